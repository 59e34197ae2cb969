//! Spellings of one route or one caller that the systems around idemgate read as one: each must
//! select the same route and the same scope, or a key executes once per spelling. Through one
//! Envoy 1.40 with the test configuration's defaults (no `normalize_path`, `merge_slashes` or
//! `path_with_escaped_slashes_action`: Envoy forwards every spelling as sent). Every test counts
//! executions at the upstream.

use crate::support;

use std::process::Command;
use std::time::Duration;

use support::http::{self, Response};
use support::Stack;

const ROUTES: &str = r#"{"scope": {"headers": ["authorization"]},
    "routes": [{"prefix": "/v1/payments"}, {"prefix": "/v2/orders/"}]}"#;

fn post(s: &Stack, path: &str, key: &str) -> Response {
    let h = [("authorization", "Bearer alice"), ("content-type", "application/json"), ("idempotency-key", key)];
    http::request(s.envoy.port, "POST", path, &h, b"{}").expect("request")
}

/// Sends the canonical path with a fresh key, then each spelling with that same key: the
/// spelling must be answered without executing (a replay, or 409/422: the fingerprint keeps the
/// path as sent). Returns the spellings that executed again, with their answer.
fn executed_again(s: &Stack, canonical: &str, spellings: &[&str], tag: &str) -> Vec<String> {
    let mut again = vec![];
    for (n, spelling) in spellings.iter().enumerate() {
        let key = format!("k-{tag}-{n}");
        let first = post(s, canonical, &key);
        assert_eq!(first.status, 201, "{canonical}: {}", first.body_text());
        let r = post(s, spelling, &key);
        if s.up.executions_with_key(&key) != 1 {
            again.push(format!("{spelling} (answered {})", r.status));
        } else {
            assert!(
                r.header("idempotent-replayed") == Some("true") || [409, 422].contains(&r.status),
                "{spelling}: {} {}",
                r.status,
                r.body_text()
            );
        }
    }
    again
}

#[test]
fn path_parameters_select_the_route_as_servlet_containers_read_them() {
    let s = Stack::new(ROUTES);
    // Tomcat, Jetty and Spring strip `;params` from each segment before routing (`..;` is `..`);
    // Spring strips them again after decoding (`%3B`).
    let spellings = [
        "/v1;jsessionid=a1/payments",
        "/v1/x/..;/payments",
        "/;x/v1/payments",
        "/v1;a=1;b=2/payments;c=3",
        "/v1/x/..;jsessionid=1/payments?q=1",
        "/v1/x/..%3B/payments",
        "/v1/x/%2E%2E;/payments",
        // The absolute form: Envoy takes the path out of it.
        "http://idemgate.test/v1;jsessionid=a1/payments",
    ];
    let again = executed_again(&s, "/v1/payments", &spellings, "param");
    assert!(again.is_empty(), "one key executed again through: {again:?}");
}

#[test]
fn encoded_slashes_select_the_route_as_decoding_servers_read_them() {
    let s = Stack::new(ROUTES);
    // WSGI servers (Flask, Django), Go's net/http before 1.22 and gorilla/mux route on the
    // decoded path; a proxy in front that decodes once more makes `%252F` a slash too.
    let spellings = [
        "/v1%2Fpayments",
        "/%2Fv1/payments",
        "/v1%2fpayments",
        "/v1/x%2F..%2Fpayments",
        "/v1%5Cpayments",
        "/v1%252Fpayments",
        "/v1%2F%2E%2E%2Fv1%2Fpayments",
    ];
    let again = executed_again(&s, "/v1/payments", &spellings, "slash");
    assert!(again.is_empty(), "one key executed again through: {again:?}");
}

#[test]
fn letter_case_selects_the_route_as_case_insensitive_routers_read_it() {
    let s = Stack::new(ROUTES);
    // ASP.NET Core routing and Express (its default `caseSensitive: false`) ignore case.
    let spellings = ["/V1/Payments", "/v1/PAYMENTS", "/V1;x/PAYMENTS", "/V1%2fPayments"];
    let again = executed_again(&s, "/v1/payments", &spellings, "case");
    assert!(again.is_empty(), "one key executed again through: {again:?}");
}

