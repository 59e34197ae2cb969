//! idemgate as an Envoy dynamic module (`libidemgate_native.so`): the same engine as the Wasm
//! filter (`idemgate::engine`, `idemgate::local`, every rule of the core), behind Envoy's dynamic
//! module C ABI instead of proxy-wasm. Loaded by `envoy.extensions.filters.http.dynamic_modules`
//! (docs/native.md).
//!
//! - `abi.rs`: the ABI's types and callbacks, written here from Envoy's C header;
//! - `host.rs`: every call into Envoy, as plain values;
//! - `shared.rs`: the local tier's shared data in process memory (sharded, CAS);
//! - `http.rs`: one request through `engine::machine`, and what this build refuses at load;
//! - `store.rs`: the Redis store (webdis) over Envoy's HTTP callouts, writes on the main thread;
//! - this file: the event hooks Envoy looks up by name.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod abi;
mod host;
pub mod http;
mod metrics;
pub mod shared;
pub mod store;
mod timer;

use std::sync::Arc;

use abi::{EnvoyBuffer, EnvoyPtr, ModulePtr};
use http::{Filter, Global};
use idemgate::engine::machine::LogLevel;

/// The event the configuration's timer posts to the main thread (`Global::on_scheduled`: the
/// store's writes due, the local table's sweep and gauges).
pub const TICK_EVENT: u64 = 2;

/// Envoy calls this once when it loads the module: the ABI version this module was written for.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const u8 {
    abi::ABI_VERSION.as_ptr()
}

/// A filter configuration (`filter_config`: idemgate's JSON configuration, as a
/// `google.protobuf.StringValue`). Null refuses it: Envoy then refuses the listener.
///
/// # Safety
/// Called by Envoy with buffers valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy: EnvoyPtr,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> ModulePtr {
    // SAFETY: Envoy's buffer for this call.
    let raw = unsafe { config.bytes() };
    host::log(LogLevel::Info, &idemgate::release::configured_line());
    match Global::configure(raw, config_envoy) {
        Ok(g) => {
            let tier = match g.config.store.as_ref() {
                Some(s) if s.kind == idemgate::config::StoreKind::Etcd => {
                    format!("store: cluster {:?} (etcd)", s.cluster)
                }
                Some(s) => format!("store: cluster {:?} (Redis through webdis)", s.cluster),
                None => "local tier only".to_string(),
            };
            host::log(
                LogLevel::Info,
                &format!(
                    "idemgate (native): configuration accepted ({} route(s), {tier}, local.max_entries: {})",
                    g.config.routes.len(),
                    g.config.local.max_entries
                ),
            );
            Arc::into_raw(Arc::new(g)).cast()
        }
        Err(why) => {
            host::log(LogLevel::Error, &why);
            std::ptr::null()
        }
    }
}

/// # Safety
/// `config` is a pointer `envoy_dynamic_module_on_http_filter_config_new` returned.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: ModulePtr) {
    if !config.is_null() {
        // SAFETY: made by `Arc::into_raw` in config_new; Envoy destroys it once.
        let global = unsafe { Arc::from_raw(config.cast::<Global>()) };
        // Envoy calls this from the configuration's destructor, its stats still alive (and only
        // once every filter of it is gone: each holds the configuration).
        global.stop();
        drop(global);
    }
}

/// # Safety
/// `config` is a live configuration of this module.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(config: ModulePtr, envoy: EnvoyPtr) -> ModulePtr {
    if config.is_null() {
        return std::ptr::null();
    }
    let ptr = config.cast::<Global>();
    // SAFETY: the configuration outlives its filters (Envoy's contract); one more owner taken.
    let global = unsafe {
        Arc::increment_strong_count(ptr);
        Arc::from_raw(ptr)
    };
    Box::into_raw(Box::new(Filter::new(envoy, global))).cast()
}

/// The filter behind a module pointer.
///
/// # Safety
/// `f` is a pointer `envoy_dynamic_module_on_http_filter_new` returned and not yet destroyed;
/// Envoy calls one stream's hooks one at a time on its worker.
unsafe fn filter<'a>(f: ModulePtr) -> Option<&'a mut Filter> {
    // SAFETY: per the contract above.
    unsafe { f.cast_mut().cast::<Filter>().as_mut() }
}

