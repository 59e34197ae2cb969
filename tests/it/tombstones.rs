//! Tombstones (issue 40, item 6) on real Envoy 1.40 with a counting upstream: a key retried after
//! its record expired (`ttl_seconds`) meets the key's tombstone (`tombstone_seconds`) and is
//! refused 410 `key-expired`, never executed; another request under it is 422; once the tombstone
//! expires the key is free. The local tier of one proxy, two proxies on Redis behind webdis, and
//! two on etcd. Every test asserts how many times the upstream executed.
//!
//! The sleeps are the subject (`ttl_seconds` and `tombstone_seconds` are protocol timings). Each
//! is timed from an instant the test saw after the completion (a replay received), so a slow
//! machine only moves a retry later: the retries inside the tombstone have 10 s of slack, the
//! last one is past every tier's expiry whenever it comes.

use crate::support;

use std::time::{Duration, Instant};

use support::http::{self, Response};
use support::store::{Redis, Webdis};
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions, Stack};

const AUTH: &str = "Bearer alice";
const BODY: &str = r#"{"amount":42}"#;
/// ttl 5 s (above a 3 s lock by the 2 s etcd asks, above the store's 1 s timeout and the 1.5 s route timeout), a
/// 10 s tombstone.
const TTL_MS: u64 = 5_000;
const TOMBSTONE_MS: u64 = 10_000;
const LIVES: &str = r#""ttl_seconds": 5, "lock_ttl_seconds": 3, "tombstone_seconds": 10"#;

fn post(e: &Envoy, key: &str, body: &str) -> Response {
    let h: Vec<(&str, &str)> = vec![("authorization", AUTH), ("idempotency-key", key)];
    http::request(e.port, "POST", "/charges", &h, body.as_bytes()).expect("request")
}

fn sleep_until(t: Instant) {
    if let Some(d) = t.checked_duration_since(Instant::now()) {
        std::thread::sleep(d);
    }
}

/// A replay of `key` on `e` (at most 100 tries, 20 ms apart: the completion may still be on its
/// way to the store); returns the instant it was received, after the record's completion.
fn replayed(e: &Envoy, key: &str) -> Instant {
    let mut last = String::new();
    for _ in 0..100 {
        let r = post(e, key, BODY);
        if r.status == 201 && r.header("idempotent-replayed") == Some("true") {
            return Instant::now();
        }
        last = format!("{} {}", r.status, r.problem());
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{key} never replayed: {last}");
}

/// The scenario on `first` (where the key executes) and `other` (the same proxy, or another one
/// sharing the store).
fn scenario(first: &Envoy, other: &Envoy, up: &Upstream, key: &str) {
    let r = post(first, key, BODY);
    assert_eq!(r.status, 201, "{}", r.body_text());
    assert_eq!(up.executions(), 1);
    let done = replayed(other, key);
    // Past the record's ttl (its completion came before `done`) by more than etcd's 1 s clock
    // skew tolerance (within it a record is judged still live), inside its tombstone.
    sleep_until(done + Duration::from_millis(TTL_MS + 1_500));
    for (e, name) in [(first, "first"), (other, "other")] {
        let retry = post(e, key, BODY);
        assert_eq!(
            up.executions(),
            1,
            "executions: the retry on {name} ran again ({} {})",
            retry.status,
            retry.problem()
        );
        assert_eq!((retry.status, retry.problem().as_str()), (410, "key-expired"), "{name}: {}", retry.body_text());
        assert_eq!(retry.header("idempotent-replayed"), None);
        let reused = post(e, key, r#"{"amount":7}"#);
        assert_eq!((reused.status, reused.problem().as_str()), (422, "key-reused"), "{name}: {}", reused.body_text());
    }
    assert_eq!(up.executions(), 1);
    assert!(first.stat("idemgate.key_expired") >= 1, "counted");
    // Past the tombstone in every tier: the key is free.
    sleep_until(done + Duration::from_millis(TTL_MS + TOMBSTONE_MS + 1_000));
    let fresh = post(other, key, BODY);
    assert_eq!(fresh.status, 201, "{}", fresh.body_text());
    assert_eq!(fresh.header("idempotent-replayed"), None);
    assert_eq!(up.executions(), 2);
    first.assert_no_wasm_panic();
    other.assert_no_wasm_panic();
}

#[test]
fn local_tier_a_key_past_its_ttl_meets_its_tombstone_then_is_free() {
    let cfg = format!(r#"{{"scope": {{"headers": ["authorization"]}}, {LIVES}}}"#);
    let s = Stack::with(&cfg, |o| o.route_timeout_ms = 1500);
    scenario(&s.envoy, &s.envoy, &s.up, "k-tomb-local");
}

#[test]
fn two_proxies_on_redis_a_key_past_its_ttl_meets_its_tombstone_on_either_then_is_free() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let cfg = format!(
        r#"{{"scope": {{"headers": ["authorization"]}}, {LIVES}, "store": {{"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 1000}}}}"#
    );
    let mut o = EnvoyOptions::new(&cfg, up.port);
    o.store_port = Some(webdis.port);
    o.route_timeout_ms = 1500;
    let a = Envoy::start(&o);
    let b = Envoy::start(&o);
    scenario(&a, &b, &up, "k-tomb-redis");
}

#[test]
fn two_proxies_on_etcd_a_key_past_its_ttl_meets_its_tombstone_on_either_then_is_free() {
    let etcd = support::etcd::EtcdCluster::start();
    let up = Upstream::start();
    let cfg = format!(
        r#"{{"scope": {{"headers": ["authorization"]}}, {LIVES}, "store": {{"kind": "etcd", "cluster": "idemgate_store", "timeout_ms": 1000}}}}"#
    );
    let mut o = EnvoyOptions::new(&cfg, up.port);
    o.etcd_ports = etcd.client_ports();
    o.route_timeout_ms = 1500;
    let a = Envoy::start(&o);
    let b = Envoy::start(&o);
    support::etcd::wait_leases(&a, o.concurrency);
    support::etcd::wait_leases(&b, o.concurrency);
    scenario(&a, &b, &up, "k-tomb-etcd");
}
