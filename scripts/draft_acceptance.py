#!/usr/bin/env python3
"""Draft-model acceptance, independently (issue 48, item 2): what a quantized draft model
(`k3-ctl pack-trunk --draft int8|int4`, SPEC.md §6.10) should have accepted on a prompt, from the
float64 numpy reference (scripts/k3ref) and the same quantization written from the spec
(scripts/quant_quality.py), to hold the engine's speculative runs against.

    python3 scripts/draft_acceptance.py MODEL_DIR --ids FILE.json [--gen 48] [--kinds int8,int4]
        [--experts shared,all] [--engine KIND:EXPERTS:K=REPORT.json ...] [--json OUT]

The exact model's greedy continuation of the prompt is computed (float64); the draft model —
the quantized trunk, its MoE layers on the shared experts alone (`shared`, the engine's
`--draft-experts shared`) or on every routed expert too (`all`, what `--draft-experts resident`
gives when the job's cache holds every expert) — is teacher-forced along the exact ids, and
position t AGREES when its greedy id is the exact model's. Greedy speculation is then exact
arithmetic: a verify pass at t drafts d1 = the draft's id at t (accepted iff t agrees) and, with
K = 2, d2 = its id at t+1 after d1 (accepted iff both agree); every pass emits its accepted ids
and one more. The simulated accepted/drafted counts for K = 1 and 2 are printed beside each
engine report given (`accepted_tokens`/`drafted_tokens` of `k3-worker --out`).

Exit codes: 0 ok; 1 failure; 2 usage or a checkpoint that cannot be bound.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import quant_quality  # noqa: E402
from k3ref.checkpoint import Checkpoint, CheckpointError  # noqa: E402
from k3ref.config import ConfigError, read_config  # noqa: E402
from k3ref.model import BindError, State, bind, forward  # noqa: E402
from k3ref.moe import MoeWeights  # noqa: E402


def shared_only(model):
    """The model with every MoE layer's MLP the shared experts alone."""
    m = copy.copy(model)
    m.layers = []
    for layer in model.layers:
        layer = copy.copy(layer)
        if isinstance(layer.mlp, MoeWeights):
            layer.mlp = layer.mlp.shared
        m.layers.append(layer)
    return m


def greedy(model, prompt: list[int], n: int) -> list[int]:
    st = State.new(model)
    logits = forward(model, prompt, st)[-1]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = forward(model, [out[-1]], st)[-1]
    return out


def agreement(draft, prompt: list[int], gen: list[int]) -> list[bool]:
    """Position t of `gen` agrees when the draft, fed the prompt and gen[:t], picks gen[t]."""
    logits = forward(draft, prompt + gen[:-1], State.new(draft))
    picks = np.argmax(logits[len(prompt) - 1:], axis=-1)
    return [bool(p == g) for p, g in zip(picks, gen)]


def simulate(agree: list[bool], k: int) -> tuple[int, int]:
    """(accepted, drafted) of greedy speculation with K = k over the agreement sequence."""
    t, acc, drafted, n = 0, 0, 0, len(agree)
    while t < n - 1:
        kk = min(k, n - 1 - t)
        drafted += kk
        a = 0
        while a < kk and agree[t + a]:
            a += 1
        acc += a
        t += a + 1
    return acc, drafted


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--ids", type=Path, required=True, help="a JSON list of prompt ids")
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--kinds", default="int8,int4")
    ap.add_argument("--experts", default="shared,all")
    ap.add_argument("--engine", action="append", default=[],
                    help="KIND:EXPERTS:K=REPORT.json, an engine run to compare")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    try:
        cfg = read_config(a.model_dir / "config.json")
        ckpt = Checkpoint(a.model_dir)
        exact = bind(cfg, ckpt)
        drafts = {}
        for kind in a.kinds.split(","):
            full = bind(cfg, quant_quality.Quantized(ckpt, kind))
            for ex in a.experts.split(","):
                drafts[(kind, ex)] = full if ex == "all" else shared_only(full)
    except (ConfigError, CheckpointError, BindError) as e:
        print(f"draft_acceptance: {e}", file=sys.stderr)
        return 2
    prompt = json.loads(a.ids.read_text())
    gen = greedy(exact, prompt, a.gen)
    res = {"prompt_ids": len(prompt), "generated": gen, "drafts": {}}
    print(f"exact greedy: {len(gen)} ids {gen[:16]}...")
    for (kind, ex), d in drafts.items():
        ag = agreement(d, prompt, gen)
        r = {"agreement": sum(ag) / len(ag)}
        for k in (1, 2):
            r[f"K{k}"] = simulate(ag, k)
        res["drafts"][f"{kind}:{ex}"] = r
        print(f"{kind} draft, {ex} experts: agrees at {sum(ag)}/{len(ag)} positions; "
              f"K=1 {r['K1'][0]}/{r['K1'][1]}, K=2 {r['K2'][0]}/{r['K2'][1]}")
    for spec in a.engine:
        kind, ex, rest = spec.split(":", 2)
        k, path = rest.split("=", 1)
        j = json.loads(Path(path).read_text())
        same = j["generated_ids"][:len(gen)] == gen[:len(j["generated_ids"])]
        print(f"engine {kind} {ex} K={k}: accepted {j['accepted_tokens']}/{j['drafted_tokens']} "
              f"(ids {'=' if same else '!='} the reference's)")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
