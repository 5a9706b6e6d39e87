//! Trunk streaming in one process: a pinned prefix plus the ring ([`crate::runtime::ring`]) with
//! one reader.
//!
//! Layers `0..pinned` are read once at start and never evicted (the forward pass scans layers
//! cyclically, which defeats LRU, so a fixed prefix is the right policy). The other layers go
//! through one [`Ring`] of `ring_bytes` (at least the largest streamed layer) whose only reader is
//! this process: its path is protected for good, so the ring reads ahead in forward order — the
//! layers after the one last handed out, cyclically — as far as the arena allows, and a layer is
//! handed out as a pin ([`Ring::pin`]): its bytes are never overwritten while the run lives.
//! [`TrunkStream::prefetch`] only moves the read-ahead start (a forward pass that begins again at
//! layer 0 after an error).
//!
//! **Integrity.** Every layer read from a packed trunk is checked against the XXH3-64 checksum
//! `trunk.json` records ([`TrunkLayout::verify_run`]): pinned layers when loaded (a mismatch
//! fails the start: the caller refuses, exit 2), streamed layers by the ring
//! ([`crate::runtime::ring::VerifyMode`], `K3_TRUNK_VERIFY=first|every|off`). A mismatch fails
//! that layer's read like an I/O error: the worker stops with an error, never computes with other
//! weights. Checking one read costs about a fifth of its read time in CPU (XXH3 at ~11.5 GB/s of
//! one core against ~2.1 GB/s of disk here; docs/RELIABILITY.md, "Trunk integrity"), too much for
//! every read of every token by default; once per layer per process it is under 1% of the
//! streamed reads of a 20-token run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::runtime::arena::ArenaMem;
use crate::runtime::io::{run_parallel, AlignedBuf};
use crate::runtime::ring::{extent_bytes, ReaderId, Ring, RingCounters, RingError, RingOptions};
use crate::runtime::source::{ByteOwner, LayerRun, Region, SourceError};
use crate::runtime::trunk::TrunkLayout;
use crate::runtime::units::fmt_bytes;

/// Parallel readers while loading the pinned prefix.
const PIN_READERS: usize = 4;

/// The ring's one reader.
const ME: ReaderId = 0;

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
    /// The ring's counters (reads, bytes, waits, read-ahead used on demand, wasted reads, early
    /// bytes of partial reads, checksum time).
    pub ring: RingCounters,
}

/// A streaming trunk: pinned prefix + ring.
pub struct TrunkStream {
    layout: Arc<TrunkLayout>,
    pinned: Vec<LayerRun>,
    ring: Option<Ring>,
    stats: StreamStats,
}

impl std::fmt::Debug for TrunkStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TrunkStream({} pinned)", self.pinned.len())
    }
}

