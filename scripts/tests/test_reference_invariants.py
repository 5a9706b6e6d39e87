"""Invariant self-tests of the float64 reference (scripts/k3ref), SPEC.md §8.

Each test checks the reference against an analytic / independently written expectation AND shows
that the plausible wrong variant (written here) differs by far more than the tolerance. Weights
are random and built in memory by ``build_tensors`` below (independent of make-checkpoint.py).
"""
from __future__ import annotations

import copy
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from k3ref import mxfp4
from k3ref.checkpoint import Checkpoint, CheckpointError
from k3ref.config import ConfigError, lookup, parse_config
from k3ref.kda import KdaDims, KdaState, KdaWeights, decay_gate, kda_forward, recurrence, short_conv
from k3ref.mla import MlaCache, MlaDims, MlaWeights, mla_forward, project
from k3ref.model import BindError, State, argmax_first, attention, bind, forward, greedy, mlp
from k3ref.moe import Expert, MoeParams, MoeWeights, DenseWeights, moe_forward, route
from k3ref.ops import attn_res, l2_norm, rms_norm, sigmoid, silu, situ, situ_mlp, softmax
from k3ref.safetensors import SafetensorsError, bf16_bits_to_f64, read_header

SCRIPTS = Path(__file__).resolve().parents[1]
REPO = SCRIPTS.parent
TIGHT = 1e-12        # float64 re-association noise between two correct formulations
WRONG = 1e-3         # a wrong variant must differ by at least this (relative), ≫ TIGHT


