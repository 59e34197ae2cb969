#!/usr/bin/env python3
"""The `idemgate_store` cluster of the shipped envoy/etcd/envoy.yaml, its members swapped for the
client ports given: the demo (scripts/demo.sh) and the benchmark (scripts/bench.py) use the
shipped cluster itself (health checks, timeouts, balancing), as the tests do
(tests/it/support/etcd.rs), rather than a copy of it.

    scripts/etcd_store_cluster.py PORT [PORT ...]   # prints the cluster (a YAML list item)
"""
import os
import sys

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "envoy", "etcd", "envoy.yaml")
START = "  - name: idemgate_store\n"


def cluster(ports):
    """The shipped cluster's text (indented as in the shipped file, under `clusters:`), one
    endpoint per port. Fails if the shipped file no longer has the shape read here."""
    text = open(SHIPPED).read()
    if text.count(START) != 1:
        sys.exit(f"{SHIPPED}: no single '{START.strip()}' list item")
    lines = text[text.index(START):].splitlines(keepends=True)
    block = [lines[0]]
    for line in lines[1:]:
        # The item ends at the next line as shallow as its dash (another cluster, or a top-level key).
        if line.strip() and len(line) - len(line.lstrip()) <= 2:
            break
        block.append(line)
    endpoints = [i for i, l in enumerate(block) if l.lstrip().startswith("- endpoint:")]
    if not endpoints or endpoints != list(range(endpoints[0], endpoints[-1] + 1)):
        sys.exit(f"{SHIPPED}: the idemgate_store cluster's endpoints are not one list")
    pad = block[endpoints[0]][: len(block[endpoints[0]]) - len(block[endpoints[0]].lstrip())]
    members = [f"{pad}- endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {int(p)}}}}}}}\n" for p in ports]
    return "".join(block[: endpoints[0]] + members + block[endpoints[-1] + 1:]).rstrip("\n") + "\n"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(cluster(sys.argv[1:]), end="")
