//! Decisions: what to do with a request, and what a finished exchange means.
//!
//! Three pure functions, each a table (see docs/internals.md, "Decisions"):
//! - `admit`: from the policy in force and the key header, whether a request passes untouched, is
//!   refused at once (400), or is protected;
//! - `decide`: from what the store holds for the key, the action (claim, take over, replay, 409,
//!   422, 503, or pass unprotected when the store is down and `on_unavailable` is `pass`);
//! - `classify`: from how Envoy finished the exchange, whether the response is stored, the key
//!   released, or the outcome unknown.

use crate::config::{Forwarding, Hop, NextHopFailures, OnUnavailable, Policy, StaleLock};
use crate::fingerprint::Fingerprint;
use crate::key::{parse_key_header, IdempotencyKey};
use crate::problem::ProblemKind;
use crate::record::{Record, State, UnknownReason};

/// The answer to "is this request protected?".
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Not protected (method or path not configured, or no key and `require_key` is off).
    Pass,
    /// Refused before anything else (400).
    Reject(ProblemKind),
    /// Protected with this key.
    Protect(IdempotencyKey),
}

/// Admission of a request under `policy` (None: no policy covers its method and path), with every
/// value of the key header.
pub fn admit(policy: Option<&Policy>, key_values: &[&[u8]]) -> Admission {
    let Some(p) = policy else {
        return Admission::Pass;
    };
    match parse_key_header(key_values, p.key_max_length, p.key_syntax) {
        Ok(Some(key)) => Admission::Protect(key),
        Ok(None) if p.require_key => Admission::Reject(ProblemKind::KeyMissing { header: p.header.clone() }),
        Ok(None) => Admission::Pass,
        Err(error) => Admission::Reject(ProblemKind::KeyInvalid {
            header: p.header.clone(),
            error,
            syntax: p.key_syntax,
            max_len: p.key_max_length,
        }),
    }
}

/// A body over the limit is refused with 413 before it is forwarded.
pub fn check_body_size(size: u64, policy: &Policy) -> Result<(), ProblemKind> {
    if size > policy.max_request_body_bytes {
        Err(ProblemKind::BodyTooLarge { limit: policy.max_request_body_bytes })
    } else {
        Ok(())
    }
}

/// The part of a record a decision needs (the local tier keeps exactly this in its index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Summary {
    /// `None` while a claim made at request headers waits for the body.
    pub fingerprint: Option<Fingerprint>,
    pub expires_at_ms: u64,
    pub phase: Phase,
}

/// Where a key stands, without the stored response: a live `record::Stage` (same names), the
/// in-flight stages carrying their lock, so a lock without a claim cannot be written
/// (`Summary::stage` maps it back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Claimed { lock_expires_at_ms: u64 },
    Forwarded { lock_expires_at_ms: u64 },
    Completed,
    Unknown,
}

impl Summary {
    /// Whether this is a claim (made at headers or forwarded) whose lock has not expired at `now_ms`.
    pub fn lock_is_live(&self, now_ms: u64) -> bool {
        match self.phase {
            Phase::Claimed { lock_expires_at_ms } | Phase::Forwarded { lock_expires_at_ms } => {
                now_ms < lock_expires_at_ms
            }
            Phase::Completed | Phase::Unknown => false,
        }
    }

    /// The one rule for "does this record still hold its key": a record is free (the key may be
    /// claimed again) once it is past its expiry **and** holds no live lock. A claim whose lock is
    /// live is never free, whatever its expiry. `decide`, the local tier (lookups, free positions,
    /// sweeps) and the store tier (the decision on a store answer, and the
    /// take-over it sends, whose script re-checks the lock by Redis's clock) all use it.
    pub fn is_free(&self, now_ms: u64) -> bool {
        now_ms >= self.expires_at_ms && !self.lock_is_live(now_ms)
    }
}

impl Record {
    pub fn summary(&self) -> Summary {
        let phase = match &self.state {
            State::Claimed { lock_expires_at_ms, .. } => Phase::Claimed { lock_expires_at_ms: *lock_expires_at_ms },
            State::Forwarded { lock_expires_at_ms, .. } => Phase::Forwarded { lock_expires_at_ms: *lock_expires_at_ms },
            State::Completed(_) | State::CompletedTooLarge { .. } | State::AwaitingInput(_) => Phase::Completed,
            State::OutcomeUnknown { .. } => Phase::Unknown,
        };
        Summary { fingerprint: Some(self.fingerprint), expires_at_ms: self.expires_at_ms, phase }
    }
}

/// What the store said about a key.
#[derive(Clone, Copy, Debug)]
pub enum Lookup {
    Absent,
    Found(Summary),
    /// A record exists but cannot be decoded (damaged, or written by a later release): it is
    /// there, so the store is not "unavailable" and the request is never forwarded.
    Unreadable,
    /// Unreachable, too slow, or an answer that could not be understood.
    StoreError,
}

/// What to do with a protected request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The key is free (absent, or expired with no live lock): claim it, then forward.
    Claim,
    /// A stale claim that provably was never forwarded (or, with `stale_lock: "takeover"`, any
    /// stale lock): replace it atomically with a claim of our own, then forward.
    TakeOver,
    /// Same key, same request, completed: replay the stored response (or, when it was too large,
    /// a problem carrying its status and `location`).
    Replay,
    /// A forwarded request whose lock expired without a completion: mark the record
    /// outcome-unknown, then answer `OutcomeUnknown`.
    MarkUnknown,
    /// Answer with this problem, naming the record's creator where there is a record.
    Reject(ProblemKind),
    /// The store is unavailable and `on_unavailable` is `pass`: forward unprotected.
    PassUnprotected,
    /// Replay, 422 and outcome-unknown depend on the fingerprint, which needs the whole body:
    /// buffer it, then decide again.
    NeedFingerprint,
}

/// Seconds a client is asked to wait before retrying a request that is still in flight.
pub const IN_FLIGHT_RETRY_AFTER_SECONDS: u64 = 1;
/// Seconds a client is asked to wait after a store outage or capacity refusal.
pub const UNAVAILABLE_RETRY_AFTER_SECONDS: u64 = 1;

/// The decision table for a protected request at time `now_ms`. `fp` is `None` when the decision
/// is taken at request headers, before the body (and so the fingerprint) is known.
pub fn decide(
    lookup: Lookup,
    fp: Option<&Fingerprint>,
    now_ms: u64,
    policy: &Policy,
    on_unavailable: OnUnavailable,
) -> Decision {
    let record = match lookup {
        Lookup::StoreError => {
            return match on_unavailable {
                OnUnavailable::Reject => Decision::Reject(ProblemKind::StoreUnavailable {
                    retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS,
                }),
                OnUnavailable::Pass => Decision::PassUnprotected,
            }
        }
        Lookup::Unreadable => {
            return Decision::Reject(ProblemKind::RecordUnreadable {
                retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS,
            })
        }
        Lookup::Absent => return Decision::Claim,
        Lookup::Found(r) if r.is_free(now_ms) => return Decision::Claim,
        Lookup::Found(r) => r,
    };
    let in_flight = Decision::Reject(ProblemKind::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS });
    // A live lock is answered at once (409), whatever the body: a concurrent duplicate need not
    // be buffered. Everything else needs the fingerprint.
    match record.phase {
        Phase::Claimed { lock_expires_at_ms } | Phase::Forwarded { lock_expires_at_ms }
            if now_ms < lock_expires_at_ms =>
        {
            return match (fp, record.fingerprint) {
                (Some(a), Some(b)) if *a != b => {
                    Decision::Reject(ProblemKind::KeyReused { status: policy.mismatch_status })
                }
                _ => in_flight,
            };
        }
        // A stale claim that never forwarded anything: its request provably did not execute, so
        // exactly one retry (the CAS decides which) may take it over.
        Phase::Claimed { .. } => {
            return match (fp, record.fingerprint) {
                (Some(a), Some(b)) if *a != b => {
                    Decision::Reject(ProblemKind::KeyReused { status: policy.mismatch_status })
                }
                _ => Decision::TakeOver,
            };
        }
        _ => {}
    }
    let Some(fp) = fp else {
        return Decision::NeedFingerprint;
    };
    if record.fingerprint.is_some_and(|r| r != *fp) {
        return Decision::Reject(ProblemKind::KeyReused { status: policy.mismatch_status });
    }
    match record.phase {
        Phase::Completed => Decision::Replay,
        Phase::Unknown => Decision::Reject(ProblemKind::OutcomeUnknown),
        Phase::Forwarded { .. } => match policy.stale_lock {
            StaleLock::Reject => Decision::MarkUnknown,
            StaleLock::Takeover => Decision::TakeOver,
        },
        Phase::Claimed { .. } => Decision::TakeOver,
    }
}

