//! The request machine's decisions, sans-IO: what a protected request does next given what it
//! met (the local tier's answer, the fingerprint, the store's answer to the call it sent) and
//! the policy it runs under. Each function takes facts and returns a [`Step`], a command the HTTP
//! context (`src/filter/http.rs`) executes with host calls (claim in the store, forward, reply,
//! replay, wait). Nothing here reads a clock, the host or shared data: time comes in as `now`.
//!
//! ```text
//! headers / body end ─ local tier answered ─▶ after_local ─▶ WaitForBody | ClaimInStore | Forward
//!                                                          | Replay | InFlight | Reply | ReadSettled
//! claim-or-read answered ─▶ after_claim     ─▶ Forward | TooLate | Replay | InFlight | Reply
//!                                                | MarkUnknown | TakeOver | Unreadable | Resend | Lost
//! take-over answered     ─▶ after_take_over ─▶ Forward | TooLate | Reply(409) | Resend | Lost
//!   (Resend, Lost and TooLate are `Answered`'s: they need the call they answer)
//! settlement read answered ─▶ after_settled_read ─▶ Replay | Reply | UnknownStands
//! store failed           ─▶ after_store_failure ─▶ PassUnprotected | Reply
//! ```
//!
//! Every "cannot happen" answer is a [`Step::FailClosed`], which has no way to forward.
//!
//! Before those, the request's own steps (the host's values in, a command out):
//!
//! ```text
//! request headers ─▶ at_headers    ─▶ Admitted | NotProtected: Pass | Unprotected | RouteAmbiguous
//!                                    | McpBody | GrpcPassed | Refuse | PolicyMissing
//! a body chunk    ─▶ body_chunk    ─▶ the bytes to add to the VM's budget | a refusal (413, 503)
//! body end        ─▶ at_body_end   ─▶ Pass (no key derivable) | Fingerprinted (and the derived key)
//! MCP body end    ─▶ at_mcp_body   ─▶ Pass | Refuse (JSON-RPC id, batch ids) | Protect
//! ```

use std::sync::Arc;

use crate::admin;
use crate::config::{Config, DeriveKey, Forwarding, GrpcMode, OnUnavailable, Policy, Selection};
use crate::decision::{admit, check_body_size, Admission};
use crate::decision::{decide, Decision, Lookup, IN_FLIGHT_RETRY_AFTER_SECONDS, UNAVAILABLE_RETRY_AFTER_SECONDS};
use crate::derive;
use crate::failsafe::Broken;
use crate::fingerprint::{self, Fingerprint};
use crate::key::{self, IdempotencyKey, KeyError};
use crate::local::{Begin, Handle, LocalError, Seen};
use crate::mcp::{self, Classified};
use crate::owner::OwnerToken;
use crate::problem::ProblemKind;
use crate::record::{Creator, Lifetimes, Record, Stage, State};
use crate::request::RequestHead;
use crate::scope::{CallerScope, StorageKey};
use crate::store::{ClaimReply, ReadReply, StoreError, StoredValue, TransitionReply, ValueError};

/// What the request does next. `release`: a local claim to free before answering.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Wait for the whole body, holding nothing; `seen`: the key's bucket as read now, which the
    /// claim at the body's end makes its first CAS on (`local::Table::begin_after`).
    WaitForBody { seen: Option<Seen> },
    /// Pause until the body, holding nothing: a local outcome-unknown the store is asked to
    /// settle once the fingerprint is known.
    PauseForBody,
    /// Send the store a claim-or-read, holding `handle` meanwhile.
    ClaimInStore { handle: Option<Handle>, fp: Fingerprint },
    /// Read (never claim) what the store holds for a key held here as outcome-unknown.
    ReadSettled { fp: Fingerprint },
    /// Forward under the claim(s) held, whose lock runs from `lock_from_ms` (the store claim's
    /// send, or now for the local tier's).
    Forward { handle: Option<Handle>, fp: Fingerprint, in_store: bool, lock_from_ms: u64 },
    /// Replay this record; `cache`: a local claim to complete with it first (a store replay).
    Replay { record: Record, cache: Option<Handle> },
    /// The key is in flight: 409, or held until its first attempt ends (`in_flight: "wait"`,
    /// which needs the fingerprint: before it, wait for the body).
    InFlight { creator: Option<Creator>, release: Option<Handle>, fp: Option<Fingerprint> },
    /// Answer with this problem.
    Reply { problem: ProblemKind, creator: Option<Creator>, release: Option<Handle> },
    /// The store's claim is stale and was forwarded: mark it outcome-unknown (owner-checked
    /// against `old_owner`), then answer outcome-unknown.
    MarkUnknown { old_owner: OwnerToken, creator: Creator, release: Option<Handle> },
    /// Replace the store's record (stale lock, or free) in one more round trip.
    TakeOver { handle: Option<Handle>, fp: Fingerprint, old: Box<StoredValue>, free: bool },
    /// The next round of an MCP call awaiting input (`record::Round::Next`): replace the
    /// awaiting value `old` with a claim of our own (`Transition::continue_round`), then forward.
    Continue { handle: Option<Handle>, fp: Fingerprint, old: Box<StoredValue> },
    /// The key holds a record that cannot be read: nothing was claimed; answer `problem`.
    Unreadable { why: ValueError, problem: ProblemKind, release: Option<Handle> },
    /// The local outcome-unknown stands (the store holds no record that settles it).
    UnknownStands { unreadable: Option<ValueError> },
    /// The local tier failed: 503.
    LocalFailed(LocalError),
    /// The store is unavailable with `on_unavailable: "pass"`: forward unprotected.
    PassUnprotected,
    /// A broken invariant: 503 `internal-state` (`failsafe::refuse`), never forward.
    FailClosed { broken: Broken, branch: &'static str, handle: Option<Handle> },
}

