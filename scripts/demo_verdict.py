"""What the two demo agents (scripts/agent_sim.py over HTTP, scripts/mcp_agent_sim.py over MCP)
share: the key an operation is given, and the closing lines `make demo` and `make test-demo` judge.
No dependencies: each agent runs under its own Python (the MCP one in target/mcp-venv)."""

import hashlib
import time


def key_for(task, step):
    """The wrapper's key: stable for one operation, never invented by the model."""
    return "agent-" + hashlib.sha256(f"{task}/{step}".encode()).hexdigest()[:32]


def finish(say, store, guarded, raw, started):
    """Prints the comparison and the closing line; returns the exit code (0: every operation
    executed exactly once through idemgate). `guarded` is (operations, executions, attempts)
    through idemgate, `raw` (operations, executions) straight to the API."""
    ops, execs, attempts = guarded
    ops_raw, execs_raw = raw
    say("")
    say(f"without idemgate: {ops_raw} operations -> {execs_raw} executions ({execs_raw - ops_raw} duplicate charges)")
    verdict = "every operation executed exactly once" if execs == ops else "SOME OPERATION DID NOT EXECUTE EXACTLY ONCE"
    say(
        f"idemgate demo ({store} store): {ops} operations requested, {execs} executions, {attempts - execs} retries absorbed "
        f"({verdict}; without idemgate {execs_raw} executions) in {time.monotonic() - started:.1f} s"
    )
    return 0 if execs == ops else 1
