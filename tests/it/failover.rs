//! Failover, measured (issue 15 item 7). Redis replication is asynchronous: a primary answers a
//! write before its replica has it, so a claim acknowledged by a primary that dies before its
//! replica applied it is gone once the replica is promoted, and a retry of that key on a proxy
//! that never saw it executes again. These tests count that loss instead of assuming it.
//!
//! Each builds a Redis primary and a replica (`envoy/redis.conf` with its ACL users, and a
//! replication user), webdis in front of the primary, two Envoys with idemgate sharing that store
//! and one counting upstream; SIGKILL the primary right after claims were acknowledged, promote
//! the replica (`REPLICAOF NO ONE`), start webdis again on the same port pointing at it (as an
//! operator or a failover script would), retry every key on both proxies and count executions
//! per key. What is asserted is what holds whatever the timing: every retry gets a documented
//! answer (a replay of the key's own response, `request-in-flight`, `outcome-unknown`, or an
//! execution the upstream counted), and the keys that executed twice are exactly the keys that
//! had executed but whose claim the replica did not hold when it was promoted (its keyspace is
//! read before the promotion). How many those are is measured and written to
//! target/faults/failover.md.
//!
//! `make test` runs the short forms (`failover_*`); `make test-failover` runs the full forms
//! (`failover_full_*`: more keys, several runs, and the `min-replicas-to-write` measurement).

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::http::{self, Response};
use support::replication::{info, info_field, ReplicatedRedis};
use support::store::{pct, Webdis};
use support::upstream::Upstream;
use support::{fault_report, Envoy, EnvoyOptions};

const PLUGIN: &str = r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 60, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 2000}}"#;
const CALLER: &str = "Bearer failover-caller";
/// Client threads sending the keys of a batch (each key once, on one proxy).
const CLIENTS: usize = 8;
/// Polls (100 ms apart) for the proxies' store writes to land or be given up: a write and its
/// outcome-unknown fallback retry for about 2 x 6.2 s plus their timeouts.
const WRITE_POLLS: u32 = 600;
/// Attempts of one retry answered 503 `store-unavailable` (the proxies' pooled connections to
/// the webdis that was restarted), 100 ms apart.
const UNAVAILABLE_ATTEMPTS: u32 = 10;

/// The Redis key idemgate uses for `key` sent by `CALLER` through `post`.
fn redis_key_of(key: &str) -> String {
    support::redis_key_of(PLUGIN, CALLER, key)
}

fn post(port: u16, key: &str, extra: &[(&str, &str)]) -> Response {
    let mut h = vec![("authorization", CALLER), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    http::request(port, "POST", "/charges", &h, b"{\"amount\": 1}").expect("an answer")
}

/// The store, the two proxies sharing it and the upstream.
struct World {
    redis: ReplicatedRedis,
    webdis: Webdis,
    up: Upstream,
    proxies: [Envoy; 2],
}

impl World {
    fn start(through_relay: bool, primary_args: &[&str]) -> World {
        let redis = ReplicatedRedis::start(through_relay, primary_args);
        let webdis = Webdis::start(redis.primary.port);
        let up = Upstream::start();
        let mut o = EnvoyOptions::new(PLUGIN, up.port);
        o.store_port = Some(webdis.port);
        o.route_timeout_ms = 30_000;
        let proxies = [Envoy::start(&o), Envoy::start(&o)];
        World { redis, webdis, up, proxies }
    }

    fn ports(&self) -> [u16; 2] {
        [self.proxies[0].port, self.proxies[1].port]
    }

    /// Waits until neither proxy has a store write queued, in flight or waiting to retry (landed,
    /// or given up after its fallback).
    fn wait_writes_settled(&self) {
        support::wait_writes_settled(&[&self.proxies[0], &self.proxies[1]], WRITE_POLLS);
    }

    fn executions(&self, keys: &[String]) -> BTreeMap<String, u64> {
        let all = self.up.executions_by_key();
        keys.iter().map(|k| (k.clone(), all.get(k).copied().unwrap_or(0))).collect()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            for p in &self.proxies {
                p.assert_no_wasm_panic();
            }
        }
    }
}

