//! Tensor names and classification (SPEC.md §2).

use k3_proto::expert::ExpertPart;
use k3_proto::names::{self, classify, TensorClass};

#[test]
fn constructors_spell_the_checkpoint_names() {
    assert_eq!(
        names::layer_tensor(7, "self_attn.q_a_proj.weight"),
        "language_model.model.layers.7.self_attn.q_a_proj.weight"
    );
    assert_eq!(
        names::expert_tensor(92, 895, ExpertPart::W2Scale),
        "language_model.model.layers.92.block_sparse_moe.experts.895.w2.weight_scale"
    );
    assert_eq!(
        names::expert_tensor(1, 0, ExpertPart::W1Packed),
        "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    );
    assert_eq!(names::EMBED, "language_model.model.embed_tokens.weight");
    assert_eq!(names::LM_HEAD, "language_model.lm_head.weight");
}

#[test]
fn legacy_prefix_is_canonicalised() {
    let legacy = "language_model.layers.5.self_attn.q_proj.weight";
    assert_eq!(
        names::canonical(legacy),
        "language_model.model.layers.5.self_attn.q_proj.weight"
    );
    let canon = "language_model.model.layers.5.self_attn.q_proj.weight";
    assert!(matches!(
        names::canonical(canon),
        std::borrow::Cow::Borrowed(_)
    ));
    assert_eq!(names::canonical(names::LM_HEAD), names::LM_HEAD);
    assert_eq!(classify(legacy), TensorClass::Trunk { layer: 5 });
    assert_eq!(
        classify("language_model.layers.3.block_sparse_moe.experts.2.w3.weight_scale"),
        TensorClass::Expert {
            layer: 3,
            expert: 2,
            part: ExpertPart::W3Scale
        }
    );
}

#[test]
fn model_level_tensors() {
    for n in names::MODEL_TENSORS {
        assert_eq!(classify(n), TensorClass::Model, "{n}");
    }
    assert_eq!(
        classify("language_model.model.embed_tokens.weight.extra"),
        TensorClass::Other
    );
}

#[test]
fn every_expert_part_round_trips() {
    for part in ExpertPart::ALL {
        let n = names::expert_tensor(17, 301, part);
        assert_eq!(
            classify(&n),
            TensorClass::Expert {
                layer: 17,
                expert: 301,
                part
            },
            "{n}"
        );
    }
}

#[test]
fn trunk_tensors_including_dense_mlp_and_shared_experts() {
    for (name, layer) in [
        ("language_model.model.layers.0.mlp.gate_proj.weight", 0),
        ("language_model.model.layers.0.mlp.down_proj.weight", 0),
        (
            "language_model.model.layers.0.self_attention_res_proj.weight",
            0,
        ),
        (
            "language_model.model.layers.4.block_sparse_moe.shared_experts.up_proj.weight",
            4,
        ),
        (
            "language_model.model.layers.4.block_sparse_moe.gate.e_score_correction_bias",
            4,
        ),
        (
            "language_model.model.layers.92.block_sparse_moe.routed_expert_norm.weight",
            92,
        ),
        (
            "language_model.model.layers.91.self_attn.kv_b_proj.weight",
            91,
        ),
        ("language_model.model.layers.1.self_attn.A_log", 1),
        // Not an MXFP4 part (bf16 experts of another release): trunk, not an expert.
        (
            "language_model.model.layers.2.block_sparse_moe.experts.0.w1.weight",
            2,
        ),
    ] {
        assert_eq!(classify(name), TensorClass::Trunk { layer }, "{name}");
    }
}

#[test]
fn vision_and_unknown_tensors_are_other() {
    for n in [
        "vision_tower.encoder.blocks.0.attn.qkv.weight",
        "vision_tower.patch_embed.proj.weight",
        "mm_projector.proj.0.weight",
        "language_model.model.rotary_emb.inv_freq",
        "language_model.model.layers.x.mlp.gate_proj.weight",
        "language_model.model.layers.01.mlp.gate_proj.weight",
        "language_model.model.layers.3",
        "language_model.model.layers.3.",
        "model.layers.3.mlp.gate_proj.weight",
        "",
    ] {
        assert_eq!(classify(n), TensorClass::Other, "{n}");
    }
}

#[test]
fn malformed_expert_indices_stay_in_the_trunk_of_their_layer() {
    assert_eq!(
        classify("language_model.model.layers.6.block_sparse_moe.experts.07.w1.weight_packed"),
        TensorClass::Trunk { layer: 6 }
    );
    assert_eq!(
        classify("language_model.model.layers.6.block_sparse_moe.experts.7.w4.weight_packed"),
        TensorClass::Trunk { layer: 6 }
    );
}
