//! What every front end hands the engine: a typed [`Request`] built from its own input (the
//! command line's ids or prompt, a chat turn, a line of a `--batch` file, a `Start` from
//! `k3-ctl serve`), and what the engine refuses before a request runs ([`RequestError`]).

use crate::engine::sampling::Sampler;
use crate::engine::shaping::Shaping;
use crate::engine::spec::{Controller, Drafter, SpecMode};
use crate::model::SeqState;
use crate::text::xtml::END_IDS;

/// The engine's handle of a sequence (unique for the engine's life).
pub type SeqId = u64;

/// A state a request can start from: it holds `ids` (a session kept in the store, or the
/// previous turn of a chat). The engine reuses it when `ids` are a strict prefix of the new
/// prompt ([`reusable`]) and prefills only the rest; otherwise it starts afresh.
#[derive(Debug)]
pub struct Held {
    /// The state.
    pub state: SeqState,
    /// The ids it holds, in order (`state.pos == ids.len()`).
    pub ids: Vec<u32>,
}

/// How many ids of `prompt` a state holding `held` saves: all of them when they are a strict
/// prefix of `prompt` (the last prompt id is always run, for the first pick), else none.
pub fn reusable(held: &[u32], prompt: &[u32]) -> Option<usize> {
    (!held.is_empty() && prompt.len() > held.len() && prompt.starts_with(held))
        .then_some(held.len())
}

/// Speculative decoding for one sequence (docs/SPEC.md §3.12): its drafted ids ride as extra
/// rows of the step's one pass; the ids are those of plain decoding whatever the drafts.
#[derive(Debug)]
pub struct Speculation {
    /// How many ids to draft per pass.
    pub mode: SpecMode,
    /// Who drafts (none: plain decoding).
    pub drafter: Option<Box<dyn Drafter>>,
    /// Auto mode's estimates, carried from an earlier request of the same conversation (a chat
    /// turn learns from the turns before it).
    pub control: Option<Controller>,
}

impl Speculation {
    /// Plain decoding.
    pub fn off() -> Speculation {
        Speculation {
            mode: SpecMode::Off,
            drafter: None,
            control: None,
        }
    }

    /// Draft with `drafter` in `mode`.
    pub fn with(mode: SpecMode, drafter: Option<Box<dyn Drafter>>) -> Speculation {
        Speculation {
            mode,
            drafter,
            control: None,
        }
    }
}

/// Keep the sequence in the store as a session (docs/SPEC.md §6.6; attached workers only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionPlan {
    /// The session's name.
    pub name: String,
    /// Also keep the state once every prompt id but the last is in it, before the first pick,
    /// so that a retry of the same request resumes there (serve).
    pub after_prefill: bool,
    /// With `after_prefill`, also keep the state when the prompt's first `k` ids are in it, for
    /// each `k` here (serve: where the conversation's history ends, before the notes that only
    /// this request renders, so that the next turn resumes there).
    pub keep_at: Vec<usize>,
    /// The key the prefix sessions are named under ([`crate::engine::outputs::prefix_session_name`];
    /// empty: the ids' plain hash).
    pub name_key: Vec<u8>,
}

/// One generation: the same type whatever the front end.
#[derive(Debug)]
pub struct Request {
    /// The prompt's ids (the whole conversation for a chat turn).
    pub prompt: Vec<u32>,
    /// Most ids to generate (≥ 1).
    pub max_new: usize,
    /// Its token choice (greedy, or its own seeded generator).
    pub sampler: Sampler,
    /// What its picks obey beyond the sampler (a grammar, a thinking budget, logit edits).
    pub shaping: Shaping,
    /// Generation ends after one of these ids (ids outside the vocabulary are dropped).
    pub stop_ids: Vec<u32>,
    /// Speculative decoding.
    pub spec: Speculation,
    /// A state to start from (used when the ids it holds are a strict prefix of `prompt`).
    pub from: Option<Held>,
    /// Positions to plan the state for when that is more than the request needs (a chat's
    /// context: its later turns grow the same state).
    pub reserve: usize,
    /// Keep the state in the store under a session name.
    pub session: Option<SessionPlan>,
    /// Check mode: re-run the whole sequence on a fresh state before every pick (must give the
    /// same ids; no speculation).
    pub full_recompute: bool,
    /// Keep the logits of the first pick (the prompt's last position) in the report.
    pub keep_step0_logits: bool,
    /// Hand the final state, sampler and speculation state back when the sequence ends
    /// ([`crate::engine::outputs::Outputs::take_ended`]): a chat's next turn continues them.
    pub hand_back: bool,
}

impl Request {
    /// A request for `max_new` ids after `prompt`, ending on the end-of-turn ids, without
    /// speculation, session or state to start from.
    pub fn new(prompt: Vec<u32>, max_new: usize, sampler: Sampler) -> Request {
        Request {
            prompt,
            max_new,
            sampler,
            shaping: Shaping::default(),
            stop_ids: END_IDS.to_vec(),
            spec: Speculation::off(),
            from: None,
            reserve: 0,
            session: None,
            full_recompute: false,
            keep_step0_logits: false,
            hand_back: false,
        }
    }
}

/// Why the engine refused a request (before it ran; nothing else is affected).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// No prompt ids.
    #[error("empty prompt")]
    EmptyPrompt,
    /// `max_new` 0.
    #[error("nothing to generate (max_new 0)")]
    NothingToGenerate,
    /// A prompt id the model does not have.
    #[error("prompt id {id} outside the vocabulary of {vocab}")]
    Vocab {
        /// The id.
        id: u32,
        /// The vocabulary's size.
        vocab: usize,
    },
    /// More positions than this engine was planned for.
    #[error(
        "a request of {prompt} prompt ids and up to {max_new} new needs {positions} positions \
         ({bytes} bytes of state); this engine holds at most {longest} positions ({budget} bytes \
         of state) for one sequence"
    )]
    TooLong {
        /// Prompt ids.
        prompt: usize,
        /// Most new ids.
        max_new: usize,
        /// Positions it needs.
        positions: usize,
        /// Its state's bytes.
        bytes: u64,
        /// The most positions one sequence may take.
        longest: usize,
        /// The engine's state budget.
        budget: u64,
    },
    /// A group of choices ([`crate::engine::Engine::submit_choices`]) larger than the engine's
    /// slots or its state budget.
    #[error(
        "{n} choices need {n} sequences ({bytes} bytes of state); this engine runs at most \
         {slots} sequences at once ({budget} bytes of state)"
    )]
    TooManyChoices {
        /// Choices asked.
        n: usize,
        /// Their states' bytes.
        bytes: u64,
        /// The engine's slots.
        slots: usize,
        /// The engine's state budget.
        budget: u64,
    },
    /// A group of choices whose prompts differ (they share one prefill).
    #[error("the choices of one request must share their prompt")]
    ChoicesDiffer,
    /// A state to start from whose ids and position disagree.
    #[error("a state at position {pos} cannot hold {held} ids")]
    BadHeld {
        /// The state's position.
        pos: usize,
        /// The ids it says it holds.
        held: usize,
    },
}
