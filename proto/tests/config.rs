//! Config reader tests (SPEC.md §1, §8 I1–I3).

use k3_proto::config::{ConfigError, ConfigShape, LayerKind, ModelConfig};
use serde_json::{json, Value};

const RELEASED: &str = include_str!("data/released_config.json");
const TINY_FLAT: &str = include_str!("data/tiny_flat_config.json");
const TINY_NESTED: &str = include_str!("data/tiny_nested_config.json");

fn parse(v: &Value) -> Result<ModelConfig, ConfigError> {
    ModelConfig::from_json_str(&v.to_string())
}

fn released() -> Value {
    serde_json::from_str(RELEASED).unwrap()
}

fn flat() -> Value {
    serde_json::from_str(TINY_FLAT).unwrap()
}

/// Removes `key` from the root, `text_config` and `linear_attn_config` (wherever it is).
fn remove_everywhere(v: &mut Value, key: &str) {
    v.as_object_mut().unwrap().remove(key);
    if let Some(t) = v.get_mut("text_config") {
        t.as_object_mut().unwrap().remove(key);
        if let Some(l) = t.get_mut("linear_attn_config") {
            l.as_object_mut().unwrap().remove(key);
        }
    }
}

fn text(v: &mut Value) -> &mut serde_json::Map<String, Value> {
    v["text_config"].as_object_mut().unwrap()
}

fn linear(v: &mut Value) -> &mut serde_json::Map<String, Value> {
    v["text_config"]["linear_attn_config"]
        .as_object_mut()
        .unwrap()
}

fn problems(r: Result<ModelConfig, ConfigError>) -> Vec<String> {
    match r {
        Ok(c) => panic!("config accepted: {c:?}"),
        Err(e) => e.problems,
    }
}

fn mentions(problems: &[String], what: &str) -> bool {
    problems.iter().any(|p| p.contains(what))
}

#[test]
fn released_config_reads_every_value() {
    let c = ModelConfig::from_json_str(RELEASED).unwrap();
    assert_eq!(c.shape, ConfigShape::Nested);
    assert_eq!(c.hidden_size, 7168);
    assert_eq!(c.num_hidden_layers, 93);
    assert_eq!(c.vocab_size, 163840);
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert_eq!(c.mla_norm_eps, 1e-6);
    assert_eq!((c.situ_beta, c.situ_linear_beta), (4.0, 25.0));
    assert_eq!(c.intermediate_size, 33792);
    assert_eq!(c.first_k_dense_replace, 1);
    assert_eq!(
        (c.num_experts, c.num_experts_per_token, c.num_shared_experts),
        (896, 16, 2)
    );
    assert_eq!(
        (c.moe_intermediate_size, c.routed_expert_hidden_size),
        (3072, 3584)
    );
    assert!(c.latent_moe_use_norm && c.moe_renormalize && c.mla_use_output_gate);
    assert_eq!(c.routed_scaling_factor, 1.0);
    assert_eq!(
        (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank),
        (96, 1536, 512)
    );
    assert_eq!(
        (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim),
        (128, 64, 128)
    );
    assert_eq!((c.kda_num_heads, c.kda_head_dim), (96, 128));
    assert_eq!(c.short_conv_kernel_size, 4);
    assert_eq!(c.gate_lower_bound, -5.0);
    assert_eq!(c.attn_res_block_size, 12);
    assert!(!c.tie_word_embeddings);
    assert_eq!(c.bos_token_id, Some(163584));
    assert_eq!(c.eos_token_ids, vec![163586]);
    assert_eq!(c.pad_token_id, Some(163839));
    assert_eq!(c.expert_layout().expert_bytes(), 17_547_264);
}

