//! k3 store library: everything that owns weight bytes.
//!
//! The engine (k3-worker) computes; this crate decides where weight bytes live and how they get
//! there. The same code runs in-process (`k3-worker --standalone`) and inside the `k3-store`
//! daemon, which is why the seam between the two is the [`source::WeightSource`] trait.

pub mod arena;
pub mod attached;
pub mod catalog;
pub mod cli;
pub mod client;
pub mod daemon;
pub mod draft;
pub mod exit_codes;
pub mod experts;
pub mod io;
pub mod ipc;
pub mod plan;
pub mod policy;
pub mod pool;
pub mod progress;
pub mod session;
pub mod shmem;
pub mod source;
pub mod standalone;
pub mod stream;
pub mod trunk;

#[cfg(test)]
extern crate self as k3_store;
#[cfg(test)]
#[path = "../tests/common/fixture.rs"]
pub(crate) mod fixture;
