//! Host access: thin wrappers over proxy-wasm host calls that never panic on our side and turn
//! host failures into values. Every host call idemgate makes goes through this module (each
//! wrapper calls `meter::call` first, which counts it in the `count-host-calls` build).

use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};

use crate::bench_host::meter::{self, Kind};
use crate::local::{HostError, SetError, SharedData};
use crate::scope::StorageKey;

/// Envoy's shared data for this VM id.
pub struct HostShared;

impl SharedData for HostShared {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        meter::shared(key, false);
        let got = hostcalls::get_shared_data(key).map_err(|_| HostError);
        if matches!(got, Ok((Some(_), _))) {
            meter::buffer();
        }
        got
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        meter::shared(key, true);
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(SetError::CasMismatch),
            Err(_) => Err(SetError::Host),
        }
    }
}

fn now() -> Option<Duration> {
    meter::call(Kind::Clock);
    hostcalls::get_current_time().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok())
}

/// The `log` crate's level of a core log level.
fn log_level(level: crate::engine::settle::Level) -> log::Level {
    use crate::engine::settle::Level;
    match level {
        Level::Error => log::Level::Error,
        Level::Warn => log::Level::Warn,
        Level::Info => log::Level::Info,
        Level::Debug => log::Level::Debug,
    }
}

/// Whether a core log line of `level` would be written (the core skips building it otherwise).
pub fn logs(level: crate::engine::settle::Level) -> bool {
    log::log_enabled!(log_level(level))
}

/// Writes a core log line at its level.
pub fn log_line(level: crate::engine::settle::Level, line: &str) {
    log::log!(log_level(level), "{line}");
}

pub fn now_ms() -> u64 {
    now().map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub fn now_nanos() -> u64 {
    now().map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// One header's first value. Read as bytes: the SDK's text variant panics on a value that is
/// not UTF-8 (a client may send any byte >= 0x80), and a panic is a VM crash.
/// One header's value, or None: absent, or a map the host no longer lends (Envoy answers
/// BadArgument for the request headers once they have gone on upstream, and the SDK's wrapper
/// panics on that: a VM crash).
pub fn header(map: MapType, name: &str) -> Option<String> {
    meter::call(Kind::GetHeader);
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the name is memory we own for the duration of the call, with its length; on Ok the
    // host has written a buffer it allocated through this module's allocator
    // (`proxy_on_memory_allocate`, a leaked `Vec` of `size` bytes), which we take back once.
    let status = unsafe { proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), &mut data, &mut size) };
    if status != 0 {
        return None;
    }
    meter::buffer();
    let v = if data.is_null() || size == 0 {
        vec![]
    } else {
        // SAFETY: as above: `data` holds `size` initialised bytes allocated as a `Vec<u8>`.
        unsafe { Vec::from_raw_parts(data, size, size) }
    };
    Some(String::from_utf8_lossy(&v).into_owned())
}

/// Every line of a header map, names as text (lossy) and values as bytes; empty if the host no
/// longer lends the map (the SDK's wrapper panics on that status: a VM crash) or its answer is
/// not a well-formed map.
pub fn all_headers(map: MapType) -> Vec<(String, Vec<u8>)> {
    meter::call(Kind::GetHeaderMap);
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: on Ok the host has written a buffer it allocated through this module's allocator
    // (`proxy_on_memory_allocate`, a leaked `Vec` of `size` bytes), which we take back once.
    let status = unsafe { proxy_get_header_map_pairs(map as u32, &mut data, &mut size) };
    if status != 0 || data.is_null() || size == 0 {
        return vec![];
    }
    meter::buffer();
    // SAFETY: as above: `data` holds `size` initialised bytes allocated as a `Vec<u8>`.
    let bytes = unsafe { Vec::from_raw_parts(data, size, size) };
    parse_header_map(&bytes).unwrap_or_default()
}

/// The ABI's serialized header map (a u32 count, then each pair's name and value lengths as u32,
/// little endian, then each name and value followed by a NUL byte), or None when it is not
/// well formed (short, lengths past its end, a missing NUL). Never panics, whatever the bytes.
pub fn parse_header_map(bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    fn u32_at(bytes: &[u8], at: usize) -> Option<usize> {
        let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
        usize::try_from(u32::from_le_bytes(b)).ok()
    }
    fn take<'a>(bytes: &'a [u8], at: &mut usize, len: usize) -> Option<&'a [u8]> {
        let end = at.checked_add(len)?;
        let v = bytes.get(*at..end)?;
        if bytes.get(end) != Some(&0) {
            return None;
        }
        *at = end + 1;
        Some(v)
    }
    if bytes.is_empty() {
        return Some(vec![]);
    }
    let count = u32_at(bytes, 0)?;
    // Each pair takes at least 8 bytes of lengths and 2 NULs: a count the bytes cannot hold is
    // refused before anything is allocated for it.
    let mut at = count.checked_mul(8)?.checked_add(4)?;
    if count.checked_mul(10)? > bytes.len() {
        return None;
    }
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let key_len = u32_at(bytes, 4 + i * 8)?;
        let value_len = u32_at(bytes, 8 + i * 8)?;
        let key = take(bytes, &mut at, key_len)?;
        let value = take(bytes, &mut at, value_len)?;
        out.push((String::from_utf8_lossy(key).into_owned(), value.to_vec()));
    }
    Some(out)
}

