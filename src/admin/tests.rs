use super::*;
use crate::fingerprint::Fingerprint;
use crate::owner::OwnerToken;
use crate::record::{Creator, UnknownReason};
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const NOW: u64 = 1_764_000_000_000;

fn value(phase: Stage, lock_expires_at_ms: u64) -> StoredValue {
    StoredValue {
        phase,
        owner: OwnerToken([0xab; 16]),
        lock_expires_at_ms,
        record: Record {
            fingerprint: Fingerprint([5; 32]),
            created_at_ms: NOW - 5_000,
            expires_at_ms: NOW + 86_400_000,
            creator: Creator { request_id: "req-1".into(), log_values: vec![("x-agent".into(), "a1".into())] },
            state: State::Forwarded { owner: OwnerToken([0xab; 16]), lock_expires_at_ms },
        },
    }
}

fn alice(key: &str) -> KeyRequest {
    KeyRequest {
        namespace: "idemgate".into(),
        scope_names: vec!["authorization".into()],
        lines: vec![("Authorization".into(), " Bearer alice".into())],
        authority: Some("api".into()),
        key: key.into(),
        key_max_length: 255,
        ..KeyRequest::default()
    }
}

#[test]
fn the_storage_key_of_a_request_is_the_filters_pinned_vector() {
    // scope::tests::scope_and_storage_key_layouts_are_pinned, computed with printf | sha256sum.
    let k = storage_key_for(&alice("k1")).unwrap();
    assert_eq!(k.storage_key.hex(), "25ac414820301995f186e203d357b20a9fd56c30da2524881ff24a53d1733af1");
    assert_eq!(k.refused, None);
    // The quoted form of a key is the same key, as for the filter.
    assert_eq!(storage_key_for(&alice("\"k1\"")).unwrap().storage_key, k.storage_key);
    assert!(storage_key_for(&alice("\"k1")).unwrap_err().starts_with("key:"));
    // The authority is normalised as the filter does: ports 80 and 443 go, whatever the scheme.
    let spelled = KeyRequest { authority: Some("API.:443".into()), scheme: "https".into(), ..alice("k1") };
    assert_eq!(storage_key_for(&spelled).unwrap().storage_key, k.storage_key);
    let no_scheme = KeyRequest { authority: Some("api:443".into()), ..alice("k1") };
    assert_eq!(storage_key_for(&no_scheme).unwrap().storage_key, k.storage_key);
    let other_port = KeyRequest { authority: Some("api:8443".into()), ..alice("k1") };
    assert_ne!(storage_key_for(&other_port).unwrap().storage_key, k.storage_key);
}

#[test]
fn a_caller_the_filter_refuses_is_said_so() {
    let anonymous = KeyRequest { lines: vec![], ..alice("k1") };
    assert!(storage_key_for(&anonymous).unwrap().refused.unwrap().contains("scope-missing"));
    let shared = KeyRequest { anonymous_shared: true, ..anonymous };
    assert_eq!(storage_key_for(&shared).unwrap().refused, None);
}

#[test]
fn storage_keys_are_read_as_hex_or_as_the_redis_key() {
    let hex = "25ac414820301995f186e203d357b20a9fd56c30da2524881ff24a53d1733af1";
    let k = parse_storage_key(hex).unwrap();
    assert_eq!(k.hex(), hex);
    assert_eq!(parse_storage_key(&hex.to_ascii_uppercase()).unwrap(), k);
    assert_eq!(parse_storage_key(&format!("idemgate:v1:{hex}")).unwrap(), k);
    for bad in ["", "25ac41482030", &hex[1..], &format!("{hex}0"), &hex.replace('a', "g")] {
        assert!(parse_storage_key(bad).is_err(), "{bad}");
    }
}

#[test]
fn value_headers_are_read_without_the_record() {
    for (phase, state) in
        [(Stage::Forwarded, Stage::Forwarded), (Stage::Completed, Stage::Completed), (Stage::Unknown, Stage::Unknown)]
    {
        let seal = crate::seal::Seal::new(Some("admin-tests-record-key-0123456789abcdef"), None).unwrap();
        let bytes = value(phase, NOW + 1).encode(&StorageKey([7; 32]), &seal);
        assert_eq!(
            parse_header(&bytes[..VALUE_HEADER_LEN]),
            Header::Value { state, owner: "ab".repeat(16), lock_expires_at_ms: NOW + 1 }
        );
    }
    assert_eq!(parse_header(format!("IGS1R{}", "ab".repeat(16)).as_bytes()), Header::Tombstone);
    assert_eq!(parse_header(b"IGS1X"), Header::Unreadable);
    assert_eq!(parse_header(&[b'x'; 52]), Header::Unreadable);
}

#[test]
fn a_live_claim_is_never_settled() {
    let v = value(Stage::Forwarded, NOW + 30_000);
    let complete = Settle::Complete { response: operator_response(201, &[], vec![]).unwrap(), ttl_ms: 1 };
    for action in [Settle::Release, Settle::Forget, complete] {
        assert_eq!(plan(&action, &v, NOW, W), Err(Refusal::InFlight { lock_expires_in_ms: 30_000 }));
    }
}

