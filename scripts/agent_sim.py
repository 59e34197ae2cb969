#!/usr/bin/env python3
"""The demo's agent simulator: an agent paying through a tool wrapper, under injected faults.

The wrapper does what docs/agents.md asks of agent builders: it derives the key from (task, step), keeps
it across every retry, retries timeouts, 409s and 5xx, and never lets the "model" choose the key.
Faults: a response that arrives after the agent's timeout, a response lost on the way back (as a
proxy answering 504 would), concurrent duplicate retries, a retry with an altered body, and a
restart of the whole task with a new task id.

The same run is made twice: through idemgate, then straight to the API (the counterfactual).
It exits 0 only if, through idemgate, every operation executed exactly once (each by its key in
the API's listing of charges, scripts/demo_verdict.py) and no charge gave up.
"""
import argparse
import hashlib
import json
import sys
import threading
import time

import requests

from demo_verdict import finish, key_for

AGENT_TIMEOUT = 1.0
MAX_ATTEMPTS = 4
OUT_LOCK = threading.Lock()


def say(line):
    with OUT_LOCK:
        print(line, flush=True)



class Wrapper:
    def __init__(self, base, stats):
        self.base = base
        self.stats = stats
        self.gave_up = []
        # Every (key, charge id) the agent accepted as an operation's answer.
        self.answers = []

    def attempt(self, task, step, body, key, n, delay_ms=0, label=""):
        headers = {
            "authorization": "Bearer demo-agent",
            "content-type": "application/json",
            "idempotency-key": key,
            "x-agent-task-id": task,
            "x-agent-step-id": step,
        }
        if delay_ms:
            headers["x-demo-delay-ms"] = str(delay_ms)
        who = f"  [{task}/{step}]{label} attempt {n} key={hashlib.sha256(key.encode()).hexdigest()[:8]}"
        self.stats["attempts"] += 1
        try:
            r = requests.post(self.base + "/charges", data=json.dumps(body), headers=headers, timeout=AGENT_TIMEOUT)
        except requests.exceptions.ReadTimeout:
            say(f"{who} -> no answer within {AGENT_TIMEOUT:.0f} s (the response is late: lost to the agent)")
            return "lost", None
        except requests.RequestException as e:
            say(f"{who} -> connection failed ({type(e).__name__})")
            return "lost", None
        problem = ""
        if r.headers.get("content-type", "").startswith("application/problem+json"):
            problem = r.json().get("type", "").rsplit(":", 1)[-1]
        if r.status_code < 300:
            replayed = r.headers.get("idempotent-replayed") == "true"
            what = "replayed" if replayed else "claimed"
            say(f"{who} -> {r.status_code} {what} (charge {r.json().get('id')})")
            return what, r
        if r.status_code == 409 and problem == "request-in-flight":
            say(f"{who} -> 409 in flight: the first attempt is still running; retry after {r.headers.get('retry-after')} s")
            return "in_flight", r
        if r.status_code == 422:
            say(f"{who} -> 422 key reused with a different request: refused, nothing executed")
            return "mismatch", r
        say(f"{who} -> {r.status_code} {problem}")
        return "other", r

    def charge(self, task, step, amount, lose_first=False, delay_ms=0, altered_retry=False, label=""):
        """One operation: retry until an answer the agent can use."""
        key = key_for(task, step)
        body = {"amount": amount, "currency": "eur"}
        for n in range(1, MAX_ATTEMPTS + 1):
            send = body
            if altered_retry and n == 2:
                send = dict(body, amount=amount + 1)  # a buggy retry that changed the request
            what, r = self.attempt(task, step, send, key, n, delay_ms if n == 1 else 0, label)
            if what in ("claimed", "replayed"):
                if lose_first and n == 1:
                    say(f"  [{task}/{step}]{label}   (a proxy on the way back answered 504: the agent never sees this response)")
                    time.sleep(0.2)
                    continue
                got = r.json().get("id")
                with OUT_LOCK:
                    self.answers.append((key, got))
                return got
            if what == "in_flight":
                time.sleep(float(r.headers.get("retry-after", "1")))
            elif what == "mismatch":
                say(f"  [{task}/{step}]{label}   the wrapper retries with the original request")
            else:
                time.sleep(0.3)
        say(f"  [{task}/{step}]{label} gave up after {MAX_ATTEMPTS} attempts")
        with OUT_LOCK:
            self.gave_up.append(f"{task}/{step}{label}")
        return None


def run(base, api, title):
    requests.post(api + "/reset", timeout=5)
    stats = {"attempts": 0}
    w = Wrapper(base, stats)
    say(f"\n== {title} ==")
    ops = {}

    say("1. a plain charge")
    ops[key_for("task-1", "step-1")] = "task-1/step-1"
    w.charge("task-1", "step-1", 1200)

    say("2. the API answers after the agent's timeout (2 s > 1 s)")
    ops[key_for("task-1", "step-2")] = "task-1/step-2"
    w.charge("task-1", "step-2", 2500, delay_ms=2000)

    say("3. the response is lost on the way back (a proxy answers 504)")
    ops[key_for("task-1", "step-3")] = "task-1/step-3"
    w.charge("task-1", "step-3", 990, lose_first=True)

    say("4. three concurrent retries of one call")
    ops[key_for("task-1", "step-4")] = "task-1/step-4"
    threads = [
        threading.Thread(target=w.charge, args=("task-1", "step-4", 4200), kwargs={"delay_ms": 500, "label": f" #{i}"})
        for i in range(1, 4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    say("5. the response is lost and the retry alters the body")
    ops[key_for("task-1", "step-5")] = "task-1/step-5"
    w.charge("task-1", "step-5", 700, lose_first=True, altered_retry=True)

    say("6. the whole task restarts with a new task id (a new operation, executed again on purpose)")
    ops[key_for("task-2", "step-1")] = "task-2/step-1"
    w.charge("task-2", "step-1", 1200)

    # Each execution by its operation's key, as the API lists its charges.
    charges = requests.get(api + "/charges", timeout=5).json()["charges"]
    executed = [c.get("idempotency_key") for c in charges]
    listed = {}
    for c in charges:
        listed.setdefault(c.get("idempotency_key"), []).append(c.get("id"))
    return ops, executed, stats["attempts"], w.gave_up, w.answers, listed


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gateway", required=True)
    p.add_argument("--api", required=True)
    p.add_argument("--admin")
    p.add_argument("--store", default="redis", help="the store the gateway uses (named in the last line)")
    a = p.parse_args()
    started = time.monotonic()
    guarded = run(a.gateway, a.api, "through idemgate")
    ops_raw, executed_raw = run(a.api, a.api, "the same agent, straight to the API (no idemgate)")[:2]
    sys.exit(finish(say, a.store, guarded, (ops_raw, executed_raw), started))


if __name__ == "__main__":
    main()
