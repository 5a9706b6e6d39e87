#!/usr/bin/env python3
"""Pass `cargo test` output through unchanged and time each test binary; or sum a pytest JUnit
report per test file (standard library only).

    cargo test --workspace 2>&1 | python3 scripts/test_times.py [--slowest N]
    python3 scripts/test_times.py --junit REPORT.xml [--slowest N]

Cargo runs the test binaries one after another and announces each with a `Running …` or
`Doc-tests …` line; the time from one announcement to the next is that binary's (its own run, as
stable `cargo test` has no per-binary timing). At the end: the N slowest binaries (default 10)
and the total. The exit status is 0: the caller takes cargo's from the pipeline (`set -o
pipefail`).
"""
from __future__ import annotations

import collections
import re
import sys
import time
import xml.etree.ElementTree as ET

ANNOUNCE = re.compile(r"^\s*(Running|Doc-tests)\s+(.*?)\s*$")


def label(kind: str, rest: str) -> str:
    """`unittests src/lib.rs (target/debug/deps/k3_store-…)` → `k3_store unittests src/lib.rs`."""
    m = re.match(r"(.*?)\s*\((?:.*/)?deps/([A-Za-z0-9_]+?)-[0-9a-f]+\)$", rest)
    if m:
        return f"{m.group(2)}: {m.group(1)}"
    return f"doc-tests {rest}" if kind == "Doc-tests" else rest


def per_file(report: str, slowest: int) -> int:
    """Each test file's time: the sum of its tests' (pytest's JUnit `time` is setup, call and
    teardown, so a module fixture counts in the test that first asks for it)."""
    files: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        # classname: `scripts.tests.test_x` (or `….test_x.TestClass`): the module's path
        parts = case.get("classname", "?").split(".")
        mod = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        name = "/".join(parts[:mod + 1]) + ".py"
        files[name] += float(case.get("time", 0))
        counts[name] += 1
    total = sum(files.values())
    print(f"== Python test files: {len(files)}, {sum(counts.values())} tests, {total:.0f} s "
          f"summed over the workers; the slowest:")
    for name, secs in sorted(files.items(), key=lambda kv: -kv[1])[:slowest]:
        print(f"   {secs:7.1f} s  {name} ({counts[name]} tests)")
    return 0


def main() -> int:
    args = sys.argv[1:]
    slowest = 10
    if "--slowest" in args:
        i = args.index("--slowest")
        slowest = int(args[i + 1])
        del args[i:i + 2]
    if len(args) == 2 and args[0] == "--junit":
        return per_file(args[1], slowest)
    times: list[tuple[float, str]] = []
    current, since = None, time.monotonic()
    t0 = since
    for line in sys.stdin:
        sys.stdout.write(line)
        sys.stdout.flush()
        m = ANNOUNCE.match(line)
        if m:
            now = time.monotonic()
            if current is not None:
                times.append((now - since, current))
            current, since = label(m.group(1), m.group(2)), now
    end = time.monotonic()
    if current is not None:
        times.append((end - since, current))
    if times:
        print(f"== Rust test binaries: {len(times)} in {end - t0:.0f} s; the slowest:")
        for secs, name in sorted(times, reverse=True)[:slowest]:
            print(f"   {secs:7.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
