//! The MLP side: SiTU-GLU MLPs (layer-0 dense MLP, shared experts), the router, and Stable
//! LatentMoE with MXFP4 routed experts (SPEC.md §3.2, §3.7, §3.8).
//!
//! The router is maths and lives here; expert bytes are storage and arrive as an
//! [`ExpertBatch`] that the caller fetched with ONE `WeightSource::experts` call per layer per
//! forward call (the two meet in `forward.rs`).

use k3_proto::expert::{ExpertLayout, ExpertPart};
use k3_store::source::{ExpertBatch, Region};
use rayon::prelude::*;

use super::{linear, Dims, Mat};
use crate::kernels;

/// A SiTU-GLU MLP: `out = W_down · SiTU([W_gate x | W_up x])`.
#[derive(Debug)]
pub struct SituMlp<'a> {
    /// `gate_proj` `[width, E]`.
    pub gate: Mat<'a>,
    /// `up_proj` `[width, E]`.
    pub up: Mat<'a>,
    /// `down_proj` `[E, width]`.
    pub down: Mat<'a>,
    /// Intermediate width.
    pub width: usize,
}

impl SituMlp<'_> {
    /// `x [n, E]` → `[n, E]`.
    pub fn forward(&self, d: &Dims, x: &[f32], n: usize) -> Vec<f32> {
        let g = linear(self.gate, self.width, d.hidden, x, n);
        let u = linear(self.up, self.width, d.hidden, x, n);
        let mut a = vec![0.0f32; n * self.width];
        kernels::situ_glu(&g, &u, d.situ_beta, d.situ_linear_beta, &mut a);
        linear(self.down, d.hidden, self.width, &a, n)
    }
}

/// The routing decision for a batch of tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// `[n, top_k]` selected expert ids per token, in selection order.
    pub sel: Vec<u32>,
    /// `[n, top_k]` combine weights (unbiased scores, renormalised, × routed_scaling_factor).
    pub w: Vec<f32>,
    /// Experts per token.
    pub k: usize,
}

impl Routing {
    /// Distinct selected experts, ascending: the one request made to the weight source.
    pub fn unique(&self) -> Vec<u32> {
        let mut u = self.sel.clone();
        u.sort_unstable();
        u.dedup();
        u
    }
}

/// One expert's users (flat `token·k + slot` indices) and its output rows `[users, latent]`.
/// One expert's users (indices into the `[n, k]` selection) and its latent outputs `[users, latent]`.
pub type ExpertRows = (Vec<usize>, Vec<f32>);

/// One MoE layer's resident weights.
#[derive(Debug)]
pub struct MoeWeights<'a> {
    /// Router `gate.weight` `[N, E]` (bf16).
    pub router: Mat<'a>,
    /// `gate.e_score_correction_bias` `[N]` (selection only).
    pub bias: &'a [f32],
    /// `routed_expert_down_proj` `[latent, E]`.
    pub down: Mat<'a>,
    /// `routed_expert_norm` `[latent]` (None when `latent_moe_use_norm` is false).
    pub norm: Option<&'a [f32]>,
    /// `routed_expert_up_proj` `[E, latent]`.
    pub up: Mat<'a>,
    /// Shared experts (None when `num_shared_experts` is 0).
    pub shared: Option<SituMlp<'a>>,
}

/// Top-k by `score + bias`; ties: higher biased score first, then lower index. Selection order =
/// that ranking.
pub fn select_top_k(scores: &[f32], bias: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..scores.len() as u32).collect();
    let key = |i: u32| scores[i as usize] + bias[i as usize];
    idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

