//! The boundary oracle (issue 41): real backends say which spellings they run as one request,
//! and idemgate must execute such a pair at most once, or refuse one before it executes.
//!
//! The panel (tests/oracle/, pinned, `scripts/install-deps.sh oracle-panel`): Flask on Werkzeug's
//! server, Django's runserver, FastAPI under uvicorn, Express, Fastify, Go's net/http ServeMux and a
//! servlet on Debian's Tomcat 10, each with its defaults, each one counting handler on
//! `/v1/payments` and `/v2/orders/<id>` that answers what it read. Each backend sits behind its
//! own Envoy 1.40 with dist/idemgate.wasm, one listener per configuration (`CONFIGS`). In the
//! `mcp` configuration (both routes `protocol: mcp`) the request is an MCP client's JSON-RPC
//! `tools/call` and each backend answers it with a JSON-RPC response echoing its id (what it read
//! is the `result`), which idemgate takes for the call's completion. In `mcp_body_key` the key is
//! in the JSON-RPC body (`params._meta.idempotencyKey`, or the `mcp.key_arguments` argument).
//! With IDEMGATE_ORACLE_MCP_SDK=1 (`make test-oracle-long`) the MCP configurations also ask a real
//! MCP server (`MCP_SDK`, tests/oracle/mcp_backend.py): the official MCP Python SDK pinned for
//! tests/it/mcp_sdk.rs, whose Streamable HTTP transport answers a call as `text/event-stream`, its
//! tool reporting what the SDK read (the id, `_meta`, the arguments as validated); its cells are
//! the table's last section, which `make test` (without it) leaves out of its comparison.
//! IDEMGATE_ORACLE_BACKENDS (comma-separated) asks a part of the panel only, to reproduce its
//! cells (target/oracle/equivalence-part.md; the published table is then left alone).
//!
//! For each pair of spellings (A, B) of one request the oracle sends, through idemgate: A with a
//! fresh key (what the backend read of A), B with another fresh key (what it read of B), then B
//! again with A's key, counting the backend's executions around that last request. The backend's
//! reading of a request is its class: the route that ran and its parameters, the method, the
//! caller's scope header, the key header (or the header `derive_key` derives from), the query and
//! the body as parsed, an MCP call's JSON-RPC `id` left out (the transport's correlation: a client
//! retries a call under a new id); host and path spelling are not in it: they are what varies. The property:
//! when A and B are of one class, B with A's key must not execute. A pair that breaks it is a
//! counterexample, shrunk (spellings dropped one at a time while it still breaks) and printed as
//! the smallest pair of requests. So is a pair the backend parsed apart only by its body (JSON, or
//! a form's fields and files; beyond an MCP call's `id`) whose B with A's key is answered A's
//! replay (`Outcome::Merged`).
//!
//! Two parts: a sweep (every spelling against the canonical request, on every backend and
//! configuration) that writes the equivalence table to target/oracle/equivalence.md (and to
//! docs/equivalence.md with IDEMGATE_ORACLE_WRITE_DOCS=1), and a seeded random search over
//! combinations of spellings (IDEMGATE_ORACLE_SEED, default 41; IDEMGATE_ORACLE_PAIRS pairs per
//! backend and configuration, default 12 in `make test`, 300 in `make test-oracle-long`).

use crate::support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::{free_port, http, repo_root, Envoy, EnvoyOptions, Started};

/// The configurations, each one listener of every backend's Envoy: (name, plugin configuration,
/// the header that carries the key, the header that names the caller).
const CONFIGS: &[(&str, &str, &str, &str)] = &[
    ("defaults", r#"{"scope": {"headers": ["authorization"]}}"#, "idempotency-key", "authorization"),
    (
        "prefixes",
        r#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/v1/payments"}, {"prefix": "/v2/orders/"}]}"#,
        "idempotency-key",
        "authorization",
    ),
    (
        "derive_key",
        r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-op"]}}"#,
        "x-op",
        "authorization",
    ),
    ("scope_header", r#"{"scope": {"headers": ["x-caller"]}}"#, "idempotency-key", "x-caller"),
    // A key derived from the header and the body (`include_body`): two bodies every backend
    // parses alike must derive one key, or one of them be refused.
    (
        "include_body",
        r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-op"], "include_body": true}}"#,
        "x-op",
        "authorization",
    ),
    // `protocol: mcp` routes (docs/mcp.md): the request is a JSON-RPC `tools/call` (`Req::base`).
    (
        "mcp",
        r#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/v1/payments", "protocol": "mcp"}, {"prefix": "/v2/orders/", "protocol": "mcp"}]}"#,
        "idempotency-key",
        "authorization",
    ),
    // `derive_key` on MCP routes: the key derived from `x-op` and the call (tool and arguments).
    (
        "mcp_derive_key",
        r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-op"]}, "routes": [{"prefix": "/v1/payments", "protocol": "mcp"}, {"prefix": "/v2/orders/", "protocol": "mcp"}]}"#,
        "x-op",
        "authorization",
    ),
    // The key in the JSON-RPC body (docs/mcp.md, "Where the key comes from"): on the payments
    // route in `params._meta.idempotencyKey`, on the orders route in the argument named by
    // `mcp.key_arguments`; no key header. Only the body's spellings are sent here (`BODY_KEY_DIMS`).
    (
        "mcp_body_key",
        r#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/v1/payments", "protocol": "mcp", "mcp": {"tools": ["charge"], "key_arguments": ["idempotency_key"]}}, {"prefix": "/v2/orders/", "protocol": "mcp", "mcp": {"tools": ["charge"], "key_arguments": ["idempotency_key"]}}]}"#,
        "idempotency-key",
        "authorization",
    ),
    // A sent key's fingerprint reading form bodies as every parser reads them
    // (`fingerprint.forms: "semantic"`): a replay must answer only a form every backend reads as
    // the first (`Outcome::Merged` otherwise). Only the form bodies' spellings are sent here
    // (`FORM_DIMS`): the other dimensions are the `defaults` configuration's.
    (
        "forms_semantic",
        r#"{"scope": {"headers": ["authorization"]}, "fingerprint": {"forms": "semantic"}}"#,
        "idempotency-key",
        "authorization",
    ),
];

/// The dimensions sent in configuration `forms_semantic`.
const FORM_DIMS: &[&str] = &["form", "multipart"];

/// The dimensions sent in configuration `mcp_body_key` (the others spell what the key header and
/// the route decide, which the `mcp` configuration covers).
const BODY_KEY_DIMS: &[&str] = &["body", "json", "content-type", "protocol"];

/// How a spelling or a sweep base rewrites a request.
type Rewrite = fn(&mut Req);

/// In the sweep, the base request a spelling is compared with, when it is not the canonical one:
/// (spelling name, how the base is rewritten). `-0` is compared with `0`.
const SWEEP_BASES: &[(&str, Rewrite)] = &[
    ("number `-0` (beside `\"amount\":0`)", |r| r.body = r.body.replacen("\"amount\":1", "\"amount\":0", 1)),
    ("key value with `/` escaped (beside a key `a/KEY`)", |r| r.body = r.body.replacen("\"KEY\"", "\"a/KEY\"", 1)),
    ("non-ASCII name %-encoded (`name=\"w%C3%A4hrung\"`)", non_ascii_base),
    ("non-ASCII file name %-encoded (`filename=\"caf%C3%A9.txt\"`)", non_ascii_base),
    ("non-ASCII name in RFC 2231 (`name*=UTF-8''w%C3%A4hrung`)", non_ascii_base),
    ("non-ASCII file name in RFC 2231 (`filename*=UTF-8''caf%C3%A9.txt`)", non_ascii_base),
    ("file name ASCII and in RFC 2231 (`filename=\"cafe.txt\"; filename*=UTF-8''caf%C3%A9.txt`)", non_ascii_base),
];

/// The multipart request with non-ASCII names (`non_ascii_names`), the sweep's base for the
/// spellings of such names.
fn non_ascii_base(r: &mut Req) {
    multipart_edit(r, non_ascii_names)
}

/// The multipart body with its `currency` field named `währung` and its file named `café.txt`,
/// as RFC 7578 and browsers send them: UTF-8 in the quoted parameter.
fn non_ascii_names(b: &str) -> String {
    b.replace("name=\"currency\"", "name=\"währung\"").replace("filename=\"a.txt\"", "filename=\"café.txt\"")
}

/// The MCP configuration's canonical body: a `tools/call` whose arguments are the other
/// configurations' body.
const MCP_BODY: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge","arguments":{"amount":1,"currency":"eur"}}}"#;

/// The canonical form body (configurations other than MCP, the `form` spellings): fields read by
/// name, a space written `+`, a slash and a non-ASCII letter %-encoded, one field repeated.
const FORM_BODY: &str = "amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y";

/// The canonical multipart body's boundary (the `multipart` spellings).
const BOUNDARY: &str = "----idemgate7MA4YWxkTrZu0gW";

/// The canonical multipart/form-data body with `boundary`: text fields `amount`, `currency` and
/// `tag` twice, then a file `doc` (`a.txt`, `text/plain`), each part as browsers write it (CRLF
/// line ends, `Content-Disposition: form-data; name="..."`), no preamble or epilogue.
fn multipart_body(boundary: &str) -> String {
    let mut b = String::new();
    for (name, value) in [("amount", "1"), ("currency", "eur"), ("tag", "x"), ("tag", "y")] {
        b.push_str(&format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"));
    }
    b.push_str(&format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"doc\"; filename=\"a.txt\"\r\nContent-Type: text/plain\r\n\r\nhello\r\n"
    ));
    b.push_str(&format!("--{boundary}--\r\n"));
    b
}

/// The canonical request's body.
#[derive(Clone, Copy, PartialEq)]
enum Body {
    Json,
    Form,
    Multipart,
}

/// The panel: (name, how it runs).
const BACKENDS: &[&str] = &["flask", "django", "fastapi", "express", "fastify", "go", "tomcat", MCP_SDK];

/// The panel's MCP server (tests/oracle/mcp_backend.py): the official MCP Python SDK's own
/// Streamable HTTP transport, answering each `tools/call` as `text/event-stream`. It serves only
/// the MCP configurations (`runs`).
const MCP_SDK: &str = "mcp-python";

/// Whether `backend` is asked in configuration `cname`: the MCP server only in the MCP ones.
fn runs(backend: &str, cname: &str) -> bool {
    backend != MCP_SDK || cname.starts_with("mcp")
}

/// One request, before its key is filled in (`KEY` in a header value is the pair's key).
#[derive(Clone, Debug)]
struct Req {
    method: String,
    path: String,
    query: String,
    host: String,
    /// Send the request line in absolute form (`http://host/path`), HTTP/1.1 only.
    absolute: bool,
    headers: Vec<(String, String)>,
    body: String,
    chunked: bool,
    h2: bool,
}

impl Req {
    /// The canonical request; `mcp`: a JSON-RPC `tools/call` as an MCP client sends it (the
    /// `accept` of the Streamable HTTP transport, the 2026-07-28 routing headers); `body`: the
    /// JSON body, a form (`FORM_BODY`, `application/x-www-form-urlencoded`) or a multipart form
    /// (`multipart_body`, `multipart/form-data`) in its place.
    fn base(orders: bool, key_header: &str, scope_header: &str, mcp: bool, body: Body, body_key: bool) -> Req {
        let scope = if scope_header == "authorization" { "Bearer alice" } else { "alice" };
        let mut r = Req {
            method: "POST".into(),
            path: if orders { "/v2/orders/o%C3%A9".into() } else { "/v1/payments".into() },
            query: "a=1&b=2".into(),
            host: "xn--bcher-kva.test".into(),
            absolute: false,
            headers: vec![
                (scope_header.into(), scope.into()),
                (key_header.into(), "KEY".into()),
                ("content-type".into(), "application/json".into()),
            ],
            body: r#"{"amount":1,"currency":"eur"}"#.into(),
            chunked: false,
            h2: false,
        };
        match body {
            Body::Form if !mcp => {
                r.body = FORM_BODY.into();
                r.headers[2].1 = "application/x-www-form-urlencoded".into();
            }
            Body::Multipart if !mcp => {
                r.body = multipart_body(BOUNDARY);
                r.headers[2].1 = format!("multipart/form-data; boundary={BOUNDARY}");
            }
            _ => {}
        }
        if mcp {
            r.body = MCP_BODY.into();
            if body_key {
                // No key header: the key is in the body (`KEY`, filled in as in the headers).
                r.headers[1] = ("x-note".into(), "n".into());
                r.body = if orders {
                    r.body.replacen("\"currency\":\"eur\"", "\"currency\":\"eur\",\"idempotency_key\":\"KEY\"", 1)
                } else {
                    r.body.replacen("\"arguments\"", "\"_meta\":{\"idempotencyKey\":\"KEY\"},\"arguments\"", 1)
                };
            }
            for (n, v) in [
                ("accept", "application/json, text/event-stream"),
                ("mcp-method", "tools/call"),
                ("mcp-name", "charge"),
            ] {
                r.headers.push((n.into(), v.into()));
            }
        }
        r
    }

    fn target(&self) -> String {
        let q = if self.query.is_empty() { String::new() } else { format!("?{}", self.query) };
        format!("{}{q}", self.path)
    }

    /// The request as a reader can paste it (HTTP/1.1 text, or the HTTP/2 header list).
    fn show(&self, key: &str) -> String {
        let hs: Vec<String> = self.headers.iter().map(|(n, v)| format!("{n}: {}", fill(v, key))).collect();
        let body = fill(&self.body, key);
        if self.h2 {
            format!(
                "HTTP/2 :method={} :path={} :authority={} {} | {}{}",
                self.method,
                self.target(),
                self.host,
                hs.join(" | "),
                body,
                if self.chunked { " (no content-length)" } else { "" }
            )
        } else {
            let t = if self.absolute { format!("http://{}{}", self.host, self.target()) } else { self.target() };
            format!(
                "{} {t} HTTP/1.1 | host: {} | {} | {}{}",
                self.method,
                self.host,
                hs.join(" | "),
                body,
                if self.chunked { " (chunked)" } else { "" }
            )
        }
    }

    fn send(&self, port: u16, key: &str) -> http::Response {
        let headers: Vec<(String, String)> = self.headers.iter().map(|(n, v)| (n.clone(), fill(v, key))).collect();
        let body = fill(&self.body, key);
        if self.h2 {
            let mut hs: Vec<Value> = headers.iter().map(|(n, v)| Value::from(vec![n.as_str(), v.as_str()])).collect();
            if !self.chunked {
                hs.push(Value::from(vec!["content-length".to_string(), body.len().to_string()]));
            }
            let spec = serde_json::json!({"method": self.method, "path": self.target(), "authority": self.host,
                "headers": hs, "body": body});
            let out = Command::new(venv_python())
                .arg(repo_root().join("tests/oracle/h2_send.py"))
                .arg(port.to_string())
                .arg(spec.to_string())
                .output()
                .expect("run h2_send.py");
            let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
            let status = v["status"].as_u64().unwrap_or(0) as u16;
            let rh = v["headers"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|p| (p[0].as_str().unwrap_or("").to_string(), p[1].as_str().unwrap_or("").to_string()))
                        .collect()
                })
                .unwrap_or_default();
            return http::Response { status, headers: rh, body: v["body"].as_str().unwrap_or("").as_bytes().to_vec() };
        }
        let t = if self.absolute { format!("http://{}{}", self.host, self.target()) } else { self.target() };
        let mut text = format!("{} {t} HTTP/1.1\r\nhost: {}\r\n", self.method, self.host);
        for (n, v) in &headers {
            text.push_str(&format!("{n}: {v}\r\n"));
        }
        let mut bytes = if self.chunked {
            text.push_str("transfer-encoding: chunked\r\nconnection: close\r\n\r\n");
            let mut b = text.into_bytes();
            b.extend_from_slice(format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len()).as_bytes());
            b
        } else {
            text.push_str(&format!("content-length: {}\r\nconnection: close\r\n\r\n", body.len()));
            let mut b = text.into_bytes();
            b.extend_from_slice(body.as_bytes());
            b
        };
        bytes.shrink_to_fit();
        // Generous: `make test` runs this beside every other suite on two cores.
        http::raw(port, &bytes, Duration::from_secs(60)).unwrap_or(http::Response {
            status: 0,
            headers: vec![],
            body: vec![],
        })
    }
}

