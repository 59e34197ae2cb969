//! The integration tests: one crate (one binary, `cargo test --test it`), one module per suite,
//! `support` compiled once. `make test-faults` runs every module named `faults` (`faults::`, the
//! fault cases of the other suites in their own `faults` submodules); `make test-native` runs the
//! rest. Select a suite by its module: `cargo test --test it -- single_proxy::`.

mod support;

mod agents;
mod bench_builds;
mod boundary_oracle;
mod boundary_spellings;
mod classification;
mod credentials;
mod detached_chain;
mod envoy_config;
mod etcd_store;
mod expiry;
mod fail_closed;
mod failover;
mod faults;
mod grpc;
mod internal_redirect;
mod interrupted;
mod lifecycle_tiers;
mod local_reply_config;
mod mcp;
mod mcp_sdk;
mod native_module;
mod next_hop;
mod operator_cli;
mod operator_cli_etcd;
mod probe_gate;
mod prometheus;
mod redis_ha;
mod releases;
mod replay_fidelity;
mod rollout;
mod scope_and_fingerprint;
mod sdk_clients;
mod shared_table;
mod shipped_configs;
mod single_proxy;
mod store_acl;
mod store_scripts;
mod store_support_smoke;
mod store_tls;
mod tombstones;
mod two_proxies;
mod upgrade;
mod webdis_late_answers;
