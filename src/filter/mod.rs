//! The proxy-wasm glue: turns Envoy's callbacks into core inputs and core decisions into host
//! calls. No rule lives here; see ARCHITECTURE.md.

mod host;
mod http;

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use log::{error, info, warn};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel};

use crate::config::Config;
use crate::local::Table;
use host::{Counter, HostShared, Metrics};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> { Box::new(Root { id, shared: None, sweep_at: 0 }) });
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
}

impl Context for Root {}

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
        self.shared = Some(Rc::new(Shared {
            config,
            table,
            metrics: Metrics::define(),
            buffered: Cell::new(0),
            tokens: Cell::new(0),
            node,
            vm,
        }));
        if proxy_wasm::hostcalls::set_tick_period(Duration::from_secs(1)).is_err() {
            warn!("idemgate: no timer: expired records are freed only when their bucket is reused");
        }
        true
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
