//! The HTTP context: one per request. Glue between Envoy's callbacks and the request machine
//! (`crate::engine::machine`), which holds the request's phase with its data and decides each
//! step: this file reads the host into the machine's inputs (the admitted headers, the body and
//! trailers, the store's parsed answer, the response as it flows, the exchange's classified
//! end) and carries its commands out with host calls (`Glue`: replies, replays, root writes,
//! waiters and detached forwards handed to the root, counters, logs, filter state).
//!
//! Kept here, beside the machine: what only the host can tell (the route name, the header map,
//! the body buffer, Envoy's response properties that classify an exchange, the connection an
//! internal redirect's hand-over is tied to), the worker's buffer budget count and the claims
//! handed over to redirects' streams (state the worker's requests share, in `Shared`), and the
//! store's wire (`filter/stores.rs` builds and parses). The machine decides what they mean.

use std::cell::Cell;
use std::rc::Rc;

use log::{debug, info, warn};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use super::host::{self, Counter, Histogram, HostShared};
use super::settle::{self, Claim};
use super::stores::{self, Unbuilt};
use super::writes;
use super::{reply, Shared};
use crate::bench_host::meter;
use crate::decision::{classify_routed, re_sent, Exchange};
use crate::engine::budget::Budget;
use crate::engine::forwards::Forward;
use crate::engine::machine::{
    self, log_line, Command, Count, Effects, Ended, Flow, Io, KeyHold, LogLevel, Machine, NotSent, Phase, Protected,
    Response, StoreOp,
};
use crate::engine::request::{self, Asked, KeyFrom, NotProtected, StoreAnswer};
use crate::failsafe::{Broken, Holding};
use crate::local::{SharedData, Table};
use crate::owner::OwnerToken;
use crate::problem::ProblemKind;
use crate::record::{Creator, Record, State};
use crate::redirect::{self, Handoff};
use crate::request::{RequestHead, ROUTER_RETRY_CAP};
use crate::scope::StorageKey;
use crate::store::{self, StoreError};

/// A store call in flight, as this glue sent it: its callout token and the request (sent again
/// with its script in full if Redis answers NOSCRIPT).
pub struct Wire {
    token: u32,
    sent: store::StoreRequest,
    /// When it was sent (`store_round_trip_ms`).
    sent_ms: u64,
}

pub struct Http {
    shared: Rc<Shared>,
    context_id: u32,
    machine: Machine<Wire>,
    /// The outcome was left in Envoy's filter state (`publish`): once per request.
    published: bool,
    /// The selected route, the label of per-route counters (known before the request is
    /// protected; `None` before a route is selected).
    counted_as: Option<usize>,
    /// The host's clock, read at most once per callback (`now`; cleared as each callback starts).
    clock: Cell<Option<u64>>,
    /// When this request claimed its key, until its claim is settled here or handed to the root
    /// (`key_held_ms`).
    held_since: Option<u64>,
    /// The request's mark (its key, `crate::redirect`) is in this stream's Request-life filter
    /// state: left here (`Command::Mark`) or found (a stream Envoy re-created for a redirect).
    marked: bool,
}

/// The machine's driver for one callback: its commands carried out with host calls.
struct Glue<'a> {
    shared: &'a Shared,
    context_id: u32,
    clock: &'a Cell<Option<u64>>,
    published: &'a mut bool,
    counted_as: Option<usize>,
    held_since: &'a mut Option<u64>,
    marked: &'a mut bool,
    sd: HostShared,
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

fn action(f: Flow) -> Action {
    match f {
        Flow::Continue => Action::Continue,
        Flow::Pause => Action::Pause,
    }
}

use crate::metrics::problem_counter;

