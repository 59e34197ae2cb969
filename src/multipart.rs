//! The meaning of a `multipart/form-data` body to the multipart parsers web frameworks use, for a
//! key derived from the body (`derive_key.include_body`, `fingerprint::derive_body_digest`).
//!
//! Werkzeug (Flask), Django, python-multipart (Starlette), busboy (Express's multer, Fastify's
//! @fastify/multipart), Go's `ParseMultipartForm` and Tomcat read such a body as text fields by
//! name, each name's values in the order sent, and files by field name, file name and content:
//! all alike whatever the boundary string (and whether the content type quotes it), the order of
//! different names, the letter case of a part's header names, of `form-data` and of the
//! content type, a space after `:` or `;`, a parameter quoted or not, the order of
//! `name` and `filename`, a part's other headers (`Content-Type`), a preamble before the first
//! boundary, an epilogue after the last, and the line end after it (the boundary oracle, issue 41).
//! Where they disagree (transport padding after a boundary: Werkzeug, Django and Go read it
//! alike, busboy and Tomcat apart, Starlette refuses; bare LF line ends: Werkzeug and Go read
//! them as CRLF, Django apart, the others refuse; a preamble, which Starlette refuses), the body
//! is read as the readers that take it read it: two such bodies then derive one key, and the
//! fingerprint, kept to the bytes, answers the second 422 rather than executing it.
//!
//! The semantic form (`Reading::Most`, for a derived key) is `form::fields_form` of the text fields (the same form a urlencoded body
//! with those fields has), then, when there are files, `|` and `form::fields_form` of the files
//! (each its name, and its file name framed before its content). A body this strict reader does
//! not take (`semantic_form` is `None`: a folded or malformed header, a
//! quoted parameter with a backslash, a `Content-Transfer-Encoding`, an RFC 2231 value not in
//! UTF-8 or `name*` beside `name` (`read_disposition`), a part
//! with no name, no closing boundary) derives from its bytes, like any body that is not a form:
//! two such spellings stay two keys, and where a backend reads them alike a retry so spelled
//! executes again (the limits docs/limitations.md lists; none is among the oracle's spellings
//! that a backend reads as the canonical body). Work is linear in the
//! body (each byte is looked at a bounded number of times; the boundary is at most 70 bytes) and
//! nothing is sized from a count read from it.

use std::borrow::Cow;

use crate::form::Reading;

/// A part's name or file name: as sent, or decoded from RFC 2231 (`ext_value`).
type Name<'b> = Cow<'b, [u8]>;

/// The media type of a multipart form (compared without parameters and letter case).
const MULTIPART_TYPE: &[u8] = b"multipart/form-data";

/// The boundary `content_type` (a `content-type` value) names when it is `multipart/form-data`
/// (whatever its letter case): its one `boundary` parameter (name in any case), quoted or not,
/// 1 to 70 bytes of RFC 2046's boundary characters. `None` otherwise.
pub fn boundary(content_type: &[u8]) -> Option<&[u8]> {
    let mut params = content_type.split(|&b| b == b';');
    if !params.next()?.trim_ascii().eq_ignore_ascii_case(MULTIPART_TYPE) {
        return None;
    }
    let mut found = None;
    for param in params {
        let mut halves = param.trim_ascii().splitn(2, |&b| b == b'=');
        let (name, value) = (halves.next()?, halves.next());
        if !name.eq_ignore_ascii_case(b"boundary") {
            continue;
        }
        let value = value?;
        let value = match value.strip_prefix(b"\"") {
            Some(quoted) => quoted.strip_suffix(b"\"")?,
            None => value,
        };
        let usable = (1..=70).contains(&value.len())
            && value.iter().all(|&b| b.is_ascii_alphanumeric() || b"'()+_,-./:=? ".contains(&b))
            && value.last() != Some(&b' ');
        if found.is_some() || !usable {
            return None;
        }
        found = Some(value);
    }
    found
}

