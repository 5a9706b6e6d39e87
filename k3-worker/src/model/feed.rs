//! The weights feed: what the forward pass asks of its weights, and everything about WHEN bytes
//! are read that the maths never sees.
//!
//! The forward pass asks for two things: layer `l`'s weights ([`Feed::layer`]: typed matrices,
//! bound once) and the experts its rows routed to ([`Feed::request_experts`], then
//! [`Feed::next_experts`]: typed expert matrices, group by group). Behind those two calls live
//! the hint for the next layer's read, the router lookahead (SPEC.md §6.7: the next layer's
//! router applied to this layer's early hidden state, and the next pass's first MoE layer),
//! the split of a large union of experts into groups the source can hold and the overlap of
//! their reads, the early release of a streamed layer, the request trace, the failure count and
//! the phase clock of the run report. None of it changes a single output bit: only what is read
//! when.
//!
//! The forward pass also shows the feed what it computes at the named points of a layer
//! ([`Feed::seen`]): the debug tap, the lookahead's early hidden state and the phase clock read
//! them there.

use std::sync::Arc;
use std::time::Instant;

use k3_proto::expert::ExpertLayout;
use k3_proto::paths::EnvError;
use k3_store::runtime::source::{ExpertBatch, LayerRun, PendingExperts, SourceError, WeightSource};

use super::bind::{BoundLayer, LayerWeights, Mlp, TensorShapes};
use super::dims::{Dims, ModelError};
use super::mats::{copy_into, rms_norm_rows_into, Experts};
use super::moe::{RouteBufs, Routing};

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

impl RunCounters {
    /// Count a prediction of `predicted` experts against the `actual` ones the layer requested;
    /// returns (layers, predicted, actual, correct) increments for the caller's counters.
    fn score(predicted: &[u32], actual: &[u32]) -> [u64; 4] {
        let correct = actual.iter().filter(|e| predicted.contains(e)).count();
        [
            1,
            predicted.len() as u64,
            actual.len() as u64,
            correct as u64,
        ]
    }
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
    pub fn parse(s: &str) -> Result<Lookahead, EnvError> {
        match s {
            "off" => Ok(Lookahead::Off),
            "attn-in" => Ok(Lookahead::AttnIn),
            "mlp-in" | "on" => Ok(Lookahead::MlpIn),
            other => Err(EnvError::Invalid {
                name: k3_proto::paths::env::K3_LOOKAHEAD,
                value: other.to_string(),
                expected: "off, on, attn-in or mlp-in",
            }),
        }
    }

    /// From `K3_LOOKAHEAD` (unset: the default).
    pub fn from_env() -> Result<Lookahead, EnvError> {
        let name = k3_proto::paths::env::K3_LOOKAHEAD;
        match std::env::var(name) {
            Ok(v) => Lookahead::parse(&v),
            Err(std::env::VarError::NotPresent) => Ok(Lookahead::default()),
            Err(source) => Err(EnvError::Unreadable { name, source }),
        }
    }
}

/// `K3_EXPERT_OVERLAP`: `on` (or unset) or `off` ([`FeedOptions::overlap_groups`]).
pub fn overlap_groups_from_env() -> Result<bool, EnvError> {
    on_off_from_env(k3_proto::paths::env::K3_EXPERT_OVERLAP)
}

/// `K3_EARLY_RELEASE`: `on` (or unset) or `off` ([`FeedOptions::early_release`]).
pub fn early_release_from_env() -> Result<bool, EnvError> {
    on_off_from_env(k3_proto::paths::env::K3_EARLY_RELEASE)
}

/// A switch that is `on` unless the variable `name` says `off`; any other value is an error.
fn on_off_from_env(name: &'static str) -> Result<bool, EnvError> {
    match std::env::var(name) {
        Ok(v) if v == "on" => Ok(true),
        Ok(v) if v == "off" => Ok(false),
        Ok(value) => Err(EnvError::Invalid {
            name,
            value,
            expected: "on or off",
        }),
        Err(std::env::VarError::NotPresent) => Ok(true),
        Err(source) => Err(EnvError::Unreadable { name, source }),
    }
}

