//! One request through the shared engine: the native host's counterpart of `src/filter/http.rs`.
//! It reads Envoy into the machine's inputs (`engine::machine::Machine`: admitted headers, body,
//! trailers, the response as it flows, the exchange's end) and carries its commands out with
//! host calls (`host.rs`). Every decision is the engine's; nothing here decides what a request
//! gets.
//!
//! Today: the local tier (one proxy) and the Redis (webdis) and etcd stores (`store.rs`: the
//! calls a request waits for are the stream's callouts, answered in `callout_done`), and
//! `in_flight: "wait"` (`http/wait.rs`) and `forwarding: "detached"` with `upstream.hop:
//! "direct"` (`http/detached.rs`). MCP routes run here: the engine reads the body and says how
//! the request is answered (`Command::McpReply`), and the core writes those answers
//! (`mcp::Reply::problem`, `encoding::retry_answer`), as for the Wasm build. Envoy's internal
//! redirects hand a claim over to the re-created stream (`http/redirect.rs`). A detached hop through
//! an internal listener is refused at configuration (`refusal`), before any request.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use idemgate::config::{Config, Forwarding, Hop};
use idemgate::decision::{classify_routed, re_sent, Exchange};
use idemgate::encoding::{self, RetryAnswer, EXPIRES_HEADER};
use idemgate::engine::budget::Budget;
use idemgate::engine::machine::{
    log_line, Command, Count, Effects, Ended, Flow, Io, KeyHold, LogLevel, Machine, NotSent, Phase, Protected,
    Response, StoreOp,
};
use idemgate::engine::request::{self, Asked, NotProtected, StoreAnswer};
use idemgate::engine::settle::Claim;
use idemgate::engine::sweep::Sweeper;
use idemgate::failsafe::{Broken, Holding};
use idemgate::local::{SharedData, Table};
use idemgate::mcp::Reply as McpReply;
use idemgate::metrics::{self as rules, Counter, Gauge, Histogram};
use idemgate::owner::{OwnerSeed, OwnerToken, TokenSources};
use idemgate::problem::{code_details, ProblemKind};
use idemgate::record::{Creator, Record};
use idemgate::redirect::Handoff;
use idemgate::request::{envoy_answers_as_grpc, RequestHead, ROUTER_RETRY_CAP};
use idemgate::scope::StorageKey;
use idemgate::store::{StoreError, StoreRequest};

use crate::abi::{self, EnvoyPtr};
use crate::host::{self, CalloutFrom};
use crate::metrics::{From as MetricsFrom, Metrics};
use crate::shared::ProcessShared;
use crate::store::StoreSide;
use crate::timer::Timer;

pub(crate) mod detached;
mod redirect;
mod wait;
pub use detached::DETACHED_EVENT;
pub use wait::WAIT_EVENT;

/// Why this build cannot run `config` yet: the first feature it needs that the native host glue
/// does not carry. `None`: it runs here.
pub fn refusal(config: &Config) -> Option<String> {
    let why = |what: &str| {
        Some(format!(
            "idemgate configuration refused by the native build: {what} is not supported by the native (dynamic module) build yet; use the Wasm build (dist/idemgate.wasm) for it (docs/native.md)"
        ))
    };
    for p in config.policies() {
        if matches!(p.forwarding, Forwarding::Detached { hop: Hop::InternalListener, .. }) {
            // Envoy registers its internal listeners on its workers: the main thread, which sends
            // detached requests here (`http/detached.rs`), reaches none (its hop probe is answered
            // 503 by Envoy, and the request refused).
            return why("forwarding \"detached\" through upstream.hop \"internal_listener\" (the default; \"direct\" is carried)");
        }
    }
    None
}

/// One filter configuration: what every request of every worker shares.
pub struct Global {
    pub config: Config,
    pub table: Table,
    /// The store (Redis through webdis), when configured.
    pub store: Option<StoreSide>,
    /// Its metrics in Envoy's stats (`metrics.rs`).
    pub metrics: Arc<Metrics>,
    owner_seed: OwnerSeed,
    tokens: AtomicU64,
    /// The local table's sweep and its gauges (`engine::sweep`, the Wasm root's rule), run on the
    /// main thread by the configuration's tick (`on_scheduled`).
    sweeper: Mutex<Sweeper>,
    /// The configuration's one timer thread (`timer.rs`): posts `crate::TICK_EVENT` to the main
    /// thread when the next sweep or store write retry is due; ended with the configuration.
    timer: Arc<Timer>,
    /// The streams held by `in_flight: "wait"` (`wait.rs`), woken by the timer's tick.
    waits: Arc<wait::Registry>,
    /// `forwarding: "detached"` (`detached.rs`): the forwards sent by the main thread, the
    /// streams waiting for their answer.
    pub(crate) detached: Arc<detached::Detached>,
    /// Claims handed over by streams Envoy ended for an internal redirect, waiting for the
    /// stream it re-creates (`redirect.rs`).
    redirects: redirect::Redirects,
}

