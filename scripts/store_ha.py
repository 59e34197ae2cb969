#!/usr/bin/env python3
"""Redis HA for idemgate on 127.0.0.1, from the shipped configurations (envoy/redis-ha/):

    3 Redis nodes (envoy/redis.conf + envoy/redis-ha.conf; redis-0 the first primary)
    3 Sentinels (envoy/redis-ha/sentinel.conf; quorum 2)
    2 legs, each HAProxy (envoy/redis-ha/haproxy.cfg: routes to the node saying role:master)
      with a webdis in front of it (envoy/redis-ha/webdis.json)

Envoy's `idemgate_store` cluster lists both webdis and health-checks them
(envoy/redis-ha/idemgate-store-cluster.yaml); no part is single and nothing needs an operator
after a failover. Ports are chosen at run time; every process is checked to own its listener.

    scripts/store_ha.py up DIR [--tls] [--acl [--operator]]   start everything; DIR/stack.json says ports and pids
    scripts/store_ha.py down DIR         SIGKILL everything DIR/stack.json lists
    scripts/store_ha.py kill DIR NAME    SIGKILL one part (redis-0, sentinel-1, haproxy-0, webdis-1, ...)
    scripts/store_ha.py start DIR NAME   start a part again on its ports (a Redis node as a replica
                                         of the primary the Sentinels name, never alone; while a
                                         failover is promoting a node, as that node's replica)
    scripts/store_ha.py primary DIR      the node the Sentinels name primary (redis-N), or "none"
    scripts/store_ha.py cluster DIR      the idemgate_store cluster (YAML) for this stack
    scripts/store_ha.py judged DIR       waits until a Sentinel judged the primary down (o_down), then
                                         until none has a failover under way (30 s at most each)

--tls: Redis listens with TLS only (tls-port, port 0) with a certificate made here (openssl); the
Sentinels, the replicas and HAProxy's connections and checks use TLS (HAProxy verifies Redis's
certificate), webdis still speaks plain RESP to its HAProxy on loopback.

--acl: idemgate reaches Redis as the named ACL user `idemgate` of envoy/redis-acl/redis-acl.conf
(the `default` user off): each leg gets an Envoy redis_proxy (envoy/redis-acl/redis-proxy.yaml,
part hop-N) between its webdis and its HAProxy, taking webdis's AUTH <password> and sending
AUTH idemgate <password>; with --tls, HAProxy originates the TLS to Redis as above, so the hop's
own TLS block is left out for its own leg's HAProxy (the hop and HAProxy are on one host,
loopback). Each hop lists every HAProxy, its own leg's at priority 0 and the others at priority
1, health-checked (the hop's cluster in redis-proxy.yaml), so a dead HAProxy loses no leg. With
--tls --acl the other legs' HAProxies are reached on a second, TLS frontend of theirs (mutual:
HAProxy requires the hop's client certificate; stack.json's haproxies[N].peer_port), as they
would be on another host: that link carries the user's AUTH and every record.

--operator (with --acl): the operator CLI's own path on each leg, beside the proxies': a webdis
(part opswebdis-N, HTTP user operator, never in the idemgate_store cluster) and a hop (part
opshop-N, the same redis-proxy.yaml with its own downstream password) logging in to Redis as the
ACL user `idemgate-operator` (redis-acl.conf: idemgate's grant plus SCAN and GETRANGE, which the
user idemgate lacks on purpose): `idemgate --webdis http://<opswebdis-N>` lists, inspects and
forgets (docs/operating.md, "The CLI through the named-user hop").
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HA = os.path.join(ROOT, "envoy", "redis-ha")
ACL_CONF = os.path.join(ROOT, "envoy", "redis-acl", "redis-acl.conf")
HOP_YAML = os.path.join(ROOT, "envoy", "redis-acl", "redis-proxy.yaml")
NODES, SENTINELS, LEGS = 3, 3, 2
ADMIN = ("admin", "idemgate-demo-admin-password")
SENTINEL_USER = ("sentinel", "idemgate-demo-sentinel-password")
# --operator: the operator webdis's HTTP user, its Redis password (the operator hop's downstream
# password) and the Redis user the operator hop logs in as (envoy/redis-acl/redis-acl.conf).
OPERATOR_WEBDIS_AUTH = "operator:idemgate-demo-operator-webdis-password"
OPERATOR_HOP_PASSWORD = "idemgate-demo-operator-redis-password"
OPERATOR_USER = ("idemgate-operator", "idemgate-demo-operator-redis-user-password")
READY_SECONDS = 30


LOG_DIR = None


def log(msg):
    print(f"store_ha: {msg}", file=sys.stderr)
    if LOG_DIR:  # also DIR/store_ha.log, so what a start decided outlives a caller that drops stderr
        with open(os.path.join(LOG_DIR, "store_ha.log"), "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d} {msg}\n")


def free_port(taken):
    """A port free a moment ago, in 20000-32767 (below Linux's ephemeral range), not in `taken`."""
    import random
    for _ in range(1000):
        p = random.randint(20000, 32767)
        if p in taken:
            continue
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
            taken.add(p)
            return p
        except OSError:
            pass
        finally:
            s.close()
    sys.exit("store_ha: no free port")


def owns_listener(pid, port):
    """Whether process `pid` holds the socket listening on `port` (/proc/net/tcp and /proc/PID/fd)."""
    inodes = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(f).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            c = line.split()
            if c[3] == "0A" and int(c[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{c[9]}]")
    if not inodes:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            pass
    return False


def alive(pid):
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (exited, not yet reaped) is not alive
        return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def render(template, values, out):
    text = open(template).read()
    for k, v in values.items():
        text = text.replace("${" + k + "}", str(v))
    left = [l for l in text.splitlines() if "${" in l and not l.lstrip().startswith("#")]
    if left:
        sys.exit(f"store_ha: {template}: placeholders left: {left}")
    with open(out, "w") as f:
        f.write(text)


# --- RESP, enough for the readiness checks -------------------------------------------------------

def resp(port, *args, user=ADMIN, tls=None, timeout=1.0):
    """One command on a new connection (AUTH as `user` first); the reply, or an exception."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    if tls:
        import ssl
        ctx = ssl.create_default_context(cafile=tls["ca"])
        ctx.load_cert_chain(tls["client_crt"], tls["client_key"])
        s = ctx.wrap_socket(s, server_hostname="redis.idemgate.internal")
    try:
        f = s.makefile("rwb")
        cmds = ([["AUTH", *user]] if user else []) + [list(args)]
        for c in cmds:
            f.write(f"*{len(c)}\r\n".encode() + b"".join(f"${len(str(a).encode())}\r\n{a}\r\n".encode() for a in c))
        f.flush()
        replies = [read(f) for _ in cmds]
        for r in replies:
            if isinstance(r, Exception):
                raise r
        return replies[-1]
    finally:
        s.close()


def read(f):
    line = f.readline()
    if not line:
        raise ConnectionError("closed")
    t, rest = line[:1], line[1:-2]
    if t == b"+":
        return rest.decode()
    if t == b"-":
        return RuntimeError(rest.decode())
    if t == b":":
        return int(rest)
    if t == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)[:-2]
        return data.decode(errors="replace")
    if t == b"*":
        n = int(rest)
        return None if n < 0 else [read(f) for _ in range(n)]
    raise ConnectionError(f"unexpected {line!r}")


def wait(what, cond, seconds=READY_SECONDS):
    deadline = time.time() + seconds
    last = None
    while time.time() < deadline:
        try:
            if cond():
                return
        except Exception as e:  # not yet
            last = e
        time.sleep(0.05)
    sys.exit(f"store_ha: {what} not ready in {seconds} s (last: {last})")


# --- the stack -----------------------------------------------------------------------------------

def load(d):
    with open(os.path.join(d, "stack.json")) as f:
        return json.load(f)


def save(d, stack):
    tmp = os.path.join(d, "stack.json.tmp")
    with open(tmp, "w") as f:
        json.dump(stack, f, indent=1)
    os.replace(tmp, os.path.join(d, "stack.json"))


def spawn(d, name, argv, cwd=None):
    """Starts a process in its own session (no terminal, its output in DIR/NAME.out)."""
    out = open(os.path.join(d, f"{name}.out"), "ab")
    p = subprocess.Popen(argv, cwd=cwd or d, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                         start_new_session=True)
    return p.pid


def tls_args(stack):
    t = stack.get("tls")
    return {"ca": t["ca"], "client_crt": t["crt"], "client_key": t["key"]} if t else None


def make_tls(d):
    """A CA and one certificate (redis.idemgate.internal) that Redis, Sentinel, HAProxy and the
    replicas all use on both sides of their links (each verifies the other against the CA)."""
    t = os.path.join(d, "tls")
    os.makedirs(t, exist_ok=True)
    run = lambda *a: subprocess.run(a, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=idemgate-redis-ca",
        "-keyout", f"{t}/ca.key", "-out", f"{t}/ca.crt")
    with open(f"{t}/ext.cnf", "w") as f:
        f.write("subjectAltName=DNS:redis.idemgate.internal,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=redis.idemgate.internal",
        "-keyout", f"{t}/redis.key", "-out", f"{t}/redis.csr")
    run("openssl", "x509", "-req", "-in", f"{t}/redis.csr", "-CA", f"{t}/ca.crt", "-CAkey", f"{t}/ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", f"{t}/ext.cnf", "-out", f"{t}/redis.crt")
    with open(f"{t}/haproxy.pem", "w") as f:
        f.write(open(f"{t}/redis.crt").read() + open(f"{t}/redis.key").read())
    return {"ca": f"{t}/ca.crt", "crt": f"{t}/redis.crt", "key": f"{t}/redis.key", "pem": f"{t}/haproxy.pem"}


def tls_directives(stack):
    """redis.conf / sentinel.conf lines for TLS on every link (served and originated)."""
    t = stack["tls"]
    return ("tls-replication yes\n"
            f"tls-cert-file {t['crt']}\ntls-key-file {t['key']}\ntls-ca-cert-file {t['ca']}\n"
            "tls-auth-clients yes\n")


def start_redis(d, stack, i, replica_of=None):
    node = stack["redis"][i]
    ndir = os.path.join(d, f"redis-{i}")
    os.makedirs(ndir, exist_ok=True)
    conf = os.path.join(ndir, "redis.conf")
    base = f"{ROOT}/envoy/redis.conf"
    if stack.get("acl"):
        # envoy/redis.conf without its users, then the users of envoy/redis-acl/redis-acl.conf
        # (Redis refuses a user declared twice); its TLS lines are this script's own below.
        base = os.path.join(ndir, "redis-base.conf")
        with open(base, "w") as f:
            f.writelines(l for l in open(f"{ROOT}/envoy/redis.conf") if not l.startswith("user "))
            f.writelines(l for l in open(ACL_CONF) if l.startswith("user "))
    lines = [f"include {base}", f"include {HA}/redis-ha.conf", f"dir {ndir}",
             f"logfile {ndir}/redis.log", "daemonize no"]
    if stack.get("tls"):
        lines += ["port 0", f"tls-port {node['port']}", tls_directives(stack)]
    else:
        lines += [f"port {node['port']}"]
    if replica_of is not None:
        lines.append(f"replicaof 127.0.0.1 {replica_of}")
    # Written anew at each start: the node's role comes from the Sentinels, not from what a
    # CONFIG REWRITE left in an older copy.
    with open(conf, "w") as f:
        f.write("\n".join(lines) + "\n")
    node["pid"] = spawn(d, f"redis-{i}", ["redis-server", conf], cwd=ndir)
    save(d, stack)
    wait(f"redis-{i}", lambda: owns_listener(node["pid"], node["port"])
         and resp(node["port"], "PING", tls=tls_args(stack)) == "PONG")


def start_sentinel(d, stack, i, primary_port):
    s = stack["sentinels"][i]
    sdir = os.path.join(d, f"sentinel-{i}")
    os.makedirs(sdir, exist_ok=True)
    conf = os.path.join(sdir, "sentinel.conf")
    if not os.path.exists(conf):  # a Sentinel restarted keeps what it learnt (its rewritten file)
        render(os.path.join(HA, "sentinel.conf"), {"SENTINEL_PORT": s["port"], "PRIMARY_HOST": "127.0.0.1",
                                                   "PRIMARY_PORT": primary_port, "STATE_DIR": sdir}, conf)
        with open(conf, "a") as f:
            f.write(f"logfile {sdir}/sentinel.log\n")
            if stack.get("tls"):
                f.write(tls_directives(stack) + f"tls-port {s['port']}\nport 0\n")
    s["pid"] = spawn(d, f"sentinel-{i}", ["redis-server", conf, "--sentinel"], cwd=sdir)
    save(d, stack)
    wait(f"sentinel-{i}", lambda: owns_listener(s["pid"], s["port"])
         and resp(s["port"], "PING", user=None, tls=tls_args(stack)) == "PONG")


def start_haproxy(d, stack, i):
    h = stack["haproxies"][i]
    conf = os.path.join(d, f"haproxy-{i}.cfg")
    tls = ""
    if stack.get("tls"):
        t = stack["tls"]
        tls = f" ssl check-ssl verify required ca-file {t['ca']} crt {t['pem']} sni str(redis.idemgate.internal)"
    values = {"HAPROXY_PORT": h["port"], "HAPROXY_TLS": tls}
    values.update({f"REDIS_{n}_PORT": stack["redis"][n]["port"] for n in range(NODES)})
    render(os.path.join(HA, "haproxy.cfg"), values, conf)
    if "peer_port" in h:
        # --tls --acl: the other legs' hops (on other hosts in a deployment) reach this HAProxy
        # here, over TLS with a client certificate (haproxy.cfg, "redis_peers").
        t = stack["tls"]
        with open(conf, "a") as f:
            f.write("\nfrontend redis_peers\n"
                    f"  bind 127.0.0.1:{h['peer_port']} ssl crt {t['pem']} ca-file {t['ca']} verify required\n"
                    "  default_backend redis_primary\n")
    h["pid"] = spawn(d, f"haproxy-{i}", ["haproxy", "-f", conf])
    save(d, stack)
    wait(f"haproxy-{i}", lambda: owns_listener(h["pid"], h["port"]))


def start_hop(d, stack, i, ops=False):
    """Leg i's Envoy redis_proxy (--acl): webdis -> this hop -> HAProxy-i (the other HAProxies as
    failover, health-checked), as the user idemgate; `ops` (--operator): the operator's hop, as
    the user idemgate-operator, behind the operator's webdis."""
    name = f"opshop-{i}" if ops else f"hop-{i}"
    h = stack["ops_hops" if ops else "hops"][i]
    hdir = os.path.join(d, name)
    os.makedirs(hdir, exist_ok=True)
    conf = os.path.join(hdir, "redis-proxy.yaml")
    render(HOP_YAML, {"LISTEN_PORT": h["port"], "ADMIN_PORT": h["admin_port"], "REDIS_ADDRESS": "127.0.0.1",
                      "REDIS_PORT": stack["haproxies"][i]["port"]}, conf)
    text = open(conf).read()
    if ops:
        for old, new in (("- inline_string: idemgate-demo-redis-password\n", f"- inline_string: {OPERATOR_HOP_PASSWORD}\n"),
                         ("inline_string: idemgate\n", f"inline_string: {OPERATOR_USER[0]}\n"),
                         ("inline_string: idemgate-demo-redis-user-password\n", f"inline_string: {OPERATOR_USER[1]}\n")):
            assert text.count(old) == 1, old
            text = text.replace(old, new)
    a, b = text.index("    transport_socket:\n"), text.index("    # One Redis. With Redis HA")
    # The TLS block (Redis's own TLS without HA) goes: this leg's HAProxy, on this host, originates
    # the TLS to Redis. With --tls the other legs' HAProxies (other hosts in a deployment) are
    # reached on their TLS frontend (`peer_port`) through the same block, chosen per endpoint by
    # `transport_socket_matches`.
    tls_block = text[a:b]
    text = text[:a] + text[b:]
    peer_tls = "peer_port" in stack["haproxies"][i]
    if peer_tls:
        t = stack["tls"]
        for old, new in (("/etc/idemgate/redis-tls/proxy.crt", t["crt"]), ("/etc/idemgate/redis-tls/proxy.key", t["key"]),
                         ("/etc/idemgate/redis-tls/ca.crt", t["ca"])):
            assert tls_block.count(old) == 1, old
            tls_block = tls_block.replace(old, new)
        matches = ("    transport_socket_matches:\n    - name: peer-tls\n      match: {peer_tls: true}\n"
                   + "".join("  " + l + "\n" for l in tls_block.splitlines()))
        marker = "    load_assignment:\n"
        assert text.count(marker) == 1
        text = text.replace(marker, matches + marker)
    # Every HAProxy, this leg's own first (priority 0), the others as failover (priority 1):
    # the hop's own health check takes a dead HAProxy out, so losing one
    # HAProxy loses no leg (webdis's connection to the hop never breaks).
    order = [i] + [j for j in range(LEGS) if j != i]

    def endpoint(j):
        if j != i and peer_tls:
            return (f"        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {stack['haproxies'][j]['peer_port']}}}}}}}\n"
                    "          metadata: {filter_metadata: {envoy.transport_socket_match: {peer_tls: true}}}\n")
        return f"        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {stack['haproxies'][j]['port']}}}}}}}\n"
    endpoints = "".join(
        f"      - priority: {0 if j == i else 1}\n        lb_endpoints:\n" + endpoint(j)
        for j in order)
    start_marker, end_marker = "      # BEGIN endpoints\n", "      # END endpoints\n"
    a, b = text.index(start_marker), text.index(end_marker)
    with open(conf, "w") as f:
        f.write(text[:a + len(start_marker)] + endpoints + text[b:])
    h["pid"] = spawn(d, name, [os.environ.get("ENVOY_BIN", "envoy"), "-c", conf, "--concurrency", "1", "--disable-hot-restart",
                               "--log-level", "warn"], cwd=hdir)
    save(d, stack)
    wait(name, lambda: owns_listener(h["pid"], h["port"]), seconds=60)


def start_webdis(d, stack, i, ops=False):
    """Leg i's webdis; `ops` (--operator): the operator's, to the operator's hop, as HTTP user
    operator (the same commands enabled)."""
    name = f"opswebdis-{i}" if ops else f"webdis-{i}"
    w = stack["ops_webdis" if ops else "webdis"][i]
    wdir = os.path.join(d, name)
    os.makedirs(wdir, exist_ok=True)
    c = json.load(open(os.path.join(HA, "webdis.json")))
    if ops:
        upstream = stack["ops_hops"][i]["port"]
        c["redis_auth"] = OPERATOR_HOP_PASSWORD
        for rule in c["acl"]:
            if "http_basic_auth" in rule:
                rule["http_basic_auth"] = OPERATOR_WEBDIS_AUTH
    else:
        upstream = stack["hops"][i]["port"] if stack.get("acl") else stack["haproxies"][i]["port"]
    c.update(redis_host="127.0.0.1", redis_port=upstream, http_host="127.0.0.1",
             http_port=w["port"], daemonize=False, logfile=os.path.join(wdir, "webdis.log"), verbosity=1)
    with open(os.path.join(wdir, "webdis.json"), "w") as f:
        json.dump(c, f)
    w["pid"] = spawn(d, name, ["webdis", "webdis.json"], cwd=wdir)
    save(d, stack)
    wait(name, lambda: owns_listener(w["pid"], w["port"]) and ping_webdis(w["port"]))


def ping_webdis(port):
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/PING", timeout=1) as r:
        return r.status == 200 and b"PONG" in r.read()


def sentinel_primary(stack):
    """The primary's port as the Sentinels name it (the answer of most of those reachable)."""
    votes = {}
    for s in stack["sentinels"]:
        try:
            a = resp(s["port"], "SENTINEL", "get-master-addr-by-name", "idemgate", user=None, tls=tls_args(stack))
            if a:
                votes[int(a[1])] = votes.get(int(a[1]), 0) + 1
        except Exception:
            pass
    return max(votes, key=votes.get) if votes else None


def failover_target(stack, seconds=5.0):
    """The replica a failover under way is promoting (its port), or None when no Sentinel reports
    one. A failover started when the whole store died may have selected a replica that died in the
    same instant (the Sentinels had not yet judged it down); it stays under way, for up to
    failover-timeout, and promotes that replica as soon as it is back, whatever came back
    meanwhile. A failover still choosing (no replica flagged `promoted` yet) is waited for, at
    most `seconds`."""
    deadline = time.time() + seconds
    while True:
        choosing = False
        for s in stack["sentinels"]:
            try:
                m = resp(s["port"], "SENTINEL", "master", "idemgate", user=None, tls=tls_args(stack))
                if "failover_in_progress" not in dict(zip(m[::2], m[1::2])).get("flags", ""):
                    continue
                choosing = True
                for r in resp(s["port"], "SENTINEL", "replicas", "idemgate", user=None, tls=tls_args(stack)) or []:
                    f = dict(zip(r[::2], r[1::2]))
                    if "promoted" in f.get("flags", "").split(","):
                        return int(f["port"])
            except Exception:
                pass
        if not choosing:
            return None
        if time.time() > deadline:
            log(f"a failover still choosing its replica after {seconds} s: going on without it")
            return None
        time.sleep(0.1)


def up(d, tls, acl=False, operator=False):
    if operator and not acl:
        sys.exit("store_ha: --operator needs --acl")
    os.makedirs(d, exist_ok=True)
    taken = set()
    stack = {
        "redis": [{"port": free_port(taken)} for _ in range(NODES)],
        "sentinels": [{"port": free_port(taken)} for _ in range(SENTINELS)],
        "haproxies": [{"port": free_port(taken)} for _ in range(LEGS)],
        "webdis": [{"port": free_port(taken)} for _ in range(LEGS)],
    }
    if tls:
        stack["tls"] = make_tls(d)
    if acl:
        stack["acl"] = True
        if tls:
            for h in stack["haproxies"]:
                h["peer_port"] = free_port(taken)
        stack["hops"] = [{"port": free_port(taken), "admin_port": free_port(taken)} for _ in range(LEGS)]
    if operator:
        stack["ops_hops"] = [{"port": free_port(taken), "admin_port": free_port(taken)} for _ in range(LEGS)]
        stack["ops_webdis"] = [{"port": free_port(taken)} for _ in range(LEGS)]
    save(d, stack)
    primary = stack["redis"][0]["port"]
    start_redis(d, stack, 0)
    for i in range(1, NODES):
        start_redis(d, stack, i, replica_of=primary)
    for i in range(1, NODES):
        wait(f"redis-{i} in sync", lambda: "master_link_status:up" in
             resp(stack["redis"][i]["port"], "INFO", "replication", tls=tls_args(stack)))
    for i in range(SENTINELS):
        start_sentinel(d, stack, i, primary)
    # Every Sentinel sees the two replicas and the two other Sentinels before anything relies on a failover.
    def sentinels_ready():
        for s in stack["sentinels"]:
            m = resp(s["port"], "SENTINEL", "master", "idemgate", user=None, tls=tls_args(stack))
            f = dict(zip(m[::2], m[1::2]))
            if int(f["num-slaves"]) < NODES - 1 or int(f["num-other-sentinels"]) < SENTINELS - 1:
                return False
        return True
    wait("the Sentinels (each sees every replica and Sentinel)", sentinels_ready)
    for i in range(LEGS):
        start_haproxy(d, stack, i)
    if acl:
        for i in range(LEGS):
            start_hop(d, stack, i)
    for i in range(LEGS):
        start_webdis(d, stack, i)
    if operator:
        for i in range(LEGS):
            start_hop(d, stack, i, ops=True)
            start_webdis(d, stack, i, ops=True)
    log(f"up: redis {[n['port'] for n in stack['redis']]} (primary {primary}), sentinels "
        f"{[s['port'] for s in stack['sentinels']]}, haproxy {[h['port'] for h in stack['haproxies']]}, "
        f"webdis {[w['port'] for w in stack['webdis']]}{', TLS to Redis' if tls else ''}"
        f"{', as the ACL user idemgate through hops ' + str([h['port'] for h in stack['hops']]) if acl else ''}"
        f"{', operator webdis ' + str([w['port'] for w in stack['ops_webdis']]) if operator else ''}")


def part(stack, name):
    kind, _, i = name.rpartition("-")
    key = {"redis": "redis", "sentinel": "sentinels", "haproxy": "haproxies", "webdis": "webdis",
           "hop": "hops", "opshop": "ops_hops", "opswebdis": "ops_webdis"}.get(kind)
    if key is None or not i.isdigit() or int(i) >= len(stack.get(key, [])):
        sys.exit(f"store_ha: no part named {name!r}")
    return kind, int(i), stack[key][int(i)]


def kill(d, name):
    stack = load(d)
    _, _, p = part(stack, name)
    pid = p.get("pid")
    if pid and alive(pid):
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            if not alive(pid):
                break
            time.sleep(0.01)


def start(d, name):
    stack = load(d)
    kind, i, p = part(stack, name)
    if p.get("pid") and alive(p["pid"]):
        sys.exit(f"store_ha: {name} is running (pid {p['pid']})")
    if kind == "redis":
        primary = sentinel_primary(stack)
        promoting = failover_target(stack)
        if promoting is not None:
            # Side with the failover under way: the node it promotes comes back as primary (it
            # refuses claims until a replica synced from it, min-replicas-to-write), every other
            # node as its replica. The former primary never comes back as primary meanwhile: it
            # would take claims the promoted node lacks, lost when the failover completes.
            log(f"{name}: a failover is promoting port {promoting}")
            start_redis(d, stack, i, replica_of=None if promoting == p["port"] else promoting)
        else:
            start_redis(d, stack, i, replica_of=None if primary in (None, p["port"]) else primary)
        log(f"{name} started" + (f" as a replica of port {promoting}" if promoting not in (None, p["port"]) else
                                 " as the promoted primary" if promoting == p["port"] else ""))
    elif kind == "sentinel":
        start_sentinel(d, stack, i, stack["redis"][0]["port"])
    elif kind == "haproxy":
        start_haproxy(d, stack, i)
    elif kind == "hop":
        start_hop(d, stack, i)
    elif kind == "opshop":
        start_hop(d, stack, i, ops=True)
    elif kind == "opswebdis":
        start_webdis(d, stack, i, ops=True)
    else:
        start_webdis(d, stack, i)


def down(d):
    try:
        stack = load(d)
    except OSError:
        return
    for key in ("ops_webdis", "ops_hops", "webdis", "hops", "haproxies", "sentinels", "redis"):
        for p in stack.get(key, []):
            if p.get("pid") and alive(p["pid"]):
                os.kill(p["pid"], signal.SIGKILL)


def cluster(d):
    """envoy/redis-ha/idemgate-store-cluster.yaml with this stack's webdis ports."""
    stack = load(d)
    text = open(os.path.join(HA, "idemgate-store-cluster.yaml")).read()
    body = text[text.index("- name: idemgate_store"):]
    endpoints = "".join(f"      - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {w['port']}}}}}}}\n"
                        for w in stack["webdis"])
    start_marker = "      # BEGIN endpoints\n"
    end_marker = "      # END endpoints\n"
    a, b = body.index(start_marker), body.index(end_marker)
    print(body[:a + len(start_marker)] + endpoints + body[b:], end="")


def main():
    args = sys.argv[1:]
    if len(args) < 2:
        sys.exit(__doc__)
    cmd, d = args[0], os.path.abspath(args[1])
    global LOG_DIR
    LOG_DIR = d if os.path.isdir(d) else None
    if cmd == "up":
        up(d, "--tls" in args[2:], "--acl" in args[2:], "--operator" in args[2:])
    elif cmd == "down":
        down(d)
    elif cmd == "kill" and len(args) == 3:
        kill(d, args[2])
    elif cmd == "start" and len(args) == 3:
        start(d, args[2])
    elif cmd == "primary":
        port = sentinel_primary(load(d))
        names = {n["port"]: f"redis-{i}" for i, n in enumerate(load(d)["redis"])}
        print(names.get(port, "none"))
    elif cmd == "cluster":
        cluster(d)
    elif cmd == "judged":
        stack = load(d)

        def flags():
            return [dict(zip(m[::2], m[1::2])).get("flags", "") for m in
                    (resp(s["port"], "SENTINEL", "master", "idemgate", user=None, tls=tls_args(stack))
                     for s in stack["sentinels"])]
        wait("the Sentinels judging the primary down (o_down)", lambda: any("o_down" in f for f in flags()))
        wait("no failover under way", lambda: not any("failover_in_progress" in f for f in flags()))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
