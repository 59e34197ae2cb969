//! What a finished exchange does to its claim, as a sans-IO machine: the claim, the exchange's
//! outcome (`decision::classify`), its response and the time come in; commands come out (push
//! this store write with this fallback, complete / release / mark unknown in the local tier,
//! count and log this), then, once the glue reports what the local tier answered, the rest
//! (count, log) and the exchange's outcome slug. Shared by the router path (`on_log`) and
//! detached forwards; the glue (`filter/settle.rs`) carries the commands out in order.
//!
//! Rules kept here: an MCP call stores only its final JSON-RPC response (an event stream that
//! ended before it is outcome-unknown, never a success), and once received that response is its
//! result whatever the status or the exchange's end; a status the route releases releases an MCP
//! call only when its answer carries no JSON-RPC response with an id; a completion's store write falls back
//! to an outcome-unknown mark, never a release; a release is only ever the classified outcome's
//! (evidence the request never executed), never a fallback; a claim whose policy is gone is kept.

use crate::config::Policy;
use crate::decision::Outcome;
use crate::fingerprint::Fingerprint;
use crate::local::{Completed, Handle};
use crate::owner::OwnerToken;
use crate::record::{Creator, Lifetimes, Record, StoredResponse, UnknownReason};
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
    /// MCP: which round of its call the claim's request is (`mcp::Call::round`): an answer
    /// asking for input is kept as this round's (`record::State::AwaitingInput`).
    pub mcp_round: Option<crate::record::RoundId>,
    /// MCP: the awaiting record this round continued (`Protected::mcp_continued`).
    pub mcp_continued: Option<Box<Record>>,
}

/// The outcome slug of a forwarded exchange that met a broken invariant (its claim kept).
pub const INTERNAL_STATE: &str = "internal-state";

/// A counter the settlement counts (the glue's `Counter` of the same name; `Released` counted
/// without the route, the others with it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Count {
    InternalErrors,
    Stored,
    StoredWithoutBody,
    LostClaim,
    LocalErrors,
    UnknownOutcome,
    Released,
}

/// A log line's level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Error,
    Warn,
    Info,
    Debug,
}

/// A log line, built only if its level is logged (`Display`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Line<'a> {
    /// `idemgate: outcome=<outcome> <the claim's log> <detail>`, then `tail`.
    Outcome { outcome: &'static str, log: &'a str, detail: &'a str, tail: Tail },
    /// The claim's policy is gone: the claim is kept.
    Kept { log: &'a str },
}

/// What ends an outcome line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tail {
    None,
    /// ` why=<why>`: why an MCP answer is not a final response.
    Why(String),
    /// ` error=<error>`: the local tier's error.
    Error(String),
    /// ` reason=<reason>`: why the outcome is unknown.
    Reason(UnknownReason),
}

impl std::fmt::Display for Line<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Line::Outcome { outcome, log, detail, tail } => {
                write!(f, "idemgate: outcome={outcome} {log} {detail}")?;
                match tail {
                    Tail::None => Ok(()),
                    Tail::Why(why) => write!(f, " why={why}"),
                    Tail::Error(e) => write!(f, " error={e}"),
                    Tail::Reason(r) => write!(f, " reason={}", r.as_str()),
                }
            }
            Line::Kept { log } => {
                write!(f, "idemgate: outcome=internal_state branch=settle broken=policy_missing claim=kept {log}")
            }
        }
    }
}

/// A local-tier operation on the claim's handle; the glue reports its answer to `finish`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Local {
    Complete(Handle, Box<Record>),
    /// Owner-checked: a claim taken over is not released.
    Release(Handle),
    MarkUnknown(Handle, UnknownReason),
}

/// What the glue does, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command<'a> {
    /// Push this store write of the claim's key (through the root's write queue), with the
    /// fallback sent if it keeps failing.
    Write {
        what: &'static str,
        transition: Box<Transition>,
        fallback: Option<Box<Transition>>,
    },
    Local(Local),
    Count(Count),
    Log(Level, Line<'a>),
}

/// What the local tier answered the `Local` command (`None`: there was none, no handle).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LocalAnswer {
    None,
    Completed(Result<Completed, String>),
    /// `true`: released; `false` or an error: not (not ours any more, or unreadable).
    Released(bool),
    /// `Ok(true)`: marked outcome-unknown; `Ok(false)`: the lifecycle refused it (the claim is
    /// no longer ours: taken over, or its record expired); `Err`: the local tier failed (the
    /// claim stays as it was: in flight until its lock expires, then outcome-unknown).
    Marked(Result<bool, String>),
}

