#!/usr/bin/env python3
"""A real gRPC peer for tests/it/grpc.rs (grpcio, no generated code: raw bytes in and out).

  grpc_peer.py serve EXECUTIONS_FILE
      A unary server on 127.0.0.1 (h2c) answering /pay.Payments/Charge with b"charged:" + the
      request bytes; each execution appends one line to EXECUTIONS_FILE. Prints its port, then
      serves until stdin closes.
  grpc_peer.py call PORT [name:value ...]
      One unary call to /pay.Payments/Charge through 127.0.0.1:PORT (h2c) with the given metadata;
      prints one JSON line: {"code", "details", "response" (hex or null), "trailers"}.
"""
import json
import sys
from concurrent import futures

import grpc

METHOD = "/pay.Payments/Charge"


def serve(executions_file):
    def charge(request, context):
        with open(executions_file, "a") as f:
            f.write("1\n")
        return b"charged:" + request

    handler = grpc.method_handlers_generic_handler(
        "pay.Payments", {"Charge": grpc.unary_unary_rpc_method_handler(charge)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    server.stop(0)


def call(port, metadata):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        charge = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        try:
            response, c = charge.with_call(b"\x08\x05amount-5", metadata=metadata, timeout=10)
            out = {"code": c.code().name, "details": c.details(), "response": response.hex(),
                   "trailers": [list(m) for m in c.trailing_metadata() or []]}
        except grpc.RpcError as e:
            out = {"code": e.code().name, "details": e.details(), "response": None,
                   "trailers": [[k, v if isinstance(v, str) else v.hex()] for k, v in e.trailing_metadata() or []]}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        call(int(sys.argv[2]), [tuple(h.split(":", 1)) for h in sys.argv[3:]])
