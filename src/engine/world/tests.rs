//! Whole requests of two proxies and a store, in memory: the scenarios the Envoy suites cover
//! (`single_proxy`, `two_proxies`, the store suites' lost answers and lock expiry), then random
//! schedules of both proxies, the store's answers, losses and delays, and the clock, with
//! retries of the same keys, checked against the promise.

use super::*;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const NOW: u64 = 1_000_000;
/// A 10 s lock, an hour of outcome-unknown, a day of completions; a store that refuses to be
/// bypassed (`on_unavailable: "reject"`).
const CONFIG: &str = r#"{"scope": {"headers": ["authorization"]}, "ttl_seconds": 86400,
    "lock_ttl_seconds": 10, "unknown_outcome_seconds": 3600,
    "store": {"cluster": "idemgate_store", "authority": "webdis", "on_unavailable": "reject"}}"#;

fn in_flight() -> Answer {
    Answer::InFlight { retry_after_seconds: 1 }
}

fn fresh(body: &str) -> Answer {
    Answer::Fresh { status: 201, body: body.as_bytes().to_vec() }
}

fn replay(body: &str) -> Answer {
    Answer::Replay { status: 201, body: body.as_bytes().to_vec() }
}

/// `CONFIG` with `in_flight: "wait"` (2 s).
fn wait_config() -> String {
    CONFIG.replacen('{', r#"{"in_flight": "wait", "wait_ms": 2000, "#, 1)
}

/// `CONFIG` with detached forwarding (straight to the upstream, 5 s).
fn detached_config() -> String {
    CONFIG.replacen(
        '{',
        r#"{"forwarding": "detached", "upstream": {"cluster": "upstream", "timeout_ms": 5000, "hop": "direct"}, "#,
        1,
    )
}

/// Moves the clock to the next write retry of any root (a tick then sends it): `false` if none
/// waits.
fn to_next_retry(w: &mut World) -> bool {
    let Some(at) = w.proxies.iter().filter_map(|p| p.root.writes.next_retry_ms()).min() else { return false };
    w.tick(at.saturating_sub(w.now));
    true
}

/// The response body of the completed record the store holds for `skey`, if any.
fn stored_body(w: &mut World, skey: &StorageKey) -> Option<Vec<u8>> {
    match w.store.read(*skey, w.now) {
        ReadReply::Found(StoredValue { record: Record { state: State::Completed(resp), .. }, .. }) => Some(resp.body),
        _ => None,
    }
}

fn unknown() -> Answer {
    Answer::Problem(ProblemKind::OutcomeUnknown.slug())
}

fn unavailable() -> Answer {
    Answer::Problem(ProblemKind::StoreUnavailable { retry_after_seconds: 1 }.slug())
}

/// Runs `r` through its headers and body until it waits on a callout or the upstream, or is
/// answered.
fn arrive(w: &mut World, r: usize) {
    w.headers(r);
    if matches!(w.phase(r), Phase::Body) {
        w.body(r);
    }
}

/// The one callout request `r` waits on.
fn its_call(w: &World, r: usize) -> usize {
    match w.phase(r) {
        Phase::Calling { call, .. } => call,
        ref other => panic!("request {r} waits on no callout: {other:?}"),
    }
}

/// Answers every callout on its way (the root's writes, orphans) until none is left.
fn answer_all(w: &mut World) {
    for _ in 0..16 {
        let pending = w.pending_calls();
        if pending.is_empty() {
            return;
        }
        for c in pending {
            w.answer(c);
        }
    }
    panic!("callouts keep coming");
}

/// One request all the way: arrives, its claim answered, the upstream answers, its writes land.
fn whole(w: &mut World, proxy: usize, key: &str, body: &[u8]) -> Answer {
    let r = w.send(proxy, key, body);
    arrive(w, r);
    // A claim-or-read, then perhaps a take-over.
    for _ in 0..2 {
        if let Phase::Calling { .. } = w.phase(r) {
            w.answer(its_call(w, r));
        }
    }
    if let Phase::Upstream = w.phase(r) {
        w.upstream(r, Upstream::Answers);
    }
    answer_all(w);
    match w.reqs[r].answer() {
        Some(a) => a.clone(),
        None => panic!("request {r} unanswered: {:?}", w.phase(r)),
    }
}

fn skey(w: &World, r: usize) -> StorageKey {
    w.reqs[r].skey.unwrap_or_else(|| panic!("request {r} has no key yet"))
}

#[test]
fn a_first_request_executes_once_and_its_retries_on_either_proxy_get_its_replay() {
    let mut w = World::new(CONFIG, 2, NOW);
    let first = whole(&mut w, 0, "k-1", b"{\"amount\":1}");
    assert_eq!(first, Answer::Fresh { status: 201, body: b"k-1#1".to_vec() });
    assert_eq!(w.store.stage(&skey(&w, 0), w.now), Stage::Completed);
    // Its retry on the same proxy: from the local tier, no store call.
    w.tick(100);
    let r = w.send(0, "k-1", b"{\"amount\":1}");
    arrive(&mut w, r);
    assert_eq!(w.reqs[r].answer(), Some(&Answer::Replay { status: 201, body: b"k-1#1".to_vec() }));
    assert!(w.pending_calls().is_empty(), "a local replay asks the store nothing");
    // On the other proxy: from the store, which then keeps a local copy.
    let other = whole(&mut w, 1, "k-1", b"{\"amount\":1}");
    assert_eq!(other, Answer::Replay { status: 201, body: b"k-1#1".to_vec() });
    let r = w.send(1, "k-1", b"{\"amount\":1}");
    arrive(&mut w, r);
    assert!(matches!(w.reqs[r].answer(), Some(Answer::Replay { .. })), "{:?}", w.phase(r));
    assert_eq!(w.runs.get("k-1"), Some(&1));
    // Another key is its own.
    assert_eq!(whole(&mut w, 1, "k-2", b"{}"), Answer::Fresh { status: 201, body: b"k-2#1".to_vec() });
}

#[test]
fn a_retry_while_the_first_runs_is_409_on_either_proxy_and_a_reused_key_is_422() {
    let mut w = World::new(CONFIG, 2, NOW);
    let first = w.send(0, "k-1", b"{\"amount\":1}");
    arrive(&mut w, first);
    w.answer(its_call(&w, first));
    assert!(matches!(w.phase(first), Phase::Upstream));
    // The same proxy: its local claim answers at the headers.
    let local = w.send(0, "k-1", b"{\"amount\":1}");
    arrive(&mut w, local);
    assert_eq!(w.reqs[local].answer(), Some(&in_flight()));
    // The other proxy: the store answers.
    let remote = w.send(1, "k-1", b"{\"amount\":1}");
    arrive(&mut w, remote);
    w.answer(its_call(&w, remote));
    assert_eq!(w.reqs[remote].answer(), Some(&in_flight()));
    w.upstream(first, Upstream::Answers);
    answer_all(&mut w);
    // Another body under the same key: 422 on both proxies, nothing executed.
    let reused = whole(&mut w, 0, "k-1", b"{\"amount\":2}");
    assert_eq!(reused, Answer::Problem(ProblemKind::KeyReused { status: 422 }.slug()));
    let reused = whole(&mut w, 1, "k-1", b"{\"amount\":2}");
    assert_eq!(reused, Answer::Problem(ProblemKind::KeyReused { status: 422 }.slug()));
    assert_eq!(w.runs.get("k-1"), Some(&1));
}

#[test]
fn a_lost_claim_answer_is_503_released_so_the_retry_executes_once() {
    let mut w = World::new(CONFIG, 2, NOW);
    let r = w.send(0, "k-1", b"{}");
    arrive(&mut w, r);
    // The claim landed; its answer is lost: 503, never forwarded, the claim released
    // owner-checked through the root.
    w.lose(its_call(&w, r), Loss::AfterLanding);
    assert_eq!(w.reqs[r].answer(), Some(&unavailable()));
    answer_all(&mut w);
    assert_eq!(w.store.stage(&skey(&w, r), w.now), Stage::Absent);
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), Answer::Fresh { status: 201, body: b"k-1#1".to_vec() });
    assert_eq!(w.runs.get("k-1"), Some(&1));
}