/// Sets (or, with `None`, removes) a header; false if the host refused (for example the request
/// headers once they have gone on upstream: Envoy answers BadArgument, on which the SDK's wrapper
/// panics).
pub fn set_header(map: MapType, name: &str, value: Option<&str>) -> bool {
    meter::call(Kind::SetHeader);
    // SAFETY: every pointer is to memory we own for the duration of the call, with its length.
    let status = unsafe {
        match value {
            Some(v) => proxy_replace_header_map_value(map as u32, name.as_ptr(), name.len(), v.as_ptr(), v.len()),
            None => proxy_remove_header_map_value(map as u32, name.as_ptr(), name.len()),
        }
    };
    status == 0
}

/// Adds a header line; false if the host refused (as `set_header`).
pub fn add_header(map: MapType, name: &str, value: &str) -> bool {
    meter::call(Kind::AddHeader);
    // SAFETY: every pointer is to memory we own for the duration of the call, with its length.
    unsafe { proxy_add_header_map_value(map as u32, name.as_ptr(), name.len(), value.as_ptr(), value.len()) == 0 }
}

pub fn buffer(kind: BufferType, size: usize) -> Vec<u8> {
    if size == 0 {
        return vec![];
    }
    meter::call(Kind::GetBuffer);
    let b = hostcalls::get_buffer(kind, 0, size).ok().flatten().unwrap_or_default();
    if !b.is_empty() {
        meter::buffer();
    }
    b
}

/// The plugin configuration, whole.
pub fn plugin_configuration() -> Vec<u8> {
    meter::call(Kind::GetBuffer);
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX).ok().flatten().unwrap_or_default()
}

/// A property's value, or None: absent, or any status but Ok. Read through the ABI directly: the
/// SDK's wrapper copies the path into two vectors on each call and panics on a status other than
/// Ok, NotFound, SerializationFailure and InternalFailure (a VM crash).
pub fn property(path: &[&str]) -> Option<Vec<u8>> {
    meter::call(Kind::GetProperty);
    let mut stack = [0u8; PROPERTY_PATH_BYTES];
    let heap: Vec<u8>;
    let joined: &[u8] = match property_path(path, &mut stack) {
        Some(j) => j,
        None => {
            heap = path.join("\0").into_bytes();
            &heap
        }
    };
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the path is memory we own for the duration of the call, with its length; on Ok the
    // host has written a buffer it allocated through this module's allocator
    // (`proxy_on_memory_allocate`, a leaked `Vec` of `size` bytes), which we take back once.
    let status = unsafe { proxy_get_property(joined.as_ptr(), joined.len(), &mut data, &mut size) };
    if status != 0 || data.is_null() {
        return None;
    }
    meter::buffer();
    if size == 0 {
        return Some(vec![]);
    }
    // SAFETY: as above: `data` holds `size` initialised bytes allocated as a `Vec<u8>`.
    Some(unsafe { Vec::from_raw_parts(data, size, size) })
}

/// Room for the property paths idemgate reads (the longest, `upstream.request_attempt_count`,
/// takes 30 bytes); a longer path is joined on the heap.
const PROPERTY_PATH_BYTES: usize = 64;

/// `path` as the ABI takes it, its segments joined by NUL bytes, written into `buf`; None when
/// it does not fit.
fn property_path<'b>(path: &[&str], buf: &'b mut [u8]) -> Option<&'b [u8]> {
    let mut at = 0usize;
    for (i, part) in path.iter().enumerate() {
        if i > 0 {
            *buf.get_mut(at)? = 0;
            at += 1;
        }
        let end = at.checked_add(part.len())?;
        buf.get_mut(at..end)?.copy_from_slice(part.as_bytes());
        at = end;
    }
    buf.get(..at)
}

/// Lets a paused request go on.
pub fn resume_request() -> bool {
    meter::call(Kind::Resume);
    hostcalls::resume_http_request().is_ok()
}

