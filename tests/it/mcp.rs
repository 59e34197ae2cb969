//! MCP tool calls (`protocol: "mcp"`, issue 28) through the real Envoy 1.40 and idemgate, in front
//! of a counting JSON-RPC upstream (tests/it/support/mcp_upstream.rs), over raw HTTP so every id is
//! checked on the wire. Every test counts the executions of `tools/call` at the upstream.

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use support::http::{self, Response};
use support::mcp_upstream::McpUpstream;
use support::store::{Redis, Webdis};
use support::{Build, Envoy, EnvoyOptions};

const ROUTE: &str =
    r#"{"prefix": "/mcp", "protocol": "mcp", "mcp": {"tools": ["charge"], "key_arguments": ["idempotency_key"]}"#;

fn plugin(route_extra: &str, top_extra: &str) -> String {
    format!(r#"{{"scope": {{"headers": ["authorization"]}}{top_extra}, "routes": [{ROUTE}{route_extra}}}]}}"#)
}

struct Mcp {
    up: McpUpstream,
    envoy: Envoy,
}

impl Mcp {
    fn start(plugin: &str) -> Mcp {
        Mcp::start_on(Build::from_env(), plugin)
    }

    /// With `build` loaded (`native_module::` runs the cases it shares for both builds).
    fn start_on(build: Build, plugin: &str) -> Mcp {
        let up = McpUpstream::start();
        let mut o = EnvoyOptions::new(plugin, up.port);
        o.build = build;
        let envoy = Envoy::start(&o);
        Mcp { up, envoy }
    }
}

impl Drop for Mcp {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.envoy.assert_no_wasm_panic();
        }
    }
}

const ALICE: (&str, &str) = ("authorization", "Bearer alice");
const BOTH: (&str, &str) = ("accept", "application/json, text/event-stream");

fn tools_call(id: Value, tool: &str, arguments: Value, meta: Value) -> Vec<u8> {
    let mut params = json!({"name": tool, "arguments": arguments});
    if !meta.is_null() {
        params["_meta"] = meta;
    }
    serde_json::to_vec(&json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params})).unwrap()
}

fn post(port: u16, headers: &[(&str, &str)], body: &[u8]) -> Response {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    http::request(port, "POST", "/mcp", &h, body).expect("answer")
}

/// The JSON-RPC message of an answer: the body, or the data of its last SSE event.
fn message(r: &Response) -> Value {
    if r.header("content-type").is_some_and(|c| c.starts_with("text/event-stream")) {
        let text = r.body_text();
        let last = text.split("\n\n").filter(|e| !e.trim().is_empty()).last().unwrap_or("").to_string();
        let data: Vec<&str> = last.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        return serde_json::from_str(&data.join("\n")).unwrap_or(Value::Null);
    }
    r.json()
}

fn error_type(m: &Value) -> String {
    m["error"]["data"]["type"].as_str().unwrap_or("").trim_start_matches("urn:idemgate:problem:").to_string()
}

#[test]
fn a_repeated_call_executes_once_and_the_retry_gets_its_own_id() {
    repeated_call_executes_once(Build::from_env());
}

/// A `tools/call` executed once, its retry replayed with the retry's own id, with `build` loaded.
pub(crate) fn repeated_call_executes_once(build: Build) {
    let s = Mcp::start_on(build, &plugin("", ""));
    let args = json!({"amount": 5, "to": "acct-1"});
    let first = post(
        s.envoy.port,
        &[ALICE, BOTH, ("idempotency-key", "k-1"), ("mcp-session-id", "s-1")],
        &tools_call(json!(1), "charge", args.clone(), json!({"progressToken": 1})),
    );
    assert_eq!(first.status, 200, "{}", first.body_text());
    let m1 = message(&first);
    assert_eq!(m1["id"], 1);
    // The retry: a string id, a new session, another progress token, members in another order.
    let retry_body = br#"{"params":{"_meta":{"progressToken":"p-9"},"arguments":{"to":"acct-1","amount":5},"name":"charge"},"method":"tools/call","id":"retry-2","jsonrpc":"2.0"}"#;
    let retry = post(s.envoy.port, &[ALICE, BOTH, ("idempotency-key", "k-1"), ("mcp-session-id", "s-2")], retry_body);
    println!("retry: {} {:?} {}", retry.status, retry.headers, retry.body_text());
    assert_eq!(retry.status, 200);
    let m2 = message(&retry);
    assert_eq!(m2["id"], "retry-2", "the retry's own id, as a string");
    assert_eq!(m2["result"], m1["result"]);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.header("mcp-session-id"), None, "the first caller's session is never replayed");
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn the_key_comes_from_meta_or_from_a_named_argument() {
    let s = Mcp::start(&plugin("", ""));
    for (i, (args, meta)) in [
        (json!({"amount": 1}), json!({"idempotencyKey": "meta-key-1"})),
        (json!({"amount": 2, "idempotency_key": "arg-key-1"}), Value::Null),
    ]
    .into_iter()
    .enumerate()
    {
        let a = post(s.envoy.port, &[ALICE, BOTH], &tools_call(json!(10 + i), "charge", args.clone(), meta.clone()));
        let b = post(s.envoy.port, &[ALICE, BOTH], &tools_call(json!(20 + i), "charge", args, meta));
        assert_eq!(message(&a)["id"], 10 + i);
        let mb = message(&b);
        println!("case {i}: {}", b.body_text());
        assert_eq!(mb["id"], 20 + i);
        assert_eq!(mb["result"], message(&a)["result"]);
        assert_eq!(s.up.executions(), i + 1, "case {i}");
    }
}

#[test]
fn other_arguments_under_the_key_are_refused_as_a_json_rpc_error() {
    other_arguments_under_the_key_refused(Build::from_env());
}

