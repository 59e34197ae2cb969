//! `in_flight: "wait"` in the native build: the host glue of `engine::waiters`, the machine the
//! Wasm root runs over its list of waiters (`src/filter/mod.rs`, `check_waiters`).
//!
//! A request the machine holds (`Command::Hold`, phase `Held`) keeps its own one-entry list of
//! waiters and a scheduler of its stream (`host::stream_scheduler_new`), registered with its
//! configuration (`Registry`). While any stream waits, the configuration's timer (`timer.rs`) fires
//! every `WAIT_TICK_MS`; its main-thread event (`Global::on_scheduled`) posts `WAIT_EVENT` to each
//! waiting stream's worker, where `engine::waiters::tick` checks it as the Wasm root's tick does:
//! answered from the local tier as soon as it shows the outcome, from the store (a read sent as
//! the stream's callout, at most every `WAIT_STORE_POLL_MS`, answered by
//! `engine::waiters::store_answered`), or with a 409 at its deadline. A held request is never
//! resumed (`continue_decoding` is called only for a machine in `Calling`): it is answered with
//! a local reply, or abandoned with its stream.
//!
//! Lifetimes: a stream's scheduler is deleted once, by `Waiting`'s drop (the request answered,
//! its stream complete, or its filter destroyed), after it left the registry under the registry's
//! lock, the only place it is committed: no commit reaches a deleted scheduler. A commit already
//! posted reaches Envoy's filter through a weak pointer, and the module's filter only while it is
//! not destroyed (`DynamicModuleHttpFilter::onScheduled`); `Filter::scheduled` does nothing for a
//! stream no longer waiting.

use std::collections::HashMap;

use idemgate::decision::IN_FLIGHT_RETRY_AFTER_SECONDS;
use idemgate::engine::waiters::{self as engine_waiters, Action as WaitAction, Reply as WaitReply, Waiter};
use idemgate::fingerprint::Fingerprint;
use idemgate::wait::Seen;

use super::*;

/// The event a waiting stream's scheduler posts (`on_http_filter_scheduled`).
pub const WAIT_EVENT: u64 = 1;

/// Waiting requests are checked at this pace (the Wasm root's tick).
pub const WAIT_TICK_MS: u64 = 100;

/// The configuration's waiting streams: each one's scheduler, by registration.
#[derive(Default)]
pub struct Registry {
    next: AtomicU64,
    /// Scheduler pointers (as integers, to be shared by workers), committed only under this lock.
    streams: Mutex<HashMap<u64, usize>>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, usize>> {
        self.streams.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(&self, scheduler: abi::SchedulerPtr) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, scheduler as usize);
        id
    }

    /// Main thread: posts `WAIT_EVENT` to every waiting stream. Whether any waits (the timer is
    /// then armed again).
    pub fn wake_all(&self) -> bool {
        let streams = self.lock();
        for s in streams.values() {
            host::stream_scheduler_commit(*s as abi::SchedulerPtr, WAIT_EVENT);
        }
        !streams.is_empty()
    }
}

/// One held request: its waiter (`engine::waiters` works on lists: this one has one entry), the
/// request (answered as a direct replay or problem would be), its store poll in flight, and its
/// registration.
pub struct Waiting {
    waiters: Vec<Waiter>,
    req: Protected,
    poll: Option<u64>,
    registry: Arc<Registry>,
    id: u64,
    scheduler: usize,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        // Out of the registry first (under its lock, the only place it is committed), then freed.
        self.registry.lock().remove(&self.id);
        host::stream_scheduler_delete(self.scheduler as abi::SchedulerPtr);
    }
}

impl Glue<'_> {
    /// Holds the request until its key's first attempt finishes (`Command::Hold`): registered
    /// for the configuration's wait tick. A stream whose scheduler cannot be made cannot be
    /// woken: answered at once as a request in flight.
    pub(super) fn hold(&mut self, req: &Protected, fp: Fingerprint, wait_ms: u64) {
        let now = self.now();
        let scheduler = host::stream_scheduler_new(self.envoy);
        if scheduler.is_null() {
            host::log(LogLevel::Warn, &log_line(Some(req), "in_flight", "waiting=false error=no_stream_scheduler"));
            let kind = ProblemKind::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS };
            self.answer(Some(req), kind, None);
            return;
        }
        let registry = Arc::clone(&self.global.waits);
        let id = registry.add(scheduler);
        *self.waiting = Some(Waiting {
            waiters: vec![req.waiter(0, fp, now, wait_ms)],
            req: req.clone(),
            poll: None,
            registry,
            id,
            scheduler: scheduler as usize,
        });
        self.count(Counter::Waited);
        host::log(LogLevel::Debug, &log_line(Some(req), "waiting", &format!("wait_ms={wait_ms}")));
        if let Err(e) = self.global.timer.arm(now.saturating_add(WAIT_TICK_MS)) {
            host::log(
                LogLevel::Warn,
                &format!("idemgate: cannot start the timer thread ({e}): retried at the next event"),
            );
        }
    }
}

