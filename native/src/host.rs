//! Every call into Envoy, wrapped so that the rest of the glue sees plain values. The only file
//! with `unsafe` calls to the ABI (`abi.rs`); the pointers it passes live for the call.

use crate::abi::{self, EnvoyBuffer, EnvoyHttpHeader, EnvoyPtr, ModuleBuffer, ModuleHttpHeader};
use idemgate::engine::machine::LogLevel;
use idemgate::scope::StorageKey;

fn level(l: LogLevel) -> u32 {
    match l {
        LogLevel::Error => abi::LOG_ERROR,
        LogLevel::Warn => abi::LOG_WARN,
        LogLevel::Info => abi::LOG_INFO,
        LogLevel::Debug => abi::LOG_DEBUG,
    }
}

/// Whether Envoy logs lines of `l` (component `dynamic_modules`).
pub fn logs(l: LogLevel) -> bool {
    // SAFETY: a plain value in, a bool out.
    unsafe { abi::envoy_dynamic_module_callback_log_enabled(level(l)) }
}

/// A line in Envoy's log (component `dynamic_modules`).
pub fn log(l: LogLevel, line: &str) {
    if logs(l) {
        // SAFETY: the buffer lives for the call.
        unsafe { abi::envoy_dynamic_module_callback_log(level(l), ModuleBuffer::of(line.as_bytes())) }
    }
}

/// The first value of header `name` in map `kind`.
pub fn header(f: EnvoyPtr, kind: u32, name: &str) -> Option<Vec<u8>> {
    let mut out = EnvoyBuffer::NULL;
    let mut count: usize = 0;
    // SAFETY: `f` is the filter Envoy passed to the current hook; `out` and `count` are writable.
    let ok = unsafe {
        abi::envoy_dynamic_module_callback_http_get_header(
            f,
            kind,
            ModuleBuffer::of(name.as_bytes()),
            &mut out,
            0,
            &mut count,
        )
    };
    if !ok || count == 0 || out.ptr.is_null() {
        return None;
    }
    // SAFETY: Envoy's buffer, valid during the hook; copied now.
    Some(unsafe { out.bytes() }.to_vec())
}

/// Every line of map `kind`, in order (names as Envoy keeps them: lowercase).
pub fn all_headers(f: EnvoyPtr, kind: u32) -> Vec<(String, Vec<u8>)> {
    // SAFETY: `f` is the current hook's filter.
    let n = unsafe { abi::envoy_dynamic_module_callback_http_get_headers_size(f, kind) };
    if n == 0 {
        return vec![];
    }
    let empty =
        EnvoyHttpHeader { key_ptr: std::ptr::null(), key_length: 0, value_ptr: std::ptr::null(), value_length: 0 };
    let mut raw = vec![empty; n];
    // SAFETY: `raw` has room for the `n` headers Envoy just counted.
    if !unsafe { abi::envoy_dynamic_module_callback_http_get_headers(f, kind, raw.as_mut_ptr()) } {
        return vec![];
    }
    // SAFETY: Envoy's buffers, valid during the hook; copied now.
    raw.iter().map(|h| unsafe { copied(h) }).collect()
}

/// One header line Envoy handed over, copied out of its buffers (the name as Envoy gave it).
///
/// # Safety
/// `h`'s pointers are Envoy's, valid for the current hook.
unsafe fn copied(h: &EnvoyHttpHeader) -> (String, Vec<u8>) {
    // SAFETY: the caller's.
    let k = unsafe { EnvoyBuffer { ptr: h.key_ptr, length: h.key_length }.bytes() };
    // SAFETY: as above.
    let v = unsafe { EnvoyBuffer { ptr: h.value_ptr, length: h.value_length }.bytes() };
    // Names are ASCII in practice: checked once and copied once (`from_utf8_lossy` scans them
    // chunk by chunk first); a name that is not UTF-8 is still read as before.
    let name = match std::str::from_utf8(k) {
        Ok(name) => name.to_owned(),
        Err(_) => String::from_utf8_lossy(k).into_owned(),
    };
    (name, v.to_vec())
}

