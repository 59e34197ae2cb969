//! The settlement driven without Envoy: each test starts a settlement, answers its local-tier
//! command as the table would, and checks every command and the slug.

use super::*;
use crate::config::{InputRequired, McpPolicy};
use crate::record::State;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const NOW: u64 = 5_000_000;

fn handle() -> Handle {
    Handle { bucket: 3, position: 1, owner: OwnerToken([7; 16]), skey: StorageKey([9; 32]) }
}

fn claim(in_store: bool) -> Claim {
    Claim {
        handle: Some(handle()),
        fp: Fingerprint([1; 32]),
        in_store,
        owner: OwnerToken([7; 16]),
        skey: StorageKey([9; 32]),
        policy_index: 0,
        creator: Creator { request_id: "first".into(), log_values: vec![] },
        log: "key=k".into(),
        mcp_id: None,
        mcp_round: None,
        mcp_continued: None,
    }
}

fn response() -> StoredResponse {
    StoredResponse { status: 201, headers: vec![], body: b"{\"id\":1}".to_vec() }
}

/// Runs a whole settlement: the local command (if any) answered `local`.
fn settle(
    claim: &Claim,
    has_store: bool,
    outcome: Outcome,
    local: LocalAnswer,
) -> (Vec<Command<'static>>, &'static str) {
    // The commands borrow the claim: a test's claim lives as long as the test binary.
    let claim: &'static Claim = Box::leak(Box::new(claim.clone()));
    let policy = Policy::default();
    let (m, mut cmds) = start(claim, Some(&policy), has_store, false, outcome, Some(response()), false, "d=1", NOW);
    let asked = cmds.iter().any(|c| matches!(c, Command::Local(_)));
    let (rest, slug) = m.finish(if asked { local } else { LocalAnswer::None });
    cmds.extend(rest);
    (cmds, slug)
}

fn writes<'c>(cmds: &'c [Command<'_>]) -> Vec<(&'static str, Option<&'c Transition>, Option<&'c Transition>)> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Write { what, transition, fallback } => Some((*what, Some(&**transition), fallback.as_deref())),
            _ => None,
        })
        .collect()
}

fn counts(cmds: &[Command]) -> Vec<Count> {
    cmds.iter().filter_map(|c| if let Command::Count(c) = c { Some(*c) } else { None }).collect()
}

fn logs(cmds: &[Command]) -> Vec<(Level, String)> {
    cmds.iter().filter_map(|c| if let Command::Log(l, s) = c { Some((*l, s.to_string())) } else { None }).collect()
}

/// A write that frees the key (deletes it).
fn is_release(t: &Transition) -> bool {
    t.new_phase.is_none()
}

#[test]
fn store_completes_in_both_tiers_with_an_unknown_fallback() {
    let (cmds, slug) = settle(&claim(true), true, Outcome::Store, LocalAnswer::Completed(Ok(Completed::Stored)));
    assert_eq!(slug, "stored");
    // The store write first, then the local completion, then count and log.
    assert!(matches!(cmds[0], Command::Write { what: "complete", .. }));
    let Command::Local(Local::Complete(h, record)) = &cmds[1] else { panic!("{cmds:?}") };
    assert_eq!(*h, handle());
    assert_eq!(record.state, State::Completed(response()));
    let w = writes(&cmds);
    let (_, Some(t), Some(fallback)) = w[0] else { panic!("{w:?}") };
    assert_eq!(t.record.as_ref().map(|r| &r.state), Some(&State::Completed(response())));
    // The fallback marks the outcome unknown; it never frees the key.
    assert!(!is_release(fallback));
    assert_eq!(
        fallback.record.as_ref().map(|r| &r.state),
        Some(&State::OutcomeUnknown { reason: UnknownReason::StoreWriteFailed })
    );
    assert_eq!(counts(&cmds), vec![Count::Stored]);
    assert_eq!(logs(&cmds), vec![(Level::Debug, "idemgate: outcome=stored key=k d=1".to_string())]);
}