#[test]
fn a_claim_landing_after_its_own_release_is_refused_by_the_tombstone() {
    let mut w = World::new(CONFIG, 2, NOW);
    let r = w.send(0, "k-1", b"{}");
    arrive(&mut w, r);
    let claim = its_call(&w, r);
    // Given up on before it reaches the store; its release lands first (a tombstone).
    w.lose(claim, Loss::LandsLater);
    let writes: Vec<usize> = w
        .pending_calls()
        .into_iter()
        .filter(|&c| matches!(w.calls[c], Some(Callout { caller: Caller::Write { .. }, .. })))
        .collect();
    assert_eq!(writes.len(), 1, "the release");
    w.answer(writes[0]);
    answer_all(&mut w);
    assert_eq!(w.store.stage(&skey(&w, r), w.now), Stage::Absent, "the late claim is refused");
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), Answer::Fresh { status: 201, body: b"k-1#1".to_vec() });
}

#[test]
fn a_completion_the_store_never_gets_falls_back_to_outcome_unknown_never_a_second_run() {
    let mut w = World::new(CONFIG, 2, NOW);
    let r = w.send(0, "k-1", b"{}");
    arrive(&mut w, r);
    w.answer(its_call(&w, r));
    w.upstream(r, Upstream::Answers);
    // Every attempt of the completion is lost (the root retries it on its schedule): then its
    // fallback, outcome-unknown, lands.
    for _ in 0..crate::store::MAX_WRITE_ATTEMPTS {
        if w.pending_calls().is_empty() {
            assert!(to_next_retry(&mut w));
        }
        let c = w.pending_calls();
        assert_eq!(c.len(), 1);
        w.lose(c[0], Loss::Never);
    }
    assert!(w.now < NOW + 10_000, "the whole schedule within the lock");
    answer_all(&mut w);
    assert_eq!(w.store.stage(&skey(&w, r), w.now), Stage::Unknown);
    // The first proxy keeps the response; the other meets outcome-unknown.
    assert_eq!(whole(&mut w, 0, "k-1", b"{}"), Answer::Replay { status: 201, body: b"k-1#1".to_vec() });
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), unknown());
    assert_eq!(w.runs.get("k-1"), Some(&1));
}