impl Global {
    /// Parses and checks the configuration and creates the local table: the message of the
    /// refusal otherwise.
    pub fn configure(raw: &[u8], config_envoy: abi::ConfigEnvoyPtr) -> Result<Global, String> {
        let config = Config::parse(raw).map_err(|e| e.to_string())?;
        if let Some(why) = refusal(&config) {
            return Err(why);
        }
        // Envoy calls config_new on its main thread: the scheduler posting to it is made here
        // (never deleted: a post after the configuration is gone does nothing), and the timer's
        // thread posts through it.
        let scheduler = Arc::new(AtomicUsize::new(host::scheduler_new(config_envoy) as usize));
        let posts = Arc::clone(&scheduler);
        let detached = Arc::new(detached::Detached::new(config_envoy, Arc::clone(&scheduler)));
        let timer = Arc::new(Timer::new(
            move || host::scheduler_commit(posts.load(Ordering::Acquire) as abi::SchedulerPtr, crate::TICK_EVENT),
            host::now_ms,
        ));
        let store = StoreSide::configure(&config, Arc::clone(&timer), scheduler)?;
        let table = Table::new(&config.local);
        match table.ensure_created(&mut ProcessShared) {
            Ok(created) if created > 0 => host::log(
                LogLevel::Info,
                &format!("idemgate: local table created ({created} keys, {} buckets)", table.buckets()),
            ),
            Ok(_) => {}
            Err(e) => return Err(format!("idemgate: cannot create the local table: {e:?}")),
        }
        let now_nanos = host::now_nanos();
        let vm = (u64::from(std::process::id()) << 32) ^ now_nanos;
        let node = std::env::var("HOSTNAME").unwrap_or_default();
        let owner_seed = OwnerSeed::derive(&TokenSources { entropy: &host::entropy(), node: &node, vm, now_nanos });
        // Envoy takes definitions only while it creates the configuration (this hook).
        let labels: Vec<&str> = config.routes.iter().map(|r| r.name.as_str()).collect();
        let fixed = [(Gauge::LocalIndexBytes, table.max_index_bytes()), (Gauge::LocalCapacity, table.capacity())];
        let metrics = Arc::new(Metrics::define(config_envoy, &labels, &fixed));
        if let Some(st) = store.as_ref() {
            // Envoy calls config_new on its main thread: the store's writes are sent from there.
            st.attach(config_envoy, Arc::clone(&metrics));
        }
        // The first sweep at once (the gauges from the first tick on), then once a second; with
        // etcd the keeper's first token and lease at that tick too, never on a request's path.
        if let Err(e) = timer.arm(host::now_ms()) {
            if store.as_ref().is_some_and(|st| st.backend().needs_tick()) {
                // Without its tick no lease would ever be granted.
                return Err(format!("idemgate configuration refused: store.kind \"etcd\" needs the native build's timer thread, which could not start ({e})"));
            }
            host::log(
                LogLevel::Warn,
                &format!("idemgate: no timer thread ({e}): the local table's gauges are not set, expired records are freed only when their bucket is reused"),
            );
        }
        Ok(Global {
            config,
            table,
            store,
            metrics,
            owner_seed,
            tokens: AtomicU64::new(0),
            sweeper: Mutex::new(Sweeper::default()),
            timer,
            waits: Arc::default(),
            detached,
            redirects: redirect::Redirects::default(),
        })
    }

    /// Main thread, on any event posted to it (a write queued, the timer due): the store's
    /// writes, then the local table's sweep if due (`engine::sweep`, once a second: the same
    /// counters and gauges as the Wasm root's tick), then the timer armed for the next sweep.
    pub fn on_scheduled(&self) {
        self.detached.on_scheduled(self);
        if let Some(st) = self.store.as_ref() {
            st.on_scheduled();
        }
        let now = host::now_ms();
        // Claims handed over for a redirect that no stream took within the window.
        self.redirects.expire(self, now);
        let next = {
            let mut sweeper = self.sweeper.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(swept) = sweeper.run(&self.table, &mut ProcessShared, now) {
                if let Some(e) = &swept.error {
                    host::log(LogLevel::Debug, &format!("idemgate: sweep failed: {e:?}"));
                }
                for c in swept.counters() {
                    self.metrics.inc(MetricsFrom::Config, c);
                }
                for (g, v) in swept.gauges {
                    self.metrics.set(g, v);
                }
                if let Some(line) = &swept.high_water {
                    host::log(LogLevel::Warn, line);
                }
            }
            sweeper.next_ms()
        };
        // Waiting requests are checked on their workers (`wait.rs`) at the wait tick's pace.
        let next = if self.waits.wake_all() { next.min(now.saturating_add(wait::WAIT_TICK_MS)) } else { next };
        // An earlier deadline (a write's retry) stays armed: the timer keeps the earliest.
        if let Err(e) = self.timer.arm(next) {
            host::log(
                LogLevel::Warn,
                &format!("idemgate: cannot start the timer thread ({e}): retried at the next event"),
            );
        }
    }

    /// Main thread: the answer to configuration callout `id`: a detached forward's or its hop
    /// probe's (`detached.rs`), else the store's.
    pub fn callout_answered(&self, id: u64, status: Option<u16>, headers: Vec<(String, Vec<u8>)>, body: &[u8]) {
        if self.detached.on_answer(self, id, status, &headers) {
            return;
        }
        if let Some(st) = self.store.as_ref() {
            st.on_answer(id, status, body);
        }
    }

    /// Envoy destroys the configuration (its destroy hook, main thread): what it leaves behind in
    /// the gauges is taken back (`StoreSide::stop`). The timer's thread ends when `Global` drops.
    pub fn stop(&self) {
        if let Some(st) = self.store.as_ref() {
            st.stop();
        }
    }

    fn next_owner(&self) -> OwnerToken {
        let n = self.tokens.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        OwnerToken::next(&self.owner_seed, n)
    }
}

// Envoy calls a configuration's filters on every worker thread at once: what they share must be
// safe to share. Checked at compile time.
const _: fn() = || {
    fn shared_by_workers<T: Send + Sync>() {}
    shared_by_workers::<Global>();
};

thread_local! {
    /// The worker's buffer budget count (`max_buffered_bytes` is per worker, as in the Wasm build
    /// where each worker has its own VM): Envoy runs a stream's hooks on its worker's thread.
    static BUFFERED: Cell<u64> = const { Cell::new(0) };
}

