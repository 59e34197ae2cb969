#![no_main]
//! Any bytes as a JSON body: the canonical form, when there is one, is a fixed point.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(c) = idemgate::canonical_json::canonicalize(data) {
        assert_eq!(idemgate::canonical_json::canonicalize(&c).as_deref(), Some(c.as_slice()));
    }
});
