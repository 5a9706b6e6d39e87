//! Synthetic checkpoints for k3-store tests: real tensor names, real safetensors shards with the
//! real shard naming scheme and a `model.safetensors.index.json`, and byte contents that encode
//! where they came from so any aliasing is visible.
//!
//! Shared by unit tests (`#[path]`-included from the library) and integration tests.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k3_proto::expert::{ExpertLayout, ExpertPart};
use k3_proto::Dtype;

use k3_store::runtime::catalog::{Catalog, PartExtent, TensorExtent};

/// Shape of a synthetic checkpoint.
#[derive(Clone, Debug)]
pub struct Spec {
    pub n_layers: usize,
    pub n_experts: usize,
    pub hidden: usize,
    pub vocab: usize,
    pub layout: ExpertLayout,
    /// Number of shard files; layers are spread over them in order.
    pub n_shards: usize,
    /// Experts whose six parts are written in reverse order (contiguous, not canonical).
    pub reversed_experts: Vec<(usize, usize)>,
    /// Layers whose trunk tensors are interleaved with an expert tensor (not contiguous).
    pub scattered_layers: Vec<usize>,
}

impl Spec {
    pub fn small(n_layers: usize, n_experts: usize) -> Spec {
        Spec {
            n_layers,
            n_experts,
            hidden: 64,
            vocab: 96,
            layout: ExpertLayout {
                inter: 64,
                latent: 64,
            },
            n_shards: 2,
            reversed_experts: vec![],
            scattered_layers: vec![],
        }
    }
}

/// A deterministic byte of expert (l, e) at slot position i (canonical layout).
pub fn expert_byte(l: usize, e: usize, i: usize) -> u8 {
    let x = (l as u64).wrapping_mul(0x9E37_79B9)
        ^ (e as u64).wrapping_mul(0x85EB_CA6B)
        ^ (i as u64).wrapping_mul(0xC2B2_AE35);
    (x ^ (x >> 13) ^ (x >> 29)) as u8
}

/// The canonical bytes of expert (l, e).
pub fn expert_bytes(spec: &Spec, l: usize, e: usize) -> Vec<u8> {
    (0..spec.layout.expert_bytes())
        .map(|i| expert_byte(l, e, i))
        .collect()
}

/// A deterministic byte of tensor `name` at position i.
pub fn tensor_byte(name: &str, i: usize) -> u8 {
    let mut h: u32 = 2166136261;
    for b in name.bytes() {
        h = (h ^ b as u32).wrapping_mul(16777619);
    }
    let x = h.wrapping_add((i as u32).wrapping_mul(0x9E37_79B9));
    (x ^ (x >> 15) ^ (x >> 7)) as u8
}

pub fn tensor_bytes(name: &str, n: usize) -> Vec<u8> {
    (0..n).map(|i| tensor_byte(name, i)).collect()
}

pub fn layer_name(l: usize, suffix: &str) -> String {
    format!("language_model.model.layers.{l}.{suffix}")
}

pub fn expert_name(l: usize, e: usize, p: ExpertPart) -> String {
    format!(
        "language_model.model.layers.{l}.block_sparse_moe.experts.{e}.{}",
        p.suffix()
    )
}

/// Trunk tensors of layer l: (suffix, dtype, shape). Layer sizes differ (layer 0 is the largest,
/// like the real model's dense layer 0), so the ring must hold the largest unpinned layer.
pub fn trunk_tensors(spec: &Spec, l: usize) -> Vec<(String, Dtype, Vec<usize>)> {
    let h = spec.hidden;
    let mut v = vec![
        ("input_layernorm.weight".to_string(), Dtype::BF16, vec![h]),
        (
            "post_attention_layernorm.weight".to_string(),
            Dtype::BF16,
            vec![h],
        ),
        (
            "self_attn.q_proj.weight".to_string(),
            Dtype::BF16,
            vec![h, h],
        ),
        ("self_attn.A_log".to_string(), Dtype::F32, vec![16]),
        (
            "self_attn.o_proj.weight".to_string(),
            Dtype::BF16,
            vec![h, h + 8 * (l % 3)],
        ),
    ];
    if l == 0 {
        v.push((
            "mlp.gate_proj.weight".to_string(),
            Dtype::BF16,
            vec![3 * h, h],
        ));
    } else {
        v.push((
            "block_sparse_moe.gate.weight".to_string(),
            Dtype::BF16,
            vec![spec.n_experts, h],
        ));
        v.push((
            "block_sparse_moe.gate.e_score_correction_bias".to_string(),
            Dtype::F32,
            vec![spec.n_experts],
        ));
    }
    v.into_iter()
        .map(|(s, d, sh)| (layer_name(l, &s), d, sh))
        .collect()
}

