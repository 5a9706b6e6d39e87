#!/usr/bin/env python3
"""Synthetic expert-cache traces in the format of `k3-worker --dump-cache-trace`.

One file per prompt (a "job"), one JSON line per (step, layer) batch:
    {"step": 0, "layer": 3, "experts": [...]}      # prefill: union over the prompt's tokens
    {"step": 5, "layer": 3, "experts": [...]}      # decode token 5: the layer's top-k

Router model, per MoE layer l and token t (no claim beyond "router-like"):
    logits[e] = bias[l, e] + beta * <key[l, e], R[l] z_t> + noise * N(0, 1)
    experts   = top-k of logits, in descending logit order
- bias ~ N(0, skew): a mild popularity skew (what a load-balancing loss leaves behind);
- key[l, e] unit vectors in R^d, R[l] a random d x d map: each layer reads the same token
  state differently;
- z_t, the token state, follows an AR(1) chain inside a prompt, z_t = rho z_{t-1} +
  sqrt(1 - rho^2) eps_t, starting from a per-prompt topic vector: consecutive tokens share
  experts, different prompts route differently.
The script prints the resulting load balance (max/mean expert load) and the token-to-token
overlap (share of a layer's top-k also chosen by the previous token; uniform routing gives k/E).

Usage:
    scripts/gen_trace.py OUT_DIR --seed 1 [--prompts 8] [--experts 256] [--top-k 8]
        [--layers 10] [--prompt-len 3 12] [--gen 96] [--skew 0.2] [--rho 0.7] [--beta 2]
        [--noise 1] [--dim 32]
"""

import argparse
import json
import os

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--model-seed", type=int, default=None,
                    help="seed of the router (bias, keys, maps); default: --seed")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[3, 12])
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--skew", type=float, default=0.2)
    ap.add_argument("--rho", type=float, default=0.7)
    ap.add_argument("--beta", type=float, default=2.0)
    ap.add_argument("--noise", type=float, default=1.0)
    ap.add_argument("--dim", type=int, default=32)
    a = ap.parse_args()
    if not (0 < a.top_k <= a.experts and a.layers > 0 and a.prompts > 0 and a.gen >= 0):
        ap.error("need 0 < top-k <= experts, layers > 0, prompts > 0, gen >= 0")
    if not (1 <= a.prompt_len[0] <= a.prompt_len[1]) or not (0 <= a.rho < 1):
        ap.error("need 1 <= prompt-len min <= max and 0 <= rho < 1")

    mrng = np.random.default_rng(a.seed if a.model_seed is None else a.model_seed)
    E, K, L, D = a.experts, a.top_k, a.layers, a.dim
    bias = mrng.normal(0.0, a.skew, size=(L, E)) if a.skew > 0 else np.zeros((L, E))
    keys = mrng.normal(size=(L, E, D))
    keys /= np.linalg.norm(keys, axis=2, keepdims=True)
    maps = mrng.normal(size=(L, D, D)) / np.sqrt(D)

    rng = np.random.default_rng(a.seed * 1_000_003 + 17)
    os.makedirs(a.out_dir, exist_ok=True)
    load = np.zeros((L, E))
    overlap, pairs = 0, 0

    def route(z):
        out = []
        for l in range(L):
            logits = bias[l] + a.beta * keys[l] @ (maps[l] @ z) + a.noise * rng.normal(size=E)
            top = np.argpartition(-logits, K - 1)[:K]
            top = top[np.argsort(-logits[top])]
            out.append([int(e) for e in top])
        return out

    for p in range(a.prompts):
        z = rng.normal(size=D)
        n_prompt = int(rng.integers(a.prompt_len[0], a.prompt_len[1] + 1))
        lines = []
        union = [[] for _ in range(L)]
        prev = None
        for t in range(n_prompt + a.gen):
            if t > 0:
                z = a.rho * z + np.sqrt(1 - a.rho ** 2) * rng.normal(size=D)
            r = route(z)
            for l in range(L):
                load[l, r[l]] += 1
                if prev is not None:
                    overlap += len(set(r[l]) & set(prev[l]))
                    pairs += K
            prev = r
            if t < n_prompt:
                for l in range(L):
                    union[l].extend(e for e in r[l] if e not in union[l])
                if t == n_prompt - 1:
                    for l in range(L):
                        lines.append({"step": 0, "layer": l, "experts": union[l]})
            else:
                step = t - n_prompt + 1
                for l in range(L):
                    lines.append({"step": step, "layer": l, "experts": r[l]})
        path = os.path.join(a.out_dir, f"job-{p:03d}.jsonl")
        with open(path, "w") as f:
            for x in lines:
                f.write(json.dumps(x, separators=(",", ":")) + "\n")

    mean = load.mean()
    print(f"{a.out_dir}: {a.prompts} jobs, {E} experts top-{K}, {L} layers; "
          f"expert load max/mean {load.max() / mean:.2f}, min/mean {load.min() / mean:.2f}; "
          f"token-to-token overlap {overlap / max(pairs, 1):.3f} (uniform: {K / E:.3f})")


if __name__ == "__main__":
    main()
