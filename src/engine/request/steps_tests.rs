//! The request's own steps driven without Envoy (headers, body chunks, body end, an MCP body),
//! from a configuration as an operator writes it and the header maps a client sends; then one
//! request run through headers, body and the local tier's claim to `Step::Forward`.

use super::*;
use crate::key::KeyError;
use crate::local::memory::MemoryShared;
use crate::local::Table;
use crate::owner::OwnerToken;
use crate::scope::StorageKey;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const NOW: u64 = 1_000_000;
const AUTH: &str = "Bearer caller-1";

fn config(json: &str) -> Config {
    match Config::parse(json.as_bytes()) {
        Ok(c) => c,
        Err(e) => panic!("configuration refused: {e:?}"),
    }
}

/// A request as a client sends it: `extra` headers after the method, path and caller.
fn head(method: &str, path: &str, extra: &[(&str, &str)]) -> RequestHead {
    let mut pairs: Vec<(String, Vec<u8>)> = vec![
        (":method".into(), method.as_bytes().to_vec()),
        (":path".into(), path.as_bytes().to_vec()),
        (":authority".into(), b"idemgate.test".to_vec()),
        ("authorization".into(), AUTH.as_bytes().to_vec()),
    ];
    pairs.extend(extra.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())));
    RequestHead::from_pairs(pairs)
}

const SCOPED: &str = r#"{"scope": {"headers": ["authorization"]}}"#;

fn admitted(at: Result<Admitted, NotProtected>) -> Admitted {
    match at {
        Ok(a) => a,
        Err(not) => panic!("not protected: {not:?}"),
    }
}