def rel(a, b) -> float:
    """max |a-b| / max |b| (0 when both are zero)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    den = float(np.max(np.abs(b))) if b.size else 0.0
    num = float(np.max(np.abs(a - b))) if a.size else 0.0
    return num / den if den > 0 else num


def assert_close(a, b, tol=TIGHT):
    r = rel(a, b)
    assert r <= tol, f"relative difference {r:.3e} > {tol:.1e}"


def assert_differs(wrong, right):
    r = rel(wrong, right)
    assert r >= WRONG, f"wrong variant only differs by {r:.3e}; the test could not catch it"


# --------------------------------------------------------------------------------------------
# In-memory tiny model builder (SPEC.md §7.1 dims with MXFP4-compatible expert widths, §7.2)
# --------------------------------------------------------------------------------------------

def tiny_root(**text_over) -> dict:
    """Nested (released-shape) config: 13 layers, block 3, MLA at 1-based 4,8,12,13."""
    text = {
        "model_type": "kimi_linear", "hidden_size": 128, "num_hidden_layers": 13, "vocab_size": 256,
        "rms_norm_eps": 1e-5, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "intermediate_size": 96, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2,
        "moe_intermediate_size": 64, "routed_expert_hidden_size": 64, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
        "qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
        "mla_use_output_gate": True, "attn_res_block_size": 3, "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "linear_attn_config": {
            "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
            "use_full_rank_gate": True, "full_attn_layers": [4, 8, 12, 13],
            "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11],
        },
    }
    lac_keys = set(text["linear_attn_config"])
    for k, v in text_over.items():
        if k in lac_keys:
            text["linear_attn_config"][k] = v
        else:
            text[k] = v
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "bos_token_id": 163584, "eos_token_id": 163586, "tie_word_embeddings": False,
            "text_config": text}


def pack_mxfp4(codes: np.ndarray) -> np.ndarray:
    """Hand packing (independent of k3ref.mxfp4): even column → low nibble, odd → high nibble."""
    codes = codes.astype(np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def build_tensors(cfg, seed: int = 0, mxfp4_experts: bool = True) -> dict[str, np.ndarray]:
    """Random float64 weights (uint8 for MXFP4 experts) with the §2 names and shapes."""
    rng = np.random.default_rng(seed)
    E, V = cfg.hidden_size, cfg.vocab_size
    H_k, D, K = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    P = H_k * D
    H, nope, rope, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    N, Lat, I = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size

    def mat(o, i, gain=1.0):
        return rng.standard_normal((o, i)) * gain / math.sqrt(i)

    def ones(n):
        return 1.0 + 0.2 * rng.standard_normal(n)

    t: dict[str, np.ndarray] = {}
    m = "language_model.model."
    t[m + "embed_tokens.weight"] = rng.standard_normal((V, E))
    t[m + "norm.weight"] = ones(E)
    t[m + "output_attn_res_norm.weight"] = ones(E)
    t[m + "output_attn_res_proj.weight"] = mat(1, E, 3.0)
    t["language_model.lm_head.weight"] = mat(V, E, 2.0)
    for L in range(cfg.num_hidden_layers):
        p = f"{m}layers.{L}."
        t[p + "input_layernorm.weight"] = ones(E)
        t[p + "post_attention_layernorm.weight"] = ones(E)
        for site in ("self_attention_res", "mlp_res"):
            t[p + site + "_norm.weight"] = ones(E)
            t[p + site + "_proj.weight"] = mat(1, E, 3.0)
        a = p + "self_attn."
        if cfg.layer_kinds[L] == "kda":
            for n in "qkv":
                t[a + f"{n}_proj.weight"] = mat(P, E, 1.5)
                t[a + f"{n}_conv1d.weight"] = rng.standard_normal((P, 1, K)) * 0.7
            t[a + "f_a_proj.weight"] = mat(D, E)
            t[a + "f_b_proj.weight"] = mat(P, D, 2.0)
            t[a + "A_log"] = np.concatenate([np.linspace(-1.0, 1.0, H_k), np.zeros(D - H_k)])
            t[a + "dt_bias"] = rng.standard_normal(P)
            t[a + "b_proj.weight"] = mat(H_k, E, 2.0)
            t[a + "g_proj.weight"] = mat(P, E, 2.0)
            t[a + "o_norm.weight"] = ones(D)
            t[a + "o_proj.weight"] = mat(E, P)
        else:
            t[a + "q_a_proj.weight"] = mat(cfg.q_lora_rank, E)
            t[a + "q_a_layernorm.weight"] = ones(cfg.q_lora_rank)
            t[a + "q_b_proj.weight"] = mat(H * (nope + rope), cfg.q_lora_rank, 2.0)
            t[a + "kv_a_proj_with_mqa.weight"] = mat(cfg.kv_lora_rank + rope, E, 2.0)
            t[a + "kv_a_layernorm.weight"] = ones(cfg.kv_lora_rank)
            t[a + "kv_b_proj.weight"] = mat(H * (nope + vd), cfg.kv_lora_rank, 2.0)
            t[a + "o_proj.weight"] = mat(E, H * vd)
            t[a + "g_proj.weight"] = mat(H * vd, E, 2.0)
        if cfg.is_dense(L):
            t[p + "mlp.gate_proj.weight"] = mat(cfg.intermediate_size, E, 2.0)
            t[p + "mlp.up_proj.weight"] = mat(cfg.intermediate_size, E, 2.0)
            t[p + "mlp.down_proj.weight"] = mat(E, cfg.intermediate_size)
        else:
            b = p + "block_sparse_moe."
            t[b + "gate.weight"] = mat(N, E, 2.0)
            t[b + "gate.e_score_correction_bias"] = rng.standard_normal(N) * 0.3
            t[b + "routed_expert_down_proj.weight"] = mat(Lat, E, 2.0)
            t[b + "routed_expert_norm.weight"] = ones(Lat)
            t[b + "routed_expert_up_proj.weight"] = mat(E, Lat)
            ish = cfg.num_shared_experts * I
            t[b + "shared_experts.gate_proj.weight"] = mat(ish, E, 2.0)
            t[b + "shared_experts.up_proj.weight"] = mat(ish, E, 2.0)
            t[b + "shared_experts.down_proj.weight"] = mat(E, ish)
            for e in range(N):
                for w, (o, i) in (("w1", (I, Lat)), ("w3", (I, Lat)), ("w2", (Lat, I))):
                    name = f"{b}experts.{e}.{w}"
                    if mxfp4_experts:
                        t[name + ".weight_packed"] = pack_mxfp4(rng.integers(0, 16, (o, i)))
                        # E2M1 RMS ≈ 3; scale 2^-5..2^-3 gives entries of a few × 1/sqrt(in)
                        t[name + ".weight_scale"] = rng.integers(122, 125, (o, i // 32)).astype(np.uint8)
                    else:
                        t[name + ".weight"] = mat(o, i, 2.0)
    return t


@pytest.fixture(scope="module")
def tiny():
    cfg = parse_config(tiny_root())
    tensors = build_tensors(cfg, seed=7)
    return cfg, tensors, bind(cfg, tensors)


PROMPT = [17, 200, 3, 99, 42, 128, 7, 255, 64, 1, 180, 33]


# --------------------------------------------------------------------------------------------
# Config / binding: I1, I2, I3
# --------------------------------------------------------------------------------------------

def real_root() -> dict:
    full = list(range(4, 93, 4)) + [93]
    kda = [i for i in range(1, 94) if i not in full]
    root = tiny_root(hidden_size=7168, num_hidden_layers=93, vocab_size=163840, full_attn_layers=full,
                     kda_layers=kda, num_heads=96, head_dim=128, num_experts=896,
                     num_experts_per_token=16, attn_res_block_size=12)
    return root


def test_I1_layer_map_is_one_based():
    real = parse_config(real_root())
    assert real.layer_map == "KKKM" * 23 + "M"
    assert real.layer_kinds[91] == real.layer_kinds[92] == "mla" and real.layer_kinds[0] == "kda"
    assert real.layer_map.count("K") == 69 and real.layer_map.count("M") == 24
    tiny = parse_config(tiny_root())
    assert tiny.layer_map == "KKKMKKKMKKKMM"
    # wrong variant: reading the list as 0-based
    wrong = "".join("M" if L in set(tiny.full_attn_layers) else "K" for L in range(13))
    assert wrong != tiny.layer_map


def test_I2_kda_dims_from_linear_attn_config_not_decoy():
    root = tiny_root()
    root["text_config"]["head_dim"] = 74          # HF-computed attribute re-saved into the config
    root["text_config"]["num_heads"] = 9
    cfg = parse_config(root)
    assert (cfg.kda_num_heads, cfg.kda_head_dim) == (4, 16)
    # the plain search order would have picked the decoy — the hazard is real in this fixture
    assert lookup(root, "head_dim") == 74 and lookup(root, "num_heads") == 9


REQUIRED_NESTED = [
    ("text_config", k) for k in (
        "hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "activation_situ_beta",
        "activation_situ_linear_beta", "intermediate_size", "first_k_dense_replace", "num_experts",
        "num_experts_per_token", "num_shared_experts", "moe_intermediate_size",
        "routed_expert_hidden_size", "routed_scaling_factor", "num_attention_heads", "q_lora_rank",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "attn_res_block_size")
] + [("linear_attn_config", k) for k in ("num_heads", "head_dim", "short_conv_kernel_size",
                                          "gate_lower_bound", "full_attn_layers")]


@pytest.mark.parametrize("scope,key", REQUIRED_NESTED)
def test_I3_each_missing_field_is_rejected(scope, key):
    root = tiny_root()
    d = root["text_config"] if scope == "text_config" else root["text_config"]["linear_attn_config"]
    del d[key]
    with pytest.raises(ConfigError, match=key):
        parse_config(root)


def test_I3_all_missing_fields_listed_at_once_and_optional_defaults():
    root = tiny_root()
    del root["text_config"]["activation_situ_beta"]
    del root["text_config"]["linear_attn_config"]["full_attn_layers"]
    with pytest.raises(ConfigError) as ei:
        parse_config(root)
    assert "activation_situ_beta" in str(ei.value) and "full_attn_layers" in str(ei.value)
    # the three documented optional booleans default to true
    root = tiny_root()
    for k in ("mla_use_output_gate", "moe_renormalize", "latent_moe_use_norm"):
        del root["text_config"][k]
    cfg = parse_config(root)
    assert cfg.mla_use_output_gate and cfg.moe_renormalize and cfg.latent_moe_use_norm


def flat_root() -> dict:
    t = tiny_root()["text_config"]
    lac = t.pop("linear_attn_config")
    t["kda_num_heads"], t["kda_head_dim"] = lac["num_heads"], lac["head_dim"]
    for k in ("short_conv_kernel_size", "gate_lower_bound", "full_attn_layers"):
        t[k] = lac[k]
    t["situ_beta"] = t.pop("activation_situ_beta")
    t["situ_linear_beta"] = t.pop("activation_situ_linear_beta")
    return t


def test_flat_shape_equals_nested():
    nested, flat = parse_config(tiny_root()), parse_config(flat_root())
    assert flat.shape == "flat" and nested.shape == "nested"
    a, b = dict(nested.__dict__), dict(flat.__dict__)
    a.pop("shape"), b.pop("shape")
    assert a == b                                  # incl. kda_layers derived as the complement
    bad = flat_root()
    del bad["situ_linear_beta"]
    with pytest.raises(ConfigError, match="situ_linear_beta"):
        parse_config(bad)


@pytest.mark.parametrize("mutate,needle", [
    (lambda t: t["linear_attn_config"].update(full_attn_layers=[0, 4]), "outside"),
    (lambda t: t["linear_attn_config"].update(kda_layers=[1, 2, 3, 4]), "overlap"),
    (lambda t: t["linear_attn_config"].update(full_attn_layers=list(range(1, 14))), "no KDA"),
    (lambda t: t.update(mla_use_nope=False), "mla_use_nope"),
    (lambda t: t.update(num_experts_per_token=9), "num_experts_per_token"),
    (lambda t: t.update(num_expert_group=2), "num_expert_group"),
    (lambda t: t.update(hidden_size="128"), "hidden_size"),
])
def test_config_structural_checks(mutate, needle):
    root = tiny_root()
    mutate(root["text_config"])
    with pytest.raises(ConfigError, match=needle):
        parse_config(root)


# --------------------------------------------------------------------------------------------
# KDA: I6 - I14
# --------------------------------------------------------------------------------------------

def rand_kda(rng, E=24, H=3, D=8, K=4, rank=None):
    P = H * D
    rank = rank or D

    def mat(o, i, g=1.0):
        return rng.standard_normal((o, i)) * g / math.sqrt(i)
    w = KdaWeights(
        q_proj=mat(P, E, 1.5), k_proj=mat(P, E, 1.5), v_proj=mat(P, E, 1.5),
        q_conv=rng.standard_normal((P, K)) * 0.7, k_conv=rng.standard_normal((P, K)) * 0.7,
        v_conv=rng.standard_normal((P, K)) * 0.7,
        f_a=mat(rank, E), f_b=mat(P, rank, 2.0), a_log=np.linspace(-1.0, 1.0, H),
        dt_bias=rng.standard_normal(P), b_proj=mat(H, E, 3.0), g_proj=mat(P, E, 2.0),
        o_norm=1 + 0.2 * rng.standard_normal(D), o_proj=mat(E, P))
    return w, KdaDims(H, D, K, -5.0, 1e-5)


def test_I6_a_log_is_per_head_and_binder_takes_first_heads(tiny):
    rng = np.random.default_rng(1)
    w, dims = rand_kda(rng)
    x = rng.standard_normal((2, 24))
    g = decay_gate(x, w, dims)
    z = x @ w.f_a.T @ w.f_b.T
    want = np.empty_like(g)
    for t in range(2):
        for h in range(dims.heads):
            for d in range(dims.head_dim):
                c = h * dims.head_dim + d
                want[t, h, d] = -5.0 * sigmoid(np.exp(w.a_log[h]) * (z[t, c] + w.dt_bias[c]))
    assert_close(g, want)
    # wrong: A_log indexed per channel d (the on-disk vector has head_dim entries)
    padded = np.concatenate([w.a_log, np.zeros(dims.head_dim - dims.heads)])
    wrong = -5.0 * sigmoid(np.exp(padded)[None, None, :] * (z + w.dt_bias).reshape(2, dims.heads, dims.head_dim))
    assert_differs(wrong, g)
    cfg, tensors, model = tiny
    disk = tensors["language_model.model.layers.0.self_attn.A_log"]
    assert disk.shape == (16,) and np.all(disk[4:] == 0)
    assert np.array_equal(model.layers[0].attn.a_log, disk[:4])


def test_I7_lower_bound_gate_form():
    rng = np.random.default_rng(2)
    w, dims = rand_kda(rng, H=1, D=4, E=4)
    # make z = x exactly: f_a = I, f_b = I
    w.f_a, w.f_b = np.eye(4), np.eye(4)
    w.a_log = np.array([math.log(2.0)])
    w.dt_bias = np.array([0.5, -1.0, 2.0, -0.25])
    x = np.array([[0.3, 0.7, -1.5, 1.0]])
    g = decay_gate(x, w, dims)[0, 0]
    want = [-5.0 / (1.0 + math.exp(-2.0 * (xi + bi))) for xi, bi in zip(x[0], w.dt_bias)]
    assert_close(g, want)
    assert np.all(g > -5.0) and np.all(g <= 0.0)
    softplus = np.log1p(np.exp(x[0] + w.dt_bias))
    assert_differs(-5.0 * sigmoid(2.0 * x[0] + w.dt_bias), g)     # dt_bias after the multiply
    assert_differs(-2.0 * softplus, g)                             # Kimi-Linear -exp(A)·softplus


def _single_token(w, dims, x):
    st = KdaState.zeros(dims.heads, dims.head_dim, dims.kernel)
    tr = {}
    out = kda_forward(x, w, dims, st, tr)
    return out, tr, st


def test_I8_I10_single_token_from_zero_state():
    """T=1 from zero state: o_h = β_h (q̂_h·k̂_h)/sqrt(D) v_h exactly (before norm and gate)."""
    rng = np.random.default_rng(3)
    w, dims = rand_kda(rng)
    x = rng.standard_normal((1, 24))
    _, tr, _ = _single_token(w, dims, x)
    H, D = dims.heads, dims.head_dim
    q = l2_norm(silu((x @ w.q_proj.T) * w.q_conv[:, -1]).reshape(H, D))
    k = l2_norm(silu((x @ w.k_proj.T) * w.k_conv[:, -1]).reshape(H, D))
    v = silu((x @ w.v_proj.T) * w.v_conv[:, -1]).reshape(H, D)
    beta = sigmoid(x @ w.b_proj.T)[0]
    assert len(set(np.round(beta, 6))) == H                 # heads really have different β
    want = (beta * np.sum(q * k, axis=1) / math.sqrt(D))[:, None] * v
    assert_close(tr["kda.o"][0], want)
    assert_differs((beta * np.sum(q * k, axis=1) / D)[:, None] * v, want)          # 1/D scale
    assert_differs((np.sum(q * k, axis=1) / math.sqrt(D))[:, None] * v, want)      # no β
    assert_differs((beta[0] * np.sum(q * k, axis=1) / math.sqrt(D))[:, None] * v, want)  # shared β


def test_I9_l2_sum_of_squares_after_conv():
    rng = np.random.default_rng(4)
    w, dims = rand_kda(rng)
    x = rng.standard_normal((5, 24))
    st = KdaState.zeros(dims.heads, dims.head_dim, dims.kernel)
    tr = {}
    kda_forward(x, w, dims, st, tr)
    conv_q, _ = short_conv(x @ w.q_proj.T, np.zeros((3, 24)), w.q_conv)
    qh = conv_q.reshape(5, dims.heads, dims.head_dim)
    want = qh / np.sqrt(np.sum(qh ** 2, axis=-1, keepdims=True) + 1e-6)
    assert_close(tr["kda.q"], want)
    norms = np.linalg.norm(tr["kda.q"], axis=-1)
    assert np.all(np.abs(norms - 1) < 1e-4)
    mean_norm = qh / np.sqrt(np.mean(qh ** 2, axis=-1, keepdims=True) + 1e-6)   # mean, not sum
    assert_differs(mean_norm, want)
    pre = (x @ w.q_proj.T).reshape(5, dims.heads, dims.head_dim)                  # norm before conv
    wrong = short_conv(l2_norm(pre).reshape(5, -1), np.zeros((3, 24)), w.q_conv)[0]
    assert_differs(wrong.reshape(qh.shape), want)
    # v is not normalised
    conv_v, _ = short_conv(x @ w.v_proj.T, np.zeros((3, 24)), w.v_conv)
    assert_close(tr["kda.v"], conv_v.reshape(qh.shape))


def explicit_delta_rule(q, k, v, beta, alpha, D):
    """Independent per-head loop with explicit outer products (no einsum)."""
    T, H, _ = q.shape
    out = np.zeros_like(v)
    for h in range(H):
        S = np.zeros((D, D))
        for t in range(T):
            S = np.diag(alpha[t, h]) @ S
            u = S.T @ k[t, h]
            S = S + np.outer(k[t, h], beta[t, h] * (v[t, h] - u))
            out[t, h] = S.T @ (q[t, h] / math.sqrt(D))
    return out


def test_I11_recurrence_order():
    rng = np.random.default_rng(5)
    T, H, D = 4, 2, 6
    q = l2_norm(rng.standard_normal((T, H, D)))
    k = l2_norm(rng.standard_normal((T, H, D)))
    v = rng.standard_normal((T, H, D))
    beta = sigmoid(rng.standard_normal((T, H)))
    alpha = np.exp(-5.0 * sigmoid(rng.standard_normal((T, H, D))))
    assert np.all(alpha < 0.999)                 # the decay position matters
    o, S = recurrence(q, k, v, beta, alpha, np.zeros((H, D, D)))
    want = explicit_delta_rule(q, k, v, beta, alpha, D)
    assert_close(o, want)
    assert np.max(np.abs(o[0])) > 1e-3          # read-before-write would give exactly 0 at t=0

    def variant(order):
        out = np.zeros_like(v)
        for h in range(H):
            S = np.zeros((D, D))
            for t in range(T):
                if order == "read_first":
                    out[t, h] = S.T @ (q[t, h] / math.sqrt(D))
                if order != "decay_after":
                    S = np.diag(alpha[t, h]) @ S
                u = S.T @ k[t, h]
                S = S + np.outer(k[t, h], beta[t, h] * (v[t, h] - u))
                if order == "decay_after":
                    S = np.diag(alpha[t, h]) @ S
                if order != "read_first":
                    out[t, h] = S.T @ (q[t, h] / math.sqrt(D))
        return out
    assert np.all(variant("read_first")[0] == 0)
    assert_differs(variant("read_first"), want)
    assert_differs(variant("decay_after"), want)


def test_I12_conv_causal_tap_history_and_split_prefill():
    rng = np.random.default_rng(6)
    P, K, T = 5, 4, 7
    w = rng.standard_normal((P, K))                      # asymmetric taps
    x = rng.standard_normal((T, P))
    y, hist = short_conv(x, np.zeros((K - 1, P)), w)
    want = np.zeros((T, P))
    for t in range(T):
        for j in range(K):
            src = t - (K - 1) + j
            if src >= 0:
                want[t] += w[:, j] * x[src]
    assert_close(y, silu(want))
    assert_close(y[0], silu(w[:, K - 1] * x[0]))          # tap K-1 = current token
    assert np.array_equal(hist, x[-(K - 1):])            # history = last raw inputs
    flipped = short_conv(x, np.zeros((K - 1, P)), w[:, ::-1])[0]
    assert_differs(flipped, y)
    # carried history: prefill(T) == prefill(T-2) + 1 + 1
    y1, h1 = short_conv(x[:T - 2], np.zeros((K - 1, P)), w)
    y2, h2 = short_conv(x[T - 2:T - 1], h1, w)
    y3, h3 = short_conv(x[T - 1:], h2, w)
    assert np.array_equal(np.concatenate([y1, y2, y3]), y) and np.array_equal(h3, hist)
    # wrong: carrying post-conv (activated) values as history
    bad_h = y1[-(K - 1):]
    assert_differs(short_conv(x[T - 2:T - 1], bad_h, w)[0], y[T - 2:T - 1])
    # wrong: SiLU before the conv
    silu_first = short_conv(silu(x), np.zeros((K - 1, P)), w)[0]
    assert_differs(silu_first, y)


def test_I12_kda_layer_prefill_split_equals_full():
    rng = np.random.default_rng(7)
    w, dims = rand_kda(rng)
    x = rng.standard_normal((9, 24))
    st_full = KdaState.zeros(dims.heads, dims.head_dim, dims.kernel)
    out_full = kda_forward(x, w, dims, st_full)
    st = KdaState.zeros(dims.heads, dims.head_dim, dims.kernel)
    parts = [kda_forward(x[:7], w, dims, st), kda_forward(x[7:8], w, dims, st), kda_forward(x[8:], w, dims, st)]
    assert_close(np.concatenate(parts), out_full)
    for a in ("S", "hist_q", "hist_k", "hist_v"):
        assert_close(getattr(st, a), getattr(st_full, a))
    # wrong: state not carried (fresh state for the decode steps)
    fresh = KdaState.zeros(dims.heads, dims.head_dim, dims.kernel)
    assert_differs(kda_forward(x[7:8], w, dims, fresh), out_full[7:8])


def test_I13_norm_then_gate_then_o_proj():
    rng = np.random.default_rng(8)
    w, dims = rand_kda(rng)
    x = rng.standard_normal((3, 24))
    out, tr, _ = _single_token(w, dims, x)
    o, H, D = tr["kda.o"], dims.heads, dims.head_dim
    gate = sigmoid(x @ w.g_proj.T).reshape(3, H, D)
    want = (rms_norm(o, w.o_norm, 1e-5) * gate).reshape(3, -1) @ w.o_proj.T
    assert_close(out, want)
    assert_differs((rms_norm(o * gate, w.o_norm, 1e-5)).reshape(3, -1) @ w.o_proj.T, want)  # gate first
    assert_differs((rms_norm(o, w.o_norm, 1e-5) * silu(x @ w.g_proj.T).reshape(3, H, D)).reshape(3, -1)
                   @ w.o_proj.T, want)                                                      # swish gate


def test_I14_decay_bottleneck_and_head_indexing():
    rng = np.random.default_rng(9)
    w, dims = rand_kda(rng, rank=5)
    x = rng.standard_normal((2, 24))
    g = decay_gate(x, w, dims)
    z = w.f_b @ (w.f_a @ x[1])                      # one bottleneck, no activation between
    h, d = 2, 3
    c = h * dims.head_dim + d
    assert_close(g[1, h, d], -5.0 * sigmoid(np.exp(w.a_log[h]) * (z[c] + w.dt_bias[c])))
    zs = silu(x @ w.f_a.T) @ w.f_b.T
    wrong = -5.0 * sigmoid(np.exp(w.a_log)[None, :, None] * (zs + w.dt_bias).reshape(2, dims.heads, dims.head_dim))
    assert_differs(wrong, g)
    # wrong output indexing d·H + h (channel-major) instead of h·D + d
    zz = (x @ w.f_a.T @ w.f_b.T + w.dt_bias).reshape(2, dims.head_dim, dims.heads).transpose(0, 2, 1)
    assert_differs(-5.0 * sigmoid(np.exp(w.a_log)[None, :, None] * zz), g)


# --------------------------------------------------------------------------------------------
# MLA: I15 - I19
# --------------------------------------------------------------------------------------------

def rand_mla(rng, E=24, H=3, nope=6, rope=4, vd=5, q_lora=10, kv_lora=7, rope_gain=1.0, eps=1e-6):
    def mat(o, i, g=1.0):
        return rng.standard_normal((o, i)) * g / math.sqrt(i)
    kv_a = mat(kv_lora + rope, E, 2.0)
    kv_a[kv_lora:] *= rope_gain
    w = MlaWeights(q_a=mat(q_lora, E), q_a_norm=1 + 0.2 * rng.standard_normal(q_lora),
                   q_b=mat(H * (nope + rope), q_lora, 2.0), kv_a=kv_a,
                   kv_a_norm=1 + 0.2 * rng.standard_normal(kv_lora),
                   kv_b=mat(H * (nope + vd), kv_lora, 2.0), o_proj=mat(E, H * vd), g_proj=mat(H * vd, E, 2.0))
    return w, MlaDims(H, nope, rope, vd, kv_lora, eps)


def explicit_mla_o(x, w, d, layout="right", drop_rope=False, scale=None, norm_all=False):
    """Per-head loops written from §3.5 (with switchable wrong variants)."""
    T = x.shape[0]
    dq = d.nope + d.rope
    ql = x @ w.q_a.T
    ql = w.q_a_norm * ql / np.sqrt(np.mean(ql ** 2, axis=-1, keepdims=True) + d.norm_eps)
    qall = ql @ w.q_b.T
    ckv = x @ w.kv_a.T
    if norm_all:
        ms = np.mean(ckv ** 2, axis=-1, keepdims=True)
        c = w.kv_a_norm * ckv[:, :d.kv_lora] / np.sqrt(ms + d.norm_eps)
    else:
        c = w.kv_a_norm * ckv[:, :d.kv_lora] / np.sqrt(np.mean(ckv[:, :d.kv_lora] ** 2, axis=-1, keepdims=True) + d.norm_eps)
    kr = ckv[:, d.kv_lora:]
    kv = c @ w.kv_b.T
    o = np.zeros((T, d.heads, d.v))
    for h in range(d.heads):
        if layout == "right":
            qn, qr = qall[:, h * dq:h * dq + d.nope], qall[:, h * dq + d.nope:(h + 1) * dq]
            kn = kv[:, h * (d.nope + d.v):h * (d.nope + d.v) + d.nope]
            vv = kv[:, h * (d.nope + d.v) + d.nope:(h + 1) * (d.nope + d.v)]
        elif layout == "kv_all_k_then_v":
            qn, qr = qall[:, h * dq:h * dq + d.nope], qall[:, h * dq + d.nope:(h + 1) * dq]
            kn = kv[:, h * d.nope:(h + 1) * d.nope]
            vv = kv[:, d.heads * d.nope + h * d.v:d.heads * d.nope + (h + 1) * d.v]
        else:  # "q_all_nope_then_rope"
            qn = qall[:, h * d.nope:(h + 1) * d.nope]
            qr = qall[:, d.heads * d.nope + h * d.rope:d.heads * d.nope + (h + 1) * d.rope]
            kn = kv[:, h * (d.nope + d.v):h * (d.nope + d.v) + d.nope]
            vv = kv[:, h * (d.nope + d.v) + d.nope:(h + 1) * (d.nope + d.v)]
        sc = scale if scale is not None else 1.0 / math.sqrt(d.nope + d.rope)
        for t in range(T):
            s = np.array([(qn[t] @ kn[j] + (0.0 if drop_rope else qr[t] @ kr[j])) * sc for j in range(t + 1)])
            p = np.exp(s - s.max())
            p /= p.sum()
            o[t, h] = p @ vv[:t + 1]
    return o.reshape(T, -1)


def test_I15_rope_dims_scored_unrotated_shared_scale_192():
    rng = np.random.default_rng(10)
    w, d = rand_mla(rng)
    x = rng.standard_normal((4, 24))
    tr = {}
    mla_forward(x, w, d, MlaCache.empty(d), "expanded", tr)
    want = explicit_mla_o(x, w, d)
    assert_close(tr["mla.o"], want)
    assert_differs(explicit_mla_o(x, w, d, drop_rope=True, scale=1 / math.sqrt(d.nope)), want)
    assert_differs(explicit_mla_o(x, w, d, scale=1 / math.sqrt(d.nope)), want)
    assert_differs(explicit_mla_o(x, w, d, scale=1 / math.sqrt(d.nope + d.rope) * 2.0), want)  # an mscale


def test_I16_kv_a_layernorm_over_latent_only():
    rng = np.random.default_rng(11)
    w, d = rand_mla(rng, rope_gain=30.0)
    x = rng.standard_normal((3, 24))
    tr = {}
    mla_forward(x, w, d, MlaCache.empty(d), "expanded", tr)
    ckv = x @ w.kv_a.T
    assert np.array_equal(tr["mla.kr"], ckv[:, d.kv_lora:])          # raw, not normalised/rotated
    assert_close(tr["mla.o"], explicit_mla_o(x, w, d))
    assert_differs(explicit_mla_o(x, w, d, norm_all=True), tr["mla.o"])


def test_I17_head_major_row_layouts():
    rng = np.random.default_rng(12)
    w, d = rand_mla(rng)
    x = rng.standard_normal((3, 24))
    tr = {}
    mla_forward(x, w, d, MlaCache.empty(d), "expanded", tr)
    assert_close(tr["mla.o"], explicit_mla_o(x, w, d))
    assert_differs(explicit_mla_o(x, w, d, layout="kv_all_k_then_v"), tr["mla.o"])
    assert_differs(explicit_mla_o(x, w, d, layout="q_all_nope_then_rope"), tr["mla.o"])


def test_I18_output_gate_before_o_proj_no_norm():
    rng = np.random.default_rng(13)
    w, d = rand_mla(rng)
    x = rng.standard_normal((1, 24))
    out = mla_forward(x, w, d, MlaCache.empty(d))
    # one position: softmax over a single key ⇒ o_h = v_h(0)
    ckv = x @ w.kv_a.T
    c = rms_norm(ckv[:, :d.kv_lora], w.kv_a_norm, d.norm_eps)
    v = (c @ w.kv_b.T).reshape(1, d.heads, d.nope + d.v)[..., d.nope:].reshape(1, -1)
    want = (v * sigmoid(x @ w.g_proj.T)) @ w.o_proj.T
    assert_close(out, want)
    assert_differs(v @ w.o_proj.T, want)                                            # no gate
    vh = v.reshape(d.heads, d.v)
    normed = (vh / np.sqrt(np.mean(vh ** 2, axis=-1, keepdims=True) + 1e-5)).reshape(1, -1)
    assert_differs((normed * sigmoid(x @ w.g_proj.T)) @ w.o_proj.T, want)           # KDA-style norm


def test_I19_causal_mask_and_latent_equals_expanded():
    rng = np.random.default_rng(14)
    w, d = rand_mla(rng)
    x = rng.standard_normal((6, 24))
    full = mla_forward(x, w, d, MlaCache.empty(d), "expanded")
    for t in range(6):                                     # position t sees only tokens 0..t
        assert_close(full[t], mla_forward(x[:t + 1], w, d, MlaCache.empty(d), "expanded")[t])
    latent = mla_forward(x, w, d, MlaCache.empty(d), "latent")
    assert_close(latent, full)
    # incremental with a cache: prefill 4 + 1 + 1, both forms
    for form in ("expanded", "latent"):
        cache = MlaCache.empty(d)
        parts = [mla_forward(x[:4], w, d, cache, form), mla_forward(x[4:5], w, d, cache, form),
                 mla_forward(x[5:], w, d, cache, form)]
        assert_close(np.concatenate(parts), full)
        assert cache.c.shape == (6, d.kv_lora) and cache.kr.shape == (6, d.rope)
    # wrong: no causal mask in prefill
    q, c, kr = project(x, w, d)
    kv = (c @ w.kv_b.T).reshape(6, d.heads, d.nope + d.v)
    k = np.concatenate([kv[..., :d.nope], np.broadcast_to(kr[:, None], (6, d.heads, d.rope))], -1)
    p = softmax(np.einsum("thd,shd->hts", q, k) / math.sqrt(d.nope + d.rope), axis=-1)
    o = np.einsum("hts,shd->thd", p, kv[..., d.nope:]).reshape(6, -1)
    assert_differs((o * sigmoid(x @ w.g_proj.T)) @ w.o_proj.T, full)


# --------------------------------------------------------------------------------------------
# MoE / MLP: I20 - I25
# --------------------------------------------------------------------------------------------

MOE_P = MoeParams(top_k=2, renormalize=True, scaling=1.0, beta1=4.0, beta2=25.0, norm_eps=1e-5)


def rand_moe(rng, E=12, N=6, Lat=8, I=10, shared=True):
    def mat(o, i, g=1.0):
        return rng.standard_normal((o, i)) * g / math.sqrt(i)
    sh = DenseWeights(mat(2 * I, E, 2), mat(2 * I, E, 2), mat(E, 2 * I)) if shared else None
    return MoeWeights(router=mat(N, E, 2), bias=rng.standard_normal(N) * 0.3, down=mat(Lat, E, 2),
                      norm=1 + 0.2 * rng.standard_normal(Lat), up=mat(E, Lat),
                      experts=[Expert(mat(I, Lat, 2), mat(I, Lat, 2), mat(Lat, I)) for _ in range(N)],
                      shared=sh)


def test_I20_bias_steers_selection_only():
    w = rand_moe(np.random.default_rng(15), E=6, N=6)
    w.router = np.eye(6)                                   # logits = x
    w.bias = np.array([0.0, 0.0, 0.0, 0.0, 2.0, 2.0])
    x = np.array([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5]])
    sel, weights, scores = route(x, w, MOE_P)
    assert sel.tolist() == [[4, 5]]                        # bias reorders the top-k (higher biased first)
    s4, s5 = sigmoid(0.0), sigmoid(-0.5)
    assert_close(weights[0], [s4 / (s4 + s5 + 1e-20), s5 / (s4 + s5 + 1e-20)])
    # wrong: weights from the biased scores; selection without the bias
    b4, b5 = s4 + 2.0, s5 + 2.0
    assert_differs([b4 / (b4 + b5), b5 / (b4 + b5)], weights[0])
    assert np.argsort(-scores[0])[:2].tolist() == [0, 1]
    # routed_scaling_factor multiplies after renormalisation; top_k == 1 is not renormalised
    p3 = MoeParams(2, True, 2.5, 4.0, 25.0, 1e-5)
    assert_close(route(x, w, p3)[1], 2.5 * weights)
    p1 = MoeParams(1, True, 1.0, 4.0, 25.0, 1e-5)
    assert_close(route(x, w, p1)[1], [[s4]])
    # deterministic tie rule: equal biased scores → lower index first
    w.bias = np.zeros(6)
    sel, _, _ = route(np.zeros((1, 6)), w, MoeParams(3, True, 1.0, 4.0, 25.0, 1e-5))
    assert sel.tolist() == [[0, 1, 2]]


def test_I20_router_bias_reorders_on_most_rows_of_tiny_model(tiny):
    """The tiny builder's bias really changes selections (so the full-model tests exercise I20)."""
    cfg, tensors, model = tiny
    rng = np.random.default_rng(16)
    x = rng.standard_normal((64, cfg.hidden_size))
    moe = model.layers[1].mlp
    sel, _, scores = route(x, moe, model.moe_params)
    unbiased = np.argsort(-scores, axis=1, kind="stable")[:, :2]
    changed = np.mean([set(a) != set(b) for a, b in zip(sel.tolist(), unbiased.tolist())])
    assert changed > 0.3


