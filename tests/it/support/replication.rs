//! A Redis primary and its replica on 127.0.0.1 (ports chosen at run time), both loading
//! `envoy/redis.conf` with its ACL users plus its replication user, for failover tests:
//!
//! - `ReplicatedRedis`: the pair (the replica authenticates as the replication user whose ACL
//!   line `envoy/redis.conf` shows commented out), optionally linked through a `Relay`;
//!   `kill_primary` (SIGKILL, and the relay cut), `promote_replica` (`REPLICAOF NO ONE`).
//! - `Relay`: a TCP relay between the replica and the primary that can hold the replication link
//!   in both directions (a partition: the primary keeps acknowledging writes its replica never
//!   sees, and hears no acknowledgement from it) and cut it, dropping what it held.

use super::store::{resp::Value, Redis};
use std::io::{ErrorKind, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The replication user's name (`masteruser`).
pub const REPLICATION_USER: &str = "replicator";

/// Polls of the replication state (50 ms apart: 30 s) before a test fails.
const SYNC_POLLS: u32 = 600;

/// The replication user's ACL line as `envoy/redis.conf` ships it (commented out), as
/// command-line words: `--user replicator on >password ...`, and its password.
fn replication_user() -> (Vec<String>, String) {
    let conf = std::fs::read_to_string(super::store::redis_conf()).expect("read envoy/redis.conf");
    let prefix = format!("# user {REPLICATION_USER} ");
    let line = conf
        .lines()
        .find_map(|l| l.strip_prefix("# ").filter(|_| l.starts_with(&prefix)))
        .expect("envoy/redis.conf shows the replication user's line");
    let words: Vec<String> = line.split_whitespace().map(String::from).collect();
    let password = words.iter().find_map(|w| w.strip_prefix('>')).expect("a password").to_string();
    let mut args = vec![format!("--{}", words[0])];
    args.extend(words[1..].iter().cloned());
    (args, password)
}

/// `INFO <section>` as text.
pub fn info(redis: &Redis, section: &str) -> String {
    match redis.command(&[b"INFO", section.as_bytes()]) {
        Value::Bulk(Some(b)) => String::from_utf8_lossy(&b).into_owned(),
        other => panic!("INFO {section} on port {}: {other:?}", redis.port),
    }
}

/// One `field:value` line of an INFO text.
pub fn info_field(info: &str, field: &str) -> Option<String> {
    info.lines().find_map(|l| l.strip_prefix(field).and_then(|rest| rest.strip_prefix(':')).map(str::to_string))
}

/// A primary and its replica, SIGKILLed when dropped.
pub struct ReplicatedRedis {
    pub primary: Redis,
    pub replica: Redis,
    /// The replication link, when it goes through a relay.
    pub relay: Option<Relay>,
}

impl ReplicatedRedis {
    /// Starts the primary (with `primary_args` more options, e.g. `--min-replicas-to-write 1`),
    /// then the replica (`--replicaof` the primary, or the relay in front of it), and waits
    /// until the replica holds everything the primary has.
    pub fn start(through_relay: bool, primary_args: &[&str]) -> ReplicatedRedis {
        let (user_args, password) = replication_user();
        let mut args = user_args.clone();
        // Start the full sync at once (the default waits 5 s to batch replicas).
        args.extend(["--repl-diskless-sync-delay", "0"].map(String::from));
        args.extend(primary_args.iter().map(|a| a.to_string()));
        let primary = Redis::start_with_args(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let relay = through_relay.then(|| Relay::start(primary.port));
        let link_port = relay.as_ref().map_or(primary.port, |r| r.port).to_string();
        let mut args = user_args;
        args.extend(
            ["--replicaof", "127.0.0.1", &link_port, "--masteruser", REPLICATION_USER, "--masterauth", &password]
                .map(String::from),
        );
        let replica = Redis::start_with_args(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let pair = ReplicatedRedis { primary, replica, relay };
        pair.wait_in_sync();
        pair
    }

    /// Waits (bounded polls) until the replica's link is up, it has applied every byte of the
    /// primary's replication stream, and, when the primary counts good replicas
    /// (`min-replicas-to-write`), the primary counts it.
    pub fn wait_in_sync(&self) {
        let mut last = String::new();
        for _ in 0..SYNC_POLLS {
            let p = info(&self.primary, "replication");
            let r = info(&self.replica, "replication");
            let up = info_field(&r, "master_link_status").as_deref() == Some("up");
            let applied = info_field(&r, "slave_repl_offset");
            let good = info_field(&p, "min_slaves_good_slaves").is_none_or(|n| n != "0");
            if up && good && applied.is_some() && applied == info_field(&p, "master_repl_offset") {
                return;
            }
            last = format!("primary:\n{p}\nreplica:\n{r}");
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the replica never caught up with the primary:\n{last}\nreplica log:\n{}", self.replica.log());
    }

    /// SIGKILL of the primary (no shutdown, nothing more sent to its replica), then the relay cut:
    /// what it held never reaches the replica.
    pub fn kill_primary(&mut self) {
        self.primary.kill9();
        if let Some(relay) = &self.relay {
            relay.cut();
        }
    }

    /// `REPLICAOF NO ONE`: the replica becomes a primary that accepts writes.
    pub fn promote_replica(&self) {
        let r = self.replica.command(&[b"REPLICAOF", b"NO", b"ONE"]);
        assert_eq!(r, Value::Status("OK".into()), "REPLICAOF NO ONE");
        let role = info_field(&info(&self.replica, "replication"), "role");
        assert_eq!(role.as_deref(), Some("master"), "the promoted replica's role");
    }
}

/// A TCP relay on 127.0.0.1 to a target port; every connection is pumped both ways by two
/// threads, which stop when the relay is cut or dropped.
pub struct Relay {
    pub port: u16,
    shared: Arc<RelayShared>,
}

#[derive(Default)]
struct RelayShared {
    held: AtomicBool,
    answers_held: AtomicBool,
    cut: AtomicBool,
    conns: Mutex<Vec<TcpStream>>,
}

impl Relay {
    pub fn start(target_port: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind relay");
        listener.set_nonblocking(true).expect("nonblocking relay listener");
        let port = listener.local_addr().expect("relay addr").port();
        let shared = Arc::new(RelayShared::default());
        let s = shared.clone();
        std::thread::spawn(move || {
            while !s.cut.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let _ = client.set_nonblocking(false);
                        let Ok(target) = TcpStream::connect(("127.0.0.1", target_port)) else { continue };
                        let clones = (client.try_clone(), target.try_clone(), client.try_clone(), target.try_clone());
                        let (Ok(client_kept), Ok(target_kept), Ok(client_out), Ok(target_in)) = clones else {
                            continue;
                        };
                        s.conns.lock().expect("lock").extend([client_kept, target_kept]);
                        let (s1, s2) = (s.clone(), s.clone());
                        std::thread::spawn(move || pump(client, target, &s1, false));
                        std::thread::spawn(move || pump(target_in, client_out, &s2, true));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Relay { port, shared }
    }

    /// Stops forwarding, both ways: bytes read from now on wait in the relay.
    pub fn hold(&self) {
        self.shared.held.store(true, Ordering::SeqCst);
    }

    /// Forwards what was held since `hold`, and what follows, both ways.
    pub fn unhold(&self) {
        self.shared.held.store(false, Ordering::SeqCst);
    }

    /// Stops forwarding the target's answers (requests still reach it): they wait in the relay
    /// until `release_answers`.
    pub fn hold_answers(&self) {
        self.shared.answers_held.store(true, Ordering::SeqCst);
    }

    /// Forwards the answers held since `hold_answers`, and those that follow.
    pub fn release_answers(&self) {
        self.shared.answers_held.store(false, Ordering::SeqCst);
    }

    /// Closes every connection and refuses new ones; held bytes are dropped.
    pub fn cut(&self) {
        self.shared.cut.store(true, Ordering::SeqCst);
        for c in self.shared.conns.lock().expect("lock").iter() {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.cut();
    }
}

/// Copies `from` to `to` until either closes or the relay is cut; while held (or, for the
/// target's side, while answers are held), keeps what it read.
fn pump(mut from: TcpStream, mut to: TcpStream, s: &RelayShared, answers: bool) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(20)));
    let mut buf = vec![0u8; 64 * 1024];
    while !s.cut.load(Ordering::SeqCst) {
        let n = match crate::support::http::read_some(&mut from, &mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {
                continue
            }
            Err(_) => break,
        };
        // Held: the bytes stay here until released or the cut drops them.
        while (s.held.load(Ordering::SeqCst) || (answers && s.answers_held.load(Ordering::SeqCst)))
            && !s.cut.load(Ordering::SeqCst)
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        if s.cut.load(Ordering::SeqCst) || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
