"""The command line every tests/sdk/*_call.py script takes (tests/it/sdk_clients.rs builds it):

    --base http://127.0.0.1:PORT [--key K] [--amount 4200] [--retries 2] [--timeout 30]
    [--header "name: value"]...

`--key` is the call's idempotency key (absent: the SDK's own, if it sends one); `--amount` varies
the body (another amount under the same key is a changed body); `--retries` the SDK's retries;
`--timeout` its request timeout in seconds; `--header` adds test knobs (`x-up-*`) as per-request
headers. `parse` returns the arguments and the headers as a dict.
"""
import argparse


def parse(describe=None):
    """Parses sys.argv; `describe(parser)` adds a script's own arguments first."""
    ap = argparse.ArgumentParser()
    if describe is not None:
        describe(ap)
    ap.add_argument("--base", required=True)
    ap.add_argument("--key")
    ap.add_argument("--amount", type=int, default=4200)
    ap.add_argument("--retries", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30)
    ap.add_argument("--header", action="append", default=[])
    a = ap.parse_args()
    return a, dict(h.split(": ", 1) for h in a.header)
