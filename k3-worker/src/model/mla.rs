//! Gated MLA (NoPE) in latent ("absorbed") form (SPEC.md §3.5, §3.6).
//!
//! ```text
//! q    = W_qb · RMSNorm(W_qa x; q_a_layernorm, 1e-6)        q_h = [q_nope_h | q_rope_h]
//! ckv  = W_kva x;  c = RMSNorm(ckv[..kv_lora]; kv_a_layernorm, 1e-6);  kr = ckv[kv_lora..]
//! cache ← [c | kr]                                          (576 floats per position)
//! q̃_h  = W_UK[h]ᵀ q_nope_h                                  (W_UK[h] = kv_b rows h·(nope+v) ..+nope)
//! s    = (q̃_h·c_s + q_rope_h·kr_s) / sqrt(nope + rope)      causal: s ≤ t; rope dims never rotated
//! ĉ_h  = Σ_s softmax(s) c_s;   o_h = W_UV[h] ĉ_h            (W_UV[h] = the next v rows)
//! out  = W_o (concat_h o_h ⊙ σ(W_g x))                      (gate BEFORE o_proj, no norm)
//! ```
//! Prefill and decode both use this form: each query position performs the same operations
//! over the same cache rows, whatever the batch it arrives in.

use rayon::prelude::*;

use super::dims::Dims;
use super::mats::{linear_into, rms_norm_rows_into, zeroed, Mat};
use crate::kernels;

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

/// One MLA layer's weights.
#[derive(Debug)]
pub struct MlaWeights<'a> {
    /// `q_a_proj` `[q_lora, E]`.
    pub q_a: Mat<'a>,
    /// `q_a_layernorm` `[q_lora]`.
    pub q_a_norm: &'a [f32],
    /// `q_b_proj` `[H·(nope+rope), q_lora]`, per head `[nope | rope]`.
    pub q_b: Mat<'a>,
    /// `kv_a_proj_with_mqa` `[kv_lora + rope, E]`.
    pub kv_a: Mat<'a>,
    /// `kv_a_layernorm` `[kv_lora]`.
    pub kv_a_norm: &'a [f32],
    /// `kv_b_proj` `[H·(nope+v), kv_lora]`, per head `[k_nope | v]`.
    pub kv_b: &'a [u8],
    /// `o_proj` `[E, H·v]`.
    pub o_proj: Mat<'a>,
    /// `g_proj` `[H·v, E]` (absent when `mla_use_output_gate` is false).
    pub g_proj: Option<Mat<'a>>,
}

/// An MLA layer's activation buffers, reused by every forward call (see [`super::mats::zeroed`]).
#[derive(Clone, Debug, Default)]
pub struct MlaBufs {
    qa: Vec<f32>,
    qa_n: Vec<f32>,
    q: Vec<f32>,
    ckv: Vec<f32>,
    /// Per head `[n, v_head]` outputs, head-major.
    heads: Vec<f32>,
    /// Per head: q_nope `[n, nope]`, q̃ `[n, kv_lora]`, the query row, ĉ `[n, kv_lora]` (the
    /// scores over the cache are per thread: `kernels::with_scratch`).
    tmp: Vec<f32>,
    o: Vec<f32>,
    g: Vec<f32>,
}