pub fn model_tensors(spec: &Spec) -> Vec<(String, Dtype, Vec<usize>)> {
    let (h, v) = (spec.hidden, spec.vocab);
    vec![
        (
            "language_model.model.embed_tokens.weight".into(),
            Dtype::BF16,
            vec![v, h],
        ),
        (
            "language_model.model.norm.weight".into(),
            Dtype::BF16,
            vec![h],
        ),
        (
            "language_model.model.output_attn_res_norm.weight".into(),
            Dtype::BF16,
            vec![h],
        ),
        (
            "language_model.model.output_attn_res_proj.weight".into(),
            Dtype::BF16,
            vec![1, h],
        ),
        (
            "language_model.lm_head.weight".into(),
            Dtype::BF16,
            vec![v, h],
        ),
    ]
}

struct Entry {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
    class: Class,
}

#[derive(Clone, Copy)]
enum Class {
    Model,
    Trunk(usize),
    Expert(usize, usize, ExpertPart),
}

/// A written checkpoint. One from [`write`] owns its temporary directory: dropping it removes
/// the directory (also when a test panics).
pub struct Written {
    pub dir: PathBuf,
    pub catalog: Catalog,
    pub spec: Spec,
    _tmp: Option<tempfile::TempDir>,
}

fn write_shard(path: &Path, entries: &[Entry]) -> Vec<u64> {
    let mut header = serde_json::Map::new();
    let mut pos = 0usize;
    for e in entries {
        header.insert(
            e.name.clone(),
            serde_json::json!({"dtype": e.dtype.name(), "shape": e.shape, "data_offsets": [pos, pos + e.data.len()]}),
        );
        pos += e.data.len();
    }
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let base = 8 + h.len() as u64;
    let mut out = Vec::with_capacity(base as usize + pos);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    let mut offs = Vec::new();
    for e in entries {
        offs.push(base + (out.len() as u64 - base));
        out.extend_from_slice(&e.data);
    }
    std::fs::write(path, out).unwrap();
    offs
}

/// Write the checkpoint described by `spec` into a fresh temp dir.
pub fn write(spec: &Spec, tag: &str) -> Written {
    let tmp = tempfile::Builder::new()
        .prefix(&format!("k3store-{tag}-"))
        .tempdir()
        .unwrap();
    let mut w = write_into(spec, tmp.path());
    w._tmp = Some(tmp);
    w
}

pub fn write_into(spec: &Spec, dir: &Path) -> Written {
    let mk = |name: String, dtype: Dtype, shape: Vec<usize>, class: Class| {
        let n = shape.iter().product::<usize>() * dtype.size();
        Entry {
            data: tensor_bytes(&name, n),
            name,
            dtype,
            shape,
            class,
        }
    };
    let mut shards: Vec<Vec<Entry>> = (0..spec.n_shards).map(|_| Vec::new()).collect();
    let mt = model_tensors(spec);
    // Embedding first in shard 0; the rest of the model-level tensors in the last shard.
    let mut mt_iter = mt.into_iter();
    let (n, d, s) = mt_iter.next().unwrap();
    shards[0].push(mk(n, d, s, Class::Model));
    for l in 0..spec.n_layers {
        let sh = l * spec.n_shards / spec.n_layers.max(1);
        let mut exps: Vec<Entry> = Vec::new();
        if l >= 1 {
            for e in 0..spec.n_experts {
                let bytes = expert_bytes(spec, l, e);
                let mut parts: Vec<Entry> = ExpertPart::ALL
                    .iter()
                    .map(|&p| {
                        let off = spec.layout.part_offset(p);
                        let len = spec.layout.part_bytes(p);
                        let sh = spec.layout.stored_shape(p);
                        Entry {
                            name: expert_name(l, e, p),
                            dtype: Dtype::U8,
                            shape: sh.to_vec(),
                            data: bytes[off..off + len].to_vec(),
                            class: Class::Expert(l, e, p),
                        }
                    })
                    .collect();
                if spec.reversed_experts.contains(&(l, e)) {
                    parts.reverse();
                }
                exps.extend(parts);
            }
        }
        let trunk: Vec<Entry> = trunk_tensors(spec, l)
            .into_iter()
            .map(|(n, d, s)| mk(n, d, s, Class::Trunk(l)))
            .collect();
        if spec.scattered_layers.contains(&l) && !exps.is_empty() {
            // experts…, trunk[0], one expert part, trunk[1..]
            let mut trunk = trunk.into_iter();
            let last_exp = exps.pop().unwrap();
            shards[sh].extend(exps);
            shards[sh].push(trunk.next().unwrap());
            shards[sh].push(last_exp);
            shards[sh].extend(trunk);
        } else {
            shards[sh].extend(exps);
            shards[sh].extend(trunk);
        }
    }
    let last = spec.n_shards - 1;
    for (n, d, s) in mt_iter {
        shards[last].push(mk(n, d, s, Class::Model));
    }

    let mut weight_map = BTreeMap::new();
    let mut paths = Vec::new();
    let mut catalog_entries = Vec::new();
    for (i, entries) in shards.iter().enumerate() {
        let fname = format!("model-{:05}-of-{:06}.safetensors", i + 1, spec.n_shards);
        let path = dir.join(&fname);
        let offs = write_shard(&path, entries);
        let len = std::fs::metadata(&path).unwrap().len();
        paths.push((path, len));
        for (e, off) in entries.iter().zip(offs) {
            weight_map.insert(e.name.clone(), fname.clone());
            catalog_entries.push((i as u16, off, e));
        }
    }
    write_config(spec, dir);
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(&index).unwrap(),
    )
    .unwrap();

    let mut cat = Catalog::new(paths, spec.n_layers, spec.n_experts, spec.layout);
    for (shard, off, e) in catalog_entries {
        let ext = TensorExtent {
            name: e.name.clone(),
            dtype: e.dtype,
            shard,
            off,
            nbytes: e.data.len() as u64,
        };
        match e.class {
            Class::Model => cat.add_model(ext).unwrap(),
            Class::Trunk(l) => cat.add_trunk(l, ext).unwrap(),
            Class::Expert(l, x, p) => cat
                .add_expert_part(
                    l,
                    x,
                    p,
                    e.dtype,
                    PartExtent {
                        shard,
                        off,
                        nbytes: e.data.len() as u64,
                    },
                )
                .unwrap(),
        }
    }
    Written {
        dir: dir.to_path_buf(),
        catalog: cat.finish().unwrap(),
        spec: spec.clone(),
        _tmp: None,
    }
}

