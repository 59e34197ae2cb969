//! Whole requests of two proxies and a store, in memory: the scenarios the Envoy suites cover
//! (`single_proxy`, `two_proxies`, the store suites' lost answers and lock expiry), then random
//! schedules of both proxies, the store's answers, losses and delays, and the clock, with
//! retries of the same keys, checked against the promise.

use super::*;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const NOW: u64 = 1_000_000;
/// A 10 s lock, an hour of outcome-unknown, a day of completions; a store that refuses to be
/// bypassed (`on_unavailable: "reject"`).
const CONFIG: &str = r#"{"scope": {"headers": ["authorization"]}, "ttl_seconds": 86400,
    "lock_ttl_seconds": 10, "unknown_outcome_seconds": 3600,
    "store": {"cluster": "idemgate_store", "authority": "webdis", "on_unavailable": "reject"}}"#;

fn in_flight() -> Answer {
    Answer::Problem(ProblemKind::InFlight { retry_after_seconds: 1 }.slug())
}

fn unknown() -> Answer {
    Answer::Problem(ProblemKind::OutcomeUnknown.slug())
}

fn unavailable() -> Answer {
    Answer::Problem(ProblemKind::StoreUnavailable { retry_after_seconds: 1 }.slug())
}

/// Runs `r` through its headers and body until it waits on a callout or the upstream, or is
/// answered.
fn arrive(w: &mut World, r: usize) {
    w.headers(r);
    if matches!(w.phase(r), Phase::Body) {
        w.body(r);
    }
}

/// The one callout request `r` waits on.
fn its_call(w: &World, r: usize) -> usize {
    match w.phase(r) {
        Phase::Calling { call, .. } => call,
        ref other => panic!("request {r} waits on no callout: {other:?}"),
    }
}

/// Answers every callout on its way (the root's writes, orphans) until none is left.
fn answer_all(w: &mut World) {
    for _ in 0..16 {
        let pending = w.pending_calls();
        if pending.is_empty() {
            return;
        }
        for c in pending {
            w.answer(c);
        }
    }
    panic!("callouts keep coming");
}

/// One request all the way: arrives, its claim answered, the upstream answers, its writes land.
fn whole(w: &mut World, proxy: usize, key: &str, body: &[u8]) -> Answer {
    let r = w.send(proxy, key, body);
    arrive(w, r);
    // A claim-or-read, then perhaps a take-over.
    for _ in 0..2 {
        if let Phase::Calling { .. } = w.phase(r) {
            w.answer(its_call(w, r));
        }
    }
    if let Phase::Upstream = w.phase(r) {
        w.upstream(r, Upstream::Answers);
    }
    answer_all(w);
    match w.reqs[r].answer() {
        Some(a) => a.clone(),
        None => panic!("request {r} unanswered: {:?}", w.phase(r)),
    }
}

fn skey(w: &World, r: usize) -> StorageKey {
    w.reqs[r].skey.unwrap_or_else(|| panic!("request {r} has no key yet"))
}

#[test]
fn a_first_request_executes_once_and_its_retries_on_either_proxy_get_its_replay() {
    let mut w = World::new(CONFIG, 2, NOW);
    let first = whole(&mut w, 0, "k-1", b"{\"amount\":1}");
    assert_eq!(first, Answer::Fresh { status: 201, body: b"k-1#1".to_vec() });
    assert_eq!(w.store.stage(&skey(&w, 0), w.now), Stage::Completed);
    // Its retry on the same proxy: from the local tier, no store call.
    w.tick(100);
    let r = w.send(0, "k-1", b"{\"amount\":1}");
    arrive(&mut w, r);
    assert_eq!(w.reqs[r].answer(), Some(&Answer::Replay { status: 201, body: b"k-1#1".to_vec() }));
    assert!(w.pending_calls().is_empty(), "a local replay asks the store nothing");
    // On the other proxy: from the store, which then keeps a local copy.
    let other = whole(&mut w, 1, "k-1", b"{\"amount\":1}");
    assert_eq!(other, Answer::Replay { status: 201, body: b"k-1#1".to_vec() });
    let r = w.send(1, "k-1", b"{\"amount\":1}");
    arrive(&mut w, r);
    assert!(matches!(w.reqs[r].answer(), Some(Answer::Replay { .. })), "{:?}", w.phase(r));
    assert_eq!(w.runs.get("k-1"), Some(&1));
    // Another key is its own.
    assert_eq!(whole(&mut w, 1, "k-2", b"{}"), Answer::Fresh { status: 201, body: b"k-2#1".to_vec() });
}

