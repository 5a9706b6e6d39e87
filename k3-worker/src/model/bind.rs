//! Binding checkpoint tensors to the layer structs — the ONE place where tensor names appear.
//!
//! Binding only creates views onto the bytes a [`WeightSource`] hands out (bf16 matrices stay raw
//! bytes) and widens the small vectors to f32. Every tensor is checked before use (SPEC.md I4):
//! present in the layer run, the expected dtype, `nbytes == product(config-derived shape) ×
//! dtype size`, inside the run, and — when the source can tell (the checkpoint index) — the
//! full stored shape. A failure names the tensor, what was expected and what was found.

use k3_proto::ecbf16::CodedMatrix;
use k3_proto::Dtype;
use std::sync::Arc;

use k3_store::runtime::source::{LayerLayout, LayerRun, Region, Storage, WeightSource};

use super::attn_res::AttnResQuery;
use super::dims::{Dims, ModelError};
use super::kda::KdaWeights;
use super::mats::Mat;
use super::mla::MlaWeights;
use super::moe::{MoeWeights, SituMlp};
use crate::kernels::{bf16_bytes_to_f32, f32_bytes_to_f32};
use k3_proto::quant::{QuantKind, QuantMatrix, GROUP, SCALE_SUFFIX};

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

/// Where one tensor sits inside its layer run, checked once at bind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Byte offset inside the run.
    pub off: usize,
    /// Byte length.
    pub len: usize,
}

impl Span {
    fn of<'r>(&self, bytes: &'r [u8]) -> &'r [u8] {
        &bytes[self.off..self.off + self.len]
    }
}

/// Where one weight matrix sits inside its layer run: a bf16 tensor, an EC-BF16 coded bf16
/// tensor (SPEC.md §6.13) or an int8/int4 quantized matrix (SPEC.md §6.15) of a packed trunk
/// (`tensor` is its index in the layout, `rows` and `cols` its bound shape), or a draft trunk's
/// quantized codes and their scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MatSpan {
    Bf16(Span),
    F32(Span),
    Coded {
        span: Span,
        tensor: u32,
        rows: u32,
        cols: u32,
    },
    Quantized {
        span: Span,
        tensor: u32,
        kind: QuantKind,
        rows: u32,
        cols: u32,
    },
    Quant {
        kind: QuantKind,
        q: Span,
        s: Span,
        rows: u32,
        cols: u32,
    },
}

impl MatSpan {
    /// The matrix in this pass's run bytes. A coded or quantized matrix's header is parsed again
    /// (`O(rows)` / `O(1)`): a streamed run is new bytes each pass, and they must still be a
    /// matrix of the bound shape (a run overwritten under a broken lease is an error here, never
    /// an out-of-bounds read).
    fn of<'r>(&self, bytes: &'r [u8], layout: &LayerLayout) -> Result<Mat<'r>, ModelError> {
        let named = |tensor: u32, problem: String| {
            let name = (layout.tensors().get(tensor as usize)).map_or("?", |t| t.name.as_str());
            bind_err(name, format!("in this pass's run: {problem}"))
        };
        Ok(match *self {
            MatSpan::Bf16(sp) => Mat::Bf16(sp.of(bytes)),
            MatSpan::F32(sp) => Mat::F32(sp.of(bytes)),
            MatSpan::Coded {
                span,
                tensor,
                rows,
                cols,
            } => Mat::Coded(
                coded_of(span.of(bytes), rows as usize, cols as usize)
                    .map_err(|p| named(tensor, p.to_string()))?,
            ),
            MatSpan::Quantized {
                span,
                tensor,
                kind,
                rows,
                cols,
            } => Mat::Quant(
                quant_of(span.of(bytes), kind, rows as usize, cols as usize)
                    .map_err(|p| named(tensor, p))?,
            ),
            MatSpan::Quant {
                kind,
                q,
                s,
                rows,
                cols,
            } => Mat::Quant(
                QuantMatrix::from_parts(
                    kind,
                    rows as usize,
                    cols as usize,
                    q.of(bytes),
                    s.of(bytes),
                )
                .map_err(|e| bind_err("draft matrix", e.to_string()))?,
            ),
        })
    }
}

