//! SHA-1 (FIPS 180-4) as a `const fn`: Redis names a Lua script by the SHA-1 of its text
//! (`EVALSHA`), so the store's scripts carry their names as constants computed when the crate is
//! compiled (`store::Script::sha1_hex`), at no cost in the module or per request.
//!
//! SHA-1 is used for nothing else: it is Redis's script name, not a security boundary (the
//! hashes that bind callers, keys and requests are SHA-256).

const H0: [u32; 5] = [0x6745_2301, 0xEFCD_AB89, 0x98BA_DCFE, 0x1032_5476, 0xC3D2_E1F0];
const HEX: &[u8; 16] = b"0123456789abcdef";

/// The SHA-1 digest of `data`.
pub const fn digest(data: &[u8]) -> [u8; 20] {
    // The message, 0x80, zeros, and its length in bits (64-bit big-endian): a multiple of 64 bytes.
    let padded = (data.len() + 8) / 64 * 64 + 64;
    let bits = (data.len() as u64).wrapping_mul(8);
    let mut h = H0;
    let mut block = 0;
    while block < padded {
        let mut w = [0u32; 80];
        let mut t = 0;
        while t < 16 {
            let at = block + 4 * t;
            w[t] = u32::from_be_bytes([
                padded_byte(data, bits, padded, at),
                padded_byte(data, bits, padded, at + 1),
                padded_byte(data, bits, padded, at + 2),
                padded_byte(data, bits, padded, at + 3),
            ]);
            t += 1;
        }
        while t < 80 {
            w[t] = (w[t - 3] ^ w[t - 8] ^ w[t - 14] ^ w[t - 16]).rotate_left(1);
            t += 1;
        }
        let [mut a, mut b, mut c, mut d, mut e] = h;
        t = 0;
        while t < 80 {
            let (f, k) = match t / 20 {
                0 => ((b & c) | (!b & d), 0x5A82_7999),
                1 => (b ^ c ^ d, 0x6ED9_EBA1),
                2 => ((b & c) | (b & d) | (c & d), 0x8F1B_BCDC),
                _ => (b ^ c ^ d, 0xCA62_C1D6),
            };
            let next = a.rotate_left(5).wrapping_add(f).wrapping_add(e).wrapping_add(k).wrapping_add(w[t]);
            e = d;
            d = c;
            c = b.rotate_left(30);
            b = a;
            a = next;
            t += 1;
        }
        h = [
            h[0].wrapping_add(a),
            h[1].wrapping_add(b),
            h[2].wrapping_add(c),
            h[3].wrapping_add(d),
            h[4].wrapping_add(e),
        ];
        block += 64;
    }
    let mut out = [0u8; 20];
    let mut i = 0;
    while i < 5 {
        let word = h[i].to_be_bytes();
        out[4 * i] = word[0];
        out[4 * i + 1] = word[1];
        out[4 * i + 2] = word[2];
        out[4 * i + 3] = word[3];
        i += 1;
    }
    out
}

/// Byte `i` of the padded message (`padded` bytes long) of `data`, whose length is `bits` bits.
const fn padded_byte(data: &[u8], bits: u64, padded: usize, i: usize) -> u8 {
    if i < data.len() {
        data[i]
    } else if i == data.len() {
        0x80
    } else if i + 8 >= padded {
        (bits >> (8 * (padded - 1 - i))) as u8
    } else {
        0
    }
}

/// Lowercase hex of a digest (Redis's spelling of a script's name).
pub const fn hex(digest: &[u8; 20]) -> [u8; 40] {
    let mut out = [0u8; 40];
    let mut i = 0;
    while i < 20 {
        out[2 * i] = HEX[(digest[i] >> 4) as usize];
        out[2 * i + 1] = HEX[(digest[i] & 0x0f) as usize];
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::{digest, hex};

    fn sha1_hex(data: &[u8]) -> String {
        String::from_utf8(hex(&digest(data)).to_vec()).unwrap()
    }

    #[test]
    fn fips_180_test_vectors() {
        assert_eq!(sha1_hex(b"abc"), "a9993e364706816aba3e25717850c26c9cd0d89d");
        assert_eq!(sha1_hex(b""), "da39a3ee5e6b4b0d3255bfef95601890afd80709");
        assert_eq!(
            sha1_hex(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "84983e441c3bd26ebaae4aa1f95129e5e54670f1"
        );
        assert_eq!(sha1_hex(&vec![b'a'; 1_000_000]), "34aa973cd4c4daa4f61eeb2bdbad27316534016f");
    }

    #[test]
    fn every_length_around_a_block_boundary_pads_correctly() {
        // Pinned with `printf '%*s' N '' | tr ' ' x | sha1sum`: the lengths where the padding and
        // the length field change block (55, 56, 63, 64, 65).
        let pinned = [
            (55, "cef734ba81a024479e09eb5a75b6ddae62e6abf1"),
            (56, "901305367c259952f4e7af8323f480d59f81335b"),
            (63, "0ddc4e0cccd9a12850deb5abb0853a4425559fec"),
            (64, "bb2fa3ee7afb9f54c6dfb5d021f14b1ffe40c163"),
            (65, "78c741ddc482e4cdf8c474a0876347a0905b6233"),
        ];
        for (n, want) in pinned {
            assert_eq!(sha1_hex(&vec![b'x'; n]), want, "{n} bytes");
        }
    }

    #[test]
    fn computed_at_compile_time() {
        const ABC: [u8; 40] = hex(&digest(b"abc"));
        assert_eq!(&ABC, b"a9993e364706816aba3e25717850c26c9cd0d89d");
    }
}