#[derive(Debug)]
enum Next<'a> {
    Kept,
    Stored,
    Released { write: Option<Command<'a>> },
    Unknown { write: Option<Command<'a>>, reason: UnknownReason },
}

/// A settlement between its start and the local tier's answer.
#[derive(Debug)]
pub struct Settlement<'a> {
    log: &'a str,
    detail: &'a str,
    next: Next<'a>,
}

/// Starts settling `claim` with `outcome` (its `response`, `too_large` over the policy's
/// `max_response_body_bytes`) at `now_ms`: `policy` is the claim's (`None`: broken invariant,
/// the claim is kept), `has_store` whether a store is configured. `detail` ends the log line.
/// Returns the machine and the commands to carry out now, the last of them the `Local` one if
/// any; its answer goes to `Settlement::finish`.
#[allow(clippy::too_many_arguments)]
pub fn start<'a>(
    claim: &'a Claim,
    policy: Option<&Policy>,
    has_store: bool,
    redirected: bool,
    outcome: Outcome,
    response: Option<StoredResponse>,
    too_large: bool,
    detail: &'a str,
    now_ms: u64,
) -> (Settlement<'a>, Vec<Command<'a>>) {
    let log = claim.log.as_str();
    let Some(policy) = policy else {
        // The claim stays as it is (a forwarded claim is judged outcome-unknown once its lock expires).
        let cmds = vec![Command::Count(Count::InternalErrors), Command::Log(Level::Error, Line::Kept { log })];
        return (Settlement { log, detail, next: Next::Kept }, cmds);
    };
    let mut out = vec![];
    let to_store = claim.in_store && has_store;
    let lifetimes = Lifetimes::of(policy);
    let mut awaiting = None;
    let (outcome, response) = match claim.mcp_id.as_deref() {
        Some(id) => {
            // A round that asks for input is released or awaits only where the route says so,
            // and never on a redirect's target (its first hop executed:
            // `redirect::after_first_hop`): kept there as the call's answer.
            let input_required = match policy.mcp.as_ref().map(|m| m.input_required) {
                _ if redirected => crate::config::InputRequired::Keep,
                Some(i) => i,
                None => crate::config::InputRequired::Keep,
            };
            let release_input_required = input_required == crate::config::InputRequired::Release;
            let (o, r, why, asks) = mcp_outcome(outcome, response, too_large, id, release_input_required);
            if let Some((name, why)) = why {
                out.push(Command::Log(Level::Info, Line::Outcome { outcome: name, log, detail, tail: Tail::Why(why) }));
            }
            // A stored answer asking for input, on a route that awaits: the call's awaiting
            // record for this round (`record::State::AwaitingInput`), not its final answer.
            if o == Outcome::Store && asks && input_required == crate::config::InputRequired::Await {
                awaiting = claim.mcp_round.map(|r| r.digest);
                if let Some(round) = awaiting {
                    let why = format!("round={}", crate::hex::encode(&round[..6]));
                    out.push(Command::Log(
                        Level::Info,
                        Line::Outcome { outcome: "mcp_awaiting_input", log, detail, tail: Tail::Why(why) },
                    ));
                }
            }
            (o, r)
        }
        None => (outcome, response),
    };
    // A released next round (it never ran) leaves its call awaiting as it was: the awaiting
    // record it continued is completed again, never a free key (a re-sent earlier round would
    // then run again).
    let (outcome, restored) = match (outcome, claim.mcp_continued.as_deref()) {
        (Outcome::Release, Some(awaited)) => {
            let why = Tail::Why("released".into());
            out.push(Command::Log(
                Level::Info,
                Line::Outcome { outcome: "mcp_awaiting_input_again", log, detail, tail: why },
            ));
            (Outcome::Store, Some(awaited.clone()))
        }
        (o, _) => (o, None),
    };
    let next = match outcome {
        Outcome::Store => {
            let response = response.unwrap_or(StoredResponse { status: 0, headers: vec![], body: vec![] });
            let mut record =
                Record::completed(claim.fp, response, too_large, claim.creator.clone(), now_ms, policy.ttl_seconds);
            // (A call that asked more often than an awaiting record lists is kept as answered.)
            let earlier = claim.mcp_continued.as_ref().map(|r| r.rounds_run()).unwrap_or_default();
            if let (Some(round), crate::record::State::Completed(r)) = (awaiting, &record.state) {
                if earlier.len() < crate::record::MAX_EARLIER_ROUNDS {
                    let awaiting = crate::record::Awaiting::new(round, earlier, r.clone());
                    record.state = crate::record::State::AwaitingInput(Box::new(awaiting));
                }
            }
            if let Some(awaited) = restored {
                record = awaited;
            }
            if to_store {
                let gone = Record::unknown(
                    claim.fp,
                    claim.creator.clone(),
                    UnknownReason::StoreWriteFailed,
                    now_ms,
                    &lifetimes,
                );
                let unknown = Transition::unknown(claim.owner, gone, &lifetimes);
                let complete = Transition::complete(claim.owner, record.clone(), &lifetimes);
                out.push(Command::Write {
                    what: "complete",
                    transition: Box::new(complete),
                    fallback: Some(Box::new(unknown)),
                });
            }
            out.extend(claim.handle.map(|h| Command::Local(Local::Complete(h, Box::new(record)))));
            Next::Stored
        }
        Outcome::Release => {
            out.extend(claim.handle.map(|h| Command::Local(Local::Release(h))));
            let write = to_store.then(|| Command::Write {
                what: "release",
                transition: Box::new(Transition::release(claim.owner)),
                fallback: None,
            });
            Next::Released { write }
        }
        Outcome::Unknown(reason) => {
            out.extend(claim.handle.map(|h| Command::Local(Local::MarkUnknown(h, reason))));
            let write = to_store.then(|| {
                let gone = Record::unknown(claim.fp, claim.creator.clone(), reason, now_ms, &lifetimes);
                Command::Write {
                    what: "unknown",
                    transition: Box::new(Transition::unknown(claim.owner, gone, &lifetimes)),
                    fallback: None,
                }
            });
            Next::Unknown { write, reason }
        }
    };
    (Settlement { log, detail, next }, out)
}