/// Sends an HTTP callout through `cluster`; its answer comes to `on_http_call_response`.
pub fn dispatch_http_call(
    cluster: &str,
    headers: Vec<(&str, &str)>,
    body: &[u8],
    timeout: Duration,
) -> Result<u32, Status> {
    meter::call(Kind::Dispatch);
    hostcalls::dispatch_http_call(cluster, headers, Some(body), vec![], timeout)
}

thread_local! {
    /// The HTTP context host calls act on now: the one whose callback runs, or the one the root
    /// made effective (`set_effective_context`); replies read it to tell an MCP request's.
    static CURRENT_CONTEXT: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Host calls (and replies) now act on `context_id`: set when its callback starts.
pub fn set_current_context(context_id: u32) {
    CURRENT_CONTEXT.with(|c| c.set(context_id));
}

/// The context set by the last `set_current_context` or `set_effective_context`.
pub fn current_context() -> u32 {
    CURRENT_CONTEXT.with(std::cell::Cell::get)
}

/// Makes `context_id` the context later host calls act on; false if the host refused.
pub fn set_effective_context(context_id: u32) -> bool {
    meter::call(Kind::Other);
    set_current_context(context_id);
    hostcalls::set_effective_context(context_id).is_ok()
}

pub fn register_queue(name: &str) -> Option<u32> {
    meter::call(Kind::Queue);
    hostcalls::register_shared_queue(name).ok()
}

pub fn enqueue(queue_id: u32, value: &[u8]) -> Result<(), Status> {
    meter::call(Kind::Queue);
    hostcalls::enqueue_shared_queue(queue_id, Some(value))
}

/// Takes one item off a shared queue (the host posts one `on_queue_ready` per item enqueued).
pub fn dequeue(queue_id: u32) {
    meter::call(Kind::Queue);
    if let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {
        meter::buffer();
    }
}

/// Empties a shared queue (its items only wake the root).
pub fn drain_queue(queue_id: u32) {
    loop {
        meter::call(Kind::Queue);
        match hostcalls::dequeue_shared_queue(queue_id) {
            Ok(Some(_)) => meter::buffer(),
            _ => return,
        }
    }
}

pub fn set_tick_period(period: Duration) -> bool {
    meter::call(Kind::Other);
    hostcalls::set_tick_period(period).is_ok()
}

pub fn define_counter(name: &str) -> Option<u32> {
    meter::call(Kind::DefineMetric);
    hostcalls::define_metric(MetricType::Counter, name).ok()
}

fn define_gauge(name: &str) -> Option<u32> {
    meter::call(Kind::DefineMetric);
    hostcalls::define_metric(MetricType::Gauge, name).ok()
}

fn define_histogram(name: &str) -> Option<u32> {
    meter::call(Kind::DefineMetric);
    hostcalls::define_metric(MetricType::Histogram, name).ok()
}

pub fn increment_metric(id: u32, delta: i64) {
    meter::call(Kind::Metric);
    let _ = hostcalls::increment_metric(id, delta);
}

fn record_metric(id: u32, value: u64) {
    meter::call(Kind::Metric);
    let _ = hostcalls::record_metric(id, value);
}

#[link(wasm_import_module = "env")]
extern "C" {
    /// The proxy-wasm ABI's `get_header_map_value` (the SDK's wrapper panics on a status other than
    /// Ok and NotFound, which Envoy answers for a header map it no longer lends).
    #[allow(clashing_extern_declarations)]
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    /// The proxy-wasm ABI's `get_header_map_pairs` (the SDK's wrapper panics as above).
    #[allow(clashing_extern_declarations)]
    fn proxy_get_header_map_pairs(map_type: u32, return_map_data: *mut *mut u8, return_map_size: *mut usize) -> u32;
    /// The proxy-wasm ABI's `replace_header_map_value` (the SDK's wrapper panics on any status
    /// but Ok, which Envoy answers for a header map it no longer lends).
    #[allow(clashing_extern_declarations)]
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    /// The proxy-wasm ABI's `remove_header_map_value` (the SDK's wrapper panics likewise).
    #[allow(clashing_extern_declarations)]
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
    /// The proxy-wasm ABI's `add_header_map_value` (the SDK's wrapper panics likewise).
    #[allow(clashing_extern_declarations)]
    fn proxy_add_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    /// The proxy-wasm ABI's `get_property` (the SDK's wrapper panics on an unexpected status).
    #[allow(clashing_extern_declarations)]
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    /// The proxy-wasm ABI's `set_property` (the SDK's wrapper panics on any status but Ok).
    fn proxy_set_property(path_data: *const u8, path_size: usize, value_data: *const u8, value_size: usize) -> u32;
    /// The proxy-wasm ABI's `call_foreign_function` (Envoy's `declare_property` is one).
    fn proxy_call_foreign_function(
        function_name_data: *const u8,
        function_name_size: usize,
        arguments_data: *const u8,
        arguments_size: usize,
        results_data: *mut *mut u8,
        results_size: *mut usize,
    ) -> u32;
    /// The proxy-wasm ABI 0.2.1 local reply (as declared by the SDK, which passes no details).
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    /// The proxy-wasm ABI's log call.
    fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
    /// The host's log level for this plugin (Envoy: its `wasm` logger's level, trace 0 to off 6).
    /// Declared with a plain integer: the SDK's enum has no value for "off".
    fn proxy_get_log_level(return_level: *mut u32) -> u32;
}

/// Sends a local reply (`headers`: the ABI's serialized header map); the host's status (0: Ok).
/// `grpc_status`: the status a gRPC request's reply carries (`None`: Envoy maps the HTTP status).
pub fn send_local_response(status: u16, details: &str, headers: &[u8], body: &[u8], grpc_status: Option<i32>) -> u32 {
    meter::call(Kind::SendResponse);
    // SAFETY: every pointer is to memory we own for the duration of the call, with its length;
    // the host copies what it needs.
    unsafe {
        proxy_send_local_response(
            u32::from(status),
            details.as_ptr(),
            details.len(),
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            grpc_status.unwrap_or(-1),
        )
    }
}

/// Sets one top-level property (Envoy keeps it as filter state `wasm.<name>`); false if the host
/// refused (for example a value already set once: Envoy's default for these is write-once).
fn set_property(name: &str, value: &[u8]) -> bool {
    meter::call(Kind::SetProperty);
    // SAFETY: both pointers are to memory we own for the duration of the call, with its length.
    unsafe { proxy_set_property(name.as_ptr(), name.len(), value.as_ptr(), value.len()) == 0 }
}

/// The filter state an access log prints: `%FILTER_STATE(wasm.idemgate_outcome:PLAIN)%`.
pub const OUTCOME_PROPERTY: &str = "idemgate_outcome";
/// The full storage key's hex: `%FILTER_STATE(wasm.idemgate_key:PLAIN)%`.
pub const KEY_PROPERTY: &str = "idemgate_key";

/// Declares `KEY_PROPERTY` for this root context's streams with Envoy's life span `Request`
/// (its foreign function `declare_property`: a `DeclarePropertyArguments` message, name field 1,
/// span field 5 = `DownstreamRequest`; type `Bytes` and `readonly: false` are its defaults): a
/// stream's key then lives in the filter state Envoy carries into the streams it re-creates for
/// an internal redirect, and only those (`crate::redirect`, the request's mark). False if the
/// host refused (an Envoy without it: the key is filter-chain state, and a claim handed over to
/// a redirect is never taken, outcome-unknown).
pub fn declare_request_key() -> bool {
    meter::call(Kind::SetProperty);
    let name = KEY_PROPERTY.as_bytes();
    let mut args = Vec::with_capacity(name.len() + 4);
    args.push(0x0a); // field 1 (name), length-delimited
    args.push(name.len() as u8); // under 128 bytes: one varint byte
    args.extend_from_slice(name);
    args.extend_from_slice(&[0x28, 0x01]); // field 5 (span), varint: DownstreamRequest
    let f = "declare_property";
    let mut out: *mut u8 = std::ptr::null_mut();
    let mut out_size: usize = 0;
    // SAFETY: the name and arguments are memory we own for the duration of the call, with their
    // lengths; `declare_property` returns no result (had it, the host would allocate it through
    // this module's allocator, and it would leak: never freed, never read).
    let status =
        unsafe { proxy_call_foreign_function(f.as_ptr(), f.len(), args.as_ptr(), args.len(), &mut out, &mut out_size) };
    status == 0
}

/// Leaves the request's mark for an internal redirect (`crate::redirect`): its storage key's hex
/// in `KEY_PROPERTY`, Request-life state (`declare_request_key`), where the access log reads it
/// too. False if the host refused.
pub fn mark(skey: &StorageKey) -> bool {
    set_property(KEY_PROPERTY, skey.hex().as_bytes())
}

/// The request's mark in this stream's filter state (`mark`, by the stream Envoy re-created
/// this one from), if any.
pub fn read_mark() -> Option<StorageKey> {
    let hex = property(&[KEY_PROPERTY])?;
    crate::hex::decode::<32>(&hex).map(StorageKey)
}

/// Leaves a protected request's outcome slug and its storage key (64 hex digits, as in the log
/// lines) in the stream's filter state, for Envoy's access logs. Called once per request, where
/// its end is decided; a refusal is logged, never more.
pub fn publish(outcome: &str, key: Option<&StorageKey>) {
    let key_set = key.is_none_or(|k| set_property(KEY_PROPERTY, k.hex().as_bytes()));
    if !set_property(OUTCOME_PROPERTY, outcome.as_bytes()) || !key_set {
        log::debug!("idemgate: filter state not set for outcome={outcome}");
    }
}

/// Random bytes from WASI `random_get` where the host offers it (wasm32-wasip1).
pub fn entropy() -> Vec<u8> {
    #[cfg(target_os = "wasi")]
    {
        #[link(wasm_import_module = "wasi_snapshot_preview1")]
        extern "C" {
            fn random_get(buf: *mut u8, len: usize) -> u16;
        }
        let mut buf = [0u8; 16];
        meter::call(Kind::Other);
        // SAFETY: the host writes at most `len` bytes into the buffer we own.
        let errno = unsafe { random_get(buf.as_mut_ptr(), buf.len()) };
        if errno == 0 {
            return buf.to_vec();
        }
    }
    vec![]
}

/// idemgate's logger: every line goes to the host's log (`proxy_log`) through `host.rs`.
struct HostLogger;

static LOGGER: HostLogger = HostLogger;

impl log::Log for HostLogger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        // The ABI's levels: trace 0, debug 1, info 2, warn 3, error 4.
        let level = match record.level() {
            log::Level::Trace => 0,
            log::Level::Debug => 1,
            log::Level::Info => 2,
            log::Level::Warn => 3,
            log::Level::Error => 4,
        };
        write_log(level, &record.args().to_string());
    }

    fn flush(&self) {}
}

