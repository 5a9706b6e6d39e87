//! The trunk ring: the layers after the pinned prefix, read into one arena and shared by every
//! reader of it — a standalone worker's stream (one reader, in this process) and the store's
//! ring (every attached worker, SPEC.md §6.8).
//!
//! The ring streams *runs* ([`Runs`]): layer `l` is `buf_len(l)` bytes read from disk to a
//! page-aligned place, its run `run_len(l)` bytes of them. What the bytes encode (bf16 tensors,
//! a coded trunk) is the [`Runs`]' business; the ring only places, reads, checks and hands out
//! byte ranges.
//!
//! **Extents.** Each read lands in a contiguous *extent* of the arena placed after the previous
//! one, wrapping ([`crate::runtime::arena::place`]), so the arena holds as many layers as fit: a
//! 3 GB arena holds layer 0 (2.34 GB) alone but two KDA layers (1.27 GB) at once.
//!
//! **Readers.** A reader (a [`ReaderId`]: the standalone worker, or one connection of the store)
//! asks for a layer and computes on it, in place, until it gives it back. Its *position* is the
//! layer it will ask for next; its *path* the layers present in the ring from its position up to
//! the first one missing, its *frontier*. A reader's path counts while it is *protected*: while
//! it waits, and after a hand-out for [`RingOptions::lease_timeout`] (or after it ends a pass,
//! for [`RingOptions::idle_protect`]) — for ever in a standalone worker.
//!
//! **One cyclic scan.** One reader thread reads the streamed layers in cyclic layer order. The
//! next read is the scan's next missing layer when it is some reader's frontier (readers running
//! together, a *convoy*), else the nearest frontier ahead of the scan. A reader joining mid-sweep
//! waits at most one sweep; N readers in a convoy cost one read per layer per sweep. With one
//! reader this is the private stream's read-ahead: its own frontier, in forward order, as far as
//! the arena allows; a reader waiting for a layer is served first (its path is empty, so the
//! layer it waits for is its frontier).
//!
//! **Eviction** (Belady for a cyclic scan, for several readers). A read may overwrite an extent
//! only when nothing holds it, it is not being read, and it is on no protected path: no reader
//! needs it before the read it waits for. A waiting reader has an empty path, so the reader
//! thread never waits for a waiting reader (no deadlock), and a read-ahead never overwrites a
//! layer needed sooner than the one it reads (no thrashing).
//!
//! **Partial reads.** When the next read fits nowhere and its run is one contiguous file range,
//! it may be placed over extents that are held but on no path, where it overlaps them least
//! ([`crate::runtime::arena::place_min_overlap`]): the free part is read at once (page-aligned
//! windows of the same span), the rest as soon as those holds are gone. Meanwhile the reader
//! thread reads nothing else. In a laptop ring (1.28× the largest layer) this keeps one reader's
//! compute over the next read.
//!
//! **Holds.** A layer is held in one of two ways. A *pin* ([`Ring::pin`]) is an in-process
//! borrow of the bytes (the standalone worker's run): never broken; a reader whose layer cannot
//! be placed because of pins alone gets [`RingError::Stuck`] after
//! [`RingOptions::demand_timeout`] instead of waiting for ever. A *lease* ([`Ring::acquire`]) is
//! a worker process's (it maps the ring read-only): one per reader, released by its next
//! `acquire`, [`Ring::release_lease`], [`Ring::end_pass`] or [`Ring::remove`]; held past the
//! lease timeout while another reader waits and no room can be made, it is *broken*: its extent
//! may be overwritten and the holder's next call answers [`RingError::Broken`].
//!
//! **Integrity.** A read is checked against the run's checksum ([`Runs::verify`]) on the first
//! read of each layer in the process, or every read, or never ([`VerifyMode`]); a mismatch fails
//! that read like an I/O error: the readers waiting for it get the error, never other weights.
//!
//! **Safety.** The arena's bytes are reached only through [`ArenaMem`]'s guards, which refuse
//! overlapping a write with anything; the reader thread writes only ranges it claimed under the
//! ring's lock (where holds are also taken) and no pin overlaps, so the layer being computed is
//! never overwritten (SPEC.md I38), however small the arena.

