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
        let seq = self.next_seq;
        self.next_seq += 1;
        self.slots.push(Slot {
            seq,
            state: model.new_state(capacity),
            todo: req.prompt,
            done: 0,
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

    /// Remove a sequence (a cancel, a client gone); the others go on. False if it is not in the
    /// batch (it ended already).
    pub fn leave(&mut self, seq: u64) -> bool {
        let before = self.slots.len();
        self.slots.retain(|s| s.seq != seq);
        self.slots.len() < before
    }

    /// One forward pass over every sequence's next rows, then a pick for every sequence whose
    /// prompt is done. Sequences that end leave the batch. On error every sequence in it is
    /// dropped (their states are unusable) and the error is returned.
    pub fn step(&mut self, model: &mut Model<'_>) -> Result<(Vec<Emitted>, StepShape), ModelError> {
        if self.slots.is_empty() {
            return Ok((Vec::new(), StepShape::default()));
        }
        let t0 = Instant::now();
        // Prompt rows this step may take, first come first served (0 = no bound).
        let mut budget = if self.prefill_chunk == 0 {
            usize::MAX
        } else {
            self.prefill_chunk
        };
        let mut shape = StepShape::default();
        let mut rows: Vec<SeqRows<'_>> = Vec::with_capacity(self.slots.len());
        // (slot index, ids it runs) of every slot in the pass.
        let mut ran: Vec<(usize, usize)> = Vec::with_capacity(self.slots.len());
        for (i, s) in self.slots.iter_mut().enumerate() {
            let left = &s.todo[s.done..];
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
                logits: if take == left.len() {
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
        let mut out = Vec::new();
        for ((i, take), logits) in ran.into_iter().zip(logits) {
            let s = &mut self.slots[i];
            s.done += take;
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
            out.push(Emitted {
                seq: s.seq,
                token,
                finish,
            });
        }
        let ended: Vec<u64> = out
            .iter()
            .filter(|e| e.finish.is_some())
            .map(|e| e.seq)
            .collect();
        self.slots.retain(|s| !ended.contains(&s.seq));
        shape.seconds = t0.elapsed().as_secs_f64();
        Ok((out, shape))
    }
}
