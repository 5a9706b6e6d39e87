//! One sequence in the engine: its state and the ids it holds, what it still has to run, its
//! own sampler, stop rules and speculation, and what its steps cost so far. The runner asks it
//! for its rows of the next pass ([`Sequence::plan`]) and hands it its logits rows
//! ([`Sequence::take`]): the pick step, the stop rules and the rollback of rejected drafts are
//! here, written once for every front end.
//!
//! The pick step is the one place an id is chosen ([`Sequence::pick`]): the sequence's logits
//! processor ([`crate::engine::shaping`]: a grammar's mask, a logit bias, penalties) edits the
//! row there before the sampler, and a forced id (closing a think channel) replaces the
//! sampler's choice there; a verify pass compares each drafted id with that same choice.

use std::time::Instant;

use k3_proto::serve::{Finish, Usage};
use k3_store::runtime::source::{SourceStats, WeightSource};

use crate::engine::outputs::{Ending, Flow, GenReport, Outputs, StepReport};
use crate::engine::request::{reusable, Held, Request, SeqId, Speculation};
use crate::engine::sampling::{positions_needed, Sampler};
use crate::engine::shaping::{Scored, Shaper};
use crate::engine::spec::{Controller, SpecMode};
use crate::model::{Dims, Logits, ModelError, PhaseSeconds, SeqState};

/// What one pass cost, and this sequence's share of its rows.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PassCost {
    /// Wall seconds of the step so far (drafting, the pass, the picks before this sequence's).
    pub(crate) seconds: f64,
    pub(crate) share: f64,
    pub(crate) bytes: u64,
    pub(crate) requests: u64,
    pub(crate) hits: u64,
    pub(crate) io_wait: f64,
    pub(crate) io_read: f64,
    pub(crate) prefetch_bytes: u64,
    pub(crate) prefetch_used: u64,
    pub(crate) trunk_bytes: u64,
    pub(crate) phases: PhaseSeconds,
}

impl PassCost {
    /// What the source and the model counted between `before` and `after` (one pass).
    pub(crate) fn between(
        before: &SourceStats,
        after: &SourceStats,
        expert_wait: f64,
        phases: PhaseSeconds,
    ) -> PassCost {
        PassCost {
            seconds: 0.0,
            share: 1.0,
            bytes: (after.expert_bytes_read + after.trunk_bytes_read)
                .saturating_sub(before.expert_bytes_read + before.trunk_bytes_read),
            requests: after.expert_requests.saturating_sub(before.expert_requests),
            hits: after.resident_hits.saturating_sub(before.resident_hits),
            io_wait: (after.trunk_wait_seconds - before.trunk_wait_seconds).max(0.0)
                + expert_wait.max(0.0),
            io_read: (after.trunk_read_seconds + after.expert_read_seconds
                - before.trunk_read_seconds
                - before.expert_read_seconds)
                .max(0.0),
            prefetch_bytes: after.prefetch_bytes.saturating_sub(before.prefetch_bytes),
            prefetch_used: after.prefetch_used.saturating_sub(before.prefetch_used),
            trunk_bytes: after
                .trunk_bytes_read
                .saturating_sub(before.trunk_bytes_read),
            phases,
        }
    }
}

/// What the passes since the sequence's last id cost it (its shares).
#[derive(Clone, Copy, Debug, Default)]
struct Pending {
    seconds: f64,
    bytes: f64,
    requests: f64,
    hits: f64,
    io_wait: f64,
    io_read: f64,
    prefetch_bytes: f64,
    prefetch_used: f64,
    trunk_bytes: f64,
    phases: PhaseSeconds,
}

impl Pending {
    fn add(&mut self, c: &PassCost) {
        let s = c.share;
        self.seconds += c.seconds;
        self.bytes += c.bytes as f64 * s;
        self.requests += c.requests as f64 * s;
        self.hits += c.hits as f64 * s;
        self.io_wait += c.io_wait;
        self.io_read += c.io_read;
        self.prefetch_bytes += c.prefetch_bytes as f64 * s;
        self.prefetch_used += c.prefetch_used as f64 * s;
        self.trunk_bytes += c.trunk_bytes as f64 * s;
        self.phases = self.phases.plus(&c.phases);
    }
}

