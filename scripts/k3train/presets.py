"""Trainer presets: K3's tensor graph (k3gen Dims, real 163,840-id vocabulary) plus how to train.

``step_seconds`` is the measured seconds per optimizer step of the preset on the 2-core
development machine; ``--minutes M`` trains ``round(60·M / step_seconds)`` steps, so the result
depends only on (preset, minutes, seed, thread count), never on how busy the machine was.
"""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.presets import Dims


@dataclass(frozen=True)
class TrainPreset:
    dims: Dims
    sub_vocab: int          # trained rows: the sub_vocab-1 most frequent ids + one shared row
    batch: int
    seq: int
    capacity: float         # training-time expert capacity factor (the reference has none)
    lr: float
    step_seconds: float


# KKKMKKMM, AttnRes blocks of 4, 32 routed experts top-4 + one shared expert per MoE layer.
# KDA heads are 4 x 32 (K3: 96 x 128): the exact sequential delta-rule recurrence costs per
# state element and step, and 4 x 64 made it 3x slower (BENCHMARKS.md, "trained proxy").
K3_TRAIN = Dims(
    name="k3-train",
    hidden=256,
    layers=8,
    vocab=163840,
    kda_heads=4,
    kda_head_dim=32,
    conv=4,
    mla_heads=4,
    q_lora=128,
    kv_lora=64,
    nope=32,
    rope=16,
    v_head=32,
    experts=32,
    top_k=4,
    shared=1,
    latent=128,
    moe_inter=128,
    dense_inter=512,
    block=4,
    full_attn_layers=(4, 7, 8),
    shards=3,
    values="given",
)

PRESETS: dict[str, TrainPreset] = {
    "k3-train": TrainPreset(K3_TRAIN, sub_vocab=8192, batch=16, seq=128, capacity=1.5,
                           lr=3e-3, step_seconds=3.0),
}
DEFAULT = "k3-train"
