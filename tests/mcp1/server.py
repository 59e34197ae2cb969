"""A counting MCP server on the official Python SDK's last 1.x line (`mcp`, pinned in
tests/mcp1/requirements.txt), for tests/it/mcp_sdk.rs: nothing of ours but the tool.

Streamable HTTP at /mcp through the SDK's own session manager, stateful by default (initialize +
Mcp-Session-Id) or --stateless, answering `application/json` (--json) or `text/event-stream`.
Its transport answers the requests it refuses with a JSON-RPC error whose id is the string
"server-error" (mcp/server/streamable_http.py `_create_error_response`,
mcp/server/streamable_http_manager.py `_error_response`).

Tools:
  charge(amount, currency, idempotency_key=None)  counts each execution.
GET /count answers {"charge": n}.

Prints `listening <port>` on stdout once the port is bound (--port 0 picks one).
"""

import argparse
import socket
import sys
import uuid

import uvicorn
from mcp.server.fastmcp import FastMCP
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import Request
from starlette.responses import JSONResponse

COUNTS = {"charge": 0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--json", action="store_true", help="answer application/json instead of SSE")
    p.add_argument("--stateless", action="store_true", help="no sessions")
    a = p.parse_args()
    server = FastMCP(
        "idemgate-test-payments-1x",
        json_response=a.json,
        stateless_http=a.stateless,
        # Envoy forwards the client's Host (127.0.0.1:<Envoy's port>); nothing to protect on loopback.
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )

    @server.tool(description="Charge a card: executes a payment each time it runs.")
    async def charge(amount: int, currency: str, idempotency_key: str | None = None) -> dict:
        COUNTS["charge"] += 1
        n = COUNTS["charge"]
        return {"payment": f"pay_{n}_{uuid.uuid4().hex[:12]}", "execution": n, "amount": amount}

    @server.custom_route("/count", methods=["GET"])
    async def count(_: Request) -> JSONResponse:
        return JSONResponse(COUNTS)

    app = server.streamable_http_app()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", a.port))
    print(f"listening {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
