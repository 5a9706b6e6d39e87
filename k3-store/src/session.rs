//! Kept conversations (docs/SPEC.md §6.6): the session container format and the sealed memfd that
//! carries one between a worker and the store.
//!
//! A session is one byte string, the same in memory, on the socket (as a sealed memfd) and in a
//! `--state-dir` file:
//!
//! ```text
//! 0   magic "K3SESSN\0"            8 bytes
//! 8   format version (2)           u32 LE
//! 12  flags (0)                    u32 LE
//! 16  model identity               u128 LE  (the checkpoint's content identity, SPEC.md §6.11)
//! 32  n_ids                        u64 LE   (token ids the state covers)
//! 40  meta_len                     u64 LE   (worker metadata: the chat history, JSON)
//! 48  state_len                    u64 LE   (the sequence state, the worker's layout)
//! 56  reserved (0)                 8 bytes
//! 64  ids                          n_ids × u32 LE
//!     meta                         meta_len bytes
//!     state                        state_len bytes
//!     checksum                     u64 LE = XXH3-64 of every byte before it
//! ```
//!
//! The store reads the header, the ids (for the prefix match) and the checksum; the meta and
//! state sections are the worker's (`k3_worker::model::snapshot`). Every length is checked
//! against the total before anything is sliced.
//!
//! Why a memfd: a state is large (hundreds of MB at full scale) and the socket's frames are
//! bounded at a MiB, so the bytes travel out of band: the sender writes them into a memfd, seals
//! it (no write, no shrink, no grow) and passes the descriptor with `SCM_RIGHTS`. The receiver
//! refuses a descriptor without those seals, so what it checked can never change under it, and it
//! keeps or forwards the same pages without a copy.

use std::fs::File;
use std::hash::Hasher;
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use memmap2::{Mmap, MmapOptions};

use crate::shmem::{PosixShm, ShmKind};

/// First bytes of a session.
pub const MAGIC: [u8; 8] = *b"K3SESSN\0";
/// The container version this build writes and reads (2: the 128-bit content identity; 1 held
/// a 64-bit identity of the config and shard sizes only).
pub const FORMAT_VERSION: u32 = 2;
/// Bytes of the fixed header.
pub const HEADER_BYTES: usize = 64;
/// Bytes of the checksum trailer.
pub const TRAILER_BYTES: usize = 8;
/// Longest session name, in bytes.
pub const MAX_NAME_BYTES: usize = 64;

/// Why a session's bytes were refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SessionError {
    /// A name that cannot be a session's (nor a file name in `--state-dir`).
    #[error("session name {0:?}: use 1 to {MAX_NAME_BYTES} characters from [A-Za-z0-9._-], not starting with a dot")]
    Name(String),
    /// Not a session at all.
    #[error("not a k3 session (bad magic)")]
    Magic,
    /// Another container version.
    #[error("session format version {0}, this build reads version {FORMAT_VERSION}")]
    Version(u32),
    /// The lengths in the header do not add up to the bytes present.
    #[error("damaged session: {0}")]
    Length(String),
    /// The checksum does not match the bytes.
    #[error(
        "damaged session: checksum {found:016x} does not match the contents ({computed:016x})"
    )]
    Checksum {
        /// Stored.
        found: u64,
        /// Computed over the bytes.
        computed: u64,
    },
    /// Made for another checkpoint.
    #[error("the session was made for model identity {found:032x}; this store serves {expected:032x} (another checkpoint or config)")]
    Identity {
        /// In the session.
        found: u128,
        /// Ours.
        expected: u128,
    },
}

/// The fixed header's fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The checkpoint's content identity (`runtime::identity::ModelIdentity`).
    pub identity: u128,
    /// Token ids the state covers.
    pub n_ids: u64,
    /// Bytes of worker metadata.
    pub meta_len: u64,
    /// Bytes of sequence state.
    pub state_len: u64,
}

impl Header {
    /// Total bytes of a session with this header (`None` on overflow).
    pub fn total_len(&self) -> Option<u64> {
        (HEADER_BYTES as u64)
            .checked_add(self.n_ids.checked_mul(4)?)?
            .checked_add(self.meta_len)?
            .checked_add(self.state_len)?
            .checked_add(TRAILER_BYTES as u64)
    }

    fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[16..32].copy_from_slice(&self.identity.to_le_bytes());
        h[32..40].copy_from_slice(&self.n_ids.to_le_bytes());
        h[40..48].copy_from_slice(&self.meta_len.to_le_bytes());
        h[48..56].copy_from_slice(&self.state_len.to_le_bytes());
        h
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// A checked session: the header and its sections, borrowed from the bytes.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    /// The header.
    pub header: Header,
    ids: &'a [u8],
    /// Worker metadata.
    pub meta: &'a [u8],
    /// Sequence state.
    pub state: &'a [u8],
}

impl View<'_> {
    /// The token ids the state covers.
    pub fn ids(&self) -> Vec<u32> {
        self.ids
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect()
    }

    /// [`ids_hash`] of the ids, without collecting them.
    pub fn ids_hash(&self) -> u128 {
        let mut h = twox_hash::XxHash3_128::new();
        h.write(self.ids);
        h.finish_128()
    }
}

/// The trailer's checksum of a session's bytes before it (XXH3-64).
pub fn checksum(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// Check `bytes` as a session: magic, version, lengths, checksum (not the identity: see
/// [`check_identity`]).
pub fn parse(bytes: &[u8]) -> Result<View<'_>, SessionError> {
    if bytes.len() < HEADER_BYTES + TRAILER_BYTES {
        if bytes.len() >= 8 && bytes[..8] != MAGIC {
            return Err(SessionError::Magic);
        }
        return Err(SessionError::Length(format!(
            "{} bytes, shorter than a header",
            bytes.len()
        )));
    }
    if bytes[..8] != MAGIC {
        return Err(SessionError::Magic);
    }
    let version = u32_at(bytes, 8);
    if version != FORMAT_VERSION {
        return Err(SessionError::Version(version));
    }
    let flags = u32_at(bytes, 12);
    if flags != 0 || bytes[56..64].iter().any(|&b| b != 0) {
        return Err(SessionError::Length(
            "reserved header fields are not zero".into(),
        ));
    }
    let header = Header {
        identity: u128::from_le_bytes(bytes[16..32].try_into().expect("16 bytes")),
        n_ids: u64_at(bytes, 32),
        meta_len: u64_at(bytes, 40),
        state_len: u64_at(bytes, 48),
    };
    match header.total_len() {
        Some(t) if t == bytes.len() as u64 => {}
        t => {
            return Err(SessionError::Length(format!(
                "the header describes {} bytes, {} are present",
                t.map_or("more than 2^64".into(), |t| t.to_string()),
                bytes.len()
            )))
        }
    }
    let body = bytes.len() - TRAILER_BYTES;
    let found = u64_at(bytes, body);
    let computed = checksum(&bytes[..body]);
    if found != computed {
        return Err(SessionError::Checksum { found, computed });
    }
    // Lengths are now known to fit `bytes` (their sum is its length).
    let ids_end = HEADER_BYTES + header.n_ids as usize * 4;
    let meta_end = ids_end + header.meta_len as usize;
    Ok(View {
        header,
        ids: &bytes[HEADER_BYTES..ids_end],
        meta: &bytes[ids_end..meta_end],
        state: &bytes[meta_end..body],
    })
}

/// Refuse a session made for another checkpoint.
pub fn check_identity(view: &View<'_>, expected: u128) -> Result<(), SessionError> {
    if view.header.identity != expected {
        return Err(SessionError::Identity {
            found: view.header.identity,
            expected,
        });
    }
    Ok(())
}

/// The first 8 bytes (big-endian) of the HMAC-SHA256 of `ids` (little-endian u32s) under `key`:
/// the tag a session name derived from a prompt carries, so that the name confirms nothing about
/// the prompt to whoever lacks the key (serve's `http-…` and `prefix-…` names).
pub fn ids_mac(key: &[u8], ids: &[u32]) -> u64 {
    use hmac::{Hmac, Mac};
    let mut m = <Hmac<sha2::Sha256> as Mac>::new_from_slice(key).expect("any key length");
    for id in ids {
        m.update(&id.to_le_bytes());
    }
    let tag = m.finalize().into_bytes();
    let mut first = [0u8; 8];
    first.copy_from_slice(&tag[..8]);
    u64::from_be_bytes(first)
}

/// XXH3-128 of `ids` as little-endian u32s: what [`View::ids_hash`] computes, for matching a
/// request's prefix against the store's list without sending the ids.
pub fn ids_hash(ids: &[u32]) -> u128 {
    let mut h = twox_hash::XxHash3_128::new();
    for chunk in ids.chunks(4096) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|i| i.to_le_bytes()).collect();
        h.write(&bytes);
    }
    h.finish_128()
}

