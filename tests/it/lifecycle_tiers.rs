//! One lifecycle, three tiers: random event sequences (claims, take-overs, completions, releases,
//! outcome-unknown marks, locks going stale, lives ending; three owners on one key) driven through
//! the local tier (the real `local::Table` over a model of proxy-wasm shared data), through the
//! Redis store (the real Lua scripts run by a real Redis, with exactly the arguments
//! `store::claim_command` and `Transition::eval_command` build, the same as the webdis requests)
//! and through the etcd store (a real three-member etcd from Debian, sent exactly the requests
//! `etcd::claim_request`, `etcd::transition_request` and `etcd::where_absent_request` build, its
//! answers read by the `etcd::parse_*` the filter uses). After every event the tiers must agree
//! on what was accepted or refused and on the key's stage and owner.
//!
//! Time: the local tier takes explicit `now` values; the store judges by Redis's clock. No test
//! sleeps: "a lock goes stale" is the local clock moving on by the lock's life and, in Redis, the
//! value's lock expiry rewritten to 0 (`SETRANGE`, the key's `PX` untouched); "its life ends" is
//! the local clock moving past every life and, in Redis, the key deleted (what `PX` does). etcd is
//! judged by the proxy's clock (`etcd::judged_now`): the etcd tier keeps its own `now`, moved on
//! by the lock's life plus `CLOCK_SKEW_TOLERANCE_MS` when a lock goes stale; when a life ends its
//! keys (value, owner mark, tombstones) are deleted, what the end of their lease does. Lives
//! other than the lock's are long (1000 s), so nothing else expires within a sequence: the
//! expiries by `ttl` and `unknown_outcome` themselves are covered by unit tests (`local::tests`,
//! `store::tests`, `record::tests`) and by `tests/it/expiry.rs`.

use crate::support;

use idemgate::config::{Policy, StaleLock};
use idemgate::decision::{decide, Decision, Lookup};
use idemgate::etcd::{self, Fence};
use idemgate::fingerprint::Fingerprint;
use idemgate::lifecycle::Stage;
use idemgate::local::{Begin, Completed, Handle, SharedData, Table};
use idemgate::owner::OwnerToken;
use idemgate::record::{Creator, Lifetimes, Record, StoredResponse, UnknownReason};
use idemgate::scope::StorageKey;
use idemgate::store::{self, ClaimReply, ReadReply, StoredValue, Transition, TransitionReply};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::collections::HashMap;
use support::etcd::EtcdCluster;
use support::store::{resp::Value, Redis};

/// Shared data as Envoy implements it (the crate's one fake: `local::memory::MemoryShared`).
type Shared = idemgate::local::memory::MemoryShared;

#[derive(Clone, Copy, Debug)]
enum Ev {
    /// Owner `o` sends the request (the fingerprint known: claim, take-over, or an answer).
    Claim(u8),
    Complete(u8),
    Release(u8),
    MarkUnknown(u8),
    /// The current lock expires.
    LockPasses,
    /// Every life ends (the record is gone).
    LifeEnds,
}

fn event() -> impl Strategy<Value = Ev> {
    let o = 1u8..=3;
    prop_oneof![
        4 => o.clone().prop_map(Ev::Claim),
        2 => o.clone().prop_map(Ev::Complete),
        2 => o.clone().prop_map(Ev::Release),
        2 => o.prop_map(Ev::MarkUnknown),
        2 => Just(Ev::LockPasses),
        1 => Just(Ev::LifeEnds),
    ]
}

/// What a tier answered to an event.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Answer {
    Claimed,
    TookOver,
    MarkedUnknown,
    Replay,
    Refused(String),
    Accepted,
    NotAccepted,
    /// The store found the key absent and wrote the owner's completion or mark there.
    Rewritten,
}

const LOCK_MS: u64 = 10_000;
const FAR: u64 = 100_000_000;

fn policy(stale_lock: StaleLock) -> Policy {
    Policy { lock_ttl_seconds: 10, ttl_seconds: 1000, unknown_outcome_seconds: 1000, stale_lock, ..Policy::default() }
}

fn owner(o: u8) -> OwnerToken {
    OwnerToken([o; 16])
}

const FP: Fingerprint = Fingerprint([7; 32]);
const KEY: StorageKey = StorageKey([0x42; 32]);

fn creator(o: u8) -> Creator {
    Creator { request_id: format!("req-{o}"), log_values: vec![] }
}

