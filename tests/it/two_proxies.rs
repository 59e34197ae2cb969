//! Two Envoy 1.40 instances sharing one external store (Redis behind webdis), in front of one
//! counting upstream. Every test asserts how many times the upstream executed.

use crate::support;

use std::time::Duration;

use support::http::{self, Response};
use support::store::{Redis, RedisCluster, Webdis};
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions};

/// The fault and security cases (`make test-faults`).
mod faults;

/// The plugin configuration most tests use: a store timeout of 2 s, so that a loaded machine's
/// slow webdis answer is not taken for an outage (tests of the timeout itself set their own).
fn cfg(extra: &str) -> String {
    format!(
        r#"{{"scope": {{"headers": ["authorization"]}}, "store": {{"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 2000{extra}}}}}"#
    )
}

struct Pair {
    up: Upstream,
    a: Envoy,
    b: Envoy,
}

impl Pair {
    fn new(webdis_port: u16, plugin: &str) -> Pair {
        Pair::with(webdis_port, plugin, |_| {})
    }

    fn with(webdis_port: u16, plugin: &str, f: impl Fn(&mut EnvoyOptions)) -> Pair {
        let up = Upstream::start();
        let mut o = EnvoyOptions::new(plugin, up.port);
        o.store_port = Some(webdis_port);
        f(&mut o);
        let a = Envoy::start(&o);
        let b = Envoy::start(&o);
        Pair { up, a, b }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.a.assert_no_wasm_panic();
            self.b.assert_no_wasm_panic();
        }
    }
}

