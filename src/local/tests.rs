//! The local tier against a deterministic model of proxy-wasm shared data, with the host's exact
//! semantics (CAS on an absent key inserts; removal leaves an empty value), including runs of
//! several workers under chosen interleavings of their host calls.

use super::*;
use crate::config::LocalConfig;
use crate::record::StoredResponse;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// Shared data as Envoy implements it (the one fake: `memory::MemoryShared`).
pub type Model = super::memory::MemoryShared;

const NOW: u64 = 1_000_000_000;

fn policy() -> Policy {
    Policy { lock_ttl_seconds: 10, ttl_seconds: 100, unknown_outcome_seconds: 50, ..Policy::default() }
}

/// A table with no protection floor (every test that evicts sets its own).
fn table(max_entries: u64, when_full: WhenFull) -> Table {
    Table::new(&LocalConfig { max_entries, max_bytes: 1 << 20, when_full, min_protection_seconds: 0 })
}

fn skey(n: u64) -> StorageKey {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&n.to_le_bytes());
    k[24..].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    StorageKey(k)
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint([n; 32])
}

fn owner(n: u8) -> OwnerToken {
    OwnerToken([n; 16])
}

fn creator(id: &str) -> Creator {
    Creator { request_id: id.into(), log_values: vec![] }
}

fn response(body: &str) -> StoredResponse {
    StoredResponse { status: 201, headers: vec![("location".into(), b"/r/1".to_vec())], body: body.as_bytes().to_vec() }
}

/// Completes a claim with an upstream response, as the filter does.
#[allow(clippy::too_many_arguments)]
pub fn complete(
    t: &Table,
    sd: &mut dyn SharedData,
    h: &Handle,
    fp: Fingerprint,
    response: StoredResponse,
    too_large: bool,
    creator: &Creator,
    now: u64,
    policy: &Policy,
) -> Result<Completed, LocalError> {
    t.complete(sd, h, Record::completed(fp, response, too_large, creator.clone(), now, policy.ttl_seconds), now)
}

fn fresh(t: &Table) -> Model {
    let mut m = Model::default();
    t.ensure_created(&mut m).unwrap();
    m
}

fn claim(t: &Table, m: &mut Model, k: StorageKey, f: Option<Fingerprint>, o: u8, now: u64) -> Begin {
    t.begin(m, k, f, now, &policy(), owner(o), &creator(&format!("req-{o}"))).unwrap()
}

/// The filter's look at request headers: nothing claimed; the bucket as read, when the key is
/// free to claim.
fn look(t: &Table, m: &mut Model, k: StorageKey, now: u64) -> Option<Seen> {
    match t.begin(m, k, None, now, &policy(), owner(99), &creator("look")).unwrap() {
        Begin::NeedFingerprint { seen } => seen,
        other => panic!("a look at headers claims nothing and needs the body here: {other:?}"),
    }
}

/// A claim made at request headers before its fingerprint (stage claimed), as modules before
/// claims moved to the body's end made them: a table keeps them across a module update (same
/// layout), so every rule about them still holds.
fn claim_at_headers(t: &Table, m: &mut Model, k: StorageKey, o: u8, now: u64, p: &Policy) -> Handle {
    let h = handle(&t.begin(m, k, Some(fp(0)), now, p, owner(o), &creator(&format!("req-{o}"))).unwrap());
    let (mut b, cas) = t.read_bucket(m, h.bucket).unwrap();
    let lt = Lifetimes::of(p);
    let e = b.positions[h.position].as_mut().unwrap();
    e.stage = Stage::Claimed;
    e.fingerprint = None;
    e.expires_at_ms = lt.expires_at(Stage::Claimed, now);
    e.lock_expires_at_ms = lt.lock_expires_at(now);
    assert!(t.write_bucket(m, h.bucket, &b, cas).unwrap());
    h
}

fn handle(b: &Begin) -> Handle {
    match b {
        Begin::Claimed { handle, .. } => *handle,
        other => panic!("expected a claim, got {other:?}"),
    }
}

fn in_flight() -> ProblemKind {
    ProblemKind::InFlight { retry_after_seconds: 1 }
}

fn is_reject(b: &Begin, p: &ProblemKind) -> bool {
    matches!(b, Begin::Reject { problem, .. } if problem == p)
}

#[test]
fn bucket_round_trips_and_refuses_garbage() {
    let mut b = Bucket::empty();
    b.positions[3] = Some(Entry {
        skey: skey(7),
        fingerprint: Some(fp(2)),
        stage: Stage::Completed,
        owner: owner(9),
        since_ms: 1,
        expires_at_ms: 2,
        lock_expires_at_ms: 3,
        status: 201,
        body_bytes: 99,
        floor_ms: 5,
        creator: vec![],
    });
    b.positions[5] = Some(Entry {
        fingerprint: None,
        stage: Stage::Claimed,
        creator: encode_creator(&creator("req-5")),
        ..b.positions[3].clone().unwrap()
    });
    b.left[9] = 1234;
    b.evicted_at_ms = 77;
    b.evicted_age_ms = 66;
    let bytes = b.encode();
    assert_eq!(Bucket::decode(&bytes), Some(b.clone()));
    for cut in 0..bytes.len() {
        assert_eq!(Bucket::decode(&bytes[..cut]), None);
    }
    assert_eq!(Bucket::decode(b"nonsense"), None);
    assert_eq!(Bucket::decode(&[bytes.as_slice(), b"x"].concat()), None, "trailing bytes");
    let mut swapped = bytes.clone();
    swapped[HEADER_BYTES] = 5; // the first entry now claims position 5, the second too
    assert_eq!(Bucket::decode(&swapped), None, "positions must increase");
    let mut out_of_range = bytes.clone();
    out_of_range[HEADER_BYTES] = BUCKET_WIDTH as u8;
    assert_eq!(Bucket::decode(&out_of_range), None);
    assert_eq!(Bucket::decode(&Bucket::empty().encode()), Some(Bucket::empty()));
    assert_eq!(decode_creator(&encode_creator(&creator("req-5"))), Some(creator("req-5")));
    let mut left_on_a_held_position = b.clone();
    left_on_a_held_position.left[3] = 1;
    assert_eq!(Bucket::decode(&left_on_a_held_position.encode()), None, "bytes left only on an empty position");
}

#[test]
fn first_request_claims_then_completes_and_a_retry_replays() {
    let t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    let k = skey(1);
    let b = claim(&t, &mut m, k, Some(fp(1)), 1, NOW);
    let h = handle(&b);
    assert!(is_reject(&claim(&t, &mut m, k, Some(fp(1)), 2, NOW + 1), &in_flight()));
    let done =
        complete(&t, &mut m, &h, fp(1), response("first"), false, &creator("req-1"), NOW + 2, &policy()).unwrap();
    assert_eq!(done, Completed::Stored);
    match claim(&t, &mut m, k, Some(fp(1)), 3, NOW + 3) {
        Begin::Replay(r) => {
            assert_eq!(r.state, State::Completed(response("first")));
            assert_eq!(r.creator.request_id, "req-1");
        }
        other => panic!("{other:?}"),
    }
    match claim(&t, &mut m, k, Some(fp(9)), 4, NOW + 4) {
        Begin::Reject { problem: ProblemKind::KeyReused { .. }, creator: Some(c), .. } => {
            assert_eq!(c.request_id, "req-1")
        }
        other => panic!("{other:?}"),
    }
}

/// Request headers claim nothing: the look answers a live claim 409 at once and hands a free
/// key's bucket (with its CAS) to the claim at the body's end, which needs no read of its own.
#[test]
fn headers_claim_nothing_a_live_claim_gets_409_and_a_completed_key_needs_the_body() {
    let t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    let k = skey(2);
    let seen = look(&t, &mut m, k, NOW);
    assert!(seen.is_some(), "a free key's bucket goes to the body's end");
    assert_eq!(t.occupied(&mut m), 0, "nothing claimed at headers");
    // A duplicate's headers meanwhile: free too, nothing claimed.
    let dup = look(&t, &mut m, k, NOW);
    let before = m.calls;
    let b = t.begin_after(&mut m, k, Some(fp(1)), NOW + 1, &policy(), owner(1), &creator("req-1"), seen).unwrap();
    assert_eq!(m.calls - before, 1, "the claim on the headers' read: one CAS, no read");
    let h = handle(&b);
    // The duplicate's body end: its read is stale (the CAS fails), read again: 409, not a claim.
    let d = t.begin_after(&mut m, k, Some(fp(1)), NOW + 2, &policy(), owner(2), &creator("req-2"), dup).unwrap();
    assert!(is_reject(&d, &in_flight()), "{d:?}");
    match claim(&t, &mut m, k, None, 3, NOW + 2) {
        Begin::Reject { problem, creator: Some(c), .. } => {
            assert_eq!(problem, in_flight());
            assert_eq!(c.request_id, "req-1", "a 409 names the run holding the key");
        }
        other => panic!("{other:?}"),
    }
    complete(&t, &mut m, &h, fp(1), response("x"), false, &creator("req-1"), NOW + 2, &policy()).unwrap();
    assert_eq!(claim(&t, &mut m, k, None, 4, NOW + 3), Begin::NeedFingerprint { seen: None });
}

#[test]
fn peek_reads_without_claiming() {
    let t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    let k = skey(30);
    assert_eq!(t.peek(&mut m, &k, NOW).unwrap(), None);
    let h = handle(&claim(&t, &mut m, k, Some(fp(1)), 1, NOW));
    let p = t.peek(&mut m, &k, NOW).unwrap().unwrap();
    assert!(matches!(p.summary.phase, crate::decision::Phase::Forwarded { .. }));
    assert_eq!(p.record, None);
    complete(&t, &mut m, &h, fp(1), response("ok"), false, &creator("c"), NOW, &policy()).unwrap();
    let p = t.peek(&mut m, &k, NOW).unwrap().unwrap();
    assert_eq!(p.summary.phase, crate::decision::Phase::Completed);
    assert_eq!(p.status, response("ok").status);
    assert_eq!(p.record.unwrap().state, State::Completed(response("ok")));
    assert_eq!(t.occupied(&mut m), 1, "peeking claimed nothing");
}

