//! The request machine's decisions, sans-IO: what a protected request does next given what it
//! met (the local tier's answer, the fingerprint, the store's answer to the call it sent) and
//! the policy it runs under. Each function takes facts and returns a [`Step`], a command the HTTP
//! context (`src/filter/http.rs`) executes with host calls (claim in the store, forward, reply,
//! replay, wait). Nothing here reads a clock, the host or shared data: time comes in as `now`.
//!
//! ```text
//! headers / body end ─ local tier answered ─▶ after_local ─▶ WaitForBody | ClaimInStore | Forward
//!                                                          | Replay | InFlight | Reply | ReadSettled
//! claim-or-read answered ─▶ after_claim     ─▶ Forward | TooLate | Replay | InFlight | Reply
//!                                                | MarkUnknown | TakeOver | Unreadable | Resend | Lost
//! take-over answered     ─▶ after_take_over ─▶ Forward | TooLate | Reply(409) | Resend | Lost
//!   (Resend, Lost and TooLate are `Answered`'s: they need the call they answer)
//! settlement read answered ─▶ after_settled_read ─▶ Replay | Reply | UnknownStands
//! store failed           ─▶ after_store_failure ─▶ PassUnprotected | Reply
//! ```
//!
//! Every "cannot happen" answer is a [`Step::FailClosed`], which has no way to forward.

use crate::admin;
use crate::config::{Forwarding, OnUnavailable, Policy};
use crate::decision::{decide, Decision, Lookup, IN_FLIGHT_RETRY_AFTER_SECONDS, UNAVAILABLE_RETRY_AFTER_SECONDS};
use crate::failsafe::Broken;
use crate::fingerprint::Fingerprint;
use crate::local::{Begin, Handle, LocalError};
use crate::owner::OwnerToken;
use crate::problem::ProblemKind;
use crate::record::{Creator, Lifetimes, Record, Stage};
use crate::store::{ClaimReply, ReadReply, StoreError, StoredValue, TransitionReply, ValueError};

/// What the request does next. `release`: a local claim to free before answering.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Wait for the whole body, holding `handle` (a local claim) if set.
    WaitForBody { handle: Option<Handle> },
    /// Pause until the body, holding nothing: a local outcome-unknown the store is asked to
    /// settle once the fingerprint is known.
    PauseForBody,
    /// Send the store a claim-or-read, holding `handle` meanwhile.
    ClaimInStore { handle: Option<Handle>, fp: Fingerprint },
    /// Read (never claim) what the store holds for a key held here as outcome-unknown.
    ReadSettled { fp: Fingerprint },
    /// Forward under the claim(s) held, whose lock runs from `lock_from_ms` (the store claim's
    /// send, or now for the local tier's).
    Forward { handle: Option<Handle>, fp: Fingerprint, in_store: bool, lock_from_ms: u64 },
    /// Replay this record; `cache`: a local claim to complete with it first (a store replay).
    Replay { record: Record, cache: Option<Handle> },
    /// The key is in flight: 409, or held until its first attempt ends (`in_flight: "wait"`,
    /// which needs the fingerprint: before it, wait for the body).
    InFlight { creator: Option<Creator>, release: Option<Handle>, fp: Option<Fingerprint> },
    /// Answer with this problem.
    Reply { problem: ProblemKind, creator: Option<Creator>, release: Option<Handle> },
    /// The store's claim is stale and was forwarded: mark it outcome-unknown (owner-checked
    /// against `old_owner`), then answer outcome-unknown.
    MarkUnknown { old_owner: OwnerToken, creator: Creator, release: Option<Handle> },
    /// Replace the store's record (stale lock, or free) in one more round trip.
    TakeOver { handle: Option<Handle>, fp: Fingerprint, old: Box<StoredValue>, free: bool },
    /// The key holds a record that cannot be read: nothing was claimed; answer `problem`.
    Unreadable { why: ValueError, problem: ProblemKind, release: Option<Handle> },
    /// The local outcome-unknown stands (the store holds no record that settles it).
    UnknownStands { unreadable: Option<ValueError> },
    /// The local tier failed: 503.
    LocalFailed(LocalError),
    /// The store is unavailable with `on_unavailable: "pass"`: forward unprotected.
    PassUnprotected,
    /// A broken invariant: 503 `internal-state` (`failsafe::refuse`), never forward.
    FailClosed { broken: Broken, branch: &'static str, handle: Option<Handle> },
}

/// What a request paused on a store call does with its answer: something only that call's
/// context can do (send it again, release what it may have claimed), or a next `Step`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answered {
    /// Redis lacks the script: send the same call again with its script in full.
    Resend,
    /// The call's answer is lost or garbled: it may have landed; release it owner-checked, then
    /// answer as for a store failure.
    Lost {
        error: StoreError,
    },
    /// The store claimed the key for us, but its answer came too late for the claim's lock:
    /// released owner-checked and answered 503, never forwarded.
    TooLate {
        waited_ms: u64,
        lock_ms: u64,
        run_ms: u64,
    },
    Next(Step),
}

