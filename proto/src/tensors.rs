//! What a config expects of every tensor the engine reads (SPEC.md §2): its dtype, from one
//! table by tensor kind ([`DTYPE_RULES`]), and its shape. [`check`] holds a checkpoint index to
//! it; it is the one check `k3-ctl inspect`, `verify`, `pack-trunk`, `k3-store start` and
//! `k3-worker --standalone` run on the first read of the headers, so a transposed or
//! wrongly typed tensor is refused there (exit 2, naming the tensor) instead of at the worker's
//! bind.
//!
//! Checked: the five model-level tensors (`lm_head` may be absent when the embeddings are tied);
//! every tensor the engine binds in each layer `< num_hidden_layers` (KDA or MLA attention, the
//! dense MLP or the MoE block with its shared experts, the AttnRes and norm vectors); every
//! routed expert of every MoE layer, with its six MXFP4 parts. A tensor the engine does not bind
//! (another trunk tensor of a layer, the vision tower) is not checked here: it is carried or
//! ignored, never read as a weight.

use std::collections::HashMap;

use crate::config::{LayerKind, ModelConfig};
use crate::dtype::Dtype;
use crate::expert::ExpertPart;
use crate::names::{self, TensorClass};
use crate::safetensors::{CheckpointIndex, INDEX_JSON};

/// The one shard file name that needs no index (the hub's single-file layout).
pub const SINGLE_FILE: &str = "model.safetensors";

/// What a tensor is to the engine; [`DTYPE_RULES`] gives the dtypes each kind may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorKind {
    /// The embedding and `lm_head` `[vocab, hidden]`.
    Embedding,
    /// A weight matrix of attention, the dense MLP, the shared experts or the latent
    /// projections.
    Matrix,
    /// The MoE router `block_sparse_moe.gate.weight` `[experts, hidden]` (BF16 in the release;
    /// F32 as the C engine and checkpoint writers take it, SPEC.md §2.7).
    Router,
    /// A small vector widened to f32 at bind (norm gains, AttnRes vectors, router bias,
    /// `A_log`, `dt_bias`, conv kernels, `o_norm`).
    Vector,
    /// One of the six MXFP4 parts of a routed expert (packed nibbles or scales).
    ExpertPart,
}

/// The dtypes each kind of tensor may be stored in: the one place to widen what the engine
/// accepts. F32 where the C engine takes it (SPEC.md §2.9): the small vectors and the router,
/// which it widens to f32 at load anyway; k3 multiplies an F32 router as SPEC.md §3.11 says.
pub const DTYPE_RULES: &[(TensorKind, &[Dtype])] = &[
    (TensorKind::Embedding, &[Dtype::BF16]),
    (TensorKind::Matrix, &[Dtype::BF16]),
    (TensorKind::Router, &[Dtype::BF16, Dtype::F32]),
    (TensorKind::Vector, &[Dtype::BF16, Dtype::F32]),
    (TensorKind::ExpertPart, &[Dtype::U8]),
];

impl TensorKind {
    /// The dtypes this kind may be stored in ([`DTYPE_RULES`]).
    pub fn dtypes(self) -> &'static [Dtype] {
        DTYPE_RULES
            .iter()
            .find(|(k, _)| *k == self)
            .map_or(&[], |(_, d)| d)
    }
}

/// One tensor the config expects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expected {
    /// Canonical name.
    pub name: String,
    /// Its kind (and so its dtypes).
    pub kind: TensorKind,
    /// The shapes accepted (`A_log` has two).
    pub shapes: Vec<Vec<u64>>,
}

fn want(name: String, kind: TensorKind, shapes: &[&[usize]]) -> Expected {
    Expected {
        name,
        kind,
        shapes: shapes
            .iter()
            .map(|s| s.iter().map(|&d| d as u64).collect())
            .collect(),
    }
}

