"""Gated MLA layer, NoPE (SPEC.md §3.5), in two mathematically identical forms:

* ``expanded``: k_h = [W_UK[h] c_s | kr_s], v_h = W_UV[h] c_s for every cached position;
* ``latent`` (absorbed, §3.6): q̃_h = W_UK[h]ᵀ q_nope_h, score = (q̃_h·c_s + q_rope_h·kr_s)/√(nope+rope),
  o_h = W_UV[h] (Σ_s p_s c_s).

The cache always holds the latent per position: c_s (post kv_a_layernorm) and kr_s (raw).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .ops import rms_norm, sigmoid, softmax


@dataclass
class MlaWeights:
    q_a: np.ndarray          # [q_lora, E]
    q_a_norm: np.ndarray     # [q_lora]
    q_b: np.ndarray          # [H·(nope+rope), q_lora], rows h·(nope+rope) + j: j < nope → nope
    kv_a: np.ndarray         # [kv_lora + rope, E]: rows < kv_lora → c, the rest → shared k_rope
    kv_a_norm: np.ndarray    # [kv_lora]
    kv_b: np.ndarray         # [H·(nope+v), kv_lora], rows h·(nope+v) + j: j < nope → k_nope, else v
    o_proj: np.ndarray       # [E, H·v]
    g_proj: np.ndarray | None  # [H·v, E] (mla_use_output_gate)


@dataclass(frozen=True)
class MlaDims:
    heads: int
    nope: int
    rope: int
    v: int
    kv_lora: int
    norm_eps: float          # q_a_layernorm / kv_a_layernorm eps (SPEC.md §10 C1; default 1e-6)


@dataclass
class MlaCache:
    c: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))   # [S, kv_lora]
    kr: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [S, rope]

    @classmethod
    def empty(cls, dims: MlaDims) -> "MlaCache":
        return cls(np.zeros((0, dims.kv_lora)), np.zeros((0, dims.rope)))


def project(x: np.ndarray, w: MlaWeights, dims: MlaDims):
    """Returns q [T,H,nope+rope], c [T,kv_lora] (normalised), kr [T,rope] (raw, unrotated)."""
    t = x.shape[0]
    q = rms_norm(x @ w.q_a.T, w.q_a_norm, dims.norm_eps) @ w.q_b.T
    q = q.reshape(t, dims.heads, dims.nope + dims.rope)
    ckv = x @ w.kv_a.T
    c = rms_norm(ckv[:, :dims.kv_lora], w.kv_a_norm, dims.norm_eps)
    kr = ckv[:, dims.kv_lora:]
    return q, c, kr


def _causal_mask(t: int, s: int) -> np.ndarray:
    """mask[i, j] True where key j is visible to query i; queries are the LAST t of s positions."""
    t0 = s - t
    return np.arange(s)[None, :] <= (t0 + np.arange(t))[:, None]


def attend_expanded(q: np.ndarray, c: np.ndarray, kr: np.ndarray, w: MlaWeights, dims: MlaDims):
    """q [T,H,nope+rope] for the last T of S cached positions; returns o [T,H,v]."""
    s = c.shape[0]
    kv = (c @ w.kv_b.T).reshape(s, dims.heads, dims.nope + dims.v)
    k_nope, v = kv[..., :dims.nope], kv[..., dims.nope:]
    k = np.concatenate([k_nope, np.broadcast_to(kr[:, None, :], (s, dims.heads, dims.rope))], axis=-1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(dims.nope + dims.rope)
    scores = np.where(_causal_mask(q.shape[0], s)[None], scores, -np.inf)
    p = softmax(scores, axis=-1)
    return np.einsum("hts,shd->thd", p, v)


def attend_latent(q: np.ndarray, c: np.ndarray, kr: np.ndarray, w: MlaWeights, dims: MlaDims):
    """Absorbed form of ``attend_expanded`` (§3.6)."""
    s = c.shape[0]
    kvb = w.kv_b.reshape(dims.heads, dims.nope + dims.v, dims.kv_lora)
    w_uk, w_uv = kvb[:, :dims.nope, :], kvb[:, dims.nope:, :]          # [H,nope,lat], [H,v,lat]
    q_lat = np.einsum("thn,hnl->thl", q[..., :dims.nope], w_uk)      # q̃_h = W_UK[h]ᵀ q_nope_h
    scores = (np.einsum("thl,sl->hts", q_lat, c)
              + np.einsum("thr,sr->hts", q[..., dims.nope:], kr)) / np.sqrt(dims.nope + dims.rope)
    scores = np.where(_causal_mask(q.shape[0], s)[None], scores, -np.inf)
    p = softmax(scores, axis=-1)
    c_hat = np.einsum("hts,sl->thl", p, c)                              # Σ_s p_s c_s per head
    return np.einsum("thl,hvl->thv", c_hat, w_uv)


def mla_forward(x: np.ndarray, w: MlaWeights, dims: MlaDims, cache: MlaCache, form: str = "expanded",
                trace: dict | None = None, tag: str = "") -> np.ndarray:
    """x: [T, E] normalised layer input; appends T positions to ``cache`` (updated in place)."""
    t = x.shape[0]
    q, c, kr = project(x, w, dims)
    cache.c = np.concatenate([cache.c, c], axis=0)
    cache.kr = np.concatenate([cache.kr, kr], axis=0)
    if form == "expanded":
        o = attend_expanded(q, cache.c, cache.kr, w, dims)
    elif form == "latent":
        o = attend_latent(q, cache.c, cache.kr, w, dims)
    else:
        raise ValueError(f"unknown MLA form {form!r}")
    o = o.reshape(t, dims.heads * dims.v)
    gate = sigmoid(x @ w.g_proj.T) if w.g_proj is not None else None
    gated = o * gate if gate is not None else o                  # gate BEFORE o_proj, no norm
    out = gated @ w.o_proj.T
    if trace is not None:
        trace.update({f"{tag}mla.q": q, f"{tag}mla.c": c, f"{tag}mla.kr": kr, f"{tag}mla.o": o,
                      f"{tag}mla.gate": gate, f"{tag}mla.out": out})
    return out