/// `text` with the pair's key in place of `KEY` (a header value, or a body that carries the key),
/// and `KEYESC` the key with its first letter written as a JSON `\uXXXX` escape.
fn fill(text: &str, key: &str) -> String {
    let mut chars = key.chars();
    let escaped = match chars.next() {
        Some(c) => format!("\\u{:04x}{}", c as u32, chars.as_str()),
        None => String::new(),
    };
    text.replace("KEYESC", &escaped).replace("KEY", key)
}

fn venv_python() -> PathBuf {
    repo_root().join("target/oracle-venv/bin/python")
}

/// A spelling: its dimension, its name, and how it rewrites a request.
type Spelling = (&'static str, &'static str, fn(&mut Req));

fn header_mut(r: &mut Req, i: usize) -> &mut (String, String) {
    &mut r.headers[i]
}

/// Every spelling the oracle knows. Index 0 of `headers` is the scope header, 1 the key header,
/// 2 the content type.
const SPELLINGS: &[Spelling] = &[
    ("method", "lower case `post`", |r| r.method = r.method.to_lowercase()),
    ("method", "mixed case `Post`", |r| r.method = "Post".into()),
    ("path", "unreserved byte %-encoded (`/v1/%70ayments`)", |r| {
        r.path = r.path.replacen("/payments", "/%70ayments", 1).replacen("/orders", "/%6Frders", 1)
    }),
    ("path", "%-hex in lower case (`%c3%a9`)", |r| r.path = r.path.replace("%C3%A9", "%c3%a9")),
    ("path", "unreserved escape in lower-case hex (`/v2/%6frders`)", |r| {
        r.path = r.path.replacen("/orders", "/%6frders", 1)
    }),
    ("path", "slash %-encoded (`%2F`)", |r| r.path = r.path.replacen("1/", "1%2F", 1).replacen("2/o", "2%2Fo", 1)),
    ("path", "dot-dot segment (`/x/../`)", |r| {
        r.path = r.path.replacen("1/", "1/x/../", 1).replacen("2/", "2/x/../", 1)
    }),
    ("path", "dot segment (`/./`)", |r| r.path = r.path.replacen("1/", "1/./", 1).replacen("2/", "2/./", 1)),
    ("path", "dot-dot %-encoded (`/x/%2E%2E/`)", |r| {
        r.path = r.path.replacen("1/", "1/x/%2E%2E/", 1).replacen("2/", "2/x/%2E%2E/", 1)
    }),
    ("path", "`;param` on a segment (`/v1;x=1/`)", |r| {
        r.path = r.path.replacen("1/", "1;x=1/", 1).replacen("2/", "2;x=1/", 1)
    }),
    ("path", "`;param` at the end", |r| r.path.push_str(";x=1")),
    ("path", "repeated slash (`//`)", |r| r.path = r.path.replacen("1/", "1//", 1).replacen("2/", "2//", 1)),
    ("path", "trailing slash", |r| r.path.push('/')),
    ("path", "leading `//`", |r| r.path.insert(0, '/')),
    ("path", "upper case (`/V1/PAYMENTS`)", |r| {
        r.path = r.path.replace("/v1/payments", "/V1/PAYMENTS").replace("/v2/orders/", "/V2/ORDERS/")
    }),
    ("path", "backslash %-encoded (`%5C`)", |r| r.path = r.path.replacen("1/", "1%5C", 1).replacen("2/o", "2%5Co", 1)),
    ("path", "NFD form of `é` (`e%CC%81`)", |r| r.path = r.path.replace("%C3%A9", "e%CC%81")),
    ("path", "double %-encoded slash (`%252F`)", |r| {
        r.path = r.path.replacen("1/", "1%252F", 1).replacen("2/o", "2%252Fo", 1)
    }),
    // Bytes HTTP/1.1's parser refuses in a request target; HTTP/2 carries `:path` as any bytes.
    ("path", "raw UTF-8 `é` (not %-encoded)", |r| r.path = r.path.replace("%C3%A9", "é")),
    ("path", "raw space in a segment (`o%C3%A9 `)", |r| {
        r.path = r.path.replacen("/payments", "/payments ", 1).replacen("%C3%A9", "%C3%A9 ", 1)
    }),
    ("path", "raw tab at the end", |r| r.path.push('\t')),
    ("path", "raw UTF-8 `é` over HTTP/2", |r| {
        to_h2(r);
        r.path = r.path.replace("%C3%A9", "é")
    }),
    ("path", "raw space in a segment over HTTP/2", |r| {
        to_h2(r);
        r.path = r.path.replacen("/payments", "/payments ", 1).replacen("%C3%A9", "%C3%A9 ", 1)
    }),
    ("query", "order (`b=2&a=1`)", |r| r.query = "b=2&a=1".into()),
    ("query", "%-encoded name (`%61=1`)", |r| r.query = r.query.replacen("a=", "%61=", 1)),
    ("query", "trailing `&`", |r| r.query.push('&')),
    ("query", "%-encoded value (`b=%32`)", |r| r.query = r.query.replacen("b=2", "b=%32", 1)),
    ("authority", "case (`Xn--Bcher-Kva.TEST`)", |r| {
        r.host = r.host.replace("xn--bcher-kva.test", "Xn--Bcher-Kva.TEST")
    }),
    ("authority", "default port (`:80`)", |r| r.host.push_str(":80")),
    ("authority", "trailing dot", |r| r.host = r.host.replacen(".test", ".test.", 1)),
    ("authority", "absolute-form request line", |r| r.absolute = !r.h2),
    // The canonical host is an IDNA A-label (`bücher.test`): its U-label, raw UTF-8 (HTTP/1.1's
    // `host`, HTTP/2's `:authority`), and the A-label in upper case.
    ("authority", "IDNA: the Unicode form (`bücher.test`)", |r| {
        r.host = r.host.replacen("xn--bcher-kva.test", "bücher.test", 1)
    }),
    ("authority", "IDNA: the Unicode form over HTTP/2", |r| {
        to_h2(r);
        r.host = r.host.replacen("xn--bcher-kva.test", "bücher.test", 1)
    }),
    ("authority", "IDNA: punycode in upper case (`XN--BCHER-KVA.TEST`)", |r| {
        r.host = r.host.replacen("xn--bcher-kva.test", "XN--BCHER-KVA.TEST", 1)
    }),
    ("key", "header name case (`Idempotency-Key`)", |r| {
        let h = header_mut(r, 1);
        h.0 = h.0.split('-').map(|w| format!("{}{}", w[..1].to_uppercase(), &w[1..])).collect::<Vec<_>>().join("-")
    }),
    ("key", "value with spaces around", |r| header_mut(r, 1).1 = " KEY  ".into()),
    ("key", "header repeated", |r| {
        let h = r.headers[1].clone();
        r.headers.push(h)
    }),
    ("key", "value comma-joined (`k, k`)", |r| header_mut(r, 1).1 = "KEY, KEY".into()),
    ("scope", "header repeated", |r| {
        let h = r.headers[0].clone();
        r.headers.push(h)
    }),
    ("scope", "header name case", |r| {
        let h = header_mut(r, 0);
        h.0 = h.0.to_uppercase()
    }),
    ("scope", "trailing whitespace", |r| header_mut(r, 0).1.push_str("  ")),
    ("content-type", "`; charset=utf-8`", |r| header_mut(r, 2).1.push_str("; charset=utf-8")),
    ("content-type", "case (`Application/JSON`)", |r| {
        if is_json(r) {
            header_mut(r, 2).1 = "Application/JSON".into()
        }
    }),
    ("body", "chunked framing", |r| r.chunked = true),
    ("body", "whitespace (`{\"amount\": 1, ...}`)", |r| {
        if is_json(r) {
            r.body = r.body.replace(":", ": ").replace(",", ", ")
        }
    }),
    // Every object's members in reverse order, as written (escapes, numbers, the key in `_meta`
    // or a key argument kept); a repeated name's members keep their order among themselves.
    ("body", "member order", |r| json_edit(r, reorder_members)),
    ("body", "number `1.0`", |r| r.body = r.body.replacen("\"amount\":1", "\"amount\":1.0", 1)),
    ("body", "number `1e0`", |r| r.body = r.body.replacen("\"amount\":1", "\"amount\":1e0", 1)),
    ("body", "string escape (`\\u0065ur`)", |r| r.body = r.body.replacen("\"eur\"", "\"\\u0065ur\"", 1)),
    ("body", "duplicate member (`\"currency\":\"usd\",\"currency\":\"eur\"`)", |r| {
        r.body = r.body.replacen("\"currency\":\"eur\"", "\"currency\":\"usd\",\"currency\":\"eur\"", 1)
    }),
    ("body", "JSON-RPC id `7.0`", |r| r.body = r.body.replacen("\"id\":7", "\"id\":7.0", 1)),
    ("body", "JSON-RPC id as a string (`\"7\"`)", |r| r.body = r.body.replacen("\"id\":7", "\"id\":\"7\"", 1)),
    // JSON spellings of the key sources (issue 41): names and values a JSON parser reads alike,
    // and repeated names, which parsers read differently. Each leaves a body without its target
    // alone (`-` in the table where the canonical body has none).
    ("json", "a BOM before the document", |r| {
        if is_json(r) {
            r.body.insert(0, '\u{feff}')
        }
    }),
    ("json", "whitespace around the document (`\\r\\n\\t`)", |r| {
        if is_json(r) {
            r.body = format!("\r\n\t{}\r\n", r.body)
        }
    }),
    ("json", "member name escaped (`\"\\u0063urrency\"`)", |r| {
        json_edit(r, |b| b.replacen("\"currency\":", "\"\\u0063urrency\":", 1))
    }),
    ("json", "member name escaped, hex in upper case (`\"\\u006Dethod\"`, `\"\\u0061mount\"`)", |r| {
        json_edit(r, |b| {
            b.replacen("\"amount\":", "\"\\u0061mount\":", 1).replacen("\"method\":", "\"\\u006Dethod\":", 1)
        })
    }),
    ("json", "number `1E0`", |r| r.body = r.body.replacen("\"amount\":1", "\"amount\":1E0", 1)),
    ("json", "number `10e-1`", |r| r.body = r.body.replacen("\"amount\":1", "\"amount\":10e-1", 1)),
    ("json", "number `-0` (beside `\"amount\":0`)", |r| {
        r.body = r.body.replacen("\"amount\":0", "\"amount\":-0", 1).replacen("\"amount\":1", "\"amount\":-0", 1)
    }),
    ("json", "duplicate member, the canonical value first (`\"currency\":\"eur\",\"currency\":\"usd\"`)", |r| {
        json_edit(r, |b| b.replacen("\"currency\":\"eur\"", "\"currency\":\"eur\",\"currency\":\"usd\"", 1))
    }),
    ("json", "duplicate member, the same value twice", |r| {
        json_edit(r, |b| b.replacen("\"currency\":\"eur\"", "\"currency\":\"eur\",\"currency\":\"eur\"", 1))
    }),
    // One name, the second spelled with an escape: the panel runs the last (the canonical value);
    // a first-value reader (pysimdjson's `Parser().parse`) the first.
    ("json", "duplicate member, the second name escaped (`\"currency\":\"usd\",\"\\u0063urrency\":\"eur\"`)", |r| {
        json_edit(r, |b| b.replacen("\"currency\":\"eur\"", "\"currency\":\"usd\",\"\\u0063urrency\":\"eur\"", 1))
    }),
    // The JSON-RPC call's own members (MCP bodies only).
    ("json", "`\"\\u006dethod\"`", |r| json_edit(r, |b| b.replacen("\"method\":", "\"\\u006dethod\":", 1))),
    ("json", "`\"tools\\/call\"` (escaped `/`)", |r| {
        json_edit(r, |b| b.replacen("\"tools/call\"", "\"tools\\/call\"", 1))
    }),
    ("json", "`\"\\u0070arams\"`", |r| json_edit(r, |b| b.replacen("\"params\":", "\"\\u0070arams\":", 1))),
    ("json", "tool name escaped (`\"\\u0063harge\"`)", |r| {
        json_edit(r, |b| b.replacen("\"charge\"", "\"\\u0063harge\"", 1))
    }),
    ("json", "`\"\\u0061rguments\"`", |r| json_edit(r, |b| b.replacen("\"arguments\":", "\"\\u0061rguments\":", 1))),
    ("json", "duplicate `method` (`\"method\":\"ping\",\"method\":\"tools/call\"`)", |r| {
        json_edit(r, |b| b.replacen("\"method\":\"tools/call\"", "\"method\":\"ping\",\"method\":\"tools/call\"", 1))
    }),
    ("json", "duplicate tool name (`\"name\":\"refund\",\"name\":\"charge\"`)", |r| {
        json_edit(r, |b| b.replacen("\"name\":\"charge\"", "\"name\":\"refund\",\"name\":\"charge\"", 1))
    }),
    ("json", "duplicate `params` (an empty one first)", |r| {
        json_edit(r, |b| b.replacen("\"params\":", "\"params\":{},\"params\":", 1))
    }),
    // The key in the body (configuration `mcp_body_key`): `_meta.idempotencyKey` or the key argument.
    ("json", "key source's name escaped (`\"\\u0069dempotencyKey\"`, `\"\\u0069dempotency_key\"`)", |r| {
        json_edit(r, |b| {
            b.replacen("\"idempotencyKey\":", "\"\\u0069dempotencyKey\":", 1).replacen(
                "\"idempotency_key\":",
                "\"\\u0069dempotency_key\":",
                1,
            )
        })
    }),
    ("json", "`\"\\u005fmeta\"`", |r| json_edit(r, |b| b.replacen("\"_meta\":", "\"\\u005fmeta\":", 1))),
    ("json", "key value's first letter escaped", |r| json_edit(r, |b| b.replacen("\"KEY\"", "\"KEYESC\"", 1))),
    ("json", "key value with `/` escaped (beside a key `a/KEY`)", |r| {
        json_edit(r, |b| b.replacen("\"a/KEY\"", "\"KEY\"", 1).replacen("\"KEY\"", "\"a\\/KEY\"", 1))
    }),
    ("json", "duplicate key, another first (`\"zz\"`, then the key)", |r| {
        json_edit(r, |b| {
            b.replacen("\"idempotencyKey\":\"KEY\"", "\"idempotencyKey\":\"zz\",\"idempotencyKey\":\"KEY\"", 1)
                .replacen("\"idempotency_key\":\"KEY\"", "\"idempotency_key\":\"zz\",\"idempotency_key\":\"KEY\"", 1)
        })
    }),
    ("json", "duplicate key, another last (the key, then `\"zz\"`)", |r| {
        json_edit(r, |b| {
            b.replacen("\"idempotencyKey\":\"KEY\"", "\"idempotencyKey\":\"KEY\",\"idempotencyKey\":\"zz\"", 1)
                .replacen("\"idempotency_key\":\"KEY\"", "\"idempotency_key\":\"KEY\",\"idempotency_key\":\"zz\"", 1)
        })
    }),
    ("json", "duplicate `_meta` (an empty one last)", |r| {
        json_edit(r, |b| {
            if b.contains("\"_meta\"") {
                b.replacen("\"arguments\":", "\"_meta\":{},\"arguments\":", 1)
            } else {
                b.to_string()
            }
        })
    }),
    // A form body (`FORM_BODY`, `Req::base` with `form`): each spelling leaves a JSON body alone.
    ("form", "field order (`currency=eur&...&amount=1`)", |r| {
        if is_form(r) && r.body.contains("amount=1&") {
            r.body = format!("{}&amount=1", r.body.replacen("amount=1&", "", 1))
        }
    }),
    ("form", "space as `%20` (`a%20b`)", |r| form_edit(r, |b| b.replace("a+b", "a%20b"))),
    ("form", "unreserved bytes %-encoded (`%61mount=1`, `=%65ur`)", |r| {
        form_edit(r, |b| b.replacen("amount=", "%61mount=", 1).replacen("=eur", "=%65ur", 1))
    }),
    ("form", "%-hex in lower case (`%2f`, `%c3%a9`)", |r| {
        form_edit(r, |b| b.replace("%2F", "%2f").replace("%C3%A9", "%c3%a9"))
    }),
    ("form", "slash not %-encoded (`a+b/caf`)", |r| form_edit(r, |b| b.replace("%2F", "/"))),
    ("form", "raw UTF-8 `é` (not %-encoded)", |r| form_edit(r, |b| b.replace("%C3%A9", "é"))),
    ("form", "trailing `&`", |r| form_edit(r, |b| format!("{b}&"))),
    ("form", "leading `&`", |r| form_edit(r, |b| format!("&{b}"))),
    ("form", "empty pair (`&&`)", |r| form_edit(r, |b| b.replacen("&currency", "&&currency", 1))),
    ("form", "content type `; charset=utf-8`", |r| {
        if is_form(r) {
            header_mut(r, 2).1.push_str("; charset=utf-8")
        }
    }),
    ("form", "content type case (`Application/X-WWW-Form-URLEncoded`)", |r| {
        if is_form(r) {
            header_mut(r, 2).1 = "Application/X-WWW-Form-URLEncoded".into()
        }
    }),
    ("form", "a repeated field's values in another order (`tag=y&tag=x`)", |r| {
        form_edit(r, |b| b.replace("tag=x&tag=y", "tag=y&tag=x"))
    }),
    ("form", "field order over HTTP/2", |r| {
        if is_form(r) && r.body.contains("amount=1&") {
            to_h2(r);
            r.body = format!("{}&amount=1", r.body.replacen("amount=1&", "", 1))
        }
    }),
    ("form", "space as `%20` over HTTP/2", |r| {
        if is_form(r) {
            to_h2(r);
            r.body = r.body.replace("a+b", "a%20b")
        }
    }),
    // A multipart body (`multipart_body`, `Req::base` with `Body::Multipart`): each spelling leaves
    // any other body alone.
    ("multipart", "another boundary string", |r| {
        if is_multipart(r) {
            r.body = r.body.replace(BOUNDARY, "XyZzy42");
            header_mut(r, 2).1 = header_mut(r, 2).1.replace(BOUNDARY, "XyZzy42");
        }
    }),
    ("multipart", "boundary quoted in the content type (`boundary=\"...\"`)", |r| {
        if is_multipart(r) {
            header_mut(r, 2).1 = header_mut(r, 2).1.replace(&format!("={BOUNDARY}"), &format!("=\"{BOUNDARY}\""));
        }
    }),
    ("multipart", "content type case (`Multipart/Form-Data; Boundary=`)", |r| {
        if is_multipart(r) {
            let h = header_mut(r, 2);
            h.1 = h.1.replace("multipart/form-data; boundary=", "Multipart/Form-Data; Boundary=");
        }
    }),
    ("multipart", "part order (`amount` last)", |r| multipart_edit(r, multipart_amount_last)),
    ("multipart", "header name in lower case (`content-disposition`)", |r| {
        multipart_edit(r, |b| b.replace("Content-Disposition:", "content-disposition:"))
    }),
    ("multipart", "header name in upper case (`CONTENT-DISPOSITION`)", |r| {
        multipart_edit(r, |b| b.replace("Content-Disposition:", "CONTENT-DISPOSITION:"))
    }),
    ("multipart", "no space after the header's colon (`Content-Disposition:form-data`)", |r| {
        multipart_edit(r, |b| b.replace("Content-Disposition: ", "Content-Disposition:"))
    }),
    ("multipart", "disposition type case (`Form-Data`)", |r| {
        multipart_edit(r, |b| b.replace(": form-data;", ": Form-Data;"))
    }),
    ("multipart", "name unquoted (`name=amount`)", |r| {
        multipart_edit(r, |b| b.replace("name=\"amount\"", "name=amount"))
    }),
    ("multipart", "no space after `;` (`form-data;name=\"amount\"`)", |r| {
        multipart_edit(r, |b| b.replace("form-data; name=\"amount\"", "form-data;name=\"amount\""))
    }),
    ("multipart", "parameter name case (`Name=\"amount\"`)", |r| {
        multipart_edit(r, |b| b.replace("name=\"amount\"", "Name=\"amount\""))
    }),
    ("multipart", "file parameters in another order (`filename=...; name=...`)", |r| {
        multipart_edit(r, |b| b.replace("name=\"doc\"; filename=\"a.txt\"", "filename=\"a.txt\"; name=\"doc\""))
    }),
    ("multipart", "the file part's content type another (`application/octet-stream`)", |r| {
        multipart_edit(r, |b| b.replace("Content-Type: text/plain", "Content-Type: application/octet-stream"))
    }),
    ("multipart", "the file part without a content type", |r| {
        multipart_edit(r, |b| b.replace("Content-Type: text/plain\r\n", ""))
    }),
    ("multipart", "a text part with `Content-Type: text/plain`", |r| {
        multipart_edit(r, |b| b.replace("name=\"currency\"\r\n", "name=\"currency\"\r\nContent-Type: text/plain\r\n"))
    }),
    ("multipart", "a preamble before the first boundary", |r| multipart_edit(r, |b| format!("preamble\r\n{b}"))),
    ("multipart", "an epilogue after the closing boundary", |r| multipart_edit(r, |b| format!("{b}epilogue\r\n"))),
    ("multipart", "no CRLF after the closing boundary", |r| {
        multipart_edit(r, |b| b.trim_end_matches("\r\n").to_string())
    }),
    ("multipart", "whitespace after a boundary (transport padding)", |r| {
        multipart_edit(r, |b| b.replace(&format!("--{BOUNDARY}\r\n"), &format!("--{BOUNDARY}  \r\n")))
    }),
    ("multipart", "LF line ends (no CR)", |r| multipart_edit(r, |b| b.replace("\r\n", "\n"))),
    ("multipart", "a repeated field's values in another order (`tag` y, x)", |r| {
        multipart_edit(r, |b| {
            b.replacen("\r\n\r\nx\r\n", "\r\n\r\nY\r\n", 1).replacen("\r\n\r\ny\r\n", "\r\n\r\nx\r\n", 1).replacen(
                "\r\n\r\nY\r\n",
                "\r\n\r\ny\r\n",
                1,
            )
        })
    }),
    ("multipart", "another file name (`b.txt`)", |r| {
        multipart_edit(r, |b| b.replace("filename=\"a.txt\"", "filename=\"b.txt\""))
    }),
    // Non-ASCII names (issue 41): RFC 7578 sends them as UTF-8 as is (`non_ascii_names`); the
    // others respell that body (the sweep sends each beside it, `SWEEP_BASES`), and leave a body
    // with ASCII names alone. No backend of the panel decodes %-escapes in a name or a file name
    // (apart everywhere; a replay would be `MERGED`). RFC 2231 `name*` and `filename*`: Flask,
    // Django, Fastify, Go and Tomcat read `name*=UTF-8''w%C3%A4hrung` and
    // `filename*=UTF-8''caf%C3%A9.txt` as the raw UTF-8 name, and with `include_body` each
    // executed twice there while the key was derived from the bytes (14 TWICE cells, seed 41,
    // 2026-12-07); `multipart::read_disposition` reads them since.
    ("multipart", "non-ASCII names as UTF-8 (`name=\"währung\"`, `filename=\"café.txt\"`)", |r| {
        multipart_edit(r, non_ascii_names)
    }),
    ("multipart", "non-ASCII name %-encoded (`name=\"w%C3%A4hrung\"`)", |r| {
        multipart_edit(r, |b| b.replace("name=\"währung\"", "name=\"w%C3%A4hrung\""))
    }),
    ("multipart", "non-ASCII file name %-encoded (`filename=\"caf%C3%A9.txt\"`)", |r| {
        multipart_edit(r, |b| b.replace("filename=\"café.txt\"", "filename=\"caf%C3%A9.txt\""))
    }),
    ("multipart", "non-ASCII name in RFC 2231 (`name*=UTF-8''w%C3%A4hrung`)", |r| {
        multipart_edit(r, |b| b.replace("name=\"währung\"", "name*=UTF-8''w%C3%A4hrung"))
    }),
    ("multipart", "non-ASCII file name in RFC 2231 (`filename*=UTF-8''caf%C3%A9.txt`)", |r| {
        multipart_edit(r, |b| b.replace("filename=\"café.txt\"", "filename*=UTF-8''caf%C3%A9.txt"))
    }),
    ("multipart", "file name ASCII and in RFC 2231 (`filename=\"cafe.txt\"; filename*=UTF-8''caf%C3%A9.txt`)", |r| {
        multipart_edit(r, |b| {
            b.replace("filename=\"café.txt\"", "filename=\"cafe.txt\"; filename*=UTF-8''caf%C3%A9.txt")
        })
    }),
    ("multipart", "part order over HTTP/2", |r| {
        if is_multipart(r) {
            to_h2(r);
            r.body = multipart_amount_last(&r.body);
        }
    }),
    ("multipart", "another boundary string over HTTP/2", |r| {
        if is_multipart(r) {
            to_h2(r);
            r.body = r.body.replace(BOUNDARY, "XyZzy42");
            header_mut(r, 2).1 = header_mut(r, 2).1.replace(BOUNDARY, "XyZzy42");
        }
    }),
    ("protocol", "HTTP/2", to_h2),
];

