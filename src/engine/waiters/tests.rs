//! The waiters machine driven in memory: a clock the test moves, a local tier the test sets, and
//! store polls answered (absent, completed, garbled), lost, refused or left unanswered.

use super::*;
use crate::owner::OwnerToken;
use crate::record::Stage;
use crate::record::{Creator, State, StoredResponse};
use crate::store::StoredValue;
use std::collections::{BTreeMap, BTreeSet};
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const FP: Fingerprint = Fingerprint([7; 32]);
const OTHER: Fingerprint = Fingerprint([8; 32]);
const WAIT_MS: u64 = 2_000;
const TICK_MS: u64 = 100;

fn seal() -> Seal {
    Seal::new(Some("engine-waiters-tests-record-key-0123456789abcdef"), None).unwrap()
}

fn skey(n: u8) -> StorageKey {
    StorageKey([n; 32])
}

fn waiter(context_id: u32, key: u8, now: u64) -> Waiter {
    Waiter {
        context_id,
        skey: skey(key),
        fp: FP,
        request_id: format!("r{context_id}"),
        deadline_ms: now + WAIT_MS,
        since_ms: now,
        mismatch_status: 422,
        policy_index: 0,
        next_store_poll_ms: now,
        polling: false,
        accept_encoding: vec![],
        max_decoded_bytes: 1 << 20,
        tombstone_seconds: 0,
    }
}

fn completed(fp: Fingerprint) -> Record {
    Record {
        fingerprint: fp,
        created_at_ms: 0,
        expires_at_ms: u64::MAX,
        creator: Creator::default(),
        state: State::Completed(StoredResponse { status: 201, headers: vec![], body: b"paid".to_vec() }),
    }
}

/// webdis's answer to a read of key `n` holding a completed record with fingerprint `fp`.
fn store_completed(n: u8, fp: Fingerprint) -> Vec<u8> {
    let v = StoredValue {
        phase: Stage::Completed,
        owner: OwnerToken([1; 16]),
        lock_expires_at_ms: 0,
        record: completed(fp),
    };
    let bytes = v.encode(&skey(n), &seal());
    [format!("${}\r\n", bytes.len()).into_bytes(), bytes, b"\r\n".to_vec()].concat()
}

const STORE_ABSENT: &[u8] = b"$-1\r\n";

/// The root as the tests see it.
struct Sim {
    ws: Vec<Waiter>,
    now: u64,
    has_store: bool,
    seal: Seal,
    live: BTreeSet<u32>,
    /// What the local tier shows of each key (`None`: unreadable); a key not here is absent.
    local: BTreeMap<StorageKey, Option<Seen>>,
    /// Polls sent and not answered, by waiter.
    polls: BTreeSet<u32>,
    /// When each waiter last polled.
    polled_at: BTreeMap<u32, Vec<u64>>,
    answers: Vec<(u32, Reply, u64)>,
    unauthentic: usize,
    refuse_next_poll: bool,
}

impl Sim {
    fn new(has_store: bool) -> Sim {
        Sim {
            ws: vec![],
            now: 1_000,
            has_store,
            seal: seal(),
            live: BTreeSet::new(),
            local: BTreeMap::new(),
            polls: BTreeSet::new(),
            polled_at: BTreeMap::new(),
            answers: vec![],
            unauthentic: 0,
            refuse_next_poll: false,
        }
    }

    fn hold(&mut self, context_id: u32, key: u8) {
        self.live.insert(context_id);
        self.ws.push(waiter(context_id, key, self.now));
    }

