//! An in-memory world for whole requests, without Envoy (issue 26; tests only): two proxies, each
//! with its own shared data (`MemoryShared`), local table and root, one store (a model of the
//! store's record table whose every change is `lifecycle::next`'s), an upstream that counts its
//! executions per key, store callouts that are answered, lost (before or after they land) or
//! delayed, clients that leave, and one clock the test moves.
//!
//! Each request is the filter's own request machine (`engine::machine`, which
//! `src/filter/http.rs` drives with Envoy's callbacks): the world feeds it the same inputs
//! (headers admitted, the body's end, the store's answers, the upstream's response, the
//! exchange's end, the client leaving) and carries its commands out on its model (callouts to the
//! store, root writes, holds, detached forwards, the client's answer). Each proxy's root runs the
//! root's own machines as `src/filter/mod.rs`'s `Root` does: `engine::writes` (every write after
//! forwarding, its retries on their schedule and its fallback), `engine::waiters`
//! (`in_flight: "wait"`: the local tier read on each tick, the store polled) and
//! `engine::forwards` (`forwarding: "detached"`: the forward sent within its lock, its answer
//! settled through `engine::machine::settle_claim`, its client answered if still there), ticked
//! whenever the clock moves. The root's machines speak the store's wire (Redis through webdis):
//! the world keeps each write's transitions by the request built for them, and answers writes
//! and polls in the store's own encoding (`StoredValue::encode`, sealed).
//!
//! What it leaves out: the wire of the requests' own calls (built and parsed by `store`'s and
//! `etcd`'s own tests), MCP, derived keys, internal-listener hops (detached routes here are
//! `hop: "direct"`) and etcd's lease and token keeper (`engine::keeper`, tested on its own).

use std::collections::{HashMap, HashSet};

use crate::backend::Backend;
use crate::config::{Config, Policy};
use crate::decision::Outcome;
use crate::engine::budget::Budget;
use crate::engine::forwards::{self, Action as ForwardAction, Forward, Forwards, Reply as ForwardReply};
use crate::engine::machine::{
    self, settle_claim, Command, Effects, Ended, Io, Machine, NotSent, Protected, Response, StoreOp,
};
use crate::engine::request::{self, Asked, StoreAnswer};
use crate::engine::waiters::{self, Action as WaitAction, Reply as WaitReply, Waiter};
use crate::engine::writes::{Action as WriteAction, Builder, Job, Note, WriteId, Writes};
use crate::lifecycle::{self, Event, Facts};
use crate::local::memory::MemoryShared;
use crate::local::{SharedData, Table};
use crate::owner::OwnerToken;
use crate::problem::ProblemKind;
use crate::record::{Creator, Lifetimes, Record, Stage, State, StoredResponse, UnknownReason};
use crate::request::RequestHead;
use crate::scope::StorageKey;
use crate::seal::Seal;
use crate::store::{
    ClaimReply, ReadReply, StoreError, StoreRequest, StoredValue, Transition, TransitionReply, WhereAbsent,
};
use crate::wait::{self, Seen};

/// The secret every proxy of the world seals its records with.
const SECRET: &str = "idemgate-world-record-key-0123456789";

/// How often a root ticks (`filter/mod.rs` sets a 100 ms tick): the clock's step when the world
/// waits for the root (a retry's backoff, a wait).
pub const ROOT_TICK_MS: u64 = 100;

/// One key's place in the store: a value, or a release tombstone naming the owner whose claim's
/// answer was lost (`Transition::release_lost`). Each lives until `expires_at_ms` (the store's
/// `PX`), then the key is absent.
#[derive(Clone, Debug)]
enum Slot {
    Value { v: StoredValue, expires_at_ms: u64 },
    Tomb { owner: OwnerToken, expires_at_ms: u64 },
}

/// The store's record table. Its clock is the world's.
#[derive(Default, Debug)]
pub struct Store {
    slots: HashMap<StorageKey, Slot>,
}

impl Store {
    fn live(&mut self, skey: &StorageKey, now: u64) -> Option<Slot> {
        let expired = match self.slots.get(skey) {
            Some(Slot::Value { expires_at_ms, .. } | Slot::Tomb { expires_at_ms, .. }) => *expires_at_ms <= now,
            None => false,
        };
        if expired {
            self.slots.remove(skey);
        }
        self.slots.get(skey).cloned()
    }

    /// Claim-or-read: the key claimed (the lifecycle's `Claim` from absent, forwarding at once),
    /// or the value it holds. A claim landing after its own owner's lost-answer release is refused
    /// (the script answers `2`, which the claim's parser takes as garbled: a lost answer).
    pub fn claim(
        &mut self,
        skey: StorageKey,
        owner: OwnerToken,
        record: Record,
        lt: &Lifetimes,
        now: u64,
    ) -> Result<ClaimReply, StoreError> {
        match self.live(&skey, now) {
            Some(Slot::Tomb { owner: o, .. }) if o == owner => {
                Err(StoreError::Garbled("claim refused by its owner's release tombstone".into()))
            }
            Some(Slot::Value { v, expires_at_ms }) => Ok(ClaimReply::Exists { now_ms: now, expires_at_ms, value: v }),
            _ => {
                let to = lifecycle::next(Stage::Absent, Event::Claim { forwarding: true }, Facts::default())
                    .map_err(|r| StoreError::Garbled(format!("{r:?}")))?;
                let v = StoredValue { phase: to, owner, lock_expires_at_ms: now + lt.lock_ms, record };
                self.slots.insert(skey, Slot::Value { v, expires_at_ms: now + lt.life_ms(to) });
                Ok(ClaimReply::Claimed { now_ms: now })
            }
        }
    }

