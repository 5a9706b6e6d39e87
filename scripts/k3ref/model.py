"""Binding checkpoint tensors to layers (one place) and the top-level forward (SPEC.md §3.3).

``tensors`` is any mapping name → ndarray supporting ``in`` and ``[]`` (a ``Checkpoint`` or a plain
dict of float64 arrays, with uint8 arrays for MXFP4 ``weight_packed``/``weight_scale``). Every
tensor's full shape is checked against the config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from . import mxfp4
from .config import Config
from .kda import KdaDims, KdaState, KdaWeights, kda_forward
from .mla import MlaCache, MlaDims, MlaWeights, mla_forward
from .moe import DenseWeights, Expert, MoeParams, MoeWeights, dense_forward, moe_forward
from .ops import attn_res, rms_norm

MODEL_PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
DEFAULT_MLA_NORM_EPS = 1e-6


class BindError(ValueError):
    """A tensor is missing or has the wrong shape/dtype (exit code 2)."""


@dataclass
class Layer:
    index: int
    kind: str                                  # "kda" | "mla"
    attn: KdaWeights | MlaWeights
    mlp: DenseWeights | MoeWeights
    input_norm: np.ndarray                     # [E]
    post_norm: np.ndarray                      # [E]
    attn_res_query: np.ndarray                 # [E] self_attention_res_norm ⊙ self_attention_res_proj
    mlp_res_query: np.ndarray                  # [E] mlp_res_norm ⊙ mlp_res_proj


@dataclass
class Model:
    cfg: Config
    layers: list[Layer]
    embed: np.ndarray                          # [V, E]
    final_norm: np.ndarray                     # [E]
    out_res_query: np.ndarray                  # [E] output_attn_res_norm ⊙ output_attn_res_proj
    lm_head: np.ndarray                        # [V, E] (untied)
    kda_dims: KdaDims
    mla_dims: MlaDims
    moe_params: MoeParams
    nan_scales: int = 0                        # E8M0 255 bytes seen (treated as 0)


class _Binder:
    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self.t = tensors
        self.problems: list[str] = []
        self.nan_scales = 0

    def float(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.t:
            self.problems.append(f"missing tensor {name}")
            return np.zeros(shape)
        a = self.t[name]
        if not np.issubdtype(a.dtype, np.floating):
            self.problems.append(f"{name}: expected a float tensor (BF16/F32), got {a.dtype}")
            return np.zeros(shape)
        if tuple(a.shape) != tuple(shape):
            self.problems.append(f"{name}: shape {list(a.shape)}, expected {list(shape)}")
            return np.zeros(shape)
        return np.asarray(a, dtype=np.float64)

    def vec1(self, name: str, n: int) -> np.ndarray:
        """An AttnRes projection [1, n] flattened."""
        return self.float(name, (1, n)).reshape(n)

    def a_log(self, name: str, heads: int) -> np.ndarray:
        """A_log is [head_dim] on disk with a zero tail (or [heads]); take the first `heads`."""
        if name not in self.t:
            self.problems.append(f"missing tensor {name}")
            return np.zeros(heads)
        a = self.t[name]
        if a.ndim != 1 or a.shape[0] < heads or not np.issubdtype(a.dtype, np.floating):
            self.problems.append(f"{name}: shape {list(a.shape)} {a.dtype}, expected a float vector "
                                 f"of length >= {heads}")
            return np.zeros(heads)
        return np.asarray(a[:heads], dtype=np.float64)

    def expert_matrix(self, prefix: str, out: int, inp: int) -> np.ndarray:
        """Routed-expert matrix: MXFP4 weight_packed/weight_scale (preferred) or a float .weight."""
        packed, scale = prefix + ".weight_packed", prefix + ".weight_scale"
        if packed in self.t or scale in self.t:
            if packed not in self.t or scale not in self.t:
                self.problems.append(f"{prefix}: weight_packed/weight_scale pair incomplete")
                return np.zeros((out, inp))
            p, s = self.t[packed], self.t[scale]
            if p.dtype != np.uint8 or s.dtype != np.uint8:
                self.problems.append(f"{prefix}: MXFP4 tensors must be U8, got {p.dtype}/{s.dtype}")
                return np.zeros((out, inp))
            if inp % mxfp4.GROUP or p.shape != (out, inp // 2) or s.shape != (out, inp // mxfp4.GROUP):
                self.problems.append(f"{prefix}: packed {list(p.shape)} / scale {list(s.shape)} do not "
                                     f"encode a [{out}, {inp}] MXFP4 matrix")
                return np.zeros((out, inp))
            w, nan = mxfp4.dequantize(p, s, inp)
            self.nan_scales += nan
            return w
        return self.float(prefix + ".weight", (out, inp))


def bind(cfg: Config, tensors: Mapping[str, np.ndarray], n_layers: int | None = None,
         mla_norm_eps: float = DEFAULT_MLA_NORM_EPS) -> Model:
    """Bind the first ``n_layers`` (default all) decoder layers; raises BindError listing problems."""
    n = cfg.num_hidden_layers if n_layers is None else n_layers
    if not 1 <= n <= cfg.num_hidden_layers:
        raise BindError(f"--layers {n} outside 1..{cfg.num_hidden_layers}")
    E, V = cfg.hidden_size, cfg.vocab_size
    H_k, D = cfg.kda_num_heads, cfg.kda_head_dim
    P = H_k * D
    K = cfg.short_conv_kernel_size
    H = cfg.num_attention_heads
    nope, rope, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    N, Lat, I = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    b = _Binder(tensors)
    layers = []
    for L in range(n):
        pre = f"{MODEL_PREFIX}layers.{L}."
        kind = cfg.layer_kinds[L]
        if kind == "kda":
            a = pre + "self_attn."
            r = tensors[a + "f_a_proj.weight"].shape[0] if a + "f_a_proj.weight" in tensors else D
            attn = KdaWeights(
                q_proj=b.float(a + "q_proj.weight", (P, E)),
                k_proj=b.float(a + "k_proj.weight", (P, E)),
                v_proj=b.float(a + "v_proj.weight", (P, E)),
                q_conv=b.float(a + "q_conv1d.weight", (P, 1, K)).reshape(P, K),
                k_conv=b.float(a + "k_conv1d.weight", (P, 1, K)).reshape(P, K),
                v_conv=b.float(a + "v_conv1d.weight", (P, 1, K)).reshape(P, K),
                f_a=b.float(a + "f_a_proj.weight", (r, E)),
                f_b=b.float(a + "f_b_proj.weight", (P, r)),
                a_log=b.a_log(a + "A_log", H_k),
                dt_bias=b.float(a + "dt_bias", (P,)),
                b_proj=b.float(a + "b_proj.weight", (H_k, E)),
                g_proj=b.float(a + "g_proj.weight", (P, E)),
                o_norm=b.float(a + "o_norm.weight", (D,)),
                o_proj=b.float(a + "o_proj.weight", (E, P)),
            )
        else:
            a = pre + "self_attn."
            attn = MlaWeights(
                q_a=b.float(a + "q_a_proj.weight", (cfg.q_lora_rank, E)),
                q_a_norm=b.float(a + "q_a_layernorm.weight", (cfg.q_lora_rank,)),
                q_b=b.float(a + "q_b_proj.weight", (H * (nope + rope), cfg.q_lora_rank)),
                kv_a=b.float(a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + rope, E)),
                kv_a_norm=b.float(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,)),
                kv_b=b.float(a + "kv_b_proj.weight", (H * (nope + vd), cfg.kv_lora_rank)),
                o_proj=b.float(a + "o_proj.weight", (E, H * vd)),
                g_proj=b.float(a + "g_proj.weight", (H * vd, E)) if cfg.mla_use_output_gate else None,
            )
        if cfg.is_dense(L):
            m = pre + "mlp."
            Idense = cfg.intermediate_size
            mlp = DenseWeights(gate=b.float(m + "gate_proj.weight", (Idense, E)),
                               up=b.float(m + "up_proj.weight", (Idense, E)),
                               down=b.float(m + "down_proj.weight", (E, Idense)))
        else:
            m = pre + "block_sparse_moe."
            Ish = cfg.num_shared_experts * I
            shared = None
            if cfg.num_shared_experts:
                shared = DenseWeights(gate=b.float(m + "shared_experts.gate_proj.weight", (Ish, E)),
                                      up=b.float(m + "shared_experts.up_proj.weight", (Ish, E)),
                                      down=b.float(m + "shared_experts.down_proj.weight", (E, Ish)))
            mlp = MoeWeights(
                router=b.float(m + "gate.weight", (N, E)),
                bias=b.float(m + "gate.e_score_correction_bias", (N,)),
                down=b.float(m + "routed_expert_down_proj.weight", (Lat, E)),
                norm=b.float(m + "routed_expert_norm.weight", (Lat,)) if cfg.latent_moe_use_norm else None,
                up=b.float(m + "routed_expert_up_proj.weight", (E, Lat)),
                experts=[Expert(w1=b.expert_matrix(f"{m}experts.{e}.w1", I, Lat),
                                w3=b.expert_matrix(f"{m}experts.{e}.w3", I, Lat),
                                w2=b.expert_matrix(f"{m}experts.{e}.w2", Lat, I)) for e in range(N)],
                shared=shared,
            )
        layers.append(Layer(
            index=L, kind=kind, attn=attn, mlp=mlp,
            input_norm=b.float(pre + "input_layernorm.weight", (E,)),
            post_norm=b.float(pre + "post_attention_layernorm.weight", (E,)),
            attn_res_query=(b.float(pre + "self_attention_res_norm.weight", (E,))
                            * b.vec1(pre + "self_attention_res_proj.weight", E)),
            mlp_res_query=(b.float(pre + "mlp_res_norm.weight", (E,))
                           * b.vec1(pre + "mlp_res_proj.weight", E)),
        ))
    embed = b.float(MODEL_PREFIX + "embed_tokens.weight", (V, E))
    final_norm = b.float(MODEL_PREFIX + "norm.weight", (E,))
    out_q = (b.float(MODEL_PREFIX + "output_attn_res_norm.weight", (E,))
             * b.vec1(MODEL_PREFIX + "output_attn_res_proj.weight", E))
    lm_head = b.float(LM_HEAD, (V, E))
    if b.problems:
        shown = b.problems[:20]
        more = f" (and {len(b.problems) - 20} more)" if len(b.problems) > 20 else ""
        raise BindError(f"checkpoint does not match the config: {'; '.join(shown)}{more}")
    eps = cfg.rms_norm_eps
    return Model(
        cfg=cfg, layers=layers, embed=embed, final_norm=final_norm, out_res_query=out_q,
        lm_head=lm_head,
        kda_dims=KdaDims(H_k, D, K, cfg.gate_lower_bound, eps),
        mla_dims=MlaDims(H, nope, rope, vd, cfg.kv_lora_rank, mla_norm_eps),
        moe_params=MoeParams(cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor,
                             cfg.situ_beta, cfg.situ_linear_beta, eps),
        nan_scales=b.nan_scales,
    )


@dataclass
class State:
    """Per-sequence carried state: KDA S + conv histories, MLA latent cache. Nothing else."""
    kda: dict[int, KdaState] = field(default_factory=dict)
    mla: dict[int, MlaCache] = field(default_factory=dict)
    n_tokens: int = 0

    @classmethod
    def new(cls, model: Model) -> "State":
        st = cls()
        d = model.kda_dims
        for layer in model.layers:
            if layer.kind == "kda":
                st.kda[layer.index] = KdaState.zeros(d.heads, d.head_dim, d.kernel)
            else:
                st.mla[layer.index] = MlaCache.empty(model.mla_dims)
        return st


def attention(model: Model, layer: Layer, x: np.ndarray, state: State, mla_form: str,
              trace: dict | None, tag: str) -> np.ndarray:
    if layer.kind == "kda":
        return kda_forward(x, layer.attn, model.kda_dims, state.kda[layer.index], trace, tag)
    return mla_forward(x, layer.attn, model.mla_dims, state.mla[layer.index], mla_form, trace, tag)


def mlp(model: Model, layer: Layer, x: np.ndarray, trace: dict | None, tag: str) -> np.ndarray:
    if isinstance(layer.mlp, DenseWeights):
        return dense_forward(x, layer.mlp, model.cfg.situ_beta, model.cfg.situ_linear_beta)
    return moe_forward(x, layer.mlp, model.moe_params, trace, tag)


def forward(model: Model, ids, state: State, mla_form: str = "expanded",
            trace: dict | None = None) -> np.ndarray:
    """Run T new tokens continuing ``state`` (updated in place); returns logits [T, V].

    ``trace`` (optional dict) receives every named intermediate, keyed ``L{n}.<name>``.
    """
    cfg = model.cfg
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise ValueError("forward needs at least one token")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"token id outside 0..{cfg.vocab_size - 1}")
    eps = cfg.rms_norm_eps
    block = cfg.attn_res_block_size
    h = model.embed[ids]                                        # no scaling
    bank: list[np.ndarray] = []
    pend: np.ndarray | None = h
    if trace is not None:
        trace["embed"] = h
    for layer in model.layers:
        L = layer.index
        tag = f"L{L}."
        # attention side: the aggregation is skipped only while the bank is empty (L = 0)
        x = pend if not bank else attn_res(bank + [pend], layer.attn_res_query, eps)
        if L % block == 0:                                      # boundary: snapshot raw pend, reset
            bank.append(pend)
            pend = None
        xn = rms_norm(x, layer.input_norm, eps)
        a = attention(model, layer, xn, state, mla_form, trace, tag)
        pend = a if pend is None else pend + a
        # MLP side: unconditional aggregation
        x2 = attn_res(bank + [pend], layer.mlp_res_query, eps)
        m = mlp(model, layer, rms_norm(x2, layer.post_norm, eps), trace, tag)
        pend = pend + m
        if trace is not None:
            trace.update({tag + "attn_in": x, tag + "attn_out": a, tag + "mlp_in": x2,
                          tag + "mlp_out": m, tag + "bank_size": len(bank)})
    x = attn_res(bank + [pend], model.out_res_query, eps)
    logits = rms_norm(x, model.final_norm, eps) @ model.lm_head.T
    if trace is not None:
        trace.update({"final_in": x, "final_bank_size": len(bank), "logits": logits})
    state.n_tokens += ids.size
    return logits


def argmax_first(logits: np.ndarray) -> int:
    """Greedy argmax; the first index wins ties."""
    return int(np.argmax(logits))


def top2_margin(logits: np.ndarray) -> float:
    i = argmax_first(logits)
    rest = np.delete(logits, i)
    return float(logits[i] - np.max(rest)) if rest.size else float("inf")


def greedy(model: Model, prompt: list[int], n_gen: int, mode: str = "full",
           mla_form: str = "expanded") -> tuple[list[int], list[np.ndarray]]:
    """Greedy decoding. mode "full": recompute the whole sequence from a fresh state each step;
    mode "incremental": prefill once, then one token per step with carried state.
    Returns (generated ids, the logits row used at each step)."""
    ids = list(prompt)
    rows: list[np.ndarray] = []
    if mode == "full":
        for _ in range(n_gen):
            row = forward(model, ids, State.new(model), mla_form)[-1]
            rows.append(row)
            ids.append(argmax_first(row))
    elif mode == "incremental":
        state = State.new(model)
        row = forward(model, ids, state, mla_form)[-1]
        for step in range(n_gen):
            rows.append(row)
            ids.append(argmax_first(row))
            if step + 1 < n_gen:
                row = forward(model, ids[-1:], state, mla_form)[-1]
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return ids[len(prompt):], rows
