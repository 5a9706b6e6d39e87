//! Generation: prefill the prompt, then pick tokens (greedy argmax or seeded top-p sampling)
//! and feed them back one at a time (incremental: KDA state, conv history and the MLA latent
//! cache carried) or by re-running the whole prefix (`full_recompute`, for checking: both give
//! identical ids because the kernels make prefill and decode bit-identical).

use std::time::Instant;

use crate::model::{Logits, Model, ModelError, PhaseSeconds, SeqState};
use crate::spec::{Controller, Drafter, SpecMode, SpecTotals};

/// The two end-of-turn ids (SPEC.md §5.4, I34): `[EOS]` and `<|end_of_msg|>`.
pub const END_IDS: [u32; 2] = [163_585, 163_586];

/// PCG32 (XSH-RR), a small deterministic generator for sampling.
#[derive(Clone, Debug)]
pub struct Pcg32 {
    state: u64,
    inc: u64,
}

impl Pcg32 {
    const MUL: u64 = 6_364_136_223_846_793_005;

    /// Seeded generator (stream 54, the reference default).
    pub fn new(seed: u64) -> Pcg32 {
        let mut g = Pcg32 {
            state: 0,
            inc: (54 << 1) | 1,
        };
        g.next_u32();
        g.state = g.state.wrapping_add(seed);
        g.next_u32();
        g
    }

    /// Next 32 random bits.
    pub fn next_u32(&mut self) -> u32 {
        let old = self.state;
        self.state = old.wrapping_mul(Self::MUL).wrapping_add(self.inc);
        let xorshifted = (((old >> 18) ^ old) >> 27) as u32;
        let rot = (old >> 59) as u32;
        xorshifted.rotate_right(rot)
    }

    /// Uniform in [0, 1) with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        let hi = (self.next_u32() >> 5) as u64; // 27 bits
        let lo = (self.next_u32() >> 6) as u64; // 26 bits
        ((hi << 26) | lo) as f64 / (1u64 << 53) as f64
    }
}

pub use crate::kernels::argmax;

/// How the next token is chosen.
#[derive(Clone, Debug)]
pub enum Sampler {
    /// Argmax.
    Greedy,
    /// Temperature + nucleus sampling with a seeded PCG32.
    TopP {
        /// Softmax temperature (> 0).
        temperature: f32,
        /// Nucleus mass in (0, 1].
        top_p: f32,
        /// Generator.
        rng: Pcg32,
    },
}

/// Sampling settings out of range (a refusal before any work).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A negative or non-finite temperature.
    #[error("--temperature {0} must be ≥ 0")]
    Temperature(f32),
    /// A top-p outside (0, 1].
    #[error("--top-p {0} must be in (0, 1]")]
    TopP(f32),
}

impl Sampler {
    /// Greedy when `temperature` is 0, else top-p sampling; rejects out-of-range values.
    pub fn new(temperature: f32, top_p: f32, seed: u64) -> Result<Sampler, SamplingError> {
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(SamplingError::Temperature(temperature));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(SamplingError::TopP(top_p));
        }
        Ok(if temperature == 0.0 {
            Sampler::Greedy
        } else {
            Sampler::TopP {
                temperature,
                top_p,
                rng: Pcg32::new(seed),
            }
        })
    }

    /// Pick a token from `logits`.
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        match self {
            Sampler::Greedy => argmax(logits),
            Sampler::TopP {
                temperature,
                top_p,
                rng,
            } => {
                let m = logits[argmax(logits) as usize] as f64;
                let t = *temperature as f64;
                let p: Vec<f64> = logits
                    .iter()
                    .map(|&l| {
                        if l.is_nan() {
                            0.0
                        } else {
                            ((l as f64 - m) / t).exp()
                        }
                    })
                    .collect();
                let z: f64 = p.iter().sum();
                let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
                idx.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b)));
                // Smallest prefix whose mass reaches top_p (at least one token).
                let mut mass = 0.0;
                let mut keep = 0;
                for &i in &idx {
                    mass += p[i as usize] / z;
                    keep += 1;
                    if mass >= *top_p as f64 {
                        break;
                    }
                }
                let kept = &idx[..keep];
                let total: f64 = kept.iter().map(|&i| p[i as usize]).sum();
                let r = rng.next_f64() * total;
                let mut acc = 0.0;
                for &i in kept {
                    acc += p[i as usize];
                    if r < acc {
                        return i;
                    }
                }
                kept[keep - 1]
            }
        }
    }
}

