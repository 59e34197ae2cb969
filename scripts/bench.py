#!/usr/bin/env python3
"""make bench: what idemgate costs, side by side, in one run, on 127.0.0.1 only.

Every scenario runs Envoy 1.40 with one worker (--concurrency 1) and the same load generator (wrk,
one thread, fixed connections, fixed body and headers), repeated; the figures are medians with
their spread (min-max). Results: target/bench/results.json, docs/BENCHMARKS.md, docs/bench.svg.
BENCH_QUICK=1 shortens every run (11 minutes measured in all at load average 10 on 2 cores, 2026-12-07).

The store scenarios run with Redis (webdis in front) and with etcd (three members on 127.0.0.1,
ports picked here, data in a scratch folder under target/bench, stopped at the end) in the same
interleaved rounds, on the same POSTs.

The native build (libidemgate_native.so, an Envoy dynamic module) runs beside the Wasm one in the
same rounds, on the same requests ("Native beside Wasm"), and both builds' memory per worker is
measured with 1 and 2 workers. BENCH_NOTE, when set, is the page's "About this run" note.

"""
import http.client
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import etcd_store_cluster  # noqa: E402 (beside this script)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = os.environ.get("BENCH_QUICK") == "1"
RUNS = 3 if QUICK else 5
# Quick: 1 s per scenario and round (24 scenarios, 3 rounds), every key still written.
DURATION = 1 if QUICK else 8
CONNECTIONS = 16
BODY = '{"amount":4200,"currency":"eur","note":"benchmark body of fixed size"}'
OUT = os.path.join(ROOT, "target", "bench")
PROCS = []


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_http(url, seconds=30):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except Exception:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


def proc_cpu_seconds(pid):
    """User + system CPU time a process has used so far (all its threads)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(cmd, log, cwd=None, env=None):
    p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
                         env=dict(os.environ, **env) if env else None)
    PROCS.append(p)
    return p


def stop(p):
    p.kill()
    p.wait()
    if p in PROCS:
        PROCS.remove(p)


# The floors (src/bench_host/floor.rs, dist/idemgate-floor.wasm): the work no fingerprinting, storing
# filter can avoid, chosen by the plugin configuration.
FLOOR_STORE_KEY = "idemgate:v1:bench-floor"
FLOOR_ETCD_KEY = "idemgate/v1/bench-floor"


def floor_plugin(mode):
    return {"idemgate_bench_floor": mode, "key": FLOOR_STORE_KEY}


# The 1-connection pass (latency without queueing): these scenarios, every round, after the
# 16-connection runs; its p50s give `first_local_p50_overhead_us`.
ONE_CONNECTION = ["h_floor_empty_post", "h_floor_buffering", "h_floor_shared", "d_first_local", "h_floor_store", "e_first_store",
                  "h_floor_store_etcd", "i_first_etcd", "g_replay_after_local_miss", "j_replay_after_local_miss_etcd",
                  "k_first_redis_ha", "q_floor_native_buffer", "m_first_local_native", "o_first_store_native",
                  "r_first_etcd_native"]
ONE_CONNECTION_DURATION = 1 if QUICK else 4

# webdis's basic-auth credential in envoy/redis-ha/webdis.json (the Redis HA stack).
HA_STORE_AUTH = "idemgate:idemgate-demo-webdis-password"
PLUGIN_LOCAL = {"scope": {"headers": ["authorization"]}, "local": {"max_entries": 200000, "max_bytes": 268435456, "when_full": "evict_oldest"}}
# The etcd store (store.kind "etcd"), as envoy/etcd/envoy.yaml configures it.
PLUGIN_ETCD = dict(PLUGIN_LOCAL, store={"kind": "etcd", "cluster": "idemgate_store", "timeout_ms": 1000})
# Replays after a local miss, every request: a proxy whose local tier holds 16 records (the least
# it may) reads a pool of MISS_POOL keys in turn, so the key asked for has always been evicted
# (with a store the local tier is a cache: it evicts whatever the age) and every replay reads the
# store. The pool is completed beforehand through a proxy with the shipped local tier.
MISS_POOL = 500 if QUICK else 2000
MISS_LOCAL = {"max_entries": 16, "max_bytes": 1048576, "when_full": "evict_oldest"}


class Etcd:
    """Three etcd members on 127.0.0.1 (Debian etcd-server, scripts/install-deps.sh etcd), ports
    picked here, data in a scratch folder under target/bench; stopped with the other processes."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="etcd-", dir=OUT)
        self.client_ports = [free_port() for _ in range(3)]
        peers = [free_port() for _ in range(3)]
        cluster = ",".join(f"m{i}=http://127.0.0.1:{peers[i]}" for i in range(3))
        self.procs = []
        for i in range(3):
            client, peer = f"http://127.0.0.1:{self.client_ports[i]}", f"http://127.0.0.1:{peers[i]}"
            self.procs.append(start(["etcd", "--name", f"m{i}", "--data-dir", os.path.join(self.dir, f"m{i}"),
                                     "--listen-client-urls", client, "--advertise-client-urls", client,
                                     "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                     "--initial-cluster", cluster, "--initial-cluster-state", "new",
                                     "--initial-cluster-token", "idemgate-bench"], os.path.join(self.dir, f"m{i}.log")))
        deadline = time.time() + 30
        while True:  # every member healthy: a leader is elected and each can reach it
            try:
                if all(json.load(urllib.request.urlopen(f"http://127.0.0.1:{p}/health", timeout=1)).get("health") == "true"
                       for p in self.client_ports):
                    break
            except Exception:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"etcd did not become healthy; logs in {self.dir}")
            time.sleep(0.2)

    def pids(self):
        return [p.pid for p in self.procs]


# The native build (docs/native.md): idemgate as an Envoy dynamic module, found by Envoy in
# ENVOY_DYNAMIC_MODULES_SEARCH_PATH (`Envoy` sets it).
NATIVE = os.path.join(ROOT, "target", "release", "libidemgate_native.so")
# Store records are sealed with this secret (src/seal.rs): the Wasm build reads it from its VM's
# environment, the native build from Envoy's process environment (docs/native.md).
RECORD_KEY = "idemgate-bench-record-key-0123456789abcdef"


def envoy_config(listen, admin, wasm, plugin, direct, api_port, store_port, etcd_ports=None, ha_cluster=None, native=None,
                 buffer_filter=False):
    filters = []
    if buffer_filter:
        # The native host's own buffering floor: Envoy's buffer filter (C++, compiled into Envoy)
        # pauses at the request headers and forwards once the whole body is in; it reads nothing of
        # the response (the Wasm buffering floor reads its headers and body too).
        filters.append({"name": "envoy.filters.http.buffer", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer", "max_request_bytes": 1048576}})
    if native:
        filters.append({
            "name": "envoy.filters.http.dynamic_modules",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
                "dynamic_module_config": {"name": "idemgate_native", "do_not_close": True},
                "filter_name": "idemgate",
                "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": json.dumps(plugin or {})},
            },
        })
    if wasm:
        filters.append({
            "name": "envoy.filters.http.wasm",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                "config": {
                    "name": "idemgate", "root_id": "idemgate", "allow_on_headers_stop_iteration": True,
                    "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": json.dumps(plugin or {})},
                    "vm_config": {"vm_id": "idemgate", "runtime": "envoy.wasm.runtime.v8", "code": {"local": {"filename": wasm}},
                                  # Store records are sealed with this secret (src/seal.rs).
                                  "environment_variables": {"key_values": dict(
                                      {"IDEMGATE_RECORD_KEY": RECORD_KEY},
                                      # The Redis HA stack's webdis asks for basic auth (envoy/redis-ha/webdis.json).
                                      **({"IDEMGATE_STORE_AUTH": HA_STORE_AUTH} if ha_cluster else {}))}},
                },
            },
        })
    filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    route = {"match": {"prefix": "/"}}
    if direct:
        route["direct_response"] = {"status": 200, "body": {"inline_string": '{"ok":true}'}}
    else:
        route["route"] = {"cluster": "api", "timeout": "10s"}
    clusters = [{"name": "api", "connect_timeout": "1s", "type": "STATIC", "load_assignment": {"cluster_name": "api", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": api_port}}}}]}]}}]
    # With etcd, the store cluster is envoy/etcd/envoy.yaml's own (`Envoy` adds it).
    if store_port and not etcd_ports:
        clusters.append({"name": "idemgate_store", "connect_timeout": "0.25s", "type": "STATIC", "load_assignment": {"cluster_name": "idemgate_store", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": store_port}}}}]}]}})
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [{
                "name": "in", "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": "in", "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
                    "http_filters": filters}}]}],
            }],
            "clusters": clusters,
        },
    }


class Envoy:
    def __init__(self, tag, concurrency=1, **kw):
        self.port, self.admin = free_port(), free_port()
        path = os.path.join(OUT, f"envoy-{tag}.json")
        json.dump(envoy_config(self.port, self.admin, **kw), open(path, "w"))
        args = ["envoy", "-c", path, "--concurrency", str(concurrency), "--disable-hot-restart", "--log-level", "error"]
        if kw.get("ha_cluster"):
            # envoy/redis-ha/idemgate-store-cluster.yaml with the stack's two webdis (store_ha.py cluster).
            args += ["--config-yaml", "static_resources:\n  clusters:\n" + "".join("  " + l + "\n" for l in kw["ha_cluster"].splitlines())]
        if kw.get("etcd_ports"):
            # The shipped store cluster itself, its members swapped (Envoy appends the clusters of
            # --config-yaml to those of -c).
            args += ["--config-yaml", "static_resources:\n  clusters:\n" + etcd_store_cluster.cluster(kw["etcd_ports"])]
        # The native build reads the record secret from Envoy's process environment (its store
        # configuration is refused at load without it).
        env = {"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": os.path.dirname(kw["native"]), "IDEMGATE_RECORD_KEY": RECORD_KEY} if kw.get("native") else None
        self.proc = start(args, os.path.join(OUT, f"envoy-{tag}.log"), env=env)
        wait_http(f"http://127.0.0.1:{self.admin}/ready", 60)
        if kw.get("etcd_ports") or kw.get("ha_cluster"):
            self.wait_store()

    def wait_store(self, seconds=20):
        """Until a protected POST is answered 2xx: with etcd, the root grants its lease (and the
        health checks admit the members) after start; until then requests get 503 (never claimed
        without expiry). One warm-up key, not counted by the runs' before/after reads."""
        deadline = time.time() + seconds
        key = f"warm-{time.time_ns():x}"
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                c.request("POST", "/bench", body=BODY, headers={"content-type": "application/json", "authorization": "Bearer bench",
                                                                 "host": "bench", "idempotency-key": key})
                r = c.getresponse()
                r.read()
                c.close()
                if r.status < 300:
                    return
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"envoy on {self.port}: the etcd store never answered")
            time.sleep(0.2)

    def stat(self, name):
        """idemgate's own counter (`idemgate.x`, either build's: `wasmcustom.` or
        `dynamicmodulescustom.` in /stats), or any Envoy stat by its full name."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/stats", timeout=5).read().decode()
        for line in text.splitlines():
            n, _, v = line.partition(": ")
            if n in (name, "wasmcustom." + name, "dynamicmodulescustom." + name):
                try:
                    return int(v)
                except ValueError:
                    return 0
        return 0

    def stats(self, prefix):
        """Every stat whose name starts with `prefix` (idemgate's metrics without their `wasmcustom.`
        or `dynamicmodulescustom.`)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/stats", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            n, _, v = line.partition(": ")
            n = n.removeprefix("wasmcustom.").removeprefix("dynamicmodulescustom.")
            if n.startswith(prefix):
                try:
                    out[n[len(prefix):]] = int(v)
                except ValueError:
                    pass
        return out

    def store_requests(self):
        """Requests Envoy sent to the store cluster: an independent count of round trips."""
        return self.stat("cluster.idemgate_store.upstream_rq_total")

    def rss(self):
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def memory_allocated(self):
        """Bytes in use in Envoy's allocator now (admin /memory reads tcmalloc at once; the gauge
        `server.memory_allocated` is only updated on the stats flush, every 5 s)."""
        return int(json.load(urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/memory", timeout=5))["allocated"])

    def cpu_seconds(self):
        """User + system CPU time Envoy has used so far (all its threads)."""
        return proc_cpu_seconds(self.proc.pid)

    def close(self):
        stop(self.proc)


LUA = """
-- Requests are built once in init(), so the per-request cost of the load generator is the same
-- small table lookup in every scenario (building them per request halved wrk's rate here).
local reqs = {}
local i = %(start)d
local n = 1
-- A fresh prefix per wrk run (substituted by bench.py): wrk's Lua random generator is not
-- seeded, so math.random alone would repeat the same "unique" keys in every run.
setup = function(thread) thread:set("tid", "%(run)s-" .. tostring(math.random(1, 1000000000))) end
init = function(args)
  local mode = "%(mode)s"
  if mode == "unique" then n = %(unique)d end
  if mode == "pool" then n = %(pool)d end
  for k = 1, n do
    local h = {["content-type"] = "application/json", ["authorization"] = "Bearer bench", ["Host"] = "bench"}
    if mode == "unique" then h["idempotency-key"] = "k-" .. tid .. "-" .. k end
    if mode == "fixed" then h["idempotency-key"] = "replay-key" end
    if mode == "pool" then h["idempotency-key"] = "%(pool_prefix)s" .. (k - 1) end
    reqs[k] = wrk.format("%(method)s", "/bench", h, %(body)s)
  end
end
request = function()
  i = i + 1
  if i > n then i = 1 end
  return reqs[i]
end
"""


def wrk(port, method="POST", mode="none", pool=1, duration=DURATION, connections=CONNECTIONS, pool_prefix="pool-", pool_start=0):
    """`pool_start`: the pool's key the run begins with (a pool is read in turn from there)."""
    body = "nil" if method == "GET" else json.dumps(BODY)
    script = LUA % {"mode": mode, "pool": pool, "pool_prefix": pool_prefix, "method": method, "body": body, "unique": 40_000 * duration,
                    "start": pool_start % max(pool, 1),
                    "run": f"{time.time_ns():x}"}
    f = tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False, dir=OUT)
    f.write(script)
    f.close()
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", f.name, f"http://127.0.0.1:{port}"],
                         capture_output=True, text=True, timeout=duration + 60).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = int(m.group(1)) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", out)) else 0

    def pct(p):
        m = re.search(rf"\s{p}%\s+([\d.]+)(us|ms|s)", out)
        v, unit = float(m.group(1)), m.group(2)
        return v / 1000 if unit == "us" else v if unit == "ms" else v * 1000

    return {"rps": rps, "p50_ms": pct(50), "p99_ms": pct(99), "requests": total, "non_2xx": non2xx}


# The counting pass (dist/idemgate-count.wasm, src/bench_host/meter.rs): host calls, VM allocations and
# store bytes per request, by count (not time: the same on a busy machine as on a quiet one).
COUNT_REQUESTS = 200
COUNT_WARM = 3