fn post(envoy: &Envoy, key: &str, body: &str, extra: &[(&str, &str)]) -> Response {
    let mut h: Vec<(&str, &str)> = vec![("authorization", "Bearer alice-secret-token"), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    http::request(envoy.port, "POST", "/charges", &h, body.as_bytes()).expect("request")
}

fn problem_type(r: &Response) -> String {
    r.json()["type"].as_str().unwrap_or("").to_string()
}

/// Waits until `key`'s record is completed in Redis (its phase byte 'D'), where the other proxy
/// reads it: the root context writes the completion after the answer, on its own time.
fn completed_in_store(redis: &Redis, plugin: &str, key: &str) {
    let name = redis_key_of(plugin, key);
    support::wait_for(&format!("{key}'s completed record in Redis"), 200, || {
        redis.get_raw(&name).is_some_and(|v| v.get(4) == Some(&b'D'))
    });
}

#[test]
fn the_other_proxy_replays_without_executing_and_then_serves_replays_from_memory() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(webdis.port, &cfg(""));
    let first = post(&p.a, "k-x", r#"{"amount":5}"#, &[]);
    assert_eq!(first.status, 201);
    completed_in_store(&redis, &cfg(""), "k-x");
    let again = post(&p.b, "k-x", r#"{"amount":5}"#, &[]);
    assert_eq!(again.status, 201);
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(p.up.executions(), 1);
    // One store round trip for the first request on each proxy; a replay served from b's memory
    // afterwards makes none.
    // The completion write is counted by a's root when it sends it, after the request's on_log,
    // and reaches /stats on its next tick: b's replay can come first.
    assert!(
        eventually(Duration::from_secs(20), || p.a.stat("idemgate.store_calls") == 2),
        "claim + completion write: {} store calls",
        p.a.stat("idemgate.store_calls")
    );
    assert_eq!(p.a.stat("idemgate.store_calls_waited"), 1, "only the claim-or-read is on the critical path");
    let calls_b = p.b.stat("idemgate.store_calls");
    assert_eq!(calls_b, 1, "b: one claim-or-read that found the record");
    let third = post(&p.b, "k-x", r#"{"amount":5}"#, &[]);
    assert_eq!(third.body, first.body);
    assert_eq!(p.b.stat("idemgate.store_calls"), calls_b, "a local replay makes zero store round trips");
    assert_eq!(p.up.executions(), 1);
}

#[test]
fn forty_concurrent_duplicates_across_both_proxies_execute_exactly_once() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(webdis.port, &cfg(""));
    let ports = [p.a.port, p.b.port];
    let threads: Vec<_> = (0..40)
        .map(|i| {
            let port = ports[i % 2];
            std::thread::spawn(move || {
                let h = [("authorization", "Bearer alice"), ("idempotency-key", "k-40"), ("x-up-delay-ms", "300")];
                http::request(port, "POST", "/charges", &h, b"{}").expect("request")
            })
        })
        .collect();
    let answers: Vec<Response> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(p.up.executions(), 1);
    for r in &answers {
        assert!(r.status == 201 || r.status == 409, "{}: {}", r.status, r.body_text());
    }
    assert_eq!(answers.iter().filter(|r| r.status == 201 && r.header("idempotent-replayed").is_none()).count(), 1);
}

#[test]
fn a_mismatch_across_proxies_is_422() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(webdis.port, &cfg(""));
    assert_eq!(post(&p.a, "k-m", r#"{"amount":5}"#, &[]).status, 201);
    completed_in_store(&redis, &cfg(""), "k-m");
    let r = post(&p.b, "k-m", r#"{"amount":6}"#, &[]);
    assert_eq!(r.status, 422);
    assert_eq!(problem_type(&r), "urn:idemgate:problem:key-reused");
    assert_eq!(p.up.executions(), 1);
}

#[test]
fn pass_mode_forwards_unprotected_when_the_store_is_down() {
    let mut redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(webdis.port, &cfg(r#", "on_unavailable": "pass""#));
    redis.kill9();
    assert_eq!(post(&p.a, "k-pass", "{}", &[]).status, 201);
    assert_eq!(post(&p.a, "k-pass", "{}", &[]).status, 201);
    assert_eq!(p.up.executions(), 2, "unprotected while the store is down, as configured");
    assert_eq!(p.a.stat("idemgate.store_passed_unprotected"), 2);
}

/// Polls `cond` every 100 ms for at most `limit`.
fn eventually(limit: Duration, cond: impl Fn() -> bool) -> bool {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < limit {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    cond()
}

/// Sends a slow protected request through `port` and kills Redis while the upstream works, so
/// the completion write after the response finds the store down.
fn first_attempt_outliving_redis(port: u16, redis: &mut Redis, key: &'static str) -> Response {
    let t = std::thread::spawn(move || {
        let h = [("authorization", "Bearer alice-secret-token"), ("idempotency-key", key), ("x-up-delay-ms", "2500")];
        http::request(port, "POST", "/charges", &h, b"{}")
    });
    // Claimed and forwarded; wait past appendfsync everysec so the claim itself is durable.
    std::thread::sleep(Duration::from_millis(1500));
    redis.kill9();
    t.join().unwrap().unwrap()
}

const WRITE_FAIL_CFG: &str = r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 2, "store": {"cluster": "idemgate_store", "timeout_ms": 300}}"#;

#[test]
fn through_a_redis_cluster_duplicates_execute_exactly_once() {
    let cluster = RedisCluster::start();
    let p = Pair::new(cluster.webdis.port, &cfg(""));
    for n in 0..20 {
        let key = format!("k-cluster-{n}");
        let first = post(&p.a, &key, "{}", &[]);
        assert_eq!(first.status, 201, "{}", first.body_text());
        // The completion write has landed (under load it may take a retry).
        assert!(
            eventually(Duration::from_secs(20), || p.a.stat("idemgate.store_writes") > n),
            "{key}: write never landed"
        );
        let again = post(&p.b, &key, "{}", &[]);
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{key}: {}", again.body_text());
    }
    assert_eq!(p.up.executions(), 20);
    let ports = [p.a.port, p.b.port];
    let threads: Vec<_> = (0..20)
        .map(|i| {
            std::thread::spawn(move || {
                let h = [
                    ("authorization", "Bearer alice"),
                    ("idempotency-key", "k-cluster-burst"),
                    ("x-up-delay-ms", "200"),
                ];
                http::request(ports[i % 2], "POST", "/charges", &h, b"{}").unwrap()
            })
        })
        .collect();
    for t in threads {
        let r = t.join().unwrap();
        assert!(r.status == 201 || r.status == 409, "{}", r.body_text());
    }
    assert_eq!(p.up.executions(), 21);
}

/// Two proxies with `in_flight: "wait"` and this `wait_ms`.
fn wait_pair(webdis_port: u16, wait_ms: u64) -> Pair {
    Pair::new(
        webdis_port,
        &format!(
            r#"{{"scope": {{"headers": ["authorization"]}}, "in_flight": "wait", "wait_ms": {wait_ms}, "store": {{"cluster": "idemgate_store", "timeout_ms": 500}}}}"#
        ),
    )
}

/// A first attempt sent through `port` in the background, with `extra` headers for the upstream.
fn in_background(
    port: u16,
    key: &'static str,
    extra: &[(&'static str, &'static str)],
) -> std::thread::JoinHandle<Response> {
    let mut h = vec![("authorization", "Bearer alice-secret-token"), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    std::thread::spawn(move || http::request(port, "POST", "/charges", &h, b"{}").unwrap())
}

#[test]
fn wait_mode_across_proxies_gives_the_retry_the_replay() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = wait_pair(webdis.port, 5000);
    let first = in_background(p.a.port, "k-xwait", &[("x-up-delay-ms", "1000")]);
    std::thread::sleep(Duration::from_millis(200));
    let retry = post(&p.b, "k-xwait", "{}", &[]);
    let first = first.join().unwrap();
    assert_eq!(retry.status, 201, "{}", retry.body_text());
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(p.up.executions(), 1);
    // b asked the store a bounded number of times while it waited (at most every 300 ms).
    assert!(p.b.stat("idemgate.store_calls") <= 6, "{} store calls", p.b.stat("idemgate.store_calls"));
}

/// A retry held by `in_flight: "wait"` with a store, answered `response-not-stored` from the
/// store's record (completed too large: over `max_response_body_bytes`; the local tier holds no
/// record of it, so the waiter polls the store), counts `replayed` and `wait_answered`, as a retry
/// meeting the key directly counts `replayed`, in both builds (`metrics::wait_counters`). One
/// proxy is enough for the store's path. The first attempt is held at the upstream until the
/// retry waits (ordered by the counters, never by time).
#[test]
fn wait_mode_with_a_store_counts_a_response_not_stored_as_a_replay() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(
        r#"{"scope": {"headers": ["authorization"]}, "in_flight": "wait", "wait_ms": 20000, "max_response_body_bytes": 100, "store": {"cluster": "idemgate_store", "timeout_ms": 500}}"#,
        up.port,
    );
    o.store_port = Some(webdis.port);
    let e = Envoy::start(&o);
    let first = in_background(e.port, "k-xwait-big", &[("x-up-hold", "1"), ("x-up-body-bytes", "5000")]);
    support::wait_for("the first attempt at the upstream", 400, || up.executions() == 1);
    let retry = in_background(e.port, "k-xwait-big", &[]);
    support::wait_for("the retry held", 400, || e.stat("idemgate.waited") == 1);
    up.release_holds();
    assert_eq!(first.join().expect("first").status, 201);
    let retry = retry.join().expect("retry");
    assert_eq!((retry.status, problem_type(&retry).as_str()), (201, "urn:idemgate:problem:response-not-stored"));
    assert_eq!(
        (e.stat("idemgate.wait_answered"), e.stat("idemgate.replayed")),
        (1, 1),
        "the waiting retry counts wait_answered and replayed"
    );
    let direct = post(&e, "k-xwait-big", "{}", &[]);
    assert_eq!((direct.status, problem_type(&direct).as_str()), (201, "urn:idemgate:problem:response-not-stored"));
    assert_eq!(e.stat("idemgate.replayed"), 2, "the direct retry counts replayed");
    assert_eq!(up.executions(), 1);
}

/// Issue 13, 3: a write queued in a root context (here a completion write retried while Redis is
/// down) must survive the plugin being reloaded: the old root context holds its VM until the
/// write lands (or a bound passes), so the other proxy replays instead of answering
/// outcome-unknown for an operation that succeeded.
#[test]
fn a_completion_write_queued_when_the_plugin_is_reloaded_still_lands() {
    let mut redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(WRITE_FAIL_CFG, up.port);
    o.store_port = Some(webdis.port);
    o.lds = true;
    // A replaced listener lives for the drain time (600 s by default): 1 s here, so the old
    // root contexts are stopped while their write still waits for the store.
    o.drain_time_s = Some(1);
    let a = Envoy::start(&o);
    o.lds = false;
    let b = Envoy::start(&o);
    let first = first_attempt_outliving_redis(a.port, &mut redis, "k-reload");
    assert_eq!(first.status, 201, "the client still gets its response");
    assert!(eventually(Duration::from_secs(10), || a.stat("idemgate.store_write_retries") >= 1));
    assert_eq!(a.stat("idemgate.store_writes_pending"), 1, "the gauge shows the write waiting");
    // The plugin configuration changes while the write waits for its retry: Envoy replaces the
    // listener and stops the old plugin's root contexts.
    let updates = |e: &Envoy| e.stats("listener_manager.lds.update_success").first().map_or(0, |(_, v)| *v);
    let before = updates(&a);
    // Only the plugin configuration changes (the same VM serves the new root contexts). A new
    // module or VM configuration starts a new VM and Envoy destroys the old one with its
    // listener: docs/stores.md says to keep the drain time above the write retry window for that.
    o.lds = true;
    o.plugin_config =
        WRITE_FAIL_CFG.replace("\"lock_ttl_seconds\": 2", "\"lock_ttl_seconds\": 2, \"ttl_seconds\": 86401");
    a.reload_listener(&o);
    assert!(eventually(Duration::from_secs(15), || updates(&a) > before), "the listener was not reloaded");
    // The old listener is dropped after the 1 s drain time; the store stays down a while longer,
    // so the write can land only if the old root context is still there to retry it (next
    // retries: 1.4 s and 3.0 s after the first failure).
    std::thread::sleep(Duration::from_millis(1300));
    redis.restart();
    assert!(eventually(Duration::from_secs(10), || a.stat("idemgate.store_writes") >= 1), "the write never landed");
    assert_eq!(a.stat("idemgate.store_writes_pending"), 0);
    let r = post(&b, "k-reload", "{}", &[]);
    assert_eq!((r.status, r.header("idempotent-replayed")), (201, Some("true")), "{}", r.body_text());
    assert_eq!(r.body, first.body);
    assert_eq!(up.executions(), 1);
    a.assert_no_wasm_panic();
    b.assert_no_wasm_panic();
}

/// Issue 13, 6: a request waiting on another proxy's attempt that is then released (the upstream
/// answered 429, in `release_on_status`: it did not execute) is told so at once: 409 with
/// `retry-after: 0`, not held until `wait_ms` and then told to wait 1 s more.
#[test]
fn wait_mode_answers_a_waiter_as_soon_as_the_first_attempt_is_released() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = wait_pair(webdis.port, 8000);
    let first = in_background(p.a.port, "k-xrel", &[("x-up-delay-ms", "800"), ("x-up-status", "429")]);
    std::thread::sleep(Duration::from_millis(200));
    let started = std::time::Instant::now();
    let retry = post(&p.b, "k-xrel", "{}", &[]);
    let waited = started.elapsed();
    assert_eq!(first.join().unwrap().status, 429);
    assert_eq!((retry.status, problem_type(&retry).as_str()), (409, "urn:idemgate:problem:request-in-flight"));
    assert_eq!(retry.header("retry-after"), Some("0"), "released: retry now ({waited:?})");
    assert!(waited < Duration::from_millis(6000), "answered when released, not at wait_ms ({waited:?})");
    // The released key executes for the next attempt.
    let again = post(&p.b, "k-xrel", "{}", &[]);
    assert_eq!(again.status, 201, "{}", again.body_text());
    assert_eq!(p.up.executions(), 2, "the 429 attempt and the retry");
}

/// The Redis key idemgate uses for `key` sent by this suite's caller (`post`).
fn redis_key_of(plugin: &str, key: &str) -> String {
    support::redis_key_of(plugin, "Bearer alice-secret-token", key)
}

#[test]
fn a_record_this_build_cannot_read_is_never_forwarded_even_in_pass_mode() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let plugin = cfg(r#", "on_unavailable": "pass""#);
    let p = Pair::new(webdis.port, &plugin);
    // A completed record as this build writes it, to turn into ones it cannot read.
    post(&p.a, "k-readable", "{}", &[]);
    completed_in_store(&redis, &plugin, "k-readable");
    let good = redis.get_raw(redis_key_of(&plugin, "k-readable")).expect("the record idemgate wrote");
    assert_eq!(p.up.executions(), 1);
    let mut future_record = good.clone();
    future_record[52 + 3] = 2; // "IGS1" header (52 bytes), then "IGR" and the record version
    let mut future_value = good.clone();
    future_value[3] = b'2'; // "IGS2": a value format of a later release
    let cases: [(&str, Vec<u8>); 4] = [
        ("garbled", b"\x00\xffnot an idemgate value".to_vec()),
        ("truncated", good[..good.len() - 3].to_vec()),
        ("future record version", future_record),
        ("future value format", future_value),
    ];
    for (i, (what, value)) in cases.iter().enumerate() {
        let key = format!("k-unreadable-{i}");
        redis.command(&[b"SET", redis_key_of(&plugin, &key).as_bytes(), value, b"PX", b"60000"]);
        let r = post(&p.a, &key, "{}", &[]);
        assert_eq!(p.up.executions(), 1, "{what}: a retry whose record exists was executed");
        assert_eq!(r.status, 503, "{what}: {}", r.body_text());
        assert_eq!(problem_type(&r), "urn:idemgate:problem:record-unreadable", "{what}");
        assert_eq!(r.header("x-should-retry"), Some("true"), "{what}");
        // The record is left as it is (another proxy may read it), and stays refused.
        assert_eq!(redis.get_raw(redis_key_of(&plugin, &key)).as_deref(), Some(value.as_slice()), "{what}");
        assert_eq!(post(&p.b, &key, "{}", &[]).status, 503, "{what}");
    }
    assert_eq!(p.up.executions(), 1);
    assert_eq!(p.a.stat("idemgate.record_unreadable"), cases.len() as u64);
    assert_eq!(p.a.stat("idemgate.store_passed_unprotected"), 0);
    assert!(p.a.log().contains("outcome=record_unreadable"), "{}", p.a.log());
}

/// Redis's own clock (`TIME`), in ms.
fn redis_now_ms(redis: &Redis) -> u64 {
    let t = redis.command(&[b"TIME"]).into_array();
    let part = |i: usize| -> u64 {
        let b = t.get(i).cloned().and_then(|v| v.into_bulk()).expect("TIME part");
        String::from_utf8_lossy(&b).parse().expect("TIME number")
    };
    part(0) * 1000 + part(1) / 1000
}

/// Sleeps until `t` (no-op if it has passed).
fn sleep_until(t: std::time::Instant) {
    if let Some(d) = t.checked_duration_since(std::time::Instant::now()) {
        std::thread::sleep(d);
    }
}

/// Issue 13, item 7, through Envoy with two proxies: `ttl_seconds` 4, `unknown_outcome_seconds`
/// 600. A request times out at the route (outcome unknown, one execution). 5.3 s later (past the
/// claim's `ttl_seconds`, far inside `unknown_outcome_seconds`) both proxies must answer 409
/// `outcome-unknown`: the store's record lives `unknown_outcome_seconds` from the moment it became
/// unknown, as the local tier's does. (The sleep is the subject: the TTL.)
///
/// Issue 39: this test ran alone for a while because, in three parallel runs of its file, its
/// outcome-unknown write "never reached the store". Two ways that write could miss this test's
/// Redis are shown and closed: a webdis that could not bind its port was taken for started
/// while another test's webdis answered on it (`store_support_smoke::
/// a_webdis_whose_port_another_webdis_holds_never_starts_as_that_one`; the write then landed,
/// silently, in another test's Redis), and a root never woken for the write, with no tick to
/// collect it then (`faults::matrix::fault_matrix_an_outcome_unknown_mark_whose_wake_is_lost_
/// still_lands`). If it ever fails here again, the message says which proxy counters moved and
/// whose webdis answered.
#[test]
fn an_outcome_unknown_record_lives_unknown_outcome_seconds_on_every_proxy() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let plugin = r#"{"scope": {"headers": ["authorization"]}, "ttl_seconds": 4, "lock_ttl_seconds": 2, "unknown_outcome_seconds": 600, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 500}}"#;
    let p = Pair::with(webdis.port, plugin, |o| o.route_timeout_ms = 1000);
    let started = std::time::Instant::now();
    let first = post(&p.a, "k-unknown-life", "{}", &[("x-up-delay-ms", "1500")]);
    assert_eq!(first.status, 504, "{}", first.body_text());
    assert_eq!(p.up.executions(), 1);
    let name = redis_key_of(plugin, "k-unknown-life");
    if !eventually(Duration::from_secs(20), || redis.get_raw(&name).is_some_and(|v| v.get(4) == Some(&b'U'))) {
        let stats: Vec<(String, u64)> = ["store_calls", "store_writes", "store_write_retries", "store_write_failures"]
            .iter()
            .chain(&["store_writes_pending", "root_wakes_missed", "unknown_outcome", "local_errors"])
            .map(|n| (n.to_string(), p.a.stat(&format!("idemgate.{n}"))))
            .collect();
        let log = p.a.log();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("idemgate")).collect();
        panic!(
            "the store never learned the outcome is unknown: value {:?}; keys {:?}; webdis on port {} is ours: {}; \
             proxy a's counters {stats:?}; its idemgate log lines:\n{}",
            redis.get_raw(&name).map(|v| String::from_utf8_lossy(&v[..v.len().min(8)]).into_owned()),
            redis.keys("*"),
            webdis.port,
            support::listener_is_owned_by(webdis.pid(), webdis.port),
            lines[lines.len().saturating_sub(30)..].join("\n")
        );
    }
    sleep_until(started + Duration::from_millis(5300));
    for (name, proxy) in [("a (saw it)", &p.a), ("b", &p.b)] {
        let r = post(proxy, "k-unknown-life", "{}", &[]);
        assert_eq!(
            p.up.executions(),
            1,
            "executions: proxy {name} executed an outcome-unknown key again ({} {})",
            r.status,
            problem_type(&r)
        );
        assert_eq!((r.status, problem_type(&r).as_str()), (409, "urn:idemgate:problem:outcome-unknown"), "{name}");
    }
}

/// Issue 13, item 2: store values are judged by Redis's clock only. Values are written straight
/// into Redis as a proxy whose clock is off would have written them (the record's own expiry
/// shifted; the lock and `PX` as the scripts set them, by Redis's clock). `ttl_seconds` 4,
/// `lock_ttl_seconds` 2:
/// - a forwarded claim written by a proxy 3 s behind Redis: in flight while its lock is live, then
///   outcome-unknown once it is stale, never taken over and executed;
/// - a completed record written by a proxy 3 s behind: replayed for its whole `PX`, never
///   executed again early;
/// - a completed record written by a proxy 30 s ahead: executed again once its `PX` (its life by
///   Redis's clock) is over, not 30 s later.
#[test]
fn store_values_are_judged_by_redis_clock_whatever_the_writers_clock() {
    use idemgate::owner::OwnerToken;
    use idemgate::record::{Stage, State};
    use idemgate::store::StoredValue;
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let plugin = r#"{"scope": {"headers": ["authorization"]}, "ttl_seconds": 4, "lock_ttl_seconds": 2, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 500}}"#;
    let p = Pair::new(webdis.port, plugin);
    let keys = ["k-skew-claim", "k-skew-behind", "k-skew-ahead"];
    let mut values = vec![];
    for k in keys {
        assert_eq!(post(&p.a, k, "{}", &[]).status, 201);
        let name = redis_key_of(plugin, k);
        assert!(
            eventually(Duration::from_secs(20), || redis.get_raw(&name).is_some_and(|v| v.get(4) == Some(&b'D'))),
            "{k}: no completed record in the store"
        );
        let v = StoredValue::open(
            &redis.get_raw(&name).expect("value"),
            &support::storage_key_of(&name),
            &support::record_seal(),
        )
        .expect("a value this build reads");
        values.push((name, v));
    }
    assert_eq!(p.up.executions(), 3);
    let t0 = std::time::Instant::now();
    let (behind, ahead) = (3_000, 30_000);
    // Another proxy's forwarded claim, clock 3 s behind: lock (by Redis) live for 2 s, its
    // record's expiry as that proxy computed it (claim time + ttl, by its clock), PX 4 s.
    let (name, mut v) = values[0].clone();
    let now = redis_now_ms(&redis);
    let other = OwnerToken([7; 16]);
    v.phase = Stage::Forwarded;
    v.owner = other;
    v.lock_expires_at_ms = now + 2_000;
    v.record.created_at_ms = now - behind;
    v.record.expires_at_ms = now - behind + 4_000;
    v.record.state = State::Forwarded { owner: other, lock_expires_at_ms: now - behind + 2_000 };
    redis.command(&[
        b"SET",
        name.as_bytes(),
        &v.encode(&support::storage_key_of(&name), &support::record_seal()),
        b"PX",
        b"4000",
    ]);
    // Completed records, PX 4 s (ttl from completion), written by clocks 3 s behind and 30 s ahead.
    for ((name, v), shift) in values[1..].iter().zip([-(behind as i64), ahead as i64]) {
        let mut v = v.clone();
        let now = redis_now_ms(&redis);
        v.record.created_at_ms = now.saturating_add_signed(shift);
        v.record.expires_at_ms = v.record.created_at_ms + 4_000;
        redis.command(&[
            b"SET",
            name.as_bytes(),
            &v.encode(&support::storage_key_of(name), &support::record_seal()),
            b"PX",
            b"4000",
        ]);
    }
    let live = post(&p.b, keys[0], "{}", &[]);
    assert_eq!((live.status, problem_type(&live).as_str()), (409, "urn:idemgate:problem:request-in-flight"));
    // 2.5 s: the claim's lock is stale but its record is not over by Redis's clock; the completed
    // record written 3 s behind is 1.5 s past its own expiry field, 1.5 s short of its PX.
    sleep_until(t0 + Duration::from_millis(2500));
    let stale = post(&p.b, keys[0], "{}", &[]);
    assert_eq!(
        p.up.executions(),
        3,
        "executions: a claim within its life was taken over ({} {})",
        stale.status,
        problem_type(&stale)
    );
    assert_eq!((stale.status, problem_type(&stale).as_str()), (409, "urn:idemgate:problem:outcome-unknown"));
    let replay = post(&p.b, keys[1], "{}", &[]);
    assert_eq!(
        p.up.executions(),
        3,
        "executions: a completed record was executed again before its ttl ({} {})",
        replay.status,
        problem_type(&replay)
    );
    assert_eq!((replay.status, replay.header("idempotent-replayed")), (201, Some("true")));
    // 4.5 s: the record written 30 s ahead is over by Redis's clock: a retry executes.
    sleep_until(t0 + Duration::from_millis(4500));
    let fresh = post(&p.b, keys[2], "{}", &[]);
    assert_eq!((fresh.status, fresh.header("idempotent-replayed")), (201, None), "{}", fresh.body_text());
    assert_eq!(p.up.executions(), 4);
}

/// Sends a slow first attempt through `a` with `extra` upstream headers, and empties the store
/// (`FLUSHALL`: an eviction, a failover) while the upstream works, so the owner's write after the
/// exchange finds its claim gone. Returns the first attempt's answer once a's write has landed.
fn first_attempt_losing_its_claim(
    p: &Pair,
    redis: &Redis,
    key: &'static str,
    extra: &[(&'static str, &'static str)],
) -> Response {
    let mut h = vec![("x-up-delay-ms", "1500")];
    h.extend_from_slice(extra);
    let first = in_background(p.a.port, key, &h);
    assert!(eventually(Duration::from_secs(20), || p.up.executions() == 1), "the first attempt never executed");
    assert!(!redis.keys("*").is_empty(), "the claim is in the store");
    redis.command(&[b"FLUSHALL"]);
    let first = first.join().unwrap();
    // The owner's write has been answered (whatever it did).
    assert!(eventually(Duration::from_secs(20), || p.a.stat("idemgate.store_writes") >= 1), "the write never landed");
    first
}

#[test]
fn a_completion_that_finds_its_claim_gone_still_stores_the_response() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(webdis.port, &cfg(""));
    let first = first_attempt_losing_its_claim(&p, &redis, "k-flushed", &[]);
    assert_eq!(first.status, 201, "{}", first.body_text());
    let r = post(&p.b, "k-flushed", "{}", &[]);
    assert_eq!(p.up.executions(), 1, "the retry on the other proxy executed again");
    assert_eq!((r.status, r.header("idempotent-replayed")), (201, Some("true")), "{}", r.body_text());
    assert_eq!(r.body, first.body);
    // Counted by a's root when the completion's answer comes back, handed to /stats on its next
    // tick: b's replay can come first.
    assert!(
        eventually(Duration::from_secs(20), || p.a.stat("idemgate.store_claim_gone_rewritten") == 1),
        "claim-gone rewrites: {}",
        p.a.stat("idemgate.store_claim_gone_rewritten")
    );
}

#[test]
fn an_outcome_unknown_mark_that_finds_its_claim_gone_still_holds_the_key() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(webdis.port, &cfg(""));
    let first = first_attempt_losing_its_claim(&p, &redis, "k-flushed-reset", &[("x-up-reset", "before-headers")]);
    assert_eq!(first.status, 503, "Envoy answers the reset: {}", first.body_text());
    let r = post(&p.b, "k-flushed-reset", "{}", &[]);
    assert_eq!(p.up.executions(), 1, "the retry on the other proxy executed again");
    assert_eq!(r.status, 409, "{}", r.body_text());
    assert_eq!(problem_type(&r), "urn:idemgate:problem:outcome-unknown");
    // Counted by a's root when the completion's answer comes back, handed to /stats on its next
    // tick: b's replay can come first.
    assert!(
        eventually(Duration::from_secs(20), || p.a.stat("idemgate.store_claim_gone_rewritten") == 1),
        "claim-gone rewrites: {}",
        p.a.stat("idemgate.store_claim_gone_rewritten")
    );
}

