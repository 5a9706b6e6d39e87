//! The store's expert usage history (docs/SPEC.md §6.6): how often workers asked for each routed
//! expert, kept across restarts in `--state-dir`, so that a store that starts again fills its
//! expert cache with the experts its users' work calls most (`--preload hot`, and `auto` when
//! the cache cannot hold every expert; SPEC.md §6.3).
//!
//! - **What counts**: each distinct expert named by a worker's `Experts` request (a demand: the
//!   worker computes with it), once per request, whether it was a hit, a miss or answered
//!   privately. Never a prefetch (a prediction), a preload, nor a draft model's
//!   `ResidentExperts` (which only uses what is resident). A prefill chunk's request names the
//!   union of its tokens' experts, so each expert counts once per chunk and once per decoded
//!   token: how often it is needed, which is what residence saves.
//! - **Decay**: every [`HALF_LIFE_PER_EXPERT`] × (layers × experts) counted requests, every
//!   count is halved (integer, rounding down). Without it, months of one kind of work would
//!   outweigh a new kind for as long again; with it the history follows the work: at full scale
//!   (93 × 896) the half-life is 21.3 M requests, about 14,500 decoded tokens (1,472 requests
//!   each) or 258 prompt chunks that route to every expert. It is counted in requests, not in wall time, so
//!   an idle store forgets nothing and the result does not depend on timing. It also bounds
//!   every count below 2 × the half-life (a `u32` for up to [`MAX_GRID`] experts).
//! - **Bounded**: one file, `DIR/expert-usage.k3usage`, of exactly 64 + 4 × layers × experts +
//!   32 bytes (333 KB for Kimi K3's 93 layers × 896), known from the checkpoint before it is read.
//! - **Crash-safe**: saved every `--usage-save-seconds` (default 5) when something was counted,
//!   and at a clean stop, through [`StateDir::stage`] and [`StateDir::install`] (a new 0600
//!   file, fsync, rename, fsync of the directory): a `kill -9` at any moment leaves the previous
//!   file or the new one, never a torn one, and loses at most the counting since the last save
//!   that completed (one period and the save in progress).
//! - **Authenticated**: the file ends with the state directory's HMAC-SHA256
//!   ([`StateDir::seal`], name `expert-usage`); its header names the model identity and the
//!   checkpoint's layers and experts. A file that is not a regular file of ours, of another
//!   length, another format, another model or grid, or whose MAC does not verify (another key,
//!   edited, damaged) is refused like a refused session: a log line, and the store starts with
//!   a new history, which replaces the file at its first save (as a session stored under a
//!   refused file's name replaces it).

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use k3_proto::wire::UsageStats;

use super::statedir::{open_private, StateDir, StateDirError, Untrusted, TAG_BYTES};
use crate::runtime::catalog::Catalog;
use crate::runtime::experts::{Preload, PreloadRefused, PreloadSet};

/// The usage file's name in the state directory.
pub const FILE_NAME: &str = "expert-usage.k3usage";
/// The name the file's MAC covers ([`StateDir::seal`]).
const MAC_NAME: &str = "expert-usage";
/// The file's first bytes.
pub const MAGIC: &[u8; 8] = b"K3USAGE\0";
/// The file format's version.
pub const VERSION: u32 = 1;
/// Bytes of the header before the counts.
pub const HEADER_BYTES: usize = 64;
/// Most (layer, expert) pairs a usage history holds (16 MiB of counts): bounds the file.
pub const MAX_GRID: u64 = 1 << 22;
/// Counts are halved every this many counted requests per (layer, expert) of the grid.
pub const HALF_LIFE_PER_EXPERT: u64 = 256;
/// Default `--usage-save-seconds`.
pub const DEFAULT_SAVE_SECONDS: f64 = 5.0;

/// Per-expert demand counts with their decay (the file's contents, without I/O).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageCounts {
    n_layers: usize,
    n_experts: usize,
    counts: Vec<u32>,
    half_life: u64,
    since_halving: u64,
    total: u64,
}

