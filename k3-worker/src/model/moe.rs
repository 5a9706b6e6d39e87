//! The MLP side: SiTU-GLU MLPs (layer-0 dense MLP, shared experts), the router, and Stable
//! LatentMoE with MXFP4 routed experts (SPEC.md §3.2, §3.7, §3.8).
//!
//! The router is maths and lives here; routed experts arrive as typed matrices
//! ([`Experts`]: the weights feed's answer for a layer's experts, `feed.rs`), never as bytes
//! this file interprets.

use super::dims::Dims;
use super::mats::{linear_into, rms_norm_rows_into, zeroed, Experts, Mat};
use crate::kernels;
use k3_proto::expert::ExpertLayout;
use k3_store::runtime::source::ExpertBatch;

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

/// A SiTU-GLU MLP's temporaries, reused by every call.
#[derive(Clone, Debug, Default)]
pub struct MlpBufs {
    g: Vec<f32>,
    u: Vec<f32>,
    a: Vec<f32>,
}

impl MlpBufs {
    /// Bytes a SiTU MLP of intermediate `width` reaches over `rows` positions: gate, up and the
    /// activation, `[rows, width]` each.
    pub fn bytes_for(rows: usize, width: usize) -> u64 {
        4 * 3 * rows as u64 * width as u64
    }
}

impl SituMlp<'_> {
    /// `x [n, E]` → `out [n, E]` (allocations reused).
    pub fn forward(&self, d: &Dims, x: &[f32], n: usize, b: &mut MlpBufs, out: &mut Vec<f32>) {
        linear_into(self.gate, self.width, d.hidden, x, n, &mut b.g);
        linear_into(self.up, self.width, d.hidden, x, n, &mut b.u);
        let a = zeroed(&mut b.a, n * self.width);
        kernels::situ_glu(&b.g, &b.u, d.situ_beta, d.situ_linear_beta, a);
        linear_into(self.down, d.hidden, self.width, &b.a, n, out);
    }
}

/// The routing decision for a batch of tokens.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing {
    /// `[n, top_k]` selected expert ids per token, in selection order.
    pub sel: Vec<u32>,
    /// `[n, top_k]` combine weights (unbiased scores, renormalised, × routed_scaling_factor).
    pub w: Vec<f32>,
    /// Experts per token.
    pub k: usize,
}

impl Routing {
    /// Bytes of the routing of `rows` positions (`top_k` ids and weights each).
    pub fn bytes_for(d: &Dims, rows: usize) -> u64 {
        8 * (rows * d.top_k) as u64
    }

    /// Distinct selected experts, ascending: the one request made to the weight source.
    pub fn unique(&self) -> Vec<u32> {
        let mut u = Vec::new();
        self.unique_into(&mut u);
        u
    }

    /// [`Routing::unique`] into `u` (its allocation reused).
    pub fn unique_into(&self, u: &mut Vec<u32>) {
        u.clear();
        u.extend_from_slice(&self.sel);
        u.sort_unstable();
        u.dedup();
    }
}

/// `ranked` holds `n` tokens' `k` selections each, in rank order: the distinct experts, every
/// token's first choice first, then every token's second, …, into `ids`. `seen` is scratch.
pub fn by_rank_into(ranked: &[u32], n: usize, k: usize, seen: &mut Vec<bool>, ids: &mut Vec<u32>) {
    seen.clear();
    seen.resize(ranked.iter().max().map_or(0, |&m| m as usize + 1), false);
    ids.clear();
    for r in 0..k {
        for t in 0..n {
            let e = ranked[t * k + r];
            if !std::mem::replace(&mut seen[e as usize], true) {
                ids.push(e);
            }
        }
    }
}

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
    let mut idx = Vec::new();
    select_top_k_into(scores, bias, k, &mut idx);
    idx
}

/// [`select_top_k`] into `idx` (its allocation reused). The ranking is a strict total order
/// (the index breaks every tie), so a selection followed by an in-place sort of the chosen `k`
/// gives exactly the full sort's first `k`.
pub fn select_top_k_into(scores: &[f32], bias: &[f32], k: usize, idx: &mut Vec<u32>) {
    idx.clear();
    idx.extend(0..scores.len() as u32);
    let key = |i: u32| scores[i as usize] + bias[i as usize];
    let rank = |a: &u32, b: &u32| key(*b).total_cmp(&key(*a)).then(a.cmp(b));
    if k == 0 {
        idx.clear();
        return;
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, rank);
        idx.truncate(k);
    }
    idx.sort_unstable_by(rank);
}

