#![no_main]
//! Any bytes as webdis's answer (with any status): errors, never panics, and never holds more
//! than a few bytes of memory per answer byte (no allocation sized from a count in the answer).
use libfuzzer_sys::fuzz_target;

#[path = "alloc_meter.rs"]
mod alloc_meter;

#[global_allocator]
static METER: alloc_meter::Meter = alloc_meter::Meter;

fuzz_target!(|data: &[u8]| {
    let status = data.first().map(|b| if *b < 128 { Some(200) } else { Some(u16::from(*b) * 2) });
    let body = data.get(1..).unwrap_or_default();
    let owner = idemgate::owner::OwnerToken([1; 16]);
    let skey = idemgate::scope::StorageKey([7; 32]);
    // A value must verify before its record is decoded (src/seal.rs); records themselves are
    // fuzzed by record_decoder.
    let Ok(seal) = idemgate::seal::Seal::new(Some("fuzz-record-key-0123456789abcdef0123"), None) else { return };
    // Each parse copies the answer's bytes at most twice (RESP bulk, then the record); lists are
    // bounded (16 RESP elements, 1024 record items of about 50 bytes, doubled while growing).
    alloc_meter::within(body.len(), 4, 128 * 1024, || {
        let _ = idemgate::store::parse_resp(body);
        let _ = idemgate::store::parse_claim_reply(status.flatten(), body, &owner, &skey, &seal);
        let _ = idemgate::store::parse_transition_reply(status.flatten(), body, None);
        let _ = idemgate::store::parse_transition_reply(status.flatten(), body, Some(&owner));
        let _ = idemgate::store::parse_read_reply(status.flatten(), body, &skey, &seal);
        let _ = idemgate::store::StoredValue::open(body, &skey, &seal);
    });
});