impl Glue<'_> {
    fn now(&self) -> u64 {
        if let Some(t) = self.clock.get() {
            return t;
        }
        let t = host::now_ms();
        self.clock.set(Some(t));
        t
    }

    fn count(&self, c: Counter) {
        self.shared.metrics.inc_for(c, self.counted_as);
    }

    /// The one place a protected request's end is told to Envoy: its outcome slug and storage key
    /// go to the filter state an access log prints (`host::publish`). The first call wins.
    fn publish(&mut self, key: Option<&StorageKey>, outcome: &str) {
        if *self.published {
            return;
        }
        *self.published = true;
        // A marked request's key is in its filter state already (`host::mark`).
        host::publish(outcome, key.filter(|_| !*self.marked));
    }

    /// Sends a problem (and never stores it).
    fn answer(&mut self, req: Option<&Protected>, problem: ProblemKind, creator: Option<&Creator>) {
        self.count(problem_counter(&problem));
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
        self.publish(req.and_then(Protected::published_key), problem.slug());
        reply::problem(&problem, &request_id, creator);
    }

    /// Replays a completed record.
    fn replay(&mut self, req: &Protected, record: &Record) {
        let State::Completed(r) = &record.state else { return };
        self.count(Counter::Replayed);
        self.shared.metrics.record(Histogram::ReplayBytes, r.body.len() as u64);
        let by = format!("status={} created_by_request_id={}", r.status, record.creator.request_id);
        debug!("{}", log_line(Some(req), "replayed", &by));
        let accept: Vec<Vec<u8>> = req.accept_encoding();
        let accept: Vec<&[u8]> = accept.iter().map(Vec::as_slice).collect();
        let max_decoded = req.policy.max_response_body_bytes;
        let now = self.now();
        let key = req.published_key();
        let sent =
            reply::replay(record, &req.creator.request_id, now, &accept, max_decoded, |slug| self.publish(key, slug));
        if let Some(c) = sent.counter() {
            self.count(c);
        }
    }

    /// The claim this request held is settled here: how long it was held.
    fn settled(&mut self) {
        if let Some(since) = self.held_since.take() {
            let now = self.now();
            self.shared.metrics.record(Histogram::KeyHeldMs, now.saturating_sub(since));
        }
    }

    /// Holds the request for the root's waiters (`in_flight: "wait"`).
    fn hold(&mut self, req: &Protected, fp: crate::fingerprint::Fingerprint, wait_ms: u64) {
        let now = self.now();
        self.shared.push_waiter(req.waiter(self.context_id, fp, now, wait_ms));
        self.count(Counter::Waited);
        debug!("{}", log_line(Some(req), "waiting", &format!("wait_ms={wait_ms}")));
    }

    /// Hands the request to the root to send (`forwarding: "detached"`).
    fn detach(&mut self, mut forward: Box<Forward>) {
        forward.context_id = self.context_id;
        if let Some(since) = self.held_since.take() {
            self.shared.hold_from(forward.claim.owner, since);
        }
        self.shared.push_forward(*forward);
    }

    /// Dispatches a built store request: the calls a client waits for (the rest are made by the
    /// root context).
    fn dispatch(&mut self, sent: store::StoreRequest) -> Result<Wire, NotSent> {
        let Some(cfg) = self.shared.config.store.as_ref() else {
            return Err(NotSent::Broken { broken: Broken::StoreMissing, branch: "store_call" });
        };
        self.count(Counter::StoreCalls);
        self.count(Counter::StoreCallsWaited);
        match writes::dispatch(cfg, &sent, &self.shared.credentials) {
            Ok(token) => Ok(Wire { token, sent, sent_ms: self.now() }),
            Err(e) => Err(NotSent::Failed(StoreError::Garbled(e))),
        }
    }

    fn unbuilt(req: &Protected, e: Unbuilt, branch: &'static str) -> NotSent {
        match e {
            // Nothing was sent: the store counts as unavailable (never a claim without a lease).
            Unbuilt::NoLease => NotSent::Failed(StoreError::Garbled(Unbuilt::NoLease.to_string())),
            Unbuilt::Broken(why) => {
                warn!("{}", log_line(Some(req), "internal_state", &format!("error={why}")));
                NotSent::Broken { broken: Broken::ImpossibleDecision, branch }
            }
        }
    }

    fn command(&mut self, c: Command<'_>) {
        match c {
            Command::Count(c) => {
                match c {
                    // The local release is counted as `release_local` counts it: not per route.
                    Count::Released => self.shared.metrics.inc(Counter::Released),
                    c => self.count(settle::counter(c)),
                }
                match c.key_hold() {
                    Some(KeyHold::Starts) => *self.held_since = Some(self.now()),
                    Some(KeyHold::Ends) => self.settled(),
                    None => {}
                }
            }
            Command::Log(level, line) => host::log_line(level, &line),
            Command::Reply { req, problem, creator } => self.answer(req, problem, creator),
            Command::Replay { req, record } => self.replay(req, &record),
            Command::Write { what, skey, transition, fallback, fence } => {
                self.shared.push_write_fenced(what, &skey, *transition, fallback.map(|f| *f), fence)
            }
            Command::KeyDerived { header, key } => {
                // With `hold_headers: false` the request headers went upstream at their end,
                // without the key (it was not known yet): the key protects the request here, and
                // the upstream never sees it (Envoy no longer lends the map; a write would only
                // be refused).
                if self.shared.config.hold_headers {
                    let _ = host::set_header(MapType::HttpRequestHeaders, header, Some(key));
                }
            }
            Command::Hold { req, fp, wait_ms } => self.hold(req, fp, wait_ms),
            Command::Detach(forward) => self.detach(forward),
            Command::Publish { key, outcome } => self.publish(key.as_ref(), outcome),
            Command::McpReply { id, batch, accepts } => {
                reply::set_mcp(self.context_id, crate::mcp::Reply { id, batch, accepts })
            }
            Command::Mark { skey } => {
                if !*self.marked {
                    *self.marked = host::mark(&skey);
                }
            }
            Command::HandOver { claim, url } => {
                let h = Handoff {
                    skey: claim.skey,
                    policy_index: claim.policy_index,
                    url,
                    connection: u64_property(&["connection", "id"]),
                    marked: *self.marked,
                    from_context: self.context_id,
                    posted_ms: self.now(),
                    claim,
                };
                settle::hand_over(self.shared, h);
            }
        }
    }
}

