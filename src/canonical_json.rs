//! Canonical JSON for request-body fingerprints.
//!
//! Two bodies that differ only in insignificant whitespace or in the order of object members get
//! the same canonical form, so they get the same fingerprint. Nothing else is normalised: numbers
//! and strings are kept byte-for-byte as written (`1.0` and `1` stay different, as do `"é"` and
//! `"\u00e9"`), because the upstream may well tell them apart.
//!
//! The canonical form is the document with all whitespace between tokens removed and the members
//! of every object sorted by their decoded name, compared as UTF-8 bytes (which is code point
//! order). A body that is not exactly one valid JSON text (RFC 8259), that repeats a member name
//! in one object, or that nests deeper than [`MAX_DEPTH`] has no canonical form: the caller then
//! fingerprints the raw bytes.
//!
//! The parser is hand-written so that number and string spellings survive untouched. It recurses
//! at most [`MAX_DEPTH`] levels and reads each byte once, so any input runs in linear time
//! (sorting members aside) and bounded stack.

/// Maximum nesting depth accepted; deeper documents are not canonicalised.
pub const MAX_DEPTH: usize = 128;

/// Returns the canonical form of `body` if it is one valid JSON text (RFC 8259) with no duplicate
/// member names in any object and nesting at most MAX_DEPTH; otherwise None (the caller then
/// fingerprints the raw bytes).
pub fn canonicalize(body: &[u8]) -> Option<Vec<u8>> {
    parse(body, false).ok()
}

/// Why a body has no semantic form (`semantic_form`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoForm {
    /// Not one JSON text (RFC 8259), or nested deeper than [`MAX_DEPTH`].
    NotJson,
    /// One JSON text in which an object names a member twice (names compared decoded: `"a"` and
    /// `"\u0061"` are one name), at any depth. Python's `json`, `JSON.parse` and Go's
    /// `encoding/json` run the last value, pysimdjson's `Parser().parse` (simdjson's on-demand
    /// API) the first: there is no one meaning to derive a key from.
    RepeatedName,
    /// One JSON text but for a string that is not Unicode: a lone surrogate escape (`"\ud800"`)
    /// or bytes that are not UTF-8. Go's `encoding/json` reads each as U+FFFD (so does Node's
    /// UTF-8 decoding of the bytes), Python's `json` and `JSON.parse` keep the surrogate and
    /// Python refuses the bytes: `{"a":"\ud800"}`, `{"a":"\xff"}` and `{"a":"\ufffd"}` are one
    /// request to Go and two or three to others, so there is no one meaning to derive a key from.
    NotUnicode,
}

/// The value `body` means to the JSON parsers web frameworks use (Python's `json`, JavaScript's
/// `JSON.parse`, Go's `encoding/json`), as bytes: whitespace and member order dropped as in
/// [`canonicalize`], and also every string with its escapes decoded (`"\u0065ur"` is `"eur"`),
/// and every number by its exact decimal value (`1`, `1.0`, `1e0` and `10E-1` are `1e0`; `-0` is
/// `0`). Two bodies any of them parses alike have the same form; two bodies with one form may
/// still differ to a parser that keeps `1` and `1.0` apart (Python), which is why this form
/// derives keys (`derive_key.include_body`, where the fingerprint, with the spelling, still tells
/// them apart: 422) and never fingerprints. A member named twice in one object has no form
/// (`NoForm::RepeatedName`): parsers disagree on which value runs; nor has a string that is not
/// Unicode (`NoForm::NotUnicode`: a lone surrogate escape, bytes that are not UTF-8), which they
/// read as U+FFFD or keep or refuse. Not one JSON text: `NoForm::NotJson`. One leading UTF-8 byte-order mark is skipped, as Python's `json` and Node's
/// JSON body parsers skip it (Go's `encoding/json` refuses the body: no key is derived for a body
/// it runs).
pub fn semantic_form(body: &[u8]) -> Result<Vec<u8>, NoForm> {
    let body = body.strip_prefix(b"\xef\xbb\xbf").unwrap_or(body);
    match parse(body, true) {
        // Read as Go and Node read it (each bad sequence U+FFFD; outside strings U+FFFD is no
        // JSON): JSON so read has no one meaning, anything else is not JSON. `parse` refuses
        // bytes that are not UTF-8 before reading anything, so only those are read again.
        Err(NoForm::NotJson) if std::str::from_utf8(body).is_err() => {
            match parse(String::from_utf8_lossy(body).as_bytes(), true) {
                Err(NoForm::NotJson) => Err(NoForm::NotJson),
                _ => Err(NoForm::NotUnicode),
            }
        }
        read => read,
    }
}

