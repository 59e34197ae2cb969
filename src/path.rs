//! The normal form of a request path, used to select the policy (`routes[].prefix`) and nothing
//! else: the fingerprint keeps the path as sent.
//!
//! An upstream (or its framework's router) may serve `/v1//payments`, `/v1/./payments` and
//! `/v1/%70ayments` as `/v1/payments`; Envoy forwards them as sent unless its
//! `normalize_path` / `merge_slashes` are on. A prefix compared with the raw `:path` would leave
//! those spellings unprotected, so a key could execute once per spelling. The normal form:
//!
//! 1. the query and the fragment are cut off (at the first `?` or `#`);
//! 2. percent-encoded unreserved characters (RFC 3986 2.3: `A-Z a-z 0-9 - . _ ~`) are decoded;
//!    every other escape stays encoded, its hex digits uppercased (`%2f` -> `%2F`, never `/`:
//!    `/a%2Fb` is one segment to most servers);
//! 3. an empty path is `/`, a path not starting with `/` is read as if it did (except `*`);
//! 4. a backslash is a slash, as WHATWG URL parsers (browsers, Node's `URL`) read it; runs of
//!    `/` are merged into one;
//! 5. dot segments are removed as RFC 3986 5.2.4 does (`/a/./b` -> `/a/b`, `/a/b/../c` ->
//!    `/a/c`, `..` above the root stays at the root).
//!
//! Letter case is kept; a route compares it case-insensitively (ASCII) when it asks to.
//! The work is one pass over the path plus one list of segments: linear in its length, and a
//! path already in normal form is returned as it is, without allocating.

use std::borrow::Cow;

/// The normal form of `path` (a `:path` value, with or without its query).
pub fn normalize(path: &str) -> Cow<'_, str> {
    let path = path.find(['?', '#']).and_then(|i| path.get(..i)).unwrap_or(path);
    if path == "*" {
        return Cow::Borrowed(path);
    }
    if is_normal(path) {
        return Cow::Borrowed(path);
    }
    let decoded = decode_unreserved(path).replace('\\', "/");
    Cow::Owned(remove_dot_segments(&decoded))
}

/// Whether `path` (a normalised request path) starts with `prefix` (a normalised prefix),
/// comparing ASCII letters without regard to case when `case_insensitive`.
pub fn has_prefix(path: &str, prefix: &str, case_insensitive: bool) -> bool {
    if case_insensitive {
        path.as_bytes().get(..prefix.len()).is_some_and(|head| head.eq_ignore_ascii_case(prefix.as_bytes()))
    } else {
        path.starts_with(prefix)
    }
}

/// A cheap check that covers every path a well-behaved client sends: rooted, no escapes, no
/// empty segment, no segment starting with a dot (a superset of the dot segments).
fn is_normal(path: &str) -> bool {
    path.starts_with('/') && !path.contains(['%', '\\']) && !path.contains("//") && !path.contains("/.")
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// The uppercase hex digit of a value below 16.
fn hex_digit(v: u8) -> char {
    char::from(if v < 10 { b'0' + v } else { b'A' + (v - 10) })
}

/// Decodes `%XX` where XX is an unreserved character; other well-formed escapes get uppercase
/// hex digits; a `%` not followed by two hex digits is kept as it is.
fn decode_unreserved(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    // `start..i` is a run copied as it is; both ends sit on ASCII bytes or the ends of `path`,
    // so they are character boundaries.
    let mut start = 0;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let escape = if b == b'%' {
            bytes
                .get(i + 1)
                .copied()
                .and_then(crate::hex::digit)
                .zip(bytes.get(i + 2).copied().and_then(crate::hex::digit))
        } else {
            None
        };
        let Some((hi, lo)) = escape else {
            i += 1;
            continue;
        };
        out.push_str(path.get(start..i).unwrap_or_default());
        let byte = (hi << 4) | lo;
        if is_unreserved(byte) {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(hex_digit(hi));
            out.push(hex_digit(lo));
        }
        i += 3;
        start = i;
    }
    out.push_str(path.get(start..).unwrap_or_default());
    out
}