/// What an MCP call's exchange settles as, from its classified `outcome` and the answer it got
/// (`response`; `too_large`: its body was not kept), and, when that differs from the outcome, the
/// log line's name and why. The call's final JSON-RPC response received (`mcp::Answer::Final`) is
/// its result, stored and replayed, whatever the status (a 2026-07-28 Python server answers a
/// tool's error with 400 or 404), the stream or the client did after it (a server that keeps an
/// event stream open past the final event; a client that reads it and leaves). Without it: a
/// classified completion of a 2xx is outcome-unknown (the call may have run, its result is not
/// known); a classified release (a status the route releases) stands only when the answer holds
/// no JSON-RPC response with an id (a server that could not read the request answers `"id":
/// null`), otherwise the outcome is unknown: an answer for another id or one idemgate cannot read
/// is no evidence that nothing ran.
fn mcp_outcome(
    outcome: Outcome,
    response: Option<StoredResponse>,
    too_large: bool,
    id: &[u8],
    release_input_required: bool,
) -> (Outcome, Option<StoredResponse>, Option<(&'static str, String)>, bool) {
    use crate::mcp::Answer;
    let answer = match &response {
        None => Answer::None,
        Some(_) if too_large => Answer::Unreadable,
        Some(r) => crate::mcp::answer_of(r, id),
    };
    let unknown = UnknownReason::Other;
    let (o, r, why) = match (outcome, answer, response) {
        // A round that asks for input (2026-07-28) is not the call's end: where the route
        // releases it, the round that answers it claims the key (`mcp::input_required`); where
        // it awaits, it is stored as the call's awaiting record (the last value: it asks).
        (o, Answer::Final(body), Some(r)) => {
            let asks = crate::mcp::input_required(&body);
            if release_input_required && asks {
                return (Outcome::Release, Some(r), Some(("mcp_input_required", format!("{o:?}"))), false);
            }
            let stored = crate::mcp::final_response(r, body);
            let why = (o != Outcome::Store).then(|| ("mcp_final_response_received", format!("{o:?}")));
            return (Outcome::Store, Some(stored), why, asks);
        }
        (Outcome::Store, _, Some(r)) if too_large => (Outcome::Store, Some(r), None),
        // The answer read above decides what is kept (not read again).
        (Outcome::Store, answer, Some(r)) => {
            let shown = format!("{answer:?}");
            match crate::mcp::stored_response_read(r, answer) {
                Ok(r) => (Outcome::Store, Some(r), None),
                Err(why) => {
                    (Outcome::Unknown(unknown), None, Some(("mcp_no_final_response", format!("{why:?}/{shown}"))))
                }
            }
        }
        // A 1.x Python SDK transport's refusal without the request's id (`"id": "server-error"`)
        // at a released 4xx precedes dispatch, as one with `"id": null` does; its 500s come after
        // dispatch (a tool that ran, then failed), so a route that releases 500 does not release
        // those: outcome-unknown.
        (Outcome::Release, Answer::None, r) => (Outcome::Release, r, None),
        (Outcome::Release, Answer::NoRequestId, Some(r)) if r.status < 500 => (Outcome::Release, Some(r), None),
        (Outcome::Release, answer, _) => {
            (Outcome::Unknown(unknown), None, Some(("mcp_answered_not_released", format!("{answer:?}"))))
        }
        (o, _, r) => (o, r, None),
    };
    (o, r, why, false)
}

impl<'a> Settlement<'a> {
    /// The local tier answered (`LocalAnswer::None` if there was no `Local` command): the
    /// commands left, and the exchange's outcome slug (for Envoy's filter state): `stored`,
    /// `stored-without-body`, `lost-claim`, `released`, `marked-unknown`, `local-error` or
    /// `internal-state`.
    pub fn finish(self, local: LocalAnswer) -> (Vec<Command<'a>>, &'static str) {
        let (log, detail) = (self.log, self.detail);
        let line = |outcome: &'static str, tail: Tail| Line::Outcome { outcome, log, detail, tail };
        match self.next {
            Next::Kept => (vec![], INTERNAL_STATE),
            Next::Stored => {
                let (count, level, name, tail, slug) = match local {
                    LocalAnswer::None | LocalAnswer::Completed(Ok(Completed::Stored)) => {
                        (Count::Stored, Level::Debug, "stored", Tail::None, "stored")
                    }
                    LocalAnswer::Completed(Ok(Completed::StoredWithoutBody)) => (
                        Count::StoredWithoutBody,
                        Level::Info,
                        "stored_without_body",
                        Tail::None,
                        "stored-without-body",
                    ),
                    LocalAnswer::Completed(Ok(Completed::LostClaim)) => {
                        (Count::LostClaim, Level::Info, "lost_claim", Tail::None, "lost-claim")
                    }
                    LocalAnswer::Completed(Err(e)) => {
                        (Count::LocalErrors, Level::Warn, "store_failed", Tail::Error(e), "local-error")
                    }
                    // Not an answer to a completion: the local tier's state is not known.
                    LocalAnswer::Released(_) | LocalAnswer::Marked(_) => {
                        (Count::LocalErrors, Level::Warn, "store_failed", Tail::Error("?".into()), "local-error")
                    }
                };
                (vec![Command::Count(count), Command::Log(level, line(name, tail))], slug)
            }
            Next::Released { write } => {
                let mut out = vec![];
                if local == LocalAnswer::Released(true) {
                    out.push(Command::Count(Count::Released));
                }
                out.extend(write);
                out.push(Command::Log(Level::Info, line("released", Tail::None)));
                (out, "released")
            }
            Next::Unknown { write, reason } => {
                // The store's write goes whatever the local tier answered: the store is
                // authoritative, and a mark that failed here must not leave it in flight.
                let mut out: Vec<Command> = write.into_iter().collect();
                out.push(Command::Count(Count::UnknownOutcome));
                match local {
                    // Marked, or no local claim (a store-only settlement).
                    LocalAnswer::None | LocalAnswer::Marked(Ok(true)) => {
                        out.push(Command::Log(Level::Info, line("unknown_outcome", Tail::Reason(reason))));
                        (out, "marked-unknown")
                    }
                    // Taken over or expired here: the key is another request's now.
                    LocalAnswer::Marked(Ok(false)) => {
                        out.push(Command::Count(Count::LostClaim));
                        out.push(Command::Log(Level::Info, line("unknown_outcome_lost_claim", Tail::Reason(reason))));
                        (out, "lost-claim")
                    }
                    // The local tier failed (or answered something else): the claim stays in
                    // flight until its lock expires, then is outcome-unknown. Never a release.
                    LocalAnswer::Marked(Err(e)) => {
                        out.push(Command::Count(Count::LocalErrors));
                        out.push(Command::Log(Level::Warn, line("unknown_outcome_local_failed", Tail::Error(e))));
                        (out, "local-error")
                    }
                    LocalAnswer::Completed(_) | LocalAnswer::Released(_) => {
                        out.push(Command::Count(Count::LocalErrors));
                        let e = Tail::Error("not an answer to a mark".into());
                        out.push(Command::Log(Level::Warn, line("unknown_outcome_local_failed", e)));
                        (out, "local-error")
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
