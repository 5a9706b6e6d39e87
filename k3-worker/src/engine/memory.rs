//! The engine's memory, stated once: what one sequence holds ([`EnginePlan::seq_bytes`]), what
//! the sequences held at once may take ([`EnginePlan::state_budget`]) and what the largest pass
//! holds in its temporaries ([`EnginePlan::pass_bytes`]), each summed from the owners'
//! statements (`model::state`: [`SeqState::bytes_for`], [`Journal::bytes_for`],
//! [`Work::bytes_for`]; [`ModelDrafter::state_bytes`]). The worker's memory plan, the store's
//! plan for a standalone worker, `k3-ctl serve`'s default slot count and the scheduler's
//! admission all read these functions.

use crate::engine::sampling::DEFAULT_PREFILL_CHUNK;
use crate::engine::spec::ModelDrafter;
use crate::model::state::{Journal, PassShape, SeqState, Work, KEEP_BUFFERS_MAX_POSITIONS};
use crate::model::Dims;

/// `--prefill-chunk`: prompt rows a step may run (`Rows(0)`: a whole prompt at once), or
/// `Auto`: the longest chunk whose pass fits what the memory plan allows a prefill
/// ([`EnginePlan::prefill_rows_within`]; k3-store's `Budget::prefill_allowance`). The ids are
/// the same at every chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillChunk {
    /// Sized from the plan.
    Auto,
    /// At most this many rows (0: all).
    Rows(usize),
}

impl PrefillChunk {
    /// `auto` or a number of rows.
    pub fn parse(s: &str) -> Result<PrefillChunk, String> {
        match s {
            "auto" => Ok(PrefillChunk::Auto),
            n => n.parse().map(PrefillChunk::Rows).map_err(|_| {
                format!("{n:?} is neither `auto` nor a number of prompt rows (0: all at once)")
            }),
        }
    }

    /// The rows, with [`DEFAULT_PREFILL_CHUNK`] for `auto` before (or without) a plan to size
    /// it from.
    pub fn rows_or_default(self) -> usize {
        match self {
            PrefillChunk::Auto => DEFAULT_PREFILL_CHUNK,
            PrefillChunk::Rows(n) => n,
        }
    }
}

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

    /// The auto prefill chunk: the most prompt rows a step may run (at most `longest`, never
    /// below one) whose largest pass ([`EnginePlan::pass_bytes`]) fits `allowance` bytes. A pass
    /// of more than [`KEEP_BUFFERS_MAX_POSITIONS`] rows frees each stage's buffers when the stage
    /// is done, so the bytes grow with the rows on each side of that bound, not across it: each
    /// side is searched, the longer first.
    pub fn prefill_rows_within(&self, d: &Dims, allowance: u64) -> usize {
        let fits = |rows: usize| {
            let p = EnginePlan {
                prefill_rows: rows,
                ..*self
            };
            p.pass_bytes(d) <= allowance
        };
        // The largest `r` in `lo..=hi` that fits, where the bytes grow with `r`.
        let largest = |lo: usize, hi: usize| {
            if lo > hi || !fits(lo) {
                return None;
            }
            let (mut a, mut b) = (lo, hi);
            while a < b {
                let m = a + (b - a).div_ceil(2);
                if fits(m) {
                    a = m;
                } else {
                    b = m - 1;
                }
            }
            Some(a)
        };
        let top = self.longest.max(1);
        let keep = KEEP_BUFFERS_MAX_POSITIONS.min(top);
        largest(keep + 1, top)
            .or_else(|| largest(1, keep))
            .unwrap_or(1)
    }

    /// The `--prefill-chunk auto` rows for a prefill allowance of `allowance` bytes: the
    /// longest chunk that fits ([`EnginePlan::prefill_rows_within`]), never fewer rows than
    /// the fixed default ran ([`DEFAULT_PREFILL_CHUNK`], or the longest prompt when shorter):
    /// at full scale a 512-row pass is ~1.6 GB, more than the laptop preset's 1.5 GB allowance,
    /// and auto never does worse than the chunk it replaced.
    pub fn auto_prefill_rows(&self, d: &Dims, allowance: u64) -> usize {
        let default = DEFAULT_PREFILL_CHUNK.min(self.longest.max(1));
        self.prefill_rows_within(d, allowance).max(default)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn dims() -> Dims {
        let cfg = k3_proto::config::ModelConfig::from_json_str(include_str!(
            "../../../proto/tests/data/released_config.json"
        ))
        .unwrap();
        Dims::from_config(&cfg).unwrap()
    }

    /// The auto chunk is the longest whose pass fits: one row more does not fit (unless the
    /// prompt is no longer), it grows with the allowance, never passes the longest prompt and
    /// never falls below one row.
    #[test]
    fn the_auto_chunk_is_the_longest_whose_pass_fits() {
        let d = dims();
        let plan = EnginePlan::one(16_384, 512, 0);
        let bytes = |rows: usize| {
            EnginePlan {
                prefill_rows: rows,
                ..plan
            }
            .pass_bytes(&d)
        };
        let mut last = 0;
        for gb in [0.5, 1.0, 1.5, 2.0, 4.0, 8.0, 16.0] {
            let allowance = (gb * 1e9) as u64;
            let rows = plan.prefill_rows_within(&d, allowance);
            assert!(bytes(rows) <= allowance, "{gb} GB: {rows} rows");
            if rows < plan.longest {
                assert!(
                    bytes(rows + 1) > allowance,
                    "{gb} GB: {} rows fit too",
                    rows + 1
                );
            }
            assert!(rows >= last, "{gb} GB: {rows} rows after {last}");
            last = rows;
        }
        assert_eq!(plan.prefill_rows_within(&d, u64::MAX), 16_384);
        assert_eq!(
            EnginePlan::one(7, 512, 0).prefill_rows_within(&d, u64::MAX),
            7
        );
        assert_eq!(plan.prefill_rows_within(&d, 0), 1);
    }

    #[test]
    fn prefill_chunk_flag_values() {
        assert_eq!(PrefillChunk::parse("auto"), Ok(PrefillChunk::Auto));
        assert_eq!(PrefillChunk::parse("0"), Ok(PrefillChunk::Rows(0)));
        assert_eq!(PrefillChunk::parse("512"), Ok(PrefillChunk::Rows(512)));
        assert!(PrefillChunk::parse("-1").is_err());
        assert!(PrefillChunk::parse("big").is_err());
        assert_eq!(PrefillChunk::Auto.rows_or_default(), DEFAULT_PREFILL_CHUNK);
    }
}
