//! Per-sequence state carried between forward calls (SPEC.md §3.10): the KDA recurrent state
//! and conv histories per KDA layer, the MLA latent cache per MLA layer. Nothing else — no
//! positions, no AttnRes state.

use super::attn_res::ResBufs;
pub use super::dims::KEEP_BUFFERS_MAX_POSITIONS;
use super::dims::{Dims, ModelError};
use super::kda::KdaBufs;
pub use super::kda::{KdaJournal, KdaState};
use super::mats::{copy_into, Mat};
use super::mla::MlaBufs;
pub use super::mla::MlaCache;
use super::moe::{CombineBufs, ExpertBufs, MlpBufs, RouteBufs, Routing, Slots, UpSide};
use crate::kernels::ROW_CHUNK;
use k3_proto::ecbf16::CodedMatrix;

/// Per-layer state.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    /// A KDA layer.
    Kda(KdaState),
    /// An MLA layer.
    Mla(MlaCache),
}

/// Activation buffers of the top-level loop, owned by the sequence and reused by every forward
/// call (their contents never carry meaning from one call to the next).
#[derive(Clone, Debug, Default)]
pub struct Scratch {
    /// The AttnRes bank: one `[n, E]` entry per block boundary passed in this call.
    pub bank: Vec<Vec<f32>>,
    /// The pending partial sum `[n, E]`.
    pub pend: Vec<f32>,
    /// Every other temporary of a forward pass.
    pub work: Box<Work>,
    /// The ids of a pass over several sequences, in turn.
    pub ids: Vec<u32>,
}

/// The temporaries of a forward pass, by stage. Each buffer grows to the largest pass it has
/// served and is then reused, so a decode step allocates nothing per layer (ARCHITECTURE.md,
/// "Run state").
#[derive(Clone, Debug, Default)]
pub struct Work {
    /// A layer's aggregated input `[n, E]` (attention side, then MLP side).
    pub(crate) x: Vec<f32>,
    /// `x` normalised.
    pub(crate) xn: Vec<f32>,
    /// The attention output `[n, E]`.
    pub(crate) a: Vec<f32>,
    /// The MLP output `[n, E]`.
    pub(crate) m: Vec<f32>,
    pub(crate) res: ResBufs,
    /// The attention's temporaries.
    pub(crate) attn: AttnBufs,
    /// The MLP side's temporaries.
    pub(crate) ffn: FfnBufs,
}

/// The attention's temporaries (a layer is KDA or MLA).
#[derive(Clone, Debug, Default)]
pub(crate) struct AttnBufs {
    pub(crate) kda: KdaBufs,
    pub(crate) mla: MlaBufs,
}

/// The MLP side's temporaries: the dense or shared experts, the router, the routed experts.
#[derive(Clone, Debug, Default)]
pub(crate) struct FfnBufs {
    pub(crate) mlp: MlpBufs,
    pub(crate) route: RouteBufs,
    pub(crate) routing: Routing,
    /// The layer's distinct experts.
    pub(crate) uniq: Vec<u32>,
    /// The latent input of the routed experts.
    pub(crate) z: Vec<f32>,
    /// The shared experts' output.
    pub(crate) shared: Vec<f32>,
    pub(crate) experts: ExpertBufs,
    pub(crate) slots: Slots,
    pub(crate) combine: CombineBufs,
    /// The layer's up-projection and latent norm, held while its streamed run is given back
    /// before the expert wait.
    pub(crate) up: UpCopy,
}

/// A copy of a MoE layer's [`UpSide`]: the bytes its run held, so the run can be given back to
/// a streaming source before the routed experts arrive and the ring can read the next layer into
/// it meanwhile (ARCHITECTURE.md, "Run state"). The copy is bit for bit, so the output is the
/// same as reading the run. Its allocations are reused like every stage buffer's.
#[derive(Clone, Debug, Default)]
pub(crate) struct UpCopy {
    /// The up-projection's bf16 bytes, its EC-BF16 code, or a draft's quantized codes.
    bytes: Vec<u8>,
    /// A draft's quantized scales (empty otherwise).
    scales: Vec<u8>,
    /// How `bytes` store the matrix.
    form: UpForm,
    /// The latent norm, when the layer has one.
    norm: Option<Vec<f32>>,
}