/// MLA layers (0-based): 3, 7, … and the last layer, like the real layer map.
pub fn mla_layers(spec: &Spec) -> Vec<usize> {
    (0..spec.n_layers)
        .filter(|&l| (l + 1) % 4 == 0 || l + 1 == spec.n_layers)
        .collect()
}

/// A nested (released-shape) config.json for `spec`.
pub fn write_config(spec: &Spec, dir: &Path) {
    let mla = mla_layers(spec);
    let full: Vec<usize> = mla.iter().map(|l| l + 1).collect();
    let kda: Vec<usize> = (1..=spec.n_layers).filter(|x| !full.contains(x)).collect();
    let mut t = serde_json::Map::new();
    let mut put = |k: &str, v: serde_json::Value| {
        t.insert(k.to_string(), v);
    };
    put("model_type", "kimi_linear".into());
    put("hidden_size", spec.hidden.into());
    put("num_hidden_layers", spec.n_layers.into());
    put("vocab_size", spec.vocab.into());
    put("rms_norm_eps", 1e-5.into());
    put("hidden_act", "situ".into());
    put("activation_situ_beta", 4.0.into());
    put("activation_situ_linear_beta", 25.0.into());
    put("intermediate_size", 96.into());
    put("first_k_dense_replace", 1.into());
    put("moe_layer_freq", 1.into());
    put("num_experts", spec.n_experts.into());
    put("num_experts_per_token", 2.into());
    put("num_shared_experts", 2.into());
    put("moe_intermediate_size", spec.layout.inter.into());
    put("routed_expert_hidden_size", spec.layout.latent.into());
    put("latent_moe_use_norm", true.into());
    put("moe_router_activation_func", "sigmoid".into());
    put("moe_renormalize", true.into());
    put("routed_scaling_factor", 1.0.into());
    put("topk_method", "noaux_tc".into());
    put("use_grouped_topk", true.into());
    put("num_expert_group", 1.into());
    put("topk_group", 1.into());
    put("num_attention_heads", 4.into());
    put("num_key_value_heads", 4.into());
    put("q_lora_rank", 32.into());
    put("kv_lora_rank", 16.into());
    put("qk_nope_head_dim", 8.into());
    put("qk_rope_head_dim", 8.into());
    put("v_head_dim", 8.into());
    put("mla_use_nope", true.into());
    put("mla_use_output_gate", true.into());
    put("attn_res_block_size", 3.into());
    put("num_nextn_predict_layers", 0.into());
    put("tie_word_embeddings", false.into());
    put(
        "linear_attn_config",
        serde_json::json!({
            "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0, "use_full_rank_gate": true,
            "full_attn_layers": full, "kda_layers": kda
        }),
    );
    let cfg = serde_json::json!({
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
        "tie_word_embeddings": false,
        "text_config": serde_json::Value::Object(t),
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&cfg).unwrap(),
    )
    .unwrap();
}

/// Expected bytes of layer l's trunk tensor `name`.
pub fn expected_tensor(spec: &Spec, name: &str) -> Vec<u8> {
    for l in 0..spec.n_layers {
        for (n, d, s) in trunk_tensors(spec, l) {
            if n == name {
                return tensor_bytes(&n, s.iter().product::<usize>() * d.size());
            }
        }
    }
    for (n, d, s) in model_tensors(spec) {
        if n == name {
            return tensor_bytes(&n, s.iter().product::<usize>() * d.size());
        }
    }
    panic!("no tensor {name}")
}

/// A tiny xorshift PRNG (no external crates).
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
