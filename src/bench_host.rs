//! Glue built only for `make bench`, kept apart from the filter's glue (`src/filter/`): the
//! benchmarks' floors (`floor.rs`, feature `bench-floor`), the empty pass-through filter (feature
//! `empty-filter`, below), and the counting meter of host calls and allocations (`meter.rs`, which
//! counts only in the `count-host-calls` build and is a set of empty inline functions otherwise;
//! `filter::host` calls it before every host call).

#[cfg(all(feature = "bench-floor", not(feature = "empty-filter")))]
mod floor;
pub(crate) mod meter;

#[cfg(any(feature = "empty-filter", feature = "bench-floor"))]
use proxy_wasm::traits::RootContext;
#[cfg(feature = "empty-filter")]
use proxy_wasm::traits::{Context, HttpContext};
#[cfg(feature = "empty-filter")]
use proxy_wasm::types::{ContextType, MapType};

#[cfg(feature = "empty-filter")]
use crate::filter::host;

// Benchmarks only (`--features empty-filter`): the floor of any Wasm filter, reading one header.
#[cfg(feature = "empty-filter")]
proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(EmptyRoot) });
}}

// Benchmarks only (`--features bench-floor`): the floors idemgate's first request is measured
// against (`floor.rs`).
#[cfg(all(feature = "bench-floor", not(feature = "empty-filter")))]
proxy_wasm::main! {{
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> { Box::new(floor::FloorRoot::new(id)) });
}}

#[cfg(feature = "empty-filter")]
struct EmptyRoot;
#[cfg(feature = "empty-filter")]
impl Context for EmptyRoot {}
#[cfg(feature = "empty-filter")]
impl RootContext for EmptyRoot {
    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(EmptyHttp))
    }
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
#[cfg(feature = "empty-filter")]
struct EmptyHttp;
#[cfg(feature = "empty-filter")]
impl Context for EmptyHttp {}
#[cfg(feature = "empty-filter")]
impl HttpContext for EmptyHttp {
    fn on_http_request_headers(&mut self, _n: usize, _eos: bool) -> proxy_wasm::types::Action {
        let _ = host::header(MapType::HttpRequestHeaders, "idempotency-key");
        proxy_wasm::types::Action::Continue
    }
}
