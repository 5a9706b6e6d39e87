//! The store's kept conversations (docs/SPEC.md §6.6): named session blobs ([`crate::session`]),
//! bounded in bytes and in count, evicted least recently used, optionally mirrored in a
//! `--state-dir` so they survive a restart.
//!
//! A session is accepted only as a sealed memfd whose bytes parse as a session (checksum) made
//! for this store's checkpoint (model identity); the store then keeps that memfd itself (no copy)
//! and hands a duplicate of its descriptor to whichever worker fetches it. Storing or fetching a
//! session makes it the most recently used; storing one evicts the least recently used others
//! until the total fits `--session-mb` and the count `--max-sessions`.
//!
//! The state directory mirrors memory: a stored session is written there (a new 0600 temporary
//! file, fsync, rename, fsync of the directory), an evicted one is removed. The directory is
//! trusted only as far as [`super::statedir`] checks it (owner and modes, bound to one model, a
//! keyed MAC on every file, no link followed). At start every `*.k3session` file is read and
//! checked like a stored one; a file that fails (not a regular file of ours, its MAC, damaged,
//! another checkpoint, larger than the budget, a bad name) is skipped with a log line and left
//! untouched.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use k3_proto::wire::{ErrorCode, Response, SessionInfo, SessionStats};

use super::statedir::{open_private, StateDir, StateDirError, Untrusted, TAG_BYTES};
use crate::session::{self, Blob, SessionError};

/// Default `--session-mb`.
pub const DEFAULT_SESSION_MB: f64 = 2048.0;
/// Default `--max-sessions`.
pub const DEFAULT_MAX_SESSIONS: u32 = 64;
/// Largest `--max-sessions` (a `ListSessions` answer must fit one frame).
pub const MAX_SESSIONS_LIMIT: u32 = 4096;
/// File name suffix in the state directory.
pub const FILE_SUFFIX: &str = ".k3session";

/// Limits and persistence.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Bytes all sessions may take together (0: sessions are refused).
    pub budget_bytes: u64,
    /// Sessions kept at most.
    pub max_count: u32,
    /// Where sessions are mirrored (None: memory only).
    pub state_dir: Option<PathBuf>,
}

impl SessionOptions {
    /// No sessions at all (a server built without them).
    pub fn off() -> SessionOptions {
        SessionOptions {
            budget_bytes: 0,
            max_count: 0,
            state_dir: None,
        }
    }
}

struct Entry {
    blob: Arc<Blob>,
    n_ids: u64,
    ids_hash: u128,
    used: Instant,
    tick: u64,
}

#[derive(Default)]
struct Inner {
    map: HashMap<String, Entry>,
    tick: u64,
    bytes: u64,
    evicted: u64,
}

/// The store's sessions.
pub struct Sessions {
    opts: SessionOptions,
    identity: u128,
    inner: Mutex<Inner>,
    /// The checked state directory and its key (set by [`Sessions::load_state_dir`]).
    state: OnceLock<StateDir>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn err(code: ErrorCode, message: String) -> Response {
    Response::Error { code, message }
}

fn mb(b: u64) -> String {
    format!("{:.3} MB", b as f64 / 1e6)
}

/// What [`Sessions::load_state_dir`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Loaded {
    /// Sessions kept.
    pub loaded: usize,
    /// Files refused (each logged).
    pub skipped: usize,
}

impl Sessions {
    /// An empty table for a store serving the checkpoint of `identity`.
    pub fn new(opts: SessionOptions, identity: u128) -> Sessions {
        Sessions {
            opts,
            identity,
            inner: Mutex::new(Inner::default()),
            state: OnceLock::new(),
        }
    }

    fn file(&self, name: &str) -> Option<PathBuf> {
        (self.state.get()).map(|d| d.path().join(format!("{name}{FILE_SUFFIX}")))
    }

    /// Check `blob` as a session of this store; its ids' count and hash.
    fn check(&self, blob: &Blob) -> Result<(u64, u128), SessionError> {
        let view = session::parse(blob.bytes())?;
        session::check_identity(&view, self.identity)?;
        Ok((view.header.n_ids, view.ids_hash()))
    }