/// The same key's value, moved within the store: `SET to <value of from>`.
fn copy_value(redis: &Redis, from: &str, to: &str) {
    let v = redis.get_raw(from).expect("the value to copy");
    redis.command(&[b"SET", to.as_bytes(), &v, b"PX", b"60000"]);
}

/// Issue 15, item 2, through Envoy: caller S's payment B executes, then payment A with the same
/// body under another key. A's stored value copied over B's Redis key must not make a retry of B,
/// on a proxy that has B only in the store, replay payment A (before sealed records it did: 201
/// with A's resource); nor may a value from another namespace, a forged one or a truncated one.
/// Each is refused with 503 `record-unreadable`, counted as `record_unauthentic`, logged with the
/// key's hash, and nothing executes again.
#[test]
fn store_a_value_moved_forged_or_cut_is_never_replayed() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let plugin = cfg("");
    let p = Pair::new(webdis.port, &plugin);
    let body = r#"{"amount":4200}"#;
    let b = post(&p.a, "k-pay-b", body, &[]);
    let a = post(&p.a, "k-pay-a", body, &[]);
    assert_eq!((b.status, a.status), (201, 201));
    assert_ne!(a.body, b.body, "two payments, two resources");
    let (key_a, key_b) = (redis_key_of(&plugin, "k-pay-a"), redis_key_of(&plugin, "k-pay-b"));
    let done = |k: &str| redis.get_raw(k).is_some_and(|v| v.get(4) == Some(&b'D'));
    assert!(eventually(Duration::from_secs(20), || done(&key_a) && done(&key_b)), "completions in the store");
    // Another namespace's record of the same caller and key, on a third proxy sharing the store.
    let other_ns = r#"{"scope": {"headers": ["authorization"]}, "namespace": "tenant-2", "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 2000}}"#;
    let mut o = EnvoyOptions::new(other_ns, p.up.port);
    o.store_port = Some(webdis.port);
    let c = Envoy::start(&o);
    assert_eq!(post(&c, "k-pay-ns", body, &[]).status, 201);
    let key_ns_there = redis_key_of(other_ns, "k-pay-ns");
    assert!(eventually(Duration::from_secs(20), || done(&key_ns_there)), "tenant-2's completion");
    assert_eq!(p.up.executions(), 3);

    // 1. A's value over B's key: B's retry on b (B is in b's memory nowhere).
    copy_value(&redis, &key_a, &key_b);
    let r = post(&p.b, "k-pay-b", body, &[]);
    assert_ne!(r.body, a.body, "payment A replayed as payment B");
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (503, "urn:idemgate:problem:record-unreadable"),
        "{}",
        r.body_text()
    );
    // 2. tenant-2's value under the default namespace's key for the same caller and key.
    let key_ns_here = redis_key_of(&plugin, "k-pay-ns");
    copy_value(&redis, &key_ns_there, &key_ns_here);
    let r = post(&p.b, "k-pay-ns", body, &[]);
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (503, "urn:idemgate:problem:record-unreadable"),
        "{}",
        r.body_text()
    );
    // 3. A's own value with its resource id changed (same length), and 4. cut short.
    let genuine = redis.get_raw(&key_a).expect("A's value");
    let at = genuine.windows(6).position(|w| w == b"\"res-2").expect("A's resource id in its record") + 5;
    let mut forged = genuine.clone();
    forged[at] = b'9';
    for (what, value) in [("forged", forged), ("truncated", genuine[..genuine.len() - 7].to_vec())] {
        redis.command(&[b"SET", key_a.as_bytes(), &value, b"PX", b"60000"]);
        let r = post(&p.b, "k-pay-a", body, &[]);
        assert!(!r.body_text().contains("res-9"), "{what}: the forged response was replayed");
        assert_eq!((r.status, problem_type(&r).as_str()), (503, "urn:idemgate:problem:record-unreadable"), "{what}");
    }
    assert_eq!(p.up.executions(), 3, "nothing executed again");
    assert_eq!(p.b.stat("idemgate.record_unauthentic"), 4);
    assert_eq!(p.b.stat("idemgate.record_unreadable"), 4);
    let log = p.b.log();
    assert!(log.contains("outcome=record_unauthentic key="), "{log}");
    c.assert_no_wasm_panic();
}