/// The store a request runs with: `None` without one, else its `on_unavailable`.
pub type StoreMode = Option<OnUnavailable>;

/// The local tier answered `begin` (`fp`: the fingerprint once the body is complete; `now_ms`:
/// this proxy's clock).
pub fn after_local(begun: Result<Begin, LocalError>, fp: Option<Fingerprint>, store: StoreMode, now_ms: u64) -> Step {
    match begun {
        Ok(Begin::Claimed { handle, .. }) => match fp {
            Some(fp) => after_fingerprint(Some(handle), fp, store, now_ms),
            None => Step::WaitForBody { handle: Some(handle) },
        },
        Ok(Begin::Replay(record)) => Step::Replay { record, cache: None },
        // With a store, the store settles a key whose outcome is unknown (an operator may have
        // released or completed it there): the local copy is asked again of the store. Only when
        // a store failure is answered 503 (`on_unavailable: "reject"`): under "pass" a failure
        // would forward the key unprotected, so the local answer stands.
        Ok(Begin::Reject { problem, .. }) if store == Some(OnUnavailable::Reject) && admin::store_settles(&problem) => {
            match fp {
                Some(fp) => Step::ReadSettled { fp },
                None => Step::PauseForBody,
            }
        }
        Ok(Begin::Reject { problem: ProblemKind::InFlight { .. }, creator, .. }) => {
            Step::InFlight { creator, release: None, fp }
        }
        Ok(Begin::Reject { problem, creator, .. }) => Step::Reply { problem, creator, release: None },
        Ok(Begin::NeedFingerprint) => Step::WaitForBody { handle: None },
        // With a store, the local tier is a cache: a full bucket only means no local copy.
        Ok(Begin::Full) if store.is_some() => match fp {
            Some(fp) => after_fingerprint(None, fp, store, now_ms),
            None => Step::WaitForBody { handle: None },
        },
        Ok(Begin::Full) => Step::Reply {
            problem: ProblemKind::CapacityExhausted { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS },
            creator: None,
            release: None,
        },
        Err(e) => Step::LocalFailed(e),
    }
}

/// The fingerprint is known and the local tier holds our claim (`handle`) or has no room: claim
/// in the store if there is one, else forward under the local claim.
pub fn after_fingerprint(handle: Option<Handle>, fp: Fingerprint, store: StoreMode, now_ms: u64) -> Step {
    match (store, handle) {
        (Some(_), handle) => Step::ClaimInStore { handle, fp },
        (None, Some(handle)) => Step::Forward { handle: Some(handle), fp, in_store: false, lock_from_ms: now_ms },
        // Without a store, the local tier always holds the claim it forwards under.
        (None, None) => {
            Step::FailClosed { broken: Broken::ImpossibleDecision, branch: "proceed_without_claim", handle }
        }
    }
}

/// A store call this request is paused on: what it holds and when it was sent (this proxy's
/// clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sent {
    pub handle: Option<Handle>,
    pub fp: Fingerprint,
    pub sent_at_ms: u64,
}

/// The store claimed the key for us: forward, unless the answer came so late that the claim's
/// lock may already be judged stale (`Lifetimes::answer_in_time`).
fn claimed(sent: &Sent, policy: &Policy, now_ms: u64) -> Answered {
    let lifetimes = Lifetimes::of(policy);
    let run_ms = match policy.forwarding {
        Forwarding::Detached { timeout_ms, .. } => timeout_ms,
        Forwarding::Router => 0,
    };
    if lifetimes.answer_in_time(sent.sent_at_ms, now_ms, run_ms) {
        Answered::Next(Step::Forward {
            handle: sent.handle,
            fp: sent.fp,
            in_store: true,
            lock_from_ms: sent.sent_at_ms,
        })
    } else {
        Answered::TooLate { waited_ms: now_ms.saturating_sub(sent.sent_at_ms), lock_ms: lifetimes.lock_ms, run_ms }
    }
}

