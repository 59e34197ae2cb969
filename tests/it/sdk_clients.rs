//! The client matrix (issue 25): real SDKs, at the versions pinned in tests/sdk/ and installed by
//! `scripts/install-deps.sh sdk-clients` (`make deps`), drive Envoy 1.40 + idemgate with a counting
//! upstream. Each logical call runs in its own SDK process (tests/sdk/*_call.{py,js}), which
//! reports what the SDK returned or raised and how many HTTP requests it sent, retries included.
//!
//! What must hold for every SDK: an idemgate 4xx/5xx is raised as an error, never returned as a
//! resource; the SDK retries only where idemgate says a retry can help (`stripe-should-retry`, the
//! header Stripe's SDKs read; `x-should-retry`, the one Stainless SDKs read); and each logical call executes at the upstream at most once.
//!
//! Two tests per SDK: `router_forwarding` (four scenarios on one Envoy with the plugin's default
//! forwarding) and `shipped_envoy_yaml` (the issue's five: timeout, LB 504, connection lost after
//! the answer, upstream reset, changed body, on one Envoy running envoy/envoy.yaml). Each
//! scenario uses keys of its own and counts the executions it adds; every call's outcome is a row
//! of target/sdk-clients/results.md, the table docs/clients.md shows.

use crate::support;

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
    OpenAiNode,
    AnthropicPython,
    ModernTreasuryPython,
    ModernTreasuryNode,
    OrbPython,
}

impl Sdk {
    /// Requests the SDK sends for one call answered 409 request-in-flight every time, with
    /// `retries` retries allowed: Stripe's SDKs follow `stripe-should-retry: true`; gocardless-pro
    /// retries only timeouts, connection errors and malformed responses (services/base_service.py),
    /// never an API error; the Stainless SDKs (openai, anthropic, modern-treasury, orb; Python
    /// `_should_retry` in _base_client.py, Node `shouldRetry` in client.js) follow
    /// `x-should-retry: true`.
    fn requests_for_in_flight(self, retries: u64) -> u64 {
        match self {
            Sdk::GoCardlessPython => 1,
            _ => 1 + retries,
        }
    }