fn refused(at: Result<Admitted, NotProtected>) -> ProblemKind {
    match at {
        Err(NotProtected::Refuse { problem, .. }) => problem,
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn a_key_sent_in_its_header_is_protected_and_a_malformed_one_is_a_400_before_anything_is_held() {
    let c = config(SCOPED);
    let a = admitted(at_headers(&c, &head("POST", "/charges", &[("idempotency-key", "k-1")]), None, false));
    assert_eq!((a.route, a.key.as_str(), a.from), (0, "k-1", KeyFrom::Sent));
    // Two lines of the key header: which one the upstream reads is unknown, so neither is used.
    let twice = head("POST", "/charges", &[("idempotency-key", "k-1"), ("idempotency-key", "k-2")]);
    let p = refused(at_headers(&c, &twice, None, false));
    assert_eq!((p.slug(), p.status()), ("key-repeated", 400));
    assert!(matches!(p, ProblemKind::KeyInvalid { error: KeyError::Repeated, .. }));
    let empty = refused(at_headers(&c, &head("POST", "/charges", &[("idempotency-key", "")]), None, true));
    assert_eq!((empty.slug(), empty.status()), ("key-empty", 400));
}

#[test]
fn without_a_key_a_request_passes_unless_the_route_requires_one() {
    let optional = config(SCOPED);
    assert!(matches!(
        at_headers(&optional, &head("POST", "/charges", &[]), None, false),
        Err(NotProtected::Unprotected { route: 0 })
    ));
    let required = config(r#"{"scope": {"headers": ["authorization"]}, "require_key": true}"#);
    let p = refused(at_headers(&required, &head("POST", "/charges", &[]), None, false));
    assert_eq!(p, ProblemKind::KeyMissing { header: "idempotency-key".into() });
    assert_eq!(p.status(), 400);
    // A method no route protects is no route's at all.
    assert!(matches!(at_headers(&required, &head("GET", "/charges", &[]), None, true), Err(NotProtected::Pass)));
}

#[test]
fn a_key_from_a_caller_no_scope_header_identifies_is_refused() {
    let c = config(r#"{"scope": {"headers": ["x-tenant"]}}"#);
    let p = refused(at_headers(&c, &head("POST", "/charges", &[("idempotency-key", "k-1")]), None, false));
    assert_eq!(p, ProblemKind::ScopeMissing { headers: vec!["x-tenant".into()] });
}

#[test]
fn a_spelling_two_routes_read_apart_is_route_ambiguous_and_the_plain_path_is_its_route() {
    let c = config(
        r#"{"scope": {"headers": ["authorization"]},
            "routes": [{"prefix": "/v1/payments", "namespace": "pay"}, {"prefix": "/", "namespace": "rest"}]}"#,
    );
    let key = [("idempotency-key", "k-1")];
    for path in ["/v1/payments/../orders", "/v1%2Fpayments", "/v1/x/..;/payments"] {
        let at = at_headers(&c, &head("POST", path, &key), None, false);
        assert!(matches!(at, Err(NotProtected::RouteAmbiguous { first: 0, other: 1 })), "{path}: {at:?}");
        assert_eq!(at.err().and_then(|n| n.route()), None, "no route's counters count it");
    }
    assert_eq!(admitted(at_headers(&c, &head("POST", "/v1/payments", &key), None, false)).route, 0);
    assert_eq!(admitted(at_headers(&c, &head("POST", "/v1/orders", &key), None, false)).route, 1);
}

#[test]
fn a_grpc_call_with_a_key_is_refused_and_with_grpc_pass_is_not_idemgates() {
    let grpc = [("content-type", "application/grpc"), ("idempotency-key", "k-1")];
    let p = refused(at_headers(&config(SCOPED), &head("POST", "/svc/Charge", &grpc), None, false));
    assert_eq!(p, ProblemKind::GrpcUnsupported { header: "idempotency-key".into() });
    let pass = config(r#"{"scope": {"headers": ["authorization"]}, "grpc": "pass"}"#);
    assert!(matches!(
        at_headers(&pass, &head("POST", "/svc/Charge", &grpc), None, false),
        Err(NotProtected::GrpcPassed { .. })
    ));
}

#[test]
fn derive_key_derives_at_the_headers_or_at_the_body_end_and_never_for_an_anonymous_caller() {
    let at_headers_only =
        config(r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-order-id"]}}"#);
    let order = [("x-order-id", "o-17")];
    let a = admitted(at_headers(&at_headers_only, &head("POST", "/charges", &order), None, false));
    assert_eq!(a.from, KeyFrom::Derived);
    // The same operation derives the same key; another order another key.
    let again = admitted(at_headers(&at_headers_only, &head("POST", "/charges", &order), None, false));
    assert_eq!(a.key, again.key);
    let other =
        admitted(at_headers(&at_headers_only, &head("POST", "/charges", &[("x-order-id", "o-18")]), None, false));
    assert_ne!(a.key, other.key);
    // Without the operation's identifier nothing is derived: unprotected (no key required).
    assert!(matches!(
        at_headers(&at_headers_only, &head("POST", "/charges", &[]), None, false),
        Err(NotProtected::Unprotected { .. })
    ));

    let with_body = config(
        r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-order-id"], "include_body": true}}"#,
    );
    let a = admitted(at_headers(&with_body, &head("POST", "/charges", &order), None, false));
    assert_eq!(a.from, KeyFrom::DerivedAtBody);
    // At the body's end: the key from the body too, added to the head the fingerprint reads.
    let policy = Arc::clone(&a.policy);
    let mut h = head("POST", "/charges", &order);
    let AtBodyEnd::Fingerprinted { fp: fp_a, derived: Some(Derived { key: k_a, skey: s_a }), keep_body: false } =
        at_body_end(&policy, &mut h, &a.scope, true, br#"{"amount":1}"#)
    else {
        panic!("a key is derived with the body");
    };
    assert_eq!(h.values("idempotency-key"), vec![k_a.as_str().as_bytes()]);
    // The storage key is the derived key's, not the provisional one the headers gave.
    assert_eq!(s_a, StorageKey::derive(&policy.namespace, &a.scope, &k_a));
    assert_ne!(s_a, a.skey);
    let mut h2 = head("POST", "/charges", &order);
    let AtBodyEnd::Fingerprinted { fp: fp_b, derived: Some(Derived { key: k_b, .. }), .. } =
        at_body_end(&policy, &mut h2, &a.scope, true, br#"{"amount":2}"#)
    else {
        panic!("a key is derived with the body");
    };
    assert_ne!((k_a, fp_a), (k_b, fp_b), "another body, another operation");
    // A request with no body at all derives at its headers, from the empty body.
    let whole = admitted(at_headers(&with_body, &head("POST", "/charges", &order), None, true));
    assert_eq!(whole.from, KeyFrom::Derived);
    // An anonymous caller never gets a derived key.
    let anonymous = RequestHead::from_pairs(vec![
        (":method".into(), b"POST".to_vec()),
        (":path".into(), b"/charges".to_vec()),
        ("x-order-id".into(), b"o-17".to_vec()),
    ]);
    assert!(matches!(at_headers(&at_headers_only, &anonymous, None, false), Err(NotProtected::Unprotected { .. })));
}

#[test]
fn a_body_end_without_a_key_to_derive_passes_and_a_sent_key_keeps_its_fingerprint() {
    let c = config(SCOPED);
    let a = admitted(at_headers(&c, &head("POST", "/charges", &[("idempotency-key", "k-1")]), None, false));
    let mut h = head("POST", "/charges", &[("idempotency-key", "k-1")]);
    let end = at_body_end(&a.policy, &mut h, &a.scope, false, b"{}");
    let (fp, _) = Fingerprint::compute(&h, b"{}", &a.policy.fingerprint);
    assert_eq!(end, AtBodyEnd::Fingerprinted { fp, derived: None, keep_body: false });
    // derive_key.include_body whose operation identifier is gone at the body's end (a
    // `hold_headers: false` request whose headers changed): not protected.
    let derive = config(
        r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-order-id"], "include_body": true}}"#,
    );
    let a = admitted(at_headers(&derive, &head("POST", "/charges", &[("x-order-id", "o-1")]), None, false));
    assert_eq!(at_body_end(&a.policy, &mut head("POST", "/charges", &[]), &a.scope, true, b"{}"), AtBodyEnd::Pass);
}

#[test]
fn a_body_over_the_routes_limit_is_413_and_over_the_vms_budget_503() {
    let c = config(r#"{"scope": {"headers": ["authorization"]}, "max_request_body_bytes": 1000}"#);
    let policy = c.shared_policy(0).unwrap_or_default();
    // Within both: the bytes not yet counted are added to the VM's count.
    assert_eq!(body_chunk(600, 0, 0, 10_000, &policy), Ok(600));
    assert_eq!(body_chunk(1000, 600, 600, 10_000, &policy), Ok(400));
    let p = body_chunk(1001, 600, 600, 10_000, &policy).err();
    assert_eq!(p, Some(ProblemKind::BodyTooLarge { limit: 1000 }));
    assert_eq!(p.map(|p| p.status()), Some(413));
    // Other requests hold 9,500 bytes of the VM's 10,000: 600 more is over.
    let p = body_chunk(600, 0, 9_500, 10_000, &policy).err();
    assert!(matches!(p, Some(ProblemKind::BufferBudgetExceeded { .. })));
    assert_eq!(p.map(|p| p.status()), Some(503));
}

const MCP: &str = r#"{"scope": {"headers": ["authorization"]},
    "routes": [{"prefix": "/mcp", "protocol": "mcp",
                "mcp": {"tools": ["charge"], "key_arguments": ["idempotency_key"]}}]}"#;

fn mcp_policy() -> (Config, Arc<Policy>) {
    let c = config(MCP);
    let at = at_headers(&c, &head("POST", "/mcp", &[]), None, false);
    let Err(NotProtected::McpBody { route: 0, policy }) = at else { panic!("an MCP POST waits for its body: {at:?}") };
    (c, policy)
}

fn call(id: u32, tool: &str, args: &str, meta: &str) -> Vec<u8> {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{tool}","arguments":{args}{meta}}}}}"#
    )
    .into_bytes()
}

fn mcp_protected(at: AtMcpBody) -> McpCall {
    match at {
        AtMcpBody::Protect(c) => *c,
        other => panic!("not protected: {other:?}"),
    }
}

#[test]
fn an_mcp_tools_call_takes_its_key_from_the_header_then_meta_then_an_argument() {
    let (c, policy) = mcp_policy();
    // Not a body-carrying POST: no tool call.
    assert!(matches!(at_headers(&c, &head("GET", "/mcp", &[]), None, true), Err(NotProtected::Pass)));
    assert!(matches!(
        at_headers(&c, &head("POST", "/mcp", &[]), None, true),
        Err(NotProtected::Unprotected { route: 0 })
    ));
    let plain = head("POST", "/mcp", &[]);
    let meta = mcp_protected(at_mcp_body(
        &policy,
        &plain,
        &call(7, "charge", "{}", r#","_meta":{"idempotencyKey":"k-meta"}"#),
    ));
    assert_eq!(
        (meta.id.as_slice(), meta.tool.as_str(), meta.key.as_str(), meta.derived),
        (&b"7"[..], "charge", "k-meta", false)
    );
    assert_eq!(meta.skey, StorageKey::derive(&policy.namespace, &meta.scope, &meta.key));
    let arg = mcp_protected(at_mcp_body(&policy, &plain, &call(8, "charge", r#"{"idempotency_key":"k-arg"}"#, "")));
    assert_eq!(arg.key.as_str(), "k-arg");
    // The header wins over the body.
    let with_header = head("POST", "/mcp", &[("idempotency-key", "k-header")]);
    let body = call(9, "charge", r#"{"idempotency_key":"k-arg"}"#, r#","_meta":{"idempotencyKey":"k-meta"}"#);
    assert_eq!(mcp_protected(at_mcp_body(&policy, &with_header, &body)).key.as_str(), "k-header");
    // The fingerprint is the tool and its canonical arguments: member order does not matter.
    let a = mcp_protected(at_mcp_body(
        &policy,
        &plain,
        &call(1, "charge", r#"{"a":1,"b":2}"#, r#","_meta":{"idempotencyKey":"k"}"#),
    ));
    let b = mcp_protected(at_mcp_body(
        &policy,
        &plain,
        &call(2, "charge", r#"{"b":2,"a":1}"#, r#","_meta":{"idempotencyKey":"k"}"#),
    ));
    assert_eq!(a.digest, b.digest);
    // A key in the body that is no string is refused to the call's id, as a malformed key.
    let bad = at_mcp_body(&policy, &plain, &call(3, "charge", r#"{"idempotency_key":12}"#, ""));
    let AtMcpBody::Refuse { id, batch, problem: ProblemKind::KeyInvalid { header, .. } } = bad else {
        panic!("a non-string key is refused: {bad:?}");
    };
    assert_eq!((id.as_slice(), batch.len(), header.as_str()), (&b"3"[..], 0, "params.arguments.idempotency_key"));
    // An unlisted tool, or no key where none is required: passed untouched.
    assert!(matches!(
        at_mcp_body(&policy, &plain, &call(4, "lookup", "{}", r#","_meta":{"idempotencyKey":"k"}"#)),
        AtMcpBody::Pass
    ));
    assert!(matches!(at_mcp_body(&policy, &plain, &call(5, "charge", "{}", "")), AtMcpBody::Pass));
}

#[test]
fn an_mcp_batch_holding_a_protected_call_and_an_ambiguous_body_are_refused() {
    let (_, policy) = mcp_policy();
    let plain = head("POST", "/mcp", &[]);
    let mut batch = b"[".to_vec();
    batch.extend(call(1, "charge", "{}", r#","_meta":{"idempotencyKey":"k"}"#));
    batch.extend(br#",{"jsonrpc":"2.0","id":2,"method":"tools/list"}]"#);
    let at = at_mcp_body(&policy, &plain, &batch);
    let AtMcpBody::Refuse { id, batch: ids, problem: ProblemKind::McpBatchRefused } = at else {
        panic!("a batch with a protected call is refused: {at:?}");
    };
    assert_eq!((id, ids), (b"null".to_vec(), vec![b"1".to_vec(), b"2".to_vec()]));
    // A body read two ways (a duplicate member) is never forwarded.
    let twice = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","method":"ping","params":{"name":"charge"}}"#;
    assert!(matches!(
        at_mcp_body(&policy, &plain, twice),
        AtMcpBody::Refuse { problem: ProblemKind::McpBodyAmbiguous, .. }
    ));
    // A protected call under a gRPC content-type: refused to its id.
    let grpc = head("POST", "/mcp", &[("content-type", "application/grpc, application/json")]);
    let at = at_mcp_body(&policy, &grpc, &call(6, "charge", "{}", r#","_meta":{"idempotencyKey":"k"}"#));
    assert!(matches!(at, AtMcpBody::Refuse { ref id, problem: ProblemKind::McpBodyAmbiguous, .. } if id == b"6"));
}

/// One request through the steps the glue runs, as `src/filter/http.rs` runs them: headers (the
/// local tier looked at, nothing claimed), the body, the local claim with the fingerprint on the
/// bucket read at headers, the next step.
fn drive(c: &Config, table: &Table, sd: &mut MemoryShared, key: &str, body: &[u8], owner: u8, now: u64) -> Step {
    let mut h = head("POST", "/charges", &[("idempotency-key", key)]);
    let a = admitted(at_headers(c, &h, None, false));
    let skey = a.skey;
    assert_eq!(skey, StorageKey::derive(&a.policy.namespace, &a.scope, &a.key));
    let creator = Creator { request_id: format!("r-{owner}"), log_values: vec![] };
    let owner = OwnerToken([owner; 16]);
    let store = c.store.as_ref().map(|s| s.on_unavailable);
    let begun = table.begin(sd, skey, None, now, &a.policy, owner, &creator);
    let seen = match after_local(begun, None, store, now) {
        Step::WaitForBody { seen } => seen,
        other => return other,
    };
    assert_eq!(body_chunk(body.len() as u64, 0, 0, c.max_buffered_bytes, &a.policy), Ok(body.len() as u64));
    let AtBodyEnd::Fingerprinted { fp, .. } = at_body_end(&a.policy, &mut h, &a.scope, false, body) else {
        panic!("a sent key needs no derivation");
    };
    let begun = table.begin_after(sd, skey, Some(fp), now, &a.policy, owner, &creator, seen);
    after_local(begun, Some(fp), store, now)
}

#[test]
fn in_memory_a_request_runs_headers_body_and_local_claim_to_forward_and_a_duplicate_meets_it_in_flight() {
    let c = config(SCOPED);
    let table = Table::new(&c.local);
    let mut sd = MemoryShared::default();
    assert!(table.ensure_created(&mut sd).is_ok());
    let first = drive(&c, &table, &mut sd, "k-1", br#"{"amount":1}"#, 1, NOW);
    assert!(matches!(first, Step::Forward { handle: Some(_), in_store: false, lock_from_ms: NOW, .. }), "{first:?}");
    // The same key while the first runs: 409 from the claim at the headers, its body never read.
    let second = drive(&c, &table, &mut sd, "k-1", br#"{"amount":1}"#, 2, NOW + 10);
    assert!(
        matches!(second, Step::InFlight { creator: Some(ref c), release: None, fp: None } if c.request_id == "r-1")
    );
    // Another key runs beside it.
    let other = drive(&c, &table, &mut sd, "k-2", br#"{"amount":1}"#, 3, NOW + 20);
    assert!(matches!(other, Step::Forward { .. }), "{other:?}");
}

/// Issue 40: the stream Envoy re-creates for an internal redirect of an MCP call finds its first
/// stream's claim under the first stream's storage key, whatever the key's source. A derived key
/// holds the path and (through the caller's scope) the authority, so read at the target it is
/// another key: `mcp_first_hop_skey` derives it again at the URL redirected from.
#[test]
fn a_redirected_mcp_call_finds_its_first_streams_key_whatever_its_source() {
    let (_, mut policy) = mcp_policy();
    {
        let p = Arc::make_mut(&mut policy);
        p.derive_key = Some(DeriveKey { headers: vec!["x-step".into()], include_body: false });
        p.scope.include_authority = true;
    }
    let step = ("x-step", "s-1");
    let cases = [
        ("derived", vec![step], "{}".to_string(), ""),
        ("header", vec![step, ("idempotency-key", "k-h")], "{}".to_string(), ""),
        ("meta", vec![step], "{}".to_string(), r#","_meta":{"idempotencyKey":"k-m"}"#),
        ("argument", vec![step], r#"{"idempotency_key":"k-a"}"#.to_string(), ""),
    ];
    for (source, headers, args, meta) in cases {
        let body = call(1, "charge", &args, meta);
        let first = mcp_protected(at_mcp_body(&policy, &head("POST", "/mcp?x=1", &headers), &body));
        assert_eq!(first.derived, source == "derived");
        for (target_authority, url) in [
            ("idemgate.test", &b"http://idemgate.test/mcp?x=1"[..]),
            ("pay.example.test", b"http://idemgate.test/mcp?x=1"),
        ] {
            let mut target = head("POST", "/mcp/target", &headers);
            target.authority = target_authority.into();
            let at_target = mcp_protected(at_mcp_body(&policy, &target, &body));
            if source == "derived" {
                // Read at the target alone, the derived key is another one: no hand-over found.
                assert_ne!(at_target.key, first.key, "{source} {target_authority}");
            }
            assert_eq!(
                mcp_first_hop_skey(&policy, &target, url, &at_target),
                Some(first.skey),
                "{source} at {target_authority}"
            );
        }
        // A URL naming another path is another first request (a forged or unrelated one).
        if source == "derived" {
            let target = head("POST", "/mcp/target", &headers);
            let at_target = mcp_protected(at_mcp_body(&policy, &target, &body));
            assert_ne!(
                mcp_first_hop_skey(&policy, &target, b"http://idemgate.test/other", &at_target),
                Some(first.skey)
            );
        }
    }
}

/// The key `derive_key.include_body` derives (from `x-op: op-1` and the body) for a POST of
/// `body` to /v1/payments, sent with `content_type` if any. The request is admitted at its
/// headers without a content type, as the boundary oracle's requests were read.
fn include_body_key(content_type: Option<&str>, body: &str) -> IdempotencyKey {
    let c = config(
        r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-op"], "include_body": true}}"#,
    );
    let op = [("x-op", "op-1")];
    let a = admitted(at_headers(&c, &head("POST", "/v1/payments", &op), None, false));
    let mut h = match content_type {
        Some(t) => head("POST", "/v1/payments", &[("x-op", "op-1"), ("content-type", t)]),
        None => head("POST", "/v1/payments", &op),
    };
    match at_body_end(&a.policy, &mut h, &a.scope, true, body.as_bytes()) {
        AtBodyEnd::Fingerprinted { derived: Some(d), .. } => d.key,
        other => panic!("no key derived for {body}: {other:?}"),
    }
}

#[test]
fn include_body_derives_one_key_for_bodies_every_json_parser_reads_alike() {
    // The boundary oracle (issue 41, configuration `include_body`): Flask, Django, FastAPI,
    // Express, Fastify and Go parse each of these as the canonical body, and each derived another
    // key from its raw bytes, so the second executed again.
    let key = |body: &str| include_body_key(None, body);
    let canonical = key(r#"{"amount":1,"currency":"eur"}"#);
    for alike in [
        r#"{"amount": 1, "currency": "eur"}"#,
        r#"{"currency":"eur","amount":1}"#,
        r#"{"amount":1.0,"currency":"eur"}"#,
        r#"{"amount":1e0,"currency":"eur"}"#,
        r#"{"amount":10E-1,"currency":"eur"}"#,
        r#"{"amount":1,"currency":"\u0065ur"}"#,
    ] {
        assert_eq!(key(alike), canonical, "{alike}");
    }
    for apart in [
        r#"{"amount":2,"currency":"eur"}"#,
        r#"{"amount":1,"currency":"usd"}"#,
        r#"{"amount":"1","currency":"eur"}"#,
        r#"{"amount":1,"currency":"eur","note":null}"#,
        r#"[{"amount":1,"currency":"eur"}]"#,
    ] {
        assert_ne!(key(apart), canonical, "{apart}");
    }
    // -0 and 0 are one number to Python's and JavaScript's parsers alike.
    assert_eq!(key(r#"{"n":-0}"#), key(r#"{"n":0}"#));
    // A body that is not JSON derives from its bytes, as before.
    assert_ne!(key("amount=1&currency=eur"), key("currency=eur&amount=1"));
}

#[test]
fn include_body_refuses_a_json_body_naming_a_member_twice_before_anything_is_claimed() {
    // `{"a":1,"a":2}` is `{"a":2}` to Python's `json`, `JSON.parse` and Go, and `{"a":1}` to
    // pysimdjson's `Parser().parse`: a key derived from the last value (before this rule) let
    // the first-value reader run it and `{"a":1}` as one request under two keys, twice.
    let c = config(
        r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-op"], "include_body": true}}"#,
    );
    let op = [("x-op", "op-1"), ("content-type", "application/json")];
    let a = admitted(at_headers(&c, &head("POST", "/v1/payments", &op), None, false));
    for body in [
        r#"{"a":1,"a":2}"#,
        r#"{"a":1,"\u0061":2}"#,
        r#"{"amount":1,"currency":"eur","c\u0075rrency":"eur"}"#,
        r#"{"order":{"lines":[{"sku":"x","qty":1,"qty":2}]}}"#,
        r#"[{"a":1},{"b":1,"b":1}]"#,
        r#"{"x":[[{"y":{"z":0,"\u007a":0}}]]}"#,
    ] {
        let mut h = head("POST", "/v1/payments", &op);
        let end = at_body_end(&a.policy, &mut h, &a.scope, true, body.as_bytes());
        assert_eq!(end, AtBodyEnd::Refuse(ProblemKind::BodyAmbiguous), "{body}");
        // No key was added for the upstream to read.
        assert!(h.values(&a.policy.header).is_empty(), "{body}");
    }
    let p = ProblemKind::BodyAmbiguous.to_problem("r1", None);
    assert_eq!((p.status, ProblemKind::BodyAmbiguous.slug()), (400, "body-ambiguous"));
    // The same name in two objects, a form's repeated field, and a body that is not JSON are
    // read as before: a key.
    for (content_type, body) in [
        ("application/json", r#"[{"a":1},{"a":2}]"#),
        ("application/json", r#"{"a":{"a":1}}"#),
        ("application/json", r#"{"a":1,"a":2"#),
        ("application/x-www-form-urlencoded", "a=1&a=2"),
    ] {
        let mut h = head("POST", "/v1/payments", &[("x-op", "op-1"), ("content-type", content_type)]);
        let end = at_body_end(&a.policy, &mut h, &a.scope, true, body.as_bytes());
        assert!(matches!(end, AtBodyEnd::Fingerprinted { derived: Some(_), .. }), "{body}: {end:?}");
    }
    // A key the client sends: the body's bytes are fingerprinted, nothing refused.
    let mut h = head("POST", "/v1/payments", &op);
    let end = at_body_end(&a.policy, &mut h, &a.scope, false, br#"{"a":1,"a":2}"#);
    assert!(matches!(end, AtBodyEnd::Fingerprinted { derived: None, .. }), "{end:?}");
}

#[test]
fn include_body_refuses_a_json_body_that_is_not_unicode() {
    // `{"a":"\ud800"}`, `{"a":"\xff"}` and `{"a":"\ufffd"}` are one request to Go's
    // `encoding/json` (U+FFFD each); before, the first two derived keys from their bytes and the
    // third from its form: three keys, three executions behind Go
    // (`boundary_oracle::oracle_full_a_json_body_that_is_not_unicode_is_refused_before_a_go_backend`).
    let c = config(
        r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-op"], "include_body": true}}"#,
    );
    let op = [("x-op", "op-1"), ("content-type", "application/json")];
    let a = admitted(at_headers(&c, &head("POST", "/v1/payments", &op), None, false));
    for body in [&br#"{"a":"\ud800"}"#[..], br#"{"x":[{"a":"\udc00"}]}"#, b"{\"a\":\"\xff\"}"] {
        let mut h = head("POST", "/v1/payments", &op);
        let end = at_body_end(&a.policy, &mut h, &a.scope, true, body);
        assert_eq!(end, AtBodyEnd::Refuse(ProblemKind::BodyAmbiguous), "{}", String::from_utf8_lossy(body));
        assert!(h.values(&a.policy.header).is_empty());
    }
    // U+FFFD written as such, and bytes that are no JSON at all, derive a key as before.
    for body in [&br#"{"a":"\ufffd"}"#[..], "{\"a\":\"\u{fffd}\"}".as_bytes(), b"\xff\xfe binary"] {
        let mut h = head("POST", "/v1/payments", &op);
        let end = at_body_end(&a.policy, &mut h, &a.scope, true, body);
        assert!(matches!(end, AtBodyEnd::Fingerprinted { derived: Some(_), .. }), "{end:?}");
    }
}

#[test]
fn include_body_derives_one_key_for_form_bodies_every_form_parser_reads_alike() {
    // The boundary oracle (issue 41, configuration `include_body`, the `form` spellings): Flask,
    // Django, FastAPI, Express, Fastify, Go and Tomcat parse each of these urlencoded bodies into
    // the canonical body's fields, and each derived another key from its raw bytes, so the second
    // executed again.
    let key_as = |content_type: &str, body: &str| include_body_key(Some(content_type), body);
    let key = |body: &str| key_as("application/x-www-form-urlencoded", body);
    let canonical = key("amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y");
    for alike in [
        "currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y&amount=1",
        "amount=1&currency=eur&memo=a%20b%2Fcaf%C3%A9&tag=x&tag=y",
        "%61mount=1&currency=%65ur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y",
        "amount=1&currency=eur&memo=a+b%2fcaf%c3%a9&tag=x&tag=y",
        "amount=1&currency=eur&memo=a+b/caf%C3%A9&tag=x&tag=y",
        "amount=1&currency=eur&memo=a+b%2Fcaf\u{e9}&tag=x&tag=y",
        "amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y&",
        "&amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y",
        "amount=1&&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y",
        "tag=x&amount=1&currency=eur&tag=y&memo=a+b%2Fcaf%C3%A9",
    ] {
        assert_eq!(key(alike), canonical, "{alike}");
    }
    for content_type in ["application/x-www-form-urlencoded; charset=utf-8", "Application/X-WWW-Form-URLEncoded"] {
        assert_eq!(key_as(content_type, "currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y&amount=1"), canonical);
    }
    // Every framework keeps a repeated field's values in the order sent, and `+` in a value is
    // a space only when written `+`, not `%2B`.
    for apart in [
        "amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=y&tag=x",
        "amount=1&currency=eur&memo=a%2Bb%2Fcaf%C3%A9&tag=x&tag=y",
        "amount=2&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y",
        "amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x",
        "amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y&tag=",
    ] {
        assert_ne!(key(apart), canonical, "{apart}");
    }
    // A body of another type derives from its bytes, as before.
    assert_ne!(key_as("text/plain", "amount=1&currency=eur"), key_as("text/plain", "currency=eur&amount=1"));
}

#[test]
fn include_body_derives_one_key_for_multipart_bodies_every_multipart_parser_reads_alike() {
    // The boundary oracle (issue 41, configuration `include_body`, the `multipart` spellings, seed
    // 41: 130 counterexamples): Flask, Django, FastAPI, Express, Fastify, Go and Tomcat parse each
    // of these multipart/form-data bodies into the canonical body's fields and files, and each
    // derived another key from its raw bytes, so the second executed again.
    let c = config(
        r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-op"], "include_body": true}}"#,
    );
    let op = [("x-op", "op-1")];
    let a = admitted(at_headers(&c, &head("POST", "/v1/payments", &op), None, false));
    let key_as = |content_type: &str, body: &str| {
        let mut h = head("POST", "/v1/payments", &[("x-op", "op-1"), ("content-type", content_type)]);
        match at_body_end(&a.policy, &mut h, &a.scope, true, body.as_bytes()) {
            AtBodyEnd::Fingerprinted { derived: Some(d), .. } => d.key,
            other => panic!("no key derived for {body}: {other:?}"),
        }
    };
    let body = |boundary: &str, parts: &[&str]| {
        let mut b: String = parts.iter().map(|p| format!("--{boundary}\r\n{p}\r\n")).collect();
        b.push_str(&format!("--{boundary}--\r\n"));
        b
    };
    let (amount, currency, tag_x, tag_y, doc) = (
        "Content-Disposition: form-data; name=\"amount\"\r\n\r\n1",
        "Content-Disposition: form-data; name=\"currency\"\r\n\r\neur",
        "Content-Disposition: form-data; name=\"tag\"\r\n\r\nx",
        "Content-Disposition: form-data; name=\"tag\"\r\n\r\ny",
        "Content-Disposition: form-data; name=\"doc\"; filename=\"a.txt\"\r\nContent-Type: text/plain\r\n\r\nhello",
    );
    let canonical_body = body("b1", &[amount, currency, tag_x, tag_y, doc]);
    let key = |body: &str| key_as("multipart/form-data; boundary=b1", body);
    let canonical = key(&canonical_body);
    for alike in [
        body("b1", &[currency, tag_x, tag_y, doc, amount]),
        body("b1", &[doc, tag_x, currency, amount, tag_y]),
        canonical_body.replace("Content-Disposition: form-data; ", "content-disposition:Form-Data;"),
        canonical_body.replace("name=\"amount\"", "Name=amount"),
        canonical_body.replace("name=\"doc\"; filename=\"a.txt\"", "filename=\"a.txt\"; name=\"doc\""),
        canonical_body.replace("Content-Type: text/plain", "Content-Type: application/octet-stream"),
        format!("preamble\r\n{canonical_body}epilogue\r\n"),
        canonical_body.trim_end().to_string(),
        canonical_body.replace("\r\n", "\n"),
    ] {
        assert_eq!(key(&alike), canonical, "{alike}");
    }
    assert_eq!(
        key_as("multipart/form-data; boundary=\"b2\"", &body("b2", &[amount, currency, tag_x, tag_y, doc])),
        canonical
    );
    assert_eq!(key_as("Multipart/Form-Data; Boundary=b1", &canonical_body), canonical);
    // Every framework keeps a repeated field's values in the order sent, and reads a file by its
    // name and content.
    for apart in [
        body("b1", &[amount, currency, tag_y, tag_x, doc]),
        canonical_body.replace("filename=\"a.txt\"", "filename=\"b.txt\""),
        canonical_body.replace("\r\n\r\nhello", "\r\n\r\nhello!"),
        canonical_body.replace("\r\n\r\n1\r\n", "\r\n\r\n2\r\n"),
    ] {
        assert_ne!(key(&apart), canonical, "{apart}");
    }
    // A body this reader does not take derives from its bytes, as before.
    let folded = canonical_body.replace("name=\"amount\"", "name=\"a\\mount\"");
    assert_ne!(key(&folded), key(&folded.replace("name=\"currency\"", "name=currency")));
}

#[test]
fn mcp_derive_key_derives_one_key_for_arguments_every_json_parser_reads_alike() {
    // The boundary oracle (issue 41, configuration `mcp_derive_key`): Express, Fastify and Go
    // parse `"amount":1.0` as `"amount":1`, every backend `"\u0065ur"` as `"eur"`; the derived
    // key came from the arguments' spelling, so the second call executed again.
    let c = config(
        r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-op"]}, "routes": [{"prefix": "/mcp", "protocol": "mcp"}]}"#,
    );
    let at = at_headers(&c, &head("POST", "/mcp", &[("x-op", "op-1")]), None, false);
    let Err(NotProtected::McpBody { policy, .. }) = at else { panic!("an MCP POST waits for its body: {at:?}") };
    let h = head("POST", "/mcp", &[("x-op", "op-1")]);
    let key = |args: &str| {
        let c = mcp_protected(at_mcp_body(&policy, &h, &call(7, "charge", args, "")));
        assert!(c.derived, "{args}: derived");
        c.key
    };
    let canonical = key(r#"{"amount":1,"currency":"eur"}"#);
    for alike in [
        r#"{"currency": "eur", "amount": 1}"#,
        r#"{"amount":1.0,"currency":"eur"}"#,
        r#"{"amount":1,"currency":"\u0065ur"}"#,
    ] {
        assert_eq!(key(alike), canonical, "{alike}");
    }
    assert_ne!(key(r#"{"amount":2,"currency":"eur"}"#), canonical);
    assert_ne!(key(r#"{"amount":"1","currency":"eur"}"#), canonical);
}
