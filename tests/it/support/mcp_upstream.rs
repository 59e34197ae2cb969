//! A small counting JSON-RPC (MCP Streamable HTTP) upstream: it executes every `tools/call` as
//! soon as the whole request has arrived (whether or not its client is still there), then answers
//! the request's own id.
//!
//! Per request, from request headers: `x-mcp-answer: json` (default) answers
//! `application/json`; `sse` answers `text/event-stream` with a progress notification, then the
//! final response event; `sse-cut` sends the progress notification and ends the stream without
//! the final response (a server that died mid-call); `sse-open` sends both events on a chunked
//! stream, then keeps it open with `: ping` comments (for 20 s, or until its reader leaves) without
//! ever ending it (the spec's SHOULD-close not followed); `x-mcp-id-echo: js` echoes a numeric id
//! as a JavaScript server does (`1.0` as `1`, `1e2` as `100`); `x-up-delay-ms` waits before answering;
//! `x-up-redirect: <status> <path>` answers a request for any other path that status with an
//! absolute `location` to `<path>` and no body, after counting it (for Envoy's internal
//! redirects).
//! `mcp-session-id: stale` gets the 404 a stateful server answers a session it no longer knows,
//! before dispatching anything (not counted as an execution), with `"id": null` as the official
//! SDKs' transports send it (Python `mcp` 2.3.0 and TypeScript 1.32.2 alike).
//! Other requests with an id get an empty result; notifications and responses get 202.

use std::io::{BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

#[derive(Clone, Debug)]
pub struct Call {
    /// The request's JSON-RPC method.
    pub method: String,
}

pub struct McpUpstream {
    pub port: u16,
    calls: Arc<Mutex<Vec<Call>>>,
}

impl McpUpstream {
    pub fn start() -> McpUpstream {
        let listener = TcpListener::bind(("127.0.0.1", 0)).expect("bind mcp upstream");
        let port = listener.local_addr().expect("addr").port();
        let calls = Arc::new(Mutex::new(vec![]));
        let c = calls.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let c = c.clone();
                std::thread::spawn(move || serve(conn, c));
            }
        });
        McpUpstream { port, calls }
    }

    /// How many `tools/call` requests executed.
    pub fn executions(&self) -> usize {
        self.count("tools/call")
    }

    /// How many requests with this JSON-RPC method arrived.
    pub fn count(&self, method: &str) -> usize {
        self.calls.lock().expect("lock").iter().filter(|c| c.method == method).count()
    }

    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().expect("lock").clone()
    }
}

fn serve(conn: TcpStream, calls: Arc<Mutex<Vec<Call>>>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(60)));
    let Ok(mut writer) = conn.try_clone() else { return };
    let mut reader = BufReader::new(conn);
    loop {
        let Some((_, path, headers)) = super::upstream::read_head(&mut reader) else { return };
        let get = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        let mut body = vec![];
        if let Some(len) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
            body.resize(len, 0);
            if reader.read_exact(&mut body).is_err() {
                return;
            }
        }
        let msg: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if get("mcp-session-id").as_deref() == Some("stale") {
            calls.lock().expect("lock").push(Call { method: "(stale session)".into() });
            let b = r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Session not found"}}"#;
            let out = format!(
                "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{b}",
                b.len()
            );
            if writer.write_all(out.as_bytes()).is_err() {
                return;
            }
            continue;
        }
        let method = msg["method"].as_str().unwrap_or("").to_string();
        let n = {
            let mut c = calls.lock().expect("lock");
            c.push(Call { method: method.clone() });
            c.iter().filter(|c| c.method == "tools/call").count()
        };
        // `x-up-redirect: <status> <path>`: executed, then redirected unless it is for `<path>`.
        if let Some(out) = super::upstream::redirect_answer(&headers, &path, n) {
            if writer.write_all(out.as_bytes()).is_err() {
                return;
            }
            continue;
        }
        if let Some(ms) = get("x-up-delay-ms").and_then(|v| v.parse::<u64>().ok()) {
            std::thread::sleep(Duration::from_millis(ms));
        }
        let out = match msg.get("id") {
            Some(id) if !method.is_empty() => {
                let id = match id.as_f64() {
                    Some(f) if get("x-mcp-id-echo").as_deref() == Some("js") && f.fract() == 0.0 && f.abs() < 9e15 => {
                        json!(f as i64)
                    }
                    _ => id.clone(),
                };
                let result = if method == "tools/call" {
                    let text = format!("charged execution {n} for {}", msg["params"]["arguments"]);
                    json!({"content": [{"type": "text", "text": text}], "execution": n})
                } else {
                    json!({})
                };
                let response = json!({"jsonrpc": "2.0", "id": id, "result": result}).to_string();
                let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
                                      "params": {"progressToken": 1, "progress": 0.5}})
                .to_string();
                match get("x-mcp-answer").as_deref() {
                    Some("sse") => {
                        let b = format!("event: message\ndata: {progress}\n\nevent: message\ndata: {response}\n\n");
                        format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nx-execution: {n}\r\n\r\n{b}", b.len())
                    }
                    Some("sse-open") => {
                        let b = format!("event: message\ndata: {progress}\n\nevent: message\ndata: {response}\n\n");
                        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                        let chunk = |b: &str| format!("{:x}\r\n{b}\r\n", b.len());
                        if writer.write_all(format!("{head}{}", chunk(&b)).as_bytes()).is_err() {
                            return;
                        }
                        for _ in 0..100 {
                            std::thread::sleep(Duration::from_millis(200));
                            if writer.write_all(chunk(": ping\n\n").as_bytes()).is_err() {
                                return;
                            }
                        }
                        return;
                    }
                    Some("sse-cut") => {
                        let b = format!("event: message\ndata: {progress}\n\n");
                        format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{b}", b.len())
                    }
                    _ => format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nmcp-session-id: session-of-first-caller\r\n\r\n{response}",
                        response.len()
                    ),
                }
            }
            _ => "HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n".to_string(),
        };
        if writer.write_all(out.as_bytes()).is_err() {
            return;
        }
    }
}
