"""Kimi K3's forward in JAX, batched [B, T], mirroring scripts/k3ref (SPEC.md §3) step by step.

The same code runs two ways:
* training: float32, routed experts fake-quantized to MXFP4 with a straight-through gradient
  (``qat=True``), unseen vocabulary folded into one shared row (see train.py);
* the third reference: float64 (``jax_enable_x64``), on parameters read back from the EXPORTED
  checkpoint (BF16-rounded trunk, MXFP4 experts dequantized exactly), full vocabulary.

Parameter names follow the checkpoint (see export.py for the mapping). AttnRes queries are used
as ``norm ⊙ proj``, exactly as the reference binds them.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

E2M1_MID = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)   # rounding thresholds (ties go DOWN)
E2M1_POS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MX_GROUP = 32
L2_EPS = 1e-6
MLA_NORM_EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# building blocks (k3ref/ops.py)

def rms_norm(x, w, eps):
    ms = jnp.mean(x * x, axis=-1, keepdims=True)
    return w * (x / jnp.sqrt(ms + eps))


def l2_norm(x, eps=L2_EPS):
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def situ(gate, up, b1, b2):
    return (b1 * jnp.tanh(gate / b1) * jax.nn.sigmoid(gate)) * (b2 * jnp.tanh(up / b2))


def situ_mlp(x, g, u, d, b1, b2):
    return situ(x @ g.T, x @ u.T, b1, b2) @ d.T


def attn_res(sources, query, eps):
    """sources: list of [B, T, E]; softmax over sources of RMS-normalised keys · query."""
    stack = jnp.stack(sources, axis=0)
    keys = stack / jnp.sqrt(jnp.mean(stack * stack, axis=-1, keepdims=True) + eps)
    p = jax.nn.softmax(keys @ query, axis=0)                       # [n, B, T]
    return jnp.einsum("nbt,nbte->bte", p, stack)


# ---------------------------------------------------------------------------------------------
# MXFP4 (k3ref/mxfp4.py): E8M0 scale per 32 inputs, E2M1 codes

def mx_exponent(w):
    """Per-group shared exponent e (scale 2^e), OCP rule floor(log2(amax)) - 2, clamped to
    [-100, 127] (E8M0 byte e + 127 never reaches 255, and 2^e stays a normal float32: XLA on CPU
    flushes subnormals, numpy does not)."""
    g = w.reshape(*w.shape[:-1], w.shape[-1] // MX_GROUP, MX_GROUP)
    amax = jnp.max(jnp.abs(g), axis=-1)
    e = jnp.floor(jnp.log2(jnp.maximum(amax, 2.0 ** -140))) - 2.0
    return jnp.clip(e, -100.0, 127.0)


def mx_quantize(w):
    """The value MXFP4 stores for w (same grid and rounding as export.py's packer)."""
    e = mx_exponent(jax.lax.stop_gradient(w))
    scale = jnp.exp2(e)[..., None]
    g = w.reshape(*w.shape[:-1], w.shape[-1] // MX_GROUP, MX_GROUP) / scale
    mag = jnp.abs(g)
    idx = sum((mag > m).astype(jnp.int32) for m in E2M1_MID)
    q = jnp.asarray(E2M1_POS, dtype=w.dtype)[idx] * jnp.sign(g)
    return (q * scale).reshape(w.shape)


def mx_fake(w):
    """Forward: the MXFP4 value; backward: identity (straight-through estimator)."""
    return w + jax.lax.stop_gradient(mx_quantize(w) - w)


# ---------------------------------------------------------------------------------------------
# KDA (k3ref/kda.py)

def short_conv(x, w):
    """x [B, T, P] raw projections of a fresh sequence, w [P, K] (tap K-1 = current token)."""
    k = w.shape[1]
    t = x.shape[1]
    ext = jnp.concatenate([jnp.zeros((x.shape[0], k - 1, x.shape[2]), x.dtype), x], axis=1)
    acc = jnp.zeros_like(x)
    for j in range(k):
        acc = acc + w[:, j] * ext[:, j:j + t]
    return jax.nn.silu(acc)


def kda(x, p, cfg):
    B, T, _ = x.shape
    H, D = cfg["kda_heads"], cfg["kda_head_dim"]
    q = short_conv(x @ p["q_proj"].T, p["q_conv"])
    k = short_conv(x @ p["k_proj"].T, p["k_conv"])
    v = short_conv(x @ p["v_proj"].T, p["v_conv"])
    q = l2_norm(q.reshape(B, T, H, D))
    k = l2_norm(k.reshape(B, T, H, D))
    v = v.reshape(B, T, H, D)
    beta = jax.nn.sigmoid(x @ p["b_proj"].T)                                  # [B, T, H]
    z = (x @ p["f_a"].T) @ p["f_b"].T
    z = (z + p["dt_bias"]).reshape(B, T, H, D)
    g = cfg["lower_bound"] * jax.nn.sigmoid(jnp.exp(p["a_log"])[None, None, :, None] * z)
    alpha = jnp.exp(g)
    scale = 1.0 / math.sqrt(D)

    def step(S, inp):
        qt, kt, vt, bt, at = inp                                              # [B, H, D], bt [B, H]
        S = at[..., :, None] * S                                              # decay rows k
        u = jnp.sum(S * kt[..., :, None], axis=-2)                            # Sᵀk
        S = S + kt[..., :, None] * (bt[..., None] * (vt - u))[..., None, :]
        o = jnp.sum(S * (qt * scale)[..., :, None], axis=-2)                  # Sᵀq, updated S
        return S, o

    tm = lambda a: jnp.swapaxes(a, 0, 1)                                      # noqa: E731
    S0 = jnp.zeros((B, H, D, D), x.dtype)
    _, o = jax.lax.scan(step, S0, (tm(q), tm(k), tm(v), tm(beta), tm(alpha)), unroll=cfg.get("unroll", 1))
    o = tm(o)                                                                 # [B, T, H, D]
    gate = jax.nn.sigmoid(x @ p["g_proj"].T).reshape(B, T, H, D)
    y = rms_norm(o, p["o_norm"], cfg["eps"]) * gate
    return y.reshape(B, T, H * D) @ p["o_proj"].T


# ---------------------------------------------------------------------------------------------
# gated MLA, NoPE (k3ref/mla.py, expanded form)

def mla(x, p, cfg):
    B, T, _ = x.shape
    H, nope, rope, vd, kvl = cfg["mla_heads"], cfg["nope"], cfg["rope"], cfg["v_head"], cfg["kv_lora"]
    q = rms_norm(x @ p["q_a"].T, p["q_a_norm"], MLA_NORM_EPS) @ p["q_b"].T
    q = q.reshape(B, T, H, nope + rope)
    ckv = x @ p["kv_a"].T
    c = rms_norm(ckv[..., :kvl], p["kv_a_norm"], MLA_NORM_EPS)
    kr = ckv[..., kvl:]
    kv = (c @ p["kv_b"].T).reshape(B, T, H, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(kr[:, :, None, :], (B, T, H, rope))], axis=-1)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(nope + rope)
    mask = jnp.tril(jnp.ones((T, T), dtype=bool))
    s = jnp.where(mask[None, None], s, -jnp.inf)
    pr = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhts,bshd->bthd", pr, v).reshape(B, T, H * vd)
    gate = jax.nn.sigmoid(x @ p["g_proj"].T)
    return (o * gate) @ p["o_proj"].T


# ---------------------------------------------------------------------------------------------
# Stable LatentMoE (k3ref/moe.py)

def moe(x, p, cfg, qat):
    """Returns (out, per-expert selection counts [N])."""
    N, k = cfg["experts"], cfg["top_k"]
    scores = jax.nn.sigmoid(x @ p["router"].T)                                # [B, T, N]
    biased = scores + jax.lax.stop_gradient(p["bias"])
    _, sel = jax.lax.top_k(jax.lax.stop_gradient(biased), k)                 # ties: lower index
    w = jnp.take_along_axis(scores, sel, axis=-1)
    if k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    w = w * cfg["scaling"]
    onehot = jax.nn.one_hot(sel, N, dtype=x.dtype)                            # [B, T, k, N]
    combine = jnp.einsum("btk,btkn->btn", w, onehot)
    z = x @ p["down"].T                                                       # [B, T, Lat]
    w1, w3, w2 = p["w1"], p["w3"], p["w2"]
    if qat:
        w1, w3, w2 = mx_fake(w1), mx_fake(w3), mx_fake(w2)
    b1, b2 = cfg["beta1"], cfg["beta2"]
    cap = cfg.get("capacity")
    if cap:
        # Training: each expert takes at most `cap` × its fair share of the batch's tokens (the
        # ones it weights most); a token past an expert's capacity loses that expert's share.
        Bx, Tx, Lat = z.shape
        n_tok = Bx * Tx
        C = min(n_tok, int(math.ceil(cap * n_tok * k / N)))
        cw = combine.reshape(n_tok, N).T                                      # [N, n_tok]
        top_w, top_i = jax.lax.top_k(jax.lax.stop_gradient(cw), C)            # [N, C]
        gw = jnp.take_along_axis(cw, top_i, axis=1)                           # differentiable
        zt = z.reshape(n_tok, Lat)[top_i]                                     # [N, C, Lat]
        h = situ(jnp.einsum("ncl,nil->nci", zt, w1), jnp.einsum("ncl,nil->nci", zt, w3), b1, b2)
        y = jnp.einsum("nci,nli->ncl", h, w2) * gw[..., None]
        acc = jnp.zeros((n_tok, Lat), z.dtype).at[top_i.reshape(-1)].add(y.reshape(-1, Lat))
        acc = acc.reshape(Bx, Tx, Lat)
    elif cfg.get("dense_experts", True):
        # Every expert on every token, weighted by `combine` (zero for unselected experts):
        # exact, and cheaper on 2 cores than a gather for 32 small experts.
        h = situ(jnp.einsum("btl,nil->btni", z, w1), jnp.einsum("btl,nil->btni", z, w3), b1, b2)
        y = jnp.einsum("btni,nli->btnl", h, w2)
        acc = jnp.einsum("btn,btnl->btl", combine, y)
    else:
        # Only the selected experts (the reference path for long single sequences).
        gw1, gw3, gw2 = w1[sel], w3[sel], w2[sel]                             # [B, T, k, ...]
        h = situ(jnp.einsum("btl,btkil->btki", z, gw1), jnp.einsum("btl,btkil->btki", z, gw3), b1, b2)
        y = jnp.einsum("btki,btkli->btkl", h, gw2)
        acc = jnp.einsum("btk,btkl->btl", w, y)
    acc = rms_norm(acc, p["norm"], cfg["eps"])
    out = acc @ p["up"].T
    out = out + situ_mlp(x, p["sh_gate"], p["sh_up"], p["sh_down"], b1, b2)
    counts = jnp.sum(onehot, axis=(0, 1, 2))
    return out, counts


# ---------------------------------------------------------------------------------------------
# the whole model (k3ref/model.py `forward`)

def forward(params, ids, cfg, qat=False):
    """ids [B, T] (indices into params['embed'] rows) -> (final hidden normed [B,T,E], counts)."""
    eps = cfg["eps"]
    block = cfg["block"]
    h = params["embed"][ids]
    bank = []
    pend = h
    counts = []
    for L, lp in enumerate(params["layers"]):
        x = pend if not bank else attn_res(bank + [pend], lp["attn_res_q_norm"] * lp["attn_res_q_proj"], eps)
        if L % block == 0:
            bank.append(pend)
            pend = None
        xn = rms_norm(x, lp["input_norm"], eps)
        a = kda(xn, lp["attn"], cfg) if cfg["kinds"][L] == "kda" else mla(xn, lp["attn"], cfg)
        pend = a if pend is None else pend + a
        x2 = attn_res(bank + [pend], lp["mlp_res_q_norm"] * lp["mlp_res_q_proj"], eps)
        xn2 = rms_norm(x2, lp["post_norm"], eps)
        if L < cfg["first_dense"]:
            m = situ_mlp(xn2, lp["mlp"]["gate"], lp["mlp"]["up"], lp["mlp"]["down"], cfg["beta1"], cfg["beta2"])
        else:
            m, c = moe(xn2, lp["mlp"], cfg, qat)
            counts.append(c)
        pend = pend + m
    x = attn_res(bank + [pend], params["out_res_q_norm"] * params["out_res_q_proj"], eps)
    return rms_norm(x, params["final_norm"], eps), counts


def logits(params, ids, cfg, qat=False):
    hn, counts = forward(params, ids, cfg, qat)
    return hn @ params["lm_head"].T, counts


def model_cfg(d) -> dict:
    """The static configuration the forward needs, from a k3gen Dims."""
    return {
        "kinds": tuple("mla" if d.is_mla(L) else "kda" for L in range(d.layers)),
        "eps": 1e-5, "block": d.block, "first_dense": 1,
        "kda_heads": d.kda_heads, "kda_head_dim": d.kda_head_dim, "lower_bound": -5.0,
        "mla_heads": d.mla_heads, "nope": d.nope, "rope": d.rope, "v_head": d.v_head,
        "kv_lora": d.kv_lora, "experts": d.experts, "top_k": d.top_k, "scaling": 1.0,
        "beta1": 4.0, "beta2": 25.0,
    }


def cfg_from_config(c) -> dict:
    """The same static configuration from a k3ref Config (config.json as k3 reads it)."""
    return {
        "kinds": c.layer_kinds, "eps": c.rms_norm_eps, "block": c.attn_res_block_size,
        "first_dense": c.first_k_dense_replace,
        "kda_heads": c.kda_num_heads, "kda_head_dim": c.kda_head_dim, "lower_bound": c.gate_lower_bound,
        "mla_heads": c.num_attention_heads, "nope": c.qk_nope_head_dim, "rope": c.qk_rope_head_dim,
        "v_head": c.v_head_dim, "kv_lora": c.kv_lora_rank, "experts": c.num_experts,
        "top_k": c.num_experts_per_token, "scaling": c.routed_scaling_factor,
        "beta1": c.situ_beta, "beta2": c.situ_linear_beta,
    }


def np_mx_pack(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy twin of ``mx_quantize`` producing the checkpoint bytes: (packed [out, in/2] U8,
    scale [out, in/32] U8). w is float32 [out, in]."""
    w = np.asarray(w, dtype=np.float32)
    out, inp = w.shape
    g = w.reshape(out, inp // MX_GROUP, MX_GROUP).astype(np.float64)
    amax = np.abs(g).max(axis=-1)
    e = np.clip(np.floor(np.log2(np.maximum(amax, 2.0 ** -140))) - 2.0, -100, 127)
    x = g / np.exp2(e)[..., None]
    mag = np.abs(x)
    idx = sum((mag > m).astype(np.uint8) for m in E2M1_MID).astype(np.uint8)
    sign = ((x < 0) & (idx > 0)).astype(np.uint8)
    codes = (idx | (sign << 3)).reshape(out, inp)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scale = (e + 127).astype(np.uint8)
    return packed, scale
