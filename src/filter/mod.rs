//! The proxy-wasm glue: turns Envoy's callbacks into core inputs and core decisions into host
//! calls. No rule lives here; see ARCHITECTURE.md.
//!
//! The root context (one per worker VM) owns everything that must outlive a request: store writes
//! after forwarding, detached upstream calls, and requests held waiting for another attempt's
//! result. HTTP contexts hand it work through `Queues` (same VM, same thread) and wake it through
//! a shared queue registered by that root.
// The benchmark builds (`empty-filter`, `bench-floor`) leave idemgate's own glue unused.
#![cfg_attr(any(feature = "empty-filter", feature = "bench-floor"), allow(dead_code, unused_imports))]

pub(crate) mod host;
mod http;
mod reply;
mod settle;
mod stores;
mod writes;

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::time::Duration;

use log::{debug, error, info, warn};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, MapType};

use crate::backend::{Backend, Credential};
use crate::bench_host::meter;
use crate::config::{Config, Forwarding};
use crate::decision::Outcome;
use crate::engine::forwards::{
    self as engine_forwards, Action as ForwardAction, Forwards, Reply as ForwardReply, HOP_PROBE_TIMEOUT_MS,
};
use crate::engine::keeper::{Action as KeeperAction, Keeper, LeaseKind, Note as KeeperNote};
use crate::engine::settle::Level;
use crate::engine::waiters::{self as engine_waiters, Action as WaitAction, Reply as WaitReply};
use crate::engine::writes::{self as engine_writes, Action as WriteAction, Job, Note, WriteId, Writes};
use crate::local::Table;
use crate::owner::{OwnerSeed, OwnerToken, TokenSources};
use crate::problem::ProblemKind;
use crate::scope::StorageKey;
use crate::seal::Seal;
use crate::store::Transition;
use crate::wait::{self, Seen};
use host::{Counter, Gauge, Histogram, HostShared, Metrics};

/// The VM environment variable holding webdis credentials as `user:password` (set it in the Wasm
/// `vm_config.environment_variables`; it never appears in the plugin configuration).
pub const STORE_AUTH_ENV: &str = "IDEMGATE_STORE_AUTH";

/// The root's tick: waiters are checked at this pace, sweeps run once a second.
const TICK: Duration = Duration::from_millis(100);
/// How long a stopping root context holds its VM for store writes still pending.
const STOP_HOLD_MS: u64 = engine_writes::STOP_HOLD_MS;

#[cfg(not(any(feature = "empty-filter", feature = "bench-floor")))]
proxy_wasm::main! {{
    host::init_logging();
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> { Box::new(Root::new(id)) });
}}

pub use crate::engine::forwards::Forward;
pub use crate::engine::waiters::Waiter;

/// Work handed from HTTP contexts to their root context.
#[derive(Default)]
pub struct Queues {
    pub jobs: RefCell<VecDeque<Job>>,
    pub forwards: RefCell<VecDeque<Forward>>,
    pub waiters: RefCell<Vec<Waiter>>,
    /// HTTP contexts that can still be answered (detached or waiting).
    pub live: RefCell<HashSet<u32>>,
}

/// The most claim times `Shared::held` keeps.
const HELD_MAX: usize = 4096;

/// What a root context shares with the HTTP contexts it creates (same VM, same thread).
pub struct Shared {
    pub config: Config,
    pub table: Table,
    pub metrics: Metrics,
    /// Request-body bytes buffered by this VM right now.
    pub buffered: Cell<u64>,
    /// This VM's owner-token seed and the number of tokens made from it (`crate::owner`).
    owner_seed: OwnerSeed,
    tokens: Cell<u64>,
    pub queues: Rc<Queues>,
    pub queue_id: Option<u32>,
    /// The `authorization` header of every store request: webdis's basic credential from the VM's
    /// environment, or etcd's current token (`crate::etcd::Auth`), replaced as tokens are renewed.
    pub credentials: RefCell<Option<String>>,
    /// `store.kind: "etcd"` with `IDEMGATE_STORE_AUTH` set: the `user:password` the root
    /// authenticates with, and the token's state.
    pub etcd_secret: Option<String>,
    pub etcd_auth: RefCell<crate::etcd::Auth>,
    /// The secrets store records are sealed with, from the VM's environment (`crate::seal`):
    /// present whenever a store is configured (the configuration is refused otherwise).
    pub seal: Option<Seal>,
    /// `store.kind: "etcd"`: the leases this VM's root context granted ahead of need
    /// (`crate::etcd::Leases`), and the TTL each is granted with.
    pub leases: RefCell<crate::etcd::Leases>,
    pub lease_ttl_seconds: u64,
    /// The keys' tombstones' leases, where a tombstone outlives every record, and their TTL
    /// (`crate::etcd::tombstone_lease_ttl_seconds`; `None`: under the records' leases).
    pub tombstone_leases: RefCell<crate::etcd::Leases>,
    pub tombstone_lease_ttl_seconds: Option<u64>,
    /// Claims of streams Envoy ended for an internal redirect, waiting for the re-created stream
    /// (`crate::redirect`).
    pub handoffs: RefCell<crate::redirect::Handoffs<settle::Claim>>,
    /// When each claim handed to the root for detached forwarding was made (its owner token),
    /// for `key_held_ms` at its settlement; the oldest dropped past `HELD_MAX`.
    pub held: RefCell<Vec<(crate::owner::OwnerToken, u64)>>,
    /// Fault tests only: `lose_next_wake`.
    #[cfg(feature = "crash-injection")]
    lose_next_wake: Cell<bool>,
}

