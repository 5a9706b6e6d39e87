//! The store's shared-memory segment as `StoreBackend::build` (backend.rs) lays it out and
//! fills it: where each region lies ([`segment_layout`]), the resident tensors and pinned layers
//! read into it ([`Loader`]), its header ([`write_header`]) and the trunk ring over its region
//! ([`ring_over`]).

use std::sync::Arc;

use k3_proto::names::MODEL_TENSORS;
use k3_proto::shm::{RegionKind, ShmHeader, SlotEntry, FIRST_REGION_OFFSET};

use crate::runtime::arena::ArenaMem;
use crate::runtime::catalog::Catalog;
use crate::runtime::draft::DraftFile;
use crate::runtime::experts::ExpertReader;
use crate::runtime::io::{align_up, span_len, DiskFile};
use crate::runtime::ring::{Ring, RingOptions};
use crate::runtime::trunk::TrunkLayout;
use crate::shmem::Segment;

/// Bytes of shared memory [`StoreBackend::build`] will create for these options.
pub fn segment_bytes(
    cat: &Catalog,
    trunk: &TrunkLayout,
    pinned: usize,
    slots: usize,
    ring_bytes: u64,
    draft: Option<&DraftFile>,
) -> u64 {
    segment_layout(cat, trunk, pinned, slots, ring_bytes, draft).total
}

pub(super) struct SegLayout {
    pub(super) model: Vec<(usize, u64, u64)>, // (catalog index, region offset, region bytes)
    pub(super) layers: Vec<(usize, u64, u64)>, // (layer, region offset, region bytes)
    pub(super) draft: Vec<(usize, u64, u64)>, // (layer, region offset, region bytes)
    pub(super) ring: Option<(u64, u64)>,
    pub(super) arena: (u64, u64),
    pub(super) slot_table: (u64, u64),
    pub(super) stride: u64,
    pub(super) total: u64,
}

pub(super) fn segment_layout(
    cat: &Catalog,
    trunk: &TrunkLayout,
    pinned: usize,
    slots: usize,
    ring_bytes: u64,
    draft_file: Option<&DraftFile>,
) -> SegLayout {
    let up = |x: u64| align_up(x).unwrap_or(u64::MAX);
    let mut at = FIRST_REGION_OFFSET;
    let mut model = Vec::new();
    for name in MODEL_TENSORS {
        if let Some(i) = cat.model_tensors().iter().position(|t| t.name == name) {
            let t = &cat.model_tensors()[i];
            let bytes = up(span_len(t.off, t.nbytes).unwrap_or(u64::MAX));
            model.push((i, at, bytes));
            at += bytes;
        }
    }
    let mut layers = Vec::new();
    for l in 0..pinned.min(trunk.n_layers()) {
        let bytes = up(trunk.buf_len(l));
        layers.push((l, at, bytes));
        at += bytes;
    }
    let mut draft = Vec::new();
    for l in 0..draft_file.map_or(0, |d| d.n_layers()) {
        let (off, len) = draft_file.expect("n_layers is 0 without a draft").run(l);
        let bytes = up(span_len(off, len).unwrap_or(u64::MAX));
        draft.push((l, at, bytes));
        at += bytes;
    }
    let ring = (pinned < trunk.n_layers()).then(|| {
        let r = (at, up(ring_bytes));
        at += r.1;
        r
    });
    let stride = ExpertReader::slot_stride(&cat.expert_layout()) as u64;
    let arena = (at, stride * slots as u64);
    at += arena.1;
    let slot_table = (at, up(SlotEntry::table_bytes(slots as u64)));
    at += slot_table.1;
    SegLayout {
        model,
        layers,
        draft,
        ring,
        arena,
        slot_table,
        stride,
        total: at,
    }
}

/// Why [`StoreBackend::build`] failed: the message and the exit code (`k3_proto::exit`): 2 when
/// a pinned trunk layer fails its checksum, 1 otherwise.
#[derive(Debug)]
pub struct BuildError {
    /// Exit code.
    pub code: i32,
    /// What went wrong.
    pub message: String,
}

impl From<String> for BuildError {
    fn from(message: String) -> Self {
        BuildError {
            code: k3_proto::exit::FAILURE,
            message,
        }
    }
}

impl From<crate::runtime::experts::ArenaSetupError> for BuildError {
    fn from(e: crate::runtime::experts::ArenaSetupError) -> Self {
        e.to_string().into()
    }
}

impl From<crate::runtime::source::ExpertError> for BuildError {
    fn from(e: crate::runtime::source::ExpertError) -> Self {
        format!("preloading the expert cache: {e}").into()
    }
}

impl std::fmt::Display for BuildError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Reads what the segment holds in full into it, region by region, saying how far it is.
pub(super) struct Loader<'a, P: FnMut(u64, u64)> {
    pub(super) seg: &'a mut Segment,
    pub(super) header: &'a mut ShmHeader,
    pub(super) done: u64,
    pub(super) total: u64,
    pub(super) progress: &'a mut P,
}

