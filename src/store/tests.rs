use super::*;
use crate::fingerprint::Fingerprint;
use crate::record::{Creator, Lifetimes, Stage, State, StoredResponse, UnknownReason};
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn record() -> Record {
    Record {
        fingerprint: Fingerprint([5; 32]),
        created_at_ms: 1,
        expires_at_ms: 2_000_000_000_000,
        creator: Creator { request_id: "r1".into(), log_values: vec![] },
        state: State::Forwarded { owner: OwnerToken([1; 16]), lock_expires_at_ms: 0 },
    }
}

/// A stored value in `phase`, its record in the matching state (a completed phase holds a
/// completed record).
fn value(phase: Stage) -> StoredValue {
    let mut record = record();
    if phase == Stage::Completed {
        record.state = State::Completed(StoredResponse { status: 201, headers: vec![], body: b"{}".to_vec() });
    }
    StoredValue { phase, owner: OwnerToken([0xab; 16]), lock_expires_at_ms: 1_764_000_060_000, record }
}

/// ttl, lock and outcome-unknown lives, in ms.
fn lives(ttl_ms: u64, lock_ms: u64, unknown_ms: u64) -> Lifetimes {
    Lifetimes { ttl_ms, lock_ms, unknown_ms, tombstone_ms: 0 }
}

/// The owner token of the claims these tests parse answers to.
const OWNER: OwnerToken = OwnerToken([1; 16]);

fn skey() -> StorageKey {
    StorageKey([7; 32])
}

/// The secret the store values of these tests are sealed with.
fn seal() -> Seal {
    Seal::new(Some("store-tests-record-key-0123456789abcdef"), None).unwrap()
}

#[test]
fn stored_values_round_trip_and_hold_the_lock_in_fixed_width_ascii() {
    for p in [Stage::Forwarded, Stage::Completed, Stage::Unknown] {
        let v = value(p);
        let bytes = v.encode(&skey(), &seal());
        assert_eq!(&bytes[..4], b"IGS1");
        assert_eq!(&bytes[37..52], b"001764000060000");
        assert_eq!(StoredValue::open(&bytes, &skey(), &seal()), Ok(v));
    }
}

/// Issue 15, item 2: a value moved to another key (or namespace: the namespace is inside the
/// storage key), forged, truncated, or sealed with another secret is unauthentic; a value sealed
/// with the previous secret is accepted while rotating; a completed phase over a claim's record
/// (a header changed by whoever can write the store) is unreadable, never a replay.
#[test]
fn stored_values_are_bound_to_their_key_and_secret() {
    let v = value(Stage::Completed);
    let at_b = v.encode(&skey(), &seal());
    let other_key = StorageKey([8; 32]);
    assert_eq!(
        StoredValue::open(&at_b, &other_key, &seal()),
        Err(ValueError::Unauthentic(crate::seal::Unsealed::BadTag)),
        "a value transplanted to another key"
    );
    let mut forged = at_b.clone();
    let n = forged.len();
    forged[n - 3] ^= 0x20;
    assert!(StoredValue::open(&forged, &skey(), &seal()).unwrap_err().is_unauthentic(), "one byte of the response");
    let unsealed = [&at_b[..HEADER_LEN], &v.record.encode()[..]].concat();
    assert_eq!(
        StoredValue::open(&unsealed, &skey(), &seal()),
        Err(ValueError::Unauthentic(crate::seal::Unsealed::NotSealed)),
        "a record written without a seal"
    );
    let stranger = Seal::new(Some("another-deployments-record-key-0123456789"), None).unwrap();
    assert!(StoredValue::open(&v.encode(&skey(), &stranger), &skey(), &seal()).unwrap_err().is_unauthentic());
    let rotated =
        Seal::new(Some("the-next-record-key-0123456789abcdef-0001"), Some("store-tests-record-key-0123456789abcdef"))
            .unwrap();
    assert_eq!(StoredValue::open(&at_b, &skey(), &rotated), Ok(v.clone()), "the previous secret, while rotating");
    // The header is Redis's to write (phase, owner, lock): a claim's header turned "completed".
    let mut claim = value(Stage::Forwarded).encode(&skey(), &seal());
    claim[4] = b'D';
    assert!(matches!(StoredValue::open(&claim, &skey(), &seal()), Err(ValueError::Unreadable(_))));
}

#[test]
fn garbled_stored_values_are_errors() {
    let good = value(Stage::Completed).encode(&skey(), &seal());
    for bad in [&b""[..], b"IGS1", b"XXXXPabababababababababababababababab001764000060000"] {
        assert!(matches!(StoredValue::open(bad, &skey(), &seal()), Err(ValueError::Unreadable(_))), "{bad:?}");
    }
    // Cut inside the sealed record: its seal no longer verifies.
    assert!(matches!(StoredValue::open(&good[..60], &skey(), &seal()), Err(ValueError::Unauthentic(_))));
    let mut wrong_phase = good.clone();
    wrong_phase[4] = b'Z';
    assert!(StoredValue::open(&wrong_phase, &skey(), &seal()).is_err());
    let mut bad_lock = good;
    bad_lock[40] = b'x';
    assert!(StoredValue::open(&bad_lock, &skey(), &seal()).is_err());
}

#[test]
fn arguments_are_percent_encoded_so_dots_slashes_and_binary_survive_webdis() {
    assert_eq!(encode_arg(b"a.b/c d"), "a%2Eb%2Fc%20d");
    assert_eq!(encode_arg(&[0, 255, b'Z', b'-', b'_', b'~']), "%00%FFZ-_~");
}

#[test]
fn claim_request_is_one_post_of_an_evalsha_with_raw_output() {
    let r = claim_request(&skey(), &OwnerToken([1; 16]), &record(), &lives(86_400_000, 60_000, 600_000), &seal());
    assert_eq!((r.method, r.path.as_str(), r.by_sha1), ("POST", "/", Some(Script::Claim)));
    let body = String::from_utf8(r.body).unwrap();
    assert!(body.starts_with("EVALSHA/"));
    assert!(body.ends_with(".raw"));
    let parts: Vec<&str> = body.trim_end_matches(".raw").split('/').collect();
    assert_eq!(parts.len(), 10, "EVALSHA sha1 numkeys key tombstone-key owner ttl lock tombstones record");
    assert_eq!(parts[1].as_bytes(), Script::Claim.sha1_hex());
    assert_eq!(parts[2], "2");
    assert_eq!(parts[3], format!("idemgate%3Av1%3A{}", "07".repeat(32)));
    let tomb = format!("idemgate%3Av1%3At%3A%7Bidemgate%3Av1%3A{}%7D", "07".repeat(32));
    assert_eq!(parts[4], tomb, "the key's tombstone, its hash tag the record's key (one Redis Cluster slot)");
    assert_eq!(parts[5], "01".repeat(16));
    assert_eq!((parts[6], parts[7]), ("660000", "60000"), "PX: a forwarded claim's life (lock, then outcome unknown)");
    assert_eq!(parts[8], "0", "a route without tombstones never reads one");
    assert!(!body[..body.len() - 4].contains('.'), "no unencoded dot before the format suffix");
}

