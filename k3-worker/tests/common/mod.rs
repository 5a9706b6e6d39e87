//! Test helpers: tiny random checkpoints with the REAL tensor names, served by an in-memory
//! `WeightSource` (also a `TensorShapes` oracle), plus a seeded PRNG.
//!
//! The tensor list below is written from SPEC.md §2 independently of `model/bind.rs`, so a
//! naming or shape slip in the binder fails here.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use k3_proto::expert::{ExpertLayout, ExpertPart};
use k3_proto::Dtype;
use k3_store::runtime::source::{
    ByteOwner, ExpertBatch, ExpertError, LayerLayout, LayerRun, Region, SourceError, SourceStats,
    TensorLoc, WeightSource,
};
use k3_worker::model::{Dims, TensorShapes};

#[allow(dead_code)] // alloc.rs, a binary of its own, uses none of it
pub mod ckpt;
pub mod gen;
#[allow(unused_imports)]
pub use gen::Gen;

/// splitmix64.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn sym(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// The 13-layer / block-3 tiny model of SPEC.md §7.1 (map KKKMKKKMKKKMM), shrunk further and
/// with MXFP4-compatible expert widths.
pub fn tiny_dims() -> Dims {
    let full = [4usize, 8, 12, 13];
    Dims {
        hidden: 64,
        n_layers: 13,
        vocab: 97,
        rms_eps: 1e-5,
        mla_norm_eps: 1e-6,
        situ_beta: 4.0,
        situ_linear_beta: 25.0,
        dense_inter: 48,
        first_k_dense: 1,
        n_experts: 8,
        top_k: 2,
        n_shared: 2,
        moe_inter: 32,
        latent: 32,
        latent_norm: true,
        renormalize: true,
        routed_scale: 1.0,
        mla_heads: 2,
        q_lora: 24,
        kv_lora: 16,
        nope: 8,
        rope: 4,
        v_head: 8,
        mla_gate: true,
        kda_heads: 2,
        kda_dim: 8,
        conv_k: 4,
        gate_lb: -5.0,
        mla: (0..13).map(|l| full.contains(&(l + 1))).collect(),
        block: 3,
    }
}

/// `(suffix, shape, dtype)` of every trunk tensor of layer `l` (SPEC.md §2.3–2.7).
pub fn layer_specs(d: &Dims, l: usize) -> Vec<(String, Vec<usize>, Dtype)> {
    let e = d.hidden;
    let bf = Dtype::BF16;
    let f = Dtype::F32;
    let mut v: Vec<(String, Vec<usize>, Dtype)> = vec![
        ("input_layernorm.weight".into(), vec![e], bf),
        ("post_attention_layernorm.weight".into(), vec![e], bf),
        ("self_attention_res_norm.weight".into(), vec![e], bf),
        ("self_attention_res_proj.weight".into(), vec![1, e], bf),
        ("mlp_res_norm.weight".into(), vec![e], bf),
        ("mlp_res_proj.weight".into(), vec![1, e], bf),
    ];
    let mut add = |s: &str, shape: Vec<usize>, dt: Dtype| v.push((s.to_string(), shape, dt));
    if d.mla[l] {
        let (h, n, r, vh) = (d.mla_heads, d.nope, d.rope, d.v_head);
        add("self_attn.q_a_proj.weight", vec![d.q_lora, e], bf);
        add("self_attn.q_a_layernorm.weight", vec![d.q_lora], bf);
        add("self_attn.q_b_proj.weight", vec![h * (n + r), d.q_lora], bf);
        add(
            "self_attn.kv_a_proj_with_mqa.weight",
            vec![d.kv_lora + r, e],
            bf,
        );
        add("self_attn.kv_a_layernorm.weight", vec![d.kv_lora], bf);
        add(
            "self_attn.kv_b_proj.weight",
            vec![h * (n + vh), d.kv_lora],
            bf,
        );
        add("self_attn.o_proj.weight", vec![e, h * vh], bf);
        add("self_attn.g_proj.weight", vec![h * vh, e], bf);
    } else {
        let (h, dh) = (d.kda_heads, d.kda_dim);
        let p = h * dh;
        for w in ["q", "k", "v"] {
            add(&format!("self_attn.{w}_proj.weight"), vec![p, e], bf);
            add(
                &format!("self_attn.{w}_conv1d.weight"),
                vec![p, 1, d.conv_k],
                f,
            );
        }
        add("self_attn.f_a_proj.weight", vec![dh, e], bf);
        add("self_attn.f_b_proj.weight", vec![p, dh], bf);
        add("self_attn.A_log", vec![dh.max(h)], f);
        add("self_attn.dt_bias", vec![p], f);
        add("self_attn.b_proj.weight", vec![h, e], bf);
        add("self_attn.g_proj.weight", vec![p, e], bf);
        add("self_attn.o_norm.weight", vec![dh], f);
        add("self_attn.o_proj.weight", vec![e, p], bf);
    }
    if l < d.first_k_dense {
        add("mlp.gate_proj.weight", vec![d.dense_inter, e], bf);
        add("mlp.up_proj.weight", vec![d.dense_inter, e], bf);
        add("mlp.down_proj.weight", vec![e, d.dense_inter], bf);
    } else {
        let m = "block_sparse_moe";
        let sw = d.n_shared * d.moe_inter;
        add(&format!("{m}.gate.weight"), vec![d.n_experts, e], bf);
        add(
            &format!("{m}.gate.e_score_correction_bias"),
            vec![d.n_experts],
            f,
        );
        add(
            &format!("{m}.routed_expert_down_proj.weight"),
            vec![d.latent, e],
            bf,
        );
        add(
            &format!("{m}.routed_expert_norm.weight"),
            vec![d.latent],
            bf,
        );
        add(
            &format!("{m}.routed_expert_up_proj.weight"),
            vec![e, d.latent],
            bf,
        );
        add(
            &format!("{m}.shared_experts.gate_proj.weight"),
            vec![sw, e],
            bf,
        );
        add(
            &format!("{m}.shared_experts.up_proj.weight"),
            vec![sw, e],
            bf,
        );
        add(
            &format!("{m}.shared_experts.down_proj.weight"),
            vec![e, sw],
            bf,
        );
    }
    v
}

