//! RFC 9457 problem documents: one stable `type` per error, listed in docs/problems.md with what the
//! client should do.

use serde_json::{json, Map, Value};

use crate::key::{KeyError, KeySyntax};
use crate::record::Creator;

/// Prefix of every problem type URI.
pub const TYPE_PREFIX: &str = "urn:idemgate:problem:";

/// Envoy's response code details for a reply idemgate sends itself (`%RESPONSE_CODE_DETAILS%` in
/// an access log): `idemgate_` then the outcome slug, lowercase, every other character than a
/// letter or digit as `_` (Envoy refuses details with spaces).
pub fn code_details(slug: &str) -> String {
    let mut d = String::from("idemgate_");
    d.extend(slug.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }));
    d
}

/// An error answered by the filter itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProblemKind {
    /// `require_key` is set and the request has no key.
    KeyMissing { header: String },
    /// The key header is malformed under the policy's `key_syntax` and `key_max_length`.
    KeyInvalid { header: String, error: KeyError, syntax: KeySyntax, max_len: usize },
    /// The request has a key but none of the headers that identify its caller
    /// (`scope.anonymous: "reject"`); nothing was forwarded.
    ScopeMissing { headers: Vec<String> },
    /// The body exceeds `max_request_body_bytes`; nothing was forwarded.
    BodyTooLarge { limit: u64 },
    /// The first request with this key is still being processed.
    InFlight { retry_after_seconds: u64 },
    /// The first request may have executed but its outcome is not known.
    OutcomeUnknown,
    /// The key's record expired (`ttl_seconds`) and only its tombstone is left
    /// (`tombstone_seconds`): the same request again, whose outcome is no longer known; nothing
    /// was forwarded.
    KeyExpired,
    /// The key was used before with a different request; `status` is the policy's
    /// `mismatch_status` (422 or 409).
    KeyReused { status: u16 },
    /// The store cannot be reached; nothing was forwarded.
    StoreUnavailable { retry_after_seconds: u64 },
    /// A record exists for the key but this build cannot read it (damaged, or written by a later
    /// release during a rolling upgrade); nothing was forwarded.
    RecordUnreadable { retry_after_seconds: u64 },
    /// The local tier is full of unexpired records; nothing was forwarded.
    CapacityExhausted { retry_after_seconds: u64 },
    /// Too many request bodies are being buffered at once; nothing was forwarded.
    BufferBudgetExceeded { retry_after_seconds: u64 },
    /// The original response was too large to keep: its status and `location` are replayed.
    ResponseNotStored { status: u16, location: Option<String> },
    /// Detached forwarding: the upstream gave no answer within `upstream.timeout_ms` (or the
    /// connection failed); the request may have executed.
    UpstreamNoAnswer,
    /// A replay's stored body is in a content coding the retry does not accept, and idemgate
    /// cannot decode it (`encoding`): nothing was executed again.
    EncodingNotAccepted { coding: String },
    /// A gRPC call with a key on a route with `grpc: "refuse"`: a replay would reach the client as
    /// a failure (Envoy reshapes local replies to gRPC requests); nothing was forwarded.
    GrpcUnsupported { header: String },
    /// The request's path reads as two routes that store keys apart (`config::Selection`):
    /// refused, never forwarded.
    RouteAmbiguous,
    /// `derive_key.include_body`: the body is JSON that names a member twice in one object
    /// (`canonical_json::NoForm::RepeatedName`), which JSON readers run by different values, or
    /// holds a string that is not Unicode (`NoForm::NotUnicode`), which they read differently,
    /// so no one key can be derived from it; nothing was forwarded.
    BodyAmbiguous,
    /// The gateway met one of its own invariants broken (`failsafe`): the request was refused,
    /// not forwarded.
    InternalState { retry_after_seconds: u64 },
    /// MCP route: a JSON-RPC batch holding a protected `tools/call` (`crate::mcp`); nothing was
    /// forwarded.
    McpBatchRefused,
    /// MCP route: a POST body not read as exactly one JSON document (not JSON, not UTF-8, a member
    /// name repeated, nesting too deep, a number out of range); nothing was forwarded.
    McpBodyAmbiguous,
    /// MCP route: a 2026-07-28 routing header (`header`: `mcp-method`, `mcp-name`) that disagrees
    /// with the body (`crate::mcp::routing_headers_disagree`); nothing was forwarded.
    McpHeaderMismatch { header: &'static str },
}