/// What a request paused on a store call does with its answer: something only that call's
/// context can do (send it again, release what it may have claimed), or a next `Step`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answered {
    /// Redis lacks the script: send the same call again with its script in full.
    Resend,
    /// The call's answer is lost or garbled: it may have landed; release it owner-checked, then
    /// answer as for a store failure.
    Lost {
        error: StoreError,
    },
    /// The store claimed the key for us, but its answer came too late for the claim's lock:
    /// released owner-checked and answered 503, never forwarded.
    TooLate {
        waited_ms: u64,
        lock_ms: u64,
        run_ms: u64,
    },
    Next(Step),
}

/// The store a request runs with: `None` without one, else its `on_unavailable`.
pub type StoreMode = Option<OnUnavailable>;

/// The local tier answered `begin` (`fp`: the fingerprint once the body is complete; `now_ms`:
/// this proxy's clock).
pub fn after_local(begun: Result<Begin, LocalError>, fp: Option<Fingerprint>, store: StoreMode, now_ms: u64) -> Step {
    match begun {
        Ok(Begin::Claimed { handle, .. }) => match fp {
            Some(fp) => after_fingerprint(Some(handle), fp, store, now_ms),
            // The local tier claims only with the fingerprint (at the body's end).
            None => Step::FailClosed {
                broken: Broken::ImpossibleDecision,
                branch: "claim_without_fingerprint",
                handle: Some(handle),
            },
        },
        // With a store, a local copy of an MCP call awaiting input is not the call's state: a
        // round run on another proxy since moved it on (another question, more rounds run), and
        // the copy would answer the round that follows with a stale question. The store's value
        // decides (`after_claim`), as for a key this proxy never saw. Only when a store failure
        // is answered 503 (`on_unavailable: "reject"`): under "pass" a failure would forward a
        // round that ran (the asking one, sent again) unprotected, so the local copy answers, as
        // for an unknown outcome above.
        Ok(Begin::Replay(record))
            if store == Some(OnUnavailable::Reject) && matches!(record.state, State::AwaitingInput(_)) =>
        {
            match fp {
                Some(fp) => Step::ClaimInStore { handle: None, fp },
                None => Step::PauseForBody,
            }
        }
        Ok(Begin::Replay(record)) => Step::Replay { record, cache: None },
        // With a store, the store settles a key whose outcome is unknown (an operator may have
        // released or completed it there): the local copy is asked again of the store. Only when
        // a store failure is answered 503 (`on_unavailable: "reject"`): under "pass" a failure
        // would forward the key unprotected, so the local answer stands.
        Ok(Begin::Reject { problem, .. }) if store == Some(OnUnavailable::Reject) && admin::store_settles(&problem) => {
            match fp {
                Some(fp) => Step::ReadSettled { fp },
                None => Step::PauseForBody,
            }
        }
        Ok(Begin::Reject { problem: ProblemKind::InFlight { .. }, creator, .. }) => {
            Step::InFlight { creator, release: None, fp }
        }
        Ok(Begin::Reject { problem, creator, .. }) => Step::Reply { problem, creator, release: None },
        Ok(Begin::NeedFingerprint { seen }) => Step::WaitForBody { seen },
        // With a store, the local tier is a cache: a full bucket only means no local copy.
        Ok(Begin::Full) if store.is_some() => match fp {
            Some(fp) => after_fingerprint(None, fp, store, now_ms),
            None => Step::WaitForBody { seen: None },
        },
        Ok(Begin::Full) => Step::Reply {
            problem: ProblemKind::CapacityExhausted { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS },
            creator: None,
            release: None,
        },
        Err(e) => Step::LocalFailed(e),
    }
}

/// The fingerprint is known and the local tier holds our claim (`handle`) or has no room: claim
/// in the store if there is one, else forward under the local claim.
pub fn after_fingerprint(handle: Option<Handle>, fp: Fingerprint, store: StoreMode, now_ms: u64) -> Step {
    match (store, handle) {
        (Some(_), handle) => Step::ClaimInStore { handle, fp },
        (None, Some(handle)) => Step::Forward { handle: Some(handle), fp, in_store: false, lock_from_ms: now_ms },
        // Without a store, the local tier always holds the claim it forwards under.
        (None, None) => {
            Step::FailClosed { broken: Broken::ImpossibleDecision, branch: "proceed_without_claim", handle }
        }
    }
}

