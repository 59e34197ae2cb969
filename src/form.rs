//! The meaning of an `application/x-www-form-urlencoded` body to the form parsers web frameworks
//! use, for a key derived from the body (`derive_key.include_body`, `fingerprint::derive_body_digest`).
//!
//! Werkzeug, Django, Starlette (python-multipart), Express, Node's querystring, Go's `ParseForm`
//! and Tomcat all read such a body as fields by name, each name's values in the order sent, and
//! all alike whatever the order of different names, `+` or `%20` for a space, a byte %-encoded
//! or not, the letter case of its hex digits, and empty pairs (`&&`, a leading or trailing `&`);
//! a pair without `=` is a name with an empty value (the boundary oracle, issue 41). The semantic
//! form is the list of decoded (name, value) pairs, stably sorted by name, framed: two bodies
//! those parsers read alike have one form. Where they disagree (a raw non-ASCII byte, which
//! Starlette reads as Latin-1 and the others as the byte its %-escape gives; a malformed escape,
//! which Python and Node keep literally and Go and Tomcat drop; a `;`), the bytes are read as the
//! majority reads them: two such bodies may then derive one key, and the fingerprint, kept to the
//! spelling, answers the second 422 rather than executing it (never one request executed twice).

/// The media type of a form (compared without parameters and letter case).
const FORM_TYPE: &[u8] = b"application/x-www-form-urlencoded";

/// Whether `content_type` (a `content-type` value) names a urlencoded form, whatever its
/// parameters (`; charset=utf-8`) and letter case.
pub fn is_form(content_type: &[u8]) -> bool {
    let media = content_type.split(|&b| b == b';').next().unwrap_or_default();
    media.trim_ascii().eq_ignore_ascii_case(FORM_TYPE)
}

/// Which reading of a form body a digest takes.
///
/// `Most`: the reading most of the panel's parsers give it, for a derived key
/// (`fingerprint::derive_body_digest`): a body they disagree on is read as the majority reads it,
/// different names' fields in any order, and two bodies so read alike derive one key; the
/// fingerprint keeps such a retry apart (422), so a broad key never answers a different request.
///
/// `Every`: the reading every parser of the panel gives it, for a fingerprint with
/// `fingerprint.forms: "semantic"`: two bodies with one `Every` form are one form to every backend
/// (the same fields, names and values, in the same order), since a replay answers the second with
/// the first's response. A body any parser reads otherwise, or that they disagree on, has no
/// `Every` form (its bytes count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reading {
    Most,
    Every,
}

/// The body's semantic form: each field as its name and value, each byte written as two letters
/// `a` to `p` (its nibbles: the order of bytes is kept) and each followed by `!`; with
/// `Reading::Most` fields stably sorted by name (a repeated name keeps its values' order), with
/// `Reading::Every` in the order sent. `None` with `Reading::Every` for a body the parsers
/// disagree on: a byte that is not printable ASCII (Starlette reads a raw non-ASCII byte as
/// Latin-1, the others as UTF-8; a raw space or control byte), a `;` (Go refuses it), a `%` not
/// followed by two hex digits (Python and Node keep it, Go and Tomcat drop the field).
/// (Strings sorted with the sort the query's form already uses, `path::one_target`: no second
/// sort in the module.)
pub fn semantic_form(body: &[u8], reading: Reading) -> Option<Vec<u8>> {
    let every_reads_alike = || {
        body.iter().enumerate().all(|(at, &b)| {
            b.is_ascii_graphic() && b != b';' && (b != b'%' || body.get(at..).and_then(crate::hex::escape).is_some())
        })
    };
    if reading == Reading::Every && !every_reads_alike() {
        return None;
    }
    let fields = body
        .split(|&b| b == b'&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let mut halves = pair.splitn(2, |&b| b == b'=');
            (decode(halves.next().unwrap_or_default()), decode(halves.next().unwrap_or_default()))
        })
        .collect();
    Some(fields_form(fields, reading))
}

/// Fields (name, value) as `semantic_form` writes them: `<name>!<value>!` in nibble letters,
/// stably sorted by name with `Reading::Most`, in their order with `Reading::Every`. Also a
/// multipart form's (`multipart::semantic_form`): one rule for both.
pub fn fields_form(fields: Vec<(Vec<u8>, Vec<u8>)>, reading: Reading) -> Vec<u8> {
    let mut bytes = 0;
    let mut keyed: Vec<String> = fields
        .iter()
        .enumerate()
        .map(|(at, (name, value))| {
            bytes += name.len() + value.len();
            let mut one = String::with_capacity(2 * (name.len() + value.len()) + 24);
            nibbles(name, &mut one);
            // The field's place, fixed-width, after its name: a stable sort by name.
            one.push_str(&format!("{at:020}!"));
            nibbles(value, &mut one);
            one
        })
        .collect();
    if reading == Reading::Most {
        keyed.sort_unstable();
    }
    let mut out = Vec::with_capacity(2 * bytes + 2 * keyed.len());
    for field in &keyed {
        // Without its place: `<name>!<value>!`.
        let (name, rest) = field.split_once('!').unwrap_or((field, ""));
        let name = name.get(..name.len().saturating_sub(20)).unwrap_or_default();
        out.extend_from_slice(name.as_bytes());
        out.push(b'!');
        out.extend_from_slice(rest.as_bytes());
        out.push(b'!');
    }
    out
}

/// Each byte of `bytes` as two letters `a` to `p`, high nibble first (order-preserving).
fn nibbles(bytes: &[u8], out: &mut String) {
    for &b in bytes {
        out.push(char::from(b'a' + (b >> 4)));
        out.push(char::from(b'a' + (b & 0x0f)));
    }
}

