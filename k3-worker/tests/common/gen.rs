//! One request alone through the engine, for the tests.
#![allow(dead_code)]

/// One request alone through the engine (planned for exactly its positions), `on_step` seeing
/// each id: its report, and the model back (its counters, what it bound).
pub struct Gen {
    /// Ids to generate.
    pub max_new: usize,
    /// The sampler.
    pub sampler: k3_worker::engine::sampling::Sampler,
    /// Stop ids.
    pub stop_ids: Vec<u32>,
    /// Re-run the whole sequence before every pick.
    pub full_recompute: bool,
    /// Keep the first pick's logits.
    pub keep_step0_logits: bool,
    /// Prompt rows a step runs (0 = the whole prompt).
    pub prefill_chunk: usize,
    /// Speculation.
    pub spec: k3_worker::engine::spec::SpecMode,
    /// Its drafter.
    pub drafter: Option<Box<dyn k3_worker::engine::spec::Drafter>>,
}

impl Gen {
    /// `max_new` ids greedy, no stop ids, no speculation, the whole prompt in one pass.
    pub fn new(max_new: usize, sampler: k3_worker::engine::sampling::Sampler) -> Gen {
        Gen {
            max_new,
            sampler,
            stop_ids: vec![],
            full_recompute: false,
            keep_step0_logits: false,
            prefill_chunk: 0,
            spec: k3_worker::engine::spec::SpecMode::Off,
            drafter: None,
        }
    }

    /// Run it on `m` after `prompt`.
    pub fn run<'s>(
        self,
        m: k3_worker::model::Model<'s>,
        prompt: &[u32],
        on_step: &mut dyn FnMut(&k3_worker::engine::outputs::StepReport),
    ) -> (
        k3_worker::engine::outputs::GenReport,
        k3_worker::model::Model<'s>,
    ) {
        use k3_worker::engine::memory::EnginePlan;
        use k3_worker::engine::request::{Request, Speculation};
        let positions = k3_worker::engine::sampling::positions_needed(prompt.len(), self.max_new);
        let drafts = if self.drafter.is_some() {
            self.spec.max_drafts()
        } else {
            0
        };
        let plan = EnginePlan::one(positions, self.prefill_chunk, drafts);
        let mut engine = k3_worker::engine::Engine::new(m, plan);
        let req = Request {
            stop_ids: self.stop_ids,
            spec: Speculation::with(self.spec, self.drafter),
            full_recompute: self.full_recompute,
            keep_step0_logits: self.keep_step0_logits,
            ..Request::new(prompt.to_vec(), self.max_new, self.sampler)
        };
        let ended = engine
            .run_one(req, &mut |s| {
                on_step(s);
                k3_worker::engine::outputs::Flow::Continue
            })
            .unwrap();
        (ended.finished.report, engine.into_model())
    }
}
