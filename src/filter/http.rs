//! The HTTP context: one per request. A small state machine over the core:
//!
//! ```text
//! headers ─(unprotected)─▶ pass          admit: 400 ─▶ answered
//!    │ local begin (no fingerprint yet): claim ─▶ Waiting{claim} | 409 | Waiting{no claim}
//! body end: fingerprint
//!    │ Waiting{claim}: mark forwarded locally     Waiting{no claim}: local begin(fp): replay | 409 | 422 | claim
//!    │ no store: ─▶ Forwarded
//!    │ store: claim-or-read (one round trip) ─▶ Calling ─▶ Forwarded | replay | 409 | 422 | 503 | pass
//! response: copied while it flows
//! on_log: Forwarded ─▶ classify ─▶ complete | release | unknown (local now; store writes via the root)
//! ```
//!
//! The request's data lives in the phase that needs it (`Phase`): a protected request's policy,
//! head, key, owner and claim are carried from phase to phase, so no phase can meet them missing.
//! Each step takes the phase out, acts, and leaves the next phase.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;

use log::{debug, error, info, warn};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use super::host::{self, Counter, HostShared};
use super::settle::{self, Claim};
use super::stores::{self, Unbuilt};
use super::writes;
use super::{reply, Forward, Shared, Waiter};
use crate::bench_host::meter;
use crate::config::{Forwarding, InFlight, OnUnavailable, Policy};
use crate::decision::{classify_routed, Exchange};
use crate::decision::{IN_FLIGHT_RETRY_AFTER_SECONDS, UNAVAILABLE_RETRY_AFTER_SECONDS};
use crate::engine::request::{
    self, Admitted, Answered, Asked, AtBodyEnd, AtMcpBody, Derived, KeyFrom, McpCall, NotProtected, Step, StoreAnswer,
};
use crate::etcd::Fence;
use crate::failsafe::{self, Broken, Holding};
use crate::fingerprint::Fingerprint;
use crate::local::{Begin, Handle, LocalError, Seen};
use crate::owner::OwnerToken;
use crate::problem::ProblemKind;
use crate::record::{Creator, Lifetimes, Record, State, StoredResponse};
use crate::redirect::{self, Handoff};
use crate::request::{RequestHead, ROUTER_RETRY_CAP};
use crate::scope::{CallerScope, StorageKey};
use crate::store::{self, StoreError, StoredValue, Transition, TransitionReply};

pub(super) use crate::record::NOT_REPLAYED;

/// Where a request is, with the data that phase needs (and nothing a phase cannot have).
/// One per request, held inline: boxing its large variants would cost an allocation per request.
#[allow(clippy::large_enum_variant)]
enum Phase {
    /// Not protected, or forwarded unprotected: every callback continues.
    Pass,
    /// A POST on an MCP route (`protocol: "mcp"`): whether it is protected is known only from
    /// its whole body (`mcp_body_complete`); nothing is held yet.
    McpBody { route: usize, policy: Arc<Policy>, head: RequestHead },
    /// Protected; waiting for the whole body, holding nothing (`seen`: the key's bucket as read
    /// at headers, for the claim at the body's end).
    Waiting { req: Protected, seen: Option<Seen> },
    /// A store call is in flight (claim-or-read, a take-over, or a read); the request is paused.
    Calling { req: Protected, call: Call },
    /// Forwarded upstream under our claim(s); its response is copied while it flows.
    Forwarded { req: Protected, claim: Claimed, response: Response, redirected: bool },
    /// Sent upstream by the root context (`forwarding: "detached"`); the root answers.
    Detached { skey: StorageKey },
    /// Held until the first attempt with this key finishes (`in_flight: "wait"`); the root answers.
    Held { skey: StorageKey },
    /// We answered locally (problem or replay): never store our own reply.
    Answered,
}

/// A protected request: its route's policy and everything known once its key is.
struct Protected {
    /// The route's index in the configuration (per-route counters, claims handed to the root).
    route: usize,
    policy: Arc<Policy>,
    head: RequestHead,
    skey: StorageKey,
    scope: CallerScope,
    creator: Creator,
    owner: OwnerToken,
    /// The key is derived at the end of the body (`derive_key.include_body`).
    derive_at_body: bool,
    /// An MCP `tools/call`: its JSON-RPC id (JSON text).
    mcp: Option<Vec<u8>>,
    /// The request body, kept for detached forwarding.
    body: Vec<u8>,
}

/// The claim(s) a forwarded request holds.
#[derive(Clone, Copy)]
struct Claimed {
    handle: Option<Handle>,
    fp: Fingerprint,
    in_store: bool,
}

/// A store call in flight (`Phase::Calling`).
struct Call {
    /// The local claim held meanwhile, if any.
    handle: Option<Handle>,
    fp: Fingerprint,
    token: u32,
    asked: Asked,
    /// When it was sent (this proxy's clock).
    sent_at_ms: u64,
    /// The request sent, kept to send again with its script in full if Redis answers NOSCRIPT.
    sent: store::StoreRequest,
    /// `store.kind: "etcd"`: the value the claim-or-read found and its revision, which a
    /// take-over or stale-to-unknown decided on it compares.
    fence: Option<Fence>,
}

/// The upstream's response as it flows (`Phase::Forwarded`).
#[derive(Default)]
struct Response {
    stored: Option<StoredResponse>,
    too_large: bool,
    complete: bool,
}

impl Protected {
    /// The storage key Envoy's filter state shows (none while the key waits for the body).
    fn published_key(&self) -> Option<&StorageKey> {
        (!self.derive_at_body).then_some(&self.skey)
    }

    /// The request's `accept-encoding` lines.
    fn accept_encoding(&self) -> Vec<Vec<u8>> {
        self.head.values("accept-encoding").into_iter().map(<[u8]>::to_vec).collect()
    }

    fn claim(&self, held: Claimed) -> Claim {
        Claim {
            handle: held.handle,
            fp: held.fp,
            in_store: held.in_store,
            owner: self.owner,
            skey: self.skey,
            policy_index: self.route,
            creator: self.creator.clone(),
            log: log_line(Some(self), "", "").trim_start_matches("idemgate: outcome= ").to_string(),
            mcp_id: self.mcp.clone(),
        }
    }
}

/// What a request holds when `handle` is its local claim, never forwarded (`fail_closed`).
fn holding(handle: Option<Handle>) -> Holding {
    if handle.is_some() {
        Holding::LocalClaim
    } else {
        Holding::Nothing
    }
}

