#!/usr/bin/env bash
# Builds dist/idemgate.wasm for wasm32-wasip1, choosing the toolchain by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=wasm32-wasip1
scripts/install-deps.sh wasm-toolchain "$TARGET"
. scripts/wasm-env.sh
wasm_env "$TARGET"
start=$(date +%s)
# shellcheck disable=SC2086
cargo build --locked --release --lib --target "$TARGET" --target-dir "$WASM_TARGET_DIR" $WASM_CARGO_FLAGS
mkdir -p dist
cp "$WASM_TARGET_DIR/$TARGET/release/idemgate.wasm" dist/idemgate.wasm
echo "build: dist/idemgate.wasm $(stat -c %s dist/idemgate.wasm) bytes ($TARGET, $WASM_TOOLCHAIN toolchain, $(( $(date +%s) - start )) s)"
