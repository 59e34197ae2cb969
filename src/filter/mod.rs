//! The proxy-wasm glue (placeholder until the filter lands).
