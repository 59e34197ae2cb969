//! The client matrix (issue 25): real SDKs, at the versions pinned in tests/sdk/ and installed by
//! `scripts/install-deps.sh sdk-clients` (`make deps`), drive Envoy 1.40 + idemgate with a counting
//! upstream. Each logical call runs in its own SDK process (tests/sdk/*_call.{py,js}), which
//! reports what the SDK returned or raised and how many HTTP requests it sent, retries included.
//!
//! What must hold for every SDK: an idemgate 4xx/5xx is raised as an error, never returned as a
//! resource; the SDK retries only where idemgate says a retry can help (`stripe-should-retry`, the
//! header Stripe's SDKs read; `x-should-retry`, the one Stainless SDKs read); and each logical call executes at the upstream at most once.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions, Shipped};

#[derive(Clone, Copy, Debug)]
enum Sdk {
    StripePython,
    StripeNode,
    GoCardlessPython,
    OpenAiPython,
    AnthropicPython,
    ModernTreasuryPython,
}

impl Sdk {
    /// Requests the SDK sends for one call answered 409 request-in-flight every time, with
    /// `retries` retries allowed: Stripe's SDKs follow `stripe-should-retry: true`; gocardless-pro
    /// retries only timeouts, connection errors and malformed responses (services/base_service.py),
    /// never an API error; the Stainless SDKs (openai, anthropic, modern-treasury) follow
    /// `x-should-retry: true`.
    fn requests_for_in_flight(self, retries: u64) -> u64 {
        match self {
            Sdk::StripePython | Sdk::StripeNode => 1 + retries,
            Sdk::GoCardlessPython => 1,
            // Stainless SDKs (`_should_retry` in their _base_client.py) follow `x-should-retry`.
            Sdk::OpenAiPython | Sdk::AnthropicPython | Sdk::ModernTreasuryPython => 1 + retries,
        }
    }
}

/// One logical call: `POST /v1/payment_intents` through the SDK.
struct Call<'a> {
    key: Option<&'a str>,
    amount: u32,
    retries: u32,
    /// The SDK's own request timeout, seconds.
    timeout: f64,
    headers: &'a [&'a str],
}