    /// Insert under the lock, evicting the least recently used others until the limits hold;
    /// their files are removed under the same lock (so a newer file of the same name is never
    /// removed by an older eviction). Returns the evicted names.
    fn insert(
        &self,
        g: &mut Inner,
        name: &str,
        blob: Arc<Blob>,
        n_ids: u64,
        ids_hash: u128,
    ) -> Vec<String> {
        g.tick += 1;
        let len = blob.len();
        if let Some(old) = g.map.insert(
            name.to_string(),
            Entry {
                blob,
                n_ids,
                ids_hash,
                used: Instant::now(),
                tick: g.tick,
            },
        ) {
            g.bytes -= old.blob.len();
        }
        g.bytes += len;
        let mut evicted = Vec::new();
        while g.bytes > self.opts.budget_bytes || g.map.len() > self.opts.max_count as usize {
            let victim = g
                .map
                .iter()
                .filter(|(n, _)| n.as_str() != name)
                .min_by_key(|(_, e)| e.tick)
                .map(|(n, _)| n.clone());
            let Some(victim) = victim else { break };
            let e = g.map.remove(&victim).expect("found above");
            g.bytes -= e.blob.len();
            g.evicted += 1;
            if let Some(f) = self.file(&victim) {
                if let Err(e) = std::fs::remove_file(&f) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!("session {victim}: evicted, but {} stays: {e}", f.display());
                    }
                }
            }
            evicted.push(victim);
        }
        evicted
    }

    /// `PutSession`: check and keep the session in `fd`.
    pub fn put(&self, name: &str, fd: Option<OwnedFd>, bytes: u64) -> Response {
        if let Err(m) = session::check_name(name) {
            return err(ErrorCode::BadRequest, m.to_string());
        }
        if self.opts.budget_bytes == 0 || self.opts.max_count == 0 {
            return err(
                ErrorCode::NotAllowed,
                "this store keeps no sessions (started with --session-mb 0 or --max-sessions 0)"
                    .into(),
            );
        }
        let Some(fd) = fd else {
            return err(
                ErrorCode::BadRequest,
                "PutSession arrived without the session's memfd".into(),
            );
        };
        if bytes > self.opts.budget_bytes {
            return err(
                ErrorCode::TooLarge,
                format!(
                    "session {name} is {}; this store keeps at most {} of sessions (raise k3-store start --session-mb)",
                    mb(bytes),
                    mb(self.opts.budget_bytes)
                ),
            );
        }
        let blob = match Blob::from_fd(fd, bytes) {
            Ok(b) => Arc::new(b),
            Err(e) => return err(ErrorCode::BadRequest, format!("session {name}: {e}")),
        };
        let (n_ids, ids_hash) = match self.check(&blob) {
            Ok(x) => x,
            Err(e) => {
                return err(
                    ErrorCode::BadRequest,
                    format!("session {name} refused: {e}"),
                )
            }
        };
        let evicted = {
            let mut g = lock(&self.inner);
            self.insert(&mut g, name, blob.clone(), n_ids, ids_hash)
        };
        if !evicted.is_empty() {
            tracing::info!(
                "sessions: evicted {} to keep {name} (least recently used first)",
                evicted.join(", ")
            );
        }
        if let (Some(state), Some(path)) = (self.state.get(), self.file(name)) {
            if let Err(e) = self.persist(state, name, &blob) {
                tracing::warn!(
                    "session {name}: kept in memory but not written to {}: {e}",
                    path.display()
                );
            }
        }
        Response::SessionStored { evicted }
    }

    /// Write `blob` and its MAC to its file atomically, unless `name` has been replaced or
    /// evicted meanwhile.
    fn persist(&self, state: &StateDir, name: &str, blob: &Arc<Blob>) -> std::io::Result<()> {
        let file = format!("{name}{FILE_SUFFIX}");
        let tag = state.seal(name, blob.bytes());
        let tmp = state.stage(&file, &[blob.bytes(), &tag])?;
        let g = lock(&self.inner);
        let current = g.map.get(name).is_some_and(|e| Arc::ptr_eq(&e.blob, blob));
        if !current {
            drop(g);
            return std::fs::remove_file(&tmp);
        }
        let installed = state.install(&tmp, &file);
        drop(g);
        installed
    }

    /// `GetSession`: the session (now the most recently used), if kept; a bad name is refused
    /// with the reason.
    pub fn get(&self, name: &str) -> Result<Option<Arc<Blob>>, SessionError> {
        session::check_name(name)?;
        let mut g = lock(&self.inner);
        g.tick += 1;
        let tick = g.tick;
        Ok(g.map.get_mut(name).map(|e| {
            e.tick = tick;
            e.used = Instant::now();
            e.blob.clone()
        }))
    }

    /// `ListSessions`: most recently used first.
    pub fn list(&self) -> Vec<SessionInfo> {
        let g = lock(&self.inner);
        let mut v: Vec<(&String, &Entry)> = g.map.iter().collect();
        v.sort_by_key(|(_, e)| std::cmp::Reverse(e.tick));
        v.into_iter()
            .map(|(n, e)| SessionInfo {
                name: n.clone(),
                ids: e.n_ids,
                ids_hash: e.ids_hash,
                bytes: e.blob.len(),
                idle_seconds: e.used.elapsed().as_secs_f64(),
            })
            .collect()
    }

    /// Figures for `k3-ctl stats`.
    pub fn stats(&self) -> SessionStats {
        let g = lock(&self.inner);
        SessionStats {
            count: g.map.len() as u32,
            bytes: g.bytes,
            budget_bytes: self.opts.budget_bytes,
            max_count: self.opts.max_count,
            evicted: g.evicted,
            state_dir: (self.opts.state_dir.as_ref())
                .map_or(String::new(), |d| d.display().to_string()),
        }
    }

    /// Check (or create, 0700) the state directory, its key and its model binding
    /// ([`StateDir::open`]: a refusal names the path, or both models), then load every
    /// `*.k3session` in it, oldest modification first (so the most recent are the most recently
    /// used); leftover temporary files of an interrupted write are removed. Fails only when the
    /// directory is refused or cannot be listed.
    pub fn load_state_dir(&self) -> Result<Loaded, StateDirError> {
        let Some(dir) = self.opts.state_dir.clone() else {
            return Ok(Loaded::default());
        };
        let state = StateDir::open(&dir, self.identity)?;
        let dir = state.path().to_path_buf();
        let io = |source: std::io::Error| StateDirError::Io {
            path: dir.clone(),
            source,
        };
        let mut files = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            let fname = entry.file_name().to_string_lossy().into_owned();
            if fname.starts_with('.') && fname.ends_with(".tmp") {
                let _ = std::fs::remove_file(entry.path());
                continue;
            }
            let Some(name) = fname.strip_suffix(FILE_SUFFIX) else {
                continue;
            };
            // Not followed if a link: the file itself is checked when opened.
            let meta = entry.metadata().map_err(io)?;
            let mtime = meta.modified().ok();
            files.push((mtime, name.to_string(), entry.path()));
        }
        files.sort();
        let _ = self.state.set(state);
        let state = self.state.get().expect("just set");
        let mut out = Loaded::default();
        for (_, name, path) in files {
            match self.load_one(state, &name, &path) {
                Ok(()) => out.loaded += 1,
                Err(e) => {
                    tracing::warn!("sessions: skipping {}: {e}", path.display());
                    out.skipped += 1;
                }
            }
        }
        let s = self.stats();
        tracing::info!(
            "sessions: {} kept from {} ({}), {} file(s) skipped",
            s.count,
            dir.display(),
            mb(s.bytes),
            out.skipped
        );
        Ok(out)
    }

    fn load_one(
        &self,
        state: &StateDir,
        name: &str,
        path: &std::path::Path,
    ) -> Result<(), SkipError> {
        session::check_name(name)?;
        let (f, len) = open_private(path)?;
        let len = len.saturating_sub(TAG_BYTES as u64);
        if len > self.opts.budget_bytes {
            return Err(SkipError::OverBudget {
                bytes: len,
                budget: self.opts.budget_bytes,
            });
        }
        let mut file = Vec::new();
        (f.take(len + TAG_BYTES as u64 + 1))
            .read_to_end(&mut file)
            .map_err(Untrusted::Io)?;
        if file.len() as u64 != len + TAG_BYTES as u64 {
            return Err(SkipError::Changed);
        }
        let bytes = state.open_sealed(name, &file)?;
        let blob = Blob::from_bytes(&format!("k3-session-{name}"), bytes).map_err(Untrusted::Io)?;
        drop(file);
        let (n_ids, ids_hash) = self.check(&blob)?;
        let evicted = {
            let mut g = lock(&self.inner);
            self.insert(&mut g, name, Arc::new(blob), n_ids, ids_hash)
        };
        if !evicted.is_empty() {
            tracing::info!(
                "sessions: evicted {} (over the limits at start)",
                evicted.join(", ")
            );
        }
        Ok(())
    }
}

