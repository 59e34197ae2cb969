//! What happens to a forwarded request's claim once its exchange is over: store the response,
//! release the key, or mark the outcome unknown, in the local tier now and in the store through
//! the root context. The root's settlements (detached forwarding's callout answer, redirects never
//! followed) run `engine::machine::settle_claim`, as a request's own end does (`on_log`).

use log::debug;

use super::host::{self, Counter, Histogram, HostShared};
use super::Shared;
use crate::decision::Outcome;
use crate::engine::forwards::Settle;
use crate::engine::machine::{self, Command, Count, Effects, LogLevel as Level};
pub use crate::engine::settle::Claim;
use crate::local::{SharedData, Table};
use crate::record::{StoredResponse, UnknownReason};
use crate::redirect::Handoff;

/// Applies `outcome` to the claim (`engine::machine::settle_claim`, as a request's own end does;
/// this carries its commands out). `detail` is appended to the log line. Returns the exchange's
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
    let policy = shared.config.policy_at(claim.policy_index);
    let has_store = shared.config.store.is_some();
    let mut root = Root { shared, policy_index: claim.policy_index, now: host::now_ms(), sd: HostShared };
    if let Some(since) = shared.held_since(&claim.owner) {
        shared.metrics.record(Histogram::KeyHeldMs, root.now.saturating_sub(since));
    }
    let s = Settle { outcome, response, too_large, detail: detail.to_string() };
    machine::settle_away(&mut root, claim, policy, has_store, s)
}

/// The root's side of a settlement: the clock read once, the claim's route for counters.
struct Root<'a> {
    shared: &'a Shared,
    policy_index: usize,
    now: u64,
    sd: HostShared,
}

impl Effects for Root<'_> {
    fn logs(&self, level: Level) -> bool {
        host::logs(level)
    }

    fn now_ms(&mut self) -> u64 {
        self.now
    }

    fn local(&mut self) -> (&Table, &mut dyn SharedData) {
        (&self.shared.table, &mut self.sd)
    }

    fn run(&mut self, c: Command<'_>) {
        match c {
            Command::Write { what, skey, transition, fallback, .. } => {
                self.shared.push_write(what, &skey, *transition, fallback.map(|f| *f));
            }
            // The local release is counted as `release_local` counts it: not per route.
            Command::Count(Count::Released) => self.shared.metrics.inc(Counter::Released),
            Command::Count(c) => self.shared.metrics.inc_for(counter(c), Some(self.policy_index)),
            Command::Log(level, line) => host::log_line(level, &line),
            // A settlement gives no other command.
            _ => {}
        }
    }
}

pub use crate::metrics::counter;

/// A forwarded request's stream was ended by Envoy for an internal redirect: its claim waits
/// for the re-created stream (`crate::redirect`), which settles it with the final answer. Claims
/// pushed out (too many waiting) are settled as unfollowed.
pub fn hand_over(shared: &Shared, h: Handoff<Claim>) {
    debug!("idemgate: outcome=redirect_handed_over {} url={}", h.claim.log, h.url);
    let pushed = shared.handoffs.borrow_mut().post(h);
    for old in pushed {
        unfollowed(shared, &old);
    }
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
