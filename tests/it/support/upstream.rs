//! A small counting upstream: it commits each execution as soon as the whole request has
//! arrived (whether or not its client is still connected, as a real charge does), then answers.
//!
//! Per-request behaviour comes from request headers (not part of any fingerprint in the tests):
//! `x-up-status` (default 201), `x-up-delay-ms`, `x-up-body-bytes` (a large body),
//! `x-up-set-cookie` (adds a set-cookie header), `x-up-reset: before-headers | mid-body` (executes,
//! then closes the connection without an answer or halfway through the body), `x-up-body` (this
//! text as the body), `x-up-plain` (only `content-length` and `content-type: text/plain`, the
//! headers Envoy's own local replies carry), `x-up-execute-on-headers` (commits the execution as
//! soon as the headers have arrived, as a handler that never reads the body does), `x-up-hold`
//! (commits the execution, then holds its answer until the test calls `Upstream::release_holds`,
//! for at most 60 s: a request still running while the test changes the world around it),
//! `x-up-coding` (`gzip` gzips the body, as an upstream that compresses does; any other value is
//! sent as the `content-encoding` of the unchanged body), `x-up-trailer` (`name: value`: the body
//! chunked, then that trailer), `x-up-header` (one more response header line, `name: value`, as
//! given), `x-up-redirect` (`<status> <path>`: a request for any other path is answered that
//! status with `location: http://<its host><path>` (Envoy follows absolute locations only) and an
//! empty body, one for that path as usual: an upstream that
//! redirects, for Envoy's internal redirects; several hops separated by commas, `307 /a, 307 /b`,
//! chain them: a request for `/a` is redirected to `/b`, one for `/b` answered as usual),
//! `x-up-hold-on` (`<path>`: as `x-up-hold`, for a request for that path only: a redirect's
//! target held while its first hop answered at once).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Execution {
    pub n: u64,
    pub method: String,
    pub path: String,
    pub key: Option<String>,
    pub body: Vec<u8>,
    /// Every request header line, names lowercase.
    pub headers: Vec<(String, String)>,
}

#[derive(Default)]
struct State {
    executions: Vec<Execution>,
    /// Requests whose headers arrived but whose body never ended (the connection was closed
    /// first): never executed. Their idempotency keys.
    partial: Vec<Option<String>>,
    /// `x-up-hold` answers may go (`Upstream::release_holds`).
    holds_released: bool,
}

/// How long an `x-up-hold` request waits for `Upstream::release_holds` at most, in 5 ms polls.
const HOLD_POLLS: u32 = 12_000;

pub struct Upstream {
    pub port: u16,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
}

impl Upstream {
    pub fn start() -> Upstream {
        Upstream::start_on(0)
    }

