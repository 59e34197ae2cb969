//! The HTTP context: one per request. A small state machine over the core:
//!
//! ```text
//! headers ─(unprotected)─▶ pass          admit: 400 ─▶ answered
//!    │ local begin (no fingerprint yet): claim ─▶ Waiting{claim} | 409 | Waiting{no claim}
//! body end: fingerprint
//!    │ Waiting{claim}: mark forwarded locally     Waiting{no claim}: local begin(fp): replay | 409 | 422 | claim
//!    │ no store: ─▶ Forwarded
//!    │ store: claim-or-read (one round trip) ─▶ Claiming ─▶ Forwarded | replay | 409 | 422 | 503 | pass
//! response: copied while it flows
//! on_log: Forwarded ─▶ classify ─▶ complete | release | unknown (local now; store writes via the root)
//! ```

use std::cell::Cell;
use std::rc::Rc;

use log::{debug, error, info, warn};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use super::host::{self, Counter, HostShared};
use super::meter;
use super::settle::{self, Claim};
use super::stores::{self, Unbuilt};
use super::writes;
use super::{reply, Forward, Shared, Waiter};
use crate::admin;
use crate::config::{Forwarding, GrpcMode, InFlight, OnUnavailable, Policy, Selection};
use crate::decision::{admit, check_body_size, classify_routed, decide, Admission, Decision, Exchange, Lookup};
use crate::decision::{IN_FLIGHT_RETRY_AFTER_SECONDS, UNAVAILABLE_RETRY_AFTER_SECONDS};
use crate::derive;
use crate::failsafe::{self, Broken, Holding};
use crate::fingerprint::{self, Fingerprint};
use crate::local::{Begin, Handle, LocalError};
use crate::owner::OwnerToken;
use crate::problem::ProblemKind;
use crate::record::{Creator, Lifetimes, Record, State, StoredResponse};
use crate::redirect::{self, Handoff};
use crate::request::{RequestHead, ROUTER_RETRY_CAP};
use crate::scope::{CallerScope, StorageKey};
use crate::store::{self, ClaimReply, StoreError, StoredValue, Transition, TransitionReply};

pub(super) use crate::record::NOT_REPLAYED;

enum Phase {
    /// Not protected, or forwarded unprotected: every callback continues.
    Pass,
    /// Protected; waiting for the whole body (a local claim is held if `handle` is set).
    Waiting { handle: Option<Handle> },
    /// A store call is in flight (claim-or-read, or a take-over), sent at `sent_at_ms` (this
    /// proxy's clock); the request is paused.
    Calling { handle: Option<Handle>, fp: Fingerprint, token: u32, asked: Asked, sent_at_ms: u64 },
    /// Forwarded upstream under our claim(s).
    Forwarded { handle: Option<Handle>, fp: Fingerprint, in_store: bool },
    /// Sent upstream by the root context (`forwarding: "detached"`); the root answers.
    Detached,
    /// Held until the first attempt with this key finishes (`in_flight: "wait"`); the root answers.
    Held,
    /// We answered locally (problem or replay): never store our own reply.
    Answered,
    /// A POST on an MCP route (`protocol: "mcp"`): whether it is protected is known only from
    /// its whole body (`mcp_body_complete`); nothing is held yet.
    McpBody,
}

/// Which store request a paused request sent: its answer is read as the answer to that request,
/// never re-derived from the local tier's state when the answer comes (a local outcome-unknown
/// record may expire between the headers and the end of the body, so the request that reads the
/// store for a settlement may end up claiming instead).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Asked {
    /// Claim-or-read (`stores::claim_request`).
    Claim,
    /// A take-over of a stale or free record (`Transition::take_over`).
    TakeOver,
    /// A read of a key held here as outcome-unknown: only a record settles it.
    Settled,
}

struct Protected {
    policy_index: usize,
    head: RequestHead,
    skey: StorageKey,
    scope: CallerScope,
    creator: Creator,
    owner: OwnerToken,
    /// The key is derived at the end of the body (`derive_key.include_body`).
    derive_at_body: bool,
    /// An MCP `tools/call`: its JSON-RPC id (JSON text).
    mcp: Option<Vec<u8>>,
}

pub struct Http {
    shared: Rc<Shared>,
    context_id: u32,
    phase: Phase,
    /// The request body, kept for detached forwarding.
    body: Vec<u8>,
    req: Option<Protected>,
    /// Bytes of request body this context has counted against the VM's budget.
    budgeted: u64,
    body_size: usize,
    response: Option<StoredResponse>,
    response_too_large: bool,
    response_complete: bool,
    /// The outcome was left in Envoy's filter state (`publish`): once per request.
    published: bool,
    /// A stream Envoy re-created for an internal redirect, continuing a handed-over claim.
    redirected: bool,
    /// The selected policy, for per-route counters (known before `req` is).
    policy_index: Option<usize>,
    /// The store call in flight (`Phase::Calling`), kept to send again with its script in full
    /// if Redis answers NOSCRIPT.
    sent: Option<store::StoreRequest>,
    /// `store.kind: "etcd"`: the value the claim-or-read found and its revision, which a
    /// take-over or stale-to-unknown decided on it compares.
    fence: Option<crate::etcd::Fence>,
    /// The host's clock, read at most once per callback (`now`; cleared as each callback starts).
    clock: Cell<Option<u64>>,
    /// `Phase::McpBody`: the request's headers, until its body says whether it is protected.
    mcp_head: Option<RequestHead>,
}

/// Fault tests only (feature `crash-injection`, never in the shipped module): traps the VM at
/// `point` when the protected request carries `x-idemgate-test-crash: <point>`.
#[cfg(feature = "crash-injection")]
fn crash_point(req: Option<&Protected>, point: &str) {
    if req.is_some_and(|r| r.head.values("x-idemgate-test-crash").first().is_some_and(|v| *v == point.as_bytes())) {
        std::process::abort();
    }
}

#[cfg(not(feature = "crash-injection"))]
fn crash_point(_req: Option<&Protected>, _point: &str) {}

/// Fault tests only (feature `crash-injection`, never in the shipped module): breaks one of the
/// filter's own invariants at `point` when the protected request carries
/// `x-idemgate-test-fault: <point>`, so a test can show the branch that meets it fails closed.
#[cfg(feature = "crash-injection")]
fn fault_point(req: Option<&Protected>, point: &str) -> bool {
    req.is_some_and(|r| r.head.values("x-idemgate-test-fault").first().is_some_and(|v| *v == point.as_bytes()))
}

#[cfg(not(feature = "crash-injection"))]
fn fault_point(_req: Option<&Protected>, _point: &str) -> bool {
    false
}

/// The outcome of a protected request whose client left before it was forwarded or answered.
const ABANDONED: &str = "abandoned";

/// A policy index that selects no policy (what `fault_point` breaks).
const NO_POLICY: usize = usize::MAX;

/// Applies `RequestHead::forbid_router_retries` to the request Envoy forwards: false if the host
/// refused a change (the request must then not be forwarded).
fn forbid_router_retries(head: &mut RequestHead) -> bool {
    let removed = head.forbid_router_retries();
    let mut ok = true;
    for name in removed {
        ok &= host::set_header(MapType::HttpRequestHeaders, &name, None);
    }
    let (cap, zero) = ROUTER_RETRY_CAP;
    ok && host::set_header(MapType::HttpRequestHeaders, cap, Some(zero))
}

impl Http {
    pub fn new(shared: Rc<Shared>, context_id: u32) -> Http {
        Http {
            shared,
            context_id,
            phase: Phase::Pass,
            body: vec![],
            req: None,
            budgeted: 0,
            body_size: 0,
            response: None,
            response_too_large: false,
            response_complete: false,
            published: false,
            redirected: false,
            policy_index: None,
            sent: None,
            fence: None,
            clock: Cell::new(None),
            mcp_head: None,
        }
    }

    /// The time now, in ms: one clock read per callback, every decision of the callback made
    /// with it.
    fn now(&self) -> u64 {
        if let Some(t) = self.clock.get() {
            return t;
        }
        let t = host::now_ms();
        self.clock.set(Some(t));
        t
    }

    /// Callback `c` starts: the clock is read again when it is first needed.
    fn callback(&self, c: meter::Callback) {
        meter::callback(c);
        self.clock.set(None);
        host::set_current_context(self.context_id);
    }

    fn policy(&self) -> Option<&Policy> {
        let i = self.req.as_ref()?.policy_index;
        self.shared.config.policy_at(i)
    }

    /// The one place a protected request's end is told to Envoy: its outcome slug and storage key
    /// go to the filter state an access log prints (`host::publish`). The first call wins.
    fn publish(&mut self, outcome: &str) {
        if self.published {
            return;
        }
        self.published = true;
        let key = self.req.as_ref().filter(|r| !r.derive_at_body).map(|r| &r.skey);
        host::publish(outcome, key);
    }

    fn count(&self, c: Counter) {
        self.shared.metrics.inc_for(c, self.policy_index);
    }

    /// A stored value that could not be read or verified: a seal that does not verify is counted
    /// on its own (`record_unauthentic`: tampering, a transplanted value, or a proxy without the
    /// secret the record was written with) and logged with the key's hash.
    fn count_unreadable(&self, why: &store::ValueError) {
        if why.is_unauthentic() {
            self.count(Counter::RecordUnauthentic);
            warn!("{}", self.log_line("record_unauthentic", &format!("error={why}")));
        }
    }

