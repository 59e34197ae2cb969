//! MCP tool calls through Envoy + idemgate with the official SDKs (issue 28), nobody's code but
//! theirs: the server is the MCP Python SDK's `MCPServer` (tests/mcp/server.py, a counting
//! `charge` tool and a read-only `balance`), the callers are the Python SDK's `Client`
//! (tests/mcp/client.py) and the TypeScript SDK's `Client` (tests/mcp/client.mjs), at the versions
//! pinned in tests/mcp/ and installed by `scripts/install-deps.sh mcp-sdk` (`make deps`).
//! Streamable HTTP, the server answering `application/json` or `text/event-stream`; executions
//! counted at the server (GET /count).
//!
//! The route under test is the MCP policy (docs/mcp-setup.md):
//! `{"prefix": "/mcp", "protocol": "mcp", "mcp": {"tools": ["charge"], "key_arguments": [...]}}`.
//! `MCP_TEST_SDK` picks one SDK, `MCP_TEST_ROUTE` replaces that route's JSON (e.g. `{"prefix": "/mcp"}` to see what a plain
//! HTTP route does), `IDEMGATE_WASM` the module (tests/it/support).
//!
//! The Python SDK repairs the ids of SSE answers and 4xx bodies without saying so (SEMANTICS.md),
//! so `a_replay_answers_the_retrys_id_on_the_wire` checks ids with raw HTTP.

use crate::support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::http;
use support::store::{Redis, Webdis};
use support::{Build, DetachedHop, Envoy, EnvoyOptions, Shipped};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Sdk {
    Python,
    TypeScript,
}

