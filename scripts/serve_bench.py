#!/usr/bin/env python3
"""Concurrent requests through `k3-ctl serve`, at several slot counts of its worker, same store,
same run.

    python3 scripts/serve_bench.py --model K3SLICE --trunk TRUNK_DIR \
        --budgets all-resident,laptop-like --concurrent 4 --gen 9 --json docs/bench/serve-k3slice.json

For each budget (`scripts/bench.py`'s, at the checkpoint's scale) and each mode (`default`: `k3-ctl
serve` with its default slot count; `slots`: `--max-jobs N`; `one`: `--max-jobs 1`, every request
alone; `own`: `--no-batch`, a worker per request — only binaries from before the one-engine serve
have it): a fresh `k3-store start` with that budget (so no mode finds the other's outputs in the
store's history: the worker speculates with `--spec auto`, and the store's history would replay
an answer it has seen), a serve process, one warm-up request, then three requests alone (the
median of their wall seconds: `solo`; the lone request of an N-slot worker is to cost what it costs
in a 1-slot one) interleaved with `--rounds` bursts of N other requests at once (each timed from
the first send to the last answer; their median: `together`), every request on a prompt nothing
else uses; then (modes with more than one slot) a request joining a running batch of N-1
(`join`: its time to the first token against its solo prefill plus two of the batch's steps).
Throughput ratio = N x solo / together (how many times the tokens per second of one request
alone N concurrent requests get). Solo requests and bursts alternate because the host's speed
drifts within minutes: one burst timed after three solos gave ratios 2.0-2.7x for one build. Requests are /v1/completions with prompt ids, greedy, `--gen`
tokens, sessions off; every answer's text must equal the same request's answer alone (exit 1
otherwise). Also reported: each concurrent request's time to its first streamed byte.

Standard library only (urllib); the binaries are target/release's unless --bins.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import batch_bench  # noqa: E402
import bench  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def post(url: str, body: dict, stream: bool = False,
         times: list | None = None) -> tuple[str, float, float]:
    """(text, seconds to the first byte of the body, seconds to the end); with `times`, the
    monotonic time of every streamed event that carries text is appended to it."""
    t0 = time.monotonic()
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(dict(body, stream=stream)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        first = None
        text = ""
        if stream:
            for raw in r:
                line = raw.decode()
                if first is None and line.startswith("data: "):
                    first = time.monotonic() - t0
                if line.startswith("data: ") and line.strip() != "data: [DONE]":
                    ev = json.loads(line[6:])
                    for c in ev.get("choices", []):
                        text += c.get("text") or ""
                    if times is not None:
                        times.append(time.monotonic())
        else:
            v = json.loads(r.read())
            first = time.monotonic() - t0
            text = v["choices"][0]["text"]
    return text, first or 0.0, time.monotonic() - t0


def mem_available() -> int:
    """MemAvailable in bytes (0 where /proc/meminfo has no such line)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_for_memory(want: int, timeout: float = 120.0) -> None:
    """Wait until MemAvailable is back to `want` bytes (less 256 MB): a stopped store's shared
    memory is freed only when the last process mapping it (a batch worker serve killed) exits,
    and the next budget's store would refuse a plan that does not fit."""
    end = time.monotonic() + timeout
    while mem_available() < want - (256 << 20) and time.monotonic() < end:
        time.sleep(0.5)


class Serve:
    def __init__(self, bins: Path, sock: Path, log: Path, *extra: str):
        self.log = open(log, "w+b")
        self.proc = subprocess.Popen(
            [str(bins / "k3-ctl"), "serve", "--socket", str(sock), "--listen", "127.0.0.1:0",
             "--no-sessions", *extra], stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL)
        line = self.proc.stdout.readline().decode()
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if not m:
            self.stop()
            raise SystemExit(f"serve_bench: serve did not start: {line!r}")
        self.url = f"http://127.0.0.1:{m.group(1)}"
        # The slots its worker decodes at once, as serve says on its first line.
        j = re.search(r"(\d+) job\(s\) at once", line)
        self.slots = int(j.group(1)) if j else None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


