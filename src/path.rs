//! How a request path selects a route (`routes[].prefix`), and nothing else: the fingerprint
//! keeps the path as sent.
//!
//! An upstream (or its framework's router) may serve `/v1//payments`, `/v1/./payments`,
//! `/v1;jsessionid=1/payments` or `/v1%2Fpayments` as `/v1/payments`; Envoy forwards them as sent
//! unless its `normalize_path` / `merge_slashes` / `path_with_escaped_slashes_action` say
//! otherwise. A prefix compared with one reading of the path would leave the spellings that
//! another reading routes there unprotected, so a key could execute once per spelling. A path is
//! therefore read every way a mainstream origin reads it (`Reading::ALL`), and a route's prefix
//! matches when it matches any reading (the prefix read the same way). The readings share these
//! steps, in this order:
//!
//! 1. the query and the fragment are cut off (at the first `?` or `#`);
//! 2. (servlet) `;params` are cut from each segment of the path as sent (`/v1;a=1/x` -> `/v1/x`,
//!    `..;` -> `..`);
//! 3. percent-escapes are decoded: in the normal form only those of unreserved characters
//!    (RFC 3986 2.3: `A-Z a-z 0-9 - . _ ~`, every other escape kept with uppercase hex digits);
//!    in the decoded readings every escape, once or twice (`%2F` is `/`, `%5C` is `\`,
//!    `%252F` decoded twice is `/`);
//! 4. (decoded, then params) `;params` are cut from each segment of the decoded path;
//! 5. an empty path is `/`, a path not starting with `/` is read as if it did (except `*`);
//! 6. a backslash is a slash, as WHATWG URL parsers (browsers, Node's `URL`) read it; runs of
//!    `/` are merged into one;
//! 7. dot segments are removed as RFC 3986 5.2.4 does (`/a/./b` -> `/a/b`, `/a/b/../c` ->
//!    `/a/c`, `..` above the root stays at the root).
//!
//! The as-sent reading is only step 1 (for origins that normalise nothing: Express, Node).
//! Letter case is kept; a route compares it case-insensitively (ASCII) when it asks to.
//! Each reading is one pass over the path plus one list of segments: linear in its length, and a
//! path already in normal form (no `%`, `;`, `\`, `//` or `/.`) is returned as it is, without
//! allocating.

use std::borrow::Cow;

/// One way an origin reads a request path. A route's prefix protects a request when it matches
/// the request path under any of them (`ALL`, tried in this order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reading {
    /// RFC 3986: unreserved escapes decoded, backslashes as slashes, slashes merged, dot
    /// segments removed (`normalize`).
    Normal,
    /// The path as sent, query cut off (origins that normalise nothing: Express, Node).
    AsSent,
    /// Servlet containers (Tomcat, Jetty, Spring MVC on the request URI): `;params` cut from
    /// each segment as sent, then every escape decoded, then `Normal`'s steps.
    Servlet,
    /// Decoding servers (WSGI: Flask, Django; Go's net/http before 1.22, gorilla/mux): every
    /// escape decoded once (`%2F` is a slash), then `Normal`'s steps.
    Decoded,
    /// Spring on the servlet path Tomcat already decoded: every escape decoded, then `;params`
    /// cut from each segment (`..%3B` is `..`), then `Normal`'s steps.
    DecodedParams,
    /// `Decoded` behind a proxy that decoded once already (`%252F` is a slash).
    TwiceDecoded,
    /// `DecodedParams` behind a proxy that decoded once already.
    TwiceDecodedParams,
}

impl Reading {
    pub const ALL: [Reading; 7] = [
        Reading::Normal,
        Reading::AsSent,
        Reading::Servlet,
        Reading::Decoded,
        Reading::DecodedParams,
        Reading::TwiceDecoded,
        Reading::TwiceDecodedParams,
    ];