/// What a sequence runs in the next pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Planned {
    /// Rows (ids) of the pass that are this sequence's.
    pub(crate) rows: usize,
    /// Its logits rows (the last ones of its rows).
    pub(crate) logits: Logits,
    /// Of the rows, prompt rows.
    pub(crate) prompt_rows: usize,
}

/// A sequence in flight.
pub(crate) struct Sequence {
    pub(crate) id: SeqId,
    /// A choice waiting for the prefill of the group's first sequence (this one): it runs
    /// nothing until that state is forked into it ([`Sequence::fork`]).
    pub(crate) leader: Option<SeqId>,
    pub(crate) state: SeqState,
    /// The ids the state holds, in order (`state.pos == held.len()` between steps).
    pub(crate) held: Vec<u32>,
    /// Ids still to run: the prompt's rest while prefilling, then the last pick; during a
    /// step, the pass's rows (the last pick and the drafts).
    todo: Vec<u32>,
    /// Of `todo`, ids already run (a prompt fed over several steps).
    done: usize,
    prefilling: bool,
    /// Stop once the state holds this many ids (the prompt's all but last, and the session's
    /// `keep_at`), to keep it: the next last.
    pauses: Vec<usize>,
    sampler: Sampler,
    /// Its logits processor: grammar, thinking budget, bias, penalties, log-probabilities.
    shaper: Shaper,
    /// The sampler after each pick of a verify pass (to rewind to the last emitted one).
    picks: Vec<(u32, Sampler)>,
    /// Each pick's log-probabilities of the pass (when asked).
    scores: Vec<Option<Scored>>,
    /// Why its shaping failed (it ended there).
    error: Option<String>,
    /// A pass's picked ids (reused).
    ids: Vec<u32>,
    stops: Vec<u32>,
    max_new: usize,
    spec: Speculation,
    control: Controller,
    /// This step's drafted ids.
    drafts: Vec<u32>,
    full_recompute: bool,
    keep_step0_logits: bool,
    report: GenReport,
    pending: Pending,
    pass: usize,
    joined: Instant,
    first: Option<Instant>,
    totals: (f64, f64, f64),
    cached: usize,
    restarted: bool,
    hand_back: bool,
    finish: Option<Finish>,
}

impl Sequence {
    /// A sequence for `req` (already checked), starting from its `from` state when the ids it
    /// holds are a strict prefix of the prompt (else on a fresh state of exactly the positions
    /// it needs).
    pub(crate) fn start(id: SeqId, d: &Dims, mut req: Request) -> Sequence {
        let capacity = positions_needed(req.prompt.len(), req.max_new).max(req.reserve);
        let from = req.from.take();
        let reuse = from.as_ref().and_then(|h| reusable(&h.ids, &req.prompt));
        let restarted = from.as_ref().is_some_and(|h| !h.ids.is_empty()) && reuse.is_none();
        let (mut state, held) = match (from, reuse) {
            (Some(h), Some(_)) => (h.state, h.ids),
            _ => (SeqState::new(d, capacity), Vec::new()),
        };
        if state.capacity < capacity {
            // A kept state planned for fewer positions: room for this request (its MLA caches
            // reserve the rest now, as a fresh state's do).
            grow(&mut state, capacity);
        }
        let cached = held.len();
        let last = req.prompt.len() - 1;
        let mut pauses: Vec<usize> = match &req.session {
            Some(s) if s.after_prefill => (s.keep_at.iter().copied().chain([last]))
                .filter(|&k| k > cached && k <= last)
                .collect(),
            _ => Vec::new(),
        };
        pauses.sort_unstable_by(|a, b| b.cmp(a));
        pauses.dedup();
        let mode = if req.full_recompute || req.spec.drafter.is_none() {
            SpecMode::Off
        } else {
            req.spec.mode
        };
        let mut control = match req.spec.control.take() {
            Some(c) if c.mode() == mode => c,
            _ => Controller::new(mode),
        };
        control.costly_drafter =
            (req.spec.drafter.as_ref()).is_some_and(|d| d.model_cost().is_some());
        let vocab = d.vocab;
        // What every step fills, sized now: a step allocates nothing of its own.
        let per_pass = control.mode().max_drafts() + 1;
        Sequence {
            id,
            leader: None,
            state,
            todo: req.prompt.clone(),
            done: cached,
            held,
            prefilling: true,
            pauses,
            sampler: req.sampler,
            shaper: Shaper::new(req.shaping),
            picks: Vec::with_capacity(per_pass),
            scores: Vec::with_capacity(per_pass),
            error: None,
            ids: Vec::with_capacity(per_pass),
            stops: (req.stop_ids.into_iter())
                .filter(|&s| (s as usize) < vocab)
                .collect(),
            max_new: req.max_new,
            spec: req.spec,
            control,
            drafts: Vec::with_capacity(per_pass),
            full_recompute: req.full_recompute,
            keep_step0_logits: req.keep_step0_logits,
            report: GenReport {
                prompt_ids: req.prompt,
                generated_ids: Vec::with_capacity(req.max_new),
                steps: Vec::with_capacity(req.max_new),
                ..GenReport::default()
            },
            pending: Pending::default(),
            pass: 0,
            joined: Instant::now(),
            first: None,
            totals: (0.0, 0.0, 0.0),
            cached,
            restarted,
            hand_back: req.hand_back,
            finish: None,
        }
    }

