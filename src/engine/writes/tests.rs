//! The write machine driven in memory: a clock the test moves, the root's 100 ms tick, and
//! callouts answered, refused, lost (answered with no status at their timeout) or delayed.

use super::*;
use crate::fingerprint::Fingerprint;
use crate::owner::OwnerToken;
use crate::record::Stage;
use crate::record::{Creator, Lifetimes, Record, StoredResponse, UnknownReason};
use crate::store::write_window_ms;
use std::collections::BTreeMap;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// The store's `timeout_ms` (unless a test sets its own): a lost callout is answered (with no
/// status) this long after it was sent.
const TIMEOUT_MS: u64 = 250;
/// The root's tick.
const TICK_MS: u64 = 100;
const NOSCRIPT: &[u8] = b"-NOSCRIPT No matching script. Please use EVAL.\r\n";
/// The transition script's answers (`{code, new owner hex}`; an owner's write checks no echo).
const CHANGED: &[u8] = b"*2\r\n:1\r\n$32\r\n00000000000000000000000000000000\r\n";
const REFUSED: &[u8] = b"*2\r\n:0\r\n$32\r\n00000000000000000000000000000000\r\n";
const CLAIM_GONE: &[u8] = b"*2\r\n:2\r\n$32\r\n00000000000000000000000000000000\r\n";

fn seal() -> Seal {
    Seal::new(Some("engine-writes-tests-record-key-0123456789abcdef"), None).unwrap()
}

fn lifetimes() -> Lifetimes {
    Lifetimes { ttl_ms: 60_000, lock_ms: 10_000, unknown_ms: 30_000, tombstone_ms: 0 }
}

fn creator() -> Creator {
    Creator { request_id: "r1".into(), log_values: vec![] }
}

/// A completion of key `n` with its outcome-unknown fallback, as `Shared::push_write` makes it.
fn completion(n: u8) -> Job {
    let (skey, owner) = (StorageKey([n; 32]), OwnerToken([n; 16]));
    let resp = StoredResponse { status: 201, headers: vec![], body: b"paid".to_vec() };
    let done = Record::completed(Fingerprint([1; 32]), resp, false, creator(), 1, 60);
    let gone = Record::unknown(Fingerprint([1; 32]), creator(), UnknownReason::StoreWriteFailed, 1, &lifetimes());
    let t = Transition::complete(owner, done, &lifetimes());
    let f = Transition::unknown(owner, gone, &lifetimes());
    let mut job = Job::build("complete", &skey, &t, None, Backend::Redis, &seal(), 0).unwrap();
    job.fallback = Some(Box::new(Job::build("unknown_fallback", &skey, &f, None, Backend::Redis, &seal(), 0).unwrap()));
    job
}

/// A release of key `n` (no fallback).
fn release(n: u8) -> Job {
    let t = Transition::release(OwnerToken([n; 16]));
    Job::build("release", &StorageKey([n; 32]), &t, None, Backend::Redis, &seal(), 0).unwrap()
}

/// What one request of a write was.
#[derive(Clone, Debug)]
struct Sent {
    what: &'static str,
    /// The stage it writes (`None`: it deletes the key).
    writes: Option<Stage>,
    at_ms: u64,
}

/// The root as the tests see it: the machine, a clock, and every action it took.
struct Sim {
    w: Writes,
    now: u64,
    timeout_ms: u64,
    seal: Seal,
    /// Requests sent and not answered yet, by write.
    outstanding: BTreeMap<WriteId, Sent>,
    /// Every request sent, by write.
    sent: BTreeMap<WriteId, Vec<Sent>>,
    notes: Vec<(WriteId, Note)>,
    ended: usize,
    stops: Vec<(u64, usize)>,
    /// The next send is refused by the host.
    refuse_next_send: bool,
    /// When the root was asked to stop.
    asked_to_stop_at: Option<u64>,
}

impl Sim {
    fn new() -> Sim {
        Sim {
            w: Writes::default(),
            now: 1_000,
            timeout_ms: TIMEOUT_MS,
            seal: seal(),
            outstanding: BTreeMap::new(),
            sent: BTreeMap::new(),
            notes: vec![],
            ended: 0,
            stops: vec![],
            refuse_next_send: false,
            asked_to_stop_at: None,
        }
    }

    fn push(&mut self, job: Job) -> WriteId {
        let id = self.w.push(job);
        self.run();
        id
    }

