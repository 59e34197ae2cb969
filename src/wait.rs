//! Requests held while another attempt with their key runs (`in_flight: "wait"`): what to answer
//! from what a tier shows of that key, as soon as it is known.
//!
//! One rule for both tiers: the local tier is looked at on every tick, the store (when there is
//! one) polled at a bounded pace; each look is turned into a `Seen` and answered here.

use crate::decision::Phase;
use crate::decision::UNAVAILABLE_RETRY_AFTER_SECONDS;
use crate::fingerprint::Fingerprint;
use crate::local::Peeked;
use crate::problem::ProblemKind;
use crate::record::{Record, Stage, State};
use crate::store::ReadReply;

/// What one tier shows of the key a request waits on.
#[derive(Clone, Debug)]
pub enum Seen {
    /// No live record: the first attempt was released (it never executed), or its record expired.
    Absent,
    /// Claimed or forwarded, not finished.
    InFlight,
    /// Finished with a response; `record` is the stored record when this tier could read it,
    /// `status` the response status its index keeps.
    Completed { fingerprint: Option<Fingerprint>, record: Option<Record>, status: u16 },
    /// Finished without a known outcome.
    Unknown { fingerprint: Option<Fingerprint> },
    /// A value exists that this build cannot decode: never forwarded, never called absent.
    Unreadable,
}

impl Seen {
    /// What the local tier's index and slot show.
    pub fn from_local(p: Option<Peeked>) -> Seen {
        let Some(p) = p else { return Seen::Absent };
        match p.summary.phase {
            Phase::Claimed { .. } | Phase::Forwarded { .. } => Seen::InFlight,
            Phase::Completed => {
                Seen::Completed { fingerprint: p.summary.fingerprint, record: p.record, status: p.status }
            }
            Phase::Unknown => Seen::Unknown { fingerprint: p.summary.fingerprint },
        }
    }

    /// What the store's answer to a read shows.
    pub fn from_store(reply: ReadReply) -> Seen {
        let v = match reply {
            ReadReply::Absent => return Seen::Absent,
            ReadReply::Unreadable(_) => return Seen::Unreadable,
            ReadReply::Found(v) => v,
        };
        let fingerprint = Some(v.record.fingerprint);
        match v.phase {
            Stage::Claimed | Stage::Forwarded => Seen::InFlight,
            // No value read is absent (`store::stage_of_letter`): as outcome-unknown if one were.
            Stage::Unknown | Stage::Absent => Seen::Unknown { fingerprint },
            Stage::Completed => {
                let status = match &v.record.state {
                    State::Completed(r) => r.status,
                    State::CompletedTooLarge { status, .. } => *status,
                    _ => 0,
                };
                Seen::Completed { fingerprint, record: Some(v.record), status }
            }
        }
    }
}

/// Which tier the look came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Local,
    Store,
}

/// The answer to a waiting request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WaitAnswer {
    /// Not known yet: keep waiting (until `wait_ms`, then 409 `request-in-flight`).
    KeepWaiting,
    /// Replay this completed record.
    Replay(Record),
    /// Answer with this problem.
    Problem(ProblemKind),
    /// The first attempt was released without executing: the client may retry at once
    /// (409 `request-in-flight` with `retry-after: 0`).
    RetryNow,
}

/// What to answer a request waiting with fingerprint `fp`, from what `tier` shows. With a store,
/// the store is the authority: a local tier that shows nothing, or a completion whose response it
/// does not hold, leaves the answer to the store's poll. `mismatch_status` is the policy's status
/// for a key reused with another request.
pub fn answer(seen: Seen, tier: Tier, fp: &Fingerprint, has_store: bool, mismatch_status: u16) -> WaitAnswer {
    let other_request = |f: Option<Fingerprint>| f.is_some_and(|f| f != *fp);
    match seen {
        Seen::InFlight => WaitAnswer::KeepWaiting,
        Seen::Unreadable => {
            WaitAnswer::Problem(ProblemKind::RecordUnreadable { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS })
        }
        Seen::Absent if tier == Tier::Local && has_store => WaitAnswer::KeepWaiting,
        Seen::Absent => WaitAnswer::RetryNow,
        Seen::Completed { fingerprint, .. } | Seen::Unknown { fingerprint } if other_request(fingerprint) => {
            WaitAnswer::Problem(ProblemKind::KeyReused { status: mismatch_status })
        }
        Seen::Unknown { .. } => WaitAnswer::Problem(ProblemKind::OutcomeUnknown),
        // With a store, this proxy's copy of an MCP call awaiting input is not the call's state
        // (a round may run, or have run, through another proxy: `request::after_local`): the
        // store's poll decides.
        Seen::Completed { record: Some(r), .. }
            if tier == Tier::Local && has_store && matches!(r.state, State::AwaitingInput(_)) =>
        {
            WaitAnswer::KeepWaiting
        }
        // A round of an MCP call that asked for input: which round the waiter is decides its
        // answer (`Record::round`), so it asks again at once and meets the record itself.
        Seen::Completed { record: Some(r), .. } if matches!(r.state, State::AwaitingInput(_)) => WaitAnswer::RetryNow,
        Seen::Completed { record: Some(r), .. }
            if matches!(r.state, State::Completed(_) | State::CompletedTooLarge { .. }) =>
        {
            WaitAnswer::Replay(r)
        }
        // It completed (it executed once) but this tier cannot give the response: the store may;
        // without one, say exactly that, never "outcome unknown".
        Seen::Completed { .. } if tier == Tier::Local && has_store => WaitAnswer::KeepWaiting,
        Seen::Completed { status, .. } => {
            WaitAnswer::Problem(ProblemKind::ResponseNotStored { status, location: None })
        }
    }
}

