"""One MCP caller for tests/it/mcp_sdk.rs: the official Python SDK client (`mcp`, pinned in
tests/mcp/requirements.txt) over Streamable HTTP, nothing of ours but the arguments.

  client.py --url http://127.0.0.1:P/mcp --key K --key-via header|meta|arg
            [--amount 4200] [--currency eur] [--delay-ms 0] [--tool charge] [--fail-code C]
            [--mode auto|legacy] --steps same:60,new:60,...

Each step calls the tool once with the same key and arguments: `same:T` in the current client
(the first step opens one), `new:T` in a new client (a new session where the server keeps them),
T the call's own timeout in seconds. One JSON line on stdout: {"steps": [...]}, each step either
{"outcome": "returned", "is_error": bool, "text": <the content's text>, "structured": ...} or
{"outcome": "raised", "error_type": <class>, "code": <MCPError code>, "message": ..., "data": ...}.
"""

import argparse
import asyncio
import json
import sys
from contextlib import AsyncExitStack

import httpx2
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import ElicitResult


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--key")
    p.add_argument("--key-via", choices=["header", "meta", "arg"], default="header")
    p.add_argument("--tool", default="charge")
    p.add_argument("--amount", type=int, default=4200)
    p.add_argument("--currency", default="eur")
    p.add_argument("--delay-ms", type=int, default=0)
    p.add_argument("--fail-code", type=int, help="charge_then_fail: the MCPError code the tool raises")
    p.add_argument("--mode", default="auto", help="auto (2026-07-28, no session) or legacy (initialize)")
    p.add_argument("--steps", default="same:60")
    p.add_argument("--authorization", default="Bearer mcp-test-agent")
    return p.parse_args()


def open_client(a: argparse.Namespace, stack: AsyncExitStack):
    # The caller's identity: idemgate scopes keys by it (envoy/mcp/envoy.yaml: scope.headers).
    headers = {"Authorization": a.authorization}
    if a.key and a.key_via == "header":
        headers["Idempotency-Key"] = a.key
    http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(120.0))
    transport = streamable_http_client(a.url, http_client=http)
    return stack.enter_async_context(
        Client(transport, mode=a.mode, cache=None, elicitation_callback=confirm_every_question)
    )


async def confirm_every_question(_context, _params) -> ElicitResult:
    """The user's answer to a tool that asks first (confirm_charge): yes."""
    return ElicitResult(action="accept", content={"confirm": True})


def arguments(a: argparse.Namespace) -> dict:
    if not (a.tool.startswith("charge") or a.tool.startswith("confirm")):
        return {"currency": a.currency}
    args = {"amount": a.amount, "currency": a.currency}
    if a.delay_ms:
        args["delay_ms"] = a.delay_ms
    if a.fail_code is not None:
        args["code"] = a.fail_code
    if a.key and a.key_via == "arg":
        args["idempotency_key"] = a.key
    return args


async def one_call(client: Client, a: argparse.Namespace, timeout: float) -> dict:
    meta = {"idempotencyKey": a.key} if a.key and a.key_via == "meta" else None
    try:
        r = await client.call_tool(a.tool, arguments(a), read_timeout_seconds=timeout, meta=meta)
    except MCPError as e:
        return {"outcome": "raised", "error_type": type(e).__name__, "code": e.code, "message": e.message,
                "data": e.data}
    except Exception as e:  # what else the SDK raises (transport errors, timeouts): recorded, not hidden
        return {"outcome": "raised", "error_type": type(e).__name__, "code": None, "message": str(e), "data": None}
    text = "".join(getattr(c, "text", "") for c in r.content)
    return {"outcome": "returned", "is_error": bool(r.is_error), "text": text,
            "structured": r.structured_content}


async def run(a: argparse.Namespace) -> dict:
    steps = []
    async with AsyncExitStack() as outer:
        client = None
        stack = None
        for spec in a.steps.split(","):
            kind, _, t = spec.partition(":")
            timeout = float(t or 60)
            if client is None or kind == "new":
                if stack is not None:
                    # Leaving the previous client: errors on its way out are recorded, not fatal.
                    try:
                        await stack.aclose()
                    except Exception as e:  # noqa: BLE001
                        steps.append({"closing_error": type(e).__name__})
                stack = AsyncExitStack()
                try:
                    client = await open_client(a, stack)
                except Exception as e:  # noqa: BLE001
                    steps.append({"outcome": "raised", "error_type": type(e).__name__, "code": None,
                                  "message": f"connect: {e}", "data": None})
                    client = None
                    continue
            steps.append(await one_call(client, a, timeout))
        if stack is not None:
            try:
                await stack.aclose()
            except Exception:  # noqa: BLE001
                pass
    return {"steps": steps}


def main() -> None:
    a = parse()
    out = asyncio.run(run(a))
    print(json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    sys.exit(main())
