#!/usr/bin/env bash
# The demo stack without Docker: the store, the demo payments API, Envoy with idemgate, all on
# 127.0.0.1 with ports chosen at run time. The store is Redis + webdis (the default), Redis HA
# (redis-ha: three Redis nodes under three Sentinels, two HAProxy + webdis legs, both webdis in
# the health-checked idemgate_store cluster; scripts/store_ha.py, envoy/redis-ha/) or a
# three-member etcd cluster with etcd's authentication on (store.kind "etcd").
#
#   scripts/demo.sh run [redis|redis-ha|etcd]   # start, run the agent simulator (with and without idemgate), stop;
#                                                # redis-ha: then the operator CLI's list/inspect on each leg
#   scripts/demo.sh up [redis|redis-ha|etcd]    # start and leave running; prints commands to try
#   scripts/demo.sh down               # stop what `up` started
#   scripts/demo.sh mcp                # the MCP variant (make demo MCP=1): the MCP payments server
#                                      # (tests/mcp/server.py) behind envoy/mcp/envoy.yaml, an agent on
#                                      # the MCP Python SDK (scripts/mcp_agent_sim.py) under the same faults
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STATE=target/demo
mkdir -p "$STATE"
STORE=${2:-redis}
[ "${1:-}" = mcp ] && STORE=redis  # the MCP variant keeps its records in idemgate's local table
case "$STORE" in
  redis|redis-ha|etcd) ;;
  *) echo "$0: unknown store '$STORE' (redis, redis-ha or etcd)" >&2; exit 2 ;;
esac

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

# Renders envoy/demo/envoy.yaml.tmpl: every ${NAME} from the environment. With etcd (STORE=etcd)
# the same template, with two changes: the plugin's store (kind "etcd", as envoy/etcd/envoy.yaml)
# and the idemgate_store cluster (envoy/etcd/envoy.yaml's, with the three members started here).
render() {
  python3 - "$1" "$STORE" <<'PY'
import os, re, sys
text = open(sys.argv[1]).read()
if sys.argv[2] == "etcd":
    def swap(old, new):
        global text
        assert text.count(old) == 1, f"envoy/demo/envoy.yaml.tmpl changed: {old!r} not found once"
        text = text.replace(old, new)
    swap('"store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 500}',
         '"store": {"kind": "etcd", "cluster": "idemgate_store", "timeout_ms": 1000}')
    swap("""# webdis's basic-auth credential ("user:password"), from Envoy's environment
                  # by name: never part of the plugin configuration.""",
         """# etcd's user and password ("user:password", traded for a token), from Envoy's
                  # environment by name: never part of the plugin configuration.""")
    # The shipped cluster itself (envoy/etcd/envoy.yaml), the members swapped: the template's
    # idemgate_store (webdis) is its last cluster.
    sys.path.insert(0, "scripts")
    from etcd_store_cluster import cluster
    text = text[:text.index("  - name: idemgate_store\n")] + cluster(os.environ["ETCD_PORTS"].split())
elif sys.argv[2] == "redis-ha":
    # envoy/redis-ha/idemgate-store-cluster.yaml with the stack's two webdis (both health-checked),
    # in place of the template's idemgate_store (its last cluster).
    ha = "".join("  " + l if l.strip() else l for l in os.environ["HA_CLUSTER"].splitlines(True))
    text = text[:text.index("  - name: idemgate_store\n")] + ha
print(re.sub(r"\$\{([A-Z_]+)\}", lambda m: os.environ[m.group(1)], text), end="")
PY
}

install() {
  scripts/install-deps.sh envoy
  case "$STORE" in
    etcd) scripts/install-deps.sh etcd ;;
    redis-ha) scripts/install-deps.sh store-ha ;;
    *) scripts/install-deps.sh store ;;
  esac
  scripts/install-deps.sh agent-client
  scripts/build-wasm.sh >&2
  cargo build --locked --release --quiet --bin demo-payments
  # Redis HA: the operator CLI too, for its steps on each leg (`run`) and `up`'s commands to try
  # (about 37 s of compiling once on 2 cores, <1 s to run).
  [ "$STORE" != redis-ha ] || cargo build --locked --release --quiet --bin idemgate
}

stop() {
  [ -f "$STATE/redis-ha/stack.json" ] && python3 scripts/store_ha.py down "$STATE/redis-ha"
  [ -f "$STATE/pids" ] || return 0
  while read -r pid; do kill "$pid" 2>/dev/null || true; done < "$STATE/pids"
  sleep 0.3
  while read -r pid; do kill -9 "$pid" 2>/dev/null || true; done < "$STATE/pids"
  rm -f "$STATE/pids" "$STATE/env"
}

