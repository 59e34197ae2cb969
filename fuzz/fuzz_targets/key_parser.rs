#![no_main]
//! Any bytes as the key header: a key that parses is 1..=max visible ASCII characters.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(k) = idemgate::key::parse_key(data, 255) {
        assert!(!k.as_str().is_empty() && k.as_str().len() <= 255);
        assert!(k.as_str().bytes().all(|b| (0x21..=0x7e).contains(&b)));
    }
});
