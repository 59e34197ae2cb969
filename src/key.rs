//! The `Idempotency-Key` header: syntax and validation.
//!
//! Two forms are accepted:
//! - an RFC 8941 sf-string, as the IETF draft asks: `"8e03978e-40d5-43e8-bc93-6894a57f9324"`, with
//!   its two escapes `\"` and `\\`;
//! - a bare RFC 9110 token (`tchar`s), as Stripe's clients send: `9f2b7c14-6d3a-4b18-9d55-1e2a7c0b4f31`.
//!   (An RFC 8941 sf-token would have to start with a letter or `*`; UUIDs often start with a digit,
//!   so the bare form follows RFC 9110 instead.)
//!
//! Structured-field parameters (`"k";p=1`) are not supported and are rejected, as are lists.

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

/// Why a key header was refused. Each variant maps to its own 400 problem type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyError {
    /// The header is present more than once.
    Repeated,
    /// The value is empty (or only whitespace, or `""`).
    Empty,
    /// The key is longer than the configured `key_max_length`.
    TooLong { len: usize, max: usize },
    /// A byte that is not visible ASCII (control, space inside the key, DEL, or non-ASCII).
    NotVisibleAscii,
    /// A comma outside a string: the header carries a list, not one key.
    List,
    /// A bare key with a visible character that is not an RFC 9110 `tchar` (quote it as a string).
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
                "a bare key may only use token characters (letters, digits and !#$%&'*+-.^_`|~); quote other keys as a string"
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
pub fn parse_key_header(values: &[&[u8]], max_len: usize) -> Result<Option<IdempotencyKey>, KeyError> {
    match values {
        [] => Ok(None),
        [one] => parse_key(one, max_len).map(Some),
        _ => Err(KeyError::Repeated),
    }
}

/// Parses one header value into a key.
pub fn parse_key(raw: &[u8], max_len: usize) -> Result<IdempotencyKey, KeyError> {
    let v = trim_ows(raw);
    let key = match v.first() {
        None => return Err(KeyError::Empty),
        Some(b'"') => parse_sf_string(v)?,
        Some(_) => parse_bare(v)?,
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
    if !v.iter().all(|b| is_tchar(*b)) {
        return Err(KeyError::NotAToken);
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
    // A space inside the string is legal sf-string syntax, but a key made to be compared and
    // logged by hash must be visible ASCII only.
    if out.bytes().any(|b| b == b' ') {
        return Err(KeyError::NotVisibleAscii);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const UUID: &str = "9f2b7c14-6d3a-4b18-9d55-1e2a7c0b4f31";

    fn ok(raw: &str) -> String {
        match parse_key(raw.as_bytes(), 255) {
            Ok(k) => k.as_str().to_owned(),
            Err(e) => panic!("{raw:?} refused: {e}"),
        }
    }

    fn err(raw: &[u8]) -> KeyError {
        match parse_key(raw, 255) {
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
            (b"\"a b\"", KeyError::NotVisibleAscii),
            (b"\"a\tb\"", KeyError::NotVisibleAscii),
            (b"a,b", KeyError::List),
            (b"\"a\",\"b\"", KeyError::List),
            (b"\"a\" , \"b\"", KeyError::List),
            (b"a/b", KeyError::NotAToken),
            (b"a=b", KeyError::NotAToken),
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
        assert_eq!(parse_key(b"abcd", 3), Err(KeyError::TooLong { len: 4, max: 3 }));
    }

    #[test]
    fn header_sent_twice_is_refused_even_with_equal_values() {
        assert_eq!(parse_key_header(&[b"k1", b"k1"], 255), Err(KeyError::Repeated));
        assert_eq!(parse_key_header(&[], 255), Ok(None));
        assert_eq!(parse_key_header(&[b"k1"], 255).map(|k| k.map(|k| k.0)), Ok(Some("k1".into())));
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
                let _ = parse_key(&raw, 255);
            }

            #[test]
            fn accepted_keys_are_visible_ascii_within_limit(raw in proptest::collection::vec(any::<u8>(), 0..300), max in 1usize..300) {
                if let Ok(k) = parse_key(&raw, max) {
                    prop_assert!(!k.as_str().is_empty() && k.as_str().len() <= max);
                    prop_assert!(k.as_str().bytes().all(|b| (0x21..=0x7e).contains(&b)));
                }
            }

            #[test]
            fn any_token_round_trips_bare_and_quoted(key in "[!#$%&'*+.^_`|~0-9A-Za-z-]{1,255}") {
                prop_assert_eq!(parse_key(key.as_bytes(), 255).map(|k| k.0), Ok(key.clone()));
                let quoted = format!("\"{key}\"");
                prop_assert_eq!(parse_key(quoted.as_bytes(), 255).map(|k| k.0), Ok(key));
            }

            #[test]
            fn any_visible_key_round_trips_through_sf_string_escaping(key in "[!-~]{1,200}") {
                let escaped: String = key.chars().flat_map(|c| match c {
                    '"' | '\\' => vec!['\\', c],
                    _ => vec![c],
                }).collect();
                let quoted = format!("\"{escaped}\"");
                prop_assert_eq!(parse_key(quoted.as_bytes(), 255).map(|k| k.0), Ok(key));
            }
        }
    }
}
