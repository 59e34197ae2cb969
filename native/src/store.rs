//! The store tier in the native build: Redis through webdis, over Envoy's HTTP callouts. Host
//! glue only: every request is built and every answer read by the core (`idemgate::backend`),
//! and the writes made after forwarding (completion, release, outcome-unknown) are scheduled by
//! the core's write machine (`idemgate::engine::writes`), as in the Wasm build.
//!
//! Two kinds of callout, as the Wasm build's HTTP and root contexts:
//!
//! - a call a request waits for (claim-or-read, take-over, read) is the stream's own callout
//!   (`CalloutFrom::Stream`), answered on the stream's worker (`Filter::callout_done`); Envoy
//!   cancels it if the stream goes first (then `stream_complete` abandons the call: the claim,
//!   which may have landed, is released owner-checked by a write);
//! - a write must outlive its stream, so it is handed to the configuration's main thread: the
//!   worker queues its `Job` and posts an event (`scheduler_commit`, thread-safe); on the main
//!   thread (`on_scheduled`) the write machine sends it as a configuration callout, reads its
//!   answer (`on_answer`) and schedules its retries; a retry's time is kept by the
//!   configuration's one timer thread (`timer.rs`), which posts an event when it is due (Envoy's
//!   main dispatcher runs the write then). `idemgate.store_writes_pending` moves as in the Wasm
//!   build: +1 when a write is queued, -1 when the write machine ends it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use idemgate::backend::{Backend, Credential};
use idemgate::config::{Config, StoreConfig, StoreKind};
use idemgate::engine::machine::LogLevel;
use idemgate::engine::writes::{Action, Builder, Job, Note, WriteId, Writes};
use idemgate::etcd::Fence;
use idemgate::metrics::{note_counters, Counter, Gauge};
use idemgate::scope::StorageKey;
use idemgate::seal::Seal;
use idemgate::store::{StoreRequest, Transition};

use crate::abi;
use crate::host::{self, CalloutFrom};
use crate::metrics::{From as MetricsFrom, Metrics};
use crate::timer::Timer;

/// The environment variable with the store's `user:password` (Redis ACL through webdis), as the
/// Wasm build's (`IDEMGATE_STORE_AUTH`): read from Envoy's process environment here.
pub const STORE_AUTH_ENV: &str = "IDEMGATE_STORE_AUTH";

/// The scheduler event the workers post when they queue a write (the configuration's timer posts
/// `crate::TICK_EVENT`, which runs the writes too).
const EVENT_WRITES: u64 = 1;

/// The main thread's side of the writes.
#[derive(Default)]
struct Main {
    writes: Writes,
    /// Configuration callouts in flight: which write each carries.
    calls: HashMap<u64, WriteId>,
}

