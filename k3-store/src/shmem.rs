//! The store's shared memory: one segment, mapped read-write by the store and read-only by
//! workers, in one of two kinds ([`ShmKind`]):
//!
//! * **memfd** (Linux, the default there). Not limited by `/dev/shm`'s size cap, no name to leak
//!   (it disappears when the store and every worker holding it are gone), and it reaches only the
//!   peers the store hands it to over the socket. It is sealed against shrinking and growing, so
//!   a mapped worker can never fault past its end, and — once the store has mapped it — against
//!   any further write (`F_SEAL_FUTURE_WRITE`, Linux ≥ 5.1): no `write(2)` and no new writable
//!   mapping, by anyone. That seal is what keeps a worker out: the read-only descriptor a worker
//!   receives (re-opened `O_RDONLY` through `/proc/self/fd`) could itself be re-opened read-write
//!   through the worker's own `/proc/self/fd` by the same uid (checked: it can, on 6.x kernels),
//!   so the access mode alone does not protect the store's memory. The memfd is also made mode
//!   0400, which refuses that re-open to a non-root worker on kernels without the seal.
//! * **POSIX shm** (`shm_open`; macOS, where it is the only kind, or forced on Linux with
//!   `K3_SHM=posix`). The store creates a fresh name (`O_EXCL`, mode 0600), sizes and maps it,
//!   opens it once more `O_RDONLY`, and unlinks the name at once: from then on the object is
//!   reachable only through the store's two descriptors and what it hands out. Workers receive
//!   duplicates of the read-only one: `mmap(PROT_WRITE, MAP_SHARED)` of it is refused and its
//!   access mode cannot be changed (`fcntl` cannot), and without a name there is nothing to
//!   `shm_open` again. On macOS there is no `/proc/self/fd` to re-open it through and a shm
//!   object can be sized only once (so it cannot shrink under a worker either); on Linux the
//!   forced path leaves `/proc/self/fd` re-open to a root worker (mode 0400 stops others) — it is
//!   a test of the portable code, not a hardening.
//!
//! [`SHM_ENV`] chooses the kind; [`shm_kind`] reads it (an unknown value, or `memfd` where there
//! is none, is a refusal).

use std::fs::File;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use k3_proto::paths::EnvError;
use memmap2::{Mmap, MmapMut, MmapOptions};
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::runtime::io::page_size;
use crate::runtime::source::ByteOwner;

/// Environment variable choosing the shared-memory kind: `memfd` (Linux only, its default) or
/// `posix` (`shm_open`; the default and only kind elsewhere).
pub const SHM_ENV: &str = k3_proto::paths::env::K3_SHM;

/// How shared memory (the store's segment, a session's bytes) is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShmKind {
    /// An anonymous `memfd_create` file with seals (Linux).
    Memfd,
    /// A POSIX shared-memory object (`shm_open`), unlinked as soon as it is open.
    Posix,
}

impl ShmKind {
    /// The kind this system uses unless [`SHM_ENV`] says otherwise.
    pub const DEFAULT: ShmKind = if cfg!(target_os = "linux") {
        ShmKind::Memfd
    } else {
        ShmKind::Posix
    };

    /// The name [`SHM_ENV`] uses.
    pub fn name(self) -> &'static str {
        match self {
            ShmKind::Memfd => "memfd",
            ShmKind::Posix => "posix",
        }
    }

    /// Parses a [`SHM_ENV`] value (empty: the default); `memfd` only where it exists.
    pub fn parse(v: &str) -> Result<ShmKind, EnvError> {
        match v.trim() {
            "" => Ok(ShmKind::DEFAULT),
            "memfd" if cfg!(target_os = "linux") => Ok(ShmKind::Memfd),
            "posix" => Ok(ShmKind::Posix),
            other => Err(EnvError::Invalid {
                name: SHM_ENV,
                value: other.to_string(),
                expected: if cfg!(target_os = "linux") {
                    "memfd or posix"
                } else {
                    "posix (this system has no memfd)"
                },
            }),
        }
    }
}

/// The kind [`SHM_ENV`] selects (read on every call; binaries check it at start-up and refuse
/// to run, exit 2, when it is invalid).
pub fn shm_kind() -> Result<ShmKind, EnvError> {
    match std::env::var(SHM_ENV) {
        Ok(v) => ShmKind::parse(&v),
        Err(std::env::VarError::NotPresent) => Ok(ShmKind::DEFAULT),
        Err(source) => Err(EnvError::Unreadable {
            name: SHM_ENV,
            source,
        }),
    }
}

