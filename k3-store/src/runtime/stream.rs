//! Trunk streaming: a pinned prefix plus a ring arena that reads ahead.
//!
//! Layers `0..pinned` are read once at start and never evicted (the forward pass scans layers
//! cyclically, which defeats LRU, so a fixed prefix is the right policy). The other layers go
//! through one **ring arena** of `ring_bytes` (at least the largest streamed layer): each layer
//! read lands in a contiguous extent placed by [`crate::runtime::arena::place`], so small layers share the
//! arena and the next layer is read while the current one is computed — a 3 GB laptop arena holds
//! layer 0 (2.34 GB) alone but two KDA layers (1.27 GB) or an MLA and a KDA layer at once.
//!
//! One background thread does every ring read. It serves the consumer's demand first
//! ([`TrunkStream::layer`] blocks until its layer is in), then **reads ahead** in forward order —
//! the layers after the one last handed out, cyclically over the streamed layers — without being
//! asked, as far as the arena allows. Eviction is Belady for a cyclic scan: a read-ahead may only
//! overwrite a layer that is needed later than the one it reads (never a layer in use, being
//! read, or needed sooner), so the arena never thrashes; a demand may overwrite anything not in
//! use. [`TrunkStream::prefetch`] only moves the read-ahead start (a forward pass that begins
//! again at layer 0 after an error).
//!
//! **Partial read-ahead.** When the very next layer does not fit beside the layer in use (layer 1
//! after the 2.34 GB layer 0 in a 3 GB arena), it is placed where it overlaps that layer least
//! ([`crate::runtime::arena::place_min_overlap`]); the free part of its extent is read at once, page-
//! aligned windows of the same span ([`TrunkLayout::read_layer_window`]), and the rest as soon as
//! the layer in use is released. While it waits the reader serves nothing else, so a consumer
//! that keeps the layer and asks for another gets the "layers in use" error after the timeout.
//!
//! **Integrity.** Every layer read from a packed trunk is checked against the XXH3-64 checksum
//! `trunk.json` records ([`TrunkLayout::verify_run`]): pinned layers when loaded (a mismatch
//! fails the start: the caller refuses, exit 2), streamed layers after every ring read unless
//! on their first read in the process ([`VerifyMode`], `K3_TRUNK_VERIFY=first|every|off`). A
//! mismatch fails that layer's read like an I/O error: the worker stops with an error, never
//! computes with other weights. Checking one read costs about a fifth of its read time in CPU
//! (XXH3 at ~11.5 GB/s of one core against ~2.1 GB/s of disk here; docs/RELIABILITY.md, "Trunk
//! integrity"), too much for every read of every token by default; once per layer per process
//! it is under 1% of the streamed reads of a 20-token run.
//!
//! **The one-slot hazard** (SPEC.md I38): an extent is rewritten only when no [`Region`] points
//! into it. The regions of a layer share one lease; the reader claims a range only while no live
//! lease overlaps it (checked under the ring's lock, where leases are also created), so the layer
//! being computed is never overwritten, however small the arena.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::runtime::arena::{place, place_min_overlap, ArenaMem};
use crate::runtime::io::{align_up, run_parallel, AlignedBuf};
use crate::runtime::source::{ByteOwner, LayerRun, Region, SourceError};
use crate::runtime::trunk::TrunkLayout;

/// Parallel readers while loading the pinned prefix.
const PIN_READERS: usize = 4;

/// How to stream.
#[derive(Clone, Debug)]
pub struct StreamOptions {
    /// Layers `0..pinned` are resident.
    pub pinned: usize,
    /// Bytes of the ring arena for the other layers (ignored when every layer is pinned); must
    /// hold the largest streamed layer. More lets the reader work further ahead.
    pub ring_bytes: u64,
    /// How long [`TrunkStream::layer`] waits while the layers in use leave no room for the one
    /// asked for before reporting it (time spent waiting for the disk does not count).
    pub demand_timeout: Duration,
}

/// Counters of the stream.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StreamStats {
    /// Layers pinned.
    pub pinned_layers: usize,
    /// Bytes of the pinned layers (read once at start).
    pub pinned_bytes: u64,
    /// Seconds spent reading the pinned layers.
    pub pinned_seconds: f64,
    /// Bytes of the ring arena (0 when everything is pinned).
    pub ring_bytes: u64,
    /// Largest streamed layer (its read buffer), bytes.
    pub largest_layer_bytes: u64,
    /// Ring reads done.
    pub layer_reads: u64,
    /// Bytes read into the ring.
    pub bytes_read: u64,
    /// Seconds spent in ring reads.
    pub read_seconds: f64,
    /// Seconds the consumer waited in [`TrunkStream::layer`].
    pub wait_seconds: f64,
    /// Layers handed out that were already in the ring when asked for (read ahead, or still
    /// there from the previous pass).
    pub ready_on_demand: u64,
    /// Layers read ahead and overwritten before anyone used them (wasted reads).
    pub evicted_unused: u64,
    /// Bytes of layers read into the part of their extent that was free while the rest was
    /// still in use by the layer being computed (the rest is read once it is released).
    pub early_bytes: u64,
    /// Seconds the reader spent checking streamed layers against their checksums.
    pub verify_seconds: f64,
}

/// Environment variable choosing which streamed trunk reads are checked against their checksums
/// ([`VerifyMode`]): `first` (the default), `every`, or `0`/`off`.
pub const VERIFY_ENV: &str = k3_proto::paths::env::K3_TRUNK_VERIFY;

/// Which ring reads are checked against the layer's checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyMode {
    /// None (`K3_TRUNK_VERIFY=0`).
    Off,
    /// The first read of each layer in this process (the default): damage at rest — flipped
    /// bits, a `trunk.bin` from another pack — is caught before the layer's bytes are first
    /// used, at one check per layer per process. (The file is open, and packing never rewrites
    /// a trunk in place, so later reads return the same bytes unless the disk fails them.)
    First,
    /// Every read (`K3_TRUNK_VERIFY=every`): also catches bytes that change while the file is
    /// open, at a CPU cost of about a fifth of the read time (docs/RELIABILITY.md).
    Every,
}