    fn log_line(&self, outcome: &str, extra: &str) -> String {
        let Some(r) = self.req.as_ref() else { return format!("idemgate: outcome={outcome} {extra}") };
        let mut line = format!(
            "idemgate: outcome={outcome} key={} scope={} method={} path={} request_id={}",
            r.skey.hex(),
            r.scope.short(),
            r.head.method,
            r.head.path_without_query(),
            r.creator.request_id
        );
        for (n, v) in &r.creator.log_values {
            line.push_str(&format!(" {n}={v}"));
        }
        if !extra.is_empty() {
            line.push(' ');
            line.push_str(extra);
        }
        line
    }

    /// Sends a problem (and never stores it).
    fn answer(&mut self, problem: ProblemKind, creator: Option<&Creator>) -> Action {
        let counter = match &problem {
            ProblemKind::KeyMissing { .. } => Counter::MissingKey,
            ProblemKind::KeyInvalid { .. } => Counter::InvalidKey,
            ProblemKind::ScopeMissing { .. } => Counter::ScopeMissing,
            ProblemKind::BodyTooLarge { .. } => Counter::BodyTooLarge,
            ProblemKind::InFlight { .. } => Counter::InFlightConflict,
            ProblemKind::OutcomeUnknown => Counter::UnknownOutcome,
            ProblemKind::KeyReused { .. } => Counter::Mismatch,
            ProblemKind::CapacityExhausted { .. } => Counter::LocalFull,
            ProblemKind::BufferBudgetExceeded { .. } => Counter::BufferBudgetExceeded,
            ProblemKind::StoreUnavailable { .. } => Counter::StoreUnavailable,
            ProblemKind::RecordUnreadable { .. } => Counter::RecordUnreadable,
            ProblemKind::ResponseNotStored { .. } => Counter::Replayed,
            ProblemKind::UpstreamNoAnswer => Counter::UnknownOutcome,
            ProblemKind::EncodingNotAccepted { .. } => Counter::ReplaysEncodingNotAccepted,
            ProblemKind::InternalState { .. } => Counter::InternalErrors,
            ProblemKind::GrpcUnsupported { .. } => Counter::GrpcRefused,
            ProblemKind::RouteAmbiguous => Counter::RouteAmbiguous,
            ProblemKind::McpBatchRefused | ProblemKind::McpBodyAmbiguous => Counter::McpRefused,
        };
        self.count(counter);
        let by = creator.map_or(String::new(), |c| {
            let mut s = format!("created_by_request_id={}", c.request_id);
            for (n, v) in &c.log_values {
                s.push_str(&format!(" created_by_{n}={v}"));
            }
            s
        });
        info!("{}", self.log_line(problem.slug(), &by));
        let request_id = self.req.as_ref().map_or_else(
            || host::header(MapType::HttpRequestHeaders, "x-request-id").unwrap_or_default(),
            |r| r.creator.request_id.clone(),
        );
        self.phase = Phase::Answered;
        self.publish(problem.slug());
        reply::problem(&problem, &request_id, creator);
        Action::Pause
    }

    /// This proxy holds the key as outcome-unknown: read (never claim) what the store holds, in
    /// case an operator settled it there.
    fn read_settled(&mut self, fp: Fingerprint) -> Action {
        let Some(r) = self.req.as_ref() else {
            return self.fail_closed(Broken::RequestMissing, "read_settled", None, Holding::Nothing);
        };
        let req = stores::read_request(&self.shared, &r.skey);
        self.call(req, None, fp, Asked::Settled)
    }

    /// The store's answer for a key held here as outcome-unknown. Only a record settles it: a
    /// completion is replayed, another request's claim running now is in flight; an absent key
    /// is no proof the key never ran (the store may have lost or expired it), so the local
    /// outcome-unknown stands, as it does when the store cannot be read.
    fn settled_answer(&mut self, fp: Fingerprint, status: Option<u16>, body: &[u8]) -> Action {
        let reply = match (self.req.as_ref(), self.shared.seal.as_ref()) {
            (Some(r), Some(seal)) => stores::parse_read(&self.shared, status, body, &r.skey, seal, self.now()),
            _ => Err(StoreError::Garbled("a read answer without its request or seal".into())),
        };
        match reply {
            Ok(store::ReadReply::Unreadable(why)) => {
                self.count_unreadable(&why);
                self.count(Counter::UnknownOutcome);
                self.answer(ProblemKind::OutcomeUnknown, None)
            }
            Ok(store::ReadReply::Found(v)) if v.record.fingerprint != fp => {
                let status = self.policy().map_or(422, |p| p.mismatch_status);
                self.answer(ProblemKind::KeyReused { status }, None)
            }
            Ok(store::ReadReply::Found(v)) if v.phase == crate::record::Stage::Completed => self.replay(v.record),
            Ok(store::ReadReply::Found(v)) if v.phase == crate::record::Stage::Forwarded => self.in_flight(),
            _ => {
                self.count(Counter::UnknownOutcome);
                self.answer(ProblemKind::OutcomeUnknown, None)
            }
        }
    }

