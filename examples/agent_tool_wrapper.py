#!/usr/bin/env python3
"""A tool wrapper for agents calling state-changing APIs behind idemgate.

- The key comes from the operation's identity (run, task, step, tool), never from the model.
- The same key is reused on every retry of that operation.
- A state-changing call without an operation identity is refused before it leaves the process.
- Each idemgate answer is turned into what the agent should do next.

    wrapper = ToolWrapper("http://127.0.0.1:10000", token="...")
    result = wrapper.call("POST", "/charges", {"amount": 4200}, run="r1", task="pay-invoice-7", step="charge")

SDKs that send no key of their own (openai, anthropic, any Stainless SDK whose idempotency header
is unset) get the same key per call through their per-request header option, which each of their
retries reuses:

    client = openai.OpenAI(base_url="http://127.0.0.1:10000/v1")
    h = ToolWrapper.sdk_headers(run="r1", task="summarise-7", step="draft", tool="chat.completions")
    client.chat.completions.create(model=m, messages=msgs, extra_headers=h)   # Python
    // Node: client.chat.completions.create({ model, messages }, { headers: h })
"""
import hashlib
import json
import time

import requests

STATE_CHANGING = {"POST", "PUT", "PATCH", "DELETE"}


class OutcomeUnknown(Exception):
    """The first attempt may have executed and its result was lost: check, then decide."""


class KeyMisuse(Exception):
    """The same key was sent with a different request: a bug in the caller."""


class ToolWrapper:
    def __init__(self, base_url, token, timeout=10.0, attempts=5):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.attempts = attempts

    @staticmethod
    def key(run, task, step, tool):
        """Stable for one operation: every retry of it sends the same key."""
        if not all([run, task, step, tool]):
            raise ValueError("a state-changing call needs run, task, step and tool to derive its key")
        return "op-" + hashlib.sha256("\x00".join([run, task, step, tool]).encode()).hexdigest()[:40]

    @staticmethod
    def sdk_headers(run, task, step, tool):
        """The per-request headers for an SDK call (openai/anthropic `extra_headers=`, Node
        `{ headers }`): the operation's key, and the ids idemgate logs."""
        return {
            "Idempotency-Key": ToolWrapper.key(run, task, step, tool),
            "x-agent-run-id": run,
            "x-agent-task-id": task,
            "x-agent-step-id": step,
        }

    def call(self, method, path, body, run=None, task=None, step=None):
        if method.upper() in STATE_CHANGING and not (run and task and step):
            raise ValueError(f"refusing {method} {path}: no operation identity, so no idempotency key")
        headers = {"authorization": f"Bearer {self.token}", "content-type": "application/json"}
        if method.upper() in STATE_CHANGING:
            headers["idempotency-key"] = self.key(run, task, step, f"{method.upper()} {path}")
            headers.update({"x-agent-run-id": run, "x-agent-task-id": task, "x-agent-step-id": step})
        data = json.dumps(body).encode()
        delay = 0.5
        for _ in range(self.attempts):
            try:
                r = requests.request(method, self.base_url + path, data=data, headers=headers, timeout=self.timeout)
            except requests.RequestException:
                time.sleep(delay)  # the response may be lost: the same key makes the retry safe
                delay = min(delay * 2, 8)
                continue
            problem = r.json().get("type", "") if r.headers.get("content-type", "").startswith("application/problem+json") else ""
            if problem.endswith(":request-in-flight") or r.status_code in (502, 503, 504) and r.headers.get("x-should-retry") != "false":
                time.sleep(float(r.headers.get("retry-after", delay)))
                delay = min(delay * 2, 8)
                continue
            if problem.endswith(":outcome-unknown") or problem.endswith(":upstream-no-answer"):
                raise OutcomeUnknown("check the resource before doing this again with a new operation identity")
            if problem.endswith(":key-reused"):
                raise KeyMisuse("this operation identity was used for a different request")
            return {"status": r.status_code, "replayed": r.headers.get("idempotent-replayed") == "true", "body": r.text}
        raise OutcomeUnknown(f"no usable answer after {self.attempts} attempts")
