//! Which sequences run, and how many prompt rows: admission (a request waits, in arrival order,
//! until a slot is free and its state fits the state budget — [`EnginePlan`]), joins and leaves
//! between steps, and the prefill budget of a step (at most `prefill_rows` prompt rows in all,
//! the earliest joined sequences' first, beside every decoding sequence's rows).
//!
//! A group of choices (n sequences of one prompt, [`Scheduler::submit_choices`]) waits and joins
//! as one: every member's state is counted, and the followers sit out until the first one's
//! prefill is forked into them ([`crate::engine::runner`]).
//!
//! A state's bytes are the memory model's ([`EnginePlan::seq_bytes`]) for the positions the
//! request needs: an idle slot costs nothing, a long request takes what it needs (several
//! slots' worth when it is longer than a slot), and one that can never fit is refused at once.

use std::collections::VecDeque;

use crate::engine::memory::EnginePlan;
use crate::engine::request::{Request, RequestError, SeqId};
use crate::engine::sampling::positions_needed;
use crate::engine::sequence::{check_held, Sequence};
use crate::model::Dims;

/// A request waiting for room.
struct Waiting {
    seq: SeqId,
    req: Request,
    bytes: u64,
    /// A choice of a group whose first sequence is this one: it joins with it and takes its
    /// prefilled state.
    follows: Option<SeqId>,
}

/// The sequences waiting and running.
pub(crate) struct Scheduler {
    plan: EnginePlan,
    budget: u64,
    waiting: VecDeque<Waiting>,
    pub(crate) running: Vec<Sequence>,
    /// State bytes of each running sequence, in `running`'s order.
    bytes: Vec<u64>,
    next: SeqId,
}

impl Scheduler {
    pub(crate) fn new(plan: EnginePlan, d: &Dims) -> Scheduler {
        Scheduler {
            plan,
            budget: plan.state_budget(d),
            waiting: VecDeque::new(),
            running: Vec::new(),
            bytes: Vec::new(),
            next: 0,
        }
    }

    pub(crate) fn plan(&self) -> &EnginePlan {
        &self.plan
    }

    /// Check `req` and queue it; it joins at a step when there is room.
    pub(crate) fn submit(&mut self, d: &Dims, req: Request) -> Result<SeqId, RequestError> {
        let bytes = self.check(d, &req)?;
        Ok(self.queue(req, bytes, None))
    }

    /// Check `reqs` (the choices of one prompt: the first prefills it, the others take its
    /// state) and queue them as a group that joins at once; all or none are queued.
    pub(crate) fn submit_choices(
        &mut self,
        d: &Dims,
        reqs: Vec<Request>,
    ) -> Result<Vec<SeqId>, RequestError> {
        let Some(first) = reqs.first() else {
            return Err(RequestError::NothingToGenerate);
        };
        if reqs.iter().any(|r| r.prompt != first.prompt) {
            return Err(RequestError::ChoicesDiffer);
        }
        let bytes = (reqs.iter())
            .map(|r| self.check(d, r))
            .collect::<Result<Vec<u64>, _>>()?;
        let total: u64 = bytes.iter().sum();
        if reqs.len() > self.plan.slots || total > self.budget {
            return Err(RequestError::TooManyChoices {
                n: reqs.len(),
                bytes: total,
                slots: self.plan.slots,
                budget: self.budget,
            });
        }
        let mut seqs: Vec<SeqId> = Vec::with_capacity(reqs.len());
        for (req, b) in reqs.into_iter().zip(bytes) {
            let follows = seqs.first().copied();
            seqs.push(self.queue(req, b, follows));
        }
        Ok(seqs)
    }

    fn queue(&mut self, req: Request, bytes: u64, follows: Option<SeqId>) -> SeqId {
        let seq = self.next;
        self.next += 1;
        self.waiting.push_back(Waiting {
            seq,
            req,
            bytes,
            follows,
        });
        seq
    }