    /// An owner-checked transition, as the transition script makes it, its stage change judged
    /// by `lifecycle::next`.
    pub fn transition(&mut self, skey: StorageKey, t: &Transition, now: u64) -> TransitionReply {
        let slot = self.live(&skey, now);
        let writes_where_absent = t.where_absent != WhereAbsent::Refuse;
        let absent = match &slot {
            None => true,
            Some(Slot::Tomb { .. }) => writes_where_absent,
            Some(Slot::Value { .. }) => false,
        };
        let lock = |now: u64| t.lock_ms.map_or(0, |l| now + l);
        if absent {
            if t.new_phase.is_none() && t.tombstone {
                self.slots.insert(skey, Slot::Tomb { owner: t.expected_owner, expires_at_ms: now + t.ttl_ms.max(1) });
                return TransitionReply::Changed;
            }
            return match (writes_where_absent, t.new_phase, &t.record) {
                (true, Some(phase), Some(record)) => {
                    let v = StoredValue {
                        phase,
                        owner: t.new_owner,
                        lock_expires_at_ms: lock(now),
                        record: record.clone(),
                    };
                    self.slots.insert(skey, Slot::Value { v, expires_at_ms: now + t.ttl_ms.max(1) });
                    TransitionReply::ClaimGoneRewritten
                }
                _ => TransitionReply::Refused,
            };
        }
        let Some(Slot::Value { v, expires_at_ms }) = slot else { return TransitionReply::Refused };
        // Every transition names the owner it expects (a take-over, the stale owner).
        let (Some(event), true) = (t.event, v.owner == t.expected_owner) else { return TransitionReply::Refused };
        let summary = v.summary(expires_at_ms);
        let facts = Facts::of(&summary, now, true);
        match lifecycle::next(v.phase, event, facts) {
            Ok(Stage::Absent) => {
                self.slots.remove(&skey);
                TransitionReply::Changed
            }
            Ok(to) => {
                let record = match (&t.record, t.where_absent) {
                    (Some(r), w) if w != WhereAbsent::WriteKeepingStored => r.clone(),
                    _ => v.record.clone(),
                };
                let v = StoredValue { phase: to, owner: t.new_owner, lock_expires_at_ms: lock(now), record };
                self.slots.insert(skey, Slot::Value { v, expires_at_ms: now + t.ttl_ms.max(1) });
                TransitionReply::Changed
            }
            Err(_) => TransitionReply::Refused,
        }
    }

    pub fn read(&mut self, skey: StorageKey, now: u64) -> ReadReply {
        match self.live(&skey, now) {
            Some(Slot::Value { v, .. }) => ReadReply::Found(v),
            _ => ReadReply::Absent,
        }
    }

    /// The stage the store holds for `skey` now (`Absent` for none or a tombstone).
    pub fn stage(&mut self, skey: &StorageKey, now: u64) -> Stage {
        match self.live(skey, now) {
            Some(Slot::Value { v, .. }) => v.phase,
            _ => Stage::Absent,
        }
    }
}

/// A store callout's request.
#[derive(Clone, Debug)]
pub enum Op {
    Claim { skey: StorageKey, owner: OwnerToken, record: Record, lifetimes: Lifetimes },
    Transition { skey: StorageKey, t: Box<Transition> },
    Read { skey: StorageKey },
}

/// The store's answer to an `Op`.
#[derive(Clone, Debug)]
pub enum Reply {
    Claim(Result<ClaimReply, StoreError>),
    Transition(TransitionReply),
    Read(ReadReply),
}

/// Who waits for a callout's answer.
#[derive(Clone, Debug)]
pub enum Caller {
    /// A request paused on it.
    Request(usize),
    /// Write `id` of proxy `proxy`'s root (`engine::writes`); `fallback`: its fallback's request.
    Write { proxy: usize, id: WriteId, fallback: bool },
    /// The store poll of request `r`, held on proxy `proxy` (`engine::waiters`).
    Poll { proxy: usize, r: usize },
    /// Nobody: its caller saw it lost, and it may still land (a slow link or store).
    Orphan,
}

/// How a callout is lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loss {
    /// It never reaches the store.
    Never,
    /// The store ran it; its answer is lost.
    AfterLanding,
    /// Its caller gives up now; it lands later (when the test lands or answers it).
    LandsLater,
}

/// A store callout on its way: `landed` once the store ran it.
#[derive(Clone, Debug)]
pub struct Callout {
    pub caller: Caller,
    pub op: Op,
    pub landed: Option<Reply>,
}

/// Where a request is, as the tests see it (the machine's phase, read).
#[derive(Clone, Debug)]
pub enum Phase {
    /// Sent by the client; its headers not yet seen by its proxy.
    New,
    /// Its headers seen; its body to come (a local claim held or not).
    Body,
    /// Paused on store callout `call`.
    Calling { call: usize },
    /// Forwarded under its claim(s): the upstream has it.
    Upstream,
    /// Held by its proxy's root until its key's first attempt finishes (`in_flight: "wait"`).
    Held,
    /// Handed to its proxy's root, which sends it upstream (`forwarding: "detached"`).
    Detached,
    /// Answered (or its client left).
    Done(Answer),
}