/// Why a tensor's bytes are not the EC-BF16 matrix its binding expects (both callers wrap it
/// with `bind_err`, which names the tensor).
#[derive(Debug, thiserror::Error)]
enum CodedProblem {
    /// Not an EC-BF16 matrix.
    #[error(transparent)]
    Codec(#[from] k3_proto::ecbf16::CodecError),
    /// Another shape.
    #[error("EC-BF16 matrix [{got_rows}, {got_cols}], expected [{rows}, {cols}]")]
    Shape {
        got_rows: usize,
        got_cols: usize,
        rows: usize,
        cols: usize,
    },
}

/// `bytes` parsed as an EC-BF16 matrix of shape `[rows, cols]`.
fn coded_of(bytes: &[u8], rows: usize, cols: usize) -> Result<CodedMatrix<'_>, CodedProblem> {
    let m = CodedMatrix::parse(bytes)?;
    if (m.rows(), m.cols()) != (rows, cols) {
        return Err(CodedProblem::Shape {
            got_rows: m.rows(),
            got_cols: m.cols(),
            rows,
            cols,
        });
    }
    Ok(m)
}

/// `bytes` parsed as a quantized matrix of `kind` and shape `[rows, cols]`.
// String error: as `coded_of`.
fn quant_of(
    bytes: &[u8],
    kind: QuantKind,
    rows: usize,
    cols: usize,
) -> Result<QuantMatrix<'_>, String> {
    let m = QuantMatrix::parse(bytes).map_err(|e| e.to_string())?;
    if (m.kind(), m.rows(), m.cols()) != (kind, rows, cols) {
        return Err(format!(
            "{} matrix [{}, {}], expected {} [{rows}, {cols}]",
            m.kind().name(),
            m.rows(),
            m.cols(),
            kind.name()
        ));
    }
    Ok(m)
}

/// Checked access to one layer run's tensors (used once per layer, at bind).
struct LayerView<'r> {
    l: usize,
    run: &'r LayerRun,
    shapes: Option<&'r dyn TensorShapes>,
    /// Accept a draft trunk's quantized matrices (a draft model only).
    quant: bool,
}

impl<'r> LayerView<'r> {
    /// The place of `layers.{l}.{suffix}`, whose shape must be one of `accept` and dtype one of
    /// `dtypes`. Returns the span, the dtype and the accepted shape that matched.
    fn get(
        &self,
        suffix: &str,
        accept: &[&[usize]],
        dtypes: &[Dtype],
    ) -> Result<(Span, Dtype, usize), ModelError> {
        let name = names::layer(self.l, suffix);
        let loc = self
            .run
            .layout
            .get(&name)
            .ok_or_else(|| bind_err(&name, format!("missing from the layer {} run", self.l)))?;
        if loc.storage != Storage::Raw {
            return Err(bind_err(
                &name,
                format!(
                    "stored {} in the layer {} run, but it is read raw (only a weight matrix \
                     other than kv_b_proj may be coded: re-run `k3-ctl pack-trunk`)",
                    loc.storage.name(),
                    self.l
                ),
            ));
        }
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
        match (off, len) {
            (Some(o), Some(n)) if o.checked_add(n).is_some_and(|end| end <= region.len()) => {
                Ok((Span { off: o, len: n }, loc.dtype, which))
            }
            _ => Err(bind_err(
                &name,
                format!(
                    "offset {} + {} bytes outside the {}-byte layer run",
                    loc.off,
                    loc.nbytes,
                    region.len()
                ),
            )),
        }
    }

    /// A bf16 matrix `[rows, cols]`.
    fn mat_bf16(&self, suffix: &str, rows: usize, cols: usize) -> Result<Span, ModelError> {
        Ok(self.get(suffix, &[&[rows, cols]], &[Dtype::BF16])?.0)
    }

