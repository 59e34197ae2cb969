//! An in-memory world for whole requests, without Envoy (issue 26; tests only): two proxies, each
//! with its own shared data (`MemoryShared`) and local table, one store (a model of the store's
//! record table whose every change is `lifecycle::next`'s), an upstream that counts its
//! executions per key, store callouts that are answered, lost (before or after they land) or
//! delayed, root writes retried then replaced by their fallback, and one clock the test moves.
//!
//! Each proxy sequences `engine::request`'s steps and carries out `engine::settle`'s commands as
//! the filter does (`src/filter/http.rs` `run`, `on_store_answer`, `body_complete`;
//! `src/filter/settle.rs`): the filter still sequences them itself, so this is a second
//! sequencer of the same steps, kept to the filter's order by hand. What it leaves out: the wire
//! (requests are built and answers parsed by `store`'s and `etcd`'s own tests), `in_flight:
//! "wait"`, detached forwards, MCP, derived keys, and `engine::writes`'s schedule (a write lost is
//! sent again up to `WRITE_TRIES` times, then its fallback, as `engine::writes` does in order).

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::{Config, OnUnavailable, Policy};
use crate::decision::Outcome;
use crate::engine::request::{self, Admitted, Answered, Asked, AtBodyEnd, Sent, Step, StoreAnswer};
use crate::engine::settle::{self, Claim, Command, Local, LocalAnswer};
use crate::failsafe::Holding;
use crate::lifecycle::{self, Event, Facts};
use crate::local::memory::MemoryShared;
use crate::local::{Handle, Seen, Table};
use crate::owner::OwnerToken;
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

