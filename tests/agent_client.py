#!/usr/bin/env python3
"""A retrying agent client, as an agent's tool wrapper would be: `requests` with urllib3's Retry.

It generates nothing: the key is given on the command line and reused on every retry. It retries
on timeouts, connection errors, 409 and 5xx (POST included), honours Retry-After, and prints one
JSON object: every attempt (time, status or error) and the final answer.
"""
import argparse
import json
import sys
import time

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

START = time.monotonic()
ATTEMPTS = []


class RecordingRetry(Retry):
    """Retry that records each failed attempt before deciding on the next."""

    def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
        ATTEMPTS.append({
            "t": round(time.monotonic() - START, 3),
            "status": response.status if response is not None else None,
            "problem": (response.headers.get("content-type", "") if response is not None else "")
            and _problem_type(response),
            "error": type(error).__name__ if error is not None else None,
        })
        return super().increment(method, url, response, error, _pool, _stacktrace)


def _problem_type(response):
    try:
        data = response.data
        return json.loads(data).get("type") if data else None
    except Exception:
        return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--key")
    p.add_argument("--header", action="append", default=[], help="name:value")
    p.add_argument("--body", default="{}")
    p.add_argument("--timeout", type=float, default=1.0)
    p.add_argument("--retries", type=int, default=6)
    a = p.parse_args()

    retry = RecordingRetry(
        total=a.retries,
        connect=a.retries,
        read=a.retries,
        status=a.retries,
        backoff_factor=0.25,
        status_forcelist=[409, 500, 502, 503, 504],
        allowed_methods=None,  # retry POST too: the key makes it safe
        respect_retry_after_header=True,
        raise_on_status=False,
    )
    s = requests.Session()
    s.mount("http://", HTTPAdapter(max_retries=retry))
    headers = {"content-type": "application/json"}
    if a.key:
        headers["Idempotency-Key"] = a.key
    for h in a.header:
        n, v = h.split(":", 1)
        headers[n.strip()] = v.strip()
    out = {"attempts": ATTEMPTS}
    try:
        r = s.post(a.url, data=a.body.encode(), headers=headers, timeout=a.timeout)
        ATTEMPTS.append({"t": round(time.monotonic() - START, 3), "status": r.status_code, "final": True})
        out.update(status=r.status_code, body=r.text, replayed=r.headers.get("idempotent-replayed"))
    except requests.RequestException as e:
        out.update(status=None, error=type(e).__name__)
    out["elapsed"] = round(time.monotonic() - START, 3)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
