//! Speculative decoding (SPEC.md §3.12): drafters propose the next ids, one forward pass runs the
//! last emitted id plus the K drafts, and the model's own pick at every position decides. The
//! emitted ids are the ids plain decoding emits — greedy or sampled with the same seed — because
//! every position's logits are bit-identical to a one-position pass's (I39) and the sampler draws
//! once per emitted id either way. A draft only changes how many ids one read of the weights
//! yields.
//!
//! K is chosen per pass ([`SpecMode::Auto`]) from the measured acceptance and a cost model of
//! the pass fitted on this run: `T(K) = t1 + K·c1` (one-position pass + each extra position's
//! compute and expert reads), expected ids `E(K) = Σ_{i≤K} aⁱ`. K maximises `E(K)/T(K)` and is
//! 0 unless that beats plain decoding by [`MIN_GAIN`]; with K = 0 a one-draft probe runs every
//! [`PROBE_EVERY`] passes so a drafter that starts agreeing is noticed.

use k3_store::runtime::draft::{DraftSource, ResidentExperts};
use k3_store::runtime::source::WeightSource;

use crate::model::forward::{Bound, Logits, Model};
use crate::model::state::{KdaState, LayerState, SeqState};
use crate::model::{Dims, ModelError};

/// How many ids to draft per pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecMode {
    /// Plain decoding: one position per pass.
    Off,
    /// K chosen per pass from the measured acceptance and pass costs (the default).
    Auto,
    /// Always draft this many ids (fewer when the drafter has fewer, or near the end).
    Fixed(usize),
}

/// A `--spec` value that is not a mode.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("expected auto, off or a draft length 1..={MAX_K}")]
pub struct BadSpecMode;

impl std::str::FromStr for SpecMode {
    type Err = BadSpecMode;
    fn from_str(s: &str) -> Result<SpecMode, BadSpecMode> {
        match s {
            "off" | "0" => Ok(SpecMode::Off),
            "auto" => Ok(SpecMode::Auto),
            n => match n.parse::<usize>() {
                Ok(k) if (1..=MAX_K).contains(&k) => Ok(SpecMode::Fixed(k)),
                _ => Err(BadSpecMode),
            },
        }
    }
}

/// Largest fixed K: the verify pass's memory (journal, logits rows, activations) is planned for
/// the mode's largest K ([`SpecMode::max_drafts`]).
pub const MAX_K: usize = 16;

// A verify pass keeps its buffers for the next one, like a decode step (the model frees the
// buffers of larger passes, prefill chunks, after each stage).
const _: () = assert!(MAX_K < crate::model::state::KEEP_BUFFERS_MAX_POSITIONS);

/// Largest K auto mode drafts: at 75% acceptance the 9th position adds under 0.08 expected ids,
/// and each position costs journal memory (~0.3 MB per KDA layer at full scale).
pub const AUTO_MAX_K: usize = 8;

impl SpecMode {
    /// The most ids one pass may draft in this mode.
    pub fn max_drafts(self) -> usize {
        match self {
            SpecMode::Off => 0,
            SpecMode::Auto => AUTO_MAX_K,
            SpecMode::Fixed(k) => k,
        }
    }
}

/// Auto mode speculates only when the model predicts at least this speed-up over plain decoding.
pub const MIN_GAIN: f64 = 1.03;

/// Auto mode at K = 0 probes with one draft after this many plain passes.
pub const PROBE_EVERY: u32 = 16;

/// The longest gap between probes of a costly drafter (each failed probe doubles it).
pub const MAX_PROBE_EVERY: u32 = 1024;

impl std::fmt::Debug for dyn Drafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Drafter({})", self.name())
    }
}

/// Proposes the ids likely to follow a context. A drafter may be wrong or return nothing; it
/// cannot change an emitted id, only the cost of producing it.
pub trait Drafter: Send {
    /// Short name for reports (`ngram`, `history`, `replay`, ...).
    fn name(&self) -> &'static str;
    /// A draft model's forward calls and seconds so far (`None` for other drafters). A drafter
    /// that has one costs time per id of the sequence (it runs every id it has not seen before
    /// it drafts): auto mode then probes ever more rarely once drafts have stopped paying
    /// ([`Controller::costly_drafter`]).
    fn model_cost(&self) -> Option<(u64, f64)> {
        None
    }
    /// Up to `k` ids to follow `context` (every id so far; the last one is not yet run).
    fn draft(&mut self, source: &dyn WeightSource, context: &[u32], k: usize) -> Vec<u32>;
}

