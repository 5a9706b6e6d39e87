#!/usr/bin/env python3
"""k3 benchmark (docs/BENCHMARKS.md): floors, then per-budget runs.

    scripts/bench.py --quick                          # small checkpoint, generated in a temp dir
    scripts/bench.py --model /tmp/k3slice --trunk T   # a real-dimension slice
    scripts/bench.py --model M --warm-start           # + warm/cold store and standalone start-up
    scripts/bench.py --model M --trunk EXACT --compare-trunks INT8,INT4   # trunks at one budget

In ONE run:
1. floors: disk via `k3-ctl doctor --json` on the checkpoint's filesystem (O_DIRECT random reads
   of one of the checkpoint's experts at QD 1/8/16 — 17,547,264 bytes on k3slice and the full
   model, 52 KB on `small` — sequential direct, buffered); memory read bandwidth via
   the kernels bench (`--memory-only`, or the full kernel table with --kernels);
2. `k3-worker --standalone` at named budgets that mirror the presets at the checkpoint's scale
   (all-resident, trunk-pinned, laptop-like), each for --gen steps (default 7: 6 decode steps),
   interleaved over --reps repetitions;
3. per budget: prefill s, decode s/token (median, min-max over steps >= 1 of every rep), disk GB
   per token (trunk / experts), I/O share, TRUE resident hit rate, peak RSS, the ids' hash, and
   the floor ratio = median decode time / max(disk floor, memory floor). All budgets must give
   identical ids, or the run fails (exit 1).

--concurrent 1,2,4 (only this table): per --concurrent-budgets (default laptop-like,pinned-2:
exactly two trunk layers pinned) one `k3-store start`, one warm-up job, then for each N a batch
of N `k3-worker`s attached at once, each with a different prompt (--concurrent-gen ids each):
batch wall s, aggregate tok/s, speed-up vs N=1, disk and trunk GB per generated token (store
`k3-ctl stats --json` deltas; trunk bytes from the workers' --out when the store does not
count them), per-worker I/O wait, the store's VmHWM, each worker's RssAnon peak (sampled every
~50 ms), and ids checked against a standalone run of each prompt. JSON key "concurrent".

Output: a table on stdout, --json FILE, --plot FILE.png (matplotlib; skipped with a note if it
is missing: pip install -r scripts/requirements-bench.txt).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALIGN = 4096
PROMPT = [17, 200, 3, 99, 42]
# Full-scale preset expert-cache slots as a share of one token's expert reads
# (moe_layers * top_k = 92 * 16 = 1472): laptop 1.0 GB = 56 slots, server 13 GB = 740 slots.
LAPTOP_SLOT_SHARE = 56 / 1472
# The laptop preset's 3 GB trunk budget relative to the full model's largest layer (layer 0,
# 2,341,213,184 B): on k3slice (real layer sizes) laptop-like gets exactly the laptop preset's 3 GB.
LAPTOP_TRUNK_FACTOR = 3.0e9 / 2_341_213_184
SERVER_SLOT_SHARE = 740 / 1472
# Reader threads of the standalone expert cache (StandaloneOptions::io_threads).
ENGINE_EXPERT_READERS = 8


# ---------------------------------------------------------------- small helpers (tested)

def align_up(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


def span_len(off: int, n: int) -> int:
    """Bytes of the 4 KiB-aligned span holding [off, off+n) (k3_store::io::span_len)."""
    return align_up(off + n) - (off // ALIGN * ALIGN)


def med_min_max(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def ids_hash(ids) -> str:
    return hashlib.sha256(",".join(str(i) for i in ids).encode()).hexdigest()[:16]


def trunk_layers(trunk_json: dict):
    """[(run_len, buf_len)] per layer, from trunk.json."""
    return [(l["nbytes"], span_len(l["file_off"], l["nbytes"])) for l in trunk_json["layers"]]


def expert_bytes_from_checkpoint(model: Path) -> tuple[int, int, int, int]:
    """(expert_bytes, moe_layers, n_experts, top_k) from config.json and one expert's tensors."""
    cfg = json.loads((model / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    n_layers = t["num_hidden_layers"]
    dense = t.get("first_k_dense_replace", 0)
    idx = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    want = [n for n in idx if ".experts.0." in n and f"layers.{dense}." in n]
    if len(want) != 6:
        raise SystemExit(f"bench: cannot find the 6 parts of layer {dense} expert 0 in {model}")
    shard = model / idx[want[0]]
    with open(shard, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        if hlen > 1 << 30:
            raise SystemExit(f"bench: {shard}: header length {hlen} is not believable")
        hdr = json.loads(f.read(hlen))
    eb = sum(hdr[n]["data_offsets"][1] - hdr[n]["data_offsets"][0] for n in want)
    return eb, n_layers - dense, t["num_experts"], t["num_experts_per_token"]


def budgets_for(model: Path, trunk: Path) -> dict:
    """`plan_budgets` of a checkpoint and its packed trunk (the budgets every bench script uses)."""
    layers = trunk_layers(json.loads((trunk / "trunk.json").read_text()))
    return plan_budgets(layers, *expert_bytes_from_checkpoint(model))


def plan_budgets(layers, expert_bytes: int, moe_layers: int, n_experts: int, top_k: int):
    """Budgets mirroring the presets at this checkpoint's scale: name -> (trunk bytes, cache bytes,
    expert slots, description). GB values are passed to the worker with 9 decimals (exact bytes);
    a small slack keeps float rounding from losing a slot or a layer."""
    stride = align_up(expert_bytes) + ALIGN  # ExpertReader::slot_stride
    bufs = [b for _, b in layers]
    total_trunk = sum(bufs)
    all_experts = moe_layers * n_experts
    per_token = moe_layers * top_k
    out = {}
    slack = ALIGN
    out["all-resident"] = (total_trunk + slack, all_experts * stride + slack, all_experts,
                           f"all {len(bufs)} trunk layers pinned, all {all_experts} experts cached")
    s = max(top_k, round(SERVER_SLOT_SHARE * per_token))
    out["trunk-pinned"] = (total_trunk + slack, s * stride + slack, s,
                           f"all trunk layers pinned; {s} expert slots (server's 13 GB share of "
                           f"one token's {per_token} expert reads)")
    s = max(top_k, round(LAPTOP_SLOT_SHARE * per_token))
    lap = max(align_up(max(bufs)), int(LAPTOP_TRUNK_FACTOR * max(bufs))) + slack
    out["laptop-like"] = (lap, s * stride + slack, s,
                          f"the laptop preset's trunk budget at this scale (1.28 x the largest "
                          f"layer = 3 GB on k3slice), nothing pinned, all of it the ring; {s} "
                          f"expert slots (laptop's 1 GB share, at least top_k)")
    out["laptop-min"] = (align_up(max(bufs)) + slack, s * stride + slack, s,
                         "the least trunk budget that runs: a ring of exactly the largest layer "
                         "(no read-ahead past it); laptop-like's expert slots")
    out["laptop-2x"] = (2 * lap, s * stride + slack, s,
                        "laptop-like with twice the trunk budget (the plan pins the longest "
                        "prefix that leaves a ring for the largest remaining layer)")
    return out


def floors(decode_trunk_bytes: float, decode_expert_bytes: float, touched_bytes: float,
           seq_mbps: float, rand_mbps: float, mem_gbps: float):
    """Disk floor (trunk at sequential O_DIRECT rate + experts at the engine's random-read
    rate), memory floor (resident bytes touched / memory bandwidth) and the floor (the max)."""
    disk = decode_trunk_bytes / (seq_mbps * 1e6) + decode_expert_bytes / (rand_mbps * 1e6)
    mem = touched_bytes / (mem_gbps * 1e9)
    return {"disk_s": disk, "memory_s": mem, "floor_s": max(disk, mem),
            "bound": "disk" if disk >= mem else "memory"}


def summarize_run(run: dict, trunk_per_step: int):
    """Per-run figures from a worker --out JSON."""
    steps = run["steps"]
    dec = steps[1:]
    n = len(steps)
    dec_bytes = [s["bytes_read"] for s in dec]
    total = run["bytes_read"] or 1
    io_wait = run["io_share"] * run["wall_seconds"]
    dec_sec = [s["seconds"] for s in dec]
    # The median step: a layer read that completes just before or after a step's end is
    # counted in that step or the next, so single steps can show one layer too many or too few.
    med_dec_bytes = statistics.median(dec_bytes) if dec_bytes else 0.0
    trunk_tok = min(trunk_per_step, med_dec_bytes) if dec_bytes else 0.0
    if dec and all("io_wait_seconds" in s for s in dec):
        # The worker measures each step's blocked time and read time itself.
        wait_tok = statistics.mean(s["io_wait_seconds"] for s in dec)
        read = sum(s["io_read_seconds"] for s in dec)
        hidden = 1.0 - sum(s["io_wait_seconds"] for s in dec) / read if read > 0 else None
    else:
        # Older workers report one total: apportion it to decode steps by bytes read.
        wait_tok = io_wait * med_dec_bytes / total if n > 1 else 0.0
        hidden = None
    return {
        "prefill_s": steps[0]["seconds"],
        "decode_s": dec_sec,
        "decode_bytes": dec_bytes,
        "trunk_bytes_per_token": trunk_tok,
        "expert_bytes_per_token": max(0.0, med_dec_bytes - trunk_tok),
        "io_share": run["io_share"],
        "io_wait_per_decode_token_s": wait_tok,
        "decode_io_hidden": None if hidden is None else max(0.0, min(1.0, hidden)),
        "true_resident_hit_rate": run["true_resident_hit_rate"],
        "peak_rss_bytes": run["peak_rss_bytes"],
        "generated_ids": run["generated_ids"],
        "wall_s": run["wall_seconds"],
        "startup_s": run["wall_seconds"] - sum(s["seconds"] for s in steps),
        # The expert cache filled before the first token (`--preload`; part of startup_s; 0 for
        # workers from before it).
        "preload_s": (run.get("preload") or {}).get("seconds", 0.0),
        "preload_bytes": (run.get("preload") or {}).get("bytes", 0),
        "trunk_bytes_read": run["trunk_bytes_read"],
        "expert_bytes_read": run["expert_bytes_read"],
        "steps": n,
        # Where a decoded token's time went (workers since the phase report; None before).
        "time_breakdown": run.get("time_breakdown"),
    }


PHASES = ("attention_s", "mlp_s", "lm_head_s", "expert_wait_s", "layer_wait_s", "other_s")


def time_breakdown(runs: list[dict]):
    """Median over runs of each phase's seconds per decoded token (None if any run lacks it)."""
    tbs = [r.get("time_breakdown") for r in runs]
    if not tbs or any(not tb for tb in tbs):
        return None
    return {k: statistics.median(tb[k] for tb in tbs) for k in PHASES}


def fmt_breakdown(rows) -> str:
    """Where a decoded token's time goes, per budget (ms), and the phases' share of it."""
    head = ("budget", "attention", "mlp", "lm_head", "expert wait", "layer wait", "other",
            "sum ms/token")
    lines = [head]
    for r in rows:
        tb = r.get("time_breakdown")
        if not tb:
            continue
        total = sum(tb[k] for k in PHASES)
        lines.append((r["budget"], *(f"{1e3 * tb[k]:.2f} ({100 * tb[k] / total:.0f}%)"
                                     for k in PHASES), f"{1e3 * total:.2f}"))
    if len(lines) == 1:
        return ""
    w = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(x[i]).ljust(w[i]) for i in range(len(head))) for x in lines)


def fmt_startup(row) -> str:
    """Median seconds from exec to the first forward call, with the expert preload's share."""
    st, pre = row.get("startup_s"), row.get("preload_s")
    if not st:
        return "-"
    if pre and pre["median"] > 0:
        return f"{st['median']:.2f} ({pre['median']:.2f})"
    return f"{st['median']:.2f}"


def fmt_table(rows) -> str:
    head = ("budget", "pinned", "start s (preload)", "prefill s", "decode s/tok (min-max)",
            "GB/tok trunk+exp",
            "I/O share", "I/O hidden", "TRUE hit", "peak RSS GB", "floor s", "floor ratio",
            "per-run ratio", "ids hash")
    lines = [head]
    for r in rows:
        d = r["decode_s"]
        lines.append((
            r["budget"], r["pinned"], fmt_startup(r), f"{r['prefill_s']['median']:.2f}",
            f"{d['median']:.3f} ({d['min']:.3f}-{d['max']:.3f})" if d else "-",
            f"{r['trunk_gb_per_token']:.3f}+{r['expert_gb_per_token']:.3f}",
            f"{100 * r['io_share']:.0f}%",
            f"{100 * r['decode_io_hidden']:.0f}%" if r.get("decode_io_hidden") is not None else "-",
            f"{100 * r['true_resident_hit_rate']:.1f}%",
            f"{r['peak_rss_gb']:.2f}", f"{r['floor']['floor_s']:.3f} ({r['floor']['bound']})",
            f"{r['floor_ratio']:.2f}" if r["floor_ratio"] else "-",
            (f"{pr['median']:.2f} ({pr['min']:.2f}-{pr['max']:.2f})"
             if (pr := r.get("floor_ratio_per_run")) else "-"),
            r["ids_hash"]))
    w = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(x[i]).ljust(w[i]) for i in range(len(head))) for x in lines)


