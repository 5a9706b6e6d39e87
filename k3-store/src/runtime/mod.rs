//! The weights runtime: where weight bytes live and how they get there, used alike by a
//! standalone worker (in-process) and by the daemon (in shared memory).
//!
//! Sources ([`source::WeightSource`]), the trunk (pack, read plans, the ring it streams
//! through), the routed-expert slot cache and its policies, the I/O pool and the memory plan.
//! Nothing here knows about sockets, leases held by other processes or sessions: that is
//! [`crate::daemon`] (the server side) and [`crate::attach`] (a worker's side of it).

pub mod arena;
pub mod catalog;
pub mod draft;
pub mod experts;
pub mod fdlimit;
pub mod identity;
pub mod io;
pub mod plan;
pub mod policy;
pub mod pool;
pub mod ring;
pub mod source;
pub mod standalone;
pub mod stream;
pub mod sysinfo;
pub mod trunk;
pub mod units;
