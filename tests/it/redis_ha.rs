//! Redis HA (issue 42): the store with no single point of failure and no manual step, started by
//! `scripts/store_ha.py` from the shipped configurations (`envoy/redis-ha/`): three Redis nodes
//! managed by three Sentinels, two legs of HAProxy (routing to whichever node says role:master)
//! with a webdis in front of each, both webdis in the `idemgate_store` cluster of two Envoys
//! (`envoy/redis-ha/idemgate-store-cluster.yaml`, health-checked). Faults are injected under load
//! through both proxies, and what they cost is measured and written to target/faults/redis_ha.md:
//! the seconds from the fault until requests are served again with no operator, the first
//! requests refused meanwhile, the acknowledged claims the new primary lacks (replication is
//! asynchronous), and executions per key.
//!
//! Asserted in every run, whatever the timing: protection comes back by itself (a bounded count of
//! attempts), every answer is a documented one, and every key executed twice is one whose claim
//! the primary serving after the fault lacked (the loss is explained, never a second execution of
//! a key the store held).
//!
//! `make test` runs the short form (`redis_ha::faults::`, the primary killed); `make
//! test-redis-ha` the full forms (`redis_ha::failover_full_*`: the primary, one webdis, one
//! HAProxy, the whole store down and back, more keys).

mod faults;

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::http::{self, Response};
use support::upstream::Upstream;
use support::{fault_report, Envoy, EnvoyOptions, Scratch};

const PLUGIN: &str = r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 60, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 500}}"#;
const CALLER: &str = "Bearer redis-ha-caller";
/// webdis's basic-auth credential in the shipped `envoy/redis-ha/webdis.json`.
const STORE_AUTH: &str = "idemgate:idemgate-demo-webdis-password";
const ADMIN: (&str, &str) = ("admin", "idemgate-demo-admin-password");
/// Client threads, each sending its keys one after another, alternating proxies.
const CLIENTS: usize = 6;
/// The pause of each client after each answer.
const PACE: Duration = Duration::from_millis(40);
/// The most keys a run sends before its fault, as a multiple of its load: while the store refuses
/// (a stalled primary fails every leg's health check at once), more keys until an eighth of the
/// load executed.
const PRE_FAULT_KEYS: usize = 10;
/// Polls (100 ms apart) for the proxies' store writes to land or be given up.
const WRITE_POLLS: u32 = 600;
/// Attempts of a request answered 503 `store-unavailable`, 100 ms apart: a bound by count, which
/// costs time only while the store refuses. 600 (at least 60 s): on a starved machine the Sentinels
/// failed over a primary that was alive and entered TILT (a Sentinel's timer late by over 2 s: 30 s
/// without acting), so two nodes said `role:master` for 31-36 s before a Sentinel demoted one;
/// the store came back with nobody touching anything. With 100 (10 s) the retry of
/// `short-primary-99` failed in a CI run on a machine running two test suites (docs/testing.md,
/// "The Redis HA tests on a starved machine").
const UNAVAILABLE_ATTEMPTS: u32 = 600;

fn store_ha(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(support::repo_root().join("scripts/store_ha.py"))
        .arg(args[0])
        .arg(dir)
        .args(&args[1..])
        .output()
        .expect("run scripts/store_ha.py");
    assert!(
        out.status.success(),
        "store_ha.py {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The store as `scripts/store_ha.py` starts it; everything SIGKILLed when dropped.
pub struct HaStore {
    pub scratch: Scratch,
}

impl HaStore {
    /// `store_ha.py up` with `options` (`--tls`: Redis on its TLS port only, replication,
    /// Sentinel and HAProxy's links and checks to Redis over TLS; `--acl`: idemgate as the named ACL user
    /// `idemgate` through an Envoy redis_proxy hop per leg).
    pub fn start_with(options: &[&str]) -> HaStore {
        let scratch = Scratch::new("redis-ha");
        let args: Vec<&str> = std::iter::once("up").chain(options.iter().copied()).collect();
        store_ha(&scratch.0, &args);
        HaStore { scratch }
    }

    fn stack(&self) -> serde_json::Value {
        let text = std::fs::read(self.scratch.0.join("stack.json")).expect("stack.json");
        serde_json::from_slice(&text).expect("stack.json is JSON")
    }

    pub fn kill(&self, part: &str) {
        store_ha(&self.scratch.0, &["kill", part]);
    }

    pub fn start_part(&self, part: &str) {
        store_ha(&self.scratch.0, &["start", part]);
    }

    /// The node the Sentinels name primary (`redis-N`).
    pub fn primary(&self) -> String {
        store_ha(&self.scratch.0, &["primary"]).trim().to_string()
    }

    pub fn port(&self, part: &str) -> u16 {
        self.part(part)["port"].as_u64().expect("a port") as u16
    }

    /// HAProxy `part`'s TLS frontend for the other legs' hops (`--tls --acl`), if it has one.
    pub fn peer_port(&self, part: &str) -> Option<u16> {
        self.part(part)["peer_port"].as_u64().map(|p| p as u16)
    }

    /// What `scripts/store_ha.py` recorded of `part` (`redis-N`, `sentinel-N`, `haproxy-N`,
    /// `webdis-N`): its port and pid.
    fn part(&self, part: &str) -> serde_json::Value {
        let (kind, i) = part.rsplit_once('-').expect("a part name");
        let key = match kind {
            "redis" => "redis",
            "sentinel" => "sentinels",
            "haproxy" => "haproxies",
            "hop" => "hops",
            "opshop" => "ops_hops",
            "opswebdis" => "ops_webdis",
            _ => "webdis",
        };
        let i: usize = i.parse().expect("a part number");
        self.stack()[key][i].clone()
    }

    /// Requests hop `part` (`hop-N`, `--acl`) sent to each upstream (HAProxy port -> its
    /// `rq_total`), from that Envoy's admin `/clusters`.
    pub fn hop_requests(&self, part: &str) -> BTreeMap<u16, u64> {
        let admin = self.part(part)["admin_port"].as_u64().expect("an admin port") as u16;
        let r = http::request(admin, "GET", "/clusters", &[], b"").expect("the hop's admin answers");
        r.body_text()
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("redis::127.0.0.1:")?;
                let (port, n) = rest.split_once("::rq_total::")?;
                Some((port.parse().ok()?, n.trim().parse().ok()?))
            })
            .collect()
    }

    /// The counter `name` of hop `part`'s Envoy (`--acl`), from its admin `/stats` (0 when absent).
    pub fn hop_stat(&self, part: &str, name: &str) -> u64 {
        let admin = self.part(part)["admin_port"].as_u64().expect("an admin port") as u16;
        let r = http::request(admin, "GET", "/stats", &[], b"").expect("the hop's admin answers");
        let prefix = format!("{name}: ");
        r.body_text().lines().find_map(|l| l.strip_prefix(prefix.as_str())?.trim().parse().ok()).unwrap_or(0)
    }

    /// Whether HAProxy `part` routes to a primary: `PING` through it (plain RESP to HAProxy, which
    /// originates the TLS to Redis) as `admin` answers `PONG`.
    pub fn haproxy_routes(&self, part: &str) -> bool {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port(part).to_string(), "--user", ADMIN.0, "--pass", ADMIN.1, "--no-auth-warning"])
            .arg("PING")
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).trim() == "PONG"
    }

    /// The `idemgate_store` cluster (YAML list item from column 0) for this stack.
    pub fn cluster(&self) -> String {
        store_ha(&self.scratch.0, &["cluster"])
    }

    /// `redis-cli` on node `part` as `admin` (TLS when the stack has it).
    fn cli_output(&self, part: &str, args: &[&str]) -> std::process::Output {
        let tls = self.scratch.0.join("tls");
        let mut cli = Command::new("redis-cli");
        if tls.exists() {
            cli.arg("--tls").arg("--cacert").arg(tls.join("ca.crt"));
            cli.arg("--cert").arg(tls.join("redis.crt")).arg("--key").arg(tls.join("redis.key"));
        }
        cli.args(["-p", &self.port(part).to_string(), "--user", ADMIN.0, "--pass", ADMIN.1, "--no-auth-warning"])
            .args(args)
            .output()
            .expect("redis-cli")
    }

    /// `redis-cli` on node `part` as `admin`: its stdout.
    fn cli(&self, part: &str, args: &[&str]) -> String {
        String::from_utf8_lossy(&self.cli_output(part, args).stdout).into_owned()
    }

    /// `CONFIG SET min-replicas-to-write n` on every node.
    pub fn set_min_replicas(&self, n: &str) {
        for i in 0..3 {
            let out = self.cli(&format!("redis-{i}"), &["CONFIG", "SET", "min-replicas-to-write", n]);
            assert_eq!(out.trim(), "OK", "CONFIG SET min-replicas-to-write {n} on redis-{i}");
        }
    }

    /// `INFO replication` of node `part` (empty when it does not answer).
    pub fn replication(&self, part: &str) -> String {
        self.cli(part, &["INFO", "replication"])
    }

    /// The pid `scripts/store_ha.py` recorded for `part`.
    pub fn pid(&self, part: &str) -> i32 {
        self.part(part)["pid"].as_i64().expect("a pid") as i32
    }

    /// The idemgate keys node `part` holds.
    pub fn keys(&self, part: &str) -> BTreeSet<String> {
        let out = self.cli_output(part, &["--scan", "--pattern", "idemgate:v1:*"]);
        assert!(out.status.success(), "redis-cli --scan: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
    }
}