impl VerifyMode {
    /// The mode [`VERIFY_ENV`] selects; `Err` names a value it does not know.
    pub fn from_env() -> Result<VerifyMode, String> {
        match std::env::var(VERIFY_ENV) {
            Err(_) => Ok(VerifyMode::First),
            Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                "" | "1" | "first" | "on" | "yes" => Ok(VerifyMode::First),
                "every" | "all" => Ok(VerifyMode::Every),
                "0" | "off" | "no" | "false" => Ok(VerifyMode::Off),
                other => Err(format!(
                    "{VERIFY_ENV}={other:?}: expected first (the default), every or off"
                )),
            },
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum ExtState {
    Filling,
    Ready { inner: usize },
    Failed(String),
}

/// One layer's bytes in the arena: `[off, off + len)`.
struct Extent {
    layer: usize,
    off: u64,
    len: u64,
    state: ExtState,
    lease: Weak<RingLease>,
    /// Handed out at least once since it was read.
    used: bool,
    /// Filling, the free part read, waiting for layers in use that overlap it to be released.
    waiting: bool,
}

impl Extent {
    fn leased(&self) -> bool {
        self.lease.strong_count() > 0
    }
    fn range(&self) -> (u64, u64) {
        (self.off, self.len)
    }
    fn overlaps(&self, off: u64, len: u64) -> bool {
        off < self.off + self.len && self.off < off + len
    }
}

struct State {
    extents: Vec<Extent>,
    demand: Option<usize>,
    /// The read-ahead starts here (the layer after the one last handed out).
    ahead_from: usize,
    /// Where the last extent ended: the next one goes after it.
    cursor: u64,
    reading: bool,
    shutdown: bool,
    stats: StreamStats,
    /// Layers whose checksum a ring read has matched (for [`VerifyMode::First`]).
    verified: Vec<bool>,
}

struct Shared {
    st: Mutex<State>,
    cv: Condvar,
    layout: Arc<TrunkLayout>,
    mem: Arc<ArenaMem>,
    /// First streamed layer.
    first: usize,
    /// Which ring reads are checked against the layer's checksum.
    verify: VerifyMode,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn n_streamed(&self) -> usize {
        self.layout.n_layers() - self.first
    }

    /// The streamed layer after `l`, cyclically.
    fn next(&self, l: usize) -> usize {
        if l + 1 >= self.layout.n_layers() {
            self.first
        } else {
            l + 1
        }
    }

    /// How soon layer `l` is needed in a scan starting at `from` (0 = first).
    fn distance(&self, from: usize, l: usize) -> usize {
        let n = self.n_streamed();
        (l + n - from) % n
    }

    /// Arena bytes layer `l` takes.
    fn extent_len(&self, l: usize) -> u64 {
        extent_len(&self.layout, l)
    }
}

/// Arena bytes layer `l` takes: its read buffer rounded up to the page.
fn extent_len(layout: &TrunkLayout, l: usize) -> u64 {
    align_up(layout.buf_len(l)).unwrap_or(u64::MAX)
}

/// The lease a layer's regions hold on its extent.
struct RingLease {
    shared: Arc<Shared>,
    off: usize,
    len: usize,
}

impl ByteOwner for RingLease {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `off..off+len` lies inside a Ready extent (checked when the lease was made,
        // under the lock). The reader writes a range only while, as decided under the same
        // lock, no extent overlapping it has a live lease (a claim overlapping a leased extent
        // reads only the part outside it until that extent is released and dropped); this
        // lease is live while `&self` is, so nothing writes these bytes while the borrow exists.
        unsafe { self.shared.mem.range(self.off, self.len) }
    }
}

impl Drop for RingLease {
    fn drop(&mut self) {
        // The strong count is already 0 (no borrow of the bytes remains): wake the reader, which
        // may now claim this extent. Taking the lock orders the wake-up after its last check.
        let g = self.shared.lock();
        drop(g);
        self.shared.cv.notify_all();
    }
}

/// A streaming trunk: pinned prefix + ring arena.
pub struct TrunkStream {
    shared: Arc<Shared>,
    pinned: Vec<LayerRun>,
    thread: Option<JoinHandle<()>>,
    demand_timeout: Duration,
}

impl std::fmt::Debug for TrunkStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TrunkStream({} pinned)", self.pinned.len())
    }
}

