//! The request machine driven without Envoy: each test feeds the answers a request meets, in
//! order, and checks the command each one yields.

use super::*;
use crate::config::StaleLock;
use crate::record::{State, StoredResponse};
use crate::scope::StorageKey;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// The store's clock (ms) in the answers below; the proxy's own clock is `LOCAL`.
const STORE_NOW: u64 = 1_764_000_000_000;
const LOCAL: u64 = 5_000_000;
const REJECT: StoreMode = Some(OnUnavailable::Reject);

fn policy() -> Policy {
    Policy::default()
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint([n; 32])
}

fn handle() -> Handle {
    Handle { bucket: 3, position: 1, owner: OwnerToken([7; 16]), skey: StorageKey([9; 32]) }
}

fn creator() -> Creator {
    Creator { request_id: "first".into(), log_values: vec![] }
}

/// The store's value for a key in `phase`, made by a request with fingerprint `fp(1)`; its lock
/// expires at `lock_expires_at_ms` (store clock).
fn value(phase: Stage, lock_expires_at_ms: u64) -> StoredValue {
    let state = match phase {
        Stage::Completed => {
            State::Completed(StoredResponse { status: 201, headers: vec![], body: b"{\"id\":1}".to_vec() })
        }
        Stage::Unknown => State::OutcomeUnknown { reason: crate::record::UnknownReason::StaleLock },
        // The store holds no other stage (a claim is written forwarded).
        Stage::Forwarded | Stage::Claimed | Stage::Absent => {
            State::Forwarded { owner: OwnerToken([1; 16]), lock_expires_at_ms }
        }
    };
    let record = Record {
        fingerprint: fp(1),
        created_at_ms: STORE_NOW - 1_000,
        expires_at_ms: STORE_NOW + 86_400_000,
        creator: creator(),
        state,
    };
    StoredValue { phase, owner: OwnerToken([1; 16]), lock_expires_at_ms, record }
}

/// `value` found by a claim-or-read, the key expiring in a day by the store's clock.
fn exists(v: StoredValue) -> Result<ClaimReply, StoreError> {
    Ok(ClaimReply::Exists { now_ms: STORE_NOW, expires_at_ms: STORE_NOW + 86_400_000, value: v })
}

fn sent(handle: Option<Handle>, n: u8) -> Sent {
    Sent { handle, fp: fp(n), sent_at_ms: LOCAL - 20, round: None }
}

#[test]
fn a_first_request_claims_locally_waits_for_its_body_claims_in_the_store_and_forwards() {
    let h = handle();
    // Headers: the local tier claims nothing before the fingerprint is known.
    assert_eq!(
        after_local(Ok(Begin::NeedFingerprint { seen: None }), None, REJECT, LOCAL),
        Step::WaitForBody { seen: None }
    );
    // A claim without the fingerprint cannot come from the local tier: refused, never forwarded.
    let begun = Ok(Begin::Claimed { handle: h, took_over: false, evicted: false });
    assert_eq!(
        after_local(begun, None, REJECT, LOCAL),
        Step::FailClosed { broken: Broken::ImpossibleDecision, branch: "claim_without_fingerprint", handle: Some(h) }
    );
    // Body complete, claimed locally with its fingerprint: the store is asked next, the local claim held.
    let begun = Ok(Begin::Claimed { handle: h, took_over: false, evicted: false });
    assert_eq!(after_local(begun, Some(fp(1)), REJECT, LOCAL), Step::ClaimInStore { handle: Some(h), fp: fp(1) });
    // The store claimed it for us in time: forwarded under both claims.
    let claimed = Ok(ClaimReply::Claimed { now_ms: STORE_NOW });
    assert_eq!(
        after_claim(claimed, &sent(Some(h), 1), &policy(), OnUnavailable::Reject, LOCAL),
        Answered::Next(Step::Forward { handle: Some(h), fp: fp(1), in_store: true, lock_from_ms: LOCAL - 20 })
    );
}

