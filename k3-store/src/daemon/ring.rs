//! The store's trunk ring: one stream of the unpinned layers, shared by every attached worker
//! (SPEC.md §6.8).
//!
//! Below full residency the layers after the pinned prefix are read into one **ring** in the
//! store's shared memory, inside the trunk budget. A worker asks for a layer
//! ([`SharedRing::acquire`], `Request::TrunkLayer`), computes on it in place under a lease and
//! gives it back when it asks for the next one or ends its pass ([`SharedRing::end_pass`]).
//!
//! **One cyclic scan.** The reader thread reads the streamed layers in one cyclic order, the
//! *scan*: the next read is the first layer at or after the scan position that is not in the
//! ring. Every worker that needs a layer while it is in the ring computes on the same bytes, so
//! workers that run their passes together (a *convoy*) cost one read per layer per sweep,
//! however many they are. A worker's *path* is the run of layers in the ring from the one it will
//! ask for next up to the first one missing (its *frontier*); it is in the convoy when its
//! frontier is the scan's next read. When some worker is in the convoy the scan goes on; when
//! none is (one worker starting its pass elsewhere, or the convoy gone), the scan jumps to the
//! nearest frontier ahead of it. A worker joining mid-sweep therefore waits at most one sweep
//! and then runs with the convoy.
//!
//! **Eviction** (the Belady rule of the private ring, for several readers): a read may overwrite
//! an extent only when no lease holds it, it is not being read, and it is on no worker's path —
//! no worker will use it before its next read. Reading never waits for a worker that waits
//! itself (a waiting worker's path is empty), so the ring cannot deadlock; it waits only for
//! workers that compute. When the next read fits nowhere else, it may begin beside a leased
//! extent that no other worker needs (a *partial* claim, page-aligned windows of the run) and
//! finish once that lease is gone, so one worker's compute still overlaps the next read in a
//! ring smaller than two layers.
//!
//! **Bounded waits.** A worker's protection of its path lasts while it computes: until
//! `lease_timeout` after its last layer was handed out, or `idle_protect` after it ended a pass
//! (a chat waiting for its user does not hold the ring). A lease held past `lease_timeout` while
//! another worker waits is *broken*: the reader may overwrite it, and the holder's next request
//! fails with `LeaseBroken`, so what it computed on those bytes is never emitted.
//!
//! The ring bytes are written only by the reader, only in a range no lease overlaps (decided
//! under the lock, where leases are also made); workers map them read-only.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::ConnId;
use crate::runtime::arena::{place, place_min_overlap, ArenaMem};
use crate::runtime::io::align_up;
use crate::runtime::stream::{free_windows, read_windows, verify_extent, VerifyMode};
use crate::runtime::trunk::TrunkLayout;

/// How the ring bounds what a worker may hold.
#[derive(Clone, Debug)]
pub struct RingOptions {
    /// A lease (and the path protected behind it) lasts this long after the layer was handed
    /// out; past it, and while another worker waits, the lease is broken.
    pub lease_timeout: Duration,
    /// After a worker ends a pass, its path (the next pass's first layers, read ahead) stays
    /// protected this long.
    pub idle_protect: Duration,
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
        }
    }
}

/// Ring counters, for the store's lifetime or one connection.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RingCounters {
    /// Bytes of layer runs read (per connection: of the reads it used first).
    pub bytes_read: u64,
    /// Layer reads (per connection: the reads it used first).
    pub layer_reads: u64,
    /// Layers handed out.
    pub served: u64,
    /// Hand-outs of a read an earlier hand-out had used already.
    pub shared: u64,
    /// Seconds spent waiting in [`SharedRing::acquire`].
    pub wait_seconds: f64,
    /// Leases broken.
    pub broken: u64,
    /// Reads that began beside a leased extent and finished once it was released (lifetime).
    pub partial_reads: u64,
}

/// A layer handed out: its run at `offset..offset + len` of the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// Offset of the run in the ring.
    pub offset: u64,
    /// Bytes of the run.
    pub len: u64,
    /// First use of this read.
    pub fresh: bool,
}

/// Why a layer could not be handed out.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RingError {
    /// Not a streamed layer.
    #[error("{0}")]
    BadLayer(String),
    /// The connection's earlier lease was broken.
    #[error("{0}")]
    Broken(String),
    /// The layer's read failed (I/O error or checksum mismatch).
    #[error("{0}")]
    Read(String),
    /// The store is stopping.
    #[error("the store is stopping")]
    Stopping,
}

