#!/usr/bin/env python3
"""Exponent statistics of a checkpoint's BF16 (and F32) tensors, per tensor class — what a
trunk coding (e.g. entropy-coding the BF16 exponent byte) can expect to save.

    python3 scripts/weight_stats.py MODEL_DIR [--json OUT.json] [--max-per-class N]

For every class (embed, lm_head, KDA projections, MLA projections, router, latent down/up,
shared experts, dense MLP, norms/gains, AttnRes queries, F32 vectors) it prints the number of
values, the BF16 exponent histogram's Shannon entropy (bits of the 8-bit exponent field), the
entropy of the sign+mantissa byte, the share of the 5 / 10 most frequent exponents, the
exponent range, and an ideal order-0 coded size of the whole BF16 value relative to 16 bits
(exponent entropy + sign/mantissa entropy, both coded separately). numpy only.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from k3ref.checkpoint import Checkpoint  # noqa: E402

CLASSES = [
    ("embed", r"embed_tokens\.weight$"),
    ("lm_head", r"lm_head\.weight$"),
    ("kda_proj", r"self_attn\.(q|k|v|g|o|b|f_a|f_b)_proj\.weight$"),
    ("mla_proj", r"self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|g_proj)\.weight$"),
    ("router", r"block_sparse_moe\.gate\.weight$"),
    ("latent_down_up", r"routed_expert_(down|up)_proj\.weight$"),
    ("shared_experts", r"shared_experts\..*\.weight$"),
    ("dense_mlp", r"\.mlp\.(gate|up|down)_proj\.weight$"),
    ("attn_res_query", r"res_proj\.weight$"),
    ("norm_gain", r"(norm|layernorm)\.weight$"),
]


def classify(name: str) -> str | None:
    for cls, pat in CLASSES:
        if re.search(pat, name):
            return cls
    return None


def entropy_bits(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def stats(model_dir: Path, max_per_class: int) -> dict:
    ck = Checkpoint(model_dir)
    exp = defaultdict(lambda: np.zeros(256, np.int64))
    sm = defaultdict(lambda: np.zeros(256, np.int64))
    n = defaultdict(int)
    for name in sorted(ck.infos):
        if ck.dtype_of(name) != "BF16":
            continue
        cls = classify(name)
        if cls is None or n[cls] >= max_per_class:
            continue
        a = ck[name].astype(np.float32).ravel()          # exact: BF16 -> f32
        u = a.view(np.uint32) >> 16
        e = (u >> 7) & 0xFF
        s_m = ((u >> 8) & 0x80) | (u & 0x7F)
        exp[cls] += np.bincount(e, minlength=256)
        sm[cls] += np.bincount(s_m, minlength=256)
        n[cls] += a.size
    out = {}
    for cls, _ in CLASSES:
        if cls not in n:
            continue
        h = exp[cls]
        order = np.sort(h)[::-1]
        used = np.nonzero(h)[0]
        he, hs = entropy_bits(h), entropy_bits(sm[cls])
        out[cls] = {
            "values": int(n[cls]), "exponent_entropy_bits": round(he, 3),
            "sign_mantissa_entropy_bits": round(hs, 3),
            "top5_exponent_share": round(float(order[:5].sum() / h.sum()), 4),
            "top10_exponent_share": round(float(order[:10].sum() / h.sum()), 4),
            "exponent_min": int(used.min()) - 127, "exponent_max": int(used.max()) - 127,
            "distinct_exponents": int(used.size),
            "order0_bits_per_value": round(he + hs, 3),
            "histogram": {str(int(i) - 127): int(h[i]) for i in used},
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--max-per-class", type=int, default=10**12,
                    help="stop adding tensors to a class past this many values")
    a = ap.parse_args(argv)
    res = stats(a.model_dir, a.max_per_class)
    print(f"{'class':<16} {'values':>11} {'H(exp)':>7} {'H(s+m)':>7} {'top5':>6} {'range':>11} {'bits/16':>8}")
    for cls, r in res.items():
        print(f"{cls:<16} {r['values']:>11,} {r['exponent_entropy_bits']:>7.3f} "
              f"{r['sign_mantissa_entropy_bits']:>7.3f} {r['top5_exponent_share']:>6.3f} "
              f"{r['exponent_min']:>5}..{r['exponent_max']:<4} {r['order0_bits_per_value']:>8.3f}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
