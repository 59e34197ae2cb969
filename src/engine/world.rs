//! An in-memory world for whole requests, without Envoy (issue 26; tests only): two proxies, each
//! with its own shared data (`MemoryShared`) and local table, one store (a model of the store's
//! record table whose every change is `lifecycle::next`'s), an upstream that counts its
//! executions per key, store callouts that are answered, lost (before or after they land) or
//! delayed, root writes retried then replaced by their fallback, and one clock the test moves.
//!
//! Each request is the filter's own request machine (`engine::machine`, which
//! `src/filter/http.rs` drives with Envoy's callbacks): the world feeds it the same inputs
//! (headers admitted, the body's end, the store's answers, the upstream's response, the
//! exchange's end) and carries its commands out on its model (callouts to the store, root
//! writes, the client's answer). What it leaves out: the wire (requests are built and answers
//! parsed by `store`'s and `etcd`'s own tests), `in_flight: "wait"`, detached forwards, MCP,
//! derived keys, and `engine::writes`'s schedule (a write lost is sent again up to `WRITE_TRIES`
//! times, then its fallback, as `engine::writes` does in order).

use std::collections::HashMap;

use crate::config::Config;
use crate::decision::Outcome;
use crate::engine::budget::Budget;
use crate::engine::machine::{self, Command, Effects, Ended, Io, Machine, NotSent, Protected, StoreOp};
use crate::engine::request::{self, Asked, KeyFrom, StoreAnswer};
use crate::lifecycle::{self, Event, Facts};
use crate::local::memory::MemoryShared;
use crate::local::{SharedData, Table};
use crate::owner::OwnerToken;
#[cfg(test)]
use crate::problem::ProblemKind;
use crate::record::{Creator, Lifetimes, Record, Stage, State, StoredResponse, UnknownReason};
use crate::request::RequestHead;
use crate::scope::StorageKey;
use crate::store::{ClaimReply, ReadReply, StoreError, StoredValue, Transition, TransitionReply, WhereAbsent};

/// How many times a root write is sent before its fallback replaces it.
pub const WRITE_TRIES: u32 = 3;

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
    /// The root's write (of `what`), sent `tries` times so far, with its fallback.
    Write { what: &'static str, tries: u32, fallback: Option<Box<Transition>> },
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
    /// Answered.
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
}

/// A proxy: its own shared data and local table.
pub struct Proxy {
    pub sd: MemoryShared,
    pub table: Table,
}

/// Two proxies (or more), one store, one upstream, one clock.
pub struct World {
    pub now: u64,
    pub config: Config,
    pub proxies: Vec<Proxy>,
    pub store: Store,
    /// Callouts by id; `None` once answered or lost.
    pub calls: Vec<Option<Callout>>,
    pub reqs: Vec<Req>,
    /// Executions by key, and the response body of each (the first is `<key>#1`).
    pub runs: HashMap<String, u32>,
    pub responses: HashMap<String, Vec<Vec<u8>>>,
    /// Requests the upstream ran without a claim (`Step::PassUnprotected`).
    pub unprotected: u32,
}

pub const AUTH: &str = "Bearer caller-1";

fn head(path: &str, key: &str) -> RequestHead {
    RequestHead::from_pairs(vec![
        (":method".into(), b"POST".to_vec()),
        (":path".into(), path.as_bytes().to_vec()),
        (":authority".into(), b"idemgate.test".to_vec()),
        ("authorization".into(), AUTH.as_bytes().to_vec()),
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
                Proxy { sd, table }
            })
            .collect();
        World {
            now,
            config,
            proxies,
            store: Store::default(),
            calls: vec![],
            reqs: vec![],
            runs: HashMap::new(),
            responses: HashMap::new(),
            unprotected: 0,
        }
    }

    /// A client sends a POST with `key` and `body` to `proxy`: the request's index.
    pub fn send(&mut self, proxy: usize, key: &str, body: &[u8]) -> usize {
        let n = self.reqs.len();
        let mut token = [0u8; 16];
        token[..8].copy_from_slice(&(n as u64 + 1).to_le_bytes());
        self.reqs.push(Req {
            proxy,
            key: key.to_string(),
            body: body.to_vec(),
            owner: OwnerToken(token),
            creator: Creator { request_id: format!("r-{n}"), log_values: vec![] },
            head: head("/charges", key),
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

    /// The root's write of `t` (with its fallback).
    fn write(&mut self, what: &'static str, skey: StorageKey, t: Transition, fallback: Option<Box<Transition>>) {
        if self.config.store.is_some() {
            self.call(Caller::Write { what, tries: 1, fallback }, Op::Transition { skey, t: Box::new(t) });
        }
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
        let req = Protected {
            route: a.route,
            policy: a.policy,
            head: q.head.clone(),
            skey: a.skey,
            scope: a.scope,
            creator: q.creator.clone(),
            owner: q.owner,
            derive_at_body: a.from == KeyFrom::DerivedAtBody,
            mcp: None,
            body: vec![],
        };
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
            Caller::Write { what, tries, fallback } => {
                if reply.is_ok() {
                    return;
                }
                if tries < WRITE_TRIES {
                    self.call(Caller::Write { what, tries: tries + 1, fallback }, op);
                } else if let (Some(f), Op::Transition { skey, .. }) = (fallback, op) {
                    self.call(Caller::Write { what, tries: 1, fallback: None }, Op::Transition { skey, t: f });
                }
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

    /// The upstream runs request `r`: its execution counted, its response body `<key>#<n>`.
    fn execute(&mut self, r: usize) -> StoredResponse {
        let key = self.reqs[r].key.clone();
        let n = self.runs.entry(key.clone()).or_insert(0);
        *n += 1;
        let body = format!("{key}#{n}").into_bytes();
        self.responses.entry(key).or_default().push(body.clone());
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

    /// Moves the clock.
    pub fn tick(&mut self, ms: u64) {
        self.now += ms;
    }

    /// Runs every request to its answer: headers, bodies, every callout answered, every forward
    /// answered by the upstream; `false` if `rounds` rounds leave a request unanswered or a
    /// callout on its way.
    pub fn drain(&mut self, rounds: usize) -> bool {
        for _ in 0..rounds {
            let mut moved = false;
            for r in 0..self.reqs.len() {
                match self.phase(r) {
                    Phase::New => self.headers(r),
                    Phase::Body => self.body(r),
                    Phase::Upstream => self.upstream(r, Upstream::Answers),
                    Phase::Calling { .. } | Phase::Done(_) => continue,
                }
                moved = true;
            }
            for c in self.pending_calls() {
                self.answer(c);
                moved = true;
            }
            if !moved {
                return true;
            }
        }
        self.reqs.iter().all(|q| q.answered.is_some()) && self.pending_calls().is_empty()
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
        match c {
            Command::Reply { problem, .. } => self.w.done(r, Answer::Problem(problem.slug())),
            Command::Replay { record, .. } => {
                if let State::Completed(resp) = record.state {
                    self.w.done(r, Answer::Replay { status: resp.status, body: resp.body });
                }
            }
            Command::Write { what, skey, transition, fallback, .. } => self.w.write(what, skey, *transition, fallback),
            Command::Hold { .. } | Command::Detach { .. } => panic!("the world leaves out waits and detached forwards"),
            Command::McpReply { .. } | Command::HandOver { .. } => panic!("the world leaves out MCP and redirects"),
            Command::Count(_) | Command::Log(..) | Command::KeyDerived { .. } | Command::Publish { .. } => {}
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