impl Effects for Glue<'_> {
    fn logs(&self, level: LogLevel) -> bool {
        host::logs(level)
    }

    fn now_ms(&mut self) -> u64 {
        self.now()
    }

    fn local(&mut self) -> (&Table, &mut dyn SharedData) {
        (&self.shared.table, &mut self.sd)
    }

    fn run(&mut self, c: Command<'_>) {
        self.command(c)
    }
}

impl Io for Glue<'_> {
    type Wire = Wire;

    fn budget(&self) -> Budget {
        Budget { buffered: self.shared.buffered.get(), max: self.shared.config.max_buffered_bytes }
    }

    fn set_buffered(&mut self, buffered: u64) {
        self.shared.buffered.set(buffered);
    }

    fn read_body(&mut self, req: Option<&Protected>, size: usize) -> Vec<u8> {
        if let Some(req) = req {
            crash_point(req, "body");
        }
        host::buffer(BufferType::HttpRequestBody, size)
    }

    fn forbid_router_retries(&mut self, head: &mut RequestHead) -> bool {
        forbid_router_retries(head)
    }

    fn next_owner(&mut self) -> OwnerToken {
        self.shared.next_owner()
    }

    fn take_handoff(&mut self, skey: &StorageKey, policy_index: usize, original_url: &[u8]) -> Option<Handoff<Claim>> {
        if self.shared.handoffs.borrow().is_empty() {
            return None;
        }
        let on = redirect::Stream {
            mark: host::read_mark(),
            connection: u64_property(&["connection", "id"]),
            context_id: self.context_id,
        };
        let now = self.now();
        let h = self.shared.handoffs.borrow_mut().take(skey, policy_index, original_url, on, now)?;
        *self.marked = true;
        Some(h)
    }

    fn send(&mut self, req: &Protected, op: StoreOp<'_, Wire>) -> Result<Wire, NotSent> {
        let shared = self.shared;
        let sent = match op {
            StoreOp::Claim { record, lifetimes } => {
                let Some(seal) = shared.seal.as_ref() else {
                    return Err(NotSent::Broken { broken: Broken::StoreMissing, branch: "claim_without_seal" });
                };
                stores::claim_request(shared, &req.skey, &req.owner, &record, &lifetimes, seal, self.now())
                    .map_err(|e| Self::unbuilt(req, e, "claim_request"))?
            }
            StoreOp::TakeOver { transition, fence } => {
                let Some(seal) = shared.seal.as_ref() else {
                    return Err(NotSent::Broken { broken: Broken::StoreMissing, branch: "take_over_without_seal" });
                };
                stores::transition_request(shared, &transition, &req.skey, seal, self.now(), fence)
                    .map_err(|e| Self::unbuilt(req, e, "take_over_request"))?
            }
            StoreOp::Read => stores::read_request(shared, &req.skey),
            StoreOp::Again(wire) => match wire.sent.with_script() {
                Some(again) => {
                    self.count(Counter::StoreScriptLoads);
                    info!("{}", log_line(Some(req), "store_script_missing", "resent=eval"));
                    again
                }
                None => {
                    return Err(NotSent::Lost(StoreError::Garbled("NOSCRIPT to a call carrying its script".into())))
                }
            },
        };
        self.dispatch(sent)
    }
}

