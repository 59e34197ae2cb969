//! idemgate's metrics in Envoy's stats: the same names as the Wasm build's (`idemgate::metrics`:
//! `idemgate.<name>`, `idemgate.route.<route>.<name>`, the histograms, `idemgate.requests_settled`
//! and the build-info gauge), defined while Envoy creates the configuration (the ABI freezes
//! definitions after that hook) and counted through the core's rules: which counter an engine
//! event counts is `idemgate::metrics`'s, this file only hands the count to Envoy.
//!
//! Unlike the Wasm build (which batches counts in its VM and flushes them every 100 ms), each
//! count is handed to Envoy where it is made (an atomic add in Envoy's stats, no copy): a request's
//! `idemgate.requests_settled` is counted last in its `stream_complete`, after its other counters.

use idemgate::metrics::{route_counter_name, Counter, Gauge, Histogram, BUILD_INFO, SETTLED_COUNTER};

use crate::abi::{ConfigEnvoyPtr, EnvoyPtr};
use crate::host;

/// The ids Envoy gave this configuration's metrics (`None`: Envoy refused the definition; that
/// metric is then not counted).
pub struct Metrics {
    /// Indexed by `Counter as usize` (`Counter::ALL` is in declaration order).
    totals: Vec<Option<usize>>,
    /// Per route (`config.routes` index), then per counter; `None` for counters not per route.
    routes: Vec<Vec<Option<usize>>>,
    /// Indexed by `Histogram as usize`.
    histograms: Vec<Option<usize>>,
    /// Indexed by `Gauge as usize` (`Gauge::ALL` is in declaration order).
    gauges: Vec<Option<usize>>,
    settled: Option<usize>,
    /// The configuration (for counts made outside a stream, on the main thread: store writes),
    /// kept as an address so that `Metrics` can be shared by the workers (Envoy's counters are
    /// atomic).
    config: usize,
}

/// Where a count is made: in a stream's hook, or on the configuration (main thread).
#[derive(Clone, Copy)]
pub enum From {
    Stream(EnvoyPtr),
    Config,
}

impl Metrics {
    /// Defines every metric (call from `on_http_filter_config_new` only). `routes`: the labels of
    /// the configuration's routes (`config::Route::name`), in order; routes sharing a label share
    /// its counters, as in the Wasm build. `fixed`: the gauges whose value the configuration fixes
    /// (the local table's capacity and index bytes, set once, as the Wasm build does).
    pub fn define(config: ConfigEnvoyPtr, routes: &[&str], fixed: &[(Gauge, u64)]) -> Metrics {
        let settled = host::define_counter(config, SETTLED_COUNTER);
        if let Some(id) = host::define_gauge(config, BUILD_INFO) {
            host::set_gauge(config, id, 1);
        }
        // Every gauge of the core's (`Gauge::ALL`, in declaration order); those the
        // configuration fixes are set once here, the others by the tick (`set`, `add`).
        let gauges: Vec<Option<usize>> = Gauge::ALL.iter().map(|g| host::define_gauge(config, g.name())).collect();
        for (g, value) in fixed {
            if let Some(id) = gauges.get(*g as usize).copied().flatten() {
                host::set_gauge(config, id, *value);
            }
        }
        let mut per_route: Vec<Vec<Option<usize>>> = Vec::with_capacity(routes.len());
        for (i, label) in routes.iter().enumerate() {
            let ids = match routes.iter().take(i).position(|l| l == label).and_then(|j| per_route.get(j)) {
                Some(same) => same.clone(),
                None => Counter::ALL
                    .iter()
                    .map(|c| {
                        if c.per_route() {
                            host::define_counter(config, &route_counter_name(label, *c))
                        } else {
                            None
                        }
                    })
                    .collect(),
            };
            per_route.push(ids);
        }
        Metrics {
            totals: Counter::ALL.iter().map(|c| host::define_counter(config, c.name())).collect(),
            routes: per_route,
            histograms: Histogram::ALL.iter().map(|h| host::define_histogram(config, h.name())).collect(),
            gauges,
            settled,
            config: config as usize,
        }
    }

    fn add(&self, from: From, id: Option<usize>) {
        if let Some(id) = id {
            match from {
                From::Stream(f) => host::increment_counter(f, id),
                From::Config => host::config_increment_counter(self.config as ConfigEnvoyPtr, id),
            }
        }
    }

    /// Counts `c` in total and, for a counter kept per route, for route `route`.
    pub fn inc_for(&self, from: From, c: Counter, route: Option<usize>) {
        self.add(from, self.totals.get(c as usize).copied().flatten());
        let per_route = route.and_then(|r| self.routes.get(r)).and_then(|ids| ids.get(c as usize)).copied().flatten();
        self.add(from, per_route);
    }

    /// Counts `c` in total only.
    pub fn inc(&self, from: From, c: Counter) {
        self.inc_for(from, c, None);
    }

    /// Records `value` in histogram `h` (from a stream).
    pub fn record(&self, f: EnvoyPtr, h: Histogram, value: u64) {
        if let Some(id) = self.histograms.get(h as usize).copied().flatten() {
            host::record_histogram(f, id, value);
        }
    }

    /// Records `value` in histogram `h` from the configuration (the main thread: a detached
    /// forward's settlement, whether or not its client is still there).
    pub fn record_from_config(&self, h: Histogram, value: u64) {
        if let Some(id) = self.histograms.get(h as usize).copied().flatten() {
            host::config_record_histogram(self.config as ConfigEnvoyPtr, id, value);
        }
    }

    /// Sets gauge `g` (from the configuration's tick, on the main thread).
    pub fn set(&self, g: Gauge, value: u64) {
        if let Some(id) = self.gauges.get(g as usize).copied().flatten() {
            host::set_gauge(self.config as ConfigEnvoyPtr, id, value);
        }
    }

    /// Adds `delta` to gauge `g` (from any thread while the configuration lives: Envoy's add is
    /// atomic): `idemgate.store_writes_pending`, as the Wasm build moves it.
    pub fn add_gauge(&self, g: Gauge, delta: i64) {
        if let Some(id) = self.gauges.get(g as usize).copied().flatten() {
            host::add_gauge(self.config as ConfigEnvoyPtr, id, delta);
        }
    }

    /// A request's counters are all counted: `idemgate.requests_settled`.
    pub fn settled(&self, f: EnvoyPtr) {
        self.add(From::Stream(f), self.settled);
    }
}
