//! Disk I/O: 4 KiB-aligned buffers, an `O_DIRECT` reader with a buffered fallback, and parallel
//! reads issued in disk-offset order.
//!
//! Weights are read once per use from NVMe; the page cache would only duplicate them, so reads
//! bypass it with `O_DIRECT` whenever the filesystem allows. `O_DIRECT` needs the file offset, the
//! length and the destination address all aligned to the logical block size; we align to
//! [`ALIGN`] (4096), which covers every NVMe in practice. A range `[off, off+len)` is read as the
//! aligned span `[align_down(off), align_up(off+len))` and the caller uses the inner window.
//! Filesystems that refuse `O_DIRECT` (tmpfs answers `EINVAL` on open, some FUSE filesystems on
//! read) are read with ordinary positioned reads instead; the file remembers the fallback.
//!
//! Where there is no `O_DIRECT` (macOS), or when `K3_DISK_IO=advise` asks for it on Linux, files
//! are read the portable way ([`DiskIo::Advise`]): ordinary positioned reads, each announced to
//! the kernel first so the whole range is fetched at once (`F_RDADVISE` on macOS,
//! `POSIX_FADV_WILLNEED` on Linux), and kept out of the page cache like `O_DIRECT` reads
//! (`F_NOCACHE` on the descriptor on macOS; `POSIX_FADV_DONTNEED` after each read on Linux), so
//! weights are not held twice.

use std::alloc::Layout;
use std::fs::File;
use std::num::NonZeroUsize;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use k3_proto::paths::EnvError;
use nix::errno::Errno;
use nix::sys::mman::{self, MapFlags, ProtFlags};

/// Environment variable choosing how files are read: `direct` (`O_DIRECT`, Linux only and its
/// default) or `advise` (buffered reads with advice; the default elsewhere).
pub const DISK_IO_ENV: &str = k3_proto::paths::env::K3_DISK_IO;

/// How checkpoint and trunk files are read ([`DISK_IO_ENV`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskIo {
    /// `O_DIRECT`, falling back to plain buffered reads where the filesystem refuses it.
    Direct,
    /// Buffered reads, each announced first and kept out of the page cache (module doc).
    Advise,
}

impl DiskIo {
    /// The mode this system uses unless [`DISK_IO_ENV`] says otherwise.
    pub const DEFAULT: DiskIo = if cfg!(target_os = "linux") {
        DiskIo::Direct
    } else {
        DiskIo::Advise
    };

    /// The name [`DISK_IO_ENV`] uses.
    pub fn name(self) -> &'static str {
        match self {
            DiskIo::Direct => "direct",
            DiskIo::Advise => "advise",
        }
    }

    /// Parses a [`DISK_IO_ENV`] value (empty: the default); `direct` only where `O_DIRECT`
    /// exists.
    pub fn parse(v: &str) -> Result<DiskIo, EnvError> {
        match v.trim() {
            "" => Ok(DiskIo::DEFAULT),
            "direct" if cfg!(target_os = "linux") => Ok(DiskIo::Direct),
            "advise" => Ok(DiskIo::Advise),
            other => Err(EnvError::Invalid {
                name: DISK_IO_ENV,
                value: other.to_string(),
                expected: if cfg!(target_os = "linux") {
                    "direct or advise"
                } else {
                    "advise (this system has no O_DIRECT)"
                },
            }),
        }
    }
}

/// The mode [`DISK_IO_ENV`] selects (binaries check it at start-up and refuse to run, exit 2,
/// when it is invalid).
pub fn disk_io() -> Result<DiskIo, EnvError> {
    match std::env::var(DISK_IO_ENV) {
        Ok(v) => DiskIo::parse(&v),
        Err(std::env::VarError::NotPresent) => Ok(DiskIo::DEFAULT),
        Err(source) => Err(EnvError::Unreadable {
            name: DISK_IO_ENV,
            source,
        }),
    }
}

/// Alignment of every `O_DIRECT` offset, length and buffer address.
pub const ALIGN: usize = 4096;

/// Round `x` down to a multiple of [`ALIGN`].
pub const fn align_down(x: u64) -> u64 {
    x & !(ALIGN as u64 - 1)
}

/// Round `x` up to a multiple of [`ALIGN`]; `None` on overflow.
pub const fn align_up(x: u64) -> Option<u64> {
    match x.checked_add(ALIGN as u64 - 1) {
        Some(v) => Some(align_down(v)),
        None => None,
    }
}

/// Bytes a buffer needs to receive `[off, off+len)` as an aligned span (see [`DiskFile::read_span`]).
pub fn span_len(off: u64, len: u64) -> Option<u64> {
    let end = align_up(off.checked_add(len)?)?;
    Some(end - align_down(off))
}

/// A read failure. The message always names the file, the offset and the length; the kind of
/// the operating system's error, when there was one, is kept (`NotFound`, `PermissionDenied`,
/// `UnexpectedEof`, …) so callers can tell them apart without reading the text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ReadError(pub String, pub Option<std::io::ErrorKind>);