impl MlaWeights<'_> {
    /// Bytes [`MlaBufs`] reach in a pass of `rows` positions: the query path (`q_a`, its norm,
    /// `q`), the new latent rows, the per-head temporaries (q_nope, q̃, the query row, ĉ), the
    /// heads' outputs, their concatenation and the gate. The attention scores over the cache are
    /// per thread ([`MlaWeights::scores_bytes_for`]).
    pub fn bufs_bytes_for(d: &Dims, rows: usize) -> u64 {
        let n = rows as u64;
        let (h, nope, rope, vh, kl) = (
            d.mla_heads as u64,
            d.nope as u64,
            d.rope as u64,
            d.v_head as u64,
            d.kv_lora as u64,
        );
        let lw = d.latent_width() as u64;
        let per_head = n * nope + 2 * n * kl + lw;
        4 * (2 * n * d.q_lora as u64
            + n * h * (nope + rope)
            + n * lw
            + h * per_head
            + 3 * n * h * vh)
    }

    /// Bytes of one thread's attention scores over a cache planned for `context` positions
    /// (`kernels::with_scratch`; kept between passes).
    pub fn scores_bytes_for(context: usize) -> u64 {
        4 * context as u64
    }

    /// Run `n` tokens (`x [n, E]`, normalised) through the layer, appending them to `cache`.
    pub fn forward(&self, d: &Dims, x: &[f32], n: usize, cache: &mut MlaCache) -> Vec<f32> {
        let mut out = Vec::new();
        self.forward_into(d, x, n, cache, &mut MlaBufs::default(), &mut out);
        out
    }

    /// [`MlaWeights::forward`] into `out`, with the layer's temporaries in `b` (no allocation
    /// once the buffers have grown).
    pub fn forward_into(
        &self,
        d: &Dims,
        x: &[f32],
        n: usize,
        cache: &mut MlaCache,
        b: &mut MlaBufs,
        out: &mut Vec<f32>,
    ) {
        self.forward_seqs(d, x, n, std::iter::once((n, cache)), b, out);
    }

    /// The layer over the rows of several sequences at once (a batched pass): `x [n, E]` holds
    /// each sequence's rows in turn; `seqs` gives each one's row count and latent cache. The
    /// projections multiply all `n` rows (one read of each weight for the batch); each
    /// sequence's rows attend over its own cache. A row's result is bit for bit the one a pass
    /// of that sequence alone gives.
    pub fn forward_seqs<'s>(
        &self,
        d: &Dims,
        x: &[f32],
        n: usize,
        seqs: impl Iterator<Item = (usize, &'s mut MlaCache)>,
        b: &mut MlaBufs,
        out: &mut Vec<f32>,
    ) {
        let (e, hn, vh) = (d.hidden, d.mla_heads, d.v_head);
        let qw = d.nope + d.rope;
        let lw = d.latent_width();

        // Queries; keys/values' latent rows.
        linear_into(self.q_a, d.q_lora, e, x, n, &mut b.qa);
        rms_norm_rows_into(&b.qa, self.q_a_norm, d.mla_norm_eps, &mut b.qa_n);
        linear_into(self.q_b, hn * qw, d.q_lora, &b.qa_n, n, &mut b.q);
        linear_into(self.kv_a, lw, e, x, n, &mut b.ckv);

        zeroed(&mut b.heads, hn * n * vh);
        let mut r0 = 0;
        for (rows, cache) in seqs {
            self.attend(d, r0, rows, n, cache, b);
            r0 += rows;
        }
        assert_eq!(r0, n, "the sequences' rows must add up to the pass's");

        let hv = hn * vh;
        let o = zeroed(&mut b.o, n * hv);
        for (h, oh) in b.heads.chunks_exact(n * vh).enumerate() {
            for t in 0..n {
                o[t * hv + h * vh..t * hv + (h + 1) * vh]
                    .copy_from_slice(&oh[t * vh..(t + 1) * vh]);
            }
        }
        if let Some(g_proj) = self.g_proj {
            linear_into(g_proj, hv, e, x, n, &mut b.g);
            for (ov, gv) in o.iter_mut().zip(&b.g) {
                *ov *= kernels::sigmoid(*gv);
            }
        }
        linear_into(self.o_proj, e, hv, &b.o, n, out);
    }

    /// One sequence's rows `r0 .. r0 + m` of a pass of `n`: append their latent rows to its
    /// cache (the norm writes straight into the cache row), then per head the absorbed query,
    /// the causal softmax over the cache, the latent sum and the V expansion into `b.heads`.
    fn attend(
        &self,
        d: &Dims,
        r0: usize,
        m: usize,
        n: usize,
        cache: &mut MlaCache,
        b: &mut MlaBufs,
    ) {
        let (hn, nope, rope, vh, kl) = (d.mla_heads, d.nope, d.rope, d.v_head, d.kv_lora);
        let qw = nope + rope;
        let lw = d.latent_width();
        let past = cache.len();
        for t in r0..r0 + m {
            let row = &b.ckv[t * lw..(t + 1) * lw];
            let at = cache.rows.len();
            cache.rows.resize(at + kl, 0.0);
            kernels::rms_norm(
                &row[..kl],
                self.kv_a_norm,
                d.mla_norm_eps,
                &mut cache.rows[at..],
            );
            cache.rows.extend_from_slice(&row[kl..]);
        }
        let rows = &cache.rows;
        let q = &b.q;

        let scale = 1.0 / ((nope + rope) as f32).sqrt();
        let per = m * nope + 2 * m * kl + lw;
        // The positions the cache was planned for: the scores' buffer is sized for them once.
        let planned = (cache.rows.capacity() / lw).max(past + m);
        let tmp = zeroed(&mut b.tmp, hn * per);
        b.heads
            .par_chunks_mut(n * vh)
            .zip(tmp.par_chunks_mut(per))
            .enumerate()
            .for_each(|(h, (oh, tmp))| {
                let (qn, rest) = tmp.split_at_mut(m * nope);
                let (qt, rest) = rest.split_at_mut(m * kl);
                let (query, chat) = rest.split_at_mut(lw);
                for t in 0..m {
                    let at = (r0 + t) * hn * qw + h * qw;
                    qn[t * nope..(t + 1) * nope].copy_from_slice(&q[at..at + nope]);
                }
                // q̃ = W_UK[h]ᵀ q_nope [m, kv_lora], straight from kv_b's rows (no copy).
                let uk_off = h * (nope + vh) * kl * 2;
                kernels::matmul_t_bf16(
                    &self.kv_b[uk_off..uk_off + nope * kl * 2],
                    nope,
                    kl,
                    qn,
                    m,
                    qt,
                );
                kernels::with_scratch(past + m, planned, |p| {
                    for t in 0..m {
                        query[..kl].copy_from_slice(&qt[t * kl..(t + 1) * kl]);
                        let qr = (r0 + t) * hn * qw + h * qw + nope;
                        query[kl..].copy_from_slice(&q[qr..qr + rope]);
                        let upto = past + t + 1; // causal: positions 0..=past+t
                        let p = &mut p[..upto];
                        for (s, ps) in p.iter_mut().enumerate() {
                            *ps = kernels::dot_f32(query, &rows[s * lw..(s + 1) * lw]) * scale;
                        }
                        kernels::softmax_inplace(p);
                        let ch = &mut chat[t * kl..(t + 1) * kl];
                        for (s, &ps) in p.iter().enumerate() {
                            for (a, &cv) in ch.iter_mut().zip(&rows[s * lw..s * lw + kl]) {
                                *a += ps * cv;
                            }
                        }
                    }
                });
                let wuv_off = (h * (nope + vh) + nope) * kl * 2;
                kernels::matmul_bf16(
                    &self.kv_b[wuv_off..wuv_off + vh * kl * 2],
                    vh,
                    kl,
                    chat,
                    m,
                    &mut oh[r0 * vh..(r0 + m) * vh],
                );
            });
    }
}