/// What an [`UpCopy`] holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum UpForm {
    /// Raw bf16.
    #[default]
    Bf16,
    /// EC-BF16 coded bf16 (SPEC.md §6.13), copied as coded: fewer bytes than raw, and the
    /// kernels multiply it to the same bits.
    Coded,
    /// f32 (`Mat::F32`; the binder gives the up-projection as bf16, coded or codes, so this
    /// only keeps the copy faithful to any [`Mat`]).
    F32,
    /// Quantized codes (`bytes`) and scales (`scales`) of `[rows, cols]`.
    Quant(k3_proto::quant::QuantKind, usize, usize),
}

impl UpCopy {
    /// Bytes of a copy of a MoE layer's up side: the bf16 up-projection `[E, latent]` and the
    /// latent norm (a coded copy is smaller).
    pub(crate) fn bytes_for(d: &Dims) -> u64 {
        2 * (d.hidden * d.latent) as u64 + 4 * d.latent as u64
    }

    /// Copy `side` in, reusing the allocations.
    pub(crate) fn hold(&mut self, side: &UpSide<'_>) {
        let (bytes, scales, form) = match side.up {
            Mat::Bf16(b) => (b, &[][..], UpForm::Bf16),
            Mat::F32(b) => (b, &[][..], UpForm::F32),
            Mat::Coded(m) => (m.bytes(), &[][..], UpForm::Coded),
            Mat::Quant(m) => (
                m.codes(),
                m.scales(),
                UpForm::Quant(m.kind(), m.rows(), m.cols()),
            ),
        };
        copy_into(&mut self.bytes, bytes);
        copy_into(&mut self.scales, scales);
        self.form = form;
        match (side.norm, &mut self.norm) {
            (Some(n), Some(v)) => copy_into(v, n),
            (Some(n), none) => *none = Some(n.to_vec()),
            (None, v) => *v = None,
        }
    }

    /// The held weights. A coded copy is parsed again (`O(rows)`; the bytes parsed when the
    /// layer was bound, so an error here means the copy is not what was held).
    pub(crate) fn side(&self) -> Result<UpSide<'_>, ModelError> {
        Ok(UpSide {
            up: match self.form {
                UpForm::Bf16 => Mat::Bf16(&self.bytes),
                UpForm::F32 => Mat::F32(&self.bytes),
                UpForm::Coded => Mat::Coded(CodedMatrix::parse(&self.bytes).map_err(|e| {
                    ModelError::Config(format!("the held coded up-projection: {e}"))
                })?),
                UpForm::Quant(kind, rows, cols) => Mat::Quant(
                    k3_proto::quant::QuantMatrix::from_parts(
                        kind,
                        rows,
                        cols,
                        &self.bytes,
                        &self.scales,
                    )
                    .map_err(|e| ModelError::Config(format!("the held up-projection: {e}")))?,
                ),
            },
            norm: self.norm.as_deref(),
        })
    }
}

/// The kernels' buffers in a pass (`kernels::with_buffer`): the largest call's transients per
/// stage (its rearranged activations and, over several positions, a rows-major chunk of its
/// output; the routed experts' calls together over at most `rows · top_k` users) and what every
/// thread keeps between calls.
struct KernelCalls {
    attention: u64,
    mlp: u64,
    head: u64,
    kept: u64,
}