    /// A weight matrix `[rows, cols]`: bf16, or — in a draft model — int8 codes `I8 [rows,
    /// cols]` or int4 codes `U8 [rows, cols/2]` with their scales under the name +
    /// [`SCALE_SUFFIX`] (`k3_proto::quant`).
    fn mat(&self, suffix: &str, rows: usize, cols: usize) -> Result<MatSpan, ModelError> {
        if let Some(coded) = self.coded(suffix, rows, cols)? {
            return Ok(coded);
        }
        if !self.quant {
            return Ok(MatSpan::Bf16(self.mat_bf16(suffix, rows, cols)?));
        }
        let half = cols / 2;
        let (span, dt, which) = self.get(
            suffix,
            &[&[rows, cols], &[rows, half]],
            &[Dtype::BF16, Dtype::I8, Dtype::U8],
        )?;
        let name = names::layer(self.l, suffix);
        let kind = match dt {
            Dtype::BF16 if which == 0 => return Ok(MatSpan::Bf16(span)),
            Dtype::BF16 => {
                return Err(bind_err(
                    &name,
                    format!("expected [{rows}, {cols}] BF16, found {} bytes", span.len),
                ))
            }
            Dtype::I8 => QuantKind::Int8,
            _ => QuantKind::Int4,
        };
        let (code_bytes, scale_bytes) = kind.sizes(rows, cols);
        if !cols.is_multiple_of(GROUP) || span.len != code_bytes {
            return Err(bind_err(
                &name,
                format!(
                    "{} codes of {} bytes do not describe [{rows}, {cols}] (columns a multiple of {GROUP})",
                    kind.name(),
                    span.len
                ),
            ));
        }
        let s_suffix = format!("{suffix}{SCALE_SUFFIX}");
        let scale_shape: &[usize] = match kind {
            QuantKind::Int8 => &[rows],
            QuantKind::Int4 => &[rows, cols / GROUP],
        };
        let (s, _, _) = self.get(&s_suffix, &[scale_shape], &[Dtype::F32])?;
        debug_assert_eq!(s.len, scale_bytes);
        let (rows, cols) = (u32::try_from(rows), u32::try_from(cols));
        let (Ok(rows), Ok(cols)) = (rows, cols) else {
            return Err(bind_err(&name, "too large a matrix".into()));
        };
        Ok(MatSpan::Quant {
            kind,
            q: span,
            s,
            rows,
            cols,
        })
    }

    /// The router `[rows, cols]`: F32 as stored (`Mat::F32`, SPEC.md §3.11), else as [`mat`]
    /// (BF16, or a draft's quantized codes).
    ///
    /// [`mat`]: LayerView::mat
    fn router(&self, suffix: &str, rows: usize, cols: usize) -> Result<MatSpan, ModelError> {
        let name = names::layer(self.l, suffix);
        match self.run.layout.get(&name).map(|t| t.dtype) {
            Some(Dtype::F32) => Ok(MatSpan::F32(
                self.get(suffix, &[&[rows, cols]], &[Dtype::F32])?.0,
            )),
            _ => self.mat(suffix, rows, cols),
        }
    }

    /// `layers.{l}.{suffix}` when it is stored EC-BF16 coded or int8/int4 quantized (`None`
    /// when raw): its header must parse and give `[rows, cols]` (and the kind its storage says),
    /// name the checkpoint tensor's recorded XXH3-64 (so a descriptor pointing at another
    /// matrix's bytes is refused here too), the checkpoint's dtype must be BF16 (and its shape
    /// `[rows, cols]`, when the index is known), and it must lie inside the run.
    fn coded(&self, suffix: &str, rows: usize, cols: usize) -> Result<Option<MatSpan>, ModelError> {
        let name = names::layer(self.l, suffix);
        let layout = &self.run.layout;
        let Some(loc) = layout.get(&name) else {
            return Ok(None);
        };
        if matches!(loc.storage, Storage::Raw) {
            return Ok(None);
        }
        let tensor = (layout.tensors().iter())
            .position(|t| t.name == name)
            .and_then(|i| u32::try_from(i).ok())
            .unwrap_or(u32::MAX);
        if loc.dtype != Dtype::BF16 {
            return Err(bind_err(
                &name,
                format!("{}, but its dtype is {}", loc.storage.name(), loc.dtype),
            ));
        }
        check_meta(self.shapes, &name, &[&[rows, cols]], Dtype::BF16)?;
        let region = self.run.region.bytes();
        let span = usize::try_from(loc.off)
            .ok()
            .zip(usize::try_from(loc.nbytes).ok())
            .filter(|(o, n)| o.checked_add(*n).is_some_and(|e| e <= region.len()))
            .map(|(off, len)| Span { off, len })
            .ok_or_else(|| {
                bind_err(
                    &name,
                    format!(
                        "offset {} + {} bytes outside the {}-byte layer run",
                        loc.off,
                        loc.nbytes,
                        region.len()
                    ),
                )
            })?;
        let source = match loc.storage.quant() {
            Some(kind) => quant_of(span.of(region), kind, rows, cols)
                .map_err(|p| bind_err(&name, p))?
                .source_xxh3(),
            None => coded_of(span.of(region), rows, cols)
                .map_err(|p| bind_err(&name, p.to_string()))?
                .raw_checksum(),
        };
        if let Some(want) = loc.source_xxh3.filter(|&w| w != source) {
            return Err(bind_err(
                &name,
                format!(
                    "its {} header was made from a tensor with xxh3 {source:016x}, but trunk.json \
                     records {want:016x} for it (a descriptor points at another matrix)",
                    loc.storage.name()
                ),
            ));
        }
        // A stored matrix's shape fits the header's u32 fields (parsed above).
        let (rows, cols) = (rows as u32, cols as u32);
        Ok(Some(match loc.storage.quant() {
            Some(kind) => MatSpan::Quantized {
                span,
                tensor,
                kind,
                rows,
                cols,
            },
            None => MatSpan::Coded {
                span,
                tensor,
                rows,
                cols,
            },
        }))
    }