    /// `path` (a `:path` value, with or without its query, or a route prefix) read this way.
    pub fn of(self, path: &str) -> Cow<'_, str> {
        let cut = without_query(path);
        // (params cut from the path as sent, full decodings, params cut after decoding)
        let (params_as_sent, decodings, params_decoded) = match self {
            Reading::Normal => return normalize(path),
            Reading::AsSent => return Cow::Borrowed(cut),
            Reading::Servlet => (true, 1, false),
            Reading::Decoded => (false, 1, false),
            Reading::DecodedParams => (false, 1, true),
            Reading::TwiceDecoded => (false, 2, false),
            Reading::TwiceDecodedParams => (false, 2, true),
        };
        if cut == "*" || (is_normal(cut) && !cut.contains(';')) {
            return Cow::Borrowed(cut);
        }
        let mut p = if params_as_sent { strip_params(cut) } else { cut.to_string() };
        for _ in 0..decodings {
            if !p.contains('%') {
                break;
            }
            p = decode(&p, true);
        }
        if params_decoded {
            p = strip_params(&p);
        }
        Cow::Owned(remove_dot_segments(&p.replace('\\', "/")))
    }
}

/// The normal form of `path` (a `:path` value, with or without its query): `Reading::Normal`.
pub fn normalize(path: &str) -> Cow<'_, str> {
    let path = without_query(path);
    if path == "*" {
        return Cow::Borrowed(path);
    }
    if is_normal(path) {
        return Cow::Borrowed(path);
    }
    let decoded = decode(path, false).replace('\\', "/");
    Cow::Owned(remove_dot_segments(&decoded))
}

/// A whole request target (path and query) read so that every two spellings that any mainstream
/// backend reads as one target are one (used where a key is derived from the target:
/// `derive::derive`). The path: every escape decoded twice, `;params` cut from each segment,
/// slashes merged, dot segments removed (`Reading::TwiceDecodedParams`, which reads each spelling
/// the other readings merge), a trailing `/` dropped, ASCII letters in lower case (Express and
/// Rails route without regard to case, Express and FastAPI with or without a trailing slash). The
/// query: empty pairs dropped, `+` a space, every escape decoded, the pairs sorted (every backend
/// of the oracle's panel reads a query as a map). It merges what some backends keep apart
/// (`/orders/A` and `/orders/a` to a case-sensitive router, `?a=1&a=2` and `?a=2&a=1`): such a
/// pair derives one key, and the fingerprint (the target as sent) answers the second 422 before it
/// executes. A target already in this form (lower case, normal, its query sorted and unescaped)
/// is returned as it is.
pub fn one_target(target: &str) -> Cow<'_, str> {
    let target = target.split('#').next().unwrap_or_default();
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    let mut out = Reading::TwiceDecodedParams.of(path).into_owned();
    if out.len() > 1 && out.ends_with('/') {
        out.pop();
    }
    out.make_ascii_lowercase();
    if let Some(q) = query {
        // Each pair decoded, its separators escaped again (so two pairs never read as one), then
        // the pairs in one order: sorted as text.
        let mut pairs: Vec<String> = q
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (n, v) = p.split_once('=').unwrap_or((p, ""));
                let mut one = escape_query(&decode(&n.replace('+', " "), true));
                if !v.is_empty() {
                    one.push('=');
                    one.push_str(&escape_query(&decode(&v.replace('+', " "), true)));
                }
                one
            })
            .collect();
        pairs.sort_unstable();
        if !pairs.is_empty() {
            out.push('?');
            out.push_str(&pairs.join("&"));
        }
    }
    if out == target {
        Cow::Borrowed(target)
    } else {
        Cow::Owned(out)
    }
}

/// A decoded query name or value with the characters that would change how the pairs split
/// escaped again (`%`, `&`, `=`, `+`, `#`), so two different pairs never join into one string.
fn escape_query(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '&' => out.push_str("%26"),
            '=' => out.push_str("%3D"),
            '+' => out.push_str("%2B"),
            '#' => out.push_str("%23"),
            c => out.push(c),
        }
    }
    out
}

/// `path` up to its first `?` or `#`.
fn without_query(path: &str) -> &str {
    path.find(['?', '#']).and_then(|i| path.get(..i)).unwrap_or(path)
}