#[test]
fn each_local_answer_to_a_completion() {
    let cases = [
        (Ok(Completed::StoredWithoutBody), "stored-without-body", Count::StoredWithoutBody, Level::Info),
        // A claim taken over by another owner: nothing written locally, counted, never a release.
        (Ok(Completed::LostClaim), "lost-claim", Count::LostClaim, Level::Info),
        (Err("Busy".to_string()), "local-error", Count::LocalErrors, Level::Warn),
    ];
    for (answer, want, count, level) in cases {
        let (cmds, slug) = settle(&claim(false), true, Outcome::Store, LocalAnswer::Completed(answer));
        assert_eq!(slug, want);
        assert_eq!(counts(&cmds), vec![count]);
        assert_eq!(logs(&cmds)[0].0, level);
        // Not in the store: no store write.
        assert!(writes(&cmds).is_empty());
        assert!(!cmds.iter().any(|c| matches!(c, Command::Local(Local::Release(_)))));
    }
    let (cmds, _) = settle(&claim(false), true, Outcome::Store, LocalAnswer::Completed(Err("Busy".into())));
    assert_eq!(logs(&cmds)[0].1, "idemgate: outcome=store_failed key=k d=1 error=Busy");
}

#[test]
fn release_frees_both_tiers_and_counts_only_a_local_release() {
    let (cmds, slug) = settle(&claim(true), true, Outcome::Release, LocalAnswer::Released(true));
    assert_eq!(slug, "released");
    assert_eq!(cmds[0], Command::Local(Local::Release(handle())));
    let w = writes(&cmds);
    assert_eq!(w.len(), 1);
    assert!(w[0].0 == "release" && w[0].2.is_none());
    assert_eq!(w[0].1, Some(&Transition::release(OwnerToken([7; 16]))));
    assert_eq!(counts(&cmds), vec![Count::Released]);
    assert_eq!(logs(&cmds), vec![(Level::Info, "idemgate: outcome=released key=k d=1".to_string())]);
    // A claim no longer ours locally: not counted as released.
    let (cmds, _) = settle(&claim(true), true, Outcome::Release, LocalAnswer::Released(false));
    assert!(counts(&cmds).is_empty());
}

#[test]
fn unknown_marks_both_tiers() {
    let reason = UnknownReason::UpstreamTimeout;
    let (cmds, slug) = settle(&claim(true), true, Outcome::Unknown(reason), LocalAnswer::Marked(Ok(true)));
    assert_eq!(slug, "marked-unknown");
    assert_eq!(cmds[0], Command::Local(Local::MarkUnknown(handle(), reason)));
    let w = writes(&cmds);
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].0, "unknown");
    assert_eq!(w[0].1.unwrap().record.as_ref().map(|r| &r.state), Some(&State::OutcomeUnknown { reason }));
    assert_eq!(counts(&cmds), vec![Count::UnknownOutcome]);
    assert_eq!(logs(&cmds)[0].1, format!("idemgate: outcome=unknown_outcome key=k d=1 reason={}", reason.as_str()));
}

/// Issue 39, item 8: the local tier's answer to the mark decides the count and the slug; the
/// store's outcome-unknown write goes whatever it was (never a release).
#[test]
fn a_mark_the_local_tier_refused_or_failed_is_not_reported_as_marked() {
    let reason = UnknownReason::UpstreamTimeout;
    let (cmds, slug) = settle(&claim(true), true, Outcome::Unknown(reason), LocalAnswer::Marked(Err("Host".into())));
    assert_eq!(slug, "local-error");
    assert_eq!(counts(&cmds), vec![Count::UnknownOutcome, Count::LocalErrors]);
    assert_eq!(
        logs(&cmds)[0],
        (Level::Warn, "idemgate: outcome=unknown_outcome_local_failed key=k d=1 error=Host".to_string())
    );
    let w = writes(&cmds);
    assert!(w.len() == 1 && w[0].0 == "unknown" && !is_release(w[0].1.unwrap()));
    let (cmds, slug) = settle(&claim(true), true, Outcome::Unknown(reason), LocalAnswer::Marked(Ok(false)));
    assert_eq!(slug, "lost-claim");
    assert_eq!(counts(&cmds), vec![Count::UnknownOutcome, Count::LostClaim]);
    assert_eq!(writes(&cmds).len(), 1);
}

