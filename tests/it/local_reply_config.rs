//! Envoy's `local_reply_config` (issue 23, item 7), in Envoy 1.40 with a counting upstream.
//! idemgate sends replays and problem documents as local replies, and the connection manager
//! applies its `local_reply_config` to every local reply: a `body_format` that gives Envoy's own
//! errors a JSON shape turned a replayed JSON 200 into `{"error":"<the original,
//! escaped>","status":200}` (content-type `application/json`), and a mapper keyed on status did
//! the same to replayed 4xx/5xx. The exempting mapper shipped (commented) in `envoy/envoy.yaml`
//! matches idemgate's replies by their response code details (`idemgate_<outcome>`) and gives them
//! their own body back; Envoy then keeps their status, headers and content-type. These tests load
//! that block as shipped.

use crate::support;

use support::http::{self, Response};
use support::Stack;

const CFG: &str = r#"{"scope": {"headers": ["authorization"]}}"#;

/// The commented `local_reply_config` block of `envoy/envoy.yaml`, uncommented: the YAML of its
/// value, from column 0.
fn shipped_local_reply_config() -> String {
    let text = std::fs::read_to_string(support::repo_root().join("envoy/envoy.yaml")).expect("envoy/envoy.yaml");
    let prefix = "          # ";
    let mut lines = text.lines().skip_while(|l| l.trim_end() != "          # local_reply_config:");
    assert!(lines.next().is_some(), "envoy/envoy.yaml has no commented local_reply_config block");
    let value: Vec<&str> = lines
        .take_while(|l| l.starts_with("          #   "))
        .map(|l| l.strip_prefix(prefix).and_then(|l| l.strip_prefix("  ")).expect("block line"))
        .collect();
    value.join("\n") + "\n"
}

/// The same block without its first mapper (the one that exempts idemgate's replies): an
/// operator's `local_reply_config` as it was before.
fn without_the_exempting_mapper(block: &str) -> String {
    let lines: Vec<&str> = block.lines().collect();
    let first = lines.iter().position(|l| l.starts_with("- ")).expect("a mapper");
    let next = first + 1 + lines[first + 1..].iter().position(|l| !l.starts_with(' ')).expect("the block goes on");
    let kept: Vec<&str> = lines[..first].iter().chain(&lines[next..]).copied().collect();
    assert!(!kept.join("\n").contains("idemgate_"), "{}", kept.join("\n"));
    kept.join("\n") + "\n"
}

fn stack(local_reply_config: String) -> Stack {
    Stack::with(CFG, |o| o.local_reply_config = Some(local_reply_config))
}

