#![no_main]
//! Any bytes as webdis's answer (with any status): errors, never panics.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let status = data.first().map(|b| if *b < 128 { Some(200) } else { Some(u16::from(*b) * 2) });
    let body = data.get(1..).unwrap_or_default();
    let _ = idemgate::store::parse_resp(body);
    let _ = idemgate::store::parse_claim_reply(status.flatten(), body);
    let _ = idemgate::store::parse_transition_reply(status.flatten(), body);
    let _ = idemgate::store::parse_read_reply(status.flatten(), body);
    let _ = idemgate::store::StoredValue::decode(body);
});