/// Refuse a name that is empty, longer than [`MAX_NAME_BYTES`], starts with a dot, or has a
/// byte outside `[A-Za-z0-9._-]` (names become file names in `--state-dir`).
pub fn check_name(name: &str) -> Result<(), SessionError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(SessionError::Name(name.to_string()))
    }
}

/// Writes a session front to back, hashing as it goes: [`SessionWriter::begin`] writes the header,
/// the ids and the meta; the caller writes exactly `state_len` bytes of state through
/// [`Write`]; [`SessionWriter::finish`] appends the checksum.
pub struct SessionWriter<W: Write> {
    w: W,
    hash: twox_hash::XxHash3_64,
    state_left: u64,
}

impl<W: Write> SessionWriter<W> {
    /// Write the header, `ids` and `meta`.
    pub fn begin(
        w: W,
        identity: u128,
        ids: &[u32],
        meta: &[u8],
        state_len: u64,
    ) -> std::io::Result<SessionWriter<W>> {
        let mut s = SessionWriter {
            w,
            hash: twox_hash::XxHash3_64::new(),
            state_left: 0,
        };
        let header = Header {
            identity,
            n_ids: ids.len() as u64,
            meta_len: meta.len() as u64,
            state_len,
        };
        s.put(&header.encode())?;
        for chunk in ids.chunks(4096) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|i| i.to_le_bytes()).collect();
            s.put(&bytes)?;
        }
        s.put(meta)?;
        s.state_left = state_len;
        Ok(s)
    }

    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.hash.write(b);
        self.w.write_all(b)
    }

    /// Append the checksum; fails if the state written is not `state_len` bytes.
    pub fn finish(mut self) -> std::io::Result<W> {
        if self.state_left != 0 {
            return Err(std::io::Error::other(format!(
                "session state is {} bytes short of its announced length",
                self.state_left
            )));
        }
        let sum = self.hash.finish();
        self.w.write_all(&sum.to_le_bytes())?;
        self.w.flush()?;
        Ok(self.w)
    }
}

impl<W: Write> Write for SessionWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() as u64 > self.state_left {
            return Err(std::io::Error::other(
                "session state longer than its announced length",
            ));
        }
        self.put(buf)?;
        self.state_left -= buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.w.flush()
    }
}

/// One session's bytes in shared memory that nobody can change, mapped read-only: checked once
/// and then shared (store ⇄ worker).
///
/// Two kinds ([`ShmKind`], `K3_SHM`): a sealed memfd (Linux), kept and forwarded without a copy;
/// or a POSIX shared-memory object (macOS; forced on Linux with `K3_SHM=posix`), which cannot be
/// sealed, so the receiver copies what it is handed into an object of its own before checking
/// it, and that object is unlinked at once and its writable descriptor and mapping dropped once
/// filled (nothing can write it afterwards: SPEC.md §6.6).
pub struct Blob {
    file: File,
    map: Option<Mmap>,
}

impl std::fmt::Debug for Blob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blob").field("len", &self.len()).finish()
    }
}

#[cfg(target_os = "linux")]
fn required_seals() -> nix::fcntl::SealFlag {
    use nix::fcntl::SealFlag;
    SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW
}

fn shm_kind() -> std::io::Result<ShmKind> {
    crate::shmem::shm_kind().map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
}

impl Blob {
    /// New shared memory of the kind `K3_SHM` selects, filled by `fill` (through a buffered
    /// writer), then sealed (or its writable views dropped) and mapped.
    pub fn create(
        name: &str,
        fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
    ) -> std::io::Result<Blob> {
        Blob::create_with(shm_kind()?, name, fill)
    }

    /// [`Blob::create`] of a given kind.
    pub fn create_with(
        kind: ShmKind,
        name: &str,
        fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
    ) -> std::io::Result<Blob> {
        match kind {
            ShmKind::Memfd => sealed_memfd(name, fill),
            ShmKind::Posix => {
                // A shm object cannot be written to (macOS) nor resized once sized: the bytes
                // are gathered first, then copied into an object of their length.
                let mut bytes = Vec::new();
                fill(&mut bytes)?;
                posix_blob(bytes.len() as u64, |dst| {
                    dst.copy_from_slice(&bytes);
                    Ok(())
                })
            }
        }
    }

    /// A blob from bytes (tests; loading a `--state-dir` file).
    pub fn from_bytes(name: &str, bytes: &[u8]) -> std::io::Result<Blob> {
        Blob::create(name, |w| w.write_all(bytes))
    }