#[test]
fn without_a_store_a_request_forwards_under_its_local_claim_and_never_without_one() {
    let h = handle();
    let begun = Ok(Begin::Claimed { handle: h, took_over: false, evicted: false });
    assert_eq!(
        after_local(begun, Some(fp(1)), None, LOCAL),
        Step::Forward { handle: Some(h), fp: fp(1), in_store: false, lock_from_ms: LOCAL }
    );
    assert_eq!(
        after_fingerprint(None, fp(1), None, LOCAL),
        Step::FailClosed { broken: Broken::ImpossibleDecision, branch: "proceed_without_claim", handle: None }
    );
    // A full local tier with no store: 503, nothing held.
    assert!(matches!(
        after_local(Ok(Begin::Full), Some(fp(1)), None, LOCAL),
        Step::Reply { problem: ProblemKind::CapacityExhausted { .. }, release: None, .. }
    ));
    // With a store, a full local tier is only a missing cache: the store is asked.
    assert_eq!(
        after_local(Ok(Begin::Full), Some(fp(1)), REJECT, LOCAL),
        Step::ClaimInStore { handle: None, fp: fp(1) }
    );
    assert_eq!(after_local(Ok(Begin::Full), None, REJECT, LOCAL), Step::WaitForBody { seen: None });
}

#[test]
fn a_retry_meeting_the_key_in_flight_in_the_store_gets_in_flight_and_frees_its_local_claim() {
    let h = handle();
    let live = value(Stage::Forwarded, STORE_NOW + 30_000);
    let step = after_claim(exists(live), &sent(Some(h), 1), &policy(), OnUnavailable::Reject, LOCAL);
    assert_eq!(step, Answered::Next(Step::InFlight { creator: Some(creator()), release: Some(h), fp: Some(fp(1)) }));
}

#[test]
fn a_retry_meeting_the_completed_key_replays_it_and_keeps_a_local_copy_on_its_own_clock() {
    let h = handle();
    let done = value(Stage::Completed, 0);
    let Answered::Next(Step::Replay { record, cache }) =
        after_claim(exists(done), &sent(Some(h), 1), &policy(), OnUnavailable::Reject, LOCAL)
    else {
        panic!("a completed key with the same fingerprint is replayed");
    };
    assert_eq!(cache, Some(h));
    assert!(matches!(record.state, State::Completed(ref r) if r.status == 201));
    // The store's key lives one more day: so does the local copy, by this proxy's clock.
    assert_eq!(record.expires_at_ms, LOCAL + 86_400_000);
}

#[test]
fn a_retry_with_another_body_meeting_any_stage_is_refused_with_the_mismatch_status() {
    for phase in [Stage::Completed, Stage::Unknown, Stage::Forwarded] {
        let step = after_claim(
            exists(value(phase, STORE_NOW + 30_000)),
            &sent(None, 2),
            &policy(),
            OnUnavailable::Reject,
            LOCAL,
        );
        assert_eq!(
            step,
            Answered::Next(Step::Reply {
                problem: ProblemKind::KeyReused { status: 422 },
                creator: Some(creator()),
                release: None
            }),
            "{phase:?}"
        );
    }
}

#[test]
fn a_retry_meeting_an_unknown_outcome_is_told_so_and_never_forwarded() {
    let step = after_claim(exists(value(Stage::Unknown, 0)), &sent(None, 1), &policy(), OnUnavailable::Reject, LOCAL);
    let unknown = Step::Reply { problem: ProblemKind::OutcomeUnknown, creator: Some(creator()), release: None };
    assert_eq!(step, Answered::Next(unknown));
}

#[test]
fn a_retry_meeting_a_stale_forwarded_claim_marks_it_unknown_or_takes_it_over_as_the_policy_says() {
    let h = handle();
    let stale = value(Stage::Forwarded, STORE_NOW - 1);
    let step = after_claim(exists(stale.clone()), &sent(Some(h), 1), &policy(), OnUnavailable::Reject, LOCAL);
    let mark = Step::MarkUnknown { old_owner: OwnerToken([1; 16]), creator: creator(), release: Some(h) };
    assert_eq!(step, Answered::Next(mark));
    let takeover = Policy { stale_lock: StaleLock::Takeover, ..policy() };
    let step = after_claim(exists(stale.clone()), &sent(Some(h), 1), &takeover, OnUnavailable::Reject, LOCAL);
    assert_eq!(step, Answered::Next(Step::TakeOver { handle: Some(h), fp: fp(1), old: Box::new(stale), free: false }));
}