/// How Envoy finished a forwarded exchange, as read in the response and log callbacks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExchangeFacts {
    /// Whether the filter let the request go on to the upstream (false: it never left the filter).
    pub forwarded: bool,
    /// `:status` of the response, if one was started.
    pub status: Option<u16>,
    /// `response.code_details`, e.g. `via_upstream`.
    pub code_details: String,
    /// `response.flags`, Envoy's response flag bit set.
    pub flags: u64,
    /// Whether the filter saw the whole upstream response (its end of stream).
    pub response_complete: bool,
    /// `upstream.address` is set: the router picked an upstream host for some attempt. Envoy
    /// records the host before it sends a byte to it.
    pub upstream_host: bool,
    /// `upstream.local_address` is set: a connection to the upstream was established.
    pub upstream_connected: bool,
    /// `upstream.request_attempt_count` (0: the router never started an upstream request; None:
    /// unreadable, which is no evidence of anything).
    pub attempts: Option<u64>,
}

/// What `classify` asks of a finished exchange, one fact at a time: the filter answers each with a
/// host call (a property read) only when `classify` asks for it, so an exchange the upstream
/// answered in full costs two reads (the attempt count and the code details), not five.
/// `ExchangeFacts` answers from plain values.
pub trait Exchange {
    fn forwarded(&mut self) -> bool;
    fn status(&mut self) -> Option<u16>;
    fn code_details(&mut self) -> String;
    fn flags(&mut self) -> u64;
    fn response_complete(&mut self) -> bool;
    fn upstream_host(&mut self) -> bool;
    fn upstream_connected(&mut self) -> bool;
    fn attempts(&mut self) -> Option<u64>;
}

impl Exchange for ExchangeFacts {
    fn forwarded(&mut self) -> bool {
        self.forwarded
    }
    fn status(&mut self) -> Option<u16> {
        self.status
    }
    fn code_details(&mut self) -> String {
        self.code_details.clone()
    }
    fn flags(&mut self) -> u64 {
        self.flags
    }
    fn response_complete(&mut self) -> bool {
        self.response_complete
    }
    fn upstream_host(&mut self) -> bool {
        self.upstream_host
    }
    fn upstream_connected(&mut self) -> bool {
        self.upstream_connected
    }
    fn attempts(&mut self) -> Option<u64> {
        self.attempts
    }
}

/// Envoy response flag bits (envoy/stream_info/stream_info.h), as `response.flags` reports them.
pub mod flags {
    pub const FAILED_LOCAL_HEALTH_CHECK: u64 = 0x1;
    pub const NO_HEALTHY_UPSTREAM: u64 = 0x2;
    pub const UPSTREAM_REQUEST_TIMEOUT: u64 = 0x4;
    pub const LOCAL_RESET: u64 = 0x8;
    pub const UPSTREAM_REMOTE_RESET: u64 = 0x10;
    pub const UPSTREAM_CONNECTION_FAILURE: u64 = 0x20;
    pub const UPSTREAM_CONNECTION_TERMINATION: u64 = 0x40;
    pub const UPSTREAM_OVERFLOW: u64 = 0x80;
    pub const NO_ROUTE_FOUND: u64 = 0x100;
    pub const DELAY_INJECTED: u64 = 0x200;
    pub const FAULT_INJECTED: u64 = 0x400;
    pub const RATE_LIMITED: u64 = 0x800;
    pub const UNAUTHORIZED_EXTERNAL_SERVICE: u64 = 0x1000;
    pub const RATE_LIMIT_SERVICE_ERROR: u64 = 0x2000;
    pub const DOWNSTREAM_CONNECTION_TERMINATION: u64 = 0x4000;
    pub const UPSTREAM_RETRY_LIMIT_EXCEEDED: u64 = 0x8000;
    pub const STREAM_IDLE_TIMEOUT: u64 = 0x10000;
    pub const INVALID_ENVOY_REQUEST_HEADERS: u64 = 0x20000;
    pub const DOWNSTREAM_PROTOCOL_ERROR: u64 = 0x40000;
    pub const UPSTREAM_MAX_STREAM_DURATION_REACHED: u64 = 0x80000;
    pub const RESPONSE_FROM_CACHE_FILTER: u64 = 0x100000;
    pub const NO_FILTER_CONFIG_FOUND: u64 = 0x200000;
    pub const DURATION_TIMEOUT: u64 = 0x400000;
    pub const UPSTREAM_PROTOCOL_ERROR: u64 = 0x800000;
    pub const NO_CLUSTER_FOUND: u64 = 0x1000000;
    pub const OVERLOAD_MANAGER: u64 = 0x2000000;
    pub const DNS_RESOLUTION_FAILURE: u64 = 0x4000000;
    pub const DOWNSTREAM_REMOTE_RESET: u64 = 0x8000000;

    /// The request may have reached the upstream and executed, with no response to keep.
    pub const MAYBE_EXECUTED: u64 = UPSTREAM_REQUEST_TIMEOUT
        | LOCAL_RESET
        | UPSTREAM_REMOTE_RESET
        | UPSTREAM_CONNECTION_TERMINATION
        | DOWNSTREAM_CONNECTION_TERMINATION
        | STREAM_IDLE_TIMEOUT
        | UPSTREAM_MAX_STREAM_DURATION_REACHED
        | DURATION_TIMEOUT
        | UPSTREAM_PROTOCOL_ERROR
        | DOWNSTREAM_REMOTE_RESET
        | DOWNSTREAM_PROTOCOL_ERROR;
}

/// What a finished exchange means for the record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The upstream answered: store the response (5xx included) for replay.
    Store,
    /// The request never executed: free the key so a retry may execute.
    Release,
    /// It may have executed without a response: keep an outcome-unknown record.
    Unknown(UnknownReason),
}

/// The reset reasons (inside `upstream_reset_before_response_started{...}`) that mean the
/// connection to the upstream was never made, so nothing was sent on it.
const CONNECT_FAILURES: [&str; 4] =
    ["remote_connection_failure", "local_connection_failure", "connection_failure", "connection_timeout"];

/// Classifies a finished exchange. The key is released only on positive evidence that the
/// request never left Envoy (the allow-list below); the upstream's own answer is stored; anything
/// else is outcome-unknown: at most once beats twice.
///
/// Evidence that it never left: idemgate did not forward it; or no upstream request was ever
/// started (no attempt, no upstream host: a later filter answered before the router); or, for at
/// most one attempt, Envoy's response flag and its code details both name a failure that happens
/// before sending (no healthy upstream, a connection never established, overflow, no route, no
/// cluster). A local reply by a later filter after the upstream answered (a Lua or ext_proc
/// failure on the response path) carries no flag and is not evidence: outcome unknown.
pub fn classify(facts: &ExchangeFacts, policy: &Policy) -> Outcome {
    classify_exchange(&mut facts.clone(), policy)
}

/// `classify`, asking `x` for each fact only when the rule reached needs it (see `Exchange`).
pub fn classify_exchange(x: &mut impl Exchange, policy: &Policy) -> Outcome {
    if !x.forwarded() || never_started(x) {
        return Outcome::Release;
    }
    let by_status =
        |status: u16| if policy.release_on_status.contains(&status) { Outcome::Release } else { Outcome::Store };
    // The whole upstream response was captured: the client leaving while it was being written
    // changes nothing, the retry gets the replay.
    if x.response_complete() {
        if let Some(status) = x.status() {
            if x.code_details() == "via_upstream" {
                return by_status(status);
            }
        }
    }
    let f = x.flags();
    if f & flags::MAYBE_EXECUTED != 0 {
        let reason = if f
            & (flags::UPSTREAM_REQUEST_TIMEOUT
                | flags::DURATION_TIMEOUT
                | flags::STREAM_IDLE_TIMEOUT
                | flags::UPSTREAM_MAX_STREAM_DURATION_REACHED)
            != 0
        {
            UnknownReason::UpstreamTimeout
        } else if f
            & (flags::DOWNSTREAM_CONNECTION_TERMINATION
                | flags::DOWNSTREAM_REMOTE_RESET
                | flags::DOWNSTREAM_PROTOCOL_ERROR)
            != 0
        {
            UnknownReason::DownstreamGone
        } else {
            UnknownReason::UpstreamReset
        };
        return Outcome::Unknown(reason);
    }
    if envoy_never_sent(x) {
        return Outcome::Release;
    }
    match x.status() {
        Some(status) if x.code_details() == "via_upstream" => by_status(status),
        // No status, a local reply that is not on the allow-list (a later filter failing on the
        // response path, an unflagged upstream failure): it may have run.
        _ => Outcome::Unknown(UnknownReason::Other),
    }
}