/// Whether `path` (a request path read one way) starts with `prefix` (the route's prefix read the
/// same way), comparing ASCII letters without regard to case when `case_insensitive`. A prefix
/// ending in `/` also matches the path without that slash (`/v1/orders/` matches `/v1/orders`):
/// Express (non-strict routing, its default), Rails and Spring before 6 route both to one
/// handler.
pub fn has_prefix(path: &str, prefix: &str, case_insensitive: bool) -> bool {
    let starts = |p: &str| {
        if case_insensitive {
            path.as_bytes().get(..p.len()).is_some_and(|head| head.eq_ignore_ascii_case(p.as_bytes()))
        } else {
            path.starts_with(p)
        }
    };
    let bare = prefix.strip_suffix('/').filter(|b| !b.is_empty());
    starts(prefix) || bare.is_some_and(|b| path.len() == b.len() && starts(b))
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
fn hex_digit(v: u8) -> u8 {
    if v < 10 {
        b'0' + v
    } else {
        b'A' + (v - 10)
    }
}

/// Decodes `%XX`: every escape when `all`, else only those of unreserved characters (the others
/// get uppercase hex digits); a `%` not followed by two hex digits is kept as it is. Decoded
/// bytes that are not UTF-8 become U+FFFD (the prefix, read the same way, gets the same).
fn decode(path: &str, all: bool) -> String {
    let bytes = path.as_bytes();
    let mut out: Vec<u8> = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let Some(byte) = bytes.get(i..).and_then(crate::hex::escape) else {
            out.push(b);
            i += 1;
            continue;
        };
        if all || is_unreserved(byte) {
            out.push(byte);
        } else {
            out.extend_from_slice(&[b'%', hex_digit(byte >> 4), hex_digit(byte & 0x0f)]);
        }
        i += 3;
    }
    match String::from_utf8(out) {
        Ok(s) => s,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    }
}

