//! The sequence state as bytes (docs/SPEC.md §6.6): the `state` section of a kept session.
//!
//! ```text
//! u32 n_layers
//! per layer, in order:
//!   u32 kind                       0 = KDA, 1 = MLA
//!   KDA: 4 arrays (S, conv q, conv k, conv v)
//!   MLA: u32 width, then 1 array (the latent rows, positions × width)
//! array: u64 count, then count × f32
//! ```
//! All little-endian; floats are the exact bits the state holds, so a restored state continues
//! bit for bit where the saved one stopped. Decoding checks every array's length against the
//! model's dims and the session's position count before it allocates.

use std::io::Write;

use super::dims::Dims;
use super::kda::KdaState;
use super::mla::MlaCache;
use super::state::{LayerState, Scratch, SeqState};

const KDA: u32 = 0;
const MLA: u32 = 1;

/// Why a state's bytes do not restore for this model (the session is not used).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// More positions than this run has room for.
    #[error("the session holds {pos} positions, more than the {capacity} this run has room for")]
    TooManyPositions {
        /// Positions the session holds.
        pos: usize,
        /// Positions this run has room for.
        capacity: usize,
    },
    /// The bytes end early.
    #[error("the state ends inside {0}")]
    Truncated(String),
    /// Another layer count.
    #[error("the state has {found} layers, this model runs {want}")]
    Layers {
        /// Layers in the state.
        found: usize,
        /// Layers of this model.
        want: usize,
    },
    /// An array of another length.
    #[error("{what} holds {found} floats, this model needs {want}")]
    Floats {
        /// The array.
        what: String,
        /// Floats in the state.
        found: u64,
        /// Floats this model needs.
        want: usize,
    },
    /// An MLA layer of another latent width.
    #[error("{what}: latent width {found}, this model's is {want}")]
    Width {
        /// The layer.
        what: String,
        /// Width in the state.
        found: usize,
        /// This model's width.
        want: usize,
    },
    /// Positions × width overflows.
    #[error("{what}: {pos} positions overflow")]
    Overflow {
        /// The layer.
        what: String,
        /// Positions.
        pos: usize,
    },
    /// A layer of the other kind.
    #[error("layer {layer} is {} in this model, the state has kind {kind}", if *.mla { "MLA" } else { "KDA" })]
    Kind {
        /// 0-based layer.
        layer: usize,
        /// The model's layer is MLA.
        mla: bool,
        /// The kind the state has.
        kind: u32,
    },
    /// Bytes left after the last layer.
    #[error("{0} bytes after the last layer")]
    Trailing(usize),
}

/// Bytes [`write_state`] writes for `state`.
pub fn state_bytes(state: &SeqState) -> u64 {
    let arr = |n: usize| 8 + 4 * n as u64;
    4 + state
        .layers
        .iter()
        .map(|l| match l {
            LayerState::Kda(k) => {
                4 + arr(k.s.len()) + k.conv.iter().map(|c| arr(c.len())).sum::<u64>()
            }
            LayerState::Mla(m) => 4 + 4 + arr(m.rows.len()),
        })
        .sum::<u64>()
}

fn write_floats(w: &mut dyn Write, v: &[f32]) -> std::io::Result<()> {
    w.write_all(&(v.len() as u64).to_le_bytes())?;
    let mut buf = Vec::with_capacity(4 * 16384);
    for chunk in v.chunks(16384) {
        buf.clear();
        buf.extend(chunk.iter().flat_map(|f| f.to_le_bytes()));
        w.write_all(&buf)?;
    }
    Ok(())
}

/// Write `state` (its layers; the position is the session's id count).
pub fn write_state(state: &SeqState, w: &mut dyn Write) -> std::io::Result<()> {
    w.write_all(&(state.layers.len() as u32).to_le_bytes())?;
    for l in &state.layers {
        match l {
            LayerState::Kda(k) => {
                w.write_all(&KDA.to_le_bytes())?;
                write_floats(w, &k.s)?;
                for c in &k.conv {
                    write_floats(w, c)?;
                }
            }
            LayerState::Mla(m) => {
                w.write_all(&MLA.to_le_bytes())?;
                w.write_all(&(m.width as u32).to_le_bytes())?;
                write_floats(w, &m.rows)?;
            }
        }
    }
    Ok(())
}

struct Reader<'a> {
    b: &'a [u8],
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], StateError> {
        if self.b.len() < n {
            return Err(StateError::Truncated(what.to_string()));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }

    fn u32(&mut self, what: &str) -> Result<u32, StateError> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4"),
        ))
    }

    /// An array that must hold exactly `want` floats, into a vector of capacity `cap` (≥ want).
    fn floats(&mut self, want: usize, cap: usize, what: &str) -> Result<Vec<f32>, StateError> {
        let n = u64::from_le_bytes(self.take(8, what)?.try_into().expect("8"));
        if n != want as u64 {
            return Err(StateError::Floats {
                what: what.to_string(),
                found: n,
                want,
            });
        }
        let bytes = self.take(want * 4, what)?;
        let mut v = Vec::with_capacity(cap.max(want));
        v.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4"))),
        );
        Ok(v)
    }
}

