use super::*;
use crate::base64::b64;
use crate::fingerprint::Fingerprint;
use crate::record::{Creator, StoredResponse, UnknownReason};
use serde_json::{json, Value};
use std::collections::BTreeMap;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const SECRET: &str = "etcd-unit-tests-record-key-0123456789abcdef";
const NOW: u64 = 1_700_000_000_000;
const LEASE: i64 = 7;

fn seal() -> Seal {
    Seal::new(Some(SECRET), None).unwrap()
}

fn skey(n: u8) -> StorageKey {
    StorageKey([n; 32])
}

fn owner(n: u8) -> OwnerToken {
    OwnerToken([n; 16])
}

fn lifetimes() -> Lifetimes {
    Lifetimes { ttl_ms: 60_000, lock_ms: 10_000, unknown_ms: 30_000, tombstone_ms: 0 }
}

fn creator() -> Creator {
    Creator { request_id: "r1".into(), log_values: vec![] }
}

fn in_progress(o: OwnerToken, now: u64) -> Record {
    Record::in_progress(Fingerprint([1; 32]), creator(), o, now, &lifetimes())
}

fn completed(now: u64) -> Record {
    let resp = StoredResponse { status: 201, headers: vec![], body: b"paid".to_vec() };
    Record::completed(Fingerprint([1; 32]), resp, false, creator(), now, 60)
}

fn unknown(now: u64) -> Record {
    Record::unknown(Fingerprint([1; 32]), creator(), UnknownReason::StoreWriteFailed, now, &lifetimes())
}

/// A model of etcd's transactions, fed the exact JSON bodies the builders send and answering as
/// etcd 3.4's gateway does (proto3 JSON: `succeeded` and empty lists left out), so the lifecycle
/// sequences below run the real requests and the real parsers. Leases are not modelled (expiry
/// is by the proxies' clocks here; etcd's leases only drop keys later).
#[derive(Default)]
struct Etcd {
    kv: BTreeMap<Vec<u8>, (Vec<u8>, i64, i64)>, // key -> (value, create_revision, mod_revision)
    revision: i64,
}

impl Etcd {
    fn key(v: &Value) -> Vec<u8> {
        unb64(v["key"].as_str().unwrap()).unwrap()
    }

    fn compare(&self, c: &Value) -> bool {
        let kv = self.kv.get(&Etcd::key(c));
        assert_eq!(c["result"], "EQUAL");
        match c["target"].as_str().unwrap() {
            "CREATE" => kv.map_or(0, |k| k.1).to_string() == c["create_revision"].as_str().unwrap(),
            "MOD" => kv.map_or(0, |k| k.2).to_string() == c["mod_revision"].as_str().unwrap(),
            "VALUE" => kv.is_some_and(|k| k.0 == unb64(c["value"].as_str().unwrap()).unwrap()),
            t => panic!("target {t}"),
        }
    }

    fn range_json(&self, key: &[u8]) -> Value {
        let kvs: Vec<Value> = self
            .kv
            .get(key)
            .map(|(v, c, m)| {
                json!({"key": b64(key), "value": b64(v), "create_revision": c.to_string(), "mod_revision": m.to_string(), "version": "1"})
            })
            .into_iter()
            .collect();
        let mut r = json!({"header": {"revision": self.revision.to_string()}});
        if !kvs.is_empty() {
            r["kvs"] = Value::Array(kvs);
            r["count"] = json!("1");
        }
        r
    }

    fn txn(&mut self, t: &Value, rev: i64) -> Value {
        let ok = t["compare"].as_array().unwrap().iter().all(|c| self.compare(c));
        let ops = if ok { &t["success"] } else { &t["failure"] };
        let mut responses = vec![];
        for op in ops.as_array().unwrap() {
            if let Some(p) = op.get("request_put") {
                assert!(p["lease"].as_str().unwrap() != "0", "every put carries a lease");
                let k = Etcd::key(p);
                let create = self.kv.get(&k).map_or(rev, |e| e.1);
                self.kv.insert(k, (unb64(p["value"].as_str().unwrap()).unwrap(), create, rev));
                responses.push(json!({"response_put": {"header": {"revision": rev.to_string()}}}));
            } else if let Some(r) = op.get("request_range") {
                let mut a = self.range_json(&Etcd::key(r));
                a["header"] = json!({"revision": rev.to_string()});
                responses.push(json!({"response_range": a}));
            } else if let Some(d) = op.get("request_delete_range") {
                self.kv.remove(&Etcd::key(d));
                responses.push(json!({"response_delete_range": {"header": {}, "deleted": "1"}}));
            } else if let Some(inner) = op.get("request_txn") {
                responses.push(json!({"response_txn": self.txn(inner, rev)}));
            } else {
                panic!("op {op}");
            }
        }
        let mut a = json!({"header": {}});
        if ok {
            a["succeeded"] = json!(true);
        }
        if !responses.is_empty() {
            a["responses"] = Value::Array(responses);
        }
        a
    }

    /// Runs one request as etcd would and returns its body.
    fn run(&mut self, req: &StoreRequest) -> Vec<u8> {
        let body: Value = serde_json::from_slice(&req.body).unwrap();
        let a = match req.path.as_str() {
            "/v3/kv/txn" => {
                self.revision += 1;
                let rev = self.revision;
                let mut a = self.txn(&body, rev);
                a["header"] = json!({"cluster_id": "1", "member_id": "2", "revision": self.revision.to_string(), "raft_term": "2"});
                a
            }
            "/v3/kv/range" => self.range_json(&Etcd::key(&body)),
            p => panic!("path {p}"),
        };
        a.to_string().into_bytes()
    }

    fn flush(&mut self) {
        self.kv.clear();
    }

    fn value(&self, s: &StorageKey) -> Option<(StoredValue, u64)> {
        self.kv.get(etcd_key(s).as_bytes()).map(|(v, _, _)| open_value(v, s, &seal()).unwrap())
    }
}

fn claim(e: &mut Etcd, s: &StorageKey, o: OwnerToken, now: u64) -> Result<(ClaimReply, Option<Fence>), StoreError> {
    let req = claim_request(s, &o, &in_progress(o, now), &lifetimes(), &seal(), LEASE, now);
    let body = e.run(&req);
    parse_claim_reply(Some(200), &body, &o, s, &seal(), now)
}

/// Owner 1's claim of `s` at NOW, and owner 2's claim-or-read once that lock is stale by every
/// reader's clock: that time and the value read (its fence), for a take-over or stale-to-unknown.
fn stale_lock(e: &mut Etcd, s: &StorageKey) -> (u64, Option<Fence>) {
    claim(e, s, owner(1), NOW).unwrap();
    let later = NOW + lifetimes().lock_ms + CLOCK_SKEW_TOLERANCE_MS;
    let (_, fence) = claim(e, s, owner(2), later).unwrap();
    (later, fence)
}

/// A write as the root makes it: the transition, then, answered `Absent`, its where-absent second
/// transaction.
fn write(e: &mut Etcd, s: &StorageKey, t: &Transition, now: u64, fence: Option<&Fence>) -> TransitionReply {
    let req = transition_request(t, s, &seal(), LEASE, now, fence).unwrap();
    match parse_transition_reply(Some(200), &e.run(&req), None).unwrap() {
        TransitionReply::Absent => {
            let again = where_absent_request(t, s, &seal(), LEASE, now).unwrap();
            parse_where_absent_reply(Some(200), &e.run(&again)).unwrap()
        }
        other => other,
    }
}

#[test]
fn base64_round_trips_and_refuses_what_etcd_never_sends() {
    for n in 0..20u8 {
        let bytes: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37)).collect();
        assert_eq!(unb64(&b64(&bytes)).unwrap(), bytes);
    }
    assert_eq!(b64(b"k1"), "azE=");
    for bad in ["a", "az=E", "a===", "az E", "azE=azE=x", "=aaa"] {
        assert_eq!(unb64(bad), None, "{bad}");
    }
}

#[test]
fn a_value_is_sealed_whole_and_bound_to_its_key() {
    let v = StoredValue { phase: Stage::Completed, owner: owner(1), lock_expires_at_ms: 0, record: completed(NOW) };
    let bytes = encode_value(&v, NOW + 60_000, &skey(1), &seal());
    assert_eq!(open_value(&bytes, &skey(1), &seal()), Ok((v.clone(), NOW + 60_000)));
    assert!(open_value(&bytes, &skey(2), &seal()).unwrap_err().is_unauthentic(), "moved to another key");
    // The header is inside the seal: turning a claim into a completion, or moving a lock or an
    // expiry, breaks it.
    let mut changed = bytes.clone();
    let at = VALUE_MAGIC.len() + 4 + 32 + 5;
    changed[at] ^= 1;
    assert!(open_value(&changed, &skey(1), &seal()).unwrap_err().is_unauthentic());
    // A Redis value is not an etcd value.
    let redis = v.encode(&skey(1), &seal());
    assert!(open_value(&redis, &skey(1), &seal()).is_err());
}

