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

/// What a host call does, for the counting build's breakdown (`idemgate.count.kind.<callback>.<kind>`).
#[cfg_attr(not(feature = "count-host-calls"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// One header's value.
    GetHeader,
    /// A whole header (or trailer) map.
    GetHeaderMap,
    /// A header set or removed.
    SetHeader,
    /// A header line added.
    AddHeader,
    /// A body buffer (or a callout's answer, or the plugin configuration).
    GetBuffer,
    /// A property of the stream (Envoy's facts: response flags, attempts, route name, ...).
    GetProperty,
    /// Filter state for the access log (`set_property`).
    SetProperty,
    /// A shared-data read or write (CAS or not) of a bucket of the local table (`.b.<i>`).
    BucketGet,
    BucketSet,
    /// ... of a record body key (`.r.<i>.<j>`; a v3 table's slot, `.s.<i>.<j>`).
    SlotGet,
    SlotSet,
    /// ... of a table-wide counter (`.count`, `.usage`: v3 only; v4 has none).
    CounterGet,
    CounterSet,
    /// ... of any other shared-data key.
    SharedGet,
    SharedSet,
    Clock,
    /// A counter incremented or a gauge moved.
    Metric,
    DefineMetric,
    /// A local reply (problem or replay).
    SendResponse,
    Resume,
    Dispatch,
    Queue,
    /// `set_effective_context`, tick period, log level, entropy.
    Other,
    Log,
}

#[cfg_attr(not(feature = "count-host-calls"), allow(dead_code))]
impl Kind {
    pub const ALL: [Kind; 24] = [
        Kind::GetHeader,
        Kind::GetHeaderMap,
        Kind::SetHeader,
        Kind::AddHeader,
        Kind::GetBuffer,
        Kind::GetProperty,
        Kind::SetProperty,
        Kind::BucketGet,
        Kind::BucketSet,
        Kind::SlotGet,
        Kind::SlotSet,
        Kind::CounterGet,
        Kind::CounterSet,
        Kind::SharedGet,
        Kind::SharedSet,
        Kind::Clock,
        Kind::Metric,
        Kind::DefineMetric,
        Kind::SendResponse,
        Kind::Resume,
        Kind::Dispatch,
        Kind::Queue,
        Kind::Other,
        Kind::Log,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::GetHeader => "get_header",
            Kind::GetHeaderMap => "get_header_map",
            Kind::SetHeader => "set_header",
            Kind::AddHeader => "add_header",
            Kind::GetBuffer => "get_buffer",
            Kind::GetProperty => "get_property",
            Kind::SetProperty => "set_property",
            Kind::BucketGet => "bucket_get",
            Kind::BucketSet => "bucket_set",
            Kind::SlotGet => "slot_get",
            Kind::SlotSet => "slot_set",
            Kind::CounterGet => "counter_get",
            Kind::CounterSet => "counter_set",
            Kind::SharedGet => "shared_get",
            Kind::SharedSet => "shared_set",
            Kind::Clock => "clock",
            Kind::Metric => "metric",
            Kind::DefineMetric => "define_metric",
            Kind::SendResponse => "send_response",
            Kind::Resume => "resume",
            Kind::Dispatch => "dispatch",
            Kind::Queue => "queue",
            Kind::Other => "other",
            Kind::Log => "log",
        }
    }
}

/// The kind of a shared-data call on `key` (`set`: a write), by the local table's key names.
#[cfg_attr(not(feature = "count-host-calls"), allow(dead_code))]
pub fn shared_kind(key: &str, set: bool) -> Kind {
    let pick = |get, put| if set { put } else { get };
    if key.contains(".b.") {
        pick(Kind::BucketGet, Kind::BucketSet)
    } else if key.contains(".r.") || key.contains(".s.") {
        pick(Kind::SlotGet, Kind::SlotSet)
    } else if key.ends_with(".count") || key.ends_with(".usage") {
        pick(Kind::CounterGet, Kind::CounterSet)
    } else {
        pick(Kind::SharedGet, Kind::SharedSet)
    }
}

