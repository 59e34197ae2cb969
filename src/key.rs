//! The `Idempotency-Key` header: syntax and validation.
//!
//! Each policy picks one rule with `key_syntax`:
//! - `"strict"` (default): an RFC 8941 sf-string, as the IETF draft asks:
//!   `"8e03978e-40d5-43e8-bc93-6894a57f9324"`, with its two escapes `\"` and `\\` (printable ASCII
//!   and spaces inside); or a bare token, as Stripe's and most clients send: the RFC 9110 `tchar`s
//!   plus `:` and `/`, which RFC 8941 sf-tokens allow (`run-7:step/1`). (An sf-token would have to
//!   start with a letter or `*`; UUIDs often start with a digit, so any token character may start
//!   a bare key.)
//! - `"any"`: Stripe's rule: any string of visible ASCII and spaces (`a=b c`), compared as sent; a
//!   value that is a valid sf-string is still unquoted first, so `"abc"` and `abc` stay one key
//!   under both rules.
//!
//! Under both rules a key is 1 to `key_max_length` characters; control characters, DEL and
//! non-ASCII bytes are refused. Structured-field parameters (`"k";p=1`) and lists are refused by
//! the strict rule.
//!
//! Accepting more keys changes nothing for a key accepted before: the storage key hashes the
//! parsed key (`scope::StorageKey::derive`), and a key both rules accept parses to the same text.

use std::fmt;

/// A validated idempotency key: 1 to `max` visible ASCII characters, escapes already removed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// A key derived at the edge (see `derive`): `derived-` and 32 hex digits.
    pub(crate) fn derived(hex: String) -> IdempotencyKey {
        IdempotencyKey(format!("derived-{hex}"))
    }

    /// The key's characters (never logged raw: log the storage key's hash instead).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Which keys a policy accepts (`key_syntax`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KeySyntax {
    /// An sf-string, or a bare RFC 9110 / RFC 8941 token (`tchar`, `:` and `/`).
    #[default]
    Strict,
    /// Any string of visible ASCII and spaces (Stripe's rule).
    Any,
}

impl KeySyntax {
    /// The configuration name.
    pub fn name(self) -> &'static str {
        match self {
            KeySyntax::Strict => "strict",
            KeySyntax::Any => "any",
        }
    }

    /// The rule in one sentence, for the 400 answer's detail.
    pub fn rule(self, max_len: usize) -> String {
        match self {
            KeySyntax::Strict => format!(
                "this endpoint's key rule (`key_syntax: \"strict\"`) is 1 to {max_len} characters, sent as a quoted structured-field string (printable ASCII and spaces, with \\\" and \\\\ escapes) or bare with only letters, digits and !#$%&'*+-.^_`|~:/"
            ),
            KeySyntax::Any => format!(
                "this endpoint's key rule (`key_syntax: \"any\"`) is 1 to {max_len} characters of visible ASCII and spaces"
            ),
        }
    }
}

/// Why a key header was refused. Each variant maps to its own 400 problem type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyError {
    /// The header is present more than once.
    Repeated,
    /// The value is empty (or only whitespace, or `""`).
    Empty,
    /// The key is longer than the configured `key_max_length`.
    TooLong { len: usize, max: usize },
    /// A byte that is not visible ASCII (control, DEL, or non-ASCII; or a space in a bare key
    /// under the strict rule).
    NotVisibleAscii,
    /// A comma outside a string: the header carries a list, not one key.
    List,
    /// A bare key with a visible character that is not a token character (`tchar`, `:` or `/`):
    /// quote it as a string.
    NotAToken,
    /// A string that is not a valid RFC 8941 sf-string: unterminated, a bad escape, or followed by
    /// parameters or other characters.
    MalformedString,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Repeated => write!(f, "the key header appears more than once"),
            KeyError::Empty => write!(f, "the key is empty"),
            KeyError::TooLong { len, max } => {
                write!(f, "the key has {len} characters, more than the limit of {max}")
            }
            KeyError::NotVisibleAscii => write!(f, "the key contains a byte that is not visible ASCII"),
            KeyError::List => write!(f, "the header holds a list; send exactly one key"),
            KeyError::NotAToken => write!(
                f,
                "a bare key may only use token characters (letters, digits and !#$%&'*+-.^_`|~:/); quote other keys as a string"
            ),
            KeyError::MalformedString => write!(
                f,
                "the quoted key is not a valid structured-field string (closing quote, \\\" and \\\\ escapes, nothing after it)"
            ),
        }
    }
}