#[test]
fn no_store_write_without_a_store_or_a_store_claim() {
    for outcome in [Outcome::Store, Outcome::Release, Outcome::Unknown(UnknownReason::Other)] {
        assert!(writes(&settle(&claim(true), false, outcome, LocalAnswer::Marked(Ok(true))).0).is_empty());
        assert!(writes(&settle(&claim(false), true, outcome, LocalAnswer::Marked(Ok(true))).0).is_empty());
    }
}

#[test]
fn without_a_local_handle_only_the_store_is_written() {
    let mut c = claim(true);
    c.handle = None;
    let (cmds, slug) = settle(&c, true, Outcome::Store, LocalAnswer::None);
    assert_eq!(slug, "stored");
    assert!(!cmds.iter().any(|c| matches!(c, Command::Local(_))));
    assert_eq!(writes(&cmds).len(), 1);
}

#[test]
fn mcp_without_its_final_response_is_unknown_never_stored() {
    let mut c = claim(true);
    c.mcp_id = Some(b"7".to_vec());
    let (cmds, slug) = settle(&c, true, Outcome::Store, LocalAnswer::Marked(Ok(true)));
    assert_eq!(slug, "marked-unknown");
    assert!(logs(&cmds)[0].1.starts_with("idemgate: outcome=mcp_no_final_response key=k d=1 why="));
    assert!(cmds.iter().any(|c| matches!(c, Command::Local(Local::MarkUnknown(_, UnknownReason::Other)))));
    assert!(!cmds.iter().any(|c| matches!(c, Command::Local(Local::Complete(..)) | Command::Local(Local::Release(_)))));
    let w = writes(&cmds);
    assert!(w.len() == 1 && w[0].0 == "unknown" && !is_release(w[0].1.unwrap()));
}

#[test]
fn a_claim_without_its_policy_is_kept() {
    let c = claim(true);
    let (m, cmds) = start(&c, None, true, false, Outcome::Release, None, false, "d=1", NOW);
    assert_eq!(counts(&cmds), vec![Count::InternalErrors]);
    assert!(!cmds.iter().any(|c| matches!(c, Command::Local(_) | Command::Write { .. })));
    let (rest, slug) = m.finish(LocalAnswer::None);
    assert!(rest.is_empty());
    assert_eq!(slug, INTERNAL_STATE);
}

/// Whatever the outcome, the local answer and the tiers, nothing is released unless the
/// classified outcome is `Release` (the evidence the request never executed).
#[test]
fn never_a_release_without_evidence() {
    let answers = [
        LocalAnswer::None,
        LocalAnswer::Completed(Ok(Completed::Stored)),
        LocalAnswer::Completed(Ok(Completed::LostClaim)),
        LocalAnswer::Completed(Err("x".into())),
        LocalAnswer::Released(true),
        LocalAnswer::Marked(Ok(true)),
        LocalAnswer::Marked(Ok(false)),
        LocalAnswer::Marked(Err("x".into())),
    ];
    let outcomes = [Outcome::Store, Outcome::Unknown(UnknownReason::Other), Outcome::Unknown(UnknownReason::StaleLock)];
    for outcome in outcomes {
        for answer in answers.clone() {
            for mcp in [None, Some(b"1".to_vec())] {
                let mut c = claim(true);
                c.mcp_id = mcp;
                let (cmds, slug) = settle(&c, true, outcome, answer.clone());
                assert_ne!(slug, "released");
                assert!(!cmds.iter().any(|c| matches!(c, Command::Local(Local::Release(_)))));
                assert!(!counts(&cmds).contains(&Count::Released));
                for (_, t, f) in writes(&cmds) {
                    assert!(!is_release(t.unwrap()) && !f.is_some_and(is_release));
                }
            }
        }
    }
}

fn mcp_response(status: u16, content_type: &str, body: &[u8]) -> StoredResponse {
    StoredResponse {
        status,
        headers: vec![("content-type".into(), content_type.as_bytes().to_vec())],
        body: body.to_vec(),
    }
}