/// Why a usage file was refused.
#[derive(Debug, thiserror::Error)]
pub enum UsageFileError {
    /// Not a regular file of ours, unreadable, or its MAC does not verify.
    #[error(transparent)]
    Untrusted(#[from] Untrusted),
    /// Another length than this checkpoint's usage file has.
    #[error("{got} bytes, a usage file of this checkpoint has {want} (truncated or not one)")]
    Length {
        /// Its length.
        got: u64,
        /// The length it must have.
        want: u64,
    },
    /// Not a usage file, or another version of the format.
    #[error("not a k3 usage file of format {VERSION} (magic, version or flags)")]
    Format,
    /// Made for another model.
    #[error("made for model {found:032x}, this store serves model {ours:032x}")]
    OtherModel {
        /// The identity the file names.
        found: u128,
        /// This store's identity.
        ours: u128,
    },
    /// Made for another layer or expert count.
    #[error(
        "made for {layers} layers of {experts} experts, this checkpoint has {want_layers} of \
             {want_experts}"
    )]
    OtherGrid {
        /// Its layers.
        layers: u64,
        /// Its experts per layer.
        experts: u64,
        /// The checkpoint's layers.
        want_layers: usize,
        /// The checkpoint's experts per layer.
        want_experts: usize,
    },
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl UsageCounts {
    /// No counts yet, for `n_layers` layers of `n_experts` routed experts (at most
    /// [`MAX_GRID`] pairs: larger grids are cut to it, and their excess never counted).
    pub fn new(n_layers: usize, n_experts: usize) -> UsageCounts {
        let grid = Self::grid(n_layers, n_experts);
        UsageCounts {
            n_layers,
            n_experts,
            counts: vec![0; grid],
            half_life: (HALF_LIFE_PER_EXPERT * grid as u64).max(1),
            since_halving: 0,
            total: 0,
        }
    }

    fn grid(n_layers: usize, n_experts: usize) -> usize {
        (n_layers as u64)
            .saturating_mul(n_experts as u64)
            .min(MAX_GRID) as usize
    }

    /// Bytes of the file of this grid (header, counts, MAC).
    pub fn file_bytes(n_layers: usize, n_experts: usize) -> u64 {
        (HEADER_BYTES + 4 * Self::grid(n_layers, n_experts) + TAG_BYTES) as u64
    }

    fn index(&self, layer: usize, expert: u32) -> Option<usize> {
        (layer < self.n_layers && (expert as usize) < self.n_experts)
            .then(|| layer * self.n_experts + expert as usize)
            .filter(|&i| i < self.counts.len())
    }

    /// Count one demand request of `ids` of `layer` (each distinct id once; ids out of range
    /// are ignored); halve every count once the half-life is reached. Returns how many were
    /// counted.
    pub fn count(&mut self, layer: u32, ids: &[u32]) -> u64 {
        let mut distinct = ids.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let mut n = 0;
        for e in distinct {
            let Some(i) = self.index(layer as usize, e) else {
                continue;
            };
            self.counts[i] = self.counts[i].saturating_add(1);
            n += 1;
            self.total += 1;
            self.since_halving += 1;
            if self.since_halving >= self.half_life {
                for c in &mut self.counts {
                    *c /= 2;
                }
                self.since_halving = 0;
            }
        }
        n
    }

    /// The count of expert `expert` of `layer` (0 outside the grid).
    pub fn get(&self, layer: usize, expert: u32) -> u32 {
        self.index(layer, expert).map_or(0, |i| self.counts[i])
    }

    /// Requests counted over the history's whole life (not decayed).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Experts whose count is not zero.
    pub fn used(&self) -> u64 {
        self.counts.iter().filter(|&&c| c > 0).count() as u64
    }

    /// The most used experts, at most `slots`, of those `held` says the checkpoint holds:
    /// by count, highest first; ties by layer, then expert, lowest first. Experts never counted
    /// (or decayed to 0) are not listed.
    pub fn hottest(&self, slots: usize, held: impl Fn(usize, u32) -> bool) -> Vec<(usize, u32)> {
        let mut v: Vec<(u32, usize, u32)> = (self.counts.iter().enumerate())
            .filter(|(_, &c)| c > 0)
            .map(|(i, &c)| (c, i / self.n_experts, (i % self.n_experts) as u32))
            .filter(|&(_, l, e)| held(l, e))
            .collect();
        v.sort_unstable_by(|a, b| b.0.cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
        v.truncate(slots);
        v.into_iter().map(|(_, l, e)| (l, e)).collect()
    }

    /// The file's bytes before its MAC: the header (magic, version, flags, `identity`, layers,
    /// experts, half-life, requests since the last halving, total requests) and the counts,
    /// little-endian.
    pub fn encode(&self, identity: u128) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_BYTES + 4 * self.counts.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&identity.to_le_bytes());
        b.extend_from_slice(&(self.n_layers as u32).to_le_bytes());
        b.extend_from_slice(&(self.n_experts as u32).to_le_bytes());
        b.extend_from_slice(&self.half_life.to_le_bytes());
        b.extend_from_slice(&self.since_halving.to_le_bytes());
        b.extend_from_slice(&self.total.to_le_bytes());
        debug_assert_eq!(b.len(), HEADER_BYTES);
        for c in &self.counts {
            b.extend_from_slice(&c.to_le_bytes());
        }
        b
    }

    /// The counts of a file's bytes (MAC already checked and removed) made by this store's
    /// model `identity` for `n_layers` × `n_experts`; a file of another format, model or grid
    /// is refused. The half-life is this build's (a file written with another keeps its
    /// counts).
    pub fn decode(
        bytes: &[u8],
        identity: u128,
        n_layers: usize,
        n_experts: usize,
    ) -> Result<UsageCounts, UsageFileError> {
        let mut u = UsageCounts::new(n_layers, n_experts);
        let want = (HEADER_BYTES + 4 * u.counts.len()) as u64;
        if bytes.len() as u64 != want {
            return Err(UsageFileError::Length {
                got: bytes.len() as u64 + TAG_BYTES as u64,
                want: want + TAG_BYTES as u64,
            });
        }
        if &bytes[..8] != MAGIC || u32_at(bytes, 8) != VERSION || u32_at(bytes, 12) != 0 {
            return Err(UsageFileError::Format);
        }
        let found = u128::from_le_bytes(bytes[16..32].try_into().expect("16 bytes"));
        if found != identity {
            return Err(UsageFileError::OtherModel {
                found,
                ours: identity,
            });
        }
        let (layers, experts) = (u64::from(u32_at(bytes, 32)), u64::from(u32_at(bytes, 36)));
        if (layers, experts) != (n_layers as u64, n_experts as u64) {
            return Err(UsageFileError::OtherGrid {
                layers,
                experts,
                want_layers: n_layers,
                want_experts: n_experts,
            });
        }
        u.since_halving = u64_at(bytes, 48).min(u.half_life - 1);
        u.total = u64_at(bytes, 56);
        for (c, b) in u
            .counts
            .iter_mut()
            .zip(bytes[HEADER_BYTES..].chunks_exact(4))
        {
            *c = u32::from_le_bytes(b.try_into().expect("4 bytes"));
        }
        Ok(u)
    }
}