/// What the client got.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The upstream's own response (this request executed, or its response came back).
    Fresh { status: u16, body: Vec<u8> },
    /// A replay of a stored response.
    Replay { status: u16, body: Vec<u8> },
    /// A problem document (its type's slug).
    Problem(&'static str),
    /// 409 `request-in-flight` with this `retry-after` (seconds).
    InFlight { retry_after_seconds: u64 },
    /// The client left before its answer: it got nothing.
    Gone,
    /// Passed to the upstream unprotected (`on_unavailable: "pass"`).
    Unprotected,
}

/// How the upstream treats a forwarded request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upstream {
    /// It executes and answers (the outcome: stored).
    Answers,
    /// It executes (or may have) and the stream is reset before the response (outcome-unknown).
    Resets,
    /// The connection is never made: nothing executed (released).
    NeverConnects,
}

/// One client request.
pub struct Req {
    pub proxy: usize,
    pub key: String,
    /// Its caller (the `authorization` header's token, the key's scope).
    pub caller: String,
    pub body: Vec<u8>,
    pub owner: OwnerToken,
    pub creator: Creator,
    pub head: RequestHead,
    pub skey: Option<StorageKey>,
    /// Its headers were given to its proxy.
    pub started: bool,
    /// The request machine (its callouts named by their index in `World::calls`).
    pub machine: Machine<usize>,
    /// What the client got.
    pub answered: Option<Answer>,
}

impl Req {
    pub fn answer(&self) -> Option<&Answer> {
        self.answered.as_ref()
    }

    /// What the upstream counts its executions by: the key, with its caller when not the
    /// default one (`CALLER`).
    pub fn label(&self) -> String {
        label(&self.caller, &self.key)
    }
}

/// The label of `key` sent by `caller` (`Req::label`).
pub fn label(caller: &str, key: &str) -> String {
    if caller == CALLER {
        key.to_string()
    } else {
        format!("{caller}/{key}")
    }
}

/// A proxy: its own shared data and local table, and its root.
pub struct Proxy {
    pub sd: MemoryShared,
    pub table: Table,
    pub root: Root,
}

/// A proxy's root context: its machines, as `filter/mod.rs`'s `Root` holds them.
#[derive(Default)]
pub struct Root {
    pub writes: Writes,
    /// Each write's requests (its own, then its fallback's) with the transitions they carry: the
    /// store model runs the transition of the request the write machine sends.
    pub built: HashMap<WriteId, Vec<(StoreRequest, StorageKey, Transition)>>,
    /// What the write machine noted (retries, failures, landings), in order.
    pub notes: Vec<Note>,
    pub waiters: Vec<Waiter>,
    pub forwards: Forwards,
    /// Detached forwards sent upstream and not yet answered, with their callout's timeout (ms).
    pub out: Vec<(Box<Forward>, u64)>,
    /// Requests (by index) the root can still answer: held or detached, their client still there.
    pub live: HashSet<u32>,
}

/// Two proxies (or more), one store, one upstream, one clock.
pub struct World {
    pub now: u64,
    pub config: Config,
    /// The proxies' record seal (one secret, as a deployment shares it).
    pub seal: Seal,
    pub proxies: Vec<Proxy>,
    pub store: Store,
    /// Callouts by id; `None` once answered or lost.
    pub calls: Vec<Option<Callout>>,
    pub reqs: Vec<Req>,
    /// Executions by label (`Req::label`), and the response body of each (the first is
    /// `<label>#1`).
    pub runs: HashMap<String, u32>,
    pub responses: HashMap<String, Vec<Vec<u8>>>,
    /// The request body each response body answered (each response is one execution's).
    pub origins: HashMap<Vec<u8>, Vec<u8>>,
    /// Requests the upstream ran without a claim (`Step::PassUnprotected`).
    pub unprotected: u32,
}

/// The default caller (`World::send`).
pub const CALLER: &str = "caller-1";

fn head(path: &str, caller: &str, key: &str) -> RequestHead {
    RequestHead::from_pairs(vec![
        (":method".into(), b"POST".to_vec()),
        (":path".into(), path.as_bytes().to_vec()),
        (":authority".into(), b"idemgate.test".to_vec()),
        ("authorization".into(), format!("Bearer {caller}").into_bytes()),
        ("idempotency-key".into(), key.as_bytes().to_vec()),
    ])
}

impl World {
    /// A world of `proxies` proxies running `config_json` (which names a store), at `now`.
    pub fn new(config_json: &str, proxies: usize, now: u64) -> World {
        let config = match Config::parse(config_json.as_bytes()) {
            Ok(c) => c,
            Err(e) => panic!("configuration refused: {e:?}"),
        };
        let proxies = (0..proxies)
            .map(|_| {
                let table = Table::new(&config.local);
                let mut sd = MemoryShared::default();
                assert!(table.ensure_created(&mut sd).is_ok());
                Proxy { sd, table, root: Root::default() }
            })
            .collect();
        let seal = match Seal::new(Some(SECRET), None) {
            Ok(s) => s,
            Err(e) => panic!("seal refused: {e}"),
        };
        World {
            now,
            config,
            seal,
            proxies,
            store: Store::default(),
            calls: vec![],
            reqs: vec![],
            runs: HashMap::new(),
            responses: HashMap::new(),
            origins: HashMap::new(),
            unprotected: 0,
        }
    }

    /// A client sends a POST with `key` and `body` to `proxy`: the request's index.
    pub fn send(&mut self, proxy: usize, key: &str, body: &[u8]) -> usize {
        self.send_as(proxy, CALLER, key, body)
    }