fn mcp_settle(outcome: Outcome, r: Option<StoredResponse>, too_large: bool) -> (Vec<Command<'static>>, &'static str) {
    mcp_settle_as(InputRequired::Keep, false, outcome, r, too_large)
}

/// `mcp_settle` on a route whose `mcp.input_required` is `input_required`, on a redirect's target
/// or not (`redirected`).
fn mcp_settle_as(
    input_required: InputRequired,
    redirected: bool,
    outcome: Outcome,
    r: Option<StoredResponse>,
    too_large: bool,
) -> (Vec<Command<'static>>, &'static str) {
    let mut c = claim(true);
    c.mcp_id = Some(b"7".to_vec());
    c.mcp_round = Some(crate::record::RoundId { digest: [4; 32], state: None });
    let c: &'static Claim = Box::leak(Box::new(c));
    let policy = Policy { mcp: Some(McpPolicy { input_required, ..McpPolicy::default() }), ..Policy::default() };
    let (m, mut cmds) = start(c, Some(&policy), true, redirected, outcome, r, too_large, "d=1", NOW);
    let local = match cmds.last() {
        Some(Command::Local(Local::Complete(..))) => LocalAnswer::Completed(Ok(Completed::Stored)),
        Some(Command::Local(Local::Release(_))) => LocalAnswer::Released(true),
        Some(Command::Local(Local::MarkUnknown(..))) => LocalAnswer::Marked(Ok(true)),
        _ => LocalAnswer::None,
    };
    let (rest, slug) = m.finish(local);
    cmds.extend(rest);
    (cmds, slug)
}

/// Issue 40: an answer with a status the route releases (400, 404) that carries the call's
/// JSON-RPC response (a 2026-07-28 Python server's answer to a tool that raised) is the call's
/// result: stored, never released. A refusal without it (`"id": null`, no body) still releases;
/// one for another id, or one that cannot be read, is outcome-unknown.
#[test]
fn mcp_a_released_status_carrying_the_calls_response_is_stored() {
    let err = br#"{"jsonrpc":"2.0","id":7,"error":{"code":-32600,"message":"charged, then failed"}}"#;
    let (cmds, slug) = mcp_settle(Outcome::Release, Some(mcp_response(400, "application/json", err)), false);
    assert_eq!(slug, "stored");
    let stored = cmds.iter().find_map(|c| match c {
        Command::Local(Local::Complete(_, r)) => Some(r.clone()),
        _ => None,
    });
    assert!(
        matches!(stored.map(|r| r.state), Some(State::Completed(response)) if response.status == 400 && response.body == err)
    );
    let null = br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32001,"message":"Session not found"}}"#;
    assert_eq!(mcp_settle(Outcome::Release, Some(mcp_response(404, "application/json", null)), false).1, "released");
    assert_eq!(mcp_settle(Outcome::Release, Some(mcp_response(405, "text/plain", b"")), false).1, "released");
    assert_eq!(mcp_settle(Outcome::Release, None, false).1, "released");
    let other = br#"{"jsonrpc":"2.0","id":"other","error":{"code":-32600,"message":"x"}}"#;
    assert_eq!(
        mcp_settle(Outcome::Release, Some(mcp_response(400, "application/json", other)), false).1,
        "marked-unknown"
    );
    // Issue 40: the 1.x Python SDK transport's refusals before dispatch carry `"id":
    // "server-error"` (a missing or unknown session, the accept or content type, a body it cannot
    // read): released at a released status, as `"id": null` is. Its failures after dispatch
    // (500) and its 503 (too many sessions; not a released status) stay outcome-unknown, never
    // stored as the call's answer. (On a redirect's target nothing releases: the machine makes
    // a release outcome-unknown before settling, `redirect::after_first_hop`.)
    let no_id =
        br#"{"jsonrpc":"2.0","id":"server-error","error":{"code":-32600,"message":"Bad Request: Missing session ID"}}"#;
    for status in [400, 404, 406, 415] {
        let r = Some(mcp_response(status, "application/json", no_id));
        assert_eq!(mcp_settle(Outcome::Release, r, false).1, "released", "{status}");
    }
    for status in [500, 503] {
        let (cmds, slug) = mcp_settle(Outcome::Store, Some(mcp_response(status, "application/json", no_id)), false);
        assert_eq!(slug, "marked-unknown", "{status}");
        assert!(!cmds.iter().any(|c| matches!(c, Command::Local(Local::Complete(..)))));
    }
    let sse = [&b"event: message\ndata: "[..], no_id, b"\n\n"].concat();
    assert_eq!(
        mcp_settle(Outcome::Release, Some(mcp_response(400, "text/event-stream", &sse)), false).1,
        "marked-unknown"
    );
    assert_eq!(
        mcp_settle(Outcome::Release, Some(mcp_response(400, "application/json", err)), true).1,
        "marked-unknown"
    );
}