    fn in_flight(&mut self) -> Action {
        self.answer(ProblemKind::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS }, None)
    }

    /// A "cannot happen" branch: refuse by the one rule (`failsafe::refuse`), never forward.
    /// `branch` names the branch in the log line; `handle` is the local claim held, if any.
    fn fail_closed(&mut self, broken: Broken, branch: &str, handle: Option<Handle>, holding: Holding) -> Action {
        let refusal = failsafe::refuse(broken, holding);
        if refusal.release_local {
            self.release_local(handle);
        }
        if refusal.release_store {
            self.release_lost_claim();
        }
        error!("{}", self.log_line("internal_state", &format!("branch={branch} broken={}", broken.as_str())));
        self.answer(refusal.problem, None)
    }

    /// What the current phase holds, for `fail_closed`.
    fn holding(&self) -> (Option<Handle>, Holding) {
        match &self.phase {
            Phase::Waiting { handle: Some(h) } => (Some(*h), Holding::LocalClaim),
            Phase::Calling { handle, .. } => (*handle, Holding::StoreClaimSent),
            Phase::Forwarded { .. } | Phase::Detached | Phase::Held => (None, Holding::Forwarded),
            _ => (None, Holding::Nothing),
        }
    }

    /// `fail_closed` with what the current phase holds.
    fn fail_closed_here(&mut self, broken: Broken, branch: &str) -> Action {
        let (handle, holding) = self.holding();
        self.fail_closed(broken, branch, handle, holding)
    }

    fn replay(&mut self, record: Record) -> Action {
        if let State::Completed(r) = &record.state {
            self.count(Counter::Replayed);
            let by = format!("status={} created_by_request_id={}", r.status, record.creator.request_id);
            debug!("{}", self.log_line("replayed", &by));
            self.phase = Phase::Answered;
            let accept: Vec<Vec<u8>> = self.accept_encoding();
            let accept: Vec<&[u8]> = accept.iter().map(Vec::as_slice).collect();
            let max_decoded = self.policy().map_or(0, |p| p.max_response_body_bytes);
            let (request_id, now) = (self.request_id(), self.now());
            let sent = reply::replay(&record, &request_id, now, &accept, max_decoded, |slug| self.publish(slug));
            if let Some(c) = sent.counter() {
                self.shared.metrics.inc_for(c, self.policy_index);
            }
            return Action::Pause;
        }
        let creator = record.creator.clone();
        match record.state {
            State::CompletedTooLarge { status, location } => {
                let location = location.map(|l| String::from_utf8_lossy(&l).into_owned());
                self.answer(ProblemKind::ResponseNotStored { status, location }, Some(&creator))
            }
            // Only completed records are replayed.
            _ => self.answer(ProblemKind::OutcomeUnknown, Some(&creator)),
        }
    }

    /// The request's `accept-encoding` lines (none before the request is known).
    fn accept_encoding(&self) -> Vec<Vec<u8>> {
        self.req
            .as_ref()
            .map(|r| r.head.values("accept-encoding").into_iter().map(<[u8]>::to_vec).collect())
            .unwrap_or_default()
    }

    fn request_id(&self) -> String {
        self.req.as_ref().map(|r| r.creator.request_id.clone()).unwrap_or_default()
    }

    /// A request meeting its key in flight: 409 now, or (wait mode) held until the first attempt
    /// finishes. The fingerprint is needed to tell a replay from a 422, so a wait starts once the
    /// body is complete.
    fn in_flight_or_wait(&mut self, fp: Option<Fingerprint>, creator: Option<&Creator>) -> Action {
        let wait = self.policy().map(|p| p.in_flight);
        match (wait, fp) {
            (Some(InFlight::Wait { .. }), None) => self.wait_for_body(None),
            (Some(InFlight::Wait { wait_ms }), Some(fp)) => {
                let Some(r) = self.req.as_ref() else {
                    return self.fail_closed(Broken::RequestMissing, "wait", None, Holding::Nothing);
                };
                let now = self.now();
                self.shared.push_waiter(Waiter {
                    context_id: self.context_id,
                    skey: r.skey,
                    fp,
                    request_id: r.creator.request_id.clone(),
                    deadline_ms: now.saturating_add(wait_ms),
                    mismatch_status: self.policy().map_or(422, |p| p.mismatch_status),
                    policy_index: r.policy_index,
                    next_store_poll_ms: now,
                    polling: false,
                    accept_encoding: self.accept_encoding(),
                    max_decoded_bytes: self.policy().map_or(0, |p| p.max_response_body_bytes),
                });
                self.count(Counter::Waited);
                debug!("{}", self.log_line("waiting", &format!("wait_ms={wait_ms}")));
                self.phase = Phase::Held;
                Action::Pause
            }
            _ => self.answer(ProblemKind::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS }, creator),
        }
    }

    /// At the request headers, a protected request whose decision needs its body. With
    /// `hold_headers` (the default; Envoy's `allow_on_headers_stop_iteration`) the headers wait
    /// too. Without it the headers go on to the router, which starts the upstream request, while
    /// the body callbacks return `Pause` (Envoy buffers the body): the upstream never receives the
    /// request's end before the claim, and a request refused then is answered locally, which
    /// resets its upstream stream (a request never complete, never executed).
    fn wait_for_body(&mut self, handle: Option<Handle>) -> Action {
        self.phase = Phase::Waiting { handle };
        if self.shared.config.hold_headers {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn local_error(&mut self, e: LocalError) -> Action {
        self.count(Counter::LocalErrors);
        warn!("{}", self.log_line("local_error", &format!("error={e:?}")));
        self.answer(ProblemKind::StoreUnavailable { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS }, None)
    }

    fn begin(&self, fp: Option<Fingerprint>) -> Result<Begin, LocalError> {
        let (Some(r), Some(policy)) = (self.req.as_ref(), self.policy()) else { return Err(LocalError::Corrupt) };
        self.shared.table.begin(&mut HostShared, r.skey, fp, self.now(), policy, r.owner, &r.creator)
    }

    /// Acts on the local tier's answer. `fp` is set once the body is complete.
    fn act(&mut self, begun: Result<Begin, LocalError>, fp: Option<Fingerprint>) -> Action {
        match begun {
            Ok(Begin::Claimed { handle, took_over, evicted }) => {
                self.count(if took_over { Counter::TakenOver } else { Counter::Claimed });
                if evicted {
                    self.count(Counter::LocalEvictions);
                }
                match fp {
                    Some(fp) => self.proceed(Some(handle), fp),
                    None => {
                        debug!("{}", self.log_line("claimed", "waiting_for_body=true"));
                        self.wait_for_body(Some(handle))
                    }
                }
            }
            Ok(Begin::Replay(r)) => self.replay(r),
            // With a store, the store settles a key whose outcome is unknown (an operator may have
            // released or completed it there): the local copy is asked again of the store. Only
            // when a store failure is answered 503 (`on_unavailable: "reject"`): under "pass" a
            // failure would forward the key unprotected, so the local 409 stands.
            Ok(Begin::Reject { problem, .. })
                if self.shared.config.store.as_ref().is_some_and(|c| c.on_unavailable == OnUnavailable::Reject)
                    && admin::store_settles(&problem) =>
            {
                match fp {
                    Some(fp) => self.read_settled(fp),
                    None => {
                        self.phase = Phase::Waiting { handle: None };
                        Action::Pause
                    }
                }
            }
            Ok(Begin::Reject { problem: ProblemKind::InFlight { .. }, creator, .. }) => {
                self.in_flight_or_wait(fp, creator.as_ref())
            }
            Ok(Begin::Reject { problem, creator, .. }) => self.answer(problem, creator.as_ref()),
            Ok(Begin::NeedFingerprint) => self.wait_for_body(None),
            // With a store, the local tier is a cache: a full bucket only means no local copy.
            Ok(Begin::Full) if self.shared.config.store.is_some() => match fp {
                Some(fp) => self.proceed(None, fp),
                None => self.wait_for_body(None),
            },
            Ok(Begin::Full) => self
                .answer(ProblemKind::CapacityExhausted { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS }, None),
            Err(e) => self.local_error(e),
        }
    }

    /// The fingerprint is known and the local tier holds our claim (or has no room): claim in the
    /// store if there is one, then forward.
    fn proceed(&mut self, handle: Option<Handle>, fp: Fingerprint) -> Action {
        let holding = if handle.is_some() { Holding::LocalClaim } else { Holding::Nothing };
        let (Some(r), Some(policy)) = (self.req.as_ref(), self.policy()) else {
            return self.fail_closed(Broken::PolicyMissing, "proceed", handle, holding);
        };
        if self.shared.config.store.is_none() {
            return match handle {
                Some(h) => self.forward(Some(h), fp, false, self.now()),
                // Without a store, the local tier always holds the claim it forwards under.
                None => self.fail_closed(Broken::ImpossibleDecision, "proceed_without_claim", None, Holding::Nothing),
            };
        };
        let lifetimes = Lifetimes::of(policy);
        let record = Record::in_progress(fp, r.creator.clone(), r.owner, self.now(), &lifetimes);
        let Some(seal) = self.shared.seal.as_ref() else {
            return self.fail_closed(Broken::StoreMissing, "claim_without_seal", handle, holding);
        };
        match stores::claim_request(&self.shared, &r.skey, &r.owner, &record, &lifetimes, seal, self.now()) {
            Ok(req) => self.call(req, handle, fp, Asked::Claim),
            // Nothing was sent: the store counts as unavailable (never a claim without a lease).
            Err(Unbuilt::NoLease) => self.store_failed(handle, &StoreError::Garbled(Unbuilt::NoLease.to_string())),
            Err(Unbuilt::Broken(why)) => {
                warn!("{}", self.log_line("internal_state", &format!("error={why}")));
                self.fail_closed(Broken::ImpossibleDecision, "claim_request", handle, holding)
            }
        }
    }

    fn call(&mut self, req: store::StoreRequest, handle: Option<Handle>, fp: Fingerprint, asked: Asked) -> Action {
        let Some(cfg) = self.shared.config.store.as_ref() else {
            let holding = if handle.is_some() { Holding::LocalClaim } else { Holding::Nothing };
            return self.fail_closed(Broken::StoreMissing, "store_call", handle, holding);
        };
        self.count(Counter::StoreCalls);
        // The only store calls a client waits for (the rest are made by the root context).
        self.count(Counter::StoreCallsWaited);
        match writes::dispatch(cfg, &req, &self.shared.credentials) {
            Ok(token) => {
                self.phase = Phase::Calling { handle, fp, token, asked, sent_at_ms: self.now() };
                self.sent = Some(req);
                Action::Pause
            }
            Err(e) => self.store_failed(handle, &StoreError::Garbled(e)),
        }
    }

    /// Redis answered our claim-or-read (or take-over) NOSCRIPT: it does not hold the script, so
    /// the script did not run and nothing was claimed. The same call goes once more with the
    /// script in full (`EVAL`, which also loads it). A NOSCRIPT to a call that carried its script
    /// is no answer Redis gives: taken as a lost answer (503, the claim released owner-checked).
    fn send_with_script(&mut self, handle: Option<Handle>, fp: Fingerprint, asked: Asked) -> Action {
        match self.sent.take().as_ref().and_then(store::StoreRequest::with_script) {
            Some(again) => {
                self.count(Counter::StoreScriptLoads);
                info!("{}", self.log_line("store_script_missing", "resent=eval"));
                self.call(again, handle, fp, asked)
            }
            None => {
                self.store_answer_lost(handle, &StoreError::Garbled("NOSCRIPT to a call carrying its script".into()))
            }
        }
    }

    /// The store claimed the key for us (a claim or a take-over sent at `sent_at_ms`): forward,
    /// unless the answer came so late that the claim's lock may already be judged stale
    /// (`Lifetimes::answer_in_time`): another request may then have marked it outcome-unknown or
    /// taken it over and forwarded. Then it is handled as a lost answer: released owner-checked
    /// (a no-op if the key changed hands), never forwarded.
    fn forward_claimed(&mut self, handle: Option<Handle>, fp: Fingerprint, sent_at_ms: u64) -> Action {
        let Some(policy) = self.policy() else {
            let holding = if handle.is_some() { Holding::LocalClaim } else { Holding::Nothing };
            return self.fail_closed(Broken::PolicyMissing, "forward_claimed", handle, holding);
        };
        let lifetimes = Lifetimes::of(policy);
        let run_ms = match policy.forwarding {
            Forwarding::Detached { timeout_ms, .. } => timeout_ms,
            Forwarding::Router => 0,
        };
        let now = self.now();
        if !lifetimes.answer_in_time(sent_at_ms, now, run_ms) {
            self.count(Counter::StoreAnswersTooLate);
            let why = format!(
                "the store's claim answer came {} ms after the claim was sent, too late for its lock ({} ms; the upstream may run {run_ms} ms more)",
                now.saturating_sub(sent_at_ms),
                lifetimes.lock_ms
            );
            // The store answered: this is no outage, so never forwarded unprotected either, even
            // with on_unavailable "pass" (another request may hold the key by now).
            self.release_lost_claim();
            return self.store_failed_as(handle, &StoreError::Garbled(why), OnUnavailable::Reject);
        }
        self.forward(handle, fp, true, sent_at_ms)
    }

    /// The claim (or take-over) was sent but its answer is lost or garbled: it may have landed
    /// (a store that timed out can still run it). Release it, owner-checked, through the root,
    /// which retries with backoff: otherwise a claim nothing executed under would answer retries
    /// with in-flight, then outcome-unknown. Then answer as for any store failure.
    fn store_answer_lost(&mut self, handle: Option<Handle>, e: &StoreError) -> Action {
        self.release_lost_claim();
        self.store_failed(handle, e)
    }

    /// The store could not answer: 503 (reject) or forward unprotected (pass).
    fn store_failed(&mut self, handle: Option<Handle>, e: &StoreError) -> Action {
        let Some(on_unavailable) = self.shared.config.store.as_ref().map(|c| c.on_unavailable) else {
            self.release_local(handle);
            return self.fail_closed(Broken::StoreMissing, "store_failed", None, Holding::Nothing);
        };
        self.store_failed_as(handle, e, on_unavailable)
    }

    /// `store_failed`, with `on_unavailable` given.
    fn store_failed_as(&mut self, handle: Option<Handle>, e: &StoreError, on_unavailable: OnUnavailable) -> Action {
        self.count(Counter::StoreErrors);
        self.release_local(handle);
        let Some(policy) = self.policy() else {
            return self.fail_closed(Broken::PolicyMissing, "store_failed", None, Holding::Nothing);
        };
        match decide(Lookup::StoreError, None, 0, policy, on_unavailable) {
            Decision::PassUnprotected => {
                self.count(Counter::StorePassed);
                warn!("{}", self.log_line("store_unavailable_passed", &format!("error={e}")));
                self.publish("passed-unprotected");
                self.phase = Phase::Pass;
                Action::Continue
            }
            Decision::Reject(p) => {
                warn!("{}", self.log_line("store_unavailable", &format!("error={e}")));
                self.answer(p, None)
            }
            _ => self.fail_closed(Broken::ImpossibleDecision, "store_failed_decision", None, Holding::Nothing),
        }
    }

    /// Forwards under our claim(s), whose lock runs from `lock_from_ms` (the store claim's send,
    /// or now for the local tier's).
    fn forward(&mut self, handle: Option<Handle>, fp: Fingerprint, in_store: bool, lock_from_ms: u64) -> Action {
        let holding = match (in_store, handle.is_some()) {
            (true, _) => Holding::StoreClaimSent,
            (false, true) => Holding::LocalClaim,
            (false, false) => Holding::Nothing,
        };
        let (Some(policy), Some(claim), Some(r)) = (self.policy(), self.claim(handle, fp, in_store), self.req.as_ref())
        else {
            return self.fail_closed(Broken::PolicyMissing, "forward", handle, holding);
        };
        let Forwarding::Detached { cluster, timeout_ms, hop } = &policy.forwarding else {
            debug!("{}", self.log_line("forwarded", ""));
            self.phase = Phase::Forwarded { handle, fp, in_store };
            return Action::Continue;
        };
        let (cluster, timeout_ms, hop) = (cluster.clone(), *timeout_ms, *hop);
        let lock_deadline_ms = Lifetimes::of(policy).lock_expires_at(lock_from_ms);
        // The root sends it: its callout outlives this request if the client leaves.
        let headers = r
            .head
            .headers
            .iter()
            .filter(|(n, _)| {
                !NOT_REPLAYED.contains(&n.as_str()) && n != "expect" && n != crate::decision::HOP_PROBE_HEADER
            })
            .filter_map(|(n, v)| std::str::from_utf8(v).ok().map(|v| (n.clone(), v.to_string())))
            .collect();
        debug!("{}", self.log_line("forwarded", &format!("detached=true cluster={cluster}")));
        self.shared.push_forward(Forward {
            context_id: self.context_id,
            cluster,
            timeout_ms,
            hop,
            headers,
            body: std::mem::take(&mut self.body),
            claim,
            request_id: r.creator.request_id.clone(),
            sent_at_ms: 0,
            lock_deadline_ms,
        });
        self.phase = Phase::Detached;
        Action::Pause
    }

    fn claim(&self, handle: Option<Handle>, fp: Fingerprint, in_store: bool) -> Option<Claim> {
        let r = self.req.as_ref()?;
        Some(Claim {
            handle,
            fp,
            in_store,
            owner: r.owner,
            skey: r.skey,
            policy_index: r.policy_index,
            creator: r.creator.clone(),
            log: self.log_line("", "").trim_start_matches("idemgate: outcome= ").to_string(),
            mcp_id: r.mcp.clone(),
        })
    }

    /// The store's answer to our claim-or-read or take-over (sent at `sent_at_ms`).
    fn on_store_answer(
        &mut self,
        handle: Option<Handle>,
        fp: Fingerprint,
        asked: Asked,
        sent_at_ms: u64,
        status: Option<u16>,
        body: &[u8],
    ) -> Action {
        if asked == Asked::TakeOver {
            let Some((skey, owner)) = self.req.as_ref().map(|r| (r.skey, r.owner)) else {
                return self
                    .store_failed(handle, &StoreError::Garbled("a take-over answer without its request".into()));
            };
            return match stores::parse_take_over(&self.shared, status, body, &skey, &owner) {
                // A take-over never writes where the key is absent (`WhereAbsent::Refuse`).
                Ok(TransitionReply::Changed | TransitionReply::ClaimGoneRewritten) => {
                    self.count(Counter::TakenOver);
                    self.forward_claimed(handle, fp, sent_at_ms)
                }
                // Nothing was written (etcd: the key is absent, which a take-over never writes).
                Ok(TransitionReply::Refused | TransitionReply::Absent) => {
                    self.release_local(handle);
                    self.in_flight()
                }
                Ok(TransitionReply::NoScript) => self.send_with_script(handle, fp, Asked::TakeOver),
                Err(e) => self.store_answer_lost(handle, &e),
            };
        }
        if asked == Asked::Settled {
            return self.settled_answer(fp, status, body);
        }
        let on_unavailable = self.shared.config.store.as_ref().map_or(OnUnavailable::Reject, |c| c.on_unavailable);
        // Cannot happen (a claim is made for a request): fail closed.
        let Some(owner) = self.req.as_ref().map(|r| r.owner) else {
            return self.store_failed(handle, &StoreError::Garbled("a claim answer without its request".into()));
        };
        let (Some(skey), Some(seal)) = (self.req.as_ref().map(|r| r.skey), self.shared.seal.clone()) else {
            return self.store_failed(handle, &StoreError::Garbled("a claim answer without its key or seal".into()));
        };
        let parsed = stores::parse_claim(&self.shared, status, body, &owner, &skey, &seal, self.now());
        let (now, expires_at, value) = match parsed {
            Ok((ClaimReply::Claimed { .. }, _)) => return self.forward_claimed(handle, fp, sent_at_ms),
            Ok((ClaimReply::Exists { now_ms, expires_at_ms, value }, fence)) => {
                self.fence = fence;
                (now_ms, expires_at_ms, value)
            }
            // The key holds a record we cannot read: nothing was claimed, and it is no outage.
            Ok((ClaimReply::Unreadable { now_ms, why }, _)) => {
                self.release_local(handle);
                self.count_unreadable(&why);
                warn!("{}", self.log_line("record_unreadable", &format!("error={why}")));
                let Some(policy) = self.policy() else {
                    return self.fail_closed(Broken::PolicyMissing, "store_answer_unreadable", None, Holding::Nothing);
                };
                return match decide(Lookup::Unreadable, Some(&fp), now_ms, policy, on_unavailable) {
                    Decision::Reject(p) => self.answer(p, None),
                    _ => self.answer(
                        ProblemKind::RecordUnreadable { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS },
                        None,
                    ),
                };
            }
            // Nothing ran: the same call again, with the script.
            Ok((ClaimReply::NoScript, _)) => return self.send_with_script(handle, fp, Asked::Claim),
            Err(e) => return self.store_answer_lost(handle, &e),
        };
        let Some(policy) = self.policy().cloned() else {
            let holding = if handle.is_some() { Holding::LocalClaim } else { Holding::Nothing };
            return self.fail_closed(Broken::PolicyMissing, "store_answer", handle, holding);
        };
        // Judged by Redis's clock only: its now, the key's expiry (TIME + PTTL), the lock's.
        match decide(Lookup::Found(value.summary(expires_at)), Some(&fp), now, &policy, on_unavailable) {
            Decision::Replay => {
                self.count(Counter::StoreReplays);
                // A completed record never changes: keep a copy so the next replay needs no store
                // call, ending with the store's key by this proxy's clock.
                let record = value.record_on_clock(now, expires_at, self.now());
                if let Some(h) = handle {
                    let _ = self.shared.table.complete(&mut HostShared, &h, record.clone(), self.now());
                }
                self.replay(record)
            }
            Decision::Reject(ProblemKind::InFlight { .. }) => {
                self.release_local(handle);
                self.in_flight_or_wait(Some(fp), Some(&value.record.creator))
            }
            Decision::Reject(p) => {
                self.release_local(handle);
                self.answer(p, Some(&value.record.creator))
            }
            Decision::MarkUnknown => {
                self.release_local(handle);
                let unknown = Transition::stale_to_unknown(value.owner, &Lifetimes::of(&policy));
                self.enqueue("stale_to_unknown", unknown, None);
                self.answer(ProblemKind::OutcomeUnknown, Some(&value.record.creator))
            }
            // A stale lock with `stale_lock: "takeover"`, or a record the store still holds that
            // is free (past its expiry, no live lock, judged by Redis's clock): replace it,
            // owner-checked, in one more round trip; the script re-checks the lock.
            Decision::TakeOver => self.take_over(handle, fp, &value, &policy, false),
            Decision::Claim => self.take_over(handle, fp, &value, &policy, true),
            // Neither can follow from a value read with a fingerprint: never forward on it.
            Decision::PassUnprotected | Decision::NeedFingerprint => {
                let holding = if handle.is_some() { Holding::LocalClaim } else { Holding::Nothing };
                self.fail_closed(Broken::ImpossibleDecision, "store_answer_decision", handle, holding)
            }
        }
    }

    fn take_over(
        &mut self,
        handle: Option<Handle>,
        fp: Fingerprint,
        old: &StoredValue,
        policy: &Policy,
        free: bool,
    ) -> Action {
        let Some(r) = self.req.as_ref() else {
            let holding = if handle.is_some() { Holding::LocalClaim } else { Holding::Nothing };
            return self.fail_closed(Broken::RequestMissing, "take_over", handle, holding);
        };
        let lifetimes = Lifetimes::of(policy);
        let record = Record::in_progress(fp, r.creator.clone(), r.owner, self.now(), &lifetimes);
        let Some(seal) = self.shared.seal.as_ref() else {
            let holding = if handle.is_some() { Holding::LocalClaim } else { Holding::Nothing };
            return self.fail_closed(Broken::StoreMissing, "take_over_without_seal", handle, holding);
        };
        let t = Transition::take_over(old.owner, r.owner, record, free, &lifetimes);
        let holding = if handle.is_some() { Holding::LocalClaim } else { Holding::Nothing };
        match stores::transition_request(&self.shared, &t, &r.skey, seal, self.now(), self.fence.as_ref()) {
            Ok(req) => self.call(req, handle, fp, Asked::TakeOver),
            Err(Unbuilt::NoLease) => self.store_failed(handle, &StoreError::Garbled(Unbuilt::NoLease.to_string())),
            Err(Unbuilt::Broken(why)) => {
                warn!("{}", self.log_line("internal_state", &format!("error={why}")));
                self.fail_closed(Broken::ImpossibleDecision, "take_over_request", handle, holding)
            }
        }
    }

    /// Hands a write to the root context, which outlives this request.
    fn enqueue(&self, what: &'static str, t: Transition, fallback: Option<Transition>) {
        if self.shared.config.store.is_none() {
            return;
        }
        let Some(r) = self.req.as_ref() else { return };
        self.shared.push_write_fenced(what, &r.skey, &t, fallback.as_ref(), self.fence.as_ref());
    }

    /// A claim-or-read or take-over was sent and its answer is lost (or the client left while it
    /// ran): it may land in the store later, even after this release (Envoy's host answers every
    /// callout on the root, so the request may still be in flight). The release is owner-checked
    /// and leaves a tombstone if the claim has not landed yet, which the claim script honours.
    fn release_lost_claim(&self) {
        if let (Some(owner), Some(policy)) = (self.req.as_ref().map(|r| r.owner), self.policy()) {
            self.enqueue("release", Transition::release_lost(owner, &Lifetimes::of(policy)), None);
        }
    }

    /// The whole body is here: fingerprint it and go on.
    fn body_complete(&mut self) -> Action {
        crash_point(self.req.as_ref(), "body");
        let body = host::buffer(BufferType::HttpRequestBody, self.body_size);
        self.release_budget();
        // Taken once, for the fingerprint and for a key derived from the body.
        let Some(digest) = self.policy().map(|p| fingerprint::body_digest(&body, &p.fingerprint)) else {
            return self.fail_closed_here(Broken::PolicyMissing, "body_complete");
        };
        if self.req.as_ref().is_some_and(|r| r.derive_at_body) {
            match self.derive_key_with_body(&digest.1) {
                Ok(true) => {}
                // No key can be derived: the request is not protected.
                Ok(false) => return Action::Continue,
                Err(broken) => return self.fail_closed_here(broken, "derive_key_with_body"),
            }
        }
        let (Some(r), Some(policy)) = (self.req.as_ref(), self.policy()) else {
            return self.fail_closed_here(Broken::PolicyMissing, "body_complete");
        };
        let (fp, _) = Fingerprint::of_digest(&r.head, digest, &policy.fingerprint);
        let policy = policy.clone();
        if matches!(policy.forwarding, Forwarding::Detached { .. }) {
            self.body = body;
        }
        match std::mem::replace(&mut self.phase, Phase::Pass) {
            Phase::Waiting { handle: Some(handle) } => {
                match self.shared.table.mark_forwarded(&mut HostShared, &handle, fp, self.now(), &policy) {
                    Ok(true) => self.proceed(Some(handle), fp),
                    Ok(false) => {
                        self.count(Counter::LostClaim);
                        self.in_flight()
                    }
                    Err(e) => self.local_error(e),
                }
            }
            Phase::Waiting { handle: None } => {
                let begun = self.begin(Some(fp));
                self.act(begun, Some(fp))
            }
            // Called only while waiting for the body.
            other => {
                self.phase = other;
                self.fail_closed_here(Broken::PhaseMismatch, "body_complete_phase")
            }
        }
    }

    /// `derive_key.include_body`: the key (and so the storage key) is known only now. Returns
    /// false when no key can be derived (the request then passes unprotected), an error when an
    /// invariant is broken.
    fn derive_key_with_body(&mut self, body_digest: &[u8; 32]) -> Result<bool, Broken> {
        let Some(policy) = self.policy().cloned() else { return Err(Broken::PolicyMissing) };
        let Some(r) = self.req.as_mut() else { return Err(Broken::RequestMissing) };
        let Some(key) = policy
            .derive_key
            .as_ref()
            .and_then(|d| derive::derive(&r.head, d, &policy.fingerprint, &r.scope, Some(body_digest)))
        else {
            self.phase = Phase::Pass;
            return Ok(false);
        };
        r.skey = StorageKey::derive(&policy.namespace, &r.scope, &key);
        r.derive_at_body = false;
        r.head.headers.push((policy.header.clone(), key.as_str().as_bytes().to_vec()));
        // With `hold_headers: false` the request headers went upstream at their end, without the
        // key (it was not known yet): the key protects the request here, and the upstream never
        // sees it (Envoy no longer lends the map; a write would only be refused).
        if self.shared.config.hold_headers {
            let _ = host::set_header(MapType::HttpRequestHeaders, &policy.header, Some(key.as_str()));
        }
        self.count(Counter::DerivedKeys);
        debug!("{}", self.log_line("derived_key", "key_source=derived"));
        Ok(true)
    }

    fn release_budget(&mut self) {
        if self.budgeted > 0 {
            let b = &self.shared.buffered;
            b.set(b.get().saturating_sub(self.budgeted));
            self.budgeted = 0;
        }
    }

    fn release_local(&self, handle: Option<Handle>) {
        settle::release_local(&self.shared, handle, self.now());
    }

    /// Frees a local claim whose request was never forwarded (refused or abandoned).
    fn release_unforwarded(&mut self) {
        if let Phase::Waiting { handle: Some(h) } = &self.phase {
            let h = *h;
            self.release_local(Some(h));
            debug!("{}", self.log_line("released", "reason=never_forwarded"));
            self.phase = Phase::Waiting { handle: None };
        }
    }

    /// A forwarded exchange Envoy ended for an internal redirect (the router took the upstream's
    /// 3xx, so no response reached this filter): its claim, to hand over to the re-created stream.
    /// Otherwise the response code details if they were read.
    fn redirected(
        &self,
        handle: Option<Handle>,
        fp: Fingerprint,
        in_store: bool,
    ) -> Result<Handoff<Claim>, Option<String>> {
        if self.response.is_some() {
            return Err(None);
        }
        let details = host::property(&["response", "code_details"])
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        if details != redirect::REDIRECT_CODE_DETAILS {
            return Err(Some(details));
        }
        let (Some(r), Some(claim)) = (self.req.as_ref(), self.claim(handle, fp, in_store)) else {
            return Err(Some(details));
        };
        Ok(Handoff {
            claim,
            skey: r.skey,
            policy_index: r.policy_index,
            url: format!("{}{}", r.head.authority, r.head.path),
            connection: u64_property(&["connection", "id"]),
            from_context: self.context_id,
            posted_ms: self.now(),
        })
    }

    /// A stream Envoy re-created for an internal redirect (`crate::redirect`): it continues the
    /// claim its first stream handed over, and settles it with the final answer. Anything else
    /// carrying `x-envoy-original-url` (a client can send it) is an ordinary request.
    fn continue_redirect(&mut self) -> Option<Action> {
        if self.shared.handoffs.borrow().is_empty() {
            return None;
        }
        let url = host::header(MapType::HttpRequestHeaders, redirect::ORIGINAL_URL_HEADER)?;
        let connection = u64_property(&["connection", "id"]);
        let now = self.now();
        let policies = self.shared.handoffs.borrow().policies_for(url.as_bytes(), connection, self.context_id, now);
        if policies.is_empty() {
            return None;
        }
        let head = RequestHead::from_pairs(host::all_headers(MapType::HttpRequestHeaders));
        for i in policies {
            let Some(policy) = self.shared.config.policy_at(i) else { continue };
            let Admission::Protect(key) = admit(Some(policy), &head.values(&policy.header)) else { continue };
            let scope = CallerScope::of(&head, &policy.scope);
            let skey = StorageKey::derive(&policy.namespace, &scope, &key);
            let taken =
                self.shared.handoffs.borrow_mut().take(&skey, i, url.as_bytes(), connection, self.context_id, now);
            let Some(h) = taken else { continue };
            return Some(self.adopt(h, head, scope));
        }
        None
    }

    /// Continues a handed-over claim: forwarded under it, settled at this stream's end.
    fn adopt(&mut self, h: Handoff<Claim>, mut head: RequestHead, scope: CallerScope) -> Action {
        let c = h.claim;
        self.policy_index = Some(c.policy_index);
        self.count(Counter::RedirectsFollowed);
        let retries_forbidden = forbid_router_retries(&mut head);
        self.req = Some(Protected {
            policy_index: c.policy_index,
            head,
            skey: c.skey,
            scope,
            creator: c.creator,
            owner: c.owner,
            derive_at_body: false,
            mcp: c.mcp_id,
        });
        self.phase = Phase::Forwarded { handle: c.handle, fp: c.fp, in_store: c.in_store };
        self.redirected = true;
        if !retries_forbidden {
            // The claim stays (judged outcome-unknown once its lock expires): never re-sent.
            return self.fail_closed_here(Broken::HostCallFailed, "redirect_retry_guard");
        }
        debug!("{}", self.log_line("redirect_followed", &format!("from={}", h.url)));
        Action::Continue
    }

    /// Settles a forwarded exchange; returns its outcome slug. `code_details`: Envoy's response
    /// code details if already read.
    fn finish(
        &mut self,
        handle: Option<Handle>,
        fp: Fingerprint,
        in_store: bool,
        code_details: Option<String>,
    ) -> &'static str {
        let Some(policy) = self.policy().cloned() else {
            // Forwarded, so its claim stays (outcome unknown once its lock expires): say so.
            self.count(Counter::InternalErrors);
            error!("{}", self.log_line("internal_state", "branch=finish broken=policy_missing claim=kept"));
            return settle::INTERNAL_STATE;
        };
        let status = self.response.as_ref().map(|r| r.status).filter(|s| *s > 0);
        let mut x = Finished {
            status: status.map(Some),
            complete: self.response_complete,
            code_details,
            ..Finished::default()
        };
        // Whether the router re-sent it is read always (its warning below); every other fact only
        // when the classification needs it (`classify_routed`).
        let attempts = x.attempts();
        let headers = self.response.as_ref().map_or(&[][..], |r| &r.headers[..]);
        let outcome = classify_routed(&mut x, headers, &policy);
        let outcome = if self.redirected { redirect::after_first_hop(outcome) } else { outcome };
        let detail = if log::log_enabled!(log::Level::Info) { x.detail() } else { String::new() };
        // The router was told to send it once; a later filter (or a host that ignores the cap)
        // may still have re-sent it. Nothing can undo that now: count it and say so.
        if attempts.is_some_and(|n| n > 1) {
            self.count(Counter::UpstreamAttemptsRepeated);
            warn!("{}", self.log_line("upstream_attempts_repeated", &x.detail()));
        }
        let Some(claim) = self.claim(handle, fp, in_store) else {
            self.count(Counter::InternalErrors);
            error!("{}", self.log_line("internal_state", "branch=finish broken=request_missing claim=kept"));
            return settle::INTERNAL_STATE;
        };
        let response = self.response.take();
        settle::settle(&self.shared, &claim, outcome, response, self.response_too_large, &detail)
    }
}

