//! The engine's loop: each [`Engine::step`] admits what fits (the scheduler), asks every running
//! sequence for its rows — a prompt chunk within the step's prefill budget, a last pick, a last
//! pick and its drafts — runs ONE forward pass over all of them ([`Model::forward_batch`]: each
//! trunk weight and each layer's experts read once for every row), and hands each sequence its
//! logits rows (picks, stop rules, rollback of rejected drafts: [`crate::engine::sequence`]).
//! One sequence alone is a step of one; its ids are those it gets in any company, because the
//! pass gives every row its solo logits bit for bit.

use std::time::Instant;

use crate::engine::memory::EnginePlan;
use crate::engine::outputs::{Ended, Ending, Finished, Flow, Outputs, Sink, StepReport};
use crate::engine::request::{Request, RequestError, SeqId};
use crate::engine::scheduler::{Removed, Scheduler};
use crate::engine::sequence::{PassCost, Planned};
use crate::model::{Model, ModelError, Scratch, SeqRows};

/// What one step ran.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepShape {
    /// Sequences in the pass (one whose prompt waits for the prefill budget sits a step out).
    pub seqs: usize,
    /// Rows of the pass: prompt rows, last picks and drafts.
    pub rows: usize,
    /// Of them, prompt rows.
    pub prompt_rows: usize,
    /// Of them, drafted ids.
    pub draft_rows: usize,
    /// Wall seconds of the step (drafting, the pass, the picks).
    pub seconds: f64,
}

/// Why [`Engine::run_one`] failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request was refused.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// A pass failed.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// A sink that hands each id to a function.
struct EachId<'a>(&'a mut dyn FnMut(&StepReport) -> Flow);

impl Sink for EachId<'_> {
    fn token(&mut self, s: &StepReport) -> Flow {
        (self.0)(s)
    }
    fn done(&mut self, _: &Finished) {}
}

/// The engine: a model, the sequences it runs, and the pass's reused temporaries.
pub struct Engine<'m> {
    model: Model<'m>,
    sched: Scheduler,
    scratch: Scratch,
    planned: Vec<(usize, Planned)>,
}

impl std::fmt::Debug for Engine<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("plan", self.sched.plan())
            .field("running", &self.sched.running())
            .field("waiting", &self.sched.waiting())
            .finish()
    }
}

impl<'m> Engine<'m> {
    /// An engine over `model` planned for `plan` (its state budget bounds admission).
    pub fn new(model: Model<'m>, plan: EnginePlan) -> Engine<'m> {
        let sched = Scheduler::new(plan, &model.dims);
        Engine {
            model,
            sched,
            scratch: Scratch::default(),
            planned: Vec::new(),
        }
    }

    /// The model (its counters, trace and taps).
    pub fn model(&self) -> &Model<'m> {
        &self.model
    }

