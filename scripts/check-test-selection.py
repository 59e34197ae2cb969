#!/usr/bin/env python3
"""Fails when a test would silently not run: the integration tests are one crate (tests/it/main.rs)
and `make` selects them by module (`make test-faults`: faults::, `make test-envoy-versions`:
single_proxy:: two_proxies::, `make test-native`: everything but faults::), so this checks what
name lists used to hide.

    scripts/check-test-selection.py [--skip PATTERN]... FILTER...   # what the target gives libtest
    scripts/check-test-selection.py --skip PATTERN...                # everything but PATTERN

It reads every `#[test]` function under tests/it/ with the module its file makes (tests/it/x/y.rs
is `x::y`), asks the test binary what exists (`cargo test --test it -- --list`) and what the run
selects (`--list FILTER... --skip PATTERN...`), and fails when
- a test function is not in the binary (a file no `mod` declares never compiles, so never runs);
- a FILTER matches no test function in the tree (a module renamed, a filter left behind);
- the run selects fewer tests than the tree holds that libtest's rule (a name containing a FILTER
  and no PATTERN) gives it, or none: the count each selection must reach comes from the tree;
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


def selects(name, filters, skips):
    """libtest's rule without --exact: some filter (or none given) is in the name, no skip is."""
    return (not filters or any(f in name for f in filters)) and not any(k in name for k in skips)


def main():
    args, filters, skips = sys.argv[1:], [], []
    while args:
        a = args.pop(0)
        if a == "--skip" and args:
            skips.append(args.pop(0))
        elif a.startswith("-"):
            sys.exit(__doc__)
        else:
            filters.append(a)
    if not filters and not skips:
        sys.exit(__doc__)
    selection = " ".join(filters + [f"--skip {k}" for k in skips])
    errors = []
    strays = sorted(p.name for p in (ROOT / "tests").glob("*.rs"))
    if strays:
        errors.append(f"tests/{', tests/'.join(strays)}: move into tests/it/ and declare in tests/it/main.rs")
    every = listed()
    names = set(every)
    sources = source_tests()
    # Each test function by its name in the binary (or by its file's module path, if missing).
    resolved = []
    for parts, name, path in sources:
        prefix = "::".join(parts) + "::" if parts else ""
        if prefix + name in names:
            resolved.append(prefix + name)
            continue
        # A test a macro or an inline module makes sits deeper under its file's module.
        deeper = [n for n in every if n.startswith(prefix) and n.endswith("::" + name)]
        if not deeper:
            errors.append(f"{path.relative_to(ROOT)}: {name} is not in the test binary (is its module declared?)")
        resolved.append(deeper[0] if deeper else prefix + name)
    for f in filters:
        if not any(f in n for n in resolved):
            errors.append(f"the filter {f} matches no #[test] under tests/it (a module renamed?)")
    expected = sum(selects(n, filters, skips) for n in resolved)
    selected = listed(*filters, *[a for k in skips for a in ("--skip", k)])
    if not selected or len(selected) < expected:
        errors.append(f"the run ({selection}) selects {len(selected)} tests; the tree under tests/it holds {expected} it should")
    for e in errors:
        print(f"check-test-selection: {e}", file=sys.stderr)
    if errors:
        sys.exit(1)
    print(
        f"check-test-selection: {len(every)} tests in tests/it, each in the binary; "
        f"the run ({selection}) selects {len(selected)}, the tree holds {expected} it should"
    )


if __name__ == "__main__":
    main()