/// The proxy key `i` of a batch goes to first (the other one never saw it).
fn origin(i: usize) -> usize {
    i % 2
}

/// Sends every key once, key `i` to proxy `origin(i)`, from `CLIENTS` threads; returns the
/// answers in key order once all are in.
fn send_batch(ports: [u16; 2], keys: &[String], extra: &'static [(&'static str, &'static str)]) -> SentBatch {
    send_batch_from(CLIENTS, ports, keys, extra)
}

/// `send_batch` from `clients` threads (one per key for requests the upstream holds).
fn send_batch_from(
    clients: usize,
    ports: [u16; 2],
    keys: &[String],
    extra: &'static [(&'static str, &'static str)],
) -> SentBatch {
    let keys = Arc::new(keys.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..clients)
        .map(|_| {
            let (keys, next) = (keys.clone(), next.clone());
            std::thread::spawn(move || {
                let mut answers = vec![];
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(key) = keys.get(i) else { return answers };
                    answers.push((i, post(ports[origin(i)], key, extra)));
                }
            })
        })
        .collect();
    SentBatch(clients)
}

struct SentBatch(Vec<std::thread::JoinHandle<Vec<(usize, Response)>>>);

impl SentBatch {
    fn answers(self) -> Vec<Response> {
        let mut all: Vec<(usize, Response)> = self.0.into_iter().flat_map(|c| c.join().expect("client")).collect();
        all.sort_by_key(|(i, _)| *i);
        all.into_iter().map(|(_, r)| r).collect()
    }
}

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// A short description of an answer: `201`, `201 replayed`, `409 outcome-unknown`, ...
fn kind(r: &Response) -> String {
    match (r.status, r.header("idempotent-replayed"), r.problem()) {
        (_, Some("true"), _) => format!("{} replayed", r.status),
        (s, _, p) if p.is_empty() => s.to_string(),
        (s, _, p) => format!("{s} {p}"),
    }
}

fn tally(answers: &[Response]) -> BTreeMap<String, usize> {
    let mut t = BTreeMap::new();
    for r in answers {
        *t.entry(kind(r)).or_insert(0) += 1;
    }
    t
}

/// What the replica held when it was promoted.
struct Promotion {
    /// Keys the upstream had executed before the promotion.
    executed: BTreeSet<String>,
    /// Of those, the keys whose claim (or record) the replica did not hold: the lost claims.
    missing: BTreeSet<String>,
}

/// After the primary's death: waits for the proxies' writes to land or be given up (a failover
/// that takes longer than their retries, as Sentinel's 30 s `down-after-milliseconds` does),
/// reads the replica's keyspace, promotes it, points webdis at it and sends each proxy one
/// request of its own until it is served (the proxies' pooled connections to the old webdis fail
/// once).
fn promote(w: &mut World, all: &[String], wait_for_writes: bool) -> Promotion {
    if wait_for_writes {
        w.wait_writes_settled();
    }
    let held: BTreeSet<String> = w.redis.replica.keys("idemgate:v1:*").into_iter().collect();
    let ours: BTreeMap<String, String> = all.iter().map(|k| (redis_key_of(k), k.clone())).collect();
    let strangers: Vec<&String> = held.iter().filter(|k| !ours.contains_key(*k)).collect();
    assert!(strangers.is_empty(), "the replica holds keys no request of this test maps to: {strangers:?}");
    let executed: BTreeSet<String> = w.executions(all).into_iter().filter(|(_, n)| *n > 0).map(|(k, _)| k).collect();
    let missing = executed.iter().filter(|k| !held.contains(&redis_key_of(k))).cloned().collect();
    w.redis.promote_replica();
    w.webdis.repoint(w.redis.replica.port);
    for (p, port) in w.ports().into_iter().enumerate() {
        let served = (0..UNAVAILABLE_ATTEMPTS).any(|attempt| {
            let r = post(port, &format!("warm-up-{p}-{attempt}"), &[]);
            r.status == 201 || {
                std::thread::sleep(Duration::from_millis(100));
                false
            }
        });
        assert!(served, "proxy {p} never reached the promoted replica through webdis");
    }
    Promotion { executed, missing }
}