impl<'a> Call<'a> {
    fn new(key: &'a str) -> Call<'a> {
        Call { key: Some(key), amount: 4200, retries: 2, timeout: 60.0, headers: &[] }
    }
}

fn command(sdk: Sdk, port: u16, c: &Call) -> Command {
    let root = support::repo_root();
    let mut cmd = match sdk {
        Sdk::StripePython => {
            let mut cmd = Command::new(root.join("target/sdk-venv/bin/python"));
            cmd.arg(root.join("tests/sdk/stripe_call.py"));
            cmd
        }
        Sdk::GoCardlessPython => {
            let mut cmd = Command::new(root.join("target/sdk-venv/bin/python"));
            cmd.arg(root.join("tests/sdk/gocardless_call.py"));
            cmd
        }
        Sdk::OpenAiPython | Sdk::AnthropicPython | Sdk::ModernTreasuryPython => {
            let name = match sdk {
                Sdk::OpenAiPython => "openai",
                Sdk::AnthropicPython => "anthropic",
                _ => "modern-treasury",
            };
            let mut cmd = Command::new(root.join("target/sdk-venv/bin/python"));
            cmd.arg(root.join("tests/sdk/stainless_call.py")).args(["--sdk", name]);
            cmd
        }
        Sdk::StripeNode => {
            let mut cmd = Command::new("node");
            cmd.env("SDK_NODE_DIR", root.join("target/sdk-node")).arg(root.join("tests/sdk/stripe_call.js"));
            cmd
        }
    };
    cmd.args(["--base", &format!("http://127.0.0.1:{port}")])
        .args(["--amount", &c.amount.to_string()])
        .args(["--retries", &c.retries.to_string()])
        .args(["--timeout", &c.timeout.to_string()]);
    if let Some(k) = c.key {
        cmd.args(["--key", k]);
    }
    for h in c.headers {
        cmd.args(["--header", h]);
    }
    cmd
}

fn report(sdk: Sdk, out: std::process::Output) -> Value {
    assert!(
        out.status.success(),
        "{sdk:?} call failed (make deps installs the SDKs: scripts/install-deps.sh sdk-clients): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).expect("SDK call report");
    eprintln!("{sdk:?}: {r}");
    r
}

fn call(sdk: Sdk, port: u16, c: &Call) -> Value {
    report(sdk, command(sdk, port, c).output().expect("SDK call"))
}

/// The SDK raised an idemgate error with this status and problem slug (the `error.code` the SDK
/// read), never returning it as a resource.
fn assert_raised(r: &Value, status: u16, slug: &str) {
    assert_eq!(r["outcome"], "raised", "the SDK must raise, not return the problem as a resource: {r}");
    assert_eq!(r["http_status"], status, "{r}");
    assert_eq!(r["error"]["code"], slug, "{r}");
    assert_eq!(r["error"]["type"].as_str().map(str::is_empty), Some(false), "{r}");
    assert!(r["error"]["message"].as_str().is_some_and(|m| m.len() > 20), "{r}");
}

fn stack() -> (Upstream, Envoy) {
    let up = Upstream::start();
    let plugin = r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 30}"#;
    // The held first call outlives the second call's process start and its retries (anthropic's
    // import alone takes seconds on a loaded machine): a route timeout far above them.
    let envoy = Envoy::start(&EnvoyOptions { route_timeout_ms: 60_000, ..EnvoyOptions::new(plugin, up.port) });
    (up, envoy)
}

/// Waits (bounded by count, 60 s at most) until the upstream has executed `n` requests.
fn wait_executions(up: &Upstream, n: u64) {
    for _ in 0..3000 {
        if up.executions() >= n {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the upstream never reached {n} executions");
}

/// A retry while the first call with the key is still running: 409 request-in-flight, which
/// idemgate says a retry can help with, so a Stripe SDK retries (2 retries: 3 requests) and then
/// raises; once the first call has ended, the same key returns the first call's resource.
fn in_flight_is_raised_then_the_key_replays_the_original(sdk: Sdk) {
    let (up, envoy) = stack();
    let port = envoy.port;
    let first = std::thread::spawn(move || {
        call(sdk, port, &Call { retries: 0, headers: &["x-up-hold: 1"], ..Call::new("sdk-in-flight") })
    });
    wait_executions(&up, 1);
    let during = call(sdk, port, &Call::new("sdk-in-flight"));
    assert_raised(&during, 409, "request-in-flight");
    assert_eq!(during["requests_sent"], sdk.requests_for_in_flight(2), "stripe-should-retry: true: {during}");
    up.release_holds();
    let first = first.join().unwrap();
    assert_eq!((first["outcome"].as_str(), first["id"].as_str()), (Some("returned"), Some("res-1")), "{first}");
    let after = call(sdk, port, &Call::new("sdk-in-flight"));
    assert_eq!((after["outcome"].as_str(), after["id"].as_str()), (Some("returned"), Some("res-1")), "{after}");
    assert_eq!(up.executions(), 1, "one logical call, one execution");
    envoy.assert_no_wasm_panic();
}

/// The same key with another body: 422 key-reused, raised at once (no retry), nothing executed.
fn key_reused_with_another_body_is_raised(sdk: Sdk) {
    let (up, envoy) = stack();
    let ok = call(sdk, envoy.port, &Call::new("sdk-reuse"));
    assert_eq!((ok["outcome"].as_str(), ok["id"].as_str()), (Some("returned"), Some("res-1")), "{ok}");
    let changed = call(sdk, envoy.port, &Call { amount: 9900, ..Call::new("sdk-reuse") });
    assert_raised(&changed, 422, "key-reused");
    assert_eq!(changed["requests_sent"], 1, "should-retry: false: {changed}");
    assert_eq!(up.executions(), 1);
    envoy.assert_no_wasm_panic();
}

/// Malformed keys: 400, raised, never retried, never forwarded. A key as callers write them
/// (`run-7:step/1`, an RFC 8941 token) is accepted.
fn malformed_keys_are_raised_and_caller_keys_accepted(sdk: Sdk) {
    let (up, envoy) = stack();
    for key in ["has space", &"k".repeat(256)] {
        let r = call(sdk, envoy.port, &Call::new(key));
        let slug = if key.len() > 255 { "key-too-long" } else { "key-not-visible-ascii" };
        assert_raised(&r, 400, slug);
        assert_eq!(r["requests_sent"], 1, "{r}");
    }
    assert_eq!(up.executions(), 0);
    let r = call(sdk, envoy.port, &Call::new("run-7:step/1"));
    assert_eq!((r["outcome"].as_str(), r["id"].as_str()), (Some("returned"), Some("res-1")), "{r}");
    assert_eq!(up.executions(), 1);
    envoy.assert_no_wasm_panic();
}

/// The upstream executes, then resets: Envoy answers 503, which the SDK retries (gocardless-pro
/// because Envoy's text body is a malformed response to it); the retry gets 409 outcome-unknown
/// with `stripe-should-retry: false`, so the SDK stops and raises (2 requests, not 1 + every retry
/// it has).
fn outcome_unknown_is_raised_and_not_retried(sdk: Sdk) {
    let (up, envoy) = stack();
    let r = call(sdk, envoy.port, &Call { headers: &["x-up-reset: before-headers"], ..Call::new("sdk-unknown") });
    assert_raised(&r, 409, "outcome-unknown");
    assert_eq!(r["requests_sent"], 2, "the 503 is retried once, outcome-unknown is not: {r}");
    assert_eq!(up.executions(), 1);
    envoy.assert_no_wasm_panic();
}

#[test]
fn stripe_python_in_flight_is_raised_then_the_key_replays_the_original() {
    in_flight_is_raised_then_the_key_replays_the_original(Sdk::StripePython);
}

#[test]
fn stripe_python_key_reused_with_another_body_is_raised() {
    key_reused_with_another_body_is_raised(Sdk::StripePython);
}

#[test]
fn stripe_python_malformed_keys_are_raised_and_caller_keys_accepted() {
    malformed_keys_are_raised_and_caller_keys_accepted(Sdk::StripePython);
}

#[test]
fn stripe_python_outcome_unknown_is_raised_and_not_retried() {
    outcome_unknown_is_raised_and_not_retried(Sdk::StripePython);
}

#[test]
fn stripe_node_in_flight_is_raised_then_the_key_replays_the_original() {
    in_flight_is_raised_then_the_key_replays_the_original(Sdk::StripeNode);
}

#[test]
fn stripe_node_key_reused_with_another_body_is_raised() {
    key_reused_with_another_body_is_raised(Sdk::StripeNode);
}

#[test]
fn stripe_node_malformed_keys_are_raised_and_caller_keys_accepted() {
    malformed_keys_are_raised_and_caller_keys_accepted(Sdk::StripeNode);
}

#[test]
fn stripe_node_outcome_unknown_is_raised_and_not_retried() {
    outcome_unknown_is_raised_and_not_retried(Sdk::StripeNode);
}

#[test]
fn gocardless_python_in_flight_is_raised_then_the_key_replays_the_original() {
    in_flight_is_raised_then_the_key_replays_the_original(Sdk::GoCardlessPython);
}

#[test]
fn gocardless_python_key_reused_with_another_body_is_raised() {
    key_reused_with_another_body_is_raised(Sdk::GoCardlessPython);
}

#[test]
fn gocardless_python_malformed_keys_are_raised_and_caller_keys_accepted() {
    malformed_keys_are_raised_and_caller_keys_accepted(Sdk::GoCardlessPython);
}

#[test]
fn gocardless_python_outcome_unknown_is_raised_and_not_retried() {
    outcome_unknown_is_raised_and_not_retried(Sdk::GoCardlessPython);
}

// ---------------------------------------------------------------------------------------------
// A lost response on the shipped defaults (issue 25 item 2): envoy/envoy.yaml as users run it.
// ---------------------------------------------------------------------------------------------

/// The shipped single-proxy configuration, its ports and module path replaced.
const SHIPPED: &str = "envoy/envoy.yaml";

/// A load balancer in front of Envoy (HTTP/1.1, one request per connection to Envoy): relays
/// each request and Envoy's answer, except the first, which it answers 504 as soon as the
/// upstream has executed it, closing its connection to Envoy as an LB whose timeout fired does.
/// Returns its port; its threads end with the test process.
fn gateway_timeout_once(backend: u16, executions: impl Fn() -> u64 + Send + Sync + 'static) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind lb");
    let port = listener.local_addr().expect("addr").port();
    let executions = Arc::new(executions);
    let seen = Arc::new(AtomicU64::new(0));
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let (executions, seen) = (executions.clone(), seen.clone());
            std::thread::spawn(move || {
                let _ = relay(conn, backend, &*executions, &seen);
            });
        }
    });
    port
}