def test_I21_router_reads_full_width_x():
    rng = np.random.default_rng(17)
    w = rand_moe(rng, E=12, Lat=12)
    x = rng.standard_normal((40, 12))
    tr = {}
    moe_forward(x, w, MOE_P, tr)
    logits = x @ w.router.T
    biased = 1 / (1 + np.exp(-logits)) + w.bias
    want = [sorted(range(6), key=lambda e: (-biased[t, e], e))[:2] for t in range(40)]
    assert tr["moe.sel"].tolist() == want
    latent = x @ w.down.T                                   # wrong: routing the latent
    wrong, _, _ = route(latent, w, MOE_P)
    assert wrong.tolist() != want


def test_I22_routed_norm_on_aggregate_once():
    rng = np.random.default_rng(18)
    w = rand_moe(rng, N=2, shared=False)
    w.experts[1].w2 = w.experts[1].w2 * 100.0               # experts of very different magnitude
    x = rng.standard_normal((3, 12))
    out = moe_forward(x, w, MOE_P)
    sel, wt, _ = route(x, w, MOE_P)
    z = x @ w.down.T
    ys = [situ(z @ e.w1.T, z @ e.w3.T, 4.0, 25.0) @ e.w2.T for e in w.experts]
    acc = sum(wt[:, [j]] * np.stack([ys[e][t] for t, e in enumerate(sel[:, j])]) for j in range(2))
    want = rms_norm(acc, w.norm, 1e-5) @ w.up.T
    assert_close(out, want)
    per_expert = sum(wt[:, [j]] * rms_norm(np.stack([ys[e][t] for t, e in enumerate(sel[:, j])]), w.norm, 1e-5)
                     for j in range(2))
    assert_differs(per_expert @ w.up.T, want)
    assert_differs(acc @ w.up.T, want)                      # norm skipped


