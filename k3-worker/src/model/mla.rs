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

use super::state::MlaCache;
use super::{linear, rms_norm_rows, Dims, Mat};
use crate::kernels;

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

impl MlaWeights<'_> {
    /// Run `n` tokens (`x [n, E]`, normalised) through the layer, appending them to `cache`.
    pub fn forward(&self, d: &Dims, x: &[f32], n: usize, cache: &mut MlaCache) -> Vec<f32> {
        let (e, hn, nope, rope, vh, kl) =
            (d.hidden, d.mla_heads, d.nope, d.rope, d.v_head, d.kv_lora);
        let qw = nope + rope;
        let lw = d.latent_width();

        // Queries.
        let qa = linear(self.q_a, d.q_lora, e, x, n);
        let qa = rms_norm_rows(&qa, self.q_a_norm, d.mla_norm_eps);
        let q = linear(self.q_b, hn * qw, d.q_lora, &qa, n);

        // Keys/values: append [c | kr] of the new positions to the latent cache.
        let ckv = linear(self.kv_a, lw, e, x, n);
        let past = cache.len();
        let mut c = vec![0.0f32; kl];
        for t in 0..n {
            let row = &ckv[t * lw..(t + 1) * lw];
            kernels::rms_norm(&row[..kl], self.kv_a_norm, d.mla_norm_eps, &mut c);
            cache.rows.extend_from_slice(&c);
            cache.rows.extend_from_slice(&row[kl..]);
        }
        let rows = &cache.rows;

        // Per head: absorbed query, causal softmax over the cache, latent sum, V expansion.
        let scale = 1.0 / ((nope + rope) as f32).sqrt();
        let per_head: Vec<Vec<f32>> = (0..hn)
            .into_par_iter()
            .map(|h| {
                let mut qn = vec![0.0f32; n * nope];
                for t in 0..n {
                    let src = &q[t * hn * qw + h * qw..t * hn * qw + h * qw + nope];
                    qn[t * nope..(t + 1) * nope].copy_from_slice(src);
                }
                // q̃ = W_UK[h]ᵀ q_nope [n, kv_lora], straight from kv_b's rows (no copy).
                let uk_off = h * (nope + vh) * kl * 2;
                let mut qt = vec![0.0f32; n * kl];
                kernels::matmul_t_bf16(
                    &self.kv_b[uk_off..uk_off + nope * kl * 2],
                    nope,
                    kl,
                    &qn,
                    n,
                    &mut qt,
                );
                let mut query = vec![0.0f32; lw];
                let mut chat = vec![0.0f32; n * kl];
                let mut p = Vec::with_capacity(past + n);
                for t in 0..n {
                    query[..kl].copy_from_slice(&qt[t * kl..(t + 1) * kl]);
                    let qr = t * hn * qw + h * qw + nope;
                    query[kl..].copy_from_slice(&q[qr..qr + rope]);
                    let upto = past + t + 1; // causal: positions 0..=past+t
                    p.clear();
                    for s in 0..upto {
                        p.push(kernels::dot_f32(&query, &rows[s * lw..(s + 1) * lw]) * scale);
                    }
                    kernels::softmax_inplace(&mut p);
                    let ch = &mut chat[t * kl..(t + 1) * kl];
                    for (s, &ps) in p.iter().enumerate() {
                        for (a, &cv) in ch.iter_mut().zip(&rows[s * lw..s * lw + kl]) {
                            *a += ps * cv;
                        }
                    }
                }
                let wuv_off = (h * (nope + vh) + nope) * kl * 2;
                linear(
                    Mat::Bf16(&self.kv_b[wuv_off..wuv_off + vh * kl * 2]),
                    vh,
                    kl,
                    &chat,
                    n,
                )
            })
            .collect();

        let hv = hn * vh;
        let mut o = vec![0.0f32; n * hv];
        for (h, oh) in per_head.iter().enumerate() {
            for t in 0..n {
                o[t * hv + h * vh..t * hv + (h + 1) * vh]
                    .copy_from_slice(&oh[t * vh..(t + 1) * vh]);
            }
        }
        if let Some(g_proj) = self.g_proj {
            let g = linear(g_proj, hv, e, x, n);
            for (ov, gv) in o.iter_mut().zip(&g) {
                *ov *= kernels::sigmoid(*gv);
            }
        }
        linear(self.o_proj, e, hv, &o, n)
    }
}
