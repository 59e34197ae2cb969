//! What a finished exchange means, when the answer the filter sees is not the upstream's own:
//! a later filter (Lua, ext_proc) replacing an executed response with Envoy's local reply, a
//! later filter refusing before the router, and (detached mode) an upstream whose answer carries
//! the texts of Envoy's own failure replies. The key is released only on positive evidence that
//! the request never left; every test counts the upstream's executions.

use crate::support;

use support::http::{self, Response};
use support::Stack;

const CFG: &str = r#"{"scope": {"headers": ["authorization"]}}"#;
const DETACHED: &str = r#"{"scope": {"headers": ["authorization"]}, "forwarding": "detached",
    "upstream": {"cluster": "upstream", "hop": "direct", "timeout_ms": 5000}}"#;

fn post(s: &Stack, key: &str, extra: &[(&str, &str)]) -> Response {
    let mut h = vec![("authorization", "Bearer alice"), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    http::request(s.envoy.port, "POST", "/charges", &h, b"{}").expect("request")
}

/// A Lua filter after idemgate whose `envoy_on_response` buffers the whole response body.
const LUA_BUFFERS_RESPONSE: &str = r#"- name: envoy.filters.http.lua
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
    default_source_code:
      inline_string: |
        function envoy_on_response(h)
          h:body()
        end
"#;

/// A Lua filter after idemgate that answers 403 itself, before the router, when asked to.
const LUA_DENIES_REQUEST: &str = r#"- name: envoy.filters.http.lua
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
    default_source_code:
      inline_string: |
        function envoy_on_request(h)
          if h:headers():get("x-deny") ~= nil then
            h:respond({[":status"] = "403"}, "denied by a later filter")
          end
        end
"#;

#[test]
fn a_later_filter_replacing_an_executed_response_with_envoys_500_is_never_released() {
    // The upstream answers 201 with a body larger than the listener's buffer limit; the Lua
    // filter's h:body() makes Envoy answer 500 (response_payload_too_large, no response flag).
    let s = Stack::with(CFG, |o| {
        o.buffer_limit_bytes = 64 * 1024;
        o.extra_http_filters = vec![LUA_BUFFERS_RESPONSE.into()];
    });
    let big = [("x-up-body-bytes", "300000")];
    let first = post(&s, "k-lua-500", &big);
    assert_eq!(first.status, 500, "Envoy's own reply replaced the upstream's 201: {}", first.body_text());
    let retry = post(&s, "k-lua-500", &big);
    assert_eq!(s.up.executions(), 1, "the retry must not execute again");
    assert_eq!(retry.status, 409, "{}", retry.body_text());
    assert_eq!(retry.problem(), "outcome-unknown");
    assert_eq!(s.envoy.stat("idemgate.released"), 0);
    // Counted twice: the record marked outcome-unknown, then the retry answered with it.
    assert_eq!(s.envoy.stat("idemgate.unknown_outcome"), 2);
}

#[test]
fn a_failure_of_ext_proc_on_the_response_path_is_never_released() {
    // ext_proc (failure_mode_allow: false) asks its processor about the response headers; the
    // processor is down, so Envoy answers 500 after the upstream executed.
    let closed = support::free_port();
    let s = Stack::with(CFG, |o| {
        o.extra_http_filters = vec![r#"- name: envoy.filters.http.ext_proc
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
    grpc_service:
      envoy_grpc: {cluster_name: ext_proc_down}
      timeout: 1s
    failure_mode_allow: false
    processing_mode: {request_header_mode: SKIP, response_header_mode: SEND}
"#
        .into()];
        o.extra_clusters = vec![format!(
            r#"- name: ext_proc_down
  connect_timeout: 0.25s
  type: STATIC
  typed_extension_protocol_options:
    envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
      "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
      explicit_http_config: {{http2_protocol_options: {{}}}}
  load_assignment:
    cluster_name: ext_proc_down
    endpoints:
    - lb_endpoints:
      - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {closed}}}}}}}
