//! The top-level loop with Block Attention Residuals (SPEC.md §3.3), one code path for prefill
//! (n prompt tokens as matrix products) and decode (n = 1).
//!
//! ```text
//! bank = []; pend = embed[id]
//! for L:
//!     x = bank empty ? pend : AttnRes(bank ++ [pend]; w_selfres_L)   # guard: layer 0 only
//!     if L % block == 0: bank.push(pend); pend = NONE                 # raw snapshot, reset
//!     a = Attn_L(RMSNorm(x; input_layernorm_L));   pend = pend? pend + a : a
//!     x = AttnRes(bank ++ [pend]; w_mlpres_L)                         # no guard
//!     pend += MLP_L(RMSNorm(x; post_attention_layernorm_L))
//! logits = lm_head · RMSNorm(AttnRes(bank ++ [pend]; w_outres); norm)
//! ```
//! Per layer: `source.layer(l)`, `source.prefetch_layer(l+1)`, bind, compute, drop the run; then
//! `source.end_pass()` (an attached worker gives its ring lease back). For
//! MoE layers the tokens are routed first and the union of their experts is requested from the
//! source ONCE.

use std::time::Instant;

use k3_store::runtime::source::{PendingExperts, SourceError, WeightSource};

use super::bind::{Attn, BoundLayer, Globals, Mlp, TensorShapes};
use super::moe::{MoeWeights, UpSide};
use super::state::{LayerState, Predict, SeqState, Work};
use super::{copy_into, linear, rms_norm_rows_into, zeroed, Dims, Mat, ModelError};

/// Which positions to compute logits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position of the call (generation).
    Last,
    /// Every position of the call (teacher forcing).
    All,
}

/// One expert request made to the weight source.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TraceRecord {
    /// Generation step (0 = prefill).
    pub step: u64,
    /// Layer.
    pub layer: u32,
    /// Expert ids requested, in request order (ascending, unique).
    pub experts: Vec<u32>,
}

/// Counters the engine keeps itself.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunCounters {
    /// Routed experts whose load failed (their contribution was skipped).
    pub failed_expert_loads: u64,
    /// The first few failures, `layer L expert E: reason`.
    pub failure_messages: Vec<String>,
    /// Expert ids requested from the source.
    pub expert_requests: u64,
    /// Seconds the forward pass was blocked waiting for routed experts (the part of their
    /// fetch that did not overlap the latent projection and the shared experts).
    pub expert_wait_seconds: f64,
    /// Router lookahead: layers whose experts were predicted (and the prediction checked).
    pub lookahead_layers: u64,
    /// Router lookahead: distinct experts predicted for those layers.
    pub lookahead_predicted: u64,
    /// Router lookahead: the experts those layers then requested.
    pub lookahead_actual: u64,
    /// Router lookahead: requested experts that had been predicted (recall = this ÷ actual).
    pub lookahead_correct: u64,
    /// Router lookahead across calls: first MoE layers whose experts the previous call
    /// predicted (its last position's choices there, read during its lm_head) and checked.
    pub next_pass_layers: u64,
    /// Experts those predictions named.
    pub next_pass_predicted: u64,
    /// The experts those layers then requested.
    pub next_pass_actual: u64,
    /// Requested experts that had been predicted.
    pub next_pass_correct: u64,
    /// Where the forward passes' time went.
    pub phases: PhaseSeconds,
}

/// Wall seconds of the forward passes by phase (`k3-worker --out`: per step, and per decoded
/// token in `time_breakdown`). The phases do not overlap; what a step spends outside them
/// (the embedding, sampling, speculation's bookkeeping) is the step's remainder.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct PhaseSeconds {
    /// Waiting for `WeightSource::layer`: a trunk layer not yet read (or the store's answer).
    pub layer_wait: f64,
    /// The attention side of every layer: its input aggregate, norm and attention (KDA or MLA).
    pub attention: f64,
    /// The MLP side of every layer (aggregate, norm, router, shared and routed experts,
    /// combine), without the expert wait.
    pub mlp: f64,
    /// Waiting for routed experts not yet arrived (the part of their fetch that the latent
    /// projection and the shared experts did not cover).
    pub expert_wait: f64,
    /// The output aggregate, the final norm and the lm_head product.
    pub lm_head: f64,
}