/// A store call in flight, as this glue sent it: the stream callout's id and the request (sent
/// again with its script in full if Redis answers NOSCRIPT).
pub struct Wire {
    id: u64,
    sent: StoreRequest,
    /// When it was sent (`idemgate.store_round_trip_ms`).
    sent_ms: u64,
}

/// One request.
pub struct Filter {
    envoy: EnvoyPtr,
    global: Arc<Global>,
    machine: Machine<Wire>,
    clock: Option<u64>,
    /// The request body's chunks copied so far (before its end).
    acc: Vec<u8>,
    /// The whole request body, once its end is seen.
    body: Vec<u8>,
    /// The route the request is counted under (`config.routes` index), once known.
    route: Option<usize>,
    /// When its claim was taken (`idemgate.key_held_ms`), until settled.
    held_since: Option<u64>,
    /// The outcome was left in Envoy's filter state (`Glue::publish`): once per request.
    published: bool,
    /// Held by `in_flight: "wait"` (`wait.rs`), until answered or its stream ends.
    waiting: Option<wait::Waiting>,
    /// An MCP request's JSON-RPC answer form, once the engine says (`Command::McpReply`).
    mcp: Option<McpReply>,
    /// Detached (`detached.rs`), until answered or its stream ends.
    detaching: Option<detached::Detaching>,
    /// The configuration's hand-over count when Envoy created the stream (`redirect.rs`): it
    /// takes only a claim handed over before.
    born: u32,
    /// The request's mark (its key, `idemgate::redirect`) is in this stream's Request-life
    /// filter state: left here (`Command::Mark`) or found (a stream re-created for a redirect).
    marked: bool,
}

struct Glue<'a> {
    envoy: EnvoyPtr,
    global: &'a Global,
    clock: &'a mut Option<u64>,
    body: &'a [u8],
    sd: ProcessShared,
    route: Option<usize>,
    held_since: &'a mut Option<u64>,
    published: &'a mut bool,
    waiting: &'a mut Option<wait::Waiting>,
    mcp: &'a mut Option<McpReply>,
    detaching: &'a mut Option<detached::Detaching>,
    born: u32,
    marked: &'a mut bool,
}

fn headers_status(f: Flow) -> u32 {
    match f {
        Flow::Continue => abi::HEADERS_CONTINUE,
        Flow::Pause => abi::HEADERS_STOP_ITERATION,
    }
}

fn body_status(f: Flow) -> u32 {
    match f {
        Flow::Continue => abi::BODY_CONTINUE,
        Flow::Pause => abi::BODY_STOP_ITERATION_AND_BUFFER,
    }
}

fn trailers_status(f: Flow) -> u32 {
    match f {
        Flow::Continue => abi::TRAILERS_CONTINUE,
        Flow::Pause => abi::TRAILERS_STOP_ITERATION,
    }
}

