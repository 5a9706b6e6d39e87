//! Several sequences decoded together (continuous batching inside one worker): every step is
//! ONE forward pass over the rows of every sequence in the batch — a decoding sequence's last
//! id, a joining sequence's next prompt chunk — so each trunk weight and each MoE layer's
//! experts are read once for all of them ([`Model::forward_batch`]). A sequence joins at the
//! next step and leaves when it ends (a stop id, its length) or is cancelled, without stopping
//! the others. Its ids are the ones it gets alone: the pass gives each sequence its solo logits
//! bit for bit, and each sequence has its own sampler.

use std::time::Instant;

use crate::generate::{positions_needed, Sampler};
use crate::model::{Logits, Model, ModelError, Scratch, SeqRows, SeqState};

/// What one sequence of a batch asks for.
#[derive(Clone, Debug)]
pub struct SeqRequest {
    /// The prompt's ids (at least one).
    pub prompt: Vec<u32>,
    /// Tokens to generate (≥ 1).
    pub max_new: usize,
    /// Its token choice (cloned from the job's: the same seed gives the same draws as alone).
    pub sampler: Sampler,
    /// Generation ends after one of these ids (ids outside the vocabulary are dropped).
    pub stop_ids: Vec<u32>,
    /// Stop once every prompt id but the last is in the state ([`StepOut::paused`]) until
    /// [`Batch::resume`]: the state there can be kept (a session a retry resumes from).
    pub pause_before_last: bool,
}

/// A state to start a sequence from (a kept session): it holds `held`, a strict prefix of the
/// request's prompt.
#[derive(Debug)]
pub struct Resumed {
    /// The state.
    pub state: SeqState,
    /// The ids it holds.
    pub held: Vec<u32>,
}

/// Why a sequence left the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// It generated a stop id (the last id of its output).
    Stop(u32),
    /// It generated `max_new` ids.
    Length,
}

/// One id a step produced for one sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Emitted {
    /// The sequence ([`Batch::join`]'s handle).
    pub seq: u64,
    /// The id.
    pub token: u32,
    /// Set when this id ended the sequence: it has left the batch.
    pub finish: Option<Finish>,
}

/// What one step produced.
#[derive(Debug, Default)]
pub struct StepOut {
    /// The ids picked, in the batch's order.
    pub emitted: Vec<Emitted>,
    /// Sequences that reached their pause (every prompt id but the last is in the state).
    pub paused: Vec<u64>,
    /// The pass's shape and time.
    pub shape: StepShape,
    /// Each sequence's share of the pass (its rows over the pass's rows), for dividing what the
    /// pass read among the sequences in it.
    pub shares: Vec<(u64, f64)>,
    /// The sequences that ended this step, with their final states (the last id picked is not
    /// in it: it was never run).
    pub ended: Vec<(u64, Resumed)>,
}

/// What one step ran.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepShape {
    /// Sequences in the pass (a sequence whose prompt waits for the prefill budget sits a step
    /// out).
    pub seqs: usize,
    /// Rows of the pass (decode rows plus prompt rows).
    pub rows: usize,
    /// Of them, prompt rows.
    pub prompt_rows: usize,
    /// Wall seconds of the pass and the picks.
    pub seconds: f64,
}

struct Slot {
    seq: u64,
    state: SeqState,
    /// The ids the state holds, in order (for keeping it as a session).
    held: Vec<u32>,
    /// Waiting for [`Batch::resume`] (or still to pause: `pause` below).
    paused: bool,
    /// Pause once the state holds this many ids (the prompt's all but last).
    pause: Option<usize>,
    /// Ids still to run: the prompt's rest, or the last pick (one id).
    todo: Vec<u32>,
    /// Of `todo`, ids already run (a prompt fed over several steps).
    done: usize,
    prompt_left: bool,
    sampler: Sampler,
    max_new: usize,
    stops: Vec<u32>,
    generated: usize,
}

/// Sequences decoded together. Every step runs each decoding sequence's one id and at most
/// `prefill_chunk` prompt ids in all (the earliest joined sequences' first), so a pass never
/// has more than `prefill_chunk` + (sequences) rows — the memory plan's bound — and a long
/// prompt delays the others' next tokens by at most one chunk's compute per step.
pub struct Batch {
    slots: Vec<Slot>,
    scratch: Scratch,
    prefill_chunk: usize,
    next_seq: u64,
}

impl Batch {
    /// An empty batch running at most `prefill_chunk` prompt ids per step (0 = every waiting
    /// prompt whole in the next step).
    pub fn new(prefill_chunk: usize) -> Batch {
        Batch {
            slots: Vec::new(),
            scratch: Scratch::default(),
            prefill_chunk,
            next_seq: 0,
        }
    }

    /// Sequences in the batch.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// No sequence in the batch.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Add a sequence; it runs from the next step. Its state is sized for exactly its request.
    /// Returns its handle.
    pub fn join(&mut self, model: &Model<'_>, req: SeqRequest) -> Result<u64, ModelError> {
        self.join_from(model, req, None)
    }

