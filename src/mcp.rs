//! MCP (Model Context Protocol, Streamable HTTP transport) on a route with `protocol: "mcp"`
//! (docs/mcp.md): JSON-RPC 2.0 in POST bodies, answered as `application/json` or as a
//! `text/event-stream`. Only a `tools/call` for a protected tool is protected.
//!
//! The rules, all without host calls:
//! - `classify`: what a POST body is (pass, a protected call, a batch holding one, a body two
//!   JSON readers could read differently);
//! - the key sources after the HTTP header (`Call::key`): `params._meta.idempotencyKey`, then a
//!   tool argument named in `mcp.key_arguments`;
//! - the fingerprint material (`Call::digest`): the tool name and the canonical JSON of
//!   `params.arguments` (`crate::canonical_json`), never the JSON-RPC id, `_meta` or the session;
//! - what is stored of an answer (`stored_body`): the final JSON-RPC response for the request's
//!   id, from a JSON body or from the event stream (earlier events, progress notifications and
//!   server requests, are not kept); an answer without one is no completion (outcome unknown);
//! - a replay (`replay_body`): the stored response with the retry's id spliced in, every other
//!   byte as stored, as JSON or as one SSE event;
//! - refusals (`error_body`): JSON-RPC errors carrying idemgate's problem type.

use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use crate::problem::{ProblemKind, TYPE_PREFIX};
use crate::record::StoredResponse;

pub use crate::config::McpPolicy;

/// Where a key found in the body came from, and its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BodyKey {
    /// `params._meta.idempotencyKey` or `params.arguments.<name>`: named in a refusal.
    pub source: String,
    /// The key's text, or `None` when the member is not a JSON string.
    pub value: Option<String>,
}

/// A protected `tools/call`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    /// The JSON-RPC id as the client wrote it, byte for byte (`null` when the request has none).
    pub id: Vec<u8>,
    pub tool: String,
    /// SHA-256 of the fingerprint material: tool name and canonical arguments.
    pub digest: [u8; 32],
    /// The same material in its semantic form (`canonical_json::semantic_form`): what a key
    /// derived from the call (`derive_key`) is derived from.
    pub derive_digest: [u8; 32],
    /// The key from the body, if any (`_meta` first, then the named arguments).
    pub key: Option<BodyKey>,
    /// Which round of a multi-round call (2026-07-28) this is: SHA-256 of what the client sends
    /// for a round, `params.inputResponses` and `params.requestState` (canonical, each framed,
    /// absent or null as nothing), outside the fingerprint. A first round sends neither.
    pub round: crate::record::RoundId,
}

/// What a POST body on an MCP route is.
// One per request, read once and moved: a `Call`'s size is no copy cost worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Classified {
    /// Not a protected call (another method, a notification, a response, an unlisted tool):
    /// passed untouched.
    Pass,
    /// A single protected `tools/call`.
    Call(Call),
    /// A batch (a JSON array) holding a protected `tools/call`: refused whole; the ids (JSON
    /// text) of its members that are requests with an id.
    Batch(Vec<Vec<u8>>),
    /// A body this gateway cannot read as exactly one JSON document: not JSON, not UTF-8 (a
    /// server's reader may take UTF-16 or a BOM), a member name repeated in an object, nesting
    /// deeper than `canonical_json::MAX_DEPTH`, a number out of range. Another reader could find
    /// a tool call in it that idemgate does not see, so it is refused (`mcp-body-ambiguous`);
    /// no MCP client sends one.
    Ambiguous,
    /// A 2026-07-28 routing header (`METHOD_HEADER`, `NAME_HEADER`) that disagrees with the body
    /// (`routing_headers_disagree`): refused before anything reads either.
    HeaderMismatch(&'static str),
}

const METHOD: &str = "tools/call";
const FP_TAG: &[u8] = b"idemgate-mcp-tools-call-v1\0";
const ROUND_TAG: &[u8] = b"idemgate-mcp-round-v1\0";

/// `Call::round` of a call whose document, in its semantic form (`canonical_json::semantic_form`:
/// two spellings a server reads alike are one round), is `semantic`, parsed as `value`. An empty
/// `inputResponses` (`{}`, "no answers yet") is none: a first round sent again so is the first.
fn round_of(semantic: &[u8], value: &Value) -> crate::record::RoundId {
    let params = member(semantic, "params");
    let mut h = Sha256::new();
    h.update(ROUND_TAG);
    for name in ["inputResponses", "requestState"] {
        let v = params.and_then(|p| member(p, name)).filter(|v| *v != b"null" && *v != b"{}").unwrap_or(b"");
        h.update((v.len() as u64).to_be_bytes());
        h.update(v);
    }
    let state = value
        .get("params")
        .and_then(|p| p.get("requestState"))
        .filter(|v| !v.is_null())
        .map(crate::record::state_digest);
    crate::record::RoundId { digest: h.finalize().into(), state }
}

/// Classifies a POST body on an MCP route under `policy`.
pub fn classify(body: &[u8], policy: &McpPolicy) -> Classified {
    classify_sent(body, policy, &[], &[])
}

/// `classify` of a POST that came with the routing headers `method` and `name` (their values):
/// the body is parsed once, for the headers' check first, then for what it holds.
pub fn classify_sent(body: &[u8], policy: &McpPolicy, method: &[&[u8]], name: &[&[u8]]) -> Classified {
    let parsed = serde_json::from_slice::<Value>(body).ok();
    if let Some(header) = routing_headers_disagree(method, name, parsed.as_ref()) {
        return Classified::HeaderMismatch(header);
    }
    let (Some(value), Some(canonical)) = (parsed, crate::canonical_json::canonicalize(body)) else {
        return Classified::Ambiguous;
    };
    match &value {
        Value::Array(items) => {
            if items.iter().any(|m| protected_tool(m, policy).is_some()) {
                // Each member's id as the client wrote it (the raw bytes of the body).
                let ids = elements(body)
                    .into_iter()
                    .zip(items)
                    .filter(|(_, m)| m.get("method").is_some())
                    .filter_map(|(raw, _)| member(raw, "id"))
                    .map(<[u8]>::to_vec)
                    .collect();
                Classified::Batch(ids)
            } else {
                Classified::Pass
            }
        }
        Value::Object(_) => match protected_tool(&value, policy) {
            // Without an id (or with `"id": null`) it is no call the SDK servers run: they take it
            // as a notification (202) or refuse it, and never answer it, so protecting it as a
            // call left its key outcome-unknown; a lenient server might still run it, so it is
            // not passed either.
            Some(_) if value.get("id").is_none_or(Value::is_null) => Classified::Ambiguous,
            Some(tool) => Classified::Call(call(&value, body, &canonical, tool, policy)),
            None => Classified::Pass,
        },
        _ => Classified::Pass,
    }
}

/// The tool name if `m` is a `tools/call` for a protected tool, with or without an id.
fn protected_tool<'v>(m: &'v Value, policy: &McpPolicy) -> Option<&'v str> {
    if m.get("method").and_then(Value::as_str) != Some(METHOD) {
        return None;
    }
    let tool = m.get("params").and_then(|p| p.get("name")).and_then(Value::as_str)?;
    match &policy.tools {
        Some(list) if !list.iter().any(|t| t == tool) => None,
        _ => Some(tool),
    }
}

fn call(value: &Value, body: &[u8], canonical: &[u8], tool: &str, policy: &McpPolicy) -> Call {
    // The id as the client wrote it (`1e2` stays `1e2`, an integer beyond u64 keeps every digit):
    // replays and refusals splice these bytes, never a re-serialised number.
    let id = member(body, "id").map_or_else(|| b"null".to_vec(), <[u8]>::to_vec);
    let digest = material(canonical, tool);
    // The key derived from the call (`derive_key`) from what the arguments mean to the parsers
    // servers use (`canonical_json::semantic_form`: escapes decoded, numbers by value), so two
    // calls a server reads alike derive one key (the boundary oracle, issue 41). The body is
    // canonical JSON already, so it has that form too.
    let semantic = crate::canonical_json::semantic_form(canonical);
    let derive_digest = semantic.as_deref().map_or(digest, |f| material(f, tool));
    let params = value.get("params");
    let meta = params
        .and_then(|p| p.get("_meta"))
        .and_then(|m| m.get("idempotencyKey"))
        .map(|v| BodyKey { source: "params._meta.idempotencyKey".into(), value: v.as_str().map(str::to_string) });
    let key = meta.or_else(|| {
        let args = params.and_then(|p| p.get("arguments"))?;
        policy.key_arguments.iter().find_map(|name| {
            args.get(name)
                .map(|v| BodyKey { source: format!("params.arguments.{name}"), value: v.as_str().map(str::to_string) })
        })
    });
    let round = round_of(semantic.as_deref().unwrap_or(canonical), value);
    Call { id, tool: tool.to_string(), digest, derive_digest, key, round }
}