/// `classify_exchange` for router forwarding, given the answer's headers (names lowercase; empty
/// when none were kept). Under `next_hop_failures: "classify"`, an answer the edge's router relayed
/// from its only attempt that carries a next hop's `x-idemgate-hop: local;...` mark is that hop's
/// own failure reply: classified by the facts in the mark, as the edge's own failure would be
/// (released when that hop sent nothing, outcome-unknown when it may have run). Any other answer
/// (no mark, `relayed`, an unreadable mark) keeps the edge's own classification.
pub fn classify_routed(x: &mut impl Exchange, headers: &[(String, Vec<u8>)], policy: &Policy) -> Outcome {
    let outcome = classify_exchange(x, policy);
    if policy.next_hop_failures != NextHopFailures::Classify
        || outcome != Outcome::Store
        || x.code_details() != "via_upstream"
        || x.attempts() != Some(1)
    {
        return outcome;
    }
    match hop_mark(x.status(), headers) {
        HopMark::Local(facts) => classify(&facts, policy),
        HopMark::Missing | HopMark::Relayed | HopMark::Unreadable => outcome,
    }
}

/// Whether Envoy's router sent the exchange upstream more than once (its attempt count). idemgate
/// tells it to send a protected request once (`request::ROUTER_RETRY_CAP`); a later filter (or a
/// host that ignores the cap) may still have re-sent it. Nothing can undo that now: each build
/// counts it (`idemgate.upstream_attempts_repeated`) and says so in its log.
pub fn re_sent(x: &mut impl Exchange) -> bool {
    x.attempts().is_some_and(|n| n > 1)
}

/// No upstream request was ever started: Envoy says there was no attempt and no upstream host.
/// Both must be read: an unreadable attempt count is no evidence. (The host is asked only when
/// the count says no attempt.)
fn never_started(x: &mut impl Exchange) -> bool {
    x.attempts() == Some(0) && !x.upstream_host()
}

/// Envoy answered for a failure that happens before anything is sent, on the only attempt: the
/// flag and the code details must agree (a flag alone may be left over from another attempt, and
/// the details name whoever answered last).
fn envoy_never_sent(x: &mut impl Exchange) -> bool {
    if !matches!(x.attempts(), Some(0 | 1)) {
        return false;
    }
    let f = x.flags();
    let d = x.code_details();
    let reset_reason = d
        .strip_prefix("upstream_reset_before_response_started{")
        .and_then(|r| r.strip_suffix('}'))
        .and_then(|r| r.split('|').next());
    (f & flags::NO_HEALTHY_UPSTREAM != 0 && d == "no_healthy_upstream")
        || (f & flags::NO_ROUTE_FOUND != 0 && d == "route_not_found")
        || (f & flags::NO_CLUSTER_FOUND != 0 && d == "cluster_not_found")
        || (f & flags::UPSTREAM_OVERFLOW != 0 && (d == "maintenance_mode" || reset_reason == Some("overflow")))
        || (f & flags::UPSTREAM_CONNECTION_FAILURE != 0
            && reset_reason.is_some_and(|r| CONNECT_FAILURES.contains(&r))
            && !x.upstream_connected())
}

/// The header Envoy's router adds to every upstream response it relays, callouts included
/// (Envoy's own local replies never carry it).
const UPSTREAM_SERVICE_TIME_HEADER: &str = "x-envoy-upstream-service-time";

/// Whether a callout's answer was relayed from the upstream (rather than Envoy's own reply).
/// `headers` are the answer's headers (names lowercase).
pub fn callout_from_upstream(headers: &[(String, Vec<u8>)]) -> bool {
    headers.iter().any(|(n, _)| n == UPSTREAM_SERVICE_TIME_HEADER)
}

/// The response header an internal listener's chain (`upstream.hop: "internal_listener"`) puts
/// on every answer it sends back to a detached callout, overwriting any the upstream sent:
/// `relayed` (its route table's `response_headers_to_add`: the router relayed the upstream's
/// answer), or `local;attempts=..;host=..;connected=..;flags=..;details=..` (its
/// `local_reply_config` mapper: a filter or the router of that chain answered itself, with the
/// stream's facts at that moment, Envoy's `%UPSTREAM_REQUEST_ATTEMPT_COUNT%`, `%UPSTREAM_HOST%`,
/// `%UPSTREAM_LOCAL_ADDRESS%`, `%RESPONSE_FLAGS%` and `%RESPONSE_CODE_DETAILS%`).
pub const HOP_HEADER: &str = "x-idemgate-hop";

/// The request header of the root's probe of an internal listener chain (and never forwarded
/// from a client in detached mode).
pub const HOP_PROBE_HEADER: &str = "x-idemgate-hop-probe";

/// What an answer's `x-idemgate-hop` says.
#[derive(Clone, Debug, PartialEq)]
pub enum HopMark {
    /// No mark: the answer did not come through the chain (Envoy's own reply for the callout, or
    /// a cluster that is not the internal listener).
    Missing,
    /// The chain's router relayed the upstream's answer.
    Relayed,
    /// The chain answered itself; the facts of its stream when it did.
    Local(ExchangeFacts),
    /// A mark this build cannot read: no evidence of anything.
    Unreadable,
}

/// Envoy's short response flag codes (`%RESPONSE_FLAGS%`) and their bits. A code not listed
/// adds no bit: a release never rests on a flag's absence (see `classify_exchange`).
const SHORT_FLAGS: [(&str, u64); 22] = [
    ("LH", flags::FAILED_LOCAL_HEALTH_CHECK),
    ("UH", flags::NO_HEALTHY_UPSTREAM),
    ("UT", flags::UPSTREAM_REQUEST_TIMEOUT),
    ("LR", flags::LOCAL_RESET),
    ("UR", flags::UPSTREAM_REMOTE_RESET),
    ("UF", flags::UPSTREAM_CONNECTION_FAILURE),
    ("UC", flags::UPSTREAM_CONNECTION_TERMINATION),
    ("UO", flags::UPSTREAM_OVERFLOW),
    ("NR", flags::NO_ROUTE_FOUND),
    ("DI", flags::DELAY_INJECTED),
    ("FI", flags::FAULT_INJECTED),
    ("RL", flags::RATE_LIMITED),
    ("UAEX", flags::UNAUTHORIZED_EXTERNAL_SERVICE),
    ("DC", flags::DOWNSTREAM_CONNECTION_TERMINATION),
    ("URX", flags::UPSTREAM_RETRY_LIMIT_EXCEEDED),
    ("SI", flags::STREAM_IDLE_TIMEOUT),
    ("DPE", flags::DOWNSTREAM_PROTOCOL_ERROR),
    ("UMSDR", flags::UPSTREAM_MAX_STREAM_DURATION_REACHED),
    ("DT", flags::DURATION_TIMEOUT),
    ("UPE", flags::UPSTREAM_PROTOCOL_ERROR),
    ("NC", flags::NO_CLUSTER_FOUND),
    ("DR", flags::DOWNSTREAM_REMOTE_RESET),
];

/// Reads an answer's `x-idemgate-hop` (`headers`: names lowercase; a repeated mark is unreadable).
pub fn hop_mark(status: Option<u16>, headers: &[(String, Vec<u8>)]) -> HopMark {
    let mut marks = headers.iter().filter(|(n, _)| n == HOP_HEADER);
    let (Some((_, v)), None) = (marks.next(), marks.next()) else {
        return if headers.iter().any(|(n, _)| n == HOP_HEADER) { HopMark::Unreadable } else { HopMark::Missing };
    };
    if v == b"relayed" {
        return HopMark::Relayed;
    }
    local_hop_facts(v, status).map_or(HopMark::Unreadable, HopMark::Local)
}

fn local_hop_facts(v: &[u8], status: Option<u16>) -> Option<ExchangeFacts> {
    let v = std::str::from_utf8(v).ok()?.strip_prefix("local;attempts=")?;
    let (attempts, rest) = v.split_once(";host=")?;
    let (host, rest) = rest.split_once(";connected=")?;
    let (connected, rest) = rest.split_once(";flags=")?;
    let (short_flags, details) = rest.split_once(";details=")?;
    let set = |s: &str| !s.is_empty() && s != "-";
    let bits = short_flags
        .split(',')
        .filter_map(|code| SHORT_FLAGS.iter().find(|(c, _)| *c == code).map(|(_, b)| *b))
        .fold(0, |acc, b| acc | b);
    Some(ExchangeFacts {
        forwarded: true,
        status,
        code_details: details.to_string(),
        flags: bits,
        // A local reply: never the upstream's whole answer.
        response_complete: false,
        upstream_host: set(host),
        upstream_connected: set(connected),
        attempts: attempts.parse().ok(),
    })
}