fn write_log(level: u32, message: &str) {
    meter::call(Kind::Log);
    // SAFETY: the pointer is to memory we own for the duration of the call, with its length.
    unsafe {
        proxy_log(level, message.as_ptr(), message.len());
    }
}

/// Installs idemgate's logger (every level on, until the host's level is read) and a panic hook
/// that logs the panic (critical) before the VM aborts. No host call: safe in `_initialize`.
pub fn init_logging() {
    if log::set_logger(&LOGGER).is_ok() {
        std::panic::set_hook(Box::new(|info| write_log(5, &info.to_string())));
    }
    log::set_max_level(log::LevelFilter::Trace);
}

/// The `log` crate's filter for the host's level: a line the host would drop is never built.
pub fn level_filter(host_level: u32) -> log::LevelFilter {
    match host_level {
        0 => log::LevelFilter::Trace,
        1 => log::LevelFilter::Debug,
        2 => log::LevelFilter::Info,
        3 => log::LevelFilter::Warn,
        4 => log::LevelFilter::Error,
        // critical, off (or a level this build does not know): idemgate logs nothing so severe.
        _ => log::LevelFilter::Off,
    }
}

/// Asks the host which lines it keeps (Envoy: `--component-log-level wasm:<level>`, or its admin
/// `/logging` endpoint at run time) and builds only those from now on. Called when the plugin is
/// configured and on every tick, so a level changed at run time applies within a tick. A host
/// that does not answer leaves every line on (the host filters them, as before).
pub fn refresh_log_level() {
    let mut level = 0u32;
    meter::call(Kind::Other);
    // SAFETY: the host writes one u32 into memory we own.
    let status = unsafe { proxy_get_log_level(&mut level) };
    log::set_max_level(if status == 0 { level_filter(level) } else { log::LevelFilter::Trace });
}

