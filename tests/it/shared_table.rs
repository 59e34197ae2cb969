//! Issue 23, item 1: one local table per VM (`vm_id`), shared by every filter configuration in it.
//! A record keeps the protection its own configuration promised, whatever other configuration
//! shares the VM, reloads, or evicts: eviction reads the record's own floor, written with it.
//! Also the stuck key of issue 23: a store answer is read as the request it answers.

use crate::support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use support::http::{self, Response};
use support::store::{Redis, Webdis};
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions};

/// Listener A: no store, 16 entries, the default 1 h protection floor.
const NO_STORE: &str = r#"{"scope": {"headers": ["authorization"]}, "local": {"max_entries": 16}}"#;
/// Listener B: the same table (16 entries), with a Redis store: its local tier is a cache.
const WITH_STORE: &str = r#"{"scope": {"headers": ["authorization"]}, "local": {"max_entries": 16}, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 2000}}"#;

fn post(port: u16, key: &str) -> Response {
    let h = [("authorization", "Bearer alice"), ("content-type", "application/json"), ("idempotency-key", key)];
    http::request(port, "POST", "/charges", &h, b"{\"amount\":1}").expect("request")
}

fn replayed(r: &Response) -> bool {
    r.header("idempotent-replayed") == Some("true")
}

/// Fills the shared table from `port` with 40 new keys (B's configuration evicts as a cache).
fn fill(port: u16, up: &Upstream, prefix: &str) {
    let before = up.executions();
    for n in 0..40 {
        let r = post(port, &format!("{prefix}-{n}"));
        assert_eq!(r.status, 201, "{prefix}-{n}: {}", r.body_text());
    }
    assert_eq!(up.executions(), before + 40);
}

#[test]
fn a_listener_with_a_store_never_evicts_the_record_of_a_listener_without_one_in_the_same_vm() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let b_port = support::free_port();
    let mut o = EnvoyOptions::new(NO_STORE, up.port);
    o.store_port = Some(webdis.port);
    o.extra_listeners = vec![(b_port, WITH_STORE.to_string())];
    let envoy = Envoy::start(&o);
    let first = post(envoy.port, "k-shared");
    assert_eq!(first.status, 201, "{}", first.body_text());
    assert!(replayed(&post(envoy.port, "k-shared")), "A replays its record");
    assert_eq!(up.executions(), 1);
    fill(b_port, &up, "b");
    assert!(envoy.stat("idemgate.local_evictions") > 0, "B evicted (its own records) to make room");
    let again = post(envoy.port, "k-shared");
    assert_eq!(
        up.executions(),
        41,
        "k-shared executed again on A after B filled the table ({} replayed={})",
        again.status,
        replayed(&again)
    );
    assert!(replayed(&again), "{} {}", again.status, again.body_text());
    assert_eq!(again.body, first.body);
    envoy.assert_no_wasm_panic();
}

/// Waits (bounded by count) until Envoy has taken a new LDS version and no listener is warming.
fn wait_reloaded(envoy: &Envoy, updates_before: u64) {
    let updates = || envoy.stats("listener_manager.lds.update_success").first().map_or(0, |(_, v)| *v);
    for _ in 0..200 {
        if updates() > updates_before && envoy.stat("listener_manager.total_listeners_warming") == 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the listener was not reloaded");
}

#[test]
fn a_reload_that_adds_a_store_never_evicts_records_written_before_it() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(NO_STORE, up.port);
    o.store_port = Some(webdis.port);
    o.lds = true;
    let envoy = Envoy::start(&o);
    let first = post(envoy.port, "k-reload");
    assert_eq!(first.status, 201, "{}", first.body_text());
    assert!(replayed(&post(envoy.port, "k-reload")));
    let updates = envoy.stats("listener_manager.lds.update_success").first().map_or(0, |(_, v)| *v);
    envoy.reload_plugin(WITH_STORE);
    wait_reloaded(&envoy, updates);
    fill(envoy.port, &up, "r");
    assert!(envoy.stat("idemgate.store_calls") > 0, "the reloaded configuration uses the store");
    let again = post(envoy.port, "k-reload");
    assert_eq!(
        up.executions(),
        41,
        "k-reload executed again after the reload filled the table ({} replayed={})",
        again.status,
        replayed(&again)
    );
    assert!(replayed(&again), "{} {}", again.status, again.body_text());
    assert_eq!(again.body, first.body);
    envoy.assert_no_wasm_panic();
}

