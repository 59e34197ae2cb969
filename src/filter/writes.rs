//! Store callouts: dispatching a store request through the store cluster and reading its answer.
//!
//! A callout made from an HTTP context dies with it when the client leaves, so every write that
//! must survive (completion, release, outcome-unknown) is handed to the root context: the HTTP
//! context pushes a `Job` (`crate::engine::writes`) and wakes the root through its shared queue;
//! the root feeds it to its write machine, which retries a failed write a bounded number of
//! times and falls back to marking the outcome unknown (never to absent).

use std::time::Duration;

use proxy_wasm::types::{BufferType, MapType};

use crate::config::StoreConfig;
use crate::store::StoreRequest;

/// Sends `req` to the store cluster with the current `authorization` (`Shared::credentials`).
pub fn dispatch(
    cfg: &StoreConfig,
    req: &StoreRequest,
    credentials: &std::cell::RefCell<Option<String>>,
) -> Result<u32, String> {
    let credentials = credentials.borrow();
    send(cfg, req, credentials.as_deref())
}

/// Sends `req` to the store cluster. Errors (unknown cluster, host refusal) are returned, never
/// panicked on.
pub fn send(cfg: &StoreConfig, req: &StoreRequest, credentials: Option<&str>) -> Result<u32, String> {
    let mut headers: Vec<(&str, &str)> =
        vec![(":method", req.method), (":path", req.path.as_str()), (":authority", cfg.authority.as_str())];
    if let Some(c) = credentials {
        headers.push(("authorization", c));
    }
    let timeout = Duration::from_millis(cfg.timeout_ms.max(1));
    crate::bench_host::meter::store_bytes(req.path.len() + req.body.len());
    super::host::dispatch_http_call(&cfg.cluster, headers, &req.body, timeout)
        .map_err(|s| format!("dispatch to cluster {:?} failed: {s:?}", cfg.cluster))
}

/// The answer of the callout being delivered: HTTP status (None: no answer) and body.
pub fn answer(body_size: usize, num_headers: usize) -> (Option<u16>, Vec<u8>) {
    if num_headers == 0 {
        return (None, vec![]);
    }
    let status = super::host::header(MapType::HttpCallResponseHeaders, ":status").and_then(|s| s.parse::<u16>().ok());
    let body = super::host::buffer(BufferType::HttpCallResponseBody, body_size);
    (status, body)
}