fn env_err(e: EnvError) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, e)
}

/// The store's read-write view of the segment.
pub struct Segment {
    /// Memfd: the read-write memfd (re-opened read-only for each worker). POSIX: the read-only
    /// descriptor, duplicated for each worker (the read-write one is closed once mapped).
    file: File,
    kind: ShmKind,
    map: MmapMut,
}

impl Segment {
    /// Create a segment of `len` bytes (zero-filled, pages allocated lazily) of the kind
    /// [`SHM_ENV`] selects.
    pub fn create(name: &str, len: u64) -> std::io::Result<Segment> {
        Segment::create_with(shm_kind().map_err(env_err)?, name, len)
    }

    /// [`Segment::create`] of a given kind.
    pub fn create_with(kind: ShmKind, name: &str, len: u64) -> std::io::Result<Segment> {
        let size = usize::try_from(len).map_err(std::io::Error::other)?;
        match kind {
            ShmKind::Memfd => memfd_segment(name, len, size),
            ShmKind::Posix => {
                let obj = PosixShm::create(len)?;
                // SAFETY: the object was created just now under a fresh name (O_EXCL), sized to
                // `len` bytes; only this store writes to it and nobody can shrink it (the store
                // keeps no way to, workers hold read-only descriptors, and the name is gone once
                // `finish` returns).
                let map = unsafe { MmapOptions::new().len(size).map_mut(&obj.rw)? };
                Ok(Segment {
                    file: obj.finish()?,
                    kind,
                    map,
                })
            }
        }
    }

    /// The kind of shared memory this is.
    pub fn kind(&self) -> ShmKind {
        self.kind
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
        match self.kind {
            ShmKind::Memfd => reopen_read_only(&self.file),
            ShmKind::Posix => Ok(OwnedFd::from(self.file.try_clone()?)),
        }
    }
}

/// A memfd segment: created, sized, mapped, then sealed (see the module doc).
#[cfg(target_os = "linux")]
fn memfd_segment(name: &str, len: u64, size: usize) -> std::io::Result<Segment> {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    let file = memfd(name)?;
    file.set_len(len)?;
    // No shrinking, no growing: a worker's mapping can never outlive the bytes behind it.
    fcntl(
        file.as_fd(),
        FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW),
    )?;
    // SAFETY: the memfd is private to this process until handed out, and only this store
    // writes to it; nobody can truncate it (sealed above), so the mapping stays valid.
    let map = unsafe { MmapOptions::new().len(size).map_mut(&file)? };
    // Best effort (see [`shmem_huge_pages`]): where the kernel allows huge pages for shared
    // memory on request, the segment gets them; elsewhere this changes nothing.
    let _ = map.advise(memmap2::Advice::HugePage);
    // From here on nobody writes through a descriptor or maps it writable again: the store's
    // mapping above is the only writable view there will ever be.
    nix::sys::stat::fchmod(file.as_fd(), Mode::S_IRUSR)?;
    match fcntl(
        file.as_fd(),
        FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_FUTURE_WRITE),
    ) {
        Ok(_) => {}
        Err(nix::errno::Errno::EINVAL) => tracing::warn!(
            "this kernel cannot seal shared memory against future writes (F_SEAL_FUTURE_WRITE, \
             Linux 5.1): a worker running as root could re-open the store's memory writable"
        ),
        Err(e) => return Err(e.into()),
    }
    Ok(Segment {
        file,
        kind: ShmKind::Memfd,
        map,
    })
}

#[cfg(not(target_os = "linux"))]
fn memfd_segment(_name: &str, _len: u64, _size: usize) -> std::io::Result<Segment> {
    Err(env_err(ShmKind::parse("memfd").expect_err("no memfd here")))
}

/// A new close-on-exec memfd that allows sealing.
#[cfg(target_os = "linux")]
pub(crate) fn memfd(name: &str) -> std::io::Result<File> {
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let cname = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
    let fd: OwnedFd = memfd_create(
        cname.as_c_str(),
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )?;
    Ok(File::from(fd))
}

/// A read-only descriptor for the memfd `file` (`/proc/self/fd`, opened `O_RDONLY`).
#[cfg(target_os = "linux")]
fn reopen_read_only(file: &File) -> std::io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let f = std::fs::OpenOptions::new().read(true).open(path)?;
    Ok(OwnedFd::from(f))
}