impl PhaseSeconds {
    /// Phase by phase: `f(self.phase, other.phase)`.
    fn zip(&self, o: &PhaseSeconds, f: impl Fn(f64, f64) -> f64) -> PhaseSeconds {
        PhaseSeconds {
            layer_wait: f(self.layer_wait, o.layer_wait),
            attention: f(self.attention, o.attention),
            mlp: f(self.mlp, o.mlp),
            expert_wait: f(self.expert_wait, o.expert_wait),
            lm_head: f(self.lm_head, o.lm_head),
        }
    }

    /// `self − earlier`, phase by phase (a step's share of running totals).
    pub fn since(&self, earlier: &PhaseSeconds) -> PhaseSeconds {
        self.zip(earlier, |a, b| a - b)
    }

    /// `self + other`, phase by phase.
    pub fn plus(&self, other: &PhaseSeconds) -> PhaseSeconds {
        self.zip(other, |a, b| a + b)
    }

    /// Every phase × `f`.
    pub fn scaled(&self, f: f64) -> PhaseSeconds {
        self.zip(self, |a, _| a * f)
    }

    /// The sum of the phases.
    pub fn total(&self) -> f64 {
        self.layer_wait + self.attention + self.mlp + self.expert_wait + self.lm_head
    }
}

/// Router lookahead: while layer l computes, the next layer's router is applied to an early
/// hidden state of layer l and the predicted experts are handed to
/// [`WeightSource::prefetch_experts`]. Only the reads change; the ids never do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Lookahead {
    /// No prediction, no prefetch.
    Off,
    /// Predict from layer l's attention input (the AttnRes aggregate before the attention).
    AttnIn,
    /// Predict from layer l's MLP input (the AttnRes aggregate before the MLP).
    #[default]
    MlpIn,
}

impl Lookahead {
    /// Parse `off`, `attn-in`, `mlp-in` (`on` = the default, `mlp-in`).
    pub fn parse(s: &str) -> Result<Lookahead, String> {
        match s {
            "off" => Ok(Lookahead::Off),
            "attn-in" => Ok(Lookahead::AttnIn),
            "mlp-in" | "on" => Ok(Lookahead::MlpIn),
            other => Err(format!(
                "{}={other:?}: expected off, on, attn-in or mlp-in",
                k3_proto::paths::env::K3_LOOKAHEAD
            )),
        }
    }

    /// From `K3_LOOKAHEAD` (unset: the default).
    pub fn from_env() -> Result<Lookahead, String> {
        match std::env::var(k3_proto::paths::env::K3_LOOKAHEAD) {
            Ok(v) => Lookahead::parse(&v),
            Err(std::env::VarError::NotPresent) => Ok(Lookahead::default()),
            Err(e) => Err(format!("{}: {e}", k3_proto::paths::env::K3_LOOKAHEAD)),
        }
    }
}

/// `K3_EXPERT_OVERLAP`: `on` (or unset) or `off` ([`Model::overlap_groups`]).
pub fn overlap_groups_from_env() -> Result<bool, String> {
    on_off_from_env(k3_proto::paths::env::K3_EXPERT_OVERLAP)
}

/// `K3_EARLY_RELEASE`: `on` (or unset) or `off` ([`Model::early_release`]).
pub fn early_release_from_env() -> Result<bool, String> {
    on_off_from_env(k3_proto::paths::env::K3_EARLY_RELEASE)
}

/// A switch that is `on` unless the variable `name` says `off`; any other value is an error.
fn on_off_from_env(name: &str) -> Result<bool, String> {
    match std::env::var(name) {
        Ok(v) if v == "on" => Ok(true),
        Ok(v) if v == "off" => Ok(false),
        Ok(v) => Err(format!("{name}={v:?}: expected on or off")),
        Err(std::env::VarError::NotPresent) => Ok(true),
        Err(e) => Err(format!("{name}: {e}")),
    }
}