impl Http {
    pub fn new(shared: Rc<Shared>, context_id: u32) -> Http {
        let store = shared.config.store.as_ref().map(|c| c.on_unavailable);
        let machine = Machine::new(store, shared.config.hold_headers);
        Http {
            shared,
            context_id,
            machine,
            published: false,
            counted_as: None,
            clock: Cell::new(None),
            held_since: None,
            marked: false,
        }
    }

    /// The machine and its driver for this callback.
    fn split(&mut self) -> (&mut Machine<Wire>, Glue<'_>) {
        let glue = Glue {
            shared: &self.shared,
            context_id: self.context_id,
            clock: &self.clock,
            published: &mut self.published,
            counted_as: self.counted_as,
            held_since: &mut self.held_since,
            marked: &mut self.marked,
            sd: HostShared,
        };
        (&mut self.machine, glue)
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

    fn count(&self, c: Counter) {
        self.shared.metrics.inc_for(c, self.counted_as);
    }

    /// Refuses the request with `problem` (a local claim held meanwhile freed).
    fn refuse(&mut self, problem: ProblemKind) -> Action {
        let (m, mut io) = self.split();
        action(m.refuse(&mut io, problem))
    }

    /// A broken invariant: refused by the one rule (`failsafe::refuse`), never forwarded.
    fn broken(&mut self, req: Option<Protected>, broken: Broken, branch: &'static str, holding: Holding) -> Action {
        let (m, mut io) = self.split();
        action(m.broken(&mut io, req, broken, branch, holding))
    }

    /// The request headers' step decided the request is not protected (`request::at_headers`).
    fn not_protected_at_headers(&mut self, not: NotProtected, head: RequestHead) -> Action {
        match not {
            NotProtected::Pass | NotProtected::Unprotected { .. } => Action::Continue,
            NotProtected::RouteAmbiguous { first, other } => {
                debug!("idemgate: outcome=route_ambiguous routes={first},{other} path={}", head.path_without_query());
                self.refuse(ProblemKind::RouteAmbiguous)
            }
            NotProtected::PolicyMissing { .. } => {
                self.broken(None, Broken::PolicyMissing, "request_headers_policy", Holding::Nothing)
            }
            NotProtected::McpBody { route, policy } => {
                let (m, mut io) = self.split();
                action(m.await_mcp_body(&mut io, route, policy, head))
            }
            NotProtected::GrpcPassed { .. } => {
                self.count(Counter::GrpcPassed);
                debug!("idemgate: outcome=grpc_passed_unprotected path={}", head.path_without_query());
                Action::Continue
            }
            NotProtected::Refuse { problem, .. } => self.refuse(problem),
        }
    }

    /// The store's answer to the call the request is paused on: parsed here, decided by the
    /// machine.
    fn on_store_answer(&mut self, status: Option<u16>, body: &[u8]) -> Action {
        let shared = Rc::clone(&self.shared);
        let Some((req, call)) = self.machine.calling() else { return Action::Continue };
        let (skey, owner, asked) = (req.skey, req.owner, call.asked);
        let now = self.now();
        let parsed = match asked {
            Asked::TakeOver => {
                Ok((StoreAnswer::TakeOver(stores::parse_take_over(&shared, status, body, &skey, &owner)), None))
            }
            Asked::Settled => {
                let reply = match shared.seal.as_ref() {
                    Some(seal) => stores::parse_read(&shared, status, body, &skey, seal, now),
                    None => Err(StoreError::Garbled("a read answer without its seal".into())),
                };
                Ok((StoreAnswer::Settled(reply), None))
            }
            Asked::Claim => match shared.seal.as_ref() {
                None => Err(StoreError::Garbled("a claim answer without its seal".into())),
                Some(seal) => match stores::parse_claim(&shared, status, body, &owner, &skey, seal, now) {
                    Ok((reply, fence)) => Ok((StoreAnswer::Claim(Ok(reply)), fence)),
                    Err(e) => Ok((StoreAnswer::Claim(Err(e)), None)),
                },
            },
        };
        let (m, mut io) = self.split();
        action(match parsed {
            Ok((answer, fence)) => m.store_answer(&mut io, answer, fence),
            Err(e) => m.store_unreadable(&mut io, &e),
        })
    }

    fn log_exchange(&mut self) {
        let (m, mut io) = self.split();
        m.release_budget(&mut io);
        if matches!(self.machine.phase(), Phase::Pass) {
            return; // unprotected, or passed unprotected: nothing to settle
        }
        // A detached or held request whose client is gone can no longer be answered; the root
        // still settles a detached request's claim when the upstream answers. (The root takes a
        // context out of `live` when it answers it, and tells Envoy the outcome then.)
        let unanswered = self.shared.queues.live.borrow_mut().remove(&self.context_id);
        match self.machine.phase() {
            Phase::Forwarded { .. } => {
                // No response reached the filter: Envoy's response code details tell whether the
                // router ended the stream for an internal redirect (its claim then handed over).
                let code_details = self.machine.wants_code_details().then(|| {
                    host::property(&["response", "code_details"])
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                        .unwrap_or_default()
                });
                if let Some(details) = &code_details {
                    let (m, mut io) = self.split();
                    if m.redirected_away(&mut io, details) {
                        return;
                    }
                }
                if let Some((req, response)) = self.machine.forwarded() {
                    let ended = self.finish(req, response, code_details);
                    let (m, mut io) = self.split();
                    m.settle(&mut io, ended);
                }
            }
            Phase::Waiting { .. } | Phase::Calling { .. } => {
                let (m, mut io) = self.split();
                m.abandon(&mut io);
            }
            // Sent by the root, which still settles its claim: only the client is gone.
            Phase::Detached { skey } if unanswered => {
                let skey = *skey;
                let (_, mut io) = self.split();
                io.publish(Some(&skey), "detached-client-left");
            }
            Phase::Held { skey } if unanswered => {
                let skey = *skey;
                let (_, mut io) = self.split();
                io.publish(Some(&skey), machine::ABANDONED);
            }
            _ => {}
        }
        self.machine.end();
    }

    /// A stream Envoy re-created for an internal redirect (`crate::redirect`): it continues the
    /// claim its first stream handed over, and settles it with the final answer. Anything else
    /// carrying `x-envoy-original-url` (a client can send it) is an ordinary request.
    fn continue_redirect(&mut self) -> Option<Action> {
        if self.shared.handoffs.borrow().is_empty() {
            return None;
        }
        let url = host::header(MapType::HttpRequestHeaders, redirect::ORIGINAL_URL_HEADER)?;
        let on = redirect::Stream {
            mark: host::read_mark(),
            connection: u64_property(&["connection", "id"]),
            context_id: self.context_id,
        };
        let now = self.now();
        let policies = self.shared.handoffs.borrow().policies_for(url.as_bytes(), on, now);
        if policies.is_empty() {
            return None;
        }
        let head = RequestHead::from_pairs(host::all_headers(MapType::HttpRequestHeaders));
        let config = &self.shared.config;
        let (h, policy, scope) = machine::take_handoff(
            &mut self.shared.handoffs.borrow_mut(),
            &policies,
            |i| config.shared_policy(i),
            &head,
            url.as_bytes(),
            on,
            now,
        )?;
        self.counted_as = Some(h.claim.policy_index);
        self.marked = true;
        let (m, mut io) = self.split();
        Some(action(m.adopt(&mut io, h, policy, head, scope)))
    }

    /// Classifies a forwarded exchange from what Envoy tells of it. `code_details`: Envoy's
    /// response code details if already read.
    fn finish(&self, req: &Protected, response: &Response, code_details: Option<String>) -> Ended {
        let status = response.stored.as_ref().map(|r| r.status).filter(|s| *s > 0);
        let mut x =
            Finished { status: status.map(Some), complete: response.complete, code_details, ..Finished::default() };
        // Whether the router re-sent it is read always (its warning below); every other fact only
        // when the classification needs it (`classify_routed`).
        let repeated = re_sent(&mut x);
        let headers = response.stored.as_ref().map_or(&[][..], |r| &r.headers[..]);
        let outcome = classify_routed(&mut x, headers, &req.policy);
        let detail = if log::log_enabled!(log::Level::Info) { x.detail() } else { String::new() };
        if repeated {
            self.count(Counter::UpstreamAttemptsRepeated);
            warn!("{}", log_line(Some(req), "upstream_attempts_repeated", &x.detail()));
        }
        Ended { outcome, detail }
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
        let Some((_, call)) = self.machine.calling() else { return };
        if token != call.wire.token {
            return;
        }
        let sent_ms = call.wire.sent_ms;
        let waited = self.now().saturating_sub(sent_ms);
        self.shared.metrics.record(Histogram::StoreRoundTripMs, waited);
        let (status, body) = writes::answer(body_size, num_headers);
        if self.on_store_answer(status, &body) == Action::Continue {
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
        let admitted = match request::at_headers(&self.shared.config, &head, route_name.as_deref(), end_of_stream) {
            Ok(a) => a,
            Err(not) => {
                self.counted_as = not.route();
                return self.not_protected_at_headers(not, head);
            }
        };
        self.counted_as = Some(admitted.route);
        let derived = admitted.from == KeyFrom::Derived;
        if let Some((name, key)) = admitted.add_derived_key(&mut head) {
            let _ = host::set_header(MapType::HttpRequestHeaders, name, Some(key));
            self.count(Counter::DerivedKeys);
        }
        self.count(Counter::Protected);
        // At most once: Envoy's router must never re-send it (a route's retry_policy, hedging, or
        // retries a client asks for with x-envoy-* headers).
        if !forbid_router_retries(&mut head) {
            return self.broken(None, Broken::HostCallFailed, "retry_guard", Holding::Nothing);
        }
        let req = Protected::at_headers(admitted, head, self.shared.next_owner());
        if derived {
            debug!("{}", log_line(Some(&req), "derived_key", "key_source=derived"));
        }
        // The branch a policy lost before the fingerprint would take (fault tests only).
        if end_of_stream && !req.derive_at_body && fault_point(&req, "policy-lost-at-headers") {
            return self.broken(Some(req), Broken::PolicyMissing, "request_headers_fingerprint", Holding::Nothing);
        }
        let (m, mut io) = self.split();
        action(m.protect(&mut io, req, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.callback(meter::Callback::RequestBody);
        let (m, mut io) = self.split();
        // The branch a policy lost while the body arrives would take (fault tests only).
        if let Phase::Waiting { req, .. } = m.phase() {
            if fault_point(req, "policy-lost-at-body") {
                m.release_budget(&mut io);
                return action(m.broken(&mut io, None, Broken::PolicyMissing, "request_body", Holding::Nothing));
            }
        }
        action(m.body_chunk(&mut io, body_size, end_of_stream))
    }

    fn on_http_request_trailers(&mut self, _n: usize) -> Action {
        self.callback(meter::Callback::RequestBody);
        // Trailers reach the upstream with a protected request: part of its fingerprint.
        let trailers = self.machine.wants_trailers().then(|| host::all_headers(MapType::HttpRequestTrailers));
        let (m, mut io) = self.split();
        action(m.trailers(&mut io, trailers))
    }

    fn on_http_response_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        self.callback(meter::Callback::ResponseHeaders);
        let Some((req, _)) = self.machine.forwarded() else { return Action::Continue };
        crash_point(req, "response");
        if fault_point(req, "lost-wake") {
            self.shared.lose_next_wake();
        }
        let headers = host::all_headers(MapType::HttpResponseHeaders);
        // Publish the expiry policy to the client that created the record.
        if let Some(ttl) = self.machine.response_headers(headers, end_of_stream) {
            let _ = host::add_header(MapType::HttpResponseHeaders, reply::EXPIRES_HEADER, &ttl.to_string());
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.callback(meter::Callback::ResponseBody);
        if self.machine.forwarded().is_none() {
            return Action::Continue;
        }
        let chunk = if self.machine.wants_response_body() {
            host::buffer(BufferType::HttpResponseBody, body_size)
        } else {
            vec![]
        };
        self.machine.response_body(&chunk, end_of_stream);
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _n: usize) -> Action {
        self.callback(meter::Callback::ResponseBody);
        if self.machine.forwarded().is_some() {
            // A replay cannot carry them: it says which it lacks.
            let names: Vec<String> =
                host::all_headers(MapType::HttpResponseTrailers).into_iter().map(|(n, _)| n).collect();
            self.machine.response_trailers(&names);
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
