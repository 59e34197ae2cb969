#![no_main]
//! Any bytes as what an MCP route reads: a request body (`mcp::classify`), an upstream answer to
//! store (`mcp::stored_body`, `mcp::read_answer`, JSON or an event stream) and a stored answer replayed with a
//! retry's id (`mcp::with_id`). Errors, never panics, holds a bounded number of bytes per input
//! byte, and:
//! - the fingerprint does not depend on the spelling: a body and its canonical form classify as
//!   the same call (tool, digest, key);
//! - what is stored of a 2xx answer is a JSON-RPC response to the request's id, never another
//!   message of the stream;
//! - a replay carries the retry's id and nothing else changed.
use libfuzzer_sys::fuzz_target;

use idemgate::config::McpPolicy;
use idemgate::mcp::{self, Classified};
use serde_json::Value;

#[path = "alloc_meter.rs"]
mod alloc_meter;

#[global_allocator]
static METER: alloc_meter::Meter = alloc_meter::Meter;

fn id_of(doc: &[u8]) -> Option<Value> {
    match serde_json::from_slice::<Value>(doc) {
        Ok(Value::Object(m)) => m.get("id").cloned(),
        _ => None,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((mode, rest)) = data.split_first() else { return };
    let split = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
    let first = rest.get(..split).unwrap_or_default();
    let second = rest.get(split + 1..).unwrap_or_default();
    alloc_meter::within(data.len(), 64, 256 * 1024, || match mode % 3 {
        0 => {
            let every = McpPolicy { tools: None, key_arguments: vec![], ..McpPolicy::default() };
            let listed = McpPolicy {
                tools: Some(vec!["charge".into()]),
                key_arguments: vec!["key".into()],
                ..McpPolicy::default()
            };
            for policy in [&every, &listed] {
                let c = mcp::classify(first, policy);
                assert_eq!(c, mcp::classify(first, policy), "classify is a function of its input");
                if let Classified::Call(call) = &c {
                    assert!(serde_json::from_slice::<Value>(&call.id).is_ok(), "a call's id is JSON text");
                    let canonical = idemgate::canonical_json::canonicalize(first).expect("a call is canonical JSON");
                    match mcp::classify(&canonical, policy) {
                        Classified::Call(again) => {
                            assert_eq!((&again.tool, again.digest, &again.key), (&call.tool, call.digest, &call.key))
                        }
                        other => panic!("the canonical form of a call classified as {other:?}"),
                    }
                }
            }
        }
        1 => {
            let (ct, status) = if mode & 0x80 == 0 {
                (&b"text/event-stream"[..], 200)
            } else {
                (&b"application/json"[..], 200 + u16::from(mode & 0x3f))
            };
            if let Ok(stored) = mcp::stored_body(status, Some(ct), None, second, first) {
                if (200..300).contains(&status) {
                    let msg: Value = serde_json::from_slice(&stored).expect("a stored 2xx answer is JSON");
                    // Ids by value (`mcp::same_id`): the stored message, read again, answers `first`.
                    assert_eq!(
                        mcp::read_answer(Some(b"application/json"), None, &stored, first),
                        mcp::Answer::Final(stored.clone()),
                        "a stored answer answers the request's id"
                    );
                    assert!(msg.get("method").is_none(), "a stored answer is a response, not a request");
                }
            }
            // Any answer, any status: read without panic, bounded by its bytes.
            let _ = mcp::read_answer(Some(ct), None, second, first);
        }
        _ => {
            let Some(out) = mcp::with_id(second, first) else { return };
            let (Ok(new_id), Ok(Value::Object(mut stored))) =
                (serde_json::from_slice::<Value>(first), serde_json::from_slice::<Value>(second))
            else {
                return;
            };
            // serde keeps one of repeated members, a splice may take the other: only a document
            // with no repeated member name (one canonical JSON has) is compared.
            if idemgate::canonical_json::canonicalize(second).is_none() || !stored.contains_key("id") {
                return;
            }
            let Ok(Value::Object(mut replayed)) = serde_json::from_slice::<Value>(&out) else {
                panic!("a replay of a JSON answer is not JSON: {:?}", String::from_utf8_lossy(&out))
            };
            assert_eq!(id_of(&out), Some(new_id), "a replay carries the retry's id");
            stored.remove("id");
            replayed.remove("id");
            assert_eq!(stored, replayed, "a replay changes nothing but the id");
        }
    });
});