/// N-gram lookup over the job's own ids: the continuation of the longest earlier occurrence of
/// the context's last 3–8 ids (prompts that quote, edit or repeat their input).
#[derive(Debug, Default)]
pub struct NgramDrafter;

impl Drafter for NgramDrafter {
    fn name(&self) -> &'static str {
        "ngram"
    }
    fn draft(&mut self, _: &dyn WeightSource, context: &[u32], k: usize) -> Vec<u32> {
        k3_proto::draft::lookup(context, context, k)
            .map(|(_, c)| c.to_vec())
            .unwrap_or_default()
    }
}

/// The store's history of earlier jobs' token streams (attached workers; nothing standalone).
/// A failed query is reported once and drafts nothing: drafting is never worth failing a job.
#[derive(Debug, Default)]
pub struct HistoryDrafter {
    warned: bool,
}

impl Drafter for HistoryDrafter {
    fn name(&self) -> &'static str {
        "history"
    }
    fn draft(&mut self, source: &dyn WeightSource, context: &[u32], k: usize) -> Vec<u32> {
        match source.history_draft(context, k) {
            Ok(ids) => ids,
            Err(e) => {
                if !self.warned {
                    tracing::warn!("history drafting off for this job: {e}");
                    self.warned = true;
                }
                Vec::new()
            }
        }
    }
}

/// The most ids a draft model runs to catch up before it drafts; further behind (auto mode
/// after a long plain stretch), it restarts on the last this many ids.
pub const MAX_CATCH_UP: usize = 64;

/// Which routed experts a draft model runs (`--draft-experts`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftExperts {
    /// The routed experts the job's cache holds right now (no read, no wait), and the shared
    /// experts.
    Resident,
    /// The shared experts alone.
    Shared,
}

/// A quantized copy of the model held in memory (`--draft model`, a draft trunk from
/// `k3-ctl pack-trunk --draft`), shared by the drafters of every sequence the engine runs: the
/// trunk is read once, what its model binds is kept across calls, and each sequence's
/// [`ModelDrafter`] holds only its own state.
pub struct DraftModel {
    source: DraftSource,
    dims: Dims,
    /// What the draft model bound (taken by a call, put back after it).
    bound: std::sync::Mutex<Option<Bound>>,
    /// Most ids per catch-up pass (the job's prefill chunk).
    chunk: usize,
    experts: DraftExperts,
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModel")
            .field("source", &self.source)
            .finish()
    }
}

impl DraftModel {
    /// The draft model over `source` (the draft trunk), catching up at most `chunk` ids per
    /// pass, running the routed experts `experts` says.
    pub fn new(
        source: DraftSource,
        dims: Dims,
        chunk: usize,
        experts: DraftExperts,
    ) -> Result<std::sync::Arc<DraftModel>, ModelError> {
        let bound = Model::draft(dims.clone(), &source, None, false)?.into_bound();
        Ok(std::sync::Arc::new(DraftModel {
            source,
            dims,
            bound: std::sync::Mutex::new(Some(bound)),
            chunk: chunk.max(1),
            experts,
        }))
    }

    /// A drafter for one sequence of at most `capacity` positions (its own, plus the most ids
    /// one call drafts).
    pub fn drafter(self: &std::sync::Arc<Self>, capacity: usize) -> ModelDrafter {
        ModelDrafter {
            model: self.clone(),
            state: SeqState::new(&self.dims, capacity),
            saved: Vec::new(),
            fed: Vec::new(),
            off: false,
            calls: 0,
            seconds: 0.0,
        }
    }

    /// The draft trunk.
    pub fn source(&self) -> &DraftSource {
        &self.source
    }
}

