//! What a request asks of its ids beyond the sampler (OpenAI's and Anthropic's request surface,
//! llama.cpp's and vLLM's logits processors): a grammar the reply must follow, a thinking
//! budget, a logit bias, presence and frequency penalties, and log-probabilities.
//!
//! [`Shaper`] is one sequence's processor, used at the one place an id is chosen
//! ([`crate::engine::sequence`]). Per pick, in this order:
//!
//! 1. A spent thinking budget forces the next of its closing ids (the sampler does not draw).
//! 2. Otherwise the row is edited: the logit bias is added, then the penalties (OpenAI's
//!    definition: `logit[j] -= count[j] · frequency + (count[j] > 0) · presence`, counting the
//!    ids this reply generated), then the grammar's mask sets every id it forbids to −∞.
//! 3. The log-probabilities, when asked, are read from the edited row at temperature 1.
//! 4. The sampler picks; the id is committed (the grammar advances, the counts grow, the budget
//!    is spent).
//!
//! The grammar's next mask is computed on a thread of its own ([`MaskAhead`]) from the moment
//! an id is committed at the end of a pass until the next pick needs it, so it overlaps the
//! forward pass instead of following it; the picks of a verify pass after its first row compute
//! theirs in line (each needs the id before it). A drafted id is accepted only when it equals
//! the pick under the mask, so speculation stays on for a constrained sequence and its ids are
//! those of plain decoding.
//!
//! A request without any of these (the default) leaves the row untouched: its ids are the
//! ids of an unshaped engine, bit for bit.

use std::collections::HashMap;
use std::time::Instant;

use crate::constrain::{apply, ConstrainError, Constraint, MaskAhead, TokenMask};

/// A bound on the think channel: `tokens` ids inside it at most, then `close` is forced (the
/// ids that close the think channel and open the response, as the chat format renders them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThinkBudget {
    /// Most ids inside the think channel.
    pub tokens: usize,
    /// The forced ids; the model closes the channel itself when it generates the first.
    pub close: Vec<u32>,
}

/// A request's shaping (the default: none).
#[derive(Debug, Default)]
pub struct Shaping {
    /// The grammar the reply follows (compiled for this reply).
    pub grammar: Option<Constraint>,
    /// The thinking budget (the reply starts inside the think channel).
    pub think: Option<ThinkBudget>,
    /// Added to these ids' logits.
    pub bias: Vec<(u32, f32)>,
    /// Subtracted once from each id the reply generated.
    pub presence: f32,
    /// Subtracted per time the reply generated an id.
    pub frequency: f32,
    /// Report each pick's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
}

impl Shaping {
    /// Nothing to do: the rows stay untouched.
    pub fn is_plain(&self) -> bool {
        self.grammar.is_none()
            && self.think.is_none()
            && self.bias.is_empty()
            && self.presence == 0.0
            && self.frequency == 0.0
            && self.logprobs.is_none()
    }
}

/// One pick's log-probability and the most likely ids of its row.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Scored {
    /// The picked id's natural log-probability.
    pub logprob: f32,
    /// The most likely ids with theirs, most likely first (ties: the lower id first).
    pub top: Vec<(u32, f32)>,
}

/// What the grammar's masks cost a sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct MaskCost {
    /// Masks computed.
    pub masks: u64,
    /// Seconds computing them (on the mask thread or in line).
    pub compute_seconds: f64,
    /// Seconds the picks waited for them (what the overlap did not hide), and applying them.
    pub wait_seconds: f64,
}

/// The grammar's state between picks.
enum Grammar {
    Ready(Box<Constraint>),
    Ahead(MaskAhead, Instant),
    /// Taken out while a pick uses it (or after a failure).
    Gone,
}

/// The thinking budget's state.
#[derive(Debug)]
struct Think {
    left: usize,
    close: Vec<u32>,
    /// The next closing id to force.
    forcing: Option<usize>,
    /// Still inside the think channel.
    open: bool,
}

/// One sequence's processor (see the module doc).
pub(crate) struct Shaper {
    grammar: Option<Grammar>,
    think: Option<Think>,
    bias: Vec<(u32, f32)>,
    presence: f32,
    frequency: f32,
    counts: HashMap<u32, u32>,
    logprobs: Option<usize>,
    cost: MaskCost,
    plain: bool,
}

impl Shaper {
    /// The processor of `s`; the first mask starts at once (beside the prefill).
    pub(crate) fn new(s: Shaping) -> Shaper {
        let plain = s.is_plain();
        let mut me = Shaper {
            grammar: s.grammar.map(|c| Grammar::Ready(Box::new(c))),
            think: s.think.map(|t| Think {
                left: t.tokens,
                forcing: None,
                open: !t.close.is_empty(),
                close: t.close,
            }),
            bias: s.bias,
            presence: s.presence,
            frequency: s.frequency,
            counts: HashMap::new(),
            logprobs: s.logprobs,
            cost: MaskCost::default(),
            plain,
        };
        me.ahead();
        me
    }