#[test]
fn a_reset_upstream_leaves_outcome_unknown_everywhere() {
    let mut w = World::new(CONFIG, 2, NOW);
    let r = w.send(0, "k-1", b"{}");
    arrive(&mut w, r);
    w.answer(its_call(&w, r));
    w.upstream(r, Upstream::Resets);
    answer_all(&mut w);
    assert_eq!(whole(&mut w, 0, "k-1", b"{}"), unknown());
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), unknown());
    // Never connected: released, the retry executes.
    let r = w.send(1, "k-2", b"{}");
    arrive(&mut w, r);
    w.answer(its_call(&w, r));
    w.upstream(r, Upstream::NeverConnects);
    answer_all(&mut w);
    assert_eq!(whole(&mut w, 0, "k-2", b"{}"), Answer::Fresh { status: 201, body: b"k-2#1".to_vec() });
    assert_eq!((w.runs.get("k-1"), w.runs.get("k-2")), (Some(&1), Some(&1)));
}

#[test]
fn past_its_lock_a_silent_claim_is_outcome_unknown_and_with_takeover_runs_again() {
    for (config, again) in
        [(CONFIG.to_string(), false), (CONFIG.replacen('{', r#"{"stale_lock": "takeover", "#, 1), true)]
    {
        let mut w = World::new(&config, 2, NOW);
        let r = w.send(0, "k-1", b"{}");
        arrive(&mut w, r);
        w.answer(its_call(&w, r));
        assert!(matches!(w.phase(r), Phase::Upstream));
        // Within the lock: in flight. Past it: the other proxy judges the claim stale.
        assert_eq!(whole(&mut w, 1, "k-1", b"{}"), in_flight());
        w.tick(10_001);
        let retry = whole(&mut w, 1, "k-1", b"{}");
        if again {
            // At least once, by the operator's choice.
            assert_eq!(retry, Answer::Fresh { status: 201, body: b"k-1#1".to_vec() });
        } else {
            assert_eq!(retry, unknown());
            assert_eq!(w.store.stage(&skey(&w, r), w.now), Stage::Unknown);
        }
        // The first attempt's late response: never overwrites what the key became.
        w.upstream(r, Upstream::Answers);
        answer_all(&mut w);
        let want = if again { 2 } else { 1 };
        assert_eq!(w.runs.get("k-1"), Some(&want), "stale_lock takeover: {again}");
        let later = whole(&mut w, 1, "k-1", b"{}");
        if again {
            assert_eq!(later, Answer::Replay { status: 201, body: b"k-1#1".to_vec() });
        } else {
            assert_eq!(later, unknown());
        }
    }
}

#[test]
fn a_claim_answer_later_than_its_lock_is_never_forwarded() {
    let mut w = World::new(CONFIG, 2, NOW);
    let r = w.send(0, "k-1", b"{}");
    arrive(&mut w, r);
    let c = its_call(&w, r);
    w.land(c);
    w.tick(10_000);
    w.answer(c);
    assert_eq!(w.reqs[r].answer(), Some(&unavailable()));
    answer_all(&mut w);
    assert_eq!(w.runs.get("k-1"), None);
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), Answer::Fresh { status: 201, body: b"k-1#1".to_vec() });
}

#[test]
fn a_completion_whose_answers_are_lost_is_retried_by_the_root_until_stored_and_retries_meanwhile_never_execute() {
    let mut w = World::new(CONFIG, 2, NOW);
    let r = w.send(0, "k-1", b"{}");
    arrive(&mut w, r);
    w.answer(its_call(&w, r));
    w.upstream(r, Upstream::Answers);
    assert_eq!(w.reqs[r].answer(), Some(&fresh("k-1#1")));
    // The completion never reaches the store, twice: the first retry goes at once, the next
    // waits for its backoff.
    for _ in 0..2 {
        let c = w.pending_calls();
        assert_eq!(c.len(), 1, "one request of the write in flight");
        w.lose(c[0], Loss::Never);
    }
    assert!(w.pending_calls().is_empty(), "the third attempt waits for its backoff");
    assert_eq!(w.store.stage(&skey(&w, r), w.now), Stage::Forwarded);
    // Meanwhile the other proxy meets the claim in flight; this one replays from its local tier.
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), in_flight());
    assert_eq!(whole(&mut w, 0, "k-1", b"{}"), replay("k-1#1"));
    // The root's tick sends the third attempt, which lands: the other proxy now replays.
    assert!(to_next_retry(&mut w));
    let c = w.pending_calls();
    assert_eq!(c.len(), 1, "the retry, sent by the tick");
    w.answer(c[0]);
    assert_eq!(w.store.stage(&skey(&w, r), w.now), Stage::Completed);
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), replay("k-1#1"));
    assert_eq!(w.runs.get("k-1"), Some(&1));
    let notes = &w.proxies[0].root.notes;
    assert_eq!(notes.iter().filter(|n| matches!(n, Note::Retry { .. })).count(), 2, "{notes:?}");
    assert!(!notes.iter().any(|n| matches!(n, Note::Failed { .. })), "{notes:?}");

    // A completion that landed and whose answer was lost: sent again, it changes nothing; the
    // store keeps the one executed response.
    let r = w.send(1, "k-2", b"{}");
    arrive(&mut w, r);
    w.answer(its_call(&w, r));
    w.upstream(r, Upstream::Answers);
    let c = w.pending_calls();
    assert_eq!(c.len(), 1);
    w.lose(c[0], Loss::AfterLanding);
    assert_eq!(w.pending_calls().len(), 1, "retried at once");
    answer_all(&mut w);
    let k2 = skey(&w, r);
    assert_eq!(stored_body(&mut w, &k2), Some(b"k-2#1".to_vec()));
    assert_eq!(whole(&mut w, 0, "k-2", b"{}"), replay("k-2#1"));
    assert_eq!(w.runs.get("k-2"), Some(&1));
}