/// One part as read: its field name, its file name (a file) or none (a text field), its content
/// type (only read with `Reading::Every`), its content.
struct Part<'b> {
    name: Name<'b>,
    filename: Option<Name<'b>>,
    content_type: Option<&'b [u8]>,
    content: &'b [u8],
}

/// The body's semantic form (module comment), or `None` when this reader does not take it.
///
/// With `Reading::Every` (a fingerprint with `fingerprint.forms: "semantic"`) only what every
/// parser of the panel reads alike is read: every line end a CRLF, no preamble, no transport
/// padding, nothing after the closing delimiter but one CRLF, no part header but
/// `Content-Disposition` and one `Content-Type`, no disposition parameter but `name` and
/// `filename`, an unquoted one a token (letters, digits, `-`, `_`, `.`). The form is then every
/// part in the order sent (`form::fields_form` with `Reading::Every`), each its name and, framed,
/// whether it is a file, its file name, its `Content-Type` as sent (a handler reads it: Werkzeug,
/// busboy and Tomcat decode a text part by its charset) and its content.
pub fn semantic_form(body: &[u8], boundary: &[u8], reading: Reading) -> Option<Vec<u8>> {
    let every = reading == Reading::Every;
    // A line ends with LF, a CR before it dropped: Werkzeug and Go read bare LF line ends as
    // CRLF ones (the others refuse such a body or read it apart: docs/limitations.md).
    let mut dash = Vec::with_capacity(boundary.len() + 3);
    dash.extend_from_slice(b"\n--");
    dash.extend_from_slice(boundary);
    // The first delimiter: at the body's start, or after a preamble's line end.
    let mut at = match body.strip_prefix(dash.get(1..)?) {
        Some(_) => dash.len() - 1,
        None if every => return None,
        None => find(body, &dash)? + dash.len(),
    };
    let (mut fields, mut files) = (Vec::new(), Vec::new());
    loop {
        let rest = body.get(at..)?;
        if let Some(epilogue) = rest.strip_prefix(b"--") {
            // The closing delimiter: an epilogue after it is not read.
            if every && !epilogue.is_empty() && epilogue != b"\r\n" {
                return None;
            }
            break;
        }
        // Transport padding, then the delimiter line's end.
        let pad = rest.iter().take_while(|&&b| b == b' ' || b == b'\t').count();
        let rest = rest.get(pad..)?;
        let lf = rest.strip_prefix(b"\r");
        if every && (pad > 0 || lf.is_none()) {
            return None;
        }
        let rest = lf.unwrap_or(rest).strip_prefix(b"\n")?;
        let end = find(rest, &dash)?;
        let raw = rest.get(..end)?;
        if every && !raw.ends_with(b"\r") {
            return None;
        }
        let part = read_part(cr_dropped(raw), reading)?;
        at = body.len() - rest.len() + end + dash.len();
        match (part.filename.as_deref(), every) {
            (None, false) => fields.push((part.name.to_vec(), part.content.to_vec())),
            (Some(filename), false) => {
                // The file name framed (`<length>:`) before the content: no shifted split.
                let mut value = format!("{}:", filename.len()).into_bytes();
                value.extend_from_slice(filename);
                value.extend_from_slice(part.content);
                files.push((part.name.to_vec(), value));
            }
            (filename, true) => {
                // `f` and the file name or `t`, then the content type or `-`, each framed.
                let mut value = Vec::with_capacity(part.content.len() + 48);
                for (mark, v) in [(b'f', filename), (b'c', part.content_type)] {
                    match v {
                        Some(v) => {
                            value.push(mark);
                            value.extend_from_slice(format!("{}:", v.len()).as_bytes());
                            value.extend_from_slice(v);
                        }
                        None => value.push(b'-'),
                    }
                }
                value.extend_from_slice(part.content);
                fields.push((part.name.to_vec(), value));
            }
        }
    }
    let mut out = crate::form::fields_form(fields, reading);
    if !files.is_empty() {
        out.push(b'|');
        out.extend_from_slice(&crate::form::fields_form(files, reading));
    }
    Some(out)
}