impl ReadError {
    /// A failure that is not an operating-system error (bounds, a missing layer, …).
    pub fn msg(m: impl std::fmt::Display) -> ReadError {
        ReadError(m.to_string(), None)
    }

    /// An operating-system error while doing `what`.
    pub fn io(what: impl std::fmt::Display, e: &std::io::Error) -> ReadError {
        ReadError(format!("{what}: {e}"), Some(e.kind()))
    }

    /// The operating system's error kind, if the failure was one.
    pub fn kind(&self) -> Option<std::io::ErrorKind> {
        self.1
    }
}

/// Why an [`AlignedBuf`] could not be allocated (the process is short of memory or address
/// space: a failure, never an abort).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// The size overflows once rounded up to [`ALIGN`].
    #[error("buffer of {len} bytes is too large")]
    TooLarge {
        /// Bytes asked for.
        len: usize,
    },
    /// The allocator refused the layout.
    #[error("buffer of {len} bytes: {source}")]
    Layout {
        /// Bytes asked for.
        len: usize,
        /// Why.
        source: std::alloc::LayoutError,
    },
    /// The heap allocation returned null.
    #[error("out of memory allocating {len} bytes (aligned buffer)")]
    OutOfMemory {
        /// Bytes asked for.
        len: usize,
    },
    /// The anonymous mapping was refused.
    #[error("out of memory mapping {len} bytes (aligned buffer): {source}")]
    Map {
        /// Bytes asked for.
        len: usize,
        /// The kernel's answer.
        source: nix::errno::Errno,
    },
}

/// A zero-initialised buffer whose address is [`ALIGN`]-aligned.
///
/// The owner of the allocation: `Drop` frees it. Buffers of at least [`MAP_MIN`] bytes are
/// anonymous private mappings: the kernel guarantees their pages read as zero, so no user-space
/// `memset` runs (the allocator's `alloc_zeroed` for a 4096-byte alignment writes every byte,
/// touching — and faulting in — every page a second time before the first read lands in it;
/// perf showed that at ~50% of a short k3slice run's cycles). Pages are only materialised when
/// first written (by the read that fills them), and buffers of 2 MiB or more ask for
/// transparent huge pages, which cuts the page faults 512-fold where THP is in `madvise` mode.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

/// Where an [`AlignedBuf`]'s memory came from.
#[derive(Clone, Copy, Debug)]
enum Backing {
    /// `std::alloc::alloc_zeroed` with this layout.
    Heap(Layout),
    /// `mmap` of this many bytes.
    Map(usize),
}

/// Smallest buffer served by an anonymous mapping instead of the heap.
pub const MAP_MIN: usize = 1 << 20;

/// A transparent huge page on x86-64 (and the alignment of buffers of at least this size).
pub const HUGE: usize = 2 << 20;