#[test]
fn released_layer_map_is_69_kda_24_mla_with_final_double_mla() {
    let c = ModelConfig::from_json_str(RELEASED).unwrap();
    let map = c.layer_map();
    assert_eq!(map.len(), 93);
    assert_eq!(map.matches('K').count(), 69);
    assert_eq!(map.matches('M').count(), 24);
    assert_eq!((c.n_kda(), c.n_mla()), (69, 24));
    let expected: String = (0..93)
        .map(|l| {
            if (l + 1) % 4 == 0 || l == 92 {
                'M'
            } else {
                'K'
            }
        })
        .collect();
    assert_eq!(map, expected);
    assert!(map.starts_with("KKKMKKKM"));
    assert!(map.ends_with("KKKMM"));
    assert_eq!(c.layer_kind(0), LayerKind::Kda);
    assert_eq!(c.layer_kind(3), LayerKind::Mla);
    assert_eq!(c.layer_kind(90), LayerKind::Kda);
    assert_eq!(c.layer_kind(91), LayerKind::Mla);
    assert_eq!(c.layer_kind(92), LayerKind::Mla);
    assert!(!c.is_moe(0));
    assert!(c.is_moe(1) && c.is_moe(92));
    assert_eq!(c.n_moe(), 92);
    assert_eq!(c.kda_layers.len(), 69);
    assert_eq!(c.full_attn_layers.len(), 24);
}

#[test]
fn tiny_flat_and_nested_give_the_same_config() {
    let f = ModelConfig::from_json_str(TINY_FLAT).unwrap();
    let n = ModelConfig::from_json_str(TINY_NESTED).unwrap();
    assert_eq!(f.shape, ConfigShape::Flat);
    assert_eq!(n.shape, ConfigShape::Nested);
    assert_eq!(f.layer_map(), "KKKMKKKMKKKMM");
    assert_eq!(n.layer_map(), "KKKMKKKMKKKMM");
    // kda_layers derived as the complement in the flat shape.
    assert_eq!(f.kda_layers, vec![1, 2, 3, 5, 6, 7, 9, 10, 11]);
    assert_eq!((f.kda_num_heads, f.kda_head_dim), (4, 16));
    assert_eq!((f.situ_beta, f.situ_linear_beta), (4.0, 25.0));
    let mut n2 = n.clone();
    n2.shape = ConfigShape::Flat;
    assert_eq!(f, n2);
}

#[test]
fn flat_shape_of_the_released_dims_equals_the_nested_reading() {
    // Hoist the released text_config into the flat shape by hand.
    let v = released();
    let mut t = v["text_config"].as_object().unwrap().clone();
    let l = t.remove("linear_attn_config").unwrap();
    t.remove("activation_situ_beta");
    t.remove("activation_situ_linear_beta");
    t.insert("situ_beta".into(), json!(4.0));
    t.insert("situ_linear_beta".into(), json!(25.0));
    t.insert("kda_num_heads".into(), l["num_heads"].clone());
    t.insert("kda_head_dim".into(), l["head_dim"].clone());
    for k in [
        "short_conv_kernel_size",
        "gate_lower_bound",
        "full_attn_layers",
    ] {
        t.insert(k.into(), l[k].clone());
    }
    let flat = ModelConfig::from_json_str(&Value::Object(t).to_string()).unwrap();
    let mut nested = parse(&v).unwrap();
    assert_eq!(flat.shape, ConfigShape::Flat);
    nested.shape = ConfigShape::Flat;
    assert_eq!(flat, nested);
}

#[test]
fn decoy_text_config_head_dim_and_num_heads_are_ignored() {
    let mut v = released();
    text(&mut v).insert("head_dim".into(), json!(74));
    text(&mut v).insert("num_heads".into(), json!(7));
    v.as_object_mut()
        .unwrap()
        .insert("head_dim".into(), json!(75));
    let c = parse(&v).unwrap();
    assert_eq!(c.kda_head_dim, 128);
    assert_eq!(c.kda_num_heads, 96);
}

#[test]
fn decoy_head_dim_does_not_fill_a_missing_kda_head_dim() {
    let mut v = released();
    text(&mut v).insert("head_dim".into(), json!(74));
    linear(&mut v).remove("head_dim");
    let p = problems(parse(&v));
    assert!(mentions(&p, "linear_attn_config.head_dim"), "{p:?}");
}