#[test]
fn expired_records_count_as_absent_on_read() {
    let t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    let k = skey(3);
    let h = handle(&claim(&t, &mut m, k, Some(fp(1)), 1, NOW));
    complete(&t, &mut m, &h, fp(1), response("x"), false, &creator("a"), NOW, &policy()).unwrap();
    let ttl_ms = policy().ttl_seconds * 1000;
    assert!(matches!(claim(&t, &mut m, k, Some(fp(1)), 2, NOW + ttl_ms - 1), Begin::Replay(_)));
    assert!(matches!(claim(&t, &mut m, k, Some(fp(1)), 3, NOW + ttl_ms), Begin::Claimed { took_over: false, .. }));
}

/// Issue 12, item 5: a request claimed at the end of a slow upload holds its key for its lock
/// from then (its record's expiry too): a retry 1.4 s later gets 409 at headers and at its body's
/// end, a sweep frees nothing, and the record then lives from completion.
#[test]
fn a_claim_made_after_a_slow_upload_keeps_its_key_for_its_lock() {
    let t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    let p = Policy { ttl_seconds: 3, lock_ttl_seconds: 3, ..policy() };
    let k = skey(30);
    let seen = look(&t, &mut m, k, NOW);
    let a = handle(&t.begin_after(&mut m, k, Some(fp(1)), NOW + 2_000, &p, owner(1), &creator("a"), seen).unwrap());
    let retry_at = NOW + 3_400;
    for f in [None, Some(fp(1))] {
        let b = t.begin(&mut m, k, f, retry_at, &p, owner(2), &creator("b")).unwrap();
        assert!(is_reject(&b, &in_flight()), "{b:?}");
    }
    assert_eq!(
        t.sweep(&mut m, 0, t.buckets(), retry_at, &mut Gauges::default()).unwrap(),
        0,
        "a sweep frees no live claim"
    );
    assert!(t.peek(&mut m, &k, retry_at).unwrap().is_some());
    let done_at = NOW + 4_000;
    let r = Record::completed(fp(1), response("a"), false, creator("a"), done_at, p.ttl_seconds);
    assert_eq!(t.complete(&mut m, &a, r, NOW).unwrap(), Completed::Stored);
    assert!(matches!(
        t.begin(&mut m, k, Some(fp(1)), done_at + 2_999, &p, owner(3), &creator("c")).unwrap(),
        Begin::Replay(_)
    ));
}

/// Issue 12, item 6, now that headers claim nothing: A's headers were looked at, then (A still
/// uploading) a retry claimed A's key at another position of the bucket and executed. At A's
/// body end the bucket it read is stale: A never claims, it meets the retry's claim (409) or
/// record (replay).
#[test]
fn a_body_end_on_a_bucket_changed_since_its_headers_meets_the_keys_new_claim() {
    let t = table(8, WhenFull::Reject); // one bucket
    let mut m = fresh(&t);
    let p = Policy { ttl_seconds: 2, lock_ttl_seconds: 1, ..policy() };
    let (y, k) = (skey(40), skey(41));
    let hy = handle(&t.begin(&mut m, y, Some(fp(9)), NOW, &p, owner(9), &creator("y")).unwrap());
    let ry = Record::completed(fp(9), response("y"), false, creator("y"), NOW, p.ttl_seconds);
    assert_eq!(t.complete(&mut m, &hy, ry, NOW).unwrap(), Completed::Stored);
    let seen_a = look(&t, &mut m, k, NOW + 10);
    let seen_b = seen_a.clone();
    let later = NOW + 2_300;
    let retry = handle(&t.begin(&mut m, k, Some(fp(1)), later, &p, owner(2), &creator("retry")).unwrap());
    assert_eq!(retry.position, 0, "the retry claims Y's expired position");
    let a = t.begin_after(&mut m, k, Some(fp(1)), later + 100, &p, owner(1), &creator("a"), seen_a).unwrap();
    assert!(is_reject(&a, &in_flight()), "A must not claim: {a:?}");
    // Nor once the retry has completed: its record answers A.
    let rr = Record::completed(fp(1), response("retry"), false, creator("retry"), later, p.ttl_seconds);
    assert_eq!(t.complete(&mut m, &retry, rr, NOW).unwrap(), Completed::Stored);
    match t.begin_after(&mut m, k, Some(fp(1)), later + 200, &p, owner(3), &creator("a"), seen_b).unwrap() {
        Begin::Replay(r) => assert_eq!(r.state, State::Completed(response("retry"))),
        other => panic!("A must be replayed the retry's response: {other:?}"),
    }
    assert_eq!(t.occupied(&mut m), 1, "one record of the key");
}

/// Envoy's CAS is one process-wide 32-bit counter: after 2^32 writes anywhere in the process a
/// bucket can be written with the very CAS a request read at its headers. A CAS made within one
/// callback never spans that; the bucket read kept from headers lives as long as its upload (hours
/// for a slow client). Here A looks at headers, B then claims and completes the key, and the
/// counter has come round so that B's completion lands on A's CAS: a body end trusting that read
/// would claim the key again over B's record (a second execution). A read older than
/// `SEEN_MAX_AGE_MS` is not used: A reads the bucket again and is replayed B's response.
#[test]
fn a_headers_read_kept_through_a_cas_counter_wrap_never_claims_a_completed_key() {
    let t = table(8, WhenFull::Reject);
    let mut m = fresh(&t);
    let p = Policy { ttl_seconds: 86_400, ..policy() };
    let k = skey(44);
    let seen = look(&t, &mut m, k, NOW).expect("a free key hands its bucket on");
    let read_cas = seen.cas;
    let hb = handle(&t.begin(&mut m, k, Some(fp(1)), NOW + 1, &p, owner(2), &creator("b")).unwrap());
    // The counter came round during A's upload: B's body key takes `read_cas - 1`, its bucket
    // write `read_cas`.
    m.set_last_cas(read_cas.wrapping_sub(2));
    let rb = Record::completed(fp(1), response("b"), false, creator("b"), NOW + 1, p.ttl_seconds);
    assert_eq!(t.complete(&mut m, &hb, rb, NOW + 2).unwrap(), Completed::Stored);
    assert_eq!(t.read_bucket(&mut m, hb.bucket).unwrap().1, read_cas, "the bucket's CAS came round");
    let later = NOW + 2 * 3_600_000;
    match t.begin_after(&mut m, k, Some(fp(1)), later, &p, owner(1), &creator("a"), Some(seen)).unwrap() {
        Begin::Replay(r) => assert_eq!(r.state, State::Completed(response("b"))),
        other => panic!("A must be replayed B's response, never claim again: {other:?}"),
    }
    assert_eq!(t.occupied(&mut m), 1, "one record of the key");
}

/// A decision that writes nothing is never made on the headers' read: the key completed at
/// headers, then forgotten (expired and swept) before the body's end, is claimed, not answered
/// from the record that is gone.
#[test]
fn a_body_end_decides_a_replay_only_on_a_fresh_read() {
    let t = table(8, WhenFull::Reject);
    let mut m = fresh(&t);
    let p = Policy { ttl_seconds: 2, lock_ttl_seconds: 1, ..policy() };
    let k = skey(42);
    let h = handle(&t.begin(&mut m, k, Some(fp(1)), NOW, &p, owner(1), &creator("a")).unwrap());
    assert_eq!(
        t.complete(&mut m, &h, Record::completed(fp(1), response("a"), false, creator("a"), NOW, 2), NOW).unwrap(),
        Completed::Stored
    );
    // A retry's headers: the record is completed (the fingerprint decides): the bucket as read
    // is handed on only for a claim, so here nothing is.
    assert_eq!(
        t.begin(&mut m, k, None, NOW + 1, &p, owner(2), &creator("b")).unwrap(),
        Begin::NeedFingerprint { seen: None }
    );
    // A look whose key was free at headers, then claimed and completed by another before the body
    // end: a stale read that would claim fails its CAS; the fresh read replays.
    let k2 = skey(43);
    let seen = look(&t, &mut m, k2, NOW + 1);
    let h2 = handle(&t.begin(&mut m, k2, Some(fp(1)), NOW + 2, &p, owner(3), &creator("c")).unwrap());
    t.complete(&mut m, &h2, Record::completed(fp(1), response("c"), false, creator("c"), NOW + 2, 2), NOW + 2).unwrap();
    let before = m.calls;
    match t.begin_after(&mut m, k2, Some(fp(1)), NOW + 3, &p, owner(4), &creator("d"), seen).unwrap() {
        Begin::Replay(r) => assert_eq!(r.state, State::Completed(response("c"))),
        other => panic!("{other:?}"),
    }
    assert_eq!(m.calls - before, 3, "the failed CAS, a fresh read of the bucket, the body's read");
}

#[test]
fn release_lets_a_retry_execute() {
    let t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    let k = skey(4);
    let h = handle(&claim(&t, &mut m, k, Some(fp(1)), 1, NOW));
    assert!(t.release(&mut m, &h, NOW).unwrap());
    assert!(!t.release(&mut m, &h, NOW).unwrap(), "a second release finds nothing of ours");
    assert!(matches!(claim(&t, &mut m, k, Some(fp(1)), 2, NOW), Begin::Claimed { .. }));
}

#[test]
fn stale_forwarded_lock_becomes_outcome_unknown_never_a_second_execution() {
    let t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    let k = skey(5);
    claim(&t, &mut m, k, Some(fp(1)), 1, NOW);
    let later = NOW + policy().lock_ttl_seconds * 1000;
    match claim(&t, &mut m, k, Some(fp(1)), 2, later) {
        Begin::Reject { problem: ProblemKind::OutcomeUnknown, marked_unknown: true, .. } => {}
        other => panic!("{other:?}"),
    }
    // And it stays unknown for unknown_outcome_seconds, then the key is free.
    assert!(is_reject(&claim(&t, &mut m, k, Some(fp(1)), 3, later + 1), &ProblemKind::OutcomeUnknown));
    let free_at = later + policy().unknown_outcome_seconds * 1000;
    assert!(matches!(claim(&t, &mut m, k, Some(fp(1)), 4, free_at), Begin::Claimed { .. }));
}

#[test]
fn stale_lock_takeover_mode_lets_one_retry_execute_again() {
    let t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    let k = skey(6);
    let mut p = policy();
    p.stale_lock = crate::config::StaleLock::Takeover;
    t.begin(&mut m, k, Some(fp(1)), NOW, &p, owner(1), &creator("a")).unwrap();
    let later = NOW + p.lock_ttl_seconds * 1000;
    let b = t.begin(&mut m, k, Some(fp(1)), later, &p, owner(2), &creator("b")).unwrap();
    assert!(matches!(b, Begin::Claimed { took_over: true, .. }));
}