#[test]
fn a_retry_while_the_first_runs_is_409_on_either_proxy_and_a_reused_key_is_422() {
    let mut w = World::new(CONFIG, 2, NOW);
    let first = w.send(0, "k-1", b"{\"amount\":1}");
    arrive(&mut w, first);
    w.answer(its_call(&w, first));
    assert!(matches!(w.phase(first), Phase::Upstream));
    // The same proxy: its local claim answers at the headers.
    let local = w.send(0, "k-1", b"{\"amount\":1}");
    arrive(&mut w, local);
    assert_eq!(w.reqs[local].answer(), Some(&in_flight()));
    // The other proxy: the store answers.
    let remote = w.send(1, "k-1", b"{\"amount\":1}");
    arrive(&mut w, remote);
    w.answer(its_call(&w, remote));
    assert_eq!(w.reqs[remote].answer(), Some(&in_flight()));
    w.upstream(first, Upstream::Answers);
    answer_all(&mut w);
    // Another body under the same key: 422 on both proxies, nothing executed.
    let reused = whole(&mut w, 0, "k-1", b"{\"amount\":2}");
    assert_eq!(reused, Answer::Problem(ProblemKind::KeyReused { status: 422 }.slug()));
    let reused = whole(&mut w, 1, "k-1", b"{\"amount\":2}");
    assert_eq!(reused, Answer::Problem(ProblemKind::KeyReused { status: 422 }.slug()));
    assert_eq!(w.runs.get("k-1"), Some(&1));
}

#[test]
fn a_lost_claim_answer_is_503_released_so_the_retry_executes_once() {
    let mut w = World::new(CONFIG, 2, NOW);
    let r = w.send(0, "k-1", b"{}");
    arrive(&mut w, r);
    // The claim landed; its answer is lost: 503, never forwarded, the claim released
    // owner-checked through the root.
    w.lose(its_call(&w, r), Loss::AfterLanding);
    assert_eq!(w.reqs[r].answer(), Some(&unavailable()));
    answer_all(&mut w);
    assert_eq!(w.store.stage(&skey(&w, r), w.now), Stage::Absent);
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), Answer::Fresh { status: 201, body: b"k-1#1".to_vec() });
    assert_eq!(w.runs.get("k-1"), Some(&1));
}

#[test]
fn a_claim_landing_after_its_own_release_is_refused_by_the_tombstone() {
    let mut w = World::new(CONFIG, 2, NOW);
    let r = w.send(0, "k-1", b"{}");
    arrive(&mut w, r);
    let claim = its_call(&w, r);
    // Given up on before it reaches the store; its release lands first (a tombstone).
    w.lose(claim, Loss::LandsLater);
    let writes: Vec<usize> = w
        .pending_calls()
        .into_iter()
        .filter(|&c| matches!(w.calls[c], Some(Callout { caller: Caller::Write { .. }, .. })))
        .collect();
    assert_eq!(writes.len(), 1, "the release");
    w.answer(writes[0]);
    answer_all(&mut w);
    assert_eq!(w.store.stage(&skey(&w, r), w.now), Stage::Absent, "the late claim is refused");
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), Answer::Fresh { status: 201, body: b"k-1#1".to_vec() });
}

#[test]
fn a_completion_the_store_never_gets_falls_back_to_outcome_unknown_never_a_second_run() {
    let mut w = World::new(CONFIG, 2, NOW);
    let r = w.send(0, "k-1", b"{}");
    arrive(&mut w, r);
    w.answer(its_call(&w, r));
    w.upstream(r, Upstream::Answers);
    // Every send of the completion is lost: then its fallback, outcome-unknown, lands.
    for _ in 0..WRITE_TRIES {
        let c = w.pending_calls();
        assert_eq!(c.len(), 1);
        w.lose(c[0], Loss::Never);
    }
    answer_all(&mut w);
    assert_eq!(w.store.stage(&skey(&w, r), w.now), Stage::Unknown);
    // The first proxy keeps the response; the other meets outcome-unknown.
    assert_eq!(whole(&mut w, 0, "k-1", b"{}"), Answer::Replay { status: 201, body: b"k-1#1".to_vec() });
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), unknown());
    assert_eq!(w.runs.get("k-1"), Some(&1));
}

