//! The platform paths a process takes (docs/SPEC.md §6.14), checked at start-up, and what the
//! system says about itself ([`crate::runtime::sysinfo`], re-exported).

#[cfg(target_vendor = "apple")]
pub use crate::runtime::sysinfo::*;

/// The platform paths this process takes: the shared-memory kind (`K3_SHM`) and how files are
/// read (`K3_DISK_IO`). Binaries call it at start-up and refuse to run (exit 2) on an error: an
/// unknown value, or a path this system lacks.
pub fn platform_paths(
) -> Result<(crate::shmem::ShmKind, crate::runtime::io::DiskIo), k3_proto::paths::EnvError> {
    Ok((crate::shmem::shm_kind()?, crate::runtime::io::disk_io()?))
}