fn parse(body: &[u8], semantic: bool) -> Result<Vec<u8>, NoForm> {
    // Outside strings the grammar only admits ASCII, so validating UTF-8 once up front covers the
    // bytes inside strings too.
    std::str::from_utf8(body).map_err(|_| NoForm::NotJson)?;
    let mut parser = Parser { src: body, pos: 0, semantic, repeated: false, not_unicode: false };
    let value = parser.value(0).ok_or(NoForm::NotJson)?;
    parser.skip_whitespace();
    if parser.pos != body.len() {
        return Err(NoForm::NotJson);
    }
    // Read to its end first: a repeated name in a body that is not JSON is not JSON.
    // Not Unicode first: read as U+FFFD, two lone surrogates may make a name repeated.
    if parser.not_unicode {
        return Err(NoForm::NotUnicode);
    }
    if parser.repeated {
        return Err(NoForm::RepeatedName);
    }
    let mut out = Vec::with_capacity(body.len());
    value.emit(&mut out, semantic);
    Ok(out)
}

/// A decoded string as a JSON string: only `"`, `\\` and control characters escaped.
fn quote(decoded: &[u8], out: &mut Vec<u8>) {
    out.push(b'"');
    for &b in decoded {
        match b {
            b'"' | b'\\' => out.extend_from_slice(&[b'\\', b]),
            0x00..=0x1f => {
                out.extend_from_slice(b"\\u00");
                out.extend_from_slice(&crate::hex::encode(&[b]).into_bytes());
            }
            _ => out.push(b),
        }
    }
    out.push(b'"');
}

/// A JSON number (valid by the grammar) as its exact decimal value: `0`, or an optional `-`, the
/// significant digits (no leading or trailing zero) and the power of ten (`1`, `1.0`, `1e0` and
/// `10E-1` are `1e0`; `-0` is `0`). Exact, with no floating point (which would cost the module
/// some 24 KB): numbers that differ only beyond a double's precision (JavaScript's reading) keep
/// two forms (docs/limitations.md). An exponent beyond i64 saturates.
fn number_form(raw: &[u8]) -> Option<Vec<u8>> {
    let (negative, rest) = match raw.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, raw),
    };
    let mantissa_end = rest.iter().position(|b| matches!(b, b'e' | b'E')).unwrap_or(rest.len());
    let (mantissa, exponent) = rest.split_at(mantissa_end);
    let mut exp: i64 = 0;
    if let Some((_, e)) = exponent.split_first() {
        let (minus, digits) = match e.split_first() {
            Some((b'-', d)) => (true, d),
            Some((b'+', d)) => (false, d),
            _ => (false, e),
        };
        for d in digits {
            exp = exp.saturating_mul(10).saturating_add(i64::from(d - b'0'));
        }
        if minus {
            exp = -exp;
        }
    }
    let mut digits: Vec<u8> = Vec::with_capacity(mantissa.len());
    let mut fraction = 0i64;
    let mut in_fraction = false;
    for &d in mantissa {
        if d == b'.' {
            in_fraction = true;
        } else {
            digits.push(d);
            fraction += i64::from(in_fraction);
        }
    }
    exp = exp.saturating_sub(fraction);
    let start = digits.iter().position(|&d| d != b'0').unwrap_or(digits.len());
    let end = digits.iter().rposition(|&d| d != b'0').map_or(start, |i| i + 1);
    if start >= end {
        return Some(b"0".to_vec());
    }
    exp = exp.saturating_add((digits.len() - end) as i64);
    let mut out = Vec::with_capacity(end - start + 24);
    if negative {
        out.push(b'-');
    }
    out.extend_from_slice(digits.get(start..end)?);
    out.push(b'e');
    out.extend_from_slice(exp.to_string().as_bytes());
    Some(out)
}