/// The router's temporaries.
#[derive(Clone, Debug, Default)]
pub struct RouteBufs {
    logits: Vec<f32>,
    idx: Vec<u32>,
    /// The lookahead's experts taken so far, `[N]`.
    seen: Vec<bool>,
}

/// The routed experts' temporaries for one request: users grouped by expert, their gathered
/// latent rows, the intermediate activations and outputs.
#[derive(Clone, Debug, Default)]
pub struct ExpertBufs {
    /// Flat `token·k + slot` indices, grouped by expert (request order), ascending inside.
    order: Vec<usize>,
    /// Expert `j`'s users are `order[starts[j]..starts[j + 1]]`.
    starts: Vec<usize>,
    /// The answer for expert `j` is usable.
    valid: Vec<bool>,
    /// `[users, latent]` gathered inputs.
    zin: Vec<f32>,
    /// `[users, 3·inter]`: gate, up and activation rows per expert.
    work: Vec<f32>,
    /// `[users, latent]` outputs.
    y: Vec<f32>,
}

/// Every (token, slot)'s routed-expert output, filled request by request and combined once.
#[derive(Clone, Debug, Default)]
pub struct Slots {
    /// `[n·k, latent]`.
    y: Vec<f32>,
    /// Slot `i` was computed (false: its expert failed to load, or was not run).
    ok: Vec<bool>,
}

impl RouteBufs {
    /// Bytes the router reaches over `rows` positions: the scores `[rows, N]`, the ranking and
    /// the lookahead's seen-set (`[N]` each).
    pub fn bytes_for(d: &Dims, rows: usize) -> u64 {
        let ne = d.n_experts as u64;
        4 * rows as u64 * ne + 4 * ne + ne
    }
}

impl ExpertBufs {
    /// Bytes the routed experts of `rows` positions reach (at most `rows · top_k` users over all
    /// of a layer's requests, each buffer reserved for that many once): the users' indices,
    /// their gathered latent rows, gate/up/activation rows and outputs, and the per-expert
    /// starts and validity.
    pub fn bytes_for(d: &Dims, rows: usize) -> u64 {
        let users = (rows * d.top_k) as u64;
        let (lat, inter, ne) = (d.latent as u64, d.moe_inter as u64, d.n_experts as u64);
        8 * users + 4 * users * (2 * lat + 3 * inter) + 9 * (ne + 1)
    }
}

impl Slots {
    /// Bytes of the (token, slot) outputs of `rows` positions.
    pub fn bytes_for(d: &Dims, rows: usize) -> u64 {
        let nk = (rows * d.top_k) as u64;
        4 * nk * d.latent as u64 + nk
    }

    /// Empty slots for `n·k` selections of `latent`-float outputs.
    pub fn reset(&mut self, nk: usize, latent: usize) {
        zeroed(&mut self.y, nk * latent);
        self.ok.clear();
        self.ok.resize(nk, false);
    }
}

/// The combine step's temporaries.
#[derive(Clone, Debug, Default)]
pub struct CombineBufs {
    acc: Vec<f32>,
    acc_n: Vec<f32>,
}

impl CombineBufs {
    /// Bytes over `rows` positions: the aggregate and its norm, `[rows, latent]` each.
    pub fn bytes_for(d: &Dims, rows: usize) -> u64 {
        8 * (rows * d.latent) as u64
    }
}