/// The retries of every key and what they found.
struct Retried {
    answers: BTreeMap<String, usize>,
    /// Keys the upstream executed more than once, over the whole test.
    twice: BTreeSet<String>,
}

/// Retries every key on the proxy that never saw it, then on the one that did, and checks each
/// answer is a documented one: the key's own response replayed, `request-in-flight`,
/// `outcome-unknown`, or an execution the upstream counted for that key.
fn retry_everywhere(w: &World, all: &[String]) -> Retried {
    let ports = w.ports();
    let next = Arc::new(AtomicUsize::new(0));
    let keys = Arc::new(all.to_vec());
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (keys, next) = (keys.clone(), next.clone());
            std::thread::spawn(move || {
                let mut answers = vec![];
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(key) = keys.get(i) else { return answers };
                    for p in [1 - origin(i), origin(i)] {
                        let mut r = post(ports[p], key, &[]);
                        for _ in 1..UNAVAILABLE_ATTEMPTS {
                            if r.problem() != "store-unavailable" {
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(100));
                            r = post(ports[p], key, &[]);
                        }
                        answers.push((key.clone(), r));
                    }
                }
            })
        })
        .collect();
    let answers: Vec<(String, Response)> = clients.into_iter().flat_map(|c| c.join().expect("client")).collect();
    let log = w.up.log();
    let mut undocumented = vec![];
    for (key, r) in &answers {
        let documented = match (r.status, r.header("idempotent-replayed"), r.problem().as_str()) {
            // A replay or an execution: the response must be one the upstream gave this key.
            (201, _, "") => {
                let n = r.json()["execution"].as_u64().unwrap_or(0);
                log.iter().any(|x| x.n == n && x.key.as_deref() == Some(key.as_str()))
            }
            (409, None, "request-in-flight" | "outcome-unknown") => true,
            _ => false,
        };
        if !documented {
            undocumented.push(format!("{key}: {} {}", r.status, r.body_text()));
        }
    }
    assert!(undocumented.is_empty(), "retries without a documented answer:\n{}", undocumented.join("\n"));
    let executions = w.executions(all);
    let thrice: Vec<_> = executions.iter().filter(|(_, n)| **n > 2).collect();
    assert!(thrice.is_empty(), "keys executed more than twice: {thrice:?}");
    let twice = executions.into_iter().filter(|(_, n)| *n == 2).map(|(k, _)| k).collect();
    let answers = tally(&answers.into_iter().map(|(_, r)| r).collect::<Vec<_>>());
    Retried { answers, twice }
}

/// The loss is exactly what the replica lacked: no key it held executed twice, and every
/// executed key it lacked did (its retry on the proxy that never saw it found nothing).
fn assert_loss_explained(p: &Promotion, r: &Retried) {
    let unexplained: Vec<_> = r.twice.difference(&p.missing).collect();
    assert!(unexplained.is_empty(), "executed twice although the replica held their claim: {unexplained:?}");
    let spared: Vec<_> = p.missing.difference(&r.twice).collect();
    assert!(spared.is_empty(), "lost claims whose retry did not execute again (not explained): {spared:?}");
}

fn report(scenario: &str, keys: usize, p: &Promotion, r: &Retried, phase1: &BTreeMap<String, usize>) {
    let row = [
        scenario.to_string(),
        format!("{keys} keys"),
        format!("{} executed before the failover", p.executed.len()),
        format!("{} missing on the replica at promotion (lost)", p.missing.len()),
        format!("{} executed twice", r.twice.len()),
        format!("first attempts {phase1:?}; retries {:?}", r.answers),
    ];
    println!("{}", row.join(" | "));
    fault_report("failover.md", &row.iter().map(String::as_str).collect::<Vec<_>>());
}