/// A ready-to-send problem response.
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl ProblemKind {
    /// The stable slug of the problem type.
    pub fn slug(&self) -> &'static str {
        match self {
            ProblemKind::KeyMissing { .. } => "key-missing",
            ProblemKind::KeyInvalid { error, .. } => match error {
                KeyError::Repeated => "key-repeated",
                KeyError::Empty => "key-empty",
                KeyError::TooLong { .. } => "key-too-long",
                KeyError::NotVisibleAscii => "key-not-visible-ascii",
                KeyError::List => "key-is-a-list",
                KeyError::NotAToken => "key-not-a-token",
                KeyError::MalformedString => "key-malformed-string",
            },
            ProblemKind::ScopeMissing { .. } => "scope-missing",
            ProblemKind::BodyTooLarge { .. } => "body-too-large",
            ProblemKind::InFlight { .. } => "request-in-flight",
            ProblemKind::OutcomeUnknown => "outcome-unknown",
            ProblemKind::KeyExpired => "key-expired",
            ProblemKind::KeyReused { .. } => "key-reused",
            ProblemKind::StoreUnavailable { .. } => "store-unavailable",
            ProblemKind::RecordUnreadable { .. } => "record-unreadable",
            ProblemKind::CapacityExhausted { .. } => "capacity-exhausted",
            ProblemKind::BufferBudgetExceeded { .. } => "buffer-budget-exceeded",
            ProblemKind::ResponseNotStored { .. } => "response-not-stored",
            ProblemKind::UpstreamNoAnswer => "upstream-no-answer",
            ProblemKind::EncodingNotAccepted { .. } => "encoding-not-accepted",
            ProblemKind::InternalState { .. } => "internal-state",
            ProblemKind::GrpcUnsupported { .. } => "grpc-unsupported",
            ProblemKind::RouteAmbiguous => "route-ambiguous",
            ProblemKind::BodyAmbiguous => "body-ambiguous",
            ProblemKind::McpBatchRefused => "mcp-batch-refused",
            ProblemKind::McpBodyAmbiguous => "mcp-body-ambiguous",
            ProblemKind::McpHeaderMismatch { .. } => "mcp-header-mismatch",
        }
    }

    pub fn status(&self) -> u16 {
        match self {
            ProblemKind::KeyMissing { .. } | ProblemKind::KeyInvalid { .. } | ProblemKind::ScopeMissing { .. } => 400,
            ProblemKind::BodyTooLarge { .. } => 413,
            ProblemKind::InFlight { .. } | ProblemKind::OutcomeUnknown => 409,
            ProblemKind::KeyReused { status } => *status,
            ProblemKind::StoreUnavailable { .. }
            | ProblemKind::RecordUnreadable { .. }
            | ProblemKind::CapacityExhausted { .. }
            | ProblemKind::BufferBudgetExceeded { .. }
            | ProblemKind::InternalState { .. } => 503,
            ProblemKind::ResponseNotStored { status, .. } => *status,
            ProblemKind::UpstreamNoAnswer => 504,
            ProblemKind::KeyExpired => 410,
            ProblemKind::EncodingNotAccepted { .. } => 406,
            ProblemKind::GrpcUnsupported { .. } => 415,
            ProblemKind::RouteAmbiguous
            | ProblemKind::BodyAmbiguous
            | ProblemKind::McpBatchRefused
            | ProblemKind::McpBodyAmbiguous
            | ProblemKind::McpHeaderMismatch { .. } => 400,
        }
    }

    pub(crate) fn title(&self) -> &'static str {
        match self {
            ProblemKind::KeyMissing { .. } => "Idempotency key required",
            ProblemKind::KeyInvalid { .. } => "Malformed idempotency key",
            ProblemKind::ScopeMissing { .. } => "Caller not identified for an idempotency key",
            ProblemKind::BodyTooLarge { .. } => "Request body too large for idempotency protection",
            ProblemKind::InFlight { .. } => "A request with this idempotency key is in progress",
            ProblemKind::OutcomeUnknown => "Outcome of the original request is unknown",
            ProblemKind::KeyExpired => "Idempotency key expired",
            ProblemKind::KeyReused { .. } => "Idempotency key reused with a different request",
            ProblemKind::StoreUnavailable { .. } => "Idempotency store unavailable",
            ProblemKind::RecordUnreadable { .. } => "Idempotency record unreadable",
            ProblemKind::CapacityExhausted { .. } => "Idempotency capacity exhausted",
            ProblemKind::BufferBudgetExceeded { .. } => "Too many requests being buffered",
            ProblemKind::ResponseNotStored { .. } => "Original response was too large to replay",
            ProblemKind::UpstreamNoAnswer => "The upstream did not answer",
            ProblemKind::EncodingNotAccepted { .. } => {
                "Original response is in an encoding this request does not accept"
            }
            ProblemKind::InternalState { .. } => "Request not protected",
            ProblemKind::GrpcUnsupported { .. } => "Idempotency keys are not supported for gRPC on this route",
            ProblemKind::RouteAmbiguous => "Request path is ambiguous between protected routes",
            ProblemKind::BodyAmbiguous => "Request body has no one JSON reading",
            ProblemKind::McpBatchRefused => "Protected tool calls cannot be sent in a JSON-RPC batch",
            ProblemKind::McpBodyAmbiguous => "Request body is not unambiguous JSON",
            ProblemKind::McpHeaderMismatch { .. } => "MCP routing header disagrees with the body",
        }
    }

    pub(crate) fn detail(&self) -> String {
        match self {
            ProblemKind::KeyMissing { header } => {
                format!("This endpoint requires an `{header}` header: send a unique key per operation and reuse it on every retry.")
            }
            ProblemKind::KeyInvalid { header, error, syntax, max_len } => format!(
                "The `{header}` header is invalid: {error}; {}. Fix the key; this request was not executed.",
                syntax.rule(*max_len)
            ),
            ProblemKind::ScopeMissing { headers } => {
                let names: Vec<String> = headers.iter().map(|h| format!("`{h}`")).collect();
                format!(
                    "This request carries an idempotency key but none of the headers that identify its caller ({}), so its result could be shared with other callers. It was not forwarded: send it with one of those headers.",
                    names.join(", ")
                )
            }
            ProblemKind::BodyTooLarge { limit } => format!(
                "The body exceeds the {limit}-byte limit for idempotent requests. It was not forwarded; send a smaller body."
            ),
            ProblemKind::InFlight { retry_after_seconds } => format!(
                "The first request with this key has not finished. Retry after {retry_after_seconds} s with the same key to get its result."
            ),
            ProblemKind::OutcomeUnknown => "The first request with this key was forwarded, but its result was lost (timeout, reset or disconnect), so it may or may not have taken effect. Do not retry with this key: check the resource, then use a new key if the operation must be done.".into(),
            ProblemKind::KeyExpired => "This key was used for this same request before, and its record has expired: the outcome of that request is no longer known here, so this request was not forwarded. Check the resource; a new operation needs a new key.".into(),
            ProblemKind::KeyReused { .. } => "This key was already used with a different request (method, path, selected headers or body). Use a new key for a new operation.".into(),
            ProblemKind::StoreUnavailable { retry_after_seconds } => format!(
                "The idempotency store cannot be reached, so the request was not forwarded. Retry after {retry_after_seconds} s with the same key."
            ),
            ProblemKind::RecordUnreadable { retry_after_seconds } => format!(
                "A record exists for this key, but this gateway cannot read it (written by a newer release during an upgrade, or damaged), so the request was not forwarded. Retry after {retry_after_seconds} s with the same key; do not use a new key for the same operation."
            ),
            ProblemKind::CapacityExhausted { retry_after_seconds } => format!(
                "The gateway holds as many unexpired idempotency records as it may; the request was not forwarded. Retry after {retry_after_seconds} s with the same key."
            ),
            ProblemKind::BufferBudgetExceeded { retry_after_seconds } => format!(
                "Too many request bodies are being buffered at once; the request was not forwarded. Retry after {retry_after_seconds} s with the same key."
            ),
            ProblemKind::UpstreamNoAnswer => "The upstream did not answer in time (or could not be reached), so the request may or may not have taken effect. Do not retry with this key: check the resource, then use a new key if the operation must be done.".into(),
            ProblemKind::EncodingNotAccepted { coding } => format!(
                "The original request completed, and its response was stored `{coding}`-encoded, a content coding this request's Accept-Encoding does not accept and the gateway cannot decode. It was not executed again: retry with the same key and `Accept-Encoding: {coding}` to get the original response."
            ),
            ProblemKind::InternalState { retry_after_seconds } => format!(
                "The gateway could not protect this request and did not forward it. Retry after {retry_after_seconds} s with the same key."
            ),
            ProblemKind::RouteAmbiguous => "This path reads as two routes whose idempotency keys are kept apart (dot segments, `;` parameters or escaped slashes that backends resolve differently), so one key could run once under each. It was not forwarded: send the path in its plain form.".into(),
            ProblemKind::BodyAmbiguous => "This request's idempotency key is derived from its body, and the body is JSON that names a member twice in one object (`{\"a\":1,\"a\":2}`, or a name and its escaped spelling), which JSON readers run by different values (most by the last, some by the first), or a string that is not Unicode (a lone surrogate escape such as `\\ud800`, bytes that are not UTF-8), which some read as U+FFFD and others keep or refuse, so no one key stands for it. It was not forwarded: send each member once, in UTF-8.".into(),
            ProblemKind::GrpcUnsupported { header } => format!(
                "This gRPC call carries `{header}`, but the gateway cannot replay a gRPC response (a replay would reach the client as a failure), so it was not forwarded. Send it without the key (it then runs unprotected), or use the service's own idempotency."
            ),
            ProblemKind::McpBatchRefused => "This JSON-RPC batch holds a protected tools/call, which the gateway can only run at most once when sent alone. Nothing in the batch was forwarded: send each tools/call as its own request.".into(),
            ProblemKind::McpBodyAmbiguous => "This body is not one JSON document the gateway reads unambiguously (not JSON or not UTF-8, a member name repeated in an object, nesting deeper than 128, a number out of range, a tool call under a gRPC content type), so a server could find a tool call in it that the gateway cannot protect. It was not forwarded: send plain UTF-8 JSON as application/json.".into(),
            ProblemKind::McpHeaderMismatch { header } => format!(
                "The `{header}` header does not name what the JSON-RPC body holds (a different method or tool, the header sent twice, or a batch), so a router or server reading the header could run another call than the one the gateway protects. It was not forwarded: send the header as the body says (2026-07-28 transport), or leave it out."
            ),
            ProblemKind::ResponseNotStored { status, .. } => format!(
                "The original request completed with status {status}, but its response body was too large to keep. The operation is done: do not repeat it; fetch the resource instead."
            ),
        }
    }

    pub(crate) fn retry_after(&self) -> Option<u64> {
        match self {
            ProblemKind::InFlight { retry_after_seconds }
            | ProblemKind::StoreUnavailable { retry_after_seconds }
            | ProblemKind::RecordUnreadable { retry_after_seconds }
            | ProblemKind::CapacityExhausted { retry_after_seconds }
            | ProblemKind::BufferBudgetExceeded { retry_after_seconds }
            | ProblemKind::InternalState { retry_after_seconds } => Some(*retry_after_seconds),
            _ => None,
        }
    }

    /// Whether retrying the same request can help, sent as `x-should-retry` (read by the
    /// Stainless-generated SDKs: OpenAI, Anthropic, Modern Treasury, Orb) and as
    /// `stripe-should-retry` (read by Stripe's SDKs, which otherwise retry every 409 and 5xx).
    pub fn should_retry(&self) -> bool {
        self.retry_after().is_some()
    }

    /// The gRPC status a gRPC client gets for this problem (Envoy sends a local reply to a gRPC
    /// request as a trailers-only status; without one, it would map the HTTP status, 400 to
    /// INTERNAL and 409 or 422 to UNKNOWN). Retryable ones (ABORTED, UNAVAILABLE) only where
    /// retrying with the same key helps.
    pub fn grpc_status(&self) -> i32 {
        const UNKNOWN: i32 = 2;
        const INVALID_ARGUMENT: i32 = 3;
        const ALREADY_EXISTS: i32 = 6;
        const RESOURCE_EXHAUSTED: i32 = 8;
        const FAILED_PRECONDITION: i32 = 9;
        const ABORTED: i32 = 10;
        const UNAVAILABLE: i32 = 14;
        match self {
            ProblemKind::KeyMissing { .. } | ProblemKind::KeyInvalid { .. } | ProblemKind::ScopeMissing { .. } => {
                INVALID_ARGUMENT
            }
            ProblemKind::BodyTooLarge { .. } => RESOURCE_EXHAUSTED,
            ProblemKind::InFlight { .. } => ABORTED,
            ProblemKind::KeyReused { .. } => ALREADY_EXISTS,
            ProblemKind::OutcomeUnknown | ProblemKind::UpstreamNoAnswer => UNKNOWN,
            ProblemKind::StoreUnavailable { .. }
            | ProblemKind::RecordUnreadable { .. }
            | ProblemKind::CapacityExhausted { .. }
            | ProblemKind::BufferBudgetExceeded { .. }
            | ProblemKind::InternalState { .. } => UNAVAILABLE,
            ProblemKind::RouteAmbiguous
            | ProblemKind::BodyAmbiguous
            | ProblemKind::McpBatchRefused
            | ProblemKind::McpBodyAmbiguous
            | ProblemKind::McpHeaderMismatch { .. } => INVALID_ARGUMENT,
            ProblemKind::ResponseNotStored { .. }
            | ProblemKind::GrpcUnsupported { .. }
            | ProblemKind::KeyExpired
            | ProblemKind::EncodingNotAccepted { .. } => FAILED_PRECONDITION,
        }
    }

    /// The text a gRPC client reads as `grpc-message` (Envoy puts a local reply's body there):
    /// the title, the problem type, the detail.
    pub fn grpc_message(&self) -> String {
        format!("{} ({TYPE_PREFIX}{}): {}", self.title(), self.slug(), self.detail())
    }

    /// The `type` of the `error` member, from the one vocabulary an SDK refuses to stray from:
    /// gocardless-pro raises `Invalid error type` (not one of its `ApiError` classes) for any type
    /// but `validation_failed`, `invalid_api_usage`, `invalid_state` and `gocardless`; Stripe's SDKs
    /// pick their error class from the status and accept any type. `None` for a 2xx answer
    /// (`response-not-stored`), which is not an error: the operation is done.
    fn sdk_error_type(&self) -> Option<&'static str> {
        match self {
            ProblemKind::KeyMissing { .. }
            | ProblemKind::KeyInvalid { .. }
            | ProblemKind::ScopeMissing { .. }
            | ProblemKind::BodyTooLarge { .. }
            | ProblemKind::GrpcUnsupported { .. }
            | ProblemKind::RouteAmbiguous
            | ProblemKind::BodyAmbiguous
            | ProblemKind::McpBatchRefused
            | ProblemKind::McpBodyAmbiguous
            | ProblemKind::McpHeaderMismatch { .. }
            | ProblemKind::EncodingNotAccepted { .. } => Some("invalid_api_usage"),
            ProblemKind::InFlight { .. }
            | ProblemKind::OutcomeUnknown
            | ProblemKind::KeyExpired
            | ProblemKind::KeyReused { .. } => Some("invalid_state"),
            ProblemKind::StoreUnavailable { .. }
            | ProblemKind::RecordUnreadable { .. }
            | ProblemKind::CapacityExhausted { .. }
            | ProblemKind::BufferBudgetExceeded { .. }
            | ProblemKind::UpstreamNoAnswer
            | ProblemKind::InternalState { .. } => Some("gocardless"),
            ProblemKind::ResponseNotStored { .. } => None,
        }
    }

    /// The `error` extension member, for SDKs that look for an error there instead of reading the
    /// problem document (docs/problems.md, "Errors as SDKs read them"): stripe-node treats a body as an
    /// error only when it has an `error` member, stripe-python raises `Invalid response object`
    /// without one, gocardless-pro reads `error.type` and, for `invalid_state`, each
    /// `error.errors[].reason`. `code` is the problem's slug, `message` its detail.
    fn sdk_error(&self, detail: &str, request_id: &str) -> Option<Value> {
        let kind = self.sdk_error_type()?;
        let mut e = Map::new();
        e.insert("type".into(), Value::String(kind.into()));
        e.insert("code".into(), Value::String(self.slug().into()));
        e.insert("message".into(), Value::String(detail.into()));
        e.insert("errors".into(), json!([{ "reason": self.slug(), "message": detail }]));
        if !request_id.is_empty() {
            e.insert("request_id".into(), Value::String(request_id.into()));
        }
        Some(Value::Object(e))
    }

    /// Builds the response: status, headers and the `application/problem+json` body.
    /// `request_id` is this request's id; `creator` names the run that made an existing record.
    pub fn to_problem(&self, request_id: &str, creator: Option<&Creator>) -> Problem {
        let mut body = Map::new();
        body.insert("type".into(), Value::String(format!("{TYPE_PREFIX}{}", self.slug())));
        body.insert("title".into(), Value::String(self.title().into()));
        body.insert("status".into(), json!(self.status()));
        let detail = self.detail();
        if let Some(e) = self.sdk_error(&detail, request_id) {
            body.insert("error".into(), e);
        }
        body.insert("detail".into(), Value::String(detail));
        if !request_id.is_empty() {
            body.insert("request_id".into(), Value::String(request_id.into()));
        }
        if let Some(s) = self.retry_after() {
            body.insert("retry_after_seconds".into(), json!(s));
        }
        if let ProblemKind::ResponseNotStored { status, location } = self {
            body.insert("original_status".into(), json!(status));
            if let Some(l) = location {
                body.insert("location".into(), Value::String(l.clone()));
            }
        }
        // The first request's id only: its logged values (`log_headers`) are for operators and
        // never echoed, since the caller reading this may be another caller of the same scope.
        if let Some(c) = creator.filter(|c| !c.request_id.is_empty()) {
            let mut by = Map::new();
            by.insert("request_id".into(), Value::String(c.request_id.clone()));
            body.insert("original_request".into(), Value::Object(by));
        }
        let mut headers = vec![("content-type".to_string(), "application/problem+json".to_string())];
        if let Some(s) = self.retry_after() {
            headers.push(("retry-after".into(), s.to_string()));
        }
        headers.push(("x-should-retry".into(), self.should_retry().to_string()));
        headers.push(("stripe-should-retry".into(), self.should_retry().to_string()));
        if let ProblemKind::ResponseNotStored { location: Some(l), .. } = self {
            headers.push(("location".into(), l.clone()));
            headers.push(("idempotent-replayed".into(), "true".into()));
        }
        let body = serde_json::to_vec(&Value::Object(body)).unwrap_or_default();
        Problem { status: self.status(), headers, body }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn response_code_details_are_the_slug_in_lowercase_with_underscores() {
        assert_eq!(code_details("key-reused"), "idemgate_key_reused");
        assert_eq!(code_details("replayed"), "idemgate_replayed");
        for p in all() {
            let d = code_details(p.slug());
            assert!(d.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'), "{d}");
        }
        assert_eq!(code_details("A b/c"), "idemgate_a_b_c");
    }

    fn all() -> Vec<ProblemKind> {
        let h = "idempotency-key".to_string();
        let mut v = vec![
            ProblemKind::KeyMissing { header: h.clone() },
            ProblemKind::ScopeMissing { headers: vec!["authorization".into()] },
            ProblemKind::BodyTooLarge { limit: 10 },
            ProblemKind::InFlight { retry_after_seconds: 2 },
            ProblemKind::OutcomeUnknown,
            ProblemKind::KeyExpired,
            ProblemKind::KeyReused { status: 422 },
            ProblemKind::StoreUnavailable { retry_after_seconds: 1 },
            ProblemKind::RecordUnreadable { retry_after_seconds: 1 },
            ProblemKind::CapacityExhausted { retry_after_seconds: 1 },
            ProblemKind::BufferBudgetExceeded { retry_after_seconds: 1 },
            ProblemKind::ResponseNotStored { status: 201, location: Some("/c/1".into()) },
            ProblemKind::UpstreamNoAnswer,
            ProblemKind::EncodingNotAccepted { coding: "br".into() },
            ProblemKind::InternalState { retry_after_seconds: 1 },
            ProblemKind::GrpcUnsupported { header: h.clone() },
            ProblemKind::RouteAmbiguous,
            ProblemKind::BodyAmbiguous,
            ProblemKind::McpBatchRefused,
            ProblemKind::McpBodyAmbiguous,
            ProblemKind::McpHeaderMismatch { header: "mcp-name" },
        ];
        for error in [
            KeyError::Repeated,
            KeyError::Empty,
            KeyError::TooLong { len: 300, max: 255 },
            KeyError::NotVisibleAscii,
            KeyError::List,
            KeyError::NotAToken,
            KeyError::MalformedString,
        ] {
            v.push(ProblemKind::KeyInvalid { header: h.clone(), error, syntax: KeySyntax::Strict, max_len: 255 });
        }
        v
    }

    fn body(p: &Problem) -> Value {
        serde_json::from_slice(&p.body).unwrap()
    }

    #[test]
    fn every_problem_has_its_own_stable_type() {
        let kinds = all();
        let slugs: std::collections::HashSet<&str> = kinds.iter().map(|k| k.slug()).collect();
        assert_eq!(slugs.len(), kinds.len());
        for k in &kinds {
            let p = k.to_problem("r1", None);
            let b = body(&p);
            assert_eq!(b["type"], format!("urn:idemgate:problem:{}", k.slug()));
            assert_eq!(b["status"], p.status);
            assert!(b["title"].as_str().is_some_and(|t| !t.is_empty()));
            assert!(b["detail"].as_str().is_some_and(|t| t.len() > 20));
            assert_eq!(b["request_id"], "r1");
            assert_eq!(p.headers[0], ("content-type".into(), "application/problem+json".into()));
        }
    }

    #[test]
    fn every_error_carries_the_error_member_sdks_read() {
        for k in all() {
            let p = k.to_problem("r1", None);
            let b = body(&p);
            if p.status < 400 {
                assert!(b.get("error").is_none(), "{} is no error: the operation is done", k.slug());
                continue;
            }
            let e = &b["error"];
            // gocardless-pro raises `Invalid error type` for any other type.
            let t = e["type"].as_str().unwrap();
            assert!(["validation_failed", "invalid_api_usage", "invalid_state", "gocardless"].contains(&t), "{t}");
            assert_eq!(e["code"], k.slug());
            assert_eq!(e["message"], b["detail"]);
            assert_eq!(e["request_id"], "r1");
            // gocardless-pro reads each entry's `reason` (invalid_state) and `message` (every type);
            // `idempotent_creation_conflict` would make it fetch a resource it is not given.
            let errors = e["errors"].as_array().unwrap();
            assert_eq!(errors.len(), 1);
            assert_eq!(errors[0]["reason"], k.slug());
            assert_eq!(errors[0]["message"], b["detail"]);
        }
        let retry_body = body(&ProblemKind::InFlight { retry_after_seconds: 1 }.to_problem("", None));
        assert_eq!(retry_body["error"]["type"], "invalid_state");
        assert!(retry_body["error"].get("request_id").is_none());
        assert_eq!(
            body(&ProblemKind::KeyMissing { header: "k".into() }.to_problem("", None))["error"]["type"],
            "invalid_api_usage"
        );
        assert_eq!(
            body(&ProblemKind::StoreUnavailable { retry_after_seconds: 1 }.to_problem("", None))["error"]["type"],
            "gocardless"
        );
    }

    #[test]
    fn stripe_should_retry_says_what_x_should_retry_says() {
        for k in all() {
            let p = k.to_problem("", None);
            let get = |name: &str| p.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
            assert_eq!(get("stripe-should-retry"), get("x-should-retry"), "{}", k.slug());
            assert_eq!(get("x-should-retry"), Some(k.should_retry().to_string()));
        }
    }

    #[test]
    fn statuses_follow_the_ietf_draft() {
        assert_eq!(ProblemKind::KeyMissing { header: "k".into() }.status(), 400);
        assert_eq!(
            ProblemKind::KeyInvalid { header: "k".into(), error: KeyError::Empty, syntax: KeySyntax::Any, max_len: 9 }
                .status(),
            400
        );
        assert_eq!(ProblemKind::BodyTooLarge { limit: 1 }.status(), 413);
        assert_eq!(ProblemKind::InFlight { retry_after_seconds: 1 }.status(), 409);
        assert_eq!(ProblemKind::OutcomeUnknown.status(), 409);
        assert_eq!(ProblemKind::KeyExpired.status(), 410);
        assert_eq!(ProblemKind::KeyExpired.slug(), "key-expired");
        assert_eq!(ProblemKind::KeyReused { status: 422 }.status(), 422);
        assert_eq!(ProblemKind::KeyReused { status: 409 }.status(), 409);
        assert_eq!(ProblemKind::StoreUnavailable { retry_after_seconds: 1 }.status(), 503);
    }

    #[test]
    fn scope_missing_names_the_headers_to_send_and_says_not_to_retry_as_is() {
        let p =
            ProblemKind::ScopeMissing { headers: vec!["authorization".into(), "x-user".into()] }.to_problem("", None);
        assert_eq!(p.status, 400);
        assert!(p.headers.contains(&("x-should-retry".into(), "false".into())));
        assert!(!p.headers.iter().any(|(n, _)| n == "retry-after"));
        let b = body(&p);
        assert_eq!(b["type"], "urn:idemgate:problem:scope-missing");
        let detail = b["detail"].as_str().unwrap();
        assert!(detail.contains("`authorization`, `x-user`") && detail.contains("not forwarded"), "{detail}");
    }

    #[test]
    fn in_flight_has_retry_after_but_outcome_unknown_tells_not_to_retry() {
        let p = ProblemKind::InFlight { retry_after_seconds: 3 }.to_problem("", None);
        assert!(p.headers.contains(&("retry-after".into(), "3".into())));
        assert!(p.headers.contains(&("x-should-retry".into(), "true".into())));
        let p = ProblemKind::OutcomeUnknown.to_problem("", None);
        assert!(!p.headers.iter().any(|(n, _)| n == "retry-after"));
        assert!(p.headers.contains(&("x-should-retry".into(), "false".into())));
        assert!(body(&p).get("request_id").is_none());
    }

    #[test]
    fn conflict_names_the_request_that_created_the_record_and_echoes_none_of_its_logged_values() {
        let creator =
            Creator { request_id: "first".into(), log_values: vec![("x-agent-run-id".into(), "run-7".into())] };
        let b = body(&ProblemKind::KeyReused { status: 422 }.to_problem("second", Some(&creator)));
        assert_eq!(b["original_request"]["request_id"], "first");
        // Logged values are the operator's: never echoed to whoever reads the problem.
        assert_eq!(b["original_request"].as_object().map(|o| o.len()), Some(1));
        assert!(!String::from_utf8_lossy(&p_body(&creator)).contains("run-7"));
    }

    fn p_body(creator: &Creator) -> Vec<u8> {
        ProblemKind::OutcomeUnknown.to_problem("second", Some(creator)).body
    }

    #[test]
    fn response_not_stored_carries_original_status_and_location_never_an_empty_success() {
        let p =
            ProblemKind::ResponseNotStored { status: 201, location: Some("/charges/9".into()) }.to_problem("", None);
        assert_eq!(p.status, 201);
        assert!(!p.body.is_empty());
        assert!(p.headers.contains(&("location".into(), "/charges/9".into())));
        let b = body(&p);
        assert_eq!(b["original_status"], 201);
        assert_eq!(b["location"], "/charges/9");
    }

    #[test]
    fn a_grpc_client_reads_a_status_that_says_whether_to_retry_and_a_message_naming_the_problem() {
        for k in all() {
            let g = k.grpc_status();
            // Retryable gRPC statuses exactly where a retry with the same key helps.
            assert_eq!(g == 10 || g == 14, k.should_retry(), "{}", k.slug());
            assert!(g != 0 && g != 13, "{}: never OK nor INTERNAL", k.slug());
            let m = k.grpc_message();
            assert!(m.contains(&format!("urn:idemgate:problem:{}", k.slug())) && m.len() > 40, "{m}");
        }
        let refused = ProblemKind::GrpcUnsupported { header: "idempotency-key".into() };
        assert_eq!((refused.grpc_status(), refused.status()), (9, 415));
        assert!(!refused.should_retry());
        assert_eq!(ProblemKind::KeyMissing { header: "k".into() }.grpc_status(), 3);
    }
}
