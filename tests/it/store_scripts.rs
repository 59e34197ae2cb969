//! The store's two Lua scripts are sent by their SHA-1 (`EVALSHA`), in full (`EVAL`) only when
//! Redis answers NOSCRIPT (issue 15 item 3). Redis and webdis run as shipped (`envoy/redis.conf`,
//! `envoy/docker-compose/webdis.json`: their ACLs must let EVALSHA through); what Redis ran is
//! read from its own `INFO commandstats`, and every test counts the upstream's executions.

use crate::support;

use std::time::Duration;

use idemgate::store::Script;
use support::http::{self, Response};
use support::store::{FakeStore, Redis, Webdis};
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions};

const PLUGIN: &str = r#"{"scope": {"headers": ["authorization"]}, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 1000}}"#;
const CALLER: &str = "Bearer alice-secret-token";

/// The webdis configuration users copy, and its basic-auth credential.
fn shipped_webdis() -> (serde_json::Value, String) {
    let path = support::repo_root().join("envoy/docker-compose/webdis.json");
    let shipped: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path).expect("read webdis.json")).expect("webdis.json is JSON");
    let credential = shipped["acl"]
        .as_array()
        .and_then(|acl| acl.iter().find_map(|a| a["http_basic_auth"].as_str().map(str::to_string)))
        .expect("the shipped webdis ACL names a credential");
    (shipped, credential)
}

/// Redis and webdis exactly as shipped, and an Envoy factory using them.
struct Store {
    redis: Redis,
    webdis: Webdis,
    credential: String,
}

impl Store {
    /// A Redis that holds none of idemgate's scripts (new, or restarted), behind webdis.
    fn start() -> Store {
        let (shipped, credential) = shipped_webdis();
        let redis = Redis::start();
        // The test support loads the scripts into every new Redis: start from an empty cache.
        assert!(redis.cli(&["SCRIPT", "FLUSH"]).contains("OK"));
        let webdis = Webdis::start_shipped(redis.port, &shipped);
        Store { redis, webdis, credential }
    }

    fn envoy(&self, up: &Upstream) -> Envoy {
        let mut o = EnvoyOptions::new(PLUGIN, up.port);
        o.store_port = Some(self.webdis.port);
        o.vm_host_env.push(("IDEMGATE_STORE_AUTH".into(), self.credential.clone()));
        Envoy::start(&o)
    }