#[test]
fn wait_mode_holds_duplicates_until_the_first_completes_then_each_gets_its_own_answer() {
    let mut w = World::new(&wait_config(), 2, NOW);
    let first = w.send(0, "k-1", b"{\"amount\":1}");
    arrive(&mut w, first);
    w.answer(its_call(&w, first));
    assert!(matches!(w.phase(first), Phase::Upstream));
    // The same proxy holds a duplicate on its local claim; the other on the store's.
    let local = w.send(0, "k-1", b"{\"amount\":1}");
    arrive(&mut w, local);
    assert!(matches!(w.phase(local), Phase::Held), "{:?}", w.phase(local));
    let remote = w.send(1, "k-1", b"{\"amount\":1}");
    arrive(&mut w, remote);
    w.answer(its_call(&w, remote));
    assert!(matches!(w.phase(remote), Phase::Held), "{:?}", w.phase(remote));
    // Another operation under the key, on either proxy.
    let reused = [w.send(0, "k-1", b"{\"amount\":2}"), w.send(1, "k-1", b"{\"amount\":2}")];
    for r in reused {
        arrive(&mut w, r);
        if let Phase::Calling { call } = w.phase(r) {
            w.answer(call);
        }
    }
    // Held across ticks: the store is polled and still shows the key in flight.
    for _ in 0..5 {
        w.tick(ROOT_TICK_MS);
        answer_all(&mut w);
    }
    assert!(matches!((w.phase(local), w.phase(remote)), (Phase::Held, Phase::Held)));
    // The first completes; the waiters are answered at the next ticks, from the local tier and
    // from the store.
    w.upstream(first, Upstream::Answers);
    answer_all(&mut w);
    for _ in 0..5 {
        w.tick(ROOT_TICK_MS);
        answer_all(&mut w);
    }
    assert_eq!(w.reqs[local].answer(), Some(&replay("k-1#1")));
    assert_eq!(w.reqs[remote].answer(), Some(&replay("k-1#1")));
    for r in reused {
        assert_eq!(w.reqs[r].answer(), Some(&Answer::Problem(ProblemKind::KeyReused { status: 422 }.slug())), "{r}");
    }
    assert_eq!(w.runs.get("k-1"), Some(&1));
    assert!(w.proxies.iter().all(|p| p.root.waiters.is_empty()));

    // A duplicate held while the first attempt is released and another operation claims the
    // key and completes before the waiter looks: that record is not the held request's (422).
    let first = w.send(0, "k-2", b"{\"amount\":1}");
    arrive(&mut w, first);
    w.answer(its_call(&w, first));
    let held = w.send(1, "k-2", b"{\"amount\":1}");
    arrive(&mut w, held);
    w.answer(its_call(&w, held));
    assert!(matches!(w.phase(held), Phase::Held), "{:?}", w.phase(held));
    w.upstream(first, Upstream::NeverConnects);
    answer_all(&mut w);
    assert_eq!(whole(&mut w, 0, "k-2", b"{\"amount\":2}"), fresh("k-2#1"));
    for _ in 0..5 {
        w.tick(ROOT_TICK_MS);
        answer_all(&mut w);
    }
    assert_eq!(w.reqs[held].answer(), Some(&Answer::Problem(ProblemKind::KeyReused { status: 422 }.slug())));
    assert_eq!(w.runs.get("k-2"), Some(&1));
}

