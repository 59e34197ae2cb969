#!/usr/bin/env bash
# The demo stack without Docker: Redis + webdis (the store), the demo payments API, Envoy with
# idemgate, all on 127.0.0.1 with ports chosen at run time.
#
#   scripts/demo.sh run    # start, run the agent simulator (with and without idemgate), stop
#   scripts/demo.sh up     # start and leave running; prints commands to try
#   scripts/demo.sh down   # stop what `up` started
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STATE=target/demo
mkdir -p "$STATE"

log() { echo "demo: $*" >&2; }

# A free port below Linux's ephemeral range (so no outgoing connection can take it meanwhile).
free_port() {
  python3 - <<'PY'
import random, socket
for _ in range(1000):
    p = random.randint(20000, 32767)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
        print(p)
        break
    except OSError:
        pass
    finally:
        s.close()
PY
}

wait_http() { # url, seconds[, basic-auth "user:password"]
  local deadline=$((SECONDS + $2))
  until python3 -c "import base64,urllib.request,sys; r=urllib.request.Request(sys.argv[1]); a=sys.argv[2]
if a: r.add_header('authorization', 'Basic ' + base64.b64encode(a.encode()).decode())
urllib.request.urlopen(r, timeout=1)" "$1" "${3:-}" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || { log "$1 did not answer in $2 s"; return 1; }
    sleep 0.2
  done
}

# Renders envoy/demo/envoy.yaml.tmpl: every ${NAME} from the environment.
render() {
  python3 - "$1" <<'PY'
import os, re, sys
text = open(sys.argv[1]).read()
print(re.sub(r"\$\{([A-Z_]+)\}", lambda m: os.environ[m.group(1)], text), end="")
PY
}

install() {
  scripts/install-deps.sh envoy
  scripts/install-deps.sh store
  scripts/install-deps.sh agent-client
  scripts/build-wasm.sh >&2
  cargo build --locked --release --quiet --bin demo-payments
}

stop() {
  [ -f "$STATE/pids" ] || return 0
  while read -r pid; do kill "$pid" 2>/dev/null || true; done < "$STATE/pids"
  sleep 0.3
  while read -r pid; do kill -9 "$pid" 2>/dev/null || true; done < "$STATE/pids"
  rm -f "$STATE/pids" "$STATE/env"
}

start() {
  stop
  rm -rf "$STATE/redis" && mkdir -p "$STATE/redis"
  export BIND=127.0.0.1 API_HOST=127.0.0.1 WEBDIS_HOST=127.0.0.1
  export LISTEN_PORT=$(free_port) ADMIN_PORT=$(free_port) API_PORT=$(free_port) WEBDIS_PORT=$(free_port)
  REDIS_PORT=$(free_port)
  export WASM_PATH="$ROOT/dist/idemgate.wasm"
  : > "$STATE/pids"
  # Every process writes to its own log: none keeps the caller's terminal or pipe open.
  redis-server envoy/redis.conf --port "$REDIS_PORT" --dir "$ROOT/$STATE/redis" --daemonize no \
    --logfile "$ROOT/$STATE/redis.log" < /dev/null > /dev/null 2>&1 & echo $! >> "$STATE/pids"
  # The store as shipped: Redis's ACL users (envoy/redis.conf), webdis's Redis password and its
  # ACL (envoy/docker-compose/webdis.json: every command refused without the credential, only
  # EVALSHA, EVAL, GET and PING with it); Envoy hands the credential to the VM (IDEMGATE_STORE_AUTH).
  python3 - "$REDIS_PORT" "$WEBDIS_PORT" "$ROOT/$STATE/webdis.log" > "$STATE/webdis.json" <<'PY'
import json, sys
c = json.load(open("envoy/docker-compose/webdis.json"))
c.update(redis_host="127.0.0.1", redis_port=int(sys.argv[1]), http_host="127.0.0.1",
         http_port=int(sys.argv[2]), verbosity=1, logfile=sys.argv[3])
print(json.dumps(c))
PY
  IDEMGATE_STORE_AUTH=$(python3 -c 'import json; print(next(a["http_basic_auth"] for a in json.load(open("envoy/docker-compose/webdis.json"))["acl"] if "http_basic_auth" in a))')
  export IDEMGATE_STORE_AUTH
  # The secret store records are sealed with (HMAC-SHA-256 over key and record, src/seal.rs): the
  # same for every proxy of the stack, new for each stack unless given.
  IDEMGATE_RECORD_KEY=${IDEMGATE_RECORD_KEY:-$(python3 -c 'import secrets; print(secrets.token_hex(32))')}
  export IDEMGATE_RECORD_KEY
  (cd "$STATE" && exec webdis webdis.json < /dev/null > /dev/null 2>&1) & echo $! >> "$STATE/pids"
  target/release/demo-payments --port "$API_PORT" < /dev/null > "$STATE/api.log" 2>&1 & echo $! >> "$STATE/pids"
  render envoy/demo/envoy.yaml.tmpl > "$STATE/envoy.yaml"
  envoy -c "$STATE/envoy.yaml" --concurrency 2 --disable-hot-restart --log-level warn \
    --component-log-level wasm:info < /dev/null > "$STATE/envoy.log" 2>&1 & echo $! >> "$STATE/pids"
  wait_http "http://127.0.0.1:$API_PORT/stats" 20
  wait_http "http://127.0.0.1:$WEBDIS_PORT/PING" 20 "$IDEMGATE_STORE_AUTH"
  wait_http "http://127.0.0.1:$ADMIN_PORT/ready" 60
  cat > "$STATE/env" <<ENV
GATEWAY=http://127.0.0.1:$LISTEN_PORT
API=http://127.0.0.1:$API_PORT
ADMIN=http://127.0.0.1:$ADMIN_PORT
IDEMGATE_RECORD_KEY=$IDEMGATE_RECORD_KEY
ENV
}

case "${1:-run}" in
  run)
    install
    trap stop EXIT
    start
    . "$STATE/env"
    python3 scripts/agent_sim.py --gateway "$GATEWAY" --api "$API" --admin "$ADMIN"
    ;;
  up)
    install
    start
    . "$STATE/env"
    cat <<TRY
The demo stack is up (logs in $STATE/). Try:

  # a charge through idemgate, then the same again: one execution, the second is a replay
  curl -si $GATEWAY/charges -H 'authorization: Bearer demo' -H 'idempotency-key: try-1' -d '{"amount":100,"currency":"eur"}'
  curl -si $GATEWAY/charges -H 'authorization: Bearer demo' -H 'idempotency-key: try-1' -d '{"amount":100,"currency":"eur"}'
  # same key, other body: 422
  curl -si $GATEWAY/charges -H 'authorization: Bearer demo' -H 'idempotency-key: try-1' -d '{"amount":999,"currency":"eur"}'
  # no key: 400 (the demo requires one)
  curl -si $GATEWAY/charges -H 'authorization: Bearer demo' -d '{"amount":1}'
  # what the API executed, and idemgate's counters
  curl -s $API/charges; curl -s $ADMIN/stats/prometheus | grep ^idemgate_

Stop it with: make down
TRY
    ;;
  down)
    stop
    log "stopped"
    ;;
  *)
    echo "usage: $0 run|up|down" >&2; exit 2 ;;
esac
