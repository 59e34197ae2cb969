//! The CLI on the etcd store (`--etcd URL[,URL...]` or `IDEMGATE_ETCD`): etcd v3's JSON gateway
//! over plain HTTP/1.1. Every request and answer is `idemgate::etcd`'s (built and parsed there),
//! every rule `idemgate::admin`'s; this module only sends, and judges times with the CLI's clock
//! taken `etcd::CLOCK_SKEW_TOLERANCE_MS` behind (`etcd::judged_now`), as the filter does.

use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use clap::ArgMatches;
use idemgate::admin::{self, KeyState, Settle};
use idemgate::etcd::{self, Fence};
use idemgate::scope::StorageKey;
use idemgate::store::{ReadReply, StoreRequest, TransitionReply};

use super::{exchange, fail, parse_url, record_seal, s, storage_key, usage, Fail};

/// How long the CLI waits to connect to one member before it tries the next.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// etcd members (or a load balancer), tried in order while one does not take the connection, and
/// the token traded for `IDEMGATE_STORE_AUTH` (etcd's authentication on).
pub struct Etcd {
    endpoints: Vec<(String, u16)>,
    token: Option<String>,
}

/// This machine's clock in ms since the epoch.
fn local_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Etcd {
    /// `urls`: `http://host:port`, several comma-separated. With `IDEMGATE_STORE_AUTH`
    /// (`user:password`) set, authenticates at once: a credential etcd refuses ends the command.
    pub fn connect(urls: &str) -> Result<Etcd, Fail> {
        let mut endpoints = vec![];
        for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            let (host, port, path) = parse_url(url).or_else(usage)?;
            if path != "/" {
                return usage(format!("--etcd {url}: a member's URL has no path (http://host:port)"));
            }
            endpoints.push((host, port));
        }
        if endpoints.is_empty() {
            return usage("--etcd: no URL (http://host:port of a member, several comma-separated)");
        }
        let mut e = Etcd { endpoints, token: None };
        if let Some(cred) = std::env::var("IDEMGATE_STORE_AUTH").ok().filter(|v| !v.is_empty()) {
            let req = etcd::authenticate_request(&cred).or_else(usage)?;
            let (status, body) = e.send(&req)?;
            match status {
                400 | 401 | 403 => {
                    return fail(format!(
                        "etcd refused IDEMGATE_STORE_AUTH (HTTP {status}: {}): check its user:password",
                        etcd::error_text(&body)
                    ))
                }
                _ => {
                    let token = etcd::parse_authenticate(Some(status), &body)
                        .or_else(|err| fail(format!("etcd authentication: {err}")))?;
                    e.token = Some(token);
                }
            }
        }
        Ok(e)
    }

    /// Sends `r` to the first member that takes the connection. Once sent, a lost answer is an
    /// error, never sent again elsewhere (a write may have landed).
    fn send(&self, r: &StoreRequest) -> Result<(u16, Vec<u8>), Fail> {
        let headers: Vec<(String, String)> =
            self.token.iter().map(|t| ("authorization".to_string(), t.clone())).collect();
        let mut refused = vec![];
        for (host, port) in &self.endpoints {
            let stream = match open(host, *port) {
                Ok(c) => c,
                Err(e) => {
                    refused.push(format!("{host}:{port}: {e}"));
                    continue;
                }
            };
            return match exchange(stream, host, *port, r.method, &r.path, &headers, &r.body, super::TIMEOUT) {
                Ok(a) => Ok((a.status, a.body)),
                Err(e) => fail(format!(
                    "etcd at {host}:{port}: {e} (no answer: a change may have landed; inspect the key again)"
                )),
            };
        }
        fail(format!("no etcd member answered: {}", refused.join("; ")))
    }

    /// `send`, a refusal of the request itself (authentication, permission) made a clear failure.
    fn call(&self, r: &StoreRequest) -> Result<(Option<u16>, Vec<u8>), Fail> {
        let (status, body) = self.send(r)?;
        if matches!(status, 400 | 401 | 403) {
            let why = etcd::error_text(&body);
            let hint = if self.token.is_some() {
                "IDEMGATE_STORE_AUTH's user needs read and write on idemgate/v1/ (or its token was revoked: try again)"
            } else {
                "if etcd's authentication is on, set IDEMGATE_STORE_AUTH to user:password"
            };
            return fail(format!("etcd refused the request (HTTP {status}: {why}): {hint}"));
        }
        Ok((Some(status), body))
    }

    /// The value of `skey` and what it was read as (`Fence`), judged at `local_now_ms`.
    fn read(&self, skey: &StorageKey, local_now_ms: u64) -> Result<(ReadReply, Option<Fence>), Fail> {
        let (status, body) = self.call(&etcd::read_request(skey))?;
        etcd::parse_fenced_read(status, &body, skey, &record_seal()?, local_now_ms)
            .or_else(|e| fail(format!("store: {e}")))
    }

    /// A lease of `ttl_seconds`, granted by etcd now.
    fn grant(&self, ttl_seconds: u64) -> Result<i64, Fail> {
        let (status, body) = self.call(&etcd::lease_grant_request(ttl_seconds))?;
        etcd::parse_lease_grant(status, &body, ttl_seconds).or_else(|e| fail(format!("etcd lease grant: {e}")))
    }
}