    /// `send`, by `caller` (the key's scope).
    pub fn send_as(&mut self, proxy: usize, caller: &str, key: &str, body: &[u8]) -> usize {
        let n = self.reqs.len();
        let mut token = [0u8; 16];
        token[..8].copy_from_slice(&(n as u64 + 1).to_le_bytes());
        self.reqs.push(Req {
            proxy,
            key: key.to_string(),
            caller: caller.to_string(),
            body: body.to_vec(),
            owner: OwnerToken(token),
            creator: Creator { request_id: format!("r-{n}"), log_values: vec![] },
            head: head("/charges", caller, key),
            skey: None,
            started: false,
            machine: self.machine(),
            answered: None,
        });
        n
    }

    fn machine(&self) -> Machine<usize> {
        Machine::new(self.config.store.as_ref().map(|s| s.on_unavailable), true)
    }

    /// Where request `r` is.
    pub fn phase(&self, r: usize) -> Phase {
        let q = &self.reqs[r];
        if let Some(a) = &q.answered {
            return Phase::Done(a.clone());
        }
        match q.machine.phase() {
            _ if !q.started => Phase::New,
            machine::Phase::Waiting { .. } => Phase::Body,
            machine::Phase::Calling { call, .. } => Phase::Calling { call: call.wire },
            machine::Phase::Forwarded { .. } => Phase::Upstream,
            machine::Phase::Held { .. } => Phase::Held,
            machine::Phase::Detached { .. } => Phase::Detached,
            other => panic!("request {r} is in a phase the world leaves out: {}", phase_name(other)),
        }
    }

    /// Request `r`'s machine takes an input (`f`), its commands carried out on the world.
    fn drive<T>(&mut self, r: usize, f: impl FnOnce(&mut Machine<usize>, &mut Driver<'_>) -> T) -> T {
        let fresh = self.machine();
        let mut m = std::mem::replace(&mut self.reqs[r].machine, fresh);
        let out = f(&mut m, &mut Driver { w: self, r });
        self.reqs[r].machine = m;
        out
    }

    /// After an input: a request the machine passed on unprotected (`on_unavailable: "pass"`)
    /// is forwarded without any claim, and the upstream runs it.
    fn passed(&mut self, r: usize) {
        if self.reqs[r].answered.is_none() && matches!(self.reqs[r].machine.phase(), machine::Phase::Pass) {
            self.unprotected += 1;
            self.execute(r);
            self.done(r, Answer::Unprotected);
        }
    }

    fn done(&mut self, r: usize, a: Answer) {
        self.reqs[r].answered = Some(a);
    }

    /// Sends a store callout for `caller`: its id.
    fn call(&mut self, caller: Caller, op: Op) -> usize {
        self.calls.push(Some(Callout { caller, op, landed: None }));
        self.calls.len() - 1
    }

    /// Proxy `proxy`'s root is handed the write `t` of `skey` (with its fallback), as
    /// `filter/mod.rs`'s `push_write` builds it, and its write machine sends it.
    fn write(
        &mut self,
        proxy: usize,
        what: &'static str,
        skey: StorageKey,
        t: Transition,
        fallback: Option<Box<Transition>>,
    ) {
        if self.config.store.is_none() {
            return;
        }
        let build = |what: &'static str, t: &Transition| match Job::build(
            what,
            &skey,
            t,
            None,
            Backend::Redis,
            &self.seal,
            self.now,
        ) {
            Ok(job) => job,
            Err(e) => panic!("write {what} not built: {e}"),
        };
        let mut job = build(what, &t);
        let mut built = vec![(job.request.clone(), skey, t)];
        if let Some(f) = fallback {
            let fj = build("unknown_fallback", &f);
            built.push((fj.request.clone(), skey, *f));
            job.fallback = Some(Box::new(fj));
        }
        let root = &mut self.proxies[proxy].root;
        let id = root.writes.push(job);
        root.built.insert(id, built);
        self.run_writes(proxy);
    }

    /// Carries out proxy `p`'s write machine's actions, in order, until it has none
    /// (`filter/mod.rs` `run_writes`).
    fn run_writes(&mut self, p: usize) {
        while let Some(action) = self.proxies[p].root.writes.poll() {
            match action {
                WriteAction::Send(id) => {
                    let root = &self.proxies[p].root;
                    let sent = root.writes.request(id);
                    let found = root.built.get(&id).and_then(|b| {
                        b.iter()
                            .enumerate()
                            .find(|(_, (request, _, _))| Some(request) == sent)
                            .map(|(i, (_, skey, t))| (i, *skey, t.clone()))
                    });
                    let Some((i, skey, t)) = found else {
                        panic!("write {id} sends a request the world did not build")
                    };
                    self.call(Caller::Write { proxy: p, id, fallback: i > 0 }, Op::Transition { skey, t: Box::new(t) });
                }
                WriteAction::Note { note, .. } => self.proxies[p].root.notes.push(note),
                WriteAction::Ended | WriteAction::Stop { .. } => {}
            }
        }
    }

    /// Proxy `p`'s root ticks (`filter/mod.rs` `on_tick`): retries due are sent, waiters are
    /// checked, and detached forwards past their callout's timeout end unanswered.
    fn root_tick(&mut self, p: usize) {
        let now = self.now;
        self.proxies[p].root.writes.tick(now);
        self.run_writes(p);
        let has_store = self.config.store.is_some();
        let Proxy { sd, table, root } = &mut self.proxies[p];
        let live = &root.live;
        let actions = waiters::tick(&mut root.waiters, now, has_store, &|id| live.contains(&id), &mut |k| {
            table.peek(&mut *sd, k, now).ok().map(Seen::from_local)
        });
        self.run_waiters(p, actions);
        // Envoy ends a callout at its timeout, answering nothing; the upstream may have run it.
        let late: Vec<u32> = self.proxies[p]
            .root
            .out
            .iter()
            .filter(|(f, timeout)| f.sent_at_ms.saturating_add(*timeout) <= now)
            .map(|(f, _)| f.context_id)
            .collect();
        for r in late {
            self.forward_upstream(p, r as usize, Upstream::Resets);
        }
    }