impl Shared {
    /// A claim made at `since_ms` goes to the root for detached forwarding: its hold is measured
    /// at its settlement (`held_since`).
    pub fn hold_from(&self, owner: crate::owner::OwnerToken, since_ms: u64) {
        let mut held = self.held.borrow_mut();
        if held.len() >= HELD_MAX {
            held.remove(0);
        }
        held.push((owner, since_ms));
    }

    /// When the claim of `owner` handed to the root was made, taken out.
    pub fn held_since(&self, owner: &crate::owner::OwnerToken) -> Option<u64> {
        let mut held = self.held.borrow_mut();
        let i = held.iter().position(|(o, _)| o == owner)?;
        Some(held.remove(i).1)
    }

    /// The next owner token of this VM: no host call, no randomness (see `crate::owner`).
    pub fn next_owner(&self) -> OwnerToken {
        let n = self.tokens.get().saturating_add(1);
        self.tokens.set(n);
        OwnerToken::next(&self.owner_seed, n)
    }

    /// Fault tests only (feature `crash-injection`): the next wake is not sent, as if the host
    /// had lost it.
    #[cfg(feature = "crash-injection")]
    pub fn lose_next_wake(&self) {
        self.lose_next_wake.set(true);
    }

    #[cfg(not(feature = "crash-injection"))]
    pub fn lose_next_wake(&self) {}

    /// Wakes the root (`on_queue_ready`). If the host loses the wake, the root's tick finds
    /// the work anyway (`Root::collect_stray_work`).
    fn wake(&self) {
        #[cfg(feature = "crash-injection")]
        if self.lose_next_wake.replace(false) {
            return;
        }
        if let Some(q) = self.queue_id {
            if let Err(e) = host::enqueue(q, b"w") {
                warn!("idemgate: cannot wake the root context (queue {q}: {e:?}): its tick takes the work");
            }
        }
    }

    /// Hands a store write to the root context.
    /// Hands the store write `t` of `skey` (with its fallback) to the root context. Without a
    /// store (and so no seal) there is nothing to write.
    pub fn push_write(&self, what: &'static str, skey: &StorageKey, t: Transition, fallback: Option<Transition>) {
        self.push_write_fenced(what, skey, t, fallback, None);
    }

    /// `push_write`, for a transition decided on a value read from the store (`fence`: etcd
    /// compares its revision).
    pub fn push_write_fenced(
        &self,
        what: &'static str,
        skey: &StorageKey,
        t: Transition,
        fallback: Option<Transition>,
        fence: Option<&crate::etcd::Fence>,
    ) {
        let Some(seal) = self.seal.as_ref() else {
            // Cannot happen: a store is configured only with its seal (`on_configure`).
            error!("idemgate: store write {what} for key={} dropped: no record seal", skey.hex());
            return;
        };
        // Only etcd's requests carry a time (a lease, the clock rule); Redis judges by its own.
        let now = if stores::backend(self).uses_proxy_clock() { host::now_ms() } else { 0 };
        let built = self.build_job(what, skey, t, fence, seal, now).and_then(|mut job| {
            let fallback =
                fallback.map(|f| self.build_job("unknown_fallback", skey, f, None, seal, now)).transpose()?;
            job.fallback = fallback.map(Box::new);
            Ok(job)
        });
        match built {
            Ok(job) => self.push_job(job),
            // As a write whose every attempt failed: a claim left in the store is judged
            // outcome-unknown once its lock expires.
            Err(e) => {
                self.metrics.inc(Counter::StoreWriteFailures);
                warn!("idemgate: store write {what} for key={} not sent: {e}", skey.hex());
            }
        }
    }

    /// The write `t` as a job: its request, and `t` itself when it carries a record (for the
    /// requests some answers call for: `Job::source`).
    pub fn build_job(
        &self,
        what: &'static str,
        skey: &StorageKey,
        t: Transition,
        fence: Option<&crate::etcd::Fence>,
        seal: &crate::seal::Seal,
        now: u64,
    ) -> Result<Job, stores::Unbuilt> {
        Job::build_owned(what, skey, t, fence, stores::writer(self, now), seal, now)
    }

    fn push_job(&self, job: Job) {
        self.metrics.add(Gauge::StoreWritesPending, 1);
        self.queues.jobs.borrow_mut().push_back(job);
        self.wake();
    }

    /// Hands a detached upstream call to the root context.
    pub fn push_forward(&self, f: Forward) {
        self.queues.live.borrow_mut().insert(f.context_id);
        self.queues.forwards.borrow_mut().push_back(f);
        self.wake();
    }

    /// Holds a request until its key's first attempt finishes.
    pub fn push_waiter(&self, w: Waiter) {
        self.queues.live.borrow_mut().insert(w.context_id);
        self.queues.waiters.borrow_mut().push(w);
    }
}

enum Call {
    /// An etcd lease grant (`store.kind: "etcd"`), sent at this time (this proxy's clock): its
    /// lease is usable a window from then, whichever grant's answer it is.
    Lease {
        sent_at_ms: u64,
        /// Which of the root's leases it grants.
        kind: LeaseKind,
    },
    /// An etcd authentication (`store.kind: "etcd"` with a credential).
    Auth,
    Write(WriteId),
    Forward(Box<Forward>),
    Poll(u32),
    /// The probe of an internal listener chain (`upstream.hop: "internal_listener"`): its cluster.
    HopProbe(String),
}

struct Root {
    id: u32,
    shared: Option<Rc<Shared>>,
    /// The local table's sweep and its gauges (`engine::sweep`).
    sweeper: crate::engine::sweep::Sweeper,
    queues: Rc<Queues>,
    calls: HashMap<u32, Call>,
    queue_id: Option<u32>,
    /// The store writes made after forwarding: in flight, waiting for their retry, and the
    /// stopping root's hold (`crate::engine::writes`).
    writes: Writes,
    /// The last tick found work queued by HTTP contexts and not yet taken by `on_queue_ready`.
    stray_seen: bool,
    /// The `count-host-calls` build's figures, flushed to its metrics on the tick.
    meter: meter::Flush,
    /// The detached forwards' hop probes: clusters behind an internal listener, proven or probed
    /// (`crate::engine::forwards`).
    forwards: Forwards,
}