/// Process death under traffic: the replica is linked directly to the primary; `n` keys are
/// sent from `CLIENTS` threads to both proxies (each key once, answered after 50 ms), and the
/// primary is SIGKILLed as soon as half of them executed, while claims keep arriving.
fn primary_killed_under_traffic(n: usize, run: usize) -> (Promotion, Retried) {
    let mut w = World::start(false, &[]);
    let all = keys(&format!("traffic-{run}"), n);
    let batch = send_batch(w.ports(), &all, &[("x-up-delay-ms", "50")]);
    let half = (n / 2) as u64;
    let reached = (0..60_000).any(|_| {
        w.up.executions() >= half || {
            std::thread::sleep(Duration::from_millis(1));
            false
        }
    });
    w.redis.kill_primary();
    assert!(reached, "half the keys never executed: {}", w.up.executions());
    let first = batch.answers();
    for (key, r) in all.iter().zip(&first) {
        let k = kind(r);
        assert!(k == "201" || k == "503 store-unavailable", "{key}: first attempt answered {k}: {}", r.body_text());
    }
    let p = promote(&mut w, &all, true);
    let r = retry_everywhere(&w, &all);
    assert_loss_explained(&p, &r);
    report(&format!("primary SIGKILLed under traffic (run {run})"), n, &p, &r, &tally(&first));
    (p, r)
}

/// A partition: the replication link is held (both ways) after `n1` keys were replicated; `n2`
/// more keys are claimed, executed and completed, every write acknowledged by the primary; then
/// the primary is SIGKILLed. Every one of the `n2` keys is lost, and executes again.
fn partitioned_replica(n1: usize, n2: usize) -> (Promotion, Retried) {
    let mut w = World::start(true, &[]);
    let before = keys("replicated", n1);
    let during = keys("partitioned", n2);
    let first = send_batch(w.ports(), &before, &[]).answers();
    assert!(first.iter().all(|r| kind(r) == "201"), "{:?}", tally(&first));
    w.wait_writes_settled();
    w.redis.wait_in_sync();
    w.redis.relay.as_ref().expect("relay").hold();
    let second = send_batch(w.ports(), &during, &[]).answers();
    assert!(second.iter().all(|r| kind(r) == "201"), "the primary acknowledges alone: {:?}", tally(&second));
    // Every completion acknowledged by the primary, none seen by the replica.
    w.wait_writes_settled();
    w.redis.kill_primary();
    let all: Vec<String> = before.iter().chain(&during).cloned().collect();
    let p = promote(&mut w, &all, true);
    assert_eq!(p.missing, during.iter().cloned().collect(), "the replica lacks exactly the partitioned keys");
    let r = retry_everywhere(&w, &all);
    assert_loss_explained(&p, &r);
    let mut answers = tally(&first);
    for (k, v) in tally(&second) {
        *answers.entry(k).or_insert(0) += v;
    }
    report("replica partitioned, then primary SIGKILLed", n1 + n2, &p, &r, &answers);
    (p, r)
}

/// Requests still running at the failover: `n2` keys are claimed (the primary acknowledges, the
/// held link keeps it from the replica) and executed, and their upstream holds its answers until
/// the replica is promoted. The owners' completions then find their claims gone and write their
/// records there (issue 15 item 5): nothing executes twice although every claim was lost.
fn requests_running_at_the_failover(n1: usize, n2: usize) -> (Promotion, Retried) {
    let mut w = World::start(true, &[]);
    let before = keys("settled", n1);
    let running = keys("running", n2);
    let first = send_batch(w.ports(), &before, &[]).answers();
    assert!(first.iter().all(|r| kind(r) == "201"), "{:?}", tally(&first));
    w.wait_writes_settled();
    w.redis.wait_in_sync();
    w.redis.relay.as_ref().expect("relay").hold();
    // One client per key: every request is held at once.
    let batch = send_batch_from(n2, w.ports(), &running, &[("x-up-hold", "1")]);
    let total = (n1 + n2) as u64;
    let executed = (0..60_000).any(|_| {
        w.up.executions() == total || {
            std::thread::sleep(Duration::from_millis(1));
            false
        }
    });
    assert!(executed, "the running keys never all executed: {}", w.up.executions());
    w.redis.kill_primary();
    let all: Vec<String> = before.iter().chain(&running).cloned().collect();
    // The running requests' writes come after the answer: none is pending yet.
    let p = promote(&mut w, &all, false);
    assert_eq!(p.missing, running.iter().cloned().collect(), "the replica lacks exactly the running keys");
    w.up.release_holds();
    let second = batch.answers();
    assert!(second.iter().all(|r| kind(r) == "201"), "{:?}", tally(&second));
    w.wait_writes_settled();
    let rewritten: u64 = w.proxies.iter().map(|e| e.stat("idemgate.store_claim_gone_rewritten")).sum();
    let r = retry_everywhere(&w, &all);
    assert!(r.twice.is_empty(), "executed twice although their owners' completions landed: {:?}", r.twice);
    assert_eq!(rewritten, n2 as u64, "completions written where their claim was gone");
    let mut answers = tally(&first);
    for (k, v) in tally(&second) {
        *answers.entry(k).or_insert(0) += v;
    }
    report("requests still running at the failover", n1 + n2, &p, &r, &answers);
    (p, r)
}

