//! Kimi Delta Attention (SPEC.md §3.4).
//!
//! Per token t (x = the normalised layer input):
//! 1. `q̂, k̂, v̂ = W_q x, W_k x, W_v x` (each `[P]`, `P = H·D`).
//! 2. Causal depthwise short conv over the raw projections (tap K-1 = current token), SiLU.
//! 3. Per head: `q ← l2(q)`, `k ← l2(k)` (sum of squares, eps 1e-6); v raw.
//! 4. `β_h = σ((W_b x)[h])`.
//! 5. `z = W_fb (W_fa x)`; `g = lb·σ(exp(A_log[h])·(z + dt_bias))`; `α = exp(g)`.
//! 6. Per head, in order: `S ← diag(α) S`; `u = Sᵀk`; `S ← S + k ⊗ β(v − u)`;
//!    `o = Sᵀ (q / sqrt(D))` (reads the UPDATED state).
//! 7. `y_h = RMSNorm(o_h; o_norm, rms_eps) ⊙ σ((W_g x)_h)` (norm first, then gate).
//! 8. `out = W_o concat_h y_h`.
//!
//! The recurrence is sequential per token in both prefill and decode, so a prefill of T tokens
//! and T single-token calls perform the same operations in the same order.

use rayon::prelude::*;

use super::dims::{Dims, ModelError};
use super::mats::{copy_into, linear_into, zeroed, Mat};
use crate::kernels;

/// One KDA layer's carried state.
#[derive(Clone, Debug, PartialEq)]
pub struct KdaState {
    /// `S_h` for every head, `[h][k][v]` (`H·D·D` floats).
    pub s: Vec<f32>,
    /// Raw (pre-conv) projection history for q, k, v: `[P][K-1]`, oldest first.
    pub conv: [Vec<f32>; 3],
}

/// What one KDA layer keeps during a journaled pass (a speculative verify pass) so that its state
/// can be advanced by any prefix of the pass afterwards without running the layer again: the
/// conv histories before the pass and the per-position inputs of the recurrence. The recurrence
/// itself runs on a copy during the pass, so no snapshot of the (large) state is needed
/// (SPEC.md §3.12).
#[derive(Clone, Debug, Default)]
pub struct KdaJournal {
    /// Positions the pass ran.
    pub n: usize,
    /// The conv histories before the pass (`[P][K-1]` each).
    pub conv0: [Vec<f32>; 3],
    /// The pass's raw (pre-conv) q, k, v projections, `[n, P]` each.
    pub raw: [Vec<f32>; 3],
    /// k after conv + SiLU, before its l2 norm, `[n, P]`.
    pub k: Vec<f32>,
    /// v after conv + SiLU, `[n, P]`.
    pub v: Vec<f32>,
    /// Decay α, `[n, P]`.
    pub alpha: Vec<f32>,
    /// β, `[n, H]`.
    pub beta: Vec<f32>,
}

/// L2-norm eps for q and k (fla `l2norm`).
const L2_EPS: f32 = 1e-6;

/// One KDA layer's weights. bf16 matrices are raw bytes `[out, in]`; small vectors are f32.
#[derive(Debug)]
pub struct KdaWeights<'a> {
    /// `q_proj` `[P, E]`.
    pub q_proj: Mat<'a>,
    /// `k_proj` `[P, E]`.
    pub k_proj: Mat<'a>,
    /// `v_proj` `[P, E]`.
    pub v_proj: Mat<'a>,
    /// Conv kernels for q, k, v: `[P, K]` (tap K-1 multiplies the current token).
    pub conv: [&'a [f32]; 3],
    /// `f_a_proj` `[D, E]` (decay bottleneck, rank D).
    pub f_a: Mat<'a>,
    /// `f_b_proj` `[P, D]`.
    pub f_b: Mat<'a>,
    /// `A_log[0..H]` (per head).
    pub a_log: &'a [f32],
    /// `dt_bias` `[P]`, index `h·D + d`.
    pub dt_bias: &'a [f32],
    /// `b_proj` `[H, E]`.
    pub b_proj: Mat<'a>,
    /// `g_proj` `[P, E]`.
    pub g_proj: Mat<'a>,
    /// `o_norm` `[D]`, shared by all heads.
    pub o_norm: &'a [f32],
    /// `o_proj` `[E, P]`.
    pub o_proj: Mat<'a>,
}