/// The counts and what was counted since the start.
struct Book {
    counts: UsageCounts,
    /// Requests counted since the start.
    counted: u64,
}

/// What the saves did.
#[derive(Default)]
struct Saves {
    /// `Book::counted` when the file on disk was written (0 before the first save).
    saved: u64,
    done: u64,
    failed: u64,
    /// When a failure was last logged (at most one line per period).
    logged: Option<Instant>,
}

/// The saving thread and how to stop it.
struct Saver {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

/// The store's usage history: counted by the backend, saved by its own thread (see the module
/// documentation).
pub struct UsageBook {
    state: StateDir,
    identity: u128,
    file: PathBuf,
    book: Mutex<Book>,
    saves: Mutex<Saves>,
    /// Why the file found at start was refused (empty: loaded, or none).
    refused: String,
    requests_at_start: u64,
    saver: Mutex<Option<Saver>>,
}

impl std::fmt::Debug for UsageBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UsageBook")
            .field("file", &self.file)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Read and check `path` as the usage file of `state`'s model for this grid.
fn read_file(
    state: &StateDir,
    identity: u128,
    path: &Path,
    n_layers: usize,
    n_experts: usize,
) -> Result<UsageCounts, UsageFileError> {
    use std::io::Read;
    let (f, len) = open_private(path)?;
    let want = UsageCounts::file_bytes(n_layers, n_experts);
    if len != want {
        return Err(UsageFileError::Length { got: len, want });
    }
    let mut file = Vec::with_capacity(want as usize);
    (f.take(want + 1))
        .read_to_end(&mut file)
        .map_err(Untrusted::Io)?;
    if file.len() as u64 != want {
        return Err(UsageFileError::Length {
            got: file.len() as u64,
            want,
        });
    }
    // The header is checked before the MAC only to name what is wrong; nothing is used unless
    // both hold.
    let body = &file[..file.len() - TAG_BYTES];
    let counts = UsageCounts::decode(body, identity, n_layers, n_experts)?;
    state.open_sealed(MAC_NAME, &file)?;
    Ok(counts)
}

impl UsageBook {
    /// The usage history of the store of `identity` in state directory `dir` (checked like the
    /// sessions', [`StateDir::open`]: a refusal is exit 2) for `n_layers` × `n_experts`. A usage
    /// file that cannot be trusted is logged and a new history begun (module documentation).
    pub fn open(
        dir: &Path,
        identity: u128,
        n_layers: usize,
        n_experts: usize,
    ) -> Result<UsageBook, StateDirError> {
        let state = StateDir::open(dir, identity)?;
        let file = state.path().join(FILE_NAME);
        let exists = std::fs::symlink_metadata(&file).is_ok();
        let (counts, refused) = if !exists {
            tracing::info!(
                "expert usage: no history in {} yet: counting from now",
                state.path().display()
            );
            (UsageCounts::new(n_layers, n_experts), String::new())
        } else {
            match read_file(&state, identity, &file, n_layers, n_experts) {
                Ok(c) => {
                    tracing::info!(
                        "expert usage: {} requests of {} experts loaded from {}",
                        c.total(),
                        c.used(),
                        file.display()
                    );
                    (c, String::new())
                }
                Err(e) => {
                    tracing::warn!(
                        "expert usage: refusing {}: {e}; starting a new history (it replaces \
                         the file at its first save)",
                        file.display()
                    );
                    (UsageCounts::new(n_layers, n_experts), e.to_string())
                }
            }
        };
        Ok(UsageBook {
            identity,
            file,
            requests_at_start: counts.total(),
            book: Mutex::new(Book { counts, counted: 0 }),
            saves: Mutex::new(Saves::default()),
            refused,
            state,
            saver: Mutex::new(None),
        })
    }