/// Both SDKs, or the one `MCP_TEST_SDK` names (`python` or `typescript`).
fn sdks() -> Vec<Sdk> {
    match std::env::var("MCP_TEST_SDK").as_deref() {
        Ok("python") => vec![Sdk::Python],
        Ok("typescript") => vec![Sdk::TypeScript],
        _ => vec![Sdk::Python, Sdk::TypeScript],
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Answers {
    Json,
    Sse,
}

const ANSWERS: [Answers; 2] = [Answers::Json, Answers::Sse];

/// The MCP payments server (tests/mcp/server.py), killed when dropped.
struct McpServer {
    child: Child,
    port: u16,
}

impl McpServer {
    fn start(answers: Answers, stateful: bool) -> McpServer {
        let mut args = vec![];
        if answers == Answers::Json {
            args.push("--json");
        }
        if stateful {
            args.push("--stateful");
        }
        McpServer::spawn("target/mcp-venv", "tests/mcp/server.py", &args)
    }

    /// The counting server on the SDK's last 1.x line (tests/mcp1/server.py), with sessions
    /// unless `stateless`.
    fn start_1x(answers: Answers, stateless: bool) -> McpServer {
        let mut args = vec![];
        if answers == Answers::Json {
            args.push("--json");
        }
        if stateless {
            args.push("--stateless");
        }
        McpServer::spawn("target/mcp1-venv", "tests/mcp1/server.py", &args)
    }

    fn spawn(venv: &str, script: &str, args: &[&str]) -> McpServer {
        let root = support::repo_root();
        let python = root.join(venv).join("bin/python");
        assert!(python.exists(), "{} is missing: scripts/install-deps.sh mcp-sdk (make deps)", python.display());
        let mut cmd = Command::new(python);
        cmd.arg(root.join(script)).args(["--port", "0"]).args(args);
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("MCP server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("server's port");
        let port = line.trim().strip_prefix("listening ").and_then(|p| p.parse().ok()).expect("`listening <port>`");
        let server = McpServer { child, port };
        let up = (0..600).any(|_| {
            std::thread::sleep(Duration::from_millis(50));
            http::get(port, "/count").is_ok_and(|r| r.status == 200)
        });
        assert!(up, "the MCP server did not answer");
        server
    }

    /// Executions of `tool` so far.
    fn count(&self, tool: &str) -> u64 {
        let r = http::get(self.port, "/count").expect("count");
        r.json()[tool].as_u64().expect("a count")
    }

    /// Waits (bounded by count, 60 s at most) until `tool` has run `n` times.
    fn wait_count(&self, tool: &str, n: u64) {
        for _ in 0..1200 {
            if self.count(tool) >= n {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{tool} never reached {n} executions");
    }
}

impl Drop for McpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One caller process: `steps` calls of `tool` with the same key and arguments (see
/// tests/mcp/client.py: `same:T` in the current client, `new:T` in a new one, T its timeout).
#[derive(Clone)]
struct Call {
    key: Option<String>,
    via: &'static str,
    tool: &'static str,
    amount: u32,
    delay_ms: u32,
    steps: &'static str,
    /// The Python client's `mode` (`auto`: revision 2026-07-28, no session; `legacy`: initialize).
    mode: &'static str,
    /// `charge_then_fail`: the MCP error code the tool raises after it charged.
    fail_code: Option<i64>,
}

impl Call {
    fn new(key: &str, via: &'static str) -> Call {
        Call {
            key: Some(key.to_string()),
            via,
            tool: "charge",
            amount: 4200,
            delay_ms: 0,
            steps: "same:60",
            mode: "auto",
            fail_code: None,
        }
    }
}

fn command(sdk: Sdk, port: u16, c: &Call) -> Command {
    let root = support::repo_root();
    let mut cmd = match sdk {
        Sdk::Python => {
            let mut cmd = Command::new(root.join("target/mcp-venv/bin/python"));
            cmd.arg(root.join("tests/mcp/client.py")).args(["--mode", c.mode]);
            cmd
        }
        Sdk::TypeScript => {
            let mut cmd = Command::new("node");
            cmd.env("MCP_NODE_DIR", root.join("target/mcp-node")).arg(root.join("tests/mcp/client.mjs"));
            cmd
        }
    };
    cmd.args(["--url", &format!("http://127.0.0.1:{port}/mcp")])
        .args(["--key-via", c.via])
        .args(["--tool", c.tool])
        .args(["--amount", &c.amount.to_string()])
        .args(["--delay-ms", &c.delay_ms.to_string()])
        .args(["--steps", c.steps]);
    if let Some(k) = &c.key {
        cmd.args(["--key", k]);
    }
    if let Some(code) = c.fail_code {
        cmd.args(["--fail-code", &code.to_string()]);
    }
    cmd
}

/// Runs one caller; its steps, as the SDK returned or raised them.
fn call(sdk: Sdk, port: u16, c: &Call) -> Vec<Value> {
    let out = command(sdk, port, c).output().expect("MCP client");
    assert!(
        out.status.success(),
        "{sdk:?} client failed (make deps installs the SDKs: scripts/install-deps.sh mcp-sdk): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{sdk:?} report ({e}): {}", String::from_utf8_lossy(&out.stdout)));
    eprintln!("{sdk:?} {}: {r}", c.steps);
    r["steps"].as_array().expect("steps").clone()
}

/// The step returned a tool result (not an error, not `isError`); its text (the payment).
fn returned(step: &Value) -> String {
    assert_eq!(step["outcome"], "returned", "the SDK must return the tool's result: {step}");
    assert_eq!(step["is_error"], false, "{step}");
    let text = step["text"].as_str().expect("text").to_string();
    assert!(text.contains("\"payment\""), "{step}");
    text
}

/// The step raised idemgate's JSON-RPC error `code` with the problem `slug` in its data.
fn assert_raised(step: &Value, code: i64, slug: &str) {
    assert_eq!(step["outcome"], "raised", "the SDK must raise, not return, idemgate's refusal: {step}");
    assert_eq!(step["code"], code, "{step}");
    assert_eq!(step["data"]["type"], format!("urn:idemgate:problem:{slug}"), "{step}");
}

/// The MCP route under test (or `MCP_TEST_ROUTE`).
fn mcp_route() -> String {
    std::env::var("MCP_TEST_ROUTE").unwrap_or_else(|_| {
        r#"{"prefix": "/mcp", "protocol": "mcp",
            "mcp": {"tools": ["charge"], "key_arguments": ["idempotency_key", "idempotencyKey"]}}"#
            .to_string()
    })
}

/// Detached forwarding and `in_flight: "wait"`, as envoy/mcp/envoy.yaml ships them; `extra` adds
/// top-level fields (the store). The hop is not what these tests are about: the Wasm build goes
/// through the internal listener as shipped, the native build (`IDEMGATE_BUILD=native`) with
/// `upstream.hop: "direct"`, the one hop it carries (`support::Build::detached_hop`, which says
/// why it is the same scenario here: no filter after idemgate, no retries on the route).
fn plugin(extra: &str) -> String {
    plugin_with_route(extra, &mcp_route())
}

fn plugin_with_route(extra: &str, route: &str) -> String {
    let scope = if extra.contains("\"scope\"") { "" } else { r#", "scope": {"headers": ["authorization"]}"# };
    format!(
        r#"{{"lock_ttl_seconds": 60, "forwarding": "detached",
            "upstream": {upstream},
            "in_flight": "wait", "wait_ms": 30000{scope}{extra},
            "routes": [{route}]}}"#,
        upstream = hop().upstream,
    )
}

/// The hop of every test here, per build (`support::Build::detached_hop`).
fn hop() -> DetachedHop {
    Build::from_env().detached_hop(30_000)
}

fn options(plugin: &str, server: &McpServer) -> EnvoyOptions {
    let mut o = EnvoyOptions::new(plugin, server.port);
    o.internal_hop = hop().internal_hop;
    o.route_timeout_ms = 30_000;
    o
}

fn stack(answers: Answers, stateful: bool) -> (McpServer, Envoy) {
    let server = McpServer::start(answers, stateful);
    let envoy = Envoy::start(&options(&plugin(""), &server));
    (server, envoy)
}

const VIAS: [&str; 3] = ["header", "meta", "arg"];

/// The same call repeated in the same client (key from the Idempotency-Key header, from
/// `_meta.idempotencyKey`, from the tool argument `idempotency_key`): one execution, the same
/// result both times; a fresh key executes again.
#[test]
fn a_repeated_call_executes_once_and_returns_the_same_result() {
    for answers in ANSWERS {
        let (server, envoy) = stack(answers, false);
        let mut executions = 0;
        for sdk in sdks() {
            for via in VIAS {
                let key = format!("mcp-repeat-{sdk:?}-{answers:?}-{via}");
                let steps = call(sdk, envoy.port, &Call { steps: "same:60,same:60", ..Call::new(&key, via) });
                let (first, again) = (returned(&steps[0]), returned(&steps[1]));
                executions += 1;
                assert_eq!(again, first, "{sdk:?} {answers:?} key via {via}: the repeat returns the original");
                assert_eq!(server.count("charge"), executions, "{sdk:?} {answers:?} key via {via}: one execution");
            }
        }
        envoy.assert_no_wasm_panic();
    }
}

/// A retry from a new client: a new session on a stateful server (initialize + Mcp-Session-Id,
/// the Python client in `legacy` mode), none on a stateless one. Same result, one execution.
#[test]
fn a_retry_in_a_new_session_returns_the_original() {
    for (answers, stateful) in [(Answers::Json, true), (Answers::Sse, true), (Answers::Sse, false)] {
        let (server, envoy) = stack(answers, stateful);
        let mut executions = 0;
        for sdk in sdks() {
            let key = format!("mcp-session-{sdk:?}-{answers:?}-{stateful}");
            let mode = if stateful { "legacy" } else { "auto" };
            let steps = call(sdk, envoy.port, &Call { steps: "same:60,new:60", mode, ..Call::new(&key, "header") });
            executions += 1;
            assert_eq!(returned(&steps[1]), returned(&steps[0]), "{sdk:?} {answers:?} stateful={stateful}");
            assert_eq!(server.count("charge"), executions, "{sdk:?} {answers:?} stateful={stateful}");
        }
        envoy.assert_no_wasm_panic();
    }
}

/// Three callers with the same key at once, the tool slow: one execution, all three get its
/// result (the duplicates are held by `in_flight: "wait"`).
#[test]
fn concurrent_duplicates_execute_once() {
    for answers in ANSWERS {
        let (server, envoy) = stack(answers, false);
        for (i, sdk) in sdks().into_iter().enumerate() {
            let key = format!("mcp-concurrent-{sdk:?}-{answers:?}");
            let c = Call { delay_ms: 1500, ..Call::new(&key, "meta") };
            let port = envoy.port;
            let callers: Vec<_> = (0..3)
                .map(|_| {
                    let c = c.clone();
                    std::thread::spawn(move || call(sdk, port, &c))
                })
                .collect();
            let texts: Vec<String> = callers.into_iter().map(|t| returned(&t.join().unwrap()[0])).collect();
            assert!(texts.iter().all(|t| t == &texts[0]), "{sdk:?} {answers:?}: one result for all: {texts:?}");
            assert_eq!(server.count("charge"), i as u64 + 1, "{sdk:?} {answers:?}: one execution");
        }
        envoy.assert_no_wasm_panic();
    }
}

/// The same key with other arguments: raised by the SDK as an MCP error -32002 (key-reused), not
/// executed; the original arguments still get the original result.
#[test]
fn changed_arguments_are_raised_as_an_mcp_error() {
    for answers in ANSWERS {
        let (server, envoy) = stack(answers, false);
        for (i, sdk) in sdks().into_iter().enumerate() {
            let key = format!("mcp-reuse-{sdk:?}-{answers:?}");
            let first = returned(&call(sdk, envoy.port, &Call::new(&key, "arg"))[0]);
            let changed = call(sdk, envoy.port, &Call { amount: 9900, ..Call::new(&key, "arg") });
            assert_raised(&changed[0], -32002, "key-reused");
            assert_eq!(changed[0]["data"]["status"], 422, "{sdk:?} {answers:?}: {}", changed[0]);
            assert_eq!(changed[0]["data"]["retry"], false, "{sdk:?} {answers:?}: {}", changed[0]);
            assert_eq!(server.count("charge"), i as u64 + 1, "{sdk:?} {answers:?}: the changed call never ran");
            let again = returned(&call(sdk, envoy.port, &Call::new(&key, "arg"))[0]);
            assert_eq!(again, first, "{sdk:?} {answers:?}");
        }
        envoy.assert_no_wasm_panic();
    }
}

/// A lost response, through the shipped envoy/mcp/envoy.yaml: the SDK's own timeout (1 s) ends
/// the first call while the tool (3 s) goes on; the retry with the same key, in the same client,
/// gets the original result (held until it is known). One execution.
#[test]
fn a_lost_response_is_recovered_through_the_shipped_mcp_config() {
    for answers in ANSWERS {
        let server = McpServer::start(answers, false);
        let envoy = Shipped::start("envoy/mcp/envoy.yaml", server.port);
        for (i, sdk) in sdks().into_iter().enumerate() {
            let key = format!("mcp-lost-{sdk:?}-{answers:?}");
            let c = Call { delay_ms: 3000, steps: "same:1,same:60", ..Call::new(&key, "header") };
            let steps = call(sdk, envoy.port, &c);
            // The SDK's own timeout: an MCP error -32001 raised by the client itself.
            assert_eq!(steps[0]["outcome"], "raised", "{sdk:?} {answers:?}: {}", steps[0]);
            assert_eq!(steps[0]["code"], -32001, "{sdk:?} {answers:?}: {}", steps[0]);
            let text = returned(&steps[1]);
            assert!(text.contains(&format!("\"execution\": {}", i + 1)), "{sdk:?} {answers:?}: {text}");
            server.wait_count("charge", i as u64 + 1);
            assert_eq!(server.count("charge"), i as u64 + 1, "{sdk:?} {answers:?}: one execution");
        }
        envoy.assert_no_wasm_panic();
    }
}

/// Two proxies sharing Redis (behind webdis): a call on one, the retry (a new client) on the
/// other returns the original result without executing.
#[test]
fn a_retry_on_the_other_proxy_returns_the_original_through_the_store() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    // The clients reach each proxy at its own port (127.0.0.1:<port> as :authority), where a load
    // balancer would give both one authority: the caller scope leaves it out (README, "One
    // authority for all proxies").
    let store = r#", "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 2000},
        "scope": {"headers": ["authorization"], "include_authority": false}"#;
    for answers in ANSWERS {
        let server = McpServer::start(answers, false);
        let mut o = options(&plugin(store), &server);
        o.store_port = Some(webdis.port);
        let (a, b) = (Envoy::start(&o), Envoy::start(&o));
        for (i, sdk) in sdks().into_iter().enumerate() {
            let key = format!("mcp-two-{sdk:?}-{answers:?}");
            let first = returned(&call(sdk, a.port, &Call::new(&key, "meta"))[0]);
            // The store write lands from the root context after the answer: give it a moment.
            std::thread::sleep(Duration::from_millis(500));
            let other = returned(&call(sdk, b.port, &Call::new(&key, "meta"))[0]);
            assert_eq!(other, first, "{sdk:?} {answers:?}: the other proxy returns the original");
            assert_eq!(server.count("charge"), i as u64 + 1, "{sdk:?} {answers:?}: one execution");
        }
        a.assert_no_wasm_panic();
        b.assert_no_wasm_panic();
    }
}

fn rpc(envoy: &Envoy, accept: &str, headers: &[(&str, &str)], body: &str) -> http::Response {
    let mut h =
        vec![("content-type", "application/json"), ("accept", accept), ("authorization", "Bearer mcp-test-agent")];
    h.extend_from_slice(headers);
    http::request(envoy.port, "POST", "/mcp", &h, body.as_bytes()).expect("request")
}

/// The JSON-RPC message of an answer: the body itself (application/json) or the data of its
/// last `message` event (text/event-stream).
fn message(r: &http::Response) -> Value {
    let text = r.body_text();
    if r.header("content-type").is_some_and(|t| t.starts_with("text/event-stream")) {
        let mut data = text.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim).filter(|d| !d.is_empty());
        serde_json::from_str(data.next_back().expect("an SSE data line")).expect("JSON-RPC in SSE")
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("JSON-RPC body ({e}): {text}"))
    }
}