fn post(s: &Stack, key: &str, body: &[u8], extra: &[(&str, &str)]) -> Response {
    let mut h: Vec<(&str, &str)> =
        vec![("authorization", "Bearer alice"), ("content-type", "application/json"), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    http::request(s.envoy.port, "POST", "/charges", &h, body).expect("request")
}

/// The headers a replay must carry as the first response had them: all but those that change
/// from one answer to the next (`date`, the seconds left in `idempotency-key-expires-in`) and the
/// replay's own mark.
fn lasting_headers(r: &Response) -> Vec<(String, String)> {
    let mut h: Vec<(String, String)> = r
        .headers
        .iter()
        .filter(|(n, _)| !matches!(n.as_str(), "date" | "idempotency-key-expires-in" | "idempotent-replayed"))
        .cloned()
        .collect();
    h.sort();
    h
}

/// The first response to `key` (the upstream told to answer with `extra`), then a retry: the
/// retry is a replay of it, byte for byte. Returns both.
fn replayed_byte_exact(s: &Stack, key: &str, extra: &[(&str, &str)]) -> (Response, Response) {
    let first = post(s, key, br#"{"amount":5}"#, extra);
    let retry = post(s, key, br#"{"amount":5}"#, extra);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"), "{key}: {}", retry.body_text());
    assert_eq!(retry.status, first.status, "{key}");
    assert_eq!(retry.body, first.body, "{key}: {} / {}", first.body_text(), retry.body_text());
    assert_eq!(lasting_headers(&retry), lasting_headers(&first), "{key}");
    assert!(retry.header("idempotency-key-expires-in").is_some(), "{key}");
    assert_eq!(s.up.executions_with_key(key), 1, "{key}");
    (first, retry)
}

/// Envoy's own 503 (the upstream resets an unprotected request before its headers) gets the
/// configured shape: the local_reply_config is in force.
fn envoys_own_503_is_formatted(s: &Stack) {
    let h = [("x-up-reset", "before-headers")];
    let r = http::request(s.envoy.port, "GET", "/health", &h, b"").expect("request");
    assert_eq!(r.status, 503, "{}", r.body_text());
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("x-error-source"), Some("envoy"));
    assert_eq!(r.json()["error"]["code"], 503, "{}", r.body_text());
    assert!(r.json()["error"]["message"].as_str().unwrap_or("").contains("upstream"), "{}", r.body_text());
}

#[test]
fn with_the_exempting_mapper_first_replays_and_problems_stay_byte_exact_while_envoys_errors_are_formatted() {
    let s = stack(shipped_local_reply_config());
    envoys_own_503_is_formatted(&s);

    // A JSON 200 (the exempting mapper's text format would say text/plain), then what mappers
    // keyed on status would catch: a 422 in plain text, a JSON 503.
    let (first, _) = replayed_byte_exact(&s, "k-200", &[("x-up-status", "200")]);
    assert_eq!(first.header("content-type"), Some("application/json"));
    replayed_byte_exact(&s, "k-422", &[("x-up-status", "422"), ("x-up-plain", "1")]);
    let (_, r503) = replayed_byte_exact(&s, "k-503", &[("x-up-status", "503")]);
    assert_eq!(r503.header("x-error-source"), None, "Envoy's 5xx mapper applied to a replay");
    // A body that is neither text nor JSON, with a percent sign and a dash (what a formatter
    // would substitute): the gzip bytes as stored, to a retry that accepts gzip.
    let gz = [("x-up-coding", "gzip"), ("accept-encoding", "gzip"), ("x-up-body", "100% - %LOCAL_REPLY_BODY% -")];
    let (first, _) = replayed_byte_exact(&s, "k-gzip", &gz);
    assert_eq!(first.header("content-encoding"), Some("gzip"));

    // idemgate's problem documents keep their type and shape.
    let r = post(&s, "k-200", br#"{"amount":6}"#, &[]);
    assert_eq!(r.status, 422, "{}", r.body_text());
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.problem(), "key-reused", "{}", r.body_text());
    assert_eq!(r.json()["status"], 422);
    assert_eq!(r.header("content-length"), Some(r.body.len().to_string().as_str()));
    assert_eq!(r.header("x-error-source"), None);
    assert_eq!(s.up.executions_with_key("k-200"), 1);
}

/// Before: the same configuration without the exempting mapper, as an operator would have it.
/// Every replay and problem is reshaped (this is what the test above showed, failing, before the
/// mapper was added; kept so a change in Envoy's behaviour shows here).
#[test]
fn without_the_exempting_mapper_envoy_reshapes_every_replay_and_problem() {
    let s = stack(without_the_exempting_mapper(&shipped_local_reply_config()));
    envoys_own_503_is_formatted(&s);
    let extra = [("x-up-status", "200")];
    let first = post(&s, "k-200", br#"{"amount":5}"#, &extra);
    let retry = post(&s, "k-200", br#"{"amount":5}"#, &extra);
    assert_eq!((first.status, retry.status), (200, 200));
    assert_eq!(retry.header("content-type"), Some("application/json"));
    assert_eq!(retry.json()["error"].as_str().map(str::as_bytes), Some(first.body.as_slice()), "{}", retry.body_text());
    assert_eq!(retry.json()["status"], 200);

    let extra = [("x-up-status", "503")];
    let first = post(&s, "k-503", br#"{"amount":5}"#, &extra);
    let retry = post(&s, "k-503", br#"{"amount":5}"#, &extra);
    assert_eq!((first.status, retry.status), (503, 503));
    assert_eq!(retry.header("x-error-source"), Some("envoy"), "a replayed upstream 503 passed for Envoy's own");
    assert_eq!(retry.json()["error"]["message"].as_str().map(str::as_bytes), Some(first.body.as_slice()));

    let r = post(&s, "k-200", br#"{"amount":6}"#, &[]);
    assert_eq!(r.status, 422);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.problem(), "", "{}", r.body_text());
    assert!(r.json()["error"].as_str().unwrap_or("").contains("urn:idemgate:problem:key-reused"), "{}", r.body_text());
    assert_eq!((s.up.executions_with_key("k-200"), s.up.executions_with_key("k-503")), (1, 1));
}
