//! The request fingerprint: what makes two requests with one key "the same request".
//!
//! `SHA-256` over a framed layout of the method, the path (query optional), the values of the
//! operation headers (`content-type` and the method-override headers, unless turned off) and of
//! the configured headers, the request trailers (unless turned off) and a digest of the body (raw
//! bytes, or canonical JSON when configured and the body is valid JSON). The layout is pinned in
//! docs/internals.md and by test vectors: a change of layout bumps the tag's version.

use sha2::{Digest, Sha256};

use crate::canonical_json;
use crate::config::{FingerprintConfig, FormMode, JsonMode};
use crate::form::Reading;
use crate::request::RequestHead;

const FP_TAG: &[u8] = b"idemgate-fp-v2\0";

/// Headers that change what the same method, path and bytes mean, hashed by default
/// (`fingerprint.operation_headers`): the body's media type, and the method overrides that
/// frameworks honour (a POST with `x-http-method-override: DELETE` is a delete).
pub const OPERATION_HEADERS: &[&str] =
    &["content-type", "x-http-method-override", "x-http-method", "x-method-override"];

/// The header names a fingerprint hashes, in order: the operation headers (when on), then the
/// configured ones not already listed.
pub fn header_names(cfg: &FingerprintConfig) -> Vec<&str> {
    let builtin: &[&str] = if cfg.operation_headers { OPERATION_HEADERS } else { &[] };
    let mut names = builtin.to_vec();
    names.extend(cfg.headers.iter().map(String::as_str).filter(|h| !builtin.contains(h)));
    names
}

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
        let mut digits = [0u8; 20];
        self.0.update(decimal(bytes.len(), &mut digits));
        self.0.update(b":");
        self.0.update(bytes);
        self.0.update(b",");
    }

    /// A field holding the decimal number `n` (a count of the fields that follow).
    pub fn count(&mut self, n: usize) {
        let mut digits = [0u8; 20];
        self.field(decimal(n, &mut digits));
    }

    pub fn finish(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

/// `n` in decimal, written into `buf` (no allocation: every hash frames several numbers).
fn decimal(mut n: usize, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        if let Some(d) = buf.get_mut(at) {
            *d = b'0' + (n % 10) as u8;
        }
        n /= 10;
        if n == 0 || at == 0 {
            break;
        }
    }
    buf.get(at..).unwrap_or(&[])
}

/// How the body entered the fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyForm {
    /// The raw bytes (also the fallback for invalid JSON or duplicate member names).
    Raw,
    /// The canonical JSON form (see `canonical_json`).
    CanonicalJson,
    /// A urlencoded form as every form parser of the panel reads it (`form::semantic_form` with
    /// `Reading::Every`; `fingerprint.forms: "semantic"`).
    Form,
    /// A multipart form as every multipart parser of the panel reads it (`multipart::semantic_form`
    /// with `Reading::Every`): the `content-type` is then hashed without its boundary.
    Multipart,
}

impl BodyForm {
    fn tag(self) -> &'static [u8] {
        match self {
            BodyForm::Raw => b"raw",
            BodyForm::CanonicalJson => b"json-c14n",
            BodyForm::Form => b"form-every",
            BodyForm::Multipart => b"multipart-every",
        }
    }
}