/// A forwarded claim's `PX` is its lock, then `unknown_outcome_seconds` (issue 13, item 7): the
/// key cannot vanish from Redis while the lock is live, nor once the claim is outcome-unknown
/// before that state's life is over, whatever `ttl_seconds` says. Every transition's `PX` comes
/// from the one table (`Lifetimes::life_ms`), as the local tier's expiries do.
#[test]
fn every_transitions_px_comes_from_the_one_lifetime_table() {
    let l = lives(4_000, 2_000, 600_000);
    let body = String::from_utf8(claim_request(&skey(), &OwnerToken([1; 16]), &record(), &l, &seal()).body).unwrap();
    let px = body.trim_end_matches(".raw").split('/').nth(6).unwrap().to_string();
    assert_eq!(px, "602000");
    let (a, b) = (OwnerToken([1; 16]), OwnerToken([2; 16]));
    let t = Transition::take_over(a, b, record(), false, &l);
    assert_eq!((t.ttl_ms, t.lock_ms), (602_000, Some(2_000)));
    assert_eq!(Transition::complete(a, record(), &l).ttl_ms, 4_000, "completed: ttl from completion");
    assert_eq!(Transition::unknown(a, gone(), &l).ttl_ms, 600_000, "unknown: unknown_outcome from now");
    assert_eq!(Transition::stale_to_unknown(a, &l).ttl_ms, 600_000);
    for (stage, px) in [(Stage::Forwarded, 602_000), (Stage::Completed, 4_000), (Stage::Unknown, 600_000)] {
        assert_eq!(l.life_ms(stage), px, "{stage:?}");
    }
}

/// Replacing a stored value is always conditional on its lock not being live by Redis's clock:
/// for a stale lock (take-over) and for a record past its expiry (free) alike; only the phases
/// accepted differ.
#[test]
fn replacing_a_stored_value_always_requires_its_lock_not_live() {
    let (old, new) = (OwnerToken([1; 16]), OwnerToken([2; 16]));
    let stale = Transition::take_over(old, new, record(), false, &lives(9_000, 1_000, 9_000));
    assert_eq!((stale.expected_phases, stale.require_stale), ("P", true));
    let free = Transition::take_over(old, new, record(), true, &lives(9_000, 1_000, 9_000));
    assert_eq!((free.expected_phases, free.require_stale), ("PDU", true));
    let path = free.request(&skey(), &seal()).path;
    let parts: Vec<&str> = path.trim_end_matches(".raw").split('/').collect();
    // "" EVALSHA sha1 2 key tombstone-key | owner phases stale ...
    assert_eq!((parts[7], parts[8]), ("PDU", "1"));
}

#[test]
fn a_completion_travels_as_a_put_body_and_other_transitions_as_posts() {
    let owner = OwnerToken([2; 16]);
    let mut done = record();
    done.state = State::Completed(StoredResponse { status: 201, headers: vec![], body: vec![0, 1, 2, 255] });
    let put = Transition::complete(owner, done.clone(), &lives(1000, 500, 5000)).request(&skey(), &seal());
    assert_eq!(put.method, "PUT");
    assert!(put.path.starts_with("/EVALSHA/") && put.path.ends_with(".raw"));
    assert_eq!(put.by_sha1, Some(Script::Transition));
    assert_eq!(put.body, seal().seal(&redis_key(&skey()), &done.encode()), "the record, sealed for its key");
    let post = Transition::release(owner).request(&skey(), &seal());
    assert_eq!((post.method, post.path.as_str()), ("POST", "/"));
    let body = String::from_utf8(post.body).unwrap();
    let parts: Vec<&str> = body.trim_end_matches(".raw").split('/').collect();
    // EVALSHA sha1 2 key tombstone-key | owner phases stale new-phase new-owner ttl lock
    // where-absent tombstone tombstone-px record
    assert_eq!(
        &parts[5..],
        &["02".repeat(16).as_str(), "P", "0", "X", "02".repeat(16).as_str(), "1", "-", "0", "-", "0", "-"]
    );
    let stale = Transition::stale_to_unknown(owner, &lives(1000, 500, 5000)).request(&skey(), &seal());
    let body = String::from_utf8(stale.body).unwrap();
    let parts: Vec<&str> = body.trim_end_matches(".raw").split('/').collect();
    assert_eq!((parts[7], parts[8], parts[10]), ("1", "U", "5000"));
}

#[test]
fn basic_auth_is_rfc_4648_base64() {
    // Vectors from RFC 4648 section 10 and RFC 7617's example.
    assert_eq!(basic_auth("Aladdin:open sesame"), "Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ==");
    assert_eq!(basic_auth("f"), "Basic Zg==");
    assert_eq!(basic_auth("fo"), "Basic Zm8=");
    assert_eq!(basic_auth("foo"), "Basic Zm9v");
    assert_eq!(basic_auth("foobar"), "Basic Zm9vYmFy");
}

#[test]
fn resp_values_parse_strictly() {
    assert_eq!(parse_resp(b"+OK\r\n"), Ok(Resp::Simple("OK".into())));
    assert_eq!(parse_resp(b":42\r\n"), Ok(Resp::Integer(42)));
    assert_eq!(parse_resp(b"$-1\r\n"), Ok(Resp::Bulk(None)));
    assert_eq!(parse_resp(b"$3\r\na\r\n\r\n"), Ok(Resp::Bulk(Some(b"a\r\n".to_vec()))));
    assert_eq!(parse_resp(b"*-1\r\n"), Ok(Resp::Array(None)));
    assert_eq!(
        parse_resp(b"*2\r\n:1\r\n$1\r\nx\r\n"),
        Ok(Resp::Array(Some(vec![Resp::Integer(1), Resp::Bulk(Some(b"x".to_vec()))])))
    );
    for bad in
        [&b""[..], b"+OK", b"$5\r\nabc\r\n", b":x\r\n", b"*3\r\n:1\r\n", b"?\r\n", b"+OK\r\nextra", b"*99999999\r\n"]
    {
        assert!(matches!(parse_resp(bad), Err(StoreError::Garbled(_))), "{bad:?}");
    }
}

#[test]
fn claim_replies_are_understood_whether_integers_come_as_integers_or_bulk_strings() {
    let echo = "01".repeat(16);
    let claimed = format!("*3\r\n:1\r\n:1764\r\n$32\r\n{echo}\r\n");
    assert_eq!(
        parse_claim_reply(Some(200), claimed.as_bytes(), &OWNER, &skey(), &seal()),
        Ok(ClaimReply::Claimed { now_ms: 1764 })
    );
    let claimed = format!("*3\r\n$1\r\n1\r\n$4\r\n1764\r\n$32\r\n{echo}\r\n");
    assert_eq!(
        parse_claim_reply(Some(200), claimed.as_bytes(), &OWNER, &skey(), &seal()),
        Ok(ClaimReply::Claimed { now_ms: 1764 })
    );
    let v = value(Stage::Completed);
    let enc = v.encode(&skey(), &seal());
    let mut reply = format!("*4\r\n$1\r\n0\r\n$4\r\n1765\r\n${}\r\n", enc.len()).into_bytes();
    reply.extend_from_slice(&enc);
    reply.extend_from_slice(b"\r\n$4\r\n4000\r\n");
    assert_eq!(
        parse_claim_reply(Some(200), &reply, &OWNER, &skey(), &seal()),
        Ok(ClaimReply::Exists { now_ms: 1765, expires_at_ms: 5765, value: v.clone() })
    );
    // A key without expiry holds; a three-item answer (no PTTL) or a PTTL that is no time is garbled.
    let no_px = reply_with_pttl(&enc, "-1");
    assert_eq!(
        parse_claim_reply(Some(200), &no_px, &OWNER, &skey(), &seal()),
        Ok(ClaimReply::Exists { now_ms: 1765, expires_at_ms: u64::MAX, value: v })
    );
    for bad in ["-2", "x"] {
        assert!(
            matches!(
                parse_claim_reply(Some(200), &reply_with_pttl(&enc, bad), &OWNER, &skey(), &seal()),
                Err(StoreError::Garbled(_))
            ),
            "{bad}"
        );
    }
    let mut three = format!("*3\r\n$1\r\n0\r\n$4\r\n1765\r\n${}\r\n", enc.len()).into_bytes();
    three.extend_from_slice(&enc);
    three.extend_from_slice(b"\r\n");
    assert!(matches!(parse_claim_reply(Some(200), &three, &OWNER, &skey(), &seal()), Err(StoreError::Garbled(_))));
}