    /// Carries out the machine's actions as the glue does.
    fn run(&mut self) {
        while let Some(a) = self.w.poll() {
            match a {
                Action::Send(id) => {
                    let job = self.w.in_flight.get(&id).expect("a write sent is in flight");
                    let writes = job.source.as_ref().and_then(|s| s.transition.new_phase);
                    let sent = Sent { what: job.what, writes, at_ms: self.now };
                    assert!(
                        !self.outstanding.contains_key(&id),
                        "write {id} sent a second request while one is in flight: {:?}",
                        self.sent.get(&id)
                    );
                    self.sent.entry(id).or_default().push(sent.clone());
                    if std::mem::take(&mut self.refuse_next_send) {
                        let now = self.now;
                        self.w.not_sent(id, "refused by the host", &move || now);
                    } else {
                        self.outstanding.insert(id, sent);
                    }
                }
                Action::Note { id, note, .. } => self.notes.push((id, note)),
                Action::Ended => {
                    self.ended += 1;
                    if self.w.stopping() {
                        self.w.stop_if_drained(0, self.now);
                    }
                }
                Action::Stop { pending } => self.stops.push((self.now, pending)),
            }
        }
    }

    fn answer(&mut self, id: WriteId, status: Option<u16>, body: &[u8]) {
        assert!(self.outstanding.remove(&id).is_some(), "write {id} answered with nothing in flight");
        let now = self.now;
        let writer = move || (now, Backend::Redis);
        let b = Builder { store: Backend::Redis, seal: Some(&self.seal), writer: &writer };
        self.w.answered(id, status, body, &b);
        self.run();
    }

    /// Moves the clock by `ms`, one tick at a time; a callout unanswered at its timeout is
    /// answered with no status then (the host's "lost").
    fn advance(&mut self, ms: u64) {
        let until = self.now + ms;
        while self.now < until {
            let step = (until - self.now).min(TICK_MS);
            let next = self.now + step;
            // Timeouts falling within this step, in order.
            loop {
                let due = self
                    .outstanding
                    .iter()
                    .map(|(id, s)| (s.at_ms + self.timeout_ms, *id))
                    .filter(|(at, _)| *at <= next)
                    .min();
                let Some((at, id)) = due else { break };
                self.now = self.now.max(at);
                self.answer(id, None, b"");
            }
            self.now = next;
            self.tick();
        }
    }

    fn tick(&mut self) {
        if self.w.next_retry_ms().is_some() {
            self.w.tick(self.now);
            self.run();
        }
        self.w.stop_if_drained(0, self.now);
        self.run();
    }

    fn stop(&mut self) -> bool {
        self.asked_to_stop_at = Some(self.now);
        self.w.stop(0, self.now)
    }

    fn only_outstanding(&self) -> WriteId {
        assert_eq!(self.outstanding.len(), 1, "{:?}", self.outstanding);
        *self.outstanding.keys().next().unwrap()
    }

    fn whats(&self, id: WriteId) -> Vec<&'static str> {
        self.sent.get(&id).map(|v| v.iter().map(|s| s.what).collect()).unwrap_or_default()
    }
}

#[test]
fn a_write_answered_changed_lands_and_ends_once() {
    let mut sim = Sim::new();
    let id = sim.push(completion(1));
    assert_eq!(sim.w.pending(), 1);
    sim.answer(id, Some(200), CHANGED);
    assert_eq!((sim.ended, sim.w.pending()), (1, 0));
    assert_eq!(sim.notes, vec![(id, Note::Landed)]);
    sim.advance(30_000);
    assert_eq!(sim.whats(id), vec!["complete"], "nothing is sent after a write landed");
}

#[test]
fn a_write_whose_callouts_are_all_lost_is_retried_on_the_schedule_then_marked_unknown_never_released() {
    let mut sim = Sim::new();
    let id = sim.push(completion(1));
    let start = sim.now;
    sim.advance(write_window_ms(TIMEOUT_MS));
    let sent = sim.sent[&id].clone();
    let whats: Vec<_> = sent.iter().map(|s| s.what).collect();
    let n = usize::from(MAX_WRITE_ATTEMPTS);
    assert_eq!(whats.len(), 2 * n, "{whats:?}");
    assert!(whats[..n].iter().all(|w| *w == "complete") && whats[n..].iter().all(|w| *w == "unknown_fallback"));
    assert!(sent.iter().all(|s| s.writes.is_some()), "no request of a failed completion deletes its key");
    assert_eq!(sent[n].writes, Some(Stage::Unknown), "the fallback marks the outcome unknown");
    // Each retry waits its backoff (after the lost attempt's timeout), at most one tick late.
    for k in 1..n {
        let gap = sent[k].at_ms - sent[k - 1].at_ms;
        let backoff = retry_delay_ms(k as u8);
        assert!(gap >= TIMEOUT_MS + backoff && gap <= TIMEOUT_MS + backoff + TICK_MS, "attempt {k}: {gap} ms");
    }
    assert!(sent.last().unwrap().at_ms - start <= write_window_ms(TIMEOUT_MS));
    assert_eq!((sim.ended, sim.w.pending()), (1, 0), "given up once the fallback failed too");
    let failed: Vec<_> = sim.notes.iter().filter(|(_, n)| matches!(n, Note::Failed { .. })).collect();
    assert_eq!(failed.len(), 2);
    assert!(matches!(&failed[0].1, Note::Failed { fallback: true, attempts: 7, .. }));
    assert!(matches!(&failed[1].1, Note::Failed { fallback: false, .. }));
}