/// The names and the counting rules are the core's (`crate::metrics`), shared with the native build.
pub use crate::metrics::{route_counter_name, Counter, Gauge, Histogram, BUILD_INFO, SETTLED_COUNTER};

/// Counter increments and gauge moves not yet handed to the host, for the whole VM (every root
/// context's and HTTP context's, whatever configuration they were created under): a counter or a
/// gauge's move costs no host call where it is made, and one per distinct metric when flushed
/// (`flush_counters`: the root's tick, every 100 ms, and its end).
#[derive(Default)]
struct Pending {
    /// (metric id, increments not yet flushed).
    counts: Vec<(u32, u64)>,
    /// (gauge id, net move not yet flushed): `Metrics::add`.
    moves: Vec<(u32, i64)>,
    /// (histogram id, value) not yet recorded: `Metrics::record`.
    values: Vec<(u32, u64)>,
    /// Requests whose `on_log` ran since the last flush.
    logged: u64,
    /// The id of `SETTLED_COUNTER` (defined when a root is configured).
    settled: Option<u32>,
    /// No timer: every increment is flushed at once.
    at_once: bool,
}

thread_local! {
    static PENDING: std::cell::RefCell<Pending> = std::cell::RefCell::new(Pending::default());
}

fn count_pending(id: u32) {
    let at_once = PENDING.with(|p| {
        let mut p = p.borrow_mut();
        match p.counts.iter_mut().find(|(i, _)| *i == id) {
            Some((_, n)) => *n += 1,
            None => p.counts.push((id, 1)),
        }
        p.at_once
    });
    if at_once {
        flush_counters();
    }
}