/// Generation settings.
#[derive(Clone, Debug)]
pub struct GenOptions {
    /// Tokens to generate (≥ 1).
    pub max_new: usize,
    /// Re-run the whole prefix every step instead of carrying state.
    pub full_recompute: bool,
    /// Token choice.
    pub sampler: Sampler,
    /// Stop after generating one of these (only ids inside the vocabulary are kept).
    pub stop_ids: Vec<u32>,
    /// Keep the step-0 logits (last prompt position) in the report.
    pub keep_step0_logits: bool,
    /// Run a prefix in forward calls of at most this many tokens (0 = all at once). Bounds the
    /// prefill's activation memory; results are identical for any value because every position
    /// is computed the same way whatever batch it arrives in.
    pub prefill_chunk: usize,
    /// Speculative decoding (`crate::spec`): how many drafted ids each decode pass verifies.
    /// Needs a drafter ([`Session::set_drafter`]); ignored with `full_recompute`.
    pub spec: SpecMode,
}

/// Default `prefill_chunk`: about half a GB of activations per chunk at full scale.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// One generated token.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepReport {
    /// 0 = the prefill step.
    pub step: usize,
    /// The chosen id.
    pub token: u32,
    /// Wall seconds of this step (forward + pick).
    pub seconds: f64,
    /// Weight bytes the source read during this step.
    pub bytes_read: u64,
    /// Requested experts already resident / requested, this step (None if none requested).
    pub resident_hit_rate: Option<f64>,
    /// Seconds of this step the forward pass was blocked waiting for weight bytes (trunk layers
    /// not yet read + routed experts not yet arrived): the I/O this step did NOT hide.
    pub io_wait_seconds: f64,
    /// Seconds the source spent reading weight bytes that completed during this step (reads run
    /// beside compute; 1 − wait ÷ read is the share of I/O hidden behind compute).
    pub io_read_seconds: f64,
    /// The forward pass that produced this id (0 = the prefill). A verify pass produces one id
    /// per accepted draft plus one; its seconds, bytes and I/O are shared equally among them.
    pub pass: usize,
    /// Drafted ids the pass verified (on the pass's first id; 0 on the others).
    pub drafted: usize,
    /// Drafted ids the pass accepted (on the pass's first id; 0 on the others).
    pub accepted: usize,
    /// Bytes the router lookahead's prefetches read during this step (part of `bytes_read`; for
    /// a verify pass, the pass's total on its first id).
    pub prefetch_bytes: u64,
    /// Requested experts this step that a prefetch had loaded (a verify pass: on its first id).
    pub prefetch_used: u64,
    /// Of `bytes_read`, the trunk's (reported on the first id of a pass).
    pub trunk_bytes_read: u64,
    /// Where this step's forward pass spent its time (a verify pass's phases are shared
    /// equally among its ids, like its seconds).
    pub phases: PhaseSeconds,
}

/// What a generation produced.
#[derive(Clone, Debug)]
pub struct GenReport {
    /// The prompt.
    pub prompt_ids: Vec<u32>,
    /// Generated ids (including a final stop id, if one was produced).
    pub generated_ids: Vec<u32>,
    /// Per step.
    pub steps: Vec<StepReport>,
    /// Logits of the last prompt position, when asked for.
    pub step0_logits: Option<Vec<f32>>,
    /// The stop id that ended generation, if any.
    pub stopped_on: Option<u32>,
    /// Speculative decoding's counts for this generation.
    pub spec: SpecTotals,
}

impl GenReport {
    /// Seconds of step 0 (prefill + first pick).
    pub fn prefill_seconds(&self) -> f64 {
        self.steps.first().map_or(0.0, |s| s.seconds)
    }

    /// Mean seconds per token over steps ≥ 1 (None with fewer than two steps).
    pub fn seconds_per_token(&self) -> Option<f64> {
        let rest = &self.steps[1.min(self.steps.len())..];
        (!rest.is_empty()).then(|| rest.iter().map(|s| s.seconds).sum::<f64>() / rest.len() as f64)
    }