impl Glue<'_> {
    fn now(&mut self) -> u64 {
        *self.clock.get_or_insert_with(host::now_ms)
    }

    /// Counts `c` (per route too, for a counter kept per route): the core's rules say which.
    fn count(&self, c: Counter) {
        self.global.metrics.inc_for(MetricsFrom::Stream(self.envoy), c, self.route);
    }

    /// The claim this request held is settled: how long it was held.
    fn settled(&mut self) {
        if let Some(since) = self.held_since.take() {
            let now = self.now();
            self.global.metrics.record(self.envoy, Histogram::KeyHeldMs, now.saturating_sub(since));
        }
    }

    /// The one place a protected request's end is told to Envoy's access log: its outcome slug and
    /// storage key in filter state (`host::publish`), as the Wasm build does. The first call wins.
    fn publish(&mut self, key: Option<&StorageKey>, outcome: &str) {
        if std::mem::replace(self.published, true) {
            return;
        }
        let hex = key.map(StorageKey::hex);
        if !host::publish(self.envoy, outcome, hex.as_deref()) {
            host::log(LogLevel::Debug, &format!("idemgate: filter state not set for outcome={outcome}"));
        }
    }

    /// Sends a problem document (never stored), counted as the core's `problem_counter` says.
    fn answer(&mut self, req: Option<&Protected>, problem: ProblemKind, creator: Option<&Creator>) {
        self.count(rules::problem_counter(&problem));
        self.send_problem(req, problem, creator);
    }

    fn send_problem(&mut self, req: Option<&Protected>, problem: ProblemKind, creator: Option<&Creator>) {
        host::log(LogLevel::Info, &log_line(req, problem.slug(), ""));
        self.publish(req.and_then(Protected::published_key), problem.slug());
        let request_id = req.map_or_else(
            || {
                host::header(self.envoy, abi::REQUEST_HEADER, "x-request-id")
                    .map(|v| String::from_utf8_lossy(&v).into_owned())
                    .unwrap_or_default()
            },
            |r| r.creator.request_id.clone(),
        );
        if let Some(m) = self.mcp.as_ref() {
            // In JSON-RPC, as the core writes it (`mcp::Reply::problem`), as the Wasm build does.
            let r = m.problem(&problem);
            host::send_response(
                self.envoy,
                r.status,
                &text_headers(&r.headers),
                &r.body,
                &code_details(problem.slug()),
            );
            return;
        }
        let p = problem.to_problem(&request_id, creator);
        let headers: Vec<(&str, &str)> = p.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let grpc =
            host::header(self.envoy, abi::REQUEST_HEADER, "content-type").is_some_and(|c| envoy_answers_as_grpc(&c));
        let details = code_details(problem.slug());
        if grpc {
            // Envoy turns a local reply to a gRPC request into a trailers-only status (its gRPC
            // status mapped from the HTTP status; this ABI takes none of its own).
            host::send_response(self.envoy, p.status, &headers, problem.grpc_message().as_bytes(), &details);
        } else {
            host::send_response(self.envoy, p.status, &headers, &p.body, &details);
        }
    }

    /// Sends a response as stored (`replayed`: with `idempotent-replayed: true`).
    fn respond(&self, status: u16, headers: &[(String, Vec<u8>)], body: &[u8], expires: &str, slug: &str) {
        let mut h = text_headers(headers);
        h.push(("idempotent-replayed", "true"));
        h.push((EXPIRES_HEADER, expires));
        host::send_response(self.envoy, status, &h, body, &code_details(slug));
    }

    /// Replays a completed record: what is sent is decided in the core (`encoding::retry_answer`),
    /// as for the Wasm build's `filter/reply.rs`.
    fn replay(&mut self, req: &Protected, record: &Record) {
        if let idemgate::record::State::Completed(_) = &record.state {
            self.count(Counter::Replayed);
        }
        self.send_replay(req, record);
    }

    /// Sends a record's replay (`replay`), `replayed` counted by the caller.
    fn send_replay(&mut self, req: &Protected, record: &Record) {
        if let idemgate::record::State::Completed(r) = &record.state {
            self.global.metrics.record(self.envoy, Histogram::ReplayBytes, r.body.len() as u64);
        }
        let now = self.now();
        let accept: Vec<Vec<u8>> = req.accept_encoding();
        let accept: Vec<&[u8]> = accept.iter().map(Vec::as_slice).collect();
        let max = req.policy.max_response_body_bytes;
        let answer = encoding::retry_answer(record, now, &accept, max, self.mcp.as_ref());
        let extra = match &answer {
            RetryAnswer::AsStored { .. } => rules::replay_counter(false, None),
            RetryAnswer::Decoded { .. } => rules::replay_counter(true, None),
            RetryAnswer::Problem(kind) => rules::replay_counter(false, Some(kind)),
        };
        if let Some(c) = extra {
            self.count(c);
        }
        match answer {
            RetryAnswer::AsStored { response: r, expires } => {
                self.publish(req.published_key(), "replayed");
                self.respond(r.status, &r.headers, &r.body, &expires, "replayed");
                host::log(LogLevel::Debug, &log_line(Some(req), "replayed", &format!("status={}", r.status)));
            }
            RetryAnswer::Decoded { response: d, expires } => {
                self.publish(req.published_key(), "replayed");
                self.respond(d.status, &d.headers, &d.body, &expires, "replayed");
                host::log(LogLevel::Debug, &log_line(Some(req), "replayed", &format!("status={}", d.status)));
            }
            // Counted above, as a replay (the Wasm build's `reply::replay`).
            RetryAnswer::Problem(kind) => self.send_problem(Some(req), kind, Some(&record.creator)),
        }
    }

    /// A command this build cannot carry out (its feature was refused at configuration): never
    /// reached; logged if it ever is.
    fn unreachable(&self, what: &str) {
        host::log(
            LogLevel::Error,
            &format!("idemgate: outcome=internal_state branch=native_{what} (refused at configuration, yet asked)"),
        );
    }
}

impl Effects for Glue<'_> {
    fn now_ms(&mut self) -> u64 {
        self.now()
    }

    fn local(&mut self) -> (&Table, &mut dyn SharedData) {
        (&self.global.table, &mut self.sd)
    }

    fn run(&mut self, c: Command<'_>) {
        match c {
            Command::Count(c) => {
                match c {
                    // The local release is counted as the Wasm build counts it: not per route.
                    Count::Released => self.global.metrics.inc(MetricsFrom::Stream(self.envoy), Counter::Released),
                    c => self.count(rules::counter(c)),
                }
                match c.key_hold() {
                    Some(KeyHold::Starts) => *self.held_since = Some(self.now()),
                    Some(KeyHold::Ends) => self.settled(),
                    None => {}
                }
            }
            Command::Publish { key, outcome } => self.publish(key.as_ref(), outcome),
            Command::Log(level, line) => host::log(level, &line),
            Command::Reply { req, problem, creator } => self.answer(req, problem, creator),
            Command::Replay { req, record } => self.replay(req, &record),
            Command::KeyDerived { header, key } => {
                if self.global.config.hold_headers {
                    let _ = host::set_header(self.envoy, abi::REQUEST_HEADER, header, Some(key));
                }
            }
            Command::Write { what, skey, transition, fallback, fence } => match self.global.store.as_ref() {
                Some(st) => st.push_write(what, &skey, *transition, fallback.map(|f| *f), fence),
                None => self.unreachable("store_write"),
            },
            Command::Hold { req, fp, wait_ms } => self.hold(req, fp, wait_ms),
            Command::Detach(f) => self.detach(f),
            Command::McpReply { id, batch, accepts } => *self.mcp = Some(McpReply { id, batch, accepts }),
            Command::Mark { skey } => {
                if !*self.marked {
                    *self.marked = host::mark(self.envoy, &skey);
                }
            }
            Command::HandOver { claim, url } => self.hand_over(claim, url),
        }
    }

    fn logs(&self, level: LogLevel) -> bool {
        host::logs(level)
    }
}