/// A KDA layer's activation buffers, reused by every forward call (see [`super::mats::zeroed`]).
#[derive(Clone, Debug, Default)]
pub struct KdaBufs {
    qkv: [Vec<f32>; 3],
    beta: Vec<f32>,
    za: Vec<f32>,
    alpha: Vec<f32>,
    gate: Vec<f32>,
    /// Per head `[n, D]` outputs, head-major `[H, n, D]`.
    heads: Vec<f32>,
    /// Per head: q, k, u, o (`4·D`), then a journaled pass's copy of the state (`D·D`).
    tmp: Vec<f32>,
    y: Vec<f32>,
}

impl KdaJournal {
    /// Bytes one KDA layer's journal holds for a verify pass of `rows` positions: the conv
    /// histories before it, and per position the raw q, k, v, then k, v, α (`6·P`) and β (`H`).
    pub fn bytes_for(d: &Dims, rows: usize) -> u64 {
        let (h, p) = (d.kda_heads as u64, (d.kda_heads * d.kda_dim) as u64);
        let hist = d.conv_k.saturating_sub(1) as u64;
        4 * (3 * p * hist + rows as u64 * (6 * p + h))
    }
}

impl KdaWeights<'_> {
    /// Bytes [`KdaBufs`] reach in a pass of `rows` positions (`journaled`: a verify pass, whose
    /// recurrence runs on a per-head copy of the state): q, k, v, α, the gate, the heads' outputs
    /// and their concatenation (`7·rows·P`), β and the decay bottleneck, the per-head temporaries.
    pub fn bufs_bytes_for(d: &Dims, rows: usize, journaled: bool) -> u64 {
        let (h, dh) = (d.kda_heads as u64, d.kda_dim as u64);
        let (p, n) = (h * dh, rows as u64);
        let per_head = 4 * dh + if journaled { dh * dh } else { 0 };
        4 * (7 * n * p + n * h + n * dh + h * per_head)
    }

    /// Run `n` tokens (`x [n, E]`, already normalised) through the layer, advancing `st`. With
    /// a `journal`, also keep what [`replay`] needs to roll the state back to any of the `n`
    /// positions.
    pub fn forward(
        &self,
        d: &Dims,
        x: &[f32],
        n: usize,
        st: &mut KdaState,
        journal: Option<&mut KdaJournal>,
    ) -> Vec<f32> {
        let mut out = Vec::new();
        self.forward_into(d, x, n, st, journal, &mut KdaBufs::default(), &mut out);
        out
    }

    /// [`KdaWeights::forward`] into `out`, with the layer's temporaries in `b` (no allocation
    /// once the buffers have grown to the pass's size).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_into(
        &self,
        d: &Dims,
        x: &[f32],
        n: usize,
        st: &mut KdaState,
        journal: Option<&mut KdaJournal>,
        b: &mut KdaBufs,
        out: &mut Vec<f32>,
    ) {
        let one = KdaSeq {
            rows: n,
            state: st,
            journal,
        };
        self.forward_seqs(d, x, n, std::iter::once(one), b, out);
    }

    /// The layer over the rows of several sequences at once (a batched pass): `x [n, E]` holds
    /// each sequence's rows in turn, `seqs` says how many rows each has and carries its state.
    /// Every projection multiplies all `n` rows (one read of each weight for the batch); the
    /// short convolutions and the recurrence run per sequence on its own state. A row's result
    /// is bit for bit the one a pass of that sequence alone gives (the kernels compute each row
    /// the same way whatever the other rows are).
    pub fn forward_seqs<'s>(
        &self,
        d: &Dims,
        x: &[f32],
        n: usize,
        seqs: impl Iterator<Item = KdaSeq<'s>>,
        b: &mut KdaBufs,
        out: &mut Vec<f32>,
    ) {
        let (e, h_n, dh) = (d.hidden, d.kda_heads, d.kda_dim);
        let p = h_n * dh;

        // 1. projections (conv + SiLU per sequence, below); 4. β per head.
        let [bq, bk, bv] = &mut b.qkv;
        linear_into(self.q_proj, p, e, x, n, bq);
        linear_into(self.k_proj, p, e, x, n, bk);
        linear_into(self.v_proj, p, e, x, n, bv);
        linear_into(self.b_proj, h_n, e, x, n, &mut b.beta);
        b.beta.iter_mut().for_each(|b| *b = kernels::sigmoid(*b));

        // 5. decay α = exp(lb·σ(exp(A_log[h])·(z + dt_bias))).
        linear_into(self.f_a, dh, e, x, n, &mut b.za);
        linear_into(self.f_b, p, dh, &b.za, n, &mut b.alpha);
        let alpha = &mut b.alpha;
        for t in 0..n {
            for c in 0..p {
                let a = self.a_log[c / dh].exp();
                let z = alpha[t * p + c] + self.dt_bias[c];
                alpha[t * p + c] = (d.gate_lb * kernels::sigmoid(a * z)).exp();
            }
        }

        // 7's gate.
        linear_into(self.g_proj, p, e, x, n, &mut b.gate);
        b.gate.iter_mut().for_each(|g| *g = kernels::sigmoid(*g));

        // 2, 3, 6, 7 per sequence, on its rows.
        zeroed(&mut b.heads, h_n * n * dh);
        let mut r0 = 0;
        for seq in seqs {
            let rows = seq.rows;
            self.recur(d, r0, n, seq, b);
            r0 += rows;
        }
        assert_eq!(r0, n, "the sequences' rows must add up to the pass's");

        let y = zeroed(&mut b.y, n * p);
        for (h, oh) in b.heads.chunks_exact(n * dh).enumerate() {
            for t in 0..n {
                y[t * p + h * dh..t * p + (h + 1) * dh].copy_from_slice(&oh[t * dh..(t + 1) * dh]);
            }
        }

        // 8.
        linear_into(self.o_proj, e, p, &b.y, n, out);
    }

    /// One sequence's rows `r0 .. r0 + seq.rows` of a pass of `n`: the causal conv + SiLU with
    /// its carried history, then the recurrence per head (heads are independent; tokens
    /// sequential inside a head) into `b.heads`; journaled when the sequence's pass is.
    fn recur(&self, d: &Dims, r0: usize, n: usize, seq: KdaSeq<'_>, b: &mut KdaBufs) {
        let (h_n, dh) = (d.kda_heads, d.kda_dim);
        let (p, k) = (h_n * dh, d.conv_k);
        let KdaSeq {
            rows: m,
            state: st,
            mut journal,
        } = seq;
        let span = r0 * p..(r0 + m) * p;
        let deferred = journal.is_some();
        if let Some(j) = journal.as_deref_mut() {
            j.n = m;
            for ((c0, raw), (hist, proj)) in
                (j.conv0.iter_mut().zip(j.raw.iter_mut())).zip(st.conv.iter().zip(&b.qkv))
            {
                copy_into(c0, hist);
                copy_into(raw, &proj[span.clone()]);
            }
        }
        for ((raw, w), hist) in b.qkv.iter_mut().zip(&self.conv).zip(st.conv.iter_mut()) {
            short_conv_silu(&mut raw[span.clone()], w, hist, p, k, m);
        }
        let [q, kk, v] = &b.qkv;
        let (alpha, beta, gate) = (&b.alpha, &b.beta, &b.gate);
        if let Some(j) = journal {
            copy_into(&mut j.k, &kk[span.clone()]);
            copy_into(&mut j.v, &v[span.clone()]);
            copy_into(&mut j.alpha, &alpha[span.clone()]);
            copy_into(&mut j.beta, &beta[r0 * h_n..(r0 + m) * h_n]);
        }

        let q_scale = 1.0 / (dh as f32).sqrt();
        let tmp_len = 4 * dh + if deferred { dh * dh } else { 0 };
        let tmp = zeroed(&mut b.tmp, h_n * tmp_len);
        st.s.par_chunks_mut(dh * dh)
            .zip(b.heads.par_chunks_mut(n * dh))
            .zip(tmp.par_chunks_mut(tmp_len))
            .with_min_len(heads_per_task(m, dh))
            .enumerate()
            .for_each(|(h, ((s_live, out), tmp))| {
                let (qkuo, copy) = tmp.split_at_mut(4 * dh);
                let (qh, rest) = qkuo.split_at_mut(dh);
                let (kh, rest) = rest.split_at_mut(dh);
                let (u, o) = rest.split_at_mut(dh);
                // A journaled pass runs the recurrence on a copy: the live state stays at the
                // pass's start until `replay` advances it by the kept positions.
                let s: &mut [f32] = if deferred {
                    copy.copy_from_slice(s_live);
                    copy
                } else {
                    s_live
                };
                for row in r0..r0 + m {
                    let base = row * p + h * dh;
                    qh.copy_from_slice(&q[base..base + dh]);
                    kh.copy_from_slice(&kk[base..base + dh]);
                    kernels::l2_norm_inplace(qh, L2_EPS);
                    kernels::l2_norm_inplace(kh, L2_EPS);
                    qh.iter_mut().for_each(|v| *v *= q_scale);
                    let vh = &v[base..base + dh];
                    let al = &alpha[base..base + dh];
                    let b = beta[row * h_n + h];
                    recurrence_step(s, dh, al, kh, vh, b, qh, u, o);
                    let y = &mut out[row * dh..(row + 1) * dh];
                    kernels::rms_norm(o, self.o_norm, d.rms_eps, y);
                    for (yv, g) in y.iter_mut().zip(&gate[base..base + dh]) {
                        *yv *= g;
                    }
                }
            });
    }
}