/// How the feed reads ahead. Never changes an output bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeedOptions {
    /// Router lookahead mode (default: from the MLP input).
    pub lookahead: Lookahead,
    /// Read the next group of a pass's experts while computing the current one, where the
    /// source allows it ([`WeightSource::overlap_expert_groups`]); default on,
    /// `K3_EXPERT_OVERLAP=off` turns it off (for A/B runs).
    pub overlap_groups: bool,
    /// Give a streamed MoE layer's run back before its expert wait, where the source allows it
    /// ([`WeightSource::releases_layers_early`]); default on, `K3_EARLY_RELEASE=off` holds it
    /// to the end of the layer (for A/B runs).
    pub early_release: bool,
}

impl Default for FeedOptions {
    fn default() -> Self {
        FeedOptions {
            lookahead: Lookahead::default(),
            overlap_groups: true,
            early_release: true,
        }
    }
}

impl FeedOptions {
    /// From `K3_LOOKAHEAD`, `K3_EXPERT_OVERLAP` and `K3_EARLY_RELEASE`.
    pub fn from_env() -> Result<FeedOptions, EnvError> {
        Ok(FeedOptions {
            lookahead: Lookahead::from_env()?,
            overlap_groups: overlap_groups_from_env()?,
            early_release: early_release_from_env()?,
        })
    }
}

/// Callback receiving named per-layer intermediates: `(layer, name, values [n, E])`.
pub type Tap<'s> = Box<dyn FnMut(usize, &str, &[f32]) + 's>;

/// The named points of a layer where the forward pass shows the feed what it computed
/// ([`Feed::seen`]); the tap names them like `scripts/k3_reference.py --dump-trace`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    /// The attention input (the AttnRes aggregate before the attention).
    AttnIn,
    /// The attention output: the attention phase ends here.
    AttnOut,
    /// The MLP input (the AttnRes aggregate before the MLP).
    MlpIn,
    /// The MLP output: the MLP phase ends here.
    MlpOut,
    /// The output aggregate before the final norm (reported with layer = n_layers).
    FinalIn,
}

impl Point {
    fn name(self) -> &'static str {
        match self {
            Point::AttnIn => "attn_in",
            Point::AttnOut => "attn_out",
            Point::MlpIn => "mlp_in",
            Point::MlpOut => "mlp_out",
            Point::FinalIn => "final_in",
        }
    }
}

/// What the feed keeps from one pass to the next (owned by the model): every layer bound so far
/// and the router lookahead's buffers and its prediction for the next pass.
#[derive(Debug)]
pub(crate) struct FeedStore {
    /// Each layer bound once, at its first pass (names, shapes and places checked, vectors
    /// widened); later passes only slice the run's bytes.
    pub(crate) bound: Vec<Option<Arc<BoundLayer>>>,
    /// Layers bound over the model's life.
    pub(crate) binds: u64,
    /// The router lookahead's temporaries.
    predict: Predict,
    /// The prediction of the next call's first MoE layer, read ahead during this call's lm_head.
    next_pass: NextPass,
    /// The pass's embedding rows as the source gave them (bf16).
    rows: Vec<u8>,
}

impl FeedStore {
    /// Bytes the feed's buffers reach in a pass of `rows` positions: the embedding rows (bf16),
    /// the attention input's copy and the norm of the early hidden state (`[rows, E]` each), the
    /// router's buffers and
    /// routing ([`RouteBufs::bytes_for`], [`Routing::bytes_for`]) and the predicted experts.
    pub fn bytes_for(d: &Dims, rows: usize) -> u64 {
        8 * (rows * d.hidden) as u64
            + 2 * (rows * d.hidden) as u64
            + RouteBufs::bytes_for(d, rows)
            + Routing::bytes_for(d, rows)
            + 4 * d.n_experts as u64
    }

    /// Over layers an earlier model bound.
    pub(crate) fn from_bound(bound: Vec<Option<Arc<BoundLayer>>>, binds: u64) -> FeedStore {
        FeedStore {
            bound,
            binds,
            predict: Predict::default(),
            next_pass: NextPass::default(),
            rows: Vec::new(),
        }
    }
}