    /// A small vector of `shape` widened to f32, stored as BF16 or F32 (SPEC.md §2: the release
    /// stores some vectors as F32; either width is widened exactly).
    fn vec(&self, suffix: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let (span, dt, _) = self.get(suffix, &[shape], VECTOR_DTYPES)?;
        Ok(widen(span.of(self.run.region.bytes()), dt))
    }

    /// A folded AttnRes query `norm ⊙ proj`.
    fn attn_res(&self, site: &str, e: usize) -> Result<AttnResQuery, ModelError> {
        let norm = self.vec(&format!("{site}_norm.weight"), &[e])?;
        let proj = self.vec(&format!("{site}_proj.weight"), &[1, e])?;
        Ok(fold(&norm, &proj))
    }
}

/// The float widths accepted for every small vector (norm gains, AttnRes vectors, router bias,
/// `A_log`, `dt_bias`, conv kernels, `o_norm`).
const VECTOR_DTYPES: &[Dtype] = &[Dtype::BF16, Dtype::F32];

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
// Made once per layer per pass and matched in place: a coded matrix's parsed header makes the
// variants' sizes differ, and boxing would allocate on every pass.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Attn<'a> {
    /// Kimi Delta Attention.
    Kda(KdaWeights<'a>),
    /// Gated MLA.
    Mla(MlaWeights<'a>),
}

/// The MLP half of a layer.
// As [`Attn`]: per pass, never boxed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Mlp<'a> {
    /// Dense SiTU MLP (layers `< first_k_dense_replace`).
    Dense(SituMlp<'a>),
    /// Stable LatentMoE.
    Moe(MoeWeights<'a>),
}

/// One decoder layer's weights for one pass: views onto the run's bytes and the bound layer's
/// widened vectors. Made from a [`BoundLayer`] without name look-ups or copies.
#[derive(Debug)]
pub struct LayerWeights<'a> {
    /// Folded AttnRes query before attention (unused at layer 0, still checked).
    pub self_res: &'a AttnResQuery,
    /// Folded AttnRes query before the MLP.
    pub mlp_res: &'a AttnResQuery,
    /// `input_layernorm` `[E]`.
    pub input_norm: &'a [f32],
    /// `post_attention_layernorm` `[E]`.
    pub post_norm: &'a [f32],
    /// KDA or MLA.
    pub attn: Attn<'a>,
    /// Dense MLP or MoE.
    pub mlp: Mlp<'a>,
}

/// A KDA layer's places and vectors.
#[derive(Debug)]
struct KdaBound {
    q: MatSpan,
    k: MatSpan,
    v: MatSpan,
    f_a: MatSpan,
    f_b: MatSpan,
    b: MatSpan,
    g: MatSpan,
    o: MatSpan,
    conv: [Vec<f32>; 3],
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    o_norm: Vec<f32>,
}

/// An MLA layer's places and vectors.
#[derive(Debug)]
struct MlaBound {
    q_a: MatSpan,
    q_b: MatSpan,
    kv_a: MatSpan,
    kv_b: Span,
    o: MatSpan,
    g: Option<MatSpan>,
    q_a_norm: Vec<f32>,
    kv_a_norm: Vec<f32>,
}

/// A SiTU MLP's places.
#[derive(Clone, Copy, Debug)]
struct SituBound {
    gate: MatSpan,
    up: MatSpan,
    down: MatSpan,
    width: usize,
}

impl SituBound {
    fn view<'a>(&self, b: &'a [u8], layout: &LayerLayout) -> Result<SituMlp<'a>, ModelError> {
        Ok(SituMlp {
            gate: self.gate.of(b, layout)?,
            up: self.up.of(b, layout)?,
            down: self.down.of(b, layout)?,
            width: self.width,
        })
    }
}

