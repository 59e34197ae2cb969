//! What happens to a forwarded request's claim once its exchange is over: store the response,
//! release the key, or mark the outcome unknown, in the local tier now and in the store through
//! the root context. Shared by the router path (`on_log`) and detached forwarding (the root's
//! callout answer).

use log::{debug, info, warn};

use super::host::{self, Counter, HostShared};
use super::Shared;
use crate::decision::Outcome;
use crate::fingerprint::Fingerprint;
use crate::local::{Completed, Handle};
use crate::owner::OwnerToken;
use crate::record::{Creator, Lifetimes, Record, StoredResponse, UnknownReason};
use crate::redirect::Handoff;
use crate::scope::StorageKey;
use crate::store::Transition;

/// What a forwarded request holds.
#[derive(Clone, Debug)]
pub struct Claim {
    pub handle: Option<Handle>,
    pub fp: Fingerprint,
    pub in_store: bool,
    pub owner: OwnerToken,
    pub skey: StorageKey,
    pub policy_index: usize,
    pub creator: Creator,
    /// The request's part of every log line (hashes, method, path, ids).
    pub log: String,
    /// MCP (`protocol: "mcp"`): the JSON-RPC id (JSON text) of the call; what is stored is its
    /// final response (`mcp::stored_response`).
    pub mcp_id: Option<Vec<u8>>,
}

/// The outcome slug of a forwarded exchange that met a broken invariant (its claim kept).
pub const INTERNAL_STATE: &str = "internal-state";

/// Applies `outcome` to the claim. `detail` is appended to the log line. Returns the exchange's
/// outcome slug (for Envoy's filter state): `stored`, `stored-without-body`, `lost-claim`,
/// `released`, `marked-unknown`, `local-error` or `internal-state`.
pub fn settle(
    shared: &Shared,
    claim: &Claim,
    outcome: Outcome,
    response: Option<StoredResponse>,
    too_large: bool,
    detail: &str,
) -> &'static str {
    let Some(policy) = shared.config.policy_at(claim.policy_index) else {
        // The claim stays as it is (a forwarded claim is judged outcome-unknown once its lock expires).
        shared.metrics.inc_for(Counter::InternalErrors, Some(claim.policy_index));
        log::error!("idemgate: outcome=internal_state branch=settle broken=policy_missing claim=kept {}", claim.log);
        return INTERNAL_STATE;
    };
    let now = host::now_ms();
    let t = &shared.table;
    let line = |outcome: &str, extra: &str| format!("idemgate: outcome={outcome} {} {extra}", claim.log);
    let lifetimes = Lifetimes::of(policy);
    // An MCP call's answer is a completion only with its final JSON-RPC response: an event stream
    // that ended before it leaves the call's outcome unknown (it may have run), never a success.
    let (outcome, response) = match (outcome, claim.mcp_id.as_deref(), response) {
        (Outcome::Store, Some(id), Some(r)) if !too_large => match crate::mcp::stored_response(r, id) {
            Ok(r) => (Outcome::Store, Some(r)),
            Err(why) => {
                info!("{}", line("mcp_no_final_response", &format!("{detail} why={why:?}")));
                (Outcome::Unknown(UnknownReason::Other), None)
            }
        },
        (o, _, r) => (o, r),
    };
    match outcome {
        Outcome::Store => {
            let response = response.unwrap_or(StoredResponse { status: 0, headers: vec![], body: vec![] });
            let record =
                Record::completed(claim.fp, response, too_large, claim.creator.clone(), now, policy.ttl_seconds);
            if claim.in_store && shared.config.store.is_some() {
                let gone =
                    Record::unknown(claim.fp, claim.creator.clone(), UnknownReason::StoreWriteFailed, now, &lifetimes);
                let unknown = Transition::unknown(claim.owner, gone, &lifetimes);
                let complete = Transition::complete(claim.owner, record.clone(), &lifetimes);
                shared.push_write("complete", &claim.skey, &complete, Some(&unknown));
            }
            match claim.handle.map(|h| t.complete(&mut HostShared, &h, record, now)) {
                Some(Ok(Completed::Stored)) | None => {
                    shared.metrics.inc_for(Counter::Stored, Some(claim.policy_index));
                    debug!("{}", line("stored", detail));
                    "stored"
                }
                Some(Ok(Completed::StoredWithoutBody)) => {
                    shared.metrics.inc_for(Counter::StoredWithoutBody, Some(claim.policy_index));
                    info!("{}", line("stored_without_body", detail));
                    "stored-without-body"
                }
                Some(Ok(Completed::LostClaim)) => {
                    shared.metrics.inc_for(Counter::LostClaim, Some(claim.policy_index));
                    info!("{}", line("lost_claim", detail));
                    "lost-claim"
                }
                Some(Err(e)) => {
                    shared.metrics.inc_for(Counter::LocalErrors, Some(claim.policy_index));
                    warn!("{}", line("store_failed", &format!("{detail} error={e:?}")));
                    "local-error"
                }
            }
        }
        Outcome::Release => {
            release_local(shared, claim.handle, now);
            if claim.in_store && shared.config.store.is_some() {
                shared.push_write("release", &claim.skey, &Transition::release(claim.owner), None);
            }
            info!("{}", line("released", detail));
            "released"
        }
        Outcome::Unknown(reason) => {
            if let Some(h) = claim.handle {
                let _ = t.mark_unknown(&mut HostShared, &h, reason, now, policy);
            }
            if claim.in_store && shared.config.store.is_some() {
                let gone = Record::unknown(claim.fp, claim.creator.clone(), reason, now, &lifetimes);
                shared.push_write("unknown", &claim.skey, &Transition::unknown(claim.owner, gone, &lifetimes), None);
            }
            shared.metrics.inc_for(Counter::UnknownOutcome, Some(claim.policy_index));
            info!("{}", line("unknown_outcome", &format!("{detail} reason={}", reason.as_str())));
            "marked-unknown"
        }
    }
}

