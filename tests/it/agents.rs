//! The agent's story: the response is lost on the way back, the agent retries. Driven by a real
//! retrying HTTP client (Python `requests` with urllib3's Retry: retries on timeouts, 409 and 5xx,
//! reusing its key), against Envoy 1.40 with idemgate and a counting upstream that commits each
//! execution whether or not its client is still connected.

use crate::support;

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::http::{self, Response};
use support::upstream::Upstream;
use support::{Build, Envoy, EnvoyOptions};

/// Runs the retrying agent client once; returns its JSON report.
fn agent(port: u16, key: Option<&str>, headers: &[&str], timeout_s: f64, upstream_delay_ms: u64) -> Value {
    let mut cmd = Command::new("python3");
    cmd.arg(support::repo_root().join("tests/agent_client.py"))
        .args(["--url", &format!("http://127.0.0.1:{port}/charges")])
        .args(["--timeout", &timeout_s.to_string()])
        .args(["--header", "authorization: Bearer agent-7"])
        .args(["--header", &format!("x-up-delay-ms: {upstream_delay_ms}")])
        .args(["--body", r#"{"amount":4200,"currency":"eur"}"#]);
    if let Some(k) = key {
        cmd.args(["--key", k]);
    }
    for h in headers {
        cmd.args(["--header", h]);
    }
    let out = cmd.output().expect("python3 tests/agent_client.py (make test installs requests)");
    assert!(out.status.success(), "agent client failed: {}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).expect("agent report");
    eprintln!("agent report: {report}");
    report
}

/// The first attempt, in the background: a slow request with `key`.
fn first_attempt(port: u16, key: &'static str, delay_ms: &'static str) -> std::thread::JoinHandle<Response> {
    std::thread::spawn(move || {
        let h = [("authorization", "Bearer a"), ("idempotency-key", key), ("x-up-delay-ms", delay_ms)];
        http::request(port, "POST", "/charges", &h, b"{}").unwrap()
    })
}

fn resource_id(body: &str) -> String {
    serde_json::from_str::<Value>(body).ok().and_then(|v| v["id"].as_str().map(str::to_string)).unwrap_or_default()
}

const SCOPE: &str = r#""scope": {"headers": ["authorization"]}"#;

fn stack(extra: &str) -> (Upstream, Envoy) {
    stack_with(Build::from_env(), extra)
}

fn stack_with(build: Build, extra: &str) -> (Upstream, Envoy) {
    let up = Upstream::start();
    let plugin = format!("{{{SCOPE}, \"lock_ttl_seconds\": 30{extra}}}");
    let mut o = EnvoyOptions::new(&plugin, up.port);
    o.build = build;
    let envoy = Envoy::start(&o);
    (up, envoy)
}

#[test]
fn detached_mode_gives_the_retrying_agent_the_one_executions_response() {
    detached_mode_gives_the_retrying_agent_the_one_executions_response_with(Build::from_env());
}

/// The agent's client leaves at 1 s while the upstream takes 2 s: the detached call goes on, its
/// retries get 409 until it is completed, then its replay; the upstream executes once. With
/// `build` loaded (`native_module::` runs it for both builds).
pub(crate) fn detached_mode_gives_the_retrying_agent_the_one_executions_response_with(build: Build) {
    let (up, envoy) = stack_with(
        build,
        r#", "forwarding": "detached", "upstream": {"cluster": "upstream", "hop": "direct", "timeout_ms": 10000}"#,
    );
    // Client timeout 1 s; the upstream needs 2 s.
    let report = agent(envoy.port, Some("agent-charge-1"), &[], 1.0, 2000);
    assert_eq!(report["status"], 201, "{report}");
    assert_eq!(report["replayed"], "true");
    let first_attempt = &report["attempts"][0];
    assert_eq!(first_attempt["error"], "ReadTimeoutError", "the first response was lost: {report}");
    assert_eq!(resource_id(report["body"].as_str().unwrap_or("")), "res-1", "the one execution's resource");
    assert_eq!(up.executions(), 1);
    assert_eq!(up.executions_with_key("agent-charge-1"), 1, "forwarded with its key unchanged");
    assert_eq!(envoy.stat("idemgate.detached_forwards"), 1);
    envoy.assert_no_wasm_panic();
}

#[test]
fn router_mode_executes_once_and_retries_get_outcome_unknown() {
    let (up, envoy) = stack("");
    let report = agent(envoy.port, Some("agent-charge-2"), &[], 1.0, 2000);
    assert_eq!(report["status"], 409, "{report}");
    let attempts = report["attempts"].as_array().unwrap();
    assert_eq!(attempts[0]["error"], "ReadTimeoutError");
    // A retry that reaches Envoy before it has seen the first client go away finds the first
    // attempt still running (request-in-flight); once Envoy has seen it, every retry gets
    // outcome-unknown, never an execution. How many retries come first depends on the machine,
    // so the test asserts the order, not the count.
    let problems: Vec<&str> = attempts[1..]
        .iter()
        .filter(|a| a.get("final").is_none())
        .map(|a| {
            assert_eq!(a["status"], 409, "{report}");
            a["problem"].as_str().unwrap_or("")
        })
        .collect();
    let in_flight = problems.iter().take_while(|p| **p == "urn:idemgate:problem:request-in-flight").count();
    assert!(
        problems[in_flight..].iter().all(|p| *p == "urn:idemgate:problem:outcome-unknown")
            && in_flight < problems.len(),
        "request-in-flight, then only outcome-unknown: {report}"
    );
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(up.executions(), 1);
    envoy.assert_no_wasm_panic();
}

#[test]
fn detached_mode_answers_a_client_that_stays_and_keeps_set_cookie_for_it_only() {
    let (up, envoy) = stack(
        r#", "forwarding": "detached", "upstream": {"cluster": "upstream", "hop": "direct", "timeout_ms": 5000}"#,
    );
    let h = [("authorization", "Bearer a"), ("idempotency-key", "k-stay"), ("x-up-set-cookie", "1")];
    let first = http::request(envoy.port, "POST", "/charges", &h, b"{}").unwrap();
    assert_eq!(first.status, 201);
    assert!(first.header("set-cookie").is_some());
    assert_eq!(first.header("location"), Some("/resources/res-1"));
    let again = http::request(envoy.port, "POST", "/charges", &h, b"{}").unwrap();
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert!(again.header("set-cookie").is_none());
    assert_eq!(up.executions(), 1);
}

#[test]
fn detached_mode_never_lets_a_clients_retry_headers_re_send_the_request() {
    // Internal clients keep their x-envoy-* headers; the callout idemgate makes would honour them.
    let up = Upstream::start();
    let plugin = format!(
        r#"{{{SCOPE}, "lock_ttl_seconds": 30, "forwarding": "detached", "upstream": {{"cluster": "upstream", "hop": "direct", "timeout_ms": 5000}}}}"#
    );
    let mut o = EnvoyOptions::new(&plugin, up.port);
    o.internal_clients = true;
    let envoy = Envoy::start(&o);
    let h = [
        ("authorization", "Bearer a"),
        ("idempotency-key", "k-detached-retry"),
        ("x-up-status", "503"),
        ("x-envoy-retry-on", "5xx"),
        ("x-envoy-max-retries", "3"),
    ];
    let first = http::request(envoy.port, "POST", "/charges", &h, b"{}").unwrap();
    assert_eq!(first.status, 503, "{}", first.body_text());
    assert_eq!(up.executions(), 1, "the detached callout was re-sent");
    let again = http::request(envoy.port, "POST", "/charges", &h, b"{}").unwrap();
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(up.executions(), 1);
    envoy.assert_no_wasm_panic();
}

#[test]
fn detached_mode_upstream_silence_is_outcome_unknown() {
    let (up, envoy) =
        stack(r#", "forwarding": "detached", "upstream": {"cluster": "upstream", "hop": "direct", "timeout_ms": 500}"#);
    let h = [("authorization", "Bearer a"), ("idempotency-key", "k-silent"), ("x-up-delay-ms", "1500")];
    let first = http::request(envoy.port, "POST", "/charges", &h, b"{}").unwrap();
    assert_eq!(first.status, 504, "{}", first.body_text());
    let again = http::request(envoy.port, "POST", "/charges", &h, b"{}").unwrap();
    assert_eq!(again.status, 409);
    assert_eq!(again.json()["type"], "urn:idemgate:problem:outcome-unknown");
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(up.executions(), 1);
}

/// A retry sent while the first attempt runs waits for it and gets its replay, never a 409; the
/// upstream executes once. With `build` loaded (`native_module::` runs it for both builds).
pub(crate) fn wait_mode_gives_a_concurrent_retry_the_replay_instead_of_a_409(build: Build) {
    let (up, envoy) = stack_with(build, r#", "in_flight": "wait", "wait_ms": 5000"#);
    let port = envoy.port;
    let first = first_attempt(port, "k-wait", "1000");
    std::thread::sleep(Duration::from_millis(200));
    let started = std::time::Instant::now();
    let h = [("authorization", "Bearer a"), ("idempotency-key", "k-wait")];
    let retry = http::request(port, "POST", "/charges", &h, b"{}").unwrap();
    let waited = started.elapsed();
    let first = first.join().unwrap();
    assert_eq!(retry.status, 201, "{build:?}: {}", retry.body_text());
    assert_eq!(retry.header("idempotent-replayed"), Some("true"), "{build:?}");
    assert_eq!(retry.body, first.body, "{build:?}");
    assert!(waited >= Duration::from_millis(600), "{build:?}: held until the first attempt finished ({waited:?})");
    assert_eq!(up.executions(), 1, "{build:?}");
    assert_eq!(envoy.stat("idemgate.in_flight_conflict"), 0, "{build:?}: no 409 at all");
    assert_eq!(envoy.stat("idemgate.waited"), 1, "{build:?}");
}

#[test]
fn wait_mode_answers_409_when_the_first_attempt_outlasts_wait_ms() {
    let (up, envoy) = stack(r#", "in_flight": "wait", "wait_ms": 300"#);
    let port = envoy.port;
    // The first attempt lasts 3 s: an answer at wait_ms (300 ms) is told from one at its end
    // with 2 s to spare on a loaded machine.
    let first = first_attempt(port, "k-wait2", "3000");
    std::thread::sleep(Duration::from_millis(200));
    let started = std::time::Instant::now();
    let retry = http::request(
        port,
        "POST",
        "/charges",
        &[("authorization", "Bearer a"), ("idempotency-key", "k-wait2")],
        b"{}",
    )
    .unwrap();
    assert_eq!(retry.status, 409, "{}", retry.body_text());
    assert!(retry.header("retry-after").is_some());
    assert!(started.elapsed() < Duration::from_millis(2500), "answered at wait_ms, not at the end");
    // A waiting retry with another body is told so once the first completes.
    assert_eq!(first.join().unwrap().status, 201);
    assert_eq!(up.executions(), 1);
}

#[test]
fn many_waiting_retries_neither_spin_nor_execute() {
    let (up, envoy) = stack(r#", "in_flight": "wait", "wait_ms": 5000"#);
    let port = envoy.port;
    let first = first_attempt(port, "k-many", "1500");
    std::thread::sleep(Duration::from_millis(200));
    let cpu_before = process_cpu_ticks(&envoy);
    let waiters: Vec<_> = (0..30)
        .map(|_| {
            std::thread::spawn(move || {
                http::request(
                    port,
                    "POST",
                    "/charges",
                    &[("authorization", "Bearer a"), ("idempotency-key", "k-many")],
                    b"{}",
                )
                .unwrap()
            })
        })
        .collect();
    let answers: Vec<Response> = waiters.into_iter().map(|t| t.join().unwrap()).collect();
    let cpu_used = process_cpu_ticks(&envoy) - cpu_before;
    first.join().unwrap();
    assert!(answers.iter().all(|r| r.status == 201 && r.header("idempotent-replayed") == Some("true")));
    assert_eq!(up.executions(), 1);
    // 30 requests held ~1.3 s: a tight loop would burn over a second of CPU; polling every 100 ms
    // costs a few hundredths.
    assert!(cpu_used < 50, "Envoy used {cpu_used} CPU ticks (1/100 s) while 30 requests waited");
}

/// utime + stime of the Envoy process, in clock ticks (1/100 s).
fn process_cpu_ticks(envoy: &Envoy) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", envoy.pid())).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    fields.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
        + fields.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
}

#[test]
fn derived_keys_execute_an_agent_step_once_and_a_new_step_again() {
    let (up, envoy) = stack(r#", "derive_key": {"headers": ["x-agent-task-id", "x-agent-step-id"]}"#);
    let step = |s: &str| {
        let h = [("authorization", "Bearer a"), ("x-agent-task-id", "task-9"), ("x-agent-step-id", s)];
        http::request(envoy.port, "POST", "/charges", &h, b"{\"amount\":1}").unwrap()
    };
    let a = step("step-1");
    let b = step("step-1");
    assert_eq!(a.status, 201);
    assert_eq!(b.header("idempotent-replayed"), Some("true"));
    assert_eq!(b.body, a.body);
    assert_eq!(up.executions(), 1);
    let forwarded_key = up.log()[0].key.clone().expect("the derived key is forwarded upstream");
    assert!(forwarded_key.starts_with("derived-"), "{forwarded_key}");
    let c = step("step-2");
    assert!(c.header("idempotent-replayed").is_none());
    assert_eq!(up.executions(), 2);
    // Without the step header nothing is derived: the request passes unprotected.
    http::request(
        envoy.port,
        "POST",
        "/charges",
        &[("authorization", "Bearer a"), ("x-agent-task-id", "task-9")],
        b"{}",
    )
    .unwrap();
    http::request(
        envoy.port,
        "POST",
        "/charges",
        &[("authorization", "Bearer a"), ("x-agent-task-id", "task-9")],
        b"{}",
    )
    .unwrap();
    assert_eq!(up.executions(), 4);
    assert!(envoy.log().contains("key_source=derived") || envoy.stat("idemgate.derived_keys") >= 2);
}

#[test]
fn the_retrying_agent_with_derived_keys_recovers_its_lost_response_in_detached_mode() {
    let (up, envoy) = stack(
        r#", "forwarding": "detached", "upstream": {"cluster": "upstream", "hop": "direct", "timeout_ms": 10000},
           "derive_key": {"headers": ["x-agent-task-id", "x-agent-step-id"], "include_body": true}"#,
    );
    let report = agent(envoy.port, None, &["x-agent-task-id: t-1", "x-agent-step-id: s-1"], 1.0, 2000);
    assert_eq!(report["status"], 201, "{report}");
    assert_eq!(resource_id(report["body"].as_str().unwrap_or("")), "res-1");
    assert_eq!(up.executions(), 1);
}

#[test]
fn detached_mode_a_response_beyond_envoys_async_client_limit_is_outcome_unknown() {
    // Envoy 1.40's async client keeps at most 32 MiB of a callout's response body; beyond that it
    // drains the rest and hands the filter no response at all. The upstream did execute.
    let (up, envoy) = stack(
        r#", "forwarding": "detached", "upstream": {"cluster": "upstream", "hop": "direct", "timeout_ms": 20000}"#,
    );
    let limit = (32 * 1024 * 1024).to_string();
    let over = (33 * 1024 * 1024).to_string();
    let send = |key: &str, size: &str| {
        let h = [("authorization", "Bearer a"), ("idempotency-key", key), ("x-up-body-bytes", size)];
        http::request(envoy.port, "POST", "/charges", &h, b"{}").unwrap()
    };
    let at = send("k-32mib", &limit);
    assert_eq!((at.status, at.body.len()), (201, 32 * 1024 * 1024), "32 MiB still comes through");
    let first = send("k-33mib", &over);
    assert_eq!(first.status, 504, "{}", first.body_text());
    assert_eq!(first.json()["type"], "urn:idemgate:problem:upstream-no-answer");
    let again = send("k-33mib", &over);
    assert_eq!(again.status, 409);
    assert_eq!(again.json()["type"], "urn:idemgate:problem:outcome-unknown");
    assert_eq!(up.executions(), 2, "each executed once, the retry never");
    // Envoy's async client keeps the bound for the Wasm build's callout; the native build's
    // configuration stream keeps the same bound in the glue (docs/native.md).
    let said = match support::Build::from_env() {
        support::Build::Wasm => "buffer size limit for async client response body",
        support::Build::Native => "detached answer beyond the async client's response limit (33554432 bytes)",
    };
    assert!(envoy.log().contains(said), "{}", envoy.log());
    envoy.assert_no_wasm_panic();
}