    fn run(&mut self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Answer(w, r) => {
                    // A poll answered after its request left: the glue sends nothing to a
                    // context that is gone (`Root::answer`).
                    if !self.live.contains(&w.context_id) {
                        continue;
                    }
                    assert!(!self.answers.iter().any(|(c, _, _)| *c == w.context_id), "answered twice");
                    self.answers.push((w.context_id, r, self.now));
                }
                Action::Poll { context_id, .. } => {
                    assert!(!self.polls.contains(&context_id), "a second poll while one is in flight");
                    self.polled_at.entry(context_id).or_default().push(self.now);
                    if std::mem::take(&mut self.refuse_next_poll) {
                        continue;
                    }
                    self.polls.insert(context_id);
                    poll_sent(&mut self.ws, context_id);
                }
                Action::Unauthentic { .. } => self.unauthentic += 1,
            }
        }
    }

    fn tick(&mut self) {
        let (live, local) = (&self.live, &self.local);
        let actions = tick(&mut self.ws, self.now, self.has_store, &|c| live.contains(&c), &mut |k| {
            local.get(k).cloned().unwrap_or(Some(Seen::Absent))
        });
        self.run(actions);
    }

    fn advance(&mut self, ms: u64) {
        let until = self.now + ms;
        while self.now < until {
            self.now = (self.now + TICK_MS).min(until);
            self.tick();
        }
    }

    fn store_answers(&mut self, context_id: u32, status: Option<u16>, body: &[u8]) {
        assert!(self.polls.remove(&context_id), "answered a poll never sent");
        let local = &self.local;
        let actions = store_answered(
            &mut self.ws,
            context_id,
            status,
            body,
            Backend::Redis,
            Some(&self.seal),
            self.now,
            // The product's rule, on the look the tick reads.
            &mut |k| wait::local_holds(local.get(k).cloned().unwrap_or(Some(Seen::Absent))),
        );
        self.run(actions);
    }

    fn answer_of(&self, context_id: u32) -> Option<&Reply> {
        self.answers.iter().find(|(c, _, _)| *c == context_id).map(|(_, r, _)| r)
    }
}

#[test]
fn without_a_store_a_local_completion_is_replayed_at_the_next_tick() {
    let mut sim = Sim::new(false);
    sim.hold(1, 1);
    sim.local.insert(skey(1), Some(Seen::InFlight));
    sim.advance(500);
    assert!(sim.answers.is_empty());
    sim.local
        .insert(skey(1), Some(Seen::Completed { fingerprint: Some(FP), record: Some(completed(FP)), status: 201 }));
    sim.advance(TICK_MS);
    assert_eq!(sim.answer_of(1), Some(&Reply::Replay(completed(FP))));
    assert!(sim.ws.is_empty() && sim.polled_at.is_empty(), "no store, no poll");
}

/// Issue 40, item 6: a waiter that finds its key's tombstone (a completed record past its own
/// expiry) is answered `key-expired`, never the replay, as every replay is.
#[test]
fn a_waiter_that_finds_its_keys_tombstone_is_answered_key_expired() {
    let tomb = Record { expires_at_ms: 1, ..completed(FP) };
    // A route without tombstones replays it, as before them.
    for (tombstone_seconds, want) in [(60, Reply::Problem(ProblemKind::KeyExpired)), (0, Reply::Replay(tomb.clone()))] {
        let mut sim = Sim::new(false);
        sim.hold(1, 1);
        if let Some(w) = sim.ws.first_mut() {
            w.tombstone_seconds = tombstone_seconds;
        }
        let seen = Seen::Completed { fingerprint: Some(FP), record: Some(tomb.clone()), status: 201 };
        sim.local.insert(skey(1), Some(seen));
        sim.advance(TICK_MS);
        assert_eq!(sim.answer_of(1), Some(&want), "tombstone_seconds {tombstone_seconds}");
    }
}

#[test]
fn a_released_key_tells_the_waiter_to_retry_at_once_and_a_reused_key_is_refused() {
    let mut sim = Sim::new(false);
    sim.hold(1, 1);
    sim.hold(2, 2);
    sim.local.insert(skey(2), Some(Seen::Unknown { fingerprint: Some(OTHER) }));
    sim.tick();
    assert_eq!(sim.answer_of(1), Some(&Reply::InFlight { retry_after_seconds: 0 }));
    assert_eq!(sim.answer_of(2), Some(&Reply::Problem(ProblemKind::KeyReused { status: 422 })));
}

#[test]
fn a_waiter_is_answered_in_flight_at_its_deadline_not_before() {
    let mut sim = Sim::new(false);
    sim.hold(1, 1);
    sim.local.insert(skey(1), Some(Seen::InFlight));
    sim.advance(WAIT_MS - TICK_MS);
    assert!(sim.answers.is_empty());
    sim.advance(TICK_MS);
    assert_eq!(
        sim.answers,
        vec![(1, Reply::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS }, 1_000 + WAIT_MS)]
    );
}

#[test]
fn a_request_that_is_gone_is_dropped_unanswered() {
    let mut sim = Sim::new(false);
    sim.hold(1, 1);
    sim.live.clear();
    sim.tick();
    assert!(sim.ws.is_empty() && sim.answers.is_empty());
}

