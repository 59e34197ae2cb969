//! What a request costs in host calls and VM allocations, counted in a test-only build
//! (`--features count-host-calls`, `scripts/build-wasm.sh --count-host-calls`, written to
//! dist/idemgate-count.wasm; never shipped: a test checks dist/idemgate.wasm has no such metric).
//!
//! Every host call idemgate makes goes through `host.rs`, which calls `meter::call` first; a
//! counting global allocator counts every allocation in the VM (those the host asks for to hand a
//! value over included). Work the root does on its own schedule (the tick's sweeps and gauges,
//! configuration) is counted apart, as background, so the per-request figures hold only what
//! requests cause: their HTTP contexts' callbacks and the root's store writes for them. The root
//! flushes the figures to the metrics `idemgate.count.*` on its tick (background, uncounted).
//! Without the feature every function here is an empty inline one.

/// Where a host call is made: the callback it is made in (HTTP contexts), or the root's work for
/// requests (its queue and the answers to its callouts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Callback {
    RequestHeaders,
    RequestBody,
    CallAnswer,
    ResponseHeaders,
    ResponseBody,
    Log,
    Root,
}

#[cfg(feature = "count-host-calls")]
mod counting {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};

    static BACKGROUND: AtomicBool = AtomicBool::new(false);
    static CALLBACK: AtomicUsize = AtomicUsize::new(0);

    /// Host calls by callback (`super::Callback` order), flushed as `idemgate.count.calls.<name>`.
    pub static BY_CALLBACK: [AtomicU64; 7] = [const { AtomicU64::new(0) }; 7];
    pub const CALLBACK_NAMES: [&str; 7] = [
        "idemgate.count.calls.request_headers",
        "idemgate.count.calls.request_body",
        "idemgate.count.calls.call_answer",
        "idemgate.count.calls.response_headers",
        "idemgate.count.calls.response_body",
        "idemgate.count.calls.log",
        "idemgate.count.calls.root",
    ];

    pub fn callback(c: super::Callback) {
        CALLBACK.store(c as usize, Relaxed);
    }

    /// The figures, in `NAMES` order. The last two say how much work has finished (a request's
    /// `on_log`, an answer to one of the root's callouts), counted at its very end and flushed
    /// last: a reader that sees them reach N and then reads again sees every figure of that work.
    pub static FIGURES: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];
    pub const NAMES: [&str; 8] = [
        "idemgate.count.host_calls",
        "idemgate.count.vm_allocations",
        "idemgate.count.host_buffers",
        "idemgate.count.store_bytes",
        "idemgate.count.background_host_calls",
        "idemgate.count.background_vm_allocations",
        "idemgate.count.requests_logged",
        "idemgate.count.root_answers",
    ];
    const CALLS: usize = 0;
    const ALLOCS: usize = 1;
    const BUFFERS: usize = 2;
    const STORE_BYTES: usize = 3;
    const BACKGROUND_CALLS: usize = 4;
    const BACKGROUND_ALLOCS: usize = 5;
    const REQUESTS_LOGGED: usize = 6;
    const ROOT_ANSWERS: usize = 7;

    pub fn request_logged() {
        add(REQUESTS_LOGGED, 1);
    }

    pub fn root_answered() {
        add(ROOT_ANSWERS, 1);
    }

    fn add(i: usize, n: u64) {
        if let Some(f) = FIGURES.get(i) {
            f.fetch_add(n, Relaxed);
        }
    }

    pub fn call() {
        if BACKGROUND.load(Relaxed) {
            add(BACKGROUND_CALLS, 1);
        } else {
            add(CALLS, 1);
            if let Some(c) = BY_CALLBACK.get(CALLBACK.load(Relaxed)) {
                c.fetch_add(1, Relaxed);
            }
        }
    }

    pub fn buffer() {
        if !BACKGROUND.load(Relaxed) {
            add(BUFFERS, 1);
        }
    }

    pub fn store_bytes(n: usize) {
        if !BACKGROUND.load(Relaxed) {
            add(STORE_BYTES, n as u64);
        }
    }

    pub fn background<T>(f: impl FnOnce() -> T) -> T {
        let was = BACKGROUND.swap(true, Relaxed);
        let out = f();
        BACKGROUND.store(was, Relaxed);
        out
    }

    struct Counting;

    // SAFETY: every call is passed on to the system allocator unchanged; only counted.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            add(if BACKGROUND.load(Relaxed) { BACKGROUND_ALLOCS } else { ALLOCS }, 1);
            // SAFETY: the caller's contract is the system allocator's.
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: as above.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            add(if BACKGROUND.load(Relaxed) { BACKGROUND_ALLOCS } else { ALLOCS }, 1);
            // SAFETY: as above.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static ALLOCATOR: Counting = Counting;
}

#[cfg(feature = "count-host-calls")]
pub use counting::{background, buffer, call, callback, request_logged, root_answered, store_bytes};

/// The metrics of the counting build and the figures flushed to them so far.
#[cfg(feature = "count-host-calls")]
#[derive(Debug, Default)]
pub struct Flush {
    ids: Vec<Option<u32>>,
    flushed: Vec<u64>,
}

#[cfg(feature = "count-host-calls")]
impl Flush {
    pub fn new() -> Flush {
        Flush::default()
    }

    /// Adds to each metric what was counted since the last flush. Call it as background work.
    /// The figures saying how much work has finished go last (see `FIGURES`).
    pub fn flush(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        let names = || counting::CALLBACK_NAMES.iter().chain(counting::NAMES.iter());
        if self.ids.is_empty() {
            self.ids = names().map(|n| super::host::define_counter(n)).collect();
            self.flushed = vec![0; self.ids.len()];
        }
        let figures = counting::BY_CALLBACK.iter().chain(counting::FIGURES.iter());
        for ((f, id), done) in figures.zip(&self.ids).zip(self.flushed.iter_mut()) {
            let now = f.load(Relaxed);
            if let (Some(id), true) = (id, now > *done) {
                super::host::increment_metric(*id, i64::try_from(now - *done).unwrap_or(i64::MAX));
                *done = now;
            }
        }
    }
}

#[cfg(not(feature = "count-host-calls"))]
#[inline(always)]
pub fn call() {}

#[cfg(not(feature = "count-host-calls"))]
#[inline(always)]
pub fn buffer() {}

#[cfg(not(feature = "count-host-calls"))]
#[inline(always)]
pub fn store_bytes(_n: usize) {}

/// A request's `on_log` is over (call it last).
#[cfg(not(feature = "count-host-calls"))]
#[inline(always)]
pub fn request_logged() {}

/// The root handled an answer to one of its callouts (call it last).
#[cfg(not(feature = "count-host-calls"))]
#[inline(always)]
pub fn root_answered() {}

/// The host calls that follow are made in callback `c`.
#[cfg(not(feature = "count-host-calls"))]
#[inline(always)]
pub fn callback(_c: Callback) {}

/// Runs `f` as background work (not caused by a request): the tick, configuration.
#[cfg(not(feature = "count-host-calls"))]
#[inline(always)]
pub fn background<T>(f: impl FnOnce() -> T) -> T {
    f()
}

#[cfg(not(feature = "count-host-calls"))]
#[derive(Debug)]
pub struct Flush;

#[cfg(not(feature = "count-host-calls"))]
impl Flush {
    pub fn new() -> Flush {
        Flush
    }

    #[inline(always)]
    pub fn flush(&mut self) {}
}
