//! The ring's state under its lock (and the options and counters that go with it), and the
//! rules over it: paths, the next read and where it goes, claims, holds, broken leases. Pure
//! bookkeeping: no I/O, no waiting (see `reader.rs` and `mod.rs` for those).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::runs::{extent_bytes, RunError, Runs};
use crate::runtime::arena::{place, place_min_overlap};

/// A reader of the ring: the standalone worker, or one connection of the store.
pub type ReaderId = u64;

/// How long the ring protects what readers hold and need.
#[derive(Clone, Debug)]
pub struct RingOptions {
    /// A lease (and the path protected behind it) lasts this long after the layer was handed
    /// out; past it, and while another reader waits, the lease is broken. `Duration::MAX`: for
    /// ever (a standalone worker's path).
    pub lease_timeout: Duration,
    /// After a reader ends a pass (or moves its position), its path (the next pass's first
    /// layers, read ahead) stays protected this long.
    pub idle_protect: Duration,
    /// How long a reader waits while pinned layers leave no room for the one it asks for before
    /// [`super::RingError::Stuck`] (time spent waiting for the disk does not count).
    pub demand_timeout: Duration,
}

/// Default [`RingOptions::lease_timeout`]: far above one layer's compute at full scale, even in
/// a long prefill chunk.
pub const DEFAULT_LEASE_TIMEOUT: Duration = Duration::from_secs(120);
/// Default [`RingOptions::idle_protect`]: above the time from one pass's last streamed layer to
/// the next pass's first (logits, sampling, the pinned prefix) at full scale.
pub const DEFAULT_IDLE_PROTECT: Duration = Duration::from_secs(10);

impl Default for RingOptions {
    fn default() -> Self {
        RingOptions {
            lease_timeout: DEFAULT_LEASE_TIMEOUT,
            idle_protect: DEFAULT_IDLE_PROTECT,
            demand_timeout: DEFAULT_LEASE_TIMEOUT,
        }
    }
}

impl RingOptions {
    /// A ring of one in-process reader (a standalone worker): its path is protected for ever,
    /// and a layer its own pins keep out fails after `demand_timeout`.
    pub fn private(demand_timeout: Duration) -> RingOptions {
        RingOptions {
            lease_timeout: Duration::MAX,
            idle_protect: Duration::MAX,
            demand_timeout,
        }
    }
}

/// Why a layer could not be handed out.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RingError {
    /// The ring cannot be made (too small, no streamed layer, a bad environment setting).
    #[error("{0}")]
    Setup(String),
    /// Not a streamed layer.
    #[error("{0}")]
    BadLayer(String),
    /// The reader's earlier lease was broken.
    #[error("{0}")]
    Broken(String),
    /// The layer's read failed (I/O error or checksum mismatch).
    #[error("{0}")]
    Read(String),
    /// Pinned layers leave no room for the layer asked for.
    #[error("{0}")]
    Stuck(String),
    /// The ring is stopping.
    #[error("the store is stopping")]
    Stopping,
}

/// Ring counters, for the ring's lifetime or one reader.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RingCounters {
    /// Bytes of runs read (per reader: of the reads it used first).
    pub bytes_read: u64,
    /// Layer reads (per reader: the reads it used first).
    pub layer_reads: u64,
    /// Layers handed out.
    pub served: u64,
    /// Hand-outs of a read an earlier hand-out had used already.
    pub shared: u64,
    /// Hand-outs of a layer that was in the ring when asked for (read ahead, or still there from
    /// an earlier pass).
    pub ready_on_demand: u64,
    /// Seconds spent waiting for hand-outs.
    pub wait_seconds: f64,
    /// Leases broken.
    pub broken: u64,
    /// Reads that began beside a held extent and finished once it was released (lifetime).
    pub partial_reads: u64,
    /// Bytes those reads read into the free part of their extent at once (lifetime).
    pub early_bytes: u64,
    /// Layers read and overwritten before anyone used them: wasted reads (lifetime).
    pub evicted_unused: u64,
    /// Seconds the reader thread spent in reads, checks included (lifetime).
    pub read_seconds: f64,
    /// Seconds it spent checking runs against their checksums (lifetime).
    pub verify_seconds: f64,
}

/// The fixed facts the rules work with: which layers stream and how many arena bytes each takes.
pub(super) struct Geometry {
    /// First streamed layer.
    pub first: usize,
    /// Number of layers.
    pub n: usize,
    /// Bytes of the arena.
    pub cap: u64,
    /// Arena bytes of each layer ([`extent_bytes`]).
    lens: Vec<u64>,
    /// Each layer can be read by windows ([`Runs::windowed`]).
    windowed: Vec<bool>,
}