impl KernelCalls {
    fn of(d: &Dims, p: &PassShape) -> KernelCalls {
        let n = p.rows;
        let many = n > 1;
        // `(rows, cols)` of every product a stage runs over the pass's positions.
        let e = d.hidden;
        let (pk, h, dh) = (d.kda_heads * d.kda_dim, d.kda_heads, d.kda_dim);
        let (qw, hv, lw) = (d.nope + d.rope, d.mla_heads * d.v_head, d.latent_width());
        let mut attn = vec![];
        if d.n_kda() > 0 {
            attn.extend([(pk, e), (h, e), (dh, e), (pk, dh), (e, pk)]);
        }
        if d.n_mla() > 0 {
            attn.extend([
                (d.q_lora, e),
                (d.mla_heads * qw, d.q_lora),
                (lw, e),
                (hv, e),
                (e, hv),
                (d.v_head, d.kv_lora),
            ]);
        }
        let shared = d.n_shared * d.moe_inter;
        let mut mlp = vec![
            (d.n_experts, e),
            (d.latent, e),
            (e, d.latent),
            (shared, e),
            (e, shared),
        ];
        if d.first_k_dense > 0 {
            mlp.extend([(d.dense_inter, e), (e, d.dense_inter)]);
        }
        // What a call needs beyond the buffers each thread keeps (those are `kept` below).
        let keep = crate::kernels::KEEP_MAX_FLOATS;
        let call = |(rows, cols): (usize, usize), n: usize| -> usize {
            let chunk = if n > 1 { ROW_CHUNK * n.min(rows) } else { 0 };
            (n * cols).saturating_sub(keep) + chunk.saturating_sub(keep)
        };
        let most = |calls: &[(usize, usize)]| calls.iter().map(|&c| call(c, n)).max().unwrap_or(0);
        let users = n * d.top_k;
        let experts = (users * (d.latent + d.moe_inter) * 2).saturating_sub(keep);
        let head = call((d.vocab, e), p.logits_rows);
        let all = attn.iter().chain(&mlp);
        let split = all
            .clone()
            .map(|&(_, c)| n * c)
            .max()
            .unwrap_or(0)
            .max(users * d.moe_inter);
        // A multi-token product's rows-major chunk: `ROW_CHUNK` rows × its tokens.
        let rows_major = if many {
            ROW_CHUNK * n.max(p.logits_rows)
        } else {
            0
        };
        let per_thread =
            crate::kernels::kept_bytes_for(split, rows_major, d.kv_lora.max(e), p.context);
        KernelCalls {
            attention: 4 * most(&attn) as u64,
            mlp: 4 * most(&mlp).max(experts) as u64,
            head: 4 * head as u64,
            kept: (p.threads as u64 + 1) * per_thread,
        }
    }
}

/// The shape of a forward pass, for the memory its buffers reach ([`Work::bytes_for`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassShape {
    /// Positions the pass runs (the prefill chunk; 1 in decode; 1 + K in a verify pass).
    pub rows: usize,
    /// Logits rows it returns (1, or `rows` for a verify pass).
    pub logits_rows: usize,
    /// Positions the sequence's MLA caches are planned for.
    pub context: usize,
    /// A journaled (verify) pass: each KDA head runs on a copy of its state.
    pub journaled: bool,
    /// Compute threads (the pool's, besides the calling thread).
    pub threads: usize,
}