/// The proxies' write window in these tests (`store::write_window_ms` of a 500 ms store timeout).
const W: u64 = 64_200;

#[test]
fn the_write_window_covers_a_write_and_its_fallback_at_the_store_timeout() {
    // 7 attempts of 500 ms and 6.2 s of backoff, 1 s of slack, for each of 6 schedules in a row.
    assert_eq!(crate::store::write_window_ms(500), W);
    assert_eq!(crate::store::write_window_ms(u64::MAX), u64::MAX);
}

/// A claim whose lock has just expired may still be completed by its proxy (its completion
/// retried while the store link was down): settling it then would leave that proxy's response
/// and the operator's. Refused until the write window after the lock has passed, for every action.
#[test]
fn a_claim_is_not_settled_while_its_proxys_writes_may_still_land() {
    let complete = Settle::Complete { response: operator_response(201, &[], vec![]).unwrap(), ttl_ms: 1 };
    let just_expired = value(Stage::Forwarded, NOW - 3_100);
    for action in [Settle::Release, Settle::Forget, complete.clone()] {
        assert_eq!(
            plan(&action, &just_expired, NOW, W),
            Err(Refusal::WritesMayLand { lock_expired_ms_ago: 3_100, wait_ms: W - 3_100 })
        );
        assert!(plan(&action, &value(Stage::Forwarded, NOW - W + 1), NOW, W).is_err());
        assert!(plan(&action, &value(Stage::Forwarded, NOW - W), NOW, W).is_ok());
    }
    // Outcome-unknown: the owner's completion needs a forwarded claim, so none can land on it.
    assert!(plan(&complete, &value(Stage::Unknown, NOW), NOW, W).is_ok());
}

#[test]
fn release_is_owner_and_phase_checked_and_a_stale_claim_is_rechecked_by_the_store() {
    let unknown = plan(&Settle::Release, &value(Stage::Unknown, 0), NOW, W).unwrap();
    assert_eq!(
        (unknown.expected_owner, unknown.expected_phases, unknown.require_stale),
        (OwnerToken([0xab; 16]), "U", false)
    );
    assert_eq!((unknown.new_phase, unknown.tombstone), (None, false));
    let stale = plan(&Settle::Release, &value(Stage::Forwarded, NOW - W), NOW, W).unwrap();
    assert_eq!((stale.expected_phases, stale.require_stale, stale.new_phase), ("P", true, None));
}

#[test]
fn a_completed_key_is_only_forgotten() {
    let done = value(Stage::Completed, 0);
    assert_eq!(plan(&Settle::Release, &done, NOW, W), Err(Refusal::Completed));
    let r = operator_response(201, &[], b"x".to_vec()).unwrap();
    assert_eq!(plan(&Settle::Complete { response: r, ttl_ms: 1 }, &done, NOW, W), Err(Refusal::Completed));
    let forget = plan(&Settle::Forget, &done, NOW, W).unwrap();
    assert_eq!((forget.expected_phases, forget.require_stale, forget.new_phase), ("D", false, None));
    // Issue 40, item 6: `forget` deletes the key's tombstone with its record (Redis), so its next
    // retry executes as `FORGOTTEN` says; a release (of a claim) keeps it.
    assert!(forget.forget_tombstone);
    let claim = value(Stage::Unknown, 0);
    assert!(!plan(&Settle::Release, &claim, NOW, W).unwrap().forget_tombstone);
}

#[test]
fn completion_keeps_the_fingerprint_and_creator_and_stores_the_operators_response() {
    let v = value(Stage::Unknown, 0);
    let headers = vec!["Content-Type: application/json".to_string()];
    let response = operator_response(201, &headers, b"{\"id\":\"ch_1\"}".to_vec()).unwrap();
    let t = plan(&Settle::Complete { response: response.clone(), ttl_ms: 60_000 }, &v, NOW, W).unwrap();
    assert_eq!((t.expected_phases, t.new_phase), ("U", Some(Stage::Completed)));
    let rec = t.record.unwrap();
    assert_eq!(rec.fingerprint, v.record.fingerprint);
    assert_eq!(rec.creator, v.record.creator);
    assert_eq!(rec.expires_at_ms, NOW + 60_000);
    assert_eq!(rec.state, State::Completed(response.clone()));
    assert_eq!(response.headers, vec![("content-type".to_string(), b"application/json".to_vec())]);
}

#[test]
fn operator_responses_refuse_what_the_filter_never_stores() {
    assert!(operator_response(99, &[], vec![]).is_err());
    assert!(operator_response(201, &["transfer-encoding: chunked".into()], vec![]).is_err());
    assert!(operator_response(201, &["no colon".into()], vec![]).is_err());
    assert!(operator_response(201, &["bad name: v".into()], vec![]).is_err());
}