/// Callback receiving named per-layer intermediates: `(layer, name, values [n, E])`.
pub type Tap<'s> = Box<dyn FnMut(usize, &str, &[f32]) + 's>;

/// The model: dimensions, the weight source, the resident model-level tensors.
pub struct Model<'s> {
    /// Dimensions.
    pub dims: Dims,
    source: &'s dyn WeightSource,
    shapes: Option<&'s dyn TensorShapes>,
    globals: Globals,
    /// Each layer bound once, at its first pass (names, shapes and places checked, vectors
    /// widened); later passes only slice the run's bytes.
    bound: Vec<Option<BoundLayer>>,
    binds: u64,
    /// Failure/request counters.
    pub counters: RunCounters,
    /// When `Some`, every expert request is appended here.
    pub trace: Option<Vec<TraceRecord>>,
    /// The step number recorded in trace records (the caller advances it).
    pub step: u64,
    /// Router lookahead mode (default: from the MLP input).
    pub lookahead: Lookahead,
    /// Read the next group of a pass's experts while computing the current one, where the
    /// source allows it ([`WeightSource::overlap_expert_groups`]); default on, `K3_EXPERT_OVERLAP=off`
    /// turns it off (for A/B runs). Only what is read when changes, never the output.
    pub overlap_groups: bool,
    /// Give a streamed MoE layer's run back before its expert wait, where the source allows it
    /// ([`WeightSource::releases_layers_early`]); default on, `K3_EARLY_RELEASE=off` holds it
    /// to the end of the layer (for A/B runs). Never changes the output.
    pub early_release: bool,
    /// Optional per-layer intermediate tap, named like `scripts/k3_reference.py --dump-trace`
    /// (`attn_in`, `attn_out`, `mlp_in`, `mlp_out` per layer; `final_in` = the output
    /// aggregator's result before the final norm, reported with layer = n_layers), for locating
    /// divergences from the reference.
    pub tap: Option<Tap<'s>>,
    /// Bind a draft trunk's quantized matrices (a draft model, [`Model::draft`]).
    quant: bool,
    /// Run the routed experts. A draft model may run its MoE layers on the shared experts
    /// alone (`false`): it then never asks its source for an expert.
    pub routed_experts: bool,
}

/// What a model binds once and keeps: the model-level tensors and every layer bound so far.
/// [`Model::into_bound`] and [`Model::from_bound`] move it between models over sources that
/// live for different spans (a drafter's model is rebuilt around each call's source).
#[derive(Debug)]
pub struct Bound {
    globals: Globals,
    bound: Vec<Option<BoundLayer>>,
    binds: u64,
}

impl std::fmt::Debug for Model<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("dims", &self.dims)
            .field("counters", &self.counters)
            .finish()
    }
}

/// Keep at most this many failure messages.
const MAX_FAILURE_MESSAGES: usize = 16;