#[test]
fn wait_mode_answers_409_when_the_wait_runs_out_and_retry_now_when_the_first_is_released() {
    let mut w = World::new(&wait_config(), 2, NOW);
    let first = w.send(0, "k-1", b"{}");
    arrive(&mut w, first);
    w.answer(its_call(&w, first));
    let held = w.send(1, "k-1", b"{}");
    arrive(&mut w, held);
    w.answer(its_call(&w, held));
    // Within its 2 s: polled, still in flight, held.
    for _ in 0..19 {
        w.tick(ROOT_TICK_MS);
        answer_all(&mut w);
        assert!(matches!(w.phase(held), Phase::Held), "at {} ms", w.now - NOW);
    }
    // At its deadline: 409, retry after the in-flight seconds.
    w.tick(ROOT_TICK_MS);
    assert_eq!(
        w.reqs[held].answer(),
        Some(&Answer::InFlight { retry_after_seconds: crate::decision::IN_FLIGHT_RETRY_AFTER_SECONDS })
    );
    // Another one held, then the first never reaches the upstream (released): 409 retry now,
    // and its retry executes, once.
    let again = w.send(1, "k-1", b"{}");
    arrive(&mut w, again);
    w.answer(its_call(&w, again));
    assert!(matches!(w.phase(again), Phase::Held));
    w.upstream(first, Upstream::NeverConnects);
    answer_all(&mut w);
    for _ in 0..5 {
        w.tick(ROOT_TICK_MS);
        answer_all(&mut w);
    }
    assert_eq!(w.reqs[again].answer(), Some(&Answer::InFlight { retry_after_seconds: 0 }));
    assert_eq!(w.runs.get("k-1"), None);
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), fresh("k-1#1"));
    assert_eq!(w.runs.get("k-1"), Some(&1));
}

#[test]
fn a_detached_forward_outlives_its_client_stores_its_response_and_the_retry_is_replayed() {
    let mut w = World::new(&detached_config(), 2, NOW);
    let r = w.send(0, "k-1", b"{}");
    arrive(&mut w, r);
    w.answer(its_call(&w, r));
    assert!(matches!(w.phase(r), Phase::Detached), "{:?}", w.phase(r));
    assert!(w.is_out(r), "the root sent it");
    // The client goes away; the root's forward goes on, completes and stores.
    w.leave(r);
    assert_eq!(w.reqs[r].answer(), Some(&Answer::Gone));
    w.upstream_detached(r, Upstream::Answers);
    answer_all(&mut w);
    assert_eq!(w.store.stage(&skey(&w, r), w.now), Stage::Completed);
    let k1 = skey(&w, r);
    assert_eq!(stored_body(&mut w, &k1), Some(b"k-1#1".to_vec()));
    assert_eq!(w.reqs[r].answer(), Some(&Answer::Gone), "nobody to tell");
    assert_eq!(whole(&mut w, 1, "k-1", b"{}"), replay("k-1#1"));
    assert_eq!(whole(&mut w, 0, "k-1", b"{}"), replay("k-1#1"));
    assert_eq!(w.runs.get("k-1"), Some(&1));
    // A client that stays gets the upstream's answer.
    assert_eq!(whole_detached(&mut w, 1, "k-2"), fresh("k-2#1"));
    // A forward the upstream never answers within its timeout: it may have run; outcome
    // unknown on both proxies, never run again.
    let r = w.send(1, "k-3", b"{}");
    arrive(&mut w, r);
    w.answer(its_call(&w, r));
    w.tick(5_000);
    assert_eq!(w.reqs[r].answer(), Some(&Answer::Problem(ProblemKind::UpstreamNoAnswer.slug())));
    answer_all(&mut w);
    assert_eq!(whole(&mut w, 0, "k-3", b"{}"), unknown());
    assert_eq!(whole(&mut w, 1, "k-3", b"{}"), unknown());
    assert_eq!(w.runs.get("k-3"), Some(&1));
}

/// The root's forward carries the client's request headers as the filter's glue sends them
/// (`Protected::forward`): hop-by-hop and recomputed ones, `expect` and the hop probe's mark
/// left out, every other line kept in order, pseudo headers included, and the router told never
/// to re-send it (as every protected request's head is at its headers).
#[test]
fn a_detached_forward_leaves_out_hop_by_hop_headers_expect_and_the_probe_mark() {
    let mut w = World::new(&detached_config(), 1, NOW);
    let r = w.send(0, "k-1", b"{}");
    for (n, v) in [
        ("expect", "100-continue"),
        ("connection", "keep-alive"),
        ("keep-alive", "timeout=5"),
        ("proxy-connection", "keep-alive"),
        ("transfer-encoding", "chunked"),
        ("te", "trailers"),
        ("trailer", "x-sum"),
        ("upgrade", "h2c"),
        ("x-envoy-retry-on", "5xx"),
        ("content-length", "2"),
        (crate::decision::HOP_PROBE_HEADER, "1"),
        ("x-kept", "yes"),
    ] {
        w.reqs[r].head.headers.push((n.to_string(), v.as_bytes().to_vec()));
    }
    arrive(&mut w, r);
    w.answer(its_call(&w, r));
    assert!(w.is_out(r), "the root sent it");
    let names: Vec<&str> = w.proxies[0].root.out[0].0.headers.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [":method", ":path", ":authority", "authorization", "idempotency-key", "x-kept", "x-envoy-max-retries"],
    );
}

