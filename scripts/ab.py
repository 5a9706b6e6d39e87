#!/usr/bin/env python3
"""Interleaved A/B of engine builds: the same standalone jobs with two or more sets of binaries.

    scripts/ab.py --model DIR --trunk PACKED --bins OLD_BIN_DIR,NEW_BIN_DIR \
        --budgets all-resident,trunk-pinned --reps 3 --gen 41 --json out.json

With --attached each run is a store and one attached worker of the same binaries instead:
`k3-store start --detach` at the budget, the worker on its socket, `k3-ctl stop` (a fresh, cold
store each time, so the two builds' stores never meet). With --modes standalone,attached one set
of binaries is compared with itself, standalone against attached, interleaved (what attaching to
a store costs a single job).

Budgets are `scripts/bench.py`'s (`plan_budgets`, at this checkpoint's scale). Every repetition
runs every budget with every set of binaries in turn (A, B, A, B, ...), so a slow minute of a
shared machine hits both sides. Per (budget, binaries): decode s/token = median of each run's
steps >= 1, then median and min-max over the runs; I/O wait (trunk and experts) per step; the
ids. The script exits 1 if two sets of binaries (or two runs) give different ids: a speed-up
that changes an id is a bug, not a result. bench.py measures floors and writes the budget tables; this only
compares builds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402


def summarize(runs: list[dict]) -> dict:
    """One (budget, binaries) cell from its runs' `--out` JSON."""
    per_run = []
    waits = []
    ids = set()
    for d in runs:
        steps = [s["seconds"] for s in d["steps"]][1:]
        if not steps:
            raise SystemExit("ab: a run without decode steps (use --gen >= 2)")
        per_run.append(statistics.median(steps))
        # Trunk and expert waits together (the engine blocked on I/O).
        waits.append(d["io_wait_seconds"] / len(d["steps"]))
        ids.add(bench.ids_hash(d["generated_ids"]))
    dec = [s for d in runs for s in d["steps"][1:]]
    return {
        "trunk_bytes_per_step": statistics.median(s.get("trunk_bytes_read", 0) for s in dec),
        "bytes_per_step": statistics.median(s.get("bytes_read", 0) for s in dec),
        "peak_rss_bytes": max(d.get("peak_rss_bytes", 0) for d in runs),
        "decode_s": bench.med_min_max(per_run),
        "decode_s_per_run": per_run,
        "io_wait_per_step_s": statistics.median(waits),
        "ids_hashes": sorted(ids),
    }