/// The digest of a call's material in `doc` (its canonical or its semantic form): the tool and
/// the arguments, and `params.task` when present and not null.
fn material(doc: &[u8], tool: &str) -> [u8; 32] {
    // The arguments as written (numbers and strings keep their spelling), members sorted: the
    // canonical document holds them in canonical form already.
    let arguments = member(doc, "params").and_then(|p| member(p, "arguments")).unwrap_or(b"{}");
    let arguments: &[u8] = if arguments == b"null" { b"{}" } else { arguments };
    let mut h = Sha256::new();
    h.update(FP_TAG);
    h.update((tool.len() as u64).to_be_bytes());
    h.update(tool.as_bytes());
    h.update((arguments.len() as u64).to_be_bytes());
    h.update(arguments);
    // `params.task` (2025-11-25: run the call as a task, answered with the task it created, not
    // the tool's result) makes another call of the same arguments: in the material when present
    // and not null, canonical, after the length-framed arguments (a call without it hashes as
    // before this member was read).
    if let Some(task) = member(doc, "params").and_then(|p| member(p, "task")).filter(|t| *t != b"null") {
        h.update(b"task\0");
        h.update((task.len() as u64).to_be_bytes());
        h.update(task);
    }
    h.finalize().into()
}

/// Revision 2026-07-28's header naming a request's JSON-RPC method.
pub const METHOD_HEADER: &str = "mcp-method";
/// Revision 2026-07-28's header naming the tool, prompt or resource a request is for.
pub const NAME_HEADER: &str = "mcp-name";

/// The methods whose `Mcp-Name` header mirrors a member of `params` (2026-07-28; as the Python
/// SDK's `NAME_BEARING_METHODS`).
const NAME_BEARING: [(&str, &str); 3] = [("tools/call", "name"), ("prompts/get", "name"), ("resources/read", "uri")];

/// Which routing header (`Mcp-Method`, `Mcp-Name`: the values sent, `method` and `name`)
/// disagrees with the body, if one does: sent more than once, over a body that is not one message
/// (a batch), `Mcp-Method` other than the body's `method`, or `Mcp-Name` other than the member it
/// mirrors for a name-bearing method (absent included). A value in the `=?base64?…?=` form is
/// compared as the canonical base64 of the body's value, which is what it decodes to exactly when
/// it matches. No header, no check (earlier revisions send none); a body that is no JSON (`body`
/// `None`, as parsed) is `classify`'s to refuse.
pub fn routing_headers_disagree(method: &[&[u8]], name: &[&[u8]], body: Option<&Value>) -> Option<&'static str> {
    if method.is_empty() && name.is_empty() {
        return None;
    }
    if method.len() > 1 {
        return Some(METHOD_HEADER);
    }
    if name.len() > 1 {
        return Some(NAME_HEADER);
    }
    let Value::Object(m) = body? else { return Some(if method.is_empty() { NAME_HEADER } else { METHOD_HEADER }) };
    let body_method = m.get("method").and_then(Value::as_str);
    if method.first().is_some_and(|h| Some(*h) != body_method.map(str::as_bytes)) {
        return Some(METHOD_HEADER);
    }
    let field = NAME_BEARING.iter().find(|(n, _)| Some(*n) == body_method).map(|(_, f)| *f)?;
    let value = m.get("params").and_then(|p| p.get(field)).and_then(Value::as_str);
    match (name.first(), value) {
        (None, _) => None,
        (Some(h), Some(v)) if header_names(h, v) => None,
        _ => Some(NAME_HEADER),
    }
}

/// Whether header value `h` carries `value`: as it is when it is printable ASCII, or as
/// `=?base64?<canonical base64 of its UTF-8>?=` (how a client sends any other value). A raw
/// non-ASCII value is never taken: readers decode such bytes differently (the Python SDK's server
/// reads them as Latin-1).
fn header_names(h: &[u8], value: &str) -> bool {
    match h.strip_prefix(b"=?base64?").and_then(|r| r.strip_suffix(b"?=")) {
        Some(payload) => payload == crate::base64::b64(value.as_bytes()).as_bytes(),
        None => h == value.as_bytes() && h.iter().all(|b| (0x20..=0x7e).contains(b)),
    }
}

/// The raw `id` of a body that is one JSON object, as the client wrote it.
pub fn request_id(body: &[u8]) -> Option<Vec<u8>> {
    member(body, "id").map(<[u8]>::to_vec)
}

/// The raw bytes of the value of top-level member `name` in the JSON object `obj` (valid JSON;
/// the first member of that name). Names are compared decoded (`"\u0069d"` is `id`).
fn member<'a>(obj: &'a [u8], name: &str) -> Option<&'a [u8]> {
    member_span(obj, name).and_then(|(s, e)| obj.get(s..e))
}

/// `member`, as a byte range of `obj`.
fn member_span(obj: &[u8], name: &str) -> Option<(usize, usize)> {
    let mut i = skip_ws(obj, 0);
    if obj.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = skip_ws(obj, i);
        match obj.get(i)? {
            b'}' => return None,
            b',' => {
                i += 1;
                continue;
            }
            b'"' => {}
            _ => return None,
        }
        let name_end = skip_string(obj, i)?;
        let decoded: Option<String> = obj.get(i..name_end).and_then(|n| serde_json::from_slice(n).ok());
        i = skip_ws(obj, name_end);
        if obj.get(i) != Some(&b':') {
            return None;
        }
        let start = skip_ws(obj, i + 1);
        let end = skip_value(obj, start)?;
        if decoded.as_deref() == Some(name) {
            return Some((start, end));
        }
        i = end;
    }
}

/// The raw bytes of each element of the JSON array `arr` (valid JSON: callers parse it first);
/// empty for anything else, and bounded by the input whatever it holds.
fn elements(arr: &[u8]) -> Vec<&[u8]> {
    let mut out = vec![];
    let mut i = skip_ws(arr, 0);
    if arr.get(i) != Some(&b'[') {
        return out;
    }
    i += 1;
    loop {
        i = skip_ws(arr, i);
        match arr.get(i) {
            None | Some(b']') => return out,
            Some(b',') => i += 1,
            Some(_) => match skip_value(arr, i) {
                // Not valid JSON after all (a value of no length): stop, never loop.
                Some(end) if end > i => {
                    out.extend(arr.get(i..end));
                    i = end;
                }
                _ => return out,
            },
        }
    }
}

fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while matches!(s.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// The index just past the string starting at `i` (its opening quote).
fn skip_string(s: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        match s.get(j)? {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
}

/// The index just past the value starting at `i` (valid JSON assumed; bounded by the input).
fn skip_value(s: &[u8], i: usize) -> Option<usize> {
    match s.get(i)? {
        b'"' => skip_string(s, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match s.get(j)? {
                    b'"' => {
                        j = skip_string(s, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while let Some(b) = s.get(j) {
                if matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                j += 1;
            }
            Some(j)
        }
    }
}

/// The JSON-RPC error code of a refusal (docs/mcp.md).
pub fn error_code(kind: &ProblemKind) -> i64 {
    match kind {
        ProblemKind::InFlight { .. } => -32001,
        ProblemKind::KeyReused { .. } => -32002,
        ProblemKind::OutcomeUnknown | ProblemKind::UpstreamNoAnswer => -32003,
        ProblemKind::StoreUnavailable { .. }
        | ProblemKind::RecordUnreadable { .. }
        | ProblemKind::CapacityExhausted { .. }
        | ProblemKind::BufferBudgetExceeded { .. }
        | ProblemKind::InternalState { .. } => -32004,
        ProblemKind::KeyMissing { .. } | ProblemKind::KeyInvalid { .. } => -32005,
        ProblemKind::BodyTooLarge { .. } => -32006,
        ProblemKind::McpBatchRefused => -32007,
        ProblemKind::KeyExpired => -32008,
        // The protocol's own code for it (2026-07-28, the Python SDK's `HEADER_MISMATCH`).
        ProblemKind::McpHeaderMismatch { .. } => -32020,
        _ => -32000,
    }
}

/// A refusal's JSON-RPC error with `"id": null`; `error_body` splices the request's id in.
fn error_value(kind: &ProblemKind) -> Value {
    let mut data = Map::new();
    data.insert("type".into(), Value::String(format!("{TYPE_PREFIX}{}", kind.slug())));
    data.insert("status".into(), json!(kind.status()));
    data.insert("detail".into(), Value::String(kind.detail()));
    if let Some(s) = kind.retry_after() {
        data.insert("retryAfter".into(), json!(s));
    }
    data.insert("retry".into(), Value::Bool(kind.should_retry()));
    // Built member by member, not by `json!`: its `id` and `data` would go through serde's
    // `to_value`, a second `Value` serializer in the module (issue 27). The same JSON.
    let mut error = Map::new();
    error.insert("code".into(), Value::from(error_code(kind)));
    error.insert("message".into(), Value::from(kind.title()));
    error.insert("data".into(), Value::Object(data));
    let mut out = Map::new();
    out.insert("jsonrpc".into(), Value::from("2.0"));
    out.insert("id".into(), Value::Null);
    out.insert("error".into(), Value::Object(error));
    Value::Object(out)
}

/// A refusal as a JSON-RPC error response to the request whose id is `id` (JSON text, spliced
/// in byte for byte as the request wrote it).
pub fn error_body(kind: &ProblemKind, id: &[u8]) -> Vec<u8> {
    let body = serde_json::to_vec(&error_value(kind)).unwrap_or_default();
    with_id(&body, id).unwrap_or(body)
}

/// A refused batch: one error per member request with an id, in an array.
pub fn batch_error_body(kind: &ProblemKind, ids: &[Vec<u8>]) -> Vec<u8> {
    let mut out = b"[".to_vec();
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(&error_body(kind, id));
    }
    out.push(b']');
    out
}

/// How a request on an MCP route is answered once the engine says so (`Command::McpReply`): in
/// JSON-RPC, to its id (JSON text; `null` before it is read), the ids of a refused batch, in the
/// form the client accepts. Each host keeps one per request and answers its refusals
/// (`Reply::problem`) and replays (`encoding::retry_answer`) through it.
#[derive(Clone, Debug)]
pub struct Reply {
    pub id: Vec<u8>,
    pub batch: Vec<Vec<u8>>,
    pub accepts: Accepts,
}

impl Reply {
    /// A refusal: a JSON-RPC error to its id (one per member of a refused batch), status 200 (the
    /// transport's status for a JSON-RPC answer), as JSON or, to a client that does not accept
    /// JSON, one event.
    pub fn problem(&self, kind: &ProblemKind) -> StoredResponse {
        let body = match kind {
            ProblemKind::McpBatchRefused => batch_error_body(kind, &self.batch),
            _ => error_body(kind, &self.id),
        };
        let (content_type, body) =
            if self.accepts.json || !self.accepts.sse { (JSON_TYPE, body) } else { (SSE_TYPE, sse_event(&body)) };
        StoredResponse { status: 200, headers: vec![("content-type".into(), content_type.as_bytes().to_vec())], body }
    }
}

/// What a client accepts (`Accept`): JSON, an event stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accepts {
    pub json: bool,
    pub sse: bool,
}

pub const JSON_TYPE: &str = "application/json";
pub const SSE_TYPE: &str = "text/event-stream";

impl Accepts {
    /// From the request's `Accept` lines; none at all accepts JSON.
    pub fn of(lines: &[&[u8]]) -> Accepts {
        let mut a = Accepts { json: lines.is_empty(), sse: false };
        for line in lines {
            for item in line.split(|b| *b == b',') {
                let media = item.split(|b| *b == b';').next().unwrap_or_default().trim_ascii().to_ascii_lowercase();
                match media.as_slice() {
                    b"application/json" | b"application/*" | b"*/*" => a.json = true,
                    b"text/event-stream" => a.sse = true,
                    _ => {}
                }
            }
        }
        a
    }

    /// The form of a reply: an event stream only when the client accepts one and (for a replay)
    /// the first answer was one, or when it does not accept JSON.
    pub fn sse_reply(self, first_was_sse: bool) -> bool {
        self.sse && (first_was_sse || !self.json)
    }
}

/// `json` (one JSON-RPC message) as one SSE event: `event: message`, one `data:` line per line.
pub fn sse_event(json: &[u8]) -> Vec<u8> {
    let mut out = b"event: message\n".to_vec();
    for line in json.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line);
        out.push(b'\n');
    }
    out.push(b'\n');
    out
}

/// Whether a content-type is an event stream.
pub fn is_sse(content_type: &[u8]) -> bool {
    content_type.split(|b| *b == b';').next().unwrap_or_default().trim_ascii().eq_ignore_ascii_case(SSE_TYPE.as_bytes())
}

/// Why an answer is not stored as a completion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotFinal {
    /// A 2xx answer without the final JSON-RPC response to the request (an event stream that
    /// ended before it, a body in a content coding, an answer for another id): the call may have
    /// run, its result is unknown.
    Missing,
}

/// What an upstream answer, whatever its status, says about the call whose id is `id`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The call's final JSON-RPC response (`result` or `error`, its id the call's by value): the
    /// JSON body, or the data of the event carrying it. The server dispatched the call and
    /// answered it: this is its result, whatever the status, the stream or the client did after.
    Final(Vec<u8>),
    /// A JSON-RPC response for another, non-null id: not the call's answer, and no evidence that
    /// it never ran either.
    Foreign,
    /// No JSON-RPC response with an id: no body, a body that is not JSON-RPC, or one whose id is
    /// `null` (the server could not read the request, JSON-RPC 2.0 section 5).
    None,
    /// One JSON-RPC error whose id is the string `"server-error"` (`SDK_NO_ID`), the body alone
    /// (not an event stream): what the Python SDK's 1.x Streamable HTTP transport answers where it
    /// has no request id, for every refusal before dispatch (`400`, `404`, `406`, `415`: a missing or
    /// unknown session, the accept or content type, a body it cannot parse or validate, an
    /// unsupported protocol version) and for failures after it (`500`, and `503` for too many
    /// sessions). Evidence that nothing ran only with a status the route releases (as `None`); at
    /// any other status it is another id's answer (as `Foreign`: the outcome is unknown).
    NoRequestId,
    /// A body idemgate cannot read (in a content coding; over `max_response_body_bytes`).
    Unreadable,
}

/// Whether a content-type is JSON (`application/json` or a `+json` type).
fn is_json(content_type: &[u8]) -> bool {
    let t = content_type.split(|b| *b == b';').next().unwrap_or_default().trim_ascii();
    t.eq_ignore_ascii_case(JSON_TYPE.as_bytes()) || t.len() >= 5 && t[t.len() - 5..].eq_ignore_ascii_case(b"+json")
}

/// Reads an upstream answer (`status` any) to the call whose id is `id` (JSON text): the JSON
/// messages of its body (the body itself, a batch's members, or the data of each complete event
/// of an event stream) searched for the call's final response. `None` (which a released status
/// may release on) only on evidence that no response is there: an empty body, a body of another
/// content type that is no JSON, or JSON-RPC messages none of which answers with an id. A body
/// declared (or, without a content type, sent) as JSON or as an event stream that idemgate cannot
/// read whole (nesting beyond the parser's depth, numbers out of range, invalid text, trailing
/// bytes, an event cut before its end, an event whose data is not JSON) is `Unreadable`: it may
/// hold the call's response (issue 39's review: a 400 carrying a tool's error with deep `data`
/// was read as no response and released).
pub fn read_answer(content_type: Option<&[u8]>, content_encoding: Option<&[u8]>, body: &[u8], id: &[u8]) -> Answer {
    if content_encoding.is_some_and(|c| !c.trim_ascii().eq_ignore_ascii_case(b"identity")) {
        return Answer::Unreadable;
    }
    let sse = content_type.is_some_and(is_sse);
    // Without a content type, a body that opens as JSON is taken as sent as JSON.
    let declared_json = match content_type {
        Some(t) => sse || is_json(t),
        None => matches!(body.trim_ascii_start().first(), Some(b'{' | b'[')),
    };
    // Each message with its parsed value where the body was parsed whole already (JSON), so no
    // message is parsed twice; an event's data is parsed as it is read.
    let (messages, mut unreadable) = if sse {
        let (events, cut) = sse_events(body);
        (events.into_iter().map(|e| (e, None)).collect(), cut)
    } else if body.trim_ascii().is_empty() {
        (vec![], false)
    } else {
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Array(items)) => {
                (elements(body).into_iter().zip(items).map(|(raw, v)| (raw.to_vec(), Some(v))).collect(), false)
            }
            Ok(v) => (vec![(body.to_vec(), Some(v))], false),
            Err(_) => (vec![], declared_json),
        }
    };
    let mut foreign = false;
    let alone = !sse && body.trim_ascii_start().first() == Some(&b'{');
    let mut no_request_id = false;
    for (m, parsed) in messages {
        if m.trim_ascii().is_empty() {
            continue; // an event without data (a priming event)
        }
        let Some(v) = parsed.or_else(|| serde_json::from_slice::<Value>(&m).ok()) else {
            unreadable = true;
            continue;
        };
        match response_id_of(&v, &m) {
            Some(i) if same_id(i, id) => return Answer::Final(m),
            Some(i)
                if alone
                    && i.trim_ascii() == SDK_NO_ID
                    && v.get("error").is_some_and(Value::is_object)
                    && v.get("result").is_none() =>
            {
                no_request_id = true
            }
            Some(i) if i.trim_ascii() != b"null" => foreign = true,
            _ => {}
        }
    }
    if foreign {
        Answer::Foreign
    } else if unreadable {
        Answer::Unreadable
    } else if no_request_id {
        Answer::NoRequestId
    } else {
        Answer::None
    }
}

/// The id the Python SDK's 1.x Streamable HTTP transport gives the errors it answers without a
/// request's id (`"id": "server-error"`, mcp 1.x `mcp/server/streamable_http.py`
/// `_create_error_response` and `mcp/server/streamable_http_manager.py` `_error_response`; gone
/// from 2.x, which answers `"id": null`). A call whose own id is that string is answered by it
/// (`same_id` first).
pub const SDK_NO_ID: &[u8] = br#""server-error""#;

