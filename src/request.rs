//! What the core sees of a request: its head as the host gave it, every header line kept.

/// The request's pseudo headers and every header line, names lowercase as Envoy delivers them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    /// `:path` as sent, query included.
    pub path: String,
    pub authority: String,
    /// `:scheme` as sent (`http` or `https`; empty when the host gave none).
    pub scheme: String,
    /// All header lines in order (pseudo headers may be included; they are ignored by `values`).
    pub headers: Vec<(String, Vec<u8>)>,
    /// The request trailers, in order (empty until they arrive, and for requests without any).
    pub trailers: Vec<(String, Vec<u8>)>,
}

/// A gRPC request's content type: `application/grpc`, `application/grpc+proto`,
/// `application/grpc-web...` (any letter case): Envoy reshapes every local reply to such a request
/// into a trailers-only gRPC status, so a replay cannot be faithful.
pub fn is_grpc_content_type(v: &[u8]) -> bool {
    v.get(..16).is_some_and(|p| p.eq_ignore_ascii_case(b"application/grpc"))
}

/// Whether Envoy sends a local reply to a request of this content type as a gRPC status
/// (`Grpc::Common::hasGrpcContentType`: exactly `application/grpc` or `application/grpc+...`;
/// gRPC-Web is answered as plain HTTP).
pub fn envoy_answers_as_grpc(v: &[u8]) -> bool {
    v == b"application/grpc" || v.starts_with(b"application/grpc+")
}

/// A field value without the spaces and tabs around it (RFC 9110 5.5: they are not part of it).
/// Envoy's HTTP/1 parser drops them; over HTTP/2 it forwards them, and every HTTP/1.1 backend's
/// parser drops them then: read with them, one caller (or key) sent over HTTP/2 with a trailing
/// space was another to idemgate (found by the boundary oracle, issue 41).
pub fn ows_trimmed(v: &[u8]) -> &[u8] {
    let start = v.iter().position(|b| *b != b' ' && *b != b'\t').unwrap_or(v.len());
    let end = v.iter().rposition(|b| *b != b' ' && *b != b'\t').map_or(start, |i| i + 1);
    v.get(start..end).unwrap_or_default()
}

impl RequestHead {
    /// Builds a head from the host's full header list (pseudo headers included).
    pub fn from_pairs(pairs: Vec<(String, Vec<u8>)>) -> RequestHead {
        let mut head = RequestHead::default();
        for (name, value) in &pairs {
            let text = || String::from_utf8_lossy(value).into_owned();
            match name.as_str() {
                ":method" => head.method = text(),
                ":path" => head.path = text(),
                ":authority" => head.authority = text(),
                ":scheme" => head.scheme = text(),
                _ => {}
            }
        }
        head.headers = pairs;
        head
    }

    /// Every value of header `name` (lowercase), in order, without the spaces and tabs around it
    /// (`ows_trimmed`). A header sent on several lines has several values: the host's
    /// single-header read would only return the first.
    pub fn values(&self, name: &str) -> Vec<&[u8]> {
        self.headers.iter().filter(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| ows_trimmed(v)).collect()
    }

    /// `values` without collecting them (no allocation: the hashes walk the lines twice, once
    /// to count them).
    pub fn values_iter<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers.iter().filter(move |(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| ows_trimmed(v))
    }

    /// A gRPC request (`is_grpc_content_type` of its first `content-type`).
    pub fn is_grpc(&self) -> bool {
        self.values("content-type").first().is_some_and(|v| is_grpc_content_type(v))
    }

    /// A head for tests: method, path and header lines.
    #[cfg(test)]
    pub(crate) fn for_test(method: &str, path: &str, headers: &[(&str, &str)]) -> RequestHead {
        let mut pairs =
            vec![(":method".to_string(), method.as_bytes().to_vec()), (":path".to_string(), path.as_bytes().to_vec())];
        pairs.extend(headers.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())));
        RequestHead::from_pairs(pairs)
    }

    /// The path without its query string.
    pub fn path_without_query(&self) -> &str {
        self.path.split_once('?').map_or(self.path.as_str(), |(p, _)| p)
    }

    /// A protected request reaches the upstream at most once, so Envoy must never re-send it:
    /// removes every header with which a client asks the router for retries (Envoy honours them
    /// from internal clients) and caps the router's retries at zero, which also stops a route's
    /// `retry_policy` and the hedging that rides on it. Also removes the headers with which a
    /// client sets the router's timeout (`ROUTER_TIMEOUT_HEADERS`): the route's timeout is the one
    /// `lock_ttl_seconds` is sized to outlast; a client disabling it (`0`) or lengthening it
    /// would let its request run past the lock, and a retry then find it stale. Returns the
    /// headers to remove from the host's map, then to set there (`ROUTER_RETRY_CAP`).
    pub fn forbid_router_retries(&mut self) -> Vec<String> {
        let mut removed: Vec<String> = vec![];
        self.headers.retain(|(n, _)| {
            let drop = ROUTER_RETRY_HEADERS.iter().chain(ROUTER_TIMEOUT_HEADERS).any(|h| n.eq_ignore_ascii_case(h))
                || n.eq_ignore_ascii_case(ROUTER_RETRY_CAP.0);
            if drop && !removed.iter().any(|r| r.eq_ignore_ascii_case(n)) {
                removed.push(n.to_ascii_lowercase());
            }
            !drop
        });
        self.headers.push((ROUTER_RETRY_CAP.0.to_string(), ROUTER_RETRY_CAP.1.as_bytes().to_vec()));
        removed
    }
}

