//! No caller's credential, nor any value idemgate logs, ever reaches another caller (issue 24,
//! item 1). Two API keys of one account share a scope (`scope.headers: [x-account-id]`); the
//! second one's request with the first one's key must not carry the first one's token back, and
//! the store must hold none of it. Real Envoy 1.40, Redis behind webdis for the store runs.

use crate::support;

use support::http::{self, Response};
use support::store::{Redis, Webdis};
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions, Started};

const TOKEN_A: &str = "Bearer sk-live-alice-7Qz9c1";
const TOKEN_B: &str = "Bearer sk-live-bob-3Xk2v8";
const RUN_A: &str = "run-alice-55e1";

/// One account, two API keys: the scope is the account, the credential differs.
fn send(e: &Envoy, token: &str, run: &str, body: &str) -> Response {
    let h = [("x-account-id", "acct-1"), ("authorization", token), ("x-agent-run-id", run), ("idempotency-key", "k-1")];
    http::request(e.port, "POST", "/charges", &h, body.as_bytes()).expect("request")
}

fn plugin(log_headers: &str, store: bool) -> String {
    let store = if store {
        r#", "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 2000}"#
    } else {
        ""
    };
    format!(
        r#"{{"scope": {{"headers": ["x-account-id"]}}, "mismatch_status": 409, "log_headers": {log_headers}{store}}}"#
    )
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// A's request completes, B reuses the key with another body (409 key-reused): B's body must
/// carry neither A's token nor A's logged values, and the store none of A's token. `a`, `b`: the
/// proxies A and B use (the same one, or two sharing the store).
fn across_callers(a: &Envoy, b: &Envoy, up: &Upstream, redis: Option<&Redis>, secrets: &[&str]) {
    let first = send(a, TOKEN_A, RUN_A, r#"{"amount":5}"#);
    assert_eq!(first.status, 201, "{}", first.body_text());
    if redis.is_some() {
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    let other = send(b, TOKEN_B, "run-bob", r#"{"amount":7}"#);
    assert_eq!(other.status, 409, "{}", other.body_text());
    assert_eq!(other.json()["type"], "urn:idemgate:problem:key-reused");
    for s in secrets {
        assert!(!contains(&other.body, s), "B's 409 carries A's {s:?}: {}", other.body_text());
        for (n, v) in &other.headers {
            assert!(!v.contains(s), "B's 409 header {n} carries A's {s:?}");
        }
    }
    if let Some(redis) = redis {
        let all = redis.dump_all_values();
        assert!(!all.is_empty());
        for (k, v) in &all {
            assert!(!contains(v, TOKEN_A) && !contains(v, "alice-7Qz9c1"), "the store value {k} holds A's token");
        }
    }
    assert_eq!(up.executions(), 1);
}

/// `log_headers: [authorization]` with a scope that is not the credential: refused at
/// configuration (`log_headers[0]` named). Before the fix it was accepted, and then B's 409 and
/// the store carried A's token: that branch runs the scenario so a module accepting it fails.
fn a_logged_credential(store: bool) {
    let redis = store.then(Redis::start);
    let webdis = redis.as_ref().map(|r| Webdis::start(r.port));
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(&plugin(r#"["authorization"]"#, store), up.port);
    o.store_port = webdis.as_ref().map(|w| w.port);
    match Envoy::try_start(&o) {
        Started::Exited { log, .. } => {
            assert!(log.contains("field `log_headers[0]`") && log.contains("credential"), "{log}");
            assert_eq!(up.executions(), 0);
        }
        Started::Ready(a) => {
            let b = if store { Some(Envoy::start(&o)) } else { None };
            across_callers(&a, b.as_ref().unwrap_or(&a), &up, redis.as_ref(), &[TOKEN_A, "alice-7Qz9c1"]);
            panic!("log_headers: [authorization] was accepted (and nothing leaked this time)");
        }
    }
}

#[test]
fn a_credential_named_in_log_headers_is_refused_rather_than_echoed_to_another_caller() {
    a_logged_credential(false);
}

#[test]
fn a_credential_named_in_log_headers_is_refused_rather_than_stored_and_echoed_across_proxies() {
    a_logged_credential(true);
}

/// A value idemgate logs (here `x-agent-run-id`) stays in the operator's logs and records: it is
/// never echoed to a client, so B never learns A's run id (nor A's token).
#[test]
fn a_logged_value_is_never_echoed_to_another_caller() {
    let up = Upstream::start();
    let a = Envoy::start(&EnvoyOptions::new(&plugin(r#"["x-agent-run-id"]"#, false), up.port));
    across_callers(&a, &a, &up, None, &[TOKEN_A, "alice-7Qz9c1", RUN_A]);
    a.assert_no_wasm_panic();
}

#[test]
fn a_logged_value_is_never_echoed_to_another_caller_through_the_store() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(&plugin(r#"["x-agent-run-id"]"#, true), up.port);
    o.store_port = Some(webdis.port);
    let (a, b) = (Envoy::start(&o), Envoy::start(&o));
    across_callers(&a, &b, &up, Some(&redis), &[TOKEN_A, "alice-7Qz9c1", RUN_A]);
    a.assert_no_wasm_panic();
    b.assert_no_wasm_panic();
}
