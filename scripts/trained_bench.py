#!/usr/bin/env python3
"""The weight-dependent figures on a TRAINED checkpoint (issue #31, `scripts/train_k3.py`):
speculation, router lookahead, expert-cache policies against Belady, routing skew.

    python3 scripts/trained_bench.py MODEL_DIR --work DIR [--bins target/release]
        [--what spec,cache,lookahead] [--reps 3] [--gen 64] [--cache-gen 400]
        [--json docs/bench/trained-proxy.json]

Prompts are real text from the corpus's VALIDATION documents (never trained on), tokenized with
the real tokenizer: `fresh` is a passage's opening; `quote` is a passage followed by a blank line
and its own first words again, so a continuation that copies is a right n-gram draft.

spec: per budget (bench.py's laptop-like and trunk-pinned at this checkpoint's scale), per
prompt, round-robin over `--reps` repetitions: --spec off; n-gram K=4 and auto; the int8 and
int4 draft models (`k3-ctl pack-trunk --draft`) K=2 and int8 auto; and the store's history
drafter (the same job twice against one store, the second job's figures). Every run must give
the plain run's ids. cache: one long greedy generation with --dump-cache-trace, replayed by
`k3-ctl replay-trace` at several capacities against Belady; routing skew from the same trace.
lookahead: `k3-worker --dump-hidden` + scripts/lookahead_recall.py.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def sh(cmd, **kw):
    return subprocess.run([str(c) for c in cmd], **kw)


def must(cmd, **kw):
    r = sh(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise SystemExit(f"trained_bench: {cmd[0]} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def prompts() -> dict[str, list[int]]:
    from tok_parity import kimi_encode, load_encoding
    sys.path.insert(0, str(ROOT / "scripts"))
    from k3train import corpus
    enc = load_encoding(str(ROOT / "fixtures" / "tokenizer"))
    docs = corpus.documents(corpus.fetch())
    val = [t for i, (p, t) in enumerate(docs) if i % corpus.VAL_EVERY == 0 and p.startswith("docs/")]
    # a prose passage of the first validation document long enough
    text = next(t for t in val[1:] if len(t) > 4000)
    start = text.index("\n\n", 600) + 2
    passage = text[start:start + 700]
    ids = kimi_encode(enc, passage)
    fresh = [corpus.BOS] + ids[:48]
    body = ids[:96]
    quote = [corpus.BOS] + body + kimi_encode(enc, "\n\n") + body[:12]
    return {"fresh": fresh, "quote": quote}


REUSE = False


def worker(bins, model, trunk, tb, cb, ids, gen, out, extra, socket=None, chunk=1):
    if REUSE and Path(out).exists() and socket is None:
        run = json.loads(Path(out).read_text())       # --reuse: a run an interrupted bench left
        return {**bench.spec_summary(run), "lookahead": run.get("lookahead"),
                "true_resident_hit_rate": run.get("true_resident_hit_rate")}
    if socket is None:
        cmd = [bins / "k3-worker", "--standalone", model, "--trunk", trunk,
               "--trunk-gb", f"{tb / 1e9:.9f}", "--cache-gb", f"{cb / 1e9:.9f}"]
    else:
        cmd = [bins / "k3-worker", "--socket", socket]
    cmd += ["--ids", ",".join(map(str, ids)), "--gen", gen, "--prefill-chunk", chunk, "--out", out, *extra]
    must(cmd)
    run = json.loads(Path(out).read_text())
    return {**bench.spec_summary(run), "lookahead": run.get("lookahead"),
            "true_resident_hit_rate": run.get("true_resident_hit_rate")}


def spec(a, model, trunk, draft8, draft4, budgets, P, work):
    configs = [
        ("off", ["--spec", "off"]),
        ("ngram K=4", ["--spec", "4", "--draft", "ngram"]),
        ("ngram auto", ["--spec", "auto", "--draft", "ngram"]),
        ("int8 K=2", ["--spec", "2", "--draft", "model", "--draft-trunk", draft8]),
        ("int4 K=2", ["--spec", "2", "--draft", "model", "--draft-trunk", draft4]),
        ("int8 auto", ["--spec", "auto", "--draft", "model", "--draft-trunk", draft8]),
    ]
    rows = []
    reps_of = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in a.budget_reps.split(",") if kv}
    for b in ("laptop-like", "trunk-pinned"):
        tb, cb, slots, _ = budgets[b]
        for pname, ids in P.items():
            runs = collections.defaultdict(list)
            for rep in range(reps_of.get(b, a.reps)):
                for name, extra in configs:
                    out = work / f"spec-{b}-{pname}-{name.replace(' ', '_').replace('=', '')}-{rep}.json"
                    runs[name].append(worker(a.bins, model, trunk, tb, cb, ids, a.gen, out, extra))
            plain = runs["off"][0]["generated_ids"]
            off = statistics.median(r["decode_s_per_token"] for r in runs["off"])
            for name, _ in configs:
                rs = runs[name]
                for r in rs:
                    if r["generated_ids"] != plain:
                        raise SystemExit(f"trained_bench: FAILED: {b} {pname} {name} ids differ from plain")
                med = statistics.median(r["decode_s_per_token"] for r in rs)
                rows.append({"budget": b, "slots": slots, "prompt": pname, "drafter": name,
                             "drafted": rs[0]["drafted"], "accepted": rs[0]["accepted"],
                             "acceptance": rs[0]["acceptance"], "forward_passes": rs[0]["forward_passes"],
                             "decode_s_per_token": med, "x_off": med / off,
                             "reps": [r["decode_s_per_token"] for r in rs],
                             "gb_per_token": rs[0]["decode_bytes_per_token"] / 1e9,
                             "lookahead": rs[0]["lookahead"],
                             "true_resident_hit_rate": rs[0]["true_resident_hit_rate"]})
                print(f"  {b:<12} {pname:<5} {name:<10} {med:.4f} s/token ({med / off:.2f}x off) "
                      f"accepted {rs[0]['accepted']}/{rs[0]['drafted']}", flush=True)
            rows.append(history(a, model, trunk, tb, cb, b, slots, pname, ids, plain, off, work))
    return rows


def history(a, model, trunk, tb, cb, b, slots, pname, ids, plain, off, work):
    """The same job twice against one store; the second job's drafts come from the first's."""
    sock = work / f"store-{b}-{pname}.sock"
    outs = [work / f"hist-{b}-{pname}-{j}.json" for j in range(2)]
    if REUSE and all(o.exists() for o in outs):
        res = [worker(a.bins, model, trunk, tb, cb, ids, a.gen, o, []) for o in outs]
        return hist_row(res, b, slots, pname, plain, off)
    must([a.bins / "k3-store", "start", model, "--trunk", trunk, "--trunk-gb", f"{tb / 1e9:.9f}",
          "--cache-gb", f"{cb / 1e9:.9f}", "--socket", sock, "--detach"])
    try:
        res = []
        for j in range(2):
            out = work / f"hist-{b}-{pname}-{j}.json"
            res.append(worker(a.bins, model, trunk, tb, cb, ids, a.gen, out,
                              ["--spec", "auto", "--draft", "history"], socket=sock))
    finally:
        sh([a.bins / "k3-ctl", "stop", "--socket", sock], capture_output=True)
    return hist_row(res, b, slots, pname, plain, off)


def hist_row(res, b, slots, pname, plain, off):
    r = res[1]
    if r["generated_ids"] != plain or res[0]["generated_ids"] != plain:
        raise SystemExit(f"trained_bench: FAILED: history {b} {pname} ids differ from plain")
    print(f"  {b:<12} {pname:<5} history    {r['decode_s_per_token']:.4f} s/token accepted "
          f"{r['accepted']}/{r['drafted']} (first job {res[0]['decode_s_per_token']:.4f})", flush=True)
    return {"budget": b, "slots": slots, "prompt": pname, "drafter": "history (2nd job)",
            "drafted": r["drafted"], "accepted": r["accepted"], "acceptance": r["acceptance"],
            "forward_passes": r["forward_passes"], "decode_s_per_token": r["decode_s_per_token"],
            "x_off": r["decode_s_per_token"] / off, "first_job_s_per_token": res[0]["decode_s_per_token"],
            "gb_per_token": r["decode_bytes_per_token"] / 1e9}


def skew(trace: Path, n_experts: int) -> dict:
    per_layer = collections.defaultdict(collections.Counter)
    steps = set()
    for line in trace.read_text().splitlines():
        rec = json.loads(line)
        steps.add(rec["step"])
        for e in rec["experts"]:
            per_layer[rec["layer"]][e] += 1
    out = {}
    shares_top = []
    ent = []
    for L, c in sorted(per_layer.items()):
        tot = sum(c.values())
        counts = sorted(c.values(), reverse=True) + [0] * (n_experts - len(c))
        p = [x / tot for x in counts if x]
        h = -sum(x * math.log2(x) for x in p)
        top = sum(counts[: max(1, n_experts // 8)]) / tot
        shares_top.append(top)
        ent.append(h)
        out[str(L)] = {"requests": tot, "distinct": len(c), "top_eighth_share": round(top, 4),
                       "entropy_bits": round(h, 3), "max_share": round(counts[0] / tot, 4)}
    return {"per_layer": out, "steps": len(steps), "uniform_entropy_bits": math.log2(n_experts),
            "mean_top_eighth_share": round(statistics.mean(shares_top), 4),
            "mean_entropy_bits": round(statistics.mean(ent), 3)}


def cache(a, model, trunk, budgets, P, work, n_experts):
    tb, cb, _, _ = budgets["all-resident"]
    out = {}
    for pname, ids in P.items():
        d = work / f"trace-{pname}"
        d.mkdir(exist_ok=True)
        worker(a.bins, model, trunk, tb, cb, ids, a.cache_gen, work / f"trace-{pname}.json",
               ["--spec", "off", "--dump-cache-trace", d])
        tr = d / "expert_trace.jsonl"
        caps = [c for c in a.capacities.split(",") if c]
        r = must([a.bins / "k3-ctl", "replay-trace", tr, "--json", *sum((["--capacity", c] for c in caps), [])])
        out[pname] = {"replay": json.loads(r.stdout), "skew": skew(tr, n_experts), "gen": a.cache_gen}
        print(f"  cache trace {pname}: {out[pname]['skew']['steps']} steps", flush=True)
    return out


def lookahead(a, model, trunk, budgets, P, work):
    tb, cb, _, _ = budgets["all-resident"]
    out = {}
    for pname, ids in P.items():
        hid = work / f"hid-{pname}"
        hid.mkdir(exist_ok=True)
        worker(a.bins, model, trunk, tb, cb, ids, 1, work / f"hid-{pname}.json",
               ["--spec", "off", "--dump-hidden", hid], chunk=0)   # every prompt position
        r = must([sys.executable, ROOT / "scripts" / "lookahead_recall.py", model, hid, "--json"])
        out[pname] = json.loads(r.stdout)
    return out


def pct(x):
    return "–" if x is None else f"{100 * x:.1f}%"


def report(res: dict) -> str:
    """Markdown tables of a result JSON (docs/BENCHMARKS.md quotes them)."""
    out = []
    if "spec" in res:
        out += ["| budget | prompt | drafter | accepted / drafted | s/token (median) | × off |",
                "|---|---|---|---|---|---|"]
        for r in res["spec"]:
            acc = f"{r['accepted']}/{r['drafted']}" + (f" ({pct(r['acceptance'])})" if r["drafted"] else "")
            out.append(f"| {r['budget']} ({r['slots']} slots) | {r['prompt']} | {r['drafter']} | {acc} | "
                       f"{r['decode_s_per_token']:.4f} | {r['x_off']:.2f}× |")
        out += ["", "| budget | prompt | lookahead recall | prefetched | used | wasted | "
                "next-pass recall | TRUE resident hits |", "|---|---|---|---|---|---|---|---|"]
        for r in res["spec"]:
            la = r.get("lookahead")
            if r["drafter"] != "off" or not la:
                continue
            mb = lambda b: f"{b / 1e6:.2f} MB"  # noqa: E731
            out.append(f"| {r['budget']} | {r['prompt']} | {pct(la['recall'])} | {mb(la['prefetched_bytes'])} | "
                       f"{mb(la['used_bytes'])} | {mb(la['wasted_bytes'])} | {pct(la['next_pass']['recall'])} | "
                       f"{pct(r['true_resident_hit_rate'])} |")
    if "lookahead" in res:
        for pname, lk in res["lookahead"].items():
            cands = sorted({(c["layers_ahead"], c["point"]) for L in lk["layers"] for c in L["candidates"]})
            out += ["", f"Router lookahead recall, prompt `{pname}` (mean share of the true top-{lk['top_k']}):", "",
                    "| layer | " + " | ".join(f"{p} {d} ahead" for d, p in cands) + " |",
                    "|---|" + "---|" * len(cands)]
            for L in lk["layers"]:
                got = {(c["layers_ahead"], c["point"]): c["recall"] for c in L["candidates"]}
                out.append(f"| {L['layer']} | " + " | ".join(
                    f"{got[k]:.2f}" if k in got else "–" for k in cands) + " |")
    if "cache" in res:
        for pname, c in res["cache"].items():
            rows = c["replay"]["rows"]
            pols = list(dict.fromkeys(r["policy"] for r in rows))
            caps = list(dict.fromkeys(r["capacity"] for r in rows))
            ws = c["replay"].get("working_set")
            out += ["", f"Expert cache, prompt `{pname}`, {c['gen']} generated tokens "
                    f"({c['replay']['requests']} requests, working set {ws}): decode-only TRUE resident hit rate "
                    "(all steps in parentheses)", "",
                    "| slots | " + " | ".join(pols) + " |", "|---:|" + "---:|" * len(pols)]
            for cap in caps:
                cells = []
                for pol in pols:
                    r = next(x for x in rows if x["policy"] == pol and x["capacity"] == cap)
                    cells.append(f"{100 * r['decode_hit_rate']:.1f} ({100 * r['hit_rate']:.1f})")
                out.append(f"| {cap} | " + " | ".join(cells) + " |")
            sk = c["skew"]
            out += ["", f"Routing skew (`{pname}`): mean per-layer entropy {sk['mean_entropy_bits']} bits "
                    f"(uniform {sk['uniform_entropy_bits']:.2f}); the top eighth of experts take "
                    f"{pct(sk['mean_top_eighth_share'])} of a layer's requests (uniform 12.5%)."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--bins", type=Path, default=ROOT / "target" / "release")
    ap.add_argument("--what", default="spec,cache,lookahead")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--cache-gen", type=int, default=400)
    ap.add_argument("--capacities", default="4.5%,9%,18%,36%,73%")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--budget-reps", default="", help="e.g. laptop-like=2,trunk-pinned=1 (else --reps)")
    ap.add_argument("--reuse", action="store_true",
                    help="take the run reports an interrupted bench left in --work instead of rerunning")
    ap.add_argument("--report", type=Path, help="print the markdown tables of a result JSON and exit")
    a = ap.parse_args(argv)
    if a.report:
        print(report(json.loads(a.report.read_text())), end="")
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    global REUSE
    REUSE = a.reuse
    model = a.model.resolve()
    trunk = a.work / "trunk"
    if not (trunk / "trunk.json").exists():
        must([a.bins / "k3-ctl", "pack-trunk", model, trunk])
    drafts = {}
    for q in ("int8", "int4"):
        drafts[q] = a.work / f"draft-{q}"
        if not (drafts[q] / "draft.json").exists():
            must([a.bins / "k3-ctl", "pack-trunk", "--draft", q, model, drafts[q]])
    budgets = bench.budgets_for(model, trunk)
    n_experts = bench.expert_bytes_from_checkpoint(model)[2]
    P = prompts()
    res = {"model": str(a.model), "prompts": P, "gen": a.gen, "reps": a.reps,
           "budgets": {k: {"trunk_bytes": v[0], "cache_bytes": v[1], "slots": v[2], "what": v[3]}
                       for k, v in budgets.items()},
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "commit": sh(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip(),
           "loadavg_start": os.getloadavg()}
    what = set(a.what.split(","))
    if "lookahead" in what:
        res["lookahead"] = lookahead(a, model, trunk, budgets, P, a.work)
    if "cache" in what:
        res["cache"] = cache(a, model, trunk, budgets, P, a.work, n_experts)
    if "spec" in what:
        res["spec"] = spec(a, model, trunk, drafts["int8"], drafts["int4"], budgets, P, a.work)
    res["loadavg_end"] = os.getloadavg()
    text = json.dumps(res, indent=1) + "\n"
    if a.json:
        a.json.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