/// The body is the canonical multipart body (`multipart_body`), respelled.
fn is_multipart(r: &Req) -> bool {
    r.headers.get(2).is_some_and(|h| h.1.to_ascii_lowercase().starts_with("multipart/"))
}

/// A multipart body rewritten by `f` (any other body left alone).
fn multipart_edit(r: &mut Req, f: impl Fn(&str) -> String) {
    if is_multipart(r) {
        r.body = f(&r.body)
    }
}

/// The multipart body with its `amount` part moved to the end (before the closing delimiter),
/// whatever its boundary, padding and line ends.
fn multipart_amount_last(b: &str) -> String {
    let Some(delim) = b.lines().find(|l| l.starts_with("--")).map(|l| l.trim_end_matches(['\r', ' ', '\t'])) else {
        return b.to_string();
    };
    // The preamble, the parts (each from after its delimiter), and the close (`--` and on).
    let mut pieces: Vec<&str> = b.split(delim).collect();
    let Some(at) = pieces.iter().position(|p| p.contains("\"amount\"") || p.contains("=amount")) else {
        return b.to_string();
    };
    if at == 0 || at + 1 >= pieces.len() {
        return b.to_string();
    }
    let part = pieces.remove(at);
    let close = pieces.len() - 1;
    pieces.insert(close, part);
    pieces.join(delim)
}