#[test]
fn store_failures_of_every_kind_are_errors_never_panics() {
    assert_eq!(parse_claim_reply(None, b"", &OWNER, &skey(), &seal()), Err(StoreError::NoAnswer));
    assert_eq!(
        parse_claim_reply(Some(503), b"Service Unavailable", &OWNER, &skey(), &seal()),
        Err(StoreError::Http(503))
    );
    assert_eq!(parse_claim_reply(Some(403), b"", &OWNER, &skey(), &seal()), Err(StoreError::Http(403)));
    assert_eq!(
        parse_claim_reply(Some(200), b"-ERR boom\r\n", &OWNER, &skey(), &seal()),
        Err(StoreError::Redis("ERR boom".into()))
    );
    assert!(matches!(
        parse_claim_reply(Some(200), b"{\"EVAL\":[1,2]}", &OWNER, &skey(), &seal()),
        Err(StoreError::Garbled(_))
    ));
    assert!(matches!(
        parse_claim_reply(Some(200), b"*2\r\n:7\r\n:1\r\n", &OWNER, &skey(), &seal()),
        Err(StoreError::Garbled(_))
    ));
    assert_eq!(parse_transition_reply(Some(200), &transition_answer(":1", &OWNER), None), Ok(TransitionReply::Changed));
    let refused = transition_answer("$1\r\n0", &OWNER);
    assert_eq!(parse_transition_reply(Some(200), &refused, Some(&OWNER)), Ok(TransitionReply::Refused));
    assert!(parse_transition_reply(Some(200), &transition_answer(":3", &OWNER), None).is_err());
    assert!(parse_transition_reply(Some(200), &transition_answer(":-1", &OWNER), None).is_err());
    assert!(parse_transition_reply(Some(502), &transition_answer(":1", &OWNER), None).is_err());
}

/// The transition script's answer `{code, new owner hex}` as webdis's raw output carries it.
fn transition_answer(code: &str, new_owner: &OwnerToken) -> Vec<u8> {
    format!("*2\r\n{code}\r\n$32\r\n{}\r\n", new_owner.hex()).into_bytes()
}

/// webdis 0.1.9 writes a late answer to whichever new connection reuses the file descriptor of
/// the client that went away (docs/stores.md): a take-over (which forwards on "changed") must
/// read only its own answer. Another request's "changed", or a bare integer (any other command's
/// answer, or this script's before it echoed), is garbled: never a claim to forward on.
#[test]
fn a_transition_answer_that_is_not_the_requests_own_is_refused() {
    let other = OwnerToken([2; 16]);
    let ours = parse_transition_reply(Some(200), &transition_answer(":1", &OWNER), Some(&OWNER));
    assert_eq!(ours, Ok(TransitionReply::Changed));
    for bad in [
        transition_answer(":1", &other),
        transition_answer(":2", &other),
        b":1\r\n".to_vec(),
        b"$1\r\n1\r\n".to_vec(),
        b"*1\r\n:1\r\n".to_vec(),
        format!("*3\r\n:1\r\n$32\r\n{}\r\n:1\r\n", OWNER.hex()).into_bytes(),
        b"*2\r\n:1\r\n$-1\r\n".to_vec(),
    ] {
        let reply = parse_transition_reply(Some(200), &bad, Some(&OWNER));
        assert!(matches!(reply, Err(StoreError::Garbled(_))), "{:?}: {reply:?}", String::from_utf8_lossy(&bad));
    }
    // Every answer of the script echoes the new owner (ARGV[5]).
    for code in ["0", "1", "2"] {
        assert!(!TRANSITION_SCRIPT.contains(&format!("return {code}")), "a bare answer {code}");
    }
    assert_eq!(TRANSITION_SCRIPT.matches("return {").count(), TRANSITION_SCRIPT.matches(",ARGV[5]}").count());
    // Without an echo to check (an owner's own write), the shape is still required.
    assert!(matches!(parse_transition_reply(Some(200), b":1\r\n", None), Err(StoreError::Garbled(_))));
    assert_eq!(parse_transition_reply(Some(200), &transition_answer(":0", &other), None), Ok(TransitionReply::Refused));
}

/// A "claimed" answer must echo the claim's owner: an answer made without reading the request
/// (a store answering "claimed" to everything) would let two proxies both forward one key.
#[test]
fn a_claimed_answer_that_does_not_echo_the_claims_owner_is_refused() {
    let other = "02".repeat(16);
    for bad in [
        "*2\r\n$1\r\n1\r\n$4\r\n1764\r\n".to_string(),
        format!("*3\r\n$1\r\n1\r\n$4\r\n1764\r\n$32\r\n{other}\r\n"),
        format!("*3\r\n$1\r\n1\r\n$4\r\n1764\r\n$31\r\n{}\r\n", &"01".repeat(16)[..31]),
        "*3\r\n$1\r\n1\r\n$4\r\n1764\r\n$-1\r\n".to_string(),
        format!("*4\r\n$1\r\n1\r\n$4\r\n1764\r\n$32\r\n{}\r\n:1\r\n", "01".repeat(16)),
    ] {
        assert!(
            matches!(
                parse_claim_reply(Some(200), bad.as_bytes(), &OWNER, &skey(), &seal()),
                Err(StoreError::Garbled(_))
            ),
            "{bad:?}"
        );
    }
}

/// The claim script echoes its owner argument (ARGV[1], the owner hex the request sends).
#[test]
fn the_claim_script_answers_claimed_with_the_owner_it_was_given() {
    assert!(CLAIM_SCRIPT.contains("return {'1',string.format('%d',now),ARGV[1]}"));
    let body = String::from_utf8(claim_request(&skey(), &OWNER, &record(), &lives(1_000, 1_000, 1_000), &seal()).body)
        .unwrap();
    assert_eq!(body.split('/').nth(5), Some("01".repeat(16).as_str()));
}

/// No allocation is sized from a count in the answer: arrays claiming more elements than any
/// idemgate answer has are refused before any element is read, at any nesting, and a claimed
/// count the bytes could hold is still refused past the element budget.
#[test]
fn arrays_claiming_more_elements_than_any_answer_are_refused_before_allocating() {
    let mut bomb = b"*8000000\r\n".repeat(9);
    bomb.extend_from_slice(&b":1\r\n".repeat(1000));
    assert!(matches!(parse_resp(&bomb), Err(StoreError::Garbled(_))));
    let wide = [b"*17\r\n".as_slice(), &b":1\r\n".repeat(17)].concat();
    assert!(matches!(parse_resp(&wide), Err(StoreError::Garbled(_))));
    let nested = [b"*2\r\n*8\r\n".as_slice(), &b":1\r\n".repeat(8), b"*8\r\n", &b":1\r\n".repeat(8)].concat();
    assert!(matches!(parse_resp(&nested), Err(StoreError::Garbled(_))), "18 elements in all");
    let fits = [b"*2\r\n*7\r\n".as_slice(), &b":1\r\n".repeat(7), b"*7\r\n", &b":1\r\n".repeat(7)].concat();
    assert!(parse_resp(&fits).is_ok(), "16 elements in all");
}

