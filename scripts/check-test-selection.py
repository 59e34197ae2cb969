#!/usr/bin/env python3
"""Fails when a test would silently not run: the integration tests are one crate (tests/it/main.rs)
and `make test-faults` selects them by module, so this checks what name lists used to hide.

    scripts/check-test-selection.py FILTER...   # the arguments make test-faults gives libtest

It reads every `#[test]` function under tests/it/ with the module its file makes (tests/it/x/y.rs
is `x::y`), asks the test binary what exists (`cargo test --test it -- --list`) and what the fault
run selects (`--list FILTER...`), and fails when
- a test function is not in the binary (a file no `mod` declares never compiles, so never runs);
- the fault run selects fewer tests than the modules named `faults` hold, or none;
- a tests/*.rs file exists: cargo would build it as a separate binary, outside the one crate.
"""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
IT = ROOT / "tests" / "it"


def module_of(path):
    parts = list(path.relative_to(IT).with_suffix("").parts)
    if parts[-1] in ("main", "mod"):
        parts.pop()
    return parts


def source_tests():
    """(module parts, fn name) of every #[test] function under tests/it/."""
    found = []
    for path in sorted(IT.rglob("*.rs")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != "#[test]":
                continue
            for nxt in lines[i + 1 :]:
                m = re.match(r"\s*(?:pub(?:\([^)]*\))?\s+)?fn\s+(\w+)", nxt)
                if m:
                    found.append((module_of(path), m.group(1), path))
                    break
                if not re.match(r"\s*(#\[|//)", nxt):
                    sys.exit(f"check-test-selection: {path}:{i + 1}: #[test] not followed by a fn")
    return found


def listed(*args):
    out = subprocess.run(
        ["cargo", "test", "--locked", "--test", "it", "--", "--list", *args],
        cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True,
    ).stdout
    return [line[: -len(": test")] for line in out.splitlines() if line.endswith(": test")]


def main():
    filters = sys.argv[1:]
    if not filters:
        sys.exit(__doc__)
    errors = []
    strays = sorted(p.name for p in (ROOT / "tests").glob("*.rs"))
    if strays:
        errors.append(f"tests/{', tests/'.join(strays)}: move into tests/it/ and declare in tests/it/main.rs")
    every = listed()
    names = set(every)
    sources = source_tests()
    for parts, name, path in sources:
        prefix = "::".join(parts) + "::" if parts else ""
        # A test a macro or an inline module makes sits deeper under its file's module.
        if prefix + name not in names and not any(n.startswith(prefix) and n.endswith("::" + name) for n in names):
            errors.append(f"{path.relative_to(ROOT)}: {name} is not in the test binary (is its module declared?)")
    in_faults = [s for s in sources if "faults" in s[0]]
    selected = listed(*filters)
    if not selected or len(selected) < len(in_faults):
        errors.append(
            f"the fault run ({' '.join(filters)}) selects {len(selected)} tests; "
            f"the modules named faults hold {len(in_faults)}"
        )
    for e in errors:
        print(f"check-test-selection: {e}", file=sys.stderr)
    if errors:
        sys.exit(1)
    print(
        f"check-test-selection: {len(every)} tests in tests/it, each in the binary; "
        f"the fault run ({' '.join(filters)}) selects {len(selected)}, the modules named faults hold {len(in_faults)}"
    )


if __name__ == "__main__":
    main()
