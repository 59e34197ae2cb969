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

/// When `scenario` lets its store be looked at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Moment {
    /// The record is live (replayed).
    Live,
    /// Past the record's ttl, inside its tombstone.
    Tombstone,
}

/// The scenario on `first` (where the key executes) and `other` (the same proxy, or another one
/// sharing the store); `look` asserts on the store's state at each `Moment`.
fn scenario(first: &Envoy, other: &Envoy, up: &Upstream, key: &str, look: impl Fn(Moment)) {
    let r = post(first, key, BODY);
    assert_eq!(r.status, 201, "{}", r.body_text());
    assert_eq!(up.executions(), 1);
    let done = replayed(other, key);
    look(Moment::Live);
    // Past the record's ttl (its completion came before `done`) by more than etcd's 1 s clock
    // skew tolerance (within it a record is judged still live), inside its tombstone.
    sleep_until(done + Duration::from_millis(TTL_MS + 1_500));
    look(Moment::Tombstone);
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
    scenario(&s.envoy, &s.envoy, &s.up, "k-tomb-local", |_| {});
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
    let record = support::redis_key_of(&cfg, AUTH, "k-tomb-redis");
    let tomb = format!("idemgate:v1:t:{{{record}}}");
    let memory = |k: &str| redis.cli(&["MEMORY", "USAGE", k, "SAMPLES", "0"]).trim().parse::<u64>().ok();
    // Issue 40, item 6: the record holds the response for `ttl`; then only the key's small
    // tombstone is left (its fingerprint, sealed: 77 bytes), never the response.
    scenario(&a, &b, &up, "k-tomb-redis", |m| {
        let (r, t) = (redis.get_raw(&record), redis.get_raw(&tomb));
        let pttl = |k: &str| redis.cli(&["PTTL", k]).trim().parse::<i64>().unwrap();
        println!(
            "{m:?}: record {:?} bytes ({:?} in memory), tombstone {:?} bytes ({:?} in memory)",
            r.as_ref().map(Vec::len),
            memory(&record),
            t.as_ref().map(Vec::len),
            memory(&tomb)
        );
        let t = t.unwrap_or_else(|| panic!("{m:?}: no tombstone at {tomb}"));
        assert_eq!((t.len(), &t[..5]), (77, &b"IGS1T"[..]), "{m:?}: the tombstone holds the fingerprint only");
        assert!(!t.windows(BODY.len()).any(|w| w == BODY.as_bytes()));
        match m {
            Moment::Live => {
                let r = r.expect("the record while live");
                assert!(r.starts_with(b"IGS1D"), "completed");
                assert!(
                    pttl(&tomb) > pttl(&record) + (TOMBSTONE_MS as i64) - 1_000,
                    "the tombstone outlives the record"
                );
                assert!(pttl(&record) <= TTL_MS as i64, "the record lives ttl, no longer");
            }
            Moment::Tombstone => assert_eq!(r, None, "past its ttl the record (and its response) is gone"),
        }
    });
}