# What each host call of a first local request is for, by (callback, kind) (`kind_rows`).
FIRST_LOCAL_CALLS = {
    ("request_headers", "get_header"): "`:method` alone, so an unprotected method passes on one read",
    ("request_headers", "get_header_map"): "the header map: the route (path), the key, the caller's scope, the fingerprint",
    ("request_headers", "set_header"): "`x-envoy-max-retries: 0` (the router never re-sends a protected request)",
    ("request_headers", "clock"): "now, for the look (is a lock live?)",
    ("request_headers", "bucket_get"): "the key's bucket, read: is the key held? (nothing claimed; the value and its CAS kept for the claim)",
    ("request_headers", "bucket_set"): "the claim: CAS write of the bucket, its records and bytes (two concurrent requests: one wins; the creator kept in the entry names it in 409s)",
    ("request_headers", "metric"): "counters `protected`, `claimed`",
    ("request_body", "get_buffer"): "the body, once, at its end",
    ("request_body", "clock"): "now, for the claim's lock and expiry (the lock counts from the end of the body)",
    ("request_body", "bucket_get"): "the bucket, read: still our claim, the key's only live one?",
    ("request_body", "bucket_set"): "the claim, with its fingerprint, forwarded at once: CAS write of the bucket read at headers (two concurrent requests: one wins; the creator kept in the entry names it in 409s)",
    ("response_headers", "get_header_map"): "the response's status and headers, copied for replays",
    ("response_headers", "add_header"): "`idempotency-key-expires-in` to the client",
    ("response_body", "get_buffer"): "each body chunk, copied for replays",
    ("log", "get_property"): "`upstream.request_attempt_count` (always), `response.code_details` (the classification)",
    ("log", "clock"): "now, for the completed record (its expiry) and the lifecycle's check that our claim is not free yet",
    ("log", "bucket_get"): "the bucket, read: may we still complete, and does the body fit the bucket's share of `max_bytes`?",
    ("log", "slot_set"): "the completed record, written to its body key (prefixed with our owner token)",
    ("log", "bucket_set"): "the entry completed: CAS write of the bucket",
    ("log", "metric"): "counter `stored`",
    ("log", "set_property"): "filter state `wasm.idemgate_outcome` and `wasm.idemgate_key` for the access log",
}


def send(conn, method, key):
    headers = {"content-type": "application/json", "authorization": "Bearer bench", "host": "bench"}
    if key:
        headers["idempotency-key"] = key
    conn.request(method, "/bench", body=BODY if method == "POST" else None, headers=headers)
    r = conn.getresponse()
    r.read()
    if r.status >= 300:
        raise RuntimeError(f"counting pass: {method} {key}: {r.status}")


def count_figures(e, requests, root_answers):
    """The counting build's figures once `requests` requests have logged and the root has handled
    `root_answers` callout answers (those two are flushed last, so the read after sees the rest)."""
    for _ in range(400):
        f = e.stats("idemgate.count.")
        if f.get("requests_logged", 0) >= requests and f.get("root_answers", 0) >= root_answers:
            return e.stats("idemgate.count.")
        time.sleep(0.05)
    raise RuntimeError(f"counting pass: figures never reached {requests} requests: {e.stats('idemgate.count.')}")


def count_scenario(e, method, key_of, root_answers_per_request):
    # What the proxy already counted (with etcd: the warm-up request that waited for the lease,
    # the lease grant and the authentication answers): the thresholds below start from there.
    f0 = e.stats("idemgate.count.")
    logged0, answers0 = f0.get("requests_logged", 0), f0.get("root_answers", 0)
    conn = http.client.HTTPConnection("127.0.0.1", e.port, timeout=10)
    for i in range(COUNT_WARM):
        send(conn, method, key_of(i))
    before = count_figures(e, logged0 + COUNT_WARM, answers0 + COUNT_WARM * root_answers_per_request)
    for i in range(COUNT_WARM, COUNT_WARM + COUNT_REQUESTS):
        send(conn, method, key_of(i))
    after = count_figures(e, logged0 + COUNT_WARM + COUNT_REQUESTS, answers0 + (COUNT_WARM + COUNT_REQUESTS) * root_answers_per_request)
    conn.close()
    return {k: (after[k] - before.get(k, 0)) / COUNT_REQUESTS for k in after}


def count_pass(base, wasm, count_wasm, plugin_store, webdis_port, etcd_ports):
    """Per request, for each scenario of the benchmark: host calls, VM allocations (the host's
    requests to allocate included), buffers the host handed the VM, bytes sent to the store."""
    run = f"{time.time_ns():x}"
    out = {}
    cases = [
        ("unprotected_get", dict(base, wasm=count_wasm, direct=False, plugin=PLUGIN_LOCAL), "GET", lambda i: None, 0),
        ("first_local", dict(base, wasm=count_wasm, direct=False, plugin=PLUGIN_LOCAL), "POST", lambda i: f"count-{run}-{i}", 0),
        ("first_store", dict(base, wasm=count_wasm, direct=False, plugin=plugin_store, store_port=webdis_port), "POST",
         lambda i: f"count-store-{run}-{i}", 1),
        ("replay_local", dict(base, wasm=count_wasm, direct=False, plugin=PLUGIN_LOCAL), "POST", lambda i: f"count-replay-{run}", 0),
        ("first_etcd", dict(base, wasm=count_wasm, direct=False, plugin=PLUGIN_ETCD, etcd_ports=etcd_ports), "POST",
         lambda i: f"count-etcd-{run}-{i}", 1),
    ]
    for name, kw, method, key_of, answers in cases:
        e = Envoy("count-" + name, **kw)
        try:
            out[name] = count_scenario(e, method, key_of, answers)
        finally:
            e.close()
    # Replays of records another proxy made: written through a proxy with the shipped module, read
    # (each key once: every one misses locally and reads the store) through the counting one.
    for name, tag, skw in (("replay_after_local_miss", "", dict(plugin=plugin_store, store_port=webdis_port)),
                           ("replay_after_local_miss_etcd", "-etcd", dict(plugin=PLUGIN_ETCD, etcd_ports=etcd_ports))):
        w = Envoy("count-writer" + tag, **dict(base, wasm=wasm, direct=False, **skw))
        try:
            writes0 = w.stat("idemgate.store_writes")
            conn = http.client.HTTPConnection("127.0.0.1", w.port, timeout=10)
            for i in range(COUNT_WARM + COUNT_REQUESTS):
                send(conn, "POST", f"count-miss{tag}-{run}-{i}")
            conn.close()
            for _ in range(400):  # every completion written to the store
                if w.stat("idemgate.store_writes") - writes0 >= COUNT_WARM + COUNT_REQUESTS:
                    break
                time.sleep(0.05)
        finally:
            w.close()
        e = Envoy("count-reader" + tag, **dict(base, wasm=count_wasm, direct=False, **skw))
        try:
            out[name] = count_scenario(e, "POST", lambda i: f"count-miss{tag}-{run}-{i}", 0)
        finally:
            e.close()
    for name, f in out.items():
        print(f"bench: counted {name}: {f['host_calls']:.1f} host calls, {f['vm_allocations']:.1f} VM allocations, "
              f"{f['store_bytes']:.0f} store bytes per request", flush=True)
    return out


# Memory per worker: each build (and Envoy without a filter) started with 1 and with 2 workers,
# given the same requests (a pool of WORKER_POOL keys in turn, each sent at least twice: first
# POSTs, then replays, so every build holds the same records), then measured; what a second worker
# adds, minus what it adds to Envoy without a filter, is the build's own cost per worker.
WORKER_POOL = 2000 if QUICK else 10000


def memory_per_worker(base, wasm):
    """Envoy's resident set (/proc) and tcmalloc's bytes in use (admin /memory, "allocated", which
    V8's own heap pages are not part of), idle and after the load, per build and worker count."""
    builds = [("none", dict(base, wasm=None, direct=False)),
              ("wasm", dict(base, wasm=wasm, direct=False, plugin=PLUGIN_LOCAL)),
              ("native", dict(base, wasm=None, native=NATIVE, direct=False, plugin=PLUGIN_LOCAL))]
    out = {}
    prefix = f"workers-{time.time_ns():x}-"
    for build, kw in builds:
        out[build] = {}
        for workers in (1, 2):
            e = Envoy(f"workers-{build}-{workers}", concurrency=workers, **kw)
            try:
                time.sleep(1.2)
                idle = {"rss_bytes": e.rss(), "memory_allocated_bytes": e.memory_allocated()}
                sent = 0
                while sent < 2 * WORKER_POOL:
                    sent += wrk(e.port, mode="pool", pool=WORKER_POOL, pool_prefix=f"{prefix}{build}-{workers}-", duration=1,
                                pool_start=sent)["requests"]
                time.sleep(1.2)
                # Connections each worker accepted: both workers served the load.
                per_worker = {k.split(".worker_")[1].split(".")[0]: v for k, v in e.stats("listener.").items()
                              if ".worker_" in k and k.endswith(".downstream_cx_total")}
                out[build][workers] = {"idle": idle, "loaded": {"rss_bytes": e.rss(), "memory_allocated_bytes": e.memory_allocated()},
                                       "requests": sent, "connections_per_worker": per_worker,
                                       "stored": e.stat("idemgate.stored"), "replayed": e.stat("idemgate.replayed")}
            finally:
                e.close()
        w1, w2 = out[build][1]["loaded"], out[build][2]["loaded"]
        out[build]["second_worker"] = {k: w2[k] - w1[k] for k in w1}
        print(f"bench: memory per worker, {build}: RSS {w1['rss_bytes'] / 1048576:.1f} MiB with 1 worker, "
              f"{w2['rss_bytes'] / 1048576:.1f} with 2", flush=True)
    for build in ("wasm", "native"):
        out[build]["own_per_worker"] = {k: out[build]["second_worker"][k] - out["none"]["second_worker"][k] for k in out["none"]["second_worker"]}
    out["pool"] = WORKER_POOL
    return out


def summarise(runs):
    med = lambda k: statistics.median(r[k] for r in runs)
    return {
        "rps": med("rps"), "rps_min": min(r["rps"] for r in runs), "rps_max": max(r["rps"] for r in runs),
        "p50_ms": med("p50_ms"), "p99_ms": med("p99_ms"), "p99_ms_max": max(r["p99_ms"] for r in runs),
        "envoy_cpu_us_per_request": statistics.median(r.get("envoy_cpu_us_per_request", 0) for r in runs),
        "webdis_cpu_us_per_request": statistics.median(r.get("webdis_cpu_us_per_request", 0) for r in runs),
        "redis_cpu_us_per_request": statistics.median(r.get("redis_cpu_us_per_request", 0) for r in runs),
        "etcd_cpu_us_per_request": statistics.median(r.get("etcd_cpu_us_per_request", 0) for r in runs),
        "requests": sum(r["requests"] for r in runs), "non_2xx": sum(r["non_2xx"] for r in runs), "runs": runs,
    }