/// One exchange per client connection: the request's head (its `connection` header replaced by
/// `close`) and body to Envoy, Envoy's answer (or the 504) back, then both connections closed.
fn relay(client: TcpStream, backend: u16, executions: &dyn Fn() -> u64, seen: &AtomicU64) -> std::io::Result<()> {
    let mut reader = BufReader::new(client.try_clone()?);
    let mut client = client;
    let mut head = String::new();
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        if line == "\r\n" {
            break;
        }
        let lower = line.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
        assert!(!lower.starts_with("transfer-encoding:"), "the LB relays content-length bodies only");
        if !lower.starts_with("connection:") {
            head.push_str(&line);
        }
    }
    head.push_str("connection: close\r\n\r\n");
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    let mut envoy = TcpStream::connect(("127.0.0.1", backend))?;
    envoy.write_all(head.as_bytes())?;
    envoy.write_all(&body)?;
    if seen.fetch_add(1, Ordering::SeqCst) == 0 {
        for _ in 0..3000 {
            if executions() >= 1 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(envoy);
        let text = "upstream request timeout";
        let answer = format!(
            "HTTP/1.1 504 Gateway Timeout\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
            text.len()
        );
        return client.write_all(answer.as_bytes());
    }
    let mut answer = vec![];
    envoy.read_to_end(&mut answer)?;
    client.write_all(&answer)
}