/// A store call this request is paused on: what it holds and when it was sent (this proxy's
/// clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sent {
    pub handle: Option<Handle>,
    pub fp: Fingerprint,
    pub sent_at_ms: u64,
    /// An MCP call's round (`mcp::Call::round`): what an awaiting record answers it.
    pub round: Option<crate::record::RoundId>,
}

/// The store claimed the key for us: forward, unless the answer came so late that the claim's
/// lock may already be judged stale (`Lifetimes::answer_in_time`).
fn claimed(sent: &Sent, policy: &Policy, now_ms: u64) -> Answered {
    let lifetimes = Lifetimes::of(policy);
    let run_ms = match policy.forwarding {
        Forwarding::Detached { timeout_ms, .. } => timeout_ms,
        Forwarding::Router => 0,
    };
    if lifetimes.answer_in_time(sent.sent_at_ms, now_ms, run_ms) {
        Answered::Next(Step::Forward {
            handle: sent.handle,
            fp: sent.fp,
            in_store: true,
            lock_from_ms: sent.sent_at_ms,
        })
    } else {
        Answered::TooLate { waited_ms: now_ms.saturating_sub(sent.sent_at_ms), lock_ms: lifetimes.lock_ms, run_ms }
    }
}

/// The store answered our claim-or-read (`now_ms`: this proxy's clock; the record is judged by
/// the store's clock, which the answer carries).
pub fn after_claim(
    reply: Result<ClaimReply, StoreError>,
    sent: &Sent,
    policy: &Policy,
    on_unavailable: OnUnavailable,
    now_ms: u64,
) -> Answered {
    let (handle, fp) = (sent.handle, sent.fp);
    let (store_now, expires_at, value) = match reply {
        Ok(ClaimReply::Claimed { .. }) => return claimed(sent, policy, now_ms),
        Ok(ClaimReply::Exists { now_ms, expires_at_ms, value }) => (now_ms, expires_at_ms, value),
        // The key holds a record we cannot read: nothing was claimed, and it is no outage.
        Ok(ClaimReply::Unreadable { now_ms, why }) => {
            let problem = match decide(Lookup::Unreadable, Some(&sent.fp), now_ms, policy, on_unavailable) {
                Decision::Reject(p) => p,
                _ => ProblemKind::RecordUnreadable { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS },
            };
            return Answered::Next(Step::Unreadable { why, problem, release: handle });
        }
        // Nothing ran: the same call again, with the script.
        Ok(ClaimReply::NoScript) => return Answered::Resend,
        Err(error) => return Answered::Lost { error },
    };
    // Judged by the store's clock only: its now, the key's expiry, the lock's.
    let step = match decide(Lookup::Found(value.summary(expires_at)), Some(&fp), store_now, policy, on_unavailable) {
        // A completed record never changes: keep a copy so the next replay needs no store call,
        // ending with the store's key by this proxy's clock.
        // The next round of a call awaiting input continues it, owner-checked (one of two
        // rounds that read the same awaiting value does: the other is refused, in flight);
        // never past the record's own expiry (its tombstone: `key-expired`, as a replay).
        Decision::Replay
            if value.record.round(sent.round.as_ref()) == crate::record::Round::Next
                && !value
                    .record_on_clock(store_now, expires_at, now_ms)
                    .is_tombstone_for(policy.tombstone_seconds, now_ms) =>
        {
            Step::Continue { handle, fp, old: Box::new(value) }
        }
        Decision::Replay => {
            Step::Replay { record: value.record_on_clock(store_now, expires_at, now_ms), cache: handle }
        }
        Decision::Reject(ProblemKind::InFlight { .. }) => {
            Step::InFlight { creator: Some(value.record.creator), release: handle, fp: Some(fp) }
        }
        Decision::Reject(problem) => Step::Reply { problem, creator: Some(value.record.creator), release: handle },
        Decision::MarkUnknown => {
            Step::MarkUnknown { old_owner: value.owner, creator: value.record.creator, release: handle }
        }
        // A stale lock with `stale_lock: "takeover"`, or a record the store still holds that is
        // free (past its expiry, no live lock): replace it, owner-checked.
        Decision::TakeOver => Step::TakeOver { handle, fp, old: Box::new(value), free: false },
        Decision::Claim => Step::TakeOver { handle, fp, old: Box::new(value), free: true },
        // Neither can follow from a value read with a fingerprint: never forward on it.
        Decision::PassUnprotected | Decision::NeedFingerprint => {
            Step::FailClosed { broken: Broken::ImpossibleDecision, branch: "store_answer_decision", handle }
        }
    };
    Answered::Next(step)
}

/// The store answered our take-over.
pub fn after_take_over(
    reply: Result<TransitionReply, StoreError>,
    sent: &Sent,
    policy: &Policy,
    now_ms: u64,
) -> Answered {
    match reply {
        // A take-over never writes where the key is absent (`WhereAbsent::Refuse`).
        Ok(TransitionReply::Changed | TransitionReply::ClaimGoneRewritten) => claimed(sent, policy, now_ms),
        // Nothing was written: another request holds the key now (never held for a wait).
        Ok(TransitionReply::Refused | TransitionReply::Absent) => Answered::Next(Step::Reply {
            problem: ProblemKind::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS },
            creator: None,
            release: sent.handle,
        }),
        Ok(TransitionReply::NoScript) => Answered::Resend,
        Err(error) => Answered::Lost { error },
    }
}