#[test]
fn reads_are_plain_gets_and_their_answers_are_checked() {
    let r = read_request(&skey());
    assert_eq!(String::from_utf8(r.body).unwrap(), format!("GET/idemgate%3Av1%3A{}.raw", "07".repeat(32)));
    assert_eq!(parse_read_reply(Some(200), b"$-1\r\n", &skey(), &seal()), Ok(ReadReply::Absent));
    let v = value(Stage::Completed);
    let enc = v.encode(&skey(), &seal());
    let mut reply = format!("${}\r\n", enc.len()).into_bytes();
    reply.extend_from_slice(&enc);
    reply.extend_from_slice(b"\r\n");
    assert_eq!(parse_read_reply(Some(200), &reply, &skey(), &seal()), Ok(ReadReply::Found(v)));
    assert!(parse_read_reply(Some(200), b":1\r\n", &skey(), &seal()).is_err());
    assert!(matches!(parse_read_reply(Some(200), b"$3\r\nabc\r\n", &skey(), &seal()), Ok(ReadReply::Unreadable(_))));
}

/// Bytes of a value as a stored-value bulk string in a claim-or-read answer ("exists").
fn exists_reply(value: &[u8]) -> Vec<u8> {
    reply_with_pttl(value, "4000")
}

/// A claim-or-read answer "exists" at Redis time 1765 with this value and `PTTL` text.
fn reply_with_pttl(value: &[u8], pttl: &str) -> Vec<u8> {
    let mut reply = format!("*4\r\n$1\r\n0\r\n$4\r\n1765\r\n${}\r\n", value.len()).into_bytes();
    reply.extend_from_slice(value);
    reply.extend_from_slice(format!("\r\n${}\r\n{pttl}\r\n", pttl.len()).as_bytes());
    reply
}

#[test]
fn a_value_that_exists_but_cannot_be_decoded_is_unreadable_not_a_store_failure() {
    let good = value(Stage::Completed).encode(&skey(), &seal());
    let mut future_record = good.clone();
    future_record[HEADER_LEN + 3] = 2; // the record's version byte, after "IGR"
    let mut future_value = good.clone();
    future_value[3] = b'2'; // "IGS2"
    let mut unknown_phase = good.clone();
    unknown_phase[4] = b'Z';
    let cases: [(&str, Vec<u8>); 6] = [
        ("garbled", b"abc".to_vec()),
        ("empty", vec![]),
        ("truncated", good[..good.len() - 1].to_vec()),
        ("future record version", future_record),
        ("future value format", future_value),
        ("unknown phase", unknown_phase),
    ];
    for (what, v) in cases {
        assert!(
            matches!(
                parse_claim_reply(Some(200), &exists_reply(&v), &OWNER, &skey(), &seal()),
                Ok(ClaimReply::Unreadable { now_ms: 1765, .. })
            ),
            "{what}"
        );
        let mut read = format!("${}\r\n", v.len()).into_bytes();
        read.extend_from_slice(&v);
        read.extend_from_slice(b"\r\n");
        assert!(matches!(parse_read_reply(Some(200), &read, &skey(), &seal()), Ok(ReadReply::Unreadable(_))), "{what}");
    }
    // The shape of the answer itself still decides "garbled": no value, or not a string.
    assert!(matches!(
        parse_claim_reply(Some(200), b"*4\r\n:0\r\n:1\r\n:5\r\n:1\r\n", &OWNER, &skey(), &seal()),
        Err(StoreError::Garbled(_))
    ));
    assert!(matches!(
        parse_claim_reply(Some(200), b"*4\r\n:0\r\n:1\r\n$-1\r\n:1\r\n", &OWNER, &skey(), &seal()),
        Err(StoreError::Garbled(_))
    ));
}

#[test]
fn summary_uses_the_stores_phase_lock_and_expiry_never_the_writers_clock() {
    let s = value(Stage::Forwarded).summary(7_000);
    assert_eq!(s.phase, Phase::Forwarded { lock_expires_at_ms: 1_764_000_060_000 });
    assert_eq!(s.fingerprint, Some(Fingerprint([5; 32])));
    assert_eq!(s.expires_at_ms, 7_000, "Redis's expiry, not the record's ({})", record().expires_at_ms);
    assert_eq!(value(Stage::Unknown).summary(7_000).phase, Phase::Unknown);
}

/// Issue 13, item 2: a proxy keeps its copy of a store record for what is left of the key's life
/// by Redis's clock, counted on its own clock, whatever the proxies' and Redis's clocks say.
#[test]
fn a_store_record_moves_onto_the_proxys_clock_with_what_is_left_of_its_life() {
    let v = value(Stage::Completed);
    // Redis at 1_000_000, the key expires at 1_004_000; the proxy's clock reads 30 s behind.
    let r = v.record_on_clock(1_000_000, 1_004_000, 970_000);
    assert_eq!(r.expires_at_ms, 974_000);
    assert_eq!(v.record_on_clock(1_000_000, 999_000, 970_000).expires_at_ms, 970_000, "already over");
    // A key without PX never ends on any clock; the completed record in it still ends as a
    // record at its own expiry, after which it is the key's tombstone (issue 40, item 6).
    let own = v.record.expires_at_ms;
    assert_eq!(v.record_on_clock(1_000_000, u64::MAX, 970_000).expires_at_ms, own, "no PX: its own expiry");
    assert_eq!(r.state, v.record.state);
    // A store key kept past its record's own expiry (`tombstone_seconds`): the copy ends with the
    // record, not with the key, so the proxy never replays the tombstone.
    let mut t = v.clone();
    t.record.expires_at_ms = 972_000;
    let copy = t.record_on_clock(1_000_000, 1_004_000, 970_000);
    assert_eq!(copy.expires_at_ms, 972_000);
    assert!(!copy.is_tombstone(971_999) && copy.is_tombstone(972_000));
}

#[cfg(not(target_arch = "wasm32"))]
mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn answers_of_any_bytes_never_panic(status in proptest::option::of(100u16..600), body in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = parse_resp(&body);
            let _ = parse_claim_reply(status, &body, &OWNER, &skey(), &seal());
            let _ = parse_transition_reply(status, &body, Some(&OWNER));
            let _ = StoredValue::open(&body, &skey(), &seal());
        }

        #[test]
        fn mutated_claim_replies_never_panic(pos in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<prop::sample::Index>()) {
            let enc = value(Stage::Completed).encode(&skey(), &seal());
            let mut reply = reply_with_pttl(&enc, "4000");
            let i = pos.index(reply.len());
            reply[i] = byte;
            let _ = parse_claim_reply(Some(200), &reply, &OWNER, &skey(), &seal());
            let _ = parse_claim_reply(Some(200), &reply[..cut.index(reply.len())], &OWNER, &skey(), &seal());
        }

        #[test]
        fn encoded_arguments_use_only_unreserved_characters_and_percent(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
            let e = encode_arg(&bytes);
            prop_assert!(e.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_~%".contains(&b)));
        }
    }
}