#[test]
fn the_report_names_state_times_creator_and_response_size() {
    let mut v = value(Stage::Completed, 0);
    v.record.state = State::Completed(operator_response(201, &["location: /c/1".into()], vec![0; 17]).unwrap());
    let r = report(&StorageKey([7; 32]), &v, NOW);
    assert_eq!(r["state"], "completed");
    assert_eq!(r["status"], 201);
    assert_eq!(r["body_bytes"], 17);
    assert_eq!(r["creator"]["request_id"], "req-1");
    assert_eq!(r["creator"]["logged_headers"]["x-agent"], "a1");
    assert_eq!(r["fingerprint"], "05".repeat(32));
    assert_eq!(r["response_headers"][0][1], "/c/1");
    assert_eq!(r["tombstone"], false);
    // Past its own expiry, still held by the store: its key's tombstone (issue 40, item 6).
    v.record.expires_at_ms = NOW;
    assert_eq!(report(&StorageKey([7; 32]), &v, NOW)["tombstone"], true);
    let live = report(&StorageKey([7; 32]), &value(Stage::Forwarded, NOW + 1), NOW);
    assert_eq!((live["state"].as_str(), live["lock"].as_str()), (Some("in-flight"), Some("live")));
    let mut u = value(Stage::Unknown, 0);
    u.record.state = State::OutcomeUnknown { reason: UnknownReason::UpstreamTimeout };
    assert_eq!(report(&StorageKey([7; 32]), &u, NOW)["reason"], "upstream_timeout");
}

#[test]
fn redis_time_is_read_in_ms() {
    assert_eq!(time_ms(&[b"1764000000".to_vec(), b"123456".to_vec()]), Some(1_764_000_000_123));
    assert_eq!(time_ms(&[b"x".to_vec()]), None);
}

/// `forget` of a value this build cannot read: judged by what is plain text in it, as a readable
/// value is (a live claim and a claim whose proxy may still write are refused), and refused
/// without `force` where nothing says whether it is a live claim.
#[test]
fn an_unreadable_value_is_forgotten_as_far_as_its_plain_text_allows() {
    let seal = || crate::seal::Seal::new(Some("admin-unit-tests-record-key-0123456789abcdef"), None).unwrap();
    let mut v = value(Stage::Forwarded, NOW + 1_000);
    let redis = |v: &StoredValue| Unsealed::of_redis_value(&v.encode(&StorageKey([7; 32]), &seal()));
    let live = redis(&v);
    assert_eq!((live.phase, live.lock_expires_at_ms), (Some(Stage::Forwarded), Some(NOW + 1_000)));
    assert!(
        matches!(plan_raw_forget(&live, NOW, 0, true), Err(Refusal::InFlight { .. })),
        "force never frees a live lock"
    );
    v.lock_expires_at_ms = NOW - 1_000;
    assert!(matches!(plan_raw_forget(&redis(&v), NOW, 5_000, false), Err(Refusal::WritesMayLand { .. })));
    assert_eq!(plan_raw_forget(&redis(&v), NOW, 500, false), Ok(()));
    let unknown = Unsealed::of_redis_value(&value(Stage::Unknown, 0).encode(&StorageKey([7; 32]), &seal()));
    assert_eq!(plan_raw_forget(&unknown, NOW, 60_000, false), Ok(()));
    // Garbage: nothing readable; an etcd claim: its lock is sealed.
    let garbage = Unsealed::of_redis_value(b"\x00garbage");
    assert_eq!(garbage, Unsealed::default());
    assert!(matches!(plan_raw_forget(&garbage, NOW, 0, false), Err(Refusal::Unjudged { .. })));
    assert_eq!(plan_raw_forget(&garbage, NOW, 0, true), Ok(()));
    let mark = Unsealed::of_etcd_mark(&crate::etcd::owner_mark(Stage::Forwarded, &OwnerToken([0xab; 16])));
    assert_eq!((mark.phase, mark.owner.as_deref()), (Some(Stage::Forwarded), Some("ab".repeat(16).as_str())));
    assert!(matches!(plan_raw_forget(&mark, NOW, 0, false), Err(Refusal::Unjudged { .. })));
    assert_eq!(plan_raw_forget(&mark, NOW, 0, true), Ok(()));
    let done = Unsealed::of_etcd_mark(&crate::etcd::owner_mark(Stage::Completed, &OwnerToken([1; 16])));
    assert_eq!(plan_raw_forget(&done, NOW, 0, false), Ok(()));
    assert_eq!(Unsealed::of_etcd_mark(b"Zxyz"), Unsealed::default());
    let r = raw_report(&StorageKey([7; 32]), "stored value: unauthentic", b"IGS1Uxx", &unknown, NOW);
    assert_eq!(
        (r["state"].as_str(), r["raw_bytes"].as_u64(), r["phase"].as_str()),
        (Some("unreadable"), Some(7), Some("outcome-unknown"))
    );
    assert_eq!(r["raw_sha1"].as_str().map(str::len), Some(40));
}