#[test]
fn a_retry_that_lands_ends_the_write_without_its_fallback() {
    let mut sim = Sim::new();
    let id = sim.push(completion(1));
    sim.answer(id, Some(503), b"");
    // The first retry goes at once; answered changed.
    let again = sim.only_outstanding();
    assert_eq!(again, id);
    sim.answer(id, Some(200), CHANGED);
    sim.advance(30_000);
    assert_eq!(sim.whats(id), vec!["complete", "complete"]);
    assert_eq!(sim.ended, 1);
}

#[test]
fn a_send_the_host_refuses_is_a_failed_attempt() {
    let mut sim = Sim::new();
    sim.refuse_next_send = true;
    let id = sim.push(completion(1));
    // Refused, then retried at once (the first retry has no backoff) and in flight.
    assert_eq!(sim.whats(id), vec!["complete", "complete"]);
    assert_eq!(sim.only_outstanding(), id);
    assert!(matches!(sim.notes[0].1, Note::Retry { delay_ms: 0, .. }));
}

#[test]
fn noscript_sends_the_same_write_with_its_script_as_the_same_attempt() {
    let mut sim = Sim::new();
    let id = sim.push(completion(1));
    sim.answer(id, Some(200), NOSCRIPT);
    assert_eq!(sim.notes, vec![(id, Note::ScriptLoad)]);
    assert_eq!(sim.w.in_flight[&id].attempts, 0, "a NOSCRIPT is no failure");
    assert!(sim.w.in_flight[&id].request.by_sha1.is_none(), "sent with its script in full");
    // Answered NOSCRIPT again, the write carrying its script has failed an attempt.
    sim.answer(id, Some(200), NOSCRIPT);
    assert!(matches!(sim.notes.last().unwrap().1, Note::Retry { .. }));
}

#[test]
fn a_completion_refused_as_too_large_goes_again_without_its_body_keeping_its_fallback() {
    let mut sim = Sim::new();
    let id = sim.push(completion(1));
    sim.answer(id, Some(413), b"");
    assert_eq!(sim.whats(id), vec!["complete", "complete_without_body"]);
    let job = &sim.w.in_flight[&id];
    assert!(job.fallback.is_some(), "the smaller write keeps the outcome-unknown fallback");
    let record = job.source.as_ref().unwrap().transition.record.as_ref().unwrap();
    assert!(matches!(record.state, crate::record::State::CompletedTooLarge { status: 201, .. }));
    sim.answer(id, Some(200), CHANGED);
    assert_eq!(sim.ended, 1);
    let notes: Vec<_> = sim.notes.iter().map(|(_, n)| n.clone()).collect();
    assert_eq!(notes, vec![Note::TooLarge, Note::TooLargeWithoutBody, Note::Landed]);
}

#[test]
fn a_release_refused_as_too_large_is_given_up_at_once() {
    let mut sim = Sim::new();
    let id = sim.push(release(1));
    sim.answer(id, Some(413), b"");
    assert_eq!(sim.whats(id), vec!["release"], "retrying the same bytes cannot help");
    assert_eq!(sim.ended, 1);
    assert!(matches!(sim.notes.last().unwrap().1, Note::Failed { fallback: false, attempts: 7, .. }));
}

#[test]
fn a_refused_write_lands_the_claim_being_no_longer_ours() {
    let mut sim = Sim::new();
    let id = sim.push(completion(1));
    sim.answer(id, Some(200), REFUSED);
    let notes: Vec<_> = sim.notes.iter().map(|(_, n)| n.clone()).collect();
    assert_eq!(notes, vec![Note::NoLongerOurs, Note::Landed]);
    assert_eq!(sim.ended, 1);
}

#[test]
fn a_root_asked_to_stop_with_nothing_pending_stops_at_once() {
    let mut sim = Sim::new();
    assert!(sim.stop());
    assert!(!sim.w.stopping());
}