/// Required fields of the nested shape (removing any one must be rejected).
const NESTED_REQUIRED: &[&str] = &[
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "rms_norm_eps",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "intermediate_size",
    "first_k_dense_replace",
    "num_experts",
    "num_experts_per_token",
    "num_shared_experts",
    "moe_intermediate_size",
    "routed_expert_hidden_size",
    "routed_scaling_factor",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_heads",
    "head_dim",
    "short_conv_kernel_size",
    "gate_lower_bound",
    "full_attn_layers",
    "attn_res_block_size",
    "tie_word_embeddings",
];

#[test]
fn removing_each_required_nested_field_is_rejected_by_name() {
    for key in NESTED_REQUIRED {
        let mut v = released();
        remove_everywhere(&mut v, key);
        let p = problems(parse(&v));
        assert!(
            mentions(&p, &format!("{key}`")),
            "removing `{key}`: problems {p:?} do not name it"
        );
        assert!(mentions(&p, "missing required field"), "{key}: {p:?}");
    }
}

#[test]
fn removing_each_required_flat_field_is_rejected_by_name() {
    let keys: Vec<String> = flat()
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| {
            !matches!(
                k.as_str(),
                "mla_use_output_gate" | "moe_renormalize" | "latent_moe_use_norm"
            )
        })
        .cloned()
        .collect();
    assert_eq!(keys.len(), 27);
    for key in &keys {
        let mut v = flat();
        v.as_object_mut().unwrap().remove(key);
        let p = problems(parse(&v));
        assert!(
            mentions(&p, &format!("`{key}`")),
            "removing `{key}`: problems {p:?} do not name it"
        );
    }
}

#[test]
fn two_removed_fields_are_both_listed() {
    let mut v = released();
    remove_everywhere(&mut v, "activation_situ_beta");
    remove_everywhere(&mut v, "full_attn_layers");
    let e = parse(&v).unwrap_err();
    assert!(mentions(&e.problems, "activation_situ_beta"), "{e}");
    assert!(mentions(&e.problems, "full_attn_layers"), "{e}");
    let shown = e.to_string();
    assert!(shown.contains("activation_situ_beta") && shown.contains("full_attn_layers"));
}

#[test]
fn optional_booleans_default_to_true() {
    let mut v = released();
    for k in [
        "mla_use_output_gate",
        "moe_renormalize",
        "latent_moe_use_norm",
    ] {
        remove_everywhere(&mut v, k);
    }
    let c = parse(&v).unwrap();
    assert!(c.mla_use_output_gate && c.moe_renormalize && c.latent_moe_use_norm);
    let mut v = released();
    text(&mut v).insert("moe_renormalize".into(), json!(false));
    assert!(!parse(&v).unwrap().moe_renormalize);
}

#[test]
fn kda_layers_may_be_absent_in_nested_shape() {
    let mut v = released();
    linear(&mut v).remove("kda_layers");
    let c = parse(&v).unwrap();
    assert_eq!(c.kda_layers.len(), 69);
    assert_eq!(c.kda_layers[..4], [1, 2, 3, 5]);
}

#[test]
fn wrong_types_are_rejected() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("hidden_size", json!("7168"), "hidden_size"),
        ("hidden_size", json!(7168.5), "hidden_size"),
        ("hidden_size", json!(-1), "hidden_size"),
        ("rms_norm_eps", json!("1e-5"), "rms_norm_eps"),
        ("activation_situ_beta", json!(true), "activation_situ_beta"),
        ("mla_use_output_gate", json!("yes"), "mla_use_output_gate"),
        ("tie_word_embeddings", json!(0), "tie_word_embeddings"),
        ("eos_token_id", json!(["x"]), "eos_token_id"),
        ("bos_token_id", json!(-5), "bos_token_id"),
    ];
    for (key, val, name) in cases {
        let mut v = released();
        text(&mut v).insert(key.into(), val.clone());
        let p = problems(parse(&v));
        assert!(mentions(&p, name), "{key}={val}: {p:?}");
    }
    let lists: Vec<(&str, Value)> = vec![
        ("full_attn_layers", json!("4,8")),
        ("full_attn_layers", json!([4, "8"])),
        ("kda_layers", json!([1, 2.5])),
        ("num_heads", json!("96")),
    ];
    for (key, val) in lists {
        let mut v = released();
        linear(&mut v).insert(key.into(), val.clone());
        let p = problems(parse(&v));
        assert!(mentions(&p, key), "{key}={val}: {p:?}");
    }
}