    /// Prompt ids a state it started from already held.
    pub(crate) fn cached_ids(&self) -> usize {
        self.cached
    }

    /// Prompt ids it still has to run before its first pick (0 once decoding).
    pub(crate) fn prompt_left(&self) -> usize {
        if self.prefilling {
            self.todo.len() - self.done
        } else {
            0
        }
    }

    /// Its ids ended it (a stop id, its length, its sink).
    pub(crate) fn finished(&self) -> bool {
        self.finish.is_some()
    }

    /// The ids generated so far.
    pub(crate) fn generated(&self) -> usize {
        self.report.generated_ids.len()
    }

    /// Plan its rows of the next pass: up to `budget` prompt ids while prefilling (taken from
    /// the budget), or the last pick and any drafts (journaled: a verify pass). `None`: it sits
    /// this step out (no prompt budget left).
    pub(crate) fn plan(
        &mut self,
        source: &dyn WeightSource,
        vocab: usize,
        budget: &mut usize,
    ) -> Option<Planned> {
        if self.leader.is_some() {
            return None;
        }
        if self.prefilling {
            let end = (self.pauses.last().copied())
                .unwrap_or(self.todo.len())
                .min(self.todo.len());
            let take = (end - self.done).min(*budget);
            if take == 0 {
                return None;
            }
            *budget -= take;
            let last = self.done + take == self.todo.len();
            return Some(Planned {
                rows: take,
                logits: if last { Logits::Last } else { Logits::None },
                prompt_rows: take,
            });
        }
        self.draft(source, vocab);
        if self.drafts.is_empty() {
            return Some(Planned {
                rows: 1,
                logits: Logits::Last,
                prompt_rows: 0,
            });
        }
        self.todo.truncate(1);
        self.todo.extend_from_slice(&self.drafts);
        self.state.begin_journal();
        Some(Planned {
            rows: self.todo.len(),
            logits: Logits::All,
            prompt_rows: 0,
        })
    }

    /// Ask the drafter for this pass's drafts (auto mode chooses how many).
    fn draft(&mut self, source: &dyn WeightSource, vocab: usize) {
        self.drafts.clear();
        // At most max_new − generated − 1 drafts: a pass emits at most drafts + 1 ids.
        let room = self.max_new - self.generated() - 1;
        let k = self
            .control
            .choose(room.min(self.control.mode().max_drafts()));
        let Some(drafter) = self.spec.drafter.as_mut().filter(|_| k > 0) else {
            return;
        };
        // The context: every id so far; the last pick is not yet run.
        self.held.push(self.todo[0]);
        let mut drafts = drafter.draft(source, &self.held, k);
        self.held.pop();
        drafts.truncate(k);
        // A drafter's id outside the vocabulary ends the draft.
        if let Some(bad) = drafts.iter().position(|&d| d as usize >= vocab) {
            drafts.truncate(bad);
        }
        self.drafts = drafts;
    }