/// Request headers that make Envoy's router re-send a request (or widen when it does): removed
/// from protected requests.
pub const ROUTER_RETRY_HEADERS: &[&str] = &[
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    "x-envoy-hedge-on-per-try-timeout",
];

/// Request headers with which a client sets how long the router waits for the upstream (Envoy
/// honours them from internal clients; the second only where the router is set to
/// `respect_expected_rq_timeout`): removed from protected requests.
pub const ROUTER_TIMEOUT_HEADERS: &[&str] = &["x-envoy-upstream-rq-timeout-ms", "x-envoy-expected-rq-timeout-ms"];

/// Set on every protected request: the router reads it after the filters and then sends the
/// request once, whatever the route's `retry_policy` says (verified on Envoy 1.40).
pub const ROUTER_RETRY_CAP: (&str, &str) = ("x-envoy-max-retries", "0");

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn repeated_header_lines_are_all_returned_in_order() {
        let head = RequestHead::from_pairs(vec![
            (":method".into(), b"POST".to_vec()),
            (":path".into(), b"/pay?x=1".to_vec()),
            ("x-a".into(), b"1".to_vec()),
            ("x-b".into(), b"2".to_vec()),
            ("x-a".into(), b"3".to_vec()),
        ]);
        assert_eq!(head.method, "POST");
        assert_eq!(head.values("x-a"), vec![b"1".as_slice(), b"3".as_slice()]);
        assert!(head.values("x-c").is_empty());
        assert_eq!(head.path_without_query(), "/pay");
    }

    #[test]
    fn a_protected_request_carries_no_retry_or_timeout_request_and_caps_the_routers_retries_at_zero() {
        let mut head = RequestHead::for_test(
            "POST",
            "/pay",
            &[
                ("X-Envoy-Retry-On", "5xx"),
                ("x-envoy-retry-grpc-on", "unavailable"),
                ("x-envoy-max-retries", "5"),
                ("x-envoy-retriable-status-codes", "503"),
                ("x-envoy-hedge-on-per-try-timeout", "true"),
                ("x-envoy-retry-on", "reset"),
                ("X-Envoy-Upstream-Rq-Timeout-Ms", "0"),
                ("x-envoy-expected-rq-timeout-ms", "600000"),
                ("x-tenant", "acme"),
            ],
        );
        let removed = head.forbid_router_retries();
        assert_eq!(
            removed,
            [
                "x-envoy-retry-on",
                "x-envoy-retry-grpc-on",
                "x-envoy-max-retries",
                "x-envoy-retriable-status-codes",
                "x-envoy-hedge-on-per-try-timeout",
                "x-envoy-upstream-rq-timeout-ms",
                "x-envoy-expected-rq-timeout-ms"
            ]
        );
        let names: Vec<&str> = head.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, [":method", ":path", "x-tenant", "x-envoy-max-retries"]);
        assert_eq!(head.values("x-envoy-max-retries"), vec![b"0".as_slice()]);
        // Nothing to remove: the cap is still set.
        let mut plain = RequestHead::for_test("POST", "/pay", &[]);
        assert!(plain.forbid_router_retries().is_empty());
        assert_eq!(plain.values("x-envoy-max-retries"), vec![b"0".as_slice()]);
    }

    #[test]
    fn grpc_content_types_are_told_apart_as_idemgate_refuses_them_and_as_envoy_answers_them() {
        for v in ["application/grpc", "application/grpc+proto", "Application/GRPC+json", "application/grpc-web+proto"] {
            assert!(is_grpc_content_type(v.as_bytes()), "{v}");
        }
        for v in ["application/json", "application/grp", "text/grpc", ""] {
            assert!(!is_grpc_content_type(v.as_bytes()), "{v}");
        }
        assert!(envoy_answers_as_grpc(b"application/grpc") && envoy_answers_as_grpc(b"application/grpc+proto"));
        assert!(!envoy_answers_as_grpc(b"application/grpc-web") && !envoy_answers_as_grpc(b"application/json"));
        let h = RequestHead::for_test("POST", "/p.S/M", &[("content-type", "application/grpc")]);
        assert!(h.is_grpc());
        assert!(!RequestHead::for_test("POST", "/p", &[("content-type", "application/json")]).is_grpc());
    }
}
