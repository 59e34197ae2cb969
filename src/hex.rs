//! Hexadecimal: lowercase out (log lines, keys, owner marks), strict in (the one decoder of
//! storage keys, owner tokens and percent-escapes).

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Lowercase hex of `bytes`.
pub fn encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    encode_into(bytes, &mut out);
    out
}

/// `encode(bytes)` appended to `out`.
pub fn encode_into(bytes: &[u8], out: &mut String) {
    out.extend(digits(bytes).map(char::from));
}

/// The lowercase hex digits of `bytes`, two a byte.
pub fn digits(bytes: &[u8]) -> impl Iterator<Item = u8> + '_ {
    bytes.iter().flat_map(|b| [DIGITS[usize::from(b >> 4)], DIGITS[usize::from(b & 0x0f)]])
}

/// The value of one hex digit (either case); `None` for anything else (no sign, no space).
pub fn digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The byte a percent-escape (`%` and two hex digits, either case) opening `at` stands for;
/// `None` when `at` does not open with one.
pub fn escape(at: &[u8]) -> Option<u8> {
    match at {
        [b'%', hi, lo, ..] => Some((digit(*hi)? << 4) | digit(*lo)?),
        _ => None,
    }
}

/// Exactly `2 * N` hex digits as `N` bytes; `None` for any other length or any non-digit.
pub fn decode<const N: usize>(text: &[u8]) -> Option<[u8; N]> {
    if text.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (slot, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        let (hi, lo) = (digit(*pair.first()?)?, digit(*pair.get(1)?)?);
        *slot = (hi << 4) | lo;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn encodes_lowercase_two_digits_per_byte() {
        assert_eq!(super::encode(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(super::encode(&[]), "");
    }

    #[test]
    fn decodes_exactly_its_length_of_digits_and_nothing_else() {
        assert_eq!(super::decode::<4>(b"000fA5ff"), Some([0x00, 0x0f, 0xa5, 0xff]));
        assert_eq!(super::decode::<2>(&super::encode(&[0xde, 0xad]).into_bytes()), Some([0xde, 0xad]));
        // u8::from_str_radix would take "+f" for 15: a sign is not a digit here.
        for bad in [&b"+f00"[..], b"0x00", b" f00", b"00g0", b"000", b"00000"] {
            assert_eq!(super::decode::<2>(bad), None, "{}", String::from_utf8_lossy(bad));
        }
        assert_eq!(super::decode::<0>(b""), Some([]));
    }
}
