#!/usr/bin/env bash
# Runs the core's unit tests compiled to wasm32 under Node.js with wasm-bindgen-test.
# The proxy-wasm glue is left out (--no-default-features): its imports have no host under Node.
#
# Then fails unless the wasm32 run passed at least as many tests as the native core holds that
# can run there: the native library's tests (`cargo test --lib -- --list`, the build test-native
# runs) less the ones left out of wasm32 by design, named below. A core module whose tests use
# plain `#[test]` instead of the alias (`scripts/check-test-attrs.py`) compiles on wasm32 but is
# never run there: this count is what shows it.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=wasm32-unknown-unknown
# Native tests not built for wasm32, by name: the filter (proxy-wasm glue, --no-default-features);
# proptest's property tests (its runner is native only: modules `props` and `schedules`); the
# local tier's thread interleavings (no threads on wasm32); the scripts' names checked with the
# system's sha1sum (a process).
NATIVE_ONLY='^filter::|::props::|::schedules::|^local::tests::interleavings::|^store::tests::script_names_are_the_sha1_of_their_text_as_sha1sum_computes_it$'

scripts/install-deps.sh wasm-toolchain "$TARGET"
scripts/install-deps.sh wasm-bindgen
command -v node >/dev/null || { echo "test-wasm: Node.js is required (apt-get install nodejs)" >&2; exit 1; }
log=$(mktemp)
trap 'rm -f "$log"' EXIT
(
  . scripts/wasm-env.sh
  wasm_env "$TARGET"
  export CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner
  # shellcheck disable=SC2086
  cargo test --locked --target "$TARGET" --target-dir "$WASM_TARGET_DIR" $WASM_CARGO_FLAGS --no-default-features --lib
) 2>&1 | tee "$log"

# wasm-bindgen-test's summary: "test result: ok. N passed; 0 failed; ...".
ran=$(grep -oE "test result: ok\. [0-9]+ passed" "$log" | grep -oE "[0-9]+" | tail -1 || true)
[ -n "$ran" ] || { echo "test-wasm: no 'test result: ok. N passed' line in the run's output: cannot say what ran" >&2; exit 1; }
native=$(cargo test --locked --lib -- --list | sed -n 's/: test$//p')
[ -n "$native" ] || { echo "test-wasm: the native library lists no tests (cargo test --lib -- --list)" >&2; exit 1; }
expected=$(grep -cvE "$NATIVE_ONLY" <<<"$native" || true)
if [ "$ran" -lt "$expected" ]; then
  echo "test-wasm: $ran tests passed on wasm32, but the native core has $expected that should run there" \
    "($(wc -l <<<"$native") native, less the native-only ones: $NATIVE_ONLY)." \
    "A core module with plain #[test] instead of the wasm alias? (scripts/check-test-attrs.py)" >&2
  exit 1
fi
echo "test-wasm: $ran tests passed on wasm32; the native core has $expected that run there ($(wc -l <<<"$native") native in all)"