start_redis() {
  rm -rf "$STATE/redis" && mkdir -p "$STATE/redis"
  export WEBDIS_HOST=127.0.0.1 WEBDIS_PORT=$(free_port)
  REDIS_PORT=$(free_port)
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
  (cd "$STATE" && exec webdis webdis.json < /dev/null > /dev/null 2>&1) & echo $! >> "$STATE/pids"
  wait_http "http://127.0.0.1:$WEBDIS_PORT/PING" 20 "$IDEMGATE_STORE_AUTH"
  STORE_SAYS="Redis behind webdis (127.0.0.1:$WEBDIS_PORT)"
}

# Redis HA (scripts/store_ha.py, every part from envoy/redis-ha/): 3 Redis nodes, 3 Sentinels,
# 2 HAProxy, 2 webdis; Envoy's idemgate_store lists both webdis. Kill the primary while it runs
# (scripts/store_ha.py kill target/demo/redis-ha "$(scripts/store_ha.py primary target/demo/redis-ha)"):
# Sentinel promotes a replica, HAProxy routes to it, webdis reconnects; nobody repoints anything.
start_redis_ha() {
  rm -rf "$STATE/redis-ha"
  python3 scripts/store_ha.py up "$STATE/redis-ha"
  HA_CLUSTER=$(python3 scripts/store_ha.py cluster "$STATE/redis-ha")
  export HA_CLUSTER
  IDEMGATE_STORE_AUTH=$(python3 -c 'import json; print(next(a["http_basic_auth"] for a in json.load(open("envoy/redis-ha/webdis.json"))["acl"] if "http_basic_auth" in a))')
  export IDEMGATE_STORE_AUTH
  STORE_SAYS="Redis HA: 3 nodes, 3 Sentinels, 2 HAProxy + webdis legs ($STATE/redis-ha/stack.json)"
  ETCD_TRY="python3 scripts/store_ha.py kill $STATE/redis-ha \$(python3 scripts/store_ha.py primary $STATE/redis-ha)   # kill the primary; a replica takes over"
  local ports
  ports=$(ha_webdis_ports)
  OPS_TRY="IDEMGATE_STORE_AUTH='$IDEMGATE_STORE_AUTH' IDEMGATE_RECORD_KEY=\$(sed -n 's/^IDEMGATE_RECORD_KEY=//p' $STATE/env) target/release/idemgate --webdis http://127.0.0.1:${ports%% *} list --state completed   # leg 0; leg 1: --webdis http://127.0.0.1:${ports##* }"
}

# Redis HA only: the operator CLI (docs/operating.md, "The CLI through the named-user hop") on each
# leg, after the agent's run: the keys it left completed listed through webdis-0 and through
# webdis-1 (the same keys: one store), the first inspected through webdis-1. Fails the demo if a
# leg lists nothing or another set, or the record is not completed.
operator_on_each_leg() {
  local url0 url1 listed0 listed1 first
  read -r url0 url1 <<< "$(ha_webdis_ports | sed 's|\([0-9][0-9]*\)|http://127.0.0.1:\1|g')"
  echo
  echo "== the operator CLI on each leg of the HA store (IDEMGATE_STORE_AUTH: webdis's credential, IDEMGATE_RECORD_KEY: the proxies') =="
  echo "\$ idemgate --webdis $url0 list --state completed      # leg 0 (webdis-0)"
  listed0=$(target/release/idemgate --webdis "$url0" list --state completed | cut -f1 | sort)
  echo "$listed0" | sed 's/^/  /'
  echo "\$ idemgate --webdis $url1 list --state completed      # leg 1 (webdis-1)"
  listed1=$(target/release/idemgate --webdis "$url1" list --state completed | cut -f1 | sort)
  echo "  the same $(echo "$listed1" | grep -c .) keys"
  [ -n "$listed0" ] && [ "$listed0" = "$listed1" ] || { log "the two legs listed different completed keys"; return 1; }
  first=$(echo "$listed0" | head -1)
  echo "\$ idemgate --webdis $url1 inspect $first"
  target/release/idemgate --webdis "$url1" inspect "$first" | python3 -c "$(cat <<'PY'
import json, sys
r = json.load(sys.stdin)
print(f"  {r['state']}: status {r.get('status')}, {r.get('body_bytes')} body bytes, first request {r['creator']['request_id']}")
sys.exit(r["state"] != "completed")
PY
)"
  echo "(resolve and forget work the same on either leg: docs/operating.md; make up STORE=redis-ha prints the commands)"
}

