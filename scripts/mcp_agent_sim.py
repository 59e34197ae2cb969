#!/usr/bin/env python3
"""`make demo MCP=1`: scripts/agent_sim.py's agent, calling the MCP payments server
(tests/mcp/server.py, the official MCP Python SDK) with the official MCP Python client, under the
same faults: a tool slower than the agent's timeout, a response lost on the way back, concurrent
duplicate retries, a retry that alters the arguments, a restarted task. The key is the wrapper's
(task, step) key in `_meta.idempotencyKey`, kept across retries (and in the tool's own
`idempotency_key` argument, so that the server lists each execution by its operation).

Run twice: through idemgate (envoy/mcp/envoy.yaml), then straight to the MCP server. Exits 0 only
if, through idemgate, every operation executed exactly once (each by its key in the server's
listing, GET /charges: scripts/demo_verdict.py) and no call gave up. Runs under target/mcp-venv/bin/python.
"""
import argparse
import asyncio
import hashlib
import json
import sys
import time
import urllib.request

import httpx2
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from demo_verdict import finish, key_for

AGENT_TIMEOUT = 1.0
MAX_ATTEMPTS = 4


def say(line):
    print(line, flush=True)



def charges(server):
    """Every execution of charge so far, as the server lists them (payment, idempotency_key)."""
    with urllib.request.urlopen(server + "/charges", timeout=5) as r:
        return json.load(r)["charges"]


def executed(server):
    """The key of every execution of charge so far, as the server lists them."""
    return [c["idempotency_key"] for c in charges(server)]


class Wrapper:
    def __init__(self, url, stats):
        self.url = url
        self.stats = stats
        self.gave_up = []
        # Every (key, payment) the agent accepted as an operation's result.
        self.answers = []

    async def attempt(self, client, task, step, args, key, n, label):
        who = f"  [{task}/{step}]{label} attempt {n} key={hashlib.sha256(key.encode()).hexdigest()[:8]}"
        self.stats["attempts"] += 1
        try:
            r = await client.call_tool("charge", args, read_timeout_seconds=AGENT_TIMEOUT,
                                       meta={"idempotencyKey": key})
        except MCPError as e:
            slug = (e.data or {}).get("type", "").rsplit(":", 1)[-1] if isinstance(e.data, dict) else ""
            if not slug and "timed out" in e.message:
                say(f"{who} -> no answer within {AGENT_TIMEOUT:.0f} s (the response is late: lost to the agent)")
                return "lost", None
            if slug == "key-reused":
                say(f"{who} -> MCP error {e.code} key reused with other arguments: refused, nothing executed")
                return "mismatch", None
            if slug == "request-in-flight":
                say(f"{who} -> MCP error {e.code} in flight: the first call is still running")
                return "in_flight", None
            say(f"{who} -> MCP error {e.code} {slug or e.message}")
            return "other", None
        payment = json.loads("".join(getattr(c, "text", "") for c in r.content)).get("payment")
        say(f"{who} -> result (payment {payment})")
        return "result", payment

    async def charge(self, task, step, amount, lose_first=False, delay_ms=0, altered_retry=False, label=""):
        key = key_for(task, step)
        args = {"amount": amount, "currency": "eur", "idempotency_key": key}
        if delay_ms:
            args["delay_ms"] = delay_ms
        # The agent's identity (idemgate scopes keys by it: envoy/mcp/envoy.yaml, scope.headers).
        http = httpx2.AsyncClient(headers={"Authorization": "Bearer demo-agent"}, timeout=httpx2.Timeout(60.0))
        async with Client(streamable_http_client(self.url, http_client=http)) as client:
            for n in range(1, MAX_ATTEMPTS + 1):
                send = dict(args, amount=amount + 1) if altered_retry and n == 2 else args
                what, payment = await self.attempt(client, task, step, send, key, n, label)
                if what == "result":
                    if lose_first and n == 1:
                        say(f"  [{task}/{step}]{label}   (a proxy on the way back answered 504: the agent never sees this result)")
                        await asyncio.sleep(0.2)
                        continue
                    self.answers.append((key, payment))
                    return payment
                if what == "mismatch":
                    say(f"  [{task}/{step}]{label}   the wrapper retries with the original arguments")
                elif what != "lost":
                    await asyncio.sleep(1)
        say(f"  [{task}/{step}]{label} gave up after {MAX_ATTEMPTS} attempts")
        self.gave_up.append(f"{task}/{step}{label}")
        return None


async def run(url, server, title):
    before = len(executed(server))
    stats = {"attempts": 0}
    w = Wrapper(url, stats)
    say(f"\n== {title} ==")
    ops = {}
    say("1. a plain charge")
    ops[key_for("task-1", "step-1")] = "task-1/step-1"
    await w.charge("task-1", "step-1", 1200)
    say("2. the tool answers after the agent's timeout (2 s > 1 s)")
    ops[key_for("task-1", "step-2")] = "task-1/step-2"
    await w.charge("task-1", "step-2", 2500, delay_ms=2000)
    say("3. the result is lost on the way back (a proxy answers 504)")
    ops[key_for("task-1", "step-3")] = "task-1/step-3"
    await w.charge("task-1", "step-3", 990, lose_first=True)
    say("4. three concurrent retries of one call")
    ops[key_for("task-1", "step-4")] = "task-1/step-4"
    await asyncio.gather(*(w.charge("task-1", "step-4", 4200, delay_ms=500, label=f" #{i}") for i in range(1, 4)))
    say("5. the result is lost and the retry alters the arguments")
    ops[key_for("task-1", "step-5")] = "task-1/step-5"
    await w.charge("task-1", "step-5", 700, lose_first=True, altered_retry=True)
    say("6. the whole task restarts with a new task id (a new operation, executed again on purpose)")
    ops[key_for("task-2", "step-1")] = "task-2/step-1"
    await w.charge("task-2", "step-1", 1200)
    # A tool that outlived its caller (step 2 without idemgate) still counts: let it end.
    await asyncio.sleep(2.5)
    mine = charges(server)[before:]
    listed = {}
    for c in mine:
        listed.setdefault(c["idempotency_key"], []).append(c["payment"])
    return ops, [c["idempotency_key"] for c in mine], stats["attempts"], w.gave_up, w.answers, listed


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gateway", required=True, help="the MCP endpoint through idemgate")
    p.add_argument("--server", required=True, help="the MCP server's base URL (its /mcp and /count)")
    p.add_argument("--store", default="local")
    a = p.parse_args()
    started = time.monotonic()
    guarded = asyncio.run(run(a.gateway, a.server, "through idemgate (MCP)"))
    ops_raw, executed_raw, *_ = asyncio.run(run(a.server + "/mcp", a.server, "the same agent, straight to the MCP server (no idemgate)"))
    sys.exit(finish(say, a.store, guarded, (ops_raw, executed_raw), started))


if __name__ == "__main__":
    main()