/// The model-level tensors the config expects (`lm_head` too when the embeddings are untied).
pub fn expected_model(cfg: &ModelConfig) -> Vec<Expected> {
    let (v, e) = (cfg.vocab_size, cfg.hidden_size);
    let mut out = vec![
        want(names::EMBED.into(), TensorKind::Embedding, &[&[v, e]]),
        want(names::FINAL_NORM.into(), TensorKind::Vector, &[&[e]]),
        want(names::OUT_RES_NORM.into(), TensorKind::Vector, &[&[e]]),
        want(names::OUT_RES_PROJ.into(), TensorKind::Vector, &[&[1, e]]),
    ];
    if !cfg.tie_word_embeddings {
        out.push(want(
            names::LM_HEAD.into(),
            TensorKind::Embedding,
            &[&[v, e]],
        ));
    }
    out
}

/// The non-expert tensors of layer `l` the engine binds (SPEC.md §2; `k3-worker`'s
/// `model::bind` reads exactly these).
pub fn expected_layer(cfg: &ModelConfig, l: usize) -> Vec<Expected> {
    use TensorKind::{Matrix, Router, Vector};
    let e = cfg.hidden_size;
    let n = |s: &str| names::layer_tensor(l, s);
    let mut out = vec![
        want(n("self_attention_res_norm.weight"), Vector, &[&[e]]),
        want(n("self_attention_res_proj.weight"), Vector, &[&[1, e]]),
        want(n("mlp_res_norm.weight"), Vector, &[&[e]]),
        want(n("mlp_res_proj.weight"), Vector, &[&[1, e]]),
        want(n("input_layernorm.weight"), Vector, &[&[e]]),
        want(n("post_attention_layernorm.weight"), Vector, &[&[e]]),
    ];
    match cfg.layer_kind(l) {
        LayerKind::Kda => {
            let (h, dh, k) = (
                cfg.kda_num_heads,
                cfg.kda_head_dim,
                cfg.short_conv_kernel_size,
            );
            let p = h * dh;
            for w in ["q", "k", "v"] {
                out.push(want(
                    n(&format!("self_attn.{w}_proj.weight")),
                    Matrix,
                    &[&[p, e]],
                ));
                out.push(want(
                    n(&format!("self_attn.{w}_conv1d.weight")),
                    Vector,
                    &[&[p, 1, k]],
                ));
            }
            out.push(want(n("self_attn.f_a_proj.weight"), Matrix, &[&[dh, e]]));
            out.push(want(n("self_attn.f_b_proj.weight"), Matrix, &[&[p, dh]]));
            // The release stores A_log as [head_dim] with a zero tail (SPEC.md §10 C2); the HF
            // module declares [num_heads].
            let a_log: &[&[usize]] = if h <= dh { &[&[dh], &[h]] } else { &[&[h]] };
            out.push(want(n("self_attn.A_log"), Vector, a_log));
            out.push(want(n("self_attn.dt_bias"), Vector, &[&[p]]));
            out.push(want(n("self_attn.b_proj.weight"), Matrix, &[&[h, e]]));
            out.push(want(n("self_attn.g_proj.weight"), Matrix, &[&[p, e]]));
            out.push(want(n("self_attn.o_norm.weight"), Vector, &[&[dh]]));
            out.push(want(n("self_attn.o_proj.weight"), Matrix, &[&[e, p]]));
        }
        LayerKind::Mla => {
            let h = cfg.num_attention_heads;
            let (qr, kvr) = (cfg.q_lora_rank, cfg.kv_lora_rank);
            let (nope, rope, vh) = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
            out.push(want(n("self_attn.q_a_proj.weight"), Matrix, &[&[qr, e]]));
            out.push(want(n("self_attn.q_a_layernorm.weight"), Vector, &[&[qr]]));
            out.push(want(
                n("self_attn.q_b_proj.weight"),
                Matrix,
                &[&[h * (nope + rope), qr]],
            ));
            out.push(want(
                n("self_attn.kv_a_proj_with_mqa.weight"),
                Matrix,
                &[&[kvr + rope, e]],
            ));
            out.push(want(
                n("self_attn.kv_a_layernorm.weight"),
                Vector,
                &[&[kvr]],
            ));
            out.push(want(
                n("self_attn.kv_b_proj.weight"),
                Matrix,
                &[&[h * (nope + vh), kvr]],
            ));
            out.push(want(n("self_attn.o_proj.weight"), Matrix, &[&[e, h * vh]]));
            if cfg.mla_use_output_gate {
                out.push(want(n("self_attn.g_proj.weight"), Matrix, &[&[h * vh, e]]));
            }
        }
    }
    // A SiTU MLP's three projections under `prefix`, of width `w`.
    let situ = |out: &mut Vec<Expected>, prefix: &str, w: usize| {
        for (p, shape) in [
            ("gate_proj", [w, e]),
            ("up_proj", [w, e]),
            ("down_proj", [e, w]),
        ] {
            out.push(want(n(&format!("{prefix}{p}.weight")), Matrix, &[&shape]));
        }
    };
    if cfg.is_moe(l) {
        let (ne, lat) = (cfg.num_experts, cfg.routed_expert_hidden_size);
        let m = |s: &str| n(&format!("block_sparse_moe.{s}"));
        out.push(want(m("gate.weight"), Router, &[&[ne, e]]));
        out.push(want(m("gate.e_score_correction_bias"), Vector, &[&[ne]]));
        out.push(want(
            m("routed_expert_down_proj.weight"),
            Matrix,
            &[&[lat, e]],
        ));
        out.push(want(
            m("routed_expert_up_proj.weight"),
            Matrix,
            &[&[e, lat]],
        ));
        if cfg.latent_moe_use_norm {
            out.push(want(m("routed_expert_norm.weight"), Vector, &[&[lat]]));
        }
        if cfg.num_shared_experts > 0 {
            let sw = cfg.num_shared_experts * cfg.moe_intermediate_size;
            situ(&mut out, "block_sparse_moe.shared_experts.", sw);
        }
    } else {
        situ(&mut out, "mlp.", cfg.intermediate_size);
    }
    out
}