/// Another call under the same key: a JSON-RPC `key-reused` error, never executed, with `build`.
pub(crate) fn other_arguments_under_the_key_refused(build: Build) {
    let s = Mcp::start_on(build, &plugin("", ""));
    let h = [ALICE, BOTH, ("idempotency-key", "k-args")];
    post(s.envoy.port, &h, &tools_call(json!(1), "charge", json!({"amount": 5}), Value::Null));
    let r = post(s.envoy.port, &h, &tools_call(json!(2), "charge", json!({"amount": 6}), Value::Null));
    println!("{} {}", r.status, r.body_text());
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let m = message(&r);
    assert_eq!(m["id"], 2);
    assert_eq!(m["error"]["code"], -32002);
    assert_eq!(error_type(&m), "key-reused");
    assert_eq!(m["error"]["data"]["retry"], false);
    // Another number spelling is another request too (canonical JSON keeps spellings).
    let r = post(s.envoy.port, &h, &tools_call(json!(3), "charge", json!({"amount": 5.0}), Value::Null));
    assert_eq!(message(&r)["error"]["code"], -32002);
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn unprotected_methods_and_tools_pass_untouched_even_with_a_key() {
    let s = Mcp::start(&plugin("", ""));
    let h = [ALICE, BOTH, ("idempotency-key", "k-same")];
    let list = br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#;
    let init = br#"{"jsonrpc":"2.0","id":2,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}"#;
    for _ in 0..2 {
        assert_eq!(message(&post(s.envoy.port, &h, list))["id"], 1);
        assert_eq!(message(&post(s.envoy.port, &h, init))["id"], 2);
        let lookup = post(s.envoy.port, &h, &tools_call(json!(3), "lookup", json!({}), Value::Null));
        assert!(message(&lookup)["result"]["execution"].as_u64().is_some());
        let cancel = br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":1}}"#;
        assert_eq!(post(s.envoy.port, &h, cancel).status, 202);
    }
    assert_eq!(s.up.count("tools/list"), 2);
    assert_eq!(s.up.count("initialize"), 2);
    assert_eq!(s.up.count("notifications/cancelled"), 2);
    assert_eq!(s.up.executions(), 2, "an unlisted tool is not protected");
}

#[test]
fn a_batch_holding_a_protected_call_is_refused_whole() {
    let s = Mcp::start(&plugin("", ""));
    let batch = br#"[{"jsonrpc":"2.0","id":"a","method":"tools/list"},{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge","arguments":{}}},{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"charge","arguments":{}}}]"#;
    let r = post(s.envoy.port, &[ALICE, BOTH, ("idempotency-key", "k-batch")], batch);
    println!("{} {}", r.status, r.body_text());
    assert_eq!(r.status, 200);
    let v = r.json();
    let errors = v.as_array().expect("an array of errors");
    assert_eq!(errors.len(), 3);
    assert_eq!(errors[1]["id"], 7);
    assert_eq!(errors[1]["error"]["code"], -32007);
    assert_eq!(error_type(&errors[1]), "mcp-batch-refused");
    assert_eq!(s.up.executions(), 0);
    assert_eq!(s.up.count("tools/list"), 0);
}

#[test]
fn an_event_stream_answer_is_replayed_as_its_final_response_in_the_form_the_retry_accepts() {
    event_stream_answer_replayed_as_accepted(Build::from_env());
}

/// An event-stream answer replayed as its final response, as JSON or one event, with `build`.
pub(crate) fn event_stream_answer_replayed_as_accepted(build: Build) {
    let s = Mcp::start_on(build, &plugin("", ""));
    let h = |accept: &'static str| [ALICE, ("accept", accept), ("idempotency-key", "k-sse"), ("x-mcp-answer", "sse")];
    let first = post(
        s.envoy.port,
        &h("application/json, text/event-stream"),
        &tools_call(json!(1), "charge", json!({"amount": 1}), Value::Null),
    );
    assert_eq!(first.header("content-type"), Some("text/event-stream"));
    let m1 = message(&first);
    assert_eq!(m1["id"], 1);
    let sse = post(
        s.envoy.port,
        &h("application/json, text/event-stream"),
        &tools_call(json!(2), "charge", json!({"amount": 1}), Value::Null),
    );
    println!("sse replay: {:?} {}", sse.headers, sse.body_text());
    assert_eq!(sse.header("content-type"), Some("text/event-stream"));
    assert!(sse.body_text().starts_with("event: message\ndata: "), "{}", sse.body_text());
    assert!(!sse.body_text().contains("notifications/progress"), "earlier events are not kept");
    assert_eq!(message(&sse)["id"], 2);
    assert_eq!(message(&sse)["result"], m1["result"]);
    let json_only =
        post(s.envoy.port, &h("application/json"), &tools_call(json!(3), "charge", json!({"amount": 1}), Value::Null));
    assert_eq!(json_only.header("content-type"), Some("application/json"));
    assert_eq!(json_only.json()["id"], 3);
    assert_eq!(json_only.json()["result"], m1["result"]);
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn an_event_stream_without_its_final_response_is_outcome_unknown_never_a_success() {
    let s = Mcp::start(&plugin("", ""));
    let h = [ALICE, BOTH, ("idempotency-key", "k-cut"), ("x-mcp-answer", "sse-cut")];
    post(s.envoy.port, &h, &tools_call(json!(1), "charge", json!({"amount": 1}), Value::Null));
    let r = post(s.envoy.port, &h, &tools_call(json!(2), "charge", json!({"amount": 1}), Value::Null));
    println!("{} {}", r.status, r.body_text());
    let m = message(&r);
    assert_eq!(m["id"], 2);
    assert_eq!(m["error"]["code"], -32003);
    assert_eq!(error_type(&m), "outcome-unknown");
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn another_caller_with_the_same_key_never_gets_the_first_callers_result() {
    let s = Mcp::start(&plugin("", ""));
    let body = tools_call(json!(1), "charge", json!({"amount": 1}), json!({"idempotencyKey": "shared-key"}));
    let a = post(s.envoy.port, &[ALICE, BOTH], &body);
    let b = post(s.envoy.port, &[("authorization", "Bearer bob"), BOTH], &body);
    assert_ne!(message(&a)["result"], message(&b)["result"]);
    assert_eq!(b.header("idempotent-replayed"), None);
    assert_eq!(s.up.executions(), 2);
}

#[test]
fn concurrent_duplicates_execute_once() {
    let s = Mcp::start(&plugin("", ""));
    let port = s.envoy.port;
    let answers: Vec<Response> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4)
            .map(|i| {
                sc.spawn(move || {
                    let h = [ALICE, BOTH, ("idempotency-key", "k-conc"), ("x-up-delay-ms", "800")];
                    post(port, &h, &tools_call(json!(i), "charge", json!({"amount": 1}), Value::Null))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, a) in answers.iter().enumerate() {
        let m = message(a);
        assert_eq!(m["id"], i, "{}", a.body_text());
        assert!(m.get("result").is_some() || m["error"]["code"] == -32001, "{}", a.body_text());
    }
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn detached_forwarding_with_wait_gives_every_duplicate_the_one_result_with_its_own_id() {
    let s = Mcp::start(&plugin(
        r#", "lock_ttl_seconds": 30, "forwarding": "detached", "upstream": {"cluster": "upstream", "hop": "direct", "timeout_ms": 10000}, "in_flight": "wait", "wait_ms": 8000"#,
        "",
    ));
    let port = s.envoy.port;
    let answers: Vec<Response> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..3)
            .map(|i| {
                sc.spawn(move || {
                    if i > 0 {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    let h = [
                        ALICE,
                        BOTH,
                        ("idempotency-key", "k-wait"),
                        ("x-up-delay-ms", "1000"),
                        ("x-mcp-answer", "sse"),
                    ];
                    post(port, &h, &tools_call(json!(format!("id-{i}")), "charge", json!({"amount": 1}), Value::Null))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let first = message(&answers[0]);
    for (i, a) in answers.iter().enumerate() {
        println!("{i}: {} {}", a.status, a.body_text());
        let m = message(a);
        assert_eq!(m["id"], format!("id-{i}"));
        assert_eq!(m["result"], first["result"]);
    }
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn a_retry_on_the_other_proxy_gets_the_result_through_the_store() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = McpUpstream::start();
    let cfg = plugin("", r#", "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 2000}"#);
    let mut o = EnvoyOptions::new(&cfg, up.port);
    o.store_port = Some(webdis.port);
    let a = Envoy::start(&o);
    let b = Envoy::start(&o);
    let h = [ALICE, BOTH, ("idempotency-key", "k-two"), ("x-mcp-answer", "sse")];
    let first = post(a.port, &h, &tools_call(json!(1), "charge", json!({"amount": 1}), Value::Null));
    // Proxy a answers its client before its root's completion write reaches the store: until it
    // lands, b sees the key in flight (JSON-RPC error -32001, `request-in-flight`, as any client
    // retrying there would). Bounded by count.
    let in_flight = |r: &Response| message(r)["error"]["code"] == -32001;
    let mut retry = post(b.port, &h, &tools_call(json!("on-b"), "charge", json!({"amount": 1}), Value::Null));
    for _ in 0..200 {
        if !in_flight(&retry) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
        retry = post(b.port, &h, &tools_call(json!("on-b"), "charge", json!({"amount": 1}), Value::Null));
    }
    println!("{} {}", retry.status, retry.body_text());
    assert_eq!(message(&retry)["id"], "on-b");
    assert_eq!(message(&retry)["result"], message(&first)["result"]);
    assert_eq!(up.executions(), 1);
    a.assert_no_wasm_panic();
    b.assert_no_wasm_panic();
}

#[test]
fn duplicate_member_names_are_refused_never_forwarded() {
    let s = Mcp::start(&plugin("", ""));
    let body = br#"{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call","params":{"name":"charge","arguments":{}}}"#;
    let r = post(s.envoy.port, &[ALICE, BOTH, ("idempotency-key", "k-dup")], body);
    println!("{} {}", r.status, r.body_text());
    assert_eq!(error_type(&message(&r)), "mcp-body-ambiguous");
    // UTF-16, deep nesting in the arguments, a number out of range: a lenient server reader
    // (Python's json) would run the call; idemgate cannot read it, so it is never forwarded.
    let call = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{}}}"#;
    let utf16: Vec<u8> = call.encode_utf16().flat_map(u16::to_le_bytes).collect();
    let deep =
        call.replace(r#""arguments":{}"#, &format!(r#""arguments":{{"x":{}{}}}"#, "[".repeat(300), "]".repeat(300)));
    let huge = call.replace(r#""arguments":{}"#, r#""arguments":{"amount":1e400}"#);
    for body in [utf16, deep.into_bytes(), huge.into_bytes()] {
        let r = post(s.envoy.port, &[ALICE, BOTH, ("idempotency-key", "k-odd")], &body);
        assert_eq!(r.status, 200);
        assert_eq!(error_type(&message(&r)), "mcp-body-ambiguous", "{}", r.body_text());
    }
    assert_eq!(s.up.calls().len(), 0);
}

#[test]
fn a_derived_key_protects_a_call_without_key() {
    let s = Mcp::start(&plugin(r#", "derive_key": {"headers": ["x-agent-step-id"]}"#, ""));
    let h = [ALICE, BOTH, ("x-agent-step-id", "step-1")];
    let a = post(s.envoy.port, &h, &tools_call(json!(1), "charge", json!({"amount": 1}), Value::Null));
    let b = post(s.envoy.port, &h, &tools_call(json!(2), "charge", json!({"amount": 1}), Value::Null));
    assert_eq!(message(&b)["id"], 2);
    assert_eq!(message(&b)["result"], message(&a)["result"]);
    // Other arguments in the same step are another call (the key derives from them).
    let c = post(s.envoy.port, &h, &tools_call(json!(3), "charge", json!({"amount": 2}), Value::Null));
    assert!(message(&c).get("result").is_some(), "{}", c.body_text());
    assert_eq!(s.up.executions(), 2);
}

/// Found by the boundary oracle (issue 41, configuration `mcp_derive_key`, seed 41): the derived
/// key came from the arguments' spelling, so `"amount":1.0` (one number to Node's and Go's JSON
/// parsers) and `"\u0065ur"` after `"amount":1` and `"eur"` derived another key and ran again.
#[test]
fn arguments_spelled_another_way_derive_the_same_key() {
    let s = Mcp::start(&plugin(r#", "derive_key": {"headers": ["x-agent-step-id"]}"#, ""));
    let h = [ALICE, BOTH, ("x-agent-step-id", "step-spell")];
    let a =
        post(s.envoy.port, &h, &tools_call(json!(1), "charge", json!({"amount": 1, "currency": "eur"}), Value::Null));
    assert!(message(&a).get("result").is_some(), "{}", a.body_text());
    let one_point_o = br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"charge","arguments":{"amount":1.0,"currency":"eur"}}}"#;
    let escaped = br#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"charge","arguments":{"amount":1,"currency":"\u0065ur"}}}"#;
    for body in [&one_point_o[..], &escaped[..]] {
        let r = post(s.envoy.port, &h, body);
        assert_eq!(message(&r)["error"]["code"], -32002, "{}", r.body_text());
    }
    assert_eq!(s.up.executions(), 1, "each spelling of the call executed again");
}

#[test]
fn a_cancellation_never_releases_the_key() {
    let s = Mcp::start(&plugin("", ""));
    let port = s.envoy.port;
    let h = [ALICE, BOTH, ("idempotency-key", "k-cancel"), ("x-up-delay-ms", "1000")];
    let first =
        std::thread::spawn(move || post(port, &h, &tools_call(json!(1), "charge", json!({"amount": 1}), Value::Null)));
    // While the call runs: the client cancels it (with the same key), then retries.
    std::thread::sleep(Duration::from_millis(300));
    let cancel = br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":1,"reason":"timeout"}}"#;
    assert_eq!(post(port, &[ALICE, BOTH, ("idempotency-key", "k-cancel")], cancel).status, 202);
    let during = post(port, &h, &tools_call(json!(2), "charge", json!({"amount": 1}), Value::Null));
    assert_eq!(message(&during)["error"]["code"], -32001, "{}", during.body_text());
    assert_eq!(message(&during)["id"], 2);
    let first = first.join().unwrap();
    let after = post(port, &h, &tools_call(json!(3), "charge", json!({"amount": 1}), Value::Null));
    assert_eq!(message(&after)["id"], 3);
    assert_eq!(message(&after)["result"], message(&first)["result"]);
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn a_lost_response_comes_back_with_detached_forwarding() {
    let s = Mcp::start(&plugin(
        r#", "lock_ttl_seconds": 30, "forwarding": "detached", "upstream": {"cluster": "upstream", "hop": "direct", "timeout_ms": 10000}, "in_flight": "wait", "wait_ms": 8000"#,
        "",
    ));
    let h =
        [("content-type", "application/json"), ALICE, BOTH, ("idempotency-key", "k-lost"), ("x-up-delay-ms", "1000")];
    let body = tools_call(json!(1), "charge", json!({"amount": 1}), Value::Null);
    // The client gives up long before the tool completes.
    let lost = http::request_timeout(s.envoy.port, "POST", "/mcp", &h, &body, Duration::from_millis(200));
    assert!(lost.is_err(), "the first answer is lost");
    let retry = http::request(
        s.envoy.port,
        "POST",
        "/mcp",
        &h,
        &tools_call(json!(2), "charge", json!({"amount": 1}), Value::Null),
    )
    .expect("answer");
    println!("{} {}", retry.status, retry.body_text());
    let m = message(&retry);
    assert_eq!(m["id"], 2);
    assert_eq!(m["result"]["execution"], 1);
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn a_call_without_key_follows_require_key_and_refusals_follow_accept() {
    let s = Mcp::start(&plugin(r#", "require_key": true"#, ""));
    let body = tools_call(json!("x"), "charge", json!({"amount": 1}), Value::Null);
    let r = post(s.envoy.port, &[ALICE, BOTH], &body);
    let m = message(&r);
    assert_eq!((r.status, m["id"].clone(), m["error"]["code"].clone()), (200, json!("x"), json!(-32005)));
    assert_eq!(error_type(&m), "key-missing");
    // A client that accepts only an event stream gets the refusal as one event.
    let sse = post(s.envoy.port, &[ALICE, ("accept", "text/event-stream")], &body);
    assert_eq!(sse.header("content-type"), Some("text/event-stream"));
    assert_eq!(message(&sse)["error"]["code"], -32005);
    // A key in _meta that is no string is a malformed key.
    let bad = tools_call(json!(1), "charge", json!({}), json!({"idempotencyKey": 42}));
    let m = message(&post(s.envoy.port, &[ALICE, BOTH], &bad));
    assert_eq!(m["error"]["code"], -32005, "{m}");
    // Other methods still pass without a key.
    let list = post(s.envoy.port, &[ALICE, BOTH], br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#);
    assert_eq!(message(&list)["id"], 1);
    assert_eq!(s.up.executions(), 0);
}

/// `hold_headers: false` (hosts without `allow_on_headers_stop_iteration`): the headers go
/// upstream before the body says whether the call is protected; the body still waits for the
/// decision, so a duplicate never completes upstream.
#[test]
fn without_held_headers_a_repeated_call_still_executes_once() {
    let up = McpUpstream::start();
    let mut o = EnvoyOptions::new(&plugin("", r#", "hold_headers": false"#), up.port);
    o.stop_iteration_flag = false;
    let envoy = Envoy::start(&o);
    let h = [ALICE, BOTH, ("idempotency-key", "k-nohold")];
    let a = post(envoy.port, &h, &tools_call(json!(1), "charge", json!({"amount": 1}), Value::Null));
    let b = post(envoy.port, &h, &tools_call(json!(2), "charge", json!({"amount": 1}), Value::Null));
    println!("{} {}", b.status, b.body_text());
    assert_eq!(message(&b)["id"], 2);
    assert_eq!(message(&b)["result"], message(&a)["result"]);
    let list = post(envoy.port, &h, br#"{"jsonrpc":"2.0","id":5,"method":"tools/list"}"#);
    assert_eq!(message(&list)["id"], 5);
    let changed = post(envoy.port, &h, &tools_call(json!(3), "charge", json!({"amount": 9}), Value::Null));
    assert_eq!(message(&changed)["error"]["code"], -32002);
    assert_eq!(up.executions(), 1);
    assert_eq!(up.count("tools/list"), 1);
    envoy.assert_no_wasm_panic();
}

/// Review (adversarial): a server that does not check the content type (this upstream) runs a
/// tools/call sent as `content-type: application/grpc, application/json`; idemgate read it as gRPC,
/// and a gRPC request without a key header passed before its body was read, so a `_meta` key was
/// never seen and each send executed. (The official Python server refuses that type itself:
/// mcp_sdk::a_tools_call_under_a_grpc_content_type_is_refused_before_the_server.)
#[test]
fn a_tools_call_under_a_grpc_content_type_is_never_passed_unread() {
    let s = Mcp::start(&plugin("", ""));
    let body = tools_call(json!(1), "charge", json!({"amount": 7}), json!({"idempotencyKey": "grpc-k-1"}));
    let mut answers = vec![];
    for _ in 0..2 {
        let h = [("content-type", "application/grpc, application/json"), ALICE, BOTH];
        let r = http::request(s.envoy.port, "POST", "/mcp", &h, &body).expect("answer");
        println!("grpc-typed call: {} {}", r.status, r.body_text());
        let m = message(&r);
        assert_eq!((m["id"].clone(), error_type(&m)), (json!(1), "mcp-body-ambiguous".to_string()));
        answers.push(r.status);
    }
    assert_eq!(s.up.executions(), 0, "a tools/call under a gRPC content-type is refused, never executed: {answers:?}");
}

/// Review (adversarial): a path that one reading routes to a plain route and another to the MCP
/// route (`/api/..%2Fmcp` is `/mcp` to a decoding origin) took the plain route (the first one)
/// when both share a store: the body was never read, the `_meta` key never seen.
#[test]
fn a_path_spelling_that_reaches_the_mcp_route_through_another_route_is_refused() {
    let plugin =
        format!(r#"{{"scope": {{"headers": ["authorization"]}}, "routes": [{{"prefix": "/api"}}, {ROUTE}}}]}}"#);
    let s = Mcp::start(&plugin);
    let body = tools_call(json!(1), "charge", json!({"amount": 8}), json!({"idempotencyKey": "path-k-1"}));
    for path in ["/api/..%2Fmcp", "/api/..%2Fmcp"] {
        let h = [("content-type", "application/json"), ALICE, BOTH];
        let r = http::request(s.envoy.port, "POST", path, &h, &body).expect("answer");
        println!("{path}: {} {}", r.status, r.body_text());
        assert_eq!(r.status, 400);
        assert_eq!(r.json()["type"], "urn:idemgate:problem:route-ambiguous");
    }
    // The plain spelling is the MCP route's: protected as ever.
    for id in [2, 3] {
        let r = post(
            s.envoy.port,
            &[ALICE, BOTH],
            &tools_call(json!(id), "charge", json!({"amount": 8}), json!({"idempotencyKey": "path-k-1"})),
        );
        assert_eq!(message(&r)["id"], id);
    }
    assert_eq!(s.up.executions(), 1);
}

/// A stateful server answers 404 to a session it no longer knows, before dispatching the call:
/// nothing ran, so the key is released and the retry, in the new session, executes (once). Before
/// MCP routes released these pre-dispatch statuses by default, the 404 was stored and replayed to
/// every retry with the key until `ttl_seconds` (the agent could never complete the call).
#[test]
fn a_stale_session_404_releases_the_key_so_the_retry_in_a_new_session_executes_once() {
    let s = Mcp::start(&plugin("", ""));
    let body = tools_call(json!(1), "charge", json!({"amount": 5}), json!({}));
    let stale = post(s.envoy.port, &[ALICE, BOTH, ("idempotency-key", "k-stale"), ("mcp-session-id", "stale")], &body);
    assert_eq!(stale.status, 404, "{}", stale.body_text());
    assert_eq!(s.up.executions(), 0);
    let retry = post(s.envoy.port, &[ALICE, BOTH, ("idempotency-key", "k-stale"), ("mcp-session-id", "s-new")], &body);
    println!("retry: {} {:?} {}", retry.status, retry.headers, retry.body_text());
    assert_eq!(retry.status, 200, "{}", retry.body_text());
    assert_eq!(retry.header("idempotent-replayed"), None);
    assert_eq!(s.up.executions(), 1);
    let again = post(s.envoy.port, &[ALICE, BOTH, ("idempotency-key", "k-stale"), ("mcp-session-id", "s-new")], &body);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(s.up.executions(), 1, "executed once in all");
}

/// Found by the review of the move of MCP bodies and internal redirects into the request
/// machine (present before it too): a `tools/call` whose key is in its arguments, redirected by
/// its server (307, followed by Envoy's `internal_redirect_policy`, the body re-sent), was never
/// matched to the claim its first stream handed over (the re-created stream's key was read from
/// its headers, which name none). The target ran as a new call under the key its first hop
/// still held: the client got a JSON-RPC `key-reused` error for a call whose first hop
/// executed, the target never ran, and the key became outcome-unknown. Now the re-created
/// stream takes the claim once its body names the key: one call, its target's result stored and
/// replayed to the retry under the retry's id.
#[test]
fn a_tools_call_redirected_with_its_key_in_its_arguments_is_one_call() {
    redirected_call_is_one_call("", "/mcp/target", KeyFrom::Arguments);
    // Without held headers, the router's retries were forbidden at the headers.
    redirected_call_is_one_call(r#", "hold_headers": false"#, "/mcp/target", KeyFrom::Arguments);
}

/// Issue 40: the same to another host (its `:authority`, part of the caller's scope, differs on
/// the re-created stream): the claim is taken in the scope of the URL redirected from.
#[test]
fn a_tools_call_redirected_to_another_host_is_one_call() {
    redirected_call_is_one_call("", "http://pay.example.test/mcp/target", KeyFrom::Arguments);
}

/// Issue 40 (review finding): a call whose key is derived (`derive_key`: no key sent) was never
/// continued across an internal redirect. The key derives from the method, the path, the named
/// headers, the call and the caller's scope; the re-created stream derived it from the target's
/// path (and, to another host, the target's authority), so it found no hand-over, claimed a key of
/// its own and stored the target's result there, while the first hop's claim waited out its
/// hand-over window (10 s) and then became outcome-unknown: the retry (sent to the first URL, as
/// a client does) got `-32001` (in flight) for those 10 s and `-32003` after, never the result.
/// Seen before the fix: the client got the target's result, the retry
/// `{"error":{"code":-32001,...,"type":"urn:idemgate:problem:request-in-flight"}}` and
/// `idemgate.internal_redirects_followed` was 0 (header and `_meta` keys passed). Now the re-created stream derives the key as its
/// first stream did (the URL redirected from): one call for every key source, same host or not.
#[test]
fn a_tools_call_redirected_is_one_call_whatever_its_key_source() {
    for to in ["/mcp/target", "http://pay.example.test/mcp/target"] {
        for from in [KeyFrom::Header, KeyFrom::Meta, KeyFrom::Derived] {
            redirected_call_is_one_call("", to, from);
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum KeyFrom {
    Header,
    Meta,
    Arguments,
    Derived,
}

fn redirected_call_is_one_call(top_extra: &str, to: &str, from: KeyFrom) {
    println!("{to} {from:?} {top_extra}");
    let up = McpUpstream::start();
    let route_extra = match from {
        KeyFrom::Derived => r#", "derive_key": {"headers": ["x-agent-step-id"]}"#,
        _ => "",
    };
    let mut o = EnvoyOptions::new(&plugin(route_extra, top_extra), up.port);
    o.stop_iteration_flag = top_extra.is_empty();
    o.route_action_extra = ", internal_redirect_policy: {redirect_response_codes: [307]}".into();
    let envoy = Envoy::start(&o);
    let to = format!("307 {to}");
    let mut h = vec![ALICE, ("accept", "application/json"), ("x-up-redirect", to.as_str())];
    let mut args = json!({"amount": 3});
    let mut meta = Value::Null;
    match from {
        KeyFrom::Header => h.push(("idempotency-key", "k-redirected")),
        KeyFrom::Meta => meta = json!({"idempotencyKey": "k-redirected"}),
        KeyFrom::Arguments => args["idempotency_key"] = json!("k-redirected"),
        KeyFrom::Derived => h.push(("x-agent-step-id", "step-redirected")),
    }
    let a = post(envoy.port, &h, &tools_call(json!(1), "charge", args.clone(), meta.clone()));
    assert_eq!(a.status, 200, "{}", a.body_text());
    let m1 = message(&a);
    assert_eq!(m1["id"], 1);
    assert!(m1["error"].is_null(), "{from:?} {top_extra}: the target's result, not an error: {m1}");
    assert_eq!(m1["result"]["execution"], 2, "{m1}");
    let b = post(envoy.port, &h, &tools_call(json!("r-2"), "charge", args, meta));
    let m2 = message(&b);
    println!("retry: {m2}");
    assert_eq!(envoy.stat("idemgate.internal_redirects_followed"), 1, "{from:?} {to}: the claim was continued");
    assert_eq!(m2["id"], "r-2", "{m2}");
    assert_eq!(m2["result"], m1["result"], "{from:?} {to}: the retry gets the target's result");
    assert_eq!(b.header("idempotent-replayed"), Some("true"));
    assert_eq!(up.executions(), 2, "each hop once, the retry nothing");
    assert_eq!(envoy.stat("idemgate.unknown_outcome"), 0);
    envoy.assert_no_wasm_panic();
}

/// Sends `body` and reads the answer only until `until` appears in it, then closes the
/// connection, as a client does that has read its final response from an event stream the
/// server keeps open (the Python SDK's client). The bytes read.
fn post_and_leave_once_read(port: u16, headers: &[(&str, &str)], body: &[u8], until: &str) -> String {
    use std::io::Write;
    let mut req = "POST /mcp HTTP/1.1\r\nhost: idemgate.test\r\ncontent-type: application/json\r\n".to_string();
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    req.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut got = vec![];
    let mut chunk = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains(until) {
        let n = http::read_some(&mut s, &mut chunk).expect("the final event arrives while the stream stays open");
        assert!(n > 0, "the stream ended: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&chunk[..n]);
    }
    let _ = s.shutdown(std::net::Shutdown::Both);
    String::from_utf8_lossy(&got).into_owned()
}

/// Issue 40: the server sends the final response event and keeps the event stream open (the
/// spec's SHOULD-close not followed; a 2026-07-28 Python server pings an open stream); the client
/// reads its result and closes. The call completed and its client has its result: before, the
/// exchange was classified client-gone, outcome-unknown, and the retry was told -32003 "may or
/// may not have taken effect".
#[test]
fn a_final_response_received_on_a_stream_left_open_is_a_completion() {
    let s = Mcp::start(&plugin("", ""));
    let h = [ALICE, BOTH, ("idempotency-key", "k-open"), ("x-mcp-answer", "sse-open")];
    let first = post_and_leave_once_read(
        s.envoy.port,
        &h,
        &tools_call(json!(1), "charge", json!({"amount": 1}), Value::Null),
        "\"result\"",
    );
    println!("first (read, then left): {first}");
    assert!(first.contains("\"execution\":1"), "{first}");
    // The exchange settles when Envoy sees the client gone; a retry may meet it in flight first.
    let mut retry = post(s.envoy.port, &h, &tools_call(json!(2), "charge", json!({"amount": 1}), Value::Null));
    for _ in 0..100 {
        if message(&retry)["error"]["code"] != -32001 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        retry = post(s.envoy.port, &h, &tools_call(json!(2), "charge", json!({"amount": 1}), Value::Null));
    }
    println!("retry: {} {:?} {}", retry.status, retry.headers, retry.body_text());
    let m = message(&retry);
    assert_eq!(m["id"], 2);
    assert_eq!(m["result"]["execution"], 1, "the first call's result, replayed: {m}");
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(s.up.executions(), 1);
    assert_eq!(s.envoy.stat("idemgate.unknown_outcome"), 0);
}

/// Issue 40: JSON-RPC ids by value and byte-exact. A JavaScript server echoes the id `1.0` as `1`:
/// the answer is the call's final response (before, it counted as missing: a completed call
/// became outcome-unknown and every retry was told -32003). The retries' ids `1e2` and an
/// integer beyond u64 are spliced into the replay as they were sent (before, `1e2` came back
/// `100.0` and the long integer as a float).
#[test]
fn ids_are_matched_by_value_and_replayed_as_the_retry_wrote_them() {
    let s = Mcp::start(&plugin("", ""));
    let h = [ALICE, ("accept", "application/json"), ("idempotency-key", "k-ids"), ("x-mcp-id-echo", "js")];
    let call = |id: &str| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"charge","arguments":{{"amount":1}}}}}}"#
        )
    };
    let first = post(s.envoy.port, &h, call("1.0").as_bytes());
    println!("first: {} {}", first.status, first.body_text());
    assert!(first.body_text().contains(r#""id":1,"#), "the server echoed 1.0 as 1: {}", first.body_text());
    for id in ["1e2", "123456789012345678901234567890", "-0.5E+1"] {
        let retry = post(s.envoy.port, &h, call(id).as_bytes());
        println!("retry {id}: {} {}", retry.status, retry.body_text());
        assert_eq!(retry.header("idempotent-replayed"), Some("true"), "{id}: {}", retry.body_text());
        assert!(retry.body_text().contains(&format!(r#""id":{id},"#)), "{id} as sent: {}", retry.body_text());
        assert_eq!(retry.json()["result"]["execution"], 1, "{id}: {}", retry.body_text());
    }
    assert_eq!(s.up.executions(), 1);
    assert_eq!(s.envoy.stat("idemgate.unknown_outcome"), 0);
}

/// Issue 40: a `tools/call` without an id, or with `"id": null`, is no call the SDK servers run
/// (a notification: 202; a null id: refused) and none they answer. Protected as a call, it was
/// forwarded and its key became outcome-unknown (no final response ever came), so the real call
/// with that key was refused -32003. Now it is refused before any server sees it (`"id": null`,
/// `mcp-body-ambiguous`) and its key stays free.
#[test]
fn a_tools_call_without_an_id_is_refused_and_leaves_its_key_free() {
    let s = Mcp::start(&plugin("", ""));
    let h = [ALICE, BOTH, ("idempotency-key", "k-no-id")];
    for body in [
        r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"charge","arguments":{"amount":1}}}"#,
        r#"{"jsonrpc":"2.0","id":null,"method":"tools/call","params":{"name":"charge","arguments":{"amount":1}}}"#,
    ] {
        let r = post(s.envoy.port, &h, body.as_bytes());
        println!("{body}: {} {}", r.status, r.body_text());
        let m = message(&r);
        assert_eq!((m["id"].clone(), error_type(&m)), (Value::Null, "mcp-body-ambiguous".to_string()), "{body}");
    }
    assert_eq!(s.up.calls().len(), 0, "never forwarded");
    let call = post(s.envoy.port, &h, &tools_call(json!(1), "charge", json!({"amount": 1}), Value::Null));
    println!("the call: {}", call.body_text());
    assert_eq!(message(&call)["result"]["execution"], 1, "{}", call.body_text());
    assert_eq!(s.up.executions(), 1);
}

/// Issue 40: revision 2026-07-28's routing headers (`Mcp-Method`, `Mcp-Name`) must agree with the
/// body, or a router or server going by the headers runs another call than the one protected (a
/// call of `lookup` named `charge` in its header runs unprotected at a header-routed `charge`).
/// Each disagreement is refused before anything is forwarded; headers that agree (as sent, or in
/// the `=?base64?…?=` form clients use for other values) protect the call as before.
#[test]
fn routing_headers_that_disagree_with_the_body_are_refused_before_anything_runs() {
    routing_headers_must_agree_with_the_body(Build::from_env());
}

/// Revision 2026-07-28's routing headers checked against the body, with `build` loaded.
pub(crate) fn routing_headers_must_agree_with_the_body(build: Build) {
    let s = Mcp::start_on(build, &plugin("", ""));
    let charge = tools_call(json!(5), "charge", json!({"amount": 1}), Value::Null);
    let lookup = tools_call(json!(6), "lookup", json!({}), Value::Null);
    let batch = br#"[{"jsonrpc":"2.0","id":7,"method":"tools/list"}]"#.to_vec();
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, &'a [u8], &'a str);
    let cases: [Case; 6] = [
        ("method", vec![("mcp-method", "tools/list")], &charge, "mcp-method"),
        ("name", vec![("mcp-method", "tools/call"), ("mcp-name", "lookup")], &charge, "mcp-name"),
        ("unprotected body, protected name", vec![("mcp-name", "charge")], &lookup, "mcp-name"),
        ("name twice", vec![("mcp-name", "charge"), ("mcp-name", "charge")], &charge, "mcp-name"),
        ("name in base64, another tool", vec![("mcp-name", "=?base64?bG9va3Vw?=")], &charge, "mcp-name"),
        ("a batch", vec![("mcp-method", "tools/list")], &batch, "mcp-method"),
    ];
    for (what, extra, body, header) in cases {
        let mut h = vec![ALICE, BOTH, ("idempotency-key", "k-headers")];
        h.extend(extra);
        let r = post(s.envoy.port, &h, body);
        println!("{what}: {} {}", r.status, r.body_text());
        let m = message(&r);
        assert_eq!(error_type(&m), "mcp-header-mismatch", "{what}");
        assert_eq!(m["error"]["code"], -32020, "{what}");
        assert!(m["error"]["data"]["detail"].as_str().unwrap_or("").contains(header), "{what}: {m}");
    }
    assert_eq!(s.up.calls().len(), 0, "nothing forwarded");
    // Agreeing headers: the call is protected (the key is still free: nothing above claimed it).
    for name in ["charge", "=?base64?Y2hhcmdl?="] {
        let h = [ALICE, BOTH, ("idempotency-key", "k-headers"), ("mcp-method", "tools/call"), ("mcp-name", name)];
        let r = post(s.envoy.port, &h, &charge);
        assert_eq!(message(&r)["result"]["execution"], 1, "{name}: {}", r.body_text());
    }
    assert_eq!(s.up.executions(), 1, "one execution, then its replay");
}

/// Issue 40, item 6, on an MCP route: a `tools/call` retried after its record expired
/// (`ttl_seconds` 5) meets the key's tombstone (`tombstone_seconds` 10): a JSON-RPC error
/// `-32008` `key-expired` with the retry's own id, never executed; other arguments are still
/// `-32002`. The sleep (a protocol timing) counts from a replay, seen after the completion; the
/// retry has the tombstone's 10 s of slack.
#[test]
fn a_tools_call_retried_after_its_record_expired_gets_key_expired_never_a_second_run() {
    let s = Mcp::start(&plugin(r#", "ttl_seconds": 5, "lock_ttl_seconds": 3, "tombstone_seconds": 10"#, ""));
    let h = [ALICE, BOTH, ("idempotency-key", "k-tomb")];
    let first = post(s.envoy.port, &h, &tools_call(json!(1), "charge", json!({"amount": 5}), Value::Null));
    assert_eq!(message(&first)["id"], 1, "{}", first.body_text());
    // A replay (at most 100 tries, 20 ms apart) is seen after the completion: count from it.
    let replayed = (0..100).any(|_| {
        let r = post(s.envoy.port, &h, &tools_call(json!(9), "charge", json!({"amount": 5}), Value::Null));
        let ok = r.header("idempotent-replayed") == Some("true");
        if !ok {
            std::thread::sleep(Duration::from_millis(20));
        }
        ok
    });
    assert!(replayed, "never replayed");
    std::thread::sleep(Duration::from_millis(5_300));
    let r = post(s.envoy.port, &h, &tools_call(json!("r-2"), "charge", json!({"amount": 5}), Value::Null));
    assert_eq!(s.up.executions(), 1, "executions: the retry ran again ({})", r.body_text());
    assert_eq!(r.status, 200);
    let m = message(&r);
    assert_eq!(m["id"], "r-2");
    assert_eq!(m["error"]["code"], -32008, "{m}");
    assert_eq!(error_type(&m), "key-expired");
    assert_eq!(m["error"]["data"]["retry"], false);
    let r = post(s.envoy.port, &h, &tools_call(json!(3), "charge", json!({"amount": 6}), Value::Null));
    assert_eq!(message(&r)["error"]["code"], -32002);
    assert_eq!(s.up.executions(), 1);
}

/// Issue 40: the cap on an awaiting record's rounds, end to end (docs/mcp.md: "a call that asks
/// more than 64 times is kept as answered at the 65th question"). A server asks at every round,
/// each question with its own `requestState`; the client answers each. Rounds 1 to 65 each run
/// once (65 executions); round 65's question is then the call's answer, so round 66, which
/// answers it, is replayed that question and never runs, however often it is sent. In the local
/// tier (one proxy) and through Redis with the rounds alternating between two proxies (each
/// reading the other's awaiting record from the store).
#[test]
fn a_call_that_asks_more_than_64_times_is_kept_as_answered_at_the_65th_question() {
    use support::upstream::Upstream;
    let routes = r#""routes": [{"prefix": "/mcp", "protocol": "mcp", "mcp": {"tools": ["confirm"]}}]"#;
    let asks = |n: u32| {
        format!(
            r#"{{"jsonrpc":"2.0","id":1,"result":{{"resultType":"input_required","inputRequests":{{"q":{{"method":"elicitation/create","params":{{"message":"sure {n}?","requestedSchema":{{"type":"object","properties":{{}}}}}}}}}},"requestState":"s{n}"}}}}"#
        )
    };
    // Round 1 answers nothing; round n > 1 answers question n - 1, echoing its state.
    let round = |n: u32| {
        let extra = if n == 1 {
            String::new()
        } else {
            format!(
                r#","inputResponses":{{"q":{{"action":"accept","content":{{"n":{}}}}}}},"requestState":"s{}""#,
                n - 1,
                n - 1
            )
        };
        format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"confirm","arguments":{{"amount":5}}{extra}}}}}"#
        )
    };
    let send = |port: u16, n: u32| {
        let answer = asks(n);
        let h = [
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
            ("authorization", "Bearer alice"),
            ("idempotency-key", "k-mcp-65"),
            ("x-up-status", "200"),
            ("x-up-header", "content-type: application/json"),
            ("x-up-body", answer.as_str()),
        ];
        // With a store, the proxy that answered a round writes its record just after: a round on
        // the other proxy before that lands is in flight (-32001), never run. Bounded by count.
        for _ in 0..100 {
            let r = http::request(port, "POST", "/mcp", &h, round(n).as_bytes()).expect("answer");
            if !r.body_text().contains("-32001") {
                return r;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("round {n} still in flight after 100 tries")
    };
    let run = |what: &str, ports: [u16; 2], up: &Upstream| {
        for n in 1..=65u32 {
            let r = send(ports[n as usize % 2], n);
            assert_eq!(r.header("idempotent-replayed"), None, "{what}: round {n} was not run: {}", r.body_text());
            assert!(
                r.body_text().contains(&format!(r#""requestState":"s{n}""#)),
                "{what}: round {n}: {}",
                r.body_text()
            );
            assert_eq!(up.executions(), u64::from(n), "{what}: round {n} ran once");
        }
        for (i, port) in [ports[0], ports[1], ports[0]].into_iter().enumerate() {
            let r = send(port, 66);
            assert_eq!(r.header("idempotent-replayed"), Some("true"), "{what}: round 66, send {i}: {}", r.body_text());
            assert!(r.body_text().contains(r#""requestState":"s65""#), "{what}: round 66 got {}", r.body_text());
            assert_eq!(up.executions(), 65, "{what}: round 66 ran (send {i})");
        }
    };
    let up = Upstream::start();
    let local = Envoy::start(&EnvoyOptions::new(
        &format!(r#"{{"scope": {{"headers": ["authorization"]}}, {routes}}}"#),
        up.port,
    ));
    run("local tier", [local.port, local.port], &up);
    local.assert_no_wasm_panic();

    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(
        &format!(
            r#"{{"scope": {{"headers": ["authorization"]}}, "store": {{"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 5000}}, {routes}}}"#
        ),
        up.port,
    );
    o.store_port = Some(webdis.port);
    let (a, b) = (Envoy::start(&o), Envoy::start(&o));
    run("Redis, two proxies", [a.port, b.port], &up);
    a.assert_no_wasm_panic();
    b.assert_no_wasm_panic();
}