/// On the wire, not through an SDK (the Python SDK repairs ids): the replay carries the retry's
/// id (a string after a number), the first answer's result, `idempotent-replayed: true`, in the
/// first answer's type; tools/list and the read-only tool (not in `mcp.tools`) pass, never
/// replayed; a refusal is a JSON-RPC error on status 200 with the request's id.
#[test]
fn a_replay_answers_the_retrys_id_on_the_wire() {
    for answers in ANSWERS {
        let (server, envoy) = stack(answers, false);
        let accept = "application/json, text/event-stream";
        let call = |id: &str, amount: u32| {
            format!(
                r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"charge","arguments":{{"amount":{amount},"currency":"eur"}}}}}}"#
            )
        };
        let key = [("idempotency-key", "mcp-wire")];
        let first = rpc(&envoy, accept, &key, &call("1", 4200));
        assert_eq!(first.status, 200, "{answers:?}: {}", first.body_text());
        let first_msg = message(&first);
        assert_eq!(first_msg["id"], 1, "{answers:?}");
        let replay = rpc(&envoy, accept, &key, &call(r#""retry-7""#, 4200));
        eprintln!("{answers:?} replay: {:?} {}", replay.headers, replay.body_text());
        assert_eq!(replay.status, 200, "{answers:?}: {}", replay.body_text());
        assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{answers:?}");
        let replay_msg = message(&replay);
        assert_eq!(replay_msg["id"], "retry-7", "{answers:?}: the retry's id, as the retry sent it");
        assert_eq!(replay_msg["result"], first_msg["result"], "{answers:?}");
        let sse = |r: &http::Response| r.header("content-type").is_some_and(|t| t.starts_with("text/event-stream"));
        assert_eq!(sse(&replay), sse(&first), "{answers:?}: the first answer's type");
        assert_eq!(server.count("charge"), 1, "{answers:?}");

        let reused = rpc(&envoy, accept, &key, &call("9", 1));
        eprintln!("{answers:?} reused: {:?} {}", reused.headers, reused.body_text());
        assert_eq!(reused.status, 200, "{answers:?}: {}", reused.body_text());
        let err = message(&reused);
        assert_eq!(err["id"], 9, "{answers:?}");
        assert_eq!(err["error"]["code"], -32002, "{answers:?}");
        assert_eq!(err["error"]["data"]["type"], "urn:idemgate:problem:key-reused", "{answers:?}");
        assert_eq!(server.count("charge"), 1, "{answers:?}");

        let list = r#"{"jsonrpc":"2.0","id":3,"method":"tools/list","params":{}}"#;
        for _ in 0..2 {
            let r = rpc(&envoy, accept, &key, list);
            assert_eq!(r.status, 200, "{answers:?}: {}", r.body_text());
            assert_eq!(r.header("idempotent-replayed"), None, "{answers:?}: tools/list is never replayed");
            let tools = message(&r);
            assert!(tools["result"]["tools"].as_array().is_some_and(|t| t.len() == 4), "{tools}");
        }
        let balance = r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"balance","arguments":{"currency":"eur"}}}"#;
        for _ in 0..2 {
            let r = rpc(&envoy, accept, &[("idempotency-key", "mcp-wire-balance")], balance);
            assert_eq!(r.status, 200, "{answers:?}: {}", r.body_text());
            assert_eq!(r.header("idempotent-replayed"), None, "{answers:?}: an unprotected tool");
        }
        assert_eq!(server.count("balance"), 2, "{answers:?}: the read-only tool runs each time");
        envoy.assert_no_wasm_panic();
    }
}

