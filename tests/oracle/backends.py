#!/usr/bin/env python3
"""The oracle's Python backends (tests/it/boundary_oracle.rs): one tiny app per framework, each on
its framework's own server with its defaults, listening on 127.0.0.1:PORT.

usage: backends.py flask|django|fastapi|simdjson PORT

Every app has the same two routes, `/v1/payments` and `/v2/orders/<id>`, and one handler: it
counts an execution and answers 201 with what it read (the route that ran, the method, the path,
the host, the caller's headers `authorization` and `x-caller`, the key headers `idempotency-key`
and `x-op`, the query and the body as the framework parses it: a JSON body (a JSON content type)
as the framework parses JSON, any other as the framework parses a form, reported as
`{"form": {name: [values in the order sent]}, "files": {name: [[filename, sha256 of the content]]}}`
(empty when the framework parsed no form from it: what a handler reading fields by name sees; a
multipart/form-data body's text fields in `form`, its files, each in the order sent, in `files`). `GET /__count` answers the
number of executions. Anything else is the framework's own 404 (or redirect): nothing executes.
A body the framework parsed as a JSON-RPC request (an object with a `method`: the oracle's MCP
configuration) is answered as an MCP server answers a call: what was read is the `result` of a
JSON-RPC response with the request's `id` (what idemgate takes for the call's completion).

`simdjson` is not on the panel: the standard library's HTTP server reading a JSON body with
pysimdjson's documented `Parser().parse(body)` (simdjson's on-demand API), which runs the FIRST
of a member named twice (`{"a":1,"a":2}` reads `a` as 1) where every parser on the panel runs the
last. It is the first-value reader of docs/limitations.md
(`boundary_oracle::a_json_body_naming_a_member_twice_is_refused_before_a_first_value_backend`).
"""
import hashlib
import json
import sys
import threading

kind, port = sys.argv[1], int(sys.argv[2])
count = 0
lock = threading.Lock()


def executed():
    global count
    with lock:
        count += 1


def sha(data):
    return hashlib.sha256(data).hexdigest()


def report(route, params, method, path, host, headers, query, body):
    def one(name):
        # Every value of the header, in order, as the framework hands them over.
        return headers(name)
    r = {
        "route": route, "params": params, "method": method, "path": path, "host": host,
        "authorization": one("authorization"), "x-caller": one("x-caller"),
        "idempotency-key": one("idempotency-key"), "x-op": one("x-op"),
        "query": query, "body": body,
    }
    if isinstance(body, dict) and "method" in body:
        return {"jsonrpc": "2.0", "id": body.get("id"), "result": r}
    return r


if kind == "flask":
    from flask import Flask, request
    from werkzeug.serving import run_simple

    app = Flask(__name__)

    def read(route, params):
        executed()
        body = request.get_json(silent=True)
        if not request.is_json:
            files = {k: [[f.filename, sha(f.read())] for f in fs] for k, fs in request.files.lists()}
            body = {"form": request.form.to_dict(flat=False), "files": files}
        q = sorted((k, v) for k, vs in request.args.lists() for v in vs)
        r = report(route, params, request.method, request.path, request.host,
                   lambda n: request.headers.getlist(n), q, body)
        return app.response_class(json.dumps(r), status=201, mimetype="application/json")

    METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]

    @app.route("/v1/payments", methods=METHODS)
    def payments():
        return read("payments", {})

    @app.route("/v2/orders/<oid>", methods=METHODS)
    def orders(oid):
        return read("orders", {"id": oid})

    @app.route("/__count")
    def get_count():
        return {"count": count}

    print(f"PORT {port}", flush=True)
    run_simple("127.0.0.1", port, app, threaded=True)

