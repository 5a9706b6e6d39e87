//! k3-worker's integration tests in one test binary: one link and one copy of what they share,
//! instead of one binary per file (scripts/test.sh's build time). Each file is a module; run one
//! with `cargo test -p k3-worker --test worker_suite FILE::`. `alloc.rs` stays a binary of its
//! own: it counts allocations with its own global allocator.

mod batch;
mod chat;
mod cli;
mod common;
mod constrain;
mod draft;
mod forward;
mod gate;
mod generate;
mod kernels;
mod layers;
mod shaping;
mod spec;
mod tools;