/// Whether the local tier's look at a key holds a waiter against a store's "absent"
/// (`answer_from_store`): anything but a clean absent, an unreadable table (`None`) too. `look` is
/// the one a tick answers waiters from (`engine::waiters::tick`). The rule the filter's root,
/// `engine::world` and the waiters' tests all read a poll's answer by.
pub fn local_holds(look: Option<Seen>) -> bool {
    !matches!(look, Some(Seen::Absent))
}

/// `answer` for the store's look, `local_holds` telling whether this proxy's local tier shows the
/// key at the moment the answer is read (in flight, finished, or unreadable: anything but
/// absent; asked only when it matters). A store that shows nothing while the local tier shows
/// the key is no release: another request here holds it (claimed at its body's end, its store
/// claim not yet landed), or the store's answer is older than the local tier's view (a read
/// answered before that claim landed, read after the first attempt finished here: the worker
/// reading it was busy). Telling the waiter to retry at once would send it into that claim, or
/// past the response it waits for. It keeps waiting: the local tier answers it at the next tick,
/// or the next poll does.
pub fn answer_from_store(
    seen: Seen,
    local_holds: impl FnOnce() -> bool,
    fp: &Fingerprint,
    mismatch_status: u16,
) -> WaitAnswer {
    if matches!(seen, Seen::Absent) && local_holds() {
        return WaitAnswer::KeepWaiting;
    }
    answer(seen, Tier::Store, fp, true, mismatch_status)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Creator, StoredResponse};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const FP: Fingerprint = Fingerprint([7; 32]);
    const OTHER: Fingerprint = Fingerprint([8; 32]);

    fn completed() -> Record {
        Record {
            fingerprint: FP,
            created_at_ms: 0,
            expires_at_ms: 10,
            creator: Creator::default(),
            state: State::Completed(StoredResponse { status: 201, headers: vec![], body: b"ok".to_vec() }),
        }
    }

    #[test]
    fn a_released_key_is_answered_at_once_by_the_authoritative_tier() {
        assert_eq!(answer(Seen::Absent, Tier::Store, &FP, true, 422), WaitAnswer::RetryNow);
        assert_eq!(answer(Seen::Absent, Tier::Local, &FP, false, 422), WaitAnswer::RetryNow);
        // With a store, a local miss says nothing: another proxy may hold the claim.
        assert_eq!(answer(Seen::Absent, Tier::Local, &FP, true, 422), WaitAnswer::KeepWaiting);
    }

    /// Found by an adversarial review: a waiter whose key another request on this proxy held
    /// locally, not yet in the store, was told "released, retry now" at its first store poll.
    #[test]
    fn a_store_miss_is_no_release_while_the_local_tier_holds_the_key_in_flight() {
        assert_eq!(answer_from_store(Seen::Absent, || true, &FP, 422), WaitAnswer::KeepWaiting);
        assert_eq!(answer_from_store(Seen::Absent, || false, &FP, 422), WaitAnswer::RetryNow);
        // Anything else the store shows is its answer, whatever the local tier holds.
        assert_eq!(
            answer_from_store(Seen::Unknown { fingerprint: Some(FP) }, || true, &FP, 422),
            WaitAnswer::Problem(ProblemKind::OutcomeUnknown)
        );
        assert_eq!(answer_from_store(Seen::InFlight, || false, &FP, 422), WaitAnswer::KeepWaiting);
    }

    #[test]
    fn a_completion_whose_response_this_tier_lacks_is_never_called_outcome_unknown() {
        let seen = || Seen::Completed { fingerprint: Some(FP), record: None, status: 201 };
        assert_eq!(
            answer(seen(), Tier::Local, &FP, false, 422),
            WaitAnswer::Problem(ProblemKind::ResponseNotStored { status: 201, location: None })
        );
        assert_eq!(answer(seen(), Tier::Local, &FP, true, 422), WaitAnswer::KeepWaiting, "the store may have it");
    }

    #[test]
    fn completed_unknown_in_flight_and_other_requests() {
        let r = completed();
        let seen = Seen::Completed { fingerprint: Some(FP), record: Some(r.clone()), status: 201 };
        assert_eq!(answer(seen, Tier::Local, &FP, false, 422), WaitAnswer::Replay(r.clone()));
        let seen = Seen::Completed { fingerprint: Some(FP), record: Some(r), status: 201 };
        assert_eq!(
            answer(seen, Tier::Store, &OTHER, true, 422),
            WaitAnswer::Problem(ProblemKind::KeyReused { status: 422 })
        );
        for tier in [Tier::Local, Tier::Store] {
            let unknown = Seen::Unknown { fingerprint: Some(FP) };
            assert_eq!(answer(unknown, tier, &FP, true, 422), WaitAnswer::Problem(ProblemKind::OutcomeUnknown));
            let unknown = Seen::Unknown { fingerprint: Some(FP) };
            assert_eq!(
                answer(unknown, tier, &OTHER, true, 422),
                WaitAnswer::Problem(ProblemKind::KeyReused { status: 422 })
            );
            assert_eq!(answer(Seen::InFlight, tier, &FP, true, 422), WaitAnswer::KeepWaiting);
        }
        assert!(matches!(
            answer(
                Seen::from_store(ReadReply::Unreadable(crate::store::ValueError::Unreadable("garbled".into()))),
                Tier::Store,
                &FP,
                true,
                422
            ),
            WaitAnswer::Problem(ProblemKind::RecordUnreadable { .. })
        ));
    }
}
