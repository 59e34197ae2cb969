//! One lifecycle for a key, in every tier: the states (`Stage`), the events that move a key
//! between them (`Event`) and the one transition table (`next`), where every pair the lifecycle
//! does not allow is an explicit `Refusal`, never a silent no-op.
//!
//! The tiers only supply how they read and write atomically: the local tier computes every new
//! bucket entry with `next` inside one CAS of the bucket; the store tier builds each owner-checked
//! transition script's expected phases from `sources` (and its stale-lock check from
//! `needs_stale_lock`), and its claim script is the `Claim` row from `Absent`. Expiry and lock
//! rules are not repeated here: whether a record still holds its key is `Summary::is_free`, and
//! whether its lock is live is `Summary::lock_is_live` (both fed to `next` as `Facts`); how long
//! each stage lives is `record::Lifetimes::life_ms`.
//!
//! | from \ event | Claim | TakeOver(never fwd) | TakeOver(stale fwd) | Forward | Complete | Release | MarkUnknown | StaleToUnknown | Expire | Evict | Operator(Release / Complete / Forget) |
//! |---|---|---|---|---|---|---|---|---|---|---|---|
//! | absent | claimed / forwarded | WrongStage | WrongStage | WrongStage | WrongStage | WrongStage | WrongStage | WrongStage | WrongStage | WrongStage | WrongStage |
//! | claimed | if free (else Held) | if lock stale (else LockLive) | WrongStage | owner: forwarded | WrongStage | owner: absent | WrongStage | WrongStage | if free: absent (else Held) | InFlight | if lock stale: absent / completed / absent (else LockLive) |
//! | forwarded | if free (else Held) | WrongStage | if lock stale (else LockLive) | WrongStage | owner: completed | owner: absent | owner: unknown | if lock stale: unknown (else LockLive) | if free: absent (else Held) | InFlight | if lock stale: absent / completed / absent (else LockLive) |
//! | completed | if free (else Held) | WrongStage | WrongStage | WrongStage | WrongStage | WrongStage | WrongStage | WrongStage | if free: absent (else Held) | absent | WrongStage / WrongStage / absent |
//!
//! `Continue` (the next round of an MCP call awaiting input, `record::Round::Next`) leads from
//! `completed` to `forwarded` and is `WrongStage` from every other stage.
//! | unknown | if free (else Held) | WrongStage | WrongStage | WrongStage | WrongStage | WrongStage | WrongStage | WrongStage | if free: absent (else Held) | absent | absent / completed / absent |
//!
//! "owner:" cells refuse `NotOwner` when the caller does not hold the claim, and `Expired` when
//! the claim is free (past its expiry, lock expired: in the store its key is already gone); except
//! `Forward`: a claim made at headers that nobody replaced while its body was uploading is still
//! its key's only claim (the local tier checks that in the same CAS), and forwarding restarts its
//! lock. A claim or take-over
//! enters `claimed` when it is made before the fingerprint is known (the local tier, at request
//! headers) and `forwarded` otherwise. "Released" and "taken over" are no stages of their own: a
//! release leads to `absent`, a take-over to a claim with a new owner. The store holds no
//! never-forwarded claims: its claim script enters `forwarded` at once.

use crate::decision::{Phase, Summary};

pub use crate::record::Stage;

/// How a stale claim is taken over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TakeOver {
    /// A claim that was never forwarded, whose lock expired: its request provably never ran.
    NeverForwarded,
    /// A forwarded claim whose lock expired (`stale_lock: "takeover"`: at least once).
    StaleForwarded,
}