/// On the wire: the client's `notifications/cancelled` for a protected call in flight passes to
/// the server and never releases the key (the retry is held and gets the original, one
/// execution); a JSON-RPC batch holding a protected call is refused whole (-32007, one error per
/// request with an id), nothing executed.
#[test]
fn a_cancel_never_releases_the_key_and_a_batch_is_refused() {
    let (server, envoy) = stack(Answers::Json, false);
    let accept = "application/json, text/event-stream";
    let slow = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":4200,"currency":"eur","delay_ms":2000}}}"#;
    let key = [("idempotency-key", "mcp-cancel")];
    let port = envoy.port;
    let first = std::thread::spawn(move || {
        let h = [
            ("content-type", "application/json"),
            ("accept", accept),
            ("authorization", "Bearer mcp-test-agent"),
            ("idempotency-key", "mcp-cancel"),
        ];
        http::request(port, "POST", "/mcp", &h, slow.as_bytes()).expect("first")
    });
    server.wait_count("charge", 1);
    let cancel = r#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":1,"reason":"timeout"}}"#;
    let c = rpc(&envoy, accept, &key, cancel);
    assert!(c.status == 202 || c.status == 200, "the notification reaches the server: {} {}", c.status, c.body_text());
    assert_eq!(c.header("idempotent-replayed"), None);
    let retry = rpc(&envoy, accept, &key, &slow.replace(r#""id":1"#, r#""id":2"#));
    assert_eq!(retry.status, 200, "{}", retry.body_text());
    let first = first.join().unwrap();
    let (a, b) = (message(&first), message(&retry));
    assert_eq!(b["id"], 2);
    assert_eq!(b["result"], a["result"], "the retry after a cancel gets the original");
    assert_eq!(server.count("charge"), 1, "the cancel released nothing");

    let batch = r#"[{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"charge","arguments":{"amount":1,"currency":"eur"}}},
                    {"jsonrpc":"2.0","id":"six","method":"tools/list","params":{}},
                    {"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":1,"progress":1}}]"#;
    let r = rpc(&envoy, accept, &[("idempotency-key", "mcp-batch")], batch);
    eprintln!("batch: {} {:?} {}", r.status, r.headers, r.body_text());
    assert_eq!(r.status, 200, "{}", r.body_text());
    let errors: Value = serde_json::from_slice(&r.body).expect("a JSON array");
    let errors = errors.as_array().expect("one error per request with an id");
    assert_eq!(errors.len(), 2, "{errors:?}");
    for (e, id) in errors.iter().zip([serde_json::json!(5), serde_json::json!("six")]) {
        assert_eq!(e["id"], id, "{e}");
        assert_eq!(e["error"]["code"], -32007, "{e}");
    }
    assert_eq!(server.count("charge"), 1, "nothing of the batch executed");
    envoy.assert_no_wasm_panic();
}

