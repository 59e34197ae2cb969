//! The CLI's link to the etcd store (`--etcd URL[,URL...]` or `IDEMGATE_ETCD`): etcd v3's JSON
//! gateway over plain HTTP/1.1, its members tried in order, and the token traded for
//! `IDEMGATE_STORE_AUTH`. It only carries requests: what they are and how their answers are read
//! is `idemgate::backend::Backend`'s (`etcd`'s requests and parsers), every rule `admin`'s.

use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use idemgate::etcd;
use idemgate::store::StoreRequest;

use super::{exchange, fail, parse_url, usage, Fail, Link};

/// How long the CLI waits to connect to one member before it tries the next.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// etcd members (or a load balancer), tried in order while one does not take the connection, and
/// the token traded for `IDEMGATE_STORE_AUTH` (etcd's authentication on).
pub struct Etcd {
    endpoints: Vec<(String, u16)>,
    token: Option<String>,
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
}

impl Link for Etcd {
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