impl Geometry {
    pub fn new(runs: &dyn Runs, first: usize, cap: u64) -> Geometry {
        let n = runs.count();
        Geometry {
            first,
            n,
            cap,
            lens: (0..n).map(|l| extent_bytes(runs, l)).collect(),
            windowed: (0..n).map(|l| runs.windowed(l)).collect(),
        }
    }

    fn n_streamed(&self) -> usize {
        self.n - self.first
    }

    /// The streamed layer after `l`, cyclically.
    pub fn next(&self, l: usize) -> usize {
        if l + 1 >= self.n {
            self.first
        } else {
            l + 1
        }
    }

    /// Steps of the scan from `from` to `l` (0 = `l` itself).
    fn distance(&self, from: usize, l: usize) -> usize {
        let n = self.n_streamed();
        (l + n - from) % n
    }

    /// Arena bytes of layer `l`.
    pub fn len(&self, l: usize) -> u64 {
        self.lens[l]
    }
}

#[derive(Clone, Debug, PartialEq)]
pub(super) enum ExtState {
    /// Claimed by the reader thread, being read (or parked: waiting to read its rest).
    Filling,
    /// Read; the run starts `inner` bytes into the extent.
    Ready { inner: usize },
    /// A read-ahead that failed and that no reader waited for: the error for the next reader
    /// that asks (the layer is read again after that). Occupies nothing.
    Failed(String),
}

/// One layer's bytes in the arena: `[off, off + len)`.
pub(super) struct Extent {
    /// Unique among the ring's extents, ever.
    pub id: u64,
    pub layer: usize,
    pub off: u64,
    pub len: u64,
    pub state: ExtState,
    /// Readers (worker processes) holding a lease on it.
    pub leases: u32,
    /// In-process pins on its bytes.
    pub pins: u32,
    /// Handed out at least once since it was read.
    pub used: bool,
    /// Filling, its free part read, waiting for the holds on the rest to go.
    pub parked: bool,
}

impl Extent {
    pub fn overlaps(&self, off: u64, len: u64) -> bool {
        off < self.off + self.len && self.off < off + len
    }
    fn held(&self) -> bool {
        self.leases > 0 || self.pins > 0
    }
    fn range(&self) -> (u64, u64) {
        (self.off, self.len)
    }
}

/// How long a reader's path counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Protect {
    /// Not now.
    #[default]
    Off,
    /// Until then.
    Until(Instant),
    /// For ever (an in-process reader).
    Always,
}

impl Protect {
    /// Protection for `d` from `now` (for ever when that is past the clock's range).
    pub fn after(now: Instant, d: Duration) -> Protect {
        now.checked_add(d).map_or(Protect::Always, Protect::Until)
    }
    fn live(self, now: Instant) -> bool {
        match self {
            Protect::Off => false,
            Protect::Until(t) => t > now,
            Protect::Always => true,
        }
    }
    fn expired(self, now: Instant) -> bool {
        matches!(self, Protect::Until(t) if t <= now)
    }
}

/// One reader.
#[derive(Default)]
pub(super) struct Consumer {
    /// The streamed layer it asks for next (the one it waits for while `waiting`); `None` before
    /// its first request and after its lease was broken.
    pub pos: Option<usize>,
    /// Blocked waiting for a hand-out.
    pub waiting: bool,
    /// How long its path counts while it does not wait.
    pub protect: Protect,
    /// The extent it leases (a worker process; pins are counted on the extent alone).
    pub lease: Option<u64>,
    /// Why its lease was broken (reported by its next call).
    pub broken: Option<String>,
    /// A failed read of the layer it waits for.
    pub error: Option<String>,
    pub counters: RingCounters,
}

impl Consumer {
    /// Its position, if it counts for scheduling now.
    fn active_pos(&self, now: Instant) -> Option<usize> {
        self.pos.filter(|_| self.waiting || self.protect.live(now))
    }
}

/// A hand-out about to be made ([`State::hand`]).
pub(super) struct HandOut {
    /// A pin (in-process) rather than a lease.
    pub pin: bool,
    /// The reader's path protection from now.
    pub protect: Protect,
    /// The layer was in the ring when asked for.
    pub ready: bool,
    /// Seconds the reader waited.
    pub waited: f64,
    /// Bytes of the run.
    pub run_len: u64,
}