#[test]
fn a_reset_upstream_leaves_outcome_unknown_everywhere() {
    let mut w = World::new(CONFIG, 2, NOW);
    let r = w.send(0, "k-1", b"{}");
    arrive(&mut w, r);
    w.answer(its_call(&w, r));
    w.upstream(r, Upstream::Resets);
    answer_all(&mut w);
    assert_eq!(whole(&mut w, 0, "k-1", b"{}"), unknown());
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), unknown());
    // Never connected: released, the retry executes.
    let r = w.send(1, "k-2", b"{}");
    arrive(&mut w, r);
    w.answer(its_call(&w, r));
    w.upstream(r, Upstream::NeverConnects);
    answer_all(&mut w);
    assert_eq!(whole(&mut w, 0, "k-2", b"{}"), Answer::Fresh { status: 201, body: b"k-2#1".to_vec() });
    assert_eq!((w.runs.get("k-1"), w.runs.get("k-2")), (Some(&1), Some(&1)));
}

#[test]
fn past_its_lock_a_silent_claim_is_outcome_unknown_and_with_takeover_runs_again() {
    for (config, again) in
        [(CONFIG.to_string(), false), (CONFIG.replacen('{', r#"{"stale_lock": "takeover", "#, 1), true)]
    {
        let mut w = World::new(&config, 2, NOW);
        let r = w.send(0, "k-1", b"{}");
        arrive(&mut w, r);
        w.answer(its_call(&w, r));
        assert!(matches!(w.phase(r), Phase::Upstream));
        // Within the lock: in flight. Past it: the other proxy judges the claim stale.
        assert_eq!(whole(&mut w, 1, "k-1", b"{}"), in_flight());
        w.tick(10_001);
        let retry = whole(&mut w, 1, "k-1", b"{}");
        if again {
            // At least once, by the operator's choice.
            assert_eq!(retry, Answer::Fresh { status: 201, body: b"k-1#1".to_vec() });
        } else {
            assert_eq!(retry, unknown());
            assert_eq!(w.store.stage(&skey(&w, r), w.now), Stage::Unknown);
        }
        // The first attempt's late response: never overwrites what the key became.
        w.upstream(r, Upstream::Answers);
        answer_all(&mut w);
        let want = if again { 2 } else { 1 };
        assert_eq!(w.runs.get("k-1"), Some(&want), "stale_lock takeover: {again}");
        let later = whole(&mut w, 1, "k-1", b"{}");
        if again {
            assert_eq!(later, Answer::Replay { status: 201, body: b"k-1#1".to_vec() });
        } else {
            assert_eq!(later, unknown());
        }
    }
}

#[test]
fn a_claim_answer_later_than_its_lock_is_never_forwarded() {
    let mut w = World::new(CONFIG, 2, NOW);
    let r = w.send(0, "k-1", b"{}");
    arrive(&mut w, r);
    let c = its_call(&w, r);
    w.land(c);
    w.tick(10_000);
    w.answer(c);
    assert_eq!(w.reqs[r].answer(), Some(&unavailable()));
    answer_all(&mut w);
    assert_eq!(w.runs.get("k-1"), None);
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), Answer::Fresh { status: 201, body: b"k-1#1".to_vec() });
}

// Random schedules: native only (proptest is not built for wasm32).
#[cfg(not(target_arch = "wasm32"))]
mod schedules {
    use super::*;
    use proptest::prelude::*;

    const KEYS: [&str; 3] = ["k-a", "k-b", "k-c"];

    /// One thing that happens: `pick` chooses among what can happen now.
    #[derive(Clone, Debug)]
    enum Move {
        /// A client sends (or retries) a key to a proxy; `other_body`: another operation.
        Send {
            proxy: usize,
            key: usize,
            other_body: bool,
        },
        /// A request's proxy takes its next callback (headers, body).
        Advance {
            pick: usize,
        },
        /// The upstream finishes a forwarded request.
        Upstream {
            pick: usize,
            how: u8,
        },
        /// A callout lands (its answer still on its way).
        Land {
            pick: usize,
        },
        Answer {
            pick: usize,
        },
        Lose {
            pick: usize,
            how: u8,
        },
        Tick {
            ms: u64,
        },
        /// The store is out for a root write's whole schedule: every send of it is lost (then
        /// its fallback, if any, is on its way).
        Outage {
            pick: usize,
        },
    }

    fn moves() -> impl Strategy<Value = Move> {
        prop_oneof![
            3 => (0..2usize, 0..KEYS.len(), proptest::bool::weighted(0.1))
                .prop_map(|(proxy, key, other_body)| Move::Send { proxy, key, other_body }),
            4 => any::<usize>().prop_map(|pick| Move::Advance { pick }),
            2 => (any::<usize>(), 0..3u8).prop_map(|(pick, how)| Move::Upstream { pick, how }),
            1 => any::<usize>().prop_map(|pick| Move::Land { pick }),
            4 => any::<usize>().prop_map(|pick| Move::Answer { pick }),
            1 => (any::<usize>(), 0..3u8).prop_map(|(pick, how)| Move::Lose { pick, how }),
            2 => (0..4_000u64).prop_map(|ms| Move::Tick { ms }),
            1 => any::<usize>().prop_map(|pick| Move::Outage { pick }),
        ]
    }

    /// Every key's operation sends the same body (so only the key tells them apart); `other`:
    /// another operation under the same key.
    fn body(_key: usize, other: bool) -> Vec<u8> {
        format!("{{\"amount\":1,\"other\":{other}}}").into_bytes()
    }

    /// Runs `moves`, then lets everything finish; the promise checked at the end.
    fn run(config: &str, moves: &[Move]) -> Result<(), TestCaseError> {
        let mut w = World::new(config, 2, NOW);
        for m in moves {
            match *m {
                Move::Send { proxy, key, other_body } => {
                    w.send(proxy, KEYS[key], &body(key, other_body));
                }
                Move::Advance { pick } => {
                    let ready: Vec<usize> =
                        (0..w.reqs.len()).filter(|&r| matches!(w.phase(r), Phase::New | Phase::Body)).collect();
                    if let Some(&r) = ready.get(pick % ready.len().max(1)) {
                        if matches!(w.phase(r), Phase::New) {
                            w.headers(r);
                        } else {
                            w.body(r);
                        }
                    }
                }
                Move::Upstream { pick, how } => {
                    let up: Vec<usize> = (0..w.reqs.len()).filter(|&r| matches!(w.phase(r), Phase::Upstream)).collect();
                    if let Some(&r) = up.get(pick % up.len().max(1)) {
                        let how = [Upstream::Answers, Upstream::Resets, Upstream::NeverConnects][how as usize % 3];
                        w.upstream(r, how);
                    }
                }
                Move::Land { pick } | Move::Answer { pick } | Move::Lose { pick, .. } => {
                    let pending = w.pending_calls();
                    let Some(&c) = pending.get(pick % pending.len().max(1)) else { continue };
                    match *m {
                        Move::Land { .. } => w.land(c),
                        Move::Answer { .. } => w.answer(c),
                        Move::Lose { how, .. } => {
                            w.lose(c, [Loss::Never, Loss::AfterLanding, Loss::LandsLater][how as usize % 3])
                        }
                        _ => {}
                    }
                }
                Move::Outage { pick } => {
                    let writes: Vec<usize> = w
                        .pending_calls()
                        .into_iter()
                        .filter(|&c| matches!(w.calls[c], Some(Callout { caller: Caller::Write { tries: 1, .. }, .. })))
                        .collect();
                    let Some(&first) = writes.get(pick % writes.len().max(1)) else { continue };
                    w.lose(first, Loss::Never);
                    // Each loss sends it again as the newest callout, until its tries are spent.
                    for _ in 1..WRITE_TRIES {
                        w.lose(w.calls.len() - 1, Loss::Never);
                    }
                }
                // Well within unknown_outcome_seconds (an hour) over the whole schedule.
                Move::Tick { ms } => w.tick(ms),
            }
        }
        // No request waits forever: everything finishes once the world lets it.
        prop_assert!(w.drain(64), "unfinished: {:?}", (0..w.reqs.len()).map(|r| w.phase(r)).collect::<Vec<_>>());
        // Retries after it all: each key executed, none again.
        for (i, key) in KEYS.iter().enumerate() {
            let before = w.runs.get(*key).copied().unwrap_or(0);
            w.send(0, key, &body(i, false));
            prop_assert!(w.drain(8));
            w.send(1, key, &body(i, false));
            prop_assert!(w.drain(8));
            let after = w.runs.get(*key).copied().unwrap_or(0);
            prop_assert!(after <= before.max(1), "{key}: retries ran it again ({before} then {after})");
        }
        // The upstream executes each key at most once.
        for (key, n) in &w.runs {
            prop_assert!(*n <= 1, "{key} executed {n} times");
        }
        prop_assert_eq!(w.unprotected, 0);
        // Every replay carries its own key's response, as the upstream gave it.
        for q in &w.reqs {
            if let Some(Answer::Replay { body, .. } | Answer::Fresh { body, .. }) = q.answer() {
                let given = w.responses.get(&q.key).map(|b| b.contains(body)).unwrap_or(false);
                prop_assert!(given, "{} got {:?}", q.key, String::from_utf8_lossy(body));
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn random_schedules_of_two_proxies_and_a_store_keep_the_promise(
            moves in proptest::collection::vec(moves(), 1..160)
        ) {
            run(CONFIG, &moves)?;
        }
    }
}