/// `min-replicas-to-write 1` with `min-replicas-max-lag 2` on the primary: the replication link
/// is held after `n1` keys; `n2` keys are sent at once (the primary still counts its replica as
/// good for up to about 2-3 s: these are acknowledged and lost); once the primary counts no good
/// replica, `n3` keys are sent: the primary refuses their claims (`NOREPLICAS`), idemgate answers
/// 503 `store-unavailable` and nothing executes. It bounds the window, it does not close it.
fn min_replicas_to_write(n1: usize, n2: usize, n3: usize) -> (Promotion, Retried, usize) {
    let mut w = World::start(true, &["--min-replicas-to-write", "1", "--min-replicas-max-lag", "2"]);
    let before = keys("replicated", n1);
    let lagging = keys("lagging", n2);
    let refused = keys("refused", n3);
    let first = send_batch(w.ports(), &before, &[]).answers();
    assert!(first.iter().all(|r| kind(r) == "201"), "{:?}", tally(&first));
    w.wait_writes_settled();
    w.redis.wait_in_sync();
    w.redis.relay.as_ref().expect("relay").hold();
    let held_at = std::time::Instant::now();
    let second = send_batch(w.ports(), &lagging, &[]).answers();
    // The primary notices within max-lag plus its 1 s replication cron: poll generously.
    let noticed = (0..300).any(|_| {
        info_field(&info(&w.redis.primary, "replication"), "min_slaves_good_slaves").as_deref() == Some("0") || {
            std::thread::sleep(Duration::from_millis(100));
            false
        }
    });
    assert!(noticed, "the primary never stopped counting its held replica");
    let window = held_at.elapsed();
    let executed_before_refusals = w.up.executions();
    let third = send_batch(w.ports(), &refused, &[]).answers();
    assert!(third.iter().all(|r| kind(r) == "503 store-unavailable"), "{:?}", tally(&third));
    assert_eq!(w.up.executions(), executed_before_refusals, "a refused claim executed");
    w.redis.kill_primary();
    let all: Vec<String> = before.iter().chain(&lagging).chain(&refused).cloned().collect();
    let p = promote(&mut w, &all, true);
    let r = retry_everywhere(&w, &all);
    assert_loss_explained(&p, &r);
    let executions = w.executions(&refused);
    assert!(executions.values().all(|n| *n == 1), "refused keys execute once, on their retry: {executions:?}");
    let acknowledged = second.iter().filter(|r| kind(r) == "201").count();
    let mut answers = tally(&first);
    for (k, v) in tally(&second).into_iter().chain(tally(&third)) {
        *answers.entry(k).or_insert(0) += v;
    }
    report(
        &format!(
            "min-replicas-to-write 1, max-lag 2: {acknowledged} of {n2} claims sent right after the partition acknowledged, writes refused {:.1} s after it began, then {n3} of {n3} claims refused",
            window.as_secs_f64()
        ),
        n1 + n2 + n3,
        &p,
        &r,
        &answers,
    );
    (p, r, acknowledged)
}

#[test]
fn failover_a_primary_killed_under_traffic_loses_only_claims_its_replica_never_had() {
    primary_killed_under_traffic(40, 0);
}