/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: EnvoyPtr,
    f: ModulePtr,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: Envoy's hook contract.
    unsafe { filter(f) }.map_or(abi::HEADERS_CONTINUE, |f| f.request_headers(envoy, end_of_stream))
}

/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: EnvoyPtr,
    f: ModulePtr,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: Envoy's hook contract.
    unsafe { filter(f) }.map_or(abi::BODY_CONTINUE, |f| f.request_body(envoy, end_of_stream))
}

/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(envoy: EnvoyPtr, f: ModulePtr) -> u32 {
    // SAFETY: Envoy's hook contract.
    unsafe { filter(f) }.map_or(abi::TRAILERS_CONTINUE, |f| f.request_trailers(envoy))
}

/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: EnvoyPtr,
    f: ModulePtr,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: Envoy's hook contract.
    unsafe { filter(f) }.map_or(abi::HEADERS_CONTINUE, |f| f.response_headers(envoy, end_of_stream))
}

/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy: EnvoyPtr,
    f: ModulePtr,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: Envoy's hook contract.
    unsafe { filter(f) }.map_or(abi::BODY_CONTINUE, |f| f.response_body(envoy, end_of_stream))
}

/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(envoy: EnvoyPtr, f: ModulePtr) -> u32 {
    // SAFETY: Envoy's hook contract.
    unsafe { filter(f) }.map_or(abi::TRAILERS_CONTINUE, |f| f.response_trailers(envoy))
}

/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(envoy: EnvoyPtr, f: ModulePtr) {
    // SAFETY: Envoy's hook contract.
    if let Some(f) = unsafe { filter(f) } {
        f.stream_complete(envoy);
    }
}

/// # Safety
/// `f` is a pointer `envoy_dynamic_module_on_http_filter_new` returned; Envoy destroys it once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(f: ModulePtr) {
    if !f.is_null() {
        // SAFETY: made by `Box::into_raw` in filter_new.
        drop(unsafe { Box::from_raw(f.cast_mut().cast::<Filter>()) });
    }
}

/// The answer to a stream's store callout, on the stream's worker thread. Not called for a
/// stream already destroyed (Envoy cancels its callouts); a call from within `host::callout`
/// (Envoy answering before it returns) is left to the refusal that call returns.
///
/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    envoy: EnvoyPtr,
    f: ModulePtr,
    callout_id: u64,
    result: u32,
    headers: *const abi::EnvoyHttpHeader,
    headers_size: usize,
    body: *const EnvoyBuffer,
    body_size: usize,
) {
    if host::sending() {
        return;
    }
    // SAFETY: the hook's arrays, valid for the hook.
    let (status, body) = unsafe { host::callout_answer(result, headers, headers_size, body, body_size) };
    // SAFETY: Envoy's hook contract.
    if let Some(f) = unsafe { filter(f) } {
        f.callout_done(envoy, callout_id, status, &body);
    }
}

/// A stream's scheduled event (`http::WAIT_EVENT`: a request held by `in_flight: "wait"` is
/// checked; `http::DETACHED_EVENT`: a detached request's answer is there), on its worker. Envoy calls it only while the filter is not destroyed.
///
/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(envoy: EnvoyPtr, f: ModulePtr, event_id: u64) {
    // SAFETY: Envoy's hook contract.
    match (unsafe { filter(f) }, event_id) {
        (Some(f), http::WAIT_EVENT) => f.scheduled(envoy),
        (Some(f), http::DETACHED_EVENT) => f.detached_told(envoy),
        _ => {}
    }
}

/// The configuration's global state behind its module pointer (not owned).
///
/// # Safety
/// `config` is a live configuration of this module.
unsafe fn global<'a>(config: ModulePtr) -> Option<&'a Global> {
    // SAFETY: made by `Arc::into_raw` in config_new, alive until config_destroy.
    unsafe { config.cast::<Global>().as_ref() }
}

/// An event posted to the main thread (queued writes, the timer: a retry or the sweep due).
///
/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _config_envoy: EnvoyPtr,
    config: ModulePtr,
    _event_id: u64,
) {
    // SAFETY: Envoy's hook contract.
    if let Some(g) = unsafe { global(config) } {
        g.on_scheduled();
    }
}

