#!/usr/bin/env python3
"""The import graph of the library's modules (src/), drawn from `crate::` and `super::` paths in
non-test code, and the layering rules ARCHITECTURE.md states, checked:

- no cycle among modules (the filter's submodules, and the engine's (`src/engine/`, core modules),
  count as modules of their own; a filter submodule naming
  its parent's items, `super::Shared` in `filter/http.rs`, is the module tree, not a layer: it is
  printed, marked `(parent)`, and left out of the cycle check);
- the core (every module but `filter` and `bench_host`, the benchmark builds' glue) never names
  `filter`, `bench_host` nor `proxy_wasm`.

`scripts/module-graph.py` checks and prints one line per module with what it imports;
`--dot` prints the graph in Graphviz form instead. Run by `make lint`; exits 1 on a broken rule.

The reading is textual (comments and string literals removed, `#[cfg(test)] mod tests` blocks and
tests.rs files skipped), so a path spelled through a `use` alias or a macro is not seen: the check is
a floor, and the compiler stays the judge of what compiles.
"""

import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def module_files():
    """(module name, file path) for every non-test file of the library."""
    out = []
    for name in sorted(os.listdir(ROOT)):
        path = os.path.join(ROOT, name)
        if name.endswith(".rs") and name not in ("lib.rs", "main.rs"):
            out.append((name[:-3], path))
    # The engine's machines (`src/engine/`, its `mod.rs` only `pub mod` lines): core modules.
    edir = os.path.join(ROOT, "engine")
    if os.path.isdir(edir):
        for name in sorted(os.listdir(edir)):
            if name.endswith(".rs") and name not in ("mod.rs", "tests.rs"):
                out.append(("engine::" + name[:-3], os.path.join(edir, name)))
    # The benchmark builds' glue (`src/bench_host.rs`, `src/bench_host/`): glue like the filter.
    bdir = os.path.join(ROOT, "bench_host")
    for name in sorted(os.listdir(bdir)) if os.path.isdir(bdir) else []:
        if name.endswith(".rs") and name != "tests.rs":
            out.append(("bench_host::" + name[:-3], os.path.join(bdir, name)))
    fdir = os.path.join(ROOT, "filter")
    for name in sorted(os.listdir(fdir)):
        if name.endswith(".rs") and name != "tests.rs":
            out.append(("filter" if name == "mod.rs" else "filter::" + name[:-3], os.path.join(fdir, name)))
    # The engine's machines (`src/engine.rs` declares them): core modules of their own.
    edir = os.path.join(ROOT, "engine")
    for name in sorted(os.listdir(edir)) if os.path.isdir(edir) else []:
        if name.endswith(".rs") and name != "tests.rs":
            out.append(("engine::" + name[:-3], os.path.join(edir, name)))
    return out


STRING = re.compile(r'b?r#*"(?:.|\n)*?"#*|b?"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])\'')


def code_of(text):
    """The text without comments, string and char literals, and `#[cfg(test)]` test modules."""
    text = re.sub(r"/\*(?:.|\n)*?\*/", "", text)
    text = re.sub(r"//[^\n]*", "", re.sub(STRING, '""', text))
    out = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == "#[cfg(test)]" and i + 1 < len(lines) and re.match(r"\s*(pub )?mod tests\b", lines[i + 1]):
            # Skip the module: to the matching brace (or the `;` of `mod tests;`).
            j, depth, opened = i + 1, 0, False
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                opened = opened or "{" in lines[j]
                if (opened and depth <= 0) or (not opened and ";" in lines[j]):
                    break
                j += 1
            i = j + 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def imports(mod, code, modules, own_items):
    """The modules `mod`'s code names."""
    found = set()
    top = {m for m in modules if "::" not in m}
    subs = {m.split("::")[1] for m in modules if m.startswith("filter::")}
    for m in re.finditer(r"\bcrate::(\w+)(?:::(\w+))?", code):
        first, second = m.group(1), m.group(2)
        if first == "filter":
            found.add("filter::" + second if second in subs else "filter")
        elif first in ("engine", "bench_host") and first + "::" + str(second) in modules:
            found.add(first + "::" + second)
        elif first in top:
            found.add(first)
    # A `use crate::{a, b::c}` group.
    for m in re.finditer(r"\bcrate::\{([^}]*)\}", code):
        for part in m.group(1).split(","):
            first = part.strip().split("::")[0]
            if first in top:
                found.add(first)
    if mod.startswith("filter::"):
        for m in re.finditer(r"(?<!::)\bsuper::(\w+)", code):
            name = m.group(1)
            if name in subs:
                found.add("filter::" + name)
            elif name not in own_items:  # `super::X` inside an inline module of this file
                found.add("filter")
        for m in re.finditer(r"(?<!::)\bsuper::\{([^}]*)\}", code):
            for part in m.group(1).split(","):
                name = part.strip().split("::")[0]
                found.add("filter::" + name if name in subs else "filter")
    elif mod == "bench_host":
        for m in re.finditer(r"\b(?:self::)?(\w+)::", code):
            if "bench_host::" + m.group(1) in modules and re.search(r"\bmod " + m.group(1) + r"\s*;", code):
                found.add("bench_host::" + m.group(1))
    elif mod == "filter":
        for m in re.finditer(r"\b(?:self::)?(\w+)::", code):
            if m.group(1) in subs and re.search(r"\bmod " + m.group(1) + r"\s*;", code):
                found.add("filter::" + m.group(1))
    found.discard(mod)
    return found


def is_glue(mod):
    """The filter and the benchmark builds' glue: the modules that may name proxy_wasm."""
    return any(mod == g or mod.startswith(g + "::") for g in ("filter", "bench_host"))


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main():
    files = module_files()
    modules = [m for m, _ in files]
    graph, raw = {}, {}
    for mod, path in files:
        with open(path, encoding="utf-8") as f:
            code = code_of(f.read())
        raw[mod] = code
        own = set(re.findall(r"\b(?:fn|struct|enum|const|static|type|trait|mod)\s+(\w+)", code))
        graph[mod] = imports(mod, code, modules, own)
    broken = []
    for mod in modules:
        if is_glue(mod):
            continue
        if any(is_glue(d) for d in graph[mod]):
            broken.append(f"core module {mod} imports the filter")
        if re.search(r"\bproxy_wasm\b", raw[mod]):
            broken.append(f"core module {mod} names proxy_wasm")
    layered = {m: {d for d in deps if not (m.startswith(d + "::"))} for m, deps in graph.items()}
    for comp in cycles(layered):
        broken.append("import cycle among " + ", ".join(comp))
    if "--dot" in sys.argv:
        print("digraph idemgate {")
        for mod in modules:
            for dep in sorted(graph[mod]):
                print(f'  "{mod}" -> "{dep}";')
        print("}")
    else:
        for mod in modules:
            deps = [d + (" (parent)" if d not in layered[mod] else "") for d in sorted(graph[mod])]
            print(f"{mod}: {', '.join(deps) or '-'}")
    for b in broken:
        print("module-graph: " + b, file=sys.stderr)
    if broken:
        sys.exit(1)
    print(f"module-graph: {len(modules)} modules, {sum(len(d) for d in graph.values())} imports, no cycle", file=sys.stderr)


if __name__ == "__main__":
    main()