/// The stuck key: a key held locally as outcome-unknown, released in the store by an operator.
/// A request's headers find the local outcome-unknown record (so the filter will ask the store
/// whether it was settled); its body comes after that local record expired, so at the end of the
/// body the local tier claims and the store is asked to claim. That claim's answer must be read
/// as a claim (forward, 201), not as the settlement read (a garbled read: 409 outcome-unknown,
/// and the store claim left behind, holding the key). The timing is set by the client: the headers
/// are seen read (the `protected` counter) while the local record cannot have expired yet, and the
/// body is sent only after it must have (`unknown_outcome_seconds`, 5 s; the TTL is the subject).
#[test]
fn a_claim_sent_after_a_local_outcome_unknown_expired_mid_body_is_read_as_a_claim() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let plugin = r#"{"scope": {"headers": ["authorization"]}, "ttl_seconds": 60, "lock_ttl_seconds": 2, "unknown_outcome_seconds": 5, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 2000}}"#;
    let mut o = EnvoyOptions::new(plugin, up.port);
    o.store_port = Some(webdis.port);
    o.route_timeout_ms = 500;
    let envoy = Envoy::start(&o);
    const UNKNOWN: Duration = Duration::from_secs(5);
    let h = [("authorization", "Bearer alice"), ("idempotency-key", "k-stuck"), ("x-up-delay-ms", "1500")];
    // The local record is marked after this instant: it cannot expire before sent + UNKNOWN (less
    // 1 s for the records' whole-second clock).
    let sent = Instant::now();
    let first = http::request(envoy.port, "POST", "/charges", &h, b"{}").expect("request");
    assert_eq!(first.status, 504, "{}", first.body_text());
    assert_eq!(up.executions(), 1);
    // The store learns the outcome is unknown; then an operator releases the key there.
    let name = support::redis_key_of(plugin, "Bearer alice", "k-stuck");
    let mut landed = false;
    for _ in 0..200 {
        if redis.get_raw(&name).is_some_and(|v| v.get(4) == Some(&b'U')) {
            landed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(landed, "the store never learned the outcome is unknown");
    // The local record was marked before the store learned of it: expired by landed + UNKNOWN.
    let landed_at = Instant::now();
    redis.cli(&["DEL", &name]);
    // The headers while the local record is still outcome-unknown...
    let mut s = TcpStream::connect(("127.0.0.1", envoy.port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    let head = "POST /charges HTTP/1.1\r\nhost: idemgate.test\r\nauthorization: Bearer alice\r\nidempotency-key: k-stuck\r\ncontent-length: 2\r\nconnection: close\r\n\r\n";
    s.write_all(head.as_bytes()).expect("headers");
    // Read by the filter (counted as protected: the first request was the first), bounded by count.
    support::wait_for("the second request's headers read", 200, || envoy.stat("idemgate.protected") == 2);
    let read_after = sent.elapsed();
    assert!(
        read_after + Duration::from_secs(1) < UNKNOWN,
        "too slow to judge: the headers were read {read_after:?} after the first request, when the local record may have expired"
    );
    // ...the body once the local record has expired (a margin for the whole-second clock).
    std::thread::sleep((UNKNOWN + Duration::from_secs(1)).saturating_sub(landed_at.elapsed()));
    s.write_all(b"{}").expect("body");
    let mut buf = vec![];
    let _ = s.read_to_end(&mut buf);
    let r = http::parse(&buf).expect("response");
    assert_eq!(r.status, 201, "{}", r.body_text());
    assert_eq!(up.executions(), 2, "the key released by the operator executes once more");
    let retry = http::request(envoy.port, "POST", "/charges", &[h[0], h[1]], b"{}").expect("request");
    assert!(replayed(&retry), "{} {}", retry.status, retry.body_text());
    assert_eq!(up.executions(), 2);
    envoy.assert_no_wasm_panic();
}