impl Io for Glue<'_> {
    type Wire = Wire;

    fn budget(&self) -> Budget {
        Budget { buffered: BUFFERED.with(Cell::get), max: self.global.config.max_buffered_bytes }
    }

    fn set_buffered(&mut self, buffered: u64) {
        BUFFERED.with(|b| b.set(buffered));
    }

    fn read_body(&mut self, _req: Option<&Protected>, _size: usize) -> Vec<u8> {
        self.body.to_vec()
    }

    fn forbid_router_retries(&mut self, head: &mut RequestHead) -> bool {
        forbid_router_retries(self.envoy, head)
    }

    fn next_owner(&mut self) -> OwnerToken {
        self.global.next_owner()
    }

    fn take_handoff(&mut self, skey: &StorageKey, policy_index: usize, original_url: &[u8]) -> Option<Handoff<Claim>> {
        self.handoff_for(skey, policy_index, original_url)
    }

    fn send(&mut self, req: &Protected, op: StoreOp<'_, Wire>) -> Result<Wire, NotSent> {
        let Some(st) = self.global.store.as_ref() else {
            return Err(NotSent::Broken { broken: Broken::StoreMissing, branch: "native_store_call" });
        };
        let now = self.now();
        let unbuilt = |e: idemgate::backend::Unbuilt, branch: &'static str| match e {
            // Nothing was sent: the store counts as unavailable.
            idemgate::backend::Unbuilt::NoLease => NotSent::Failed(StoreError::Garbled(e.to_string())),
            idemgate::backend::Unbuilt::Broken(why) => {
                host::log(LogLevel::Warn, &log_line(Some(req), "internal_state", &format!("error={why}")));
                NotSent::Broken { broken: Broken::ImpossibleDecision, branch }
            }
        };
        let sent = match op {
            StoreOp::Claim { record, lifetimes } => st
                .writer(now)
                .claim_request(&req.skey, &req.owner, &record, &lifetimes, &st.seal, now)
                .map_err(|e| unbuilt(e, "claim_request"))?,
            StoreOp::TakeOver { transition, fence } => st
                .writer(now)
                .transition_request(&transition, &req.skey, &st.seal, now, fence)
                .map_err(|e| unbuilt(e, "take_over_request"))?,
            StoreOp::Read => st.backend().read_request(&req.skey),
            StoreOp::Again(wire) => match wire.sent.with_script() {
                Some(again) => {
                    self.count(Counter::StoreScriptLoads);
                    host::log(LogLevel::Info, &log_line(Some(req), "store_script_missing", "resent=eval"));
                    again
                }
                None => {
                    return Err(NotSent::Lost(StoreError::Garbled("NOSCRIPT to a call carrying its script".into())))
                }
            },
        };
        self.count(Counter::StoreCalls);
        self.count(Counter::StoreCallsWaited);
        match st.send(CalloutFrom::Stream(self.envoy), &sent) {
            Ok(id) => Ok(Wire { id, sent, sent_ms: now }),
            Err(e) => Err(NotSent::Failed(StoreError::Garbled(e))),
        }
    }
}

/// Header values as the host calls take them (text): one that is not valid UTF-8 is left out.
fn text_headers(headers: &[(String, Vec<u8>)]) -> Vec<(&str, &str)> {
    headers.iter().filter_map(|(n, v)| std::str::from_utf8(v).ok().map(|v| (n.as_str(), v))).collect()
}

/// `RequestHead::forbid_router_retries` applied to the headers Envoy forwards.
fn forbid_router_retries(f: EnvoyPtr, head: &mut RequestHead) -> bool {
    let mut ok = true;
    for name in head.forbid_router_retries() {
        ok &= host::set_header(f, abi::REQUEST_HEADER, &name, None);
    }
    let (cap, zero) = ROUTER_RETRY_CAP;
    ok && host::set_header(f, abi::REQUEST_HEADER, cap, Some(zero))
}

/// A forwarded exchange as this build sees it end: the facts the Wasm build reads from Envoy's
/// properties (`filter::http::Finished`), read here through the ABI's attribute accessors, each
/// the first time the core's rule asks for it (`classify_routed`), then kept: the response's
/// status, whether it ended, Envoy's response code details (`via_upstream` for the upstream's own
/// answer), `response.flags`, `upstream.request_attempt_count`, whether the stream has an upstream
/// host (`upstream.address`) and whether a connection to it was made (`upstream.local_address`).
/// Envoy 1.40 serves each to an HTTP filter (measured, docs/native.md, "failure classification"),
/// so the same rule decides from the same facts in both builds.
struct Seen {
    status: Option<u16>,
    complete: bool,
    code_details: String,
    flags: Option<u64>,
    attempts: Option<Option<u64>>,
    upstream_host: Option<bool>,
    upstream_connected: Option<bool>,
    envoy: EnvoyPtr,
}

impl Seen {
    /// The facts read, for log lines (`-` for those the classification never needed), in the
    /// Wasm build's words.
    fn detail(&self) -> String {
        let shown = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        format!(
            "status={} code_details={} flags={} attempts={} upstream_host={} upstream_connected={}",
            self.status.unwrap_or(0),
            self.code_details,
            shown(self.flags.map(|f| f.to_string())),
            shown(self.attempts.map(|a| a.map_or_else(|| "unknown".to_string(), |n| n.to_string()))),
            shown(self.upstream_host.map(|b| b.to_string())),
            shown(self.upstream_connected.map(|b| b.to_string())),
        )
    }
}

