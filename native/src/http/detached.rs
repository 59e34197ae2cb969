//! `forwarding: "detached"` in the native build: the host glue of `engine::forwards`, the machine
//! the Wasm root runs over its detached forwards (`src/filter/mod.rs`, `forward_answered`).
//!
//! The stream hands its request (`Command::Detach`) to its configuration's main thread: it makes
//! a scheduler of its stream (`host::stream_scheduler_new`), registers it (`Detached`), queues the
//! forward and posts an event to the main thread (`scheduler_commit`, thread-safe). On the main
//! thread (`Global::on_scheduled`) `engine::forwards` sends it as a configuration HTTP stream
//! (`host::config_stream`; a hop probe as a callout), which Envoy does not cancel when the
//! client leaves: the upstream call outlives the stream, as the Wasm root's callout does. Its
//! answer (the stream hooks, `on_stream_*`, main thread) is
//! settled there by the core (`engine::machine::settle_away`: the local tier now, the store
//! through the write machine), then told to the client if it is still there: the reply is left in
//! its registration and `DETACHED_EVENT` posted to its stream's scheduler; the stream sends it on
//! its worker (`Filter::detached_told`). A retry meanwhile finds the claim held (409, or it
//! waits): the key is executed once and completed once, by the main thread.
//!
//! Lifetimes: as `wait.rs`: a stream's scheduler is deleted once, by `Detaching`'s drop (the
//! client answered, its stream complete, or its filter destroyed), after it left the registry
//! under the registry's lock, the only place it is committed. A client gone before the answer is
//! no longer registered: its answer is settled and kept, never sent (`detached-client-left` in its
//! filter state). Its key's hold (`idemgate.key_held_ms`) is measured at its settlement on the
//! main thread, from the configuration (`record_histogram_value` of the configuration), whether
//! its client is still there or not, as the Wasm root measures it (`filter::settle`).
//!
//! The forward goes as a configuration HTTP stream, not a callout: the callout's answer hook
//! hands over no trailers, the stream's hooks do, and their names are noted on the client's
//! answer and every replay (`idempotent-replayed-trailers-dropped`), as in the Wasm build. What
//! the callout did itself is kept here: its 32 MiB bound on the answer (`RESPONSE_LIMIT_BYTES`)
//! and the request's `content-length`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicU32;

use idemgate::decision::Outcome;
use idemgate::engine::forwards::{
    self as engine_forwards, Action as ForwardAction, Forward, Forwards, Reply as ForwardReply, Settle,
    HOP_PROBE_TIMEOUT_MS,
};
use idemgate::engine::machine::settle_away;
use idemgate::engine::settle::INTERNAL_STATE;

use super::*;

/// The event a detached stream's scheduler posts when its answer is there
/// (`on_http_filter_scheduled`).
pub const DETACHED_EVENT: u64 = 2;

/// The main-thread event posted when a forward is queued (any event runs `Global::on_scheduled`).
const EVENT_FORWARDS: u64 = 3;

/// The outcome left in a detached stream's filter state when its client left first.
const CLIENT_LEFT: &str = "detached-client-left";

/// What a detached stream's client is told.
pub enum Told {
    Response {
        status: u16,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
        expires: Option<String>,
        slug: &'static str,
    },
    Problem(ProblemKind),
}

/// A registered detached stream: its scheduler, and its answer once the main thread has one.
struct Slot {
    scheduler: usize,
    told: Option<Told>,
}

/// A configuration callout of the main thread's forwards in flight (the hop probes).
enum Call {
    Probe(String),
}

/// Envoy's bound on a configuration callout's response body (its async client's buffer limit:
/// beyond it the callout answers no response, `ExceedResponseBufferLimit`), kept by the glue for
/// a forward's stream, so that a detached answer beyond it is outcome-unknown as before
/// (`agents::detached_mode_a_response_beyond_envoys_async_client_limit_is_outcome_unknown`).
const RESPONSE_LIMIT_BYTES: usize = 32 * 1024 * 1024;

/// A forward sent as a configuration HTTP stream, and its answer as far as it has come: the
/// stream hands over headers, body and trailers in parts (the callout's answer had no trailers).
struct Receiving {
    forward: Box<Forward>,
    status: Option<u16>,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    trailer_names: Vec<String>,
    /// The body went beyond `RESPONSE_LIMIT_BYTES`: no response, as the callout answered.
    over: bool,
}

#[derive(Default)]
struct Main {
    forwards: Forwards,
    calls: HashMap<u64, Call>,
    streams: HashMap<u64, Receiving>,
}