pub fn layer_name(l: usize, suffix: &str) -> String {
    format!("language_model.model.layers.{l}.{suffix}")
}

pub fn bf16_bits(x: f32) -> [u8; 2] {
    half::bf16::from_f32(x).to_bits().to_le_bytes()
}

pub fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// Plausible random values for a tensor (so activations stay O(1)).
fn init_values(suffix: &str, shape: &[usize], d: &Dims, rng: &mut Rng) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let fan_in = *shape.last().unwrap_or(&1) as f32;
    if suffix.ends_with("A_log") {
        // Distinct per head, zero tail (SPEC.md §2.4).
        return (0..n)
            .map(|i| if i < d.kda_heads { rng.sym() } else { 0.0 })
            .collect();
    }
    if suffix.contains("norm.weight") || suffix.contains("layernorm") {
        return (0..n).map(|_| 1.0 + 0.2 * rng.sym()).collect();
    }
    if suffix.contains("conv1d") {
        return (0..n).map(|_| 0.6 * rng.sym()).collect();
    }
    if suffix.ends_with("dt_bias") || suffix.ends_with("e_score_correction_bias") {
        return (0..n).map(|_| 0.5 * rng.sym()).collect();
    }
    if suffix.contains("_res_proj") {
        return (0..n).map(|_| 2.0 * rng.sym()).collect();
    }
    let s = 1.7 / fan_in.sqrt();
    (0..n).map(|_| s * rng.sym()).collect()
}

fn encode(vals: &[f32], dt: Dtype) -> Vec<u8> {
    match dt {
        Dtype::BF16 => vals.iter().flat_map(|&v| bf16_bits(v)).collect(),
        Dtype::F32 => vals.iter().flat_map(|&v| v.to_le_bytes()).collect(),
        _ => panic!("test source encodes BF16/F32 only"),
    }
}

struct Layer {
    bytes: Arc<Vec<u8>>,
    layout: Arc<LayerLayout>,
}

/// An in-memory checkpoint.
pub struct MemSource {
    pub dims: Dims,
    layers: Vec<Layer>,
    model: BTreeMap<String, Arc<Vec<u8>>>,
    experts: BTreeMap<(usize, u32), Arc<Vec<u8>>>,
    meta: BTreeMap<String, (Dtype, Vec<u64>)>,
    /// (layer, expert) pairs whose load fails.
    pub fail: BTreeSet<(usize, u32)>,
    pub stats: Mutex<SourceStats>,
    /// Every `layer()` / `prefetch_layer()` call, in order (`prefetch` negative-encoded as !l).
    pub calls: Mutex<Vec<(char, usize)>>,
}