#[derive(Clone, Debug, PartialEq)]
enum ExtState {
    Filling,
    Ready { inner: usize },
}

/// One layer's bytes in the ring: `[off, off + len)`.
struct Extent {
    layer: usize,
    off: u64,
    len: u64,
    state: ExtState,
    /// Connections holding a lease on it.
    leases: u32,
    /// Handed out at least once since it was read.
    used: bool,
}

impl Extent {
    fn overlaps(&self, off: u64, len: u64) -> bool {
        off < self.off + self.len && self.off < off + len
    }
}

/// One worker connection.
#[derive(Default)]
struct Consumer {
    /// The streamed layer it asks for next (the one it waits for while `waiting`); `None` before
    /// its first request.
    pos: Option<usize>,
    /// Blocked in [`SharedRing::acquire`].
    waiting: bool,
    /// Its path is protected until then (while not waiting).
    until: Option<Instant>,
    /// Its lease: (layer, extent offset).
    lease: Option<(usize, u64)>,
    /// Why its lease was broken (reported by its next request).
    broken: Option<String>,
    /// A failed read of the layer it waits for.
    error: Option<String>,
    counters: RingCounters,
}

impl Consumer {
    /// Its position, if it counts for scheduling now.
    fn active_pos(&self, now: Instant) -> Option<usize> {
        let live = self.waiting || self.until.is_some_and(|u| u > now);
        self.pos.filter(|_| live)
    }
}

struct State {
    extents: Vec<Extent>,
    consumers: BTreeMap<ConnId, Consumer>,
    /// Where the scan reads next (a streamed layer).
    scan: usize,
    /// Where the last extent ended: the next one goes after it.
    cursor: u64,
    reading: bool,
    shutdown: bool,
    lifetime: RingCounters,
    /// Layers whose checksum a ring read has matched (for [`VerifyMode::First`]).
    verified: Vec<bool>,
}

struct Shared {
    st: Mutex<State>,
    cv: Condvar,
    layout: Arc<TrunkLayout>,
    mem: ArenaMem,
    first: usize,
    verify: VerifyMode,
    opts: RingOptions,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn n(&self) -> usize {
        self.layout.n_layers()
    }
    fn n_streamed(&self) -> usize {
        self.n() - self.first
    }
    fn next(&self, l: usize) -> usize {
        if l + 1 >= self.n() {
            self.first
        } else {
            l + 1
        }
    }
    /// Steps of the scan from `from` to `l`.
    fn distance(&self, from: usize, l: usize) -> usize {
        let n = self.n_streamed();
        (l + n - from) % n
    }
    fn extent_len(&self, l: usize) -> u64 {
        align_up(self.layout.buf_len(l)).unwrap_or(u64::MAX)
    }
}

/// The first layer at or after `from` (cyclically) that is not ready in the ring (missing, or
/// being read); `None` when all are ready.
fn frontier(sh: &Shared, st: &State, from: usize) -> Option<usize> {
    let mut l = from;
    for _ in 0..sh.n_streamed() {
        if !st
            .extents
            .iter()
            .any(|e| e.layer == l && e.state != ExtState::Filling)
        {
            return Some(l);
        }
        l = sh.next(l);
    }
    None
}

/// The active workers' `(position, frontier)`.
fn paths(sh: &Shared, st: &State, now: Instant) -> Vec<(usize, usize)> {
    st.consumers
        .values()
        .filter_map(|c| c.active_pos(now))
        .filter_map(|p| frontier(sh, st, p).map(|f| (p, f)))
        .collect()
}

/// Per layer: on some active worker's path (it will use that layer before its next read).
fn on_paths(sh: &Shared, paths: &[(usize, usize)]) -> Vec<bool> {
    (0..sh.n())
        .map(|l| {
            l >= sh.first
                && paths
                    .iter()
                    .any(|&(p, f)| sh.distance(p, l) < sh.distance(p, f))
        })
        .collect()
}