/// Rotation of the record secret (issue 15, item 2): a proxy given the new secret with the old
/// one as previous replays what the old one sealed, and writes with the new one; a proxy still
/// on the old secret alone refuses what the new one sealed (503, never executed), which is why
/// every proxy gets the new secret as previous before any writes with it (docs/stores.md, "Sealed records").
#[test]
fn store_records_sealed_with_the_previous_secret_are_replayed_while_rotating() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let plugin = cfg("");
    let old = "rotation-old-record-key-0123456789abcdef-01";
    let new = "rotation-new-record-key-0123456789abcdef-02";
    let p = Pair::with(webdis.port, &plugin, |o| {
        o.vm_env = vec![("IDEMGATE_RECORD_KEY".into(), old.into())];
    });
    let up_port = p.up.port;
    let mut o = EnvoyOptions::new(&plugin, up_port);
    o.store_port = Some(webdis.port);
    o.vm_env = vec![("IDEMGATE_RECORD_KEY".into(), new.into()), ("IDEMGATE_RECORD_KEY_PREVIOUS".into(), old.into())];
    let rotated = Envoy::start(&o);
    let first = post(&p.a, "k-rot-old", "{}", &[]);
    assert_eq!(first.status, 201);
    let done = |k: &str| redis.get_raw(redis_key_of(&plugin, k)).is_some_and(|v| v.get(4) == Some(&b'D'));
    assert!(eventually(Duration::from_secs(20), || done("k-rot-old")));
    let again = post(&rotated, "k-rot-old", "{}", &[]);
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")), "{}", again.body_text());
    assert_eq!(again.body, first.body);
    assert_eq!(post(&rotated, "k-rot-new", "{}", &[]).status, 201);
    assert!(eventually(Duration::from_secs(20), || done("k-rot-new")));
    let stale = post(&p.b, "k-rot-new", "{}", &[]);
    assert_eq!((stale.status, problem_type(&stale).as_str()), (503, "urn:idemgate:problem:record-unreadable"));
    assert_eq!(p.up.executions(), 2);
    assert_eq!(rotated.stat("idemgate.record_unauthentic"), 0);
    assert_eq!(p.b.stat("idemgate.record_unauthentic"), 1);
    rotated.assert_no_wasm_panic();
}

