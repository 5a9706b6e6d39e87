//! Binding checkpoint tensors to the layer structs — the ONE place where tensor names appear.
//!
//! Binding only creates views onto the bytes a [`WeightSource`] hands out (bf16 matrices stay raw
//! bytes) and widens the small vectors to f32. Every tensor is checked before use (SPEC.md I4):
//! present in the layer run, the expected dtype, `nbytes == product(config-derived shape) ×
//! dtype size`, inside the run, and — when the source can tell (the checkpoint index) — the
//! full stored shape. A failure names the tensor, what was expected and what was found.

use k3_proto::Dtype;
use k3_store::source::{LayerRun, Region, WeightSource};

use super::attn_res::AttnResQuery;
use super::kda::KdaWeights;
use super::mla::MlaWeights;
use super::moe::{MoeWeights, SituMlp};
use super::{Dims, ModelError};
use crate::kernels::{bf16_bytes_to_f32, f32_bytes_to_f32};

/// Full stored metadata of checkpoint tensors, when a source knows it (the checkpoint index).
pub trait TensorShapes: Send + Sync {
    /// `(dtype, shape)` of the tensor `name`, or `None` if the checkpoint has no such tensor.
    fn meta(&self, name: &str) -> Option<(Dtype, Vec<u64>)>;
}

/// Tensor names (SPEC.md §2), from the proto crate.
mod names {
    pub use k3_proto::names::{EMBED, FINAL_NORM, LM_HEAD, OUT_RES_NORM, OUT_RES_PROJ};

    /// `language_model.model.layers.{l}.{suffix}`.
    pub fn layer(l: usize, suffix: &str) -> String {
        k3_proto::names::layer_tensor(l, suffix)
    }
}

fn bind_err(name: &str, problem: String) -> ModelError {
    ModelError::Bind {
        name: name.to_string(),
        problem,
    }
}

fn fmt_shape(s: &[usize]) -> String {
    format!("{s:?}")
}

fn nbytes_of(shape: &[usize], dt: Dtype) -> Option<u64> {
    shape
        .iter()
        .try_fold(dt.size() as u64, |a, &d| a.checked_mul(d as u64))
}

/// Check the index's stored dtype and shape for `name`, when the source exposes it.
fn check_meta(
    shapes: Option<&dyn TensorShapes>,
    name: &str,
    accept: &[&[usize]],
    dt: Dtype,
) -> Result<(), ModelError> {
    let Some(shapes) = shapes else { return Ok(()) };
    let Some((idt, ishape)) = shapes.meta(name) else {
        return Err(bind_err(name, "not in the checkpoint index".into()));
    };
    if idt != dt {
        return Err(bind_err(
            name,
            format!("index dtype {idt} differs from the source's {dt}"),
        ));
    }
    let matches = |s: &&[usize]| {
        s.len() == ishape.len() && s.iter().zip(&ishape).all(|(&a, &b)| a as u64 == b)
    };
    if !accept.iter().any(matches) {
        let want: Vec<String> = accept.iter().map(|s| fmt_shape(s)).collect();
        return Err(bind_err(
            name,
            format!(
                "expected shape {} {dt}, found {ishape:?}",
                want.join(" or ")
            ),
        ));
    }
    Ok(())
}

/// Checked access to one layer run's tensors.
struct LayerView<'r> {
    l: usize,
    run: &'r LayerRun,
    shapes: Option<&'r dyn TensorShapes>,
}

impl<'r> LayerView<'r> {
    /// The bytes of `layers.{l}.{suffix}`, whose shape must be one of `accept` and dtype one of
    /// `dtypes`. Returns the bytes, the dtype and the accepted shape that matched.
    fn get(
        &self,
        suffix: &str,
        accept: &[&[usize]],
        dtypes: &[Dtype],
    ) -> Result<(&'r [u8], Dtype, usize), ModelError> {
        let name = names::layer(self.l, suffix);
        let loc = self
            .run
            .layout
            .get(&name)
            .ok_or_else(|| bind_err(&name, format!("missing from the layer {} run", self.l)))?;
        if !dtypes.contains(&loc.dtype) {
            let want: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
            return Err(bind_err(
                &name,
                format!("expected dtype {}, found {}", want.join(" or "), loc.dtype),
            ));
        }
        let which = accept
            .iter()
            .position(|s| nbytes_of(s, loc.dtype) == Some(loc.nbytes))
            .ok_or_else(|| {
                let want: Vec<String> = accept
                    .iter()
                    .map(|s| {
                        format!(
                            "{} {} = {} bytes",
                            fmt_shape(s),
                            loc.dtype,
                            nbytes_of(s, loc.dtype).map_or("overflow".into(), |b| b.to_string())
                        )
                    })
                    .collect();
                bind_err(
                    &name,
                    format!("expected {}, found {} bytes", want.join(" or "), loc.nbytes),
                )
            })?;
        check_meta(self.shapes, &name, &accept[which..=which], loc.dtype)?;
        let region = &self.run.region;
        let off = usize::try_from(loc.off).ok();
        let len = usize::try_from(loc.nbytes).ok();
        let bytes = match (off, len) {
            (Some(o), Some(n)) if o.checked_add(n).is_some_and(|end| end <= region.len()) => {
                &region.bytes()[o..o + n]
            }
            _ => {
                return Err(bind_err(
                    &name,
                    format!(
                        "offset {} + {} bytes outside the {}-byte layer run",
                        loc.off,
                        loc.nbytes,
                        region.len()
                    ),
                ))
            }
        };
        Ok((bytes, loc.dtype, which))
    }