/// A forwarded exchange as Envoy finished it, each fact read from Envoy's properties the first
/// time `classify_exchange` asks for it (one host call each), then kept.
#[derive(Default)]
struct Finished {
    status: Option<Option<u16>>,
    complete: bool,
    flags: Option<u64>,
    code_details: Option<String>,
    attempts: Option<Option<u64>>,
    upstream_host: Option<bool>,
    upstream_connected: Option<bool>,
}

fn u64_property(path: &[&str]) -> Option<u64> {
    host::property(path).and_then(|b| b.get(..8).and_then(|s| s.try_into().ok()).map(u64::from_le_bytes))
}

impl Finished {
    /// The facts read, for log lines (`-` for those the classification never needed).
    fn detail(&self) -> String {
        let shown = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        format!(
            "status={} code_details={} flags={} attempts={} upstream_host={} upstream_connected={}",
            self.status.flatten().unwrap_or(0),
            shown(self.code_details.clone()),
            shown(self.flags.map(|f| f.to_string())),
            shown(self.attempts.map(|a| a.map_or_else(|| "unknown".to_string(), |n| n.to_string()))),
            shown(self.upstream_host.map(|b| b.to_string())),
            shown(self.upstream_connected.map(|b| b.to_string())),
        )
    }
}

impl Exchange for Finished {
    fn forwarded(&mut self) -> bool {
        true
    }
    fn status(&mut self) -> Option<u16> {
        *self.status.get_or_insert_with(|| {
            u64_property(&["response", "code"]).and_then(|c| u16::try_from(c).ok()).filter(|c| *c > 0)
        })
    }
    fn code_details(&mut self) -> String {
        self.code_details
            .get_or_insert_with(|| {
                host::property(&["response", "code_details"])
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_default()
            })
            .clone()
    }
    fn flags(&mut self) -> u64 {
        *self.flags.get_or_insert_with(|| u64_property(&["response", "flags"]).unwrap_or(0))
    }
    fn response_complete(&mut self) -> bool {
        self.complete
    }
    // Whether the router ever started an upstream request, picked a host, connected to it.
    fn upstream_host(&mut self) -> bool {
        *self.upstream_host.get_or_insert_with(|| host::property(&["upstream", "address"]).is_some())
    }
    fn upstream_connected(&mut self) -> bool {
        *self.upstream_connected.get_or_insert_with(|| host::property(&["upstream", "local_address"]).is_some())
    }
    fn attempts(&mut self) -> Option<u64> {
        *self.attempts.get_or_insert_with(|| u64_property(&["upstream", "request_attempt_count"]))
    }
}