#[cfg(not(target_os = "linux"))]
fn reopen_read_only(_file: &File) -> std::io::Result<OwnedFd> {
    Err(env_err(ShmKind::parse("memfd").expect_err("no memfd here")))
}

/// A POSIX shared-memory object being made: its name (still linked) and its read-write
/// descriptor. [`PosixShm::finish`] opens the read-only descriptor and unlinks the name; a
/// failure before that unlinks it too (`Drop`).
pub(crate) struct PosixShm {
    name: String,
    pub(crate) rw: File,
    linked: bool,
}

/// Names made by this process so far (each POSIX object gets a fresh one).
static SHM_SEQ: AtomicU64 = AtomicU64::new(0);

impl PosixShm {
    /// A fresh object of `len` bytes, mode 0600, open read-write.
    pub(crate) fn create(len: u64) -> std::io::Result<PosixShm> {
        // Short: macOS allows 31 bytes (PSHMNAMLEN).
        let name = format!(
            "/k3-{}-{}",
            std::process::id(),
            SHM_SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let fd = nix::sys::mman::shm_open(
            name.as_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )?;
        let obj = PosixShm {
            name,
            rw: File::from(fd),
            linked: true,
        };
        set_cloexec(obj.rw.as_fd())?;
        // An empty object keeps its size 0 unset (macOS may refuse to size a shm object to 0).
        if len > 0 {
            let off = i64::try_from(len).map_err(std::io::Error::other)?;
            nix::unistd::ftruncate(obj.rw.as_fd(), off)?;
        }
        Ok(obj)
    }

    /// The read-only descriptor; the name is unlinked and the object made mode 0400 (best
    /// effort: macOS may not support `fchmod` on shm, and without a name it does not matter
    /// there). The read-write descriptor is closed when `self` drops.
    pub(crate) fn finish(mut self) -> std::io::Result<File> {
        let ro = nix::sys::mman::shm_open(self.name.as_str(), OFlag::O_RDONLY, Mode::empty());
        self.unlink();
        let ro = File::from(ro?);
        set_cloexec(ro.as_fd())?;
        if let Err(e) = nix::sys::stat::fchmod(self.rw.as_fd(), Mode::S_IRUSR) {
            tracing::debug!("fchmod of a POSIX shared-memory object: {e}");
        }
        Ok(ro)
    }

    fn unlink(&mut self) {
        if std::mem::take(&mut self.linked) {
            if let Err(e) = nix::sys::mman::shm_unlink(self.name.as_str()) {
                tracing::warn!("cannot unlink shared memory {}: {e}", self.name);
            }
        }
    }
}

impl Drop for PosixShm {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// Sets close-on-exec on `fd` (`shm_open` sets it on Linux and macOS; said explicitly so a
/// descriptor of the store's memory never leaks into a spawned process).
pub(crate) fn set_cloexec(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    fcntl(fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
    Ok(())
}

/// Whether an object of `found` bytes holds exactly the `expected` announced: equal, or (a
/// POSIX object, whose size macOS rounds up to whole pages) `expected` rounded up to a page.
pub(crate) fn size_matches(found: u64, expected: u64) -> bool {
    found == expected
        || (found > expected && Some(found) == expected.checked_next_multiple_of(page_size()))
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
        if !size_matches(len, expected_len) {
            return Err(std::io::Error::other(format!(
                "shared memory is {len} bytes, the store announced {expected_len}"
            )));
        }
        let size = usize::try_from(expected_len).map_err(std::io::Error::other)?;
        // SAFETY: the segment cannot shrink (a memfd sealed by the store; a POSIX object that
        // only the store could resize, and macOS sizes one only once), so the mapping stays
        // backed; the store writes only slots that are not leased to this worker, and this worker
        // reads only leased slots and immutable regions (header, resident tensors, pinned layers).
        let map = unsafe { MmapOptions::new().len(size).map(&file)? };
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

    /// Every kind this system has.
    fn kinds() -> Vec<ShmKind> {
        if cfg!(target_os = "linux") {
            vec![ShmKind::Memfd, ShmKind::Posix]
        } else {
            vec![ShmKind::Posix]
        }
    }

    #[test]
    fn worker_view_is_read_only_and_sees_store_writes() {
        for kind in kinds() {
            let mut seg = Segment::create_with(kind, "k3-test", 8192).unwrap();
            assert_eq!(seg.kind(), kind);
            seg.bytes_mut()[..5].copy_from_slice(b"hello");
            let fd = seg.read_only_fd().unwrap();
            // The read-only descriptor cannot be mapped writable, nor written to.
            let mut f = File::from(fd.try_clone().unwrap());
            // SAFETY: test-only mapping of the store's segment; expected to fail with EACCES.
            let writable = unsafe { MmapMut::map_mut(&f) };
            assert!(
                writable.is_err(),
                "{kind:?}: read-only fd must not map writable"
            );
            use std::io::Write;
            assert!(f.write_all(b"x").is_err(), "{kind:?}: read-only fd wrote");
            let ro = ReadOnlySegment::map(fd, 8192).unwrap();
            assert_eq!(&ro.bytes()[..5], b"hello");
            seg.bytes_mut()[0] = b'j';
            assert_eq!(&ro.bytes()[..5], b"jello", "{kind:?}: shared, not copied");
        }
    }

    /// What a worker could try on Linux with the descriptor it gets: re-open it read-write
    /// through its own `/proc/self/fd` (same uid; root skips the mode check). The memfd's
    /// `F_SEAL_FUTURE_WRITE` refuses both a write and a writable mapping through the re-opened
    /// descriptor, while the store's own mapping stays writable.
    #[cfg(target_os = "linux")]
    #[test]
    fn reopened_memfd_cannot_be_written_or_mapped_writable() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let mut seg = Segment::create_with(ShmKind::Memfd, "k3-test", 8192).unwrap();
        let fd = seg.read_only_fd().unwrap();
        let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
        {
            // Not root: mode 0400 refuses the re-open itself.
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}"),
            Ok(mut rw) => {
                let e = rw.write_all(b"x").unwrap_err();
                assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
                // SAFETY: test-only; expected to fail (the memfd is sealed against new writable
                // mappings).
                let writable = unsafe { MmapMut::map_mut(&rw) };
                assert!(writable.is_err(), "a sealed memfd mapped writable");
            }
        }
        seg.bytes_mut()[4096] = 7;
        let ro = ReadOnlySegment::map(fd, 8192).unwrap();
        assert_eq!(ro.bytes()[4096], 7, "the store still writes its memory");
    }