#[test]
fn a_taken_over_owner_can_neither_forward_nor_complete_nor_release() {
    let t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    let k = skey(7);
    let a = claim_at_headers(&t, &mut m, k, 1, NOW, &policy());
    let later = NOW + policy().lock_ttl_seconds * 1000;
    let b = claim(&t, &mut m, k, Some(fp(1)), 2, later);
    assert!(matches!(b, Begin::Claimed { took_over: true, .. }), "{b:?}");
    let b = handle(&b);
    assert_eq!(
        complete(&t, &mut m, &a, fp(1), response("a"), false, &creator("a"), later, &policy()).unwrap(),
        Completed::LostClaim
    );
    assert!(!t.release(&mut m, &a, NOW).unwrap());
    assert!(!t.mark_unknown(&mut m, &a, UnknownReason::Other, later, &policy()).unwrap());
    assert_eq!(
        complete(&t, &mut m, &b, fp(1), response("b"), false, &creator("b"), later, &policy()).unwrap(),
        Completed::Stored
    );
    match claim(&t, &mut m, k, Some(fp(1)), 3, later + 1) {
        Begin::Replay(r) => assert_eq!(r.state, State::Completed(response("b"))),
        other => panic!("{other:?}"),
    }
}

pub(super) fn floor_table(max_entries: u64, when_full: WhenFull, floor_s: u64) -> Table {
    Table::new(&LocalConfig { max_entries, max_bytes: 1 << 20, when_full, min_protection_seconds: floor_s })
}

/// Storage keys that all land in bucket `b` of `t`.
pub(super) fn keys_in_bucket(t: &Table, b: u32, n: usize) -> Vec<StorageKey> {
    (0u64..).map(skey).filter(|k| t.bucket_of(k) == b).take(n).collect()
}

fn fill_completed(t: &Table, m: &mut Model, keys: &[StorageKey], now: u64) {
    for (n, k) in keys.iter().enumerate() {
        let h = handle(&claim(t, m, *k, Some(fp(1)), 1, now + n as u64));
        complete(t, m, &h, fp(1), response("r"), false, &creator("c"), now + n as u64, &policy()).unwrap();
    }
}

#[test]
fn a_full_table_evicts_the_oldest_finished_record_only_past_the_floor() {
    let t = floor_table(16, WhenFull::EvictOldest, 10);
    let mut m = fresh(&t);
    let keys: Vec<_> = (0..16).map(skey).collect();
    fill_completed(&t, &mut m, &keys, NOW);
    assert_eq!((t.count(&mut m), t.occupied(&mut m)), (16, 16));
    // Every record younger than the 10 s floor: full, nothing forgotten.
    assert_eq!(claim(&t, &mut m, skey(100), Some(fp(1)), 2, NOW + 9_000), Begin::Full);
    for k in &keys {
        assert!(matches!(claim(&t, &mut m, *k, Some(fp(1)), 3, NOW + 9_000), Begin::Replay(_)));
    }
    // Past the floor: the claim takes an old record's place; the count stays at capacity.
    let b = claim(&t, &mut m, skey(100), Some(fp(1)), 2, NOW + 10_100);
    assert!(matches!(b, Begin::Claimed { evicted: true, .. }), "{b:?}");
    assert_eq!((t.count(&mut m), t.occupied(&mut m)), (16, 16));
    let age = t.last_evicted_age_ms(&mut m);
    assert!((10_000..=10_100).contains(&age), "evicted age {age}");
    let held = keys.iter().filter(|k| t.peek(&mut m, k, NOW + 10_100).unwrap().is_some()).count();
    assert_eq!(held, 15, "exactly one record was evicted");
    assert!(t.peek(&mut m, &skey(0), NOW + 10_100).unwrap().is_none(), "the oldest one");
}

#[test]
fn when_full_reject_never_evicts_and_a_live_claim_is_never_evicted() {
    let t = floor_table(16, WhenFull::Reject, 0);
    let mut m = fresh(&t);
    fill_completed(&t, &mut m, &(0..16).map(skey).collect::<Vec<_>>(), NOW);
    assert_eq!(claim(&t, &mut m, skey(100), Some(fp(1)), 2, NOW + 50_000), Begin::Full);
    // Claims in flight, far past the floor (their locks live): never evicted, in any mode.
    let t = floor_table(16, WhenFull::EvictOldest, 0);
    let mut m = fresh(&t);
    for n in 0..16u64 {
        claim(&t, &mut m, skey(n), Some(fp(1)), 1, NOW);
    }
    assert_eq!(claim(&t, &mut m, skey(100), Some(fp(1)), 2, NOW + 9_000), Begin::Full);
    assert_eq!(
        t.as_cache().begin(&mut m, skey(100), Some(fp(1)), NOW + 9_000, &policy(), owner(2), &creator("x")).unwrap(),
        Begin::Full
    );
}

#[test]
fn with_a_store_the_local_tier_evicts_finished_records_whatever_their_age() {
    let t = floor_table(16, WhenFull::Reject, 3_600).as_cache();
    let mut m = fresh(&t);
    fill_completed(&t, &mut m, &(0..16).map(skey).collect::<Vec<_>>(), NOW);
    assert!(matches!(claim(&t, &mut m, skey(100), Some(fp(1)), 2, NOW + 20), Begin::Claimed { evicted: true, .. }));
    assert_eq!(t.count(&mut m), 16);
}

/// Issue 23, item 1: two configurations of one table (the same `max_entries`, so the same shared
/// data: two listeners of one VM, or one listener before and after a reload). Each record keeps
/// the floor of the configuration that wrote it, whichever configuration evicts.
#[test]
fn a_record_keeps_the_floor_of_the_configuration_that_wrote_it_whichever_evicts() {
    let protected = floor_table(16, WhenFull::EvictOldest, 60);
    let cache = floor_table(16, WhenFull::EvictOldest, 60).as_cache();
    let mut m = fresh(&protected);
    fill_completed(&protected, &mut m, &(0..16).map(skey).collect::<Vec<_>>(), NOW);
    // The cache configuration finds only records under their own 60 s floor: no local copy.
    assert_eq!(claim(&cache, &mut m, skey(100), Some(fp(1)), 2, NOW + 30_000), Begin::Full);
    for n in 0..16 {
        assert!(matches!(claim(&protected, &mut m, skey(n), Some(fp(1)), 3, NOW + 30_000), Begin::Replay(_)), "{n}");
    }
    // Past their floor (still unexpired), they go.
    let past = NOW + 60_000 + 100;
    assert!(matches!(claim(&cache, &mut m, skey(100), Some(fp(1)), 2, past), Begin::Claimed { evicted: true, .. }));
    // Records the cache wrote carry no floor: the protected configuration may evict them at once.
    let mut m = fresh(&cache);
    fill_completed(&cache, &mut m, &(0..16).map(skey).collect::<Vec<_>>(), NOW);
    let b = claim(&protected, &mut m, skey(100), Some(fp(1)), 2, NOW + 20);
    assert!(matches!(b, Begin::Claimed { evicted: true, .. }), "{b:?}");
    // A stale claim of the protected configuration, marked outcome-unknown by the cache, keeps
    // the floor its own configuration gave it.
    let mut m = fresh(&protected);
    let h = handle(&claim(&protected, &mut m, skey(200), Some(fp(1)), 1, NOW));
    let b = claim(&cache, &mut m, skey(200), Some(fp(1)), 2, NOW + 11_000);
    assert!(is_reject(&b, &ProblemKind::OutcomeUnknown), "{b:?}");
    let (bucket, _) = cache.read_bucket(&mut m, h.bucket).unwrap();
    let e = bucket.positions[h.position].as_ref().unwrap();
    assert_eq!((e.stage, e.floor_ms), (Stage::Unknown, 60_000));
    // A record written under `when_full: "reject"` is never evicted, not even by a cache.
    let reject = floor_table(16, WhenFull::Reject, 0);
    let mut m = fresh(&reject);
    fill_completed(&reject, &mut m, &(0..16).map(skey).collect::<Vec<_>>(), NOW);
    assert_eq!(claim(&cache, &mut m, skey(100), Some(fp(1)), 2, NOW + 50_000), Begin::Full);
}

/// Layout v4 is set-associative: a full bucket evicts within itself (never a record of another
/// bucket), and a key of another bucket still finds room.
#[test]
fn a_full_bucket_evicts_within_itself_and_other_buckets_keep_their_records() {
    let t = floor_table(100, WhenFull::EvictOldest, 1);
    assert_eq!((t.buckets(), t.width()), (4, 64));
    let mut m = fresh(&t);
    let full = keys_in_bucket(&t, 0, 64);
    fill_completed(&t, &mut m, &full, NOW);
    let other = keys_in_bucket(&t, 1, 1)[0];
    let next = keys_in_bucket(&t, 0, 65)[64];
    assert_eq!(claim(&t, &mut m, next, Some(fp(1)), 2, NOW + 500), Begin::Full, "under the floor");
    assert!(matches!(claim(&t, &mut m, other, Some(fp(1)), 2, NOW + 500), Begin::Claimed { evicted: false, .. }));
    assert!(matches!(claim(&t, &mut m, next, Some(fp(1)), 2, NOW + 2_000), Begin::Claimed { evicted: true, .. }));
    assert_eq!(t.count(&mut m), 65);
    assert_eq!(full.iter().filter(|k| t.peek(&mut m, k, NOW + 2_000).unwrap().is_some()).count(), 63);
    let age = t.last_evicted_age_ms(&mut m);
    assert!((1_000..=2_000).contains(&age), "evicted age {age}");
    // An expired record of the bucket gives its place without an eviction.
    let t = floor_table(100, WhenFull::Reject, 0);
    let mut m = fresh(&t);
    fill_completed(&t, &mut m, &full, NOW);
    let later = NOW + policy().ttl_seconds * 1000 + 100;
    assert!(matches!(claim(&t, &mut m, next, Some(fp(1)), 2, later), Begin::Claimed { evicted: false, .. }));
    assert_eq!(t.count(&mut m), 64);
}

