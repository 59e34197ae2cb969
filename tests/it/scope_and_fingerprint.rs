//! Who shares a record (the caller scope) and what counts as the same request (the fingerprint),
//! through one Envoy 1.40 with idemgate and no external store. Every test asserts how many times
//! the upstream executed.

use crate::support;

use std::process::Command;

use support::http::{self, Response};
use support::Stack;

const CFG: &str = r#"{"scope": {"headers": ["authorization"]}}"#;

fn post(s: &Stack, headers: &[(&str, &str)], body: &[u8]) -> Response {
    http::request(s.envoy.port, "POST", "/charges", headers, body).expect("request")
}

#[test]
fn callers_without_any_scope_header_are_refused_rather_than_pooled() {
    let s = Stack::new(CFG);
    // Two callers authenticated by cookie (no `authorization`), one key.
    let a = post(&s, &[("cookie", "session=alice"), ("idempotency-key", "k-anon")], b"{}");
    let b = post(&s, &[("cookie", "session=bob"), ("idempotency-key", "k-anon")], b"{}");
    assert_ne!(b.header("idempotent-replayed"), Some("true"), "bob got alice's response: {}", b.body_text());
    for r in [&a, &b] {
        assert_eq!((r.status, r.problem().as_str()), (400, "scope-missing"), "{}", r.body_text());
        assert_eq!(r.header("x-should-retry"), Some("false"));
        assert!(r.json()["detail"].as_str().is_some_and(|d| d.contains("authorization")), "{}", r.body_text());
    }
    // An empty scope header identifies nobody either.
    let empty = post(&s, &[("authorization", ""), ("idempotency-key", "k-anon")], b"{}");
    assert_eq!((empty.status, empty.problem().as_str()), (400, "scope-missing"), "{}", empty.body_text());
    assert_eq!(s.up.executions(), 0, "nothing refused may be forwarded");
    assert_eq!(s.envoy.stat("idemgate.scope_missing"), 3);
    // With the scope header the same key is protected as usual.
    let c = post(&s, &[("authorization", "Bearer carol"), ("idempotency-key", "k-anon")], b"{}");
    assert_eq!(c.status, 201, "{}", c.body_text());
    let c2 = post(&s, &[("authorization", "Bearer carol"), ("idempotency-key", "k-anon")], b"{}");
    assert_eq!(c2.header("idempotent-replayed"), Some("true"));
    // Without a key an anonymous request is not protected, so it passes (as before).
    assert_eq!(post(&s, &[("cookie", "session=alice")], b"{}").status, 201);
    assert_eq!(s.up.executions(), 2);
}

