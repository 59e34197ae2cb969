//! The native build (libidemgate_native.so, `envoy.filters.http.dynamic_modules`, docs/native.md)
//! in a real Envoy 1.40: the local tier's rules through the same engine as the Wasm filter, each
//! case run against both builds from one body (`both`), asserting the upstream's executions.
//! Also: the module's ABI version is the one this Envoy was built with (Envoy logs "matched"),
//! and a configuration naming a feature the native build does not carry yet is refused at load.

use crate::support;

use support::http::{self, Response};
use support::{Build, Envoy, EnvoyOptions, Stack, Started};

const CFG: &str = r#"{"scope": {"headers": ["authorization"]}}"#;

fn stack(build: Build, plugin: &str) -> Stack {
    Stack::with(plugin, |o| o.build = build)
}

fn post(s: &Stack, key: Option<&str>, body: &str, extra: &[(&str, &str)]) -> Response {
    let mut h: Vec<(&str, &str)> = vec![("authorization", "Bearer alice"), ("content-type", "application/json")];
    if let Some(k) = key {
        h.push(("idempotency-key", k));
    }
    h.extend_from_slice(extra);
    http::request(s.envoy.port, "POST", "/charges", &h, body.as_bytes()).expect("request")
}

/// A POST whose body is written in two parts with a pause between them (whatever the pause, the
/// request's bytes are the same; only how Envoy's reads split them may change, and the answers
/// asserted do not depend on it).
fn post_in_two_writes(port: u16, key: &str, body: &[u8]) -> Response {
    use std::io::{Read, Write};
    let head = format!(
        "POST /charges HTTP/1.1\r\nhost: idemgate.test\r\nconnection: close\r\nauthorization: Bearer alice\r\ncontent-type: application/json\r\nidempotency-key: {key}\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    c.set_read_timeout(Some(std::time::Duration::from_secs(20))).expect("timeout");
    let (first, second) = body.split_at(body.len() / 2);
    c.write_all(head.as_bytes()).expect("write head");
    c.write_all(first).expect("write first part");
    c.flush().expect("flush");
    std::thread::sleep(std::time::Duration::from_millis(200));
    c.write_all(second).expect("write second part");
    let mut buf = vec![];
    c.read_to_end(&mut buf).expect("read answer");
    http::parse(&buf).expect("parse answer")
}

fn problem_type(r: &Response) -> String {
    r.json()["type"].as_str().unwrap_or("").to_string()
}

/// The local tier's core cases against one build: each assertion on what the upstream executed.
fn local_tier(build: Build) {
    let s = stack(build, CFG);
    // First request: executed once, stored.
    let a = post(&s, Some("n-1"), r#"{"amount":100}"#, &[]);
    assert_eq!(a.status, 201, "{build:?}: {}", a.body_text());
    assert_eq!(a.header("idempotent-replayed"), None, "{build:?}");
    assert_eq!(s.up.executions(), 1, "{build:?}");
    // The retry is replayed byte for byte, not executed.
    let b = post(&s, Some("n-1"), r#"{"amount":100}"#, &[]);
    assert_eq!(b.status, 201, "{build:?}");
    assert_eq!(b.header("idempotent-replayed"), Some("true"), "{build:?}");
    assert_eq!(b.body, a.body, "{build:?}");
    assert_eq!(b.header("x-execution"), Some("1"), "{build:?}");
    assert_eq!(a.header("idempotency-key-expires-in"), Some("86400"), "{build:?}");
    assert_eq!(s.up.executions(), 1, "{build:?}: a replay must not execute");
    // Same key, another body: 422, not executed.
    let c = post(&s, Some("n-1"), r#"{"amount":999}"#, &[]);
    assert_eq!(c.status, 422, "{build:?}: {}", c.body_text());
    assert_eq!(problem_type(&c), "urn:idemgate:problem:key-reused", "{build:?}");
    assert_eq!(s.up.executions(), 1, "{build:?}");
    // A malformed key: 400, not executed.
    let d = post(&s, Some("bad key"), r#"{"amount":1}"#, &[]);
    assert_eq!(d.status, 400, "{build:?}: {}", d.body_text());
    assert!(problem_type(&d).starts_with("urn:idemgate:problem:key-"), "{build:?}: {}", d.body_text());
    assert_eq!(s.up.executions(), 1, "{build:?}");
    // A duplicate while the first is in flight: 409, not executed; the first then completes once.
    let port = s.envoy.port;
    let first = std::thread::spawn(move || {
        let h = [
            ("authorization", "Bearer alice"),
            ("content-type", "application/json"),
            ("idempotency-key", "n-2"),
            ("x-up-hold", "1"),
        ];
        http::request(port, "POST", "/charges", &h, br#"{"amount":5}"#).expect("request")
    });
    support::wait_for("the first n-2 at the upstream", 2000, || s.up.executions() == 2);
    let dup = post(&s, Some("n-2"), r#"{"amount":5}"#, &[]);
    assert_eq!(dup.status, 409, "{build:?}: {}", dup.body_text());
    assert_eq!(problem_type(&dup), "urn:idemgate:problem:request-in-flight", "{build:?}");
    s.up.release_holds();
    let first = first.join().expect("first");
    assert_eq!(first.status, 201, "{build:?}");
    assert_eq!(s.up.executions(), 2, "{build:?}: n-2 executed once");
    let again = post(&s, Some("n-2"), r#"{"amount":5}"#, &[]);
    assert_eq!(again.header("idempotent-replayed"), Some("true"), "{build:?}");
    assert_eq!(s.up.executions(), 2, "{build:?}");
    assert_eq!(s.up.executions_with_key("n-1"), 1, "{build:?}");
    assert_eq!(s.up.executions_with_key("n-2"), 1, "{build:?}");

    // A body sent in two writes (Envoy reads the first before the second is sent, so it reaches
    // the filter in more than one chunk; Envoy 1.40 gave two of 150,005 and 150,006 bytes, then
    // an empty one ending the stream): the fingerprint covers every byte. The same body again is
    // replayed; one byte changed in either write is 422.
    let big: String = format!(r#"{{"blob":"{}"}}"#, "a".repeat(300_000));
    let e = post_in_two_writes(port, "n-3", big.as_bytes());
    assert_eq!(e.status, 201, "{build:?}: {}", e.body_text());
    let f = post_in_two_writes(port, "n-3", big.as_bytes());
    assert_eq!(f.header("idempotent-replayed"), Some("true"), "{build:?}");
    let mut changed = big.clone();
    changed.replace_range(changed.len() - 3..changed.len() - 2, "b");
    let g = post_in_two_writes(port, "n-3", changed.as_bytes());
    assert_eq!(g.status, 422, "{build:?}: a change in the second part must be seen");
    let mut changed = big.clone();
    changed.replace_range(20..21, "b");
    let g = post_in_two_writes(port, "n-3", changed.as_bytes());
    assert_eq!(g.status, 422, "{build:?}: a change in the first part must be seen");
    assert_eq!(s.up.executions_with_key("n-3"), 1, "{build:?}");

    // Concurrent identical requests over both workers (exact_balance): one execution.
    let threads: Vec<_> = (0..30)
        .map(|_| {
            std::thread::spawn(move || {
                let h = [
                    ("authorization", "Bearer alice"),
                    ("content-type", "application/json"),
                    ("idempotency-key", "n-4"),
                ];
                http::request(port, "POST", "/charges", &h, br#"{"amount":7}"#).expect("request").status
            })
        })
        .collect();
    let statuses: Vec<u16> = threads.into_iter().map(|t| t.join().expect("thread")).collect();
    assert!(statuses.iter().all(|st| [201, 409].contains(st)), "{build:?}: {statuses:?}");
    assert_eq!(s.up.executions_with_key("n-4"), 1, "{build:?}: {statuses:?}");
}

#[test]
fn local_tier_cases_hold_in_both_builds() {
    for build in [Build::Wasm, Build::Native] {
        local_tier(build);
    }
}

#[test]
fn native_module_abi_version_matches_this_envoy() {
    let s = stack(Build::Native, CFG);
    support::wait_for("envoy's log of the module load", 100, || s.envoy.log().contains("ABI version"));
    let log = s.envoy.log();
    assert!(log.contains("Dynamic module ABI version v0.2.0 matched"), "{log}");
}

#[test]
fn native_build_refuses_a_store_at_load_naming_it() {
    let mut o = EnvoyOptions::new(
        r#"{"scope": {"headers": ["authorization"]}, "store": {"cluster": "idemgate_store"}}"#,
        support::free_port(),
    );
    o.build = Build::Native;
    o.store_port = Some(support::free_port());
    match Envoy::try_start(&o) {
        Started::Ready(_) => panic!("the native build accepted a store configuration"),
        Started::Exited { log, .. } => {
            assert!(log.contains("not supported by the native (dynamic module) build yet"), "{log}");
            assert!(log.contains("\"store\""), "{log}");
        }
    }
}