/// A range the reader thread claimed for a read ([`State::claim`]).
pub(super) struct Claim {
    /// The new extent.
    pub id: u64,
    pub layer: usize,
    pub off: u64,
    pub len: u64,
    /// Parts of it `(start, len)` (relative, sorted) still held by extents it overlaps: read
    /// once they are released (a partial read).
    pub busy: Vec<(u64, u64)>,
}

/// What the ring's lock guards.
pub(super) struct State {
    pub extents: Vec<Extent>,
    pub consumers: BTreeMap<ReaderId, Consumer>,
    /// Where the scan reads next (a streamed layer).
    scan: usize,
    /// Where the last extent ended: the next one goes after it.
    cursor: u64,
    /// The reader thread is reading (not parked, not idle).
    pub reading: bool,
    pub shutdown: bool,
    /// The reader thread died: every hand-out fails with this.
    pub dead: Option<String>,
    pub lifetime: RingCounters,
    /// Per layer, the file stamp a ring read whose checksum matched saw (`Some(None)`: the file
    /// has no stamp to compare), for `VerifyMode::First`.
    pub verified: Vec<Option<Option<crate::runtime::io::FileStamp>>>,
    next_extent: u64,
}

impl State {
    pub fn new(first: usize, n: usize) -> State {
        State {
            extents: Vec::new(),
            consumers: BTreeMap::new(),
            scan: first,
            cursor: 0,
            reading: false,
            shutdown: false,
            dead: None,
            lifetime: RingCounters::default(),
            verified: vec![None; n],
            next_extent: 0,
        }
    }

    /// Reader `id` (registered if new).
    pub fn consumer(&mut self, id: ReaderId) -> &mut Consumer {
        self.consumers.entry(id).or_default()
    }

    pub fn any_waiting(&self) -> bool {
        self.consumers.values().any(|c| c.waiting)
    }

    fn extent_mut(&mut self, id: u64) -> Option<&mut Extent> {
        self.extents.iter_mut().find(|e| e.id == id)
    }

    /// Reader `id` asks for layer `l` and waits for it: its earlier lease goes first (`lease`:
    /// a worker process holds one at a time); `Err` reports a lease broken since its last call.
    pub fn ask(&mut self, id: ReaderId, l: usize, lease: bool) -> Result<(), RingError> {
        if lease {
            self.release(id);
        }
        let c = self.consumer(id);
        if let Some(m) = c.broken.take() {
            return Err(RingError::Broken(m));
        }
        c.pos = Some(l);
        c.waiting = true;
        c.error = None;
        Ok(())
    }

    /// What reader `id`, waiting for layer `l`, gets now: the Ready extent's index and where its
    /// run starts in it, an error (it stops waiting), or `None` to wait on.
    pub fn answer(&mut self, id: ReaderId, l: usize) -> Option<Result<(usize, usize), RingError>> {
        let failed = if self.shutdown {
            Some(RingError::Stopping)
        } else if let Some(m) = self.dead.clone().or_else(|| self.consumer(id).error.take()) {
            Some(RingError::Read(m))
        } else {
            let i = self.extents.iter().position(|e| e.layer == l)?;
            match &self.extents[i].state {
                ExtState::Ready { inner } => return Some(Ok((i, *inner))),
                ExtState::Filling => return None,
                // The error of a read-ahead: this reader is told, the next ask reads again.
                ExtState::Failed(m) => {
                    let m = m.clone();
                    self.extents.remove(i);
                    Some(RingError::Read(m))
                }
            }
        };
        self.consumer(id).waiting = false;
        failed.map(Err)
    }

    /// Hand extent `i` to reader `id`; true when this is the first use of its read.
    pub fn hand(&mut self, id: ReaderId, i: usize, h: HandOut, geo: &Geometry) -> bool {
        let e = &mut self.extents[i];
        if h.pin {
            e.pins += 1;
        } else {
            e.leases += 1;
        }
        let fresh = !e.used;
        e.used = true;
        let (layer, ext) = (e.layer, e.id);
        let c = self.consumers.entry(id).or_default();
        if !h.pin {
            c.lease = Some(ext);
        }
        c.pos = Some(geo.next(layer));
        c.waiting = false;
        c.protect = h.protect;
        for k in [&mut c.counters, &mut self.lifetime] {
            k.served += 1;
            k.wait_seconds += h.waited;
            k.shared += u64::from(!fresh);
            k.ready_on_demand += u64::from(h.ready);
        }
        if fresh {
            c.counters.layer_reads += 1;
            c.counters.bytes_read += h.run_len;
        }
        fresh
    }