/// A MoE layer's places and vectors.
#[derive(Debug)]
struct MoeBound {
    router: MatSpan,
    down: MatSpan,
    up: MatSpan,
    bias: Vec<f32>,
    norm: Option<Vec<f32>>,
    shared: Option<SituBound>,
}

// Bound once per layer and kept (never moved per pass): the KDA side's dozen spans are larger
// than MLA's, and boxing them buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum AttnBound {
    Kda(KdaBound),
    Mla(MlaBound),
}

#[derive(Debug)]
enum MlpBound {
    Dense(SituBound),
    Moe(MoeBound),
}

/// One decoder layer bound ONCE: every tensor's name looked up, its dtype, size, stored shape and
/// place inside the run checked, its small vectors widened to f32 and the AttnRes queries folded.
/// Each later pass slices the run's bytes by the recorded spans ([`BoundLayer::weights`]) — no
/// name formatting, map look-up, widening or copy per token, whether the layer is resident or
/// streamed through the ring.
#[derive(Debug)]
pub struct BoundLayer {
    /// The 0-based layer.
    pub layer: usize,
    layout: Arc<LayerLayout>,
    /// Every span ends at or before this many bytes of the run.
    run_len: usize,
    self_res: AttnResQuery,
    mlp_res: AttnResQuery,
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    attn: AttnBound,
    mlp: MlpBound,
}

impl BoundLayer {
    /// Bind layer `run.layer` of a model with dims `d`. `shapes` (the checkpoint index), when
    /// given, also checks each tensor's stored shape.
    pub fn bind(
        d: &Dims,
        run: &LayerRun,
        shapes: Option<&dyn TensorShapes>,
        quant: bool,
    ) -> Result<BoundLayer, ModelError> {
        let l = run.layer;
        if l >= d.n_layers {
            return Err(ModelError::Config(format!(
                "layer run {l} outside the {} bound layers",
                d.n_layers
            )));
        }
        let v = LayerView {
            l,
            run,
            shapes,
            quant,
        };
        let e = d.hidden;
        let attn = if d.is_mla(l) {
            AttnBound::Mla(bind_mla(d, &v)?)
        } else {
            AttnBound::Kda(bind_kda(d, &v)?)
        };
        let mlp = if d.is_moe(l) {
            MlpBound::Moe(bind_moe(d, &v)?)
        } else {
            MlpBound::Dense(SituBound {
                gate: v.mat("mlp.gate_proj.weight", d.dense_inter, e)?,
                up: v.mat("mlp.up_proj.weight", d.dense_inter, e)?,
                down: v.mat("mlp.down_proj.weight", e, d.dense_inter)?,
                width: d.dense_inter,
            })
        };
        let run_len = run
            .layout
            .tensors()
            .iter()
            .filter_map(|t| usize::try_from(t.off.checked_add(t.nbytes)?).ok())
            .max()
            .unwrap_or(0)
            .min(run.region.len());
        Ok(BoundLayer {
            layer: l,
            layout: run.layout.clone(),
            run_len,
            self_res: v.attn_res("self_attention_res", e)?,
            mlp_res: v.attn_res("mlp_res", e)?,
            input_norm: v.vec("input_layernorm.weight", &[e])?,
            post_norm: v.vec("post_attention_layernorm.weight", &[e])?,
            attn,
            mlp,
        })
    }

    /// Bytes of f32 vectors this bound layer keeps (counted in the worker's memory plan).
    pub fn vector_bytes(&self) -> usize {
        let mut n = self.self_res.w.len()
            + self.mlp_res.w.len()
            + self.input_norm.len()
            + self.post_norm.len();
        n += match &self.attn {
            AttnBound::Kda(k) => {
                k.conv.iter().map(Vec::len).sum::<usize>()
                    + k.a_log.len()
                    + k.dt_bias.len()
                    + k.o_norm.len()
            }
            AttnBound::Mla(m) => m.q_a_norm.len() + m.kv_a_norm.len(),
        };
        if let MlpBound::Moe(m) = &self.mlp {
            n += m.bias.len() + m.norm.as_ref().map_or(0, Vec::len);
        }
        n * 4
    }