/// Review (adversarial): idemgate read `content-type: application/grpc, application/json` as gRPC
/// and passed a keyless gRPC request before its body, so a `_meta` key was never seen and a server
/// that does not check the type (tests/it/mcp.rs's counting upstream) ran each send. The official
/// Python server (mcp 2.3.0) refuses that type itself (its transport check asks for a type
/// starting with `application/json`, seen here straight to the server), so against it this was
/// no break; through idemgate the call is now refused before any server sees it.
#[test]
fn a_tools_call_under_a_grpc_content_type_is_refused_before_the_server() {
    let (server, envoy) = stack(Answers::Json, false);
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":4200,"currency":"eur"},"_meta":{"idempotencyKey":"mcp-grpc-typed"}}}"#;
    let h = [
        ("content-type", "application/grpc, application/json"),
        ("accept", "application/json, text/event-stream"),
        ("authorization", "Bearer mcp-test-agent"),
    ];
    let direct = http::request(server.port, "POST", "/mcp", &h, body.as_bytes()).expect("request");
    eprintln!("straight to the server: {} {}", direct.status, direct.body_text());
    assert_eq!(direct.status, 400, "the official server refuses this content-type itself");
    for _ in 0..2 {
        let r = http::request(envoy.port, "POST", "/mcp", &h, body.as_bytes()).expect("request");
        eprintln!("through idemgate: {} {}", r.status, r.body_text());
        let m = message(&r);
        assert_eq!(m["id"], 1);
        assert_eq!(m["error"]["data"]["type"], "urn:idemgate:problem:mcp-body-ambiguous");
    }
    assert_eq!(server.count("charge"), 0, "nothing executed");
    envoy.assert_no_wasm_panic();
}