/// The store answered the read of a key held here as outcome-unknown. Only a record settles it:
/// a completion is replayed, another request's claim running now is in flight; an absent key is
/// no proof the key never ran (the store may have lost or expired it), so the local
/// outcome-unknown stands, as it does when the store cannot be read.
pub fn after_settled_read(reply: Result<ReadReply, StoreError>, fp: &Fingerprint, mismatch_status: u16) -> Step {
    match reply {
        Ok(ReadReply::Unreadable(why)) => Step::UnknownStands { unreadable: Some(why) },
        Ok(ReadReply::Found(v)) if v.record.fingerprint != *fp => {
            Step::Reply { problem: ProblemKind::KeyReused { status: mismatch_status }, creator: None, release: None }
        }
        Ok(ReadReply::Found(v)) if v.phase == Stage::Completed => Step::Replay { record: v.record, cache: None },
        Ok(ReadReply::Found(v)) if v.phase == Stage::Forwarded => Step::Reply {
            problem: ProblemKind::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS },
            creator: None,
            release: None,
        },
        _ => Step::UnknownStands { unreadable: None },
    }
}

/// What a request paused on a store call asked: its answer is read as the answer to that
/// request, never re-derived from the local tier's state when the answer comes (a local
/// outcome-unknown record may expire between the headers and the end of the body, so the request
/// that reads the store for a settlement may end up claiming instead).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asked {
    /// Claim-or-read (`Step::ClaimInStore`).
    Claim,
    /// A take-over of a stale or free record (`Step::TakeOver`).
    TakeOver,
    /// A read of a key held here as outcome-unknown: only a record settles it (`Step::ReadSettled`).
    Settled,
}

/// The store's answer to the call a request is paused on, parsed by the glue.
#[derive(Clone, Debug)]
pub enum StoreAnswer {
    Claim(Result<ClaimReply, StoreError>),
    TakeOver(Result<TransitionReply, StoreError>),
    Settled(Result<ReadReply, StoreError>),
}

impl StoreAnswer {
    /// What was asked.
    pub fn asked(&self) -> Asked {
        match self {
            StoreAnswer::Claim(_) => Asked::Claim,
            StoreAnswer::TakeOver(_) => Asked::TakeOver,
            StoreAnswer::Settled(_) => Asked::Settled,
        }
    }
}

/// The store answered the call `sent` (`now_ms`: this proxy's clock): what the request does next.
pub fn after_store_answer(
    answer: StoreAnswer,
    sent: &Sent,
    policy: &Policy,
    on_unavailable: OnUnavailable,
    now_ms: u64,
) -> Answered {
    match answer {
        StoreAnswer::Claim(reply) => after_claim(reply, sent, policy, on_unavailable, now_ms),
        StoreAnswer::TakeOver(reply) => after_take_over(reply, sent, policy, now_ms),
        StoreAnswer::Settled(reply) => Answered::Next(after_settled_read(reply, &sent.fp, policy.mismatch_status)),
    }
}

/// The store could not be asked or did not answer: 503 (`reject`) or forward unprotected (`pass`).
pub fn after_store_failure(policy: &Policy, on_unavailable: OnUnavailable) -> Step {
    match decide(Lookup::StoreError, None, 0, policy, on_unavailable) {
        Decision::PassUnprotected => Step::PassUnprotected,
        Decision::Reject(problem) => Step::Reply { problem, creator: None, release: None },
        _ => Step::FailClosed { broken: Broken::ImpossibleDecision, branch: "store_failed_decision", handle: None },
    }
}

/// How a protected request's key was had.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyFrom {
    /// The key header (or, for an MCP call, the body).
    Sent,
    /// Derived at the edge now (`derive_key`): the glue adds it to the request's headers.
    Derived,
    /// Derivable, but from the body too (`derive_key.include_body`): the key given is the one
    /// without the body, replaced at the body's end (`at_body_end`).
    DerivedAtBody,
}

/// A request the headers protect: its route, policy, scope, key and storage key (for a key
/// derived at the body's end, the provisional one, replaced then: `AtBodyEnd`).
#[derive(Clone, Debug)]
pub struct Admitted {
    pub route: usize,
    pub policy: Arc<Policy>,
    pub scope: CallerScope,
    pub key: IdempotencyKey,
    pub skey: StorageKey,
    pub from: KeyFrom,
}

impl Admitted {
    /// A key derived at the edge now (`KeyFrom::Derived`) goes upstream with the request: added
    /// to `head` as a line of the key header, and returned (the header's name, the key) for the
    /// host to set in its header map. `None`: nothing to add.
    pub fn add_derived_key(&self, head: &mut RequestHead) -> Option<(&str, &str)> {
        if self.from != KeyFrom::Derived {
            return None;
        }
        head.headers.push((self.policy.header.clone(), self.key.as_str().as_bytes().to_vec()));
        Some((&self.policy.header, self.key.as_str()))
    }
}