/// The filter state keys an access log prints, the Wasm build's (`idemgate::filter::host`: Envoy
/// keeps a Wasm property `<name>` as `wasm.<name>`), so one access log format serves both builds:
/// `%FILTER_STATE(wasm.idemgate_outcome:PLAIN)%` and `%FILTER_STATE(wasm.idemgate_key:PLAIN)%`.
pub const OUTCOME_STATE: &str = "wasm.idemgate_outcome";
pub const KEY_STATE: &str = "wasm.idemgate_key";

/// Leaves a protected request's outcome slug and storage key (its 64 hex digits) in the stream's
/// filter state; false if Envoy refused either.
pub fn publish(f: EnvoyPtr, outcome: &str, key_hex: Option<&str>) -> bool {
    let set = |k: &str, v: &str| {
        // SAFETY: the buffers live for the call; Envoy copies them.
        unsafe {
            abi::envoy_dynamic_module_callback_http_set_filter_state_bytes(
                f,
                ModuleBuffer::of(k.as_bytes()),
                ModuleBuffer::of(v.as_bytes()),
            )
        }
    };
    let key_set = key_hex.is_none_or(|k| set(KEY_STATE, k));
    set(OUTCOME_STATE, outcome) && key_set
}

/// The filter state key of the request's mark for an internal redirect (`idemgate::redirect`):
/// the claim's storage key, an object with Envoy's life span `Request`.
pub const MARK_STATE: &str = "idemgate.redirect_mark";

/// Frees a mark Envoy drops (`mark`'s destructor).
unsafe extern "C" fn drop_mark(object: *mut std::ffi::c_void) {
    if !object.is_null() {
        // SAFETY: `mark` gave Envoy this pointer from `Box::into_raw` of a `StorageKey`, and
        // Envoy calls the destructor once.
        drop(unsafe { Box::from_raw(object.cast::<StorageKey>()) });
    }
}

/// Leaves the request's mark (its storage key) in the stream's filter state with the life span
/// `Request`, which Envoy carries into the streams it re-creates for this request and no other;
/// false if Envoy refused.
pub fn mark(f: EnvoyPtr, skey: &StorageKey) -> bool {
    let object = Box::into_raw(Box::new(*skey)).cast::<std::ffi::c_void>();
    // SAFETY: the key's buffer lives for the call; the object is Envoy's from here, freed through
    // `drop_mark` (also when Envoy refuses it).
    unsafe {
        abi::envoy_dynamic_module_callback_http_set_filter_state_object(
            f,
            ModuleBuffer::of(MARK_STATE.as_bytes()),
            object,
            drop_mark,
            abi::LIFE_SPAN_REQUEST,
        )
    }
}

/// The request's mark in the stream's filter state (`mark`, by the stream Envoy re-created this
/// one from), if any.
pub fn read_mark(f: EnvoyPtr) -> Option<StorageKey> {
    // SAFETY: the key's buffer lives for the call.
    let object = unsafe {
        abi::envoy_dynamic_module_callback_http_get_filter_state_object(f, ModuleBuffer::of(MARK_STATE.as_bytes()))
    };
    if object.is_null() {
        return None;
    }
    // SAFETY: only `mark` stores an object under this key: a `StorageKey` Envoy keeps alive
    // while the request's filter state lives, which outlasts this hook.
    Some(unsafe { *object.cast::<StorageKey>() })
}

/// Sets (`Some`) or removes (`None`) header `name` in map `kind`: false if Envoy refused.
pub fn set_header(f: EnvoyPtr, kind: u32, name: &str, value: Option<&str>) -> bool {
    let v = match value {
        Some(v) => ModuleBuffer::of(v.as_bytes()),
        None => ModuleBuffer { ptr: std::ptr::null(), length: 0 },
    };
    // SAFETY: the buffers live for the call.
    unsafe { abi::envoy_dynamic_module_callback_http_set_header(f, kind, ModuleBuffer::of(name.as_bytes()), v) }
}

/// Adds a line to map `kind`.
pub fn add_header(f: EnvoyPtr, kind: u32, name: &str, value: &str) -> bool {
    // SAFETY: the buffers live for the call.
    unsafe {
        abi::envoy_dynamic_module_callback_http_add_header(
            f,
            kind,
            ModuleBuffer::of(name.as_bytes()),
            ModuleBuffer::of(value.as_bytes()),
        )
    }
}