    /// Take a descriptor received from a peer, holding `expected_len` bytes. With memfds it must
    /// be sealed against writing, shrinking and growing (else the peer could change it after it
    /// was checked); with POSIX shared memory its bytes are copied into a blob of this
    /// process's own (which nobody can write) and the peer's descriptor is closed.
    pub fn from_fd(fd: OwnedFd, expected_len: u64) -> std::io::Result<Blob> {
        Blob::from_fd_with(shm_kind()?, fd, expected_len)
    }

    /// [`Blob::from_fd`] of a given kind.
    pub fn from_fd_with(kind: ShmKind, fd: OwnedFd, expected_len: u64) -> std::io::Result<Blob> {
        match kind {
            ShmKind::Memfd => take_sealed(fd, expected_len),
            ShmKind::Posix => copy_in(fd, expected_len),
        }
    }

    /// Maps the first `len` bytes of `file` read-only.
    fn map(file: File, len: u64) -> std::io::Result<Blob> {
        let map = if len == 0 {
            None
        } else {
            let size = usize::try_from(len).map_err(std::io::Error::other)?;
            // SAFETY: nothing can change or shrink the bytes under this read-only mapping: a
            // memfd is sealed against writing, shrinking and growing (checked by `take_sealed`,
            // set by `sealed_memfd`); a POSIX object is this process's own, its name unlinked
            // and its writable descriptor and mapping gone (`posix_blob`).
            Some(unsafe { MmapOptions::new().len(size).map(&file)? })
        };
        Ok(Blob { file, map })
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.bytes().len() as u64
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.bytes().is_empty()
    }

