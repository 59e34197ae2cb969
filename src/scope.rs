//! The caller scope and the storage key.
//!
//! A record is addressed by `SHA-256(namespace, scope hash, key)`: never by the raw key or a raw
//! credential. Two callers that send the same key get different records, so a guessed key cannot
//! replay (or block) another caller's response. Layouts are pinned in docs/internals.md.
//!
//! A caller that sends none of the configured scope headers (or only empty ones) is anonymous: all
//! such callers would hash to one scope, so a request of theirs that uses a key is refused
//! (`scope-missing`) unless the operator opts into that shared scope (`scope.anonymous: "shared"`).

use crate::config::{Anonymous, ScopeConfig};
use crate::fingerprint::Framer;
use crate::hex;
use crate::key::IdempotencyKey;
use crate::problem::ProblemKind;
use crate::request::RequestHead;

/// Domain-separation prefixes: a scope hash can never equal a storage key or a fingerprint.
const SCOPE_TAG: &[u8] = b"idemgate-scope-v1\0";
const KEY_TAG: &[u8] = b"idemgate-key-v1\0";

/// The hashed identity of a caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallerScope {
    pub hash: [u8; 32],
    /// True when at least one configured scope header was present with a non-empty value. Without
    /// one, all such callers hash to the anonymous scope of their authority.
    pub identified: bool,
}

impl CallerScope {
    /// Hashes the configured scope headers (every value, in configured order) and, unless turned
    /// off, the `:authority`.
    pub fn of(head: &RequestHead, cfg: &ScopeConfig) -> CallerScope {
        let mut f = Framer::new(SCOPE_TAG);
        let mut identified = false;
        f.count(cfg.headers.len());
        for name in &cfg.headers {
            identified |= head.values_iter(name).any(|v| !v.trim_ascii().is_empty());
            f.field(name.as_bytes());
            f.count(head.values_iter(name).count());
            for v in head.values_iter(name) {
                f.field(v);
            }
        }
        if cfg.include_authority {
            f.field(b":authority");
            match already_normal(&head.authority) {
                Some(a) => f.field(a.as_bytes()),
                None => f.field(normal_authority(&head.authority).as_bytes()),
            }
        }
        CallerScope { hash: f.finish(), identified }
    }

    /// Whether this caller may use a key: an identified caller always; an anonymous one only
    /// when every caller deliberately shares one scope (`scope.global`) or the operator opted
    /// into a shared anonymous scope. Anything else (a policy with no scope headers that is not
    /// global, refused at configure time) fails closed.
    pub fn admits(&self, cfg: &ScopeConfig) -> Result<(), ProblemKind> {
        let shared = cfg.global || (!cfg.headers.is_empty() && cfg.anonymous == Anonymous::Shared);
        if self.identified || shared {
            Ok(())
        } else {
            Err(ProblemKind::ScopeMissing { headers: cfg.headers.clone() })
        }
    }

    /// First 12 hex digits, for log lines.
    pub fn short(&self) -> String {
        hex::encode(self.hash.get(..6).unwrap_or_default())
    }
}

/// The authority as URI comparison reads it (RFC 3986 6.2.2-6.2.3, RFC 9110 4.2.3), so that one
/// origin spelled several ways is one scope: lowercase; the port without leading zeros, and
/// none when it is empty, 80 or 443 (the default ports of http and https); the host without the
/// trailing dot of a fully qualified name (`api.example.` is `api.example`). An IPv6 literal
/// keeps its brackets; an authority that is not `host[:port]` is only lowercased.
///
/// Both default ports are dropped whatever the request's `:scheme`, which the client controls
/// (an HTTP/2 client writes it; Envoy takes `x-forwarded-proto` from HTTP/1 clients unless
/// `use_remote_address` is set): a scope that depended on it would let one caller split its own
/// key in two by sending `x-forwarded-proto: https` with `Host: api:443` (found by an adversarial
/// review: 2 executions). The scope still holds the caller's credentials, so no two callers merge.
pub fn normal_authority(authority: &str) -> String {
    let lower = authority.trim_ascii().to_ascii_lowercase();
    let (host, port) = match lower.strip_prefix('[') {
        Some(_) => match lower.find(']') {
            Some(end) => {
                let (host, rest) = lower.split_at(end + 1);
                match rest.strip_prefix(':') {
                    Some(port) => (host, Some(port)),
                    None if rest.is_empty() => (host, None),
                    None => return lower,
                }
            }
            None => return lower,
        },
        None => match lower.split_once(':') {
            Some((_, port)) if port.contains(':') => return lower,
            Some((host, port)) => (host, Some(port)),
            None => (lower.as_str(), None),
        },
    };
    let host = match host.strip_suffix('.') {
        Some(bare) if !bare.is_empty() && !bare.ends_with('.') => bare,
        _ => host,
    };
    let port = port.map(|p| match p.trim_start_matches('0') {
        "" if !p.is_empty() => "0",
        digits if p.bytes().all(|b| b.is_ascii_digit()) => digits,
        _ => p,
    });
    match port {
        Some(p) if !p.is_empty() && p != "80" && p != "443" => format!("{host}:{p}"),
        _ => host.to_string(),
    }
}