/// What happens to a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A new claim: of an absent key, or of a record that no longer holds its key (free).
    /// `forwarding`: the fingerprint is known and the request goes to the upstream at once.
    Claim { forwarding: bool },
    /// Replace another request's stale claim with one of our own.
    TakeOver { how: TakeOver, forwarding: bool },
    /// The next round of an MCP call awaiting input replaces its awaiting record (a completed
    /// stage: `record::State::AwaitingInput`) with a forwarded claim, whatever its expiry. The
    /// tier checks the record is awaiting and the round another (`record::Round::Next`) on the
    /// value it then compares (the local tier's bucket CAS, the owner in Redis's script, the
    /// revision in etcd): the lifecycle sees only its stage.
    Continue,
    /// The owner of a claim made at headers forwards it (the body is complete).
    Forward,
    /// The owner keeps the response.
    Complete,
    /// The owner frees the key: its request never executed.
    Release,
    /// The owner's request may have executed without a response.
    MarkUnknown,
    /// Anyone: a forwarded claim whose lock expired without a completion is outcome-unknown.
    StaleToUnknown,
    /// A record that no longer holds its key is dropped (a sweep, or a position reused).
    Expire,
    /// A finished record is dropped to make room (capacity).
    Evict,
    /// An operator settles a key (`idemgate-cli settle`): not its owner, and only once its
    /// request can no longer be running (a claim's lock expired). The CLI adds its own margin on
    /// top (the proxies' write window, `admin::plan`).
    Operator(Settlement),
}

/// What an operator does to a key (`admin::Settle`, without its response).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settlement {
    /// Free a claim or an outcome-unknown key: the next retry executes.
    Release,
    /// Store the response found upstream for a claim or an outcome-unknown key.
    Complete,
    /// Delete the record, whatever its stage (a completed one too).
    Forget,
}

impl Event {
    /// Every event, for tables and tests.
    pub const ALL: [Event; 17] = [
        Event::Claim { forwarding: false },
        Event::Claim { forwarding: true },
        Event::TakeOver { how: TakeOver::NeverForwarded, forwarding: false },
        Event::TakeOver { how: TakeOver::NeverForwarded, forwarding: true },
        Event::TakeOver { how: TakeOver::StaleForwarded, forwarding: true },
        Event::TakeOver { how: TakeOver::StaleForwarded, forwarding: false },
        Event::Forward,
        Event::Continue,
        Event::Complete,
        Event::Release,
        Event::MarkUnknown,
        Event::StaleToUnknown,
        Event::Expire,
        Event::Evict,
        Event::Operator(Settlement::Release),
        Event::Operator(Settlement::Complete),
        Event::Operator(Settlement::Forget),
    ];
}

/// Why the lifecycle refuses an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The event cannot happen in this stage.
    WrongStage { from: Stage, event: Event },
    /// The caller does not hold the claim.
    NotOwner,
    /// The record still holds its key (not past its expiry, or its lock is live).
    Held,
    /// The claim's lock is live.
    LockLive,
    /// A claim in flight is never evicted.
    InFlight,
    /// The claim no longer holds its key (past its expiry, its lock expired): its owner can no
    /// longer move it (in the store its key is gone, `PX`).
    Expired,
}

/// What the rules need to know about the record an event meets, besides its stage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    /// The caller holds this claim (its owner token matches).
    pub owner: bool,
    /// `Summary::lock_is_live` at the event's instant.
    pub lock_live: bool,
    /// `Summary::is_free` at the event's instant.
    pub free: bool,
}

impl Facts {
    /// The facts about `summary` at `now_ms` (by the clock of the tier that holds it), for a
    /// caller that holds the claim when `owner`.
    pub fn of(summary: &Summary, now_ms: u64, owner: bool) -> Facts {
        Facts { owner, lock_live: summary.lock_is_live(now_ms), free: summary.is_free(now_ms) }
    }
}

impl Summary {
    /// The record's stage in the lifecycle.
    pub fn stage(&self) -> Stage {
        match self.phase {
            Phase::Claimed { .. } => Stage::Claimed,
            Phase::Forwarded { .. } => Stage::Forwarded,
            Phase::Completed => Stage::Completed,
            Phase::Unknown => Stage::Unknown,
        }
    }
}

