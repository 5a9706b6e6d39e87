"""config.json writers: the released nested shape (SPEC.md §1.1) and the flat shape of the
kimi-k3-in-c fixtures (§1.3)."""
from __future__ import annotations

import json

from .presets import Dims

BOS, EOS, PAD, MEDIA = 163584, 163586, 163839, 163605


def _quantization_config() -> dict:
    """compressed-tensors MXFP4 block, as in the release (routed experts only, §10 C9)."""
    return {
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": 32,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "scale_dtype": "torch.uint8",
                    "strategy": "group",
                    "symmetric": True,
                    "type": "float",
                    "zp_dtype": None,
                },
            }
        },
        "format": "mxfp4-pack-quantized",
        "global_compression_ratio": None,
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def nested_config(d: Dims, decoy_head_dim: bool = False) -> dict:
    """Root (model_type kimi_k3) with text_config (kimi_linear) and 1-based layer lists."""
    text = {
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "architectures": ["KimiLinearForCausalLM"],
        "attn_res_block_size": d.block,
        "bos_token_id": BOS,
        "dtype": "bfloat16",
        "eos_token_id": EOS,
        "first_k_dense_replace": 1,
        "hidden_act": "situ",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.dense_inter,
        "kv_lora_rank": d.kv_lora,
        "latent_moe_use_norm": True,
        "linear_attn_config": {
            "full_attn_layers": list(d.full_attn_layers),
            "gate_lower_bound": -5.0,
            "head_dim": d.kda_head_dim,
            "kda_layers": list(d.kda_layers),
            "num_heads": d.kda_heads,
            "short_conv_kernel_size": d.conv,
            "use_full_rank_gate": True,
        },
        "max_position_embeddings": 1048576,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "model_type": "kimi_linear",
        "moe_intermediate_size": d.moe_inter,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": d.mla_heads,
        "num_expert_group": 1,
        "num_experts": d.experts,
        "num_experts_per_token": d.top_k,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.mla_heads,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": d.shared,
        "pad_token_id": PAD,
        "q_lora_rank": d.q_lora,
        "qk_nope_head_dim": d.nope,
        "qk_rope_head_dim": d.rope,
        "quantization_config": _quantization_config(),
        "rms_norm_eps": 1e-05,
        "routed_expert_hidden_size": d.latent,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_cache": True,
        "use_grouped_topk": True,
        "v_head_dim": d.v_head,
        "vocab_size": d.vocab,
    }
    if decoy_head_dim:
        # What a re-saved KimiLinearConfig carries (SPEC.md §8 I2); a correct reader ignores it.
        text["head_dim"] = d.hidden // d.mla_heads
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "bos_token_id": BOS,
        "dtype": "bfloat16",
        "eos_token_id": EOS,
        "media_placeholder_token_id": MEDIA,
        "model_type": "kimi_k3",
        "pad_token_id": PAD,
        "text_config": text,
        "tie_word_embeddings": False,
        "vision_config": {
            "activation_func": "gelu_pytorch_tanh",
            "merge_kernel_size": [2, 2],
            "mm_hidden_size": 1024,
            "mm_projector_type": "patchmergerv2",
            "norm_type": "rmsnorm",
            "patch_size": 14,
            "text_hidden_size": d.hidden,
            "vt_hidden_size": 1024,
            "vt_intermediate_size": 4096,
            "vt_num_attention_heads": 12,
            "vt_num_hidden_layers": 27,
        },
    }


def flat_config(d: Dims, decoy_head_dim: bool = False) -> dict:
    """Every key at the root, KDA/SiTU under their flat names, no kda_layers (§1.3)."""
    cfg = {
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "vocab_size": d.vocab,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "kda_num_heads": d.kda_heads,
        "kda_head_dim": d.kda_head_dim,
        "short_conv_kernel_size": d.conv,
        "gate_lower_bound": -5.0,
        "num_attention_heads": d.mla_heads,
        "q_lora_rank": d.q_lora,
        "kv_lora_rank": d.kv_lora,
        "qk_nope_head_dim": d.nope,
        "qk_rope_head_dim": d.rope,
        "v_head_dim": d.v_head,
        "mla_use_output_gate": True,
        "num_experts": d.experts,
        "num_experts_per_token": d.top_k,
        "num_shared_experts": d.shared,
        "routed_expert_hidden_size": d.latent,
        "moe_intermediate_size": d.moe_inter,
        "routed_scaling_factor": 1.0,
        "moe_renormalize": True,
        "latent_moe_use_norm": True,
        "first_k_dense_replace": 1,
        "intermediate_size": d.dense_inter,
        "attn_res_block_size": d.block,
        "situ_beta": 4.0,
        "situ_linear_beta": 25.0,
        "full_attn_layers": list(d.full_attn_layers),
    }
    if decoy_head_dim:
        cfg["head_dim"] = d.hidden // d.mla_heads
    return cfg


def config_text(d: Dims, shape: str, decoy_head_dim: bool) -> str:
    if shape == "nested":
        cfg = nested_config(d, decoy_head_dim)
        # Nested config: sorted keys, 2-space indent, like a transformers save_pretrained.
        return json.dumps(cfg, indent=2, sort_keys=True) + "\n"
    if shape == "flat":
        return json.dumps(flat_config(d, decoy_head_dim), indent=2) + "\n"
    raise ValueError(f"unknown config shape {shape!r} (nested|flat)")