impl MoeWeights<'_> {
    /// Route `n` tokens (`x [n, E]`, normalised): sigmoid scores in f32 from the bf16 gate,
    /// bias-steered selection, weights from the unbiased scores.
    pub fn route(&self, d: &Dims, x: &[f32], n: usize) -> Routing {
        let ne = d.n_experts;
        let mut logits = linear(self.router, ne, d.hidden, x, n);
        logits.iter_mut().for_each(|z| *z = kernels::sigmoid(*z));
        let k = d.top_k;
        let mut sel = Vec::with_capacity(n * k);
        let mut w = Vec::with_capacity(n * k);
        for t in 0..n {
            let s = &logits[t * ne..(t + 1) * ne];
            let chosen = select_top_k(s, self.bias, k);
            let mut ws: Vec<f32> = chosen.iter().map(|&i| s[i as usize]).collect();
            if d.renormalize {
                let sum: f32 = ws.iter().sum::<f32>() + 1e-20;
                ws.iter_mut().for_each(|v| *v /= sum);
            }
            ws.iter_mut().for_each(|v| *v *= d.routed_scale);
            sel.extend_from_slice(&chosen);
            w.extend_from_slice(&ws);
        }
        Routing { sel, w, k }
    }

    /// The MoE output for `x [n, E]` given the routing and the fetched experts (`batch` answers
    /// the request `ids`, in that order). Returns the output `[n, E]` and the ids whose load
    /// failed (their contribution is skipped; the caller counts them and fails the run).
    ///
    /// Each unique expert runs once over the latent rows of all tokens routed to it; per token
    /// the results are then aggregated in selection order, exactly as a single-token call would.
    pub fn forward(
        &self,
        d: &Dims,
        x: &[f32],
        n: usize,
        routing: &Routing,
        ids: &[u32],
        batch: &ExpertBatch,
    ) -> (Vec<f32>, Vec<(u32, String)>) {
        let z = self.latent_in(d, x, n);
        let results = self.run_experts(d, &z, n, routing, ids, batch);
        let shared = self.shared_out(d, x, n);
        self.combine(d, n, routing, &results, shared.as_deref())
    }

    /// The shared experts' output `[n, E]` on the full-width input (`None` without shared
    /// experts). Independent of the routed experts, so it can run while they are fetched.
    pub fn shared_out(&self, d: &Dims, x: &[f32], n: usize) -> Option<Vec<f32>> {
        self.shared.as_ref().map(|sh| sh.forward(d, x, n))
    }

    /// The latent down-projection `z = W_down x` (`[n, latent]`) that every routed expert reads.
    pub fn latent_in(&self, d: &Dims, x: &[f32], n: usize) -> Vec<f32> {
        linear(self.down, d.latent, d.hidden, x, n)
    }

    /// Run the experts `ids` (answered by `batch`, in that order) over the latent rows of the
    /// tokens routed to them. The result does not depend on how a layer's experts are split
    /// into requests: each expert always runs over all of its users at once.
    pub fn run_experts(
        &self,
        d: &Dims,
        z: &[f32],
        n: usize,
        routing: &Routing,
        ids: &[u32],
        batch: &ExpertBatch,
    ) -> Vec<(u32, Result<ExpertRows, String>)> {
        let lat = d.latent;
        let k = routing.k;
        let layout = ExpertLayout {
            inter: d.moe_inter,
            latent: lat,
        };
        // Per unique expert: its (token, slot) users, the gathered latent rows, the result.
        let one = |(&id, got): (&u32, &Result<Region, String>)| {
            let region = got.as_ref().map_err(|e| e.clone())?;
            let bytes = region.bytes();
            if bytes.len() != layout.expert_bytes() {
                return Err(format!(
                    "expert region of {} bytes, expected {}",
                    bytes.len(),
                    layout.expert_bytes()
                ));
            }
            let part = |p: ExpertPart| {
                let o = layout.part_offset(p);
                &bytes[o..o + layout.part_bytes(p)]
            };
            let users: Vec<usize> = (0..n * k).filter(|&i| routing.sel[i] == id).collect();
            let m = users.len();
            let mut zin = Vec::with_capacity(m * lat);
            for &i in &users {
                let t = i / k;
                zin.extend_from_slice(&z[t * lat..(t + 1) * lat]);
            }
            let inter = d.moe_inter;
            // `[m, rows]` = the expert's (packed, scales) part × `x [m, cols]`.
            let product = |packed, scales, rows: usize, cols: usize, x: &[f32]| {
                let mut y = vec![0.0f32; m * rows];
                kernels::matmul_mxfp4(part(packed), part(scales), rows, cols, x, m, &mut y);
                y
            };
            let g = product(ExpertPart::W1Packed, ExpertPart::W1Scale, inter, lat, &zin);
            let u = product(ExpertPart::W3Packed, ExpertPart::W3Scale, inter, lat, &zin);
            let mut a = vec![0.0f32; m * inter];
            kernels::situ_glu(&g, &u, d.situ_beta, d.situ_linear_beta, &mut a);
            let y = product(ExpertPart::W2Packed, ExpertPart::W2Scale, lat, inter, &a);
            Ok((users, y))
        };
        // Experts in parallel only when one expert's products are worth a hand-off to the pool
        // (`kernels::PAR_MIN_MACS`); each expert's result is the same either way.
        let per_expert = 3 * d.moe_inter * lat * n * k / ids.len().max(1);
        let results: Vec<Result<ExpertRows, String>> = if per_expert < kernels::PAR_MIN_MACS {
            ids.iter().zip(&batch.experts).map(one).collect()
        } else {
            ids.par_iter()
                .zip(batch.experts.par_iter())
                .map(one)
                .collect()
        };
        ids.iter().copied().zip(results).collect()
    }

    /// Aggregate the experts' outputs per token in selection order, normalise the aggregate,
    /// project it up and add the shared experts' output (from [`MoeWeights::shared_out`]).
    /// Returns the output `[n, E]` and the ids whose load failed (their contribution is
    /// skipped).
    pub fn combine(
        &self,
        d: &Dims,
        n: usize,
        routing: &Routing,
        results: &[(u32, Result<ExpertRows, String>)],
        shared: Option<&[f32]>,
    ) -> (Vec<f32>, Vec<(u32, String)>) {
        let lat = d.latent;
        let k = routing.k;
        // Scatter to (token, slot) and aggregate per token in selection order.
        let mut slot_out: Vec<Option<&[f32]>> = vec![None; n * k];
        let mut failed = Vec::new();
        for (id, r) in results {
            let id = *id;
            match r {
                Ok((users, y)) => {
                    for (j, &i) in users.iter().enumerate() {
                        slot_out[i] = Some(&y[j * lat..(j + 1) * lat]);
                    }
                }
                Err(e) => failed.push((id, e.clone())),
            }
        }
        let mut acc = vec![0.0f32; n * lat];
        for t in 0..n {
            let a = &mut acc[t * lat..(t + 1) * lat];
            for j in 0..k {
                if let Some(y) = slot_out[t * k + j] {
                    let w = routing.w[t * k + j];
                    for (av, &yv) in a.iter_mut().zip(y) {
                        *av += w * yv;
                    }
                }
            }
        }
        if let Some(norm) = &self.norm {
            acc = super::rms_norm_rows(&acc, norm, d.rms_eps);
        }
        let mut out = linear(self.up, d.hidden, lat, &acc, n);
        if let Some(s) = shared {
            for (o, sv) in out.iter_mut().zip(s) {
                *o += sv;
            }
        }
        (out, failed)
    }
}