/// One name or value decoded: `+` a space, `%XX` (either case) its byte; a `%` not followed by
/// two hex digits stays as written.
fn decode(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while let Some(&b) = raw.get(i) {
        match (b, raw.get(i..).and_then(crate::hex::escape)) {
            (_, Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', None) => {
                out.push(b' ');
                i += 1;
            }
            (_, None) => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn same(a: &str, b: &str) -> bool {
        semantic_form(a.as_bytes(), Reading::Most) == semantic_form(b.as_bytes(), Reading::Most)
    }

    #[test]
    fn is_form_reads_the_media_type_without_parameters_or_case() {
        for t in [
            "application/x-www-form-urlencoded",
            "application/x-www-form-urlencoded; charset=utf-8",
            "Application/X-WWW-Form-URLEncoded",
            " application/x-www-form-urlencoded ;charset=UTF-8",
        ] {
            assert!(is_form(t.as_bytes()), "{t}");
        }
        for t in ["application/json", "text/plain", "multipart/form-data; boundary=x", "", "application/x-www-form"] {
            assert!(!is_form(t.as_bytes()), "{t}");
        }
    }

    #[test]
    fn spellings_every_form_parser_reads_alike_have_one_form() {
        let canonical = "amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y";
        for alike in [
            "currency=eur&amount=1&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y",
            "tag=x&memo=a+b%2Fcaf%C3%A9&tag=y&currency=eur&amount=1",
            "amount=1&currency=eur&memo=a%20b%2Fcaf%C3%A9&tag=x&tag=y",
            "%61mount=1&currency=%65%75%72&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y",
            "amount=1&currency=eur&memo=a+b%2fcaf%c3%a9&tag=x&tag=y",
            "amount=1&currency=eur&memo=a+b/caf%C3%A9&tag=x&tag=y",
            "amount=1&currency=eur&memo=a+b/caf\u{e9}&tag=x&tag=y",
            "&amount=1&&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y&&",
        ] {
            assert!(same(alike, canonical), "{alike}");
        }
        // A pair without `=` is a name with an empty value; an empty body has no field.
        assert!(same("a&b=1", "a=&b=1"));
        assert!(same("", "&&"));
    }

    #[test]
    fn what_a_form_parser_reads_apart_keeps_apart() {
        let canonical = "amount=1&tag=x&tag=y";
        for apart in [
            // A repeated name's values keep their order in every framework.
            "amount=1&tag=y&tag=x",
            // `%2B` is a plus sign, `+` a space.
            "amount=1%2B&tag=x&tag=y",
            "amount=1+&tag=x&tag=y",
            "amount=2&tag=x&tag=y",
            "amount=1&tag=x",
            "amount=1&tag=x&tag=y&tag=",
            "amount=1&tag=x&tag=y&tag",
            // `=` %-encoded is part of the name, not its end.
            "amount%3D1&tag=x&tag=y",
            // `&` %-encoded is part of the value.
            "amount=1%26tag%3Dx&tag=y",
            "Amount=1&tag=x&tag=y",
        ] {
            assert!(!same(apart, canonical), "{apart}");
        }
        // The framing keeps the boundary between a name and its value.
        assert!(!same("ab=c", "a=bc"));
        assert!(!same("a=1&b=2", "a=1%26b%3D2"));
    }

    fn every(a: &str) -> Option<Vec<u8>> {
        semantic_form(a.as_bytes(), Reading::Every)
    }

    /// What a fingerprint with `forms: "semantic"` may take as one request: only spellings every
    /// parser reads alike, in the order sent (issue 41's boundary oracle).
    #[test]
    fn the_every_reading_merges_only_what_every_parser_reads_alike() {
        let canonical = "amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y";
        let one = every(canonical).expect("taken");
        for alike in [
            "amount=1&currency=eur&memo=a%20b%2Fcaf%C3%A9&tag=x&tag=y",
            "%61mount=1&currency=%65%75%72&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y",
            "amount=1&currency=eur&memo=a+b%2fcaf%c3%a9&tag=x&tag=y",
            "amount=1&currency=eur&memo=a+b/caf%C3%A9&tag=x&tag=y",
            "&amount=1&&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y&&",
        ] {
            assert_eq!(every(alike), Some(one.clone()), "{alike}");
        }
        for apart in [
            // Fields keep the order sent: a handler iterating the form sees it.
            "currency=eur&amount=1&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y",
            "amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=y&tag=x",
            "amount=2&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y",
            "Amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y",
            "amount=1%2B&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y",
            "amount=1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x",
            "amount%3D1&currency=eur&memo=a+b%2Fcaf%C3%A9&tag=x&tag=y",
        ] {
            assert!(every(apart).is_some_and(|f| f != one), "{apart}");
        }
        assert_ne!(every("a=1&a=2"), every("a=2&a=1"));
        // Bytes the parsers read apart: no form, the bytes count.
        for refused in ["memo=caf\u{e9}", "a=1;b=2", "a=%zz", "a=%4", "a=b c", "a=\n", "a=1\t"] {
            assert_eq!(every(refused), None, "{refused:?}");
        }
        // The majority's reading of the same bodies is unchanged.
        assert!(semantic_form("memo=caf\u{e9}".as_bytes(), Reading::Most).is_some());
    }

    #[test]
    fn a_malformed_escape_stays_as_written() {
        assert!(same("a=%zz&b=%4", "a=%25zz&b=%254"));
        assert!(!same("a=%zz", "a=zz"));
        assert_eq!(decode(b"%"), b"%");
        assert_eq!(decode(b"%4"), b"%4");
        assert_eq!(decode(b"%41%4a%4A+"), b"AJJ ");
    }
}