impl<'s> Model<'s> {
    /// Validate `dims` and bind the model-level tensors. Layers are bound at their first pass.
    pub fn new(
        dims: Dims,
        source: &'s dyn WeightSource,
        shapes: Option<&'s dyn TensorShapes>,
    ) -> Result<Model<'s>, ModelError> {
        dims.validate()?;
        let globals = Globals::bind(&dims, source, shapes)?;
        let bound = (0..dims.n_layers).map(|_| None).collect();
        Ok(Model::from_bound(
            dims,
            source,
            shapes,
            Bound {
                globals,
                bound,
                binds: 0,
            },
        ))
    }

    /// A model over what an earlier model bound (same dims; see [`Bound`]).
    pub fn from_bound(
        dims: Dims,
        source: &'s dyn WeightSource,
        shapes: Option<&'s dyn TensorShapes>,
        b: Bound,
    ) -> Model<'s> {
        Model {
            dims,
            source,
            shapes,
            globals: b.globals,
            bound: b.bound,
            binds: b.binds,
            counters: RunCounters::default(),
            trace: None,
            step: 0,
            lookahead: Lookahead::default(),
            overlap_groups: true,
            early_release: true,
            tap: None,
            quant: false,
            routed_experts: true,
        }
    }

    /// A draft model (over what an earlier one bound, when given): binds a draft trunk's
    /// quantized matrices (`k3_proto::quant`) as well as bf16 ones, runs no router lookahead and
    /// runs the routed experts only when `routed_experts` (those its source cannot give are
    /// skipped, their weight left out of the mix).
    pub fn draft(
        dims: Dims,
        source: &'s dyn WeightSource,
        bound: Option<Bound>,
        routed_experts: bool,
    ) -> Result<Model<'s>, ModelError> {
        let mut m = match bound {
            Some(b) => Model::from_bound(dims, source, None, b),
            None => Model::new(dims, source, None)?,
        };
        m.quant = true;
        m.routed_experts = routed_experts;
        m.lookahead = Lookahead::Off;
        Ok(m)
    }

    /// What this model bound, to build the next one with [`Model::from_bound`].
    pub fn into_bound(self) -> Bound {
        Bound {
            globals: self.globals,
            bound: self.bound,
            binds: self.binds,
        }
    }

    /// Fresh per-sequence state for at most `capacity` positions.
    pub fn new_state(&self, capacity: usize) -> SeqState {
        SeqState::new(&self.dims, capacity)
    }

    /// The weight source.
    pub fn source(&self) -> &'s dyn WeightSource {
        self.source
    }

    /// Layers bound so far (each is bound once, at its first pass).
    pub fn bound_layers(&self) -> usize {
        self.bound.iter().filter(|b| b.is_some()).count()
    }

    /// Times a layer was bound over this engine's life (= the layers run, if binding happens
    /// once per layer as it must).
    pub fn bind_count(&self) -> u64 {
        self.binds
    }

    /// Run `ids` (appended after the `st.pos` tokens already consumed) and return logits
    /// `[rows, vocab]` for the positions chosen by `which`. On error the state is unusable.
    pub fn forward(
        &mut self,
        ids: &[u32],
        st: &mut SeqState,
        which: Logits,
    ) -> Result<Vec<f32>, ModelError> {
        let Model {
            dims: d,
            source,
            shapes,
            globals,
            bound,
            binds,
            counters,
            trace,
            step,
            lookahead,
            overlap_groups,
            early_release,
            tap,
            quant,
            routed_experts,
        } = self;
        let (quant, routed_experts) = (*quant, *routed_experts);
        let overlap_groups = *overlap_groups && source.overlap_expert_groups();
        let early_release = *early_release;
        let lookahead = *lookahead;
        let (source, shapes, step) = (*source, *shapes, *step);
        let mut tap = |l: usize, name: &str, v: &[f32]| {
            if let Some(t) = tap.as_mut() {
                t(l, name, v);
            }
        };
        let (n, e) = (ids.len(), d.hidden);
        if n == 0 {
            return Err(ModelError::Input("no tokens to run".into()));
        }
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= d.vocab) {
            return Err(ModelError::Input(format!(
                "token id {bad} outside the vocabulary of {}",
                d.vocab
            )));
        }
        if st.layers.len() != d.n_layers {
            return Err(ModelError::Input(format!(
                "state for {} layers, model has {}",
                st.layers.len(),
                d.n_layers
            )));
        }
        st.reserve(n)?;

        // The residual bank and the pending sum live in the state's buffers, reused every pass.
        let scratch = &mut st.scratch;
        let n_blocks = d.n_layers.div_ceil(d.block);
        scratch.bank.resize_with(n_blocks, Vec::new);
        let mut banked = 0usize;

        // Embedding, unscaled.
        let mut pend = std::mem::take(&mut scratch.pend);
        pend.clear();
        let emb = globals.embed.bytes();
        for &id in ids {
            let o = id as usize * e * 2;
            pend.extend(
                emb[o..o + e * 2]
                    .chunks_exact(2)
                    .map(|b| crate::kernels::bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))),
            );
        }

        // The layer whose experts were predicted (router lookahead; the ids are in
        // `w.predict`), checked when it routes.
        let mut predicted: Option<usize> = None;
        // The first MoE layer this pass routed (its last position's choices are kept in
        // `scratch.next_pass`, the next pass's prediction for it).
        let mut first_moe: Option<usize> = None;
        let w = &mut scratch.work;
        for l in 0..d.n_layers {
            let (done, later) = bound.split_at_mut(l + 1);
            let slot = &mut done[l];
            let t_layer = Instant::now();
            let mut run = Some(source.layer(l)?);
            let run_ref = run.as_ref().expect("just set");
            counters.phases.layer_wait += t_layer.elapsed().as_secs_f64();
            if run_ref.layer != l {
                return Err(ModelError::Config(format!(
                    "source returned layer {} for layer {l}",
                    run_ref.layer
                )));
            }
            if l + 1 < d.n_layers {
                source.prefetch_layer(l + 1);
            }
            if slot.is_none() {
                *slot = Some(BoundLayer::bind(d, run_ref, shapes, quant)?);
                *binds += 1;
            }
            let lw = slot.as_ref().expect("bound just above").weights(run_ref)?;

            // Attention side.
            let t_attn = Instant::now();
            if banked == 0 {
                copy_into(&mut w.x, &pend);
            } else {
                let bank = &scratch.bank[..banked];
                lw.self_res
                    .aggregate(bank, &pend, n, d.rms_eps, &mut w.res, &mut w.x);
            }
            let carried = l % d.block != 0;
            if !carried {
                // Boundary: the pending sum becomes a bank entry (its buffer is reused).
                std::mem::swap(&mut scratch.bank[banked], &mut pend);
                banked += 1;
            }
            tap(l, "attn_in", &w.x);
            if lookahead == Lookahead::AttnIn {
                copy_into(&mut w.attn_in, &w.x);
            }
            rms_norm_rows_into(&w.x, lw.input_norm, d.rms_eps, &mut w.xn);
            let journal = if st.journal.active {
                st.journal.kda.get_mut(l)
            } else {
                None
            };
            match (&lw.attn, &mut st.layers[l]) {
                (Attn::Kda(a), LayerState::Kda(s)) => {
                    a.forward_into(d, &w.xn, n, s, journal, &mut w.attn.kda, &mut w.a)
                }
                (Attn::Mla(a), LayerState::Mla(c)) => {
                    a.forward_into(d, &w.xn, n, c, &mut w.attn.mla, &mut w.a)
                }
                _ => {
                    return Err(ModelError::Input(format!(
                        "state of layer {l} does not match its kind"
                    )))
                }
            }
            w.attention_done(n);
            counters.phases.attention += t_attn.elapsed().as_secs_f64();
            tap(l, "attn_out", &w.a);
            if carried {
                pend.iter_mut().zip(&w.a).for_each(|(pv, av)| *pv += av);
            } else {
                pend.clear();
                pend.extend_from_slice(&w.a);
            }

            // MLP side (bank is non-empty: layer 0 is a boundary).
            let t_mlp = Instant::now();
            let expert_wait0 = counters.expert_wait_seconds;
            let bank = &scratch.bank[..banked];
            lw.mlp_res
                .aggregate(bank, &pend, n, d.rms_eps, &mut w.res, &mut w.x);
            tap(l, "mlp_in", &w.x);
            rms_norm_rows_into(&w.x, lw.post_norm, d.rms_eps, &mut w.xn);
            // A streamed MoE layer gives its run back before the expert wait (the source's
            // ring reads the next layer meanwhile); the rest of the layer reads a copy.
            let early_release = early_release && source.releases_layers_early(l);
            let mut tail: Option<MoeTail> = None;
            let mut c = MlpCtx {
                d,
                source,
                shapes,
                binds,
                counters,
                lookahead,
                predicted: &mut predicted,
            };
            match &lw.mlp {
                Mlp::Dense(mlp) => {
                    // Nothing to fetch here: the disk is free for the next layer's predicted
                    // experts at once.
                    c.predict(l, n, later.first_mut(), w)?;
                    mlp.forward(d, &w.xn, n, &mut w.ffn.mlp, &mut w.m);
                }
                Mlp::Moe(moe) if !routed_experts => {
                    if !moe.shared_out(d, &w.xn, n, &mut w.ffn.mlp, &mut w.m) {
                        zeroed(&mut w.m, n * e);
                    }
                }
                Mlp::Moe(moe) => {
                    moe.route_into(d, &w.xn, n, &mut w.ffn.route, &mut w.ffn.routing);
                    w.ffn.routing.unique_into(&mut w.ffn.uniq);
                    let uniq = &w.ffn.uniq;
                    if lookahead != Lookahead::Off && first_moe.is_none() {
                        first_moe = Some(l);
                        let np = &mut scratch.next_pass;
                        if np.layer.take() == Some(l) {
                            let counters = &mut *c.counters;
                            counters.next_pass_layers += 1;
                            counters.next_pass_predicted += np.ids.len() as u64;
                            counters.next_pass_actual += uniq.len() as u64;
                            counters.next_pass_correct +=
                                uniq.iter().filter(|e| np.ids.contains(e)).count() as u64;
                        }
                        let r = &w.ffn.routing;
                        np.ids.clear();
                        np.ids.extend_from_slice(&r.sel[(n - 1) * r.k..n * r.k]);
                    }
                    if c.predicted.take() == Some(l) {
                        let p = &w.predict.ids;
                        let counters = &mut *c.counters;
                        counters.lookahead_layers += 1;
                        counters.lookahead_predicted += p.len() as u64;
                        counters.lookahead_actual += uniq.len() as u64;
                        counters.lookahead_correct +=
                            uniq.iter().filter(|e| p.contains(e)).count() as u64;
                    }
                    // A prefill's or a verify pass's union of experts can exceed the cache:
                    // fetch it in groups the source can hold at once. Where the source allows
                    // it, groups are half the cache and group i+1 is requested before group i is
                    // computed (its read runs under that compute); otherwise each group's slots
                    // are released (its batch dropped) before the next is requested. The output
                    // does not depend on the grouping.
                    let cap = source.max_expert_batch().max(1);
                    let ahead = overlap_groups && uniq.len() > cap && cap >= 2;
                    let group = if ahead { cap / 2 } else { cap };
                    for ids in uniq.chunks(group) {
                        if let Some(t) = trace.as_mut() {
                            t.push(TraceRecord {
                                step,
                                layer: l as u32,
                                experts: ids.to_vec(),
                            });
                        }
                        c.counters.expert_requests += ids.len() as u64;
                    }
                    // The first group's read (on the source's long-lived fetch thread) overlaps
                    // the latent down-projection and the shared experts, which do not depend on
                    // it.
                    let pending = uniq
                        .chunks(group)
                        .next()
                        .map(|ids| source.request_experts(l, ids));
                    moe.latent_in(d, &w.xn, n, &mut w.ffn.z);
                    let has_shared = moe.shared_out(d, &w.xn, n, &mut w.ffn.mlp, &mut w.ffn.shared);
                    let t = MoeTail {
                        pending,
                        has_shared,
                        group,
                        ahead,
                    };
                    if early_release {
                        // Only the up-projection and the latent norm are read after the wait:
                        // hold a copy and give the run back below, before waiting.
                        w.ffn.up.hold(&moe.up_side());
                        tail = Some(t);
                    } else {
                        c.finish_moe(l, n, later.first_mut(), moe.up_side(), t, w)?;
                    }
                }
            }
            if let Some(t) = tail {
                // The run goes back to the source first (nothing borrows it any more): a
                // streaming ring reads the next layer into its extent while this layer waits
                // for its experts.
                if let Some(r) = run.take() {
                    source.release_layer(r)?;
                }
                let up = std::mem::take(&mut w.ffn.up);
                let done = c.finish_moe(l, n, later.first_mut(), up.side(), t, w);
                w.ffn.up = up;
                done?;
            }
            let waited = counters.expert_wait_seconds - expert_wait0;
            counters.phases.expert_wait += waited;
            counters.phases.mlp += (t_mlp.elapsed().as_secs_f64() - waited).max(0.0);
            w.mlp_done(n);
            tap(l, "mlp_out", &w.m);
            pend.iter_mut().zip(&w.m).for_each(|(pv, mv)| *pv += mv);
            drop(run);
        }
        // Give back the streamed layers; a lease the store broke voids the pass.
        source.end_pass()?;
        // The next pass's first MoE layer is predicted by this pass's last position's choices
        // there, and read while the lm_head runs (the disk would otherwise idle until the next
        // pass's first MoE layer routes; SPEC §6.7).
        if let Some(l) = first_moe {
            let np = &mut scratch.next_pass;
            np.ids.truncate(source.max_expert_batch().max(1));
            source.prefetch_experts(l, &np.ids);
            np.layer = Some(l);
        }

        // Output aggregator → final norm → lm_head.
        let t_head = Instant::now();
        let bank = &scratch.bank[..banked];
        globals
            .out_res
            .aggregate(bank, &pend, n, d.rms_eps, &mut w.res, &mut w.x);
        scratch.pend = pend;
        tap(d.n_layers, "final_in", &w.x);
        let (first, rows) = match which {
            Logits::All => (0, n),
            Logits::Last => (n - 1, 1),
        };
        rms_norm_rows_into(&w.x[first * e..], &globals.final_norm, d.rms_eps, &mut w.xn);
        let logits = linear(Mat::Bf16(globals.lm_head.bytes()), d.vocab, e, &w.xn, rows);
        w.pass_done(n);
        counters.phases.lm_head += t_head.elapsed().as_secs_f64();
        st.pos += n;
        Ok(logits)
    }
}