/// A proxy sharing a store without a record secret (or with one too short to be a secret) is
/// refused at configuration: it would write records anyone who can write the store could forge.
#[test]
fn a_store_without_a_record_secret_is_refused_at_configuration() {
    for (value, needle) in [("", "IDEMGATE_RECORD_KEY is not set"), ("short-secret", "at least 32 bytes")] {
        let mut o = EnvoyOptions::new(&cfg(""), support::free_port());
        o.store_port = Some(support::free_port());
        o.vm_env = vec![("IDEMGATE_RECORD_KEY".into(), value.into())];
        match Envoy::try_start(&o) {
            support::Started::Ready(envoy) => panic!("envoy started without a record secret; log:\n{}", envoy.log()),
            support::Started::Exited { code, log } => {
                assert_ne!(code, Some(0));
                assert!(log.contains(needle), "log lacks `{needle}`:\n{log}");
            }
        }
    }
}

/// A claim whose store answer comes after its lock could be judged stale is not forwarded: by
/// then another proxy may have found the lock stale and, with `stale_lock: "takeover"`, taken the
/// key over and executed it. Proxy a reaches webdis through a relay that holds the store's
/// answers: a's claim lands in Redis at once, its answer reaches a only after b has taken the
/// stale claim over and executed the request. (Found by an adversarial review; before the fix a
/// forwarded on that answer: the upstream executed the key twice.)
#[test]
fn a_claim_answered_after_its_lock_went_stale_is_not_forwarded() {
    late_claim_answer("reject");
}

