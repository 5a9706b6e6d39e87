"""The Kimi K3 text tensor graph (SPEC.md §2): names, shapes, dtypes, and the units the
writer lays out on disk.

A *unit* is a run of tensors written back to back in one shard: a model-level tensor, one
layer's non-expert ("trunk") tensors, or one routed expert's six MXFP4 tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .presets import Dims

DTYPE_SIZE = {"BF16": 2, "F32": 4, "U8": 1}

LM = "language_model."
MODEL = "language_model.model."

# Order of one expert's six tensors on disk: lexicographic, as observed in the release (§4).
EXPERT_PARTS = (
    "w1.weight_packed",
    "w1.weight_scale",
    "w2.weight_packed",
    "w2.weight_scale",
    "w3.weight_packed",
    "w3.weight_scale",
)


class Tensor:
    """One safetensors entry plus the recipe (role, param) for its values (see values.py)."""

    __slots__ = ("name", "dtype", "shape", "role", "param", "numel", "nbytes")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], role: str, param: float = 1.0):
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.role = role
        self.param = param
        n = 1
        for dim in shape:
            n *= dim
        self.numel = n
        self.nbytes = n * DTYPE_SIZE[dtype]

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.dtype}, {self.shape}, {self.role})"


@dataclass
class Unit:
    """Tensors that are written contiguously, in this order, inside one shard."""

    kind: str  # "model", "trunk", "expert", "vision"
    tensors: list[Tensor]
    layer: int | None = None
    expert: int | None = None
    note: str = ""  # e.g. why an expert unit is deliberately not contiguous
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(t.nbytes for t in self.tensors)


# Output-scale multipliers for the BF16 matrices (weights are N(0,1) * gain / sqrt(fan_in)).
# Chosen so that the tiny model's hidden states stay O(1) over 13 layers and its logits have
# a spread (see fixtures/tiny/README.md for the measured statistics).
GAIN = {
    "lm_head": 3.0,
    "o_proj": 1.0,
    "down": 1.0,
}


def _lin(name: str, out: int, inp: int, gain: float = 1.0) -> Tensor:
    return Tensor(name, "BF16", (out, inp), "linear", gain)


def _gain(name: str, n: int) -> Tensor:
    return Tensor(name, "BF16", (n,), "gain", 0.1)


def model_head_tensors(d: Dims) -> list[Tensor]:
    """The model-level tensors written after the last layer (embed is written first)."""
    E = d.hidden
    return [
        _gain(MODEL + "norm.weight", E),
        _gain(MODEL + "output_attn_res_norm.weight", E),
        Tensor(MODEL + "output_attn_res_proj.weight", "BF16", (1, E), "res_proj", 2.0),
        _lin(LM + "lm_head.weight", d.vocab, E, GAIN["lm_head"]),
    ]


def embed_tensor(d: Dims) -> Tensor:
    return Tensor(MODEL + "embed_tokens.weight", "BF16", (d.vocab, d.hidden), "embed", 1.0)


def layer_trunk(d: Dims, L: int) -> list[Tensor]:
    """Non-expert tensors of 0-based layer L, in on-disk (lexicographic) order."""
    E, P, D, H = d.hidden, d.kda_proj, d.kda_head_dim, d.kda_heads
    p = f"{MODEL}layers.{L}."
    ts = [
        _gain(p + "input_layernorm.weight", E),
        _gain(p + "post_attention_layernorm.weight", E),
        _gain(p + "self_attention_res_norm.weight", E),
        Tensor(p + "self_attention_res_proj.weight", "BF16", (1, E), "res_proj", 2.0),
        _gain(p + "mlp_res_norm.weight", E),
        Tensor(p + "mlp_res_proj.weight", "BF16", (1, E), "res_proj", 2.0),
    ]
    a = p + "self_attn."
    if d.is_mla(L):
        Hm = d.mla_heads
        ts += [
            _lin(a + "q_a_proj.weight", d.q_lora, E),
            _gain(a + "q_a_layernorm.weight", d.q_lora),
            _lin(a + "q_b_proj.weight", Hm * (d.nope + d.rope), d.q_lora),
            _lin(a + "kv_a_proj_with_mqa.weight", d.kv_lora + d.rope, E),
            _gain(a + "kv_a_layernorm.weight", d.kv_lora),
            _lin(a + "kv_b_proj.weight", Hm * (d.nope + d.v_head), d.kv_lora),
            _lin(a + "o_proj.weight", E, Hm * d.v_head, GAIN["o_proj"]),
            _lin(a + "g_proj.weight", Hm * d.v_head, E),
        ]
    else:
        ts += [
            _lin(a + "q_proj.weight", P, E),
            _lin(a + "k_proj.weight", P, E),
            _lin(a + "v_proj.weight", P, E),
            Tensor(a + "q_conv1d.weight", "F32", (P, 1, d.conv), "conv", 0.5),
            Tensor(a + "k_conv1d.weight", "F32", (P, 1, d.conv), "conv", 0.5),
            Tensor(a + "v_conv1d.weight", "F32", (P, 1, d.conv), "conv", 0.5),
            _lin(a + "f_a_proj.weight", D, E),
            _lin(a + "f_b_proj.weight", P, D),
            # A_log is [head_dim] on disk; entries 0..H-1 are used, the tail is zero (§2.4, C2).
            Tensor(a + "A_log", "F32", (D,), "a_log", float(H)),
            Tensor(a + "dt_bias", "F32", (P,), "normal_f32", 0.5),
            _lin(a + "b_proj.weight", H, E),
            _lin(a + "g_proj.weight", P, E),
            Tensor(a + "o_norm.weight", "F32", (D,), "gain", 0.1),
            _lin(a + "o_proj.weight", E, P, GAIN["o_proj"]),
        ]
    if L < 1:  # first_k_dense_replace = 1
        m = p + "mlp."
        ts += [
            _lin(m + "gate_proj.weight", d.dense_inter, E),
            _lin(m + "up_proj.weight", d.dense_inter, E),
            _lin(m + "down_proj.weight", E, d.dense_inter, GAIN["down"]),
        ]
    else:
        m = p + "block_sparse_moe."
        S = d.shared * d.moe_inter
        ts += [
            _lin(m + "gate.weight", d.experts, E),
            Tensor(m + "gate.e_score_correction_bias", "F32", (d.experts,), "normal_f32", 0.25),
            _lin(m + "routed_expert_down_proj.weight", d.latent, E),
            _gain(m + "routed_expert_norm.weight", d.latent),
            _lin(m + "routed_expert_up_proj.weight", E, d.latent, GAIN["down"]),
            _lin(m + "shared_experts.gate_proj.weight", S, E),
            _lin(m + "shared_experts.up_proj.weight", S, E),
            _lin(m + "shared_experts.down_proj.weight", E, S, GAIN["down"]),
        ]
    return sorted(ts, key=lambda t: t.name)


def expert_tensors(d: Dims, L: int, e: int) -> list[Tensor]:
    """The six MXFP4 tensors of routed expert e of layer L (logical w1/w3 [inter, latent],
    w2 [latent, inter]; packed [out, in/2], scale [out, in/32]). param = logical input width."""
    p = f"{MODEL}layers.{L}.block_sparse_moe.experts.{e}."
    I, Lat = d.moe_inter, d.latent
    shapes = {"w1": (I, Lat), "w2": (Lat, I), "w3": (I, Lat)}
    out = []
    for part in EXPERT_PARTS:
        w, kind = part.split(".")
        rows, cols = shapes[w]
        if kind == "weight_packed":
            out.append(Tensor(p + part, "U8", (rows, cols // 2), "mx_packed", float(cols)))
        else:
            out.append(Tensor(p + part, "U8", (rows, cols // 32), "mx_scale", float(cols)))
    return out


def vision_tensors() -> list[Tensor]:
    """168 synthetic vision tower / projector tensors (names and shapes are plausible
    stand-ins, NOT the release's); they exist only so readers prove they skip these prefixes."""
    V, Vi = 1024, 4096
    ts = [
        Tensor("vision_tower.patch_embed.proj.weight", "BF16", (V, 3, 14, 14), "hole"),
        Tensor("vision_tower.patch_embed.pos_emb.weight", "BF16", (64, 64, V), "hole"),
    ]
    for i in range(27):
        b = f"vision_tower.encoder.blocks.{i}."
        ts += [
            Tensor(b + "norm0.weight", "BF16", (V,), "hole"),
            Tensor(b + "norm1.weight", "BF16", (V,), "hole"),
            Tensor(b + "wqkv.weight", "BF16", (3 * V, V), "hole"),
            Tensor(b + "wo.weight", "BF16", (V, V), "hole"),
            Tensor(b + "mlp.fc0.weight", "BF16", (Vi, V), "hole"),
            Tensor(b + "mlp.fc1.weight", "BF16", (V, Vi), "hole"),
        ]
    ts += [
        Tensor("vision_tower.encoder.final_layernorm.weight", "BF16", (V,), "hole"),
        Tensor("mm_projector.pre_norm.weight", "BF16", (V,), "hole"),
        Tensor("mm_projector.proj.0.weight", "BF16", (4 * V, 4 * V), "hole"),
        Tensor("mm_projector.proj.2.weight", "BF16", (7168, 4 * V), "hole"),
    ]
    return ts


# The deliberately non-contiguous expert of the tiny fixture: a model-level tensor is written
# between its w1 and w2 tensors, so its six tensors do not form one byte range.
GAP_EXPERT = (1, 3)
GAP_TENSOR = MODEL + "norm.weight"


def build_units(d: Dims) -> list[Unit]:
    """All units in on-disk order: embed, then per layer its trunk run followed by its
    experts, then the remaining model-level tensors (and, for the skeleton, vision)."""
    units = [Unit("model", [embed_tensor(d)])]
    head = model_head_tensors(d)
    gap = None
    if d.name == "tiny":
        gap = next(t for t in head if t.name == GAP_TENSOR)
        head = [t for t in head if t.name != GAP_TENSOR]
    for L in range(d.layers):
        units.append(Unit("trunk", layer_trunk(d, L), layer=L))
        if L < 1:
            continue
        for e in range(d.experts):
            ts = expert_tensors(d, L, e)
            note = ""
            if gap is not None and (L, e) == GAP_EXPERT:
                ts = ts[:2] + [gap] + ts[2:]
                note = f"{GAP_TENSOR} written between w1.weight_scale and w2.weight_packed"
            units.append(Unit("expert", ts, layer=L, expert=e, note=note))
    units += [Unit("model", [t]) for t in head]
    if d.vision:
        units += [Unit("vision", [t]) for t in vision_tensors()]
    return units


def assign_shards(units: list[Unit], shards: int) -> list[int]:
    """Shard index per unit: units stay in order and each goes to the shard that holds the
    midpoint of its byte range when the total is cut into `shards` equal parts. Units are
    never split, so a layer's trunk run or an expert never straddles two shards."""
    total = sum(u.nbytes for u in units)
    out = []
    start = 0
    for u in units:
        mid2 = 2 * start + u.nbytes  # twice the midpoint, to stay in integers
        out.append(min(shards - 1, (mid2 * shards) // (2 * total)))
        start += u.nbytes
    used = set(out)
    if used != set(range(shards)):
        raise ValueError(f"cannot spread {len(units)} units over {shards} non-empty shards")
    return out


def shard_name(i: int, n: int) -> str:
    """`model-00001-of-000096.safetensors`: 5-digit index, 6-digit total (as released)."""
    return f"model-{i + 1:05d}-of-{n:06d}.safetensors"