impl MoeWeights<'_> {
    /// Route `n` tokens (`x [n, E]`, normalised): sigmoid scores in f32 from the bf16 gate,
    /// bias-steered selection, weights from the unbiased scores.
    pub fn route(&self, d: &Dims, x: &[f32], n: usize) -> Routing {
        let mut r = Routing::default();
        self.route_into(d, x, n, &mut RouteBufs::default(), &mut r);
        r
    }

    /// [`MoeWeights::route`] into `r` (allocations reused).
    pub fn route_into(&self, d: &Dims, x: &[f32], n: usize, b: &mut RouteBufs, r: &mut Routing) {
        let ne = d.n_experts;
        linear_into(self.router, ne, d.hidden, x, n, &mut b.logits);
        b.logits.iter_mut().for_each(|z| *z = kernels::sigmoid(*z));
        let k = d.top_k;
        r.k = k;
        r.sel.clear();
        r.w.clear();
        for t in 0..n {
            let s = &b.logits[t * ne..(t + 1) * ne];
            select_top_k_into(s, self.bias, k, &mut b.idx);
            let w0 = r.w.len();
            r.w.extend(b.idx.iter().map(|&i| s[i as usize]));
            let ws = &mut r.w[w0..];
            if d.renormalize {
                let sum: f32 = ws.iter().sum::<f32>() + 1e-20;
                ws.iter_mut().for_each(|v| *v /= sum);
            }
            ws.iter_mut().for_each(|v| *v *= d.routed_scale);
            r.sel.extend_from_slice(&b.idx);
        }
    }

    /// The router lookahead's prediction from `x [n, E]`: the routing of
    /// [`MoeWeights::route_into`] (into `r`), its experts most likely first (every token's first
    /// choice, then every token's second, …; each expert once), so that a prefetch that runs
    /// out of time has read the likeliest ones.
    pub fn predict_into(
        &self,
        d: &Dims,
        x: &[f32],
        n: usize,
        b: &mut RouteBufs,
        r: &mut Routing,
        ids: &mut Vec<u32>,
    ) {
        self.route_into(d, x, n, b, r);
        let k = r.sel.len().checked_div(n).unwrap_or(0);
        by_rank_into(&r.sel, n, k, &mut b.seen, ids);
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
        let (mut z, mut shared, mut out) = (Vec::new(), Vec::new(), Vec::new());
        let mut slots = Slots::default();
        self.latent_in(d, x, n, &mut z);
        slots.reset(n * routing.k, d.latent);
        let layout = ExpertLayout {
            inter: d.moe_inter,
            latent: d.latent,
        };
        let failed = MoeWeights::run_experts(
            d,
            &z,
            routing,
            ids,
            &Experts::new(batch, layout),
            &mut ExpertBufs::default(),
            &mut slots,
        );
        let has_shared = self.shared_out(d, x, n, &mut MlpBufs::default(), &mut shared);
        self.up_side().combine(
            d,
            n,
            routing,
            &slots,
            has_shared.then_some(&shared[..]),
            &mut CombineBufs::default(),
            &mut out,
        );
        (out, failed)
    }

    /// The shared experts' output `[n, E]` on the full-width input into `out`; false (and
    /// `out` untouched) without shared experts. Independent of the routed experts, so it can run
    /// while they are fetched.
    pub fn shared_out(
        &self,
        d: &Dims,
        x: &[f32],
        n: usize,
        b: &mut MlpBufs,
        out: &mut Vec<f32>,
    ) -> bool {
        match &self.shared {
            Some(sh) => {
                sh.forward(d, x, n, b, out);
                true
            }
            None => false,
        }
    }

    /// The latent down-projection `z = W_down x` (`[n, latent]`) that every routed expert reads.
    pub fn latent_in(&self, d: &Dims, x: &[f32], n: usize, z: &mut Vec<f32>) {
        linear_into(self.down, d.latent, d.hidden, x, n, z)
    }

    /// Run the experts `ids` (answered by `experts`, in that order) over the latent rows `z` of
    /// the tokens routed to them, writing each (token, slot)'s output into `slots`. The result
    /// does not depend on how a layer's experts are split into requests: each expert always
    /// runs over all of its users at once. Returns the ids whose answer is unusable (their
    /// slots stay empty).
    #[allow(clippy::too_many_arguments)]
    pub fn run_experts(
        d: &Dims,
        z: &[f32],
        routing: &Routing,
        ids: &[u32],
        experts: &Experts<'_>,
        b: &mut ExpertBufs,
        slots: &mut Slots,
    ) -> Vec<(u32, String)> {
        let (lat, inter) = (d.latent, d.moe_inter);
        let k = routing.k;
        // Check every answer first: the compute below only runs usable ones.
        let mut failed = Vec::new();
        b.valid.clear();
        for (j, &id) in ids.iter().enumerate().take(experts.len()) {
            let why = experts.get(j).err().map(|e| e.to_string());
            b.valid.push(why.is_none());
            if let Some(why) = why {
                failed.push((id, why));
            }
        }
        // A layer's requests together have at most `sel.len()` users: reserve for that many once,
        // so a pass's buffers never grow past what `ExpertBufs::bytes_for` states.
        let most = routing.sel.len();
        for (v, w) in [(&mut b.zin, lat), (&mut b.work, 3 * inter), (&mut b.y, lat)] {
            if v.capacity() < most * w {
                crate::kernels::grow_exact(v, most * w);
            }
        }
        crate::kernels::grow_exact(&mut b.order, most);
        // Users grouped by expert, in request order, and their latent rows gathered.
        b.order.clear();
        b.starts.clear();
        b.starts.push(0);
        for &id in ids {
            b.order
                .extend((0..routing.sel.len()).filter(|&i| routing.sel[i] == id));
            b.starts.push(b.order.len());
        }
        let users = b.order.len();
        let zin = zeroed(&mut b.zin, users * lat);
        for (row, &i) in zin.chunks_exact_mut(lat).zip(&b.order) {
            let t = i / k;
            row.copy_from_slice(&z[t * lat..(t + 1) * lat]);
        }
        let work = zeroed(&mut b.work, users * 3 * inter);
        let y = zeroed(&mut b.y, users * lat);
        let (zin, valid, starts) = (&b.zin, &b.valid, &b.starts);
        let one = |j: usize, work: &mut [f32], y: &mut [f32]| {
            if !valid.get(j).copied().unwrap_or(false) {
                return;
            }
            let Ok(w) = experts.get(j) else { return };
            let m = starts[j + 1] - starts[j];
            let x = &zin[starts[j] * lat..starts[j + 1] * lat];
            let (g, rest) = work.split_at_mut(m * inter);
            let (u, a) = rest.split_at_mut(m * inter);
            w.w1.matmul(inter, lat, x, m, g);
            w.w3.matmul(inter, lat, x, m, u);
            kernels::situ_glu(g, u, d.situ_beta, d.situ_linear_beta, a);
            w.w2.matmul(lat, inter, a, m, y);
        };
        // Experts in parallel when one expert's products are worth a hand-off to the pool
        // (`kernels::PAR_MIN_MACS`): halved down to one expert a task. Smaller experts whose
        // half together is worth one (several sequences' experts in a decode step: `small` at
        // 4 sequences, ~16 experts of 98 Ki multiply-adds) run in two halves, one hand-off.
        // Each expert's result is the same either way.
        let all = 3 * inter * lat * users;
        let splits = if all / ids.len().max(1) >= kernels::PAR_MIN_MACS {
            u32::MAX
        } else if all >= 2 * kernels::PAR_MIN_MACS {
            1
        } else {
            0
        };
        each_expert(0, starts, work, 3 * inter, y, lat, splits, &one);
        // Scatter each computed row to its (token, slot).
        for (j, w) in b.starts.windows(2).enumerate() {
            if !b.valid.get(j).copied().unwrap_or(false) {
                continue;
            }
            for r in w[0]..w[1] {
                let i = b.order[r];
                slots.y[i * lat..(i + 1) * lat].copy_from_slice(&b.y[r * lat..(r + 1) * lat]);
                slots.ok[i] = true;
            }
        }
        failed
    }
}