    /// Nothing to do.
    pub(crate) fn is_plain(&self) -> bool {
        self.plain
    }

    /// What the masks cost so far (`None`: no grammar).
    pub(crate) fn mask_cost(&self) -> Option<MaskCost> {
        self.grammar.as_ref().map(|_| self.cost)
    }

    /// The id the budget forces next, if it does.
    fn forced(&mut self) -> Option<u32> {
        let t = self.think.as_mut().filter(|t| t.open)?;
        if t.forcing.is_none() && t.left == 0 {
            t.forcing = Some(0);
        }
        t.forcing.map(|i| t.close[i])
    }

    /// The grammar's mask for this pick: the one computed ahead, or one computed now.
    fn mask(&mut self) -> Result<Option<TokenMask>, ConstrainError> {
        let Some(g) = self.grammar.as_mut() else {
            return Ok(None);
        };
        let t = Instant::now();
        let (c, m) = match std::mem::replace(g, Grammar::Gone) {
            Grammar::Ahead(a, started) => {
                let (c, m) = a.wait()?;
                self.cost.compute_seconds += started.elapsed().as_secs_f64();
                (Box::new(c), m)
            }
            Grammar::Ready(mut c) => {
                let m = c.mask()?;
                self.cost.compute_seconds += t.elapsed().as_secs_f64();
                (c, m)
            }
            Grammar::Gone => return Err(ConstrainError::Matcher("the grammar failed".into())),
        };
        self.cost.masks += 1;
        self.cost.wait_seconds += t.elapsed().as_secs_f64();
        *g = Grammar::Ready(c);
        Ok(Some(m))
    }

    /// Before a pick: `Some(id)` when the budget forces it (the row is not used), else the row
    /// edited in place (bias, penalties, mask).
    pub(crate) fn prepare(&mut self, row: &mut [f32]) -> Result<Option<u32>, ConstrainError> {
        if self.plain {
            return Ok(None);
        }
        for &(id, b) in &self.bias {
            if let Some(l) = row.get_mut(id as usize) {
                *l += b;
            }
        }
        if self.presence != 0.0 || self.frequency != 0.0 {
            for (&id, &n) in &self.counts {
                if let Some(l) = row.get_mut(id as usize) {
                    *l -= n as f32 * self.frequency + self.presence;
                }
            }
        }
        if let Some(id) = self.forced() {
            // The grammar's pending mask is not needed: the commit checks the id.
            if let Some(Grammar::Ahead(..)) = self.grammar {
                self.mask()?;
            }
            return Ok(Some(id));
        }
        let m = self.mask()?;
        if m.as_ref().is_some_and(|m| m.count() == 0) {
            return Err(ConstrainError::Matcher(
                "the grammar allows no id here".into(),
            ));
        }
        let t = Instant::now();
        apply(m.as_ref(), row);
        self.cost.wait_seconds += t.elapsed().as_secs_f64();
        Ok(None)
    }

    /// The log-probabilities of picking `id` from the prepared `row`, when asked.
    pub(crate) fn scored(&self, row: &[f32], id: u32) -> Option<Scored> {
        self.logprobs.map(|k| scores(row, id, k))
    }

    /// The pick was `id`: the grammar takes it, the counts and the budget follow.
    pub(crate) fn commit(&mut self, id: u32) -> Result<(), ConstrainError> {
        if self.plain {
            return Ok(());
        }
        if let Some(g) = self.grammar.as_mut() {
            match g {
                Grammar::Ready(c) => c.commit(id)?,
                _ => return Err(ConstrainError::Matcher("the grammar failed".into())),
            }
        }
        *self.counts.entry(id).or_insert(0) += 1;
        if let Some(t) = self.think.as_mut().filter(|t| t.open) {
            match t.forcing {
                Some(i) if i + 1 == t.close.len() => {
                    t.forcing = None;
                    t.open = false;
                }
                Some(i) => t.forcing = Some(i + 1),
                None if id == t.close[0] => t.open = false,
                None => t.left = t.left.saturating_sub(1),
            }
        }
        Ok(())
    }

    /// Start the next mask on its own thread (after the last pick of a pass).
    pub(crate) fn ahead(&mut self) {
        if let Some(g) = self.grammar.as_mut() {
            if let Grammar::Ready(_) = g {
                let Grammar::Ready(c) = std::mem::replace(g, Grammar::Gone) else {
                    unreachable!("matched above")
                };
                *g = Grammar::Ahead(MaskAhead::start(*c), Instant::now());
            }
        }
    }
}

