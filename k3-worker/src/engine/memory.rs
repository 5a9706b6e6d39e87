//! The engine's memory, stated once: what one sequence holds ([`EnginePlan::seq_bytes`]), what
//! the sequences held at once may take ([`EnginePlan::state_budget`]) and what the largest pass
//! holds in its temporaries ([`EnginePlan::pass_bytes`]), each summed from the owners'
//! statements (`model::state`: [`SeqState::bytes_for`], [`Journal::bytes_for`],
//! [`Work::bytes_for`]; [`ModelDrafter::state_bytes`]). The worker's memory plan, the store's
//! plan for a standalone worker, `k3-ctl serve`'s default slot count and the scheduler's
//! admission all read these functions.

use crate::engine::spec::ModelDrafter;
use crate::model::state::{Journal, PassShape, SeqState, Work};
use crate::model::Dims;

/// What an engine is planned for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnginePlan {
    /// Sequences decoded at once.
    pub slots: usize,
    /// Positions each slot is planned for.
    pub positions: usize,
    /// The most positions one sequence may take (≥ `positions`): the state budget always holds
    /// one such sequence, so a long request runs (alone if it must) in the same engine.
    pub longest: usize,
    /// Prompt rows a step may run in all (the prefill chunk; 0 = a whole prompt: `longest`).
    pub prefill_rows: usize,
    /// The most ids a sequence drafts per pass (0: no speculation).
    pub drafts: usize,
    /// Each sequence runs a draft model (its own draft state; the draft trunk is shared and
    /// counted by whoever loads it).
    pub draft_model: bool,
    /// One sequence keeps its first pick's logits (`--dump-logits`).
    pub keep_step0_logits: bool,
}

impl EnginePlan {
    /// One sequence alone, planned for exactly `positions`.
    pub fn one(positions: usize, prefill_chunk: usize, drafts: usize) -> EnginePlan {
        EnginePlan {
            slots: 1,
            positions,
            longest: positions,
            prefill_rows: prefill_rows(prefill_chunk, positions),
            drafts,
            draft_model: false,
            keep_step0_logits: false,
        }
    }

    /// Bytes one sequence of `positions` holds while it runs: its state (KDA state, MLA
    /// latent cache reserved in full), the verify journal of its largest pass and its draft
    /// model's state.
    pub fn seq_bytes(&self, d: &Dims, positions: usize) -> u64 {
        let journal = if self.drafts > 0 {
            Journal::bytes_for(d, self.drafts + 1)
        } else {
            0
        };
        let draft = if self.draft_model {
            ModelDrafter::state_bytes(d, positions + self.drafts)
        } else {
            0
        };
        SeqState::bytes_for(d, positions) + journal + draft
    }

    /// The bytes the scheduler lets the states of the sequences in flight take: `slots`
    /// sequences of `positions`, or one of `longest` when that is more.
    pub fn state_budget(&self, d: &Dims) -> u64 {
        (self.slots as u64 * self.seq_bytes(d, self.positions)).max(self.seq_bytes(d, self.longest))
    }

    /// Prompt rows a step may run in all.
    pub fn prefill_budget(&self) -> usize {
        prefill_rows(self.prefill_rows, self.longest)
    }

    /// The temporaries of the largest pass a step runs: the larger of a step with prompt rows
    /// (`prefill_rows`, beside every other slot's verify rows) and a step where every slot
    /// verifies its drafts, plus the first pick's logits when kept.
    pub fn pass_bytes(&self, d: &Dims) -> u64 {
        let threads = rayon::current_num_threads();
        let per = self.drafts + 1;
        let others = self.slots.saturating_sub(1) * per;
        let journaled = self.drafts > 0;
        let pass = |rows: usize, logits_rows: usize, journaled: bool| {
            Work::bytes_for(
                d,
                &PassShape {
                    rows,
                    logits_rows,
                    context: self.longest + self.drafts,
                    journaled,
                    threads,
                },
            )
        };
        let prefill = pass(
            self.prefill_budget() + others,
            1 + others,
            journaled && self.slots > 1,
        );
        let decode = pass(self.slots * per, self.slots * per, journaled);
        let kept = if self.keep_step0_logits {
            4 * d.vocab as u64
        } else {
            0
        };
        prefill.max(decode) + kept
    }

    /// What the engine allocates at its peak: the state budget and the largest pass.
    pub fn bytes(&self, d: &Dims) -> u64 {
        self.state_budget(d) + self.pass_bytes(d)
    }

    /// How many slots of `positions` fit `avail` bytes with a pass of this plan's shape (at
    /// least 1, at most `max`).
    pub fn slots_that_fit(&self, d: &Dims, avail: u64, max: usize) -> usize {
        let mut n = 1;
        while n < max {
            let more = EnginePlan {
                slots: n + 1,
                ..*self
            };
            if more.bytes(d) > avail {
                break;
            }
            n += 1;
        }
        n
    }
}

/// Prompt rows a step runs for `--prefill-chunk chunk` (0 = a whole prompt at once) when no
/// sequence is longer than `longest`.
pub fn prefill_rows(chunk: usize, longest: usize) -> usize {
    match chunk {
        0 => longest.max(1),
        c => c.min(longest.max(1)),
    }
}