mod reader;
mod runs;
mod state;
#[cfg(test)]
mod tests;

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::runtime::arena::{ArenaMem, ArenaRead};
use crate::runtime::source::ByteOwner;
use reader::Shared;
pub use runs::{extent_bytes, ChecksumMismatch, RunError, Runs, VerifyMode, VERIFY_ENV};
use state::{Geometry, HandOut, Protect, State};
pub use state::{
    ReaderId, RingCounters, RingError, RingOptions, DEFAULT_IDLE_PROTECT, DEFAULT_LEASE_TIMEOUT,
};

/// A layer leased to a reader: its run at `offset..offset + len` of the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// Offset of the run in the ring.
    pub offset: u64,
    /// Bytes of the run.
    pub len: u64,
    /// First use of this read.
    pub fresh: bool,
}

/// How a hand-out holds its extent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hold {
    /// In this process, until the [`RingPin`] drops.
    Pin,
    /// By a worker process, until the reader's next call.
    Lease,
}

/// A pinned run: the bytes of a layer in the ring, never overwritten while this lives.
pub struct RingPin {
    sh: Arc<Shared>,
    extent: u64,
    /// `None` only while dropping (the guard goes before the pin is counted out).
    bytes: Option<ArenaRead>,
}

impl ByteOwner for RingPin {
    fn bytes(&self) -> &[u8] {
        self.bytes.as_deref().unwrap_or(&[])
    }
}

impl Drop for RingPin {
    fn drop(&mut self) {
        // The arena guard first: once the pin is counted out the reader may claim the extent.
        drop(self.bytes.take());
        let mut g = self.sh.lock();
        g.unpin(self.extent);
        drop(g);
        self.sh.cv.notify_all();
    }
}

/// The trunk ring and its reader thread.
pub struct Ring {
    sh: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Ring({} bytes, layers {}..{})",
            self.sh.mem.len(),
            self.sh.geo.first,
            self.sh.geo.n
        )
    }
}

impl Ring {
    /// Arena bytes the runs `first..` of `runs` need at least (the largest one).
    pub fn min_bytes(runs: &dyn Runs, first: usize) -> u64 {
        (first..runs.count())
            .map(|l| extent_bytes(runs, l))
            .max()
            .unwrap_or(0)
    }

    /// Stream runs `first..` of `runs` through `mem` (at least the largest of them) and start the
    /// reader thread. It reads nothing until a reader asks or sets its position.
    pub fn new(
        runs: Arc<dyn Runs>,
        first: usize,
        mem: ArenaMem,
        opts: RingOptions,
    ) -> Result<Ring, RingError> {
        let n = runs.count();
        if first >= n {
            return Err(RingError::Setup(format!(
                "no streamed layer: {first} of {n} are pinned"
            )));
        }
        let need = Ring::min_bytes(&*runs, first);
        if (mem.len() as u64) < need {
            return Err(RingError::Setup(format!(
                "a trunk ring of {} bytes cannot hold the largest streamed layer ({need} bytes)",
                mem.len()
            )));
        }
        let verify = VerifyMode::from_env().map_err(|e| RingError::Setup(e.to_string()))?;
        let geo = Geometry::new(&*runs, first, mem.len() as u64);
        let sh = Arc::new(Shared {
            st: Mutex::new(State::new(first, n)),
            cv: Condvar::new(),
            geo,
            runs,
            mem: Arc::new(mem),
            verify,
            opts,
        });
        let s = sh.clone();
        let thread = std::thread::Builder::new()
            .name("k3-ring-reader".into())
            .spawn(move || reader::run(&s))
            .map_err(|e| RingError::Setup(format!("cannot start the ring reader: {e}")))?;
        Ok(Ring {
            sh,
            thread: Some(thread),
        })
    }

