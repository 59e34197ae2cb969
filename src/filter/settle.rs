//! What happens to a forwarded request's claim once its exchange is over: store the response,
//! release the key, or mark the outcome unknown, in the local tier now and in the store through
//! the root context. Shared by the router path (`on_log`) and detached forwarding (the root's
//! callout answer).

use log::debug;

use super::host::{self, Counter, HostShared};
use super::Shared;
use crate::decision::Outcome;
pub use crate::engine::settle::Claim;
use crate::engine::settle::{self as engine, Command, Count, Level, Local, LocalAnswer};
use crate::record::{StoredResponse, UnknownReason};
use crate::redirect::Handoff;

/// Applies `outcome` to the claim (`engine::settle` decides; this carries its commands out).
/// `detail` is appended to the log line. Returns the exchange's outcome slug (for Envoy's filter
/// state): `stored`, `stored-without-body`, `lost-claim`, `released`, `marked-unknown`,
/// `local-error` or `internal-state`.
pub fn settle(
    shared: &Shared,
    claim: &Claim,
    outcome: Outcome,
    response: Option<StoredResponse>,
    too_large: bool,
    detail: &str,
) -> &'static str {
    let policy = shared.config.policy_at(claim.policy_index);
    let now = host::now_ms();
    let has_store = shared.config.store.is_some();
    let (machine, cmds) = engine::start(claim, policy, has_store, outcome, response, too_large, detail, now);
    let mut answer = LocalAnswer::None;
    for c in cmds {
        if let Some(a) = run(shared, claim, c, now) {
            answer = a;
        }
    }
    let (cmds, slug) = machine.finish(answer);
    for c in cmds {
        run(shared, claim, c, now);
    }
    slug
}

/// Carries out one command; a local-tier operation's answer is returned.
fn run(shared: &Shared, claim: &Claim, c: Command<'_>, now: u64) -> Option<LocalAnswer> {
    let t = &shared.table;
    match c {
        Command::Write { what, transition, fallback } => {
            shared.push_write(what, &claim.skey, &transition, fallback.as_deref());
        }
        Command::Local(Local::Complete(h, record)) => {
            let done = t.complete(&mut HostShared, &h, *record, now).map_err(|e| format!("{e:?}"));
            return Some(LocalAnswer::Completed(done));
        }
        Command::Local(Local::Release(h)) => {
            return Some(LocalAnswer::Released(matches!(t.release(&mut HostShared, &h, now), Ok(true))));
        }
        Command::Local(Local::MarkUnknown(h, reason)) => {
            if let Some(policy) = shared.config.policy_at(claim.policy_index) {
                let _ = t.mark_unknown(&mut HostShared, &h, reason, now, policy);
            }
            return Some(LocalAnswer::Marked);
        }
        // The local release is counted as `release_local` counts it: not per route.
        Command::Count(Count::Released) => shared.metrics.inc(Counter::Released),
        Command::Count(c) => shared.metrics.inc_for(counter(c), Some(claim.policy_index)),
        Command::Log(level, line) => match level {
            Level::Error => log::error!("{line}"),
            Level::Warn => log::warn!("{line}"),
            Level::Info => log::info!("{line}"),
            Level::Debug => log::debug!("{line}"),
        },
    }
    None
}

fn counter(c: Count) -> Counter {
    match c {
        Count::InternalErrors => Counter::InternalErrors,
        Count::Stored => Counter::Stored,
        Count::StoredWithoutBody => Counter::StoredWithoutBody,
        Count::LostClaim => Counter::LostClaim,
        Count::LocalErrors => Counter::LocalErrors,
        Count::UnknownOutcome => Counter::UnknownOutcome,
        Count::Released => Counter::Released,
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
