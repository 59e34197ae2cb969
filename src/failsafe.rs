//! What the filter does when it meets one of its own invariants broken (a "cannot happen"
//! branch: a phase mismatch, a policy or request state gone, an impossible decision, a host
//! call that failed while building the claim). One rule, here, for every such branch: refuse
//! with 503 `internal-state` and never forward. A refusal has no variant that forwards, so the
//! glue that calls this cannot choose to let the request through.

use crate::decision::UNAVAILABLE_RETRY_AFTER_SECONDS;
use crate::problem::ProblemKind;

/// Which invariant was found broken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Broken {
    /// The request's policy index selects no policy.
    PolicyMissing,
    /// A protected request has no request state (head, key, owner).
    RequestMissing,
    /// A callback met the request in a phase it is never called in.
    PhaseMismatch,
    /// A tier answered with a decision that cannot follow from what it was asked.
    ImpossibleDecision,
    /// A store step without a configured store.
    StoreMissing,
    /// A host call needed to protect the request failed.
    HostCallFailed,
}

impl Broken {
    pub fn as_str(self) -> &'static str {
        match self {
            Broken::PolicyMissing => "policy_missing",
            Broken::RequestMissing => "request_missing",
            Broken::PhaseMismatch => "phase_mismatch",
            Broken::ImpossibleDecision => "impossible_decision",
            Broken::StoreMissing => "store_missing",
            Broken::HostCallFailed => "host_call_failed",
        }
    }
}

/// What the request holds when the invariant breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holding {
    /// No claim.
    Nothing,
    /// A local claim, never forwarded.
    LocalClaim,
    /// A store claim (or take-over) was sent and may have landed; never forwarded.
    StoreClaimSent,
    /// Already forwarded: its claim stays (judged outcome-unknown once its lock expires).
    Forwarded,
}

/// The one answer to a broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Always 503 `internal-state` with `retry-after`.
    pub problem: ProblemKind,
    /// Free the local claim (only when provably never forwarded).
    pub release_local: bool,
    /// Queue an owner-checked release of a store claim that may have landed.
    pub release_store: bool,
}

/// Refuses the request: nothing is forwarded; a claim is released only if the request provably
/// never left.
pub fn refuse(_broken: Broken, holding: Holding) -> Refusal {
    let problem = ProblemKind::InternalState { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS };
    match holding {
        Holding::Nothing => Refusal { problem, release_local: false, release_store: false },
        Holding::LocalClaim => Refusal { problem, release_local: true, release_store: false },
        Holding::StoreClaimSent => Refusal { problem, release_local: true, release_store: true },
        Holding::Forwarded => Refusal { problem, release_local: false, release_store: false },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const ALL_BROKEN: [Broken; 6] = [
        Broken::PolicyMissing,
        Broken::RequestMissing,
        Broken::PhaseMismatch,
        Broken::ImpossibleDecision,
        Broken::StoreMissing,
        Broken::HostCallFailed,
    ];
    const ALL_HOLDING: [Holding; 4] =
        [Holding::Nothing, Holding::LocalClaim, Holding::StoreClaimSent, Holding::Forwarded];

    #[test]
    fn every_broken_invariant_is_refused_with_503_internal_state_and_retry_after() {
        for b in ALL_BROKEN {
            for h in ALL_HOLDING {
                let r = refuse(b, h);
                let p = r.problem.to_problem("rid", None);
                assert_eq!(p.status, 503, "{b:?} {h:?}");
                let body: serde_json::Value = serde_json::from_slice(&p.body).unwrap();
                assert_eq!(body["type"], "urn:idemgate:problem:internal-state");
                assert!(p.headers.iter().any(|(n, v)| n == "retry-after" && v == "1"), "{b:?} {h:?}: {:?}", p.headers);
            }
        }
    }

    #[test]
    fn a_claim_is_released_only_when_the_request_provably_never_left() {
        for b in ALL_BROKEN {
            let forwarded = refuse(b, Holding::Forwarded);
            assert!(!forwarded.release_local && !forwarded.release_store, "{b:?}: a forwarded claim must stay");
            assert!(refuse(b, Holding::LocalClaim).release_local);
            assert!(!refuse(b, Holding::LocalClaim).release_store);
            let sent = refuse(b, Holding::StoreClaimSent);
            assert!(sent.release_local && sent.release_store, "{b:?}: a claim that may have landed is released");
            let none = refuse(b, Holding::Nothing);
            assert!(!none.release_local && !none.release_store);
        }
    }

    #[test]
    fn slugs_name_the_invariant() {
        let slugs: std::collections::HashSet<_> = ALL_BROKEN.iter().map(|b| b.as_str()).collect();
        assert_eq!(slugs.len(), ALL_BROKEN.len());
    }
}