    /// Split borrows for the pass: its rows and its state.
    pub(crate) fn rows_and_state(&mut self, p: &Planned) -> (&[u32], &mut SeqState) {
        (&self.todo[self.done..self.done + p.rows], &mut self.state)
    }

    /// The pass ran its rows (`logits`: its logits rows): feed what it ran into `held`, keep
    /// the prefill's session at the pause, and pick, emit and roll back as the rows say.
    pub(crate) fn take(
        &mut self,
        d: &Dims,
        p: &Planned,
        logits: &mut [f32],
        cost: &PassCost,
        out: &mut Outputs<'_>,
    ) -> Result<(), ModelError> {
        self.pending.add(cost);
        self.totals.0 += cost.bytes as f64 * cost.share;
        self.totals.1 += cost.requests as f64 * cost.share;
        self.totals.2 += cost.hits as f64 * cost.share;
        if !self.prefilling {
            return self.decoded(d, logits, cost.seconds, out);
        }
        let ran = self.done..self.done + p.rows;
        self.held.extend_from_slice(&self.todo[ran]);
        self.done += p.rows;
        if self.pauses.last() == Some(&self.done) {
            self.pauses.pop();
            out.at_prefill(self.id, &self.state, &self.held);
        }
        if self.done < self.todo.len() {
            return Ok(());
        }
        self.first_pick(d, logits, out);
        Ok(())
    }

    /// This pass ends its first prefill (`p` is its plan): its state can be forked into the
    /// other choices of its group.
    pub(crate) fn forks_now(&self, p: &Planned) -> bool {
        self.prefilling && self.pass == 0 && p.prompt_rows > 0 && p.logits == Logits::Last
    }

    /// A choice takes the prefill of its group's first sequence: `state` holding `held` (the
    /// whole prompt), of which `cached` came from a kept session, and `logits`, its copy of the
    /// prompt's last row. It then picks its first id with its own sampler and shaping, as a
    /// sequence that had run the prompt itself would.
    pub(crate) fn fork(
        &mut self,
        d: &Dims,
        mut state: SeqState,
        cached: usize,
        logits: &mut [f32],
        cost: &PassCost,
        out: &mut Outputs<'_>,
    ) {
        if state.capacity < self.state.capacity {
            grow(&mut state, self.state.capacity);
        }
        self.state = state;
        self.leader = None;
        self.held.clone_from(&self.todo);
        self.done = self.todo.len();
        self.cached = cached;
        self.pending.add(cost);
        self.first_pick(d, logits, out);
    }

    /// The prompt is in the state and `logits` is its last row: the first pick.
    fn first_pick(&mut self, d: &Dims, logits: &mut [f32], out: &mut Outputs<'_>) {
        self.prefilling = false;
        if self.pass == 0 && self.keep_step0_logits {
            self.report.step0_logits = Some(logits.to_vec());
        }
        if self.pass > 0 {
            // Check mode: the whole sequence again was this id's pass.
            self.report.spec.forward_passes += 1;
        }
        out.prefilled(self.id, self.cached, self.held.len());
        self.drafts.clear();
        self.scores.clear();
        let Some(token) = self.pick(logits) else {
            return;
        };
        self.emit(&[token], 0, out);
        self.next(d, token);
    }

