//! Content codings on replay (RFC 9110 §8.4, §12.5.3).
//!
//! A stored response is replayed as the first request received it, content coding included. A
//! retry may not accept that coding: the first request sent `accept-encoding: gzip` and a
//! compressor (after idemgate, or in the upstream) gzipped the answer, and the retry sends
//! `accept-encoding: identity`, or none. Replaying gzip bytes to it would hand the client a body
//! it cannot read. So, for each replay:
//!
//! - the stored response carries no coding (or only `identity`), or the retry accepts every
//!   coding it carries: replayed as stored;
//! - otherwise, one `gzip` (`x-gzip`) or `deflate` coding: decoded here (at most the policy's
//!   `max_response_body_bytes` of output) and replayed without `content-encoding` (a strong
//!   `etag`, which named the encoded bytes, becomes weak; the digests of the coded bytes,
//!   `CODED_DIGESTS`, are dropped); an empty body, whatever its coding, is replayed empty so;
//! - otherwise (`br`, `zstd`, `compress`, several codings, or a body that does not decode):
//!   406 `encoding-not-accepted`, naming the coding; nothing is executed again.
//!
//! A retry without `accept-encoding` is treated as accepting only `identity` (RFC 9110 lets a
//! server send any coding then, but a client that sent none rarely decodes one), and an empty
//! field value means `identity` only, as the RFC says.

use std::borrow::Cow;

use crate::problem::ProblemKind;
use crate::record::StoredResponse;

/// The header advertising how long the key's record lasts (the IETF draft asks resources to
/// publish their expiry policy): seconds from now. Sent by both builds' replays.
pub const EXPIRES_HEADER: &str = "idempotency-key-expires-in";

/// Seconds until `expires_at_ms`, rounded up.
pub fn expires_in(expires_at_ms: u64, now_ms: u64) -> String {
    expires_at_ms.saturating_sub(now_ms).div_ceil(1000).to_string()
}

/// What a retry is replayed.
#[derive(Debug, PartialEq, Eq)]
pub enum Replay {
    /// The stored response as it is.
    AsStored,
    /// The stored response decoded to its identity form.
    Decoded(StoredResponse),
}

/// What a retry that meets a completed record (`record`) is answered with, in every host (the
/// Wasm filter's `filter::reply::replay`, the native build's): its stored response, as stored
/// or decoded (`for_retry`), with the `idempotency-key-expires-in` value; or the problem that
/// stands for it (a response completed without its body, a record in any other state, or an
/// encoding the retry cannot read).
pub enum RetryAnswer<'r> {
    /// Not decoded: as stored, or (to an MCP request, `mcp::replay`) the stored JSON-RPC
    /// response with the retry's id, in the form the retry accepts.
    AsStored {
        response: Cow<'r, StoredResponse>,
        expires: String,
    },
    Decoded {
        response: StoredResponse,
        expires: String,
    },
    Problem(ProblemKind),
}

/// `RetryAnswer` for `record` at `now_ms`, to a retry with `Accept-Encoding` lines `accept`;
/// `mcp`: the retry is a `tools/call` on an MCP route, answered as `mcp::replay` says.
pub fn retry_answer<'r>(
    record: &'r crate::record::Record,
    now_ms: u64,
    accept: &[&[u8]],
    max_decoded_bytes: u64,
    mcp: Option<&crate::mcp::Reply>,
) -> RetryAnswer<'r> {
    use crate::record::State;
    match &record.state {
        State::Completed(r) => {
            let expires = expires_in(record.expires_at_ms, now_ms);
            if let Some(m) = mcp {
                return RetryAnswer::AsStored {
                    response: Cow::Owned(crate::mcp::replay(r, &m.id, m.accepts)),
                    expires,
                };
            }
            match for_retry(r, accept, max_decoded_bytes) {
                Ok(Replay::AsStored) => RetryAnswer::AsStored { response: Cow::Borrowed(r), expires },
                Ok(Replay::Decoded(d)) => RetryAnswer::Decoded { response: d, expires },
                Err(kind) => RetryAnswer::Problem(kind),
            }
        }
        State::CompletedTooLarge { status, location } => {
            let location = location.as_ref().map(|l| String::from_utf8_lossy(l).into_owned());
            RetryAnswer::Problem(ProblemKind::ResponseNotStored { status: *status, location })
        }
        _ => RetryAnswer::Problem(ProblemKind::OutcomeUnknown),
    }
}