#[test]
fn failover_a_partitioned_replica_loses_every_claim_acknowledged_during_the_partition() {
    let (p, r) = partitioned_replica(10, 10);
    assert_eq!((p.missing.len(), r.twice.len()), (10, 10));
}

#[test]
fn failover_requests_running_at_the_failover_rewrite_their_lost_claims_and_never_execute_twice() {
    requests_running_at_the_failover(6, 10);
}

/// WAIT after each claim would make the claim wait for the replica's acknowledgement, but Redis
/// refuses WAIT inside a script (idemgate's claim is one script): it would have to be a second
/// command, a second round trip per claim through webdis.
#[test]
fn failover_redis_refuses_wait_inside_a_script() {
    let redis = ReplicatedRedis::start(false, &[]);
    let r = redis.primary.command(&[b"EVAL", b"return redis.call('WAIT', 1, 100)", b"0"]);
    let support::store::resp::Value::Error(e) = &r else { panic!("WAIT inside a script answered {r:?}") };
    assert!(e.contains("not allowed from script"), "{e}");
    // Outside a script it works: one replica acknowledged.
    let r = redis.primary.command(&[b"WAIT", b"1", b"1000"]);
    assert_eq!(r, support::store::resp::Value::Int(1));
}

/// Sequential claim-like writes through webdis (a script setting a new key, as idemgate's claim
/// does) timed alone and each followed by `WAIT 1 1000` in a second request: what waiting for the
/// replica after each claim would cost. idemgate does not do it (its Redis user may not even run
/// WAIT; this test grants it for the measurement).
#[test]
fn failover_full_wait_after_each_claim_costs_a_second_round_trip() {
    const CLAIMS: usize = 300;
    const SCRIPT: &str = "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', 60000)";
    let redis = ReplicatedRedis::start(false, &[]);
    let grant = redis.primary.command(&[b"ACL", b"SETUSER", b"default", b"+wait"]);
    assert_eq!(grant, support::store::resp::Value::Status("OK".into()));
    let webdis = Webdis::start(redis.primary.port);
    let claims = |prefix: &str, wait: bool| -> f64 {
        let start = std::time::Instant::now();
        for i in 0..CLAIMS {
            let key = pct(format!("idemgate:v1:{prefix}-{i}"));
            let r = webdis.post(&format!("EVAL/{}/1/{key}/owner", pct(SCRIPT)));
            assert_eq!(r.status, 200, "{}", r.body_text());
            if wait {
                let r = webdis.post("WAIT/1/1000");
                assert_eq!(r.json()["WAIT"], 1, "the replica acknowledged: {}", r.body_text());
            }
        }
        start.elapsed().as_secs_f64() * 1000.0 / CLAIMS as f64
    };
    let alone = claims("alone", false);
    let waited = claims("waited", true);
    let row = format!("WAIT 1 after each claim: {alone:.2} ms per claim alone, {waited:.2} ms with WAIT ({CLAIMS} sequential claims through webdis, replica on loopback)");
    println!("{row}");
    fault_report("failover.md", &[&row]);
}