/// A local reply with response code details (`idemgate_<slug>`).
pub fn send_response(f: EnvoyPtr, status: u16, headers: &[(&str, &str)], body: &[u8], details: &str) {
    let mut h: Vec<ModuleHttpHeader> = headers
        .iter()
        .map(|(n, v)| ModuleHttpHeader {
            key_ptr: n.as_ptr(),
            key_length: n.len(),
            value_ptr: v.as_ptr(),
            value_length: v.len(),
        })
        .collect();
    // SAFETY: `h`, `body` and `details` live for the call; Envoy copies them.
    unsafe {
        abi::envoy_dynamic_module_callback_http_send_response(
            f,
            u32::from(status),
            h.as_mut_ptr(),
            h.len(),
            ModuleBuffer::of(body),
            ModuleBuffer::of(details.as_bytes()),
        )
    }
}

/// The bytes of body `kind` (received in this hook, or buffered so far), copied.
pub fn body(f: EnvoyPtr, kind: u32) -> Vec<u8> {
    // SAFETY: `f` is the current hook's filter.
    let n = unsafe { abi::envoy_dynamic_module_callback_http_get_body_chunks_size(f, kind) };
    if n == 0 {
        return vec![];
    }
    let mut chunks = vec![EnvoyBuffer::NULL; n];
    // SAFETY: `chunks` has room for the `n` chunks Envoy just counted.
    if !unsafe { abi::envoy_dynamic_module_callback_http_get_body_chunks(f, kind, chunks.as_mut_ptr()) } {
        return vec![];
    }
    let mut out = Vec::with_capacity(chunks.iter().map(|c| c.length).sum());
    for c in chunks {
        // SAFETY: Envoy's buffers, valid during the hook.
        out.extend_from_slice(unsafe { c.bytes() });
    }
    out
}

/// A string attribute of the stream (`abi::ATTRIBUTE_*`), copied.
pub fn attribute_string(f: EnvoyPtr, id: u32) -> Option<Vec<u8>> {
    let mut out = EnvoyBuffer::NULL;
    let len: *mut usize = &mut out.length;
    // SAFETY: `out` is writable and `len` points into it (see the declaration in abi.rs).
    let ok = unsafe { abi::envoy_dynamic_module_callback_http_filter_get_attribute_string(f, id, &mut out, len) };
    // SAFETY: Envoy's buffer, valid during the hook; copied now.
    (ok && !out.ptr.is_null()).then(|| unsafe { out.bytes() }.to_vec())
}

/// An integer attribute of the stream (`abi::ATTRIBUTE_*`).
pub fn attribute_int(f: EnvoyPtr, id: u32) -> Option<u64> {
    let mut out: u64 = 0;
    // SAFETY: `out` is writable for the call; `f` is the current hook's filter.
    unsafe { abi::envoy_dynamic_module_callback_http_filter_get_attribute_int(f, id, &mut out) }.then_some(out)
}

/// The stream's downstream connection id (`connection.id`), if it has a connection.
pub fn connection_id(f: EnvoyPtr) -> Option<u64> {
    attribute_int(f, abi::ATTRIBUTE_CONNECTION_ID)
}

/// Milliseconds since the epoch (the process clock: every worker reads the same one).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Nanoseconds since the epoch.
pub fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// 32 random bytes from the kernel (empty if it has none to give).
pub fn entropy() -> Vec<u8> {
    use std::io::Read;
    let mut b = [0u8; 32];
    match std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)) {
        Ok(()) => b.to_vec(),
        Err(_) => vec![],
    }
}

fn module_headers(headers: &[(&str, &str)]) -> Vec<ModuleHttpHeader> {
    headers
        .iter()
        .map(|(n, v)| ModuleHttpHeader {
            key_ptr: n.as_ptr(),
            key_length: n.len(),
            value_ptr: v.as_ptr(),
            value_length: v.len(),
        })
        .collect()
}

