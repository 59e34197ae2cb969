//! Detached forwards and hop probes driven without Envoy: forwards queued, probes and forwards
//! answered, refused or lost, with a clock the tests move.

use super::*;
use crate::config::Forwarding;
use crate::fingerprint::Fingerprint;
use crate::owner::OwnerToken;
use crate::record::{Creator, UnknownReason};
use crate::scope::StorageKey;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const NOW: u64 = 1_000_000;

fn forward(n: u8, hop: Hop) -> Forward {
    Forward {
        context_id: n.into(),
        cluster: "chain".into(),
        timeout_ms: 3_000,
        hop,
        headers: vec![(":authority".into(), "api.example".into())],
        body: vec![],
        claim: Claim {
            handle: None,
            fp: Fingerprint([n; 32]),
            in_store: false,
            owner: OwnerToken([n; 16]),
            skey: StorageKey([n; 32]),
            policy_index: 0,
            creator: Creator { request_id: format!("r{n}"), log_values: vec![] },
            log: format!("key=k{n}"),
            mcp_id: None,
            mcp_round: None,
            mcp_continued: None,
        },
        request_id: format!("r{n}"),
        sent_at_ms: 0,
        lock_deadline_ms: NOW + 10_000,
    }
}

fn sent(a: &Action) -> Option<(u32, u64, u64)> {
    match a {
        Action::Send(f, timeout) => Some((f.context_id, f.sent_at_ms, *timeout)),
        _ => None,
    }
}

fn refused(a: &Action) -> Option<(u32, &'static str)> {
    match a {
        Action::Refuse { forward, detail, .. } => Some((forward.context_id, *detail)),
        _ => None,
    }
}

fn mark(v: &str) -> Vec<(String, Vec<u8>)> {
    vec![(":status".into(), b"200".to_vec()), (HOP_HEADER.into(), v.as_bytes().to_vec())]
}

#[test]
fn a_direct_forward_is_sent_within_its_lock() {
    let mut m = Forwards::default();
    let a = m.queued(forward(1, Hop::Direct), NOW).unwrap();
    assert_eq!(sent(&a), Some((1, NOW, 3_000)));
    // Late: only what is left of the lock.
    let a = m.queued(forward(2, Hop::Direct), NOW + 9_000).unwrap();
    assert_eq!(sent(&a), Some((2, NOW + 9_000, 1_000)));
}

#[test]
fn a_forward_whose_lock_ran_out_is_refused_and_released_never_sent() {
    let mut m = Forwards::default();
    let a = m.queued(forward(1, Hop::Direct), NOW + 10_000).unwrap();
    assert_eq!(refused(&a), Some((1, "reason=dispatch_failed")));
    let Action::Refuse { log, problem, .. } = a else { unreachable!() };
    assert_eq!(problem, ProblemKind::UpstreamNoAnswer);
    assert!(log.ends_with("error=the claim's lock ran out before the dispatch (0 ms late)"), "{log}");
}

#[test]
fn a_forward_the_host_refused_is_released() {
    let a = not_sent(forward(1, Hop::Direct), "BadArgument");
    assert_eq!(refused(&a), Some((1, "reason=dispatch_failed")));
}

#[test]
fn hop_forwards_wait_for_one_probe_and_go_once_proven() {
    let mut m = Forwards::default();
    let Some(Action::Probe { cluster, headers }) = m.queued(forward(1, Hop::InternalListener), NOW) else {
        panic!("no probe")
    };
    assert_eq!(cluster, "chain");
    assert!(
        headers.contains(&(":authority", "api.example".into())) && headers.contains(&(HOP_PROBE_HEADER, "1".into()))
    );
    // A second forward waits behind the same probe: nothing sent.
    assert!(m.queued(forward(2, Hop::InternalListener), NOW).is_none());
    let out = m.probe_answered("chain".into(), Some(200), &mark("relayed"), NOW + 5);
    let s: Vec<_> = out.iter().filter_map(sent).collect();
    assert_eq!(s, vec![(1, NOW + 5, 3_000), (2, NOW + 5, 3_000)]);
    // Proven: the next goes at once, without a probe.
    assert_eq!(sent(&m.queued(forward(3, Hop::InternalListener), NOW + 6).unwrap()), Some((3, NOW + 6, 3_000)));
}

#[test]
fn an_unproven_hop_refuses_its_forwards_and_probes_again() {
    for headers in [vec![(":status".to_string(), b"404".to_vec())], vec![]] {
        let mut m = Forwards::default();
        assert!(matches!(m.queued(forward(1, Hop::InternalListener), NOW), Some(Action::Probe { .. })));
        assert!(m.queued(forward(2, Hop::InternalListener), NOW).is_none());
        let status = if headers.is_empty() { None } else { Some(404) };
        let out = m.probe_answered("chain".into(), status, &headers, NOW);
        assert!(out.iter().all(|a| sent(a).is_none()));
        let r: Vec<_> = out.iter().filter_map(refused).collect();
        assert_eq!(r, vec![(1, "reason=hop_unproven"), (2, "reason=hop_unproven")]);
        assert!(out.iter().any(|a| matches!(a, Action::Refuse { problem: ProblemKind::InternalState { .. }, .. })));
        // Not proven: the next forward is probed again.
        assert!(matches!(m.queued(forward(3, Hop::InternalListener), NOW), Some(Action::Probe { .. })));
    }
}