/// The configured store, shared by every worker of one filter configuration.
pub struct StoreSide {
    pub cfg: StoreConfig,
    pub seal: Seal,
    credentials: Option<String>,
    /// Envoy's configuration and its main-thread scheduler (set once, on the main thread, by
    /// `attach`), as addresses: plain values every thread may hold.
    config_envoy: AtomicUsize,
    scheduler: Arc<AtomicUsize>,
    /// The configuration's timer (`crate::http::Global`): posts an event when the next retry is
    /// due (its one thread, ended with the configuration).
    timer: Arc<Timer>,
    /// Writes queued or in flight (what `idemgate.store_writes_pending` counts for this
    /// configuration), to take back from the gauge when the configuration goes with them.
    pending: AtomicI64,
    /// Writes queued by workers for the main thread.
    queue: Mutex<VecDeque<Job>>,
    /// The main thread's only.
    main: Mutex<Main>,
    /// The configuration's metrics (set by `attach`): the writes' counters.
    metrics: OnceLock<Arc<Metrics>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock cannot happen (the module aborts on panic); its data is still whole.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl StoreSide {
    /// The store of `config` (`None`: the local tier only), with the record seal and credentials
    /// from Envoy's process environment: the message of the refusal otherwise.
    pub fn configure(
        config: &Config,
        timer: Arc<Timer>,
        scheduler: Arc<AtomicUsize>,
    ) -> Result<Option<StoreSide>, String> {
        let Some(cfg) = config.store.clone() else { return Ok(None) };
        // Records in a shared store are sealed (src/seal.rs): no secret, no store.
        let seal = Seal::from_env()
            .map_err(|e| format!("idemgate configuration refused: {e} (native build: Envoy's process environment)"))?;
        let secret = std::env::var(STORE_AUTH_ENV).ok().filter(|v| !v.is_empty());
        let credentials = match Backend::of(cfg.kind, None).credential(secret) {
            Ok(Credential::None) => None,
            Ok(Credential::Header(h)) => Some(h),
            // etcd is refused before (`http::refusal`).
            Ok(Credential::Token(_)) => {
                return Err("idemgate configuration refused: an etcd token in the native build".into())
            }
            Err(e) => return Err(format!("idemgate configuration refused: {e}")),
        };
        Ok(Some(StoreSide {
            cfg,
            seal,
            credentials,
            config_envoy: AtomicUsize::new(0),
            scheduler,
            timer,
            pending: AtomicI64::new(0),
            queue: Mutex::new(VecDeque::new()),
            main: Mutex::new(Main::default()),
            metrics: OnceLock::new(),
        }))
    }

    /// Envoy's configuration object (main thread, at `config_new`; its scheduler is made by
    /// `Global::configure`, never deleted: a post through it after the configuration is gone does
    /// nothing; the timer's thread ends with the configuration, before it could post).
    pub fn attach(&self, config_envoy: abi::ConfigEnvoyPtr, metrics: Arc<Metrics>) {
        let _ = self.metrics.set(metrics);
        self.config_envoy.store(config_envoy as usize, Ordering::Release);
    }

    /// Moves `idemgate.store_writes_pending` by `delta` (a write queued: +1; ended: -1), as the
    /// Wasm build does (`filter::Shared::push_job`, `Root::write_ended`).
    fn pending_moved(&self, delta: i64) {
        self.pending.fetch_add(delta, Ordering::AcqRel);
        if let Some(m) = self.metrics.get() {
            m.add_gauge(Gauge::StoreWritesPending, delta);
        }
    }

    /// Envoy destroys the configuration (main thread, in its destroy hook, while its stats still
    /// live): the writes still pending are lost (docs/native.md), and taken back from the gauge as
    /// the Wasm root does when it stops with writes pending.
    pub fn stop(&self) {
        let left = self.pending.swap(0, Ordering::AcqRel);
        if left > 0 {
            host::log(
                LogLevel::Warn,
                &format!("idemgate: configuration destroyed with {left} store write(s) still pending: other proxies judge those keys outcome-unknown once their locks expire"),
            );
            if let Some(m) = self.metrics.get() {
                m.add_gauge(Gauge::StoreWritesPending, -left);
            }
        }
    }

    fn scheduler(&self) -> abi::SchedulerPtr {
        self.scheduler.load(Ordering::Acquire) as abi::SchedulerPtr
    }

    /// The store (Redis: no lease).
    pub fn backend(&self) -> Backend {
        Backend::of(StoreKind::Redis, None)
    }

    /// Sends `req` to the store cluster: the callout's id, or why Envoy refused it (nothing sent).
    pub fn send(&self, from: CalloutFrom, req: &StoreRequest) -> Result<u64, String> {
        let mut headers: Vec<(&str, &str)> =
            vec![(":method", req.method), (":path", req.path.as_str()), (":authority", self.cfg.authority.as_str())];
        if let Some(c) = self.credentials.as_deref() {
            headers.push(("authorization", c));
        }
        host::callout(from, &self.cfg.cluster, &headers, &req.body, self.cfg.timeout_ms.max(1))
            .map_err(|r| format!("callout to cluster {:?} refused by Envoy (init result {r})", self.cfg.cluster))
    }

    /// Hands the write `t` of `skey` (with its fallback) to the main thread (from any thread).
    pub fn push_write(
        &self,
        what: &'static str,
        skey: &StorageKey,
        t: Transition,
        fallback: Option<Transition>,
        fence: Option<&Fence>,
    ) {
        // Only etcd's requests carry a time; Redis judges by its own clock.
        let now = 0;
        let built = Job::build_owned(what, skey, t, fence, self.backend(), &self.seal, now).and_then(|mut job| {
            let fallback = fallback
                .map(|f| Job::build_owned("unknown_fallback", skey, f, None, self.backend(), &self.seal, now))
                .transpose()?;
            job.fallback = fallback.map(Box::new);
            Ok(job)
        });
        match built {
            Ok(job) => {
                self.pending_moved(1);
                lock(&self.queue).push_back(job);
                host::scheduler_commit(self.scheduler(), EVENT_WRITES);
            }
            // As a write whose every attempt failed: a claim left in the store is judged
            // outcome-unknown once its lock expires.
            Err(e) => {
                host::log(LogLevel::Warn, &format!("idemgate: store write {what} for key={} not sent: {e}", skey.hex()))
            }
        }
    }

    /// Main thread: the queued writes go to the write machine, retries due are sent.
    pub fn on_scheduled(&self) {
        let jobs: Vec<Job> = lock(&self.queue).drain(..).collect();
        {
            let mut m = lock(&self.main);
            let now = host::now_ms();
            for job in jobs {
                m.writes.push(job);
            }
            m.writes.tick(now);
        }
        self.run();
    }

    /// Main thread: the answer to configuration callout `id` (`status` `None`: none).
    pub fn on_answer(&self, id: u64, status: Option<u16>, body: &[u8]) {
        {
            let mut m = lock(&self.main);
            let Some(write) = m.calls.remove(&id) else { return };
            let backend = self.backend();
            let writer = || (host::now_ms(), backend);
            let b = Builder { store: self.backend(), seal: Some(&self.seal), writer: &writer };
            m.writes.answered(write, status, body, &b);
        }
        self.run();
    }

    /// Carries out the write machine's actions until it has none; no lock is held while a
    /// callout is sent (Envoy may answer it before `callout` returns).
    fn run(&self) {
        loop {
            let action = lock(&self.main).writes.poll();
            let Some(action) = action else { break };
            match action {
                Action::Send(id) => {
                    let request = lock(&self.main).writes.request(id).cloned();
                    let Some(request) = request else { continue };
                    let from = CalloutFrom::Config(self.config_envoy.load(Ordering::Acquire) as abi::ConfigEnvoyPtr);
                    self.count(Counter::StoreCalls);
                    let sent = self.send(from, &request);
                    let mut m = lock(&self.main);
                    match sent {
                        Ok(callout) => {
                            m.calls.insert(callout, id);
                        }
                        Err(e) => m.writes.not_sent(id, &e, &host::now_ms),
                    }
                }
                Action::Note { what, key_hash, note, .. } => {
                    for c in note_counters(&note) {
                        self.count(*c);
                    }
                    note_line(what, &key_hash, note)
                }
                Action::Ended => self.pending_moved(-1),
                // Only a stopping machine says so, and this build never stops one (`stop`).
                Action::Stop { .. } => {}
            }
        }
        self.arm_timer();
    }

    /// Counts `c` (in total) from the main thread.
    fn count(&self, c: Counter) {
        if let Some(m) = self.metrics.get() {
            m.inc(MetricsFrom::Config, c);
        }
    }

    /// The timer posts an event when the next retry is due (its one thread; an earlier deadline
    /// armed before it fires replaces the later one, which `tick` then finds due too).
    fn arm_timer(&self) {
        let due = lock(&self.main).writes.next_retry_ms();
        let Some(due) = due else { return };
        if let Err(e) = self.timer.arm(due) {
            host::log(
                LogLevel::Warn,
                &format!("idemgate: cannot start the store write retry timer ({e}): retried at the next write"),
            );
        }
    }
}

/// Logs what happened to a write (counted by `run`, through the core's `note_counters`).
fn note_line(what: &str, key_hash: &str, note: Note) {
    let (level, line) = match note {
        Note::Landed => (LogLevel::Debug, format!("idemgate: store write {what} for key={key_hash} landed")),
        Note::NoLongerOurs => {
            (LogLevel::Info, format!("idemgate: store write {what} for key={key_hash} found the claim no longer ours"))
        }
        Note::ClaimGoneRewritten => (
            LogLevel::Warn,
            format!("idemgate: store write {what} for key={key_hash} found the claim gone from the store (flushed, evicted or failed over) and wrote the record where it was"),
        ),
        Note::NothingWhereAbsent => {
            (LogLevel::Info, format!("idemgate: store write {what} for key={key_hash} found the key absent"))
        }
        Note::ScriptLoad => (
            LogLevel::Info,
            format!("idemgate: store write {what} for key={key_hash} met a store without its script (NOSCRIPT); sent again with the script"),
        ),
        Note::TooLarge => (LogLevel::Warn, format!("idemgate: store write {what} for key={key_hash} refused as too large")),
        Note::TooLargeWithoutBody => (
            LogLevel::Warn,
            format!("idemgate: store write {what} for key={key_hash} refused by the store as too large; writing the record without its response body"),
        ),
        Note::Retry { why, delay_ms } => (
            LogLevel::Warn,
            format!("idemgate: store write {what} for key={key_hash} failed ({why}); retrying in {delay_ms} ms"),
        ),
        Note::Failed { why, attempts, fallback: true } => (
            LogLevel::Warn,
            format!("idemgate: store write {what} for key={key_hash} failed {attempts} times ({why}); marking the outcome unknown"),
        ),
        Note::Failed { why, attempts, fallback: false } => (
            LogLevel::Warn,
            format!("idemgate: store write {what} for key={key_hash} failed {attempts} times ({why}); a claim left in the store is judged outcome-unknown once its lock expires"),
        ),
    };
    host::log(level, &line);
}