    /// First streamed layer.
    pub fn first(&self) -> usize {
        self.sh.geo.first
    }

    /// Bytes of the ring.
    pub fn len(&self) -> usize {
        self.sh.mem.len()
    }

    /// True for an empty ring (never: [`Ring::new`] refuses one).
    pub fn is_empty(&self) -> bool {
        self.sh.mem.is_empty()
    }

    /// True when `l` is a streamed layer.
    pub fn streams(&self, l: usize) -> bool {
        (self.sh.geo.first..self.sh.geo.n).contains(&l)
    }

    /// Lease layer `l` to reader `id` (a worker process), releasing its earlier lease; blocks
    /// until the layer is in the ring.
    pub fn acquire(&self, id: ReaderId, l: usize) -> Result<Grant, RingError> {
        self.hand_out(id, l, Hold::Lease).map(|(g, _)| g)
    }

    /// Pin layer `l` for reader `id` (in this process): its run's bytes, never overwritten while
    /// the pin lives; blocks until the layer is in the ring.
    pub fn pin(&self, id: ReaderId, l: usize) -> Result<RingPin, RingError> {
        let (_, pin) = self.hand_out(id, l, Hold::Pin)?;
        pin.ok_or_else(|| RingError::Read(format!("trunk layer {l}: no pin made")))
    }

    /// Reader `id` will ask for layer `l` next (a streamed layer; others are ignored): the
    /// read-ahead for it starts there, protected like a path after a pass. A reader waiting
    /// for a layer keeps its position.
    pub fn position(&self, id: ReaderId, l: usize) {
        if !self.streams(l) {
            return;
        }
        let mut g = self.sh.lock();
        let c = g.consumers.entry(id).or_default();
        if !c.waiting {
            c.pos = Some(l);
            c.protect = Protect::after(Instant::now(), self.sh.opts.idle_protect);
        }
        drop(g);
        self.sh.cv.notify_all();
    }