#[test]
fn a_record_past_its_expiry_with_no_live_lock_is_free_and_taken_over_owner_checked() {
    let mut done = value(Stage::Completed, 0);
    done.record.expires_at_ms = STORE_NOW - 1;
    let gone = Ok(ClaimReply::Exists { now_ms: STORE_NOW, expires_at_ms: STORE_NOW - 1, value: done.clone() });
    let step = after_claim(gone, &sent(None, 1), &policy(), OnUnavailable::Reject, LOCAL);
    assert_eq!(step, Answered::Next(Step::TakeOver { handle: None, fp: fp(1), old: Box::new(done), free: true }));
}

#[test]
fn a_take_over_forwards_when_it_landed_and_is_in_flight_when_another_request_won() {
    let h = handle();
    let s = sent(Some(h), 1);
    let forward =
        Answered::Next(Step::Forward { handle: Some(h), fp: fp(1), in_store: true, lock_from_ms: LOCAL - 20 });
    assert_eq!(after_take_over(Ok(TransitionReply::Changed), &s, &policy(), LOCAL), forward);
    assert_eq!(after_take_over(Ok(TransitionReply::ClaimGoneRewritten), &s, &policy(), LOCAL), forward);
    for lost_race in [TransitionReply::Refused, TransitionReply::Absent] {
        assert_eq!(
            after_take_over(Ok(lost_race), &s, &policy(), LOCAL),
            Answered::Next(Step::Reply {
                problem: ProblemKind::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS },
                creator: None,
                release: Some(h)
            })
        );
    }
    assert_eq!(after_take_over(Ok(TransitionReply::NoScript), &s, &policy(), LOCAL), Answered::Resend);
}

#[test]
fn a_lost_or_garbled_store_answer_is_a_lost_claim_never_a_forward() {
    let s = sent(Some(handle()), 1);
    for error in [StoreError::NoAnswer, StoreError::Http(503), StoreError::Garbled("x".into())] {
        assert_eq!(
            after_claim(Err(error.clone()), &s, &policy(), OnUnavailable::Pass, LOCAL),
            Answered::Lost { error: error.clone() }
        );
        assert_eq!(after_take_over(Err(error.clone()), &s, &policy(), LOCAL), Answered::Lost { error });
    }
    assert_eq!(after_claim(Ok(ClaimReply::NoScript), &s, &policy(), OnUnavailable::Reject, LOCAL), Answered::Resend);
}

#[test]
fn a_claim_answer_later_than_the_lock_is_not_used_even_though_the_store_claimed_it() {
    let h = handle();
    let lock_ms = 60_000;
    let claimed = || Ok(ClaimReply::Claimed { now_ms: STORE_NOW });
    let s = Sent { handle: Some(h), fp: fp(1), sent_at_ms: LOCAL, round: None };
    // One ms short of the lock: still in time.
    let in_time = after_claim(claimed(), &s, &policy(), OnUnavailable::Reject, LOCAL + lock_ms - 1);
    assert_eq!(
        in_time,
        Answered::Next(Step::Forward { handle: Some(h), fp: fp(1), in_store: true, lock_from_ms: LOCAL })
    );
    let late = after_claim(claimed(), &s, &policy(), OnUnavailable::Pass, LOCAL + lock_ms);
    assert_eq!(late, Answered::TooLate { waited_ms: lock_ms, lock_ms, run_ms: 0 });
    // The same for a take-over.
    let late = after_take_over(Ok(TransitionReply::Changed), &s, &policy(), LOCAL + lock_ms);
    assert!(matches!(late, Answered::TooLate { .. }));
}