/// A detached request all the way, its client staying.
fn whole_detached(w: &mut World, proxy: usize, key: &str) -> Answer {
    let r = w.send(proxy, key, b"{}");
    arrive(w, r);
    w.answer(its_call(w, r));
    w.upstream_detached(r, Upstream::Answers);
    answer_all(w);
    w.reqs[r].answer().cloned().unwrap_or_else(|| panic!("request {r} unanswered: {:?}", w.phase(r)))
}

// Random schedules: native only (proptest is not built for wasm32).
#[cfg(not(target_arch = "wasm32"))]
mod schedules {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::RngSeed;

    const KEYS: [&str; 3] = ["k-a", "k-b", "k-c"];
    /// Two callers: the same key of each is its own.
    const CALLERS: [&str; 2] = [CALLER, "caller-2"];

    /// One thing that happens: `pick` chooses among what can happen now.
    #[derive(Clone, Debug)]
    enum Move {
        /// A client sends (or retries) a key to a proxy; `other_body`: another operation.
        Send {
            proxy: usize,
            caller: usize,
            key: usize,
            other_body: bool,
        },
        /// A request's proxy takes its next callback (headers, body).
        Advance {
            pick: usize,
        },
        /// The upstream finishes a forwarded request (the request's own, or its root's detached
        /// forward).
        Upstream {
            pick: usize,
            how: u8,
        },
        /// A callout lands (its answer still on its way).
        Land {
            pick: usize,
        },
        Answer {
            pick: usize,
        },
        Lose {
            pick: usize,
            how: u8,
        },
        /// The clock moves; every root ticks.
        Tick {
            ms: u64,
        },
        /// The store is out for a root write's whole schedule: every attempt of it is lost, the
        /// clock moving to each retry (then its fallback, if any, is on its way).
        Outage {
            pick: usize,
        },
        /// A client not yet answered goes away.
        Leave {
            pick: usize,
        },
    }

    fn moves() -> impl Strategy<Value = Move> {
        prop_oneof![
            3 => (0..2usize, 0..CALLERS.len(), 0..KEYS.len(), proptest::bool::weighted(0.1))
                .prop_map(|(proxy, caller, key, other_body)| Move::Send { proxy, caller, key, other_body }),
            4 => any::<usize>().prop_map(|pick| Move::Advance { pick }),
            2 => (any::<usize>(), 0..3u8).prop_map(|(pick, how)| Move::Upstream { pick, how }),
            1 => any::<usize>().prop_map(|pick| Move::Land { pick }),
            4 => any::<usize>().prop_map(|pick| Move::Answer { pick }),
            1 => (any::<usize>(), 0..3u8).prop_map(|(pick, how)| Move::Lose { pick, how }),
            2 => (0..4_000u64).prop_map(|ms| Move::Tick { ms }),
            1 => any::<usize>().prop_map(|pick| Move::Outage { pick }),
            1 => any::<usize>().prop_map(|pick| Move::Leave { pick }),
        ]
    }

    /// Every key's operation sends the same body (so only the key tells them apart); `other`:
    /// another operation under the same key.
    fn body(_key: usize, other: bool) -> Vec<u8> {
        format!("{{\"amount\":1,\"other\":{other}}}").into_bytes()
    }

    /// The pending callout of write `id` of `proxy`'s root (not its fallback), if any.
    fn write_call(w: &World, proxy: usize, id: WriteId) -> Option<usize> {
        w.pending_calls().into_iter().find(|&c| {
            matches!(w.calls[c], Some(Callout { caller: Caller::Write { proxy: p, id: i, fallback: false }, .. }) if p == proxy && i == id)
        })
    }

    /// The store is out for the whole schedule of the write callout `first` is part of.
    fn outage(w: &mut World, first: usize) {
        let Some(Callout { caller: Caller::Write { proxy, id, .. }, .. }) = w.calls[first].clone() else { return };
        w.lose(first, Loss::Never);
        for _ in 0..crate::store::MAX_WRITE_ATTEMPTS {
            // Its next attempt: at once, or at the root's tick after its backoff.
            if write_call(w, proxy, id).is_none() {
                let Some(at) = w.proxies[proxy].root.writes.next_retry_ms() else { return };
                w.tick(at.saturating_sub(w.now));
            }
            let Some(c) = write_call(w, proxy, id) else { return };
            w.lose(c, Loss::Never);
        }
    }

