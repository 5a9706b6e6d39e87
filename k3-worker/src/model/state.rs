//! Per-sequence state carried between forward calls (SPEC.md §3.10): the KDA recurrent state
//! and conv histories per KDA layer, the MLA latent cache per MLA layer. Nothing else — no
//! positions, no AttnRes state.

use super::{Dims, ModelError};

/// One KDA layer's carried state.
#[derive(Clone, Debug, PartialEq)]
pub struct KdaState {
    /// `S_h` for every head, `[h][k][v]` (`H·D·D` floats).
    pub s: Vec<f32>,
    /// Raw (pre-conv) projection history for q, k, v: `[P][K-1]`, oldest first.
    pub conv: [Vec<f32>; 3],
}

/// One MLA layer's latent cache: `[c (kv_lora, post-norm) | kr (rope)]` per position.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaCache {
    /// Rows of `width` floats, one per cached position.
    pub rows: Vec<f32>,
    /// Floats per position (`kv_lora + rope`).
    pub width: usize,
}

impl MlaCache {
    /// Cached positions.
    pub fn len(&self) -> usize {
        self.rows.len() / self.width
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

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
}

impl PartialEq for Scratch {
    /// Buffers are not state: two sequences in the same state compare equal whatever their
    /// scratch holds.
    fn eq(&self, _: &Scratch) -> bool {
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
        }
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