"#
        )];
    });
    let first = post(&s, "k-ext-proc", &[]);
    assert!(
        first.status >= 500,
        "Envoy's own reply replaced the upstream's 201: {} {}",
        first.status,
        first.body_text()
    );
    let retry = post(&s, "k-ext-proc", &[]);
    assert_eq!(s.up.executions(), 1, "the retry must not execute again");
    // ext_proc also fails on idemgate's own 409 and turns it into a 500: the counters show what
    // idemgate answered (the record marked outcome-unknown, then the retry answered with it).
    assert!(retry.status >= 500, "{} {}", retry.status, retry.body_text());
    assert_eq!(s.envoy.stat("idemgate.released"), 0);
    assert_eq!(s.envoy.stat("idemgate.unknown_outcome"), 2);
}

#[test]
fn a_later_filter_refusing_before_the_router_releases_the_key() {
    // No upstream host was ever selected: the request provably never left Envoy.
    let s = Stack::with(CFG, |o| o.extra_http_filters = vec![LUA_DENIES_REQUEST.into()]);
    let denied = post(&s, "k-denied", &[("x-deny", "1")]);
    assert_eq!(denied.status, 403, "{}", denied.body_text());
    assert_eq!(s.up.executions(), 0);
    let retry = post(&s, "k-denied", &[]);
    assert_eq!(retry.status, 201, "the retry executes: {}", retry.body_text());
    assert_eq!(s.up.executions(), 1);
    assert_eq!(s.envoy.stat("idemgate.released"), 1);
    assert_eq!(s.envoy.stat("idemgate.unknown_outcome"), 0);
}

/// The texts of Envoy's own failure replies (router and async client), as an upstream may send
/// them too.
const ENVOY_FAILURE_TEXTS: [&str; 5] = [
    "no healthy upstream",
    "upstream connect error or disconnect/reset before headers. reset reason: connection failure, transport failure reason: delayed connect error: Connection refused",
    "upstream connect error or disconnect/reset before headers. reset reason: remote connection failure, transport failure reason: delayed connect error: 111",
    "upstream connect error or disconnect/reset before headers. reset reason: overflow",
    "upstream request timeout",
];

#[test]
fn detached_an_upstream_answer_carrying_envoys_failure_texts_is_stored_not_released() {
    let s = Stack::new(DETACHED);
    let mut cases = 0;
    for (t, text) in ENVOY_FAILURE_TEXTS.iter().enumerate() {
        for status in ["200", "503", "504"] {
            // The upstream's usual headers, and only the two headers Envoy's own replies carry.
            for plain in [false, true] {
                let key = format!("k-text-{t}-{status}-{plain}");
                let mut h = vec![("x-up-status", status), ("x-up-body", *text)];
                if plain {
                    h.push(("x-up-plain", "1"));
                }
                let first = post(&s, &key, &h);
                assert_eq!(first.status.to_string(), status, "{key}: the upstream's answer is passed on");
                assert_eq!(first.body_text(), *text, "{key}");
                let retry = post(&s, &key, &h);
                assert_eq!(s.up.executions_with_key(&key), 1, "{key}: executed again after {text:?}");
                assert_eq!(retry.status.to_string(), status, "{key}: {}", retry.body_text());
                assert_eq!(retry.header("idempotent-replayed"), Some("true"), "{key}");
                assert_eq!(retry.body_text(), *text, "{key}");
                cases += 1;
            }
        }
    }
    assert_eq!(s.envoy.stat("idemgate.released"), 0);
    assert_eq!(s.envoy.stat("idemgate.stored"), cases);
}

#[test]
fn detached_envoys_own_connection_failure_still_releases() {
    // Nothing listens on the upstream port: Envoy's async client answers 503 itself.
    let s = Stack::with(DETACHED, |o| o.upstream_port = support::free_port());
    for _ in 0..2 {
        let r = post(&s, "k-detached-refused", &[]);
        assert_eq!(r.status, 503, "Envoy's own answer, not a 409: {}", r.body_text());
        assert!(r.body_text().starts_with("upstream connect error"), "{}", r.body_text());
    }
    assert_eq!(s.envoy.stat("idemgate.released"), 2);
    assert_eq!(s.envoy.stat("idemgate.unknown_outcome"), 0);
}