    /// Mean seconds per decoded token (steps ≥ 1) by phase, and the rest of the step outside
    /// the phases (embedding, sampling, bookkeeping); `None` without decode steps.
    pub fn time_per_token(&self) -> Option<(PhaseSeconds, f64)> {
        let rest = &self.steps[1.min(self.steps.len())..];
        if rest.is_empty() {
            return None;
        }
        let n = rest.len() as f64;
        let mut sum = PhaseSeconds::default();
        let mut seconds = 0.0;
        for s in rest {
            sum = sum.plus(&s.phases);
            seconds += s.seconds;
        }
        let mean = sum.scaled(1.0 / n);
        Some((mean, (seconds / n - mean.total()).max(0.0)))
    }
}

/// Positions a request needs: the prompt (or conversation) plus every generated token fed back
/// (the last one is never fed).
pub fn positions_needed(prompt_len: usize, max_new: usize) -> usize {
    prompt_len + max_new.saturating_sub(1)
}

/// What the step callback wants next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Generate the next token (up to the limit or a stop id).
    Continue,
    /// Stop after this token (e.g. the chat reply parser saw the end of the message).
    Stop,
}

/// A sequence being generated: its state (with its reused buffers), the ids the state holds, and
/// the sampler. The ONE generation loop ([`Session::generate`]) serves one-shot runs
/// ([`generate`]) and chat turns (`crate::chat::Session`), and every later mode.
#[derive(Debug)]
pub struct Session {
    state: SeqState,
    /// The ids the state holds, in order (`state.pos == held.len()` while the state is valid).
    held: Vec<u32>,
    sampler: Sampler,
    /// Proposes ids for speculative verify passes (none: plain decoding).
    drafter: Option<Box<dyn Drafter>>,
    /// Auto mode's estimates, carried across calls (chat turns learn from earlier turns).
    control: Option<Controller>,
}

impl Session {
    /// An empty sequence of at most `capacity` positions.
    pub fn new(model: &Model<'_>, capacity: usize, sampler: Sampler) -> Session {
        Session {
            state: model.new_state(capacity),
            held: Vec::new(),
            sampler,
            drafter: None,
            control: None,
        }
    }

    /// The drafter set with [`Session::set_drafter`].
    pub fn drafter(&self) -> Option<&dyn Drafter> {
        self.drafter.as_deref()
    }

    /// Draft with `drafter` in the decode passes of later [`Session::generate`] calls whose
    /// options enable speculation.
    pub fn set_drafter(&mut self, drafter: Box<dyn Drafter>) {
        self.drafter = Some(drafter);
    }

    /// A sequence over a restored `state` that holds `held` (a kept session).
    pub fn from_parts(
        state: SeqState,
        held: Vec<u32>,
        sampler: Sampler,
    ) -> Result<Session, ModelError> {
        if state.pos != held.len() || held.len() > state.capacity {
            return Err(ModelError::Input(format!(
                "a restored state at position {} of {} cannot hold {} ids",
                state.pos,
                state.capacity,
                held.len()
            )));
        }
        Ok(Session {
            state,
            held,
            sampler,
            drafter: None,
            control: None,
        })
    }

    /// The state (to keep it as a session).
    pub fn state(&self) -> &SeqState {
        &self.state
    }

    /// The ids the state holds.
    pub fn held(&self) -> &[u32] {
        &self.held
    }

    /// Positions the state was sized for.
    pub fn capacity(&self) -> usize {
        self.state.capacity
    }

    /// The sampler (its generator carries on from one call to the next).
    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// True while the state matches `held` (a failed forward leaves it unusable).
    pub fn is_valid(&self) -> bool {
        self.state.pos == self.held.len()
    }

    /// Forget everything: a fresh state of the same capacity (kept allocation-free when the
    /// state is already empty).
    pub fn reset(&mut self, model: &Model<'_>) {
        if self.state.pos != 0 {
            self.state = model.new_state(self.state.capacity);
        }
        self.held.clear();
    }