/// How many runs the full forms make (`IDEMGATE_FAILOVER_RUNS`, default 5).
fn runs() -> usize {
    std::env::var("IDEMGATE_FAILOVER_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(5)
}

#[test]
fn failover_full_a_primary_killed_under_traffic_loses_only_claims_its_replica_never_had() {
    let (mut lost, mut executed) = (0, 0);
    for run in 0..runs() {
        let (p, _) = primary_killed_under_traffic(400, run);
        lost += p.missing.len();
        executed += p.executed.len();
    }
    println!("primary SIGKILLed under traffic: {lost} claims lost of {executed} executed over {} runs", runs());
}

#[test]
fn failover_full_a_partitioned_replica_loses_every_claim_acknowledged_during_the_partition() {
    let (p, r) = partitioned_replica(100, 100);
    assert_eq!((p.missing.len(), r.twice.len()), (100, 100));
}

#[test]
fn failover_full_requests_running_at_the_failover_rewrite_their_lost_claims_and_never_execute_twice() {
    requests_running_at_the_failover(50, 100);
}

#[test]
fn failover_full_min_replicas_to_write_refuses_claims_once_the_replica_lags_but_loses_those_before() {
    for _ in 0..runs().min(3) {
        min_replicas_to_write(20, 20, 20);
    }
}

/// WAIT cannot be offered through webdis (issue 42 item 2): Redis's WAIT waits for the last write
/// of the connection it runs on, and webdis 0.1.9 sends each HTTP request on one of its pooled
/// connections, which webdis does not promise is the one that ran the claim. With the replica's
/// link held (a partition), a connection whose own last write was replicated answers WAIT with 1
/// at once for another connection's claim no replica has; the claim's own connection answers 0.
/// Also measured: sequential claims through webdis, each followed by a WAIT request.
#[test]
fn failover_wait_through_webdis_vouches_for_claims_no_replica_has() {
    use std::io::{BufReader, Write};
    use support::store::resp::{self, Value};
    const CLAIMS: usize = 40;
    const SCRIPT: &str = "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', 60000)";
    let redis = ReplicatedRedis::start(true, &[]);
    let grant = redis.primary.command(&[b"ACL", b"SETUSER", b"default", b"+wait"]);
    assert_eq!(grant, Value::Status("OK".into()));
    // Two connections of the operators' user, each kept open (as webdis keeps its pool).
    let open = || {
        let s = std::net::TcpStream::connect(("127.0.0.1", redis.primary.port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let (user, password) = support::store::REDIS_ADMIN;
        let mut c = (BufReader::new(s.try_clone().expect("clone")), s);
        c.1.write_all(&resp::encode(&[b"AUTH", user.as_bytes(), password.as_bytes()])).expect("write");
        assert_eq!(resp::read(&mut c.0).expect("AUTH"), Value::Status("OK".into()));
        c
    };
    let send = |c: &mut (BufReader<std::net::TcpStream>, std::net::TcpStream), args: &[&[u8]]| {
        c.1.write_all(&resp::encode(args)).expect("write");
        resp::read(&mut c.0).expect("an answer")
    };
    let (mut x, mut y) = (open(), open());
    assert_eq!(send(&mut x, &[b"SET", b"idemgate:v1:before", b"1"]), Value::Status("OK".into()));
    redis.wait_in_sync();
    assert_eq!(send(&mut x, &[b"WAIT", b"1", b"1000"]), Value::Int(1), "x's write replicated");
    let webdis = Webdis::start(redis.primary.port);
    redis.relay.as_ref().expect("a relay").hold();
    let claim = pct(SCRIPT);
    assert_eq!(
        send(&mut y, &[b"EVAL", SCRIPT.as_bytes(), b"1", b"idemgate:v1:claim", b"owner"]),
        Value::Status("OK".into())
    );
    let other = send(&mut x, &[b"WAIT", b"1", b"200"]);
    let own = send(&mut y, &[b"WAIT", b"1", b"200"]);
    // Through webdis, sequentially (what a proxy would send: the claim, then WAIT).
    let mut vouched = 0;
    for i in 0..CLAIMS {
        let key = pct(format!("idemgate:v1:wait-{i}"));
        let r = webdis.post(&format!("EVAL/{claim}/1/{key}/owner"));
        assert_eq!(r.status, 200, "{}", r.body_text());
        let w = webdis.post("WAIT/1/50");
        match w.json()["WAIT"].as_i64() {
            Some(1) => vouched += 1,
            Some(0) => {}
            _ => panic!("WAIT answered {} {}", w.status, w.body_text()),
        }
    }
    let row = format!(
        "WAIT 1 200 (webdis: WAIT 1 50) with the replica's link held: on another connection (its own write replicated) {other:?}, \
         on the claim's connection {own:?}; through webdis after each of {CLAIMS} sequential claims: {vouched} answered 1"
    );
    println!("{row}");
    fault_report("failover.md", &[&row]);
    assert_eq!(other, Value::Int(1), "{row}");
    assert_eq!(own, Value::Int(0), "{row}");
}