impl TrunkStream {
    /// Read the pinned prefix (calling `progress(done, total)` after each layer), allocate the
    /// ring and start its reader thread.
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
                let mut buf = AlignedBuf::zeroed(layout.buf_len(l) as usize)?;
                let inner = layout.read_layer(l, buf.as_mut_slice())?;
                let run = &buf.as_slice()[inner..inner + plan.run_len as usize];
                layout
                    .verify_run(l, run)
                    .map_err(|e| SourceError::Invalid(e.to_string()))?;
                let owner: Arc<dyn ByteOwner> = Arc::new(buf);
                let region = Region::new(owner, inner, plan.run_len as usize)
                    .ok_or_else(|| SourceError::Outside(format!("layer {l}'s run")))?;
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
    /// start its reader thread.
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
        Ring::min_bytes(layout, pinned)
    }

    fn with_pinned(
        layout: Arc<TrunkLayout>,
        pinned: Vec<LayerRun>,
        mut stats: StreamStats,
        opts: &StreamOptions,
    ) -> Result<TrunkStream, SourceError> {
        let (n, first) = (layout.n_layers(), pinned.len());
        let ring = if first < n {
            // More than every streamed layer together is never used.
            let all: u64 = (first..n)
                .map(|l| extent_bytes(&*layout, l))
                .fold(0u64, |a, b| a.saturating_add(b));
            let bytes = opts.ring_bytes.min(all);
            let mem = ArenaMem::new(bytes as usize)?;
            let ring = Ring::new(
                layout.clone(),
                first,
                mem,
                RingOptions::private(opts.demand_timeout),
            )
            .map_err(|e| SourceError::Invalid(e.to_string()))?;
            // Read ahead from the first streamed layer at once.
            ring.position(ME, first);
            stats.ring_bytes = bytes;
            stats.largest_layer_bytes = Ring::min_bytes(&*layout, first);
            Some(ring)
        } else {
            None
        };
        Ok(TrunkStream {
            layout,
            pinned,
            ring,
            stats,
        })
    }

    /// One line for the run report: where the trunk comes from, pinned layers, ring, read mode.
    pub fn describe(&self) -> String {
        let st = &self.stats;
        let layout = &self.layout;
        let from = match layout.packed_dir() {
            Some(d) => format!("packed {}", d.display()),
            None => "from the shards".to_string(),
        };
        let ring = if st.ring_bytes == 0 {
            "no ring".to_string()
        } else {
            format!(
                "ring {} (largest streamed layer {}), reading ahead",
                fmt_bytes(st.ring_bytes),
                fmt_bytes(st.largest_layer_bytes)
            )
        };
        format!(
            "trunk stream: {from}, {}/{} layers PINNED ({}), {ring}, {}",
            st.pinned_layers,
            layout.n_layers(),
            fmt_bytes(st.pinned_bytes),
            if layout.is_direct() {
                "O_DIRECT"
            } else {
                "buffered reads"
            }
        )
    }

    /// Counters so far.
    pub fn stats(&self) -> StreamStats {
        StreamStats {
            ring: self.ring.as_ref().map(Ring::lifetime).unwrap_or_default(),
            ..self.stats.clone()
        }
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layout.n_layers()
    }

    /// True when layer `l` goes through the ring: dropping its run lets the reader reuse its
    /// extent.
    pub fn streams(&self, l: usize) -> bool {
        self.ring.as_ref().is_some_and(|r| r.streams(l))
    }

    /// Layer `l`'s run if it is pinned (never reads, never blocks).
    pub fn pinned_layer(&self, l: usize) -> Option<LayerRun> {
        self.pinned.get(l).cloned()
    }

    /// Start reading ahead from layer `l` (the reader already reads ahead from the layer after
    /// the one last handed out; this only matters when the next pass starts elsewhere). `l` past
    /// the last layer wraps to the first streamed layer. A no-op for pinned layers.
    pub fn prefetch(&self, l: usize) {
        if let Some(r) = &self.ring {
            r.position(ME, if l >= self.n_layers() { r.first() } else { l });
        }
    }

    /// Layer `l`'s run; blocks until it is in memory.
    pub fn layer(&self, l: usize) -> Result<LayerRun, SourceError> {
        if let Some(r) = self.pinned.get(l) {
            return Ok(r.clone());
        }
        let plan = self
            .layout
            .plan(l)
            .ok_or_else(|| SourceError::Missing(format!("trunk layer {l}")))?;
        let ring = self
            .ring
            .as_ref()
            .ok_or_else(|| SourceError::Missing(format!("trunk layer {l}")))?;
        let pin = ring.pin(ME, l).map_err(|e| match e {
            RingError::Stuck(m) | RingError::BadLayer(m) | RingError::Setup(m) => {
                SourceError::Invalid(m)
            }
            e => SourceError::Ring(e.into()),
        })?;
        let owner: Arc<dyn ByteOwner> = Arc::new(pin);
        Ok(LayerRun {
            layer: l,
            region: Region::whole(owner),
            layout: plan.layout.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::{self, Spec};
    use crate::runtime::trunk::{open_shards, pack_trunk, Interrupt, PackOptions, TrunkCodec};

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

    fn stream(layout: Arc<TrunkLayout>, pinned: usize, ring_bytes: u64) -> TrunkStream {
        let opts = StreamOptions {
            pinned,
            ring_bytes,
            demand_timeout: Duration::from_secs(10),
        };
        TrunkStream::new(layout, &opts, &mut |_, _| {}).unwrap()
    }

    #[test]
    fn pinned_prefix_is_read_once_and_the_ring_serves_the_rest() {
        let spec = Spec::small(5, 2);
        let w = fixture::write(&spec, "pinned");
        let layout = Arc::new(TrunkLayout::from_catalog(
            &w.catalog,
            open_shards(&w.catalog).unwrap(),
        ));
        let min = TrunkStream::min_ring_bytes(&layout, 2);
        assert_eq!(
            min,
            (2..5).map(|l| extent_bytes(&*layout, l)).max().unwrap()
        );
        let s = stream(layout.clone(), 2, min);
        let st = s.stats();
        assert_eq!(st.pinned_layers, 2);
        assert_eq!(
            st.pinned_bytes,
            w.catalog.trunk_bytes(0) + w.catalog.trunk_bytes(1)
        );
        assert_eq!((st.ring_bytes, st.largest_layer_bytes), (min, min));
        assert!(!s.streams(1) && s.streams(2) && s.streams(4) && !s.streams(5));
        for _ in 0..4 {
            for l in 0..5 {
                let run = s.layer(l).unwrap();
                verify(&spec, &run);
                s.prefetch((l + 1) % 5);
            }
        }
        // The read-ahead of the next pass's first streamed layer (2) once 4 was dropped.
        let t0 = Instant::now();
        while s.stats().ring.layer_reads < 13 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let st = s.stats();
        // Pinned layers never go through the ring: 3 ring layers per pass, 4 passes, and the
        // read-ahead of layer 2.
        assert_eq!(st.ring.layer_reads, 13, "{st:?}");
        let ring_bytes: u64 = (2..5).map(|l| w.catalog.trunk_bytes(l)).sum();
        assert_eq!(
            st.ring.bytes_read,
            4 * ring_bytes + w.catalog.trunk_bytes(2)
        );
        let run2 = s.layer(2).unwrap();
        verify(&spec, &run2);
        assert_eq!(s.stats().ring.layer_reads, 13);
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
        let all = stream(layout, 5, 0);
        assert_eq!(all.stats().ring_bytes, 0);
        assert!(!all.streams(4));
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

    /// A byte flipped in `trunk.bin` after the trunk was opened: a pinned layer fails the start
    /// (`Invalid`: the caller refuses), a streamed one fails its read (`ring::tests`).
    #[test]
    fn a_damaged_pinned_layer_is_refused() {
        let spec = Spec::small(3, 2);
        let w = fixture::write(&spec, "sflip-pinned");
        let packed = w.dir.join("packed");
        pack_trunk(
            &w.catalog,
            &packed,
            &PackOptions::new(TrunkCodec::Raw),
            &Interrupt::never(),
            &mut |_| {},
        )
        .unwrap();
        let layout = Arc::new(
            TrunkLayout::from_packed(&w.catalog, open_shards(&w.catalog).unwrap(), &packed)
                .unwrap(),
        );
        let json: crate::runtime::trunk::TrunkJson =
            serde_json::from_str(&std::fs::read_to_string(packed.join("trunk.json")).unwrap())
                .unwrap();
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(packed.join(crate::runtime::trunk::TRUNK_BIN))
                .unwrap();
            f.write_all_at(&[0xa5, 0x5a, 0xa5], json.layers[1].file_off + 7)
                .unwrap();
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
        // Streamed instead, the same damage fails only that layer, as an I/O error.
        let min = TrunkStream::min_ring_bytes(&layout, 0);
        let s = stream(layout, 0, 3 * min);
        verify(&spec, &s.layer(0).unwrap());
        assert!(
            matches!(s.layer(1), Err(SourceError::Ring(e)) if e.to_string().contains("checksum"))
        );
        verify(&spec, &s.layer(2).unwrap());
        std::fs::remove_dir_all(&w.dir).unwrap();
    }
}
