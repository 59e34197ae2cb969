//! Fail closed (issue 13, items 4 and 5): a branch of the filter that meets one of its own
//! invariants broken answers 503 `internal-state` and never forwards; a claim that lands in the
//! store after its owner-checked release cannot block its key.
//!
//! The invariants are broken on purpose by the test-only module (`--crash-injection`, trigger
//! `x-idemgate-test-fault`), which the shipped module does not carry.

use crate::support;

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::http::{self, Response};
use support::store::{Redis, Webdis};
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions};

const LOCAL: &str = r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 30}"#;
const FAULT: &str = "x-idemgate-test-fault";

fn post(port: u16, key: &str, body: &str, extra: &[(&str, &str)]) -> Response {
    let mut h: Vec<(&str, &str)> = vec![("authorization", "Bearer alice"), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    http::request_timeout(port, "POST", "/charges", &h, body.as_bytes(), Duration::from_secs(10)).expect("request")
}

fn problem_type(r: &Response) -> String {
    r.json()["type"].as_str().unwrap_or("").to_string()
}

/// The test-only module that breaks invariants on demand (built once per test run).
fn fault_module() -> PathBuf {
    support::build_module("--crash-injection", "idemgate-crash.wasm")
}

fn fault_envoy(up: &Upstream) -> Envoy {
    let mut o = EnvoyOptions::new(LOCAL, up.port);
    o.wasm = Some(fault_module());
    o.concurrency = 1;
    Envoy::start(&o)
}

#[test]
fn fail_closed_the_shipped_module_has_no_fault_trigger() {
    let shipped = std::fs::read(support::wasm_path()).expect("dist/idemgate.wasm");
    let test_build = std::fs::read(fault_module()).expect("fault module");
    let needle = FAULT.as_bytes();
    assert!(test_build.windows(needle.len()).any(|w| w == needle), "the test build must carry the trigger");
    assert!(!shipped.windows(needle.len()).any(|w| w == needle), "the shipped module carries the test trigger");
}

/// Asserts the refusal: 503 `internal-state` with `retry-after`, nothing executed, counted and logged.
fn assert_refused(e: &Envoy, up: &Upstream, r: &Response, branch: &str) {
    assert_eq!(up.executions(), 0, "executions {} != 0: a broken invariant forwarded the request", up.executions());
    assert_eq!((r.status, problem_type(r).as_str()), (503, "urn:idemgate:problem:internal-state"), "{}", r.body_text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(e.stat("idemgate.internal_errors"), 1);
    assert!(e.log().contains(&format!("branch={branch}")), "no log line names the branch {branch}");
}

#[test]
fn fail_closed_a_policy_lost_while_the_body_arrives_is_refused_and_frees_the_key() {
    let up = Upstream::start();
    let e = fault_envoy(&up);
    let r = post(e.port, "k-lost-body", "{\"a\":1}", &[(FAULT, "policy-lost-at-body")]);
    assert_refused(&e, &up, &r, "request_body");
    // It never left and held nothing (claims are made at the body's end): the retry executes once.
    let retry = post(e.port, "k-lost-body", "{\"a\":1}", &[]);
    assert_eq!(retry.status, 201, "{}", retry.body_text());
    assert_eq!(post(e.port, "k-lost-body", "{\"a\":1}", &[]).header("idempotent-replayed"), Some("true"));
    assert_eq!(up.executions(), 1);
}

#[test]
fn fail_closed_a_policy_lost_on_a_request_without_body_is_refused() {
    let up = Upstream::start();
    let e = fault_envoy(&up);
    let r = post(e.port, "k-lost-headers", "", &[(FAULT, "policy-lost-at-headers")]);
    assert_refused(&e, &up, &r, "request_headers_fingerprint");
    let retry = post(e.port, "k-lost-headers", "", &[]);
    assert_eq!(retry.status, 201, "{}", retry.body_text());
    assert_eq!(up.executions(), 1);
}

/// A TCP proxy in front of webdis that holds the next `arm`ed claim-or-read (the request naming or
/// carrying the claim script) for `delay` before passing it on, as a slow link to the store would, while
/// every other request (the owner-checked release among them) goes through at once. A held request
/// is delivered even after Envoy gave up on it: it was already on its way.
struct SlowClaims {
    port: u16,
    armed: Arc<AtomicU32>,
    /// Held requests that webdis has answered (so Redis has run them).
    answered: Arc<AtomicU32>,
}

impl SlowClaims {
    fn start(webdis_port: u16, delay: Duration) -> SlowClaims {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let armed = Arc::new(AtomicU32::new(0));
        let answered = Arc::new(AtomicU32::new(0));
        let (a, n) = (armed.clone(), answered.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(upstream) = TcpStream::connect(("127.0.0.1", webdis_port)) else { continue };
                let (a, n) = (a.clone(), n.clone());
                std::thread::spawn(move || relay(client, upstream, delay, &a, &n));
            }
        });
        SlowClaims { port, armed, answered }
    }
}