/// What a MoE layer reads after its routed experts arrive: the up-projection and the latent
/// norm. Borrowed from the layer's run ([`MoeWeights::up_side`]), or from a copy held while
/// the run is given back early (`state::UpCopy`).
#[derive(Clone, Copy, Debug)]
pub struct UpSide<'a> {
    /// `routed_expert_up_proj` `[E, latent]`.
    pub up: Mat<'a>,
    /// `routed_expert_norm` `[latent]` (None when `latent_moe_use_norm` is false).
    pub norm: Option<&'a [f32]>,
}

impl<'a> MoeWeights<'a> {
    /// The weights [`UpSide::combine`] reads.
    pub fn up_side(&self) -> UpSide<'a> {
        UpSide {
            up: self.up,
            norm: self.norm,
        }
    }
}

impl UpSide<'_> {
    /// Aggregate the experts' outputs per token in selection order, normalise the aggregate,
    /// project it up and add the shared experts' output (from [`MoeWeights::shared_out`]) into
    /// `out` `[n, E]`. Slots left empty (a failed expert) are skipped.
    #[allow(clippy::too_many_arguments)]
    pub fn combine(
        &self,
        d: &Dims,
        n: usize,
        routing: &Routing,
        slots: &Slots,
        shared: Option<&[f32]>,
        b: &mut CombineBufs,
        out: &mut Vec<f32>,
    ) {
        let lat = d.latent;
        let k = routing.k;
        let acc = zeroed(&mut b.acc, n * lat);
        for t in 0..n {
            let a = &mut acc[t * lat..(t + 1) * lat];
            for j in 0..k {
                let i = t * k + j;
                if slots.ok[i] {
                    let w = routing.w[i];
                    for (av, &yv) in a.iter_mut().zip(&slots.y[i * lat..(i + 1) * lat]) {
                        *av += w * yv;
                    }
                }
            }
        }
        let acc = match &self.norm {
            Some(norm) => {
                rms_norm_rows_into(&b.acc, norm, d.rms_eps, &mut b.acc_n);
                &b.acc_n
            }
            None => &b.acc,
        };
        linear_into(self.up, d.hidden, lat, acc, n, out);
        if let Some(s) = shared {
            for (o, sv) in out.iter_mut().zip(s) {
                *o += sv;
            }
        }
    }
}

