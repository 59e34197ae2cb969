//! The demo's payments API: it executes charges, counts them and lists them. It commits a
//! charge as soon as the request has arrived, before answering, whether or not its client is
//! still there: exactly what makes a lost response dangerous.
//!
//!     demo-payments --port 8080 [--bind 0.0.0.0]
//!
//! - `POST /charges` with `{"amount": 4200, "currency": "eur"}`: executes, answers 201 with the
//!   charge; `x-demo-delay-ms` delays the answer (not the execution).
//! - `GET /charges`: every charge, in order. `GET /stats`: `{"executions": N}`.
//! - `POST /reset`: forgets every charge (between the demo's two runs).
//! - `GET|POST /bench`: a fast, stateless `200 {"ok":true}` for the benchmarks.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

#[derive(Default)]
struct Ledger {
    charges: Vec<Value>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let port =
        args.iter().position(|a| a == "--port").and_then(|i| args.get(i + 1)).and_then(|p| p.parse::<u16>().ok());
    let Some(port) = port else {
        eprintln!("usage: demo-payments --port PORT [--bind ADDRESS]");
        std::process::exit(2);
    };
    // Loopback unless told otherwise (the Docker compose flavour binds 0.0.0.0 in its container).
    let bind =
        args.iter().position(|a| a == "--bind").and_then(|i| args.get(i + 1)).map_or("127.0.0.1", |s| s.as_str());
    let listener = match TcpListener::bind((bind, port)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("demo-payments: cannot listen on {bind}:{port}: {e}");
            std::process::exit(1);
        }
    };
    eprintln!("demo-payments: listening on {bind}:{port}");
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    for conn in listener.incoming().flatten() {
        let ledger = ledger.clone();
        std::thread::spawn(move || serve(conn, &ledger));
    }
}

struct Request {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

fn read_request(r: &mut BufReader<TcpStream>) -> Option<Request> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next()?.to_string(), parts.next()?.to_string());
    let mut headers = vec![];
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).ok()? == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((n, v)) = h.split_once(':') {
            headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let len =
        headers.iter().find(|(n, _)| n == "content-length").and_then(|(_, v)| v.parse::<usize>().ok()).unwrap_or(0);
    let mut body = vec![0; len];
    r.read_exact(&mut body).ok()?;
    Some(Request { method, path, headers, body })
}

fn serve(conn: TcpStream, ledger: &Mutex<Ledger>) {
    let _ = conn.set_nodelay(true);
    let Ok(mut out) = conn.try_clone() else { return };
    let mut reader = BufReader::new(conn);
    while let Some(req) = read_request(&mut reader) {
        let (status, body) = handle(&req, ledger);
        let text = body.to_string();
        let head = format!(
            "HTTP/1.1 {status} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{}\r\n",
            if status < 300 { "OK" } else { "Error" },
            text.len(),
            body.get("id").and_then(Value::as_str).map_or(String::new(), |id| format!("location: /charges/{id}\r\n"))
        );
        // One write per response: head and body in two writes would meet Nagle and delayed ACKs.
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(text.as_bytes());
        if out.write_all(&bytes).is_err() {
            return;
        }
    }
}

fn handle(req: &Request, ledger: &Mutex<Ledger>) -> (u16, Value) {
    let path = req.path.split('?').next().unwrap_or("");
    match (req.method.as_str(), path) {
        ("POST", "/charges") => {
            let Ok(input) = serde_json::from_slice::<Value>(&req.body) else {
                return (400, json!({"error": "body must be JSON"}));
            };
            // Commit first: a charge that executed stays executed, whatever happens to the answer.
            let charge = {
                let mut l = ledger.lock().unwrap_or_else(|e| e.into_inner());
                let charge = json!({
                    "id": format!("ch_{}", l.charges.len() + 1),
                    "amount": input.get("amount").cloned().unwrap_or(Value::Null),
                    "currency": input.get("currency").cloned().unwrap_or(Value::Null),
                    "idempotency_key": req.header("idempotency-key"),
                });
                l.charges.push(charge.clone());
                charge
            };
            if let Some(ms) = req.header("x-demo-delay-ms").and_then(|v| v.parse::<u64>().ok()) {
                std::thread::sleep(Duration::from_millis(ms.min(30_000)));
            }
            (201, charge)
        }
        ("GET", "/charges") => {
            let l = ledger.lock().unwrap_or_else(|e| e.into_inner());
            (200, json!({"charges": l.charges}))
        }
        ("GET", "/stats") => {
            let l = ledger.lock().unwrap_or_else(|e| e.into_inner());
            (200, json!({"executions": l.charges.len()}))
        }
        ("GET" | "POST", "/bench") => (200, json!({"ok": true})),
        ("POST", "/reset") => {
            ledger.lock().unwrap_or_else(|e| e.into_inner()).charges.clear();
            (200, json!({"executions": 0}))
        }
        _ => (404, json!({"error": "not found"})),
    }
}