impl Context for Http {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        self.callback(meter::Callback::CallAnswer);
        let Phase::Calling { handle, fp, token: expected, asked, sent_at_ms } = self.phase else { return };
        if token != expected {
            return;
        }
        let (status, body) = writes::answer(body_size, num_headers);
        if self.on_store_answer(handle, fp, asked, sent_at_ms, status, &body) == Action::Continue {
            let _ = host::resume_request();
        }
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        self.callback(meter::Callback::RequestHeaders);
        if let Some(action) = self.continue_redirect() {
            return action;
        }
        // The whole header map, read once: the method, the route (the path), every line of the
        // key header (a repeated one must be seen), the caller's scope and the fingerprint all
        // come from it. A request without a body (most unprotected ones: GET, HEAD) has its method
        // read alone first, so an unprotected one passes on one small read; one with a body is
        // read whole at once (one read either way when unprotected, one fewer when protected).
        if end_of_stream {
            let method = host::header(MapType::HttpRequestHeaders, ":method").unwrap_or_default();
            if !self.shared.config.protects_method(&method) {
                return Action::Continue;
            }
        }
        let mut head = RequestHead::from_pairs(host::all_headers(MapType::HttpRequestHeaders));
        if !end_of_stream && !self.shared.config.protects_method(&head.method) {
            return Action::Continue;
        }
        // The name of the Envoy route that matched, read only when a route is selected by it.
        let route_name = if self.shared.config.uses_route_names() {
            host::property(&["xds", "route_name"]).map(|n| String::from_utf8_lossy(&n).into_owned())
        } else {
            None
        };
        let policy_index = match self.shared.config.select_route(&head.method, &head.path, route_name.as_deref()) {
            Selection::Policy(i) => i,
            Selection::Unprotected => return Action::Continue,
            Selection::Ambiguous { first, other } => {
                debug!("idemgate: outcome=route_ambiguous routes={first},{other} path={}", head.path_without_query());
                return self.answer(ProblemKind::RouteAmbiguous, None);
            }
        };
        self.policy_index = Some(policy_index);
        let Some(policy) = self.shared.config.policy_at(policy_index) else {
            return self.fail_closed(Broken::PolicyMissing, "request_headers_policy", None, Holding::Nothing);
        };
        // gRPC: a replay cannot be faithful (Envoy reshapes every local reply to a gRPC request
        // into a trailers-only status), so such calls are refused with a key (below) or, with
        // `grpc: "pass"`, not idemgate's at all.
        let grpc = head.is_grpc();
        // MCP: only the body says whether this is a protected tools/call. A request without one
        // (GET streams, DELETE) is no tool call. A gRPC content-type is no exception: a server that
        // does not check the type runs a tools/call sent as `application/grpc, application/json`
        // (a protected call under such a type is refused, `mcp_body_complete`).
        if policy.mcp.is_some() {
            if end_of_stream || head.method != "POST" {
                return Action::Continue;
            }
            // Without `hold_headers` the headers go upstream now, before the body says whether
            // the call is protected: the router is told not to re-send it now, as for any
            // protected request (the one change an unprotected MCP POST then sees).
            if !self.shared.config.hold_headers && !forbid_router_retries(&mut head) {
                return self.fail_closed(Broken::HostCallFailed, "mcp_retry_guard", None, Holding::Nothing);
            }
            self.mcp_head = Some(head);
            self.phase = Phase::McpBody;
            return if self.shared.config.hold_headers { Action::Pause } else { Action::Continue };
        }
        if grpc && policy.grpc == GrpcMode::Pass {
            self.count(Counter::GrpcPassed);
            debug!("idemgate: outcome=grpc_passed_unprotected path={}", head.path_without_query());
            return Action::Continue;
        }
        // No key and nothing to derive one from: decided without hashing the caller.
        if policy.derive_key.is_none() && head.values(&policy.header).is_empty() {
            return match admit(Some(policy), &[]) {
                Admission::Reject(p) => self.answer(p, None),
                _ => Action::Continue,
            };
        }
        let scope = CallerScope::of(&head, &policy.scope);
        let key_values = head.values(&policy.header);
        // A request without a key but with the operation's identifiers gets a key derived at
        // the edge (opt-in); with include_body, once the body is here.
        let derive = if key_values.is_empty() { policy.derive_key.as_ref() } else { None };
        let derive_at_body = derive.is_some_and(|d| d.include_body) && !end_of_stream;
        let derived = match derive {
            // Whether it can be derived is known now (headers, scope); the key itself later.
            Some(d) if derive_at_body => derive::derive(
                &head,
                &crate::config::DeriveKey { include_body: false, ..d.clone() },
                &policy.fingerprint,
                &scope,
                None,
            ),
            Some(d) => {
                let empty = d.include_body.then(|| fingerprint::body_digest(b"", &policy.fingerprint).1);
                derive::derive(&head, d, &policy.fingerprint, &scope, empty.as_ref())
            }
            None => None,
        };
        let was_derived = derived.is_some();
        // A gRPC call with a key (sent, valid or not, or derivable): refused before anything
        // executes; a malformed key is answered as such first.
        if grpc && (was_derived || matches!(admit(Some(policy), &key_values), Admission::Protect(_))) {
            return self.answer(ProblemKind::GrpcUnsupported { header: policy.header.clone() }, None);
        }
        let key = match derived {
            Some(k) => {
                if !derive_at_body {
                    head.headers.push((policy.header.clone(), k.as_str().as_bytes().to_vec()));
                    let _ = host::set_header(MapType::HttpRequestHeaders, &policy.header, Some(k.as_str()));
                    self.count(Counter::DerivedKeys);
                }
                k
            }
            None => match admit(Some(policy), &key_values) {
                Admission::Pass => return Action::Continue,
                Admission::Reject(p) => return self.answer(p, None),
                Admission::Protect(k) => k,
            },
        };
        // A key from a caller none of the scope headers identify: refused unless the operator
        // chose a shared anonymous scope (derived keys are only ever derived for identified ones).
        if let Err(p) = scope.admits(&policy.scope) {
            return self.answer(p, None);
        }
        self.count(Counter::Protected);
        // At most once: Envoy's router must never re-send it (a route's retry_policy, hedging, or
        // retries a client asks for with x-envoy-* headers).
        if !forbid_router_retries(&mut head) {
            return self.fail_closed(Broken::HostCallFailed, "retry_guard", None, Holding::Nothing);
        }
        let skey = StorageKey::derive(&policy.namespace, &scope, &key);
        let owner = self.shared.next_owner();
        let creator = creator_of(policy, &head);
        self.req = Some(Protected { policy_index, head, skey, scope, creator, owner, derive_at_body, mcp: None });
        if was_derived && !derive_at_body {
            debug!("{}", self.log_line("derived_key", "key_source=derived"));
        }
        if derive_at_body {
            // The key depends on the body: decide once it is here.
            return self.wait_for_body(None);
        }
        if end_of_stream {
            if fault_point(self.req.as_ref(), "policy-lost-at-headers") {
                if let Some(r) = self.req.as_mut() {
                    r.policy_index = NO_POLICY;
                }
            }
            // No body: the fingerprint is known now.
            let fp = {
                let (Some(r), Some(p)) = (self.req.as_ref(), self.policy()) else {
                    return self.fail_closed(
                        Broken::PolicyMissing,
                        "request_headers_fingerprint",
                        None,
                        Holding::Nothing,
                    );
                };
                Fingerprint::compute(&r.head, b"", &p.fingerprint).0
            };
            let begun = self.begin(Some(fp));
            return self.act(begun, Some(fp));
        }
        // Claim at headers: concurrent duplicates get a 409 without buffering their bodies.
        let begun = self.begin(None);
        self.act(begun, None)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.callback(meter::Callback::RequestBody);
        match self.phase {
            Phase::Waiting { .. } | Phase::McpBody => {}
            // Paused on a store call: keep buffering.
            Phase::Calling { .. } => return Action::Pause,
            _ => return Action::Continue,
        }
        self.body_size = body_size;
        if matches!(self.phase, Phase::McpBody) {
            return self.mcp_body(body_size, end_of_stream);
        }
        if fault_point(self.req.as_ref(), "policy-lost-at-body") {
            if let Some(r) = self.req.as_mut() {
                r.policy_index = NO_POLICY;
            }
        }
        let Some(policy) = self.policy() else {
            self.release_budget();
            return self.fail_closed_here(Broken::PolicyMissing, "request_body");
        };
        if let Err(p) = check_body_size(body_size as u64, policy) {
            self.release_budget();
            self.release_unforwarded();
            return self.answer(p, None);
        }
        // Per-VM budget of buffered bytes: many concurrent large bodies get a 503, not an OOM.
        let total = body_size as u64;
        let delta = total.saturating_sub(self.budgeted);
        let b = &self.shared.buffered;
        if b.get().saturating_add(delta) > self.shared.config.max_buffered_bytes {
            self.release_budget();
            self.release_unforwarded();
            return self.answer(
                ProblemKind::BufferBudgetExceeded { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS },
                None,
            );
        }
        b.set(b.get() + delta);
        self.budgeted = total;
        if end_of_stream {
            self.body_complete()
        } else {
            Action::Pause
        }
    }

    fn on_http_request_trailers(&mut self, _n: usize) -> Action {
        self.callback(meter::Callback::RequestBody);
        match self.phase {
            Phase::Waiting { .. } => {
                // Trailers reach the upstream with the request: part of its fingerprint.
                if let Some(r) = self.req.as_mut() {
                    r.head.trailers = host::all_headers(MapType::HttpRequestTrailers);
                }
                self.body_complete()
            }
            Phase::McpBody => self.mcp_body_complete(),
            Phase::Calling { .. } => Action::Pause,
            _ => Action::Continue,
        }
    }

    fn on_http_response_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        self.callback(meter::Callback::ResponseHeaders);
        if !matches!(self.phase, Phase::Forwarded { .. }) {
            return Action::Continue;
        }
        crash_point(self.req.as_ref(), "response");
        if fault_point(self.req.as_ref(), "lost-wake") {
            self.shared.lose_next_wake();
        }
        let Some(policy) = self.policy() else { return Action::Continue };
        let exclude = &policy.replay_exclude_headers;
        let mut status = 0;
        let mut headers = vec![];
        for (n, v) in host::all_headers(MapType::HttpResponseHeaders) {
            if n == ":status" {
                status = std::str::from_utf8(&v).ok().and_then(|s| s.parse().ok()).unwrap_or(0);
            } else if crate::record::storable_header(&n) && !exclude.contains(&n) {
                headers.push((n, v));
            }
        }
        self.response = Some(StoredResponse { status, headers, body: vec![] });
        self.response_complete = end_of_stream;
        // Publish the expiry policy to the client that created the record.
        if !self.policy().is_some_and(|p| p.release_on_status.contains(&status)) {
            let ttl = self.policy().map_or(0, |p| p.ttl_seconds).to_string();
            let _ = host::add_header(MapType::HttpResponseHeaders, reply::EXPIRES_HEADER, &ttl);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.callback(meter::Callback::ResponseBody);
        if !matches!(self.phase, Phase::Forwarded { .. }) {
            return Action::Continue;
        }
        let limit = self.policy().map_or(0, |p| p.max_response_body_bytes) as usize;
        if !self.response_too_large {
            let chunk = host::buffer(BufferType::HttpResponseBody, body_size);
            if let Some(r) = self.response.as_mut() {
                if r.body.len() + chunk.len() > limit {
                    self.response_too_large = true;
                    r.body = vec![];
                } else {
                    r.body.extend_from_slice(&chunk);
                }
            }
        }
        if end_of_stream {
            self.response_complete = true;
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _n: usize) -> Action {
        self.callback(meter::Callback::ResponseBody);
        if matches!(self.phase, Phase::Forwarded { .. }) {
            self.response_complete = true;
            // A replay cannot carry them: it says which it lacks.
            let names: Vec<String> =
                host::all_headers(MapType::HttpResponseTrailers).into_iter().map(|(n, _)| n).collect();
            if let Some(r) = self.response.as_mut() {
                crate::record::note_dropped_trailers(r, &names);
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.callback(meter::Callback::Log);
        self.log_exchange();
        reply::forget_mcp(self.context_id);
        // Its counters are all counted: the next flush says so (`idemgate.requests_settled`).
        host::request_settled();
        meter::request_logged();
    }
}

impl Http {
    /// `Phase::McpBody`: a chunk of an MCP POST's body; the same limits as a protected body (it may
    /// be a protected call), refused as JSON-RPC errors with id null (the id is not read yet).
    fn mcp_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(policy) = self.policy_index.and_then(|i| self.shared.config.policy_at(i)) else {
            self.release_budget();
            return self.fail_closed_here(Broken::PolicyMissing, "mcp_body");
        };
        let refusal = match check_body_size(body_size as u64, policy) {
            Err(p) => Some(p),
            Ok(()) => {
                let delta = (body_size as u64).saturating_sub(self.budgeted);
                let b = &self.shared.buffered;
                if b.get().saturating_add(delta) > self.shared.config.max_buffered_bytes {
                    Some(ProblemKind::BufferBudgetExceeded { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS })
                } else {
                    b.set(b.get() + delta);
                    self.budgeted = body_size as u64;
                    None
                }
            }
        };
        if let Some(p) = refusal {
            self.release_budget();
            self.set_mcp_reply(b"null".to_vec(), vec![]);
            return self.answer(p, None);
        }
        if end_of_stream {
            self.mcp_body_complete()
        } else {
            Action::Pause
        }
    }

    /// This request's replies are JSON-RPC, to id `id` (JSON text).
    fn set_mcp_reply(&self, id: Vec<u8>, batch: Vec<Vec<u8>>) {
        let head = self.req.as_ref().map(|r| &r.head).or(self.mcp_head.as_ref());
        let accepts = crate::mcp::Accepts::of(&head.map(|h| h.values("accept")).unwrap_or_default());
        reply::set_mcp(self.context_id, reply::McpReply { id, batch, accepts });
    }

    /// The whole body of an MCP POST: passed untouched unless it is a protected `tools/call`,
    /// which is then protected as an HTTP request with a key is, its fingerprint the tool name
    /// and canonical arguments (`crate::mcp`).
    fn mcp_body_complete(&mut self) -> Action {
        let body = host::buffer(BufferType::HttpRequestBody, self.body_size);
        self.release_budget();
        self.phase = Phase::Pass;
        let (Some(policy_index), Some(mut head)) = (self.policy_index, self.mcp_head.take()) else {
            return self.fail_closed(Broken::RequestMissing, "mcp_body_complete", None, Holding::Nothing);
        };
        let Some(policy) = self.shared.config.policy_at(policy_index).cloned() else {
            return self.fail_closed(Broken::PolicyMissing, "mcp_body_complete", None, Holding::Nothing);
        };
        let Some(mcp) = policy.mcp.as_ref() else {
            return self.fail_closed(Broken::PolicyMissing, "mcp_body_complete", None, Holding::Nothing);
        };
        let call = match crate::mcp::classify(&body, mcp) {
            crate::mcp::Classified::Pass => return Action::Continue,
            crate::mcp::Classified::Batch(ids) => {
                self.mcp_head = Some(head);
                self.set_mcp_reply(b"null".to_vec(), ids);
                return self.answer(ProblemKind::McpBatchRefused, None);
            }
            crate::mcp::Classified::Ambiguous => {
                self.mcp_head = Some(head);
                self.set_mcp_reply(b"null".to_vec(), vec![]);
                return self.answer(ProblemKind::McpBodyAmbiguous, None);
            }
            crate::mcp::Classified::Call(c) => c,
        };
        self.mcp_head = Some(head.clone());
        self.set_mcp_reply(call.id.clone(), vec![]);
        self.mcp_head = None;
        // A protected call under a gRPC content-type: read two ways (gRPC here, JSON by a server
        // that does not check the type), never forwarded, with or without a key.
        if head.is_grpc() {
            return self.answer(ProblemKind::McpBodyAmbiguous, None);
        }
        // The key: the header, then the body (`_meta`, a named argument), then derived.
        let key_values = head.values(&policy.header);
        let scope = CallerScope::of(&head, &policy.scope);
        let key = if !key_values.is_empty() {
            match admit(Some(&policy), &key_values) {
                Admission::Protect(k) => Some(k),
                Admission::Reject(p) => return self.answer(p, None),
                Admission::Pass => None,
            }
        } else if let Some(k) = call.key.as_ref() {
            let parsed = k
                .value
                .as_deref()
                .ok_or(crate::key::KeyError::MalformedString)
                .and_then(|v| crate::key::parse_key(v.as_bytes(), policy.key_max_length, policy.key_syntax));
            match parsed {
                Ok(k) => Some(k),
                Err(error) => {
                    return self.answer(
                        ProblemKind::KeyInvalid {
                            header: k.source.clone(),
                            error,
                            syntax: policy.key_syntax,
                            max_len: policy.key_max_length,
                        },
                        None,
                    )
                }
            }
        } else {
            None
        };
        let key = match key {
            Some(k) => k,
            None => {
                let derived = policy.derive_key.as_ref().and_then(|d| {
                    let d = crate::config::DeriveKey { include_body: true, ..d.clone() };
                    derive::derive(&head, &d, &policy.fingerprint, &scope, Some(&call.digest))
                });
                match derived {
                    Some(k) => {
                        self.count(Counter::DerivedKeys);
                        k
                    }
                    None => match admit(Some(&policy), &[]) {
                        Admission::Reject(p) => return self.answer(p, None),
                        _ => {
                            reply::forget_mcp(self.context_id);
                            return Action::Continue;
                        }
                    },
                }
            }
        };
        if let Err(p) = scope.admits(&policy.scope) {
            return self.answer(p, None);
        }
        self.count(Counter::Protected);
        if self.shared.config.hold_headers && !forbid_router_retries(&mut head) {
            return self.fail_closed(Broken::HostCallFailed, "mcp_retry_guard", None, Holding::Nothing);
        }
        let skey = StorageKey::derive(&policy.namespace, &scope, &key);
        let owner = self.shared.next_owner();
        let creator = creator_of(&policy, &head);
        let fp =
            Fingerprint::of_digest(&head, (fingerprint::BodyForm::CanonicalJson, call.digest), &policy.fingerprint).0;
        self.req = Some(Protected {
            policy_index,
            head,
            skey,
            scope,
            creator,
            owner,
            derive_at_body: false,
            mcp: Some(call.id),
        });
        debug!("{}", self.log_line("mcp_tools_call", &format!("tool={}", call.tool)));
        if matches!(policy.forwarding, Forwarding::Detached { .. }) {
            self.body = body;
        }
        let begun = self.begin(Some(fp));
        self.act(begun, Some(fp))
    }

    fn log_exchange(&mut self) {
        if self.req.is_none() && matches!(self.phase, Phase::Pass) {
            return; // unprotected: nothing to settle
        }
        self.release_budget();
        // A detached or held request whose client is gone can no longer be answered; the root
        // still settles a detached request's claim when the upstream answers. (The root takes a
        // context out of `live` when it answers it, and tells Envoy the outcome then.)
        let unanswered = self.shared.queues.live.borrow_mut().remove(&self.context_id);
        match std::mem::replace(&mut self.phase, Phase::Pass) {
            Phase::Forwarded { handle, fp, in_store } => {
                let outcome = match self.redirected(handle, fp, in_store) {
                    Ok(h) => settle::hand_over(&self.shared, h),
                    Err(code_details) => self.finish(handle, fp, in_store, code_details),
                };
                self.publish(outcome);
            }
            p @ Phase::Waiting { .. } => {
                // The client left (or the stream was reset) before the body was complete: the
                // request was never forwarded, so a retry may execute it.
                self.phase = p;
                self.release_unforwarded();
                self.publish(ABANDONED);
            }
            Phase::Calling { handle, .. } => {
                // The client left while the store answered: our claim may have landed. Free it,
                // owner-checked, through the root (this context's callout dies with it).
                self.release_local(handle);
                self.release_lost_claim();
                self.publish(ABANDONED);
            }
            // Sent by the root, which still settles its claim: only the client is gone.
            Phase::Detached if unanswered => self.publish("detached-client-left"),
            Phase::Held if unanswered => self.publish(ABANDONED),
            _ => {}
        }
    }
}

/// Who made a record, as a 409 names it: the request's `x-request-id` and its `log_headers`.
fn creator_of(policy: &Policy, head: &RequestHead) -> Creator {
    let first = |name: &str| head.values(name).first().map(|v| String::from_utf8_lossy(v).into_owned());
    Creator {
        request_id: first("x-request-id").unwrap_or_default(),
        log_values: policy.log_headers.iter().filter_map(|h| first(h).map(|v| (h.clone(), v))).collect(),
    }
}
