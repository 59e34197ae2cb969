#![no_main]
//! Any bytes as a stored record: an error or a record that encodes back to the same bytes.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = idemgate::record::Record::decode(data) {
        assert_eq!(r.encode(), data);
    }
    let _ = idemgate::local::Bucket::decode(data);
});