#[test]
fn a_stopping_root_stops_when_its_last_write_lands() {
    let mut sim = Sim::new();
    let a = sim.push(completion(1));
    let b = sim.push(completion(2));
    assert!(!sim.stop());
    sim.answer(a, Some(200), CHANGED);
    assert!(sim.stops.is_empty(), "one write still pending");
    sim.answer(b, Some(503), b"");
    assert!(sim.stops.is_empty(), "its retry still pending");
    sim.answer(b, Some(200), CHANGED);
    assert_eq!(sim.stops, vec![(sim.now, 0)]);
}

#[test]
fn a_stopping_root_stops_after_its_hold_with_writes_still_pending() {
    let mut sim = Sim::new();
    // Callouts lost after 1 s each: the write and its fallback take longer than the hold.
    sim.timeout_ms = 1_000;
    sim.push(completion(1));
    assert!(!sim.stop());
    let asked = sim.now;
    sim.advance(STOP_HOLD_MS + TICK_MS);
    assert_eq!(sim.stops.len(), 1);
    let (at, _) = sim.stops[0];
    assert!(at >= asked + STOP_HOLD_MS && at <= asked + STOP_HOLD_MS + TICK_MS, "stopped at {at}");
}

// Property tests: native only (proptest is not built for wasm32).
#[cfg(not(target_arch = "wasm32"))]
mod props {
    use super::*;
    use proptest::prelude::*;

    /// What the store does with one request.
    #[derive(Clone, Copy, Debug)]
    enum Reply {
        Changed,
        Refused,
        ClaimGone,
        NoScript,
        TooLarge,
        Error503,
        Garbled,
        /// Not answered now: answered lost at its timeout, or by a later step.
        Later,
    }

    fn reply() -> impl Strategy<Value = Reply> {
        prop_oneof![
            2 => Just(Reply::Changed),
            1 => Just(Reply::Refused),
            1 => Just(Reply::ClaimGone),
            1 => Just(Reply::NoScript),
            1 => Just(Reply::TooLarge),
            2 => Just(Reply::Error503),
            1 => Just(Reply::Garbled),
            3 => Just(Reply::Later),
        ]
    }

    /// One step of a schedule.
    #[derive(Clone, Debug)]
    enum Step {
        /// A new write of key `n` (a completion, or a release when `release`).
        Push { n: u8, release: bool },
        /// The host refuses the next send.
        RefuseNextSend,
        /// The `pick`-th outstanding callout is answered.
        Answer { pick: usize, reply: Reply },
        /// The clock moves.
        Advance(u64),
        /// The host asks the root to stop.
        Stop,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            2 => (0u8..6, any::<bool>()).prop_map(|(n, release)| Step::Push { n, release }),
            1 => Just(Step::RefuseNextSend),
            6 => (any::<usize>(), reply()).prop_map(|(pick, reply)| Step::Answer { pick, reply }),
            3 => (0u64..1_500).prop_map(Step::Advance),
            1 => Just(Step::Stop),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Over random schedules of writes, answers, losses, refusals, delays and a stop: one write
        /// never has two requests in flight; every write ends exactly once, within
        /// `write_window_ms` of its first request; a completion's requests never delete its key, and
        /// one never answered as landed ends only after its outcome-unknown fallback was sent; the
        /// stopping root stops only once no write is pending, or its hold has passed.
        #[test]
        fn random_schedules_keep_the_write_rules(steps in proptest::collection::vec(step(), 1..120)) {
            let mut sim = Sim::new();
            let mut pushed: BTreeMap<WriteId, bool> = BTreeMap::new();
            // Keys with a write not over yet (one write per key at a time, as one request makes one).
            let mut busy: BTreeMap<u8, WriteId> = BTreeMap::new();
            for s in steps {
                busy.retain(|_, id| sim.w.in_flight.contains_key(id) || sim.w.retries.iter().any(|(_, r, _)| r == id));
                match s {
                    Step::Push { n, release: r } => {
                        if busy.contains_key(&n) { continue; }
                        let id = sim.push(if r { release(n) } else { completion(n) });
                        pushed.insert(id, r);
                        busy.insert(n, id);
                    }
                    Step::RefuseNextSend => sim.refuse_next_send = true,
                    Step::Answer { pick, reply } => {
                        if sim.outstanding.is_empty() { continue; }
                        let id = *sim.outstanding.keys().nth(pick % sim.outstanding.len()).unwrap();
                        match reply {
                            Reply::Changed => sim.answer(id, Some(200), CHANGED),
                            Reply::Refused => sim.answer(id, Some(200), REFUSED),
                            Reply::ClaimGone => sim.answer(id, Some(200), CLAIM_GONE),
                            Reply::NoScript => sim.answer(id, Some(200), NOSCRIPT),
                            Reply::TooLarge => sim.answer(id, Some(413), b""),
                            Reply::Error503 => sim.answer(id, Some(503), b""),
                            Reply::Garbled => sim.answer(id, Some(200), b"?"),
                            Reply::Later => {}
                        }
                    }
                    Step::Advance(ms) => sim.advance(ms),
                    Step::Stop => {
                        if sim.asked_to_stop_at.is_none() && sim.stop() {
                            sim.stops.push((sim.now, 0));
                        }
                    }
                }
                prop_assert_eq!(sim.w.pending(), pushed.len() - sim.ended, "pending is the writes not over");
            }
            // The store goes silent: everything left is lost and retried to its end (bounded by count).
            for _ in 0..10_000 {
                if sim.w.pending() == 0 { break; }
                sim.advance(TICK_MS);
            }
            prop_assert_eq!(sim.w.pending(), 0);
            prop_assert_eq!(sim.ended, pushed.len(), "every write ends exactly once");
            let window = write_window_ms(TIMEOUT_MS);
            for (id, is_release) in &pushed {
                let sent = &sim.sent[id];
                let span = sent.last().unwrap().at_ms - sent[0].at_ms;
                prop_assert!(span <= window, "write {} sent for {} ms > {}", id, span, window);
                if !is_release {
                    prop_assert!(sent.iter().all(|s| s.writes.is_some()), "a completion's request deleted its key: {:?}", sent);
                    let landed = sim.notes.iter().any(|(w, n)| w == id && *n == Note::Landed);
                    if !landed {
                        prop_assert!(sent.iter().any(|s| s.what == "unknown_fallback"), "given up without marking the outcome unknown: {:?}", sent);
                    }
                }
            }
            prop_assert!(sim.stops.len() <= 1, "stopped twice: {:?}", sim.stops);
            if let (Some(asked), Some(&(at, pending))) = (sim.asked_to_stop_at, sim.stops.first()) {
                prop_assert!(pending == 0 || at >= asked + STOP_HOLD_MS, "stopped at {} with {} pending", at, pending);
            }
            if sim.asked_to_stop_at.is_some() {
                prop_assert_eq!(sim.stops.len(), 1, "a stopping root stops once its writes are over");
            }
        }
    }
}