#[test]
fn the_claim_is_one_transaction_with_a_lease_and_an_owner_echo() {
    let s = skey(1);
    let req = claim_request(&s, &owner(1), &in_progress(owner(1), NOW), &lifetimes(), &seal(), LEASE, NOW);
    assert_eq!((req.method, req.path.as_str()), ("POST", "/v3/kv/txn"));
    let t: Value = serde_json::from_slice(&req.body).unwrap();
    assert_eq!(t["compare"].as_array().unwrap().len(), 2);
    assert_eq!(unb64(t["compare"][1]["key"].as_str().unwrap()).unwrap(), tombstone_key(&s, &owner(1)).as_bytes());
    assert_eq!(t["success"][0]["request_put"]["lease"], "7");
    assert_eq!(t["success"][1]["request_put"]["lease"], "7");
    assert_eq!(t["failure"].as_array().unwrap().len(), 1);
    let mut e = Etcd::default();
    assert_eq!(claim(&mut e, &s, owner(1), NOW).unwrap().0, ClaimReply::Claimed { now_ms: judged_now(NOW) });
    let (v, expires) = e.value(&s).unwrap();
    assert_eq!((v.phase, v.owner, v.lock_expires_at_ms), (Stage::Forwarded, owner(1), NOW + 10_000));
    assert_eq!(expires, NOW + 40_000, "a forwarded claim's life: the lock, then unknown_outcome");
    // The duplicate reads it, with its fencing token.
    let (reply, fence) = claim(&mut e, &s, owner(2), NOW + 1).unwrap();
    let ClaimReply::Exists { now_ms, expires_at_ms, value } = reply else { panic!("{reply:?}") };
    assert_eq!((now_ms, expires_at_ms, value.owner), (judged_now(NOW + 1), NOW + 40_000, owner(1)));
    assert_eq!(fence.unwrap().mod_revision, 1);
}

#[test]
fn a_claimed_answer_that_does_not_echo_the_owner_is_refused() {
    let s = skey(1);
    let mut e = Etcd::default();
    let req = claim_request(&s, &owner(1), &in_progress(owner(1), NOW), &lifetimes(), &seal(), LEASE, NOW);
    let body = e.run(&req);
    // The answer to owner 1's claim, offered as the answer to owner 2's (a store or mock that
    // answers "succeeded" to everything).
    assert!(matches!(parse_claim_reply(Some(200), &body, &owner(2), &s, &seal(), NOW), Err(StoreError::Garbled(_))));
    let bare = br#"{"header":{"revision":"9"},"succeeded":true}"#;
    assert!(matches!(parse_claim_reply(Some(200), bare, &owner(1), &s, &seal(), NOW), Err(StoreError::Garbled(_))));
}

/// The answer etcd 3.4's gateway gives a claim that landed (recorded shape: `succeeded`, two
/// puts and the owner mark read back), with `mark` as the mark read at `key`.
fn claimed_answer(key: &[u8], mark: &[u8], succeeded: &str) -> Vec<u8> {
    format!(
        r#"{{"header":{{"cluster_id":"1","member_id":"2","revision":"5","raft_term":"2"}},{succeeded}"responses":[{{"response_put":{{"header":{{"revision":"5"}}}}}},{{"response_put":{{"header":{{"revision":"5"}}}}}},{{"response_range":{{"header":{{"revision":"5"}},"kvs":[{{"key":"{}","create_revision":"5","mod_revision":"5","version":"1","value":"{}","lease":"7"}}],"count":"1"}}}}]}}"#,
        b64(key),
        b64(mark)
    )
    .into_bytes()
}