#[test]
fn eos_may_be_an_int_or_a_list() {
    let mut v = released();
    text(&mut v).insert("eos_token_id".into(), json!([163586, 163585]));
    assert_eq!(parse(&v).unwrap().eos_token_ids, vec![163586, 163585]);
}

#[test]
fn zero_based_looking_lists_are_rejected() {
    let mut v = released();
    let zero_based: Vec<u64> = (0..93).filter(|l| (l + 1) % 4 == 0 || *l == 92).collect();
    // [3,7,...,91,92] is not zero-containing; add 0 to make it look 0-based.
    let mut full = vec![0u64];
    full.extend(zero_based);
    linear(&mut v).insert("full_attn_layers".into(), json!(full));
    linear(&mut v).remove("kda_layers");
    let p = problems(parse(&v));
    assert!(mentions(&p, "1-based"), "{p:?}");

    let mut v = flat();
    v["full_attn_layers"] = json!([0, 3, 7, 11, 12]);
    let p = problems(parse(&v));
    assert!(mentions(&p, "full_attn_layers` contains 0"), "{p:?}");

    let mut v = released();
    let kda: Vec<u64> = (0..69).collect();
    linear(&mut v).insert("kda_layers".into(), json!(kda));
    let p = problems(parse(&v));
    assert!(mentions(&p, "kda_layers` contains 0"), "{p:?}");
}

#[test]
fn structural_checks() {
    let expect = |edit: &dyn Fn(&mut Value), what: &str| {
        let mut v = released();
        edit(&mut v);
        let p = problems(parse(&v));
        assert!(mentions(&p, what), "expected `{what}` in {p:?}");
    };
    expect(
        &|v| {
            linear(v).insert("full_attn_layers".into(), json!([4, 94]));
            linear(v).remove("kda_layers");
        },
        "outside 1..=93",
    );
    expect(
        &|v| {
            linear(v).insert("full_attn_layers".into(), json!([4, 4, 93]));
            linear(v).remove("kda_layers");
        },
        "twice",
    );
    expect(
        &|v| {
            linear(v).insert("kda_layers".into(), json!([1, 2, 3, 4]));
        },
        "in both",
    );
    expect(
        &|v| {
            linear(v).insert("kda_layers".into(), json!([1, 2, 3]));
        },
        "missing (1-based)",
    );
    expect(
        &|v| {
            let all: Vec<u64> = (1..=93).collect();
            linear(v).insert("full_attn_layers".into(), json!(all));
            linear(v).remove("kda_layers");
        },
        "no KDA layer",
    );
    expect(
        &|v| {
            text(v).insert("num_experts_per_token".into(), json!(897));
        },
        "exceeds `num_experts`",
    );
    expect(
        &|v| {
            text(v).insert("attn_res_block_size".into(), json!(0));
        },
        "attn_res_block_size` must be at least 1",
    );
    expect(
        &|v| {
            linear(v).insert("short_conv_kernel_size".into(), json!(0));
        },
        "short_conv_kernel_size` must be at least 1",
    );
    expect(
        &|v| {
            text(v).insert("mla_use_nope".into(), json!(false));
        },
        "mla_use_nope",
    );
    expect(
        &|v| {
            text(v).insert("routed_expert_hidden_size".into(), json!(3580));
        },
        "routed_expert_hidden_size` = 3580 is not a multiple of 32",
    );
    expect(
        &|v| {
            text(v).insert("moe_intermediate_size".into(), json!(48));
        },
        "moe_intermediate_size` = 48 is not a multiple of 32",
    );
    expect(
        &|v| {
            text(v).insert("first_k_dense_replace".into(), json!(94));
        },
        "first_k_dense_replace",
    );
    expect(
        &|v| {
            text(v).insert("hidden_act".into(), json!("silu"));
        },
        "hidden_act",
    );
    expect(
        &|v| {
            text(v).insert("num_expert_group".into(), json!(8));
        },
        "num_expert_group",
    );
    expect(
        &|v| {
            linear(v).insert("use_full_rank_gate".into(), json!(false));
        },
        "use_full_rank_gate",
    );
    expect(
        &|v| {
            text(v).insert("num_hidden_layers".into(), json!(0));
        },
        "num_hidden_layers",
    );
    expect(
        &|v| {
            text(v).insert("hidden_size".into(), json!(1u64 << 40));
        },
        "larger than any plausible size",
    );
}

