//! Rollouts that strand no key (issue 43 item 3): two Envoy 1.40 proxies on one Redis (behind
//! webdis), restarted one after the other under load, the way docs/operating.md says to.
//!
//! - `rolling_restart_*`: keys keep arriving through both proxies while proxy A is taken out of
//!   the clients' rotation, drained (`POST /drain_listeners?graceful`, then polled until its
//!   listener refuses connections, no request is active and `idemgate.store_writes_pending` is
//!   0, by count), stopped with SIGTERM and started again, then the same for B. A client whose
//!   connection closes retries on the other proxy. Every key executes once, its completion is in
//!   Redis, every retry of a key that executed gets its replay, and at the end every key sent
//!   once more is replayed with its first answer's body. The short form (100 keys) runs in
//!   `make test`; `rolling_restart_full_*` runs IDEMGATE_ROLLOUT_KEYS (default 500) in
//!   `make test-rollout`. Figures in target/rollout/drain.md.
//! - `a_sigterm_with_requests_in_flight_*`: the failure the docs warn of. SIGTERM alone with
//!   requests in flight: the clients get no answer, the upstream executed each once, the
//!   completions never reach the store, and the retries on the other proxy get 409 (in flight
//!   while the lock lives, `outcome-unknown` after): never a second execution, never a replay.

use crate::support;

use std::collections::HashMap;
use std::io::ErrorKind;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::http;
use support::store::{Redis, Webdis};
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions};

const TOKEN: &str = "Bearer alice-secret-token";

fn plugin(lock_ttl_seconds: u32) -> String {
    format!(
        r#"{{"scope": {{"headers": ["authorization"]}}, "lock_ttl_seconds": {lock_ttl_seconds}, "store": {{"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 2000}}}}"#
    )
}