/// A MoE layer's state between requesting its first group of experts and waiting for it.
struct MoeTail {
    /// The first group's request (`None`: the layer routed to no expert).
    pending: Option<PendingExperts>,
    /// The shared experts' output is in `FfnBufs::shared`.
    has_shared: bool,
    /// Experts per request.
    group: usize,
    /// Group `i + 1` is requested before group `i` is computed.
    ahead: bool,
}

/// What a layer's MLP side needs from the forward pass besides its weights and the work
/// buffers: the router lookahead and the MoE layer's expert wait.
struct MlpCtx<'c, 'm> {
    d: &'c Dims,
    source: &'m dyn WeightSource,
    shapes: Option<&'m dyn TensorShapes>,
    binds: &'c mut u64,
    counters: &'c mut RunCounters,
    lookahead: Lookahead,
    predicted: &'c mut Option<usize>,
}

impl MlpCtx<'_, '_> {
    /// The router lookahead (SPEC §6.7): predict the next layer's experts from this layer's
    /// early hidden state and hand them to the source as a prefetch (see [`predict_next`]).
    fn predict(
        &mut self,
        l: usize,
        n: usize,
        next_layer: Option<&mut Option<BoundLayer>>,
        w: &mut Work,
    ) -> Result<(), ModelError> {
        let early = match self.lookahead {
            Lookahead::Off => return Ok(()),
            Lookahead::AttnIn => &w.attn_in[..],
            Lookahead::MlpIn => &w.x[..],
        };
        *self.predicted = predict_next(
            self.d,
            self.source,
            self.shapes,
            next_layer,
            self.binds,
            l,
            early,
            n,
            &mut w.predict,
        )?;
        Ok(())
    }