impl Filter {
    /// The stream's scheduled event (`WAIT_EVENT`, on its worker): a waiting request is checked
    /// (`engine::waiters::tick`), as the Wasm root checks its waiters on its tick.
    pub fn scheduled(&mut self, envoy: EnvoyPtr) {
        self.hook(envoy);
        let Some(w) = self.waiting.as_mut() else { return };
        let now = host::now_ms();
        let (table, has_store) = (&self.global.table, self.global.store.is_some());
        let actions = engine_waiters::tick(&mut w.waiters, now, has_store, &|_| true, &mut |k| {
            table.peek(&mut ProcessShared, k, now).ok().map(Seen::from_local)
        });
        self.run_waiters(actions);
    }

    /// The answer to a waiting request's store poll (`callout_done`, for a callout that is not
    /// the machine's): `engine::waiters::store_answered`. Another callout id is ignored.
    pub(super) fn poll_answered(&mut self, id: u64, status: Option<u16>, body: &[u8]) {
        let Some(w) = self.waiting.as_mut().filter(|w| w.poll == Some(id)) else { return };
        w.poll = None;
        let Some(st) = self.global.store.as_ref() else { return };
        if st.token_refused(status, body) {
            self.global.metrics.inc(MetricsFrom::Stream(self.envoy), Counter::StoreTokenRefused);
        }
        let now = host::now_ms();
        let table = &self.global.table;
        let actions = engine_waiters::store_answered(
            &mut w.waiters,
            0,
            status,
            body,
            st.backend(),
            Some(&st.seal),
            now,
            &mut |k| idemgate::wait::local_holds(table.peek(&mut ProcessShared, k, now).ok().map(Seen::from_local)),
        );
        self.run_waiters(actions);
    }

    /// Carries out the waiters machine's actions (the Wasm root's `run_waiters`).
    fn run_waiters(&mut self, actions: Vec<WaitAction>) {
        for action in actions {
            match action {
                WaitAction::Answer(w, reply) => self.wait_answered(&w, reply),
                WaitAction::Poll { skey, .. } => self.poll(&skey),
                WaitAction::Unauthentic { policy_index, skey, why } => {
                    self.global.metrics.inc_for(
                        MetricsFrom::Stream(self.envoy),
                        Counter::RecordUnauthentic,
                        Some(policy_index),
                    );
                    host::log(
                        LogLevel::Warn,
                        &format!("idemgate: outcome=record_unauthentic key={} waiting=true error={why}", skey.hex()),
                    );
                }
            }
        }
    }

    /// Sends the store read a waiting request polls with, as the stream's callout (cancelled by
    /// Envoy if the stream goes first).
    fn poll(&mut self, skey: &StorageKey) {
        let Some(st) = self.global.store.as_ref() else { return };
        let Some(w) = self.waiting.as_mut() else { return };
        self.global.metrics.inc(MetricsFrom::Stream(self.envoy), Counter::StoreCalls);
        match st.send(CalloutFrom::Stream(self.envoy), &st.backend().read_request(skey)) {
            Ok(id) => {
                w.poll = Some(id);
                engine_waiters::poll_sent(&mut w.waiters, 0);
            }
            // Not sent: the next tick polls again (`WAIT_STORE_POLL_MS` later).
            Err(e) => host::log(LogLevel::Debug, &format!("idemgate: waiting poll not sent: {e}")),
        }
    }

    /// Answers the waiting request as the waiters machine says, counted by the core's rule
    /// (`metrics::wait_counters`, the Wasm root's too); its wait is over (scheduler deleted, out
    /// of the registry).
    fn wait_answered(&mut self, w: &Waiter, reply: WaitReply) {
        let Some(waiting) = self.waiting.take() else { return };
        let now = host::now_ms();
        self.global.metrics.record(self.envoy, Histogram::WaitMs, now.saturating_sub(w.since_ms));
        let req = &waiting.req;
        let (_, mut io) = self.split();
        for c in rules::wait_counters(&reply).into_iter().flatten() {
            io.count(c);
        }
        match reply {
            // Released (0: the first attempt never executed), or the wait is over.
            WaitReply::InFlight { retry_after_seconds } => {
                io.send_problem(Some(req), ProblemKind::InFlight { retry_after_seconds }, None);
            }
            WaitReply::Replay(r) => io.send_replay(req, &r),
            WaitReply::Problem(kind) => {
                if matches!(kind, ProblemKind::RecordUnreadable { .. }) {
                    host::log(LogLevel::Warn, &log_line(Some(req), "record_unreadable", "waiting=true"));
                }
                io.send_problem(Some(req), kind, None);
            }
        }
    }
}
