//! The store proper: the shared-memory segment (resident tensors, pinned trunk layers, the
//! routed-expert arena and its slot table) and the expert requests of connected workers.
//!
//! Expert requests run the three phases of the slot protocol: reserve under one lock (hits are
//! leased, misses get a victim that no one leases), read the misses in parallel in disk-offset
//! order straight into their arena slots, publish under the lock only what arrived. A failed read
//! leaves the slot EMPTY and is answered as `Failed` for that expert.
//!
//! Leases: a worker's `Experts` request releases every lease that connection held before (the
//! engine finishes a layer before it routes the next, so this includes the protocol's "until the
//! next request for the same layer"), and a disconnect releases everything. A slot is never
//! rewritten while leased.

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use k3_proto::names::MODEL_TENSORS;
use k3_proto::shm::{RegionKind, ShmHeader, FIRST_REGION_OFFSET};
use k3_proto::wire::{
    ClientKind, Counters, JobStats, Response, SlotAnswer, StatsReport, StatusReport,
};

use super::{Backend, ConnId};
use crate::catalog::Catalog;
use crate::experts::ExpertReader;
use crate::experts::{ReserveError, Reserved, SlotState, SlotTable};
use crate::io::{align_up, run_parallel, span_len, DiskFile};
use crate::shmem::Segment;
use crate::trunk::{open_shards, TrunkLayout};

/// What to build.
#[derive(Clone, Debug)]
pub struct BuildOptions {
    /// Checkpoint directory.
    pub model_dir: PathBuf,
    /// Packed trunk directory.
    pub trunk_dir: PathBuf,
    /// Pin layers `0..pinned_layers` in shared memory.
    pub pinned_layers: usize,
    /// Whole-expert slots in the arena.
    pub slots: usize,
    /// Parallel expert reads per batch.
    pub io_threads: usize,
    /// Expert-cache eviction policy (a name from `crate::policy::POLICY_NAMES`).
    pub cache_policy: String,
    /// Preset name (or "custom") for status.
    pub preset: String,
    /// The memory plan as printed, for status.
    pub plan_text: String,
}

/// How long an expert request waits for leased slots to be released by other workers.
const BUSY_TIMEOUT: Duration = Duration::from_secs(60);
/// Finished jobs kept for `k3-ctl stats`.
const FINISHED_JOBS_KEPT: usize = 16;
/// Most expert ids one request may name.
const MAX_IDS: usize = 4096;

/// The base pointer of the segment, shared by reader threads that write disjoint slots.
#[derive(Clone, Copy)]
struct Base(*mut u8);
// SAFETY: the pointer targets the store's own mapping, which lives as long as the backend; all
// writes through it go to slots that the writing request holds INFLIGHT and exclusively (see
// `slot_mut`), or happen under the state mutex (slot-table entries).
unsafe impl Send for Base {}
// SAFETY: as above.
unsafe impl Sync for Base {}

struct Job {
    label: String,
    live: bool,
    counters: Counters,
}

struct State {
    table: SlotTable,
    jobs: BTreeMap<ConnId, Job>,
    finished: VecDeque<(ConnId, Job)>,
    bytes_read: u64,
    read_seconds: f64,
}

/// The daemon's backend.
pub struct StoreBackend {
    seg: Segment,
    base: Base,
    arena_off: usize,
    stride: usize,
    slots: usize,
    slot_table_off: usize,
    reader: ExpertReader,
    catalog: Arc<Catalog>,
    io_threads: usize,
    n_layers: usize,
    state: Mutex<State>,
    cv: Condvar,
    dirs: (String, String),
    status: StatusReport,
    pinned: u32,
}

/// Bytes of shared memory [`StoreBackend::build`] will create for these options.
pub fn segment_bytes(cat: &Catalog, trunk: &TrunkLayout, pinned: usize, slots: usize) -> u64 {
    segment_layout(cat, trunk, pinned, slots).total
}

struct SegLayout {
    model: Vec<(usize, u64, u64)>, // (catalog index, region offset, region bytes)
    layers: Vec<(usize, u64, u64)>, // (layer, region offset, region bytes)
    arena: (u64, u64),
    slot_table: (u64, u64),
    stride: u64,
    total: u64,
}