/// True for RFC 9110 `tchar`.
pub fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// True for a character of a bare key under the strict rule: an RFC 9110 `tchar`, or `:` and `/`,
/// which RFC 8941 sf-tokens add.
fn is_key_token_char(b: u8) -> bool {
    is_tchar(b) || b == b':' || b == b'/'
}

fn is_ows(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = v {
        if is_ows(*first) {
            v = rest;
        } else {
            break;
        }
    }
    while let [rest @ .., last] = v {
        if is_ows(*last) {
            v = rest;
        } else {
            break;
        }
    }
    v
}

/// Parses the key from every value of the key header in the request (all header lines, in order).
/// Returns `Ok(None)` when the header is absent.
pub fn parse_key_header(
    values: &[&[u8]],
    max_len: usize,
    syntax: KeySyntax,
) -> Result<Option<IdempotencyKey>, KeyError> {
    match values {
        [] => Ok(None),
        [one] => parse_key(one, max_len, syntax).map(Some),
        _ => Err(KeyError::Repeated),
    }
}

/// Parses one header value into a key.
pub fn parse_key(raw: &[u8], max_len: usize, syntax: KeySyntax) -> Result<IdempotencyKey, KeyError> {
    let v = trim_ows(raw);
    let key = match (syntax, v.first()) {
        (_, None) => return Err(KeyError::Empty),
        (KeySyntax::Strict, Some(b'"')) => parse_sf_string(v)?,
        (KeySyntax::Strict, Some(_)) => parse_bare(v)?,
        (KeySyntax::Any, Some(b'"')) => parse_sf_string(v).or_else(|_| parse_any(v))?,
        (KeySyntax::Any, Some(_)) => parse_any(v)?,
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > max_len {
        return Err(KeyError::TooLong { len: key.len(), max: max_len });
    }
    Ok(IdempotencyKey(key))
}

fn parse_bare(v: &[u8]) -> Result<String, KeyError> {
    // Order matters for a precise answer: invisible bytes first, then lists, then other
    // visible characters that are not token characters.
    if v.iter().any(|b| !(0x21..=0x7e).contains(b)) {
        return Err(KeyError::NotVisibleAscii);
    }
    if v.contains(&b',') {
        return Err(KeyError::List);
    }
    if !v.iter().all(|b| is_key_token_char(*b)) {
        return Err(KeyError::NotAToken);
    }
    // Visible ASCII only (checked above), so the bytes are their own UTF-8: copied at once.
    Ok(std::str::from_utf8(v).map_or_else(|_| v.iter().map(|b| char::from(*b)).collect(), str::to_owned))
}

/// Stripe's rule: the value as sent (surrounding whitespace already trimmed), visible ASCII and
/// spaces.
fn parse_any(v: &[u8]) -> Result<String, KeyError> {
    if v.iter().any(|b| !(0x20..=0x7e).contains(b)) {
        return Err(KeyError::NotVisibleAscii);
    }
    Ok(v.iter().map(|b| char::from(*b)).collect())
}

/// `v` starts with `"`. RFC 8941 section 4.2.5.
fn parse_sf_string(v: &[u8]) -> Result<String, KeyError> {
    let mut out = String::new();
    let mut i = 1;
    loop {
        let Some(&b) = v.get(i) else {
            return Err(KeyError::MalformedString);
        };
        i += 1;
        match b {
            b'\\' => match v.get(i) {
                Some(&e @ (b'"' | b'\\')) => {
                    out.push(char::from(e));
                    i += 1;
                }
                _ => return Err(KeyError::MalformedString),
            },
            b'"' => break,
            0x20..=0x7e => out.push(char::from(b)),
            _ => return Err(KeyError::NotVisibleAscii),
        }
    }
    match v.get(i) {
        None => {}
        Some(b',') => return Err(KeyError::List),
        Some(_) => {
            // A second string in a list (`"a", "b"`) is still a list.
            let rest = trim_ows(v.get(i..).unwrap_or_default());
            return Err(if rest.first() == Some(&b',') { KeyError::List } else { KeyError::MalformedString });
        }
    }
    // A space inside the string is legal sf-string syntax (RFC 8941 4.2.5), and the key is
    // stored and logged by hash only.
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const UUID: &str = "9f2b7c14-6d3a-4b18-9d55-1e2a7c0b4f31";

    fn ok(raw: &str) -> String {
        ok_with(raw, KeySyntax::Strict)
    }

    fn ok_with(raw: &str, syntax: KeySyntax) -> String {
        match parse_key(raw.as_bytes(), 255, syntax) {
            Ok(k) => k.as_str().to_owned(),
            Err(e) => panic!("{raw:?} refused: {e}"),
        }
    }

    fn err(raw: &[u8]) -> KeyError {
        err_with(raw, KeySyntax::Strict)
    }

    fn err_with(raw: &[u8], syntax: KeySyntax) -> KeyError {
        match parse_key(raw, 255, syntax) {
            Ok(k) => panic!("{raw:?} accepted as {k:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn bare_uuid_starting_with_a_digit_is_accepted() {
        assert_eq!(ok(UUID), UUID);
    }

    #[test]
    fn sf_string_uuid_is_accepted_without_its_quotes() {
        assert_eq!(ok(&format!("\"{UUID}\"")), UUID);
    }

    #[test]
    fn bare_and_quoted_forms_of_one_key_are_the_same_key() {
        assert_eq!(ok("abc-123"), ok("\"abc-123\""));
    }

    #[test]
    fn sf_string_escapes_are_decoded() {
        assert_eq!(ok(r#""a\"b\\c""#), r#"a"b\c"#);
    }

    #[test]
    fn surrounding_whitespace_is_ignored() {
        assert_eq!(ok(" \tkey-1 \t"), "key-1");
        assert_eq!(ok("  \"key-1\"  "), "key-1");
    }

    #[test]
    fn every_token_character_is_accepted_bare() {
        let all = "!#$%&'*+-.^_`|~09azAZ";
        assert_eq!(ok(all), all);
    }

    #[test]
    fn quoted_key_may_hold_visible_non_token_characters() {
        assert_eq!(ok("\"a/b:c=d\""), "a/b:c=d");
    }

    #[test]
    fn each_malformed_shape_has_its_own_error() {
        let table: &[(&[u8], KeyError)] = &[
            (b"", KeyError::Empty),
            (b"   ", KeyError::Empty),
            (b"\"\"", KeyError::Empty),
            (b"a b", KeyError::NotVisibleAscii),
            (b"a\x00b", KeyError::NotVisibleAscii),
            (b"a\x7fb", KeyError::NotVisibleAscii),
            (b"caf\xc3\xa9", KeyError::NotVisibleAscii),
            (b"\"caf\xc3\xa9\"", KeyError::NotVisibleAscii),
            (b"\"a\tb\"", KeyError::NotVisibleAscii),
            (b"a,b", KeyError::List),
            (b"\"a\",\"b\"", KeyError::List),
            (b"\"a\" , \"b\"", KeyError::List),
            (b"a=b", KeyError::NotAToken),
            (b"a;b", KeyError::NotAToken),
            (b"a\"b", KeyError::NotAToken),
            (b"\"abc", KeyError::MalformedString),
            (b"\"a\\b\"", KeyError::MalformedString),
            (b"\"abc\\", KeyError::MalformedString),
            (b"\"abc\";p=1", KeyError::MalformedString),
            (b"\"abc\"x", KeyError::MalformedString),
        ];
        for (raw, want) in table {
            assert_eq!(err(raw), *want, "input {:?}", String::from_utf8_lossy(raw));
        }
    }

    #[test]
    fn length_limit_counts_key_characters_not_quotes() {
        let k255 = "k".repeat(255);
        assert_eq!(ok(&k255).len(), 255);
        assert_eq!(ok(&format!("\"{k255}\"")).len(), 255);
        let k256 = "k".repeat(256);
        assert_eq!(err(k256.as_bytes()), KeyError::TooLong { len: 256, max: 255 });
        assert_eq!(parse_key(b"abcd", 3, KeySyntax::Strict), Err(KeyError::TooLong { len: 4, max: 3 }));
    }

    #[test]
    fn header_sent_twice_is_refused_even_with_equal_values() {
        assert_eq!(parse_key_header(&[b"k1", b"k1"], 255, KeySyntax::Strict), Err(KeyError::Repeated));
        assert_eq!(parse_key_header(&[], 255, KeySyntax::Any), Ok(None));
        assert_eq!(parse_key_header(&[b"k1"], 255, KeySyntax::Strict).map(|k| k.map(|k| k.0)), Ok(Some("k1".into())));
    }

    #[test]
    fn strict_rule_takes_rfc_8941_tokens_as_callers_write_them() {
        assert_eq!(ok("run-7:step/1"), "run-7:step/1");
        assert_eq!(ok("urn:agent:task/42"), "urn:agent:task/42");
        assert_eq!(ok("/leading/slash:"), "/leading/slash:");
        // A quoted form of the same key is the same key.
        assert_eq!(ok("\"run-7:step/1\""), "run-7:step/1");
    }

    #[test]
    fn strict_rule_takes_spaces_inside_an_sf_string_only() {
        assert_eq!(ok("\"step 1 of run 7\""), "step 1 of run 7");
        assert_eq!(err(b"step 1"), KeyError::NotVisibleAscii);
        assert_eq!(err(b"a=b"), KeyError::NotAToken);
        assert_eq!(ok("\"a=b\""), "a=b");
    }

    #[test]
    fn any_rule_takes_stripes_keys_as_sent() {
        for key in
            ["run-7:step/1", "a=b", "step 1 of run 7", "a,b", "a;b=c", "{\"json\": 1}", "x\"y", "~!@#$%^&*()[]<>?"]
        {
            assert_eq!(ok_with(key, KeySyntax::Any), key);
        }
        // Surrounding whitespace is the header's, not the key's.
        assert_eq!(ok_with("  a b  ", KeySyntax::Any), "a b");
        // A valid sf-string is unquoted under both rules, so a key means the same on every route.
        assert_eq!(ok_with("\"abc\"", KeySyntax::Any), "abc");
        assert_eq!(ok_with("\"a\\\"b\"", KeySyntax::Any), "a\"b");
        // Anything else that starts with a quote is taken literally.
        assert_eq!(ok_with("\"a\"b", KeySyntax::Any), "\"a\"b");
        assert_eq!(ok_with("\"abc", KeySyntax::Any), "\"abc");
        assert_eq!(ok_with(&"k".repeat(255), KeySyntax::Any).len(), 255);
    }

    #[test]
    fn keys_accepted_by_the_strict_rule_mean_the_same_under_the_any_rule() {
        for key in ["abc", UUID, "\"abc\"", "run-7:step/1", "\"a b\"", "\"a\\\\b\"", "!#$%&'*+-.^_`|~"] {
            assert_eq!(ok(key), ok_with(key, KeySyntax::Any), "{key}");
        }
    }

    #[test]
    fn hostile_keys_are_refused_under_both_rules() {
        for syntax in [KeySyntax::Strict, KeySyntax::Any] {
            let table: &[(&[u8], KeyError)] = &[
                (b"", KeyError::Empty),
                (b" \t ", KeyError::Empty),
                (b"\"\"", KeyError::Empty),
                (b"a\x00b", KeyError::NotVisibleAscii),
                (b"a\x01b", KeyError::NotVisibleAscii),
                (b"a\tb", KeyError::NotVisibleAscii),
                (b"a\rb", KeyError::NotVisibleAscii),
                (b"a\nb", KeyError::NotVisibleAscii),
                (b"a\x7fb", KeyError::NotVisibleAscii),
                (b"caf\xc3\xa9", KeyError::NotVisibleAscii),
                (b"\xff", KeyError::NotVisibleAscii),
            ];
            for (raw, want) in table {
                assert_eq!(err_with(raw, syntax), *want, "{syntax:?} {:?}", String::from_utf8_lossy(raw));
            }
            let k256 = "k".repeat(256);
            assert_eq!(err_with(k256.as_bytes(), syntax), KeyError::TooLong { len: 256, max: 255 });
            assert_eq!(err_with(format!("\"{k256}\"").as_bytes(), syntax), KeyError::TooLong { len: 256, max: 255 });
            assert_eq!(parse_key_header(&[b"k1", b"k2"], 255, syntax), Err(KeyError::Repeated));
        }
    }

    #[test]
    fn the_rule_names_itself_and_its_limit() {
        let strict = KeySyntax::Strict.rule(64);
        assert!(
            strict.contains("key_syntax: \"strict\"") && strict.contains("1 to 64") && strict.contains(":/"),
            "{strict}"
        );
        let any = KeySyntax::Any.rule(255);
        assert!(any.contains("key_syntax: \"any\"") && any.contains("1 to 255"), "{any}");
        assert_eq!(
            (KeySyntax::default(), KeySyntax::Strict.name(), KeySyntax::Any.name()),
            (KeySyntax::Strict, "strict", "any")
        );
    }

    #[test]
    fn every_error_has_a_distinct_sentence() {
        let all = [
            KeyError::Repeated,
            KeyError::Empty,
            KeyError::TooLong { len: 2, max: 1 },
            KeyError::NotVisibleAscii,
            KeyError::List,
            KeyError::NotAToken,
            KeyError::MalformedString,
        ];
        let texts: std::collections::HashSet<String> = all.iter().map(|e| e.to_string()).collect();
        assert_eq!(texts.len(), all.len());
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod props {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn never_panics_on_any_bytes(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
                let _ = parse_key(&raw, 255, KeySyntax::Strict);
                let _ = parse_key(&raw, 255, KeySyntax::Any);
            }

            #[test]
            fn accepted_keys_are_printable_ascii_within_limit(raw in proptest::collection::vec(any::<u8>(), 0..300), max in 1usize..300) {
                for syntax in [KeySyntax::Strict, KeySyntax::Any] {
                    if let Ok(k) = parse_key(&raw, max, syntax) {
                        prop_assert!(!k.as_str().is_empty() && k.as_str().len() <= max);
                        prop_assert!(k.as_str().bytes().all(|b| (0x20..=0x7e).contains(&b)));
                    }
                }
            }

            #[test]
            fn a_key_the_strict_rule_accepts_is_the_same_key_under_the_any_rule(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
                if let Ok(k) = parse_key(&raw, 255, KeySyntax::Strict) {
                    prop_assert_eq!(parse_key(&raw, 255, KeySyntax::Any), Ok(k));
                }
            }

            #[test]
            fn any_token_round_trips_bare_and_quoted(key in "[!#$%&'*+.^_`|~0-9A-Za-z:/-]{1,255}") {
                prop_assert_eq!(parse_key(key.as_bytes(), 255, KeySyntax::Strict).map(|k| k.0), Ok(key.clone()));
                let quoted = format!("\"{key}\"");
                prop_assert_eq!(parse_key(quoted.as_bytes(), 255, KeySyntax::Strict).map(|k| k.0), Ok(key));
            }

            #[test]
            fn any_printable_key_round_trips_through_sf_string_escaping(key in "[ -~]{1,200}") {
                let escaped: String = key.chars().flat_map(|c| match c {
                    '"' | '\\' => vec!['\\', c],
                    _ => vec![c],
                }).collect();
                let quoted = format!("\"{escaped}\"");
                prop_assert_eq!(parse_key(quoted.as_bytes(), 255, KeySyntax::Strict).map(|k| k.0), Ok(key));
            }
        }
    }
}