/// `content_type` (one `multipart/form-data` value that `boundary` reads) with its boundary's
/// value left out, as a fingerprint that reads the body by `semantic_form` hashes it: the
/// boundary is a random string each client build of one form chooses anew. Everything else
/// (letter case, quotes, other parameters) stays as sent.
pub fn without_boundary(content_type: &[u8]) -> Option<Vec<u8>> {
    let value = boundary(content_type)?;
    let start = (value.as_ptr() as usize).checked_sub(content_type.as_ptr() as usize)?;
    let mut out = content_type.get(..start)?.to_vec();
    out.extend_from_slice(content_type.get(start + value.len()..)?);
    Some(out)
}

/// A part (its headers, an empty line, its content): `None` for what this reader does not take.
fn read_part(part: &[u8], reading: Reading) -> Option<Part<'_>> {
    let every = reading == Reading::Every;
    let mut rest = part;
    let (mut disposition, mut content_type) = (None, None);
    loop {
        let end = rest.iter().position(|&b| b == b'\n')?;
        let raw = rest.get(..end)?;
        if every && !raw.ends_with(b"\r") {
            return None;
        }
        let line = cr_dropped(raw);
        rest = rest.get(end + 1..)?;
        if line.is_empty() {
            break;
        }
        let colon = line.iter().position(|&b| b == b':')?;
        let (name, value) = (line.get(..colon)?, line.get(colon + 1..)?.trim_ascii());
        // A folded line (leading whitespace), a name with spaces, a CR inside: not taken.
        if name.is_empty() || !name.iter().all(|&b| b.is_ascii_graphic()) || value.contains(&b'\r') {
            return None;
        }
        if name.eq_ignore_ascii_case(b"content-disposition") {
            if disposition.is_some() {
                return None;
            }
            disposition = Some(value);
        } else if name.eq_ignore_ascii_case(b"content-transfer-encoding") {
            // python-multipart decodes base64 and quoted-printable, the others do not.
            return None;
        } else if every && (!name.eq_ignore_ascii_case(b"content-type") || content_type.replace(value).is_some()) {
            return None;
        }
    }
    let (name, filename) = read_disposition(disposition?, reading)?;
    Some(Part { name, filename, content_type, content: rest })
}