/// Drafts for one sequence with the shared [`DraftModel`]: greedy steps of a draft [`Model`]
/// that reads no disk: its MoE layers run the shared experts and, with
/// [`DraftExperts::Resident`], the routed experts the target's cache holds at that moment
/// ([`ResidentExperts`]; the others are left out).
///
/// The drafter keeps its own sequence state over the ids the target has consumed (all of the
/// context but its last id): each call first runs the ids added since the last call (one
/// batched pass), saves the KDA states, runs `k` one-id steps from the context's last id, and
/// then puts the state back (KDA states restored, MLA caches truncated), so the draft state
/// never holds a drafted id. A failure turns the drafter off for the sequence (reported once):
/// drafting is never worth failing a request.
pub struct ModelDrafter {
    model: std::sync::Arc<DraftModel>,
    state: SeqState,
    saved: Vec<KdaState>,
    /// The ids `state` stands for (after a restart it has run only the last [`MAX_CATCH_UP`]
    /// of them).
    fed: Vec<u32>,
    off: bool,
    /// Draft-model forward calls and their seconds ([`Drafter::model_cost`]).
    calls: u64,
    seconds: f64,
}

impl std::fmt::Debug for ModelDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelDrafter")
            .field("model", &self.model)
            .field("fed", &self.fed.len())
            .finish()
    }
}

impl ModelDrafter {
    /// A drafter with a draft model of its own over `source` (see [`DraftModel::new`]) for
    /// sequences of at most `capacity` positions.
    pub fn new(
        source: DraftSource,
        dims: Dims,
        capacity: usize,
        chunk: usize,
        experts: DraftExperts,
    ) -> Result<ModelDrafter, ModelError> {
        Ok(DraftModel::new(source, dims, chunk, experts)?.drafter(capacity))
    }

    /// Bytes a drafter holds besides the shared draft trunk: its sequence state for `capacity`
    /// positions and the saved KDA states.
    pub fn state_bytes(d: &Dims, capacity: usize) -> u64 {
        2 * d.kda_state_bytes() + d.mla_cache_bytes(capacity as u64)
    }

    fn try_draft(
        &mut self,
        target: &dyn WeightSource,
        context: &[u32],
        k: usize,
    ) -> Result<Vec<u32>, ModelError> {
        let Some((&last, done)) = context.split_last() else {
            return Ok(Vec::new());
        };
        let shared = self.model.clone();
        if !done.starts_with(&self.fed) || done.len() - self.fed.len() > MAX_CATCH_UP {
            // Another sequence (a new chat turn after a reset), or too far behind: start over
            // on the last MAX_CATCH_UP ids only (lossy: the draft then sees a shorter context
            // at other positions, which costs acceptance, never an emitted id).
            tracing::debug!(
                "draft model: restarting on the last {} of {} ids",
                MAX_CATCH_UP.min(done.len()),
                done.len()
            );
            self.state = SeqState::new(&shared.dims, self.state.capacity);
            self.fed.clear();
            self.fed
                .extend_from_slice(&done[..done.len().saturating_sub(MAX_CATCH_UP)]);
        }
        let mut slot = shared.bound.lock().unwrap_or_else(|p| p.into_inner());
        let Some(bound) = slot.take() else {
            return Err(ModelError::Input(
                "the draft model lost what it bound (an earlier call panicked)".into(),
            ));
        };
        let view = ResidentExperts {
            draft: &shared.source,
            target,
        };
        let (src, routed): (&dyn WeightSource, bool) = match shared.experts {
            DraftExperts::Resident => (&view, true),
            DraftExperts::Shared => (&shared.source, false),
        };
        let mut model = Model::draft(shared.dims.clone(), src, Some(bound), routed)?;
        let t0 = std::time::Instant::now();
        let r = self.steps(&mut model, done, last, k, shared.chunk);
        self.seconds += t0.elapsed().as_secs_f64();
        *slot = Some(model.into_bound());
        r
    }