    /// The POSIX object has no name left once its read-only descriptor is open: nothing can
    /// open it again; a failure before that unlinks it too.
    #[test]
    fn posix_object_has_no_name_once_finished() {
        let gone = |name: &str| {
            matches!(
                nix::sys::mman::shm_open(name, OFlag::O_RDONLY, Mode::empty()),
                Err(nix::errno::Errno::ENOENT)
            )
        };
        let obj = PosixShm::create(4096).unwrap();
        let name = obj.name.clone();
        assert!(!gone(&name), "the name exists while the object is made");
        let ro = obj.finish().unwrap();
        assert!(gone(&name), "{name} still exists");
        assert_eq!(ro.metadata().unwrap().len(), 4096);
        let obj = PosixShm::create(4096).unwrap();
        let name = obj.name.clone();
        drop(obj);
        assert!(gone(&name), "{name} left behind by a failed creation");
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
        for kind in kinds() {
            let seg = Segment::create_with(kind, "k3-test", 4096).unwrap();
            let fd = seg.read_only_fd().unwrap();
            assert!(ReadOnlySegment::map(fd, 8192).is_err(), "{kind:?}");
        }
        // A whole page more than announced is only the rounding of a shorter size.
        let page = page_size();
        assert!(size_matches(page, page - 100));
        assert!(size_matches(page, page));
        assert!(!size_matches(2 * page, page));
        assert!(!size_matches(page - 1, page));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn sealed_against_resize() {
        let seg = Segment::create_with(ShmKind::Memfd, "k3-test", 4096).unwrap();
        assert!(seg.file.set_len(0).is_err());
        assert!(seg.file.set_len(1 << 20).is_err());
    }

    #[test]
    fn kind_names_parse() {
        assert_eq!(ShmKind::parse("").unwrap(), ShmKind::DEFAULT);
        assert_eq!(ShmKind::parse(" posix ").unwrap(), ShmKind::Posix);
        assert_eq!(
            ShmKind::parse("memfd").is_ok(),
            cfg!(target_os = "linux"),
            "memfd exactly where it exists"
        );
        let e = ShmKind::parse("sysv").unwrap_err().to_string();
        assert!(e.contains("K3_SHM") && e.contains("sysv"), "{e}");
        for k in kinds() {
            assert_eq!(ShmKind::parse(k.name()).unwrap(), k);
        }
    }
}