/// `form-data` (any case) and its `name` and `filename` parameters (names in any case, values
/// quoted without a backslash or as tokens, each at most once; other parameters ignored, or
/// refused with `Reading::Every`, which takes only letters, digits, `-`, `_` and `.` unquoted).
///
/// With `Reading::Most`, RFC 2231's `name*` and `filename*` (`UTF-8''` and %-escapes,
/// `ext_value`) are read as the UTF-8 name they spell, as Werkzeug, Django, busboy (Fastify), Go
/// and Tomcat read them (measured by the boundary oracle, issue 41: the key derived from the
/// bytes executed such a retry twice on those five): a lone `name*` as the name (`name` and
/// `name*` together: not taken, not measured), and `filename*` before `filename` when both are
/// sent (Werkzeug, Django, Go, Tomcat and multer; Starlette and busboy read `filename`: a retry
/// spelled so against those meets the fingerprint, 422). `Reading::Every` takes neither.
fn read_disposition(value: &[u8], reading: Reading) -> Option<(Name<'_>, Option<Name<'_>>)> {
    let every = reading == Reading::Every;
    let kind_end = value.iter().position(|&b| b == b';').unwrap_or(value.len());
    if !value.get(..kind_end)?.trim_ascii().eq_ignore_ascii_case(b"form-data") {
        return None;
    }
    let (mut name, mut filename) = (None, None);
    let (mut name_ext, mut filename_ext) = (None, None);
    let mut rest = value.get(kind_end..)?;
    while let Some(after) = rest.strip_prefix(b";") {
        let after = after.trim_ascii_start();
        let eq = after.iter().position(|&b| b == b'=')?;
        let param = after.get(..eq)?;
        let tail = after.get(eq + 1..)?;
        let (v, next) = match tail.strip_prefix(b"\"") {
            Some(quoted) => {
                let close = quoted.iter().position(|&b| b == b'"')?;
                (quoted.get(..close)?, quoted.get(close + 1..)?)
            }
            None => {
                let stop = tail.iter().position(|&b| b == b';' || b == b' ' || b == b'\t').unwrap_or(tail.len());
                let token = tail.get(..stop)?;
                if every && !token.iter().all(|&b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
                    return None;
                }
                (token, tail.get(stop..)?)
            }
        };
        if v.contains(&b'\\') {
            return None;
        }
        if let Some(base) = param.strip_suffix(b"*") {
            // An RFC 2231 value is a token, never quoted.
            let quoted = tail.first() == Some(&b'"');
            let slot = if base.eq_ignore_ascii_case(b"name") {
                &mut name_ext
            } else if base.eq_ignore_ascii_case(b"filename") {
                &mut filename_ext
            } else {
                return None;
            };
            if every || quoted || slot.replace(ext_value(v)?).is_some() {
                return None;
            }
            rest = next.trim_ascii_start();
            continue;
        }
        if param.contains(&b'*') {
            return None;
        }
        let slot = if param.eq_ignore_ascii_case(b"name") {
            &mut name
        } else if param.eq_ignore_ascii_case(b"filename") {
            &mut filename
        } else if every {
            return None;
        } else {
            rest = next.trim_ascii_start();
            continue;
        };
        if slot.replace(v).is_some() {
            return None;
        }
        rest = next.trim_ascii_start();
    }
    if !rest.is_empty() {
        return None;
    }
    let name = match (name, name_ext) {
        (Some(n), None) => Cow::Borrowed(n),
        (None, Some(n)) => Cow::Owned(n),
        _ => return None,
    };
    Some((name, filename_ext.map(Cow::Owned).or(filename.map(Cow::Borrowed))))
}

/// An RFC 2231 / RFC 8187 `ext-value` in UTF-8 (`UTF-8'<language>'<attr-chars and %-escapes>`,
/// the charset in any case) as the bytes it spells, if they are UTF-8; `None` for another
/// charset, a byte outside `attr-char`, or a malformed escape.
fn ext_value(v: &[u8]) -> Option<Vec<u8>> {
    let mut parts = v.splitn(3, |&b| b == b'\'');
    let (charset, _language, encoded) = (parts.next()?, parts.next()?, parts.next()?);
    if !charset.eq_ignore_ascii_case(b"utf-8") {
        return None;
    }
    let mut out = Vec::with_capacity(encoded.len());
    let mut at = 0;
    while let Some(&b) = encoded.get(at) {
        if b == b'%' {
            out.push(crate::hex::escape(encoded.get(at..)?)?);
            at += 3;
        } else if b.is_ascii_alphanumeric() || b"!#$&+-.^_`|~".contains(&b) {
            out.push(b);
            at += 1;
        } else {
            return None;
        }
    }
    std::str::from_utf8(&out).ok()?;
    Some(out)
}

/// `bytes` without one CR at its end (the CR of a CRLF line end).
fn cr_dropped(bytes: &[u8]) -> &[u8] {
    bytes.strip_suffix(b"\r").unwrap_or(bytes)
}

