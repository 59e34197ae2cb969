//! Edge-derived keys: for agents that send no `Idempotency-Key` but do send stable identifiers
//! of the operation (for example `x-agent-task-id` and `x-agent-step-id`).
//!
//! The key is `derived-` + 32 hex digits of `SHA-256(tag, method, target, each named header and
//! its values, the body digest or "-", the caller scope)`, the target read as every backend reads
//! it alike (`path::one_target`: `/v1//payments?b=2&a=1` is `/v1/payments?a=1&b=2`). Method and path are in it so that two
//! different operations in one step never collapse into one; the caller scope so that two callers'
//! task ids never meet. A request lacking any named header, or any scope header (an anonymous
//! caller, `CallerScope::identified`), gets no key and passes unprotected like any request without
//! a key, whatever `scope.anonymous` says: task and step ids are far too easily shared to pool
//! anonymous callers on them. (An anonymous request that sends its own key is what
//! `scope.anonymous` decides: refused by default.)

use crate::config::{DeriveKey, FingerprintConfig};
use crate::fingerprint::Framer;
use crate::key::IdempotencyKey;
use crate::request::RequestHead;
use crate::scope::CallerScope;

const DERIVE_TAG: &[u8] = b"idemgate-derive-v1\0";

/// The derived key, or `None` when a named header or the caller's identity is missing (even with
/// `scope.anonymous: "shared"`).
/// `body_digest` (the body's `fingerprint::body_digest`) is consulted only when `cfg.include_body`
/// is set; it is `fingerprint::derive_body_digest`, the JSON body's meaning to the parsers
/// backends use (whitespace, member order, string escapes, number spellings; a body naming a
/// member twice has none and is refused before this, `body-ambiguous`), or a urlencoded form's fields as their form parsers read them (`form::semantic_form`),
/// whatever `fp.json` says, so two bodies a backend parses alike derive one key rather than two
/// keys that would both execute (the boundary oracle, issue 41). The path counts as the policy's
/// fingerprint counts it (`fp.include_query`).
pub fn derive(
    head: &RequestHead,
    cfg: &DeriveKey,
    fp: &FingerprintConfig,
    scope: &CallerScope,
    body_digest: Option<&[u8; 32]>,
) -> Option<IdempotencyKey> {
    if !scope.identified {
        return None;
    }
    let mut f = Framer::new(DERIVE_TAG);
    // In upper case: Werkzeug and Django run an HTTP/2 `post` as POST (the boundary oracle).
    f.field(head.method.to_ascii_uppercase().as_bytes());
    // The target as every backend reads it alike (`path::one_target`): a retry that spells the
    // path or the query another way derives the same key (found by the boundary oracle).
    f.field(crate::path::one_target(crate::fingerprint::target(head, fp)).as_bytes());
    for name in &cfg.headers {
        let values = head.values(name);
        if values.iter().all(|v| v.is_empty()) {
            return None;
        }
        f.field(name.as_bytes());
        f.count(values.len());
        for v in values {
            f.field(v);
        }
    }
    match (cfg.include_body, body_digest) {
        (true, Some(d)) => f.field(crate::hex::encode(d).as_bytes()),
        (true, None) => return None,
        (false, _) => f.field(b"-"),
    }
    f.field(&scope.hash);
    let digest = f.finish();
    Some(IdempotencyKey::derived(crate::hex::encode(digest.get(..16).unwrap_or_default())))
}