/// Why the request headers leave a request unprotected, or refuse it (`at_headers`).
#[derive(Clone, Debug)]
pub enum NotProtected {
    /// No route protects it: continue untouched.
    Pass,
    /// A route was selected, but the request is not protected (no key where none is required,
    /// an MCP request without a body or not a POST): continue untouched.
    Unprotected { route: usize },
    /// Two routes match the request: 400 `route-ambiguous` (logged with both).
    RouteAmbiguous { first: usize, other: usize },
    /// The route selected has no policy: cannot happen, fail closed.
    PolicyMissing { route: usize },
    /// A POST on an MCP route: only its whole body says whether it is protected.
    McpBody { route: usize, policy: Arc<Policy> },
    /// A gRPC call on a route with `grpc: "pass"`: continue, counted.
    GrpcPassed { route: usize },
    /// Refused before anything is held (a missing or malformed key, no scope, gRPC with a key).
    Refuse { route: usize, problem: ProblemKind },
}

impl NotProtected {
    /// The route selected, the label of per-route counters.
    pub fn route(&self) -> Option<usize> {
        match self {
            NotProtected::Pass | NotProtected::RouteAmbiguous { .. } => None,
            NotProtected::PolicyMissing { route }
            | NotProtected::Unprotected { route }
            | NotProtected::McpBody { route, .. }
            | NotProtected::GrpcPassed { route }
            | NotProtected::Refuse { route, .. } => Some(*route),
        }
    }
}

/// The request headers' step: route selection, admission, scope and key (given or derived); the
/// request protected, or why not (`head`: the whole header map; `route_name`: Envoy's route name,
/// read only when `config.uses_route_names()`; `end_of_stream`: no body follows). The method is
/// checked first by the glue (`Config::protects_method`), which reads it alone when there is no
/// body.
pub fn at_headers(
    config: &Config,
    head: &RequestHead,
    route_name: Option<&str>,
    end_of_stream: bool,
) -> Result<Admitted, NotProtected> {
    let route = match config.select_route(&head.method, &head.path, route_name) {
        Selection::Policy(i) => i,
        Selection::Unprotected => return Err(NotProtected::Pass),
        Selection::Ambiguous { first, other } => return Err(NotProtected::RouteAmbiguous { first, other }),
    };
    // The one place a route's index becomes its policy: from here on the request carries it.
    let Some(policy) = config.shared_policy(route) else { return Err(NotProtected::PolicyMissing { route }) };
    // gRPC: a replay cannot be faithful (Envoy reshapes every local reply to a gRPC request
    // into a trailers-only status), so such calls are refused with a key (below) or, with
    // `grpc: "pass"`, not idemgate's at all.
    let grpc = head.is_grpc();
    // MCP: only the body says whether this is a protected tools/call. A request without one
    // (GET streams, DELETE) is no tool call. A gRPC content-type is no exception: a server that
    // does not check the type runs a tools/call sent as `application/grpc, application/json`
    // (a protected call under such a type is refused, `at_mcp_body`).
    if policy.mcp.is_some() {
        if end_of_stream || !head.method.eq_ignore_ascii_case("POST") {
            return Err(NotProtected::Unprotected { route });
        }
        return Err(NotProtected::McpBody { route, policy });
    }
    if grpc && policy.grpc == GrpcMode::Pass {
        return Err(NotProtected::GrpcPassed { route });
    }
    let key_values = head.values(&policy.header);
    // No key and nothing to derive one from: decided without hashing the caller.
    if policy.derive_key.is_none() && key_values.is_empty() {
        return match admit(Some(&policy), &[]) {
            Admission::Reject(problem) => Err(NotProtected::Refuse { route, problem }),
            _ => Err(NotProtected::Unprotected { route }),
        };
    }
    let scope = CallerScope::of(head, &policy.scope);
    // A request without a key but with the operation's identifiers gets a key derived at
    // the edge (opt-in); with include_body, once the body is here.
    let derive = if key_values.is_empty() { policy.derive_key.as_ref() } else { None };
    if let Some(name) = derive.and_then(|d| derive::repeated_header(head, d)) {
        let problem = ProblemKind::KeyInvalid {
            header: name.to_string(),
            error: crate::key::KeyError::Repeated,
            syntax: policy.key_syntax,
            max_len: policy.key_max_length,
        };
        return Err(NotProtected::Refuse { route, problem });
    }
    let derive_at_body = derive.is_some_and(|d| d.include_body) && !end_of_stream;
    let derived = match derive {
        // Whether it can be derived is known now (headers, scope); the key itself later.
        Some(d) if derive_at_body => {
            derive::derive(head, &DeriveKey { include_body: false, ..d.clone() }, &policy.fingerprint, &scope, None)
        }
        Some(d) => {
            // An empty body is no JSON: never refused, but by the one rule if it were.
            let empty = if d.include_body {
                match fingerprint::derive_body_digest(head, b"") {
                    Ok(digest) => Some(digest),
                    Err(_) => return Err(NotProtected::Refuse { route, problem: ProblemKind::BodyAmbiguous }),
                }
            } else {
                None
            };
            derive::derive(head, d, &policy.fingerprint, &scope, empty.as_ref())
        }
        None => None,
    };
    // A gRPC call with a key (sent, valid or not, or derivable): refused before anything
    // executes; a malformed key is answered as such first.
    if grpc && (derived.is_some() || matches!(admit(Some(&policy), &key_values), Admission::Protect(_))) {
        return Err(NotProtected::Refuse {
            route,
            problem: ProblemKind::GrpcUnsupported { header: policy.header.clone() },
        });
    }
    let (key, from) = match derived {
        Some(k) if derive_at_body => (k, KeyFrom::DerivedAtBody),
        Some(k) => (k, KeyFrom::Derived),
        None => match admit(Some(&policy), &key_values) {
            Admission::Pass => return Err(NotProtected::Unprotected { route }),
            Admission::Reject(problem) => return Err(NotProtected::Refuse { route, problem }),
            Admission::Protect(k) => (k, KeyFrom::Sent),
        },
    };
    // A key from a caller none of the scope headers identify: refused unless the operator
    // chose a shared anonymous scope (a key is only ever derived for an identified caller, so
    // a derived key is never refused here).
    if let Err(problem) = scope.admits(&policy.scope) {
        return Err(NotProtected::Refuse { route, problem });
    }
    let skey = StorageKey::derive(&policy.namespace, &scope, &key);
    Ok(Admitted { route, policy, scope, key, skey, from })
}