#[test]
fn a_lost_claim_release_leaves_a_tombstone_naming_its_owner_that_reads_as_absent() {
    let owner = OwnerToken([0xcd; 16]);
    let t = Transition::release_lost(owner, &lives(86_400_000, 30_000, 60_000));
    assert!(t.tombstone && t.new_phase.is_none());
    let req = String::from_utf8(t.request(&skey(), &seal()).body).unwrap();
    // ARGV: owner, phases, stale, new phase 'R', new owner, ttl (the claim's own life), lock,
    // where absent (no write: the tombstone is its own case), record.
    let tail = format!("/{}/P/0/R/{}/90000/-/0/-/0/-.raw", owner.hex(), owner.hex());
    assert!(req.ends_with(&tail), "{req}");
    // A plain release deletes and never writes a tombstone.
    let plain = String::from_utf8(Transition::release(owner).request(&skey(), &seal()).body).unwrap();
    assert!(plain.contains("/P/0/X/"), "{plain}");
    // A waiter reading the tombstone sees a free key.
    let tomb = format!("IGS1R{}", owner.hex());
    let resp = format!("${}\r\n{tomb}\r\n", tomb.len());
    assert_eq!(parse_read_reply(Some(200), resp.as_bytes(), &skey(), &seal()), Ok(ReadReply::Absent));
}

#[test]
fn a_claim_refused_by_its_owners_tombstone_is_never_taken_for_a_claim() {
    let refused = b"*2\r\n$1\r\n2\r\n$13\r\n1764000000000\r\n";
    assert!(parse_claim_reply(Some(200), refused, &OWNER, &skey(), &seal()).is_err());
}

/// The outcome-unknown record an owner writes where the store lost its claim.
fn gone() -> Record {
    let l = lives(4_000, 2_000, 600_000);
    Record::unknown(record().fingerprint, record().creator, UnknownReason::UpstreamReset, 0, &l)
}

/// A completion or outcome-unknown mark that finds its claim gone from the store writes its
/// record there and answers 2; an owner mismatch stays a refusal (0).
#[test]
fn a_write_that_finds_its_claim_gone_answers_its_own_code() {
    let rewritten = |code: &str| parse_transition_reply(Some(200), &transition_answer(code, &OWNER), Some(&OWNER));
    assert_eq!(rewritten(":2"), Ok(TransitionReply::ClaimGoneRewritten));
    assert_eq!(rewritten("$1\r\n2"), Ok(TransitionReply::ClaimGoneRewritten));
    assert!(TransitionReply::ClaimGoneRewritten.written() && TransitionReply::Changed.written());
    assert!(!TransitionReply::Refused.written());
}

/// Only the owner's completion and outcome-unknown mark write where the key is absent; every
/// other transition keeps refusing there. The flag is the ARGV before the record.
#[test]
fn only_completion_and_outcome_unknown_write_where_their_claim_is_gone() {
    let (a, b) = (OwnerToken([1; 16]), OwnerToken([2; 16]));
    let l = lives(4_000, 2_000, 600_000);
    let flag = |t: &Transition| {
        let req = t.request(&skey(), &seal());
        let cmd = if t.record.is_some() { req.path } else { String::from_utf8(req.body).unwrap() };
        let parts: Vec<String> = cmd.trim_end_matches(".raw").split('/').map(str::to_string).collect();
        // (PUT) "" EVAL script 1 key | 7 args, where-absent [, record] -- the flag is 8th of ARGV.
        let argv0 = parts.iter().position(|p| p == &a.hex()).unwrap();
        parts[argv0 + 7].clone()
    };
    let complete = Transition::complete(a, record(), &l);
    assert_eq!((complete.where_absent, flag(&complete).as_str()), (WhereAbsent::Write, "1"));
    let unknown = Transition::unknown(a, gone(), &l);
    assert_eq!((unknown.where_absent, flag(&unknown).as_str()), (WhereAbsent::WriteKeepingStored, "K"));
    // The record written where absent travels as the PUT body; where the claim is found it is kept.
    assert_eq!(unknown.request(&skey(), &seal()).method, "PUT");
    assert_eq!(unknown.request(&skey(), &seal()).body, seal().seal(&redis_key(&skey()), &gone().encode()));
    for t in [
        Transition::release(a),
        Transition::release_lost(a, &l),
        Transition::stale_to_unknown(a, &l),
        Transition::take_over(a, b, record(), false, &l),
        Transition::take_over(a, b, record(), true, &l),
    ] {
        assert_eq!((t.where_absent, flag(&t).as_str()), (WhereAbsent::Refuse, "0"), "{t:?}");
    }
    // The script writes where absent only on the flag, and answers 2 for it.
    assert!(TRANSITION_SCRIPT.contains("if not v and ARGV[8]~='0' and ARGV[11]~='-'"));
    assert!(TRANSITION_SCRIPT.contains("return {2,ARGV[5]} end"));
}

/// Redis's answer to an EVALSHA of a script it does not hold (webdis passes it with HTTP 200).
const NOSCRIPT_ANSWER: &[u8] = b"-NOSCRIPT No matching script. Please use EVAL.\r\n";

#[test]
fn noscript_is_its_own_answer_never_an_outage_or_garbled() {
    assert_eq!(parse_claim_reply(Some(200), NOSCRIPT_ANSWER, &OWNER, &skey(), &seal()), Ok(ClaimReply::NoScript));
    assert_eq!(parse_transition_reply(Some(200), NOSCRIPT_ANSWER, Some(&OWNER)), Ok(TransitionReply::NoScript));
    assert!(!TransitionReply::NoScript.written());
    // A GET runs no script: a store answering it NOSCRIPT is only an error.
    assert!(matches!(parse_read_reply(Some(200), NOSCRIPT_ANSWER, &skey(), &seal()), Err(StoreError::Redis(_))));
}

