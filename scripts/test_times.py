#!/usr/bin/env python3
"""Pass `cargo test` output through unchanged and time each test binary (standard library only).

    cargo test --workspace 2>&1 | python3 scripts/test_times.py [--slowest N]

Cargo runs the test binaries one after another and announces each with a `Running …` or
`Doc-tests …` line; the time from one announcement to the next is that binary's (its own run, as
stable `cargo test` has no per-binary timing). At the end: the N slowest binaries (default 10)
and the total. The exit status is 0: the caller takes cargo's from the pipeline (`set -o
pipefail`).
"""
from __future__ import annotations

import re
import sys
import time

ANNOUNCE = re.compile(r"^\s*(Running|Doc-tests)\s+(.*?)\s*$")


def label(kind: str, rest: str) -> str:
    """`unittests src/lib.rs (target/debug/deps/k3_store-…)` → `k3_store unittests src/lib.rs`."""
    m = re.match(r"(.*?)\s*\((?:.*/)?deps/([A-Za-z0-9_]+?)-[0-9a-f]+\)$", rest)
    if m:
        return f"{m.group(2)}: {m.group(1)}"
    return f"doc-tests {rest}" if kind == "Doc-tests" else rest


def main() -> int:
    slowest = 10
    if len(sys.argv) == 3 and sys.argv[1] == "--slowest":
        slowest = int(sys.argv[2])
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