    /// A decode or verify pass ran: pick each row up to the first disagreement with the drafts
    /// (or a stop id), emit, and keep only the positions whose ids were emitted.
    fn decoded(
        &mut self,
        d: &Dims,
        logits: &mut [f32],
        seconds: f64,
        out: &mut Outputs<'_>,
    ) -> Result<(), ModelError> {
        let vocab = d.vocab;
        let drafted = self.drafts.len();
        self.picks.clear();
        self.scores.clear();
        // The sampler draws once per pick, as plain decoding does; its state after each pick
        // is kept in case fewer ids are emitted.
        for (i, row) in logits.chunks_exact_mut(vocab).enumerate() {
            let Some(token) = self.pick(row) else {
                // The shaping failed: the sequence ended (nothing of this pass is emitted).
                return Ok(());
            };
            self.picks.push((token, self.sampler.clone()));
            if self.stops.contains(&token) || i == drafted || token != self.drafts[i] {
                break;
            }
        }
        let produced = self.picks.len();
        // Drafts checked: every accepted one, plus the one that was refused (if any).
        let tested = drafted.min(produced);
        self.control.observe(drafted, tested, produced - 1, seconds);
        self.report.spec.forward_passes += 1;
        self.report.spec.drafted_tokens += drafted as u64;
        let mut ids = std::mem::take(&mut self.ids);
        ids.clear();
        ids.extend(self.picks.iter().map(|p| p.0));
        let emitted = self.emit(&ids, drafted, out);
        self.report.spec.accepted_tokens += (emitted - 1) as u64;
        let last = self.todo[0];
        if drafted > 0 {
            // Keep the positions whose ids were emitted: the last id and the accepted drafts
            // before the final pick (the final pick itself is fed by the next pass).
            self.state.rollback(emitted)?;
            self.held.extend_from_slice(&self.todo[..emitted]);
            // The sampler as plain decoding would leave it after `emitted` picks.
            self.sampler = self.picks[emitted - 1].1.clone();
        } else {
            self.held.push(last);
        }
        let token = ids[emitted - 1];
        self.ids = ids;
        self.next(d, token);
        Ok(())
    }

    /// The one place an id is chosen from a row of logits: the shaper edits the row (or forces
    /// the id), the sampler picks, the shaper takes the id. `None`: the shaping failed and the
    /// sequence ended with its error.
    fn pick(&mut self, row: &mut [f32]) -> Option<u32> {
        if self.shaper.is_plain() {
            self.scores.push(None);
            return Some(self.sampler.pick(row));
        }
        let picked = self.shaper.prepare(row).and_then(|forced| {
            let id = forced.unwrap_or_else(|| self.sampler.pick(row));
            self.scores.push(self.shaper.scored(row, id));
            self.shaper.commit(id)?;
            Ok(id)
        });
        match picked {
            Ok(id) => Some(id),
            Err(e) => {
                tracing::warn!("sequence {}: {e}", self.id);
                self.error = Some(e.to_string());
                self.cancel();
                None
            }
        }
    }

    /// Emit `ids` (one pass's picks) to the sinks; the sequence ends at a stop id, at its
    /// length or when a sink says so. Returns how many were emitted.
    fn emit(&mut self, ids: &[u32], drafted: usize, out: &mut Outputs<'_>) -> usize {
        let produced = ids.len();
        let share = 1.0 / produced as f64;
        let p = std::mem::take(&mut self.pending);
        let seconds = p.seconds;
        let bytes = p.bytes.round() as u64;
        let now = Instant::now();
        self.first.get_or_insert(now);
        let mut emitted = 0;
        for (i, &token) in ids.iter().enumerate() {
            let first = i == 0;
            let r = StepReport {
                step: self.generated(),
                token,
                seconds: seconds * share,
                bytes_read: bytes / produced as u64 + u64::from(first) * (bytes % produced as u64),
                resident_hit_rate: (p.requests > 0.0).then(|| p.hits / p.requests),
                io_wait_seconds: p.io_wait * share,
                io_read_seconds: p.io_read * share,
                pass: self.pass,
                drafted: if first { drafted } else { 0 },
                accepted: if first { produced - 1 } else { 0 },
                prefetch_bytes: if first {
                    p.prefetch_bytes.round() as u64
                } else {
                    0
                },
                prefetch_used: if first {
                    p.prefetch_used.round() as u64
                } else {
                    0
                },
                trunk_bytes_read: if first {
                    p.trunk_bytes.round() as u64
                } else {
                    0
                },
                phases: p.phases.scaled(share),
                first_of_pass: first,
                scored: self.scores.get_mut(i).and_then(Option::take),
            };
            let flow = out.token(self.id, &r);
            self.report.steps.push(r);
            self.report.generated_ids.push(token);
            emitted += 1;
            if self.stops.contains(&token) {
                self.report.stopped_on = Some(token);
                self.finish = Some(Finish::EndId(token));
            } else if self.generated() >= self.max_new {
                self.finish = Some(Finish::Length);
            } else if flow == Flow::Stop {
                self.finish = Some(Finish::Cancelled);
            }
            if self.finish.is_some() {
                break;
            }
        }
        self.pass += 1;
        emitted
    }