/// The body is JSON (the canonical JSON or MCP body, respelled).
fn is_json(r: &Req) -> bool {
    r.body.trim_start_matches(['\u{feff}', ' ', '\t', '\r', '\n']).starts_with('{')
}

/// A JSON body rewritten by `f` (any other body left alone).
fn json_edit(r: &mut Req, f: impl Fn(&str) -> String) {
    if is_json(r) {
        r.body = f(&r.body)
    }
}

/// `json` with every object's members in reverse order, each member's text as written; the
/// members of one name (compared decoded) move together, in their order. Anything that is not
/// an object is copied; text the scanner cannot read is returned unchanged.
fn reorder_members(json: &str) -> String {
    let b = json.as_bytes();
    let mut out = String::with_capacity(json.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'{' {
            match reordered_object(json, i) {
                Some((text, end)) => {
                    out.push_str(&text);
                    i = end;
                }
                None => return json.to_string(),
            }
        } else if b[i] == b'"' {
            let end = string_end(b, i);
            out.push_str(&json[i..end]);
            i = end;
        } else {
            let next = json[i..].chars().next().map_or(1, char::len_utf8);
            out.push_str(&json[i..i + next]);
            i += next;
        }
    }
    out
}

/// The end (one past the closing quote) of the JSON string starting at `at`.
fn string_end(b: &[u8], at: usize) -> usize {
    let mut i = at + 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    b.len()
}

/// The end of the JSON value starting at `at` (an object, an array, a string or a scalar).
fn value_end(b: &[u8], at: usize) -> usize {
    let mut depth = 0usize;
    let mut i = at;
    while i < b.len() {
        match b[i] {
            b'"' => {
                i = string_end(b, i);
                if depth == 0 {
                    return i;
                }
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                if depth == 0 {
                    return i;
                }
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            b',' if depth == 0 => return i,
            _ => {}
        }
        i += 1;
    }
    b.len()
}

/// The object starting at `at` with its members reordered (`reorder_members`), and its end.
fn reordered_object(json: &str, at: usize) -> Option<(String, usize)> {
    let b = json.as_bytes();
    let mut members: Vec<(String, String)> = vec![];
    let mut i = at + 1;
    loop {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        match b.get(i)? {
            b'}' => break,
            b',' => i += 1,
            b'"' => {
                let name_end = string_end(b, i);
                let name: String = serde_json::from_str(&json[i..name_end]).ok()?;
                let colon = name_end + json[name_end..].find(':')?;
                let vstart = colon + 1 + json[colon + 1..].len() - json[colon + 1..].trim_start().len();
                let vend = value_end(b, vstart);
                let value = reorder_members(&json[vstart..vend]);
                members.push((name, format!("{}{value}", &json[i..vstart])));
                i = vend;
            }
            _ => return None,
        }
    }
    // The names in order of first appearance, reversed; each name's members in their order.
    let mut names: Vec<&str> = vec![];
    for (n, _) in &members {
        if !names.contains(&n.as_str()) {
            names.push(n);
        }
    }
    let texts: Vec<&str> =
        names.iter().rev().flat_map(|n| members.iter().filter(move |(m, _)| m == n).map(|(_, t)| t.as_str())).collect();
    Some((format!("{{{}}}", texts.join(",")), i + 1))
}

/// The body is the canonical form (`FORM_BODY`), respelled.
fn is_form(r: &Req) -> bool {
    !is_json(r) && !is_multipart(r) && r.body.contains("currency")
}

/// A form body rewritten by `f` (a JSON body left alone).
fn form_edit(r: &mut Req, f: impl Fn(&str) -> String) {
    if is_form(r) {
        r.body = f(&r.body)
    }
}

/// The request over HTTP/2 (h2c): header names in lower case, no absolute form.
fn to_h2(r: &mut Req) {
    r.h2 = true;
    r.absolute = false;
    for h in &mut r.headers {
        h.0 = h.0.to_lowercase();
    }
}

fn apply(base: &Req, spellings: &[usize]) -> Req {
    let mut r = base.clone();
    // HTTP/2 first, so that a later header spelling is the one sent.
    let mut order: Vec<usize> = spellings.to_vec();
    order.sort_by_key(|&i| !SPELLINGS[i].1.contains("HTTP/2"));
    for i in order {
        (SPELLINGS[i].2)(&mut r);
    }
    r
}

/// One backend: its process, its port, its Envoy.
struct Backend {
    name: &'static str,
    child: Child,
    port: u16,
    envoy: Option<Envoy>,
    /// Each configuration's listener port.
    listeners: Vec<u16>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if self.name == "tomcat" {
            // tests/oracle/tomcat.sh's CATALINA_BASE for this run.
            let _ = std::fs::remove_dir_all(repo_root().join(format!("target/oracle/tomcat-{}", self.port)));
        }
    }
}