/// The one transition table: the stage `event` leads to from `from`, or why it is refused.
pub fn next(from: Stage, event: Event, facts: Facts) -> Result<Stage, Refusal> {
    use Stage::{Absent, Claimed, Completed, Forwarded, Unknown};
    let wrong = Err(Refusal::WrongStage { from, event });
    let claim_stage = |forwarding: bool| if forwarding { Forwarded } else { Claimed };
    let by_owner = |to: Stage| if facts.owner { Ok(to) } else { Err(Refusal::NotOwner) };
    match (from, event) {
        (Absent, Event::Claim { forwarding }) => Ok(claim_stage(forwarding)),
        (Claimed | Forwarded, Event::Complete | Event::Release | Event::MarkUnknown) if facts.free => {
            Err(Refusal::Expired)
        }
        (Absent, _) => wrong,
        (_, Event::Claim { .. } | Event::Expire) if !facts.free => Err(Refusal::Held),
        (_, Event::Claim { forwarding }) => Ok(claim_stage(forwarding)),
        (_, Event::Expire) => Ok(Absent),
        (Claimed, Event::TakeOver { how: TakeOver::NeverForwarded, forwarding })
        | (Forwarded, Event::TakeOver { how: TakeOver::StaleForwarded, forwarding }) => {
            if facts.lock_live {
                Err(Refusal::LockLive)
            } else {
                Ok(claim_stage(forwarding))
            }
        }
        (_, Event::TakeOver { .. }) => wrong,
        (Completed, Event::Continue) => Ok(Forwarded),
        (_, Event::Continue) => wrong,
        (Claimed, Event::Forward) => by_owner(Forwarded),
        (_, Event::Forward) => wrong,
        (Forwarded, Event::Complete) => by_owner(Completed),
        (_, Event::Complete) => wrong,
        (Claimed | Forwarded, Event::Release) => by_owner(Absent),
        (_, Event::Release) => wrong,
        (Forwarded, Event::MarkUnknown) => by_owner(Unknown),
        (_, Event::MarkUnknown) => wrong,
        (Forwarded, Event::StaleToUnknown) if facts.lock_live => Err(Refusal::LockLive),
        (Forwarded, Event::StaleToUnknown) => Ok(Unknown),
        (_, Event::StaleToUnknown) => wrong,
        (Claimed | Forwarded, Event::Evict) => Err(Refusal::InFlight),
        (Completed | Unknown, Event::Evict) => Ok(Absent),
        (Claimed | Forwarded, Event::Operator(_)) if facts.lock_live => Err(Refusal::LockLive),
        (Completed, Event::Operator(Settlement::Release | Settlement::Complete)) => wrong,
        (_, Event::Operator(Settlement::Release | Settlement::Forget)) => Ok(Absent),
        (_, Event::Operator(Settlement::Complete)) => Ok(Completed),
    }
}

/// The live stages `event` can leave (given the right facts): the stages a tier may expect to
/// find before it writes. The store tier's transition scripts take their expected phases from
/// here (`Absent` is the claim script's own case).
pub fn sources(event: Event) -> &'static [Stage] {
    use Stage::{Claimed, Completed, Forwarded, Unknown};
    match event {
        Event::Claim { .. } | Event::Expire => &[Claimed, Forwarded, Completed, Unknown],
        Event::TakeOver { how: TakeOver::NeverForwarded, .. } | Event::Forward => &[Claimed],
        Event::TakeOver { how: TakeOver::StaleForwarded, .. } | Event::MarkUnknown | Event::StaleToUnknown => {
            &[Forwarded]
        }
        Event::Release => &[Claimed, Forwarded],
        Event::Complete => &[Forwarded],
        Event::Evict => &[Completed, Unknown],
        Event::Continue => &[Completed],
        Event::Operator(Settlement::Release | Settlement::Complete) => &[Claimed, Forwarded, Unknown],
        Event::Operator(Settlement::Forget) => &[Claimed, Forwarded, Completed, Unknown],
    }
}

