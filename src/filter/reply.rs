//! Local replies: problem documents and replays. Usable from an HTTP context, or from the root
//! context after `set_effective_context` to a live HTTP context (detached forwarding, waiters).
//!
//! Every reply carries response code details (`idemgate_<slug>`, `problem::code_details`), so
//! Envoy's `%RESPONSE_CODE_DETAILS%` tells a replay from a 409. The SDK's `send_http_response`
//! passes none, so the ABI's `proxy_send_local_response` is called here directly.

use std::cell::RefCell;
use std::collections::HashMap;

use super::host::Counter;
use crate::encoding::RetryAnswer;
use crate::mcp;
use crate::problem::{code_details, ProblemKind};
use crate::record::{Creator, Record};
use crate::request::envoy_answers_as_grpc;

/// The ABI's header map: the number of pairs, each pair's name and value lengths (u32, little
/// endian), then each name and value followed by a NUL byte.
fn serialize_headers(headers: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(headers.len() as u32).to_le_bytes());
    for (n, v) in headers {
        out.extend_from_slice(&(n.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (n, v) in headers {
        out.extend_from_slice(n.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// Sends a local reply with response code details; false if the host refused it (logged).
fn send(status: u16, details: &str, headers: &[(&str, &str)], body: &[u8], grpc_status: Option<i32>) -> bool {
    let map = serialize_headers(headers);
    let result = super::host::send_local_response(status, details, &map, body, grpc_status);
    if result != 0 {
        log::error!("idemgate: outcome=internal_state branch=local_reply status={status} details={details} host_status={result}");
    }
    result == 0
}

thread_local! {
    /// MCP requests by context: their replies are JSON-RPC (`problem`, `replay`).
    static MCP: RefCell<HashMap<u32, mcp::Reply>> = RefCell::new(HashMap::new());
}

/// `context_id` is an MCP request: its replies are JSON-RPC.
pub fn set_mcp(context_id: u32, r: mcp::Reply) {
    MCP.with(|m| m.borrow_mut().insert(context_id, r));
}

/// `context_id` has ended.
pub fn forget_mcp(context_id: u32) {
    MCP.with(|m| m.borrow_mut().remove(&context_id));
}

fn current_mcp() -> Option<mcp::Reply> {
    let id = super::host::current_context();
    MCP.with(|m| m.borrow().get(&id).cloned())
}

/// A refusal to an MCP request, as the core writes it (`mcp::Reply::problem`).
fn mcp_problem(kind: &ProblemKind, m: &mcp::Reply) {
    let r = m.problem(kind);
    let headers: Vec<(&str, &str)> =
        r.headers.iter().filter_map(|(n, v)| std::str::from_utf8(v).ok().map(|v| (n.as_str(), v))).collect();
    send(r.status, &code_details(kind.slug()), &headers, &r.body, None);
}

/// Sends a problem document. To a gRPC request (Envoy turns the reply into a trailers-only status
/// whose `grpc-message` is the body), the problem's gRPC status and its text instead of the JSON.
pub fn problem(kind: &ProblemKind, request_id: &str, creator: Option<&Creator>) {
    if let Some(m) = current_mcp() {
        return mcp_problem(kind, &m);
    }
    let p = kind.to_problem(request_id, creator);
    let headers: Vec<(&str, &str)> = p.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
    let content_type = super::host::header(proxy_wasm::types::MapType::HttpRequestHeaders, "content-type");
    if content_type.is_some_and(|c| envoy_answers_as_grpc(c.as_bytes())) {
        let text = kind.grpc_message();
        send(p.status, &code_details(kind.slug()), &headers, text.as_bytes(), Some(kind.grpc_status()));
    } else {
        send(p.status, &code_details(kind.slug()), &headers, &p.body, None);
    }
}

// The expiry header: the core's (`crate::encoding`), shared with the native build.
pub use crate::encoding::EXPIRES_HEADER;

/// Sends a response as the upstream gave it. `replayed` adds `idempotent-replayed: true`;
/// `expires_in` the expiry header; `slug` names the outcome in the response code details. Header
/// values that are not valid UTF-8 are left out (the host call takes text).
pub fn response(
    status: u16,
    headers: &[(String, Vec<u8>)],
    body: &[u8],
    replayed: bool,
    expires_in: Option<&str>,
    slug: &str,
) {
    let mut h: Vec<(&str, &str)> =
        headers.iter().filter_map(|(n, v)| std::str::from_utf8(v).ok().map(|v| (n.as_str(), v))).collect();
    if replayed {
        h.push(("idempotent-replayed", "true"));
    }
    if let Some(e) = expires_in {
        h.push((EXPIRES_HEADER, e));
    }
    send(status, &code_details(slug), &h, body, None);
}

/// The outcome slug of a replay.
pub const REPLAYED: &str = "replayed";

/// What a replay sent.
#[derive(Debug)]
pub enum Replayed {
    /// The stored response, as stored.
    Stored,
    /// The stored response decoded from a content coding the retry does not accept.
    Decoded,
    /// A problem instead (no body to replay, or a coding the retry does not accept).
    Problem(ProblemKind),
}

impl Replayed {
    /// The counter of what a replay needed beyond the stored bytes: a decoding, or a coding refused.
    pub fn counter(&self) -> Option<Counter> {
        match self {
            Replayed::Stored => crate::metrics::replay_counter(false, None),
            Replayed::Decoded => crate::metrics::replay_counter(true, None),
            Replayed::Problem(p) => crate::metrics::replay_counter(false, Some(p)),
        }
    }
}

/// Replays a completed record to a retry whose `accept-encoding` lines are `accept`
/// (`encoding::for_retry`, decoding at most `max_decoded_bytes`). `outcome` is told the slug of
/// what is about to be sent (`replayed`, or the problem's), before it is sent.
pub fn replay(
    record: &Record,
    request_id: &str,
    now_ms: u64,
    accept: &[&[u8]],
    max_decoded_bytes: u64,
    outcome: impl FnOnce(&'static str),
) -> Replayed {
    match crate::encoding::retry_answer(record, now_ms, accept, max_decoded_bytes, current_mcp().as_ref()) {
        RetryAnswer::AsStored { response: r, expires } => {
            outcome(REPLAYED);
            response(r.status, &r.headers, &r.body, true, Some(&expires), REPLAYED);
            Replayed::Stored
        }
        RetryAnswer::Decoded { response: d, expires } => {
            outcome(REPLAYED);
            response(d.status, &d.headers, &d.body, true, Some(&expires), REPLAYED);
            Replayed::Decoded
        }
        RetryAnswer::Problem(kind) => {
            outcome(kind.slug());
            problem(&kind, request_id, Some(&record.creator));
            Replayed::Problem(kind)
        }
    }
}