fn log_line(req: Option<&Protected>, outcome: &str, extra: &str) -> String {
    let Some(r) = req else { return format!("idemgate: outcome={outcome} {extra}") };
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

pub struct Http {
    shared: Rc<Shared>,
    context_id: u32,
    phase: Phase,
    /// Bytes of request body this context has counted against the VM's budget.
    budgeted: u64,
    /// Bytes of the bucket read at headers (`Phase::Waiting`'s `seen`) counted against the same budget.
    seen_budgeted: u64,
    body_size: usize,
    /// The outcome was left in Envoy's filter state (`publish`): once per request.
    published: bool,
    /// The selected route, the label of per-route counters (known before the request is
    /// protected; `None` before a route is selected).
    counted_as: Option<usize>,
    /// The host's clock, read at most once per callback (`now`; cleared as each callback starts).
    clock: Cell<Option<u64>>,
}

/// Fault tests only (feature `crash-injection`, never in the shipped module): traps the VM at
/// `point` when the protected request carries `x-idemgate-test-crash: <point>`.
#[cfg(feature = "crash-injection")]
fn crash_point(req: &Protected, point: &str) {
    if req.head.values("x-idemgate-test-crash").first().is_some_and(|v| *v == point.as_bytes()) {
        std::process::abort();
    }
}

#[cfg(not(feature = "crash-injection"))]
fn crash_point(_req: &Protected, _point: &str) {}

/// Fault tests only (feature `crash-injection`, never in the shipped module): breaks one of the
/// filter's own invariants at `point` when the protected request carries
/// `x-idemgate-test-fault: <point>`, so a test can show the branch that meets it fails closed.
/// A request carries its policy, so "policy lost" is simulated: the branch a lost policy would
/// take is taken.
#[cfg(feature = "crash-injection")]
fn fault_point(req: &Protected, point: &str) -> bool {
    req.head.values("x-idemgate-test-fault").first().is_some_and(|v| *v == point.as_bytes())
}

#[cfg(not(feature = "crash-injection"))]
fn fault_point(_req: &Protected, _point: &str) -> bool {
    false
}

/// The outcome of a protected request whose client left before it was forwarded or answered.
const ABANDONED: &str = "abandoned";

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
            budgeted: 0,
            seen_budgeted: 0,
            body_size: 0,
            published: false,
            counted_as: None,
            clock: Cell::new(None),
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

    /// The one place a protected request's end is told to Envoy: its outcome slug and storage key
    /// go to the filter state an access log prints (`host::publish`). The first call wins.
    fn publish(&mut self, key: Option<&StorageKey>, outcome: &str) {
        if self.published {
            return;
        }
        self.published = true;
        host::publish(outcome, key);
    }

    fn count(&self, c: Counter) {
        self.shared.metrics.inc_for(c, self.counted_as);
    }

    /// A stored value that could not be read or verified: a seal that does not verify is counted
    /// on its own (`record_unauthentic`: tampering, a transplanted value, or a proxy without the
    /// secret the record was written with) and logged with the key's hash.
    fn count_unreadable(&self, req: &Protected, why: &store::ValueError) {
        if why.is_unauthentic() {
            self.count(Counter::RecordUnauthentic);
            warn!("{}", log_line(Some(req), "record_unauthentic", &format!("error={why}")));
        }
    }

    /// Sends a problem (and never stores it).
    fn answer(&mut self, req: Option<&Protected>, problem: ProblemKind, creator: Option<&Creator>) -> Action {
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
        info!("{}", log_line(req, problem.slug(), &by));
        let request_id = req.map_or_else(
            || host::header(MapType::HttpRequestHeaders, "x-request-id").unwrap_or_default(),
            |r| r.creator.request_id.clone(),
        );
        self.phase = Phase::Answered;
        self.publish(req.and_then(Protected::published_key), problem.slug());
        reply::problem(&problem, &request_id, creator);
        Action::Pause
    }

    /// This proxy holds the key as outcome-unknown: read (never claim) what the store holds, in
    /// case an operator settled it there.
    fn read_settled(&mut self, req: Protected, fp: Fingerprint) -> Action {
        let sent = stores::read_request(&self.shared, &req.skey);
        self.call(req, sent, None, fp, Asked::Settled, None)
    }

    /// A "cannot happen" branch: refuse by the one rule (`failsafe::refuse`), never forward.
    /// `branch` names the branch in the log line; `handle` is the local claim held, if any.
    fn fail_closed(
        &mut self,
        req: Option<&Protected>,
        broken: Broken,
        branch: &str,
        handle: Option<Handle>,
        holding: Holding,
    ) -> Action {
        let refusal = failsafe::refuse(broken, holding);
        if refusal.release_local {
            self.release_local(handle);
        }
        if refusal.release_store {
            if let Some(r) = req {
                self.release_lost_claim(r, None);
            }
        }
        error!("{}", log_line(req, "internal_state", &format!("branch={branch} broken={}", broken.as_str())));
        self.answer(req, refusal.problem, None)
    }

    fn replay(&mut self, req: &Protected, record: Record) -> Action {
        if let State::Completed(r) = &record.state {
            self.count(Counter::Replayed);
            let by = format!("status={} created_by_request_id={}", r.status, record.creator.request_id);
            debug!("{}", log_line(Some(req), "replayed", &by));
            self.phase = Phase::Answered;
            let accept: Vec<Vec<u8>> = req.accept_encoding();
            let accept: Vec<&[u8]> = accept.iter().map(Vec::as_slice).collect();
            let max_decoded = req.policy.max_response_body_bytes;
            let now = self.now();
            let key = req.published_key();
            let sent = reply::replay(&record, &req.creator.request_id, now, &accept, max_decoded, |slug| {
                self.publish(key, slug)
            });
            if let Some(c) = sent.counter() {
                self.shared.metrics.inc_for(c, self.counted_as);
            }
            return Action::Pause;
        }
        let creator = record.creator.clone();
        match record.state {
            State::CompletedTooLarge { status, location } => {
                let location = location.map(|l| String::from_utf8_lossy(&l).into_owned());
                self.answer(Some(req), ProblemKind::ResponseNotStored { status, location }, Some(&creator))
            }
            // Only completed records are replayed.
            _ => self.answer(Some(req), ProblemKind::OutcomeUnknown, Some(&creator)),
        }
    }

    /// A request meeting its key in flight: 409 now, or (wait mode) held until the first attempt
    /// finishes. The fingerprint is needed to tell a replay from a 422, so a wait starts once the
    /// body is complete.
    fn in_flight_or_wait(&mut self, req: Protected, fp: Option<Fingerprint>, creator: Option<&Creator>) -> Action {
        match (req.policy.in_flight, fp) {
            (InFlight::Wait { .. }, None) => self.wait_for_body(req, None),
            (InFlight::Wait { wait_ms }, Some(fp)) => {
                let now = self.now();
                self.shared.push_waiter(Waiter {
                    context_id: self.context_id,
                    skey: req.skey,
                    fp,
                    request_id: req.creator.request_id.clone(),
                    deadline_ms: now.saturating_add(wait_ms),
                    mismatch_status: req.policy.mismatch_status,
                    policy_index: req.route,
                    next_store_poll_ms: now,
                    polling: false,
                    accept_encoding: req.accept_encoding(),
                    max_decoded_bytes: req.policy.max_response_body_bytes,
                });
                self.count(Counter::Waited);
                debug!("{}", log_line(Some(&req), "waiting", &format!("wait_ms={wait_ms}")));
                self.phase = Phase::Held { skey: req.skey };
                Action::Pause
            }
            _ => self.answer(
                Some(&req),
                ProblemKind::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS },
                creator,
            ),
        }
    }

    /// At the request headers, a protected request whose decision needs its body. With
    /// `hold_headers` (the default; Envoy's `allow_on_headers_stop_iteration`) the headers wait
    /// too. Without it the headers go on to the router, which starts the upstream request, while
    /// the body callbacks return `Pause` (Envoy buffers the body): the upstream never receives the
    /// request's end before the claim, and a request refused then is answered locally, which
    /// resets its upstream stream (a request never complete, never executed).
    fn wait_for_body(&mut self, req: Protected, seen: Option<Seen>) -> Action {
        // The bucket read at headers is kept for the claim only within the worker's buffer budget
        // (counted with the bodies being buffered): beyond it, the claim reads the bucket again.
        let b = &self.shared.buffered;
        let seen = seen.filter(|s| {
            let fits = b.get().saturating_add(s.bytes()) <= self.shared.config.max_buffered_bytes;
            if fits {
                b.set(b.get() + s.bytes());
                self.seen_budgeted = s.bytes();
            }
            fits
        });
        self.phase = Phase::Waiting { req, seen };
        if self.shared.config.hold_headers {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn local_error(&mut self, req: &Protected, e: LocalError) -> Action {
        self.count(Counter::LocalErrors);
        warn!("{}", log_line(Some(req), "local_error", &format!("error={e:?}")));
        self.answer(
            Some(req),
            ProblemKind::StoreUnavailable { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS },
            None,
        )
    }

    /// The local tier's `begin` (`seen`: the bucket as read at headers).
    fn begin(&self, req: &Protected, fp: Option<Fingerprint>, seen: Option<Seen>) -> Result<Begin, LocalError> {
        let t = &self.shared.table;
        t.begin_after(&mut HostShared, req.skey, fp, self.now(), &req.policy, req.owner, &req.creator, seen)
    }

    /// Acts on the local tier's answer. `fp` is set once the body is complete.
    fn act(&mut self, req: Protected, begun: Result<Begin, LocalError>, fp: Option<Fingerprint>) -> Action {
        if let Ok(Begin::Claimed { took_over, evicted, .. }) = &begun {
            self.count(if *took_over { Counter::TakenOver } else { Counter::Claimed });
            if *evicted {
                self.count(Counter::LocalEvictions);
            }
        }
        let step = request::after_local(begun, fp, self.store_mode(), self.now());
        self.run(req, step, None)
    }

    /// The store this request runs with (`None`: the local tier only).
    fn store_mode(&self) -> request::StoreMode {
        self.shared.config.store.as_ref().map(|c| c.on_unavailable)
    }

    /// Executes the request machine's next step (`crate::engine::request`). `fence`: the store
    /// value a store answer decided on, which a take-over or stale-to-unknown compares.
    fn run(&mut self, req: Protected, step: Step, fence: Option<Fence>) -> Action {
        match step {
            Step::WaitForBody { seen } => self.wait_for_body(req, seen),
            Step::PauseForBody => {
                self.phase = Phase::Waiting { req, seen: None };
                Action::Pause
            }
            Step::ClaimInStore { handle, fp } => self.claim_in_store(req, handle, fp),
            Step::ReadSettled { fp } => self.read_settled(req, fp),
            Step::Forward { handle, fp, in_store, lock_from_ms } => {
                self.forward(req, Claimed { handle, fp, in_store }, lock_from_ms)
            }
            Step::Replay { record, cache } => {
                if let Some(h) = cache {
                    let _ = self.shared.table.complete(&mut HostShared, &h, record.clone(), self.now());
                }
                self.replay(&req, record)
            }
            Step::InFlight { creator, release, fp } => {
                self.release_local(release);
                self.in_flight_or_wait(req, fp, creator.as_ref())
            }
            Step::Reply { problem, creator, release } => {
                self.release_local(release);
                self.answer(Some(&req), problem, creator.as_ref())
            }
            Step::MarkUnknown { old_owner, creator, release } => {
                self.release_local(release);
                let unknown = Transition::stale_to_unknown(old_owner, &Lifetimes::of(&req.policy));
                self.enqueue(&req, fence.as_ref(), "stale_to_unknown", unknown, None);
                self.answer(Some(&req), ProblemKind::OutcomeUnknown, Some(&creator))
            }
            Step::TakeOver { handle, fp, old, free } => self.take_over(req, handle, fp, &old, free, fence),
            Step::Unreadable { why, problem, release } => {
                self.release_local(release);
                self.count_unreadable(&req, &why);
                warn!("{}", log_line(Some(&req), "record_unreadable", &format!("error={why}")));
                self.answer(Some(&req), problem, None)
            }
            Step::UnknownStands { unreadable } => {
                if let Some(why) = unreadable {
                    self.count_unreadable(&req, &why);
                }
                self.count(Counter::UnknownOutcome);
                self.answer(Some(&req), ProblemKind::OutcomeUnknown, None)
            }
            Step::LocalFailed(e) => self.local_error(&req, e),
            Step::PassUnprotected => {
                self.publish(req.published_key(), "passed-unprotected");
                self.phase = Phase::Pass;
                Action::Continue
            }
            Step::FailClosed { broken, branch, handle } => {
                self.fail_closed(Some(&req), broken, branch, handle, holding(handle))
            }
        }
    }

    /// The request headers' step decided the request is not protected (`request::at_headers`).
    fn not_protected_at_headers(&mut self, not: NotProtected, mut head: RequestHead) -> Action {
        match not {
            NotProtected::Pass | NotProtected::Unprotected { .. } => Action::Continue,
            NotProtected::RouteAmbiguous { first, other } => {
                debug!("idemgate: outcome=route_ambiguous routes={first},{other} path={}", head.path_without_query());
                self.answer(None, ProblemKind::RouteAmbiguous, None)
            }
            NotProtected::PolicyMissing { .. } => {
                self.fail_closed(None, Broken::PolicyMissing, "request_headers_policy", None, Holding::Nothing)
            }
            NotProtected::McpBody { route, policy } => {
                // Without `hold_headers` the headers go upstream now, before the body says whether
                // the call is protected: the router is told not to re-send it now, as for any
                // protected request (the one change an unprotected MCP POST then sees).
                if !self.shared.config.hold_headers && !forbid_router_retries(&mut head) {
                    return self.fail_closed(None, Broken::HostCallFailed, "mcp_retry_guard", None, Holding::Nothing);
                }
                self.phase = Phase::McpBody { route, policy, head };
                if self.shared.config.hold_headers {
                    Action::Pause
                } else {
                    Action::Continue
                }
            }
            NotProtected::GrpcPassed { .. } => {
                self.count(Counter::GrpcPassed);
                debug!("idemgate: outcome=grpc_passed_unprotected path={}", head.path_without_query());
                Action::Continue
            }
            NotProtected::Refuse { problem, .. } => self.answer(None, problem, None),
        }
    }

    /// Sends the store a claim-or-read (`Step::ClaimInStore`).
    fn claim_in_store(&mut self, req: Protected, handle: Option<Handle>, fp: Fingerprint) -> Action {
        let lifetimes = Lifetimes::of(&req.policy);
        let record = Record::in_progress(fp, req.creator.clone(), req.owner, self.now(), &lifetimes);
        let Some(seal) = self.shared.seal.as_ref() else {
            return self.fail_closed(Some(&req), Broken::StoreMissing, "claim_without_seal", handle, holding(handle));
        };
        match stores::claim_request(&self.shared, &req.skey, &req.owner, &record, &lifetimes, seal, self.now()) {
            Ok(sent) => self.call(req, sent, handle, fp, Asked::Claim, None),
            // Nothing was sent: the store counts as unavailable (never a claim without a lease).
            Err(Unbuilt::NoLease) => self.store_failed(req, handle, &StoreError::Garbled(Unbuilt::NoLease.to_string())),
            Err(Unbuilt::Broken(why)) => {
                warn!("{}", log_line(Some(&req), "internal_state", &format!("error={why}")));
                self.fail_closed(Some(&req), Broken::ImpossibleDecision, "claim_request", handle, holding(handle))
            }
        }
    }

    fn call(
        &mut self,
        req: Protected,
        sent: store::StoreRequest,
        handle: Option<Handle>,
        fp: Fingerprint,
        asked: Asked,
        fence: Option<Fence>,
    ) -> Action {
        let shared = Rc::clone(&self.shared);
        let Some(cfg) = shared.config.store.as_ref() else {
            return self.fail_closed(Some(&req), Broken::StoreMissing, "store_call", handle, holding(handle));
        };
        self.count(Counter::StoreCalls);
        // The only store calls a client waits for (the rest are made by the root context).
        self.count(Counter::StoreCallsWaited);
        match writes::dispatch(cfg, &sent, &shared.credentials) {
            Ok(token) => {
                let call = Call { handle, fp, token, asked, sent_at_ms: self.now(), sent, fence };
                self.phase = Phase::Calling { req, call };
                Action::Pause
            }
            Err(e) => self.store_failed(req, handle, &StoreError::Garbled(e)),
        }
    }

    /// Redis answered our claim-or-read (or take-over) NOSCRIPT: it does not hold the script, so
    /// the script did not run and nothing was claimed. The same call goes once more with the
    /// script in full (`EVAL`, which also loads it). A NOSCRIPT to a call that carried its script
    /// is no answer Redis gives: taken as a lost answer (503, the claim released owner-checked).
    fn send_with_script(&mut self, req: Protected, call: Call) -> Action {
        match call.sent.with_script() {
            Some(again) => {
                self.count(Counter::StoreScriptLoads);
                info!("{}", log_line(Some(&req), "store_script_missing", "resent=eval"));
                self.call(req, again, call.handle, call.fp, call.asked, call.fence)
            }
            None => self.store_answer_lost(
                req,
                call.handle,
                call.fence.as_ref(),
                &StoreError::Garbled("NOSCRIPT to a call carrying its script".into()),
            ),
        }
    }

    /// The claim (or take-over) was sent but its answer is lost or garbled: it may have landed
    /// (a store that timed out can still run it). Release it, owner-checked, through the root,
    /// which retries with backoff: otherwise a claim nothing executed under would answer retries
    /// with in-flight, then outcome-unknown. Then answer as for any store failure.
    fn store_answer_lost(
        &mut self,
        req: Protected,
        handle: Option<Handle>,
        fence: Option<&Fence>,
        e: &StoreError,
    ) -> Action {
        self.release_lost_claim(&req, fence);
        self.store_failed(req, handle, e)
    }

    /// The store could not answer: 503 (reject) or forward unprotected (pass).
    fn store_failed(&mut self, req: Protected, handle: Option<Handle>, e: &StoreError) -> Action {
        let Some(on_unavailable) = self.shared.config.store.as_ref().map(|c| c.on_unavailable) else {
            self.release_local(handle);
            return self.fail_closed(Some(&req), Broken::StoreMissing, "store_failed", None, Holding::Nothing);
        };
        self.store_failed_as(req, handle, e, on_unavailable)
    }

    /// `store_failed`, with `on_unavailable` given.
    fn store_failed_as(
        &mut self,
        req: Protected,
        handle: Option<Handle>,
        e: &StoreError,
        on_unavailable: OnUnavailable,
    ) -> Action {
        self.count(Counter::StoreErrors);
        self.release_local(handle);
        let step = request::after_store_failure(&req.policy, on_unavailable);
        match &step {
            Step::PassUnprotected => {
                self.count(Counter::StorePassed);
                warn!("{}", log_line(Some(&req), "store_unavailable_passed", &format!("error={e}")));
            }
            Step::Reply { .. } => warn!("{}", log_line(Some(&req), "store_unavailable", &format!("error={e}"))),
            _ => {}
        }
        self.run(req, step, None)
    }

    /// Forwards under our claim(s), whose lock runs from `lock_from_ms` (the store claim's send,
    /// or now for the local tier's).
    fn forward(&mut self, mut req: Protected, held: Claimed, lock_from_ms: u64) -> Action {
        let Forwarding::Detached { cluster, timeout_ms, hop } = &req.policy.forwarding else {
            debug!("{}", log_line(Some(&req), "forwarded", ""));
            self.phase = Phase::Forwarded { req, claim: held, response: Response::default(), redirected: false };
            return Action::Continue;
        };
        let (cluster, timeout_ms, hop) = (cluster.clone(), *timeout_ms, *hop);
        let lock_deadline_ms = Lifetimes::of(&req.policy).lock_expires_at(lock_from_ms);
        // The root sends it: its callout outlives this request if the client leaves.
        let headers = req
            .head
            .headers
            .iter()
            .filter(|(n, _)| {
                !NOT_REPLAYED.contains(&n.as_str()) && n != "expect" && n != crate::decision::HOP_PROBE_HEADER
            })
            .filter_map(|(n, v)| std::str::from_utf8(v).ok().map(|v| (n.clone(), v.to_string())))
            .collect();
        debug!("{}", log_line(Some(&req), "forwarded", &format!("detached=true cluster={cluster}")));
        self.shared.push_forward(Forward {
            context_id: self.context_id,
            cluster,
            timeout_ms,
            hop,
            headers,
            body: std::mem::take(&mut req.body),
            claim: req.claim(held),
            request_id: req.creator.request_id.clone(),
            sent_at_ms: 0,
            lock_deadline_ms,
        });
        self.phase = Phase::Detached { skey: req.skey };
        Action::Pause
    }

    /// The store's answer to our claim-or-read, take-over or read: parsed here, decided by the
    /// request machine (`crate::engine::request`).
    fn on_store_answer(&mut self, req: Protected, call: Call, status: Option<u16>, body: &[u8]) -> Action {
        let shared = Rc::clone(&self.shared);
        let sent = request::Sent { handle: call.handle, fp: call.fp, sent_at_ms: call.sent_at_ms };
        let now = self.now();
        let on_unavailable = shared.config.store.as_ref().map_or(OnUnavailable::Reject, |c| c.on_unavailable);
        let (answer, fence) = match call.asked {
            Asked::TakeOver => {
                let reply = stores::parse_take_over(&shared, status, body, &req.skey, &req.owner);
                if matches!(reply, Ok(TransitionReply::Changed | TransitionReply::ClaimGoneRewritten)) {
                    self.count(Counter::TakenOver);
                }
                (StoreAnswer::TakeOver(reply), None)
            }
            Asked::Settled => {
                let reply = match shared.seal.as_ref() {
                    Some(seal) => stores::parse_read(&shared, status, body, &req.skey, seal, now),
                    None => Err(StoreError::Garbled("a read answer without its seal".into())),
                };
                (StoreAnswer::Settled(reply), None)
            }
            Asked::Claim => {
                let Some(seal) = shared.seal.as_ref() else {
                    let e = StoreError::Garbled("a claim answer without its seal".into());
                    return self.store_failed(req, call.handle, &e);
                };
                match stores::parse_claim(&shared, status, body, &req.owner, &req.skey, seal, now) {
                    Ok((reply, fence)) => (StoreAnswer::Claim(Ok(reply)), fence),
                    Err(e) => (StoreAnswer::Claim(Err(e)), None),
                }
            }
        };
        let answered = request::after_store_answer(answer, &sent, &req.policy, on_unavailable, now);
        if call.asked == Asked::Claim && matches!(answered, Answered::Next(Step::Replay { .. })) {
            self.count(Counter::StoreReplays);
        }
        match answered {
            Answered::Next(step) => self.run(req, step, fence.or(call.fence)),
            Answered::Resend => self.send_with_script(req, call),
            Answered::Lost { error } => self.store_answer_lost(req, call.handle, call.fence.as_ref(), &error),
            // The store claimed the key for us, so late that the claim's lock may already be
            // judged stale: another request may then have marked it outcome-unknown or taken it
            // over and forwarded. Handled as a lost answer: released owner-checked (a no-op if
            // the key changed hands), never forwarded.
            Answered::TooLate { waited_ms, lock_ms, run_ms } => {
                self.count(Counter::StoreAnswersTooLate);
                let why = format!(
                    "the store's claim answer came {waited_ms} ms after the claim was sent, too late for its lock ({lock_ms} ms; the upstream may run {run_ms} ms more)"
                );
                // The store answered: this is no outage, so never forwarded unprotected either,
                // even with on_unavailable "pass" (another request may hold the key by now).
                self.release_lost_claim(&req, call.fence.as_ref());
                self.store_failed_as(req, call.handle, &StoreError::Garbled(why), OnUnavailable::Reject)
            }
        }
    }

    fn take_over(
        &mut self,
        req: Protected,
        handle: Option<Handle>,
        fp: Fingerprint,
        old: &StoredValue,
        free: bool,
        fence: Option<Fence>,
    ) -> Action {
        let lifetimes = Lifetimes::of(&req.policy);
        let record = Record::in_progress(fp, req.creator.clone(), req.owner, self.now(), &lifetimes);
        let shared = Rc::clone(&self.shared);
        let Some(seal) = shared.seal.as_ref() else {
            return self.fail_closed(
                Some(&req),
                Broken::StoreMissing,
                "take_over_without_seal",
                handle,
                holding(handle),
            );
        };
        let t = Transition::take_over(old.owner, req.owner, record, free, &lifetimes);
        match stores::transition_request(&shared, &t, &req.skey, seal, self.now(), fence.as_ref()) {
            Ok(sent) => self.call(req, sent, handle, fp, Asked::TakeOver, fence),
            Err(Unbuilt::NoLease) => self.store_failed(req, handle, &StoreError::Garbled(Unbuilt::NoLease.to_string())),
            Err(Unbuilt::Broken(why)) => {
                warn!("{}", log_line(Some(&req), "internal_state", &format!("error={why}")));
                self.fail_closed(Some(&req), Broken::ImpossibleDecision, "take_over_request", handle, holding(handle))
            }
        }
    }

    /// Hands a write to the root context, which outlives this request.
    fn enqueue(
        &self,
        req: &Protected,
        fence: Option<&Fence>,
        what: &'static str,
        t: Transition,
        fallback: Option<Transition>,
    ) {
        if self.shared.config.store.is_none() {
            return;
        }
        self.shared.push_write_fenced(what, &req.skey, &t, fallback.as_ref(), fence);
    }

    /// A claim-or-read or take-over was sent and its answer is lost (or the client left while it
    /// ran): it may land in the store later, even after this release (Envoy's host answers every
    /// callout on the root, so the request may still be in flight). The release is owner-checked
    /// and leaves a tombstone if the claim has not landed yet, which the claim script honours.
    fn release_lost_claim(&self, req: &Protected, fence: Option<&Fence>) {
        self.enqueue(req, fence, "release", Transition::release_lost(req.owner, &Lifetimes::of(&req.policy)), None);
    }

    /// The whole body is here: fingerprint it and go on.
    fn body_complete(&mut self, mut req: Protected, seen: Option<Seen>) -> Action {
        crash_point(&req, "body");
        let body = host::buffer(BufferType::HttpRequestBody, self.body_size);
        self.release_budget();
        let (fp, derived, keep_body) =
            match request::at_body_end(&req.policy, &mut req.head, &req.scope, req.derive_at_body, &body) {
                AtBodyEnd::Fingerprinted { fp, derived, keep_body } => (fp, derived, keep_body),
                AtBodyEnd::Pass => {
                    // No key can be derived: the request is not protected.
                    self.phase = Phase::Pass;
                    return Action::Continue;
                }
            };
        if let Some(derived) = derived {
            self.key_derived_with_body(&mut req, &derived);
        }
        if keep_body {
            req.body = body;
        }
        let begun = self.begin(&req, Some(fp), seen);
        self.act(req, begun, Some(fp))
    }

    /// `derive_key.include_body`: the key (and so the storage key) is known only now (the engine
    /// added it to the request's head).
    fn key_derived_with_body(&mut self, req: &mut Protected, derived: &Derived) {
        let key = &derived.key;
        req.skey = derived.skey;
        req.derive_at_body = false;
        // With `hold_headers: false` the request headers went upstream at their end, without the
        // key (it was not known yet): the key protects the request here, and the upstream never
        // sees it (Envoy no longer lends the map; a write would only be refused).
        if self.shared.config.hold_headers {
            let _ = host::set_header(MapType::HttpRequestHeaders, &req.policy.header, Some(key.as_str()));
        }
        self.count(Counter::DerivedKeys);
        debug!("{}", log_line(Some(req), "derived_key", "key_source=derived"));
    }

    fn release_budget(&mut self) {
        if self.budgeted > 0 || self.seen_budgeted > 0 {
            let b = &self.shared.buffered;
            b.set(b.get().saturating_sub(self.budgeted + self.seen_budgeted));
            self.budgeted = 0;
            self.seen_budgeted = 0;
        }
    }

    /// Gives back the bytes of the bucket read at headers (`seen_budgeted`): its `seen` is dropped.
    fn drop_seen_budget(&mut self) {
        let b = &self.shared.buffered;
        b.set(b.get().saturating_sub(self.seen_budgeted));
        self.seen_budgeted = 0;
    }

    fn release_local(&self, handle: Option<Handle>) {
        settle::release_local(&self.shared, handle, self.now());
    }

    /// A forwarded exchange Envoy ended for an internal redirect (the router took the upstream's
    /// 3xx, so no response reached this filter): its claim, to hand over to the re-created stream.
    /// Otherwise the response code details if they were read.
    fn redirected(
        &self,
        req: &Protected,
        held: Claimed,
        response: &Response,
    ) -> Result<Handoff<Claim>, Option<String>> {
        if response.stored.is_some() {
            return Err(None);
        }
        let details = host::property(&["response", "code_details"])
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        if details != redirect::REDIRECT_CODE_DETAILS {
            return Err(Some(details));
        }
        Ok(Handoff {
            claim: req.claim(held),
            skey: req.skey,
            policy_index: req.route,
            url: format!("{}{}", req.head.authority, req.head.path),
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
            let Some(policy) = self.shared.config.shared_policy(i) else { continue };
            let Some((scope, skey)) = request::redirected_claim(&policy, &head) else { continue };
            let taken =
                self.shared.handoffs.borrow_mut().take(&skey, i, url.as_bytes(), connection, self.context_id, now);
            let Some(h) = taken else { continue };
            return Some(self.adopt(h, policy, head, scope));
        }
        None
    }

    /// Continues a handed-over claim: forwarded under it, settled at this stream's end.
    fn adopt(&mut self, h: Handoff<Claim>, policy: Arc<Policy>, mut head: RequestHead, scope: CallerScope) -> Action {
        let c = h.claim;
        self.counted_as = Some(c.policy_index);
        self.count(Counter::RedirectsFollowed);
        let retries_forbidden = forbid_router_retries(&mut head);
        let req = Protected {
            route: c.policy_index,
            policy,
            head,
            skey: c.skey,
            scope,
            creator: c.creator,
            owner: c.owner,
            derive_at_body: false,
            mcp: c.mcp_id,
            body: vec![],
        };
        if !retries_forbidden {
            // The claim stays (judged outcome-unknown once its lock expires): never re-sent.
            return self.fail_closed(
                Some(&req),
                Broken::HostCallFailed,
                "redirect_retry_guard",
                None,
                Holding::Forwarded,
            );
        }
        debug!("{}", log_line(Some(&req), "redirect_followed", &format!("from={}", h.url)));
        let claim = Claimed { handle: c.handle, fp: c.fp, in_store: c.in_store };
        self.phase = Phase::Forwarded { req, claim, response: Response::default(), redirected: true };
        Action::Continue
    }

    /// Settles a forwarded exchange; returns its outcome slug. `code_details`: Envoy's response
    /// code details if already read.
    fn finish(
        &mut self,
        req: &Protected,
        held: Claimed,
        response: Response,
        redirected: bool,
        code_details: Option<String>,
    ) -> &'static str {
        let status = response.stored.as_ref().map(|r| r.status).filter(|s| *s > 0);
        let mut x =
            Finished { status: status.map(Some), complete: response.complete, code_details, ..Finished::default() };
        // Whether the router re-sent it is read always (its warning below); every other fact only
        // when the classification needs it (`classify_routed`).
        let attempts = x.attempts();
        let headers = response.stored.as_ref().map_or(&[][..], |r| &r.headers[..]);
        let outcome = classify_routed(&mut x, headers, &req.policy);
        let outcome = if redirected { redirect::after_first_hop(outcome) } else { outcome };
        let detail = if log::log_enabled!(log::Level::Info) { x.detail() } else { String::new() };
        // The router was told to send it once; a later filter (or a host that ignores the cap)
        // may still have re-sent it. Nothing can undo that now: count it and say so.
        if attempts.is_some_and(|n| n > 1) {
            self.count(Counter::UpstreamAttemptsRepeated);
            warn!("{}", log_line(Some(req), "upstream_attempts_repeated", &x.detail()));
        }
        let claim = req.claim(held);
        settle::settle(&self.shared, &claim, outcome, response.stored, response.too_large, &detail)
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
        let Phase::Calling { call, .. } = &self.phase else { return };
        if token != call.token {
            return;
        }
        let Phase::Calling { req, call } = std::mem::replace(&mut self.phase, Phase::Pass) else { return };
        let (status, body) = writes::answer(body_size, num_headers);
        if self.on_store_answer(req, call, status, &body) == Action::Continue {
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
        let Admitted { route, policy, scope, key, skey, from } =
            match request::at_headers(&self.shared.config, &head, route_name.as_deref(), end_of_stream) {
                Ok(a) => a,
                Err(not) => {
                    self.counted_as = not.route();
                    return self.not_protected_at_headers(not, head);
                }
            };
        self.counted_as = Some(route);
        if from == KeyFrom::Derived {
            head.headers.push((policy.header.clone(), key.as_str().as_bytes().to_vec()));
            let _ = host::set_header(MapType::HttpRequestHeaders, &policy.header, Some(key.as_str()));
            self.count(Counter::DerivedKeys);
        }
        self.count(Counter::Protected);
        // At most once: Envoy's router must never re-send it (a route's retry_policy, hedging, or
        // retries a client asks for with x-envoy-* headers).
        if !forbid_router_retries(&mut head) {
            return self.fail_closed(None, Broken::HostCallFailed, "retry_guard", None, Holding::Nothing);
        }
        let derive_at_body = from == KeyFrom::DerivedAtBody;
        let owner = self.shared.next_owner();
        let creator = creator_of(&policy, &head);
        let req =
            Protected { route, policy, head, skey, scope, creator, owner, derive_at_body, mcp: None, body: vec![] };
        if from == KeyFrom::Derived {
            debug!("{}", log_line(Some(&req), "derived_key", "key_source=derived"));
        }
        if derive_at_body {
            // The key depends on the body: decide once it is here.
            return self.wait_for_body(req, None);
        }
        if end_of_stream {
            // The branch a policy lost before the fingerprint would take (fault tests only).
            if fault_point(&req, "policy-lost-at-headers") {
                return self.fail_closed(
                    Some(&req),
                    Broken::PolicyMissing,
                    "request_headers_fingerprint",
                    None,
                    Holding::Nothing,
                );
            }
            // No body: the fingerprint is known now.
            let fp = request::fingerprint_without_body(&req.policy, &req.head);
            let begun = self.begin(&req, Some(fp), None);
            return self.act(req, begun, Some(fp));
        }
        // Look at headers (nothing is claimed before the body is whole): a key held by a live
        // claim gets its 409 without buffering the body.
        let begun = self.begin(&req, None, None);
        self.act(req, begun, None)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.callback(meter::Callback::RequestBody);
        match std::mem::replace(&mut self.phase, Phase::Pass) {
            Phase::Waiting { req, seen } => self.request_body(req, seen, body_size, end_of_stream),
            Phase::McpBody { route, policy, head } => self.mcp_body(route, policy, head, body_size, end_of_stream),
            // Paused on a store call: keep buffering.
            p @ Phase::Calling { .. } => {
                self.phase = p;
                Action::Pause
            }
            p => {
                self.phase = p;
                Action::Continue
            }
        }
    }

    fn on_http_request_trailers(&mut self, _n: usize) -> Action {
        self.callback(meter::Callback::RequestBody);
        match std::mem::replace(&mut self.phase, Phase::Pass) {
            Phase::Waiting { mut req, seen } => {
                // Trailers reach the upstream with the request: part of its fingerprint.
                req.head.trailers = host::all_headers(MapType::HttpRequestTrailers);
                self.body_complete(req, seen)
            }
            Phase::McpBody { route, policy, head } => self.mcp_body_complete(route, policy, head),
            p @ Phase::Calling { .. } => {
                self.phase = p;
                Action::Pause
            }
            p => {
                self.phase = p;
                Action::Continue
            }
        }
    }

    fn on_http_response_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        self.callback(meter::Callback::ResponseHeaders);
        let Phase::Forwarded { req, response, .. } = &mut self.phase else { return Action::Continue };
        crash_point(req, "response");
        if fault_point(req, "lost-wake") {
            self.shared.lose_next_wake();
        }
        let policy = &req.policy;
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
        response.stored = Some(StoredResponse { status, headers, body: vec![] });
        response.complete = end_of_stream;
        // Publish the expiry policy to the client that created the record.
        if !policy.release_on_status.contains(&status) {
            let ttl = policy.ttl_seconds.to_string();
            let _ = host::add_header(MapType::HttpResponseHeaders, reply::EXPIRES_HEADER, &ttl);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.callback(meter::Callback::ResponseBody);
        let Phase::Forwarded { req, response, .. } = &mut self.phase else { return Action::Continue };
        let limit = req.policy.max_response_body_bytes as usize;
        if !response.too_large {
            let chunk = host::buffer(BufferType::HttpResponseBody, body_size);
            if let Some(r) = response.stored.as_mut() {
                if r.body.len() + chunk.len() > limit {
                    response.too_large = true;
                    r.body = vec![];
                } else {
                    r.body.extend_from_slice(&chunk);
                }
            }
        }
        if end_of_stream {
            response.complete = true;
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _n: usize) -> Action {
        self.callback(meter::Callback::ResponseBody);
        if let Phase::Forwarded { response, .. } = &mut self.phase {
            response.complete = true;
            // A replay cannot carry them: it says which it lacks.
            let names: Vec<String> =
                host::all_headers(MapType::HttpResponseTrailers).into_iter().map(|(n, _)| n).collect();
            if let Some(r) = response.stored.as_mut() {
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
    /// `Phase::Waiting`: a chunk of a protected request's body (`body_size` bytes so far).
    fn request_body(&mut self, req: Protected, seen: Option<Seen>, body_size: usize, end_of_stream: bool) -> Action {
        self.body_size = body_size;
        // The branch a policy lost while the body arrives would take (fault tests only).
        if fault_point(&req, "policy-lost-at-body") {
            self.release_budget();
            return self.fail_closed(Some(&req), Broken::PolicyMissing, "request_body", None, Holding::Nothing);
        }
        let max = self.shared.config.max_buffered_bytes;
        // The bucket read at headers is only a saving: it yields its bytes to its own body (the
        // claim then reads the bucket again) rather than have the body refused.
        let seen = if self.shared.buffered.get().saturating_add((body_size as u64).saturating_sub(self.budgeted)) > max
        {
            self.drop_seen_budget();
            None
        } else {
            seen
        };
        let b = &self.shared.buffered;
        match request::body_chunk(body_size as u64, self.budgeted, b.get(), max, &req.policy) {
            Ok(delta) => b.set(b.get() + delta),
            Err(p) => {
                self.release_budget();
                return self.answer(Some(&req), p, None);
            }
        }
        self.budgeted = body_size as u64;
        if end_of_stream {
            self.body_complete(req, seen)
        } else {
            self.phase = Phase::Waiting { req, seen };
            Action::Pause
        }
    }

    /// `Phase::McpBody`: a chunk of an MCP POST's body; the same limits as a protected body (it may
    /// be a protected call), refused as JSON-RPC errors with id null (the id is not read yet).
    fn mcp_body(
        &mut self,
        route: usize,
        policy: Arc<Policy>,
        head: RequestHead,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        self.body_size = body_size;
        let b = &self.shared.buffered;
        let max = self.shared.config.max_buffered_bytes;
        match request::body_chunk(body_size as u64, self.budgeted, b.get(), max, &policy) {
            Ok(delta) => {
                b.set(b.get() + delta);
                self.budgeted = body_size as u64;
            }
            Err(p) => {
                self.release_budget();
                self.set_mcp_reply(&head, b"null".to_vec(), vec![]);
                return self.answer(None, p, None);
            }
        }
        if end_of_stream {
            self.mcp_body_complete(route, policy, head)
        } else {
            self.phase = Phase::McpBody { route, policy, head };
            Action::Pause
        }
    }

    /// This request's replies are JSON-RPC, to id `id` (JSON text).
    fn set_mcp_reply(&self, head: &RequestHead, id: Vec<u8>, batch: Vec<Vec<u8>>) {
        let accepts = crate::mcp::Accepts::of(&head.values("accept"));
        reply::set_mcp(self.context_id, reply::McpReply { id, batch, accepts });
    }

    /// The whole body of an MCP POST: passed untouched unless it is a protected `tools/call`,
    /// which is then protected as an HTTP request with a key is, its fingerprint the tool name
    /// and canonical arguments (`crate::mcp`).
    fn mcp_body_complete(&mut self, route: usize, policy: Arc<Policy>, mut head: RequestHead) -> Action {
        let body = host::buffer(BufferType::HttpRequestBody, self.body_size);
        self.release_budget();
        self.phase = Phase::Pass;
        let call = match request::at_mcp_body(&policy, &head, &body) {
            AtMcpBody::Pass => {
                reply::forget_mcp(self.context_id);
                return Action::Continue;
            }
            AtMcpBody::PolicyMissing => {
                return self.fail_closed(None, Broken::PolicyMissing, "mcp_body_complete", None, Holding::Nothing)
            }
            AtMcpBody::Refuse { id, batch, problem } => {
                self.set_mcp_reply(&head, id, batch);
                return self.answer(None, problem, None);
            }
            AtMcpBody::Protect(call) => *call,
        };
        let McpCall { id, tool, scope, skey, derived, digest, .. } = call;
        self.set_mcp_reply(&head, id.clone(), vec![]);
        if derived {
            self.count(Counter::DerivedKeys);
        }
        self.count(Counter::Protected);
        if self.shared.config.hold_headers && !forbid_router_retries(&mut head) {
            return self.fail_closed(None, Broken::HostCallFailed, "mcp_retry_guard", None, Holding::Nothing);
        }
        let owner = self.shared.next_owner();
        let creator = creator_of(&policy, &head);
        let fp = request::mcp_fingerprint(&policy, &head, digest);
        let detached = matches!(policy.forwarding, Forwarding::Detached { .. });
        let req = Protected {
            route,
            policy,
            head,
            skey,
            scope,
            creator,
            owner,
            derive_at_body: false,
            mcp: Some(id),
            body: if detached { body } else { vec![] },
        };
        debug!("{}", log_line(Some(&req), "mcp_tools_call", &format!("tool={tool}")));
        let begun = self.begin(&req, Some(fp), None);
        self.act(req, begun, Some(fp))
    }

    fn log_exchange(&mut self) {
        self.release_budget();
        if matches!(self.phase, Phase::Pass) {
            return; // unprotected, or passed unprotected: nothing to settle
        }
        // A detached or held request whose client is gone can no longer be answered; the root
        // still settles a detached request's claim when the upstream answers. (The root takes a
        // context out of `live` when it answers it, and tells Envoy the outcome then.)
        let unanswered = self.shared.queues.live.borrow_mut().remove(&self.context_id);
        match std::mem::replace(&mut self.phase, Phase::Pass) {
            Phase::Forwarded { req, claim, response, redirected } => {
                let outcome = match self.redirected(&req, claim, &response) {
                    Ok(h) => settle::hand_over(&self.shared, h),
                    Err(code_details) => self.finish(&req, claim, response, redirected, code_details),
                };
                self.publish(req.published_key(), outcome);
            }
            Phase::Waiting { req, .. } => {
                // The client left (or the stream was reset) before the body was complete: it
                // held nothing (the claim is made at the body's end).
                self.publish(req.published_key(), ABANDONED);
            }
            Phase::Calling { req, call } => {
                // The client left while the store answered: our claim may have landed. Free it,
                // owner-checked, through the root (this context's callout dies with it).
                self.release_local(call.handle);
                self.release_lost_claim(&req, call.fence.as_ref());
                self.publish(req.published_key(), ABANDONED);
            }
            // Sent by the root, which still settles its claim: only the client is gone.
            Phase::Detached { skey } if unanswered => self.publish(Some(&skey), "detached-client-left"),
            Phase::Held { skey } if unanswered => self.publish(Some(&skey), ABANDONED),
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