    /// Release reader `id`'s lease, if any.
    pub fn release(&mut self, id: ReaderId) {
        let Some(ext) = self.consumers.get_mut(&id).and_then(|c| c.lease.take()) else {
            return;
        };
        if let Some(e) = self.extent_mut(ext) {
            e.leases = e.leases.saturating_sub(1);
        }
    }

    /// One pin on extent `ext` is gone.
    pub fn unpin(&mut self, ext: u64) {
        if let Some(e) = self.extent_mut(ext) {
            e.pins = e.pins.saturating_sub(1);
        }
    }

    /// Break the leases held past their protection (called while a reader waits and the ring has
    /// no room): their extents may be overwritten, their holders' next call fails.
    pub fn break_stale(&mut self, now: Instant, lease_timeout: Duration) {
        let stale: Vec<ReaderId> = (self.consumers.iter())
            .filter(|(_, c)| c.lease.is_some() && !c.waiting && c.protect.expired(now))
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.release(id);
            let c = self.consumer(id);
            c.broken = Some(format!(
                "this job held a trunk layer of the store's ring for more than {:.0} s while \
                 other jobs waited; the store broke its lease (the layer may have been \
                 overwritten) and the job must stop",
                lease_timeout.as_secs_f64()
            ));
            c.pos = None;
            c.protect = Protect::Off;
            c.counters.broken += 1;
            self.lifetime.broken += 1;
            tracing::warn!("reader {id}: trunk lease broken after the lease limit");
        }
    }

    fn ready(&self, l: usize) -> bool {
        (self.extents.iter()).any(|e| e.layer == l && matches!(e.state, ExtState::Ready { .. }))
    }

    fn missing(&self, l: usize) -> bool {
        !self.extents.iter().any(|e| e.layer == l)
    }

    /// The first layer at or after `from` (cyclically) that is not ready in the ring (missing,
    /// being read or failed); `None` when all are ready.
    fn frontier(&self, geo: &Geometry, from: usize) -> Option<usize> {
        let mut l = from;
        for _ in 0..geo.n_streamed() {
            if !self.ready(l) {
                return Some(l);
            }
            l = geo.next(l);
        }
        None
    }

    /// The protected readers' `(position, frontier)`.
    fn paths(&self, geo: &Geometry, now: Instant) -> Vec<(usize, usize)> {
        (self.consumers.values())
            .filter_map(|c| c.active_pos(now))
            .filter_map(|p| self.frontier(geo, p).map(|f| (p, f)))
            .collect()
    }

    /// Per layer: on some protected reader's path (it will use that layer before its next read).
    fn on_paths(geo: &Geometry, paths: &[(usize, usize)]) -> Vec<bool> {
        (0..geo.n)
            .map(|l| {
                l >= geo.first
                    && (paths.iter()).any(|&(p, f)| geo.distance(p, l) < geo.distance(p, f))
            })
            .collect()
    }

    /// What the reader thread reads next and where, or `None` to wait (nothing needed, or no
    /// room yet).
    ///
    /// The target is the scan's next missing layer when it is some reader's frontier, else the
    /// frontier nearest ahead of the scan (a failed frontier waits for its reader to ask again).
    /// The placement avoids every extent that is held, being read or on a path. When none fits
    /// and the layer can be read by windows, it may overlap extents that are held but on no path
    /// — in use by their holders, needed by nobody after them: a partial claim, whose free part
    /// is read at once and the rest when those holds are gone.
    pub fn next_read(&self, geo: &Geometry, now: Instant) -> Option<(usize, u64)> {
        let paths = self.paths(geo, now);
        let wanted: Vec<usize> = (paths.iter())
            .map(|&(_, f)| f)
            .filter(|&f| self.missing(f))
            .collect();
        let s = self.frontier(geo, self.scan)?;
        let target = if wanted.contains(&s) {
            s
        } else {
            wanted.into_iter().min_by_key(|&f| geo.distance(s, f))?
        };
        let on_path = Self::on_paths(geo, &paths);
        let ranges = |keep: &dyn Fn(&Extent) -> bool| -> Vec<(u64, u64)> {
            self.extents
                .iter()
                .filter(|e| keep(e))
                .map(Extent::range)
                .collect()
        };
        let filling = |e: &Extent| e.state == ExtState::Filling;
        let needed = |e: &Extent| filling(e) || on_path[e.layer];
        let blocked = ranges(&|e| e.held() || needed(e));
        let len = geo.len(target);
        if let Some(off) = place(geo.cap, len, self.cursor, &blocked) {
            return Some((target, off));
        }
        if !geo.windowed[target] {
            return None;
        }
        let hard = ranges(&needed);
        let soft = ranges(&|e| e.held() && !needed(e));
        place_min_overlap(geo.cap, len, self.cursor, &hard, &soft)
            .filter(|&(_, overlap)| overlap < len)
            .map(|(off, _)| (target, off))
    }

    /// True when only pins keep layer `l` out: the reader thread waits for pinned bytes to finish
    /// a partial read, or `l` fits nowhere beside the pinned extents.
    pub fn stuck_on_pins(&self, geo: &Geometry, l: usize) -> bool {
        let pinned: Vec<&Extent> = self.extents.iter().filter(|e| e.pins > 0).collect();
        let parked = (self.extents.iter().filter(|e| e.parked))
            .any(|p| pinned.iter().any(|e| e.overlaps(p.off, p.len)));
        let held: Vec<(u64, u64)> = pinned.iter().map(|e| e.range()).collect();
        parked || place(geo.cap, geo.len(l), self.cursor, &held).is_none()
    }

    /// Claim `[off, off + len(l))` for reading layer `l`: the extents it overlaps go, except held
    /// ones (a partial claim: [`State::next_read`] kept clear of everything else in use, being
    /// read or on a path), and the new extent is Filling.
    pub fn claim(&mut self, geo: &Geometry, l: usize, off: u64) -> Claim {
        let len = geo.len(l);
        let mut busy = Vec::new();
        let mut wasted = 0;
        self.extents.retain(|e| {
            if !e.overlaps(off, len) {
                return true;
            }
            if e.held() {
                let s = e.off.max(off);
                busy.push((s - off, (e.off + e.len).min(off + len) - s));
                return true;
            }
            wasted += u64::from(!e.used && matches!(e.state, ExtState::Ready { .. }));
            false
        });
        busy.sort_unstable();
        self.lifetime.evicted_unused += wasted;
        self.next_extent += 1;
        let id = self.next_extent;
        self.extents.push(Extent {
            id,
            layer: l,
            off,
            len,
            state: ExtState::Filling,
            leases: 0,
            pins: 0,
            used: false,
            parked: false,
        });
        self.cursor = off + len;
        self.scan = geo.next(l);
        self.reading = true;
        Claim {
            id,
            layer: l,
            off,
            len,
            busy,
        }
    }

    /// Mark claim `c` parked (its free part read) or going on.
    pub fn park(&mut self, c: &Claim, parked: bool) {
        if let Some(e) = self.extent_mut(c.id) {
            e.parked = parked;
        }
        self.reading = !parked;
    }

    /// True while an extent that claim `c` overlaps is held or on a protected path.
    pub fn claim_blocked(&self, geo: &Geometry, c: &Claim, now: Instant) -> bool {
        let on_path = Self::on_paths(geo, &self.paths(geo, now));
        (self.extents.iter())
            .any(|e| e.id != c.id && e.overlaps(c.off, c.len) && (e.held() || on_path[e.layer]))
    }

    /// Drop the extents claim `c` overlaps (none is held or needed any more).
    pub fn take_rest(&mut self, c: &Claim) {
        self.extents
            .retain(|e| e.id == c.id || !e.overlaps(c.off, c.len));
    }

    /// Publish claim `c`'s read: Ready, or the error for the readers waiting for it (kept for
    /// the next one to ask when none waits).
    pub fn publish(&mut self, c: &Claim, res: Result<usize, RunError>, run_len: u64) {
        self.reading = false;
        match res {
            Ok(inner) => {
                if let Some(e) = self.extent_mut(c.id) {
                    e.state = ExtState::Ready { inner };
                }
                self.lifetime.layer_reads += 1;
                self.lifetime.bytes_read += run_len;
            }
            Err(e) => {
                let l = c.layer;
                let m = e.to_string();
                let m = if m.starts_with(&format!("trunk layer {l}:")) {
                    m
                } else {
                    format!("trunk layer {l}: {m}")
                };
                tracing::warn!("ring: {m}");
                let mut told = false;
                for w in self.consumers.values_mut() {
                    if w.waiting && w.pos == Some(l) {
                        w.error = Some(m.clone());
                        told = true;
                    }
                }
                if told {
                    self.extents.retain(|e| e.id != c.id);
                } else if let Some(e) = self.extent_mut(c.id) {
                    e.state = ExtState::Failed(m);
                }
            }
        }
    }

    /// Streamed layers in the arena (any state), ascending.
    #[cfg(test)]
    pub fn present(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.extents.iter().map(|e| e.layer).collect();
        v.sort_unstable();
        v
    }
}
