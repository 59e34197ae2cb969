//! The request fingerprint: what makes two requests with one key "the same request".
//!
//! `SHA-256` over a framed layout of the method, the path (query optional), the configured header
//! values and a digest of the body (raw bytes, or canonical JSON when configured and the body is
//! valid JSON). The layout is pinned in ARCHITECTURE.md and by test vectors: a silent change would
//! turn every retry in flight during an upgrade into a 422.

use sha2::{Digest, Sha256};

use crate::canonical_json;
use crate::config::{FingerprintConfig, JsonMode};
use crate::request::RequestHead;

const FP_TAG: &[u8] = b"idemgate-fp-v1\0";

/// Hashes a tag followed by fields framed as `<decimal length>:<bytes>,` (netstring style), so
/// no field boundary can be shifted to make two different inputs collide.
pub struct Framer(Sha256);

impl Framer {
    pub fn new(tag: &[u8]) -> Framer {
        let mut h = Sha256::new();
        h.update(tag);
        Framer(h)
    }

    pub fn field(&mut self, bytes: &[u8]) {
        self.0.update(bytes.len().to_string().as_bytes());
        self.0.update(b":");
        self.0.update(bytes);
        self.0.update(b",");
    }

    pub fn finish(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

/// How the body entered the fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyForm {
    /// The raw bytes (also the fallback for invalid JSON or duplicate member names).
    Raw,
    /// The canonical JSON form (see `canonical_json`).
    CanonicalJson,
}

impl BodyForm {
    fn tag(self) -> &'static [u8] {
        match self {
            BodyForm::Raw => b"raw",
            BodyForm::CanonicalJson => b"json-c14n",
        }
    }
}

