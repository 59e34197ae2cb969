//! One Envoy 1.40 (two workers, exact_balance) with idemgate and no external store, in front of
//! a counting upstream. Every test asserts how many times the upstream executed.

use crate::support;

use std::io::{Read, Write};
use std::time::Duration;

use support::http::{self, Response};
use support::{Build, Stack};

/// The fault and security cases (`make test-faults`).
mod faults;

const CFG: &str = r#"{"scope": {"headers": ["authorization"]}}"#;

/// `post` is this suite's own request shape (JSON content type, optional key).
impl Stack {
    fn post(&self, path: &str, key: Option<&str>, body: &str, extra: &[(&str, &str)]) -> Response {
        let mut h: Vec<(&str, &str)> = vec![("authorization", "Bearer alice"), ("content-type", "application/json")];
        if let Some(k) = key {
            h.push(("idempotency-key", k));
        }
        h.extend_from_slice(extra);
        http::request(self.envoy.port, "POST", path, &h, body.as_bytes()).expect("request")
    }
}

fn problem_type(r: &Response) -> String {
    r.json()["type"].as_str().unwrap_or("").to_string()
}

#[test]
fn same_key_twice_executes_once_and_replays_byte_identical_with_the_header() {
    let s = Stack::new(CFG);
    let a = s.post("/charges", Some("k-1"), r#"{"amount":100}"#, &[]);
    let b = s.post("/charges", Some("k-1"), r#"{"amount":100}"#, &[]);
    assert_eq!(a.status, 201, "{}", a.body_text());
    assert_eq!(s.up.executions(), 1);
    assert_eq!(b.status, 201);
    assert_eq!(b.body, a.body);
    assert_eq!(b.header("idempotent-replayed"), Some("true"));
    assert_eq!(a.header("idempotent-replayed"), None);
    assert_eq!(b.header("location"), a.header("location"));
    assert_eq!(b.header("x-execution"), Some("1"));
    // The expiry policy is published: the full ttl on the first answer, what is left on a replay.
    assert_eq!(a.header("idempotency-key-expires-in"), Some("86400"));
    let left: u64 = b.header("idempotency-key-expires-in").and_then(|v| v.parse().ok()).unwrap();
    assert!((86_390..=86_400).contains(&left), "{left}");
    assert_eq!(s.envoy.stat("idemgate.replayed"), 1);
    assert_eq!(s.envoy.stat("idemgate.claimed"), 1);
    assert_eq!(s.envoy.stat("idemgate.stored"), 1);
}

#[test]
fn same_key_with_another_body_or_path_or_method_is_422_without_executing() {
    let s = Stack::new(r#"{"scope": {"headers": ["authorization"]}, "methods": ["POST", "PUT"]}"#);
    assert_eq!(s.post("/charges", Some("k-2"), r#"{"amount":100}"#, &[]).status, 201);
    let other_body = s.post("/charges", Some("k-2"), r#"{"amount":999}"#, &[]);
    assert_eq!(other_body.status, 422, "{}", other_body.body_text());
    assert_eq!(problem_type(&other_body), "urn:idemgate:problem:key-reused");
    assert_eq!(other_body.header("content-type"), Some("application/problem+json"));
    let other_path = s.post("/refunds", Some("k-2"), r#"{"amount":100}"#, &[]);
    assert_eq!(other_path.status, 422);
    let h = [("authorization", "Bearer alice"), ("idempotency-key", "k-2")];
    let other_method = http::request(s.envoy.port, "PUT", "/charges", &h, br#"{"amount":100}"#).unwrap();
    assert_eq!(other_method.status, 422);
    assert_eq!(s.up.executions(), 1);
    assert_eq!(s.envoy.stat("idemgate.mismatch"), 3);
    // The 422 names the request that created the record.
    assert!(other_body.json()["original_request"]["request_id"].as_str().is_some_and(|id| !id.is_empty()));
}

#[test]
fn fifty_concurrent_identical_requests_execute_exactly_once() {
    let s = Stack::new(CFG);
    let port = s.envoy.port;
    let threads: Vec<_> = (0..50)
        .map(|_| {
            std::thread::spawn(move || {
                let h = [("authorization", "Bearer alice"), ("idempotency-key", "k-burst"), ("x-up-delay-ms", "300")];
                http::request(port, "POST", "/charges", &h, br#"{"amount":1}"#).expect("request")
            })
        })
        .collect();
    let answers: Vec<Response> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(s.up.executions(), 1);
    let first: Vec<&Response> =
        answers.iter().filter(|r| r.status == 201 && r.header("idempotent-replayed").is_none()).collect();
    assert_eq!(first.len(), 1);
    for r in &answers {
        match r.status {
            201 => assert_eq!(r.body, first[0].body),
            409 => {
                assert_eq!(problem_type(r), "urn:idemgate:problem:request-in-flight");
                assert!(r.header("retry-after").is_some());
            }
            other => panic!("unexpected {other}: {}", r.body_text()),
        }
    }
}

#[test]
fn missing_key_with_require_key_is_400_and_without_it_passes_unprotected() {
    let s = Stack::new(
        r#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/strict", "require_key": true}, {"prefix": "/"}]}"#,
    );
    let r = s.post("/strict/charges", None, "{}", &[]);
    assert_eq!(r.status, 400);
    assert_eq!(problem_type(&r), "urn:idemgate:problem:key-missing");
    assert_eq!(s.up.executions(), 0);
    assert_eq!(s.post("/loose", None, "{}", &[]).status, 201);
    assert_eq!(s.post("/loose", None, "{}", &[]).status, 201);
    assert_eq!(s.up.executions(), 2, "without a key and without require_key, requests pass unprotected");
    assert_eq!(s.envoy.stat("idemgate.missing_key"), 1);
}

/// Keys as clients write them (issue 25): RFC 8941 tokens (`:` and `/`) and sf-strings with
/// spaces by default; Stripe's rule (any visible ASCII and spaces) with `key_syntax: "any"`;
/// hostile keys refused under both, with a 400 whose detail names the rule. Each accepted key
/// executes once and replays.
#[test]
fn keys_as_clients_write_them_under_each_key_syntax() {
    let strict = Stack::new(CFG);
    let any = Stack::new(r#"{"scope": {"headers": ["authorization"]}, "key_syntax": "any"}"#);
    let mut executions = 0;
    for (s, keys) in [
        (&strict, &["run-7:step/1", "urn:task:42/step:3", "\"step 1 of run 7\""][..]),
        (&any, &["run-7:step/1", "a=b c", "task 7, step 1", "{\"step\": 1}"][..]),
    ] {
        for key in keys {
            let first = s.post("/charges", Some(key), "{}", &[]);
            assert_eq!(first.status, 201, "{key}: {}", first.body_text());
            let again = s.post("/charges", Some(key), "{}", &[]);
            assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")), "{key}");
            assert_eq!(again.body, first.body, "{key}");
        }
        executions += keys.len() as u64;
    }
    assert_eq!(strict.up.executions() + any.up.executions(), executions);
    // The strict rule: `=` and a bare space are not token characters; the detail names the rule.
    for (key, slug) in [("a=b", "key-not-a-token"), ("a b", "key-not-visible-ascii")] {
        let r = strict.post("/charges", Some(key), "{}", &[]);
        assert_eq!((r.status, problem_type(&r)), (400, format!("urn:idemgate:problem:{slug}")), "{key}");
        let detail = r.json()["detail"].as_str().unwrap_or("").to_string();
        assert!(detail.contains("key_syntax: \"strict\"") && detail.contains("!#$%&'*+-.^_`|~:/"), "{detail}");
    }
    // Hostile keys: 400 under both rules, nothing forwarded.
    let long = "k".repeat(256);
    for s in [&strict, &any] {
        let before = s.up.executions();
        for (key, slug) in [(long.as_str(), "key-too-long"), ("a\tb", "key-not-visible-ascii")] {
            let r = s.post("/charges", Some(key), "{}", &[]);
            assert_eq!((r.status, problem_type(&r)), (400, format!("urn:idemgate:problem:{slug}")), "{key}");
            assert_eq!(r.header("stripe-should-retry"), Some("false"));
        }
        let req =
            b"POST /charges HTTP/1.1\r\nhost: t\r\nconnection: close\r\nauthorization: a\r\ncontent-length: 2\r\nidempotency-key: caf\xc3\xa9\r\n\r\n{}".to_vec();
        let r = s.raw(&req);
        assert_eq!((r.status, problem_type(&r).as_str()), (400, "urn:idemgate:problem:key-not-visible-ascii"));
        // DEL: refused by Envoy's codec or by idemgate; a 400 either way.
        assert_eq!(s.post("/charges", Some("a\x7fb"), "{}", &[]).status, 400);
        assert_eq!(s.up.executions(), before);
    }
    let r = any.post("/charges", Some(&long), "{}", &[]);
    let detail = r.json()["detail"].as_str().unwrap_or("").to_string();
    assert!(detail.contains("key_syntax: \"any\"") && detail.contains("1 to 255"), "{detail}");
}

#[test]
fn get_with_a_key_is_untouched() {
    let s = Stack::new(CFG);
    for _ in 0..2 {
        let r = http::request(
            s.envoy.port,
            "GET",
            "/charges",
            &[("idempotency-key", "k-get"), ("authorization", "a")],
            b"",
        )
        .unwrap();
        assert_eq!(r.status, 201);
        assert!(r.header("idempotent-replayed").is_none());
    }
    assert_eq!(s.up.executions(), 2);
    assert_eq!(s.envoy.stat("idemgate.protected"), 0);
}

#[test]
fn upstream_500_is_stored_and_replayed() {
    let s = Stack::new(CFG);
    let a = s.post("/charges", Some("k-500"), "{}", &[("x-up-status", "500")]);
    let b = s.post("/charges", Some("k-500"), "{}", &[("x-up-status", "500")]);
    assert_eq!((a.status, b.status), (500, 500));
    assert_eq!(b.body, a.body);
    assert_eq!(b.header("idempotent-replayed"), Some("true"));
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn upstream_429_releases_the_key() {
    let s = Stack::new(CFG);
    assert_eq!(s.post("/charges", Some("k-429"), "{}", &[("x-up-status", "429")]).status, 429);
    assert_eq!(s.post("/charges", Some("k-429"), "{}", &[]).status, 201);
    assert_eq!(s.up.executions(), 2);
    assert_eq!(s.envoy.stat("idemgate.released"), 1);
}

#[test]
fn short_ttl_executes_again_after_expiry() {
    let s = Stack::new(r#"{"scope": {"headers": ["authorization"]}, "ttl_seconds": 2, "lock_ttl_seconds": 1}"#);
    s.post("/charges", Some("k-ttl"), "{}", &[]);
    assert_eq!(s.post("/charges", Some("k-ttl"), "{}", &[]).header("idempotent-replayed"), Some("true"));
    std::thread::sleep(Duration::from_millis(2100));
    let r = s.post("/charges", Some("k-ttl"), "{}", &[]);
    assert!(r.header("idempotent-replayed").is_none());
    assert_eq!(s.up.executions(), 2);
}

#[test]
fn counters_are_exported_to_prometheus_without_the_envoy_prefix() {
    let s = Stack::new(CFG);
    s.post("/charges", Some("k-prom"), "{}", &[]);
    // Counters reach Envoy on the root's tick: `prometheus` waits (bounded) until this request's
    // are there. The native build's series carry Envoy's prefix until docs/native.md's relabel
    // rule takes it off, as an operator's Prometheus does (`Envoy::prometheus`).
    let text = s.envoy.prometheus();
    let line = text
        .lines()
        .find(|l| l.starts_with("idemgate_claimed"))
        .unwrap_or_else(|| panic!("no idemgate_claimed in:\n{text}"));
    assert!(line.ends_with(" 1"), "{line}");
}

#[test]
fn the_shipped_envoy_configs_are_valid() {
    for file in ["envoy/envoy.yaml", "envoy/two-proxies/envoy-a.yaml", "envoy/two-proxies/envoy-b.yaml"] {
        let (ok, out) = support::envoy_validate(&support::repo_root().join(file));
        assert!(ok, "{file}: {out}");
        assert!(out.contains("configuration accepted"), "{file}: idemgate checked its plugin configuration:\n{out}");
    }
}

/// A route retry policy that would re-send a 5xx up to twice.
const RETRY_5XX: &str = "{retry_on: 5xx, num_retries: 2}";

/// A filter after idemgate that undoes its protection: it removes the `x-envoy-max-retries: 0`
/// idemgate sets, so the route's retry policy applies to a protected request.
const LUA_REENABLES_RETRIES: &str = r#"          - name: envoy.filters.http.lua
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
              default_source_code:
                inline_string: |
                  function envoy_on_request(h) h:headers():remove("x-envoy-max-retries") end
"#;

#[test]
fn a_route_retry_policy_never_re_sends_a_protected_request() {
    let s = Stack::with(CFG, |o| o.retry_policy = Some(RETRY_5XX.into()));
    // The policy is live: an unprotected request answered 503 is sent three times.
    let r = s.post("/charges", None, "{}", &[("x-up-status", "503")]);
    assert_eq!(r.status, 503);
    assert_eq!(s.up.executions(), 3, "the route's retry policy re-sends unprotected requests");
    // A protected one is sent once; its 503 is the result, kept for the retry.
    let a = s.post("/charges", Some("k-route-retry"), "{}", &[("x-up-status", "503")]);
    assert_eq!(a.status, 503, "{}", a.body_text());
    assert_eq!(s.up.executions_with_key("k-route-retry"), 1, "a protected request executed more than once");
    let b = s.post("/charges", Some("k-route-retry"), "{}", &[("x-up-status", "503")]);
    assert_eq!(b.header("idempotent-replayed"), Some("true"));
    assert_eq!(s.up.executions_with_key("k-route-retry"), 1);
    assert_eq!(s.envoy.stat("idemgate.stored"), 1);
    assert_eq!(s.envoy.stat("idemgate.upstream_attempts_repeated"), 0);
}

#[test]
fn hedging_on_per_try_timeout_never_sends_a_protected_request_twice() {
    // Hedging: at each 300 ms per-try timeout Envoy sends another attempt while the first runs
    // (2 s), so all three have arrived long before the first answers.
    let s = Stack::with(CFG, |o| {
        o.retry_policy = Some("{retry_on: 5xx, num_retries: 2, per_try_timeout: 0.3s}".into());
        o.hedge_policy = Some("{hedge_on_per_try_timeout: true}".into());
    });
    let slow = [("x-up-delay-ms", "2000")];
    assert_eq!(s.post("/charges", None, "{}", &slow).status, 201);
    assert_eq!(s.up.executions(), 3, "the hedge policy sends unprotected requests three times");
    let a = s.post("/charges", Some("k-hedged"), "{}", &slow);
    assert_eq!(s.up.executions_with_key("k-hedged"), 1, "a protected request executed more than once");
    // With hedging a per-try timeout does not cancel the attempt: with no retry left, Envoy
    // waits for it, and its answer is the one kept.
    assert_eq!(a.status, 201, "{}", a.body_text());
    let b = s.post("/charges", Some("k-hedged"), "{}", &slow);
    assert_eq!(b.header("idempotent-replayed"), Some("true"));
    assert_eq!(b.body, a.body);
    assert_eq!(s.up.executions_with_key("k-hedged"), 1);
    assert_eq!(s.envoy.stat("idemgate.upstream_attempts_repeated"), 0);
}

#[test]
fn a_client_asking_envoy_for_retries_cannot_make_it_re_send_a_protected_request() {
    // Envoy honours these headers from internal clients (loopback here, as a mesh's sidecars).
    let s = Stack::with(CFG, |o| o.internal_clients = true);
    let ask = [
        ("x-up-status", "503"),
        ("x-envoy-retry-on", "5xx,reset,retriable-status-codes"),
        ("x-envoy-retriable-status-codes", "503"),
        ("x-envoy-retry-grpc-on", "unavailable"),
        ("x-envoy-max-retries", "3"),
    ];
    let r = s.post("/charges", None, "{}", &ask);
    assert_eq!(r.status, 503);
    assert_eq!(s.up.executions(), 4, "Envoy honours a client's retry headers on unprotected requests");
    let a = s.post("/charges", Some("k-client-retry"), "{}", &ask);
    assert_eq!(a.status, 503, "{}", a.body_text());
    assert_eq!(s.up.executions_with_key("k-client-retry"), 1, "a protected request executed more than once");
    // The upstream never sees the retry headers of a protected request.
    let seen = s.up.log().into_iter().rfind(|e| e.key.as_deref() == Some("k-client-retry")).unwrap();
    assert!(!seen.headers.iter().any(|(n, _)| n.starts_with("x-envoy-retr")), "{:?}", seen.headers);
}

#[test]
fn a_client_cannot_disable_the_routes_timeout_for_a_protected_request() {
    // Envoy honours x-envoy-upstream-rq-timeout-ms from internal clients (loopback here, as a
    // mesh's sidecars): 0 turns the route's timeout off. lock_ttl_seconds is sized to outlast the
    // route's timeout, so a protected request must keep it.
    let s = Stack::with(CFG, |o| {
        o.internal_clients = true;
        o.route_timeout_ms = 1000;
    });
    let ask = [("x-up-delay-ms", "2500"), ("x-envoy-upstream-rq-timeout-ms", "0")];
    let r = s.post("/charges", None, "{}", &ask);
    assert_eq!(r.status, 201, "Envoy honours a client's timeout header on unprotected requests");
    let a = s.post("/charges", Some("k-client-timeout"), "{}", &ask);
    assert_eq!(a.status, 504, "the route's 1 s timeout held: {}", a.body_text());
    assert_eq!(s.up.executions_with_key("k-client-timeout"), 1);
}

#[test]
fn an_exchange_re_sent_behind_idemgates_back_is_counted_and_logged() {
    // A later filter that undoes idemgate's protection: nothing idemgate can stop, so it reports it.
    let s = Stack::with(CFG, |o| {
        o.retry_policy = Some(RETRY_5XX.into());
        o.filters_after_idemgate = LUA_REENABLES_RETRIES.into();
    });
    let a = s.post("/charges", Some("k-behind"), "{}", &[("x-up-status", "503")]);
    assert_eq!(a.status, 503, "{}", a.body_text());
    assert_eq!(s.up.executions_with_key("k-behind"), 3, "the later filter re-enabled the route's retries");
    assert_eq!(s.envoy.stat("idemgate.upstream_attempts_repeated"), 1);
    let log = s.envoy.log();
    assert!(log.contains("outcome=upstream_attempts_repeated") && log.contains("attempts=3"), "{log}");
}

/// Spellings of `/v1/payments` that an upstream (or a framework's router) may serve as the same
/// resource: a key is protected on every one of them.
const PAYMENT_SPELLINGS: &[&str] = &[
    "/v1//payments",
    "//v1/payments",
    "/v1/./payments",
    "/v1/%70ayments",
    "/v1/payments/../payments",
    "/v1/%2E/payments",
    "/x/../v1/payments?cur=eu",
    // A WHATWG URL parser (browsers, Node's URL) reads a backslash as a slash.
    "/v1\\payments",
];

#[test]
fn a_route_prefix_protects_every_spelling_of_its_path() {
    let s = Stack::new(r#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/v1/payments"}]}"#);
    assert_eq!(s.post("/v1/payments", Some("k-path"), "{}", &[]).status, 201);
    let mut executed_again = vec![];
    for path in PAYMENT_SPELLINGS {
        let before = s.up.executions();
        let r = s.post(path, Some("k-path"), "{}", &[]);
        if s.up.executions() != before {
            executed_again.push(format!("{path} (answered {})", r.status));
        } else {
            // The fingerprint keeps the path as sent: another spelling is another request.
            assert_eq!(problem_type(&r), "urn:idemgate:problem:key-reused", "{path}: {}", r.status);
        }
    }
    assert!(executed_again.is_empty(), "one key executed again through: {executed_again:?}");
    // Each spelling is protected on its own too: its own key twice executes once.
    for (n, path) in PAYMENT_SPELLINGS.iter().enumerate() {
        let key = format!("k-spelling-{n}");
        let a = s.post(path, Some(&key), "{}", &[]);
        let b = s.post(path, Some(&key), "{}", &[]);
        assert_eq!(s.up.executions_with_key(&key), 1, "{path}: {} then {}", a.status, b.status);
        assert_eq!(b.header("idempotent-replayed"), Some("true"), "{path}");
    }
    // Another path stays unprotected: the normal form is used to select, not to protect everything.
    s.post("/v1/refunds", Some("k-refund"), "{}", &[]);
    s.post("/v1/refunds", Some("k-refund"), "{}", &[]);
    assert_eq!(s.up.executions_with_key("k-refund"), 2);
}

#[test]
fn a_case_insensitive_route_protects_every_case_of_its_path() {
    let s = Stack::new(
        r#"{"scope": {"headers": ["authorization"]},
            "routes": [{"prefix": "/v1/payments", "case_insensitive": true}, {"prefix": "/v2/payments", "case_insensitive": false}]}"#,
    );
    assert_eq!(s.post("/v1/payments", Some("k-case"), "{}", &[]).status, 201);
    for path in ["/V1/payments", "/v1/PAYMENTS", "//V1/%50ayments"] {
        let r = s.post(path, Some("k-case"), "{}", &[]);
        assert_eq!(s.up.executions_with_key("k-case"), 1, "{path} executed again (answered {})", r.status);
    }
    // Case-sensitive on request: `/V2/payments` is another path.
    s.post("/v2/payments", Some("k-case-2"), "{}", &[]);
    s.post("/V2/payments", Some("k-case-2"), "{}", &[]);
    assert_eq!(s.up.executions_with_key("k-case-2"), 2);
}

#[test]
fn a_route_name_selects_the_policy_of_the_envoy_route_that_matched() {
    route_name_selects_the_policy(Build::from_env());
}

/// A policy selected by Envoy's route name, with `build` loaded (`native_module::` runs it for
/// both builds).
pub(crate) fn route_name_selects_the_policy(build: Build) {
    // Envoy's route `pay` matches /v1/payments in any case; the catch-all has no name.
    let s = Stack::with(r#"{"scope": {"headers": ["authorization"]}, "routes": [{"route_name": "pay"}]}"#, |o| {
        o.named_routes = vec![("pay".into(), r#"{prefix: "/v1/payments", case_sensitive: false}"#.into())];
        o.build = build;
    });
    for (key, path) in [("k-name-1", "/v1/payments"), ("k-name-2", "/V1/PAYMENTS/9")] {
        let a = s.post(path, Some(key), "{}", &[]);
        let b = s.post(path, Some(key), "{}", &[]);
        assert_eq!(s.up.executions_with_key(key), 1, "{path}: {} then {}", a.status, b.status);
        assert_eq!(b.header("idempotent-replayed"), Some("true"), "{path}");
    }
    // A request on another Envoy route is not protected by it.
    s.post("/v1/orders", Some("k-name-3"), "{}", &[]);
    s.post("/v1/orders", Some("k-name-3"), "{}", &[]);
    assert_eq!(s.up.executions_with_key("k-name-3"), 2);
}

/// The access log line of the request sent with `x-test-id: id`, split at `|` (id, status, code
/// details, outcome, key).
fn access_line(lines: &[String], id: &str) -> Vec<String> {
    let found: Vec<&String> = lines.iter().filter(|l| l.split('|').next() == Some(id)).collect();
    assert_eq!(found.len(), 1, "one access log line for {id} in:\n{}", lines.join("\n"));
    found[0].split('|').map(str::to_string).collect()
}

#[test]
fn every_protected_request_leaves_its_outcome_and_full_key_in_envoys_access_log() {
    outcome_and_full_key_in_the_access_log(Build::from_env());
}

/// The access log's filter state after a first request, its replay, a reused key, a request in
/// flight and its retry, a malformed key and an unprotected GET, with `build` loaded (the native
/// build's `native_module::` runs it for both builds: one access log format serves both).
pub(crate) fn outcome_and_full_key_in_the_access_log(build: Build) {
    let mut s = Stack::with(CFG, |o| {
        o.access_log = true;
        o.build = build;
    });
    let body = r#"{"amount":7}"#;
    let first = s.post("/charges", Some("k-log"), body, &[("x-test-id", "first")]);
    assert_eq!(first.status, 201, "{}", first.body_text());
    assert_eq!(s.post("/charges", Some("k-log"), body, &[("x-test-id", "replay")]).status, 201);
    assert_eq!(s.post("/charges", Some("k-log"), r#"{"amount":8}"#, &[("x-test-id", "reused")]).status, 422);
    // A slow first attempt with another key, and its retry while it runs.
    let port = s.envoy.port;
    let slow = std::thread::spawn(move || {
        let h = [("authorization", "Bearer alice"), ("idempotency-key", "k-slow"), ("x-up-delay-ms", "1500")];
        http::request(port, "POST", "/charges", &[&h[..], &[("x-test-id", "slow")]].concat(), b"{}").expect("slow")
    });
    for _ in 0..200 {
        if s.up.executions() == 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.up.executions(), 2, "the slow request reached the upstream");
    let h = [("authorization", "Bearer alice"), ("idempotency-key", "k-slow"), ("x-test-id", "in-flight")];
    assert_eq!(http::request(port, "POST", "/charges", &h, b"{}").expect("retry").status, 409);
    assert_eq!(slow.join().expect("slow thread").status, 201);
    let long_key = "k".repeat(300);
    assert_eq!(s.post("/charges", Some(&long_key), body, &[("x-test-id", "bad-key")]).status, 400);
    let get = http::request(port, "GET", "/charges", &[("x-test-id", "unprotected")], b"").expect("get");
    assert_eq!(get.status, 201);
    assert_eq!(s.up.executions(), 3, "k-log once, k-slow once, the GET");

    s.envoy.stop();
    let lines = s.envoy.access_log();
    let line = |id: &str| access_line(&lines, id);
    let (first, replay) = (line("first"), line("replay"));
    assert_eq!(first[1..4], ["201", "via_upstream", "stored"], "{first:?}");
    assert_eq!(replay[1..4], ["201", "idemgate_replayed", "replayed"], "{replay:?}");
    assert_eq!(line("reused")[1..4], ["422", "idemgate_key_reused", "key-reused"]);
    assert_eq!(line("slow")[1..4], ["201", "via_upstream", "stored"]);
    assert_eq!(line("in-flight")[1..4], ["409", "idemgate_request_in_flight", "request-in-flight"]);
    assert_eq!(line("bad-key")[1..5], ["400", "idemgate_key_too_long", "key-too-long", "-"]);
    assert_eq!(line("unprotected")[1..5], ["201", "via_upstream", "-", "-"]);
    // The full storage key (64 hex digits): the same for every request with that key, another for
    // another key, and the one the filter's log lines name.
    let key = &first[4];
    assert!(key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit()), "{key}");
    assert_eq!(&replay[4], key);
    assert_eq!(&line("reused")[4], key);
    assert_eq!(line("in-flight")[4], line("slow")[4]);
    assert_ne!(&line("slow")[4], key);
    assert!(s.envoy.log().contains(&format!("key={key}")), "the filter's log lines name the full key");
}

#[test]
fn the_status_for_a_key_reused_with_another_payload_is_chosen_per_route() {
    // The Agentic Commerce Protocol's routes answer 409; the others keep the IETF draft's 422.
    let s = Stack::new(
        r#"{"scope": {"headers": ["authorization"]},
            "routes": [{"prefix": "/acp", "mismatch_status": 409}, {"prefix": "/", "mismatch_status": 422}]}"#,
    );
    assert_eq!(s.post("/acp/checkouts", Some("k-acp"), r#"{"amount":1}"#, &[]).status, 201);
    let acp = s.post("/acp/checkouts", Some("k-acp"), r#"{"amount":2}"#, &[]);
    assert_eq!(acp.status, 409, "{}", acp.body_text());
    assert_eq!(problem_type(&acp), "urn:idemgate:problem:key-reused");
    assert_eq!(acp.json()["status"], 409);
    assert_eq!(acp.header("x-should-retry"), Some("false"));
    assert_eq!(acp.header("retry-after"), None, "a 409 for another payload is no in-flight conflict");
    assert_eq!(s.post("/charges", Some("k-ietf"), r#"{"amount":1}"#, &[]).status, 201);
    let ietf = s.post("/charges", Some("k-ietf"), r#"{"amount":2}"#, &[]);
    assert_eq!(ietf.status, 422, "{}", ietf.body_text());
    assert_eq!(ietf.json()["status"], 422);
    assert_eq!(s.up.executions(), 2);
    assert_eq!(s.envoy.stat("idemgate.mismatch"), 2);
}

#[test]
fn a_mismatch_status_other_than_409_or_422_is_refused_naming_the_field() {
    let up = support::upstream::Upstream::start();
    let o = support::EnvoyOptions::new(r#"{"routes": [{"prefix": "/", "mismatch_status": 400}]}"#, up.port);
    match support::Envoy::try_start(&o) {
        support::Started::Exited { log, .. } => {
            assert!(log.contains("routes[0].mismatch_status"), "{log}");
        }
        support::Started::Ready(_) => panic!("Envoy accepted mismatch_status 400"),
    }
}

/// Istio's `WasmPlugin` and Envoy Gateway's `wasm` API cannot set the filter's
/// `allow_on_headers_stop_iteration`: with `hold_headers: false` the request headers go on at
/// once and only the body (the request's end) waits for the claim.
#[test]
fn without_the_stop_iteration_flag_a_key_still_executes_once_and_refused_requests_never_reach_the_upstream_complete() {
    let s = Stack::with(r#"{"scope": {"headers": ["authorization"]}, "hold_headers": false}"#, |o| {
        o.stop_iteration_flag = false;
    });
    let port = s.envoy.port;
    let send = |key: &str, body: &str, extra: &[(&str, &str)]| {
        let mut h =
            vec![("authorization", "Bearer alice"), ("content-type", "application/json"), ("idempotency-key", key)];
        h.extend_from_slice(extra);
        http::request_timeout(port, "POST", "/charges", &h, body.as_bytes(), Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("no answer for {key} (a request held without the flag hangs): {e}"))
    };
    let first = send("k-nf", r#"{"amount":1}"#, &[]);
    assert_eq!(first.status, 201, "{}", first.body_text());
    let replay = send("k-nf", r#"{"amount":1}"#, &[]);
    assert_eq!((replay.status, replay.header("idempotent-replayed")), (201, Some("true")));
    assert_eq!(replay.body, first.body);
    let reused = send("k-nf", r#"{"amount":2}"#, &[]);
    assert_eq!(reused.status, 422, "{:?} {}", reused.headers, reused.body_text());
    // A retry while the first attempt runs is refused at its headers.
    let slow = std::thread::spawn(move || {
        let h = [("authorization", "Bearer alice"), ("idempotency-key", "k-nf-slow"), ("x-up-delay-ms", "1500")];
        http::request_timeout(port, "POST", "/charges", &h, b"{}", Duration::from_secs(10)).expect("slow")
    });
    for _ in 0..200 {
        if s.up.executions() == 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.up.executions(), 2, "the slow request reached the upstream");
    assert_eq!(send("k-nf-slow", "{}", &[]).status, 409);
    assert_eq!(slow.join().expect("slow thread").status, 201);
    // A body over the limit is refused at its end, after its headers went upstream.
    let big = "x".repeat(1_100_000);
    assert_eq!(send("k-nf-big", &big, &[]).status, 413);
    // Fifty concurrent duplicates of a new key: one execution.
    let threads: Vec<_> = (0..50)
        .map(|_| {
            std::thread::spawn(move || {
                let h =
                    [("authorization", "Bearer alice"), ("idempotency-key", "k-nf-burst"), ("x-up-delay-ms", "300")];
                http::request_timeout(port, "POST", "/charges", &h, br#"{"amount":3}"#, Duration::from_secs(10))
                    .expect("burst")
                    .status
            })
        })
        .collect();
    let statuses: Vec<u16> = threads.into_iter().map(|t| t.join().expect("thread")).collect();
    assert_eq!(statuses.iter().filter(|s| **s == 201).count(), 50 - statuses.iter().filter(|s| **s == 409).count());
    assert_eq!(s.up.executions_with_key("k-nf"), 1);
    assert_eq!(s.up.executions_with_key("k-nf-slow"), 1);
    assert_eq!(s.up.executions_with_key("k-nf-big"), 0);
    assert_eq!(s.up.executions_with_key("k-nf-burst"), 1, "{statuses:?}");
    assert_eq!(s.up.executions(), 3);
    // The replay, the 422 and the 413 were decided at the body's end: their headers had reached
    // the upstream, which saw each connection closed before the body (never a complete request).
    // How many of them reached the upstream is Envoy's timing; what matters is that none executed.
    eprintln!("upstream requests left incomplete: {}", s.up.partial_requests());
    assert!(s.up.partial_requests() <= 3 + 49, "{}", s.up.partial_requests());
}

/// `derive_key.include_body` with `hold_headers: false`: the key is known at the body's end,
/// after the headers went upstream, so the derived key cannot be added to them (Envoy refuses a
/// header map it no longer lends; the SDK's wrapper panicked on that: a VM crash, an empty 503).
/// The key still protects the request; the upstream just does not see it.
#[test]
fn a_key_derived_from_the_body_after_the_headers_went_upstream_protects_without_crashing_the_vm() {
    let s = Stack::with(
        r#"{"scope": {"headers": ["authorization"]}, "hold_headers": false,
            "derive_key": {"headers": ["x-agent-task-id", "x-agent-step-id"], "include_body": true}}"#,
        |o| o.stop_iteration_flag = false,
    );
    let h = [("authorization", "Bearer alice"), ("x-agent-task-id", "t-1"), ("x-agent-step-id", "s-1")];
    let send = || {
        http::request_timeout(s.envoy.port, "POST", "/charges", &h, br#"{"amount":1}"#, Duration::from_secs(10))
            .expect("answer")
    };
    let first = send();
    assert_eq!(first.status, 201, "{:?} {}\n{}", first.headers, first.body_text(), s.envoy.log());
    let replay = send();
    assert_eq!((replay.status, replay.header("idempotent-replayed")), (201, Some("true")), "{}", replay.body_text());
    assert_eq!(replay.body, first.body);
    assert_eq!(s.up.executions(), 1);
    // A JSON body naming a member twice has no key to derive (readers run different values):
    // refused at the body's end, after its headers went upstream, and never executed (before:
    // a key from the last value, and it ran).
    let h = [("authorization", "Bearer alice"), ("x-agent-task-id", "t-1"), ("x-agent-step-id", "s-2")];
    let body = br#"{"amount":1,"\u0061mount":2}"#;
    let r = http::request_timeout(s.envoy.port, "POST", "/charges", &h, body, Duration::from_secs(10)).expect("answer");
    assert_eq!((r.status, r.problem().as_str()), (400, "body-ambiguous"), "{}", r.body_text());
    assert_eq!(s.up.executions(), 1);
    s.envoy.assert_no_wasm_panic();
}

/// Why `hold_headers` stays the default wherever the flag can be set: without held headers, a
/// retry's headers reach the upstream before the body's end decides it is a replay. An upstream
/// that acts on headers alone (a handler that never reads the body) then executes it again; one
/// that reads the request to its end never does (the test above).
#[test]
fn without_held_headers_an_upstream_acting_on_headers_alone_runs_a_replayed_key_again_so_holding_stays_the_default() {
    for (hold, expected) in [(true, 1), (false, 2)] {
        let s =
            Stack::with(&format!(r#"{{"scope": {{"headers": ["authorization"]}}, "hold_headers": {hold}}}"#), |o| {
                o.stop_iteration_flag = hold;
            });
        let h = [("authorization", "Bearer alice"), ("idempotency-key", "k-hdr"), ("x-up-execute-on-headers", "1")];
        let first = http::request(s.envoy.port, "POST", "/charges", &h, br#"{"amount":1}"#).expect("first");
        assert_eq!(first.status, 201);
        // The retry sends its headers and half its body, and the rest once the upstream has seen
        // it (or a bounded number of polls later: with held headers it never does).
        let mut c = std::net::TcpStream::connect(("127.0.0.1", s.envoy.port)).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let head = "POST /charges HTTP/1.1\r\nhost: idemgate.test\r\nconnection: close\r\nauthorization: Bearer alice\r\nidempotency-key: k-hdr\r\nx-up-execute-on-headers: 1\r\ncontent-length: 12\r\n\r\n{\"amount\"";
        c.write_all(head.as_bytes()).expect("head");
        for _ in 0..50 {
            if s.up.executions() >= 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        c.write_all(b":1}").expect("rest");
        let mut answer = vec![];
        let _ = c.read_to_end(&mut answer);
        let retry = http::parse(&answer).expect("retry answer");
        assert_eq!((retry.status, retry.header("idempotent-replayed")), (201, Some("true")));
        assert_eq!(s.up.executions(), expected, "hold_headers: {hold}");
    }
}

#[test]
fn counters_exist_per_route_as_well_as_in_total() {
    let s = Stack::new(
        r#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/refunds"}, {"prefix": "/", "mismatch_status": 409, "name": "charges"}]}"#,
    );
    assert_eq!(s.post("/refunds", Some("k-r"), "{}", &[]).status, 201);
    assert_eq!(s.post("/charges", Some("k-c"), "{}", &[]).status, 201);
    assert_eq!(s.post("/charges", Some("k-c"), "{}", &[]).status, 201);
    assert_eq!(s.post("/charges", Some("k-c"), r#"{"a":1}"#, &[]).status, 409);
    assert_eq!(s.up.executions(), 2);
    let e = &s.envoy;
    assert_eq!((e.stat("idemgate.claimed"), e.stat("idemgate.replayed"), e.stat("idemgate.mismatch")), (2, 1, 1));
    // Labelled by the route's `name`, or its prefix without the slashes.
    assert_eq!((e.stat("idemgate.route.refunds.claimed"), e.stat("idemgate.route.refunds.replayed")), (1, 0));
    assert_eq!((e.stat("idemgate.route.charges.claimed"), e.stat("idemgate.route.charges.replayed")), (1, 1));
    assert_eq!((e.stat("idemgate.route.refunds.stored"), e.stat("idemgate.route.charges.stored")), (1, 1));
    assert_eq!((e.stat("idemgate.route.refunds.mismatch"), e.stat("idemgate.route.charges.mismatch")), (0, 1));
    // What only the root counts exists in total only.
    assert!(e.stats("idemgate.route.charges.store_writes").is_empty());
    // Prometheus: one family per counter, the route a label (the configuration's stats_tags; the
    // native build's from docs/native.md, its names through the relabel rule there).
    let text = e.prometheus();
    let line = |prefix: &str| text.lines().find(|l| l.starts_with(prefix)).map(str::to_string);
    assert_eq!(
        line("idemgate_route_replayed{route=\"charges\"}").as_deref(),
        Some("idemgate_route_replayed{route=\"charges\"} 1"),
        "{text}"
    );
    assert_eq!(
        line("idemgate_route_replayed{route=\"refunds\"}").as_deref(),
        Some("idemgate_route_replayed{route=\"refunds\"} 0"),
        "{text}"
    );
    assert!(!text.contains("idemgate_route_charges_"), "{text}");
    // The build, as a label of a series always 1.
    let build = format!("idemgate_build_info{{version=\"{}\"}} 1", env!("CARGO_PKG_VERSION"));
    assert!(text.lines().any(|l| l == build), "{build} in {text}");
}

/// Envoy merges histograms on its stats flush (`stats_flush_interval`, 5 s by default): the tests
/// that read them have Envoy flush every 200 ms, before the build's `stats_config`.
fn flushing_often(o: &mut support::EnvoyOptions) {
    o.stats_config = Some(format!("stats_flush_interval: 0.2s\n{}", o.build.stats_config()));
}

/// The histograms count what they measure: two replays, one wait, and the hold of every key
/// claimed (two here), in Envoy's Prometheus output once it merged them.
#[test]
fn histograms_measure_replays_waits_and_held_keys() {
    let s = Stack::with(
        r#"{"scope": {"headers": ["authorization"]}, "in_flight": "wait", "wait_ms": 5000}"#,
        flushing_often,
    );
    assert_eq!(s.post("/charges", Some("k-1"), "{}", &[]).status, 201);
    assert_eq!(s.post("/charges", Some("k-1"), "{}", &[]).status, 201);
    // A retry while the first runs waits for it, then is replayed.
    let first = {
        let port = s.envoy.port;
        std::thread::spawn(move || {
            let h = [
                ("authorization", "Bearer alice"),
                ("content-type", "application/json"),
                ("idempotency-key", "k-2"),
                ("x-up-delay-ms", "400"),
            ];
            http::request(port, "POST", "/charges", &h, b"{}")
        })
    };
    for _ in 0..200 {
        if s.up.executions() >= 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(s.post("/charges", Some("k-2"), "{}", &[]).status, 201);
    assert_eq!(first.join().expect("first").expect("answer").status, 201);
    assert_eq!(s.up.executions(), 2);
    let e = &s.envoy;
    assert_eq!((e.stat("idemgate.replayed"), e.stat("idemgate.waited")), (2, 1));
    // Envoy merges histograms on its stats flush (`flushing_often`): bounded by count.
    // Envoy writes a series without labels as `name{} value`.
    let mut text = String::new();
    for _ in 0..100 {
        text = e.prometheus().replace("{} ", " ");
        if text.lines().any(|l| l == "idemgate_key_held_ms_count 2")
            && text.lines().any(|l| l == "idemgate_wait_ms_count 1")
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Envoy's sums are read from its buckets (approximate): bucket counts are exact. Both stored
    // bodies are longer than 1 byte; k-2 was held at least its upstream's 400 ms.
    let bucket = |name: &str| -> u64 {
        text.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse().ok()).expect(name)
    };
    assert!(bucket("idemgate_key_held_ms_bucket{le=\"250\"}") <= 1, "{text}");
    for want in [
        "idemgate_key_held_ms_count 2",
        "idemgate_wait_ms_count 1",
        "idemgate_replay_bytes_count 2",
        "idemgate_replay_bytes_bucket{le=\"1\"} 0",
    ] {
        assert!(text.lines().any(|l| l == want), "{want} in {text}");
    }
    // The wait lasted about as long as the first attempt's 400 ms.
    let sum: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("idemgate_wait_ms_sum "))
        .and_then(|v| v.parse().ok())
        .expect("wait sum");
    assert!(sum >= 200.0, "wait_ms_sum {sum}");
}

/// A retry held by `in_flight: "wait"` and answered `response-not-stored` counts what a retry
/// meeting the completed key directly counts (`metrics::problem_counter`: `replayed`), and
/// `wait_answered` besides, in both builds: for a response over `max_response_body_bytes` (the
/// record completed too large, `/charges`) and for one the local tier had no room to keep
/// (`local.max_bytes`, `/`: the entry keeps only its status). Each first attempt is held at the
/// upstream until its retry waits (ordered by Envoy's counters, never by time).
#[test]
fn a_waiting_retry_answered_response_not_stored_counts_as_a_direct_retry_does() {
    let s = Stack::new(
        r#"{"scope": {"headers": ["authorization"]}, "in_flight": "wait", "wait_ms": 20000,
            "local": {"max_bytes": 4096},
            "routes": [{"prefix": "/charges", "max_response_body_bytes": 100}, {"prefix": "/"}]}"#,
    );
    for (n, path) in ["/charges", "/"].into_iter().enumerate() {
        let key = format!("k-not-stored-{n}");
        let port = s.envoy.port;
        // Alice's POST of `{}` under `key` on `path`, with `extra` headers, on its own thread.
        let post_away = |extra: &'static [(&'static str, &'static str)]| {
            let (key, path) = (key.clone(), path.to_string());
            std::thread::spawn(move || {
                let mut h = vec![
                    ("authorization", "Bearer alice"),
                    ("content-type", "application/json"),
                    ("idempotency-key", key.as_str()),
                ];
                h.extend_from_slice(extra);
                http::request(port, "POST", &path, &h, b"{}")
            })
        };
        let first = post_away(&[("x-up-body-bytes", "5000"), ("x-up-hold", "1")]);
        support::wait_for(&format!("{path}: the first attempt at the upstream"), 400, || {
            s.up.executions_with_key(&key) == 1
        });
        let waiting = post_away(&[]);
        let waited = n as u64 + 1;
        support::wait_for(&format!("{path}: the retry held"), 400, || s.envoy.stat("idemgate.waited") == waited);
        s.up.release_holds();
        let first = first.join().expect("first thread").expect("first");
        assert_eq!((first.status, first.body.len()), (201, 5000), "{path}");
        let waiting = waiting.join().expect("waiting thread").expect("waiting retry");
        assert_eq!(
            (waiting.status, problem_type(&waiting).as_str()),
            (201, "urn:idemgate:problem:response-not-stored"),
            "{path}: {}",
            waiting.body_text()
        );
        let e = &s.envoy;
        assert_eq!(
            (e.stat("idemgate.wait_answered"), e.stat("idemgate.replayed")),
            (waited, 2 * waited - 1),
            "{path}: the waiting retry counts wait_answered and replayed"
        );
        let direct = s.post(path, Some(&key), "{}", &[]);
        assert_eq!(
            (direct.status, problem_type(&direct).as_str()),
            (201, "urn:idemgate:problem:response-not-stored"),
            "{path}"
        );
        assert_eq!(e.stat("idemgate.replayed"), 2 * waited, "{path}: the direct retry counts replayed");
        assert_eq!(s.up.executions_with_key(&key), 1, "{path}");
        s.up.hold_again();
    }
    assert_eq!((s.envoy.stat("idemgate.in_flight_conflict"), s.up.executions()), (0, 2));
}

/// Detached forwarding: the root settles the claim, and the key's hold is measured from the
/// request's claim all the same (at least its upstream's 300 ms); and so is the hold of a key
/// whose client left before the upstream answered (Wasm: by the root; native: by the
/// configuration on Envoy's main thread, docs/native.md), once, the key replaying. The upstream
/// holds that first attempt until its client has left (ordered by Envoy's counters, never by
/// time).
#[test]
fn a_detached_forwards_key_hold_is_measured_to_its_settlement_by_the_root() {
    let s = Stack::with(
        r#"{"scope": {"headers": ["authorization"]}, "forwarding": "detached", "upstream": {"cluster": "upstream", "hop": "direct", "timeout_ms": 10000}}"#,
        flushing_often,
    );
    assert_eq!(s.post("/charges", Some("k-d"), "{}", &[("x-up-delay-ms", "300")]).status, 201);
    assert_eq!(s.up.executions(), 1);
    assert_eq!(s.envoy.stat("idemgate.detached_forwards"), 1);
    let held = |count: u64| {
        let want = format!("idemgate_key_held_ms_count {count}");
        let mut text = String::new();
        for _ in 0..100 {
            text = s.envoy.prometheus().replace("{} ", " ");
            if text.lines().any(|l| l == want) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(text.lines().any(|l| l == want), "{want} in {text}");
        text
    };
    let text = held(1);
    assert!(text.lines().any(|l| l == "idemgate_key_held_ms_bucket{le=\"250\"} 0"), "{text}");
    // The client leaves while the upstream holds its request.
    let raw = "POST /charges HTTP/1.1\r\nhost: idemgate.test\r\nauthorization: Bearer alice\r\ncontent-type: application/json\r\nidempotency-key: k-left\r\nx-up-hold: 1\r\ncontent-length: 2\r\n\r\n{}";
    let mut c = std::net::TcpStream::connect(("127.0.0.1", s.envoy.port)).expect("connect");
    c.write_all(raw.as_bytes()).expect("write");
    support::wait_for("the first attempt at the upstream", 400, || s.up.executions() == 2);
    drop(c);
    support::wait_for("the client's stream ended", 400, || s.envoy.stat("http.ingress.downstream_rq_active") == 0);
    s.up.release_holds();
    support::wait_for("the key completed", 400, || {
        s.post("/charges", Some("k-left"), "{}", &[]).header("idempotent-replayed") == Some("true")
    });
    assert_eq!((s.up.executions(), s.envoy.stat("idemgate.detached_forwards")), (2, 2));
    held(2);
}

/// idemgate builds only the log lines Envoy keeps (it asks Envoy's level for Wasm): a level
/// raised at run time through the admin endpoint reaches it within a tick, and lines logged at
/// debug then appear, as they did when every line was sent and Envoy dropped them.
#[test]
fn a_log_level_raised_at_run_time_reaches_idemgate_and_its_debug_lines_appear() {
    let s = Stack::with(CFG, |o| o.wasm_log_level = "info".into());
    let r = s.post("/charges", Some("k-quiet"), "{}", &[]);
    assert_eq!(r.status, 201);
    assert!(!s.envoy.log().contains("outcome=forwarded"), "a debug line at level info");
    // The native build logs under Envoy's `dynamic_modules` logger (docs/native.md).
    let logger = match Build::from_env() {
        Build::Wasm => "wasm",
        Build::Native => "dynamic_modules",
    };
    let set = http::request(s.envoy.admin_port, "POST", &format!("/logging?{logger}=debug"), &[], b"").expect("admin");
    assert_eq!(set.status, 200, "{}", set.body_text());
    // Each worker reads the level on its tick (100 ms): bounded by count, not by time.
    let mut seen = false;
    for i in 0..50 {
        let r = s.post("/charges", Some(&format!("k-loud-{i}")), "{}", &[]);
        assert_eq!(r.status, 201);
        if s.envoy.log().contains("outcome=forwarded") {
            seen = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(seen, "no debug line after the level was raised");
    assert_eq!(s.up.executions(), s.up.executions_by_key().len() as u64, "each key executed once");
}
