#![no_main]
//! Any bytes as a form body that a derived key (`Reading::Most`) or a `forms: "semantic"`
//! fingerprint (`Reading::Every`) reads: as a `multipart/form-data` body (its parts' headers,
//! RFC 2231 `name*` and `filename*` values included) and as a urlencoded body. Never panics,
//! holds a bounded number of bytes per input byte, and reads the same bytes the same way twice.
use idemgate::form::{self, Reading};
use idemgate::multipart;
use libfuzzer_sys::fuzz_target;

#[path = "alloc_meter.rs"]
mod alloc_meter;

#[global_allocator]
static METER: alloc_meter::Meter = alloc_meter::Meter;

fuzz_target!(|data: &[u8]| {
    let Some((mode, body)) = data.split_first() else { return };
    let reading = if mode & 1 == 0 { Reading::Most } else { Reading::Every };
    alloc_meter::within(data.len(), 64, 256 * 1024, || {
        if mode & 2 == 0 {
            let a = form::semantic_form(body, reading);
            assert_eq!(a, form::semantic_form(body, reading));
        } else {
            let a = multipart::semantic_form(body, b"Bq7", reading);
            assert_eq!(a, multipart::semantic_form(body, b"Bq7", reading));
        }
    });
});
