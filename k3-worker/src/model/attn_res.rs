//! Block Attention Residuals (SPEC.md §3.3).
//!
//! ```text
//! AttnRes(S; w):  s_i = Σ_d ( S_i[d] / sqrt(mean_d(S_i²) + eps) ) · w[d]
//!                 p   = softmax_i(s)
//!                 out = Σ_i p_i · S_i          (RAW sources, not the normalised keys)
//! ```
//! `w = norm.weight ⊙ proj.weight`, folded once at bind. Nothing crosses token positions.

use super::mats::zeroed;
use crate::kernels;

/// One AttnRes site: the folded query `norm.weight ⊙ proj.weight` (`[E]`, f32).
#[derive(Clone, Debug)]
pub struct AttnResQuery {
    /// `norm.weight[d] · proj.weight[0, d]`.
    pub w: Vec<f32>,
}

/// AttnRes temporaries, reused by every call.
#[derive(Clone, Debug, Default)]
pub struct ResBufs {
    key: Vec<f32>,
    p: Vec<f32>,
}

impl ResBufs {
    /// Bytes over a bank of `banked` entries: one key row and the sources' probabilities.
    pub fn bytes_for(d: &super::dims::Dims, banked: usize) -> u64 {
        4 * (d.hidden + banked + 1) as u64
    }
}

impl AttnResQuery {
    /// Aggregate the sources `bank ++ [last]` (each `[T, E]`, token-major) into `out`
    /// (`[T, E]`; allocations reused).
    ///
    /// Per token: keys are the RMS-normalised sources (eps = `rms_norm_eps`), scored against the
    /// folded query, softmax over sources, and the output is the probability-weighted sum of the
    /// raw sources, accumulated in source order.
    pub fn aggregate<B: AsRef<[f32]>>(
        &self,
        bank: &[B],
        last: &[f32],
        n_tok: usize,
        eps: f32,
        b: &mut ResBufs,
        out: &mut Vec<f32>,
    ) {
        let e = self.w.len();
        let sources = || bank.iter().map(|s| s.as_ref()).chain(std::iter::once(last));
        let out = zeroed(out, n_tok * e);
        let key = zeroed(&mut b.key, e);
        let p = zeroed(&mut b.p, bank.len() + 1);
        for t in 0..n_tok {
            for (i, s) in sources().enumerate() {
                let row = &s[t * e..(t + 1) * e];
                // key ⊙ w in one pass: rms_norm computes w[d]·(x[d]·inv_rms).
                kernels::rms_norm(row, &self.w, eps, key);
                p[i] = key.iter().map(|&v| v as f64).sum::<f64>() as f32;
            }
            kernels::softmax_inplace(p);
            let o = &mut out[t * e..(t + 1) * e];
            for (i, s) in sources().enumerate() {
                let row = &s[t * e..(t + 1) * e];
                for d in 0..e {
                    o[d] += p[i] * row[d];
                }
            }
        }
    }
}