    /// The model, to set its taps before a run.
    pub fn model_mut(&mut self) -> &mut Model<'m> {
        &mut self.model
    }

    /// The model back (what it bound, its counters).
    pub fn into_model(self) -> Model<'m> {
        self.model
    }

    /// Run `req` alone to its end (other sequences in the engine run beside it); `on_step` sees
    /// each of its ids and may end it ([`Flow::Stop`]). What it handed back (its report; its
    /// state, sampler and speculation state when usable).
    pub fn run_one(
        &mut self,
        req: Request,
        on_step: &mut dyn FnMut(&StepReport) -> Flow,
    ) -> Result<Ended, EngineError> {
        let mut out = Outputs::new(None);
        let req = Request {
            hand_back: true,
            ..req
        };
        let seq = self.submit(req, Box::new(EachId(on_step)), &mut out)?;
        self.run_to_end(&mut out)?;
        Ok(out.take_ended(seq).expect("the request asked for its end"))
    }

    /// The plan.
    pub fn plan(&self) -> &EnginePlan {
        self.sched.plan()
    }

    /// Queue `req` with its `sink` (registered in `out`); it joins at the next step with room.
    pub fn submit<'o>(
        &mut self,
        req: Request,
        sink: Box<dyn Sink + 'o>,
        out: &mut Outputs<'o>,
    ) -> Result<SeqId, RequestError> {
        let session = req.session.clone();
        let seq = self.sched.submit(&self.model.dims, req)?;
        out.attach(seq, sink, session);
        Ok(seq)
    }

    /// Queue the choices of one prompt (`n` > 1 of the OpenAI API), each with its sink: the
    /// first prefills the prompt once, then its state and its last logits row are forked into
    /// the others, and all of them decode side by side, each with its own sampler, shaping,
    /// stop ids and speculation. Each choice's ids are those of its request run alone. The group
    /// joins whole (every member's state counted); it is refused when it cannot ever fit
    /// ([`RequestError::TooManyChoices`]) or its prompts differ. The sessions of the choices but
    /// the first are never kept (they would hold the same prompt).
    pub fn submit_choices<'o>(
        &mut self,
        choices: Vec<(Request, Box<dyn Sink + 'o>)>,
        out: &mut Outputs<'o>,
    ) -> Result<Vec<SeqId>, RequestError> {
        let (mut reqs, sinks): (Vec<Request>, Vec<_>) = choices.into_iter().unzip();
        let sessions: Vec<_> = (reqs.iter_mut().enumerate())
            .map(|(i, r)| {
                if i == 0 {
                    r.session.clone()
                } else {
                    r.session.take()
                }
            })
            .collect();
        let seqs = self.sched.submit_choices(&self.model.dims, reqs)?;
        for ((&seq, sink), session) in seqs.iter().zip(sinks).zip(sessions) {
            out.attach(seq, sink, session);
        }
        Ok(seqs)
    }

    /// Cancel sequence `seq` (between steps): it ends as cancelled, keeping what its session
    /// kept after the prefill. False when it is not in the engine.
    pub fn cancel(&mut self, seq: SeqId, out: &mut Outputs<'_>) -> bool {
        match self.sched.remove(seq) {
            Some(Removed::Running(mut s)) => {
                s.cancel();
                out.finished(s.ending(true));
                true
            }
            Some(Removed::Waiting(req)) => {
                out.finished(Ending::unstarted(seq, *req));
                true
            }
            None => false,
        }
    }

    /// Nothing waiting or running.
    pub fn is_idle(&self) -> bool {
        self.sched.running() == 0 && self.sched.waiting() == 0
    }

    /// Sequences running and waiting.
    pub fn load(&self) -> (usize, usize) {
        (self.sched.running(), self.sched.waiting())
    }

    /// Run steps until nothing is left.
    pub fn run_to_end(&mut self, out: &mut Outputs<'_>) -> Result<(), ModelError> {
        while !self.is_idle() {
            self.step(out)?;
        }
        Ok(())
    }

    /// One step: admit, one pass over every running sequence's rows, picks; the sequences that
    /// end leave (their sinks told). On a failed pass every running sequence is dropped (their
    /// states are unusable) and the error returned.
    pub fn step(&mut self, out: &mut Outputs<'_>) -> Result<StepShape, ModelError> {
        let t0 = Instant::now();
        self.sched.admit(&self.model.dims);
        let r = self.pass(out, t0);
        if r.is_err() {
            for s in self.sched.take_all() {
                out.dropped(s.id);
            }
            return r;
        }
        for s in self.sched.take_finished() {
            out.finished(s.ending(true));
        }
        out.after_step();
        r
    }

    fn pass(&mut self, out: &mut Outputs<'_>, t0: Instant) -> Result<StepShape, ModelError> {
        let mut shape = StepShape::default();
        let source = self.model.source();
        let vocab = self.model.dims.vocab;
        let mut budget = self.sched.prefill_rows();
        self.planned.clear();
        orphans(&mut self.sched.running);
        for (i, s) in self.sched.running.iter_mut().enumerate() {
            if let Some(p) = s.plan(source, vocab, &mut budget) {
                shape.rows += p.rows;
                shape.prompt_rows += p.prompt_rows;
                if p.prompt_rows == 0 {
                    shape.draft_rows += p.rows - 1;
                }
                self.planned.push((i, p));
            }
        }
        shape.seqs = self.planned.len();
        let Some(&(first, _)) = self.planned.first() else {
            return Ok(shape);
        };
        // The trace's step number: the first sequence's ids so far.
        self.model.step = self.sched.running[first].generated() as u64;
        let before = source.stats();
        let wait0 = self.model.counters.expert_wait_seconds;
        let phases0 = self.model.counters.phases;
        let mut logits = {
            let mut planned = self.planned.iter().peekable();
            let mut rows: Vec<SeqRows<'_>> = Vec::with_capacity(self.planned.len());
            for (i, s) in self.sched.running.iter_mut().enumerate() {
                let Some(&&(_, p)) = planned.peek().filter(|(j, _)| *j == i) else {
                    continue;
                };
                planned.next();
                let (ids, state) = s.rows_and_state(&p);
                rows.push(SeqRows {
                    ids,
                    state,
                    logits: p.logits,
                });
            }
            self.model.forward_batch(&mut rows, &mut self.scratch)?
        };
        let after = source.stats();
        let m = &self.model;
        let cost = PassCost::between(
            &before,
            &after,
            m.counters.expert_wait_seconds - wait0,
            m.counters.phases.since(&phases0),
        );
        let all = shape.rows.max(1) as f64;
        let mut at = 0;
        for &(i, p) in &self.planned {
            let k = p.logits.rows(p.rows) * m.dims.vocab;
            let c = PassCost {
                seconds: t0.elapsed().as_secs_f64(),
                share: p.rows as f64 / all,
                ..cost
            };
            let rows = &mut logits[at..at + k];
            let running = &mut self.sched.running;
            // The first of a group of choices ends its prefill: its state and last row, before
            // its own pick edits the row, are every other choice's.
            let fork = (running[i].forks_now(&p))
                .then(|| running[i].id)
                .filter(|&id| running.iter().any(|f| f.leader == Some(id)))
                .map(|id| {
                    (
                        id,
                        running[i].state.clone(),
                        running[i].cached_ids(),
                        rows.to_vec(),
                    )
                });
            running[i].take(&m.dims, &p, rows, &c, out)?;
            if let Some((id, state, cached, row)) = fork {
                let share = PassCost { share: 0.0, ..c };
                for f in running.iter_mut().filter(|f| f.leader == Some(id)) {
                    f.fork(
                        &m.dims,
                        state.clone(),
                        cached,
                        &mut row.clone(),
                        &share,
                        out,
                    );
                }
            }
            at += k;
        }
        shape.seconds = t0.elapsed().as_secs_f64();
        Ok(shape)
    }
}

/// A choice whose group's first sequence left before its prefill ended (cancelled) prefills
/// the prompt itself.
fn orphans(running: &mut [crate::engine::sequence::Sequence]) {
    if running.iter().all(|s| s.leader.is_none()) {
        return;
    }
    let prefilling: Vec<SeqId> = (running.iter())
        .filter(|s| s.leader.is_none() && s.prompt_left() > 0)
        .map(|s| s.id)
        .collect();
    for s in running.iter_mut() {
        if s.leader.is_some_and(|l| !prefilling.contains(&l)) {
            s.leader = None;
        }
    }
}
