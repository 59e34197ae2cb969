//! Benchmarks only (`--features bench-floor`, `scripts/build-wasm.sh --floor`, written to
//! dist/idemgate-floor.wasm; never shipped): the work no fingerprinting, storing filter can avoid,
//! so `make bench` can divide idemgate's first request by it. The plugin configuration chooses:
//!
//! - `{"idemgate_bench_floor": "empty"}`: reads one request header and continues (the empty filter,
//!   on the same POSTs as idemgate's first request);
//! - `"buffering"`: pauses at the request headers, takes the whole body at its end, continues;
//!   reads the response headers and every response body chunk (what idemgate must do to
//!   fingerprint a request and keep its response);
//! - `"store"`: the buffering floor plus one callout per request to the store cluster (a webdis
//!   `GET` of one key), waited for before continuing, and a second one after the response, made by
//!   the root context as idemgate's completion write is (handed over through the root's queue).
//!   With `"store_kind": "etcd"` both callouts are etcd writes instead (`POST /v3/kv/put` of one
//!   small value under idemgate's key prefix): a claim and a completion in etcd are writes, each
//!   one Raft commit (and fsync) that no etcd-backed filter can avoid, where a Redis claim is one
//!   script call whatever it does, so a `GET` stands for it.
//!
//! - `"shared"`: the buffering floor plus the local tier's shared-data traffic of a first request,
//!   call for call (`docs/BENCHMARKS.md`, host calls by kind; layout v4, 5 calls): at the request
//!   headers a bucket read (the look); at the end of the body a CAS write of the value read then
//!   (the claim); at the log the body key's write, then the bucket's read and CAS write
//!   (completed). Values of the sizes
//!   idemgate's are in the benchmark (`SHARED_BUCKET_BYTES`, `SHARED_SLOT_BYTES`), keys spread
//!   over `SHARED_BUCKETS` buckets made at configure time as idemgate's are. What idemgate's
//!   first request costs beyond this floor is its own work (hashing, fingerprinting, encoding).
//!
//! Nothing here decides anything: it only makes the host calls those steps need.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType};
use serde::Deserialize;

use crate::filter::host;

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Mode {
    Empty,
    Buffering,
    Store,
    Shared,
}

/// The shared floor's table: buckets and body keys of about the sizes idemgate's hold in the
/// benchmark (200,000 records: 6,250 buckets of about 160-byte entries, a few held each; a body
/// with the record of a 70-byte JSON response and its headers).
const SHARED_BUCKETS: u32 = 6250;
const SHARED_BUCKET_BYTES: usize = 22 + 4 * 160;
const SHARED_SLOT_BYTES: usize = 320;

/// A read, then a CAS write of the value read (one byte changed), as every state change of
/// idemgate's local table is.
fn touch(key: &str) {
    if let Ok((Some(mut v), cas)) = hostcalls::get_shared_data(key) {
        if let Some(b) = v.first_mut() {
            *b ^= 1;
        }
        let _ = hostcalls::set_shared_data(key, Some(&v), cas);
    }
}

/// What the `store` floor calls: webdis (`GET /GET/<key>`) or etcd (`POST /v3/kv/put`).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum StoreKind {
    #[default]
    Redis,
    Etcd,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FloorConfig {
    idemgate_bench_floor: Mode,
    #[serde(default)]
    store_kind: StoreKind,
    /// The store cluster, its authority and the key read (`store` only).
    #[serde(default = "default_cluster")]
    cluster: String,
    #[serde(default = "default_authority")]
    authority: String,
    #[serde(default = "default_key")]
    key: String,
    #[serde(default = "default_timeout_ms")]
    timeout_ms: u64,
}

fn default_cluster() -> String {
    "idemgate_store".into()
}
fn default_authority() -> String {
    "webdis".into()
}
fn default_key() -> String {
    "idemgate:v1:bench-floor".into()
}
fn default_timeout_ms() -> u64 {
    1000
}

struct Setup {
    mode: Mode,
    cluster: String,
    authority: String,
    method: &'static str,
    path: String,
    body: Option<Vec<u8>>,
    timeout: Duration,
    queue_id: Option<u32>,
    /// Second callouts handed to the root (one per finished request).
    pending: RefCell<VecDeque<()>>,
    /// `shared`: requests seen (spreads them over the buckets) and the names' prefix.
    seen: std::cell::Cell<u32>,
    prefix: String,
}

impl Setup {
    fn dispatch(&self) -> Option<u32> {
        let mut headers =
            vec![(":method", self.method), (":path", self.path.as_str()), (":authority", self.authority.as_str())];
        if self.body.is_some() {
            headers.push(("content-type", "application/json"));
        }
        hostcalls::dispatch_http_call(&self.cluster, headers, self.body.as_deref(), vec![], self.timeout).ok()
    }
}

/// Reads a callout's answer as idemgate reads a store answer: its status and whole body.
fn read_answer(num_headers: usize, body_size: usize) {
    if num_headers > 0 {
        let _ = host::header(MapType::HttpCallResponseHeaders, ":status");
    }
    let _ = host::buffer(BufferType::HttpCallResponseBody, body_size);
}

pub struct FloorRoot {
    id: u32,
    setup: Option<Rc<Setup>>,
}

impl FloorRoot {
    pub fn new(id: u32) -> FloorRoot {
        FloorRoot { id, setup: None }
    }
}

impl Context for FloorRoot {
    fn on_http_call_response(&mut self, _token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        read_answer(num_headers, body_size);
    }
}

