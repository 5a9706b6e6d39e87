//! k3 worker library, in layers: the front ends ([`front`]: the command line, one-shot prompts,
//! the chat REPL, `--batch` files, jobs from `k3-ctl serve`) feed the one generation engine
//! ([`engine`]: scheduler, runner, outputs) typed requests; the engine runs the Kimi K3 forward
//! pass ([`model`]) on the kernels ([`kernels`]); [`text`] holds the chat format and
//! [`tokenizer`] the tokenizer. The binary is only wiring.

pub mod constrain;
pub mod engine;
pub mod eval;
pub mod front;
pub mod kernels;
pub mod model;
pub mod text;
pub mod tokenizer;