#[test]
fn a_shared_anonymous_scope_is_an_explicit_opt_in() {
    let s = Stack::new(r#"{"scope": {"headers": ["authorization"], "anonymous": "shared"}}"#);
    let a = post(&s, &[("cookie", "session=alice"), ("idempotency-key", "k-pool")], b"{}");
    let b = post(&s, &[("cookie", "session=bob"), ("idempotency-key", "k-pool")], b"{}");
    assert_eq!(a.status, 201, "{}", a.body_text());
    // The operator chose one scope for every anonymous caller: the second is a replay.
    assert_eq!(b.header("idempotent-replayed"), Some("true"));
    assert_eq!(b.body, a.body);
    // An identified caller still has a scope of its own.
    let c = post(&s, &[("authorization", "Bearer carol"), ("idempotency-key", "k-pool")], b"{}");
    assert_eq!((c.status, c.header("idempotent-replayed")), (201, None));
    assert_eq!(s.up.executions(), 2);
}

fn send_as_alice(s: &Stack, key: &str, extra: &[(&str, &str)]) -> Response {
    let mut h = vec![("authorization", "Bearer alice"), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    post(s, &h, b"amount=100&to=bob")
}

#[test]
fn the_same_bytes_with_another_content_type_are_not_replayed() {
    let s = Stack::new(CFG);
    let form = send_as_alice(&s, "k-ct", &[("content-type", "application/x-www-form-urlencoded")]);
    assert_eq!(form.status, 201, "{}", form.body_text());
    let plain = send_as_alice(&s, "k-ct", &[("content-type", "text/plain")]);
    assert_ne!(plain.header("idempotent-replayed"), Some("true"), "a text/plain request got the form's response");
    assert_eq!((plain.status, plain.problem().as_str()), (422, "key-reused"), "{}", plain.body_text());
    let no_type = send_as_alice(&s, "k-ct", &[]);
    assert_eq!((no_type.status, no_type.problem().as_str()), (422, "key-reused"));
    let again = send_as_alice(&s, "k-ct", &[("content-type", "application/x-www-form-urlencoded")]);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn a_method_override_header_makes_another_request() {
    let s = Stack::new(CFG);
    assert_eq!(send_as_alice(&s, "k-ovr", &[]).status, 201);
    for name in ["x-http-method-override", "x-http-method", "x-method-override"] {
        let r = send_as_alice(&s, "k-ovr", &[(name, "DELETE")]);
        assert_ne!(r.header("idempotent-replayed"), Some("true"), "{name}: DELETE got the POST's response");
        assert_eq!((r.status, r.problem().as_str()), (422, "key-reused"), "{name}: {}", r.body_text());
    }
    assert_eq!(send_as_alice(&s, "k-ovr", &[]).header("idempotent-replayed"), Some("true"));
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn the_operation_headers_can_be_left_out_of_the_fingerprint() {
    let s = Stack::new(r#"{"scope": {"headers": ["authorization"]}, "fingerprint": {"operation_headers": false}}"#);
    let send = |ct: &str| {
        post(&s, &[("authorization", "Bearer a"), ("idempotency-key", "k-off"), ("content-type", ct)], b"a=1")
    };
    assert_eq!(send("application/x-www-form-urlencoded").status, 201);
    assert_eq!(send("text/plain").header("idempotent-replayed"), Some("true"));
    assert_eq!(s.up.executions(), 1);
}

/// Sends `n` HTTP/2 streams on one connection; returns (status, replayed) per stream.
fn h2(s: &Stack, n: usize, args: &[&str]) -> Vec<(String, String)> {
    let out = Command::new("python3")
        .arg(support::repo_root().join("tests/h2_client.py"))
        .args([&s.envoy.port.to_string(), &n.to_string(), "/charges", r#"{"amount":5}"#])
        .args(args)
        .output()
        .expect("python3 tests/h2_client.py (h2 installed by make test-faults)");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.get(1).unwrap_or(&"").to_string(), f.get(2).unwrap_or(&"").to_string())
        })
        .collect()
}

#[test]
fn http2_request_trailers_are_part_of_the_fingerprint() {
    let s = Stack::new(CFG);
    let base = ["authorization: Bearer a", "idempotency-key: k-trailers"];
    let with = |trailer: &'static str| [base[0], base[1], trailer];
    assert_eq!(h2(&s, 1, &with("@x-checksum: abc")), vec![("201".into(), "-".into())]);
    assert_eq!(s.up.executions(), 1);
    // The same trailers: a replay.
    assert_eq!(h2(&s, 1, &with("@x-checksum: abc")), vec![("201".into(), "true".into())]);
    // Other trailers, or none: another request with the same key.
    let other = h2(&s, 1, &with("@x-checksum: def"));
    assert_eq!(other, vec![("422".into(), "-".into())], "a request with other trailers got the replay");
    assert_eq!(h2(&s, 1, &base), vec![("422".into(), "-".into())]);
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn request_trailers_can_be_left_out_of_the_fingerprint() {
    let s = Stack::new(r#"{"scope": {"headers": ["authorization"]}, "fingerprint": {"trailers": false}}"#);
    let base = ["authorization: Bearer a", "idempotency-key: k-no-trailers"];
    assert_eq!(h2(&s, 1, &[base[0], base[1], "@x-checksum: abc"]), vec![("201".into(), "-".into())]);
    assert_eq!(h2(&s, 1, &[base[0], base[1], "@x-checksum: def"]), vec![("201".into(), "true".into())]);
    assert_eq!(s.up.executions(), 1);
}

/// A chunked HTTP/1.1 POST with `trailers` (lines ending in CRLF) after its last chunk.
fn chunked_with_trailers(s: &Stack, key: &str, trailers: &str) -> Response {
    let body = r#"{"amount":5}"#;
    let req = format!(
        "POST /charges HTTP/1.1\r\nhost: t\r\nconnection: close\r\nauthorization: Bearer a\r\nidempotency-key: {key}\r\n\
         transfer-encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n{trailers}\r\n",
        body.len()
    );
    s.raw(req.as_bytes())
}

#[test]
fn http1_request_trailers_count_once_envoy_lets_them_through() {
    // By default Envoy's HTTP/1 codec drops request trailers: neither idemgate nor the upstream
    // sees them, so other trailers are the same request (tests/it/faults/hostile.rs shows it). With
    // `enable_trailers` they reach the filter (and may reach the upstream): they count.
    let s = Stack::with(CFG, |o| o.http1_trailers = true);
    assert_eq!(chunked_with_trailers(&s, "k-h1", "x-checksum: abc\r\n").status, 201);
    let same = chunked_with_trailers(&s, "k-h1", "x-checksum: abc\r\n");
    assert_eq!(same.header("idempotent-replayed"), Some("true"), "{}", same.body_text());
    let other = chunked_with_trailers(&s, "k-h1", "x-checksum: def\r\n");
    assert_eq!((other.status, other.problem().as_str()), (422, "key-reused"), "{}", other.body_text());
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn derived_keys_are_never_derived_for_anonymous_callers_shared_scope_or_not() {
    for anonymous in ["reject", "shared"] {
        let s = Stack::new(&format!(
            r#"{{"scope": {{"headers": ["authorization"], "anonymous": "{anonymous}"}},
                "derive_key": {{"headers": ["x-agent-task-id", "x-agent-step-id"]}}}}"#
        ));
        let step = [("cookie", "session=alice"), ("x-agent-task-id", "t1"), ("x-agent-step-id", "s1")];
        // No key is derived: each passes unprotected, as any keyless request does.
        assert_eq!(post(&s, &step, b"{}").status, 201, "{anonymous}");
        assert_eq!(post(&s, &step, b"{}").header("idempotent-replayed"), None, "{anonymous}");
        assert_eq!(s.up.executions_by_key().get(""), Some(&2), "{anonymous}: nothing derived");
        // An identified caller's step gets its derived key as usual.
        let auth = [("authorization", "Bearer a"), ("x-agent-task-id", "t1"), ("x-agent-step-id", "s1")];
        assert_eq!(post(&s, &auth, b"{}").status, 201);
        assert_eq!(post(&s, &auth, b"{}").header("idempotent-replayed"), Some("true"));
        assert_eq!(s.up.executions(), 3, "{anonymous}");
    }
}

/// `curl -F` sends the form in `parts` to `/charges` with `key`; returns (status, whether the
/// answer is a replay, the boundary curl chose: a fresh random one per run, as every HTTP
/// client's form builder does).
fn curl_form(s: &Stack, key: &str, parts: &[&str]) -> (u16, bool, String) {
    let dir = std::env::temp_dir().join(format!("idemgate-formfp-{}-{key}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("a.txt"), b"hello").expect("file");
    let mut c = Command::new("curl");
    c.current_dir(&dir).args(["-sS", "-v", "-o", "/dev/null", "-D", "-", "--max-time", "30"]);
    c.args(["-H", "authorization: Bearer alice", "-H", &format!("idempotency-key: {key}")]);
    for p in parts {
        c.args(["-F", p]);
    }
    c.arg(format!("http://127.0.0.1:{}/charges", s.envoy.port));
    let out = c.output().expect("curl runs");
    let (head, trace) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let replayed = head.lines().any(|l| l.trim().eq_ignore_ascii_case("idempotent-replayed: true"));
    let boundary = trace.split("boundary=").nth(1).and_then(|b| b.split_whitespace().next()).unwrap_or_default();
    (status, replayed, boundary.to_string())
}

/// Issue 41 (a sent key's fingerprint read a multipart body's bytes): an agent that rebuilds a
/// form request to retry it gets a new random boundary from its client (curl -F, Python requests
/// and httpx, undici's FormData), so the retry of the same form with the same key was answered
/// 422 `key-reused`. With `fingerprint.forms: "semantic"` the form counts by what every backend of
/// the oracle's panel reads (`form::Reading::Every`): the retry replays, and a form any of them
/// reads apart (another value, another file part content type) is still answered 422.
#[test]
fn a_form_rebuilt_by_curl_with_a_new_boundary_replays_with_semantic_forms() {
    let s = Stack::new(r#"{"scope": {"headers": ["authorization"]}, "fingerprint": {"forms": "semantic"}}"#);
    let form = ["amount=1", "currency=eur", "doc=@a.txt;type=text/plain"];
    let (first, _, b1) = curl_form(&s, "k-form", &form);
    assert_eq!(first, 201);
    let (again, replayed, b2) = curl_form(&s, "k-form", &form);
    assert_ne!(b1, b2, "curl chose one boundary twice: the test shows nothing");
    assert_eq!((again, replayed), (201, true), "the same form with boundary {b2} (first {b1}) was not replayed");
    assert_eq!(s.up.executions_with_key("k-form"), 1);
    // Forms a backend reads apart, with the same key: 422, never the first form's answer.
    for other in [
        ["amount=2", "currency=eur", "doc=@a.txt;type=text/plain"],
        ["amount=1", "currency=eur", "doc=@a.txt;type=application/octet-stream"],
        ["amount=1", "currency=eur", "doc=hello"],
        ["currency=eur", "amount=1", "doc=@a.txt;type=text/plain"],
    ] {
        let (status, replayed, _) = curl_form(&s, "k-form", &other);
        assert_eq!((status, replayed), (422, false), "{other:?}");
    }
    assert_eq!(s.up.executions_with_key("k-form"), 1);
}