    /// Carries out proxy `p`'s waiters machine's actions (`filter/mod.rs` `run_waiters`).
    fn run_waiters(&mut self, p: usize, actions: Vec<WaitAction>) {
        for action in actions {
            match action {
                WaitAction::Answer(w, reply) => {
                    let answer = match reply {
                        WaitReply::InFlight { retry_after_seconds } => Answer::InFlight { retry_after_seconds },
                        WaitReply::Replay(record) => replayed(record),
                        WaitReply::Problem(kind) => Answer::Problem(kind.slug()),
                    };
                    self.root_answers(p, w.context_id, answer);
                }
                WaitAction::Poll { context_id, skey } => {
                    self.call(Caller::Poll { proxy: p, r: context_id as usize }, Op::Read { skey });
                    waiters::poll_sent(&mut self.proxies[p].root.waiters, context_id);
                }
                WaitAction::Unauthentic { skey, why, .. } => {
                    panic!("the model store's record of {} failed its seal: {why}", skey.hex())
                }
            }
        }
    }

    /// Proxy `p`'s root answers request `context_id` if its client is still there.
    fn root_answers(&mut self, p: usize, context_id: u32, answer: Answer) {
        if self.proxies[p].root.live.remove(&context_id) {
            self.done(context_id as usize, answer);
        }
    }

    /// Carries out a detached forwarding action of proxy `p` (`filter/mod.rs` `run_forward`).
    fn run_forward(&mut self, p: usize, a: ForwardAction) {
        match a {
            ForwardAction::Send(f, timeout) => self.proxies[p].root.out.push((f, timeout)),
            ForwardAction::Refuse { forward, detail, problem, .. } => {
                let ended = Ended { outcome: Outcome::Release, detail: detail.to_string() };
                self.root_settles(p, &forward, ended, Response::default());
                self.root_answers(p, forward.context_id, Answer::Problem(problem.slug()));
            }
            ForwardAction::Probe { cluster, .. } => panic!("the world's detached routes are direct; {cluster} probed"),
            ForwardAction::Log(..) => {}
        }
    }