    /// Runs `moves`, then lets everything finish; the promise checked at the end.
    fn run(config: &str, moves: &[Move]) -> Result<(), TestCaseError> {
        // A local table sized for a schedule's few keys (the default's creation, 2 x 256 times,
        // is most of the run's time; no schedule comes near a full bucket).
        let config = config.replacen('{', r#"{"local": {"max_entries": 1024}, "#, 1);
        let mut w = World::new(&config, 2, NOW);
        for m in moves {
            match *m {
                Move::Send { proxy, caller, key, other_body } => {
                    w.send_as(proxy, CALLERS[caller], KEYS[key], &body(key, other_body));
                }
                Move::Advance { pick } => {
                    let ready: Vec<usize> =
                        (0..w.reqs.len()).filter(|&r| matches!(w.phase(r), Phase::New | Phase::Body)).collect();
                    if let Some(&r) = ready.get(pick % ready.len().max(1)) {
                        if matches!(w.phase(r), Phase::New) {
                            w.headers(r);
                        } else {
                            w.body(r);
                        }
                    }
                }
                Move::Upstream { pick, how } => {
                    let up: Vec<usize> =
                        (0..w.reqs.len()).filter(|&r| matches!(w.phase(r), Phase::Upstream) || w.is_out(r)).collect();
                    if let Some(&r) = up.get(pick % up.len().max(1)) {
                        let how = [Upstream::Answers, Upstream::Resets, Upstream::NeverConnects][how as usize % 3];
                        if w.is_out(r) {
                            w.upstream_detached(r, how);
                        } else {
                            w.upstream(r, how);
                        }
                    }
                }
                Move::Land { pick } | Move::Answer { pick } | Move::Lose { pick, .. } => {
                    let pending = w.pending_calls();
                    let Some(&c) = pending.get(pick % pending.len().max(1)) else { continue };
                    match *m {
                        Move::Land { .. } => w.land(c),
                        Move::Answer { .. } => w.answer(c),
                        Move::Lose { how, .. } => {
                            w.lose(c, [Loss::Never, Loss::AfterLanding, Loss::LandsLater][how as usize % 3])
                        }
                        _ => {}
                    }
                }
                Move::Outage { pick } => {
                    let writes: Vec<usize> = w
                        .pending_calls()
                        .into_iter()
                        .filter(|&c| {
                            matches!(w.calls[c], Some(Callout { caller: Caller::Write { fallback: false, .. }, .. }))
                        })
                        .collect();
                    let Some(&first) = writes.get(pick % writes.len().max(1)) else { continue };
                    outage(&mut w, first);
                }
                // Well within unknown_outcome_seconds (an hour) over the whole schedule.
                Move::Tick { ms } => w.tick(ms),
                Move::Leave { pick } => {
                    let open: Vec<usize> = (0..w.reqs.len()).filter(|&r| w.reqs[r].answered.is_none()).collect();
                    if let Some(&r) = open.get(pick % open.len().max(1)) {
                        w.leave(r);
                    }
                }
            }
        }
        // No request waits forever: everything finishes once the world lets it (the clock moving
        // a root tick at a time while a root waits).
        prop_assert!(w.drain(512), "unfinished: {:?}", (0..w.reqs.len()).map(|r| w.phase(r)).collect::<Vec<_>>());
        // Retries after it all: each key executed, none again.
        for caller in CALLERS {
            for (i, key) in KEYS.iter().enumerate() {
                let l = label(caller, key);
                let before = w.runs.get(&l).copied().unwrap_or(0);
                w.send_as(0, caller, key, &body(i, false));
                prop_assert!(w.drain(512));
                w.send_as(1, caller, key, &body(i, false));
                prop_assert!(w.drain(512));
                let after = w.runs.get(&l).copied().unwrap_or(0);
                prop_assert!(after <= before.max(1), "{l}: retries ran it again ({before} then {after})");
            }
        }
        // The upstream executes each key at most once.
        for (key, n) in &w.runs {
            prop_assert!(*n <= 1, "{key} executed {n} times");
        }
        prop_assert_eq!(w.unprotected, 0);
        // Every client got its own request's response (its key's and caller's, executed for its
        // very operation), as the upstream gave it.
        for q in &w.reqs {
            if let Some(Answer::Replay { body, .. } | Answer::Fresh { body, .. }) = q.answer() {
                let given = w.responses.get(&q.label()).map(|b| b.contains(body)).unwrap_or(false);
                prop_assert!(given, "{} got {:?}", q.label(), String::from_utf8_lossy(body));
                let origin = w.origins.get(body);
                prop_assert_eq!(origin, Some(&q.body), "{} got another operation's response", q.label());
            }
        }
        // Every stored record, in the store and in each proxy's local tier, is the one executed
        // response of its key.
        let keys: HashMap<StorageKey, String> = w.reqs.iter().filter_map(|q| Some((q.skey?, q.label()))).collect();
        for (skey, l) in &keys {
            let executed = w.responses.get(l).and_then(|b| b.first()).cloned();
            if let Some(body) = stored_body(&mut w, skey) {
                prop_assert_eq!(Some(&body), executed.as_ref(), "the store's record of {}", l);
            }
            let now = w.now;
            for p in &mut w.proxies {
                let peeked = p.table.peek(&mut p.sd, skey, now).ok().flatten();
                if let Some(Record { state: State::Completed(resp), .. }) = peeked.and_then(|x| x.record) {
                    prop_assert_eq!(Some(&resp.body), executed.as_ref(), "a local record of {}", l);
                }
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 256,
            rng_seed: RngSeed::Fixed(26),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn random_schedules_of_two_proxies_and_a_store_keep_the_promise(
            moves in proptest::collection::vec(moves(), 1..160)
        ) {
            run(CONFIG, &moves)?;
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 256,
            rng_seed: RngSeed::Fixed(2626),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// The root's machines in the schedules: duplicates held (`in_flight: "wait"`), requests
        /// forwarded by the root (`forwarding: "detached"`), or both.
        #[test]
        fn random_schedules_with_waits_and_detached_forwards_keep_the_promise(
            config in 0..3usize,
            moves in proptest::collection::vec(moves(), 1..160)
        ) {
            let both = wait_config().replacen('{', r#"{"forwarding": "detached", "upstream": {"cluster": "upstream", "timeout_ms": 5000, "hop": "direct"}, "#, 1);
            let config = [wait_config(), detached_config(), both][config].clone();
            run(&config, &moves)?;
        }
    }
}

/// `CONFIG` with a 100 s `ttl_seconds` and a 50 s tombstone (issue 40, item 6).
fn tombstone_config(tombstone_seconds: u64) -> String {
    CONFIG.replacen(
        "\"ttl_seconds\": 86400",
        &format!("\"ttl_seconds\": 100, \"tombstone_seconds\": {tombstone_seconds}"),
        1,
    )
}

fn key_expired() -> Answer {
    Answer::Problem(ProblemKind::KeyExpired.slug())
}

/// Issue 40, item 6: a key retried after its record expired, on either proxy (the store's
/// tombstone on the other, the local tier's on the first), is refused `key-expired` and never
/// executed; another request under it is 422; once the tombstone expires the key is free. Before
/// tombstones the retry past `ttl_seconds` executed a second time (`runs` 2), as it still does
/// with `tombstone_seconds: 0`.
#[test]
fn a_key_retried_after_its_record_expired_meets_its_tombstone_on_either_proxy_then_is_free() {
    let mut w = World::new(&tombstone_config(50), 2, NOW);
    assert_eq!(whole(&mut w, 0, "k-1", b"{\"amount\":1}"), fresh("k-1#1"));
    // Replayed while the record lives, on both proxies (the second keeps a local copy).
    w.tick(99_000);
    assert_eq!(whole(&mut w, 1, "k-1", b"{\"amount\":1}"), replay("k-1#1"));
    // Past `ttl_seconds`: the tombstone, on the first proxy (its own local tier) and the other.
    w.tick(2_000);
    assert_eq!(whole(&mut w, 0, "k-1", b"{\"amount\":1}"), key_expired());
    assert_eq!(whole(&mut w, 1, "k-1", b"{\"amount\":1}"), key_expired());
    assert_eq!(
        whole(&mut w, 1, "k-1", b"{\"amount\":2}"),
        Answer::Problem(ProblemKind::KeyReused { status: 422 }.slug())
    );
    assert_eq!(
        whole(&mut w, 0, "k-1", b"{\"amount\":2}"),
        Answer::Problem(ProblemKind::KeyReused { status: 422 }.slug())
    );
    assert_eq!(w.runs.get("k-1"), Some(&1), "a tombstone never lets the key execute");
    assert_eq!(w.store.stage(&skey(&w, 0), w.now), Stage::Completed, "the store still holds the key");
    // Past the tombstone (ttl 100 s + 50 s from the completion): the key is free everywhere.
    w.tick(50_000);
    assert_eq!(w.store.stage(&skey(&w, 0), w.now), Stage::Absent);
    assert_eq!(whole(&mut w, 1, "k-1", b"{\"amount\":1}"), fresh("k-1#2"));
    assert_eq!(w.runs.get("k-1"), Some(&2));
}

/// `tombstone_seconds: 0` keeps the behaviour of before: past `ttl_seconds` the key is free.
#[test]
fn without_a_tombstone_a_key_past_its_ttl_executes_again() {
    let mut w = World::new(&tombstone_config(0), 2, NOW);
    assert_eq!(whole(&mut w, 0, "k-1", b"{\"amount\":1}"), fresh("k-1#1"));
    w.tick(101_000);
    assert_eq!(whole(&mut w, 1, "k-1", b"{\"amount\":1}"), fresh("k-1#2"));
    assert_eq!(w.runs.get("k-1"), Some(&2));
}
