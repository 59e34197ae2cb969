//! Envoy's internal redirects in the native build: the host glue of `idemgate::redirect`, as
//! `src/filter/http.rs` and `src/filter/settle.rs` are the Wasm build's.
//!
//! A forwarded stream that ends with response code details `internal_redirect` (read through
//! the ABI's string accessor, `response.code_details`) hands its claim over
//! (`Machine::redirected_away`, then `Command::HandOver`): the claim is posted to its
//! configuration's list (`Redirects`, one per configuration, shared by every worker behind one
//! lock, read without it while empty). The stream Envoy re-creates for the target (the same
//! configuration, the same worker, the same downstream connection, created after the first
//! stream's end) takes it at its headers (`Filter::continue_redirect`, `machine::take_handoff`),
//! or, on an MCP route whose key is in the body, when the machine asks (`Io::take_handoff`),
//! and settles it with the final answer (`Machine::adopt`).
//!
//! What the Wasm build proves with its VM's context ids, this build proves with a count of the
//! hand-overs made (`Redirects::handed`): each stream notes the count when Envoy creates it
//! (`Filter::born`), each hand-over is posted under the count before it (and raises it), and
//! only a stream born after the hand-over (`born > from_context`) takes it: a stream already
//! open when the claim was handed over (another stream of the same HTTP/2 connection with a
//! forged `x-envoy-original-url`) never does. The rest is the core's (`Handoffs::take`): the
//! request's mark (its storage key, stored where the request is forwarded under its claim with
//! `host::mark` as an object with Envoy's life span `Request`, which Envoy carries into the
//! streams it re-creates for the request and no other: the same internal client's next request
//! on the same connection lacks it), the same connection (`connection.id`, the ABI's integer accessor; a hand-over without one is never
//! taken), the URL redirected from, the storage key (caller scope and key), the policy, and the
//! window (`HANDOFF_WINDOW_MS`). After 2^32 hand-overs the count wraps: a stream born then takes
//! nothing (its redirect is unfollowed: outcome-unknown, never a second execution).
//!
//! A claim nobody takes (the target's route runs without idemgate, the re-created stream never
//! comes, or is refused before this filter) is settled outcome-unknown when its window ends, by
//! the configuration's tick on the main thread (`Global::on_scheduled`), and counted
//! `idemgate.internal_redirects_unfollowed`; one pushed out of a full list (`MAX_HANDOFFS`) at
//! once, on the worker that pushed it. A configuration destroyed with claims in its list leaves
//! them held in the local tier or the store until their lock expires: outcome-unknown to a retry,
//! never released.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize};

use idemgate::decision::Outcome;
use idemgate::engine::forwards::Settle;
use idemgate::engine::machine::{self as engine_machine, settle_away};
use idemgate::record::UnknownReason;
use idemgate::redirect::{Handoffs, Stream, ORIGINAL_URL_HEADER, REDIRECT_CODE_DETAILS};
use idemgate::scope::CallerScope;

use super::detached::MainThread;
use super::*;

/// The claims handed over and, for each, since when its key is held (`idemgate.key_held_ms`,
/// recorded by the stream that settles it, as the Wasm build records it across a redirect).
#[derive(Default)]
struct List {
    handoffs: Handoffs<Claim>,
    held_since: HashMap<StorageKey, u64>,
}

impl List {
    /// Claims settled away from the list (expired, pushed out): their hold is not measured.
    fn forget(&mut self, gone: &[Handoff<Claim>]) {
        for h in gone {
            self.held_since.remove(&h.skey);
        }
    }
}

/// A configuration's claims handed over by redirected streams, not yet taken.
#[derive(Default)]
pub struct Redirects {
    list: Mutex<List>,
    /// How many claims the list holds (set under its lock): a stream's headers read it without
    /// the lock, and look no further while it is 0.
    waiting: AtomicUsize,
    /// Hand-overs made so far (wrapping): what a stream notes when it is created.
    handed: AtomicU32,
}

impl Redirects {
    /// What a stream created now notes (`Filter::born`): it takes only a claim handed over
    /// before this.
    pub fn born(&self) -> u32 {
        self.handed.load(Ordering::Acquire)
    }

    fn is_empty(&self) -> bool {
        self.waiting.load(Ordering::Acquire) == 0
    }

    /// Runs `f` on the list under its lock, the count of claims waiting set after it.
    fn with<T>(&self, f: impl FnOnce(&mut List) -> T) -> T {
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(&mut list);
        self.waiting.store(list.handoffs.len(), Ordering::Release);
        out
    }

    /// Posts a claim handed over by a stream of connection `connection` (`Command::HandOver`),
    /// its key held since `held_since`; claims pushed out of a full list are settled as
    /// unfollowed.
    #[allow(clippy::too_many_arguments)]
    pub fn hand_over(
        &self,
        g: &Global,
        claim: Claim,
        url: String,
        connection: Option<u64>,
        marked: bool,
        held_since: Option<u64>,
        now: u64,
    ) {
        host::log(LogLevel::Debug, &format!("idemgate: outcome=redirect_handed_over {} url={url}", claim.log));
        let pushed = self.with(|list| {
            if let Some(since) = held_since {
                list.held_since.insert(claim.skey, since);
            }
            // Under the lock: a stream created from here on is born after this hand-over.
            let from_context = self.handed.fetch_add(1, Ordering::AcqRel);
            let h = Handoff {
                skey: claim.skey,
                policy_index: claim.policy_index,
                url,
                connection,
                marked,
                from_context,
                posted_ms: now,
                claim,
            };
            let pushed = list.handoffs.post(h);
            list.forget(&pushed);
            pushed
        });
        for old in pushed {
            unfollowed(g, &old);
        }
    }