    /// Proxy `p`'s root settles forward `f`'s claim (`filter/settle.rs` `settle`).
    fn root_settles(&mut self, p: usize, f: &Forward, ended: Ended, response: Response) -> &'static str {
        let policy: Option<Policy> = self.config.policy_at(f.claim.policy_index).cloned();
        let has_store = self.config.store.is_some();
        settle_claim(&mut RootDriver { w: self, p }, &f.claim, policy.as_ref(), has_store, false, ended, response)
    }

    /// The callouts still on their way (answered or lost ones are gone).
    pub fn pending_calls(&self) -> Vec<usize> {
        (0..self.calls.len()).filter(|&i| self.calls[i].is_some()).collect()
    }

    /// The request's proxy sees its headers (`http.rs` `on_http_request_headers`).
    pub fn headers(&mut self, r: usize) {
        assert!(!self.reqs[r].started, "headers once");
        let a = match request::at_headers(&self.config, &self.reqs[r].head, None, false) {
            Ok(a) => a,
            Err(not) => panic!("not protected: {not:?}"),
        };
        let q = &mut self.reqs[r];
        q.started = true;
        q.skey = Some(a.skey);
        // The head as `http.rs` `on_http_request_headers` hands it on: a derived key added, the
        // router told never to re-send it.
        let mut head = q.head.clone();
        a.add_derived_key(&mut head);
        head.forbid_router_retries();
        // The world names each request's creator itself (`r-{n}`).
        let req = Protected { creator: q.creator.clone(), ..Protected::at_headers(a, head, q.owner) };
        self.drive(r, |m, io| m.protect(io, req, false));
        self.passed(r);
    }

    /// The request's whole body arrives (`http.rs` `body_complete`).
    pub fn body(&mut self, r: usize) {
        assert!(matches!(self.phase(r), Phase::Body), "request {r} waits for no body");
        let body = self.reqs[r].body.clone();
        self.drive(r, |m, io| m.body_end(io, body, None));
        self.passed(r);
    }

    /// The store runs callout `c` now (its answer not yet back).
    pub fn land(&mut self, c: usize) {
        let now = self.now;
        let Some(call) = self.calls[c].as_mut() else { return };
        if call.landed.is_some() {
            return;
        }
        let reply = match &call.op {
            Op::Claim { skey, owner, record, lifetimes } => {
                Reply::Claim(self.store.claim(*skey, *owner, record.clone(), lifetimes, now))
            }
            Op::Transition { skey, t } => Reply::Transition(self.store.transition(*skey, t, now)),
            Op::Read { skey } => Reply::Read(self.store.read(*skey, now)),
        };
        call.landed = Some(reply);
    }

    /// Callout `c` is answered (landing now if it had not).
    pub fn answer(&mut self, c: usize) {
        self.land(c);
        let Some(call) = self.calls[c].take() else { return };
        let reply = call.landed.map(Ok).unwrap_or(Err(StoreError::NoAnswer));
        self.answered(call.caller, call.op, reply);
    }

    /// Callout `c` is lost: its caller sees no answer.
    pub fn lose(&mut self, c: usize, how: Loss) {
        if how == Loss::AfterLanding {
            self.land(c);
        }
        let Some(call) = self.calls[c].take() else { return };
        if how == Loss::LandsLater && call.landed.is_none() {
            self.calls.push(Some(Callout { caller: Caller::Orphan, op: call.op.clone(), landed: None }));
        }
        self.answered(call.caller, call.op, Err(StoreError::NoAnswer));
    }

    fn answered(&mut self, caller: Caller, op: Op, reply: Result<Reply, StoreError>) {
        match caller {
            Caller::Write { proxy, id, .. } => {
                let (status, body) = match reply {
                    Ok(Reply::Transition(t)) => (Some(200), transition_wire(&t)),
                    Ok(other) => panic!("write {id} answered {other:?}"),
                    Err(_) => (None, vec![]),
                };
                let now = self.now;
                let writer = move || (now, Backend::Redis);
                let b = Builder { store: Backend::Redis, seal: Some(&self.seal), writer: &writer };
                self.proxies[proxy].root.writes.answered(id, status, &body, &b);
                self.run_writes(proxy);
            }
            Caller::Poll { proxy, r } => {
                let Op::Read { skey } = op else { panic!("poll of request {r} is not a read") };
                let (status, body) = match reply {
                    Ok(Reply::Read(read)) => (Some(200), read_wire(&read, &skey, &self.seal)),
                    Ok(other) => panic!("poll of request {r} answered {other:?}"),
                    Err(_) => (None, vec![]),
                };
                let now = self.now;
                let Proxy { sd, table, root } = &mut self.proxies[proxy];
                let actions = waiters::store_answered(
                    &mut root.waiters,
                    r as u32,
                    status,
                    &body,
                    Backend::Redis,
                    Some(&self.seal),
                    now,
                    &mut |k| wait::local_holds(table.peek(&mut *sd, k, now).ok().map(Seen::from_local)),
                );
                self.run_waiters(proxy, actions);
            }
            Caller::Request(r) => self.request_answered(r, reply),
            Caller::Orphan => {}
        }
    }

    /// A request's store call answered (`http.rs` `on_store_answer`).
    fn request_answered(&mut self, r: usize, reply: Result<Reply, StoreError>) {
        let Some((_, call)) = self.reqs[r].machine.calling() else { return };
        let asked = call.asked;
        let answer = match (asked, reply) {
            (Asked::Claim, Ok(Reply::Claim(reply))) => StoreAnswer::Claim(reply),
            (Asked::Claim, Err(e)) => StoreAnswer::Claim(Err(e)),
            (Asked::TakeOver, Ok(Reply::Transition(t))) => StoreAnswer::TakeOver(Ok(t)),
            (Asked::TakeOver, Err(e)) => StoreAnswer::TakeOver(Err(e)),
            (Asked::Settled, Ok(Reply::Read(read))) => StoreAnswer::Settled(Ok(read)),
            (Asked::Settled, Err(e)) => StoreAnswer::Settled(Err(e)),
            (_, Ok(other)) => panic!("request {r} asked {asked:?}, answered {other:?}"),
        };
        self.drive(r, |m, io| m.store_answer(io, answer, None));
        self.passed(r);
    }

    /// The upstream runs request `r`: its execution counted, its response body `<label>#<n>`.
    fn execute(&mut self, r: usize) -> StoredResponse {
        let key = self.reqs[r].label();
        let n = self.runs.entry(key.clone()).or_insert(0);
        *n += 1;
        let body = format!("{key}#{n}").into_bytes();
        self.responses.entry(key).or_default().push(body.clone());
        self.origins.insert(body.clone(), self.reqs[r].body.clone());
        StoredResponse { status: 201, headers: vec![], body }
    }

    /// The upstream treats forwarded request `r` so; its response flows through the machine,
    /// and the exchange is settled (`engine::settle`, through the machine).
    pub fn upstream(&mut self, r: usize, how: Upstream) {
        assert!(matches!(self.phase(r), Phase::Upstream), "request {r} is not forwarded");
        let (outcome, response) = match how {
            Upstream::Answers => (Outcome::Store, Some(self.execute(r))),
            Upstream::Resets => {
                self.execute(r);
                (Outcome::Unknown(UnknownReason::UpstreamReset), None)
            }
            Upstream::NeverConnects => (Outcome::Release, None),
        };
        if let Some(resp) = &response {
            let m = &mut self.reqs[r].machine;
            let _ = m.response_headers(vec![(":status".into(), resp.status.to_string().into_bytes())], false);
            m.response_body(&resp.body, true);
        }
        self.drive(r, |m, io| m.settle(io, Ended { outcome, detail: String::new() }));
        let answer = match (how, response) {
            (Upstream::Answers, Some(resp)) => Answer::Fresh { status: resp.status, body: resp.body },
            (Upstream::Resets, _) => Answer::Problem("upstream-reset"),
            _ => Answer::Problem("upstream-unreachable"),
        };
        self.done(r, answer);
    }

    /// The upstream treats detached request `r`'s forward so (sent by its proxy's root); the
    /// root settles the claim and answers the client if it is still there.
    pub fn upstream_detached(&mut self, r: usize, how: Upstream) {
        assert!(self.is_out(r), "request {r} has no forward on its way");
        let p = self.reqs[r].proxy;
        self.forward_upstream(p, r, how);
    }

    /// Whether request `r`'s detached forward is on its way to the upstream.
    pub fn is_out(&self, r: usize) -> bool {
        let p = self.reqs[r].proxy;
        self.proxies[p].root.out.iter().any(|(f, _)| f.context_id == r as u32)
    }

    fn forward_upstream(&mut self, p: usize, r: usize, how: Upstream) {
        let out = &mut self.proxies[p].root.out;
        let Some(i) = out.iter().position(|(f, _)| f.context_id == r as u32) else { return };
        let (f, _) = out.remove(i);
        let (status, headers, body) = match how {
            Upstream::Answers => {
                let resp = self.execute(r);
                (Some(resp.status), vec![("x-envoy-upstream-service-time".to_string(), b"3".to_vec())], resp.body)
            }
            Upstream::Resets => {
                self.execute(r);
                (None, vec![], vec![])
            }
            Upstream::NeverConnects => {
                (Some(503), vec![("content-type".to_string(), b"text/plain".to_vec())], b"no healthy upstream".to_vec())
            }
        };
        let policy: Option<Policy> = self.config.policy_at(f.claim.policy_index).cloned();
        let live = self.proxies[p].root.live.contains(&f.context_id);
        let a = forwards::answered(&f, policy.as_ref(), status, headers, body, &[], live, self.now);
        if let Some(st) = a.settle {
            let ended = Ended { outcome: st.outcome, detail: st.detail };
            let response = Response { stored: st.response, too_large: st.too_large, complete: true };
            self.root_settles(p, &f, ended, response);
        }
        let answer = match a.reply {
            ForwardReply::Response { status, body, .. } if status < 300 => Answer::Fresh { status, body },
            ForwardReply::Response { .. } => Answer::Problem("upstream-unreachable"),
            ForwardReply::Problem(kind) => Answer::Problem(kind.slug()),
        };
        self.root_answers(p, f.context_id, answer);
    }

    /// Request `r`'s client leaves (`http.rs` `on_done`/`on_log` before an answer): what the
    /// request held is freed; a held or detached request's root answers no one. A forwarded
    /// request is left alone (its upstream decides; `Upstream::Resets` models a reset).
    pub fn leave(&mut self, r: usize) {
        if self.reqs[r].answered.is_some() {
            return;
        }
        let p = self.reqs[r].proxy;
        match self.phase(r) {
            Phase::Upstream | Phase::Done(_) => return,
            Phase::Body | Phase::Calling { .. } => {
                self.drive(r, |m, io| m.abandon(io));
            }
            Phase::New | Phase::Held | Phase::Detached => {}
        }
        self.proxies[p].root.live.remove(&(r as u32));
        self.done(r, Answer::Gone);
    }

    /// Moves the clock; every root ticks.
    pub fn tick(&mut self, ms: u64) {
        self.now += ms;
        for p in 0..self.proxies.len() {
            self.root_tick(p);
        }
    }

    /// Whether a root still has work the clock must move for: a write waiting for its retry, a
    /// request held, or a detached forward out.
    pub fn root_busy(&self) -> bool {
        self.proxies.iter().any(|p| p.root.writes.pending() > 0 || !p.root.waiters.is_empty() || !p.root.out.is_empty())
    }

    /// Runs every request to its answer: headers, bodies, every callout answered, every forward
    /// answered by the upstream, the clock moved a root tick at a time while a root waits;
    /// `false` if `rounds` rounds leave a request unanswered or a callout on its way.
    pub fn drain(&mut self, rounds: usize) -> bool {
        for _ in 0..rounds {
            let mut moved = false;
            for r in 0..self.reqs.len() {
                match self.phase(r) {
                    Phase::New => self.headers(r),
                    Phase::Body => self.body(r),
                    Phase::Upstream => self.upstream(r, Upstream::Answers),
                    Phase::Detached if self.is_out(r) => self.upstream_detached(r, Upstream::Answers),
                    Phase::Calling { .. } | Phase::Held | Phase::Detached | Phase::Done(_) => continue,
                }
                moved = true;
            }
            for c in self.pending_calls() {
                self.answer(c);
                moved = true;
            }
            if !moved && self.root_busy() {
                self.tick(ROOT_TICK_MS);
                moved = true;
            }
            if !moved {
                return true;
            }
        }
        self.reqs.iter().all(|q| q.answered.is_some()) && self.pending_calls().is_empty()
    }
}

