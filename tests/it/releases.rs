//! Issue 43: releases and their compatibility contract (docs/operating.md, "Upgrades and mixed
//! fleets"). Each release reads every record the previous release wrote, in the store and in the
//! local tier, and the previous release reads what the new one writes (or refuses it safely).
//!
//! - `RELEASES` (the repository's list of releases and their commits), CHANGELOG.md, Cargo.toml's
//!   version and the shipped OCI tags agree (`the_releases_file_the_changelog_and_the_version_agree`).
//! - The mixed fleet: the previous release is built from its recorded commit (a git worktree in a
//!   temporary folder, its module built by that commit's own scripts/build-wasm.sh, cached under
//!   target/releases/), and an Envoy running it and an Envoy running this build share one store
//!   (Redis behind webdis, and etcd) under traffic, every key's retries crossing versions both
//!   ways: each key executes once, retries get 409 while it runs and its replay once it is done,
//!   never 503 `record-unreadable`. `mixed_fleet_*` are the short forms (`make test`);
//!   `mixed_fleet_full_*` run 1,000 keys in rounds of 100 (`make test-mixed-fleet`,
//!   IDEMGATE_MIXED_FLEET_KEYS).
//! - The local tier: a hot reload from the previous release's module to this one with records in
//!   shared data, a claim in flight, and a request on a connection the old listener still serves.

use crate::support;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use support::etcd::EtcdCluster;
use support::http::{self, Response};
use support::store::{Redis, Webdis};
use support::upstream::Upstream;
use support::{repo_root, Envoy, EnvoyOptions};

/// This build's version (Cargo.toml's).
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// A semantic version, ordered as semver orders them (a pre-release before its release).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Version {
    major: u64,
    minor: u64,
    patch: u64,
    /// false for a pre-release (`0.2.0-dev`), which comes before its release.
    released: bool,
    pre: String,
}

impl Version {
    fn parse(text: &str) -> Version {
        let (core, pre) = text.split_once('-').map_or((text, ""), |(c, p)| (c, p));
        let n: Vec<u64> = core.split('.').map(|p| p.parse().unwrap_or_else(|_| panic!("version {text}"))).collect();
        assert_eq!(n.len(), 3, "version {text}: major.minor.patch");
        Version { major: n[0], minor: n[1], patch: n[2], released: pre.is_empty(), pre: pre.to_string() }
    }
}

#[derive(Clone, Debug)]
struct Release {
    version: String,
    commit: String,
}

/// The releases recorded in RELEASES (version, full commit hash, date), oldest first.
fn releases() -> Vec<Release> {
    let text = std::fs::read_to_string(repo_root().join("RELEASES")).expect("RELEASES");
    let mut out = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 3, "RELEASES line {line:?}: version, commit, date");
        assert!(
            f[1].len() == 40 && f[1].bytes().all(|b| b.is_ascii_hexdigit()),
            "RELEASES line {line:?}: a full commit hash"
        );
        out.push(Release { version: f[0].to_string(), commit: f[1].to_string() });
    }
    out
}

/// The newest recorded release older than this build: the one this build must interoperate with.
fn previous_release() -> Release {
    let me = Version::parse(VERSION);
    releases()
        .into_iter()
        .filter(|r| Version::parse(&r.version) < me)
        .max_by_key(|r| Version::parse(&r.version))
        .unwrap_or_else(|| panic!("RELEASES records no release older than {VERSION}"))
}

fn git(args: &[&str]) -> std::process::Output {
    Command::new("git").arg("-C").arg(repo_root()).args(args).output().expect("run git")
}

/// A git worktree in a temporary folder, removed (with its folder) when dropped.
struct Worktree(PathBuf);

impl Drop for Worktree {
    fn drop(&mut self) {
        let _ = git(&["worktree", "remove", "--force", &self.0.join("src").to_string_lossy()]);
        let _ = std::fs::remove_dir_all(&self.0);
        let _ = git(&["worktree", "prune"]);
    }
}