/// The answer to a configuration callout (a store write, a detached forward or its hop probe), on
/// the main thread.
///
/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _config_envoy: EnvoyPtr,
    config: ModulePtr,
    callout_id: u64,
    result: u32,
    headers: *const abi::EnvoyHttpHeader,
    headers_size: usize,
    body: *const EnvoyBuffer,
    body_size: usize,
) {
    if host::sending() {
        return;
    }
    // SAFETY: the hook's arrays, valid for the hook.
    let (status, answer) = unsafe { host::callout_answer(result, headers, headers_size, body, body_size) };
    // SAFETY: as above (a detached forward's answer and its hop probe's are read with their headers).
    let headers = unsafe { host::callout_headers(result, headers, headers_size) };
    // SAFETY: Envoy's hook contract.
    if let Some(g) = unsafe { global(config) } {
        g.callout_answered(callout_id, status, headers, &answer);
    }
}

// A detached forward's stream (`envoy_dynamic_module_callback_http_filter_config_start_http_stream`,
// main thread): its answer in parts, gathered by `Detached` until it completes or is reset.

/// A forward's stream: its response headers.
///
/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_headers(
    _config_envoy: EnvoyPtr,
    config: ModulePtr,
    stream_id: u64,
    headers: *const abi::EnvoyHttpHeader,
    headers_size: usize,
    _end_stream: bool,
) {
    // SAFETY: the hook's array, valid for the hook.
    let headers = unsafe { host::stream_headers(headers, headers_size) };
    // SAFETY: Envoy's hook contract.
    if let Some(g) = unsafe { global(config) } {
        g.detached.on_stream_headers(stream_id, headers);
    }
}

/// A forward's stream: part of its response body.
///
/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_data(
    _config_envoy: EnvoyPtr,
    config: ModulePtr,
    stream_id: u64,
    data: *const EnvoyBuffer,
    data_count: usize,
    _end_stream: bool,
) {
    // SAFETY: Envoy's hook contract; the hook's array, valid for the hook.
    if let Some(g) = unsafe { global(config) } {
        unsafe { g.detached.on_stream_data(stream_id, data, data_count) };
    }
}

/// A forward's stream: its response trailers.
///
/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_trailers(
    _config_envoy: EnvoyPtr,
    config: ModulePtr,
    stream_id: u64,
    trailers: *const abi::EnvoyHttpHeader,
    trailers_size: usize,
) {
    // SAFETY: the hook's array, valid for the hook.
    let trailers = unsafe { host::stream_headers(trailers, trailers_size) };
    // SAFETY: Envoy's hook contract.
    if let Some(g) = unsafe { global(config) } {
        g.detached.on_stream_trailers(stream_id, trailers);
    }
}

/// A forward's stream ended with its whole answer.
///
/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_complete(
    _config_envoy: EnvoyPtr,
    config: ModulePtr,
    stream_id: u64,
) {
    // SAFETY: Envoy's hook contract.
    if let Some(g) = unsafe { global(config) } {
        g.detached.on_stream_end(g, stream_id, true);
    }
}

/// A forward's stream reset: no response.
///
/// # Safety
/// Envoy's hook contract.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_reset(
    _config_envoy: EnvoyPtr,
    config: ModulePtr,
    stream_id: u64,
    _reason: u32,
) {
    // SAFETY: Envoy's hook contract.
    if let Some(g) = unsafe { global(config) } {
        g.detached.on_stream_end(g, stream_id, false);
    }
}

// Hooks Envoy 1.40 requires to exist (it looks each up at configuration) for features this build
// does not use yet: streams started by a filter, watermarks. This
// build starts none of them, so Envoy never calls these with anything of ours; each does nothing.

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _envoy: EnvoyPtr,
    _f: ModulePtr,
    _stream_id: u64,
    _headers: *const abi::EnvoyHttpHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _envoy: EnvoyPtr,
    _f: ModulePtr,
    _stream_id: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _envoy: EnvoyPtr,
    _f: ModulePtr,
    _stream_id: u64,
    _trailers: *const abi::EnvoyHttpHeader,
    _trailers_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _envoy: EnvoyPtr,
    _f: ModulePtr,
    _stream_id: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _envoy: EnvoyPtr,
    _f: ModulePtr,
    _stream_id: u64,
    _reason: u32,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _envoy: EnvoyPtr,
    _f: ModulePtr,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _envoy: EnvoyPtr,
    _f: ModulePtr,
) {
}
