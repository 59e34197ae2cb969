"""What the two demo agents (scripts/agent_sim.py over HTTP, scripts/mcp_agent_sim.py over MCP)
share: the key an operation is given, and the closing lines `make demo` and `make test-demo` judge.
No dependencies: each agent runs under its own Python (the MCP one in target/mcp-venv).

`python3 scripts/demo_verdict.py` checks the verdict itself on crafted runs (one operation twice and
another never, an execution of no operation, a charge that gave up) and exits 0 only if each is
judged a failure and a clean run is not."""

import hashlib
import sys
import time
from collections import Counter


def key_for(task, step):
    """The wrapper's key: stable for one operation, never invented by the model."""
    return "agent-" + hashlib.sha256(f"{task}/{step}".encode()).hexdigest()[:32]


def problems(ops, executed, gave_up, answers=(), listed=None):
    """What is wrong with one run, by operation. `ops` maps each requested operation's key to its
    name ("task-1/step-2"), `executed` is the key of every execution the API lists (None for an
    execution without one), `gave_up` the names of the operations whose charge the agent gave up
    on, `answers` every (key, id) the agent accepted as an operation's answer, and `listed` the
    id of every execution the API lists by its key. Empty: every operation executed exactly once,
    every charge got its answer, and every answer was its own operation's execution (a replay of
    another operation's response would pass the counts alone)."""
    seen = Counter(executed)
    out = [f"{name} executed {seen[key]} times" for key, name in ops.items() if seen[key] != 1]
    out += [f"{n} execution(s) of no requested operation (key {key})" for key, n in seen.items() if key not in ops]
    out += [f"{name}: the agent gave up (no answer it could use)" for name in gave_up]
    for key, got in answers:
        own = (listed or {}).get(key, [])
        if got not in own:
            out.append(f"{ops.get(key, key)} was answered with {got}, which is not its execution ({own})")
    return out


def finish(say, store, guarded, raw, started):
    """Prints the comparison and the closing line; returns the exit code (0: through idemgate,
    every operation executed exactly once, by its key in the API's listing, and no charge gave
    up). `guarded` is (ops, executed, attempts, gave_up) through idemgate, as `problems` reads
    them; `raw` (ops, executed) straight to the API."""
    ops, executed, attempts, gave_up = guarded[:4]
    answers, listed = guarded[4:6] if len(guarded) >= 6 else ((), None)
    ops_raw, executed_raw = raw
    wrong = problems(ops, executed, gave_up, answers, listed)
    say("")
    say(
        f"without idemgate: {len(ops_raw)} operations -> {len(executed_raw)} executions "
        f"({len(executed_raw) - len(ops_raw)} duplicate charges)"
    )
    for line in wrong:
        say(f"  NOT EXACTLY ONCE: {line}")
    verdict = "SOME OPERATION DID NOT EXECUTE EXACTLY ONCE" if wrong else "every operation executed exactly once"
    say(
        f"idemgate demo ({store} store): {len(ops)} operations requested, {len(executed)} executions, "
        f"{attempts - len(executed)} retries absorbed "
        f"({verdict}; without idemgate {len(executed_raw)} executions) in {time.monotonic() - started:.1f} s"
    )
    return 1 if wrong else 0


def self_check():
    ops = {key_for("t", f"s{i}"): f"t/s{i}" for i in (1, 2, 3)}
    k1, k2, k3 = ops
    cases = [
        ("clean", [k1, k2, k3], [], 0),
        ("one twice, one never (same total)", [k1, k1, k3], [], 1),
        ("an execution of no operation", [k1, k2, k3, None], [], 1),
        ("a charge that gave up", [k1, k2, k3], ["t/s2"], 1),
    ]
    listed = {k1: ["c1"], k2: ["c2"], k3: ["c3"]}
    answered = [
        ("every answer its own execution", [(k1, "c1"), (k2, "c2"), (k3, "c3")], 0),
        ("an operation answered with another's execution", [(k1, "c1"), (k2, "c1"), (k3, "c3")], 1),
        ("an answer that is no execution", [(k1, "c1"), (k2, "c9"), (k3, "c3")], 1),
    ]
    cases += [(name, [k1, k2, k3], [], want, answers) for name, answers, want in answered]
    bad = 0
    for name, executed, gave_up, want, *answers in cases:
        lines = []
        guarded = (ops, executed, 3 + len(executed), gave_up) + ((answers[0], listed) if answers else ())
        code = finish(lines.append, "check", guarded, (ops, executed), time.monotonic())
        print(f"{'ok  ' if code == want else 'FAIL'} {name}: exit {code} (want {want}): {lines[-1]}")
        bad += code != want
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(self_check())