def test_I23_shared_experts_full_width_unweighted():
    rng = np.random.default_rng(19)
    w = rand_moe(rng)
    for e in w.experts:
        e.w2 = np.zeros_like(e.w2)                          # zero routed contribution
    x = rng.standard_normal((4, 12))
    out = moe_forward(x, w, MOE_P)
    sh = w.shared
    want = situ(x @ sh.gate.T, x @ sh.up.T, 4.0, 25.0) @ sh.down.T
    assert_close(out, want)
    silu_glu = (silu(x @ sh.gate.T) * (x @ sh.up.T)) @ sh.down.T
    assert_differs(silu_glu, want)
    assert_differs(want / MOE_P.top_k, want)                # weighted by a mean router weight


def test_I24_situ_caps_and_uncapped_sigma():
    assert_close(situ(np.array(2.0), np.array(3.0), 4.0, 25.0),
                 4 * math.tanh(0.5) / (1 + math.exp(-2.0)) * 25 * math.tanh(3 / 25))
    mags = np.geomspace(0.1, 1000.0, 41)
    z = np.concatenate([-mags[::-1], mags])
    g, u = np.meshgrid(z, z, indexing="ij")
    out = situ(g, u, 4.0, 25.0)
    assert np.all(np.abs(out) <= 100.0) and np.all(np.isfinite(out))
    assert abs(situ(np.array(1000.0), np.array(1000.0), 4.0, 25.0) - 100.0) < 1e-9
    assert abs(situ(np.array(1000.0), np.array(-1000.0), 4.0, 25.0) + 100.0) < 1e-9
    assert abs(situ(np.array(-1000.0), np.array(1000.0), 4.0, 25.0)) < 1e-9
    # wrong: σ of the capped gate
    capped = 4 * np.tanh(g / 4) * sigmoid(4 * np.tanh(g / 4)) * 25 * np.tanh(u / 25)
    assert_differs(capped, out)
    # w1 = gate, w3 = up: swapping them is a different function
    rng = np.random.default_rng(20)
    x, wg, wu, wd = rng.standard_normal((3, 8)), rng.standard_normal((6, 8)), rng.standard_normal((6, 8)), rng.standard_normal((8, 6))
    assert_differs(situ_mlp(x, wu, wg, wd, 4.0, 25.0), situ_mlp(x, wg, wu, wd, 4.0, 25.0))