impl Root {
    fn new(id: u32) -> Root {
        Root {
            id,
            shared: None,
            sweeper: crate::engine::sweep::Sweeper::default(),
            queues: Rc::new(Queues::default()),
            calls: HashMap::new(),
            queue_id: None,
            writes: Writes::default(),
            stray_seen: false,
            meter: meter::Flush::new(),
            forwards: Forwards::default(),
        }
    }

    /// Takes the store writes and detached forwards HTTP contexts queued for this root.
    fn take_queued_work(&mut self) {
        // What a later tick finds queued was queued after this.
        self.stray_seen = false;
        self.take_queued_writes();
        let forwards: Vec<Forward> = self.queues.forwards.borrow_mut().drain(..).collect();
        for f in forwards {
            self.forward_through_hop(f);
        }
    }

    /// A detached request handed over: sent once its cluster is proven to be the internal
    /// listener chain that runs the filters after idemgate and the route table (`upstream.hop`);
    /// a cluster not yet proven is probed first, the request waiting for the answer
    /// (`engine::forwards`).
    fn forward_through_hop(&mut self, f: Forward) {
        let action = self.forwards.queued(f, host::now_ms());
        self.run_forwards(action.into_iter().collect());
    }

    /// The probe's answer: the chain's mark proves the cluster (its waiting forwards go);
    /// anything else refuses them (never sent, keys released) and the next forward probes again.
    fn hop_probe_answered(&mut self, cluster: String, num_headers: usize) {
        let headers = if num_headers == 0 { vec![] } else { host::all_headers(MapType::HttpCallResponseHeaders) };
        let status =
            headers.iter().find(|(n, _)| n == ":status").and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse().ok());
        let out = self.forwards.probe_answered(cluster, status, &headers, host::now_ms());
        self.run_forwards(out);
    }

    /// Carries out `engine::forwards`' actions in order.
    fn run_forwards(&mut self, actions: Vec<ForwardAction>) {
        for a in actions {
            self.run_forward(a);
        }
    }

    fn run_forward(&mut self, a: ForwardAction) {
        match a {
            ForwardAction::Probe { cluster, headers } => {
                let h: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
                match host::dispatch_http_call(&cluster, h, &[], Duration::from_millis(HOP_PROBE_TIMEOUT_MS)) {
                    Ok(token) => {
                        self.calls.insert(token, Call::HopProbe(cluster));
                    }
                    Err(e) => {
                        let out = self.forwards.probe_not_sent(&cluster, &format!("{e:?}"));
                        self.run_forwards(out);
                    }
                }
            }
            ForwardAction::Send(f, timeout_ms) => {
                let Some(s) = self.shared.clone() else { return };
                let headers: Vec<(&str, &str)> = f.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
                match host::dispatch_http_call(&f.cluster, headers, &f.body, Duration::from_millis(timeout_ms)) {
                    Ok(token) => {
                        s.metrics.inc(Counter::DetachedForwards);
                        self.calls.insert(token, Call::Forward(f));
                    }
                    Err(e) => self.run_forward(engine_forwards::not_sent(*f, &format!("{e:?}"))),
                }
            }
            // Nothing was sent: free the key and tell the client.
            ForwardAction::Refuse { forward: f, log, detail, problem } => {
                let Some(s) = self.shared.clone() else { return };
                warn!("{log}");
                settle::settle(&s, &f.claim, Outcome::Release, None, false, detail);
                self.answer(
                    f.context_id,
                    (problem.slug(), &f.claim.skey),
                    |rid| reply::problem(&problem, rid, None),
                    &f.request_id,
                );
            }
            ForwardAction::Log(Level::Error, line) => error!("{line}"),
            ForwardAction::Log(Level::Warn, line) => warn!("{line}"),
            ForwardAction::Log(Level::Info, line) => info!("{line}"),
            ForwardAction::Log(Level::Debug, line) => debug!("{line}"),
        }
    }

    /// Work queued by an HTTP context wakes the root through its shared queue; a wake the host
    /// never delivers would leave a completion or outcome-unknown write (or a detached forward)
    /// queued for good. Work still queued at two ticks in a row (the wake, posted to this same
    /// thread, would have run between them) was not woken for: taken here, counted, logged.
    fn collect_stray_work(&mut self) {
        let queued = self.queues.jobs.borrow().len() + self.queues.forwards.borrow().len();
        if queued == 0 {
            self.stray_seen = false;
            return;
        }
        if !self.stray_seen {
            self.stray_seen = true;
            return;
        }
        self.stray_seen = false;
        if let Some(s) = self.shared.as_ref() {
            for _ in 0..queued {
                s.metrics.inc(Counter::RootWakesMissed);
            }
        }
        warn!(
            "idemgate: {queued} store write(s) or forward(s) queued for the root were not woken for: taken by its tick"
        );
        self.take_queued_work();
    }

    /// Store writes this root still owns: queued by HTTP contexts, in flight, or waiting to retry.
    fn pending_writes(&self) -> usize {
        self.queues.jobs.borrow().len() + self.writes.pending()
    }

    /// Hands the writes HTTP contexts queued to the write machine, and sends them.
    fn take_queued_writes(&mut self) {
        let jobs: Vec<Job> = self.queues.jobs.borrow_mut().drain(..).collect();
        for job in jobs {
            self.writes.push(job);
        }
        self.run_writes();
    }

    /// Carries out the write machine's actions, in order, until it has none.
    fn run_writes(&mut self) {
        while let Some(action) = self.writes.poll() {
            match action {
                WriteAction::Send(id) => self.send_write(id),
                WriteAction::Note { what, key_hash, note, .. } => self.write_note(what, &key_hash, note),
                WriteAction::Ended => self.write_ended(),
                WriteAction::Stop { pending } => self.stop_now(pending),
            }
        }
    }

    fn send_write(&mut self, id: WriteId) {
        let Some(s) = self.shared.clone() else { return self.writes.abandon(id) };
        let Some(cfg) = s.config.store.as_ref() else {
            // Cannot happen (writes exist only with a store): count it over rather than hold the VM.
            error!("idemgate: store write with no store configured");
            return self.writes.abandon(id);
        };
        let Some(request) = self.writes.request(id) else { return };
        s.metrics.inc(Counter::StoreCalls);
        match writes::dispatch(cfg, request, &s.credentials) {
            Ok(token) => {
                self.calls.insert(token, Call::Write(id));
            }
            Err(e) => self.writes.not_sent(id, &e, &host::now_ms),
        }
    }

    /// The store's answer to write `id` (`status` `None`: no answer).
    fn write_answered(&mut self, id: WriteId, status: Option<u16>, body: &[u8]) {
        let Some(s) = self.shared.clone() else { return };
        stores::note_answer(&s, status, body);
        let writer = || {
            let now = host::now_ms();
            (now, stores::writer(&s, now))
        };
        let b = engine_writes::Builder { store: stores::backend(&s), seal: s.seal.as_ref(), writer: &writer };
        self.writes.answered(id, status, body, &b);
        self.run_writes();
    }

    /// Counts and logs what happened to a write.
    fn write_note(&self, what: &str, key_hash: &str, note: Note) {
        let Some(s) = self.shared.as_ref() else { return };
        for c in crate::metrics::note_counters(&note) {
            s.metrics.inc(*c);
        }
        match note {
            Note::Landed | Note::TooLarge => {}
            Note::NoLongerOurs => {
                info!("idemgate: store write {what} for key={key_hash} found the claim no longer ours")
            }
            Note::ClaimGoneRewritten => {
                warn!(
                    "idemgate: store write {what} for key={key_hash} found the claim gone from the store (flushed, evicted or failed over) and wrote the record where it was"
                );
            }
            Note::NothingWhereAbsent => {
                info!("idemgate: store write {what} for key={key_hash} found the key absent; nothing to write there")
            }
            Note::ScriptLoad => {
                info!(
                    "idemgate: store write {what} for key={key_hash} met a store without its script (NOSCRIPT); sent again with the script"
                );
            }
            Note::TooLargeWithoutBody => {
                warn!(
                    "idemgate: store write {what} for key={key_hash} refused by the store as too large; writing the record without its response body (retries get response-not-stored)"
                );
            }
            Note::Retry { why, delay_ms } => {
                warn!("idemgate: store write {what} for key={key_hash} failed ({why}); retrying in {delay_ms} ms");
            }
            Note::Failed { why, attempts, fallback } => {
                if fallback {
                    warn!("idemgate: store write {what} for key={key_hash} failed {attempts} times ({why}); marking the outcome unknown");
                } else {
                    warn!("idemgate: store write {what} for key={key_hash} failed {attempts} times ({why}); a claim left in the store is judged outcome-unknown once its lock expires");
                }
            }
        }
    }

    /// A write is over (landed, or given up after its fallback).
    fn write_ended(&mut self) {
        if let Some(s) = self.shared.as_ref() {
            // Flushed with the counters on the tick, after them (`host::flush_counters`): a
            // reader that sees no write pending sees every write's counters
            // (`store_claim_gone_rewritten`, `store_write_failures`, ...).
            s.metrics.add(Gauge::StoreWritesPending, -1);
        }
        self.finish_stopping_if_drained();
    }

    /// A stopping root tells the host it is done once its writes are over or its bound passed.
    fn finish_stopping_if_drained(&mut self) {
        if self.writes.stopping() {
            self.writes.stop_if_drained(self.queues.jobs.borrow().len(), host::now_ms());
        }
    }

    /// The write machine says the stopping root may stop, `pending` writes left.
    fn stop_now(&mut self, pending: usize) {
        if pending > 0 {
            warn!("idemgate: root context stopping with {pending} store write(s) still pending after {STOP_HOLD_MS} ms: other proxies judge those keys outcome-unknown");
            if let Some(s) = self.shared.as_ref() {
                s.metrics.add(Gauge::StoreWritesPending, -(pending as i64));
            }
        } else {
            info!("idemgate: root context stopping: every queued store write has landed");
        }
        // No tick after this one's end: what it counted, and the gauge's last moves, go now.
        meter::background(host::flush_counters);
        self.done();
    }

    /// Answers a live HTTP context from the root, leaving `outcome` (its slug and storage key) in
    /// that stream's filter state as the HTTP context does for the answers it sends itself.
    fn answer(&self, context_id: u32, outcome: (&str, &StorageKey), send: impl FnOnce(&str), request_id: &str) {
        self.answer_publishing(
            context_id,
            outcome.1,
            |rid, publish| {
                publish(outcome.0);
                send(rid);
            },
            request_id,
        );
    }

    /// `answer`, for a reply that learns its outcome as it is built: `send` is given the request
    /// id and a function that publishes the outcome (call it before sending).
    fn answer_publishing(
        &self,
        context_id: u32,
        skey: &StorageKey,
        send: impl FnOnce(&str, &dyn Fn(&str)),
        request_id: &str,
    ) {
        if !self.queues.live.borrow().contains(&context_id) {
            return;
        }
        if host::set_effective_context(context_id) {
            send(request_id, &|outcome| host::publish(outcome, Some(skey)));
        }
        self.queues.live.borrow_mut().remove(&context_id);
    }

    /// The upstream's answer to a detached call (`engine::forwards::answered`): settle the
    /// claim, then answer the client if it is still there.
    fn forward_answered(&mut self, f: Forward, num_headers: usize, body_size: usize, num_trailers: usize) {
        let Some(s) = self.shared.clone() else { return };
        let policy = s.config.policy_at(f.claim.policy_index);
        let a = match policy {
            None => engine_forwards::answered(&f, None, None, vec![], vec![], &[], false, 0),
            Some(policy) => {
                let (status, body) = writes::answer(body_size, num_headers);
                let headers =
                    if num_headers == 0 { vec![] } else { host::all_headers(MapType::HttpCallResponseHeaders) };
                let now = host::now_ms();
                let trailers: Vec<String> = if num_trailers > 0 {
                    host::all_headers(MapType::HttpCallResponseTrailers).into_iter().map(|(n, _)| n).collect()
                } else {
                    vec![]
                };
                let live = self.queues.live.borrow().contains(&f.context_id);
                engine_forwards::answered(&f, Some(policy), status, headers, body, &trailers, live, now)
            }
        };
        if let Some(line) = &a.log {
            s.metrics.inc(Counter::InternalErrors);
            error!("{line}");
        }
        let slug = a.settle.map_or(crate::engine::settle::INTERNAL_STATE, |st| {
            settle::settle(&s, &f.claim, st.outcome, st.response, st.too_large, &st.detail)
        });
        if let Some(line) = a.kept {
            info!("{line}");
        }
        match a.reply {
            ForwardReply::Response { status, headers, body, expires } => self.answer(
                f.context_id,
                (slug, &f.claim.skey),
                |_| reply::response(status, &headers, &body, false, expires.as_deref(), slug),
                &f.request_id,
            ),
            ForwardReply::Problem(kind) => self.answer(
                f.context_id,
                (kind.slug(), &f.claim.skey),
                |rid| reply::problem(&kind, rid, None),
                &f.request_id,
            ),
        }
    }

    /// Checks every waiting request (`engine::waiters::tick`): answered from the local tier as
    /// soon as it shows the outcome, from the store (polled at most every `WAIT_STORE_POLL_MS`),
    /// or with a 409 at its deadline.
    fn check_waiters(&mut self) {
        let Some(s) = self.shared.clone() else { return };
        let now = host::now_ms();
        let actions = {
            let mut ws = self.queues.waiters.borrow_mut();
            let live = self.queues.live.borrow();
            engine_waiters::tick(&mut ws, now, s.config.store.is_some(), &|id| live.contains(&id), &mut |k| {
                s.table.peek(&mut HostShared, k, now).ok().map(Seen::from_local)
            })
        };
        self.run_waiters(actions);
    }

    /// The store's answer to a waiter's poll.
    fn poll_answered(&mut self, context_id: u32, num_headers: usize, body_size: usize) {
        let (status, body) = writes::answer(body_size, num_headers);
        let Some(s) = self.shared.clone() else { return };
        stores::note_answer(&s, status, &body);
        let actions = engine_waiters::store_answered(
            &mut self.queues.waiters.borrow_mut(),
            context_id,
            status,
            &body,
            stores::backend(&s),
            s.seal.as_ref(),
            host::now_ms(),
            &mut |k| wait::local_holds(s.table.peek(&mut HostShared, k, host::now_ms()).ok().map(Seen::from_local)),
        );
        self.run_waiters(actions);
    }

    /// Carries out the waiters machine's actions.
    fn run_waiters(&mut self, actions: Vec<WaitAction>) {
        let Some(s) = self.shared.clone() else { return };
        for action in actions {
            match action {
                WaitAction::Answer(w, reply) => self.wait_answered(&w, reply),
                WaitAction::Poll { context_id, skey } => {
                    let Some(cfg) = s.config.store.as_ref() else { continue };
                    s.metrics.inc(Counter::StoreCalls);
                    if let Ok(token) = writes::dispatch(cfg, &stores::read_request(&s, &skey), &s.credentials) {
                        self.calls.insert(token, Call::Poll(context_id));
                        engine_waiters::poll_sent(&mut self.queues.waiters.borrow_mut(), context_id);
                    }
                }
                WaitAction::Unauthentic { policy_index, skey, why } => {
                    s.metrics.inc_for(Counter::RecordUnauthentic, Some(policy_index));
                    warn!("idemgate: outcome=record_unauthentic key={} waiting=true error={why}", skey.hex());
                }
            }
        }
    }

    /// Answers a waiting request as the waiters machine says, counted by the core's rule
    /// (`metrics::wait_counters`, the native build's too).
    fn wait_answered(&self, w: &Waiter, reply: WaitReply) {
        let Some(s) = self.shared.clone() else { return };
        s.metrics.record(Histogram::WaitMs, host::now_ms().saturating_sub(w.since_ms));
        for c in crate::metrics::wait_counters(&reply).into_iter().flatten() {
            s.metrics.inc_for(c, Some(w.policy_index));
        }
        let rid = w.request_id.clone();
        match reply {
            // Released (0: the first attempt never executed; the client may retry at once), or
            // the wait is over.
            WaitReply::InFlight { retry_after_seconds } => {
                let kind = ProblemKind::InFlight { retry_after_seconds };
                self.answer(w.context_id, (kind.slug(), &w.skey), |r| reply::problem(&kind, r, None), &rid);
            }
            WaitReply::Replay(r) => {
                if let crate::record::State::Completed(c) = &r.state {
                    s.metrics.record(Histogram::ReplayBytes, c.body.len() as u64);
                }
                let accept: Vec<&[u8]> = w.accept_encoding.iter().map(Vec::as_slice).collect();
                self.answer_publishing(
                    w.context_id,
                    &w.skey,
                    |rid, publish| {
                        let sent = reply::replay(&r, rid, host::now_ms(), &accept, w.max_decoded_bytes, publish);
                        if let Some(c) = sent.counter() {
                            s.metrics.inc_for(c, Some(w.policy_index));
                        }
                    },
                    &rid,
                );
            }
            WaitReply::Problem(kind) => {
                if let ProblemKind::RecordUnreadable { .. } = kind {
                    warn!("idemgate: outcome=record_unreadable request_id={rid} waiting=true");
                }
                self.answer(w.context_id, (kind.slug(), &w.skey), |r| reply::problem(&kind, r, None), &rid);
            }
        }
    }

    /// `store.kind: "etcd"`: grants the next lease when the keeper says so (ahead of need: never
    /// on a request's path).
    fn grant_lease_if_due(&mut self) {
        let Some(s) = self.shared.clone() else { return };
        let Some(cfg) = s.config.store.as_ref().filter(|_| stores::backend(&s).needs_tick()) else { return };
        let now = host::now_ms();
        if let Some(a) = keeper(&s, |k| k.grant_if_due(now)) {
            self.keeper_action(&s, cfg, a, now);
        }
    }

    /// `store.kind: "etcd"` with a credential: authenticates when the keeper says so (at start,
    /// every `store.token_refresh_seconds`, and at once after etcd refused the token), ahead of
    /// need like the leases.
    fn authenticate_if_due(&mut self) {
        let Some(s) = self.shared.clone() else { return };
        if s.etcd_secret.is_none() {
            return;
        }
        let Some(cfg) = s.config.store.as_ref() else { return };
        let now = host::now_ms();
        if let Some(a) = keeper(&s, |k| k.authenticate_if_due(cfg.token_refresh_seconds.saturating_mul(1000), now)) {
            self.keeper_action(&s, cfg, a, now);
        }
    }

    fn auth_answered(&mut self, num_headers: usize, body_size: usize) {
        let Some(s) = self.shared.clone() else { return };
        let Some(cfg) = s.config.store.as_ref() else { return };
        let (status, body) = writes::answer(body_size, num_headers);
        let now = host::now_ms();
        for a in keeper(&s, |k| k.auth_answered(status, &body, now)) {
            self.keeper_action(&s, cfg, a, now);
        }
    }

    fn lease_answered(&mut self, kind: LeaseKind, sent_at_ms: u64, num_headers: usize, body_size: usize) {
        let Some(s) = self.shared.clone() else { return };
        let Some(cfg) = s.config.store.as_ref() else { return };
        let (status, body) = writes::answer(body_size, num_headers);
        stores::note_answer(&s, status, &body);
        let now = host::now_ms();
        let note = keeper(&s, |k| k.lease_answered(kind, sent_at_ms, status, &body, now));
        self.keeper_action(&s, cfg, KeeperAction::Note(note), now);
    }

    /// Carries out one action of the etcd keeper.
    fn keeper_action(&mut self, s: &Rc<Shared>, cfg: &crate::config::StoreConfig, a: KeeperAction, now: u64) {
        match a {
            KeeperAction::Authenticate(req) => {
                s.metrics.inc(Counter::StoreCalls);
                // The authentication itself carries no token.
                match writes::send(cfg, &req, None) {
                    Ok(token) => {
                        keeper(s, |k| k.auth_sent(now));
                        self.calls.insert(token, Call::Auth);
                    }
                    Err(e) => {
                        s.metrics.inc(Counter::StoreErrors);
                        keeper(s, |k| k.auth_not_sent(now));
                        warn!("idemgate: etcd authentication not sent: {e}");
                    }
                }
            }
            KeeperAction::GrantLease(req, kind) => {
                s.metrics.inc(Counter::StoreCalls);
                match writes::dispatch(cfg, &req, &s.credentials) {
                    Ok(token) => {
                        keeper(s, |k| k.lease_sent(kind, now));
                        self.calls.insert(token, Call::Lease { sent_at_ms: now, kind });
                    }
                    Err(e) => {
                        s.metrics.inc(Counter::StoreErrors);
                        keeper(s, |k| k.lease_not_sent(kind, now));
                        warn!("idemgate: etcd lease grant not sent: {e}");
                    }
                }
            }
            KeeperAction::UseToken(token) => *s.credentials.borrow_mut() = Some(token),
            KeeperAction::Note(KeeperNote::AuthUnbuilt(e)) => error!("idemgate: etcd authentication not sent: {e}"),
            KeeperAction::Note(KeeperNote::Authenticated) => {
                s.metrics.inc(Counter::StoreAuthentications);
                info!("idemgate: etcd authenticated (root {})", self.id);
            }
            KeeperAction::Note(KeeperNote::AuthFailed { why, said }) => {
                s.metrics.inc(Counter::StoreErrors);
                warn!(
                    "idemgate: etcd authentication failed: {why} {said:?} (the user:password in IDEMGATE_STORE_AUTH)"
                );
            }
            KeeperAction::Note(KeeperNote::LeaseGranted) => {
                info!("idemgate: etcd lease granted (root {}, ttl {} s)", self.id, s.lease_ttl_seconds)
            }
            KeeperAction::Note(KeeperNote::LeaseFailed(e)) => {
                s.metrics.inc(Counter::StoreErrors);
                warn!("idemgate: etcd lease grant failed: {e}");
            }
        }
    }
}

