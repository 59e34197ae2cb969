"""The oracle's MCP server backend (tests/it/boundary_oracle.rs, `mcp*` configurations only): the
official MCP Python SDK (`mcp`, pinned in tests/mcp/requirements.txt, venv target/mcp-venv) and
nothing of ours but one tool and what it reports.

usage: mcp_backend.py PORT

Streamable HTTP, stateless (no Mcp-Session-Id), the SDK's default answers (`text/event-stream`:
each `tools/call` is answered as an SSE stream carrying the JSON-RPC response), mounted on the
panel's two routes, `/v1/payments` and `/v2/orders/{id}`, with DNS rebinding protection off (the
oracle sends hosts such as `xn--bcher-kva.test`). One tool, `charge(amount: int, currency: str,
idempotency_key: str | None = None)`, as tests/mcp/server.py declares it: it counts an execution
and returns (as its structured content) what it read, in the fields the other backends report:
the route that ran and its parameters, the method, the path, the host, the headers
`authorization`, `x-caller`, `idempotency-key` and `x-op`, the query, and as `body` the call as
the SDK read it: the JSON-RPC id, the method, the tool's name, the arguments as the tool received
them (after the SDK validated them against its signature) and the request's `_meta`. `GET /__count`
answers the number of executions. Anything else is Starlette's 404 (or the SDK's own refusal):
nothing executes.
"""
import socket
import sys

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

port = int(sys.argv[1])
count = 0

server = MCPServer("idemgate-oracle")


@server.tool(description="Charge a card: executes a payment each time it runs.")
async def charge(amount: int, currency: str, ctx: Context, idempotency_key: str | None = None) -> dict:
    global count
    count += 1
    rc = ctx.request_context
    request = rc.request
    arguments = {"amount": amount, "currency": currency}
    if idempotency_key is not None:
        arguments["idempotency_key"] = idempotency_key
    params = {"name": (rc.params or {}).get("name"), "arguments": arguments}
    if rc.meta is not None:
        params["_meta"] = dict(rc.meta)
    body = {"jsonrpc": "2.0", "id": rc.request_id, "method": rc.method, "params": params}
    path_params = dict(request.path_params)
    return {
        "route": "orders" if "oid" in path_params else "payments",
        "params": {"id": path_params["oid"]} if "oid" in path_params else {},
        "method": request.method,
        "path": request.url.path,
        "host": request.headers.get("host"),
        "authorization": request.headers.getlist("authorization"),
        "x-caller": request.headers.getlist("x-caller"),
        "idempotency-key": request.headers.getlist("idempotency-key"),
        "x-op": request.headers.getlist("x-op"),
        "query": sorted(request.query_params.multi_items()),
        "body": body,
    }


async def get_count(_: Request) -> JSONResponse:
    return JSONResponse({"count": count})


app = server.streamable_http_app(
    streamable_http_path="/v1/payments",
    stateless_http=True,
    transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
)
# The SDK's route's endpoint (its Streamable HTTP ASGI app) on the orders route too.
mcp_endpoint = next(r.endpoint for r in app.routes if getattr(r, "path", None) == "/v1/payments")
app.router.routes.append(Route("/v2/orders/{oid}", endpoint=mcp_endpoint))
app.router.routes.append(Route("/__count", endpoint=get_count))

sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", port))
print(f"PORT {port}", flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)).run(sockets=[sock])