/// `id`'s log-probability in `row` at temperature 1 and the `k` most likely ids (−∞ rows
/// excluded; a NaN counts as −∞).
pub fn scores(row: &[f32], id: u32, k: usize) -> Scored {
    let finite = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
    let m = row
        .iter()
        .map(|&l| finite(l))
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = row
        .iter()
        .map(|&l| (finite(l) as f64 - m).exp())
        .sum::<f64>();
    let lz = m + z.ln();
    let lp = |l: f32| (finite(l) as f64 - lz) as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (j, &l) in row.iter().enumerate() {
            let l = finite(l);
            if l == f32::NEG_INFINITY {
                continue;
            }
            let worse = |(a, b): &(u32, f32)| l > *b || (l == *b && (j as u32) < *a);
            if top.len() < k || top.last().is_some_and(worse) {
                let at = top.iter().position(worse).unwrap_or(top.len());
                top.insert(at, (j as u32, l));
                top.truncate(k);
            }
        }
    }
    Scored {
        logprob: row.get(id as usize).map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top: top.into_iter().map(|(j, l)| (j, lp(l))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shaper(s: Shaping) -> Shaper {
        Shaper::new(s)
    }

    #[test]
    fn a_plain_shaper_leaves_the_row_bit_for_bit() {
        let mut s = shaper(Shaping::default());
        let row0 = [0.1f32, f32::NAN, -3.0, 7.5];
        let mut row = row0;
        assert_eq!(s.prepare(&mut row).unwrap(), None);
        s.commit(3).unwrap();
        assert_eq!(
            row.map(f32::to_bits),
            row0.map(f32::to_bits),
            "an unshaped row must not change"
        );
        assert!(s.mask_cost().is_none());
    }

    #[test]
    fn bias_and_penalties_follow_openai() {
        let mut s = shaper(Shaping {
            bias: vec![(0, 2.0), (9, 5.0)],
            presence: 0.5,
            frequency: 0.25,
            ..Shaping::default()
        });
        for id in [1, 1, 2] {
            s.commit(id).unwrap();
        }
        let mut row = [1.0f32; 4];
        s.prepare(&mut row).unwrap();
        // id 0: +2 bias; id 1: twice → 1 − 2·0.25 − 0.5; id 2: once → 1 − 0.25 − 0.5; id 3 as is.
        assert_eq!(row, [3.0, 0.0, 0.25, 1.0]);
    }

    #[test]
    fn a_spent_budget_forces_the_closing_ids_then_lets_go() {
        let close = vec![90, 91, 92];
        let mut s = shaper(Shaping {
            think: Some(ThinkBudget {
                tokens: 2,
                close: close.clone(),
            }),
            ..Shaping::default()
        });
        let mut got = Vec::new();
        for free in [5, 6, 7, 8, 9, 10] {
            let mut row = [0.0f32; 100];
            let id = s.prepare(&mut row).unwrap().unwrap_or(free);
            s.commit(id).unwrap();
            got.push(id);
        }
        assert_eq!(got, [5, 6, 90, 91, 92, 10]);
        // The model closing the channel itself ends the budget: nothing is forced.
        let mut s = shaper(Shaping {
            think: Some(ThinkBudget { tokens: 1, close }),
            ..Shaping::default()
        });
        s.commit(90).unwrap();
        for _ in 0..3 {
            assert_eq!(s.prepare(&mut [0.0f32; 100]).unwrap(), None);
            s.commit(4).unwrap();
        }
    }

    #[test]
    fn a_zero_budget_forces_from_the_first_pick() {
        let mut s = shaper(Shaping {
            think: Some(ThinkBudget {
                tokens: 0,
                close: vec![7, 8],
            }),
            ..Shaping::default()
        });
        assert_eq!(s.prepare(&mut [0.0f32; 10]).unwrap(), Some(7));
        s.commit(7).unwrap();
        assert_eq!(s.prepare(&mut [0.0f32; 10]).unwrap(), Some(8));
        s.commit(8).unwrap();
        assert_eq!(s.prepare(&mut [0.0f32; 10]).unwrap(), None);
    }

    #[test]
    fn scores_are_a_log_softmax_with_the_top_ids_in_order() {
        let row = [1.0f32, 3.0, f32::NEG_INFINITY, 3.0, 0.0, f32::NAN];
        let s = scores(&row, 4, 3);
        let z: f64 = [1.0f64, 3.0, 3.0, 0.0].iter().map(|l| l.exp()).sum();
        let want = |l: f64| (l - z.ln()) as f32;
        assert!((s.logprob - want(0.0)).abs() < 1e-6, "{s:?}");
        let ids: Vec<u32> = s.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 0], "ties go to the lower id");
        assert!((s.top[0].1 - want(3.0)).abs() < 1e-6);
        assert_eq!(scores(&row, 2, 0).logprob, f32::NEG_INFINITY);
        assert!(scores(&row, 2, 0).top.is_empty());
        // Probabilities sum to one.
        let total: f64 = (0..6)
            .map(|j| (scores(&row, j, 0).logprob as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}