/// NOSCRIPT is the only answer after which a call is sent again, so nothing that may have run is
/// ever taken for it: no answer (a timeout, a reset), an HTTP error, another Redis error, or
/// bytes that are not exactly one RESP error whose code is NOSCRIPT.
#[test]
fn nothing_but_redis_noscript_error_reads_as_noscript() {
    let not_noscript: [(Option<u16>, &[u8]); 10] = [
        (None, b""),
        (None, NOSCRIPT_ANSWER),
        (Some(503), NOSCRIPT_ANSWER),
        (Some(403), NOSCRIPT_ANSWER),
        (Some(200), b"-ERR NOSCRIPT No matching script\r\n"),
        (Some(200), b"-NOSCRIPTS No matching script\r\n"),
        (Some(200), b"+NOSCRIPT No matching script\r\n"),
        (Some(200), b"-NOSCRIPT No matching script"),
        (Some(200), b"-NOSCRIPT No matching script\r\n:1\r\n"),
        (Some(200), br#"{"EVALSHA":[false,"NOSCRIPT No matching script. Please use EVAL."]}"#),
    ];
    for (status, body) in not_noscript {
        let claim = parse_claim_reply(status, body, &OWNER, &skey(), &seal());
        assert!(claim.is_err(), "{status:?} {:?}: {claim:?}", String::from_utf8_lossy(body));
        let transition = parse_transition_reply(status, body, None);
        assert!(transition.is_err(), "{status:?} {:?}: {transition:?}", String::from_utf8_lossy(body));
    }
    assert_eq!(parse_claim_reply(None, NOSCRIPT_ANSWER, &OWNER, &skey(), &seal()), Err(StoreError::NoAnswer));
    assert_eq!(parse_transition_reply(Some(503), NOSCRIPT_ANSWER, None), Err(StoreError::Http(503)));
}

/// The re-sent call is the same call: every argument byte for byte, only `EVALSHA/<sha1>` made
/// `EVAL/<script>` (the webdis request the filter sent before scripts were named). It is made
/// once: the full form has no `with_script` of its own, and neither has a read.
#[test]
fn with_script_is_the_same_call_with_the_script_in_full_and_only_once() {
    let l = lives(86_400_000, 60_000, 600_000);
    let owner = OwnerToken([1; 16]);
    let mut done = record();
    done.state = State::Completed(StoredResponse { status: 201, headers: vec![], body: b"a/b.c\0".to_vec() });
    let requests = [
        (Script::Claim, claim_request(&skey(), &owner, &record(), &l, &seal())),
        (Script::Transition, Transition::complete(owner, done, &l).request(&skey(), &seal())),
        (Script::Transition, Transition::release(owner).request(&skey(), &seal())),
        (
            Script::Transition,
            Transition::take_over(owner, OwnerToken([2; 16]), record(), true, &l).request(&skey(), &seal()),
        ),
    ];
    for (script, by_name) in requests {
        let full = by_name.with_script().expect("an EVALSHA has a full form");
        assert_eq!((full.method, full.by_sha1), (by_name.method, None));
        let name = format!("EVALSHA/{}/", String::from_utf8_lossy(script.sha1_hex()));
        let text = format!("EVAL/{}/", encode_arg(script.text().as_bytes()));
        let (sent, again) = match by_name.method {
            "PUT" => {
                assert_eq!(full.body, by_name.body, "the record travels unchanged");
                (by_name.path.clone().into_bytes(), full.path.clone().into_bytes())
            }
            _ => {
                assert_eq!(full.path, by_name.path);
                (by_name.body.clone(), full.body.clone())
            }
        };
        let skip = usize::from(by_name.method == "PUT");
        assert!(sent[skip..].starts_with(name.as_bytes()), "{}", String::from_utf8_lossy(&sent));
        assert!(again[skip..].starts_with(text.as_bytes()), "{}", String::from_utf8_lossy(&again));
        assert_eq!(sent[skip + name.len()..], again[skip + text.len()..], "the arguments, byte for byte");
        assert_eq!(full.with_script(), None, "re-sent at most once");
    }
    assert_eq!(read_request(&skey()).with_script(), None);
    assert_eq!(StoreRequest::command("PING.raw").with_script(), None);
    // A request claiming a script by name whose command does not start with that name is never
    // rewritten into something else.
    let forged = StoreRequest { by_sha1: Some(Script::Claim), ..read_request(&skey()) };
    assert_eq!(forged.with_script(), None);
}

/// The scripts' names are the SHA-1 of their text, computed at compile time; recomputed here
/// with the system's `sha1sum` (Redis answers the same names: `tests/it/store_scripts.rs`).
#[cfg(not(target_arch = "wasm32"))]
#[test]
fn script_names_are_the_sha1_of_their_text_as_sha1sum_computes_it() {
    use std::io::Write;
    for script in [Script::Claim, Script::Transition] {
        let mut child = std::process::Command::new("sha1sum")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("sha1sum");
        child.stdin.take().unwrap().write_all(script.text().as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        let hex = String::from_utf8(out.stdout).unwrap();
        assert_eq!(script.sha1_hex().as_slice(), hex.split(' ').next().unwrap().as_bytes(), "{script:?}");
    }
    assert_ne!(Script::Claim.sha1_hex(), Script::Transition.sha1_hex());
}

/// Bytes of webdis requests for a first request (claim-or-read, then the completion of a small
/// response), by name and in full: the request lines and bodies the proxy sends, without HTTP
/// headers. Printed with `--nocapture` for docs/BENCHMARKS.md; the saving is the scripts' text.
#[test]
fn a_first_requests_store_requests_shrink_by_the_scripts_text() {
    let l = lives(86_400_000, 60_000, 600_000);
    let owner = OwnerToken([1; 16]);
    let mut done = record();
    done.state = State::Completed(StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: br#"{"id":"ch_1","amount":7}"#.to_vec(),
    });
    let size = |r: &StoreRequest| r.path.len() + r.body.len();
    let claim = claim_request(&skey(), &owner, &record(), &l, &seal());
    let complete = Transition::complete(owner, done, &l).request(&skey(), &seal());
    let (claim_full, complete_full) = (claim.with_script().unwrap(), complete.with_script().unwrap());
    println!(
        "claim {} bytes by name, {} in full; completion {} by name, {} in full",
        size(&claim),
        size(&claim_full),
        size(&complete),
        size(&complete_full)
    );
    for (script, by_name, full) in
        [(Script::Claim, &claim, &claim_full), (Script::Transition, &complete, &complete_full)]
    {
        let text = encode_arg(script.text().as_bytes()).len();
        assert_eq!(size(full) - size(by_name), text - 40 + "EVAL".len() - "EVALSHA".len());
    }
}

/// The request builders as they were before issue 27's cuts (percent-encoding into a `String` per
/// argument, every argument its own `Vec`), kept to prove the faster builders send the same bytes:
/// proxies of two versions share one store during an upgrade.
mod before_issue_27 {
    use super::super::*;

    pub fn encode_arg(bytes: &[u8]) -> String {
        const HEX: &[u8; 16] = b"0123456789ABCDEF";
        let mut out = String::with_capacity(bytes.len() * 3);
        for &b in bytes {
            if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'~' {
                out.push(char::from(b));
            } else {
                out.push('%');
                out.push(char::from(HEX[usize::from(b >> 4)]));
                out.push(char::from(HEX[usize::from(b & 0x0f)]));
            }
        }
        out
    }

    pub fn redis_key(skey: &StorageKey) -> String {
        format!("{KEY_PREFIX}{}", skey.hex())
    }

    fn head(script: Script, in_full: bool) -> String {
        if in_full {
            format!("EVAL/{}/", encode_arg(script.text().as_bytes()))
        } else {
            format!("EVALSHA/{}/", encode_arg(script.sha1_hex()))
        }
    }

    /// Issue 40, item 6: both scripts take the key's tombstone as KEYS[2].
    fn tombstone_key(key: &str) -> String {
        format!("{KEY_PREFIX}t:{{{key}}}")
    }

    fn command(script: Script, key: &str, args: &[&[u8]]) -> String {
        let mut p = head(script, false);
        p.push_str("2/");
        p.push_str(&encode_arg(key.as_bytes()));
        p.push('/');
        p.push_str(&encode_arg(tombstone_key(key).as_bytes()));
        for a in args {
            p.push('/');
            p.push_str(&encode_arg(a));
        }
        p
    }

    fn post(command: &str, script: Option<Script>) -> StoreRequest {
        StoreRequest { method: "POST", path: "/".into(), body: command.as_bytes().to_vec(), by_sha1: script }
    }

    fn claim_args(skey: &StorageKey, owner: &OwnerToken, record: &Record, l: &Lifetimes, seal: &Seal) -> Vec<Vec<u8>> {
        vec![
            owner.hex().into_bytes(),
            l.life_ms(Stage::Forwarded).to_string().into_bytes(),
            l.lock_ms.to_string().into_bytes(),
            if l.tombstone_ms > 0 { b"1".to_vec() } else { b"0".to_vec() },
            seal.seal(&redis_key(skey), &record.encode()),
        ]
    }

    pub fn claim_request(
        skey: &StorageKey,
        owner: &OwnerToken,
        record: &Record,
        l: &Lifetimes,
        seal: &Seal,
    ) -> StoreRequest {
        let args = claim_args(skey, owner, record, l, seal);
        let args: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
        let command = command(Script::Claim, &redis_key(skey), &args);
        post(&format!("{command}.raw"), Some(Script::Claim))
    }

    pub fn claim_command(
        skey: &StorageKey,
        owner: &OwnerToken,
        record: &Record,
        l: &Lifetimes,
        seal: &Seal,
    ) -> Vec<Vec<u8>> {
        let mut cmd = vec![b"EVAL".to_vec(), CLAIM_SCRIPT.as_bytes().to_vec(), b"2".to_vec()];
        cmd.push(redis_key(skey).into_bytes());
        cmd.push(tombstone_key(&redis_key(skey)).into_bytes());
        cmd.extend(claim_args(skey, owner, record, l, seal));
        cmd
    }

    fn args(t: &Transition, skey: &StorageKey, seal: &Seal) -> Vec<Vec<u8>> {
        let completes = t.record.is_some() && t.new_phase == Some(Stage::Completed) && t.key_tombstone_ms > 0;
        let forgets = t.forget_tombstone && t.new_phase.is_none() && !t.tombstone;
        let (tomb, tomb_px) = match (&t.record, completes) {
            _ if forgets => (b"F".to_vec(), b"0".to_vec()),
            (Some(r), true) => {
                let mut body = b"IGT\x01".to_vec();
                body.extend_from_slice(&r.fingerprint.0);
                let sealed = seal.seal(&tombstone_key(&redis_key(skey)), &body);
                ([b"IGS1T".to_vec(), sealed].concat(), t.ttl_ms.max(1).to_string().into_bytes())
            }
            _ => (b"-".to_vec(), b"0".to_vec()),
        };
        let phase = vec![t.new_phase.map_or(if t.tombstone { b'R' } else { b'X' }, stage_letter)];
        vec![
            t.expected_owner.hex().into_bytes(),
            t.expected_phases.as_bytes().to_vec(),
            if t.require_stale { b"1".to_vec() } else { b"0".to_vec() },
            phase,
            t.new_owner.hex().into_bytes(),
            t.ttl_ms.saturating_sub(t.key_tombstone_ms).max(1).to_string().into_bytes(),
            t.lock_ms.map_or("-".to_string(), |l| l.to_string()).into_bytes(),
            vec![t.where_absent.letter()],
            tomb,
            tomb_px,
        ]
    }

    pub fn eval_command(t: &Transition, skey: &StorageKey, seal: &Seal) -> Vec<Vec<u8>> {
        let mut cmd = vec![b"EVAL".to_vec(), TRANSITION_SCRIPT.as_bytes().to_vec(), b"2".to_vec()];
        let key = redis_key(skey);
        cmd.push(key.clone().into_bytes());
        cmd.push(tombstone_key(&key).into_bytes());
        cmd.extend(args(t, skey, seal));
        cmd.push(t.record.as_ref().map_or(b"-".to_vec(), |r| seal.seal(&key, &r.encode())));
        cmd
    }

    pub fn transition_request(t: &Transition, skey: &StorageKey, seal: &Seal) -> StoreRequest {
        let owned = args(t, skey, seal);
        let mut args: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
        let key = redis_key(skey);
        let script = Script::Transition;
        match &t.record {
            Some(r) => StoreRequest {
                method: "PUT",
                path: format!("/{}.raw", command(script, &key, &args)),
                body: seal.seal(&key, &r.encode()),
                by_sha1: Some(script),
            },
            None => {
                args.push(b"-");
                let command = command(script, &key, &args);
                post(&format!("{command}.raw"), Some(script))
            }
        }
    }

    pub fn read_request(skey: &StorageKey) -> StoreRequest {
        post(&format!("GET/{}.raw", encode_arg(redis_key(skey).as_bytes())), None)
    }

    pub fn value_encode(v: &StoredValue, skey: &StorageKey, seal: &Seal) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(VALUE_MAGIC);
        out.push(stage_letter(v.phase));
        out.extend_from_slice(v.owner.hex().as_bytes());
        out.extend_from_slice(format!("{:015}", v.lock_expires_at_ms % 1_000_000_000_000_000).as_bytes());
        out.extend_from_slice(&seal.seal(&redis_key(skey), &v.record.encode()));
        out
    }
}