/// Issue 40: a tool that charges, then raises an MCP error. At revision 2026-07-28 (the Python
/// client's `auto` mode) the Python SDK 2.3.0 answers it with the status its
/// `ERROR_CODE_HTTP_STATUS` maps the code to (400 for -32600, 404 for -32601) and a JSON-RPC error
/// body carrying the request's id; at 2025-11-25 (the TypeScript client) with 200. An MCP route
/// released 400 and 404 as refusals before dispatch, so the retry (a new client, the same key) ran
/// the tool again: 2 executions. Now an answer carrying the call's JSON-RPC response is the
/// call's result whatever its status: stored, and the retry gets the same error, one execution.
#[test]
fn a_tool_that_raises_after_it_charged_executes_once() {
    let route = mcp_route().replace(r#"["charge"]"#, r#"["charge", "charge_then_fail"]"#);
    for answers in ANSWERS {
        let server = McpServer::start(answers, false);
        let envoy = Envoy::start(&options(&plugin_with_route("", &route), &server));
        let mut executions = 0;
        for sdk in sdks() {
            for code in [-32600, -32601] {
                let key = format!("mcp-raise-{sdk:?}-{answers:?}-{code}");
                let c = Call {
                    tool: "charge_then_fail",
                    steps: "same:60,new:60",
                    fail_code: Some(code),
                    ..Call::new(&key, "header")
                };
                let steps = call(sdk, envoy.port, &c);
                executions += 1;
                for step in &steps {
                    assert_eq!(step["outcome"], "raised", "{sdk:?} {answers:?} {code}: {step}");
                    assert_eq!(step["code"], code, "{sdk:?} {answers:?} {code}: the tool's own error: {step}");
                }
                assert_eq!(
                    server.count("charge_then_fail"),
                    executions,
                    "{sdk:?} {answers:?} {code}: the retry replays the error, the tool ran once"
                );
            }
        }
        envoy.assert_no_wasm_panic();
    }
}

/// Issue 40: a tool that asks for confirmation first (`Resolve(Elicit)`: at 2026-07-28 an
/// `InputRequiredResult`, `resultType: "input_required"`) is one call over several rounds: the
/// SDK's driver re-sends it with `inputResponses` and `requestState` under the same key. By
/// default (`mcp.input_required` "await": the round's question kept as the call's awaiting
/// record) each round is answered as it would be: the driver finishes with one execution, and a
/// later call with the key (a new client, the driver again) gets the same final result, still
/// one execution; another call under the key is refused. (Before the awaiting record, the
/// default stored round 1's answer as the call's completion and replayed it to every later
/// round, so the tool never ran: the driver gave up after 10 rounds with
/// `InputRequiredRoundsExceededError`, as "keep" still does.) `"release"` finishes too, for
/// routes that set it. Python only: the TypeScript SDK at 1.32.2 does not speak 2026-07-28.
#[test]
fn a_tool_that_asks_first_runs_once_through_the_sdks_driver() {
    let tools = r#"["charge", "confirm_charge"]"#;
    let awaits = mcp_route().replace(r#"["charge"]"#, tools);
    assert!(!awaits.contains("input_required"), "the default: {awaits}");
    let release = awaits.replace(r#""key_arguments":"#, r#""input_required": "release", "key_arguments":"#);
    assert!(release.contains(r#""input_required": "release""#), "{release}");
    let runs = [(ANSWERS[0], &awaits), (ANSWERS[1], &awaits), (ANSWERS[0], &release)];
    for (answers, route) in runs {
        let server = McpServer::start(answers, false);
        let envoy = Envoy::start(&options(&plugin_with_route("", route), &server));
        let mut executions = 0;
        for via in ["header", "meta"] {
            let key = format!("mcp-asks-first-{answers:?}-{via}");
            let c = Call { tool: "confirm_charge", steps: "same:60,new:60", ..Call::new(&key, via) };
            let steps = call(Sdk::Python, envoy.port, &c);
            executions += 1;
            let (first, again) = (returned(&steps[0]), returned(&steps[1]));
            assert!(first.contains("\"confirmed\": true"), "{answers:?} {via}: {first}");
            assert_eq!(again, first, "{answers:?} {via}: the retry gets the final result");
            assert_eq!(server.count("confirm_charge"), executions, "{answers:?} {via}: one execution");
            // Another call under the key (other arguments) is still refused.
            let other = call(Sdk::Python, envoy.port, &Call { amount: 1, ..c.clone() });
            assert_raised(&other[0], -32002, "key-reused");
            assert_eq!(server.count("confirm_charge"), executions, "{answers:?} {via}: refused, not run");
        }
        envoy.assert_no_wasm_panic();
    }
    // "keep" keeps the first round as the call's answer: the driver raises, the tool never runs.
    let keep = awaits.replace(r#""key_arguments":"#, r#""input_required": "keep", "key_arguments":"#);
    let server = McpServer::start(ANSWERS[0], false);
    let envoy = Envoy::start(&options(&plugin_with_route("", &keep), &server));
    let c = Call { tool: "confirm_charge", steps: "same:60", ..Call::new("mcp-asks-first-kept", "header") };
    let steps = call(Sdk::Python, envoy.port, &c);
    assert_eq!(steps[0]["outcome"], "raised", "{}", steps[0]);
    assert_eq!(steps[0]["error_type"], "InputRequiredRoundsExceededError", "{}", steps[0]);
    assert_eq!(server.count("confirm_charge"), 0, "nothing ran");
    envoy.assert_no_wasm_panic();
}

/// Issue 40: the Python SDK's 1.x servers (`mcp` 1.30.0, tests/mcp1/, with sessions) answer every
/// request their transport refuses with a JSON-RPC error whose id is the string "server-error"
/// (no request id). Read in its source (docs/mcp.md, "What releases a key"), each `4xx` so
/// answered comes before the message reaches the server: a call sent without a session (`400`),
/// for an unknown session (`404`), not accepting JSON (`406`), not sent as JSON (`415`), under a
/// protocol version it does not speak (`400`). idemgate read that id as another call's answer, so
/// the refusal left the key outcome-unknown and the client's retry in its session got `-32003`
/// for a call that never ran (seen before the fix: the retry's message was
/// `{"error":{"code":-32003,...}}` and `charge` ran 0 times). Now such a refusal releases the key
/// as one with `"id": null` does: the retry executes once and its retry is replayed.
#[test]
fn a_1x_servers_refusals_before_dispatch_release_the_key() {
    for answers in ANSWERS {
        let server = McpServer::start_1x(answers, false);
        let envoy = Envoy::start(&options(&plugin(""), &server));
        let accept = "application/json, text/event-stream";
        let init = r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"idemgate-test","version":"1"}}}"#;
        let opened = rpc(&envoy, accept, &[], init);
        assert_eq!(opened.status, 200, "{answers:?}: {}", opened.body_text());
        let sid = opened.header("mcp-session-id").expect("a session").to_string();
        let initialized = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
        assert_eq!(rpc(&envoy, accept, &[("mcp-session-id", &sid)], initialized).status, 202);
        let call = |id: u32| {
            format!(
                r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"charge","arguments":{{"amount":12,"currency":"eur"}}}}}}"#
            )
        };
        // (what is wrong, its headers, its content type, its accept, the SDK's status)
        type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, &'a str, &'a str, u16);
        let cases: [Case; 5] = [
            ("no session", vec![], "application/json", accept, 400),
            ("unknown session", vec![("mcp-session-id", "0123456789abcdef")], "application/json", accept, 404),
            ("accept", vec![("mcp-session-id", &sid)], "application/json", "text/plain", 406),
            // (Its transport security answers a type not opening with `application/json` 400, as
            // text, without an id: released before as now.)
            ("content type", vec![("mcp-session-id", &sid)], "application/json-seq", accept, 415),
            (
                "protocol version",
                vec![("mcp-session-id", &sid), ("mcp-protocol-version", "1999-01-01")],
                "application/json",
                accept,
                400,
            ),
        ];
        for (i, (what, headers, content_type, refused_accept, status)) in cases.into_iter().enumerate() {
            let key = format!("k-1x-{i}");
            let mut h = vec![
                ("content-type", content_type),
                ("accept", refused_accept),
                ("authorization", "Bearer mcp-test-agent"),
                ("idempotency-key", key.as_str()),
            ];
            h.extend_from_slice(&headers);
            let refused = http::request(envoy.port, "POST", "/mcp", &h, call(1).as_bytes()).expect("request");
            println!("{answers:?} {what}: {} {}", refused.status, refused.body_text());
            assert_eq!(refused.status, status, "{answers:?} {what}: {}", refused.body_text());
            assert_eq!(refused.json()["id"], "server-error", "{answers:?} {what}");
            assert_eq!(server.count("charge"), i as u64, "{answers:?} {what}: the SDK refused it before dispatch");
            let in_session = [("mcp-session-id", sid.as_str()), ("idempotency-key", key.as_str())];
            let retry = rpc(&envoy, accept, &in_session, &call(2));
            let m = message(&retry);
            println!("{answers:?} {what}: retry {} {m}", retry.status);
            assert_eq!(retry.status, 200, "{answers:?} {what}");
            assert!(m["error"].is_null(), "{answers:?} {what}: the retry runs, never outcome-unknown: {m}");
            assert_eq!(m["id"], 2);
            assert_eq!(server.count("charge"), i as u64 + 1, "{answers:?} {what}: the retry executed, once");
            let again = rpc(&envoy, accept, &in_session, &call(3));
            assert_eq!(again.header("idempotent-replayed"), Some("true"), "{answers:?} {what}");
            assert_eq!(message(&again)["result"], m["result"], "{answers:?} {what}");
            assert_eq!(message(&again)["id"], 3);
            assert_eq!(server.count("charge"), i as u64 + 1, "{answers:?} {what}: executed once in all");
        }
        envoy.assert_no_wasm_panic();
    }
}

