//! Where a one-shot run's ids go, and whether it goes on: the boundary between the job and the
//! process that asked for it. [`Stdout`] prints them (`k3-worker --ids/--prompt`); the serve
//! channel (`crate::serve_channel`) sends them as typed messages and carries cancellation.

use std::io::Write;

use k3_proto::serve::{Finish, Timings, Usage};

use crate::generate::{Flow, StepReport};
use crate::tokenizer::Tokenizer;

/// The receiver of a one-shot run's output.
pub trait Sink {
    /// The prompt is in the state: `cached` ids came from a kept session, the state holds
    /// `held` prompt ids, and the state was kept after the prefill (`kept` bytes) or not.
    fn prefilled(&mut self, cached: usize, held: usize, kept: Option<u64>);
    /// One generated id; [`Flow::Stop`] ends the run after it (the id is then not emitted).
    fn token(&mut self, s: &StepReport) -> Flow;
    /// True once the run should stop at its next step boundary (checked between prefill
    /// chunks too).
    fn cancelled(&self) -> bool;
    /// Keep the state after the prefill as a session before the first pick (for a retry of
    /// the same request), and keep the final state only when the run was not cancelled.
    fn keeps_prefill(&self) -> bool;
    /// The run ended without an error.
    fn done(&mut self, finish: Finish, usage: Usage, timings: Timings);
}

/// Standard output: each id as text (with a tokenizer) or as its number and a space, flushed
/// per id; a newline at the end.
#[derive(Debug)]
pub struct Stdout<'a> {
    /// Decode ids to text with this tokenizer.
    pub tok: Option<&'a Tokenizer>,
}

impl Sink for Stdout<'_> {
    fn prefilled(&mut self, _: usize, _: usize, _: Option<u64>) {}

    fn token(&mut self, s: &StepReport) -> Flow {
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        let text = self.tok.and_then(|t| t.decode(&[s.token]).ok());
        let _ = match text {
            Some(bytes) => out.write_all(&bytes),
            None => write!(out, "{} ", s.token),
        };
        let _ = out.flush();
        Flow::Continue
    }

    fn cancelled(&self) -> bool {
        false
    }

    fn keeps_prefill(&self) -> bool {
        false
    }

    fn done(&mut self, _: Finish, _: Usage, _: Timings) {
        println!();
    }
}