/// The router lookahead's temporaries and its prediction for the next layer.
#[derive(Clone, Debug, Default)]
struct Predict {
    /// The attention input, kept for a prediction from it ([`Lookahead::AttnIn`]).
    attn_in: Vec<f32>,
    hn: Vec<f32>,
    route: RouteBufs,
    routing: Routing,
    /// The predicted experts, most likely first ([`super::moe::MoeWeights::predict_into`]).
    ids: Vec<u32>,
}

/// The router lookahead's prediction for the next forward call (SPEC §6.7): the first MoE
/// layer's choices at this call's last position.
#[derive(Clone, Debug, Default)]
struct NextPass {
    /// The layer they were handed to the source for (`None`: no prediction pending).
    layer: Option<usize>,
    /// The experts, in selection order.
    ids: Vec<u32>,
}

/// Layer `l`'s weights for one pass: its bound form and its bytes, held until the layer is done
/// or given back early ([`Feed::release`]).
#[derive(Debug)]
pub struct Layer {
    bound: Arc<BoundLayer>,
    run: LayerRun,
}

impl Layer {
    /// The layer's typed weights (views onto its bytes; no copy, no look-up).
    pub fn weights(&self) -> Result<LayerWeights<'_>, ModelError> {
        self.bound.weights(&self.run)
    }
}

/// A layer's expert request in progress: its union of experts split into groups the source can
/// hold, the group to hand out next and the read already started for it.
#[derive(Debug)]
pub struct ExpertStream {
    l: usize,
    /// Experts per request.
    group: usize,
    /// Group `i + 1` is requested before group `i` is computed.
    ahead: bool,
    /// The next group's index.
    next: usize,
    /// The read started for it.
    pending: Option<PendingExperts>,
}

/// One group of a layer's experts as answered: `ids[range]` of the layer's union, their
/// matrices through [`ExpertGroup::experts`].
#[derive(Debug)]
pub struct ExpertGroup {
    /// Where the group's ids sit in the union the request was made for.
    pub range: std::ops::Range<usize>,
    batch: ExpertBatch,
    layout: ExpertLayout,
}

impl ExpertGroup {
    /// The group's experts, typed.
    pub fn experts(&self) -> Experts<'_> {
        Experts::new(&self.batch, self.layout)
    }
}

/// Keep at most this many failure messages.
const MAX_FAILURE_MESSAGES: usize = 16;

/// The feed of one forward pass: the source, what the model keeps, its counters and options.
pub(crate) struct Feed<'p, 's> {
    pub(crate) d: &'p Dims,
    pub(crate) source: &'s dyn WeightSource,
    pub(crate) shapes: Option<&'s dyn TensorShapes>,
    /// Bind a draft trunk's quantized matrices.
    pub(crate) quant: bool,
    pub(crate) opts: FeedOptions,
    pub(crate) store: &'p mut FeedStore,
    pub(crate) counters: &'p mut RunCounters,
    pub(crate) trace: Option<&'p mut Vec<TraceRecord>>,
    pub(crate) step: u64,
    pub(crate) tap: Option<&'p mut Tap<'s>>,
    /// The layer whose experts were predicted (the ids are in `store.predict`), checked when it
    /// routes.
    predicted: Option<usize>,
    /// The first MoE layer this pass routed (its last position's choices are kept in
    /// `store.next_pass`, the next pass's prediction for it).
    first_moe: Option<usize>,
    /// When the phase being timed began.
    mark: Instant,
    /// The expert wait inside the MLP phase being timed.
    waited: f64,
}

