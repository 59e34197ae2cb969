#![no_main]
//! Any bytes as etcd's JSON gateway's answer (with any status) to a claim, a transition, a read
//! (the filter's and the operator's fenced one), a lease grant, an authentication or a page of
//! the operator's `list`: errors, never panics, and never holds more than a few bytes of memory
//! per answer byte (lists are refused past four elements, a list page past
//! `etcd::LIST_PAGE_MAX`, as they arrive; nothing is sized from the answer).
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
    let Ok(seal) = idemgate::seal::Seal::new(Some("fuzz-record-key-0123456789abcdef0123"), None) else { return };
    let now = 1_700_000_000_000;
    // Base64 text is kept once and decoded once (3/4), then opened and the record decoded: a few
    // copies of the answer; JSON structure (objects, lists of at most four) is bounded per level.
    alloc_meter::within(body.len(), 8, 128 * 1024, || {
        let _ = idemgate::etcd::parse_claim_reply(status.flatten(), body, &owner, &skey, &seal, now);
        let _ = idemgate::etcd::parse_transition_reply(status.flatten(), body, None);
        let echo = Some((&skey, idemgate::record::Stage::Forwarded, &owner));
        let _ = idemgate::etcd::parse_transition_reply(status.flatten(), body, echo);
        let _ = idemgate::etcd::parse_where_absent_reply(status.flatten(), body);
        let _ = idemgate::etcd::refused_as_too_large(status.flatten(), body);
        let _ = idemgate::etcd::parse_read_reply(status.flatten(), body, &skey, &seal, now);
        let _ = idemgate::etcd::parse_fenced_read(status.flatten(), body, &skey, &seal, now);
        let _ = idemgate::etcd::parse_list_page(status.flatten(), body, None, idemgate::etcd::LIST_PAGE_MAX);
        let _ = idemgate::etcd::parse_list_page(status.flatten(), body, Some(b"idemgate/v1/7\0"), 2);
        let _ = idemgate::etcd::parse_lease_grant(status.flatten(), body, 600);
        if let Ok(token) = idemgate::etcd::parse_authenticate(status.flatten(), body) {
            // A token goes into a header value: visible ASCII only, bounded.
            assert!(!token.is_empty() && token.len() <= 4096 && token.bytes().all(|b| b.is_ascii_graphic()));
        }
        assert!(idemgate::etcd::error_text(body).chars().count() <= 200);
        let _ = idemgate::etcd::open_value(body, &skey, &seal);
        let _ = idemgate::base64::unb64(&String::from_utf8_lossy(body));
    });
});