#[test]
fn a_prefix_with_a_trailing_slash_also_protects_the_path_without_it() {
    let s = Stack::new(ROUTES);
    // Express (strict routing off, its default), Rails and Spring before 6 route `/v2/orders`
    // and `/v2/orders/` to one handler.
    let again = executed_again(&s, "/v2/orders/", &["/v2/orders", "/v2/orders;x", "/v2%2Forders"], "trailing");
    assert!(again.is_empty(), "one key executed again through: {again:?}");
}

/// Routes that keep keys apart (another namespace here): a spelling whose readings select both
/// is refused (400 `route-ambiguous`, nothing forwarded), whichever route its canonical form
/// takes. Before, the first route matching any reading took it: `/v1/payments/../orders` was
/// protected in `pay` while a backend ran it as /v1/orders, whose key lives in `rest`, and the
/// same key then executed again as `/v1/orders` (found by an adversarial review: 2 executions).
#[test]
fn a_spelling_read_as_two_routes_that_keep_keys_apart_is_refused() {
    let s = Stack::new(
        r#"{"scope": {"headers": ["authorization"]},
            "routes": [{"prefix": "/v1/payments", "namespace": "pay"}, {"prefix": "/v1/refunds", "namespace": "refunds"}, {"prefix": "/", "namespace": "rest"}]}"#,
    );
    let ambiguous = [
        "/v1/payments/../orders",
        "/v1/payments/%2e%2e/orders",
        "/v1/payments/..%2Forders",
        "/v1/payments;x/../orders",
        "/v1/refunds/../payments",
        "/v1%2Fpayments",
        "/v1;x/payments",
        "/v1/x/..;/payments",
        "/v1%252Fpayments",
    ];
    for (n, path) in ambiguous.iter().enumerate() {
        let key = format!("k-ambiguous-{n}");
        let r = post(&s, path, &key);
        assert_eq!((r.status, r.problem().as_str()), (400, "route-ambiguous"), "{path}: {}", r.body_text());
        assert_eq!(s.up.executions_with_key(&key), 0, "{path} was forwarded");
    }
    // The reviewer's sequence: the odd spelling first, then the path a backend runs it as.
    assert_eq!(post(&s, "/v1/payments/../orders", "k-seq").status, 400);
    assert_eq!(post(&s, "/v1/orders", "k-seq").status, 201);
    assert_eq!(post(&s, "/v1/orders", "k-seq").header("idempotent-replayed"), Some("true"));
    assert_eq!(s.up.executions_with_key("k-seq"), 1);
    // Plain paths are each their own route's.
    for (n, path) in ["/v1/payments", "/v1/refunds/r1", "/v1/orders"].iter().enumerate() {
        let key = format!("k-plain-{n}");
        assert_eq!(post(&s, path, &key).status, 201, "{path}");
        assert_eq!(post(&s, path, &key).header("idempotent-replayed"), Some("true"), "{path}");
    }
}

/// Routes that store keys alike (the same namespace, header, scope and key rule) are one table:
/// a spelling read as both is protected by the first, and meets the record its canonical path made.
#[test]
fn a_spelling_read_as_two_routes_that_store_keys_alike_meets_one_record() {
    let s = Stack::new(
        r#"{"scope": {"headers": ["authorization"]},
            "routes": [{"prefix": "/v1/payments", "ttl_seconds": 3600}, {"prefix": "/"}]}"#,
    );
    let spellings = ["/v1%2Fpayments", "/v1;x/payments", "/v1/x/..;/payments", "/v1%252Fpayments"];
    let again = executed_again(&s, "/v1/payments", &spellings, "alike");
    assert!(again.is_empty(), "one key executed again through: {again:?}");
}

