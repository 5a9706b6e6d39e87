#!/usr/bin/env python3
"""The shape of the code, read from the sources: lines per crate and per folder, the longest
functions, the imports between rooms and between files (modules) with their circles, and how
many `Result<_, String>` are left outside tests.

    python3 scripts/code_shape.py [TREE] [--top N] [--json]

TREE is a checkout of this repository (default: the one this script is in). A "room" is a
crate's top-level module: a folder or a file under `src/` (`k3-store/runtime`,
`k3-worker/model`, `k3-worker/job`). Lines are non-blank lines of `.rs` files under `src/`
(unit tests in `#[cfg(test)]` modules included; `tests/`, `benches/`, `fuzz/` excluded). A
function's length is the lines from its `fn` line to its closing brace. Standard library only:
the issue's before/after figures are this script run on two checkouts.
"""
import argparse
import json
import os
import re
import sys
from collections import defaultdict

CRATES = {"proto": "k3_proto", "k3-store": "k3_store", "k3-worker": "k3_worker", "k3-ctl": "k3_ctl",
          "tests": "k3_tests"}
FN_RE = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?(?:extern\s+\"C\"\s+)?fn\s+([A-Za-z0-9_]+)")
STRING_RE = re.compile(r'"(?:\\.|[^"\\])*"')
CHAR_RE = re.compile(r"'(?:\\.|[^'\\])'")
RESULT_STRING_RE = re.compile(r"Result<[^;{]*,\s*String>")


def code_of(line):
    """The line without string and char literals and `//` comments (for brace counting)."""
    line = STRING_RE.sub('""', line)
    line = CHAR_RE.sub("' '", line)
    i = line.find("//")
    return line if i < 0 else line[:i]


def rust_files(tree, crate):
    src = os.path.join(tree, crate, "src")
    for root, _dirs, files in os.walk(src):
        for f in sorted(files):
            if f.endswith(".rs"):
                yield os.path.join(root, f)


def room_of(tree, crate, path):
    rel = os.path.relpath(path, os.path.join(tree, crate, "src"))
    first = rel.split(os.sep)[0]
    if first.endswith(".rs"):
        first = first[:-3]
    return f"{crate}/{first}"


def functions(lines):
    """(name, first line, length) of every fn with a body."""
    out = []
    i = 0
    while i < len(lines):
        m = FN_RE.match(lines[i])
        if not m:
            i += 1
            continue
        depth = 0
        opened = False
        j = i
        while j < len(lines):
            c = code_of(lines[j])
            if not opened and ";" in c and "{" not in c:
                break  # a declaration without a body (trait method)
            depth += c.count("{") - c.count("}")
            opened = opened or "{" in c
            if opened and depth <= 0:
                out.append((m.group(1), i + 1, j - i + 1))
                break
            j += 1
        i += 1
    return out


def test_spans(lines):
    """Line ranges of `#[cfg(test)]` modules."""
    spans = []
    for i, line in enumerate(lines):
        if line.strip() == "#[cfg(test)]" and i + 1 < len(lines) and re.match(r"\s*(pub\s+)?mod\s", lines[i + 1]):
            depth, j = 0, i + 1
            while j < len(lines):
                c = code_of(lines[j])
                depth += c.count("{") - c.count("}")
                if "{" in c or depth:
                    if depth <= 0:
                        break
                j += 1
            spans.append((i, j))
    return spans


def imports(tree, crate, path, text):
    """Rooms this file's code names (crate-local `crate::X` and the other crates' `k3_x::Y`;
    comments, doc comments and `#[cfg(test)]` modules left out)."""
    rooms = set()
    for m in re.finditer(r"\bcrate::([a-z_0-9]+)", text):
        rooms.add(f"{crate}/{m.group(1)}")
    for other, lib in CRATES.items():
        if other == crate:
            continue
        for m in re.finditer(rf"\b{lib}::([a-z_0-9]+)", text):
            rooms.add(f"{other}/{m.group(1)}")
    # `use crate::{a, b::c}` groups
    for m in re.finditer(r"\bcrate::\{([^}]*)\}", text):
        for part in m.group(1).split(","):
            name = part.strip().split("::")[0]
            if name and re.match(r"^[a-z_0-9]+$", name):
                rooms.add(f"{crate}/{name}")
    return rooms


def module_of(tree, crate, path):
    """The module a file defines (`engine::runner`, `crate` for lib.rs, or main.rs without a
    library; `main` for a binary beside a library)."""
    src = os.path.join(tree, crate, "src")
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] == "mod":
        rel = rel[:-1]
    name = "::".join(rel)
    if name == "lib" or (name == "main" and not os.path.exists(os.path.join(src, "lib.rs"))):
        return "crate"
    return name