#[test]
fn two_proxies_on_etcd_a_key_past_its_ttl_meets_its_tombstone_on_either_then_is_free() {
    let etcd = support::etcd::EtcdCluster::start();
    let up = Upstream::start();
    // Outcome-unknown records live 5 s here, so every record's life (at most 8 s: a 3 s lock, then
    // 5 s unknown) is shorter than a tombstone's (15 s): tombstones get leases of their own.
    let cfg = format!(
        r#"{{"scope": {{"headers": ["authorization"]}}, {LIVES}, "unknown_outcome_seconds": 5, "store": {{"kind": "etcd", "cluster": "idemgate_store", "timeout_ms": 1000}}}}"#
    );
    let mut o = EnvoyOptions::new(&cfg, up.port);
    o.etcd_ports = etcd.client_ports();
    o.route_timeout_ms = 1500;
    let a = Envoy::start(&o);
    let b = Envoy::start(&o);
    support::etcd::wait_leases(&a, o.concurrency);
    support::etcd::wait_leases(&b, o.concurrency);
    let hex = support::redis_key_of(&cfg, AUTH, "k-tomb-etcd").trim_start_matches("idemgate:v1:").to_string();
    let record = format!("idemgate/v1/{hex}");
    let tomb = format!("{record}/t");
    // As on Redis: a key of its own holds the key's tombstone (its fingerprint and expiry, sealed
    // for that key: 92 bytes), written with the completion, never the response; the record
    // expires (judged by the proxies' clocks) after `ttl`, the tombstone after `ttl + tombstone`.
    // The lease each key was put under, and the TTL etcd granted it.
    let granted_ttl = |key: &str| -> (i64, i64) {
        let kv =
            etcd.call(0, "/v3/kv/range", &serde_json::json!({"key": idemgate::base64::b64(key.as_bytes())})).unwrap();
        let lease: i64 = kv["kvs"][0]["lease"].as_str().unwrap_or("0").parse().unwrap();
        let t = etcd.call(0, "/v3/lease/timetolive", &serde_json::json!({"ID": lease.to_string()})).unwrap();
        (lease, t["grantedTTL"].as_str().unwrap_or("0").parse().unwrap())
    };
    scenario(&a, &b, &up, "k-tomb-etcd", |m| {
        if m == Moment::Live {
            // The record under the records' lease (a 60 s window + its 8 s life + a 30 s margin),
            // its tombstone under a lease of its own (60 + 15 + 30 s): etcd drops the record
            // `tombstone_seconds` before the tombstone, not with it.
            let ((rl, rttl), (tl, tttl)) = (granted_ttl(&record), granted_ttl(&tomb));
            println!("leases: record {rl} ({rttl} s), tombstone {tl} ({tttl} s)");
            assert_ne!(rl, tl);
            assert_eq!((rttl, tttl), (60 + 8 + 30, 60 + 15 + 30));
        }
        if m == Moment::Tombstone {
            // What etcd does when the record's lease ends (up to 90 s past its ttl: the lease
            // window and margin), done now: the record and its owner mark go, the tombstone stays.
            // The retries below then meet the tombstone alone, and the request after it a
            // tombstone past its expiry whose lease still holds it (claimed once, fenced on it).
            for k in [&record, &format!("{record}/o")] {
                let d = serde_json::json!({"key": idemgate::base64::b64(k.as_bytes())});
                assert!(etcd.call(0, "/v3/kv/deleterange", &d).is_some());
            }
        }
        let all = etcd.all();
        let get = |k: &str| all.iter().find(|(name, _)| name == k.as_bytes()).map(|(_, v)| v.clone());
        let (r, t) = (get(&record), get(&tomb));
        let names: Vec<String> = all.iter().map(|(k, _)| String::from_utf8_lossy(k).replace(&hex, "<hex>")).collect();
        println!(
            "{m:?}: record {:?} bytes, tombstone {:?} bytes, keys {names:?}",
            r.as_ref().map(Vec::len),
            t.as_ref().map(Vec::len)
        );
        let t = t.unwrap_or_else(|| panic!("{m:?}: no tombstone at {tomb}: keys {names:?}"));
        assert_eq!((t.len(), &t[..5]), (92, &b"IGS1T"[..]), "{m:?}: the tombstone holds the fingerprint only");
        assert!(!t.windows(BODY.len()).any(|w| w == BODY.as_bytes()));
        match m {
            Moment::Live => assert!(r.expect("the record while live").starts_with(b"IGE1")),
            Moment::Tombstone => assert_eq!(names, ["idemgate/v1/<hex>/t"], "only the small tombstone is left"),
        }
        // No other key of this storage key than its value, owner mark and tombstone.
        assert!(
            names
                .iter()
                .all(|n| ["idemgate/v1/<hex>", "idemgate/v1/<hex>/o", "idemgate/v1/<hex>/t"].contains(&n.as_str())),
            "{names:?}"
        );
    });
}

