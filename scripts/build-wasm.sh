#!/usr/bin/env bash
# Builds dist/idemgate.wasm for wasm32-wasip1, choosing the toolchain by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=wasm32-wasip1
# --empty: the benchmarks' empty pass-through filter, written to dist/empty.wasm.
FEATURES="" OUT=dist/idemgate.wasm SUBDIR=""
# --crash-injection: a test-only module that traps on demand, written to dist/idemgate-crash.wasm.
case "${1:-}" in
  --empty) FEATURES="--features empty-filter" OUT=dist/empty.wasm SUBDIR=/empty ;;
  --crash-injection) FEATURES="--features crash-injection" OUT=dist/idemgate-crash.wasm SUBDIR=/crash ;;
  # --floor: the benchmarks' floors (src/bench_host/floor.rs), written to dist/idemgate-floor.wasm.
  --floor) FEATURES="--features bench-floor" OUT=dist/idemgate-floor.wasm SUBDIR=/floor ;;
  # --count-host-calls: idemgate counting its host calls and allocations, dist/idemgate-count.wasm.
  --count-host-calls) FEATURES="--features count-host-calls" OUT=dist/idemgate-count.wasm SUBDIR=/count ;;
esac
scripts/install-deps.sh wasm-toolchain "$TARGET"
. scripts/wasm-env.sh
wasm_env "$TARGET"
start=$(date +%s)
# shellcheck disable=SC2086
cargo build --locked --release --lib --target "$TARGET" --target-dir "$WASM_TARGET_DIR$SUBDIR" $WASM_CARGO_FLAGS $FEATURES
mkdir -p dist
# binaryen's optimizer over rustc's output, for size (-Oz: 870,309 -> 748,737 bytes, 12,651 fewer
# than -O3; the core's per-step times of benches/hot_path.rs under Node, both passes applied to its
# wasm32 build and timed on the process's CPU clock in 8 alternating rounds, were not slower beyond
# noise: paired ratios -Oz/-O3 0.87-1.06 per step, median 0.955). The features are the ones rustc's
# wasm32 output uses;
# Envoy's V8 runs each. Every build gets it (the shipped module, the benchmarks' floors and the
# test builds alike), so what the tests and the benchmarks measure is what ships.
# --low-memory-unused (issue 27: 732,378 -> 724,485 bytes): lets the pass fold a constant added to a
# pointer into the load's or store's offset, which is exact unless the addition wraps past 4 GiB
# into the first KiB of memory. rustc's wasm32 output keeps that KiB unused by anything but the
# last KiB of a full 1 MiB stack (--stack-first: data from 1 MiB up, the stack below it), and no
# pointer wraps. Fewer adds on the request path: the core's steps were not slower under Node
# (median paired ratio 0.95, within noise).
scripts/install-deps.sh wasm-opt
wasm-opt -Oz --low-memory-unused --enable-bulk-memory --enable-sign-ext --enable-mutable-globals --enable-nontrapping-float-to-int \
  "$WASM_TARGET_DIR$SUBDIR/$TARGET/release/idemgate.wasm" -o "$OUT"
echo "build: $OUT $(stat -c %s "$OUT") bytes ($TARGET, $WASM_TOOLCHAIN toolchain, $(( $(date +%s) - start )) s)"
