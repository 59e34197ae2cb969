//! idemgate: `Idempotency-Key` enforcement at the edge, as a proxy-wasm filter for Envoy.
//!
//! The crate is split in two (see ARCHITECTURE.md):
//! - the **core** (every module here but `filter`): plain Rust with no host calls. It holds the
//!   rules (key syntax, caller scope, fingerprint, record format, decisions, problem documents,
//!   configuration) and is tested natively and on wasm32 under Node.js;
//! - the **filter** (`src/filter`, behind the default `proxy-wasm` feature): the thin glue that
//!   turns Envoy's callbacks into core inputs and core decisions into host calls.
//!
//! The core never imports `proxy_wasm`.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod admin;
pub mod backend;
pub mod base64;
pub mod canonical_json;
pub mod config;
pub mod decision;
pub mod derive;
pub mod encoding;
pub mod engine;
pub mod etcd;
pub mod failsafe;
pub mod fingerprint;
pub mod form;
pub mod hex;
pub mod key;
pub mod lifecycle;
pub mod local;
pub mod mcp;
pub mod metrics;
pub mod multipart;
pub mod owner;
pub mod path;
pub mod probe;
pub mod problem;
pub mod record;
pub mod redirect;
pub mod release;
pub mod request;
pub mod scope;
pub mod seal;
pub mod sha1;
pub mod store;
pub mod wait;

#[cfg(feature = "proxy-wasm")]
mod bench_host;
#[cfg(feature = "proxy-wasm")]
mod filter;