/// The configuration's detached forwards: the streams waiting for their answer, the forwards
/// queued for the main thread and the main thread's machine.
pub struct Detached {
    next: AtomicU32,
    streams: Mutex<HashMap<u32, Slot>>,
    /// When each forward's key was claimed, by stream id, until the main thread settles it
    /// (`key_held_ms`): kept apart from `streams`, which a client leaving empties.
    held: Mutex<HashMap<u32, u64>>,
    queue: Mutex<VecDeque<Forward>>,
    main: Mutex<Main>,
    /// The configuration (its callouts) and its main-thread scheduler, as integers.
    config_envoy: usize,
    scheduler: Arc<AtomicUsize>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A detached stream's registration: out of the registry, then its scheduler deleted, on drop.
pub struct Detaching {
    registry: Arc<Detached>,
    id: u32,
    scheduler: usize,
}

impl Drop for Detaching {
    fn drop(&mut self) {
        lock(&self.registry.streams).remove(&self.id);
        host::stream_scheduler_delete(self.scheduler as abi::SchedulerPtr);
    }
}

impl Detached {
    pub fn new(config_envoy: abi::ConfigEnvoyPtr, scheduler: Arc<AtomicUsize>) -> Detached {
        Detached {
            next: AtomicU32::new(1),
            streams: Mutex::default(),
            held: Mutex::default(),
            queue: Mutex::default(),
            main: Mutex::default(),
            config_envoy: config_envoy as usize,
            scheduler,
        }
    }

    fn from(&self) -> CalloutFrom {
        CalloutFrom::Config(self.config_envoy as abi::ConfigEnvoyPtr)
    }

    /// Main thread: the forwards queued by the streams go to `engine::forwards`.
    pub fn on_scheduled(&self, g: &Global) {
        let queued: Vec<Forward> = lock(&self.queue).drain(..).collect();
        for f in queued {
            let action = lock(&self.main).forwards.queued(f, host::now_ms());
            self.run(g, action.into_iter().collect());
        }
    }

    /// Main thread: carries out `engine::forwards`' actions in order (no lock held while a
    /// callout is sent).
    fn run(&self, g: &Global, actions: Vec<ForwardAction>) {
        for a in actions {
            match a {
                ForwardAction::Probe { cluster, headers } => {
                    let h: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
                    match host::callout(self.from(), &cluster, &h, &[], HOP_PROBE_TIMEOUT_MS) {
                        Ok(id) => {
                            lock(&self.main).calls.insert(id, Call::Probe(cluster));
                        }
                        Err(r) => {
                            let out = lock(&self.main).forwards.probe_not_sent(&cluster, &format!("init result {r}"));
                            self.run(g, out);
                        }
                    }
                }
                ForwardAction::Send(f, timeout_ms) => {
                    let mut h: Vec<(&str, &str)> = f.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
                    // The callout's message carried its length (Envoy's async client sets it for a
                    // whole request); a stream's body would go chunked without it, which not every
                    // upstream reads.
                    let length = f.body.len().to_string();
                    if !h.iter().any(|(n, _)| n.eq_ignore_ascii_case("content-length")) {
                        h.push(("content-length", &length));
                    }
                    let config = self.config_envoy as abi::ConfigEnvoyPtr;
                    match host::config_stream(config, &f.cluster, &h, &f.body, timeout_ms.max(1)) {
                        Ok(id) => {
                            g.metrics.inc(MetricsFrom::Config, Counter::DetachedForwards);
                            let r = Receiving {
                                forward: f,
                                status: None,
                                headers: vec![],
                                body: vec![],
                                trailer_names: vec![],
                                over: false,
                            };
                            lock(&self.main).streams.insert(id, r);
                        }
                        Err(r) => {
                            let refused = engine_forwards::not_sent(*f, &format!("init result {r}"));
                            self.run(g, vec![refused]);
                        }
                    }
                }
                // Nothing was sent: the key is freed and the client told.
                ForwardAction::Refuse { forward, log, detail, problem } => {
                    host::log(LogLevel::Warn, &log);
                    let s =
                        Settle { outcome: Outcome::Release, response: None, too_large: false, detail: detail.into() };
                    self.settle(g, &forward, s);
                    self.tell(forward.context_id, Told::Problem(problem));
                }
                ForwardAction::Log(level, line) => host::log(level, &line),
            }
        }
    }

    /// Main thread: the answer to configuration callout `id`, if it is one of the forwards'
    /// (`false`: not ours).
    pub fn on_answer(&self, g: &Global, id: u64, status: Option<u16>, headers: &[(String, Vec<u8>)]) -> bool {
        let call = lock(&self.main).calls.remove(&id);
        let Some(Call::Probe(cluster)) = call else { return false };
        let out = lock(&self.main).forwards.probe_answered(cluster, status, headers, host::now_ms());
        self.run(g, out);
        true
    }

    /// Main thread: a forward's stream hands over its response headers (`false`: not ours).
    pub fn on_stream_headers(&self, id: u64, headers: Vec<(String, Vec<u8>)>) -> bool {
        let mut main = lock(&self.main);
        let Some(r) = main.streams.get_mut(&id) else { return false };
        r.status = headers
            .iter()
            .find(|(n, _)| n == ":status")
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
            .and_then(|v| v.parse().ok());
        r.headers = headers;
        true
    }

