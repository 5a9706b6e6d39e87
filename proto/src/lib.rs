//! k3 formats and contracts.
//!
//! This crate is deliberately light: it knows the on-disk and on-wire formats (the checkpoint
//! index, the model config, tensor names, the packed-trunk description, the wire protocol and the
//! shared-memory layout) and nothing about kernels or threads.

pub mod config;
pub mod draft;
pub mod dtype;
pub mod ecbf16;
pub mod exit;
pub mod expert;
pub mod manifest;
pub mod names;
pub mod paths;
pub mod quant;
pub mod safetensors;
pub mod serve;
pub mod shm;
pub mod tensors;
pub mod wire;

pub use dtype::Dtype;

/// `--version` of every k3 binary: the crate version and the commit it was built from.
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("K3_COMMIT"), ")");
