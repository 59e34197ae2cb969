//! Fail closed (issue 13, items 4 and 5): a branch of the filter that meets one of its own
//! invariants broken answers 503 `internal-state` and never forwards; a claim that lands in the
//! store after its owner-checked release cannot block its key.
//!
//! The invariants are broken on purpose by the test-only module (`--crash-injection`, trigger
//! `x-idemgate-test-fault`), which the shipped module does not carry.

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use support::http::{self, Response};
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions};

const LOCAL: &str = r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 30}"#;
const FAULT: &str = "x-idemgate-test-fault";

fn post(port: u16, key: &str, body: &str, extra: &[(&str, &str)]) -> Response {
    let mut h: Vec<(&str, &str)> = vec![("authorization", "Bearer alice"), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    http::request_timeout(port, "POST", "/charges", &h, body.as_bytes(), Duration::from_secs(10)).expect("request")
}

fn problem_type(r: &Response) -> String {
    r.json()["type"].as_str().unwrap_or("").to_string()
}

/// The test-only module that breaks invariants on demand (built once per test run).
fn fault_module() -> PathBuf {
    static BUILT: Mutex<bool> = Mutex::new(false);
    let mut built = BUILT.lock().unwrap();
    let path = support::repo_root().join("dist/idemgate-crash.wasm");
    if !*built {
        let out = Command::new("scripts/build-wasm.sh")
            .arg("--crash-injection")
            .current_dir(support::repo_root())
            .output()
            .expect("build the crash-injection module");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        *built = true;
    }
    path
}

fn fault_envoy(up: &Upstream) -> Envoy {
    let mut o = EnvoyOptions::new(LOCAL, up.port);
    o.wasm = Some(fault_module());
    o.concurrency = 1;
    Envoy::start(&o)
}

#[test]
fn fail_closed_the_shipped_module_has_no_fault_trigger() {
    let shipped = std::fs::read(support::wasm_path()).expect("dist/idemgate.wasm");
    let test_build = std::fs::read(fault_module()).expect("fault module");
    let needle = FAULT.as_bytes();
    assert!(test_build.windows(needle.len()).any(|w| w == needle), "the test build must carry the trigger");
    assert!(!shipped.windows(needle.len()).any(|w| w == needle), "the shipped module carries the test trigger");
}

/// Asserts the refusal: 503 `internal-state` with `retry-after`, nothing executed, counted and logged.
fn assert_refused(e: &Envoy, up: &Upstream, r: &Response, branch: &str) {
    assert_eq!(up.executions(), 0, "executions {} != 0: a broken invariant forwarded the request", up.executions());
    assert_eq!((r.status, problem_type(r).as_str()), (503, "urn:idemgate:problem:internal-state"), "{}", r.body_text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(e.stat("idemgate.internal_errors"), 1);
    assert!(e.log().contains(&format!("branch={branch}")), "no log line names the branch {branch}");
}

#[test]
fn fail_closed_a_policy_lost_while_the_body_arrives_is_refused_and_frees_the_key() {
    let up = Upstream::start();
    let e = fault_envoy(&up);
    let r = post(e.port, "k-lost-body", "{\"a\":1}", &[(FAULT, "policy-lost-at-body")]);
    assert_refused(&e, &up, &r, "request_body");
    // It never left: the local claim made at headers was released, so the retry executes once.
    let retry = post(e.port, "k-lost-body", "{\"a\":1}", &[]);
    assert_eq!(retry.status, 201, "{}", retry.body_text());
    assert_eq!(post(e.port, "k-lost-body", "{\"a\":1}", &[]).header("idempotent-replayed"), Some("true"));
    assert_eq!(up.executions(), 1);
}

#[test]
fn fail_closed_a_policy_lost_on_a_request_without_body_is_refused() {
    let up = Upstream::start();
    let e = fault_envoy(&up);
    let r = post(e.port, "k-lost-headers", "", &[(FAULT, "policy-lost-at-headers")]);
    assert_refused(&e, &up, &r, "request_headers_fingerprint");
    let retry = post(e.port, "k-lost-headers", "", &[]);
    assert_eq!(retry.status, 201, "{}", retry.body_text());
    assert_eq!(up.executions(), 1);
}