/// A chunk of a body the filter buffers (`body_size`: the bytes so far; `budgeted`: the bytes
/// this request counts against the VM's budget; `vm_buffered`: the VM's count now): the bytes
/// to add to the VM's count, or the refusal (413 over the route's limit, 503 over the VM's).
pub fn body_chunk(
    body_size: u64,
    budgeted: u64,
    vm_buffered: u64,
    max_buffered: u64,
    policy: &Policy,
) -> Result<u64, ProblemKind> {
    check_body_size(body_size, policy)?;
    // Per-VM budget of buffered bytes: many concurrent large bodies get a 503, not an OOM.
    let delta = body_size.saturating_sub(budgeted);
    if vm_buffered.saturating_add(delta) > max_buffered {
        return Err(ProblemKind::BufferBudgetExceeded { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS });
    }
    Ok(delta)
}

/// A protected request's whole body is here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AtBodyEnd {
    /// The key was to be derived with the body and cannot be: the request is not protected.
    Pass,
    /// The key was to be derived with the body, and the body has no one meaning to derive it
    /// from (`body-ambiguous`: JSON naming a member twice): refused, nothing forwarded or claimed.
    Refuse(ProblemKind),
    /// The fingerprint; `derived`: the key derived with the body (`KeyFrom::DerivedAtBody`);
    /// `keep_body`: the body is kept for the root to send (`forwarding: "detached"`).
    Fingerprinted { fp: Fingerprint, derived: Option<Derived>, keep_body: bool },
}

/// A key derived at the body's end, and the storage key it makes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Derived {
    pub key: IdempotencyKey,
    pub skey: StorageKey,
}

/// The body step: the fingerprint once the body is whole (`head` with its trailers), and the
/// key when it is derived from the body (`derive_at_body`), added to `head` (which the
/// fingerprint then reads, as the upstream does).
pub fn at_body_end(
    policy: &Policy,
    head: &mut RequestHead,
    scope: &CallerScope,
    derive_at_body: bool,
    body: &[u8],
) -> AtBodyEnd {
    // Taken once, for the fingerprint and for a key derived from the body.
    let digest = fingerprint::body_digest(head, body, &policy.fingerprint);
    let mut derived = None;
    if derive_at_body {
        // `{"a":1,"a":2}` runs as `{"a":2}` on most JSON readers and as `{"a":1}` on others
        // (pysimdjson's `Parser().parse`): a key derived from either value lets one of them
        // run two requests it reads as one under two keys.
        let Ok(body_digest) = fingerprint::derive_body_digest(head, body) else {
            return AtBodyEnd::Refuse(ProblemKind::BodyAmbiguous);
        };
        let Some(key) = policy
            .derive_key
            .as_ref()
            .and_then(|d| derive::derive(head, d, &policy.fingerprint, scope, Some(&body_digest)))
        else {
            return AtBodyEnd::Pass;
        };
        head.headers.push((policy.header.clone(), key.as_str().as_bytes().to_vec()));
        let skey = StorageKey::derive(&policy.namespace, scope, &key);
        derived = Some(Derived { key, skey });
    }
    let fp = Fingerprint::of_digest(head, digest, &policy.fingerprint).0;
    let keep_body = matches!(policy.forwarding, Forwarding::Detached { .. });
    AtBodyEnd::Fingerprinted { fp, derived, keep_body }
}