/// The root's etcd lease and token as the keeper machine (`engine::keeper`) sees them.
fn keeper<T>(s: &Shared, f: impl FnOnce(&mut Keeper) -> T) -> T {
    let (mut leases, mut auth) = (s.leases.borrow_mut(), s.etcd_auth.borrow_mut());
    let mut tombstone_leases = s.tombstone_leases.borrow_mut();
    f(&mut Keeper {
        leases: &mut leases,
        tombstone_leases: s.tombstone_lease_ttl_seconds.map(|ttl| (&mut *tombstone_leases, ttl)),
        auth: &mut auth,
        secret: s.etcd_secret.as_deref(),
        lease_ttl_seconds: s.lease_ttl_seconds,
    })
}

impl Context for Root {
    fn on_done(&mut self) -> bool {
        // Counters not yet flushed reach Envoy's /stats before the root stops.
        meter::background(host::flush_counters);
        // Writes handed over by HTTP contexts but not yet dispatched go out now.
        self.take_queued_writes();
        let pending = self.pending_writes();
        if pending == 0 {
            return true;
        }
        // Hold the VM until they land (or the bound passes): a write lost here is a key other
        // proxies answer outcome-unknown although it succeeded.
        if self.writes.stop(self.queues.jobs.borrow().len(), host::now_ms()) {
            return true;
        }
        info!("idemgate: root context asked to stop with {pending} store write(s) pending; holding it for at most {STOP_HOLD_MS} ms");
        false
    }

    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, num_trailers: usize) {
        meter::callback(meter::Callback::Root);
        self.call_answered(token, num_headers, body_size, num_trailers);
        meter::root_answered();
    }
}