    /// The usage file's path.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Count a worker's demand request of `ids` of `layer` (module documentation).
    pub fn count(&self, layer: u32, ids: &[u32]) {
        let mut b = lock(&self.book);
        let n = b.counts.count(layer, ids);
        b.counted += n;
    }

    /// A copy of the counts now.
    pub fn counts(&self) -> UsageCounts {
        lock(&self.book).counts.clone()
    }

    /// Write the counts to the file if anything was counted since the last save (atomically:
    /// the previous file or this one, never a torn one). True when it wrote.
    pub fn save(&self) -> std::io::Result<bool> {
        let mut s = lock(&self.saves);
        let (bytes, counted) = {
            let b = lock(&self.book);
            if b.counted == s.saved {
                return Ok(false);
            }
            (b.counts.encode(self.identity), b.counted)
        };
        let tag = self.state.seal(MAC_NAME, &bytes);
        let written = (self.state.stage(FILE_NAME, &[&bytes, &tag]))
            .and_then(|tmp| self.state.install(&tmp, FILE_NAME));
        match written {
            Ok(()) => {
                s.saved = counted;
                s.done += 1;
                Ok(true)
            }
            Err(e) => {
                s.failed += 1;
                Err(e)
            }
        }
    }

    /// [`UsageBook::save`], a failure logged (at most once per `period`).
    fn save_logged(&self, period: Duration) {
        if let Err(e) = self.save() {
            let mut s = lock(&self.saves);
            if s.logged.is_none_or(|t| t.elapsed() >= period) {
                s.logged = Some(Instant::now());
                tracing::warn!(
                    "expert usage: cannot save {} ({} failed saves so far; the previous file \
                     stays): {e}",
                    self.file.display(),
                    s.failed
                );
            }
        }
    }