impl Drop for HaStore {
    fn drop(&mut self) {
        let _ = Command::new("python3")
            .arg(support::repo_root().join("scripts/store_ha.py"))
            .arg("down")
            .arg(&self.scratch.0)
            .output();
    }
}

/// The store, the two proxies sharing it and the upstream.
pub struct World {
    pub store: HaStore,
    pub up: Upstream,
    pub proxies: [Envoy; 2],
}

impl World {
    pub fn start(tls: bool) -> World {
        World::start_with(if tls { &["--tls"] } else { &[] })
    }

    /// The store started with `store_ha.py up` `options`.
    pub fn start_with(options: &[&str]) -> World {
        let store = HaStore::start_with(options);
        // `IDEMGATE_REDIS_HA_MIN_REPLICAS=N`: every node's `min-replicas-to-write` set to N for
        // this run (0: the configuration before it was shipped), to measure the shipped 1 against it.
        if let Ok(n) = std::env::var("IDEMGATE_REDIS_HA_MIN_REPLICAS") {
            store.set_min_replicas(&n);
        }
        let up = Upstream::start();
        let mut o = EnvoyOptions::new(PLUGIN, up.port);
        o.extra_clusters.push(store.cluster());
        o.vm_host_env.push(("IDEMGATE_STORE_AUTH".into(), STORE_AUTH.into()));
        o.route_timeout_ms = 30_000;
        let proxies = [Envoy::start(&o), Envoy::start(&o)];
        let w = World { store, up, proxies };
        // Both proxies protect through the store before any fault (the health checks have run).
        for (p, port) in w.ports().into_iter().enumerate() {
            let served = (0..UNAVAILABLE_ATTEMPTS).any(|a| {
                post(port, &format!("warm-up-{p}-{a}")).status == 201 || {
                    std::thread::sleep(Duration::from_millis(100));
                    false
                }
            });
            assert!(served, "proxy {p} never served through the HA store:\n{}", w.proxies[p].log());
        }
        w
    }

    pub fn ports(&self) -> [u16; 2] {
        [self.proxies[0].port, self.proxies[1].port]
    }