/// Runs `f(j, work_j, y_j)` for the experts `j0..` whose rows are `starts[j]..starts[j + 1]`
/// (relative to `starts[0]`) of `work` (`ws` floats a row) and `y` (`ys` a row): one after the
/// other, or halved `splits` times on the pool (each half of `splits > 0` experts runs in
/// parallel with the other, its own halved `splits − 1` times; each expert owns its rows, so
/// nothing is shared and nothing allocated).
#[allow(clippy::too_many_arguments)]
fn each_expert<F>(
    j0: usize,
    starts: &[usize],
    work: &mut [f32],
    ws: usize,
    y: &mut [f32],
    ys: usize,
    splits: u32,
    f: &F,
) where
    F: Fn(usize, &mut [f32], &mut [f32]) + Sync,
{
    let m = starts.len().saturating_sub(1);
    if splits > 0 && m > 1 {
        let mid = m / 2;
        let rows = starts[mid] - starts[0];
        let (wa, wb) = work.split_at_mut(rows * ws);
        let (ya, yb) = y.split_at_mut(rows * ys);
        rayon::join(
            || each_expert(j0, &starts[..=mid], wa, ws, ya, ys, splits - 1, f),
            || each_expert(j0 + mid, &starts[mid..], wb, ws, yb, ys, splits - 1, f),
        );
        return;
    }
    let (mut work, mut y) = (work, y);
    for (j, w) in starts.windows(2).enumerate() {
        let rows = w[1] - w[0];
        let (wj, wr) = std::mem::take(&mut work).split_at_mut(rows * ws);
        let (yj, yr) = std::mem::take(&mut y).split_at_mut(rows * ys);
        f(j0 + j, wj, yj);
        (work, y) = (wr, yr);
    }
}

#[cfg(test)]
mod tests {
    use super::{by_rank_into, each_expert};

    /// The lookahead's order: every token's first choice, then every second, …, each expert
    /// once (a later token's first choice comes before an earlier token's second), and the
    /// scratch is reused without leaking the previous call's experts.
    #[test]
    fn predictions_come_by_rank_across_tokens_each_once() {
        let (mut seen, mut ids) = (Vec::new(), Vec::new());
        // Three tokens, top-3 each.
        let ranked = [5, 1, 9, /**/ 2, 5, 1, /**/ 5, 7, 0];
        by_rank_into(&ranked, 3, 3, &mut seen, &mut ids);
        assert_eq!(ids, [5, 2, 1, 7, 9, 0]);
        by_rank_into(&[3, 5, 1], 1, 3, &mut seen, &mut ids);
        assert_eq!(ids, [3, 5, 1]);
        by_rank_into(&[], 0, 3, &mut seen, &mut ids);
        assert!(ids.is_empty());
    }

    /// Every expert gets exactly its own rows of both buffers, once, whether the experts run one
    /// after the other, in two halves or halved down to one expert a task on the pool (uneven row
    /// counts, an expert with none).
    #[test]
    fn each_expert_hands_every_expert_exactly_its_rows() {
        let starts = [0usize, 3, 4, 4, 9, 10, 12, 17];
        let (ws, ys) = (5, 2);
        let rows = *starts.last().unwrap();
        for splits in [0, 1, 2, u32::MAX] {
            let mut work = vec![0.0f32; rows * ws];
            let mut y = vec![0.0f32; rows * ys];
            let f = |j: usize, w: &mut [f32], y: &mut [f32]| {
                let m = starts[j + 1] - starts[j];
                assert_eq!((w.len(), y.len()), (m * ws, m * ys), "expert {j}");
                w.iter_mut().for_each(|v| *v += (j + 1) as f32);
                y.iter_mut().for_each(|v| *v += (j + 1) as f32);
            };
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .unwrap();
            pool.install(|| each_expert(0, &starts, &mut work, ws, &mut y, ys, splits, &f));
            for (j, s) in starts.windows(2).enumerate() {
                let want = (j + 1) as f32;
                assert!(
                    work[s[0] * ws..s[1] * ws].iter().all(|&v| v == want),
                    "splits {splits}"
                );
                assert!(
                    y[s[0] * ys..s[1] * ys].iter().all(|&v| v == want),
                    "splits {splits}"
                );
            }
        }
    }
}