/// Decides how the stored `response` is replayed to a retry whose `Accept-Encoding` field lines
/// are `accept` (in order; none if the retry sent none). Decoding stops at `max_decoded_bytes`.
pub fn for_retry(response: &StoredResponse, accept: &[&[u8]], max_decoded_bytes: u64) -> Result<Replay, ProblemKind> {
    let codings = stored_codings(response);
    if codings.is_empty() {
        return Ok(Replay::AsStored);
    }
    let accept: Vec<(String, bool)> = accepted(accept);
    if codings.iter().all(|c| accepts(&accept, c)) {
        return Ok(Replay::AsStored);
    }
    // No content (a 201 or 204 without a body, a HEAD's answer): nothing to decode, whatever the
    // coding; its identity form is empty too.
    if response.body.is_empty() {
        return Ok(Replay::Decoded(StoredResponse {
            status: response.status,
            headers: decoded_headers(response),
            body: vec![],
        }));
    }
    let refused = || ProblemKind::EncodingNotAccepted { coding: codings.join(", ") };
    let [coding] = codings.as_slice() else { return Err(refused()) };
    let body = decode(coding, &response.body, max_decoded_bytes).ok_or_else(refused)?;
    Ok(Replay::Decoded(StoredResponse { status: response.status, headers: decoded_headers(response), body }))
}

/// Digests computed over the content as coded (RFC 9530 `Content-Digest` and `Repr-Digest`,
/// whose representation includes its content coding; RFC 3230 `Digest`; `Content-MD5`): wrong for
/// the decoded body, so a decoded replay drops them rather than carry a digest it fails.
const CODED_DIGESTS: &[&str] = &["content-digest", "repr-digest", "digest", "content-md5"];

/// The stored headers for the decoded body: no `content-encoding`, none of `CODED_DIGESTS`, and a
/// strong `etag` made weak.
fn decoded_headers(response: &StoredResponse) -> Vec<(String, Vec<u8>)> {
    response
        .headers
        .iter()
        .filter(|(n, _)| n != "content-encoding" && !CODED_DIGESTS.contains(&n.as_str()))
        .map(|(n, v)| match (n.as_str(), v.first()) {
            // A strong validator named the encoded bytes; the decoded ones are only equivalent.
            ("etag", Some(b'"')) => (n.clone(), [b"W/".as_slice(), v].concat()),
            _ => (n.clone(), v.clone()),
        })
        .collect()
}

/// The codings applied to the stored body, in order, lowercase, `identity` left out.
fn stored_codings(response: &StoredResponse) -> Vec<String> {
    response
        .headers
        .iter()
        .filter(|(n, _)| n == "content-encoding")
        .flat_map(|(_, v)| String::from_utf8_lossy(v).split(',').map(normal_coding).collect::<Vec<_>>())
        .filter(|c| !c.is_empty() && c != "identity")
        .collect()
}

/// A coding's name as compared: lowercase, `x-gzip` and `x-compress` as `gzip` and `compress`.
fn normal_coding(name: &str) -> String {
    let c = name.trim().to_ascii_lowercase();
    match c.as_str() {
        "x-gzip" => "gzip".to_string(),
        "x-compress" => "compress".to_string(),
        _ => c,
    }
}

/// The retry's `Accept-Encoding` members: (coding or `*`, acceptable: its weight above 0).
fn accepted(lines: &[&[u8]]) -> Vec<(String, bool)> {
    let mut out = vec![];
    for line in lines {
        for member in String::from_utf8_lossy(line).split(',') {
            let mut parts = member.split(';');
            let name = normal_coding(parts.next().unwrap_or_default());
            if name.is_empty() {
                continue;
            }
            let mut acceptable = true;
            for p in parts {
                // `q` without `=` (`gzip;q`) is a weight with no value: unreadable like any other.
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                if k.trim().eq_ignore_ascii_case("q") {
                    // A weight of 0 (0, 0.0, 0.000) refuses; anything unreadable counts as 0.
                    acceptable = weight_above_zero(v.trim());
                }
            }
            out.push((name, acceptable));
        }
    }
    out
}

