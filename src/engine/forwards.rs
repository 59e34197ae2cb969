//! The root's detached forwards (`forwarding: "detached"`) and the probes of the internal
//! listener chains they go through (`upstream.hop: "internal_listener"`), as a sans-IO machine:
//! a forward queued, a probe or a forward sent or refused by the host, a probe's or a forward's
//! answer (or its loss) come in, with the time; actions come out (send this probe, send this
//! forward within its lock, refuse this forward: release its claim and tell its client, log this)
//! and, for an answer, how to settle the claim and what to tell the client. The glue
//! (`filter/mod.rs`) sends, settles (`engine::settle`) and answers.
//!
//! Rules kept here: no forward goes to a hop cluster before the cluster has answered a probe with
//! the chain's mark; a forward is released only when it never left (the host refused it, its lock
//! ran out before it was sent, its cluster was not proven); an answer lost or not the upstream's
//! settles as `decision::classify_callout` says (outcome-unknown for a lost answer), never as a
//! release it has no evidence for.

use std::collections::HashMap;

use crate::config::{Hop, Policy};
use crate::decision::{
    callout_answer_is_upstreams, classify_callout, hop_mark, HopMark, Outcome, HOP_HEADER, HOP_PROBE_HEADER,
};
use crate::engine::settle::{Claim, Level};
use crate::problem::ProblemKind;
use crate::record::StoredResponse;

/// How long the root waits for a probe's answer.
pub const HOP_PROBE_TIMEOUT_MS: u64 = 2_000;

/// A protected request sent upstream by the root (`forwarding: "detached"`).
#[derive(Debug)]
pub struct Forward {
    pub context_id: u32,
    pub cluster: String,
    pub timeout_ms: u64,
    pub hop: Hop,
    /// Request headers, pseudo headers included.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub claim: Claim,
    pub request_id: String,
    pub sent_at_ms: u64,
    /// When the claim's lock may be judged stale (this proxy's clock): the callout's timeout is
    /// cut to end by then, and none is sent after it.
    pub lock_deadline_ms: u64,
}

/// Where this root stands with a detached cluster behind an internal listener.
#[derive(Debug)]
enum HopCheck {
    /// Its probe is on the way; the forwards waiting for its answer.
    Probing(Vec<Forward>),
    /// It answered with the chain's mark: forwards go.
    Proven,
}