fn response() -> StoredResponse {
    StoredResponse { status: 201, headers: vec![], body: b"{}".to_vec() }
}

struct Local {
    table: Table,
    sd: Shared,
    now: u64,
    handles: HashMap<u8, Handle>,
}

impl Local {
    fn new() -> Local {
        let table = Table::new(&idemgate::config::LocalConfig {
            max_entries: 64,
            max_bytes: 1 << 20,
            when_full: idemgate::config::WhenFull::Reject,
            min_protection_seconds: 0,
        });
        let mut sd = Shared::default();
        table.ensure_created(&mut sd).expect("table");
        Local { table, sd, now: 1_000_000_000, handles: HashMap::new() }
    }

    fn handle(&self, o: u8) -> Handle {
        self.handles.get(&o).copied().unwrap_or(Handle {
            bucket: self.table.bucket_of(&KEY),
            position: 0,
            owner: owner(o),
            skey: KEY,
        })
    }

    fn apply(&mut self, ev: Ev, p: &Policy) -> Answer {
        let now = self.now;
        // The handle the owner got when it claimed (or one naming the key's bucket, for an owner
        // that never claimed: the lifecycle refuses it as not the owner).
        let h = match ev {
            Ev::Complete(o) | Ev::Release(o) | Ev::MarkUnknown(o) => self.handle(o),
            _ => self.handle(0),
        };
        match ev {
            Ev::Claim(o) => match self.table.begin(&mut self.sd, KEY, Some(FP), now, p, owner(o), &creator(o)).unwrap()
            {
                Begin::Claimed { handle, took_over, .. } => {
                    self.handles.insert(o, handle);
                    if took_over {
                        Answer::TookOver
                    } else {
                        Answer::Claimed
                    }
                }
                Begin::Replay(_) => Answer::Replay,
                Begin::Reject { marked_unknown: true, .. } => Answer::MarkedUnknown,
                Begin::Reject { problem, .. } => Answer::Refused(format!("{problem:?}")),
                other => Answer::Refused(format!("{other:?}")),
            },
            Ev::Complete(o) => {
                let r = Record::completed(FP, response(), false, creator(o), now, p.ttl_seconds);
                match self.table.complete(&mut self.sd, &h, r, now).unwrap() {
                    Completed::Stored => Answer::Accepted,
                    _ => Answer::NotAccepted,
                }
            }
            Ev::Release(_) => accepted(self.table.release(&mut self.sd, &h, now).unwrap()),
            Ev::MarkUnknown(_) => {
                accepted(self.table.mark_unknown(&mut self.sd, &h, UnknownReason::Other, now, p).unwrap())
            }
            Ev::LockPasses => {
                self.now += LOCK_MS;
                Answer::Accepted
            }
            Ev::LifeEnds => {
                self.now += FAR;
                Answer::Accepted
            }
        }
    }

    /// The key's stage and, for a live record, its owner.
    fn state(&mut self) -> (Stage, Option<OwnerToken>) {
        let Some(peeked) = self.table.peek(&mut self.sd, &KEY, self.now).unwrap() else { return (Stage::Absent, None) };
        let name = self.table.bucket_name(self.table.bucket_of(&KEY));
        let bytes = self.sd.get(&name).unwrap().0.expect("bucket");
        let bucket = idemgate::local::Bucket::decode(&bytes).expect("bucket decodes");
        let owners: Vec<OwnerToken> =
            bucket.positions.iter().flatten().filter(|e| e.skey == KEY).map(|e| e.owner).collect();
        assert_eq!(owners.len(), 1, "one entry for the key: {owners:?}");
        (peeked.summary.stage(), owners.first().copied())
    }
}

fn accepted(yes: bool) -> Answer {
    if yes {
        Answer::Accepted
    } else {
        Answer::NotAccepted
    }
}

struct StoreTier<'a> {
    redis: &'a Redis,
}

/// The transition script's code from its answer `{code, new owner hex}`, its echo checked.
fn code(answer: Value, t: &Transition) -> Value {
    match answer {
        Value::Array(Some(items)) if items.len() == 2 => {
            assert_eq!(items[1], Value::Bulk(Some(t.new_owner.hex().into_bytes())), "the echo of the new owner");
            items[0].clone()
        }
        other => other,
    }
}