    /// Wait for layer `l`'s routed experts, predict the next layer's from this layer's early
    /// hidden state (the disk is free again), run the experts group by group and combine them
    /// with `up` into `w.m`. The same whether `up` is the layer's run or a copy of it.
    fn finish_moe(
        &mut self,
        l: usize,
        n: usize,
        next_layer: Option<&mut Option<BoundLayer>>,
        up: UpSide<'_>,
        t: MoeTail,
        w: &mut Work,
    ) -> Result<(), ModelError> {
        let t_wait = Instant::now();
        let first = t.pending.map(|p| p.wait());
        self.counters.expert_wait_seconds += t_wait.elapsed().as_secs_f64();
        w.ffn.slots.reset(w.ffn.routing.sel.len(), self.d.latent);
        // The disk is free again: read ahead what the next layer's router would choose from
        // this layer's early hidden state, if its router is resident.
        self.predict(l, n, next_layer, w)?;
        let (d, source, counters) = (self.d, self.source, &mut *self.counters);
        // The answer for the group about to be computed: the first group's (waited for above),
        // then, with overlap, the request made before the previous group was computed; without,
        // a request made now.
        let uniq = &w.ffn.uniq;
        let mut next: Option<PendingExperts> = first.map(PendingExperts::ready);
        for (gi, ids) in uniq.chunks(t.group).enumerate() {
            let t_wait = Instant::now();
            let batch = match next.take().map(PendingExperts::wait) {
                Some(Ok(b)) => b,
                Some(Err(SourceError::Panicked(message))) => {
                    return Err(ModelError::FetchPanicked { layer: l, message })
                }
                Some(Err(e)) => return Err(e.into()),
                None => source.experts(l, ids)?,
            };
            counters.expert_wait_seconds += t_wait.elapsed().as_secs_f64();
            if t.ahead {
                next = uniq
                    .chunks(t.group)
                    .nth(gi + 1)
                    .map(|ids| source.request_experts(l, ids));
            }
            if batch.experts.len() != ids.len() {
                return Err(ModelError::Config(format!(
                    "source answered {} experts for a request of {} (layer {l})",
                    batch.experts.len(),
                    ids.len()
                )));
            }
            let failed = MoeWeights::run_experts(
                d,
                &w.ffn.z,
                &w.ffn.routing,
                ids,
                &batch,
                &mut w.ffn.experts,
                &mut w.ffn.slots,
            );
            for (id, why) in failed {
                counters.failed_expert_loads += 1;
                if counters.failure_messages.len() < MAX_FAILURE_MESSAGES {
                    counters
                        .failure_messages
                        .push(format!("layer {l} expert {id}: {why}"));
                }
            }
        }
        let shared = t.has_shared.then_some(&w.ffn.shared[..]);
        up.combine(
            d,
            n,
            &w.ffn.routing,
            &w.ffn.slots,
            shared,
            &mut w.ffn.combine,
            &mut w.m,
        );
        Ok(())
    }
}