impl Work {
    /// The most bytes a forward pass of shape `p` holds in its temporaries at once: the layer
    /// input, its norm, the attention and MLP outputs, the residual bank and pending sum
    /// (`Scratch`), then the larger of the attention stage, the MLP stage and the lm_head
    /// (each with the largest kernel call's transient buffers), the router lookahead's buffers
    /// and every thread's kept kernel buffers. Each term is stated by the buffer's owner; a
    /// pass of more than [`KEEP_BUFFERS_MAX_POSITIONS`] positions frees each stage's buffers
    /// when the stage is done, a smaller one keeps them all (both attention kinds, the dense
    /// and the MoE side), and the plan counts what each keeps.
    pub fn bytes_for(d: &Dims, p: &PassShape) -> u64 {
        let (n, e) = (p.rows as u64, d.hidden as u64);
        let nb = d.n_layers.div_ceil(d.block) as u64;
        let bank = nb * (4 * n * e + size_of::<Vec<f32>>() as u64);
        let base = 4 * (5 * n * e) + bank + ResBufs::bytes_for(d, nb as usize);
        let kept = p.rows <= KEEP_BUFFERS_MAX_POSITIONS;
        let combine = |a: u64, b: u64| if kept { a + b } else { a.max(b) };
        let combine = &combine;
        let (kda, mla) = (d.n_kda() > 0, d.n_mla() > 0);
        let attention = combine(
            if kda {
                super::kda::KdaWeights::bufs_bytes_for(d, p.rows, p.journaled)
            } else {
                0
            },
            if mla {
                super::mla::MlaWeights::bufs_bytes_for(d, p.rows)
            } else {
                0
            },
        );
        let (dense, moe) = (d.first_k_dense > 0, d.n_layers > d.first_k_dense);
        let shared = d.n_shared * d.moe_inter;
        let moe_bytes = RouteBufs::bytes_for(d, p.rows)
            + Routing::bytes_for(d, p.rows)
            + 4 * (p.rows * d.top_k).min(d.n_experts) as u64
            + 4 * n * (d.latent as u64 + e)
            + ExpertBufs::bytes_for(d, p.rows)
            + Slots::bytes_for(d, p.rows)
            + CombineBufs::bytes_for(d, p.rows)
            + UpCopy::bytes_for(d);
        let mlp_width = match (dense, moe) {
            (true, true) if kept => d.dense_inter.max(shared),
            (true, _) => d.dense_inter,
            _ => shared,
        };
        let mlp = MlpBufs::bytes_for(p.rows, mlp_width) + if moe { moe_bytes } else { 0 };
        let head = 4 * (p.logits_rows * d.vocab) as u64;
        let k = KernelCalls::of(d, p);
        let stage = if kept {
            // Every stage's buffers stay; one kernel call's transients at a time.
            attention + mlp + k.attention.max(k.mlp).max(head + k.head)
        } else {
            // Each stage's buffers go when it is done.
            (attention + k.attention)
                .max(mlp + k.mlp)
                .max(head + k.head)
        };
        base + stage + k.kept + super::feed::FeedStore::bytes_for(d, p.rows)
    }

    /// After the attention of a pass of `n` positions: free its buffers if the pass is large.
    pub(crate) fn attention_done(&mut self, n: usize) {
        if n > KEEP_BUFFERS_MAX_POSITIONS {
            self.attn = AttnBufs::default();
        }
    }

    /// After the MLP of a pass of `n` positions: free its buffers if the pass is large.
    pub(crate) fn mlp_done(&mut self, n: usize) {
        if n > KEEP_BUFFERS_MAX_POSITIONS {
            self.ffn = FfnBufs::default();
        }
    }

    /// At the end of a pass of `n` positions: free everything if the pass was large.
    pub(crate) fn pass_done(&mut self, n: usize) {
        if n > KEEP_BUFFERS_MAX_POSITIONS {
            *self = Work::default();
        }
    }
}

impl PartialEq for Scratch {
    /// Buffers are not state: two sequences in the same state compare equal whatever their
    /// scratch holds.
    fn eq(&self, _: &Scratch) -> bool {
        true
    }
}

/// The journal of a speculative verify pass: where it started and, per KDA layer, what rolling
/// back needs. Its buffers are reused from one pass to the next.
#[derive(Clone, Debug, Default)]
pub struct Journal {
    /// A journaled pass is in progress (set by [`SeqState::begin_journal`]).
    pub active: bool,
    /// The position the pass started at.
    pub pos0: usize,
    /// One entry per layer (MLA layers leave theirs empty: truncating the cache is enough).
    pub kda: Vec<KdaJournal>,
    /// The rollback's per-head temporaries.
    pub tmp: Vec<f32>,
}

impl Journal {
    /// The journal entry layer `l`'s forward must fill, when a journaled pass is running.
    pub fn layer(&mut self, l: usize) -> Option<&mut KdaJournal> {
        if self.active {
            self.kda.get_mut(l)
        } else {
            None
        }
    }
}

impl Journal {
    /// Bytes the journal of a verify pass of `rows` positions holds: every KDA layer's entry and
    /// the rollback's per-head temporaries.
    pub fn bytes_for(d: &Dims, rows: usize) -> u64 {
        d.n_kda() as u64 * KdaJournal::bytes_for(d, rows)
            + (d.n_layers * size_of::<KdaJournal>()) as u64
            + 4 * 2 * (d.kda_heads * d.kda_dim) as u64
    }
}