// SAFETY: AlignedBuf uniquely owns its allocation (no aliasing pointer escapes except through
// `&self`/`&mut self` borrows), so moving it to another thread or sharing `&AlignedBuf` between
// threads is as safe as for `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: see `Send`; `&AlignedBuf` only gives out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (the allocation is rounded up to a multiple of [`ALIGN`]).
    /// Fails cleanly (no abort) when the allocation is refused.
    pub fn zeroed(len: usize) -> Result<AlignedBuf, AllocError> {
        let cap = len
            .checked_add(ALIGN - 1)
            .map(|v| (v / ALIGN).max(1) * ALIGN)
            .ok_or(AllocError::TooLarge { len })?;
        if cap >= MAP_MIN {
            return Self::mapped(len, cap);
        }
        let layout = Layout::from_size_align(cap, ALIGN)
            .map_err(|source| AllocError::Layout { len, source })?;
        // SAFETY: `layout` has non-zero size (cap >= ALIGN) and a valid power-of-two alignment.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(AllocError::OutOfMemory { len })?;
        Ok(AlignedBuf {
            ptr,
            len,
            backing: Backing::Heap(layout),
        })
    }

    /// `cap` bytes (a multiple of the page size) of zero pages from an anonymous mapping. From
    /// [`HUGE`] bytes on, the buffer starts on a [`HUGE`] boundary and asks for transparent huge
    /// pages: then every whole 2 MiB of it can be one huge page (an unaligned mapping only gets
    /// the aligned 2 MiB windows inside it, none at all for a buffer under 4 MiB). That is what
    /// makes `O_DIRECT` reads fast on a virtual disk: a read into 4 KiB pages is one
    /// scatter-gather segment per page (~1.0 GB/s measured on the benchmark VM), into huge pages
    /// a few segments (~2.3 GB/s, same file, same 1.7 MB and 64 MiB reads). The tail past the
    /// last whole 2 MiB keeps small pages, so the resident size stays `cap`.
    fn mapped(len: usize, cap: usize) -> Result<AlignedBuf, AllocError> {
        // Over-map by HUGE - page when aligning, then give back the unaligned head and tail.
        let pad = if cap >= HUGE { HUGE - ALIGN } else { 0 };
        let map_len = cap.checked_add(pad).ok_or(AllocError::TooLarge { len })?;
        // Never zero: `cap` is at least MAP_MIN.
        let size = NonZeroUsize::new(map_len).ok_or(AllocError::TooLarge { len })?;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing aliases
        // nothing; it is owned by this buffer from here on.
        let raw = unsafe {
            mman::mmap_anonymous(
                None,
                size,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE,
            )
        }
        .map_err(|source| AllocError::Map { len, source })?;
        let raw = raw.cast::<u8>();
        let head = match pad {
            0 => 0,
            _ => (raw.as_ptr() as usize).next_multiple_of(HUGE) - raw.as_ptr() as usize,
        };
        let tail = map_len - head - cap;
        // SAFETY: `head < map_len`, so `raw + head` stays inside the mapping just created.
        let ptr = unsafe { raw.add(head) };
        if head > 0 {
            // SAFETY: `raw..raw+head` is the unaligned start of the mapping just created, owned
            // by us and never handed out.
            let _ = unsafe { mman::munmap(raw.cast(), head) };
        }
        if tail > 0 {
            // SAFETY: `ptr + cap` is the end of the buffer, inside the mapping (`cap + tail` bytes
            // from `ptr` are mapped).
            let end = unsafe { ptr.add(cap) };
            // SAFETY: `end..end+tail` is the end of the same mapping, past the buffer.
            let _ = unsafe { mman::munmap(end.cast(), tail) };
        }
        #[cfg(target_os = "linux")]
        if cap >= HUGE {
            // Best effort: huge pages only change how the zero pages are provided (Linux's
            // transparent huge pages; other systems have no such request).
            // SAFETY: `ptr..ptr+cap` is inside the mapping just created and owned by us.
            let _ = unsafe { mman::madvise(ptr.cast(), cap, mman::MmapAdvise::MADV_HUGEPAGE) };
        }
        Ok(AlignedBuf {
            ptr,
            len,
            backing: Backing::Map(cap),
        })
    }

    /// Length in bytes (as requested, not the rounded capacity).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to an allocation of `layout.size() >= len` bytes that this value
        // owns and that was zero-initialised (by `alloc_zeroed` or, for a mapping, by the
        // kernel), so all `len` bytes are initialised; the returned
        // borrow is tied to `&self`, so the allocation outlives it and no `&mut` can coexist.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` guarantees this is the only live borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The start of the buffer as a raw pointer (for owners that hand out disjoint sub-ranges
    /// themselves, like the trunk ring's arena). Valid for `len()` bytes while `self` lives.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match self.backing {
            Backing::Heap(layout) => {
                // SAFETY: `ptr` was returned by `alloc_zeroed(layout)` and is freed exactly once.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
            }
            Backing::Map(cap) => {
                // SAFETY: `ptr..ptr+cap` is the mapping made in `mapped`, unmapped exactly once;
                // no borrow of it outlives `self`.
                let _ = unsafe { mman::munmap(self.ptr.cast(), cap) };
            }
        }
    }
}

/// A read-only, page-cache-backed mapping of one byte range of a file. Only the pages actually
/// touched become resident: the embedding table (2.35 GB at full scale, one 14 KB row read per
/// token) is served this way instead of being read into anonymous memory.
pub struct MappedRange {
    map: memmap2::Mmap,
    inner: usize,
    len: usize,
}

impl MappedRange {
    /// Map `len` bytes of `path` from `off`.
    pub fn map(path: &Path, off: u64, len: u64) -> Result<MappedRange, ReadError> {
        let what = || format!("{} [{off}, +{len})", path.display());
        let f = File::open(path).map_err(|e| ReadError::io(what(), &e))?;
        let flen = f.metadata().map_err(|e| ReadError::io(what(), &e))?.len();
        let end = off.checked_add(len).filter(|&e| e <= flen).ok_or_else(|| {
            ReadError::msg(format!("{}: past the end of a {flen}-byte file", what()))
        })?;
        // Mapping offsets are whole pages of this system (16 KiB on Apple silicon, 4 KiB on
        // x86-64 Linux), not `ALIGN`.
        let page = page_size();
        let start = off / page * page;
        let inner = (off - start) as usize;
        let map_len = usize::try_from(end - start)
            .map_err(|_| ReadError::msg(format!("{}: too large to map", what())))?;
        // SAFETY: the file is opened read-only and mapped read-only; k3 never writes checkpoint
        // files. The range was checked against the file's size above. (As with any mapped
        // loader, another process truncating the file while it is mapped would fault; the
        // checkpoint is treated as immutable while k3 runs.)
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(start)
                .len(map_len)
                .map(&f)
        }
        .map_err(|e| ReadError::io(format!("mapping {}", what()), &e))?;
        Ok(MappedRange {
            map,
            inner,
            len: len as usize,
        })
    }
}