#[test]
fn with_a_store_a_local_miss_polls_the_store_one_poll_at_a_time_every_300_ms() {
    let mut sim = Sim::new(true);
    sim.hold(1, 1);
    sim.tick();
    assert_eq!(sim.polled_at[&1], vec![1_000]);
    // Unanswered: no second poll.
    sim.advance(1_000);
    assert_eq!(sim.polled_at[&1].len(), 1);
    // Answered garbled: the waiter keeps waiting and polls again (its 300 ms have passed).
    sim.store_answers(1, Some(200), b"?");
    assert!(sim.answers.is_empty());
    sim.tick();
    assert_eq!(sim.polled_at[&1], vec![1_000, 2_000]);
    sim.store_answers(1, Some(200), &store_completed(1, FP));
    assert_eq!(sim.answer_of(1), Some(&Reply::Replay(completed(FP))));
}

#[test]
fn a_store_that_shows_nothing_while_the_local_tier_holds_the_key_is_no_release() {
    let mut sim = Sim::new(true);
    sim.hold(1, 1);
    sim.local.insert(skey(1), Some(Seen::InFlight));
    sim.tick();
    sim.store_answers(1, Some(200), STORE_ABSENT);
    assert!(sim.answers.is_empty(), "kept waiting");
    sim.local.remove(&skey(1));
    sim.advance(300);
    sim.store_answers(1, Some(200), STORE_ABSENT);
    assert_eq!(sim.answer_of(1), Some(&Reply::InFlight { retry_after_seconds: 0 }));
}

/// Seen in CI (Envoy 1.36, two workers, a loaded machine): a poll answered "absent" before the
/// first attempt's store claim landed was read by the waiter's worker after that attempt had
/// finished here, and the waiter was told "released, retry now" (409, retry-after 0) instead of
/// getting the replay. The local tier's view is newer than such an answer.
#[test]
fn a_store_miss_read_after_the_first_attempt_finished_here_is_no_release() {
    let mut sim = Sim::new(true);
    sim.hold(1, 1);
    sim.local.insert(skey(1), Some(Seen::InFlight));
    sim.tick();
    // Meanwhile the claim landed, the upstream answered, the local tier holds the completion.
    sim.local
        .insert(skey(1), Some(Seen::Completed { fingerprint: Some(FP), record: Some(completed(FP)), status: 201 }));
    sim.store_answers(1, Some(200), STORE_ABSENT);
    assert!(sim.answers.is_empty(), "kept waiting: {:?}", sim.answers);
    sim.tick();
    assert_eq!(sim.answer_of(1), Some(&Reply::Replay(completed(FP))));
}

#[test]
fn a_store_record_failing_its_seal_is_reported_and_answered_unreadable() {
    let mut sim = Sim::new(true);
    sim.hold(1, 1);
    sim.tick();
    // Sealed for key 2, read at key 1: its seal does not verify.
    sim.store_answers(1, Some(200), &store_completed(2, FP));
    assert_eq!(sim.unauthentic, 1);
    assert!(matches!(sim.answer_of(1), Some(Reply::Problem(ProblemKind::RecordUnreadable { .. }))));
}

