//! The store tier in the native build: Redis through webdis or etcd v3 (`store.kind`), over
//! Envoy's HTTP callouts. Host glue only: every request is built and every answer read by the
//! core (`idemgate::backend`), the writes made after forwarding (completion, release,
//! outcome-unknown) are scheduled by the core's write machine (`idemgate::engine::writes`), and
//! etcd's leases and token are asked for when the core's keeper (`idemgate::engine::keeper`)
//! says so, as in the Wasm build.
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
//! - etcd only: the main thread is the Wasm root's counterpart for the keeper too. The timer
//!   posts an event every `KEEPER_TICK_MS` (the Wasm root's tick); on it the keeper's
//!   authentication and lease grants are sent as configuration callouts, their answers read on
//!   the main thread (`on_answer`). Workers read the lease usable now (`writer`) and the token
//!   (`send`) under short locks; a request finding no usable lease is refused by the core
//!   (`Unbuilt::NoLease`: 503 store-unavailable, nothing put without a lease).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use idemgate::backend::{Backend, Credential};
use idemgate::config::{Config, StoreConfig};
use idemgate::engine::keeper::{self, Action as KeeperAction, Keeper, LeaseKind, Note as KeeperNote};
use idemgate::engine::machine::LogLevel;
use idemgate::engine::writes::{Action, Builder, Job, Note, WriteId, Writes};
use idemgate::etcd::{self, Auth, Fence, Leases};
use idemgate::metrics::{note_counters, Counter, Gauge};
use idemgate::scope::StorageKey;
use idemgate::seal::Seal;
use idemgate::store::{StoreRequest, Transition};

use crate::abi;
use crate::host::{self, CalloutFrom};
use crate::metrics::{From as MetricsFrom, Metrics};
use crate::timer::Timer;

/// The environment variable with the store's `user:password` (webdis's basic auth, or etcd's
/// user traded for a token), as the Wasm build's (`IDEMGATE_STORE_AUTH`): read from Envoy's
/// process environment here.
pub const STORE_AUTH_ENV: &str = "IDEMGATE_STORE_AUTH";

/// The scheduler event the workers post when they queue a write (the configuration's timer posts
/// `crate::TICK_EVENT`, which runs the writes too).
const EVENT_WRITES: u64 = 1;

/// How often the main thread asks etcd's keeper whether a lease or a token is due: the Wasm
/// root's tick period.
const KEEPER_TICK_MS: u64 = 100;

/// Writes of a configuration Envoy destroyed while they were pending, each with when it is due,
/// waiting for a live configuration of the same store to carry them on (`StoreSide::stop`,
/// `on_scheduled`). The Wasm build holds its stopping root until its writes are over; a native
/// configuration cannot outlive its destroy hook, so its writes move to another configuration:
/// the one that replaced it at a reload, or the next one made.
static PARKED: Mutex<Vec<(StoreConfig, u64, Job)>> = Mutex::new(Vec::new());

/// The live configurations with a store: an id of each, its store and its scheduler's address
/// (registered by `attach`, taken out by `stop` or when it drops). Read and written on Envoy's
/// main thread (configurations are made and destroyed there), behind a lock all the same.
static LIVE: Mutex<Vec<(u64, StoreConfig, usize)>> = Mutex::new(Vec::new());

/// The next id of a live configuration in `LIVE`.
static NEXT_LIVE_ID: AtomicU64 = AtomicU64::new(1);

/// What a configuration callout in flight carries.
enum Call {
    Write(WriteId),
    /// An etcd lease grant of `kind`, sent at `sent_at_ms` (this proxy's clock).
    Lease {
        sent_at_ms: u64,
        kind: LeaseKind,
    },
    /// An etcd authentication.
    Auth,
}

/// The main thread's side of the writes.
#[derive(Default)]
struct Main {
    writes: Writes,
    /// Configuration callouts in flight: what each carries.
    calls: HashMap<u64, Call>,
}

/// etcd's leases and token: granted and renewed on the main thread, read by every worker.
#[derive(Default)]
struct Kept {
    leases: Leases,
    tombstone_leases: Leases,
    auth: Auth,
}