/// Whether a weight (RFC 9110 §12.4.2, `q=`) is above 0: a decimal of digits with at most one
/// point (`1`, `0.5`, `0.001`, `.5`), above 0 when any digit is not 0. Anything else (a sign, an
/// exponent, `inf`, `nan`, no digit) is unreadable, and an unreadable weight counts as 0. Read
/// without `f64` (its parser is about 7 KB of the module); the same answer as `f64`'s `q > 0.0`
/// on every plain decimal but one whose first non-zero digit comes after about 323 places
/// (`f64` rounds it to 0; read here above 0, as its sender meant; an RFC 9110 qvalue has at most
/// three places).
fn weight_above_zero(q: &str) -> bool {
    let (whole, fraction) = q.split_once('.').unwrap_or((q, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    !(whole.is_empty() && fraction.is_empty())
        && digits(whole)
        && digits(fraction)
        && q.bytes().any(|b| (b'1'..=b'9').contains(&b))
}

/// Whether `coding` is acceptable: named with a weight above 0, or not named and `*` is.
fn accepts(accept: &[(String, bool)], coding: &str) -> bool {
    match accept.iter().find(|(n, _)| n == coding) {
        Some((_, ok)) => *ok,
        None => accept.iter().any(|(n, ok)| n == "*" && *ok),
    }
}

/// The identity form of `body` under `coding`, or None (not a coding decoded here, damaged, or
/// more than `limit` bytes decoded).
fn decode(coding: &str, body: &[u8], limit: u64) -> Option<Vec<u8>> {
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    match coding {
        "gzip" => gunzip(body, limit),
        // `deflate` is the zlib format (RFC 9110 §8.4.1.2); some servers send raw deflate.
        "deflate" => miniz_oxide::inflate::decompress_to_vec_zlib_with_limit(body, limit)
            .or_else(|_| miniz_oxide::inflate::decompress_to_vec_with_limit(body, limit))
            .ok(),
        _ => None,
    }
}

/// One gzip member (RFC 1952): the header (with its optional fields), a raw deflate stream, and
/// the CRC-32 and length of the data, both checked. Several members, or anything after the
/// member, is refused.
fn gunzip(body: &[u8], limit: usize) -> Option<Vec<u8>> {
    const FHCRC: u8 = 2;
    const FEXTRA: u8 = 4;
    const FNAME: u8 = 8;
    const FCOMMENT: u8 = 16;
    let (head, rest) = body.split_at_checked(10)?;
    if head[0..3] != [0x1f, 0x8b, 8] || head[3] & 0xe0 != 0 {
        return None;
    }
    let flags = head[3];
    let mut rest = rest;
    if flags & FEXTRA != 0 {
        let (len, r) = rest.split_at_checked(2)?;
        rest = r.get(usize::from(u16::from_le_bytes([len[0], len[1]]))..)?;
    }
    for flag in [FNAME, FCOMMENT] {
        if flags & flag != 0 {
            let end = rest.iter().position(|b| *b == 0)?;
            rest = rest.get(end + 1..)?;
        }
    }
    if flags & FHCRC != 0 {
        rest = rest.get(2..)?;
    }
    let (stream, trailer) = rest.split_at_checked(rest.len().checked_sub(8)?)?;
    let data = miniz_oxide::inflate::decompress_to_vec_with_limit(stream, limit).ok()?;
    let crc = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]);
    let size = u32::from_le_bytes([trailer[4], trailer[5], trailer[6], trailer[7]]);
    (crc32(&data) == crc && size == data.len() as u32).then_some(data)
}

/// CRC-32 as gzip checks it (ISO-HDLC: reflected, polynomial 0xEDB88320), a byte at a time over
/// a 1 KB table built at compile time. Written here rather than taken from `crc32fast`, whose
/// 16 KB of tables were 2 % of the module for a check only the replays that decode gzip make.
fn crc32(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    !data.iter().fold(!0u32, |c, &b| TABLE[usize::from((c as u8) ^ b)] ^ (c >> 8))
}