/// The names of the callbacks, in `Callback` order (for the breakdown's metric names).
#[cfg_attr(not(feature = "count-host-calls"), allow(dead_code))]
pub const CALLBACKS: [&str; 7] =
    ["request_headers", "request_body", "call_answer", "response_headers", "response_body", "log", "root"];

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

    /// Host calls by callback and kind (`callback * Kind::ALL.len() + kind`), flushed as
    /// `idemgate.count.kind.<callback>.<kind>` (defined when first non-zero).
    pub static BY_KIND: [AtomicU64; 7 * 24] = [const { AtomicU64::new(0) }; 7 * 24];

    pub fn call(kind: super::Kind) {
        if BACKGROUND.load(Relaxed) {
            add(BACKGROUND_CALLS, 1);
        } else {
            add(CALLS, 1);
            let cb = CALLBACK.load(Relaxed);
            if let Some(c) = BY_CALLBACK.get(cb) {
                c.fetch_add(1, Relaxed);
            }
            if let Some(c) = BY_KIND.get(cb * super::Kind::ALL.len() + kind as usize) {
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

/// A shared-data call on `key` (`set`: a write), counted by what it touches.
#[cfg(feature = "count-host-calls")]
pub fn shared(key: &str, set: bool) {
    counting::call(shared_kind(key, set));
}

#[cfg(not(feature = "count-host-calls"))]
#[inline(always)]
pub fn shared(_key: &str, _set: bool) {}

#[cfg(feature = "count-host-calls")]
pub use counting::{background, buffer, call, callback, request_logged, root_answered, store_bytes};

/// The metrics of the counting build and the figures flushed to them so far.
#[cfg(feature = "count-host-calls")]
#[derive(Debug, Default)]
pub struct Flush {
    ids: Vec<Option<u32>>,
    flushed: Vec<u64>,
    /// The breakdown by callback and kind: each metric defined when its figure is first non-zero.
    kind_ids: Vec<Option<u32>>,
    kind_flushed: Vec<u64>,
}

#[cfg(feature = "count-host-calls")]
impl Flush {
    pub fn new() -> Flush {
        Flush::default()
    }

    /// Adds to each metric what was counted since the last flush, defining a metric with `define`
    /// and adding to it with `increment` (the host's, `host::define_counter` and
    /// `host::increment_metric`: passed in, so that the meter stays below the host calls it counts).
    /// Call it as background work. The figures saying how much work has finished go last (see
    /// `FIGURES`).
    pub fn flush(&mut self, mut define: impl FnMut(&str) -> Option<u32>, mut increment: impl FnMut(u32, i64)) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.kind_ids.is_empty() {
            self.kind_ids = vec![None; counting::BY_KIND.len()];
            self.kind_flushed = vec![0; counting::BY_KIND.len()];
        }
        let kinds = Kind::ALL.len();
        for (i, f) in counting::BY_KIND.iter().enumerate() {
            let now = f.load(Relaxed);
            let (Some(id), Some(done)) = (self.kind_ids.get_mut(i), self.kind_flushed.get_mut(i)) else { continue };
            if now <= *done {
                continue;
            }
            if id.is_none() {
                let (cb, kind) = (CALLBACKS.get(i / kinds), Kind::ALL.get(i % kinds));
                if let (Some(cb), Some(kind)) = (cb, kind) {
                    *id = define(&format!("idemgate.count.kind.{cb}.{}", kind.name()));
                }
            }
            if let Some(id) = id {
                increment(*id, i64::try_from(now - *done).unwrap_or(i64::MAX));
                *done = now;
            }
        }
        // The figures saying how much work has finished go last (after the breakdown too).
        let names = || counting::CALLBACK_NAMES.iter().chain(counting::NAMES.iter());
        if self.ids.is_empty() {
            self.ids = names().map(|n| define(n)).collect();
            self.flushed = vec![0; self.ids.len()];
        }
        let figures = counting::BY_CALLBACK.iter().chain(counting::FIGURES.iter());
        for ((f, id), done) in figures.zip(&self.ids).zip(self.flushed.iter_mut()) {
            let now = f.load(Relaxed);
            if let (Some(id), true) = (id, now > *done) {
                increment(*id, i64::try_from(now - *done).unwrap_or(i64::MAX));
                *done = now;
            }
        }
    }
}

#[cfg(not(feature = "count-host-calls"))]
#[inline(always)]
pub fn call(_kind: Kind) {}

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
    pub fn flush(&mut self, _define: impl FnMut(&str) -> Option<u32>, _increment: impl FnMut(u32, i64)) {}
}
