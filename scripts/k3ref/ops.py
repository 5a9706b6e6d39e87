"""Elementwise / normalisation building blocks (SPEC.md §3.1-§3.3), float64 throughout."""
from __future__ import annotations

import numpy as np


def sigmoid(z: np.ndarray) -> np.ndarray:
    """σ(z) = 1/(1+e^{-z}), evaluated without overflow for large |z|."""
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu(z: np.ndarray) -> np.ndarray:
    """silu(z) = z·σ(z)."""
    return z * sigmoid(z)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: w ⊙ x / sqrt(mean(x²) + eps). No (1+w) offset, no centring."""
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x / np.sqrt(ms + eps))


L2_EPS = 1e-6


def l2_norm(x: np.ndarray, eps: float = L2_EPS) -> np.ndarray:
    """KDA q/k normalisation over the last axis: x / sqrt(Σ x² + eps) — SUM of squares."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def situ(gate: np.ndarray, up: np.ndarray, beta1: float, beta2: float) -> np.ndarray:
    """SiTU-GLU (§3.2): β1·tanh(g/β1)·σ(g) · β2·tanh(u/β2). σ takes the UNCAPPED gate."""
    a = beta1 * np.tanh(gate / beta1) * sigmoid(gate)
    u = beta2 * np.tanh(up / beta2)
    return a * u


def situ_mlp(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray,
             beta1: float, beta2: float) -> np.ndarray:
    """down · SiTU([gate·x | up·x]) for rows of x (gate = w1/gate_proj, up = w3/up_proj)."""
    return situ(x @ w_gate.T, x @ w_up.T, beta1, beta2) @ w_down.T


def softmax(s: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(s, axis=axis, keepdims=True)
    e = np.exp(s - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def attn_res(sources: list[np.ndarray], query: np.ndarray, eps: float) -> np.ndarray:
    """Block AttnRes aggregation (§3.3) for a list of [T, E] sources.

    Keys are the RMS-normalised sources (no gain; the gain is folded into ``query`` =
    norm.weight ⊙ proj.weight), values are the RAW sources; softmax over the sources, per token.
    """
    stack = np.stack(sources, axis=0)                                 # [n, T, E]
    keys = stack / np.sqrt(np.mean(stack * stack, axis=-1, keepdims=True) + eps)
    scores = keys @ query                                             # [n, T]
    p = softmax(scores, axis=0)
    return np.einsum("nt,nte->te", p, stack)