/// One tensor that does not match the config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorProblem {
    /// The tensor (canonical name).
    pub tensor: String,
    /// What is wrong, with what was expected.
    pub problem: String,
}

/// Every tensor of a checkpoint that does not match its config (the first
/// [`ShapeError::LISTED`] are kept, the rest counted).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct ShapeError {
    /// The problems kept, in index order (model-level and missing tensors last).
    pub problems: Vec<TensorProblem>,
    /// Problems beyond those kept.
    pub more: u64,
}

impl ShapeError {
    /// Problems listed one by one.
    pub const LISTED: usize = 20;

    fn describe(&self) -> String {
        let n = self.problems.len() as u64 + self.more;
        let mut s = format!(
            "{n} tensor{} do{} not match the config:",
            if n == 1 { "" } else { "s" },
            if n == 1 { "es" } else { "" }
        );
        for p in &self.problems {
            s.push_str(&format!("\n  - `{}`: {}", p.tensor, p.problem));
        }
        if self.more > 0 {
            s.push_str(&format!("\n  - … and {} more", self.more));
        }
        s
    }

    /// Each problem as one line (`` `tensor`: problem ``), the count of the rest last.
    pub fn lines(&self) -> Vec<String> {
        let mut v: Vec<String> = (self.problems.iter())
            .map(|p| format!("`{}`: {}", p.tensor, p.problem))
            .collect();
        if self.more > 0 {
            v.push(format!(
                "… and {} more tensors do not match the config",
                self.more
            ));
        }
        v
    }
}

fn dtypes_text(d: &[Dtype]) -> String {
    d.iter().map(|d| d.name()).collect::<Vec<_>>().join(" or ")
}