/// The review of this session's MCP change: a released status whose body may hold the call's
/// response but cannot be read whole (a tool's error with data nested beyond the parser's depth,
/// a number out of range, an event cut before its end) is outcome-unknown, never a release; a
/// non-2xx answer for another id is never stored as this call's (it would be replayed under the
/// retry's id).
#[test]
fn mcp_a_released_status_with_an_answer_it_cannot_read_is_never_released() {
    let deep = format!(
        r#"{{"jsonrpc":"2.0","id":7,"error":{{"code":-32602,"message":"charged","data":{}0{}}}}}"#,
        "[".repeat(300),
        "]".repeat(300)
    );
    let cases: Vec<(u16, &str, Vec<u8>)> = vec![
        (400, "application/json", deep.into_bytes()),
        (400, "application/json", br#"{"jsonrpc":"2.0","id":7,"error":{"code":1e400,"message":"x"}}"#.to_vec()),
        (404, "text/event-stream", b"data: {\"jsonrpc\":\"2.0\",\"id\":7,\"error\":{}}".to_vec()),
    ];
    for (status, ct, body) in cases {
        let (cmds, slug) = mcp_settle(Outcome::Release, Some(mcp_response(status, ct, &body)), false);
        assert_eq!(slug, "marked-unknown", "{status} {ct}");
        assert!(!cmds.iter().any(|c| matches!(c, Command::Local(Local::Release(_)))));
    }
    let other = br#"{"jsonrpc":"2.0","id":3,"result":{"payment":"p-3"}}"#;
    let (cmds, slug) = mcp_settle(Outcome::Store, Some(mcp_response(500, "application/json", other)), false);
    assert_eq!(slug, "marked-unknown");
    assert!(!cmds.iter().any(|c| matches!(c, Command::Local(Local::Complete(..)))));
}

/// Issue 40: the call's final response received is a completion whatever the exchange did
/// after it (a server keeping the event stream open, the client leaving once it read it).
#[test]
fn mcp_a_final_response_received_is_a_completion_whatever_came_after() {
    let sse = b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"ok\":1}}\n\n: ping\n\n";
    for reason in [UnknownReason::DownstreamGone, UnknownReason::UpstreamReset, UnknownReason::Other] {
        let (cmds, slug) =
            mcp_settle(Outcome::Unknown(reason), Some(mcp_response(200, "text/event-stream", sse)), false);
        assert_eq!(slug, "stored", "{reason:?}");
        assert!(logs(&cmds).iter().any(|(_, l)| l.contains("outcome=mcp_final_response_received")));
        assert_eq!(writes(&cmds)[0].0, "complete");
    }
    // Without it, the outcome stays unknown.
    let cut = b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}";
    let gone = Outcome::Unknown(UnknownReason::DownstreamGone);
    assert_eq!(mcp_settle(gone, Some(mcp_response(200, "text/event-stream", cut)), false).1, "marked-unknown");
    assert_eq!(mcp_settle(gone, Some(mcp_response(200, "text/event-stream", sse)), true).1, "marked-unknown");
}