fn relay(
    mut client: TcpStream,
    mut upstream: TcpStream,
    delay: Duration,
    armed: &AtomicU32,
    answered: &Arc<AtomicU32>,
) {
    let held = Arc::new(AtomicBool::new(false));
    let (Ok(mut from_up), Ok(mut to_client)) = (upstream.try_clone(), client.try_clone()) else { return };
    let (h, n) = (held.clone(), answered.clone());
    std::thread::spawn(move || {
        let mut buf = [0u8; 16384];
        while let Ok(k) = http::read_some(&mut from_up, &mut buf) {
            if k == 0 {
                break;
            }
            if h.load(Ordering::SeqCst) {
                n.fetch_add(1, Ordering::SeqCst);
            }
            let _ = to_client.write_all(&buf[..k]);
        }
    });
    let mut buf = [0u8; 16384];
    // Bounded: a connection carries a bounded number of chunks in these tests.
    for _ in 0..10_000 {
        let Ok(k) = http::read_some(&mut client, &mut buf) else { break };
        if k == 0 {
            break;
        }
        let chunk = &buf[..k];
        // By its script's name (EVALSHA) or, re-sent after NOSCRIPT, by the script's text.
        let name = idemgate::store::Script::Claim.sha1_hex();
        let is_claim = chunk.windows(name.len()).any(|w| w == name) || chunk.windows(5).any(|w| w == b"IGS1P");
        if is_claim && armed.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |x| x.checked_sub(1)).is_ok() {
            held.store(true, Ordering::SeqCst);
            std::thread::sleep(delay);
        }
        if upstream.write_all(chunk).is_err() {
            break;
        }
    }
    // The client may have left: keep the upstream connection until webdis has answered.
    if held.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_secs(3));
    }
}

const STORE: &str = r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 30, "store": {"cluster": "idemgate_store", "timeout_ms": 300}}"#;

#[test]
fn fail_closed_a_claim_landing_after_its_release_does_not_block_the_key() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let slow = SlowClaims::start(webdis.port, Duration::from_millis(1500));
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(STORE, up.port);
    o.store_port = Some(slow.port);
    let e = Envoy::start(&o);
    slow.armed.store(1, Ordering::SeqCst);
    let r = post(e.port, "k-late-claim", "{}", &[]);
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (503, "urn:idemgate:problem:store-unavailable"),
        "{}",
        r.body_text()
    );
    assert_eq!(up.executions(), 0);
    // The release, queued when the claim's answer was lost, is answered before the claim lands:
    // its tombstone (`IGS1R`) is in Redis, read there rather than from a counter the root hands
    // to /stats on its next tick.
    let tombstone = || redis.keys("*").iter().any(|k| redis.get_raw(k).is_some_and(|v| v.starts_with(b"IGS1R")));
    assert!(
        eventually(Duration::from_secs(20), tombstone),
        "the owner-checked release never ran (store writes: {})",
        e.stat("idemgate.store_writes")
    );
    assert_eq!(slow.answered.load(Ordering::SeqCst), 0, "the claim landed before the release: nothing measured");
    // Then the held claim reaches Redis.
    assert!(
        eventually(Duration::from_secs(20), || slow.answered.load(Ordering::SeqCst) >= 1),
        "the claim never landed"
    );
    // Nothing ran under that claim: a retry with the same key must execute, once.
    let retry = post(e.port, "k-late-claim", "{}", &[]);
    assert_eq!(retry.status, 201, "key blocked by a claim that landed after its release: {}", retry.body_text());
    assert_eq!(post(e.port, "k-late-claim", "{}", &[]).header("idempotent-replayed"), Some("true"));
    assert_eq!(up.executions(), 1);
    // The held claim ran by name (the test Redis holds the scripts), so it met the tombstone: no
    // EVALSHA was answered NOSCRIPT.
    let stats = redis.cli(&["INFO", "commandstats"]);
    let evalsha = stats.lines().find(|l| l.starts_with("cmdstat_evalsha:")).unwrap_or_default();
    assert!(evalsha.contains(",failed_calls=0"), "{evalsha}");
}

fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}