fn bulk_u64(v: Option<&Value>) -> u64 {
    match v {
        Some(Value::Bulk(Some(b))) => std::str::from_utf8(b).unwrap().parse().unwrap(),
        other => panic!("not a number: {other:?}"),
    }
}

impl StoreTier<'_> {
    fn eval(&self, cmd: Vec<Vec<u8>>) -> Value {
        let args: Vec<&[u8]> = cmd.iter().map(Vec::as_slice).collect();
        self.redis.command(&args)
    }

    fn transition(&self, t: Transition) -> bool {
        match code(self.eval(t.eval_command(&KEY, &support::record_seal())), &t) {
            Value::Int(1) => true,
            Value::Int(0) => false,
            other => panic!("transition answered {other:?}"),
        }
    }

    /// An owner's completion or outcome-unknown mark: `Accepted`, `NotAccepted`, or `Rewritten`
    /// where the key was absent and the script wrote it anyway (answer 2).
    fn owner_write(&self, t: Transition) -> Answer {
        match code(self.eval(t.eval_command(&KEY, &support::record_seal())), &t) {
            Value::Int(1) => Answer::Accepted,
            Value::Int(0) => Answer::NotAccepted,
            Value::Int(2) => Answer::Rewritten,
            other => panic!("transition answered {other:?}"),
        }
    }

    fn redis_key(&self) -> Vec<u8> {
        store::redis_key(&KEY).into_bytes()
    }

    /// What the filter does with a request whose body is complete: claim-or-read, then decide on
    /// the value by Redis's clock and send the take-over or stale-to-unknown it chose.
    fn apply(&self, ev: Ev, p: &Policy) -> Answer {
        let lifetimes = Lifetimes::of(p);
        match ev {
            Ev::Claim(o) => {
                let record = Record::in_progress(FP, creator(o), owner(o), 0, &lifetimes);
                let items = match self.eval(store::claim_command(
                    &KEY,
                    &owner(o),
                    &record,
                    &lifetimes,
                    &support::record_seal(),
                )) {
                    Value::Array(Some(items)) => items,
                    other => panic!("claim answered {other:?}"),
                };
                match items.first() {
                    Some(Value::Bulk(Some(b))) if b == b"1" => return Answer::Claimed,
                    Some(Value::Bulk(Some(b))) if b == b"0" => {}
                    other => panic!("claim answered {other:?}"),
                }
                let now = bulk_u64(items.get(1));
                let value = match items.get(2) {
                    Some(Value::Bulk(Some(v))) => {
                        StoredValue::open(v, &KEY, &support::record_seal()).expect("value decodes")
                    }
                    other => panic!("claim value {other:?}"),
                };
                let pttl = bulk_u64(items.get(3));
                let summary = value.summary(now + pttl);
                match decide(Lookup::Found(summary), Some(&FP), now, p, idemgate::config::OnUnavailable::Reject) {
                    Decision::Claim | Decision::TakeOver => {
                        let free = matches!(
                            decide(Lookup::Found(summary), Some(&FP), now, p, idemgate::config::OnUnavailable::Reject),
                            Decision::Claim
                        );
                        let t = Transition::take_over(value.owner, owner(o), record, free, &lifetimes);
                        match (self.transition(t), free) {
                            (true, true) => Answer::Claimed,
                            (true, false) => Answer::TookOver,
                            (false, _) => Answer::Refused("take-over lost".into()),
                        }
                    }
                    Decision::MarkUnknown => {
                        if self.transition(Transition::stale_to_unknown(value.owner, &lifetimes)) {
                            Answer::MarkedUnknown
                        } else {
                            Answer::Refused("stale-to-unknown lost".into())
                        }
                    }
                    Decision::Replay => Answer::Replay,
                    Decision::Reject(problem) => Answer::Refused(format!("{problem:?}")),
                    other => Answer::Refused(format!("{other:?}")),
                }
            }
            Ev::Complete(o) => {
                let r = Record::completed(FP, response(), false, creator(o), 0, p.ttl_seconds);
                self.owner_write(Transition::complete(owner(o), r, &lifetimes))
            }
            Ev::Release(o) => accepted(self.transition(Transition::release(owner(o)))),
            Ev::MarkUnknown(o) => {
                let gone = Record::unknown(FP, creator(o), UnknownReason::Other, 0, &lifetimes);
                self.owner_write(Transition::unknown(owner(o), gone, &lifetimes))
            }
            Ev::LockPasses => {
                // The value's lock expiry (bytes 37..52 of `IGS1<phase><owner hex><lock>`) set in
                // the past of Redis's clock; its PX is untouched.
                if self.redis.get_raw(self.redis_key()).is_some_and(|v| v.get(4) == Some(&b'P')) {
                    let r = self.redis.command(&[b"SETRANGE", &self.redis_key(), b"37", b"000000000000000"]);
                    assert!(matches!(r, Value::Int(_)), "{r:?}");
                }
                Answer::Accepted
            }
            Ev::LifeEnds => {
                self.redis.command(&[b"DEL", &self.redis_key()]);
                Answer::Accepted
            }
        }
    }

    fn state(&self) -> (Stage, Option<OwnerToken>) {
        match self.redis.get_raw(self.redis_key()) {
            None => (Stage::Absent, None),
            Some(v) if v.starts_with(b"IGS1R") => (Stage::Absent, None),
            Some(v) => {
                let value = StoredValue::open(&v, &KEY, &support::record_seal()).expect("value decodes");
                (value.phase, Some(value.owner))
            }
        }
    }
}