impl Exchange for Seen {
    fn forwarded(&mut self) -> bool {
        true
    }
    fn status(&mut self) -> Option<u16> {
        self.status
    }
    fn code_details(&mut self) -> String {
        self.code_details.clone()
    }
    fn flags(&mut self) -> u64 {
        let envoy = self.envoy;
        *self.flags.get_or_insert_with(|| host::attribute_int(envoy, abi::ATTRIBUTE_RESPONSE_FLAGS).unwrap_or(0))
    }
    fn response_complete(&mut self) -> bool {
        self.complete
    }
    fn upstream_host(&mut self) -> bool {
        let envoy = self.envoy;
        *self
            .upstream_host
            .get_or_insert_with(|| host::attribute_string(envoy, abi::ATTRIBUTE_UPSTREAM_ADDRESS).is_some())
    }
    fn upstream_connected(&mut self) -> bool {
        let envoy = self.envoy;
        *self
            .upstream_connected
            .get_or_insert_with(|| host::attribute_string(envoy, abi::ATTRIBUTE_UPSTREAM_LOCAL_ADDRESS).is_some())
    }
    fn attempts(&mut self) -> Option<u64> {
        let envoy = self.envoy;
        *self.attempts.get_or_insert_with(|| host::attribute_int(envoy, abi::ATTRIBUTE_UPSTREAM_REQUEST_ATTEMPT_COUNT))
    }
}

/// How a forwarded exchange ended (`Ended`), and whether the router re-sent it (`re_sent`);
/// `code_details`: Envoy's response code details if already read.
fn ended(envoy: EnvoyPtr, req: &Protected, response: &Response, code_details: Option<String>) -> (Ended, bool) {
    let status = response.stored.as_ref().map(|r| r.status).filter(|s| *s > 0);
    let code_details = code_details.unwrap_or_else(|| redirect::code_details_of(envoy));
    let mut seen = Seen {
        status,
        complete: response.complete,
        code_details,
        flags: None,
        attempts: None,
        upstream_host: None,
        upstream_connected: None,
        envoy,
    };
    // Whether the router re-sent it is read always (counted and logged); every other fact only
    // when the classification needs it.
    let repeated = re_sent(&mut seen);
    let headers = response.stored.as_ref().map_or(&[][..], |r| &r.headers[..]);
    let outcome = classify_routed(&mut seen, headers, &req.policy);
    // The facts are written out only when a line that prints them can be logged: the settlement's
    // lines that carry them are Debug, Info or Warn (`engine::settle`), so with Envoy logging
    // only errors (`--log-level error`) they are not (a line formatted per request for nothing,
    // profiled 2026-12-07, docs/native.md).
    let detail = if repeated || host::logs(LogLevel::Warn) { seen.detail() } else { String::new() };
    (Ended { outcome, detail }, repeated)
}

impl Filter {
    pub fn new(envoy: EnvoyPtr, global: Arc<Global>) -> Filter {
        let hold = global.config.hold_headers;
        let store = global.config.store.as_ref().map(|c| c.on_unavailable);
        let born = global.redirects.born();
        Filter {
            born,
            envoy,
            global,
            machine: Machine::new(store, hold),
            clock: None,
            acc: vec![],
            body: vec![],
            route: None,
            held_since: None,
            published: false,
            waiting: None,
            mcp: None,
            detaching: None,
            marked: false,
        }
    }

    fn split(&mut self) -> (&mut Machine<Wire>, Glue<'_>) {
        let glue = Glue {
            envoy: self.envoy,
            global: &self.global,
            clock: &mut self.clock,
            body: &self.body,
            sd: ProcessShared,
            route: self.route,
            held_since: &mut self.held_since,
            published: &mut self.published,
            waiting: &mut self.waiting,
            mcp: &mut self.mcp,
            detaching: &mut self.detaching,
            born: self.born,
            marked: &mut self.marked,
        };
        (&mut self.machine, glue)
    }

    /// A hook starts: the clock is read again when first needed.
    fn hook(&mut self, envoy: EnvoyPtr) {
        self.envoy = envoy;
        self.clock = None;
    }

    fn refuse(&mut self, problem: ProblemKind) -> Flow {
        let (m, mut io) = self.split();
        m.refuse(&mut io, problem)
    }

    fn broken(&mut self, broken: Broken, branch: &'static str) -> Flow {
        let (m, mut io) = self.split();
        m.broken(&mut io, None, broken, branch, Holding::Nothing)
    }

    pub fn request_headers(&mut self, envoy: EnvoyPtr, end_of_stream: bool) -> u32 {
        self.hook(envoy);
        // A stream re-created for an internal redirect continues its first stream's claim.
        if let Some(status) = self.continue_redirect(envoy) {
            return status;
        }
        let config = &self.global.config;
        if end_of_stream {
            let method = host::header(envoy, abi::REQUEST_HEADER, ":method").unwrap_or_default();
            if !config.protects_method(&String::from_utf8_lossy(&method)) {
                return abi::HEADERS_CONTINUE;
            }
        }
        let mut head = RequestHead::from_pairs(host::all_headers(envoy, abi::REQUEST_HEADER));
        if !end_of_stream && !config.protects_method(&head.method) {
            return abi::HEADERS_CONTINUE;
        }
        // The Envoy route's name, read only where a route is selected by it (as the Wasm build).
        let route_name = if config.uses_route_names() {
            host::attribute_string(envoy, abi::ATTRIBUTE_XDS_ROUTE_NAME)
                .map(|n| String::from_utf8_lossy(&n).into_owned())
        } else {
            None
        };
        let admitted = match request::at_headers(config, &head, route_name.as_deref(), end_of_stream) {
            Ok(a) => a,
            Err(not) => {
                self.route = not.route();
                let flow = match not {
                    NotProtected::Pass | NotProtected::Unprotected { .. } => Flow::Continue,
                    NotProtected::GrpcPassed { .. } => {
                        self.count(Counter::GrpcPassed);
                        Flow::Continue
                    }
                    NotProtected::RouteAmbiguous { .. } => self.refuse(ProblemKind::RouteAmbiguous),
                    NotProtected::Refuse { problem, .. } => self.refuse(problem),
                    NotProtected::PolicyMissing { .. } => {
                        self.broken(Broken::PolicyMissing, "native_request_headers_policy")
                    }
                    // Protected or not is known from its whole body (`Machine::await_mcp_body`).
                    NotProtected::McpBody { route, policy } => {
                        let (m, mut io) = self.split();
                        m.await_mcp_body(&mut io, route, policy, head)
                    }
                };
                return headers_status(flow);
            }
        };
        self.route = Some(admitted.route);
        if let Some((name, key)) = admitted.add_derived_key(&mut head) {
            let _ = host::set_header(envoy, abi::REQUEST_HEADER, name, Some(key));
            self.count(Counter::DerivedKeys);
        }
        self.count(Counter::Protected);
        if !forbid_router_retries(envoy, &mut head) {
            return headers_status(self.broken(Broken::HostCallFailed, "retry_guard"));
        }
        let req = Protected::at_headers(admitted, head, self.global.next_owner());
        let (m, mut io) = self.split();
        headers_status(m.protect(&mut io, req, end_of_stream))
    }