    /// This pass's weights: views onto `run`'s bytes at the recorded spans. `run` must be this
    /// layer's run with the layout it was bound with.
    pub fn weights<'a>(&'a self, run: &'a LayerRun) -> Result<LayerWeights<'a>, ModelError> {
        let same_layout =
            Arc::ptr_eq(&run.layout, &self.layout) || run.layout.tensors() == self.layout.tensors();
        if run.layer != self.layer || !same_layout || run.region.len() < self.run_len {
            return Err(ModelError::Config(format!(
                "layer {} was bound to another layout than the run the source returned (layer {}, {} bytes)",
                self.layer,
                run.layer,
                run.region.len()
            )));
        }
        let b = run.region.bytes();
        let lt = &*self.layout;
        let attn = match &self.attn {
            AttnBound::Kda(k) => Attn::Kda(KdaWeights {
                q_proj: k.q.of(b, lt)?,
                k_proj: k.k.of(b, lt)?,
                v_proj: k.v.of(b, lt)?,
                conv: [&k.conv[0], &k.conv[1], &k.conv[2]],
                f_a: k.f_a.of(b, lt)?,
                f_b: k.f_b.of(b, lt)?,
                a_log: &k.a_log,
                dt_bias: &k.dt_bias,
                b_proj: k.b.of(b, lt)?,
                g_proj: k.g.of(b, lt)?,
                o_norm: &k.o_norm,
                o_proj: k.o.of(b, lt)?,
            }),
            AttnBound::Mla(m) => Attn::Mla(MlaWeights {
                q_a: m.q_a.of(b, lt)?,
                q_a_norm: &m.q_a_norm,
                q_b: m.q_b.of(b, lt)?,
                kv_a: m.kv_a.of(b, lt)?,
                kv_a_norm: &m.kv_a_norm,
                kv_b: m.kv_b.of(b),
                o_proj: m.o.of(b, lt)?,
                g_proj: m.g.map(|g| g.of(b, lt)).transpose()?,
            }),
        };
        let mlp = match &self.mlp {
            MlpBound::Dense(s) => Mlp::Dense(s.view(b, lt)?),
            MlpBound::Moe(m) => Mlp::Moe(MoeWeights {
                router: m.router.of(b, lt)?,
                bias: &m.bias,
                down: m.down.of(b, lt)?,
                norm: m.norm.as_deref(),
                up: m.up.of(b, lt)?,
                shared: m.shared.map(|s| s.view(b, lt)).transpose()?,
            }),
        };
        Ok(LayerWeights {
            self_res: &self.self_res,
            mlp_res: &self.mlp_res,
            input_norm: &self.input_norm,
            post_norm: &self.post_norm,
            attn,
            mlp,
        })
    }
}

fn bind_kda(d: &Dims, v: &LayerView<'_>) -> Result<KdaBound, ModelError> {
    let (e, h, dh, k) = (d.hidden, d.kda_heads, d.kda_dim, d.conv_k);
    let p = h * dh;
    let conv = |w: &str| v.vec(&format!("self_attn.{w}_conv1d.weight"), &[p, 1, k]);
    // A_log: the release stores [head_dim] with a zero tail (SPEC.md §10 C2); the HF module
    // declares [num_heads]. Accept either; only the first H entries are used.
    let (sd, sh) = ([dh], [h]);
    let a_shapes: &[&[usize]] = if h <= dh { &[&sd, &sh] } else { &[&sh] };
    let (a_span, a_dt, _) = v.get("self_attn.A_log", a_shapes, VECTOR_DTYPES)?;
    let mut a_log = widen(a_span.of(v.run.region.bytes()), a_dt);
    a_log.truncate(h);
    Ok(KdaBound {
        q: v.mat("self_attn.q_proj.weight", p, e)?,
        k: v.mat("self_attn.k_proj.weight", p, e)?,
        v: v.mat("self_attn.v_proj.weight", p, e)?,
        conv: [conv("q")?, conv("k")?, conv("v")?],
        f_a: v.mat("self_attn.f_a_proj.weight", dh, e)?,
        f_b: v.mat("self_attn.f_b_proj.weight", p, dh)?,
        a_log,
        dt_bias: v.vec("self_attn.dt_bias", &[p])?,
        b: v.mat("self_attn.b_proj.weight", h, e)?,
        g: v.mat("self_attn.g_proj.weight", p, e)?,
        o_norm: v.vec("self_attn.o_norm.weight", &[dh])?,
        o: v.mat("self_attn.o_proj.weight", e, p)?,
    })
}