/// One sequence's part of a batched KDA pass: its rows (consecutive in the pass), its state and,
/// in a journaled (verify) pass, its journal.
#[derive(Debug)]
pub struct KdaSeq<'s> {
    /// Rows of the pass that are this sequence's (its new positions, in order).
    pub rows: usize,
    /// Its carried state, advanced by the pass.
    pub state: &'s mut KdaState,
    /// Its journal, in a journaled pass.
    pub journal: Option<&'s mut KdaJournal>,
}

/// Heads per parallel task of the recurrence over `n` positions: enough that a task is worth a
/// hand-off to the pool (~4·dh² multiply-adds per head and position against
/// `kernels::PAR_MIN_MACS`). K3's 96 heads of 128² run in tasks of 4 heads per decoded token; a
/// model with a few small heads (`small`: 4 of 64²) runs them on the calling thread. Each head
/// is computed by the same code either way, so the bits do not change.
fn heads_per_task(n: usize, dh: usize) -> usize {
    kernels::PAR_MIN_MACS
        .div_ceil((4 * n * dh * dh).max(1))
        .max(1)
}

/// Advance a KDA layer's state by the first `keep` positions of the journaled pass `j` (whose
/// recurrence ran on a copy, leaving `st.s` at the pass's start): only the recurrence's state
/// update runs, from the journaled inputs, through the same functions the forward pass uses —
/// so the result is bit for bit what a pass of only those positions leaves. The conv histories
/// become the last `K-1` raw projections of (history before the pass ++ the kept positions).
///
/// `tmp` holds the per-head temporaries (its allocation is reused).
pub fn replay(
    st: &mut KdaState,
    j: &KdaJournal,
    keep: usize,
    tmp: &mut Vec<f32>,
) -> Result<(), ModelError> {
    let n = j.n;
    let bad = |what: &str| ModelError::Input(format!("KDA rollback journal: {what}"));
    if keep > n || n == 0 {
        return Err(bad("keeps more positions than the pass ran"));
    }
    if j.beta.is_empty() || !j.beta.len().is_multiple_of(n) {
        return Err(bad("does not match the layer's state"));
    }
    let h_n = j.beta.len() / n;
    let p = j.alpha.len() / n;
    let dh = p / h_n;
    if dh * dh * h_n != st.s.len() || [&j.k, &j.v, &j.alpha].iter().any(|a| a.len() != n * p) {
        return Err(bad("inconsistent sizes"));
    }
    let tmp = zeroed(tmp, h_n * 2 * dh);
    st.s.par_chunks_mut(dh * dh)
        .zip(tmp.par_chunks_mut(2 * dh))
        .with_min_len(heads_per_task(keep.max(1), dh))
        .enumerate()
        .for_each(|(h, (s, tmp))| {
            let (kh, u) = tmp.split_at_mut(dh);
            for t in 0..keep {
                let base = t * p + h * dh;
                kh.copy_from_slice(&j.k[base..base + dh]);
                kernels::l2_norm_inplace(kh, L2_EPS);
                let b = j.beta[t * h_n + h];
                state_update(
                    s,
                    dh,
                    &j.alpha[base..base + dh],
                    kh,
                    &j.v[base..base + dh],
                    b,
                    u,
                );
            }
        });
    for i in 0..3 {
        let (hist, h0, raw) = (&mut st.conv[i], &j.conv0[i], &j.raw[i]);
        if h0.len() != hist.len() || raw.len() != n * p {
            return Err(bad("conv history sizes"));
        }
        let hl = hist.len() / p;
        for c in 0..p {
            // The sequence (old history ++ kept raw values), last `hl` of it.
            let total = hl + keep;
            for (slot, idx) in (total - hl..total).enumerate() {
                hist[c * hl + slot] = if idx < hl {
                    h0[c * hl + idx]
                } else {
                    raw[(idx - hl) * p + c]
                };
            }
        }
    }
    Ok(())
}