#[test]
fn the_c_oracle_config_with_48_wide_experts_is_rejected_for_mxfp4() {
    let mut v = flat();
    v["moe_intermediate_size"] = json!(48);
    let p = problems(parse(&v));
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(p[0].contains("multiple of 32"));
}

#[test]
fn malformed_json_and_non_object_are_errors() {
    assert!(ModelConfig::from_json_str("{").is_err());
    assert!(ModelConfig::from_json_str("[]").is_err());
    assert!(ModelConfig::from_json_str(r#"{"text_config": 5}"#).is_err());
    let e = ModelConfig::from_json_str("{}").unwrap_err();
    // An empty flat config lists every required field at once.
    assert_eq!(e.problems.len(), 27, "{e}");
}

#[test]
fn explicit_null_counts_as_missing() {
    let mut v = released();
    text(&mut v).insert("activation_situ_beta".into(), Value::Null);
    let p = problems(parse(&v));
    assert!(mentions(&p, "activation_situ_beta"));
}

#[test]
fn with_layers_truncates_the_map() {
    let c = ModelConfig::from_json_str(TINY_NESTED).unwrap();
    let t = c.with_layers(5);
    assert_eq!(t.num_hidden_layers, 5);
    assert_eq!(t.layer_map(), "KKKMK");
    assert_eq!(t.full_attn_layers, vec![4]);
    assert_eq!(t.kda_layers, vec![1, 2, 3, 5]);
    assert_eq!(c.with_layers(100).layer_map(), c.layer_map());
}

#[test]
fn load_reads_a_file_and_names_a_missing_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let p = dir.join("config.json");
    std::fs::write(&p, RELEASED).unwrap();
    assert_eq!(ModelConfig::load(&p).unwrap().num_hidden_layers, 93);
    let missing = dir.join("nope.json");
    let e = ModelConfig::load(&missing).unwrap_err();
    assert!(e.to_string().contains("nope.json"), "{e}");
}

#[test]
fn special_ids_outside_a_small_vocab_are_accepted() {
    // A tiny test model keeps the real tokenizer's special ids (163584+) with a 256-token vocab.
    let s = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/tiny_nested_config.json"
    ))
    .unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&s).unwrap();
    v["eos_token_id"] = serde_json::json!(163586);
    v["bos_token_id"] = serde_json::json!(163584);
    let cfg = k3_proto::config::ModelConfig::from_json_str(&v.to_string()).unwrap();
    assert_eq!(cfg.vocab_size, 256);
    assert!(cfg.eos_token_ids.contains(&163586));
}

#[test]
fn conflicting_alias_spellings_are_rejected() {
    let mut v = released();
    text(&mut v).insert("situ_beta".into(), json!(5.0));
    let p = problems(parse(&v));
    assert!(mentions(&p, "conflicts with"), "{p:?}");
    assert!(mentions(&p, "activation_situ_beta") && mentions(&p, "situ_beta"));
    // Same value under both names is fine.
    let mut v = released();
    text(&mut v).insert("situ_beta".into(), json!(4));
    text(&mut v).insert("kda_head_dim".into(), json!(128));
    assert_eq!(parse(&v).unwrap().situ_beta, 4.0);
    let mut v = released();
    text(&mut v).insert("kda_num_heads".into(), json!(64));
    let p = problems(parse(&v));
    assert!(
        mentions(&p, "linear_attn_config.num_heads` = 96 conflicts"),
        "{p:?}"
    );
}