    /// The whole body at its end: Envoy's buffered body when it holds every byte (after earlier
    /// chunks were buffered, it moves the last one in), else the chunks copied here plus the last.
    fn whole_body(&mut self, received: Vec<u8>) -> Vec<u8> {
        let buffered = host::body(self.envoy, abi::BUFFERED_REQUEST_BODY);
        let mut mine = std::mem::take(&mut self.acc);
        mine.extend_from_slice(&received);
        if buffered.len() >= mine.len() && !buffered.is_empty() {
            buffered
        } else {
            mine
        }
    }

    pub fn request_body(&mut self, envoy: EnvoyPtr, end_of_stream: bool) -> u32 {
        self.hook(envoy);
        if matches!(self.machine.phase(), Phase::Pass) {
            return abi::BODY_CONTINUE;
        }
        let received = host::body(envoy, abi::RECEIVED_REQUEST_BODY);
        let size = if end_of_stream {
            self.body = self.whole_body(received);
            self.body.len()
        } else {
            self.acc.extend_from_slice(&received);
            self.acc.len()
        };
        let (m, mut io) = self.split();
        body_status(m.body_chunk(&mut io, size, end_of_stream))
    }

    pub fn request_trailers(&mut self, envoy: EnvoyPtr) -> u32 {
        self.hook(envoy);
        if matches!(self.machine.phase(), Phase::Pass) {
            return abi::TRAILERS_CONTINUE;
        }
        // The body ended before the trailers: it is whole now.
        self.body = self.whole_body(vec![]);
        let trailers = self.machine.wants_trailers().then(|| host::all_headers(envoy, abi::REQUEST_TRAILER));
        let (m, mut io) = self.split();
        trailers_status(m.trailers(&mut io, trailers))
    }

    pub fn response_headers(&mut self, envoy: EnvoyPtr, end_of_stream: bool) -> u32 {
        self.hook(envoy);
        if self.machine.forwarded().is_none() {
            return abi::HEADERS_CONTINUE;
        }
        let headers = host::all_headers(envoy, abi::RESPONSE_HEADER);
        if let Some(ttl) = self.machine.response_headers(headers, end_of_stream) {
            let _ = host::add_header(envoy, abi::RESPONSE_HEADER, EXPIRES_HEADER, &ttl.to_string());
        }
        abi::HEADERS_CONTINUE
    }

    pub fn response_body(&mut self, envoy: EnvoyPtr, end_of_stream: bool) -> u32 {
        self.hook(envoy);
        if self.machine.forwarded().is_none() {
            return abi::BODY_CONTINUE;
        }
        let chunk =
            if self.machine.wants_response_body() { host::body(envoy, abi::RECEIVED_RESPONSE_BODY) } else { vec![] };
        self.machine.response_body(&chunk, end_of_stream);
        abi::BODY_CONTINUE
    }

    pub fn response_trailers(&mut self, envoy: EnvoyPtr) -> u32 {
        self.hook(envoy);
        if self.machine.forwarded().is_some() {
            let names: Vec<String> =
                host::all_headers(envoy, abi::RESPONSE_TRAILER).into_iter().map(|(n, _)| n).collect();
            self.machine.response_trailers(&names);
        }
        abi::TRAILERS_CONTINUE
    }

    /// The answer to the stream's store callout `id` (`status` `None`: none, a reset or a
    /// timeout): parsed here by the core, decided by the machine; the request resumes if the
    /// machine forwards it (a local reply ends it).
    pub fn callout_done(&mut self, envoy: EnvoyPtr, id: u64, status: Option<u16>, body: &[u8]) {
        self.hook(envoy);
        let Some((req, call)) = self.machine.calling() else {
            // Not the machine's call: a waiting request's store poll (`wait.rs`), if any.
            self.poll_answered(id, status, body);
            return;
        };
        if call.wire.id != id {
            return;
        }
        let Some(st) = self.global.store.as_ref() else { return };
        let (skey, owner, asked) = (req.skey, req.owner, call.asked);
        let now = *self.clock.get_or_insert_with(host::now_ms);
        if st.token_refused(status, body) {
            self.global.metrics.inc(MetricsFrom::Stream(envoy), Counter::StoreTokenRefused);
        }
        let backend = st.backend();
        let (answer, fence) = match asked {
            Asked::TakeOver => (StoreAnswer::TakeOver(backend.parse_take_over(status, body, &skey, &owner)), None),
            Asked::Settled => (StoreAnswer::Settled(backend.parse_read(status, body, &skey, &st.seal, now)), None),
            Asked::Claim => match backend.parse_claim(status, body, &owner, &skey, &st.seal, now) {
                Ok((reply, fence)) => (StoreAnswer::Claim(Ok(reply)), fence),
                Err(e) => (StoreAnswer::Claim(Err(e)), None),
            },
        };
        let waited = now.saturating_sub(call.wire.sent_ms);
        self.global.metrics.record(envoy, Histogram::StoreRoundTripMs, waited);
        let (m, mut io) = self.split();
        if m.store_answer(&mut io, answer, fence) == Flow::Continue {
            host::continue_decoding(envoy);
        }
    }