/// A request fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Computes the fingerprint of a request with its whole body.
    pub fn compute(head: &RequestHead, body: &[u8], cfg: &FingerprintConfig) -> (Fingerprint, BodyForm) {
        Fingerprint::of_digest(head, body_digest(head, body, cfg), cfg)
    }

    /// `compute`, with the body's `body_digest` already taken (a derived key takes it too).
    pub fn of_digest(
        head: &RequestHead,
        (form, body_digest): (BodyForm, [u8; 32]),
        cfg: &FingerprintConfig,
    ) -> (Fingerprint, BodyForm) {
        let mut f = Framer::new(FP_TAG);
        f.field(head.method.as_bytes());
        f.field(target(head, cfg).as_bytes());
        // `header_names(cfg)`, walked without collecting it (no allocation per request).
        let builtin: &[&str] = if cfg.operation_headers { OPERATION_HEADERS } else { &[] };
        let configured = || cfg.headers.iter().map(String::as_str).filter(|h| !builtin.contains(h));
        f.count(builtin.len() + configured().count());
        for name in builtin.iter().copied().chain(configured()) {
            f.field(name.as_bytes());
            f.count(head.values_iter(name).count());
            for v in head.values_iter(name) {
                // A multipart body read as its form: its boundary is not what was asked.
                match (form, name) {
                    (BodyForm::Multipart, "content-type") => {
                        f.field(&crate::multipart::without_boundary(v).unwrap_or_default())
                    }
                    _ => f.field(v),
                }
            }
        }
        // Trailers sorted by name (stable: repeated names keep their order), so only what they
        // say counts, not how a client library orders them.
        let mut trailers: Vec<(String, &[u8])> = if cfg.trailers {
            head.trailers.iter().map(|(n, v)| (n.to_ascii_lowercase(), v.as_slice())).collect()
        } else {
            vec![]
        };
        trailers.sort_by(|a, b| a.0.cmp(&b.0));
        f.count(trailers.len());
        for (name, value) in &trailers {
            f.field(name.as_bytes());
            f.field(value);
        }
        f.field(form.tag());
        let mut hex = [0u8; 64];
        for (slot, d) in hex.iter_mut().zip(crate::hex::digits(&body_digest)) {
            *slot = d;
        }
        f.field(&hex);
        (Fingerprint(f.finish()), form)
    }
}

/// The request target as `cfg` counts it: the path, with its query only if `include_query`.
/// (Derived keys use the same rule: `derive::derive`.)
pub fn target<'h>(head: &'h RequestHead, cfg: &FingerprintConfig) -> &'h str {
    if cfg.include_query {
        head.path.as_str()
    } else {
        head.path_without_query()
    }
}

/// The body's digest as `cfg` counts it: of its form as every form parser of the panel reads it
/// with `forms: "semantic"` (when it is a form they all read alike: `form_of`), of its canonical
/// JSON form with `json: "canonical"` (when it is JSON), else of its bytes. (A key derived from
/// the body uses `derive_body_digest`.)
pub fn body_digest(head: &RequestHead, body: &[u8], cfg: &FingerprintConfig) -> (BodyForm, [u8; 32]) {
    if cfg.forms == FormMode::Semantic {
        if let Some((multipart, form)) = form_of(head, body, Reading::Every) {
            let kind = if multipart { BodyForm::Multipart } else { BodyForm::Form };
            return (kind, Sha256::digest(form).into());
        }
    }
    let canonical = match cfg.json {
        JsonMode::Canonical => canonical_json::canonicalize(body),
        JsonMode::Raw => None,
    };
    match &canonical {
        Some(c) => (BodyForm::CanonicalJson, Sha256::digest(c).into()),
        None => (BodyForm::Raw, Sha256::digest(body).into()),
    }
}

/// The body's form read as `reading` says when the request's one `content-type` is a urlencoded
/// form (`form::semantic_form`) or `multipart/form-data` with a usable boundary
/// (`multipart::semantic_form`; `true` then) and the reader takes it. The one rule for a derived
/// key (`Reading::Most`) and a fingerprint (`Reading::Every`).
fn form_of(head: &RequestHead, body: &[u8], reading: Reading) -> Option<(bool, Vec<u8>)> {
    let mut types = head.values_iter("content-type");
    let (Some(t), None) = (types.next(), types.next()) else {
        return None;
    };
    if crate::form::is_form(t) {
        return crate::form::semantic_form(body, reading).map(|f| (false, f));
    }
    let b = crate::multipart::boundary(t)?;
    crate::multipart::semantic_form(body, b, reading).map(|f| (true, f))
}