/// What the reader reads next and where, or `None` to wait (nothing needed, or no room yet).
///
/// The placement avoids every extent that is leased, being read or on a path. When none fits
/// and the layer's run can be read by windows (a packed trunk), it may overlap extents that are
/// leased but on no path — in use by their holders, needed by nobody after them: a *partial*
/// claim, whose free part is read at once and the rest when those leases are gone (the private
/// stream's partial read-ahead, §6.8; e.g. layer 1 beside the 2.34 GB layer 0 in a 3 GB ring).
fn next_read(sh: &Shared, st: &State, now: Instant) -> Option<(usize, u64)> {
    let paths = paths(sh, st, now);
    if paths.is_empty() {
        return None;
    }
    let s = frontier(sh, st, st.scan)?;
    let target = if paths.iter().any(|&(_, f)| f == s) {
        s
    } else {
        paths
            .iter()
            .map(|&(_, f)| f)
            .min_by_key(|&f| sh.distance(s, f))?
    };
    let on_path = on_paths(sh, &paths);
    let range = |e: &Extent| (e.off, e.len);
    let blocked: Vec<(u64, u64)> = (st.extents.iter())
        .filter(|e| e.leases > 0 || e.state == ExtState::Filling || on_path[e.layer])
        .map(range)
        .collect();
    let (cap, len) = (sh.mem.len() as u64, sh.extent_len(target));
    if let Some(off) = place(cap, len, st.cursor, &blocked) {
        return Some((target, off));
    }
    if !sh.layout.windowed(target) {
        return None;
    }
    let hard: Vec<(u64, u64)> = (st.extents.iter())
        .filter(|e| e.state == ExtState::Filling || on_path[e.layer])
        .map(range)
        .collect();
    let soft: Vec<(u64, u64)> = (st.extents.iter())
        .filter(|e| e.leases > 0 && e.state != ExtState::Filling && !on_path[e.layer])
        .map(range)
        .collect();
    place_min_overlap(cap, len, st.cursor, &hard, &soft)
        .filter(|&(_, overlap)| overlap < len)
        .map(|(off, _)| (target, off))
}

/// Release `c`'s lease, if any.
fn release(st: &mut State, conn: ConnId) {
    let Some(c) = st.consumers.get_mut(&conn) else {
        return;
    };
    if let Some((layer, off)) = c.lease.take() {
        if let Some(e) = st
            .extents
            .iter_mut()
            .find(|e| e.layer == layer && e.off == off)
        {
            e.leases = e.leases.saturating_sub(1);
        }
    }
}

/// Break the leases held past the limit (called while a worker waits and the ring is full).
fn break_stale(sh: &Shared, st: &mut State, now: Instant) {
    let stale: Vec<ConnId> = st
        .consumers
        .iter()
        .filter(|(_, c)| c.lease.is_some() && !c.waiting && c.until.is_some_and(|u| u <= now))
        .map(|(id, _)| *id)
        .collect();
    for id in stale {
        release(st, id);
        if let Some(c) = st.consumers.get_mut(&id) {
            let msg = format!(
                "this job held a trunk layer of the store's ring for more than {:.0} s while \
                 other jobs waited; the store broke its lease (the layer may have been \
                 overwritten) and the job must stop",
                sh.opts.lease_timeout.as_secs_f64()
            );
            tracing::warn!("connection {id}: trunk lease broken after the lease limit");
            c.broken = Some(msg);
            c.pos = None;
            c.until = None;
            c.counters.broken += 1;
            st.lifetime.broken += 1;
        }
    }
}

/// The store's trunk ring and its reader thread.
pub struct SharedRing {
    sh: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for SharedRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SharedRing({} bytes, layers {}..{})",
            self.sh.mem.len(),
            self.sh.first,
            self.sh.n()
        )
    }
}

impl SharedRing {
    /// Stream layers `first..` of `layout` through `mem` (at least the largest of them).
    pub fn new(
        layout: Arc<TrunkLayout>,
        first: usize,
        mem: ArenaMem,
        opts: RingOptions,
    ) -> Result<SharedRing, String> {
        let n = layout.n_layers();
        if first >= n {
            return Err(format!("no streamed layer: {first} of {n} are pinned"));
        }
        let need = (first..n)
            .map(|l| align_up(layout.buf_len(l)).unwrap_or(u64::MAX))
            .max()
            .unwrap_or(0);
        if (mem.len() as u64) < need {
            return Err(format!(
                "a trunk ring of {} bytes cannot hold the largest streamed layer ({need} bytes)",
                mem.len()
            ));
        }
        let verify = VerifyMode::from_env()?;
        let sh = Arc::new(Shared {
            st: Mutex::new(State {
                extents: Vec::new(),
                consumers: BTreeMap::new(),
                scan: first,
                cursor: 0,
                reading: false,
                shutdown: false,
                lifetime: RingCounters::default(),
                verified: vec![false; n],
            }),
            cv: Condvar::new(),
            layout,
            mem,
            first,
            verify,
            opts,
        });
        let s = sh.clone();
        let thread = std::thread::Builder::new()
            .name("k3-ring-reader".into())
            .spawn(move || reader(&s))
            .map_err(|e| format!("cannot start the ring reader: {e}"))?;
        Ok(SharedRing {
            sh,
            thread: Some(thread),
        })
    }