/// Cuts each `/`-separated segment at its first `;` (`/v1;a=1/x;b` -> `/v1/x`, `..;` -> `..`).
fn strip_params(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for (n, segment) in path.split('/').enumerate() {
        if n > 0 {
            out.push('/');
        }
        out.push_str(segment.split(';').next().unwrap_or_default());
    }
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
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

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

    /// Every reading of `p`, in `Reading::ALL` order.
    fn readings(p: &str) -> Vec<String> {
        Reading::ALL.iter().map(|r| r.of(p).into_owned()).collect()
    }

    fn read_as(p: &str, target: &str) -> bool {
        readings(p).iter().any(|r| r == target)
    }

    #[test]
    fn servlet_containers_cut_path_parameters_from_each_segment() {
        assert_eq!(Reading::Servlet.of("/v1;jsessionid=a1/payments"), "/v1/payments");
        assert_eq!(Reading::Servlet.of("/v1/x/..;/payments"), "/v1/payments");
        assert_eq!(Reading::Servlet.of("/v1/x/..;a=b/payments?q=;x"), "/v1/payments");
        assert_eq!(Reading::Servlet.of("/;x/v1;a;b/payments;c"), "/v1/payments");
        // Cut before decoding: an encoded `;` is not a separator to Tomcat ...
        assert_eq!(Reading::Servlet.of("/v1/x/..%3B/payments"), "/v1/x/..;/payments");
        // ... but Spring cuts again on the decoded path.
        assert_eq!(Reading::DecodedParams.of("/v1/x/..%3B/payments"), "/v1/payments");
        // Parameters hide what follows them in their segment, encoded slashes included.
        assert_eq!(Reading::Servlet.of("/v1;%2F..%2F..%2Fx/payments"), "/v1/payments");
        assert_eq!(Reading::DecodedParams.of("/v1;%2F..%2F..%2Fx/payments"), "/x/payments");
        // The normal form and the as-sent reading keep them.
        assert_eq!(Reading::Normal.of("/v1;a/payments"), "/v1;a/payments");
        assert_eq!(Reading::AsSent.of("/v1;a/payments?x"), "/v1;a/payments");
    }

    #[test]
    fn decoding_servers_read_encoded_slashes_and_backslashes_as_separators() {
        assert_eq!(Reading::Decoded.of("/v1%2Fpayments"), "/v1/payments");
        assert_eq!(Reading::Decoded.of("/%2Fv1/payments"), "/v1/payments");
        assert_eq!(Reading::Decoded.of("/v1%2fpayments"), "/v1/payments");
        assert_eq!(Reading::Decoded.of("/v1%5Cpayments"), "/v1/payments");
        assert_eq!(Reading::Decoded.of("/v1/x%2F..%2Fpayments"), "/v1/payments");
        assert_eq!(Reading::Decoded.of("%2Fv1"), "/v1");
        // Once: `%252F` is `%2F`; twice (behind a decoding proxy) it is `/`.
        assert_eq!(Reading::Decoded.of("/v1%252Fpayments"), "/v1%2Fpayments");
        assert_eq!(Reading::TwiceDecoded.of("/v1%252Fpayments"), "/v1/payments");
        assert_eq!(Reading::TwiceDecodedParams.of("/v1%253Bx/payments"), "/v1/payments");
        // Never a third time.
        assert_eq!(Reading::TwiceDecoded.of("/v1%25252Fpayments"), "/v1%2Fpayments");
        // Bytes that are not UTF-8 once decoded become U+FFFD; malformed escapes stay.
        assert_eq!(Reading::Decoded.of("/a%FF/%C3%A9/%zz%"), "/a\u{fffd}/\u{e9}/%zz%");
        // The normal form keeps `%2F` and `%5C` encoded.
        assert_eq!(Reading::Normal.of("/v1%2Fpayments"), "/v1%2Fpayments");
    }

    #[test]
    fn every_spelling_from_the_issue_has_a_reading_that_is_the_canonical_path() {
        for p in [
            "/v1;jsessionid=a1/payments",
            "/v1/x/..;/payments",
            "/v1%2Fpayments",
            "/%2Fv1/payments",
            "/v1/%2e%2E/v1/payments",
            "/v1//payments",
            "/v1\\payments",
            "/v1%5cpayments",
            "/v1%252Fpayments",
            "/v1/x/..%3B/payments",
            "/v1/x/%2E%2E;/payments",
        ] {
            assert!(read_as(p, "/v1/payments"), "{p}: {:?}", readings(p));
        }
        for p in ["/v1/pay%2Fments", "/v1/pay;ments", "/v1/paymentsX/.."] {
            assert!(!read_as(p, "/v1/payments"), "{p}: {:?}", readings(p));
        }
    }

    #[test]
    fn plain_paths_are_every_reading_without_allocating() {
        for r in Reading::ALL {
            for p in ["/", "/v1/payments", "/v1/payments/", "/a-b_c~d/e.f", "*"] {
                assert!(matches!(r.of(p), Cow::Borrowed(b) if b == p), "{r:?} {p}");
            }
            assert!(matches!(r.of("/v1/payments?a=%2F;b"), Cow::Borrowed("/v1/payments")), "{r:?}");
        }
    }

    #[test]
    fn a_prefix_with_a_trailing_slash_matches_the_path_without_it() {
        assert!(has_prefix("/v1/orders", "/v1/orders/", false));
        assert!(has_prefix("/V1/ORDERS", "/v1/orders/", true));
        assert!(has_prefix("/v1/orders/7", "/v1/orders/", false));
        assert!(!has_prefix("/v1/order", "/v1/orders/", false));
        assert!(!has_prefix("/v1/ordersx", "/v1/orders/", false));
        assert!(!has_prefix("/V1/orders", "/v1/orders/", false));
        assert!(!has_prefix("", "/", false));
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
                "*", "\u{e9}", "~", "\\", "%5C", ";", ";x", "%3B", "%25", "%252F",
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
                for r in Reading::ALL {
                    let _ = r.of(&p);
                }
            }

            #[test]
            fn every_decoded_reading_is_rooted_and_free_of_dot_segments(
                pieces in proptest::collection::vec(path_piece(), 0..24)
            ) {
                let p = pieces.concat();
                for r in &Reading::ALL[2..] {
                    let read = r.of(&p).into_owned();
                    prop_assert!(read == "*" || read.starts_with('/'), "{:?} {:?} -> {:?}", r, p, read);
                    prop_assert!(!read.contains("//") && !read.contains('\\'), "{:?} {:?} -> {:?}", r, p, read);
                    let segments: Vec<&str> = read.split('/').collect();
                    prop_assert!(!segments.contains(&".") && !segments.contains(&".."), "{:?} {:?} -> {:?}", r, p, read);
                }
            }
        }
    }
}