fn shapes_text(s: &[Vec<u64>]) -> String {
    s.iter()
        .map(|s| format!("{s:?}"))
        .collect::<Vec<_>>()
        .join(" or ")
}

/// What is wrong with a tensor stored as `dtype` `shape` that should be `kind` of one of
/// `shapes` (`None`: nothing).
fn mismatch(kind: TensorKind, shapes: &[Vec<u64>], dtype: Dtype, shape: &[u64]) -> Option<String> {
    let dtype_ok = kind.dtypes().contains(&dtype);
    let shape_ok = shapes.iter().any(|s| s.as_slice() == shape);
    if dtype_ok && shape_ok {
        return None;
    }
    let mut m = format!(
        "{dtype} {shape:?}, the config expects {} {}",
        dtypes_text(kind.dtypes()),
        shapes_text(shapes)
    );
    if !shape_ok && shape.len() == 2 && shapes.iter().any(|s| s == &[shape[1], shape[0]]) {
        m.push_str(" (transposed)");
    }
    Some(m)
}

/// Problems as they are found: the first [`ShapeError::LISTED`] kept, the rest counted.
#[derive(Default)]
struct Found {
    list: Vec<TensorProblem>,
    more: u64,
}

impl Found {
    fn note(&mut self, tensor: &str, problem: String) {
        if self.full() {
            self.more += 1;
        } else {
            self.list.push(TensorProblem {
                tensor: tensor.to_string(),
                problem,
            });
        }
    }

    fn full(&self) -> bool {
        self.list.len() >= ShapeError::LISTED
    }
}

