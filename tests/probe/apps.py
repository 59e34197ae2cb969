"""Small APIs for tests/it/probe_gate.rs, each on a real PyPI idempotency library (or none).

    python apps.py KIND    # serves on 127.0.0.1:<free port>, prints "PORT <n>" once listening

Every app creates a charge on POST /charges (201 {"id": "ch_<n>", ...}, after PROBE_APP_DELAY seconds, default 1, so
concurrent duplicates overlap) and counts its executions: GET /count answers {"count": n, "requests": r} (r: every HTTP request the
server received, Starlette apps only) and
GET /charges lists the charges created (a JSON array). KIND:

  asgi-idempotency-header   IdempotencyHeaderMiddleware (memory backend), Starlette
  fastapi-idempotency-key   fastapi_idempotency_key.IdempotencyMiddleware (memory), Starlette
  fastapi-idempotency       fastapi_idempotency.IdempotencyMiddleware (memory store), Starlette
  django-idempotency-key    Django view with @idempotency_key and IdempotencyKeyMiddleware
  plain                     no idempotency at all (executes every request)
  constant                  no idempotency, and the same answer for every execution
  replay-exec               a broken idempotency layer: it executes every request, then answers a key it has seen with
                            the answer it stored for that key (looks like a replay, executes again)

PROBE_APP_TLS_CERT / PROBE_APP_TLS_KEY (PEM files): the Starlette apps serve HTTPS.
"""

import json
import os
import socket
import sys
import threading
import time

DELAY = float(os.environ.get("PROBE_APP_DELAY", "1.0"))
KIND = sys.argv[1]
state = {"count": 0, "charges": [], "requests": 0}
lock = threading.Lock()


def execute(body: bytes):
    with lock:
        state["count"] += 1
        n = state["count"]
    try:
        amount = json.loads(body or b"{}").get("amount")
    except (ValueError, AttributeError):
        amount = None
    charge = {"id": f"ch_{n}", "amount": amount}
    with lock:
        state["charges"].append(charge)
    if KIND == "constant":
        return 200, {"status": "accepted"}
    return 201, charge


def listen():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def serve_asgi():
    import asyncio

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    stored = {}

    async def charges(request):
        if request.method == "GET":
            return JSONResponse(state["charges"])
        body = await request.body()
        await asyncio.sleep(DELAY)
        status, doc = execute(body)
        key = request.headers.get("idempotency-key")
        if KIND == "replay-exec" and key is not None:
            # Executed above whatever the key; the first stored answer wins.
            status, doc = stored.setdefault(key, (status, doc))
        return JSONResponse(doc, status_code=status)

    async def count(_request):
        return JSONResponse({"count": state["count"], "requests": state["requests"]})

    app = Starlette(routes=[Route("/charges", charges, methods=["GET", "POST"]), Route("/count", count)])
    if KIND == "asgi-idempotency-header":
        from idempotency_header_middleware import IdempotencyHeaderMiddleware
        from idempotency_header_middleware.backends.memory import MemoryBackend

        app = IdempotencyHeaderMiddleware(app, backend=MemoryBackend())
    elif KIND == "fastapi-idempotency-key":
        from fastapi_idempotency_key import IdempotencyMiddleware

        app = IdempotencyMiddleware(app)
    elif KIND == "fastapi-idempotency":
        from fastapi_idempotency import IdempotencyMiddleware

        app = IdempotencyMiddleware(app)
    elif KIND not in ("plain", "constant", "replay-exec"):
        sys.exit(f"unknown app {KIND}")
    inner = app

    async def counted(scope, receive, send):
        # Every HTTP request that reached the server, refused by the library or not.
        if scope["type"] == "http":
            with lock:
                state["requests"] += 1
        await inner(scope, receive, send)

    app = counted
    sock = listen()
    tls = {}
    if os.environ.get("PROBE_APP_TLS_CERT"):
        tls = {"ssl_certfile": os.environ["PROBE_APP_TLS_CERT"], "ssl_keyfile": os.environ["PROBE_APP_TLS_KEY"]}
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, **tls))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])


def serve_django():
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

    import django
    from django.conf import settings
    from django.http import JsonResponse
    from django.urls import path

    from idempotency_key.decorators import idempotency_key

    @idempotency_key
    def charges(request):
        if request.method == "GET":
            return JsonResponse(state["charges"], safe=False)
        time.sleep(DELAY)
        status, doc = execute(request.body)
        return JsonResponse(doc, status=status)

    def count(_request):
        return JsonResponse({"count": state["count"]})

    global urlpatterns
    urlpatterns = [path("charges", charges), path("count", count)]
    settings.configure(
        DEBUG=False,
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        SECRET_KEY="probe-test",
        MIDDLEWARE=["idempotency_key.middleware.IdempotencyKeyMiddleware"],
        INSTALLED_APPS=[],
        CACHES={"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}},
    )
    django.setup()
    from django.core.wsgi import get_wsgi_application

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args):
            pass

    server = Server(("127.0.0.1", 0), Quiet)
    server.set_app(get_wsgi_application())
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


if KIND == "django-idempotency-key":
    serve_django()
else:
    serve_asgi()