fn start_backend(name: &'static str) -> Backend {
    start_backend_with(name, CONFIGS)
}

/// `start_backend` behind an Envoy with one listener per configuration of `configs`.
fn start_backend_with(name: &'static str, configs: &[(&str, &str, &str, &str)]) -> Backend {
    let port = free_port();
    let root = repo_root();
    let mut cmd = match name {
        "express" | "fastify" => {
            let mut c = Command::new("node");
            c.arg(root.join("tests/oracle/backend.mjs"))
                .arg(name)
                .arg(port.to_string())
                .arg(root.join("target/oracle-node"));
            c
        }
        "go" => {
            let bin = root.join("target/oracle/backend-go");
            let built = Command::new("go")
                .args(["build", "-o"])
                .arg(&bin)
                .arg(root.join("tests/oracle/backend.go"))
                .env("GOCACHE", root.join("target/oracle/gocache"))
                .env("GO111MODULE", "off")
                .status()
                .expect("go build (scripts/install-deps.sh oracle-panel installs golang-go)");
            assert!(built.success(), "go build tests/oracle/backend.go");
            let mut c = Command::new(bin);
            c.arg(port.to_string());
            c
        }
        "tomcat" => {
            let mut c = Command::new(root.join("tests/oracle/tomcat.sh"));
            c.arg(port.to_string()).arg(root.join(format!("target/oracle/tomcat-{port}")));
            c
        }
        MCP_SDK => {
            // The MCP SDK pinned for tests/it/mcp_sdk.rs (tests/mcp/requirements.txt).
            let python = root.join("target/mcp-venv/bin/python");
            assert!(python.exists(), "{} is missing: run scripts/install-deps.sh mcp-sdk", python.display());
            let mut c = Command::new(python);
            c.arg(root.join("tests/oracle/mcp_backend.py")).arg(port.to_string());
            c
        }
        _ => {
            let python = venv_python();
            assert!(python.exists(), "{} is missing: run scripts/install-deps.sh oracle-panel", python.display());
            let mut c = Command::new(python);
            c.arg(root.join("tests/oracle/backends.py")).arg(name).arg(port.to_string());
            c
        }
    };
    let mut child =
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("start a backend");
    let out = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).expect("read the backend's port line");
    let mut b = Backend { name, child, port, envoy: None, listeners: vec![] };
    // Bounded by count: 2400 polls 50 ms apart (Tomcat on two loaded cores takes seconds).
    support::wait_for(&format!("{name} answering /__count"), 2400, || {
        http::get(port, "/__count").is_ok_and(|r| r.status == 200)
    });
    // Envoy starts again on fresh ports when one was taken before it bound it (the extra
    // listeners' ports are picked here; a few attempts at most).
    for attempt in 0..5 {
        b.listeners = configs.iter().skip(1).map(|_| free_port()).collect();
        let mut o = EnvoyOptions::new(configs.first().map_or("{}", |c| c.1), port);
        o.extra_listeners = configs.iter().skip(1).zip(&b.listeners).map(|(c, p)| (*p, c.1.to_string())).collect();
        o.wasm_log_level = "error".into();
        match Envoy::try_start(&o) {
            Started::Ready(envoy) => {
                b.listeners.insert(0, envoy.port);
                b.envoy = Some(*envoy);
                return b;
            }
            Started::Exited { log, .. } if log.contains("Address already in use") && attempt < 4 => continue,
            Started::Exited { code, log } => panic!("{name}: envoy exited ({code:?}); log:\n{log}"),
        }
    }
    unreachable!("the last attempt returns or panics")
}

fn count(b: &Backend) -> u64 {
    let r = http::get(b.port, "/__count").expect("GET /__count");
    serde_json::from_slice::<Value>(&r.body).ok().and_then(|v| v["count"].as_u64()).expect("count")
}

/// What the backend read of one request: its class, or why it has none.
#[derive(Clone, Debug, PartialEq)]
enum Reading {
    /// The handler ran: the fields of its class.
    Ran(BTreeMap<&'static str, Value>),
    /// idemgate refused it before anything executed: 400 and the problem.
    Refused(String),
    /// Not run: the answer (Envoy's refusal, the backend's 404 or redirect).
    NotRun(u16, String),
}

/// idemgate's refusal in an answer: the RFC 9457 problem's type, or on an MCP route the JSON-RPC
/// error's code and type (`-32002 key-reused`); empty when the answer is neither.
fn refusal(r: &http::Response) -> String {
    let problem = r.problem();
    if !problem.is_empty() {
        return problem;
    }
    let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    match (v["error"]["code"].as_i64(), v["error"]["data"]["type"].as_str()) {
        (Some(code), Some(t)) => match t.strip_prefix("urn:idemgate:problem:") {
            Some(slug) => format!("{code} {slug}"),
            None => String::new(),
        },
        _ => String::new(),
    }
}

/// An answer's JSON: its body, or for an event stream (`text/event-stream`, the MCP SDK's answer
/// to a call) the message in its `data:` lines; `key` read as `KEY`.
fn answer_json(r: &http::Response, key: &str) -> Value {
    let text = r.body_text().replace(key, "KEY");
    let sse = r.header("content-type").is_some_and(|c| c.to_ascii_lowercase().starts_with("text/event-stream"));
    if !sse {
        return serde_json::from_str(&text).unwrap_or(Value::Null);
    }
    let data: Vec<&str> =
        text.lines().filter_map(|l| l.strip_prefix("data:")).map(|d| d.strip_prefix(' ').unwrap_or(d)).collect();
    serde_json::from_str(&data.join("\n")).unwrap_or(Value::Null)
}

/// What a backend read, from its answer: the object itself, or an MCP call's JSON-RPC `result`
/// (the panel's web apps put it there; the MCP SDK's tool result carries it as its structured
/// content or as the JSON text of its first content block).
fn what_was_read(mut v: Value) -> Value {
    if v["route"].is_string() {
        return v;
    }
    let mut result = v["result"].take();
    if result["route"].is_string() {
        return result;
    }
    if result["structuredContent"]["route"].is_string() {
        return result["structuredContent"].take();
    }
    result["content"][0]["text"].as_str().and_then(|t| serde_json::from_str(t).ok()).unwrap_or(Value::Null)
}

fn reading(r: &http::Response, key_header: &str, scope_header: &str, key: &str) -> Reading {
    // The web apps answer 201; the MCP SDK answers a call 200 (its result in an event stream).
    if r.status == 201 || r.status == 200 {
        // The pair's requests carry different fresh keys: the key read is compared as `KEY`.
        let v = what_was_read(answer_json(r, key));
        if v["route"].is_string() {
            let mut m = BTreeMap::new();
            for f in ["route", "params", "method", "query", "body"] {
                m.insert(f, v[f].clone());
            }
            m.insert("key", v[key_header].clone());
            m.insert("scope", v[scope_header].clone());
            return Reading::Ran(m);
        }
    }
    let problem = refusal(r);
    if !problem.is_empty() && r.status < 500 {
        return Reading::Refused(format!("{} {problem}", r.status));
    }
    // Envoy adds x-envoy-upstream-service-time to what the upstream answered, never to its own.
    let who = if r.header("x-envoy-upstream-service-time").is_some() { "backend" } else { "envoy" };
    Reading::NotRun(r.status, who.into())
}

/// The outcome of one pair on one backend and configuration.
#[derive(Clone, Debug)]
enum Outcome {
    /// Both ran, alike, and B with A's key did not execute: idemgate's answer to it.
    Once(String),
    /// One of them refused by idemgate (problem).
    Refused(String),
    /// The backend read them apart (the first field that differs), or did not run one.
    Apart(String),
    /// Counterexample: alike, and B with A's key executed again.
    Twice(String),
    /// Counterexample: the backend parsed the two bodies apart (JSON beyond the JSON-RPC `id`,
    /// which is no part of an MCP call, or a form), and B with A's key was answered A's replay: idemgate
    /// merged two requests the backend keeps apart.
    Merged(String),
    /// The spelling does not apply to this route (the request is the canonical one).
    Inapplicable,
}

impl Outcome {
    fn is_counterexample(&self) -> bool {
        matches!(self, Outcome::Twice(_) | Outcome::Merged(_))
    }
}

/// A body as the backend parsed it (a JSON object, or a form's `{"form", "files"}`) without its
/// top-level `id` (an MCP call's transport id); None for a body it did not parse as an object
/// (Tomcat's JSON text).
fn parsed_json_body(v: &Value) -> Option<Value> {
    let mut o = v.as_object()?.clone();
    o.remove("id");
    Some(Value::Object(o))
}

/// How many times in all a pair is sent when Envoy itself answers one of them 5xx (`Probe::run`).
const TRIES_ON_ENVOY_5XX: usize = 4;

struct Probe<'a> {
    b: &'a Backend,
    cfg: usize,
    seq: u64,
}

impl Probe<'_> {
    fn key(&mut self) -> String {
        self.seq += 1;
        format!("o-{}-{}-{}-{}", self.b.name, CONFIGS[self.cfg].0, std::process::id(), self.seq)
    }

    /// The pair's outcome. Envoy's own 5xx for one of them (an upstream timeout or reset on a
    /// loaded machine) says nothing of the spellings: the pair is sent again with new keys, at
    /// most `TRIES_ON_ENVOY_5XX` times in all (bounded by count); one that persists is published.
    fn run(&mut self, a: &Req, bq: &Req) -> Outcome {
        let mut out = self.run_once(a, bq);
        for _ in 1..TRIES_ON_ENVOY_5XX {
            match &out {
                Outcome::Apart(why) if why.starts_with("not run: 5") && why.ends_with(" from envoy") => {
                    out = self.run_once(a, bq)
                }
                _ => break,
            }
        }
        out
    }

    fn run_once(&mut self, a: &Req, bq: &Req) -> Outcome {
        let (_, _, kh, sh) = CONFIGS[self.cfg];
        let port = self.b.listeners[self.cfg];
        let ka = self.key();
        let ra = reading(&a.send(port, &ka), kh, sh, &ka);
        let kb = self.key();
        let rb = reading(&bq.send(port, &kb), kh, sh, &kb);
        match (&ra, &rb) {
            (Reading::Refused(p), _) | (_, Reading::Refused(p)) => return Outcome::Refused(p.clone()),
            (Reading::NotRun(s, w), _) | (_, Reading::NotRun(s, w)) => {
                return Outcome::Apart(format!("not run: {s} from {w}"))
            }
            (Reading::Ran(x), Reading::Ran(y)) => {
                if let Some(f) = x.keys().find(|f| x[*f] != y[*f]) {
                    let only_body = x.keys().all(|g| *g == "body" || x[*g] == y[*g]);
                    match (parsed_json_body(&x["body"]), parsed_json_body(&y["body"])) {
                        // Only an MCP call's JSON-RPC id differs (`7` and `"7"`): one tools/call,
                        // which clients retry under a new id: B with A's key must not execute
                        // (below), whatever id it carries.
                        (Some(px), Some(py)) if only_body && px == py => {}
                        // Only the parsed body differs, from bodies sent apart: B with A's key
                        // must not be answered A's response.
                        (Some(_), Some(_)) if only_body && a.body != bq.body => {
                            let r = bq.send(port, &ka);
                            if r.header("idempotent-replayed") == Some("true") {
                                return Outcome::Merged(format!("{} replayed", r.status));
                            }
                            return Outcome::Apart(format!("{f} differs"));
                        }
                        _ => return Outcome::Apart(format!("{f} differs")),
                    }
                }
            }
        }
        // A and B are one request to this backend: B with A's key must not execute.
        let before = count(self.b);
        let r = bq.send(port, &ka);
        let ran = count(self.b) - before;
        let answer = if r.header("idempotent-replayed") == Some("true") {
            "replay".to_string()
        } else if refusal(&r).is_empty() {
            r.status.to_string()
        } else {
            format!("{} {}", r.status, refusal(&r))
        };
        if ran > 0 {
            Outcome::Twice(answer)
        } else {
            Outcome::Once(answer)
        }
    }
}