/// Under uniform keys (SHA-256 storage keys, as the filter makes them) the default table's first
/// bucket overflows its 64 positions only past `max_entries` (docs/local-tier.md: about 1.2 x).
#[test]
fn the_first_bucket_overflows_only_past_max_entries() {
    let t = Table::new(&LocalConfig::default());
    assert_eq!((t.buckets(), t.width()), (8192, 64));
    let mut held = vec![0usize; t.buckets() as usize];
    let mut n = 0u64;
    let first_overflow = loop {
        let b = t.bucket_of(&hashed_skey(n)) as usize;
        held[b] += 1;
        n += 1;
        if held[b] > BUCKET_WIDTH {
            break n;
        }
    };
    assert_eq!(first_overflow, 308_089, "{} of max_entries", first_overflow as f64 / t.capacity() as f64);
    assert!(first_overflow > t.capacity());
}

#[test]
fn the_count_follows_claims_releases_and_sweeps() {
    let t = table(64, WhenFull::Reject);
    let mut m = fresh(&t);
    let hs: Vec<_> = (0..10).map(|n| handle(&claim(&t, &mut m, skey(n), Some(fp(1)), 1, NOW))).collect();
    assert_eq!(t.count(&mut m), 10);
    // A duplicate (409) or a replay takes no unit.
    assert!(is_reject(&claim(&t, &mut m, skey(0), Some(fp(1)), 2, NOW), &in_flight()));
    assert_eq!(t.count(&mut m), 10);
    assert!(t.release(&mut m, &hs[0], NOW).unwrap());
    assert_eq!(t.count(&mut m), 9);
    for h in &hs[1..] {
        complete(&t, &mut m, h, fp(1), response("r"), false, &creator("c"), NOW, &policy()).unwrap();
    }
    let later = NOW + policy().ttl_seconds * 1000 + 1;
    assert_eq!(t.sweep(&mut m, 0, t.buckets(), later, &mut Gauges::default()).unwrap(), 9);
    assert_eq!((t.count(&mut m), t.occupied(&mut m)), (0, 0));
}

#[test]
fn an_empty_bucket_costs_a_few_bytes_and_a_bucket_grows_with_use() {
    let t = Table::new(&LocalConfig::default());
    assert_eq!(t.buckets(), 262_144 / 32);
    assert_eq!(Bucket::empty().encode().len(), HEADER_BYTES + 1);
    let mut m = fresh(&t);
    let k = skey(1);
    claim(&t, &mut m, k, Some(fp(1)), 1, NOW);
    let (v, _) = m.get(&t.bucket_name(t.bucket_of(&k))).unwrap();
    assert_eq!(v.unwrap().len(), HEADER_BYTES + 1 + ENTRY_BYTES + "req-1".len() + 1);
}

#[test]
fn creating_the_table_again_never_overwrites_live_records() {
    let t = table(100, WhenFull::Reject);
    let mut m = fresh(&t);
    let k = skey(8);
    handle(&claim(&t, &mut m, k, Some(fp(1)), 1, NOW));
    assert_eq!(t.ensure_created(&mut m).unwrap(), 0, "ready marker: nothing to do");
    m.map.remove(&*t.ready_name()); // as if the marker had never been written
    assert_eq!(t.ensure_created(&mut m).unwrap(), 0, "every bucket exists: none rewritten");
    assert!(is_reject(&claim(&t, &mut m, k, Some(fp(1)), 2, NOW), &in_flight()));
}

#[test]
fn a_missing_bucket_is_an_error_not_a_racy_insert() {
    let t = table(100, WhenFull::Reject);
    let mut m = Model::default();
    assert_eq!(t.begin(&mut m, skey(1), None, NOW, &policy(), owner(1), &creator("a")), Err(LocalError::Missing));
    assert_eq!(m.names(), 0);
}

#[test]
fn a_flood_of_unique_keys_keeps_names_and_bytes_bounded() {
    let t = Table::new(&LocalConfig {
        max_entries: 64,
        max_bytes: 16 * 1024,
        when_full: WhenFull::EvictOldest,
        min_protection_seconds: 0,
    });
    let mut m = fresh(&t);
    let mut stored_without_body = 0;
    for n in 0..5_000u64 {
        let now = NOW + n;
        if let Begin::Claimed { handle, .. } = claim(&t, &mut m, skey(n), Some(fp(1)), 1, now) {
            let body = "y".repeat(500);
            if complete(&t, &mut m, &handle, fp(1), response(&body), false, &creator("c"), now, &policy()).unwrap()
                == Completed::StoredWithoutBody
            {
                stored_without_body += 1;
            }
        }
    }
    let max_names = t.buckets() as usize * (1 + BUCKET_WIDTH) + 4;
    assert!(m.names() <= max_names, "{} names > {max_names}", m.names());
    assert!(t.usage(&mut m) <= 16 * 1024);
    assert_eq!((t.count(&mut m), t.occupied(&mut m)), (64, 64), "at capacity, never past it");
    assert!(m.bytes() < 16 * 1024 + max_names * 2_000, "{} bytes", m.bytes());
    assert!(stored_without_body > 0, "the byte budget was reached and degraded to status-only records");
}

#[test]
fn usage_follows_completions_releases_and_sweeps() {
    let t = table(100, WhenFull::Reject);
    let mut m = fresh(&t);
    let h = handle(&claim(&t, &mut m, skey(1), Some(fp(1)), 1, NOW));
    complete(&t, &mut m, &h, fp(1), response("abc"), false, &creator("c"), NOW, &policy()).unwrap();
    let used = t.usage(&mut m);
    let (body, _) = m.get(&t.body_name(h.bucket, h.position)).unwrap();
    assert_eq!(used, body.unwrap().len() as u64, "the bucket counts the bytes its body key holds");
    let h2 = handle(&claim(&t, &mut m, skey(2), Some(fp(1)), 1, NOW));
    complete(&t, &mut m, &h2, fp(1), response("x".repeat(10_000).as_str()), true, &creator("c"), NOW, &policy())
        .unwrap();
    let (lean, _) = m.get(&t.body_name(h2.bucket, h2.position)).unwrap();
    let lean = lean.unwrap().len() as u64;
    assert!(lean < 200, "a too-large response is kept without its body: {lean} bytes");
    assert_eq!(t.usage(&mut m), used + lean);
    assert_eq!(t.occupied(&mut m), 2);
    let after_expiry = NOW + policy().ttl_seconds * 1000;
    let mut g = Gauges::default();
    assert_eq!(t.sweep(&mut m, 0, t.buckets(), after_expiry, &mut g).unwrap(), 2);
    assert_eq!(t.usage(&mut m), 0, "the sweep empties the bodies of the records it frees");
    assert_eq!((g.occupancy(), g.bytes()), (0, 0));
    assert_eq!(t.occupied(&mut m), 0);
}

/// The bytes body keys hold in `m` (all of them, whatever the table).
fn held(m: &Model) -> u64 {
    m.entries().filter(|(k, _)| k.contains(".r.")).map(|(_, v)| v.len() as u64).sum()
}

/// Each bucket has its share of `max_bytes` (three quarters of it over the buckets), the pool the
/// rest: a completion that fits neither keeps its status only, and the bytes the body keys hold
/// never pass `max_bytes`.
#[test]
fn a_bucket_never_holds_more_than_its_share_of_max_bytes() {
    let t = Table::new(&LocalConfig {
        max_entries: 64,
        max_bytes: 4_000,
        when_full: WhenFull::Reject,
        min_protection_seconds: 0,
    });
    assert_eq!((t.bucket_bytes(), t.pool_bytes()), (3_000, 1_000));
    let mut m = fresh(&t);
    let mut outcomes = vec![];
    for n in 0..10 {
        let h = handle(&claim(&t, &mut m, skey(n), Some(fp(1)), 1, NOW));
        let body = "z".repeat(1_000);
        outcomes.push(complete(&t, &mut m, &h, fp(1), response(&body), false, &creator("c"), NOW, &policy()).unwrap());
        assert_eq!(t.usage(&mut m), held(&m));
        assert!(held(&m) <= 4_000, "{} bytes", held(&m));
    }
    // Two bodies fill the bucket's 3,000 bytes; the third (over 1,000 bytes) does not fit the pool.
    assert_eq!(outcomes.iter().filter(|o| **o == Completed::Stored).count(), 2);
    assert!(outcomes[2..].iter().all(|o| *o == Completed::StoredWithoutBody), "{outcomes:?}");
    assert_eq!(t.pool_usage(&mut m), 0);
}