/// What a client is sent for `record` replayed (`filter/reply.rs` `replay`).
fn replayed(record: Record) -> Answer {
    match record.state {
        State::Completed(resp) => Answer::Replay { status: resp.status, body: resp.body },
        State::CompletedTooLarge { status, .. } => {
            Answer::Problem(ProblemKind::ResponseNotStored { status, location: None }.slug())
        }
        _ => Answer::Problem(ProblemKind::OutcomeUnknown.slug()),
    }
}

/// The transition script's answer, as webdis sends it: `{code, new owner}`.
fn transition_wire(t: &TransitionReply) -> Vec<u8> {
    let code = match t {
        TransitionReply::Changed => 1,
        TransitionReply::Refused => 0,
        TransitionReply::ClaimGoneRewritten => 2,
        other => panic!("the model store answers no {other:?}"),
    };
    format!("*2\r\n:{code}\r\n$32\r\n{}\r\n", OwnerToken([0; 16]).hex()).into_bytes()
}

/// A read's answer, as webdis sends it: the value as the scripts wrote it, sealed for its key.
fn read_wire(read: &ReadReply, skey: &StorageKey, seal: &Seal) -> Vec<u8> {
    match read {
        ReadReply::Found(v) => {
            let value = v.encode(skey, seal);
            let mut out = format!("${}\r\n", value.len()).into_bytes();
            out.extend_from_slice(&value);
            out.extend_from_slice(b"\r\n");
            out
        }
        _ => b"$-1\r\n".to_vec(),
    }
}