    /// `calls` and `failed_calls` of one command in Redis's `INFO commandstats` (0 if never run).
    fn command_stats(&self, command: &str) -> (u64, u64) {
        let info = self.redis.cli(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{command}:");
        let Some(line) = info.lines().find(|l| l.starts_with(&prefix)) else { return (0, 0) };
        let field = |name: &str| {
            line.trim_start_matches(&prefix)
                .split(',')
                .find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        (field("calls"), field("failed_calls"))
    }

    /// The phase letter of the value idemgate stores for `key` (sent by `post`), if any.
    fn phase_of(&self, key: &str) -> Option<u8> {
        self.redis.get_raw(redis_key_of(key)).and_then(|v| v.get(4).copied())
    }
}

/// The Redis key idemgate uses for `key` sent by `post` through an Envoy running `PLUGIN`.
fn redis_key_of(key: &str) -> String {
    support::redis_key_of(PLUGIN, CALLER, key)
}

fn post(envoy: &Envoy, key: &str) -> Response {
    let h = [("authorization", CALLER), ("idempotency-key", key)];
    http::request(envoy.port, "POST", "/charges", &h, br#"{"amount": 7}"#).expect("request")
}

/// Polls `cond` every 50 ms for at most `limit` (the root's writes land after the answer).
fn eventually(limit: Duration, cond: impl Fn() -> bool) -> bool {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < limit {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    cond()
}

/// A key is first executed and answered 201, its completion lands in the store (phase `D`),
/// and a retry on `retry_on` replays it.
fn executes_once_and_replays(s: &Store, first: &Envoy, retry_on: &Envoy, up: &Upstream, key: &str) {
    let before = up.executions();
    let r = post(first, key);
    assert_eq!(r.status, 201, "{key}: {} {}", r.status, r.body_text());
    completes_and_replays(s, first, retry_on, up, key, before, &r);
}

/// The rest of `executes_once_and_replays`, for the answer `r` to the key's first request.
fn completes_and_replays(
    s: &Store,
    first: &Envoy,
    retry_on: &Envoy,
    up: &Upstream,
    key: &str,
    before: u64,
    r: &Response,
) {
    assert_eq!(up.executions(), before + 1, "{key}: executions");
    assert!(
        eventually(Duration::from_secs(20), || s.phase_of(key) == Some(b'D')),
        "{key}: the root's completion never landed (store holds phase {:?}); store counters {:?}",
        s.phase_of(key).map(char::from),
        first.stats("wasmcustom.idemgate.store")
    );
    let again = post(retry_on, key);
    assert_eq!(again.status, 201, "{key}: {}", again.body_text());
    assert_eq!(again.header("idempotent-replayed"), Some("true"), "{key}: {}", again.body_text());
    assert_eq!(again.body, r.body, "{key}");
    assert_eq!(up.executions(), before + 1, "{key}: executions after the retry");
}

#[test]
fn first_requests_run_the_scripts_by_their_sha1_and_load_each_script_at_most_once() {
    let s = Store::start();
    let up = Upstream::start();
    let e = s.envoy(&up);
    const KEYS: u64 = 5;
    for i in 0..KEYS {
        executes_once_and_replays(&s, &e, &e, &up, &format!("sha-{i}"));
    }
    assert_eq!(up.executions(), KEYS);
    let (evalsha, _) = s.command_stats("evalsha");
    let (eval, _) = s.command_stats("eval");
    // Each key: one claim and one completion, each an EVALSHA (the first of each a NOSCRIPT on
    // this fresh Redis, then one EVAL that loads the script).
    assert!(evalsha >= 2 * KEYS, "evalsha calls {evalsha} < {} (eval calls {eval})", 2 * KEYS);
    assert!(eval <= 2, "eval calls {eval} > 2: a script was sent in full more than once");
    // The root counts a load when it handles the NOSCRIPT answer and hands its counters to Envoy on
    // its next tick: a completion seen in Redis may not be counted yet.
    assert!(
        eventually(Duration::from_secs(20), || e.stat("idemgate.store_script_loads") == eval),
        "every EVAL was a re-send after NOSCRIPT: {} loads counted, {eval} EVAL calls",
        e.stat("idemgate.store_script_loads")
    );
    // Redis knows both scripts by the names idemgate computed at compile time.
    let (claim, transition) = (Script::Claim.sha1_hex(), Script::Transition.sha1_hex());
    let exists = s.redis.cli(&[
        "SCRIPT",
        "EXISTS",
        std::str::from_utf8(claim).unwrap(),
        std::str::from_utf8(transition).unwrap(),
    ]);
    assert_eq!(exists.split_whitespace().collect::<Vec<_>>(), ["1", "1"], "SCRIPT EXISTS: {exists}");
    e.assert_no_wasm_panic();
}

#[test]
fn after_a_script_flush_or_a_redis_restart_a_new_key_executes_once_completes_and_replays_on_another_proxy() {
    let mut s = Store::start();
    let up = Upstream::start();
    let a = s.envoy(&up);
    let b = s.envoy(&up);
    let loads = |e: &Envoy| e.stat("idemgate.store_script_loads");
    // The completion's load is counted by the root when NOSCRIPT comes back, and reaches /stats on
    // its next tick, after the record can be seen in Redis: the count is waited for (a count that
    // goes past `want` never comes back to it, so the wait fails then too).
    let loads_reach = |want: (u64, u64)| eventually(Duration::from_secs(20), || (loads(&a), loads(&b)) == want);
    // Both scripts are loaded (the claim and the completion of a first key).
    executes_once_and_replays(&s, &a, &b, &up, "warm");
    assert!(
        loads_reach((2, 0)),
        "the first key's claim and completion loaded the scripts: {:?}",
        (loads(&a), loads(&b))
    );

    // SCRIPT FLUSH (an operator, a failover to a node that never ran them): the claim of a new key
    // and the completion the root context writes both meet NOSCRIPT.
    assert!(s.redis.cli(&["SCRIPT", "FLUSH"]).contains("OK"));
    executes_once_and_replays(&s, &a, &b, &up, "after-flush");
    assert!(
        loads_reach((4, 0)),
        "the claim and the completion each sent again with its script: {:?}",
        (loads(&a), loads(&b))
    );

    // A restart (SIGKILL, AOF kept) empties the script cache too. webdis reconnects its pooled
    // connections as they fail: until then a request may get 503 store-unavailable (nothing
    // forwarded), so the first one is repeated while it does (bounded by count).
    s.redis.restart();
    let ping = || s.webdis.request("GET", "/PING", b"").is_ok_and(|r| r.status == 200);
    assert!(
        eventually(Duration::from_secs(20), || (0..20).all(|_| ping())),
        "webdis never reached the restarted Redis on every pooled connection"
    );
    let before = up.executions();
    let mut first = post(&a, "after-restart");
    for _ in 0..50 {
        if first.status != 503 {
            break;
        }
        assert_eq!(first.json()["type"], "urn:idemgate:problem:store-unavailable", "{}", first.body_text());
        assert_eq!(up.executions(), before, "executed on a 503");
        std::thread::sleep(Duration::from_millis(200));
        first = post(&a, "after-restart");
    }
    assert_eq!(first.status, 201, "after-restart: {}", first.body_text());
    completes_and_replays(&s, &a, &b, &up, "after-restart", before, &first);
    // Each script met NOSCRIPT at least once (more if a re-send met a connection webdis had not
    // yet reconnected).
    assert!(
        eventually(Duration::from_secs(20), || loads(&a) >= 6) && loads(&b) == 0,
        "a restarted Redis holds no script: loads {} and {}",
        loads(&a),
        loads(&b)
    );
    // The AOF kept the records written before the restart.
    assert_eq!(s.phase_of("after-flush"), Some(b'D'));
    assert_eq!(up.executions(), 3);
    a.assert_no_wasm_panic();
    b.assert_no_wasm_panic();
}

/// Bytes the proxy sends to webdis per first request (claim-or-read and completion), read from
/// Envoy's store cluster (`upstream_cx_tx_bytes_total`: request lines, headers and bodies), for
/// docs/BENCHMARKS.md. Printed with `--nocapture`.
#[test]
fn store_bytes_per_first_request_are_measured() {
    let s = Store::start();
    let up = Upstream::start();
    let e = s.envoy(&up);
    let tx = || {
        e.stats("cluster.idemgate_store.upstream_cx_tx_bytes_total")
            .into_iter()
            .find(|(n, _)| n == "cluster.idemgate_store.upstream_cx_tx_bytes_total")
            .map_or(0, |(_, v)| v)
    };
    // A fresh Redis: the very first request (its scripts not yet loaded).
    let t0 = tx();
    executes_once_and_replays(&s, &e, &e, &up, "bytes-first");
    let first = tx() - t0;
    // Later first requests (distinct keys), each completion landed before the next.
    const KEYS: u64 = 20;
    let t1 = tx();
    for i in 0..KEYS {
        executes_once_and_replays(&s, &e, &e, &up, &format!("bytes-{i:02}"));
    }
    let per_request = (tx() - t1) / KEYS;
    println!(
        "store bytes sent per first request: {per_request} (mean of {KEYS}, scripts loaded); \
         the very first on a fresh Redis: {first}"
    );
    assert!(per_request > 0, "no bytes counted on the store cluster");
    // 3,850 when every call carried its script in full (before EVALSHA).
    assert!(per_request < 2_000, "{per_request} bytes per first request: are the scripts sent in full?");
    e.assert_no_wasm_panic();
}

/// A store that answers NOSCRIPT to everything (a broken proxy or mock, or an attacker on the
/// store link): each call is sent again with its script exactly once, the EVAL's NOSCRIPT is not
/// believed, and nothing is forwarded: the claim is answered 503 and its owner-checked release
/// gives up after its bounded retries. No loop, no execution.
#[test]
fn a_store_answering_noscript_to_everything_gets_each_call_once_more_and_nothing_executes() {
    let store = FakeStore::start(b"-NOSCRIPT No matching script. Please use EVAL.\r\n".to_vec());
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(PLUGIN, up.port);
    o.store_port = Some(store.port);
    let e = Envoy::start(&o);
    const KEYS: u64 = 3;
    for i in 0..KEYS {
        let r = post(&e, &format!("noscript-{i}"));
        assert_eq!(r.status, 503, "{}", r.body_text());
        assert_eq!(r.json()["type"], "urn:idemgate:problem:store-unavailable", "{}", r.body_text());
    }
    assert_eq!(up.executions(), 0);
    assert_eq!(e.stat("idemgate.store_calls_waited"), 2 * KEYS, "each claim: EVALSHA, then EVAL once");
    // The releases queued for those claims (their answers were not understood) end too.
    assert!(
        eventually(Duration::from_secs(30), || e.stat("idemgate.store_write_failures") == KEYS
            && e.stat("idemgate.store_writes_pending") == 0),
        "the releases never ended: {:?}",
        e.stats("wasmcustom.idemgate.store")
    );
    // Per key: the claim twice; the release once by name, once with its script, then its six
    // retries (`writes::MAX_WRITE_ATTEMPTS` attempts in all), never by name again.
    assert_eq!(store.requests(), KEYS * (2 + 1 + 7), "store requests");
    assert_eq!(e.stat("idemgate.store_script_loads"), 2 * KEYS);
    assert_eq!(up.executions(), 0);
    e.assert_no_wasm_panic();
}