#[test]
fn an_unreadable_record_is_refused_as_unreadable_whatever_on_unavailable_says() {
    let h = handle();
    for mode in [OnUnavailable::Reject, OnUnavailable::Pass] {
        let reply =
            Ok(ClaimReply::Unreadable { now_ms: STORE_NOW, why: ValueError::Unreadable("a later format".into()) });
        let step = after_claim(reply, &sent(Some(h), 1), &policy(), mode, LOCAL);
        let Answered::Next(Step::Unreadable { problem, release, .. }) = step else { panic!("{mode:?}: {step:?}") };
        assert!(matches!(problem, ProblemKind::RecordUnreadable { .. }), "{mode:?}");
        assert_eq!(release, Some(h));
    }
}

#[test]
fn a_store_failure_is_503_or_an_unprotected_forward_as_on_unavailable_says() {
    assert!(matches!(
        after_store_failure(&policy(), OnUnavailable::Reject),
        Step::Reply { problem: ProblemKind::StoreUnavailable { .. }, .. }
    ));
    assert_eq!(after_store_failure(&policy(), OnUnavailable::Pass), Step::PassUnprotected);
}

#[test]
fn a_local_outcome_unknown_is_asked_of_the_store_only_when_a_store_failure_is_refused() {
    let unknown = || Ok(Begin::Reject { problem: ProblemKind::OutcomeUnknown, creator: None, marked_unknown: false });
    assert_eq!(after_local(unknown(), None, REJECT, LOCAL), Step::PauseForBody);
    assert_eq!(after_local(unknown(), Some(fp(1)), REJECT, LOCAL), Step::ReadSettled { fp: fp(1) });
    // Under "pass" a store failure would forward it unprotected: the local answer stands.
    for store in [Some(OnUnavailable::Pass), None] {
        assert_eq!(
            after_local(unknown(), Some(fp(1)), store, LOCAL),
            Step::Reply { problem: ProblemKind::OutcomeUnknown, creator: None, release: None }
        );
    }
}

#[test]
fn the_stores_settlement_of_a_local_unknown_replays_a_completion_and_otherwise_the_unknown_stands() {
    let done = ReadReply::Found(value(Stage::Completed, 0));
    assert!(matches!(after_settled_read(Ok(done.clone()), &fp(1), 422), Step::Replay { cache: None, .. }));
    assert_eq!(
        after_settled_read(Ok(done), &fp(2), 409),
        Step::Reply { problem: ProblemKind::KeyReused { status: 409 }, creator: None, release: None }
    );
    let running = ReadReply::Found(value(Stage::Forwarded, STORE_NOW + 1));
    assert!(matches!(
        after_settled_read(Ok(running), &fp(1), 422),
        Step::Reply { problem: ProblemKind::InFlight { .. }, .. }
    ));
    // An absent key is no proof the key never ran; nor is a lost answer.
    assert_eq!(after_settled_read(Ok(ReadReply::Absent), &fp(1), 422), Step::UnknownStands { unreadable: None });
    assert_eq!(after_settled_read(Err(StoreError::NoAnswer), &fp(1), 422), Step::UnknownStands { unreadable: None });
    let unknown = ReadReply::Found(value(Stage::Unknown, 0));
    assert_eq!(after_settled_read(Ok(unknown), &fp(1), 422), Step::UnknownStands { unreadable: None });
}

#[test]
fn a_retry_meeting_the_local_tier_replays_or_is_in_flight_without_asking_the_store() {
    let record = value(Stage::Completed, 0).record;
    assert_eq!(
        after_local(Ok(Begin::Replay(record.clone())), Some(fp(1)), REJECT, LOCAL),
        Step::Replay { record, cache: None }
    );
    let in_flight = Ok(Begin::Reject {
        problem: ProblemKind::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS },
        creator: Some(creator()),
        marked_unknown: false,
    });
    assert_eq!(
        after_local(in_flight, None, REJECT, LOCAL),
        Step::InFlight { creator: Some(creator()), release: None, fp: None }
    );
    assert_eq!(
        after_local(Ok(Begin::NeedFingerprint { seen: None }), None, REJECT, LOCAL),
        Step::WaitForBody { seen: None }
    );
    assert_eq!(after_local(Err(LocalError::Corrupt), None, REJECT, LOCAL), Step::LocalFailed(LocalError::Corrupt));
}