def test_I25_layer0_dense_situ_mlp_names(tiny):
    cfg, tensors, model = tiny
    tr = {}
    forward(model, PROMPT[:3], State.new(model), trace=tr)
    layer = model.layers[0]
    assert isinstance(layer.mlp, DenseWeights)
    xn = rms_norm(tr["L0.mlp_in"], layer.post_norm, cfg.rms_norm_eps)
    pre = "language_model.model.layers.0.mlp."
    g, u, d = (tensors[pre + n + "_proj.weight"] for n in ("gate", "up", "down"))
    want = situ(xn @ g.T, xn @ u.T, 4.0, 25.0) @ d.T
    assert_close(tr["L0.mlp_out"], want)
    assert_differs((silu(xn @ g.T) * (xn @ u.T)) @ d.T, want)
    # a checkpoint naming layer 0's MLP block_sparse_moe.* is refused (mlp.* is required)
    bad = {k.replace("layers.0.mlp.", "layers.0.block_sparse_moe."): v for k, v in tensors.items()}
    with pytest.raises(BindError, match=r"layers\.0\.mlp\.gate_proj"):
        bind(cfg, bad)


# --------------------------------------------------------------------------------------------
# Block AttnRes: I27 - I30
# --------------------------------------------------------------------------------------------

def test_I27_keys_normalised_values_raw_query_folded(tiny):
    rng = np.random.default_rng(21)
    E, T = 16, 2
    srcs = [rng.standard_normal((T, E)) * s for s in (0.1, 1.0, 30.0)]     # very different RMS
    w = rng.standard_normal(E) * 0.5
    eps = 1e-5
    got = attn_res(srcs, w, eps)
    want = np.zeros((T, E))
    for t in range(T):
        s = [sum(S[t, d] / math.sqrt(np.mean(S[t] ** 2) + eps) * w[d] for d in range(E)) for S in srcs]
        p = np.exp(np.array(s) - max(s))
        p /= p.sum()
        want[t] = sum(p[i] * srcs[i][t] for i in range(3))
    assert_close(got, want)
    normed = [S / np.sqrt(np.mean(S ** 2, axis=-1, keepdims=True) + eps) for S in srcs]
    assert_differs(attn_res(normed, w, eps), want)                           # values normalised
    raw_scores = softmax(np.stack([S @ w for S in srcs]), axis=0)            # keys not normalised
    assert_differs(np.einsum("nt,nte->te", raw_scores, np.stack(srcs)), want)
    cfg, tensors, model = tiny
    p = "language_model.model.layers.5."
    assert np.array_equal(model.layers[5].mlp_res_query,
                          tensors[p + "mlp_res_norm.weight"] * tensors[p + "mlp_res_proj.weight"][0])
    assert_differs(tensors[p + "mlp_res_proj.weight"][0], model.layers[5].mlp_res_query)   # proj only