# ---------------------------------------------------------------- running things

def sh(cmd, **kw):
    print("+ " + " ".join(str(c) for c in cmd), file=sys.stderr, flush=True)
    return subprocess.run([str(c) for c in cmd], **kw)


def build(bins: Path):
    r = sh(["cargo", "build", "--release", "--quiet", "-p", "k3-worker", "-p", "k3-ctl",
            "-p", "k3-store", "--bins"], cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit("bench: release build failed")


def doctor(bins: Path, target_dir: Path, seconds: float, size_mib: int, read_bytes: int) -> dict:
    """`k3-ctl doctor --json`, its random reads `read_bytes` long: the checkpoint's expert, so
    that the floor of a checkpoint with small experts prices their reads at what the disk gives
    for reads that small (latency-bound), not at a full-size expert's rate."""
    r = sh([bins / "k3-ctl", "doctor", "--json", "--dir", target_dir, "--seconds", seconds,
            "--size-mib", size_mib, "--read-bytes", read_bytes], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench: k3-ctl doctor failed:\n{r.stderr}")
    return json.loads(r.stdout)


def direct_rates(bins: Path, trunk_bin: Path, shard: Path, seconds: float, read_bytes: int):
    """The disk right now, on the checkpoint's own files (what the engine reads; this VM's disk
    speed depends on what the host has cached): `k3-ctl doctor` reading in place, sequential
    O_DIRECT over trunk.bin and random O_DIRECT reads of `read_bytes` (one expert) at QD8 over a
    shard.
    Returns (sequential MB/s, random MB/s)."""
    def rate(target: Path, name: str) -> float:
        m = {x["name"]: x
             for x in doctor(bins, target, seconds, 0, read_bytes)["disk"]["measurements"]}
        return m[name]["mb_per_s"]["median"]
    return (rate(trunk_bin, "sequential_direct"),
            rate(shard, f"random_qd{ENGINE_EXPERT_READERS}"))


def memory_bench(out: Path, full_kernels: bool) -> dict:
    cmd = ["cargo", "bench", "--quiet", "-p", "k3-worker", "--bench", "kernels", "--",
           "--json", out, "--reps", "5"]
    if not full_kernels:
        cmd.append("--memory-only")
    r = sh(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench: kernels bench failed:\n{r.stdout}\n{r.stderr}")
    return json.loads(out.read_text())


def run_worker(bins: Path, model: Path, trunk: Path, trunk_b: int, cache_b: int, gen: int,
               out: Path, chunk: int, extra=("--spec", "off"), ids=None) -> tuple[dict, str]:
    """One standalone worker run (prompt `ids`, default PROMPT); plain decoding unless `extra`
    says otherwise (the budget table measures one forward pass per token; --spec measures
    speculation separately)."""
    cmd = [bins / "k3-worker", "--standalone", model, "--trunk", trunk,
           "--trunk-gb", f"{trunk_b / 1e9:.9f}", "--cache-gb", f"{cache_b / 1e9:.9f}",
           "--ids", ",".join(map(str, ids or PROMPT)), "--gen", gen, "--prefill-chunk", chunk,
           "--out", out, *extra]
    r = sh(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench: worker failed (exit {r.returncode}):\n{r.stderr}")
    return json.loads(out.read_text()), r.stderr


def pinned_line(stderr: str) -> str:
    for line in stderr.splitlines():
        if "PINNED" in line:
            return " ".join(line.split()[3:])
    return "?"


def pinned_count(stderr: str, n_layers: int) -> int:
    for line in stderr.splitlines():
        if "layers PINNED" in line:
            tok = [t for t in line.split() if "/" in t and t.split("/")[0].isdigit()]
            if tok:
                return int(tok[0].split("/")[0])
    return n_layers


def plot(rows, path: Path, title: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib missing: no plot (pip install -r scripts/requirements-bench.txt)"
    names = [r["budget"] for r in rows]
    tot = [r["decode_s"]["median"] for r in rows]
    io = [min(r["io_wait_per_decode_token_s"], t) for r, t in zip(rows, tot)]
    comp = [t - i for t, i in zip(tot, io)]
    floor = [r["floor"]["floor_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, comp, label="compute (+ overlapped I/O)")
    ax.bar(names, io, bottom=comp, label="I/O wait (engine blocked on weights)")
    ax.scatter(names, floor, color="k", marker="_", s=800, label="floor", zorder=3)
    ax.set_ylabel("seconds per decode token (median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot: {path}"


# ---------------------------------------------------------------- warm start

def warm_start(bins: Path, model: Path, trunk: Path, budget, gen: int, work: Path, chunk: int):
    """Exec -> first token (stdout timestamp) and per-worker peak RSS for (a) a warm store,
    (b) a store that just started, (c) --standalone from cold. Same budget everywhere."""
    trunk_b, cache_b = budget[0], budget[1]
    sock = work / "run" / "store.sock"
    ids = ",".join(map(str, PROMPT))

    def timed(cmd):
        t0 = time.monotonic()
        p = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        first = None
        # The worker prints "ID " per token as it arrives (no tokenizer).
        while True:
            b = p.stdout.read(1)
            if not b:
                break
            if b == b" " and first is None:
                first = time.monotonic() - t0
        err = p.stderr.read().decode(errors="replace")
        rc = p.wait()
        total = time.monotonic() - t0
        if rc != 0:
            raise SystemExit(f"bench: warm-start worker failed ({rc}):\n{err}")
        return first, total, err

    def worker(out, attached):
        base = [bins / "k3-worker", "--ids", ids, "--gen", gen, "--prefill-chunk", chunk,
                "--out", out]
        if attached:
            return timed(base + ["--socket", sock])
        return timed(base + ["--standalone", model, "--trunk", trunk, "--trunk-gb",
                             f"{trunk_b / 1e9:.9f}", "--cache-gb", f"{cache_b / 1e9:.9f}"])

    def start_store():
        t0 = time.monotonic()
        r = sh([bins / "k3-store", "start", model, "--trunk", trunk, "--trunk-gb",
                f"{trunk_b / 1e9:.9f}", "--cache-gb", f"{cache_b / 1e9:.9f}", "--socket", sock,
                "--detach"], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"bench: k3-store start failed:\n{r.stderr}")
        return time.monotonic() - t0

    def stop_store():
        sh([bins / "k3-ctl", "stop", "--socket", sock], capture_output=True)

    res = {}
    # Standalone first: a store that was just stopped may not have returned its memory yet.
    f, t, _ = worker(work / "ws-standalone.json", False)
    res["standalone_cold"] = {"first_token_s": f, "exit_s": t,
                              "run": json.loads((work / "ws-standalone.json").read_text())}
    try:
        st = start_store()
        f, t, _ = worker(work / "ws-cold-store.json", True)
        res["cold_store"] = {"store_start_s": st, "first_token_s": f, "exit_s": t,
                             "run": json.loads((work / "ws-cold-store.json").read_text())}
        f, t, _ = worker(work / "ws-warm-store.json", True)
        res["warm_store"] = {"first_token_s": f, "exit_s": t,
                             "run": json.loads((work / "ws-warm-store.json").read_text())}
    finally:
        stop_store()
    ids0 = {k: v["run"]["generated_ids"] for k, v in res.items()}
    if len({tuple(v) for v in ids0.values()}) != 1:
        raise SystemExit(f"bench: warm-start modes disagree on ids: {ids0}")
    for v in res.values():
        r = v.pop("run")
        v.update({"peak_rss_bytes": r["peak_rss_bytes"], "prefill_s": r["prefill_seconds"],
                  "true_resident_hit_rate": r["true_resident_hit_rate"],
                  "bytes_read": r["bytes_read"], "ids_hash": ids_hash(r["generated_ids"])})
    return res


# ---------------------------------------------------------------- full-model projection

# Full-scale Kimi K3 (SPEC.md §2.9; the same figures as k3_store::plan's full-scale tests and
# k3-ctl doctor): trunk bytes of layer 0 (KDA + dense MLP), a KDA+MoE layer, an MLA+MoE layer.
FULL = {"dense": 2_341_213_184, "kda_moe": 1_267_744_256, "mla_moe": 844_335_616,
        "n_kda_moe": 68, "n_mla_moe": 24, "moe_layers": 92, "experts": 896, "top_k": 16,
        "expert_bytes": 17_547_264, "lm_head": 163_840 * 7168 * 2}
PRESET_GB = {"laptop": (3.0, 1.0), "desktop": (16.0, 10.0), "workstation": (60.0, 30.0),
             "server": (110.0, 13.0), "max": (110.0, 109.0)}
# kimi-k3-in-c: TRUE resident hit rate was 0% below ~36 GB of expert arena (flat routing).
HIT_THRESHOLD_BYTES = 36e9


def full_layers():
    """Trunk bytes per layer at full scale: MLA at 3, 7, ..., 91 and 92, KDA elsewhere."""
    return [FULL["dense"] if l == 0 else FULL["mla_moe"] if (l + 1) % 4 == 0 or l == 92
            else FULL["kda_moe"] for l in range(93)]


def pinned_prefix(layers, budget: int) -> int:
    """Largest prefix that leaves room for a ring holding the largest remaining layer
    (k3_store::plan::MemoryPlan::compute; the rest of the budget is the ring)."""
    n = len(layers)
    for p in range(n, -1, -1):
        ring = max(align_up(x) for x in layers[p:]) if p < n else 0
        if sum(layers[:p]) + ring <= budget:
            return p
    return 0


def project(res_decode_s: float, touched_slice: float, seq_mbps: float, rand_mbps: float,
            ratio_laptop: float | None, ratio_pinned: float | None = None):
    """Seconds per token of the full model per preset (an ESTIMATE):
    C = compute = all-resident k3slice decode s / touched byte x full-model touched bytes;
    D = disk = streamed trunk bytes / sequential + expert misses x 17.5 MB / random QD8;
    T between max(C, D) (perfect overlap) and C + D (none); 'calibrated' = max(C, D) x the
    floor ratio measured on k3slice at the matching budget (laptop-like when trunk layers stream,
    trunk-pinned when the whole trunk is pinned)."""
    layers = full_layers()
    eb = FULL["expert_bytes"]
    stride = eb + 2 * ALIGN
    touched_full = sum(layers) + FULL["moe_layers"] * FULL["top_k"] * eb + FULL["lm_head"]
    c = res_decode_s / touched_slice * touched_full
    out = []
    for name, (tgb, cgb) in PRESET_GB.items():
        p = pinned_prefix(layers, int(tgb * 1e9))
        streamed = sum(layers[p:])
        slots = min(int(cgb * 1e9) // stride, FULL["moe_layers"] * FULL["experts"])
        hit = 0.0 if slots * stride < HIT_THRESHOLD_BYTES else slots / (FULL["moe_layers"] * FULL["experts"])
        misses = FULL["moe_layers"] * FULL["top_k"] * (1 - hit)
        d = streamed / (seq_mbps * 1e6) + misses * eb / (rand_mbps * 1e6)
        lo, hi = max(c, d), c + d
        ratio = ratio_pinned if p == len(layers) and ratio_pinned else ratio_laptop
        out.append({"preset": name, "pinned_layers": p, "streamed_trunk_gb": streamed / 1e9,
                    "expert_slots": slots, "assumed_hit_rate": hit,
                    "disk_gb_per_token": (streamed + misses * eb) / 1e9,
                    "compute_s": c, "disk_s": d, "overlapped_s": lo, "serial_s": hi,
                    "calibrated_s": lo * ratio if ratio else None,
                    "calibration_ratio": ratio})
    return {"touched_full_bytes": touched_full, "rows": out,
            "formula": "T in [max(C,D), C+D]; C = (k3slice all-resident decode s / k3slice touched "
                       "bytes per token) x full touched bytes per token; D = streamed trunk / "
                       "sequential O_DIRECT + 92*16*(1-h) experts x 17,547,264 B / random QD8 "
                       "O_DIRECT; h = 0 below a 36 GB arena (kimi-k3-in-c's observation), else "
                       "slots / 82,432 (uniform routing)"}


def fmt_projection(pr) -> str:
    lines = [("preset", "pinned", "trunk GB/tok", "exp slots", "hit", "disk GB/tok", "C s",
              "D s", "T overlapped-serial s", "calibrated s")]
    for r in pr["rows"]:
        lines.append((r["preset"], f"{r['pinned_layers']}/93", f"{r['streamed_trunk_gb']:.1f}",
                      str(r["expert_slots"]), f"{100 * r['assumed_hit_rate']:.1f}%",
                      f"{r['disk_gb_per_token']:.1f}", f"{r['compute_s']:.1f}",
                      f"{r['disk_s']:.1f}", f"{r['overlapped_s']:.1f}-{r['serial_s']:.1f}",
                      f"{r['calibrated_s']:.1f}" if r["calibrated_s"] else "-"))
    w = [max(len(x[i]) for x in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(x[i].ljust(w[i]) for i in range(len(w))) for x in lines)


def projection_from(doc: dict):
    rows = {r["budget"]: r for r in doc["budgets"]}
    if "all-resident" not in rows:
        return None
    f = doc["floors_used"]
    rand = next(v for k, v in f.items() if k.startswith("random_qd"))
    lap = rows.get("laptop-like")
    tp = rows.get("trunk-pinned")
    return project(rows["all-resident"]["decode_s"]["median"],
                   doc["checkpoint"]["touched_bytes_per_token"], f["sequential_direct_mb_s"],
                   rand, lap["floor_ratio"] if lap else None, tp["floor_ratio"] if tp else None)


def union_experts(n_experts: int, top_k: int, positions: int) -> float:
    """Expected distinct experts among `positions` top-k choices of one layer, routing taken
    as uniform and independent (consecutive tokens share few of 896 experts)."""
    return n_experts * (1 - (1 - top_k / n_experts) ** positions)


def spec_project(pr: dict, seq_mbps: float, acceptances=(0.5, 0.75, 0.9, 1.0), k_max: int = 8):
    """Full-model s/token with speculative decoding per preset (an ESTIMATE) from the plain
    projection `pr` (project()): a pass of K drafts reads the streamed trunk and its weights in
    memory ONCE, and reads and computes the union of K+1 positions' experts; with no overlap,
    T(K) = Dtrunk + Ctrunk + (Dexp + Cexp) x U(K+1)/16, U(n) = 896(1 - (1 - 16/896)^n), the
    compute C split by the bytes it touches (trunk + lm_head vs experts); a pass yields
    E(K) = sum_{i<=K} a^i ids; s/token = min over K <= 8 of T(K)/E(K) (K = 0: plain)."""
    rows = []
    nexp, topk = FULL["experts"], FULL["top_k"]
    # Decode compute is memory-bound: the trunk's share (its weights are read once per pass,
    # whatever the positions) and the experts' share (per distinct expert).
    exp_touched = FULL["moe_layers"] * topk * FULL["expert_bytes"]
    exp_share = exp_touched / pr["touched_full_bytes"]
    for r in pr["rows"]:
        dtrunk = r["streamed_trunk_gb"] * 1e9 / (seq_mbps * 1e6)
        once = dtrunk + r["compute_s"] * (1 - exp_share)
        rest = r["disk_s"] - dtrunk + r["compute_s"] * exp_share
        plain = once + rest
        row = {"preset": r["preset"], "plain_s": plain, "by_acceptance": {}}
        for a in acceptances:
            best = (plain, 0)
            for k in range(1, k_max + 1):
                t = once + rest * union_experts(nexp, topk, k + 1) / topk
                e = sum(a ** i for i in range(k + 1))
                if t / e < best[0]:
                    best = (t / e, k)
            row["by_acceptance"][a] = {"s_per_token": best[0], "k": best[1],
                                       "x_plain": best[0] / plain}
        rows.append(row)
    return {"rows": rows, "acceptances": list(acceptances),
            "formula": "T(K) = Dtrunk + Ctrunk + (Dexp + Cexp) x U(K+1)/16 (serial, no "
                       "overlap); U(n) = 896(1-(1-16/896)^n); C split into trunk+lm_head and "
                       "expert shares by the bytes each touches; E(K) = sum_{i<=K} a^i; "
                       "s/token = min_{K<=8} T(K)/E(K); C, Dtrunk, Dexp from the plain projection"}


def fmt_spec_projection(sp) -> str:
    head = ["preset", "plain s"] + [f"a={a:.0%}: s (K, x plain)" for a in sp["acceptances"]]
    lines = [head]
    for r in sp["rows"]:
        cells = [r["preset"], f"{r['plain_s']:.1f}"]
        for a in sp["acceptances"]:
            b = r["by_acceptance"][a]
            cells.append(f"{b['s_per_token']:.1f} ({b['k']}, {b['x_plain']:.2f})")
        lines.append(cells)
    w = [max(len(x[i]) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(x[i].ljust(w[i]) for i in range(len(w))) for x in lines)


# ---------------------------------------------------------------- concurrent workers on one store

# The concurrent table's prompts: as long as PROMPT and all different (worker i of a batch gets
# prompt i); WARM_PROMPT warms the store and is none of them.
CONC_PROMPTS = [PROMPT, [5, 1000, 77, 12, 9], [300, 8, 4242, 61, 7], [91, 23, 15000, 2, 640]]
WARM_PROMPT = [42, 99, 3, 200, 17]
VOCAB = 163_840
# Store counters the concurrent table reads from `k3-ctl stats --json` (lifetime). Older stores
# call the expert bytes `bytes_read` and have no trunk counters (their workers streamed the
# unpinned layers privately); missing counters are 0.
STORE_COUNTERS = ("expert_bytes_read", "trunk_bytes_read", "trunk_layers_served",
                  "trunk_shared_layers", "trunk_wait_seconds", "broken_leases")


def int_list(s: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (each >= 1)."""
    out = [int(x) for x in s.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise ValueError(f"want a list of counts >= 1, got {s!r}")
    return out


def conc_prompts(n: int) -> list[list[int]]:
    """n different prompts of len(PROMPT) ids: CONC_PROMPTS first, then deterministic others."""
    out = [list(p) for p in CONC_PROMPTS[:n]]
    k = len(out)
    while len(out) < n:
        k += 1
        p = [(17 + 7919 * k + 104_729 * j) % VOCAB for j in range(len(PROMPT))]
        if p not in out and p != WARM_PROMPT:
            out.append(p)
    return out


def pinned_trunk_budget(layers, k: int) -> int:
    """The least trunk budget (+ ALIGN of slack) whose plan pins exactly the first k layers:
    their bytes plus a ring for the largest remaining layer (k3_store::plan::MemoryPlan::compute,
    the rule pinned_prefix mirrors)."""
    bufs = [b for _, b in layers]
    n = len(bufs)
    if not 0 <= k <= n:
        raise ValueError(f"cannot pin {k} of {n} layers")
    b = sum(bufs[:k]) + (max(align_up(x) for x in bufs[k:]) if k < n else 0) + ALIGN
    if pinned_prefix(bufs, b) != k:
        raise ValueError(f"no trunk budget pins exactly {k} of {n} layers")
    return b


def concurrent_budgets(names, budgets: dict, layers) -> dict:
    """Store budgets of the concurrent table: name -> (trunk bytes, cache bytes, expert slots,
    description, pinned layers or None). A plan_budgets name as it is; 'pinned-K' = the least
    trunk budget that pins exactly K layers, with laptop-like's expert slots."""
    out = {}
    for name in names:
        if name in budgets:
            out[name] = (*budgets[name], None)
        elif name.startswith("pinned-") and name[7:].isdigit():
            k = int(name[7:])
            _, cb, slots, _ = budgets["laptop-like"]
            out[name] = (pinned_trunk_budget(layers, k), cb, slots,
                         f"exactly {k} trunk layer(s) pinned (their bytes + a ring for the "
                         f"largest remaining layer); laptop-like's {slots} expert slots", k)
        else:
            raise ValueError(f"unknown budget {name!r} (have {', '.join(budgets)}, pinned-K)")
    return out


def proc_status_bytes(text: str, key: str):
    """`key` (e.g. VmHWM, RssAnon) of a /proc/PID/status text in bytes; None when absent."""
    for line in (text or "").splitlines():
        if line.startswith(key + ":"):
            parts = line.split()
            mult = 1024 if len(parts) > 2 and parts[2].lower() == "kb" else 1
            return int(parts[1]) * mult
    return None


def parse_store_pid(text: str):
    """The store's pid from `k3-store start --detach` ('(pid N)') or `k3-ctl status`
    ('pid N'); None when neither says it."""
    import re
    m = re.search(r"\bpid (\d+)\b", text or "")
    return int(m.group(1)) if m else None


def store_counters(stats: dict) -> dict:
    """The lifetime counters of a `k3-ctl stats --json` answer under both namings (missing: 0),
    and whether the store counts trunk reads itself."""
    lt = {**{k: stats[k] for k in STORE_COUNTERS if k in stats}, **stats.get("lifetime", {})}
    out = {k: lt.get(k, 0) or 0 for k in STORE_COUNTERS}
    if "expert_bytes_read" not in lt:
        out["expert_bytes_read"] = lt.get("bytes_read", 0) or 0
    out["store_counts_trunk"] = "trunk_bytes_read" in lt
    return out


def counters_delta(before: dict, after: dict) -> dict:
    """after - before of store_counters() of two stats answers."""
    b, a = store_counters(before), store_counters(after)
    d = {k: a[k] - b[k] for k in STORE_COUNTERS}
    d["store_counts_trunk"] = a["store_counts_trunk"]
    return d


def summarize_batch(n: int, wall: float, reports, delta: dict, prompts, ref_ids: dict,
                    mem, failures=()) -> dict:
    """One batch of n concurrent attached workers: `reports` their --out JSONs (None for a
    worker that failed: `failures`), `delta` the store's counters_delta over the batch,
    `ref_ids` prompt tuple -> standalone ids, `mem` one {"rss_anon_peak_bytes", "vm_hwm_bytes"}
    per worker (sampled /proc). Tokens and throughput count the workers that finished; with a
    failed worker whose trunk bytes only its report had, bytes per token are None (unknown)."""
    done = [r for r in reports if r is not None]
    tokens = sum(len(r["generated_ids"]) for r in done)
    if delta["store_counts_trunk"]:
        trunk, src = delta["trunk_bytes_read"], "store (k3-ctl stats lifetime trunk_bytes_read delta)"
    else:
        trunk = sum(r.get("trunk_bytes_read", 0) or 0 for r in done)
        src = "workers (sum of --out trunk_bytes_read: each streamed the trunk privately)"
    known = delta["store_counts_trunk"] or len(done) == len(reports)
    expert = delta["expert_bytes_read"]
    match = [None if r is None else r["generated_ids"] == ref_ids[tuple(p)]
             for r, p in zip(reports, prompts)]
    get = lambda k: [None if r is None else r.get(k) for r in reports]  # noqa: E731
    return {
        "n": n, "wall_s": wall, "tokens": tokens,
        "aggregate_tok_s": tokens / wall if wall > 0 and tokens else None,
        "expert_bytes_read": expert, "trunk_bytes_read": trunk if known else None,
        "trunk_bytes_source": src,
        "disk_bytes_per_token": (expert + trunk) / tokens if tokens and known else None,
        "trunk_bytes_per_token": trunk / tokens if tokens and known else None,
        "store_delta": delta,
        "worker_wait_s": get("io_wait_seconds"),
        # Each worker's own view (--out): trunk bytes it streamed itself (old workers) and the
        # expert bytes the store read for its job.
        "worker_trunk_bytes_read": get("trunk_bytes_read"),
        "worker_expert_bytes_read": get("expert_bytes_read"),
        "worker_wall_s": get("wall_seconds"),
        "worker_trunk_wait_s": get("trunk_wait_seconds"),
        "worker_private_peak_bytes": [m["rss_anon_peak_bytes"] for m in mem],
        "worker_vm_hwm_bytes": [m["vm_hwm_bytes"] for m in mem],
        "worker_report_peak_rss_bytes": get("peak_rss_bytes"),
        "prompts": [list(p) for p in prompts],
        "generated_ids": get("generated_ids"),
        "ids_match_per_worker": match,
        "ids_match": all(m is not False for m in match) and any(m for m in match),
        "failed_workers": list(failures),
    }


def conc_row(budget: str, batches) -> dict:
    """The table row of one budget and N from its repetitions (medians; peaks are maxima)."""
    def med(key):
        xs = [b[key] for b in batches if b[key] is not None]
        return statistics.median(xs) if xs else None
    waits = [w for b in batches for w in b["worker_wait_s"] if w is not None]
    priv = [x for b in batches for x in b["worker_private_peak_bytes"] if x is not None]
    store = [b["store_vm_hwm_bytes"] for b in batches if b.get("store_vm_hwm_bytes") is not None]
    return {"budget": budget, "n": batches[0]["n"], "wall_s": med("wall_s"),
            "aggregate_tok_s": med("aggregate_tok_s"),
            "disk_gb_per_token": (d / 1e9 if (d := med("disk_bytes_per_token")) is not None else None),
            "trunk_gb_per_token": (t / 1e9 if (t := med("trunk_bytes_per_token")) is not None else None),
            "worker_wait_s": med_min_max(waits),
            "store_peak_rss_gb": max(store) / 1e9 if store else None,
            "worker_private_peak_gb": max(priv) / 1e9 if priv else None,
            "ids_match": all(b["ids_match"] for b in batches),
            "failed_workers": sum(len(b.get("failed_workers", ())) for b in batches),
            "workers": sum(b["n"] for b in batches),
            "trunk_bytes_source": batches[0]["trunk_bytes_source"],
            "reps": batches}


def add_speedups(rows) -> None:
    """speedup_vs_1 = aggregate tok/s / the same budget's N=1 aggregate tok/s (None without one)."""
    ref = {r["budget"]: r["aggregate_tok_s"] for r in rows if r["n"] == 1}
    for r in rows:
        base = ref.get(r["budget"])
        r["speedup_vs_1"] = (r["aggregate_tok_s"] / base
                             if base and r["aggregate_tok_s"] is not None else None)


def fmt_conc_table(rows) -> str:
    """Markdown table of the concurrent rows."""
    def f(x, spec):
        return "-" if x is None else format(x, spec)
    head = ("budget", "N", "wall s", "aggregate tok/s", "speed-up vs N=1", "disk GB/token",
            "trunk GB/token", "per-worker wait s", "store peak RSS GB", "worker private peak GB",
            "ids match")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        w = r["worker_wait_s"]
        cells = (r["budget"], str(r["n"]), f(r["wall_s"], ".1f"), f(r["aggregate_tok_s"], ".3f"),
                 f(r.get("speedup_vs_1"), ".2f") + ("x" if r.get("speedup_vs_1") else ""),
                 f(r["disk_gb_per_token"], ".3f"), f(r["trunk_gb_per_token"], ".3f"),
                 (f"{w['median']:.2f} ({w['min']:.2f}-{w['max']:.2f})" if w else "-"),
                 f(r["store_peak_rss_gb"], ".2f"), f(r["worker_private_peak_gb"], ".2f"),
                 ("yes" if r["ids_match"] else "**NO**")
                 + (f" ({r['failed_workers']} of {r['workers']} workers FAILED)"
                    if r.get("failed_workers") else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_proc_status(pid: int):
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None


def run_attached_batch(bins: Path, sock: Path, prompts, gen: int, chunk: int, work: Path,
                       tag: str, timeout: float = 3600.0):
    """Start one attached worker per prompt at once, sample each one's /proc status every
    ~50 ms while it runs (RssAnon peak, VmHWM), wait for all. Returns (wall s, --out reports,
    memory samples, per-worker exec->exit s)."""
    procs, outs = [], []
    t0 = time.monotonic()
    for i, p in enumerate(prompts):
        out = work / f"{tag}-w{i}.json"
        err = open(work / f"{tag}-w{i}.stderr", "w")
        cmd = [bins / "k3-worker", "--socket", sock, "--ids", ",".join(map(str, p)),
               "--gen", gen, "--prefill-chunk", chunk, "--out", out, "--spec", "off"]
        procs.append(subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL,
                                      stderr=err))
        err.close()
        outs.append(out)
    print(f"+ {len(procs)} x k3-worker --socket {sock} --gen {gen} (pids "
          f"{', '.join(str(p.pid) for p in procs)})", file=sys.stderr, flush=True)
    mem = [{"rss_anon_peak_bytes": None, "vm_hwm_bytes": None} for _ in procs]
    rcs, ends = [None] * len(procs), [None] * len(procs)
    while any(rc is None for rc in rcs):
        for i, p in enumerate(procs):
            if rcs[i] is not None:
                continue
            # Read before poll(): poll reaps the process and its /proc entry goes.
            st = read_proc_status(p.pid)
            anon, hwm = proc_status_bytes(st, "RssAnon"), proc_status_bytes(st, "VmHWM")
            if anon is not None:
                m = mem[i]
                m["rss_anon_peak_bytes"] = max(m["rss_anon_peak_bytes"] or 0, anon)
            if hwm is not None:
                mem[i]["vm_hwm_bytes"] = max(mem[i]["vm_hwm_bytes"] or 0, hwm)
            rc = p.poll()
            if rc is not None:
                rcs[i], ends[i] = rc, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            for i, p in enumerate(procs):
                if rcs[i] is None:
                    p.kill()
            raise SystemExit(f"bench: concurrent batch {tag} took over {timeout:.0f} s")
        time.sleep(0.05)
    wall = time.monotonic() - t0
    reports, failures = [], []
    for i, (rc, o) in enumerate(zip(rcs, outs)):
        if rc == 0:
            reports.append(json.loads(o.read_text()))
            continue
        # A failed worker is a result too (e.g. an expert cache too small for N jobs at once):
        # recorded, the batch's other workers still count.
        err = (work / f"{tag}-w{i}.stderr").read_text(errors="replace")
        last = [l for l in err.splitlines() if l.strip()]
        failures.append({"worker": i, "exit": rc, "exit_s": ends[i],
                         "error": last[-1] if last else "", "stderr_tail": err[-2000:]})
        reports.append(None)
    return wall, reports, mem, ends, failures


def ctl_stats(bins: Path, sock: Path) -> dict:
    r = subprocess.run([str(bins / "k3-ctl"), "stats", "--json", "--socket", str(sock)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench: k3-ctl stats failed:\n{r.stderr}")
    return json.loads(r.stdout)


def bin_version(bins: Path, name: str) -> str:
    r = subprocess.run([str(bins / name), "--version"], capture_output=True, text=True)
    return (r.stdout or r.stderr).strip()


def concurrent_bench(a, model: Path, trunk: Path, budgets: dict, layers, tmp: Path) -> dict:
    """Per budget: one store; one warm-up job; then for each N a batch of N attached workers at
    once, each with a different prompt and --gen, checked against the standalone ids."""
    ns = int_list(a.concurrent)
    reps = a.concurrent_reps
    gen = a.concurrent_gen
    cb = concurrent_budgets([b for b in a.concurrent_budgets.split(",") if b], budgets, layers)
    prompts = conc_prompts(max(ns))
    # Reference ids: every prompt once, standalone (no store), before any store runs.
    tb, cbytes, _, _ = budgets[a.concurrent_ref_budget]
    ref_ids, ref_runs = {}, []
    for i, p in enumerate(prompts):
        run, _ = run_worker(a.bins, model, trunk, tb, cbytes, gen, tmp / f"conc-ref-{i}.json",
                            a.prefill_chunk, ids=p)
        ref_ids[tuple(p)] = run["generated_ids"]
        ref_runs.append({"prompt": p, "generated_ids": run["generated_ids"],
                         "wall_s": run["wall_seconds"]})
        print(f"  standalone {p}: ids {run['generated_ids']} ({run['wall_seconds']:.1f} s)",
              flush=True)
    rows, stores = [], {}
    for name, (trunk_b, cache_b, slots, desc, want_pinned) in cb.items():
        sock = tmp / f"run-{name}" / "store.sock"
        t0 = time.monotonic()
        r = sh([a.bins / "k3-store", "start", model, "--trunk", trunk, "--trunk-gb",
                f"{trunk_b / 1e9:.9f}", "--cache-gb", f"{cache_b / 1e9:.9f}", "--socket", sock,
                "--detach"], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"bench: k3-store start ({name}) failed:\n{r.stderr}")
        start_s = time.monotonic() - t0
        try:
            pid = parse_store_pid(r.stdout + r.stderr)
            if pid is None:
                st = subprocess.run([str(a.bins / "k3-ctl"), "status", "--socket", str(sock)],
                                    capture_output=True, text=True)
                pid = parse_store_pid(st.stdout)
            s0 = ctl_stats(a.bins, sock)
            pinned = s0.get("pinned_layers")
            if want_pinned is not None and pinned != want_pinned:
                raise SystemExit(f"bench: {name}: the store pinned {pinned} layers, not {want_pinned}")
            print(f"== concurrent: {name} store pid {pid}, {pinned}/{len(layers)} layers pinned, "
                  f"{slots} expert slots, started in {start_s:.1f} s", flush=True)
            w, _, _, _, fail = run_attached_batch(a.bins, sock, [WARM_PROMPT], gen,
                                                  a.prefill_chunk, tmp, f"conc-{name}-warm")
            if fail:
                raise SystemExit(f"bench: {name}: the warm-up job failed:\n"
                                 f"{fail[0]['stderr_tail']}")
            stores[name] = {"trunk_budget_bytes": trunk_b, "cache_budget_bytes": cache_b,
                            "expert_slots": slots, "desc": desc, "pinned_layers": pinned,
                            "store_pid": pid, "store_start_s": start_s, "warm_job_s": w,
                            "store_log_tail": None}
            print(f"  warm-up job {WARM_PROMPT}: {w:.1f} s", flush=True)
            for n in ns:
                batches = []
                for rep in range(reps):
                    before = ctl_stats(a.bins, sock)
                    load0 = os.getloadavg()
                    wall, reports, mem, ends, fail = run_attached_batch(
                        a.bins, sock, prompts[:n], gen, a.prefill_chunk, tmp,
                        f"conc-{name}-n{n}-r{rep}")
                    after = ctl_stats(a.bins, sock)
                    b = summarize_batch(n, wall, reports, counters_delta(before, after),
                                        prompts[:n], ref_ids, mem, fail)
                    b["worker_exit_s"] = ends
                    # Anything else on the 2 CPUs (a build) shows here: the batch shares them.
                    b["load_average_before"], b["load_average_after"] = load0, os.getloadavg()
                    b["store_vm_hwm_bytes"] = (proc_status_bytes(read_proc_status(pid), "VmHWM")
                                               if pid else None)
                    b["store_vm_rss_bytes"] = (proc_status_bytes(read_proc_status(pid), "VmRSS")
                                               if pid else None)
                    batches.append(b)
                    print(f"  {name} N={n} rep {rep}: {wall:.1f} s (load {load0[0]:.2f} -> "
                          f"{b['load_average_after'][0]:.2f}), "
                          f"{b['aggregate_tok_s'] or 0:.3f} tok/s, "
                          f"{(b['disk_bytes_per_token'] or 0) / 1e9:.3f} GB/token, ids "
                          f"{'match' if b['ids_match'] else 'DIFFER'}"
                          + "".join(f"; worker {f['worker']} FAILED (exit {f['exit']}): "
                                    f"{f['error']}" for f in fail), flush=True)
                rows.append(conc_row(name, batches))
        finally:
            sh([a.bins / "k3-ctl", "stop", "--socket", sock], capture_output=True)
            log = sock.parent / "store.log"
            if name in stores and log.exists():
                stores[name]["store_log_tail"] = log.read_text(errors="replace")[-3000:]
    add_speedups(rows)
    return {"n": ns, "gen": gen, "reps": reps, "prompts": prompts, "warm_prompt": WARM_PROMPT,
            "worker_flags": ["--spec", "off", "--prefill-chunk", str(a.prefill_chunk)],
            "standalone_ref_budget": a.concurrent_ref_budget, "standalone_refs": ref_runs,
            "stores": stores, "rows": rows,
            "trunk_bytes_source": sorted({r["trunk_bytes_source"] for r in rows}),
            "notes": ["disk bytes = store lifetime expert bytes delta over the batch + trunk "
                      "bytes (trunk_bytes_source); per generated token (prefill reads included)",
                      "per-worker wait = the worker's --out io_wait_seconds (trunk + experts)",
                      "store peak RSS = the daemon's VmHWM after the batch (since the store "
                      "started; counts the shared memory it touched)",
                      "worker private peak = max RssAnon sampled every ~50 ms; VmHWM in "
                      "worker_vm_hwm_bytes counts mapped shared pages too",
                      "a worker that exits non-zero (e.g. the store cannot lease it a layer's "
                      "top_k expert slots because other workers hold them) is listed in "
                      "failed_workers; tokens and tok/s count the workers that finished"]}


# ---------------------------------------------------------------- main

def spec_summary(run: dict) -> dict:
    """Decode figures per EMITTED id of a run (steps >= 1; a verify pass's time and bytes are
    shared by the ids it emits)."""
    dec = run["steps"][1:]
    n = max(1, len(dec))
    drafted = run.get("drafted_tokens", 0)
    return {
        "decode_s_per_token": sum(s["seconds"] for s in dec) / n,
        "decode_bytes_per_token": sum(s["bytes_read"] for s in dec) / n,
        "forward_passes": run.get("forward_passes", len(dec)),
        "drafted": drafted,
        "accepted": run.get("accepted_tokens", 0),
        "acceptance": run.get("accepted_tokens", 0) / drafted if drafted else None,
        "peak_rss_bytes": run["peak_rss_bytes"],
        "generated_ids": run["generated_ids"],
    }


def fmt_spec_table(rows) -> str:
    head = ("budget", "drafts right", "K", "s/token", "plain s/token", "x plain", "GB/token",
            "passes", "accepted/drafted", "peak RSS GB")
    lines = [head]
    for r in rows:
        lines.append((r["budget"], "-" if r["target_acceptance"] is None else
                      f"{100 * r['target_acceptance']:.0f}%", r["k"],
                      f"{r['decode_s_per_token']:.3f}", f"{r['plain_s_per_token']:.3f}",
                      f"{r['x_plain']:.2f}",
                      f"{r['decode_bytes_per_token'] / 1e9:.3f}", r["forward_passes"],
                      f"{r['accepted']}/{r['drafted']}", f"{r['peak_rss_bytes'] / 1e9:.2f}"))
    w = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(x[i]).ljust(w[i]) for i in range(len(head))) for x in lines)


def trunk_codec(trunk: Path) -> str:
    """The codec a packed trunk's trunk.json records (format 5), or "?" for an older one."""
    return json.loads((trunk / "trunk.json").read_text()).get("codec") or "?"


def compare_trunks(a, model: Path, trunks: list, budgets: dict, names: list, tmp: Path) -> dict:
    """The same budgets (sized from the FIRST trunk, the reference: in absolute bytes, so every
    trunk gets the same memory) with several packed trunks of one checkpoint, interleaved per
    repetition (budget, then trunk), in one run: decode s/token, bytes per token, what was
    pinned, and each trunk's ratio to the reference's s/token at that budget (median of the
    per-repetition ratios). Every trunk must give the same ids at every budget; an exact trunk
    (raw, ecbf16) the reference's, a lossy one (int8, int4) its own (how many of its ids equal
    the exact ones is reported)."""
    runs = {(b, t): [] for b in names for t in range(len(trunks))}
    pinned = {}
    for rep in range(a.compare_reps):
        for b in names:
            tb, cb, slots, _ = budgets[b]
            for i, t in enumerate(trunks):
                run, err = run_worker(a.bins, model, t, tb, cb, a.gen,
                                      tmp / f"cmp-{b}-{i}-{rep}.json", a.prefill_chunk)
                tj = json.loads((t / "trunk.json").read_text())
                layers = trunk_layers(tj)
                p = pinned_count(err, len(layers))
                pinned[(b, i)] = f"{p}/{len(layers)} L, {slots} slots"
                runs[(b, i)].append(summarize_run(run, sum(rl for rl, _ in layers[p:])))
                s = runs[(b, i)][-1]
                print(f"  {b:<13} {trunk_codec(t):<7} rep {rep}: decode "
                      f"{statistics.median(s['decode_s']):.3f} s/token, ids {ids_hash(s['generated_ids'])}",
                      flush=True)
    exact = runs[(names[0], 0)][0]["generated_ids"]
    rows, bad = [], []
    for b in names:
        for i, t in enumerate(trunks):
            rs = runs[(b, i)]
            codec = trunk_codec(t)
            own = runs[(names[0], i)][0]["generated_ids"]
            want = exact if codec not in ("int8", "int4") else own
            bad += [(b, codec, k) for k, s in enumerate(rs) if s["generated_ids"] != want]
            ratios = [statistics.median(s["decode_s"]) / statistics.median(r["decode_s"])
                      for s, r in zip(rs, runs[(b, 0)])]
            same = next((k for k, (x, y) in enumerate(zip(own, exact)) if x != y), len(own))
            rows.append({
                "budget": b, "trunk": str(t), "codec": codec, "pinned": pinned[(b, i)],
                "decode_s": med_min_max([x for s in rs for x in s["decode_s"]]),
                "trunk_gb_per_token": statistics.mean(s["trunk_bytes_per_token"] for s in rs) / 1e9,
                "expert_gb_per_token": statistics.mean(s["expert_bytes_per_token"] for s in rs) / 1e9,
                "x_reference": statistics.median(ratios),
                "x_reference_per_rep": ratios,
                "ids_hash": ids_hash(own), "ids_equal_to_exact_prefix": same,
                "runs": rs,
            })
    if bad:
        for b, codec, k in bad:
            print(f"IDS DIFFER: {b} {codec} rep {k}", file=sys.stderr)
        raise SystemExit("bench: FAILED: a trunk gave other ids than it should")
    head = ("budget", "trunk", "pinned", "decode s/token", "x reference", "trunk GB/tok",
            "expert GB/tok", "ids = exact for")
    lines = [head]
    for r in rows:
        d = r["decode_s"]
        lines.append((r["budget"], r["codec"], r["pinned"],
                      f"{d['median']:.3f} ({d['min']:.3f}-{d['max']:.3f})", f"{r['x_reference']:.3f}",
                      f"{r['trunk_gb_per_token']:.3f}", f"{r['expert_gb_per_token']:.3f}",
                      f"{r['ids_equal_to_exact_prefix']}/{len(exact)} ids"))
    w = [max(len(str(x[c])) for x in lines) for c in range(len(head))]
    print("\n".join("  ".join(str(x[c]).ljust(w[c]) for c in range(len(head))) for x in lines))
    print(f"x reference = median over repetitions of (decode s/token / the reference trunk's, "
          f"{trunk_codec(trunks[0])}, in the same repetition)")
    return {"rows": rows, "gen": a.gen, "reps": a.compare_reps, "exact_ids": exact}


def spec_bench(a, model: Path, trunk: Path, budgets: dict, tmp: Path) -> dict:
    """Speculative decoding with replayed drafts: per budget, a plain run gives the ids; then
    the replay drafter proposes them with misses injected (1 - acceptance) at each K (and auto).
    Every run must give the plain run's ids. A plain run precedes every acceptance group and
    one ends the budget, and each speculative run is compared with the mean of the plain runs
    just before and after its group, so drifting load on the machine does not skew the ratios."""
    rows = []
    ks = [k for k in a.spec_ks.split(",") if k]
    accs = [float(x) / 100 for x in a.spec_acceptance.split(",") if x]
    for b in [x for x in a.spec_budgets.split(",") if x]:
        tb, cb, _, _ = budgets[b]
        plains = []

        def plain_run(tag):
            run, _ = run_worker(a.bins, model, trunk, tb, cb, a.gen, tmp / f"spec-{b}-plain-{tag}.json",
                                a.prefill_chunk)
            r = spec_summary(run)
            plains.append(r)
            print(f"  {b:<12} plain: {r['decode_s_per_token']:.3f} s/token", flush=True)
            return r

        first = plain_run("0")
        ids = first["generated_ids"]
        cont = tmp / f"spec-{b}-cont.json"
        cont.write_text(json.dumps(ids))
        groups = []
        for gi, acc in enumerate(accs):
            if gi > 0:
                plain_run(str(gi))
            before = len(plains) - 1
            group = []
            for k in ks:
                reps = []
                for rep in range(a.spec_reps):
                    run, _ = run_worker(
                        a.bins, model, trunk, tb, cb, a.gen,
                        tmp / f"spec-{b}-{acc}-{k}-{rep}.json", a.prefill_chunk,
                        extra=("--spec", k, "--draft", "replay", "--draft-replay", cont,
                               "--draft-miss-rate", f"{1 - acc:.4f}", "--draft-seed", str(rep)))
                    r = spec_summary(run)
                    if r["generated_ids"] != ids:
                        raise SystemExit(f"bench: FAILED: --spec {k} at {acc:.0%} gave "
                                         f"{r['generated_ids']} != plain {ids}")
                    reps.append(r)
                med = statistics.median(r["decode_s_per_token"] for r in reps)
                group.append((acc, k, med, reps))
                print(f"  {b:<12} {acc:4.0%} K={k:<4} {med:.3f} s/token, accepted "
                      f"{reps[0]['accepted']}/{reps[0]['drafted']}", flush=True)
            groups.append((before, group))
        plain_run("end")
        for before, group in groups:
            ref = (plains[before]["decode_s_per_token"] + plains[before + 1]["decode_s_per_token"]) / 2
            for acc, k, med, reps in group:
                rows.append({"budget": b, "target_acceptance": acc, "k": k, **reps[0],
                             "decode_s_per_token": med, "x_plain": med / ref,
                             "plain_s_per_token": ref,
                             "reps": [r["decode_s_per_token"] for r in reps]})
        pm = statistics.median(p["decode_s_per_token"] for p in plains)
        rows.insert(len(rows) - sum(len(g) for _, g in groups),
                    {"budget": b, "target_acceptance": None, "k": "off", **first,
                     "decode_s_per_token": pm, "x_plain": 1.0, "plain_s_per_token": pm,
                     "reps": [p["decode_s_per_token"] for p in plains]})
    return {"rows": rows, "gen": a.gen, "reps": a.spec_reps}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--trunk", type=Path, help="packed trunk dir (packed into a temp dir if absent)")
    ap.add_argument("--quick", action="store_true", help="small checkpoint, short floors")
    ap.add_argument("--gen", type=int, default=7)
    ap.add_argument("--reps", type=int, default=None, help="repetitions per budget (interleaved)")
    ap.add_argument("--budgets", default="all-resident,trunk-pinned,laptop-like")
    ap.add_argument("--prefill-chunk", type=int, default=1,
                    help="worker --prefill-chunk (1: the prefill's expert batches stay <= top_k, "
                         "so the laptop-like cache of top_k slots can serve them)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--warm-start", action="store_true")
    ap.add_argument("--warm-budget", default="trunk-pinned")
    ap.add_argument("--kernels", action="store_true", help="full kernel table, not only memory")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--doctor-seconds", type=float, default=None)
    ap.add_argument("--doctor-dir", type=Path, default=None)
    ap.add_argument("--rep-disk-seconds", type=float, default=0.25,
                    help="after every run, measure sequential (trunk.bin) and random QD8 (largest "
                         "shard) O_DIRECT rates on the checkpoint's own files with k3-ctl doctor "
                         "(this many seconds per round) and report a floor ratio against them too "
                         "(0: off; off with --quick)")
    ap.add_argument("--bins", type=Path, default=ROOT / "target" / "release")
    ap.add_argument("--spec", action="store_true",
                    help="only the speculative-decoding table: replayed drafts at each acceptance "
                         "and K beside plain decoding, per --spec-budgets")
    ap.add_argument("--spec-budgets", default="laptop-like,trunk-pinned")
    ap.add_argument("--spec-ks", default="2,4,8,auto")
    ap.add_argument("--spec-acceptance", default="100,75,50,25,0",
                    help="percent of drafted ids that are right")
    ap.add_argument("--spec-reps", type=int, default=1)
    ap.add_argument("--compare-trunks", metavar="DIR,DIR,...",
                    help="only the trunk comparison: --budgets sized from --trunk (the reference), "
                         "each run with --trunk and every DIR (e.g. int8 and int4 packs of the "
                         "same checkpoint), interleaved, s/token ratios to the reference")
    ap.add_argument("--compare-reps", type=int, default=3)
    ap.add_argument("--concurrent", metavar="N,N,...",
                    help="only the concurrent table: per --concurrent-budgets one store, then "
                         "batches of N attached workers at once (different prompts), e.g. 1,2,4")
    ap.add_argument("--concurrent-budgets", default="laptop-like,pinned-2",
                    help="store budgets: bench budget names, or pinned-K (exactly K trunk layers "
                         "pinned, laptop-like's expert slots)")
    ap.add_argument("--concurrent-gen", type=int, default=6, help="tokens per worker")
    ap.add_argument("--concurrent-reps", type=int, default=1, help="batches per budget and N")
    ap.add_argument("--concurrent-ref-budget", default="trunk-pinned",
                    help="budget of the standalone runs that give each prompt's reference ids")
    ap.add_argument("--project", type=Path, metavar="BENCH_JSON",
                    help="only print the full-model projection from a k3slice bench JSON")
    a = ap.parse_args(argv)
    if a.project:
        doc = json.loads(a.project.read_text())
        pr = projection_from(doc)
        if pr is None:
            raise SystemExit("bench: the JSON has no all-resident budget to project from")
        print("full-model projection (ESTIMATE)\n" + fmt_projection(pr) + "\n" + pr["formula"])
        sp = spec_project(pr, doc["floors_used"]["sequential_direct_mb_s"])
        print("\nwith speculative decoding at acceptance a (ESTIMATE)\n" + fmt_spec_projection(sp)
              + "\n" + sp["formula"])
        return 0
    reps = a.reps or (1 if a.quick else 2)
    if a.gen < 2:
        raise SystemExit("bench: --gen must be >= 2 (decode steps are steps >= 1)")
    if not a.no_build:
        build(a.bins)
    tmp = Path(tempfile.mkdtemp(prefix="k3-bench."))
    try:
        return run(a, reps, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_concurrent(a, model: Path, trunk: Path, budgets: dict, layers, tmp: Path) -> int:
    print(f"== concurrent attached workers on {model} (--gen {a.concurrent_gen}, N "
          f"{a.concurrent}, budgets {a.concurrent_budgets}, bins {a.bins})", flush=True)
    cc = concurrent_bench(a, model, trunk, budgets, layers, tmp)
    print()
    print(fmt_conc_table(cc["rows"]))
    print(f"\ntrunk bytes from: {'; '.join(cc['trunk_bytes_source'])}")
    for note in cc["notes"]:
        print(f"- {note}")
    ok = all(r["ids_match"] for r in cc["rows"])
    print("every concurrent worker that finished gave its prompt's standalone ids" if ok else
          "IDS DIFFER from the standalone runs (see ids_match_per_worker in the JSON)")
    for r in cc["rows"]:
        for b in r["reps"]:
            for f in b["failed_workers"]:
                print(f"FAILED: {r['budget']} N={r['n']} worker {f['worker']} exit {f['exit']} "
                      f"after {f['exit_s']:.1f} s: {f['error']}")
    ok = ok and not any(r["failed_workers"] for r in cc["rows"])
    if a.json:
        out = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                        capture_output=True, text=True).stdout.strip(),
               "bins": str(a.bins.resolve()),
               "bin_versions": {b: bin_version(a.bins, b)
                                for b in ("k3-store", "k3-worker", "k3-ctl")},
               "load_average": os.getloadavg(), "model": str(model), "trunk": str(trunk),
               "prefill_chunk": a.prefill_chunk, "cpus": os.cpu_count(), "concurrent": cc}
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0 if ok else 1


def run(a, reps: int, tmp: Path) -> int:
    model = a.model
    if model is None:
        if not a.quick:
            raise SystemExit("bench: give --model DIR (or --quick to generate the small preset)")
        model = tmp / "small"
        r = sh([sys.executable, ROOT / "scripts" / "make-checkpoint.py", "--preset", "small",
                "--seed", "1", model], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"bench: generating the small checkpoint failed:\n{r.stderr}")
    trunk = a.trunk
    if trunk is None:
        trunk = tmp / "trunk"
        r = sh([a.bins / "k3-ctl", "pack-trunk", model, trunk], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"bench: pack-trunk failed:\n{r.stderr}")
    tj = json.loads((trunk / "trunk.json").read_text())
    layers = trunk_layers(tj)
    eb, moe_layers, n_experts, top_k = expert_bytes_from_checkpoint(model)
    budgets = plan_budgets(layers, eb, moe_layers, n_experts, top_k)
    if a.concurrent:
        return run_concurrent(a, model, trunk, budgets, layers, tmp)
    if a.compare_trunks:
        names = [b for b in a.budgets.split(",") if b]
        for b in names:
            if b not in budgets:
                raise SystemExit(f"bench: unknown budget {b!r} (have {', '.join(budgets)})")
        trunks = [trunk] + [Path(t) for t in a.compare_trunks.split(",") if t]
        print(f"== trunks {', '.join(trunk_codec(t) for t in trunks)} on {model} (prompt {PROMPT}, "
              f"--gen {a.gen}, {a.compare_reps} rep(s))", flush=True)
        cmp = compare_trunks(a, model, trunks, budgets, names, tmp)
        if a.json:
            out = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                   "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                            capture_output=True, text=True).stdout.strip(),
                   "load_average": os.getloadavg(), "model": str(model), "prompt": PROMPT,
                   "prefill_chunk": a.prefill_chunk, "budgets": {b: budgets[b] for b in names},
                   "compare_trunks": cmp}
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(out, indent=1) + "\n")
            print(f"wrote {a.json}")
        return 0
    if a.spec:
        for b in a.spec_budgets.split(","):
            if b and b not in budgets:
                raise SystemExit(f"bench: unknown budget {b!r} (have {', '.join(budgets)})")
        print(f"== speculative decoding on {model} (prompt {PROMPT}, --gen {a.gen})", flush=True)
        sp = spec_bench(a, model, trunk, budgets, tmp)
        print()
        print(fmt_spec_table(sp["rows"]))
        print("\ns/token = decode seconds per emitted id (steps >= 1); plain s/token = the mean of "
              "the plain runs just before and after the row's group (the 'off' row: their median); "
              "x plain = their ratio; GB/token = bytes read per emitted id; drafts right = 1 - the "
              "replay drafter's miss rate; every run gave the plain run's ids")
        if a.json:
            out = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                   "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                            capture_output=True, text=True).stdout.strip(),
                   "load_average": os.getloadavg(), "model": str(model), "prompt": PROMPT,
                   "prefill_chunk": a.prefill_chunk, "spec": sp}
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(out, indent=1) + "\n")
            print(f"wrote {a.json}")
        return 0
    names = [b for b in a.budgets.split(",") if b]
    for b in names:
        if b not in budgets:
            raise SystemExit(f"bench: unknown budget {b!r} (have {', '.join(budgets)})")

    # ---- floors
    print(f"== floors (load {os.getloadavg()[0]:.2f})", flush=True)
    ddir = a.doctor_dir or model.resolve().parent  # the checkpoint's filesystem
    secs = a.doctor_seconds or (0.5 if a.quick else 2.0)
    doc = doctor(a.bins, ddir, secs, 512 if a.quick else 2048, eb)
    disk = {m["name"]: m for m in doc["disk"]["measurements"]}
    seq = disk["sequential_direct"]["mb_per_s"]["median"]
    rnd_name = f"random_qd{ENGINE_EXPERT_READERS}"
    rnd = disk[rnd_name]["mb_per_s"]["median"]
    for m in doc["disk"]["measurements"]:
        r = m["mb_per_s"]
        print(f"  disk {m['name']:<20} {r['median']:8.0f} MB/s ({r['min']:.0f}-{r['max']:.0f})")
    kb = memory_bench(tmp / "kernels.json", a.kernels)
    threads = os.cpu_count() or 1
    mem_rows = kb["memory_read_bandwidth"]
    mem_row = min(mem_rows, key=lambda m: abs(m["threads"] - threads))
    mem_gbps = mem_row["gb_per_s"]["median"]
    for m in mem_rows:
        g = m["gb_per_s"]
        print(f"  memory read {m['threads']} thread(s): {g['median']:.2f} GB/s "
              f"({g['min']:.2f}-{g['max']:.2f})")

    # ---- budgets, interleaved
    print(f"== budgets on {model} (prompt {PROMPT}, --gen {a.gen}, {reps} rep(s))", flush=True)
    rep_disk = 0.0 if a.quick else a.rep_disk_seconds
    # The largest shard: the one holding most experts.
    shard_files = sorted(model.glob("*.safetensors"), key=lambda f: -f.stat().st_size)
    raw = {b: [] for b in names}
    info = {}
    for rep in range(reps):
        for b in names:
            tb, cb, slots, desc = budgets[b]
            run, err = run_worker(a.bins, model, trunk, tb, cb, a.gen, tmp / f"{b}-{rep}.json",
                                  a.prefill_chunk)
            p = pinned_count(err, len(layers))
            info[b] = {"pinned_layers": p, "plan": pinned_line(err), "desc": desc,
                       "trunk_budget_bytes": tb, "cache_budget_bytes": cb, "expert_slots": slots}
            trunk_step = sum(rl for rl, _ in layers[p:])
            raw[b].append(summarize_run(run, trunk_step))
            s = raw[b][-1]
            if rep_disk:
                # The disk right after this run (so the engine never profits from the check).
                s["disk_after_mb_s"] = direct_rates(a.bins, trunk / "trunk.bin", shard_files[0],
                                                    rep_disk, eb)
            print(f"  {b:<13} rep {rep}: prefill {s['prefill_s']:.2f} s, decode "
                  f"{statistics.median(s['decode_s']):.3f} s/token, ids {ids_hash(s['generated_ids'])}",
                  flush=True)
    ref = raw[names[0]][0]["generated_ids"]
    bad = [(b, i) for b in names for i, s in enumerate(raw[b]) if s["generated_ids"] != ref]
    if bad:
        for b, i in bad:
            print(f"IDS DIFFER: {b} rep {i}: {raw[b][i]['generated_ids']} != {ref}", file=sys.stderr)
        raise SystemExit("bench: FAILED: budgets gave different ids")

    lm_head = 0
    cfg = json.loads((model / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    lm_head = t["vocab_size"] * t["hidden_size"] * 2
    run_len_total = sum(rl for rl, _ in layers)
    touched = run_len_total + moe_layers * top_k * eb + lm_head
    rows = []
    for b in names:
        rs = raw[b]
        dec = [x for s in rs for x in s["decode_s"]]
        tr = statistics.mean(s["trunk_bytes_per_token"] for s in rs)
        ex = statistics.mean(s["expert_bytes_per_token"] for s in rs)
        fl = floors(tr, ex, touched, seq, rnd, mem_gbps)
        d = med_min_max(dec)
        # Each run against the disk measured right after it, on the checkpoint's own files.
        per_run = [statistics.median(s["decode_s"]) / floors(
            s["trunk_bytes_per_token"], s["expert_bytes_per_token"], touched,
            s["disk_after_mb_s"][0], s["disk_after_mb_s"][1], mem_gbps)["floor_s"]
            for s in rs if s.get("disk_after_mb_s") and s["decode_s"]]
        rows.append({
            "budget": b, "pinned": f"{info[b]['pinned_layers']}/{len(layers)} L, {info[b]['expert_slots']} slots",
            **info[b],
            "prefill_s": med_min_max([s["prefill_s"] for s in rs]),
            "decode_s": d,
            "trunk_gb_per_token": tr / 1e9, "expert_gb_per_token": ex / 1e9,
            "io_share": statistics.median(s["io_share"] for s in rs),
            "io_wait_per_decode_token_s": statistics.median(s["io_wait_per_decode_token_s"] for s in rs),
            "decode_io_hidden": (statistics.median(s["decode_io_hidden"] for s in rs)
                                 if all(s.get("decode_io_hidden") is not None for s in rs)
                                 else None),
            "true_resident_hit_rate": statistics.median(s["true_resident_hit_rate"] for s in rs),
            "peak_rss_gb": max(s["peak_rss_bytes"] for s in rs) / 1e9,
            "startup_s": med_min_max([s["startup_s"] for s in rs]),
            "preload_s": med_min_max([s["preload_s"] for s in rs]),
            "preload_gb": statistics.median(s["preload_bytes"] for s in rs) / 1e9,
            "floor": fl,
            "floor_ratio": d["median"] / fl["floor_s"] if d and fl["floor_s"] > 0 else None,
            "floor_ratio_per_run": ({"median": statistics.median(per_run), "min": min(per_run),
                                     "max": max(per_run)} if per_run else None),
            "ids_hash": ids_hash(rs[0]["generated_ids"]),
            "time_breakdown": time_breakdown(rs),
            "runs": rs,
        })
    print()
    print(fmt_table(rows))
    bd = fmt_breakdown(rows)
    if bd:
        print("\nwhere a decoded token's time goes (ms, median over runs; worker --out "
              "time_breakdown):")
        print(bd)
    print(f"\nfloor = max(trunk bytes/token / sequential O_DIRECT {seq:.0f} MB/s + expert bytes/token"
          f" / random QD{ENGINE_EXPERT_READERS} O_DIRECT {rnd:.0f} MB/s (the engine's"
          f" {ENGINE_EXPERT_READERS} expert readers), {touched / 1e9:.3f} GB touched/token /"
          f" memory {mem_gbps:.2f} GB/s at {mem_row['threads']} threads)")
    if rep_disk:
        print(f"per-run ratio = each run's median decode time / the floor with the disk measured "
              f"right after that run on the checkpoint's own files (k3-ctl doctor in place: "
              f"sequential O_DIRECT over trunk.bin, random QD{ENGINE_EXPERT_READERS} over the "
              f"largest shard)")
    print(f"all budgets gave identical ids: {ref}")
    out = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "load_average": os.getloadavg(),
        "model": str(model), "prompt": PROMPT, "gen": a.gen, "reps": reps,
        "prefill_chunk": a.prefill_chunk,
        "checkpoint": {"layers": len(layers), "trunk_run_bytes": [rl for rl, _ in layers],
                       "expert_bytes": eb, "moe_layers": moe_layers, "n_experts": n_experts,
                       "top_k": top_k, "lm_head_bytes": lm_head,
                       "touched_bytes_per_token": touched},
        "doctor": doc, "kernels": kb,
        "floors_used": {"sequential_direct_mb_s": seq, f"{rnd_name}_mb_s": rnd,
                        "memory_gb_s": mem_gbps, "memory_threads": mem_row["threads"]},
        "budgets": rows, "generated_ids": ref,
    }
    if t["hidden_size"] == 7168 and "all-resident" in names:
        pr = projection_from(out)
        out["projection"] = pr
        print("\nfull-model projection (ESTIMATE)\n" + fmt_projection(pr) + "\n" + pr["formula"])
    if a.warm_start:
        print("== warm start", flush=True)
        ws = warm_start(a.bins, model, trunk, budgets[a.warm_budget], 2, tmp, a.prefill_chunk)
        out["warm_start"] = {"budget": a.warm_budget, **ws}
        for k, v in ws.items():
            print(f"  {k:<16} exec->first token {v['first_token_s']:.3f} s, exit {v['exit_s']:.3f} s, "
                  f"prefill {v['prefill_s']:.3f} s, peak RSS {v['peak_rss_bytes'] / 1e9:.3f} GB, "
                  f"read {v['bytes_read'] / 1e9:.3f} GB"
                  + (f", store start {v['store_start_s']:.2f} s" if "store_start_s" in v else ""))
    if a.plot:
        print(plot(rows, a.plot, f"{model.name}: decode time per token by budget"))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