/// A protected MCP `tools/call`: its JSON-RPC id, tool, scope, key and body digest.
#[derive(Clone, Debug)]
pub struct McpCall {
    /// The JSON-RPC id (JSON text) every reply to it carries.
    pub id: Vec<u8>,
    pub tool: String,
    pub scope: CallerScope,
    pub key: IdempotencyKey,
    pub skey: StorageKey,
    /// The key was derived (`derive_key`, always with the body's digest).
    pub derived: bool,
    /// The digest of the fingerprint's body material: tool name and canonical arguments.
    pub digest: [u8; 32],
    /// Which round of its call (`mcp::Call::round`), outside the fingerprint.
    pub round: crate::record::RoundId,
    /// What a derived key is derived from: that material's semantic form (`mcp::Call`).
    pub derive_digest: [u8; 32],
}

/// What an MCP POST's whole body decides.
#[derive(Clone, Debug)]
pub enum AtMcpBody {
    /// Not a protected call (or no key and none required): passed untouched.
    Pass,
    /// The route's policy has no MCP part: cannot happen, fail closed.
    PolicyMissing,
    /// Refused as a JSON-RPC error to `id` (`batch`: the ids of a refused batch's requests).
    Refuse { id: Vec<u8>, batch: Vec<Vec<u8>>, problem: ProblemKind },
    /// A protected call.
    Protect(Box<McpCall>),
}

/// The MCP body step: a protected `tools/call` is protected as an HTTP request with a key is;
/// the key is the header's, then the body's (`_meta`, a named argument), then derived.
pub fn at_mcp_body(policy: &Policy, head: &RequestHead, body: &[u8]) -> AtMcpBody {
    let Some(mcp) = policy.mcp.as_ref() else { return AtMcpBody::PolicyMissing };
    let null = || b"null".to_vec();
    // 2026-07-28's routing headers name the message; one that disagrees with the body is refused
    // before anything reads either (a router or server going by the headers would run another
    // call than the one protected).
    let (method, name) = (head.values(mcp::METHOD_HEADER), head.values(mcp::NAME_HEADER));
    let call = match mcp::classify_sent(body, mcp, &method, &name) {
        Classified::HeaderMismatch(header) => {
            let id = mcp::request_id(body).unwrap_or_else(null);
            return AtMcpBody::Refuse { id, batch: vec![], problem: ProblemKind::McpHeaderMismatch { header } };
        }
        Classified::Pass => return AtMcpBody::Pass,
        Classified::Batch(ids) => {
            return AtMcpBody::Refuse { id: null(), batch: ids, problem: ProblemKind::McpBatchRefused }
        }
        Classified::Ambiguous => {
            return AtMcpBody::Refuse { id: null(), batch: vec![], problem: ProblemKind::McpBodyAmbiguous }
        }
        Classified::Call(c) => c,
    };
    let refuse = |problem| AtMcpBody::Refuse { id: call.id.clone(), batch: vec![], problem };
    // A protected call under a gRPC content-type: read two ways (gRPC here, JSON by a server
    // that does not check the type), never forwarded, with or without a key.
    if head.is_grpc() {
        return refuse(ProblemKind::McpBodyAmbiguous);
    }
    let key_values = head.values(&policy.header);
    let scope = CallerScope::of(head, &policy.scope);
    let key = if !key_values.is_empty() {
        match admit(Some(policy), &key_values) {
            Admission::Protect(k) => Some(k),
            Admission::Reject(p) => return refuse(p),
            Admission::Pass => None,
        }
    } else if let Some(k) = call.key.as_ref() {
        let parsed = k
            .value
            .as_deref()
            .ok_or(KeyError::MalformedString)
            .and_then(|v| key::parse_key(v.as_bytes(), policy.key_max_length, policy.key_syntax));
        match parsed {
            Ok(k) => Some(k),
            Err(error) => {
                return refuse(ProblemKind::KeyInvalid {
                    header: k.source.clone(),
                    error,
                    syntax: policy.key_syntax,
                    max_len: policy.key_max_length,
                })
            }
        }
    } else {
        None
    };
    let (key, derived) = match key {
        Some(k) => (k, false),
        None => {
            // A header the key is derived from, sent on several lines: refused, as at headers.
            if let Some(name) = policy.derive_key.as_ref().and_then(|d| derive::repeated_header(head, d)) {
                return refuse(ProblemKind::KeyInvalid {
                    header: name.to_string(),
                    error: crate::key::KeyError::Repeated,
                    syntax: policy.key_syntax,
                    max_len: policy.key_max_length,
                });
            }
            match mcp_derived_key(policy, head, &scope, &call.derive_digest) {
                Some(k) => (k, true),
                None => {
                    return match admit(Some(policy), &[]) {
                        Admission::Reject(p) => refuse(p),
                        _ => AtMcpBody::Pass,
                    }
                }
            }
        }
    };
    // A key is only ever derived for an identified caller: a derived key is never refused here.
    if let Err(p) = scope.admits(&policy.scope) {
        return refuse(p);
    }
    let skey = StorageKey::derive(&policy.namespace, &scope, &key);
    AtMcpBody::Protect(Box::new(McpCall {
        id: call.id,
        tool: call.tool,
        scope,
        key,
        skey,
        derived,
        digest: call.digest,
        round: call.round,
        derive_digest: call.derive_digest,
    }))
}