impl MappedRange {
    /// The bytes of the range.
    pub fn as_slice(&self) -> &[u8] {
        &self.map[self.inner..self.inner + self.len]
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

/// An open file read with `O_DIRECT` when possible, buffered otherwise.
#[derive(Debug)]
pub struct DiskFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    /// Cleared the first time the filesystem refuses a direct read.
    direct_ok: AtomicBool,
    /// Buffered reads are announced first and kept out of the page cache ([`DiskIo::Advise`]).
    advise: bool,
    len: u64,
}

/// What [`DiskFile::stamp`] sees of an open file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileStamp {
    /// Inode number.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// Last modification (seconds, nanoseconds).
    pub mtime: (i64, i64),
    /// Last change of contents or metadata (seconds, nanoseconds).
    pub ctime: (i64, i64),
}

/// Chunk size of the bounce buffer used to read into unaligned destinations.
pub const BOUNCE: usize = 8 << 20;

impl DiskFile {
    /// Open `path` for reading the way [`DISK_IO_ENV`] says ([`DiskFile::open_mode`]).
    pub fn open(path: &Path) -> Result<DiskFile, ReadError> {
        let mode = disk_io().map_err(ReadError::msg)?;
        Self::open_mode(path, mode)
    }

    /// Open `path` for reading in `mode`: [`DiskIo::Direct`] tries `O_DIRECT` too and silently
    /// keeps only the buffered handle if the filesystem refuses it; [`DiskIo::Advise`] reads
    /// through the buffered handle with advice (the module doc).
    pub fn open_mode(path: &Path, mode: DiskIo) -> Result<DiskFile, ReadError> {
        match mode {
            DiskIo::Direct => Self::open_with(path, true),
            DiskIo::Advise => {
                let mut f = Self::open_with(path, false)?;
                f.advise = true;
                keep_out_of_cache(&f.buffered);
                Ok(f)
            }
        }
    }

    /// Like [`DiskFile::open`] with plain buffered reads (no advice) or `O_DIRECT`;
    /// `try_direct = false` never uses `O_DIRECT`.
    pub fn open_with(path: &Path, try_direct: bool) -> Result<DiskFile, ReadError> {
        let buffered = File::open(path)
            .map_err(|e| ReadError::io(format!("cannot open {}", path.display()), &e))?;
        let len = buffered
            .metadata()
            .map_err(|e| ReadError::io(format!("cannot stat {}", path.display()), &e))?
            .len();
        let direct = if try_direct { open_direct(path) } else { None };
        Ok(DiskFile {
            path: path.to_path_buf(),
            buffered,
            direct_ok: AtomicBool::new(direct.is_some()),
            direct,
            advise: false,
            len,
        })
    }

    /// How this file is read now, for run reports.
    pub fn read_mode(&self) -> &'static str {
        match (self.is_direct(), self.advise) {
            (true, _) => "O_DIRECT",
            (false, true) if cfg!(target_os = "macos") => "F_NOCACHE + F_RDADVISE reads",
            (false, true) => "buffered reads + fadvise",
            (false, false) => "buffered reads",
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size when opened.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty file.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file's state now (`fstat` of the open file: inode, size, modification and change
    /// times), or `None` when it cannot be had. A write to the file changes its change time, so
    /// two equal stamps say nobody wrote to it in between (`K3_TRUNK_VERIFY=first`).
    pub fn stamp(&self) -> Option<FileStamp> {
        use std::os::unix::fs::MetadataExt;
        let m = self.buffered.metadata().ok()?;
        Some(FileStamp {
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }

    /// True while reads go through `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some() && self.direct_ok.load(Ordering::Relaxed)
    }

    fn err(&self, off: u64, len: u64, what: impl std::fmt::Display) -> ReadError {
        ReadError::msg(format!(
            "read of {} bytes at offset {} in {} failed: {what}",
            len,
            off,
            self.path.display()
        ))
    }

    fn check_range(&self, off: u64, len: u64) -> Result<(), ReadError> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(self.err(
                off,
                len,
                format_args!("range ends past end of file ({} bytes)", self.len),
            )),
        }
    }

    /// Positioned read of exactly `dst.len()` bytes through the buffered handle (announced first
    /// and dropped from the page cache after, with [`DiskIo::Advise`]).
    fn pread_exact(&self, off: u64, dst: &mut [u8]) -> Result<(), ReadError> {
        if !self.advise {
            return self.pread_plain(off, dst);
        }
        will_need(&self.buffered, off, dst.len() as u64);
        let r = self.pread_plain(off, dst);
        done_with(&self.buffered, off, dst.len() as u64);
        r
    }