#[cfg(test)]
mod tests {
    #[test]
    fn crc32_gives_the_check_values_of_gzip_s_crc() {
        // The catalogue's check value (CRC-32/ISO-HDLC of "123456789"), and flate2's own crc.
        assert_eq!(super::crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(super::crc32(b""), 0);
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let mut h = flate2::Crc::new();
        h.update(&data);
        assert_eq!(super::crc32(&data), h.sum());
    }

    use std::io::Write;

    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(vec![], flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn zlib(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::ZlibEncoder::new(vec![], flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn stored(coding: Option<&str>, body: Vec<u8>) -> StoredResponse {
        let mut headers = vec![("content-type".to_string(), b"application/json".to_vec())];
        if let Some(c) = coding {
            headers.push(("content-encoding".to_string(), c.as_bytes().to_vec()));
        }
        headers.push(("etag".to_string(), b"\"v1\"".to_vec()));
        StoredResponse { status: 201, headers, body }
    }

    const JSON: &[u8] = br#"{"id":"ch_1","amount":5}"#;

    #[test]
    fn a_response_without_a_coding_is_replayed_as_stored_whatever_the_retry_accepts() {
        for accept in [&[][..], &[b"identity".as_slice()], &[b"gzip"], &[b"identity;q=0"]] {
            assert_eq!(for_retry(&stored(None, JSON.to_vec()), accept, 1 << 20), Ok(Replay::AsStored));
            assert_eq!(for_retry(&stored(Some("identity"), JSON.to_vec()), accept, 1 << 20), Ok(Replay::AsStored));
        }
    }

    #[test]
    fn a_retry_that_accepts_the_coding_gets_the_stored_bytes() {
        let r = stored(Some("gzip"), gzip(JSON));
        for accept in [
            &[b"gzip".as_slice()][..],
            &[b"gzip, deflate, br"],
            &[b"br;q=1.0, GZIP;q=0.5"],
            &[b"*"],
            &[b"identity", b"x-gzip"],
            &[b"deflate", b"gzip;q=0.001"],
        ] {
            assert_eq!(for_retry(&r, accept, 1 << 20), Ok(Replay::AsStored), "{accept:?}");
        }
    }

    #[test]
    fn a_retry_that_does_not_accept_gzip_gets_the_decoded_body_without_the_coding() {
        let r = stored(Some("gzip"), gzip(JSON));
        for accept in [
            &[][..],
            &[b"".as_slice()],
            &[b"identity"],
            &[b"br, deflate"],
            &[b"gzip;q=0"],
            &[b"gzip;q=0.000, *"],
            &[b"*;q=0, identity"],
        ] {
            let Ok(Replay::Decoded(d)) = for_retry(&r, accept, 1 << 20) else { panic!("{accept:?}") };
            assert_eq!(d.body, JSON, "{accept:?}");
            assert_eq!(d.status, 201);
            assert_eq!(
                d.headers,
                vec![
                    ("content-type".to_string(), b"application/json".to_vec()),
                    ("etag".to_string(), b"W/\"v1\"".to_vec())
                ]
            );
        }
    }

    #[test]
    fn a_weight_is_read_as_a_plain_decimal_and_anything_else_counts_as_zero() {
        for q in ["1", "1.0", "1.000", "0.5", "0.001", "0.0001", ".5", "5.", "2", "007"] {
            assert!(weight_above_zero(q), "{q}");
            // The same answer as the f64 parser gave on a plain decimal.
            assert!(q.parse::<f64>().is_ok_and(|v| v > 0.0), "{q}");
        }
        for q in ["0", "0.0", "0.000", ".0", "0.", "00"] {
            assert!(!weight_above_zero(q), "{q}");
            assert!(q.parse::<f64>().is_ok_and(|v| v == 0.0), "{q}");
        }
        // Unreadable: counted as 0 (f64 would have read some of these as above 0).
        for q in ["", ".", "+0.5", "-0.5", "1e3", "1E-1", "inf", "nan", "0.5.1", "0,5", "q", "½", "1 0"] {
            assert!(!weight_above_zero(q), "{q}");
        }
        let r = stored(Some("gzip"), gzip(JSON));
        for accept in [
            &[b"gzip;q=1e3".as_slice()][..],
            &[b"gzip; q=+1"],
            &[b"gzip;q=inf, identity"],
            &[b"gzip;q"],
            &[b"gzip; Q ;level=1"],
            &[b"gzip;q="],
        ] {
            let Ok(Replay::Decoded(d)) = for_retry(&r, accept, 1 << 20) else { panic!("{accept:?}") };
            assert_eq!(d.body, JSON, "{accept:?}");
        }
        assert_eq!(for_retry(&r, &[b"gzip; Q = .5 "], 1 << 20), Ok(Replay::AsStored));
        // A parameter other than the weight, with or without a value, is not read.
        assert_eq!(for_retry(&r, &[b"gzip;level, gzip2;x=1"], 1 << 20), Ok(Replay::AsStored));
    }

    #[test]
    fn deflate_is_decoded_in_the_zlib_form_and_the_raw_form() {
        let Ok(Replay::Decoded(d)) = for_retry(&stored(Some("deflate"), zlib(JSON)), &[], 1 << 20) else { panic!() };
        assert_eq!(d.body, JSON);
        let mut e = flate2::write::DeflateEncoder::new(vec![], flate2::Compression::default());
        e.write_all(JSON).unwrap();
        let raw = e.finish().unwrap();
        let Ok(Replay::Decoded(d)) = for_retry(&stored(Some("Deflate"), raw), &[b"identity"], 1 << 20) else {
            panic!()
        };
        assert_eq!(d.body, JSON);
    }

    #[test]
    fn what_cannot_be_decoded_is_refused_naming_the_coding() {
        let refused = |c: &str| Err(ProblemKind::EncodingNotAccepted { coding: c.to_string() });
        assert_eq!(for_retry(&stored(Some("br"), vec![1, 2, 3]), &[b"gzip"], 1 << 20), refused("br"));
        assert_eq!(for_retry(&stored(Some("zstd"), vec![1]), &[], 1 << 20), refused("zstd"));
        assert_eq!(
            for_retry(&stored(Some("deflate, gzip"), gzip(&zlib(JSON))), &[], 1 << 20),
            refused("deflate, gzip")
        );
        // Damaged, or truncated.
        assert_eq!(for_retry(&stored(Some("gzip"), b"not gzip".to_vec()), &[], 1 << 20), refused("gzip"));
        let mut cut = gzip(JSON);
        cut.truncate(cut.len() - 6);
        assert_eq!(for_retry(&stored(Some("gzip"), cut), &[], 1 << 20), refused("gzip"));
    }

    #[test]
    fn gzip_headers_with_optional_fields_are_read_and_several_members_refused() {
        let mut e = flate2::GzBuilder::new()
            .filename("charge.json")
            .comment("made by a test")
            .extra(vec![1, 2, 3])
            .write(vec![], flate2::Compression::best());
        e.write_all(JSON).unwrap();
        let named = e.finish().unwrap();
        let Ok(Replay::Decoded(d)) = for_retry(&stored(Some("x-gzip"), named), &[], 1 << 20) else { panic!() };
        assert_eq!(d.body, JSON);
        let two = [gzip(b"{\"a\":"), gzip(b"1}")].concat();
        assert!(for_retry(&stored(Some("gzip"), two), &[], 1 << 20).is_err());
        // A checksum that does not match the data.
        let mut bad = gzip(JSON);
        let n = bad.len();
        bad[n - 8] ^= 1;
        assert!(for_retry(&stored(Some("gzip"), bad), &[], 1 << 20).is_err());
    }

    #[test]
    fn an_empty_coded_body_is_replayed_empty_without_the_coding_never_refused() {
        // Before: a 201 or 204 stored with `content-encoding: gzip` and no body could not be
        // decoded, so every retry not accepting gzip got 406 instead of its replay.
        for coding in ["gzip", "br", "deflate, gzip"] {
            for status in [201, 204] {
                let r = StoredResponse { status, ..stored(Some(coding), vec![]) };
                let Ok(Replay::Decoded(d)) = for_retry(&r, &[b"identity"], 1 << 20) else {
                    panic!("{coding} {status}")
                };
                assert_eq!((d.status, d.body.as_slice()), (status, &b""[..]));
                assert!(d.headers.iter().all(|(n, _)| n != "content-encoding"), "{:?}", d.headers);
            }
        }
        // A retry that accepts the coding still gets what the first request got.
        assert_eq!(for_retry(&stored(Some("gzip"), vec![]), &[b"gzip"], 1 << 20), Ok(Replay::AsStored));
    }

    #[test]
    fn a_decoded_replay_drops_the_digests_of_the_coded_bytes() {
        // Before: `content-digest` and the like were kept, naming bytes the retry never got.
        let mut r = stored(Some("gzip"), gzip(JSON));
        for n in ["content-digest", "Repr-Digest", "digest", "content-md5"] {
            r.headers.push((n.to_ascii_lowercase(), b"sha-256=:AAAA:".to_vec()));
        }
        r.headers.push(("x-other".to_string(), b"1".to_vec()));
        let Ok(Replay::Decoded(d)) = for_retry(&r, &[], 1 << 20) else { panic!() };
        let names: Vec<&str> = d.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "etag", "x-other"]);
        // Replayed as stored (the coding accepted), every digest stays: it is right then.
        assert_eq!(for_retry(&r, &[b"gzip"], 1 << 20), Ok(Replay::AsStored));
    }

    #[test]
    fn decoding_stops_at_the_limit() {
        // A small body that decodes to much more (a "zip bomb") never decodes past the limit.
        let big = vec![b'a'; 1 << 20];
        let r = stored(Some("gzip"), gzip(&big));
        assert!(r.body.len() < 4096);
        assert!(matches!(for_retry(&r, &[], 1 << 20), Ok(Replay::Decoded(_))));
        assert_eq!(
            for_retry(&r, &[], (1 << 20) - 1),
            Err(ProblemKind::EncodingNotAccepted { coding: "gzip".to_string() })
        );
    }
}