    /// Catch up on `done`, then `k` greedy steps from `last`, leaving the state as it was
    /// after the catch-up.
    fn steps(
        &mut self,
        model: &mut Model<'_>,
        done: &[u32],
        last: u32,
        k: usize,
        chunk: usize,
    ) -> Result<Vec<u32>, ModelError> {
        let start = self.fed.len();
        for new in done[start..].chunks(chunk) {
            model.forward(new, &mut self.state, Logits::Last)?;
            self.calls += 1;
            self.fed.extend_from_slice(new);
        }
        // Save what the drafted steps change.
        let pos0 = self.state.pos;
        let kda = self.state.layers.iter().filter_map(|l| match l {
            LayerState::Kda(s) => Some(s),
            LayerState::Mla(_) => None,
        });
        self.saved.resize_with(kda.clone().count(), || KdaState {
            s: Vec::new(),
            conv: Default::default(),
        });
        for (dst, src) in self.saved.iter_mut().zip(kda) {
            dst.clone_from(src);
        }
        let mut out = Vec::with_capacity(k);
        let mut id = last;
        let room = self.state.capacity - self.state.pos;
        for _ in 0..k.min(room) {
            let logits = model.forward(&[id], &mut self.state, Logits::Last)?;
            self.calls += 1;
            id = crate::kernels::argmax(&logits);
            out.push(id);
        }
        // Put the state back to `pos0`.
        let mut saved = self.saved.iter();
        for l in &mut self.state.layers {
            match l {
                LayerState::Kda(s) => s.clone_from(saved.next().expect("one per KDA layer")),
                LayerState::Mla(c) => c.rows.truncate(pos0 * c.width),
            }
        }
        self.state.pos = pos0;
        Ok(out)
    }
}

impl Drafter for ModelDrafter {
    fn name(&self) -> &'static str {
        "model"
    }
    fn model_cost(&self) -> Option<(u64, f64)> {
        Some((self.calls, self.seconds))
    }
    fn draft(&mut self, target: &dyn WeightSource, context: &[u32], k: usize) -> Vec<u32> {
        if self.off || k == 0 {
            return Vec::new();
        }
        match self.try_draft(target, context, k) {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!("the draft model is off for this job: {e}");
                self.off = true;
                Vec::new()
            }
        }
    }
}

/// The first drafter that proposes anything wins.
pub struct FirstOf(pub Vec<Box<dyn Drafter>>);

impl Drafter for FirstOf {
    fn name(&self) -> &'static str {
        "first-of"
    }
    fn model_cost(&self) -> Option<(u64, f64)> {
        self.0.iter().find_map(|d| d.model_cost())
    }
    fn draft(&mut self, source: &dyn WeightSource, context: &[u32], k: usize) -> Vec<u32> {
        for d in &mut self.0 {
            let ids = d.draft(source, context, k);
            if !ids.is_empty() {
                return ids;
            }
        }
        Vec::new()
    }
}

/// For benchmarks: drafts a given continuation of the prompt (e.g. a plain run's output), with
/// each drafted id replaced by a wrong one with probability `miss_rate` (decided by a hash of
/// the seed and the id's position, so a position is a miss whatever pass drafts it).
#[derive(Clone, Debug)]
pub struct ReplayDrafter {
    /// Ids expected after the prompt.
    pub continuation: Vec<u32>,
    /// Prompt length (ids before the continuation).
    pub prompt_len: usize,
    /// Share of drafted ids made wrong, in [0, 1].
    pub miss_rate: f64,
    /// Seed of the miss pattern.
    pub seed: u64,
}

impl ReplayDrafter {
    fn is_miss(&self, pos: usize) -> bool {
        // SplitMix64 of (seed, position) → uniform in [0, 1).
        let mut z = self
            .seed
            .wrapping_add((pos as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 / (1u64 << 53) as f64) < self.miss_rate
    }
}

impl Drafter for ReplayDrafter {
    fn name(&self) -> &'static str {
        "replay"
    }
    fn draft(&mut self, _: &dyn WeightSource, context: &[u32], k: usize) -> Vec<u32> {
        // The context holds the prompt and every generated id: the next id is generated id
        // number `context.len() - prompt_len`.
        let Some(next) = context.len().checked_sub(self.prompt_len) else {
            return Vec::new();
        };
        let end = (next + k).min(self.continuation.len());
        (next..end)
            .map(|i| {
                let t = self.continuation[i];
                if self.is_miss(i) {
                    if t == 0 {
                        1
                    } else {
                        t - 1
                    }
                } else {
                    t
                }
            })
            .collect()
    }
}

/// What speculation did over a run.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct SpecTotals {
    /// Decode forward passes (after the prefill).
    pub forward_passes: u64,
    /// Drafted ids run through verify passes.
    pub drafted_tokens: u64,
    /// Drafted ids the model agreed with (each one an id emitted without its own pass).
    pub accepted_tokens: u64,
}