/// The fingerprint of a protected request that has no body, from its headers as forwarded
/// (after the glue's edits: a derived key added, the router's retry headers removed).
pub fn fingerprint_without_body(policy: &Policy, head: &RequestHead) -> Fingerprint {
    Fingerprint::compute(head, b"", &policy.fingerprint).0
}

/// The key `derive_key` gives an MCP call that carries none: derived from its head and caller
/// scope and the digest of its tool and arguments as JSON parsers read them
/// (`McpCall::derive_digest`), whatever the
/// route's `include_body` says (the call is in the body).
fn mcp_derived_key(
    policy: &Policy,
    head: &RequestHead,
    scope: &CallerScope,
    digest: &[u8; 32],
) -> Option<IdempotencyKey> {
    let d = DeriveKey { include_body: true, ..policy.derive_key.clone()? };
    derive::derive(head, &d, &policy.fingerprint, scope, Some(digest))
}

/// The storage key under which a stream Envoy re-created for an internal redirect of a protected
/// MCP call (`call`, as the re-created stream read it) finds the claim its first stream handed
/// over: the call's key in the scope of the URL redirected from (`first_hop_scope`). A key the
/// call carries (header, `_meta`, arguments) is re-sent with it; a derived key is derived again
/// as the first stream derived it, at the URL redirected from (`first_hop_head`: the path and the
/// authority are part of it), or the re-created stream would never find its claim.
pub fn mcp_first_hop_skey(
    policy: &Policy,
    head: &RequestHead,
    original_url: &[u8],
    call: &McpCall,
) -> Option<StorageKey> {
    let scope = first_hop_scope(policy, head, original_url);
    let key = if call.derived {
        mcp_derived_key(policy, &first_hop_head(head, original_url), &scope, &call.derive_digest)?
    } else {
        call.key.clone()
    };
    Some(StorageKey::derive(&policy.namespace, &scope, &key))
}

/// The fingerprint of a protected MCP call: its headers as forwarded and the digest of its tool
/// and canonical arguments (`McpCall::digest`).
pub fn mcp_fingerprint(policy: &Policy, head: &RequestHead, digest: [u8; 32]) -> Fingerprint {
    Fingerprint::of_digest(head, (fingerprint::BodyForm::CanonicalJson, digest), &policy.fingerprint).0
}

/// Who made a record, as a 409 names it: the request's `x-request-id` and its `log_headers`.
pub fn creator_of(policy: &Policy, head: &RequestHead) -> Creator {
    let first = |name: &str| head.values(name).first().map(|v| String::from_utf8_lossy(v).into_owned());
    Creator {
        request_id: first("x-request-id").unwrap_or_default(),
        log_values: policy.log_headers.iter().filter_map(|h| first(h).map(|v| (h.clone(), v))).collect(),
    }
}

/// A request re-created by an internal redirect: the storage key of the claim it may take over
/// under `policy` (its key and scope read from its headers as at the first request's), or
/// `None` when its headers protect nothing.
pub fn redirected_claim(policy: &Policy, head: &RequestHead, original_url: &[u8]) -> Option<(CallerScope, StorageKey)> {
    let Admission::Protect(key) = admit(Some(policy), &head.values(&policy.header)) else { return None };
    let scope = first_hop_scope(policy, head, original_url);
    let skey = StorageKey::derive(&policy.namespace, &scope, &key);
    Some((scope, skey))
}

/// The head of the request a stream re-created for an internal redirect continues: its own
/// (Envoy re-sends the first stream's headers and body) at the URL it was redirected from
/// (`original_url`: its authority and path, when it names them).
pub fn first_hop_head(head: &RequestHead, original_url: &[u8]) -> RequestHead {
    let mut first = head.clone();
    if let Some(a) = crate::redirect::original_authority(original_url) {
        first.authority = a.to_string();
    }
    if let Some(p) = crate::redirect::original_path(original_url) {
        first.path = p.to_string();
    }
    first
}

/// The caller scope of the request a stream re-created for an internal redirect continues: its
/// own headers (Envoy re-sends the first stream's), under the `:authority` of the URL it was
/// redirected from (`original_url`, Envoy's `x-envoy-original-url`: `http[s]://authority/path`),
/// which a redirect to another host changes. A claim is only taken where that URL names the
/// claim's request exactly (`redirect::Handoffs::take`), so this is the first stream's scope.
pub fn first_hop_scope(policy: &Policy, head: &RequestHead, original_url: &[u8]) -> CallerScope {
    match crate::redirect::original_authority(original_url) {
        Some(a) if a != head.authority => {
            CallerScope::of(&RequestHead { authority: a.to_string(), ..head.clone() }, &policy.scope)
        }
        _ => CallerScope::of(head, &policy.scope),
    }
}

#[cfg(test)]
mod steps_tests;
#[cfg(test)]
mod tests;