/// A connection to `host:port`, given up after `CONNECT_TIMEOUT`.
fn open(host: &str, port: u16) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::other("no address");
    for addr in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(c) => return Ok(c),
            Err(e) => last = e,
        }
    }
    Err(last)
}

pub fn inspect(e: &Etcd, a: &ArgMatches) -> Result<(), Fail> {
    let skey = storage_key(a)?;
    let now = local_now_ms();
    match e.read(&skey, now)? {
        (ReadReply::Absent, _) => println!("absent"),
        (ReadReply::Unreadable(why), _) => return fail(format!("the key holds a value this build cannot read: {why}")),
        (ReadReply::Found(v), fence) => {
            let mut report = admin::report(&skey, &v, etcd::judged_now(now));
            if let (Some(f), Some(o)) = (fence, report.as_object_mut()) {
                // The value's expiry by its writer's clock; etcd drops the key later (its lease).
                o.insert("store_expires_at_ms".into(), f.expires_at_ms.into());
                o.insert("store_mod_revision".into(), f.mod_revision.into());
            }
            println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
        }
    }
    Ok(())
}

/// Pages of at most `etcd::LIST_PAGE_MAX` key names over `etcd::KEY_PREFIX` (never one unbounded
/// range, never a page of values), then one read per value key found, until `--limit` are shown.
pub fn list(e: &Etcd, a: &ArgMatches) -> Result<(), Fail> {
    let want = KeyState::parse(s(a, "state").map_or("", |v| v.as_str())).or_else(usage)?;
    let limit = a.get_one::<usize>("limit").copied().unwrap_or(100);
    let mut start: Option<Vec<u8>> = None;
    let mut shown = 0;
    let mut unreadable = 0;
    while shown < limit {
        let (status, body) = e.call(&etcd::list_page_request(start.as_deref(), etcd::LIST_PAGE_MAX))?;
        let page = etcd::parse_list_page(status, &body, start.as_deref(), etcd::LIST_PAGE_MAX)
            .or_else(|err| fail(format!("store: {err}")))?;
        for skey in &page.keys {
            if shown >= limit {
                break;
            }
            let now = local_now_ms();
            let v = match e.read(skey, now)? {
                (ReadReply::Found(v), _) => v,
                (ReadReply::Absent, _) => continue,
                (ReadReply::Unreadable(_), _) => {
                    unreadable += 1;
                    continue;
                }
            };
            let report = admin::report(skey, &v, etcd::judged_now(now));
            if report["state"].as_str() != Some(want.as_str()) {
                continue;
            }
            match (want, report["lock"].as_str()) {
                (KeyState::InFlight, Some("live")) => println!(
                    "{}\t{}\tlock live {} ms",
                    skey.hex(),
                    want.as_str(),
                    v.lock_expires_at_ms.saturating_sub(etcd::judged_now(now))
                ),
                (KeyState::InFlight, _) => println!("{}\t{}\tlock expired", skey.hex(), want.as_str()),
                _ => println!("{}\t{}", skey.hex(), want.as_str()),
            }
            shown += 1;
        }
        match page.next {
            Some(next) => start = Some(next),
            None => break,
        }
    }
    if unreadable > 0 {
        eprintln!("idemgate: note: {unreadable} value(s) this build cannot read (another record key?) were skipped");
    }
    Ok(())
}

/// Reads the value (and its `mod_revision`), plans the action (`admin::plan`, the lock judged
/// by `etcd::judged_now`), grants the lease a write needs, and sends the transition fenced on
/// the value read.
pub fn settle(e: &Etcd, skey: &StorageKey, action: &Settle, done: &str, write_window_ms: u64) -> Result<(), Fail> {
    let now = local_now_ms();
    let fence = match e.read(skey, now)? {
        (ReadReply::Found(_), Some(f)) => f,
        (ReadReply::Found(_), None) => return fail("store: a value read without its revision"),
        (ReadReply::Absent, _) => return fail("refused: the key is absent (nothing to settle)"),
        (ReadReply::Unreadable(why), _) => {
            return fail(format!("refused: the key holds a value this build cannot read: {why}"))
        }
    };
    let t =
        admin::plan(action, &fence.value, etcd::judged_now(now), write_window_ms).or_else(|r| fail(r.to_string()))?;
    let lease = match t.new_phase {
        Some(_) => e.grant(etcd::operator_lease_ttl_seconds(t.ttl_ms))?,
        None => 0,
    };
    let request = etcd::operator_transition_request(&t, skey, &record_seal()?, lease, now, &fence)
        .or_else(|why| fail(format!("refused: {why}")))?;
    let (status, body) = e.call(&request)?;
    let echo = t.new_phase.map(|p| (skey, p, &t.new_owner));
    match etcd::parse_transition_reply(status, &body, echo) {
        Ok(TransitionReply::Changed | TransitionReply::ClaimGoneRewritten) => {
            println!("{done}");
            Ok(())
        }
        // An operator's transition never writes where absent: the key is gone.
        Ok(TransitionReply::Refused | TransitionReply::Absent) => fail(
            "refused: the record changed since it was read (its request or another operator acted); inspect it again",
        ),
        Ok(TransitionReply::NoScript) => fail("store: an etcd answer parsed as NOSCRIPT"),
        Err(err) => fail(format!("store: {err}")),
    }
}