    /// Save every `period` on a thread of its own until [`UsageBook::finish`] (a thread that
    /// cannot be started is logged: the history is then saved at the stop only).
    pub fn start_saver(self: &Arc<Self>, period: Duration) {
        let (stop, rx) = mpsc::channel::<()>();
        let me = self.clone();
        let thread = std::thread::Builder::new()
            .name("k3-usage-save".into())
            .spawn(move || loop {
                match rx.recv_timeout(period) {
                    Err(RecvTimeoutError::Timeout) => me.save_logged(period),
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                }
            });
        match thread {
            Ok(thread) => *lock(&self.saver) = Some(Saver { stop, thread }),
            Err(e) => tracing::warn!(
                "expert usage: no saving thread ({e}): {} is saved at the stop only",
                self.file.display()
            ),
        }
    }

    /// Stop the saving thread and save what is left (the store is stopping).
    pub fn finish(&self) {
        if let Some(s) = lock(&self.saver).take() {
            let _ = s.stop.send(());
            let _ = s.thread.join();
        }
        match self.save() {
            Ok(true) => tracing::info!("expert usage: saved to {}", self.file.display()),
            Ok(false) => {}
            Err(e) => tracing::warn!(
                "expert usage: cannot save {} (the previous file stays): {e}",
                self.file.display()
            ),
        }
    }

    /// Figures for `k3-ctl stats` (the preload fields are the backend's).
    pub fn stats(&self) -> UsageStats {
        let (counted, used) = {
            let b = lock(&self.book);
            (b.counted, b.counts.used())
        };
        let s = lock(&self.saves);
        UsageStats {
            file: self.file.display().to_string(),
            refused: self.refused.clone(),
            requests_at_start: self.requests_at_start,
            requests_counted: counted,
            requests_saved: s.saved,
            experts_used: used,
            saves: s.done,
            save_failures: s.failed,
            ..UsageStats::default()
        }
    }
}

/// What a store with `slots` expert slots for checkpoint `cat` preloads for `--preload
/// preload`, given its usage history (`None`: no `--state-dir`). Refused (exit 2): `on` when
/// not every routed expert fits, `hot` without a history.
pub fn choose_preload(
    preload: Preload,
    slots: usize,
    cat: &Catalog,
    book: Option<&UsageBook>,
) -> Result<PreloadSet, PreloadRefused> {
    let experts = cat.routed_experts().count();
    let hot = |b: &UsageBook| {
        let list = b
            .counts()
            .hottest(slots, |l, e| cat.expert(l, e as usize).is_some());
        if list.is_empty() {
            PreloadSet::Nothing
        } else {
            PreloadSet::These(list)
        }
    };
    Ok(match preload {
        Preload::Off => PreloadSet::Nothing,
        Preload::On if slots >= experts => PreloadSet::Every,
        Preload::On => return Err(PreloadRefused::NotAll { slots, experts }),
        Preload::Auto if slots >= experts => PreloadSet::Every,
        Preload::Auto => book.map_or(PreloadSet::Nothing, hot),
        Preload::Hot => match book {
            Some(b) => hot(b),
            None => {
                return Err(PreloadRefused::NoHistory {
                    what: "this store keeps none (start it with --state-dir DIR)",
                })
            }
        },
    })
}

/// The `preload` word of [`UsageStats`] for a preload set.
pub fn preload_kind(set: &PreloadSet) -> &'static str {
    match set {
        PreloadSet::Nothing => "none",
        PreloadSet::Every => "every",
        PreloadSet::These(_) => "hot",
    }
}

#[cfg(test)]
mod tests {
    use super::super::statedir::tests::private_dir;
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn counts_distinct_demands_halve_at_the_half_life_and_stay_in_the_grid() {
        let mut u = UsageCounts::new(3, 4);
        assert_eq!(u.half_life, HALF_LIFE_PER_EXPERT * 12);
        // Each distinct id once per request; out-of-range ids and layers are not counted.
        assert_eq!(u.count(1, &[2, 2, 0, 9]), 2);
        assert_eq!(u.count(7, &[0]), 0);
        assert_eq!(
            (u.get(1, 2), u.get(1, 0), u.get(1, 1), u.total()),
            (1, 1, 0, 2)
        );
        assert_eq!(u.used(), 2);
        // Up to the half-life nothing decays; the request that reaches it halves every count.
        let h = u.half_life;
        while u.since_halving < h - 1 {
            u.count(2, &[3]);
        }
        let before = u.get(2, 3);
        assert_eq!(before as u64, h - 3);
        u.count(2, &[3]);
        let counted = before + 1;
        assert_eq!(u.get(2, 3), counted / 2, "counted, then halved");
        assert_eq!((u.get(1, 2), u.get(1, 0)), (0, 0), "1 halves to 0");
        assert_eq!((u.since_halving, u.total()), (0, h));
        // Bounded: however long one expert is asked for, its count stays below 2 half-lives.
        for _ in 0..3 * h {
            u.count(0, &[1]);
        }
        assert!((u.get(0, 1) as u64) < 2 * h);
    }

