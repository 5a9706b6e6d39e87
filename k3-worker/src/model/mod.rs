//! The Kimi K3 forward pass (SPEC.md §3).
//!
//! One file per layer kind, loading apart from maths:
//! * [`bind`] — the ONE place where checkpoint tensor names meet structs; every tensor's full
//!   shape and dtype is checked against [`Dims`] there (SPEC.md I4).
//! * [`attn_res`] — Block Attention Residuals (§3.3).
//! * [`kda`] — Kimi Delta Attention (§3.4).
//! * [`mla`] — Gated MLA with the latent cache (§3.5, §3.6).
//! * [`moe`] — router, Stable LatentMoE, shared experts, dense SiTU MLP (§3.2, §3.7, §3.8).
//! * [`state`] — per-sequence state (the KDA and MLA layers' carried state) and every buffer a
//!   pass needs, each sized from the shapes ([`state::Work::bytes_for`]).
//! * [`feed`] — the weights feed: hands the forward pass a layer's typed weights and a layer's
//!   experts, and keeps every read-ahead, lookahead, probe and their bookkeeping behind it.
//! * [`forward`] — the top-level loop (§3.3), one code path for prefill and decode.
//! * [`dims`], [`mats`] — the dimensions and the typed matrices every file reads (leaves).
//!
//! Activations are f32, row-major `[tokens, width]`. Every product goes through
//! [`crate::kernels`], so prefill (T tokens) and decode (1 token) run the same per-token
//! operations and produce bit-identical results.

pub mod attn_res;
pub mod bind;
pub mod dims;
pub mod feed;
pub mod forward;
pub mod kda;
pub mod mats;
pub mod mla;
pub mod moe;
pub mod snapshot;
pub mod state;

pub use bind::{BoundLayer, TensorShapes};
pub use dims::{Dims, ModelError};
pub use feed::{Lookahead, PhaseSeconds, RunCounters, TraceRecord};
pub use forward::{Logits, Model, SeqRows};
pub use mats::Mat;
pub use state::{Scratch, SeqState};
