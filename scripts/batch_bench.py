#!/usr/bin/env python3
"""Batched decoding against the same requests run one at a time, same run, same budgets.

    python3 scripts/batch_bench.py --model K3SLICE --trunk TRUNK_DIR \
        --budgets all-resident,trunk-pinned,laptop-like --parallel 1,2,4 --gen 9 \
        --json docs/bench/batch-k3slice.json

For every budget (`scripts/bench.py`'s, at the checkpoint's scale) and every N in --parallel:
N requests (the bench prompt and N-1 others of mixed lengths) run one after another through
`k3-worker --standalone ... --ids ... --spec off` (solo), then together through one
`k3-worker --batch FILE --parallel N` (batch). The ids of every request must be identical
(exit 1 otherwise). Reported, per cell:

- solo decode s/token: the median of every solo run's decode steps (steps >= 1);
- batch decode step: the median of the batch's steps in which all N sequences decode (no
  prompt rows);
- decode throughput ratio = N x solo s/token / batch step s (how many times the tokens per
  second of one request alone the batch gives);
- wall: the batch job's wall seconds against the sum of the solo jobs' (both include loading
  the model and the prefill).

Runs standalone: one process holds the weights and every sequence, as a batch worker would.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def prompts(n: int) -> list[list[int]]:
    """The bench prompt first, then prompts of other lengths (deterministic)."""
    out = [list(bench.PROMPT)]
    for i in range(1, n):
        length = 3 + (i * 5) % 11
        out.append([(1000 + 7919 * i + 104729 * j) % 150000 for j in range(length)])
    return out


def budget_flags(trunk: Path, tb: int, cb: int) -> list[str]:
    return ["--trunk", str(trunk), "--trunk-gb", f"{tb / 1e9:.9f}", "--cache-gb",
            f"{cb / 1e9:.9f}"]


def run(cmd: list, what: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    secs = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"batch_bench: {what} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return r, secs


def solo(bins: Path, model: Path, flags: list[str], ids: list[int], gen: int,
         tmp: Path) -> dict:
    out = tmp / "solo.json"
    cmd = [bins / "k3-worker", "--standalone", model, *flags, "--ids", ",".join(map(str, ids)),
           "--gen", str(gen), "--spec", "off", "--out", out]
    _, secs = run(cmd, "solo worker")
    rep = json.loads(out.read_text())
    return {"ids": rep["generated_ids"], "decode": [s["seconds"] for s in rep["steps"][1:]],
            "wall": secs}


def batch(bins: Path, model: Path, flags: list[str], reqs: list[list[int]], gen: int,
          tmp: Path) -> dict:
    f = tmp / "batch.jsonl"
    f.write_text("".join(json.dumps({"ids": r, "max_tokens": gen}) + "\n" for r in reqs))
    cmd = [bins / "k3-worker", "--standalone", model, *flags, "--batch", f, "--parallel",
           str(len(reqs)), "--spec", "off"]
    r, secs = run(cmd, "batch worker")
    ids: dict[int, list[int]] = {}
    for line in r.stdout.splitlines():
        v = json.loads(line)
        ids[v["index"]] = v["ids"]
    steps = []
    in_table = False
    for line in r.stderr.splitlines():
        cols = line.split()
        if cols[:2] == ["step", "seqs"]:
            in_table = True
            continue
        # step, seqs, rows, prompt rows, [draft rows,] seconds (the draft column is newer).
        if in_table and len(cols) in (5, 6) and cols[0].isdigit():
            steps.append({"seqs": int(cols[1]), "rows": int(cols[2]), "prompt": int(cols[3]),
                          "drafts": int(cols[4]) if len(cols) == 6 else 0,
                          "seconds": float(cols[-1])})
    full = [s["seconds"] for s in steps if s["prompt"] == 0 and s["seqs"] == len(reqs)]
    return {"ids": [ids.get(i) for i in range(len(reqs))], "full_decode_steps": full,
            "steps": steps, "wall": secs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--trunk", required=True, type=Path, help="packed trunk dir")
    ap.add_argument("--bins", type=Path, default=ROOT / "target" / "release")
    ap.add_argument("--budgets", default="all-resident,trunk-pinned,laptop-like")
    ap.add_argument("--parallel", default="1,2,4")
    ap.add_argument("--gen", type=int, default=9)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.gen < 3:
        ap.error("--gen >= 3 (decode steps to measure)")
    if not (a.bins / "k3-worker").is_file():
        ap.error(f"{a.bins}: no k3-worker there (cargo build --release)")
    budgets = bench.budgets_for(a.model, a.trunk)
    names = [n for n in a.budgets.split(",") if n]
    for n in names:
        if n not in budgets:
            ap.error(f"unknown budget {n!r}: one of {', '.join(budgets)}")
    ns = [int(x) for x in a.parallel.split(",") if x]
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    cells = []
    same = True
    with tempfile.TemporaryDirectory(prefix="k3-batch-bench.") as t:
        tmp = Path(t)
        for name in names:
            flags = budget_flags(a.trunk, budgets[name][0], budgets[name][1])
            for n in ns:
                reqs = prompts(n)
                solos = [solo(a.bins, a.model, flags, r, a.gen, tmp) for r in reqs]
                b = batch(a.bins, a.model, flags, reqs, a.gen, tmp)
                ok = all(s["ids"] == bi for s, bi in zip(solos, b["ids"]))
                same &= ok
                solo_tok = statistics.median([x for s in solos for x in s["decode"]])
                step = statistics.median(b["full_decode_steps"]) if b["full_decode_steps"] else None
                ratio = n * solo_tok / step if step else None
                cell = {"budget": name, "parallel": n, "solo_decode_s": solo_tok,
                        "batch_decode_step_s": step, "decode_throughput_ratio": ratio,
                        "solo_wall_s": sum(s["wall"] for s in solos), "batch_wall_s": b["wall"],
                        "ids_identical": ok, "ids": [s["ids"] for s in solos],
                        "batch_steps": b["steps"]}
                cells.append(cell)
                print(f"{name:13} N={n}: solo {solo_tok * 1e3:9.2f} ms/token; batch step "
                      f"{(step or 0) * 1e3:9.2f} ms ({len(b['full_decode_steps'])} full steps) -> "
                      f"{ratio or 0:.2f}x decode throughput; wall solo "
                      f"{cell['solo_wall_s']:.1f} s, batch {b['wall']:.1f} s; ids "
                      f"{'identical' if ok else 'DIFFER'}", flush=True)
    if a.json:
        a.json.write_text(json.dumps({
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "load_average": list(os.getloadavg()), "cpu": cpu, "model": str(a.model),
            "trunk": str(a.trunk), "gen": a.gen, "cells": cells, "ids_identical": same,
        }, indent=1))
        print(f"wrote {a.json}")
    print("ids identical, batch and solo" if same else "IDS DIFFER between batch and solo")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