def block_formulation(model, ids):
    """Independent restatement of §3.3: sources = [embedding] + completed block sums + the running
    sum of the current block (when non-empty). AttnRes over a single source is the identity, which
    is exactly the layer-0 'skip'."""
    eps, B = model.cfg.rms_norm_eps, model.cfg.attn_res_block_size
    st = State.new(model)
    emb = model.embed[np.asarray(ids)]
    done, cur = [], None
    for layer in model.layers:
        L = layer.index
        if L % B == 0 and L > 0:
            done.append(cur)
            cur = None
        x = attn_res([emb] + done + ([cur] if cur is not None else []), layer.attn_res_query, eps)
        a = attention(model, layer, rms_norm(x, layer.input_norm, eps), st, "expanded", None, "")
        cur = a if cur is None else cur + a
        x2 = attn_res([emb] + done + [cur], layer.mlp_res_query, eps)
        cur = cur + mlp(model, layer, rms_norm(x2, layer.post_norm, eps), None, "")
    x = attn_res([emb] + done + [cur], model.out_res_query, eps)
    return rms_norm(x, model.final_norm, eps) @ model.lm_head.T


def buggy_loop(model, ids, bug):
    """The bank/pend loop with one plausible bug switched on."""
    eps, B = model.cfg.rms_norm_eps, model.cfg.attn_res_block_size
    st = State.new(model)
    bank, pend = [], model.embed[np.asarray(ids)]
    for layer in model.layers:
        L = layer.index
        boundary = L % B == 0
        if bug == "guard_on_boundary":
            x = pend if boundary else attn_res(bank + [pend], layer.attn_res_query, eps)
        else:
            x = pend if not bank else attn_res(bank + [pend], layer.attn_res_query, eps)
        if boundary:
            bank.append(x if bug == "snapshot_aggregated" else pend)
            if bug != "no_reset":
                pend = None
        a = attention(model, layer, rms_norm(x, layer.input_norm, eps), st, "expanded", None, "")
        pend = a if pend is None else pend + a
        if bug == "second_guarded" and boundary:
            x2 = pend
        else:
            x2 = attn_res(bank + [pend], layer.mlp_res_query, eps)
        pend = pend + mlp(model, layer, rms_norm(x2, layer.post_norm, eps), None, "")
    if bug == "final_without_aggregator":
        x = pend
    elif bug == "final_norm_before_aggregator":
        srcs = [rms_norm(s, model.final_norm, eps) for s in bank + [pend]]
        return attn_res(srcs, model.out_res_query, eps) @ model.lm_head.T
    else:
        x = attn_res(bank + [pend], model.out_res_query, eps)
    return rms_norm(x, model.final_norm, eps) @ model.lm_head.T