/// Causal depthwise conv of width `k` over `n` tokens of `raw [n, p]` (replaced in place by
/// `silu(conv)`), reading and then updating the raw history `hist [p, k-1]` (oldest first).
fn short_conv_silu(raw: &mut [f32], w: &[f32], hist: &mut [f32], p: usize, k: usize, n: usize) {
    let hl = k - 1;
    for c in 0..p {
        let wc = &w[c * k..(c + 1) * k];
        let hc = &mut hist[c * hl..(c + 1) * hl];
        for t in 0..n {
            let cur = raw[t * p + c];
            let mut acc = 0.0f32;
            for j in 0..hl {
                acc += wc[j] * hc[j];
            }
            acc += wc[hl] * cur;
            if hl > 0 {
                hc.copy_within(1.., 0);
                hc[hl - 1] = cur;
            }
            raw[t * p + c] = kernels::silu(acc);
        }
    }
}

/// One token of the delta-rule recurrence for one head, state `s [k][v]` (`D×D`):
/// decay → read → write → read the updated state. `q` is already scaled by `1/sqrt(D)`.
#[allow(clippy::too_many_arguments)]
pub fn recurrence_step(
    s: &mut [f32],
    dh: usize,
    alpha: &[f32],
    k: &[f32],
    v: &[f32],
    beta: f32,
    q: &[f32],
    u: &mut [f32],
    o: &mut [f32],
) {
    state_update(s, dh, alpha, k, v, beta, u);
    // o = Sᵀ q
    o.iter_mut().for_each(|x| *x = 0.0);
    for (row, &qv) in s.chunks_exact(dh).zip(q) {
        for (ov, &sv) in o.iter_mut().zip(row) {
            *ov += qv * sv;
        }
    }
}

/// The state half of [`recurrence_step`] (decay → read → write), shared with [`replay`] so a
/// rollback performs exactly the forward pass's operations.
fn state_update(
    s: &mut [f32],
    dh: usize,
    alpha: &[f32],
    k: &[f32],
    v: &[f32],
    beta: f32,
    u: &mut [f32],
) {
    // S ← diag(α)·S  (row k scaled by α[k])
    for (row, &a) in s.chunks_exact_mut(dh).zip(alpha) {
        row.iter_mut().for_each(|x| *x *= a);
    }
    // u = Sᵀ k
    u.iter_mut().for_each(|x| *x = 0.0);
    for (row, &kv) in s.chunks_exact(dh).zip(k) {
        for (uv, &sv) in u.iter_mut().zip(row) {
            *uv += kv * sv;
        }
    }
    // S ← S + k ⊗ β(v − u)
    for (uv, &vv) in u.iter_mut().zip(v) {
        *uv = beta * (vv - *uv);
    }
    for (row, &kv) in s.chunks_exact_mut(dh).zip(k) {
        for (sv, &dv) in row.iter_mut().zip(u.iter()) {
            *sv += kv * dv;
        }
    }
}
