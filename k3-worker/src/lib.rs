//! k3 worker library: kernels, the Kimi K3 forward pass, the tokenizer and generation.

pub mod chat;
pub mod generate;
pub mod kernels;
pub mod model;
pub mod tokenizer;