/// Whether a detached callout's answer is the upstream's own (to store and replay): behind an
/// internal listener, the answers its router relayed (`x-idemgate-hop: relayed`); straight to
/// the upstream cluster, the answers stamped by the callout's router.
pub fn callout_answer_is_upstreams(headers: &[(String, Vec<u8>)], policy: &Policy) -> bool {
    if behind_hop(policy) {
        hop_mark(None, headers) == HopMark::Relayed
    } else {
        callout_from_upstream(headers)
    }
}

fn behind_hop(policy: &Policy) -> bool {
    matches!(policy.forwarding, Forwarding::Detached { hop: Hop::InternalListener, .. })
}

/// The start of Envoy's reply when the upstream connection failed or was reset before headers,
/// then what follows it on the first attempt (after retries: `retried and the latest reset
/// reason: `, and an earlier attempt may have run).
const CONNECT_ERROR_PREFIX: &[u8] = b"upstream connect error or disconnect/reset before headers. ";
const FIRST_ATTEMPT_REASON: &[u8] = b"reset reason: ";

/// Reset reasons in Envoy's reply text that mean nothing was sent.
const CONNECT_FAILURE_TEXTS: [&[u8]; 5] = [
    b"remote connection failure",
    b"local connection failure",
    b"connection failure",
    b"connection timeout",
    b"overflow",
];

