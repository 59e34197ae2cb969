//! Hostile input sent through Envoy (`make test-faults`), each with its expected answer, the
//! upstream's execution count, and no VM crash. (Malformed key shapes and repeated key headers are
//! in tests/it/single_proxy/faults.rs, also run by `make test-faults`.) Each case writes a line to
//! target/faults/hostile.md, its executions measured (the upstream's count before and after the
//! case) and asserted.

use crate::support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::Stack;

const CFG: &str = r#"{"scope": {"headers": ["authorization"]}, "max_request_body_bytes": 1000}"#;

fn record(case: &str, answer: &str, executions: u64) {
    support::fault_report("hostile.md", &[case, answer, &executions.to_string()]);
}

/// One case: `run` sends it; its executions are what the upstream counted meanwhile, asserted to be
/// `want` and written to the table.
fn case(s: &Stack, name: &str, answer: &str, want: u64, run: impl FnOnce()) {
    let before = s.up.executions();
    run();
    let executions = s.up.executions() - before;
    assert_eq!(executions, want, "{name}: executions");
    record(name, answer, executions);
}

fn post_head(key: &[u8], extra: &str) -> Vec<u8> {
    let mut r =
        b"POST /charges HTTP/1.1\r\nhost: t\r\nconnection: close\r\nauthorization: Bearer a\r\nidempotency-key: "
            .to_vec();
    r.extend_from_slice(key);
    r.extend_from_slice(b"\r\n");
    r.extend_from_slice(extra.as_bytes());
    r
}

#[test]
fn hostile_input_nul_and_control_bytes_in_the_key_are_refused_without_a_crash() {
    let s = Stack::new(CFG);
    // NUL: Envoy's HTTP/1 codec refuses the request itself.
    case(&s, "NUL byte in the key header", "400 (Envoy's codec)", 0, || {
        let r = s.raw(&post_head(b"k\0x", "content-length: 2\r\n\r\n{}"));
        assert_eq!(r.status, 400);
    });
    // Other control bytes: refused by Envoy's codec too, or by idemgate (not visible ASCII).
    for (byte, name) in [(1u8, "0x01"), (0x1f, "0x1f"), (0x7f, "DEL 0x7f")] {
        let before = s.up.executions();
        let r = s.raw(&post_head(&[b'k', byte, b'x'], "content-length: 2\r\n\r\n{}"));
        assert_eq!(r.status, 400, "{name}: {}", r.body_text());
        let seen = match r.problem() {
            p if p.is_empty() => "400 (Envoy's codec)".to_string(),
            p => {
                assert_eq!(p, "key-not-visible-ascii");
                format!("400 {p}")
            }
        };
        let executions = s.up.executions() - before;
        assert_eq!(executions, 0, "{name}: executions");
        record(&format!("control byte {name} in the key header"), &seen, executions);
    }
}

#[test]
fn hostile_input_huge_headers_are_refused_before_anything_executes() {
    let s = Stack::new(CFG);
    // A key of 10 KB: ours (key-too-long).
    case(&s, "10 KB key", "400 key-too-long", 0, || {
        let big_key = "k".repeat(10_000);
        let r = s.raw(&post_head(big_key.as_bytes(), "content-length: 2\r\n\r\n{}"));
        assert_eq!((r.status, r.problem().as_str()), (400, "key-too-long"));
    });
    // 100 KB of headers: over Envoy's 60 KiB default, refused by Envoy (431).
    case(&s, "100 KB of headers", "431 (Envoy)", 0, || {
        let filler = format!("x-filler: {}\r\n", "f".repeat(100_000));
        let r = s.raw(&post_head(b"k-huge", &format!("{filler}content-length: 2\r\n\r\n{{}}")));
        assert_eq!(r.status, 431, "{}", r.body_text());
    });
    // 90 headers of 500 bytes (45 KB, under the limit): protected as usual.
    case(&s, "90 headers, 45 KB, sent twice", "201 then replay", 1, || {
        let many: String = (0..90).map(|i| format!("x-h{i}: {}\r\n", "v".repeat(500))).collect();
        let r = s.raw(&post_head(b"k-many", &format!("{many}content-length: 2\r\n\r\n{{}}")));
        assert_eq!(r.status, 201, "{}", r.body_text());
        let r = s.raw(&post_head(b"k-many", &format!("{many}content-length: 2\r\n\r\n{{}}")));
        assert_eq!(r.header("idempotent-replayed"), Some("true"));
    });
}

