#!/usr/bin/env bash
# Runs the core's unit tests compiled to wasm32 under Node.js with wasm-bindgen-test.
# The proxy-wasm glue is left out (--no-default-features): its imports have no host under Node.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=wasm32-unknown-unknown
scripts/install-deps.sh wasm-toolchain "$TARGET"
scripts/install-deps.sh wasm-bindgen
command -v node >/dev/null || { echo "test-wasm: Node.js is required (apt-get install nodejs)" >&2; exit 1; }
. scripts/wasm-env.sh
wasm_env "$TARGET"
export CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner
# shellcheck disable=SC2086
cargo test --locked --target "$TARGET" --target-dir "$WASM_TARGET_DIR" $WASM_CARGO_FLAGS --no-default-features --lib