/// Issue 40: a round that asks for input (2026-07-28 `InputRequiredResult`) is not the call's
/// end. Where the route releases it (`mcp.input_required: "release"`), it is released whatever
/// the exchange's outcome, so the round that answers it claims the key; a result that only looks
/// like it (neither `inputRequests` nor `requestState`, another `resultType`, nested in the
/// tool's content, another id) is not. By default it is kept as the call's answer (a tool may have
/// acted before it asked: a re-sent first round would run it again), and a redirect's target
/// never releases (its first hop executed), as the review found.
#[test]
fn mcp_a_round_that_asks_for_input_is_released_only_where_the_route_says_so() {
    let asks = br#"{"jsonrpc":"2.0","id":7,"result":{"resultType":"input_required","inputRequests":{"q":{"method":"elicitation/create","params":{}}},"requestState":"s1"}}"#;
    let polls = br#"{"jsonrpc":"2.0","id":7,"result":{"resultType":"input_required","requestState":"s2"}}"#;
    let release = |outcome, ct, body: &[u8]| {
        mcp_settle_as(InputRequired::Release, false, outcome, Some(mcp_response(200, ct, body)), false)
    };
    for outcome in [Outcome::Store, Outcome::Unknown(UnknownReason::DownstreamGone), Outcome::Release] {
        for body in [&asks[..], polls] {
            let (cmds, slug) = release(outcome, "application/json", body);
            assert_eq!(slug, "released", "{outcome:?}");
            assert!(cmds.iter().any(|c| matches!(c, Command::Local(Local::Release(_)))), "{outcome:?}");
            assert!(logs(&cmds).iter().any(|(_, l)| l.contains("outcome=mcp_input_required")), "{outcome:?}");
        }
    }
    let sse = format!("event: message\ndata: {}\n\n", std::str::from_utf8(asks).unwrap_or_default());
    assert_eq!(release(Outcome::Store, "text/event-stream", sse.as_bytes()).1, "released");
    let look_alikes: [&[u8]; 4] = [
        br#"{"jsonrpc":"2.0","id":7,"result":{"resultType":"input_required"}}"#,
        br#"{"jsonrpc":"2.0","id":7,"result":{"resultType":"input_required","inputRequests":null}}"#,
        br#"{"jsonrpc":"2.0","id":7,"result":{"resultType":"complete","inputRequests":{}}}"#,
        br#"{"jsonrpc":"2.0","id":7,"result":{"content":[],"structuredContent":{"resultType":"input_required","inputRequests":{}}}}"#,
    ];
    for body in look_alikes {
        assert_eq!(release(Outcome::Store, "application/json", body).1, "stored", "{}", String::from_utf8_lossy(body));
    }
    let other_id = br#"{"jsonrpc":"2.0","id":8,"result":{"resultType":"input_required","inputRequests":{}}}"#;
    assert_eq!(release(Outcome::Store, "application/json", other_id).1, "marked-unknown");
    // The default keeps it, whatever the exchange did: the retry of that round gets it again.
    for outcome in [Outcome::Store, Outcome::Unknown(UnknownReason::DownstreamGone)] {
        let (cmds, slug) = mcp_settle(outcome, Some(mcp_response(200, "application/json", asks)), false);
        assert_eq!(slug, "stored", "{outcome:?}");
        assert!(!cmds.iter().any(|c| matches!(c, Command::Local(Local::Release(_)))), "{outcome:?}");
    }
    // A redirect's target: never released, even where the route releases such rounds.
    let r = Some(mcp_response(200, "application/json", asks));
    assert_eq!(mcp_settle_as(InputRequired::Release, true, Outcome::Store, r, false).1, "stored");
}

