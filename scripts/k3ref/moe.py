"""Stable LatentMoE (SPEC.md §3.7) and the dense SiTU MLP (§3.8)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ops import rms_norm, sigmoid, situ, situ_mlp


@dataclass
class DenseWeights:
    gate: np.ndarray         # [I, E]  mlp.gate_proj
    up: np.ndarray           # [I, E]  mlp.up_proj
    down: np.ndarray         # [E, I]  mlp.down_proj


@dataclass
class Expert:
    w1: np.ndarray           # [I, Lat] gate
    w3: np.ndarray           # [I, Lat] up
    w2: np.ndarray           # [Lat, I] down


@dataclass
class MoeWeights:
    router: np.ndarray       # [N, E]   gate.weight
    bias: np.ndarray         # [N]      gate.e_score_correction_bias (selection only)
    down: np.ndarray         # [Lat, E] routed_expert_down_proj
    norm: np.ndarray | None  # [Lat]    routed_expert_norm (latent_moe_use_norm)
    up: np.ndarray           # [E, Lat] routed_expert_up_proj
    experts: list[Expert]
    shared: DenseWeights | None  # widths num_shared_experts · moe_intermediate_size


@dataclass(frozen=True)
class MoeParams:
    top_k: int
    renormalize: bool
    scaling: float
    beta1: float
    beta2: float
    norm_eps: float


def select_top_k(biased: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values per row; ties: higher value first, then LOWER index."""
    n = biased.shape[-1]
    idx = np.broadcast_to(np.arange(n), biased.shape)
    order = np.lexsort((idx, -biased), axis=-1)     # primary key -biased, secondary index
    return order[..., :k]


def route(x: np.ndarray, w: MoeWeights, p: MoeParams):
    """Router on the full-width x. Returns (sel [T,k], weights [T,k], unbiased scores [T,N])."""
    scores = sigmoid(x @ w.router.T)                      # independent sigmoids, not softmax
    sel = select_top_k(scores + w.bias, p.top_k)          # bias steers SELECTION only
    weights = np.take_along_axis(scores, sel, axis=-1)    # unbiased scores
    if p.top_k > 1 and p.renormalize:
        weights = weights / (np.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return sel, weights * p.scaling, scores


def moe_forward(x: np.ndarray, w: MoeWeights, p: MoeParams, trace: dict | None = None,
                tag: str = "") -> np.ndarray:
    """x: [T, E] = RMSNorm(aggregated; post_attention_layernorm)."""
    sel, weights, _ = route(x, w, p)
    z = x @ w.down.T                                      # [T, Lat] latent
    acc = np.zeros_like(z)
    for e in np.unique(sel):
        rows, slot = np.nonzero(sel == e)
        ex = w.experts[e]
        y = situ(z[rows] @ ex.w1.T, z[rows] @ ex.w3.T, p.beta1, p.beta2) @ ex.w2.T
        acc[rows] += weights[rows, slot][:, None] * y
    if w.norm is not None:
        acc = rms_norm(acc, w.norm, p.norm_eps)           # on the weighted AGGREGATE, once
    routed = acc @ w.up.T
    out = routed
    if w.shared is not None:                              # full-width x, unweighted
        out = out + situ_mlp(x, w.shared.gate, w.shared.up, w.shared.down, p.beta1, p.beta2)
    if trace is not None:
        trace.update({f"{tag}moe.sel": sel, f"{tag}moe.weights": weights, f"{tag}moe.routed": routed,
                      f"{tag}moe.out": out})
    return out


def dense_forward(x: np.ndarray, w: DenseWeights, beta1: float, beta2: float) -> np.ndarray:
    return situ_mlp(x, w.gate, w.up, w.down, beta1, beta2)
