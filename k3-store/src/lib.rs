//! k3 store library: everything that owns weight bytes.
//!
//! The engine (k3-worker) computes; this crate decides where weight bytes live and how they get
//! there. The same code runs in-process (`k3-worker --standalone`) and inside the `k3-store`
//! daemon, which is why the seam between the two is the [`runtime::source::WeightSource`] trait.
//!
//! - [`runtime`]: sources, the trunk and its ring, the expert cache, the I/O pool, the plan —
//!   used standalone and by the daemon alike; it imports nothing from the two below.
//! - [`daemon`]: the server side (socket, leases, the shared ring, sessions, stats).
//! - [`attach`]: a worker's side of the daemon (the client connection and the attached source).

pub mod attach;
pub mod cli;
pub mod daemon;
pub mod exit_codes;
pub mod ipc;
pub mod progress;
pub mod runtime;
pub mod session;
pub mod shmem;
pub mod sys;

#[cfg(test)]
extern crate self as k3_store;
#[cfg(test)]
#[path = "../tests/common/fixture.rs"]
pub(crate) mod fixture;
