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

fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// A directory in the path to the state directory (or the directory itself, `own`) that others
/// could change: not ours (or root's, above), or writable by group or others without the sticky
/// bit.
fn check_dir(p: &Path, own: bool) -> Result<(), String> {
    let m = std::fs::metadata(p).map_err(|e| format!("{}: {e}", p.display()))?;
    if !m.is_dir() {
        return Err(format!("{} is not a directory", p.display()));
    }
    let me = euid();
    let owner_ok = m.uid() == me || (!own && m.uid() == 0);
    if !owner_ok {
        return Err(format!(
            "{} belongs to uid {}, not to the store's uid {me}{}",
            p.display(),
            m.uid(),
            if own { "" } else { " or root" }
        ));
    }
    let mode = m.mode() & 0o7777;
    let sticky = mode & 0o1000 != 0;
    if mode & 0o022 != 0 && (own || !sticky) {
        return Err(format!(
            "{} has mode {mode:04o}: writable by {} (other users could replace the store's \
             sessions); chmod go-w it",
            p.display(),
            if mode & 0o002 != 0 {
                "others"
            } else {
                "its group"
            }
        ));
    }
    Ok(())
}

/// Open `path` for reading without following a symlink or blocking on a FIFO, and only if it is
/// a regular file of ours with one link and no group or other permission bits. Returns it and
/// its length.
pub fn open_private(path: &Path) -> Result<(File, u64), String> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => "a symbolic link (not followed)".to_string(),
            _ => e.to_string(),
        })?;
    let m = f.metadata().map_err(|e| e.to_string())?;
    if !m.file_type().is_file() {
        return Err("not a regular file (a FIFO, device or directory is never read)".into());
    }
    if m.uid() != euid() {
        return Err(format!("belongs to uid {}, not to the store's", m.uid()));
    }
    if m.nlink() != 1 {
        return Err(format!(
            "has {} links (a hard link to another file?)",
            m.nlink()
        ));
    }
    if m.mode() & 0o077 != 0 {
        return Err(format!(
            "mode {:04o}: readable or writable by others (the store writes 0600)",
            m.mode() & 0o7777
        ));
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
fn unpredictable(prefix: &str) -> Result<String, String> {
    let mut r = [0u8; 8];
    getrandom::fill(&mut r).map_err(|e| format!("no random bytes: {e}"))?;
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
    pub fn open(dir: &Path, identity: u128) -> Result<StateDir, String> {
        let io = |p: &Path, e: std::io::Error| format!("--state-dir {}: {e}", p.display());
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| io(dir, e))?;
        }
        let dir = dir.canonicalize().map_err(|e| io(dir, e))?;
        check_dir(&dir, true).map_err(|e| format!("--state-dir refused: {e}"))?;
        for up in dir.ancestors().skip(1) {
            check_dir(up, false)
                .map_err(|e| format!("--state-dir {} refused: {e}", dir.display()))?;
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
    fn bind(&self) -> Result<(), String> {
        let p = self.dir.join(MODEL_FILE);
        let ours = format!("{:032x}\n", self.identity);
        match open_private(&p) {
            Ok((mut f, len)) => {
                let mut text = String::new();
                Read::by_ref(&mut f)
                    .take(len.min(256))
                    .read_to_string(&mut text)
                    .map_err(|e| format!("{}: {e}", p.display()))?;
                if text != ours {
                    return Err(format!(
                        "--state-dir {} holds the sessions of model {}, but this store serves \
                         model {:032x}: use another --state-dir for this model (or empty this \
                         one)",
                        self.dir.display(),
                        text.trim(),
                        self.identity
                    ));
                }
                Ok(())
            }
            Err(_) if std::fs::symlink_metadata(&p).is_err() => self
                .write_atomic(MODEL_FILE, ours.as_bytes())
                .map_err(|e| format!("{}: {e}", p.display())),
            Err(e) => Err(format!("--state-dir refused: {}: {e}", p.display())),
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
    pub fn open_sealed<'a>(&self, name: &str, file: &'a [u8]) -> Result<&'a [u8], String> {
        if file.len() < TAG_BYTES {
            return Err("shorter than its MAC".into());
        }
        let (bytes, tag) = file.split_at(file.len() - TAG_BYTES);
        self.tag(name, bytes).verify_slice(tag).map_err(|_| {
            "MAC mismatch: not written by this store for this model and name, or edited since \
             (refused)"
                .to_string()
        })?;
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
fn load_or_create_key(dir: &Path) -> Result<[u8; KEY_BYTES], String> {
    let p = dir.join(KEY_FILE);
    let refuse = |m: String| format!("--state-dir refused: {}: {m}", p.display());
    if std::fs::symlink_metadata(&p).is_err() {
        let mut key = [0u8; KEY_BYTES];
        getrandom::fill(&mut key).map_err(|e| refuse(format!("no random bytes: {e}")))?;
        let mut f = create_private(&p).map_err(|e| refuse(e.to_string()))?;
        f.write_all(&key)
            .and_then(|()| f.sync_all())
            .map_err(|e| refuse(e.to_string()))?;
        return Ok(key);
    }
    let (mut f, len) = open_private(&p).map_err(refuse)?;
    if len != KEY_BYTES as u64 {
        return Err(refuse(format!("{len} bytes, a key is {KEY_BYTES}")));
    }
    let mut key = [0u8; KEY_BYTES];
    f.read_exact(&mut key).map_err(|e| refuse(e.to_string()))?;
    Ok(key)
}

/// Mode bits of `p` (tests and diagnostics).
pub fn mode_of(p: &Path) -> std::io::Result<u32> {
    Ok(std::fs::symlink_metadata(p)?.permissions().mode() & 0o7777)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn private_dir() -> tempfile::TempDir {
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
        assert!(s.open_sealed("a", &edited).unwrap_err().contains("MAC"));
        // Reopened: the same key (the file verifies); another model is refused naming both.
        let again = StateDir::open(&dir, 7).unwrap();
        assert_eq!(again.open_sealed("a", &file).unwrap(), b"bytes");
        let e = StateDir::open(&dir, 8).unwrap_err();
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
        let e = StateDir::open(&dir, 1).unwrap_err();
        assert!(
            e.contains("0777") && e.contains(&dir.display().to_string()),
            "{e}"
        );
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        // A key planted as a symlink, or made readable by others, is refused.
        let target = d.path().join("elsewhere");
        std::fs::write(&target, [0u8; KEY_BYTES]).unwrap();
        std::os::unix::fs::symlink(&target, dir.join(KEY_FILE)).unwrap();
        let e = StateDir::open(&dir, 1).unwrap_err();
        assert!(e.contains("symbolic link"), "{e}");
        std::fs::remove_file(dir.join(KEY_FILE)).unwrap();
        let s = StateDir::open(&dir, 1).unwrap();
        std::fs::set_permissions(dir.join(KEY_FILE), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        assert!(StateDir::open(&dir, 1).unwrap_err().contains("0644"));
        std::fs::set_permissions(dir.join(KEY_FILE), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        // A FIFO is not opened for reading (and the call does not hang).
        let fifo = dir.join("x.k3session");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(open_private(&fifo)
            .unwrap_err()
            .contains("not a regular file"));
        // A hard link to another file is not read.
        let linked = dir.join("y.k3session");
        std::fs::write(&target, b"x").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::hard_link(&target, &linked).unwrap();
        assert!(open_private(&linked).unwrap_err().contains("links"));
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
