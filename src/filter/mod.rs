//! The proxy-wasm glue: turns Envoy's callbacks into core inputs and core decisions into host
//! calls. No rule lives here; see ARCHITECTURE.md.

mod host;
mod http;
mod writes;

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::time::Duration;

use log::{error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel};

use crate::config::Config;
use crate::local::Table;
use crate::store;
use host::{Counter, HostShared, Metrics};
use writes::{Job, MAX_WRITE_ATTEMPTS};

/// The VM environment variable holding webdis credentials as `user:password` (set it in the Wasm
/// `vm_config.environment_variables`; it never appears in the plugin configuration).
pub const STORE_AUTH_ENV: &str = "IDEMGATE_STORE_AUTH";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> {
        Box::new(Root { id, shared: None, sweep_at: 0, jobs: Rc::new(RefCell::new(VecDeque::new())), calls: HashMap::new(), queue_id: None })
    });
}}

/// What a root context shares with the HTTP contexts it creates (same VM, same thread).
pub struct Shared {
    pub config: Config,
    pub table: Table,
    pub metrics: Metrics,
    /// Request-body bytes buffered by this VM right now.
    pub buffered: Cell<u64>,
    tokens: Cell<u64>,
    pub node: String,
    pub vm: u64,
    /// Writes handed to the root context, and the queue that wakes it.
    pub jobs: Rc<RefCell<VecDeque<Job>>>,
    pub queue_id: Option<u32>,
    /// `authorization` for the store, from the VM's environment.
    pub credentials: Option<String>,
}

impl Shared {
    pub fn next_token(&self) -> u64 {
        let n = self.tokens.get().wrapping_add(1);
        self.tokens.set(n);
        n
    }
}

/// Buckets each worker sweeps per tick, freeing expired records and their bytes.
const SWEEP_BUCKETS_PER_TICK: u32 = 64;

struct Root {
    id: u32,
    shared: Option<Rc<Shared>>,
    sweep_at: u32,
    jobs: Rc<RefCell<VecDeque<Job>>>,
    /// Store writes in flight, by callout token.
    calls: HashMap<u32, Job>,
    queue_id: Option<u32>,
}

impl Root {
    fn dispatch(&mut self, job: Job) {
        let Some(s) = self.shared.clone() else { return };
        let Some(cfg) = s.config.store.as_ref() else { return };
        s.metrics.inc(Counter::StoreCalls);
        match writes::dispatch(cfg, &job.request, s.credentials.as_deref()) {
            Ok(token) => {
                self.calls.insert(token, job);
            }
            Err(e) => self.failed(job, &e),
        }
    }

    /// A write failed: retry it, then its fallback, then give up (counted and logged).
    fn failed(&mut self, mut job: Job, why: &str) {
        let Some(s) = self.shared.clone() else { return };
        s.metrics.inc(Counter::StoreErrors);
        job.attempts = job.attempts.saturating_add(1);
        if job.attempts < MAX_WRITE_ATTEMPTS {
            s.metrics.inc(Counter::StoreWriteRetries);
            warn!("idemgate: store write {} for key={} failed ({why}); retrying", job.what, job.key_hash);
            self.dispatch(job);
        } else if let Some(fallback) = job.fallback.take() {
            s.metrics.inc(Counter::StoreWriteFailures);
            warn!(
                "idemgate: store write {} for key={} failed {} times ({why}); marking the outcome unknown",
                job.what, job.key_hash, job.attempts
            );
            self.dispatch(Job {
                what: "unknown_fallback",
                request: fallback,
                fallback: None,
                attempts: 0,
                key_hash: job.key_hash,
            });
        } else {
            s.metrics.inc(Counter::StoreWriteFailures);
            warn!(
                "idemgate: store write {} for key={} failed {} times ({why}); the claim stays in the store and will be judged outcome-unknown once its lock expires",
                job.what, job.key_hash, job.attempts
            );
        }
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let Some(job) = self.calls.remove(&token) else { return };
        let (status, body) = writes::answer(body_size, num_headers);
        match store::parse_transition_reply(status, &body) {
            Ok(changed) => {
                if let Some(s) = self.shared.as_ref() {
                    s.metrics.inc(Counter::StoreWrites);
                }
                if !changed {
                    info!("idemgate: store write {} for key={} found the claim no longer ours", job.what, job.key_hash);
                }
            }
            Err(e) => self.failed(job, &e.to_string()),
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = proxy_wasm::hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let config = match Config::parse(&raw) {
            Ok(c) => c,
            Err(e) => {
                error!("{e}");
                return false;
            }
        };
        let table = Table::new(&config.local);
        // Buckets are created where truly absent, never over a live one (see src/local.rs).
        match table.ensure_created(&mut HostShared) {
            Ok(created) if created > 0 => {
                info!("idemgate: local table created ({created} keys, {} buckets)", table.buckets())
            }
            Ok(_) => {}
            Err(e) => {
                error!("idemgate: cannot create the local table in shared data: {e:?}");
                return false;
            }
        }
        info!(
            "idemgate: configuration accepted ({} route(s), store: {}, local.max_entries: {})",
            config.routes.len(),
            config.store.as_ref().map_or("none", |s| s.cluster.as_str()),
            config.local.max_entries
        );
        let node =
            host::property(&["node", "id"]).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
        let vm = (u64::from(self.id) << 48) ^ host::now_nanos();
        if config.store.is_some() && self.queue_id.is_none() {
            // A queue of this root's own (same thread): HTTP contexts wake it to make writes.
            let name = format!("idemgate.writes.{}.{vm:x}", self.id);
            self.queue_id = hostcalls::register_shared_queue(&name).ok();
            if self.queue_id.is_none() {
                error!("idemgate: cannot register the store write queue");
                return false;
            }
        }
        let credentials = std::env::var(STORE_AUTH_ENV).ok().filter(|v| !v.is_empty()).map(|v| store::basic_auth(&v));
        self.shared = Some(Rc::new(Shared {
            config,
            table,
            metrics: Metrics::define(),
            buffered: Cell::new(0),
            tokens: Cell::new(0),
            node,
            vm,
            jobs: self.jobs.clone(),
            queue_id: self.queue_id,
            credentials,
        }));
        if proxy_wasm::hostcalls::set_tick_period(Duration::from_secs(1)).is_err() {
            warn!("idemgate: no timer: expired records are freed only when their bucket is reused");
        }
        true
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
        let pending: Vec<Job> = self.jobs.borrow_mut().drain(..).collect();
        for job in pending {
            self.dispatch(job);
        }
    }

    fn on_tick(&mut self) {
        let Some(s) = self.shared.as_ref() else { return };
        let buckets = s.table.buckets();
        match s.table.sweep(&mut HostShared, self.sweep_at, SWEEP_BUCKETS_PER_TICK, host::now_ms()) {
            Ok(n) => {
                for _ in 0..n {
                    s.metrics.inc(Counter::LocalSwept);
                }
            }
            Err(e) => warn!("idemgate: sweep failed: {e:?}"),
        }
        self.sweep_at = (self.sweep_at + SWEEP_BUCKETS_PER_TICK) % buckets.max(1);
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        match &self.shared {
            Some(s) => Some(Box::new(http::Http::new(s.clone()))),
            // Not configured (cannot happen once Envoy accepted the config): pass everything.
            None => Some(Box::new(Passthrough)),
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Passthrough;
impl Context for Passthrough {}
impl HttpContext for Passthrough {}