impl TrunkStream {
    /// Read the pinned prefix (calling `progress(done, total)` after each layer), allocate the
    /// ring and start the reader thread.
    pub fn new(
        layout: Arc<TrunkLayout>,
        opts: &StreamOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<TrunkStream, SourceError> {
        let n = layout.n_layers();
        let pinned_n = opts.pinned.min(n);
        let mut stats = StreamStats {
            pinned_layers: pinned_n,
            ..Default::default()
        };
        let t0 = Instant::now();
        let mut pinned = Vec::with_capacity(pinned_n);
        // Pinned layers are read a few at a time in parallel (NVMe wants queue depth > 1).
        let all: Vec<usize> = (0..pinned_n).collect();
        for chunk in all.chunks(PIN_READERS) {
            let read = |l: usize| -> Result<LayerRun, SourceError> {
                let plan = layout
                    .plan(l)
                    .ok_or_else(|| SourceError::Missing(format!("trunk layer {l}")))?;
                let mut buf =
                    AlignedBuf::zeroed(layout.buf_len(l) as usize).map_err(SourceError::Io)?;
                let inner = layout.read_layer(l, buf.as_mut_slice())?;
                let run = &buf.as_slice()[inner..inner + plan.run_len as usize];
                layout.verify_run(l, run).map_err(SourceError::Invalid)?;
                let owner: Arc<dyn ByteOwner> = Arc::new(buf);
                let region = Region::new(owner, inner, plan.run_len as usize)
                    .ok_or_else(|| SourceError::Io(format!("layer {l}: run outside its buffer")))?;
                Ok(LayerRun {
                    layer: l,
                    region,
                    layout: plan.layout.clone(),
                })
            };
            for run in run_parallel(chunk.to_vec(), PIN_READERS, read) {
                let run = run?;
                stats.pinned_bytes += run.region.len() as u64;
                pinned.push(run);
            }
            progress(pinned.len(), pinned_n);
        }
        stats.pinned_seconds = t0.elapsed().as_secs_f64();
        Self::with_pinned(layout, pinned, stats, opts)
    }

    /// A stream whose pinned prefix is already in memory (the runs of layers `0..pinned.len()`,
    /// e.g. mapped from the store's shared memory): allocate the ring for the other layers and
    /// start the reader thread.
    pub fn from_pinned(
        layout: Arc<TrunkLayout>,
        pinned: Vec<LayerRun>,
        opts: &StreamOptions,
    ) -> Result<TrunkStream, SourceError> {
        for (l, r) in pinned.iter().enumerate() {
            if r.layer != l {
                return Err(SourceError::Invalid(format!(
                    "pinned run {l} is layer {}: the pinned set must be a prefix",
                    r.layer
                )));
            }
        }
        let stats = StreamStats {
            pinned_layers: pinned.len(),
            pinned_bytes: pinned.iter().map(|r| r.region.len() as u64).sum(),
            ..Default::default()
        };
        Self::with_pinned(layout, pinned, stats, opts)
    }

    /// Arena bytes the streamed layers `pinned..` of `layout` need at least (the largest one).
    pub fn min_ring_bytes(layout: &TrunkLayout, pinned: usize) -> u64 {
        (pinned..layout.n_layers())
            .map(|l| extent_len(layout, l))
            .max()
            .unwrap_or(0)
    }

    fn with_pinned(
        layout: Arc<TrunkLayout>,
        pinned: Vec<LayerRun>,
        mut stats: StreamStats,
        opts: &StreamOptions,
    ) -> Result<TrunkStream, SourceError> {
        let n = layout.n_layers();
        let first = pinned.len();
        let largest = Self::min_ring_bytes(&layout, first);
        let ring = if first < n {
            // More than every streamed layer together is never used.
            let all: u64 = (first..n)
                .map(|l| extent_len(&layout, l))
                .fold(0u64, |a, b| a.saturating_add(b));
            let ring = opts.ring_bytes.min(all);
            if ring < largest {
                return Err(SourceError::Invalid(format!(
                    "a trunk ring of {} bytes cannot hold the largest streamed layer ({largest} \
                     bytes)",
                    opts.ring_bytes
                )));
            }
            ring
        } else {
            0
        };
        stats.ring_bytes = ring;
        stats.largest_layer_bytes = if first < n { largest } else { 0 };
        let verify = VerifyMode::from_env().map_err(SourceError::Invalid)?;
        let mem = ArenaMem::new(ring as usize).map_err(SourceError::Io)?;
        let shared = Arc::new(Shared {
            st: Mutex::new(State {
                extents: Vec::new(),
                demand: None,
                ahead_from: first,
                cursor: 0,
                reading: false,
                shutdown: false,
                stats,
                verified: vec![false; n],
            }),
            cv: Condvar::new(),
            layout,
            mem: Arc::new(mem),
            first,
            verify,
        });
        let thread = if ring > 0 {
            let s = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("k3-trunk-reader".into())
                    .spawn(move || reader(&s))
                    .map_err(|e| SourceError::Io(format!("cannot start trunk reader: {e}")))?,
            )
        } else {
            None
        };
        Ok(TrunkStream {
            shared,
            pinned,
            thread,
            demand_timeout: opts.demand_timeout,
        })
    }

    /// One line for the run report: where the trunk comes from, pinned layers, ring, read mode.
    pub fn describe(&self) -> String {
        let st = self.stats();
        let layout = &self.shared.layout;
        let from = match layout.packed_dir() {
            Some(d) => format!("packed {}", d.display()),
            None => "from the shards".to_string(),
        };
        let ring = if st.ring_bytes == 0 {
            "no ring".to_string()
        } else {
            format!(
                "ring {} (largest streamed layer {}), reading ahead",
                crate::runtime::plan::fmt_bytes(st.ring_bytes),
                crate::runtime::plan::fmt_bytes(st.largest_layer_bytes)
            )
        };
        format!(
            "trunk stream: {from}, {}/{} layers PINNED ({}), {ring}, {}",
            st.pinned_layers,
            layout.n_layers(),
            crate::runtime::plan::fmt_bytes(st.pinned_bytes),
            if layout.is_direct() {
                "O_DIRECT"
            } else {
                "buffered reads"
            }
        )
    }

    /// Counters so far.
    pub fn stats(&self) -> StreamStats {
        self.shared.lock().stats.clone()
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.shared.layout.n_layers()
    }

    /// True when layer `l` goes through the ring: dropping its run lets the reader reuse its
    /// extent.
    pub fn streams(&self, l: usize) -> bool {
        l >= self.pinned.len() && l < self.n_layers() && self.thread.is_some()
    }

    /// Layer `l`'s run if it is pinned (never reads, never blocks).
    pub fn pinned_layer(&self, l: usize) -> Option<LayerRun> {
        self.pinned.get(l).cloned()
    }

    /// Start reading ahead from layer `l` (the reader already reads ahead from the layer after
    /// the one last handed out; this only matters when the next pass starts elsewhere). `l` past
    /// the last layer wraps to the first streamed layer. A no-op for pinned layers.
    pub fn prefetch(&self, l: usize) {
        let l = if l >= self.n_layers() {
            self.pinned.len()
        } else {
            l
        };
        if l < self.pinned.len() || l >= self.n_layers() || self.thread.is_none() {
            return;
        }
        let mut g = self.shared.lock();
        g.ahead_from = l;
        drop(g);
        self.shared.cv.notify_all();
    }

