//! The generation engine every front end feeds (vLLM's engine core, llama.cpp's slot loop):
//! a typed [`request::Request`] in, per-sequence output ([`outputs::Sink`]) out.
//!
//! * [`runner`] — [`runner::Engine`]: each step admits what fits, runs ONE forward pass over
//!   every running sequence's rows (prompt chunks, last picks, drafted ids) and hands each
//!   sequence its logits rows. One sequence alone is a step of one.
//! * [`scheduler`] — admission (slots and the state budget), joins and leaves between steps,
//!   the prefill budget of a step.
//! * [`sequence`] — one sequence: its rows of a pass, the pick step, the stop rules, the
//!   rollback of rejected drafts, what its steps cost.
//! * [`outputs`] — sinks, the per-id report, usage and timings, what the store is told
//!   (sessions kept, progress, history).
//! * [`shaping`] — a sequence's logits processor: grammar masks, a thinking budget, logit
//!   bias, penalties, log-probabilities.
//! * [`request`] — the request type and its refusals; [`sampling`] — the sampler; [`spec`] —
//!   drafters and auto mode's controller; [`session`] — kept sessions in the store;
//!   [`memory`] — the bytes per sequence and per pass the plans read.

pub mod memory;
pub mod outputs;
pub mod request;
pub mod runner;
pub mod sampling;
pub(crate) mod scheduler;
pub(crate) mod sequence;
pub mod session;
pub mod shaping;
pub mod spec;

pub use runner::{Engine, EngineError};