/// The digest of the body a derived key is derived from (`derive_key.include_body`), whatever the
/// fingerprint's `json` and `forms` say: of its meaning to the form parsers web frameworks use
/// (`form::semantic_form`) when the request's one `content-type` is a urlencoded form, or to their
/// multipart parsers (`multipart::semantic_form`) when it is `multipart/form-data` and the body is
/// one that reader takes, each read as most of them read it (`Reading::Most`), else of its meaning
/// to their JSON parsers (`canonical_json::semantic_form`) when it is JSON, else of its bytes. Two
/// bodies a backend parses alike derive one key; the fingerprint, kept to the spelling (or with
/// `forms: "semantic"` to what every parser reads alike), answers a retry read otherwise 422
/// rather than executing it again (the boundary oracle, issue 41). JSON that names a member twice
/// in one object (`NoForm::RepeatedName`), or a string that is not Unicode (`NoForm::NotUnicode`),
/// has no one meaning (the only errors): the request is refused (`body-ambiguous`).
pub fn derive_body_digest(head: &RequestHead, body: &[u8]) -> Result<[u8; 32], canonical_json::NoForm> {
    if let Some((_, form)) = form_of(head, body, Reading::Most) {
        // One tag for both: a multipart form without files is the urlencoded form of its fields.
        let mut h = Sha256::new();
        h.update(b"form\0");
        h.update(form);
        return Ok(h.finalize().into());
    }
    match canonical_json::semantic_form(body) {
        Ok(form) => {
            let mut h = Sha256::new();
            h.update(b"json\0");
            h.update(&form);
            Ok(h.finalize().into())
        }
        Err(canonical_json::NoForm::NotJson) => Ok(Sha256::digest(body).into()),
        Err(ambiguous) => Err(ambiguous),
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

    #[test]
    fn field_lengths_are_framed_in_decimal_as_written_by_to_string() {
        let mut buf = [0u8; 20];
        for n in (0..2000).chain([9, 10, 99, 100, 65_535, u32::MAX as usize, usize::MAX]) {
            assert_eq!(decimal(n, &mut buf), n.to_string().as_bytes(), "{n}");
        }
    }

    /// The defaults (operation headers and trailers on) with these fields.
    fn cfg(headers: &[&str], include_query: bool, json: JsonMode) -> FingerprintConfig {
        FingerprintConfig {
            headers: headers.iter().map(|s| s.to_string()).collect(),
            include_query,
            json,
            operation_headers: true,
            trailers: true,
            forms: FormMode::Raw,
        }
    }

    fn with_trailers(mut h: RequestHead, trailers: &[(&str, &str)]) -> RequestHead {
        h.trailers = trailers.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect();
        h
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
    fn content_type_and_method_overrides_change_the_fingerprint_by_default() {
        let c = cfg(&[], true, JsonMode::Raw);
        let body = b"amount=100";
        let form = fp(&head("POST", "/pay", &[("content-type", "application/x-www-form-urlencoded")]), body, &c);
        assert_ne!(form, fp(&head("POST", "/pay", &[("content-type", "text/plain")]), body, &c));
        assert_ne!(form, fp(&head("POST", "/pay", &[]), body, &c));
        let plain = fp(&head("POST", "/pay", &[]), body, &c);
        for name in OPERATION_HEADERS.iter().skip(1) {
            assert_ne!(plain, fp(&head("POST", "/pay", &[(name, "DELETE")]), body, &c), "{name}");
        }
        // Turned off, they are ignored like any other header.
        let off = FingerprintConfig { operation_headers: false, ..c };
        assert_eq!(
            fp(
                &head("POST", "/pay", &[("content-type", "text/plain"), ("x-http-method-override", "DELETE")]),
                body,
                &off
            ),
            fp(&head("POST", "/pay", &[]), body, &off)
        );
    }

    #[test]
    fn configured_headers_follow_the_operation_headers_once_each() {
        let c = cfg(&["x-tenant", "content-type"], true, JsonMode::Raw);
        let names = header_names(&c);
        assert_eq!(
            names,
            vec!["content-type", "x-http-method-override", "x-http-method", "x-method-override", "x-tenant"]
        );
        let off = FingerprintConfig { operation_headers: false, ..c };
        assert_eq!(header_names(&off), vec!["x-tenant", "content-type"]);
    }

    #[test]
    fn request_trailers_count_by_default_in_any_order() {
        let c = cfg(&[], true, JsonMode::Raw);
        let h = || head("POST", "/pay", &[]);
        let none = fp(&h(), b"{}", &c);
        let abc = fp(&with_trailers(h(), &[("x-checksum", "abc"), ("x-sig", "1")]), b"{}", &c);
        assert_ne!(none, abc);
        assert_ne!(abc, fp(&with_trailers(h(), &[("x-checksum", "def"), ("x-sig", "1")]), b"{}", &c));
        assert_eq!(abc, fp(&with_trailers(h(), &[("x-sig", "1"), ("x-checksum", "abc")]), b"{}", &c));
        // Repeated trailer names keep their order.
        assert_ne!(
            fp(&with_trailers(h(), &[("x-a", "1"), ("x-a", "2")]), b"{}", &c),
            fp(&with_trailers(h(), &[("x-a", "2"), ("x-a", "1")]), b"{}", &c)
        );
        // A trailer is not a header of the same name.
        assert_ne!(
            fp(&with_trailers(h(), &[("content-type", "text/plain")]), b"{}", &c),
            fp(&head("POST", "/pay", &[("content-type", "text/plain")]), b"{}", &c)
        );
        let off = FingerprintConfig { trailers: false, ..c };
        assert_eq!(fp(&h(), b"{}", &off), fp(&with_trailers(h(), &[("x-checksum", "abc")]), b"{}", &off));
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

    fn semantic() -> FingerprintConfig {
        FingerprintConfig { forms: FormMode::Semantic, ..cfg(&[], true, JsonMode::Raw) }
    }

    fn multipart(boundary: &str, parts: &[(&str, &str)]) -> (RequestHead, Vec<u8>) {
        let mut body: String = parts
            .iter()
            .map(|(name, value)| {
                format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n")
            })
            .collect();
        body.push_str(&format!("--{boundary}--\r\n"));
        let t = format!("multipart/form-data; boundary={boundary}");
        (head("POST", "/pay", &[("content-type", &t)]), body.into_bytes())
    }

    /// Issue 41: a client rebuilding one form chooses a new boundary; with `forms: "semantic"` the
    /// retry is the same request, and only what every parser reads alike is (a replay answers it).
    #[test]
    fn semantic_forms_count_a_form_without_its_boundary_and_nothing_broader() {
        let c = semantic();
        let (h1, b1) = multipart("b1", &[("amount", "1"), ("currency", "eur")]);
        let (h2, b2) = multipart("----other42", &[("amount", "1"), ("currency", "eur")]);
        let (one, form) = Fingerprint::compute(&h1, &b1, &c);
        assert_eq!(form, BodyForm::Multipart);
        assert_eq!(one, fp(&h2, &b2, &c));
        // With the default (`forms: "raw"`) the boundary counts, as before.
        let raw = cfg(&[], true, JsonMode::Raw);
        assert_ne!(fp(&h1, &b1, &raw), fp(&h2, &b2, &raw));
        // Another value, another order, a content type spelled otherwise: another request.
        let (h, b) = multipart("b1", &[("amount", "2"), ("currency", "eur")]);
        assert_ne!(one, fp(&h, &b, &c));
        let (h, b) = multipart("b1", &[("currency", "eur"), ("amount", "1")]);
        assert_ne!(one, fp(&h, &b, &c));
        for t in [
            "Multipart/Form-Data; boundary=b1",
            "multipart/form-data; boundary=\"b1\"",
            "multipart/form-data; boundary=b1; charset=utf-8",
        ] {
            assert_ne!(one, fp(&head("POST", "/pay", &[("content-type", t)]), &b1, &c), "{t}");
        }
        // A form in a body some parser reads apart counts by its bytes; the raw tag keeps it apart.
        let padded = String::from_utf8(b1.clone()).unwrap().replace("--b1\r\n", "--b1 \r\n");
        let (got, form) = Fingerprint::compute(&h1, padded.as_bytes(), &c);
        assert_eq!((got, form), (fp(&h1, padded.as_bytes(), &raw), BodyForm::Raw));
        // Urlencoded: spellings every parser reads alike, never another order.
        let f = |body: &[u8]| {
            Fingerprint::compute(
                &head("POST", "/pay", &[("content-type", "application/x-www-form-urlencoded")]),
                body,
                &c,
            )
        };
        assert_eq!(f(b"a=1&b=x+y").1, BodyForm::Form);
        assert_eq!(f(b"a=1&b=x+y").0, f(b"%61=1&b=x%20y&").0);
        assert_ne!(f(b"a=1&b=x+y").0, f(b"b=x+y&a=1").0);
        assert_ne!(f(b"a=1&a=2").0, f(b"a=2&a=1").0);
        assert_eq!(f(b"a=caf\xc3\xa9").1, BodyForm::Raw);
        // A form's semantic fingerprint never meets a raw one of any body.
        let form_fp = f(b"a=1").0;
        let text = |body: &[u8]| {
            fp(&head("POST", "/pay", &[("content-type", "application/x-www-form-urlencoded")]), body, &raw)
        };
        assert_ne!(form_fp, text(b"a=1"));
        // Two content-type lines: not read as a form.
        let two = head(
            "POST",
            "/pay",
            &[("content-type", "application/x-www-form-urlencoded"), ("content-type", "text/plain")],
        );
        assert_eq!(Fingerprint::compute(&two, b"a=1", &c).1, BodyForm::Raw);
    }

    /// A record written before `forms` existed holds the raw-bytes fingerprint of a form request:
    /// with the default (`forms: "raw"`) this release computes the same bytes, so an identical
    /// retry across the upgrade still replays. Vector from the layout in docs/internals.md:
    /// `printf 'idemgate-fp-v2\0004:POST,4:/pay,1:4,12:content-type,1:1,32:multipart/form-data; boundary=b1,22:x-http-method-override,1:0,13:x-http-method,1:0,17:x-method-override,1:0,1:0,3:raw,64:<sha256 of the body>,' | sha256sum`.
    #[test]
    fn a_form_fingerprint_under_the_default_is_the_raw_one_earlier_releases_stored() {
        let (h, body) = multipart("b1", &[("amount", "1")]);
        let (got, form) = Fingerprint::compute(&h, &body, &cfg(&[], true, JsonMode::Raw));
        assert_eq!(form, BodyForm::Raw);
        assert_eq!(crate::hex::encode(&got.0), "a1bd6baef78ea5134d0ef26f03031f76aace54522c4757162e95daa20ee889e2");
    }

    /// Pinned vectors, computed independently of this code from the layout in docs/internals.md:
    /// `printf '{"b": 1, "a": [1,2]}' | sha256sum` gives the raw body digest, `printf '{"a":[1,2],"b":1}' | sha256sum`
    /// the canonical one, then for example
    /// `printf 'idemgate-fp-v2\0004:POST,11:/pay?cur=eu,1:5,12:content-type,1:1,16:application/json,22:x-http-method-override,1:0,13:x-http-method,1:0,17:x-method-override,1:0,8:x-tenant,1:1,4:acme,1:2,3:x-a,1:1,10:x-checksum,3:abc,3:raw,64:<raw digest>,' | sha256sum`
    /// and, with operation headers, trailers and the query off,
    /// `printf 'idemgate-fp-v2\0004:POST,4:/pay,1:0,1:0,3:raw,64:<raw digest>,' | sha256sum`.
    #[test]
    fn fingerprint_layout_is_pinned_by_independent_vectors() {
        let h = with_trailers(
            head("POST", "/pay?cur=eu", &[("x-tenant", "acme"), ("content-type", "application/json")]),
            &[("x-checksum", "abc"), ("x-a", "1")],
        );
        let body = br#"{"b": 1, "a": [1,2]}"#;
        let raw = fp(&h, body, &cfg(&["x-tenant"], true, JsonMode::Raw));
        assert_eq!(crate::hex::encode(&raw.0), VECTOR_RAW);
        let canon = fp(&h, body, &cfg(&["x-tenant"], true, JsonMode::Canonical));
        assert_eq!(crate::hex::encode(&canon.0), VECTOR_CANONICAL);
        let bare = FingerprintConfig { operation_headers: false, trailers: false, ..cfg(&[], false, JsonMode::Raw) };
        assert_eq!(crate::hex::encode(&fp(&h, body, &bare).0), VECTOR_BARE);
    }

    const VECTOR_RAW: &str = "61228b373243814f6dc5cfa5bd127f5e9df80c641951986574f8a3fb21819220";
    const VECTOR_CANONICAL: &str = "f99da24fac0102e128891b210f93b20df0f4b6623e25b48e1148ce095ccbe7f4";
    const VECTOR_BARE: &str = "503d38093f032fa6f44953ef3f29a8fee176821772f0867ec35ae1886c80b5c7";
}