/// Rebuild the state of a sequence of `pos` positions from `bytes`, for this model's `d`, with
/// room for `capacity` positions (≥ `pos`; the MLA caches reserve it now, as a fresh state does).
pub fn read_state(
    d: &Dims,
    bytes: &[u8],
    pos: usize,
    capacity: usize,
) -> Result<SeqState, StateError> {
    if pos > capacity {
        return Err(StateError::TooManyPositions { pos, capacity });
    }
    let mut r = Reader { b: bytes };
    let n = r.u32("the layer count")? as usize;
    if n != d.n_layers {
        return Err(StateError::Layers {
            found: n,
            want: d.n_layers,
        });
    }
    let p = d.kda_heads * d.kda_dim;
    let hist = d.conv_k.saturating_sub(1);
    let width = d.latent_width();
    let mut layers = Vec::with_capacity(n);
    for l in 0..n {
        let kind = r.u32("a layer kind")?;
        let layer = match (kind, d.is_mla(l)) {
            (KDA, false) => {
                let what = format!("layer {l} (KDA)");
                let s = r.floats(d.kda_heads * d.kda_dim * d.kda_dim, 0, &what)?;
                let mut conv = [Vec::new(), Vec::new(), Vec::new()];
                for c in &mut conv {
                    *c = r.floats(p * hist, 0, &what)?;
                }
                LayerState::Kda(KdaState { s, conv })
            }
            (MLA, true) => {
                let what = format!("layer {l} (MLA)");
                let w = r.u32(&what)? as usize;
                if w != width {
                    return Err(StateError::Width {
                        what,
                        found: w,
                        want: width,
                    });
                }
                let want = pos.checked_mul(width).ok_or(StateError::Overflow {
                    what: what.clone(),
                    pos,
                })?;
                let rows = r.floats(want, capacity * width, &what)?;
                LayerState::Mla(MlaCache { rows, width })
            }
            (kind, mla) => {
                return Err(StateError::Kind {
                    layer: l,
                    mla,
                    kind,
                })
            }
        };
        layers.push(layer);
    }
    if !r.b.is_empty() {
        return Err(StateError::Trailing(r.b.len()));
    }
    Ok(SeqState {
        layers,
        pos,
        capacity,
        scratch: Scratch::default(),
        journal: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims() -> Dims {
        let cfg = k3_proto::config::ModelConfig::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../fixtures/tiny/model/config.json"),
        )
        .unwrap();
        Dims::from_config(&cfg).unwrap()
    }

    /// A state with distinct values everywhere (including a NaN and -0.0, kept bit for bit).
    fn filled(d: &Dims, pos: usize, capacity: usize) -> SeqState {
        let mut st = SeqState::new(d, capacity);
        let mut x = 0.5f32;
        let mut next = || {
            x += 0.25;
            x
        };
        for l in &mut st.layers {
            match l {
                LayerState::Kda(k) => {
                    k.s.iter_mut().for_each(|v| *v = next());
                    k.conv.iter_mut().flatten().for_each(|v| *v = -next());
                }
                LayerState::Mla(m) => {
                    m.rows = (0..pos * m.width).map(|_| next()).collect();
                    m.rows[0] = f32::NAN;
                    m.rows[1] = -0.0;
                }
            }
        }
        st.pos = pos;
        st
    }

    fn bits(s: &SeqState) -> Vec<u32> {
        s.layers
            .iter()
            .flat_map(|l| match l {
                LayerState::Kda(k) => {
                    k.s.iter()
                        .chain(k.conv.iter().flatten())
                        .map(|f| f.to_bits())
                        .collect::<Vec<_>>()
                }
                LayerState::Mla(m) => m.rows.iter().map(|f| f.to_bits()).collect(),
            })
            .collect()
    }

    #[test]
    fn round_trip_is_bit_exact_and_grows_capacity() {
        let d = dims();
        let st = filled(&d, 5, 5);
        let mut b = Vec::new();
        write_state(&st, &mut b).unwrap();
        assert_eq!(b.len() as u64, state_bytes(&st));
        let back = read_state(&d, &b, 5, 40).unwrap();
        assert_eq!(bits(&back), bits(&st));
        assert_eq!((back.pos, back.capacity), (5, 40));
        for l in &back.layers {
            if let LayerState::Mla(m) = l {
                assert!(m.rows.capacity() >= 40 * m.width, "room for the new turn");
                assert_eq!(m.len(), 5);
            }
        }
    }

    #[test]
    fn mismatches_are_refused() {
        let d = dims();
        let st = filled(&d, 3, 3);
        let mut b = Vec::new();
        write_state(&st, &mut b).unwrap();
        // Another position count, too little room, truncation, trailing bytes, fewer layers.
        assert!(read_state(&d, &b, 4, 9)
            .unwrap_err()
            .to_string()
            .contains("floats"));
        assert!(read_state(&d, &b, 3, 2)
            .unwrap_err()
            .to_string()
            .contains("room"));
        assert!(read_state(&d, &b[..b.len() - 1], 3, 3).is_err());
        let mut long = b.clone();
        long.push(0);
        assert!(read_state(&d, &long, 3, 3)
            .unwrap_err()
            .to_string()
            .contains("after"));
        let mut other = d.clone();
        other.n_layers -= 1;
        assert!(read_state(&other, &b, 3, 3)
            .unwrap_err()
            .to_string()
            .contains("layers"));
        // A kind swapped: layer 0 is KDA in this model.
        let mut swapped = b.clone();
        swapped[4..8].copy_from_slice(&MLA.to_le_bytes());
        assert!(read_state(&d, &swapped, 3, 3)
            .unwrap_err()
            .to_string()
            .contains("layer 0"));
        // A huge announced count is refused before allocating.
        let mut huge = b.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(read_state(&d, &huge, 3, 3).is_err());
    }
}
