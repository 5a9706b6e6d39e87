//! The `--state-dir` the store keeps sessions in, trusted only as far as it can be (SPEC.md §6.6,
//! docs/RELIABILITY.md): the checks of OpenSSH's `StrictModes`, files opened without following
//! links, and every file authenticated with a keyed MAC.
//!
//! - **The directory** is created 0700 when missing. An existing one — and every directory
//!   above it — must belong to the store's uid (or root, for the ones above), and must not be
//!   writable by group or others unless the sticky bit is set (as on `/tmp`); otherwise the
//!   start is refused naming the path ([`StateDir::open`]).
//! - **The key** `DIR/.k3-state-key`: 32 random bytes, created with `O_EXCL|O_NOFOLLOW`, mode
//!   0600; an existing key must be a regular file of ours, 0600, one link, 32 bytes.
//! - **The binding** `DIR/.k3-state-model`: the content identity of the model the directory's
//!   sessions were made for (SPEC.md §6.11). A store of another model is refused (exit 2, both
//!   identities named): a state directory belongs to one model.
//! - **Session files** `DIR/NAME.k3session` are the session's bytes followed by a 32-byte
//!   HMAC-SHA256 under the key over the domain `k3-state/1`, the model identity, the name and
//!   the bytes ([`StateDir::seal`]): a file made elsewhere (another key, another model, another
//!   name) or edited — even with its checksum recomputed — is refused. They are written 0600
//!   to a new temporary file (`O_CREAT|O_EXCL|O_NOFOLLOW`, a name no one can predict), fsynced
//!   and renamed into place (a symlink planted at the final name is replaced, never followed),
//!   and read with `O_NOFOLLOW|O_NONBLOCK`: only a regular file of ours with one link is read
//!   (a FIFO or a device in its place cannot hang the start).

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The key file's name in the state directory.
pub const KEY_FILE: &str = ".k3-state-key";
/// The model binding's name in the state directory.
pub const MODEL_FILE: &str = ".k3-state-model";
/// Bytes of the key.
pub const KEY_BYTES: usize = 32;
/// Bytes of the MAC appended to every session file.
pub const TAG_BYTES: usize = 32;

/// A state directory whose owner and modes were checked, with its key.
pub struct StateDir {
    dir: PathBuf,
    key: [u8; KEY_BYTES],
    identity: u128,
}

impl std::fmt::Debug for StateDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateDir").field("dir", &self.dir).finish()
    }
}

/// Why a file or directory of the state directory is not trusted (or not readable).
#[derive(Debug, thiserror::Error)]
pub enum Untrusted {
    /// Its metadata cannot be read.
    #[error("{}: {source}", path.display())]
    Stat {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not a directory.
    #[error("{} is not a directory", path.display())]
    NotDir {
        /// The path.
        path: PathBuf,
    },
    /// A directory of another user.
    #[error("{} belongs to uid {uid}, not to the store's uid {me}{}", path.display(),
        if *own { "" } else { " or root" })]
    DirOwner {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        uid: u32,
        /// The store's uid.
        me: u32,
        /// The state directory itself (root is not trusted there).
        own: bool,
    },
    /// A directory others may write.
    #[error("{} has mode {mode:04o}: writable by {} (other users could replace the store's \
             sessions); chmod go-w it", path.display(),
        if mode & 0o002 != 0 { "others" } else { "its group" })]
    Writable {
        /// The directory.
        path: PathBuf,
        /// Its mode bits.
        mode: u32,
    },
    /// A symbolic link where a file was expected.
    #[error("a symbolic link (not followed)")]
    Symlink,
    /// The file cannot be opened or read.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A FIFO, device or directory.
    #[error("not a regular file (a FIFO, device or directory is never read)")]
    NotRegular,
    /// A file of another user.
    #[error("belongs to uid {0}, not to the store's")]
    FileOwner(u32),
    /// More than one link.
    #[error("has {0} links (a hard link to another file?)")]
    Links(u64),
    /// Readable or writable by others.
    #[error("mode {0:04o}: readable or writable by others (the store writes 0600)")]
    Mode(u32),
    /// A key of the wrong length.
    #[error("{0} bytes, a key is {KEY_BYTES}")]
    KeyLength(u64),
    /// No random bytes for a key or a file name.
    #[error("no random bytes: {0}")]
    Random(getrandom::Error),
    /// A sealed file shorter than its MAC.
    #[error("shorter than its MAC")]
    Short,
    /// A sealed file whose MAC does not verify.
    #[error(
        "MAC mismatch: not written by this store for this model and name, or edited since \
         (refused)"
    )]
    Mac,
}