# The two webdis ports of the Redis HA stack (leg 0, leg 1).
ha_webdis_ports() {
  python3 -c 'import json, sys; print(" ".join(str(w["port"]) for w in json.load(open(sys.argv[1]))["webdis"]))' "$STATE/redis-ha/stack.json"
}

# Three etcd members on 127.0.0.1 (data in target/demo/etcd), then etcd's authentication on: root
# administers (its password stays here), user "idemgate" may read and write idemgate's keys
# (idemgate/v1/ and below) and nothing else; its password goes to the proxy through the VM's
# environment (IDEMGATE_STORE_AUTH). Both passwords are new for each stack.
start_etcd() {
  rm -rf "$STATE/etcd" && mkdir -p "$STATE/etcd"
  local clients=() peers=() cluster="" i
  for i in 0 1 2; do
    clients+=("$(free_port)"); peers+=("$(free_port)")
    cluster+="${cluster:+,}m$i=http://127.0.0.1:${peers[$i]}"
  done
  for i in 0 1 2; do
    etcd --name "m$i" --data-dir "$ROOT/$STATE/etcd/m$i" \
      --listen-client-urls "http://127.0.0.1:${clients[$i]}" --advertise-client-urls "http://127.0.0.1:${clients[$i]}" \
      --listen-peer-urls "http://127.0.0.1:${peers[$i]}" --initial-advertise-peer-urls "http://127.0.0.1:${peers[$i]}" \
      --initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token idemgate-demo \
      < /dev/null > "$STATE/etcd/m$i.log" 2>&1 & echo $! >> "$STATE/pids"
  done
  export ETCD_PORTS="${clients[*]}"
  local password root_password
  password=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
  root_password=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
  python3 - "$password" "$root_password" $ETCD_PORTS <<'PY'
import base64, json, sys, time, urllib.request
password, root_password, ports = sys.argv[1], sys.argv[2], sys.argv[3:]
def call(port, path, body=None, token=None):
    r = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=None if body is None else json.dumps(body).encode())
    if token:
        r.add_header("authorization", token)
    return json.load(urllib.request.urlopen(r, timeout=2))
deadline = time.time() + 30
while True:  # every member healthy: a leader elected, reachable from each
    try:
        if all(call(p, "/health").get("health") == "true" for p in ports):
            break
    except Exception:
        pass
    if time.time() > deadline:
        sys.exit("demo: etcd did not become healthy (logs in target/demo/etcd/)")
    time.sleep(0.2)
b64 = lambda b: base64.b64encode(b).decode()
prefix = b"idemgate/v1/"  # idemgate::etcd::KEY_PREFIX
for path, body in [
    ("/v3/auth/user/add", {"name": "root", "password": root_password}),
    ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
    ("/v3/auth/role/add", {"name": "idemgate-rw"}),
    ("/v3/auth/role/grant", {"name": "idemgate-rw", "perm": {"permType": "READWRITE", "key": b64(prefix), "range_end": b64(prefix[:-1] + bytes([prefix[-1] + 1]))}}),
    ("/v3/auth/user/add", {"name": "idemgate", "password": password}),
    ("/v3/auth/user/grant", {"user": "idemgate", "role": "idemgate-rw"}),
    ("/v3/auth/enable", {}),
]:
    call(ports[0], path, body)
# Auth is on: a client without a token is refused, and idemgate's user may not go beyond its prefix.
try:
    call(ports[0], "/v3/kv/put", {"key": b64(b"x"), "value": b64(b"y")})
    sys.exit("demo: etcd accepted a write without a token")
except urllib.error.HTTPError:
    pass
token = call(ports[0], "/v3/auth/authenticate", {"name": "idemgate", "password": password})["token"]
try:
    call(ports[0], "/v3/kv/put", {"key": b64(b"outside"), "value": b64(b"y")}, token)
    sys.exit("demo: etcd let user idemgate write outside idemgate/v1/")
except urllib.error.HTTPError:
    pass
PY
  export IDEMGATE_STORE_AUTH="idemgate:$password"
  STORE_SAYS="etcd, 3 members (127.0.0.1:${clients[0]}, :${clients[1]}, :${clients[2]}), authentication on, user idemgate limited to idemgate/v1/"
  ETCD_TRY="ETCDCTL_API=3 etcdctl --endpoints=127.0.0.1:${clients[0]} --user 'idemgate:$password' get --prefix idemgate/v1/ --keys-only"
}