    /// An upstream on this port (0: any free one), e.g. an application coming back on the port
    /// a proxy's cluster names.
    pub fn start_on(port: u16) -> Upstream {
        let listener = TcpListener::bind(("127.0.0.1", port)).expect("bind upstream");
        let port = listener.local_addr().expect("addr").port();
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if sp.load(Ordering::SeqCst) {
                    break;
                }
                if let Ok(conn) = conn {
                    let st = st.clone();
                    std::thread::spawn(move || serve(conn, st));
                }
            }
        });
        Upstream { port, state, stop }
    }

    /// How many requests executed.
    pub fn executions(&self) -> u64 {
        self.state.lock().expect("lock").executions.len() as u64
    }

    /// A reader of `executions()` that other threads may keep (a proxy in front waiting for the
    /// upstream to have executed).
    pub fn execution_counter(&self) -> impl Fn() -> u64 + Send + 'static {
        let state = self.state.clone();
        move || state.lock().expect("lock").executions.len() as u64
    }

    /// Requests whose headers arrived but whose body never ended (never executed).
    pub fn partial_requests(&self) -> u64 {
        self.state.lock().expect("lock").partial.len() as u64
    }

    /// Executions whose forwarded idempotency key is `key`.
    pub fn executions_with_key(&self, key: &str) -> u64 {
        self.state.lock().expect("lock").executions.iter().filter(|e| e.key.as_deref() == Some(key)).count() as u64
    }

    /// Executions per `idempotency-key` value ("" for none).
    pub fn executions_by_key(&self) -> std::collections::HashMap<String, u64> {
        let mut per_key = std::collections::HashMap::new();
        for x in self.state.lock().expect("lock").executions.iter() {
            *per_key.entry(x.key.clone().unwrap_or_default()).or_insert(0) += 1;
        }
        per_key
    }

    pub fn log(&self) -> Vec<Execution> {
        self.state.lock().expect("lock").executions.clone()
    }

    /// Lets every `x-up-hold` request answer, those held now and those to come.
    pub fn release_holds(&self) {
        self.state.lock().expect("lock").holds_released = true;
    }

    /// Holds `x-up-hold` requests again, once every request held before has answered (one still
    /// waiting for its release would wait on).
    pub fn hold_again(&self) {
        self.state.lock().expect("lock").holds_released = false;
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Header lines as (lowercase name, value), in order.
pub type Headers = Vec<(String, String)>;

/// `x-up-redirect: <status> <path>` among a request's `headers` (names lowercase), the request
/// being for `path` and its execution `n`: the redirect to answer (that status, an absolute
/// `location` to `<path>` on the request's `host`, or to `<path>` itself when it is an absolute
/// `http://` URL (another host), which Envoy's internal redirects follow, an empty body), unless
/// the request is for `<path>`'s path itself. Hops separated by commas chain: a request for one
/// hop's path gets the next hop's redirect (the last one's is answered as usual). Shared by the
/// MCP upstream.
pub fn redirect_answer(headers: &[(String, String)], path: &str, n: impl std::fmt::Display) -> Option<String> {
    let get = |name: &str| headers.iter().find(|(h, _)| h == name).map(|(_, v)| v.as_str());
    let mut hops = vec![];
    for hop in get("x-up-redirect")?.split(',') {
        let (status, to) = hop.trim().split_once(' ')?;
        // `<path>` or an absolute `http://<host><path>` (a redirect to another host).
        let (location, to) = match to.strip_prefix("http://").and_then(|r| r.find('/').map(|i| (to, &r[i..]))) {
            Some((url, p)) => (url.to_string(), p),
            None => (format!("http://{}{to}", get("host").unwrap_or_default()), to),
        };
        hops.push((status, location, to));
    }
    let next = match hops.iter().position(|(_, _, to)| *to == path) {
        Some(i) => hops.get(i + 1)?,
        None => hops.first()?,
    };
    let (status, location, _) = next;
    Some(format!("HTTP/1.1 {status} X\r\nlocation: {location}\r\ncontent-length: 0\r\nx-execution: {n}\r\n\r\n"))
}

/// An HTTP/1.1 request's line and headers (names lowercased) read from `reader`; `None` when the
/// connection ends first.
pub fn read_head(reader: &mut impl BufRead) -> Option<(String, String, Headers)> {
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let mut headers: Headers = vec![];
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            return Some((method, path, headers));
        }
        if let Some((n, v)) = h.split_once(':') {
            headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
}

fn serve(conn: TcpStream, state: Arc<Mutex<State>>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(60)));
    let mut writer = match conn.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    let mut reader = BufReader::new(conn);
    loop {
        let Some((method, path, headers)) = read_head(&mut reader) else { return };
        let get = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        let partial = || state.lock().expect("lock").partial.push(get("idempotency-key"));
        let execute = |body: &[u8]| {
            let mut s = state.lock().expect("lock");
            let n = s.executions.len() as u64 + 1;
            s.executions.push(Execution {
                n,
                method: method.clone(),
                path: path.clone(),
                key: get("idempotency-key"),
                body: body.to_vec(),
                headers: headers.clone(),
            });
            n
        };
        let on_headers = get("x-up-execute-on-headers").is_some();
        let early = if on_headers { Some(execute(b"")) } else { None };
        let mut body = vec![];
        if let Some(len) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
            body.resize(len, 0);
            if reader.read_exact(&mut body).is_err() {
                partial();
                return;
            }
        } else if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
            loop {
                let mut size_line = String::new();
                if reader.read_line(&mut size_line).unwrap_or(0) == 0 {
                    partial();
                    return;
                }
                let size = usize::from_str_radix(size_line.trim().split(';').next().unwrap_or("0"), 16).unwrap_or(0);
                let mut chunk = vec![0; size + 2];
                if reader.read_exact(&mut chunk).is_err() {
                    partial();
                    return;
                }
                if size == 0 {
                    break;
                }
                body.extend_from_slice(&chunk[..size]);
            }
        }
        // Commit the execution now, before answering: a lost response does not undo it.
        let n = match early {
            Some(n) => n,
            None => execute(&body),
        };
        if let Some(ms) = get("x-up-delay-ms").and_then(|v| v.parse::<u64>().ok()) {
            std::thread::sleep(Duration::from_millis(ms));
        }
        if get("x-up-hold").is_some() || get("x-up-hold-on").is_some_and(|p| p == path) {
            for _ in 0..HOLD_POLLS {
                if state.lock().expect("lock").holds_released {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if let Some(out) = redirect_answer(&headers, &path, n) {
            let _ = writer.write_all(out.as_bytes());
            let _ = writer.flush();
            continue;
        }
        let status: u16 = get("x-up-status").and_then(|v| v.parse().ok()).unwrap_or(201);
        let resp_body = match (get("x-up-body"), get("x-up-body-bytes").and_then(|v| v.parse::<usize>().ok())) {
            (Some(text), _) => text.into_bytes(),
            (None, Some(size)) => vec![b'x'; size],
            (None, None) => format!("{{\"id\":\"res-{n}\",\"execution\":{n},\"path\":{path:?}}}").into_bytes(),
        };
        let mut head = if get("x-up-plain").is_some() {
            format!("HTTP/1.1 {status} X\r\ncontent-length: {}\r\ncontent-type: text/plain\r\n", resp_body.len())
        } else {
            format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nlocation: /resources/res-{n}\r\nx-execution: {n}\r\n",
                resp_body.len()
            )
        };
        let resp_body = match get("x-up-coding") {
            Some(coding) => {
                head = head.replace(&format!("content-length: {}\r\n", resp_body.len()), "");
                let coded = if coding == "gzip" {
                    let mut e = flate2::write::GzEncoder::new(vec![], flate2::Compression::default());
                    let _ = e.write_all(&resp_body);
                    e.finish().unwrap_or_default()
                } else {
                    resp_body
                };
                head.push_str(&format!("content-encoding: {coding}\r\ncontent-length: {}\r\n", coded.len()));
                coded
            }
            None => resp_body,
        };
        if get("x-up-set-cookie").is_some() {
            head.push_str("set-cookie: session=secret-of-first-caller; HttpOnly\r\n");
        }
        if let Some(line) = get("x-up-header") {
            head.push_str(&format!("{line}\r\n"));
        }
        // `x-up-trailer: name: value`: the body chunked, then that response trailer (Envoy passes
        // HTTP/1 trailers on only with the cluster's `enable_trailers`).
        let trailer = get("x-up-trailer");
        if trailer.is_some() {
            head = head.replace(&format!("content-length: {}\r\n", resp_body.len()), "");
            head.push_str("transfer-encoding: chunked\r\n");
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        match &trailer {
            Some(t) => {
                out.extend_from_slice(format!("{:x}\r\n", resp_body.len()).as_bytes());
                out.extend_from_slice(&resp_body);
                out.extend_from_slice(format!("\r\n0\r\n{t}\r\n\r\n").as_bytes());
            }
            None => out.extend_from_slice(&resp_body),
        }
        match get("x-up-reset").as_deref() {
            // Executed, then the connection is cut: no response at all, or half of it.
            Some("before-headers") => return,
            Some("mid-body") => {
                let cut = out.len() - resp_body.len() / 2 - 1;
                let _ = writer.write_all(&out[..cut]);
                let _ = writer.flush();
                return;
            }
            _ => {}
        }
        if writer.write_all(&out).is_err() {
            return;
        }
    }
}
