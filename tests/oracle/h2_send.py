#!/usr/bin/env python3
"""One HTTP/2 request (h2c, prior knowledge) for tests/it/boundary_oracle.rs: the request is a JSON
object {method, path, authority, headers: [[name, value]...], body} (argv[2]); prints one JSON line
{status, headers, body}. Header names are sent as given (HTTP/2 wants them lowercase).

usage: h2_send.py PORT REQUEST_JSON
"""
import json
import socket
import sys

import h2.config
import h2.connection
import h2.events

port, req = int(sys.argv[1]), json.loads(sys.argv[2])
body = req["body"].encode()
sock = socket.create_connection(("127.0.0.1", port), timeout=60)
conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding=None,
                                                                     validate_outbound_headers=False,
                                                                     normalize_outbound_headers=False))
conn.initiate_connection()
sid = conn.get_next_available_stream_id()
headers = [(":method", req["method"]), (":path", req["path"]), (":scheme", "http"),
           (":authority", req["authority"])] + [(k, v) for k, v in req["headers"]]
conn.send_headers(sid, [(k.encode(), v.encode()) for k, v in headers], end_stream=not body)
if body:
    conn.send_data(sid, body, end_stream=True)
sock.sendall(conn.data_to_send())
status, resp_headers, data, done = 0, [], b"", False
while not done:
    chunk = sock.recv(65536)
    if not chunk:
        break
    for ev in conn.receive_data(chunk):
        if isinstance(ev, h2.events.ResponseReceived):
            for k, v in ev.headers:
                k, v = k.decode(), v.decode()
                if k == ":status":
                    status = int(v)
                else:
                    resp_headers.append([k, v])
        elif isinstance(ev, h2.events.DataReceived):
            data += ev.data
            conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
            done = True
    sock.sendall(conn.data_to_send())
print(json.dumps({"status": status, "headers": resp_headers, "body": data.decode("utf-8", "replace")}))