// Property tests: native only (proptest is not built for wasm32).
#[cfg(not(target_arch = "wasm32"))]
mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Step {
        Hold {
            key: u8,
        },
        Leave {
            pick: usize,
        },
        /// The local tier of key `key` now shows this (0 absent, 1 in flight, 2 completed, 3 unknown, 4 unreadable).
        Local {
            key: u8,
            what: u8,
        },
        /// The `pick`-th poll in flight is answered (0 absent, 1 completed, 2 garbled, 3 lost).
        Answer {
            pick: usize,
            what: u8,
        },
        RefuseNextPoll,
        Advance(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            2 => (0u8..4).prop_map(|key| Step::Hold { key }),
            1 => any::<usize>().prop_map(|pick| Step::Leave { pick }),
            2 => (0u8..4, 0u8..5).prop_map(|(key, what)| Step::Local { key, what }),
            4 => (any::<usize>(), 0u8..4).prop_map(|(pick, what)| Step::Answer { pick, what }),
            1 => Just(Step::RefuseNextPoll),
            4 => (0u64..700).prop_map(Step::Advance),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Over random schedules of waiters, departures, local-tier changes, and store polls answered,
        /// lost, refused or delayed: a waiter is answered at most once and never once gone; it never
        /// has two polls in flight nor polls more often than every `WAIT_STORE_POLL_MS`; a live waiter
        /// is answered by the first tick at or after its deadline, and answered "in flight, retry
        /// later" only then.
        #[test]
        fn random_schedules_keep_the_waiting_rules(has_store in any::<bool>(), steps in proptest::collection::vec(step(), 1..150)) {
            let mut sim = Sim::new(has_store);
            let mut next_id = 1u32;
            let mut deadlines: BTreeMap<u32, u64> = BTreeMap::new();
            for s in steps {
                match s {
                    Step::Hold { key } => {
                        sim.hold(next_id, key);
                        deadlines.insert(next_id, sim.now + WAIT_MS);
                        next_id += 1;
                    }
                    Step::Leave { pick } => {
                        if sim.live.is_empty() { continue; }
                        let c = *sim.live.iter().nth(pick % sim.live.len()).unwrap();
                        sim.live.remove(&c);
                    }
                    Step::Local { key, what } => {
                        let seen = match what {
                            0 => Some(Seen::Absent),
                            1 => Some(Seen::InFlight),
                            2 => Some(Seen::Completed { fingerprint: Some(FP), record: Some(completed(FP)), status: 201 }),
                            3 => Some(Seen::Unknown { fingerprint: Some(FP) }),
                            _ => None,
                        };
                        sim.local.insert(skey(key), seen);
                    }
                    Step::Answer { pick, what } => {
                        if sim.polls.is_empty() { continue; }
                        let c = *sim.polls.iter().nth(pick % sim.polls.len()).unwrap();
                        let key = sim.ws.iter().find(|w| w.context_id == c).map_or(0, |w| w.skey.0[0]);
                        match what {
                            0 => sim.store_answers(c, Some(200), STORE_ABSENT),
                            1 => sim.store_answers(c, Some(200), &store_completed(key, FP)),
                            2 => sim.store_answers(c, Some(200), b"?"),
                            _ => sim.store_answers(c, None, b""),
                        }
                    }
                    Step::RefuseNextPoll => sim.refuse_next_poll = true,
                    Step::Advance(ms) => sim.advance(ms),
                }
            }
            sim.advance(WAIT_MS + TICK_MS);
            for (c, at) in &deadlines {
                let answered = sim.answers.iter().find(|(a, _, _)| a == c);
                if let Some((_, Reply::InFlight { retry_after_seconds }, when)) = answered {
                    if *retry_after_seconds > 0 {
                        prop_assert!(*when >= *at, "waiter {} told to retry later at {} before its deadline {}", c, when, at);
                    }
                }
                if sim.live.contains(c) {
                    let (_, _, when) = answered.expect("a live waiter is answered by its deadline");
                    prop_assert!(*when <= *at + TICK_MS, "waiter {} answered at {} after its deadline {}", c, when, at);
                }
                if let Some(times) = sim.polled_at.get(c) {
                    prop_assert!(has_store, "polled without a store");
                    for pair in times.windows(2) {
                        prop_assert!(pair[1] - pair[0] >= WAIT_STORE_POLL_MS, "waiter {} polled at {:?}", c, times);
                    }
                }
            }
            prop_assert!(sim.ws.is_empty(), "every waiter is answered or dropped by its deadline");
        }
    }
}

/// Review (h-review3): with a store, this proxy's local copy of an MCP call awaiting input is not
/// the call's state (`request::after_local` asks the store instead since 1a74b82), yet a held
/// waiter is answered from it. Round 1 ran on this proxy and asked (its local copy: the awaiting
/// record); round 2 runs on another proxy (the store: in flight); the client's round 2 sent here
/// goes to the store, meets the claim and is held (`in_flight: "wait"`). At the first tick the
/// local tier's stale awaiting copy answers it 409 `retry-after: 0` ("released, retry now")
/// while round 2 still runs: wait mode becomes a 409 spin until round 2 ends elsewhere.
#[test]
fn with_a_store_a_local_awaiting_copy_never_answers_a_held_round() {
    let question = crate::record::question_for_tests("s1");
    let mut awaiting = completed(FP);
    awaiting.state = State::AwaitingInput(Box::new(crate::record::Awaiting::new([1; 32], vec![], question)));
    let now = 1_000;
    let mut ws = vec![waiter(1, 1, now)];
    let mut local =
        |_: &StorageKey| Some(Seen::Completed { fingerprint: Some(FP), record: Some(awaiting.clone()), status: 200 });
    let actions = tick(&mut ws, now + TICK_MS, true, &|_| true, &mut local);
    let answered: Vec<_> =
        actions.iter().filter_map(|a| if let Action::Answer(_, r) = a { Some(r.clone()) } else { None }).collect();
    assert!(
        answered.is_empty(),
        "a round held while the key is in flight in the store was answered from the local awaiting copy: {answered:?}"
    );
}