    fn pread_plain(&self, off: u64, dst: &mut [u8]) -> Result<(), ReadError> {
        let mut done = 0usize;
        while done < dst.len() {
            match self.buffered.read_at(&mut dst[done..], off + done as u64) {
                Ok(0) => {
                    return Err(self.err(
                        off,
                        dst.len() as u64,
                        format_args!("unexpected end of file after {done} bytes"),
                    ))
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let kind = e.kind();
                    return Err(ReadError(self.err(off, dst.len() as u64, e).0, Some(kind)));
                }
            }
        }
        Ok(())
    }

    /// Direct read of the aligned span starting at aligned `aoff` into aligned `dst`; needs at
    /// least `need` bytes (the tail of the last block may lie past EOF). `Ok(false)` when the
    /// filesystem refused `O_DIRECT` (the caller falls back).
    fn direct_read(
        &self,
        aoff: u64,
        dst: &mut [u8],
        need: usize,
        (off, len): (u64, u64),
    ) -> Result<bool, ReadError> {
        let Some(f) = self.direct.as_ref() else {
            return Ok(false);
        };
        let mut done = 0usize;
        while done < need {
            match f.read_at(&mut dst[done..], aoff + done as u64) {
                Ok(0) => {
                    return Err(self.err(
                        off,
                        len,
                        format_args!(
                            "unexpected end of file after {} bytes (direct read)",
                            (aoff + done as u64).saturating_sub(off)
                        ),
                    ))
                }
                // A short direct read that is not block-aligned can only happen at EOF.
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(Errno::EINVAL as i32) && done == 0 => {
                    self.direct_ok.store(false, Ordering::Relaxed);
                    return Ok(false);
                }
                Err(e) => {
                    let kind = e.kind();
                    return Err(ReadError(self.err(off, len, e).0, Some(kind)));
                }
            }
        }
        Ok(true)
    }

    /// Read `[off, off+len)` as an aligned span into `dst`, whose address must be
    /// [`ALIGN`]-aligned and whose length must be at least [`span_len`]`(off, len)`. Returns the
    /// offset inside `dst` where byte `off` landed (`off % ALIGN`); bytes of `dst` outside
    /// `[inner, inner+len)` are unspecified afterwards.
    pub fn read_span(&self, off: u64, len: u64, dst: &mut [u8]) -> Result<usize, ReadError> {
        let span = span_len(off, len).ok_or_else(|| self.err(off, len, "length overflows"))?;
        if (dst.len() as u64) < span {
            return Err(self.err(
                off,
                len,
                format_args!(
                    "destination buffer of {} bytes is too small (needs {span})",
                    dst.len()
                ),
            ));
        }
        self.read_span_window(off, len, &mut dst[..span as usize], 0)
    }

    /// The part `[at, at + window.len())` of what [`DiskFile::read_span`]`(off, len, ..)` writes
    /// into its destination, written into `window` (the same bytes: a span read window by window
    /// equals one read). `at` is a multiple of [`ALIGN`], `window` is [`ALIGN`]-aligned, and its
    /// length is a multiple of [`ALIGN`] or reaches the end of the span. Returns `off % ALIGN`,
    /// like `read_span`.
    pub fn read_span_window(
        &self,
        off: u64,
        len: u64,
        window: &mut [u8],
        at: usize,
    ) -> Result<usize, ReadError> {
        self.check_range(off, len)?;
        let span = span_len(off, len).ok_or_else(|| self.err(off, len, "length overflows"))?;
        let end = at as u64 + window.len() as u64;
        if !(window.as_ptr() as usize).is_multiple_of(ALIGN)
            || !at.is_multiple_of(ALIGN)
            || end > span
            || (!window.len().is_multiple_of(ALIGN) && end != span)
        {
            return Err(self.err(
                off,
                len,
                format_args!(
                    "window [{at}, {end}) of a {span}-byte span is unaligned or out of range"
                ),
            ));
        }
        let aoff = align_down(off);
        let inner = (off - aoff) as usize;
        // The window's bytes that belong to [off, off+len), in span coordinates.
        let lo = at.max(inner);
        let hi = (end as usize).min(inner + len as usize);
        if lo >= hi {
            return Ok(inner);
        }
        if self.is_direct() && self.direct_read(aoff + at as u64, window, hi - at, (off, len))? {
            return Ok(inner);
        }
        self.pread_exact(aoff + lo as u64, &mut window[lo - at..hi - at])?;
        Ok(inner)
    }