/// The first header of `cfg.headers` sent on more than one line, if any: such a request is
/// refused (`key-repeated`, naming it) rather than given a key. Node's servers (Express, Fastify)
/// read `x-op: a` and `x-op: a` on two lines as `x-op: a, a` on one, which the key would tell
/// apart (found by the boundary oracle, issue 41), and other servers read only the first line.
pub fn repeated_header<'c>(head: &RequestHead, cfg: &'c DeriveKey) -> Option<&'c str> {
    cfg.headers.iter().find(|name| head.values_iter(name).count() > 1).map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Anonymous, Policy, ScopeConfig};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn head(method: &str, path: &str, hs: &[(&str, &str)]) -> RequestHead {
        RequestHead::for_test(method, path, hs)
    }

    fn cfg(include_body: bool) -> DeriveKey {
        DeriveKey { headers: vec!["x-agent-task-id".into(), "x-agent-step-id".into()], include_body }
    }

    fn scope(h: &RequestHead) -> CallerScope {
        CallerScope::of(
            h,
            &ScopeConfig {
                headers: vec!["authorization".into()],
                global: false,
                include_authority: false,
                anonymous: Anonymous::Shared,
            },
        )
    }

    fn key(h: &RequestHead, c: &DeriveKey, body: Option<&[u8]>) -> Option<String> {
        key_with(h, c, &Policy::default().fingerprint, body)
    }

    fn key_with(h: &RequestHead, c: &DeriveKey, fp: &FingerprintConfig, body: Option<&[u8]>) -> Option<String> {
        let digest = body.map(|b| crate::fingerprint::body_digest(h, b, fp).1);
        derive(h, c, fp, &scope(h), digest.as_ref()).map(|k| k.as_str().to_string())
    }

    const STEP: &[(&str, &str)] = &[("authorization", "a"), ("x-agent-task-id", "t1"), ("x-agent-step-id", "s1")];

    #[test]
    fn same_task_and_step_give_the_same_key_and_a_new_step_another() {
        let a = key(&head("POST", "/charges", STEP), &cfg(false), None).unwrap();
        assert!(a.starts_with("derived-") && a.len() == 40);
        assert_eq!(Some(a.clone()), key(&head("POST", "/charges", STEP), &cfg(false), None));
        let next =
            head("POST", "/charges", &[("authorization", "a"), ("x-agent-task-id", "t1"), ("x-agent-step-id", "s2")]);
        assert_ne!(Some(a), key(&next, &cfg(false), None));
    }

    #[test]
    fn method_path_caller_and_optionally_body_separate_operations() {
        let base = key(&head("POST", "/charges", STEP), &cfg(false), None);
        assert_ne!(base, key(&head("POST", "/refunds", STEP), &cfg(false), None));
        assert_ne!(base, key(&head("PATCH", "/charges", STEP), &cfg(false), None));
        let other_caller =
            head("POST", "/charges", &[("authorization", "b"), ("x-agent-task-id", "t1"), ("x-agent-step-id", "s1")]);
        assert_ne!(base, key(&other_caller, &cfg(false), None));
        let h = head("POST", "/charges", STEP);
        assert_eq!(key(&h, &cfg(false), Some(b"x")), key(&h, &cfg(false), Some(b"y")), "body ignored unless asked");
        assert_ne!(key(&h, &cfg(true), Some(b"x")), key(&h, &cfg(true), Some(b"y")));
    }

    /// Found by an adversarial review: the key hashed the raw body and the whole target whatever
    /// the fingerprint counted, so an agent's retry whose JSON members came in another order
    /// (the same request to a `json: "canonical"` fingerprint) derived a second key and executed
    /// again.
    #[test]
    fn requests_the_fingerprint_calls_the_same_derive_the_same_key() {
        let c = cfg(true);
        let canonical = FingerprintConfig { json: crate::config::JsonMode::Canonical, ..Policy::default().fingerprint };
        let h = head("POST", "/charges", STEP);
        let (a, b) = (br#"{"amount":100,"currency":"eur"}"#, br#"{"currency":"eur","amount":100}"#);
        assert_eq!(key_with(&h, &c, &canonical, Some(a)), key_with(&h, &c, &canonical, Some(b)));
        assert_ne!(key_with(&h, &c, &canonical, Some(a)), key_with(&h, &c, &canonical, Some(br#"{"amount":101}"#)));
        assert_ne!(key(&h, &c, Some(a)), key(&h, &c, Some(b)), "raw JSON: another request");
        let no_query = FingerprintConfig { include_query: false, ..Policy::default().fingerprint };
        let (q1, q2) = (head("POST", "/charges?attempt=1", STEP), head("POST", "/charges?attempt=2", STEP));
        assert_eq!(key_with(&q1, &c, &no_query, Some(a)), key_with(&q2, &c, &no_query, Some(a)));
        assert_ne!(key(&q1, &c, Some(a)), key(&q2, &c, Some(a)), "query included by default");
    }

    /// With the default fingerprint the derived key is the one earlier releases derived (this
    /// value was printed by the code before the change above): a retry across an upgrade finds
    /// its first attempt's key.
    #[test]
    fn the_default_fingerprint_derives_the_key_earlier_releases_derived() {
        let h = head("POST", "/charges?x=1", STEP);
        assert_eq!(
            key(&h, &cfg(true), Some(br#"{"b":1,"a":2}"#)).as_deref(),
            Some("derived-fbeb559e068118de36c2440758f278a2")
        );
    }

    /// Found by the boundary oracle (issue 41, tests/it/boundary_oracle.rs): the key hashed the
    /// target as sent, so a retry that spelled the path or the query another way (`/v1/%70ayments`,
    /// `/v1//payments`, `/v1;x=1/payments`, `?b=2&a=1`, `?%61=1`), one request to Flask, Django,
    /// FastAPI, Express, Fastify, Go and Tomcat alike, derived a second key and executed again.
    #[test]
    fn spellings_every_backend_reads_as_one_target_derive_one_key() {
        let c = cfg(false);
        let k = |target: &str| key(&head("POST", target, STEP), &c, None);
        let canonical = k("/v1/payments?a=1&b=2");
        for spelling in [
            "/v1/%70ayments?a=1&b=2",
            "/v1%2Fpayments?a=1&b=2",
            "//v1/payments?a=1&b=2",
            "/v1//payments?a=1&b=2",
            "/v1/./payments?a=1&b=2",
            "/v1/x/../payments?a=1&b=2",
            "/v1/x/%2E%2E/payments?a=1&b=2",
            "/v1;x=1/payments?a=1&b=2",
            "/v1/payments;x=1?a=1&b=2",
            "/v1/payments/?a=1&b=2",
            "/V1/PAYMENTS?a=1&b=2",
            "/v1/payments?b=2&a=1",
            "/v1/payments?%61=1&b=2",
            "/v1/payments?a=1&b=2&",
            "/v1/payments?a=1&&b=2",
        ] {
            assert_eq!(k(spelling), canonical, "{spelling}");
        }
        assert_eq!(k("/v2/orders/o%C3%A9"), k("/v2/orders/o%c3%a9"));
        // What backends keep apart stays apart: another resource, another value, the NFD form.
        assert_ne!(k("/v1/payments?a=1&b=3"), canonical);
        assert_ne!(k("/v1/refunds?a=1&b=2"), canonical);
        assert_ne!(k("/v2/orders/o%C3%A9"), k("/v2/orders/oe%CC%81"));
        assert_ne!(k("/v2/orders/1"), k("/v2/orders/2"));
    }

    /// Found by the boundary oracle (issue 41): Envoy forwards an HTTP/2 `:method` of `post`,
    /// which Werkzeug and Django run as POST; the key hashed the method as sent, so `post` and
    /// `POST` with one step derived two keys and executed twice.
    #[test]
    fn a_method_in_another_letter_case_derives_the_same_key() {
        let c = cfg(false);
        let k = |m: &str| key(&head(m, "/charges", STEP), &c, None);
        assert_eq!(k("post"), k("POST"));
        assert_eq!(k("Post"), k("POST"));
        assert_ne!(k("PATCH"), k("POST"));
    }

    /// Found by the boundary oracle (issue 41): Express and Fastify read `x-op: k1, k1` on one
    /// line and `x-op: k1` on two lines as one value (`k1, k1`), which derived two keys; a
    /// header the key is derived from, sent on several lines, is refused instead
    /// (`repeated_header`), as a repeated key header is.
    #[test]
    fn a_derive_header_on_several_lines_is_named() {
        let c = cfg(false);
        let two = head(
            "POST",
            "/c",
            &[("authorization", "a"), ("x-agent-task-id", "t1"), ("x-agent-step-id", "s1"), ("x-agent-step-id", "s1")],
        );
        assert_eq!(repeated_header(&two, &c), Some("x-agent-step-id"));
        assert_eq!(repeated_header(&head("POST", "/c", STEP), &c), None);
    }

    #[test]
    fn missing_step_header_or_anonymous_caller_derives_nothing() {
        assert_eq!(
            key(&head("POST", "/c", &[("authorization", "a"), ("x-agent-task-id", "t1")]), &cfg(false), None),
            None
        );
        assert_eq!(
            key(&head("POST", "/c", &[("x-agent-task-id", "t1"), ("x-agent-step-id", "s1")]), &cfg(false), None),
            None
        );
        // An empty scope header identifies nobody (the scope module's rule), shared scope or not.
        let empty = head("POST", "/c", &[("authorization", ""), ("x-agent-task-id", "t1"), ("x-agent-step-id", "s1")]);
        assert_eq!(key(&empty, &cfg(false), None), None);
        assert_eq!(key(&head("POST", "/c", STEP), &cfg(true), None), None, "include_body needs the body");
    }
}