/// Issue 27: the store path's requests were made cheaper to build, never different. Every
/// request the filter, the root and the CLI send to Redis (claims of several records, each
/// transition: completion with a body, without it, outcome-unknown, release, a lost claim's
/// release, stale-to-unknown, take-over, an operator's; their NOSCRIPT forms), the scripts' direct
/// commands, reads, stored values and percent-encoded arguments of every byte are byte for byte
/// those of the builders before the change.
#[test]
fn store_requests_are_byte_identical_to_those_before_issue_27() {
    let seal = seal();
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec()), ("location".into(), b"/c/1".to_vec())],
        body: br#"{"id":"ch_1","amount":4200,"currency":"eur","status":"succeeded"}"#.to_vec(),
    };
    let creator =
        Creator { request_id: "7f3c2a9e-5b1d/4e8f.9a6c%2d".into(), log_values: vec![("x-user".into(), "a b".into())] };
    let fp = Fingerprint([0x2e; 32]);
    let l = lives(86_400_000, 60_000, 3_600_000);
    let owners = [OwnerToken([0; 16]), OwnerToken([0xff; 16]), OwnerToken(*b"0123456789.-/%~_")];
    let skeys = [StorageKey([0; 32]), StorageKey([0xa5; 32]), skey()];
    let mut records = vec![record()];
    for now in [0, 1, 1_764_000_000_123, u64::MAX] {
        records.push(Record::in_progress(fp, creator.clone(), owners[2], now, &l));
        records.push(Record::completed(fp, response.clone(), false, creator.clone(), now, 86_400));
        records.push(Record::completed(fp, response.clone(), true, Creator::default(), now, 1));
        records.push(Record::unknown(fp, creator.clone(), UnknownReason::StoreWriteFailed, now, &l));
    }
    let mut checked = 0;
    for skey in &skeys {
        assert_eq!(redis_key(skey), before_issue_27::redis_key(skey));
        assert_eq!(read_request(skey), before_issue_27::read_request(skey));
        for owner in &owners {
            for r in &records {
                let tl = Lifetimes { tombstone_ms: 1_000, ..l };
                assert_eq!(
                    claim_request(skey, owner, r, &tl, &seal),
                    before_issue_27::claim_request(skey, owner, r, &tl, &seal)
                );
                let new = claim_request(skey, owner, r, &l, &seal);
                assert_eq!(new, before_issue_27::claim_request(skey, owner, r, &l, &seal));
                assert_eq!(new.with_script(), before_issue_27::claim_request(skey, owner, r, &l, &seal).with_script());
                assert_eq!(
                    claim_command(skey, owner, r, &l, &seal),
                    before_issue_27::claim_command(skey, owner, r, &l, &seal)
                );
                let mut transitions = vec![
                    Transition::complete(*owner, r.clone(), &l),
                    Transition::complete(*owner, r.clone(), &Lifetimes { tombstone_ms: 3_600_000, ..l }),
                    Transition::unknown(*owner, r.clone(), &l),
                    Transition::release(*owner),
                    Transition::release_lost(*owner, &lives(0, 0, 0)),
                    Transition::stale_to_unknown(*owner, &l),
                    Transition::take_over(owners[0], *owner, r.clone(), false, &l),
                    Transition::take_over(owners[1], *owner, r.clone(), true, &l),
                ];
                transitions.extend(transitions.iter().filter_map(Transition::without_body).collect::<Vec<_>>());
                transitions.push(Transition { forget_tombstone: true, ..Transition::release(*owner) });
                transitions.push(Transition {
                    lock_ms: Some(u64::MAX),
                    ttl_ms: u64::MAX,
                    event: None,
                    expected_phases: "",
                    ..Transition::release(*owner)
                });
                for t in &transitions {
                    let new = t.request(skey, &seal);
                    let old = before_issue_27::transition_request(t, skey, &seal);
                    assert_eq!(new, old, "{t:?}");
                    assert_eq!(new.with_script(), old.with_script());
                    assert_eq!(t.eval_command(skey, &seal), before_issue_27::eval_command(t, skey, &seal));
                    checked += 1;
                }
                for phase in [Stage::Forwarded, Stage::Completed, Stage::Unknown] {
                    let v =
                        StoredValue { phase, owner: *owner, lock_expires_at_ms: r.expires_at_ms, record: r.clone() };
                    assert_eq!(v.encode(skey, &seal), before_issue_27::value_encode(&v, skey, &seal));
                }
            }
        }
    }
    assert!(checked > 500, "{checked}");
    let every_byte: Vec<u8> = (0..=255).collect();
    assert_eq!(encode_arg(&every_byte), before_issue_27::encode_arg(&every_byte));
}