/// Router lookahead: apply layer `l + 1`'s router to `h` (`[n, E]`, an early hidden state of
/// layer `l`) when that layer is a resident MoE layer (bound here if it was not yet), hand the
/// predicted experts (at most one request's worth) to the source as a prefetch, and keep them in
/// `p.ids` to be checked when layer `l + 1` routes. Returns `Some(l + 1)` when it predicted.
#[allow(clippy::too_many_arguments)]
fn predict_next(
    d: &Dims,
    source: &dyn WeightSource,
    shapes: Option<&dyn TensorShapes>,
    next: Option<&mut Option<BoundLayer>>,
    binds: &mut u64,
    l: usize,
    h: &[f32],
    n: usize,
    p: &mut Predict,
) -> Result<Option<usize>, ModelError> {
    let Some(next) = next else { return Ok(None) };
    let Some(run) = source.resident_layer(l + 1) else {
        return Ok(None);
    };
    if next.is_none() {
        *next = Some(BoundLayer::bind(d, &run, shapes, false)?);
        *binds += 1;
    }
    let nw = next.as_ref().expect("bound just above").weights(&run)?;
    let Mlp::Moe(moe) = &nw.mlp else {
        return Ok(None);
    };
    rms_norm_rows_into(h, nw.post_norm, d.rms_eps, &mut p.hn);
    moe.predict_into(d, &p.hn, n, &mut p.route, &mut p.routing, &mut p.ids);
    p.ids.truncate(source.max_expert_batch().max(1));
    source.prefetch_experts(l + 1, &p.ids);
    Ok(Some(l + 1))
}
