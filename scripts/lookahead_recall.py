#!/usr/bin/env python3
"""How well can a MoE layer's experts be predicted before it routes? (issue 14, SPEC §6.7)

    target/release/k3-worker --standalone MODEL --ids ... --gen 1 --dump-hidden HID
    python3 scripts/lookahead_recall.py MODEL HID [--depth 3] [--json]

`--dump-hidden` writes the prefill's per-layer intermediates (`L{l}.attn_in.npy`,
`L{l}.mlp_in.npy`: the aggregated inputs of each layer's attention and MLP, one row per prompt
position). For every MoE layer L this script applies L's own router — RMSNorm with L's
`post_attention_layernorm`, sigmoid scores, the selection bias, top-k, as the float64 reference
(`k3ref.moe`) does — to:

- L's own MLP input: the true choice (`--check-trace` compares it with what the engine routed;
  a near-tie between this float64 router and the engine's float32 one may differ);
- the MLP and attention inputs of the layers before it, up to `--depth` layers back: the
  candidates a lookahead could predict from while those layers compute.

Recall = the share of each position's true top-k that the candidate's top-k contains, averaged
over positions. The engine's lookahead uses layer L-1's MLP input (`K3_LOOKAHEAD=mlp-in`); a
deeper candidate gives the reads more time at some cost in recall. Run it on a real checkpoint
to choose how far ahead to read: synthetic checkpoints have random weights.

Exit codes: 0 ok; 1 a check failed (`--check-trace`); 2 usage error or unreadable inputs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k3ref.checkpoint import CANONICAL_PREFIX, Checkpoint, CheckpointError  # noqa: E402
from k3ref.config import ConfigError, read_config  # noqa: E402
from k3ref.moe import select_top_k  # noqa: E402
from k3ref.ops import rms_norm, sigmoid  # noqa: E402


def top_k(x: np.ndarray, ckpt, layer: int, eps: float, k: int) -> np.ndarray:
    """Layer `layer`'s router on the aggregated MLP-side input `x` [T, E]: the top-k ids [T, k]."""
    pre = f"{CANONICAL_PREFIX}{layer}."
    xn = rms_norm(np.asarray(x, dtype=np.float64), ckpt[pre + "post_attention_layernorm.weight"], eps)
    scores = sigmoid(xn @ ckpt[pre + "block_sparse_moe.gate.weight"].T)
    return select_top_k(scores + ckpt[pre + "block_sparse_moe.gate.e_score_correction_bias"], k)


def recall(pred: np.ndarray, true: np.ndarray) -> float:
    """Mean over rows of |pred ∩ true| / k."""
    k = true.shape[1]
    return float(np.mean([len(set(p.tolist()) & set(t.tolist())) / k for p, t in zip(pred, true)]))


def analyse(model: Path, hidden: Path, depth: int) -> dict:
    cfg = read_config(model / "config.json")
    ckpt = Checkpoint(model)
    k, eps = cfg.num_experts_per_token, cfg.rms_norm_eps
    load = {}
    for l in range(cfg.num_hidden_layers):
        for point in ("attn_in", "mlp_in"):
            f = hidden / f"L{l}.{point}.npy"
            if f.exists():
                load[(l, point)] = np.load(f)
    rows = []
    true_sets = {}
    for l in range(cfg.num_hidden_layers):
        if cfg.is_dense(l) or (l, "mlp_in") not in load:
            continue
        true = top_k(load[(l, "mlp_in")], ckpt, l, eps, k)
        true_sets[l] = sorted(set(true.ravel().tolist()))
        row = {"layer": l, "positions": int(true.shape[0]), "candidates": []}
        for back in range(0, depth + 1):
            src = l - back
            if src < 0:
                break
            for point in ("attn_in", "mlp_in"):
                if back == 0 and point == "mlp_in":
                    continue  # the truth itself
                if (src, point) not in load:
                    continue
                r = recall(top_k(load[(src, point)], ckpt, l, eps, k), true)
                row["candidates"].append({"from_layer": src, "point": point, "layers_ahead": back,
                                          "recall": r})
        rows.append(row)
    return {"model": str(model), "top_k": k, "layers": rows, "routed": true_sets}


def check_trace(doc: dict, trace: Path) -> list[str]:
    """The union over the prompt of each layer's true choice vs the engine's step-0 requests."""
    engine: dict[int, set] = {}
    for line in trace.read_text().splitlines():
        r = json.loads(line)
        if r["step"] == 0:
            engine.setdefault(r["layer"], set()).update(r["experts"])
    bad = []
    for l, ids in doc["routed"].items():
        if sorted(engine.get(l, set())) != ids:
            bad.append(f"layer {l}: engine requested {sorted(engine.get(l, set()))}, router gives {ids}")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("hidden", type=Path, help="a k3-worker --dump-hidden directory")
    ap.add_argument("--depth", type=int, default=3, help="layers back to try (default 3)")
    ap.add_argument("--check-trace", type=Path, metavar="JSONL",
                    help="the same run's --dump-cache-trace expert_trace.jsonl: exit 1 unless "
                         "the router here chose what the engine requested at step 0")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.depth < 1:
        print("lookahead_recall: --depth must be >= 1", file=sys.stderr)
        return 2
    try:
        doc = analyse(a.model, a.hidden, a.depth)
    except (ConfigError, CheckpointError, OSError, KeyError, ValueError) as e:
        print(f"lookahead_recall: {e}", file=sys.stderr)
        return 2
    if not doc["layers"]:
        print(f"lookahead_recall: no MoE layer's mlp_in in {a.hidden}", file=sys.stderr)
        return 2
    bad = check_trace(doc, a.check_trace) if a.check_trace else []
    if a.json:
        print(json.dumps({**doc, "routed": {str(k): v for k, v in doc["routed"].items()},
                          "trace_mismatches": bad}, indent=1))
    else:
        for row in doc["layers"]:
            cands = ", ".join(f"L{c['from_layer']} {c['point']} {c['recall']:.2f}"
                              for c in row["candidates"])
            print(f"layer {row['layer']} ({row['positions']} positions, top-{doc['top_k']}): {cands}")
    for b in bad:
        print(f"lookahead_recall: MISMATCH {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