/// `authority` itself when `normal_authority` would return it unchanged, as for the common
/// `host` or `host.domain` sent in lowercase (no port, no brackets, no trailing dot, no
/// surrounding whitespace): the scope then hashes it without building a copy. `None`: ask
/// `normal_authority`.
fn already_normal(authority: &str) -> Option<&str> {
    let b = authority.as_bytes();
    let plain = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'-' | b'.' | b'_');
    (b.iter().all(plain) && !authority.ends_with('.')).then_some(authority)
}

/// Where a record lives: `SHA-256(tag, namespace, scope hash, key)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StorageKey(pub [u8; 32]);

impl StorageKey {
    pub fn derive(namespace: &str, scope: &CallerScope, key: &IdempotencyKey) -> StorageKey {
        let mut f = Framer::new(KEY_TAG);
        f.field(namespace.as_bytes());
        f.field(&scope.hash);
        f.field(key.as_str().as_bytes());
        StorageKey(f.finish())
    }

    /// Full lowercase hex (64 characters).
    pub fn hex(&self) -> String {
        hex::encode(&self.0)
    }

    /// First 12 hex digits: the key's hash as it appears in log lines.
    pub fn short(&self) -> String {
        hex::encode(self.0.get(..6).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::parse_key;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn head(auth: Option<&str>, authority: &str) -> RequestHead {
        let mut pairs = vec![(":authority".to_string(), authority.as_bytes().to_vec())];
        if let Some(a) = auth {
            pairs.push(("authorization".to_string(), a.as_bytes().to_vec()));
        }
        RequestHead::from_pairs(pairs)
    }

    fn cfg(headers: &[&str], include_authority: bool) -> ScopeConfig {
        ScopeConfig {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            global: headers.is_empty(),
            include_authority,
            anonymous: Anonymous::Reject,
        }
    }

    fn key(k: &str) -> IdempotencyKey {
        parse_key(k.as_bytes(), 255, crate::key::KeySyntax::Strict).unwrap()
    }

    #[test]
    fn two_callers_with_the_same_key_get_different_storage_keys() {
        let c = cfg(&["authorization"], true);
        let a = CallerScope::of(&head(Some("Bearer alice"), "api"), &c);
        let b = CallerScope::of(&head(Some("Bearer bob"), "api"), &c);
        assert_ne!(a, b);
        assert_ne!(StorageKey::derive("ns", &a, &key("k1")), StorageKey::derive("ns", &b, &key("k1")));
        assert!(a.identified && b.identified);
    }

    /// Found by the boundary oracle (issue 41): over HTTP/2 Envoy forwards `authorization: Bearer
    /// alice  ` with its trailing spaces, every HTTP/1.1 backend's parser drops them (RFC 9110
    /// 5.5), and idemgate hashed them: one caller in two scopes, one key executed once in each.
    #[test]
    fn whitespace_around_a_scope_value_is_not_part_of_the_scope() {
        let c = cfg(&["authorization"], true);
        let plain = CallerScope::of(&head(Some("Bearer alice"), "api"), &c);
        for spaced in ["Bearer alice  ", " Bearer alice", "\tBearer alice\t"] {
            assert_eq!(CallerScope::of(&head(Some(spaced), "api"), &c), plain, "{spaced:?}");
        }
        assert_ne!(CallerScope::of(&head(Some("Bearer  alice"), "api"), &c), plain, "inner spaces are the value's");
    }

    #[test]
    fn authority_is_part_of_the_scope_unless_turned_off() {
        let on = cfg(&["authorization"], true);
        let off = cfg(&["authorization"], false);
        let x = head(Some("t"), "a.example");
        let y = head(Some("t"), "b.example");
        assert_ne!(CallerScope::of(&x, &on), CallerScope::of(&y, &on));
        assert_eq!(CallerScope::of(&x, &off), CallerScope::of(&y, &off));
        assert_eq!(CallerScope::of(&head(Some("t"), "A.example"), &on), CallerScope::of(&x, &on));
    }

    fn with_scheme(authority: &str, scheme: &str) -> RequestHead {
        RequestHead::from_pairs(vec![
            (":scheme".into(), scheme.as_bytes().to_vec()),
            (":authority".into(), authority.as_bytes().to_vec()),
            ("authorization".into(), b"t".to_vec()),
        ])
    }

    #[test]
    fn an_authority_is_compared_as_uri_comparison_reads_it() {
        let n = |a: &str, _scheme: &str| normal_authority(a);
        // Case, the scheme's default port, an empty port, leading zeros, a trailing dot.
        assert_eq!(n("API.Example.Test", "http"), "api.example.test");
        assert_eq!(n("api.example.test:80", "http"), "api.example.test");
        assert_eq!(n("api.example.test:443", "https"), "api.example.test");
        assert_eq!(n("api.example.test:443", "HTTPS"), "api.example.test");
        assert_eq!(n("api.example.test:", "http"), "api.example.test");
        assert_eq!(n("api.example.test:0080", "http"), "api.example.test");
        assert_eq!(n("api.example.test.", "http"), "api.example.test");
        assert_eq!(n("API.example.test.:80", "http"), "api.example.test");
        assert_eq!(n("api.example.test.:8080", "https"), "api.example.test:8080");
        assert_eq!(n("api.example.test:08080", "https"), "api.example.test:8080");
        assert_eq!(n(" api ", ""), "api");
        // Both default ports go whatever the scheme (the client's to choose); another port stays.
        assert_eq!(n("api.example.test:443", "http"), "api.example.test");
        assert_eq!(n("api.example.test:80", "https"), "api.example.test");
        assert_eq!(n("api.example.test:0", "http"), "api.example.test:0");
        assert_eq!(n("api:80", ""), "api");
        assert_eq!(n("api:443", "ftp"), "api");
        // IPv6 literals keep their brackets; their port is read after them.
        assert_eq!(n("[::1]:80", "http"), "[::1]");
        assert_eq!(n("[FE80::1]:8080", "http"), "[fe80::1]:8080");
        assert_eq!(n("[::1]", "http"), "[::1]");
        // Anything that is not host[:port] is only lowercased.
        assert_eq!(n("::1", "http"), "::1");
        assert_eq!(n("[::1]x", "http"), "[::1]x");
        assert_eq!(n("[::1", "http"), "[::1");
        assert_eq!(n("a:B", "http"), "a:b");
        assert_eq!(n(".", "http"), ".");
        assert_eq!(n("a..", "http"), "a..");
        assert_eq!(n("", "http"), "");
    }

    #[test]
    fn one_origin_spelled_several_ways_is_one_scope() {
        let c = cfg(&["authorization"], true);
        let plain = CallerScope::of(&with_scheme("api.example.test", "http"), &c);
        for a in [
            "api.example.test:80",
            "api.example.test.",
            "API.Example.Test.:80",
            "api.example.test:",
            "api.example.test:0080",
        ] {
            assert_eq!(CallerScope::of(&with_scheme(a, "http"), &c), plain, "{a}");
        }
        for a in ["api.example.test:8080", "api.example.test.:81"] {
            assert_ne!(CallerScope::of(&with_scheme(a, "http"), &c), plain, "{a}");
        }
        for (a, scheme) in
            [("api.example.test:443", "https"), ("api.example.test:443", "http"), ("api.example.test:80", "https")]
        {
            assert_eq!(
                CallerScope::of(&with_scheme(a, scheme), &c),
                plain,
                "{a} over {scheme}: the client's scheme never splits a scope"
            );
        }
        // The pinned layout holds for an authority already in normal form, with or without a scheme.
        let pinned = CallerScope::of(&head(Some("Bearer alice"), "api"), &c);
        let mut h = head(Some("Bearer alice"), "API.:80");
        h.scheme = "http".into();
        assert_eq!(CallerScope::of(&h, &c), pinned);
        assert_eq!(hex::encode(&pinned.hash), SCOPE_VECTOR);
    }

    #[test]
    fn namespace_separates_storage_keys() {
        let s = CallerScope::of(&head(Some("t"), "api"), &cfg(&["authorization"], true));
        assert_ne!(StorageKey::derive("a", &s, &key("k")), StorageKey::derive("b", &s, &key("k")));
    }

    #[test]
    fn caller_without_any_scope_header_is_not_identified() {
        let s = CallerScope::of(&head(None, "api"), &cfg(&["authorization"], true));
        assert!(!s.identified);
    }

    #[test]
    fn an_empty_scope_header_identifies_nobody() {
        let c = cfg(&["authorization"], true);
        for empty in ["", " ", "\t"] {
            assert!(!CallerScope::of(&head(Some(empty), "api"), &c).identified, "{empty:?}");
        }
        // One non-empty value among several configured headers is enough.
        let two = cfg(&["authorization", "x-user"], true);
        let h = RequestHead::from_pairs(vec![("authorization".into(), vec![]), ("x-user".into(), b"u1".to_vec())]);
        assert!(CallerScope::of(&h, &two).identified);
    }

    #[test]
    fn anonymous_callers_are_refused_unless_a_shared_scope_is_chosen() {
        let reject = cfg(&["authorization"], true);
        let anonymous = CallerScope::of(&head(None, "api"), &reject);
        assert_eq!(anonymous.admits(&reject), Err(ProblemKind::ScopeMissing { headers: vec!["authorization".into()] }));
        let empty = CallerScope::of(&head(Some(""), "api"), &reject);
        assert!(empty.admits(&reject).is_err());
        assert_eq!(CallerScope::of(&head(Some("Bearer a"), "api"), &reject).admits(&reject), Ok(()));
        let shared = ScopeConfig { anonymous: Anonymous::Shared, ..reject.clone() };
        assert_eq!(CallerScope::of(&head(None, "api"), &shared).admits(&shared), Ok(()));
        // Anonymous callers of one authority then share one scope; identified ones keep their own.
        assert_eq!(CallerScope::of(&head(None, "api"), &shared), CallerScope::of(&head(None, "api"), &shared));
        assert_ne!(CallerScope::of(&head(None, "api"), &shared), CallerScope::of(&head(Some("t"), "api"), &shared));
        // scope.global: every caller deliberately shares one scope.
        let global = cfg(&[], true);
        assert_eq!(CallerScope::of(&head(None, "api"), &global).admits(&global), Ok(()));
        // No scope headers and not global (refused at configure time): fails closed.
        let broken = ScopeConfig { global: false, anonymous: Anonymous::Shared, ..global };
        assert!(CallerScope::of(&head(Some("t"), "api"), &broken).admits(&broken).is_err());
    }

    #[test]
    fn header_boundaries_cannot_be_shifted_to_collide() {
        let c = cfg(&["x-a", "x-b"], false);
        let h1 = RequestHead::from_pairs(vec![("x-a".into(), b"ab".to_vec()), ("x-b".into(), b"c".to_vec())]);
        let h2 = RequestHead::from_pairs(vec![("x-a".into(), b"a".to_vec()), ("x-b".into(), b"bc".to_vec())]);
        assert_ne!(CallerScope::of(&h1, &c), CallerScope::of(&h2, &c));
    }

    #[test]
    fn an_authority_taken_as_it_is_is_one_normal_authority_returns_unchanged() {
        // Every string over a small alphabet that covers each rule (case, ports, brackets, dots,
        // whitespace), up to 4 characters: where the shortcut takes an authority as it is,
        // `normal_authority` returns it unchanged; and it takes the plain lowercase ones.
        let alphabet = ['a', 'B', '0', '8', '.', ':', '[', ']', ' ', '-', '_', '4'];
        let mut taken = 0;
        let mut strings = vec![String::new()];
        for _ in 0..4 {
            let longer: Vec<String> =
                strings.iter().flat_map(|s| alphabet.iter().map(move |c| format!("{s}{c}"))).collect();
            strings.extend(longer);
        }
        for s in &strings {
            if let Some(a) = already_normal(s) {
                assert_eq!(a, normal_authority(s), "{s:?}");
                taken += 1;
            }
        }
        assert!(taken > 1000, "{taken}");
        assert_eq!(already_normal("api.example.com"), Some("api.example.com"));
        assert_eq!(already_normal("bench"), Some("bench"));
        assert_eq!(already_normal("API.example.com"), None);
        assert_eq!(already_normal("api:8080"), None);
    }

    #[test]
    fn short_forms_are_prefixes_of_the_full_hash() {
        let s = CallerScope::of(&head(Some("Bearer secret-token"), "api"), &cfg(&["authorization"], true));
        let k = StorageKey::derive("idemgate", &s, &key("order-12345"));
        assert_eq!(k.hex().len(), 64);
        assert_eq!(k.short(), k.hex()[..12]);
        assert_eq!(s.short(), hex::encode(&s.hash)[..12]);
    }

    /// Pinned vector, computed independently of this code with:
    /// `printf 'idemgate-scope-v1\0001:1,13:authorization,1:1,12:Bearer alice,10::authority,3:api,' | sha256sum`
    /// and then
    /// `(printf 'idemgate-key-v1\0008:idemgate,32:'; printf '<scope hash>' | xxd -r -p; printf ',2:k1,') | sha256sum`.
    #[test]
    fn scope_and_storage_key_layouts_are_pinned() {
        let s = CallerScope::of(&head(Some("Bearer alice"), "api"), &cfg(&["authorization"], true));
        assert_eq!(hex::encode(&s.hash), SCOPE_VECTOR);
        assert_eq!(StorageKey::derive("idemgate", &s, &key("k1")).hex(), KEY_VECTOR);
    }

    const SCOPE_VECTOR: &str = "206e3bfe09a939a9ec8d124ddc11747076e91bc1538bbd31c47195f8f3283263";
    const KEY_VECTOR: &str = "25ac414820301995f186e203d357b20a9fd56c30da2524881ff24a53d1733af1";
}