/// Why the state directory was refused (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum StateDirError {
    /// It cannot be created or resolved.
    #[error("--state-dir {}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// It (or a directory above it, or one of its own files) is not trusted.
    #[error("--state-dir refused: {0}")]
    Refused(Untrusted),
    /// A directory above it is not trusted.
    #[error("--state-dir {} refused: {problem}", dir.display())]
    Above {
        /// The state directory.
        dir: PathBuf,
        /// What is wrong above it.
        problem: Untrusted,
    },
    /// One of its own files is not trusted.
    #[error("--state-dir refused: {}: {problem}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: Untrusted,
    },
    /// The model binding cannot be read or written.
    #[error("{}: {source}", path.display())]
    Binding {
        /// The binding file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// It holds another model's sessions.
    #[error("--state-dir {} holds the sessions of model {found}, but this store serves \
             model {ours:032x}: use another --state-dir for this model (or empty this one)",
        dir.display())]
    OtherModel {
        /// The state directory.
        dir: PathBuf,
        /// The identity its binding names.
        found: String,
        /// This store's identity.
        ours: u128,
    },
}

fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// A directory in the path to the state directory (or the directory itself, `own`) that others
/// could change: not ours (or root's, above), or writable by group or others without the sticky
/// bit.
fn check_dir(p: &Path, own: bool) -> Result<(), Untrusted> {
    let path = || p.to_path_buf();
    let m = std::fs::metadata(p).map_err(|source| Untrusted::Stat {
        path: path(),
        source,
    })?;
    if !m.is_dir() {
        return Err(Untrusted::NotDir { path: path() });
    }
    let me = euid();
    let owner_ok = m.uid() == me || (!own && m.uid() == 0);
    if !owner_ok {
        return Err(Untrusted::DirOwner {
            path: path(),
            uid: m.uid(),
            me,
            own,
        });
    }
    let mode = m.mode() & 0o7777;
    let sticky = mode & 0o1000 != 0;
    if mode & 0o022 != 0 && (own || !sticky) {
        return Err(Untrusted::Writable { path: path(), mode });
    }
    Ok(())
}

/// Open `path` for reading without following a symlink or blocking on a FIFO, and only if it is
/// a regular file of ours with one link and no group or other permission bits. Returns it and
/// its length.
pub fn open_private(path: &Path) -> Result<(File, u64), Untrusted> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => Untrusted::Symlink,
            _ => Untrusted::Io(e),
        })?;
    let m = f.metadata()?;
    if !m.file_type().is_file() {
        return Err(Untrusted::NotRegular);
    }
    if m.uid() != euid() {
        return Err(Untrusted::FileOwner(m.uid()));
    }
    if m.nlink() != 1 {
        return Err(Untrusted::Links(m.nlink()));
    }
    if m.mode() & 0o077 != 0 {
        return Err(Untrusted::Mode(m.mode() & 0o7777));
    }
    Ok((f, m.len()))
}

