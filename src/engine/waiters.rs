//! Requests held by `in_flight: "wait"` until their key's first attempt finishes, as a sans-IO
//! machine over the root's list of waiters: the tick (with the time, whether each request can
//! still be answered, and what the local tier shows) and the store's answers to polls come in;
//! actions come out (answer this waiter so, poll the store for this key, report a record that
//! failed its seal). What a waiter is told is `wait::answer`'s rule, the same for both tiers; the
//! glue (`filter/mod.rs`) sends the polls and the answers.

use crate::backend::Backend;
use crate::decision::IN_FLIGHT_RETRY_AFTER_SECONDS;
use crate::fingerprint::Fingerprint;
use crate::problem::ProblemKind;
use crate::record::Record;
use crate::scope::StorageKey;
use crate::seal::Seal;
use crate::store::ReadReply;
use crate::wait::{self, Seen, Tier, WaitAnswer};

/// A waiting request asks the store at most this often.
pub const WAIT_STORE_POLL_MS: u64 = 300;

/// A request held until another attempt with its key finishes (`in_flight: "wait"`).
#[derive(Debug)]
pub struct Waiter {
    pub context_id: u32,
    pub skey: StorageKey,
    pub fp: Fingerprint,
    pub request_id: String,
    pub deadline_ms: u64,
    /// When it began to wait (`wait_ms`, the histogram).
    pub since_ms: u64,
    /// The policy's status for a key reused with another request.
    pub mismatch_status: u16,
    /// The policy's index, for per-route counters.
    pub policy_index: usize,
    pub next_store_poll_ms: u64,
    pub polling: bool,
    /// The request's `accept-encoding` lines: a replay decodes a coding they do not accept.
    pub accept_encoding: Vec<Vec<u8>>,
    /// The policy's `max_response_body_bytes`: the most a replay decodes.
    pub max_decoded_bytes: u64,
    /// The policy's `tombstone_seconds` (`Record::is_tombstone_for`).
    pub tombstone_seconds: u64,
}

/// What a waiter is answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// 409 `request-in-flight` with this `retry-after`: 0 when the first attempt was released
    /// (it never executed), `IN_FLIGHT_RETRY_AFTER_SECONDS` when the wait is over.
    InFlight { retry_after_seconds: u64 },
    /// Replay this completed record.
    Replay(Record),
    /// This problem (key reused, outcome unknown, record unreadable, response not stored).
    Problem(ProblemKind),
}

/// What the glue does next.
#[derive(Debug)]
pub enum Action {
    /// Answer the waiter (taken off the list) so.
    Answer(Box<Waiter>, Reply),
    /// Send the store read of `skey` for waiter `context_id`; report `poll_sent` if it went, and
    /// later `store_answered`.
    Poll { context_id: u32, skey: StorageKey },
    /// The store's record of a waiter's key failed its seal (`record_unauthentic`): count, log.
    Unauthentic { policy_index: usize, skey: StorageKey, why: String },
}

/// What `answer` means for a waiter at `now_ms`: a record to replay that is its key's tombstone
/// (`Record::is_tombstone`, the rule every replay keeps) is `key-expired` instead.
fn reply(answer: WaitAnswer, tombstone_seconds: u64, now_ms: u64) -> Option<Reply> {
    match answer {
        WaitAnswer::KeepWaiting => None,
        WaitAnswer::RetryNow => Some(Reply::InFlight { retry_after_seconds: 0 }),
        WaitAnswer::Replay(r) if r.is_tombstone_for(tombstone_seconds, now_ms) => {
            Some(Reply::Problem(ProblemKind::KeyExpired))
        }
        WaitAnswer::Replay(r) => Some(Reply::Replay(r)),
        WaitAnswer::Problem(kind) => Some(Reply::Problem(kind)),
    }
}

/// The root's tick over `waiters`: a waiter that can no longer be answered (`live` false) is
/// dropped; one the local tier answers (`local`: what it shows of a key, `None` if it cannot be
/// read now) is answered; one past its deadline gets 409; with a store (`has_store`), one not
/// polling asks the store every `WAIT_STORE_POLL_MS`.
pub fn tick(
    waiters: &mut Vec<Waiter>,
    now_ms: u64,
    has_store: bool,
    live: &dyn Fn(u32) -> bool,
    local: &mut dyn FnMut(&StorageKey) -> Option<Seen>,
) -> Vec<Action> {
    let mut out = vec![];
    let mut keep = Vec::with_capacity(waiters.len());
    for mut w in waiters.drain(..) {
        if !live(w.context_id) {
            continue;
        }
        // Unreadable now: the store (or the next tick) decides.
        let seen = local(&w.skey).unwrap_or(Seen::InFlight);
        if let Some(r) =
            reply(wait::answer(seen, Tier::Local, &w.fp, has_store, w.mismatch_status), w.tombstone_seconds, now_ms)
        {
            out.push(Action::Answer(Box::new(w), r));
            continue;
        }
        if now_ms >= w.deadline_ms {
            out.push(Action::Answer(
                Box::new(w),
                Reply::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS },
            ));
            continue;
        }
        if has_store && !w.polling && now_ms >= w.next_store_poll_ms {
            out.push(Action::Poll { context_id: w.context_id, skey: w.skey });
            w.next_store_poll_ms = now_ms.saturating_add(WAIT_STORE_POLL_MS);
        }
        keep.push(w);
    }
    *waiters = keep;
    out
}

/// The poll of waiter `context_id` went out: no other until it is answered.
pub fn poll_sent(waiters: &mut [Waiter], context_id: u32) {
    if let Some(w) = waiters.iter_mut().find(|w| w.context_id == context_id) {
        w.polling = true;
    }
}

/// The store answered waiter `context_id`'s poll (`status` `None`: no answer), read by `store`
/// with `seal`; `local_holds` tells whether this proxy's local tier shows a key now, in any
/// stage (`wait::answer_from_store`). An answer that cannot be read leaves the waiter for the next
/// poll.
#[allow(clippy::too_many_arguments)]
pub fn store_answered(
    waiters: &mut Vec<Waiter>,
    context_id: u32,
    status: Option<u16>,
    body: &[u8],
    store: Backend,
    seal: Option<&Seal>,
    now_ms: u64,
    local_holds: &mut dyn FnMut(&StorageKey) -> bool,
) -> Vec<Action> {
    let mut out = vec![];
    let Some(pos) = waiters.iter().position(|w| w.context_id == context_id) else { return out };
    let Some(w) = waiters.get_mut(pos) else { return out };
    w.polling = false;
    let Some(seal) = seal else { return out };
    let seen = match store.parse_read(status, body, &w.skey, seal, now_ms) {
        Ok(ReadReply::Unreadable(why)) if why.is_unauthentic() => {
            out.push(Action::Unauthentic { policy_index: w.policy_index, skey: w.skey, why: why.to_string() });
            Seen::from_store(ReadReply::Unreadable(why))
        }
        Ok(v) => Seen::from_store(v),
        // An unreadable answer: ask again at the next poll.
        Err(_) => return out,
    };
    let skey = w.skey;
    match reply(
        wait::answer_from_store(seen, || local_holds(&skey), &w.fp, w.mismatch_status),
        w.tombstone_seconds,
        now_ms,
    ) {
        None => {}
        Some(r) => out.push(Action::Answer(Box::new(waiters.remove(pos)), r)),
    }
    out
}

#[cfg(test)]
mod tests;