/// Issue 40: at revision 2026-07-28 the Python SDK (2.3.0) answers an error raised in a tool with
/// `400` (-32600) or `404` (-32601) and the call's JSON-RPC error, which idemgate stores as the
/// call's answer. Its replay must carry what every replay carries: `idempotent-replayed: true`,
/// `idempotency-key-expires-in` (the record's remaining lifetime), the retry's id, the first
/// answer's status, type and error. On the wire (raw HTTP), against a `200` result's replay.
#[test]
fn a_stored_tool_error_is_replayed_with_the_headers_of_every_replay() {
    let route = mcp_route().replace(r#"["charge"]"#, r#"["charge", "charge_then_fail"]"#);
    for answers in ANSWERS {
        let server = McpServer::start(answers, false);
        let envoy = Envoy::start(&options(&plugin_with_route(r#", "ttl_seconds": 3600"#, &route), &server));
        let accept = "application/json, text/event-stream";
        let call = |id: &str, tool: &str, code: i64| {
            format!(
                r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{tool}","arguments":{{"amount":5,"currency":"eur","code":{code}}},"_meta":{{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientCapabilities":{{}}}}}}}}"#
            )
        };
        let mut executions = 0;
        for (tool, code, status) in [("charge_then_fail", -32600, 400), ("charge_then_fail", -32601, 404)] {
            let key = format!("mcp-stored-error-{answers:?}-{code}");
            let h = [
                ("idempotency-key", key.as_str()),
                ("mcp-protocol-version", "2026-07-28"),
                ("mcp-method", "tools/call"),
                ("mcp-name", tool),
            ];
            let first = rpc(&envoy, accept, &h, &call("1", tool, code));
            println!("{answers:?} {code} first: {} {:?} {}", first.status, first.headers, first.body_text());
            assert_eq!(first.status, status, "{answers:?} {code}: {}", first.body_text());
            assert_eq!(message(&first)["error"]["code"], code);
            executions += 1;
            assert_eq!(server.count(tool), executions);
            let replay = rpc(&envoy, accept, &h, &call(r#""r-2""#, tool, code));
            println!("{answers:?} {code} replay: {} {:?} {}", replay.status, replay.headers, replay.body_text());
            assert_eq!(replay.status, status, "{answers:?} {code}: the first answer's status");
            assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{answers:?} {code}");
            let left = replay.header("idempotency-key-expires-in").and_then(|v| v.parse::<u64>().ok());
            assert!(left.is_some_and(|s| s > 3500 && s <= 3600), "{answers:?} {code}: the record's lifetime: {left:?}");
            assert_eq!(replay.header("content-type"), first.header("content-type"), "{answers:?} {code}");
            let m = message(&replay);
            assert_eq!(m["id"], "r-2", "{answers:?} {code}");
            assert_eq!(m["error"], message(&first)["error"], "{answers:?} {code}");
            assert_eq!(server.count(tool), executions, "{answers:?} {code}: replayed, not run");
        }
        envoy.assert_no_wasm_panic();
    }
}