/// Auto mode's running estimates: acceptance and pass costs, both exponentially weighted so
/// they follow a drafter whose quality changes mid-run.
#[derive(Clone, Debug)]
pub struct Controller {
    mode: SpecMode,
    /// Decayed counts of drafted ids that were checked and that were accepted.
    tested: f64,
    accepted: f64,
    /// Seconds of a one-position pass.
    t1: Option<f64>,
    /// Extra seconds per drafted position.
    c1: Option<f64>,
    plain_since_probe: u32,
    /// Plain passes between probes: [`PROBE_EVERY`], doubled after each probe that does not
    /// bring drafting back when the drafter is costly ([`Drafter::model_cost`]), up to
    /// [`MAX_PROBE_EVERY`].
    probe_every: u32,
    /// The drafter costs time per id of the sequence.
    pub costly_drafter: bool,
    /// Consecutive drafted passes after which even a perfect draft would not beat plain
    /// decoding (their extra seconds per drafted id, unsmoothed); at [`HOPELESS_PASSES`] auto
    /// mode stops drafting for the job.
    hopeless: u32,
}

/// Auto mode stops drafting after this many consecutive drafted passes in which even a
/// perfect draft would not have paid (a drafter whose own cost per drafted id exceeds what a
/// pass saves: a draft model on a machine where its steps cost about what a pass costs). Two,
/// not one, so one pass slowed by the disk does not end speculation.
pub const HOPELESS_PASSES: u32 = 2;

/// Weight of history in the running estimates (per pass): about the last ten passes count.
const DECAY: f64 = 0.9;

impl Controller {
    /// A controller for `mode`, knowing nothing yet.
    pub fn new(mode: SpecMode) -> Controller {
        Controller {
            mode,
            tested: 0.0,
            accepted: 0.0,
            t1: None,
            c1: None,
            plain_since_probe: 0,
            probe_every: PROBE_EVERY,
            costly_drafter: false,
            hopeless: 0,
        }
    }

    /// The mode.
    pub fn mode(&self) -> SpecMode {
        self.mode
    }

    /// Estimated probability that the next drafted id is accepted (Jeffreys prior: ½ before
    /// any evidence, and a few rejections are enough to bring it near 0).
    pub fn acceptance(&self) -> f64 {
        (self.accepted + 0.5) / (self.tested + 1.0)
    }

    /// Drafts to ask for in the next pass, at most `k_max`.
    pub fn choose(&mut self, k_max: usize) -> usize {
        if k_max == 0 {
            return 0;
        }
        match self.mode {
            SpecMode::Off => 0,
            SpecMode::Fixed(k) => k.min(k_max),
            SpecMode::Auto => {
                if self.hopeless >= HOPELESS_PASSES {
                    return 0;
                }
                let Some(t1) = self.t1 else {
                    return 0; // measure a plain pass first
                };
                let Some(c1) = self.c1 else {
                    return 1; // then one draft, to measure what a position costs
                };
                let k = best_k(self.acceptance(), t1, c1, k_max);
                if k > 0 {
                    self.probe_every = PROBE_EVERY;
                }
                if k == 0 {
                    self.plain_since_probe += 1;
                    if self.plain_since_probe >= self.probe_every {
                        self.plain_since_probe = 0;
                        if self.costly_drafter {
                            self.probe_every = (2 * self.probe_every).min(MAX_PROBE_EVERY);
                        }
                        return 1;
                    }
                }
                k
            }
        }
    }

    /// Learn from a finished pass: `drafted` ids were run, the first `tested` of them were
    /// checked against the model's picks and `accepted` agreed; the pass took `seconds`.
    pub fn observe(&mut self, drafted: usize, tested: usize, accepted: usize, seconds: f64) {
        let ewma =
            |old: Option<f64>, new: f64| Some(old.map_or(new, |o| DECAY * o + (1.0 - DECAY) * new));
        if drafted == 0 {
            self.t1 = ewma(self.t1, seconds);
            return;
        }
        if let Some(t1) = self.t1 {
            let extra = ((seconds - t1) / drafted as f64).max(0.0);
            self.c1 = ewma(self.c1, extra);
            if best_k(1.0, t1, extra, AUTO_MAX_K) == 0 {
                self.hopeless += 1;
                if self.hopeless == HOPELESS_PASSES && self.mode == SpecMode::Auto {
                    tracing::info!(
                        "speculation off for this job: a drafted id costs {extra:.3} s, a plain pass {t1:.3} s; even drafts always right would be slower"
                    );
                }
            } else {
                self.hopeless = 0;
            }
        }
        self.tested = DECAY * self.tested + tested as f64;
        self.accepted = DECAY * self.accepted + accepted as f64;
    }
}