thread_local! {
    static SENDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside `callout` (a done hook called from within it).
pub fn sending() -> bool {
    SENDING.with(std::cell::Cell::get)
}

/// Where a callout is sent from: the stream (answered on its worker, cancelled with it) or the
/// filter configuration (main thread only, answered there).
#[derive(Clone, Copy)]
pub enum CalloutFrom {
    Stream(EnvoyPtr),
    Config(abi::ConfigEnvoyPtr),
}

/// Sends an HTTP callout to `cluster`: its id, or Envoy's refusal (`envoy_dynamic_module_type_
/// http_callout_init_result`).
pub fn callout(
    from: CalloutFrom,
    cluster: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout_ms: u64,
) -> Result<u64, u32> {
    let mut h = module_headers(headers);
    let mut id: u64 = 0;
    // Envoy may answer a callout before returning (a request that never left it): the done hook
    // sees `sending()` and leaves it to the refusal returned here.
    SENDING.with(|s| s.set(true));
    let cluster = ModuleBuffer::of(cluster.as_bytes());
    // SAFETY: every buffer lives for the call (Envoy copies them into the request it makes).
    let r = unsafe {
        match from {
            CalloutFrom::Stream(f) => abi::envoy_dynamic_module_callback_http_filter_http_callout(
                f,
                &mut id,
                cluster,
                h.as_mut_ptr(),
                h.len(),
                ModuleBuffer::of(body),
                timeout_ms,
            ),
            CalloutFrom::Config(c) => abi::envoy_dynamic_module_callback_http_filter_config_http_callout(
                c,
                &mut id,
                cluster,
                h.as_mut_ptr(),
                h.len(),
                ModuleBuffer::of(body),
                timeout_ms,
            ),
        }
    };
    SENDING.with(|s| s.set(false));
    if r == abi::CALLOUT_INIT_SUCCESS {
        Ok(id)
    } else {
        Err(r)
    }
}

/// Starts an HTTP stream of configuration `c` to `cluster` with the whole request (headers, then
/// `body` ending it): its id, or Envoy's refusal. An answer Envoy gives before returning (a
/// request that never left it) is not handed to the stream's hooks: the refusal says it.
pub fn config_stream(
    c: abi::ConfigEnvoyPtr,
    cluster: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout_ms: u64,
) -> Result<u64, u32> {
    let mut h = module_headers(headers);
    let mut id: u64 = 0;
    SENDING.with(|s| s.set(true));
    // SAFETY: every buffer lives for the call (Envoy copies them into the request it makes).
    let r = unsafe {
        abi::envoy_dynamic_module_callback_http_filter_config_start_http_stream(
            c,
            &mut id,
            ModuleBuffer::of(cluster.as_bytes()),
            h.as_mut_ptr(),
            h.len(),
            ModuleBuffer::of(body),
            true,
            timeout_ms,
        )
    };
    SENDING.with(|s| s.set(false));
    if r == abi::CALLOUT_INIT_SUCCESS {
        Ok(id)
    } else {
        Err(r)
    }
}

/// The headers (or trailers) a stream hook hands over, names lowercased, copied.
///
/// # Safety
/// `headers`: Envoy's array of `size` entries, valid during the hook (or null).
pub unsafe fn stream_headers(headers: *const EnvoyHttpHeader, size: usize) -> Vec<(String, Vec<u8>)> {
    if headers.is_null() {
        return vec![];
    }
    // SAFETY: the caller's.
    let hs = unsafe { std::slice::from_raw_parts(headers, size) };
    hs.iter()
        .map(|h| {
            // SAFETY: Envoy's buffers, valid during the hook.
            let (k, v) = unsafe { copied(h) };
            (k.to_ascii_lowercase(), v)
        })
        .collect()
}

/// Appends the buffers a stream's data hook hands over to `out`, up to `limit` bytes in all:
/// whether they fitted.
///
/// # Safety
/// `data`: Envoy's array of `count` buffers, valid during the hook (or null).
pub unsafe fn stream_data(data: *const EnvoyBuffer, count: usize, out: &mut Vec<u8>, limit: usize) -> bool {
    if data.is_null() {
        return true;
    }
    // SAFETY: the caller's.
    for b in unsafe { std::slice::from_raw_parts(data, count) } {
        // SAFETY: as above.
        let bytes = unsafe { b.bytes() };
        if out.len().saturating_add(bytes.len()) > limit {
            return false;
        }
        out.extend_from_slice(bytes);
    }
    true
}

/// A callout's answer as the done hook hands it: the HTTP status (`None`: no response, a reset
/// or a response over Envoy's buffer limit) and the body, copied.
///
/// # Safety
/// The pointers are the done hook's, valid for the hook.
pub unsafe fn callout_answer(
    result: u32,
    headers: *const EnvoyHttpHeader,
    headers_size: usize,
    body: *const EnvoyBuffer,
    body_size: usize,
) -> (Option<u16>, Vec<u8>) {
    if result != abi::CALLOUT_SUCCESS || headers.is_null() {
        return (None, vec![]);
    }
    // SAFETY: Envoy's arrays of `headers_size` and `body_size` entries, valid during the hook.
    let hs = unsafe { std::slice::from_raw_parts(headers, headers_size) };
    let status = hs.iter().find_map(|h| {
        // SAFETY: Envoy's buffers, valid during the hook.
        let k = unsafe { EnvoyBuffer { ptr: h.key_ptr, length: h.key_length }.bytes() };
        (k == b":status").then(|| {
            // SAFETY: as above.
            let v = unsafe { EnvoyBuffer { ptr: h.value_ptr, length: h.value_length }.bytes() };
            std::str::from_utf8(v).ok().and_then(|s| s.parse::<u16>().ok())
        })?
    });
    let mut out = vec![];
    if !body.is_null() {
        // SAFETY: as above.
        for c in unsafe { std::slice::from_raw_parts(body, body_size) } {
            // SAFETY: as above.
            out.extend_from_slice(unsafe { c.bytes() });
        }
    }
    (status, out)
}

/// A callout's answer's headers as the done hook hands them (none without a response), copied.
///
/// # Safety
/// The pointers are the done hook's, valid for the hook.
pub unsafe fn callout_headers(
    result: u32,
    headers: *const EnvoyHttpHeader,
    headers_size: usize,
) -> Vec<(String, Vec<u8>)> {
    if result != abi::CALLOUT_SUCCESS {
        return vec![];
    }
    // SAFETY: Envoy's array of `headers_size` entries (or null), valid during the hook.
    unsafe { stream_headers(headers, headers_size) }
}

/// Resumes the stream's request (paused on a store call).
pub fn continue_decoding(f: EnvoyPtr) {
    // SAFETY: `f` is the filter Envoy passed to the current hook.
    unsafe { abi::envoy_dynamic_module_callback_http_filter_continue_decoding(f) }
}

/// A main-thread scheduler of configuration `c` (call on the main thread).
pub fn scheduler_new(c: abi::ConfigEnvoyPtr) -> abi::SchedulerPtr {
    // SAFETY: `c` is the configuration Envoy passed to `config_new`, on the main thread.
    unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(c) }
}