/// Issue 40, item 4, against the real servers (Python SDK 2.3.0 at revision 2025-11-25 and 1.30.0,
/// both stateless): a `tools/call` without an id, or with `"id": null`, sent straight to the
/// server runs nothing (both answer `202`, taking it for a notification), which is why idemgate
/// refuses it (`mcp-body-ambiguous`, `"id": null`) rather than protect it as a call whose answer
/// never comes; through Envoy it never reaches the server and leaves the key free for the call.
/// `params.task`: both servers run a call of a tool without task support as if it were absent
/// (the tool's own result), yet idemgate fingerprints it (a server with tasks answers the task
/// it created instead): the same key with and without it is `key-reused`, never a second run
/// and never the other's answer.
#[test]
fn calls_without_an_id_or_with_a_task_against_the_sdk_servers() {
    for (name, server) in
        [("2.3.0", McpServer::start(Answers::Json, false)), ("1.30.0", McpServer::start_1x(Answers::Json, true))]
    {
        let envoy = Envoy::start(&options(&plugin(""), &server));
        let accept = "application/json, text/event-stream";
        let version = [("mcp-protocol-version", "2025-11-25")];
        let args = r#""name":"charge","arguments":{"amount":9,"currency":"eur"}"#;
        let no_id = format!(r#"{{"jsonrpc":"2.0","method":"tools/call","params":{{{args}}}}}"#);
        let null_id = format!(r#"{{"jsonrpc":"2.0","id":null,"method":"tools/call","params":{{{args}}}}}"#);
        for body in [&no_id, &null_id] {
            let mut h = vec![("content-type", "application/json"), ("accept", accept)];
            h.extend_from_slice(&version);
            let direct = http::request(server.port, "POST", "/mcp", &h, body.as_bytes()).expect("request");
            println!("{name} direct {body}: {} {}", direct.status, direct.body_text());
            assert_eq!(direct.status, 202, "{name}: the server takes it for a notification");
            let through = rpc(&envoy, accept, &[version[0], ("idempotency-key", "k-sdk-no-id")], body);
            println!("{name} through Envoy: {} {}", through.status, through.body_text());
            let m = message(&through);
            assert_eq!(m["id"], Value::Null, "{name}");
            assert_eq!(m["error"]["data"]["type"], "urn:idemgate:problem:mcp-body-ambiguous", "{name}");
        }
        // (A run after the 202 would also show in the exact counts below, after three more calls.)
        assert_eq!(server.count("charge"), 0, "{name}: neither ran, at the server or through idemgate");
        let call = |id: u32, task: &str| {
            format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{{args}{task}}}}}"#)
        };
        let first = rpc(&envoy, accept, &[version[0], ("idempotency-key", "k-sdk-no-id")], &call(1, ""));
        assert!(message(&first)["result"].is_object(), "{name}: the key is free: {}", first.body_text());
        assert_eq!(server.count("charge"), 1, "{name}");
        let task = r#","task":{"ttl":60000}"#;
        let key = [version[0], ("idempotency-key", "k-sdk-task")];
        let with_task = rpc(&envoy, accept, &key, &call(2, task));
        println!("{name} with a task: {} {}", with_task.status, with_task.body_text());
        assert!(message(&with_task)["result"].is_object(), "{name}: the tool's own result: {}", with_task.body_text());
        assert_eq!(server.count("charge"), 2, "{name}");
        let again = rpc(&envoy, accept, &key, &call(3, task));
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{name}");
        let without = rpc(&envoy, accept, &key, &call(4, ""));
        println!("{name} without the task: {} {}", without.status, without.body_text());
        assert_eq!(message(&without)["error"]["data"]["type"], "urn:idemgate:problem:key-reused", "{name}");
        assert_eq!(server.count("charge"), 2, "{name}: never a second run");
        envoy.assert_no_wasm_panic();
    }
}