/// The store answered our claim-or-read (`now_ms`: this proxy's clock; the record is judged by
/// the store's clock, which the answer carries).
pub fn after_claim(
    reply: Result<ClaimReply, StoreError>,
    sent: &Sent,
    policy: &Policy,
    on_unavailable: OnUnavailable,
    now_ms: u64,
) -> Answered {
    let (handle, fp) = (sent.handle, sent.fp);
    let (store_now, expires_at, value) = match reply {
        Ok(ClaimReply::Claimed { .. }) => return claimed(sent, policy, now_ms),
        Ok(ClaimReply::Exists { now_ms, expires_at_ms, value }) => (now_ms, expires_at_ms, value),
        // The key holds a record we cannot read: nothing was claimed, and it is no outage.
        Ok(ClaimReply::Unreadable { now_ms, why }) => {
            let problem = match decide(Lookup::Unreadable, Some(&sent.fp), now_ms, policy, on_unavailable) {
                Decision::Reject(p) => p,
                _ => ProblemKind::RecordUnreadable { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS },
            };
            return Answered::Next(Step::Unreadable { why, problem, release: handle });
        }
        // Nothing ran: the same call again, with the script.
        Ok(ClaimReply::NoScript) => return Answered::Resend,
        Err(error) => return Answered::Lost { error },
    };
    // Judged by the store's clock only: its now, the key's expiry, the lock's.
    let step = match decide(Lookup::Found(value.summary(expires_at)), Some(&fp), store_now, policy, on_unavailable) {
        // A completed record never changes: keep a copy so the next replay needs no store call,
        // ending with the store's key by this proxy's clock.
        Decision::Replay => {
            Step::Replay { record: value.record_on_clock(store_now, expires_at, now_ms), cache: handle }
        }
        Decision::Reject(ProblemKind::InFlight { .. }) => {
            Step::InFlight { creator: Some(value.record.creator), release: handle, fp: Some(fp) }
        }
        Decision::Reject(problem) => Step::Reply { problem, creator: Some(value.record.creator), release: handle },
        Decision::MarkUnknown => {
            Step::MarkUnknown { old_owner: value.owner, creator: value.record.creator, release: handle }
        }
        // A stale lock with `stale_lock: "takeover"`, or a record the store still holds that is
        // free (past its expiry, no live lock): replace it, owner-checked.
        Decision::TakeOver => Step::TakeOver { handle, fp, old: Box::new(value), free: false },
        Decision::Claim => Step::TakeOver { handle, fp, old: Box::new(value), free: true },
        // Neither can follow from a value read with a fingerprint: never forward on it.
        Decision::PassUnprotected | Decision::NeedFingerprint => {
            Step::FailClosed { broken: Broken::ImpossibleDecision, branch: "store_answer_decision", handle }
        }
    };
    Answered::Next(step)
}

/// The store answered our take-over.
pub fn after_take_over(
    reply: Result<TransitionReply, StoreError>,
    sent: &Sent,
    policy: &Policy,
    now_ms: u64,
) -> Answered {
    match reply {
        // A take-over never writes where the key is absent (`WhereAbsent::Refuse`).
        Ok(TransitionReply::Changed | TransitionReply::ClaimGoneRewritten) => claimed(sent, policy, now_ms),
        // Nothing was written: another request holds the key now (never held for a wait).
        Ok(TransitionReply::Refused | TransitionReply::Absent) => Answered::Next(Step::Reply {
            problem: ProblemKind::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS },
            creator: None,
            release: sent.handle,
        }),
        Ok(TransitionReply::NoScript) => Answered::Resend,
        Err(error) => Answered::Lost { error },
    }
}

/// The store answered the read of a key held here as outcome-unknown. Only a record settles it:
/// a completion is replayed, another request's claim running now is in flight; an absent key is
/// no proof the key never ran (the store may have lost or expired it), so the local
/// outcome-unknown stands, as it does when the store cannot be read.
pub fn after_settled_read(reply: Result<ReadReply, StoreError>, fp: &Fingerprint, mismatch_status: u16) -> Step {
    match reply {
        Ok(ReadReply::Unreadable(why)) => Step::UnknownStands { unreadable: Some(why) },
        Ok(ReadReply::Found(v)) if v.record.fingerprint != *fp => {
            Step::Reply { problem: ProblemKind::KeyReused { status: mismatch_status }, creator: None, release: None }
        }
        Ok(ReadReply::Found(v)) if v.phase == Stage::Completed => Step::Replay { record: v.record, cache: None },
        Ok(ReadReply::Found(v)) if v.phase == Stage::Forwarded => Step::Reply {
            problem: ProblemKind::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS },
            creator: None,
            release: None,
        },
        _ => Step::UnknownStands { unreadable: None },
    }
}

/// The store could not be asked or did not answer: 503 (`reject`) or forward unprotected (`pass`).
pub fn after_store_failure(policy: &Policy, on_unavailable: OnUnavailable) -> Step {
    match decide(Lookup::StoreError, None, 0, policy, on_unavailable) {
        Decision::PassUnprotected => Step::PassUnprotected,
        Decision::Reject(problem) => Step::Reply { problem, creator: None, release: None },
        _ => Step::FailClosed { broken: Broken::ImpossibleDecision, branch: "store_failed_decision", handle: None },
    }
}

#[cfg(test)]
mod tests;