/// A request's `on_log` ran (its counters are all counted by then): it is counted in
/// `SETTLED_COUNTER` by the flush that hands them to the host.
pub fn request_settled() {
    let at_once = PENDING.with(|p| {
        let mut p = p.borrow_mut();
        p.logged += 1;
        p.at_once
    });
    if at_once {
        flush_counters();
    }
}

/// Hands every pending counter increment and gauge move to the host, one call per metric whose
/// figure changed: gauges that rose first, then the counters, then the number of requests
/// settled since the last flush (so a reader that sees it reach N sees every counter of those N
/// requests), then gauges that fell (so a reader that sees `store_writes_pending` fall to 0 sees
/// every counter of the writes that ended; a write queued and ended within one tick never shows
/// in it, its moves netted out).
pub fn flush_counters() {
    let (counts, moves, values, logged, settled) = PENDING.with(|p| {
        let mut p = p.borrow_mut();
        (
            std::mem::take(&mut p.counts),
            std::mem::take(&mut p.moves),
            std::mem::take(&mut p.values),
            std::mem::take(&mut p.logged),
            p.settled,
        )
    });
    for &(id, delta) in moves.iter().filter(|(_, d)| *d > 0) {
        increment_metric(id, delta);
    }
    for (id, value) in values {
        record_metric(id, value);
    }
    for (id, n) in counts {
        increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
    }
    if let (Some(id), true) = (settled, logged > 0) {
        increment_metric(id, i64::try_from(logged).unwrap_or(i64::MAX));
    }
    for &(id, delta) in moves.iter().filter(|(_, d)| *d < 0) {
        increment_metric(id, delta);
    }
}

/// A gauge's move, handed to the host by the next flush (net of the moves before it: a write
/// pushed and ended between two ticks costs no host call).
fn move_pending(id: u32, delta: i64) {
    let at_once = PENDING.with(|p| {
        let mut p = p.borrow_mut();
        match p.moves.iter_mut().find(|(i, _)| *i == id) {
            Some((_, d)) => *d = d.saturating_add(delta),
            None => p.moves.push((id, delta)),
        }
        p.at_once
    });
    if at_once {
        flush_counters();
    }
}

/// Without a timer nothing would flush the counters: from now on each is handed over at once.
pub fn flush_counters_at_once() {
    PENDING.with(|p| p.borrow_mut().at_once = true);
    flush_counters();
}

/// The most histogram values held for the next flush.
const VALUES_MAX: usize = 1024;

/// Metric ids, defined once per VM.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    ids: Vec<Option<u32>>,
    gauges: Vec<Option<u32>>,
    histograms: Vec<Option<u32>>,
    /// Per configured route (none without `routes`: the totals are the one policy's), its
    /// counters in `Counter::ALL` order (`None` for a counter counted in total only,
    /// `Counter::per_route`).
    per_route: Vec<Vec<Option<u32>>>,
}

impl Metrics {
    /// Defines the totals, the gauges, the histograms, the build info, `SETTLED_COUNTER` and, for
    /// each route (its label, `config::Route::name`), its own counters (routes of one label share
    /// them).
    pub fn define(routes: &[&str]) -> Metrics {
        if let Some(id) = define_counter(SETTLED_COUNTER) {
            PENDING.with(|p| p.borrow_mut().settled = Some(id));
        }
        if let Some(id) = define_gauge(BUILD_INFO) {
            record_metric(id, 1);
        }
        let mut per_route: Vec<Vec<Option<u32>>> = Vec::with_capacity(routes.len());
        for (i, label) in routes.iter().enumerate() {
            let ids = match routes[..i].iter().position(|l| l == label).and_then(|j| per_route.get(j)) {
                Some(same) => same.clone(),
                None => Counter::ALL
                    .iter()
                    .map(|c| if c.per_route() { define_counter(&route_counter_name(label, *c)) } else { None })
                    .collect(),
            };
            per_route.push(ids);
        }
        Metrics {
            ids: Counter::ALL.iter().map(|c| define_counter(c.name())).collect(),
            gauges: Gauge::ALL.iter().map(|g| define_gauge(g.name())).collect(),
            histograms: Histogram::ALL.iter().map(|h| define_histogram(h.name())).collect(),
            per_route,
        }
    }

