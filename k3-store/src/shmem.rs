//! The store's shared memory: one `memfd`, mapped read-write by the store and read-only by workers.
//!
//! Why a memfd: it is not limited by `/dev/shm`'s size cap, it has no name to leak (it disappears
//! when the store and every worker holding it are gone), and it reaches only the peers the store
//! hands it to over the socket. Workers receive a descriptor re-opened `O_RDONLY` through
//! `/proc/self/fd`, so they cannot map it writable or write to it; the segment is sealed against
//! shrinking so a mapped worker can never fault past its end.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use memmap2::{Mmap, MmapMut};

use crate::runtime::source::ByteOwner;

/// The store's read-write view of the segment.
pub struct Segment {
    file: File,
    map: MmapMut,
}

impl Segment {
    /// Create a segment of `len` bytes (zero-filled, pages allocated lazily).
    pub fn create(name: &str, len: u64) -> std::io::Result<Segment> {
        use nix::sys::memfd::{memfd_create, MFdFlags};
        let cname = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
        let fd: OwnedFd = memfd_create(
            cname.as_c_str(),
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )?;
        let file = File::from(fd);
        file.set_len(len)?;
        // No shrinking, no growing: a worker's mapping can never outlive the bytes behind it.
        nix::fcntl::fcntl(
            file.as_fd(),
            nix::fcntl::FcntlArg::F_ADD_SEALS(
                nix::fcntl::SealFlag::F_SEAL_SHRINK | nix::fcntl::SealFlag::F_SEAL_GROW,
            ),
        )?;
        // SAFETY: the memfd is private to this process until handed out, and only this store
        // writes to it; nobody can truncate it (sealed above), so the mapping stays valid.
        let map = unsafe { MmapMut::map_mut(&file)? };
        // Best effort (see [`shmem_huge_pages`]): where the kernel allows huge pages for shared
        // memory on request, the segment gets them; elsewhere this changes nothing.
        let _ = map.advise(memmap2::Advice::HugePage);
        Ok(Segment { file, map })
    }

    /// The bytes, for the store to fill.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when zero-length.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// A raw pointer to the start of the mapping (for writers that fill disjoint slots from
    /// several threads under the slot protocol).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// A new descriptor for the same memory that can only be read: what workers receive.
    pub fn read_only_fd(&self) -> std::io::Result<OwnedFd> {
        let path = format!("/proc/self/fd/{}", self.file.as_raw_fd());
        let f = std::fs::OpenOptions::new().read(true).open(path)?;
        Ok(OwnedFd::from(f))
    }
}

/// The kernel's transparent-huge-page mode for shared memory
/// (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`, the bracketed word), or `None` where it
/// cannot be read.
///
/// It decides whether the store's segment can get huge pages: `always`, `within_size`, `force`
/// and `advise` (the segment asks) give them, `never` and `deny` do not. It matters for speed:
/// the store reads weights into the segment with `O_DIRECT`, and on a virtual disk a read into
/// 4 KiB pages costs one scatter-gather segment per page. Measured on the benchmark VM (64 MiB
/// reads of one file into a memfd): 0.9–1.5 GB/s with 4 KiB pages, 2.6–2.9 GB/s with huge pages
/// (`k3-ctl doctor` measures both on the machine at hand).
pub fn shmem_huge_pages() -> Option<String> {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()?;
    parse_thp_mode(&s)
}

/// The bracketed word of a sysfs THP mode line (`always within_size [advise] never deny force`).
fn parse_thp_mode(line: &str) -> Option<String> {
    let open = line.find('[')?;
    let close = open + line[open..].find(']')?;
    Some(line[open + 1..close].to_string())
}

/// True when a segment that asks for huge pages gets them under this `shmem_enabled` mode.
pub fn shmem_mode_gives_huge_pages(mode: &str) -> bool {
    matches!(mode, "always" | "within_size" | "advise" | "force")
}

/// A worker's read-only view of the segment.
pub struct ReadOnlySegment {
    map: Mmap,
}

impl ReadOnlySegment {
    /// Map a descriptor received from the store, checking its size.
    pub fn map(fd: OwnedFd, expected_len: u64) -> std::io::Result<ReadOnlySegment> {
        let file = File::from(fd);
        let len = file.metadata()?.len();
        if len != expected_len {
            return Err(std::io::Error::other(format!(
                "shared memory is {len} bytes, the store announced {expected_len}"
            )));
        }
        // SAFETY: the segment is sealed against shrinking by the store, so the mapping stays
        // backed; the store writes only slots that are not leased to this worker, and this worker
        // reads only leased slots and immutable regions (header, resident tensors, pinned layers).
        let map = unsafe { Mmap::map(&file)? };
        Ok(ReadOnlySegment { map })
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

impl ByteOwner for ReadOnlySegment {
    fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// Wrap a raw descriptor number received through `SCM_RIGHTS`.
///
/// # Safety
/// `fd` must be an open descriptor that the caller owns and that nothing else will close.
pub unsafe fn owned_fd(fd: i32) -> OwnedFd {
    // SAFETY: guaranteed by the caller.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_view_is_read_only_and_sees_store_writes() {
        let mut seg = Segment::create("k3-test", 8192).unwrap();
        seg.bytes_mut()[..5].copy_from_slice(b"hello");
        let fd = seg.read_only_fd().unwrap();
        // The read-only descriptor cannot be mapped writable.
        let f = File::from(fd.try_clone().unwrap());
        // SAFETY: test-only mapping of a private memfd; expected to fail with EACCES.
        let writable = unsafe { MmapMut::map_mut(&f) };
        assert!(writable.is_err(), "read-only fd must not map writable");
        let ro = ReadOnlySegment::map(fd, 8192).unwrap();
        assert_eq!(&ro.bytes()[..5], b"hello");
        seg.bytes_mut()[0] = b'j';
        assert_eq!(&ro.bytes()[..5], b"jello", "shared, not copied");
    }

    #[test]
    fn thp_mode_is_the_bracketed_word() {
        assert_eq!(
            parse_thp_mode("always within_size [advise] never deny force\n").as_deref(),
            Some("advise")
        );
        assert_eq!(
            parse_thp_mode("always within_size advise [never] deny force").as_deref(),
            Some("never")
        );
        assert_eq!(parse_thp_mode("always never"), None);
        assert_eq!(parse_thp_mode("[never"), None);
        assert!(shmem_mode_gives_huge_pages("advise"));
        assert!(shmem_mode_gives_huge_pages("within_size"));
        assert!(!shmem_mode_gives_huge_pages("never"));
        assert!(!shmem_mode_gives_huge_pages("deny"));
    }

    #[test]
    fn size_mismatch_is_refused() {
        let seg = Segment::create("k3-test", 4096).unwrap();
        let fd = seg.read_only_fd().unwrap();
        assert!(ReadOnlySegment::map(fd, 8192).is_err());
    }

    #[test]
    fn sealed_against_resize() {
        let seg = Segment::create("k3-test", 4096).unwrap();
        assert!(seg.file.set_len(0).is_err());
        assert!(seg.file.set_len(1 << 20).is_err());
    }
}