/// Whether a call's final JSON-RPC response (`Answer::Final`'s message) asks for input before the
/// call can end (revision 2026-07-28's `InputRequiredResult`: a `result` whose `resultType` is
/// `"input_required"`, with `inputRequests` or a `requestState`, at least one, as its schema
/// says; state alone asks the client to poll). Not the call's end: the client sends the call again
/// with `params.inputResponses` and the `requestState` it was given. Whether such an answer is
/// kept or released is the route's `mcp.input_required`.
pub fn input_required(message: &[u8]) -> bool {
    let Ok(Value::Object(m)) = serde_json::from_slice::<Value>(message) else { return false };
    let Some(Value::Object(result)) = m.get("result") else { return false };
    let present = |name| result.get(name).is_some_and(|v| !v.is_null());
    !m.contains_key("error")
        && result.get("resultType").and_then(Value::as_str) == Some("input_required")
        && (present("inputRequests") || present("requestState"))
}

/// `read_answer` on a captured response.
pub fn answer_of(r: &StoredResponse, id: &[u8]) -> Answer {
    let header = |name: &str| r.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice());
    read_answer(header("content-type"), header("content-encoding"), &r.body, id)
}

/// What is stored of an upstream answer to a protected call whose id is `id` (JSON text): its
/// final JSON-RPC response when it carries one (a JSON body as it is; from an event stream, the
/// data of the event that answers `id`: earlier events are not kept); a 2xx without it is no
/// completion; any other status without it is kept as it came.
pub fn stored_body(
    status: u16,
    content_type: Option<&[u8]>,
    content_encoding: Option<&[u8]>,
    body: &[u8],
    id: &[u8],
) -> Result<Vec<u8>, NotFinal> {
    kept_body(status, read_answer(content_type, content_encoding, body, id), body)
}

/// `stored_body`'s rule on an answer already read (`answer`, of `body` answered with `status`).
fn kept_body(status: u16, answer: Answer, body: &[u8]) -> Result<Vec<u8>, NotFinal> {
    match answer {
        Answer::Final(m) => Ok(m),
        // Another call's response, or one idemgate cannot read, is never kept as this call's
        // (a replay would splice this call's id into it), whatever the status.
        Answer::Foreign | Answer::Unreadable | Answer::NoRequestId => Err(NotFinal::Missing),
        Answer::None if !(200..300).contains(&status) => Ok(body.to_vec()),
        Answer::None => Err(NotFinal::Missing),
    }
}

/// Response headers a replay never carries: the first caller's session is not the retry's.
pub const NOT_REPLAYED_HEADERS: &[&str] = &["mcp-session-id", "content-length"];

/// `stored_body` on a whole response: what a completion keeps. Its `content-type` stays as the
/// upstream sent it (a replay reads it to know whether the first answer was an event stream);
/// its body is the final JSON-RPC response.
pub fn stored_response(r: StoredResponse, id: &[u8]) -> Result<StoredResponse, NotFinal> {
    let answer = answer_of(&r, id);
    stored_response_read(r, answer)
}

/// `stored_response` on a response whose answer was already read (`answer_of`).
pub fn stored_response_read(r: StoredResponse, answer: Answer) -> Result<StoredResponse, NotFinal> {
    let body = kept_body(r.status, answer, &r.body)?;
    Ok(final_response(r, body))
}

/// What a completion keeps of a response whose final JSON-RPC response is `body`
/// (`Answer::Final`): its status, its headers but a session's, and that response.
pub fn final_response(r: StoredResponse, body: Vec<u8>) -> StoredResponse {
    let headers = r.headers.into_iter().filter(|(n, _)| !NOT_REPLAYED_HEADERS.contains(&n.as_str())).collect();
    StoredResponse { status: r.status, headers, body }
}

/// A replay of a stored response to a retry (`id`, JSON text; `accepts`): status, headers and
/// body. A 2xx's body is the final JSON-RPC response with the retry's id, as JSON or as one event
/// (`Accepts::sse_reply`); any other status is replayed as stored.
pub fn replay(r: &StoredResponse, id: &[u8], accepts: Accepts) -> StoredResponse {
    let mut headers: Vec<(String, Vec<u8>)> =
        r.headers.iter().filter(|(n, _)| !NOT_REPLAYED_HEADERS.contains(&n.as_str())).cloned().collect();
    let as_stored = |headers| StoredResponse { status: r.status, headers, body: r.body.clone() };
    // A JSON-RPC response stored with another status (a server that answers a tool's error with
    // 400 or 404) is the call's final response too: the retry's id, in the form it accepts (the
    // first answer may have come as an event, whose data is what was stored).
    let answered = (200..300).contains(&r.status) || response_id(&r.body).is_some_and(|i| i.trim_ascii() != b"null");
    if !answered {
        return as_stored(headers);
    }
    let Some(body) = with_id(&r.body, id) else { return as_stored(headers) };
    let first_was_sse = r.headers.iter().any(|(n, v)| n == "content-type" && is_sse(v));
    headers.retain(|(n, _)| n != "content-type");
    if accepts.sse_reply(first_was_sse) {
        headers.push(("content-type".into(), SSE_TYPE.as_bytes().to_vec()));
        StoredResponse { status: r.status, headers, body: sse_event(&body) }
    } else {
        headers.push(("content-type".into(), JSON_TYPE.as_bytes().to_vec()));
        StoredResponse { status: r.status, headers, body }
    }
}

/// The raw id of `msg` if it is a JSON-RPC response (an object with `result` or `error`, no
/// `method`).
fn response_id(msg: &[u8]) -> Option<&[u8]> {
    response_id_of(&serde_json::from_slice::<Value>(msg).ok()?, msg)
}

/// `response_id` of `msg` already parsed as `v`.
fn response_id_of<'m>(v: &Value, msg: &'m [u8]) -> Option<&'m [u8]> {
    let Value::Object(m) = v else { return None };
    if m.contains_key("method") || !(m.contains_key("result") || m.contains_key("error")) {
        return None;
    }
    member(msg, "id")
}

/// Whether two JSON-RPC ids (JSON text) are one id, by value: strings compared decoded
/// (`"a"` is `"\u0061"`), numbers by their exact value (`1`, `1.0`, `1e0` and `10e-1` are one
/// id: a server's reader may keep only the value, and a JavaScript server echoes `1.0` as `1`),
/// `null` only with `null`. A string is never a number (`"1"` is not `1`).
pub fn same_id(a: &[u8], b: &[u8]) -> bool {
    let (a, b) = (a.trim_ascii(), b.trim_ascii());
    if a == b {
        return true;
    }
    match (a.first(), b.first()) {
        (Some(b'"'), Some(b'"')) => {
            let decoded = |s: &[u8]| serde_json::from_slice::<String>(s).ok();
            matches!((decoded(a), decoded(b)), (Some(x), Some(y)) if x == y)
        }
        _ => matches!((decimal(a), decimal(b)), (Some(x), Some(y)) if x == y),
    }
}

/// A JSON number's exact value as (negative, significant digits without leading or trailing
/// zeros, power of ten): `-12.50e1` is (true, "125", 0); zero is (false, "", 0). `None` for
/// anything that is not a JSON number, or an exponent beyond i64.
fn decimal(s: &[u8]) -> Option<(bool, Vec<u8>, i64)> {
    let (negative, rest) = match s.strip_prefix(b"-") {
        Some(r) => (true, r),
        None => (false, s),
    };
    let int_len = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let (int, rest) = rest.split_at(int_len);
    if int.is_empty() || (int.len() > 1 && int.first() == Some(&b'0')) {
        return None;
    }
    let (frac, rest) = match rest.strip_prefix(b".") {
        Some(r) => {
            let n = r.iter().take_while(|b| b.is_ascii_digit()).count();
            if n == 0 {
                return None;
            }
            r.split_at(n)
        }
        None => (&b""[..], rest),
    };
    let exp: i64 = match rest.first() {
        None => 0,
        Some(b'e' | b'E') => {
            let e = rest.get(1..)?;
            let digits = e.strip_prefix(b"+").or_else(|| e.strip_prefix(b"-")).unwrap_or(e);
            if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            std::str::from_utf8(e.strip_prefix(b"+").unwrap_or(e)).ok()?.parse().ok()?
        }
        Some(_) => return None,
    };
    let mut digits: Vec<u8> = int.iter().chain(frac).copied().collect();
    let mut power = exp.checked_sub(i64::try_from(frac.len()).ok()?)?;
    let lead = digits.iter().take_while(|d| **d == b'0').count();
    digits.drain(..lead);
    while digits.last() == Some(&b'0') {
        digits.pop();
        power = power.checked_add(1)?;
    }
    if digits.is_empty() {
        return Some((false, digits, 0));
    }
    Some((negative, digits, power))
}