def module_imports(crate, module, code, known, is_parent):
    """Modules a file's code names: `crate::a::b`, `super::x`, a parent's `child::x` and a
    binary's `<lib>::a`, resolved to the deepest module that exists (use trees' first level
    expanded, as in `use crate::{a, b::c}`)."""
    segs = [] if module in ("crate", "main") else module.split("::")
    parent = segs[:-1]
    paths = []
    root = CRATES[crate] if module == "main" else "crate"
    for m in re.finditer(rf"(?<![A-Za-z0-9_:]){root}::((?:[a-z_0-9]+::)*[a-z_0-9]+)", code):
        paths.append(m.group(1).split("::"))
    for m in re.finditer(rf"(?<![A-Za-z0-9_:]){root}::\{{([^}}]*)\}}", code):
        for part in m.group(1).split(","):
            p = [x for x in part.strip().split("::") if re.match(r"^[a-z_0-9]+$", x)]
            if p:
                paths.append(p)
    for m in re.finditer(r"(?<![A-Za-z0-9_:])super::((?:[a-z_0-9]+::)*[a-z_0-9]+)", code):
        paths.append(parent + m.group(1).split("::"))
    if is_parent:
        for child in [k for k in known if k.startswith(("::".join(segs) + "::") if segs else "")]:
            rest = child[len("::".join(segs)) + 2:] if segs else child
            if "::" in rest or rest in ("crate", "main"):
                continue
            for m in re.finditer(rf"(?<![A-Za-z0-9_:]){rest}::((?:[a-z_0-9]+::)*[a-z_0-9]+)", code):
                paths.append(segs + [rest] + m.group(1).split("::"))
    out = set()
    for p in paths:
        for k in range(len(p), 0, -1):
            cand = "::".join(p[:k])
            if cand in known:
                if cand != module:
                    out.add(cand)
                break
    return out


def shape(tree):
    per_crate = defaultdict(int)
    per_room = defaultdict(int)
    fns = []
    edges = defaultdict(set)
    file_edges = {c: defaultdict(set) for c in CRATES}
    result_string = []
    known_rooms = set()
    known_modules = {c: set() for c in CRATES}
    for crate in CRATES:
        for path in rust_files(tree, crate):
            known_rooms.add(room_of(tree, crate, path))
            known_modules[crate].add(module_of(tree, crate, path))
    for crate in CRATES:
        for path in rust_files(tree, crate):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            lines = text.split("\n")
            n = sum(1 for l in lines if l.strip())
            room = room_of(tree, crate, path)
            per_crate[crate] += n
            per_room[room] += n
            rel = os.path.relpath(path, tree)
            tests = test_spans(lines)
            in_test = lambda ln: any(a <= ln <= b for a, b in tests)
            for name, line, length in functions(lines):
                if not in_test(line - 1):
                    fns.append((length, f"{rel}:{line}", name))
            for ln, line in enumerate(lines):
                # The product crates' (the test-support crate's helpers panic anyway).
                if crate == "tests":
                    break
                if RESULT_STRING_RE.search(line) and not in_test(ln) and not line.strip().startswith("//"):
                    result_string.append(f"{rel}:{ln + 1}")
            code = "\n".join(code_of(l) for ln, l in enumerate(lines) if not in_test(ln))
            for r in imports(tree, crate, path, code):
                if r != room and r in known_rooms:
                    edges[room].add(r)
            module = module_of(tree, crate, path)
            is_parent = module == "crate" or os.path.basename(path) in ("mod.rs", "lib.rs")
            for m in module_imports(crate, module, code, known_modules[crate], is_parent):
                if m != "crate":
                    file_edges[crate][module].add(m)
    return per_crate, per_room, fns, edges, result_string, file_edges


def cycles(edges):
    """Strongly connected components of more than one room (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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
    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tree", nargs="?", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--top", type=int, default=10, help="longest functions to list")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    per_crate, per_room, fns, edges, result_string, file_edges = shape(a.tree)
    fns.sort(reverse=True)
    cyc = cycles(edges)
    file_cyc = {c: cycles(e) for c, e in file_edges.items()}
    if a.json:
        json.dump(
            {
                "lines_per_crate": per_crate,
                "lines_per_room": per_room,
                "longest_functions": [{"lines": l, "at": at, "fn": n} for l, at, n in fns[: a.top]],
                "imports": {k: sorted(v) for k, v in sorted(edges.items())},
                "room_cycles": cyc,
                "file_cycles": {c: v for c, v in file_cyc.items() if v},
                "result_string": result_string,
            },
            sys.stdout,
            indent=1,
        )
        print()
        return
    total = sum(per_crate.values())
    print(f"non-blank lines under src/: {total}")
    for c, n in sorted(per_crate.items(), key=lambda kv: -kv[1]):
        print(f"  {c:<12}{n:>7}  {100 * n / total:4.1f}%")
    print("per room (crate/top-level module):")
    for r, n in sorted(per_room.items(), key=lambda kv: -kv[1]):
        print(f"  {r:<28}{n:>7}")
    print(f"longest {a.top} functions (outside #[cfg(test)]):")
    for l, at, n in fns[: a.top]:
        print(f"  {l:>5}  {n:<28} {at}")
    print("imports between rooms (room -> rooms it names):")
    for r in sorted(edges):
        print(f"  {r} -> {', '.join(sorted(edges[r]))}")
    print(f"room-level import circles: {len(cyc)}")
    for c in cyc:
        print(f"  {' <-> '.join(c)}")
    n_file = sum(len(v) for v in file_cyc.values())
    print(f"file-level import circles (modules of one crate): {n_file}")
    for crate, cs in file_cyc.items():
        for c in cs:
            print(f"  {crate}: {' <-> '.join(c)}")
    print(f"Result<_, String> outside #[cfg(test)]: {len(result_string)}")


if __name__ == "__main__":
    main()
