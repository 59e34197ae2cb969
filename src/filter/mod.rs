//! The proxy-wasm glue: turns Envoy's callbacks into core inputs and core decisions into host
//! calls. No rule lives here; see ARCHITECTURE.md.

use std::rc::Rc;

use log::{error, info};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use crate::config::Config;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { config: None }) });
}}

struct Root {
    config: Option<Rc<Config>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = proxy_wasm::hostcalls::get_buffer(proxy_wasm::types::BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        match Config::parse(&raw) {
            Ok(c) => {
                info!(
                    "idemgate: configuration accepted ({} route(s), store: {})",
                    c.routes.len(),
                    c.store.as_ref().map_or("none", |s| s.cluster.as_str())
                );
                self.config = Some(Rc::new(c));
                true
            }
            Err(e) => {
                error!("{e}");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Pass))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Pass;
impl Context for Pass {}
impl HttpContext for Pass {}