/// The data of every complete event in an event stream (WHATWG HTML, "event stream
/// interpretation"): lines end in CRLF, LF or CR; `data:` lines join with LF; a blank line ends
/// an event; an event not ended before the stream ends is dropped, as a browser drops it.
fn sse_events(body: &[u8]) -> (Vec<Vec<u8>>, bool) {
    let mut events = vec![];
    let mut data: Option<Vec<u8>> = None;
    let mut i = 0;
    while i < body.len() {
        let rest = body.get(i..).unwrap_or_default();
        let len = rest.iter().position(|b| *b == b'\n' || *b == b'\r');
        // An unterminated last line: the event it belongs to is cut.
        let Some(len) = len else {
            let cut = !rest.trim_ascii().is_empty() || data.is_some_and(|d| !d.trim_ascii().is_empty());
            return (events, cut);
        };
        let line = rest.get(..len).unwrap_or_default();
        i += len + if rest.get(len..len + 2) == Some(b"\r\n") { 2 } else { 1 };
        if line.is_empty() {
            if let Some(d) = data.take() {
                events.push(d);
            }
            continue;
        }
        if line.first() == Some(&b':') {
            continue;
        }
        let (field, value) = match line.iter().position(|b| *b == b':') {
            Some(c) => {
                let v = line.get(c + 1..).unwrap_or_default();
                (line.get(..c).unwrap_or_default(), v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        if field == b"data" {
            match data.as_mut() {
                None => data = Some(value.to_vec()),
                Some(d) => {
                    d.push(b'\n');
                    d.extend_from_slice(value);
                }
            }
        }
    }
    // Data lines without the blank line that ends their event: cut too.
    let cut = data.is_some_and(|d| !d.trim_ascii().is_empty());
    (events, cut)
}

/// A stored response replayed to a retry whose id is `id` (JSON text): the retry's id spliced in
/// place of the stored one, every other byte as stored. `None` when the stored body has no
/// top-level `id` (an answer stored as it came: replayed as it is).
pub fn with_id(stored: &[u8], id: &[u8]) -> Option<Vec<u8>> {
    let (s, e) = member_span(stored, "id")?;
    let mut out = Vec::with_capacity(stored.len() + id.len());
    out.extend_from_slice(stored.get(..s)?);
    out.extend_from_slice(id);
    out.extend_from_slice(stored.get(e..)?);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one refusal both builds send to an MCP request (`Reply::problem`): status 200, the
    /// error to its id (each id of a refused batch), as JSON unless the client accepts only an
    /// event stream.
    #[test]
    fn a_refusal_answers_the_id_as_json_or_as_one_event_to_a_client_that_takes_only_events() {
        let json = Accepts { json: true, sse: true };
        let only_sse = Accepts { json: false, sse: true };
        let r = Reply { id: b"7".to_vec(), batch: vec![], accepts: json };
        let sent = r.problem(&ProblemKind::McpBodyAmbiguous);
        assert_eq!(sent.status, 200);
        assert_eq!(sent.headers, vec![("content-type".to_string(), JSON_TYPE.as_bytes().to_vec())]);
        assert_eq!(sent.body, error_body(&ProblemKind::McpBodyAmbiguous, b"7"));
        let r = Reply { accepts: only_sse, ..r };
        let sent = r.problem(&ProblemKind::McpBodyAmbiguous);
        assert_eq!(sent.headers, vec![("content-type".to_string(), SSE_TYPE.as_bytes().to_vec())]);
        assert_eq!(sent.body, sse_event(&error_body(&ProblemKind::McpBodyAmbiguous, b"7")));
        let batch = Reply { id: b"null".to_vec(), batch: vec![b"1".to_vec(), b"\"a\"".to_vec()], accepts: json };
        let sent = batch.problem(&ProblemKind::McpBatchRefused);
        assert_eq!(sent.body, batch_error_body(&ProblemKind::McpBatchRefused, &batch.batch));
    }

    /// Issue 40: a round is what the client sends for it, `inputResponses` and `requestState`,
    /// outside the fingerprint: every round of a call has the call's fingerprint, rounds with
    /// other answers or state differ, and member order or spacing does not.
    #[test]
    fn a_round_is_its_input_responses_and_state_outside_the_fingerprint() {
        let policy = McpPolicy::default();
        let of = |params: &str| {
            let body = format!(
                r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"t","arguments":{{"a":1}}{params}}}}}"#
            );
            match classify(body.as_bytes(), &policy) {
                Classified::Call(c) => (c.digest, c.round),
                other => panic!("{other:?}"),
            }
        };
        let first = of("");
        let answered = of(r#","inputResponses":{"q":{"action":"accept","content":{"x":1,"y":2}}},"requestState":"s1""#);
        let reordered =
            of(r#", "requestState" : "s1","inputResponses":{"q":{"content":{"y":2,"x":1},"action":"accept"}}"#);
        let declined = of(r#","inputResponses":{"q":{"action":"decline"}},"requestState":"s1""#);
        let state_only = of(r#","requestState":"s1""#);
        let nulls = of(r#","inputResponses":null,"requestState":null"#);
        for (_, (digest, _)) in [("answered", answered), ("declined", declined), ("state", state_only)] {
            assert_eq!(digest, first.0, "every round has the call's fingerprint");
        }
        assert_eq!(answered.1, reordered.1);
        assert_eq!(nulls.1, first.1);
        let rounds = [first.1, answered.1, declined.1, state_only.1];
        for (i, a) in rounds.iter().enumerate() {
            for b in rounds.iter().skip(i + 1) {
                assert_ne!(a, b);
            }
        }
    }
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn all_tools() -> McpPolicy {
        McpPolicy { tools: None, key_arguments: vec!["idempotency_key".into()], ..McpPolicy::default() }
    }

    fn call_of(body: &str) -> Call {
        match classify(body.as_bytes(), &all_tools()) {
            Classified::Call(c) => c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn routing_headers_must_name_what_the_body_holds() {
        let call =
            r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"café","arguments":{}}}"#.as_bytes();
        let read = br#"{"jsonrpc":"2.0","id":4,"method":"resources/read","params":{"uri":"file:///a"}}"#;
        let list = br#"{"jsonrpc":"2.0","id":5,"method":"tools/list"}"#;
        let m: &[u8] = b"tools/call";
        type Headers<'a> = &'a [&'a [u8]];
        let agree: [(Headers, Headers, &[u8]); 8] = [
            (&[], &[], call),
            (&[m], &[], call),
            (&[m], &["=?base64?Y2Fmw6k=?=".as_bytes()], call),
            (&[], &["=?base64?Y2Fmw6k=?=".as_bytes()], call),
            (&[b"resources/read"], &[b"file:///a"], read),
            (&[b"tools/list"], &[], list),
            // Not a name-bearing method: its name header is not read (as the SDK's server).
            (&[b"tools/list"], &[b"anything"], list),
            // No JSON: `classify`'s to refuse.
            (&[m], &[], b"not json"),
        ];
        for (i, (method, name, body)) in agree.iter().enumerate() {
            let parsed = serde_json::from_slice::<Value>(body).ok();
            assert_eq!(routing_headers_disagree(method, name, parsed.as_ref()), None, "agree {i}");
        }
        let disagree: [(Headers, Headers, &[u8], &str); 10] = [
            (&[b"tools/list"], &[], call, METHOD_HEADER),
            (&[m, m], &[], call, METHOD_HEADER),
            (&[b"Tools/Call"], &[], call, METHOD_HEADER),
            (&[m], &["café".as_bytes(), "café".as_bytes()], call, NAME_HEADER),
            (&[m], &[b"caf"], call, NAME_HEADER),
            // The name's raw UTF-8: not plain printable ASCII, so only its base64 form names it.
            (&[m], &["café".as_bytes()], call, NAME_HEADER),
            // Not canonical (other trailing bits), or no base64 at all: never the name.
            (&[m], &["=?base64?Y2Fmw6l=?=".as_bytes()], call, NAME_HEADER),
            (&[m], &["=?base64?Y2Fmw6k?=".as_bytes()], call, NAME_HEADER),
            (&[], &[b"x"], br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{}}"#, NAME_HEADER),
            (&[b"tools/list"], &[], br#"[{"jsonrpc":"2.0","id":5,"method":"tools/list"}]"#, METHOD_HEADER),
        ];
        for (i, (method, name, body, header)) in disagree.iter().enumerate() {
            let parsed = serde_json::from_slice::<Value>(body).ok();
            assert_eq!(routing_headers_disagree(method, name, parsed.as_ref()), Some(*header), "disagree {i}");
            // As `classify_sent` decides it, before anything else the body holds.
            let every = McpPolicy::default();
            assert_eq!(classify_sent(body, &every, method, name), Classified::HeaderMismatch(header), "disagree {i}");
        }
        assert_eq!(request_id(call), Some(b"3".to_vec()));
        assert_eq!(error_code(&ProblemKind::McpHeaderMismatch { header: NAME_HEADER }), -32020);
    }

    #[test]
    fn only_tools_call_for_a_listed_tool_is_protected() {
        let p = McpPolicy { tools: Some(vec!["charge".into()]), key_arguments: vec![], ..McpPolicy::default() };
        let c = |b: &str| classify(b.as_bytes(), &p);
        assert!(matches!(
            c(r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{}}}"#),
            Classified::Call(_)
        ));
        assert_eq!(
            c(r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"lookup","arguments":{}}}"#),
            Classified::Pass
        );
        assert_eq!(c(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#), Classified::Pass);
        assert_eq!(c(r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#), Classified::Pass);
        assert_eq!(
            c(r#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":1}}"#),
            Classified::Pass
        );
        assert_eq!(c(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#), Classified::Pass);
        assert_eq!(c("not json"), Classified::Ambiguous);
        assert_eq!(c(r#"[]"#), Classified::Pass);
        assert_eq!(c("\"tools/call\""), Classified::Pass);
        assert_eq!(c("{\"method\":\"tools/call\",\"params\":{\"name\":\"ch\u{e9}\"}}"), Classified::Pass);
        let not_utf8 = b"{\"method\":\"tools/call\",\"params\":{\"name\":\"charge\"},\"x\":\"\xff\"}";
        assert_eq!(classify(not_utf8, &p), Classified::Ambiguous);
    }

    #[test]
    fn a_batch_with_a_protected_call_is_refused_with_each_request_id() {
        let b = r#"[{"jsonrpc":"2.0","id":"a","method":"tools/list"},
                    {"jsonrpc":"2.0","method":"notifications/initialized"},
                    {"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge"}}]"#;
        assert_eq!(classify(b.as_bytes(), &all_tools()), Classified::Batch(vec![b"\"a\"".to_vec(), b"7".to_vec()]));
        let only_lists = r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"}]"#;
        assert_eq!(classify(only_lists.as_bytes(), &all_tools()), Classified::Pass);
        let body = batch_error_body(&ProblemKind::McpBatchRefused, &[b"\"a\"".to_vec(), b"7".to_vec()]);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v[0]["id"], "a");
        assert_eq!(v[1]["id"], 7);
        assert_eq!(v[1]["error"]["code"], -32007);
        assert_eq!(v[1]["error"]["data"]["type"], "urn:idemgate:problem:mcp-batch-refused");
    }

    #[test]
    fn duplicate_names_or_deep_nesting_are_ambiguous() {
        let dup = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call","params":{"name":"charge"}}"#;
        assert_eq!(classify(dup.as_bytes(), &all_tools()), Classified::Ambiguous);
        let args_dup = r#"{"id":1,"method":"tools/call","params":{"name":"charge","arguments":{"a":1,"a":2}}}"#;
        assert_eq!(classify(args_dup.as_bytes(), &all_tools()), Classified::Ambiguous);
        // Deeper than idemgate reads, a number out of its range, UTF-16 or a BOM: a server's
        // reader (Python's json takes all of them) could run a call idemgate never saw.
        let deep = format!(
            r#"{{"id":1,"method":"tools/call","params":{{"name":"charge","arguments":{{"x":{}{}}}}}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        assert_eq!(classify(deep.as_bytes(), &all_tools()), Classified::Ambiguous);
        let huge = r#"{"id":1,"method":"tools/call","params":{"name":"charge","arguments":{"x":1e400}}}"#;
        assert_eq!(classify(huge.as_bytes(), &all_tools()), Classified::Ambiguous);
        let call = r#"{"id":1,"method":"tools/call","params":{"name":"charge"}}"#;
        let utf16: Vec<u8> = call.encode_utf16().flat_map(u16::to_le_bytes).collect();
        assert_eq!(classify(&utf16, &all_tools()), Classified::Ambiguous);
        let bom = [&b"\xef\xbb\xbf"[..], call.as_bytes()].concat();
        assert_eq!(classify(&bom, &all_tools()), Classified::Ambiguous);
        // Escapes are read as servers read them: still the protected call.
        let escaped = r#"{"id":1,"method":"tools\/call","params":{"name":"ch\u0061rge"}}"#;
        assert!(matches!(classify(escaped.as_bytes(), &all_tools()), Classified::Call(_)));
    }

    #[test]
    fn a_name_repeated_in_any_spelling_or_a_string_not_unicode_is_ambiguous() {
        // Review (h-review4): each pair of spellings is one member name to the MCP SDKs' readers
        // (Python's json, JSON.parse, Go), a repeated one they run by its last value (simdjson
        // by its first), and a string that is not Unicode Go reads as U+FFFD where Python keeps
        // or refuses it: a class or key read from either value could make two calls one or one
        // call two, so none is classified.
        for body in [
            &br#"{"jsonrpc":"2.0","id":1,"\u006dethod":"tools/list","method":"tools/call","params":{"name":"charge"}}"#[..],
            br#"{"jsonrpc":"2.0","id":1,"\u0069d":2,"method":"tools/call","params":{"name":"charge"}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge"},"p\u0061rams":{"name":"lookup"}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","n\u0061me":"lookup"}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"a":1},"\u0061rguments":{"a":2}}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"\u00E9":1,"\u00e9":2}}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"\/":1,"/":2}}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"x":[{"k":1,"k":2}]}}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"a":"\ud800"}}}"#,
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{\"name\":\"charge\",\"arguments\":{\"a\":\"\xff\"}}}",
        ] {
            assert_eq!(classify(body, &all_tools()), Classified::Ambiguous, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn fingerprint_is_tool_and_canonical_arguments_only() {
        let a = call_of(
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":5,"to":"x"},"_meta":{"progressToken":1}}}"#,
        );
        let b = call_of(
            r#"{"params":{"_meta":{"progressToken":"p-2"},"arguments":{ "to" : "x", "amount" : 5 },"name":"charge"},"method":"tools/call","id":"retry-7","jsonrpc":"2.0"}"#,
        );
        assert_eq!(a.digest, b.digest);
        assert_eq!(a.id, b"1");
        assert_eq!(b.id, b"\"retry-7\"");
        // Number spelling is the upstream's business: 5.0 is another request.
        let c =
            call_of(r#"{"id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":5.0,"to":"x"}}}"#);
        assert_ne!(a.digest, c.digest);
        let d =
            call_of(r#"{"id":1,"method":"tools/call","params":{"name":"refund","arguments":{"amount":5,"to":"x"}}}"#);
        assert_ne!(a.digest, d.digest);
        // A task-augmented call is another call; the task's members in any order, one task.
        let t = call_of(
            r#"{"id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":5,"to":"x"},"task":{"ttl":6000}}}"#,
        );
        assert_ne!(a.digest, t.digest);
        let t2 = call_of(
            r#"{"id":1,"method":"tools/call","params":{"task":{ "ttl" : 6000 },"name":"charge","arguments":{"amount":5,"to":"x"}}}"#,
        );
        assert_eq!(t.digest, t2.digest);
        let t3 = call_of(
            r#"{"id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":5,"to":"x"},"task":{"ttl":1}}}"#,
        );
        assert_ne!(t.digest, t3.digest);
        let n = call_of(
            r#"{"id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":5,"to":"x"},"task":null}}"#,
        );
        assert_eq!(a.digest, n.digest);
        // No arguments and empty arguments are one call.
        let e = call_of(r#"{"id":1,"method":"tools/call","params":{"name":"charge"}}"#);
        let f = call_of(r#"{"id":1,"method":"tools/call","params":{"name":"charge","arguments":{}}}"#);
        assert_eq!(e.digest, f.digest);
        // A tools/call without an id, or with id null, is no call: refused, never forwarded (a
        // notification-shaped tools/call for an unprotected tool passes, as any notification).
        for b in [
            r#"{"method":"tools/call","params":{"name":"charge"}}"#,
            r#"{"id":null,"method":"tools/call","params":{"name":"charge"}}"#,
        ] {
            assert_eq!(classify(b.as_bytes(), &all_tools()), Classified::Ambiguous, "{b}");
        }
        let only = McpPolicy { tools: Some(vec!["charge".into()]), key_arguments: vec![], ..McpPolicy::default() };
        assert_eq!(classify(br#"{"method":"tools/call","params":{"name":"lookup"}}"#, &only), Classified::Pass);
    }

    #[test]
    fn key_from_meta_first_then_named_argument() {
        let m = call_of(
            r#"{"id":1,"method":"tools/call","params":{"name":"c","arguments":{"idempotency_key":"arg"},"_meta":{"idempotencyKey":"meta"}}}"#,
        );
        assert_eq!(m.key, Some(BodyKey { source: "params._meta.idempotencyKey".into(), value: Some("meta".into()) }));
        let a =
            call_of(r#"{"id":1,"method":"tools/call","params":{"name":"c","arguments":{"idempotency_key":"arg"}}}"#);
        assert_eq!(
            a.key,
            Some(BodyKey { source: "params.arguments.idempotency_key".into(), value: Some("arg".into()) })
        );
        let n = call_of(r#"{"id":1,"method":"tools/call","params":{"name":"c","_meta":{"idempotencyKey":5}}}"#);
        assert_eq!(n.key.and_then(|k| k.value), None);
        assert_eq!(
            call_of(r#"{"id":1,"method":"tools/call","params":{"name":"c","arguments":{"other":"x"}}}"#).key,
            None
        );
    }

    #[test]
    fn replay_splices_the_retry_id_and_keeps_every_other_byte() {
        let stored = br#"{"jsonrpc":"2.0", "id" : 1 ,"result":{"content":[{"type":"text","text":"id: 1"}],"id":9}}"#;
        let out = with_id(stored, b"\"r-2\"").unwrap();
        assert_eq!(
            out,
            br#"{"jsonrpc":"2.0", "id" : "r-2" ,"result":{"content":[{"type":"text","text":"id: 1"}],"id":9}}"#
        );
        let s2 = br#"{"result":{"x":"\"id\":"},"id":"a\"b"}"#;
        assert_eq!(with_id(s2, b"3").unwrap(), br#"{"result":{"x":"\"id\":"},"id":3}"#);
        assert_eq!(with_id(b"[1]", b"3"), None);
        assert_eq!(with_id(br#"{"result":{}}"#, b"3"), None);
    }

    #[test]
    fn the_final_response_is_found_in_an_event_stream() {
        let sse = b": ping\r\nevent: message\r\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\r\n\r\n\
event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":2,\"result\":{}}\n\n\
event: message\ndata: {\"jsonrpc\":\"2.0\",\n\
data: \"id\":1,\"result\":{\"ok\":true}}\n\n";
        let got = stored_body(200, Some(b"text/event-stream"), None, sse, b"1").unwrap();
        assert_eq!(got, b"{\"jsonrpc\":\"2.0\",\n\"id\":1,\"result\":{\"ok\":true}}");
        // The stream ended before the final event (or in its middle): no completion.
        let cut = b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\n\
data: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}";
        assert_eq!(stored_body(200, Some(b"text/event-stream"), None, cut, b"1"), Err(NotFinal::Missing));
        // An answer to another id, a request from the server, a gzip body: no completion.
        assert_eq!(
            stored_body(200, Some(b"application/json"), None, br#"{"id":2,"result":{}}"#, b"1"),
            Err(NotFinal::Missing)
        );
        assert_eq!(
            stored_body(200, Some(b"application/json"), None, br#"{"id":1,"method":"sampling/createMessage"}"#, b"1"),
            Err(NotFinal::Missing)
        );
        assert_eq!(
            stored_body(200, Some(b"application/json"), Some(b"gzip"), br#"{"id":1,"result":{}}"#, b"1"),
            Err(NotFinal::Missing)
        );
        assert_eq!(stored_body(200, None, None, br#"{"id":"1","result":{}}"#, b"1"), Err(NotFinal::Missing));
        // A JSON-RPC error is a final answer; a 4xx is kept as it came.
        assert!(stored_body(200, None, None, br#"{"id":1,"error":{"code":-1,"message":"x"}}"#, b"1").is_ok());
        assert_eq!(stored_body(404, None, None, b"gone", b"1"), Ok(b"gone".to_vec()));
    }

    #[test]
    fn elements_of_any_bytes_end() {
        for bad in ["[}", "[:", "[1,}", "[", "[\"", "[1 2]", "x"] {
            let _ = elements(bad.as_bytes());
            let _ = read_answer(None, None, bad.as_bytes(), b"1");
        }
        assert_eq!(elements(br#"[1, "a" ,{"b":[2]}]"#), vec![&b"1"[..], b"\"a\"", br#"{"b":[2]}"#]);
    }

    #[test]
    fn ids_are_one_id_by_value() {
        for (a, b) in [
            ("1", "1.0"),
            ("1", "1e0"),
            ("100", "1e2"),
            ("100", "1E+2"),
            ("1", "10e-1"),
            ("-5", "-0.5E+1"),
            ("0", "-0"),
            ("0", "0.000e7"),
            ("123456789012345678901234567890", "1.2345678901234567890123456789e29"),
            (r#""a""#, r#""\u0061""#),
            ("null", "null"),
        ] {
            assert!(same_id(a.as_bytes(), b.as_bytes()), "{a} {b}");
            assert!(same_id(b.as_bytes(), a.as_bytes()), "{b} {a}");
        }
        for (a, b) in [
            ("1", "2"),
            ("1", r#""1""#),
            ("1", "-1"),
            ("null", "0"),
            ("10", "1"),
            // A JavaScript peer's rounding is another value: no match, so the answer is missing
            // (outcome unknown), never someone else's.
            ("12345678901234567890", "12345678901234567000"),
            ("18446744073709551617", "18446744073709551616"),
            (r#""a""#, r#""A""#),
            ("1", "01"),
            ("1", "1e"),
        ] {
            assert!(!same_id(a.as_bytes(), b.as_bytes()), "{a} {b}");
        }
    }

    #[test]
    fn ids_are_kept_and_spliced_as_the_client_wrote_them() {
        for id in ["1e2", "123456789012345678901234567890", "-0.50", r#""\u0072-1""#, "1.0"] {
            let body = format!(r#"{{"jsonrpc":"2.0","id": {id} ,"method":"tools/call","params":{{"name":"c"}}}}"#);
            let c = call_of(&body);
            assert_eq!(c.id, id.as_bytes(), "{id}");
            let stored = br#"{"jsonrpc":"2.0","id":1,"result":{}}"#;
            let expected = format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{}}}}"#);
            assert_eq!(with_id(stored, &c.id).unwrap(), expected.as_bytes());
            let refusal = String::from_utf8(error_body(&ProblemKind::McpBodyAmbiguous, &c.id)).unwrap();
            assert!(refusal.contains(&format!(r#""id":{id},"#)), "{refusal}");
        }
        let batch = r#"[{"id":1e2,"method":"tools/call","params":{"name":"c"}},{"id":"x","method":"ping"}]"#;
        let Classified::Batch(ids) = classify(batch.as_bytes(), &all_tools()) else { panic!() };
        assert_eq!(ids, vec![b"1e2".to_vec(), b"\"x\"".to_vec()]);
        let body = batch_error_body(&ProblemKind::McpBatchRefused, &ids);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v[1]["id"], "x");
        assert!(String::from_utf8(body).unwrap().contains(r#""id":1e2,"#));
    }

    #[test]
    fn an_answer_is_the_calls_by_its_id_value_whatever_its_status() {
        let json = Some(&b"application/json"[..]);
        // A JavaScript server echoes 1.0 as 1: the call's answer.
        assert_eq!(
            read_answer(json, None, br#"{"jsonrpc":"2.0","id":1,"result":{}}"#, b"1.0"),
            Answer::Final(br#"{"jsonrpc":"2.0","id":1,"result":{}}"#.to_vec())
        );
        // A 2026-07-28 Python server's tool error (400 or 404): the request's id, the call's answer.
        let err = br#"{"jsonrpc":"2.0","id":7,"error":{"code":-32600,"message":"charged, then failed"}}"#;
        assert_eq!(read_answer(json, None, err, b"7"), Answer::Final(err.to_vec()));
        assert_eq!(stored_body(400, json, None, err, b"7"), Ok(err.to_vec()));
        // A transport's refusal before it read the request: id null, nothing of the call's.
        let refused = br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error"}}"#;
        assert_eq!(read_answer(json, None, refused, b"7"), Answer::None);
        assert_eq!(read_answer(None, None, b"", b"7"), Answer::None);
        assert_eq!(read_answer(Some(b"text/plain"), None, b"Not Acceptable", b"7"), Answer::None);
        // The 1.x Python SDK transport's error without the request's id: `NoRequestId` (released
        // only at a released status, `engine::settle`), never kept as the call's answer. Not in an
        // event stream, a batch, with a result, or as anything but an error object: another id.
        let no_id = br#"{"jsonrpc":"2.0","id":"server-error","error":{"code":-32600,"message":"Bad Request: Missing session ID"}}"#;
        assert_eq!(read_answer(json, None, no_id, b"7"), Answer::NoRequestId);
        assert_eq!(read_answer(None, None, no_id, b"7"), Answer::NoRequestId);
        assert_eq!(stored_body(500, json, None, no_id, b"7"), Err(NotFinal::Missing));
        assert_eq!(stored_body(400, json, None, no_id, b"7"), Err(NotFinal::Missing));
        // A call whose own id is that string is answered by it.
        assert_eq!(read_answer(json, None, no_id, br#""server-error""#), Answer::Final(no_id.to_vec()));
        let sse_no_id = [&b"event: message\ndata: "[..], no_id, b"\n\n"].concat();
        for foreign in [
            sse_no_id.as_slice(),
            br#"[{"jsonrpc":"2.0","id":"server-error","error":{}}]"#,
            br#"{"jsonrpc":"2.0","id":"server-error","error":{},"result":{}}"#,
            br#"{"jsonrpc":"2.0","id":"server-error","error":"x"}"#,
            br#"{"jsonrpc":"2.0","id":"server-error","result":{}}"#,
            br#"{"jsonrpc":"2.0","id":"Server-Error","error":{}}"#,
        ] {
            let t = if foreign.starts_with(b"event") { Some(&b"text/event-stream"[..]) } else { json };
            assert_eq!(read_answer(t, None, foreign, b"7"), Answer::Foreign, "{}", String::from_utf8_lossy(foreign));
        }
        assert_eq!(read_answer(json, Some(b"gzip"), err, b"7"), Answer::Unreadable);
        // An event stream: the event that answers, whatever follows it.
        let sse = b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}\n\n: ping\n\n: pi";
        assert_eq!(
            read_answer(Some(b"text/event-stream"), None, sse, b"7"),
            Answer::Final(br#"{"jsonrpc":"2.0","id":7,"result":{}}"#.to_vec())
        );
        // A 400 stored as the call's answer is replayed under the retry's id; other statuses as stored.
        let r = StoredResponse {
            status: 400,
            headers: vec![("content-type".into(), b"application/json".to_vec())],
            body: err.to_vec(),
        };
        let sent = replay(&r, b"\"r-2\"", Accepts { json: true, sse: true });
        assert_eq!(sent.status, 400);
        assert_eq!(
            sent.body,
            br#"{"jsonrpc":"2.0","id":"r-2","error":{"code":-32600,"message":"charged, then failed"}}"#
        );
        // A 400 whose response came as an event: replayed in a form the retry reads (review).
        let r = StoredResponse {
            status: 400,
            headers: vec![("content-type".into(), b"text/event-stream".to_vec())],
            body: err.to_vec(),
        };
        let sent = replay(&r, b"3", Accepts { json: false, sse: true });
        assert_eq!(
            read_answer(Some(b"text/event-stream"), None, &sent.body, b"3"),
            Answer::Final(with_id(err, b"3").unwrap_or_default())
        );
        let sent = replay(&r, b"3", Accepts { json: true, sse: false });
        assert_eq!(
            sent.headers.iter().find(|(n, _)| n == "content-type").map(|(_, v)| v.as_slice()),
            Some(&b"application/json"[..])
        );
        let r = StoredResponse { status: 500, headers: vec![], body: br#"{"id":"e-1","message":"x"}"#.to_vec() };
        assert_eq!(replay(&r, b"2", Accepts { json: true, sse: false }).body, r.body);
    }

    /// The review of issue 40's answer reading: "no response" (what a released status may
    /// release on) only on evidence; a body declared as JSON or as an event stream that cannot be
    /// read whole may hold the call's response, and another call's response is never kept.
    #[test]
    fn an_answer_that_cannot_be_read_whole_is_never_no_response() {
        let json = Some(&b"application/json"[..]);
        let sse = Some(&b"text/event-stream"[..]);
        let deep = format!(
            r#"{{"jsonrpc":"2.0","id":7,"error":{{"code":-32602,"message":"x","data":{}1{}}}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        let unreadable: Vec<(Option<&[u8]>, Vec<u8>)> = vec![
            // Nesting beyond serde_json's depth: a tool's error with deep data.
            (json, deep.clone().into_bytes()),
            (None, deep.into_bytes()),
            // A number out of range, NaN, a lone surrogate, trailing bytes.
            (json, br#"{"jsonrpc":"2.0","id":7,"result":{"n":1e400}}"#.to_vec()),
            (json, br#"{"jsonrpc":"2.0","id":7,"result":{"n":NaN}}"#.to_vec()),
            (json, br#"{"jsonrpc":"2.0","id":7,"result":{"s":"\udc80"}}"#.to_vec()),
            (json, br#"{"jsonrpc":"2.0","id":7,"result":{}} x"#.to_vec()),
            // An event stream whose answering event is cut, or whose data is not JSON.
            (sse, b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"res".to_vec()),
            (sse, b"data: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}\n".to_vec()),
            (sse, b"data: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"n\":1e400}}\n\n".to_vec()),
        ];
        for (ct, body) in &unreadable {
            let a = read_answer(*ct, None, body, b"7");
            assert_eq!(
                a,
                Answer::Unreadable,
                "{:?} {}",
                ct.map(String::from_utf8_lossy),
                String::from_utf8_lossy(body)
            );
            assert_eq!(stored_body(400, *ct, None, body, b"7"), Err(NotFinal::Missing));
        }
        // Evidence of no response: none of these may hold the call's answer.
        let none: Vec<(Option<&[u8]>, &[u8])> = vec![
            (json, b""),
            (None, b"  "),
            (Some(b"text/html"), b"<html>Bad Request</html>"),
            (json, br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Bad Request"}}"#),
            (sse, b"id: 1\ndata:\n\ndata: {\"jsonrpc\":\"2.0\",\"id\":null,\"error\":{}}\n\n"),
        ];
        for (ct, body) in none {
            assert_eq!(read_answer(ct, None, body, b"7"), Answer::None, "{}", String::from_utf8_lossy(body));
        }
        // Another call's response is no answer of this call's at any status: never kept.
        let other = br#"{"jsonrpc":"2.0","id":3,"result":{"payment":"p-3"}}"#;
        assert_eq!(stored_body(500, json, None, other, b"7"), Err(NotFinal::Missing));
        assert_eq!(stored_body(200, json, None, other, b"7"), Err(NotFinal::Missing));
    }

    #[test]
    fn a_replay_answers_the_retry_in_the_form_it_accepts() {
        let first = StoredResponse {
            status: 200,
            headers: vec![
                ("content-type".into(), b"text/event-stream".to_vec()),
                ("mcp-session-id".into(), b"s-1".to_vec()),
                ("x-app".into(), b"1".to_vec()),
            ],
            body: b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{\"n\":1}}\n\n".to_vec(),
        };
        let stored = stored_response(first, b"1").unwrap();
        assert_eq!(stored.body, br#"{"jsonrpc":"2.0","id":1,"result":{"n":1}}"#);
        assert!(stored.headers.iter().all(|(n, _)| n != "mcp-session-id"));
        let both = Accepts { json: true, sse: true };
        let StoredResponse { status, headers, body } = replay(&stored, b"\"retry\"", both);
        assert_eq!(status, 200);
        assert!(headers.contains(&("content-type".to_string(), b"text/event-stream".to_vec())));
        assert!(headers.contains(&("x-app".to_string(), b"1".to_vec())));
        assert_eq!(
            body,
            b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":\"retry\",\"result\":{\"n\":1}}\n\n".to_vec()
        );
        let StoredResponse { headers, body, .. } = replay(&stored, b"2", Accepts { json: true, sse: false });
        assert!(headers.contains(&("content-type".to_string(), b"application/json".to_vec())));
        assert_eq!(body, br#"{"jsonrpc":"2.0","id":2,"result":{"n":1}}"#);
        let cut = StoredResponse {
            status: 200,
            headers: vec![("content-type".into(), b"text/event-stream".to_vec())],
            body: b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\n".to_vec(),
        };
        assert_eq!(stored_response(cut, b"1"), Err(NotFinal::Missing));
    }

    #[test]
    fn accept_decides_json_or_event_stream() {
        let both = Accepts::of(&[b"application/json, text/event-stream"]);
        assert!(both.json && both.sse);
        assert!(both.sse_reply(true));
        assert!(!both.sse_reply(false));
        let sse_only = Accepts::of(&[b"text/event-stream;q=1"]);
        assert!(sse_only.sse_reply(false));
        let none = Accepts::of(&[]);
        assert!(none.json && !none.sse_reply(true));
        assert_eq!(sse_event(b"{\"a\":\n1}"), b"event: message\ndata: {\"a\":\ndata: 1}\n\n".to_vec());
    }

    #[test]
    fn refusals_are_json_rpc_errors_with_the_request_id() {
        let body = error_body(&ProblemKind::InFlight { retry_after_seconds: 2 }, b"\"x\"");
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["jsonrpc"], "2.0");
        assert_eq!(v["id"], "x");
        assert_eq!(v["error"]["code"], -32001);
        assert_eq!(v["error"]["data"]["status"], 409);
        assert_eq!(v["error"]["data"]["retryAfter"], 2);
        assert_eq!(v["error"]["data"]["retry"], true);
        let r: Value = serde_json::from_slice(&error_body(&ProblemKind::KeyReused { status: 422 }, b"3")).unwrap();
        assert_eq!(r["error"]["code"], -32002);
        assert_eq!(r["error"]["data"]["retry"], false);
        assert!(r["error"]["data"].get("retryAfter").is_none());
        assert_eq!(error_code(&ProblemKind::OutcomeUnknown), -32003);
        assert_eq!(error_code(&ProblemKind::StoreUnavailable { retry_after_seconds: 1 }), -32004);
        assert_eq!(error_code(&ProblemKind::KeyMissing { header: "h".into() }), -32005);
        assert_eq!(error_code(&ProblemKind::BodyTooLarge { limit: 1 }), -32006);
        assert_eq!(error_code(&ProblemKind::KeyExpired), -32008);
        assert_eq!(error_code(&ProblemKind::McpBodyAmbiguous), -32000);
    }
}