    /// Layer `l`'s run; blocks until it is in memory.
    pub fn layer(&self, l: usize) -> Result<LayerRun, SourceError> {
        if let Some(r) = self.pinned.get(l) {
            return Ok(r.clone());
        }
        let plan = self
            .shared
            .layout
            .plan(l)
            .ok_or_else(|| SourceError::Missing(format!("trunk layer {l}")))?;
        let sh = &self.shared;
        let t0 = Instant::now();
        let mut deadline = t0 + self.demand_timeout;
        let mut g = sh.lock();
        let mut asked = false;
        loop {
            if let Some(i) = g.extents.iter().position(|e| e.layer == l) {
                match g.extents[i].state.clone() {
                    ExtState::Failed(m) => {
                        g.extents.remove(i);
                        if g.demand == Some(l) {
                            g.demand = None;
                        }
                        drop(g);
                        sh.cv.notify_all();
                        return Err(SourceError::Io(m));
                    }
                    ExtState::Ready { inner } => {
                        let e = &mut g.extents[i];
                        let lease = match e.lease.upgrade() {
                            Some(x) => x,
                            None => {
                                let x = Arc::new(RingLease {
                                    shared: sh.clone(),
                                    off: e.off as usize + inner,
                                    len: plan.run_len as usize,
                                });
                                e.lease = Arc::downgrade(&x);
                                x
                            }
                        };
                        e.used = true;
                        if g.demand == Some(l) {
                            g.demand = None;
                        }
                        if !asked {
                            g.stats.ready_on_demand += 1;
                        }
                        g.ahead_from = sh.next(l);
                        g.stats.wait_seconds += t0.elapsed().as_secs_f64();
                        drop(g);
                        sh.cv.notify_all();
                        let owner: Arc<dyn ByteOwner> = lease;
                        return Ok(LayerRun {
                            layer: l,
                            region: Region::whole(owner),
                            layout: plan.layout.clone(),
                        });
                    }
                    ExtState::Filling => {}
                }
            } else if g.demand != Some(l) {
                g.demand = Some(l);
                sh.cv.notify_all();
            }
            asked = true;
            let now = Instant::now();
            // Only layers in use can keep ours out for good; while the disk works we wait
            // however slow it is.
            let leased: Vec<(u64, u64)> = g
                .extents
                .iter()
                .filter(|e| e.leased())
                .map(Extent::range)
                .collect();
            // A read in progress will finish; while the reader waits for layers in use to be
            // released (to finish a partial read) it serves nothing else, so that depends on
            // them like a layer that does not fit.
            let progressing = g
                .extents
                .iter()
                .any(|e| e.state == ExtState::Filling && !e.waiting);
            let parked = g.extents.iter().any(|e| e.waiting);
            let stuck =
                parked || place(sh.mem.len() as u64, sh.extent_len(l), g.cursor, &leased).is_none();
            if !stuck || progressing {
                deadline = now + self.demand_timeout;
            } else if now >= deadline {
                if g.demand == Some(l) {
                    g.demand = None;
                }
                return Err(SourceError::Invalid(format!(
                    "waited {:.1} s for trunk layer {l}: the layers in use fill the {}-byte ring \
                     (drop the previous layer before asking for the next)",
                    self.demand_timeout.as_secs_f64(),
                    sh.mem.len()
                )));
            }
            g = sh
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for TrunkStream {
    fn drop(&mut self) {
        let reading = {
            let mut g = self.shared.lock();
            g.shutdown = true;
            g.reading
        };
        self.shared.cv.notify_all();
        if let Some(t) = self.thread.take() {
            // A read in progress (a read-ahead nobody will use) is not waited for: the thread
            // owns what it touches and exits when the read returns.
            if !reading {
                let _ = t.join();
            }
        }
    }
}

/// What the reader should read next and where: `(layer, offset)`, or `None` to wait. A
/// read-ahead of the very next layer may overlap the layer in use (a "partial" claim): the free
/// part is read at once, the rest when that layer is released.
fn next_read(sh: &Shared, st: &State) -> Option<(usize, u64)> {
    let cap = sh.mem.len() as u64;
    let present = |l: usize| st.extents.iter().any(|e| e.layer == l);
    // The consumer's demand first: anything not in use and not being read may go.
    if let Some(l) = st.demand.filter(|&l| !present(l)) {
        let blocked: Vec<(u64, u64)> = st
            .extents
            .iter()
            .filter(|e| e.leased() || e.state == ExtState::Filling)
            .map(Extent::range)
            .collect();
        return place(cap, sh.extent_len(l), st.cursor, &blocked).map(|off| (l, off));
    }
    if st.demand.is_some() {
        return None;
    }
    // Read-ahead: the first layer of the scan not in the arena, over extents needed later.
    let from = st.ahead_from;
    let l = (0..sh.n_streamed())
        .map(|k| sh.first + (from - sh.first + k) % sh.n_streamed())
        .find(|&l| !present(l))?;
    let d = sh.distance(from, l);
    let hard = |e: &&Extent| {
        e.state == ExtState::Filling
            || (!matches!(e.state, ExtState::Failed(_)) && sh.distance(from, e.layer) < d)
    };
    let blocked: Vec<(u64, u64)> = st
        .extents
        .iter()
        .filter(|e| e.leased() || hard(e))
        .map(Extent::range)
        .collect();
    let len = sh.extent_len(l);
    if let Some(off) = place(cap, len, st.cursor, &blocked) {
        return Some((l, off));
    }
    if d > 0 || !sh.layout.windowed(l) {
        return None;
    }
    let soft: Vec<(u64, u64)> = st
        .extents
        .iter()
        .filter(|e| e.leased() && !hard(e))
        .map(Extent::range)
        .collect();
    let hard: Vec<(u64, u64)> = st
        .extents
        .iter()
        .filter(|e| !e.leased() && hard(e))
        .map(Extent::range)
        .collect();
    place_min_overlap(cap, len, st.cursor, &hard, &soft)
        .filter(|&(_, overlap)| overlap < len)
        .map(|(off, _)| (l, off))
}

/// `[0, len)` minus `busy` (sorted, disjoint sub-ranges `(start, len)`), as `(start, end)`.
pub(crate) fn free_windows(len: u64, busy: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = 0;
    for &(s, l) in busy {
        if s > at {
            out.push((at, s));
        }
        at = at.max(s + l);
    }
    if at < len {
        out.push((at, len));
    }
    out
}

/// Read windows `(start, end)` (relative to the extent) of layer `l` into its extent at `off` of
/// `mem`. Returns where the run starts in the extent.
///
/// # Safety
/// Every window `[off + start, off + end)` lies inside `mem`, and while it is written no other
/// slice of `mem` overlapping it exists (the caller owns those bytes: a claimed extent, minus
/// whatever is still leased).
pub(crate) unsafe fn read_windows(
    layout: &TrunkLayout,
    mem: &ArenaMem,
    l: usize,
    off: u64,
    windows: &[(u64, u64)],
) -> Result<usize, String> {
    let mut inner = 0;
    for &(a, b) in windows {
        // SAFETY: inside `mem` and not aliased while written (this function's contract).
        let dst = unsafe { mem.range_mut((off + a) as usize, (b - a) as usize) };
        inner = layout
            .read_layer_window(l, dst, a as usize)
            .map_err(|e| e.0)?;
    }
    Ok(inner)
}

/// Check layer `l`'s run, read into the extent `[off, off + len)` of `mem` with the run at
/// `inner`, against its checksum; `Ok(inner)` when it matches.
///
/// # Safety
/// `[off, off + len)` lies inside `mem`, its writes have returned, and no exclusive slice
/// overlapping it exists while it is checked.
pub(crate) unsafe fn verify_extent(
    layout: &TrunkLayout,
    mem: &ArenaMem,
    l: usize,
    (off, len): (u64, u64),
    inner: usize,
) -> Result<usize, String> {
    let run_len = layout.plan(l).map(|p| p.run_len).unwrap_or(0);
    match (inner as u64).checked_add(run_len) {
        Some(end) if end <= len => {
            // SAFETY: [off+inner, off+end) lies inside the extent (checked just above), which is
            // inside `mem` and not written meanwhile (this function's contract).
            let run = unsafe { mem.range(off as usize + inner, run_len as usize) };
            layout.verify_run(l, run).map(|()| inner)
        }
        _ => Err(format!("trunk layer {l}: run outside its extent")),
    }
}

/// The reader thread.
fn reader(sh: &Shared) {
    let mut g = sh.lock();
    loop {
        if g.shutdown {
            return;
        }
        let Some((l, off)) = next_read(sh, &g) else {
            g = sh.cv.wait(g).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        let len = sh.extent_len(l);
        // Claim [off, off+len): drop the extents it overlaps that are not in use; the ones in
        // use (a partial claim) stay until released.
        let mut wasted = 0;
        let mut busy: Vec<(u64, u64)> = Vec::new();
        g.extents.retain(|e| {
            if !e.overlaps(off, len) {
                return true;
            }
            if e.leased() {
                let s = e.off.max(off);
                busy.push((s - off, (e.off + e.len).min(off + len) - s));
                return true;
            }
            if !e.used && matches!(e.state, ExtState::Ready { .. }) {
                wasted += 1;
            }
            false
        });
        busy.sort_unstable();
        g.stats.evicted_unused += wasted;
        g.extents.push(Extent {
            layer: l,
            off,
            len,
            state: ExtState::Filling,
            lease: Weak::new(),
            used: false,
            waiting: false,
        });
        g.cursor = off + len;
        g.reading = true;
        drop(g);
        let t0 = Instant::now();
        let mut res = if busy.is_empty() {
            // SAFETY: [off, off+len) is inside the arena (`place` checks against its length)
            // and was just claimed under the lock: every extent overlapping it was dropped, none
            // of them leased (so no RingLease — the only readers of arena bytes — points into
            // it), and a Filling extent is never leased nor claimed again until this read is
            // published.
            let dst = unsafe { sh.mem.range_mut(off as usize, len as usize) };
            sh.layout.read_layer(l, dst).map_err(|e| e.0)
        } else {
            // SAFETY: the windows lie inside the extent claimed for this read ([off, off+len) is
            // in the arena) and exclude the extents with a live lease that it overlaps; the claim
            // dropped every other extent it overlaps, under the ring's lock, where leases are
            // also made.
            unsafe { read_windows(&sh.layout, &sh.mem, l, off, &free_windows(len, &busy)) }
        };
        let mut secs = t0.elapsed().as_secs_f64();
        g = sh.lock();
        if !busy.is_empty() && res.is_ok() {
            g.stats.early_bytes += len - busy.iter().map(|b| b.1).sum::<u64>();
            // Wait until the layers in use that overlap the claim are released, drop them, read
            // the rest.
            g.reading = false;
            let me = |e: &Extent| e.layer == l && e.off == off;
            if let Some(e) = g.extents.iter_mut().find(|e| me(e)) {
                e.waiting = true;
            }
            sh.cv.notify_all();
            while g
                .extents
                .iter()
                .any(|e| !me(e) && e.overlaps(off, len) && e.leased())
            {
                if g.shutdown {
                    return;
                }
                g = sh.cv.wait(g).unwrap_or_else(|p| p.into_inner());
            }
            g.extents.retain(|e| me(e) || !e.overlaps(off, len));
            if let Some(e) = g.extents.iter_mut().find(|e| me(e)) {
                e.waiting = false;
            }
            g.reading = true;
            drop(g);
            let windows: Vec<(u64, u64)> = busy.iter().map(|&(s, l)| (s, s + l)).collect();
            let t1 = Instant::now();
            // SAFETY: as above; the leased extents these windows overlapped were released and
            // dropped under the lock before this read.
            res = unsafe { read_windows(&sh.layout, &sh.mem, l, off, &windows) };
            secs += t1.elapsed().as_secs_f64();
            g = sh.lock();
        }
        let check = match sh.verify {
            VerifyMode::Off => false,
            VerifyMode::First => !g.verified.get(l).copied().unwrap_or(false),
            VerifyMode::Every => true,
        };
        if check {
            if let Ok(inner) = res {
                // Checked without the lock (the extent is ours while Filling and `reading` is
                // set), so the consumer is not held up by the hash.
                drop(g);
                let t1 = Instant::now();
                // SAFETY: the extent [off, off+len) is in the arena and still Filling (claimed by
                // this thread, never leased, so no RingLease and no other claim can point into
                // it), and its last write (above) has returned.
                res = unsafe { verify_extent(&sh.layout, &sh.mem, l, (off, len), inner) };
                let dt = t1.elapsed().as_secs_f64();
                g = sh.lock();
                g.stats.verify_seconds += dt;
                if res.is_ok() {
                    if let Some(v) = g.verified.get_mut(l) {
                        *v = true;
                    }
                }
                secs += dt;
            }
        }
        let ok = res.is_ok();
        g.reading = false;
        if let Some(e) = g.extents.iter_mut().find(|e| e.layer == l && e.off == off) {
            e.state = match res {
                Ok(inner) => ExtState::Ready { inner },
                Err(m) => ExtState::Failed(m),
            };
        }
        if ok {
            g.stats.layer_reads += 1;
            g.stats.bytes_read += sh.layout.plan(l).map(|p| p.run_len).unwrap_or(0);
        }
        g.stats.read_seconds += secs;
        sh.cv.notify_all();
    }
}

#[cfg(test)]
impl TrunkStream {
    /// Wait until the reader has nothing left to do (read-ahead done as far as the arena allows).
    fn quiesce(&self) {
        let sh = &self.shared;
        let mut g = sh.lock();
        while g.reading || (next_read(sh, &g).is_some() && !g.extents.iter().any(|e| e.waiting)) {
            g = sh
                .cv
                .wait_timeout(g, Duration::from_millis(20))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Streamed layers in the arena (any state), ascending.
    fn present(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.shared.lock().extents.iter().map(|e| e.layer).collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::{self, Rng, Spec};
    use crate::runtime::trunk::{open_shards, pack_trunk};

    fn verify(spec: &Spec, run: &LayerRun) {
        let want = fixture::trunk_tensors(spec, run.layer);
        assert_eq!(run.layout.tensors().len(), want.len());
        for (name, _, _) in want {
            let loc = run.layout.get(&name).unwrap();
            let got = &run.region.bytes()[loc.off as usize..(loc.off + loc.nbytes) as usize];
            assert!(
                got == &fixture::expected_tensor(spec, &name)[..],
                "layer {}: {name} has another layer's bytes",
                run.layer
            );
        }
    }

    fn stream(
        layout: Arc<TrunkLayout>,
        pinned: usize,
        ring_bytes: u64,
        timeout_ms: u64,
    ) -> TrunkStream {
        let opts = StreamOptions {
            pinned,
            ring_bytes,
            demand_timeout: Duration::from_millis(timeout_ms),
        };
        TrunkStream::new(layout, &opts, &mut |_, _| {}).unwrap()
    }

    /// The trunk read straight from the shards.
    fn catalog_layout(w: &fixture::Written) -> Arc<TrunkLayout> {
        Arc::new(TrunkLayout::from_catalog(
            &w.catalog,
            open_shards(&w.catalog).unwrap(),
        ))
    }

    /// The trunk packed into `w.dir/packed` and read from there.
    fn packed_layout(w: &fixture::Written) -> Arc<TrunkLayout> {
        let packed_dir = w.dir.join("packed");
        if !packed_dir.exists() {
            pack_trunk(&w.catalog, &packed_dir, &mut |_| {}).unwrap();
        }
        Arc::new(
            TrunkLayout::from_packed(&w.catalog, open_shards(&w.catalog).unwrap(), &packed_dir)
                .unwrap(),
        )
    }

    /// Arena bytes of layer `l`.
    fn ext(layout: &TrunkLayout, l: usize) -> u64 {
        extent_len(layout, l)
    }

    /// SPEC.md I38: whatever the arena size, the reader reading ahead while the engine
    /// "computes" a layer (random sleeps) never overwrites the layer in use.
    #[test]
    fn read_ahead_never_overwrites_the_layer_in_use() {
        let spec = Spec::small(3, 2);
        let w = fixture::write(&spec, "i38");
        let layouts = [packed_layout(&w), catalog_layout(&w)];
        for layout in layouts {
            let min = TrunkStream::min_ring_bytes(&layout, 0);
            let all: u64 = (0..3).map(|l| ext(&layout, l)).sum();
            for (k, ring) in [min, ext(&layout, 1) + ext(&layout, 2), all - 4096, all]
                .into_iter()
                .enumerate()
            {
                let ring = ring.max(min);
                let s = stream(layout.clone(), 0, ring, 10_000);
                let mut rng = Rng(7 + k as u64);
                for step in 0..60 {
                    let l = step % 3;
                    let run = s.layer(l).unwrap();
                    assert_eq!(run.layer, l);
                    verify(&spec, &run);
                    s.prefetch((l + 1) % 3);
                    std::thread::sleep(Duration::from_micros(rng.below(3000)));
                    // Still this layer's bytes after the reader had time to run.
                    verify(&spec, &run);
                    drop(run);
                    if rng.below(4) == 0 {
                        std::thread::sleep(Duration::from_micros(rng.below(2000)));
                    }
                }
                let st = s.stats();
                assert_eq!(st.ring_bytes, ring);
                assert_eq!(st.evicted_unused, 0, "{st:?}");
                assert_eq!(st.pinned_layers, 0);
                if ring >= all {
                    // Everything fits: each layer is read once.
                    assert_eq!(st.layer_reads, 3, "{st:?}");
                } else {
                    // At most once per layer per pass (+ read-ahead into the next pass), at least
                    // once per pass (the three never fit together).
                    assert!((20..=63).contains(&st.layer_reads), "{st:?}");
                }
            }
        }
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    /// The reader works ahead in scan order as far as the arena allows, without being asked, and
    /// the layer handed out next is then already in memory.
    #[test]
    fn the_next_layers_are_read_while_the_current_one_is_in_use() {
        let spec = Spec::small(6, 2);
        let w = fixture::write(&spec, "ahead");
        let layout = catalog_layout(&w);
        let n = 6;
        let exts: Vec<u64> = (0..n).map(|l| ext(&layout, l)).collect();
        // Arena: layer 1 plus the two after it, exactly.
        let ring = exts[1] + exts[2] + exts[3];
        let s = stream(layout.clone(), 1, ring, 10_000);
        let run1 = s.layer(1).unwrap();
        s.quiesce();
        // While layer 1 is held, 2 and 3 were read ahead; 4 does not fit.
        assert_eq!(s.present(), vec![1, 2, 3]);
        assert_eq!(s.stats().layer_reads, 3);
        verify(&spec, &run1);
        drop(run1);
        s.quiesce();
        // Layer 1 (needed last in the scan 2, 3, 4, 5, 1) may now go: 4 is read, if it fits in
        // the space 1 left; nothing needed sooner than 4 was dropped.
        let st = s.stats();
        assert!(s.present().contains(&2) && s.present().contains(&3));
        assert_eq!(st.evicted_unused, 0);
        // A whole pass: 2 and 3 were ready on demand.
        let before = s.stats().ready_on_demand;
        for l in 2..n {
            let run = s.layer(l).unwrap();
            verify(&spec, &run);
        }
        assert!(s.stats().ready_on_demand >= before + 2, "{:?}", s.stats());
        // Many passes: each streamed layer read once per pass, no read-ahead wasted.
        let reads0 = s.stats().layer_reads;
        for _ in 0..10 {
            for l in 0..n {
                verify(&spec, &s.layer(l).unwrap());
            }
        }
        let st = s.stats();
        let passes = st.layer_reads - reads0;
        // At most one read per layer per pass (+ the read-ahead into the next pass); fewer when
        // a layer was still in the arena from the previous pass.
        assert!(
            passes <= 10 * 5 + 3,
            "{passes} reads for 10 passes of 5 streamed layers: {st:?}"
        );
        assert_eq!(st.evicted_unused, 0, "{st:?}");
        assert!(st.ready_on_demand >= 10 * 3, "{st:?}");
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    /// The next layer does not fit beside the one in use: its free part is read at once, the
    /// rest after the layer in use is released — and the layer in use is never touched.
    #[test]
    fn a_partial_read_ahead_fills_around_the_layer_in_use() {
        let spec = Spec::small(6, 2);
        let w = fixture::write(&spec, "partial");
        let layouts = [packed_layout(&w), catalog_layout(&w)];
        for layout in layouts {
            assert!((0..6).all(|l| layout.windowed(l)));
            let (e1, e2) = (ext(&layout, 1), ext(&layout, 2));
            let min = TrunkStream::min_ring_bytes(&layout, 1);
            // Layer 2 overlaps the held layer 1 by two pages.
            let ring = (e1 + e2 - 2 * 4096).max(min);
            let s = stream(layout.clone(), 1, ring, 300);
            let run1 = s.layer(1).unwrap();
            s.quiesce();
            let st = s.stats();
            assert_eq!(st.early_bytes, e2 - (e1 + e2 - ring), "{st:?}");
            assert_eq!(s.present(), vec![1, 2]);
            // Asking for layer 2 while holding the layer it waits for fails instead of hanging.
            let e = s.layer(2).unwrap_err().to_string();
            assert!(e.contains("layers in use fill"), "{e}");
            verify(&spec, &run1);
            drop(run1);
            let run2 = s.layer(2).unwrap();
            verify(&spec, &run2);
            assert_eq!(s.stats().layer_reads, 2);
            drop(run2);
            // The scan goes on from layer 3, then five whole passes.
            for l in (3..6).chain((0..5).flat_map(|_| 0..6)) {
                let run = s.layer(l).unwrap();
                verify(&spec, &run);
            }
            let st = s.stats();
            assert!(st.early_bytes > e2 && st.evicted_unused == 0, "{st:?}");
        }
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    /// A layer asked out of scan order is read at once, over read-ahead nobody used if need be.
    #[test]
    fn an_out_of_order_demand_takes_the_space_of_unused_read_ahead() {
        let spec = Spec::small(5, 2);
        let w = fixture::write(&spec, "order");
        let layout = catalog_layout(&w);
        let min = TrunkStream::min_ring_bytes(&layout, 0);
        let s = stream(layout.clone(), 0, min, 10_000);
        s.quiesce();
        // Nothing asked yet: the reader read layer 0 ahead.
        assert_eq!(s.present(), vec![0]);
        let run3 = s.layer(3).unwrap();
        verify(&spec, &run3);
        assert_eq!(s.stats().evicted_unused, 1);
        drop(run3);
        // The scan continues after 3: 4 is read next to 3 (both fit in the dense layer 0's
        // size); 0, the largest, would need 4's space and 4 is needed sooner.
        s.quiesce();
        assert_eq!(s.present(), vec![3, 4]);
        verify(&spec, &s.layer(0).unwrap());
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    fn pinned_prefix_is_read_once_and_the_ring_serves_the_rest() {
        let spec = Spec::small(5, 2);
        let w = fixture::write(&spec, "pinned");
        let layout = catalog_layout(&w);
        let min = TrunkStream::min_ring_bytes(&layout, 2);
        assert_eq!(min, (2..5).map(|l| ext(&layout, l)).max().unwrap());
        let s = stream(layout.clone(), 2, min, 10_000);
        let st = s.stats();
        assert_eq!(st.pinned_layers, 2);
        assert_eq!(
            st.pinned_bytes,
            w.catalog.trunk_bytes(0) + w.catalog.trunk_bytes(1)
        );
        assert_eq!((st.ring_bytes, st.largest_layer_bytes), (min, min));
        for _ in 0..4 {
            for l in 0..5 {
                let run = s.layer(l).unwrap();
                verify(&spec, &run);
                s.prefetch((l + 1) % 5);
            }
        }
        s.quiesce();
        let st = s.stats();
        // Pinned layers never go through the ring: 3 ring layers per pass, 4 passes, and the
        // read-ahead of the next pass's first streamed layer (2) once 4 was dropped.
        assert_eq!(st.layer_reads, 13, "{st:?}");
        let ring_bytes: u64 = (2..5).map(|l| w.catalog.trunk_bytes(l)).sum();
        assert_eq!(st.bytes_read, 4 * ring_bytes + w.catalog.trunk_bytes(2));
        assert_eq!(s.present(), vec![2]);
        let run2 = s.layer(2).unwrap();
        verify(&spec, &run2);
        assert_eq!(s.stats().layer_reads, 13);
        drop(run2);
        // A ring below the largest streamed layer is refused.
        let opts = StreamOptions {
            pinned: 2,
            ring_bytes: min - 1,
            demand_timeout: Duration::from_secs(1),
        };
        let e = TrunkStream::new(layout.clone(), &opts, &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains("cannot hold the largest"), "{e}");
        // Everything pinned: no ring, no reader thread.
        let all = stream(layout, 5, 0, 1000);
        assert_eq!(all.stats().ring_bytes, 0);
        assert!(
            all.describe().contains("5/5 layers PINNED") && all.describe().contains("no ring"),
            "{}",
            all.describe()
        );
        assert!(
            s.describe().contains("2/5 layers PINNED") && s.describe().contains("ring "),
            "{}",
            s.describe()
        );
        verify(&spec, &all.layer(4).unwrap());
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    fn holding_a_layer_that_leaves_no_room_errors_instead_of_hanging() {
        let spec = Spec::small(3, 2);
        let w = fixture::write(&spec, "hold");
        let layout = catalog_layout(&w);
        let min = TrunkStream::min_ring_bytes(&layout, 0);
        assert!(ext(&layout, 0) + ext(&layout, 1) > min);
        let s = stream(layout, 0, min, 200);
        let run0 = s.layer(0).unwrap();
        let e = s.layer(1).unwrap_err().to_string();
        assert!(e.contains("layers in use fill"), "{e}");
        verify(&spec, &run0);
        // The same layer twice shares the extent.
        let again = s.layer(0).unwrap();
        verify(&spec, &again);
        drop((run0, again));
        verify(&spec, &s.layer(1).unwrap());
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    /// A byte flipped in `trunk.bin` after the trunk was opened: a pinned layer fails the start,
    /// a streamed one fails its read (every time it is asked for), the other layers are served.
    #[test]
    fn a_damaged_layer_is_refused_pinned_and_fails_streamed() {
        let spec = Spec::small(3, 2);
        let w = fixture::write(&spec, "sflip");
        let layout = packed_layout(&w);
        let json: crate::runtime::trunk::TrunkJson = serde_json::from_str(
            &std::fs::read_to_string(w.dir.join("packed").join("trunk.json")).unwrap(),
        )
        .unwrap();
        let at = json.layers[1].file_off + 7;
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(w.dir.join("packed").join(crate::runtime::trunk::TRUNK_BIN))
                .unwrap();
            f.write_all_at(&[0xa5, 0x5a, 0xa5], at).unwrap();
        }
        let opts = StreamOptions {
            pinned: 2,
            ring_bytes: TrunkStream::min_ring_bytes(&layout, 2),
            demand_timeout: Duration::from_secs(5),
        };
        let e = TrunkStream::new(layout.clone(), &opts, &mut |_, _| {}).unwrap_err();
        assert!(
            matches!(&e, SourceError::Invalid(m) if m.contains("trunk layer 1")),
            "{e}"
        );
        let min = TrunkStream::min_ring_bytes(&layout, 0);
        for ring in [min, 3 * min] {
            let s = stream(layout.clone(), 0, ring, 5000);
            verify(&spec, &s.layer(0).unwrap());
            let e = s.layer(1).unwrap_err().to_string();
            assert!(e.contains("trunk layer 1") && e.contains("checksum"), "{e}");
            verify(&spec, &s.layer(2).unwrap());
            assert!(s.layer(1).is_err());
            assert!(s.stats().verify_seconds > 0.0);
        }
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    fn read_failure_is_reported_for_that_layer() {
        let spec = Spec::small(3, 2);
        let w = fixture::write(&spec, "sfail");
        let packed_dir = w.dir.join("packed");
        pack_trunk(&w.catalog, &packed_dir, &mut |_| {}).unwrap();
        let layout = Arc::new(
            TrunkLayout::from_packed(&w.catalog, open_shards(&w.catalog).unwrap(), &packed_dir)
                .unwrap(),
        );
        // Truncate trunk.bin inside layer 2's run.
        let bin = packed_dir.join(crate::runtime::trunk::TRUNK_BIN);
        let json: crate::runtime::trunk::TrunkJson =
            serde_json::from_str(&std::fs::read_to_string(packed_dir.join("trunk.json")).unwrap())
                .unwrap();
        let cut = json.layers[2].file_off + 10;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&bin)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let min = TrunkStream::min_ring_bytes(&layout, 0);
        for ring in [min, 3 * min] {
            let s = stream(layout.clone(), 0, ring, 5000);
            verify(&spec, &s.layer(0).unwrap());
            let e = s.layer(2).unwrap_err().to_string();
            assert!(e.contains("trunk.bin"), "{e}");
            verify(&spec, &s.layer(1).unwrap());
            // Asked again, the failed layer is read again (and fails again).
            assert!(s.layer(2).is_err());
            verify(&spec, &s.layer(0).unwrap());
        }
        std::fs::remove_dir_all(&w.dir).unwrap();
    }
}