/// A small seeded generator (SplitMix64): the same seed, the same pairs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Drops spellings from A's and B's lists one at a time while the pair still executes twice.
fn shrink(p: &mut Probe, base: &Req, mut sa: Vec<usize>, mut sb: Vec<usize>) -> (Vec<usize>, Vec<usize>) {
    loop {
        let mut smaller = false;
        for side in 0..2 {
            let len = if side == 0 { sa.len() } else { sb.len() };
            for i in (0..len).rev() {
                let (mut ta, mut tb) = (sa.clone(), sb.clone());
                if side == 0 {
                    ta.remove(i)
                } else {
                    tb.remove(i)
                };
                if p.run(&apply(base, &ta), &apply(base, &tb)).is_counterexample() {
                    (sa, sb) = (ta, tb);
                    smaller = true;
                    break;
                }
            }
        }
        if !smaller {
            return (sa, sb);
        }
    }
}

fn names(s: &[usize]) -> String {
    if s.is_empty() {
        return "canonical".into();
    }
    s.iter().map(|&i| format!("{}: {}", SPELLINGS[i].0, SPELLINGS[i].1)).collect::<Vec<_>>().join(" + ")
}

/// Everything one backend found: the sweep's cells (config, spelling, base) and counterexamples.
struct Found {
    cells: Vec<(usize, usize, bool, Outcome)>,
    twice: Vec<String>,
    pairs: u64,
}

fn explore(b: &Backend, seed: u64, pairs: u64) -> Found {
    let mut found = Found { cells: vec![], twice: vec![], pairs: 0 };
    for (cfg, &(cname, _, kh, sh)) in CONFIGS.iter().enumerate() {
        if !runs(b.name, cname) {
            continue;
        }
        let mcp = cname.starts_with("mcp");
        let body_key = cname == "mcp_body_key";
        let forms = cname == "forms_semantic";
        let mut p = Probe { b, cfg, seq: 0 };
        let report = |p: &mut Probe, base: &Req, sa: Vec<usize>, sb: Vec<usize>, found: &mut Found| {
            let (sa, sb) = shrink(p, base, sa, sb);
            let (a, bq) = (apply(base, &sa), apply(base, &sb));
            let pair = format!(
                "{} / {}: A = {} [{}]\n    B = {} [{}]",
                b.name,
                CONFIGS[cfg].0,
                a.show("k1"),
                names(&sa),
                bq.show("k1"),
                names(&sb)
            );
            // Printed when found too: a long run stopped before its end still says what it found.
            println!("oracle: counterexample: {pair}");
            found.twice.push(pair);
        };
        // The sweep: each spelling alone against the canonical request, on both routes (the
        // `form` spellings against the form body, on the payments route).
        for orders in [false, true] {
            for (s, &(dim, sname, _)) in SPELLINGS.iter().enumerate() {
                let body = match dim {
                    "form" => Body::Form,
                    "multipart" => Body::Multipart,
                    _ => Body::Json,
                };
                if (body != Body::Json && orders)
                    || (body_key && !BODY_KEY_DIMS.contains(&dim))
                    || (forms && !FORM_DIMS.contains(&dim))
                {
                    found.cells.push((cfg, s, orders, Outcome::Inapplicable));
                    continue;
                }
                let mut base = Req::base(orders, kh, sh, mcp, body, body_key);
                if let Some((_, f)) = SWEEP_BASES.iter().find(|(n, _)| *n == sname) {
                    f(&mut base);
                }
                let spelled = apply(&base, &[s]);
                if spelled.show("k") == base.show("k") {
                    found.cells.push((cfg, s, orders, Outcome::Inapplicable));
                    continue;
                }
                let o = p.run(&base, &spelled);
                found.pairs += 1;
                if o.is_counterexample() {
                    report(&mut p, &base, vec![], vec![s], &mut found);
                }
                found.cells.push((cfg, s, orders, o));
            }
        }
        // The search: random combinations of spellings on both sides.
        let mut rng = Rng(seed ^ (cfg as u64) << 32 ^ b.name.len() as u64);
        for _ in 0..pairs {
            // A form body one time in three, a multipart body one time in six (spellings of
            // another body leave it alone).
            let orders = rng.below(2) == 1;
            // (`forms_semantic`: a form body always, multipart one time in two.)
            let body = match rng.below(6) {
                0 | 1 => Body::Form,
                2 => Body::Multipart,
                n if forms => [Body::Form, Body::Multipart][n % 2],
                _ => Body::Json,
            };
            let base = Req::base(orders, kh, sh, mcp, body, body_key);
            let pick = |rng: &mut Rng| -> Vec<usize> {
                let n = 1 + rng.below(3);
                let mut v: Vec<usize> = (0..n).map(|_| rng.below(SPELLINGS.len())).collect();
                v.sort_unstable();
                v.dedup();
                v
            };
            let (sa, sb) = (pick(&mut rng), pick(&mut rng));
            let (a, bq) = (apply(&base, &sa), apply(&base, &sb));
            // Two identical requests (spellings that leave this body alone) are a plain retry,
            // which every `once` cell of the sweep already sends: not sent again.
            if a.show("k") == bq.show("k") {
                continue;
            }
            found.pairs += 1;
            if p.run(&a, &bq).is_counterexample() {
                report(&mut p, &base, sa, sb, &mut found);
            }
        }
    }
    found
}

/// The start of the table's line naming the panel's unpinned parts (`panel_versions`).
const UNPINNED: &str = "Unpinned parts of the panel in the run that wrote this table:";

/// The panel's parts apt cannot pin here (Debian's golang-go, tomcat10 and the Java it runs on):
/// (what, version), read from dpkg and the tools themselves.
fn panel_versions() -> Vec<(&'static str, String)> {
    let out = |cmd: &str, args: &[&str]| {
        Command::new(cmd)
            .args(args)
            .output()
            .map(|o| {
                let text = if o.stdout.is_empty() { o.stderr } else { o.stdout };
                String::from_utf8_lossy(&text).lines().next().unwrap_or("").trim().to_string()
            })
            .unwrap_or_else(|_| "missing".into())
    };
    let deb = |p: &str| out("dpkg-query", &["-W", "-f", "${Version}", p]);
    vec![
        ("golang-go", format!("{} ({})", deb("golang-go"), out("go", &["version"]))),
        ("tomcat10", deb("tomcat10")),
        ("java", out("java", &["-version"])),
    ]
}

fn versions_line(v: &[(&str, String)]) -> String {
    let parts: Vec<String> = v.iter().map(|(n, v)| format!("{n} `{v}`")).collect();
    format!("{UNPINNED} {}.\n", parts.join(", "))
}

/// Where the published table and this run's differ: the unpinned versions that changed (named),
/// and whether any other line (a cell) did.
fn compare(published: &str, doc: &str) -> (Vec<String>, bool) {
    let line = |t: &str| t.lines().find(|l| l.starts_with(UNPINNED)).unwrap_or("").to_string();
    let (old, new) = (line(published), line(doc));
    let parts = |l: &str| -> Vec<String> {
        l.trim_start_matches(UNPINNED).trim_end_matches('.').split(", ").map(|s| s.trim().to_string()).collect()
    };
    let changed: Vec<String> = if old == new {
        vec![]
    } else {
        let (o, n) = (parts(&old), parts(&new));
        n.iter()
            .filter(|p| !o.contains(p))
            .map(|p| {
                let name = p.split(' ').next().unwrap_or("");
                let was = o.iter().find(|q| q.split(' ').next() == Some(name)).cloned().unwrap_or("none".into());
                format!("{name}: the table was written with {was}, this run has {p}")
            })
            .collect()
    };
    let rest = |t: &str| t.lines().filter(|l| !l.starts_with(UNPINNED)).collect::<Vec<_>>().join("\n");
    (changed, rest(published) != rest(doc))
}