/// The module of release `r`, built from its recorded commit with that commit's own
/// scripts/build-wasm.sh, cached in target/releases/<version>-<commit>/ (reruns do not build).
fn release_module(r: &Release) -> PathBuf {
    static BUILDING: Mutex<()> = Mutex::new(());
    let _one = BUILDING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = repo_root().join("target/releases").join(format!("{}-{}", r.version, &r.commit[..12]));
    let out = dir.join("idemgate.wasm");
    if out.exists() {
        return out;
    }
    let has = git(&["cat-file", "-e", &format!("{}^{{commit}}", r.commit)]);
    assert!(
        has.status.success(),
        "release {} (commit {}) is not in this clone's history: a shallow clone? (git fetch --unshallow)",
        r.version,
        r.commit
    );
    let tmp = std::env::temp_dir().join(format!("idemgate-release-{}-{}", r.version, std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).expect("temporary folder");
    let wt = Worktree(tmp);
    let src = wt.0.join("src");
    let added = git(&["worktree", "add", "--detach", &src.to_string_lossy(), &r.commit]);
    assert!(added.status.success(), "git worktree add {}: {}", r.commit, String::from_utf8_lossy(&added.stderr));
    let t0 = std::time::Instant::now();
    let built = Command::new(src.join("scripts/build-wasm.sh"))
        .current_dir(&src)
        .env_remove("CARGO_TARGET_DIR")
        .output()
        .expect("run the release's scripts/build-wasm.sh");
    assert!(
        built.status.success(),
        "building release {} with its own scripts/build-wasm.sh: {}",
        r.version,
        String::from_utf8_lossy(&built.stderr)
    );
    eprintln!("built release {} ({}) in {} s", r.version, &r.commit[..12], t0.elapsed().as_secs());
    std::fs::create_dir_all(&dir).expect("target/releases");
    let part = dir.join("idemgate.wasm.part");
    std::fs::copy(src.join("dist/idemgate.wasm"), &part).expect("copy the release's module");
    std::fs::rename(&part, &out).expect("cache the release's module");
    std::fs::write(dir.join("commit"), format!("{}\n", r.commit)).expect("write the commit beside it");
    out
}

const TOKEN: &str = "Bearer alice-secret-token";

fn post(e: &Envoy, key: &str, extra: &[(&str, &str)]) -> Response {
    let mut h: Vec<(&str, &str)> = vec![("authorization", TOKEN), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    let body = format!(r#"{{"amount":5,"key":"{key}"}}"#);
    http::request(e.port, "POST", "/charges", &h, body.as_bytes()).expect("request")
}

fn replayed(r: &Response) -> bool {
    r.header("idempotent-replayed") == Some("true")
}

/// The old and the new proxy on one store, each side of every crossing.
struct Fleet {
    up: Upstream,
    old: Envoy,
    new: Envoy,
    previous: Release,
}

impl Fleet {
    /// Both proxies with `plugin`, the store reached as `store` sets; `etcd_leases` waits for the
    /// etcd leases of every worker before traffic.
    fn start(plugin: &str, store: impl Fn(&mut EnvoyOptions), etcd_leases: bool) -> Fleet {
        let previous = previous_release();
        let old_module = release_module(&previous);
        let up = Upstream::start();
        let mut o = EnvoyOptions::new(plugin, up.port);
        store(&mut o);
        // First attempts are held at the upstream until the test lets them answer.
        o.route_timeout_ms = 60_000;
        let new = Envoy::start(&o);
        o.wasm = Some(old_module);
        let old = Envoy::start(&o);
        if etcd_leases {
            support::etcd::wait_leases(&old, o.concurrency);
            support::etcd::wait_leases(&new, o.concurrency);
        }
        // Each names its release and formats (releases before 0.2.0 logged neither).
        assert!(new.log().contains(&format!("idemgate {VERSION}: store records written and read as")), "{}", new.log());
        if Version::parse(&previous.version) >= Version::parse("0.2.0") {
            assert!(old.log().contains(&format!("idemgate {}: ", previous.version)), "{}", old.log());
        }
        Fleet { up, old, new, previous }
    }

    /// The proxy a key's first attempt goes to (`first`) and the other one, alternating by key so
    /// that retries cross versions both ways.
    fn sides(&self, i: usize) -> (&Envoy, &Envoy) {
        if i % 2 == 0 {
            (&self.old, &self.new)
        } else {
            (&self.new, &self.old)
        }
    }

    /// `keys` keys, each first sent to one version and retried on the other while it runs and
    /// once it is done; then `duplicates` keys each sent six times at once across both versions;
    /// then, each round, two keys left outcome-unknown by one version and retried on the other.
    fn run(&self, keys: usize, duplicates: usize) {
        // In rounds of at most 100 keys: a thousand claims sent at once overrun a store's
        // timeout on a loaded 2-core machine (503 store-unavailable, a refusal, not the contract).
        for (r, start) in (0..keys).step_by(100).enumerate() {
            let k = (keys - start).min(100);
            self.round(r, k, duplicates * k / keys.max(1));
        }
    }

    /// One round: keys `k-<r>-<i>` and duplicates `d-<r>-<d>`.
    fn round(&self, r: usize, keys: usize, duplicates: usize) {
        let before = self.up.executions_by_key().len();
        let who =
            |e: &Envoy| if std::ptr::eq(e, &self.old) { self.previous.version.clone() } else { VERSION.to_string() };
        // 1. First attempts, held at the upstream once executed.
        let firsts: Vec<_> = (0..keys)
            .map(|i| {
                let port = self.sides(i).0.port;
                std::thread::spawn(move || {
                    let key = format!("k-{r}-{i}");
                    let mut h = vec![("authorization", TOKEN), ("idempotency-key", key.as_str()), ("x-up-hold", "1")];
                    h.push(("content-type", "application/json"));
                    let body = format!(r#"{{"amount":5,"key":"{key}"}}"#);
                    // A claim the store did not answer in time (seen once per few runs with etcd
                    // on one loaded core) is refused 503 store-unavailable, never forwarded: a
                    // refusal, not the contract. Sent again, bounded by count; any other answer
                    // (or the 50th refusal) is this attempt's.
                    let mut tries = 0;
                    loop {
                        let r = http::request_timeout(
                            port,
                            "POST",
                            "/charges",
                            &h,
                            body.as_bytes(),
                            Duration::from_secs(90),
                        )
                        .expect("first attempt");
                        tries += 1;
                        if r.status != 503 || r.problem() != "store-unavailable" || tries == 50 {
                            break r;
                        }
                        std::thread::sleep(Duration::from_millis(200));
                    }
                })
            })
            .collect();
        let by_key = || self.up.executions_by_key();
        // A first attempt answered before the holds are released did not execute (a refusal):
        // stop waiting and say what it got.
        support::wait_for("every first attempt executing at the upstream", 1200, || {
            by_key().len() == before + keys || firsts.iter().any(|t| t.is_finished())
        });
        if let Some(i) = firsts.iter().position(|t| t.is_finished()) {
            let executed = by_key().len() - before;
            let answer = firsts.into_iter().nth(i).expect("that attempt").join().expect("first attempt");
            panic!(
                "k-{r}-{i}'s first attempt answered while held ({executed} of {keys} executing): {} {}",
                answer.status,
                answer.body_text()
            );
        }
        // 2. Retries on the other version while every first attempt runs: 409, never executed.
        for i in 0..keys {
            let (first, other) = self.sides(i);
            let key = format!("k-{r}-{i}");
            let r = post(other, &key, &[("content-type", "application/json")]);
            assert_eq!(
                (r.status, r.problem().as_str()),
                (409, "request-in-flight"),
                "{key} first sent to {}, retried on {} while in flight: {}",
                who(first),
                who(other),
                r.body_text()
            );
        }
        self.up.release_holds();
        let firsts: Vec<Response> = firsts.into_iter().map(|t| t.join().expect("first attempt")).collect();
        // Every held attempt has answered: the next round's are held again.
        self.up.hold_again();
        for (i, f) in firsts.iter().enumerate() {
            assert_eq!((f.status, replayed(f)), (201, false), "k-{r}-{i}'s first attempt: {}", f.body_text());
        }
        // 3. Retries on the other version once done (the completion is written by the first
        // proxy's root after the answer: 409 until it lands, polled by count): the replay.
        for (i, f) in firsts.iter().enumerate() {
            let (first, other) = self.sides(i);
            let key = format!("k-{r}-{i}");
            let mut last = None;
            for _ in 0..400 {
                let r = post(other, &key, &[("content-type", "application/json")]);
                if r.status != 409 {
                    last = Some(r);
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let r = last.unwrap_or_else(|| panic!("{key}: still in flight on {} after 400 retries", who(other)));
            assert_eq!(
                (r.status, replayed(&r)),
                (201, true),
                "{key} done on {}, retried on {}: {}",
                who(first),
                who(other),
                r.body_text()
            );
            assert_eq!(r.body, f.body, "{key}: the replay is the first attempt's response");
            // And back on the first version, whose own record it is.
            let back = post(first, &key, &[("content-type", "application/json")]);
            assert_eq!((back.status, replayed(&back), &back.body), (201, true, &f.body), "{key} on {}", who(first));
        }
        // 4. Concurrent duplicates, six per key, alternating versions, all sent at once.
        let sends: Vec<_> = (0..duplicates)
            .flat_map(|d| (0..6).map(move |j| (d, j)))
            .map(|(d, j)| {
                let port = if j % 2 == 0 { self.old.port } else { self.new.port };
                std::thread::spawn(move || {
                    let key = format!("d-{r}-{d}");
                    let h = [
                        ("authorization", TOKEN),
                        ("idempotency-key", key.as_str()),
                        ("content-type", "application/json"),
                        ("x-up-delay-ms", "200"),
                    ];
                    let body = format!(r#"{{"amount":5,"key":"{key}"}}"#);
                    (key.clone(), http::request(port, "POST", "/charges", &h, body.as_bytes()).expect("duplicate"))
                })
            })
            .collect();
        let mut answers: HashMap<String, Vec<Response>> = HashMap::new();
        for s in sends {
            let (key, r) = s.join().expect("duplicate");
            answers.entry(key).or_default().push(r);
        }
        for (key, rs) in &answers {
            let executed: Vec<&Response> = rs.iter().filter(|r| r.status == 201 && !replayed(r)).collect();
            assert_eq!(executed.len(), 1, "{key}: one answer is the execution's");
            for r in rs {
                let ok = (r.status == 409 && r.problem() == "request-in-flight")
                    || (r.status == 201 && r.body == executed[0].body);
                assert!(ok, "{key}: {} {}", r.status, r.body_text());
            }
        }
        // 5. An outcome-unknown record crossing versions: the upstream executes, then resets
        // before answering (Envoy's 503); the first proxy marks the key outcome-unknown after the
        // answer, and the other version answers 409 outcome-unknown (request-in-flight until the
        // mark lands, polled by count), never executing it again.
        for i in 0..2 {
            let (first, other) = self.sides(i);
            let key = format!("u-{r}-{i}");
            let cut = post(first, &key, &[("content-type", "application/json"), ("x-up-reset", "before-headers")]);
            assert_eq!(cut.status, 503, "{key}'s first attempt on {}: {}", who(first), cut.body_text());
            let mut last = None;
            for _ in 0..400 {
                let r = post(other, &key, &[("content-type", "application/json")]);
                if r.problem() != "request-in-flight" {
                    last = Some(r);
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let r = last.unwrap_or_else(|| panic!("{key}: still in flight on {} after 400 retries", who(other)));
            assert_eq!(
                (r.status, r.problem().as_str()),
                (409, "outcome-unknown"),
                "{key} unknown on {}, retried on {}: {}",
                who(first),
                who(other),
                r.body_text()
            );
        }
        // Every key executed once, whichever version saw it first.
        let counts = by_key();
        assert_eq!(counts.len(), before + keys + duplicates + 2, "{counts:?}");
        let twice: Vec<_> = counts.iter().filter(|(_, n)| **n != 1).collect();
        assert!(twice.is_empty(), "keys executed more than once: {twice:?}");
        // Nothing either version could not read.
        for (e, v) in [(&self.old, &self.previous.version), (&self.new, &VERSION.to_string())] {
            e.settle();
            assert_eq!(e.stat("idemgate.record_unreadable"), 0, "{v} found records it cannot read");
            assert_eq!(e.stat("idemgate.record_unauthentic"), 0, "{v} found records whose seal fails");
        }
        eprintln!(
            "mixed fleet {} + {VERSION}: {keys} keys crossing versions, {duplicates} x 6 duplicates: {} executions",
            self.previous.version,
            self.up.executions()
        );
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.old.assert_no_wasm_panic();
            self.new.assert_no_wasm_panic();
        }
    }
}

// A store timeout of 10 s: with 2 s, an etcd claim answered late on a loaded 2-core machine was
// 503 store-unavailable (seen with 1,000 first attempts at once), a refusal that says nothing
// about compatibility.
fn redis_plugin() -> String {
    r#"{"scope": {"headers": ["authorization"]}, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 10000}}"#
        .to_string()
}

fn etcd_plugin() -> String {
    r#"{"scope": {"headers": ["authorization"]}, "store": {"kind": "etcd", "cluster": "idemgate_store", "timeout_ms": 10000}}"#
        .to_string()
}

fn full_keys() -> usize {
    std::env::var("IDEMGATE_MIXED_FLEET_KEYS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000)
}

fn mixed_fleet_on_redis(keys: usize, duplicates: usize) {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let port = webdis.port;
    let fleet = Fleet::start(&redis_plugin(), |o| o.store_port = Some(port), false);
    fleet.run(keys, duplicates);
}

fn mixed_fleet_on_etcd(keys: usize, duplicates: usize) {
    let etcd = EtcdCluster::start();
    let ports = etcd.client_ports();
    let fleet = Fleet::start(&etcd_plugin(), |o| o.etcd_ports = ports.clone(), true);
    fleet.run(keys, duplicates);
}

#[test]
fn mixed_fleet_on_one_redis_executes_each_key_once_and_replays_across_versions() {
    mixed_fleet_on_redis(16, 8);
}

#[test]
fn mixed_fleet_on_one_etcd_executes_each_key_once_and_replays_across_versions() {
    mixed_fleet_on_etcd(16, 8);
}

#[test]
fn mixed_fleet_full_on_one_redis() {
    let n = full_keys();
    mixed_fleet_on_redis(n, n / 2);
}

#[test]
fn mixed_fleet_full_on_one_etcd() {
    let n = full_keys();
    mixed_fleet_on_etcd(n, n / 2);
}

/// A keep-alive HTTP/1.1 connection: opened to the old listener before a reload, it is still
/// served by the old listener's filter chain (the old module) while that drains.
struct Connection {
    reader: BufReader<TcpStream>,
}

impl Connection {
    fn open(port: u16) -> Connection {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        Connection { reader: BufReader::new(s) }
    }

    /// A POST of `key` on this connection; its answer's status, whether replayed, and body.
    fn post(&mut self, key: &str) -> (u16, bool, Vec<u8>) {
        let body = format!(r#"{{"amount":5,"key":"{key}"}}"#);
        let req = format!(
            "POST /charges HTTP/1.1\r\nhost: idemgate.test\r\nauthorization: {TOKEN}\r\nidempotency-key: {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        self.reader.get_mut().write_all(req.as_bytes()).expect("send on the kept connection");
        let mut status_line = String::new();
        self.reader.read_line(&mut status_line).expect("status line");
        let status: u16 = status_line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("status");
        let (mut len, mut replay) = (0usize, false);
        loop {
            let mut line = String::new();
            self.reader.read_line(&mut line).expect("header");
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((n, v)) = line.split_once(':') {
                match n.trim().to_ascii_lowercase().as_str() {
                    "content-length" => len = v.trim().parse().expect("length"),
                    "idempotent-replayed" => replay = v.trim() == "true",
                    _ => {}
                }
            }
        }
        let mut body = vec![0; len];
        self.reader.read_exact(&mut body).expect("body");
        (status, replay, body)
    }
}

/// The local tier across a hot reload from the previous release's module to this build's (one
/// Envoy, no store): shared data belongs to the process and the VM id, not to the module, so the
/// new module finds the old module's records (a replay, 409 for a claim still running), and the
/// old module, still serving a connection opened before the reload, finds the new module's.
#[test]
fn mixed_fleet_local_tier_records_survive_a_reload_to_this_release_both_ways() {
    let previous = previous_release();
    let old_module = release_module(&previous);
    let new_module = support::wasm_path();
    let up = Upstream::start();
    let cfg = r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 30, "local": {"max_entries": 1000}}"#;
    let mut o = EnvoyOptions::new(cfg, up.port);
    o.wasm = Some(old_module);
    o.lds = true;
    // Envoy's gradual drain closes a draining listener's connection after a response with a
    // probability growing from 0 to 1 over the drain time: over 600 s, the kept connection's two
    // requests in the seconds after the reload are closed early about once in 300 runs.
    o.drain_time_s = Some(600);
    o.route_timeout_ms = 60_000;
    // One worker: a kept connection and the requests the test sends are on the same worker.
    o.concurrency = 1;
    let e = Envoy::start(&o);
    let port = e.port;
    // Written by the old module: a completed record and a claim held at the upstream.
    let done = post(&e, "k-old-done", &[("content-type", "application/json")]);
    assert_eq!((done.status, replayed(&done)), (201, false), "{}", done.body_text());
    let held = std::thread::spawn(move || {
        let h = [
            ("authorization", TOKEN),
            ("idempotency-key", "k-old-held"),
            ("content-type", "application/json"),
            ("x-up-hold", "1"),
        ];
        http::request_timeout(
            port,
            "POST",
            "/charges",
            &h,
            br#"{"amount":5,"key":"k-old-held"}"#,
            Duration::from_secs(90),
        )
        .expect("held")
    });
    support::wait_for("k-old-held executing", 400, || up.executions_with_key("k-old-held") == 1);
    // A connection to the old listener, used once before the reload so that it is established.
    let mut kept = Connection::open(port);
    let warm = kept.post("k-old-kept");
    assert_eq!((warm.0, warm.1), (201, false));
    let envoy_stat = |name: &str| e.stats(name).into_iter().find(|(n, _)| n == name).map_or(0, |(_, v)| v);
    let before = envoy_stat("listener_manager.lds.update_success");
    o.wasm = Some(new_module);
    // The new listener's route marks what it forwards: an execution without the mark came through
    // the old listener's filter chain, hence the old module.
    o.route_fields =
        "                request_headers_to_add:\n                - header: {key: x-listener, value: new}\n".into();
    e.reload_listener(&o);
    support::wait_for("the new listener active", 400, || {
        envoy_stat("listener_manager.lds.update_success") > before
            && envoy_stat("listener_manager.total_listeners_warming") == 0
    });
    support::wait_for("this build's module configured", 400, || {
        e.log().contains(&format!("idemgate {VERSION}: store records written and read as"))
    });
    // The new module (new connections) reads the old module's records.
    let again = post(&e, "k-old-done", &[("content-type", "application/json")]);
    assert_eq!((again.status, replayed(&again), &again.body), (201, true, &done.body), "{}", again.body_text());
    let running = post(&e, "k-old-held", &[("content-type", "application/json")]);
    assert_eq!((running.status, running.problem().as_str()), (409, "request-in-flight"), "{}", running.body_text());
    // The new module writes a record; the old module, on the kept connection, reads it.
    let new_done = post(&e, "k-new-done", &[("content-type", "application/json")]);
    assert_eq!((new_done.status, replayed(&new_done)), (201, false), "{}", new_done.body_text());
    let crossed = kept.post("k-new-done");
    assert_eq!(
        (crossed.0, crossed.1, &crossed.2),
        (201, true, &new_done.body),
        "the old module on the kept connection"
    );
    // A key first sent on the kept connection after the reload: executed through the old
    // listener (no mark), replayed by the new module.
    let old_only = kept.post("k-kept-after");
    assert_eq!((old_only.0, old_only.1), (201, false));
    let via_new = post(&e, "k-kept-after", &[("content-type", "application/json")]);
    assert_eq!((via_new.status, replayed(&via_new), &via_new.body), (201, true, &old_only.2));
    let marked = |key: &str| {
        let ex = up.log().into_iter().find(|x| x.key.as_deref() == Some(key)).expect("executed");
        ex.headers.iter().any(|(n, v)| n == "x-listener" && v == "new")
    };
    assert!(!marked("k-kept-after"), "the kept connection was served by the new listener: it proves nothing");
    assert!(marked("k-new-done"), "the new listener's executions carry its mark");
    up.release_holds();
    let held = held.join().expect("held");
    assert_eq!(held.status, 201, "{}", held.body_text());
    let after = post(&e, "k-old-held", &[("content-type", "application/json")]);
    assert_eq!((after.status, replayed(&after), &after.body), (201, true, &held.body), "{}", after.body_text());
    let counts = up.executions_by_key();
    assert_eq!(counts.len(), 5, "{counts:?}");
    assert!(counts.values().all(|n| *n == 1), "a key executed twice: {counts:?}");
    e.assert_no_wasm_panic();
}

/// RELEASES, CHANGELOG.md, Cargo.toml's version and the shipped OCI tags tell one story.
#[test]
fn the_releases_file_the_changelog_and_the_version_agree() {
    let recorded = releases();
    assert!(!recorded.is_empty(), "RELEASES records no release");
    let changelog = std::fs::read_to_string(repo_root().join("CHANGELOG.md")).expect("CHANGELOG.md");
    let heading = |v: &str| changelog.lines().any(|l| l.starts_with(&format!("## {v} ")) || l == format!("## {v}"));
    let mut last: Option<Version> = None;
    for r in &recorded {
        let v = Version::parse(&r.version);
        assert!(v.released, "RELEASES {}: a release has no pre-release suffix", r.version);
        assert!(last.as_ref().is_none_or(|l| *l < v), "RELEASES: {} out of order", r.version);
        last = Some(v);
        assert!(heading(&r.version), "CHANGELOG.md has no section '## {}'", r.version);
        let ancestor = git(&["merge-base", "--is-ancestor", &r.commit, "HEAD"]);
        assert!(ancestor.status.success(), "release {}'s commit {} is not in this history", r.version, r.commit);
        // The commit identifies as the release it is recorded as.
        let toml = git(&["show", &format!("{}:Cargo.toml", r.commit)]);
        let toml = String::from_utf8_lossy(&toml.stdout);
        assert!(toml.contains(&format!("\nversion = \"{}\"\n", r.version)), "{} at {}", r.version, r.commit);
    }
    let newest = recorded.last().map(|r| r.version.clone()).unwrap_or_default();
    let me = Version::parse(VERSION);
    if me.released {
        // A release's own commit (recorded by the next commit, which bumps to the next -dev).
        assert!(me > Version::parse(&newest), "{VERSION} is released but not newer than {newest}");
        assert!(heading(VERSION), "CHANGELOG.md has no section '## {VERSION}'");
    } else {
        assert!(me > Version::parse(&newest), "{VERSION} is not newer than the newest release {newest}");
        assert!(changelog.contains("\n## Unreleased"), "an unreleased version needs CHANGELOG.md's '## Unreleased'");
    }
    // What users pull names a release: the newest recorded one.
    for f in ["envoy/istio/wasmplugin.yaml", "envoy/envoy-gateway/envoyextensionpolicy.yaml"] {
        let text = std::fs::read_to_string(repo_root().join(f)).expect(f);
        let tag = text.split("/idemgate:").nth(1).map(|t| t.split_whitespace().next().unwrap_or("")).unwrap_or("");
        assert_eq!(tag, newest, "{f}: the image tag");
    }
}

/// The members of an uncompressed tar (ustar, as scripts/oci-image.py writes it): name -> bytes.
fn untar(t: &[u8]) -> HashMap<String, Vec<u8>> {
    let mut out = HashMap::new();
    let mut at = 0;
    while at + 512 <= t.len() && t[at] != 0 {
        let h = &t[at..at + 512];
        let field =
            |r: std::ops::Range<usize>| String::from_utf8_lossy(&h[r]).trim_end_matches('\0').trim().to_string();
        let name = field(0..100);
        let size = usize::from_str_radix(&field(124..136), 8).expect("octal size");
        let data = t[at + 512..at + 512 + size].to_vec();
        if h[156] == b'0' || h[156] == 0 {
            out.insert(name, data);
        }
        at += 512 + size.div_ceil(512) * 512;
    }
    out
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

/// `make release`'s image (scripts/oci-image.py): an OCI image layout whose index tags the one
/// manifest with the version, every blob named by its digest, the config labelled with the
/// version and commit, one gzipped layer holding the module as plugin.wasm; the same bytes twice.
#[test]
fn the_release_image_holds_the_module_under_its_version() {
    let scratch = support::Scratch::new("oci");
    let module = support::wasm_path();
    let write = |out: &str| {
        let path = scratch.0.join(out);
        let ok = Command::new(repo_root().join("scripts/oci-image.py"))
            .args([module.to_str().expect("path"), "9.8.7", "0123456789abcdef0123456789abcdef01234567"])
            .arg(&path)
            .status()
            .expect("run scripts/oci-image.py");
        assert!(ok.success());
        std::fs::read(path).expect("the archive")
    };
    let archive = write("a.tar");
    assert_eq!(archive, write("b.tar"), "reproducible");
    let files = untar(&archive);
    let json = |b: &[u8]| serde_json::from_slice::<serde_json::Value>(b).expect("json");
    let blob = |digest: &str| {
        let hex = digest.strip_prefix("sha256:").expect("sha256 digest");
        let b = files.get(&format!("blobs/sha256/{hex}")).unwrap_or_else(|| panic!("blob {digest}")).clone();
        assert_eq!(sha256_hex(&b), hex, "blob {digest} holds what its name says");
        b
    };
    assert_eq!(json(&files["oci-layout"])["imageLayoutVersion"], "1.0.0");
    let index = json(&files["index.json"]);
    let entry = &index["manifests"][0];
    assert_eq!(entry["annotations"]["org.opencontainers.image.ref.name"], "9.8.7", "the tag");
    let manifest_bytes = blob(entry["digest"].as_str().expect("digest"));
    assert_eq!(entry["size"].as_u64(), Some(manifest_bytes.len() as u64));
    let manifest = json(&manifest_bytes);
    assert_eq!(manifest["mediaType"], "application/vnd.oci.image.manifest.v1+json");
    let config = json(&blob(manifest["config"]["digest"].as_str().expect("config")));
    assert_eq!(config["config"]["Labels"]["org.opencontainers.image.version"], "9.8.7");
    assert_eq!(
        config["config"]["Labels"]["org.opencontainers.image.revision"],
        "0123456789abcdef0123456789abcdef01234567"
    );
    let layers = manifest["layers"].as_array().expect("layers");
    assert_eq!(layers.len(), 1, "one layer");
    assert_eq!(layers[0]["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip");
    let gz = blob(layers[0]["digest"].as_str().expect("layer"));
    let mut layer_tar = Vec::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut layer_tar).expect("gunzip the layer");
    assert_eq!(config["rootfs"]["diff_ids"][0], format!("sha256:{}", sha256_hex(&layer_tar)));
    let layer = untar(&layer_tar);
    assert_eq!(layer.keys().collect::<Vec<_>>(), vec!["plugin.wasm"]);
    assert!(layer["plugin.wasm"] == std::fs::read(&module).expect("module"), "plugin.wasm is the module");
}

/// Issue 40: this release keeps an MCP call that asked for input (a round answered
/// `input_required`) as an awaiting record (record tag 6, `State::AwaitingInput`), which the
/// previous release cannot decode. What the previous release does when it meets one, in a fleet
/// sharing one Redis: it refuses every request under the key (`record-unreadable`, retryable), a
/// re-sent first round, the next round and another call alike: it never runs the call again and
/// never hands the question out as anyone's answer. The next round through this release then
/// finishes the call (one more run), and its final result (a record of the previous format) is
/// replayed by the previous release too.
#[test]
fn an_mcp_call_awaiting_input_is_refused_never_run_by_the_previous_release() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let port = webdis.port;
    let plugin = r#"{"scope": {"headers": ["authorization"]}, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 10000},
        "routes": [{"prefix": "/mcp", "protocol": "mcp", "mcp": {"tools": ["confirm"]}}]}"#;
    let fleet = Fleet::start(plugin, |o| o.store_port = Some(port), false);
    let asks = r#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"input_required","inputRequests":{"q":{"method":"elicitation/create","params":{"message":"sure?","requestedSchema":{"type":"object","properties":{}}}}},"requestState":"s1"}}"#;
    let done = r#"{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"confirmed"}]}}"#;
    let round2 = r#","inputResponses":{"q":{"action":"accept","content":{}}},"requestState":"s1""#;
    let body = |amount: u32, extra: &str| {
        format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"confirm","arguments":{{"amount":{amount}}}{extra}}}}}"#
        )
    };
    let send = |e: &Envoy, body: &str, answer: &str| {
        let h = [
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
            ("authorization", TOKEN),
            ("idempotency-key", "k-mcp-awaiting"),
            ("x-up-status", "200"),
            ("x-up-header", "content-type: application/json"),
            ("x-up-body", answer),
        ];
        http::request(e.port, "POST", "/mcp", &h, body.as_bytes()).expect("request")
    };
    // The proxy that answered a round writes its record after the answer (its write queue): a
    // request on the other proxy before that lands is in flight (-32001), never run. Sent again
    // until it is not, bounded by count.
    let settled = |e: &Envoy, body: &str, answer: &str| {
        for _ in 0..100 {
            let r = send(e, body, answer);
            if !r.body_text().contains("-32001") {
                return r;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("still in flight after 100 tries")
    };
    let r = send(&fleet.new, &body(5, ""), asks);
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert!(r.body_text().contains("input_required"), "{}", r.body_text());
    assert_eq!(fleet.up.executions(), 1);
    for (what, b) in
        [("the first round again", body(5, "")), ("the next round", body(5, round2)), ("another call", body(6, ""))]
    {
        let r = settled(&fleet.old, &b, done);
        let text = r.body_text();
        eprintln!("{} meets the awaiting record with {what}: {} {text}", fleet.previous.version, r.status);
        assert_eq!(fleet.up.executions(), 1, "{what}: the previous release ran it: {text}");
        assert!(!text.contains("input_required") && !text.contains("confirmed"), "{what}: answered {text}");
        assert!(text.contains("record-unreadable") || text.contains("unreadable"), "{what}: {} {text}", r.status);
    }
    let r = send(&fleet.new, &body(5, round2), done);
    assert!(r.body_text().contains("confirmed"), "{}", r.body_text());
    assert_eq!(fleet.up.executions(), 2, "the next round ran once");
    let r = settled(&fleet.old, &body(5, ""), asks);
    assert!(r.body_text().contains("confirmed"), "the previous release replays the final result: {}", r.body_text());
    assert_eq!(fleet.up.executions(), 2);
}

/// Issue 40, item 6: a key's tombstone on Redis is a key of its own (`idemgate:v1:t:<hex>`),
/// which the previous release never reads (its scripts and reads touch the record's key only)
/// and whose configuration refuses `tombstone_seconds` (so it runs without). A rolling upgrade
/// with both on one Redis, ttl 5 s and a 60 s tombstone on the new proxy:
/// - a key completed by the new proxy is replayed by the old one while its record lives (the
///   record's format is unchanged);
/// - past its ttl the new proxy answers its tombstone (410 `key-expired`, never executed), while
///   the old proxy finds the key free and executes it, exactly as the previous release does
///   without tombstones after `ttl_seconds`: never a misread tombstone (`record-unreadable`),
///   never an execution the old fleet would not have made; the new proxy then replays the old
///   proxy's record (a record is read before the tombstone);
/// - a key completed by the old proxy leaves no tombstone: past its ttl it is free on both, as
///   before. Executions are counted at the upstream, per key.
#[test]
fn mixed_fleet_on_one_redis_the_new_releases_tombstones_are_never_misread_by_the_previous_one() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let store = r#""store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 2000}"#;
    tombstones_never_misread(
        store,
        |o| o.store_port = Some(webdis.port),
        |plugin, key| {
            let tomb = format!("idemgate:v1:t:{{{}}}", support::redis_key_of(plugin, TOKEN, key));
            redis.get_raw(tomb).map(|v| v.len())
        },
    );
}

/// The same on one etcd: the new release's tombstone is a key of its own
/// (`idemgate/v1/<hex>/t`, 92 bytes), which the previous release never reads (its claim compares
/// and reads the value and its owner's release tombstone only; its listing skips any key that is
/// not a value's); the record's format is unchanged and lives `ttl`, so past it the previous
/// release finds the key free, as it always has.
#[test]
fn mixed_fleet_on_one_etcd_the_new_releases_tombstones_are_never_misread_by_the_previous_one() {
    let etcd = EtcdCluster::start();
    let ports = etcd.client_ports();
    let store = r#""store": {"kind": "etcd", "cluster": "idemgate_store", "timeout_ms": 2000}"#;
    tombstones_never_misread(
        store,
        |o| o.etcd_ports = ports.clone(),
        |plugin, key| {
            let hex = support::redis_key_of(plugin, TOKEN, key).trim_start_matches("idemgate:v1:").to_string();
            let tomb = format!("idemgate/v1/{hex}/t");
            etcd.all().into_iter().find(|(k, _)| k == tomb.as_bytes()).map(|(_, v)| v.len())
        },
    );
}

/// The rolling-upgrade scenario of the two tests above on one store: `store` (the plugin's
/// `store` field), `with_store` (the Envoy options reaching it), `tomb_len` (the byte length of
/// the key's tombstone the store holds for a plugin and key, if any).
fn tombstones_never_misread(
    store: &str,
    with_store: impl Fn(&mut EnvoyOptions),
    tomb_len: impl Fn(&str, &str) -> Option<usize>,
) {
    let previous = previous_release();
    let old_module = release_module(&previous);
    let up = Upstream::start();
    let lives = r#""ttl_seconds": 5, "lock_ttl_seconds": 3"#;
    let etcd = store.contains("etcd");
    let plugin = |extra: &str| format!(r#"{{"scope": {{"headers": ["authorization"]}}, {lives}{extra}, {store}}}"#);
    let options = |cfg: &str| {
        let mut o = EnvoyOptions::new(cfg, up.port);
        with_store(&mut o);
        o.route_timeout_ms = 1500;
        o
    };
    // The tombstone outlives its record by 60 s: the 410 below is asked for at least 6.5 s after
    // the first replay and after the second key's replay loop, whose length is the machine's (a
    // 10 s tombstone had expired by then once, on one core shared with another run: 201, a third
    // execution, where 410 was expected).
    let new_options = options(&plugin(r#", "tombstone_seconds": 60"#));
    let new = Envoy::start(&new_options);
    let mut o = options(&plugin(""));
    o.wasm = Some(old_module);
    let old = Envoy::start(&o);
    if etcd {
        support::etcd::wait_leases(&new, new_options.concurrency);
        support::etcd::wait_leases(&old, o.concurrency);
    }
    let executions = |key: &str| up.executions_by_key().get(key).copied().unwrap_or(0);
    let json = [("content-type", "application/json")];
    let (a, b) = ("tomb-new-first", "tomb-old-first");
    for (first, key) in [(&new, a), (&old, b)] {
        let r = post(first, key, &json);
        assert_eq!((r.status, replayed(&r)), (201, false), "{key}: {}", r.body_text());
    }
    // Replayed across versions while the records live (the completion lands after the answer).
    let mut done = None;
    for (other, key) in [(&old, a), (&new, b)] {
        let mut last = String::new();
        let ok = (0..200).any(|_| {
            let r = post(other, key, &json);
            last = format!("{} {}", r.status, r.problem());
            let hit = r.status == 201 && replayed(&r);
            if !hit {
                std::thread::sleep(Duration::from_millis(20));
            }
            hit
        });
        assert!(ok, "{key} never replayed across versions: {last}");
        done.get_or_insert_with(std::time::Instant::now);
    }
    assert_eq!((executions(a), executions(b)), (1, 1));
    let tomb = |key: &str| tomb_len(&plugin(""), key);
    assert_eq!(tomb(a), Some(if etcd { 92 } else { 77 }), "the new proxy's completion left its tombstone");
    assert_eq!(tomb(b), None, "the previous release writes none");
    // Past both records' ttl (5 s from their completions, which came before `done`).
    let until = done.expect("replayed") + Duration::from_millis(6_500);
    if let Some(d) = until.checked_duration_since(std::time::Instant::now()) {
        std::thread::sleep(d);
    }
    let on_new = post(&new, a, &json);
    assert_eq!((on_new.status, on_new.problem().as_str()), (410, "key-expired"), "{}", on_new.body_text());
    assert_eq!(executions(a), 1, "the tombstone executed nothing");
    let on_old = post(&old, a, &json);
    assert_eq!(
        (on_old.status, replayed(&on_old)),
        (201, false),
        "{} past its ttl: free, as without tombstones: {}",
        previous.version,
        on_old.body_text()
    );
    assert_eq!(executions(a), 2, "the previous release executed it once more past its ttl, as it always has");
    // The old proxy's completion lands after its answer: 409 until then (polled by count).
    let after = (0..200)
        .map(|_| post(&new, a, &json))
        .find(|r| {
            r.status != 409 || {
                std::thread::sleep(Duration::from_millis(20));
                false
            }
        })
        .expect("an answer other than 409");
    assert_eq!((after.status, replayed(&after)), (201, true), "the record is read before the tombstone");
    let free = post(&new, b, &json);
    assert_eq!((free.status, replayed(&free)), (201, false), "{}", free.body_text());
    assert_eq!((executions(a), executions(b)), (2, 2));
    assert!(!new.log().contains("record-unreadable") && !old.log().contains("record-unreadable"));
    new.assert_no_wasm_panic();
    old.assert_no_wasm_panic();
}