/// Where `needle` first starts in `hay`: bounded by `hay`'s length times the needle's (at most
/// 73 bytes: `\n--` and a boundary).
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const B: &str = "----idemgate7MA4YWxkTrZu0gW";

    /// The oracle's canonical body (tests/it/boundary_oracle.rs, `multipart_body`).
    fn canonical(boundary: &str) -> String {
        let mut b = String::new();
        for (name, value) in [("amount", "1"), ("currency", "eur"), ("tag", "x"), ("tag", "y")] {
            b.push_str(&format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"));
        }
        b.push_str(&format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"doc\"; filename=\"a.txt\"\r\nContent-Type: text/plain\r\n\r\nhello\r\n--{boundary}--\r\n"
        ));
        b
    }

    fn form(content_type: &str, body: &str) -> Option<Vec<u8>> {
        semantic_form(body.as_bytes(), boundary(content_type.as_bytes())?, Reading::Most)
    }

    fn every(content_type: &str, body: &str) -> Option<Vec<u8>> {
        semantic_form(body.as_bytes(), boundary(content_type.as_bytes())?, Reading::Every)
    }

    fn ct(boundary: &str) -> String {
        format!("multipart/form-data; boundary={boundary}")
    }

    #[test]
    fn boundary_reads_the_parameter_in_any_case_quoted_or_not() {
        assert_eq!(boundary(b"multipart/form-data; boundary=abc"), Some(&b"abc"[..]));
        assert_eq!(boundary(b"Multipart/Form-Data; Boundary=\"a b:c\""), Some(&b"a b:c"[..]));
        assert_eq!(boundary(b"multipart/form-data;charset=utf-8;boundary=x"), Some(&b"x"[..]));
        for refused in [
            "multipart/form-data",
            "multipart/form-data; boundary=",
            "multipart/form-data; boundary=a; boundary=b",
            "multipart/form-data; boundary=\"abc",
            "multipart/form-data; boundary=a{b",
            "multipart/mixed; boundary=abc",
            "application/x-www-form-urlencoded",
            "",
        ] {
            assert_eq!(boundary(refused.as_bytes()), None, "{refused}");
        }
        let long = "b".repeat(71);
        assert_eq!(boundary(ct(&long).as_bytes()), None);
        assert!(boundary(ct(&long[1..]).as_bytes()).is_some());
    }

    #[test]
    fn spellings_every_multipart_parser_reads_alike_have_one_form() {
        let c = canonical(B);
        let one = form(&ct(B), &c).expect("the canonical body is read");
        let alike: Vec<(String, String)> = vec![
            (ct("XyZzy42"), canonical("XyZzy42")),
            (format!("multipart/form-data; boundary=\"{B}\""), c.clone()),
            (format!("Multipart/Form-Data; Boundary={B}"), c.clone()),
            (ct(B), {
                // `amount` last.
                let first = c.find(&format!("--{B}\r\nContent-Disposition: form-data; name=\"currency\"")).unwrap();
                let close = c.rfind(&format!("--{B}--")).unwrap();
                format!("{}{}{}", &c[first..close], &c[..first], &c[close..])
            }),
            (ct(B), c.replace("Content-Disposition:", "content-disposition:")),
            (ct(B), c.replace("Content-Disposition: ", "Content-Disposition:")),
            (ct(B), c.replace(": form-data;", ": Form-Data;")),
            (ct(B), c.replace("name=\"amount\"", "name=amount")),
            (ct(B), c.replace("name=\"amount\"", "Name=\"amount\"")),
            (ct(B), c.replace("; name=\"amount\"", ";name=\"amount\"")),
            (ct(B), c.replace("name=\"doc\"; filename=\"a.txt\"", "filename=\"a.txt\"; name=\"doc\"")),
            (ct(B), c.replace("Content-Type: text/plain\r\n", "")),
            (ct(B), c.replace("name=\"currency\"\r\n", "name=\"currency\"\r\nContent-Type: text/plain\r\n")),
            (ct(B), format!("preamble\r\n{c}")),
            (ct(B), format!("{c}epilogue\r\n")),
            (ct(B), c.trim_end_matches("\r\n").to_string()),
            (ct(B), c.replace(&format!("--{B}\r\n"), &format!("--{B}  \r\n"))),
            (ct(B), c.replace("\r\n", "\n")),
            // RFC 2231 (issue 41's oracle: Werkzeug, Django, busboy, Go and Tomcat).
            (ct(B), c.replace("name=\"amount\"", "name*=utf-8''amount")),
            (ct(B), c.replace("name=\"amount\"", "name*=UTF-8'en'%61mount")),
            (ct(B), c.replace("filename=\"a.txt\"", "filename*=UTF-8''a.txt")),
            (ct(B), c.replace("filename=\"a.txt\"", "filename=\"b.txt\"; filename*=UTF-8''a.txt")),
        ];
        for (t, body) in &alike {
            assert_eq!(form(t, body).as_ref(), Some(&one), "{t}\n{body}");
        }
        // A non-ASCII name as RFC 7578 sends it (UTF-8 as is) and as RFC 2231 spells it.
        let raw = c
            .replace("name=\"currency\"", "name=\"w\u{e4}hrung\"")
            .replace("filename=\"a.txt\"", "filename=\"caf\u{e9}.txt\"");
        let ext = c
            .replace("name=\"currency\"", "name*=UTF-8''w%C3%A4hrung")
            .replace("filename=\"a.txt\"", "filename*=UTF-8''caf%C3%A9.txt");
        assert_eq!(form(&ct(B), &raw), form(&ct(B), &ext));
        assert_ne!(form(&ct(B), &raw), Some(one.clone()));
        // A multipart form with no file is the urlencoded form of its fields.
        let text = format!(
            "--{B}\r\nContent-Disposition: form-data; name=\"b\"\r\n\r\n2\r\n--{B}\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n--{B}--"
        );
        assert_eq!(form(&ct(B), &text), crate::form::semantic_form(b"a=1&b=2", Reading::Most));
    }

    #[test]
    fn what_a_multipart_parser_reads_apart_keeps_apart() {
        let c = canonical(B);
        let one = form(&ct(B), &c).expect("the canonical body is read");
        for apart in [
            // A repeated name's values keep their order.
            c.replacen("\r\n\r\nx\r\n", "\r\n\r\nY\r\n", 1).replacen("\r\n\r\ny\r\n", "\r\n\r\nx\r\n", 1).replacen(
                "\r\n\r\nY\r\n",
                "\r\n\r\ny\r\n",
                1,
            ),
            c.replace("filename=\"a.txt\"", "filename=\"b.txt\""),
            c.replace("\r\n\r\nhello\r\n", "\r\n\r\nhello!\r\n"),
            c.replace("\r\n\r\n1\r\n", "\r\n\r\n2\r\n"),
            c.replace("\r\n\r\n1\r\n", "\r\n\r\n1 \r\n"),
            // A file is not a text field of the same name and content.
            c.replace("; filename=\"a.txt\"", ""),
            c.replace("filename=\"a.txt\"", "filename=\"\""),
            c.replace("name=\"amount\"", "name=\"Amount\""),
        ] {
            let other = form(&ct(B), &apart);
            assert!(other.is_some(), "{apart}");
            assert_ne!(other, Some(one.clone()), "{apart}");
        }
        // The framing keeps a file name apart from its content.
        let file = |name: &str, content: &str| {
            format!(
                "--{B}\r\nContent-Disposition: form-data; name=\"f\"; filename=\"{name}\"\r\n\r\n{content}\r\n--{B}--"
            )
        };
        assert_ne!(form(&ct(B), &file("a", "bc")), form(&ct(B), &file("ab", "c")));
    }

    #[test]
    fn what_this_reader_does_not_take_derives_from_the_bytes() {
        let c = canonical(B);
        for refused in [
            c.replace(&format!("--{B}--\r\n"), ""),
            c.replace("name=\"amount\"", "name=\"am\\\"ount\""),
            // RFC 2231 values this reader does not take: with `name` too, another charset, quoted,
            // a byte outside attr-char, a malformed escape, not UTF-8, twice, another parameter.
            c.replace("name=\"amount\"", "name=\"amount\"; name*=utf-8''amount"),
            c.replace("name=\"amount\"", "name*=iso-8859-1''amount"),
            c.replace("name=\"amount\"", "name*=\"utf-8''amount\""),
            c.replace("name=\"amount\"", "name*=utf-8''am/ount"),
            c.replace("name=\"amount\"", "name*=utf-8''am%6ount"),
            c.replace("name=\"amount\"", "name*=utf-8''am%FFount"),
            c.replace("name=\"amount\"", "name*=utf-8''amount; name*=utf-8''amount"),
            c.replace("name=\"amount\"", "name=\"amount\"; size*=utf-8''1"),
            c.replace("name=\"amount\"", "name*0=amount"),
            c.replace("name=\"amount\"", "name=\"amount\"; name=\"x\""),
            c.replace("name=\"amount\"", "filename=\"x\""),
            c.replace("form-data; name=\"amount\"", "attachment; name=\"amount\""),
            c.replace("name=\"currency\"\r\n", "name=\"currency\"\r\nContent-Transfer-Encoding: base64\r\n"),
            c.replace("name=\"currency\"\r\n", "name=\"currency\"\r\n folded\r\n"),
            c.replace(
                &format!("--{B}\r\nContent-Disposition: form-data; name=\"currency\""),
                &format!("--{B}x\r\nContent-Disposition: form-data; name=\"currency\""),
            ),
            String::new(),
            "no boundary here".into(),
        ] {
            assert_eq!(form(&ct(B), &refused), None, "{refused}");
        }
    }

    /// What a fingerprint with `forms: "semantic"` may take as one request (issue 41): another
    /// boundary and spellings of a part's headers every parser reads alike, never two parts'
    /// values, order, file names or content types, and no body the parsers disagree on.
    #[test]
    fn the_every_reading_merges_only_what_every_parser_reads_alike() {
        let c = canonical(B);
        let one = every(&ct(B), &c).expect("the canonical body is read");
        for (t, body) in [
            (ct("XyZzy42"), canonical("XyZzy42")),
            (ct(B), c.replace("Content-Disposition:", "content-disposition:")),
            (ct(B), c.replace("Content-Type:", "CONTENT-TYPE:")),
            (ct(B), c.replace("Content-Disposition: ", "Content-Disposition:")),
            (ct(B), c.replace(": form-data;", ": Form-Data;")),
            (ct(B), c.replace("name=\"amount\"", "name=amount")),
            (ct(B), c.replace("name=\"amount\"", "Name=\"amount\"")),
            (ct(B), c.replace("; name=\"amount\"", ";name=\"amount\"")),
            (ct(B), c.replace("name=\"doc\"; filename=\"a.txt\"", "filename=\"a.txt\"; name=\"doc\"")),
            (ct(B), c.trim_end_matches("\r\n").to_string()),
        ] {
            assert_eq!(every(&t, &body).as_ref(), Some(&one), "{t}\n{body}");
        }
        let amount_last = {
            let first = c.find(&format!("--{B}\r\nContent-Disposition: form-data; name=\"currency\"")).unwrap();
            let close = c.rfind(&format!("--{B}--")).unwrap();
            format!("{}{}{}", &c[first..close], &c[..first], &c[close..])
        };
        for apart in [
            amount_last,
            c.replacen("\r\n\r\nx\r\n", "\r\n\r\nY\r\n", 1).replacen("\r\n\r\ny\r\n", "\r\n\r\nx\r\n", 1).replacen(
                "\r\n\r\nY\r\n",
                "\r\n\r\ny\r\n",
                1,
            ),
            c.replace("\r\n\r\n1\r\n", "\r\n\r\n2\r\n"),
            c.replace("name=\"amount\"", "name=\"Amount\""),
            c.replace("filename=\"a.txt\"", "filename=\"b.txt\""),
            c.replace("filename=\"a.txt\"", "filename=\"\""),
            c.replace("; filename=\"a.txt\"", ""),
            // A part's content type is read by the handler (a file's) or decodes it (a text's).
            c.replace("Content-Type: text/plain", "Content-Type: application/octet-stream"),
            c.replace("Content-Type: text/plain\r\n", ""),
            c.replace("name=\"currency\"\r\n", "name=\"currency\"\r\nContent-Type: text/plain\r\n"),
            c.replace("name=\"currency\"\r\n", "name=\"currency\"\r\nContent-Type: text/plain; charset=iso-8859-1\r\n"),
        ] {
            let other = every(&ct(B), &apart);
            assert!(other.is_some(), "{apart}");
            assert_ne!(other, Some(one.clone()), "{apart}");
        }
        // Spellings some parser reads apart or refuses: no form, the bytes count.
        for refused in [
            format!("preamble\r\n{c}"),
            format!("{c}epilogue\r\n"),
            c.replace(&format!("--{B}\r\n"), &format!("--{B}  \r\n")),
            c.replace("\r\n", "\n"),
            c.replacen("name=\"amount\"\r\n", "name=\"amount\"\n", 1),
            c.replacen("\r\n\r\n1\r\n", "\r\n\r\n1\n", 1),
            c.replace("name=\"currency\"\r\n", "name=\"currency\"\r\nX-Note: a\r\n"),
            c.replace("name=\"currency\"\r\n", "name=\"currency\"\r\nContent-Type: a\r\nContent-Type: a\r\n"),
            c.replace("name=\"amount\"", "name=\"amount\"; size=1"),
            c.replace("name=\"amount\"", "name=am%6fount"),
            // RFC 2231: FastAPI refuses `name*` (400), multer fails on it (500), Starlette reads
            // a lone `filename*` part as a text field and busboy prefers `filename`.
            c.replace("name=\"amount\"", "name*=utf-8''amount"),
            c.replace("filename=\"a.txt\"", "filename*=UTF-8''a.txt"),
            c.replace("filename=\"a.txt\"", "filename=\"a.txt\"; filename*=UTF-8''a.txt"),
            c.replace("name=\"currency\"\r\n", "name=\"currency\"\r\nContent-Transfer-Encoding: base64\r\n"),
            c.replace(&format!("--{B}--\r\n"), ""),
        ] {
            assert_eq!(every(&ct(B), &refused), None, "{refused}");
        }
    }

    #[test]
    fn without_boundary_leaves_out_only_the_boundary_value() {
        assert_eq!(
            without_boundary(b"multipart/form-data; boundary=abc").as_deref(),
            Some(&b"multipart/form-data; boundary="[..])
        );
        assert_eq!(
            without_boundary(b"Multipart/Form-Data; Boundary=\"a b\"; charset=utf-8").as_deref(),
            Some(&b"Multipart/Form-Data; Boundary=\"\"; charset=utf-8"[..])
        );
        assert_eq!(without_boundary(b"multipart/form-data"), None);
        assert_eq!(without_boundary(b"application/x-www-form-urlencoded"), None);
    }

    #[test]
    fn bodies_made_to_cost_stay_bounded_and_never_panic() {
        // Many empty parts, a body of delimiters cut anywhere: linear work, no panic.
        let many =
            format!("--{B}\r\nContent-Disposition: form-data; name=a\r\n\r\n\r\n").repeat(5000) + &format!("--{B}--");
        assert!(form(&ct(B), &many).is_some());
        for cut in 0..canonical(B).len() {
            let _ = form(&ct(B), &canonical(B)[..cut]);
            let _ = every(&ct(B), &canonical(B)[..cut]);
        }
        let _ = semantic_form(b"--x\r\n\r\n", b"x", Reading::Most);
        let _ = semantic_form(b"--x--", b"x", Reading::Most);
        assert_eq!(semantic_form(b"--x--", b"x", Reading::Most), Some(vec![]));
    }
}