/// Posts event `id` to the main thread (from any thread).
pub fn scheduler_commit(s: abi::SchedulerPtr, id: u64) {
    if !s.is_null() {
        // SAFETY: a scheduler made by `scheduler_new`, never deleted (docs: native.md).
        unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(s, id) }
    }
}

/// A scheduler posting events to stream `f`'s worker (`on_http_filter_scheduled`), made from the
/// current hook's filter; deleted with `stream_scheduler_delete`.
pub fn stream_scheduler_new(f: EnvoyPtr) -> abi::SchedulerPtr {
    // SAFETY: `f` is the filter Envoy passed to the current hook.
    unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_new(f) }
}

/// Posts event `id` to a stream's worker (from any thread): a no-op once the stream's filter is
/// destroyed (Envoy's weak pointer), but `s` must not be deleted yet.
pub fn stream_scheduler_commit(s: abi::SchedulerPtr, id: u64) {
    if !s.is_null() {
        // SAFETY: a scheduler made by `stream_scheduler_new` and not yet deleted (the caller's).
        unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_commit(s, id) }
    }
}

/// Frees a stream's scheduler (once, after its last commit).
pub fn stream_scheduler_delete(s: abi::SchedulerPtr) {
    if !s.is_null() {
        // SAFETY: made by `stream_scheduler_new`, deleted only here, once (`http::wait::Waiting`).
        unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_delete(s) }
    }
}

/// One of the ABI's `define_*` metric callbacks (`abi.rs`: the same arguments for each kind).
type DefineMetric =
    unsafe extern "C" fn(abi::ConfigEnvoyPtr, ModuleBuffer, *const ModuleBuffer, usize, *mut usize) -> u32;