/// Create `path` new (never an existing file, never through a symlink), 0600.
fn create_private(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// A name for a temporary file no other user can predict.
fn unpredictable(prefix: &str) -> Result<String, Untrusted> {
    let mut r = [0u8; 8];
    getrandom::fill(&mut r).map_err(Untrusted::Random)?;
    Ok(format!(
        ".{prefix}.{}.{:016x}.tmp",
        std::process::id(),
        u64::from_le_bytes(r)
    ))
}

impl StateDir {
    /// Check (or create, 0700) `dir` and the directories above it, load or create the key, and
    /// bind the directory to the model of `identity` (refusing one bound to another). Every
    /// failure is a refusal naming the path.
    pub fn open(dir: &Path, identity: u128) -> Result<StateDir, StateDirError> {
        let io = |p: &Path, source: std::io::Error| StateDirError::Io {
            path: p.to_path_buf(),
            source,
        };
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| io(dir, e))?;
        }
        let dir = dir.canonicalize().map_err(|e| io(dir, e))?;
        check_dir(&dir, true).map_err(StateDirError::Refused)?;
        for up in dir.ancestors().skip(1) {
            check_dir(up, false).map_err(|problem| StateDirError::Above {
                dir: dir.clone(),
                problem,
            })?;
        }
        let key = load_or_create_key(&dir)?;
        let sd = StateDir { dir, key, identity };
        sd.bind()?;
        Ok(sd)
    }

    /// The directory (canonical).
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Refuse a directory bound to another model; bind an unbound one to ours.
    fn bind(&self) -> Result<(), StateDirError> {
        let p = self.dir.join(MODEL_FILE);
        let ours = format!("{:032x}\n", self.identity);
        match open_private(&p) {
            Ok((mut f, len)) => {
                let mut text = String::new();
                Read::by_ref(&mut f)
                    .take(len.min(256))
                    .read_to_string(&mut text)
                    .map_err(|source| StateDirError::Binding {
                        path: p.clone(),
                        source,
                    })?;
                if text != ours {
                    return Err(StateDirError::OtherModel {
                        dir: self.dir.clone(),
                        found: text.trim().to_string(),
                        ours: self.identity,
                    });
                }
                Ok(())
            }
            Err(_) if std::fs::symlink_metadata(&p).is_err() => self
                .write_atomic(MODEL_FILE, ours.as_bytes())
                .map_err(|source| StateDirError::Binding { path: p, source }),
            Err(problem) => Err(StateDirError::File { path: p, problem }),
        }
    }

    /// The MAC of a session of `name` with `bytes`.
    fn tag(&self, name: &str, bytes: &[u8]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.key).expect("any key length");
        m.update(b"k3-state/1\0");
        m.update(&self.identity.to_le_bytes());
        m.update(&(name.len() as u64).to_le_bytes());
        m.update(name.as_bytes());
        m.update(bytes);
        m
    }

    /// The file of session `name`: its bytes and their MAC.
    pub fn seal(&self, name: &str, bytes: &[u8]) -> [u8; TAG_BYTES] {
        self.tag(name, bytes).finalize().into_bytes().into()
    }

    /// The session bytes of a file of session `name` (its bytes and MAC), if the MAC holds.
    pub fn open_sealed<'a>(&self, name: &str, file: &'a [u8]) -> Result<&'a [u8], Untrusted> {
        if file.len() < TAG_BYTES {
            return Err(Untrusted::Short);
        }
        let (bytes, tag) = file.split_at(file.len() - TAG_BYTES);
        (self.tag(name, bytes).verify_slice(tag)).map_err(|_| Untrusted::Mac)?;
        Ok(bytes)
    }

    /// Write `data` to `DIR/name` atomically: [`StateDir::stage`] then [`StateDir::install`].
    pub fn write_atomic(&self, name: &str, data: &[u8]) -> std::io::Result<()> {
        let tmp = self.stage(name, &[data])?;
        self.install(&tmp, name)
    }

    /// The concatenation of `parts` in a new 0600 temporary file beside `DIR/name` (exclusive,
    /// no symlink followed, an unpredictable name), fsynced; removed again on failure.
    pub fn stage(&self, name: &str, parts: &[&[u8]]) -> std::io::Result<PathBuf> {
        let tmp = self
            .dir
            .join(unpredictable(name).map_err(std::io::Error::other)?);
        let written = (|| {
            let mut f = create_private(&tmp)?;
            for p in parts {
                f.write_all(p)?;
            }
            f.sync_all()
        })();
        match written {
            Ok(()) => Ok(tmp),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Rename a staged file to `DIR/name` (replacing whatever is there, a symlink included,
    /// without following it) and fsync the directory.
    pub fn install(&self, tmp: &Path, name: &str) -> std::io::Result<()> {
        if let Err(e) = std::fs::rename(tmp, self.dir.join(name)) {
            let _ = std::fs::remove_file(tmp);
            return Err(e);
        }
        File::open(&self.dir)?.sync_all()
    }
}

/// The key in `dir`, created (32 random bytes, 0600, exclusively) when missing.
fn load_or_create_key(dir: &Path) -> Result<[u8; KEY_BYTES], StateDirError> {
    let p = dir.join(KEY_FILE);
    let refuse = |problem: Untrusted| StateDirError::File {
        path: p.clone(),
        problem,
    };
    let io = |e: std::io::Error| refuse(Untrusted::Io(e));
    if std::fs::symlink_metadata(&p).is_err() {
        let mut key = [0u8; KEY_BYTES];
        getrandom::fill(&mut key).map_err(|e| refuse(Untrusted::Random(e)))?;
        let mut f = create_private(&p).map_err(io)?;
        f.write_all(&key).and_then(|()| f.sync_all()).map_err(io)?;
        return Ok(key);
    }
    let (mut f, len) = open_private(&p).map_err(refuse)?;
    if len != KEY_BYTES as u64 {
        return Err(refuse(Untrusted::KeyLength(len)));
    }
    let mut key = [0u8; KEY_BYTES];
    f.read_exact(&mut key).map_err(io)?;
    Ok(key)
}

/// Mode bits of `p` (tests and diagnostics).
pub fn mode_of(p: &Path) -> std::io::Result<u32> {
    Ok(std::fs::symlink_metadata(p)?.permissions().mode() & 0o7777)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A new temporary directory, 0700 (a state directory may be made inside it).
    pub(crate) fn private_dir() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        d
    }

    #[test]
    fn key_binding_and_mac() {
        let d = private_dir();
        let dir = d.path().join("state");
        let s = StateDir::open(&dir, 7).unwrap();
        assert_eq!(mode_of(&dir).unwrap(), 0o700);
        assert_eq!(mode_of(&dir.join(KEY_FILE)).unwrap(), 0o600);
        assert_eq!(mode_of(&dir.join(MODEL_FILE)).unwrap(), 0o600);
        let tag = s.seal("a", b"bytes");
        let mut file = b"bytes".to_vec();
        file.extend_from_slice(&tag);
        assert_eq!(s.open_sealed("a", &file).unwrap(), b"bytes");
        // Another name, another byte, another model, another key: refused.
        assert!(s.open_sealed("b", &file).is_err());
        let mut edited = file.clone();
        edited[0] ^= 1;
        let e = s.open_sealed("a", &edited).unwrap_err().to_string();
        assert!(e.contains("MAC"), "{e}");
        // Reopened: the same key (the file verifies); another model is refused naming both.
        let again = StateDir::open(&dir, 7).unwrap();
        assert_eq!(again.open_sealed("a", &file).unwrap(), b"bytes");
        let e = StateDir::open(&dir, 8).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{:032x}", 7u128)) && e.contains(&format!("{:032x}", 8u128)),
            "{e}"
        );
        // A key elsewhere does not verify this file.
        let other = StateDir::open(&d.path().join("other"), 7).unwrap();
        assert!(other.open_sealed("a", &file).is_err());
    }

    #[test]
    fn modes_owners_links_and_fifos_are_refused() {
        let d = private_dir();
        let dir = d.path().join("state");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = StateDir::open(&dir, 1).unwrap_err().to_string();
        assert!(
            e.contains("0777") && e.contains(&dir.display().to_string()),
            "{e}"
        );
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        // A key planted as a symlink, or made readable by others, is refused.
        let target = d.path().join("elsewhere");
        std::fs::write(&target, [0u8; KEY_BYTES]).unwrap();
        std::os::unix::fs::symlink(&target, dir.join(KEY_FILE)).unwrap();
        let e = StateDir::open(&dir, 1).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        std::fs::remove_file(dir.join(KEY_FILE)).unwrap();
        let s = StateDir::open(&dir, 1).unwrap();
        std::fs::set_permissions(dir.join(KEY_FILE), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        let e = StateDir::open(&dir, 1).unwrap_err().to_string();
        assert!(e.contains("0644"), "{e}");
        std::fs::set_permissions(dir.join(KEY_FILE), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        // A FIFO is not opened for reading (and the call does not hang).
        let fifo = dir.join("x.k3session");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let e = open_private(&fifo).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        // A hard link to another file is not read.
        let linked = dir.join("y.k3session");
        std::fs::write(&target, b"x").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::hard_link(&target, &linked).unwrap();
        let e = open_private(&linked).unwrap_err().to_string();
        assert!(e.contains("links"), "{e}");
        // Atomic writes are 0600 and replace a planted symlink instead of following it.
        std::os::unix::fs::symlink(&target, dir.join("z.k3session")).unwrap();
        s.write_atomic("z.k3session", b"new").unwrap();
        assert_eq!(
            std::fs::read(&target).unwrap(),
            b"x",
            "the link was followed"
        );
        assert_eq!(std::fs::read(dir.join("z.k3session")).unwrap(), b"new");
        assert_eq!(mode_of(&dir.join("z.k3session")).unwrap(), 0o600);
    }
}