    /// A bf16 matrix `[rows, cols]` as raw bytes.
    fn mat(&self, suffix: &str, rows: usize, cols: usize) -> Result<&'r [u8], ModelError> {
        Ok(self.get(suffix, &[&[rows, cols]], &[Dtype::BF16])?.0)
    }

    /// A small vector of `shape` widened to f32 (stored as one of `dtypes`).
    fn vec(&self, suffix: &str, shape: &[usize], dtypes: &[Dtype]) -> Result<Vec<f32>, ModelError> {
        let (b, dt, _) = self.get(suffix, &[shape], dtypes)?;
        Ok(widen(b, dt))
    }

    /// A folded AttnRes query `norm ⊙ proj`.
    fn attn_res(&self, site: &str, e: usize) -> Result<AttnResQuery, ModelError> {
        let norm = self.vec(&format!("{site}_norm.weight"), &[e], &[Dtype::BF16])?;
        let proj = self.vec(&format!("{site}_proj.weight"), &[1, e], &[Dtype::BF16])?;
        Ok(fold(&norm, &proj))
    }
}

fn widen(b: &[u8], dt: Dtype) -> Vec<f32> {
    match dt {
        Dtype::BF16 => bf16_bytes_to_f32(b),
        Dtype::F32 => f32_bytes_to_f32(b),
        // Only BF16/F32 are ever accepted for vectors by the callers above.
        _ => unreachable!("vector dtype {dt} not accepted by the binder"),
    }
}

fn fold(norm: &[f32], proj: &[f32]) -> AttnResQuery {
    AttnResQuery {
        w: norm.iter().zip(proj).map(|(a, b)| a * b).collect(),
    }
}

/// The attention half of a layer.
#[derive(Debug)]
pub enum Attn<'a> {
    /// Kimi Delta Attention.
    Kda(KdaWeights<'a>),
    /// Gated MLA.
    Mla(MlaWeights<'a>),
}

/// The MLP half of a layer.
#[derive(Debug)]
pub enum Mlp<'a> {
    /// Dense SiTU MLP (layers `< first_k_dense_replace`).
    Dense(SituMlp<'a>),
    /// Stable LatentMoE.
    Moe(MoeWeights<'a>),
}

/// One decoder layer, bound.
#[derive(Debug)]
pub struct LayerWeights<'a> {
    /// Folded AttnRes query before attention (unused at layer 0, still checked).
    pub self_res: AttnResQuery,
    /// Folded AttnRes query before the MLP.
    pub mlp_res: AttnResQuery,
    /// `input_layernorm` `[E]`.
    pub input_norm: Vec<f32>,
    /// `post_attention_layernorm` `[E]`.
    pub post_norm: Vec<f32>,
    /// KDA or MLA.
    pub attn: Attn<'a>,
    /// Dense MLP or MoE.
    pub mlp: Mlp<'a>,
}

impl<'a> LayerWeights<'a> {
    /// Bind layer `run.layer` of a model with dims `d`. `shapes` (the checkpoint index), when
    /// given, also checks each tensor's stored shape.
    pub fn bind(
        d: &Dims,
        run: &'a LayerRun,
        shapes: Option<&'a dyn TensorShapes>,
    ) -> Result<LayerWeights<'a>, ModelError> {
        let l = run.layer;
        if l >= d.n_layers {
            return Err(ModelError::Config(format!(
                "layer run {l} outside the {} bound layers",
                d.n_layers
            )));
        }
        let v = LayerView { l, run, shapes };
        let e = d.hidden;
        let attn = if d.is_mla(l) {
            bind_mla(d, &v)?
        } else {
            bind_kda(d, &v)?
        };
        let mlp = if d.is_moe(l) {
            bind_moe(d, &v)?
        } else {
            Mlp::Dense(SituMlp {
                gate: v.mat("mlp.gate_proj.weight", d.dense_inter, e)?,
                up: v.mat("mlp.up_proj.weight", d.dense_inter, e)?,
                down: v.mat("mlp.down_proj.weight", e, d.dense_inter)?,
                width: d.dense_inter,
            })
        };
        Ok(LayerWeights {
            self_res: v.attn_res("self_attention_res", e)?,
            mlp_res: v.attn_res("mlp_res", e)?,
            input_norm: v.vec("input_layernorm.weight", &[e], &[Dtype::BF16])?,
            post_norm: v.vec("post_attention_layernorm.weight", &[e], &[Dtype::BF16])?,
            attn,
            mlp,
        })
    }
}