/// The key of a shipped-config call: modern-treasury's own (it sends one per call, which its
/// retries must reuse for the call to end well), the caller's stable key for the others.
fn shipped_key(sdk: Sdk, key: &str) -> Option<&str> {
    match sdk {
        Sdk::ModernTreasuryPython => None,
        _ => Some(key),
    }
}

/// The SDK returned the one execution's resource.
fn assert_original(r: &Value, up: &Upstream) {
    assert_eq!(
        (r["outcome"].as_str(), r["id"].as_str()),
        (Some("returned"), Some("res-1")),
        "the SDK must end holding the original object: {r}"
    );
    assert!(r["requests_sent"].as_u64().is_some_and(|n| n >= 2), "the SDK retried: {r}");
    if let Some(keys) = r["keys_sent"].as_array() {
        assert_eq!(keys.len(), 1, "every request of the call carried the same key: {r}");
    }
    assert_eq!(up.executions(), 1, "one logical call, one execution");
}

/// (a) The SDK times out (1 s) while the upstream takes 2 s and completes; the SDK retries with
/// the same key and must end with the original resource.
fn shipped_timeout_then_retry_returns_the_original(sdk: Sdk) {
    let up = Upstream::start();
    let envoy = Shipped::start(SHIPPED, up.port);
    let r = call(
        sdk,
        envoy.port,
        &Call {
            key: shipped_key(sdk, "sdk-timeout"),
            retries: 3,
            timeout: 1.0,
            headers: &["x-up-delay-ms: 2000"],
            ..Call::new("sdk-timeout")
        },
    );
    assert_original(&r, &up);
    envoy.assert_no_wasm_panic();
}

/// (b) A load balancer in front answers 504 once the upstream has executed (the upstream takes
/// 2 s and completes); the SDK retries the 504 with the same key and must end with the original.
fn shipped_lb_504_then_retry_returns_the_original(sdk: Sdk) {
    let up = Upstream::start();
    let envoy = Shipped::start(SHIPPED, up.port);
    let lb = gateway_timeout_once(envoy.port, up.execution_counter());
    let c = Call {
        key: shipped_key(sdk, "sdk-504"),
        retries: 3,
        headers: &["x-up-delay-ms: 2000"],
        ..Call::new("sdk-504")
    };
    let r = call(sdk, lb, &c);
    assert_original(&r, &up);
    envoy.assert_no_wasm_panic();
}

/// (c) The same key with another body on the shipped configuration: 422 key-reused, raised.
fn shipped_changed_body_is_raised(sdk: Sdk) {
    let up = Upstream::start();
    let envoy = Shipped::start(SHIPPED, up.port);
    let ok = call(sdk, envoy.port, &Call::new("sdk-changed"));
    assert_eq!((ok["outcome"].as_str(), ok["id"].as_str()), (Some("returned"), Some("res-1")), "{ok}");
    let changed = call(sdk, envoy.port, &Call { amount: 9900, ..Call::new("sdk-changed") });
    assert_raised(&changed, 422, "key-reused");
    assert_eq!(changed["requests_sent"], 1, "should-retry: false: {changed}");
    assert_eq!(up.executions(), 1);
    envoy.assert_no_wasm_panic();
}

#[test]
fn shipped_stripe_python_timeout_then_retry_returns_the_original() {
    shipped_timeout_then_retry_returns_the_original(Sdk::StripePython);
}

#[test]
fn shipped_stripe_python_lb_504_then_retry_returns_the_original() {
    shipped_lb_504_then_retry_returns_the_original(Sdk::StripePython);
}

#[test]
fn shipped_stripe_python_changed_body_is_raised() {
    shipped_changed_body_is_raised(Sdk::StripePython);
}

#[test]
fn shipped_stripe_node_timeout_then_retry_returns_the_original() {
    shipped_timeout_then_retry_returns_the_original(Sdk::StripeNode);
}

#[test]
fn shipped_stripe_node_lb_504_then_retry_returns_the_original() {
    shipped_lb_504_then_retry_returns_the_original(Sdk::StripeNode);
}