    fn wait_writes_settled(&self) {
        support::wait_writes_settled(&[&self.proxies[0], &self.proxies[1]], WRITE_POLLS);
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

fn redis_key_of(key: &str) -> String {
    support::redis_key_of(PLUGIN, CALLER, key)
}

fn post(port: u16, key: &str) -> Response {
    post_held(port, key, "20")
}

/// `post` answered by the upstream after `delay_ms`.
fn post_held(port: u16, key: &str, delay_ms: &str) -> Response {
    post_with(port, key, &[("x-up-delay-ms", delay_ms)])
}

/// `post` with the upstream's test headers `extra` (`x-up-reset`, `x-up-hold`, ...).
fn post_with(port: u16, key: &str, extra: &[(&str, &str)]) -> Response {
    let mut h = vec![("authorization", CALLER), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    http::request(port, "POST", "/charges", &h, b"{\"amount\": 1}").expect("an answer")
}

/// `post`, asked again (100 ms apart, at most `attempts` in all) while it is refused 503
/// `store-unavailable` (nothing forwarded): a proxy may still send to a dead leg until its
/// health check takes it out.
fn post_past_unavailable(port: u16, key: &str, attempts: u32) -> Response {
    let mut r = post(port, key);
    for _ in 1..attempts {
        if r.problem() != "store-unavailable" {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        r = post(port, key);
    }
    r
}

/// A short description of an answer: `201`, `201 replayed`, `503 store-unavailable`, ...
fn kind(r: &Response) -> String {
    match (r.status, r.header("idempotent-replayed"), r.problem()) {
        (_, Some("true"), _) => format!("{} replayed", r.status),
        (s, _, p) if p.is_empty() => s.to_string(),
        (s, _, p) => format!("{s} {p}"),
    }
}

/// `kill <sig> <pid>`.
fn signal(pid: i32, sig: &str) {
    let st = Command::new("kill").args([sig, &pid.to_string()]).status().expect("kill");
    assert!(st.success(), "kill {sig} {pid}");
}

/// The faults the tests inject.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// SIGKILL of the node the Sentinels name primary (not started again during the run).
    Primary,
    /// SIGKILL of webdis-0 (not started again).
    Webdis,
    /// SIGKILL of haproxy-0, webdis-0's only way to Redis (not started again).
    Haproxy,
    /// SIGKILL of hop-0 (`--acl`: the Envoy `redis_proxy` between webdis-0 and the HAProxies),
    /// webdis-0's only way to Redis on that path (not started again).
    Hop,
    /// SIGKILL of every Redis node, then all three started again (from their AOF) once both
    /// proxies answer 503 `store-unavailable`.
    WholeStore,
    /// The primary cut off from both its replicas (each SIGSTOPped: no replication, no
    /// acknowledgement, their sockets held open) while clients and Sentinels still reach it; held
    /// until both proxies refuse (the primary's `min-replicas-max-lag`), then healed (SIGCONT).
    Partition,
}

/// One request of the load: when it was sent and answered (from the run's start), and its answer.
struct Sent {
    /// The key's number: `{label}-{i}`, sent to proxy `i % 2`.
    i: usize,
    key: String,
    start: Duration,
    end: Duration,
    kind: String,
}

/// What one run measured.
pub struct Measured {
    /// Seconds from the fault until the first request sent after it that was served (201).
    pub back_after: f64,
    /// Seconds from the fault to the end of the last request refused (503) because of it.
    pub last_refusal_after: f64,
    pub refused: usize,
    /// First requests refused (503 `store-unavailable`) before the fault: an availability figure
    /// of the machine the run had (a primary or a leg stalled past the health check's timeout),
    /// reported, not asserted; the load sends more keys until an eighth of `n` executed.
    pub refused_before: usize,
    pub answers: BTreeMap<String, usize>,
    /// Executed keys whose claim the primary serving after the fault lacked.
    pub lost: usize,
    pub twice: usize,
    pub keys: usize,
    /// `run_probed`'s fresh keys after the load, by answer (empty unless asked for).
    pub probes: BTreeMap<String, usize>,
    /// With the hop (`--acl`): requests hop-0 sent to haproxy-1 (with `--tls`, to its TLS
    /// frontend, `peer_port`), read once the load and the fresh keys were answered (none before a
    /// fault: its own HAProxy comes first).
    pub hop0_to_other: Option<u64>,
    /// With `--tls --acl`: TLS handshakes hop-0 completed (`cluster.redis.ssl.handshake`). Its
    /// own HAProxy is plain loopback, so these are its links to the other leg's HAProxy.
    pub hop0_tls_handshakes: Option<u64>,
}

/// Keys from `CLIENTS` threads through both proxies, each sent once: the fault injected once an
/// eighth of `n` executed, then `n` less an eighth more keys sent; every key then retried on both
/// proxies. Bounded by count, not by time: keys refused before the fault (a stalled store on a
/// starved machine) are made up by more keys, at most `PRE_FAULT_KEYS` times `n` in all.
pub fn run(fault: Fault, n: usize, label: &str) -> Measured {
    run_on(false, fault, n, label)
}

/// `run` on the TLS stack (`tls`) or the plain one.
pub fn run_on(tls: bool, fault: Fault, n: usize, label: &str) -> Measured {
    run_with(if tls { &["--tls"] } else { &[] }, fault, n, label)
}

/// `run` on the stack `store_ha.py up` `options` starts (`--tls`, `--acl`).
pub fn run_with(options: &[&str], fault: Fault, n: usize, label: &str) -> Measured {
    run_probed(options, fault, n, label, 0)
}

/// `run_with`, then, once the load has ended and before any retry, `probes` fresh keys sent once
/// each, alternating proxies (`Measured::probes`: their answers). With one leg lost, a store that
/// still sends part of its calls to that leg refuses some of them.
pub fn run_probed(options: &[&str], fault: Fault, n: usize, label: &str, probes: usize) -> Measured {
    let tls = options.contains(&"--tls");
    let acl = options.contains(&"--acl");
    let w = World::start_with(options);
    let ports = w.ports();
    let t0 = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    // The keys sent are `{label}-0` up to (not including) `limit`: until the fault, as many as
    // it takes for an eighth of `n` to execute (at most `PRE_FAULT_KEYS * n`); at the fault,
    // `n` less an eighth more.
    let limit = Arc::new(AtomicUsize::new(PRE_FAULT_KEYS * n));
    let sent = Arc::new(Mutex::new(Vec::<Sent>::new()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (limit, next, sent) = (limit.clone(), next.clone(), sent.clone());
            let label = label.to_string();
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= limit.load(Ordering::SeqCst) {
                    return;
                }
                let key = format!("{label}-{i}");
                let start = t0.elapsed();
                let r = post(ports[i % 2], &key);
                // Paced (each client at most one request per PACE), so the load outlasts a failover.
                std::thread::sleep(PACE);
                let s = Sent { i, key, start, end: t0.elapsed(), kind: kind(&r) };
                sent.lock().unwrap_or_else(|e| e.into_inner()).push(s);
            })
        })
        .collect();
    let eighth = (n / 8) as u64;
    let reached = (0..60_000).any(|_| {
        w.up.executions() >= eighth || next.load(Ordering::SeqCst) >= PRE_FAULT_KEYS * n + CLIENTS || {
            std::thread::sleep(Duration::from_millis(1));
            false
        }
    }) && w.up.executions() >= eighth;
    let refused_before = || {
        let sent = sent.lock().unwrap_or_else(|e| e.into_inner());
        sent.iter().filter(|s| s.kind != "201").count()
    };
    assert!(
        reached,
        "an eighth of {n} keys never executed: {} executed, {} sent, {} refused",
        w.up.executions(),
        next.load(Ordering::SeqCst).min(PRE_FAULT_KEYS * n),
        refused_before()
    );
    // The rest of the load: `n` less an eighth more keys from here.
    limit.store(next.load(Ordering::SeqCst) + n - n / 8, Ordering::SeqCst);
    let old_primary = w.store.primary();
    // IDEMGATE_REDIS_HA_DEBUG: each proxy's idemgate_store host flags, polled until the fresh
    // keys are answered, printed at each change with the time from the run's start.
    let debug = std::env::var("IDEMGATE_REDIS_HA_DEBUG").is_ok();
    if debug {
        let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        println!("t {:.3} is unix {:.3}", t0.elapsed().as_secs_f64(), wall.as_secs_f64());
        for e in &w.proxies {
            for logger in ["upstream", "hc", "outlier"] {
                let _ = http::request(e.admin_port, "POST", &format!("/logging?{logger}=debug"), &[], b"");
            }
        }
    }
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let admins: Vec<u16> = w.proxies.iter().map(|e| e.admin_port).collect();
    let watcher = debug.then(|| {
        let watching = watching.clone();
        // Bounded by count (at least 60 s), should the run fail before it is told to stop.
        std::thread::spawn(move || {
            let mut last = vec![String::new(); admins.len()];
            for _ in 0..3_000 {
                if !watching.load(Ordering::SeqCst) {
                    break;
                }
                for (i, a) in admins.iter().enumerate() {
                    let r = crate::support::http::get(*a, "/clusters")
                        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
                        .unwrap_or_default();
                    let now: Vec<&str> =
                        r.lines().filter(|l| l.starts_with("idemgate_store::") && l.contains("health_flags")).collect();
                    let now = now.join(" ");
                    if now != last[i] {
                        println!("watch {:.3} proxy {i}: {now}", t0.elapsed().as_secs_f64());
                        last[i] = now;
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    });
    let mut whole_down_at = None;
    let mut alone_for = None;
    // The part dies between these two instants (`store_ha.py kill` returns once it is reaped).
    let fault_start = t0.elapsed();
    match fault {
        Fault::Primary => w.store.kill(&old_primary),
        Fault::Webdis => w.store.kill("webdis-0"),
        Fault::Haproxy => w.store.kill("haproxy-0"),
        Fault::Hop => w.store.kill("hop-0"),
        Fault::Partition => {
            let replicas: Vec<String> = (0..3).map(|i| format!("redis-{i}")).filter(|p| *p != old_primary).collect();
            for r in &replicas {
                signal(w.store.pid(r), "-STOP");
            }
            // Held until both proxies refuse (bounded by count): the primary acknowledges alone
            // until no replica has acknowledged within `min-replicas-max-lag`.
            let refused = (0..400).any(|a| {
                let ok =
                    ports.iter().all(|p| kind(&post(*p, &format!("{label}-probe-{a}"))) == "503 store-unavailable");
                ok || {
                    std::thread::sleep(Duration::from_millis(50));
                    false
                }
            });
            alone_for = Some((t0.elapsed() - fault_start).as_secs_f64());
            for r in &replicas {
                signal(w.store.pid(r), "-CONT");
            }
            assert!(refused, "the primary never refused writes with both replicas cut off");
            whole_down_at = Some(t0.elapsed());
        }
        Fault::WholeStore => {
            for i in 0..3 {
                w.store.kill(&format!("redis-{i}"));
            }
            whole_down_at = Some(t0.elapsed());
            // Down until both proxies refuse (bounded by count), then back.
            let refused = (0..200).any(|a| {
                let ok =
                    ports.iter().all(|p| kind(&post(*p, &format!("{label}-probe-{a}"))) == "503 store-unavailable");
                ok || {
                    std::thread::sleep(Duration::from_millis(50));
                    false
                }
            });
            assert!(refused, "the proxies never refused with the whole store down");
            let primary = old_primary.clone();
            w.store.start_part(&primary);
            for i in 0..3 {
                let part = format!("redis-{i}");
                if part != primary {
                    w.store.start_part(&part);
                }
            }
        }
    }
    let fault_at = whole_down_at.unwrap_or_else(|| t0.elapsed());
    for c in clients {
        c.join().expect("client");
    }
    let mut sent = std::mem::take(&mut *sent.lock().unwrap_or_else(|e| e.into_inner()));
    sent.sort_by_key(|s| s.i);
    let all: Vec<String> = sent.iter().map(|s| s.key.clone()).collect();
    let first_answers: BTreeMap<String, usize> = sent.iter().fold(BTreeMap::new(), |mut t, s| {
        *t.entry(s.kind.clone()).or_insert(0) += 1;
        t
    });
    for s in &sent {
        assert!(
            s.kind == "201" || s.kind == "503 store-unavailable",
            "{}: first attempt answered {} (every key is sent once, so only an execution or a refusal)",
            s.key,
            s.kind
        );
    }
    if std::env::var("IDEMGATE_REDIS_HA_DEBUG").is_ok() {
        println!("fault {:.3}..{:.3}", fault_start.as_secs_f64(), fault_at.as_secs_f64());
        for s in sent.iter().filter(|s| s.end >= fault_start) {
            println!("{} {:.3} {:.3} {}", s.key, s.start.as_secs_f64(), s.end.as_secs_f64(), s.kind);
        }
    }
    // Refusals that ended before the fault are the machine's (reported); the fault's are the rest.
    let (refused, refused_before): (Vec<&Sent>, Vec<&Sent>) =
        sent.iter().filter(|s| s.kind != "201").partition(|s| s.end >= fault_start);
    // Served again: the first request sent after the fault that executed.
    let back = sent.iter().filter(|s| s.kind == "201" && s.start >= fault_at).map(|s| s.end).min();
    let back_after = match back {
        Some(b) => b.saturating_sub(fault_at).as_secs_f64(),
        // Every request after the fault was refused: the load ran out first. The service must
        // still come back by itself: probe until it does (bounded by count).
        None => {
            let served = (0..UNAVAILABLE_ATTEMPTS).any(|a| {
                post(ports[a as usize % 2], &format!("{label}-after-{a}")).status == 201 || {
                    std::thread::sleep(Duration::from_millis(100));
                    false
                }
            });
            assert!(served, "the store never served again after {fault:?}");
            (t0.elapsed() - fault_at).as_secs_f64()
        }
    };
    let last_refusal_after = refused.iter().map(|s| s.end.saturating_sub(fault_at).as_secs_f64()).fold(0.0, f64::max);
    // Fresh first requests once the load has ended, each sent once (no retry): all should execute.
    // Where the fault takes leg 0 out (its webdis dead, or left without a Redis link), first until
    // both proxies' health checks have marked it (`/clusters`, bounded by count): from then on a
    // proxy must send it nothing. (Before `update_merge_window: 0s`, the worker threads learned
    // of the mark up to 1 s after `/clusters` showed it, and kept sending it store calls.)
    let leg_lost = matches!(fault, Fault::Webdis | Fault::Hop) || (matches!(fault, Fault::Haproxy) && !acl);
    if probes > 0 && leg_lost {
        let dead = format!("idemgate_store::127.0.0.1:{}::health_flags::", w.store.port("webdis-0"));
        let marked = |e: &Envoy| {
            http::get(e.admin_port, "/clusters").is_ok_and(|r| {
                String::from_utf8_lossy(&r.body).lines().any(|l| l.starts_with(&dead) && l.contains("failed_active_hc"))
            })
        };
        let both = (0..600).any(|_| {
            w.proxies.iter().all(marked) || {
                std::thread::sleep(Duration::from_millis(50));
                false
            }
        });
        assert!(both, "the proxies' health checks never took leg 0 out after {fault:?}");
    }
    let mut probe_answers = BTreeMap::new();
    for i in 0..probes {
        let r = post(ports[i % 2], &format!("{label}-fresh-{i}"));
        *probe_answers.entry(kind(&r)).or_insert(0) += 1;
    }
    let probes_at = (t0.elapsed() - fault_at).as_secs_f64();
    watching.store(false, Ordering::SeqCst);
    if let Some(watcher) = watcher {
        watcher.join().expect("watcher");
    }
    if debug {
        println!("fresh keys {probe_answers:?}, ending {probes_at:.3} s after the fault");
        for (i, e) in w.proxies.iter().enumerate() {
            for l in e.log().lines().filter(|l| {
                l.contains("store_unavailable")
                    || l.contains("membership update")
                    || l.contains("[hc]")
                    || l.contains("[outlier]")
            }) {
                println!("proxy {i} log: {l}");
            }
            for (n, v) in e
                .stats("cluster.idemgate_store.upstream_cx_none_healthy")
                .into_iter()
                .chain(e.stats("cluster.idemgate_store.upstream_rq_5"))
                .chain(e.stats("cluster_manager.update_"))
            {
                println!("proxy {i}: {n} {v}");
            }
        }
    }
    if std::env::var("IDEMGATE_REDIS_HA_DEBUG").is_ok() {
        for (i, e) in w.proxies.iter().enumerate() {
            let r = crate::support::http::get(e.admin_port, "/clusters")
                .map(|r| String::from_utf8_lossy(&r.body).into_owned())
                .unwrap_or_default();
            for l in r.lines().filter(|l| {
                l.starts_with("idemgate_store::")
                    && (l.contains("health_flags") || l.contains("rq_error") || l.contains("rq_success"))
            }) {
                println!("proxy {i}: {l}");
            }
            for (n, v) in e.stats("idemgate_store.health_check").into_iter().chain(e.stats("idemgate_store.outlier")) {
                println!("proxy {i}: {n} {v}");
            }
        }
        println!("webdis ports: {:?}", (0..2).map(|j| w.store.port(&format!("webdis-{j}"))).collect::<Vec<_>>());
    }
    // With the hop, what hop-0 sent to the other leg's HAProxy (its failover), before the retries
    // (nothing to read once hop-0 itself was killed).
    let hop0_to_other = if acl && !matches!(fault, Fault::Hop) {
        let other = w.store.peer_port("haproxy-1").unwrap_or_else(|| w.store.port("haproxy-1"));
        w.store.hop_requests("hop-0").get(&other).copied()
    } else {
        None
    };
    let hop0_tls_handshakes =
        (tls && acl && !matches!(fault, Fault::Hop)).then(|| w.store.hop_stat("hop-0", "cluster.redis.ssl.handshake"));

    // Every key retried on both proxies once the writes settled; 503s retried (bounded).
    w.wait_writes_settled();
    let primary_now = w.store.primary();
    let held = w.store.keys(&primary_now);
    if acl {
        // idemgate's connections are the named user's; no client is the (disabled) default user.
        let clients = w.store.cli(&primary_now, &["CLIENT", "LIST"]);
        assert!(clients.contains(" user=idemgate "), "no client as idemgate on {primary_now}:\n{clients}");
        // A connection that has sent no command yet (`cmd=NULL`: a HAProxy check caught between its
        // connect and its AUTH) is listed as default until it logs in; it ran nothing as default.
        let as_default = clients.lines().any(|l| l.contains(" user=default ") && !l.contains(" cmd=NULL "));
        assert!(!as_default, "a client as default on {primary_now}:\n{clients}");
    }
    let before = w.up.executions_by_key();
    let executed: BTreeSet<String> = all.iter().filter(|k| before.get(*k).copied().unwrap_or(0) > 0).cloned().collect();
    let missing: BTreeSet<String> = executed.iter().filter(|k| !held.contains(&redis_key_of(k))).cloned().collect();
    let mut retry_answers = BTreeMap::new();
    let mut in_flight = vec![];
    let mut answered: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let log = w.up.log();
    for (i, key) in all.iter().enumerate() {
        for p in [1 - i % 2, i % 2] {
            let r = post_past_unavailable(ports[p], key, UNAVAILABLE_ATTEMPTS);
            let k = kind(&r);
            let documented = match (r.status, r.problem().as_str()) {
                (201, "") => {
                    let n = r.json()["execution"].as_u64().unwrap_or(0);
                    log.iter().any(|x| x.n == n && x.key.as_deref() == Some(key.as_str()))
                        || w.up.log().iter().any(|x| x.n == n && x.key.as_deref() == Some(key.as_str()))
                }
                (409, "request-in-flight" | "outcome-unknown") => true,
                _ => false,
            };
            assert!(documented, "{key}: retry answered {k}: {}", r.body_text());
            if k == "409 request-in-flight" {
                in_flight.push(redis_key_of(key));
            }
            answered.entry(key.clone()).or_default().push(format!("proxy {p}: {k}"));
            *retry_answers.entry(k).or_insert(0) += 1;
        }
    }
    let after = w.up.executions_by_key();
    let thrice: Vec<_> = all.iter().filter(|k| after.get(*k).copied().unwrap_or(0) > 2).collect();
    assert!(thrice.is_empty(), "keys executed more than twice: {thrice:?}");
    let twice: BTreeSet<String> = all.iter().filter(|k| after.get(*k).copied().unwrap_or(0) == 2).cloned().collect();
    let unexplained: Vec<_> = twice.difference(&missing).collect();
    assert!(
        unexplained.is_empty(),
        "executed twice although the primary serving after {fault:?} held their claim: {unexplained:?}"
    );
    // Keys missing from the primary's keyspace (read once the writes settled) that no retry
    // executed again: what their retries answered, so a row that shows them says why.
    // Where the missing keys are, read again now on every node (the cause of the 4 keys once
    // missing from a TLS run's keyspace): which node the Sentinels name, and which nodes hold them.
    let whereabouts = if missing.is_empty() {
        String::new()
    } else {
        let now = w.store.primary();
        let holders: Vec<String> = (0..3)
            .map(|i| {
                let node = format!("redis-{i}");
                let out = w.store.cli_output(&node, &["--scan", "--pattern", "idemgate:v1:*"]);
                if !out.status.success() || out.stdout.is_empty() {
                    return format!("{node} does not answer");
                }
                let held: BTreeSet<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
                let n = missing.iter().filter(|k| held.contains(&redis_key_of(k))).count();
                format!("{node} holds {n} of them ({} keys)", held.len())
            })
            .collect();
        format!("read again: primary {now}; {}; first read {} keys", holders.join(", "), held.len())
    };
    let spared: Vec<String> = missing
        .difference(&twice)
        .map(|k| {
            format!("{k} (origin proxy {}): {:?}", all.iter().position(|x| x == k).unwrap_or(0) % 2, answered.get(k))
        })
        .collect();
    let stat = |name: &str| w.proxies.iter().map(|p| p.stat(name)).sum::<u64>();
    let counters = format!(
        "store_write_retries {}, store_write_failures {}, store_claim_gone_rewritten {}, store_script_loads {}",
        stat("idemgate.store_write_retries"),
        stat("idemgate.store_write_failures"),
        stat("idemgate.store_claim_gone_rewritten"),
        stat("idemgate.store_script_loads")
    );
    if std::env::var("IDEMGATE_REDIS_HA_DEBUG").is_ok() {
        for k in in_flight.iter().take(3) {
            let hex = k.trim_start_matches("idemgate:v1:");
            for (i, p) in w.proxies.iter().enumerate() {
                for line in p.log().lines().filter(|l| l.contains(hex)) {
                    println!("proxy {i}: {line}");
                }
            }
        }
    }
    let m = Measured {
        back_after,
        last_refusal_after,
        refused: refused.len(),
        refused_before: refused_before.len(),
        answers: first_answers,
        lost: missing.len(),
        twice: twice.len(),
        keys: n,
        probes: probe_answers,
        hop0_to_other,
        hop0_tls_handshakes,
    };
    let row = [
        format!(
            "{fault:?}{}{} ({label})",
            if tls { ", TLS to Redis" } else { "" },
            if acl { ", ACL user idemgate through a redis_proxy hop" } else { "" }
        ),
        format!("{} keys ({} refused before the fault), {CLIENTS} clients, two proxies", all.len(), m.refused_before),
        match alone_for {
            Some(a) => format!(
                "both proxies refused {a:.2} s after the cut; served again {:.2} s after it healed",
                m.back_after
            ),
            None => format!("served again {:.2} s after the fault", m.back_after),
        },
        format!("{} refused (503), the last ending {:.2} s after", m.refused, m.last_refusal_after),
        format!("{} lost (primary after: {primary_now}, before: {old_primary})", m.lost),
        format!("{} executed twice", m.twice),
        if probes == 0 {
            String::new()
        } else {
            format!(
                "{probes} fresh keys after the load (ending {probes_at:.2} s after the fault), sent once: {:?}",
                m.probes
            )
        },
        match m.hop0_to_other {
            Some(n) => format!(
                "hop-0 sent {n} requests to haproxy-1{}",
                m.hop0_tls_handshakes.map(|h| format!(" ({h} TLS handshakes)")).unwrap_or_default()
            ),
            None => String::new(),
        },
        format!("first attempts {:?}; retries {retry_answers:?}", m.answers),
        counters,
        if spared.is_empty() {
            String::new()
        } else {
            format!("missing but not executed again: {}; {whereabouts}", spared.join("; "))
        },
    ];
    println!("{}", row.join(" | "));
    fault_report("redis_ha.md", &row.iter().map(String::as_str).collect::<Vec<_>>());
    m
}

/// What `last_haproxy_stalled` saw.
pub struct Stalled {
    /// Commands the hops gave up on (their `op_timeout`) while the HAProxy was stopped.
    pub hop_timeouts: u64,
    /// The fresh keys sent once each after the HAProxy answered again, by answer.
    pub probes: BTreeMap<String, usize>,
    /// Keys (the stalled ones and the fresh ones) the upstream executed more than once.
    pub twice: Vec<String>,
}

/// The named-user path (`--tls --acl`) with haproxy-0 SIGKILLed, so both hops send to haproxy-1
/// alone; then haproxy-1 stalls (SIGSTOP, what a HAProxy starved of CPU does) while requests are
/// pending, until a hop gives up a command (its `op_timeout`, bounded by count), and goes on
/// (SIGCONT). Once it routes to the primary again (a `PING` through it, bounded by count),
/// `probes` fresh keys are sent once each, alternating proxies: a hop that took its last HAProxy
/// out for the stall refuses them although that HAProxy answers.
pub fn last_haproxy_stalled(probes: usize, label: &str) -> Stalled {
    let w = World::start_with(&["--tls", "--acl"]);
    let ports = w.ports();
    w.store.kill("haproxy-0");
    // Both proxies served through haproxy-1 alone (hop-0 failed over), bounded by count.
    for (p, port) in ports.into_iter().enumerate() {
        let r = post_past_unavailable(port, &format!("{label}-before-{p}"), UNAVAILABLE_ATTEMPTS);
        assert_eq!(r.status, 201, "proxy {p} never served with haproxy-0 dead: {}", r.body_text());
    }
    let timeouts =
        || ["hop-0", "hop-1"].iter().map(|h| w.store.hop_stat(h, "cluster.redis.upstream_rq_timeout")).sum::<u64>();
    let before = timeouts();
    let pid = w.store.pid("haproxy-1");
    signal(pid, "-STOP");
    let stalled: Vec<_> = (0..4)
        .map(|i| {
            let port = ports[i % 2];
            let key = format!("{label}-stalled-{i}");
            std::thread::spawn(move || (key.clone(), kind(&post(port, &key))))
        })
        .collect();
    let gave_up = (0..200).any(|_| {
        timeouts() > before || {
            std::thread::sleep(Duration::from_millis(50));
            false
        }
    });
    signal(pid, "-CONT");
    assert!(gave_up, "no hop gave up a command while haproxy-1 was stopped");
    let hop_timeouts = timeouts() - before;
    let mut keys = vec![];
    for t in stalled {
        let (key, a) = t.join().expect("a stalled request");
        assert!(a == "201" || a == "503 store-unavailable", "{key}: sent once, answered {a}");
        keys.push(key);
    }
    let routes = (0..100).any(|_| {
        w.store.haproxy_routes("haproxy-1") || {
            std::thread::sleep(Duration::from_millis(50));
            false
        }
    });
    assert!(routes, "haproxy-1 never routed to the primary again after SIGCONT");
    let mut answers = BTreeMap::new();
    for i in 0..probes {
        let key = format!("{label}-fresh-{i}");
        *answers.entry(kind(&post(ports[i % 2], &key))).or_insert(0) += 1;
        keys.push(key);
    }
    w.wait_writes_settled();
    let by_key = w.up.executions_by_key();
    let twice = keys.into_iter().filter(|k| by_key.get(k).copied().unwrap_or(0) > 1).collect();
    let m = Stalled { hop_timeouts, probes: answers, twice };
    let row = [
        format!(
            "haproxy-0 SIGKILLed, then haproxy-1 (the last) stalled once, TLS, ACL user through the hops ({label})"
        ),
        format!("{} commands given up by the hops during the stall", m.hop_timeouts),
        format!("{probes} fresh keys once haproxy-1 routed again, sent once: {:?}", m.probes),
        format!("{} executed twice", m.twice.len()),
    ];
    println!("{}", row.join(" | "));
    fault_report("redis_ha.md", &row.iter().map(String::as_str).collect::<Vec<_>>());
    m
}

/// `make test-redis-ha`: each fault, several runs (`IDEMGATE_REDIS_HA_RUNS`, default 3).
fn runs() -> usize {
    std::env::var("IDEMGATE_REDIS_HA_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(3)
}

#[test]
fn failover_full_redis_ha_primary_killed() {
    for r in 0..runs() {
        run(Fault::Primary, 400, &format!("full-primary-{r}"));
    }
}

/// The same on the TLS stack: Redis serves TLS only, HAProxy originates TLS and verifies Redis's
/// certificate, replication and Sentinel over TLS.
#[test]
fn failover_full_redis_ha_primary_killed_with_tls_to_redis() {
    for r in 0..runs() {
        run_on(true, Fault::Primary, 400, &format!("full-primary-tls-{r}"));
    }
}

/// The same as the named ACL user `idemgate` through a redis_proxy hop per leg, TLS to Redis.
#[test]
fn failover_full_redis_ha_primary_killed_named_acl_user_over_tls() {
    for r in 0..runs() {
        run_with(&["--tls", "--acl"], Fault::Primary, 400, &format!("full-primary-acl-{r}"));
    }
}

#[test]
fn failover_full_redis_ha_one_webdis_killed() {
    for r in 0..runs() {
        run(Fault::Webdis, 400, &format!("full-webdis-{r}"));
    }
}

#[test]
fn failover_full_redis_ha_one_haproxy_killed() {
    for r in 0..runs() {
        run(Fault::Haproxy, 400, &format!("full-haproxy-{r}"));
    }
}

#[test]
fn failover_full_redis_ha_primary_partitioned_from_its_replicas() {
    for r in 0..runs() {
        run(Fault::Partition, 400, &format!("full-partition-{r}"));
    }
}

#[test]
fn failover_full_redis_ha_whole_store_down_and_back() {
    for r in 0..runs() {
        run(Fault::WholeStore, 400, &format!("full-whole-{r}"));
    }
}

/// Completions outlive a failover: `n` requests claimed and executing (the upstream holds each
/// for 1.5 s) when the primary is SIGKILLed; their completions are written after it died, so they
/// land only if the write retry window (`store::retry_delay_ms`, about 6.2 s of backoff) covers
/// the failover. Each key is then retried on the proxy that never saw it: a replay means its
/// completion reached the new primary. Returns how many did.
pub fn completions_outlive_failover(n: usize, label: &str) -> usize {
    let w = World::start(false);
    let ports = w.ports();
    let all: Vec<String> = (0..n).map(|i| format!("{label}-{i}")).collect();
    let old_primary = w.store.primary();
    let before = w.up.executions();
    let clients: Vec<_> = all
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let key = key.clone();
            std::thread::spawn(move || post_held(ports[i % 2], &key, "1500"))
        })
        .collect();
    let executing = (0..3_000).any(|_| {
        w.up.executions() >= before + n as u64 || {
            std::thread::sleep(Duration::from_millis(1));
            false
        }
    });
    assert!(executing, "the requests never all reached the upstream: {}", w.up.executions() - before);
    let t = Instant::now();
    w.store.kill(&old_primary);
    let first: Vec<Response> = clients.into_iter().map(|c| c.join().expect("client")).collect();
    for (key, r) in all.iter().zip(&first) {
        assert_eq!(r.status, 201, "{key}: the upstream's answer is forwarded whatever the store: {}", r.body_text());
    }
    w.wait_writes_settled();
    let settled = t.elapsed().as_secs_f64();
    let mut replayed = 0;
    let mut answers = BTreeMap::new();
    for (i, key) in all.iter().enumerate() {
        let r = post_past_unavailable(ports[1 - i % 2], key, UNAVAILABLE_ATTEMPTS);
        let k = kind(&r);
        assert!(
            k == "201 replayed" || k == "409 request-in-flight" || k == "409 outcome-unknown",
            "{key}: a retry of a key executed before the failover answered {k}: {}",
            r.body_text()
        );
        replayed += usize::from(k == "201 replayed");
        *answers.entry(k).or_insert(0) += 1;
    }
    let by_key = w.up.executions_by_key();
    let twice: Vec<_> = all.iter().filter(|k| by_key.get(*k).copied().unwrap_or(0) > 1).collect();
    assert!(twice.is_empty(), "executed twice: {twice:?}");
    let stat = |name: &str| w.proxies.iter().map(|p| p.stat(name)).sum::<u64>();
    let row = [
        format!("completions of requests executing at the primary's SIGKILL ({label})"),
        format!("{n} keys held 1.5 s by the upstream"),
        format!("{replayed} of {n} completions landed on the new primary (retries replayed)"),
        format!("writes settled {settled:.2} s after the kill"),
        format!(
            "retries {answers:?}; store_write_retries {}, store_write_failures {}, store_claim_gone_rewritten {}",
            stat("idemgate.store_write_retries"),
            stat("idemgate.store_write_failures"),
            stat("idemgate.store_claim_gone_rewritten")
        ),
    ];
    println!("{}", row.join(" | "));
    fault_report("redis_ha.md", &row.iter().map(String::as_str).collect::<Vec<_>>());
    replayed
}

#[test]
fn failover_full_redis_ha_completions_outlive_the_failover() {
    for r in 0..runs() {
        let n = 40;
        let landed = completions_outlive_failover(n, &format!("full-completions-{r}"));
        // The write retry window (about 6.2 s) is longer than the failover the shipped
        // sentinel.conf gives (down-after-milliseconds 1000: measured about 2 s), so every
        // completion lands.
        assert_eq!(landed, n, "completions lost in the failover");
    }
}

/// What the HA path costs beside one Redis behind one webdis, measured in the same test (60 keys,
/// one client, loopback; `appendfsync always` on every node): a first request, and a replay on the
/// proxy that has no local copy (one store read). Written to target/faults/redis_ha.md.
#[test]
fn failover_full_redis_ha_latency_beside_single_redis() {
    use support::store::{Redis, Webdis};
    fn measure(a: u16, b: u16, prefix: &str, writes_settled: impl Fn()) -> (Vec<f64>, Vec<f64>) {
        let (mut first, mut replay) = (vec![], vec![]);
        for i in 0..60 {
            let t = Instant::now();
            assert_eq!(post_held(a, &format!("{prefix}-{i}"), "0").status, 201);
            first.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        writes_settled();
        for i in 0..60 {
            let t = Instant::now();
            let r = post_held(b, &format!("{prefix}-{i}"), "0");
            assert_eq!(r.header("idempotent-replayed"), Some("true"), "{prefix}-{i}: {}", r.body_text());
            replay.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        (first, replay)
    }
    fn pct(v: &mut [f64], q: f64) -> f64 {
        v.sort_by(|x, y| x.partial_cmp(y).unwrap_or(std::cmp::Ordering::Equal));
        v[((v.len() as f64 - 1.0) * q).round() as usize]
    }
    let w = World::start(false);
    let [a, b] = w.ports();
    let (mut hf, mut hr) = measure(a, b, "cost-ha", || w.wait_writes_settled());
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(PLUGIN, up.port);
    o.store_port = Some(webdis.port);
    let (ra, rb) = (Envoy::start(&o), Envoy::start(&o));
    let settled = || support::wait_writes_settled(&[&ra], WRITE_POLLS);
    let (mut sf, mut sr) = measure(ra.port, rb.port, "cost-single", settled);
    assert_eq!(up.executions(), 60);
    let row = [
        "latency, 60 keys, one client".to_string(),
        format!(
            "first request: HA median {:.2} ms p95 {:.2} ms, single Redis median {:.2} ms p95 {:.2} ms",
            pct(&mut hf, 0.5),
            pct(&mut hf, 0.95),
            pct(&mut sf, 0.5),
            pct(&mut sf, 0.95)
        ),
        format!(
            "replay after a local miss: HA median {:.2} ms p95 {:.2} ms, single Redis median {:.2} ms p95 {:.2} ms",
            pct(&mut hr, 0.5),
            pct(&mut hr, 0.95),
            pct(&mut sr, 0.5),
            pct(&mut sr, 0.95)
        ),
    ];
    println!("{}", row.join(" | "));
    fault_report("redis_ha.md", &row.iter().map(String::as_str).collect::<Vec<_>>());
}

/// What the shipped `min-replicas-to-write 1` costs (issue 42 item 2): on one HA store, rounds
/// alternating the setting (1, then 0 on every node): first requests one at a time (60 keys,
/// median and p95) and a burst of 120 keys from 6 clients (requests per second). Written to
/// target/faults/redis_ha.md.
#[test]
fn failover_full_redis_ha_min_replicas_to_write_cost() {
    fn pct(v: &mut [f64], q: f64) -> f64 {
        v.sort_by(|x, y| x.partial_cmp(y).unwrap_or(std::cmp::Ordering::Equal));
        v[((v.len() as f64 - 1.0) * q).round() as usize]
    }
    let w = World::start(false);
    let [a, b] = w.ports();
    let mut cells = vec![];
    for round in 0..3 {
        for n in ["1", "0"] {
            w.store.set_min_replicas(n);
            let prefix = format!("mrw-{round}-{n}");
            let mut first = vec![];
            for i in 0..60 {
                let t = Instant::now();
                assert_eq!(post_held(a, &format!("{prefix}-seq-{i}"), "0").status, 201);
                first.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            let next = Arc::new(AtomicUsize::new(0));
            let t = Instant::now();
            let clients: Vec<_> = (0..CLIENTS)
                .map(|_| {
                    let (next, prefix) = (next.clone(), prefix.clone());
                    std::thread::spawn(move || loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        if i >= 120 {
                            return;
                        }
                        let r = post_held([a, b][i % 2], &format!("{prefix}-burst-{i}"), "0");
                        assert_eq!(r.status, 201, "{}", r.body_text());
                    })
                })
                .collect();
            for c in clients {
                c.join().expect("client");
            }
            let rps = 120.0 / t.elapsed().as_secs_f64();
            cells.push(format!(
                "round {round} min-replicas-to-write {n}: median {:.2} ms p95 {:.2} ms, {rps:.0} req/s",
                pct(&mut first, 0.5),
                pct(&mut first, 0.95)
            ));
        }
    }
    w.store.set_min_replicas("1");
    let row =
        ["min-replicas-to-write cost, 60 sequential + 120 from 6 clients per round".to_string(), cells.join("; ")];
    println!("{}", row.join(" | "));
    fault_report("redis_ha.md", &row.iter().map(String::as_str).collect::<Vec<_>>());
}

/// What `primary_back_alone` saw.
pub struct BackAlone {
    /// First attempts sent while the former primary ran alone, by answer.
    pub alone: BTreeMap<String, usize>,
    /// Keys executed more than once.
    pub twice: Vec<String>,
    /// The node the Sentinels promoted.
    pub promoted: String,
    /// Seconds from the former primary's second SIGKILL until a retry was served.
    pub back_after: f64,
}

/// The whole store down and back, in the order that lost 43 acknowledged claims in one run of
/// `failover_full_redis_ha_whole_store_down_and_back`, made deterministic: every node SIGKILLed;
/// the former primary started again alone (the Sentinels still name it, so it comes back as
/// primary, from its AOF) and `k` keys sent while its replicas are still down, each once; then it
/// dies again before any replica synced from it, the two others come back (as replicas of the
/// primary the Sentinels name), the Sentinels promote one, and every key is retried on both
/// proxies. Whatever the former primary acknowledged alone, the promoted node never received: a
/// claim it acknowledged is a key executed twice. Executions are counted per key.
pub fn primary_back_alone(k: usize, label: &str) -> BackAlone {
    let w = World::start(false);
    let ports = w.ports();
    let old = w.store.primary();
    for i in 0..3 {
        w.store.kill(&format!("redis-{i}"));
    }
    let refused = (0..200).any(|a| {
        ports.iter().all(|p| kind(&post(*p, &format!("{label}-probe-{a}"))) == "503 store-unavailable") || {
            std::thread::sleep(Duration::from_millis(50));
            false
        }
    });
    assert!(refused, "the proxies never refused with the whole store down");
    // A failover the Sentinels started as every node died (it may have selected a replica that
    // died in the same instant) would make `store_ha.py start` bring the former primary back as
    // that replica's replica, not alone: let it end first (its promotion never comes, so it
    // aborts after failover-timeout), so the former primary comes back as primary.
    store_ha(&w.store.scratch.0, &["judged"]);
    w.store.start_part(&old);
    assert!(w.store.replication(&old).contains("role:master"), "{old} did not come back as primary");
    // The store reachable again through both legs: Envoy's check (GET /PING through webdis and
    // HAProxy to the node saying role:master) passes on both proxies (bounded by count).
    let healthy = |p: &Envoy| p.stats("cluster.idemgate_store.membership_healthy").iter().any(|(_, v)| *v >= 1);
    let reachable = (0..300).any(|_| {
        w.proxies.iter().all(healthy) || {
            std::thread::sleep(Duration::from_millis(100));
            false
        }
    });
    assert!(reachable, "the store never answered Envoy's health check with {old} back");
    let keys: Vec<String> = (0..k).map(|i| format!("{label}-{i}")).collect();
    let mut alone = BTreeMap::new();
    for (i, key) in keys.iter().enumerate() {
        let a = kind(&post(ports[i % 2], key));
        assert!(a == "201" || a == "503 store-unavailable", "{key}: sent once, answered {a}");
        *alone.entry(a).or_insert(0) += 1;
    }
    w.wait_writes_settled();
    let held_alone = w.store.keys(&old).len();
    // Dies again before a replica synced from it; the others come back as replicas.
    w.store.kill(&old);
    let killed = Instant::now();
    for i in 0..3 {
        let part = format!("redis-{i}");
        if part != old {
            w.store.start_part(&part);
        }
    }
    let mut promoted = String::new();
    let done = (0..900).any(|_| {
        promoted = w.store.primary();
        (promoted != old && promoted != "none" && w.store.replication(&promoted).contains("role:master")) || {
            std::thread::sleep(Duration::from_millis(100));
            false
        }
    });
    assert!(done, "the Sentinels never promoted a replica after {old} died again (they name {promoted})");
    let mut back_after = None;
    let mut retries = BTreeMap::new();
    for (i, key) in keys.iter().enumerate() {
        for p in [1 - i % 2, i % 2] {
            let r = post_past_unavailable(ports[p], key, UNAVAILABLE_ATTEMPTS * 3);
            back_after.get_or_insert_with(|| killed.elapsed().as_secs_f64());
            let a = kind(&r);
            assert!(
                matches!(a.as_str(), "201" | "201 replayed" | "409 request-in-flight" | "409 outcome-unknown"),
                "{key}: retry on proxy {p} answered {a}: {}",
                r.body_text()
            );
            *retries.entry(a).or_insert(0) += 1;
        }
    }
    let by_key = w.up.executions_by_key();
    let twice: Vec<String> = keys.iter().filter(|k| by_key.get(*k).copied().unwrap_or(0) > 1).cloned().collect();
    let m = BackAlone { alone, twice, promoted, back_after: back_after.unwrap_or(0.0) };
    let row = [
        format!("whole store down, former primary back alone then killed again ({label})"),
        format!("{k} keys sent once while {old} ran alone: {:?}; {held_alone} idemgate keys on it", m.alone),
        format!("{} promoted; retries served {:.2} s after the second kill", m.promoted, m.back_after),
        format!("retries {retries:?}"),
        format!("{} executed twice", m.twice.len()),
    ];
    println!("{}", row.join(" | "));
    fault_report("redis_ha.md", &row.iter().map(String::as_str).collect::<Vec<_>>());
    m
}

/// The operator webdis's HTTP credential (`scripts/store_ha.py --operator`).
const OPERATOR_STORE_AUTH: &str = "operator:idemgate-demo-operator-webdis-password";

/// The operator CLI (`idemgate --webdis`) against each leg of the HA stack started with
/// `options`: keys written through the two proxies are listed completed by the CLI on either
/// leg, `inspect` reads one, `forget` removes one (its retry, on the proxy that never held it,
/// executes once more), and with one leg's webdis SIGKILLed the CLI on the other leg still lists,
/// inspects and forgets. With the named-user hop (`--acl --operator`), the CLI uses the
/// operator's own webdis and hop (user `idemgate-operator`, `opswebdis-N`), and `list` through
/// the proxies' webdis is refused by Redis: the user `idemgate` has no `SCAN` (least privilege,
/// envoy/redis-acl/redis-acl.conf). Bounded by count; asserted on the keys listed and the
/// upstream's executions.
fn operator_cli_on_each_leg(options: &[&str]) {
    use support::operator::{text, OperatorCli};
    let hop = options.contains(&"--acl");
    let w = World::start_with(options);
    let ports = w.ports();
    let keys: Vec<String> = (0..6).map(|i| format!("cli-hop-{i}")).collect();
    for (i, key) in keys.iter().enumerate() {
        let r = post(ports[i % 2], key);
        assert_eq!(r.status, 201, "{key}: {}", r.body_text());
    }
    w.wait_writes_settled();
    let execs = |key: &str| w.up.executions_by_key().get(key).copied().unwrap_or(0);
    for key in &keys {
        assert_eq!(execs(key), 1, "{key}");
    }
    // The CLI's webdis on each leg: the proxies' own, or through the hop the operator's.
    let webdis = |leg: usize| if hop { format!("opswebdis-{leg}") } else { format!("webdis-{leg}") };
    let cli = |leg: usize| {
        let url = format!("http://127.0.0.1:{}", w.store.port(&webdis(leg)));
        OperatorCli::webdis(&url, Some(if hop { OPERATOR_STORE_AUTH } else { STORE_AUTH }))
    };
    let legs = [cli(0), cli(1)];
    let skeys: Vec<String> = keys.iter().map(|k| legs[0].storage_key(CALLER, k)).collect();
    if hop {
        // The proxies' webdis and hop (user idemgate): the listing refused by Redis, and the CLI
        // says so.
        for leg in 0..2 {
            let url = format!("http://127.0.0.1:{}", w.store.port(&format!("webdis-{leg}")));
            let out = OperatorCli::webdis(&url, Some(STORE_AUTH)).run(&["list", "--state", "completed"]);
            let stderr = text(&out.stderr);
            assert!(!out.status.success(), "leg {leg}: list as idemgate succeeded: {}", text(&out.stdout));
            assert!(
                stderr.contains("Redis refused the SCAN script") && stderr.contains("can't run this command"),
                "leg {leg}: {stderr}"
            );
        }
    }
    let completed = |leg: usize| -> BTreeSet<String> { legs[leg].listed("completed").into_iter().collect() };
    for (leg, c) in legs.iter().enumerate() {
        for skey in &skeys {
            c.wait_listed("completed", skey, || format!("leg {leg}"));
        }
        let listed = completed(leg);
        assert!(skeys.iter().all(|s| listed.contains(s)), "leg {leg} listed {listed:?}, not all of {skeys:?}");
        let doc = c.inspect(&skeys[leg]);
        assert_eq!(doc["state"], "completed", "leg {leg}: {doc}");
    }
    // `forget` on leg 0 of key 0 (sent through proxy 0): its retry through proxy 1, which never
    // held it, executes once more.
    let out = legs[0].run(&["forget", &skeys[0]]);
    assert!(out.status.success(), "forget on leg 0: {}", text(&out.stderr));
    assert_eq!(text(&legs[1].run(&["inspect", &skeys[0]]).stdout).trim(), "absent");
    assert!(!completed(1).contains(&skeys[0]));
    let r = post(ports[1], &keys[0]);
    assert_eq!((r.status, r.header("idempotent-replayed")), (201, None), "{}", r.body_text());
    assert_eq!(execs(&keys[0]), 2, "the forgotten key executed once more");
    // Settling (`resolve`) on each leg; `later` is outcome-unknown, left for leg 1 alone.
    let later = settle_on_each_leg(&w, &legs, &skeys[1]);
    // Leg 0's webdis (the CLI's) gone: the CLI on leg 1 still lists, inspects and forgets.
    w.store.kill(&webdis(0));
    settle_on_the_other_leg(&w, &legs, &later);
    assert!(!legs[0].run(&["inspect", &skeys[1]]).status.success(), "{} answered after its SIGKILL", webdis(0));
    let listed = completed(1);
    assert!(skeys[1..].iter().all(|s| listed.contains(s)), "leg 1 alone listed {listed:?}");
    assert_eq!(legs[1].inspect(&skeys[2])["state"], "completed");
    let out = legs[1].run(&["forget", &skeys[2]]);
    assert!(out.status.success(), "forget on leg 1 alone: {}", text(&out.stderr));
    assert_eq!(text(&legs[1].run(&["inspect", &skeys[2]]).stdout).trim(), "absent");
    assert!(!completed(1).contains(&skeys[2]));
    // Key 2 went through proxy 0: its retry through proxy 1 executes once more (proxy 1 may
    // still send to the dead webdis-0 until its health check takes it out).
    let r = post_past_unavailable(ports[1], &keys[2], UNAVAILABLE_ATTEMPTS);
    assert_eq!((r.status, r.header("idempotent-replayed")), (201, None), "{}", r.body_text());
    assert_eq!(execs(&keys[2]), 2, "the forgotten key executed once more");
    for key in keys.iter().filter(|k| *k != &keys[0] && *k != &keys[2]) {
        assert_eq!(execs(key), 1, "{key}");
    }
}

/// A key the upstream executed whose answer was lost (it reset the connection after running it),
/// sent through proxy `p`: marked outcome-unknown in the store (listed so on leg 0), the other
/// proxy's retry refused 409 `outcome-unknown`, executed once. Its storage key.
fn outcome_unknown(w: &World, cli: &support::operator::OperatorCli, p: usize, key: &str) -> String {
    let r = post_with(w.ports()[p], key, &[("x-up-reset", "before-headers")]);
    assert!(r.status >= 500, "{key}: {} {}", r.status, r.body_text());
    let skey = cli.storage_key(CALLER, key);
    cli.wait_listed("outcome-unknown", &skey, || format!("{key} through proxy {p}"));
    let again = post(w.ports()[1 - p], key);
    assert_eq!((again.status, kind(&again).as_str()), (409, "409 outcome-unknown"), "{}", again.body_text());
    assert_eq!(w.up.executions_with_key(key), 1, "{key}");
    skey
}

/// `idemgate resolve` on each leg of the HA stack (`legs`: the CLI on leg 0 and on leg 1):
/// - leg 0 completes an outcome-unknown key (sent through proxy 0): both proxies replay the
///   operator's answer, the upstream never runs it again;
/// - leg 1 releases an outcome-unknown key (sent through proxy 1): the retry on proxy 0 executes
///   once more and is replayed by both proxies after (proxy 1, which marked the key, answers 409
///   until the new completion is in the store: docs/operating.md);
/// - a completed key (`completed`) and a key in flight (its answer held by the upstream) are
///   refused on both legs, exit 1, with the reason the CLI documents, and left as they were.
///
/// Returns the storage key of one more outcome-unknown key (sent through proxy 0), for
/// `settle_on_the_other_leg`.
fn settle_on_each_leg(w: &World, legs: &[support::operator::OperatorCli; 2], completed: &str) -> String {
    use support::operator::text;
    let ports = w.ports();
    let execs = |key: &str| w.up.executions_with_key(key);
    let found = outcome_unknown(w, &legs[0], 0, "cli-found");
    let released = outcome_unknown(w, &legs[0], 1, "cli-released");
    let later = outcome_unknown(w, &legs[0], 0, "cli-later");
    for (leg, c) in legs.iter().enumerate() {
        assert_eq!(c.inspect(&found)["state"], "outcome-unknown", "leg {leg}");
    }
    // Leg 0 completes `cli-found` with the answer the operator found upstream.
    let scratch = Scratch::new("redis-ha-resolve");
    let body = scratch.0.join("found.json");
    std::fs::write(&body, br#"{"id":"ch_found_upstream"}"#).expect("write the body");
    let body = body.to_str().expect("a UTF-8 path");
    let out = legs[0].run(&[
        "resolve",
        &found,
        "--complete",
        "--status",
        "201",
        "--body-file",
        body,
        "--header",
        "content-type: application/json",
    ]);
    assert!(out.status.success(), "resolve --complete on leg 0: {}", text(&out.stderr));
    let rec = legs[1].inspect(&found);
    assert_eq!((rec["state"].as_str(), rec["status"].as_u64()), (Some("completed"), Some(201)), "leg 1: {rec}");
    for port in [ports[0], ports[1], ports[0]] {
        let r = post(port, "cli-found");
        assert_eq!((kind(&r).as_str(), r.body_text().as_str()), ("201 replayed", r#"{"id":"ch_found_upstream"}"#));
    }
    assert_eq!(execs("cli-found"), 1, "the operator's completion is replayed, never executed again");
    // Leg 1 releases `cli-released`: the retry on proxy 0 (which never marked it) executes.
    let out = legs[1].run(&["resolve", &released, "--release"]);
    assert!(out.status.success(), "resolve --release on leg 1: {}", text(&out.stderr));
    assert_eq!(text(&legs[0].run(&["inspect", &released]).stdout).trim(), "absent");
    let r = post(ports[0], "cli-released");
    assert_eq!(kind(&r), "201", "{}", r.body_text());
    assert_eq!(execs("cli-released"), 2, "the released key executes once more, on the retry");
    legs[1].wait_listed("completed", &released, || "cli-released's new completion".into());
    for port in [ports[1], ports[0]] {
        assert_eq!(kind(&post(port, "cli-released")), "201 replayed");
    }
    assert_eq!(execs("cli-released"), 2);
    // Refused on both legs: a completed key, a key in flight.
    for (leg, c) in legs.iter().enumerate() {
        let out = c.run(&["resolve", completed, "--release"]);
        assert_eq!(out.status.code(), Some(1), "leg {leg}: released a completed key: {}", text(&out.stdout));
        assert!(text(&out.stderr).contains("refused: the key is completed"), "leg {leg}: {}", text(&out.stderr));
        assert_eq!(c.inspect(completed)["state"], "completed", "leg {leg}");
    }
    let port = ports[0];
    let held = std::thread::spawn(move || post_with(port, "cli-busy", &[("x-up-hold", "1")]));
    let busy = legs[1].storage_key(CALLER, "cli-busy");
    legs[1].wait_listed("in-flight", &busy, || "cli-busy held by the upstream".into());
    for (leg, c) in legs.iter().enumerate() {
        for args in [&["resolve", &busy, "--release"][..], &["resolve", &busy, "--complete", "--status", "200"]] {
            let out = c.run(args);
            assert_eq!(out.status.code(), Some(1), "leg {leg} {args:?}: {}", text(&out.stdout));
            assert!(
                text(&out.stderr).contains("refused: the key is in flight"),
                "leg {leg} {args:?}: {}",
                text(&out.stderr)
            );
        }
        assert_eq!(c.inspect(&busy)["state"], "in-flight", "leg {leg}");
    }
    w.up.release_holds();
    assert_eq!(kind(&held.join().expect("the held request")), "201");
    legs[0].wait_listed("completed", &busy, || "cli-busy's completion".into());
    assert_eq!(kind(&post(ports[1], "cli-busy")), "201 replayed");
    assert_eq!(execs("cli-busy"), 1);
    later
}

/// With leg 0's CLI webdis SIGKILLed: the CLI there fails, leg 1 releases outcome-unknown `later`
/// (sent through proxy 0), and the retry on proxy 1 executes it once more.
fn settle_on_the_other_leg(w: &World, legs: &[support::operator::OperatorCli; 2], later: &str) {
    use support::operator::text;
    let out = legs[0].run(&["resolve", later, "--release"]);
    assert!(!out.status.success(), "resolve on leg 0 after its webdis's SIGKILL: {}", text(&out.stdout));
    assert_eq!(legs[1].inspect(later)["state"], "outcome-unknown");
    let out = legs[1].run(&["resolve", later, "--release"]);
    assert!(out.status.success(), "resolve --release on leg 1 alone: {}", text(&out.stderr));
    assert_eq!(text(&legs[1].run(&["inspect", later]).stdout).trim(), "absent");
    let r = post_past_unavailable(w.ports()[1], "cli-later", UNAVAILABLE_ATTEMPTS);
    assert_eq!(kind(&r), "201", "{}", r.body_text());
    assert_eq!(w.up.executions_with_key("cli-later"), 2, "the released key executes once more, on the retry");
}

#[test]
fn redis_ha_operator_cli_on_each_leg() {
    operator_cli_on_each_leg(&[]);
}

/// The same with the named-user hop over TLS (`--tls --acl --operator`): the CLI through the
/// operator's own webdis and hop (user `idemgate-operator`); refused `list` through the proxies'.
#[test]
fn redis_ha_operator_cli_on_each_leg_through_the_named_user_hop() {
    operator_cli_on_each_leg(&["--tls", "--acl", "--operator"]);
}