start() {
  stop
  export BIND=127.0.0.1 API_HOST=127.0.0.1
  export LISTEN_PORT=$(free_port) ADMIN_PORT=$(free_port) API_PORT=$(free_port)
  # Placeholders of the template that the etcd rendering does not use.
  export WEBDIS_HOST=127.0.0.1 WEBDIS_PORT=0
  export WASM_PATH="$ROOT/dist/idemgate.wasm"
  : > "$STATE/pids"
  ETCD_TRY="" OPS_TRY=""
  "start_${STORE//-/_}"
  # The secret store records are sealed with (HMAC-SHA-256 over key and record, src/seal.rs): the
  # same for every proxy of the stack, new for each stack unless given.
  IDEMGATE_RECORD_KEY=${IDEMGATE_RECORD_KEY:-$(python3 -c 'import secrets; print(secrets.token_hex(32))')}
  export IDEMGATE_RECORD_KEY
  target/release/demo-payments --port "$API_PORT" < /dev/null > "$STATE/api.log" 2>&1 & echo $! >> "$STATE/pids"
  render envoy/demo/envoy.yaml.tmpl > "$STATE/envoy.yaml"
  envoy -c "$STATE/envoy.yaml" --concurrency 2 --disable-hot-restart --log-level warn \
    --component-log-level wasm:info < /dev/null > "$STATE/envoy.log" 2>&1 & echo $! >> "$STATE/pids"
  wait_http "http://127.0.0.1:$API_PORT/stats" 20
  wait_http "http://127.0.0.1:$ADMIN_PORT/ready" 60
  if [ "$STORE" = etcd ]; then
    # Each worker's root authenticates, then grants its lease; until then requests get 503.
    local deadline=$((SECONDS + 30))
    until [ "$(grep -c 'etcd lease granted' "$STATE/envoy.log")" -ge 2 ]; do
      if grep -q 'etcd authentication failed' "$STATE/envoy.log" || [ $SECONDS -ge $deadline ]; then
        log "idemgate got no etcd token and lease (see $STATE/envoy.log)"; return 1
      fi
      sleep 0.2
    done
  fi
  log "store: $STORE_SAYS"
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
    python3 scripts/agent_sim.py --gateway "$GATEWAY" --api "$API" --admin "$ADMIN" --store "$STORE"
    [ "$STORE" != redis-ha ] || operator_on_each_leg
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
${ETCD_TRY:+  # $([ "$STORE" = etcd ] && echo "what idemgate keeps in etcd (its user sees only its own prefix)" || echo "a failover with no operator")
  $ETCD_TRY
}${OPS_TRY:+  # the operator CLI on either leg (docs/operating.md): list, then inspect/resolve/forget a key
  $OPS_TRY
}
Stop it with: make down
TRY
    ;;
  mcp)
    scripts/install-deps.sh envoy
    scripts/install-deps.sh mcp-sdk
    scripts/build-wasm.sh >&2
    trap stop EXIT
    stop
    : > "$STATE/pids"
    LISTEN_PORT=$(free_port) ADMIN_PORT=$(free_port) MCP_PORT=$(free_port)
    IDEMGATE_RECORD_KEY=${IDEMGATE_RECORD_KEY:-$(python3 -c 'import secrets; print(secrets.token_hex(32))')}
    export IDEMGATE_RECORD_KEY
    target/mcp-venv/bin/python tests/mcp/server.py --port "$MCP_PORT" < /dev/null > "$STATE/mcp-server.log" 2>&1 & echo $! >> "$STATE/pids"
    # The shipped example as users run it, only its loopback ports and the module path replaced.
    sed -e "s/port_value: 10000/port_value: $LISTEN_PORT/" -e "s/port_value: 9901/port_value: $ADMIN_PORT/" \
      -e "s/port_value: 8080/port_value: $MCP_PORT/" -e "s|dist/idemgate.wasm|${WASM_PATH:-$ROOT/dist/idemgate.wasm}|" \
      envoy/mcp/envoy.yaml > "$STATE/envoy-mcp.yaml"
    envoy -c "$STATE/envoy-mcp.yaml" --concurrency 2 --disable-hot-restart --log-level warn \
      --component-log-level wasm:info < /dev/null > "$STATE/envoy.log" 2>&1 & echo $! >> "$STATE/pids"
    wait_http "http://127.0.0.1:$MCP_PORT/count" 30
    wait_http "http://127.0.0.1:$ADMIN_PORT/ready" 60
    target/mcp-venv/bin/python scripts/mcp_agent_sim.py --gateway "http://127.0.0.1:$LISTEN_PORT/mcp" \
      --server "http://127.0.0.1:$MCP_PORT" --store local
    ;;
  down)
    stop
    log "stopped"
    ;;
  *)
    echo "usage: $0 run|up [redis|redis-ha|etcd] | mcp | down" >&2; exit 2 ;;
esac