impl Root {
    fn call_answered(&mut self, token: u32, num_headers: usize, body_size: usize, num_trailers: usize) {
        match self.calls.remove(&token) {
            Some(Call::Lease { sent_at_ms, kind }) => {
                meter::background(|| self.lease_answered(kind, sent_at_ms, num_headers, body_size))
            }
            Some(Call::Auth) => meter::background(|| self.auth_answered(num_headers, body_size)),
            Some(Call::Write(id)) => {
                let (status, body) = writes::answer(body_size, num_headers);
                self.write_answered(id, status, &body);
            }
            Some(Call::Forward(f)) => self.forward_answered(*f, num_headers, body_size, num_trailers),
            Some(Call::Poll(context_id)) => self.poll_answered(context_id, num_headers, body_size),
            Some(Call::HopProbe(cluster)) => self.hop_probe_answered(cluster, num_headers),
            None => {}
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        meter::background(|| self.configure(size))
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        meter::callback(meter::Callback::Root);
        // Its item only woke us: the host posts one call per item, so one is taken here (the
        // tick empties the queue of any a lost call left behind).
        host::dequeue(queue_id);
        self.take_queued_work();
    }

    fn on_tick(&mut self) {
        meter::background(|| {
            self.tick();
            // Every counter counted since the last tick (requests' and this tick's) reaches
            // Envoy's /stats now: one host call per counter touched, whatever the traffic.
            host::flush_counters();
        });
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        match &self.shared {
            Some(s) => Some(Box::new(http::Http::new(s.clone(), context_id))),
            // Not configured (cannot happen once Envoy accepted the config): it cannot tell a
            // protected request from another, so it refuses every request rather than pass one.
            None => Some(Box::new(Unconfigured)),
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

impl Root {
    fn configure(&mut self, _size: usize) -> bool {
        host::refresh_log_level();
        // Which release runs here and the record formats it reads and writes (src/release.rs).
        info!("{}", crate::release::configured_line());
        // The request's key in Request-life filter state, the mark a redirect's stream inherits.
        if !host::declare_request_key() {
            warn!(
                "idemgate: Envoy refused to declare {} with the life span Request: claims handed over to internal redirects will be outcome-unknown",
                host::KEY_PROPERTY
            );
        }
        let raw = host::plugin_configuration();
        let config = match Config::parse(&raw) {
            Ok(c) => c,
            Err(e) => {
                error!("{e}");
                return false;
            }
        };
        let mut table = match config.store {
            // The store keeps every record: the local tier is a cache that evicts freely.
            Some(_) => Table::new(&config.local).as_cache(),
            None => Table::new(&config.local),
        };
        // After a hot reload from a module of layout v3, its records are honoured (read only).
        if table.consult_v3_if_present(&mut HostShared) {
            info!(
                "idemgate: a local table of layout v3 is present: its records are honoured until this Envoy restarts"
            );
        }
        // Buckets are created where truly absent, never over a live one (see src/local.rs).
        match table.ensure_created(&mut HostShared) {
            Ok(created) if created > 0 => {
                info!("idemgate: local table created ({created} keys, {} buckets)", table.buckets())
            }
            Ok(_) => {}
            Err(e) => {
                error!("idemgate: cannot create the local table in shared data: {e:?}");
                return false;
            }
        }
        let detached = config.policies().any(|p| matches!(p.forwarding, Forwarding::Detached { .. }));
        let waits = config.policies().any(|p| matches!(p.in_flight, crate::config::InFlight::Wait { .. }));
        // Detached forwarding and waiting answer clients from the root context: the host must let
        // it switch the effective context. Probe it now, rather than hang requests later.
        if (detached || waits) && !host::set_effective_context(self.id) {
            error!("idemgate configuration refused: this host cannot switch the effective context, which forwarding \"detached\" and in_flight \"wait\" need");
            return false;
        }
        info!(
            "idemgate: configuration accepted ({} route(s), store: {}, local.max_entries: {}, detached: {detached})",
            config.routes.len(),
            config.store.as_ref().map_or("none", |s| s.cluster.as_str()),
            config.local.max_entries
        );
        let ttl = config.policies().map(|p| p.ttl_seconds).max().unwrap_or(config.default_policy.ttl_seconds);
        info!("{}", table.describe(ttl));
        let node =
            host::property(&["node", "id"]).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
        let started_nanos = host::now_nanos();
        let vm = (u64::from(self.id) << 48) ^ started_nanos;
        // Once per VM (per configuration): every owner token of this VM is made from it.
        let owner_seed =
            OwnerSeed::derive(&TokenSources { entropy: &host::entropy(), node: &node, vm, now_nanos: started_nanos });
        if self.queue_id.is_none() {
            // A queue of this root's own (same thread): HTTP contexts wake it to hand it work.
            let name = format!("idemgate.root.{}.{vm:x}", self.id);
            self.queue_id = host::register_queue(&name);
            if self.queue_id.is_none() {
                error!("idemgate: cannot register the root's work queue");
                return false;
            }
        }
        let seal = match config.store {
            // Records in a shared store are sealed (src/seal.rs): no secret, no store.
            Some(_) => match Seal::from_env() {
                Ok(s) => Some(s),
                Err(e) => {
                    error!("idemgate configuration refused: {e}");
                    return false;
                }
            },
            None => None,
        };
        let secret = std::env::var(STORE_AUTH_ENV).ok().filter(|v| !v.is_empty());
        let backend = config.store.as_ref().map(|s| Backend::of(s.kind, None));
        let (credentials, etcd_secret) = match backend.map(|b| b.credential(secret)) {
            None | Some(Ok(Credential::None)) => (None, None),
            Some(Ok(Credential::Header(h))) => (Some(h), None),
            Some(Ok(Credential::Token(v))) => (None, Some(v)),
            Some(Err(e)) => {
                error!("idemgate configuration refused: {e}");
                return false;
            }
        };
        let lease_ttl_seconds = crate::etcd::lease_ttl_seconds(&config);
        let tombstone_lease_ttl_seconds = crate::etcd::tombstone_lease_ttl_seconds(&config);
        let labels: Vec<&str> = config.routes.iter().map(|r| r.name.as_str()).collect();
        let metrics = Metrics::define(&labels);
        // Fixed by `max_entries`: set once here (the record bytes and occupancy are set by the tick).
        metrics.set(Gauge::LocalIndexBytes, table.max_index_bytes());
        metrics.set(Gauge::LocalCapacity, table.capacity());
        self.shared = Some(Rc::new(Shared {
            config,
            table,
            metrics,
            buffered: Cell::new(0),
            owner_seed,
            tokens: Cell::new(0),
            queues: self.queues.clone(),
            queue_id: self.queue_id,
            credentials: RefCell::new(credentials),
            etcd_secret,
            etcd_auth: RefCell::new(crate::etcd::Auth::default()),
            seal,
            leases: RefCell::new(crate::etcd::Leases::default()),
            lease_ttl_seconds,
            tombstone_leases: RefCell::new(crate::etcd::Leases::default()),
            tombstone_lease_ttl_seconds,
            handoffs: RefCell::new(crate::redirect::Handoffs::default()),
            held: RefCell::new(Vec::new()),
            #[cfg(feature = "crash-injection")]
            lose_next_wake: Cell::new(false),
        }));
        // The first token and lease come from the first tick (100 ms): while Envoy configures the
        // VM its worker threads do not have the store cluster yet (a callout is refused with
        // BadArgument), and the tick keeps them ahead from then on.
        if !host::set_tick_period(TICK) {
            if self.shared.as_ref().is_some_and(|s| stores::backend(s).needs_tick()) {
                // Leases and tokens are granted by the tick, never on a request's path.
                error!("idemgate configuration refused: store.kind \"etcd\" needs a timer (set_tick_period), which this host refused");
                return false;
            }
            warn!("idemgate: no timer: expired records are freed only when their bucket is reused, counters are flushed as they are counted");
            host::flush_counters_at_once();
        }
        true
    }

    fn tick(&mut self) {
        self.meter.flush(host::define_counter, host::increment_metric);
        host::refresh_log_level();
        if let Some(q) = self.queue_id {
            host::drain_queue(q);
        }
        self.authenticate_if_due();
        self.grant_lease_if_due();
        self.collect_stray_work();
        self.check_waiters();
        if self.writes.next_retry_ms().is_some() {
            self.writes.tick(host::now_ms());
            self.run_writes();
        }
        self.finish_stopping_if_drained();
        self.run_writes();
        let Some(s) = self.shared.clone() else { return };
        let now = host::now_ms();
        settle::unfollowed_redirects(&s, now);
        // The sweep frees expired records and reads each bucket's figures: the gauges are their
        // sums, made here, off the request path (each bucket as of its last sweep). One rule for
        // both hosts: `engine::sweep`.
        let Some(swept) = self.sweeper.run(&s.table, &mut HostShared, now) else { return };
        if let Some(e) = &swept.error {
            debug!("idemgate: sweep failed: {e:?}");
        }
        for c in swept.counters() {
            s.metrics.inc(c);
        }
        for (g, v) in swept.gauges {
            s.metrics.set(g, v);
        }
        if let Some(line) = &swept.high_water {
            warn!("{line}");
        }
    }
}

struct Unconfigured;
impl Context for Unconfigured {}
impl HttpContext for Unconfigured {
    fn on_http_request_headers(&mut self, _n: usize, _eos: bool) -> proxy_wasm::types::Action {
        let request_id = host::header(MapType::HttpRequestHeaders, "x-request-id").unwrap_or_default();
        error!(
            "idemgate: outcome=internal_state branch=unconfigured_root broken=policy_missing request_id={request_id}"
        );
        let refusal =
            crate::failsafe::refuse(crate::failsafe::Broken::PolicyMissing, crate::failsafe::Holding::Nothing);
        host::publish(refusal.problem.slug(), None);
        reply::problem(&refusal.problem, &request_id, None);
        proxy_wasm::types::Action::Pause
    }

    fn on_log(&mut self) {
        host::request_settled();
    }
}