    /// The claim handed over under `skey` and policy `policy_index` by a stream redirected from
    /// `original_url` that a stream (`on`: its mark, its connection, `born` as its context) may
    /// take, taken (`Io::take_handoff`), with since when its key is held.
    pub fn take(
        &self,
        skey: &StorageKey,
        policy_index: usize,
        original_url: &[u8],
        on: Stream,
        now: u64,
    ) -> Option<(Handoff<Claim>, Option<u64>)> {
        if self.is_empty() {
            return None;
        }
        self.with(|list| {
            let h = list.handoffs.take(skey, policy_index, original_url, on, now)?;
            let since = list.held_since.remove(&h.skey);
            Some((h, since))
        })
    }

    /// Main thread, at the configuration's tick: the claims whose window ended, settled as
    /// unfollowed (outcome-unknown).
    pub fn expire(&self, g: &Global, now: u64) {
        if self.is_empty() {
            return;
        }
        let old = self.with(|list| {
            let old = list.handoffs.expire(now);
            list.forget(&old);
            old
        });
        for h in old {
            unfollowed(g, &h);
        }
    }
}

/// A claim whose re-created stream never took it: its first hop executed, so it is
/// outcome-unknown (never released: a retry must not run it again), counted
/// `internal_redirects_unfollowed`, as the Wasm root settles it (`filter::settle::unfollowed`).
fn unfollowed(g: &Global, h: &Handoff<Claim>) {
    g.metrics.inc_for(MetricsFrom::Config, Counter::RedirectsUnfollowed, Some(h.claim.policy_index));
    let detail = format!("code_details={REDIRECT_CODE_DETAILS} redirect_followed=false");
    let s = Settle { outcome: Outcome::Unknown(UnknownReason::Other), response: None, too_large: false, detail };
    let policy = g.config.policy_at(h.claim.policy_index);
    let mut main = MainThread::new(g, h.claim.policy_index);
    settle_away(&mut main, &h.claim, policy, g.store.is_some(), s);
}

impl Glue<'_> {
    /// `Command::HandOver`: the claim posted with what only the host knows (the connection, the
    /// time; the hand-over's count in `Redirects::hand_over`).
    pub(super) fn hand_over(&mut self, claim: Claim, url: String) {
        let connection = host::connection_id(self.envoy);
        let now = self.now();
        // The key's hold goes on: measured by the stream that settles the claim.
        let held_since = self.held_since.take();
        self.global.redirects.hand_over(self.global, claim, url, connection, *self.marked, held_since, now);
    }

    /// `Io::take_handoff` (an MCP call whose key its body names).
    pub(super) fn handoff_for(
        &mut self,
        skey: &StorageKey,
        policy_index: usize,
        original_url: &[u8],
    ) -> Option<Handoff<Claim>> {
        if self.global.redirects.is_empty() {
            return None;
        }
        let on = Stream {
            mark: host::read_mark(self.envoy),
            connection: host::connection_id(self.envoy),
            context_id: self.born,
        };
        let now = self.now();
        let (h, since) = self.global.redirects.take(skey, policy_index, original_url, on, now)?;
        *self.held_since = since;
        *self.marked = true;
        Some(h)
    }
}

impl Filter {
    /// A stream Envoy re-created for an internal redirect (the module's doc): it continues the
    /// claim its first stream handed over and settles it with the final answer. Anything else
    /// carrying `x-envoy-original-url` (a client can send it) is an ordinary request (`None`).
    pub(super) fn continue_redirect(&mut self, envoy: EnvoyPtr) -> Option<u32> {
        let redirects = &self.global.redirects;
        if redirects.is_empty() {
            return None;
        }
        let url = host::header(envoy, abi::REQUEST_HEADER, ORIGINAL_URL_HEADER)?;
        let on = Stream { mark: host::read_mark(envoy), connection: host::connection_id(envoy), context_id: self.born };
        let now = *self.clock.get_or_insert_with(host::now_ms);
        let config = &self.global.config;
        let taken: Option<(Handoff<Claim>, Arc<idemgate::config::Policy>, CallerScope, RequestHead)> =
            redirects.with(|list| {
                let policies = list.handoffs.policies_for(&url, on, now);
                if policies.is_empty() {
                    return None;
                }
                let head = RequestHead::from_pairs(host::all_headers(envoy, abi::REQUEST_HEADER));
                let (h, policy, scope) = engine_machine::take_handoff(
                    &mut list.handoffs,
                    &policies,
                    |i| config.shared_policy(i),
                    &head,
                    &url,
                    on,
                    now,
                )?;
                self.held_since = list.held_since.remove(&h.skey);
                Some((h, policy, scope, head))
            });
        let (h, policy, scope, head) = taken?;
        self.route = Some(h.claim.policy_index);
        self.marked = true;
        let (m, mut io) = self.split();
        Some(headers_status(m.adopt(&mut io, h, policy, head, scope)))
    }

    /// A forwarded stream that ended without a response reaching the filter: if Envoy ended it
    /// for an internal redirect (`response.code_details`, read only then), its claim is handed
    /// over (`true`); otherwise it is settled as any exchange. The code details read, for that.
    pub(super) fn redirected_away(&mut self, envoy: EnvoyPtr) -> (bool, Option<String>) {
        if !self.machine.wants_code_details() {
            return (false, None);
        }
        let details = code_details_of(envoy);
        let (m, mut io) = self.split();
        (m.redirected_away(&mut io, &details), Some(details))
    }
}

/// The stream's response code details (`response.code_details`), empty when it has none.
pub(super) fn code_details_of(envoy: EnvoyPtr) -> String {
    host::attribute_string(envoy, abi::ATTRIBUTE_RESPONSE_CODE_DETAILS)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}