impl RootContext for FloorRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw =
            hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX).ok().flatten().unwrap_or_default();
        let Ok(c) = serde_json::from_slice::<FloorConfig>(&raw) else {
            log::error!("idemgate bench floor: configuration refused (expected {{\"idemgate_bench_floor\": \"empty\" | \"buffering\" | \"store\" | \"shared\"}})");
            return false;
        };
        let name = format!("idemgate.floor.{}.{:x}", self.id, host::now_nanos());
        let queue_id = hostcalls::register_shared_queue(&name).ok();
        if queue_id.is_none() {
            return false;
        }
        let (method, path, body) = match c.store_kind {
            StoreKind::Redis => ("GET", format!("/GET/{}", c.key), None),
            StoreKind::Etcd => {
                let key = crate::base64::b64(c.key.as_bytes());
                let value = crate::base64::b64(b"bench-floor-value");
                let body = serde_json::json!({"key": key, "value": value}).to_string().into_bytes();
                ("POST", "/v3/kv/put".to_string(), Some(body))
            }
        };
        let prefix = "idemgate.floor.shared".to_string();
        if c.idemgate_bench_floor == Mode::Shared {
            // Made once, where absent, as idemgate's buckets are.
            let make = |key: String, bytes: usize| {
                if matches!(hostcalls::get_shared_data(&key), Ok((None, _))) {
                    let _ = hostcalls::set_shared_data(&key, Some(&vec![7u8; bytes]), None);
                }
            };
            for i in 0..SHARED_BUCKETS {
                make(format!("{prefix}.b.{i}"), SHARED_BUCKET_BYTES);
                make(format!("{prefix}.s.{i}"), SHARED_SLOT_BYTES);
            }
            make(format!("{prefix}.count"), 8);
            make(format!("{prefix}.usage"), 8);
        }
        self.setup = Some(Rc::new(Setup {
            seen: std::cell::Cell::new(0),
            prefix,
            mode: c.idemgate_bench_floor,
            method,
            path,
            body,
            cluster: c.cluster,
            authority: c.authority,
            timeout: Duration::from_millis(c.timeout_ms.max(1)),
            queue_id,
            pending: RefCell::new(VecDeque::new()),
        }));
        true
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
        let Some(s) = self.setup.as_ref() else { return };
        let n = s.pending.borrow_mut().drain(..).count();
        for _ in 0..n {
            let _ = s.dispatch();
        }
    }

    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        let setup = self.setup.clone()?;
        let n = setup.seen.get().wrapping_add(1);
        setup.seen.set(n);
        let bucket = format!("{}.b.{}", setup.prefix, n.wrapping_mul(2_654_435_761) % SHARED_BUCKETS);
        let slot = format!("{}.r.{}", setup.prefix, n.wrapping_mul(2_654_435_761) % SHARED_BUCKETS);
        Some(Box::new(FloorHttp { setup, body_size: 0, calling: None, bucket, slot, seen: None }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct FloorHttp {
    setup: Rc<Setup>,
    body_size: usize,
    calling: Option<u32>,
    /// `shared`: this request's bucket and slot, and the bucket as read at headers with its CAS.
    bucket: String,
    slot: String,
    seen: Option<(Vec<u8>, Option<u32>)>,
}

impl FloorHttp {
    /// The whole request is here: go on, or (store floor) wait for one callout first.
    fn request_complete(&mut self) -> Action {
        if let Some((mut v, cas)) = self.seen.take() {
            // The claim: a CAS write of the value read at headers.
            if let Some(b) = v.first_mut() {
                *b ^= 1;
            }
            let _ = hostcalls::set_shared_data(&self.bucket, Some(&v), cas);
        }
        if self.setup.mode != Mode::Store {
            return Action::Continue;
        }
        match self.setup.dispatch() {
            Some(token) => {
                self.calling = Some(token);
                Action::Pause
            }
            None => Action::Continue,
        }
    }
}

impl Context for FloorHttp {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        if self.calling != Some(token) {
            return;
        }
        self.calling = None;
        read_answer(num_headers, body_size);
        let _ = hostcalls::resume_http_request();
    }
}

impl HttpContext for FloorHttp {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        let _ = host::header(MapType::HttpRequestHeaders, "idempotency-key");
        if self.setup.mode == Mode::Shared {
            // The look: the bucket read, kept for the claim.
            if let Ok((Some(v), cas)) = hostcalls::get_shared_data(&self.bucket) {
                self.seen = Some((v, cas));
            }
        }
        match self.setup.mode {
            Mode::Empty => Action::Continue,
            _ if end_of_stream => self.request_complete(),
            _ => Action::Pause,
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.setup.mode == Mode::Empty {
            return Action::Continue;
        }
        if self.calling.is_some() {
            return Action::Pause;
        }
        self.body_size = body_size;
        if !end_of_stream {
            return Action::Pause;
        }
        let _ = host::buffer(BufferType::HttpRequestBody, self.body_size);
        self.request_complete()
    }

    fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        if self.setup.mode != Mode::Empty {
            let _ = host::all_headers(MapType::HttpResponseHeaders);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        if self.setup.mode != Mode::Empty {
            let _ = host::buffer(BufferType::HttpResponseBody, body_size);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if self.setup.mode == Mode::Shared {
            // The completed record's body key, then its bucket.
            let _ = hostcalls::set_shared_data(&self.slot, Some(&[7u8; SHARED_SLOT_BYTES]), None);
            touch(&self.bucket);
        }
        if self.setup.mode != Mode::Store {
            return;
        }
        // As idemgate's completion write: queued for the root, which makes the callout.
        self.setup.pending.borrow_mut().push_back(());
        if let Some(q) = self.setup.queue_id {
            let _ = hostcalls::enqueue_shared_queue(q, Some(b"w"));
        }
    }
}