/// Hold every tensor the engine reads in `index` to `cfg` (see the module doc): dtype by
/// [`DTYPE_RULES`], shape by the config, nothing missing, and a sharded checkpoint has its
/// `model.safetensors.index.json`. Layers at or past `cfg.num_hidden_layers` are not checked
/// (a `with_layers` config checks a partial set).
pub fn check(cfg: &ModelConfig, index: &CheckpointIndex) -> Result<(), ShapeError> {
    let mut found = Found::default();
    // Without the index a missing shard cannot be told from a checkpoint of fewer shards: only
    // a single-file checkpoint (`model.safetensors`) may do without it.
    let single = index.n_shards() == 1
        && index.shard_path(0).file_name() == Some(std::ffi::OsStr::new(SINGLE_FILE));
    if !index.listed_in_index_json() && !single {
        found.note(
            INDEX_JSON,
            format!(
                "missing: a checkpoint of {} shard file(s) other than a single `{SINGLE_FILE}` \
                 needs its index (it names every shard, so a missing one is caught)",
                index.n_shards()
            ),
        );
    }
    // Non-expert tensors: by name; seen ones are removed, what is left is missing.
    let mut wanted: HashMap<String, Expected> = expected_model(cfg)
        .into_iter()
        .chain((0..cfg.num_hidden_layers).flat_map(|l| expected_layer(cfg, l)))
        .map(|x| (x.name.clone(), x))
        .collect();
    let layout = cfg.expert_layout();
    // Parts seen per (layer, expert): a bit per part. A map, not a table: a config may claim
    // millions of experts the checkpoint does not have.
    let mut parts: HashMap<(usize, usize), u8> = HashMap::new();
    for t in index.iter() {
        match names::classify(t.name) {
            TensorClass::Expert {
                layer,
                expert,
                part,
            } if layer < cfg.num_hidden_layers => {
                if !cfg.is_moe(layer) || expert >= cfg.num_experts {
                    found.note(
                        t.name,
                        format!(
                            "no such routed expert (layer {layer} is {}, {} experts per layer)",
                            if cfg.is_moe(layer) { "MoE" } else { "dense" },
                            cfg.num_experts
                        ),
                    );
                    continue;
                }
                let shape = [layout.stored_shape(part).map(|d| d as u64).to_vec()];
                if let Some(m) = mismatch(TensorKind::ExpertPart, &shape, t.dtype, t.shape()) {
                    found.note(t.name, m);
                }
                *parts.entry((layer, expert)).or_default() |= 1 << part.index();
            }
            TensorClass::Model | TensorClass::Trunk { .. } => {
                if let Some(x) = wanted.remove(t.name) {
                    if let Some(m) = mismatch(x.kind, &x.shapes, t.dtype, t.shape()) {
                        found.note(t.name, m);
                    }
                }
            }
            _ => {}
        }
    }
    let mut missing: Vec<&String> = wanted.keys().collect();
    missing.sort();
    for name in missing {
        found.note(name, "missing from the checkpoint".into());
    }
    // Every MoE layer holds every expert with its six parts. The scan for examples stops once
    // the list is full; the rest are counted, not visited.
    let complete = parts.values().filter(|&&m| m == 0x3f).count() as u64;
    let expected = (cfg.n_moe() as u64).saturating_mul(cfg.num_experts as u64);
    let mut incomplete = expected.saturating_sub(complete);
    'scan: for l in cfg.first_k_dense_replace..cfg.num_hidden_layers {
        for e in 0..cfg.num_experts {
            if incomplete == 0 || found.full() {
                break 'scan;
            }
            let mask = parts.get(&(l, e)).copied().unwrap_or(0);
            if mask == 0x3f {
                continue;
            }
            let absent = ExpertPart::ALL
                .into_iter()
                .find(|p| mask & (1 << p.index()) == 0)
                .expect("a part is absent");
            found.note(
                &names::expert_tensor(l, e, absent),
                "missing from the checkpoint (routed expert incomplete)".into(),
            );
            incomplete -= 1;
        }
    }
    found.more += incomplete;
    if found.list.is_empty() {
        Ok(())
    } else {
        Err(ShapeError {
            problems: found.list,
            more: found.more,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_a_dtype_rule() {
        for k in [
            TensorKind::Embedding,
            TensorKind::Matrix,
            TensorKind::Router,
            TensorKind::Vector,
            TensorKind::ExpertPart,
        ] {
            assert!(!k.dtypes().is_empty(), "{k:?}");
        }
    }

    #[test]
    fn mismatch_names_what_was_expected_and_spots_a_transpose() {
        let s = [vec![64u64, 256]];
        assert_eq!(
            mismatch(TensorKind::Matrix, &s, Dtype::BF16, &[64, 256]),
            None
        );
        let m = mismatch(TensorKind::Matrix, &s, Dtype::BF16, &[256, 64]).unwrap();
        assert!(m.contains("transposed") && m.contains("[64, 256]"), "{m}");
        let m = mismatch(TensorKind::Matrix, &s, Dtype::F16, &[64, 256]).unwrap();
        assert!(m.starts_with("F16") && m.contains("expects BF16"), "{m}");
        assert_eq!(
            mismatch(TensorKind::Vector, &[vec![8]], Dtype::F32, &[8]),
            None
        );
    }

    #[test]
    fn the_router_takes_bf16_or_f32_of_its_shape_only_and_matrices_stay_bf16() {
        let s = [vec![8u64, 64]];
        for dt in [Dtype::BF16, Dtype::F32] {
            assert_eq!(mismatch(TensorKind::Router, &s, dt, &[8, 64]), None, "{dt}");
        }
        let m = mismatch(TensorKind::Router, &s, Dtype::F32, &[64, 8]).unwrap();
        assert!(
            m.contains("(transposed)") && m.contains("BF16 or F32"),
            "{m}"
        );
        let m = mismatch(TensorKind::Router, &s, Dtype::F32, &[8, 32]).unwrap();
        assert!(m.starts_with("F32 [8, 32]"), "{m}");
        assert!(mismatch(TensorKind::Router, &s, Dtype::F16, &[8, 64]).is_some());
        assert!(mismatch(TensorKind::Matrix, &s, Dtype::F32, &[8, 64]).is_some());
    }
}
