"""Trained parameters -> checkpoint tensors (written by scripts/k3gen), and back.

Vocabulary: training uses a sub-vocabulary (the ``V'-1`` most frequent ids of the train split,
[BOS] always among them) plus ONE shared row standing for every other id of the real 163,840
(see train.py). Export writes the full vocabulary: each kept id gets its trained embed/lm_head row
and every other id a copy of the shared row, so the exported model's full-vocabulary distribution
is exactly the one trained (a shared lm_head row trained with the log of its multiplicity added).
"""
from __future__ import annotations

import numpy as np

from k3gen.graph import LM, MODEL, build_units
from k3gen.values import f32_to_bf16_bits


def full_vocab(sub: np.ndarray, kept_ids: np.ndarray, vocab: int) -> np.ndarray:
    """[V', E] sub rows (last = shared) -> [vocab, E]."""
    out = np.repeat(sub[-1:], vocab, axis=0)
    out[kept_ids] = sub[: len(kept_ids)]
    return out


def logical_tensors(params: dict, d, kept_ids: np.ndarray) -> dict[str, np.ndarray]:
    """name -> float32 array in checkpoint shape (routed experts as [out, in] float32, not yet
    packed)."""
    f = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    t: dict[str, np.ndarray] = {}
    t[MODEL + "embed_tokens.weight"] = full_vocab(f(params["embed"]), kept_ids, d.vocab)
    t[LM + "lm_head.weight"] = full_vocab(f(params["lm_head"]), kept_ids, d.vocab)
    t[MODEL + "norm.weight"] = f(params["final_norm"])
    t[MODEL + "output_attn_res_norm.weight"] = f(params["out_res_q_norm"])
    t[MODEL + "output_attn_res_proj.weight"] = f(params["out_res_q_proj"]).reshape(1, -1)
    for L, lp in enumerate(params["layers"]):
        p = f"{MODEL}layers.{L}."
        t[p + "input_layernorm.weight"] = f(lp["input_norm"])
        t[p + "post_attention_layernorm.weight"] = f(lp["post_norm"])
        t[p + "self_attention_res_norm.weight"] = f(lp["attn_res_q_norm"])
        t[p + "self_attention_res_proj.weight"] = f(lp["attn_res_q_proj"]).reshape(1, -1)
        t[p + "mlp_res_norm.weight"] = f(lp["mlp_res_q_norm"])
        t[p + "mlp_res_proj.weight"] = f(lp["mlp_res_q_proj"]).reshape(1, -1)
        a, at = p + "self_attn.", lp["attn"]
        if d.is_mla(L):
            for name, key in (("q_a_proj", "q_a"), ("q_a_layernorm", "q_a_norm"), ("q_b_proj", "q_b"),
                              ("kv_a_proj_with_mqa", "kv_a"), ("kv_a_layernorm", "kv_a_norm"),
                              ("kv_b_proj", "kv_b"), ("o_proj", "o_proj"), ("g_proj", "g_proj")):
                t[a + name + ".weight"] = f(at[key])
        else:
            for name, key in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"),
                              ("f_a_proj", "f_a"), ("f_b_proj", "f_b"), ("b_proj", "b_proj"),
                              ("g_proj", "g_proj"), ("o_norm", "o_norm"), ("o_proj", "o_proj")):
                t[a + name + ".weight"] = f(at[key])
            for c in ("q", "k", "v"):
                w = f(at[c + "_conv"])
                t[a + f"{c}_conv1d.weight"] = w.reshape(w.shape[0], 1, w.shape[1])
            a_log = np.zeros(d.kda_head_dim, dtype=np.float32)      # [head_dim], zero tail
            a_log[: d.kda_heads] = f(at["a_log"])
            t[a + "A_log"] = a_log
            t[a + "dt_bias"] = f(at["dt_bias"])
        mp = lp["mlp"]
        if L < 1:
            m = p + "mlp."
            for name in ("gate", "up", "down"):
                t[m + name + "_proj.weight"] = f(mp[name])
        else:
            m = p + "block_sparse_moe."
            t[m + "gate.weight"] = f(mp["router"])
            t[m + "gate.e_score_correction_bias"] = f(mp["bias"])
            t[m + "routed_expert_down_proj.weight"] = f(mp["down"])
            t[m + "routed_expert_norm.weight"] = f(mp["norm"])
            t[m + "routed_expert_up_proj.weight"] = f(mp["up"])
            t[m + "shared_experts.gate_proj.weight"] = f(mp["sh_gate"])
            t[m + "shared_experts.up_proj.weight"] = f(mp["sh_up"])
            t[m + "shared_experts.down_proj.weight"] = f(mp["sh_down"])
            for e in range(d.experts):
                for w in ("w1", "w2", "w3"):
                    t[f"{m}experts.{e}.{w}"] = f(mp[w][e])
    return t