/// Issue 27's regression (layout v4 kept no body over its bucket's 32 KiB share): at the defaults
/// a body of 100 KB, and one near `max_response_body_bytes`, is kept whole on the table-wide pool
/// and replayed; it costs its completion a few shared-data calls more, and the first request of an
/// ordinary body still makes 5.
#[test]
fn at_the_defaults_a_body_over_the_buckets_share_is_kept_whole() {
    let t = Table::new(&LocalConfig::default());
    assert_eq!((t.buckets(), t.bucket_bytes(), t.pool_bytes()), (8_192, 24 * 1024, 64 * 1024 * 1024));
    let mut m = fresh(&t);
    let max = crate::config::Policy::default().max_response_body_bytes as usize;
    for (n, size) in [(1u64, 100_000usize), (2, max - 1_000)] {
        let body = "q".repeat(size);
        let h = handle(&claim(&t, &mut m, skey(n), Some(fp(1)), 1, NOW));
        let before = m.calls;
        let done = complete(&t, &mut m, &h, fp(1), response(&body), false, &creator("c"), NOW, &policy()).unwrap();
        assert_eq!(done, Completed::Stored, "a body of {size} bytes");
        // The bucket's read, the body key's read, its creation and read again (the first use of
        // the key: 2 calls fewer after), the pool's read and CAS, the body's CAS, the bucket's CAS.
        assert_eq!(m.calls - before, 8, "a body of {size} bytes");
        match claim(&t, &mut m, skey(n), Some(fp(1)), 2, NOW + 1) {
            Begin::Replay(r) => assert_eq!(r.state, State::Completed(response(&body)), "a body of {size} bytes"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(t.usage(&mut m), held(&m));
    assert_eq!(t.pool_usage(&mut m), held(&m), "both bodies are on the pool");
    // An ordinary body stays on the bucket: 5 calls for the whole first request.
    let before = m.calls;
    let seen = look(&t, &mut m, skey(3), NOW);
    let h =
        handle(&t.begin_after(&mut m, skey(3), Some(fp(1)), NOW, &policy(), owner(1), &creator("c"), seen).unwrap());
    complete(&t, &mut m, &h, fp(1), response(&"s".repeat(2_000)), false, &creator("c"), NOW, &policy()).unwrap();
    assert_eq!(m.calls - before, 5);
}

/// `local.max_bytes` bounds the bytes body keys hold, buckets and pool together, through a flood
/// of keys with bodies of every size (evictions, replacements, expiries and sweeps), every
/// retry replays its own response or its status, and once every record expired and the sweep
/// passed, the pool lists nothing.
#[test]
fn max_bytes_bounds_buckets_and_pool_together_under_a_flood_of_mixed_bodies() {
    // 4 buckets of 64 (share 7,500 bytes each), pool 10,000.
    let t = Table::new(&LocalConfig {
        max_entries: 128,
        max_bytes: 40_000,
        when_full: WhenFull::EvictOldest,
        min_protection_seconds: 0,
    });
    assert_eq!((t.bucket_bytes(), t.pool_bytes()), (7_500, 10_000));
    let mut m = fresh(&t);
    let (mut pooled_peak, mut stored, mut lean) = (0, 0, 0);
    for n in 0..3_000u64 {
        let now = NOW + n * 50;
        let size = usize::try_from((n * 7_919) % 9_000).unwrap();
        let b = claim(&t, &mut m, skey(n), Some(fp(1)), (n % 200) as u8, now);
        let Begin::Claimed { handle: h, .. } = b else { continue };
        let body = format!("{n}:{}", "w".repeat(size));
        match complete(&t, &mut m, &h, fp(1), response(&body), false, &creator("c"), now, &policy()).unwrap() {
            Completed::Stored => stored += 1,
            _ => lean += 1,
        }
        assert!(held(&m) <= 40_000, "after key {n}: {} bytes held", held(&m));
        assert!(held(&m) <= t.usage(&mut m), "after key {n}: held {} > counted {}", held(&m), t.usage(&mut m));
        pooled_peak = pooled_peak.max(t.pool_usage(&mut m));
        match claim(&t, &mut m, skey(n), Some(fp(1)), 201, now + 1) {
            Begin::Replay(r) => match r.state {
                State::Completed(resp) => assert_eq!(resp.body, body.as_bytes(), "key {n}"),
                State::CompletedTooLarge { status, .. } => assert_eq!(status, 201),
                other => panic!("{other:?}"),
            },
            other => assert!(matches!(other, Begin::Reject { problem: ProblemKind::ResponseNotStored { .. }, .. })),
        }
        if n % 97 == 0 {
            t.sweep(&mut m, u32::try_from(n).unwrap(), 2, now, &mut Gauges::default()).unwrap();
        }
    }
    assert!(pooled_peak > 5_000, "the pool was used: {pooled_peak}");
    assert!(stored > 100 && lean > 100, "stored {stored}, status only {lean}");
    let far = NOW + 3_000 * 50 + 10 * policy().ttl_seconds * 1000;
    let mut g = Gauges::default();
    t.sweep(&mut m, 0, t.buckets(), far, &mut g).unwrap();
    t.sweep(&mut m, 0, t.buckets(), far, &mut g).unwrap();
    assert_eq!(t.pool_usage(&mut m), 0, "no reservation outlives its record");
    assert_eq!(t.occupied(&mut m), 0);
    assert!(held(&m) <= t.usage(&mut m));
}

/// Issue 27: a first request (looked at at headers, claimed at its body's end on that read,
/// completed) makes 5 shared-data calls.
#[test]
fn a_first_request_makes_five_shared_data_calls() {
    let t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    let before = m.calls;
    let seen = look(&t, &mut m, skey(1), NOW);
    assert_eq!(m.calls - before, 1, "the look: one read");
    let b = t.begin_after(&mut m, skey(1), Some(fp(1)), NOW + 1, &policy(), owner(1), &creator("c"), seen).unwrap();
    let h = handle(&b);
    assert_eq!(m.calls - before, 2, "the claim: one CAS on the headers' read");
    complete(&t, &mut m, &h, fp(1), response("x"), false, &creator("c"), NOW + 2, &policy()).unwrap();
    assert_eq!(m.calls - before, 5, "the completion: the bucket's read, the body's write, the bucket's CAS");
}

#[test]
fn too_large_response_replays_status_and_location_only() {
    let t = table(100, WhenFull::Reject);
    let mut m = fresh(&t);
    let h = handle(&claim(&t, &mut m, skey(1), Some(fp(1)), 1, NOW));
    assert_eq!(
        complete(&t, &mut m, &h, fp(1), response("big"), true, &creator("c"), NOW, &policy()).unwrap(),
        Completed::StoredWithoutBody
    );
    match claim(&t, &mut m, skey(1), Some(fp(1)), 2, NOW) {
        Begin::Replay(r) => {
            assert_eq!(r.state, State::CompletedTooLarge { status: 201, location: Some(b"/r/1".to_vec()) })
        }
        other => panic!("{other:?}"),
    }
}

#[cfg(not(target_arch = "wasm32"))]
mod interleavings;

#[test]
fn shared_data_holds_no_raw_key_and_no_raw_credential() {
    use crate::key::parse_key_header;
    use crate::request::RequestHead;
    use crate::scope::CallerScope;
    let head = RequestHead::from_pairs(vec![
        (":method".into(), b"POST".to_vec()),
        (":path".into(), b"/charges".to_vec()),
        ("authorization".into(), b"Bearer alice-secret-token".to_vec()),
        ("idempotency-key".into(), b"order-7f3c-raw-key".to_vec()),
    ]);
    let p = policy();
    let cfg = crate::config::ScopeConfig {
        headers: vec!["authorization".into()],
        global: false,
        include_authority: false,
        anonymous: crate::config::Anonymous::Reject,
    };
    let scope = CallerScope::of(&head, &cfg);
    let key = parse_key_header(&head.values("idempotency-key"), 255, crate::key::KeySyntax::Strict).unwrap().unwrap();
    let k = StorageKey::derive(&p.namespace, &scope, &key);
    let t = table(64, WhenFull::Reject);
    let mut m = fresh(&t);
    let b = claim(&t, &mut m, k, Some(fp(1)), 1, NOW);
    let h = handle(&b);
    complete(&t, &mut m, &h, fp(1), response("{}"), false, &creator("req-1"), NOW, &p).unwrap();
    // The record is there (a replay finds it) ...
    assert!(matches!(
        t.begin(&mut m, k, Some(fp(1)), NOW + 1, &p, owner(2), &creator("req-2")).unwrap(),
        Begin::Replay(_)
    ));
    // ... and no stored byte string contains the key or the credential, raw or as hex of itself.
    for needle in [&b"order-7f3c-raw-key"[..], b"alice-secret-token", b"Bearer"] {
        for (name, (value, _)) in &m.map {
            assert!(
                !value.windows(needle.len()).any(|w| w == needle),
                "{name} holds {:?}",
                String::from_utf8_lossy(needle)
            );
            assert!(!name.as_bytes().windows(needle.len()).any(|w| w == needle), "a name holds it: {name}");
        }
    }
}

/// Issue 13, item 7, in the local tier: with `ttl_seconds` 4 and `unknown_outcome_seconds` 600, a
/// forwarded claim that never finished (its VM failed) is outcome-unknown from its lock's expiry
/// for `unknown_outcome_seconds`, never free at `ttl_seconds`; a claim marked unknown lives
/// `unknown_outcome_seconds` from then. The same lives as the store's `PX` (`Lifetimes`).
#[test]
fn a_forwarded_claim_that_never_finished_is_outcome_unknown_for_unknown_outcome_seconds_whatever_the_ttl() {
    let t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    let p = Policy { ttl_seconds: 4, lock_ttl_seconds: 2, unknown_outcome_seconds: 600, ..policy() };
    let (k, j) = (skey(60), skey(61));
    t.begin(&mut m, k, Some(fp(1)), NOW, &p, owner(1), &creator("a")).unwrap();
    let past_ttl = NOW + 5_300;
    assert_eq!(
        t.sweep(&mut m, 0, t.buckets(), past_ttl, &mut Gauges::default()).unwrap(),
        0,
        "no sweep frees it at its ttl"
    );
    let b = t.begin(&mut m, k, Some(fp(1)), past_ttl, &p, owner(2), &creator("b")).unwrap();
    assert!(matches!(b, Begin::Reject { problem: ProblemKind::OutcomeUnknown, .. }), "{b:?}");
    // Marked unknown by the settle after a route timeout: 600 s from then.
    let h = handle(&t.begin(&mut m, j, Some(fp(1)), NOW, &p, owner(3), &creator("c")).unwrap());
    assert!(t.mark_unknown(&mut m, &h, UnknownReason::UpstreamTimeout, NOW + 1_000, &p).unwrap());
    for at in [past_ttl, NOW + 1_000 + 599_999] {
        let b = t.begin(&mut m, j, Some(fp(1)), at, &p, owner(4), &creator("d")).unwrap();
        assert!(is_reject(&b, &ProblemKind::OutcomeUnknown), "{at}: {b:?}");
    }
    assert!(matches!(
        t.begin(&mut m, j, Some(fp(1)), NOW + 1_000 + 600_000, &p, owner(5), &creator("e")).unwrap(),
        Begin::Claimed { .. }
    ));
}

/// A storage key as the filter makes them: SHA-256 output (the sequential `skey` spreads keys far
/// more evenly over buckets than real hashes do).
fn hashed_skey(n: u64) -> StorageKey {
    use sha2::{Digest, Sha256};
    StorageKey(Sha256::digest(n.to_le_bytes()).into())
}

/// Claims and completes `keys` unique keys, one every `step_ms`, with the default policy; returns
/// how many were refused for capacity.
fn drive_unique_keys(t: &Table, m: &mut Model, keys: u64, step_ms: u64) -> u64 {
    let policy = Policy::default();
    let mut full = 0;
    for n in 0..keys {
        let now = NOW + n * step_ms;
        match t.begin(m, hashed_skey(n), Some(fp(1)), now, &policy, owner(1), &creator("c")).unwrap() {
            Begin::Claimed { handle, .. } => {
                complete(t, m, &handle, fp(1), response("{\"id\":1}"), false, &creator("c"), now, &policy).unwrap();
            }
            Begin::Full => full += 1,
            other => panic!("key {n}: {other:?}"),
        }
    }
    full
}

#[test]
fn the_default_table_holds_two_protected_requests_a_second_for_a_whole_ttl() {
    // Issue 14: at 2 requests/s for the default 24 h ttl (172,800 live records), no refusal.
    let t = Table::new(&LocalConfig::default());
    let mut m = fresh(&t);
    let keys = 2 * Policy::default().ttl_seconds;
    let full = drive_unique_keys(&t, &mut m, keys, 500);
    assert_eq!(full, 0, "{full} of {keys} keys refused for capacity");
}

#[test]
fn a_half_full_table_refuses_no_key() {
    // Issue 14: with buckets of 16, 50,000 keys in a table of 100,000 got 41 refusals.
    let t = Table::new(&LocalConfig { max_entries: 100_000, ..LocalConfig::default() });
    let mut m = fresh(&t);
    let full = drive_unique_keys(&t, &mut m, 50_000, 1);
    assert_eq!(full, 0, "{full} of 50000 keys refused in a half-full table");
}

#[test]
fn the_configure_line_states_capacity_memory_and_sustained_rate() {
    let t = Table::new(&LocalConfig::default());
    assert_eq!(
        t.describe(86_400),
        "idemgate: local table: capacity 262144 records (8192 buckets of 64), 320 MiB reserved, supports 3.0 protected requests/s sustained at ttl_seconds 86400"
    );
    assert!(t.crossed_high_water(209_714, 209_716));
    assert!(!t.crossed_high_water(209_716, 209_800), "once per crossing");
    assert!(!t.crossed_high_water(0, 100));
}

/// Issue 13 (one lifecycle): a forwarded claim whose lock expired is marked outcome-unknown by the
/// next request; its owner's late settle must not change it. The store already refused it (its
/// transitions expect phase `P`); the local tier released the key (a retry executed again),
/// completed it, or renewed its life. The table refuses all three from `unknown`.
#[test]
fn a_claim_marked_unknown_on_its_stale_lock_is_not_released_completed_or_renewed_by_its_late_owner() {
    let t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    let p = policy();
    let k = skey(70);
    let a = handle(&t.begin(&mut m, k, Some(fp(1)), NOW, &p, owner(1), &creator("a")).unwrap());
    let stale = NOW + p.lock_ttl_seconds * 1000;
    let b = t.begin(&mut m, k, Some(fp(1)), stale, &p, owner(2), &creator("b")).unwrap();
    assert!(matches!(b, Begin::Reject { problem: ProblemKind::OutcomeUnknown, marked_unknown: true, .. }), "{b:?}");
    let late = stale + 1_000;
    assert!(!t.release(&mut m, &a, NOW).unwrap(), "a late release of an outcome-unknown record was accepted");
    assert!(
        !t.mark_unknown(&mut m, &a, UnknownReason::Other, late + 40_000, &p).unwrap(),
        "a late mark-unknown renewed an outcome-unknown record"
    );
    assert_eq!(
        complete(&t, &mut m, &a, fp(1), response("a"), false, &creator("a"), late, &p).unwrap(),
        Completed::LostClaim,
        "a late completion replaced an outcome-unknown record"
    );
    // Still outcome-unknown for unknown_outcome_seconds from when it was marked, then free.
    let c = t.begin(&mut m, k, Some(fp(1)), stale + 49_999, &p, owner(3), &creator("c")).unwrap();
    assert!(is_reject(&c, &ProblemKind::OutcomeUnknown), "{c:?}");
    let d = t.begin(&mut m, k, Some(fp(1)), stale + 50_000, &p, owner(4), &creator("d")).unwrap();
    assert!(matches!(d, Begin::Claimed { .. }), "{d:?}");
}

/// A completed record is final: its owner can neither release it (a retry would execute again)
/// nor mark it unknown.
#[test]
fn a_completed_record_is_neither_released_nor_marked_unknown_by_its_owner() {
    let t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    let p = policy();
    let k = skey(71);
    let a = handle(&t.begin(&mut m, k, Some(fp(1)), NOW, &p, owner(1), &creator("a")).unwrap());
    complete(&t, &mut m, &a, fp(1), response("a"), false, &creator("a"), NOW, &p).unwrap();
    assert!(!t.release(&mut m, &a, NOW).unwrap(), "a completed record was released");
    assert!(
        !t.mark_unknown(&mut m, &a, UnknownReason::Other, NOW + 1, &p).unwrap(),
        "a completed record was marked unknown"
    );
    match t.begin(&mut m, k, Some(fp(1)), NOW + 2, &p, owner(2), &creator("b")).unwrap() {
        Begin::Replay(r) => assert_eq!(r.state, State::Completed(response("a"))),
        other => panic!("{other:?}"),
    }
}

#[test]
fn shared_data_names_are_built_without_allocating_and_spell_as_before() {
    let t = Table::new(&LocalConfig { max_entries: u64::MAX, ..LocalConfig::default() });
    let prefix = format!("idemgate.v4.local.n{}", u64::MAX);
    for (name, want) in [
        (t.bucket_name(u32::MAX), format!("{prefix}.b.{}", u32::MAX)),
        (t.body_name(u32::MAX, usize::MAX), format!("{prefix}.r.{}.{}", u32::MAX, usize::MAX)),
        (t.ready_name(), format!("{prefix}.ready")),
    ] {
        assert_eq!(&*name, want.as_str());
        assert!(matches!(name, Name::Stack(..)), "{want} went to the heap");
    }
}

/// The floor protects a record for `min_protection_seconds` from when it finished, not from its
/// claim: a request whose upstream ran 9 s is still protected 10 s after its completion. (Found
/// by an adversarial review: the age was counted from the claim, so it was evicted 1.1 s after
/// it completed.)
#[test]
fn the_eviction_floor_counts_from_the_completion_not_the_claim() {
    let t = floor_table(16, WhenFull::EvictOldest, 10);
    let mut m = fresh(&t);
    let keys: Vec<_> = (0..16).map(skey).collect();
    let handles: Vec<_> = keys.iter().map(|k| handle(&claim(&t, &mut m, *k, Some(fp(1)), 1, NOW))).collect();
    for h in &handles[..8] {
        complete(&t, &mut m, h, fp(1), response("r"), false, &creator("c"), NOW + 9_000, &policy()).unwrap();
    }
    for h in &handles[8..] {
        assert!(t.mark_unknown(&mut m, h, UnknownReason::Other, NOW + 9_000, &policy()).unwrap());
    }
    // 10.1 s after the claims, 1.1 s after the records finished: all under the floor.
    assert_eq!(claim(&t, &mut m, skey(100), Some(fp(1)), 2, NOW + 10_100), Begin::Full);
    assert_eq!(keys.iter().filter(|k| t.peek(&mut m, k, NOW + 10_100).unwrap().is_some()).count(), 16);
    // 10 s after they finished: one gives its place.
    let b = claim(&t, &mut m, skey(100), Some(fp(1)), 2, NOW + 19_000);
    assert!(matches!(b, Begin::Claimed { evicted: true, .. }), "{b:?}");
    assert_eq!(t.last_evicted_age_ms(&mut m), 10_000);
}

/// Upgrade from layout v3 (issue 27): after a hot reload the old module's claim may still be in
/// flight. The v4 table honours the v3 record, read only: 409 while it runs, its response once
/// the old module completes it (even after the claim's own expiry), never a second execution;
/// and a claim v4 made at headers is not forwarded once v3 holds the key.
#[test]
fn a_v3_claim_in_flight_after_a_reload_is_never_executed_again() {
    let v3_table = "idemgate.v3.local.n1000";
    let k = skey(42);
    let old_owner = owner(0x33);
    let p = policy();
    let v3_bucket = |tag: u8, expires: u64, lock: u64| {
        let b = (u64::from_le_bytes(k.0[24..32].try_into().unwrap()) % 125) as u32;
        (
            format!("{v3_table}.b.{b}"),
            format!("{v3_table}.s.{b}.3"),
            v3::encode_for_test(&[(3, tag, k, old_owner, expires, lock)]),
        )
    };
    let mut t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    assert!(!t.consult_v3_if_present(&mut m), "no v3 table: nothing to consult");
    m.set(&format!("{v3_table}.ready"), b"1", None).unwrap();
    assert!(t.consult_v3_if_present(&mut m));
    // In flight in v3 (forwarded, lock live).
    let (bucket, slot, v) = v3_bucket(2, NOW + 20_000, NOW + 10_000);
    m.set(&bucket, &v, None).unwrap();
    assert!(is_reject(&t.begin(&mut m, k, Some(fp(7)), NOW + 1, &p, owner(1), &creator("b")).unwrap(), &in_flight()));
    assert!(matches!(
        t.begin(&mut m, k, Some(fp(7)), NOW + 12_000, &p, owner(1), &creator("b")).unwrap(),
        Begin::Reject { problem: ProblemKind::OutcomeUnknown, marked_unknown: false, .. }
    ));
    // The old module completes it after the expiry it had as a claim: replayed from v3.
    let done = NOW + 30_000;
    let r = Record::completed(Fingerprint([7; 32]), response("v3"), false, creator("a"), done, p.ttl_seconds);
    let mut body = old_owner.0.to_vec();
    body.extend_from_slice(&k.0);
    body.extend_from_slice(&r.encode());
    m.set(&slot, &body, None).unwrap();
    let (_, _, v) = v3_bucket(3, r.expires_at_ms, 0);
    m.set(&bucket, &v, None).unwrap();
    match t.begin(&mut m, k, Some(fp(7)), done + 1, &p, owner(1), &creator("b")).unwrap() {
        Begin::Replay(r) => assert_eq!(r.state, State::Completed(response("v3"))),
        other => panic!("a v3 record must be replayed, not executed again: {other:?}"),
    }
    assert!(t.peek(&mut m, &k, done + 1).unwrap().is_some_and(|p| p.record.is_some()));
    // A key free in both tables at headers, claimed by v3 before the body's end: v4 does not
    // claim it (the v3 claim answers: in flight).
    let k2 = skey(43);
    let seen = match t.begin(&mut m, k2, None, NOW, &p, owner(2), &creator("c")).unwrap() {
        Begin::NeedFingerprint { seen } => seen,
        other => panic!("{other:?}"),
    };
    assert!(seen.is_some());
    let b2 = (u64::from_le_bytes(k2.0[24..32].try_into().unwrap()) % 125) as u32;
    m.set(
        &format!("{v3_table}.b.{b2}"),
        &v3::encode_for_test(&[(0, 1, k2, old_owner, NOW + 20_000, NOW + 10_000)]),
        None,
    )
    .unwrap();
    let b = t.begin_after(&mut m, k2, Some(fp(1)), NOW + 1, &p, owner(2), &creator("c"), seen).unwrap();
    assert!(matches!(b, Begin::Reject { .. }), "the v3 claim answers: {b:?}");
    // Once the v3 record no longer holds its key, v4 claims it.
    let expired = r.expires_at_ms + 1;
    assert!(matches!(
        t.begin(&mut m, k, Some(fp(7)), expired, &p, owner(1), &creator("b")).unwrap(),
        Begin::Claimed { .. }
    ));
}

/// Upgrade from layout v3, the race the header-time check cannot see: a v4 claim made at headers
/// (by a v4 module of before claims moved to the body's end; v3 not holding the key then), the
/// draining v3 module claims, forwards and completes the same key, and the v4 claim stays in its
/// bucket. Once its lock is stale, a retry that comes with its fingerprint must still meet the v3
/// record (replayed), not take the stale v4 claim over and execute the key a second time.
#[test]
fn a_stale_v4_claim_is_not_taken_over_while_v3_holds_the_key() {
    let v3_table = "idemgate.v3.local.n1000";
    let k = skey(44);
    let old_owner = owner(0x34);
    let p = policy();
    let mut t = table(1000, WhenFull::Reject);
    let mut m = fresh(&t);
    m.set(&format!("{v3_table}.ready"), b"1", None).unwrap();
    assert!(t.consult_v3_if_present(&mut m));
    // v4 claims at headers: v3 does not hold the key yet.
    let _h = claim_at_headers(&t, &mut m, k, 5, NOW, &p);
    // The v3 module claims it (it never looks at v4), forwards it and completes it.
    let b = (u64::from_le_bytes(k.0[24..32].try_into().unwrap()) % 125) as u32;
    let done = NOW + 1_000;
    let r = Record::completed(Fingerprint([7; 32]), response("v3"), false, creator("v3"), done, p.ttl_seconds);
    let mut body = old_owner.0.to_vec();
    body.extend_from_slice(&k.0);
    body.extend_from_slice(&r.encode());
    m.set(&format!("{v3_table}.s.{b}.3"), &body, None).unwrap();
    m.set(&format!("{v3_table}.b.{b}"), &v3::encode_for_test(&[(3, 3, k, old_owner, r.expires_at_ms, 0)]), None)
        .unwrap();
    // While the v4 claim's lock is live, a retry gets 409 (its module may still forward it).
    let b = t.begin(&mut m, k, Some(fp(7)), done + 2, &p, owner(8), &creator("retry-0")).unwrap();
    assert!(is_reject(&b, &in_flight()), "{b:?}");
    // Its lock (10 s) is stale: a retry with its fingerprint gets v3's response.
    let later = NOW + 11_000;
    match t.begin(&mut m, k, Some(fp(7)), later, &p, owner(6), &creator("retry")).unwrap() {
        Begin::Replay(r) => assert_eq!(r.state, State::Completed(response("v3"))),
        other => panic!("the key ran in v3: it must be replayed, not executed again: {other:?}"),
    }
    // And one at headers claims nothing either.
    assert!(!matches!(
        t.begin(&mut m, k, None, later, &p, owner(7), &creator("retry-2")).unwrap(),
        Begin::Claimed { .. }
    ));
}

/// The raw view of a bucket (`RawBucket`, used by `complete`) counts what
/// `Bucket::bytes` counts, decodes each entry as `Bucket::decode` does, and replacing one entry
/// gives byte for byte what decode, change and encode give; it refuses truncated and trailing
/// values as `decode` does.
#[test]
fn the_raw_bucket_view_patches_one_entry_byte_for_byte_as_decode_and_encode() {
    let t = floor_table(64, WhenFull::EvictOldest, 0);
    let mut m = fresh(&t);
    let mut checked = 0;
    for n in 0..300u64 {
        let now = NOW + n * 10;
        let b = claim(&t, &mut m, skey(n), if n % 3 == 0 { None } else { Some(fp(1)) }, (n % 250) as u8, now);
        if let Begin::Claimed { handle: h, .. } = b {
            if n % 4 != 0 {
                let body = "v".repeat((n as usize * 37) % 700);
                complete(&t, &mut m, &h, fp(1), response(&body), false, &creator("c"), now, &policy()).unwrap();
            }
        }
        if n % 50 == 49 {
            t.sweep(&mut m, 0, 1, now + policy().ttl_seconds * 1000 / 2, &mut Gauges::default()).unwrap();
        }
        let value = m.get(&t.bucket_name(0)).unwrap().0.unwrap();
        let bucket = Bucket::decode_width(&value, t.width()).unwrap();
        let raw = RawBucket::index(value.clone(), t.width()).unwrap();
        assert_eq!(raw.counted, bucket.bytes());
        for j in 0..t.width() {
            assert_eq!(raw.entry(j), bucket.positions[j].clone(), "position {j}");
            let Some(e) = bucket.positions[j].clone() else {
                assert_eq!(raw.with_entry(j, &Entry { creator: vec![], ..dummy_entry() }), None);
                continue;
            };
            let mut changed = e.clone();
            changed.stage = Stage::Completed;
            changed.body_bytes = 12_345;
            changed.creator = if n % 2 == 0 { vec![] } else { b"\x03abc".to_vec() };
            let mut expected = bucket.clone();
            expected.positions[j] = Some(changed.clone());
            assert_eq!(raw.with_entry(j, &changed), Some(expected.encode()), "position {j}");
            checked += 1;
        }
        assert!(RawBucket::index(value[..value.len() - 1].to_vec(), t.width()).is_none());
        let mut longer = value.clone();
        longer.push(0);
        assert!(RawBucket::index(longer, t.width()).is_none());
    }
    assert!(checked > 5_000, "{checked} entries checked");
}

fn dummy_entry() -> Entry {
    Entry {
        skey: skey(0),
        fingerprint: None,
        stage: Stage::Claimed,
        owner: owner(0),
        since_ms: 0,
        expires_at_ms: 0,
        lock_expires_at_ms: 0,
        status: 0,
        body_bytes: 0,
        floor_ms: 0,
        creator: vec![],
    }
}

/// Found by review: with tombstones, a completed record keeps its position past its own expiry,
/// and a full bucket evicted by age alone, so an outcome-unknown record older than every
/// tombstone in its bucket (`unknown_outcome_seconds` above `ttl_seconds`, or routes of other
/// TTLs sharing the table) lost its position to a new key, and its retry claimed: a second
/// execution. Without tombstones those positions were free. The tombstone's position goes first,
/// whatever its floor (the default floor, 3600 s, protects the tombstones here, not the record).
#[test]
fn a_full_bucket_takes_a_tombstones_position_before_evicting_a_live_record() {
    for (tombstone_ms, floor_s) in [(0u64, 0u64), (1_000_000, 0), (1_000_000, 3600)] {
        let t = floor_table(16, WhenFull::EvictOldest, floor_s);
        let mut m = fresh(&t);
        let p = Policy {
            lock_ttl_seconds: 10,
            ttl_seconds: 10,
            unknown_outcome_seconds: 100_000,
            tombstone_seconds: tombstone_ms / 1000,
            ..Policy::default()
        };
        let w = t.width();
        let keys = keys_in_bucket(&t, 0, w + 1);
        let h = handle(&t.begin(&mut m, keys[0], Some(fp(1)), NOW, &p, owner(1), &creator("u")).unwrap());
        assert!(t.mark_unknown(&mut m, &h, UnknownReason::Other, NOW, &p).unwrap());
        // Past the floor of the outcome-unknown record (3600 s), the others completed later.
        let later = NOW + 4_000_000;
        for k in &keys[1..w] {
            let h = handle(&t.begin(&mut m, *k, Some(fp(1)), later, &p, owner(2), &creator("c")).unwrap());
            let r = Record::completed(fp(1), response("r"), false, creator("c"), later, p.ttl_seconds);
            let until = r.expires_at_ms + tombstone_ms;
            t.complete_until(&mut m, &h, r, later, until).unwrap();
        }
        let at = later + 20_000;
        let b = t.begin(&mut m, keys[w], Some(fp(1)), at, &p, owner(3), &creator("new")).unwrap();
        assert!(matches!(b, Begin::Claimed { .. }), "tombstone_ms={tombstone_ms} floor={floor_s}: the new key: {b:?}");
        let again = t.begin(&mut m, keys[0], Some(fp(1)), at, &p, owner(4), &creator("retry")).unwrap();
        assert!(
            !matches!(again, Begin::Claimed { .. }),
            "tombstone_ms={tombstone_ms} floor={floor_s}: the outcome-unknown key claimed again after {b:?}: {again:?}"
        );
    }
}

/// With `when_full: "reject"`, a bucket full of tombstones takes a new key in a tombstone's
/// position (as it took an expired record's before tombstones) rather than answering full.
#[test]
fn a_bucket_full_of_tombstones_is_not_full_when_it_rejects() {
    let t = floor_table(16, WhenFull::Reject, 3600);
    let mut m = fresh(&t);
    let p = Policy { ttl_seconds: 10, tombstone_seconds: 1000, ..Policy::default() };
    let w = t.width();
    let keys = keys_in_bucket(&t, 0, w + 1);
    for k in &keys[..w] {
        let h = handle(&t.begin(&mut m, *k, Some(fp(1)), NOW, &p, owner(2), &creator("c")).unwrap());
        let r = Record::completed(fp(1), response("r"), false, creator("c"), NOW, p.ttl_seconds);
        let until = r.expires_at_ms + 1_000_000;
        t.complete_until(&mut m, &h, r, NOW, until).unwrap();
    }
    // Within their ttl: full.
    let full = t.begin(&mut m, keys[w], Some(fp(1)), NOW + 5_000, &p, owner(3), &creator("new")).unwrap();
    assert!(matches!(full, Begin::Full), "{full:?}");
    // Past it, every record is a tombstone: a position is taken.
    let b = t.begin(&mut m, keys[w], Some(fp(1)), NOW + 20_000, &p, owner(3), &creator("new")).unwrap();
    assert!(matches!(b, Begin::Claimed { .. }), "{b:?}");
}

/// A route whose records are kept 100 s as their key's tombstone past a 10 s ttl.
pub(super) fn tombstone_policy() -> Policy {
    Policy {
        lock_ttl_seconds: 5,
        ttl_seconds: 10,
        unknown_outcome_seconds: 50,
        tombstone_seconds: 100,
        ..Policy::default()
    }
}

/// Completes `h` with a response of `body_len` bytes as the filter does where this tier is the
/// record's authority: its entry kept through the key's tombstone (`Lifetimes::life_ms`).
pub(super) fn complete_kept(t: &Table, m: &mut dyn SharedData, h: &Handle, f: Fingerprint, body_len: usize, now: u64) {
    let p = tombstone_policy();
    let response = StoredResponse { status: 201, headers: vec![], body: vec![b'x'; body_len] };
    let r = Record::completed(f, response, false, creator("c"), now, p.ttl_seconds);
    let until = r.expires_at_ms + p.tombstone_seconds * 1000;
    assert_eq!(t.complete_until(m, h, r, now, until).unwrap(), Completed::Stored);
}

/// The value of a body key (empty when never written or emptied).
fn body_key(t: &Table, m: &Model, h: &Handle) -> Vec<u8> {
    m.map.get(&*t.body_name(h.bucket, h.position)).map(|(v, _)| v.clone()).unwrap_or_default()
}

/// Whether `v` holds a run of the response's bytes.
fn holds_response(v: &[u8]) -> bool {
    v.windows(64).any(|w| w.iter().all(|b| *b == b'x'))
}

/// Issue 40, item 6: the local tier's tombstone is small. Past its ttl a completed record's body
/// key holds its owner, its key and the key's tombstone (`IGT\x01` + the fingerprint: 84 bytes),
/// not the 1 KB response; the table counts 84 bytes for it (bucket, pool and gauges); the same
/// request is refused as its key's tombstone (never replayed), another is key-reused, and only
/// past ttl + tombstone is the key free. Seen failing before the change: the body key still held
/// the whole record (1 KB) after the sweep.
#[test]
fn a_local_tombstone_holds_the_fingerprint_only_and_the_table_counts_its_bytes_only() {
    let t = Table::new(&LocalConfig {
        max_entries: 128,
        max_bytes: 8192,
        when_full: WhenFull::EvictOldest,
        min_protection_seconds: 0,
    });
    let p = tombstone_policy();
    let mut m = fresh(&t);
    let keys = keys_in_bucket(&t, 0, 2);
    let (a, b) = (keys[0], keys[1]);
    let ha = handle(&t.begin(&mut m, a, Some(fp(1)), NOW, &p, owner(1), &creator("a")).unwrap());
    complete_kept(&t, &mut m, &ha, fp(1), 1024, NOW);
    // The second body does not fit its bucket's share (1536 bytes, 1.1 KB used): it goes to the pool.
    let hb = handle(&t.begin(&mut m, b, Some(fp(2)), NOW, &p, owner(2), &creator("b")).unwrap());
    complete_kept(&t, &mut m, &hb, fp(2), 1900, NOW);
    assert!(t.pool_usage(&mut m) > 1900, "the second body is pooled: {}", t.pool_usage(&mut m));
    let live = body_key(&t, &m, &ha);
    assert!(live.len() > 1024 && holds_response(&live));
    // Within the ttl the sweep leaves the records whole.
    t.sweep(&mut m, 0, t.buckets(), NOW + 9_999, &mut Gauges::default()).unwrap();
    assert_eq!(body_key(&t, &m, &ha), live);
    let at = NOW + 10_000;
    let mut g = Gauges::default();
    assert_eq!(t.sweep(&mut m, 0, t.buckets(), at, &mut g).unwrap(), 0, "nothing is freed");
    for (h, f) in [(&ha, fp(1)), (&hb, fp(2))] {
        let v = body_key(&t, &m, h);
        assert_eq!(v.len(), 84, "owner, key, IGT\\x01 and the fingerprint: {} bytes", v.len());
        assert!(!holds_response(&v), "no response byte is kept");
        assert_eq!(v.get(52..), Some(f.0.as_slice()));
        // The previous release reads no record from it: it never replays one.
        assert!(Record::decode(v.get(48..).unwrap_or(&[])).is_err());
    }
    assert_eq!(t.count(&mut m), 2, "both keys still held");
    assert_eq!(t.pool_usage(&mut m), 0, "the pooled body's reservation went back");
    assert_eq!(t.usage(&mut m), 168);
    assert_eq!(g.bytes(), 168, "the gauge follows");
    // The same request: its key's tombstone, no response.
    match claim_with(&t, &mut m, a, fp(1), 3, at + 1, &p) {
        Begin::Replay(r) => {
            assert!(r.is_tombstone_for(0, at + 1) && !matches!(r.state, State::Completed(_)), "{r:?}")
        }
        other => panic!("the tombstone answered {other:?}"),
    }
    let reused = claim_with(&t, &mut m, a, fp(9), 4, at + 1, &p);
    assert!(matches!(reused, Begin::Reject { problem: ProblemKind::KeyReused { .. }, .. }), "{reused:?}");
    // Just before ttl + tombstone the key is still held; at it, free, and its bytes gone.
    let end = NOW + 110_000;
    assert!(!matches!(claim_with(&t, &mut m, a, fp(1), 5, end - 1, &p), Begin::Claimed { .. }));
    t.sweep(&mut m, 0, t.buckets(), end, &mut g).unwrap();
    assert_eq!((t.count(&mut m), t.usage(&mut m), g.bytes()), (0, 0, 0));
    assert!(matches!(claim_with(&t, &mut m, a, fp(1), 6, end, &p), Begin::Claimed { .. }));
}

fn claim_with(t: &Table, m: &mut Model, k: StorageKey, f: Fingerprint, o: u8, now: u64, p: &Policy) -> Begin {
    t.begin(m, k, Some(f), now, p, owner(o), &creator(&format!("req-{o}"))).unwrap()
}

/// A table of 64 buckets (the oldest evicted) on a fresh model, `tombstone_policy()`, and the
/// handle of the claim owner 1 made on `skey(1)` with `fp(1)` at `NOW` under that policy.
fn claimed_under_tombstones() -> (Table, Policy, Model, Handle) {
    let t = table(64, WhenFull::EvictOldest);
    let p = tombstone_policy();
    let mut m = fresh(&t);
    let h = handle(&t.begin(&mut m, skey(1), Some(fp(1)), NOW, &p, owner(1), &creator("a")).unwrap());
    (t, p, m, h)
}

/// A lookup that meets a completed record past its ttl before any sweep shrinks it on the spot
/// (one write of its body key and one of its bucket), and answers its key's tombstone. Seen
/// failing before the change: the body key still held the 1 KB record after the lookup.
#[test]
fn a_lookup_that_meets_a_record_past_its_ttl_leaves_the_small_tombstone() {
    let (t, p, mut m, h) = claimed_under_tombstones();
    complete_kept(&t, &mut m, &h, fp(1), 1024, NOW);
    let at = NOW + 10_000;
    match claim_with(&t, &mut m, skey(1), fp(1), 2, at, &p) {
        Begin::Replay(r) => assert!(r.is_tombstone_for(p.tombstone_seconds, at), "{r:?}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(body_key(&t, &m, &h).len(), 84);
    assert_eq!(t.usage(&mut m), 84);
    assert_eq!(t.count(&mut m), 1);
}

/// The cost per key the docs state (docs/how-it-works.md, "Cost, measured"; printed with
/// `--nocapture`): a completed record with a 1,000-byte JSON body, 2 headers and a request id
/// against its tombstone, in its body key and with its bucket entry (`ENTRY_BYTES` + 1 for its
/// count, both stages alike: a completed entry keeps no creator).
#[test]
fn the_local_tombstone_costs_its_fingerprint_whatever_the_response() {
    let (t, p, mut m, h) = claimed_under_tombstones();
    let response = StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), b"application/json".to_vec()),
            ("location".into(), b"/charges/ch_1".to_vec()),
        ],
        body: [b"{\"d\":\"".as_slice(), &[b'x'; 992], b"\"}"].concat(),
    };
    let id = creator("9b2f0d6e-4c1a-4f7e-8e5d-2a61c0f3b7aa");
    let r = Record::completed(fp(1), response, false, id, NOW, p.ttl_seconds);
    let until = r.expires_at_ms + p.tombstone_seconds * 1000;
    t.complete_until(&mut m, &h, r, NOW, until).unwrap();
    let bucket = |m: &mut Model| t.read_bucket(m, 0).map(|(b, _)| b.encode().len()).unwrap();
    let (live, live_bucket) = (body_key(&t, &m, &h).len(), bucket(&mut m));
    t.sweep(&mut m, 0, 1, NOW + 10_000, &mut Gauges::default()).unwrap();
    let (tomb, tomb_bucket) = (body_key(&t, &m, &h).len(), bucket(&mut m));
    println!(
        "local tier per key: record body key {live} bytes, tombstone {tomb}; bucket {live_bucket} -> {tomb_bucket}"
    );
    assert_eq!((tomb, tomb_bucket), (TOMBSTONE_BODY_BYTES, live_bucket));
    assert!(live > 1_000 + 48, "{live}");
}

/// An entry completed by a module of before the shrink holds its claim's lock where the sweep
/// looks for its cue (`Entry::lock_expires_at_ms`): long before the record's own expiry. The
/// sweep then reads the record and leaves it whole until that expiry (a retry within the ttl is
/// still replayed), and shrinks it after.
#[test]
fn a_record_completed_by_an_earlier_module_is_shrunk_only_past_its_own_expiry() {
    let (t, p, mut m, h) = claimed_under_tombstones();
    complete_kept(&t, &mut m, &h, fp(1), 1024, NOW);
    let (mut b, cas) = t.read_bucket(&mut m, h.bucket).unwrap();
    if let Some(Some(e)) = b.positions.get_mut(h.position) {
        e.lock_expires_at_ms = NOW + 5_000;
    }
    assert!(t.write_bucket(&mut m, h.bucket, &b, cas).unwrap());
    let whole = body_key(&t, &m, &h);
    t.sweep(&mut m, 0, 1, NOW + 9_999, &mut Gauges::default()).unwrap();
    assert_eq!(body_key(&t, &m, &h), whole, "within the ttl the record stays whole");
    match claim_with(&t, &mut m, skey(1), fp(1), 2, NOW + 9_999, &p) {
        Begin::Replay(r) => assert!(matches!(r.state, State::Completed(_)) && !r.is_tombstone(NOW + 9_999)),
        other => panic!("{other:?}"),
    }
    t.sweep(&mut m, 0, 1, NOW + 10_000, &mut Gauges::default()).unwrap();
    assert_eq!(body_key(&t, &m, &h).len(), TOMBSTONE_BODY_BYTES);
    assert_eq!(t.usage(&mut m), TOMBSTONE_BODY_BYTES as u64);
}
