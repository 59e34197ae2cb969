//! A bounded soak (`make test-faults`; IDEMGATE_SOAK_SECONDS, default 120): two Envoys, Redis
//! with AOF behind webdis, one counting upstream; agents retry every operation until they get a
//! final answer, some send duplicates to both proxies at once, some operations time out or have
//! their connection reset upstream; meanwhile webdis, Redis and one Envoy are killed and
//! restarted in turn. The accounting at the end: upstream executions == distinct operations,
//! and no operation executed twice.

use crate::support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::http::{self, Response};
use support::store::{Redis, Webdis};
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions};

/// Agents, and the most operations each sends: the soak is bounded by count as well as by time,
/// and the local table is sized from that count, so a faster machine cannot fill it.
const AGENTS: usize = 8;
const OPS_PER_AGENT: u64 = 4_000;
const PLUGIN: &str = r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 2, "local": {"max_entries": 80000}, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 500}}"#;

/// How one operation ended.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum End {
    Executed,
    Replayed,
    OutcomeUnknown,
    GaveUp,
}

/// A tiny deterministic generator (xorshift), seeded per agent.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn send(port: u16, key: &str, agent: usize, extra: &[(&str, &str)]) -> Option<Response> {
    let auth = format!("Bearer agent-{agent}");
    let mut h: Vec<(&str, &str)> = vec![("authorization", &auth), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    http::request_timeout(
        port,
        "POST",
        "/charges",
        &h,
        format!(r#"{{"op":"{key}"}}"#).as_bytes(),
        Duration::from_secs(5),
    )
    .ok()
}

#[test]
fn soak_mixed_retries_duplicates_and_faults_executes_every_operation_exactly_once() {
    let seconds: u64 = std::env::var("IDEMGATE_SOAK_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(120);
    let mut redis = Redis::start();
    let webdis = Arc::new(Mutex::new(Webdis::start(redis.port)));
    let webdis_port = webdis.lock().unwrap().port;
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(PLUGIN, up.port);
    o.store_port = Some(webdis_port);
    o.route_timeout_ms = 1000;
    let a = Envoy::start(&o);
    let b = Arc::new(Mutex::new(Envoy::start(&o)));
    let ports = Arc::new([AtomicU16::new(a.port), AtomicU16::new(b.lock().unwrap().port)]);

    let stop = Arc::new(AtomicBool::new(false));
    let ends = Arc::new(Mutex::new(HashMap::<String, End>::new()));
    let sends = Arc::new(AtomicU64::new(0));
    const { assert!(AGENTS as u64 * OPS_PER_AGENT * 2 <= 80_000) };
    let agents: Vec<_> = (0..AGENTS)
        .map(|agent| {
            let (stop, ends, sends, ports) = (stop.clone(), ends.clone(), sends.clone(), ports.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((agent as u64 + 1) * 0x1000_0001));
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) && n < OPS_PER_AGENT {
                    n += 1;
                    let key = format!("soak-{agent}-{n}");
                    let kind = rng.next() % 10;
                    // 1 in 10 times out upstream (1.5 s > the 1 s route timeout), 1 in 10 is
                    // reset by the upstream, 2 in 10 are sent twice at once to both proxies.
                    let fault: Vec<(&str, &str)> = match kind {
                        0 => vec![("x-up-delay-ms", "1500")],
                        1 => vec![("x-up-reset", "before-headers")],
                        _ => vec![],
                    };
                    let mut end = End::GaveUp;
                    for attempt in 0..60 {
                        let port = ports[(agent + attempt) % 2].load(Ordering::SeqCst);
                        let extra: &[(&str, &str)] = if attempt == 0 { &fault } else { &[] };
                        let answer = if attempt == 0 && kind >= 8 {
                            // A duplicate to the other proxy at the same time.
                            let other = ports[(agent + 1) % 2].load(Ordering::SeqCst);
                            let k2 = key.clone();
                            let twin = std::thread::spawn(move || send(other, &k2, agent, &[]));
                            let mine = send(port, &key, agent, extra);
                            let theirs = twin.join().ok().flatten();
                            sends.fetch_add(2, Ordering::SeqCst);
                            // Whichever was final decides.
                            match (mine, theirs) {
                                (Some(m), Some(t)) if t.status == 201 && m.status != 201 => Some(t),
                                (Some(m), _) => Some(m),
                                (None, t) => t,
                            }
                        } else {
                            sends.fetch_add(1, Ordering::SeqCst);
                            send(port, &key, agent, extra)
                        };
                        match answer {
                            Some(r) if r.status == 201 && r.header("idempotent-replayed") == Some("true") => {
                                end = End::Replayed;
                                break;
                            }
                            Some(r) if r.status == 201 => {
                                end = End::Executed;
                                break;
                            }
                            Some(r) if r.status == 409 && r.problem() == "outcome-unknown" => {
                                end = End::OutcomeUnknown;
                                break;
                            }
                            // 409 in flight, 503 store unavailable, 503/504 from Envoy, a
                            // refused connection during a restart: retry a little later.
                            _ => std::thread::sleep(Duration::from_millis(150 + rng.next() % 200)),
                        }
                    }
                    ends.lock().unwrap().insert(key, end);
                }
            })
        })
        .collect();

    // The fault injector: webdis, Redis and proxy b killed and restarted in turn.
    let t0 = Instant::now();
    let mut faults = vec![];
    let mut round = 0;
    while t0.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_secs(8));
        if t0.elapsed() >= Duration::from_secs(seconds) {
            break;
        }
        round += 1;
        match round % 3 {
            1 => {
                webdis.lock().unwrap().kill9();
                std::thread::sleep(Duration::from_secs(2));
                webdis.lock().unwrap().restart();
                faults.push("webdis killed 2 s");
            }
            2 => {
                redis.kill9();
                std::thread::sleep(Duration::from_secs(2));
                redis.restart();
                faults.push("redis killed 2 s (AOF)");
            }
            _ => {
                let mut old = b.lock().unwrap();
                old.kill();
                let fresh = Envoy::start(&o);
                ports[1].store(fresh.port, Ordering::SeqCst);
                *old = fresh;
                faults.push("envoy b killed and restarted");
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    for t in agents {
        t.join().unwrap();
    }
    std::thread::sleep(Duration::from_millis(500));

    let ends = ends.lock().unwrap();
    let per_key = up.executions_by_key();
    let twice: Vec<_> = per_key.iter().filter(|(_, n)| **n > 1).collect();
    let gave_up: Vec<_> = ends.iter().filter(|(_, e)| **e == End::GaveUp).collect();
    let mut by_end: HashMap<End, u64> = HashMap::new();
    for e in ends.values() {
        *by_end.entry(e.clone()).or_insert(0) += 1;
    }
    let executions = up.executions();
    let summary = format!(
        "{} s, {} operations, {} sends, {} executions, {} executions of keys no agent sent; ends {:?}; faults: {}",
        seconds,
        ends.len(),
        sends.load(Ordering::SeqCst),
        executions,
        per_key.keys().filter(|k| !ends.contains_key(*k)).count(),
        by_end,
        faults.join(", ")
    );
    println!("soak: {summary}");
    support::fault_report(
        "table.md",
        &[&format!("soak: {seconds} s of mixed retries, duplicates and faults"), &executions.to_string(), &summary],
    );
    assert!(twice.is_empty(), "executed twice: {twice:?}");
    assert!(gave_up.is_empty(), "operations without a final answer after 60 attempts: {gave_up:?}");
    // Every operation reached a final answer. A result (first or replayed) means exactly one
    // execution; "outcome unknown" means at most one (a proxy killed between its store claim and
    // forwarding leaves a claim that cannot be told apart from a forwarded one).
    let mut unknown_unexecuted = 0;
    for (key, end) in ends.iter() {
        let n = per_key.get(key).copied().unwrap_or(0);
        match end {
            End::OutcomeUnknown if n == 0 => unknown_unexecuted += 1,
            _ => assert_eq!(n, 1, "{key} ended {end:?}"),
        }
    }
    assert_eq!(executions + unknown_unexecuted, ends.len() as u64, "executions == distinct operations");
    assert!(ends.len() > 100, "too little traffic: {summary}");
    a.assert_no_wasm_panic();
    b.lock().unwrap().assert_no_wasm_panic();
}