/// Whether the store tier writes the event's new stage where it finds its key absent (or a
/// release tombstone), instead of refusing: the store can lose a live key (`FLUSHALL`, an
/// eviction, a failover to a replica that never had it), and a completion or outcome-unknown mark
/// that vanished with it would let a retry execute again. The owner's request did run, so its key
/// must not read as free. The local tier never meets this: it loses a live entry only by its own
/// expiry, after which `next` refuses the owner (`Expired`). A key held by another owner or in
/// another stage is still refused (`NotOwner`, `WrongStage`).
pub fn store_writes_where_absent(event: Event) -> bool {
    matches!(event, Event::Complete | Event::MarkUnknown)
}

/// Whether the event needs the record's lock to have expired (a tier that cannot evaluate
/// `Facts` before writing, like the store's transition script, re-checks it atomically).
/// A claim of a free record needs it too: a record holding a live lock is never free.
pub fn needs_stale_lock(event: Event) -> bool {
    matches!(
        event,
        Event::Claim { .. } | Event::TakeOver { .. } | Event::StaleToUnknown | Event::Expire | Event::Continue
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const STAGES: [Stage; 5] = [Stage::Absent, Stage::Claimed, Stage::Forwarded, Stage::Completed, Stage::Unknown];

    fn all_facts() -> Vec<Facts> {
        let mut v = vec![];
        for owner in [false, true] {
            for lock_live in [false, true] {
                for free in [false, true] {
                    v.push(Facts { owner, lock_live, free });
                }
            }
        }
        v
    }

    #[test]
    fn sources_are_exactly_the_live_stages_an_event_can_leave() {
        for event in Event::ALL {
            for from in STAGES.into_iter().filter(|s| *s != Stage::Absent) {
                let accepted = all_facts().into_iter().any(|f| next(from, event, f).is_ok());
                assert_eq!(accepted, sources(event).contains(&from), "{from:?} {event:?}");
            }
        }
    }

    #[test]
    fn only_the_owner_moves_its_claim_forward_or_settles_it() {
        for event in [Event::Forward, Event::Complete, Event::Release, Event::MarkUnknown] {
            for from in sources(event) {
                let f = Facts { owner: false, lock_live: true, free: false };
                assert_eq!(next(*from, event, f), Err(Refusal::NotOwner), "{from:?} {event:?}");
            }
        }
    }

    #[test]
    fn a_live_lock_is_never_taken_claimed_expired_or_evicted() {
        for from in [Stage::Claimed, Stage::Forwarded] {
            for event in Event::ALL {
                // A live lock is never free (`Summary::is_free`).
                let f = Facts { owner: false, lock_live: true, free: false };
                let to = next(from, event, f);
                assert!(to.is_err() || event == Event::Forward, "{from:?} {event:?} -> {to:?}");
            }
        }
    }

    /// A completed stage also leaves by `Continue`: an MCP call's awaiting record
    /// (`record::State::AwaitingInput`) is a completed stage its next round continues.
    #[test]
    fn a_finished_record_changes_only_by_expiring_being_evicted_an_operator_or_a_next_round() {
        for from in [Stage::Completed, Stage::Unknown] {
            for event in Event::ALL {
                for f in all_facts() {
                    let ok = next(from, event, f).is_ok();
                    let operator = match event {
                        Event::Operator(Settlement::Forget) => true,
                        Event::Operator(_) => from == Stage::Unknown,
                        _ => false,
                    };
                    let allowed = matches!(event, Event::Evict)
                        || operator
                        || (from == Stage::Completed && event == Event::Continue)
                        || (f.free && matches!(event, Event::Claim { .. } | Event::Expire));
                    assert_eq!(ok, allowed, "{from:?} {event:?} {f:?}");
                }
            }
        }
    }

    /// The decision table never chooses a transition the lifecycle refuses: every claim,
    /// take-over and stale-to-unknown `decide` answers is accepted by `next` on the same record.
    #[test]
    fn every_transition_the_decision_table_chooses_is_one_the_lifecycle_allows() {
        use crate::config::{OnUnavailable, Policy, StaleLock};
        use crate::decision::{decide, Decision, Lookup};
        use crate::fingerprint::Fingerprint;
        let now = 1_000_000;
        for stale_lock in [StaleLock::Reject, StaleLock::Takeover] {
            let policy = Policy { stale_lock, ..Policy::default() };
            for phase in [
                Phase::Claimed { lock_expires_at_ms: now - 1 },
                Phase::Claimed { lock_expires_at_ms: now + 1 },
                Phase::Forwarded { lock_expires_at_ms: now - 1 },
                Phase::Forwarded { lock_expires_at_ms: now + 1 },
                Phase::Completed,
                Phase::Unknown,
            ] {
                for expires_at_ms in [now - 1, now, now + 1] {
                    for fp in [None, Some(Fingerprint([1; 32]))] {
                        let summary = Summary { fingerprint: Some(Fingerprint([1; 32])), expires_at_ms, phase };
                        let facts = Facts::of(&summary, now, false);
                        let forwarding = fp.is_some();
                        let event =
                            match decide(Lookup::Found(summary), fp.as_ref(), now, &policy, OnUnavailable::Reject) {
                                Decision::Claim => Event::Claim { forwarding },
                                Decision::TakeOver if summary.stage() == Stage::Claimed => {
                                    Event::TakeOver { how: TakeOver::NeverForwarded, forwarding }
                                }
                                Decision::TakeOver => Event::TakeOver { how: TakeOver::StaleForwarded, forwarding },
                                Decision::MarkUnknown => Event::StaleToUnknown,
                                _ => continue,
                            };
                        assert!(next(summary.stage(), event, facts).is_ok(), "{summary:?} {fp:?} {event:?}");
                    }
                }
            }
        }
    }

    /// An operator never settles a key whose request may still run, and never rewrites a
    /// completed answer (only forgets it), whoever it is and whatever else holds.
    #[test]
    fn an_operator_settles_only_what_can_no_longer_run_and_never_rewrites_an_answer() {
        for from in [Stage::Claimed, Stage::Forwarded] {
            for how in [Settlement::Release, Settlement::Complete, Settlement::Forget] {
                for f in all_facts().into_iter().filter(|f| f.lock_live) {
                    assert_eq!(next(from, Event::Operator(how), f), Err(Refusal::LockLive), "{from:?} {how:?} {f:?}");
                }
            }
        }
        for f in all_facts() {
            for how in [Settlement::Release, Settlement::Complete] {
                assert!(next(Stage::Completed, Event::Operator(how), f).is_err(), "{how:?} {f:?}");
            }
            assert_eq!(next(Stage::Unknown, Event::Operator(Settlement::Complete), f), Ok(Stage::Completed));
            assert_eq!(next(Stage::Completed, Event::Operator(Settlement::Forget), f), Ok(Stage::Absent));
        }
    }

    /// Issue 40: the next round of a call awaiting input continues only a completed stage (its
    /// awaiting record), whoever asks and whatever its expiry, into a forwarded claim: never a
    /// claim in flight (a round running), an outcome-unknown key or an absent one.
    #[test]
    fn a_next_round_continues_only_a_completed_stage() {
        for from in STAGES {
            for f in all_facts() {
                let got = next(from, Event::Continue, f);
                match from {
                    Stage::Completed => assert_eq!(got, Ok(Stage::Forwarded), "{f:?}"),
                    _ => assert_eq!(got, Err(Refusal::WrongStage { from, event: Event::Continue }), "{from:?} {f:?}"),
                }
            }
        }
        assert_eq!(sources(Event::Continue), &[Stage::Completed]);
        assert!(needs_stale_lock(Event::Continue), "fenced by the value read in every store");
    }

    #[test]
    fn an_absent_key_can_only_be_claimed() {
        for event in Event::ALL {
            for f in all_facts() {
                assert_eq!(next(Stage::Absent, event, f).is_ok(), matches!(event, Event::Claim { .. }), "{event:?}");
            }
        }
    }
}