def run_attached(bins: Path, model: Path, trunk: Path, trunk_b: int, cache_b: int, gen: int,
                 out: Path, chunk: int, tmp: Path) -> dict:
    """One cold store at the budget and one attached worker (plain decoding); the store is
    stopped before returning, whatever happened."""
    sockdir = Path(tempfile.mkdtemp(dir=tmp))  # mode 700, as the store requires
    sock = sockdir / "store.sock"
    start = [bins / "k3-store", "start", model, "--trunk", trunk,
             "--trunk-gb", f"{trunk_b / 1e9:.9f}", "--cache-gb", f"{cache_b / 1e9:.9f}",
             "--socket", sock, "--detach", "--log", sockdir / "store.log"]
    r = bench.sh(start, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"ab: store failed to start (exit {r.returncode}):\n{r.stderr}")
    try:
        w = bench.sh([bins / "k3-worker", "--socket", sock,
                      "--ids", ",".join(map(str, bench.PROMPT)), "--gen", gen,
                      "--prefill-chunk", chunk, "--spec", "off", "--out", out],
                     capture_output=True, text=True)
        if w.returncode != 0:
            raise SystemExit(f"ab: attached worker failed (exit {w.returncode}):\n{w.stderr}")
        return json.loads(out.read_text())
    finally:
        bench.sh([bins / "k3-ctl", "stop", "--socket", sock], capture_output=True, text=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--trunk", required=True,
                    help="packed trunk dir (its layer sizes set the budgets), or one per --bins "
                         "entry (comma-separated, same order) when the builds pack different "
                         "trunk formats (the first sets the budgets)")
    ap.add_argument("--bins", required=True,
                    help="comma-separated directories holding k3-worker (2 or more, or 1 with "
                         "--trunks)")
    ap.add_argument("--trunks", default="",
                    help="comma-separated packed trunk dirs to compare with the same binaries "
                         "(e.g. raw and ecbf16), interleaved; budgets stay --trunk's")
    ap.add_argument("--budgets", default="all-resident,trunk-pinned,laptop-like")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=41)
    ap.add_argument("--prefill-chunk", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--attached", action="store_true",
                    help="a store and one attached worker per run, not --standalone")
    ap.add_argument("--modes", default="",
                    help="'standalone,attached': one --bins dir, each run once standalone and "
                         "once attached to a fresh store")
    a = ap.parse_args(argv)
    bins = [Path(b) for b in a.bins.split(",") if b]
    trunks = [Path(t) for t in a.trunks.split(",") if t]
    per_bins = [Path(t) for t in a.trunk.split(",") if t]
    if len(per_bins) not in (1, len(bins)):
        ap.error("--trunk takes one directory or one per --bins entry")
    a.trunk = per_bins[0]
    trunk_of = dict(zip(bins, per_bins if len(per_bins) == len(bins) else per_bins * len(bins)))
    modes = [m for m in a.modes.split(",") if m]
    if modes and (sorted(modes) != ["attached", "standalone"] or len(bins) != 1 or trunks
                  or a.attached):
        ap.error("--modes takes 'standalone,attached' with one --bins dir (no --trunks, "
                 "no --attached)")
    if len(bins) < 2 and len(trunks) < 2 and not modes:
        ap.error("--bins needs at least two directories (or --trunks two trunks, or --modes)")
    if len(trunks) >= 2 and len(bins) != 1:
        ap.error("--trunks compares trunks with one set of binaries: give one --bins dir")
    for t in trunks:
        if not (t / "trunk.json").is_file():
            ap.error(f"{t}: no trunk.json there")
    # (binaries, trunk, label, attached) per side.
    if modes:
        sides = [(bins[0], a.trunk, m, m == "attached") for m in modes]
    elif len(trunks) >= 2:
        sides = [(bins[0], t, str(t), a.attached) for t in trunks]
    else:
        sides = [(b, trunk_of[b], str(b), a.attached) for b in bins]
    for b in bins:
        if not (b / "k3-worker").is_file():
            ap.error(f"{b}: no k3-worker there")
    if a.reps < 1 or a.gen < 2:
        ap.error("--reps >= 1 and --gen >= 2")
    budgets = bench.budgets_for(a.model, a.trunk)
    names = [n for n in a.budgets.split(",") if n]
    for n in names:
        if n not in budgets:
            ap.error(f"unknown budget {n!r}: one of {', '.join(budgets)}")
    raw: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="k3-ab.") as tmp:
        out = Path(tmp) / "out.json"
        for rep in range(a.reps):
            for n in names:
                tb, cb = budgets[n][0], budgets[n][1]
                for b, trunk, label, attached in sides:
                    if attached:
                        d = run_attached(b, a.model, trunk, tb, cb, a.gen, out,
                                         a.prefill_chunk, Path(tmp))
                    else:
                        d, _ = bench.run_worker(b, a.model, trunk, tb, cb, a.gen, out,
                                                a.prefill_chunk)
                    raw.setdefault((n, label), []).append(d)
                    st = [s["seconds"] for s in d["steps"]][1:]
                    print(f"rep {rep} {n:13} {label}: {statistics.median(st) * 1e3:.2f} ms/token",
                          flush=True)
    cells = [{"budget": n, "bins": b, **summarize(runs)} for (n, b), runs in raw.items()]
    print()
    for c in cells:
        d = c["decode_s"]
        print(f"{c['budget']:13} {c['bins']:30} {d['median'] * 1e3:8.2f} ms "
              f"({d['min'] * 1e3:.2f}-{d['max'] * 1e3:.2f})  I/O wait "
              f"{c['io_wait_per_step_s'] * 1e3:.2f} ms/step  trunk "
              f"{c['trunk_bytes_per_step'] / 1e9:.3f} GB/step  peak RSS "
              f"{c['peak_rss_bytes'] / 1e9:.2f} GB  ids {','.join(c['ids_hashes'])}")
    hashes = {h for c in cells for h in c["ids_hashes"]}
    same = len(hashes) == 1
    print("ids identical across builds and runs" if same else f"IDS DIFFER: {sorted(hashes)}")
    if a.json:
        a.json.write_text(json.dumps({
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "load_average": list(__import__("os").getloadavg()),
            "model": str(a.model), "gen": a.gen, "reps": a.reps,
            "prefill_chunk": a.prefill_chunk, "prompt": bench.PROMPT,
            "mode": "standalone,attached" if modes else
                    "attached" if a.attached else "standalone",
            "bins": [str(b) for b in bins], "trunks": [str(t) for t in trunks] or [str(a.trunk)],
            "cells": cells, "ids_identical": same,
        }, indent=1))
        print(f"wrote {a.json}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