/// A request fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Computes the fingerprint of a request with its whole body.
    pub fn compute(head: &RequestHead, body: &[u8], cfg: &FingerprintConfig) -> (Fingerprint, BodyForm) {
        let canonical = match cfg.json {
            JsonMode::Canonical => canonical_json::canonicalize(body),
            JsonMode::Raw => None,
        };
        let (form, body_digest): (BodyForm, [u8; 32]) = match &canonical {
            Some(c) => (BodyForm::CanonicalJson, Sha256::digest(c).into()),
            None => (BodyForm::Raw, Sha256::digest(body).into()),
        };
        let mut f = Framer::new(FP_TAG);
        f.field(head.method.as_bytes());
        let target = if cfg.include_query { head.path.as_str() } else { head.path_without_query() };
        f.field(target.as_bytes());
        f.field(cfg.headers.len().to_string().as_bytes());
        for name in &cfg.headers {
            let values = head.values(name);
            f.field(name.as_bytes());
            f.field(values.len().to_string().as_bytes());
            for v in values {
                f.field(v);
            }
        }
        f.field(form.tag());
        f.field(crate::hex::encode(&body_digest).as_bytes());
        (Fingerprint(f.finish()), form)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn head(method: &str, path: &str, extra: &[(&str, &str)]) -> RequestHead {
        RequestHead::for_test(method, path, extra)
    }

    fn cfg(headers: &[&str], include_query: bool, json: JsonMode) -> FingerprintConfig {
        FingerprintConfig { headers: headers.iter().map(|s| s.to_string()).collect(), include_query, json }
    }

    fn fp(h: &RequestHead, body: &[u8], c: &FingerprintConfig) -> Fingerprint {
        Fingerprint::compute(h, body, c).0
    }

    #[test]
    fn method_path_body_and_chosen_headers_all_change_the_fingerprint() {
        let c = cfg(&["x-tenant"], true, JsonMode::Raw);
        let base = fp(&head("POST", "/pay", &[("x-tenant", "a")]), b"{}", &c);
        assert_ne!(base, fp(&head("PATCH", "/pay", &[("x-tenant", "a")]), b"{}", &c));
        assert_ne!(base, fp(&head("POST", "/refund", &[("x-tenant", "a")]), b"{}", &c));
        assert_ne!(base, fp(&head("POST", "/pay", &[("x-tenant", "b")]), b"{}", &c));
        assert_ne!(base, fp(&head("POST", "/pay", &[]), b"{}", &c));
        assert_ne!(base, fp(&head("POST", "/pay", &[("x-tenant", "a")]), b"{ }", &c));
        assert_eq!(base, fp(&head("POST", "/pay", &[("x-tenant", "a"), ("x-other", "z")]), b"{}", &c));
    }

    #[test]
    fn query_counts_only_when_configured() {
        let with = cfg(&[], true, JsonMode::Raw);
        let without = cfg(&[], false, JsonMode::Raw);
        let a = head("POST", "/pay?x=1", &[]);
        let b = head("POST", "/pay?x=2", &[]);
        assert_ne!(fp(&a, b"", &with), fp(&b, b"", &with));
        assert_eq!(fp(&a, b"", &without), fp(&b, b"", &without));
    }

    #[test]
    fn canonical_json_ignores_whitespace_and_member_order() {
        let c = cfg(&[], true, JsonMode::Canonical);
        let h = head("POST", "/pay", &[]);
        let (a, form) = Fingerprint::compute(&h, br#"{"amount": 100, "currency": "eur"}"#, &c);
        assert_eq!(form, BodyForm::CanonicalJson);
        assert_eq!(a, fp(&h, b"{\"currency\":\"eur\",\n \"amount\":100}", &c));
        assert_ne!(a, fp(&h, br#"{"amount": 100, "currency": "usd"}"#, &c));
    }

    #[test]
    fn canonical_json_keeps_numbers_as_written() {
        let c = cfg(&[], true, JsonMode::Canonical);
        let h = head("POST", "/pay", &[]);
        assert_ne!(fp(&h, br#"{"a":0.1}"#, &c), fp(&h, br#"{"a":0.10000000000000001}"#, &c));
        assert_ne!(fp(&h, br#"{"a":9007199254740993}"#, &c), fp(&h, br#"{"a":9007199254740992}"#, &c));
    }

    #[test]
    fn invalid_or_duplicate_key_json_falls_back_to_raw_bytes() {
        let c = cfg(&[], true, JsonMode::Canonical);
        let h = head("POST", "/pay", &[]);
        for body in [&br#"{"a":1,"a":2}"#[..], b"{not json", b""] {
            let (got, form) = Fingerprint::compute(&h, body, &c);
            assert_eq!(form, BodyForm::Raw);
            assert_eq!(got, fp(&h, body, &cfg(&[], true, JsonMode::Raw)));
        }
    }

    #[test]
    fn raw_and_canonical_forms_of_identical_bytes_never_collide() {
        let h = head("POST", "/pay", &[]);
        let body = br#"{"a":1}"#; // already canonical
        let raw = fp(&h, body, &cfg(&[], true, JsonMode::Raw));
        let canon = fp(&h, body, &cfg(&[], true, JsonMode::Canonical));
        assert_ne!(raw, canon);
    }

    #[test]
    fn repeated_header_lines_all_count() {
        let c = cfg(&["x-a"], true, JsonMode::Raw);
        let one = head("POST", "/p", &[("x-a", "1")]);
        let two = head("POST", "/p", &[("x-a", "1"), ("x-a", "2")]);
        assert_ne!(fp(&one, b"", &c), fp(&two, b"", &c));
    }

    /// Pinned vectors, computed independently of this code from the layout in ARCHITECTURE.md:
    /// `printf '{"b": 1, "a": [1,2]}' | sha256sum` gives the raw body digest, `printf '{"a":[1,2],"b":1}' | sha256sum`
    /// the canonical one, then for example
    /// `printf 'idemgate-fp-v1\0004:POST,11:/pay?cur=eu,1:1,8:x-tenant,1:1,4:acme,3:raw,64:<raw digest>,' | sha256sum`.
    #[test]
    fn fingerprint_layout_is_pinned_by_independent_vectors() {
        let h = head("POST", "/pay?cur=eu", &[("x-tenant", "acme")]);
        let body = br#"{"b": 1, "a": [1,2]}"#;
        let raw = fp(&h, body, &cfg(&["x-tenant"], true, JsonMode::Raw));
        assert_eq!(crate::hex::encode(&raw.0), VECTOR_RAW);
        let canon = fp(&h, body, &cfg(&["x-tenant"], true, JsonMode::Canonical));
        assert_eq!(crate::hex::encode(&canon.0), VECTOR_CANONICAL);
        let noquery = fp(&h, body, &cfg(&[], false, JsonMode::Raw));
        assert_eq!(crate::hex::encode(&noquery.0), VECTOR_NO_QUERY);
    }

    const VECTOR_RAW: &str = "25d47513f9eb2936455144a471286d29297677199adfe471e0b6d78eafbff311";
    const VECTOR_CANONICAL: &str = "b66c49dc191fc3e9202c2ca64be0d4926210329f915b7fbcc1f8f517462ab040";
    const VECTOR_NO_QUERY: &str = "9e596cc17d0752f1fe4ac75c0ac90ac408fce794f6b303f62929eb8e4deb1d56";
}
