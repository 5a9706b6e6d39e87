//! Per-sequence state carried between forward calls (SPEC.md §3.10): the KDA recurrent state
//! and conv histories per KDA layer, the MLA latent cache per MLA layer. Nothing else — no
//! positions, no AttnRes state.

use super::attn_res::ResBufs;
use super::dims::{Dims, ModelError};
use super::kda::KdaBufs;
pub use super::kda::{KdaJournal, KdaState};
use super::mats::{copy_into, Mat};
use super::mla::MlaBufs;
pub use super::mla::MlaCache;
use super::moe::{CombineBufs, ExpertBufs, MlpBufs, RouteBufs, Routing, Slots, UpSide};

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
    /// The up-projection's bf16 bytes, or a draft's quantized codes.
    bytes: Vec<u8>,
    /// A draft's quantized scales (empty for bf16).
    scales: Vec<u8>,
    /// `None` for bf16.
    kind: Option<k3_proto::quant::QuantKind>,
    /// The latent norm, when the layer has one.
    norm: Option<Vec<f32>>,
}

impl UpCopy {
    /// Copy `side` in, reusing the allocations.
    pub(crate) fn hold(&mut self, side: &UpSide<'_>) {
        let (bytes, scales, kind) = match side.up {
            Mat::Bf16(b) => (b, &[][..], None),
            Mat::Quant { kind, q, s } => (q, s, Some(kind)),
        };
        copy_into(&mut self.bytes, bytes);
        copy_into(&mut self.scales, scales);
        self.kind = kind;
        match (side.norm, &mut self.norm) {
            (Some(n), Some(v)) => copy_into(v, n),
            (Some(n), none) => *none = Some(n.to_vec()),
            (None, v) => *v = None,
        }
    }

    /// The held weights.
    pub(crate) fn side(&self) -> UpSide<'_> {
        UpSide {
            up: match self.kind {
                None => Mat::Bf16(&self.bytes),
                Some(kind) => Mat::Quant {
                    kind,
                    q: &self.bytes,
                    s: &self.scales,
                },
            },
            norm: self.norm.as_deref(),
        }
    }
}

/// Passes of at most this many positions (a decode step, a verify pass of up to `spec::MAX_K`
/// drafts: spec.rs checks at compile time that they fit)
/// keep their buffers for the next pass. A larger pass (a prefill chunk) frees each stage's
/// buffers when the stage is done and the rest when the pass ends, so its peak is one stage's
/// temporaries at the chunk's size, as `k3_store::runtime::plan::activation_bytes` budgets, and the run
/// does not keep a chunk's worth of buffers through its decode.
pub const KEEP_BUFFERS_MAX_POSITIONS: usize = 17;

impl Work {
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