/// The same with `on_unavailable: "pass"`: the store answered, so this is no outage, and the
/// request is not forwarded unprotected either. (Found by a review of the fix above, which first
/// treated the late answer as a store failure: under "pass" it forwarded, 2 executions.)
#[test]
fn a_claim_answered_after_its_lock_went_stale_is_not_forwarded_even_in_pass_mode() {
    late_claim_answer("pass");
}

/// The first answer to `key` (body `{}`) through `e` that is not a 409, asking at most 100 times,
/// 100 ms apart.
fn past_409(e: &Envoy, key: &str) -> Option<Response> {
    for _ in 0..100 {
        let r = post(e, key, "{}", &[]);
        if r.status != 409 {
            return Some(r);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    None
}

fn late_claim_answer(on_unavailable: &str) {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let relay = support::replication::Relay::start(webdis.port);
    let plugin = format!(
        r#"{{"scope": {{"headers": ["authorization"]}}, "ttl_seconds": 10, "lock_ttl_seconds": 1, "stale_lock": "takeover", "store": {{"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 20000, "on_unavailable": "{on_unavailable}"}}}}"#
    );
    let plugin = plugin.as_str();
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(plugin, up.port);
    o.store_port = Some(relay.port);
    let a = Envoy::start(&o);
    o.store_port = Some(webdis.port);
    let b = Envoy::start(&o);
    relay.hold_answers();
    let port = a.port;
    let first = std::thread::spawn(move || {
        let h = [("authorization", "Bearer alice-secret-token"), ("idempotency-key", "k-late-claim")];
        http::request(port, "POST", "/charges", &h, b"{}")
    });
    let rkey = redis_key_of(plugin, "k-late-claim");
    assert!(eventually(Duration::from_secs(20), || redis.get_raw(&rkey).is_some()), "a's claim in Redis");
    // Once the lock is stale (1 s by Redis's clock), b takes the key over and executes it.
    let taken = past_409(&b, "k-late-claim").expect("b took the stale claim over");
    assert_eq!(taken.status, 201, "{}", taken.body_text());
    assert_eq!(up.executions_with_key("k-late-claim"), 1);
    relay.release_answers();
    let first = first.join().unwrap().expect("a's answer");
    assert_eq!(up.executions_with_key("k-late-claim"), 1, "a forwarded on an answer that came after its lock");
    assert_eq!((first.status, first.problem().as_str()), (503, "store-unavailable"), "{}", first.body_text());
    assert_eq!(a.stat("idemgate.store_answers_too_late"), 1);
    // b's execution stands: a retry through a replays it (once b's completion is in the store).
    let replay = past_409(&a, "k-late-claim").expect("b's completion in the store");
    assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{}", replay.body_text());
    assert_eq!(replay.body, taken.body);
    assert_eq!(up.executions_with_key("k-late-claim"), 1);
}

/// Wait mode with a store: a retry that meets a first attempt on the same proxy whose store claim
/// has not landed yet (Redis paused for writes: the claim script waits, reads go on) keeps waiting
/// while the store shows nothing, and gets the replay once the first attempt completes. (Found by
/// an adversarial review: the waiter's first store poll saw the key absent and answered 409
/// "released, retry now" while the first attempt was still in flight here.)
#[test]
fn wait_mode_keeps_waiting_while_a_first_attempt_here_has_not_reached_the_store() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(
        webdis.port,
        r#"{"scope": {"headers": ["authorization"]}, "in_flight": "wait", "wait_ms": 20000, "store": {"cluster": "idemgate_store", "timeout_ms": 15000}}"#,
    );
    // Write commands (the claim script among them) wait 6 s; GET, the waiter's poll, does not.
    // The retry must start waiting within those 6 s (or it meets the completed key: the test
    // would pass without the case it is for), which `waited` checks below.
    redis.command(&[b"CLIENT", b"PAUSE", b"6000", b"WRITE"]);
    let first = in_background(p.a.port, "k-paused", &[]);
    assert!(
        eventually(Duration::from_secs(20), || p.a.stat("idemgate.store_calls_waited") == 1),
        "the first attempt's store claim is sent"
    );
    let retry = in_background(p.a.port, "k-paused", &[]);
    let (first, retry) = (first.join().unwrap(), retry.join().unwrap());
    assert_eq!(first.status, 201, "{}", first.body_text());
    assert_eq!(retry.status, 201, "{} retry-after {:?}", retry.body_text(), retry.header("retry-after"));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(p.up.executions_with_key("k-paused"), 1);
    assert_eq!(p.a.stat("idemgate.waited"), 1, "the retry waited");
}

/// Issue 23, item 5, through Redis behind webdis: a response of exactly the default
/// `max_response_body_bytes` (1 MiB) is stored by proxy a and replayed byte-exact by proxy b, one
/// execution (webdis takes requests up to its `http_max_request_size`, 128 MiB by default, and
/// Redis bulk strings up to `proto-max-bulk-len`, 512 MB).
#[test]
fn a_response_of_exactly_max_response_body_bytes_is_replayed_on_the_other_proxy() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(webdis.port, &cfg(""));
    let first = post(&p.a, "k-large", "{}", &[("x-up-body-bytes", "1048576")]);
    assert_eq!((first.status, first.body.len()), (201, 1_048_576));
    assert!(eventually(Duration::from_secs(20), || p.a.stat("idemgate.store_writes") >= 1), "no completion landed");
    let again = post(&p.b, "k-large", "{}", &[]);
    assert_eq!(p.up.executions(), 1);
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("location"), first.header("location"));
}