/// The etcd store, driven as the filter drives it (`filter::stores` and the take-over,
/// stale-to-unknown and where-absent steps of the glue).
struct EtcdTier<'a> {
    etcd: &'a EtcdCluster,
    lease: i64,
    now: std::cell::Cell<u64>,
}

impl<'a> EtcdTier<'a> {
    fn new(etcd: &'a EtcdCluster) -> EtcdTier<'a> {
        let ttl = 3600;
        let r = etcd::lease_grant_request(ttl);
        let (status, body) = Self::send_to(etcd, &r);
        let lease = etcd::parse_lease_grant(status, &body, ttl).expect("lease granted");
        EtcdTier { etcd, lease, now: std::cell::Cell::new(1_000_000_000) }
    }

    fn send_to(etcd: &EtcdCluster, r: &store::StoreRequest) -> (Option<u16>, Vec<u8>) {
        let port = etcd.members[0].client_port;
        let a = support::http::request(port, r.method, &r.path, &[], &r.body).expect("etcd answers");
        (Some(a.status), a.body)
    }

    fn send(&self, r: &store::StoreRequest) -> (Option<u16>, Vec<u8>) {
        Self::send_to(self.etcd, r)
    }

    /// Deletes every key of the store's prefix (values, owner marks, tombstones).
    fn clear(&self) {
        let prefix = etcd::KEY_PREFIX.as_bytes();
        let mut end = prefix.to_vec();
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        let b64 = idemgate::base64::b64;
        let q = format!(r#"{{"key":"{}","range_end":"{}"}}"#, b64(prefix), b64(&end));
        let a =
            support::http::request(self.etcd.members[0].client_port, "POST", "/v3/kv/deleterange", &[], q.as_bytes())
                .expect("etcd answers");
        assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    }

    /// A transition as the filter sends it; a where-absent write's second transaction follows an
    /// `Absent` answer.
    fn transition(&self, t: &Transition, fence: Option<&Fence>, echo: Option<&OwnerToken>) -> TransitionReply {
        let now = self.now.get();
        let seal = support::record_seal();
        let r = etcd::transition_request(t, &KEY, &seal, self.lease, now, fence).expect("request built");
        let (status, body) = self.send(&r);
        let reply = etcd::parse_transition_reply(status, &body, echo.map(|o| (&KEY, Stage::Forwarded, o)))
            .expect("transition answer parses");
        if reply != TransitionReply::Absent {
            return reply;
        }
        let r = etcd::where_absent_request(t, &KEY, &seal, self.lease, now).expect("where-absent built");
        let (status, body) = self.send(&r);
        etcd::parse_where_absent_reply(status, &body).expect("where-absent answer parses")
    }

    fn changed(reply: TransitionReply) -> Answer {
        match reply {
            TransitionReply::Changed => Answer::Accepted,
            TransitionReply::Refused => Answer::NotAccepted,
            TransitionReply::ClaimGoneRewritten => Answer::Rewritten,
            other => panic!("etcd transition answered {other:?}"),
        }
    }

    fn apply(&self, ev: Ev, p: &Policy) -> Answer {
        let lifetimes = Lifetimes::of(p);
        let now = self.now.get();
        let seal = support::record_seal();
        match ev {
            Ev::Claim(o) => {
                let record = Record::in_progress(FP, creator(o), owner(o), now, &lifetimes);
                let r = etcd::claim_request(&KEY, &owner(o), &record, &lifetimes, &seal, self.lease, now);
                let (status, body) = self.send(&r);
                let (reply, fence) =
                    etcd::parse_claim_reply(status, &body, &owner(o), &KEY, &seal, now).expect("claim answer parses");
                let (now_ms, summary, value) = match reply {
                    ClaimReply::Claimed { .. } => return Answer::Claimed,
                    ClaimReply::Exists { now_ms, expires_at_ms, value } => {
                        (now_ms, value.summary(expires_at_ms), value)
                    }
                    other => panic!("etcd claim answered {other:?}"),
                };
                let decision =
                    decide(Lookup::Found(summary), Some(&FP), now_ms, p, idemgate::config::OnUnavailable::Reject);
                match decision {
                    Decision::Claim | Decision::TakeOver => {
                        let free = matches!(decision, Decision::Claim);
                        let t = Transition::take_over(value.owner, owner(o), record, free, &lifetimes);
                        match (self.transition(&t, fence.as_ref(), Some(&owner(o))), free) {
                            (TransitionReply::Changed, true) => Answer::Claimed,
                            (TransitionReply::Changed, false) => Answer::TookOver,
                            (TransitionReply::Refused, _) => Answer::Refused("take-over lost".into()),
                            (other, _) => panic!("etcd take-over answered {other:?}"),
                        }
                    }
                    Decision::MarkUnknown => {
                        let t = Transition::stale_to_unknown(value.owner, &lifetimes);
                        match self.transition(&t, fence.as_ref(), None) {
                            TransitionReply::Changed => Answer::MarkedUnknown,
                            TransitionReply::Refused => Answer::Refused("stale-to-unknown lost".into()),
                            other => panic!("etcd stale-to-unknown answered {other:?}"),
                        }
                    }
                    Decision::Replay => Answer::Replay,
                    Decision::Reject(problem) => Answer::Refused(format!("{problem:?}")),
                    other => Answer::Refused(format!("{other:?}")),
                }
            }
            Ev::Complete(o) => {
                let r = Record::completed(FP, response(), false, creator(o), now, p.ttl_seconds);
                Self::changed(self.transition(&Transition::complete(owner(o), r, &lifetimes), None, None))
            }
            Ev::Release(o) => Self::changed(self.transition(&Transition::release(owner(o)), None, None)),
            Ev::MarkUnknown(o) => {
                let gone = Record::unknown(FP, creator(o), UnknownReason::Other, now, &lifetimes);
                Self::changed(self.transition(&Transition::unknown(owner(o), gone, &lifetimes), None, None))
            }
            Ev::LockPasses => {
                self.now.set(now + LOCK_MS + etcd::CLOCK_SKEW_TOLERANCE_MS);
                Answer::Accepted
            }
            Ev::LifeEnds => {
                self.clear();
                self.now.set(now + FAR);
                Answer::Accepted
            }
        }
    }

    fn state(&self) -> (Stage, Option<OwnerToken>) {
        let (status, body) = self.send(&etcd::read_request(&KEY));
        match etcd::parse_read_reply(status, &body, &KEY, &support::record_seal(), self.now.get())
            .expect("read answer parses")
        {
            ReadReply::Absent => (Stage::Absent, None),
            ReadReply::Found(value) => (value.phase, Some(value.owner)),
            ReadReply::Unreadable(e) => panic!("etcd value unreadable: {e:?}"),
        }
    }
}

#[test]
fn both_tiers_follow_the_same_lifecycle_for_random_event_sequences() {
    let redis = Redis::start();
    let store_tier = StoreTier { redis: &redis };
    let cluster = EtcdCluster::start();
    let etcd_tier = EtcdTier::new(&cluster);
    let mut runner = TestRunner::new(Config { cases: 200, failure_persistence: None, ..Config::default() });
    let strategy = (proptest::collection::vec(event(), 1..=12), any::<bool>());
    let transitions = std::cell::RefCell::new(HashMap::<String, u32>::new());
    let result = runner.run(&strategy, |(events, takeover)| {
        let p = policy(if takeover { StaleLock::Takeover } else { StaleLock::Reject });
        redis.command(&[b"DEL", &store_tier.redis_key()]);
        etcd_tier.clear();
        let mut local = Local::new();
        for (n, ev) in events.iter().enumerate() {
            let before = local.state().0;
            let a = local.apply(*ev, &p);
            let b = store_tier.apply(*ev, &p);
            let c = etcd_tier.apply(*ev, &p);
            // The two stores agree with each other everywhere.
            prop_assert_eq!(&b, &c, "Redis and etcd answers differ at event {} {:?} of {:?}", n, ev, events);
            // Where the tiers differ on purpose: a completion or outcome-unknown mark that finds
            // the key absent is refused by the local tier (it loses a live entry only by its own
            // expiry, after which the owner may no longer move it) but written by the store, which
            // can lose a live key (`lifecycle::store_writes_where_absent`). The store must then
            // hold the owner's record; the key is deleted again so both tiers go on from absent.
            if let (Stage::Absent, Ev::Complete(o) | Ev::MarkUnknown(o)) = (before, ev) {
                prop_assert_eq!(&a, &Answer::NotAccepted, "local tier at event {} {:?} of {:?}", n, ev, events);
                prop_assert_eq!(&b, &Answer::Rewritten, "store tier at event {} {:?} of {:?}", n, ev, events);
                let stage = if matches!(ev, Ev::Complete(_)) { Stage::Completed } else { Stage::Unknown };
                prop_assert_eq!(store_tier.state(), (stage, Some(owner(*o))), "store after event {} {:?}", n, ev);
                prop_assert_eq!(etcd_tier.state(), (stage, Some(owner(*o))), "etcd after event {} {:?}", n, ev);
                prop_assert_eq!(local.state(), (Stage::Absent, None));
                *transitions.borrow_mut().entry(format!("Absent --{ev:?}/store {b:?}--> {stage:?}")).or_default() += 1;
                redis.command(&[b"DEL", &store_tier.redis_key()]);
                etcd_tier.clear();
                continue;
            }
            prop_assert_eq!(&a, &b, "answers differ at event {} {:?} of {:?}", n, ev, events);
            let (sa, sb) = (local.state(), store_tier.state());
            prop_assert_eq!(sa, sb, "states differ after event {} {:?} of {:?}", n, ev, events);
            prop_assert_eq!(sa, etcd_tier.state(), "etcd's state differs after event {} {:?} of {:?}", n, ev, events);
            *transitions.borrow_mut().entry(format!("{before:?} --{ev:?}/{a:?}--> {:?}", sa.0)).or_default() += 1;
        }
        Ok::<(), TestCaseError>(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    // The sequences reach every stage and the transitions between them that matter.
    let transitions = transitions.into_inner();
    let total: u32 = transitions.values().sum();
    eprintln!("{total} events in 200 sequences, {} distinct transitions", transitions.len());
    assert!(total >= 200, "{total} events");
    let seen = |what: &str| transitions.keys().any(|k| k.contains(what));
    for what in [
        "Absent --Claim",
        "--> Completed",
        "--> Unknown",
        "/TookOver",
        "/MarkedUnknown",
        "/Replay",
        "Forwarded --Release",
        "Completed --Release",
        "Unknown --Complete",
        "/store Rewritten--> Completed",
        "/store Rewritten--> Unknown",
    ] {
        assert!(seen(what), "no sequence covered {what}: {:#?}", transitions.keys().collect::<Vec<_>>());
    }
}

/// Issue 40: two proxies race on an MCP call's awaiting record (a round answered
/// `input_required`: `State::AwaitingInput`, a completed stage), each with a copy of the call's
/// next round: both read the awaiting value and decide to continue it (`Record::round`: `Next`),
/// then each sends its continuation (`Transition::continue_round`, as the filter sends it after
/// `request::after_claim`'s `Step::Continue`). Exactly one lands in each tier (Redis's script
/// checks the owner and phase read; etcd compares the revision read); the key is then that
/// round's claim in flight, which a re-sent asking round and the losing copy meet as such. In
/// the local tier (`local::Table::continue_round`, one bucket CAS) the second finds the claim.
#[test]
fn two_copies_of_a_next_round_continue_an_awaiting_call_once_in_every_tier() {
    use idemgate::record::{Awaiting, Round, RoundId, State};
    let p = policy(StaleLock::Reject);
    let lifetimes = Lifetimes::of(&p);
    let asked = RoundId { digest: [1u8; 32], state: None };
    let next = RoundId { digest: [2u8; 32], state: None };
    let awaiting = |now: u64| Record {
        state: State::AwaitingInput(Box::new(Awaiting::new(asked.digest, vec![], response()))),
        ..Record::completed(FP, response(), false, creator(1), now, p.ttl_seconds)
    };
    let continuation = |o: u8, from: &StoredValue, now: u64| {
        assert_eq!(from.record.round(Some(&next)), Round::Next, "the next round continues");
        assert_eq!(from.record.round(Some(&asked)), Round::Asked, "the asking round is replayed");
        let record = Record::in_progress(FP, creator(o), owner(o), now, &lifetimes);
        Transition::continue_round(from.owner, owner(o), record, &lifetimes)
    };

    // Redis: the real script, as webdis runs it.
    let redis = Redis::start();
    let s = StoreTier { redis: &redis };
    assert_eq!(s.apply(Ev::Claim(1), &p), Answer::Claimed);
    assert_eq!(s.owner_write(Transition::complete(owner(1), awaiting(0), &lifetimes)), Answer::Accepted);
    let read = || {
        let v = redis.get_raw(s.redis_key()).expect("the awaiting value");
        StoredValue::open(&v, &KEY, &support::record_seal()).expect("value decodes")
    };
    let (seen2, seen3) = (read(), read());
    assert_eq!(seen2.phase, Stage::Completed);
    assert!(s.transition(continuation(2, &seen2, 0)), "the first continuation lands");
    assert!(!s.transition(continuation(3, &seen3, 0)), "Redis: the second copy continued the call again");
    assert_eq!(s.state(), (Stage::Forwarded, Some(owner(2))));
    assert_eq!(s.apply(Ev::Claim(4), &p), Answer::Refused("InFlight { retry_after_seconds: 1 }".into()));

    // etcd: three members, each continuation fenced by the value its claim-or-read found.
    let cluster = EtcdCluster::start();
    let e = EtcdTier::new(&cluster);
    assert_eq!(e.apply(Ev::Claim(1), &p), Answer::Claimed);
    let now = e.now.get();
    assert_eq!(
        EtcdTier::changed(e.transition(&Transition::complete(owner(1), awaiting(now), &lifetimes), None, None)),
        Answer::Accepted
    );
    let seal = support::record_seal();
    let read = |o: u8| {
        let record = Record::in_progress(FP, creator(o), owner(o), now, &lifetimes);
        let r = etcd::claim_request(&KEY, &owner(o), &record, &lifetimes, &seal, e.lease, now);
        let (status, body) = e.send(&r);
        match etcd::parse_claim_reply(status, &body, &owner(o), &KEY, &seal, now).expect("claim answer parses") {
            (ClaimReply::Exists { value, .. }, Some(fence)) => (value, fence),
            other => panic!("etcd claim-or-read answered {other:?}"),
        }
    };
    let ((seen2, fence2), (seen3, fence3)) = (read(2), read(3));
    let first = e.transition(&continuation(2, &seen2, now), Some(&fence2), Some(&owner(2)));
    assert_eq!(first, TransitionReply::Changed, "the first continuation lands");
    let second = e.transition(&continuation(3, &seen3, now), Some(&fence3), Some(&owner(3)));
    assert_eq!(second, TransitionReply::Refused, "etcd: the second copy continued the call again");
    assert_eq!(e.state(), (Stage::Forwarded, Some(owner(2))));

    // The local tier: one CAS of the bucket.
    let mut l = Local::new();
    assert_eq!(l.apply(Ev::Claim(1), &p), Answer::Claimed);
    let h = l.handle(1);
    let now = l.now;
    assert!(matches!(l.table.complete(&mut l.sd, &h, awaiting(now), now).unwrap(), Completed::Stored));
    let cont = |l: &mut Local, o: u8, round: &RoundId| {
        let now = l.now;
        l.table.continue_round(&mut l.sd, KEY, FP, round, now, &p, owner(o), &creator(o)).unwrap()
    };
    assert!(cont(&mut l, 4, &asked).is_none(), "the asking round never continues the call");
    assert!(cont(&mut l, 2, &next).is_some(), "the first continuation lands");
    assert!(cont(&mut l, 3, &next).is_none(), "local: the second copy continued the call again");
    assert_eq!(l.state(), (Stage::Forwarded, Some(owner(2))));
}
