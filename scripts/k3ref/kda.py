"""Kimi Delta Attention layer (SPEC.md §3.4), float64, sequential recurrence.

Per head h the state S_h is [D_k][D_v] (indexed [k][v]). Per token, in this order:
  S ← diag(α)·S;  u ← Sᵀk;  S ← S + k ⊗ β(v − u);  o ← Sᵀ(q/√D)   (read the UPDATED state)
then y_h = RMSNorm(o_h; o_norm, eps) ⊙ σ(W_g x)_h  (norm FIRST, then gate), out = W_o·concat(y).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ops import l2_norm, rms_norm, sigmoid, silu


@dataclass
class KdaWeights:
    q_proj: np.ndarray      # [P, E]
    k_proj: np.ndarray      # [P, E]
    v_proj: np.ndarray      # [P, E]
    q_conv: np.ndarray      # [P, K]  (checkpoint [P, 1, K], tap K-1 = current token)
    k_conv: np.ndarray      # [P, K]
    v_conv: np.ndarray      # [P, K]
    f_a: np.ndarray         # [r, E]   decay bottleneck A (shared by all heads)
    f_b: np.ndarray         # [P, r]   decay bottleneck B
    a_log: np.ndarray       # [H]      per head (first H entries of the on-disk vector)
    dt_bias: np.ndarray     # [P]      per (head, channel), index h·D + d
    b_proj: np.ndarray      # [H, E]   β logits
    g_proj: np.ndarray      # [P, E]   full-rank output gate
    o_norm: np.ndarray      # [D]      head-wise RMSNorm gain shared by all heads
    o_proj: np.ndarray      # [E, P]


@dataclass
class KdaState:
    S: np.ndarray           # [H, D, D]  recurrent state, [h][k][v]
    hist_q: np.ndarray      # [K-1, P]   last K-1 RAW (pre-conv) projections, oldest first
    hist_k: np.ndarray
    hist_v: np.ndarray

    @classmethod
    def zeros(cls, heads: int, head_dim: int, kernel: int) -> "KdaState":
        p = heads * head_dim
        z = lambda: np.zeros((kernel - 1, p))  # noqa: E731
        return cls(np.zeros((heads, head_dim, head_dim)), z(), z(), z())


@dataclass(frozen=True)
class KdaDims:
    heads: int
    head_dim: int
    kernel: int
    lower_bound: float
    norm_eps: float


def short_conv(x_raw: np.ndarray, hist: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv + SiLU over T new rows of raw projections.

    y_t[c] = silu( Σ_{j=0..K-1} w[c, j] · in_{t-(K-1)+j}[c] ), tap K-1 = the current token; inputs
    before the sequence start come from ``hist`` (zeros for a fresh sequence). Returns (y, new
    history = last K-1 raw inputs).
    """
    k = w.shape[1]
    ext = np.concatenate([hist, x_raw], axis=0)              # [K-1+T, P]
    t = x_raw.shape[0]
    acc = np.zeros_like(x_raw)
    for j in range(k):
        acc = acc + w[:, j] * ext[j:j + t]
    new_hist = ext[ext.shape[0] - (k - 1):] if k > 1 else hist
    return silu(acc), new_hist.copy()


def decay_gate(x: np.ndarray, w: KdaWeights, dims: KdaDims) -> np.ndarray:
    """g[t,h,d] = lb · σ( exp(A_log[h]) · (z[t,h·D+d] + dt_bias[h·D+d]) ), z = W_fb(W_fa x)."""
    z = (x @ w.f_a.T) @ w.f_b.T                                 # [T, P], no activation between
    t = x.shape[0]
    z = (z + w.dt_bias).reshape(t, dims.heads, dims.head_dim)
    return dims.lower_bound * sigmoid(np.exp(w.a_log)[None, :, None] * z)


def recurrence(q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: np.ndarray, alpha: np.ndarray,
               S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sequential delta rule. q,k,v,alpha: [T,H,D] (q,k already L2-normalised, q NOT yet scaled),
    beta: [T,H]; S: [H,D,D]. Returns (o [T,H,D], final S)."""
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d)
    out = np.empty_like(v)
    for t in range(q.shape[0]):
        S = alpha[t][:, :, None] * S                                    # decay rows k
        u = np.einsum("hkv,hk->hv", S, k[t])                            # read
        S = S + k[t][:, :, None] * (beta[t][:, None] * (v[t] - u))[:, None, :]   # delta write
        out[t] = np.einsum("hkv,hk->hv", S, q[t] * scale)               # read UPDATED state
    return out, S


def kda_forward(x: np.ndarray, w: KdaWeights, dims: KdaDims, state: KdaState,
                trace: dict | None = None, tag: str = "") -> np.ndarray:
    """x: [T, E] normalised layer input (continuing ``state``, which is updated in place)."""
    t = x.shape[0]
    h, d = dims.heads, dims.head_dim
    q_raw, k_raw, v_raw = x @ w.q_proj.T, x @ w.k_proj.T, x @ w.v_proj.T
    q, state.hist_q = short_conv(q_raw, state.hist_q, w.q_conv)
    k, state.hist_k = short_conv(k_raw, state.hist_k, w.k_conv)
    v, state.hist_v = short_conv(v_raw, state.hist_v, w.v_conv)
    q = l2_norm(q.reshape(t, h, d))
    k = l2_norm(k.reshape(t, h, d))
    v = v.reshape(t, h, d)                                      # v is NOT normalised
    beta = sigmoid(x @ w.b_proj.T)                              # [T, H]
    g = decay_gate(x, w, dims)
    o, state.S = recurrence(q, k, v, beta, np.exp(g), state.S)
    gate = sigmoid(x @ w.g_proj.T).reshape(t, h, d)
    y = rms_norm(o, w.o_norm, dims.norm_eps) * gate             # norm first, then gate
    out = y.reshape(t, h * d) @ w.o_proj.T
    if trace is not None:
        trace.update({f"{tag}kda.q": q, f"{tag}kda.k": k, f"{tag}kda.v": v, f"{tag}kda.beta": beta,
                      f"{tag}kda.g": g, f"{tag}kda.o": o, f"{tag}kda.gate": gate, f"{tag}kda.out": out})
    return out