/// A forwarded request's stream was ended by Envoy for an internal redirect: its claim waits
/// for the re-created stream (`crate::redirect`), which settles it with the final answer. Claims
/// pushed out (too many waiting) are settled as unfollowed.
pub fn hand_over(shared: &Shared, h: Handoff<Claim>) -> &'static str {
    debug!("idemgate: outcome=redirect_handed_over {} url={}", h.claim.log, h.url);
    let pushed = shared.handoffs.borrow_mut().post(h);
    for old in pushed {
        unfollowed(shared, &old);
    }
    "redirected"
}

/// Claims whose re-created stream never came within the window: the first hop executed, so
/// they are outcome-unknown (never released: a retry must not run it again).
pub fn unfollowed_redirects(shared: &Shared, now_ms: u64) {
    if shared.handoffs.borrow().is_empty() {
        return;
    }
    let old = shared.handoffs.borrow_mut().expire(now_ms);
    for h in old {
        unfollowed(shared, &h);
    }
}

fn unfollowed(shared: &Shared, h: &Handoff<Claim>) {
    shared.metrics.inc_for(Counter::RedirectsUnfollowed, Some(h.claim.policy_index));
    let detail = format!("code_details={} redirect_followed=false", crate::redirect::REDIRECT_CODE_DETAILS);
    settle(shared, &h.claim, Outcome::Unknown(UnknownReason::Other), None, false, &detail);
}

/// Releases a local claim (owner-checked) at `now_ms`, counting it.
pub fn release_local(shared: &Shared, handle: Option<Handle>, now_ms: u64) {
    if let Some(h) = handle {
        if let Ok(true) = shared.table.release(&mut HostShared, &h, now_ms) {
            shared.metrics.inc(Counter::Released);
        }
    }
}