/// Issue 40, item 6: on a route that keeps tombstones, a completion keeps its record for `ttl`
/// only and writes, in the same script, the key's tombstone for `ttl + tombstone`: its
/// fingerprint only, sealed for the tombstone's own key, 77 bytes whatever the response held. No
/// other transition writes one, nor a completion on a route without tombstones; the body-less
/// rewrite of a completion too large for the store writes the same tombstone.
#[test]
fn a_completion_keeps_its_record_for_ttl_and_a_small_tombstone_for_ttl_plus_tombstone() {
    let l = Lifetimes { tombstone_ms: 7_000, ..lives(4_000, 2_000, 600_000) };
    let owner = OwnerToken([2; 16]);
    let mut done = record();
    let headers = vec![("content-type".into(), b"application/json".to_vec())];
    done.state = State::Completed(StoredResponse { status: 201, headers, body: vec![b'x'; 1_000] });
    let t = Transition::complete(owner, done.clone(), &l);
    let tomb = tombstone_value(&skey(), &done.fingerprint, &seal());
    assert_eq!(tomb.len(), 77, "IGS1T + seal (36) + IGT1 + fingerprint");
    let arg = |t: &Transition, i: usize| {
        let path = t.request(&skey(), &seal()).path;
        path.trim_end_matches(".raw").split('/').nth(i).unwrap().to_string()
    };
    // "" EVALSHA sha1 2 key tombstone-key | owner phases stale D owner ttl lock where tomb tomb-px
    assert_eq!(arg(&t, 5), encode_arg(tombstone_redis_key(&skey()).as_bytes()));
    assert_eq!(arg(&t, 11), "4000", "the record: ttl");
    assert_eq!((arg(&t, 14), arg(&t, 15)), (encode_arg(&tomb), "11000".into()), "its tombstone: ttl + tombstone");
    let lean = t.without_body().unwrap();
    assert_eq!((arg(&lean, 11), arg(&lean, 14), arg(&lean, 15)), ("4000".into(), encode_arg(&tomb), "11000".into()));
    assert_eq!(open_tombstone(&tomb, &skey(), &seal()), Ok(done.fingerprint));
    assert!(open_tombstone(&tomb, &StorageKey([8; 32]), &seal()).unwrap_err().is_unauthentic(), "moved");
    assert!(open_tombstone(&tomb[..76], &skey(), &seal()).is_err(), "truncated");
    let plain = Transition::complete(owner, done.clone(), &lives(4_000, 2_000, 600_000));
    assert_eq!((arg(&plain, 11), arg(&plain, 14), arg(&plain, 15)), ("4000".into(), "-".into(), "0".into()));
    for other in [
        Transition::unknown(owner, gone(), &l),
        Transition::take_over(owner, OwnerToken([3; 16]), done.clone(), true, &l),
    ] {
        assert_eq!((arg(&other, 14), arg(&other, 15)), ("-".into(), "0".into()), "{other:?}");
    }
    // Written only with a completed value, in the script that writes it (both places).
    assert_eq!(TRANSITION_SCRIPT.matches("tomb()").count(), 3, "defined once, called where a value is written");
    assert!(TRANSITION_SCRIPT
        .contains("if ARGV[4]=='D' and ARGV[9]~='-' then redis.call('SET',KEYS[2],ARGV[9],'PX',ARGV[10])"));
}

/// Issue 40, item 6: a claim meeting the key's tombstone (no record held) claims nothing and reads
/// as a completed record past its own expiry, holding nothing to replay: `key-expired` for the
/// same request on every route, whatever its `tombstone_seconds`; a tombstone that does not
/// verify for its key is unreadable, never a free key.
#[test]
fn a_claim_meeting_the_keys_tombstone_reads_as_a_completed_record_past_its_expiry() {
    let fp = Fingerprint([0x2e; 32]);
    let answer = |v: &[u8]| {
        let mut a = format!("*4\r\n$1\r\n3\r\n$4\r\n1764\r\n${}\r\n", v.len()).into_bytes();
        a.extend_from_slice(v);
        a.extend_from_slice(b"\r\n$4\r\n7000\r\n");
        a
    };
    let tomb = tombstone_value(&skey(), &fp, &seal());
    match parse_claim_reply(Some(200), &answer(&tomb), &OWNER, &skey(), &seal()) {
        Ok(ClaimReply::Exists { now_ms: 1764, expires_at_ms: 8764, value }) => {
            assert_eq!((value.phase, &value.record), (Stage::Completed, &Record::key_tombstone(fp)));
            let summary = value.summary(8764);
            assert_eq!((summary.phase, summary.fingerprint), (Phase::Completed, Some(fp)));
            let on_clock = value.record_on_clock(1764, 8764, 50);
            assert!(on_clock.is_tombstone_for(0, 50) && on_clock.is_tombstone_for(10, 50));
        }
        other => panic!("{other:?}"),
    }
    let moved = tombstone_value(&StorageKey([8; 32]), &fp, &seal());
    let reply = parse_claim_reply(Some(200), &answer(&moved), &OWNER, &skey(), &seal());
    assert!(matches!(reply, Ok(ClaimReply::Unreadable { .. })), "{reply:?}");
    // The script reads it only for a route that keeps tombstones, only where no record is held.
    assert!(CLAIM_SCRIPT.contains("if v then return {'0'"));
    let at = |s: &str| CLAIM_SCRIPT.find(s).unwrap();
    assert!(at("if v then return {'0'") < at("if ARGV[4]=='1' then local d=redis.call('GET',KEYS[2])"));
    assert!(at("return {'3'") < at("redis.call('SET',KEYS[1]"));
}