elif kind == "django":
    from django.conf import settings

    settings.configure(DEBUG=False, ROOT_URLCONF=__name__, ALLOWED_HOSTS=["*"], SECRET_KEY="oracle",
                       MIDDLEWARE=[], INSTALLED_APPS=[])
    import django
    django.setup()
    from django.http import HttpResponse, JsonResponse
    from django.urls import path as upath
    from django.core.handlers.wsgi import WSGIHandler
    from django.core.servers.basehttp import run

    def read(request, route, params):
        executed()
        try:
            body = json.loads(request.body) if "json" in (request.content_type or "").lower() else None
        except ValueError:
            body = None
        if "json" not in (request.content_type or "").lower():
            files = {k: [[f.name, sha(f.read())] for f in fs] for k, fs in request.FILES.lists()}
            body = {"form": dict(request.POST.lists()), "files": files}
        q = sorted((k, v) for k, vs in request.GET.lists() for v in vs)
        def hdr(n):
            v = request.headers.get(n)
            return [] if v is None else [v]
        r = report(route, params, request.method, request.path, request.get_host(), hdr, q, body)
        return HttpResponse(json.dumps(r), status=201, content_type="application/json")

    urlpatterns = [
        upath("v1/payments", lambda r: read(r, "payments", {})),
        upath("v2/orders/<str:oid>", lambda r, oid: read(r, "orders", {"id": oid})),
        upath("__count", lambda r: JsonResponse({"count": count})),
    ]
    print(f"PORT {port}", flush=True)
    run("127.0.0.1", port, WSGIHandler(), threading=True)

elif kind == "fastapi":
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    import uvicorn

    app = FastAPI()
    METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]

    async def read(request: Request, route, params):
        executed()
        raw = await request.body()
        try:
            body = json.loads(raw) if "json" in request.headers.get("content-type", "").lower() else None
        except ValueError:
            body = None
        if "json" not in request.headers.get("content-type", "").lower():
            # Starlette's form parsers (python-multipart's, for a urlencoded or multipart body).
            form, files = {}, {}
            for k, v in (await request.form()).multi_items():
                if isinstance(v, str):
                    form.setdefault(k, []).append(v)
                else:
                    files.setdefault(k, []).append([v.filename, sha(await v.read())])
            body = {"form": form, "files": files}
        q = sorted(request.query_params.multi_items())
        r = report(route, params, request.method, request.url.path, request.headers.get("host"),
                   lambda n: request.headers.getlist(n), q, body)
        return JSONResponse(r, status_code=201)

    @app.api_route("/v1/payments", methods=METHODS)
    async def payments(request: Request):
        return await read(request, "payments", {})

    @app.api_route("/v2/orders/{oid}", methods=METHODS)
    async def orders(request: Request, oid: str):
        return await read(request, "orders", {"id": oid})

    @app.get("/__count")
    async def get_count():
        return {"count": count}

    print(f"PORT {port}", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
elif kind == "simdjson":
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import parse_qsl, urlsplit
    import simdjson

    def first_values(v):
        # `doc[name]` is the first member of that name; `as_dict()` would build a dict (the last).
        if isinstance(v, simdjson.Object):
            return {k: first_values(v[k]) for k in v.keys()}
        if isinstance(v, simdjson.Array):
            return [first_values(x) for x in v]
        return v

    class Handler(BaseHTTPRequestHandler):
        def answer(self, status, doc):
            out = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def run(self):
            url = urlsplit(self.path)
            if url.path == "/__count":
                return self.answer(200, {"count": count})
            if url.path == "/v1/payments":
                route, params = "payments", {}
            elif url.path.startswith("/v2/orders/") and "/" not in url.path[len("/v2/orders/"):]:
                route, params = "orders", {"id": url.path[len("/v2/orders/"):]}
            else:
                return self.answer(404, {})
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            executed()
            try:
                # One parser per request: a document lives as long as its parser's next parse.
                body = first_values(simdjson.Parser().parse(raw))
            except ValueError:
                body = None
            q = sorted(parse_qsl(url.query, keep_blank_values=True))
            r = report(route, params, self.command, url.path, self.headers.get("host"),
                       lambda n: self.headers.get_all(n) or [], q, body)
            self.answer(201, r)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = run

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"PORT {port}", flush=True)
    server.serve_forever()
else:
    sys.exit(f"unknown backend {kind}")