/// Issue 40: a claim-or-read that finds an MCP call's awaiting value answers the round that asked
/// (or an earlier one) with a replay of it (its question, once the machine turns it), and the
/// next round with a continuation of that value, owner-checked; never past the record's own
/// expiry (its tombstone: a replay, answered `key-expired`), and never for a request that is no
/// round.
#[test]
fn an_awaiting_value_is_replayed_to_its_round_and_continued_by_the_next() {
    let h = handle();
    let mut awaiting = value(Stage::Completed, 0);
    let question = StoredResponse { status: 200, headers: vec![], body: b"{\"q\":1}".to_vec() };
    let a = crate::record::Awaiting::new([1; 32], vec![[0; 32]], question);
    awaiting.record.state = State::AwaitingInput(Box::new(a));
    let round = |r: Option<[u8; 32]>| Sent {
        round: r.map(|digest| crate::record::RoundId { digest, state: None }),
        ..sent(Some(h), 1)
    };
    let p = Policy { tombstone_seconds: 60, ..policy() };
    for asked in [Some([1; 32]), Some([0; 32]), None] {
        let step = after_claim(exists(awaiting.clone()), &round(asked), &p, OnUnavailable::Reject, LOCAL);
        assert!(matches!(step, Answered::Next(Step::Replay { .. })), "{asked:?}: {step:?}");
    }
    let step = after_claim(exists(awaiting.clone()), &round(Some([2; 32])), &p, OnUnavailable::Reject, LOCAL);
    assert_eq!(step, Answered::Next(Step::Continue { handle: Some(h), fp: fp(1), old: Box::new(awaiting.clone()) }));
    // The record's own expiry is by its writer's clock, a proxy's (`StoredValue::record_on_clock`).
    let mut expired = awaiting;
    expired.record.expires_at_ms = LOCAL - 1;
    let step = after_claim(exists(expired), &round(Some([2; 32])), &p, OnUnavailable::Reject, LOCAL);
    assert!(matches!(step, Answered::Next(Step::Replay { .. })), "a tombstone is no call to continue: {step:?}");
}

/// Issue 40: the store tier judges a round by the question's `requestState` digest stored in the
/// awaiting record (tag 6), read from the sealed value as the store holds it: the round echoing
/// the question's state continues the call, one echoing an earlier question's (a copy of the
/// round that answered it, spelled another way) or none is replayed the question, never run.
#[test]
fn a_stored_awaiting_value_is_continued_only_by_a_round_echoing_its_questions_state() {
    let h = handle();
    let state = |s: &str| crate::record::state_digest(&serde_json::Value::String(s.into()));
    let question = StoredResponse {
        status: 200,
        headers: vec![],
        body: br#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"input_required","requestState":"s2"}}"#.to_vec(),
    };
    let mut awaiting = value(Stage::Completed, 0);
    let a = crate::record::Awaiting::new([2; 32], vec![[0; 32]], question);
    awaiting.record.state = State::AwaitingInput(Box::new(a));
    let seal = crate::seal::Seal::new(Some("engine-request-tests-record-key-0123456789abcdef"), None).unwrap();
    let skey = StorageKey([9; 32]);
    let read = crate::store::StoredValue::open(&awaiting.encode(&skey, &seal), &skey, &seal).expect("opens");
    assert_eq!(read, awaiting);
    let round = |digest: u8, s: Option<&str>| Sent {
        round: Some(crate::record::RoundId { digest: [digest; 32], state: s.map(state) }),
        ..sent(Some(h), 1)
    };
    let p = policy();
    let step = after_claim(exists(read.clone()), &round(3, Some("s2")), &p, OnUnavailable::Reject, LOCAL);
    assert_eq!(step, Answered::Next(Step::Continue { handle: Some(h), fp: fp(1), old: Box::new(read.clone()) }));
    for (what, r) in [("an earlier question's state", round(7, Some("s1"))), ("no state", round(3, None))] {
        let step = after_claim(exists(read.clone()), &r, &p, OnUnavailable::Reject, LOCAL);
        assert!(matches!(step, Answered::Next(Step::Replay { .. })), "{what}: {step:?}");
    }
}