/// Issue 40, item 6, the scripts alone on a real Redis (no Envoy, no sleep: the record's expiry is
/// its `DEL`). Sequences that could execute a key twice or leak a response:
/// - a retry racing the record's expiry and the tombstone's write: both are written by the one
///   completion script, the tombstone's `PX` the longer, so no claim finds the record gone and
///   the tombstone not yet there;
/// - a completion whose claim the store lost (written where absent) leaves its tombstone too;
/// - a claim meeting the tombstone claims nothing (the key stays unwritten); a route without
///   tombstones never reads one (its claim claims, as before tombstones);
/// - an outcome-unknown or in-flight record leaves none (it never completed: what it does is
///   unchanged, its own life);
/// - what a tombstone costs in Redis against the record it outlives (a 1 KB response).
#[test]
fn redis_scripts_a_completion_leaves_a_small_tombstone_that_a_claim_meets_once_the_record_is_gone() {
    use idemgate::fingerprint::Fingerprint;
    use idemgate::owner::OwnerToken;
    use idemgate::record::{Creator, Lifetimes, Record, StoredResponse, UnknownReason};
    use idemgate::scope::StorageKey;
    use idemgate::seal::Seal;
    use idemgate::store::{self, Transition};
    use support::store::resp::Value;

    let redis = Redis::start();
    let seal = Seal::new(Some("a-test-secret-of-at-least-32-bytes!!"), None).unwrap();
    let l = Lifetimes { ttl_ms: 60_000, lock_ms: 5_000, unknown_ms: 30_000, tombstone_ms: 120_000 };
    let plain = Lifetimes { tombstone_ms: 0, ..l };
    let fp = Fingerprint([0x2e; 32]);
    let owner = OwnerToken([1; 16]);
    let creator = Creator { request_id: "7f3c2a9e-5b1d-4e8f-9a6c-2d1b0c9e8f7a".into(), log_values: vec![] };
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec()), ("location".into(), b"/c/1".to_vec())],
        body: vec![b'x'; 1_000],
    };
    let run = |cmd: Vec<Vec<u8>>| {
        let args: Vec<&[u8]> = cmd.iter().map(Vec::as_slice).collect();
        redis.command(&args)
    };
    let code = |v: &Value| match v {
        Value::Array(Some(items)) => match items.first() {
            Some(Value::Bulk(Some(b))) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::Int(i)) => i.to_string(),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    };
    let pttl = |k: &str| redis.cli(&["PTTL", k]).trim().parse::<i64>().unwrap();
    let memory = |k: &str| redis.cli(&["MEMORY", "USAGE", k, "SAMPLES", "0"]).trim().parse::<u64>().unwrap();
    let claim = |skey: &StorageKey, lives: &Lifetimes| {
        let rec = Record::in_progress(fp, creator.clone(), owner, 1, lives);
        run(store::claim_command(skey, &owner, &rec, lives, &seal))
    };
    let done = Record::completed(fp, response.clone(), false, creator.clone(), 1, 60);

    // Claimed, then completed: the record for ttl, the tombstone for ttl + tombstone.
    let a = StorageKey([0xa1; 32]);
    let (rk, tk) = (store::redis_key(&a), store::tombstone_redis_key(&a));
    assert_eq!(code(&claim(&a, &l)), "1");
    assert_eq!(redis.get_raw(&tk), None, "a claim writes no tombstone");
    assert_eq!(code(&run(Transition::complete(owner, done.clone(), &l).eval_command(&a, &seal))), "1");
    let (record_ttl, tomb_ttl) = (pttl(&rk), pttl(&tk));
    assert!(record_ttl <= 60_000 && record_ttl > 50_000, "record PX {record_ttl}");
    assert!(tomb_ttl > record_ttl + 110_000, "tombstone PX {tomb_ttl}");
    let (record_bytes, tomb_bytes) = (redis.get_raw(&rk).unwrap().len(), redis.get_raw(&tk).unwrap().len());
    let (record_mem, tomb_mem) = (memory(&rk), memory(&tk));
    println!(
        "Redis, per key: record (1,000-byte body) {record_bytes} value bytes, MEMORY USAGE {record_mem}; \
         tombstone {tomb_bytes} value bytes, MEMORY USAGE {tomb_mem}"
    );
    assert_eq!(tomb_bytes, 77);
    assert!(tomb_mem * 5 < record_mem, "a tombstone is small: {tomb_mem} vs {record_mem}");
    // While the record lives a claim reads it (a replay), not the tombstone.
    assert_eq!(code(&claim(&a, &l)), "0");
    // The record expires: a claim meets the tombstone and claims nothing.
    redis.command(&[b"DEL", rk.as_bytes()]);
    let met = claim(&a, &l);
    assert_eq!(code(&met), "3", "{met:?}");
    let Value::Array(Some(items)) = met else { unreachable!() };
    let Value::Bulk(Some(v)) = &items[2] else { panic!("{items:?}") };
    assert_eq!(store::open_tombstone(v, &a, &seal), Ok(fp));
    assert_eq!(redis.get_raw(&rk), None, "nothing claimed");
    // A route without tombstones claims, as before them.
    assert_eq!(code(&claim(&a, &plain)), "1");
    // Its owner's release (the claim never ran) keeps the tombstone: the memory of the first run.
    assert_eq!(code(&run(Transition::release(owner).eval_command(&a, &seal))), "1");
    assert_eq!((redis.get_raw(&rk), redis.get_raw(&tk).map(|v| v.len())), (None, Some(77)));
    // An operator's `forget` of a completed key deletes its tombstone with it: its next retry
    // executes, as `idemgate forget` says (`admin::FORGOTTEN`).
    assert_eq!(code(&claim(&a, &plain)), "1");
    assert_eq!(code(&run(Transition::complete(owner, done.clone(), &l).eval_command(&a, &seal))), "1");
    let forget = Transition { forget_tombstone: true, ..Transition::release(owner) };
    assert_eq!(code(&run(Transition { expected_phases: "D", ..forget }.eval_command(&a, &seal))), "1");
    assert_eq!((redis.get_raw(&rk), redis.get_raw(&tk)), (None, None), "forgotten, tombstone too");
    assert_eq!(code(&claim(&a, &l)), "1", "the next retry executes");

    // A completion whose claim the store lost is written where absent, with its tombstone.
    let b = StorageKey([0xb2; 32]);
    assert_eq!(code(&run(Transition::complete(owner, done.clone(), &l).eval_command(&b, &seal))), "2");
    assert!(redis.get_raw(store::tombstone_redis_key(&b)).is_some());
    // Its body-less rewrite (too large for the store) too.
    let c = StorageKey([0xc3; 32]);
    assert_eq!(code(&claim(&c, &l)), "1");
    let lean = Transition::complete(owner, done.clone(), &l).without_body().unwrap();
    assert_eq!(code(&run(lean.eval_command(&c, &seal))), "1");
    assert_eq!(redis.get_raw(store::tombstone_redis_key(&c)).map(|v| v.len()), Some(77));

    // Outcome-unknown and in flight: no tombstone, before or after their record ends.
    let d = StorageKey([0xd4; 32]);
    assert_eq!(code(&claim(&d, &l)), "1");
    let gone = Record::unknown(fp, creator.clone(), UnknownReason::UpstreamTimeout, 1, &l);
    assert_eq!(code(&run(Transition::unknown(owner, gone, &l).eval_command(&d, &seal))), "1");
    assert_eq!(redis.get_raw(store::tombstone_redis_key(&d)), None);
    // A completion on a route without tombstones writes none.
    let e = StorageKey([0xe5; 32]);
    assert_eq!(code(&claim(&e, &plain)), "1");
    assert_eq!(code(&run(Transition::complete(owner, done, &plain).eval_command(&e, &seal))), "1");
    assert_eq!(redis.get_raw(store::tombstone_redis_key(&e)), None);
    assert!(pttl(&store::redis_key(&e)) > 50_000, "the record: ttl");
}

