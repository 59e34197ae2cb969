"""The MCP payments server of tests/it/mcp_sdk.rs: the official Python SDK (`mcp`, pinned in
tests/mcp/requirements.txt) and nothing of ours but the tools.

Streamable HTTP at /mcp, stateless by default (no Mcp-Session-Id; a tool call outlives the client
that sent it), answering `application/json` (--json) or `text/event-stream` (the SDK's default).
--stateful keeps sessions (initialize + Mcp-Session-Id, the older protocol revisions' way).

Tools:
  charge(amount, currency, idempotency_key=None, delay_ms=0)  counts each execution; `delay_ms`
      (or MCP_CHARGE_DELAY_MS) makes it slow; returns a payment with an id unique to the execution.
  balance(currency)  read-only (annotations.readOnlyHint), counted too.
  charge_then_fail(amount, currency, code=-32600, idempotency_key=None)  counts an execution (the
      payment is made), then raises `MCPError(code)`: at revision 2026-07-28 the SDK answers it
      with the HTTP status of its ERROR_CODE_HTTP_STATUS (mcp/shared/inbound.py: 400 for -32600,
      404 for -32601) and a JSON-RPC error body with the request's id, at the 2025 revisions with
      200 (issue 40).
  confirm_charge(amount, currency, idempotency_key=None)  asks the user to confirm first (a
      `Resolve(Elicit)` parameter: at 2026-07-28 an `InputRequiredResult` the client's driver
      answers by re-sending the call with `inputResponses` and `requestState`), then counts an
      execution and returns a payment (issue 40).
GET /count answers {"charge": n, "balance": m, "charge_then_fail": k, "confirm_charge": c} (executions so far); the
Rust test reads it.
GET /charges lists every execution of charge, in order: {"charges": [{"payment", "idempotency_key"}]}
(the key as the `idempotency_key` argument gave it, or null); the MCP demo's verdict reads it.

Prints `listening <port>` on stdout once the port is bound (--port 0 picks one).
"""

import argparse
import asyncio
import os
import socket
import sys
import uuid

import uvicorn
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.resolve import Elicit, Resolve
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types import ToolAnnotations
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse

COUNTS = {"charge": 0, "balance": 0, "charge_then_fail": 0, "confirm_charge": 0}
CHARGES = []

server = MCPServer("idemgate-test-payments")


@server.tool(description="Charge a card: executes a payment each time it runs.")
async def charge(amount: int, currency: str, idempotency_key: str | None = None, delay_ms: int = 0) -> dict:
    COUNTS["charge"] += 1
    n = COUNTS["charge"]
    payment = f"pay_{n}_{uuid.uuid4().hex[:12]}"
    CHARGES.append({"payment": payment, "idempotency_key": idempotency_key})
    delay = delay_ms or int(os.environ.get("MCP_CHARGE_DELAY_MS", "0"))
    if delay:
        await asyncio.sleep(delay / 1000)
    return {"payment": payment, "execution": n, "amount": amount, "currency": currency}


@server.tool(
    description="The balance (read only).",
    annotations=ToolAnnotations(readOnlyHint=True, idempotentHint=True),
)
async def balance(currency: str) -> dict:
    COUNTS["balance"] += 1
    return {"currency": currency, "available": 100000}


@server.tool(description="Charge a card, then fail with an MCP error: the payment is made each time it runs.")
async def charge_then_fail(amount: int, currency: str, code: int = -32600, idempotency_key: str | None = None) -> dict:
    COUNTS["charge_then_fail"] += 1
    raise MCPError(code=code, message=f"charged {amount} {currency}, then failed")


class Confirmation(BaseModel):
    confirm: bool


async def ask_to_confirm(amount: int, currency: str) -> Elicit[Confirmation]:
    return Elicit(f"Charge {amount} {currency}?", Confirmation)


@server.tool(description="Charge a card once the user confirms: asks first (2026-07-28: an InputRequiredResult).")
async def confirm_charge(
    amount: int,
    currency: str,
    confirmation: Annotated[Confirmation, Resolve(ask_to_confirm)],
    idempotency_key: str | None = None,
) -> dict:
    COUNTS["confirm_charge"] += 1
    n = COUNTS["confirm_charge"]
    payment = f"pay_{n}_{uuid.uuid4().hex[:12]}"
    return {"payment": payment, "execution": n, "amount": amount, "currency": currency,
            "confirmed": confirmation.confirm}


@server.custom_route("/count", methods=["GET"])
async def count(_: Request) -> JSONResponse:
    return JSONResponse(COUNTS)


@server.custom_route("/charges", methods=["GET"])
async def charges(_: Request) -> JSONResponse:
    return JSONResponse({"charges": CHARGES})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--json", action="store_true", help="answer application/json instead of SSE")
    p.add_argument("--stateful", action="store_true", help="sessions (initialize + Mcp-Session-Id)")
    a = p.parse_args()
    app = server.streamable_http_app(
        json_response=a.json,
        stateless_http=not a.stateful,
        # Envoy forwards the client's Host (127.0.0.1:<Envoy's port>); nothing to protect on loopback.
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", a.port))
    print(f"listening {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