/// Issue 40: with a store, the local copy of an MCP call awaiting input never answers: a round
/// run on another proxy since may have moved the call on (another question), so the store's
/// value decides. Without a store the local tier is the call's state and answers (a replay of
/// the question, or the next round continued by the machine). Before this rule a proxy whose
/// local copy held question 1 answered round 3 (answering question 2, asked by another proxy)
/// with question 1 (`mcp::a_call_that_asks_more_than_64_times_is_kept_as_answered_at_the_65th_question`).
#[test]
fn with_a_store_a_local_copy_of_a_call_awaiting_input_is_asked_of_the_store() {
    let response = StoredResponse { status: 200, headers: vec![], body: b"{\"q\":1}".to_vec() };
    let mut awaiting = Record::completed(fp(1), response.clone(), false, creator(), LOCAL, 60);
    awaiting.state = State::AwaitingInput(Box::new(crate::record::Awaiting::new([1; 32], vec![], response.clone())));
    assert_eq!(
        after_local(Ok(Begin::Replay(awaiting.clone())), Some(fp(1)), REJECT, LOCAL),
        Step::ClaimInStore { handle: None, fp: fp(1) }
    );
    assert_eq!(after_local(Ok(Begin::Replay(awaiting.clone())), None, REJECT, LOCAL), Step::PauseForBody);
    assert_eq!(
        after_local(Ok(Begin::Replay(awaiting.clone())), Some(fp(1)), None, LOCAL),
        Step::Replay { record: awaiting, cache: None }
    );
    // A final record is still replayed from the local copy with a store.
    let done = Record::completed(fp(1), response, false, creator(), LOCAL, 60);
    assert_eq!(
        after_local(Ok(Begin::Replay(done.clone())), Some(fp(1)), REJECT, LOCAL),
        Step::Replay { record: done, cache: None }
    );
}

/// Review (h-review3): under `on_unavailable: "pass"` a store failure forwards the key
/// unprotected, so (as for a local outcome-unknown, above) a local answer must stand rather than
/// be asked of the store. Round 1 of an MCP call ran on this proxy and asked for input (the local
/// copy is its awaiting record); the store becomes unreachable; the client re-sends round 1
/// (the round that asked: `Record::round` says `Asked`, the local copy would replay its
/// question). With the awaiting-copy rule the request goes to the store, the store fails, and
/// round 1 is forwarded unprotected: its tool step executes a second time.
#[test]
fn under_pass_a_round_the_local_copy_shows_ran_is_never_forwarded_unprotected_when_the_store_fails() {
    let question = crate::record::question_for_tests("s1");
    let mut awaiting = Record::completed(fp(1), question.clone(), false, creator(), LOCAL, 60);
    awaiting.state = State::AwaitingInput(Box::new(crate::record::Awaiting::new([1; 32], vec![], question)));
    // Round 1 re-sent: the round that asked (its digest, no state echoed).
    let resent = crate::record::RoundId { digest: [1; 32], state: None };
    assert_eq!(awaiting.round(Some(&resent)), crate::record::Round::Asked, "round 1 ran: its question is its answer");
    let step = after_local(Ok(Begin::Replay(awaiting)), Some(fp(1)), Some(OnUnavailable::Pass), LOCAL);
    // Where the request ends if the store then fails (what `machine` runs for a failed call).
    let then = match &step {
        Step::ClaimInStore { .. } => after_store_failure(&policy(), OnUnavailable::Pass),
        other => other.clone(),
    };
    assert_ne!(
        then,
        Step::PassUnprotected,
        "round 1, re-sent after it ran, is forwarded unprotected when the store fails under pass (after_local: {step:?})"
    );
}