impl PartialEq for Journal {
    /// Buffers, not state (see [`Scratch`]).
    fn eq(&self, _: &Journal) -> bool {
        true
    }
}

/// Everything one sequence carries between forward calls.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqState {
    /// One entry per bound layer.
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub pos: usize,
    /// Positions the MLA caches were sized for (the request's prompt + generation).
    pub capacity: usize,
    /// Reused activation buffers.
    pub scratch: Scratch,
    /// The rollback journal of a speculative verify pass.
    pub journal: Journal,
}

impl SeqState {
    /// Fresh state for a sequence of at most `capacity` positions. The MLA caches reserve their
    /// full size now, so a request that fits at start never allocates mid-run.
    pub fn new(d: &Dims, capacity: usize) -> SeqState {
        let p = d.kda_heads * d.kda_dim;
        let hist = d.conv_k.saturating_sub(1);
        let layers = (0..d.n_layers)
            .map(|l| {
                if d.is_mla(l) {
                    LayerState::Mla(MlaCache {
                        rows: Vec::with_capacity(capacity * d.latent_width()),
                        width: d.latent_width(),
                    })
                } else {
                    LayerState::Kda(KdaState {
                        s: vec![0.0; d.kda_heads * d.kda_dim * d.kda_dim],
                        conv: [
                            vec![0.0; p * hist],
                            vec![0.0; p * hist],
                            vec![0.0; p * hist],
                        ],
                    })
                }
            })
            .collect();
        SeqState {
            layers,
            pos: 0,
            capacity,
            scratch: Scratch::default(),
            journal: Journal::default(),
        }
    }

    /// Bytes of the state of a sequence planned for `capacity` positions: every KDA layer's
    /// recurrent state and conv histories, every MLA layer's latent cache (reserved in full).
    pub fn bytes_for(d: &Dims, capacity: usize) -> u64 {
        let structs = size_of::<Work>() + d.n_layers * size_of::<LayerState>();
        d.kda_state_bytes() + d.mla_cache_bytes(capacity as u64) + structs as u64
    }

    /// Journal the next forward call so that [`SeqState::rollback`] can keep any prefix of it.
    pub fn begin_journal(&mut self) {
        self.journal.active = true;
        self.journal.pos0 = self.pos;
        self.journal
            .kda
            .resize_with(self.layers.len(), KdaJournal::default);
    }

    /// End a journaled pass keeping only its first `keep` positions: the MLA caches are
    /// truncated and every KDA layer's recurrent state is advanced by those positions from the
    /// journal (its conv history rebuilt), bit for bit the state a pass of only those positions
    /// would have left. No weight is read. Must follow every journaled pass, even one that
    /// keeps all its positions.
    pub fn rollback(&mut self, keep: usize) -> Result<(), ModelError> {
        let j = &mut self.journal;
        if !j.active {
            return Err(ModelError::Input(
                "rollback without a journaled pass".into(),
            ));
        }
        j.active = false;
        let ran = self.pos - j.pos0;
        if keep > ran {
            return Err(ModelError::Input(format!(
                "cannot keep {keep} positions of a pass of {ran}"
            )));
        }
        let end = j.pos0 + keep;
        for (layer, jl) in self.layers.iter_mut().zip(&j.kda) {
            match layer {
                LayerState::Mla(c) => c.rows.truncate(end * c.width),
                LayerState::Kda(s) => super::kda::replay(s, jl, keep, &mut j.tmp)?,
            }
        }
        self.pos = end;
        Ok(())
    }

    /// Check that `n` more tokens fit the planned capacity.
    pub fn reserve(&self, n: usize) -> Result<(), ModelError> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.capacity => Ok(()),
            _ => Err(ModelError::Input(format!(
                "sequence of {} + {n} positions exceeds the planned {}",
                self.pos, self.capacity
            ))),
        }
    }
}