    /// First streamed layer.
    pub fn first(&self) -> usize {
        self.sh.first
    }

    /// Bytes of the ring.
    pub fn len(&self) -> usize {
        self.sh.mem.len()
    }

    /// True for an empty ring (never: [`SharedRing::new`] refuses one).
    pub fn is_empty(&self) -> bool {
        self.sh.mem.len() == 0
    }

    /// Hand layer `l` to `conn` under a lease, releasing its earlier lease; blocks until the layer
    /// is in the ring.
    pub fn acquire(&self, conn: ConnId, l: usize) -> Result<Grant, RingError> {
        let sh = &self.sh;
        if l < sh.first || l >= sh.n() {
            return Err(RingError::BadLayer(format!(
                "layer {l} is not streamed (streamed layers: {}..{})",
                sh.first,
                sh.n()
            )));
        }
        let run_len = sh.layout.plan(l).map(|p| p.run_len).unwrap_or(0);
        let t0 = Instant::now();
        let mut g = sh.lock();
        release(&mut g, conn);
        let c = g.consumers.entry(conn).or_default();
        if let Some(m) = c.broken.take() {
            return Err(RingError::Broken(m));
        }
        c.pos = Some(l);
        c.waiting = true;
        c.error = None;
        sh.cv.notify_all();
        loop {
            if g.shutdown {
                if let Some(c) = g.consumers.get_mut(&conn) {
                    c.waiting = false;
                }
                return Err(RingError::Stopping);
            }
            let st = &mut *g;
            let c = st.consumers.entry(conn).or_default();
            if let Some(m) = c.error.take() {
                c.waiting = false;
                return Err(RingError::Read(m));
            }
            let ready = st.extents.iter_mut().find_map(|e| match e.state {
                ExtState::Ready { inner } if e.layer == l => Some((e, inner)),
                _ => None,
            });
            if let Some((e, inner)) = ready {
                e.leases += 1;
                let fresh = !e.used;
                e.used = true;
                let (off, eoff) = (e.off + inner as u64, e.off);
                let waited = t0.elapsed().as_secs_f64();
                let c = st.consumers.entry(conn).or_default();
                c.lease = Some((l, eoff));
                c.pos = Some(sh.next(l));
                c.waiting = false;
                c.until = Some(Instant::now() + sh.opts.lease_timeout);
                for k in [&mut c.counters, &mut st.lifetime] {
                    k.served += 1;
                    k.wait_seconds += waited;
                    if !fresh {
                        k.shared += 1;
                    }
                }
                if fresh {
                    c.counters.layer_reads += 1;
                    c.counters.bytes_read += run_len;
                }
                drop(g);
                sh.cv.notify_all();
                return Ok(Grant {
                    offset: off,
                    len: run_len,
                    fresh,
                });
            }
            g = sh
                .cv
                .wait_timeout(g, Duration::from_millis(500))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// `conn` is done with the streamed layers of this pass: release its lease. `Err` when the
    /// lease was broken while it was held.
    pub fn end_pass(&self, conn: ConnId) -> Result<(), RingError> {
        let sh = &self.sh;
        let mut g = sh.lock();
        release(&mut g, conn);
        let c = g.consumers.entry(conn).or_default();
        let broken = c.broken.take();
        c.until = Some(Instant::now() + sh.opts.idle_protect);
        drop(g);
        sh.cv.notify_all();
        broken.map_or(Ok(()), |m| Err(RingError::Broken(m)))
    }

    /// `conn` gives its lease back mid-pass (it copied what it still reads, `ReleaseTrunk`): the
    /// extent may be overwritten at once; its path stays protected as while it computes. `Err`
    /// when the lease was broken while held.
    pub fn release_lease(&self, conn: ConnId) -> Result<(), RingError> {
        let sh = &self.sh;
        let mut g = sh.lock();
        release(&mut g, conn);
        let broken = g.consumers.get_mut(&conn).and_then(|c| c.broken.take());
        drop(g);
        sh.cv.notify_all();
        broken.map_or(Ok(()), |m| Err(RingError::Broken(m)))
    }

    /// `conn` is gone: release its lease and forget it; its counters.
    pub fn remove(&self, conn: ConnId) -> RingCounters {
        let mut g = self.sh.lock();
        release(&mut g, conn);
        let c = g.consumers.remove(&conn);
        drop(g);
        self.sh.cv.notify_all();
        c.map(|c| c.counters).unwrap_or_default()
    }

    /// Counters since the store started.
    pub fn lifetime(&self) -> RingCounters {
        self.sh.lock().lifetime.clone()
    }

    /// `conn`'s counters so far.
    pub fn job(&self, conn: ConnId) -> RingCounters {
        (self.sh.lock().consumers.get(&conn))
            .map(|c| c.counters.clone())
            .unwrap_or_default()
    }

    /// Wake every waiter with [`RingError::Stopping`] and stop reading.
    pub fn shutdown(&self) {
        self.sh.lock().shutdown = true;
        self.sh.cv.notify_all();
    }
}

impl Drop for SharedRing {
    fn drop(&mut self) {
        self.shutdown();
        if let Some(t) = self.thread.take() {
            // Joined even while a read is in progress: the ring memory is the store's segment,
            // which must outlive every write into it (it does: the backend drops the ring
            // first).
            let _ = t.join();
        }
    }
}

/// The reader thread.
fn reader(sh: &Shared) {
    let mut g = sh.lock();
    loop {
        if g.shutdown {
            return;
        }
        let now = Instant::now();
        let Some((l, off)) = next_read(sh, &g, now) else {
            if g.consumers.values().any(|c| c.waiting) {
                // A worker waits and there is no room: leases held past the limit go.
                break_stale(sh, &mut g, now);
                if next_read(sh, &g, now).is_some() {
                    continue;
                }
            }
            // Protections expire with time: look again now and then.
            g = sh
                .cv
                .wait_timeout(g, Duration::from_millis(200))
                .unwrap_or_else(|p| p.into_inner())
                .0;
            continue;
        };
        let len = sh.extent_len(l);
        // Claim [off, off+len): the extents it overlaps go, except leased ones (a partial claim:
        // `next_read` kept clear of everything else that is in use, being read or on a path).
        let mut busy: Vec<(u64, u64)> = Vec::new();
        g.extents.retain(|e| {
            if !e.overlaps(off, len) {
                return true;
            }
            if e.leases > 0 {
                let s = e.off.max(off);
                busy.push((s - off, (e.off + e.len).min(off + len) - s));
                return true;
            }
            false
        });
        busy.sort_unstable();
        g.extents.push(Extent {
            layer: l,
            off,
            len,
            state: ExtState::Filling,
            leases: 0,
            used: false,
        });
        g.cursor = off + len;
        g.scan = sh.next(l);
        g.reading = true;
        drop(g);
        let t0 = Instant::now();
        let mut res = if busy.is_empty() {
            // SAFETY: [off, off+len) is inside the ring (`place` checks against its length) and
            // was just claimed under the lock: every extent overlapping it was dropped, none of
            // them leased (leases are made under the same lock, only on Ready extents), and a
            // Filling extent is neither leased nor claimed again until this read is published.
            // Nothing in this process reads ring bytes outside a lease or this thread.
            let dst = unsafe { sh.mem.range_mut(off as usize, len as usize) };
            sh.layout.read_layer(l, dst).map_err(|e| e.0)
        } else {
            // SAFETY: the windows lie inside the extent claimed for this read (inside the ring)
            // and exclude the leased extents it overlaps; the claim dropped every other extent
            // it overlaps, under the lock where leases are made, and the claimed extent is
            // Filling: never leased meanwhile.
            unsafe { read_windows(&sh.layout, &sh.mem, l, off, &free_windows(len, &busy)) }
        };
        if !busy.is_empty() && res.is_ok() {
            sh.lock().lifetime.partial_reads += 1;
            // The rest once the overlapped extents are neither leased nor on a path (paths end
            // at this read: a worker waiting for it needs nothing behind it, so no deadlock).
            let me = |e: &Extent| e.layer == l && e.off == off;
            g = sh.lock();
            loop {
                if g.shutdown {
                    return;
                }
                let now = Instant::now();
                let on_path = on_paths(sh, &paths(sh, &g, now));
                let held = |e: &Extent| {
                    !me(e) && e.overlaps(off, len) && (e.leases > 0 || on_path[e.layer])
                };
                if !g.extents.iter().any(held) {
                    break;
                }
                if g.consumers.values().any(|c| c.waiting) {
                    break_stale(sh, &mut g, now);
                }
                g = sh
                    .cv
                    .wait_timeout(g, Duration::from_millis(200))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            g.extents.retain(|e| me(e) || !e.overlaps(off, len));
            drop(g);
            let windows: Vec<(u64, u64)> = busy.iter().map(|&(s, n)| (s, s + n)).collect();
            // SAFETY: as above; the leased extents these windows overlapped were neither leased
            // nor on a path any more and were dropped under the lock before this read.
            res = unsafe { read_windows(&sh.layout, &sh.mem, l, off, &windows) };
        }
        let run_len = sh.layout.plan(l).map(|p| p.run_len).unwrap_or(0);
        let check = match sh.verify {
            VerifyMode::Off => false,
            VerifyMode::First => !sh.lock().verified.get(l).copied().unwrap_or(false),
            VerifyMode::Every => true,
        };
        if check {
            if let Ok(inner) = res {
                // SAFETY: this layer's extent is in the ring, still Filling (ours alone), and its
                // writes above have returned.
                res = unsafe { verify_extent(&sh.layout, &sh.mem, l, (off, len), inner) };
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        g = sh.lock();
        g.reading = false;
        let me = |e: &Extent| e.layer == l && e.off == off;
        match res {
            Ok(inner) => {
                if check {
                    if let Some(v) = g.verified.get_mut(l) {
                        *v = true;
                    }
                }
                if let Some(e) = g.extents.iter_mut().find(|e| me(e)) {
                    e.state = ExtState::Ready { inner };
                }
                g.lifetime.layer_reads += 1;
                g.lifetime.bytes_read += run_len;
                tracing::debug!("ring: layer {l} read in {secs:.3} s");
            }
            Err(m) => {
                g.extents.retain(|e| !me(e));
                tracing::warn!("ring: reading trunk layer {l} failed: {m}");
                for c in g.consumers.values_mut() {
                    if c.waiting && c.pos == Some(l) {
                        c.error = Some(format!("trunk layer {l}: {m}"));
                    }
                }
            }
        }
        sh.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::{self, Rng, Spec};
    use crate::runtime::trunk::open_shards;

    fn layout(w: &fixture::Written) -> Arc<TrunkLayout> {
        Arc::new(TrunkLayout::from_catalog(
            &w.catalog,
            open_shards(&w.catalog).unwrap(),
        ))
    }

    fn ext(layout: &TrunkLayout, l: usize) -> u64 {
        align_up(layout.buf_len(l)).unwrap()
    }

    fn ring(layout: Arc<TrunkLayout>, first: usize, bytes: u64, lease_ms: u64) -> SharedRing {
        let mem = ArenaMem::new(bytes as usize).unwrap();
        let opts = RingOptions {
            lease_timeout: Duration::from_millis(lease_ms),
            idle_protect: Duration::from_millis(lease_ms),
        };
        SharedRing::new(layout, first, mem, opts).unwrap()
    }

    /// The bytes a grant points at are layer `l`'s run as the checkpoint has it.
    fn check(spec: &Spec, r: &SharedRing, l: usize, g: Grant) {
        let plan = r.sh.layout.plan(l).unwrap();
        // SAFETY: test code; the grant's lease is held by the caller while it looks, so the reader
        // does not write these bytes.
        let run = unsafe { r.sh.mem.range(g.offset as usize, g.len as usize) };
        for t in plan.layout.tensors() {
            let got = &run[t.off as usize..(t.off + t.nbytes) as usize];
            assert!(
                got == &fixture::expected_tensor(spec, &t.name)[..],
                "layer {l}: {} has other bytes",
                t.name
            );
        }
    }

    /// Several workers, each running passes over the streamed layers with random compute
    /// times, always get their layer's bytes, never someone else's, whatever the ring size; and
    /// workers that run together share reads.
    #[test]
    fn concurrent_workers_get_their_layers_and_share_reads() {
        let spec = Spec::small(5, 2);
        let w = fixture::write(&spec, "ring-conc");
        let lay = layout(&w);
        let first = 1;
        let largest = (first..5).map(|l| ext(&lay, l)).max().unwrap();
        // Ring sizes: one layer; a layer and a quarter (partial claims beside a leased layer); two;
        // four.
        let quarter = align_up(largest / 4).unwrap();
        let sizes = [largest, largest + quarter, 2 * largest, 4 * largest];
        for (k, bytes) in sizes.into_iter().enumerate() {
            let r = Arc::new(ring(lay.clone(), first, bytes, 10_000));
            let passes = 6;
            let jobs: Vec<RingCounters> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..3u64)
                    .map(|wkr| {
                        let (r, spec) = (r.clone(), &spec);
                        s.spawn(move || {
                            let mut rng = Rng(11 + wkr + 7 * k as u64);
                            for _ in 0..passes {
                                for l in first..5 {
                                    let g = r.acquire(wkr, l).unwrap();
                                    check(spec, &r, l, g);
                                    std::thread::sleep(Duration::from_micros(rng.below(1500)));
                                    check(spec, &r, l, g);
                                }
                                r.end_pass(wkr).unwrap();
                            }
                            r.remove(wkr)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let lt = r.lifetime();
            assert_eq!(lt.served, 3 * passes * 4, "{lt:?}");
            for j in &jobs {
                // Every hand-out is either the first use of a read (charged) or a shared one.
                assert_eq!(j.served, passes * 4, "{j:?}");
                assert_eq!(j.layer_reads + j.shared, j.served, "{j:?}");
            }
            // Each read is charged to one job at most.
            let charged: u64 = jobs.iter().map(|j| j.layer_reads).sum();
            assert!(charged <= lt.layer_reads, "{charged} > {lt:?}");
            assert!(jobs.iter().map(|j| j.bytes_read).sum::<u64>() <= lt.bytes_read);
            // Three workers that run together: far fewer reads than three private streams.
            assert!(
                lt.layer_reads <= 2 * passes * 4,
                "ring {bytes}: {} reads for {} hand-outs",
                lt.layer_reads,
                lt.served
            );
            assert_eq!(lt.broken, 0);
        }
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    /// One worker alone: each streamed layer is read once per pass (ring of one layer) or once
    /// in all (a ring holding them all); in a ring of a layer and a quarter the next layer's read
    /// begins beside the held one (a partial claim) and its bytes are right.
    #[test]
    fn one_worker_reads_each_layer_once_per_pass() {
        let spec = Spec::small(4, 2);
        let w = fixture::write(&spec, "ring-one");
        let lay = layout(&w);
        let all: u64 = (0..4).map(|l| ext(&lay, l)).sum();
        let largest = (0..4).map(|l| ext(&lay, l)).max().unwrap();
        assert!((0..4).all(|l| lay.windowed(l)), "contiguous runs");
        let quarter = align_up(largest / 4).unwrap();
        // (ring, reads in all, some reads begin beside the leased layer: must, must not, may)
        for (bytes, want, partial) in [
            (largest, 4 * 5, None),
            (largest + quarter, 4 * 5, Some(true)),
            (all, 4, Some(false)),
        ] {
            let r = ring(lay.clone(), 0, bytes, 10_000);
            for _ in 0..5 {
                for l in 0..4 {
                    let g = r.acquire(1, l).unwrap();
                    check(&spec, &r, l, g);
                    // Compute on it a while: the reader reads ahead meanwhile where it can.
                    std::thread::sleep(Duration::from_millis(2));
                    check(&spec, &r, l, g);
                }
                r.end_pass(1).unwrap();
            }
            let lt = r.lifetime();
            // (+1: the next pass's first layer may already have been read ahead.)
            assert!((want..=want + 1).contains(&lt.layer_reads), "{lt:?}");
            if let Some(p) = partial {
                assert_eq!(lt.partial_reads > 0, p, "ring {bytes}: {lt:?}");
            }
            assert_eq!(r.job(1).served, 20);
            assert_eq!(r.remove(1).layer_reads, want);
        }
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    /// A worker that keeps its lease past the limit while another waits loses it: the other goes
    /// on, and the holder's next call fails with `Broken`, whether it is its next layer's
    /// `acquire` or its `release_lease` (`ReleaseTrunk` after the expert wait the lease outlived).
    #[test]
    fn a_stalled_lease_is_broken_and_reported() {
        let spec = Spec::small(3, 2);
        let w = fixture::write(&spec, "ring-stall");
        let lay = layout(&w);
        let largest = (0..3).map(|l| ext(&lay, l)).max().unwrap();
        for (k, by_release) in [false, true].into_iter().enumerate() {
            // Room for one layer: a held lease blocks every other read.
            let r = Arc::new(ring(lay.clone(), 0, largest, 300));
            let g = r.acquire(1, 0).unwrap();
            check(&spec, &r, 0, g);
            let t0 = Instant::now();
            let g2 = r.acquire(2, 1).unwrap();
            check(&spec, &r, 1, g2);
            assert!(
                t0.elapsed() >= Duration::from_millis(250),
                "{:?}",
                t0.elapsed()
            );
            let reported = if by_release {
                r.release_lease(1)
            } else {
                r.acquire(1, 1).map(|_| ())
            };
            match reported {
                Err(RingError::Broken(m)) => assert!(m.contains("broke its lease"), "{m}"),
                other => panic!("release {by_release}: {other:?}"),
            }
            assert_eq!(r.lifetime().broken, 1, "round {k}");
            // Reported once: the worker may start over.
            r.end_pass(2).unwrap();
            r.release_lease(1).unwrap();
            let g = r.acquire(1, 2).unwrap();
            check(&spec, &r, 2, g);
            assert!(matches!(r.acquire(1, 7), Err(RingError::BadLayer(_))));
        }
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    /// `release_lease` (`ReleaseTrunk`) frees the extent mid-pass: in a ring of one layer,
    /// another worker's layer is read at once instead of waiting for the holder's lease to
    /// time out, and the holder's next request is not a broken lease.
    #[test]
    fn a_lease_given_back_mid_pass_frees_the_extent_at_once() {
        let spec = Spec::small(3, 2);
        let w = fixture::write(&spec, "ring-release");
        let lay = layout(&w);
        let largest = (0..3).map(|l| ext(&lay, l)).max().unwrap();
        // Room for one layer, and a lease limit far beyond the test's patience.
        let r = ring(lay.clone(), 0, largest, 60_000);
        let g = r.acquire(1, 0).unwrap();
        check(&spec, &r, 0, g);
        r.release_lease(1).unwrap();
        let t0 = Instant::now();
        let g2 = r.acquire(2, 1).unwrap();
        check(&spec, &r, 1, g2);
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        assert_eq!(r.lifetime().broken, 0);
        r.end_pass(2).unwrap();
        // The holder goes on with its pass.
        let g = r.acquire(1, 1).unwrap();
        check(&spec, &r, 1, g);
        r.end_pass(1).unwrap();
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    /// A worker starting its pass while another is mid-pass joins the convoy within one sweep:
    /// after that every layer is read once for both.
    #[test]
    fn a_late_worker_joins_the_convoy() {
        let spec = Spec::small(6, 2);
        let w = fixture::write(&spec, "ring-join");
        let lay = layout(&w);
        let largest = (0..6).map(|l| ext(&lay, l)).max().unwrap();
        let r = Arc::new(ring(lay.clone(), 0, 2 * largest, 10_000));
        let passes = 8;
        std::thread::scope(|s| {
            for (wkr, delay_ms) in [(1u64, 0u64), (2, 30)] {
                let r = r.clone();
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(delay_ms));
                    for _ in 0..passes {
                        for l in 0..6 {
                            r.acquire(wkr, l).unwrap();
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        r.end_pass(wkr).unwrap();
                    }
                    r.remove(wkr);
                });
            }
        });
        let lt = r.lifetime();
        assert_eq!(lt.served, 2 * passes * 6);
        // Private streams would read 96; the convoy reads each layer once per sweep plus at most
        // about a sweep and a half while the second worker joins and the first leaves.
        assert!(lt.layer_reads <= passes * 6 + 9, "{lt:?}");
        std::fs::remove_dir_all(&w.dir).unwrap();
    }
}
