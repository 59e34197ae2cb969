//! webdis 0.1.9 writes a command's answer to the file descriptor its HTTP client had
//! (`cmd->fd`); when that client went away before Redis answered (a caller that timed out and
//! closed its connection), the descriptor is closed and the next connection webdis accepts gets
//! the same number, so the late answer is written to that new client, before its own
//! (upstream's fix, "Avoid responding to the wrong fd after client disconnection", is in webdis
//! 0.1.20). These tests make that happen on purpose, with a real webdis and Redis, and check that
//! the reader refuses an answer that is not its own request's: the take-over that forwards on
//! "changed" (the promise), and the operator CLI's reads (docs/stores.md).
//!
//! Ordering is by state, never by time: Redis holds the first client's command
//! (`CLIENT PAUSE ... WRITE`: a script is a write) until the test has seen, in webdis's
//! `/proc/PID/fd`, the first client's descriptor closed and the second's accepted.

use crate::support;
use idemgate::backend::Backend;
use idemgate::owner::OwnerToken;
use idemgate::record::{Creator, Lifetimes, Record};
use idemgate::scope::StorageKey;
use idemgate::store::{self, StoreError, StoreRequest, Transition, TransitionReply};
use std::collections::BTreeSet;
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;
use support::store::{resp::Value, Redis, Webdis};

/// Polls of webdis's descriptors (5 ms apart) before a test gives up.
const POLLS: u32 = 2000;

/// webdis's open socket descriptors.
fn sockets(pid: u32) -> BTreeSet<u32> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return BTreeSet::new() };
    dir.filter_map(|e| e.ok())
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:")))
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .collect()
}