/// A host that cannot hold its root past its end (the native build's configuration) hands its
/// writes to a live one: a write waiting for its retry keeps its time and its attempts, one in
/// flight goes again at once, and the adopting machine carries both to the end (the fallback
/// after the attempts left, never a release); the first machine has none left.
#[test]
fn writes_handed_over_keep_their_due_time_and_attempts_and_end_in_the_machine_that_adopted_them() {
    let mut old = Sim::new();
    let waiting = old.push(completion(1));
    old.answer(waiting, Some(503), b"");
    // The immediate first retry fails too: the write now waits for its backoff.
    old.answer(waiting, Some(503), b"");
    old.push(completion(2));
    let due = old.w.next_retry_ms().unwrap();
    assert!(due > old.now);
    let handed = old.w.hand_over(old.now);
    assert_eq!((old.w.pending(), old.w.next_retry_ms()), (0, None), "nothing left behind");
    assert_eq!(handed.iter().map(|(at, j)| (*at, j.attempts)).collect::<Vec<_>>(), vec![(due, 2), (old.now, 0)]);

    let mut new = Sim::new();
    new.now = old.now;
    let ids: Vec<WriteId> = handed.into_iter().map(|(at, job)| new.w.adopt(at, job)).collect();
    assert_eq!(new.w.pending(), 2);
    new.tick();
    // The one in flight goes at once; the waiting one only at its time.
    assert_eq!((new.whats(ids[0]), new.whats(ids[1])), (vec![], vec!["complete"]));
    new.answer(ids[1], Some(200), CHANGED);
    new.advance(due - new.now);
    assert_eq!(new.whats(ids[0]), vec!["complete"]);
    // Every attempt left fails: the fallback marks the outcome unknown after 7 in all.
    new.advance(write_window_ms(TIMEOUT_MS));
    let whats = new.whats(ids[0]);
    let n = usize::from(MAX_WRITE_ATTEMPTS);
    assert_eq!(whats.iter().filter(|w| **w == "complete").count(), n - 2, "{whats:?}");
    assert!(whats.iter().skip(n - 2).all(|w| *w == "unknown_fallback"), "{whats:?}");
    assert_eq!((new.ended, new.w.pending()), (2, 0));
    let sent = new.sent.values().flatten();
    assert!(sent.clone().all(|s| s.writes.is_some()), "no write handed over deletes its key");
}