/// The configured store, shared by every worker of one filter configuration.
pub struct StoreSide {
    pub cfg: StoreConfig,
    pub seal: Seal,
    /// The `authorization` every request carries: webdis's basic auth, or etcd's current token.
    credentials: Mutex<Option<String>>,
    /// etcd with auth: the `user:password` traded for a token.
    etcd_secret: Option<String>,
    /// etcd: the TTL its leases are granted with, and its tombstones' (`None`: under the records').
    lease_ttl_seconds: u64,
    tombstone_lease_ttl_seconds: Option<u64>,
    kept: Mutex<Kept>,
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
    /// This configuration's id in `LIVE` (0 until `attach`).
    live_id: AtomicU64,
}

impl Drop for StoreSide {
    fn drop(&mut self) {
        self.unregister();
    }
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
        let (credentials, etcd_secret) = match Backend::of(cfg.kind, None).credential(secret) {
            Ok(Credential::None) => (None, None),
            Ok(Credential::Header(h)) => (Some(h), None),
            Ok(Credential::Token(v)) => (None, Some(v)),
            Err(e) => return Err(format!("idemgate configuration refused: {e}")),
        };
        Ok(Some(StoreSide {
            cfg,
            seal,
            credentials: Mutex::new(credentials),
            etcd_secret,
            lease_ttl_seconds: etcd::lease_ttl_seconds(config),
            tombstone_lease_ttl_seconds: etcd::tombstone_lease_ttl_seconds(config),
            kept: Mutex::new(Kept::default()),
            config_envoy: AtomicUsize::new(0),
            scheduler,
            timer,
            pending: AtomicI64::new(0),
            queue: Mutex::new(VecDeque::new()),
            main: Mutex::new(Main::default()),
            metrics: OnceLock::new(),
            live_id: AtomicU64::new(0),
        }))
    }

    /// Envoy's configuration object (main thread, at `config_new`; its scheduler is made by
    /// `Global::configure`, never deleted: a post through it after the configuration is gone does
    /// nothing; the timer's thread ends with the configuration, before it could post).
    pub fn attach(&self, config_envoy: abi::ConfigEnvoyPtr, metrics: Arc<Metrics>) {
        let _ = self.metrics.set(metrics);
        self.config_envoy.store(config_envoy as usize, Ordering::Release);
        let id = NEXT_LIVE_ID.fetch_add(1, Ordering::Relaxed);
        self.live_id.store(id, Ordering::Release);
        lock(&LIVE).push((id, self.cfg.clone(), self.scheduler.load(Ordering::Acquire)));
        // Writes a destroyed configuration of this store left: carried on from the first event.
        if lock(&PARKED).iter().any(|(store, _, _)| *store == self.cfg) {
            host::scheduler_commit(self.scheduler(), EVENT_WRITES);
        }
    }

    /// Takes this configuration out of `LIVE` (no write is handed to it from now on).
    fn unregister(&self) {
        let id = self.live_id.swap(0, Ordering::AcqRel);
        if id != 0 {
            lock(&LIVE).retain(|(live, _, _)| *live != id);
        }
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
    /// live): the writes still pending (queued, in flight, waiting for their retry) are parked
    /// for a live configuration of the same store (`PARKED`: the one that replaced this one at a
    /// reload, told at once; otherwise the next one made), and taken back from this
    /// configuration's gauge (the one that adopts them counts them again).
    pub fn stop(&self) {
        self.unregister();
        let now = host::now_ms();
        let mut jobs: Vec<(u64, Job)> = lock(&self.queue).drain(..).map(|job| (now, job)).collect();
        {
            let mut m = lock(&self.main);
            jobs.extend(m.writes.hand_over(now));
            // Their answers can no longer come here.
            m.calls.clear();
        }
        let left = self.pending.swap(0, Ordering::AcqRel);
        if let Some(m) = self.metrics.get() {
            m.add_gauge(Gauge::StoreWritesPending, -left);
        }
        if jobs.is_empty() {
            return;
        }
        let handed = jobs.len();
        lock(&PARKED).extend(jobs.into_iter().map(|(at, job)| (self.cfg.clone(), at, job)));
        let heir = lock(&LIVE).iter().find(|(_, store, _)| *store == self.cfg).map(|(_, _, scheduler)| *scheduler);
        match heir {
            Some(scheduler) => {
                host::log(
                    LogLevel::Info,
                    &format!("idemgate: configuration destroyed with {handed} store write(s) pending: handed to a live configuration of the same store"),
                );
                host::scheduler_commit(scheduler as abi::SchedulerPtr, EVENT_WRITES);
            }
            None => host::log(
                LogLevel::Warn,
                &format!("idemgate: configuration destroyed with {handed} store write(s) pending and no live configuration of the same store: kept for the next one; until it comes, other proxies judge those keys outcome-unknown once their locks expire"),
            ),
        }
    }

    /// Main thread: the writes a destroyed configuration of this store left (`stop`), carried on
    /// here with their due times and attempts.
    fn adopt_parked(&self, m: &mut Main) {
        let mine: Vec<(u64, Job)> = {
            let mut parked = lock(&PARKED);
            let (mine, others): (Vec<_>, Vec<_>) = parked.drain(..).partition(|(store, _, _)| *store == self.cfg);
            *parked = others;
            mine.into_iter().map(|(_, at, job)| (at, job)).collect()
        };
        if mine.is_empty() {
            return;
        }
        host::log(
            LogLevel::Info,
            &format!(
                "idemgate: carrying on {} store write(s) a destroyed configuration of the same store left",
                mine.len()
            ),
        );
        for (at, job) in mine {
            self.pending_moved(1);
            m.writes.adopt(at, job);
        }
    }

    fn scheduler(&self) -> abi::SchedulerPtr {
        self.scheduler.load(Ordering::Acquire) as abi::SchedulerPtr
    }

    /// The configured store, for reads and answers (no lease).
    pub fn backend(&self) -> Backend {
        Backend::of(self.cfg.kind, None)
    }

    /// The configured store with the leases usable at `now_ms` (etcd), for claims and writes.
    pub fn writer(&self, now_ms: u64) -> Backend {
        Backend::writing(self.cfg.kind, || {
            let k = lock(&self.kept);
            keeper::usable(&k.leases, self.tombstone_lease_ttl_seconds.map(|_| &k.tombstone_leases), now_ms)
        })
    }

    /// Every store answer passes here (any thread): whether it refused etcd's token (the caller
    /// counts `store_token_refused`); the next keeper tick authenticates again.
    pub fn token_refused(&self, status: Option<u16>, body: &[u8]) -> bool {
        let refused = keeper::token_refused(&mut lock(&self.kept).auth, self.etcd_secret.as_deref(), status, body);
        if refused == Some(true) {
            host::log(
                LogLevel::Warn,
                "idemgate: etcd refused the token (expired, its member forgot it, or etcd's auth changed since): authenticating again",
            );
        }
        refused.is_some()
    }

    /// Sends `req` to the store cluster with the current credentials: the callout's id, or why
    /// Envoy refused it (nothing sent).
    pub fn send(&self, from: CalloutFrom, req: &StoreRequest) -> Result<u64, String> {
        let credentials = lock(&self.credentials).clone();
        self.send_with(from, req, credentials.as_deref())
    }

    fn send_with(&self, from: CalloutFrom, req: &StoreRequest, credentials: Option<&str>) -> Result<u64, String> {
        let mut headers: Vec<(&str, &str)> =
            vec![(":method", req.method), (":path", req.path.as_str()), (":authority", self.cfg.authority.as_str())];
        if let Some(c) = credentials {
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
        // Only etcd's requests carry a time (a lease, the clock rule); Redis judges by its own.
        let now = if self.backend().uses_proxy_clock() { host::now_ms() } else { 0 };
        let writer = self.writer(now);
        let built = Job::build_owned(what, skey, t, fence, writer, &self.seal, now).and_then(|mut job| {
            let fallback = fallback
                .map(|f| Job::build_owned("unknown_fallback", skey, f, None, writer, &self.seal, now))
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
                self.count(Counter::StoreWriteFailures);
                host::log(LogLevel::Warn, &format!("idemgate: store write {what} for key={} not sent: {e}", skey.hex()))
            }
        }
    }

    /// Main thread: etcd's token and leases when due, then the queued writes go to the write
    /// machine and retries due are sent.
    pub fn on_scheduled(&self) {
        self.keep();
        let jobs: Vec<Job> = lock(&self.queue).drain(..).collect();
        {
            let mut m = lock(&self.main);
            self.adopt_parked(&mut m);
            let now = host::now_ms();
            for job in jobs {
                m.writes.push(job);
            }
            m.writes.tick(now);
        }
        self.run();
    }

    /// Main thread: the answer to configuration callout `id` (`status` `None`: none). Sends
    /// nothing itself: what the answer calls for (a retry due at once, the where-absent
    /// transaction, the lease grant after a token) is sent at the event it posts. While Envoy
    /// shuts down it resets the callouts in flight and answers them here, and a callout started
    /// from that answer crashed Envoy (`envoy_dynamic_module_callback_http_filter_config_http_callout`,
    /// SIGSEGV, seen in `etcd_store::etcd_envoy_health_checks_*` under `IDEMGATE_BUILD=native`);
    /// the event posted then never runs (the main loop has exited): the write is lost, as any
    /// write pending when Envoy destroys the configuration.
    pub fn on_answer(&self, id: u64, status: Option<u16>, body: &[u8]) {
        let call = lock(&self.main).calls.remove(&id);
        match call {
            Some(Call::Write(write)) => {
                if self.token_refused(status, body) {
                    self.count(Counter::StoreTokenRefused);
                }
                let mut m = lock(&self.main);
                let writer = || {
                    let now = host::now_ms();
                    (now, self.writer(now))
                };
                let b = Builder { store: self.backend(), seal: Some(&self.seal), writer: &writer };
                m.writes.answered(write, status, body, &b);
            }
            Some(Call::Lease { sent_at_ms, kind }) => {
                if self.token_refused(status, body) {
                    self.count(Counter::StoreTokenRefused);
                }
                let now = host::now_ms();
                let note = self.keeper(|k| k.lease_answered(kind, sent_at_ms, status, body, now));
                self.keeper_action(KeeperAction::Note(note), now);
            }
            Some(Call::Auth) => {
                let now = host::now_ms();
                for a in self.keeper(|k| k.auth_answered(status, body, now)) {
                    match a {
                        // Not marked sent: the keeper asks for it again at the event posted below.
                        KeeperAction::GrantLease(..) | KeeperAction::Authenticate(_) => {}
                        a => self.keeper_action(a, now),
                    }
                }
            }
            None => return,
        }
        host::scheduler_commit(self.scheduler(), EVENT_WRITES);
    }

    /// etcd's keeper (`engine::keeper`) over this store's leases and token.
    fn keeper<T>(&self, f: impl FnOnce(&mut Keeper) -> T) -> T {
        let mut k = lock(&self.kept);
        let Kept { leases, tombstone_leases, auth } = &mut *k;
        f(&mut Keeper {
            leases,
            tombstone_leases: self.tombstone_lease_ttl_seconds.map(|ttl| (tombstone_leases, ttl)),
            auth,
            secret: self.etcd_secret.as_deref(),
            lease_ttl_seconds: self.lease_ttl_seconds,
        })
    }

    /// Main thread, etcd only: authenticates and grants leases when the keeper says so (at
    /// start, ahead of need, at once after etcd refused the token), as the Wasm root's tick.
    fn keep(&self) {
        if !self.backend().needs_tick() {
            return;
        }
        let now = host::now_ms();
        let refresh_ms = self.cfg.token_refresh_seconds.saturating_mul(1000);
        if let Some(a) = self.keeper(|k| k.authenticate_if_due(refresh_ms, now)) {
            self.keeper_action(a, now);
        }
        if let Some(a) = self.keeper(|k| k.grant_if_due(now)) {
            self.keeper_action(a, now);
        }
    }

    /// Main thread: carries out one action of etcd's keeper (no lock held while sending).
    fn keeper_action(&self, a: KeeperAction, now: u64) {
        let from = || CalloutFrom::Config(self.config_envoy.load(Ordering::Acquire) as abi::ConfigEnvoyPtr);
        match a {
            KeeperAction::Authenticate(req) => {
                self.count(Counter::StoreCalls);
                // The authentication itself carries no token.
                match self.send_with(from(), &req, None) {
                    Ok(id) => {
                        self.keeper(|k| k.auth_sent(now));
                        lock(&self.main).calls.insert(id, Call::Auth);
                    }
                    Err(e) => {
                        self.count(Counter::StoreErrors);
                        self.keeper(|k| k.auth_not_sent(now));
                        host::log(LogLevel::Warn, &format!("idemgate: etcd authentication not sent: {e}"));
                    }
                }
            }
            KeeperAction::GrantLease(req, kind) => {
                self.count(Counter::StoreCalls);
                match self.send(from(), &req) {
                    Ok(id) => {
                        self.keeper(|k| k.lease_sent(kind, now));
                        lock(&self.main).calls.insert(id, Call::Lease { sent_at_ms: now, kind });
                    }
                    Err(e) => {
                        self.count(Counter::StoreErrors);
                        self.keeper(|k| k.lease_not_sent(kind, now));
                        host::log(LogLevel::Warn, &format!("idemgate: etcd lease grant not sent: {e}"));
                    }
                }
            }
            KeeperAction::UseToken(token) => *lock(&self.credentials) = Some(token),
            KeeperAction::Note(KeeperNote::AuthUnbuilt(e)) => {
                host::log(LogLevel::Error, &format!("idemgate: etcd authentication not sent: {e}"))
            }
            KeeperAction::Note(KeeperNote::Authenticated) => {
                self.count(Counter::StoreAuthentications);
                host::log(LogLevel::Info, "idemgate: etcd authenticated (native configuration)");
            }
            KeeperAction::Note(KeeperNote::AuthFailed { why, said }) => {
                self.count(Counter::StoreErrors);
                host::log(
                    LogLevel::Warn,
                    &format!("idemgate: etcd authentication failed: {why} {said:?} (the user:password in IDEMGATE_STORE_AUTH)"),
                );
            }
            KeeperAction::Note(KeeperNote::LeaseGranted) => host::log(
                LogLevel::Info,
                &format!("idemgate: etcd lease granted (native configuration, ttl {} s)", self.lease_ttl_seconds),
            ),
            KeeperAction::Note(KeeperNote::LeaseFailed(e)) => {
                self.count(Counter::StoreErrors);
                host::log(LogLevel::Warn, &format!("idemgate: etcd lease grant failed: {e}"));
            }
        }
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
                            m.calls.insert(callout, Call::Write(id));
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

    /// The timer posts an event when the next retry is due, and with etcd at the keeper's next
    /// tick (its one thread; an earlier deadline armed before it fires replaces the later one,
    /// which `tick` then finds due too).
    fn arm_timer(&self) {
        let retry = lock(&self.main).writes.next_retry_ms();
        let keeper = self.backend().needs_tick().then(|| host::now_ms().saturating_add(KEEPER_TICK_MS));
        let due = match (retry, keeper) {
            (Some(r), Some(k)) => Some(r.min(k)),
            (r, k) => r.or(k),
        };
        if let Some(due) = due {
            self.arm(due);
        }
    }

    fn arm(&self, due: u64) {
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
    let level = match note {
        Note::Landed => LogLevel::Debug,
        Note::NoLongerOurs | Note::NothingWhereAbsent | Note::ScriptLoad => LogLevel::Info,
        Note::ClaimGoneRewritten
        | Note::TooLarge
        | Note::TooLargeWithoutBody
        | Note::Retry { .. }
        | Note::Failed { .. } => LogLevel::Warn,
    };
    // Formatted only when Envoy logs it: a landed write's Debug line was written out for every
    // write and dropped (profiled 2026-12-07, docs/native.md).
    if !host::logs(level) {
        return;
    }
    let line = match note {
        Note::Landed => format!("idemgate: store write {what} for key={key_hash} landed"),
        Note::NoLongerOurs => {
            format!("idemgate: store write {what} for key={key_hash} found the claim no longer ours")
        }
        Note::ClaimGoneRewritten => format!("idemgate: store write {what} for key={key_hash} found the claim gone from the store (flushed, evicted or failed over) and wrote the record where it was"),
        Note::NothingWhereAbsent => {
            format!("idemgate: store write {what} for key={key_hash} found the key absent")
        }
        Note::ScriptLoad => format!("idemgate: store write {what} for key={key_hash} met a store without its script (NOSCRIPT); sent again with the script"),
        Note::TooLarge => format!("idemgate: store write {what} for key={key_hash} refused as too large"),
        Note::TooLargeWithoutBody => format!("idemgate: store write {what} for key={key_hash} refused by the store as too large; writing the record without its response body"),
        Note::Retry { why, delay_ms } => format!("idemgate: store write {what} for key={key_hash} failed ({why}); retrying in {delay_ms} ms"),
        Note::Failed { why, attempts, fallback: true } => format!("idemgate: store write {what} for key={key_hash} failed {attempts} times ({why}); marking the outcome unknown"),
        Note::Failed { why, attempts, fallback: false } => format!("idemgate: store write {what} for key={key_hash} failed {attempts} times ({why}); a claim left in the store is judged outcome-unknown once its lock expires"),
    };
    host::log(level, &line);
}