fn phase_name<W>(p: &machine::Phase<W>) -> &'static str {
    match p {
        machine::Phase::Pass => "pass",
        machine::Phase::McpBody { .. } => "mcp-body",
        machine::Phase::Waiting { .. } => "waiting",
        machine::Phase::Calling { .. } => "calling",
        machine::Phase::Forwarded { .. } => "forwarded",
        machine::Phase::Detached { .. } => "detached",
        machine::Phase::Held { .. } => "held",
        machine::Phase::Answered => "answered",
    }
}

/// The world as request `r`'s machine's driver.
struct Driver<'w> {
    w: &'w mut World,
    r: usize,
}

impl Effects for Driver<'_> {
    /// The world logs nothing.
    fn logs(&self, _level: crate::engine::settle::Level) -> bool {
        false
    }

    fn now_ms(&mut self) -> u64 {
        self.w.now
    }

    fn local(&mut self) -> (&Table, &mut dyn SharedData) {
        let p = &mut self.w.proxies[self.w.reqs[self.r].proxy];
        (&p.table, &mut p.sd)
    }

    fn run(&mut self, c: Command<'_>) {
        let r = self.r;
        let p = self.w.reqs[r].proxy;
        match c {
            Command::Reply { problem: ProblemKind::InFlight { retry_after_seconds }, .. } => {
                self.w.done(r, Answer::InFlight { retry_after_seconds })
            }
            Command::Reply { problem, .. } => self.w.done(r, Answer::Problem(problem.slug())),
            Command::Replay { record, .. } => self.w.done(r, replayed(record)),
            Command::Write { what, skey, transition, fallback, .. } => {
                self.w.write(p, what, skey, *transition, fallback)
            }
            // `http.rs` `hold`.
            Command::Hold { req, fp, wait_ms } => {
                let now = self.w.now;
                let root = &mut self.w.proxies[p].root;
                root.live.insert(r as u32);
                root.waiters.push(req.waiter(r as u32, fp, now, wait_ms));
            }
            // `http.rs` `detach`, then the root's `forward_through_hop`.
            Command::Detach(mut f) => {
                f.context_id = r as u32;
                let f = *f;
                let now = self.w.now;
                let root = &mut self.w.proxies[p].root;
                root.live.insert(r as u32);
                if let Some(a) = root.forwards.queued(f, now) {
                    self.w.run_forward(p, a);
                }
            }
            Command::McpReply { .. } | Command::HandOver { .. } => panic!("the world leaves out MCP and redirects"),
            // Nothing is redirected in the world: a mark would never be read.
            Command::Count(_)
            | Command::Log(..)
            | Command::KeyDerived { .. }
            | Command::Publish { .. }
            | Command::Mark { .. } => {}
        }
    }
}

/// The world as proxy `p`'s root's settlement driver (`filter/settle.rs`'s `Root`).
struct RootDriver<'w> {
    w: &'w mut World,
    p: usize,
}

impl Effects for RootDriver<'_> {
    fn logs(&self, _level: crate::engine::settle::Level) -> bool {
        false
    }

    fn now_ms(&mut self) -> u64 {
        self.w.now
    }

    fn local(&mut self) -> (&Table, &mut dyn SharedData) {
        let p = &mut self.w.proxies[self.p];
        (&p.table, &mut p.sd)
    }

    fn run(&mut self, c: Command<'_>) {
        // A settlement gives writes, counts and logs only.
        if let Command::Write { what, skey, transition, fallback, .. } = c {
            self.w.write(self.p, what, skey, *transition, fallback);
        }
    }
}

impl Io for Driver<'_> {
    type Wire = usize;

    /// The world keeps no buffer budget: the bucket read at headers is always kept.
    fn budget(&self) -> Budget {
        Budget { buffered: 0, max: u64::MAX }
    }

    fn set_buffered(&mut self, _buffered: u64) {}

    fn read_body(&mut self, _req: Option<&Protected>, _size: usize) -> Vec<u8> {
        self.w.reqs[self.r].body.clone()
    }

    fn forbid_router_retries(&mut self, head: &mut RequestHead) -> bool {
        head.forbid_router_retries();
        true
    }

    fn next_owner(&mut self) -> OwnerToken {
        self.w.reqs[self.r].owner
    }

    /// The world leaves out internal redirects: nothing is ever handed over.
    fn take_handoff(
        &mut self,
        _skey: &StorageKey,
        _policy_index: usize,
        _original_url: &[u8],
    ) -> Option<crate::redirect::Handoff<crate::engine::settle::Claim>> {
        None
    }

    fn send(&mut self, req: &Protected, op: StoreOp<'_, usize>) -> Result<usize, NotSent> {
        let skey = req.skey;
        let op = match op {
            StoreOp::Claim { record, lifetimes } => Op::Claim { skey, owner: req.owner, record, lifetimes },
            StoreOp::TakeOver { transition, .. } => Op::Transition { skey, t: Box::new(transition) },
            StoreOp::Read => Op::Read { skey },
            // The model's store always holds its scripts.
            StoreOp::Again(_) => panic!("NOSCRIPT from the model store"),
        };
        Ok(self.w.call(Caller::Request(self.r), op))
    }
}

#[cfg(test)]
mod tests;