/// Waits (bounded by count) until `done(sockets)`.
fn wait_sockets(pid: u32, what: &str, done: impl Fn(&BTreeSet<u32>) -> bool) -> BTreeSet<u32> {
    for _ in 0..POLLS {
        let now = sockets(pid);
        if done(&now) {
            return now;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("webdis's sockets never {what}: {:?}", sockets(pid));
}

/// `r` as one keep-alive HTTP/1.1 request (as Envoy sends the filter's).
fn http_bytes(r: &StoreRequest, port: u16) -> Vec<u8> {
    let mut b = format!(
        "{} {} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-length: {}\r\n\r\n",
        r.method,
        r.path,
        r.body.len()
    )
    .into_bytes();
    b.extend_from_slice(&r.body);
    b
}

/// The next whole answer on `c` (`buf`: what was read past the last one): (status, body).
fn read_answer(c: &mut TcpStream, buf: &mut Vec<u8>) -> (u16, Vec<u8>) {
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut chunk = [0u8; 16384];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("status");
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .expect("content-length");
            if buf.len() >= end + 4 + len {
                let body = buf[end + 4..end + 4 + len].to_vec();
                buf.drain(..end + 4 + len);
                return (status, body);
            }
        }
        let n = crate::support::http::read_some(c, &mut chunk).expect("an answer");
        assert!(n > 0, "webdis closed without an answer: {:?}", String::from_utf8_lossy(buf));
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Sends `late` on a connection that goes away while Redis holds it, then connects anew and
/// returns that new connection (Redis released: webdis writes `late`'s answer to it, before
/// anything is sent on it).
fn late_answer_lands_on_a_new_connection(redis: &Redis, webdis: &Webdis, late: &StoreRequest) -> TcpStream {
    let pid = webdis.pid();
    // Settled: its listener and its pool (`Webdis::start`: 2 threads of 8 Redis connections), no
    // client left (the readiness check's connection closed).
    let before = wait_sockets(pid, "settled", |s| s.len() == 1 + 2 * 8);
    assert_eq!(redis.command(&[b"CLIENT", b"PAUSE", b"600000", b"WRITE"]), Value::Status("OK".into()));
    let mut a = TcpStream::connect(("127.0.0.1", webdis.port)).unwrap();
    a.write_all(&http_bytes(late, webdis.port)).unwrap();
    // webdis has A's descriptor; it reads A's request before A's end, and sends its command to
    // Redis, which holds it (paused).
    let with_a = wait_sockets(pid, "took A's connection", |s| s.len() > before.len());
    let fd = *with_a.difference(&before).next().expect("A's descriptor");
    drop(a);
    wait_sockets(pid, "closed A's connection", |s| *s == before);
    let b = TcpStream::connect(("127.0.0.1", webdis.port)).unwrap();
    // The lowest free descriptor: A's number again.
    wait_sockets(pid, "accepted B's connection as A's descriptor", |s| s.contains(&fd));
    assert_eq!(redis.command(&[b"CLIENT", b"UNPAUSE"]), Value::Status("OK".into()));
    b
}

fn lifetimes() -> Lifetimes {
    Lifetimes::of(&idemgate::config::Policy { lock_ttl_seconds: 10, ttl_seconds: 1000, ..Default::default() })
}

/// A forwarded claim of `skey` by `owner` in Redis, its lock expired (`stale`) or live.
fn claim(redis: &Redis, skey: &StorageKey, owner: OwnerToken, stale: bool) {
    let l = lifetimes();
    let creator = Creator { request_id: "req".into(), log_values: vec![] };
    let record = Record::in_progress(idemgate::fingerprint::Fingerprint([7; 32]), creator, owner, 0, &l);
    let cmd = store::claim_command(skey, &owner, &record, &l, &support::record_seal());
    let args: Vec<&[u8]> = cmd.iter().map(Vec::as_slice).collect();
    assert!(matches!(redis.command(&args), Value::Array(Some(_))));
    if stale {
        let key = store::redis_key(skey);
        redis.command(&[b"SETRANGE", key.as_bytes(), b"37", b"000000000000000"]);
    }
}

/// The take-over of `skey`'s claim by `stale_owner` for `new_owner`, with its script in full.
fn take_over(skey: &StorageKey, stale_owner: OwnerToken, new_owner: OwnerToken) -> StoreRequest {
    let l = lifetimes();
    let creator = Creator { request_id: "req".into(), log_values: vec![] };
    let record = Record::in_progress(idemgate::fingerprint::Fingerprint([7; 32]), creator, new_owner, 0, &l);
    let t = Transition::take_over(stale_owner, new_owner, record, false, &l);
    let r = t.request(skey, &support::record_seal());
    r.with_script().unwrap_or(r)
}

/// Proxy A takes over a stale claim (Redis: changed) and goes away before the answer; proxy B's
/// new connection gets A's "changed" first, while B's own take-over (of a claim whose lock is
/// live) is refused. B must not read A's answer as its own: it would forward a request whose key
/// another request holds. The echo of the new owner tells them apart.
#[test]
fn a_take_over_never_reads_another_requests_late_changed_as_its_own() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let (k1, k2) = (StorageKey([0x51; 32]), StorageKey([0x52; 32]));
    let (a, b, holder) = (OwnerToken([0xa1; 16]), OwnerToken([0xb2; 16]), OwnerToken([0xc3; 16]));
    claim(&redis, &k1, OwnerToken([0x5a; 16]), true);
    claim(&redis, &k2, holder, false);
    let mut conn = late_answer_lands_on_a_new_connection(&redis, &webdis, &take_over(&k1, OwnerToken([0x5a; 16]), a));
    let ours = take_over(&k2, holder, b);
    // The late answer is there before this request is sent (were it sent first, webdis could
    // write either answer first: the same hazard, less easily shown).
    let mut buf = vec![];
    let (status, body) = read_answer(&mut conn, &mut buf);
    conn.write_all(&http_bytes(&ours, webdis.port)).unwrap();
    println!("B's take-over of k2 read: {status} {:?}", String::from_utf8_lossy(&body));
    // webdis gave B the answer of A's take-over: "changed", echoing A.
    let a_changed = Backend::Redis.parse_take_over(Some(status), &body, &k1, &a);
    assert_eq!(a_changed, Ok(TransitionReply::Changed), "B's connection did not get A's late answer first");
    // B refuses it: not its own (with the bare "1" this script answered before, B forwarded).
    let read_by_b = Backend::Redis.parse_take_over(Some(status), &body, &k2, &b);
    assert!(matches!(read_by_b, Err(StoreError::Garbled(_))), "{read_by_b:?}");
    // B's own answer follows on the same connection: refused, the holder's claim untouched.
    let (status, body) = read_answer(&mut conn, &mut buf);
    assert_eq!(Backend::Redis.parse_take_over(Some(status), &body, &k2, &b), Ok(TransitionReply::Refused));
    let held = store::StoredValue::open(
        &redis.get_raw(store::redis_key(&k2).into_bytes()).unwrap(),
        &k2,
        &support::record_seal(),
    );
    assert_eq!(held.map(|v| v.owner), Ok(holder));
}

/// The operator CLI's reads meet the same: a `TIME` or `SCAN` answer that is another request's
/// (here another listing's page) is refused by its nonce, and the CLI asks again.
#[test]
fn the_operators_list_and_clock_refuse_another_requests_late_answer() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let backend = Backend::Redis;
    let other = backend.list_request(None, "another-listing");
    let mut conn = late_answer_lands_on_a_new_connection(&redis, &webdis, &other);
    let ours = backend.list_request(None, "this-listing");
    // The late answer is there before this request is sent (were it sent first, webdis could
    // write either answer first: the same hazard, less easily shown).
    let mut buf = vec![];
    let (status, body) = read_answer(&mut conn, &mut buf);
    conn.write_all(&http_bytes(&ours, webdis.port)).unwrap();
    println!("this listing read: {status} {:?}", String::from_utf8_lossy(&body));
    assert!(backend.parse_list(Some(status), &body, None, "another-listing").is_ok(), "not the late answer");
    assert!(matches!(backend.parse_list(Some(status), &body, None, "this-listing"), Err(StoreError::Garbled(_))));
    assert!(matches!(backend.parse_clock(Some(status), &body, "this-listing"), Err(StoreError::Garbled(_))));
    let (status, body) = read_answer(&mut conn, &mut buf);
    assert!(backend.parse_list(Some(status), &body, None, "this-listing").is_ok());
}

/// The CLI itself: a store answering every request with another request's `TIME` (its nonce not
/// this request's) is asked three times, then refused; such an answer was taken for the clock
/// before `TIME` echoed a nonce.
#[test]
fn the_cli_asks_again_then_refuses_a_clock_that_is_not_its_own() {
    let bulk = |b: &str| format!("${}\r\n{b}\r\n", b.len());
    let answer = format!("*3\r\n{}{}{}", bulk("1700000000"), bulk("250000"), bulk("another-request"));
    let fake = support::store::FakeStore::start(answer.into_bytes());
    let ops = support::operator::OperatorCli::webdis(&format!("http://127.0.0.1:{}", fake.port), None);
    let out = ops.run(&["list", "--state", "in-flight"]);
    let stderr = support::operator::text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("unexpected TIME answer (not this request's)"), "{stderr}");
    assert_eq!(fake.requests(), 3, "asked three times: {stderr}");
}
