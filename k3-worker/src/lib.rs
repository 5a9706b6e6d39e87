//! k3 worker library: kernels, the Kimi K3 forward pass, the tokenizer, generation (one loop for
//! one-shot runs and chat), and the `k3-worker` job itself (`cli`, `job`, `report`), so the
//! binary is only wiring.

pub mod batch;
pub mod batch_job;
pub mod chat;
pub mod cli;
pub mod eval;
pub mod generate;
pub mod job;
pub mod kernels;
pub mod model;
pub mod report;
pub mod serve_batch;
pub mod serve_channel;
pub mod session;
pub mod sink;
pub mod spec;
pub mod tokenizer;
