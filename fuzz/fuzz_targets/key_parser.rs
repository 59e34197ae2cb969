#![no_main]
//! Any bytes as the key header, under both `key_syntax` rules: a key that parses is 1..=max
//! printable ASCII characters, and a key the strict rule accepts is the same key under `any`.
use idemgate::key::{parse_key, KeySyntax};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let strict = parse_key(data, 255, KeySyntax::Strict);
    let any = parse_key(data, 255, KeySyntax::Any);
    for k in [&strict, &any].into_iter().flatten() {
        assert!(!k.as_str().is_empty() && k.as_str().len() <= 255);
        assert!(k.as_str().bytes().all(|b| (0x20..=0x7e).contains(&b)));
    }
    if let Ok(k) = &strict {
        assert_eq!(any.as_ref(), Ok(k));
    }
});
