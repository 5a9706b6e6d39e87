#!/usr/bin/env python3
"""Instruction counts of the NEON kernels' compiled inner loops (docs/BENCHMARKS.md, "NEON").

Counts, not times: it disassembles an aarch64 release build of k3-worker and prints, for every
loop (a backward branch) that multiplies (fmla/fmul) inside the kernels' functions, how many
instructions of each kind one trip runs. Emulation measures no speed; these counts, with a
core's issue widths, give the rooflines the benchmarks document argues from.

Build first (needs the aarch64 target and cross linker; scripts/test-platforms.sh installs
them), then run:

    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \\
        cargo build --release --target aarch64-unknown-linux-gnu -p k3-worker --lib
    python3 scripts/neon_loop_counts.py [RLIB] > counts.json

Output: JSON {"commit", "rustc", "rlib", "loops"}, each loop {"function", "instructions", "simd",
"loads", "counts"}; "simd" counts the
vector data-processing instructions (those that go to a core's vector pipes: fmla, fmul, fadd,
shl, and, ushl, tbl, zip, shll, ...), "loads" the load instructions (ldp counts once).
"""

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

RLIB = "target/aarch64-unknown-linux-gnu/release/libk3_worker.rlib"
OBJDUMP = "aarch64-linux-gnu-objdump"
# The functions the NEON kernels are compiled into (generic helpers are inlined into these).
FUNCS = re.compile(r"kernels::neon::|kernels::Kernels::(matmul_mxfp4|dot_f32)")
# Vector data-processing mnemonics (a register list of v-registers distinguishes `and v..` from
# the scalar `and x..`; see `is_simd`).
LOADS = {"ldr", "ldp", "ldur", "ld1", "ld1r", "ldrb", "ldurb", "ldrh"}


def is_simd(op, args):
    return bool(re.match(r"\s*v\d+\.", args)) and not op.startswith(("ld", "st"))


def loops(ins):
    """(start, end) index pairs of every backward branch's body."""
    at = {a: j for j, (a, _, _) in enumerate(ins)}
    for j, (a, op, args) in enumerate(ins):
        if op.startswith("b") and op not in ("bl", "blr", "br"):
            m = re.search(r"\b([0-9a-f]+) <", args)
            if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in at:
                yield at[int(m.group(1), 16)], j + 1


def main():
    rlib = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else RLIB)
    out = []
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(["ar", "x", rlib], cwd=d, check=True)
        for obj in sorted(f for f in os.listdir(d) if f.endswith(".o")):
            text = subprocess.run(
                [OBJDUMP, "-d", "-C", "--no-show-raw-insn", os.path.join(d, obj)],
                check=True, capture_output=True, text=True).stdout
            name, ins = None, []
            for line in text.splitlines() + ["0 <END>:"]:
                m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
                if m:
                    if name and FUNCS.search(name):
                        for s, e in loops(ins):
                            body = ins[s:e]
                            c = collections.Counter(op for _, op, _ in body)
                            if c["fmla"] + c["fmul"] == 0:
                                continue
                            out.append({
                                "function": name,
                                "instructions": len(body),
                                "simd": sum(1 for _, op, a in body if is_simd(op, a)),
                                "loads": sum(c[k] for k in LOADS),
                                "counts": dict(c.most_common()),
                            })
                    name, ins = m.group(1), []
                    continue
                m = re.match(r"^\s+([0-9a-f]+):\s+(\S+)\s*(.*)$", line)
                if m:
                    ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    run = lambda *a: subprocess.run(a, capture_output=True, text=True).stdout.strip()
    doc = {
        "commit": run("git", "rev-parse", "--short", "HEAD"),
        "rustc": run("rustc", "--version"),
        "rlib": rlib,
        "loops": out,
    }
    json.dump(doc, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
