//! Exit codes shared by every k3 binary (documented in the README).

/// Success.
pub const OK: i32 = 0;
/// Bind, forward or I/O failure after work started.
pub const FAILURE: i32 = 1;
/// Refused before any work: usage error, a config or checkpoint that cannot be read with
/// confidence, or a memory plan / KV cache that cannot fit.
pub const REFUSED: i32 = 2;
/// Cannot reach or attach to the store.
pub const NO_STORE: i32 = 3;
/// The run finished but at least one routed expert failed to load: the ids are unsound.
pub const EXPERT_LOAD_FAILED: i32 = 4;