/// The K in `0..=k_max` with the most expected ids per second, `Σ_{i≤K} aⁱ / (t1 + K·c1)`; 0
/// unless it beats plain decoding (`1 / t1`) by [`MIN_GAIN`].
pub fn best_k(a: f64, t1: f64, c1: f64, k_max: usize) -> usize {
    let plain = 1.0 / t1.max(1e-9);
    let (mut best, mut best_rate) = (0, plain);
    let (mut expected, mut term) = (1.0, 1.0);
    for k in 1..=k_max {
        term *= a;
        expected += term;
        let rate = expected / (t1 + k as f64 * c1).max(1e-9);
        if rate > best_rate {
            best = k;
            best_rate = rate;
        }
    }
    if best_rate >= MIN_GAIN * plain {
        best
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_k_follows_acceptance_and_cost() {
        // Trunk-bound pass (t1 = 3 s, 0.2 s per extra position): long drafts pay at 75%.
        assert!(best_k(0.75, 3.0, 0.2, 16) >= 4);
        // Nothing is accepted: never speculate.
        assert_eq!(best_k(0.0, 3.0, 0.2, 16), 0);
        // An extra position costing as much as a whole pass can never pay; costing half of
        // one, a 50% draft does not pay and a near certain one does.
        assert_eq!(best_k(0.99, 1.0, 1.0, 16), 0);
        assert_eq!(best_k(0.5, 1.0, 0.5, 16), 0);
        assert!(best_k(0.95, 1.0, 0.5, 16) >= 1);
        assert_eq!(best_k(0.9, 3.0, 0.2, 0), 0);
    }

    #[test]
    fn auto_measures_plain_then_probes_then_backs_off() {
        let mut c = Controller::new(SpecMode::Auto);
        assert_eq!(c.choose(8), 0, "first a plain pass");
        c.observe(0, 0, 0, 3.0);
        assert_eq!(c.choose(8), 1, "then a one-draft probe");
        c.observe(1, 1, 0, 3.2);
        // Rejections drive K to 0; a probe comes back every PROBE_EVERY plain passes.
        for _ in 0..6 {
            let k = c.choose(8);
            c.observe(k, k.min(1), 0, 3.0 + 0.2 * k as f64);
        }
        let ks: Vec<usize> = (0..PROBE_EVERY)
            .map(|_| {
                let k = c.choose(8);
                c.observe(k, k.min(1), 0, 3.0 + 0.2 * k as f64);
                k
            })
            .collect();
        assert_eq!(ks.iter().filter(|&&k| k == 1).count(), 1, "{ks:?}");
        assert!(ks.iter().all(|&k| k <= 1), "{ks:?}");
        // A drafter that agrees gets longer drafts.
        for _ in 0..10 {
            let k = c.choose(8).max(1);
            c.observe(k, k, k, 3.0 + 0.2 * k as f64);
        }
        assert!(c.choose(8) >= 4, "acceptance {}", c.acceptance());
        assert_eq!(Controller::new(SpecMode::Off).choose(8), 0);
        assert_eq!(Controller::new(SpecMode::Fixed(4)).choose(2), 2);
    }

    #[test]
    fn auto_stops_drafting_when_even_perfect_drafts_cannot_pay() {
        // A drafter whose drafted id costs more than a plain pass (a draft model catching up
        // on the ids since its last call): two such passes in a row end drafting for the job.
        let mut c = Controller::new(SpecMode::Auto);
        c.observe(0, 0, 0, 1.0);
        assert_eq!(c.choose(8), 1);
        c.observe(1, 1, 1, 5.0);
        for _ in 0..PROBE_EVERY {
            let k = c.choose(8);
            c.observe(k, k, k, 1.0 + 4.0 * k as f64);
        }
        assert!((0..100).all(|_| c.choose(8) == 0), "drafting must stay off");
        // One slow pass (a disk hiccup) between cheap ones does not end it.
        let mut c = Controller::new(SpecMode::Auto);
        c.observe(0, 0, 0, 1.0);
        assert_eq!(c.choose(8), 1);
        c.observe(1, 1, 1, 5.0);
        let mut drafted = 0;
        for _ in 0..3 * PROBE_EVERY {
            let k = c.choose(8);
            drafted += k;
            c.observe(k, k, k, 1.0 + 0.05 * k as f64);
        }
        assert!(drafted > 0, "cheap, right drafts must still be used");
    }

    #[test]
    fn auto_probes_a_costly_drafter_ever_more_rarely() {
        let probes = |costly: bool| {
            let mut c = Controller::new(SpecMode::Auto);
            c.costly_drafter = costly;
            let mut at = Vec::new();
            for pass in 0..600 {
                let k = c.choose(8);
                if k > 0 {
                    at.push(pass);
                }
                // Every draft is refused; a drafted id costs a little.
                c.observe(k, k.min(1), 0, 1.0 + 0.1 * k as f64);
            }
            at
        };
        let cheap = probes(false);
        let costly = probes(true);
        assert!(cheap.len() > 30, "{cheap:?}");
        let gaps: Vec<usize> = costly.windows(2).map(|w| w[1] - w[0]).collect();
        // A few drafted passes while the acceptance estimate falls, then probes 16, 32, 64, …
        // passes apart.
        assert!(costly.len() <= 10, "{costly:?}");
        let tail = &gaps[gaps.len() - 4..];
        assert!(tail.windows(2).all(|g| g[1] == 2 * g[0]), "{gaps:?}");
        assert_eq!(tail[0], 2 * PROBE_EVERY as usize, "{gaps:?}");
    }

    use k3_store::runtime::source::{ExpertBatch, LayerRun, Region, SourceError, SourceStats};

    /// A source with no weights: the drafters here never read any.
    struct NoWeights;

    impl WeightSource for NoWeights {
        fn model_tensor(&self, name: &str) -> Result<Region, SourceError> {
            Err(SourceError::Missing(name.into()))
        }
        fn layer(&self, l: usize) -> Result<LayerRun, SourceError> {
            Err(SourceError::Missing(format!("layer {l}")))
        }
        fn experts(&self, l: usize, _: &[u32]) -> Result<ExpertBatch, SourceError> {
            Err(SourceError::Missing(format!("layer {l} experts")))
        }
        fn stats(&self) -> SourceStats {
            SourceStats::default()
        }
    }

    #[test]
    fn ngram_drafts_from_the_context_itself() {
        let ctx = [5, 6, 7, 8, 9, 1, 5, 6, 7];
        assert_eq!(NgramDrafter.draft(&NoWeights, &ctx, 3), vec![8, 9, 1]);
        assert!(NgramDrafter.draft(&NoWeights, &ctx[..5], 3).is_empty());
        let mut chain = FirstOf(vec![
            Box::new(HistoryDrafter::default()),
            Box::new(NgramDrafter),
        ]);
        assert_eq!(
            chain.draft(&NoWeights, &ctx, 2),
            vec![8, 9],
            "history is empty standalone"
        );
    }

    #[test]
    fn replay_misses_at_the_asked_rate_and_by_position() {
        let cont: Vec<u32> = (100..2100).collect();
        let mut r = ReplayDrafter {
            continuation: cont.clone(),
            prompt_len: 3,
            miss_rate: 0.25,
            seed: 7,
        };
        let src = NoWeights;
        let ctx: Vec<u32> = vec![1, 2, 3];
        let all = r.draft(&src, &ctx, 2000);
        let misses = all.iter().zip(&cont).filter(|(a, b)| a != b).count();
        assert!(
            (400..600).contains(&misses),
            "{misses} misses of 2000 at 25%"
        );
        // The same position is a miss whichever pass drafts it.
        let mut ctx2 = ctx.clone();
        ctx2.extend_from_slice(&cont[..10]);
        assert_eq!(r.draft(&src, &ctx2, 5), all[10..15].to_vec());
        r.miss_rate = 0.0;
        assert_eq!(r.draft(&src, &ctx, 4), cont[..4].to_vec());
    }

    #[test]
    fn parses_modes() {
        assert_eq!("auto".parse::<SpecMode>().unwrap(), SpecMode::Auto);
        assert_eq!("off".parse::<SpecMode>().unwrap(), SpecMode::Off);
        assert_eq!("4".parse::<SpecMode>().unwrap(), SpecMode::Fixed(4));
        assert!("17".parse::<SpecMode>().is_err());
        assert!("-1".parse::<SpecMode>().is_err());
    }
}
