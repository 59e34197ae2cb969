#![no_main]
//! Any bytes as a stored record: an error or a record that encodes back to the same bytes, never
//! holding more than a few bytes of memory per input byte.
use libfuzzer_sys::fuzz_target;

#[path = "alloc_meter.rs"]
mod alloc_meter;

#[global_allocator]
static METER: alloc_meter::Meter = alloc_meter::Meter;

fuzz_target!(|data: &[u8]| {
    alloc_meter::within(data.len(), 4, 128 * 1024, || {
        if let Ok(r) = idemgate::record::Record::decode(data) {
            assert_eq!(r.encode(), data);
        }
        let _ = idemgate::local::Bucket::decode(data);
    });
});
