//! k3 store library: everything that owns weight bytes.
//!
//! The engine (k3-worker) computes; this crate decides where weight bytes live and how they get
//! there. The same code runs in-process (`k3-worker --standalone`) and inside the `k3-store`
//! daemon, which is why the seam between the two is the [`source::WeightSource`] trait.

pub mod client;
pub mod daemon;
pub mod ipc;
pub mod shmem;
pub mod source;