/// Merges runs of `/` and removes dot segments (RFC 3986 5.2.4) in one pass over the segments:
/// an empty segment is dropped unless it is the last (a trailing `/`), `.` is dropped, `..`
/// drops the segment before it; a path ending in `.` or `..` keeps its trailing `/`.
fn remove_dot_segments(path: &str) -> String {
    let rooted = path.strip_prefix('/').unwrap_or(path);
    let mut out: Vec<&str> = Vec::new();
    let mut trailing_slash = false;
    let mut segments = rooted.split('/').peekable();
    while let Some(segment) = segments.next() {
        let last = segments.peek().is_none();
        match segment {
            "" if !last => {}
            "." => trailing_slash = true,
            ".." => {
                out.pop();
                trailing_slash = true;
            }
            s => {
                out.push(s);
                trailing_slash = false;
            }
        }
    }
    let mut normal = String::with_capacity(path.len() + 1);
    for segment in &out {
        normal.push('/');
        normal.push_str(segment);
    }
    if normal.is_empty() || (trailing_slash && !normal.ends_with('/')) {
        normal.push('/');
    }
    normal
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(p: &str) -> String {
        normalize(p).into_owned()
    }

    #[test]
    fn paths_already_in_normal_form_are_returned_without_allocating() {
        for p in ["/", "/v1/payments", "/v1/payments/", "/a-b_c~d/e.f", "/v1/payments..x", "/v1/pay.ments"] {
            assert!(matches!(normalize(p), Cow::Borrowed(b) if b == p), "{p}");
        }
        assert!(matches!(normalize("/v1/payments?a=/./b"), Cow::Borrowed("/v1/payments")));
    }

    #[test]
    fn slashes_are_merged() {
        assert_eq!(n("/v1//payments"), "/v1/payments");
        assert_eq!(n("//v1/payments"), "/v1/payments");
        assert_eq!(n("///v1///payments///"), "/v1/payments/");
        assert_eq!(n("//"), "/");
    }

    #[test]
    fn dot_segments_are_removed_as_rfc_3986_5_2_4_does() {
        assert_eq!(n("/v1/./payments"), "/v1/payments");
        assert_eq!(n("/v1/payments/../payments"), "/v1/payments");
        assert_eq!(n("/x/../v1/payments"), "/v1/payments");
        // RFC 3986 5.2.4's own examples.
        assert_eq!(n("/a/b/c/./../../g"), "/a/g");
        assert_eq!(n("mid/content=5/../6"), "/mid/6");
        // A trailing dot segment leaves a trailing slash.
        assert_eq!(n("/a/b/."), "/a/b/");
        assert_eq!(n("/a/b/.."), "/a/");
        assert_eq!(n("/a/b/../"), "/a/");
        assert_eq!(n("/a/../"), "/");
        // Above the root stays at the root.
        assert_eq!(n("/.."), "/");
        assert_eq!(n("/../../v1/payments"), "/v1/payments");
        assert_eq!(n("/."), "/");
        // Segments that only start with a dot are ordinary.
        assert_eq!(n("/.well-known/x"), "/.well-known/x");
        assert_eq!(n("/a/.../b"), "/a/.../b");
        assert_eq!(n("/a/..b/c"), "/a/..b/c");
    }

    #[test]
    fn unreserved_characters_are_decoded_and_nothing_else() {
        assert_eq!(n("/v1/%70ayments"), "/v1/payments");
        assert_eq!(n("/v1/%50AYMENTS"), "/v1/PAYMENTS");
        assert_eq!(n("/%7E%2d%5F%2E%30"), "/~-_.0");
        // Encoded dots are dots: decoded before dot segments are removed.
        assert_eq!(n("/v1/%2E/payments"), "/v1/payments");
        assert_eq!(n("/v1/x/%2e%2E/payments"), "/v1/payments");
        // A slash stays encoded: one segment, never a path separator.
        assert_eq!(n("/v1/payments%2Fx"), "/v1/payments%2Fx");
        assert_eq!(n("/v1/payments%2fx"), "/v1/payments%2Fx");
        assert_eq!(n("/v1%2F..%2Fpayments"), "/v1%2F..%2Fpayments");
        // Reserved and non-ASCII bytes stay encoded, hex uppercased.
        assert_eq!(n("/a%3fb%23c%25d%c3%a9"), "/a%3Fb%23c%25d%C3%A9");
        // %25 is '%': decoded once at most, never a second time.
        assert_eq!(n("/%2570ayments"), "/%2570ayments");
        // Malformed escapes are kept as they are.
        assert_eq!(n("/a%"), "/a%");
        assert_eq!(n("/a%7"), "/a%7");
        assert_eq!(n("/a%zz/%g0"), "/a%zz/%g0");
        assert_eq!(n("/%%70"), "/%p");
    }

    #[test]
    fn a_backslash_is_a_slash_but_not_when_encoded() {
        assert_eq!(n("/v1\\payments"), "/v1/payments");
        assert_eq!(n("\\v1\\\\payments\\..\\refunds"), "/v1/refunds");
        assert_eq!(n("/v1%5Cpayments"), "/v1%5Cpayments");
        assert_eq!(n("/v1%5cpayments"), "/v1%5Cpayments");
    }

    #[test]
    fn the_query_and_the_fragment_are_cut_off() {
        assert_eq!(n("/v1/payments?x=1"), "/v1/payments");
        assert_eq!(n("/v1//payments?/../x"), "/v1/payments");
        assert_eq!(n("/v1/payments#frag"), "/v1/payments");
        assert_eq!(n("/v1/pay#x?y"), "/v1/pay");
        assert_eq!(n("?"), "/");
        assert_eq!(n("/a%3F/b"), "/a%3F/b", "an encoded ? is part of the path");
    }

    #[test]
    fn empty_asterisk_and_unrooted_paths() {
        assert_eq!(n(""), "/");
        assert_eq!(n("*"), "*");
        assert_eq!(n("*?x"), "*");
        assert_eq!(n("v1/payments"), "/v1/payments");
        assert_eq!(n("."), "/");
        assert_eq!(n(".."), "/");
        assert_eq!(n("../v1/payments"), "/v1/payments");
    }

    #[test]
    fn non_ascii_text_is_kept() {
        assert_eq!(n("/caf\u{e9}//x"), "/caf\u{e9}/x");
        assert_eq!(n("/\u{fffd}%70/./\u{fffd}"), "/\u{fffd}p/\u{fffd}");
    }

    #[test]
    fn very_long_paths_are_handled_in_one_pass() {
        // 64 KiB (more than Envoy's header limit lets through) of each hostile shape.
        let slashes = "/".repeat(64 * 1024);
        assert_eq!(n(&slashes), "/");
        let ups = "/a/..".repeat(13 * 1024);
        assert_eq!(n(&ups), "/");
        let escapes = "/%70".repeat(16 * 1024);
        assert_eq!(n(&escapes), "/p".repeat(16 * 1024));
        let deep = format!("{}{}", "/a".repeat(32 * 1024), "/..".repeat(32 * 1024 + 5));
        assert_eq!(n(&deep), "/");
        let long = format!("/v1/payments/{}", "x".repeat(64 * 1024));
        assert!(matches!(normalize(&long), Cow::Borrowed(_)));
    }

    #[test]
    fn prefixes_compare_case_only_when_asked() {
        assert!(has_prefix("/v1/payments/9", "/v1/payments", false));
        assert!(!has_prefix("/V1/payments", "/v1/payments", false));
        assert!(has_prefix("/V1/PAYMENTS", "/v1/payments", true));
        assert!(has_prefix("/v1/pay", "/v1/pay", true));
        assert!(!has_prefix("/v1/pa", "/v1/pay", true), "shorter than the prefix");
        assert!(!has_prefix("/caf\u{c9}", "/caf\u{e9}", true), "ASCII letters only");
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod props {
        use super::super::*;
        use proptest::prelude::*;

        fn path_piece() -> impl Strategy<Value = String> {
            proptest::sample::select(vec![
                "/", "//", ".", "..", "/./", "/../", "a", "B", "%2E", "%2e", "%2F", "%70", "%", "%4", "%zz", "?", "#",
                "*", "\u{e9}", "~", "\\", "%5C",
            ])
            .prop_map(str::to_string)
        }

        proptest! {
            #[test]
            fn normal_form_is_stable_and_rooted(pieces in proptest::collection::vec(path_piece(), 0..24)) {
                let p = pieces.concat();
                let once = normalize(&p).into_owned();
                prop_assert_eq!(normalize(&once).into_owned(), once.clone(), "from {:?}", p);
                prop_assert!(once == "*" || once.starts_with('/'), "{:?} -> {:?}", p, once);
                prop_assert!(!once.contains("//"), "{:?} -> {:?}", p, once);
                prop_assert!(!once.contains('?') && !once.contains('#'), "{:?} -> {:?}", p, once);
                let segments: Vec<&str> = once.split('/').collect();
                prop_assert!(!segments.contains(&".") && !segments.contains(&".."), "{:?} -> {:?}", p, once);
            }

            #[test]
            fn normalize_never_panics_on_any_text(p in ".{0,64}") {
                let _ = normalize(&p);
            }
        }
    }
}
