//! The benchmark-only modules (issue 17): the floors `make bench` divides idemgate's first request
//! by (`--features bench-floor`, dist/idemgate-floor.wasm) do the work they stand for, and none of
//! them is in the shipped module.

use crate::support;

use std::path::PathBuf;
use std::time::Duration;

use support::store::{Redis, Webdis};
use support::upstream::Upstream;
use support::{http, Envoy, EnvoyOptions};

fn bench_module(flag: &str, file: &str) -> PathBuf {
    support::build_module(flag, file)
}

fn floor_module() -> PathBuf {
    bench_module("--floor", "idemgate-floor.wasm")
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn bench_builds_the_shipped_module_carries_no_floor() {
    let shipped = std::fs::read(support::wasm_path()).expect("dist/idemgate.wasm");
    let floor = std::fs::read(floor_module()).expect("floor module");
    let needle = b"idemgate_bench_floor";
    assert!(contains(&floor, needle), "the floor build must carry its configuration field");
    assert!(!contains(&shipped, needle), "the shipped module carries the benchmark floor");
}

fn floor_envoy(up: &Upstream, mode: &str, store_port: Option<u16>) -> Envoy {
    let mut o = EnvoyOptions::new(&format!(r#"{{"idemgate_bench_floor": "{mode}"}}"#), up.port);
    o.wasm = Some(floor_module());
    o.store_port = store_port;
    o.concurrency = 1;
    Envoy::start(&o)
}

/// Store requests Envoy sent through the store cluster, once `want` have been sent (the second
/// callout of each request is made after its response), polled a bounded number of times.
fn store_requests_reaching(e: &Envoy, want: u64) -> u64 {
    stat_reaching(e, "cluster.idemgate_store.upstream_rq_total", want)
}

/// `stat` once it reaches `want`, or its value after 100 looks 50 ms apart (the root's callout
/// after the response is counted when sent and again when answered: the two land apart).
fn stat_reaching(e: &Envoy, stat: &str, want: u64) -> u64 {
    let mut n = 0;
    for _ in 0..100 {
        n = e.stat(stat);
        if n >= want {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    n
}

#[test]
fn bench_floors_forward_every_post_whole_and_the_store_floor_makes_two_store_calls_each() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let body = br#"{"amount":4200,"currency":"eur","note":"benchmark body of fixed size"}"#;
    for mode in ["empty", "buffering", "store", "shared"] {
        let up = Upstream::start();
        let store = (mode == "store").then_some(webdis.port);
        let e = floor_envoy(&up, mode, store);
        for i in 0..5 {
            let key = format!("k-{mode}-{i}");
            let h = [("content-type", "application/json"), ("idempotency-key", key.as_str())];
            let r = http::request(e.port, "POST", "/bench", &h, body).expect("answer");
            assert_eq!(r.status, 201, "{mode}: {}", r.body_text());
        }
        assert_eq!(up.executions(), 5, "{mode}: every POST forwarded once");
        assert!(up.log().iter().all(|x| x.body == body), "{mode}: bodies forwarded whole");
        let want = if mode == "store" { 10 } else { 0 };
        assert_eq!(store_requests_reaching(&e, want), want, "{mode}: store requests");
        if mode == "store" {
            // Every callout reached webdis and was answered (a GET of one absent key).
            assert_eq!(stat_reaching(&e, "cluster.idemgate_store.upstream_rq_200", 10), 10, "{mode}: answered");
        }
    }
}

/// The etcd store floor (`"store_kind": "etcd"`, scripts/bench.py's `h_floor_store_etcd`): two etcd
/// writes per request (a put waited for, a second from the root after the response), both landed.
#[test]
fn bench_the_etcd_store_floor_makes_two_etcd_writes_per_request() {
    let etcd = support::etcd::EtcdCluster::start();
    let up = Upstream::start();
    let key = "idemgate/v1/bench-floor";
    let config = format!(r#"{{"idemgate_bench_floor": "store", "store_kind": "etcd", "key": "{key}"}}"#);
    let mut o = EnvoyOptions::new(&config, up.port);
    o.wasm = Some(floor_module());
    o.etcd_ports = etcd.client_ports();
    o.concurrency = 1;
    let e = Envoy::start(&o);
    // Every member admitted by the health check before the first callout.
    assert_eq!(stat_reaching(&e, "cluster.idemgate_store.membership_healthy", 3), 3);
    let body = br#"{"amount":4200,"currency":"eur","note":"benchmark body of fixed size"}"#;
    for i in 0..5 {
        let k = format!("k-etcd-{i}");
        let h = [("content-type", "application/json"), ("idempotency-key", k.as_str())];
        let r = http::request(e.port, "POST", "/bench", &h, body).expect("answer");
        assert_eq!(r.status, 201, "{}", r.body_text());
    }
    assert_eq!(up.executions(), 5);
    // Ten puts of the one key: its version (puts since it was created) reaches 10 once the root's
    // puts after the responses have landed, and goes no further.
    let q = serde_json::json!({"key": idemgate::base64::b64(key.as_bytes())});
    let mut version = serde_json::Value::Null;
    for _ in 0..100 {
        version = etcd.call(etcd.wait_leader(), "/v3/kv/range", &q).expect("range")["kvs"][0]["version"].clone();
        if version == "10" {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let settled = etcd.call(etcd.wait_leader(), "/v3/kv/range", &q).expect("range")["kvs"][0]["version"].clone();
    assert_eq!((version, settled), (serde_json::json!("10"), serde_json::json!("10")));
}

fn count_module() -> PathBuf {
    bench_module("--count-host-calls", "idemgate-count.wasm")
}

#[test]
fn bench_builds_the_shipped_module_carries_no_host_call_counter() {
    let shipped = std::fs::read(support::wasm_path()).expect("dist/idemgate.wasm");
    let count = std::fs::read(count_module()).expect("count module");
    let needle = b"idemgate.count.host_calls";
    assert!(contains(&count, needle), "the counting build must carry its metric");
    assert!(!contains(&shipped, needle), "the shipped module carries the host-call counter");
}

/// The benchmark's local-tier configuration (scripts/bench.py `PLUGIN_LOCAL`).
const BENCH_LOCAL: &str = r#"{"scope": {"headers": ["authorization"]}, "local": {"max_entries": 200000, "max_bytes": 268435456, "when_full": "evict_oldest"}}"#;

/// The counting build's figures (`idemgate.count.*`), read once `requests` requests have logged
/// and the root has handled `root_answers` callout answers (flushed after every other figure, so
/// the read that follows sees all of their work).
fn figures(e: &Envoy, requests: u64, root_answers: u64) -> std::collections::HashMap<String, u64> {
    let read = || -> std::collections::HashMap<String, u64> {
        e.stats("idemgate.count.")
            .into_iter()
            .map(|(n, v)| (n.trim_start_matches("wasmcustom.").to_string(), v))
            .collect()
    };
    for _ in 0..200 {
        let f = read();
        let done = f.get("idemgate.count.requests_logged").copied().unwrap_or(0);
        let answered = f.get("idemgate.count.root_answers").copied().unwrap_or(0);
        if done >= requests && answered >= root_answers {
            return read();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the counting build never reported {requests} requests and {root_answers} root answers: {:?}", read());
}

/// Host calls, VM allocations and store bytes per request: `send(i)` sends request `i`; the
/// first `warm` requests are not counted.
fn per_request(
    e: &Envoy,
    warm: u64,
    n: u64,
    root_answers_per_request: u64,
    send: impl Fn(u64),
) -> std::collections::HashMap<String, f64> {
    per_request_after(e, (0, 0), warm, n, root_answers_per_request, send)
}

/// `per_request`, once `done` (requests logged, root answers) were already made before it.
fn per_request_after(
    e: &Envoy,
    done: (u64, u64),
    warm: u64,
    n: u64,
    root_answers_per_request: u64,
    send: impl Fn(u64),
) -> std::collections::HashMap<String, f64> {
    for i in 0..warm {
        send(i);
    }
    let before = figures(e, done.0 + warm, done.1 + warm * root_answers_per_request);
    for i in warm..warm + n {
        send(i);
    }
    let after = figures(e, done.0 + warm + n, done.1 + (warm + n) * root_answers_per_request);
    after
        .iter()
        .map(|(k, v)| {
            (
                k.trim_start_matches("idemgate.count.").to_string(),
                (v - before.get(k).copied().unwrap_or(0)) as f64 / n as f64,
            )
        })
        .collect()
}

const BODY: &[u8] = br#"{"amount":4200,"currency":"eur","note":"benchmark body of fixed size"}"#;

fn bench_post(port: u16, key: &str) {
    let h = [("content-type", "application/json"), ("authorization", "Bearer bench"), ("idempotency-key", key)];
    let r = http::request(port, "POST", "/bench", &h, BODY).expect("answer");
    assert!(r.status < 300, "{key}: {} {}", r.status, r.body_text());
}

/// Host calls a first protected request makes in the local tier, at most (issue 17 targets 20;
/// 41 before its cuts, 30 before its item 4, 26 with the local layout v3 before issue 27). Every
/// remaining call, what it is for and why it stays, is tabled in docs/BENCHMARKS.md.
const FIRST_LOCAL_HOST_CALLS: f64 = 18.0;
/// Of them, shared-data reads and writes (layout v4: 5 since claims moved to the body's end, 7 before; v3 made 13; docs/local-tier.md has the
/// bound analysis).
const FIRST_LOCAL_SHARED_DATA_CALLS: f64 = 5.0;

#[test]
fn count_build_a_first_protected_request_in_the_local_tier_makes_at_most_20_host_calls() {
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(BENCH_LOCAL, up.port);
    o.wasm = Some(count_module());
    o.concurrency = 1;
    // As in `make bench`: Envoy logs errors only.
    o.wasm_log_level = "error".into();
    let e = Envoy::start(&o);
    let f = per_request(&e, 3, 20, 0, |i| bench_post(e.port, &format!("first-{i}")));
    println!("first request, local tier, per request: {f:?}");
    // The breakdown by callback and kind (docs/BENCHMARKS.md tables it) accounts for every call.
    let mut kinds: Vec<(&String, &f64)> = f.iter().filter(|(k, v)| k.starts_with("kind.") && **v > 0.0).collect();
    kinds.sort_by(|a, b| a.0.cmp(b.0));
    for (k, v) in &kinds {
        println!("  {k}: {v}");
    }
    let in_kinds: f64 = kinds.iter().map(|(_, v)| **v).sum();
    assert!((in_kinds - f["host_calls"]).abs() < 1e-9, "by kind {in_kinds} != host calls {}", f["host_calls"]);
    assert_eq!(up.executions(), 23);
    assert!(
        f["host_calls"] <= FIRST_LOCAL_HOST_CALLS,
        "host calls per first local request {} > {FIRST_LOCAL_HOST_CALLS} ({f:?})",
        f["host_calls"]
    );
    let shared: f64 = kinds
        .iter()
        .filter(|(k, _)| {
            ["bucket_", "slot_", "counter_", "shared_"]
                .iter()
                .any(|p| k.rsplit('.').next().is_some_and(|l| l.starts_with(p)))
        })
        .map(|(_, v)| **v)
        .sum();
    assert!(
        shared <= FIRST_LOCAL_SHARED_DATA_CALLS,
        "shared-data calls per first local request {shared} > {FIRST_LOCAL_SHARED_DATA_CALLS} ({kinds:?})"
    );
}

/// Shared-data calls among a counting build's figures (by kind: buckets, body keys, counters).
fn shared_data_calls(f: &std::collections::HashMap<String, f64>) -> f64 {
    f.iter()
        .filter(|(k, _)| k.starts_with("kind."))
        .filter(|(k, _)| {
            ["bucket_", "slot_", "counter_", "shared_"]
                .iter()
                .any(|p| k.rsplit('.').next().is_some_and(|l| l.starts_with(p)))
        })
        .map(|(_, v)| *v)
        .sum()
}

/// The bucket read at request headers is kept for the claim at the body's end only within the
/// worker's buffer budget, and the body goes first: a body that fits `max_buffered_bytes` only
/// without it is buffered and claimed (the claim reads its bucket again: one shared-data call
/// more), never refused; a small body keeps it (5 calls).
#[test]
fn count_build_a_body_that_fits_the_buffer_budget_only_without_the_headers_read_is_still_claimed() {
    let up = Upstream::start();
    let cfg =
        r#"{"scope": {"headers": ["authorization"]}, "max_buffered_bytes": 1024, "max_request_body_bytes": 1024}"#;
    let mut o = EnvoyOptions::new(cfg, up.port);
    o.wasm = Some(count_module());
    o.concurrency = 1;
    o.wasm_log_level = "error".into();
    let e = Envoy::start(&o);
    let post = |key: String, body: &[u8]| {
        let h = [
            ("content-type", "application/json"),
            ("authorization", "Bearer bench"),
            ("idempotency-key", key.as_str()),
        ];
        let r = http::request(e.port, "POST", "/bench", &h, body).expect("answer");
        assert!(r.status < 300, "{key}: {} {}", r.status, r.body_text());
    };
    // 1,020 bytes: with the bucket's value (tens of bytes) beside it, over 1,024.
    let big = vec![b'7'; 1020];
    let f = per_request(&e, 2, 10, 0, |i| post(format!("big-{i}"), &big));
    assert_eq!(shared_data_calls(&f), 6.0, "{f:?}");
    let small = per_request_after(&e, (12, 0), 2, 10, 0, |i| post(format!("small-{i}"), BODY));
    assert_eq!(shared_data_calls(&small), 5.0, "{small:?}");
    assert_eq!(up.executions(), 24);
    assert_eq!(e.stat("idemgate.buffer_budget_exceeded"), 0);
}

/// Host calls a replay from the local tier makes, at most (14 before issue 17 item 4).
const LOCAL_REPLAY_HOST_CALLS: f64 = 11.0;

#[test]
fn count_build_a_replay_from_the_local_tier_stays_within_its_host_calls() {
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(BENCH_LOCAL, up.port);
    o.wasm = Some(count_module());
    o.concurrency = 1;
    o.wasm_log_level = "error".into();
    let e = Envoy::start(&o);
    // The first request executes; every later one with the key is a replay from memory.
    let f = per_request(&e, 3, 20, 0, |_| bench_post(e.port, "replayed"));
    println!("replay from the local tier, per request: {f:?}");
    assert_eq!(up.executions(), 1);
    assert!(
        f["host_calls"] <= LOCAL_REPLAY_HOST_CALLS,
        "host calls per local replay {} > {LOCAL_REPLAY_HOST_CALLS} ({f:?})",
        f["host_calls"]
    );
}

#[test]
fn count_build_a_first_protected_request_with_redis_allocates_a_few_hundred_times_not_thousands() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let plugin = BENCH_LOCAL.replacen(
        '{',
        r#"{"store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 1000}, "#,
        1,
    );
    let mut o = EnvoyOptions::new(&plugin, up.port);
    o.wasm = Some(count_module());
    o.store_port = Some(webdis.port);
    o.concurrency = 1;
    o.wasm_log_level = "error".into();
    let e = Envoy::start(&o);
    // Each first request's completion is written to the store by the root (one answer each).
    let f = per_request(&e, 3, 20, 1, |i| bench_post(e.port, &format!("first-store-{i}")));
    println!("first request, Redis store, per request: {f:?}");
    assert_eq!(up.executions(), 23);
    // Percent-encoding the store's requests once allocated twice per encoded byte: 2,227 a request.
    assert!(f["vm_allocations"] < 400.0, "VM allocations per first request with Redis {} ({f:?})", f["vm_allocations"]);
    assert!(f["store_bytes"] > 0.0, "{f:?}");
    // 46 before issue 17 item 4 (its counters now flushed on the root's tick); 30 while the gauge
    // `store_writes_pending` moved at once (a call when the write was queued, one when it ended),
    // 28 since it moves with the counters on the tick.
    assert!(f["host_calls"] <= 28.0, "host calls per first request with Redis {} ({f:?})", f["host_calls"]);
}

/// VM allocations per first request with the etcd store, at most (issue 27 targets 250): 449 here
/// (518 in `make bench`) while each transaction was written as a tree of small strings and its
/// answers parsed into owned strings, 230 since.
const FIRST_ETCD_VM_ALLOCATIONS: f64 = 240.0;

#[test]
fn count_build_a_first_protected_request_with_etcd_allocates_within_its_bound() {
    let etcd = support::etcd::EtcdCluster::start();
    let up = Upstream::start();
    // As scripts/bench.py's `PLUGIN_ETCD`.
    let plugin = BENCH_LOCAL.replacen(
        '{',
        r#"{"store": {"kind": "etcd", "cluster": "idemgate_store", "timeout_ms": 1000}, "#,
        1,
    );
    let mut o = EnvoyOptions::new(&plugin, up.port);
    o.wasm = Some(count_module());
    o.etcd_ports = etcd.client_ports();
    o.concurrency = 1;
    o.wasm_log_level = "error".into();
    let e = Envoy::start(&o);
    assert_eq!(stat_reaching(&e, "cluster.idemgate_store.membership_healthy", 3), 3);
    // The root grants its lease ahead of need: the first requests may find none yet (503).
    let mut sent = 0;
    let granted = (0..200).any(|i| {
        let k = format!("lease-{i}");
        let h =
            [("content-type", "application/json"), ("authorization", "Bearer bench"), ("idempotency-key", k.as_str())];
        sent += 1;
        let ok = http::request(e.port, "POST", "/bench", &h, BODY).expect("answer").status < 300;
        if !ok {
            std::thread::sleep(Duration::from_millis(50));
        }
        ok
    });
    assert!(granted, "the etcd store never answered");
    let executed = up.executions();
    // Each first request's completion is written to etcd by the root (one answer each), after the
    // lease grant's answer and the completion of the request that found the lease.
    let f = per_request_after(&e, (sent, 2), 3, 20, 1, |i| bench_post(e.port, &format!("first-etcd-{i}")));
    println!("first request, etcd store, per request: {f:?}");
    assert_eq!(up.executions(), executed + 23);
    assert!(f["store_bytes"] > 0.0, "{f:?}");
    assert!(
        f["vm_allocations"] <= FIRST_ETCD_VM_ALLOCATIONS,
        "VM allocations per first request with etcd {} > {FIRST_ETCD_VM_ALLOCATIONS} ({f:?})",
        f["vm_allocations"]
    );
}
