#!/usr/bin/env python3
"""The first job after a store restart, with and without the store's expert usage history
(issue 48 item 3, `k3-store start --state-dir`, `--preload auto` = hot when not every expert
fits): its TRUE resident hit rate against a warm store's for the same job.

    python3 scripts/hot_bench.py MODEL_DIR --work DIR [--bins target/release]
        [--slots 32,56,112] [--history 4] [--history-gen 64] [--gen 16,64] [--lookahead off]
        [--json docs/bench/hot-experts.json]
    python3 scripts/hot_bench.py - --work - --report docs/bench/hot-experts.json   # the table

MODEL_DIR is the trained proxy (`python3 scripts/train_k3.py DIR --expand
fixtures/trained/compact.npz`). Prompts are real text: `--history` + 1 passages of VALIDATION
documents of its corpus (never trained on; `scripts/k3train/corpus.py`, which downloads the
Django sdist with pip once), through the real tokenizer (tiktoken). For each cache of `--slots`
expert slots (all smaller than the model's 224 routed experts) and each `--gen`:

- warm: a store with a new `--state-dir` serves the user's earlier work (the history prompts,
  `--history-gen` ids each); once its usage history is saved, the state directory is copied;
  then the measured job (the last passage, never among the history) runs on that warm store;
- hot: a new store on the copy (its history holds the earlier work only) preloads the most used
  experts and runs the measured job first;
- cold: a new store on an empty state directory runs the measured job first;
- again: the measured job once more on the warm store (a job's best case: its own experts).

Each job's figures are the store's per-job counters (`k3-ctl stats --json`): requests, TRUE
resident hits, hits on preloaded slots. Jobs run with `--spec off` and, unless `--lookahead on`,
`K3_LOOKAHEAD=off`: the requests then do not depend on timing, so the hit rates are exact counts
(any load). Every job's ids must equal the others' (the bench fails otherwise). Target: hot >=
0.8 x warm.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.8
PROMPT_TOKENS = 48


def slot_cache_bytes(slots: int, expert_bytes: int) -> int:
    """`--cache-gb` bytes that buy exactly `slots` expert slots (ExpertReader::slot_stride)."""
    return slots * (bench.align_up(expert_bytes) + bench.ALIGN)


def gb(b: int) -> str:
    return f"{b / 1e9:.9f}"


def rate(c: dict) -> float | None:
    return c["resident_hits"] / c["requests"] if c.get("requests") else None


def job_of(stats: dict, pid: int) -> dict:
    """The counters of the job of worker `pid` in a `k3-ctl stats --json` report."""
    jobs = [j for j in stats["jobs"] if j.get("pid") == pid]
    if len(jobs) != 1:
        raise SystemExit(f"hot_bench: {len(jobs)} jobs of pid {pid} in the store's stats")
    c = jobs[0]["counters"]
    return {k: c[k] for k in ("requests", "resident_hits", "misses", "preload_hits")}


def row(slots: int, gen: int, runs: dict, working_set: int, n_experts: int) -> dict:
    """One table row: each mode's counters and rate, hot and cold against warm."""
    r = {"slots": slots, "share_of_experts": slots / n_experts, "gen": gen,
         "history_working_set": working_set}
    for mode, c in runs.items():
        r[mode] = {**c, "true_resident_hit_rate": rate(c)}
    warm = rate(runs["warm"])
    for mode in ("hot", "cold"):
        x = rate(runs[mode])
        r[f"{mode}_over_warm"] = None if not warm or x is None else x / warm
    r["target_met"] = r["hot_over_warm"] is not None and r["hot_over_warm"] >= TARGET
    return r


def pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def fmt_table(rows: list[dict]) -> str:
    head = ("| slots (of 224) | gen | cold (no history) | **hot (history)** | warm | again | "
            "hot ÷ warm | cold ÷ warm | hot's preload hits |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        h = r["hot"]
        lines.append(
            f"| {r['slots']} ({100 * r['share_of_experts']:.0f}%) | {r['gen']} | "
            f"{pct(r['cold']['true_resident_hit_rate'])} | "
            f"**{pct(h['true_resident_hit_rate'])}** | {pct(r['warm']['true_resident_hit_rate'])} | "
            f"{pct(r['again']['true_resident_hit_rate'])} | "
            f"**{r['hot_over_warm']:.2f}** | {r['cold_over_warm']:.2f} | "
            f"{h['preload_hits']} of {h['resident_hits']} hits ({h['requests']} requests) |")
    return "\n".join(lines)


# ---------------------------------------------------------------- running (not unit-tested)

def sh(cmd, **kw):
    return subprocess.run([str(c) for c in cmd], **kw)


def must(cmd, **kw):
    r = sh(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise SystemExit(f"hot_bench: {cmd[0]} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def prompts(n: int) -> list[list[int]]:
    """`n` passages of different validation documents: [BOS] + PROMPT_TOKENS ids each."""
    from tok_parity import kimi_encode, load_encoding
    from k3train import corpus
    enc = load_encoding(str(ROOT / "fixtures" / "tokenizer"))
    docs = corpus.documents(corpus.fetch())
    val = [t for i, (p, t) in enumerate(docs) if i % corpus.VAL_EVERY == 0 and p.startswith("docs/")]
    out = []
    for text in val:
        if len(text) < 3000:
            continue
        start = text.index("\n\n", 600) + 2
        ids = kimi_encode(enc, text[start:start + 1200])
        if len(ids) >= PROMPT_TOKENS:
            out.append([corpus.BOS] + ids[:PROMPT_TOKENS])
        if len(out) == n:
            return out
    raise SystemExit(f"hot_bench: only {len(out)} validation passages long enough, {n} needed")


class Store:
    def __init__(self, a, model: Path, sock: Path, state: Path, cache_bytes: int):
        self.a, self.sock = a, sock
        must([a.bins / "k3-store", "start", model, "--trunk-gb", "1", "--cache-gb", gb(cache_bytes),
              "--state-dir", state, "--socket", sock, "--detach"])

    def stats(self) -> dict:
        return json.loads(must([self.a.bins / "k3-ctl", "stats", "--json", "--socket", self.sock]).stdout)

    def job(self, ids: list[int], gen: int, out: Path) -> tuple[list[int], dict]:
        env = dict(os.environ)
        if self.a.lookahead == "off":
            env["K3_LOOKAHEAD"] = "off"
        p = subprocess.Popen([str(self.a.bins / "k3-worker"), "--socket", str(self.sock), "--ids",
                              ",".join(map(str, ids)), "--gen", str(gen), "--spec", "off",
                              "--out", str(out)], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        _, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"hot_bench: k3-worker failed ({p.returncode}):\n{err[-3000:]}")
        run = json.loads(out.read_text())
        return run["generated_ids"], job_of(self.stats(), p.pid)

    def saved(self) -> dict:
        for _ in range(300):
            s = self.stats()
            u = s["usage"]
            if u["requests_saved"] == u["requests_counted"]:
                return s
            time.sleep(0.1)
        raise SystemExit("hot_bench: the store did not save its usage history within 30 s")

    def stop(self):
        must([self.a.bins / "k3-ctl", "stop", "--socket", self.sock])


def measure(a, model: Path, work: Path, history, job_ids, slots: int, gen: int, expert_bytes: int,
            n_experts: int) -> dict:
    d = work / f"s{slots}-g{gen}"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    os.chmod(d, 0o700)
    cache = slot_cache_bytes(slots, expert_bytes)
    sock = d / "run" / "store.sock"
    runs, ids = {}, {}
    warm = Store(a, model, sock, d / "state", cache)
    try:
        for i, h in enumerate(history):
            warm.job(h, a.history_gen, d / f"history-{i}.json")
        s = warm.saved()
        working_set = s["usage"]["experts_used"]
        shutil.copytree(d / "state", d / "state-snapshot", symlinks=True)
        ids["warm"], runs["warm"] = warm.job(job_ids, gen, d / "warm.json")
        ids["again"], runs["again"] = warm.job(job_ids, gen, d / "again.json")
    finally:
        warm.stop()
    for mode, state in (("hot", d / "state-snapshot"), ("cold", d / "state-cold")):
        st = Store(a, model, sock, state, cache)
        try:
            pre = st.stats()
            ids[mode], runs[mode] = st.job(job_ids, gen, d / f"{mode}.json")
            runs[mode]["preloaded"] = pre["lifetime"]["preloaded_experts"]
            runs[mode]["preload"] = pre["usage"]["preload"]
        finally:
            st.stop()
    if len({tuple(v) for v in ids.values()}) != 1:
        raise SystemExit(f"hot_bench: FAILED: the measured job's ids differ between modes: {ids}")
    if runs["hot"]["preload"] != "hot" or runs["hot"]["preloaded"] != min(slots, working_set):
        raise SystemExit(f"hot_bench: FAILED: the restarted store preloaded {runs['hot']}")
    r = row(slots, gen, runs, working_set, n_experts)
    r["ids_hash"] = bench.ids_hash(ids["hot"])
    print(f"  {slots:>4} slots gen {gen:>3}: cold {pct(r['cold']['true_resident_hit_rate'])}  "
          f"hot {pct(r['hot']['true_resident_hit_rate'])}  warm "
          f"{pct(r['warm']['true_resident_hit_rate'])}  again "
          f"{pct(r['again']['true_resident_hit_rate'])}  hot/warm {r['hot_over_warm']:.2f}",
          flush=True)
    shutil.rmtree(d)
    return r


def git_commit() -> str:
    r = sh(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="the expanded trained proxy (or - with --report)")
    ap.add_argument("--work", required=True, help="scratch directory (removed runs), or - with --report")
    ap.add_argument("--bins", type=Path, default=ROOT / "target" / "release")
    ap.add_argument("--slots", default="32,56,112")
    ap.add_argument("--history", type=int, default=4, help="earlier jobs (prompts) before the restart")
    ap.add_argument("--history-gen", type=int, default=64)
    ap.add_argument("--gen", default="16,64", help="ids the measured job generates")
    ap.add_argument("--lookahead", choices=["off", "on"], default="off")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, help="print the table of an earlier --json and exit")
    a = ap.parse_args()
    if a.report:
        print(fmt_table(json.loads(a.report.read_text())["rows"]))
        return
    model, work = Path(a.model), Path(a.work)
    for b in ("k3-store", "k3-worker", "k3-ctl"):
        if not (a.bins / b).exists():
            raise SystemExit(f"hot_bench: {a.bins / b} missing (cargo build --release --bins)")
    expert_bytes, moe_layers, n_experts, top_k = bench.expert_bytes_from_checkpoint(model)
    routed = moe_layers * n_experts
    slots = bench.int_list(a.slots)
    if any(s >= routed for s in slots):
        raise SystemExit(f"hot_bench: every --slots must be below the {routed} routed experts")
    work.mkdir(parents=True, exist_ok=True)
    all_prompts = prompts(a.history + 1)
    history, job_ids = all_prompts[:-1], all_prompts[-1]
    rows = []
    print(f"hot_bench: {model}, {routed} routed experts (top-{top_k}), history {a.history} x "
          f"{a.history_gen} ids, lookahead {a.lookahead}", flush=True)
    for s in slots:
        for g in bench.int_list(a.gen):
            rows.append(measure(a, model, work, history, job_ids, s, g, expert_bytes, routed))
    doc = {
        "what": "TRUE resident hit rate of the first job after a store restart: cold (no usage "
                "history), hot (the history of the earlier jobs, --preload auto -> hot), warm "
                "(the store that ran the earlier jobs), again (the same job a second time)",
        "model": str(model), "routed_experts": routed, "top_k": top_k,
        "history_prompts": len(history), "history_gen": a.history_gen,
        "prompt_tokens": PROMPT_TOKENS + 1, "lookahead": a.lookahead, "spec": "off",
        "k3_version": bench.bin_version(a.bins, "k3-store"),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target_hot_over_warm": TARGET,
        "rows": rows,
    }
    print(fmt_table(rows))
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"hot_bench: wrote {a.json}")


if __name__ == "__main__":
    main()