    /// Read exactly `dst.len()` bytes from `off` into any destination. Uses `O_DIRECT` through an
    /// aligned bounce buffer (at most 8 MiB) when the destination is not itself aligned.
    pub fn read_exact_at(&self, off: u64, dst: &mut [u8]) -> Result<(), ReadError> {
        let len = dst.len() as u64;
        self.check_range(off, len)?;
        if len == 0 {
            return Ok(());
        }
        if !self.is_direct() {
            return self.pread_exact(off, dst);
        }
        let mut bounce: Option<AlignedBuf> = None;
        let mut done = 0usize;
        while done < dst.len() {
            let pos = off + done as u64;
            let inner = (pos - align_down(pos)) as usize;
            let take = (dst.len() - done).min(BOUNCE - inner);
            if bounce.is_none() {
                let want = span_len(pos, (dst.len() - done) as u64)
                    .map(|s| (s as usize).min(BOUNCE))
                    .unwrap_or(BOUNCE);
                bounce = Some(AlignedBuf::zeroed(want).map_err(|e| self.err(off, len, e))?);
            }
            let b = bounce
                .as_mut()
                .map(AlignedBuf::as_mut_slice)
                .unwrap_or_default();
            let got = self.read_span(pos, take as u64, b)?;
            dst[done..done + take].copy_from_slice(&b[got..got + take]);
            done += take;
        }
        Ok(())
    }

    /// Read `[off, off+len)` into a fresh aligned buffer; returns the buffer and the offset of
    /// byte `off` inside it.
    pub fn read_region(&self, off: u64, len: u64) -> Result<(AlignedBuf, usize), ReadError> {
        let span = span_len(off, len).ok_or_else(|| self.err(off, len, "length overflows"))?;
        self.check_range(off, len)?;
        let span = usize::try_from(span).map_err(|_| self.err(off, len, "too large"))?;
        let mut buf = AlignedBuf::zeroed(span).map_err(|e| self.err(off, len, e))?;
        let inner = self.read_span(off, len, buf.as_mut_slice())?;
        Ok((buf, inner))
    }
}

/// The system's page size (what a mapping's file offset must be a multiple of).
pub fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|v| u64::try_from(v).ok())
        .filter(|v| v.is_power_of_two())
        .unwrap_or(ALIGN as u64)
}

/// `path` opened with `O_DIRECT`, or `None` where the filesystem (or the system) has none.
#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
        .open(path)
        .ok()
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_path: &Path) -> Option<File> {
    None
}

/// macOS: reads through `f` bypass the unified buffer cache (`F_NOCACHE`), as `O_DIRECT` reads
/// do on Linux. Best effort. (Linux drops each range after reading it: [`done_with`].)
fn keep_out_of_cache(f: &File) {
    #[cfg(target_os = "macos")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: F_NOCACHE takes an int argument and only sets a flag on this open file.
        let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) };
        if r == -1 {
            tracing::debug!("F_NOCACHE: {}", std::io::Error::last_os_error());
        }
    }
    #[cfg(not(target_os = "macos"))]
    let _ = f;
}

/// Tells the kernel that `[off, off+len)` of `f` is about to be read, so it fetches the whole
/// range at once (`F_RDADVISE` on macOS, `POSIX_FADV_WILLNEED` on Linux). Best effort.
fn will_need(f: &File, off: u64, len: u64) {
    #[cfg(target_os = "macos")]
    {
        use nix::fcntl::{fcntl, FcntlArg};
        // F_RDADVISE takes an int count: advise in pieces of at most 1 GiB.
        let mut at = off;
        while at < off + len {
            let n = (off + len - at).min(1 << 30);
            let (Ok(ra_offset), Ok(ra_count)) = (i64::try_from(at), i32::try_from(n)) else {
                return;
            };
            let ra = libc::radvisory {
                ra_offset,
                ra_count,
            };
            if fcntl(f, FcntlArg::F_RDADVISE(ra)).is_err() {
                return;
            }
            at += n;
        }
    }
    #[cfg(target_os = "linux")]
    fadvise(
        f,
        off,
        len,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_WILLNEED,
    );
    #[cfg(not(any(target_os = "macos", target_os = "linux")))]
    let _ = (f, off, len);
}

/// Linux: drops `[off, off+len)` of `f` from the page cache once read (`POSIX_FADV_DONTNEED`),
/// so buffered reads leave no second copy of the weights behind. Best effort; elsewhere nothing
/// (macOS's `F_NOCACHE` already kept the pages out).
fn done_with(f: &File, off: u64, len: u64) {
    #[cfg(target_os = "linux")]
    fadvise(
        f,
        off,
        len,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    );
    #[cfg(not(target_os = "linux"))]
    let _ = (f, off, len);
}

#[cfg(target_os = "linux")]
fn fadvise(f: &File, off: u64, len: u64, advice: nix::fcntl::PosixFadviseAdvice) {
    if let (Ok(off), Ok(len)) = (i64::try_from(off), i64::try_from(len)) {
        let _ = nix::fcntl::posix_fadvise(f, off, len, advice);
    }
}