#[test]
fn a_mis_parsed_claim_answer_is_never_read_as_a_won_claim() {
    let s = skey(1);
    let o = owner(1);
    let c = |body: &[u8]| parse_claim_reply(Some(200), body, &o, &s, &seal(), NOW);
    let mark = owner_mark(Stage::Forwarded, &o);
    let won = ClaimReply::Claimed { now_ms: judged_now(NOW) };
    // The one answer that is a won claim.
    assert_eq!(c(&claimed_answer(owner_key(&s).as_bytes(), &mark, r#""succeeded":true,"#)).unwrap().0, won);
    // The same strings with JSON escapes (which etcd never writes) read the same: unescaped, not
    // borrowed, never misread.
    let escaped = String::from_utf8(claimed_answer(owner_key(&s).as_bytes(), &mark, r#""succeeded":true,"#))
        .unwrap()
        .replace(r#""revision":"5""#, r#""revision":"\u0035""#)
        .replacen(&b64(&mark)[..4], &format!("\\u00{:02x}{}", b64(&mark).as_bytes()[0], &b64(&mark)[1..4]), 1);
    assert_eq!(c(escaped.as_bytes()).unwrap().0, won, "{escaped}");
    let mut refused: Vec<(&str, Vec<u8>)> = vec![
        // The writes' answer without `succeeded` (proto3 JSON leaves out a false one): not won,
        // and three operations are no claim-or-read answer either.
        ("no succeeded", claimed_answer(owner_key(&s).as_bytes(), &mark, "")),
        ("succeeded false", claimed_answer(owner_key(&s).as_bytes(), &mark, r#""succeeded":false,"#)),
        ("succeeded as a string", claimed_answer(owner_key(&s).as_bytes(), &mark, r#""succeeded":"true","#)),
        ("succeeded twice", claimed_answer(owner_key(&s).as_bytes(), &mark, r#""succeeded":false,"succeeded":true,"#)),
        // The mark read back at another key: the answer to another key's claim.
        ("another key", claimed_answer(owner_key(&skey(2)).as_bytes(), &mark, r#""succeeded":true,"#)),
        ("the value key", claimed_answer(etcd_key(&s).as_bytes(), &mark, r#""succeeded":true,"#)),
        // Another owner's mark, or another phase's.
        (
            "another owner",
            claimed_answer(owner_key(&s).as_bytes(), &owner_mark(Stage::Forwarded, &owner(2)), r#""succeeded":true,"#),
        ),
        (
            "another phase",
            claimed_answer(owner_key(&s).as_bytes(), &owner_mark(Stage::Completed, &o), r#""succeeded":true,"#),
        ),
        // A header only, with or without `succeeded`.
        ("header only", br#"{"header":{"revision":"5"}}"#.to_vec()),
        ("header and succeeded", br#"{"header":{"revision":"5"},"succeeded":true}"#.to_vec()),
        (
            "no header",
            br#"{"succeeded":true,"responses":[{"response_put":{}},{"response_put":{}},{"response_range":{}}]}"#
                .to_vec(),
        ),
    ];
    // A truncated answer, at every length.
    let whole = claimed_answer(owner_key(&s).as_bytes(), &mark, r#""succeeded":true,"#);
    for n in (0..whole.len()).step_by(7) {
        refused.push(("truncated", whole[..n].to_vec()));
    }
    for (why, body) in refused {
        match c(&body) {
            Ok((ClaimReply::Claimed { .. }, _)) => {
                panic!("{why}: read as a won claim: {}", String::from_utf8_lossy(&body))
            }
            Ok(other) => panic!("{why}: {other:?}"),
            Err(_) => {}
        }
    }
}

#[test]
fn a_mis_parsed_take_over_answer_is_never_read_as_a_change() {
    let s = skey(1);
    let new = owner(2);
    let t = |body: &[u8]| parse_transition_reply(Some(200), body, Some((&s, Stage::Forwarded, &new)));
    let mark = owner_mark(Stage::Forwarded, &new);
    let ok = r#""succeeded":true,"#;
    assert_eq!(t(&claimed_answer(owner_key(&s).as_bytes(), &mark, ok)), Ok(TransitionReply::Changed));
    for (why, body) in [
        ("no succeeded", claimed_answer(owner_key(&s).as_bytes(), &mark, "")),
        ("another key", claimed_answer(owner_key(&skey(2)).as_bytes(), &mark, ok)),
        ("the old owner", claimed_answer(owner_key(&s).as_bytes(), &owner_mark(Stage::Forwarded, &owner(1)), ok)),
        ("header and succeeded", br#"{"header":{"revision":"5"},"succeeded":true}"#.to_vec()),
    ] {
        assert_ne!(t(&body), Ok(TransitionReply::Changed), "{why}");
    }
    // A header only is a refusal (the compare failed), never a change.
    assert_eq!(t(br#"{"header":{"revision":"5"}}"#), Ok(TransitionReply::Refused));
}

#[test]
fn errors_and_hostile_answers_are_store_errors_never_claims() {
    let s = skey(1);
    let o = owner(1);
    let c = |status, body: &[u8]| parse_claim_reply(status, body, &o, &s, &seal(), NOW);
    assert_eq!(c(None, b""), Err(StoreError::NoAnswer));
    assert_eq!(c(Some(503), b"{}"), Err(StoreError::Http(503)));
    for body in [
        &b""[..],
        b"{}",
        b"[]",
        br#"{"header":{}}"#,
        br#"{"header":{"revision":"x"}}"#,
        br#"{"header":{"revision":"1"},"responses":[{},{},{},{},{}]}"#,
        br#"{"header":{"revision":"1"},"responses":[{"response_range":{"kvs":[{},{},{},{},{}]}}]}"#,
        br#"{"header":{"revision":"1"},"responses":[{"response_range":{}}]}"#,
        br#"{"header":{"revision":"1"},"responses":[{"response_range":{},"response_put":{}}]}"#,
        br#"{"header":{"revision":"1"},"header":{"revision":"1"}}"#,
    ] {
        assert!(matches!(c(Some(200), body), Err(StoreError::Garbled(_))), "{}", String::from_utf8_lossy(body));
    }
    // A list of a million elements is refused at its fifth.
    let mut huge = br#"{"header":{"revision":"1"},"responses":["#.to_vec();
    for _ in 0..1_000_000 {
        huge.extend_from_slice(b"{},");
    }
    huge.extend_from_slice(b"{}]}");
    assert!(matches!(c(Some(200), &huge), Err(StoreError::Garbled(_))));
}

#[test]
fn owner_transitions_compare_the_owner_mark_and_fenced_ones_the_revision() {
    let s = skey(1);
    let l = lifetimes();
    let body = |t: &Transition, f: Option<&Fence>| -> Value {
        serde_json::from_slice(&transition_request(t, &s, &seal(), LEASE, NOW, f).unwrap().body).unwrap()
    };
    let mark = |p| b64(&owner_mark(p, &owner(1)));
    let complete = body(&Transition::complete(owner(1), completed(NOW), &l), None);
    assert_eq!(complete["compare"][0]["target"], "VALUE");
    assert_eq!(complete["compare"][0]["value"], mark(Stage::Forwarded));
    // Where the claim is gone, a completion reads whether the key exists (its name only); the
    // record is in the transaction once.
    assert_eq!(complete["failure"][0]["request_range"]["keys_only"], json!(true));
    assert_eq!(complete["failure"].as_array().unwrap().len(), 1);
    let release = body(&Transition::release(owner(1)), None);
    assert_eq!(release["success"].as_array().unwrap().len(), 2);
    assert_eq!(release["failure"], json!([]), "a release never writes where absent");
    let lost = body(&Transition::release_lost(owner(1), &l), None);
    assert_eq!(
        unb64(lost["failure"][0]["request_put"]["key"].as_str().unwrap()).unwrap(),
        tombstone_key(&s, &owner(1)).as_bytes()
    );
    let unknown_t = body(&Transition::unknown(owner(1), unknown(NOW), &l), None);
    assert_eq!(unknown_t["failure"][0]["request_range"]["keys_only"], json!(true));
    assert!(where_absent_request(&Transition::release(owner(1)), &s, &seal(), LEASE, NOW).is_err());
    // Non-owners need the value they decided on, stale by the judged clock.
    let stale = Transition::stale_to_unknown(owner(1), &l);
    assert!(transition_request(&stale, &s, &seal(), LEASE, NOW, None).is_err());
    let value = StoredValue {
        phase: Stage::Forwarded,
        owner: owner(1),
        lock_expires_at_ms: NOW - CLOCK_SKEW_TOLERANCE_MS + 1,
        record: in_progress(owner(1), NOW - 10_000),
    };
    let live = Fence { mod_revision: 5, value: value.clone(), expires_at_ms: NOW + 30_000, tombstone: false };
    assert!(transition_request(&stale, &s, &seal(), LEASE, NOW, Some(&live)).is_err(), "live within the skew");
    let gone = Fence {
        value: StoredValue { lock_expires_at_ms: NOW - CLOCK_SKEW_TOLERANCE_MS, ..value.clone() },
        ..live.clone()
    };
    let t = body(&stale, Some(&gone));
    assert_eq!(
        (t["compare"][0]["target"].as_str(), t["compare"][0]["mod_revision"].as_str()),
        (Some("MOD"), Some("5"))
    );
    let other = Fence { value: StoredValue { owner: owner(3), ..gone.value.clone() }, ..gone.clone() };
    assert!(transition_request(&stale, &s, &seal(), LEASE, NOW, Some(&other)).is_err(), "another owner's value");
}

/// A non-owner's fenced transition is the lifecycle's (`lifecycle::next` on the fenced value at
/// `judged_now`), as Redis's script and the local tier judge theirs: a claim of a value that is
/// not free yet (a completed record before its expiry, whose lock is no claim's) is never built,
/// nor a take-over of a completed value or an outcome-unknown mark of one.
#[test]
fn a_fenced_transition_is_built_only_where_the_lifecycle_allows_it() {
    let s = skey(1);
    let l = lifetimes();
    let value = StoredValue { phase: Stage::Completed, owner: owner(1), lock_expires_at_ms: 0, record: completed(NOW) };
    let fence = Fence { mod_revision: 5, value, expires_at_ms: NOW + 60_000, tombstone: false };
    let claim_free = Transition::take_over(owner(1), owner(2), in_progress(owner(2), NOW), true, &l);
    let held = transition_request(&claim_free, &s, &seal(), LEASE, NOW, Some(&fence));
    assert!(held.unwrap_err().contains("Held"), "a completed record before its expiry holds its key");
    let past = NOW + 60_000 + CLOCK_SKEW_TOLERANCE_MS;
    assert!(transition_request(&claim_free, &s, &seal(), LEASE, past, Some(&fence)).is_ok(), "free");
    let take = Transition::take_over(owner(1), owner(2), in_progress(owner(2), past), false, &l);
    assert!(transition_request(&take, &s, &seal(), LEASE, past, Some(&fence)).unwrap_err().contains("WrongStage"));
    let stale = Transition::stale_to_unknown(owner(1), &l);
    assert!(transition_request(&stale, &s, &seal(), LEASE, past, Some(&fence)).unwrap_err().contains("WrongStage"));
}

/// The sequences that would execute a key twice, run through the real requests and parsers on a
/// model of etcd's transactions.
#[test]
fn two_duplicates_racing_claim_once() {
    let s = skey(1);
    let mut e = Etcd::default();
    let a = claim(&mut e, &s, owner(1), NOW).unwrap().0;
    let b = claim(&mut e, &s, owner(2), NOW).unwrap().0;
    assert!(matches!(a, ClaimReply::Claimed { .. }));
    assert!(matches!(b, ClaimReply::Exists { .. }), "{b:?}");
}

#[test]
fn a_lost_claim_released_before_it_lands_never_lands() {
    let s = skey(1);
    let l = lifetimes();
    let mut e = Etcd::default();
    // The claim's answer was lost and its release ran first: the tombstone refuses the claim
    // arriving late, so no claim that nothing runs under holds the key...
    assert_eq!(write(&mut e, &s, &Transition::release_lost(owner(1), &l), NOW, None), TransitionReply::Changed);
    assert!(claim(&mut e, &s, owner(1), NOW).is_err());
    assert!(e.value(&s).is_none());
    // ...and it does not hold it for anyone else.
    assert!(matches!(claim(&mut e, &s, owner(2), NOW).unwrap().0, ClaimReply::Claimed { .. }));
    // A release that comes after the claim landed deletes it.
    let s2 = skey(2);
    claim(&mut e, &s2, owner(3), NOW).unwrap();
    assert_eq!(write(&mut e, &s2, &Transition::release_lost(owner(3), &l), NOW, None), TransitionReply::Changed);
    assert!(e.value(&s2).is_none());
}

#[test]
fn a_lost_take_over_released_before_it_lands_never_lands() {
    // A take-over (of a stale lock, or of a free record) whose answer was lost is released with
    // its owner's tombstone; landing after that, it would hold the key for a request never
    // forwarded (in flight, then outcome-unknown). The tombstone refuses it, as it does a claim.
    let l = lifetimes();
    for free in [false, true] {
        let s = skey(1);
        let mut e = Etcd::default();
        let (stale, fence) = stale_lock(&mut e, &s);
        // A free value is claimed once it is past its expiry (`Summary::is_free`), a stale lock
        // taken over as soon as it is stale.
        let free_at = fence.as_ref().map_or(stale, |f| f.expires_at_ms + CLOCK_SKEW_TOLERANCE_MS);
        let later = if free { free_at } else { stale };
        let take = Transition::take_over(owner(1), owner(2), in_progress(owner(2), later), free, &l);
        write(&mut e, &s, &Transition::release_lost(owner(2), &l), later, None);
        assert_eq!(write(&mut e, &s, &take, later, fence.as_ref()), TransitionReply::Refused, "free: {free}");
        assert_eq!(e.value(&s).unwrap().0.owner, owner(1), "free: {free}");
        // Another owner's take-over is not refused by that tombstone.
        let other = Transition::take_over(owner(1), owner(3), in_progress(owner(3), later), free, &l);
        assert_eq!(write(&mut e, &s, &other, later, fence.as_ref()), TransitionReply::Changed, "free: {free}");
    }
}

#[test]
fn a_completion_after_a_take_over_is_refused_and_the_new_owner_keeps_the_key() {
    let s = skey(1);
    let l = lifetimes();
    let mut e = Etcd::default();
    let (later, fence) = stale_lock(&mut e, &s);
    let take = Transition::take_over(owner(1), owner(2), in_progress(owner(2), later), false, &l);
    let req = transition_request(&take, &s, &seal(), LEASE, later, fence.as_ref()).unwrap();
    let body = e.run(&req);
    assert_eq!(
        parse_transition_reply(Some(200), &body, Some((&s, Stage::Forwarded, &owner(2)))),
        Ok(TransitionReply::Changed)
    );
    // The stale owner's late completion and release change nothing.
    assert_eq!(
        write(&mut e, &s, &Transition::complete(owner(1), completed(later), &l), later, None),
        TransitionReply::Refused
    );
    assert_eq!(write(&mut e, &s, &Transition::release(owner(1)), later, None), TransitionReply::Refused);
    assert_eq!(e.value(&s).unwrap().0.owner, owner(2));
    // A second take-over decided on the same read loses: the revision moved.
    let again = Transition::take_over(owner(1), owner(3), in_progress(owner(3), later), false, &l);
    assert_eq!(write(&mut e, &s, &again, later, fence.as_ref()), TransitionReply::Refused);
}

#[test]
fn stale_to_unknown_racing_the_owners_completion_lets_exactly_one_win() {
    let l = lifetimes();
    for completion_first in [true, false] {
        let s = skey(1);
        let mut e = Etcd::default();
        let (later, fence) = stale_lock(&mut e, &s);
        let stale = Transition::stale_to_unknown(owner(1), &l);
        let complete = Transition::complete(owner(1), completed(later), &l);
        let (first, second) = if completion_first {
            (write(&mut e, &s, &complete, later, None), write(&mut e, &s, &stale, later, fence.as_ref()))
        } else {
            (write(&mut e, &s, &stale, later, fence.as_ref()), write(&mut e, &s, &complete, later, None))
        };
        assert_eq!((first, second), (TransitionReply::Changed, TransitionReply::Refused));
        let phase = e.value(&s).unwrap().0.phase;
        assert_eq!(phase, if completion_first { Stage::Completed } else { Stage::Unknown });
    }
}

#[test]
fn a_completion_or_unknown_mark_that_finds_its_claim_gone_writes_it_and_an_owner_mismatch_is_refused() {
    let l = lifetimes();
    let s = skey(1);
    let mut e = Etcd::default();
    claim(&mut e, &s, owner(1), NOW).unwrap();
    e.flush();
    assert_eq!(
        write(&mut e, &s, &Transition::complete(owner(1), completed(NOW), &l), NOW, None),
        TransitionReply::ClaimGoneRewritten
    );
    let ClaimReply::Exists { value, .. } = claim(&mut e, &s, owner(2), NOW).unwrap().0 else { panic!() };
    assert_eq!(value.phase, Stage::Completed, "the retry replays");
    // Gone, then claimed by a retry before the owner's mark: refused, the retry keeps it.
    let s2 = skey(2);
    claim(&mut e, &s2, owner(1), NOW).unwrap();
    e.flush();
    claim(&mut e, &s2, owner(2), NOW).unwrap();
    assert_eq!(
        write(&mut e, &s2, &Transition::unknown(owner(1), unknown(NOW), &l), NOW, None),
        TransitionReply::Refused
    );
    assert_eq!(e.value(&s2).unwrap().0.owner, owner(2));
    // A release never writes where absent.
    let s3 = skey(3);
    assert_eq!(write(&mut e, &s3, &Transition::release(owner(1)), NOW, None), TransitionReply::Refused);
    assert!(e.value(&s3).is_none());
}

#[test]
fn a_finished_record_is_never_released_completed_or_marked_again() {
    let l = lifetimes();
    let s = skey(1);
    let mut e = Etcd::default();
    claim(&mut e, &s, owner(1), NOW).unwrap();
    assert_eq!(
        write(&mut e, &s, &Transition::complete(owner(1), completed(NOW), &l), NOW, None),
        TransitionReply::Changed
    );
    for t in [
        Transition::release(owner(1)),
        Transition::complete(owner(1), completed(NOW), &l),
        Transition::unknown(owner(1), unknown(NOW), &l),
    ] {
        assert_eq!(write(&mut e, &s, &t, NOW, None), TransitionReply::Refused, "{t:?}");
    }
    assert_eq!(e.value(&s).unwrap().0.phase, Stage::Completed);
}

#[test]
fn reads_judge_expiry_with_the_clock_taken_the_tolerance_behind() {
    let s = skey(1);
    let mut e = Etcd::default();
    claim(&mut e, &s, owner(1), NOW).unwrap();
    let (_, expires) = e.value(&s).unwrap();
    let body = e.run(&read_request(&s));
    let read = |now| parse_read_reply(Some(200), &body, &s, &seal(), now).unwrap();
    assert!(matches!(read(expires), ReadReply::Found(_)), "not yet free within the tolerance");
    assert!(matches!(read(expires + CLOCK_SKEW_TOLERANCE_MS - 1), ReadReply::Found(_)));
    assert_eq!(read(expires + CLOCK_SKEW_TOLERANCE_MS), ReadReply::Absent);
    let none = Etcd::default().run(&read_request(&s));
    assert_eq!(parse_read_reply(Some(200), &none, &s, &seal(), NOW), Ok(ReadReply::Absent));
}

#[test]
fn leases_are_granted_ahead_and_a_put_never_goes_without_one() {
    let mut l = Leases::default();
    assert_eq!(l.usable(NOW), None);
    assert!(l.wants_grant(NOW));
    l.grant_sent(NOW);
    assert!(!l.wants_grant(NOW + 1), "one grant in flight");
    l.granted(11, NOW, NOW + 5);
    assert_eq!(l.usable(NOW + 5), Some(11));
    assert!(!l.wants_grant(NOW + 10));
    // Half a window later the next one is granted, before the first stops being usable.
    let half = NOW + LEASE_WINDOW_MS / 2;
    assert!(l.wants_grant(half));
    l.grant_sent(half);
    l.granted(12, half, half + 1);
    assert_eq!(l.usable(half + 2), Some(12));
    // No answer for a whole window: nothing usable.
    assert_eq!(l.usable(half + LEASE_WINDOW_MS), None);
    let mut f = Leases::default();
    f.grant_sent(NOW);
    f.grant_failed(NOW, NOW + 1);
    assert!(!f.wants_grant(NOW + 2));
    assert!(f.wants_grant(NOW + 1 + LEASE_RETRY_MS));
}

#[test]
fn a_late_answer_to_a_grant_sent_again_is_timed_from_its_own_send() {
    // Grant A sent at NOW, its member hangs after etcd granted it (A's TTL runs from about NOW);
    // no answer after LEASE_GRANT_STUCK_MS, so grant B is sent and answered at once; then A's answer
    // arrives, late. A must be usable only a window from NOW, when it was sent: timed from B's send
    // (or from its arrival), a put near that window's end would outlive A's TTL, etcd would drop the
    // record early, and a retry would claim the key and execute it again.
    let mut l = Leases::default();
    l.grant_sent(NOW);
    let again = NOW + LEASE_GRANT_STUCK_MS;
    assert!(l.wants_grant(again), "a grant with no answer is sent again");
    l.grant_sent(again);
    l.granted(2, again, again + 50);
    let late = NOW + 50_000;
    l.granted(1, NOW, late);
    assert_eq!(l.usable(NOW + LEASE_WINDOW_MS - 1), Some(2), "B, sent later, lasts longer");
    assert_eq!(l.usable(again + LEASE_WINDOW_MS - 1), Some(2));
    assert_eq!(l.usable(again + LEASE_WINDOW_MS), None, "A is never used past a window from its send");
    // The older grant's failure leaves the newer one in flight: no third grant meanwhile.
    let mut f = Leases::default();
    f.grant_sent(NOW);
    f.grant_sent(again);
    f.grant_failed(NOW, again + 1);
    assert!(!f.wants_grant(again + 2 + LEASE_RETRY_MS), "the newer grant is still in flight");
    f.grant_failed(again, again + 3);
    assert!(f.wants_grant(again + 3 + LEASE_RETRY_MS));
    let mut n = Leases::default();
    n.grant_not_sent(NOW);
    assert!(!n.wants_grant(NOW + 1));
    assert!(n.wants_grant(NOW + LEASE_RETRY_MS));
}

#[test]
fn a_lease_outlives_every_record_put_under_it() {
    let c = Config::parse(br#"{"scope": {"global": true}, "ttl_seconds": 100, "lock_ttl_seconds": 10, "unknown_outcome_seconds": 500, "store": {"kind": "etcd", "cluster": "e"}}"#).unwrap();
    assert_eq!(longest_life_ms(&c), 510_000);
    assert_eq!(lease_ttl_seconds(&c), 60 + 510 + 30);
    let body = br#"{"header":{"revision":"1"},"ID":"4111120359662177285","TTL":"600"}"#;
    assert_eq!(parse_lease_grant(Some(200), body, 600), Ok(4111120359662177285));
    assert!(parse_lease_grant(Some(200), body, 601).is_err(), "a shorter lease than asked");
    assert!(parse_lease_grant(Some(200), br#"{"header":{"revision":"1"},"ID":"0","TTL":"600"}"#, 600).is_err());
    let req: Value = serde_json::from_slice(&lease_grant_request(600).body).unwrap();
    assert_eq!(req["TTL"], "600");
}

/// Issue 23, item 5: a completion carries its record once (a nested where-absent put carried it
/// twice, and etcd refused an 800 KB response as over its 1.5 MiB request limit).
#[test]
fn a_completion_carries_its_record_once() {
    let l = lifetimes();
    let s = skey(1);
    let resp = StoredResponse { status: 200, headers: vec![], body: vec![b'x'; 300_000] };
    let record = Record::completed(Fingerprint([1; 32]), resp, false, creator(), NOW, 60);
    let t = Transition::complete(owner(1), record, &l);
    let req = transition_request(&t, &s, &seal(), LEASE, NOW, None).unwrap();
    // The value in base64 is 400 KB: once, with a few hundred bytes of the rest.
    assert!((400_000..420_000).contains(&req.body.len()), "{} bytes", req.body.len());
    let again = where_absent_request(&t, &s, &seal(), LEASE, NOW).unwrap();
    assert!((400_000..420_000).contains(&again.body.len()), "{} bytes", again.body.len());
}

#[test]
fn answers_seen_from_a_real_etcd_parse() {
    // Recorded from etcd 3.4.23 with curl (see TOOLCHAIN.md).
    let absent = br#"{"header":{"cluster_id":"15118495548433857066","member_id":"13668033151171901709","revision":"1","raft_term":"2"},"responses":[{"response_range":{"header":{"revision":"1"}}}]}"#;
    assert_eq!(parse_transition_reply(Some(200), absent, None), Ok(TransitionReply::Absent));
    let exists = br#"{"header":{"cluster_id":"15118495548433857066","member_id":"13668033151171901709","revision":"2","raft_term":"2"},"responses":[{"response_range":{"header":{"revision":"2"},"kvs":[{"key":"dg==","create_revision":"2","mod_revision":"2","version":"1"}],"count":"1"}}]}"#;
    assert_eq!(parse_transition_reply(Some(200), exists, None), Ok(TransitionReply::Refused));
    // Refused for their size (nothing applied): over --max-request-bytes, over the gRPC limit.
    let too_large =
        br#"{"error":"etcdserver: request is too large","message":"etcdserver: request is too large","code":3}"#;
    assert!(refused_as_too_large(Some(400), too_large));
    let over_grpc = br#"{"error":"grpc: received message larger than max (3000018 vs. 2097152)","message":"grpc: received message larger than max (3000018 vs. 2097152)","code":8}"#;
    assert!(refused_as_too_large(Some(429), over_grpc));
    assert!(!refused_as_too_large(Some(400), br#"{"error":"etcdserver: revision of auth store is old"}"#));
    assert!(!refused_as_too_large(None, b""));
    let refused = br#"{"header":{"cluster_id":"1","member_id":"1","revision":"4","raft_term":"2"}}"#;
    assert_eq!(parse_transition_reply(Some(200), refused, None), Ok(TransitionReply::Refused));
    let deleted = br#"{"header":{"revision":"3"},"succeeded":true,"responses":[{"response_delete_range":{"header":{"revision":"3"},"deleted":"1"}},{"response_delete_range":{"header":{"revision":"3"},"deleted":"1"}}]}"#;
    assert_eq!(parse_transition_reply(Some(200), deleted, None), Ok(TransitionReply::Changed));
    let lease_gone = br#"{"error":"etcdserver: requested lease not found","message":"etcdserver: requested lease not found","code":5}"#;
    assert_eq!(parse_transition_reply(Some(404), lease_gone, None), Err(StoreError::Http(404)));
}

#[test]
fn authentication_is_asked_with_the_whole_password_and_refused_without_a_user() {
    let r = authenticate_request("idemgate:pa:ss").unwrap();
    assert_eq!((r.method, r.path.as_str()), ("POST", AUTH_PATH));
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!((v["name"].as_str(), v["password"].as_str()), (Some("idemgate"), Some("pa:ss")));
    assert!(authenticate_request(":pw").is_err());
    assert!(authenticate_request("no-colon").is_err());
}

#[test]
fn a_token_is_taken_only_from_a_whole_answer_and_only_if_it_fits_a_header() {
    let ok = br#"{"header":{"revision":"1"},"token":"aCYxrMFTHEFthxCm.12"}"#;
    assert_eq!(parse_authenticate(Some(200), ok).unwrap(), "aCYxrMFTHEFthxCm.12");
    let bad_password = br#"{"error":"etcdserver: authentication failed, invalid user ID or password","code":3}"#;
    assert_eq!(parse_authenticate(Some(400), bad_password), Err(StoreError::Http(400)));
    assert_eq!(parse_authenticate(None, b""), Err(StoreError::NoAnswer));
    for body in [
        &br#"{"token":"t"}"#[..],
        br#"{"header":{"revision":"1"}}"#,
        br#"{"header":{"revision":"1"},"token":""}"#,
        br#"{"header":{"revision":"1"},"token":"a b"}"#,
        br#"{"header":{"revision":"1"},"token":"a\r\nx-injected: 1"}"#,
    ] {
        assert!(parse_authenticate(Some(200), body).is_err(), "{}", String::from_utf8_lossy(body));
    }
    let long = format!(r#"{{"header":{{"revision":"1"}},"token":"{}"}}"#, "t".repeat(MAX_TOKEN_LEN + 1));
    assert!(parse_authenticate(Some(200), long.as_bytes()).is_err());
    assert!(token_refused(Some(401), b"") && !token_refused(Some(403), b"") && !token_refused(None, b""));
    // A token older than etcd's auth store (a role granted anywhere since): taken again at once.
    let old_revision = br#"{"error":"etcdserver: revision of auth store is old","code":3,"message":"etcdserver: revision of auth store is old"}"#;
    assert!(token_refused(Some(400), old_revision));
    assert!(!token_refused(Some(400), bad_password) && !token_refused(Some(400), b"revision of auth store is old"));
    assert!(!token_refused(Some(200), old_revision));
    assert_eq!(error_text(bad_password), "etcdserver: authentication failed, invalid user ID or password");
    assert_eq!(
        error_text(b"Client sent an HTTP request\r\nto an HTTPS server."),
        "Client sent an HTTP requestto an HTTPS server."
    );
    assert_eq!(error_text(format!(r#"{{"error":"{}\n"}}"#, "x".repeat(300)).as_bytes()).len(), 200);
}

#[test]
fn the_token_is_asked_at_start_refreshed_before_it_ages_and_again_at_once_when_refused() {
    let refresh = 60_000;
    let mut a = Auth::default();
    assert!(a.wants_authenticate(0, refresh) && a.token().is_none());
    a.sent(0);
    assert!(!a.wants_authenticate(100, refresh), "one in flight at a time");
    a.obtained("t1".into(), 100);
    assert_eq!(a.token(), Some("t1"));
    assert!(!a.wants_authenticate(60_099, refresh));
    assert!(a.wants_authenticate(60_100, refresh), "refreshed every token_refresh_seconds");
    // Refused by etcd: asked again at once, the old token kept until its successor arrives.
    assert!(a.refused());
    assert!(!a.refused(), "one refusal is news once");
    assert!(a.wants_authenticate(1_000, refresh));
    a.sent(1_000);
    assert!(!a.wants_authenticate(1_001, refresh));
    assert_eq!(a.token(), Some("t1"));
    // A failure (wrong password, etcd down) backs off, doubling up to 10 s.
    a.failed(2_000);
    assert!(!a.wants_authenticate(2_499, refresh) && a.wants_authenticate(2_500, refresh));
    for _ in 0..10 {
        a.failed(10_000);
    }
    assert!(!a.wants_authenticate(19_999, refresh) && a.wants_authenticate(20_000, refresh));
    a.obtained("t2".into(), 30_000);
    assert_eq!(a.token(), Some("t2"));
    assert!(!a.wants_authenticate(30_001, refresh), "a new token clears the refusal");
    // A refusal before any token is no news (nothing to replace).
    assert!(!Auth::default().refused());
}

// ---------------------------------------------------------------------------------------------
// The operator's CLI on etcd: fenced reads, fenced transitions, leases, list pages.

/// The value of `s` as the operator reads it: the read answer and its fence.
fn operator_read(e: &mut Etcd, s: &StorageKey, now: u64) -> (ReadReply, Option<Fence>) {
    let body = e.run(&read_request(s));
    parse_fenced_read(Some(200), &body, s, &seal(), now).unwrap()
}

fn operator_write(e: &mut Etcd, s: &StorageKey, t: &Transition, now: u64, fence: &Fence) -> TransitionReply {
    let req = operator_transition_request(t, s, &seal(), LEASE, now, fence).unwrap();
    let echo = t.new_phase.map(|p| (s, p, &t.new_owner));
    parse_transition_reply(Some(200), &e.run(&req), echo).unwrap()
}

/// A key marked outcome-unknown by its owner (`owner(1)`), as the filter leaves it.
fn outcome_unknown_key(e: &mut Etcd, s: &StorageKey) {
    claim(e, s, owner(1), NOW).unwrap();
    let mark = Transition::unknown(owner(1), unknown(NOW), &lifetimes());
    assert_eq!(write(e, s, &mark, NOW, None), TransitionReply::Changed);
}

#[test]
fn a_fenced_read_carries_the_values_revision_and_judges_expiry_as_reads_do() {
    let s = skey(1);
    let mut e = Etcd::default();
    assert_eq!(operator_read(&mut e, &s, NOW), (ReadReply::Absent, None));
    claim(&mut e, &s, owner(1), NOW).unwrap();
    let (read, fence) = operator_read(&mut e, &s, NOW);
    let f = fence.unwrap();
    assert_eq!(read, ReadReply::Found(f.value.clone()));
    assert_eq!(f.mod_revision, e.kv[etcd_key(&s).as_bytes()].2);
    assert_eq!(f.expires_at_ms, e.value(&s).unwrap().1);
    // Past its expiry by the judged clock: absent, and no fence to write on.
    assert_eq!(operator_read(&mut e, &s, f.expires_at_ms + CLOCK_SKEW_TOLERANCE_MS), (ReadReply::Absent, None));
    assert!(parse_fenced_read(Some(401), b"{}", &s, &seal(), NOW).is_err());
}

#[test]
fn an_operators_transition_compares_the_revision_read_whatever_the_event() {
    let s = skey(1);
    let mut e = Etcd::default();
    outcome_unknown_key(&mut e, &s);
    let (_, fence) = operator_read(&mut e, &s, NOW);
    let fence = fence.unwrap();
    let release = crate::admin::plan(&crate::admin::Settle::Release, &fence.value, judged_now(NOW), 0).unwrap();
    let req = operator_transition_request(&release, &s, &seal(), LEASE, NOW, &fence).unwrap();
    let body: Value = serde_json::from_slice(&req.body).unwrap();
    assert_eq!(body["compare"].as_array().unwrap().len(), 1);
    assert_eq!(body["compare"][0]["target"], "MOD");
    assert_eq!(body["compare"][0]["mod_revision"], fence.mod_revision.to_string());
    assert_eq!(unb64(body["compare"][0]["key"].as_str().unwrap()).unwrap(), etcd_key(&s).as_bytes());
    assert_eq!(body["failure"], json!([]), "a key found changed or absent is left as it is");
    // The value rewritten since the read, with the same phase and owner (what an owner-mark
    // compare alone would let through): refused, nothing deleted.
    e.revision += 1;
    let rev = e.revision;
    e.kv.get_mut(etcd_key(&s).as_bytes()).unwrap().2 = rev;
    assert_eq!(operator_write(&mut e, &s, &release, NOW, &fence), TransitionReply::Refused);
    assert_eq!(e.value(&s).unwrap().0.phase, Stage::Unknown);
    // Read again: it lands, value and owner mark gone.
    let (_, fresh) = operator_read(&mut e, &s, NOW);
    assert_eq!(operator_write(&mut e, &s, &release, NOW, &fresh.unwrap()), TransitionReply::Changed);
    assert!(e.value(&s).is_none());
    assert!(!e.kv.contains_key(owner_key(&s).as_bytes()));
}

#[test]
fn two_operators_deciding_on_one_read_change_the_key_once() {
    let s = skey(1);
    let mut e = Etcd::default();
    outcome_unknown_key(&mut e, &s);
    let (_, fence) = operator_read(&mut e, &s, NOW);
    let fence = fence.unwrap();
    let response = StoredResponse { status: 201, headers: vec![], body: b"found".to_vec() };
    let complete = crate::admin::plan(
        &crate::admin::Settle::Complete { response, ttl_ms: 60_000 },
        &fence.value,
        judged_now(NOW),
        0,
    )
    .unwrap();
    let release = crate::admin::plan(&crate::admin::Settle::Release, &fence.value, judged_now(NOW), 0).unwrap();
    assert_eq!(operator_write(&mut e, &s, &complete, NOW, &fence), TransitionReply::Changed);
    assert_eq!(operator_write(&mut e, &s, &release, NOW, &fence), TransitionReply::Refused);
    let (v, expires) = e.value(&s).unwrap();
    assert_eq!((v.phase, v.owner, expires), (Stage::Completed, owner(1), NOW + 60_000));
    assert_eq!(e.kv[owner_key(&s).as_bytes()].0, owner_mark(Stage::Completed, &owner(1)));
    // The owner's own late outcome-unknown mark (it expects its claim) changes nothing either.
    let late = Transition::unknown(owner(1), unknown(NOW), &lifetimes());
    assert_eq!(write(&mut e, &s, &late, NOW, None), TransitionReply::Refused);
}

#[test]
fn an_operators_transition_is_refused_unbuilt_when_it_does_not_fit_the_value_read() {
    let s = skey(1);
    let mut e = Etcd::default();
    claim(&mut e, &s, owner(1), NOW).unwrap();
    let (_, fence) = operator_read(&mut e, &s, NOW);
    let fence = fence.unwrap();
    // A claim whose lock is live (judged 1 s behind): admin refuses, and so would the builder.
    assert!(crate::admin::plan(&crate::admin::Settle::Forget, &fence.value, judged_now(NOW), 0).is_err());
    let mut forget = Transition::release(owner(1));
    forget.require_stale = true;
    assert!(operator_transition_request(&forget, &s, &seal(), LEASE, NOW, &fence).is_err(), "lock live");
    // Stale by the judged clock only once the tolerance has passed too.
    let lock = fence.value.lock_expires_at_ms;
    assert!(operator_transition_request(&forget, &s, &seal(), LEASE, lock, &fence).is_err());
    assert!(operator_transition_request(&forget, &s, &seal(), LEASE, lock + CLOCK_SKEW_TOLERANCE_MS, &fence).is_ok());
    // Another owner, another phase, a write without a lease, a write where absent: never built.
    let other = Transition { expected_owner: owner(2), ..forget.clone() };
    assert!(operator_transition_request(&other, &s, &seal(), LEASE, lock + 5_000, &fence).is_err());
    let done = Transition { expected_phases: "D", ..forget.clone() };
    assert!(operator_transition_request(&done, &s, &seal(), LEASE, lock + 5_000, &fence).is_err());
    let complete = Transition {
        expected_phases: "P",
        require_stale: true,
        where_absent: WhereAbsent::Refuse,
        ..Transition::complete(owner(1), completed(NOW), &lifetimes())
    };
    assert!(operator_transition_request(&complete, &s, &seal(), 0, lock + 5_000, &fence).is_err(), "no lease");
    assert!(operator_transition_request(&complete, &s, &seal(), LEASE, lock + 5_000, &fence).is_ok());
    let absent = Transition { where_absent: WhereAbsent::Write, ..complete.clone() };
    assert!(operator_transition_request(&absent, &s, &seal(), LEASE, lock + 5_000, &fence).is_err());
    let tomb = Transition { tombstone: true, ..forget.clone() };
    assert!(operator_transition_request(&tomb, &s, &seal(), LEASE, lock + 5_000, &fence).is_err());
}

#[test]
fn an_operators_lease_outlives_the_record_it_carries() {
    assert_eq!(operator_lease_ttl_seconds(86_400_000), 86_400 + LEASE_MARGIN_MS / 1000);
    assert_eq!(operator_lease_ttl_seconds(1), 1 + LEASE_MARGIN_MS / 1000);
    assert!(operator_lease_ttl_seconds(u64::MAX) > 0);
}

fn page_answer(keys: &[&[u8]], more: bool) -> Vec<u8> {
    let kvs: Vec<Value> = keys
        .iter()
        .map(|k| json!({"key": b64(k), "create_revision": "2", "mod_revision": "3", "version": "1"}))
        .collect();
    let mut a = json!({"header": {"revision": "9"}, "kvs": kvs, "count": keys.len().to_string()});
    if more {
        a["more"] = json!(true);
    }
    a.to_string().into_bytes()
}

#[test]
fn a_list_page_asks_for_key_names_only_bounded_and_within_the_prefix() {
    let req = list_page_request(None, 100);
    assert_eq!((req.method, req.path.as_str()), ("POST", "/v3/kv/range"));
    let v: Value = serde_json::from_slice(&req.body).unwrap();
    assert_eq!(unb64(v["key"].as_str().unwrap()).unwrap(), KEY_PREFIX.as_bytes());
    assert_eq!(unb64(v["range_end"].as_str().unwrap()).unwrap(), b"idemgate/v10");
    assert_eq!((v["limit"].as_str(), v["keys_only"].as_bool()), (Some("100"), Some(true)));
    let v: Value = serde_json::from_slice(&list_page_request(Some(b"idemgate/v1/ab\0"), 0).body).unwrap();
    assert_eq!(v["limit"], "1", "never 0, which etcd reads as no limit");
    assert_eq!(unb64(v["key"].as_str().unwrap()).unwrap(), b"idemgate/v1/ab\0");
    let v: Value = serde_json::from_slice(&list_page_request(None, usize::MAX).body).unwrap();
    assert_eq!(v["limit"], LIST_PAGE_MAX.to_string());
}

#[test]
fn a_list_page_keeps_value_keys_and_skips_owner_marks_and_tombstones() {
    let (a, b) = (skey(0xab), skey(0xcd));
    let (ka, kb) = (etcd_key(&a), etcd_key(&b));
    let (oa, ta) = (owner_key(&a), tombstone_key(&a, &owner(1)));
    let body = page_answer(&[ka.as_bytes(), oa.as_bytes(), ta.as_bytes(), kb.as_bytes()], true);
    let page = parse_list_page(Some(200), &body, None, 4).unwrap();
    assert_eq!(page.keys, vec![a, b]);
    let mut next = kb.as_bytes().to_vec();
    next.push(0);
    assert_eq!(page.next.as_deref(), Some(next.as_slice()));
    // The last page; a page of marks only moves on all the same.
    let last = parse_list_page(Some(200), &page_answer(&[owner_key(&b).as_bytes()], false), Some(&next), 4).unwrap();
    assert_eq!(last, ListPage { keys: vec![], next: None });
    let marks = parse_list_page(Some(200), &page_answer(&[oa.as_bytes()], true), None, 4).unwrap();
    assert!(marks.keys.is_empty() && marks.next.is_some());
    // Uppercase hex or a short name is not a value key idemgate writes: skipped.
    let odd = format!("{KEY_PREFIX}{}", a.hex().to_ascii_uppercase());
    let page = parse_list_page(Some(200), &page_answer(&[odd.as_bytes(), b"idemgate/v1/ab"], false), None, 4);
    assert_eq!(page.unwrap().keys, vec![]);
    assert_eq!(parse_list_page(Some(200), br#"{"header":{"revision":"9"}}"#, None, 4).unwrap().next, None);
}

#[test]
fn a_list_page_that_could_loop_or_grow_is_refused() {
    let (ka, kb) = (etcd_key(&skey(1)), etcd_key(&skey(2)));
    let p = |body: &[u8], start: Option<&[u8]>, n| parse_list_page(Some(200), body, start, n);
    let garbled = |r: Result<ListPage, StoreError>| matches!(r, Err(StoreError::Garbled(_)));
    assert!(garbled(p(&page_answer(&[ka.as_bytes(), kb.as_bytes()], false), None, 1)), "more than asked");
    assert!(garbled(p(&page_answer(&[kb.as_bytes(), ka.as_bytes()], false), None, 4)), "out of order");
    assert!(garbled(p(&page_answer(&[ka.as_bytes(), ka.as_bytes()], false), None, 4)), "a key twice");
    assert!(garbled(p(&page_answer(&[ka.as_bytes()], false), Some(kb.as_bytes()), 4)), "before the start");
    assert!(garbled(p(&page_answer(&[], true), None, 4)), "more after nothing");
    assert!(garbled(p(&page_answer(&[b"other/key"], false), None, 4)), "outside the prefix");
    assert!(garbled(p(br#"{"kvs":[]}"#, None, 4)), "no revision");
    assert!(matches!(p(b"{}", None, 4), Err(StoreError::Garbled(_))));
    assert_eq!(parse_list_page(Some(401), b"{}", None, 4), Err(StoreError::Http(401)));
    assert_eq!(parse_list_page(None, b"", None, 4), Err(StoreError::NoAnswer));
    // A list longer than any page is refused as it arrives.
    let mut huge = br#"{"header":{"revision":"1"},"kvs":["#.to_vec();
    for _ in 0..LIST_PAGE_MAX + 1 {
        huge.extend_from_slice(b"{},");
    }
    huge.extend_from_slice(b"{}]}");
    assert!(garbled(p(&huge, None, LIST_PAGE_MAX)));
}

#[test]
fn requests_are_json_whatever_their_strings_hold() {
    // The request writer escapes what a JSON string must: a password with quotes, backslashes
    // and control characters reaches etcd intact.
    let password = "p\"w\\d\n\u{1}é:x";
    let r = authenticate_request(&format!("idemgate:{password}")).unwrap();
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["password"].as_str(), Some(password));
    // Every builder's body parses as JSON.
    let s = skey(3);
    let bodies = [
        claim_request(&s, &owner(1), &in_progress(owner(1), 5), &lifetimes(), &seal(), 7, 5).body,
        read_request(&s).body,
        lease_grant_request(90).body,
        list_page_request(None, 10).body,
        transition_request(&Transition::complete(owner(1), completed(6), &lifetimes()), &s, &seal(), 7, 6, None)
            .unwrap()
            .body,
    ];
    for b in bodies {
        assert!(serde_json::from_slice::<Value>(&b).is_ok(), "{}", String::from_utf8_lossy(&b));
    }
}

/// The listing's batched read: one transaction of ranges, answered in order, each judged as a
/// single read is; an answer with another number of reads, or a read of another key, is garbled.
#[test]
fn many_values_are_read_in_one_transaction_each_judged_as_one_read() {
    let keys = [skey(1), skey(2), skey(3)];
    let req = read_many_request(&keys);
    let body: Value = serde_json::from_slice(&req.body).unwrap();
    assert_eq!(body["success"].as_array().map(Vec::len), Some(3));
    assert_eq!(body["success"][1]["request_range"]["key"], b64(etcd_key(&skey(2)).as_bytes()));
    assert_eq!(body["success"][1]["request_range"]["serializable"], json!(true));
    let v = StoredValue {
        phase: Stage::Unknown,
        owner: owner(4),
        lock_expires_at_ms: 0,
        record: Record {
            fingerprint: Fingerprint([5; 32]),
            created_at_ms: NOW,
            expires_at_ms: NOW + 60_000,
            creator: creator(),
            state: State::OutcomeUnknown { reason: UnknownReason::UpstreamReset },
        },
    };
    let kv = |k: &StorageKey, value: &[u8]| {
        json!({"response_range": {"header": {"revision": "9"}, "kvs": [
            {"key": b64(etcd_key(k).as_bytes()), "value": b64(value), "mod_revision": "8"}]}})
    };
    let absent = json!({"response_range": {"header": {"revision": "9"}}});
    let answer =
        |ops: Vec<Value>| json!({"header": {"revision": "9"}, "succeeded": true, "responses": ops}).to_string();
    let good = answer(vec![
        kv(&skey(1), &encode_value(&v, NOW + 60_000, &skey(1), &seal())),
        absent.clone(),
        kv(&skey(3), b"junk"),
    ]);
    let reads = parse_read_many(Some(200), good.as_bytes(), &keys, &seal(), NOW).unwrap();
    assert!(
        matches!(reads.as_slice(), [ReadReply::Found(_), ReadReply::Absent, ReadReply::Unreadable(_)]),
        "{reads:?}"
    );
    let short = answer(vec![absent.clone()]);
    assert!(parse_read_many(Some(200), short.as_bytes(), &keys, &seal(), NOW).is_err());
    let swapped = answer(vec![absent.clone(), absent.clone(), kv(&skey(1), b"x")]);
    assert!(parse_read_many(Some(200), swapped.as_bytes(), &keys, &seal(), NOW).is_err());
    let many: Vec<StorageKey> = (0..100).map(|i| skey(i as u8)).collect();
    let req: Value = serde_json::from_slice(&read_many_request(&many).body).unwrap();
    assert_eq!(req["success"].as_array().map(Vec::len), Some(READ_MANY_MAX));
}

// ---------------------------------------------------------------------------------------------
// A key's own tombstone (`tombstone_seconds`, issue 40 item 6): small, a key of its own.

fn with_tombstones() -> Lifetimes {
    Lifetimes { tombstone_ms: 120_000, ..lifetimes() }
}

/// A store where owner 1 claimed `s` at `NOW` under `l`.
fn claimed_on(s: &StorageKey, l: &Lifetimes) -> Etcd {
    let mut e = Etcd::default();
    claim_on(&mut e, s, owner(1), NOW, l).unwrap();
    e
}

/// A store where owner 1 claimed `s` at `NOW` and completed it (`completed(NOW)`) under `l`.
fn completed_on(s: &StorageKey, l: &Lifetimes) -> Etcd {
    let mut e = claimed_on(s, l);
    write(&mut e, s, &Transition::complete(owner(1), completed(NOW), l), NOW, None);
    e
}

fn claim_on(
    e: &mut Etcd,
    s: &StorageKey,
    o: OwnerToken,
    now: u64,
    l: &Lifetimes,
) -> Result<(ClaimReply, Option<Fence>), StoreError> {
    let req = claim_request(s, &o, &in_progress(o, now), l, &seal(), LEASE, now);
    let body = e.run(&req);
    parse_claim_reply(Some(200), &body, &o, s, &seal(), now)
}

/// What `claim_on` answered: the key's tombstone (no record), and whether it is free.
fn tombstone_answer(reply: &ClaimReply, now: u64) -> Option<bool> {
    match reply {
        ClaimReply::Exists { value, expires_at_ms, .. } if value.record.is_key_tombstone() => {
            Some(value.summary(*expires_at_ms).is_free(judged_now(now)))
        }
        _ => None,
    }
}

#[test]
fn a_completion_keeps_its_record_for_ttl_and_a_small_sealed_tombstone_key_for_ttl_plus_tombstone() {
    let l = with_tombstones();
    let s = skey(1);
    let mut e = claimed_on(&s, &l);
    let t = Transition::complete(owner(1), completed(NOW), &l);
    let req = transition_request(&t, &s, &seal(), LEASE, NOW, None).unwrap();
    let sent: Value = serde_json::from_slice(&req.body).unwrap();
    assert_eq!(sent["success"].as_array().unwrap().len(), 4, "record, mark, echo, tombstone: one txn");
    assert_eq!(parse_transition_reply(Some(200), &e.run(&req), None), Ok(TransitionReply::Changed));
    // The record lives `ttl`, no longer: what a 0.2.0 proxy reads of it is a record expiring then.
    assert_eq!(e.value(&s).unwrap().1, NOW + l.ttl_ms);
    // The tombstone: its own key (not a release tombstone's), 92 bytes, the fingerprint only,
    // sealed for that key, expiring `ttl + tombstone` from the completion.
    let tomb = e.kv.get(key_tombstone_key(&s).as_bytes()).unwrap().0.clone();
    assert!(key_tombstone_key(&s).ends_with("/t"));
    assert_eq!(tomb.len(), 92);
    let (v, expires) = open_key_tombstone(&tomb, &s, &seal()).unwrap();
    assert_eq!((v.record.fingerprint, expires), (Fingerprint([1; 32]), NOW + l.ttl_ms + l.tombstone_ms));
    assert!(open_key_tombstone(&tomb, &skey(2), &seal()).is_err(), "bound to its key");
    assert!(open_value(&tomb, &s, &seal()).is_err() && crate::store::open_tombstone(&tomb, &s, &seal()).is_err());
    // The route without tombstones writes none.
    let s2 = skey(2);
    let e2 = completed_on(&s2, &lifetimes());
    assert!(!e2.kv.contains_key(key_tombstone_key(&s2).as_bytes()));
    assert_eq!(e2.value(&s2).unwrap().1, NOW + lifetimes().ttl_ms);
}

#[test]
fn past_its_record_a_key_answers_its_tombstone_claims_nothing_and_is_freed_only_past_it() {
    let l = with_tombstones();
    let s = skey(1);
    let mut e = completed_on(&s, &l);
    let ttl_end = NOW + l.ttl_ms + CLOCK_SKEW_TOLERANCE_MS;
    let tomb_end = NOW + l.ttl_ms + l.tombstone_ms + CLOCK_SKEW_TOLERANCE_MS;
    // Within ttl: the record is replayed.
    let (r, _) = claim_on(&mut e, &s, owner(2), ttl_end - 1, &l).unwrap();
    assert!(
        matches!(r, ClaimReply::Exists { ref value, .. } if value.record.fingerprint == Fingerprint([1; 32]) && !value.record.is_key_tombstone())
    );
    // Past ttl, its record still held (its lease not over) or dropped by etcd: the tombstone,
    // not free, no fence: nothing can be claimed on it.
    for dropped in [false, true] {
        if dropped {
            e.kv.remove(etcd_key(&s).as_bytes());
            e.kv.remove(owner_key(&s).as_bytes());
        }
        for now in [ttl_end, tomb_end - 1] {
            let (r, fence) = claim_on(&mut e, &s, owner(2), now, &l).unwrap();
            assert_eq!(tombstone_answer(&r, now), Some(false), "dropped: {dropped}, at {now}");
            assert!(fence.is_none());
        }
        assert_eq!(e.value(&s).is_some(), !dropped, "nothing was claimed");
    }
    // A route without tombstones ignores it, as Redis's claim script does.
    let mut other = Etcd { kv: e.kv.clone(), revision: e.revision };
    assert!(matches!(claim(&mut other, &s, owner(2), ttl_end).unwrap().0, ClaimReply::Claimed { .. }));
    // Past ttl + tombstone (judged) it is free: a claim decided on it compares it unchanged and
    // the value still absent, and deletes it; the same decision taken twice claims once.
    let (r, fence) = claim_on(&mut e, &s, owner(2), tomb_end, &l).unwrap();
    assert_eq!(tombstone_answer(&r, tomb_end), Some(true));
    let fence = fence.unwrap();
    assert!(fence.tombstone);
    let take = |o: u8| Transition::take_over(OwnerToken([0; 16]), owner(o), in_progress(owner(o), tomb_end), true, &l);
    assert_eq!(write(&mut e, &s, &take(2), tomb_end, Some(&fence)), TransitionReply::Changed);
    assert_eq!(write(&mut e, &s, &take(3), tomb_end, Some(&fence)), TransitionReply::Refused);
    assert_eq!(e.value(&s).unwrap().0.owner, owner(2));
    assert!(!e.kv.contains_key(key_tombstone_key(&s).as_bytes()), "the spent tombstone went with the claim");
    // A fence on a tombstone is refused before it is sent while the tombstone is live.
    completed_on(&s, &l);
    let live = Fence { expires_at_ms: NOW + l.ttl_ms + l.tombstone_ms, ..fence };
    assert!(transition_request(&take(2), &s, &seal(), LEASE, ttl_end, Some(&live)).is_err());
}

#[test]
fn a_completion_written_where_its_claim_was_lost_or_without_its_body_writes_the_tombstone_too() {
    let l = with_tombstones();
    let s = skey(1);
    let mut e = claimed_on(&s, &l);
    e.flush();
    let t = Transition::complete(owner(1), completed(NOW), &l);
    assert_eq!(write(&mut e, &s, &t, NOW, None), TransitionReply::ClaimGoneRewritten);
    assert_eq!(e.value(&s).unwrap().1, NOW + l.ttl_ms);
    let tomb = e.kv.get(key_tombstone_key(&s).as_bytes()).unwrap().0.clone();
    assert_eq!(open_key_tombstone(&tomb, &s, &seal()).unwrap().1, NOW + l.ttl_ms + l.tombstone_ms);
    // The body-less rewrite of a record etcd refused as too large.
    let s2 = skey(2);
    claim_on(&mut e, &s2, owner(1), NOW, &l).unwrap();
    write(&mut e, &s2, &t.without_body().unwrap(), NOW, None);
    assert!(e.kv.contains_key(key_tombstone_key(&s2).as_bytes()));
}

#[test]
fn an_operators_forget_deletes_the_tombstone_with_the_record_and_a_proxys_release_keeps_it() {
    let l = with_tombstones();
    let s = skey(1);
    let mut e = completed_on(&s, &l);
    let (_, fence) = operator_read(&mut e, &s, NOW);
    let value = fence.as_ref().unwrap().value.clone();
    let forget = crate::admin::plan(&crate::admin::Settle::Forget, &value, NOW, 1_000).unwrap();
    assert_eq!(operator_write(&mut e, &s, &forget, NOW, &fence.unwrap()), TransitionReply::Changed);
    assert!(e.kv.is_empty(), "record, owner mark and tombstone gone: {:?}", e.kv.keys());
    // A proxy's release (of a claim made over a spent tombstone) keeps what is there.
    let s2 = skey(2);
    e.kv.insert(key_tombstone_key(&s2).into_bytes(), (b"kept".to_vec(), 1, 1));
    claim(&mut e, &s2, owner(1), NOW).unwrap();
    write(&mut e, &s2, &Transition::release(owner(1)), NOW, None);
    assert!(e.kv.contains_key(key_tombstone_key(&s2).as_bytes()) && e.value(&s2).is_none());
}

#[test]
fn the_listing_skips_a_keys_tombstone_as_it_skips_owner_marks() {
    let s = skey(0xab);
    let keys = [etcd_key(&s), owner_key(&s), key_tombstone_key(&s)];
    let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    let page = parse_list_page(Some(200), &page_answer(&keys, false), None, LIST_PAGE_MAX).unwrap();
    assert_eq!(page.keys, vec![s]);
}

#[test]
fn a_records_lease_covers_its_ttl_and_a_tombstones_lease_ttl_plus_tombstone() {
    let c = Config::parse(br#"{"scope": {"global": true}, "ttl_seconds": 100, "lock_ttl_seconds": 10, "unknown_outcome_seconds": 50, "tombstone_seconds": 1000, "store": {"kind": "etcd", "cluster": "e"}}"#).unwrap();
    // The record lives ttl (100 s), its key's tombstone ttl + tombstone (1100 s).
    assert_eq!((longest_life_ms(&c), longest_tombstone_life_ms(&c)), (100_000, 1_100_000));
    assert_eq!(lease_ttl_seconds(&c), 60 + 100 + 30);
    assert_eq!(tombstone_lease_ttl_seconds(&c), Some(60 + 1100 + 30));
    // Without tombstones (or where the records' lease covers them) there is no second lease.
    let none =
        Config::parse(br#"{"scope": {"global": true}, "ttl_seconds": 100, "store": {"kind": "etcd", "cluster": "e"}}"#)
            .unwrap();
    assert_eq!(tombstone_lease_ttl_seconds(&none), None);
    // The completion puts its record under the records' lease, its tombstone under its own.
    let l = with_tombstones();
    let t = Transition::complete(owner(1), completed(NOW), &l);
    let leased = Leased { record: 7, tombstone: 8 };
    let req = transition_request_leased(&t, &skey(1), &seal(), leased, NOW, None).unwrap();
    let sent: Value = serde_json::from_slice(&req.body).unwrap();
    let puts: Vec<(String, String)> = sent["success"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("request_put"))
        .map(|p| {
            (
                String::from_utf8(unb64(p["key"].as_str().unwrap()).unwrap()).unwrap(),
                p["lease"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let k = etcd_key(&skey(1));
    assert_eq!(puts, vec![(k.clone(), "7".into()), (format!("{k}/o"), "7".into()), (format!("{k}/t"), "8".into())]);
    let again = where_absent_request_leased(&t, &skey(1), &seal(), leased, NOW).unwrap();
    assert!(String::from_utf8(again.body).unwrap().contains(r#""lease":"8""#));
}