    #[test]
    fn hottest_is_by_count_then_layer_then_expert_and_never_more_than_the_slots() {
        let mut u = UsageCounts::new(3, 4);
        for (l, ids, times) in [
            (2u32, &[1u32][..], 5),
            (1, &[3][..], 5),
            (1, &[0, 2][..], 7),
            (0, &[0][..], 1),
        ] {
            for _ in 0..times {
                u.count(l, ids);
            }
        }
        let all = u.hottest(100, |_, _| true);
        assert_eq!(all, [(1, 0), (1, 2), (1, 3), (2, 1), (0, 0)]);
        assert_eq!(u.hottest(3, |_, _| true), [(1, 0), (1, 2), (1, 3)]);
        // An expert the checkpoint lacks is skipped, the next one takes its place.
        assert_eq!(
            u.hottest(3, |l, e| (l, e) != (1, 2)),
            [(1, 0), (1, 3), (2, 1)]
        );
        assert!(UsageCounts::new(3, 4).hottest(10, |_, _| true).is_empty());
    }

    #[test]
    fn the_file_round_trips_and_a_foreign_damaged_or_wrong_key_file_is_refused() {
        let d = private_dir();
        let dir = d.path().join("state");
        let book = UsageBook::open(&dir, 7, 3, 4).unwrap();
        assert_eq!(book.stats().requests_at_start, 0);
        assert!(!book.save().unwrap(), "nothing counted: nothing written");
        assert!(!book.file().exists());
        book.count(1, &[0, 3]);
        book.count(2, &[3]);
        assert!(book.save().unwrap());
        assert!(!book.save().unwrap(), "unchanged: not written again");
        let file = book.file().to_path_buf();
        assert_eq!(
            std::fs::metadata(&file).unwrap().len(),
            UsageCounts::file_bytes(3, 4)
        );
        assert_eq!(super::super::statedir::mode_of(&file).unwrap(), 0o600);
        let s = book.stats();
        assert_eq!((s.requests_counted, s.requests_saved, s.saves), (3, 3, 1));
        // A restart loads it.
        let again = UsageBook::open(&dir, 7, 3, 4).unwrap();
        assert_eq!(again.counts(), book.counts());
        assert_eq!(
            (again.stats().requests_at_start, again.refused.as_str()),
            (3, "")
        );
        let good = std::fs::read(&file).unwrap();
        let refused = |bytes: &[u8], what: &str| {
            std::fs::write(&file, bytes).unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
            let b = UsageBook::open(&dir, 7, 3, 4).unwrap();
            let r = b.stats().refused;
            assert!(r.contains(what), "{what}: {r}");
            assert_eq!(
                b.counts(),
                UsageCounts::new(3, 4),
                "a refused file gives no counts"
            );
            assert_eq!(b.stats().requests_at_start, 0);
        };
        // A flipped count byte (the MAC), a flipped MAC byte, a truncated file.
        let mut flipped = good.clone();
        flipped[HEADER_BYTES + 4 * 4] ^= 1;
        refused(&flipped, "MAC mismatch");
        let mut tag = good.clone();
        *tag.last_mut().unwrap() ^= 0x80;
        refused(&tag, "MAC mismatch");
        refused(&good[..good.len() - 1], "truncated");
        refused(&[], "truncated");
        // The same counts sealed under another key (another state directory of this model).
        let other = UsageBook::open(&d.path().join("other"), 7, 3, 4).unwrap();
        other.count(1, &[0, 3]);
        other.count(2, &[3]);
        other.save().unwrap();
        refused(&std::fs::read(other.file()).unwrap(), "MAC mismatch");
        // Another model's file under this directory's own key: named by its identity.
        let mut foreign = UsageCounts::new(3, 4);
        foreign.count(1, &[1]);
        let body = foreign.encode(8);
        let mut f = body.clone();
        f.extend_from_slice(&again.state.seal(MAC_NAME, &body));
        refused(&f, &format!("made for model {:032x}", 8u128));
        // Another grid (same length in bytes would need 12 experts: 4 layers of 3).
        let mut grid = UsageCounts::new(4, 3);
        grid.count(0, &[0]);
        let body = grid.encode(7);
        let mut f = body.clone();
        f.extend_from_slice(&again.state.seal(MAC_NAME, &body));
        refused(&f, "made for 4 layers of 3 experts");
        // A refused file is replaced at the first save of the new history.
        let b = UsageBook::open(&dir, 7, 3, 4).unwrap();
        b.count(0, &[1]);
        assert!(b.save().unwrap());
        let c = UsageBook::open(&dir, 7, 3, 4).unwrap();
        assert_eq!((c.refused.as_str(), c.counts().get(0, 1)), ("", 1));
        // A symlink in the file's place is not followed.
        std::fs::remove_file(&file).unwrap();
        std::os::unix::fs::symlink(other.file(), &file).unwrap();
        let b = UsageBook::open(&dir, 7, 3, 4).unwrap();
        assert!(
            b.stats().refused.contains("symbolic link"),
            "{:?}",
            b.stats()
        );
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes a checkpoint
    fn preload_choice_follows_the_flag_and_the_history() {
        let spec = crate::fixture::Spec::small(4, 8);
        let w = crate::fixture::write(&spec, "usage-choice");
        let cat = &w.catalog;
        let routed = cat.routed_experts().count();
        let d = private_dir();
        let book =
            UsageBook::open(&d.path().join("state"), 7, cat.n_layers(), cat.n_experts()).unwrap();
        let choose = |p, slots, b: Option<&UsageBook>| choose_preload(p, slots, cat, b);
        // Every expert fits: `auto` and `on` read them all, whatever the history.
        assert_eq!(
            choose(Preload::Auto, routed, Some(&book)),
            Ok(PreloadSet::Every)
        );
        assert_eq!(choose(Preload::On, routed, None), Ok(PreloadSet::Every));
        assert!(matches!(
            choose(Preload::On, routed - 1, None),
            Err(PreloadRefused::NotAll { .. })
        ));
        // Not all fit, an empty history: nothing; `hot` without a history is refused.
        assert_eq!(
            choose(Preload::Auto, 5, Some(&book)),
            Ok(PreloadSet::Nothing)
        );
        assert_eq!(choose(Preload::Auto, 5, None), Ok(PreloadSet::Nothing));
        assert!(matches!(
            choose(Preload::Hot, 5, None),
            Err(PreloadRefused::NoHistory { .. })
        ));
        // Demands: layer 2 expert 6 three times, layer 1 expert 1 twice, layer 3 expert 0 and
        // layer 0 (dense: no routed expert) once; a layer beyond the checkpoint is not counted.
        for (l, ids) in [
            (2, &[6u32, 1][..]),
            (2, &[6]),
            (2, &[6]),
            (1, &[1]),
            (1, &[1]),
        ] {
            book.count(l, ids);
        }
        book.count(3, &[0]);
        book.count(0, &[4]);
        book.count(9, &[4]);
        let hot = PreloadSet::These(vec![(2, 6), (1, 1), (2, 1)]);
        assert_eq!(choose(Preload::Auto, 3, Some(&book)), Ok(hot.clone()));
        assert_eq!(choose(Preload::Hot, 3, Some(&book)), Ok(hot.clone()));
        assert_eq!(hot.count(cat, 3), 3);
        assert_eq!(hot.count(cat, 2), 2, "never more than the cache holds");
        // `hot` reads only used experts even when all would fit; `off` reads nothing.
        match choose(Preload::Hot, routed, Some(&book)).unwrap() {
            PreloadSet::These(v) => assert_eq!(v, [(2, 6), (1, 1), (2, 1), (3, 0)]),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            choose(Preload::Off, 3, Some(&book)),
            Ok(PreloadSet::Nothing)
        );
        assert_eq!(preload_kind(&hot), "hot");
        assert_eq!(preload_kind(&PreloadSet::Every), "every");
        assert_eq!(preload_kind(&PreloadSet::Nothing), "none");
        std::fs::remove_dir_all(&w.dir).unwrap();
    }
}