    fn hand_out(
        &self,
        id: ReaderId,
        l: usize,
        hold: Hold,
    ) -> Result<(Grant, Option<RingPin>), RingError> {
        let sh = &self.sh;
        if !self.streams(l) {
            return Err(RingError::BadLayer(format!(
                "layer {l} is not streamed (streamed layers: {}..{})",
                sh.geo.first, sh.geo.n
            )));
        }
        let t0 = Instant::now();
        let timeout = sh.opts.demand_timeout;
        let mut deadline = t0.checked_add(timeout);
        let mut g = sh.lock();
        g.ask(id, l, hold == Hold::Lease)?;
        sh.cv.notify_all();
        let mut asked = false;
        loop {
            if let Some(answer) = g.answer(id, l) {
                let (i, inner) = answer.inspect_err(|_| sh.cv.notify_all())?;
                return self.give(g, id, (i, inner), hold, t0, !asked);
            }
            asked = true;
            let now = Instant::now();
            // Only pins can keep the layer out for good (leases are broken, paths expire); while
            // the disk works we wait however slow it is.
            if g.reading || !g.stuck_on_pins(&sh.geo, l) {
                deadline = now.checked_add(timeout);
            } else if deadline.is_some_and(|d| now >= d) {
                g.consumer(id).waiting = false;
                return Err(RingError::Stuck(format!(
                    "waited {:.1} s for trunk layer {l}: the layers in use fill the {}-byte ring \
                     (drop the previous layer before asking for the next)",
                    timeout.as_secs_f64(),
                    sh.mem.len()
                )));
            }
            let left = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(now));
            g = sh.wait(g, left.min(Duration::from_millis(500)));
        }
    }

    /// Hand the Ready extent `i` (its run at `inner`) to reader `id`, held as `hold`.
    fn give(
        &self,
        mut g: MutexGuard<'_, State>,
        id: ReaderId,
        (i, inner): (usize, usize),
        hold: Hold,
        t0: Instant,
        ready: bool,
    ) -> Result<(Grant, Option<RingPin>), RingError> {
        let sh = &self.sh;
        let (l, ext) = (g.extents[i].layer, g.extents[i].id);
        let run_len = sh.runs.run_len(l);
        let at = g.extents[i].off as usize + inner;
        // The guard is taken under the lock, where claims are made: no claim overlaps a Ready
        // extent that is about to be pinned.
        let bytes = match hold {
            Hold::Pin => match sh.mem.read(at, run_len as usize) {
                Ok(b) => Some(b),
                Err(e) => {
                    g.consumer(id).waiting = false;
                    return Err(RingError::Read(format!("trunk layer {l}: {e}")));
                }
            },
            Hold::Lease => None,
        };
        let h = HandOut {
            pin: hold == Hold::Pin,
            protect: Protect::after(Instant::now(), sh.opts.lease_timeout),
            ready,
            waited: t0.elapsed().as_secs_f64(),
            run_len,
        };
        let fresh = g.hand(id, i, h, &sh.geo);
        drop(g);
        sh.cv.notify_all();
        let pin = bytes.map(|b| RingPin {
            sh: sh.clone(),
            extent: ext,
            bytes: Some(b),
        });
        let grant = Grant {
            offset: at as u64,
            len: run_len,
            fresh,
        };
        Ok((grant, pin))
    }

    /// Reader `id` is done with the streamed layers of this pass: release its lease. `Err` when
    /// the lease was broken while it was held.
    pub fn end_pass(&self, id: ReaderId) -> Result<(), RingError> {
        let mut g = self.sh.lock();
        g.release(id);
        let c = g.consumer(id);
        let broken = c.broken.take();
        c.protect = Protect::after(Instant::now(), self.sh.opts.idle_protect);
        drop(g);
        self.sh.cv.notify_all();
        broken.map_or(Ok(()), |m| Err(RingError::Broken(m)))
    }

    /// Reader `id` gives its lease back mid-pass (it copied what it still reads, `ReleaseTrunk`):
    /// the extent may be overwritten at once; its path stays protected as while it computes.
    /// `Err` when the lease was broken while held.
    pub fn release_lease(&self, id: ReaderId) -> Result<(), RingError> {
        let mut g = self.sh.lock();
        g.release(id);
        let broken = g.consumers.get_mut(&id).and_then(|c| c.broken.take());
        drop(g);
        self.sh.cv.notify_all();
        broken.map_or(Ok(()), |m| Err(RingError::Broken(m)))
    }

    /// Reader `id` is gone: release its lease and forget it; its counters.
    pub fn remove(&self, id: ReaderId) -> RingCounters {
        let mut g = self.sh.lock();
        g.release(id);
        let c = g.consumers.remove(&id);
        drop(g);
        self.sh.cv.notify_all();
        c.map(|c| c.counters).unwrap_or_default()
    }

    /// Counters since the ring started.
    pub fn lifetime(&self) -> RingCounters {
        self.sh.lock().lifetime.clone()
    }

    /// Reader `id`'s counters so far.
    pub fn job(&self, id: ReaderId) -> RingCounters {
        (self.sh.lock().consumers.get(&id))
            .map(|c| c.counters.clone())
            .unwrap_or_default()
    }

    /// Wake every waiter with [`RingError::Stopping`] and stop reading.
    pub fn shutdown(&self) {
        self.sh.lock().shutdown = true;
        self.sh.cv.notify_all();
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        let reading = {
            let mut g = self.sh.lock();
            g.shutdown = true;
            g.reading
        };
        self.sh.cv.notify_all();
        if let Some(t) = self.thread.take() {
            // Over memory someone else owns (the store's segment) the thread is joined even while
            // it reads: that memory must outlive every write into it. Over its own memory a read
            // in progress (a read-ahead nobody will use) is not waited for: the thread holds the
            // arena and exits when the read returns.
            if !(reading && self.sh.mem.owns_memory()) {
                let _ = t.join();
            }
        }
    }
}
