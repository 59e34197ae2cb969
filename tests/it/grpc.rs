//! gRPC through idemgate with a real client and server (Python grpcio, tests/grpc_peer.py), over
//! h2c, Envoy 1.40 (issue 23, item 6). A local reply to a gRPC request is reshaped by Envoy into
//! a trailers-only answer, so a replay cannot carry the first call's message and trailers: a
//! keyed gRPC call is refused before it executes (or, with `grpc: "pass"`, let through
//! unprotected), never answered with a failure in place of its success.

use crate::support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use serde_json::Value;
use support::{Envoy, EnvoyOptions, Scratch};

/// The gRPC status a keyed call gets on a route that refuses gRPC (`grpc-unsupported`).
const FAILED_PRECONDITION: &str = "FAILED_PRECONDITION";

fn peer() -> std::path::PathBuf {
    support::repo_root().join("tests/grpc_peer.py")
}

/// The counting gRPC upstream (killed when dropped).
struct Server {
    child: Child,
    port: u16,
    executions: std::path::PathBuf,
    _scratch: Scratch,
}

impl Server {
    fn start() -> Server {
        let scratch = Scratch::new("grpc");
        let executions = scratch.0.join("executions");
        let mut child = Command::new("python3")
            .arg(peer())
            .args(["serve", executions.to_str().expect("path")])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect(
                "python3 tests/grpc_peer.py (grpcio installed by `make deps`: scripts/install-deps.sh grpc-client)",
            );
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("port line");
        let port = line.trim().parse().unwrap_or_else(|_| panic!("grpc server port, got {line:?}"));
        Server { child, port, executions, _scratch: scratch }
    }

    fn executions(&self) -> usize {
        std::fs::read_to_string(&self.executions).map(|s| s.lines().count()).unwrap_or(0)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One unary call through Envoy with this metadata: {code, details, response (hex), trailers}.
fn call(envoy: &Envoy, metadata: &[&str]) -> Value {
    let out = Command::new("python3")
        .arg(peer())
        .args(["call", &envoy.port.to_string()])
        .args(metadata)
        .output()
        .expect("python3 tests/grpc_peer.py call");
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("grpc call output {text:?} ({e}); stderr {}", String::from_utf8_lossy(&out.stderr)))
}

fn stack(plugin: &str) -> (Server, Envoy) {
    let server = Server::start();
    let mut o = EnvoyOptions::new(plugin, server.port);
    o.upstream_http2 = true;
    let envoy = Envoy::start(&o);
    (server, envoy)
}

const CALLER: &str = "authorization:Bearer grpc-caller";

fn plugin(extra: &str) -> String {
    format!(r#"{{"scope": {{"headers": ["authorization"]}}{extra}}}"#)
}

/// Before the fix: the first call got OK and `charged:...`, the retry with the same key a
/// trailers-only UNKNOWN whose message was the protobuf bytes percent-encoded (one execution, and
/// a client told its charge failed). Now the keyed call is refused before anything executes, with
/// a status and a message that say why, the same on every attempt.
#[test]
fn a_keyed_grpc_call_is_refused_before_it_executes_never_replayed_as_a_failure() {
    let (server, envoy) = stack(&plugin(""));
    let first = call(&envoy, &[CALLER, "idempotency-key:g-1"]);
    let retry = call(&envoy, &[CALLER, "idempotency-key:g-1"]);
    // Never a failure in place of a success.
    if first["code"] == "OK" {
        assert_eq!(retry["code"], "OK", "the retry of a success: {retry}");
        assert_eq!(retry["response"], first["response"], "{retry}");
    }
    for r in [&first, &retry] {
        assert_eq!(r["code"], FAILED_PRECONDITION, "{r}");
        let details = r["details"].as_str().unwrap_or("");
        assert!(details.contains("grpc-unsupported") && details.contains("gRPC"), "{details}");
    }
    assert_eq!(server.executions(), 0);
    // Without a key: unchanged, the call executes each time (nothing to protect it by).
    for n in 1..=2 {
        let plain = call(&envoy, &[CALLER]);
        assert_eq!(plain["code"], "OK", "{plain}");
        assert_eq!(plain["response"], hex(b"charged:\x08\x05amount-5"));
        assert_eq!(server.executions(), n);
    }
    envoy.assert_no_wasm_panic();
}

/// `grpc: "pass"` on a route: keyed gRPC calls go through unprotected (documented), each executes.
#[test]
fn grpc_pass_lets_keyed_calls_through_unprotected() {
    let (server, envoy) =
        stack(&plugin(r#", "routes": [{"prefix": "/pay.Payments", "grpc": "pass"}, {"prefix": "/"}]"#));
    for n in 1..=2 {
        let r = call(&envoy, &[CALLER, "idempotency-key:g-2"]);
        assert_eq!(r["code"], "OK", "{r}");
        assert_eq!(r["response"], hex(b"charged:\x08\x05amount-5"));
        assert_eq!(server.executions(), n);
    }
    envoy.assert_no_wasm_panic();
}

/// idemgate's other answers to a gRPC call keep a meaningful gRPC status and message (Envoy
/// would otherwise map a 400 to INTERNAL with the problem JSON as the message): a missing key on
/// a `require_key` route and a malformed key are INVALID_ARGUMENT naming the problem (before: INTERNAL, the
/// message the problem's JSON).
#[test]
fn a_missing_or_malformed_key_on_a_grpc_call_is_invalid_argument_naming_the_problem() {
    let (server, envoy) = stack(&plugin(r#", "require_key": true"#));
    let missing = call(&envoy, &[CALLER]);
    assert_eq!(missing["code"], "INVALID_ARGUMENT", "{missing}");
    assert!(missing["details"].as_str().unwrap_or("").contains("key-missing"), "{missing}");
    let malformed = call(&envoy, &[CALLER, "idempotency-key:a b"]);
    assert_eq!(malformed["code"], "INVALID_ARGUMENT", "{malformed}");
    assert!(malformed["details"].as_str().unwrap_or("").contains("key-not-visible-ascii"), "{malformed}");
    assert_eq!(server.executions(), 0);
    envoy.assert_no_wasm_panic();
}

/// A key derived at the edge (`derive_key`) makes a gRPC call keyed too: refused alike.
#[test]
fn a_grpc_call_with_a_derivable_key_is_refused_alike() {
    let (server, envoy) = stack(&plugin(r#", "derive_key": {"headers": ["x-agent-step-id"]}"#));
    let r = call(&envoy, &[CALLER, "x-agent-step-id:step-1"]);
    assert_eq!(r["code"], FAILED_PRECONDITION, "{r}");
    assert_eq!(server.executions(), 0);
    envoy.assert_no_wasm_panic();
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