fn bind_kda<'a>(d: &Dims, v: &LayerView<'a>) -> Result<Attn<'a>, ModelError> {
    let (e, h, dh, k) = (d.hidden, d.kda_heads, d.kda_dim, d.conv_k);
    let p = h * dh;
    let f32_ = &[Dtype::F32][..];
    let conv = |w: &str| v.vec(&format!("self_attn.{w}_conv1d.weight"), &[p, 1, k], f32_);
    // A_log: the release stores [head_dim] with a zero tail (SPEC.md §10 C2); the HF module
    // declares [num_heads]. Accept either; only the first H entries are used.
    let (sd, sh) = ([dh], [h]);
    let a_shapes: &[&[usize]] = if h <= dh { &[&sd, &sh] } else { &[&sh] };
    let (a_bytes, a_dt, _) = v.get("self_attn.A_log", a_shapes, f32_)?;
    let mut a_log = widen(a_bytes, a_dt);
    a_log.truncate(h);
    Ok(Attn::Kda(KdaWeights {
        q_proj: v.mat("self_attn.q_proj.weight", p, e)?,
        k_proj: v.mat("self_attn.k_proj.weight", p, e)?,
        v_proj: v.mat("self_attn.v_proj.weight", p, e)?,
        conv: [conv("q")?, conv("k")?, conv("v")?],
        f_a: v.mat("self_attn.f_a_proj.weight", dh, e)?,
        f_b: v.mat("self_attn.f_b_proj.weight", p, dh)?,
        a_log,
        dt_bias: v.vec("self_attn.dt_bias", &[p], f32_)?,
        b_proj: v.mat("self_attn.b_proj.weight", h, e)?,
        g_proj: v.mat("self_attn.g_proj.weight", p, e)?,
        o_norm: v.vec("self_attn.o_norm.weight", &[dh], f32_)?,
        o_proj: v.mat("self_attn.o_proj.weight", e, p)?,
    }))
}

fn bind_mla<'a>(d: &Dims, v: &LayerView<'a>) -> Result<Attn<'a>, ModelError> {
    let (e, h) = (d.hidden, d.mla_heads);
    let bf = &[Dtype::BF16][..];
    let kv_b = v.mat(
        "self_attn.kv_b_proj.weight",
        h * (d.nope + d.v_head),
        d.kv_lora,
    )?;
    let g_proj = if d.mla_gate {
        Some(v.mat("self_attn.g_proj.weight", h * d.v_head, e)?)
    } else {
        None
    };
    Ok(Attn::Mla(MlaWeights {
        q_a: v.mat("self_attn.q_a_proj.weight", d.q_lora, e)?,
        q_a_norm: v.vec("self_attn.q_a_layernorm.weight", &[d.q_lora], bf)?,
        q_b: v.mat("self_attn.q_b_proj.weight", h * (d.nope + d.rope), d.q_lora)?,
        kv_a: v.mat("self_attn.kv_a_proj_with_mqa.weight", d.kv_lora + d.rope, e)?,
        kv_a_norm: v.vec("self_attn.kv_a_layernorm.weight", &[d.kv_lora], bf)?,
        kv_b,
        w_uk_t: MlaWeights::transpose_uk(d, kv_b),
        o_proj: v.mat("self_attn.o_proj.weight", e, h * d.v_head)?,
        g_proj,
    }))
}

