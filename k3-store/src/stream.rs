//! Trunk streaming: a pinned prefix plus a ring of 1–2 uniform slots.
//!
//! Layers `0..pinned` are read once at start and never evicted (the forward pass scans layers
//! cyclically, which defeats LRU, so a fixed prefix is the right policy). The other layers go
//! through a ring of slots sized to the largest of them. One background thread does all ring
//! reads: [`TrunkStream::prefetch`] asks it to read layer l+1 while the engine computes layer l,
//! [`TrunkStream::layer`] asks for a layer and waits for it.
//!
//! **The one-slot hazard** (MODEL.md I38): a ring slot is refilled only when no [`Region`] points
//! into it. Each slot's memory is an `Arc<AlignedBuf>`; the regions of a layer share one lease
//! that holds a clone of it, and the reader writes only through `Arc::get_mut`, which fails while
//! any clone exists. So with one slot, a prefetch waits until the engine drops the layer it is
//! computing — it cannot overwrite it.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::io::AlignedBuf;
use crate::source::{ByteOwner, LayerRun, Region, SourceError};
use crate::trunk::TrunkLayout;

/// How to stream.
#[derive(Clone, Debug)]
pub struct StreamOptions {
    /// Layers `0..pinned` are resident.
    pub pinned: usize,
    /// Ring slots for the other layers (1 or 2; ignored when every layer is pinned).
    pub ring_slots: usize,
    /// How long [`TrunkStream::layer`] waits for a ring slot before reporting that every slot
    /// is held by live [`LayerRun`]s.
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
    /// Ring slots.
    pub ring_slots: usize,
    /// Bytes per ring slot.
    pub slot_bytes: u64,
    /// Ring reads done.
    pub layer_reads: u64,
    /// Bytes read into the ring.
    pub bytes_read: u64,
    /// Seconds spent in ring reads.
    pub read_seconds: f64,
    /// Seconds the consumer waited in [`TrunkStream::layer`].
    pub wait_seconds: f64,
}

#[derive(Clone, Debug, PartialEq)]
enum SlotState {
    Empty,
    Filling(usize),
    Ready { layer: usize, inner: usize },
    Failed(usize, String),
}

struct RingSlot {
    /// `None` while the reader thread holds it.
    buf: Option<Arc<AlignedBuf>>,
    state: SlotState,
    lease: Weak<RingLease>,
    used: u64,
}

impl RingSlot {
    /// No region points into the slot and the reader is not filling it.
    fn is_free(&self) -> bool {
        self.buf.as_ref().is_some_and(|b| Arc::strong_count(b) == 1)
    }
}

struct State {
    slots: Vec<RingSlot>,
    demand: Option<usize>,
    prefetch: Option<usize>,
    shutdown: bool,
    clock: u64,
    stats: StreamStats,
}