#[test]
fn shipped_stripe_node_changed_body_is_raised() {
    shipped_changed_body_is_raised(Sdk::StripeNode);
}

#[test]
fn shipped_gocardless_python_timeout_then_retry_returns_the_original() {
    shipped_timeout_then_retry_returns_the_original(Sdk::GoCardlessPython);
}

#[test]
fn shipped_gocardless_python_lb_504_then_retry_returns_the_original() {
    shipped_lb_504_then_retry_returns_the_original(Sdk::GoCardlessPython);
}

#[test]
fn shipped_gocardless_python_changed_body_is_raised() {
    shipped_changed_body_is_raised(Sdk::GoCardlessPython);
}

#[test]
fn openai_python_in_flight_is_raised_then_the_key_replays_the_original() {
    in_flight_is_raised_then_the_key_replays_the_original(Sdk::OpenAiPython);
}

#[test]
fn openai_python_key_reused_with_another_body_is_raised() {
    key_reused_with_another_body_is_raised(Sdk::OpenAiPython);
}

#[test]
fn openai_python_malformed_keys_are_raised_and_caller_keys_accepted() {
    malformed_keys_are_raised_and_caller_keys_accepted(Sdk::OpenAiPython);
}

#[test]
fn openai_python_outcome_unknown_is_raised_and_not_retried() {
    outcome_unknown_is_raised_and_not_retried(Sdk::OpenAiPython);
}

#[test]
fn shipped_openai_python_timeout_then_retry_returns_the_original() {
    shipped_timeout_then_retry_returns_the_original(Sdk::OpenAiPython);
}

#[test]
fn shipped_openai_python_lb_504_then_retry_returns_the_original() {
    shipped_lb_504_then_retry_returns_the_original(Sdk::OpenAiPython);
}

#[test]
fn shipped_openai_python_changed_body_is_raised() {
    shipped_changed_body_is_raised(Sdk::OpenAiPython);
}

#[test]
fn anthropic_python_in_flight_is_raised_then_the_key_replays_the_original() {
    in_flight_is_raised_then_the_key_replays_the_original(Sdk::AnthropicPython);
}

#[test]
fn anthropic_python_key_reused_with_another_body_is_raised() {
    key_reused_with_another_body_is_raised(Sdk::AnthropicPython);
}

#[test]
fn anthropic_python_malformed_keys_are_raised_and_caller_keys_accepted() {
    malformed_keys_are_raised_and_caller_keys_accepted(Sdk::AnthropicPython);
}

#[test]
fn anthropic_python_outcome_unknown_is_raised_and_not_retried() {
    outcome_unknown_is_raised_and_not_retried(Sdk::AnthropicPython);
}

#[test]
fn shipped_anthropic_python_timeout_then_retry_returns_the_original() {
    shipped_timeout_then_retry_returns_the_original(Sdk::AnthropicPython);
}

#[test]
fn shipped_anthropic_python_lb_504_then_retry_returns_the_original() {
    shipped_lb_504_then_retry_returns_the_original(Sdk::AnthropicPython);
}

#[test]
fn shipped_anthropic_python_changed_body_is_raised() {
    shipped_changed_body_is_raised(Sdk::AnthropicPython);
}

#[test]
fn modern_treasury_python_in_flight_is_raised_then_the_key_replays_the_original() {
    in_flight_is_raised_then_the_key_replays_the_original(Sdk::ModernTreasuryPython);
}

#[test]
fn modern_treasury_python_key_reused_with_another_body_is_raised() {
    key_reused_with_another_body_is_raised(Sdk::ModernTreasuryPython);
}

#[test]
fn modern_treasury_python_malformed_keys_are_raised_and_caller_keys_accepted() {
    malformed_keys_are_raised_and_caller_keys_accepted(Sdk::ModernTreasuryPython);
}

#[test]
fn modern_treasury_python_outcome_unknown_is_raised_and_not_retried() {
    outcome_unknown_is_raised_and_not_retried(Sdk::ModernTreasuryPython);
}

#[test]
fn shipped_modern_treasury_python_timeout_then_retry_returns_the_original() {
    shipped_timeout_then_retry_returns_the_original(Sdk::ModernTreasuryPython);
}

#[test]
fn shipped_modern_treasury_python_lb_504_then_retry_returns_the_original() {
    shipped_lb_504_then_retry_returns_the_original(Sdk::ModernTreasuryPython);
}

#[test]
fn shipped_modern_treasury_python_changed_body_is_raised() {
    shipped_changed_body_is_raised(Sdk::ModernTreasuryPython);
}