/// What the glue does next.
#[derive(Debug)]
pub enum Action {
    /// Send the probe of `cluster` (these headers, no body, `HOP_PROBE_TIMEOUT_MS`); report
    /// `probe_not_sent` if the host refuses it, later `probe_answered`.
    Probe {
        cluster: String,
        headers: Vec<(&'static str, String)>,
    },
    /// Send this forward (its `sent_at_ms` set) with this timeout (ms, within its lock); count it
    /// (`detached_forwards`) once sent; report `not_sent` if the host refuses it.
    Send(Box<Forward>, u64),
    /// Nothing was sent: log `log` (warn), settle the claim `Outcome::Release` with `detail`,
    /// answer the client with `problem`.
    Refuse {
        forward: Box<Forward>,
        log: String,
        detail: &'static str,
        problem: ProblemKind,
    },
    Log(Level, String),
}

/// The detached clusters behind an internal listener, by name: none is sent a request before it
/// has answered a probe with the chain's mark.
#[derive(Debug, Default)]
pub struct Forwards {
    hops: HashMap<String, HopCheck>,
}

/// The forward `f` at `now_ms`: sent if its lock leaves time for its callout, refused otherwise.
fn dispatch(mut f: Forward, now_ms: u64) -> Action {
    f.sent_at_ms = now_ms;
    // Within the lock: a callout still running when the lock can be judged stale would let a
    // retry execute beside it. (The configuration keeps upstream.timeout_ms below the lock; the
    // time the claim took, and the wait for this root, come off it.)
    let timeout = crate::record::callout_timeout_within_lock(f.timeout_ms, f.lock_deadline_ms, f.sent_at_ms);
    if timeout == 0 {
        let e = format!(
            "the claim's lock ran out before the dispatch ({} ms late)",
            f.sent_at_ms.saturating_sub(f.lock_deadline_ms)
        );
        return not_sent(f, &e);
    }
    Action::Send(Box::new(f), timeout)
}

/// The host refused to send forward `f` (`error`): nothing was sent; free the key and tell the
/// client.
pub fn not_sent(f: Forward, error: &str) -> Action {
    let log = format!("idemgate: outcome=detached_dispatch_failed {} cluster={} error={error}", f.claim.log, f.cluster);
    Action::Refuse {
        forward: Box::new(f),
        log,
        detail: "reason=dispatch_failed",
        problem: ProblemKind::UpstreamNoAnswer,
    }
}

/// Forwards whose cluster could not be proven: nothing was sent; keys released, clients told.
fn refuse_unproven(forwards: Vec<Forward>) -> impl Iterator<Item = Action> {
    forwards.into_iter().map(|f| {
        let log = format!("idemgate: outcome=detached_hop_unproven {} cluster={}", f.claim.log, f.cluster);
        Action::Refuse {
            forward: Box::new(f),
            log,
            detail: "reason=hop_unproven",
            problem: ProblemKind::InternalState { retry_after_seconds: 1 },
        }
    })
}

impl Forwards {
    /// A forward handed over by an HTTP context at `now_ms`: sent at once (direct, or its cluster
    /// proven), held behind its cluster's probe on the way, or held behind a new probe.
    pub fn queued(&mut self, f: Forward, now_ms: u64) -> Option<Action> {
        if f.hop == Hop::Direct {
            return Some(dispatch(f, now_ms));
        }
        match self.hops.get_mut(&f.cluster) {
            Some(HopCheck::Proven) => return Some(dispatch(f, now_ms)),
            Some(HopCheck::Probing(waiting)) => {
                waiting.push(f);
                return None;
            }
            None => {}
        }
        let authority =
            f.headers.iter().find(|(n, _)| n == ":authority").map_or("idemgate-hop-probe", |(_, v)| v).to_string();
        let headers = vec![
            (":method", "GET".into()),
            (":path", "/".into()),
            (":authority", authority),
            (HOP_PROBE_HEADER, "1".into()),
        ];
        let cluster = f.cluster.clone();
        self.hops.insert(cluster.clone(), HopCheck::Probing(vec![f]));
        Some(Action::Probe { cluster, headers })
    }

    fn take_waiting(&mut self, cluster: &str) -> Vec<Forward> {
        match self.hops.remove(cluster) {
            Some(HopCheck::Probing(waiting)) => waiting,
            Some(HopCheck::Proven) => {
                self.hops.insert(cluster.to_string(), HopCheck::Proven);
                vec![]
            }
            None => vec![],
        }
    }

    /// The host refused to send `cluster`'s probe (`error`): its forwards are refused, never sent;
    /// the next forward probes again.
    pub fn probe_not_sent(&mut self, cluster: &str, error: &str) -> Vec<Action> {
        let waiting = self.take_waiting(cluster);
        let mut out = vec![Action::Log(
            Level::Error,
            format!("idemgate: detached hop probe not sent to cluster={cluster} error={error}"),
        )];
        out.extend(refuse_unproven(waiting));
        out
    }

    /// The probe's answer (`status`, `headers`; none if it was lost) at `now_ms`: the chain's
    /// mark proves the cluster (its waiting forwards go); anything else refuses them (never sent,
    /// keys released) and the next forward probes again.
    pub fn probe_answered(
        &mut self,
        cluster: String,
        status: Option<u16>,
        headers: &[(String, Vec<u8>)],
        now_ms: u64,
    ) -> Vec<Action> {
        let waiting = match self.hops.remove(&cluster) {
            Some(HopCheck::Probing(waiting)) => waiting,
            _ => vec![],
        };
        match hop_mark(status, headers) {
            HopMark::Relayed | HopMark::Local(_) => {
                let line = format!("idemgate: detached hop proven: cluster={cluster} answers with {HOP_HEADER}");
                self.hops.insert(cluster, HopCheck::Proven);
                let mut out = vec![Action::Log(Level::Info, line)];
                out.extend(waiting.into_iter().map(|f| dispatch(f, now_ms)));
                out
            }
            HopMark::Missing | HopMark::Unreadable => {
                let line = format!(
                    "idemgate: detached hop refused: cluster={cluster} answered the probe (status {}) without a readable {HOP_HEADER}: it is not an internal listener running the chain after idemgate (docs/agents.md, detached forwarding); its requests are refused, never sent",
                    status.unwrap_or(0)
                );
                let mut out = vec![Action::Log(Level::Error, line)];
                out.extend(refuse_unproven(waiting));
                out
            }
        }
    }
}

/// How a detached answer settles its claim.
#[derive(Debug, PartialEq, Eq)]
pub struct Settle {
    pub outcome: Outcome,
    pub response: Option<StoredResponse>,
    pub too_large: bool,
    pub detail: String,
}

/// What the client of an answered forward is told.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// The answer passed on (with the settlement's slug): `expires` is the replay's
    /// `idempotency-expires` (seconds) when it was stored.
    Response {
        status: u16,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
        expires: Option<String>,
    },
    Problem(ProblemKind),
}