def main():
    os.makedirs(OUT, exist_ok=True)
    wasm = os.path.join(ROOT, "dist", "idemgate.wasm")
    empty = os.path.join(ROOT, "dist", "empty.wasm")
    count_wasm = os.path.join(ROOT, "dist", "idemgate-count.wasm")
    floor = os.path.join(ROOT, "dist", "idemgate-floor.wasm")
    api_port = free_port()
    start([os.path.join(ROOT, "target", "release", "demo-payments"), "--port", str(api_port)], os.path.join(OUT, "api.log"))
    wait_http(f"http://127.0.0.1:{api_port}/stats")
    redis_port, webdis_port = free_port(), free_port()
    rdir = tempfile.mkdtemp(dir=OUT)
    redis_proc = start(["redis-server", os.path.join(ROOT, "envoy", "redis.conf"), "--port", str(redis_port), "--dir", rdir, "--daemonize", "no", "--appendonly", "no"], os.path.join(OUT, "redis.log"))
    # envoy/redis.conf requires idemgate's Redis password (its ACL user); webdis sends it.
    redis_auth = json.load(open(os.path.join(ROOT, "envoy", "docker-compose", "webdis.json")))["redis_auth"]
    json.dump({"redis_host": "127.0.0.1", "redis_port": redis_port, "redis_auth": redis_auth, "http_host": "127.0.0.1", "http_port": webdis_port, "threads": 1, "pool_size": 8,
               "daemonize": False, "database": 0, "verbosity": 1, "logfile": os.path.join(OUT, "webdis.log"), "acl": [{"disabled": ["DEBUG"]}]},
              open(os.path.join(OUT, "webdis.json"), "w"))
    webdis_proc = start(["webdis", os.path.join(OUT, "webdis.json")], os.path.join(OUT, "webdis.out"), cwd=OUT)
    wait_http(f"http://127.0.0.1:{webdis_port}/PING")
    etcd = Etcd()
    # Redis HA as shipped (scripts/store_ha.py from envoy/redis-ha/: three Redis nodes with
    # envoy/redis.conf's appendfsync always and min-replicas-to-write 1, three Sentinels, two
    # HAProxy + webdis legs), its first POST beside the single Redis and etcd.
    ha_dir = tempfile.mkdtemp(prefix="redis-ha-", dir=OUT)
    store_ha = [sys.executable, os.path.join(ROOT, "scripts", "store_ha.py")]
    subprocess.run(store_ha + ["up", ha_dir], check=True, stdout=subprocess.DEVNULL)
    ha_cluster = subprocess.run(store_ha + ["cluster", ha_dir], check=True, capture_output=True, text=True).stdout
    # CPU of the store's side of each run: webdis (one thread), Redis, the three etcd members.
    store_side = {"webdis": [webdis_proc.pid], "redis": [redis_proc.pid], "etcd": etcd.pids()}
    plugin_store = dict(PLUGIN_LOCAL, store={"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 1000})
    R = {}
    base = dict(api_port=api_port, store_port=None, plugin=None)
    with_redis = dict(store_port=webdis_port)
    with_etcd = dict(etcd_ports=etcd.client_ports)
    # The pools the replay-after-a-local-miss scenarios read: completed through a proxy of each
    # store (every key claimed, executed and its completion landed) before the rounds.
    miss_prefix = f"miss-{time.time_ns():x}-"
    for store, plugin, skw in (("redis", plugin_store, with_redis), ("etcd", PLUGIN_ETCD, with_etcd)):
        w = Envoy(f"miss_writer_{store}", **dict(base, wasm=wasm, direct=False, plugin=plugin, **skw))
        writes0 = w.stat("idemgate.store_writes")
        sent = 0
        # Every pool key sent at least once (later passes replay). Each run goes on where the last
        # one's answered requests ended (its unanswered last few are sent again), so a slow store
        # whose one-second runs answer fewer than MISS_POOL requests still reaches every key.
        while sent < 2 * MISS_POOL:
            sent += wrk(w.port, mode="pool", pool=MISS_POOL, pool_prefix=miss_prefix, duration=1, pool_start=sent)["requests"]
        for _ in range(400):
            if w.stat("idemgate.store_writes") - writes0 >= MISS_POOL:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"{store}: {w.stat('idemgate.store_writes') - writes0} of the miss pool's {MISS_POOL} completions landed")
        w.close()
    # Every scenario (a)-(r), the floors (h) and (q) among them, runs interleaved: every Envoy is started first, then each
    # round runs every scenario once in turn, so a slow spell of this shared VM hits all of them
    # alike; a ratio is the median of its per-round ratios (same round, same conditions), with
    # their spread. The floors get the same POSTs (body, headers, unique keys) as (d) and (e).
    group = [
        ("a_direct", dict(base, wasm=None, direct=True), dict(mode="none")),
        ("a_proxied", dict(base, wasm=None, direct=False), dict(mode="none")),
        # No filter at all, the same GETs as (b proxied) and (c): the floor of a native filter's
        # pass-through (a dynamic module has no VM to enter).
        ("a_proxied_get", dict(base, wasm=None, direct=False), dict(method="GET", mode="none")),
        ("b_empty_wasm_direct", dict(base, wasm=empty, direct=True), dict(mode="fixed")),
        ("b_empty_wasm_proxied", dict(base, wasm=empty, direct=False), dict(method="GET", mode="none")),
        ("c_unprotected_get", dict(base, wasm=wasm, direct=False, plugin=PLUGIN_LOCAL), dict(method="GET", mode="none")),
        ("h_floor_empty_post", dict(base, wasm=floor, direct=False, plugin=floor_plugin("empty")), dict(mode="unique")),
        ("h_floor_buffering", dict(base, wasm=floor, direct=False, plugin=floor_plugin("buffering")), dict(mode="unique")),
        ("h_floor_shared", dict(base, wasm=floor, direct=False, plugin=floor_plugin("shared")), dict(mode="unique")),
        ("d_first_local", dict(base, wasm=wasm, direct=False, plugin=PLUGIN_LOCAL), dict(mode="unique")),
        ("h_floor_store", dict(base, wasm=floor, direct=False, plugin=floor_plugin("store"), store_port=webdis_port), dict(mode="unique")),
        ("e_first_store", dict(base, wasm=wasm, direct=False, plugin=plugin_store, store_port=webdis_port), dict(mode="unique")),
        ("f_replay_local", dict(base, wasm=wasm, direct=False, plugin=PLUGIN_LOCAL), dict(mode="fixed")),
        # The native build beside the Wasm one: the same requests as (c), (d), (e) and (f), the
        # same engine, the same webdis; and the native host's buffering floor (Envoy's own buffer
        # filter) on the same POSTs.
        ("q_floor_native_buffer", dict(base, wasm=None, buffer_filter=True, direct=False), dict(mode="unique")),
        ("m_first_local_native", dict(base, wasm=None, native=NATIVE, direct=False, plugin=PLUGIN_LOCAL), dict(mode="unique")),
        ("o_first_store_native", dict(base, wasm=None, native=NATIVE, direct=False, plugin=plugin_store, store_port=webdis_port), dict(mode="unique")),
        ("n_replay_local_native", dict(base, wasm=None, native=NATIVE, direct=False, plugin=PLUGIN_LOCAL), dict(mode="fixed")),
        ("p_unprotected_get_native", dict(base, wasm=None, native=NATIVE, direct=False, plugin=PLUGIN_LOCAL), dict(method="GET", mode="none")),
        # etcd beside Redis: the same POSTs, the same floors, the same replays after a local miss.
        ("h_floor_store_etcd", dict(base, wasm=floor, direct=False, plugin=dict(floor_plugin("store"), store_kind="etcd", key=FLOOR_ETCD_KEY), **with_etcd),
         dict(mode="unique")),
        ("i_first_etcd", dict(base, wasm=wasm, direct=False, plugin=PLUGIN_ETCD, **with_etcd), dict(mode="unique")),
        # The native build with etcd: the same POSTs as (i), the same etcd members (`Envoy` waits
        # for its lease as for the Wasm one's: wait_store).
        ("r_first_etcd_native", dict(base, wasm=None, native=NATIVE, direct=False, plugin=PLUGIN_ETCD, **with_etcd), dict(mode="unique")),
        ("k_first_redis_ha", dict(base, wasm=wasm, direct=False, plugin=plugin_store, ha_cluster=ha_cluster), dict(mode="unique")),
        ("g_replay_after_local_miss", dict(base, wasm=wasm, direct=False, plugin=dict(plugin_store, local=MISS_LOCAL), **with_redis),
         dict(mode="pool", pool=MISS_POOL, pool_prefix=miss_prefix)),
        ("j_replay_after_local_miss_etcd", dict(base, wasm=wasm, direct=False, plugin=dict(PLUGIN_ETCD, local=MISS_LOCAL), **with_etcd),
         dict(mode="pool", pool=MISS_POOL, pool_prefix=miss_prefix)),
    ]
    envoys = {name: Envoy(name, **kw) for name, kw, _ in group}
    wrk(envoys["f_replay_local"].port, duration=1, mode="fixed")  # the record every run replays
    wrk(envoys["n_replay_local_native"].port, duration=1, mode="fixed")
    runs = {name: [] for name, _, _ in group}
    runs1 = {name: [] for name in ONE_CONNECTION}
    wkws = {name: wkw for name, _, wkw in group}
    counters = {name: (envoys[name].stat("idemgate.store_calls"), envoys[name].stat("idemgate.store_calls_waited"), envoys[name].store_requests()) for name in envoys}
    round_loads = []  # the 1-minute load average at each round's end: above the core count, others shared the CPU
    for rnd in range(RUNS):
        for name, _, wkw in group:
            cpu0 = envoys[name].cpu_seconds()
            side0 = {k: sum(proc_cpu_seconds(p) for p in pids) for k, pids in store_side.items()}
            r = wrk(envoys[name].port, **wkw)
            r["envoy_cpu_us_per_request"] = (envoys[name].cpu_seconds() - cpu0) * 1e6 / max(r["requests"], 1)
            # The store's side of the same requests: webdis (one thread), Redis, etcd's members.
            for k, pids in store_side.items():
                r[f"{k}_cpu_us_per_request"] = (sum(proc_cpu_seconds(p) for p in pids) - side0[k]) * 1e6 / max(r["requests"], 1)
            runs[name].append(r)
        for name in ONE_CONNECTION:
            runs1[name].append(wrk(envoys[name].port, duration=ONE_CONNECTION_DURATION, connections=1, **wkws[name]))
        round_loads.append(round(os.getloadavg()[0], 2))
        print(f"bench: round {rnd + 1}/{RUNS} done (load average {round_loads[-1]})", flush=True)
    time.sleep(0.5)  # writes made after the last responses
    for name, kw, _ in group:
        R[name] = summarise(runs[name])
        if name in runs1:
            R[name]["one_connection"] = summarise(runs1[name])
        if kw.get("plugin"):
            # Every request the counters saw: the 1-connection pass's too.
            n = max(R[name]["requests"] + R[name].get("one_connection", {}).get("requests", 0), 1)
            c0, w0, s0 = counters[name]
            R[name]["store_calls_per_request"] = (envoys[name].stat("idemgate.store_calls") - c0) / n
            R[name]["store_calls_waited_per_request"] = (envoys[name].stat("idemgate.store_calls_waited") - w0) / n
            R[name]["store_cluster_requests_per_request"] = (envoys[name].store_requests() - s0) / n
        envoys[name].close()
        print(f"bench: {name}: {R[name]['rps']:.0f} req/s (min {R[name]['rps_min']:.0f}, max {R[name]['rps_max']:.0f}), p50 {R[name]['p50_ms']:.3f} ms, p99 {R[name]['p99_ms']:.3f} ms", flush=True)

    def cpu_paired(x, y):
        """Median of the per-round ratios of Envoy CPU per request, y/x (a throughput-like ratio:
        1.0 means x costs Envoy no more CPU per request than y)."""
        return statistics.median(b["envoy_cpu_us_per_request"] / a["envoy_cpu_us_per_request"] for a, b in zip(runs[x], runs[y]))

    def paired(x, y):
        """Median and spread of the per-round throughput ratios x/y."""
        rs = [a["rps"] / b["rps"] for a, b in zip(runs[x], runs[y])]
        return {"median": statistics.median(rs), "min": min(rs), "max": max(rs), "per_round": rs}

    def p50_overhead_us(x, y):
        """Median and spread of the per-round 1-connection p50 differences x - y, in µs."""
        ds = [(a["p50_ms"] - b["p50_ms"]) * 1000 for a, b in zip(runs1[x], runs1[y])]
        return {"median": statistics.median(ds), "min": min(ds), "max": max(ds), "per_round": ds}


    # Memory under a flood of unique keys, with the configured cap: Envoy's resident set and the
    # local tier's shared data (idemgate's gauges), idle, once the cap is first filled, then after
    # 100k (and 1M in the full run) unique keys.
    cap = 10000
    capped = dict(PLUGIN_LOCAL, local={"max_entries": cap, "max_bytes": 67108864, "when_full": "evict_oldest"})
    e = Envoy("memory", **dict(base, wasm=wasm, direct=False, plugin=capped))
    time.sleep(1.2)  # the gauges are set once a second

    def mem_point(sent):
        time.sleep(1.2)
        return {"keys_sent": sent, "rss_bytes": e.rss(), "local_record_bytes": e.stat("idemgate.local_record_bytes"),
                "local_index_bytes": e.stat("idemgate.local_index_bytes"), "evictions": e.stat("idemgate.local_evictions")}

    mem = {"cap_max_entries": cap, "points": [mem_point(0)]}
    sent = 0
    # Quick: at least 60,000 keys (six times the cap; wrk overshoots) since the etcd scenarios joined the rounds, to stay
    # under three minutes.
    targets = [2 * cap, 60_000] if QUICK else [2 * cap, 100_000, 1_000_000]
    for target in targets:
        while sent < target:
            sent += wrk(e.port, mode="unique", duration=min(5, max(1, (target - sent) // 2000)))["requests"]
        mem["points"].append(mem_point(sent))
        print(f"bench: memory after {sent} keys: RSS {mem['points'][-1]['rss_bytes'] / 1048576:.1f} MiB", flush=True)
    e.close()
    filled = mem["points"][1]["rss_bytes"]
    mem["rss_growth_after_cap_filled_bytes"] = mem["points"][-1]["rss_bytes"] - filled
    R["memory"] = mem

    R["memory_per_worker"] = memory_per_worker(base, wasm)

    counted = count_pass(base, wasm, count_wasm, plugin_store, webdis_port, etcd.client_ports)

    # The per-step profile compiles the core twice (native and wasm32): full runs only.
    profile = hot_path_profile() if not QUICK else {"skipped": "quick run"}
    cpu_split = perf_split(base, wasm, empty, floor, plugin_store, webdis_port, etcd.client_ports) if not QUICK else {"skipped": "quick run"}
    for p in etcd.procs:
        stop(p)
    subprocess.run(store_ha + ["down", ha_dir], check=False)

    passthrough = paired("c_unprotected_get", "b_empty_wasm_proxied")
    protected_first = paired("e_first_store", "a_proxied")
    replay_local = paired("f_replay_local", "b_empty_wasm_direct")
    local_floor = paired("d_first_local", "h_floor_buffering")
    shared_floor = paired("d_first_local", "h_floor_shared")
    shared_vs_buffering = paired("h_floor_shared", "h_floor_buffering")
    store_floor = paired("e_first_store", "h_floor_store")
    local_p50 = p50_overhead_us("d_first_local", "h_floor_buffering")
    store_p50 = p50_overhead_us("e_first_store", "h_floor_store")
    etcd_vs_redis = paired("i_first_etcd", "e_first_store")
    etcd_floor = paired("i_first_etcd", "h_floor_store_etcd")
    etcd_p50 = p50_overhead_us("i_first_etcd", "h_floor_store_etcd")
    ha_vs_redis = paired("k_first_redis_ha", "e_first_store")
    miss_etcd_vs_redis = paired("j_replay_after_local_miss_etcd", "g_replay_after_local_miss")
    native_first = paired("m_first_local_native", "d_first_local")
    native_replay = paired("n_replay_local_native", "f_replay_local")
    native_local_floor = paired("m_first_local_native", "h_floor_buffering")
    native_local_own_floor = paired("m_first_local_native", "q_floor_native_buffer")
    native_store = paired("o_first_store_native", "e_first_store")
    native_store_floor = paired("o_first_store_native", "h_floor_store")
    native_etcd = paired("r_first_etcd_native", "i_first_etcd")
    native_etcd_floor = paired("r_first_etcd_native", "h_floor_store_etcd")
    native_passthrough = paired("p_unprotected_get_native", "c_unprotected_get")
    native_passthrough_empty = paired("p_unprotected_get_native", "b_empty_wasm_proxied")
    native_passthrough_none = paired("p_unprotected_get_native", "a_proxied_get")
    wasm_passthrough_none = paired("c_unprotected_get", "a_proxied_get")
    native_floor_vs_buffering = paired("q_floor_native_buffer", "h_floor_buffering")
    native_local_p50 = p50_overhead_us("m_first_local_native", "h_floor_buffering")
    native_local_own_p50 = p50_overhead_us("m_first_local_native", "q_floor_native_buffer")
    native_store_p50 = p50_overhead_us("o_first_store_native", "h_floor_store")
    native_etcd_p50 = p50_overhead_us("r_first_etcd_native", "h_floor_store_etcd")
    one = lambda k, f: R[k]["one_connection"][f]
    results = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "envoy": subprocess.run(["envoy", "--version"], capture_output=True, text=True).stdout.strip(),
                    "round_loads": round_loads},
        "note": os.environ.get("BENCH_NOTE", ""),
        "settings": {"envoy_workers": 1, "wrk_threads": 1, "connections": CONNECTIONS, "duration_s": DURATION, "runs": RUNS, "interleaved": True, "body_bytes": len(BODY), "log_level": "error", "quick": QUICK},
        "passthrough_ratio": passthrough["median"],
        "passthrough_ratio_spread": passthrough,
        "passthrough_ratio_divides_by": "b_empty_wasm_proxied (same GET requests)",
        "passthrough_cpu_ratio": cpu_paired("c_unprotected_get", "b_empty_wasm_proxied"),
        "passthrough_cpu_ratio_note": "Envoy CPU per request of (b) divided by that of (c): the same comparison, insensitive to how the VM schedules wrk and the upstream",
        "replay_local_cpu_ratio": cpu_paired("f_replay_local", "b_empty_wasm_direct"),
        "protected_first_ratio": protected_first["median"],
        "protected_first_ratio_spread": protected_first,
        "protected_first_ratio_divides_by": "a_proxied (Envoy without Wasm, proxying the same POSTs)",
        "protected_first_local_ratio": paired("d_first_local", "a_proxied")["median"],
        "replay_local_ratio": replay_local["median"],
        "replay_local_ratio_spread": replay_local,
        "replay_local_ratio_divides_by": "b_empty_wasm_direct (empty Wasm filter in front of Envoy's direct_response, same POSTs)",
        "empty_wasm_ratio_direct": paired("b_empty_wasm_direct", "a_direct")["median"],
        "native_first_local_ratio": native_first["median"],
        "native_first_local_ratio_spread": native_first,
        "native_first_local_ratio_divides_by": "d_first_local (the Wasm build, same POSTs)",
        "native_replay_local_ratio": native_replay["median"],
        "native_replay_local_ratio_spread": native_replay,
        "native_replay_local_ratio_divides_by": "f_replay_local (the Wasm build, same POSTs)",
        "native_replay_local_cpu_ratio": cpu_paired("n_replay_local_native", "f_replay_local"),
        "native_first_local_cpu_ratio": cpu_paired("m_first_local_native", "d_first_local"),
        "native_first_local_floor_ratio": native_local_floor["median"],
        "native_first_local_floor_ratio_spread": native_local_floor,
        "native_first_local_floor_ratio_divides_by": "h_floor_buffering (the Wasm buffering floor of first_local_floor_ratio; same POSTs)",
        "native_first_local_floor_cpu_ratio": cpu_paired("m_first_local_native", "h_floor_buffering"),
        "native_first_local_native_floor_ratio": native_local_own_floor["median"],
        "native_first_local_native_floor_ratio_spread": native_local_own_floor,
        "native_first_local_native_floor_ratio_divides_by": "q_floor_native_buffer (Envoy's own buffer filter: pause at headers, whole body, continue; no response read; same POSTs)",
        "native_first_local_native_floor_cpu_ratio": cpu_paired("m_first_local_native", "q_floor_native_buffer"),
        "native_buffer_floor_vs_wasm_buffering_ratio": native_floor_vs_buffering["median"],
        "native_buffer_floor_vs_wasm_buffering_ratio_spread": native_floor_vs_buffering,
        "native_first_store_ratio": native_store["median"],
        "native_first_store_ratio_spread": native_store,
        "native_first_store_ratio_divides_by": "e_first_store (the Wasm build, same POSTs, same webdis and Redis)",
        "native_first_store_cpu_ratio": cpu_paired("o_first_store_native", "e_first_store"),
        "native_first_store_floor_ratio": native_store_floor["median"],
        "native_first_store_floor_ratio_spread": native_store_floor,
        "native_first_store_floor_ratio_divides_by": "h_floor_store (the Wasm store floor of first_store_floor_ratio: buffering plus 2 webdis callouts; same POSTs)",
        "native_first_store_floor_cpu_ratio": cpu_paired("o_first_store_native", "h_floor_store"),
        "native_first_store_round_trips": R["o_first_store_native"]["store_calls_waited_per_request"],
        "native_first_store_calls_total": R["o_first_store_native"]["store_calls_per_request"],
        "native_first_store_cluster_requests": R["o_first_store_native"]["store_cluster_requests_per_request"],
        "native_first_etcd_ratio": native_etcd["median"],
        "native_first_etcd_ratio_spread": native_etcd,
        "native_first_etcd_ratio_divides_by": "i_first_etcd (the Wasm build, same POSTs, same etcd members)",
        "native_first_etcd_cpu_ratio": cpu_paired("r_first_etcd_native", "i_first_etcd"),
        "native_first_etcd_floor_ratio": native_etcd_floor["median"],
        "native_first_etcd_floor_ratio_spread": native_etcd_floor,
        "native_first_etcd_floor_ratio_divides_by": "h_floor_store_etcd (the Wasm etcd store floor of first_etcd_floor_ratio: buffering plus 2 etcd writes; same POSTs, same etcd)",
        "native_first_etcd_floor_cpu_ratio": cpu_paired("r_first_etcd_native", "h_floor_store_etcd"),
        "native_first_etcd_round_trips": R["r_first_etcd_native"]["store_calls_waited_per_request"],
        "native_first_etcd_calls_total": R["r_first_etcd_native"]["store_calls_per_request"],
        "native_first_etcd_cluster_requests": R["r_first_etcd_native"]["store_cluster_requests_per_request"],
        "native_passthrough_ratio": native_passthrough["median"],
        "native_passthrough_ratio_spread": native_passthrough,
        "native_passthrough_ratio_divides_by": "c_unprotected_get (the Wasm build, same GETs)",
        "native_passthrough_cpu_ratio": cpu_paired("p_unprotected_get_native", "c_unprotected_get"),
        "native_passthrough_empty_ratio": native_passthrough_empty["median"],
        "native_passthrough_empty_ratio_spread": native_passthrough_empty,
        "native_passthrough_empty_ratio_divides_by": "b_empty_wasm_proxied (the empty Wasm filter, same GETs)",
        "native_passthrough_nofilter_ratio": native_passthrough_none["median"],
        "native_passthrough_nofilter_ratio_spread": native_passthrough_none,
        "native_passthrough_nofilter_ratio_divides_by": "a_proxied_get (Envoy without any filter, same GETs)",
        "native_passthrough_nofilter_cpu_ratio": cpu_paired("p_unprotected_get_native", "a_proxied_get"),
        "wasm_passthrough_nofilter_ratio": wasm_passthrough_none["median"],
        "wasm_passthrough_nofilter_ratio_spread": wasm_passthrough_none,
        "wasm_passthrough_nofilter_cpu_ratio": cpu_paired("c_unprotected_get", "a_proxied_get"),
        "native_first_local_p50_overhead_us": native_local_p50["median"],
        "native_first_local_p50_overhead_us_spread": native_local_p50,
        "native_first_local_native_floor_p50_overhead_us": native_local_own_p50["median"],
        "native_first_local_native_floor_p50_overhead_us_spread": native_local_own_p50,
        "native_first_store_p50_overhead_us": native_store_p50["median"],
        "native_first_store_p50_overhead_us_spread": native_store_p50,
        "native_first_etcd_p50_overhead_us": native_etcd_p50["median"],
        "native_first_etcd_p50_overhead_us_spread": native_etcd_p50,
        "native_so_bytes": os.path.getsize(NATIVE),
        "first_local_floor_ratio": local_floor["median"],
        "first_local_floor_ratio_spread": local_floor,
        "first_local_floor_ratio_divides_by": "h_floor_buffering (pause at headers, whole body, continue, response headers and body read; same POSTs)",
        "first_local_floor_cpu_ratio": cpu_paired("d_first_local", "h_floor_buffering"),
        "first_local_shared_floor_ratio": shared_floor["median"],
        "first_local_shared_floor_ratio_spread": shared_floor,
        "first_local_shared_floor_ratio_divides_by": "h_floor_shared (the buffering floor plus the local tier's 5 shared-data calls of a first request, values of idemgate's sizes)",
        "first_local_shared_floor_cpu_ratio": cpu_paired("d_first_local", "h_floor_shared"),
        "shared_floor_vs_buffering_ratio": shared_vs_buffering["median"],
        "shared_floor_vs_buffering_cpu_ratio": cpu_paired("h_floor_shared", "h_floor_buffering"),
        "first_store_floor_ratio": store_floor["median"],
        "first_store_floor_ratio_spread": store_floor,
        "first_store_floor_ratio_divides_by": "h_floor_store (the buffering floor plus a webdis GET waited for and a second one from the root after the response; same POSTs, same webdis)",
        "first_store_floor_cpu_ratio": cpu_paired("e_first_store", "h_floor_store"),
        "first_local_p50_overhead_us": local_p50["median"],
        "first_local_p50_overhead_us_spread": local_p50,
        "first_local_p50_overhead_us_note": "1-connection p50 of (d) minus that of the buffering floor, per round, median",
        "first_store_p50_overhead_us": store_p50["median"],
        "first_store_p50_overhead_us_spread": store_p50,
        "pause_cost_ratio": paired("h_floor_buffering", "h_floor_empty_post")["median"],
        "pause_cost_ratio_note": "buffering floor / empty filter on the same POSTs: what pausing for the body costs any filter",
        "first_request_store_round_trips": R["e_first_store"]["store_calls_waited_per_request"],
        "first_request_store_round_trips_note": "store calls the client waits for (the claim-or-read); the completion write is made after the response",
        "first_request_store_calls_total": R["e_first_store"]["store_calls_per_request"],
        "replay_local_store_round_trips": R["f_replay_local"]["store_calls_per_request"],
        "replay_after_local_miss_store_round_trips": R["g_replay_after_local_miss"]["store_calls_per_request"],
        "wasm_bytes": os.path.getsize(wasm),
        "empty_wasm_bytes": os.path.getsize(empty),
        "floor_wasm_bytes": os.path.getsize(floor),
        **{f"host_calls_{k}": v["host_calls"] for k, v in counted.items()},
        **{f"vm_allocations_{k}": v["vm_allocations"] for k, v in counted.items()},
        "store_bytes_first_request": counted["first_store"]["store_bytes"],
        "store_bytes_first_request_note": "bytes of the webdis requests' paths and bodies per first request with Redis (the claim-or-read and the completion write), counted by dist/idemgate-count.wasm",
        "store_bytes_replay_after_local_miss": counted["replay_after_local_miss"]["store_bytes"],
        "counted_per_request": counted,
        # etcd beside Redis (three members on loopback, fsync per commit), same rounds, same POSTs.
        "redis_first_rps": R["e_first_store"]["rps"],
        "redis_first_p50_ms_1conn": one("e_first_store", "p50_ms"),
        "redis_first_p99_ms_1conn": one("e_first_store", "p99_ms"),
        "redis_ha_first_rps": R["k_first_redis_ha"]["rps"],
        "redis_ha_first_p50_ms_1conn": one("k_first_redis_ha", "p50_ms"),
        "redis_ha_first_p99_ms_1conn": one("k_first_redis_ha", "p99_ms"),
        "redis_ha_first_vs_redis_ratio": ha_vs_redis["median"],
        "redis_ha_first_vs_redis_ratio_spread": ha_vs_redis,
        "redis_ha_first_store_round_trips": R["k_first_redis_ha"]["store_calls_waited_per_request"],
        "etcd_first_rps": R["i_first_etcd"]["rps"],
        "etcd_first_p50_ms_1conn": one("i_first_etcd", "p50_ms"),
        "etcd_first_p99_ms_1conn": one("i_first_etcd", "p99_ms"),
        "etcd_first_vs_redis_ratio": etcd_vs_redis["median"],
        "etcd_first_vs_redis_ratio_spread": etcd_vs_redis,
        "etcd_first_vs_redis_ratio_divides_by": "e_first_store (idemgate's first POST with Redis behind webdis; same POSTs, same rounds)",
        "etcd_first_vs_redis_cpu_ratio": cpu_paired("i_first_etcd", "e_first_store"),
        "etcd_first_store_round_trips": R["i_first_etcd"]["store_calls_waited_per_request"],
        "etcd_first_store_calls_total": R["i_first_etcd"]["store_calls_per_request"],
        "first_etcd_floor_ratio": etcd_floor["median"],
        "first_etcd_floor_ratio_spread": etcd_floor,
        "first_etcd_floor_ratio_divides_by": "h_floor_store_etcd (the buffering floor plus an etcd put waited for and a second one from the root after the response: two Raft commits, as a claim and a completion are; same POSTs, same etcd)",
        "first_etcd_floor_cpu_ratio": cpu_paired("i_first_etcd", "h_floor_store_etcd"),
        "first_etcd_p50_overhead_us": etcd_p50["median"],
        "first_etcd_p50_overhead_us_spread": etcd_p50,
        "redis_replay_after_local_miss_rps": R["g_replay_after_local_miss"]["rps"],
        "redis_replay_after_local_miss_p50_ms_1conn": one("g_replay_after_local_miss", "p50_ms"),
        "redis_replay_after_local_miss_p99_ms_1conn": one("g_replay_after_local_miss", "p99_ms"),
        "redis_replay_after_local_miss_store_calls_per_request": R["g_replay_after_local_miss"]["store_calls_per_request"],
        "etcd_replay_after_local_miss_rps": R["j_replay_after_local_miss_etcd"]["rps"],
        "etcd_replay_after_local_miss_p50_ms_1conn": one("j_replay_after_local_miss_etcd", "p50_ms"),
        "etcd_replay_after_local_miss_p99_ms_1conn": one("j_replay_after_local_miss_etcd", "p99_ms"),
        "etcd_replay_after_local_miss_store_calls_per_request": R["j_replay_after_local_miss_etcd"]["store_calls_per_request"],
        "etcd_replay_after_local_miss_vs_redis_ratio": miss_etcd_vs_redis["median"],
        "etcd_replay_after_local_miss_vs_redis_ratio_spread": miss_etcd_vs_redis,
        "replay_after_local_miss_every_request_note": f"a proxy whose local tier holds 16 records reads a pool of {MISS_POOL} keys completed beforehand through another proxy, in turn: every request misses locally and reads the store once (store_calls_per_request)",
        "store_bytes_first_request_etcd": counted["first_etcd"]["store_bytes"],
        "store_bytes_replay_after_local_miss_etcd": counted["replay_after_local_miss_etcd"]["store_bytes"],
        "hot_path_ns": profile,
        "envoy_cpu_split": cpu_split,
        "scenarios": R,
    }
    json.dump(results, open(os.path.join(OUT, "results.json"), "w"), indent=2)
    write_docs(results)
    print(json.dumps({k: v for k, v in results.items() if k != "scenarios"}, indent=2))


def hot_path_profile():
    """The core's per-request steps, timed natively and in V8 (benches/hot_path.rs)."""
    env = dict(os.environ, IDEMGATE_HOT_PATH_MS="30" if QUICK else "300")
    out = {}
    # --no-default-features, as on wasm32: the benches need only the core, and with the default
    # features cargo also builds the CLI binary, whose library shares its file name with the
    # testkit build of the dev-dependency on this crate (cargo's "output filename collision"),
    # and that link failed here now and then.
    native = ["cargo", "bench", "--locked", "--no-default-features", "--bench", "hot_path", "--", "--bench"]
    for where, cmd in (("native", native),
                       ("wasm32_v8", [os.path.join(ROOT, "scripts", "hot-path-wasm.sh")])):
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        steps = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
        out[where] = {s["step"]: s["ns_per_op"] for s in steps} if p.returncode == 0 else {"error": p.stderr[-400:]}
    return out


def perf_split(base, wasm, empty, floor, plugin_store, webdis_port, etcd_ports):
    """Where Envoy's CPU goes (Linux perf, when it works here): the kernel, Envoy's own code
    (stripped: no symbols), and the Wasm code V8 compiled ([JIT]), for the GET pass-through of the
    empty filter and of idemgate, a first POST (local tier, and Redis) beside its floors, and a
    local replay."""
    if subprocess.run(["perf", "stat", "-e", "task-clock", "true"], capture_output=True).returncode != 0:
        return {"skipped": "perf is not usable here"}
    cases = [("b_empty_wasm_proxied", dict(base, wasm=empty, direct=False), dict(method="GET", mode="none")),
             ("c_unprotected_get", dict(base, wasm=wasm, direct=False, plugin=PLUGIN_LOCAL), dict(method="GET", mode="none")),
             ("h_floor_buffering", dict(base, wasm=floor, direct=False, plugin=floor_plugin("buffering")), dict(mode="unique")),
             ("h_floor_shared", dict(base, wasm=floor, direct=False, plugin=floor_plugin("shared")), dict(mode="unique")),
             ("d_first_local", dict(base, wasm=wasm, direct=False, plugin=PLUGIN_LOCAL), dict(mode="unique")),
             ("h_floor_store", dict(base, wasm=floor, direct=False, plugin=floor_plugin("store"), store_port=webdis_port), dict(mode="unique")),
             ("e_first_store", dict(base, wasm=wasm, direct=False, plugin=plugin_store, store_port=webdis_port), dict(mode="unique")),
             ("h_floor_store_etcd", dict(base, wasm=floor, direct=False, plugin=dict(floor_plugin("store"), store_kind="etcd", key=FLOOR_ETCD_KEY),
                                         etcd_ports=etcd_ports), dict(mode="unique")),
             ("i_first_etcd", dict(base, wasm=wasm, direct=False, plugin=PLUGIN_ETCD, etcd_ports=etcd_ports), dict(mode="unique")),
             ("f_replay_local", dict(base, wasm=wasm, direct=False, plugin=PLUGIN_LOCAL), dict(mode="fixed"))]
    out = {}
    for name, ekw, wkw in cases:
        e = Envoy("perf-" + name, **ekw)
        try:
            wrk(e.port, duration=1, **wkw)
            data = os.path.join(OUT, f"perf-{name}.data")
            rec = subprocess.Popen(["perf", "record", "-F", "999", "-p", str(e.proc.pid), "-o", data, "--", "sleep", "5"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.3)
            cpu0 = e.cpu_seconds()
            r = wrk(e.port, duration=4, **wkw)
            cpu_us = (e.cpu_seconds() - cpu0) * 1e6 / max(r["requests"], 1)
            rec.wait(timeout=60)
            rep = subprocess.run(["perf", "report", "-i", data, "--sort", "dso", "--stdio"], capture_output=True, text=True).stdout
            shares = {"kernel": 0.0, "envoy": 0.0, "wasm_jit": 0.0, "other": 0.0}
            for line in rep.splitlines():
                m = re.match(r"\s*([\d.]+)%\s+(.+?)\s*$", line)
                if not m:
                    continue
                pct, dso = float(m.group(1)), m.group(2)
                key = "kernel" if "kernel" in dso else "wasm_jit" if dso.startswith("[JIT]") else "envoy" if dso == "envoy" else "other"
                shares[key] += pct
            out[name] = {"percent": shares, "rps_under_perf": r["rps"], "envoy_cpu_us_per_request": cpu_us,
                         "us_per_request": {k: v * cpu_us / 100 for k, v in shares.items()}}
        finally:
            e.close()
    return out


LABELS = [
    ("a_direct", "(a) Envoy, direct_response"),
    ("a_proxied", "(a) Envoy, proxied"),
    ("a_proxied_get", "(a) Envoy, proxied (GET)"),
    ("b_empty_wasm_direct", "(b) empty Wasm, direct_response"),
    ("b_empty_wasm_proxied", "(b) empty Wasm, proxied (GET)"),
    ("c_unprotected_get", "(c) idemgate, unprotected GET"),
    ("d_first_local", "(d) idemgate, first POST, local tier"),
    ("e_first_store", "(e) idemgate, first POST, Redis store"),
    ("f_replay_local", "(f) idemgate, replay from memory"),
    ("m_first_local_native", "(m) idemgate native, first POST, local tier"),
    ("o_first_store_native", "(o) idemgate native, first POST, Redis store"),
    ("r_first_etcd_native", "(r) idemgate native, first POST, etcd store"),
    ("n_replay_local_native", "(n) idemgate native, replay from memory"),
    ("p_unprotected_get_native", "(p) idemgate native, unprotected GET"),
    ("q_floor_native_buffer", "(q) floor, native host: Envoy's buffer filter"),
    ("h_floor_empty_post", "(h) floor: empty filter, same POSTs"),
    ("h_floor_buffering", "(h) floor: buffering (body, response)"),
    ("h_floor_shared", "(h) floor: buffering + the local tier's shared data"),
    ("h_floor_store", "(h) floor: buffering + 2 store callouts"),
    ("h_floor_store_etcd", "(h) floor: buffering + 2 etcd writes"),
    ("i_first_etcd", "(i) idemgate, first POST, etcd store"),
    ("k_first_redis_ha", "(k) idemgate, first POST, Redis HA store"),
    ("g_replay_after_local_miss", "(g) idemgate, replay after local miss, Redis"),
    ("j_replay_after_local_miss_etcd", "(j) idemgate, replay after local miss, etcd"),
]


def svg(results):
    S = results["scenarios"]
    w, row, left = 760, 26, 300
    h = 60 + row * len(LABELS) * 2
    top_rps = max(S[k]["rps"] for k, _ in LABELS)
    top_p99 = max(S[k]["p99_ms"] for k, _ in LABELS)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           '<text x="10" y="20" font-size="14">idemgate: throughput (blue, req/s) and p99 latency (orange, ms) by scenario</text>']
    for i, (k, label) in enumerate(LABELS):
        y = 40 + i * row * 2
        rps, p99 = S[k]["rps"], S[k]["p99_ms"]
        out.append(f'<text x="10" y="{y + 12}">{label}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{(w - left - 90) * rps / top_rps:.1f}" height="12" fill="#3b6fb6"/>')
        out.append(f'<text x="{left + (w - left - 90) * rps / top_rps + 4:.1f}" y="{y + 11}">{rps:.0f}</text>')
        out.append(f'<rect x="{left}" y="{y + 15}" width="{(w - left - 90) * p99 / top_p99:.1f}" height="10" fill="#e08a2c"/>')
        out.append(f'<text x="{left + (w - left - 90) * p99 / top_p99 + 4:.1f}" y="{y + 24}">{p99:.2f} ms</text>')
    out.append("</svg>")
    return "\n".join(out)


# The shipped module's size in the last docs/BENCHMARKS.md run before issue 27 was filed.
ISSUE_27_MODULE_BYTES = 637772


def shared_first_local(results):
    """Shared-data calls of a first local request, from the counting build's kinds."""
    return calls_of(results["counted_per_request"].get("first_local", {}), SHARED_KINDS)[0]


# The kinds of host call `still_pays_for` groups, by what they touch (the counting build's
# `idemgate.count.kind.<callback>.<kind>`).
SHARED_KINDS = ("bucket_get", "bucket_set", "slot_get", "slot_set", "counter_get", "counter_set", "shared_get", "shared_set")
PAYS_FOR_GROUPS = [
    ("Shared data", SHARED_KINDS),
    ("Clock", ("clock",)),
    ("Headers", ("get_header", "get_header_map", "set_header", "add_header")),
    ("Bodies", ("get_buffer",)),
    ("Properties", ("get_property",)),
    ("Filter state", ("set_property",)),
]


def calls_of(fl, kinds):
    """Counted calls of these kinds per first local request: in all, and by callback (those made)."""
    by = {}
    for k, v in fl.items():
        parts = k.split(".")
        if len(parts) == 3 and parts[0] == "kind" and parts[2] in kinds and v > 0:
            by[parts[1]] = by.get(parts[1], 0) + v
    return sum(by.values()), by


def still_pays_for(fl):
    """What a first request in the local tier pays for, by group of host calls: every figure read from
    the counting build's kinds (`fl`: counted_per_request["first_local"]), none written here."""
    if "host_calls" not in fl:
        return "What a first request in the local tier pays for: not counted in this run."
    n = {}
    for name, kinds in PAYS_FOR_GROUPS:
        total, by = calls_of(fl, kinds)
        where = ", ".join(f"{cb.replace('_', ' ')} {v:.0f}" for cb, v in by.items())
        n[name] = f"{total:.0f}" + (f" ({where})" if where else "")
    return f"""What a first request in the local tier still pays for (`host_calls_first_local`: {fl['host_calls']:.1f} in
this run; issue 27's target 14), each call by the table above, and why it stays (the figures counted
in this run):
- **Shared data, {n['Shared data']}**. Every change of the table is
  a CAS on a key that exists, and Envoy's `set_shared_data` hands back no version: the version a
  CAS compares comes only from a read (Envoy's CAS value is one process-wide counter, so the
  version after our own write cannot be predicted), so each change is a read and a write. A
  single CAS "on the expected absent version" is no atomic insert in Envoy (`SharedData::set`
  inserts an absent key whatever the CAS it is given, so two racing claims would both succeed).
  The claim is one pair split over two callbacks: the key's bucket (which holds its own occupancy
  and bytes: no table-wide counter) read at the request headers, where nothing is claimed (a live
  claim is answered 409 there), and its CAS at the end of the body on the value read then, the
  claim made with its fingerprint and forwarded at once (a bucket changed meanwhile fails the CAS
  and is read again: 2 calls more on that request). Then the completion (the bucket read, the body
  written to its own key, the bucket's CAS that completes the entry and counts the body's bytes
  against the bucket's share of `max_bytes`). Completing by the body key alone would save one more
  (the bytes could no longer be counted in the same atomic step: `max_bytes` would not be exact);
  docs/local-tier.md has the analysis.
- **Clock, {n['Clock']}**: the look at headers (is a lock live?); the claim at the body's end (the lock
  counts from there: the route's timeout counts from there, and `lock_ttl_seconds` need only
  exceed it: an older time would shorten the lock under a running request); the completed
  record's expiry and the lifecycle's check that our claim is not free yet. Each callback reads it
  once.
- **Headers, {n['Headers']}**: the request's header map (method, route, key, scope, fingerprint: read whole
  once); `x-envoy-max-retries: 0` (never re-sent by the router); the response's header map (status
  and headers kept for replays); `idempotency-key-expires-in` to the client.
- **Bodies, {n['Bodies']}**: the request body once at its end; each response body chunk.
- **Properties, {n['Properties']}**: `response.code_details` (tells an upstream answer from Envoy's own reply: a
  later filter can replace one) and `upstream.request_attempt_count` (read always: a re-send
  behind idemgate's back is counted and logged).
- **Filter state, {n['Filter state']}**: `wasm.idemgate_outcome` and `wasm.idemgate_key`, the two values access logs
  print by name (one call each)."""


def native_beside_wasm(results, sp, r3):
    """The section "Native beside Wasm": the native build's scenarios beside the Wasm build's, each
    ratio with its baseline, what the engine costs in each host, memory per worker."""
    S = results["scenarios"]
    cpu = lambda k: S[k].get("envoy_cpu_us_per_request", 0)
    one = lambda k: S[k].get("one_connection", {}).get("p50_ms", float("nan")) * 1000
    rps = lambda k: f"{S[k]['rps']:.0f} ({S[k]['rps_min']:.0f}-{S[k]['rps_max']:.0f})"
    yes = lambda ok: "reached" if ok else "**not reached**"
    quick = " (a quick run on a shared machine: not judged here; a full quiet `make bench` decides)" if results["settings"]["quick"] else ""
    rows = "\n".join(f"| {what} | {rps(w)} | {rps(n)} | **{r3(ratio)}** ({sp(ratio)}) | {cpu(w):.0f} | {cpu(n):.0f} |"
                     for what, w, n, ratio in [("first POST, local tier", "d_first_local", "m_first_local_native", "native_first_local_ratio"),
                                               ("first POST, Redis store", "e_first_store", "o_first_store_native", "native_first_store_ratio"),
                                               ("first POST, etcd store", "i_first_etcd", "r_first_etcd_native", "native_first_etcd_ratio"),
                                               ("replay from memory", "f_replay_local", "n_replay_local_native", "native_replay_local_ratio"),
                                               ("unprotected GET (pass-through)", "c_unprotected_get", "p_unprotected_get_native", "native_passthrough_ratio")])
    M = S.get("memory_per_worker")
    if M:
        mib = lambda v: f"{v / 1048576:.1f}"
        b = ("none", "wasm", "native")
        line = lambda what, f: f"| {what} | " + " | ".join(f(M[x]) for x in b) + " |"
        # Worker counts are keys 1 and 2 in a run, "1" and "2" read back from results.json (--render).
        w = lambda m, n: m.get(n) or m.get(str(n))
        mem = "\n".join([
            "| | Envoy, no filter | Wasm build | native build |",
            "|---|---|---|---|",
            line("RSS idle, 1 worker, MiB", lambda m: mib(w(m, 1)["idle"]["rss_bytes"])),
            line("RSS idle, 2 workers, MiB", lambda m: mib(w(m, 2)["idle"]["rss_bytes"])),
            line("RSS after the load, 1 worker, MiB", lambda m: mib(w(m, 1)["loaded"]["rss_bytes"])),
            line("RSS after the load, 2 workers, MiB", lambda m: mib(w(m, 2)["loaded"]["rss_bytes"])),
            line("a second worker adds to the RSS, MiB", lambda m: mib(m["second_worker"]["rss_bytes"])),
            line("a second worker adds to tcmalloc's allocated bytes, MiB", lambda m: mib(m["second_worker"]["memory_allocated_bytes"])),
            "| **the build's own per worker**: RSS, MiB | - | " + " | ".join(f"**{mib(M[x]['own_per_worker']['rss_bytes'])}**" for x in b[1:]) + " |",
            "| the build's own per worker: tcmalloc's allocated bytes, MiB | - | " + " | ".join(mib(M[x]["own_per_worker"]["memory_allocated_bytes"]) for x in b[1:]) + " |",
            line("connections per worker, 2 workers", lambda m: ", ".join(f"{k}: {v}" for k, v in sorted(w(m, 2)["connections_per_worker"].items()))),
            "| records stored / replays, 2 workers | - | " + " | ".join(f"{w(M[x], 2)['stored']} / {w(M[x], 2)['replayed']}" for x in b[1:]) + " |",
        ])
        mem_text = f"""**Memory per worker.** Each build (and Envoy without a filter) started twice, with 1 and with 2
workers (`--concurrency`), each given the same load: a pool of {M['pool']} keys sent in turn until
every key went at least twice (first POSTs, then replays; wrk with {results['settings']['connections']} connections, which the
kernel spreads over the workers: the connections each accepted are listed), then measured after
1.2 s. What a second worker adds, minus what it adds to Envoy without a filter, is **the build's
own cost per worker**: for the Wasm build a V8 VM with the module's instance per worker; for the
native build the per-worker filter configuration only (its table is one per process, shared by
every worker, as the Wasm build's shared data is). The records both builds hold are the same
{M['pool']}, per process, so they cancel out of the difference. Envoy's resident set is read from
/proc; "allocated" is the bytes in use in Envoy's allocator (tcmalloc, admin `/memory`), which V8's
own heap pages are not part of: for the Wasm build, the RSS is the figure that counts. One
sample per build and worker count: a difference of a MiB or two is within what the allocators
keep or return, not a finding.

{mem}
"""
    else:
        mem_text = "Memory per worker: not measured in this run."
    return f"""## Native beside Wasm

The native build (`libidemgate_native.so`, [native.md](native.md): the same engine as an Envoy
dynamic module) in the same interleaved rounds as the Wasm build, on the same requests: (m), (o),
(r), (n) and (p) are (d), (e), (i), (f) and (c) with the native filter in place of the Wasm one (same
configuration, same webdis and Redis, same etcd members, the record secret in Envoy's process
environment). Each
ratio is the median of its per-round throughput ratios, with their min-max; CPU ratios are the
baseline's Envoy CPU per request over the scenario's (above 1: cheaper than the baseline).

| | Wasm build, req/s | native build, req/s | native / Wasm (rounds) | Wasm, Envoy CPU µs / request | native, Envoy CPU µs / request |
|---|---|---|---|---|---|
{rows}

- `native_first_local_floor_ratio` = (m) / the buffering floor (the Wasm floor of `first_local_floor_ratio`) =
  **{r3('native_first_local_floor_ratio')}** (rounds: {sp('native_first_local_floor_ratio')}; by Envoy CPU per request {r3('native_first_local_floor_cpu_ratio')});
  goal >= 0.95 (issue 45): {yes(results['native_first_local_floor_ratio'] >= 0.95)}{quick}. 1-connection p50, (m) minus the buffering floor:
  {results['native_first_local_p50_overhead_us']:.0f} µs (rounds: {results['native_first_local_p50_overhead_us_spread']['min']:.0f} to {results['native_first_local_p50_overhead_us_spread']['max']:.0f}; the Wasm build's, (d) minus it: {results['first_local_p50_overhead_us']:.0f} µs)
- `native_first_store_floor_ratio` = (o) / the store floor (buffering + 2 webdis callouts, the Wasm floor of
  `first_store_floor_ratio`) = **{r3('native_first_store_floor_ratio')}** (rounds: {sp('native_first_store_floor_ratio')}; by Envoy CPU per request
  {r3('native_first_store_floor_cpu_ratio')}); goal >= 0.9 (issue 45): {yes(results['native_first_store_floor_ratio'] >= 0.9)}{quick}. 1-connection p50, (o) minus
  the store floor: {results['native_first_store_p50_overhead_us']:.0f} µs (the Wasm build's, (e) minus it: {results['first_store_p50_overhead_us']:.0f} µs). The native
  first POST with Redis used the store: {results['native_first_store_round_trips']:.3f} store calls waited for per request
  ({results['native_first_store_calls_total']:.3f} in all, {results['native_first_store_cluster_requests']:.3f} requests Envoy sent to the store cluster; the Wasm build:
  {results['first_request_store_round_trips']:.3f} / {results['first_request_store_calls_total']:.3f})
- `native_first_etcd_floor_ratio` = (r) / the etcd store floor (buffering + 2 etcd writes, the Wasm floor of
  `first_etcd_floor_ratio`) = **{r3('native_first_etcd_floor_ratio')}** (rounds: {sp('native_first_etcd_floor_ratio')}; by Envoy CPU per request
  {r3('native_first_etcd_floor_cpu_ratio')}; the Wasm build's, (i) / it: {r3('first_etcd_floor_ratio')}). 1-connection p50, (r) minus the etcd store floor:
  {results['native_first_etcd_p50_overhead_us']:.0f} µs (the Wasm build's, (i) minus it: {results['first_etcd_p50_overhead_us']:.0f} µs). The native first POST with
  etcd used the store: {results['native_first_etcd_round_trips']:.3f} store calls waited for per request ({results['native_first_etcd_calls_total']:.3f} in all,
  {results['native_first_etcd_cluster_requests']:.3f} requests Envoy sent to the store cluster; the Wasm build:
  {results['etcd_first_store_round_trips']:.3f} / {results['etcd_first_store_calls_total']:.3f}). `native_first_etcd_ratio` = (r) / (i), first POSTs with etcd =
  **{r3('native_first_etcd_ratio')}** (rounds: {sp('native_first_etcd_ratio')}; by Envoy CPU per request {r3('native_first_etcd_cpu_ratio')})
- `native_first_store_ratio` = (o) / (e), first POSTs with Redis = **{r3('native_first_store_ratio')}** (rounds: {sp('native_first_store_ratio')}; by
  Envoy CPU per request {r3('native_first_store_cpu_ratio')}); `native_first_local_ratio` = (m) / (d) = **{r3('native_first_local_ratio')}**
  (by CPU {r3('native_first_local_cpu_ratio')}); `native_replay_local_ratio` = (n) / (f) = **{r3('native_replay_local_ratio')}** (by CPU {r3('native_replay_local_cpu_ratio')})
- pass-through, the same unprotected GETs: `native_passthrough_ratio` = (p) / (c), the Wasm build = **{r3('native_passthrough_ratio')}**
  (rounds: {sp('native_passthrough_ratio')}; by CPU {r3('native_passthrough_cpu_ratio')}); (p) / (b), the empty Wasm filter = **{r3('native_passthrough_empty_ratio')}**
  (rounds: {sp('native_passthrough_empty_ratio')}); (p) / (a, GET), Envoy without any filter = **{r3('native_passthrough_nofilter_ratio')}**
  (rounds: {sp('native_passthrough_nofilter_ratio')}; by CPU {r3('native_passthrough_nofilter_cpu_ratio')}; the Wasm build's, (c) / (a, GET): {r3('wasm_passthrough_nofilter_ratio')}, by CPU
  {r3('wasm_passthrough_nofilter_cpu_ratio')})
- artefacts: the native library {results['native_so_bytes']} bytes, the Wasm module {results['wasm_bytes']} bytes

**What the engine itself costs in each host**: each build against the floor of its own host, the
same work done by the host with no engine. The Wasm host's floors are the Wasm floors above
(`src/bench_host/floor.rs`, run in the same V8 VM). The native host's buffering floor is (q),
Envoy's own buffer filter (C++, in Envoy's binary): it pauses at the request headers and forwards
once the whole body is in, and reads nothing of the response (the Wasm floor copies the body into
the VM and reads the response's headers and body too), so it is a lower floor than a native
module doing the Wasm floor's work would be; its pass-through floor is Envoy without any filter.
No native two-callout floor is built: the store rows compare both builds with the Wasm store
floors (Redis, etcd), which are the native build's bound only in being the work both must do.

| | Wasm host | native host |
|---|---|---|
| the host's buffering floor: req/s, Envoy CPU µs / request | (h) {rps('h_floor_buffering')}, {cpu('h_floor_buffering'):.0f} | (q) {rps('q_floor_native_buffer')}, {cpu('q_floor_native_buffer'):.0f} |
| first POST, local tier / that floor (throughput, rounds) | (d) **{r3('first_local_floor_ratio')}** ({sp('first_local_floor_ratio')}) | (m) **{r3('native_first_local_native_floor_ratio')}** ({sp('native_first_local_native_floor_ratio')}) |
| first POST, local tier / that floor, by Envoy CPU | {r3('first_local_floor_cpu_ratio')} | {r3('native_first_local_native_floor_cpu_ratio')} |
| the engine's Envoy CPU per first POST beyond that floor, µs | {cpu('d_first_local') - cpu('h_floor_buffering'):.0f} | {cpu('m_first_local_native') - cpu('q_floor_native_buffer'):.0f} |
| 1-connection p50 beyond that floor, µs | {results['first_local_p50_overhead_us']:.0f} | {results['native_first_local_native_floor_p50_overhead_us']:.0f} |
| the host's pass-through floor: req/s, CPU µs / request | (b, GET) {rps('b_empty_wasm_proxied')}, {cpu('b_empty_wasm_proxied'):.0f} | (a, GET) {rps('a_proxied_get')}, {cpu('a_proxied_get'):.0f} |
| unprotected GET / that floor (throughput, rounds) | (c) **{r3('passthrough_ratio')}** ({sp('passthrough_ratio')}) | (p) **{r3('native_passthrough_nofilter_ratio')}** ({sp('native_passthrough_nofilter_ratio')}) |
| the engine's Envoy CPU per GET beyond that floor, µs | {cpu('c_unprotected_get') - cpu('b_empty_wasm_proxied'):.0f} | {cpu('p_unprotected_get_native') - cpu('a_proxied_get'):.0f} |
| first POST, Redis / the store floor (the Wasm floor for both) | (e) **{r3('first_store_floor_ratio')}** ({sp('first_store_floor_ratio')}) | (o) **{r3('native_first_store_floor_ratio')}** ({sp('native_first_store_floor_ratio')}) |
| Envoy CPU per first POST with Redis beyond the store floor, µs | {cpu('e_first_store') - cpu('h_floor_store'):.0f} | {cpu('o_first_store_native') - cpu('h_floor_store'):.0f} |
| first POST, etcd / the etcd store floor (the Wasm floor for both) | (i) **{r3('first_etcd_floor_ratio')}** ({sp('first_etcd_floor_ratio')}) | (r) **{r3('native_first_etcd_floor_ratio')}** ({sp('native_first_etcd_floor_ratio')}) |
| Envoy CPU per first POST with etcd beyond the etcd store floor, µs | {cpu('i_first_etcd') - cpu('h_floor_store_etcd'):.0f} | {cpu('r_first_etcd_native') - cpu('h_floor_store_etcd'):.0f} |

The two hosts' buffering floors side by side, (q) / (h): {r3('native_buffer_floor_vs_wasm_buffering_ratio')} (rounds:
{sp('native_buffer_floor_vs_wasm_buffering_ratio')}): what the Wasm floor's work (the body copied into the VM, the response's
headers and body read) costs beyond Envoy's own buffering. A
negative CPU difference means the build spent less than the floor it is compared with (the Wasm
store floor does its work in a VM the native build does not enter).

{mem_text}
"""


def write_docs(results):
    os.makedirs(os.path.join(ROOT, "docs"), exist_ok=True)
    open(os.path.join(ROOT, "docs", "bench.svg"), "w").write(svg(results))
    S = results["scenarios"]
    rows = "\n".join(
        f"| {label} | {S[k]['rps']:.0f} ({S[k]['rps_min']:.0f}-{S[k]['rps_max']:.0f}) | {S[k]['p50_ms']:.3f} | {S[k]['p99_ms']:.3f} | "
        f"{(format(S[k]['envoy_cpu_us_per_request'], '.0f') if S[k].get('envoy_cpu_us_per_request') else '-')} | "
        f"{S[k].get('store_calls_waited_per_request', 0):.3f} | {S[k].get('store_calls_per_request', 0):.3f} |" for k, label in LABELS)
    m = S["memory"]
    mem_rows = "\n".join(f"| {p['keys_sent']} | {p['rss_bytes'] / 1048576:.1f} | {p['local_record_bytes'] / 1048576:.2f} | "
                          f"{p['local_index_bytes'] / 1048576:.2f} | {p['evictions']} |" for p in m["points"])
    hp = results["hot_path_ns"]
    steps = [k for k in hp.get("wasm32_v8", {}) if k != "error"] or [k for k in hp.get("native", {}) if k != "error"]
    hp_rows = "\n".join(f"| {k} | {hp.get('native', {}).get(k, float('nan')):.0f} | {hp.get('wasm32_v8', {}).get(k, float('nan')):.0f} |" for k in steps)
    if "skipped" in hp:
        hp_rows = f"| not measured in this run ({hp['skipped']}) | | |"
    cs = results["envoy_cpu_split"]
    if "skipped" in cs:
        cpu = f"Not measured in this run ({cs['skipped']}); the full `make bench` measures it with Linux perf."
    else:
        cpu = ("| scenario | kernel % | Envoy code % | Wasm code (V8 JIT) % | req/s under perf | Envoy CPU µs / request: kernel, Envoy code, Wasm code |\n|---|---|---|---|---|---|\n" + "\n".join(
            f"| {k} | {v['percent']['kernel']:.1f} | {v['percent']['envoy']:.1f} | {v['percent']['wasm_jit']:.1f} | {v['rps_under_perf']:.0f} | "
            + (f"{v['us_per_request']['kernel']:.0f}, {v['us_per_request']['envoy']:.0f}, {v['us_per_request']['wasm_jit']:.0f} |" if "us_per_request" in v else "- |")
            for k, v in cs.items())
            + "\n\nThe buffering and store floors beside idemgate's first request show where its cost lies: the"
            " Wasm code's own share, and Envoy's code doing the work of the host calls (shared data, header"
            " maps, properties), which the counted host calls above explain.")
    growth = m["rss_growth_after_cap_filled_bytes"] / 1048576
    last_keys = m["points"][-1]["keys_sent"]
    yes = lambda ok: "reached" if ok else "**not reached**"
    targets = "\n".join([
        f"- `passthrough_ratio` >= 0.97 (issue 27): {results['passthrough_ratio']:.3f}, {yes(results['passthrough_ratio'] >= 0.97)} "
        f"(single rounds vary {results['passthrough_ratio_spread']['min']:.3f}-{results['passthrough_ratio_spread']['max']:.3f} on this shared VM; "
        f"by Envoy CPU per request {results['passthrough_cpu_ratio']:.3f}"
        + ("" if "skipped" in cs else f"; perf puts idemgate's own Wasm code on an unprotected GET at "
           f"{cs['c_unprotected_get']['percent']['wasm_jit']:.1f} % of Envoy's CPU against "
           f"{cs['b_empty_wasm_proxied']['percent']['wasm_jit']:.1f} % for the empty filter") + ")",
        f"- first request: exactly 1 store round trip waited for: {results['first_request_store_round_trips']:.3f}, "
        f"{yes(abs(results['first_request_store_round_trips'] - 1) < 0.02)} (the completion write after the response is the second call, "
        "off the critical path; it cannot be avoided: the record must reach the store)",
        f"- local replay: 0 round trips: {results['replay_local_store_round_trips']:.3f}, {yes(results['replay_local_store_round_trips'] == 0)}",
        f"- `replay_local_ratio` >= 0.9: {results['replay_local_ratio']:.3f}, {yes(results['replay_local_ratio'] >= 0.9)}",
        f"- memory flat at the cap: Envoy's resident set grew {growth:.1f} MiB from the cap first filled to {last_keys} keys, "
        f"{yes(growth < 5)}",
        f"- not a target, explained: `protected_first_ratio` {results['protected_first_ratio']:.3f} is bound by the store "
        "(webdis with one thread in front of Redis, one Lua script per first request); with the local tier only "
        f"it is {results['protected_first_local_ratio']:.3f}, where the Wasm side (four SHA-256 derivations, three bucket "
        "encodes and decodes, the host calls that copy headers and body) is the cost: see the profile below",
    ])
    st = results["settings"]
    busy = " (a quick run on a shared machine: not judged here; a full quiet `make bench` decides)" if st["quick"] else ""
    targets += "\n" + "\n".join([
        f"- `first_local_floor_ratio` >= 0.85 (issue 27): {results['first_local_floor_ratio']:.3f}, {yes(results['first_local_floor_ratio'] >= 0.85)}{busy} "
        f"(by Envoy CPU per request {results['first_local_floor_cpu_ratio']:.3f}). What bounds it, measured: the buffering "
        f"floor plus only the local tier's 5 shared-data calls (the look at headers, the claim's CAS at the body's end, the body key, the completion's read and CAS: "
        f"\"Host calls per request\") runs at {results['shared_floor_vs_buffering_ratio']:.3f} of the buffering floor "
        f"(by CPU {results['shared_floor_vs_buffering_cpu_ratio']:.3f}); idemgate's first request is "
        f"{results['first_local_shared_floor_ratio']:.3f} of that floor (by CPU {results['first_local_shared_floor_cpu_ratio']:.3f}), "
        "the rest being its own work (hashing, fingerprinting, bucket encoding, the other host calls)",
        f"- `first_store_floor_ratio` >= 0.8 (issue 27): {results['first_store_floor_ratio']:.3f}, {yes(results['first_store_floor_ratio'] >= 0.8)}{busy} "
        f"(by Envoy CPU per request {results['first_store_floor_cpu_ratio']:.3f}). What bounds it, measured (\"The store path, "
        f"explained\"): a first request with the store does the local tier's work too, so the bound above applies to it; beyond "
        f"that, per request, Envoy spends {S['e_first_store'].get('envoy_cpu_us_per_request', 0) - S['h_floor_store'].get('envoy_cpu_us_per_request', 0):.0f} µs "
        f"more than the store floor and Redis runs two Lua scripts ({S['e_first_store'].get('redis_cpu_us_per_request', 0):.0f} µs of "
        f"Redis CPU against {S['h_floor_store'].get('redis_cpu_us_per_request', 0):.0f} for the floor's two `GET`s), on the same two cores",
        f"- `first_local_p50_overhead_us` <= 30: {results['first_local_p50_overhead_us']:.0f} µs, {yes(results['first_local_p50_overhead_us'] <= 30)}{busy}",
        f"- `host_calls_first_local` <= 14 (issue 27): {results['host_calls_first_local']:.1f}, {yes(results['host_calls_first_local'] <= 14)} (counted, "
        "the same on any machine; what bounds it: see \"Host calls per request\")",
        f"- shared-data calls per first local request <= 5 (issue 27): {shared_first_local(results):.1f}, {yes(shared_first_local(results) <= 5)} "
        "(counted: the look at headers, the claim's CAS on it at the body's end, the completion's read, body and CAS: "
        "\"Host calls per request\" and docs/local-tier.md)",
        f"- etcd first request >= 0.8 of the etcd floor (issue 27): {results['first_etcd_floor_ratio']:.3f}, {yes(results['first_etcd_floor_ratio'] >= 0.8)}{busy}; "
        f">= 0.4 of Redis's: {results['etcd_first_vs_redis_ratio']:.3f}, {yes(results['etcd_first_vs_redis_ratio'] >= 0.4)}{busy} "
        "(what stops both is etcd's own CPU per commit: \"etcd beside Redis\")",
        f"- VM allocations per etcd first request <= 250 (issue 27): {results['vm_allocations_first_etcd']:.1f}, {yes(results['vm_allocations_first_etcd'] <= 250)}",
        f"- module growth <= 10 % (issue 27, against {ISSUE_27_MODULE_BYTES} bytes, the last run before it): {results['wasm_bytes']} bytes, "
        f"{100 * (results['wasm_bytes'] / ISSUE_27_MODULE_BYTES - 1):+.1f} %, {yes(results['wasm_bytes'] <= 1.1 * ISSUE_27_MODULE_BYTES)}",
        f"- `store_bytes_first_request` reported: {results['store_bytes_first_request']:.0f} bytes",
        f"- native first request >= 0.95 of the buffering floor (issue 45): {results['native_first_local_floor_ratio']:.3f}, "
        f"{yes(results['native_first_local_floor_ratio'] >= 0.95)}{busy}; native first request with Redis >= 0.9 of the store floor (issue 45): "
        f"{results['native_first_store_floor_ratio']:.3f}, {yes(results['native_first_store_floor_ratio'] >= 0.9)}{busy} (\"Native beside Wasm\")",
    ])
    C = results["counted_per_request"]
    count_rows = "\n".join(
        f"| {label} | {C[k]['host_calls']:.1f} | {C[k]['vm_allocations']:.1f} | {C[k]['host_buffers']:.1f} | {C[k]['store_bytes']:.0f} |"
        for k, label in [("unprotected_get", "(c) unprotected GET"), ("first_local", "(d) first POST, local tier"),
                         ("first_store", "(e) first POST, Redis store"), ("replay_local", "(f) replay from memory"),
                         ("replay_after_local_miss", "(g) replay after a local miss"),
                         ("first_etcd", "(i) first POST, etcd store"),
                         ("replay_after_local_miss_etcd", "(j) replay after a local miss, etcd")] if k in C)
    phases = ["request_headers", "request_body", "call_answer", "response_headers", "response_body", "log", "root"]
    phase_rows = "\n".join(
        f"| {label} | " + " | ".join(f"{C[k].get('calls.' + p, 0):.1f}" for p in phases) + f" | {C[k]['host_calls']:.1f} |"
        for k, label in [("first_local", "(d) first POST, local tier"), ("first_store", "(e) first POST, Redis store"),
                         ("replay_local", "(f) replay from memory"), ("replay_after_local_miss", "(g) replay after a local miss"),
                         ("first_etcd", "(i) first POST, etcd store"), ("replay_after_local_miss_etcd", "(j) replay after a local miss, etcd")] if k in C)
    # Every host call of a first request in the local tier, by callback and kind (the counting
    # build's `idemgate.count.kind.<callback>.<kind>`), with what each is for.
    kinds = ["get_header", "get_header_map", "set_header", "add_header", "get_buffer", "get_property",
             "set_property", "bucket_get", "bucket_set", "slot_get", "slot_set", "counter_get", "counter_set",
             "shared_get", "shared_set", "clock", "metric", "define_metric", "send_response", "resume", "dispatch",
             "queue", "other", "log"]
    fl = C.get("first_local", {})
    kind_rows = "\n".join(
        f"| {p.replace('_', ' ')} | `{k}` | {fl['kind.' + p + '.' + k]:.1f} | {FIRST_LOCAL_CALLS.get((p, k), '')} |"
        for p in phases for k in kinds if fl.get(f"kind.{p}.{k}", 0) > 0)
    one = lambda k: S[k].get("one_connection", {})
    floor_rows = "\n".join(
        f"| {label} | {S[k]['rps']:.0f} ({S[k]['rps_min']:.0f}-{S[k]['rps_max']:.0f}) | {S[k]['envoy_cpu_us_per_request']:.0f} | "
        f"{one(k).get('p50_ms', float('nan')) * 1000:.0f} | {one(k).get('p99_ms', float('nan')) * 1000:.0f} |"
        for k, label in [("h_floor_empty_post", "(h) empty filter, same POSTs"), ("h_floor_buffering", "(h) buffering floor"),
                         ("h_floor_shared", "(h) buffering + the local tier's shared data"),
                         ("d_first_local", "(d) idemgate, first POST, local tier"), ("h_floor_store", "(h) store floor"),
                         ("e_first_store", "(e) idemgate, first POST, Redis store"), ("h_floor_store_etcd", "(h) store floor, etcd"),
                         ("i_first_etcd", "(i) idemgate, first POST, etcd store")])
    E, HS, D, HB = S["e_first_store"], S["h_floor_store"], S["d_first_local"], S["h_floor_buffering"]
    I, HE = S["i_first_etcd"], S["h_floor_store_etcd"]
    cpu_of = lambda x, k: x.get(k, 0)
    local_extra = cpu_of(D, "envoy_cpu_us_per_request") - cpu_of(HB, "envoy_cpu_us_per_request")
    store_extra = cpu_of(E, "envoy_cpu_us_per_request") - cpu_of(HS, "envoy_cpu_us_per_request")
    busy = lambda x: cpu_of(x, "webdis_cpu_us_per_request") * x["rps"] / 1e6
    store_path = f"""## The store path, explained

A first request with Redis beside the store floor, from what can be counted (the counting build,
Envoy's count of requests to the store cluster) and from the runs above (CPU time per request of
Envoy, webdis and Redis, read from /proc around each run, median of the rounds):

- **Callouts**: idemgate makes {results['first_request_store_calls_total']:.2f} store calls per first request: the claim-or-read
  the client waits for ({results['first_request_store_round_trips']:.2f}) and the completion write the root makes after the
  response. The store floor makes {cpu_of(HS, 'store_cluster_requests_per_request'):.2f}, one waited for and one after the response, to the
  same webdis (one thread) in front of the same Redis.
- **Bytes sent to the store**: {results['store_bytes_first_request']:.0f} per first request (webdis paths and bodies): each call is
  an `EVALSHA` naming its Lua script by its 40-hex digest, percent-encoded, with the sealed record
  (a Redis without the script answers NOSCRIPT once and gets it whole: "Store bytes per first
  request"); the floor's two `GET`s carry {2 * len('/GET/' + FLOOR_STORE_KEY)}.
- **Host calls**: {C['first_store']['host_calls']:.0f} against {C['first_local']['host_calls']:.0f} in the local tier (see "By callback"): the callout, its
  answer's status and body, resuming the request, waking the root and its queue, the root's
  callout and its answer.
- **CPU per request** in this run, µs:

| | Envoy | webdis | Redis | webdis busy (share of one core) | etcd (3 members) |
|---|---|---|---|---|---|
| buffering floor | {cpu_of(HB, 'envoy_cpu_us_per_request'):.0f} | - | - | - | - |
| (d) idemgate, local tier | {cpu_of(D, 'envoy_cpu_us_per_request'):.0f} | - | - | - | - |
| store floor | {cpu_of(HS, 'envoy_cpu_us_per_request'):.0f} | {cpu_of(HS, 'webdis_cpu_us_per_request'):.0f} | {cpu_of(HS, 'redis_cpu_us_per_request'):.0f} | {busy(HS):.2f} | - |
| (e) idemgate, Redis | {cpu_of(E, 'envoy_cpu_us_per_request'):.0f} | {cpu_of(E, 'webdis_cpu_us_per_request'):.0f} | {cpu_of(E, 'redis_cpu_us_per_request'):.0f} | {busy(E):.2f} | - |
| store floor, etcd | {cpu_of(HE, 'envoy_cpu_us_per_request'):.0f} | - | - | - | {cpu_of(HE, 'etcd_cpu_us_per_request'):.0f} |
| (i) idemgate, etcd | {cpu_of(I, 'envoy_cpu_us_per_request'):.0f} | - | - | - | {cpu_of(I, 'etcd_cpu_us_per_request'):.0f} |

  Of the {store_extra:.0f} µs of Envoy CPU (e) spends beyond the store floor, {local_extra:.0f} µs is what the local
  tier already costs beyond the buffering floor ((d) minus it: hashing, the local table's shared
  data, the header maps); the remaining {store_extra - local_extra:.0f} µs is the store path's own: building, sealing and
  percent-encoding those bytes, parsing the answers, and the host calls above. On this 2-core
  machine Envoy, wrk, webdis and Redis share the cores (with whatever else runs), so CPU figures
  move from run to run: compare rows of one run, not runs.
"""
    sp = lambda k: f"{results[k + '_spread']['min']:.3f}-{results[k + '_spread']['max']:.3f}"
    r3 = lambda k: f"{results[k]:.3f}"
    native_section = native_beside_wasm(results, sp, r3)
    etcd_section = f"""## etcd beside Redis

`store.kind: "etcd"` in the same interleaved rounds as the Redis scenarios, on the same POSTs with
the same load generator: three etcd 3.4 members (Debian `etcd-server`) on 127.0.0.1, started by
`scripts/bench.py` with ports picked at run time and data in a scratch folder under `target/bench`
(so every commit is fsynced to that disk), stopped at the end; Envoy's `idemgate_store` cluster
lists the three members as `envoy/etcd/envoy.yaml` does. etcd's authentication is off here (the
demo runs with it on: a token adds one header to each call, and the root authenticates again every
`store.token_refresh_seconds`, 60 by default).

| | Redis (webdis) | etcd (3 members) | etcd / Redis |
|---|---|---|---|
| first POST, req/s at {st['connections']} connections | {results['redis_first_rps']:.0f} | {results['etcd_first_rps']:.0f} | **{r3('etcd_first_vs_redis_ratio')}** (rounds: {sp('etcd_first_vs_redis_ratio')}) |
| first POST, p50 / p99 ms at 1 connection | {results['redis_first_p50_ms_1conn']:.3f} / {results['redis_first_p99_ms_1conn']:.3f} | {results['etcd_first_p50_ms_1conn']:.3f} / {results['etcd_first_p99_ms_1conn']:.3f} | |
| first POST, store calls waited for / in all | {results['first_request_store_round_trips']:.3f} / {results['first_request_store_calls_total']:.3f} | {results['etcd_first_store_round_trips']:.3f} / {results['etcd_first_store_calls_total']:.3f} | |
| replay after a local miss (every request), req/s at {st['connections']} connections | {results['redis_replay_after_local_miss_rps']:.0f} | {results['etcd_replay_after_local_miss_rps']:.0f} | **{r3('etcd_replay_after_local_miss_vs_redis_ratio')}** (rounds: {sp('etcd_replay_after_local_miss_vs_redis_ratio')}) |
| replay after a local miss, p50 / p99 ms at 1 connection | {results['redis_replay_after_local_miss_p50_ms_1conn']:.3f} / {results['redis_replay_after_local_miss_p99_ms_1conn']:.3f} | {results['etcd_replay_after_local_miss_p50_ms_1conn']:.3f} / {results['etcd_replay_after_local_miss_p99_ms_1conn']:.3f} | |
| replay after a local miss, store calls / request | {results['redis_replay_after_local_miss_store_calls_per_request']:.3f} | {results['etcd_replay_after_local_miss_store_calls_per_request']:.3f} | |
| bytes sent to the store: first POST / replay after a miss (counted) | {results['store_bytes_first_request']:.0f} / {results['store_bytes_replay_after_local_miss']:.0f} | {results['store_bytes_first_request_etcd']:.0f} / {results['store_bytes_replay_after_local_miss_etcd']:.0f} | |

**Redis HA beside them** (k): the same first POSTs through the Redis HA store as shipped
(`scripts/store_ha.py`, `envoy/redis-ha/`: three Redis nodes on this one disk with
`appendfsync always` and `min-replicas-to-write 1`, three Sentinels, Envoy's health-checked
cluster over two legs of webdis and HAProxy), in the same rounds. The single Redis of (e) runs
with `--appendonly no`, so the difference includes three nodes' fsyncs, not only the HAProxy hop.

| | Redis (webdis) | Redis HA | etcd (3 members) | HA / Redis |
|---|---|---|---|---|
| first POST, req/s at {st['connections']} connections | {results['redis_first_rps']:.0f} | {results['redis_ha_first_rps']:.0f} | {results['etcd_first_rps']:.0f} | **{r3('redis_ha_first_vs_redis_ratio')}** (rounds: {sp('redis_ha_first_vs_redis_ratio')}) |
| first POST, p50 / p99 ms at 1 connection | {results['redis_first_p50_ms_1conn']:.3f} / {results['redis_first_p99_ms_1conn']:.3f} | {results['redis_ha_first_p50_ms_1conn']:.3f} / {results['redis_ha_first_p99_ms_1conn']:.3f} | {results['etcd_first_p50_ms_1conn']:.3f} / {results['etcd_first_p99_ms_1conn']:.3f} | |
| first POST, store calls waited for | {results['first_request_store_round_trips']:.3f} | {results['redis_ha_first_store_round_trips']:.3f} | {results['etcd_first_store_round_trips']:.3f} | |

- `etcd_first_vs_redis_ratio` = (i) / (e), throughput of the first POST, median of the per-round
  ratios; by Envoy CPU per request (e) / (i): {r3('etcd_first_vs_redis_cpu_ratio')}.
- Replay after a local miss ((g) and (j)): {results['replay_after_local_miss_every_request_note']}.
  Store calls per request sit slightly above 1 (and a first request's above 1 and 2) because a
  request still in flight when wrk stops is not in the count of requests but its store call is.
- **The floor for etcd** (`first_etcd_floor_ratio` = (i) / the etcd store floor =
  **{r3('first_etcd_floor_ratio')}**, rounds: {sp('first_etcd_floor_ratio')}; by Envoy CPU per request
  {r3('first_etcd_floor_cpu_ratio')}; 1-connection p50, (i) minus the floor: {results['first_etcd_p50_overhead_us']:.0f} µs): the
  buffering floor plus two etcd writes (`POST /v3/kv/put` of one small key), one waited for and
  one made by the root after the response. A claim and a completion are writes in etcd, each a
  Raft commit that a majority fsyncs before etcd answers, so no etcd-backed filter can do with
  less; idemgate's claim is one transaction (compare, two puts, one range) and its completion
  another, one commit each. The Redis store floor makes two webdis `GET`s instead: the bench's
  Redis keeps no append-only file, so a write costs it no disk work either and a round trip is
  the floor there.
- What the etcd path costs inside Envoy beyond its floor, counted (see "Host calls per request"):
  a first request makes {C['first_etcd']['host_calls']:.0f} host calls (Redis: {C['first_store']['host_calls']:.0f}),
  {C['first_etcd']['vm_allocations']:.0f} VM allocations (Redis: {C['first_store']['vm_allocations']:.0f}; each transaction is written into one
  buffer sized before it is written, and answers are parsed into strings borrowed from them: 518
  here before issue 27) and sends etcd {results['store_bytes_first_request_etcd']:.0f} bytes (Redis: {results['store_bytes_first_request']:.0f}): JSON
  transactions with every key and value in base64. About half of those bytes are etcd keys: every
  operation names its key, and a claim names six (the value's key three times, its owner mark's
  twice, the owner's release tombstone once; 76 to 111 bytes each before base64), a completion
  five; the rest is the sealed value in base64 and the JSON around it. Shorter keys would move
  the records: proxies of two versions side by side during an upgrade would not see each other's
  claims, so the keys stay.
- What stops (i) short of its floor is etcd's own work, not Envoy's: the three members spend
  {cpu_of(I, 'etcd_cpu_us_per_request'):.0f} µs of CPU per first request against {cpu_of(HE, 'etcd_cpu_us_per_request'):.0f} µs for the floor's two puts (a claim
  and a completion each compare one or two keys, put two (the value and its owner mark) and read
  the mark back, through etcd's JSON gateway), and Envoy {cpu_of(I, 'envoy_cpu_us_per_request'):.0f} µs against {cpu_of(HE, 'envoy_cpu_us_per_request'):.0f}; on this 2-core
  machine etcd's share is most of a request's cost. The etcd column of "The store path, explained"
  is the CPU of the three members together.
"""
    if st["quick"]:
        etcd_section += """
These figures come from a **quick run (`BENCH_QUICK=1 make bench`) on a shared 2-core machine**
while other engineers compiled and ran tests on it: short runs, few rounds, and a disk whose fsync
time depends on what else writes to it. Read the ratios (each round pairs scenarios measured
moments apart), not the absolute figures; a full quiet `make bench` replaces them.
"""
    loads = results["machine"].get("round_loads") or []
    loads_note = (f" Load average (1 min) at each round's end: {', '.join(str(x) for x in loads)}"
                  f" ({results['machine']['cpus']} cores: above that, other work shared the CPU).") if loads else ""
    run_note = f"\n\n**About this run:** {results['note']}" if results.get("note") else ""
    quick_note = ("\n\n**Every figure on this page measured by `make bench` comes from a quick run (`BENCH_QUICK=1`) on a shared"
                  " 2-core machine** (other engineers compiling and testing at the same time): compare rows of this run, not"
                  " runs; a full `make bench` on a quiet machine replaces them. The sections kept from tests say so.") if st["quick"] else ""
    doc = f"""# Benchmarks

Generated by `make bench` (`scripts/bench.py`); do not edit by hand. Machine: {results['machine']['cpus']} cores,
{results['machine']['platform']}, {results['machine']['envoy']}.{loads_note}{run_note}

Settings: Envoy with {st['envoy_workers']} worker, log level {st['log_level']}; wrk with {st['wrk_threads']} thread and
{st['connections']} connections for {st['duration_s']} s, {st['runs']} rounds (median, and min-max of
throughput); POST bodies of {st['body_bytes']} bytes with the same headers in every scenario; the upstream is the demo
API's stateless `/bench` route on 127.0.0.1. Scenarios (a)-(r) run interleaved: all their Envoys are up
at once and each round runs every scenario in turn, so a ratio compares runs made under the same
conditions (its figure is the median of the per-round ratios, with their min-max). Quick run: {st['quick']}.{quick_note}

| scenario | req/s median (min-max) | p50 ms | p99 ms | Envoy CPU µs / request | store calls waited for / request | store calls in all / request |
|---|---|---|---|---|---|---|
{rows}

Ratios (each names its baseline):

- `passthrough_ratio` = (c) / (b proxied, same GETs) = **{results['passthrough_ratio']:.3f}** (rounds: {sp('passthrough_ratio')});
  by Envoy CPU per request instead of throughput (b) / (c): {results['passthrough_cpu_ratio']:.3f}
- `protected_first_ratio` = (e) / (a proxied) = **{results['protected_first_ratio']:.3f}** (rounds: {sp('protected_first_ratio')};
  local tier only, (d) / (a proxied): {results['protected_first_local_ratio']:.3f})
- `replay_local_ratio` = (f) / (b, empty Wasm in front of `direct_response`) = **{results['replay_local_ratio']:.3f}** (rounds: {sp('replay_local_ratio')});
  by Envoy CPU per request: {results['replay_local_cpu_ratio']:.3f}
- the empty Wasm filter itself, (b) / (a) with `direct_response`: {results['empty_wasm_ratio_direct']:.3f}
- store round trips: a first request waits for {results['first_request_store_round_trips']:.3f} (the claim-or-read); the
  completion write follows the response ({results['first_request_store_calls_total']:.3f} calls in all per first request);
  replay from memory {results['replay_local_store_round_trips']:.3f}; replay after a local miss
  {results['replay_after_local_miss_store_round_trips']:.3f} ({results['replay_after_local_miss_every_request_note']})
- module: {results['wasm_bytes']} bytes (the empty filter: {results['empty_wasm_bytes']} bytes)

![throughput and p99 by scenario](bench.svg)

## Floors

What no fingerprinting, storing filter can avoid, measured in the same interleaved rounds on the
same POSTs (`src/bench_host/floor.rs`, built as `dist/idemgate-floor.wasm` by `scripts/build-wasm.sh
--floor`, never shipped): the **empty filter** reads one header and continues; the **buffering
floor** pauses at the request headers, takes the whole body, continues, and reads the response
headers and body; the **shared-data floor** adds to it the local tier's 5 shared-data calls of a
first request, call for call (the bucket read at headers and its CAS write at the body's end, the
body key's write, the bucket's read and CAS write at completion, values of the sizes idemgate's
have here; docs/local-tier.md has why 5 is its bound): the part of the local tier's design no
implementation of it can skip; the **store floor** adds one callout per request to the same webdis (a `GET` of
one key) waited for before continuing, and a second one made by the root context after the
response, as idemgate's completion write is. The 1-connection columns come from a pass of
{ONE_CONNECTION_DURATION} s per scenario in each round (latency without queueing).

| scenario | req/s, {st['connections']} connections | Envoy CPU µs / request | p50 µs, 1 connection | p99 µs, 1 connection |
|---|---|---|---|---|
{floor_rows}

- `first_local_floor_ratio` = (d) / buffering floor = **{results['first_local_floor_ratio']:.3f}** (rounds: {sp('first_local_floor_ratio')})
- `first_store_floor_ratio` = (e) / store floor = **{results['first_store_floor_ratio']:.3f}** (rounds: {sp('first_store_floor_ratio')})
- `first_local_p50_overhead_us` = (d) minus the buffering floor, 1-connection p50 = **{results['first_local_p50_overhead_us']:.0f} µs**
  (rounds: {results['first_local_p50_overhead_us_spread']['min']:.0f} to {results['first_local_p50_overhead_us_spread']['max']:.0f});
  with the store, (e) minus the store floor: {results['first_store_p50_overhead_us']:.0f} µs
- pausing for the body, buffering floor / empty filter on the same POSTs: {results['pause_cost_ratio']:.3f}

## Host calls per request

Counted, not timed, so the same on a busy machine as on a quiet one: `dist/idemgate-count.wasm`
(`scripts/build-wasm.sh --count-host-calls`, never shipped) is idemgate with every host call
counted where `src/filter/host.rs` makes it and a counting allocator; the figures are per request
over {COUNT_REQUESTS} requests after {COUNT_WARM} uncounted ones, Envoy logging errors only (as in the runs
above). Host calls include the root's store write and its answer; the tick's sweeps and gauges are
not requests' work and are left out. VM allocations include those the host asks the VM for to hand
it a value (one per buffer handed over). Store bytes are the webdis requests' paths and bodies.

| scenario | host calls | VM allocations | buffers handed to the VM | bytes sent to the store |
|---|---|---|---|---|
{count_rows}

By callback (the store's answer to the claim comes to the request's own context; the root makes
the completion write and reads its answer):

| scenario | request headers | request body | store answer | response headers | response body | log | root | in all |
|---|---|---|---|---|---|---|---|---|
{phase_rows}

Every call of a first request in the local tier, by callback and kind (`idemgate.count.kind.*`
of the counting build; shared-data calls named by the key they touch):

| callback | kind | calls | what for |
|---|---|---|---|
{kind_rows}

{still_pays_for(C.get('first_local', {}))}

Cut by the claim at the body's end (issue 27; 20 to 18, counted by `tests/it/bench_builds.rs`): the
claim's read at the end of the body (its CAS uses the headers' read) and the CAS that marked a
headers-time claim forwarded. Cut by layout v4 (issue 27; 26 to 20): the table-wide
record count reserved before each claim and the table-wide byte usage (4 calls: each bucket now
keeps its own, and the gauges are sums made by the background sweep), and the claim's slot
written at headers (2 calls: the creator a 409 names is kept in the bucket's entry until the
completion). Cut before (issue 17 item 4, 30 to 26): the `:method` read alone, and the counters
`protected`, `claimed` and `stored` (counted in the VM, handed to Envoy on the root's tick).

Considered and not made, each because it changes what idemgate promises or shows: one CAS on an
absent version for the claim (not atomic in Envoy, above); the clock of an earlier callback, or a
VM-wide cached one (1 or 2 calls: a lock started before the request's end, or a record's expiry
from before its completion); one filter-state value for both (1 call: access logs print
`wasm.idemgate_outcome` and `wasm.idemgate_key` by name); the attempt count only when the
classification needs it (1 call: a re-send behind idemgate's back would go unseen).

{native_section}
{store_path}
{etcd_section}
## Targets

{targets}

## Memory under a flood of unique keys

`local.max_entries` {m['cap_max_entries']}, `when_full: evict_oldest`; Envoy's resident set and the local tier's
shared data (gauges `idemgate.local_record_bytes`, `idemgate.local_index_bytes`). Growth of the
resident set from the cap first filled to the last point: {m['rss_growth_after_cap_filled_bytes'] / 1048576:.1f} MiB.

| unique keys sent | Envoy RSS MiB | records in shared data MiB | index (fixed) MiB | evictions |
|---|---|---|---|---|
{mem_rows}

## Where the time goes

The core's per-request steps (`benches/hot_path.rs`), natively and compiled to wasm32 and run by
V8 under Node.js (the engine Envoy runs the filter in); host calls excluded, shared data an
in-memory map. ns per call:

| step | native | wasm32 (V8) |
|---|---|---|
{hp_rows}

Envoy's CPU by code region (Linux perf on the Envoy process during a run; Envoy's binary is
stripped, so its own code is one region):

{cpu}

Rerun: `make bench` (about {'3' if st['quick'] else '27'} minutes here on a quiet machine; `BENCH_QUICK=1 make bench` for the short version).
Raw figures: `target/bench/results.json`.
"""
    path = os.path.join(ROOT, "docs", "BENCHMARKS.md")
    # Sections measured by tests or once by hand, not here (memory at the default capacity:
    # tests/it/faults/capacity.rs; store bytes per first request: tests/it/store_scripts.rs; etcd
    # over gRPC: a measurement outside make bench): keep them.
    if os.path.exists(path):
        old = open(path).read()
        for section in (
            "## Memory at the default capacity",
            "## Store bytes per first request",
            "## etcd over its native gRPC API (measured, not built)",
        ):
            at = old.find(section)
            if at >= 0:
                end = old.find("\n## ", at + 1)
                # One blank line after it, however many the page had (they grew by one a run).
                kept = (old[at:] if end < 0 else old[at:end]).rstrip("\n") + "\n\n"
                doc = doc.replace("## Where the time goes", kept + "## Where the time goes", 1)
    open(path, "w").write(doc)

if __name__ == "__main__":
    import signal
    # Stopped from outside (Ctrl-C, kill): still stop every process it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if sys.argv[1:] == ["--render"]:
        # The docs again from the last run's figures (target/bench/results.json), after a change to
        # their text: no new measurement.
        # BENCH_NOTE, when set, replaces the run's note (what the machine was doing meanwhile).
        results = json.load(open(os.path.join(OUT, "results.json")))
        if "BENCH_NOTE" in os.environ:
            results["note"] = os.environ["BENCH_NOTE"]
            json.dump(results, open(os.path.join(OUT, "results.json"), "w"), indent=2)
        write_docs(results)
        sys.exit(0)
    try:
        main()
    finally:
        for p in list(PROCS):
            stop(p)