#[test]
fn spellings_no_backend_reads_as_a_protected_path_stay_unprotected() {
    let s = Stack::new(ROUTES);
    // A servlet container reads `/v1/pay;ments` as `/v1/pay`; every reading of `/v1/pay%2Fments`
    // has a slash inside `payments`; `/v2/ordersX` is not `/v2/orders/`.
    for (n, path) in ["/v1/pay;ments", "/v1/pay%2Fments", "/v1/refunds", "/v2/ordersX", "/v2/order"].iter().enumerate()
    {
        let key = format!("k-free-{n}");
        post(&s, path, &key);
        post(&s, path, &key);
        assert_eq!(s.up.executions_with_key(&key), 2, "{path} was protected");
    }
}

const AUTHORITY_CFG: &str = r#"{"scope": {"headers": ["authorization"]}}"#;

/// A plain-HTTP/1.1 request with this `Host`.
fn h1_with_host(s: &Stack, host: &str, key: &str) -> Response {
    h1_to(s, "/charges", host, key)
}

/// A plain-HTTP/1.1 request to this request target with this `Host`.
fn h1_to(s: &Stack, target: &str, host: &str, key: &str) -> Response {
    let req = format!(
        "POST {target} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\nauthorization: Bearer alice\r\n\
         idempotency-key: {key}\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}"
    );
    http::raw(s.envoy.port, req.as_bytes(), Duration::from_secs(20)).expect("answer")
}

/// One HTTP/2 (h2c, `:scheme: http`) request with this `:authority`; returns its status.
fn h2_with_authority(s: &Stack, authority: &str, key: &str) -> String {
    let out = Command::new("python3")
        .arg(support::repo_root().join("tests/h2_client.py"))
        .args([&s.envoy.port.to_string(), "1", "/charges", "{}"])
        .args(["authorization: Bearer alice", &format!("idempotency-key: {key}"), "content-type: application/json"])
        .arg(format!(":authority={authority}"))
        .output()
        .expect("python3 tests/h2_client.py (h2 installed by make test-faults)");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    text.split(' ').nth(1).unwrap_or("").to_string()
}

/// Spellings of `api.example.test` over plain HTTP: URI comparison (RFC 3986 6.2.2-6.2.3, RFC
/// 9110 4.2.3) reads them as one origin.
/// Both default ports are dropped whatever the scheme, which the client controls.
const SAME_ORIGIN: &[&str] = &[
    "api.example.test:80",
    "api.example.test.",
    "API.Example.Test.:80",
    "api.example.test:",
    "api.example.test:0080",
    "api.example.test:443",
];

/// Another origin: another port.
const OTHER_ORIGIN: &[&str] = &["api.example.test:8080", "api.example.test:8443"];

#[test]
fn one_origin_spelled_several_ways_over_http1_is_one_scope() {
    let s = Stack::new(AUTHORITY_CFG);
    let first = h1_with_host(&s, "api.example.test", "k-h1");
    assert_eq!(first.status, 201, "{}", first.body_text());
    let mut again = vec![];
    for host in SAME_ORIGIN {
        let before = s.up.executions_with_key("k-h1");
        let r = h1_with_host(&s, host, "k-h1");
        if s.up.executions_with_key("k-h1") != before {
            again.push(format!("{host} (answered {})", r.status));
        }
    }
    assert!(again.is_empty(), "one caller's key executed again through Host: {again:?}");
    // In the absolute form the target's authority is the request's (Envoy replaces Host with it).
    for target in ["http://API.example.test.:80/charges", "http://api.example.test:0080/charges"] {
        let r = h1_to(&s, target, "other.example.test", "k-h1");
        assert_eq!(s.up.executions_with_key("k-h1"), 1, "{target} executed again (answered {})", r.status);
    }
    // The client's scheme (x-forwarded-proto, which Envoy takes from HTTP/1 clients here) never
    // splits its scope: before, `Host: api:443` was one scope over http and another with
    // `x-forwarded-proto: https` (found by an adversarial review: 2 executions).
    let req = "POST /charges HTTP/1.1\r\nhost: api.example.test:443\r\nx-forwarded-proto: https\r\nconnection: close\r\n\
               authorization: Bearer alice\r\nidempotency-key: k-h1\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    let r = http::raw(s.envoy.port, req.as_bytes(), Duration::from_secs(20)).expect("answer");
    assert_eq!(s.up.executions_with_key("k-h1"), 1, "x-forwarded-proto split the scope (answered {})", r.status);
    for (n, host) in OTHER_ORIGIN.iter().enumerate() {
        let key = format!("k-h1-other-{n}");
        assert_eq!(h1_with_host(&s, "api.example.test", &key).status, 201);
        assert_eq!(h1_with_host(&s, host, &key).status, 201, "{host}");
        assert_eq!(s.up.executions_with_key(&key), 2, "{host} shares the scope of api.example.test");
    }
}