/// Where a request is.
#[derive(Clone, Debug)]
pub enum Phase {
    /// Sent by the client; its headers not yet seen by its proxy.
    New,
    /// Its headers seen; its body to come, holding nothing (`seen`: its bucket as read then).
    Body { seen: Option<Seen> },
    /// Paused on store callout `call`.
    Calling { asked: Asked, sent: Sent, call: usize },
    /// Forwarded under `claim`: the upstream has it.
    Upstream(Box<Claim>),
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
#[derive(Clone, Debug)]
pub struct Req {
    pub proxy: usize,
    pub key: String,
    pub body: Vec<u8>,
    pub owner: OwnerToken,
    pub creator: Creator,
    pub head: RequestHead,
    pub admitted: Option<Admitted>,
    pub skey: Option<StorageKey>,
    pub phase: Phase,
}

impl Req {
    pub fn answer(&self) -> Option<&Answer> {
        match &self.phase {
            Phase::Done(a) => Some(a),
            _ => None,
        }
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
            admitted: None,
            skey: None,
            phase: Phase::New,
        });
        n
    }

    fn store_mode(&self) -> request::StoreMode {
        self.config.store.as_ref().map(|s| s.on_unavailable)
    }

    fn on_unavailable(&self) -> OnUnavailable {
        self.config.store.as_ref().map_or(OnUnavailable::Reject, |s| s.on_unavailable)
    }

    fn policy(&self, r: usize) -> Arc<Policy> {
        match &self.reqs[r].admitted {
            Some(a) => Arc::clone(&a.policy),
            None => panic!("request {r} has no policy yet"),
        }
    }

    fn skey(&self, r: usize) -> StorageKey {
        match self.reqs[r].skey {
            Some(s) => s,
            None => panic!("request {r} has no storage key yet"),
        }
    }

    fn done(&mut self, r: usize, a: Answer) {
        self.reqs[r].phase = Phase::Done(a);
    }

    fn release_local(&mut self, r: usize, handle: Option<Handle>) {
        if let Some(h) = handle {
            let p = &mut self.proxies[self.reqs[r].proxy];
            let _ = p.table.release(&mut p.sd, &h, self.now);
        }
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

    /// The request's proxy sees its headers (`http.rs` `on_http_request_headers`, then `act`).
    pub fn headers(&mut self, r: usize) {
        assert!(matches!(self.reqs[r].phase, Phase::New), "headers once");
        let admitted = match request::at_headers(&self.config, &self.reqs[r].head, None, false) {
            Ok(a) => a,
            Err(not) => panic!("not protected: {not:?}"),
        };
        let skey = admitted.skey;
        let policy = Arc::clone(&admitted.policy);
        self.reqs[r].admitted = Some(admitted);
        self.reqs[r].skey = Some(skey);
        let (owner, creator) = (self.reqs[r].owner, self.reqs[r].creator.clone());
        let p = &mut self.proxies[self.reqs[r].proxy];
        let begun = p.table.begin(&mut p.sd, skey, None, self.now, &policy, owner, &creator);
        let step = request::after_local(begun, None, self.store_mode(), self.now);
        self.run(r, step);
    }

    /// The request's whole body arrives (`http.rs` `body_complete`).
    pub fn body(&mut self, r: usize) {
        let Phase::Body { seen } = self.reqs[r].phase.clone() else { panic!("request {r} waits for no body") };
        let policy = self.policy(r);
        let (scope, mut head, body) = match &self.reqs[r].admitted {
            Some(a) => (a.scope, self.reqs[r].head.clone(), self.reqs[r].body.clone()),
            None => panic!("admitted"),
        };
        let AtBodyEnd::Fingerprinted { fp, .. } = request::at_body_end(&policy, &mut head, &scope, false, &body) else {
            panic!("a sent key needs no derivation")
        };
        let (now, mode, skey) = (self.now, self.store_mode(), self.skey(r));
        let (owner, creator) = (self.reqs[r].owner, self.reqs[r].creator.clone());
        let p = &mut self.proxies[self.reqs[r].proxy];
        let begun = p.table.begin_after(&mut p.sd, skey, Some(fp), now, &policy, owner, &creator, seen);
        let step = request::after_local(begun, Some(fp), mode, now);
        self.run(r, step);
    }

    /// Carries out the request machine's next step (`http.rs` `run`).
    fn run(&mut self, r: usize, step: Step) {
        let policy = self.policy(r);
        let lt = Lifetimes::of(&policy);
        let (skey, owner, now) = (self.skey(r), self.reqs[r].owner, self.now);
        match step {
            Step::WaitForBody { seen } => self.reqs[r].phase = Phase::Body { seen },
            Step::PauseForBody => self.reqs[r].phase = Phase::Body { seen: None },
            Step::ClaimInStore { handle, fp } => {
                let record = Record::in_progress(fp, self.reqs[r].creator.clone(), owner, now, &lt);
                let call = self.call(Caller::Request(r), Op::Claim { skey, owner, record, lifetimes: lt });
                let sent = Sent { handle, fp, sent_at_ms: now };
                self.reqs[r].phase = Phase::Calling { asked: Asked::Claim, sent, call };
            }
            Step::ReadSettled { fp } => {
                let call = self.call(Caller::Request(r), Op::Read { skey });
                let sent = Sent { handle: None, fp, sent_at_ms: now };
                self.reqs[r].phase = Phase::Calling { asked: Asked::Settled, sent, call };
            }
            Step::Forward { handle, fp, in_store, .. } => {
                let claim = Claim {
                    handle,
                    fp,
                    in_store,
                    owner,
                    skey,
                    policy_index: self.reqs[r].admitted.as_ref().map_or(0, |a| a.route),
                    creator: self.reqs[r].creator.clone(),
                    log: String::new(),
                    mcp_id: None,
                };
                self.reqs[r].phase = Phase::Upstream(Box::new(claim));
            }
            Step::Replay { record, cache } => {
                if let Some(h) = cache {
                    let p = &mut self.proxies[self.reqs[r].proxy];
                    let _ = p.table.complete(&mut p.sd, &h, record.clone(), now);
                }
                let answer = match record.state {
                    State::Completed(resp) => Answer::Replay { status: resp.status, body: resp.body },
                    State::CompletedTooLarge { .. } => Answer::Problem("response-not-stored"),
                    _ => Answer::Problem(ProblemKind::OutcomeUnknown.slug()),
                };
                self.done(r, answer);
            }
            Step::InFlight { release, .. } => {
                self.release_local(r, release);
                let p = ProblemKind::InFlight { retry_after_seconds: 1 };
                self.done(r, Answer::Problem(p.slug()));
            }
            Step::Reply { problem, release, .. } => {
                self.release_local(r, release);
                self.done(r, Answer::Problem(problem.slug()));
            }
            Step::MarkUnknown { old_owner, release, .. } => {
                self.release_local(r, release);
                self.write("stale_to_unknown", skey, Transition::stale_to_unknown(old_owner, &lt), None);
                self.done(r, Answer::Problem(ProblemKind::OutcomeUnknown.slug()));
            }
            Step::TakeOver { handle, fp, old, free } => {
                let record = Record::in_progress(fp, self.reqs[r].creator.clone(), owner, now, &lt);
                let t = Transition::take_over(old.owner, owner, record, free, &lt);
                let call = self.call(Caller::Request(r), Op::Transition { skey, t: Box::new(t) });
                let sent = Sent { handle, fp, sent_at_ms: now };
                self.reqs[r].phase = Phase::Calling { asked: Asked::TakeOver, sent, call };
            }
            Step::Unreadable { problem, release, .. } => {
                self.release_local(r, release);
                self.done(r, Answer::Problem(problem.slug()));
            }
            Step::UnknownStands { .. } => self.done(r, Answer::Problem(ProblemKind::OutcomeUnknown.slug())),
            Step::LocalFailed(_) => {
                let p = ProblemKind::StoreUnavailable { retry_after_seconds: 1 };
                self.done(r, Answer::Problem(p.slug()));
            }
            Step::PassUnprotected => {
                // Forwarded without any claim: the upstream runs it.
                self.unprotected += 1;
                self.execute(r);
                self.done(r, Answer::Unprotected);
            }
            Step::FailClosed { broken, handle, .. } => {
                let holding = if handle.is_some() { Holding::LocalClaim } else { Holding::Nothing };
                let refusal = crate::failsafe::refuse(broken, holding);
                if refusal.release_local {
                    self.release_local(r, handle);
                }
                self.done(r, Answer::Problem(refusal.problem.slug()));
            }
        }
    }

    /// A store failure for a request holding `handle` (`http.rs` `store_failed_as`).
    fn store_failed(&mut self, r: usize, handle: Option<Handle>, on_unavailable: OnUnavailable) {
        self.release_local(r, handle);
        let step = request::after_store_failure(&self.policy(r), on_unavailable);
        self.run(r, step);
    }

    /// The claim or take-over's answer is lost (or too late): release it owner-checked, leaving
    /// a tombstone (`http.rs` `release_lost_claim`).
    fn release_lost(&mut self, r: usize) {
        let t = Transition::release_lost(self.reqs[r].owner, &Lifetimes::of(&self.policy(r)));
        self.write("release", self.skey(r), t, None);
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
        let Phase::Calling { asked, sent, .. } = self.reqs[r].phase.clone() else { return };
        let policy = self.policy(r);
        let now = self.now;
        let answer = match (asked, reply) {
            (Asked::Claim, Ok(Reply::Claim(reply))) => StoreAnswer::Claim(reply),
            (Asked::Claim, Err(e)) => StoreAnswer::Claim(Err(e)),
            (Asked::TakeOver, Ok(Reply::Transition(t))) => StoreAnswer::TakeOver(Ok(t)),
            (Asked::TakeOver, Err(e)) => StoreAnswer::TakeOver(Err(e)),
            (Asked::Settled, Ok(Reply::Read(read))) => StoreAnswer::Settled(Ok(read)),
            (Asked::Settled, Err(e)) => StoreAnswer::Settled(Err(e)),
            (_, Ok(other)) => panic!("request {r} asked {asked:?}, answered {other:?}"),
        };
        let answered = request::after_store_answer(answer, &sent, &policy, self.on_unavailable(), now);
        match answered {
            Answered::Next(step) => self.run(r, step),
            // The model's store always holds its scripts.
            Answered::Resend => panic!("NOSCRIPT from the model store"),
            Answered::Lost { .. } => {
                self.release_lost(r);
                self.store_failed(r, sent.handle, self.on_unavailable());
            }
            Answered::TooLate { .. } => {
                self.release_lost(r);
                self.store_failed(r, sent.handle, OnUnavailable::Reject);
            }
        }
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

    /// The upstream treats forwarded request `r` so; the exchange is settled
    /// (`engine::settle` as `filter/settle.rs` carries it out).
    pub fn upstream(&mut self, r: usize, how: Upstream) {
        let Phase::Upstream(claim) = self.reqs[r].phase.clone() else { panic!("request {r} is not forwarded") };
        let policy = self.policy(r);
        let (outcome, response) = match how {
            Upstream::Answers => (Outcome::Store, Some(self.execute(r))),
            Upstream::Resets => {
                self.execute(r);
                (Outcome::Unknown(UnknownReason::UpstreamReset), None)
            }
            Upstream::NeverConnects => (Outcome::Release, None),
        };
        let now = self.now;
        let (machine, cmds) = settle::start(&claim, Some(&policy), true, outcome, response.clone(), false, "", now);
        let mut local = LocalAnswer::None;
        let mut writes = vec![];
        for c in cmds {
            if let Some(a) = self.settle_command(r, &claim, &policy, c, &mut writes) {
                local = a;
            }
        }
        let (cmds, _slug) = machine.finish(local);
        for c in cmds {
            self.settle_command(r, &claim, &policy, c, &mut writes);
        }
        for (what, t, fallback) in writes {
            self.write(what, claim.skey, t, fallback);
        }
        let answer = match (how, response) {
            (Upstream::Answers, Some(resp)) => Answer::Fresh { status: resp.status, body: resp.body },
            (Upstream::Resets, _) => Answer::Problem("upstream-reset"),
            _ => Answer::Problem("upstream-unreachable"),
        };
        self.done(r, answer);
    }

    fn settle_command(
        &mut self,
        r: usize,
        _claim: &Claim,
        policy: &Policy,
        c: Command<'_>,
        writes: &mut Vec<(&'static str, Transition, Option<Box<Transition>>)>,
    ) -> Option<LocalAnswer> {
        let now = self.now;
        let p = &mut self.proxies[self.reqs[r].proxy];
        match c {
            Command::Write { what, transition, fallback } => writes.push((what, *transition, fallback)),
            Command::Local(Local::Complete(h, record)) => {
                let done = p.table.complete(&mut p.sd, &h, *record, now).map_err(|e| format!("{e:?}"));
                return Some(LocalAnswer::Completed(done));
            }
            Command::Local(Local::Release(h)) => {
                return Some(LocalAnswer::Released(matches!(p.table.release(&mut p.sd, &h, now), Ok(true))));
            }
            Command::Local(Local::MarkUnknown(h, reason)) => {
                let _ = p.table.mark_unknown(&mut p.sd, &h, reason, now, policy);
                return Some(LocalAnswer::Marked);
            }
            Command::Count(_) | Command::Log(..) => {}
        }
        None
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
                match self.reqs[r].phase {
                    Phase::New => self.headers(r),
                    Phase::Body { .. } => self.body(r),
                    Phase::Upstream(_) => self.upstream(r, Upstream::Answers),
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
        self.reqs.iter().all(|q| matches!(q.phase, Phase::Done(_))) && self.pending_calls().is_empty()
    }
}

#[cfg(test)]
mod tests;
