#!/usr/bin/env bash
# The core's per-request profile (benches/hot_path.rs) compiled to wasm32-wasip1 and run under
# Node.js's WASI: V8, the engine Envoy runs the filter in. Prints one JSON line per step.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=wasm32-wasip1
scripts/install-deps.sh wasm-toolchain "$TARGET" >&2
command -v node >/dev/null || { echo "hot-path-wasm: Node.js is required (apt-get install nodejs)" >&2; exit 1; }
. scripts/wasm-env.sh
wasm_env "$TARGET"
# shellcheck disable=SC2086
out=$(cargo bench --locked --target "$TARGET" --target-dir "$WASM_TARGET_DIR" $WASM_CARGO_FLAGS --no-default-features \
  --bench hot_path --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "hot_path" and m.get("filenames"):
        print(m["filenames"][0])')
[ -n "$out" ] || { echo "hot-path-wasm: the benchmark did not build" >&2; exit 1; }
node --no-warnings - "$out" <<'JS'
const { WASI } = require("node:wasi");
const fs = require("node:fs");
const file = process.argv[2];
const wasi = new WASI({ version: "preview1", args: ["hot_path", "--bench"],
  env: process.env.IDEMGATE_HOT_PATH_MS ? { IDEMGATE_HOT_PATH_MS: process.env.IDEMGATE_HOT_PATH_MS } : {} });
WebAssembly.instantiate(fs.readFileSync(file), { wasi_snapshot_preview1: wasi.wasiImport })
  .then(({ instance }) => wasi.start(instance));
JS