fn bind_mla(d: &Dims, v: &LayerView<'_>) -> Result<MlaBound, ModelError> {
    let (e, h) = (d.hidden, d.mla_heads);
    let g = if d.mla_gate {
        Some(v.mat("self_attn.g_proj.weight", h * d.v_head, e)?)
    } else {
        None
    };
    Ok(MlaBound {
        q_a: v.mat("self_attn.q_a_proj.weight", d.q_lora, e)?,
        q_a_norm: v.vec("self_attn.q_a_layernorm.weight", &[d.q_lora])?,
        q_b: v.mat("self_attn.q_b_proj.weight", h * (d.nope + d.rope), d.q_lora)?,
        kv_a: v.mat("self_attn.kv_a_proj_with_mqa.weight", d.kv_lora + d.rope, e)?,
        kv_a_norm: v.vec("self_attn.kv_a_layernorm.weight", &[d.kv_lora])?,
        // Always bf16: MLA applies W_UKᵀ straight from its rows (SPEC.md §3.5).
        kv_b: v.mat_bf16(
            "self_attn.kv_b_proj.weight",
            h * (d.nope + d.v_head),
            d.kv_lora,
        )?,
        o: v.mat("self_attn.o_proj.weight", e, h * d.v_head)?,
        g,
    })
}

fn bind_moe(d: &Dims, v: &LayerView<'_>) -> Result<MoeBound, ModelError> {
    let (e, ne, lat) = (d.hidden, d.n_experts, d.latent);
    let m = "block_sparse_moe";
    let norm = if d.latent_norm {
        Some(v.vec(&format!("{m}.routed_expert_norm.weight"), &[lat])?)
    } else {
        None
    };
    let sw = d.n_shared * d.moe_inter;
    let shared = if d.n_shared > 0 {
        Some(SituBound {
            gate: v.mat(&format!("{m}.shared_experts.gate_proj.weight"), sw, e)?,
            up: v.mat(&format!("{m}.shared_experts.up_proj.weight"), sw, e)?,
            down: v.mat(&format!("{m}.shared_experts.down_proj.weight"), e, sw)?,
            width: sw,
        })
    } else {
        None
    };
    Ok(MoeBound {
        router: v.router(&format!("{m}.gate.weight"), ne, e)?,
        // F32 in the release; BF16 accepted (SPEC.md §10 C5).
        bias: v.vec(&format!("{m}.gate.e_score_correction_bias"), &[ne])?,
        down: v.mat(&format!("{m}.routed_expert_down_proj.weight"), lat, e)?,
        norm,
        up: v.mat(&format!("{m}.routed_expert_up_proj.weight"), e, lat)?,
        shared,
    })
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

/// A model-level small vector of `shape`, stored as BF16 or F32, widened exactly. The width is
/// the index's dtype when known, else told apart by the byte length (the two differ by 2×).
fn model_vec(
    source: &dyn WeightSource,
    shapes: Option<&dyn TensorShapes>,
    name: &str,
    shape: &[usize],
) -> Result<Vec<f32>, ModelError> {
    let r = source.model_tensor(name)?;
    let dt = match shapes.and_then(|s| s.meta(name)) {
        Some((dt, _)) => dt,
        None if nbytes_of(shape, Dtype::F32) == Some(r.len() as u64) => Dtype::F32,
        None => Dtype::BF16,
    };
    if !VECTOR_DTYPES.contains(&dt) {
        return Err(bind_err(
            name,
            format!("expected dtype BF16 or F32, found {dt}"),
        ));
    }
    let want = nbytes_of(shape, dt);
    if want != Some(r.len() as u64) {
        return Err(bind_err(
            name,
            format!(
                "expected {} {dt} = {want:?} bytes, found {} bytes",
                fmt_shape(shape),
                r.len()
            ),
        ));
    }
    check_meta(shapes, name, &[shape], dt)?;
    Ok(widen(r.bytes(), dt))
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
        let final_norm = model_vec(source, shapes, names::FINAL_NORM, &[e])?;
        let rn = model_vec(source, shapes, names::OUT_RES_NORM, &[e])?;
        let rp = model_vec(source, shapes, names::OUT_RES_PROJ, &[1, e])?;
        Ok(Globals {
            embed,
            lm_head,
            final_norm,
            out_res: fold(&rn, &rp),
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
