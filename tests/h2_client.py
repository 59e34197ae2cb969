#!/usr/bin/env python3
"""HTTP/2 (prior knowledge, h2c) client for tests/it/faults/hostile.rs: opens ONE connection to
127.0.0.1:PORT and sends N concurrent POST streams with the given headers and body, then prints
one line per stream: "<stream id> <status> <idempotent-replayed or ->". An argument written
`@name:value` is sent as a request trailer (a HEADERS frame after the body that ends the stream).

usage: h2_client.py PORT N PATH BODY [name:value | @name:value | :authority=value ...]

`:authority=value` sends that :authority instead of idemgate.test.
"""
import socket
import sys

import h2.config
import h2.connection
import h2.events

port, n, path, body = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4].encode()
authority = next((h.split("=", 1)[1] for h in sys.argv[5:] if h.startswith(":authority=")), "idemgate.test")
extra = [tuple(h.split(":", 1)) for h in sys.argv[5:] if not h.startswith(("@", ":authority="))]
trailers = [tuple(h[1:].split(":", 1)) for h in sys.argv[5:] if h.startswith("@")]
sock = socket.create_connection(("127.0.0.1", port), timeout=10)
conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
conn.initiate_connection()
streams = []
for _ in range(n):
    sid = conn.get_next_available_stream_id()
    headers = [(":method", "POST"), (":path", path), (":scheme", "http"), (":authority", authority),
               ("content-length", str(len(body)))] + [(k.strip().lower(), v.strip()) for k, v in extra]
    conn.send_headers(sid, headers)
    conn.send_data(sid, body, end_stream=not trailers)
    if trailers:
        conn.send_headers(sid, [(k.strip().lower(), v.strip()) for k, v in trailers], end_stream=True)
    streams.append(sid)
sock.sendall(conn.data_to_send())
status, replayed, done = {}, {}, set()
while len(done) < n:
    data = sock.recv(65536)
    if not data:
        break
    for ev in conn.receive_data(data):
        if isinstance(ev, h2.events.ResponseReceived):
            h = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v for k, v in ev.headers}
            status[ev.stream_id] = h.get(":status", "?")
            replayed[ev.stream_id] = h.get("idempotent-replayed", "-")
        elif isinstance(ev, h2.events.DataReceived):
            conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
            done.add(ev.stream_id)
    sock.sendall(conn.data_to_send())
for sid in streams:
    print(sid, status.get(sid, "none"), replayed.get(sid, "-"))
