//! Replays and content codings (issue 24, item 5), in Envoy 1.40 with a counting upstream: a
//! response stored gzip-encoded (an upstream that gzips, or Envoy's compressor placed after
//! idemgate) is replayed to a retry that does not accept gzip in its identity form, never as the
//! gzip bytes; a retry that accepts gzip gets the stored bytes; a coding idemgate cannot decode is
//! refused with 406 `encoding-not-accepted`. Nothing executes twice.

use crate::support;

use std::io::Read;

use support::http::{self, Response};
use support::Stack;

const CFG: &str = r#"{"scope": {"headers": ["authorization"]}}"#;

/// Envoy's gzip compressor, for JSON answers of any size.
const COMPRESSOR: &str = r#"- name: envoy.filters.http.compressor
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.compressor.v3.Compressor
    response_direction_config:
      common_config:
        min_content_length: 1
        content_type: [application/json]
    compressor_library:
      name: gzip
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.compression.gzip.compressor.v3.Gzip
"#;

fn post(s: &Stack, key: &str, extra: &[(&str, &str)]) -> Response {
    let mut h: Vec<(&str, &str)> =
        vec![("authorization", "Bearer alice"), ("content-type", "application/json"), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    http::request(s.envoy.port, "POST", "/charges", &h, br#"{"amount":5}"#).expect("request")
}

fn gunzip(b: &[u8]) -> Vec<u8> {
    let mut out = vec![];
    flate2::read::MultiGzDecoder::new(b).read_to_end(&mut out).expect("gzip body");
    out
}

/// The first request accepted gzip and got it; then retries that do and do not accept it.
fn a_gzip_first_response_is_replayed_to_each_retry_as_it_accepts(s: &Stack, first_extra: &[(&str, &str)]) {
    let mut extra = vec![("accept-encoding", "gzip")];
    extra.extend_from_slice(first_extra);
    let first = post(s, "k-gz", &extra);
    assert_eq!(first.status, 201, "{}", first.body_text());
    assert_eq!(first.header("content-encoding"), Some("gzip"));
    let identity = gunzip(&first.body);
    assert!(identity.starts_with(b"{\"id\":\"res-1\""), "{}", String::from_utf8_lossy(&identity));
    for accept in [Some("identity"), None, Some("br, deflate"), Some("gzip;q=0, identity")] {
        let h: Vec<(&str, &str)> = accept.iter().map(|a| ("accept-encoding", *a)).collect();
        let r = post(s, "k-gz", &h);
        assert_eq!(r.status, 201, "{accept:?}: {}", r.body_text());
        assert_eq!(r.header("idempotent-replayed"), Some("true"), "{accept:?}");
        assert_eq!(r.header("content-encoding"), None, "{accept:?}: a coding the retry did not accept");
        assert_eq!(r.body, identity, "{accept:?}: the gzip bytes replayed to a retry that does not accept gzip");
    }
    let r = post(s, "k-gz", &[("accept-encoding", "gzip, deflate")]);
    assert_eq!((r.status, r.header("content-encoding")), (201, Some("gzip")));
    assert_eq!(gunzip(&r.body), identity);
    assert_eq!(s.up.executions(), 1);
    assert!(s.envoy.stat("idemgate.replays_decoded") >= 4, "{}", s.envoy.stat("idemgate.replays_decoded"));
}

#[test]
fn an_upstream_that_gzips_is_replayed_decoded_to_a_retry_that_does_not_accept_gzip() {
    let s = Stack::new(CFG);
    a_gzip_first_response_is_replayed_to_each_retry_as_it_accepts(&s, &[("x-up-coding", "gzip")]);
}

#[test]
fn a_compressor_after_idemgate_is_replayed_decoded_to_a_retry_that_does_not_accept_gzip() {
    let s = Stack::with(CFG, |o| o.extra_http_filters.push(COMPRESSOR.to_string()));
    a_gzip_first_response_is_replayed_to_each_retry_as_it_accepts(&s, &[]);
}

#[test]
fn a_coding_idemgate_cannot_decode_is_refused_with_406_never_replayed_as_bytes_the_retry_cannot_read() {
    let s = Stack::new(CFG);
    let first = post(&s, "k-br", &[("accept-encoding", "br"), ("x-up-coding", "br")]);
    assert_eq!((first.status, first.header("content-encoding")), (201, Some("br")));
    let r = post(&s, "k-br", &[("accept-encoding", "gzip")]);
    assert_eq!(r.status, 406, "{}", r.body_text());
    assert_eq!(r.json()["type"], "urn:idemgate:problem:encoding-not-accepted");
    assert!(r.json()["detail"].as_str().unwrap_or("").contains("`Accept-Encoding: br`"), "{}", r.body_text());
    // The same retry accepting br gets the original.
    let r = post(&s, "k-br", &[("accept-encoding", "br")]);
    assert_eq!((r.status, r.header("idempotent-replayed")), (201, Some("true")));
    assert_eq!(r.body, first.body);
    assert_eq!(s.up.executions(), 1);
    assert_eq!(s.envoy.stat("idemgate.replays_encoding_not_accepted"), 1);
}

/// Issue 24, item 8: a local reply carries no trailers, so a replay of a response that ended with
/// trailers says which it lacks (`idempotent-replayed-trailers-dropped`) instead of passing for
/// the whole response. (Before: the replay carried neither the trailer nor any word of it.)
#[test]
fn a_replay_of_a_response_with_trailers_names_the_trailers_it_lacks() {
    let s = Stack::with(CFG, |o| {
        o.http1_trailers = true;
        o.upstream_trailers = true;
    });
    let extra = [("x-up-trailer", "x-checksum: abc123"), ("connection", "close")];
    let first = post(&s, "k-trailers", &extra);
    assert_eq!(first.status, 201, "{}", first.body_text());
    assert_eq!(first.header("idempotent-replayed-trailers-dropped"), None);
    let r = post(&s, "k-trailers", &[("connection", "close")]);
    assert_eq!((r.status, r.header("idempotent-replayed")), (201, Some("true")));
    assert_eq!(r.body, first.body);
    assert_eq!(r.header("idempotent-replayed-trailers-dropped"), Some("x-checksum"));
    // An upstream cannot make a replay claim trailers it never had.
    let plain = post(&s, "k-no-trailers", &[("connection", "close")]);
    assert_eq!(plain.status, 201);
    let r = post(&s, "k-no-trailers", &[("connection", "close")]);
    assert_eq!(
        (r.header("idempotent-replayed"), r.header("idempotent-replayed-trailers-dropped")),
        (Some("true"), None)
    );
    assert_eq!(s.up.executions(), 2);
}

/// Detached forwarding keeps the same promise: the detached call's answer (the root's callout
/// response) is a local reply to the first client and a replay to every retry, neither carrying
/// trailers, so both name those the upstream sent; and an upstream's own
/// `idempotent-replayed-trailers-dropped` is never stored nor passed on. (Before: the callout's
/// trailers were ignored, so neither named them, and the forged header was stored and replayed.)
#[test]
fn a_detached_response_with_trailers_names_them_and_an_upstreams_forged_claim_is_dropped() {
    detached_trailers_named(support::Build::from_env());
}

/// The case above against `build` (the native build's run: `native_module::`).
pub fn detached_trailers_named(build: support::Build) {
    let cfg = r#"{"scope": {"headers": ["authorization"]}, "forwarding": "detached",
                  "upstream": {"cluster": "upstream", "hop": "direct", "timeout_ms": 10000}}"#;
    let s = Stack::with(cfg, |o| {
        o.upstream_trailers = true;
        o.build = build;
    });
    let first = post(&s, "k-dt", &[("x-up-trailer", "x-checksum: abc123")]);
    assert_eq!(first.status, 201, "{}", first.body_text());
    assert_eq!(first.header("idempotent-replayed-trailers-dropped"), Some("x-checksum"), "{:?}", first.headers);
    let r = post(&s, "k-dt", &[]);
    assert_eq!((r.status, r.header("idempotent-replayed")), (201, Some("true")));
    assert_eq!(r.body, first.body);
    assert_eq!(r.header("idempotent-replayed-trailers-dropped"), Some("x-checksum"), "{:?}", r.headers);
    let forged = [("x-up-header", "idempotent-replayed-trailers-dropped: x-forged")];
    let first = post(&s, "k-dt-forged", &forged);
    assert_eq!(first.status, 201, "{}", first.body_text());
    assert_eq!(first.header("idempotent-replayed-trailers-dropped"), None, "{:?}", first.headers);
    let r = post(&s, "k-dt-forged", &[]);
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(r.header("idempotent-replayed-trailers-dropped"), None, "{:?}", r.headers);
    assert_eq!(s.up.executions(), 2);
}

/// Envoy's CORS filter, and the policy of the test's catch-all route: two allowed origins.
const CORS: &str = r#"- name: envoy.filters.http.cors
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors
"#;
const CORS_POLICY: &str = r#"                typed_per_filter_config:
                  envoy.filters.http.cors:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.cors.v3.CorsPolicy
                    allow_origin_string_match: [{exact: "https://a.test"}, {exact: "https://b.test"}]
"#;

/// The first request comes from origin a, its retry from origin b: which origin the replay's
/// `access-control-allow-origin` names.
fn cors_origin_of_the_replay(cors_before_idemgate: bool) -> Option<String> {
    let s = Stack::with(CFG, |o| {
        o.route_fields = CORS_POLICY.to_string();
        if cors_before_idemgate {
            o.filters_before_idemgate.push(CORS.to_string());
        } else {
            o.extra_http_filters.push(CORS.to_string());
        }
    });
    let first = post(&s, "k-cors", &[("origin", "https://a.test")]);
    assert_eq!(first.status, 201, "{}", first.body_text());
    assert_eq!(first.header("access-control-allow-origin"), Some("https://a.test"));
    let r = post(&s, "k-cors", &[("origin", "https://b.test")]);
    assert_eq!((r.status, r.header("idempotent-replayed")), (201, Some("true")));
    assert_eq!(r.body, first.body);
    assert_eq!(s.up.executions(), 1);
    r.header("access-control-allow-origin").map(str::to_string)
}

/// Issue 24, item 8: CORS placed before idemgate (as `envoy/envoy.yaml` advises) answers each
/// replay for its own origin; placed after idemgate, its headers for the first origin are part of
/// the response idemgate stores, and every replay carries them (the documented reason for the
/// advice; a browser at origin b then refuses the replay).
#[test]
fn cors_before_idemgate_answers_each_replay_for_its_own_origin() {
    assert_eq!(cors_origin_of_the_replay(true).as_deref(), Some("https://b.test"));
    assert_eq!(cors_origin_of_the_replay(false).as_deref(), Some("https://a.test"));
}