impl<'p, 's> Feed<'p, 's> {
    /// The feed of a pass.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        d: &'p Dims,
        source: &'s dyn WeightSource,
        shapes: Option<&'s dyn TensorShapes>,
        quant: bool,
        opts: FeedOptions,
        store: &'p mut FeedStore,
        counters: &'p mut RunCounters,
        trace: Option<&'p mut Vec<TraceRecord>>,
        step: u64,
        tap: Option<&'p mut Tap<'s>>,
    ) -> Self {
        let opts = FeedOptions {
            overlap_groups: opts.overlap_groups && source.overlap_expert_groups(),
            ..opts
        };
        Feed {
            d,
            source,
            shapes,
            quant,
            opts,
            store,
            counters,
            trace,
            step,
            tap,
            predicted: None,
            first_moe: None,
            mark: Instant::now(),
            waited: 0.0,
        }
    }

    /// Seconds since the last mark; marks now.
    fn lap(&mut self) -> f64 {
        let now = Instant::now();
        let s = now.duration_since(self.mark).as_secs_f64();
        self.mark = now;
        s
    }

    /// The embedding rows of `ids` (bf16 `[n, E]`), as the source reads them.
    pub(crate) fn embed(&mut self, ids: &[u32]) -> Result<&[u8], ModelError> {
        let row = 2 * self.d.hidden;
        let rows = &mut self.store.rows;
        crate::kernels::grow_exact(rows, ids.len() * row);
        self.source
            .tensor_rows(k3_proto::names::EMBED, row, ids, rows)?;
        Ok(rows)
    }

    /// Layer `l`'s weights: waits for its bytes (timed as the layer wait), hints the next layer's
    /// read and binds the layer at its first pass. The attention phase starts when it returns.
    pub(crate) fn layer(&mut self, l: usize) -> Result<Layer, ModelError> {
        self.lap();
        let run = self.source.layer(l)?;
        self.counters.phases.layer_wait += self.lap();
        if run.layer != l {
            return Err(ModelError::Config(format!(
                "source returned layer {} for layer {l}",
                run.layer
            )));
        }
        if l + 1 < self.d.n_layers {
            self.source.prefetch_layer(l + 1);
        }
        let bound = self.bound(l, &run)?;
        self.lap();
        Ok(Layer { bound, run })
    }

    /// Layer `l` bound (at its first pass, from `run`).
    fn bound(&mut self, l: usize, run: &LayerRun) -> Result<Arc<BoundLayer>, ModelError> {
        let slot = &mut self.store.bound[l];
        if let Some(b) = slot {
            return Ok(b.clone());
        }
        let b = Arc::new(BoundLayer::bind(self.d, run, self.shapes, self.quant)?);
        *slot = Some(b.clone());
        self.store.binds += 1;
        Ok(b)
    }

    /// The forward pass computed `v` at `point` of layer `l`: the tap sees it, the lookahead
    /// keeps the attention input when it predicts from it, the phase clock turns.
    pub(crate) fn seen(&mut self, l: usize, point: Point, v: &[f32]) {
        match point {
            Point::AttnIn if self.opts.lookahead == Lookahead::AttnIn => {
                copy_into(&mut self.store.predict.attn_in, v)
            }
            Point::AttnOut => self.counters.phases.attention += self.lap(),
            Point::MlpOut => {
                let t = self.lap();
                self.counters.phases.expert_wait += self.waited;
                self.counters.phases.mlp += (t - self.waited).max(0.0);
                self.waited = 0.0;
            }
            _ => {}
        }
        if let Some(t) = self.tap.as_mut() {
            t(l, point.name(), v);
        }
    }

    /// A layer without routed experts (dense, or a draft's shared experts only): the disk is
    /// free for the next layer's predicted experts at once (`mlp_in`: this layer's MLP input).
    pub(crate) fn no_experts(&mut self, l: usize, mlp_in: &[f32]) -> Result<(), ModelError> {
        self.predict_next(l, mlp_in)
    }

    /// Layer `l`'s rows routed as `routing` to the distinct experts `uniq` (ascending): request
    /// them, the first group's read starting now on the source's fetch thread (it overlaps the
    /// latent projection and the shared experts the caller computes next). A prefill's or a
    /// verify pass's union can exceed what the source holds at once: it is fetched in groups,
    /// each read while the previous one is computed where the source allows it.
    pub(crate) fn request_experts(
        &mut self,
        l: usize,
        routing: &Routing,
        uniq: &[u32],
    ) -> ExpertStream {
        let n = routing.sel.len().checked_div(routing.k).unwrap_or(0);
        if self.opts.lookahead != Lookahead::Off && self.first_moe.is_none() {
            self.first_moe = Some(l);
            let np = &mut self.store.next_pass;
            if np.layer.take() == Some(l) {
                let [a, b, c, e] = RunCounters::score(&np.ids, uniq);
                let cn = &mut *self.counters;
                cn.next_pass_layers += a;
                cn.next_pass_predicted += b;
                cn.next_pass_actual += c;
                cn.next_pass_correct += e;
            }
            copy_into(
                &mut np.ids,
                &routing.sel[(n - 1) * routing.k..n * routing.k],
            );
        }
        if self.predicted.take() == Some(l) {
            let [a, b, c, e] = RunCounters::score(&self.store.predict.ids, uniq);
            let cn = &mut *self.counters;
            cn.lookahead_layers += a;
            cn.lookahead_predicted += b;
            cn.lookahead_actual += c;
            cn.lookahead_correct += e;
        }
        let cap = self.source.max_expert_batch().max(1);
        let ahead = self.opts.overlap_groups && uniq.len() > cap && cap >= 2;
        let group = if ahead { cap / 2 } else { cap };
        for ids in uniq.chunks(group) {
            if let Some(t) = self.trace.as_mut() {
                t.push(TraceRecord {
                    step: self.step,
                    layer: l as u32,
                    experts: ids.to_vec(),
                });
            }
            self.counters.expert_requests += ids.len() as u64;
        }
        let pending = uniq
            .chunks(group)
            .next()
            .map(|ids| self.source.request_experts(l, ids));
        ExpertStream {
            l,
            group,
            ahead,
            next: 0,
            pending,
        }
    }

    /// True when layer `l`'s run should be given back before its expert wait
    /// ([`Feed::release`]): the source streams it through a ring, whose reader then reads the
    /// next layer meanwhile.
    pub(crate) fn releases_early(&self, l: usize) -> bool {
        self.opts.early_release && self.source.releases_layers_early(l)
    }

    /// Give a layer's run back before the pass ends (see [`Feed::releases_early`]).
    pub(crate) fn release(&mut self, layer: Layer) -> Result<(), ModelError> {
        let Layer { bound, run } = layer;
        drop(bound);
        Ok(self.source.release_layer(run)?)
    }

    /// The next group of `s`'s experts (the ids are `uniq[group.range]`), waiting for it (timed
    /// as the expert wait); `None` when every group was handed out. After the first wait the
    /// disk is free again: the next layer's experts are predicted from this layer's early hidden
    /// state (`mlp_in`, or the attention input kept at [`Point::AttnIn`]).
    pub(crate) fn next_experts(
        &mut self,
        s: &mut ExpertStream,
        uniq: &[u32],
        mlp_in: &[f32],
    ) -> Result<Option<ExpertGroup>, ModelError> {
        let l = s.l;
        let t = Instant::now();
        let first = s.next == 0;
        let answer = s.pending.take().map(PendingExperts::wait);
        self.waited += t.elapsed().as_secs_f64();
        self.counters.expert_wait_seconds += t.elapsed().as_secs_f64();
        if first {
            self.predict_next(l, mlp_in)?;
        }
        let start = s.next * s.group;
        if start >= uniq.len() {
            return Ok(None);
        }
        let range = start..(start + s.group).min(uniq.len());
        let ids = &uniq[range.clone()];
        let batch = match answer {
            Some(Ok(b)) => b,
            Some(Err(SourceError::Panicked(message))) => {
                return Err(ModelError::FetchPanicked { layer: l, message })
            }
            Some(Err(e)) => return Err(e.into()),
            None => {
                let t = Instant::now();
                let b = self.source.experts(l, ids)?;
                self.waited += t.elapsed().as_secs_f64();
                self.counters.expert_wait_seconds += t.elapsed().as_secs_f64();
                b
            }
        };
        s.next += 1;
        if s.ahead {
            s.pending = uniq
                .chunks(s.group)
                .nth(s.next)
                .map(|ids| self.source.request_experts(l, ids));
        }
        if batch.experts.len() != ids.len() {
            return Err(ModelError::Config(format!(
                "source answered {} experts for a request of {} (layer {l})",
                batch.experts.len(),
                ids.len()
            )));
        }
        Ok(Some(ExpertGroup {
            range,
            batch,
            layout: ExpertLayout {
                inter: self.d.moe_inter,
                latent: self.d.latent,
            },
        }))
    }

    /// Count the experts of layer `l` whose answer was unusable (the run then exits 4).
    pub(crate) fn failed(&mut self, l: usize, failed: Vec<(u32, String)>) {
        let c = &mut *self.counters;
        for (id, why) in failed {
            c.failed_expert_loads += 1;
            if c.failure_messages.len() < MAX_FAILURE_MESSAGES {
                c.failure_messages
                    .push(format!("layer {l} expert {id}: {why}"));
            }
        }
    }

    /// The router lookahead (SPEC §6.7): apply layer `l + 1`'s router to layer `l`'s early
    /// hidden state when that layer is a resident MoE layer (bound here if it was not yet), hand
    /// the predicted experts (at most one request's worth) to the source as a prefetch, and keep
    /// them to be checked when layer `l + 1` routes.
    fn predict_next(&mut self, l: usize, mlp_in: &[f32]) -> Result<(), ModelError> {
        let early = match self.opts.lookahead {
            Lookahead::Off => return Ok(()),
            Lookahead::AttnIn => std::mem::take(&mut self.store.predict.attn_in),
            Lookahead::MlpIn => Vec::new(),
        };
        let h = if self.opts.lookahead == Lookahead::AttnIn {
            &early[..]
        } else {
            mlp_in
        };
        let done = self.predict_from(l, h);
        if self.opts.lookahead == Lookahead::AttnIn {
            self.store.predict.attn_in = early;
        }
        done
    }

    fn predict_from(&mut self, l: usize, h: &[f32]) -> Result<(), ModelError> {
        let d = self.d;
        if l + 1 >= d.n_layers {
            return Ok(());
        }
        let Some(run) = self.source.resident_layer(l + 1) else {
            return Ok(());
        };
        let next = self.bound(l + 1, &run)?;
        let nw = next.weights(&run)?;
        let Mlp::Moe(moe) = &nw.mlp else {
            return Ok(());
        };
        let p = &mut self.store.predict;
        let n = h.len() / d.hidden;
        rms_norm_rows_into(h, nw.post_norm, d.rms_eps, &mut p.hn);
        moe.predict_into(d, &p.hn, n, &mut p.route, &mut p.routing, &mut p.ids);
        p.ids.truncate(self.source.max_expert_batch().max(1));
        self.source.prefetch_experts(l + 1, &p.ids);
        self.predicted = Some(l + 1);
        Ok(())
    }

    /// The pass is done with the trunk layers and the experts: give back the streamed layers (a
    /// lease the store broke voids the pass) and read ahead the next pass's first MoE layer's
    /// predicted experts (this pass's last position's choices there) while the lm_head runs —
    /// the disk would otherwise idle until the next pass's first MoE layer routes (SPEC §6.7).
    /// The lm_head phase starts when it returns.
    pub(crate) fn end_pass(&mut self) -> Result<(), ModelError> {
        self.source.end_pass()?;
        if let Some(l) = self.first_moe {
            let np = &mut self.store.next_pass;
            np.ids.truncate(self.source.max_expert_batch().max(1));
            self.source.prefetch_experts(l, &np.ids);
            np.layer = Some(l);
        }
        self.lap();
        Ok(())
    }

    /// The logits are computed: the lm_head phase ends. A pass of more than
    /// [`super::dims::KEEP_BUFFERS_MAX_POSITIONS`] rows gives the lookahead's buffers back.
    pub(crate) fn head_done(&mut self, rows: usize) {
        self.counters.phases.lm_head += self.lap();
        if rows > super::dims::KEEP_BUFFERS_MAX_POSITIONS {
            self.store.predict = Predict::default();
        }
    }
}