def test_I28_I29_I30_boundaries_on_13_layer_block_3_model(tiny):
    cfg, tensors, model = tiny
    assert cfg.attn_res_block_size == 3 and cfg.num_hidden_layers == 13   # 4 complete blocks + 1 partial
    ids = PROMPT[:5]
    tr = {}
    logits = forward(model, ids, State.new(model), trace=tr)
    assert_close(block_formulation(model, ids), logits)
    assert [tr[f"L{L}.bank_size"] for L in range(13)] == [L // 3 + 1 for L in range(13)]
    assert tr["final_bank_size"] == math.ceil(13 / 3)
    assert np.array_equal(tr["L0.attn_in"], tr["embed"])               # first aggregation skipped at L=0
    for bug in ("guard_on_boundary", "snapshot_aggregated", "no_reset", "second_guarded",
                "final_without_aggregator", "final_norm_before_aggregator"):
        assert_differs(buggy_loop(model, ids, bug), logits)
    # I30: aggregator → final norm → lm_head
    assert_close(rms_norm(tr["final_in"], model.final_norm, cfg.rms_norm_eps) @ model.lm_head.T, logits)


def test_I29_sources_on_boundary_mla_layer_12_and_non_boundary_kda_layer_5(tiny):
    """Sources rebuilt from the traced sublayer outputs: the snapshot is the raw block sum and a
    boundary layer's second aggregation ends with its attention output alone."""
    cfg, tensors, model = tiny
    tr = {}
    forward(model, PROMPT[:4], State.new(model), trace=tr)
    eps = cfg.rms_norm_eps
    out = {L: (tr[f"L{L}.attn_out"], tr[f"L{L}.mlp_out"]) for L in range(13)}
    S = [sum(out[L][0] + out[L][1] for L in range(3 * b, 3 * b + 3)) for b in range(4)]
    emb = tr["embed"]
    L12, L5 = model.layers[12], model.layers[5]
    assert L12.kind == "mla" and L5.kind == "kda"
    assert_close(tr["L12.attn_in"], attn_res([emb] + S, L12.attn_res_query, eps))
    assert_close(tr["L12.mlp_in"], attn_res([emb] + S + [out[12][0]], L12.mlp_res_query, eps))
    part = out[3][0] + out[3][1] + out[4][0] + out[4][1]
    assert_close(tr["L5.attn_in"], attn_res([emb, S[0], part], L5.attn_res_query, eps))
    assert_close(tr["L5.mlp_in"], attn_res([emb, S[0], part + out[5][0]], L5.mlp_res_query, eps))
    assert_close(tr["final_in"], attn_res([emb] + S + [out[12][0] + out[12][1]], model.out_res_query, eps))
    # wrong: at the boundary the pushed snapshot also stays in pend (counted twice)
    assert_differs(attn_res([emb] + S + [S[3] + out[12][0]], L12.mlp_res_query, eps), tr["L12.mlp_in"])


def test_truncated_model_uses_ceil_n_over_block_snapshots(tiny):
    cfg, tensors, _ = tiny
    m7 = bind(cfg, tensors, n_layers=7)
    tr = {}
    logits = forward(m7, PROMPT[:4], State.new(m7), trace=tr)
    assert tr["final_bank_size"] == 3 and len(m7.layers) == 7
    assert_close(block_formulation(m7, PROMPT[:4]), logits)


# --------------------------------------------------------------------------------------------
# Formats: I31 (MXFP4), I32 (bf16)
# --------------------------------------------------------------------------------------------

def test_I31_mxfp4_nibble_order_sign_and_group_scale():
    rng = np.random.default_rng(22)
    rows, cols = 3, 64
    codes = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
    codes[0, 0], codes[0, 1] = 0x3, 0xB               # +1.5 then -1.5: sign is bit 3
    scale = np.array([[127, 128], [120, 134], [127, 255]], dtype=np.uint8)
    packed = np.zeros((rows, cols // 2), dtype=np.uint8)
    for r in range(rows):
        for i in range(cols // 2):
            packed[r, i] = int(codes[r, 2 * i]) | (int(codes[r, 2 * i + 1]) << 4)
    w, nan = mxfp4.dequantize(packed, scale, cols)
    mags = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    want = np.zeros((rows, cols))
    for r in range(rows):
        for c in range(cols):
            s = int(scale[r, c // 32])
            val = (-1 if codes[r, c] & 8 else 1) * mags[codes[r, c] & 7]
            want[r, c] = 0.0 if s == 255 else val * 2.0 ** (s - 127)
    assert np.array_equal(w, want)
    assert w[0, 0] == 1.5 and w[0, 1] == -1.5 and nan == 1
    assert w[1, 0] == want[1, 0] and abs(w[1, 40]) in {m * 128.0 for m in mags}
    # swapped-nibble negative control: identical value statistics, different positions
    swapped = ((packed & 0x0F) << 4) | (packed >> 4)
    ws, _ = mxfp4.dequantize(swapped.astype(np.uint8), scale, cols)
    assert np.array_equal(np.sort(ws[:2].ravel()), np.sort(w[:2].ravel()))
    x = rng.standard_normal(cols)
    assert_differs(ws[:2] @ x, w[:2] @ x)
    with pytest.raises(mxfp4.Mxfp4Error):
        mxfp4.dequantize(packed, scale[:, :1], cols)


def test_I32_bf16_widening_is_an_exact_shift():
    bits = np.array([0x3F80, 0xC049, 0x0001, 0x7F7F, 0x3F81, 0x0080, 0xFF80], dtype=np.uint16)
    got = bf16_bits_to_f64(bits)
    want = [1.0, -3.140625, 2.0 ** -133, (2 - 2 ** -7) * 2.0 ** 127, 1.0078125, 2.0 ** -126, -np.inf]
    assert got.tolist() == want
    # wrong: a round trip through f16 loses the subnormal and overflows the max
    with np.errstate(over="ignore"):
        via_f16 = np.array(want[:6], dtype=np.float16).astype(np.float64)
    assert via_f16[2] == 0.0 and np.isinf(via_f16[3])


# --------------------------------------------------------------------------------------------
# Whole model: I35, I36, latent MLA, split prefill
# --------------------------------------------------------------------------------------------

def test_I35_embedding_unscaled_lm_head_untied(tiny):
    cfg, tensors, model = tiny
    tr = {}
    logits = forward(model, PROMPT[:3], State.new(model), trace=tr)
    emb = tensors["language_model.model.embed_tokens.weight"]
    assert np.array_equal(tr["embed"], emb[PROMPT[:3]])
    xn = rms_norm(tr["final_in"], model.final_norm, cfg.rms_norm_eps)
    assert_close(xn @ tensors["language_model.lm_head.weight"].T, logits)
    assert_differs(xn @ emb.T, logits)                                       # tied head
    scaled = model.embed * math.sqrt(cfg.hidden_size)                        # Gemma-style scaling
    m2 = copy.copy(model)
    m2.embed = scaled
    assert_differs(forward(m2, PROMPT[:3], State.new(m2)), logits)


def test_I36_full_recompute_equals_incremental_20_tokens(tiny):
    cfg, tensors, model = tiny
    ids_full, rows_full = greedy(model, PROMPT, 20, "full")
    ids_inc, rows_inc = greedy(model, PROMPT, 20, "incremental")
    ids_lat, rows_lat = greedy(model, PROMPT, 20, "incremental", mla_form="latent")
    assert ids_full == ids_inc == ids_lat
    assert_close(np.stack(rows_inc), np.stack(rows_full), 1e-10)
    assert_close(np.stack(rows_lat), np.stack(rows_full), 1e-10)
    assert len(set(ids_full)) > 3                         # not a degenerate constant generation
    # teacher forcing over all 32 positions reproduces every greedy choice
    tf = forward(model, PROMPT + ids_full, State.new(model))
    assert [argmax_first(r) for r in tf[len(PROMPT) - 1:-1]] == ids_full


def test_latent_mla_equals_expanded_in_the_model(tiny):
    cfg, tensors, model = tiny
    a = forward(model, PROMPT, State.new(model), "expanded")
    b = forward(model, PROMPT, State.new(model), "latent")
    assert_close(b, a)


def test_model_prefill_T_equals_prefill_T_minus_2_plus_two_steps(tiny):
    cfg, tensors, model = tiny
    full = forward(model, PROMPT, State.new(model))
    st = State.new(model)
    forward(model, PROMPT[:-2], st)
    r1 = forward(model, PROMPT[-2:-1], st)
    r2 = forward(model, PROMPT[-1:], st)
    assert_close(r1[0], full[-2], 1e-10)
    assert_close(r2[0], full[-1], 1e-10)
    assert st.n_tokens == len(PROMPT)
    # wrong: dropping the KDA state (conv history + S) between calls
    st2 = State.new(model)
    forward(model, PROMPT[:-2], st2)
    for L in st2.kda:
        st2.kda[L] = type(st2.kda[L]).zeros(model.kda_dims.heads, model.kda_dims.head_dim, model.kda_dims.kernel)
    assert_differs(forward(model, PROMPT[-2:-1], st2)[0], full[-2])


# --------------------------------------------------------------------------------------------
# Loader: safetensors, shards, legacy prefix, dtypes, shape checks
# --------------------------------------------------------------------------------------------

F32_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")


def write_safetensors(path: Path, entries: dict[str, tuple[str, np.ndarray]]) -> None:
    header, blobs, off = {}, [], 0
    for name, (dtype, arr) in entries.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    return (a.astype("<f4").view("<u4") >> 16).astype("<u2")


def write_checkpoint(d: Path, root: dict, tensors: dict, shards: int = 2, legacy_layers=(),
                     index: bool = True) -> dict:
    """Write tensors as a sharded release-style checkpoint; returns the dict of values as stored."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(root))
    stored, per_shard, wmap = {}, [dict() for _ in range(shards)], {}
    for i, (name, arr) in enumerate(sorted(tensors.items())):
        if arr.dtype == np.uint8:
            dtype, disk, val = "U8", arr, arr
        elif name.endswith(F32_SUFFIXES):
            dtype, disk = "F32", arr.astype("<f4")
            val = disk.astype(np.float64)
        else:
            dtype, disk = "BF16", to_bf16_bits(arr)
            val = bf16_bits_to_f64(disk)
        stored[name] = val
        disk_name = name
        for L in legacy_layers:
            pre = f"language_model.model.layers.{L}."
            if name.startswith(pre):
                disk_name = "language_model.layers." + name[len("language_model.model.layers."):]
        shard = f"model-{(i % shards) + 1:05d}-of-{shards:06d}.safetensors"
        per_shard[i % shards][disk_name] = (dtype, disk)
        wmap[disk_name] = shard
    for s in range(shards):
        write_safetensors(d / f"model-{s + 1:05d}-of-{shards:06d}.safetensors", per_shard[s])
    if index:
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return stored


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny):
    cfg, tensors, _ = tiny
    d = tmp_path_factory.mktemp("ckpt")
    stored = write_checkpoint(d, tiny_root(), tensors, shards=3, legacy_layers=(2, 5))
    return d, stored


def test_loader_roundtrip_sharded_index_legacy_prefix(written, tiny):
    cfg, tensors, _ = tiny
    d, stored = written
    ckpt = Checkpoint(d)
    assert len(ckpt.shards) == 3
    assert "language_model.model.layers.2.self_attn.q_proj.weight" in ckpt     # legacy name mapped
    assert ckpt.dtype_of("language_model.model.layers.0.self_attn.A_log") == "F32"
    assert ckpt.dtype_of("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed") == "U8"
    m_disk = bind(cfg, ckpt)
    m_mem = bind(cfg, stored)
    a = forward(m_disk, PROMPT, State.new(m_disk))
    b = forward(m_mem, PROMPT, State.new(m_mem))
    assert np.array_equal(a, b)                         # identical float64 values ⇒ identical logits
    hashes = ckpt.file_hashes()
    assert "config.json" in hashes and len(hashes) == 5


def test_loader_scan_without_index(tmp_path, tiny):
    cfg, tensors, _ = tiny
    stored = write_checkpoint(tmp_path, tiny_root(), tensors, shards=2, index=False)
    m = bind(cfg, Checkpoint(tmp_path), n_layers=2)
    assert np.array_equal(m.embed, stored["language_model.model.embed_tokens.weight"])


def test_bind_checks_full_shape_and_dtype(tiny):
    cfg, tensors, _ = tiny
    bad = dict(tensors)
    k = "language_model.model.layers.4.self_attn.o_proj.weight"
    bad[k] = tensors[k].T.copy()                         # same element count, transposed
    del bad["language_model.model.norm.weight"]
    e = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    bad[e] = tensors[e].astype(np.float64)
    with pytest.raises(BindError) as ei:
        bind(cfg, bad)
    msg = str(ei.value)
    assert "layers.4.self_attn.o_proj.weight: shape [64, 128]" in msg
    assert "norm.weight" in msg and "experts.3.w2" in msg


def _st_bytes(header: dict, data: bytes, hlen=None) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h) if hlen is None else hlen) + h + data


@pytest.mark.parametrize("case,needle", [
    ("hlen_too_big", "header length"),
    ("offsets_outside", "outside the data region"),
    ("size_mismatch", "offsets span"),
    ("unknown_dtype", "unknown dtype"),
    ("not_json", "not valid JSON"),
    ("short", "too short"),
])
def test_safetensors_header_bounds(tmp_path, case, needle):
    p = tmp_path / "x.safetensors"
    good = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    if case == "hlen_too_big":
        raw = _st_bytes(good, b"\0" * 8, hlen=1 << 40)
    elif case == "offsets_outside":
        raw = _st_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, b"\0" * 8)
    elif case == "size_mismatch":
        raw = _st_bytes({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8)
    elif case == "unknown_dtype":
        raw = _st_bytes({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
    elif case == "not_json":
        raw = struct.pack("<Q", 4) + b"{{{{" + b"\0" * 8
    else:
        raw = b"\1\0"
    p.write_bytes(raw)
    with pytest.raises(SafetensorsError, match=needle):
        read_header(p)


def test_checkpoint_refuses_bad_index_and_unsupported_dtype(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"x": ("F16", np.zeros(2, dtype="<f2")),
                                                   "y": ("F32", np.ones(2, dtype="<f4"))})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../a.safetensors"}}))
    with pytest.raises(CheckpointError, match="plain file name"):
        Checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "b.safetensors"}}))
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    ck = Checkpoint(tmp_path)
    assert ck["y"].tolist() == [1.0, 1.0]
    with pytest.raises(CheckpointError, match="F16"):
        ck["x"]                                          # never decoded through f16 (I32)
    write_safetensors(tmp_path / "b.safetensors", {"y": ("F32", np.ones(2, dtype="<f4"))})
    with pytest.raises(CheckpointError, match="appears twice"):
        Checkpoint(tmp_path)


# --------------------------------------------------------------------------------------------
# CLI and the committed fixture
# --------------------------------------------------------------------------------------------

def run_cli(*args):
    return subprocess.run([sys.executable, str(SCRIPTS / "k3_reference.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_cli_writes_all_outputs(written, tmp_path, tiny):
    d, stored = written
    cfg, _, _ = tiny
    out = tmp_path / "ref"
    r = run_cli(d, "--ids", ",".join(map(str, PROMPT)), "--gen", "5", "--out-dir", out, "--seed", "7",
                "--dump-trace", tmp_path / "trace.npz")
    assert r.returncode == 0, r.stderr
    trace = np.load(tmp_path / "trace.npz")
    assert trace["L12.mla.c"].shape == (12, cfg.kv_lora_rank) and trace["L1.moe.sel"].shape == (12, 2)
    gen = json.loads((out / "greedy_ids.json").read_text())
    assert r.stdout.strip() == ",".join(map(str, gen)) and len(gen) == 5
    assert json.loads((out / "prompt_ids.json").read_text()) == PROMPT
    tf = json.loads((out / "teacher_forcing.json").read_text())
    assert len(tf) == 17 and tf[11:16] == gen
    logits = np.fromfile(out / "logits_step0.f32", dtype="<f4")
    m = bind(cfg, stored)
    want = forward(m, PROMPT, State.new(m))[-1]
    assert logits.shape == (cfg.vocab_size,) and np.allclose(logits, want, rtol=1e-6, atol=1e-6)
    assert np.array_equal(trace["logits"][-1], want)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["mla_norm_eps"] == 1e-6 and meta["seed"] == 7 and len(meta["greedy_top1_top2_margins"]) == 5
    assert meta["checkpoint_sha256"] == Checkpoint(d).file_hashes()
    r2 = run_cli(d, "--ids", ",".join(map(str, PROMPT)), "--gen", "5", "--mode", "incremental")
    assert r2.returncode == 0 and r2.stdout.strip() == r.stdout.strip()


def test_cli_refusals_exit_2(tmp_path, written):
    d, _ = written
    assert run_cli(d, "--ids", "1,x").returncode == 2
    assert run_cli(d, "--ids", "1,256").returncode == 2
    assert run_cli(d, "--ids", "1", "--layers", "14").returncode == 2
    bad = tiny_root()
    del bad["text_config"]["activation_situ_beta"]
    (tmp_path / "config.json").write_text(json.dumps(bad))
    r = run_cli(d, "--ids", "1", "--config", tmp_path / "config.json")
    assert r.returncode == 2 and "activation_situ_beta" in r.stderr


FIXTURE_MODEL = REPO / "fixtures" / "tiny" / "model"
FIXTURE_REF = REPO / "fixtures" / "tiny" / "reference"


@pytest.mark.skipif(not FIXTURE_MODEL.is_dir(),
                    reason="fixtures/tiny/model is absent (run scripts/make-fixtures.sh once "
                           "scripts/make-checkpoint.py has landed)")
def test_committed_fixture_is_reproduced():
    """Re-running the reference on fixtures/tiny/model reproduces fixtures/tiny/reference/."""
    from k3ref.config import read_config
    meta = json.loads((FIXTURE_REF / "meta.json").read_text())
    ckpt = Checkpoint(FIXTURE_MODEL)
    assert ckpt.file_hashes() == meta["checkpoint_sha256"], \
        "fixtures/tiny/model changed without regenerating fixtures/tiny/reference (make-fixtures.sh)"
    cfg = read_config(FIXTURE_MODEL / "config.json")
    model = bind(cfg, ckpt, meta["layers_bound"], meta["mla_norm_eps"])
    prompt = json.loads((FIXTURE_REF / "prompt_ids.json").read_text())
    want_ids = json.loads((FIXTURE_REF / "greedy_ids.json").read_text())
    assert len(prompt) == 12 and len(want_ids) == 20
    for mode in ("full", "incremental"):
        ids, rows = greedy(model, prompt, len(want_ids), mode)
        assert ids == want_ids, mode
    tf = forward(model, prompt + want_ids, State.new(model))
    assert [argmax_first(r) for r in tf] == json.loads((FIXTURE_REF / "teacher_forcing.json").read_text())
    logits = np.fromfile(FIXTURE_REF / "logits_step0.f32", dtype="<f4")
    assert logits.shape == (cfg.vocab_size,)
    assert np.allclose(logits, rows[0], rtol=1e-6, atol=1e-6 * float(np.max(np.abs(rows[0]))))