    /// The stream is over (Envoy's access-log time): a forwarded request's claim is settled by
    /// what the exchange came to; one still waiting is abandoned.
    pub fn stream_complete(&mut self, envoy: EnvoyPtr) {
        self.hook(envoy);
        {
            let (m, mut io) = self.split();
            m.release_budget(&mut io);
        }
        match self.machine.phase() {
            Phase::Pass => {
                self.global.metrics.settled(envoy);
                return;
            }
            Phase::Forwarded { .. } => {
                // No response reached the filter: ended for an internal redirect, its claim is
                // handed over to the stream Envoy re-creates (`redirect.rs`), not settled here.
                let (redirected, code_details) = self.redirected_away(envoy);
                if let (false, Some((req, response))) = (redirected, self.machine.forwarded()) {
                    let (e, repeated) = ended(envoy, req, response, code_details);
                    if repeated {
                        self.count(Counter::UpstreamAttemptsRepeated);
                        host::log(LogLevel::Warn, &log_line(Some(req), "upstream_attempts_repeated", &e.detail));
                    }
                    let (m, mut io) = self.split();
                    m.settle(&mut io, e);
                }
            }
            Phase::Waiting { .. } | Phase::Calling { .. } => {
                let (m, mut io) = self.split();
                m.abandon(&mut io);
            }
            Phase::Detached { skey } => {
                let skey = *skey;
                self.detached_complete(&skey);
            }
            // Held and never answered: its client left (the Wasm build's outcome for it); its
            // wait ends here (scheduler deleted, out of the registry).
            Phase::Held { skey } => {
                let skey = *skey;
                if self.waiting.take().is_some() {
                    let (_, mut io) = self.split();
                    io.publish(Some(&skey), idemgate::engine::machine::ABANDONED);
                }
            }
            _ => {}
        }
        self.machine.end();
        // Every counter of this request is counted: `idemgate.requests_settled` last.
        self.global.metrics.settled(envoy);
    }

    /// Counts `c` for this request (per route too, for a counter kept per route).
    fn count(&self, c: Counter) {
        self.global.metrics.inc_for(MetricsFrom::Stream(self.envoy), c, self.route);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(json: &str) -> Config {
        Config::parse(json.as_bytes()).unwrap()
    }

    #[test]
    fn local_tier_configs_run_here() {
        assert_eq!(refusal(&parsed(r#"{"scope": {"global": true}}"#)), None);
        assert_eq!(
            refusal(&parsed(r#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/pay"}]}"#)),
            None
        );
        // The Redis store (webdis) and the etcd store run here.
        assert_eq!(refusal(&parsed(r#"{"scope": {"global": true}, "store": {"cluster": "webdis"}}"#)), None);
        assert_eq!(
            refusal(&parsed(r#"{"scope": {"global": true}, "store": {"cluster": "etcd", "kind": "etcd"}}"#)),
            None
        );
    }

    #[test]
    fn features_not_carried_are_refused_by_name() {
        // The one feature not carried: a detached hop through an internal listener.
        let json = r#"{"scope": {"global": true}, "forwarding": "detached", "upstream": {"cluster": "idemgate_hop", "timeout_ms": 5000}}"#;
        let c = match Config::parse(json.as_bytes()) {
            Ok(c) => c,
            Err(e) => panic!("{json}: {e}"),
        };
        let why = refusal(&c).unwrap_or_default();
        assert!(why.contains("upstream.hop \"internal_listener\""), "{json}: {why}");
        assert!(why.contains("native"), "{why}");
        // Carried since: `in_flight: "wait"` (`http/wait.rs`), with either tier.
        for json in [
            r#"{"scope": {"global": true}, "in_flight": "wait"}"#,
            r#"{"scope": {"global": true}, "in_flight": "wait", "wait_ms": 300, "store": {"cluster": "webdis"}}"#,
        ] {
            assert_eq!(Config::parse(json.as_bytes()).map(|c| refusal(&c)).ok(), Some(None), "{json}");
        }
        // Carried since: `forwarding: "detached"` straight to its cluster (`http/detached.rs`).
        let direct = r#"{"scope": {"global": true}, "forwarding": "detached", "upstream": {"cluster": "up", "hop": "direct", "timeout_ms": 5000}}"#;
        assert_eq!(Config::parse(direct.as_bytes()).map(|c| refusal(&c)).ok(), Some(None));
        // Carried since: routes selected by Envoy's route name.
        let named = Config::parse(br#"{"scope": {"global": true}, "routes": [{"route_name": "pay"}]}"#);
        assert_eq!(named.map(|c| refusal(&c)).ok(), Some(None));
        // Carried since: `next_hop_failures: "classify"` (Envoy 1.40 serves the attempt count).
        let classify = Config::parse(br#"{"scope": {"global": true}, "next_hop_failures": "classify"}"#);
        assert_eq!(classify.map(|c| refusal(&c)).ok(), Some(None));
        // And MCP routes (`protocol: "mcp"`).
        let mcp = Config::parse(
            br#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/mcp", "protocol": "mcp"}]}"#,
        );
        assert_eq!(mcp.map(|c| refusal(&c)).ok(), Some(None));
    }
}