    /// Records `value` in histogram `h`: one host call, made by the next flush (the root's tick,
    /// as counters are: none on the request's path), or at once when `VALUES_MAX` wait already.
    /// Envoy merges histograms on its own stats flush (seconds), so the tick's delay never shows.
    pub fn record(&self, h: Histogram, value: u64) {
        let Some(Some(id)) = self.histograms.get(h as usize) else { return };
        let flush = PENDING.with(|p| {
            let mut p = p.borrow_mut();
            p.values.push((*id, value));
            p.at_once || p.values.len() >= VALUES_MAX
        });
        if flush {
            flush_counters();
        }
    }

    /// Counts `c` in total and, when the request's policy is known, for its route (in Envoy's
    /// /stats at the next flush).
    pub fn inc_for(&self, c: Counter, policy_index: Option<usize>) {
        self.inc(c);
        if let Some(Some(id)) = policy_index.and_then(|i| self.per_route.get(i)).and_then(|ids| ids.get(c as usize)) {
            count_pending(*id);
        }
    }

    /// Gauges are set at once (they are read as levels, and move rarely).
    pub fn set(&self, g: Gauge, value: u64) {
        if let Some(Some(id)) = self.gauges.get(g as usize) {
            record_metric(*id, value);
        }
    }

    /// Adds `delta` (negative to subtract) to a gauge that every worker moves by its own share:
    /// in Envoy's /stats at the next flush, as counters are (`flush_counters`).
    pub fn add(&self, g: Gauge, delta: i64) {
        if let Some(Some(id)) = self.gauges.get(g as usize) {
            move_pending(*id, delta);
        }
    }