    /// Main thread: a forward's stream hands over part of its response body, kept up to
    /// `RESPONSE_LIMIT_BYTES` (beyond: no response, as the callout answered).
    ///
    /// # Safety
    /// `data`: Envoy's array of `count` buffers, valid during the hook.
    pub unsafe fn on_stream_data(&self, id: u64, data: *const abi::EnvoyBuffer, count: usize) {
        let mut main = lock(&self.main);
        let Some(r) = main.streams.get_mut(&id) else { return };
        if r.over {
            return;
        }
        // SAFETY: the caller's.
        if !unsafe { host::stream_data(data, count, &mut r.body, RESPONSE_LIMIT_BYTES) } {
            r.over = true;
            r.body = vec![];
        }
    }

    /// Main thread: a forward's stream hands over its response trailers: their names, noted
    /// as dropped on the client's answer and every replay (`engine::forwards::answered`).
    pub fn on_stream_trailers(&self, id: u64, trailers: Vec<(String, Vec<u8>)>) {
        if let Some(r) = lock(&self.main).streams.get_mut(&id) {
            r.trailer_names = trailers.into_iter().map(|(n, _)| n).collect();
        }
    }

    /// Main thread: a forward's stream ended, `complete` (its whole answer handed over) or reset
    /// (no response: timed out, the connection failed or was reset).
    pub fn on_stream_end(&self, g: &Global, id: u64, complete: bool) {
        let Some(r) = lock(&self.main).streams.remove(&id) else { return };
        if complete && !r.over {
            let status = r.status;
            self.answered(g, &r.forward, status, r.headers, r.body, &r.trailer_names);
        } else {
            if r.over {
                host::log(
                    LogLevel::Warn,
                    &format!(
                        "idemgate: detached answer beyond the async client's response limit ({RESPONSE_LIMIT_BYTES} bytes): no response {}",
                        r.forward.claim.log
                    ),
                );
            }
            self.answered(g, &r.forward, None, vec![], vec![], &[]);
        }
    }

    /// The upstream's answer to a forward (`engine::forwards::answered`): its claim settled,
    /// then its client told if it is still there.
    fn answered(
        &self,
        g: &Global,
        f: &Forward,
        status: Option<u16>,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
        trailer_names: &[String],
    ) {
        let policy = g.config.policy_at(f.claim.policy_index);
        let live = lock(&self.streams).contains_key(&f.context_id);
        let a = engine_forwards::answered(f, policy, status, headers, body, trailer_names, live, host::now_ms());
        if let Some(line) = &a.log {
            g.metrics.inc(MetricsFrom::Config, Counter::InternalErrors);
            host::log(LogLevel::Error, line);
        }
        let slug = match a.settle {
            Some(s) => self.settle(g, f, s),
            // Not settled (its claim kept, outcome unknown once its lock expires): not measured.
            None => {
                lock(&self.held).remove(&f.context_id);
                INTERNAL_STATE
            }
        };
        if let Some(line) = a.kept {
            host::log(LogLevel::Info, &line);
        }
        let told = match a.reply {
            ForwardReply::Response { status, headers, body, expires } => {
                Told::Response { status, headers, body, expires, slug }
            }
            ForwardReply::Problem(kind) => Told::Problem(kind),
        };
        self.tell(f.context_id, told);
    }

    /// Main thread: settles a forward's claim as `s` says (`engine::machine::settle_away`), its
    /// hold measured from its claim (the Wasm root's `filter::settle`).
    fn settle(&self, g: &Global, f: &Forward, s: Settle) -> &'static str {
        let policy = g.config.policy_at(f.claim.policy_index);
        let mut main = MainThread::new(g, f.claim.policy_index);
        if let Some(since) = lock(&self.held).remove(&f.context_id) {
            g.metrics.record_from_config(Histogram::KeyHeldMs, main.now.saturating_sub(since));
        }
        settle_away(&mut main, &f.claim, policy, g.store.is_some(), s)
    }

    /// Leaves `told` for stream `id` and wakes it, if it is still registered (under the lock,
    /// the only place its scheduler is committed).
    fn tell(&self, id: u32, told: Told) {
        let mut streams = lock(&self.streams);
        if let Some(slot) = streams.get_mut(&id) {
            slot.told = Some(told);
            host::stream_scheduler_commit(slot.scheduler as abi::SchedulerPtr, DETACHED_EVENT);
        }
    }
}