#[test]
fn hostile_input_bodies_at_and_over_the_limit_plain_and_chunked() {
    let s = Stack::new(CFG);
    let at = "a".repeat(1000);
    let over = "a".repeat(1001);
    let plain = |key: &str, body: &str| {
        s.raw(&post_head(key.as_bytes(), &format!("content-length: {}\r\n\r\n{body}", body.len())))
    };
    let chunked = |key: &str, body: &str, trailers: &str| {
        let (a, b) = body.split_at(body.len() / 2);
        s.raw(&post_head(
            key.as_bytes(),
            &format!(
                "transfer-encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n{trailers}\r\n",
                a.len(),
                b.len()
            ),
        ))
    };
    case(&s, "body of exactly max_request_body_bytes", "201", 1, || {
        assert_eq!(plain("k-at", &at).status, 201);
    });
    case(&s, "body one byte over (content-length, and chunked)", "413 body-too-large", 0, || {
        let r = plain("k-over", &over);
        assert_eq!((r.status, r.problem().as_str()), (413, "body-too-large"));
        let r = chunked("k-over-c", &over, "");
        assert_eq!((r.status, r.problem().as_str()), (413, "body-too-large"));
    });
    // A chunked body is the same request as the same bytes sent with a content-length.
    case(&s, "chunked body, then the same bytes with content-length", "201 then replay", 1, || {
        assert_eq!(chunked("k-at-c", &at, "").status, 201);
        let r = plain("k-at-c", &at);
        assert_eq!(r.header("idempotent-replayed"), Some("true"), "{}", r.body_text());
    });
    // Envoy's HTTP/1 codec drops request trailers by default (no `enable_trailers`): neither
    // idemgate nor the upstream sees them, so other trailers are the same request; the body still
    // counts. (Trailers that do arrive are fingerprinted: tests/it/scope_and_fingerprint.rs.)
    let trailers = "chunked body with trailers (dropped by Envoy's HTTP/1 codec); other trailers; other body";
    case(&s, trailers, "201, replay, 422", 1, || {
        assert_eq!(chunked("k-trailer", r#"{"amount":7}"#, "x-checksum: abc\r\n").status, 201);
        let r = chunked("k-trailer", r#"{"amount":7}"#, "x-checksum: other\r\n");
        assert_eq!(r.header("idempotent-replayed"), Some("true"));
        let r = chunked("k-trailer", r#"{"amount":8}"#, "x-checksum: abc\r\n");
        assert_eq!((r.status, r.problem().as_str()), (422, "key-reused"));
    });
}

#[test]
fn hostile_input_invalid_json_with_canonical_fingerprints_falls_back_to_the_raw_bytes() {
    let s = Stack::new(r#"{"scope": {"headers": ["authorization"]}, "fingerprint": {"json": "canonical"}}"#);
    let send = |key: &str, body: &str| {
        s.raw(&post_head(
            key.as_bytes(),
            &format!("content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()),
        ))
    };
    // Same JSON, other member order and spacing: the same request.
    case(&s, "canonical JSON: reordered members", "replay", 1, || {
        assert_eq!(send("k-json", r#"{"a":1,"b":[1,2]}"#).status, 201);
        assert_eq!(send("k-json", r#"{ "b" : [1,2], "a" : 1 }"#).header("idempotent-replayed"), Some("true"));
    });
    // Not JSON: fingerprinted by its bytes.
    case(&s, "canonical JSON: invalid JSON, same bytes / other bytes", "replay / 422", 1, || {
        assert_eq!(send("k-bad", r#"{"a":1,"#).status, 201);
        assert_eq!(send("k-bad", r#"{"a":1,"#).header("idempotent-replayed"), Some("true"));
        assert_eq!(send("k-bad", r#"{"a":1, "#).problem(), "key-reused");
    });
    // Duplicate member names are ambiguous: raw bytes too.
    case(&s, "canonical JSON: duplicate member names reordered", "422", 1, || {
        assert_eq!(send("k-dup", r#"{"a":1,"a":2}"#).status, 201);
        assert_eq!(send("k-dup", r#"{"a":2,"a":1}"#).problem(), "key-reused");
    });
    // Deep nesting does not crash the canonicaliser.
    case(&s, "canonical JSON: 5000 levels of nesting", "201", 1, || {
        let deep = format!("{}1{}", "[".repeat(5000), "]".repeat(5000));
        assert_eq!(send("k-deep", &deep).status, 201);
    });
}

#[test]
fn hostile_input_http2_streams_on_one_connection_with_one_key_execute_once() {
    let s = Stack::new(CFG);
    let script = support::repo_root().join("tests/h2_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .args([&s.envoy.port.to_string(), "20", "/charges", "{}"])
        .args(["authorization: Bearer a", "idempotency-key: k-h2", "x-up-delay-ms: 200"])
        .output()
        .expect("python3 tests/h2_client.py (h2 installed by make test-faults)");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
    assert_eq!(lines.len(), 20, "{text}");
    // One stream executes; the others, on the same connection at the same time, get 409 (in
    // flight) or the replay.
    let firsts = lines.iter().filter(|l| l[1] == "201" && l[2] == "-").count();
    assert_eq!(firsts, 1, "{text}");
    assert!(lines.iter().all(|l| l[1] == "201" || l[1] == "409"), "{text}");
    assert_eq!(s.up.executions(), 1);
    // Sent again on a new HTTP/2 connection after it finished: all replays.
    let again = Command::new("python3")
        .arg(&script)
        .args([&s.envoy.port.to_string(), "5", "/charges", "{}", "authorization: Bearer a", "idempotency-key: k-h2"])
        .output()
        .expect("h2 client");
    let text2 = String::from_utf8_lossy(&again.stdout).to_string();
    assert!(text2.lines().all(|l| l.ends_with(" 201 true")), "{text2}");
    let executions = s.up.executions();
    assert_eq!(executions, 1);
    record(
        "20 HTTP/2 streams, one connection, one key; then 5 more",
        "one 201, the rest 409 in flight or replays; then 5 replays",
        executions,
    );
}

#[test]
fn hostile_input_a_flood_of_distinct_keys_is_protected_and_answered_without_errors() {
    // Bounded by count, not by time: each wrk thread sends at most KEYS_PER_THREAD distinct keys,
    // then unprotected GETs (no entry); the table is sized from that count, so how fast this
    // machine is changes the figures, never whether the table can fill.
    const THREADS: u64 = 2;
    const KEYS_PER_THREAD: u64 = 10_000;
    // Twice the keys: the table holds up to `max_entries` records whatever buckets they hash to.
    let max_entries = 2 * THREADS * KEYS_PER_THREAD;
    let s = Stack::new(&format!(
        r#"{{"scope": {{"headers": ["authorization"]}}, "local": {{"max_entries": {max_entries}}}}}"#
    ));
    let dir = support::Scratch::new("flood");
    let lua = dir.0.join("flood.lua");
    // Every request a new key until the thread's quota; the connection count is high so the
    // offered load is as large as this machine can make it.
    std::fs::write(
        &lua,
        format!(
            r#"-- setup runs once per thread in wrk's main Lua state: a distinct prefix per thread.
local threads = 0
setup = function(thread)
  threads = threads + 1
  thread:set("tid", tostring(threads))
end
local n = 0
request = function()
  if n >= {KEYS_PER_THREAD} then
    return wrk.format("GET", "/health", {{["Host"] = "t"}})
  end
  n = n + 1
  return wrk.format("POST", "/charges", {{["Host"] = "t", ["authorization"] = "Bearer a", ["idempotency-key"] = "flood-" .. tid .. "-" .. n}}, "{{}}")
end
"#
        ),
    )
    .expect("lua");
    let t0 = Instant::now();
    let out = Command::new("wrk")
        .args([format!("-t{THREADS}").as_str(), "-c64", "-d5s", "-s"])
        .arg(&lua)
        .arg(format!("http://127.0.0.1:{}", s.envoy.port))
        .output()
        .expect("wrk (installed by make test-faults)");
    let secs = t0.elapsed().as_secs_f64();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let total: u64 = text
        .lines()
        .find_map(|l| l.trim().split_once(" requests in ").and_then(|(n, _)| n.trim().parse().ok()))
        .unwrap_or_else(|| panic!("wrk output: {text}"));
    let full = s.envoy.stat("idemgate.local_full");
    assert!(!text.contains("Non-2xx"), "{text} (capacity refusals: {full})");
    assert!(!text.contains("Socket errors"), "{text}");
    std::thread::sleep(Duration::from_millis(300));
    // Every answered request got 2xx; every request Envoy forwarded (including those still in
    // flight when wrk stopped counting) executed once, and no key twice.
    let all = s.up.executions();
    let log = s.up.log();
    let executions = log.iter().filter(|x| x.key.is_some()).count() as u64;
    assert!(all >= total, "{all} executions for {total} answers");
    assert!(all - total <= 64, "more unanswered executions than connections");
    assert!(executions <= THREADS * KEYS_PER_THREAD, "{executions} keyed executions, more than the keys sent");
    let keys: std::collections::HashSet<_> = log.into_iter().filter_map(|x| x.key).collect();
    assert_eq!(keys.len() as u64, executions, "a key executed twice");
    assert_eq!(s.envoy.stat("idemgate.claimed"), executions);
    let rate = executions as f64 / 5.0;
    println!("flood: {total} answers, {executions} distinct keys in {secs:.1} s ({rate:.0}/s achieved)");
    record(
        &format!(
            "flood of distinct keys: wrk 2 threads, 64 connections, 5 s, at most {} keys ({rate:.0} keys/s achieved)",
            THREADS * KEYS_PER_THREAD
        ),
        "all 201",
        executions,
    );
}
