#!/usr/bin/env python3
"""What `n` choices cost through `k3-ctl serve`: one request with `n` = N against the same request
with `n` = 1, same server, same store.

    python3 scripts/choices_bench.py --model K3SLICE --trunk TRUNK_DIR --budget laptop-like \
        --choices 3 --gen 9 --json docs/bench/choices-k3slice.json

A fresh `k3-store start` with the budget (`scripts/bench.py`'s, at the checkpoint's scale), a
serve process with `--max-jobs N --no-sessions`, one warm-up request, then, alternating, RUNS
requests of `n` = 1 and RUNS of `n` = N on the bench prompt or `--prompt-ids` ids (/v1/completions with prompt ids,
temperature 1, seed 7, `--gen` tokens, streamed): the median wall seconds of each and their
ratio (`extra_cost` = median(n = N) / median(n = 1)), and each one's time to its first streamed
byte (the prompt is prefilled once: the first byte of `n` = N comes after one prefill, not N).
Checked (exit 1 otherwise): choice i of the `n` = N answer is the text of the `n` = 1 request
with seed 7 + i; `usage.prompt_tokens` is the prompt's length and `usage.completion_tokens` the
sum over the choices; serve's `k3_serve_prompt_tokens_total` grows by the prompt's length once
per request whatever `n`.

Standard library only (urllib); the binaries are target/release's unless --bins. Starts and stops
its own store and server (in a temporary directory); changes nothing else.
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
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from serve_bench import Serve  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUNS = 3
SEED = 7


def request(url: str, body: dict) -> tuple[dict, float, float]:
    """A streamed completion folded by choice: ({"choices": {index: (text, finish)}, "usage"},
    seconds to the first text event, seconds to the end)."""
    t0 = time.monotonic()
    req = urllib.request.Request(url + "/v1/completions",
                                 data=json.dumps(dict(body, stream=True, stream_options={"include_usage": True})).encode(),
                                 headers={"Content-Type": "application/json"})
    choices: dict[int, tuple[str, str | None]] = {}
    usage, first = None, None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode()
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for c in ev.get("choices", []):
                text, finish = choices.get(c["index"], ("", None))
                if c.get("text") and first is None:
                    first = time.monotonic() - t0
                choices[c["index"]] = (text + (c.get("text") or ""), c.get("finish_reason") or finish)
    return {"choices": choices, "usage": usage}, first or 0.0, time.monotonic() - t0


def prompt_tokens_total(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        m = re.search(r"^k3_serve_prompt_tokens_total (\d+)", r.read().decode(), re.M)
    return int(m.group(1)) if m else -1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--trunk", required=True, type=Path)
    ap.add_argument("--bins", type=Path, default=ROOT / "target" / "release")
    ap.add_argument("--budget", default="laptop-like")
    ap.add_argument("--choices", type=int, default=3)
    ap.add_argument("--gen", type=int, default=9)
    ap.add_argument("--prompt-ids", type=int, default=0,
                    help="a prompt of this many ids (deterministic) instead of the bench prompt: a long one "
                         "shows the one prefill in the first-byte times")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    tb, cb = bench.budgets_for(a.model, a.trunk)[a.budget][:2]
    prompt = ([(1000 + 104729 * j) % 150000 for j in range(a.prompt_ids)] if a.prompt_ids > 0
              else list(bench.PROMPT))
    body = {"model": "kimi-k3", "prompt": prompt, "max_tokens": a.gen, "temperature": 1.0, "seed": SEED}
    n = a.choices
    ok, why = True, []
    with tempfile.TemporaryDirectory(prefix="k3-choices-bench.") as t:
        tmp = Path(t)
        sock = tmp / "run" / "store.sock"
        r = subprocess.run([str(a.bins / "k3-store"), "start", str(a.model), "--trunk", str(a.trunk),
                            "--trunk-gb", f"{tb / 1e9:.9f}", "--cache-gb", f"{cb / 1e9:.9f}",
                            "--socket", str(sock), "--detach"], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"choices_bench: k3-store start failed:\n{r.stderr}")
        try:
            srv = Serve(a.bins, sock, tmp / "serve.log", "--max-jobs", str(n))
            try:
                request(srv.url, dict(body, seed=SEED + 1000))  # warm-up
                runs: dict[int, list] = {1: [], n: []}
                for _ in range(RUNS):
                    for k in (1, n):
                        before = prompt_tokens_total(srv.url)
                        runs[k].append(request(srv.url, dict(body, n=k)))
                        if prompt_tokens_total(srv.url) - before != len(prompt):
                            ok = False
                            why.append(f"n={k}: the prompt is not counted once in /metrics")
                alone = [runs[1][0][0]] + [request(srv.url, dict(body, seed=SEED + i))[0] for i in range(1, n)]
            finally:
                srv.stop()
        finally:
            subprocess.run([str(a.bins / "k3-ctl"), "stop", "--socket", str(sock)], capture_output=True, timeout=120)
    many = runs[n][0][0]
    if [many["choices"].get(i) for i in range(n)] != [r["choices"][0] for r in alone]:
        ok = False
        why.append("a choice differs from its seed's request alone")
    u = many["usage"] or {}
    alone_ids = sum(r["usage"]["completion_tokens"] for r in alone)
    if u.get("prompt_tokens") != len(prompt) or u.get("completion_tokens") != alone_ids:
        ok = False
        why.append(f"usage {u}")
    med = {k: statistics.median(r[2] for r in v) for k, v in runs.items()}
    first = {k: statistics.median(r[1] for r in v) for k, v in runs.items()}
    cell = {"budget": a.budget, "choices": n, "gen": a.gen, "prompt_ids": len(prompt),
            "one_s": med[1], "many_s": med[n], "extra_cost": med[n] / med[1],
            "one_runs_s": [r[2] for r in runs[1]], "many_runs_s": [r[2] for r in runs[n]],
            "one_first_byte_s": first[1], "many_first_byte_s": first[n],
            "usage_many": u, "choices_equal_their_seeds_alone": ok, "problems": why}
    print(f"{a.budget}: n=1 {med[1]:.2f} s, n={n} {med[n]:.2f} s (median of {RUNS}) -> {cell['extra_cost']:.2f}x; "
          f"first byte {first[1]:.2f} s vs {first[n]:.2f} s; {'checks hold' if ok else 'FAILED: ' + '; '.join(why)}")
    if a.json:
        a.json.write_text(json.dumps({
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "load_average": list(os.getloadavg()), "model": str(a.model), "trunk": str(a.trunk),
            **cell}, indent=1))
        print(f"wrote {a.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