/// Issue 40, item 6, through a Redis Cluster (Envoy's `redis_proxy` behind webdis): the scripts
/// name the record's key and its tombstone's, which Redis Cluster runs only when both are in one
/// slot (`CROSSSLOT` otherwise): the tombstone's hash tag is the record's key. A completion with
/// its tombstone lands (replayed on the other proxy), and the tombstone sits on the record's node.
#[test]
fn through_a_redis_cluster_a_completion_and_its_tombstone_land_in_one_slot() {
    let cluster = support::store::RedisCluster::start();
    let up = Upstream::start();
    let cfg = format!(
        r#"{{"scope": {{"headers": ["authorization"]}}, {LIVES}, "store": {{"cluster": "idemgate_store", "timeout_ms": 1000}}}}"#
    );
    let mut o = EnvoyOptions::new(&cfg, up.port);
    o.store_port = Some(cluster.webdis.port);
    o.route_timeout_ms = 1500;
    let a = Envoy::start(&o);
    let b = Envoy::start(&o);
    for n in 0..4 {
        let key = format!("k-tomb-cluster-{n}");
        let r = post(&a, &key, BODY);
        assert_eq!(r.status, 201, "{}", r.body_text());
        replayed(&b, &key);
    }
    assert_eq!(up.executions(), 4);
    assert_eq!(a.stat("idemgate.store_write_failures") + b.stat("idemgate.store_write_failures"), 0);
    a.assert_no_wasm_panic();
    b.assert_no_wasm_panic();
}