/// A parsed value. Scalars are the exact source bytes (strings with their quotes).
enum Value<'a> {
    Scalar(&'a [u8]),
    /// A scalar in its semantic form (`semantic_form`).
    Owned(Vec<u8>),
    Array(Vec<Value<'a>>),
    Object(Vec<Member<'a>>),
}

struct Member<'a> {
    /// The decoded name, as UTF-8: the sort key.
    name: Vec<u8>,
    /// The name as written, quotes and escapes included: what is emitted.
    raw_name: &'a [u8],
    value: Value<'a>,
}

impl Value<'_> {
    fn emit(&self, out: &mut Vec<u8>, semantic: bool) {
        match self {
            Value::Scalar(raw) => out.extend_from_slice(raw),
            Value::Owned(form) => out.extend_from_slice(form),
            Value::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    item.emit(out, semantic);
                }
                out.push(b']');
            }
            Value::Object(members) => {
                out.push(b'{');
                for (i, member) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    if semantic {
                        quote(&member.name, out);
                    } else {
                        out.extend_from_slice(member.raw_name);
                    }
                    out.push(b':');
                    member.value.emit(out, semantic);
                }
                out.push(b'}');
            }
        }
    }
}

struct Parser<'a> {
    src: &'a [u8],
    pos: usize,
    /// `semantic_form`: strings decoded, numbers by their decimal value.
    semantic: bool,
    /// An object named a member twice (`NoForm::RepeatedName`).
    repeated: bool,
    /// `semantic` only: a string held a lone surrogate escape, read on as U+FFFD
    /// (`NoForm::NotUnicode`); `canonicalize` refuses it at once.
    not_unicode: bool,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.src.get(self.pos).copied()
    }

    /// Consumes and returns the next byte.
    fn next(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.pos += 1;
        Some(byte)
    }

    /// Consumes `byte` if it comes next.
    fn eat(&mut self, byte: u8) -> bool {
        let found = self.peek() == Some(byte);
        if found {
            self.pos += 1;
        }
        found
    }

    fn skip_whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    /// The source bytes from `start` to the current position.
    fn since(&self, start: usize) -> Option<&'a [u8]> {
        self.src.get(start..self.pos)
    }

    /// Parses one value (after optional whitespace) inside `depth` enclosing containers.
    fn value(&mut self, depth: usize) -> Option<Value<'a>> {
        self.skip_whitespace();
        let start = self.pos;
        match self.peek()? {
            b'[' | b'{' if depth >= MAX_DEPTH => None,
            b'[' => self.array(depth + 1),
            b'{' => self.object(depth + 1),
            b'"' if self.semantic => {
                let mut decoded = Vec::new();
                self.string(Some(&mut decoded))?;
                let mut form = Vec::with_capacity(decoded.len() + 2);
                quote(&decoded, &mut form);
                Some(Value::Owned(form))
            }
            b'"' => {
                self.string(None)?;
                self.since(start).map(Value::Scalar)
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => {
                self.number()?;
                let raw = self.since(start)?;
                if self.semantic {
                    number_form(raw).map(Value::Owned)
                } else {
                    Some(Value::Scalar(raw))
                }
            }
            _ => None,
        }
    }

    fn literal(&mut self, word: &'static [u8]) -> Option<Value<'a>> {
        let end = self.pos.checked_add(word.len())?;
        if self.src.get(self.pos..end)? != word {
            return None;
        }
        self.pos = end;
        Some(Value::Scalar(word))
    }

    /// `[` has been seen; `depth` counts this array.
    fn array(&mut self, depth: usize) -> Option<Value<'a>> {
        self.pos += 1;
        let mut items = Vec::new();
        self.skip_whitespace();
        if self.eat(b']') {
            return Some(Value::Array(items));
        }
        loop {
            items.push(self.value(depth)?);
            self.skip_whitespace();
            match self.next()? {
                b',' => {}
                b']' => return Some(Value::Array(items)),
                _ => return None,
            }
        }
    }

    /// `{` has been seen; `depth` counts this object.
    fn object(&mut self, depth: usize) -> Option<Value<'a>> {
        self.pos += 1;
        let mut members = Vec::new();
        self.skip_whitespace();
        if !self.eat(b'}') {
            loop {
                self.skip_whitespace();
                if self.peek() != Some(b'"') {
                    return None;
                }
                let start = self.pos;
                let mut name = Vec::new();
                self.string(Some(&mut name))?;
                let raw_name = self.since(start)?;
                self.skip_whitespace();
                if !self.eat(b':') {
                    return None;
                }
                let value = self.value(depth)?;
                members.push(Member { name, raw_name, value });
                self.skip_whitespace();
                match self.next()? {
                    b',' => {}
                    b'}' => break,
                    _ => return None,
                }
            }
        }
        members.sort_by(|a, b| a.name.cmp(&b.name));
        // Decoded names: `"a"` and `"\u0061"` are one. Read on: the document may not be JSON.
        if members.windows(2).any(|w| matches!(w, [a, b] if a.name == b.name)) {
            self.repeated = true;
        }
        Some(Value::Object(members))
    }

    /// `"` has been seen. Validates the string and, if `decoded` is given, appends its decoded
    /// UTF-8 there. The input is already known to be valid UTF-8.
    fn string(&mut self, mut decoded: Option<&mut Vec<u8>>) -> Option<()> {
        self.pos += 1;
        loop {
            let byte = match self.next()? {
                b'"' => return Some(()),
                0x00..=0x1f => return None,
                b'\\' => {
                    let c = match self.next()? {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => self.unicode_escape()?,
                        _ => return None,
                    };
                    if let Some(out) = decoded.as_deref_mut() {
                        out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                    }
                    continue;
                }
                byte => byte,
            };
            if let Some(out) = decoded.as_deref_mut() {
                out.push(byte);
            }
        }
    }

    /// `\u` has been seen: four hex digits, or a surrogate pair written as two escapes.
    /// A lone surrogate is no JSON to `canonicalize`; to `semantic_form` it reads as U+FFFD
    /// (as Go does), the escape after it read on its own, and the text is `NoForm::NotUnicode`.
    fn unicode_escape(&mut self) -> Option<char> {
        let unit = self.hex4()?;
        let code = match unit {
            0xD800..=0xDBFF => {
                let after = self.pos;
                let low = if self.eat(b'\\') && self.eat(b'u') { self.hex4() } else { None };
                match low {
                    Some(low) if (0xDC00..=0xDFFF).contains(&low) => 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00),
                    _ => {
                        self.pos = after;
                        return self.lone_surrogate();
                    }
                }
            }
            0xDC00..=0xDFFF => return self.lone_surrogate(),
            _ => unit,
        };
        char::from_u32(code)
    }

    fn lone_surrogate(&mut self) -> Option<char> {
        if !self.semantic {
            return None;
        }
        self.not_unicode = true;
        Some(char::REPLACEMENT_CHARACTER)
    }

    fn hex4(&mut self) -> Option<u32> {
        let mut unit = 0;
        for _ in 0..4 {
            unit = unit * 16 + char::from(self.next()?).to_digit(16)?;
        }
        Some(unit)
    }

    /// `-? (0 | [1-9][0-9]*) (\.[0-9]+)? ([eE][+-]?[0-9]+)?`
    fn number(&mut self) -> Option<()> {
        self.eat(b'-');
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.eat(b'.') {
            self.one_or_more_digits()?;
        }
        if self.eat(b'e') || self.eat(b'E') {
            if !self.eat(b'+') {
                self.eat(b'-');
            }
            self.one_or_more_digits()?;
        }
        Some(())
    }

    fn digits(&mut self) {
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
    }

    fn one_or_more_digits(&mut self) -> Option<()> {
        let start = self.pos;
        self.digits();
        (self.pos > start).then_some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn canon(body: &str) -> Option<String> {
        canonicalize(body.as_bytes()).map(|out| String::from_utf8(out).expect("UTF-8 output"))
    }

    #[test]
    fn member_order_and_whitespace_do_not_change_canonical_form() {
        let expected = Some(r#"{"a":[1,{"x":null,"y":true}],"b":"s"}"#.to_owned());
        assert_eq!(canon(r#"{"a":[1,{"x":null,"y":true}],"b":"s"}"#), expected);
        assert_eq!(canon(" {\"b\" :\"s\",\r\n\t\"a\": [ 1 , {\"y\":true ,\"x\" : null} ] }\n"), expected);
    }

    #[test]
    fn arrays_keep_their_order() {
        assert_eq!(canon("[ 3, 1 ,2 ]"), Some("[3,1,2]".to_owned()));
        assert_ne!(canon("[1,2]"), canon("[2,1]"));
    }

    #[test]
    fn any_value_may_be_the_top_level() {
        for (input, expected) in [
            (" 42 ", "42"),
            ("\"s\"", "\"s\""),
            ("\ttrue\n", "true"),
            ("false", "false"),
            ("null", "null"),
            ("[]", "[]"),
            ("{ }", "{}"),
            ("[ [ ] , { } ]", "[[],{}]"),
        ] {
            assert_eq!(canon(input).as_deref(), Some(expected), "{input:?}");
        }
    }

    #[test]
    fn numbers_are_kept_exactly_as_written() {
        for n in ["0", "-0", "1.0", "1", "0.1", "0.10000000000000001", "9007199254740993", "1e2", "1E+02", "-1.5e-7"] {
            assert_eq!(canon(&format!("[ {n} ]")), Some(format!("[{n}]")), "{n}");
        }
        assert_ne!(canon("1.0"), canon("1"));
        assert_ne!(canon("0.1"), canon("0.10000000000000001"));
    }

    #[test]
    fn strings_are_kept_exactly_as_written() {
        for s in [
            r#""""#,
            r#""\u00e9""#,
            "\"\u{e9}\"",
            r#""\/\b\f\n\r\t\"\\""#,
            r#""\ud83d\ude00""#,
            r#""\uD83D\uDE00""#,
            "\"😀\"",
        ] {
            assert_eq!(canon(&format!(" {s} ")).as_deref(), Some(s), "{s}");
        }
        assert_ne!(canon(r#""\u00e9""#), canon("\"\u{e9}\""));
    }

    #[test]
    fn member_names_are_sorted_by_decoded_code_points_and_emitted_as_written() {
        // Decoded: "b" > "a"; U+FFFF < U+10000 in code point order (UTF-16 order would differ).
        assert_eq!(canon(r#"{"\u0062":1,"a":2}"#), Some(r#"{"a":2,"\u0062":1}"#.to_owned()));
        assert_eq!(
            canon("{\"\\ud800\\udc00\":1,\"\u{ffff}\":2,\"\":3,\"a\\u0000\":4,\"a\":5}"),
            Some("{\"\":3,\"a\":5,\"a\\u0000\":4,\"\u{ffff}\":2,\"\\ud800\\udc00\":1}".to_owned())
        );
    }

    #[test]
    fn duplicate_member_names_are_rejected_even_when_escaped() {
        for input in [
            r#"{"a":1,"a":2}"#,
            r#"{"a":1,"\u0061":2}"#,
            r#"{"\/":1,"/":2}"#,
            "{\"\\u00e9\":1,\"\u{e9}\":2}",
            r#"{"\ud83d\ude00":1,"😀":2}"#,
            r#"[{"ok":1},{"x":{"b":1,"b":1}}]"#,
        ] {
            assert_eq!(canon(input), None, "{input}");
        }
        assert!(canon(r#"[{"a":1},{"a":2}]"#).is_some(), "same name in different objects is fine");
    }

    #[test]
    fn the_semantic_form_is_what_json_parsers_read() {
        let form = |s: &str| semantic_form(s.as_bytes()).map(|f| String::from_utf8(f).unwrap_or_default());
        assert_eq!(
            form(r#"{ "b" : "\u0065\"\n" , "a":[1.0, -0, 1E2, 1.50, 1e400] }"#).as_deref(),
            Ok(r#"{"a":[1e0,0,1e2,15e-1,1e400],"b":"e\"\u000a"}"#)
        );
        assert_ne!(form(r#"{"a":"1"}"#), form(r#"{"a":1}"#));
        assert_eq!(form("{"), Err(NoForm::NotJson));
    }

    #[test]
    fn a_repeated_member_name_has_no_semantic_form_at_any_depth_escaped_or_not() {
        // Python's `json`, `JSON.parse` and Go run the last value, pysimdjson's
        // `Parser().parse` the first (measured: `{"a":1,"a":2}` reads `a` as 1), so a key derived
        // from either value lets one of them run `{"a":1,"a":2}` and `{"a":1}` as one request
        // under two keys. Before: the form of the last value, `{"a":2}`'s.
        for repeated in [
            r#"{"a":1,"a":2}"#,
            r#"{"a":1,"a":1}"#,
            r#"{"a":1,"\u0061":2}"#,
            r#"{"\u0061":1,"\u0061":2}"#,
            r#"{"\/":1,"/":2}"#,
            "{\"\\u00e9\":1,\"\u{e9}\":2}",
            r#"{"\ud83d\ude00":1,"😀":2}"#,
            r#"{"x":{"y":{"a":1,"b":0,"a":2}}}"#,
            r#"[{"ok":1},{"a":1,"a":2}]"#,
            r#"{"list":[[{"a":[]}],[{"a":1,"\u0061":1}]]}"#,
            "\u{feff}{\"a\":1,\"a\":2}",
        ] {
            let body = repeated.as_bytes();
            assert_eq!(semantic_form(body), Err(NoForm::RepeatedName), "{repeated}");
            assert_eq!(canonicalize(body), None, "{repeated}");
        }
        // One name in different objects is not repeated; nor are names that differ decoded.
        for alone in [r#"[{"a":1},{"a":2}]"#, r#"{"a":{"a":1}}"#, r#"{"a":1,"A":2}"#, r#"{"a":1,"a\u0000":2}"#] {
            assert!(semantic_form(alone.as_bytes()).is_ok(), "{alone}");
        }
        // Not JSON however it repeats a name: derived from the bytes, as any other such body.
        for not_json in [r#"{"a":1,"a":2}x"#, r#"{"a":1,"a":2"#, r#"[{"a":1,"a":2},]"#] {
            assert_eq!(semantic_form(not_json.as_bytes()), Err(NoForm::NotJson), "{not_json}");
        }
    }

    #[test]
    fn a_leading_bom_is_read_as_the_parsers_read_it() {
        // Python's `json` (Flask, Django, FastAPI), Express's and Fastify's JSON parsers skip a
        // UTF-8 byte-order mark and run the document behind it: a key derived from the body
        // (`include_body`) must be the one the document without it derives, or both execute
        // (the boundary oracle, `include_body`, `json: a BOM before the document`).
        let doc = br#"{"amount":1,"currency":"eur"}"#;
        let bom = [&b"\xef\xbb\xbf"[..], &doc[..]].concat();
        assert_eq!(semantic_form(&bom), semantic_form(doc));
        // The fingerprint keeps the spelling (422 for a retry that adds one), and one BOM only.
        assert_eq!(canonicalize(&bom), None);
        let two = [&b"\xef\xbb\xbf"[..], &bom[..]].concat();
        assert_eq!(semantic_form(&two), Err(NoForm::NotJson));
    }

    #[test]
    fn invalid_json_is_rejected() {
        let cases: &[&[u8]] = &[
            b"",
            b"   ",
            b"[1,]",
            b"{\"a\":1,}",
            b"[,1]",
            b"{,}",
            b"{'a':1}",
            b"'a'",
            b"NaN",
            b"Infinity",
            b"-Infinity",
            b"01",
            b"-01",
            b"1.",
            b".5",
            b"+1",
            b"-",
            b"1e",
            b"1e+",
            b"0x10",
            b"1.5.2",
            b"\"a\tb\"",
            b"\"a\nb\"",
            b"\"\x00\"",
            b"\"\\x41\"",
            b"\"\\u12\"",
            b"\"\\u12g4\"",
            b"\"\\U0041\"",
            b"\"\\'\"",
            b"\"\\ud800\"",
            b"\"\\udc00\"",
            b"\"\\ud800\\u0041\"",
            b"\"\\ud800\\ud800\"",
            b"\"\\ud800x\"",
            b"\"\xff\"",
            b"\"\xc3\"",
            b"\"\xed\xa0\x80\"",
            b"\xef\xbb\xbf{}",
            b"1 2",
            b"{} {}",
            b"[] x",
            b"[",
            b"{",
            b"[1",
            b"{\"a\":1",
            b"{\"a\"",
            b"{\"a\":}",
            b"{\"a\" 1}",
            b"{1:2}",
            b"[1 2]",
            b"\"unclosed",
            b"tru",
            b"True",
            b"nul",
            b"truex",
            b"]",
            b"}",
            b"\x0c1",
            b"1\x0b",
            b"/* c */ 1",
        ];
        for input in cases {
            assert_eq!(canonicalize(input), None, "{:?}", String::from_utf8_lossy(input));
        }
    }

    #[test]
    fn a_string_that_is_not_unicode_has_no_semantic_form() {
        // Go's `encoding/json` reads a lone surrogate escape and each byte that is not UTF-8 as
        // U+FFFD (measured: `{"a":"\ud800"}`, `{"a":"\xff"}` and `{"a":"\ufffd"}` all unmarshal
        // to `{"a":"\ufffd"}`; Node's UTF-8 decoding of the bytes too), Python's `json` and
        // `JSON.parse` keep the surrogate. Before: the first two derived from their bytes (not
        // JSON here), the third from its form: three keys for one request to Go.
        for unsound in [
            &br#"{"a":"\ud800"}"#[..],
            br#"{"a":"\udc00"}"#,
            br#"{"a":"\ud800\u0041"}"#,
            br#"{"a":"\ud800\ud800\udc00"}"#,
            br#"{"a":"\ud800x"}"#,
            br#"["\ud800\""]"#,
            b"{\"a\":\"\xff\"}",
            b"{\"a\":\"\xe2\x82\"}",
            b"{\"\xfe\":1}",
            b"\xef\xbb\xbf[\"\xed\xa0\x80\"]",
            // names that are one to Go (both U+FFFD) and two to Python: not unicode, and repeated
            br#"{"\ud800":1,"\udc00":2}"#,
        ] {
            let shown = String::from_utf8_lossy(unsound);
            assert_eq!(semantic_form(unsound), Err(NoForm::NotUnicode), "{shown}");
            assert_eq!(canonicalize(unsound), None, "{shown}");
        }
        // Not JSON however it is spelled: derived from the bytes as before.
        for not_json in [&b"\xff{}"[..], b"{\"a\":\xff}", br#"{"a":"\ud800\uZZZZ"}"#, br#"{"a":"\ud800"#] {
            assert_eq!(semantic_form(not_json), Err(NoForm::NotJson), "{}", String::from_utf8_lossy(not_json));
        }
        // A surrogate pair, in either hex case, is the character.
        assert_eq!(semantic_form(br#"["\uD83D\uDE00"]"#), semantic_form("[\"\u{1f600}\"]".as_bytes()));
    }

    #[test]
    fn nesting_deeper_than_max_depth_is_rejected() {
        let nest = |open: &str, close: &str, depth: usize| open.repeat(depth) + "0" + &close.repeat(depth);
        for (open, close) in [("[", "]"), ("{\"a\":", "}"), ("[{\"a\":", "}]")] {
            let max = MAX_DEPTH / close.len(); // `close` has one byte per container
            let ok = nest(open, close, max);
            assert_eq!(canon(&ok), Some(ok.clone()), "{open}");
            assert_eq!(canon(&nest(open, close, max + 1)), None, "{open}");
        }
    }

    #[test]
    fn a_megabyte_of_open_brackets_does_not_overflow() {
        let mib = 1 << 20;
        assert_eq!(canonicalize(&vec![b'['; mib]), None);
        assert_eq!(canonicalize(&b"{\"a\":".repeat(mib / 5)), None);
        let mut long_string = vec![b'"'; 1];
        long_string.extend(std::iter::repeat_n(b'a', mib));
        long_string.push(b'"');
        assert_eq!(canonicalize(&long_string), Some(long_string.clone()));
        let wide = format!("[{}1]", "1,".repeat(mib / 2));
        assert_eq!(canon(&wide).map(|s| s.len()), Some(wide.len()));
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod props {
        use super::super::*;
        use proptest::prelude::*;

        /// A generated JSON value with every scalar already spelled out.
        #[derive(Clone, Debug)]
        enum Json {
            Scalar(String),
            Array(Vec<Json>),
            /// Unique decoded names, each with its spelling.
            Object(Vec<(String, String, Json)>),
        }

        /// Spells `s` as a JSON string, either the usual way or entirely with `\u` escapes.
        fn spell(s: &str, escape_all: bool) -> String {
            if !escape_all {
                return serde_json::to_string(s).expect("a string serialises");
            }
            let mut out = String::from("\"");
            for unit in s.encode_utf16() {
                out += &format!("\\u{unit:04x}");
            }
            out + "\""
        }

        fn text() -> impl Strategy<Value = String> {
            prop_oneof!["[ab\"\\\\/\\x00\\x1f\u{7f}é\u{e000}\u{ffff}\u{10000}😀]{0,4}", "\\PC{0,8}"]
        }

        fn json() -> impl Strategy<Value = Json> {
            let leaf = prop_oneof![
                "-?(0|[1-9][0-9]{0,20})(\\.[0-9]{1,5})?([eE][+-]?[0-9]{1,3})?".prop_map(Json::Scalar),
                (text(), any::<bool>()).prop_map(|(s, esc)| Json::Scalar(spell(&s, esc))),
                prop_oneof![Just("true"), Just("false"), Just("null")].prop_map(|s| Json::Scalar(s.into())),
            ];
            leaf.prop_recursive(5, 64, 6, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..6).prop_map(Json::Array),
                    prop::collection::btree_map(text(), (any::<bool>(), inner), 0..6).prop_map(|members| {
                        Json::Object(members.into_iter().map(|(name, (esc, v))| (spell(&name, esc), name, v)).collect())
                    }),
                ]
            })
        }

        /// A small deterministic generator for whitespace and member order.
        struct Rng(u64);
        impl Rng {
            fn below(&mut self, n: usize) -> usize {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                (self.0 % n as u64) as usize
            }
            fn space(&mut self, out: &mut String) {
                for _ in 0..self.below(4) {
                    out.push([' ', '\t', '\n', '\r'][self.below(4)]);
                }
            }
        }

        fn space(rng: &mut Option<Rng>, out: &mut String) {
            if let Some(r) = rng {
                r.space(out);
            }
        }

        /// Writes `v` with random whitespace and member order, or (no `rng`) canonically.
        fn write(v: &Json, rng: &mut Option<Rng>, out: &mut String) {
            space(rng, out);
            match v {
                Json::Scalar(s) => *out += s,
                Json::Array(items) => {
                    out.push('[');
                    space(rng, out);
                    for (i, item) in items.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        write(item, rng, out);
                    }
                    out.push(']');
                }
                Json::Object(members) => {
                    let mut order: Vec<_> = members.iter().collect();
                    match rng {
                        Some(r) => (1..order.len()).rev().for_each(|i| order.swap(i, r.below(i + 1))),
                        None => order.sort_by(|a, b| a.1.cmp(&b.1)),
                    }
                    out.push('{');
                    for (i, (spelling, _, value)) in order.into_iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        space(rng, out);
                        *out += spelling;
                        space(rng, out);
                        out.push(':');
                        write(value, rng, out);
                    }
                    space(rng, out);
                    out.push('}');
                }
            }
            space(rng, out);
        }

        fn render(v: &Json, seed: Option<u64>) -> String {
            let mut out = String::new();
            write(v, &mut seed.map(|s| Rng(s | 1)), &mut out);
            out
        }

        /// Output, when there is one, is valid JSON (serde_json accepts duplicate names, so only
        /// this direction holds) and is its own canonical form.
        fn check_output(input: &[u8]) -> Result<(), TestCaseError> {
            if let Some(out) = canonicalize(input) {
                prop_assert!(serde_json::from_slice::<serde::de::IgnoredAny>(&out).is_ok());
                prop_assert_eq!(canonicalize(&out), Some(out));
            }
            Ok(())
        }

        const TOKENS: &[u8] = b"[]{}\",:\\0-e.u ";

        proptest! {
            #[test]
            fn canonicalize_is_idempotent(v in json(), seed: u64) {
                let out = canonicalize(render(&v, Some(seed)).as_bytes());
                prop_assert!(out.is_some());
                prop_assert_eq!(canonicalize(out.as_deref().unwrap_or_default()), out);
            }

            #[test]
            fn whitespace_and_member_order_give_the_same_canonical_form(v in json(), a: u64, b: u64) {
                let expected = render(&v, None).into_bytes();
                prop_assert_eq!(canonicalize(render(&v, Some(a)).as_bytes()), Some(expected.clone()));
                prop_assert_eq!(canonicalize(render(&v, Some(b)).as_bytes()), Some(expected));
            }

            #[test]
            fn arbitrary_bytes_never_panic(input: Vec<u8>) {
                check_output(&input)?;
            }

            #[test]
            fn mutated_json_never_panics(
                v in json(),
                seed: u64,
                edits in prop::collection::vec((any::<prop::sample::Index>(), 0u8..4, any::<u8>()), 1..4),
            ) {
                let mut input = render(&v, Some(seed)).into_bytes();
                for (at, op, byte) in edits {
                    let i = at.index(input.len() + 1);
                    match op {
                        0 => input.insert(i, byte),
                        1 => input.insert(i, TOKENS[usize::from(byte) % TOKENS.len()]),
                        2 if i < input.len() => { input.remove(i); }
                        3 => input.truncate(i),
                        _ => {}
                    }
                }
                check_output(&input)?;
            }

            #[test]
            fn output_is_valid_json_with_the_same_meaning(v in json(), seed: u64) {
                let input = render(&v, Some(seed));
                let out = canonicalize(input.as_bytes());
                prop_assert!(out.is_some());
                check_output(input.as_bytes())?;
                // Numbers beyond f64 range are valid JSON that serde_json refuses to load.
                if let Ok(meaning) = serde_json::from_str::<serde_json::Value>(&input) {
                    let out = out.unwrap_or_default();
                    prop_assert_eq!(serde_json::from_slice::<serde_json::Value>(&out).ok(), Some(meaning));
                }
            }
        }
    }
}