/// The configuration's side of a settlement, away from any stream: the clock read once, the
/// claim's route for counters (counted on the configuration: Envoy's counters are atomic). The
/// main thread's (a detached answer, a redirect never followed) and a worker's (a redirect's
/// hand-over pushed out of a full list, `redirect.rs`).
pub(super) struct MainThread<'a> {
    g: &'a Global,
    policy_index: usize,
    now: u64,
    sd: ProcessShared,
}

impl<'a> MainThread<'a> {
    pub(super) fn new(g: &'a Global, policy_index: usize) -> MainThread<'a> {
        MainThread { g, policy_index, now: host::now_ms(), sd: ProcessShared }
    }
}

impl Effects for MainThread<'_> {
    fn logs(&self, level: LogLevel) -> bool {
        host::logs(level)
    }

    fn now_ms(&mut self) -> u64 {
        self.now
    }

    fn local(&mut self) -> (&Table, &mut dyn SharedData) {
        (&self.g.table, &mut self.sd)
    }

    fn run(&mut self, c: Command<'_>) {
        match c {
            Command::Write { what, skey, transition, fallback, fence } => {
                if let Some(st) = self.g.store.as_ref() {
                    st.push_write(what, &skey, *transition, fallback.map(|f| *f), fence);
                }
            }
            // The local release is counted as the Wasm build counts it: not per route.
            Command::Count(Count::Released) => self.g.metrics.inc(MetricsFrom::Config, Counter::Released),
            Command::Count(c) => {
                self.g.metrics.inc_for(MetricsFrom::Config, rules::counter(c), Some(self.policy_index))
            }
            Command::Log(level, line) => host::log(level, &line),
            // A settlement gives no other command.
            _ => {}
        }
    }
}

impl Glue<'_> {
    /// Hands the request to the main thread to send (`Command::Detach`). A stream whose
    /// scheduler cannot be made could not be answered: nothing is sent, its key is released and
    /// it is told at once (`engine::forwards::not_sent`).
    pub(super) fn detach(&mut self, mut f: Box<Forward>) {
        let scheduler = host::stream_scheduler_new(self.envoy);
        if scheduler.is_null() {
            if let ForwardAction::Refuse { forward, log, detail, problem } =
                engine_forwards::not_sent(*f, "no stream scheduler")
            {
                host::log(LogLevel::Warn, &log);
                let global = self.global;
                let policy = global.config.policy_at(forward.claim.policy_index);
                let s = Settle { outcome: Outcome::Release, response: None, too_large: false, detail: detail.into() };
                settle_away(self, &forward.claim, policy, global.store.is_some(), s);
                self.publish(Some(&forward.claim.skey), problem.slug());
                self.send_problem(None, problem, None);
            }
            return;
        }
        let registry = Arc::clone(&self.global.detached);
        let id = registry.next.fetch_add(1, Ordering::Relaxed);
        if let Some(since) = self.held_since.take() {
            lock(&registry.held).insert(id, since);
        }
        lock(&registry.streams).insert(id, Slot { scheduler: scheduler as usize, told: None });
        f.context_id = id;
        *self.detaching = Some(Detaching { registry: Arc::clone(&registry), id, scheduler: scheduler as usize });
        lock(&registry.queue).push_back(*f);
        host::scheduler_commit(registry.scheduler.load(Ordering::Acquire) as abi::SchedulerPtr, EVENT_FORWARDS);
    }
}

impl Filter {
    /// The stream's `DETACHED_EVENT` (on its worker): its answer is sent, once; its registration
    /// ends (scheduler deleted, out of the registry).
    pub fn detached_told(&mut self, envoy: EnvoyPtr) {
        self.hook(envoy);
        let Phase::Detached { skey } = self.machine.phase() else { return };
        let skey = *skey;
        let Some(d) = self.detaching.as_ref() else { return };
        let told = lock(&d.registry.streams).get_mut(&d.id).and_then(|s| s.told.take());
        let Some(told) = told else { return };
        self.detaching = None;
        let (_, mut io) = self.split();
        match told {
            Told::Response { status, headers, body, expires, slug } => {
                io.publish(Some(&skey), slug);
                let mut h: Vec<(&str, &str)> =
                    headers.iter().filter_map(|(n, v)| std::str::from_utf8(v).ok().map(|v| (n.as_str(), v))).collect();
                if let Some(e) = expires.as_deref() {
                    h.push((EXPIRES_HEADER, e));
                }
                host::send_response(envoy, status, &h, &body, &code_details(slug));
            }
            Told::Problem(kind) => {
                io.publish(Some(&skey), kind.slug());
                io.send_problem(None, kind, None);
            }
        }
    }

    /// The stream ends while detached: a client not yet answered left first (its call goes on;
    /// the main thread settles its claim when the upstream answers).
    pub(super) fn detached_complete(&mut self, skey: &StorageKey) {
        if self.detaching.take().is_some() {
            let (_, mut io) = self.split();
            io.publish(Some(skey), CLIENT_LEFT);
        }
    }
}