struct Shared {
    st: Mutex<State>,
    cv: Condvar,
    layout: Arc<TrunkLayout>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The lease a layer's regions hold on its ring slot.
struct RingLease {
    shared: Arc<Shared>,
    buf: Option<Arc<AlignedBuf>>,
    inner: usize,
    len: usize,
}

impl ByteOwner for RingLease {
    fn bytes(&self) -> &[u8] {
        match &self.buf {
            Some(b) => &b.as_slice()[self.inner..self.inner + self.len],
            None => &[],
        }
    }
}

impl Drop for RingLease {
    fn drop(&mut self) {
        // Give up the slot memory first, then wake the reader: it may now refill the slot.
        self.buf.take();
        let g = self.shared.lock();
        drop(g);
        self.shared.cv.notify_all();
    }
}

/// A streaming trunk: pinned prefix + ring.
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
        for l in 0..pinned_n {
            let plan = layout
                .plan(l)
                .ok_or_else(|| SourceError::Missing(format!("trunk layer {l}")))?;
            let mut buf =
                AlignedBuf::zeroed(layout.buf_len(l) as usize).map_err(SourceError::Io)?;
            let inner = layout.read_layer(l, buf.as_mut_slice())?;
            let owner: Arc<dyn ByteOwner> = Arc::new(buf);
            let region = Region::new(owner, inner, plan.run_len as usize)
                .ok_or_else(|| SourceError::Io(format!("layer {l}: run outside its buffer")))?;
            stats.pinned_bytes += plan.run_len;
            pinned.push(LayerRun {
                layer: l,
                region,
                layout: plan.layout.clone(),
            });
            progress(l + 1, pinned_n);
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

    fn with_pinned(
        layout: Arc<TrunkLayout>,
        pinned: Vec<LayerRun>,
        mut stats: StreamStats,
        opts: &StreamOptions,
    ) -> Result<TrunkStream, SourceError> {
        let n = layout.n_layers();
        let pinned_n = pinned.len();
        let slot_bytes = (pinned_n..n).map(|l| layout.buf_len(l)).max().unwrap_or(0);
        let ring = if pinned_n < n {
            opts.ring_slots.clamp(1, 2)
        } else {
            0
        };
        stats.ring_slots = ring;
        stats.slot_bytes = slot_bytes;
        let slots = (0..ring)
            .map(|_| {
                AlignedBuf::zeroed(slot_bytes as usize).map(|b| RingSlot {
                    buf: Some(Arc::new(b)),
                    state: SlotState::Empty,
                    lease: Weak::new(),
                    used: 0,
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(SourceError::Io)?;
        let shared = Arc::new(Shared {
            st: Mutex::new(State {
                slots,
                demand: None,
                prefetch: None,
                shutdown: false,
                clock: 0,
                stats,
            }),
            cv: Condvar::new(),
            layout,
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

    /// Counters so far.
    pub fn stats(&self) -> StreamStats {
        self.shared.lock().stats.clone()
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.shared.layout.n_layers()
    }

    /// Ask the reader to load layer `l` into a free ring slot in the background. A no-op for
    /// pinned layers and layers already in the ring.
    pub fn prefetch(&self, l: usize) {
        if l < self.pinned.len() || l >= self.n_layers() || self.thread.is_none() {
            return;
        }
        let mut g = self.shared.lock();
        g.prefetch = Some(l);
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
        let t0 = Instant::now();
        let deadline = t0 + self.demand_timeout;
        let mut g = self.shared.lock();
        loop {
            let clock = g.clock + 1;
            g.clock = clock;
            let found = g.slots.iter_mut().find(|s| {
                matches!(s.state, SlotState::Ready { layer, .. } if layer == l)
                    || matches!(s.state, SlotState::Failed(layer, _) if layer == l)
            });
            if let Some(slot) = found {
                match slot.state.clone() {
                    SlotState::Failed(_, m) => {
                        slot.state = SlotState::Empty;
                        if g.demand == Some(l) {
                            g.demand = None;
                        }
                        return Err(SourceError::Io(m));
                    }
                    SlotState::Ready { inner, .. } => {
                        slot.used = clock;
                        let lease = match slot.lease.upgrade() {
                            Some(x) => x,
                            None => {
                                let x = Arc::new(RingLease {
                                    shared: self.shared.clone(),
                                    buf: slot.buf.clone(),
                                    inner,
                                    len: plan.run_len as usize,
                                });
                                slot.lease = Arc::downgrade(&x);
                                x
                            }
                        };
                        if g.demand == Some(l) {
                            g.demand = None;
                        }
                        g.stats.wait_seconds += t0.elapsed().as_secs_f64();
                        drop(g);
                        let owner: Arc<dyn ByteOwner> = lease;
                        return Ok(LayerRun {
                            layer: l,
                            region: Region::whole(owner),
                            layout: plan.layout.clone(),
                        });
                    }
                    _ => {}
                }
            }
            g.demand = Some(l);
            self.shared.cv.notify_all();
            let now = Instant::now();
            if now >= deadline {
                if g.demand == Some(l) {
                    g.demand = None;
                }
                return Err(SourceError::Invalid(format!(
                    "waited {:.1} s for trunk layer {l}: all {} ring slots are held by live \
                     layer runs (drop the previous layer before asking for the next)",
                    self.demand_timeout.as_secs_f64(),
                    g.slots.len()
                )));
            }
            g = self
                .shared
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for TrunkStream {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The reader thread: serves the consumer's demand first, then the prefetch hint.
fn reader(shared: &Shared) {
    let mut g = shared.lock();
    loop {
        if g.shutdown {
            return;
        }
        let present = |st: &State, l: usize| {
            st.slots.iter().any(|s| match &s.state {
                SlotState::Filling(x) | SlotState::Failed(x, _) => *x == l,
                SlotState::Ready { layer, .. } => *layer == l,
                SlotState::Empty => false,
            })
        };
        if let Some(p) = g.prefetch {
            if present(&g, p) {
                g.prefetch = None;
            }
        }
        let target = [g.demand, g.prefetch]
            .into_iter()
            .flatten()
            .find(|&l| !present(&g, l));
        let Some(l) = target else {
            g = shared.cv.wait(g).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        // A free slot: not leased, not being filled, not holding the layer the consumer waits for.
        let demand = g.demand;
        let pick = g
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                s.is_free()
                    && !matches!(s.state, SlotState::Ready { layer, .. } if Some(layer) == demand)
            })
            .min_by_key(|(_, s)| match s.state {
                SlotState::Empty | SlotState::Failed(..) => (0, 0),
                _ => (1, s.used),
            })
            .map(|(i, _)| i);
        let Some(i) = pick else {
            g = shared.cv.wait(g).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        let slot = &mut g.slots[i];
        let Some(mut buf) = slot.buf.take() else {
            continue;
        };
        slot.state = SlotState::Filling(l);
        slot.lease = Weak::new();
        if g.prefetch == Some(l) {
            g.prefetch = None;
        }
        drop(g);
        let t0 = Instant::now();
        let res = match Arc::get_mut(&mut buf) {
            Some(b) => shared
                .layout
                .read_layer(l, b.as_mut_slice())
                .map_err(|e| e.0),
            None => Err(format!(
                "trunk layer {l}: ring slot {i} is still referenced"
            )),
        };
        let secs = t0.elapsed().as_secs_f64();
        g = shared.lock();
        let slot = &mut g.slots[i];
        slot.buf = Some(buf);
        slot.state = match res {
            Ok(inner) => SlotState::Ready { layer: l, inner },
            Err(m) => SlotState::Failed(l, m),
        };
        if matches!(g.slots[i].state, SlotState::Ready { .. }) {
            g.stats.layer_reads += 1;
            g.stats.bytes_read += shared.layout.plan(l).map(|p| p.run_len).unwrap_or(0);
        }
        g.stats.read_seconds += secs;
        shared.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::{self, Rng, Spec};
    use crate::trunk::{open_shards, pack_trunk};

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
        ring: usize,
        timeout_ms: u64,
    ) -> TrunkStream {
        let opts = StreamOptions {
            pinned,
            ring_slots: ring,
            demand_timeout: Duration::from_millis(timeout_ms),
        };
        TrunkStream::new(layout, &opts, &mut |_, _| {}).unwrap()
    }

    /// MODEL.md I38: one ring slot, prefetch of the next layer issued while the current one is
    /// being "computed" (random sleeps): the consumer always sees the right layer's bytes.
    #[test]
    fn one_slot_prefetch_never_overwrites_the_layer_in_use() {
        let spec = Spec::small(3, 2);
        let w = fixture::write(&spec, "i38");
        let packed_dir = w.dir.join("packed");
        pack_trunk(&w.catalog, &packed_dir, &mut |_| {}).unwrap();
        let shards = open_shards(&w.catalog).unwrap();
        let layouts = [
            Arc::new(TrunkLayout::from_packed(&w.catalog, shards.clone(), &packed_dir).unwrap()),
            Arc::new(TrunkLayout::from_catalog(&w.catalog, shards)),
        ];
        for layout in layouts {
            for ring in [1, 2] {
                let s = stream(layout.clone(), 0, ring, 10_000);
                let mut rng = Rng(7 + ring as u64);
                for step in 0..60 {
                    let l = step % 3;
                    let run = s.layer(l).unwrap();
                    assert_eq!(run.layer, l);
                    verify(&spec, &run);
                    s.prefetch((l + 1) % 3);
                    std::thread::sleep(Duration::from_micros(rng.below(3000)));
                    // Still this layer's bytes after the prefetch had time to run.
                    verify(&spec, &run);
                    drop(run);
                    if rng.below(4) == 0 {
                        std::thread::sleep(Duration::from_micros(rng.below(2000)));
                    }
                }
                let st = s.stats();
                assert_eq!(st.ring_slots, ring);
                assert!(st.layer_reads >= 60 / 3, "{st:?}");
                assert_eq!(st.pinned_layers, 0);
            }
        }
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    fn pinned_prefix_is_read_once_and_ring_serves_the_rest() {
        let spec = Spec::small(5, 2);
        let w = fixture::write(&spec, "pinned");
        let layout = Arc::new(TrunkLayout::from_catalog(
            &w.catalog,
            open_shards(&w.catalog).unwrap(),
        ));
        let s = stream(layout.clone(), 2, 2, 10_000);
        let st = s.stats();
        assert_eq!(st.pinned_layers, 2);
        assert_eq!(
            st.pinned_bytes,
            w.catalog.trunk_bytes(0) + w.catalog.trunk_bytes(1)
        );
        assert_eq!(
            st.slot_bytes,
            (2..5).map(|l| layout.buf_len(l)).max().unwrap()
        );
        for _ in 0..4 {
            for l in 0..5 {
                let run = s.layer(l).unwrap();
                verify(&spec, &run);
                s.prefetch((l + 1) % 5);
            }
        }
        let st = s.stats();
        // Pinned layers never go through the ring: 3 ring layers per pass, 4 passes.
        assert_eq!(st.layer_reads, 12);
        let ring_bytes: u64 = (2..5).map(|l| w.catalog.trunk_bytes(l)).sum();
        assert_eq!(st.bytes_read, 4 * ring_bytes);
        // Everything pinned: no ring, no reader thread.
        let all = stream(layout, 5, 2, 1000);
        assert_eq!(all.stats().ring_slots, 0);
        verify(&spec, &all.layer(4).unwrap());
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    fn holding_the_only_slot_while_asking_for_another_layer_errors_instead_of_hanging() {
        let spec = Spec::small(3, 2);
        let w = fixture::write(&spec, "hold");
        let layout = Arc::new(TrunkLayout::from_catalog(
            &w.catalog,
            open_shards(&w.catalog).unwrap(),
        ));
        let s = stream(layout, 0, 1, 200);
        let run0 = s.layer(0).unwrap();
        let e = s.layer(1).unwrap_err().to_string();
        assert!(e.contains("held by live layer runs"), "{e}");
        verify(&spec, &run0);
        // The same layer twice shares the slot.
        let again = s.layer(0).unwrap();
        verify(&spec, &again);
        drop((run0, again));
        verify(&spec, &s.layer(1).unwrap());
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
        let bin = packed_dir.join(crate::trunk::TRUNK_BIN);
        let json: crate::trunk::TrunkJson =
            serde_json::from_str(&std::fs::read_to_string(packed_dir.join("trunk.json")).unwrap())
                .unwrap();
        let cut = json.layers[2].file_off + 10;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&bin)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let s = stream(layout, 0, 1, 5000);
        verify(&spec, &s.layer(0).unwrap());
        let e = s.layer(2).unwrap_err().to_string();
        assert!(e.contains("trunk.bin"), "{e}");
        verify(&spec, &s.layer(1).unwrap());
        std::fs::remove_dir_all(&w.dir).unwrap();
    }
}