fn bind_moe<'a>(d: &Dims, v: &LayerView<'a>) -> Result<Mlp<'a>, ModelError> {
    let (e, ne, lat) = (d.hidden, d.n_experts, d.latent);
    let m = "block_sparse_moe";
    let norm = if d.latent_norm {
        Some(v.vec(
            &format!("{m}.routed_expert_norm.weight"),
            &[lat],
            &[Dtype::BF16],
        )?)
    } else {
        None
    };
    let sw = d.n_shared * d.moe_inter;
    let shared = if d.n_shared > 0 {
        Some(SituMlp {
            gate: v.mat(&format!("{m}.shared_experts.gate_proj.weight"), sw, e)?,
            up: v.mat(&format!("{m}.shared_experts.up_proj.weight"), sw, e)?,
            down: v.mat(&format!("{m}.shared_experts.down_proj.weight"), e, sw)?,
            width: sw,
        })
    } else {
        None
    };
    Ok(Mlp::Moe(MoeWeights {
        router: v.mat(&format!("{m}.gate.weight"), ne, e)?,
        // F32 in the release; BF16 accepted (SPEC.md §10 C5).
        bias: v.vec(
            &format!("{m}.gate.e_score_correction_bias"),
            &[ne],
            &[Dtype::F32, Dtype::BF16],
        )?,
        down: v.mat(&format!("{m}.routed_expert_down_proj.weight"), lat, e)?,
        norm,
        up: v.mat(&format!("{m}.routed_expert_up_proj.weight"), e, lat)?,
        shared,
    }))
}

/// The model-level tensors, resident for the whole run.
#[derive(Debug)]
pub struct Globals {
    /// `embed_tokens` `[V, E]` bf16.
    pub embed: Region,
    /// `lm_head` `[V, E]` bf16.
    pub lm_head: Region,
    /// Final `norm` `[E]`.
    pub final_norm: Vec<f32>,
    /// Output AttnRes query.
    pub out_res: AttnResQuery,
}

/// A model-level bf16 tensor of `shape` (sources hand these out as bare regions: the byte length
/// is checked here, the stored dtype and shape via `shapes` when known).
fn model_bf16(
    source: &dyn WeightSource,
    shapes: Option<&dyn TensorShapes>,
    name: &str,
    shape: &[usize],
) -> Result<Region, ModelError> {
    let r = source.model_tensor(name)?;
    let want = nbytes_of(shape, Dtype::BF16);
    if want != Some(r.len() as u64) {
        return Err(bind_err(
            name,
            format!(
                "expected {} BF16 = {want:?} bytes, found {} bytes",
                fmt_shape(shape),
                r.len()
            ),
        ));
    }
    check_meta(shapes, name, &[shape], Dtype::BF16)?;
    Ok(r)
}

impl Globals {
    /// Bind and check the five model-level tensors.
    pub fn bind(
        d: &Dims,
        source: &dyn WeightSource,
        shapes: Option<&dyn TensorShapes>,
    ) -> Result<Globals, ModelError> {
        let (v, e) = (d.vocab, d.hidden);
        let embed = model_bf16(source, shapes, names::EMBED, &[v, e])?;
        let lm_head = model_bf16(source, shapes, names::LM_HEAD, &[v, e])?;
        let norm = model_bf16(source, shapes, names::FINAL_NORM, &[e])?;
        let rn = model_bf16(source, shapes, names::OUT_RES_NORM, &[e])?;
        let rp = model_bf16(source, shapes, names::OUT_RES_PROJ, &[1, e])?;
        Ok(Globals {
            embed,
            lm_head,
            final_norm: bf16_bytes_to_f32(norm.bytes()),
            out_res: fold(
                &bf16_bytes_to_f32(rn.bytes()),
                &bf16_bytes_to_f32(rp.bytes()),
            ),
        })
    }
}

impl TensorShapes for k3_proto::safetensors::CheckpointIndex {
    fn meta(&self, name: &str) -> Option<(Dtype, Vec<u64>)> {
        self.get(name).map(|t| (t.dtype, t.shape().to_vec()))
    }
}

/// The stored dtype and shape of every non-expert tensor of the bound layers and the model-level
/// tensors, copied out of a [`k3_proto::safetensors::CheckpointIndex`] so the (large, at full
/// scale ~100 MB) index itself can be dropped before the run.
#[derive(Debug, Default)]
pub struct ShapeTable {
    map: std::collections::HashMap<String, (Dtype, Vec<u64>)>,
}

impl ShapeTable {
    /// Keep the model-level tensors and the trunk tensors of layers `< n_layers`.
    pub fn from_index(index: &k3_proto::safetensors::CheckpointIndex, n_layers: usize) -> Self {
        use k3_proto::names::{classify, TensorClass};
        let map = index
            .iter()
            .filter(|t| match classify(t.name) {
                TensorClass::Model => true,
                TensorClass::Trunk { layer } => layer < n_layers,
                _ => false,
            })
            .map(|t| (t.name.to_string(), (t.dtype, t.shape().to_vec())))
            .collect();
        ShapeTable { map }
    }

    /// Tensors held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

impl TensorShapes for ShapeTable {
    fn meta(&self, name: &str) -> Option<(Dtype, Vec<u64>)> {
        self.map.get(name).cloned()
    }
}