/// What an answered forward does: settle its claim (`None`: its policy is gone, the claim is kept
/// and `internal_state` counted and logged as `log`), log `kept` if the client is gone, answer
/// the client.
#[derive(Debug)]
pub struct Answered {
    pub settle: Option<Settle>,
    pub log: Option<String>,
    pub kept: Option<String>,
    pub reply: Reply,
}

/// The upstream's answer to forward `f` (`status` `None`: no answer; `headers` its own,
/// `trailer_names` those of its trailers) at `now_ms`; `policy` is the claim's, `live` whether
/// the client is still there.
#[allow(clippy::too_many_arguments)]
pub fn answered(
    f: &Forward,
    policy: Option<&Policy>,
    status: Option<u16>,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    trailer_names: &[String],
    live: bool,
    now_ms: u64,
) -> Answered {
    let Some(policy) = policy else {
        // Sent, so the claim stays (outcome unknown once its lock expires); the client is told.
        let log = format!(
            "idemgate: outcome=internal_state branch=detached_answer broken=policy_missing claim=kept {}",
            f.claim.log
        );
        return Answered {
            settle: None,
            log: Some(log),
            kept: None,
            reply: Reply::Problem(ProblemKind::UpstreamNoAnswer),
        };
    };
    let elapsed = now_ms.saturating_sub(f.sent_at_ms);
    let outcome = classify_callout(status, &headers, &body, policy);
    let upstream_answered = callout_answer_is_upstreams(&headers, policy);
    let mut client_headers: Vec<(String, Vec<u8>)> =
        headers.into_iter().filter(|(n, _)| crate::record::storable_header(n) && n != HOP_HEADER).collect();
    // Neither the client's answer nor a replay (local replies both) carries the trailers: both
    // say which they lack, as a forwarded response's replay does.
    if !trailer_names.is_empty() {
        crate::record::note_dropped_trailers_in(&mut client_headers, trailer_names);
    }
    let detail = format!("detached=true status={} elapsed_ms={elapsed}", status.unwrap_or(0));
    match status {
        Some(status) if upstream_answered => {
            let kept =
                client_headers.iter().filter(|(n, _)| !policy.replay_exclude_headers.contains(n)).cloned().collect();
            let too_large = body.len() as u64 > policy.max_response_body_bytes;
            let stored = StoredResponse { status, headers: kept, body: if too_large { vec![] } else { body.clone() } };
            let gone = (!live).then(|| {
                format!("idemgate: outcome=detached_response_kept {} status={status} client=gone", f.claim.log)
            });
            let expires = (outcome == Outcome::Store).then(|| policy.ttl_seconds.to_string());
            Answered {
                settle: Some(Settle { outcome, response: Some(stored), too_large, detail }),
                log: None,
                kept: gone,
                reply: Reply::Response { status, headers: client_headers, body, expires },
            }
        }
        // Envoy answered for an unreachable upstream: nothing was sent; pass its answer on.
        Some(status) if outcome == Outcome::Release => Answered {
            settle: Some(Settle { outcome, response: None, too_large: false, detail }),
            log: None,
            kept: None,
            reply: Reply::Response { status, headers: client_headers, body, expires: None },
        },
        // Silent or reset upstream: it may have run; nothing to replay.
        _ => Answered {
            settle: Some(Settle { outcome, response: None, too_large: false, detail }),
            log: None,
            kept: None,
            reply: Reply::Problem(ProblemKind::UpstreamNoAnswer),
        },
    }
}

#[cfg(test)]
mod tests;