    /// After a pass's last emitted id `token`: the next pass runs it (or, in check mode, the
    /// whole sequence again on a fresh state).
    fn next(&mut self, d: &Dims, token: u32) {
        self.todo.clear();
        self.done = 0;
        if self.finished() {
            return;
        }
        // The grammar's next mask runs beside the next pass.
        self.shaper.ahead();
        if self.full_recompute {
            self.todo.extend_from_slice(&self.held);
            self.todo.push(token);
            self.held.clear();
            self.state = SeqState::new(d, self.state.capacity);
            self.prefilling = true;
        } else {
            self.todo.push(token);
        }
    }

    /// Set aside by a cancel.
    pub(crate) fn cancel(&mut self) {
        self.finish = Some(Finish::Cancelled);
        if self.state.journal.active {
            // A cancel never lands mid-pass; a journal left open would be a bug. Close it
            // keeping what the pass ran so the state stays usable.
            let ran = self.state.pos - self.state.journal.pos0;
            let _ = self.state.rollback(ran);
        }
    }

    /// Its end, for the outputs; `usable`: its state can be handed back (not after a failed
    /// pass).
    pub(crate) fn ending(self, usable: bool) -> Ending {
        let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        let usage = Usage {
            prompt_ids: n(self.report.prompt_ids.len()),
            cached_ids: n(self.cached),
            generated: n(self.report.generated_ids.len()),
        };
        let valid = usable && self.state.pos == self.held.len() && !self.state.journal.active;
        Ending {
            seq: self.id,
            finish: self.finish.unwrap_or(Finish::Cancelled),
            report: self.report,
            usage,
            joined: self.joined,
            first: self.first,
            bytes: self.totals.0,
            requests: self.totals.1,
            hits: self.totals.2,
            restarted: self.restarted,
            held: valid.then_some(Held {
                state: self.state,
                ids: self.held,
            }),
            sampler: self.sampler,
            spec: Speculation {
                control: Some(self.control),
                ..self.spec
            },
            hand_back: self.hand_back,
            error: self.error,
            mask: self.shaper.mask_cost(),
        }
    }
}

impl Ending {
    /// The end of a request cancelled before it joined.
    pub(crate) fn unstarted(seq: SeqId, req: Request) -> Ending {
        let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        let now = Instant::now();
        Ending {
            seq,
            finish: Finish::Cancelled,
            usage: Usage {
                prompt_ids: n(req.prompt.len()),
                cached_ids: 0,
                generated: 0,
            },
            report: GenReport {
                prompt_ids: req.prompt,
                generated_ids: Vec::with_capacity(req.max_new),
                steps: Vec::with_capacity(req.max_new),
                ..GenReport::default()
            },
            joined: now,
            first: None,
            bytes: 0.0,
            requests: 0.0,
            hits: 0.0,
            restarted: false,
            held: None,
            sampler: req.sampler,
            spec: req.spec,
            hand_back: false,
            error: None,
            mask: None,
        }
    }
}

/// Give `state` room for `capacity` positions (its MLA caches reserve them).
fn grow(state: &mut SeqState, capacity: usize) {
    for l in &mut state.layers {
        if let crate::model::state::LayerState::Mla(c) = l {
            let want = capacity * c.width;
            c.rows.reserve_exact(want.saturating_sub(c.rows.len()));
        }
    }
    state.capacity = capacity;
}

/// A state handed in holds what it says: `Err((position, ids))` otherwise.
pub(crate) fn check_held(h: &Held) -> Result<(), (usize, usize)> {
    if h.state.pos != h.ids.len() || h.ids.len() > h.state.capacity {
        return Err((h.state.pos, h.ids.len()));
    }
    Ok(())
}
