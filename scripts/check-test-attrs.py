#!/usr/bin/env python3
"""Fails on test attributes that make a green `make test` prove less than it says (`make lint`).

    scripts/check-test-attrs.py            # the tree
    scripts/check-test-attrs.py FILE...    # these files only (a sample to try the checks on)

1. A core module's tests must run on wasm32 too (`make test-wasm`): every `#[test]` in a module
   under src/ (not src/filter/, src/bin/, src/bench_host*) must be in a module that imports the
   alias exactly as the core does it,

       #[cfg(target_arch = "wasm32")]
       use wasm_bindgen_test::wasm_bindgen_test as test;

   so `#[test]` means wasm-bindgen-test's attribute on wasm32 and libtest's natively. A plain
   `#[test]` compiles on wasm32 and is silently never run there. Tests inside `proptest!` blocks
   are exempt (proptest's runner is native only; they sit in modules gated off wasm32), and so
   are the modules in WASM_EXCEPTIONS, each with the reason it cannot run on wasm32.
2. Every `#[ignore]` in src/, tests/, benches/ and fuzz/ must say why and what is left to do:
   `#[ignore = "..."]`, at least MIN_REASON characters, and no placeholder for a reason ("under
   investigation", "TODO", ...): an ignored test is a test `make test` does not run.
3. No test under tests/ reads with a bare `.read(...)` call: a receive on a socket with a timeout
   fails with EINTR when the process is stopped and continued (signal(7)), and a bare read turns
   that into a red suite (stop 49's CI). Tests read through `support::http::read_some`, which
   asks again; READ_EXEMPT lists the one place that calls `.read` itself.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

ALIAS_CFG = '#[cfg(target_arch = "wasm32")]'
ALIAS_USE = "use wasm_bindgen_test::wasm_bindgen_test as test;"

# Core modules whose tests cannot run on wasm32, with why. Each must still hold a plain #[test]
# (a stale entry fails too).
WASM_EXCEPTIONS = {
    "src/local/tests/interleavings.rs": "runs several workers on std threads with a Condvar scheduler; "
    "wasm32-unknown-unknown has no threads (declared #[cfg(not(target_arch = \"wasm32\"))] in src/local/tests.rs)",
}

# The one place under tests/ that calls `.read(` itself: the helper every other read goes through.
READ_EXEMPT = {"tests/it/support/mod.rs": "fn read_some"}
BARE_READ = re.compile(r"\.read\(\s*&mut\b|\.read\(\s*buf\b")

MIN_REASON = 40
PLACEHOLDERS = re.compile(
    r"under investigation|investigating|to be investigated|not yet understood|\btodo\b|\btbd\b|\bfixme\b|\bxxx\b",
    re.IGNORECASE,
)


def blank(text):
    """The text with comments, string and char literals' contents replaced by spaces (newlines
    kept), so braces and attributes are read from code only, at the same offsets."""
    out = list(text)
    i, n = 0, len(text)

    def wipe(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            wipe(i, j)
            i = j
        elif (m := re.compile(r'b?r(#*)"').match(text, i)) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = text.find('"' + m.group(1), m.end())
            end = n if end < 0 else end + 1 + len(m.group(1))
            wipe(m.end(), end - 1 - len(m.group(1)))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            wipe(i + 1, j)
            i = j + 1
        elif c == "'":
            m = re.compile(r"'(\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'])'").match(text, i)
            if m:
                wipe(i + 1, m.end() - 1)
                i = m.end()
            else:
                i += 1  # a lifetime or a label
        else:
            i += 1
    return "".join(out)


def line_of(text, pos):
    return text.count("\n", 0, pos) + 1


class Scope:
    def __init__(self, kind, parent=None, gated=False):
        self.kind, self.parent, self.gated = kind, parent, gated
        self.alias = self.globs_parent = False
        self.tests = []

    def module(self):
        s = self
        while s.kind != "mod":
            s = s.parent
        return s

    def runs_on_wasm(self):
        """Whether `#[test]` here is the alias on wasm32: imported here, or by `use super::*;`
        from an inline parent module that has it; never in a module gated off wasm32."""
        if self.gated:
            return False
        if self.alias:
            return True
        return self.globs_parent and self.parent is not None and self.parent.module().runs_on_wasm()


def plain_tests(path, text):
    """The lines of each #[test] that is libtest's on wasm32 too (so never runs there)."""
    code = blank(text)
    lines = text.splitlines()
    file_scope = Scope("mod")  # the file itself; a file module's own gate is in its parent's file
    stack, modules = [file_scope], [file_scope]
    last = 0  # where the text leading to the next brace starts
    pattern = r"[{};]|#\[test\]|use\s+super::\*\s*;|use\s+wasm_bindgen_test::wasm_bindgen_test\s+as\s+test\s*;"
    for m in re.finditer(pattern, code):
        tok = m.group(0)
        if tok == "{":
            lead = code[last : m.start()]
            if re.search(r"\bmod\s+\w+\s*$", lead):
                gated = 'not(target_arch = "wasm32")' in text[last : m.start()]
                stack.append(Scope("mod", stack[-1], gated))
                modules.append(stack[-1])
            elif re.search(r"\bproptest!\s*$", lead):
                stack.append(Scope("proptest", stack[-1]))
            else:
                stack.append(Scope("block", stack[-1]))
            last = m.end()
        elif tok == "}":
            if len(stack) > 1:
                stack.pop()
            last = m.end()
        elif tok == ";":
            last = m.end()
        elif tok == "#[test]":
            if not any(s.kind == "proptest" for s in stack):
                stack[-1].module().tests.append(line_of(text, m.start()))
        elif tok.startswith("use super"):
            if stack[-1].kind == "mod" and stack[-1] is not file_scope:
                stack[-1].globs_parent = True
            last = m.end()
        else:
            ln = line_of(text, m.start())
            prev = next((lines[k].strip() for k in range(ln - 2, -1, -1) if lines[k].strip()), "")
            if lines[ln - 1].strip() != ALIAS_USE or prev != ALIAS_CFG:
                sys.exit(
                    f"check-test-attrs: {path}:{ln}: the wasm test alias must read exactly\n"
                    f"    {ALIAS_CFG}\n    {ALIAS_USE}"
                )
            stack[-1].module().alias = True
            last = m.end()
    return sorted(t for s in modules if not s.runs_on_wasm() for t in s.tests)