    /// Counts `c` (in Envoy's /stats at the next flush).
    pub fn inc(&self, c: Counter) {
        // `ALL` lists the counters in declaration order, so a counter's discriminant is its index.
        if let Some(Some(id)) = self.ids.get(c as usize) {
            count_pending(*id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Counter;

    #[test]
    fn idemgate_builds_exactly_the_lines_the_hosts_level_keeps() {
        use log::LevelFilter::*;
        let expected = [Trace, Debug, Info, Warn, Error, Off, Off, Off];
        for (host_level, want) in expected.iter().enumerate() {
            assert_eq!(super::level_filter(host_level as u32), *want, "host level {host_level}");
        }
        assert_eq!(super::level_filter(u32::MAX), Off);
    }

    #[test]
    fn every_counter_sits_at_its_own_index_with_a_distinct_name() {
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i, "{c:?}");
        }
        for (i, g) in super::Gauge::ALL.iter().enumerate() {
            assert_eq!(*g as usize, i, "{g:?}");
        }
        let names: std::collections::HashSet<&str> =
            Counter::ALL.iter().map(|c| c.name()).chain(super::Gauge::ALL.iter().map(|g| g.name())).collect();
        assert_eq!(names.len(), Counter::ALL.len() + super::Gauge::ALL.len());
    }

    /// The ABI's map format, written as `reply::serialize_headers` writes it.
    fn map(pairs: &[(&[u8], &[u8])]) -> Vec<u8> {
        let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
        for (k, v) in pairs {
            out.extend_from_slice(&(k.len() as u32).to_le_bytes());
            out.extend_from_slice(&(v.len() as u32).to_le_bytes());
        }
        for (k, v) in pairs {
            out.extend_from_slice(k);
            out.push(0);
            out.extend_from_slice(v);
            out.push(0);
        }
        out
    }

    #[test]
    fn a_header_map_is_read_as_the_host_serializes_it() {
        let bytes = map(&[(b":method", b"POST"), (b"x-empty", b""), (b"x-bin", b"\xff\x00a")]);
        let got = super::parse_header_map(&bytes).expect("well formed");
        assert_eq!(
            got,
            vec![
                (":method".to_string(), b"POST".to_vec()),
                ("x-empty".to_string(), vec![]),
                ("x-bin".to_string(), b"\xff\x00a".to_vec()),
            ]
        );
        assert_eq!(super::parse_header_map(&[]), Some(vec![]));
        assert_eq!(super::parse_header_map(&map(&[])), Some(vec![]));
    }

    #[test]
    fn a_malformed_header_map_is_refused_never_a_panic() {
        let good = map(&[(b"a", b"bc"), (b"dd", b"e")]);
        // Every truncation, and every single byte changed, is either refused or read in bounds.
        for n in 0..good.len() {
            assert_eq!(super::parse_header_map(&good[..n]), if n == 0 { Some(vec![]) } else { None }, "cut at {n}");
        }
        for i in 0..good.len() {
            for b in [0u8, 1, 0x7f, 0xff] {
                let mut bad = good.clone();
                bad[i] = b;
                let _ = super::parse_header_map(&bad);
            }
        }
        // A count the bytes cannot hold (no allocation for it), lengths past the end, no NUL.
        assert_eq!(super::parse_header_map(&u32::MAX.to_le_bytes()), None);
        let mut long = good.clone();
        long[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(super::parse_header_map(&long), None);
        let mut no_nul = good.clone();
        let last = no_nul.len() - 1;
        no_nul[last] = b'x';
        assert_eq!(super::parse_header_map(&no_nul), None);
    }

    #[test]
    fn a_property_path_is_joined_as_the_sdk_joins_it() {
        let mut buf = [0u8; super::PROPERTY_PATH_BYTES];
        assert_eq!(
            super::property_path(&["upstream", "request_attempt_count"], &mut buf),
            Some(&b"upstream\0request_attempt_count"[..])
        );
        assert_eq!(super::property_path(&["response", "code_details"], &mut buf), Some(&b"response\0code_details"[..]));
        assert_eq!(super::property_path(&["plugin_root_id"], &mut buf), Some(&b"plugin_root_id"[..]));
        assert_eq!(super::property_path(&[], &mut buf), Some(&b""[..]));
        // Too long for the buffer: None (the caller joins it on the heap), never a panic.
        let mut small = [0u8; 8];
        assert_eq!(super::property_path(&["upstream", "address"], &mut small), None);
        assert_eq!(super::property_path(&["12345678"], &mut small), Some(&b"12345678"[..]));
        assert_eq!(super::property_path(&["1234567", "a"], &mut small), None);
        // Every property idemgate reads fits.
        for p in
            [&["xds", "route_name"][..], &["connection", "id"], &["response", "flags"], &["upstream", "local_address"]]
        {
            assert_eq!(super::property_path(p, &mut buf).map(<[u8]>::len), Some(p.join("\0").len()));
        }
    }

    #[test]
    fn route_counters_are_named_by_the_routes_label() {
        assert_eq!(super::route_counter_name("refunds", Counter::Replayed), "idemgate.route.refunds.replayed");
        assert_eq!(
            super::route_counter_name("v1_pay", Counter::StorePassed),
            "idemgate.route.v1_pay.store_passed_unprotected"
        );
        // What only the root counts is not repeated per route.
        assert!(!Counter::StoreWrites.per_route() && !Counter::LocalSweepPasses.per_route());
        assert!(Counter::Replayed.per_route() && Counter::StoreUnavailable.per_route());
    }

    /// docs/operating.md's metrics table names every series once, with its type and whether it
    /// exists per route, and nothing else.
    #[test]
    fn every_series_is_in_the_metrics_table() {
        let doc = include_str!("../../docs/operating.md");
        let at = doc.find("<!-- metrics-table").expect("the metrics-table marker");
        let rows: Vec<Vec<&str>> = doc[at..]
            .lines()
            .skip(3)
            .take_while(|l| l.starts_with('|'))
            .map(|l| l.trim_matches('|').split(" | ").map(str::trim).collect())
            .collect();
        let prom = |n: &str| format!("`idemgate_{}`", n.trim_start_matches("idemgate."));
        let mut want: Vec<(String, &str, &str)> = vec![("`idemgate_build_info`".into(), "gauge", "no")];
        for c in Counter::ALL {
            want.push((prom(c.name()), "counter", if c.per_route() { "yes" } else { "no" }));
        }
        want.push((prom(super::SETTLED_COUNTER), "counter", "no"));
        for g in super::Gauge::ALL {
            want.push((prom(g.name()), "gauge", "no"));
        }
        for h in super::Histogram::ALL {
            let base = h.name().trim_start_matches("idemgate.");
            want.push((format!("`idemgate_{base}_bucket`, `_sum`, `_count`"), "histogram", "no"));
        }
        let mut got: Vec<(String, &str, &str)> = rows.iter().map(|r| (r[0].to_string(), r[1], r[3])).collect();
        want.sort();
        got.sort();
        assert_eq!(got, want);
    }

    #[test]
    fn histograms_sit_at_their_own_index_with_a_distinct_name() {
        for (i, h) in super::Histogram::ALL.iter().enumerate() {
            assert_eq!(*h as usize, i, "{h:?}");
        }
        let names: std::collections::HashSet<&str> = super::Histogram::ALL.iter().map(|h| h.name()).collect();
        assert_eq!(names.len(), super::Histogram::ALL.len());
        assert_eq!(super::BUILD_INFO, format!("idemgate.build_info.{}", env!("CARGO_PKG_VERSION")));
    }
}
