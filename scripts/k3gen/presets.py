"""Model dimensions of each checkpoint preset (SPEC.md §1, §7.2; docs/BENCHMARKS.md).

Layer lists are 1-based, exactly as in the released config: 0-based layer L is MLA iff
L + 1 is in `full_attn_layers`; every other layer is KDA.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Dims:
    """Everything the tensor graph and config.json depend on."""

    name: str
    hidden: int  # E
    layers: int  # num_hidden_layers
    vocab: int
    kda_heads: int  # linear_attn_config.num_heads
    kda_head_dim: int  # linear_attn_config.head_dim (d_k = d_v)
    conv: int  # short_conv_kernel_size
    mla_heads: int  # num_attention_heads
    q_lora: int
    kv_lora: int
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    v_head: int
    experts: int
    top_k: int
    shared: int  # num_shared_experts (fused into one MLP of width shared * moe_inter)
    latent: int  # routed_expert_hidden_size
    moe_inter: int  # moe_intermediate_size
    dense_inter: int  # intermediate_size (layer-0 dense MLP)
    block: int  # attn_res_block_size
    full_attn_layers: tuple[int, ...]  # 1-based MLA layers
    shards: int  # number of safetensors shards written
    values: str  # "exact" (per-tensor seeded normals), "fast" (pooled), "hole" (sparse, no data)
    vision: bool = False  # add synthetic vision_tower./mm_projector. tensors (skeleton only)

    @property
    def kda_proj(self) -> int:
        """P = KDA heads x head dim."""
        return self.kda_heads * self.kda_head_dim

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """1-based KDA layers: the complement of full_attn_layers."""
        full = set(self.full_attn_layers)
        return tuple(i for i in range(1, self.layers + 1) if i not in full)

    def is_mla(self, layer: int) -> bool:
        """0-based layer index -> MLA?"""
        return (layer + 1) in self.full_attn_layers

    def layer_map(self) -> str:
        return "".join("M" if self.is_mla(L) else "K" for L in range(self.layers))

    def validate(self) -> None:
        """MXFP4 needs every expert input width to be a multiple of 32 (E8M0 group size)."""
        problems = []
        for what, width in (("routed_expert_hidden_size", self.latent), ("moe_intermediate_size", self.moe_inter)):
            if width % 32:
                problems.append(f"{what}={width} is not a multiple of 32 (MXFP4 group)")
        if not all(1 <= i <= self.layers for i in self.full_attn_layers):
            problems.append("full_attn_layers out of 1..num_hidden_layers")
        if self.layers not in self.full_attn_layers:
            problems.append("the last layer must be MLA")
        if self.top_k > self.experts:
            problems.append("top_k > experts")
        if self.kda_head_dim < self.kda_heads:
            problems.append("A_log is stored as [head_dim]; head_dim must be >= num_heads")
        if self.shards < 2:
            problems.append("at least two shards")
        if problems:
            raise ValueError(f"preset {self.name}: " + "; ".join(problems))


# The real Kimi K3 text model (SPEC.md §1.1).
REAL = Dims(
    name="skeleton-full",
    hidden=7168,
    layers=93,
    vocab=163840,
    kda_heads=96,
    kda_head_dim=128,
    conv=4,
    mla_heads=96,
    q_lora=1536,
    kv_lora=512,
    nope=128,
    rope=64,
    v_head=128,
    experts=896,
    top_k=16,
    shared=2,
    latent=3584,
    moe_inter=3072,
    dense_inter=33792,
    block=12,
    full_attn_layers=tuple(range(4, 93, 4)) + (93,),
    shards=96,
    values="hole",
    vision=True,
)

PRESETS: dict[str, Dims] = {
    # SPEC.md §7.2: the kimi-k3-in-c tiny oracle dims, MXFP4-compatible widths. Layer map
    # KKKMKKKMKKKMM, AttnRes boundaries at 0,3,6,9,12.
    "tiny": Dims(
        name="tiny",
        hidden=128,
        layers=13,
        vocab=256,
        kda_heads=4,
        kda_head_dim=16,
        conv=4,
        mla_heads=4,
        q_lora=64,
        kv_lora=32,
        nope=24,
        rope=8,
        v_head=16,
        experts=8,
        top_k=2,
        shared=2,
        latent=64,
        moe_inter=64,
        dense_inter=96,
        block=3,
        full_attn_layers=(4, 8, 12, 13),
        shards=3,
        values="exact",
    ),
    # Quick benches; the real vocabulary so the real tokenizer can drive it. KKKMKKMM.
    "small": Dims(
        name="small",
        hidden=256,
        layers=8,
        vocab=163840,
        kda_heads=4,
        kda_head_dim=64,
        conv=4,
        mla_heads=4,
        q_lora=128,
        kv_lora=64,
        nope=32,
        rope=16,
        v_head=32,
        experts=32,
        top_k=4,
        shared=2,
        latent=128,
        moe_inter=256,
        dense_inter=512,
        block=4,
        full_attn_layers=(4, 7, 8),
        shards=3,
        values="exact",
    ),
    # Cache-policy traces: many experts per layer. KKKMKKKKMM.
    "medium": Dims(
        name="medium",
        hidden=1024,
        layers=10,
        vocab=163840,
        kda_heads=8,
        kda_head_dim=64,
        conv=4,
        mla_heads=8,
        q_lora=256,
        kv_lora=128,
        nope=64,
        rope=32,
        v_head=64,
        experts=256,
        top_k=8,
        shared=2,
        latent=512,
        moe_inter=2560,
        dense_inter=2048,
        block=4,
        full_attn_layers=(4, 9, 10),
        shards=4,
        values="fast",
    ),
    # Real layer dimensions, 5 layers KKKMM, 64 experts top-16.
    "k3slice": replace(
        REAL,
        name="k3slice",
        layers=5,
        experts=64,
        full_attn_layers=(4, 5),
        shards=4,
        values="fast",
        vision=False,
    ),
    "skeleton-full": REAL,
}