struct Owner(Arc<Vec<u8>>);
impl ByteOwner for Owner {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

fn region(b: &Arc<Vec<u8>>) -> Region {
    Region::whole(Arc::new(Owner(b.clone())))
}

impl MemSource {
    /// Random weights for `d`, seeded.
    pub fn random(d: &Dims, seed: u64) -> MemSource {
        let mut rng = Rng(seed);
        let mut meta = BTreeMap::new();
        let mut model = BTreeMap::new();
        let (v, e) = (d.vocab, d.hidden);
        for (name, shape) in [
            ("language_model.model.embed_tokens.weight", vec![v, e]),
            ("language_model.lm_head.weight", vec![v, e]),
            ("language_model.model.norm.weight", vec![e]),
            ("language_model.model.output_attn_res_norm.weight", vec![e]),
            (
                "language_model.model.output_attn_res_proj.weight",
                vec![1, e],
            ),
        ] {
            let vals = if name.contains("embed") {
                (0..v * e).map(|_| rng.sym()).collect()
            } else {
                init_values(name, &shape, d, &mut rng)
            };
            meta.insert(
                name.to_string(),
                (Dtype::BF16, shape.iter().map(|&x| x as u64).collect()),
            );
            model.insert(name.to_string(), Arc::new(encode(&vals, Dtype::BF16)));
        }
        let mut layers = Vec::new();
        for l in 0..d.n_layers {
            let mut bytes = Vec::new();
            let mut locs = Vec::new();
            for (suffix, shape, dt) in layer_specs(d, l) {
                let name = layer_name(l, &suffix);
                let vals = init_values(&suffix, &shape, d, &mut rng);
                let enc = encode(&vals, dt);
                // Some padding between tensors, as in a real shard run.
                bytes.extend_from_slice(&[0xAB; 6]);
                locs.push(TensorLoc {
                    name: name.clone(),
                    off: bytes.len() as u64,
                    nbytes: enc.len() as u64,
                    dtype: dt,
                    storage: Default::default(),
                    source_xxh3: None,
                });
                bytes.extend_from_slice(&enc);
                meta.insert(name, (dt, shape.iter().map(|&x| x as u64).collect()));
            }
            layers.push(Layer {
                bytes: Arc::new(bytes),
                layout: Arc::new(LayerLayout::new(locs)),
            });
        }
        let layout = ExpertLayout {
            inter: d.moe_inter,
            latent: d.latent,
        };
        let mut experts = BTreeMap::new();
        for l in d.first_k_dense..d.n_layers {
            for x in 0..d.n_experts as u32 {
                let mut b = Vec::with_capacity(layout.expert_bytes());
                for p in ExpertPart::ALL {
                    let n = layout.part_bytes(p);
                    match p {
                        ExpertPart::W1Packed | ExpertPart::W2Packed | ExpertPart::W3Packed => {
                            b.extend((0..n).map(|_| rng.next_u64() as u8))
                        }
                        // 2^(s-127) with s in 122..=125: element magnitudes ≤ 6/4.
                        _ => b.extend((0..n).map(|_| 122 + (rng.next_u64() % 4) as u8)),
                    }
                }
                experts.insert((l, x), Arc::new(b));
            }
        }
        MemSource {
            dims: d.clone(),
            layers,
            model,
            experts,
            meta,
            fail: BTreeSet::new(),
            stats: Mutex::new(SourceStats::default()),
            calls: Mutex::new(Vec::new()),
        }
    }

    /// Overwrite a tensor's values (encoded in its stored dtype).
    pub fn set(&mut self, name: &str, vals: &[f32]) {
        if let Some(b) = self.model.get_mut(name) {
            assert_eq!(vals.len() * 2, b.len());
            *b = Arc::new(encode(vals, Dtype::BF16));
            return;
        }
        for layer in &mut self.layers {
            if let Some(loc) = layer.layout.get(name) {
                let enc = encode(vals, loc.dtype);
                assert_eq!(enc.len() as u64, loc.nbytes, "{name}");
                let bytes = Arc::make_mut(&mut layer.bytes);
                bytes[loc.off as usize..(loc.off + loc.nbytes) as usize].copy_from_slice(&enc);
                return;
            }
        }
        panic!("no tensor {name}");
    }