/// `idemgate.local_record_bytes` once it satisfies `ok`, waiting at most 8 sweep passes (bounded
/// by count, as `faults::capacity`): the gauge is the sweep's.
fn record_bytes_reaching(e: &Envoy, ok: impl Fn(u64) -> bool) -> u64 {
    let passes = e.stat("idemgate.local_sweep_passes");
    for _ in 0..3000 {
        let v = e.stat("idemgate.local_record_bytes");
        if ok(v) || e.stat("idemgate.local_sweep_passes") >= passes + 8 {
            return v;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    e.stat("idemgate.local_record_bytes")
}

/// Issue 40, item 6: the local tier's tombstone is small. A 1 KB response is kept whole for its
/// ttl (the table counts over 1 KB), then only as its key's tombstone (the fingerprint: 84 bytes,
/// `local::TOMBSTONE_BODY_BYTES`), answered 410 and 422 without executing, and the key is free
/// after ttl + tombstone (the upstream ran twice in all). Before the change the gauge stayed over
/// 1 KB through the tombstone.
#[test]
fn local_tier_a_tombstone_keeps_the_fingerprint_only_and_the_table_bytes_drop() {
    // One bucket: every sweep (each root's, once a second) reads the whole table, so the gauge
    // follows within a second.
    let cfg = format!(r#"{{"scope": {{"headers": ["authorization"]}}, "local": {{"max_entries": 64}}, {LIVES}}}"#);
    let s = Stack::with(&cfg, |o| o.route_timeout_ms = 1500);
    let key = "k-tomb-small";
    let send = |body: &str| {
        let h = vec![("authorization", AUTH), ("idempotency-key", key), ("x-up-body-bytes", "1024")];
        http::request(s.envoy.port, "POST", "/charges", &h, body.as_bytes()).expect("request")
    };
    let r = send(BODY);
    assert_eq!((r.status, r.body.len()), (201, 1024), "{}", r.body_text());
    let done = Instant::now();
    assert_eq!(s.up.executions(), 1);
    let live = record_bytes_reaching(&s.envoy, |b| b > 1024);
    assert!(live > 1024, "the live record is counted whole: {live}");
    sleep_until(done + Duration::from_millis(TTL_MS + 1_500));
    let tomb = record_bytes_reaching(&s.envoy, |b| b <= 84);
    assert_eq!(tomb, 84, "only the key's tombstone is left");
    let retry = send(BODY);
    assert_eq!((retry.status, retry.problem().as_str()), (410, "key-expired"), "{}", retry.body_text());
    assert_eq!(retry.header("idempotent-replayed"), None);
    let reused = send(r#"{"amount":7}"#);
    assert_eq!((reused.status, reused.problem().as_str()), (422, "key-reused"), "{}", reused.body_text());
    assert_eq!(s.up.executions(), 1);
    sleep_until(done + Duration::from_millis(TTL_MS + TOMBSTONE_MS + 1_000));
    let fresh = send(BODY);
    assert_eq!(fresh.status, 201, "{}", fresh.body_text());
    assert_eq!(fresh.header("idempotent-replayed"), None);
    assert_eq!(s.up.executions(), 2);
    s.envoy.assert_no_wasm_panic();
}