use std::io::Read as _;

/// Why a file of the state directory was skipped at start (logged, never fatal).
#[derive(Debug, thiserror::Error)]
enum SkipError {
    /// Its name is not a session name, or its contents not a session of this store.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// It is not a file of ours, or its MAC does not verify.
    #[error(transparent)]
    Untrusted(#[from] Untrusted),
    /// It is larger than the whole budget.
    #[error("{} exceeds the session budget of {} (--session-mb)", mb(*.bytes), mb(*.budget))]
    OverBudget {
        /// Its session bytes.
        bytes: u64,
        /// `--session-mb`.
        budget: u64,
    },
    /// Its length changed while it was read.
    #[error("changed while reading")]
    Changed,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::SessionWriter;
    use std::io::Write;
    use std::os::fd::AsFd;

    fn blob(identity: u128, ids: &[u32], state: usize) -> Blob {
        Blob::create("k3-test", |w| {
            let mut s = SessionWriter::begin(w, identity, ids, b"", state as u64)?;
            s.write_all(&vec![7u8; state])?;
            s.finish()?;
            Ok(())
        })
        .unwrap()
    }

    fn put(s: &Sessions, name: &str, b: &Blob) -> Response {
        let fd = b.fd().try_clone_to_owned().unwrap();
        s.put(name, Some(fd), b.len())
    }

    fn names(s: &Sessions) -> Vec<String> {
        s.list().into_iter().map(|i| i.name).collect()
    }

    #[test]
    fn lru_by_bytes_and_count_and_identity_checks() {
        let one = blob(5, &[1, 2, 3], 1000).len();
        let s = Sessions::new(
            SessionOptions {
                budget_bytes: 3 * one,
                max_count: 2,
                state_dir: None,
            },
            5,
        );
        assert_eq!(
            put(&s, "a", &blob(5, &[1, 2, 3], 1000)),
            Response::SessionStored { evicted: vec![] }
        );
        assert!(matches!(
            put(&s, "b", &blob(5, &[1, 2, 4], 1000)),
            Response::SessionStored { .. }
        ));
        // Fetching a makes b the least recently used: the count limit evicts b.
        assert!(s.get("a").unwrap().is_some());
        assert_eq!(
            put(&s, "c", &blob(5, &[9], 1000)),
            Response::SessionStored {
                evicted: vec!["b".into()]
            }
        );
        assert_eq!(names(&s), ["c", "a"]);
        // The byte limit: one session of twice the size leaves room for itself and one other.
        let big = blob(5, &[1], 2 * one as usize);
        assert!(big.len() > 2 * one);
        match put(&s, "d", &big) {
            Response::SessionStored { evicted } => assert_eq!(evicted, ["a", "c"]),
            other => panic!("{other:?}"),
        }
        let st = s.stats();
        assert_eq!((st.count, st.bytes, st.evicted), (1, big.len(), 3));
        // Replacing keeps the count and accounts the new size.
        assert!(matches!(
            put(&s, "d", &blob(5, &[1], 10)),
            Response::SessionStored { .. }
        ));
        assert!(s.stats().bytes < one);
        // Another checkpoint, a damaged blob, a missing fd, a bad name, too large: refused.
        match put(&s, "x", &blob(6, &[1], 10)) {
            Response::Error { code, message } => {
                assert_eq!(code, ErrorCode::BadRequest);
                assert!(message.contains("model identity"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let mut bytes = blob(5, &[1], 10).bytes().to_vec();
        bytes[70] ^= 1;
        match put(&s, "x", &Blob::from_bytes("t", &bytes).unwrap()) {
            Response::Error { message, .. } => assert!(message.contains("checksum"), "{message}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(s.put("x", None, 10), Response::Error { .. }));
        assert!(matches!(
            put(&s, "../x", &blob(5, &[1], 10)),
            Response::Error { .. }
        ));
        assert!(matches!(
            put(&s, "x", &blob(5, &[1], 4 * one as usize)),
            Response::Error {
                code: ErrorCode::TooLarge,
                ..
            }
        ));
        assert_eq!(names(&s), ["d"]);
        assert!(s.get("nope").unwrap().is_none());
        // The list's hash is the ids' hash.
        assert_eq!(s.list()[0].ids_hash, session::ids_hash(&[1]));
        let _ = big.fd().as_fd();
    }

    #[test]
    fn state_dir_mirrors_memory_and_skips_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        let sd = dir.path().join("state");
        let opts = SessionOptions {
            budget_bytes: 1 << 20,
            max_count: 2,
            state_dir: Some(sd.clone()),
        };
        let s = Sessions::new(opts.clone(), 5);
        assert_eq!(s.load_state_dir().unwrap(), Loaded::default());
        for n in ["a", "b", "c"] {
            assert!(matches!(
                put(&s, n, &blob(5, &[1, 2], 100)),
                Response::SessionStored { .. }
            ));
        }
        let mut files: Vec<String> = std::fs::read_dir(&sd)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|f| !f.starts_with('.'))
            .collect();
        files.sort();
        assert_eq!(files, ["b.k3session", "c.k3session"], "a was evicted");
        assert_eq!(
            super::super::statedir::mode_of(&sd.join("b.k3session")).unwrap(),
            0o600
        );
        // A restart reloads both; damaged, foreign and forged files are skipped, not loaded.
        let write_private = |name: &str, bytes: &[u8]| {
            use std::os::unix::fs::PermissionsExt;
            let p = sd.join(name);
            std::fs::write(&p, bytes).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        };
        let mut bad = std::fs::read(sd.join("b.k3session")).unwrap();
        bad[80] ^= 1;
        write_private("bad.k3session", &bad);
        write_private("foreign.k3session", blob(9, &[1], 10).bytes());
        // Forged: another state under b's valid header, checksum recomputed; and b's own file
        // copied under another name (the MAC covers the name).
        let good = std::fs::read(sd.join("b.k3session")).unwrap();
        let forged = blob(5, &[1, 2], 100);
        let mut f = forged.bytes().to_vec();
        let body = f.len() - 8;
        f[body - 1] ^= 0x55;
        let sum = twox_hash::XxHash3_64::oneshot(&f[..body]);
        f[body..].copy_from_slice(&sum.to_le_bytes());
        assert!(
            session::parse(&f).is_ok(),
            "the forgery passes the checksum"
        );
        f.extend_from_slice(&good[good.len() - TAG_BYTES..]);
        write_private("forged.k3session", &f);
        write_private("renamed.k3session", &good);
        std::fs::write(sd.join(".x.1.2.tmp"), b"partial").unwrap();
        let s2 = Sessions::new(
            SessionOptions {
                max_count: 8,
                ..opts.clone()
            },
            5,
        );
        assert_eq!(
            s2.load_state_dir().unwrap(),
            Loaded {
                loaded: 2,
                skipped: 4
            }
        );
        let mut got = names(&s2);
        got.sort();
        assert_eq!(got, ["b", "c"]);
        assert_eq!(
            s2.get("c").unwrap().unwrap().bytes(),
            blob(5, &[1, 2], 100).bytes()
        );
        assert!(
            !sd.join(".x.1.2.tmp").exists(),
            "leftover temporary removed"
        );
        assert!(
            sd.join("bad.k3session").exists(),
            "skipped files are left alone"
        );
        // Another model's store is refused at the directory, naming both identities.
        let e = Sessions::new(opts, 6)
            .load_state_dir()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("{:032x}", 5u128)) && e.contains(&format!("{:032x}", 6u128)),
            "{e}"
        );
    }
}