impl<P: FnMut(u64, u64)> Loader<'_, P> {
    /// `bytes` more are in.
    pub(super) fn advanced(&mut self, bytes: u64) {
        self.done += bytes;
        (self.progress)(self.done, self.total);
    }

    /// The model-level tensors, from the checkpoint's shards.
    pub(super) fn model_tensors(
        &mut self,
        cat: &Catalog,
        shards: &[Arc<DiskFile>],
        lay: &SegLayout,
    ) -> Result<(), BuildError> {
        for &(i, off, bytes) in &lay.model {
            let t = &cat.model_tensors()[i];
            let f: &DiskFile = shards
                .get(t.shard as usize)
                .ok_or_else(|| format!("{}: shard {} not open", t.name, t.shard))?;
            let dst = &mut self.seg.bytes_mut()[off as usize..(off + bytes) as usize];
            let inner = f
                .read_span(t.off, t.nbytes, dst)
                .map_err(|e| format!("{}: {}", t.name, e.0))?;
            if inner != 0 {
                dst.copy_within(inner..inner + t.nbytes as usize, 0);
            }
            let idx = MODEL_TENSORS
                .iter()
                .position(|n| *n == t.name)
                .expect("laid out from MODEL_TENSORS") as u32;
            self.header
                .push_region(RegionKind::ModelTensor, idx, off, t.nbytes)
                .map_err(|e| e.to_string())?;
            self.advanced(bytes);
        }
        Ok(())
    }

    /// The pinned layers' runs, each checked against its checksum.
    pub(super) fn pinned_layers(
        &mut self,
        trunk: &TrunkLayout,
        lay: &SegLayout,
    ) -> Result<(), BuildError> {
        for &(l, off, bytes) in &lay.layers {
            let dst = &mut self.seg.bytes_mut()[off as usize..(off + bytes) as usize];
            let inner = trunk
                .read_layer(l, dst)
                .map_err(|e| format!("layer {l}: {}", e.0))?;
            let run = trunk.plan(l).map(|p| p.run_len).unwrap_or(0);
            if inner != 0 {
                dst.copy_within(inner..inner + run as usize, 0);
            }
            trunk
                .verify_run(l, &dst[..run as usize])
                .map_err(|e| BuildError {
                    code: k3_proto::exit::REFUSED,
                    message: e.to_string(),
                })?;
            self.header
                .push_region(RegionKind::PinnedLayer, l as u32, off, run)
                .map_err(|e| e.to_string())?;
            self.advanced(bytes);
        }
        Ok(())
    }

    /// The draft trunk's layers, each checked.
    pub(super) fn draft_layers(
        &mut self,
        d: &DraftFile,
        lay: &SegLayout,
    ) -> Result<(), BuildError> {
        let bin = d.open_bin().map_err(|e| BuildError {
            code: k3_proto::exit::REFUSED,
            message: e.to_string(),
        })?;
        for &(l, off, bytes) in &lay.draft {
            let (file_off, run) = d.run(l);
            let dst = &mut self.seg.bytes_mut()[off as usize..(off + bytes) as usize];
            let inner = bin
                .read_span(file_off, run, dst)
                .map_err(|e| format!("draft layer {l}: {}", e.0))?;
            if inner != 0 {
                dst.copy_within(inner..inner + run as usize, 0);
            }
            d.verify(l, &dst[..run as usize]).map_err(|e| BuildError {
                code: k3_proto::exit::REFUSED,
                message: e.to_string(),
            })?;
            self.header
                .push_region(RegionKind::DraftLayer, l as u32, off, run)
                .map_err(|e| e.to_string())?;
            self.advanced(bytes);
        }
        Ok(())
    }
}

/// Write the segment's header: the expert arena's geometry, its regions (arena, slot table,
/// ring) after the ones the loader pushed, validated and encoded at the segment's start.
pub(super) fn write_header(
    seg: &mut Segment,
    header: &mut ShmHeader,
    lay: &SegLayout,
    slots: usize,
    expert_bytes: u64,
) -> Result<(), BuildError> {
    header.slot_count = slots as u32;
    header.slot_stride = lay.stride;
    header.expert_bytes = expert_bytes;
    header
        .push_region(RegionKind::ExpertArena, 0, lay.arena.0, lay.arena.1)
        .map_err(|e| e.to_string())?;
    header
        .push_region(RegionKind::SlotTable, 0, lay.slot_table.0, lay.slot_table.1)
        .map_err(|e| e.to_string())?;
    if let Some((off, len)) = lay.ring {
        header
            .push_region(RegionKind::TrunkRing, 0, off, len)
            .map_err(|e| e.to_string())?;
    }
    header.validate().map_err(|e| e.to_string())?;
    let enc = header.encode();
    seg.bytes_mut()[..enc.len()].copy_from_slice(enc);
    Ok(())
}

/// The trunk ring over its region of the segment (`None` when every layer is pinned).
pub(super) fn ring_over(
    seg: &mut Segment,
    lay: &SegLayout,
    trunk: TrunkLayout,
    options: RingOptions,
) -> Result<Option<Ring>, BuildError> {
    let Some((off, len)) = lay.ring else {
        return Ok(None);
    };
    let (r0, rlen) = (off as usize, len as usize);
    // SAFETY: the ring region lies inside the segment, which `StoreBackend` owns and keeps
    // mapped until the ring (declared before it) is dropped and its reader joined; nothing else
    // touches these bytes through `bytes_mut` after this point (the slot-table mirror and the
    // arena are disjoint regions).
    let mem = unsafe { ArenaMem::over(&mut seg.bytes_mut()[r0..r0 + rlen]) };
    let first = lay.layers.len();
    let ring = Ring::new(Arc::new(trunk), first, mem, options);
    Ok(Some(ring.map_err(|e| e.to_string())?))
}