/// Run `f` over `jobs` on up to `threads` threads, issuing jobs in the order given (callers sort
/// by disk offset) and returning results in the same order.
pub fn run_parallel<T, R, F>(jobs: Vec<T>, threads: usize, f: F) -> Vec<R>
where
    T: Send,
    R: Send,
    F: Fn(T) -> R + Sync,
{
    let n = jobs.len();
    let threads = threads.clamp(1, n.max(1));
    if threads <= 1 {
        return jobs.into_iter().map(f).collect();
    }
    let slots: Vec<std::sync::Mutex<Option<T>>> = jobs
        .into_iter()
        .map(|j| std::sync::Mutex::new(Some(j)))
        .collect();
    let results: Vec<std::sync::Mutex<Option<R>>> =
        (0..n).map(|_| std::sync::Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let job = slots[i].lock().ok().and_then(|mut g| g.take());
                if let Some(job) = job {
                    let r = f(job);
                    if let Ok(mut g) = results[i].lock() {
                        *g = Some(r);
                    }
                }
            });
        }
    });
    results
        .into_iter()
        .map(|m| {
            m.into_inner()
                .ok()
                .flatten()
                .expect("every job ran exactly once (a worker thread panicked otherwise)")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("k3io-{tag}-"))
            .tempdir()
            .unwrap()
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 + i / 251) as u8).collect()
    }

    #[test]
    fn aligned_buf_is_aligned_and_zeroed() {
        for len in [
            0usize,
            1,
            4095,
            4096,
            4097,
            MAP_MIN - 1,
            MAP_MIN,
            HUGE - 1,
            HUGE,
            3 << 20,
            (5 << 20) + 7,
        ] {
            let mut b = AlignedBuf::zeroed(len).unwrap();
            assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
            // From 2 MiB on, the buffer starts on a huge-page boundary (so all of it but the
            // tail can be huge pages: what makes O_DIRECT reads fast on a virtual disk).
            if len >= HUGE {
                assert_eq!(b.as_slice().as_ptr() as usize % HUGE, 0, "len {len}");
            }
            assert_eq!(b.len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            // Writable over its whole length, and the writes read back.
            for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
                *x = (i % 251) as u8;
            }
            assert!(b
                .as_slice()
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (i % 251) as u8));
        }
    }

    fn check_ranges(f: &DiskFile, data: &[u8]) {
        let n = data.len() as u64;
        for (off, len) in [
            (0u64, 1u64),
            (1, 4095),
            (4095, 2),
            (4096, 4096),
            (100, 20_000),
            (n - 7, 7),
            (n - 5000, 5000),
            (3, 0),
        ] {
            let (buf, inner) = f.read_region(off, len).unwrap();
            assert_eq!(inner as u64, off % 4096);
            assert_eq!(
                &buf.as_slice()[inner..inner + len as usize],
                &data[off as usize..(off + len) as usize],
                "off {off} len {len}"
            );
            let mut v = vec![0u8; len as usize];
            f.read_exact_at(off, &mut v).unwrap();
            assert_eq!(&v[..], &data[off as usize..(off + len) as usize]);
            // Window by window, last window first, the span gets the same bytes.
            let span = span_len(off, len).unwrap() as usize;
            let mut w = AlignedBuf::zeroed(span).unwrap();
            for a in (0..span).step_by(ALIGN).rev() {
                let b = (a + ALIGN).min(span);
                let got = f
                    .read_span_window(off, len, &mut w.as_mut_slice()[a..b], a)
                    .unwrap();
                assert_eq!(got as u64, off % 4096);
            }
            let inner = (off % 4096) as usize;
            assert!(
                w.as_slice()[inner..inner + len as usize]
                    == data[off as usize..(off + len) as usize],
                "windows: off {off} len {len}"
            );
        }
        // Unaligned windows are refused.
        let mut w = AlignedBuf::zeroed(3 * ALIGN).unwrap();
        assert!(f
            .read_span_window(0, 3 * ALIGN as u64, &mut w.as_mut_slice()[1..ALIGN + 1], 1)
            .is_err());
        assert!(f
            .read_span_window(0, 3 * ALIGN as u64, &mut w.as_mut_slice()[..100], 0)
            .is_err());
    }

    #[test]
    fn reads_arbitrary_ranges_direct_and_buffered() {
        let tmp = tmpdir("ranges");
        let d = tmp.path();
        let p = d.join("f.bin");
        // Not a multiple of 4096, so the last block is partial (direct reads stop at EOF).
        let data = pattern(3 * 4096 * 7 + 123);
        std::fs::write(&p, &data).unwrap();
        let direct = DiskFile::open(&p).unwrap();
        check_ranges(&direct, &data);
        let buffered = DiskFile::open_with(&p, false).unwrap();
        assert!(!buffered.is_direct());
        check_ranges(&buffered, &data);
        // The portable path: buffered reads announced first and dropped from the cache after.
        let advised = DiskFile::open_mode(&p, DiskIo::Advise).unwrap();
        assert!(!advised.is_direct());
        assert_ne!(advised.read_mode(), buffered.read_mode());
        check_ranges(&advised, &data);
        // A large read through the bounce buffer crosses several 8 MiB chunks.
        let big = pattern(17 << 20);
        let pb = d.join("big.bin");
        std::fs::write(&pb, &big).unwrap();
        let f = DiskFile::open(&pb).unwrap();
        let mut v = vec![0u8; (17 << 20) - 4097];
        f.read_exact_at(4097, &mut v).unwrap();
        assert!(v == big[4097..]);
    }

    #[test]
    fn tmpfs_falls_back_to_buffered() {
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            return;
        }
        let p = shm.join(format!("k3io-{}.bin", std::process::id()));
        let data = pattern(3 * 4096 * 7 + 123);
        std::fs::write(&p, &data).unwrap();
        let f = DiskFile::open(&p).unwrap();
        check_ranges(&f, &data);
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn past_eof_and_short_file_are_errors_naming_file_offset_len() {
        let tmp = tmpdir("eof");
        let d = tmp.path();
        let p = d.join("short.bin");
        std::fs::write(&p, pattern(5000)).unwrap();
        let f = DiskFile::open(&p).unwrap();
        let e = f.read_region(4000, 2000).unwrap_err().0;
        assert!(
            e.contains("short.bin") && e.contains("4000") && e.contains("2000"),
            "{e}"
        );
        let mut v = vec![0u8; 10];
        let e = f.read_exact_at(4999, &mut v).unwrap_err().0;
        assert!(e.contains("4999") && e.contains("10"), "{e}");
        // The file shrinks after opening: the read hits EOF and must fail, not return zeros.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(1000)
            .unwrap();
        let e = f.read_region(500, 3000).unwrap_err().0;
        assert!(e.contains("end of file") && e.contains("offset 500"), "{e}");
        let b = DiskFile::open_with(&p, false).unwrap();
        let mut v = vec![0u8; 100];
        let e = b.read_exact_at(950, &mut v).unwrap_err().0;
        assert!(
            e.contains("past end of file") && e.contains("offset 950"),
            "{e}"
        );
        let e = DiskFile::open(&d.join("nope")).unwrap_err().0;
        assert!(e.contains("nope"), "{e}");
    }

    /// A mapped range starts at any byte: the mapping itself starts at the page below it (this
    /// system's page, 16 KiB on Apple silicon), and a range past the end is refused.
    #[test]
    fn mapped_ranges_start_anywhere() {
        let tmp = tmpdir("mapped");
        let p = tmp.path().join("f.bin");
        let data = pattern(5 * 16384 + 77);
        std::fs::write(&p, &data).unwrap();
        let page = page_size() as usize;
        assert!(page.is_power_of_two() && page >= 4096);
        for (off, len) in [
            (0, 1),
            (1, 100),
            (4095, 2),
            (16383, 3),
            (page + 7, 40_000),
            (81_900, 97),
        ] {
            let m = MappedRange::map(&p, off as u64, len as u64).unwrap();
            assert_eq!(m.as_slice(), &data[off..off + len], "off {off} len {len}");
        }
        assert!(MappedRange::map(&p, data.len() as u64 - 3, 4).is_err());
    }

    #[test]
    fn disk_io_names_parse() {
        assert_eq!(DiskIo::parse("").unwrap(), DiskIo::DEFAULT);
        assert_eq!(DiskIo::parse(" advise").unwrap(), DiskIo::Advise);
        assert_eq!(
            DiskIo::parse("direct").is_ok(),
            cfg!(target_os = "linux"),
            "direct exactly where O_DIRECT exists"
        );
        let e = DiskIo::parse("mmap").unwrap_err().to_string();
        assert!(e.contains("K3_DISK_IO") && e.contains("mmap"), "{e}");
        for m in [DiskIo::Direct, DiskIo::Advise] {
            if m == DiskIo::Advise || cfg!(target_os = "linux") {
                assert_eq!(DiskIo::parse(m.name()).unwrap(), m);
            }
        }
    }

    #[test]
    fn run_parallel_keeps_order_and_runs_everything() {
        let out = run_parallel((0..100u64).collect(), 4, |x| x * x);
        assert_eq!(out, (0..100u64).map(|x| x * x).collect::<Vec<_>>());
        let out: Vec<u64> = run_parallel(vec![], 4, |x: u64| x);
        assert!(out.is_empty());
    }

    #[test]
    fn read_errors_keep_the_operating_system_error_kind() {
        let dir = tempfile::tempdir().unwrap();
        let e = DiskFile::open(&dir.path().join("absent")).unwrap_err();
        assert_eq!(e.kind(), Some(std::io::ErrorKind::NotFound), "{e}");
        assert!(e.to_string().contains("absent"), "{e}");
        let s: crate::runtime::source::SourceError = e.clone().into();
        assert!(
            matches!(s, crate::runtime::source::SourceError::Read(ref r) if r.kind() == e.kind())
        );
        let bounds = ReadError::msg("outside the file");
        assert_eq!(bounds.kind(), None);
    }
}