/// The equivalence table, one section per configuration: spelling x backend.
fn table(found: &[(&str, Found)], versions: &[(&str, String)]) -> String {
    let mut t = String::from(
        "# The equivalence table\n\n\
         GENERATED by the boundary oracle (tests/it/boundary_oracle.rs): `make test-oracle-long`\n\
         writes this file; `make test` fails when what the backends and idemgate do no longer\n\
         matches it. Do not edit by hand. The known limits are in [limitations](limitations.md).\n\n\
         Each spelling is sent beside the canonical request (`POST /v1/payments?a=1&b=2` and\n\
         `POST /v2/orders/o%C3%A9?a=1&b=2`, host `xn--bcher-kva.test` (IDNA for `bücher.test`), JSON body), through Envoy 1.40 and\n\
         idemgate, to each backend of the panel (tests/oracle/). A cell says what happened, for the\n\
         payments route / the orders route when they differ:\n\n\
         - `once (A)`: the backend reads both as one request, and the spelling with the canonical\n\
           request's key did not execute; A is idemgate's answer (`replay`, `409`, `422 ...`).\n\
         - `refused (P)`: idemgate refused one of the two before it executed (problem P).\n\
         - `apart (F)`: the backend reads them as two requests (field F of what it read differs:\n\
           the route, its parameters, the method, the caller, the key, the query or the body, an\n\
           MCP call's JSON-RPC `id` left out: a client retries a call under a new id), or\n\
           did not run the spelling at all (`not run: status from envoy|backend`): no obligation.\n\
         - `TWICE`: a counterexample: one request to the backend, executed twice.\n\
         - `MERGED`: a counterexample: the backend parsed the two bodies apart (JSON, or a form's\n\
           fields and files; beyond an MCP call's JSON-RPC `id`), and the spelling with the\n\
           canonical request's key was answered the canonical request's replay.\n\
         - `-`: the spelling does not apply to that route (`%c3%a9` on `/v1/payments`).\n\n\
         In configuration `mcp` (both routes `protocol: mcp`) the request is an MCP client's\n\
         `tools/call`: the same paths, query and headers, plus `accept: application/json,\n\
         text/event-stream`, `mcp-method: tools/call` and `mcp-name: charge`, and the body\n\
         `{\"jsonrpc\":\"2.0\",\"id\":7,\"method\":\"tools/call\",\"params\":{\"name\":\"charge\",\"arguments\":{\"amount\":1,\"currency\":\"eur\"}}}`;\n\
         each backend answers it with a JSON-RPC response (the request's id, what it read as the\n\
         result), which idemgate takes for the call's completion; the MCP server (`mcp-python`, in\n\
         the MCP configurations only) answers as its SDK does, with an event stream\n\
         (`text/event-stream`) carrying that response, what its tool read as the tool's result\n\
         (the arguments as the SDK validated them against the tool's signature, the id and\n\
         `_meta` as the SDK parsed them); `mcp_derive_key` sends that call\n\
         with `x-op` in place of the key header. In `derive_key` and `include_body` the key is\n\
         derived from `x-op` (and in `include_body` from the body too). In `mcp_body_key` the key\n\
         is in the body, not in a header: in `params._meta.idempotencyKey` on the payments route, in\n\
         the argument `idempotency_key` (`mcp.key_arguments`) on the orders route; only the\n\
         `body`, `json`, `content-type` and `protocol` spellings are sent there (`-` elsewhere).\n\
         In `forms_semantic` a sent key's fingerprint reads form bodies as every parser reads them\n\
         (`fingerprint.forms: \"semantic\"`); only the `form` and `multipart` spellings are sent\n\
         there (`-` elsewhere).\n\n\
         The `json` spellings respell the JSON body where it has their target (`-` where it has\n\
         none): a BOM, whitespace around the document, `\\uXXXX` escapes of ASCII letters in\n\
         member names and values, an escaped `/`, number spellings, and repeated member names (in\n\
         the arguments, the JSON-RPC members, the key's source). `-0` is sent beside a canonical\n\
         request with `\"amount\":0`, the escaped `/` in a key beside a key `a/...`. Each backend\n\
         reports the body as its JSON parser read it: on repeated names Python's `json`,\n\
         `JSON.parse` (Express, Fastify) and Go's `encoding/json` all keep the last.\n\n\
         The `form` spellings are sent beside the canonical request with a form body in place of\n\
         the JSON one (`content-type: application/x-www-form-urlencoded`, body\n\
         `amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y`), on the payments route, in\n\
         the configurations that are not MCP. Each backend reports the form as its framework parses\n\
         it, as a handler reading fields by name sees it: each name with its values in the order\n\
         sent (the order of different names is not part of it, the order of one name's values is).\n\n\
         The `multipart` spellings are sent the same way with a multipart/form-data body\n\
         (`content-type: multipart/form-data; boundary=----idemgate7MA4YWxkTrZu0gW`; text fields\n\
         `amount=1`, `currency=eur`, `tag=x`, `tag=y`, then a file `doc` named `a.txt`,\n\
         `Content-Type: text/plain`, content `hello`; each part as browsers write it, CRLF line\n\
         ends, no preamble or epilogue). Each backend reports the text fields as its form, and each\n\
         file by its field name, file name and a SHA-256 of its content, in the order sent. The\n\
         spellings of non-ASCII names are sent beside that body with its field `currency` named\n\
         `währung` and its file named `café.txt`, UTF-8 in the quoted parameter as RFC 7578 and\n\
         browsers send them (the row \"non-ASCII names as UTF-8\" is that body beside the canonical one).\n\n",
    );
    t.push_str(
        "Backends: Flask 3.1.3 on Werkzeug 3.1.9's server; Django 5.2.19 (runserver's WSGIServer);\n\
         FastAPI 0.165.0 / Starlette 1.10.0 under uvicorn 0.54.0; Express 5.3.0; Fastify 5.12.8 (Node 20);\n\
         Go 1.19 net/http ServeMux (Debian golang-go); a servlet on Tomcat 10.1 (Debian tomcat10, Java 17).\n\
         All with their defaults, and a form parser: Express's `express.urlencoded()`, FastAPI's\n\
         python-multipart 0.0.34 (Starlette's form parser needs it), and for Fastify, which has\n\
         none (415), node:querystring registered as @fastify/formbody registers its parser; for\n\
         multipart bodies, Express's multer 2.5.0 (`any()`, busboy 1.6.0) and Fastify's\n\
         @fastify/multipart 10.1.9 (@fastify/busboy 3.2.6), each with its defaults, and the\n\
         servlet's `<multipart-config/>` on Tomcat. In the MCP configurations, an MCP server too:\n\
         the official MCP Python SDK 2.3.0 (`mcp`, tests/mcp/requirements.txt), its `MCPServer`\n\
         with one tool, `charge(amount: int, currency: str, idempotency_key: str | None = None)`,\n\
         on its Streamable HTTP transport (stateless, its default answers: `text/event-stream`)\n\
         under uvicorn 0.54.0, on both routes (tests/oracle/mcp_backend.py). The\n\
         servlet API parses no JSON: Tomcat's JSON body is its text; its form is the parameter\n\
         map, which merges the query's fields with the body's. The\n\
         sweep below does not depend on the seed; the random search (combinations of these\n\
         spellings on both sides of a pair) found no counterexample in the run that wrote it.\n",
    );
    t.push_str(&versions_line(versions));
    let web: Vec<&(&str, Found)> = found.iter().filter(|(n, _)| *n != MCP_SDK).collect();
    for (cfg, (cname, plugin, _, _)) in CONFIGS.iter().enumerate() {
        t.push_str(&format!("\n## Configuration `{cname}`\n\n`{plugin}`\n\n"));
        let columns: Vec<(String, &Found, usize)> = web.iter().map(|(n, f)| (n.to_string(), f, cfg)).collect();
        t.push_str(&cells_table(&columns));
    }
    // The MCP server's cells, one column per MCP configuration (`make test-oracle-long` only).
    if let Some((_, f)) = found.iter().find(|(n, _)| *n == MCP_SDK) {
        t.push_str(MCP_SECTION);
        t.push_str(
            "\n\nThe official MCP Python SDK's server (tests/oracle/mcp_backend.py, `mcp-python`) behind\n\
             idemgate, in the three MCP configurations above (one column each), with the same requests\n\
             and the same cells. `make test-oracle-long` asks it (IDEMGATE_ORACLE_MCP_SDK=1); `make test`\n\
             does not, and compares only the tables above this section.\n\n",
        );
        let columns: Vec<(String, &Found, usize)> = CONFIGS
            .iter()
            .enumerate()
            .filter(|(_, c)| runs(MCP_SDK, c.0))
            .map(|(cfg, c)| (format!("`{}`", c.0), f, cfg))
            .collect();
        t.push_str(&cells_table(&columns));
    }
    t
}

/// The heading of the MCP server's section of the table (the last).
const MCP_SECTION: &str = "\n## The MCP server (`mcp`, `mcp_derive_key`, `mcp_body_key`)";

/// One markdown table, spelling x column: each column a header and one backend's cells in one
/// configuration.
fn cells_table(columns: &[(String, &Found, usize)]) -> String {
    let mut t = String::from("| dimension | spelling |");
    for (h, _, _) in columns {
        t.push_str(&format!(" {h} |"));
    }
    t.push_str("\n|---|---|");
    for _ in columns {
        t.push_str("---|");
    }
    t.push('\n');
    for (s, (dim, name, _)) in SPELLINGS.iter().enumerate() {
        t.push_str(&format!("| {dim} | {} |", name.replace('|', "\\|")));
        for (_, f, cfg) in columns {
            let cell = |orders: bool| {
                f.cells
                    .iter()
                    .find(|(c, sp, o, _)| c == cfg && *sp == s && *o == orders)
                    .map(|(_, _, _, o)| match o {
                        Outcome::Once(a) => format!("once ({a})"),
                        Outcome::Refused(p) => format!("refused ({p})"),
                        Outcome::Apart(why) => format!("apart ({why})"),
                        Outcome::Twice(a) => format!("**TWICE** ({a})"),
                        Outcome::Merged(a) => format!("**MERGED** ({a})"),
                        Outcome::Inapplicable => "-".to_string(),
                    })
                    .unwrap_or_default()
            };
            let (p, o) = (cell(false), cell(true));
            if p == o {
                t.push_str(&format!(" {p} |"));
            } else {
                t.push_str(&format!(" {p} / {o} |"));
            }
        }
        t.push('\n');
    }
    t
}

#[test]
fn spellings_a_backend_runs_as_one_request_execute_once_through_idemgate() {
    let seed = env_u64("IDEMGATE_ORACLE_SEED", 41);
    let pairs = env_u64("IDEMGATE_ORACLE_PAIRS", 12);
    // IDEMGATE_ORACLE_BACKENDS: a comma-separated part of the panel (one backend's cells, to
    // reproduce them); the table is then neither written nor compared with docs/equivalence.md.
    // The MCP server (`MCP_SDK`) with IDEMGATE_ORACLE_MCP_SDK=1 (`make test-oracle-long`) or when
    // named there.
    let only = std::env::var("IDEMGATE_ORACLE_BACKENDS").unwrap_or_default();
    let mcp_sdk = std::env::var("IDEMGATE_ORACLE_MCP_SDK").is_ok_and(|v| v == "1");
    let named = |n: &str| only.split(',').any(|o| o.trim() == n);
    let panel: Vec<&'static str> = BACKENDS
        .iter()
        .copied()
        .filter(|n| if only.is_empty() { *n != MCP_SDK || mcp_sdk } else { named(n) })
        .collect();
    assert!(!panel.is_empty(), "IDEMGATE_ORACLE_BACKENDS={only} names none of {BACKENDS:?}");
    let whole_panel = BACKENDS.iter().all(|n| *n == MCP_SDK || panel.contains(n));
    let mcp_ran = panel.contains(&MCP_SDK);
    // Start the panel side by side, then explore each backend on its own thread.
    let handles: Vec<_> = panel.iter().map(|&n| std::thread::spawn(move || start_backend(n))).collect();
    let backends: Vec<Backend> = handles.into_iter().map(|h| h.join().expect("a backend started")).collect();
    let found: Vec<(&str, Found)> = std::thread::scope(|sc| {
        let hs: Vec<_> = backends.iter().map(|b| sc.spawn(move || (b.name, explore(b, seed, pairs)))).collect();
        hs.into_iter().map(|h| h.join().expect("explore")).collect()
    });
    for b in &backends {
        if let Some(e) = &b.envoy {
            e.assert_no_wasm_panic();
        }
    }
    let doc = table(&found, &panel_versions());
    let dir = repo_root().join("target/oracle");
    std::fs::create_dir_all(&dir).expect("target/oracle");
    let name = if whole_panel { "equivalence.md" } else { "equivalence-part.md" };
    std::fs::write(dir.join(name), &doc).expect("write the table");
    let published = repo_root().join("docs/equivalence.md");
    let twice_found = found.iter().any(|(_, f)| !f.twice.is_empty());
    if std::env::var("IDEMGATE_ORACLE_WRITE_DOCS").is_ok_and(|v| v == "1") && !twice_found && whole_panel && mcp_ran {
        std::fs::write(&published, &doc).expect("write docs/equivalence.md");
    }
    let total: u64 = found.iter().map(|(_, f)| f.pairs).sum();
    let once: usize =
        found.iter().map(|(_, f)| f.cells.iter().filter(|c| matches!(c.3, Outcome::Once(_))).count()).sum();
    let refused: usize =
        found.iter().map(|(_, f)| f.cells.iter().filter(|c| matches!(c.3, Outcome::Refused(_))).count()).sum();
    let twice: Vec<&String> = found.iter().flat_map(|(_, f)| &f.twice).collect();
    println!(
        "oracle: seed {seed}, {total} pairs on {} backends x {} configurations; sweep: {once} once, {refused} refused; {} counterexamples",
        backends.len(),
        CONFIGS.len(),
        twice.len()
    );
    assert!(once > 0, "no spelling was read as one request by any backend: the oracle tested nothing");
    assert!(
        twice.is_empty(),
        "executed twice (smallest pairs):\n{}",
        twice.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n")
    );
    // The published table is this run's sweep: a backend or idemgate that changed what it does
    // with one spelling changes a cell (target/oracle/equivalence.md has the new table). Debian's
    // golang-go, tomcat10 and Java cannot be pinned (docs/testing.md): a version that changed
    // fails the check only with a changed cell, and the failure names it.
    if !whole_panel {
        return;
    }
    let mut text = std::fs::read_to_string(&published).unwrap_or_default();
    if !mcp_ran {
        // Without the MCP server, the tables above its section.
        if let Some(at) = text.find(MCP_SECTION) {
            text.truncate(at);
        }
    }
    let (versions, cells) = compare(&text, &doc);
    for v in &versions {
        println!("oracle: unpinned version changed, cells {}: {v}", if cells { "changed" } else { "unchanged" });
    }
    assert!(
        !cells,
        "docs/equivalence.md differs from the sweep (target/oracle/equivalence.md): run make test-oracle-long to write it{}",
        if versions.is_empty() {
            " (the unpinned versions are the table's)".to_string()
        } else {
            format!("; unpinned versions changed since the table was written: {}", versions.join("; "))
        }
    );
}