/// Defines metric `name` of configuration `c` with the ABI's `define` of its kind, without
/// labels: its id, if Envoy defined it.
fn define_metric(c: abi::ConfigEnvoyPtr, name: &str, define: DefineMetric) -> Option<usize> {
    let mut id: usize = 0;
    // SAFETY: `c` is the configuration Envoy is creating (the callers run during
    // `on_http_filter_config_new`); the name lives for the call; no labels (a null array of 0).
    let r = unsafe { define(c, ModuleBuffer::of(name.as_bytes()), std::ptr::null(), 0, &mut id) };
    (r == abi::METRICS_SUCCESS).then_some(id)
}

/// Defines counter `name` of configuration `c` (during `on_http_filter_config_new`): its id.
pub fn define_counter(c: abi::ConfigEnvoyPtr, name: &str) -> Option<usize> {
    define_metric(c, name, abi::envoy_dynamic_module_callback_http_filter_config_define_counter)
}

/// Defines gauge `name` of configuration `c`: its id.
pub fn define_gauge(c: abi::ConfigEnvoyPtr, name: &str) -> Option<usize> {
    define_metric(c, name, abi::envoy_dynamic_module_callback_http_filter_config_define_gauge)
}

/// Defines histogram `name` of configuration `c`: its id.
pub fn define_histogram(c: abi::ConfigEnvoyPtr, name: &str) -> Option<usize> {
    define_metric(c, name, abi::envoy_dynamic_module_callback_http_filter_config_define_histogram)
}

/// Adds 1 to counter `id` from stream `f`'s hook.
pub fn increment_counter(f: EnvoyPtr, id: usize) {
    // SAFETY: `f` is the current hook's filter; an id its configuration defined; no labels.
    let _ = unsafe { abi::envoy_dynamic_module_callback_http_filter_increment_counter(f, id, std::ptr::null(), 0, 1) };
}

/// Adds 1 to counter `id` of configuration `c` (outside a stream: the main thread's writes).
pub fn config_increment_counter(c: abi::ConfigEnvoyPtr, id: usize) {
    // SAFETY: `c` is a live configuration (its `Global` holds the metrics); no labels.
    let _ = unsafe {
        abi::envoy_dynamic_module_callback_http_filter_config_increment_counter(c, id, std::ptr::null(), 0, 1)
    };
}

/// Records `value` in histogram `id` from stream `f`'s hook.
pub fn record_histogram(f: EnvoyPtr, id: usize, value: u64) {
    // SAFETY: as `increment_counter`.
    let _ = unsafe {
        abi::envoy_dynamic_module_callback_http_filter_record_histogram_value(f, id, std::ptr::null(), 0, value)
    };
}

/// Records `value` in histogram `id` of configuration `c` (outside a stream: the main thread's
/// settlements).
pub fn config_record_histogram(c: abi::ConfigEnvoyPtr, id: usize, value: u64) {
    // SAFETY: as `config_increment_counter`.
    let _ = unsafe {
        abi::envoy_dynamic_module_callback_http_filter_config_record_histogram_value(c, id, std::ptr::null(), 0, value)
    };
}

/// Sets gauge `id` of configuration `c`.
pub fn set_gauge(c: abi::ConfigEnvoyPtr, id: usize, value: u64) {
    // SAFETY: as `config_increment_counter`.
    let _ =
        unsafe { abi::envoy_dynamic_module_callback_http_filter_config_set_gauge(c, id, std::ptr::null(), 0, value) };
}

/// Adds `delta` (negative: subtracts) to gauge `id` of configuration `c`: an atomic add in
/// Envoy's stats, callable from a worker or the main thread while the configuration lives.
pub fn add_gauge(c: abi::ConfigEnvoyPtr, id: usize, delta: i64) {
    let by = delta.unsigned_abs();
    // SAFETY: as `config_increment_counter`.
    let _ = unsafe {
        if delta >= 0 {
            abi::envoy_dynamic_module_callback_http_filter_config_increment_gauge(c, id, std::ptr::null(), 0, by)
        } else {
            abi::envoy_dynamic_module_callback_http_filter_config_decrement_gauge(c, id, std::ptr::null(), 0, by)
        }
    };
}