    /// Feed `new` after the ids the state holds (prefill, in chunks of `opts.prefill_chunk`),
    /// then pick and feed back up to `opts.max_new` ids, stopping after a stop id or when
    /// `on_step` returns [`Flow::Stop`]. Step 0 is the prefill and the first pick.
    pub fn generate(
        &mut self,
        model: &mut Model<'_>,
        new: &[u32],
        opts: &GenOptions,
        on_step: &mut dyn FnMut(&StepReport) -> Flow,
    ) -> Result<GenReport, ModelError> {
        if new.is_empty() {
            return Err(ModelError::Input("empty prompt".into()));
        }
        if opts.max_new == 0 {
            return Err(ModelError::Input("nothing to generate (--gen 0)".into()));
        }
        if !self.is_valid() {
            return Err(ModelError::Input(
                "the sequence state is unusable after a failed forward; reset it first".into(),
            ));
        }
        let need = positions_needed(self.held.len() + new.len(), opts.max_new);
        if need > self.state.capacity {
            return Err(ModelError::Input(format!(
                "{} held + {} new ids and up to {} generated need {need} positions; the state holds {}",
                self.held.len(),
                new.len(),
                opts.max_new,
                self.state.capacity
            )));
        }
        let vocab = model.dims.vocab;
        let stops: Vec<u32> = opts
            .stop_ids
            .iter()
            .copied()
            .filter(|&s| (s as usize) < vocab)
            .collect();
        let mode = if opts.full_recompute || self.drafter.is_none() {
            SpecMode::Off
        } else {
            opts.spec
        };
        let mut control = match self.control.take() {
            Some(c) if c.mode() == mode => c,
            _ => Controller::new(mode),
        };
        control.costly_drafter = self
            .drafter
            .as_ref()
            .is_some_and(|d| d.model_cost().is_some());
        let mut report = GenReport {
            prompt_ids: new.to_vec(),
            generated_ids: Vec::new(),
            steps: Vec::new(),
            step0_logits: None,
            stopped_on: None,
            spec: SpecTotals::default(),
        };
        let source = model.source();
        let mut pass = 0usize;
        let mut context: Vec<u32> = Vec::new();
        // The source's counters once per pass: a pass's `after` is the next one's `before` (an
        // attached source asks the store for them).
        let mut after = source.stats();
        'passes: while report.generated_ids.len() < opts.max_new {
            let before = std::mem::take(&mut after);
            let expert_wait0 = model.counters.expert_wait_seconds;
            let phases0 = model.counters.phases;
            let t0 = Instant::now();
            model.step = report.generated_ids.len() as u64;
            // The pass: the prompt (pass 0), or the last id plus any drafts.
            let mut drafts: Vec<u32> = Vec::new();
            let logits = if pass == 0 {
                self.feed(model, new, opts.prefill_chunk)?
            } else {
                let last = *report
                    .generated_ids
                    .last()
                    .expect("one id per earlier pass");
                // At most max_new − generated − 1 drafts: a pass emits at most drafts + 1 ids.
                let room = opts.max_new - report.generated_ids.len() - 1;
                let k = control.choose(room.min(opts.spec.max_drafts()));
                if k > 0 {
                    if let Some(drafter) = self.drafter.as_mut() {
                        context.clear();
                        context.extend_from_slice(&self.held);
                        context.push(last);
                        drafts = drafter.draft(source, &context, k);
                        drafts.truncate(k);
                        // A drafter's id outside the vocabulary ends the draft.
                        if let Some(bad) = drafts.iter().position(|&d| d as usize >= vocab) {
                            drafts.truncate(bad);
                        }
                    }
                }
                if opts.full_recompute {
                    // Check mode: the whole sequence again on a fresh state.
                    self.held.push(last);
                    let mut fresh = model.new_state(self.state.capacity);
                    let logits = run_chunks(model, &self.held, &mut fresh, opts.prefill_chunk)?;
                    self.state = fresh;
                    logits
                } else if drafts.is_empty() {
                    self.feed(model, &[last], 0)?
                } else {
                    // Verify pass: logits at every position, state journaled for the rollback.
                    context.clear();
                    context.push(last);
                    context.extend_from_slice(&drafts);
                    self.state.begin_journal();
                    model.forward(&context, &mut self.state, Logits::All)?
                }
            };
            // The model's pick at each position, up to the first disagreement with the drafts
            // (or a stop id). The sampler draws once per pick, as plain decoding does; its state
            // after each pick is kept in case the caller stops early.
            let mut picks: Vec<(u32, Sampler)> = Vec::with_capacity(drafts.len() + 1);
            for i in 0..=drafts.len() {
                let row = &logits[i * vocab..(i + 1) * vocab];
                let token = self.sampler.pick(row);
                picks.push((token, self.sampler.clone()));
                if stops.contains(&token) || i == drafts.len() || token != drafts[i] {
                    break;
                }
            }
            if pass == 0 && opts.keep_step0_logits {
                report.step0_logits = Some(logits);
            }
            let seconds = t0.elapsed().as_secs_f64();
            after = source.stats();
            let produced = picks.len();
            let share = 1.0 / produced as f64;
            let reqs = after.expert_requests.saturating_sub(before.expert_requests);
            let hits = after.resident_hits.saturating_sub(before.resident_hits);
            let bytes = (after.expert_bytes_read + after.trunk_bytes_read)
                .saturating_sub(before.expert_bytes_read + before.trunk_bytes_read);
            let io_wait = (after.trunk_wait_seconds - before.trunk_wait_seconds).max(0.0)
                + (model.counters.expert_wait_seconds - expert_wait0).max(0.0);
            let io_read = (after.trunk_read_seconds + after.expert_read_seconds
                - before.trunk_read_seconds
                - before.expert_read_seconds)
                .max(0.0);
            let prefetch_bytes = after.prefetch_bytes.saturating_sub(before.prefetch_bytes);
            let prefetch_used = after.prefetch_used.saturating_sub(before.prefetch_used);
            let trunk_bytes = after
                .trunk_bytes_read
                .saturating_sub(before.trunk_bytes_read);
            let phases = model.counters.phases.since(&phases0).scaled(share);
            let accepted = produced - 1;
            if pass > 0 {
                // Drafts checked: every accepted one, plus the one that was refused (if any).
                let tested = drafts.len().min(produced);
                control.observe(drafts.len(), tested, accepted, seconds);
                report.spec.forward_passes += 1;
                report.spec.drafted_tokens += drafts.len() as u64;
            }
            // Emit the picks; the caller may stop after any of them.
            let mut emitted = 0;
            let mut stop = false;
            for (i, (token, _)) in picks.iter().enumerate() {
                let r = StepReport {
                    step: report.generated_ids.len(),
                    token: *token,
                    seconds: seconds * share,
                    bytes_read: bytes / produced as u64
                        + u64::from(i == 0) * (bytes % produced as u64),
                    resident_hit_rate: (reqs > 0).then(|| hits as f64 / reqs as f64),
                    io_wait_seconds: io_wait * share,
                    io_read_seconds: io_read * share,
                    pass,
                    drafted: if i == 0 { drafts.len() } else { 0 },
                    accepted: if i == 0 { accepted } else { 0 },
                    prefetch_bytes: if i == 0 { prefetch_bytes } else { 0 },
                    prefetch_used: if i == 0 { prefetch_used } else { 0 },
                    trunk_bytes_read: if i == 0 { trunk_bytes } else { 0 },
                    phases,
                };
                let flow = on_step(&r);
                report.steps.push(r);
                report.generated_ids.push(*token);
                emitted += 1;
                if stops.contains(token) {
                    report.stopped_on = Some(*token);
                    stop = true;
                }
                if stop || flow == Flow::Stop {
                    stop = true;
                    break;
                }
            }
            if pass > 0 {
                report.spec.accepted_tokens += (emitted - 1) as u64;
            }
            if !drafts.is_empty() {
                // Keep the positions whose ids were emitted: the last id and the accepted drafts
                // before the final pick (the final pick itself is fed by the next pass).
                self.state.rollback(emitted)?;
                self.held.extend_from_slice(&context[..emitted]);
                // The sampler as plain decoding would leave it after `emitted` picks.
                self.sampler = picks[emitted - 1].1.clone();
            }
            pass += 1;
            if stop {
                break 'passes;
            }
        }
        self.control = Some(control);
        Ok(report)
    }

    /// Run `ids` through the state in forward calls of at most `chunk` ids (0 = one call),
    /// recording them as held, without picking: the part of a prompt before its last id, so
    /// that the state can be kept (and a retry resumed) before the first pick.
    pub fn prefill(
        &mut self,
        model: &mut Model<'_>,
        ids: &[u32],
        chunk: usize,
    ) -> Result<(), ModelError> {
        if !self.is_valid() {
            return Err(ModelError::Input(
                "the sequence state is unusable after a failed forward; reset it first".into(),
            ));
        }
        self.state.reserve(ids.len())?;
        if !ids.is_empty() {
            self.feed(model, ids, chunk)?;
        }
        Ok(())
    }

    /// Run `ids` through the state in chunks, recording them as held; the last chunk's logits.
    fn feed(
        &mut self,
        model: &mut Model<'_>,
        ids: &[u32],
        chunk: usize,
    ) -> Result<Vec<f32>, ModelError> {
        // After a failed forward `held` no longer matches the state's position, so the session
        // reads as unusable ([`Session::is_valid`]) until it is reset.
        let logits = run_chunks(model, ids, &mut self.state, chunk)?;
        self.held.extend_from_slice(ids);
        Ok(logits)
    }
}