def ignores(text):
    """(line, reason or None, raw attribute) of each #[ignore...] in code."""
    code = blank(text)
    for m in re.finditer(r"#\[ignore\b", code):
        end = code.find("]", m.end())
        attr = text[m.start() : end + 1]
        r = re.fullmatch(r'#\[ignore\s*=\s*"((?:[^"\\]|\\.)*)"\s*\]', attr, re.S)
        yield line_of(text, m.start()), (r.group(1) if r else None), attr


def is_core(rel):
    return rel.startswith("src/") and not re.match(r"src/(filter|bin|bench_host)(/|\.rs$)", rel)


def main():
    if sys.argv[1:]:
        files = [pathlib.Path(a).resolve() for a in sys.argv[1:]]
    else:
        files = sorted(
            p for d in ("src", "tests", "benches", "fuzz") for p in (ROOT / d).rglob("*.rs") if "target" not in p.parts
        )
    errors = []
    excepted = set()
    for path in files:
        try:
            rel = path.relative_to(ROOT).as_posix()
        except ValueError:
            rel = str(path)
        text = path.read_text()
        if is_core(rel) or sys.argv[1:]:
            plain = plain_tests(rel, text)
            if plain and rel in WASM_EXCEPTIONS:
                excepted.add(rel)
            elif plain:
                errors.append(
                    f"{rel}:{plain[0]}: {len(plain)} #[test] (lines {', '.join(map(str, plain))}) in a module without "
                    f"the wasm test alias (or gated off wasm32): they never run on wasm32 (make test-wasm). Add, after `use super::*;`:\n"
                    f"    {ALIAS_CFG}\n    {ALIAS_USE}\n"
                    f"  or, if the module truly cannot run on wasm32, list it in WASM_EXCEPTIONS with the reason"
                )
        if rel.startswith("tests/"):
            code = blank(text)
            for m in BARE_READ.finditer(code):
                ln = line_of(code, m.start())
                exempt = READ_EXEMPT.get(rel)
                if exempt and exempt in "\n".join(text.splitlines()[max(0, ln - 12) : ln]):
                    continue
                errors.append(
                    f"{rel}:{ln}: a bare .read(...): read through support::http::read_some (a stop and continue "
                    f"of the test process interrupts a receive with EINTR, which a bare read returns as an error)"
                )
        for ln, reason, attr in ignores(text):
            if reason is None:
                errors.append(f'{rel}:{ln}: {attr}: write #[ignore = "why, and what is left to do"]')
            elif len(reason.strip()) < MIN_REASON:
                errors.append(
                    f"{rel}:{ln}: #[ignore] reason too short ({len(reason.strip())} < {MIN_REASON} characters): "
                    f"say why, and what is left to do: {reason!r}"
                )
            elif m := PLACEHOLDERS.search(reason):
                errors.append(
                    f"{rel}:{ln}: #[ignore] reason says {m.group(0)!r}: say what is left to do (the cause found, "
                    f"the change that would let it run, or the issue that tracks it): {reason!r}"
                )
    if not sys.argv[1:]:
        for rel in sorted(set(WASM_EXCEPTIONS) - excepted):
            errors.append(f"{rel}: listed in WASM_EXCEPTIONS but holds no plain #[test] (or is gone): remove the entry")
    for e in errors:
        print(f"check-test-attrs: {e}", file=sys.stderr)
    if errors:
        sys.exit(1)
    print(f"check-test-attrs: {len(files)} files; core tests all run on wasm32 (exceptions: {len(excepted)}); every #[ignore] says why; no bare read under tests/")


if __name__ == "__main__":
    main()