#[test]
fn the_table_check_names_a_changed_unpinned_version_and_fails_only_on_changed_cells() {
    let v = |go: &str| versions_line(&[("golang-go", go.into()), ("tomcat10", "10.1.60-1~deb12u1".into())]);
    let doc = |go: &str, cell: &str| format!("# t\n{}| x | {cell} |\n", v(go));
    assert_eq!(compare(&doc("2:1.19~1", "once"), &doc("2:1.19~1", "once")), (vec![], false));
    let (changed, cells) = compare(&doc("2:1.19~1", "once"), &doc("2:1.19~2", "once"));
    assert_eq!(
        changed,
        vec!["golang-go: the table was written with golang-go `2:1.19~1`, this run has golang-go `2:1.19~2`"]
    );
    assert!(!cells, "a version alone changes no cell");
    assert!(compare(&doc("2:1.19~1", "once"), &doc("2:1.19~2", "apart")).1);
    assert_eq!(compare(&doc("2:1.19~1", "once"), &doc("2:1.19~1", "apart")), (vec![], true));
}

/// A spelling sent in `mcp_body_key` that loses the body's key makes its cell `apart (body
/// differs)` whatever idemgate does: a cell that cannot fail. The member order spelling did
/// (it wrote a fixed body without `_meta` or the key argument).
#[test]
fn every_body_key_spelling_keeps_the_key_in_the_body() {
    for orders in [false, true] {
        let base = Req::base(orders, "idempotency-key", "authorization", true, Body::Json, true);
        assert!(base.body.contains("\"KEY\""), "{}", base.body);
        for (s, (dim, name, _)) in SPELLINGS.iter().enumerate() {
            if !BODY_KEY_DIMS.contains(dim) {
                continue;
            }
            let spelled = apply(&base, &[s]);
            assert!(spelled.body.contains("KEY"), "{dim}: {name} drops the key: {}", spelled.body);
        }
    }
}

#[test]
fn member_order_moves_members_and_keeps_their_text() {
    assert_eq!(reorder_members(r#"{"amount":1,"currency":"eur"}"#), r#"{"currency":"eur","amount":1}"#);
    assert_eq!(
        reorder_members(MCP_BODY),
        r#"{"params":{"arguments":{"currency":"eur","amount":1},"name":"charge"},"method":"tools/call","id":7,"jsonrpc":"2.0"}"#
    );
    let keyed = Req::base(false, "idempotency-key", "authorization", true, Body::Json, true).body;
    assert_eq!(
        reorder_members(&keyed),
        r#"{"params":{"arguments":{"currency":"eur","amount":1},"_meta":{"idempotencyKey":"KEY"},"name":"charge"},"method":"tools/call","id":7,"jsonrpc":"2.0"}"#
    );
    // A repeated name's members keep their order (the last value stays last); escapes, numbers
    // and whitespace inside a member are kept; a name is compared decoded.
    assert_eq!(
        reorder_members("\u{feff} {\"a\": [1, {\"x\":1,\"y\":2}], \"c\":\"u\",\"\\u0063\":\"e\\\"}\", \"n\":1.0e0 }"),
        "\u{feff} {\"n\":1.0e0 ,\"c\":\"u\",\"\\u0063\":\"e\\\"}\",\"a\": [1, {\"y\":2,\"x\":1}]}"
    );
    assert_eq!(reorder_members("amount=1&currency=eur"), "amount=1&currency=eur");
}

/// The MCP SDK's answer to a call, an event stream whose message's result carries what the tool
/// read as JSON text, is read as the web apps' JSON answers are (the key as `KEY`); an answer
/// without a `route` is no reading.
#[test]
fn an_event_stream_answer_is_read_as_its_json_rpc_result() {
    let read = serde_json::json!({"route": "payments", "params": {}, "method": "POST", "query": [], "body": {"id": 7},
        "idempotency-key": ["k-1"], "authorization": ["Bearer alice"]});
    let message = serde_json::json!({"jsonrpc": "2.0", "id": 7,
        "result": {"content": [{"type": "text", "text": read.to_string()}], "isError": false}});
    let sse = |ct: &str, body: String| http::Response {
        status: 200,
        headers: vec![("Content-Type".into(), ct.into())],
        body: body.into_bytes(),
    };
    let r = sse("text/event-stream", format!("event: message\r\ndata: {message}\r\n\r\n"));
    let Reading::Ran(m) = reading(&r, "idempotency-key", "authorization", "k-1") else {
        panic!("not read: {:?}", reading(&r, "idempotency-key", "authorization", "k-1"))
    };
    assert_eq!(m["route"], "payments");
    assert_eq!(m["key"], serde_json::json!(["KEY"]));
    assert_eq!(m["scope"], serde_json::json!(["Bearer alice"]));
    // The same message as application/json, and the web apps' `result` holding the reading itself.
    assert_eq!(
        reading(&sse("application/json", message.to_string()), "idempotency-key", "authorization", "k-1"),
        Reading::Ran(m.clone())
    );
    let web = serde_json::json!({"jsonrpc": "2.0", "id": 7, "result": read});
    assert_eq!(
        reading(&sse("application/json", web.to_string()), "idempotency-key", "authorization", "k-1"),
        Reading::Ran(m)
    );
    // A tool error (no reading in its text) is no run.
    let error = serde_json::json!({"jsonrpc": "2.0", "id": 7,
        "result": {"content": [{"type": "text", "text": "Error executing tool charge"}], "isError": true}});
    let r = sse("text/event-stream", format!("event: message\ndata: {error}\n\n"));
    assert!(matches!(reading(&r, "idempotency-key", "authorization", "k-1"), Reading::NotRun(200, _)));
}

/// A JSON reader that runs the first of a member named twice: pysimdjson 7.0.2's documented
/// `Parser().parse(body)` (`simdjson` in tests/oracle/backends.py, not on the panel, whose parsers
/// all run the last). Behind `derive_key.include_body` a key derived from either value lets one
/// of the two kinds of reader run two requests it reads as one under two keys: the key was
/// derived from the last value, and this backend ran `{"a":1,"a":2}` and `{"a":1}`, which it
/// reads alike, twice. A body naming a member twice is refused before it executes
/// (`body-ambiguous`), at any depth, a name and its escaped spelling being one name.
#[test]
fn a_json_body_naming_a_member_twice_is_refused_before_a_first_value_backend() {
    let include_body: Vec<_> = CONFIGS.iter().filter(|c| c.0 == "include_body").copied().collect();
    let b = start_backend_with("simdjson", &include_body);
    let port = b.listeners[0];
    // What makes the pair one request: the backend, asked directly, reads the first value.
    let direct = http::request(b.port, "POST", "/v1/payments", &[], br#"{"a":1,"a":2}"#).expect("request");
    assert_eq!(direct.json()["body"], serde_json::json!({"a": 1}), "{}", direct.body_text());
    for (n, (twice, once)) in [
        (r#"{"a":1,"a":2}"#, r#"{"a":1}"#),
        (r#"{"a":1,"\u0061":2}"#, r#"{"a":1}"#),
        (r#"{"x":[{"y":0},{"a":1,"b":0,"a":2}]}"#, r#"{"x":[{"y":0},{"a":1,"b":0}]}"#),
    ]
    .into_iter()
    .enumerate()
    {
        let op = format!("op-dup-{n}");
        let h = [("authorization", "Bearer alice"), ("content-type", "application/json"), ("x-op", op.as_str())];
        let before = count(&b);
        let first = http::request(port, "POST", "/v1/payments", &h, twice.as_bytes()).expect("request");
        let second = http::request(port, "POST", "/v1/payments", &h, once.as_bytes()).expect("request");
        let executions = count(&b) - before;
        assert!(
            executions <= 1,
            "{twice} then {once}, one request to this backend, executed {executions} times: answered {} {} then {} {}",
            first.status,
            first.body_text(),
            second.status,
            second.body_text()
        );
        assert_eq!((first.status, first.problem().as_str()), (400, "body-ambiguous"), "{}", first.body_text());
        assert_eq!((second.status, executions), (201, 1), "{}", second.body_text());
    }
    if let Some(e) = &b.envoy {
        e.assert_no_wasm_panic();
    }
}

/// Go's `encoding/json` reads a lone surrogate escape (`"\ud800"`) and a byte that is not UTF-8
/// (`"\xff"`) each as U+FFFD (Express's JSON body parser the byte too), so `{"a":"\ud800"}`,
/// `{"a":"\xff"}` and `{"a":"\ufffd"}` are one request to it. idemgate derived the first two from
/// their bytes (not JSON to its reader) and the third from its semantic form: three keys, three
/// executions. Such a body has no one meaning (Python's `json` and `JSON.parse` keep the
/// surrogate, Python refuses the byte): refused (`body-ambiguous`), as a member named twice is.
/// `make test-oracle-long` only (`oracle_full_`: a Go backend and an Envoy of its own);
/// `steps_tests::include_body_refuses_a_json_body_that_is_not_unicode` guards the rule in `make test`.
#[test]
fn oracle_full_a_json_body_that_is_not_unicode_is_refused_before_a_go_backend() {
    let include_body: Vec<_> = CONFIGS.iter().filter(|c| c.0 == "include_body").copied().collect();
    let b = start_backend_with("go", &include_body);
    let port = b.listeners[0];
    // What makes them one request: the backend, asked directly, reads each as U+FFFD.
    for unsound in [&br#"{"a":"\ud800"}"#[..], b"{\"a\":\"\xff\"}"] {
        let json = [("content-type", "application/json")];
        let direct = http::request(b.port, "POST", "/v1/payments", &json, unsound).expect("request");
        assert_eq!(direct.json()["body"], serde_json::json!({"a": "\u{fffd}"}), "{}", direct.body_text());
    }
    for (n, (unsound, sound)) in [
        (&br#"{"a":"\ud800"}"#[..], r#"{"a":"\ufffd"}"#),
        (br#"{"a":"\udc00x"}"#, r#"{"a":"\ufffdx"}"#),
        (b"{\"a\":\"\xff\"}", r#"{"a":"\ufffd"}"#),
        (b"{\"\xfe\":1}", r#"{"\ufffd":1}"#),
    ]
    .into_iter()
    .enumerate()
    {
        let op = format!("op-unsound-{n}");
        let h = [("authorization", "Bearer alice"), ("content-type", "application/json"), ("x-op", op.as_str())];
        let before = count(&b);
        let first = http::request(port, "POST", "/v1/payments", &h, unsound).expect("request");
        let second = http::request(port, "POST", "/v1/payments", &h, sound.as_bytes()).expect("request");
        let executions = count(&b) - before;
        assert!(
            executions <= 1,
            "{} then {sound}, one request to this backend, executed {executions} times: answered {} {} then {} {}",
            String::from_utf8_lossy(unsound),
            first.status,
            first.body_text(),
            second.status,
            second.body_text()
        );
        assert_eq!((first.status, first.problem().as_str()), (400, "body-ambiguous"), "{}", first.body_text());
        assert_eq!((second.status, executions), (201, 1), "{}", second.body_text());
    }
    if let Some(e) = &b.envoy {
        e.assert_no_wasm_panic();
    }
}