    /// `req`'s state bytes, or why it can never run.
    fn check(&self, d: &Dims, req: &Request) -> Result<u64, RequestError> {
        if req.prompt.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        if req.max_new == 0 {
            return Err(RequestError::NothingToGenerate);
        }
        if let Some(&id) = req.prompt.iter().find(|&&id| id as usize >= d.vocab) {
            return Err(RequestError::Vocab { id, vocab: d.vocab });
        }
        if let Some(h) = &req.from {
            check_held(h).map_err(|(pos, held)| RequestError::BadHeld { pos, held })?;
        }
        let positions = positions_needed(req.prompt.len(), req.max_new).max(req.reserve);
        let bytes = self.plan.seq_bytes(d, positions);
        if positions > self.plan.longest.max(self.plan.positions) || bytes > self.budget {
            return Err(RequestError::TooLong {
                prompt: req.prompt.len(),
                max_new: req.max_new,
                positions,
                bytes,
                longest: self.plan.longest,
                budget: self.budget,
            });
        }
        Ok(bytes)
    }

    /// Move waiting requests in while a slot is free and the next one's state fits (in arrival
    /// order: a large request is not overtaken; a group of choices joins whole). Returns how
    /// many joined.
    pub(crate) fn admit(&mut self, d: &Dims) -> usize {
        let mut joined = 0;
        while let Some(w) = self.waiting.front() {
            let lead = w.seq;
            let group = 1
                + (self.waiting.iter().skip(1))
                    .take_while(|f| f.follows == Some(lead))
                    .count();
            let want: u64 = self.waiting.iter().take(group).map(|w| w.bytes).sum();
            let used: u64 = self.bytes.iter().sum();
            if self.running.len() + group > self.plan.slots || used + want > self.budget {
                break;
            }
            for w in self.waiting.drain(..group) {
                let mut s = Sequence::start(w.seq, d, w.req);
                s.leader = w.follows;
                tracing::debug!(
                    "sequence {} joins: {} prompt ids ({} held{}), {} running",
                    w.seq,
                    s.prompt_left(),
                    s.held.len(),
                    w.follows
                        .map_or(String::new(), |l| format!(", a choice of {l}'s prefill")),
                    self.running.len() + 1
                );
                self.running.push(s);
                self.bytes.push(w.bytes);
                joined += 1;
            }
        }
        joined
    }

    /// Take sequence `seq` out (waiting or running): its request, or the sequence.
    pub(crate) fn remove(&mut self, seq: SeqId) -> Option<Removed> {
        if let Some(i) = self.waiting.iter().position(|w| w.seq == seq) {
            let w = self.waiting.remove(i).expect("found above");
            return Some(Removed::Waiting(Box::new(w.req)));
        }
        let i = self.running.iter().position(|s| s.id == seq)?;
        self.bytes.remove(i);
        Some(Removed::Running(Box::new(self.running.remove(i))))
    }

    /// The sequences that finished this step, out of the running set.
    pub(crate) fn take_finished(&mut self) -> Vec<Sequence> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].finished() {
                self.bytes.remove(i);
                out.push(self.running.remove(i));
            } else {
                i += 1;
            }
        }
        out
    }

    /// Every running sequence (a failed pass leaves their states unusable).
    pub(crate) fn take_all(&mut self) -> Vec<Sequence> {
        self.bytes.clear();
        std::mem::take(&mut self.running)
    }

    /// Requests waiting.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences running.
    pub(crate) fn running(&self) -> usize {
        self.running.len()
    }

    /// The prompt rows a step may run.
    pub(crate) fn prefill_rows(&self) -> usize {
        self.plan.prefill_budget()
    }
}

/// What [`Scheduler::remove`] took out.
pub(crate) enum Removed {
    /// A request that had not joined yet.
    Waiting(Box<Request>),
    /// A running sequence.
    Running(Box<Sequence>),
}