    /// The descriptor, to pass to a peer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

/// A memfd filled by `fill`, sealed against writing and resizing, mapped.
#[cfg(target_os = "linux")]
fn sealed_memfd(
    name: &str,
    fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> std::io::Result<Blob> {
    let mut file = crate::shmem::memfd(name)?;
    {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, &mut file);
        fill(&mut w)?;
        w.flush()?;
    }
    nix::fcntl::fcntl(
        file.as_fd(),
        nix::fcntl::FcntlArg::F_ADD_SEALS(required_seals() | nix::fcntl::SealFlag::F_SEAL_SEAL),
    )?;
    let len = file.metadata()?.len();
    Blob::map(file, len)
}

#[cfg(not(target_os = "linux"))]
fn sealed_memfd(
    _name: &str,
    _fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> std::io::Result<Blob> {
    Err(no_memfd())
}

#[cfg(not(target_os = "linux"))]
fn no_memfd() -> std::io::Error {
    let e = ShmKind::parse("memfd").expect_err("no memfd here");
    std::io::Error::new(std::io::ErrorKind::InvalidInput, e)
}

/// A peer's memfd, accepted only sealed against writing, shrinking and growing and of the
/// announced length.
#[cfg(target_os = "linux")]
fn take_sealed(fd: OwnedFd, expected_len: u64) -> std::io::Result<Blob> {
    let seals = nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_GET_SEALS).map_err(|e| {
        std::io::Error::other(format!(
            "the descriptor is not a sealable memfd ({e}); a session travels as a sealed memfd"
        ))
    })?;
    let seals = nix::fcntl::SealFlag::from_bits_truncate(seals);
    if !seals.contains(required_seals()) {
        return Err(std::io::Error::other(
            "the session's memfd is not sealed against writing and resizing",
        ));
    }
    let file = File::from(fd);
    let len = file.metadata()?.len();
    if len != expected_len {
        return Err(std::io::Error::other(format!(
            "the session's memfd holds {len} bytes, {expected_len} were announced"
        )));
    }
    Blob::map(file, len)
}

#[cfg(not(target_os = "linux"))]
fn take_sealed(_fd: OwnedFd, _expected_len: u64) -> std::io::Result<Blob> {
    Err(no_memfd())
}

/// A POSIX shared-memory blob of `len` bytes written by `fill` through a mapping that is dropped
/// before the object's read-only descriptor is mapped: afterwards no descriptor or mapping that
/// can write it exists, and its name is gone.
fn posix_blob(
    len: u64,
    fill: impl FnOnce(&mut [u8]) -> std::io::Result<()>,
) -> std::io::Result<Blob> {
    let obj = PosixShm::create(len)?;
    if len > 0 {
        let size = usize::try_from(len).map_err(std::io::Error::other)?;
        // SAFETY: the object was just created under a fresh name (O_EXCL) and sized to `len`;
        // only this function writes it, and the mapping is dropped before anyone else can see
        // the object.
        let mut map = unsafe { MmapOptions::new().len(size).map_mut(&obj.rw)? };
        fill(&mut map)?;
    }
    let ro = obj.finish()?;
    Blob::map(ro, len)
}

/// A peer's descriptor copied into a blob of this process's own. A regular file (Linux's shm
/// objects are tmpfs files) is read with `pread`, so a peer that shrinks it mid-copy causes an
/// error, never a fault; anything else (macOS's shm objects, which refuse `read` and cannot
/// change size once sized) is mapped read-only and copied.
fn copy_in(fd: OwnedFd, expected_len: u64) -> std::io::Result<Blob> {
    use std::os::unix::fs::FileExt;
    let file = File::from(fd);
    let meta = file.metadata()?;
    if !crate::shmem::size_matches(meta.len(), expected_len) {
        return Err(std::io::Error::other(format!(
            "the session's shared memory holds {} bytes, {expected_len} were announced",
            meta.len()
        )));
    }
    if meta.file_type().is_file() {
        return posix_blob(expected_len, |dst| file.read_exact_at(dst, 0));
    }
    let size = usize::try_from(expected_len).map_err(std::io::Error::other)?;
    let peer = if size == 0 {
        None
    } else {
        // SAFETY: a read-only mapping of the peer's object, within its size (checked above),
        // which cannot shrink: macOS sizes a shm object only once. The peer may still change the
        // bytes while they are copied; only the copy is checked and used.
        Some(unsafe { MmapOptions::new().len(size).map(&file)? })
    };
    posix_blob(expected_len, |dst| {
        dst.copy_from_slice(peer.as_deref().unwrap_or(&[]));
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(identity: u128) -> Vec<u8> {
        let state: Vec<u8> = (0..100u8).collect();
        let mut w = SessionWriter::begin(Vec::new(), identity, &[1, 2, 300_000], b"{\"m\":1}", 100)
            .unwrap();
        w.write_all(&state[..40]).unwrap();
        w.write_all(&state[40..]).unwrap();
        w.finish().unwrap()
    }

    #[test]
    fn round_trip_and_every_check() {
        let b = sample(7);
        let v = parse(&b).unwrap();
        assert_eq!(v.header.identity, 7);
        assert_eq!(v.ids(), [1, 2, 300_000]);
        assert_eq!(v.ids_hash(), ids_hash(&[1, 2, 300_000]));
        assert_ne!(v.ids_hash(), ids_hash(&[1, 2]));
        assert_eq!(v.meta, b"{\"m\":1}");
        assert_eq!(v.state, (0..100u8).collect::<Vec<_>>());
        check_identity(&v, 7).unwrap();
        assert!(matches!(
            check_identity(&v, 8),
            Err(SessionError::Identity {
                found: 7,
                expected: 8
            })
        ));
        // Any flipped byte is caught: magic, version, lengths or checksum.
        for at in [0, 8, 20, 30, 70, 90, b.len() - 60, b.len() - 1] {
            let mut d = b.clone();
            d[at] ^= 0x10;
            assert!(parse(&d).is_err(), "byte {at} flipped");
        }
        let mut d = b.clone();
        d[100] ^= 1;
        assert!(matches!(parse(&d), Err(SessionError::Checksum { .. })));
        assert!(matches!(
            parse(&b[..b.len() - 1]),
            Err(SessionError::Length(_))
        ));
        let mut d = b.clone();
        d[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(parse(&d), Err(SessionError::Length(_))));
        let mut d = b.clone();
        d[8] = 1;
        assert_eq!(parse(&d).unwrap_err(), SessionError::Version(1));
        // The identity's high half counts: two identities that differ only there.
        let hi = sample(7 | (1 << 100));
        let v = parse(&hi).unwrap();
        assert_eq!(v.header.identity, 7 | (1 << 100));
        assert!(check_identity(&v, 7).is_err());
        assert_eq!(parse(b"nonsense").unwrap_err(), SessionError::Magic);
    }

    #[test]
    fn writer_holds_the_announced_state_length() {
        let w = SessionWriter::begin(Vec::new(), 1, &[], b"", 4).unwrap();
        assert!(w.finish().is_err(), "state short");
        let mut w = SessionWriter::begin(Vec::new(), 1, &[], b"", 4).unwrap();
        assert!(w.write_all(&[0; 5]).is_err(), "state long");
    }

    #[test]
    fn names() {
        for ok in ["s", "chat-1", "http-00ff.a_b", &"x".repeat(64)] {
            check_name(ok).unwrap();
        }
        for bad in ["", ".hidden", "a/b", "..", "a b", "é", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn blob_is_sealed_and_unsealed_descriptors_are_refused() {
        let m = ShmKind::Memfd;
        let bytes = sample(3);
        let blob = Blob::create_with(m, "k3-test-session", |w| w.write_all(&bytes)).unwrap();
        assert_eq!(blob.bytes(), &bytes[..]);
        // A peer's copy of the descriptor is accepted (sealed) and sees the same bytes.
        let fd = blob.fd().try_clone_to_owned().unwrap();
        let other = Blob::from_fd_with(m, fd, bytes.len() as u64).unwrap();
        assert_eq!(other.bytes(), &bytes[..]);
        // Writing through the descriptor is impossible.
        let mut f = File::from(blob.fd().try_clone_to_owned().unwrap());
        assert!(f.write_all(b"x").is_err());
        // A wrong announced size, an unsealed memfd and a regular file are refused.
        let fd = blob.fd().try_clone_to_owned().unwrap();
        assert!(Blob::from_fd_with(m, fd, 1).is_err());
        let unsealed = {
            use nix::sys::memfd::{memfd_create, MFdFlags};
            let fd = memfd_create(c"k3-test-unsealed", MFdFlags::MFD_ALLOW_SEALING).unwrap();
            let mut f = File::from(fd);
            f.write_all(&bytes).unwrap();
            OwnedFd::from(f)
        };
        let e = Blob::from_fd_with(m, unsealed, bytes.len() as u64).unwrap_err();
        assert!(e.to_string().contains("not sealed"), "{e}");
        let tmp = tempfile::tempfile().unwrap();
        let e = Blob::from_fd_with(m, OwnedFd::from(tmp), 0).unwrap_err();
        assert!(e.to_string().contains("sealable memfd"), "{e}");
    }

    /// The portable kind: a blob nobody can write; a peer's descriptor of any kind (a POSIX
    /// object, a regular file, an unsealed memfd) is COPIED, so changing the peer's bytes after
    /// the handover changes nothing the receiver checked; a wrong announced size is refused.
    #[test]
    fn posix_blobs_cannot_be_written_and_received_bytes_are_copied() {
        use std::os::unix::fs::FileExt;
        let p = ShmKind::Posix;
        let bytes = sample(4);
        let blob = Blob::create_with(p, "k3-test-session", |w| w.write_all(&bytes)).unwrap();
        assert_eq!(blob.bytes(), &bytes[..]);
        let mut f = File::from(blob.fd().try_clone_to_owned().unwrap());
        assert!(f.write_all(b"x").is_err(), "a blob's descriptor wrote");
        // SAFETY: test-only; expected to fail (the descriptor is read-only).
        assert!(unsafe { memmap2::MmapMut::map_mut(&f) }.is_err());
        let other = Blob::from_fd_with(
            p,
            blob.fd().try_clone_to_owned().unwrap(),
            bytes.len() as u64,
        )
        .unwrap();
        assert_eq!(other.bytes(), &bytes[..]);
        let fd = blob.fd().try_clone_to_owned().unwrap();
        let e = Blob::from_fd_with(p, fd, bytes.len() as u64 + 1).unwrap_err();
        assert!(e.to_string().contains("announced"), "{e}");
        // A writable file handed over, then changed: the receiver kept what it was given.
        let tmp = tempfile::tempfile().unwrap();
        tmp.write_all_at(&bytes, 0).unwrap();
        let fd = OwnedFd::from(tmp.try_clone().unwrap());
        let got = Blob::from_fd_with(p, fd, bytes.len() as u64).unwrap();
        tmp.write_all_at(b"changed", 0).unwrap();
        assert_eq!(
            got.bytes(),
            &bytes[..],
            "the receiver's bytes changed under it"
        );
        // Shrunk below the announced size: an error, not a fault.
        tmp.set_len(10).unwrap();
        let fd = OwnedFd::from(tmp.try_clone().unwrap());
        assert!(Blob::from_fd_with(p, fd, bytes.len() as u64).is_err());
        // Empty blobs travel too.
        let empty = Blob::create_with(p, "k3-test-empty", |_| Ok(())).unwrap();
        assert!(empty.is_empty());
        let fd = empty.fd().try_clone_to_owned().unwrap();
        assert!(Blob::from_fd_with(p, fd, 0).unwrap().is_empty());
    }
}