    /// The SDK sends an idempotency key of its own on every POST, reused by its retries
    /// (modern-treasury and orb: `idempotency_key` / `idempotencyKey` under `Idempotency-Key`).
    fn sends_its_own_key(self) -> bool {
        matches!(self, Sdk::ModernTreasuryPython | Sdk::ModernTreasuryNode | Sdk::OrbPython)
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
        Sdk::OpenAiPython | Sdk::AnthropicPython | Sdk::ModernTreasuryPython | Sdk::OrbPython => {
            let name = match sdk {
                Sdk::OpenAiPython => "openai",
                Sdk::AnthropicPython => "anthropic",
                Sdk::OrbPython => "orb",
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
        Sdk::OpenAiNode | Sdk::ModernTreasuryNode => {
            let name = if matches!(sdk, Sdk::OpenAiNode) { "openai" } else { "modern-treasury" };
            let mut cmd = Command::new("node");
            cmd.env("SDK_NODE_DIR", root.join("target/sdk-node"))
                .arg(root.join("tests/sdk/stainless_call.js"))
                .args(["--sdk", name]);
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

/// The router-forwarding stack the first four scenarios share (one per SDK, each scenario with
/// keys of its own, so executions are counted per scenario as the upstream's count grows).
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

/// The id of the upstream's `n`th execution (its resources are `res-<n>`).
fn res(n: u64) -> String {
    format!("res-{n}")
}

/// The SDK returned the resource `id`.
fn assert_returned(r: &Value, id: &str) {
    assert_eq!((r["outcome"].as_str(), r["id"].as_str()), (Some("returned"), Some(id)), "{r}");
}

/// One row of the results table (target/sdk-clients/results.md, docs/clients.md): the SDK, the
/// scenario, what the SDK returned or raised, the requests it sent, the executions the call made.
fn record(scenario: &str, r: &Value, executions: u64) {
    let outcome = match r["outcome"].as_str() {
        Some("returned") => format!("returned `{}`", r["id"].as_str().unwrap_or("?")),
        _ => format!(
            "raised `{}` {} `{}`",
            r["error_class"].as_str().unwrap_or("?"),
            r["http_status"],
            r["error"]["code"].as_str().unwrap_or("-")
        ),
    };
    let sdk = r["sdk"].as_str().unwrap_or("?");
    support::table_row(
        "target/sdk-clients",
        "results.md",
        &[sdk, scenario, &outcome, &r["requests_sent"].to_string(), &executions.to_string()],
    );
}

/// A retry while the first call with the key is still running: 409 request-in-flight, which
/// idemgate says a retry can help with, so a Stripe SDK retries (2 retries: 3 requests) and then
/// raises; once the first call has ended, the same key returns the first call's resource.
fn in_flight_is_raised_then_the_key_replays_the_original(sdk: Sdk, up: &Upstream, port: u16) {
    let base = up.executions();
    let first = std::thread::spawn(move || {
        call(sdk, port, &Call { retries: 0, headers: &["x-up-hold: 1"], ..Call::new("sdk-in-flight") })
    });
    wait_executions(up, base + 1);
    let during = call(sdk, port, &Call::new("sdk-in-flight"));
    assert_raised(&during, 409, "request-in-flight");
    assert_eq!(during["requests_sent"], sdk.requests_for_in_flight(2), "should-retry: true: {during}");
    up.release_holds();
    let first = first.join().expect("first call");
    assert_returned(&first, &res(base + 1));
    let after = call(sdk, port, &Call::new("sdk-in-flight"));
    assert_returned(&after, &res(base + 1));
    assert_eq!(up.executions() - base, 1, "one logical call, one execution");
    record("router: retry while the first call runs (409 `request-in-flight`, 2 retries)", &during, 1);
    record("router: the same key after the first call ended", &after, 1);
}

/// The same key with another body: 422 key-reused, raised at once (no retry), nothing executed.
fn key_reused_with_another_body_is_raised(sdk: Sdk, up: &Upstream, port: u16) {
    let base = up.executions();
    let ok = call(sdk, port, &Call::new("sdk-reuse"));
    assert_returned(&ok, &res(base + 1));
    let changed = call(sdk, port, &Call { amount: 9900, ..Call::new("sdk-reuse") });
    assert_raised(&changed, 422, "key-reused");
    assert_eq!(changed["requests_sent"], 1, "should-retry: false: {changed}");
    assert_eq!(up.executions() - base, 1);
    record("router: same key, changed body", &changed, 1);
}

/// Malformed keys: 400, raised, never retried, never forwarded. A key as callers write them
/// (`run-7:step/1`, an RFC 8941 token) is accepted.
fn malformed_keys_are_raised_and_caller_keys_accepted(sdk: Sdk, up: &Upstream, port: u16) {
    let base = up.executions();
    for key in ["has space", &"k".repeat(256)] {
        let r = call(sdk, port, &Call::new(key));
        let slug = if key.len() > 255 { "key-too-long" } else { "key-not-visible-ascii" };
        assert_raised(&r, 400, slug);
        assert_eq!(r["requests_sent"], 1, "{r}");
        assert_eq!(up.executions() - base, 0);
        record(
            &format!(
                "router: malformed key (`{}`)",
                if key.len() > 255 { "k".repeat(3) + "…(256)" } else { key.to_string() }
            ),
            &r,
            0,
        );
    }
    let r = call(sdk, port, &Call::new("run-7:step/1"));
    assert_returned(&r, &res(base + 1));
    assert_eq!(up.executions() - base, 1);
    record("router: key `run-7:step/1`", &r, 1);
}

/// The upstream executes, then resets: Envoy answers 503, which the SDK retries (gocardless-pro
/// because Envoy's text body is a malformed response to it); the retry gets 409 outcome-unknown
/// with `stripe-should-retry: false`, so the SDK stops and raises (2 requests, not 1 + every retry
/// it has).
fn outcome_unknown_is_raised_and_not_retried(sdk: Sdk, up: &Upstream, port: u16) {
    let base = up.executions();
    let r = call(sdk, port, &Call { headers: &["x-up-reset: before-headers"], ..Call::new("sdk-unknown") });
    assert_raised(&r, 409, "outcome-unknown");
    assert_eq!(r["requests_sent"], 2, "the 503 is retried once, outcome-unknown is not: {r}");
    assert_eq!(up.executions() - base, 1);
    record("router: upstream executes then resets (503, then 409 `outcome-unknown`)", &r, 1);
}

/// The four router-forwarding scenarios, one after the other on one stack.
fn router_scenarios(sdk: Sdk) {
    let (up, envoy) = stack();
    in_flight_is_raised_then_the_key_replays_the_original(sdk, &up, envoy.port);
    key_reused_with_another_body_is_raised(sdk, &up, envoy.port);
    malformed_keys_are_raised_and_caller_keys_accepted(sdk, &up, envoy.port);
    outcome_unknown_is_raised_and_not_retried(sdk, &up, envoy.port);
    envoy.assert_no_wasm_panic();
}

// ---------------------------------------------------------------------------------------------
// A lost response on the shipped defaults (issue 25 item 2): envoy/envoy.yaml as users run it.
// ---------------------------------------------------------------------------------------------

/// The shipped single-proxy configuration, its ports and module path replaced.
const SHIPPED: &str = "envoy/envoy.yaml";

/// What the shipped configuration answers when the upstream executes then resets: detached
/// forwarding sees no answer to its call, so 504 upstream-no-answer (an outcome-unknown with
/// `x-should-retry: false` and `stripe-should-retry: false`); no SDK retries it.
const SHIPPED_RESET: (u16, &str) = (504, "upstream-no-answer");
const SHIPPED_RESET_REQUESTS: u64 = 1;

/// How the proxy in front of Envoy loses the answer to the first request it relays.
#[derive(Clone, Copy, Debug)]
enum Loss {
    /// A load balancer whose timeout fired: once the upstream has executed, it closes its
    /// connection to Envoy and answers 504 itself.
    GatewayTimeout,
    /// The connection to the client is lost after the upstream answered: once Envoy's first
    /// response bytes reach the proxy, it closes both connections without relaying a byte.
    DropAfterAnswer,
}

/// A proxy in front of Envoy (HTTP/1.1, one request per connection to Envoy): relays each
/// request and Envoy's answer, except the first, whose answer it loses as `loss` says.
/// `requests` counts the requests that reached it (the SDK's attempts, seen at the edge); its
/// threads end with the test process.
struct Edge {
    port: u16,
    requests: Arc<AtomicU64>,
}

impl Edge {
    fn start(backend: u16, loss: Loss, executed: impl Fn() -> bool + Send + Sync + 'static) -> Edge {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind edge");
        let port = listener.local_addr().expect("addr").port();
        let executed = Arc::new(executed);
        let requests = Arc::new(AtomicU64::new(0));
        let seen = requests.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (executed, seen) = (executed.clone(), seen.clone());
                std::thread::spawn(move || {
                    let _ = relay(conn, backend, loss, &*executed, &seen);
                });
            }
        });
        Edge { port, requests }
    }

    fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
}

/// One exchange per client connection: the request's head (its `connection` header replaced by
/// `close`) and body to Envoy, Envoy's answer back (or, for the first request, lost as `loss`
/// says), then both connections closed.
fn relay(
    client: TcpStream,
    backend: u16,
    loss: Loss,
    executed: &dyn Fn() -> bool,
    seen: &AtomicU64,
) -> std::io::Result<()> {
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
        assert!(!lower.starts_with("transfer-encoding:"), "the edge relays content-length bodies only");
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
        match loss {
            Loss::GatewayTimeout => {
                for _ in 0..3000 {
                    if executed() {
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
            Loss::DropAfterAnswer => {
                // Envoy's read timeout is its route's (30 s): its answer comes well before.
                envoy.set_read_timeout(Some(Duration::from_secs(60)))?;
                let mut first = [0u8; 1];
                let answered = crate::support::http::read_some(&mut envoy, &mut first)? == 1;
                assert!(answered && executed(), "Envoy answered after the upstream executed");
                let _ = client.shutdown(std::net::Shutdown::Both);
                return Ok(());
            }
        }
    }
    let mut answer = vec![];
    envoy.read_to_end(&mut answer)?;
    client.write_all(&answer)
}

/// The key of a shipped-config call: the SDK's own where it sends one (modern-treasury, orb:
/// its retries must reuse it for the call to end well), the caller's stable key for the others.
fn shipped_key(sdk: Sdk, key: &str) -> Option<&str> {
    if sdk.sends_its_own_key() {
        None
    } else {
        Some(key)
    }
}

/// The SDK returned the one execution's resource (`res-<base + 1>`) after retrying, every request
/// of the call with the same key, and the call executed once.
fn assert_original(r: &Value, up: &Upstream, base: u64) {
    assert_eq!(
        (r["outcome"].as_str(), r["id"].as_str()),
        (Some("returned"), Some(res(base + 1).as_str())),
        "the SDK must end holding the original object: {r}"
    );
    assert!(r["requests_sent"].as_u64().is_some_and(|n| n >= 2), "the SDK retried: {r}");
    if let Some(keys) = r["keys_sent"].as_array() {
        assert_eq!(keys.len(), 1, "every request of the call carried the same key: {r}");
    }
    assert_eq!(up.executions() - base, 1, "one logical call, one execution");
}

/// (a) The SDK times out (1 s) while the upstream takes 2 s and completes; the SDK retries with
/// the same key and must end with the original resource.
fn shipped_timeout_then_retry_returns_the_original(sdk: Sdk, up: &Upstream, port: u16) {
    let base = up.executions();
    let c = Call {
        key: shipped_key(sdk, "sdk-timeout"),
        retries: 3,
        timeout: 1.0,
        headers: &["x-up-delay-ms: 2000"],
        ..Call::new("sdk-timeout")
    };
    let r = call(sdk, port, &c);
    assert_original(&r, up, base);
    record("shipped: the SDK times out (1 s) while the upstream completes (2 s)", &r, 1);
}

/// A proxy in front of the shipped Envoy that loses the first answer as `loss` says, once this
/// scenario's call has executed.
fn edge(loss: Loss, up: &Upstream, port: u16) -> Edge {
    let (executions, base) = (up.execution_counter(), up.executions());
    Edge::start(port, loss, move || executions() > base)
}

/// (b) A load balancer in front answers 504 once the upstream has executed (the upstream takes
/// 2 s and completes); the SDK retries the 504 with the same key and must end with the original.
fn shipped_lb_504_then_retry_returns_the_original(sdk: Sdk, up: &Upstream, port: u16) {
    let base = up.executions();
    let edge = edge(Loss::GatewayTimeout, up, port);
    let c = Call {
        key: shipped_key(sdk, "sdk-504"),
        retries: 3,
        headers: &["x-up-delay-ms: 2000"],
        ..Call::new("sdk-504")
    };
    let r = call(sdk, edge.port, &c);
    assert_original(&r, up, base);
    assert_eq!(r["requests_sent"], edge.requests(), "the SDK's attempts, counted at the edge: {r}");
    record("shipped: a load balancer answers 504 once the upstream has executed", &r, 1);
}

/// (c) The response is lost between Envoy and the client after the upstream answered: a proxy in
/// front of Envoy closes the client's connection once Envoy's first response bytes reach it. The
/// SDK sees a connection error, retries with the same key and must end with the original.
fn shipped_reset_after_answer_then_retry_returns_the_original(sdk: Sdk, up: &Upstream, port: u16) {
    let base = up.executions();
    let edge = edge(Loss::DropAfterAnswer, up, port);
    let c = Call { key: shipped_key(sdk, "sdk-drop"), retries: 3, ..Call::new("sdk-drop") };
    let r = call(sdk, edge.port, &c);
    assert_original(&r, up, base);
    assert_eq!(r["requests_sent"], edge.requests(), "the SDK's attempts, counted at the edge: {r}");
    record("shipped: the connection to the client is lost after the upstream answered", &r, 1);
}

/// (d) The upstream executes, then resets the connection without answering (every attempt asks
/// it to): the outcome is unknown, so the SDK must raise an error, never return a resource, and
/// the key must never execute a second time.
fn shipped_upstream_reset_is_raised(sdk: Sdk, up: &Upstream, port: u16) {
    let base = up.executions();
    let c = Call {
        key: shipped_key(sdk, "sdk-up-reset"),
        retries: 3,
        headers: &["x-up-reset: before-headers"],
        ..Call::new("sdk-up-reset")
    };
    let r = call(sdk, port, &c);
    assert_raised(&r, SHIPPED_RESET.0, SHIPPED_RESET.1);
    assert_eq!(r["requests_sent"], SHIPPED_RESET_REQUESTS, "{r}");
    assert_eq!(up.executions() - base, 1, "one logical call, one execution");
    record("shipped: the upstream executes, then resets without answering", &r, 1);
}

/// (e) The same key with another body on the shipped configuration: 422 key-reused, raised.
fn shipped_changed_body_is_raised(sdk: Sdk, up: &Upstream, port: u16) {
    let base = up.executions();
    let ok = call(sdk, port, &Call::new("sdk-changed"));
    assert_returned(&ok, &res(base + 1));
    let changed = call(sdk, port, &Call { amount: 9900, ..Call::new("sdk-changed") });
    assert_raised(&changed, 422, "key-reused");
    assert_eq!(changed["requests_sent"], 1, "should-retry: false: {changed}");
    assert_eq!(up.executions() - base, 1);
    record("shipped: same key, changed body", &changed, 1);
}

/// The five lost-response and changed-body scenarios, one after the other on one shipped Envoy.
fn shipped_scenarios(sdk: Sdk) {
    let up = Upstream::start();
    let envoy = Shipped::start(SHIPPED, up.port);
    shipped_timeout_then_retry_returns_the_original(sdk, &up, envoy.port);
    shipped_lb_504_then_retry_returns_the_original(sdk, &up, envoy.port);
    shipped_reset_after_answer_then_retry_returns_the_original(sdk, &up, envoy.port);
    shipped_upstream_reset_is_raised(sdk, &up, envoy.port);
    shipped_changed_body_is_raised(sdk, &up, envoy.port);
    envoy.assert_no_wasm_panic();
}

/// Every scenario for one SDK, as a module of tests named after it.
macro_rules! matrix {
    ($name:ident, $sdk:ident) => {
        mod $name {
            /// In flight, changed body, malformed keys, outcome-unknown: router forwarding.
            #[test]
            fn router_forwarding() {
                super::router_scenarios(super::Sdk::$sdk);
            }

            /// Timeout, 504, reset after the answer, upstream reset, changed body: `envoy/envoy.yaml`.
            #[test]
            fn shipped_envoy_yaml() {
                super::shipped_scenarios(super::Sdk::$sdk);
            }
        }
    };
}

matrix!(stripe_python, StripePython);
matrix!(stripe_node, StripeNode);
matrix!(gocardless_python, GoCardlessPython);
matrix!(openai_python, OpenAiPython);
matrix!(openai_node, OpenAiNode);
matrix!(anthropic_python, AnthropicPython);
matrix!(modern_treasury_python, ModernTreasuryPython);
matrix!(modern_treasury_node, ModernTreasuryNode);
matrix!(orb_python, OrbPython);