#[test]
fn one_origin_spelled_several_ways_over_http2_is_one_scope() {
    let s = Stack::new(AUTHORITY_CFG);
    assert_eq!(h2_with_authority(&s, "api.example.test", "k-h2"), "201");
    let mut again = vec![];
    for authority in SAME_ORIGIN {
        let before = s.up.executions_with_key("k-h2");
        let status = h2_with_authority(&s, authority, "k-h2");
        if s.up.executions_with_key("k-h2") != before {
            again.push(format!("{authority} (answered {status})"));
        }
    }
    assert!(again.is_empty(), "one caller's key executed again through :authority: {again:?}");
    // HTTP/1 and HTTP/2 spellings of one origin are one scope too.
    let h1 = h1_with_host(&s, "api.example.test.:80", "k-h2");
    assert_eq!(s.up.executions_with_key("k-h2"), 1, "HTTP/1 after HTTP/2 answered {}", h1.status);
    for (n, authority) in OTHER_ORIGIN.iter().enumerate() {
        let key = format!("k-h2-other-{n}");
        assert_eq!(h2_with_authority(&s, "api.example.test", &key), "201");
        assert_eq!(h2_with_authority(&s, authority, &key), "201", "{authority}");
        assert_eq!(s.up.executions_with_key(&key), 2, "{authority} shares the scope of api.example.test");
    }
}

/// Found by the boundary oracle (issue 41): with `derive_key` the key was derived from the target
/// as sent, so a retry spelling the path or the query another way, one request to every backend of
/// the oracle's panel (Flask, Django, FastAPI, Express, Fastify, Go, Tomcat), derived another key
/// and executed again.
/// With the key derived from `x-op` and the body (`derive_key.include_body`): sends `first` as
/// `content_type` with a fresh `x-op` (`op-<tag>-<n>`), then each spelling of it with that same
/// `x-op`: the spelling must be answered without executing (a replay, or 422). Returns the
/// spellings that executed again, with their answer.
fn body_executed_again(s: &Stack, content_type: &str, first: &[u8], spellings: &[&str], tag: &str) -> Vec<String> {
    let mut again = vec![];
    for (n, spelling) in spellings.iter().enumerate() {
        let op = format!("op-{tag}-{n}");
        let h = [("authorization", "Bearer alice"), ("content-type", content_type), ("x-op", op.as_str())];
        let before = s.up.executions();
        let first = http::request(s.envoy.port, "POST", "/v1/payments", &h, first).expect("request");
        assert_eq!(first.status, 201, "{}", first.body_text());
        let r = http::request(s.envoy.port, "POST", "/v1/payments", &h, spelling.as_bytes()).expect("request");
        if s.up.executions() - before != 1 {
            again.push(format!("{spelling} (answered {})", r.status));
        } else {
            assert!(r.status == 422 || r.header("idempotent-replayed") == Some("true"), "{spelling}: {}", r.status);
        }
    }
    again
}