def encode(logical: dict[str, np.ndarray], d) -> dict[str, np.ndarray]:
    """Checkpoint bytes per tensor of the k3gen graph, in its dtype (BF16 bits, F32, MXFP4 U8)."""
    from .model import np_mx_pack          # (JAX is imported only when exporting)

    out: dict[str, np.ndarray] = {}
    for unit in build_units(d):
        for t in unit.tensors:
            if t.dtype == "U8":
                base, part = t.name.rsplit(".", 1)
                if base not in logical:
                    raise KeyError(f"no trained value for {base}")
                packed, scale = np_mx_pack(logical[base])
                arr = packed if part == "weight_packed" else scale
            else:
                if t.name not in logical:
                    raise KeyError(f"no trained value for {t.name}")
                v = logical[t.name]
                arr = f32_to_bf16_bits(v) if t.dtype == "BF16" else v.astype("<f4")
            if tuple(arr.shape) != tuple(t.shape):
                raise ValueError(f"{t.name}: trained shape {arr.shape}, graph shape {t.shape}")
            out[t.name] = np.ascontiguousarray(arr).reshape(-1)
    return out


def params_from_bound(model) -> dict:
    """k3ref's bound Model (float64 numpy, experts dequantized) -> this package's params pytree.
    AttnRes queries come bound as norm ⊙ proj: stored as q_norm with q_proj = 1."""
    ones = lambda v: np.ones_like(v)  # noqa: E731
    layers = []
    for layer in model.layers:
        w = layer.attn
        if layer.kind == "kda":
            attn = {"q_proj": w.q_proj, "k_proj": w.k_proj, "v_proj": w.v_proj, "q_conv": w.q_conv,
                    "k_conv": w.k_conv, "v_conv": w.v_conv, "f_a": w.f_a, "f_b": w.f_b,
                    "a_log": w.a_log, "dt_bias": w.dt_bias, "b_proj": w.b_proj, "g_proj": w.g_proj,
                    "o_norm": w.o_norm, "o_proj": w.o_proj}
        else:
            attn = {"q_a": w.q_a, "q_a_norm": w.q_a_norm, "q_b": w.q_b, "kv_a": w.kv_a,
                    "kv_a_norm": w.kv_a_norm, "kv_b": w.kv_b, "o_proj": w.o_proj, "g_proj": w.g_proj}
        m = layer.mlp
        if hasattr(m, "experts"):
            mlp = {"router": m.router, "bias": m.bias, "down": m.down, "norm": m.norm, "up": m.up,
                   "w1": np.stack([e.w1 for e in m.experts]), "w3": np.stack([e.w3 for e in m.experts]),
                   "w2": np.stack([e.w2 for e in m.experts]),
                   "sh_gate": m.shared.gate, "sh_up": m.shared.up, "sh_down": m.shared.down}
        else:
            mlp = {"gate": m.gate, "up": m.up, "down": m.down}
        layers.append({"input_norm": layer.input_norm, "post_norm": layer.post_norm,
                       "attn_res_q_norm": layer.attn_res_query, "attn_res_q_proj": ones(layer.attn_res_query),
                       "mlp_res_q_norm": layer.mlp_res_query, "mlp_res_q_proj": ones(layer.mlp_res_query),
                       "attn": attn, "mlp": mlp})
    return {"embed": model.embed, "lm_head": model.lm_head, "final_norm": model.final_norm,
            "out_res_q_norm": model.out_res_query, "out_res_q_proj": ones(model.out_res_query),
            "layers": layers}


EMBED = MODEL + "embed_tokens.weight"
HEAD = LM + "lm_head.weight"


def compact(given: dict[str, np.ndarray], kept: np.ndarray, d) -> dict[str, np.ndarray]:
    """The exported checkpoint without its vocabulary copies: embed / lm_head keep only the kept
    rows and the shared row (BF16 bits), every other tensor as exported. ~17 MB for k3-train
    instead of 180 MB; ``expand`` gives back the identical checkpoint."""
    out = {k: v for k, v in given.items() if k not in (EMBED, HEAD)}
    for name in (EMBED, HEAD):
        full = given[name].reshape(d.vocab, d.hidden)
        shared = np.setdiff1d(np.arange(d.vocab), kept)[0]
        out[name] = np.concatenate([full[kept], full[shared:shared + 1]])
    out["__kept__"] = kept.astype(np.int64)
    return out


def expand(c: dict[str, np.ndarray], d) -> dict[str, np.ndarray]:
    kept = c["__kept__"]
    out = {k: np.asarray(v) for k, v in c.items() if k != "__kept__"}
    for name in (EMBED, HEAD):
        out[name] = full_vocab(out[name], kept, d.vocab).reshape(-1)
    return out