fn segment_layout(cat: &Catalog, trunk: &TrunkLayout, pinned: usize, slots: usize) -> SegLayout {
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
    let stride = ExpertReader::slot_stride(&cat.expert_layout()) as u64;
    let arena = (at, stride * slots as u64);
    at += arena.1;
    let slot_table = (at, up(16 * slots as u64));
    at += slot_table.1;
    SegLayout {
        model,
        layers,
        arena,
        slot_table,
        stride,
        total: at,
    }
}

impl StoreBackend {
    /// Open the checkpoint and the packed trunk, create the segment, load the resident tensors
    /// and the pinned layers (calling `progress(done, total)` as bytes arrive), and lay out the
    /// expert arena.
    pub fn build(
        opts: &BuildOptions,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<StoreBackend, String> {
        let (cat, _cfg) = Catalog::open_dir(&opts.model_dir).map_err(|e| e.0)?;
        let cat = Arc::new(cat);
        let shards = open_shards(&cat).map_err(|e| e.0)?;
        let trunk = TrunkLayout::from_packed(&cat, shards.clone(), &opts.trunk_dir)
            .map_err(|e| e.to_string())?;
        if opts.slots < 1 {
            return Err("the expert arena needs at least one slot".into());
        }
        let policy = crate::policy::policy_by_name(&opts.cache_policy, opts.slots)
            .ok_or_else(|| crate::policy::unknown_policy(&opts.cache_policy))?;
        let lay = segment_layout(&cat, &trunk, opts.pinned_layers, opts.slots);
        let identity = cat.identity(&opts.model_dir)?;
        let mut seg = Segment::create("k3-store", lay.total)
            .map_err(|e| format!("cannot create {} bytes of shared memory: {e}", lay.total))?;
        let mut header = ShmHeader::new(lay.total, identity);
        let total_load: u64 = lay.model.iter().map(|m| m.2).sum::<u64>()
            + lay.layers.iter().map(|l| l.2).sum::<u64>();
        let mut done = 0u64;
        progress(0, total_load);
        for &(i, off, bytes) in &lay.model {
            let t = &cat.model_tensors()[i];
            let f: &DiskFile = shards
                .get(t.shard as usize)
                .ok_or_else(|| format!("{}: shard {} not open", t.name, t.shard))?;
            let dst = &mut seg.bytes_mut()[off as usize..(off + bytes) as usize];
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
            header
                .push_region(RegionKind::ModelTensor, idx, off, t.nbytes)
                .map_err(|e| e.to_string())?;
            done += bytes;
            progress(done, total_load);
        }
        for &(l, off, bytes) in &lay.layers {
            let dst = &mut seg.bytes_mut()[off as usize..(off + bytes) as usize];
            let inner = trunk
                .read_layer(l, dst)
                .map_err(|e| format!("layer {l}: {}", e.0))?;
            let run = trunk.plan(l).map(|p| p.run_len).unwrap_or(0);
            if inner != 0 {
                dst.copy_within(inner..inner + run as usize, 0);
            }
            header
                .push_region(RegionKind::PinnedLayer, l as u32, off, run)
                .map_err(|e| e.to_string())?;
            done += bytes;
            progress(done, total_load);
        }
        header.slot_count = opts.slots as u32;
        header.slot_stride = lay.stride;
        header.expert_bytes = cat.expert_layout().expert_bytes() as u64;
        header
            .push_region(RegionKind::ExpertArena, 0, lay.arena.0, lay.arena.1)
            .map_err(|e| e.to_string())?;
        header
            .push_region(RegionKind::SlotTable, 0, lay.slot_table.0, lay.slot_table.1)
            .map_err(|e| e.to_string())?;
        header.validate().map_err(|e| e.to_string())?;
        let enc = header.encode();
        seg.bytes_mut()[..enc.len()].copy_from_slice(&enc);
        let base = Base(seg.as_mut_ptr());
        let dirs = (
            opts.model_dir.display().to_string(),
            opts.trunk_dir.display().to_string(),
        );
        let status = StatusReport {
            model_dir: dirs.0.clone(),
            trunk_dir: dirs.1.clone(),
            preset: opts.preset.clone(),
            plan: opts.plan_text.clone(),
            shm_bytes: lay.total,
            pid: std::process::id(),
            clients: Vec::new(),
            uptime_seconds: 0.0,
        };
        Ok(StoreBackend {
            base,
            arena_off: lay.arena.0 as usize,
            stride: lay.stride as usize,
            slots: opts.slots,
            slot_table_off: lay.slot_table.0 as usize,
            reader: ExpertReader::new(shards, cat.expert_layout()),
            n_layers: cat.n_layers(),
            catalog: cat,
            io_threads: opts.io_threads.max(1),
            state: Mutex::new(State {
                table: SlotTable::new(opts.slots, policy),
                jobs: BTreeMap::new(),
                finished: VecDeque::new(),
                bytes_read: 0,
                read_seconds: 0.0,
            }),
            cv: Condvar::new(),
            dirs,
            status,
            pinned: lay.layers.len() as u32,
            seg,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The bytes of `slot`, for the request that holds it INFLIGHT.
    ///
    /// # Safety
    /// The caller must hold `slot` INFLIGHT from its own reservation (so no other request writes
    /// it and no worker holds a lease on it) and must not create another reference to it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slot_mut(&self, slot: usize) -> &mut [u8] {
        assert!(slot < self.slots, "slot {slot} out of range");
        // SAFETY: the arena region was laid out inside the mapping for `slots` slots of `stride`
        // bytes, so the offset stays in bounds of the same allocation.
        let start = unsafe { self.base.0.add(self.arena_off + slot * self.stride) };
        // SAFETY: `stride` bytes from `start` are inside the mapping; exclusivity is guaranteed
        // by the caller.
        unsafe { std::slice::from_raw_parts_mut(start, self.stride) }
    }

    /// Mirror one slot's state into the shared slot table (diagnostics for readers).
    fn write_slot_entry(&self, st: &State, slot: usize) {
        let (state, layer, expert) = match st.table.state(slot) {
            SlotState::Empty => (0u32, 0u32, 0u32),
            SlotState::Inflight { layer, expert } => (1, layer, expert),
            SlotState::Resident { layer, expert } => (2, layer, expert),
        };
        let mut e = [0u8; 16];
        e[0..4].copy_from_slice(&state.to_le_bytes());
        e[4..8].copy_from_slice(&layer.to_le_bytes());
        e[8..12].copy_from_slice(&expert.to_le_bytes());
        e[12..16].copy_from_slice(&st.table.leases(slot).to_le_bytes());
        // SAFETY: the slot table region holds 16 bytes per slot inside the mapping.
        let dst = unsafe { self.base.0.add(self.slot_table_off + 16 * slot) };
        // SAFETY: 16 bytes at `dst` are inside the mapping and not referenced elsewhere in this
        // process; entries are only written under the state mutex (`st` proves the caller holds
        // it).
        unsafe { std::ptr::copy_nonoverlapping(e.as_ptr(), dst, 16) };
    }

    /// Pinned layers held in shared memory.
    pub fn pinned_layers(&self) -> u32 {
        self.pinned
    }

    /// Slots in the arena.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Bytes of shared memory.
    pub fn shm_bytes(&self) -> u64 {
        self.seg.len() as u64
    }

    fn serve(&self, conn: ConnId, layer: u32, ids: &[u32]) -> Result<Response, String> {
        if layer as usize >= self.n_layers {
            return Err(format!(
                "layer {layer} out of range ({} layers)",
                self.n_layers
            ));
        }
        if ids.len() > MAX_IDS {
            return Err(format!("{} ids in one request (max {MAX_IDS})", ids.len()));
        }
        if let Some(&bad) = ids
            .iter()
            .find(|&&e| e as usize >= self.catalog.n_experts())
        {
            return Err(format!(
                "expert {bad} out of range ({} experts)",
                self.catalog.n_experts()
            ));
        }
        let mut uniq: Vec<u32> = Vec::with_capacity(ids.len());
        for &e in ids {
            if !uniq.contains(&e) {
                uniq.push(e);
            }
        }
        // Phase 1: reserve (this connection's earlier leases go first).
        let mut g = self.lock();
        g.table.release_holder(conn);
        let deadline = Instant::now() + BUSY_TIMEOUT;
        let plan = loop {
            match g.table.reserve(layer, &uniq) {
                Ok(p) => break p,
                Err(e @ ReserveError::TooSmall { .. }) => return Err(e.to_string()),
                Err(e @ ReserveError::Busy { .. }) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(format!(
                            "{e} after {} s: other workers hold the slots (raise --cache-gb)",
                            BUSY_TIMEOUT.as_secs()
                        ));
                    }
                    g = self
                        .cv
                        .wait_timeout(g, deadline - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        };
        for r in &plan {
            self.write_slot_entry(&g, r.slot());
        }
        let mut jobs = Vec::new();
        for (i, r) in plan.iter().enumerate() {
            if let Reserved::Load { slot, .. } = *r {
                let e = uniq[i];
                let ext = self.catalog.expert(layer as usize, e as usize);
                let key = ext.map(|x| x.disk_key()).unwrap_or((u16::MAX, u64::MAX));
                jobs.push((key, slot, e, ext));
            }
        }
        drop(g);

        // Phase 2: read the misses in disk-offset order, in parallel, straight into their slots.
        jobs.sort_by_key(|j| j.0);
        let t_read = Instant::now();
        let n_jobs = jobs.len();
        let results = run_parallel(jobs, self.io_threads, |(_, slot, e, ext)| {
            let what = format!("layer {layer} expert {e}");
            let res = match ext {
                None => Err(format!("{what} is not in the checkpoint")),
                Some(ext) => {
                    // SAFETY: `slot` is INFLIGHT from this request's reservation: no other
                    // request writes it, no worker holds a lease on it, and this closure is the
                    // only reference to it in the process.
                    let dst = unsafe { self.slot_mut(slot) };
                    self.reader.read(&what, &ext, dst).map_err(|err| err.0)
                }
            };
            (slot, res)
        });
        let read_secs = t_read.elapsed().as_secs_f64();

        // Phase 3: publish what arrived.
        let eb = self.reader.expert_bytes() as u64;
        let mut g = self.lock();
        let mut failed: BTreeMap<usize, String> = BTreeMap::new();
        let mut bytes = 0u64;
        for (slot, res) in results {
            match res {
                Ok(()) => {
                    g.table.publish(slot, Ok(()));
                    bytes += eb;
                }
                Err(m) => {
                    g.table.publish(slot, Err(m.clone()));
                    g.table.release(slot);
                    failed.insert(slot, m);
                }
            }
            self.write_slot_entry(&g, slot);
        }
        self.cv.notify_all();
        let mut answers_u: Vec<SlotAnswer> = Vec::with_capacity(uniq.len());
        let mut held = Vec::with_capacity(uniq.len());
        let (mut hits, mut misses) = (0u64, 0u64);
        for (i, r) in plan.iter().enumerate() {
            let e = uniq[i];
            let slot = r.slot();
            match r {
                Reserved::Hit { .. } => hits += 1,
                _ => misses += 1,
            }
            if let Some(m) = failed.get(&slot) {
                answers_u.push(SlotAnswer::Failed { reason: m.clone() });
                continue;
            }
            if let Reserved::Wait { .. } = r {
                while g.table.state(slot) == (SlotState::Inflight { layer, expert: e }) {
                    g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
                }
                if g.table.state(slot) != (SlotState::Resident { layer, expert: e }) {
                    let m = g
                        .table
                        .last_error(slot)
                        .map(|m| format!("{m} (read by a concurrent request)"))
                        .unwrap_or_else(|| format!("layer {layer} expert {e}: load failed"));
                    g.table.release(slot);
                    answers_u.push(SlotAnswer::Failed { reason: m });
                    continue;
                }
            }
            held.push(slot);
            answers_u.push(SlotAnswer::Leased { slot: slot as u32 });
        }
        g.table.hold(conn, layer, held);
        g.bytes_read += bytes;
        if n_jobs > 0 {
            g.read_seconds += read_secs;
        }
        let n_failed = answers_u
            .iter()
            .filter(|a| matches!(a, SlotAnswer::Failed { .. }))
            .count() as u64;
        let job = g.jobs.entry(conn).or_insert_with(|| Job {
            label: format!("connection {conn}"),
            live: true,
            counters: Counters::default(),
        });
        job.counters.requests += uniq.len() as u64;
        job.counters.resident_hits += hits;
        job.counters.misses += misses;
        job.counters.failed_loads += n_failed;
        job.counters.bytes_read += bytes;
        if n_jobs > 0 {
            job.counters.read_seconds += read_secs;
        }
        drop(g);
        let answers = ids
            .iter()
            .map(|e| {
                let i = uniq.iter().position(|u| u == e).unwrap_or(0);
                answers_u[i].clone()
            })
            .collect();
        Ok(Response::Experts {
            answers,
            resident_hits: hits as u32,
        })
    }
}

impl Backend for StoreBackend {
    fn experts(&self, conn: ConnId, layer: u32, ids: &[u32]) -> Response {
        self.serve(conn, layer, ids)
            .unwrap_or_else(|message| Response::Error { message })
    }

    fn release_all(&self, conn: ConnId) {
        let mut g = self.lock();
        g.table.release_holder(conn);
        for s in 0..self.slots {
            self.write_slot_entry(&g, s);
        }
        drop(g);
        self.cv.notify_all();
    }

    fn opened(&self, conn: ConnId, kind: ClientKind, label: &str) {
        if kind == ClientKind::Worker {
            self.lock().jobs.insert(
                conn,
                Job {
                    label: label.to_string(),
                    live: true,
                    counters: Counters::default(),
                },
            );
        }
    }

    fn closed(&self, conn: ConnId) {
        self.release_all(conn);
        let mut g = self.lock();
        if let Some(mut job) = g.jobs.remove(&conn) {
            job.live = false;
            g.finished.push_back((conn, job));
            while g.finished.len() > FINISHED_JOBS_KEPT {
                g.finished.pop_front();
            }
        }
    }

    fn stats(&self, conn: ConnId) -> StatsReport {
        let g = self.lock();
        let t = g.table.counters();
        let lifetime = Counters {
            requests: t.requests,
            resident_hits: t.resident_hits,
            misses: t.misses,
            evictions: t.evictions,
            failed_loads: t.failed_loads,
            bytes_read: g.bytes_read,
            read_seconds: g.read_seconds,
        };
        let to_stats = |c: &ConnId, j: &Job| JobStats {
            conn: *c,
            label: j.label.clone(),
            live: j.live,
            counters: j.counters.clone(),
        };
        let mut jobs: Vec<JobStats> = g.finished.iter().map(|(c, j)| to_stats(c, j)).collect();
        jobs.extend(g.jobs.iter().map(|(c, j)| to_stats(c, j)));
        jobs.sort_by_key(|j| j.conn);
        StatsReport {
            lifetime,
            job: g
                .jobs
                .get(&conn)
                .map(|j| j.counters.clone())
                .unwrap_or_default(),
            jobs,
            pinned_layers: self.pinned,
            slots_used: g.table.used() as u32,
            slots_total: self.slots as u32,
            slots_leased: (0..self.slots).filter(|&s| g.table.leases(s) > 0).count() as u32,
            workers: g.jobs.len() as u32,
            uptime_seconds: 0.0,
        }
    }

    fn status(&self) -> StatusReport {
        self.status.clone()
    }

    fn worker_fd(&self) -> std::io::Result<(OwnedFd, u64)> {
        Ok((self.seg.read_only_fd()?, self.seg.len() as u64))
    }

    fn dirs(&self) -> (String, String) {
        self.dirs.clone()
    }
}

/// Where a model-level tensor sits in the segment (for tests and the worker).
pub fn find_model_tensor(header: &ShmHeader, name: &str) -> Option<(u64, u64)> {
    let idx = MODEL_TENSORS.iter().position(|n| *n == name)? as u32;
    header
        .find(RegionKind::ModelTensor, idx)
        .map(|r| (r.offset, r.len))
}

/// The path the pinned-layer count and arena size came from (kept for status).
pub fn describe(opts: &BuildOptions) -> String {
    format!(
        "{} pinned layers, {} expert slots, model {}, trunk {}",
        opts.pinned_layers,
        opts.slots,
        opts.model_dir.display(),
        Path::new(&opts.trunk_dir).display()
    )
}