SOLOS = 3


def burst(url: str, bodies: list) -> tuple:
    """Every body sent at once, one thread each: (wall seconds from the first send to the last
    answer, each request's (text, first byte, seconds))."""
    results: list = [None] * len(bodies)

    def one(i):
        results[i] = post(url, bodies[i], stream=True)

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.monotonic() - t0, results


def join(url: str, body, prompts: list, n: int, gen: int, solo_first: float) -> dict:
    """A request joining a running batch: n-1 requests stream (each `gen + 6` tokens), and once
    every one of them has 2 tokens a new request is sent; its time to the first streamed token
    against its own solo prefill (the median time to the first byte of the same request sent
    alone, SOLOS times, after the batch) plus two of the running batch's steps (the median gap
    between tokens of the running streams before the join). `solo_first` (the other solo
    requests' median) is reported too."""
    times: list[list[float]] = [[] for _ in range(n - 1)]

    def run(i):
        post(url, dict(body(prompts[i]), max_tokens=gen + 6), stream=True, times=times[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n - 1)]
    for th in threads:
        th.start()
    while any(len(t) < 2 for t in times) and any(th.is_alive() for th in threads):
        time.sleep(0.01)
    before = [t[:] for t in times]
    text, first, _ = post(url, body(prompts[-1]), stream=True)
    for th in threads:
        th.join()
    gaps = [b - a for t in before for a, b in zip(t, t[1:])]
    step = statistics.median(gaps) if gaps else 0.0
    # The same request alone: its own prefill (prompts differ in length).
    alone_runs = [post(url, body(prompts[-1]), stream=True) for _ in range(SOLOS)]
    own_first = statistics.median(r[1] for r in alone_runs)
    bound = own_first + 2 * step
    return {"running": n - 1, "first_byte_s": first, "own_solo_first_byte_s": own_first,
            "own_solo_first_byte_runs_s": [r[1] for r in alone_runs],
            "solo_first_byte_s": solo_first, "prompt_ids": len(prompts[-1]),
            "batch_step_s": step, "bound_s": bound, "within": first <= bound,
            "text_identical_to_alone": all(r[0] == text for r in alone_runs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--trunk", required=True, type=Path)
    ap.add_argument("--bins", type=Path, default=ROOT / "target" / "release")
    ap.add_argument("--budgets", default="all-resident,laptop-like")
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--gen", type=int, default=9)
    ap.add_argument("--modes", default="one,slots,default",
                    help="one (--max-jobs 1), slots (--max-jobs N), default (serve's own slot "
                         "count), own (--no-batch: binaries from before the one-engine serve)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="bursts of N requests together, interleaved with the requests alone; "
                         "`together` is their median (1 on a disk-bound checkpoint: each burst "
                         "takes minutes)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.concurrent < 1 or a.gen < 1:
        ap.error("--rounds, --concurrent and --gen must be at least 1")
    budgets = bench.budgets_for(a.model, a.trunk)
    n = a.concurrent
    # [0, n·rounds): the bursts of n together; then the warm-up; then SOLOS alone; the last: the
    # request that joins.
    prompts = batch_bench.prompts(n * a.rounds + 2 + SOLOS)
    baseline = mem_available()
    cells, same = [], True
    with tempfile.TemporaryDirectory(prefix="k3-serve-bench.") as t:
        tmp = Path(t)
        for name in [b for b in a.budgets.split(",") if b]:
            tb, cb = budgets[name][0], budgets[name][1]
            alone_text: dict[int, str] = {}
            for mode in [m for m in a.modes.split(",") if m]:
                sock = tmp / f"run-{name}-{mode}" / "store.sock"
                wait_for_memory(baseline)
                r = subprocess.run([str(a.bins / "k3-store"), "start", str(a.model), "--trunk", str(a.trunk),
                                    "--trunk-gb", f"{tb / 1e9:.9f}", "--cache-gb", f"{cb / 1e9:.9f}",
                                    "--socket", str(sock), "--detach"], capture_output=True, text=True)
                if r.returncode != 0:
                    raise SystemExit(f"serve_bench: k3-store start failed:\n{r.stderr}")
                try:
                    extra = {"one": ["--max-jobs", "1"], "slots": ["--max-jobs", str(n)],
                             "default": [], "own": ["--max-jobs", str(n), "--no-batch"]}[mode]
                    extra = extra + ["--queue", str(2 * n)]
                    srv = Serve(a.bins, sock, tmp / f"serve-{name}-{mode}.log", *extra)
                    try:
                        body = lambda p: {"model": "kimi-k3", "prompt": p, "max_tokens": a.gen,  # noqa: E731
                                          "temperature": 0}
                        post(srv.url, body(prompts[n * a.rounds]))  # warm-up
                        # Solo requests and bursts of n interleaved, each on prompts nothing else
                        # uses: the host's speed drifts by ±10% within minutes, so the medians
                        # of both are taken over the same stretch of time.
                        alone, bursts = [], []
                        for r in range(max(SOLOS, a.rounds)):
                            if r < SOLOS:
                                alone.append(post(srv.url, body(prompts[n * a.rounds + 1 + r]), stream=True))
                            if r < a.rounds:
                                bursts.append(burst(srv.url, [body(p) for p in prompts[r * n:(r + 1) * n]]))
                        solo = statistics.median(r[2] for r in alone)
                        solo_first = statistics.median(r[1] for r in alone)
                        together = statistics.median(b[0] for b in bursts)
                        results = bursts[0][1]
                        # Each concurrent answer against the same request alone (after the
                        # timing; the later mode uses the first mode's).
                        ok = True
                        for r, (_, res) in enumerate(bursts):
                            for i in range(n):
                                k = r * n + i
                                if k not in alone_text:
                                    alone_text[k] = post(srv.url, body(prompts[k]))[0]
                                ok &= res[i][0] == alone_text[k]
                        same &= ok
                        ratio = n * solo / together
                        cell = {"budget": name, "mode": mode, "concurrent": n, "solo_s": solo,
                                "solo_runs_s": [r[2] for r in alone], "solo_first_byte_s": solo_first,
                                "together_s": together, "together_runs_s": [b[0] for b in bursts],
                                "throughput_ratio": ratio,
                                "first_byte_s": [r[1] for r in results],
                                "texts_identical_to_alone": ok}
                        if mode in ("slots", "default") and n > 1:
                            cell["join"] = join(srv.url, body, prompts, n, a.gen, solo_first)
                            same &= cell["join"]["text_identical_to_alone"]
                        cells.append(cell)
                        slots = srv.slots
                        cell["slots"] = slots
                        print(f"{name:13} {mode:7} ({slots} slots) N={n}: one alone {solo:.1f} s (median of "
                              f"{SOLOS}), {n} together {together:.1f} s (median of {a.rounds}) -> {ratio:.2f}x; first bytes "
                              f"{statistics.median(cell['first_byte_s']):.1f} s median; texts "
                              f"{'identical' if ok else 'DIFFER'}", flush=True)
                        if "join" in cell:
                            j = cell["join"]
                            print(f"{name:13} join: first token {j['first_byte_s']:.2f} s into a running "
                                  f"batch of {n - 1}; bound = its solo prefill {j['own_solo_first_byte_s']:.2f} s + 2 steps x "
                                  f"{j['batch_step_s']:.2f} s = {j['bound_s']:.2f} s -> "
                                  f"{'within' if j['within'] else 'OVER'}", flush=True)
                    finally:
                        srv.stop()
                finally:
                    subprocess.run([str(a.bins / "k3-ctl"), "stop", "--socket", str(sock)],
                                   capture_output=True, timeout=120)
    if a.json:
        a.json.write_text(json.dumps({
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "load_average": list(os.getloadavg()), "model": str(a.model), "trunk": str(a.trunk),
            "gen": a.gen, "cells": cells, "texts_identical": same}, indent=1))
        print(f"wrote {a.json}")
    print("texts identical to each request alone" if same else "TEXTS DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