#[test]
fn a_probe_the_host_refused_refuses_its_forwards() {
    let mut m = Forwards::default();
    m.queued(forward(1, Hop::InternalListener), NOW);
    m.queued(forward(2, Hop::InternalListener), NOW);
    let out = m.probe_not_sent("chain", "BadArgument");
    assert!(matches!(&out[0], Action::Log(Level::Error, l) if l.ends_with("cluster=chain error=BadArgument")));
    let r: Vec<_> = out.iter().filter_map(refused).collect();
    assert_eq!(r, vec![(1, "reason=hop_unproven"), (2, "reason=hop_unproven")]);
    assert!(matches!(m.queued(forward(3, Hop::InternalListener), NOW), Some(Action::Probe { .. })));
}

fn policy() -> Policy {
    Policy {
        forwarding: Forwarding::Detached { cluster: "up".into(), timeout_ms: 3_000, hop: Hop::Direct },
        ..Policy::default()
    }
}

/// The headers of an answer Envoy's router relayed from the upstream (direct hop).
fn upstream(status: &str) -> Vec<(String, Vec<u8>)> {
    vec![
        (":status".into(), status.as_bytes().to_vec()),
        ("content-type".into(), b"application/json".to_vec()),
        ("x-envoy-upstream-service-time".into(), b"3".to_vec()),
    ]
}

#[test]
fn an_upstream_answer_is_stored_and_passed_on() {
    let mut f = forward(1, Hop::Direct);
    f.sent_at_ms = NOW;
    let p = policy();
    let a = answered(&f, Some(&p), Some(201), upstream("201"), b"{}".to_vec(), &[], true, NOW + 7);
    let s = a.settle.unwrap();
    assert_eq!(s.outcome, Outcome::Store);
    assert_eq!(s.detail, "detached=true status=201 elapsed_ms=7");
    assert_eq!(s.response.map(|r| r.status), Some(201));
    assert!(a.kept.is_none());
    let Reply::Response { status, expires, .. } = a.reply else { panic!() };
    assert_eq!((status, expires), (201, Some(p.ttl_seconds.to_string())));
    // The client gone: kept all the same, and said so.
    let a = answered(&f, Some(&p), Some(201), upstream("201"), b"{}".to_vec(), &[], false, NOW + 7);
    assert!(a.kept.unwrap().ends_with("status=201 client=gone"));
}

/// An answer lost (reset, timeout: no status) may have run: outcome-unknown, never a release,
/// and the client is told `upstream-no-answer`.
#[test]
fn a_lost_answer_is_outcome_unknown_never_released() {
    let f = forward(1, Hop::Direct);
    let a = answered(&f, Some(&policy()), None, vec![], vec![], &[], true, NOW);
    let s = a.settle.unwrap();
    assert_eq!(s.outcome, Outcome::Unknown(UnknownReason::UpstreamReset));
    assert!(s.response.is_none());
    assert_eq!(a.reply, Reply::Problem(ProblemKind::UpstreamNoAnswer));
}

#[test]
fn a_claim_without_its_policy_is_kept() {
    let f = forward(1, Hop::Direct);
    let a = answered(&f, None, Some(201), upstream("201"), vec![], &[], true, NOW);
    assert!(a.settle.is_none());
    assert!(a.log.unwrap().contains("broken=policy_missing claim=kept key=k1"));
    assert_eq!(a.reply, Reply::Problem(ProblemKind::UpstreamNoAnswer));
}

/// Envoy's own 503 for an upstream it never reached (no `x-envoy-upstream-service-time`,
/// `no healthy upstream` in plain text): nothing was sent, so the key is released and the answer passed on.
#[test]
fn envoys_answer_for_an_unreachable_upstream_is_released_and_passed_on() {
    let f = forward(1, Hop::Direct);
    let headers = vec![(":status".to_string(), b"503".to_vec()), ("content-type".to_string(), b"text/plain".to_vec())];
    let body = b"no healthy upstream".to_vec();
    let a = answered(&f, Some(&policy()), Some(503), headers, body, &[], true, NOW);
    let s = a.settle.unwrap();
    assert_eq!((s.outcome, s.response), (Outcome::Release, None));
    assert!(matches!(a.reply, Reply::Response { status: 503, expires: None, .. }));
}

/// Envoy's own 504 (the callout timed out): the upstream may have run it, so not a release and
/// nothing to replay.
#[test]
fn envoys_timeout_answer_is_never_released() {
    let f = forward(1, Hop::Direct);
    let headers = vec![(":status".to_string(), b"504".to_vec())];
    let a = answered(&f, Some(&policy()), Some(504), headers, b"upstream request timeout".to_vec(), &[], true, NOW);
    let s = a.settle.unwrap();
    assert!(matches!(s.outcome, Outcome::Unknown(_)), "{:?}", s.outcome);
    assert_eq!(a.reply, Reply::Problem(ProblemKind::UpstreamNoAnswer));
}
