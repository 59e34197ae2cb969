//! A global allocator that counts the bytes the Rust code holds, so a fuzz target can assert that
//! parsing an input never holds more than a few bytes per input byte: a parser that sizes an
//! allocation from a count it read (`*8000000` in a RESP answer) fails here even on short
//! inputs, long before it would exhaust a real VM. (libFuzzer's `-malloc_limit_mb` only catches
//! one allocation beyond the limit, which needs megabytes of input.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

pub struct Meter;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Meter {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        System.dealloc(p, layout)
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = System.realloc(p, layout, new_size);
        if !q.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            let live = LIVE.fetch_add(new_size, Ordering::Relaxed) + new_size;
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        q
    }
}

/// Runs `f` and panics (a fuzzing failure) if the bytes held at once while it ran grew by more
/// than `per_byte` times `input_len` plus `fixed`.
pub fn within(input_len: usize, per_byte: usize, fixed: usize, f: impl FnOnce()) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    f();
    let grew = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    let limit = input_len.saturating_mul(per_byte).saturating_add(fixed);
    assert!(grew <= limit, "held {grew} bytes at once for a {input_len}-byte input (limit {limit})");
}