    /// [`Batch::join`] from a kept state holding a strict prefix of the prompt (only the rest is
    /// run); its capacity must hold the request.
    pub fn join_from(
        &mut self,
        model: &Model<'_>,
        req: SeqRequest,
        from: Option<Resumed>,
    ) -> Result<u64, ModelError> {
        let vocab = model.dims.vocab;
        if req.prompt.is_empty() {
            return Err(ModelError::Input("empty prompt".into()));
        }
        if req.max_new == 0 {
            return Err(ModelError::Input("nothing to generate (max_new 0)".into()));
        }
        if let Some(&bad) = req.prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(ModelError::Input(format!(
                "token id {bad} outside the vocabulary of {vocab}"
            )));
        }
        let capacity = positions_needed(req.prompt.len(), req.max_new);
        let (state, held) = match from {
            Some(r) => {
                let fits = r.state.pos == r.held.len()
                    && r.held.len() < req.prompt.len()
                    && req.prompt.starts_with(&r.held)
                    && r.state.capacity >= capacity;
                if !fits {
                    return Err(ModelError::Input(format!(
                        "a kept state of {} ids (capacity {}) cannot start a prompt of {} ids \
                         and {} new",
                        r.held.len(),
                        r.state.capacity,
                        req.prompt.len(),
                        req.max_new
                    )));
                }
                (r.state, r.held)
            }
            None => (model.new_state(capacity), Vec::new()),
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        // Nothing to keep when the kept state already holds all of the prompt but its last id.
        let pause = (req.pause_before_last && req.prompt.len() - 1 > held.len())
            .then(|| req.prompt.len() - 1);
        self.slots.push(Slot {
            seq,
            state,
            todo: req.prompt,
            done: held.len(),
            held,
            paused: false,
            pause,
            prompt_left: true,
            sampler: req.sampler,
            max_new: req.max_new,
            stops: req
                .stop_ids
                .into_iter()
                .filter(|&s| (s as usize) < vocab)
                .collect(),
            generated: 0,
        });
        Ok(seq)
    }

    /// Let a paused sequence go on from the next step (no effect on others).
    pub fn resume(&mut self, seq: u64) {
        if let Some(s) = self.slots.iter_mut().find(|s| s.seq == seq) {
            s.paused = false;
        }
    }

    /// A sequence's state and the ids it holds (to keep it as a session).
    pub fn state(&self, seq: u64) -> Option<(&SeqState, &[u32])> {
        self.slots
            .iter()
            .find(|s| s.seq == seq)
            .map(|s| (&s.state, &s.held[..]))
    }

    /// Remove a sequence (a cancel, a client gone, or one that ended and was kept); the others
    /// go on. Its state and the ids it holds; `None` if it is not in the batch.
    pub fn leave(&mut self, seq: u64) -> Option<Resumed> {
        let i = self.slots.iter().position(|s| s.seq == seq)?;
        let s = self.slots.remove(i);
        Some(Resumed {
            state: s.state,
            held: s.held,
        })
    }

    /// One forward pass over every sequence's next rows, then a pick for every sequence whose
    /// prompt is done. Sequences that end leave the batch (their final states are in
    /// [`StepOut::ended`]). On error every sequence in it is dropped (their states are
    /// unusable) and the error is returned.
    pub fn step(&mut self, model: &mut Model<'_>) -> Result<StepOut, ModelError> {
        let mut out = StepOut::default();
        if self.slots.is_empty() {
            return Ok(out);
        }
        let t0 = Instant::now();
        // Prompt rows this step may take, first come first served (0 = no bound).
        let mut budget = if self.prefill_chunk == 0 {
            usize::MAX
        } else {
            self.prefill_chunk
        };
        let shape = &mut out.shape;
        let mut rows: Vec<SeqRows<'_>> = Vec::with_capacity(self.slots.len());
        // (slot index, ids it runs) of every slot in the pass.
        let mut ran: Vec<(usize, usize)> = Vec::with_capacity(self.slots.len());
        for (i, s) in self.slots.iter_mut().enumerate() {
            if s.paused {
                continue;
            }
            let mut left = &s.todo[s.done..];
            if let Some(p) = s.pause {
                left = &left[..p.saturating_sub(s.done).min(left.len())];
            }
            let take = if s.prompt_left {
                let take = left.len().min(budget);
                budget -= take;
                shape.prompt_rows += take;
                take
            } else {
                left.len()
            };
            if take == 0 {
                continue;
            }
            shape.rows += take;
            ran.push((i, take));
            rows.push(SeqRows {
                ids: &left[..take],
                state: &mut s.state,
                logits: if s.done + take == s.todo.len() {
                    Logits::Last
                } else {
                    Logits::None
                },
            });
        }
        shape.seqs = rows.len();
        let logits = match model.forward_batch(&mut rows, &mut self.scratch) {
            Ok(l) => l,
            Err(e) => {
                self.slots.clear();
                return Err(e);
            }
        };
        drop(rows);
        let all_rows = shape.rows.max(1) as f64;
        for ((i, take), logits) in ran.into_iter().zip(logits) {
            let s = &mut self.slots[i];
            out.shares.push((s.seq, take as f64 / all_rows));
            s.held.extend_from_slice(&s.todo[s.done..s.done + take]);
            s.done += take;
            if s.pause == Some(s.done) {
                s.pause = None;
                s.paused = true;
                out.paused.push(s.seq);
            }
            if s.done < s.todo.len() {
                continue;
            }
            let token = s.sampler.pick(&logits);
            s.generated += 1;
            s.prompt_left = false;
            let finish = if s.stops.contains(&token) {
                Some(Finish::Stop(token))
            } else if s.generated >= s.max_new {
                Some(Finish::Length)
            } else {
                None
            };
            s.todo.clear();
            s.todo.push(token);
            s.done = 0;
            out.emitted.push(Emitted {
                seq: s.seq,
                token,
                finish,
            });
        }
        for e in out.emitted.iter().filter(|e| e.finish.is_some()) {
            if let Some(r) = self.leave(e.seq) {
                out.ended.push((e.seq, r));
            }
        }
        out.shape.seconds = t0.elapsed().as_secs_f64();
        Ok(out)
    }
}