/// Feed `ids` after the state's current position, in chunks, returning the last chunk's logits.
fn run_chunks(
    model: &mut Model<'_>,
    ids: &[u32],
    state: &mut SeqState,
    chunk: usize,
) -> Result<Vec<f32>, ModelError> {
    let chunk = if chunk == 0 { ids.len() } else { chunk };
    let mut last = Vec::new();
    for part in ids.chunks(chunk) {
        last = model.forward(part, state, Logits::Last)?;
    }
    Ok(last)
}

/// One-shot generation from `prompt` on a fresh sequence sized for exactly this request; calls
/// `on_step` after each token (for streaming and the report).
pub fn generate(
    model: &mut Model<'_>,
    prompt: &[u32],
    opts: &GenOptions,
    on_step: &mut dyn FnMut(&StepReport),
) -> Result<GenReport, ModelError> {
    generate_with(model, prompt, opts, None, on_step)
}

/// [`generate`] with a drafter for speculative decoding (used when `opts.spec` is not off).
pub fn generate_with(
    model: &mut Model<'_>,
    prompt: &[u32],
    opts: &GenOptions,
    drafter: Option<Box<dyn Drafter>>,
    on_step: &mut dyn FnMut(&StepReport),
) -> Result<GenReport, ModelError> {
    let capacity = positions_needed(prompt.len(), opts.max_new);
    let mut session = Session::new(model, capacity, opts.sampler.clone());
    if let Some(d) = drafter {
        session.set_drafter(d);
    }
    session.generate(model, prompt, opts, &mut |s| {
        on_step(s);
        Flow::Continue
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_first_index_wins_ties_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
        assert_eq!(argmax(&[-1.0]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(
            argmax(&[0.5, f32::NAN, 2.0, f32::INFINITY, 7.0, f32::INFINITY]),
            3
        );
    }

    #[test]
    fn pcg32_matches_the_reference_sequence() {
        // pcg32_srandom(42, 54) → first outputs of the PCG reference demo.
        let mut g = Pcg32::new(42);
        let got: Vec<u32> = (0..6).map(|_| g.next_u32()).collect();
        assert_eq!(
            got,
            [0xa15c02b7, 0x7b47f409, 0xba1d3330, 0x83d2f293, 0xbfa4784b, 0xcbed606e]
        );
    }

    #[test]
    fn tiny_top_p_is_greedy_and_sampling_is_seeded() {
        let logits = [0.1f32, 2.0, 1.9, -3.0];
        let mut s = Sampler::new(1.0, 1e-6, 7).unwrap();
        assert!((0..50).all(|_| s.pick(&logits) == 1));
        let draw = |seed| {
            let mut s = Sampler::new(1.0, 1.0, seed).unwrap();
            (0..64).map(|_| s.pick(&logits)).collect::<Vec<u32>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
        let d = draw(3);
        // Both high-probability tokens show up; the p≈0.3% token rarely does.
        assert!(d.contains(&1) && d.contains(&2), "{d:?}");
        assert!(Sampler::new(-1.0, 1.0, 0).is_err());
        assert!(Sampler::new(1.0, 0.0, 0).is_err());
        assert!(matches!(
            Sampler::new(0.0, 1.0, 0).unwrap(),
            Sampler::Greedy
        ));
    }
}
