//! What a finished exchange does to its claim, as a sans-IO machine: the claim, the exchange's
//! outcome (`decision::classify`), its response and the time come in; commands come out (push
//! this store write with this fallback, complete / release / mark unknown in the local tier,
//! count and log this), then, once the glue reports what the local tier answered, the rest
//! (count, log) and the exchange's outcome slug. Shared by the router path (`on_log`) and
//! detached forwards; the glue (`filter/settle.rs`) carries the commands out in order.
//!
//! Rules kept here: an MCP call stores only its final JSON-RPC response (an event stream that
//! ended before it is outcome-unknown, never a success); a completion's store write falls back
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
pub enum Command {
    /// Push this store write of the claim's key (through the root's write queue), with the
    /// fallback sent if it keeps failing.
    Write {
        what: &'static str,
        transition: Box<Transition>,
        fallback: Option<Box<Transition>>,
    },
    Local(Local),
    Count(Count),
    Log(Level, String),
}

/// What the local tier answered the `Local` command (`None`: there was none, no handle).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LocalAnswer {
    None,
    Completed(Result<Completed, String>),
    /// `true`: released; `false` or an error: not (not ours any more, or unreadable).
    Released(bool),
    Marked,
}

#[derive(Debug)]
enum Next {
    Kept,
    Stored { detail: String },
    Released { write: Option<Command>, detail: String },
    Unknown { write: Option<Command>, reason: UnknownReason, detail: String },
}

/// A settlement between its start and the local tier's answer.
#[derive(Debug)]
pub struct Settlement {
    log: String,
    next: Next,
}

/// Starts settling `claim` with `outcome` (its `response`, `too_large` over the policy's
/// `max_response_body_bytes`) at `now_ms`: `policy` is the claim's (`None`: broken invariant,
/// the claim is kept), `has_store` whether a store is configured. `detail` ends the log line.
/// Returns the machine and the commands to carry out now, the last of them the `Local` one if
/// any; its answer goes to `Settlement::finish`.
#[allow(clippy::too_many_arguments)]
pub fn start(
    claim: &Claim,
    policy: Option<&Policy>,
    has_store: bool,
    outcome: Outcome,
    response: Option<StoredResponse>,
    too_large: bool,
    detail: &str,
    now_ms: u64,
) -> (Settlement, Vec<Command>) {
    let log = claim.log.clone();
    let Some(policy) = policy else {
        // The claim stays as it is (a forwarded claim is judged outcome-unknown once its lock expires).
        let line = format!("idemgate: outcome=internal_state branch=settle broken=policy_missing claim=kept {log}");
        let cmds = vec![Command::Count(Count::InternalErrors), Command::Log(Level::Error, line)];
        return (Settlement { log, next: Next::Kept }, cmds);
    };
    let mut out = vec![];
    let to_store = claim.in_store && has_store;
    let lifetimes = Lifetimes::of(policy);
    // An MCP call's answer is a completion only with its final JSON-RPC response: an event stream
    // that ended before it leaves the call's outcome unknown (it may have run), never a success.
    let (outcome, response) = match (outcome, claim.mcp_id.as_deref(), response) {
        (Outcome::Store, Some(id), Some(r)) if !too_large => match crate::mcp::stored_response(r, id) {
            Ok(r) => (Outcome::Store, Some(r)),
            Err(why) => {
                let line = format!("idemgate: outcome=mcp_no_final_response {log} {detail} why={why:?}");
                out.push(Command::Log(Level::Info, line));
                (Outcome::Unknown(UnknownReason::Other), None)
            }
        },
        (o, _, r) => (o, r),
    };
    let next = match outcome {
        Outcome::Store => {
            let response = response.unwrap_or(StoredResponse { status: 0, headers: vec![], body: vec![] });
            let record =
                Record::completed(claim.fp, response, too_large, claim.creator.clone(), now_ms, policy.ttl_seconds);
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
            Next::Stored { detail: detail.to_string() }
        }
        Outcome::Release => {
            out.extend(claim.handle.map(|h| Command::Local(Local::Release(h))));
            let write = to_store.then(|| Command::Write {
                what: "release",
                transition: Box::new(Transition::release(claim.owner)),
                fallback: None,
            });
            Next::Released { write, detail: detail.to_string() }
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
            Next::Unknown { write, reason, detail: detail.to_string() }
        }
    };
    (Settlement { log, next }, out)
}

impl Settlement {
    /// The local tier answered (`LocalAnswer::None` if there was no `Local` command): the
    /// commands left, and the exchange's outcome slug (for Envoy's filter state): `stored`,
    /// `stored-without-body`, `lost-claim`, `released`, `marked-unknown`, `local-error` or
    /// `internal-state`.
    pub fn finish(self, local: LocalAnswer) -> (Vec<Command>, &'static str) {
        let log = self.log;
        let line = |outcome: &str, extra: &str| format!("idemgate: outcome={outcome} {log} {extra}");
        match self.next {
            Next::Kept => (vec![], INTERNAL_STATE),
            Next::Stored { detail } => {
                let (count, level, name, extra, slug) = match local {
                    LocalAnswer::None | LocalAnswer::Completed(Ok(Completed::Stored)) => {
                        (Count::Stored, Level::Debug, "stored", detail, "stored")
                    }
                    LocalAnswer::Completed(Ok(Completed::StoredWithoutBody)) => {
                        (Count::StoredWithoutBody, Level::Info, "stored_without_body", detail, "stored-without-body")
                    }
                    LocalAnswer::Completed(Ok(Completed::LostClaim)) => {
                        (Count::LostClaim, Level::Info, "lost_claim", detail, "lost-claim")
                    }
                    LocalAnswer::Completed(Err(e)) => {
                        (Count::LocalErrors, Level::Warn, "store_failed", format!("{detail} error={e}"), "local-error")
                    }
                    // Not an answer to a completion: the local tier's state is not known.
                    LocalAnswer::Released(_) | LocalAnswer::Marked => {
                        (Count::LocalErrors, Level::Warn, "store_failed", format!("{detail} error=?"), "local-error")
                    }
                };
                (vec![Command::Count(count), Command::Log(level, line(name, &extra))], slug)
            }
            Next::Released { write, detail } => {
                let mut out = vec![];
                if local == LocalAnswer::Released(true) {
                    out.push(Command::Count(Count::Released));
                }
                out.extend(write);
                out.push(Command::Log(Level::Info, line("released", &detail)));
                (out, "released")
            }
            Next::Unknown { write, reason, detail } => {
                let mut out: Vec<Command> = write.into_iter().collect();
                out.push(Command::Count(Count::UnknownOutcome));
                out.push(Command::Log(
                    Level::Info,
                    line("unknown_outcome", &format!("{detail} reason={}", reason.as_str())),
                ));
                (out, "marked-unknown")
            }
        }
    }
}

#[cfg(test)]
mod tests;