/// A route that releases 500 (allowed: `release_on_status` takes 400..=599, and a top-level list
/// applies to MCP routes too) must not release a Python SDK 1.x server's 500 `"server-error"`: the
/// 1.x transport answers it after dispatch (the tool ran, then its answer failed), so the retry
/// would run the tool again. Its 4xx refusals, before dispatch, still release. Found by review:
/// a released 500 read as `NoRequestId` released the key.
#[test]
fn mcp_a_released_500_server_error_after_dispatch_is_outcome_unknown() {
    let no_id =
        br#"{"jsonrpc":"2.0","id":"server-error","error":{"code":-32603,"message":"Error processing request"}}"#;
    let p = Policy { release_on_status: vec![500], ..Policy::default() };
    struct Upstream500;
    impl crate::decision::Exchange for Upstream500 {
        fn forwarded(&mut self) -> bool {
            true
        }
        fn status(&mut self) -> Option<u16> {
            Some(500)
        }
        fn code_details(&mut self) -> String {
            "via_upstream".into()
        }
        fn flags(&mut self) -> u64 {
            0
        }
        fn response_complete(&mut self) -> bool {
            true
        }
        fn upstream_host(&mut self) -> bool {
            true
        }
        fn upstream_connected(&mut self) -> bool {
            true
        }
        fn attempts(&mut self) -> Option<u64> {
            Some(1)
        }
    }
    let outcome = crate::decision::classify_exchange(&mut Upstream500, &p);
    assert_eq!(outcome, Outcome::Release, "the route releases 500");
    let slug = mcp_settle(outcome, Some(mcp_response(500, "application/json", no_id)), false).1;
    assert_eq!(slug, "marked-unknown", "a tool that ran, then failed: 500 server-error");
    let refused = br#"{"jsonrpc":"2.0","id":"server-error","error":{"code":-32600,"message":"Bad Request: No valid session ID provided"}}"#;
    let slug = mcp_settle(Outcome::Release, Some(mcp_response(400, "application/json", refused)), false).1;
    assert_eq!(slug, "released", "a 1.x refusal before dispatch");
}

/// Issue 40: by default (`mcp.input_required` "await") a round that asks for input is stored as
/// the call's awaiting record for the round that asked (the claim's `mcp_round`), in the local
/// tier and in the store alike, whatever the exchange did after the answer; "keep" and a
/// redirect's target store it as the call's answer; a question too large to keep is the call's
/// answer without its body (loud, never run again). Before the awaiting record the default kept
/// it as the call's answer (`State::Completed`).
#[test]
fn mcp_a_round_that_asks_for_input_is_an_awaiting_record_by_default() {
    let asks = br#"{"jsonrpc":"2.0","id":7,"result":{"resultType":"input_required","inputRequests":{"q":{"method":"elicitation/create","params":{}}},"requestState":"s1"}}"#;
    let kept = |input_required, redirected, outcome, too_large| {
        let r = Some(mcp_response(200, "application/json", asks));
        let (cmds, slug) = mcp_settle_as(input_required, redirected, outcome, r, too_large);
        assert_eq!(slug, "stored");
        let local = cmds.iter().find_map(|c| match c {
            Command::Local(Local::Complete(_, r)) => Some(r.state.clone()),
            _ => None,
        });
        let store = cmds.iter().find_map(|c| match c {
            Command::Write { what: "complete", transition, .. } => transition.record.as_ref().map(|r| r.state.clone()),
            _ => None,
        });
        assert_eq!(local, store, "both tiers keep the same record");
        local
    };
    for outcome in [Outcome::Store, Outcome::Unknown(UnknownReason::DownstreamGone)] {
        let state = kept(InputRequired::default(), false, outcome, false);
        assert!(
            matches!(&state, Some(State::AwaitingInput(a)) if a.round() == [4; 32] && a.earlier().is_empty() && a.response().body == asks
                && a.asked_state() == Some(crate::record::state_digest(&serde_json::json!("s1")))),
            "{outcome:?}: {state:?}"
        );
    }
    for (how, redirected) in [(InputRequired::Keep, false), (InputRequired::Await, true)] {
        let state = kept(how, redirected, Outcome::Store, false);
        assert!(matches!(state, Some(State::Completed(_))), "{how:?} {redirected}: {state:?}");
    }
    let state = kept(InputRequired::Await, false, Outcome::Store, true);
    assert!(matches!(state, Some(State::CompletedTooLarge { .. })), "{state:?}");
    // A final result is the call's answer, whatever the route.
    let done = br#"{"jsonrpc":"2.0","id":7,"result":{"content":[]}}"#;
    let (cmds, _) = mcp_settle_as(
        InputRequired::Await,
        false,
        Outcome::Store,
        Some(mcp_response(200, "application/json", done)),
        false,
    );
    assert!(cmds
        .iter()
        .any(|c| matches!(c, Command::Local(Local::Complete(_, r)) if matches!(r.state, State::Completed(_)))));
}