#[test]
fn spellings_of_one_target_derive_one_key() {
    let s = Stack::new(r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-op"]}}"#);
    let spellings = [
        "/v1/%70ayments?a=1&b=2",
        "/v1%2Fpayments?a=1&b=2",
        "//v1/payments?a=1&b=2",
        "/v1;x=1/payments?a=1&b=2",
        "/v1/x/../payments?a=1&b=2",
        "/v1/payments/?a=1&b=2",
        "/V1/PAYMENTS?a=1&b=2",
        "/v1/payments?b=2&a=1",
        "/v1/payments?%61=1&b=2",
        "/v1/payments?a=1&b=2&",
    ];
    let mut again = vec![];
    for (n, spelling) in spellings.iter().enumerate() {
        let op = format!("op-{n}");
        let h = [("authorization", "Bearer alice"), ("content-type", "application/json"), ("x-op", op.as_str())];
        let before = s.up.executions();
        let first = http::request(s.envoy.port, "POST", "/v1/payments?a=1&b=2", &h, b"{}").expect("request");
        assert_eq!(first.status, 201, "{}", first.body_text());
        let r = http::request(s.envoy.port, "POST", spelling, &h, b"{}").expect("request");
        if s.up.executions() - before != 1 {
            again.push(format!("{spelling} (answered {})", r.status));
        }
    }
    assert!(again.is_empty(), "one derived key executed again through: {again:?}");
}

/// One request over HTTP/2 as `tests/oracle/h2_send.py` sends it (`request`: method, path,
/// authority, body, headers in order, any spelling Envoy's HTTP/2 codec takes): its answer.
fn h2_send(s: &Stack, request: serde_json::Value) -> serde_json::Value {
    let out = Command::new("python3")
        .arg(support::repo_root().join("tests/oracle/h2_send.py"))
        .arg(s.envoy.port.to_string())
        .arg(request.to_string())
        .output()
        .expect("python3 tests/oracle/h2_send.py (h2 installed by scripts/install-deps.sh h2-client)");
    serde_json::from_slice(&out.stdout).expect("h2_send.py's answer")
}

/// Found by the boundary oracle (issue 41, the smallest pair it printed): `:method: Post` over
/// HTTP/2 (Envoy forwards it; its HTTP/1 codec refuses it), which Werkzeug and Django run as POST,
/// passed unprotected, so the same key sent again as POST executed a second time.
#[test]
fn a_method_in_another_letter_case_over_http2_is_protected() {
    let s = Stack::new(r#"{"scope": {"headers": ["authorization"]}}"#);
    let key = "k-method-case";
    let first = h2_send(
        &s,
        serde_json::json!({"method": "Post", "path": "/v1/payments", "authority": "idemgate.test", "body": "{}",
                "headers": [["authorization", "Bearer alice"], ["idempotency-key", key],
                            ["content-type", "application/json"], ["content-length", "2"]]}),
    );
    assert_eq!(first["status"], 201, "{first}");
    let r = post(&s, "/v1/payments", key);
    assert_eq!(s.up.executions_with_key(key), 1, "Post over HTTP/2 then POST executed twice (answered {})", r.status);
    assert_eq!(r.status, 422, "{}", r.body_text());
}

/// Found by the boundary oracle (issue 41, the smallest pair it printed, on Django, Express, Go and
/// Tomcat): `authorization: Bearer alice  ` over HTTP/2, which Envoy forwards with its trailing
/// spaces and every HTTP/1.1 backend reads as `Bearer alice`, was another scope to idemgate, so
/// the same key sent again over HTTP/1.1 (where Envoy's parser drops the spaces) executed again.
#[test]
fn whitespace_around_a_scope_value_over_http2_is_one_caller() {
    let s = Stack::new(r#"{"scope": {"headers": ["authorization"]}}"#);
    let key = "k-scope-space";
    let first = h2_send(
        &s,
        serde_json::json!({"method": "POST", "path": "/v1/payments", "authority": "idemgate.test", "body": "{}",
                "headers": [["authorization", "Bearer alice  "], ["idempotency-key", key],
                            ["content-type", "application/json"], ["content-length", "2"]]}),
    );
    assert_eq!(first["status"], 201, "{first}");
    let r = post(&s, "/v1/payments", key);
    assert_eq!(s.up.executions_with_key(key), 1, "executed again in another scope (answered {})", r.status);
    assert_eq!(r.header("idempotent-replayed"), Some("true"), "{} {}", r.status, r.body_text());
}

/// Found by the boundary oracle (issue 41, the smallest pairs it printed): with `derive_key`,
/// `:method: post` over HTTP/2 (Django runs it as POST) derived another key than POST, and
/// `x-op: k1` on two lines (Express and Fastify read it as `k1, k1`) another than `x-op: k1, k1`:
/// each executed twice. Now the method is read in upper case, and a derive header on two lines
/// is refused (400 key-repeated) before anything executes.
#[test]
fn derived_keys_read_the_method_and_repeated_headers_as_backends_do() {
    let s = Stack::new(r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-op"]}}"#);
    let h = [("authorization", "Bearer alice"), ("content-type", "application/json"), ("x-op", "op-m")];
    let before = s.up.executions();
    let first = h2_send(
        &s,
        serde_json::json!({"method": "post", "path": "/v1/payments", "authority": "idemgate.test", "body": "{}",
                "headers": [["authorization", "Bearer alice"], ["x-op", "op-m"],
                            ["content-type", "application/json"], ["content-length", "2"]]}),
    );
    assert_eq!(first["status"], 201, "{first}");
    let r = http::request(s.envoy.port, "POST", "/v1/payments", &h, b"{}").expect("request");
    assert_eq!(s.up.executions() - before, 1, "post over HTTP/2 then POST executed twice (answered {})", r.status);

    let joined = [("authorization", "Bearer alice"), ("content-type", "application/json"), ("x-op", "op-r, op-r")];
    let two_lines =
        [("authorization", "Bearer alice"), ("content-type", "application/json"), ("x-op", "op-r"), ("x-op", "op-r")];
    let before = s.up.executions();
    let a = http::request(s.envoy.port, "POST", "/v1/payments", &joined, b"{}").expect("request");
    assert_eq!(a.status, 201, "{}", a.body_text());
    let b = http::request(s.envoy.port, "POST", "/v1/payments", &two_lines, b"{}").expect("request");
    assert_eq!(s.up.executions() - before, 1, "x-op on one line then on two executed twice (answered {})", b.status);
    assert_eq!((b.status, b.problem().as_str()), (400, "key-repeated"), "{}", b.body_text());
}

/// Found by the boundary oracle (issue 41, configuration `include_body`, the `multipart` spellings,
/// seed 41: 130 counterexamples on the seven backends): with `derive_key.include_body` a
/// multipart/form-data body's key was derived from its bytes, so a retry every backend of the
/// panel parses into the same fields and files (another boundary, another part order, header
/// names in another case, a name unquoted, a preamble and an epilogue) executed again.
#[test]
fn multipart_bodies_backends_parse_alike_derive_one_key_with_include_body() {
    let s = Stack::new(
        r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-op"], "include_body": true}}"#,
    );
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
    let canonical = body("b1", &[amount, currency, tag_x, tag_y, doc]);
    let spellings = [
        ("b2", body("b2", &[amount, currency, tag_x, tag_y, doc])),
        ("b1", body("b1", &[currency, tag_x, tag_y, doc, amount])),
        ("b1", canonical.replace("Content-Disposition:", "content-disposition:")),
        ("b1", canonical.replace("name=\"amount\"", "name=amount")),
        ("b1", format!("preamble\r\n{canonical}epilogue\r\n")),
    ];
    let mut again = vec![];
    for (n, (boundary, spelling)) in spellings.iter().enumerate() {
        let op = format!("op-multipart-{n}");
        let h = |b: &str| {
            [
                ("authorization", "Bearer alice".to_string()),
                ("content-type", format!("multipart/form-data; boundary={b}")),
                ("x-op", op.clone()),
            ]
        };
        let (h1, h2) = (h("b1"), h(boundary));
        let h1: Vec<(&str, &str)> = h1.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let h2: Vec<(&str, &str)> = h2.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let before = s.up.executions();
        let first = http::request(s.envoy.port, "POST", "/v1/payments", &h1, canonical.as_bytes()).expect("request");
        assert_eq!(first.status, 201, "{}", first.body_text());
        let r = http::request(s.envoy.port, "POST", "/v1/payments", &h2, spelling.as_bytes()).expect("request");
        if s.up.executions() - before != 1 {
            again.push(format!("{spelling:?} (answered {})", r.status));
        } else {
            assert!(r.status == 422 || r.header("idempotent-replayed") == Some("true"), "{spelling}: {}", r.status);
        }
    }
    // Another file content is another form to every backend: it executes.
    let h = [
        ("authorization", "Bearer alice"),
        ("content-type", "multipart/form-data; boundary=b1"),
        ("x-op", "op-multipart-0"),
    ];
    let before = s.up.executions();
    let other = canonical.replace("\r\n\r\nhello", "\r\n\r\nhello!");
    let r = http::request(s.envoy.port, "POST", "/v1/payments", &h, other.as_bytes()).expect("request");
    assert_eq!((r.status, s.up.executions() - before), (201, 1), "{}", r.body_text());
    assert!(again.is_empty(), "one derived key executed again through: {again:?}");
}

/// Found by the boundary oracle (issue 41, configuration `include_body`, the `form` spellings,
/// seed 41): with `derive_key.include_body` a urlencoded form's key was derived from its bytes, so
/// a retry every backend of the panel parses into the same fields (another field order, `%20` for
/// `+`, escapes in another case, an unreserved byte %-encoded, empty pairs) executed again.
#[test]
fn form_bodies_backends_parse_alike_derive_one_key_with_include_body() {
    let s = Stack::new(
        r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-op"], "include_body": true}}"#,
    );
    let canonical = "amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y";
    let spellings = [
        "currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y&amount=1",
        "amount=1&currency=eur&memo=a%20b%2Fcaf%C3%A9&tag=x&tag=y",
        "amount=1&currency=eur&memo=a+b%2fcaf%c3%a9&tag=x&tag=y",
        "%61mount=1&currency=%65ur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y",
        "&amount=1&&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y&",
    ];
    let form = "application/x-www-form-urlencoded";
    let again = body_executed_again(&s, form, canonical.as_bytes(), &spellings, "form");
    // A repeated field's values in another order are another form to every backend: it executes.
    let h = [("authorization", "Bearer alice"), ("content-type", form), ("x-op", "op-form-0")];
    let before = s.up.executions();
    let other = http::request(
        s.envoy.port,
        "POST",
        "/v1/payments",
        &h,
        b"amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=y&tag=x",
    )
    .expect("request");
    assert_eq!((other.status, s.up.executions() - before), (201, 1), "{}", other.body_text());
    assert!(again.is_empty(), "one derived key executed again through: {again:?}");
}

/// Found by the boundary oracle (issue 41, configuration `include_body`, seed 41): with
/// `derive_key.include_body` the key was derived from the body's bytes, so a retry whose JSON
/// every parsing backend of the panel reads as the first body (whitespace, member order, `1.0`,
/// `1e0`, `\u0065ur`, a repeated member) derived another key and executed again.
#[test]
fn json_bodies_backends_parse_alike_derive_one_key_with_include_body() {
    let s = Stack::new(
        r#"{"scope": {"headers": ["authorization"]}, "derive_key": {"headers": ["x-op"], "include_body": true}}"#,
    );
    let spellings = [
        r#"{"amount": 1, "currency": "eur"}"#,
        r#"{"currency":"eur","amount":1}"#,
        r#"{"amount":1.0,"currency":"eur"}"#,
        r#"{"amount":1e0,"currency":"eur"}"#,
        r#"{"amount":1,"currency":"\u0065ur"}"#,
    ];
    // A member named twice is refused, not read (`body-ambiguous`: JSON readers disagree on which
    // value runs): boundary_oracle::a_json_body_naming_a_member_twice_is_refused_before_a_first_value_backend.
    let first = br#"{"amount":1,"currency":"eur"}"#;
    let again = body_executed_again(&s, "application/json", first, &spellings, "body");
    // Another amount is another operation: it executes.
    let h = [("authorization", "Bearer alice"), ("content-type", "application/json"), ("x-op", "op-body-0")];
    let before = s.up.executions();
    let other =
        http::request(s.envoy.port, "POST", "/v1/payments", &h, br#"{"amount":2,"currency":"eur"}"#).expect("request");
    assert_eq!((other.status, s.up.executions() - before), (201, 1), "{}", other.body_text());
    assert!(again.is_empty(), "one derived key executed again through: {again:?}");
}