    /// A tensor's values, widened.
    pub fn get(&self, name: &str) -> Vec<f32> {
        if let Some(b) = self.model.get(name) {
            return k3_worker::kernels::bf16_bytes_to_f32(b);
        }
        for layer in &self.layers {
            if let Some(loc) = layer.layout.get(name) {
                let b = &layer.bytes[loc.off as usize..(loc.off + loc.nbytes) as usize];
                return match loc.dtype {
                    Dtype::BF16 => k3_worker::kernels::bf16_bytes_to_f32(b),
                    _ => k3_worker::kernels::f32_bytes_to_f32(b),
                };
            }
        }
        panic!("no tensor {name}");
    }

    /// Raw bytes of a tensor.
    pub fn raw(&self, name: &str) -> Vec<u8> {
        if let Some(b) = self.model.get(name) {
            return b.to_vec();
        }
        for layer in &self.layers {
            if let Some(loc) = layer.layout.get(name) {
                return layer.bytes[loc.off as usize..(loc.off + loc.nbytes) as usize].to_vec();
            }
        }
        panic!("no tensor {name}");
    }

    /// Replace an expert's slot bytes.
    pub fn set_expert(&mut self, l: usize, e: u32, bytes: Vec<u8>) {
        self.experts.insert((l, e), Arc::new(bytes));
    }

    /// An expert's slot bytes.
    pub fn expert_bytes(&self, l: usize, e: u32) -> Vec<u8> {
        self.experts[&(l, e)].to_vec()
    }

    /// Change what the index reports for a tensor (the layer layout is unchanged).
    pub fn set_meta(&mut self, name: &str, dt: Dtype, shape: Vec<u64>) {
        self.meta.insert(name.to_string(), (dt, shape));
    }

    /// Change a layout entry (dtype and/or byte length) of a layer tensor.
    pub fn set_loc(&mut self, name: &str, dt: Dtype, nbytes: u64) {
        for layer in &mut self.layers {
            if layer.layout.get(name).is_some() {
                let locs = layer
                    .layout
                    .tensors()
                    .iter()
                    .map(|t| {
                        let mut t = t.clone();
                        if t.name == name {
                            t.dtype = dt;
                            t.nbytes = nbytes;
                        }
                        t
                    })
                    .collect();
                layer.layout = Arc::new(LayerLayout::new(locs));
                return;
            }
        }
        panic!("no tensor {name}");
    }
}

impl TensorShapes for MemSource {
    fn meta(&self, name: &str) -> Option<(Dtype, Vec<u64>)> {
        self.meta.get(name).cloned()
    }
}

impl WeightSource for MemSource {
    fn model_tensor(&self, name: &str) -> Result<Region, SourceError> {
        self.model
            .get(name)
            .map(region)
            .ok_or_else(|| SourceError::Missing(name.to_string()))
    }

    fn layer(&self, l: usize) -> Result<LayerRun, SourceError> {
        self.calls.lock().unwrap().push(('L', l));
        let layer = self
            .layers
            .get(l)
            .ok_or_else(|| SourceError::Invalid(format!("layer {l}")))?;
        Ok(LayerRun {
            layer: l,
            region: region(&layer.bytes),
            layout: layer.layout.clone(),
        })
    }

    fn prefetch_layer(&self, l: usize) {
        self.calls.lock().unwrap().push(('P', l));
    }

    fn experts(&self, l: usize, ids: &[u32]) -> Result<ExpertBatch, SourceError> {
        let mut st = self.stats.lock().unwrap();
        let mut out = Vec::new();
        for &id in ids {
            st.expert_requests += 1;
            if self.fail.contains(&(l, id)) {
                st.failed_expert_loads += 1;
                out.push(Err(ExpertError::Injected {
                    layer: l,
                    expert: id,
                    message: "injected failure".into(),
                }));
                continue;
            }
            match self.experts.get(&(l, id)) {
                Some(b) => {
                    st.resident_hits += 1;
                    out.push(Ok(region(b)));
                }
                None => out.push(Err(ExpertError::NotInCheckpoint {
                    layer: l,
                    expert: id,
                })),
            }
        }
        Ok(ExpertBatch { experts: out })
    }

    fn stats(&self) -> SourceStats {
        self.stats.lock().unwrap().clone()
    }
}