/// How a detached callout ended. Callouts carry no response flags, so the answer itself decides:
/// an answer the router relayed from the upstream carries `x-envoy-upstream-service-time` and is
/// the upstream's (stored, or released by `release_on_status`), whatever its text. Only an answer
/// without it, typed `text/plain`, with the status Envoy uses and one of its failure texts is
/// Envoy's own: released when that failure happens before sending (503 `no healthy upstream`,
/// 503 connection failure or overflow), outcome-unknown otherwise. `headers` are the answer's
/// headers (names lowercase).
pub fn classify_callout(status: Option<u16>, headers: &[(String, Vec<u8>)], body: &[u8], policy: &Policy) -> Outcome {
    let Some(status) = status else {
        return Outcome::Unknown(UnknownReason::UpstreamReset);
    };
    if behind_hop(policy) {
        // Every answer the chain sends carries its mark (the upstream's own overwritten); only
        // an answer without one is the callout's Envoy's own (the rules below).
        match hop_mark(Some(status), headers) {
            HopMark::Relayed => {
                return if policy.release_on_status.contains(&status) { Outcome::Release } else { Outcome::Store }
            }
            HopMark::Local(facts) => return classify(&facts, policy),
            HopMark::Unreadable => return Outcome::Unknown(UnknownReason::Other),
            HopMark::Missing => {}
        }
    }
    if callout_from_upstream(headers) {
        return if policy.release_on_status.contains(&status) { Outcome::Release } else { Outcome::Store };
    }
    let plain_text = headers.iter().any(|(n, v)| n == "content-type" && v == b"text/plain");
    let connect_error = body.strip_prefix(CONNECT_ERROR_PREFIX);
    let never_sent = body == b"no healthy upstream"
        || connect_error.and_then(|r| r.strip_prefix(FIRST_ATTEMPT_REASON)).is_some_and(|r| {
            CONNECT_FAILURE_TEXTS
                .iter()
                .any(|t| r == *t || r.strip_prefix(*t).is_some_and(|rest| rest.starts_with(b",")))
        });
    match status {
        503 if plain_text && never_sent => Outcome::Release,
        504 => Outcome::Unknown(UnknownReason::UpstreamTimeout),
        _ if connect_error.is_some() => Outcome::Unknown(UnknownReason::UpstreamReset),
        // No upstream answer and nothing that proves the request never left.
        _ => Outcome::Unknown(UnknownReason::Other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::owner::OwnerToken;
    use crate::record::{Creator, StoredResponse};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const NOW: u64 = 1_000_000;

    fn policy() -> Policy {
        Policy { require_key: false, ..Policy::default() }
    }

    fn rec(fp: u8, state: State, expires_at_ms: u64) -> Record {
        Record {
            fingerprint: Fingerprint([fp; 32]),
            created_at_ms: 0,
            expires_at_ms,
            creator: Creator::default(),
            state,
        }
    }

    fn owner() -> OwnerToken {
        OwnerToken([1; 16])
    }

    #[test]
    fn admission_table() {
        let mut required = policy();
        required.require_key = true;
        let p = policy();
        type Row<'a> = (Option<&'a Policy>, Vec<&'a [u8]>, Admission);
        let table: Vec<Row> = vec![
            (None, vec![b"k"], Admission::Pass),
            (Some(&p), vec![], Admission::Pass),
            (Some(&required), vec![], Admission::Reject(ProblemKind::KeyMissing { header: "idempotency-key".into() })),
            (
                Some(&p),
                vec![b"a,b"],
                Admission::Reject(ProblemKind::KeyInvalid {
                    header: "idempotency-key".into(),
                    error: crate::key::KeyError::List,
                    syntax: crate::key::KeySyntax::Strict,
                    max_len: 255,
                }),
            ),
            (
                Some(&p),
                vec![b"k", b"k"],
                Admission::Reject(ProblemKind::KeyInvalid {
                    header: "idempotency-key".into(),
                    error: crate::key::KeyError::Repeated,
                    syntax: crate::key::KeySyntax::Strict,
                    max_len: 255,
                }),
            ),
        ];
        for (pol, values, want) in table {
            assert_eq!(admit(pol, &values), want, "{values:?}");
        }
        assert!(matches!(admit(Some(&p), &[b"\"k1\""]), Admission::Protect(k) if k.as_str() == "k1"));
    }

    #[test]
    fn body_limit_is_inclusive() {
        let mut p = policy();
        p.max_request_body_bytes = 10;
        assert_eq!(check_body_size(10, &p), Ok(()));
        assert_eq!(check_body_size(11, &p), Err(ProblemKind::BodyTooLarge { limit: 10 }));
    }

    #[test]
    fn decision_table_covers_every_store_state() {
        let fp = Fingerprint([9; 32]);
        let later = NOW + 5_000;
        let earlier = NOW - 1;
        let completed = State::Completed(StoredResponse { status: 201, headers: vec![], body: b"x".to_vec() });
        let in_flight = Decision::Reject(ProblemKind::InFlight { retry_after_seconds: 1 });
        let mut takeover = policy();
        takeover.stale_lock = StaleLock::Takeover;
        let claimed_live = State::Claimed { owner: owner(), lock_expires_at_ms: later };
        let claimed_stale = State::Claimed { owner: owner(), lock_expires_at_ms: earlier };
        let forwarded_live = State::Forwarded { owner: owner(), lock_expires_at_ms: later };
        let forwarded_stale = State::Forwarded { owner: owner(), lock_expires_at_ms: earlier };
        let unknown = State::OutcomeUnknown { reason: UnknownReason::UpstreamTimeout };
        let def = policy();
        let too_large = State::CompletedTooLarge { status: 201, location: None };
        #[rustfmt::skip]
        let table: Vec<(&str, Option<Record>, &Policy, Decision)> = vec![
            ("absent", None, &def, Decision::Claim),
            ("expired completed", Some(rec(9, completed.clone(), NOW)), &def, Decision::Claim),
            ("expired outcome unknown", Some(rec(9, unknown.clone(), NOW - 10)), &def, Decision::Claim),
            ("completed, same request", Some(rec(9, completed.clone(), later)), &def, Decision::Replay),
            ("completed too large", Some(rec(9, too_large, later)), &def, Decision::Replay),
            ("completed, other request", Some(rec(8, completed, later)), &def, Decision::Reject(ProblemKind::KeyReused { status: 422 })),
            ("claimed, lock live", Some(rec(9, claimed_live.clone(), later)), &def, in_flight.clone()),
            ("claimed, other request", Some(rec(8, claimed_live, later)), &def, Decision::Reject(ProblemKind::KeyReused { status: 422 })),
            ("forwarded, lock live", Some(rec(9, forwarded_live, later)), &def, in_flight),
            ("claimed never forwarded, stale", Some(rec(9, claimed_stale.clone(), later)), &def, Decision::TakeOver),
            ("claimed stale, takeover mode", Some(rec(9, claimed_stale.clone(), later)), &takeover, Decision::TakeOver),
            ("claimed stale, other request", Some(rec(8, claimed_stale, later)), &def, Decision::Reject(ProblemKind::KeyReused { status: 422 })),
            ("forwarded, stale", Some(rec(9, forwarded_stale.clone(), later)), &def, Decision::MarkUnknown),
            ("forwarded, stale, takeover mode", Some(rec(9, forwarded_stale.clone(), later)), &takeover, Decision::TakeOver),
            ("forwarded stale, other request", Some(rec(8, forwarded_stale, later)), &def, Decision::Reject(ProblemKind::KeyReused { status: 422 })),
            ("outcome unknown", Some(rec(9, unknown.clone(), later)), &def, Decision::Reject(ProblemKind::OutcomeUnknown)),
            ("outcome unknown, other request", Some(rec(8, unknown, later)), &def, Decision::Reject(ProblemKind::KeyReused { status: 422 })),
        ];
        for (name, record, pol, want) in table {
            let lookup = match &record {
                None => Lookup::Absent,
                Some(r) => Lookup::Found(r.summary()),
            };
            assert_eq!(decide(lookup, Some(&fp), NOW, pol, OnUnavailable::Reject), want, "{name}");
        }
    }

    #[test]
    fn at_request_headers_only_live_locks_and_free_keys_are_decided() {
        let later = NOW + 5_000;
        let summary = |phase, fp: Option<u8>| Summary {
            fingerprint: fp.map(|b| Fingerprint([b; 32])),
            expires_at_ms: later,
            phase,
        };
        let d = |s: Summary| decide(Lookup::Found(s), None, NOW, &policy(), OnUnavailable::Reject);
        assert_eq!(decide(Lookup::Absent, None, NOW, &policy(), OnUnavailable::Reject), Decision::Claim);
        assert_eq!(
            d(summary(Phase::Claimed { lock_expires_at_ms: later }, None)),
            Decision::Reject(ProblemKind::InFlight { retry_after_seconds: 1 })
        );
        assert_eq!(
            d(summary(Phase::Forwarded { lock_expires_at_ms: later }, Some(1))),
            Decision::Reject(ProblemKind::InFlight { retry_after_seconds: 1 })
        );
        assert_eq!(d(summary(Phase::Claimed { lock_expires_at_ms: NOW }, None)), Decision::TakeOver);
        assert_eq!(d(summary(Phase::Forwarded { lock_expires_at_ms: NOW }, Some(1))), Decision::NeedFingerprint);
        assert_eq!(d(summary(Phase::Completed, Some(1))), Decision::NeedFingerprint);
        assert_eq!(d(summary(Phase::Unknown, Some(1))), Decision::NeedFingerprint);
        // A claim made at headers has no fingerprint yet: a full request meeting it live is in flight.
        let fp = Fingerprint([1; 32]);
        assert_eq!(
            decide(
                Lookup::Found(summary(Phase::Claimed { lock_expires_at_ms: later }, None)),
                Some(&fp),
                NOW,
                &policy(),
                OnUnavailable::Reject
            ),
            Decision::Reject(ProblemKind::InFlight { retry_after_seconds: 1 })
        );
    }

    /// Issue 12, item 5: a claim whose lock is live is never free, whatever its record's expiry;
    /// past its expiry, a record with no live lock is free.
    #[test]
    fn a_live_lock_is_never_free_whatever_the_records_expiry() {
        let fp = Fingerprint([9; 32]);
        let (live, stale, expired) = (NOW + 1, NOW, NOW);
        let in_flight = Decision::Reject(ProblemKind::InFlight { retry_after_seconds: 1 });
        let summary = |phase| Summary { fingerprint: Some(fp), expires_at_ms: expired, phase };
        let headers_claim = |phase| Summary { fingerprint: None, expires_at_ms: expired, phase };
        #[rustfmt::skip]
        let table: Vec<(&str, Summary, Option<&Fingerprint>, Decision)> = vec![
            ("forwarded, lock live, expired", summary(Phase::Forwarded { lock_expires_at_ms: live }), Some(&fp), in_flight.clone()),
            ("forwarded, lock live, expired, at headers", summary(Phase::Forwarded { lock_expires_at_ms: live }), None, in_flight.clone()),
            ("claimed at headers, lock live, expired", headers_claim(Phase::Claimed { lock_expires_at_ms: live }), Some(&fp), in_flight.clone()),
            ("claimed at headers, lock live, expired, at headers", headers_claim(Phase::Claimed { lock_expires_at_ms: live }), None, in_flight),
            ("forwarded, lock live, expired, other request", summary(Phase::Forwarded { lock_expires_at_ms: live }), Some(&Fingerprint([8; 32])), Decision::Reject(ProblemKind::KeyReused { status: 422 })),
            ("forwarded, lock stale, expired", summary(Phase::Forwarded { lock_expires_at_ms: stale }), Some(&fp), Decision::Claim),
            ("claimed, lock stale, expired", headers_claim(Phase::Claimed { lock_expires_at_ms: stale }), None, Decision::Claim),
            ("completed, expired", summary(Phase::Completed), Some(&fp), Decision::Claim),
            ("unknown, expired", summary(Phase::Unknown), None, Decision::Claim),
        ];
        for (name, s, f, want) in table {
            assert_eq!(decide(Lookup::Found(s), f, NOW, &policy(), OnUnavailable::Reject), want, "{name}");
        }
    }

    #[test]
    fn a_key_reused_with_another_request_gets_the_policys_mismatch_status_in_every_state() {
        let acp = Policy { mismatch_status: 409, ..policy() };
        let later = NOW + 5_000;
        let completed = State::Completed(StoredResponse { status: 201, headers: vec![], body: vec![] });
        for state in [
            completed,
            State::Claimed { owner: owner(), lock_expires_at_ms: later },
            State::Forwarded { owner: owner(), lock_expires_at_ms: NOW - 1 },
            State::OutcomeUnknown { reason: UnknownReason::UpstreamTimeout },
        ] {
            let r = rec(8, state, later);
            assert_eq!(
                decide(Lookup::Found(r.summary()), Some(&Fingerprint([9; 32])), NOW, &acp, OnUnavailable::Reject),
                Decision::Reject(ProblemKind::KeyReused { status: 409 }),
                "{r:?}"
            );
        }
    }

    #[test]
    fn store_error_rejects_or_passes_as_configured() {
        let fp = Fingerprint([0; 32]);
        assert_eq!(
            decide(Lookup::StoreError, Some(&fp), NOW, &policy(), OnUnavailable::Reject),
            Decision::Reject(ProblemKind::StoreUnavailable { retry_after_seconds: 1 })
        );
        assert_eq!(
            decide(Lookup::StoreError, Some(&fp), NOW, &policy(), OnUnavailable::Pass),
            Decision::PassUnprotected
        );
    }

    #[test]
    fn a_record_that_exists_but_cannot_be_read_is_refused_in_every_mode() {
        let fp = Fingerprint([0; 32]);
        for mode in [OnUnavailable::Reject, OnUnavailable::Pass] {
            for fp in [None, Some(&fp)] {
                assert_eq!(
                    decide(Lookup::Unreadable, fp, NOW, &policy(), mode),
                    Decision::Reject(ProblemKind::RecordUnreadable { retry_after_seconds: 1 }),
                    "{mode:?}"
                );
            }
        }
    }

    /// A forwarded exchange where the router made one attempt on a host it connected to.
    fn facts(forwarded: bool, status: Option<u16>, details: &str, flags: u64) -> ExchangeFacts {
        ExchangeFacts {
            forwarded,
            status,
            code_details: details.into(),
            flags,
            response_complete: false,
            upstream_host: true,
            upstream_connected: true,
            attempts: Some(1),
        }
    }

    #[test]
    fn an_exchange_counts_as_re_sent_only_when_the_router_made_more_than_one_attempt() {
        let with = |attempts| ExchangeFacts { attempts, ..facts(true, Some(503), "via_upstream", 0) };
        assert!(re_sent(&mut with(Some(2))) && re_sent(&mut with(Some(3))));
        // One attempt, none, or a count Envoy did not give: nothing to count.
        assert!(!re_sent(&mut with(Some(1))) && !re_sent(&mut with(Some(0))) && !re_sent(&mut with(None)));
    }

    /// The same, where the connection to the upstream was never established.
    fn unconnected(status: Option<u16>, details: &str, flags: u64) -> ExchangeFacts {
        ExchangeFacts { upstream_connected: false, ..facts(true, status, details, flags) }
    }

    /// The same, where the router never started an upstream request (no attempt, no host).
    fn not_started(status: Option<u16>, details: &str, flags: u64) -> ExchangeFacts {
        ExchangeFacts {
            upstream_host: false,
            upstream_connected: false,
            attempts: Some(0),
            ..facts(true, status, details, flags)
        }
    }

    /// An exchange that records which facts `classify_exchange` asked for.
    struct Asked(ExchangeFacts, Vec<&'static str>);

    impl Exchange for Asked {
        fn forwarded(&mut self) -> bool {
            self.0.forwarded
        }
        fn status(&mut self) -> Option<u16> {
            self.0.status
        }
        fn code_details(&mut self) -> String {
            self.1.push("code_details");
            self.0.code_details.clone()
        }
        fn flags(&mut self) -> u64 {
            self.1.push("flags");
            self.0.flags
        }
        fn response_complete(&mut self) -> bool {
            self.0.response_complete
        }
        fn upstream_host(&mut self) -> bool {
            self.1.push("upstream_host");
            self.0.upstream_host
        }
        fn upstream_connected(&mut self) -> bool {
            self.1.push("upstream_connected");
            self.0.upstream_connected
        }
        fn attempts(&mut self) -> Option<u64> {
            self.1.push("attempts");
            self.0.attempts
        }
    }

    #[test]
    fn an_exchange_the_upstream_answered_in_full_is_classified_on_its_attempts_and_code_details_alone() {
        let mut x =
            Asked(ExchangeFacts { response_complete: true, ..facts(true, Some(201), "via_upstream", 0) }, vec![]);
        assert_eq!(classify_exchange(&mut x, &policy()), Outcome::Store);
        x.1.sort_unstable();
        x.1.dedup();
        assert_eq!(x.1, ["attempts", "code_details"], "facts read (each one a host call in the filter)");
    }

    #[test]
    fn the_facts_left_unread_never_change_an_outcome() {
        // Whatever the facts classify did not ask for, it answers the same: flipping each fact it
        // left unread never changes the outcome.
        use flags::*;
        let details = [
            "via_upstream",
            "no_healthy_upstream",
            "upstream_reset_before_response_started{connection_timeout}",
            "upstream_reset_before_response_started{remote_connection_failure|x}",
            "response_timeout",
            "",
            "other",
        ];
        let flag_sets = [
            0,
            UPSTREAM_CONNECTION_FAILURE,
            NO_HEALTHY_UPSTREAM,
            UPSTREAM_REQUEST_TIMEOUT,
            UPSTREAM_OVERFLOW,
            DOWNSTREAM_CONNECTION_TERMINATION,
            UPSTREAM_CONNECTION_FAILURE | UPSTREAM_REQUEST_TIMEOUT,
        ];
        let mut cases = 0;
        for d in details {
            for f in flag_sets {
                for attempts in [None, Some(0), Some(1), Some(2)] {
                    for status in [None, Some(201), Some(429), Some(503)] {
                        for bits in 0..16u8 {
                            let x = ExchangeFacts {
                                forwarded: bits & 1 != 0,
                                status,
                                code_details: d.into(),
                                flags: f,
                                response_complete: bits & 2 != 0,
                                upstream_host: bits & 4 != 0,
                                upstream_connected: bits & 8 != 0,
                                attempts,
                            };
                            let mut asked = Asked(x.clone(), vec![]);
                            let out = classify_exchange(&mut asked, &policy());
                            let unread = |n: &str| !asked.1.contains(&n);
                            let mut flips = vec![];
                            if unread("flags") {
                                flips.push(ExchangeFacts { flags: !x.flags, ..x.clone() });
                            }
                            if unread("code_details") {
                                flips.push(ExchangeFacts { code_details: "via_upstream".into(), ..x.clone() });
                                flips.push(ExchangeFacts { code_details: "no_healthy_upstream".into(), ..x.clone() });
                            }
                            if unread("upstream_host") {
                                flips.push(ExchangeFacts { upstream_host: !x.upstream_host, ..x.clone() });
                            }
                            if unread("upstream_connected") {
                                flips.push(ExchangeFacts { upstream_connected: !x.upstream_connected, ..x.clone() });
                            }
                            if unread("attempts") {
                                flips.push(ExchangeFacts { attempts: Some(0), ..x.clone() });
                                flips.push(ExchangeFacts { attempts: Some(3), ..x.clone() });
                            }
                            for y in flips {
                                assert_eq!(classify(&y, &policy()), out, "{x:?} vs {y:?}");
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(cases > 1000, "{cases}");
    }

    #[test]
    fn a_fully_captured_response_is_stored_even_if_the_client_left_while_it_was_written() {
        let mut f = facts(true, Some(201), "via_upstream", flags::DOWNSTREAM_CONNECTION_TERMINATION);
        assert_eq!(classify(&f, &policy()), Outcome::Unknown(UnknownReason::DownstreamGone));
        f.response_complete = true;
        assert_eq!(classify(&f, &policy()), Outcome::Store);
        f.status = Some(429);
        assert_eq!(classify(&f, &policy()), Outcome::Release);
    }

    #[test]
    fn exchange_classification_table() {
        use flags::*;
        let refused = "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}";
        let connect_timeout = "upstream_reset_before_response_started{connection_timeout}";
        let overflow = "upstream_reset_before_response_started{overflow}";
        let retried = |mut f: ExchangeFacts| {
            f.attempts = Some(3);
            f
        };
        let unreadable_attempts = |mut f: ExchangeFacts| {
            f.attempts = None;
            f
        };
        #[rustfmt::skip]
        let table: Vec<(&str, ExchangeFacts, Outcome)> = vec![
            ("upstream 201", facts(true, Some(201), "via_upstream", 0), Outcome::Store),
            ("upstream 500 is stored", facts(true, Some(500), "via_upstream", 0), Outcome::Store),
            ("upstream 503 is stored", facts(true, Some(503), "via_upstream", 0), Outcome::Store),
            ("upstream 429 released", facts(true, Some(429), "via_upstream", 0), Outcome::Release),
            // Released: positive evidence that nothing left Envoy.
            ("never forwarded", facts(false, None, "", 0), Outcome::Release),
            ("never forwarded, client gone", facts(false, None, "downstream_remote_disconnect", DOWNSTREAM_CONNECTION_TERMINATION), Outcome::Release),
            ("connection refused", unconnected(Some(503), refused, UPSTREAM_CONNECTION_FAILURE), Outcome::Release),
            ("connect timeout", unconnected(Some(503), connect_timeout, UPSTREAM_CONNECTION_FAILURE), Outcome::Release),
            ("no healthy upstream", unconnected(Some(503), "no_healthy_upstream", NO_HEALTHY_UPSTREAM), Outcome::Release),
            ("overflow", unconnected(Some(503), overflow, UPSTREAM_OVERFLOW), Outcome::Release),
            ("maintenance mode", unconnected(Some(503), "maintenance_mode", UPSTREAM_OVERFLOW), Outcome::Release),
            ("no route", not_started(Some(404), "route_not_found", NO_ROUTE_FOUND), Outcome::Release),
            ("no cluster", not_started(Some(503), "cluster_not_found", NO_CLUSTER_FOUND), Outcome::Release),
            ("no route, attempt counted", unconnected(Some(404), "route_not_found", NO_ROUTE_FOUND), Outcome::Release),
            ("later filter local reply before the router", not_started(Some(403), "ext_authz_denied", 0), Outcome::Release),
            ("later filter's SDK reply (empty details) before the router", not_started(Some(403), "", 0), Outcome::Release),
            ("direct response", not_started(Some(200), "direct_response", 0), Outcome::Release),
            ("client gone while a later filter held the request", not_started(None, "downstream_remote_disconnect", DOWNSTREAM_CONNECTION_TERMINATION), Outcome::Release),
            // Not released: a local reply after an upstream request started is no evidence.
            ("a later filter replaced the upstream's answer", facts(true, Some(500), "response_payload_too_large", 0), Outcome::Unknown(UnknownReason::Other)),
            ("ext_proc failed on the response", facts(true, Some(500), "ext_proc_error_gRPC_error_14{upstream_reset_before_response_started{remote_connection_failure}}", 0), Outcome::Unknown(UnknownReason::Other)),
            ("a local reply with a host but no attempt count", unreadable_attempts(facts(true, Some(403), "ext_authz_denied", 0)), Outcome::Unknown(UnknownReason::Other)),
            ("no host but an unreadable attempt count", unreadable_attempts(not_started(Some(403), "lua_response", 0)), Outcome::Unknown(UnknownReason::Other)),
            ("a connect-failure flag left over, the answer a later filter's", unconnected(Some(500), "response_payload_too_large", UPSTREAM_CONNECTION_FAILURE), Outcome::Unknown(UnknownReason::Other)),
            ("connection failure details without the flag", unconnected(Some(503), refused, 0), Outcome::Unknown(UnknownReason::Other)),
            ("connection failure, but a connection was made", facts(true, Some(503), refused, UPSTREAM_CONNECTION_FAILURE), Outcome::Unknown(UnknownReason::Other)),
            ("refused after retries (an earlier attempt may have run)", retried(unconnected(Some(503), refused, UPSTREAM_CONNECTION_FAILURE | UPSTREAM_RETRY_LIMIT_EXCEEDED)), Outcome::Unknown(UnknownReason::Other)),
            ("refused, attempts unreadable", unreadable_attempts(unconnected(Some(503), refused, UPSTREAM_CONNECTION_FAILURE)), Outcome::Unknown(UnknownReason::Other)),
            ("no healthy upstream after retries", retried(unconnected(Some(503), "no_healthy_upstream", NO_HEALTHY_UPSTREAM)), Outcome::Unknown(UnknownReason::Other)),
            ("a flag outside the allow-list (fault injected) after an attempt", facts(true, Some(503), "fault_filter_abort", FAULT_INJECTED), Outcome::Unknown(UnknownReason::Other)),
            ("route timeout", facts(true, Some(504), "response_timeout", UPSTREAM_REQUEST_TIMEOUT), Outcome::Unknown(UnknownReason::UpstreamTimeout)),
            ("reset after send", facts(true, Some(503), "upstream_reset_before_response_started{connection_termination}", UPSTREAM_CONNECTION_TERMINATION), Outcome::Unknown(UnknownReason::UpstreamReset)),
            ("remote reset", facts(true, Some(503), "upstream_reset_before_response_started{remote_reset}", UPSTREAM_REMOTE_RESET), Outcome::Unknown(UnknownReason::UpstreamReset)),
            ("reset after headers", facts(true, Some(200), "upstream_reset_after_response_started{remote_reset}", UPSTREAM_REMOTE_RESET), Outcome::Unknown(UnknownReason::UpstreamReset)),
            ("client gone after forward", facts(true, None, "downstream_remote_disconnect", DOWNSTREAM_CONNECTION_TERMINATION), Outcome::Unknown(UnknownReason::DownstreamGone)),
            ("client reset after forward", facts(true, None, "", DOWNSTREAM_REMOTE_RESET), Outcome::Unknown(UnknownReason::DownstreamGone)),
            ("idle timeout", facts(true, Some(504), "stream_idle_timeout", STREAM_IDLE_TIMEOUT), Outcome::Unknown(UnknownReason::UpstreamTimeout)),
            ("timeout wins over connection failure", unconnected(Some(504), "response_timeout", UPSTREAM_REQUEST_TIMEOUT | UPSTREAM_CONNECTION_FAILURE), Outcome::Unknown(UnknownReason::UpstreamTimeout)),
            ("no status, no flags", facts(true, None, "", 0), Outcome::Unknown(UnknownReason::Other)),
            ("unflagged upstream failure", facts(true, Some(503), "upstream_reset_before_response_started{other}", 0), Outcome::Unknown(UnknownReason::Other)),
        ];
        for (name, f, want) in table {
            assert_eq!(classify(&f, &policy()), want, "{name}");
        }
    }

    fn hdrs(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
    }

    #[test]
    fn behind_an_internal_listener_the_chains_mark_decides() {
        use crate::config::{Forwarding, Hop};
        let hop = |h: Hop| Policy {
            forwarding: Forwarding::Detached { cluster: "idemgate_hop".into(), timeout_ms: 5000, hop: h },
            ..policy()
        };
        let (p, direct) = (hop(Hop::InternalListener), hop(Hop::Direct));
        // Every answer through the chain is stamped by the callout's own router.
        let marked = |mark: &str| {
            hdrs(&[("content-type", "text/plain"), ("x-envoy-upstream-service-time", "0"), (HOP_HEADER, mark)])
        };
        // The marks Envoy 1.40's internal listener wrote (envoy/detached/envoy.yaml).
        let rbac = marked("local;attempts=0;host=;connected=;flags=-;details=rbac_access_denied_matched_policy[none]");
        let refused = marked("local;attempts=1;host=127.0.0.1:29909;connected=;flags=UF;details=upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}");
        let timeout =
            marked("local;attempts=1;host=127.0.0.1:29903;connected=127.0.0.1:40000;flags=UT;details=response_timeout");
        let no_host = marked("local;attempts=0;host=;connected=;flags=UH;details=no_healthy_upstream");
        let late = marked(
            "local;attempts=1;host=127.0.0.1:1;connected=127.0.0.1:2;flags=-;details=lua_response_body_too_large",
        );
        let relayed = marked("relayed");
        let forged = marked("local;attempts=zero");
        let stamped = hdrs(&[("content-type", "text/plain"), ("x-envoy-upstream-service-time", "0")]);
        let twice = [relayed.clone(), marked("local;attempts=0;host=;connected=;flags=-;details=x")].concat();
        use Outcome::*;
        use UnknownReason::*;
        let body = &b"RBAC: access denied"[..];
        assert_eq!(classify_callout(Some(403), &rbac, body, &p), Release, "a later filter refused before the router");
        assert_eq!(classify_callout(Some(503), &refused, body, &p), Release, "the chain's router could not connect");
        assert_eq!(classify_callout(Some(503), &no_host, body, &p), Release);
        assert_eq!(classify_callout(Some(504), &timeout, body, &p), Unknown(UpstreamTimeout));
        assert_eq!(
            classify_callout(Some(500), &late, body, &p),
            Unknown(Other),
            "a local reply after the upstream ran"
        );
        assert_eq!(classify_callout(Some(403), &relayed, body, &p), Store, "the upstream's own 403");
        assert_eq!(classify_callout(Some(429), &relayed, body, &p), Release, "release_on_status");
        assert_eq!(classify_callout(Some(403), &forged, body, &p), Unknown(Other));
        assert_eq!(classify_callout(Some(403), &twice, body, &p), Unknown(Other), "two marks: neither is believed");
        assert_eq!(classify_callout(Some(403), &stamped, body, &p), Store, "no mark, stamped: it reached an upstream");
        assert!(callout_answer_is_upstreams(&relayed, &p) && !callout_answer_is_upstreams(&rbac, &p));
        // Straight to the upstream a mark is the upstream's own header: never believed.
        assert_eq!(classify_callout(Some(403), &rbac, body, &direct), Store);
        assert!(callout_answer_is_upstreams(&rbac, &direct));
    }

    #[test]
    fn a_next_hops_marked_failure_is_classified_as_the_edges_own_only_when_asked() {
        use crate::config::NextHopFailures;
        let classify_p = Policy { next_hop_failures: NextHopFailures::Classify, ..policy() };
        let store_p = policy();
        // The edge's router relayed the next hop's answer, on its only attempt.
        let relayed_by_edge = |status: u16, attempts: u64| ExchangeFacts {
            forwarded: true,
            status: Some(status),
            code_details: "via_upstream".into(),
            flags: 0,
            response_complete: true,
            upstream_host: true,
            upstream_connected: true,
            attempts: Some(attempts),
        };
        let marked = |mark: &str| hdrs(&[("content-type", "text/plain"), (HOP_HEADER, mark)]);
        // The marks a second Envoy 1.40 wrote with envoy/next-hop/envoy.yaml, its app down (`retried`:
        // its keyed route given `retry_on: connect-failure, num_retries: 2`).
        let refused = marked("local;attempts=1;host=127.0.0.1:29909;connected=;flags=UF;details=upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}");
        let retried = marked("local;attempts=3;host=127.0.0.1:19299;connected=;flags=URX,UF;details=upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}");
        let timeout =
            marked("local;attempts=1;host=127.0.0.1:29903;connected=127.0.0.1:40000;flags=UT;details=response_timeout");
        let relayed = marked("relayed");
        let none = hdrs(&[("content-type", "text/plain")]);
        use Outcome::*;
        use UnknownReason::*;
        let run = |f: ExchangeFacts, h: &[(String, Vec<u8>)], p: &Policy| classify_routed(&mut f.clone(), h, p);
        assert_eq!(run(relayed_by_edge(503, 1), &refused, &classify_p), Release, "the hop never connected");
        assert_eq!(run(relayed_by_edge(503, 1), &refused, &store_p), Store, "default: the mark is not believed");
        assert_eq!(
            run(relayed_by_edge(503, 1), &retried, &classify_p),
            Unknown(Other),
            "the hop retried: an attempt may have run"
        );
        assert_eq!(run(relayed_by_edge(504, 1), &timeout, &classify_p), Unknown(UpstreamTimeout));
        assert_eq!(run(relayed_by_edge(503, 1), &relayed, &classify_p), Store, "the app's own 503");
        assert_eq!(
            run(relayed_by_edge(503, 1), &none, &classify_p),
            Store,
            "no mark: the app's (its text proves nothing)"
        );
        assert_eq!(run(relayed_by_edge(503, 2), &refused, &classify_p), Store, "the edge itself retried");
        assert_eq!(run(relayed_by_edge(429, 1), &relayed, &classify_p), Release, "release_on_status still applies");
    }

    #[test]
    fn callout_classification_table() {
        let p = policy();
        // Envoy's own local reply: content-length and content-type only.
        let envoy = hdrs(&[("content-length", "19"), ("content-type", "text/plain")]);
        // The same headers from the upstream, relayed by the router (which stamps its header).
        let relayed =
            hdrs(&[("content-length", "19"), ("content-type", "text/plain"), ("x-envoy-upstream-service-time", "0")]);
        let no_healthy = &b"no healthy upstream"[..];
        let refused =
            &b"upstream connect error or disconnect/reset before headers. reset reason: remote connection failure"[..];
        let refused_old = &b"upstream connect error or disconnect/reset before headers. reset reason: connection failure, transport failure reason: delayed connect error: Connection refused"[..];
        let overflow = &b"upstream connect error or disconnect/reset before headers. reset reason: overflow"[..];
        let reset =
            &b"upstream connect error or disconnect/reset before headers. reset reason: connection termination"[..];
        let retried = &b"upstream connect error or disconnect/reset before headers. retried and the latest reset reason: remote connection failure"[..];
        let timeout = &b"upstream request timeout"[..];
        let json = hdrs(&[("content-type", "application/json")]);
        let c = |status, headers: &[(String, Vec<u8>)], body: &[u8]| classify_callout(status, headers, body, &p);
        use Outcome::*;
        use UnknownReason::*;
        #[rustfmt::skip]
        type Row<'a> = (&'a str, Option<u16>, &'a [(String, Vec<u8>)], &'a [u8], Outcome);
        let table: Vec<Row> = vec![
            ("upstream 201", Some(201), &relayed, b"{}", Store),
            ("upstream 500", Some(500), &relayed, b"boom", Store),
            ("upstream 504, fast", Some(504), &relayed, b"gateway says no", Store),
            ("upstream 429", Some(429), &relayed, b"", Release),
            ("no answer at all", None, &[], b"", Unknown(UpstreamReset)),
            // Envoy's own failures.
            ("Envoy: no healthy upstream", Some(503), &envoy, no_healthy, Release),
            ("Envoy: connection refused", Some(503), &envoy, refused, Release),
            ("Envoy: connection refused (older text)", Some(503), &envoy, refused_old, Release),
            ("Envoy: overflow", Some(503), &envoy, overflow, Release),
            ("Envoy: reset after connecting", Some(503), &envoy, reset, Unknown(UpstreamReset)),
            ("Envoy: refused after retries", Some(503), &envoy, retried, Unknown(UpstreamReset)),
            ("Envoy: timeout", Some(504), &envoy, timeout, Unknown(UpstreamTimeout)),
            ("Envoy: another 504", Some(504), &envoy, b"", Unknown(UpstreamTimeout)),
            ("an unknown reply without the router's header", Some(502), &envoy, b"bad gateway", Unknown(Other)),
            // Envoy's texts with another status than Envoy uses, or another content type: not Envoy's.
            ("no healthy upstream with 200, no router header", Some(200), &envoy, no_healthy, Unknown(Other)),
            ("no healthy upstream as JSON", Some(503), &json, no_healthy, Unknown(Other)),
            (
                "a longer reason than Envoy's",
                Some(503),
                &envoy,
                b"upstream connect error or disconnect/reset before headers. reset reason: overflowing",
                Unknown(UpstreamReset),
            ),
        ];
        for (name, status, headers, body, want) in table {
            assert_eq!(c(status, headers, body), want, "{name}");
        }
        // The upstream sending each of Envoy's failure texts, with any status: its answer.
        for body in [no_healthy, refused, refused_old, overflow, reset, retried, timeout] {
            for status in [200, 503, 504] {
                assert_eq!(c(Some(status), &relayed, body), Store, "{status} {}", String::from_utf8_lossy(body));
            }
        }
    }

    #[test]
    fn release_on_status_is_configurable() {
        let mut p = policy();
        p.release_on_status = vec![503];
        assert_eq!(classify(&facts(true, Some(429), "via_upstream", 0), &p), Outcome::Store);
        assert_eq!(classify(&facts(true, Some(503), "via_upstream", 0), &p), Outcome::Release);
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod props {
        use super::super::*;
        use crate::owner::OwnerToken;
        use crate::record::Creator;
        use proptest::prelude::*;

        proptest! {
            /// Whatever the flags say, a request that was forwarded and may have run is never released
            /// unless Envoy says it never sent it or the upstream itself answered.
            #[test]
            fn maybe_executed_flags_are_never_released(flags_bits in any::<u64>(), status in proptest::option::of(100u16..600), details in "[a-z_]{0,20}", connected in any::<bool>(), attempts in proptest::option::of(0u64..4)) {
                let f = ExchangeFacts { forwarded: true, status, code_details: details, flags: flags_bits | super::super::flags::UPSTREAM_REQUEST_TIMEOUT, response_complete: false,
                                        upstream_host: true, upstream_connected: connected, attempts };
                prop_assert!(matches!(classify(&f, &Policy::default()), Outcome::Unknown(_)));
            }

            /// Once an upstream request was started, any answer that is not the upstream's own and
            /// not on the allow-list of Envoy's failures before sending is never released, whatever
            /// the flags: a later filter's local reply, after the upstream ran, is no evidence.
            #[test]
            fn a_started_exchange_is_released_only_on_the_allow_list(flags_bits in any::<u64>(), status in proptest::option::of(100u16..600), details in "[a-z_{}|]{0,40}", connected in any::<bool>(), attempts in proptest::option::of(1u64..4)) {
                let f = ExchangeFacts { forwarded: true, status, code_details: details.clone(), flags: flags_bits, response_complete: false,
                                        upstream_host: true, upstream_connected: connected, attempts };
                let allowed = ["no_healthy_upstream", "route_not_found", "cluster_not_found", "maintenance_mode"].contains(&details.as_str())
                    || details.starts_with("upstream_reset_before_response_started{");
                if classify(&f, &Policy::default()) == Outcome::Release {
                    prop_assert!(allowed || (details == "via_upstream" && status == Some(429)), "{f:?}");
                    prop_assert!(attempts == Some(1) || details == "via_upstream", "{f:?}");
                }
            }

            /// Whatever its status, headers and text, a callout answer the router relayed from the
            /// upstream is never taken for Envoy's own failure.
            #[test]
            fn a_relayed_callout_answer_is_the_upstreams(status in 100u16..600, body in proptest::collection::vec(any::<u8>(), 0..120), extra in proptest::collection::vec(("[a-z-]{1,12}", "[ -~]{0,20}"), 0..4)) {
                let mut headers: Vec<(String, Vec<u8>)> = extra.into_iter().map(|(n, v)| (n, v.into_bytes())).collect();
                headers.push(("x-envoy-upstream-service-time".into(), b"3".to_vec()));
                let want = if status == 429 { Outcome::Release } else { Outcome::Store };
                prop_assert_eq!(classify_callout(Some(status), &headers, &body, &Policy::default()), want);
            }

            #[test]
            fn a_fingerprint_mismatch_on_an_unexpired_record_is_always_422(fp in any::<[u8; 32]>(), other in any::<[u8; 32]>(), lock in any::<u64>(), now in 0u64..u64::MAX - 1) {
                prop_assume!(fp != other);
                let r = Record { fingerprint: Fingerprint(fp), created_at_ms: 0, expires_at_ms: now + 1, creator: Creator::default(),
                                 state: State::Forwarded { owner: OwnerToken([0; 16]), lock_expires_at_ms: lock } };
                prop_assert_eq!(decide(Lookup::Found(r.summary()), Some(&Fingerprint(other)), now, &Policy::default(), OnUnavailable::Reject), Decision::Reject(ProblemKind::KeyReused { status: 422 }));
            }
        }
    }
}