fn post(port: u16, key: &str, extra: &[(&str, &str)]) -> std::io::Result<http::Response> {
    let mut h = vec![("authorization", TOKEN), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    http::request_timeout(port, "POST", "/charges", &h, b"{\"amount\":1}", Duration::from_secs(30))
}

/// The phase byte of `key`'s record in Redis ('D' done, 'U' outcome-unknown, ...), '-' if none.
fn phase(redis: &Redis, plugin: &str, key: &str) -> char {
    let name = support::redis_key_of(plugin, TOKEN, key);
    redis.get_raw(&name).and_then(|v| v.get(4).map(|b| *b as char)).unwrap_or('-')
}

/// What a proxy's admin says of its drain: (requests active on its listeners, idemgate's
/// `store_writes_pending`), None once the admin does not answer (Envoy gone).
fn in_flight(envoy: &Envoy) -> Option<(u64, u64)> {
    let r = http::get(envoy.admin_port, "/stats?filter=downstream_rq_active%7Cstore_writes_pending").ok()?;
    let (mut active, mut pending) = (0, 0);
    for (n, v) in String::from_utf8_lossy(&r.body).lines().filter_map(|l| l.split_once(": ")) {
        let v: u64 = v.trim().parse().unwrap_or(0);
        if n.starts_with("http.ingress") && n.ends_with(".downstream_rq_active") {
            active += v;
        } else if n.ends_with("idemgate.store_writes_pending") {
            pending += v;
        }
    }
    Some((active, pending))
}

fn refuses_connections(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_err_and(|e| e.kind() == ErrorKind::ConnectionRefused)
}

/// What one drain measured.
struct Drained {
    active_at_drain: u64,
    to_idle: Duration,
    to_closed: Duration,
    exited_by_itself: bool,
    sigterm_to_exit: Duration,
}

/// The documented drain: `POST /drain_listeners?graceful`, then poll (at most `polls` looks 50 ms
/// apart) until the listener refuses connections and nothing is active or pending, then SIGTERM.
/// `on_closed` runs once the listener refuses connections.
fn drain_and_stop(envoy: &mut Envoy, polls: u32, mut on_closed: impl FnMut()) -> Drained {
    let active_at_drain = in_flight(envoy).map_or(0, |x| x.0);
    let t0 = Instant::now();
    let r = http::request(envoy.admin_port, "POST", "/drain_listeners?graceful", &[], b"").expect("drain_listeners");
    assert_eq!(r.status, 200, "drain_listeners: {}", r.body_text());
    // First the listener closes (the drain time is over: no new connection from here on), then
    // what it had accepted finishes and its completions land.
    let (mut to_idle, mut to_closed, mut gone) = (None, None, false);
    for _ in 0..polls {
        if to_closed.is_none() && refuses_connections(envoy.port) {
            to_closed = Some(t0.elapsed());
            on_closed();
        }
        match in_flight(envoy) {
            None => {
                gone = true;
                break;
            }
            Some((0, 0)) if to_closed.is_some() => {
                to_idle = Some(t0.elapsed());
                break;
            }
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        gone || to_idle.is_some(),
        "proxy on port {} not drained after {polls} polls: active/pending {:?}, listener closed: {}",
        envoy.port,
        in_flight(envoy),
        to_closed.is_some()
    );
    let t1 = Instant::now();
    envoy.stop();
    Drained {
        active_at_drain,
        to_idle: to_idle.unwrap_or_default(),
        to_closed: to_closed.unwrap_or_default(),
        exited_by_itself: gone,
        sigterm_to_exit: t1.elapsed(),
    }
}

/// One key's story as its client saw it.
#[derive(Default, Clone, Debug)]
struct Story {
    /// The first answer's body (a 201 executed or replayed).
    body: Vec<u8>,
    /// Attempts whose connection was refused (never reached a proxy).
    refused: u32,
    /// Attempts sent whose connection closed without an answer.
    unanswered: u32,
    /// Retries after an unanswered attempt, of a key the upstream had executed: were they replays?
    retries_after_execution: Vec<bool>,
    /// 409 in-flight answers met (the key running on the other proxy).
    in_flight_answers: u32,
    /// Anything else: (status, problem type).
    other: Vec<(u16, String)>,
}

/// The clients' load balancer: the proxies in rotation (their listener ports, None when out).
type Rotation = Arc<Mutex<[Option<u16>; 2]>>;

/// Sends `key` through the rotation, starting at proxy `first`, until it has a 201: retries on
/// the other proxy when a connection is refused or closes without an answer, waits out 409
/// in-flight. At most 600 attempts.
fn send_until_answered(key: &str, first: usize, delay_ms: &str, lb: &Rotation, up: &Upstream) -> Story {
    let mut s = Story::default();
    let mut which = first;
    let mut after_unanswered = false;
    for _ in 0..600 {
        let port = {
            let r = lb.lock().expect("lb");
            r[which].or(r[1 - which])
        };
        let Some(port) = port else {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        let executed_before = up.executions_with_key(key) > 0;
        match post(port, key, &[("x-up-delay-ms", delay_ms)]) {
            Ok(r) if r.status == 201 => {
                if after_unanswered && executed_before {
                    s.retries_after_execution.push(r.header("idempotent-replayed") == Some("true"));
                }
                s.body = r.body;
                return s;
            }
            Ok(r) if r.status == 409 && r.problem() == "request-in-flight" => {
                s.in_flight_answers += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(r) => {
                s.other.push((r.status, r.problem()));
                return s;
            }
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                s.refused += 1;
                which = 1 - which;
            }
            Err(_) => {
                s.unanswered += 1;
                after_unanswered = true;
                which = 1 - which;
            }
        }
    }
    s.other.push((0, "no answer in 600 attempts".into()));
    s
}

fn rolling_restart(keys: usize, label: &str) {
    assert!(keys >= 10 && keys % 5 == 0, "keys in five equal batches");
    let plugin = plugin(30);
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Arc::new(Upstream::start());
    let mut o = EnvoyOptions::new(&plugin, up.port);
    o.store_port = Some(webdis.port);
    o.route_timeout_ms = 10_000;
    o.wasm_log_level = "info".into();
    // The graceful drain's length: the listener stays open (new connections answered with
    // `connection: close`) for this long, then closes.
    o.drain_time_s = Some(2);
    let mut proxies = [Envoy::start(&o), Envoy::start(&o)];
    // Half the clients follow the load balancer, which takes a proxy out before its drain; the
    // other half keep a stale list (a client's DNS cache, an L4 balancer without the news) and
    // keep sending to the draining proxy, answered with `connection: close` until its listener
    // closes, then refused: they retry on the other proxy.
    let lb: Rotation = Arc::new(Mutex::new([Some(proxies[0].port), Some(proxies[1].port)]));
    let stale: Rotation = Arc::new(Mutex::new([Some(proxies[0].port), Some(proxies[1].port)]));
    let stories: Arc<Mutex<HashMap<String, Story>>> = Arc::default();

    let (tx, rx) = mpsc::channel::<usize>();
    let rx = Arc::new(Mutex::new(rx));
    let workers: Vec<_> = (0..10)
        .map(|w| {
            let (rx, up, stories) = (rx.clone(), up.clone(), stories.clone());
            let lb = if w % 2 == 0 { lb.clone() } else { stale.clone() };
            std::thread::spawn(move || loop {
                let next = rx.lock().expect("rx").recv();
                let Ok(i) = next else { return };
                let key = format!("roll-{i}");
                // Most take 300 ms upstream, every fourth 1.5 s: some are still running when
                // a drain starts.
                let delay = if i % 4 == 0 { "1500" } else { "300" };
                let story = send_until_answered(&key, i % 2, delay, &lb, &up);
                stories.lock().expect("stories").insert(key, story);
            })
        })
        .collect();
    let batch = keys / 5;
    let mut pushed = 0;
    let push = |pushed: &mut usize, n: usize| {
        for i in *pushed..*pushed + n {
            tx.send(i).expect("send");
        }
        *pushed += n;
    };

    let mut figures = vec![];
    // Five batches: one before anything, one as A's drain begins, one once A's listener has
    // closed (the stale clients find it refusing), one after A is back, one once B's has closed.
    push(&mut pushed, batch);
    for which in [0usize, 1] {
        let name = ["a", "b"][which];
        let mut active_before = 0;
        support::wait_for(&format!("requests running on proxy {name}"), 400, || {
            active_before = in_flight(&proxies[which]).map_or(0, |(active, _)| active);
            active_before > 0
        });
        // The load balancer first (as Kubernetes removes a terminating pod from its endpoints),
        // then the drain; keys keep coming through the other proxy meanwhile.
        lb.lock().expect("lb")[which] = None;
        if which == 0 {
            push(&mut pushed, batch);
        }
        let d = drain_and_stop(&mut proxies[which], 400, || push(&mut pushed, batch));
        let t = Instant::now();
        proxies[which] = Envoy::start(&o);
        let restart = t.elapsed();
        lb.lock().expect("lb")[which] = Some(proxies[which].port);
        stale.lock().expect("stale")[which] = Some(proxies[which].port);
        if which == 0 {
            push(&mut pushed, batch);
        }
        eprintln!(
            "[{label}] proxy {name}: {} active at the drain, idle after {:?}, listener closed after {:?}, exited by itself: {}, SIGTERM to exit {:?}, restart {:?}",
            d.active_at_drain, d.to_idle, d.to_closed, d.exited_by_itself, d.sigterm_to_exit, restart
        );
        figures.push(format!(
            "{name}: {} active at drain, idle {} ms, listener closed {} ms, SIGTERM to exit {} ms",
            d.active_at_drain,
            d.to_idle.as_millis(),
            d.to_closed.as_millis(),
            d.sigterm_to_exit.as_millis()
        ));
        // What the drain must carry: requests running just before it began (each key takes 300 ms
        // or 1.5 s upstream); `active_at_drain`, read again as the drain starts, is for the table.
        assert!(
            active_before > 0,
            "nothing was in flight on proxy {name} when its drain began: the test proves nothing"
        );
    }
    assert_eq!(pushed, keys);
    drop(tx);
    for w in workers {
        w.join().expect("worker");
    }

    let stories = stories.lock().expect("stories").clone();
    assert_eq!(stories.len(), keys);
    let per_key = up.executions_by_key();
    let mut bad = vec![];
    let (mut refused, mut unanswered, mut retried, mut in_flight_409) = (0, 0, 0, 0);
    for (key, s) in &stories {
        refused += s.refused;
        unanswered += s.unanswered;
        retried += s.retries_after_execution.len();
        in_flight_409 += s.in_flight_answers;
        let executions = per_key.get(key).copied().unwrap_or(0);
        let p = phase(&redis, &plugin, key);
        if executions != 1 || p != 'D' || !s.other.is_empty() || s.retries_after_execution.contains(&false) {
            bad.push(format!("{key}: executions {executions}, store phase {p}, {s:?}"));
        }
    }
    assert!(bad.is_empty(), "{} keys stranded or executed twice:\n{}", bad.len(), bad.join("\n"));

    // Every key once more, through the proxy it did not start on (both restarted, their local
    // tiers empty): the replay from the store, the first answer's body.
    let mut replays = 0;
    for i in 0..keys {
        let key = format!("roll-{i}");
        let r = post(proxies[1 - i % 2].port, &key, &[]).expect("replay request");
        let first = &stories[&key].body;
        if r.status == 201 && r.header("idempotent-replayed") == Some("true") && r.body == *first {
            replays += 1;
        } else {
            bad.push(format!("{key}: {} {} replayed={:?}", r.status, r.problem(), r.header("idempotent-replayed")));
        }
    }
    assert!(bad.is_empty(), "retries after the rollout not replayed:\n{}", bad.join("\n"));
    assert_eq!(up.executions(), keys as u64, "executions in all");
    for p in &proxies {
        p.assert_no_wasm_panic();
    }
    support::table_row(
        "target/rollout",
        "drain.md",
        &[
            label,
            &keys.to_string(),
            &figures.join("; "),
            &format!("{refused} refused, {unanswered} unanswered, {retried} retried after execution, {in_flight_409} x 409 in-flight"),
            "executed twice 0, outcome-unknown 0",
            &format!("{replays}/{keys} replayed after"),
        ],
    );
}

fn full_keys() -> usize {
    std::env::var("IDEMGATE_ROLLOUT_KEYS").ok().and_then(|v| v.parse().ok()).unwrap_or(500)
}

#[test]
fn rolling_restart_drained_strands_no_key() {
    rolling_restart(100, "rolling restart, drained (short)");
}

#[test]
fn rolling_restart_full_drained_strands_no_key() {
    let keys = full_keys() / 5 * 5;
    rolling_restart(keys, "rolling restart, drained (full)");
}

/// The documented failure: SIGTERM without the drain, with requests in flight. Each was
/// executed once, its client got no answer, its completion never reached the store, and a
/// retry on the other proxy is refused (409 in-flight while the 2 s lock lives,
/// `outcome-unknown` after): never executed again, never a replay.
#[test]
fn a_sigterm_with_requests_in_flight_leaves_them_outcome_unknown_never_executed_twice() {
    let plugin = plugin(2);
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(&plugin, up.port);
    o.store_port = Some(webdis.port);
    o.route_timeout_ms = 30_000;
    o.wasm_log_level = "info".into();
    let mut a = Envoy::start(&o);
    let b = Envoy::start(&o);
    const N: usize = 8;
    let clients: Vec<_> = (0..N)
        .map(|i| {
            let port = a.port;
            std::thread::spawn(move || post(port, &format!("term-{i}"), &[("x-up-hold", "1")]))
        })
        .collect();
    support::wait_for("every key executing upstream", 400, || up.executions() == N as u64);
    let t0 = Instant::now();
    a.stop();
    let exit = t0.elapsed();
    for (i, c) in clients.into_iter().enumerate() {
        let r = c.join().expect("client");
        assert!(r.is_err(), "term-{i}: the client got an answer after SIGTERM: {:?}", r.map(|r| r.status));
    }
    up.release_holds();
    let mut first_answers = vec![];
    let phases: String = (0..N).map(|i| phase(&redis, &plugin, &format!("term-{i}"))).collect();
    for i in 0..N {
        let key = format!("term-{i}");
        let r = post(b.port, &key, &[]).expect("retry");
        let p = r.problem();
        assert!(r.status == 409 && (p == "request-in-flight" || p == "outcome-unknown"), "{key}: {} {p}", r.status);
        first_answers.push(p);
    }
    // The lock (2 s) expires; polled by count, on Redis's own clock.
    for i in 0..N {
        let key = format!("term-{i}");
        let mut last = (0, String::new());
        for _ in 0..100 {
            let r = post(b.port, &key, &[]).expect("retry");
            last = (r.status, r.problem());
            if last.1 != "request-in-flight" {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!((last.0, last.1.as_str()), (409, "outcome-unknown"), "{key} once its lock expired");
        assert_ne!(phase(&redis, &plugin, &key), 'D', "{key}: a completion reached the store");
    }
    let per_key = up.executions_by_key();
    for i in 0..N {
        assert_eq!(per_key.get(&format!("term-{i}")), Some(&1), "term-{i} executions");
    }
    assert_eq!(up.executions(), N as u64);
    b.assert_no_wasm_panic();
    eprintln!("[sigterm] {N} in flight: SIGTERM to exit {exit:?}; store phases after the exit {phases}; first retries {first_answers:?}, then outcome-unknown");
    support::table_row(
        "target/rollout",
        "drain.md",
        &[
            "plain SIGTERM, requests in flight",
            &N.to_string(),
            &format!("SIGTERM to exit {} ms", exit.as_millis()),
            &format!("{N} unanswered"),
            &format!("executed twice 0, outcome-unknown {N}"),
            &format!("0 replayed: first retries {first_answers:?}, then outcome-unknown; store phases {phases}"),
        ],
    );
}

/// An Envoy process of a hot restart (started without `--disable-hot-restart`), killed when
/// dropped.
struct Epoch(std::process::Child);

impl Epoch {
    fn start(dir: &std::path::Path, epoch: u32, base_id: &str, log: &str) -> Epoch {
        let log = std::fs::File::create(dir.join(log)).expect("log");
        let mut cmd = std::process::Command::new(support::envoy_bin());
        cmd.current_dir(dir)
            .args(["-c", "envoy.yaml", "--concurrency", "2", "--log-level", "info"])
            .args(["--restart-epoch", &epoch.to_string()])
            .args(["--drain-time-s", "2", "--parent-shutdown-time-s", "8"]);
        if epoch == 0 {
            cmd.args(["--use-dynamic-base-id", "--base-id-path", "base-id"]);
        } else {
            cmd.args(["--base-id", base_id]);
        }
        let child = cmd
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start envoy");
        Epoch(child)
    }

    fn exited(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(Some(_)))
    }
}

impl Drop for Epoch {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn server_epoch(admin_port: u16) -> Option<String> {
    let r = http::get(admin_port, "/server_info").ok()?;
    let v = r.json();
    (r.status == 200 && v["state"] == "LIVE").then(|| v["command_line_options"]["restart_epoch"].to_string())
}

/// Item 2 of issue 43 item 3: a hot restart (`--restart-epoch 1`, `--drain-time-s 2`,
/// `--parent-shutdown-time-s 8`) with a store. Keys in flight on the old process when the new
/// one takes the sockets: those whose upstream answers before the parent shuts down finish there
/// (their clients get the 201) and their completions land in Redis, where the new process
/// replays them; those still running at the parent's shutdown are cut off, executed once and
/// outcome-unknown, as with a plain SIGTERM.
#[test]
fn a_hot_restart_lets_keys_in_flight_on_the_old_process_finish_and_land() {
    let plugin = plugin(2);
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(&plugin, up.port);
    o.store_port = Some(webdis.port);
    o.route_timeout_ms = 60_000;
    o.wasm_log_level = "info".into();
    let scratch = support::Scratch::new("hot-restart");
    let (port, admin) = (support::free_port(), support::free_port());
    let cfg = support::render_config(&o, port, admin, &support::wasm_path());
    std::fs::write(scratch.0.join("envoy.yaml"), cfg).expect("config");
    let mut old = Epoch::start(&scratch.0, 0, "", "epoch0.log");
    support::wait_for("epoch 0 live", 600, || server_epoch(admin).is_some());
    let base_id = std::fs::read_to_string(scratch.0.join("base-id")).expect("base id").trim().to_string();

    // 6 keys that finish during the parent's drain (held until the new process is up), 2 that
    // outlive the parent (their upstream takes 30 s).
    const FINISH: usize = 6;
    const OUTLIVE: usize = 2;
    let mut clients = vec![];
    for i in 0..FINISH + OUTLIVE {
        let key = format!("hot-{i}");
        let extra: (&'static str, &'static str) =
            if i < FINISH { ("x-up-hold", "1") } else { ("x-up-delay-ms", "30000") };
        clients.push(std::thread::spawn(move || {
            let r = post(port, &key, &[extra]);
            (Instant::now(), r)
        }));
    }
    support::wait_for("every key executing upstream", 400, || up.executions() == (FINISH + OUTLIVE) as u64);
    let t0 = Instant::now();
    let _new = Epoch::start(&scratch.0, 1, &base_id, "epoch1.log");
    support::wait_for("epoch 1 live", 600, || server_epoch(admin).as_deref() == Some("1"));
    let took_over = t0.elapsed();
    assert!(!old.exited(), "the old process exited before its drain");
    up.release_holds();
    let mut finished = vec![];
    for c in clients.drain(..FINISH) {
        let (at, r) = c.join().expect("client");
        let r = r.expect("a key in flight on the old process gets its answer");
        assert_eq!(r.status, 201, "{}", r.body_text());
        finished.push((at - t0, r.body));
    }
    for i in 0..FINISH {
        let key = format!("hot-{i}");
        support::wait_for(&format!("{key}'s completion in Redis"), 200, || phase(&redis, &plugin, &key) == 'D');
    }
    let landed = t0.elapsed();
    // The parent goes at --parent-shutdown-time-s (8 s after the new process started).
    let mut polls = 0;
    while !old.exited() && polls < 400 {
        std::thread::sleep(Duration::from_millis(50));
        polls += 1;
    }
    assert!(old.exited(), "the old process still runs 20 s after its drain began");
    let parent_gone = t0.elapsed();
    for c in clients {
        let (_, r) = c.join().expect("client");
        assert!(r.is_err(), "a key outliving the parent got an answer: {:?}", r.map(|r| r.status));
    }
    // The new process: the finished keys replayed from the store, the outliving ones refused.
    for (i, (_, body)) in finished.iter().enumerate() {
        let r = post(port, &format!("hot-{i}"), &[]).expect("retry");
        assert_eq!((r.status, r.header("idempotent-replayed")), (201, Some("true")), "hot-{i}");
        assert_eq!(&r.body, body, "hot-{i}: the replay is the first answer");
    }
    let mut outlived = vec![];
    for i in FINISH..FINISH + OUTLIVE {
        let key = format!("hot-{i}");
        let mut last = (0, String::new());
        for _ in 0..100 {
            let r = post(port, &key, &[]).expect("retry");
            last = (r.status, r.problem());
            if last.1 != "request-in-flight" {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!((last.0, last.1.as_str()), (409, "outcome-unknown"), "{key}");
        outlived.push(phase(&redis, &plugin, &key));
    }
    for (k, n) in up.executions_by_key() {
        assert_eq!(n, 1, "{k} executions");
    }
    assert_eq!(up.executions(), (FINISH + OUTLIVE) as u64);
    let logs = std::fs::read_to_string(scratch.0.join("epoch0.log")).unwrap_or_default()
        + &std::fs::read_to_string(scratch.0.join("epoch1.log")).unwrap_or_default();
    for needle in ["panicked at", "Wasm VM failed", "wasm trap"] {
        assert!(!logs.contains(needle), "envoy log shows `{needle}`");
    }
    eprintln!(
        "[hot restart] new process live after {took_over:?}; {FINISH} held keys answered by the old process and landed (phase D) {landed:?} after the new one started; parent gone after {parent_gone:?}; {OUTLIVE} outliving keys: unanswered, store phases {outlived:?}, 409 outcome-unknown"
    );
    support::table_row(
        "target/rollout",
        "drain.md",
        &[
            "hot restart (drain 2 s, parent shutdown 8 s)",
            &(FINISH + OUTLIVE).to_string(),
            &format!(
                "new live {} ms, completions landed {} ms, parent gone {} ms",
                took_over.as_millis(),
                landed.as_millis(),
                parent_gone.as_millis()
            ),
            &format!("{FINISH} answered by the old process, {OUTLIVE} outliving it unanswered"),
            &format!("executed twice 0, outcome-unknown {OUTLIVE} (those outliving the parent)"),
            &format!("{FINISH}/{FINISH} replayed by the new process"),
        ],
    );
}

/// What a hot restart forgets without a store: the new process starts with empty shared data
/// (the local tier), so a key completed on the old process executes again on the new one. The
/// documented limit of the local tier (README, docs/operating.md), held by a test.
#[test]
fn a_hot_restart_without_a_store_forgets_completed_keys() {
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(r#"{"scope": {"headers": ["authorization"]}}"#, up.port);
    o.wasm_log_level = "info".into();
    let scratch = support::Scratch::new("hot-restart-local");
    let (port, admin) = (support::free_port(), support::free_port());
    let cfg = support::render_config(&o, port, admin, &support::wasm_path());
    std::fs::write(scratch.0.join("envoy.yaml"), cfg).expect("config");
    let _old = Epoch::start(&scratch.0, 0, "", "epoch0.log");
    support::wait_for("epoch 0 live", 600, || server_epoch(admin).is_some());
    let base_id = std::fs::read_to_string(scratch.0.join("base-id")).expect("base id").trim().to_string();
    let first = post(port, "local-1", &[]).expect("first");
    assert_eq!(first.status, 201);
    let again = post(port, "local-1", &[]).expect("retry");
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")), "replayed before");
    let _new = Epoch::start(&scratch.0, 1, &base_id, "epoch1.log");
    support::wait_for("epoch 1 live", 600, || server_epoch(admin).as_deref() == Some("1"));
    let after = post(port, "local-1", &[]).expect("retry after the hot restart");
    assert_eq!((after.status, after.header("idempotent-replayed")), (201, None), "{}", after.body_text());
    assert_eq!(up.executions_with_key("local-1"), 2, "the new process executed the key again");
}
