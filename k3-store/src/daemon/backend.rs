//! The store proper: the shared-memory segment (resident tensors, pinned trunk layers, the
//! routed-expert arena and its slot table) and the expert requests of connected workers.
//!
//! Expert requests run the three phases of the slot protocol ([`ExpertSlots::serve_batch`], the
//! same routine as the standalone cache) over the arena in shared memory, mirroring each slot's
//! state into the shared slot table. A failed read leaves the slot EMPTY and is answered as
//! `Failed` for that expert.
//!
//! Leases: a worker's `Experts` request releases every lease that connection held before (the
//! engine finishes a layer before it routes the next, so this includes the protocol's "until the
//! next request for the same layer"), and a disconnect releases everything. A slot is never
//! rewritten while leased.
//!
//! A worker that keeps its leases (stopped with SIGSTOP, swapped out) never fails the others: a
//! request that finds too few slots free waits at most [`PRIVATE_AFTER`] — not at all once a
//! holder has kept its leases longer than that — and then takes what is resident and answers
//! the rest [`SlotAnswer::Private`]: the worker reads those experts from the checkpoint into its
//! own memory (same bytes, same ids). The stuck holder keeps its slots (its bytes stay valid);
//! `k3-ctl ps` shows each job's pid and how long it has held its leases, and the log names the
//! holders once per 10 s.

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k3_proto::names::MODEL_TENSORS;
use k3_proto::shm::{RegionKind, ShmHeader, SlotEntry};
use k3_proto::wire::{
    ClientKind, Counters, ErrorCode, JobStats, Response, SlotAnswer, StatsReport, StatusReport,
};
use zerocopy::IntoBytes;

use super::ring::{add_ring, released, ring_error};
use super::segment::{ring_over, segment_layout, write_header, Loader};
pub use super::segment::{segment_bytes, BuildError};
use super::usage::{preload_kind, UsageBook};
use super::{Backend, ConnId};
use crate::runtime::catalog::Catalog;
use crate::runtime::draft::DraftFile;
use crate::runtime::experts::{
    Arena, BatchError, ExpertSlots, Locked, PreloadSet, SlotState, SlotTable,
};
use crate::runtime::pool::IoPool;
use crate::runtime::ring::{Grant, Ring, RingOptions};
use crate::runtime::trunk::{open_shards, TrunkLayout};
use crate::shmem::Segment;

/// Mirror one slot's state into the shared slot table at `base + off` (diagnostics for readers).
/// Call under the slots' lock (the borrowed `table` lives behind it), while the mapping lives.
fn write_slot_entry(base: Base, off: usize, table: &SlotTable, slot: usize) {
    let (state, layer, expert) = match table.state(slot) {
        SlotState::Empty => (SlotEntry::EMPTY, 0, 0),
        SlotState::Inflight { layer, expert } => (SlotEntry::INFLIGHT, layer, expert),
        SlotState::Resident { layer, expert } => (SlotEntry::RESIDENT, layer, expert),
    };
    let entry = SlotEntry {
        state,
        layer,
        expert,
        leases: table.leases(slot),
    };
    let bytes = entry.as_bytes();
    assert!(slot < table.slots(), "slot {slot} outside the slot table");
    // SAFETY: `base` is the live mapping (the backend owns it and joins every thread that calls
    // this before unmapping it); the slot table region, laid out by `segment_layout` for
    // `table.slots()` entries (the arena's slots), holds `SlotEntry::table_bytes(slots)` bytes
    // inside it, so entry `slot` starts inside it.
    let dst = unsafe { base.0.add(off + slot * bytes.len()) };
    // SAFETY: the entry's bytes at `dst` are inside the mapping and not referenced elsewhere
    // in this process; entries are only written under the slots' lock (the borrowed `table`
    // lives behind it). A byte copy needs no alignment.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
}

/// What to build.
#[derive(Clone, Debug)]
pub struct BuildOptions {
    /// Checkpoint directory.
    pub model_dir: PathBuf,
    /// Packed trunk directory.
    pub trunk_dir: Option<PathBuf>,
    /// The draft trunk to hold in shared memory (already checked against the checkpoint).
    pub draft: Option<Arc<DraftFile>>,
    /// Pin layers `0..pinned_layers` in shared memory.
    pub pinned_layers: usize,
    /// Whole-expert slots in the arena.
    pub slots: usize,
    /// Parallel expert reads per batch.
    pub io_threads: usize,
    /// Expert-cache eviction policy (a name from `crate::runtime::policy::POLICY_NAMES`).
    pub cache_policy: String,
    /// Preset name (or "custom") for status.
    pub preset: String,
    /// The memory plan as printed, for status.
    pub plan_text: String,
    /// Bytes of the ring the unpinned layers stream through (ignored when every layer is
    /// pinned; at least the largest unpinned layer otherwise).
    pub ring_bytes: u64,
    /// The experts read into the arena before serving (`--preload`, decided by the caller:
    /// [`super::usage::choose_preload`]).
    pub preload: PreloadSet,
    /// The expert usage history that counts workers' demands (`--state-dir`).
    pub usage: Option<Arc<UsageBook>>,
    /// Lease limits of the ring.
    pub ring: RingOptions,
    /// The checkpoint's content identity (`runtime::identity::ModelIdentity`), recorded in the
    /// segment's header for workers to compare with their own.
    pub identity: u128,
}

/// How long a preload waits for leased slots (none are leased at start-up).
const BUSY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long an expert request waits for leased slots before it answers the experts it lacks
/// [`SlotAnswer::Private`]; also the lease age past which a holder counts as stuck (then a
/// request does not wait at all).
pub const PRIVATE_AFTER: Duration = Duration::from_secs(1);
/// At most one log line per this long about requests answered privately.
const PRIVATE_LOG_PERIOD: Duration = Duration::from_secs(10);
/// Finished jobs kept for `k3-ctl stats`.
const FINISHED_JOBS_KEPT: usize = 16;
/// Most expert ids one request may name.
const MAX_IDS: usize = 4096;

/// The base pointer of the segment, for the slot-table mirror.
#[derive(Clone, Copy)]
struct Base(*mut u8);
// SAFETY: the pointer targets the store's own mapping, which lives as long as the backend; all
// writes through it are slot-table entries, written under the slots' lock.
unsafe impl Send for Base {}
// SAFETY: as above.
unsafe impl Sync for Base {}

struct Job {
    label: String,
    live: bool,
    counters: Counters,
    progress: k3_proto::wire::JobProgress,
    /// Number of this connection's latest `Prefetch` (an older one still queued is dropped).
    prefetch_seq: u64,
    /// The worker's pid (`SO_PEERCRED`; 0 unknown).
    pid: u32,
    /// When it took the expert leases it holds now (`None`: it holds none).
    leased_since: Option<Instant>,
}

impl Job {
    fn new(label: String, pid: u32) -> Job {
        Job {
            label,
            live: true,
            counters: Counters::default(),
            progress: Default::default(),
            prefetch_seq: 0,
            pid,
            leased_since: None,
        }
    }
}

/// The workers' jobs, kept under the slots' lock.
#[derive(Default)]
struct Jobs {
    live: BTreeMap<ConnId, Job>,
    finished: VecDeque<(ConnId, Job)>,
    /// When requests answered privately were last logged.
    private_logged: Option<Instant>,
}

/// The daemon's backend.
pub struct StoreBackend {
    /// The thread `Prefetch` requests are read on. Declared first: dropped (its queued jobs
    /// finished, its thread joined) before the segment they write into is unmapped.
    prefetcher: IoPool,
    /// The trunk ring (`None` when every layer is pinned). Declared before the segment: its
    /// reader thread is joined before the memory it reads into is unmapped.
    ring: Option<Ring>,
    /// Offset of the ring in the segment.
    ring_off: u64,
    seg: Segment,
    base: Base,
    slot_table_off: usize,
    experts: Arc<ExpertSlots<Jobs>>,
    dirs: (String, String),
    draft_dir: String,
    status: StatusReport,
    pinned: u32,
    /// What was preloaded at start (`k3-ctl stats`).
    preload: &'static str,
    /// The expert usage history, counted on every demand request.
    usage: Option<Arc<UsageBook>>,
}

/// An expert request the store refuses (answered as `BadRequest`).
#[derive(Debug, thiserror::Error)]
pub enum BadRequest {
    /// More ids than one request may carry.
    #[error("{0} ids in one request (max {MAX_IDS})")]
    TooMany(usize),
    /// A layer or expert id out of range (the slot table's words).
    #[error("{0}")]
    Invalid(String),
}

/// The store's directories as it reports them (model, trunk; draft) and its status before any
/// client.
fn status_of(opts: &BuildOptions, shm_bytes: u64) -> ((String, String), String, StatusReport) {
    let dirs = (
        opts.model_dir.display().to_string(),
        opts.trunk_dir
            .as_ref()
            .map_or(String::new(), |d| d.display().to_string()),
    );
    let draft_dir = opts
        .draft
        .as_ref()
        .map_or(String::new(), |d| d.dir().display().to_string());
    let status = StatusReport {
        model_dir: dirs.0.clone(),
        trunk_dir: dirs.1.clone(),
        preset: opts.preset.clone(),
        plan: opts.plan_text.clone(),
        shm_bytes,
        pid: std::process::id(),
        clients: Vec::new(),
        uptime_seconds: 0.0,
        trunk: Default::default(),
    };
    (dirs, draft_dir, status)
}

impl StoreBackend {
    /// Open the checkpoint and the packed trunk, create the segment, load the resident tensors
    /// and the pinned layers (calling `progress(done, total)` as bytes arrive), and lay out the
    /// expert arena.
    pub fn build(
        opts: &BuildOptions,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<StoreBackend, BuildError> {
        let (cat, _cfg) = Catalog::open_dir(&opts.model_dir).map_err(|e| e.0)?;
        let cat = Arc::new(cat);
        let shards = open_shards(&cat).map_err(|e| e.0)?;
        // Without a packed trunk the layers are read from the checkpoint's shards (SPEC.md §6).
        let trunk = match &opts.trunk_dir {
            Some(dir) => {
                TrunkLayout::from_packed(&cat, shards.clone(), dir).map_err(|e| e.to_string())?
            }
            None => TrunkLayout::from_catalog(&cat, shards.clone()),
        };
        let trunk_info = trunk.info();
        match trunk.quant() {
            Some(_) => tracing::warn!("{}", trunk_info.lossy),
            None => tracing::info!(
                "trunk: exact ({})",
                trunk
                    .codec()
                    .map_or("the checkpoint's shards", |c| c.name())
            ),
        }
        if opts.slots < 1 {
            return Err(String::from("the expert arena needs at least one slot").into());
        }
        let policy = crate::runtime::policy::policy_by_name(&opts.cache_policy, opts.slots)
            .ok_or_else(|| crate::runtime::policy::unknown_policy(&opts.cache_policy))?;
        let lay = segment_layout(
            &cat,
            &trunk,
            opts.pinned_layers,
            opts.slots,
            opts.ring_bytes,
            opts.draft.as_deref(),
        );
        let mut seg = Segment::create("k3-store", lay.total)
            .map_err(|e| format!("cannot create {} bytes of shared memory: {e}", lay.total))?;
        let mut header = ShmHeader::new(lay.total, opts.identity);
        let preload_bytes = (opts.preload.count(&cat, opts.slots) as u64)
            * cat.expert_layout().expert_bytes() as u64;
        let total_load: u64 = lay.model.iter().map(|m| m.2).sum::<u64>()
            + lay.layers.iter().map(|l| l.2).sum::<u64>()
            + lay.draft.iter().map(|l| l.2).sum::<u64>()
            + preload_bytes;
        let mut load = Loader {
            seg: &mut seg,
            header: &mut header,
            done: 0,
            total: total_load,
            progress: &mut progress,
        };
        (load.progress)(0, total_load);
        load.model_tensors(&cat, &shards, &lay)?;
        load.pinned_layers(&trunk, &lay)?;
        if let Some(d) = &opts.draft {
            load.draft_layers(d, &lay)?;
        }
        let done = load.done;
        let expert_bytes = cat.expert_layout().expert_bytes() as u64;
        write_header(&mut seg, &mut header, &lay, opts.slots, expert_bytes)?;
        let (a0, alen) = (lay.arena.0 as usize, lay.arena.1 as usize);
        // SAFETY: the arena region lies inside the segment, which `StoreBackend` owns for as
        // long as the arena is used and never touches through `bytes_mut` after this point; only
        // the slot-table mirror writes to the segment, and that region is disjoint.
        let arena = unsafe {
            Arena::over(
                &mut seg.bytes_mut()[a0..a0 + alen],
                lay.stride as usize,
                opts.slots,
            )?
        };
        let ring = ring_over(&mut seg, &lay, trunk, opts.ring.clone())?;
        let base = Base(seg.as_mut_ptr());
        let (dirs, draft_dir, mut status) = status_of(opts, lay.total);
        status.trunk = trunk_info;
        let experts = ExpertSlots::new(
            cat,
            shards,
            arena,
            policy,
            opts.io_threads,
            BUSY_TIMEOUT,
            Jobs::default(),
        )?;
        if opts.preload != PreloadSet::Nothing {
            let off = lay.slot_table.0 as usize;
            let mirror = |t: &SlotTable, slot: usize| write_slot_entry(base, off, t, slot);
            let at = done;
            let p = &mut |d, _| progress(at + d, total_load);
            experts.preload(&opts.preload, None, &mirror, p)?;
        }
        let prefetcher = IoPool::new("k3-store-prefetch", 1)
            .map_err(|e| format!("starting the prefetch thread: {e}"))?;
        Ok(StoreBackend {
            prefetcher,
            ring,
            ring_off: lay.ring.map_or(0, |r| r.0),
            experts: Arc::new(experts),
            base,
            slot_table_off: lay.slot_table.0 as usize,
            dirs,
            draft_dir,
            status,
            pinned: lay.layers.len() as u32,
            preload: preload_kind(&opts.preload),
            usage: opts.usage.clone(),
            seg,
        })
    }

    /// Mirror one slot's state into the shared slot table (diagnostics for readers).
    fn write_slot_entry(&self, table: &SlotTable, slot: usize) {
        write_slot_entry(self.base, self.slot_table_off, table, slot)
    }

    /// Pinned layers held in shared memory.
    pub fn pinned_layers(&self) -> u32 {
        self.pinned
    }

    /// Slots in the arena.
    pub fn slots(&self) -> usize {
        self.experts.arena().slots()
    }

    /// Bytes of shared memory.
    pub fn shm_bytes(&self) -> u64 {
        self.seg.len() as u64
    }

    fn serve(&self, conn: ConnId, layer: u32, ids: &[u32]) -> Result<Response, BadRequest> {
        if ids.len() > MAX_IDS {
            return Err(BadRequest::TooMany(ids.len()));
        }
        let mirror = |t: &SlotTable, s: usize| self.write_slot_entry(t, s);
        // A holder past its time: do not wait for it (it may never release).
        let wait = if self.stuck_holders(conn).is_empty() {
            PRIVATE_AFTER
        } else {
            Duration::ZERO
        };
        // Holder `conn`: this connection's earlier leases are released before reserving.
        let served =
            self.experts
                .serve_batch_within(layer as usize, ids, Some(conn), None, &mirror, wait);
        let (mut g, served) = match served {
            Ok(x) => x,
            Err(BatchError::Invalid(m)) => return Err(BadRequest::Invalid(m)),
            Err(BatchError::Busy(e)) => return Ok(self.serve_privately(conn, layer, ids, &e)),
        };
        let hits = served.outcomes.iter().filter(|o| o.hit).count() as u64;
        let n_failed = served.outcomes.iter().filter(|o| o.slot.is_err()).count() as u64;
        let job = g
            .extra
            .live
            .entry(conn)
            .or_insert_with(|| Job::new(format!("connection {conn}"), 0));
        job.leased_since = Some(Instant::now());
        let c = &mut job.counters;
        c.requests += served.outcomes.len() as u64;
        c.resident_hits += hits;
        c.misses += served.outcomes.len() as u64 - hits;
        c.failed_loads += n_failed;
        c.expert_bytes_read += served.bytes_read;
        c.read_seconds += served.read_seconds;
        c.prefetch_used += served.prefetch_used;
        c.preload_hits += served.preload_hits;
        drop(g);
        let answers: Vec<SlotAnswer> = served
            .outcomes
            .iter()
            .map(|o| match &o.slot {
                Ok(s) => SlotAnswer::Leased {
                    slot: *s as u32,
                    at: o.at as u32,
                },
                Err(m) => SlotAnswer::Failed {
                    reason: m.to_string(),
                },
            })
            .collect();
        Ok(Response::Experts {
            answers: served.in_request_order(&answers),
            resident_hits: hits as u32,
        })
    }

    /// Other workers holding expert leases for longer than [`PRIVATE_AFTER`]: (conn, pid,
    /// seconds, slots).
    fn stuck_holders(&self, conn: ConnId) -> Vec<(ConnId, u32, f64, usize)> {
        let g = self.experts.lock();
        holders_of(&g.table, &g.extra, conn)
            .into_iter()
            .filter(|h| h.2 >= PRIVATE_AFTER.as_secs_f64())
            .collect()
    }

    /// `ids` of `layer` when no slot could be reserved for the batch (`busy`): those resident
    /// now are leased, the others answered [`SlotAnswer::Private`] (the worker reads them). The
    /// holders are named in the reason and, once per 10 s, in the log.
    fn serve_privately(
        &self,
        conn: ConnId,
        layer: u32,
        ids: &[u32],
        busy: &crate::runtime::experts::ReserveError,
    ) -> Response {
        let mut g = self.experts.lock();
        let holders = holders_of(&g.table, &g.extra, conn);
        let named: Vec<String> = holders
            .iter()
            .map(|(c, pid, secs, n)| {
                format!("connection {c} (pid {pid}) holds {n} slot(s) for {secs:.1} s")
            })
            .collect();
        let reason = format!(
            "{busy}: {}; read it from the checkpoint",
            if named.is_empty() {
                "other workers hold the slots".to_string()
            } else {
                named.join(", ")
            }
        );
        let mut private = 0u64;
        let (answers, hits) = self.lease_resident(&mut g, conn, layer, ids, |_| {
            private += 1;
            SlotAnswer::Private {
                reason: reason.clone(),
            }
        });
        let log_due = (g.extra.private_logged).is_none_or(|t| t.elapsed() >= PRIVATE_LOG_PERIOD);
        if log_due {
            g.extra.private_logged = Some(Instant::now());
        }
        // The lifetime counts them as the job does (it counted only the arena's answers: its
        // requests fell short of the jobs' sum by the private ones).
        g.table.count_private(ids.len() as u64, u64::from(hits));
        if let Some(job) = g.extra.live.get_mut(&conn) {
            let c = &mut job.counters;
            c.requests += ids.len() as u64;
            c.resident_hits += u64::from(hits);
            c.misses += private;
            c.private_reads += private;
        }
        drop(g);
        if log_due {
            tracing::warn!(
                "layer {layer}: {private} expert(s) of connection {conn} answered private (the \
                 worker reads them itself): {reason}"
            );
        }
        Response::Experts {
            answers,
            resident_hits: hits,
        }
    }

    /// Lease to `conn`, of experts `ids` of `layer`, those resident now (its earlier leases
    /// released first; no read, no wait); `missing` answers the others. The answers in request
    /// order and how many were leased.
    fn lease_resident(
        &self,
        g: &mut Locked<Jobs>,
        conn: ConnId,
        layer: u32,
        ids: &[u32],
        mut missing: impl FnMut(u32) -> SlotAnswer,
    ) -> (Vec<SlotAnswer>, u32) {
        g.table.release_holder(conn);
        let mut slots = Vec::new();
        let answers = ids
            .iter()
            .map(|&e| match g.table.lease_resident(layer, e) {
                Some(s) => {
                    slots.push(s);
                    self.write_slot_entry(&g.table, s);
                    SlotAnswer::Leased {
                        slot: s as u32,
                        at: self.experts.offset_in_slot(layer as usize, e) as u32,
                    }
                }
                None => missing(e),
            })
            .collect();
        let leased = slots.len() as u32;
        g.table.hold(conn, layer, slots);
        if let Some(job) = g.extra.live.get_mut(&conn) {
            job.leased_since = (leased > 0).then(Instant::now);
        }
        (answers, leased)
    }
}

/// Live jobs other than `conn` that hold expert leases: (conn, pid, seconds held, slots).
fn holders_of(table: &SlotTable, jobs: &Jobs, conn: ConnId) -> Vec<(ConnId, u32, f64, usize)> {
    table
        .holders()
        .into_iter()
        .filter(|(h, _)| *h != conn)
        .map(|(h, n)| {
            let job = jobs.live.get(&h);
            let secs = job
                .and_then(|j| j.leased_since)
                .map_or(0.0, |t| t.elapsed().as_secs_f64());
            (h, job.map_or(0, |j| j.pid), secs, n)
        })
        .collect()
}

impl Backend for StoreBackend {
    fn experts(&self, conn: ConnId, layer: u32, ids: &[u32]) -> Response {
        let r = self
            .serve(conn, layer, ids)
            .unwrap_or_else(|e| Response::Error {
                code: k3_proto::wire::ErrorCode::BadRequest,
                message: e.to_string(),
            });
        // A demand the store served (hit, read or private): the usage history counts it.
        if let (Some(u), Response::Experts { .. }) = (&self.usage, &r) {
            u.count(layer, ids);
        }
        r
    }

    fn resident_experts(&self, conn: ConnId, layer: u32, ids: &[u32]) -> Response {
        if ids.len() > MAX_IDS {
            return Response::Error {
                code: k3_proto::wire::ErrorCode::BadRequest,
                message: format!("{} ids in one request (max {MAX_IDS})", ids.len()),
            };
        }
        let mut g = self.experts.lock();
        // As for `Experts`: this connection's earlier leases go first.
        let (answers, _) = self.lease_resident(&mut g, conn, layer, ids, |e| SlotAnswer::Failed {
            reason: format!("expert {e} of layer {layer} is not resident"),
        });
        Response::Experts {
            answers,
            resident_hits: 0,
        }
    }

    fn prefetch(&self, conn: ConnId, layer: u32, ids: &[u32]) {
        if ids.len() > MAX_IDS {
            return;
        }
        let seq = {
            let mut g = self.experts.lock();
            match g.extra.live.get_mut(&conn) {
                Some(job) => {
                    job.prefetch_seq += 1;
                    job.prefetch_seq
                }
                None => return,
            }
        };
        let (experts, ids) = (self.experts.clone(), ids.to_vec());
        // This connection's request of `layer` comes after this message: from then on the
        // prefetch is late, even if it has not started.
        let since = experts.demands(layer as usize);
        let (base, off) = (self.base, self.slot_table_off);
        self.prefetcher.submit(
            move || {
                let current = experts
                    .lock()
                    .extra
                    .live
                    .get(&conn)
                    .is_some_and(|j| j.prefetch_seq == seq);
                if !current {
                    return;
                }
                let mirror = |t: &SlotTable, s: usize| write_slot_entry(base, off, t, s);
                let done = experts.prefetch(layer as usize, &ids, since, None, &mirror);
                if let Some(job) = experts.lock().extra.live.get_mut(&conn) {
                    job.counters.prefetch_loads += done.loads;
                    job.counters.prefetch_dropped += done.dropped;
                    job.counters.prefetch_bytes += done.bytes_read;
                    job.counters.expert_bytes_read += done.bytes_read;
                }
            },
            // A prediction is never needed: a failed prefetch only costs its reads.
            |_| {},
        );
    }

    fn release_all(&self, conn: ConnId) {
        let mut g = self.experts.lock();
        g.table.release_holder(conn);
        if let Some(job) = g.extra.live.get_mut(&conn) {
            job.leased_since = None;
        }
        for s in 0..g.table.slots() {
            self.write_slot_entry(&g.table, s);
        }
        drop(g);
        self.experts.notify();
    }

    fn opened(&self, conn: ConnId, kind: ClientKind, label: &str, pid: u32) {
        if kind == ClientKind::Worker {
            (self.experts.lock().extra.live).insert(conn, Job::new(label.to_string(), pid));
        }
    }

    fn closed(&self, conn: ConnId) {
        self.release_all(conn);
        let ring = self.ring.as_ref().map(|r| r.remove(conn));
        let mut g = self.experts.lock();
        let jobs = &mut g.extra;
        if let Some(mut job) = jobs.live.remove(&conn) {
            job.live = false;
            job.leased_since = None;
            if let Some(r) = ring {
                add_ring(&mut job.counters, &r);
            }
            jobs.finished.push_back((conn, job));
            while jobs.finished.len() > FINISHED_JOBS_KEPT {
                jobs.finished.pop_front();
            }
        }
    }

    fn trunk_layer(&self, conn: ConnId, layer: u32) -> Response {
        // The worker is done with the experts of the layers before this one: it asks for the
        // next layer only after computing them. Holding their slots while it waits for the ring
        // could deadlock with a worker that holds the ring's layer and waits for slots.
        self.release_all(conn);
        let Some(ring) = &self.ring else {
            return Response::Error {
                code: ErrorCode::BadRequest,
                message: format!("layer {layer} is pinned: every layer of this store is"),
            };
        };
        match ring.acquire(conn, layer as usize) {
            Ok(Grant { offset, len, fresh }) => Response::TrunkLayer {
                offset: self.ring_off + offset,
                len,
                fresh,
            },
            Err(e) => ring_error(e),
        }
    }

    fn end_pass(&self, conn: ConnId) -> Response {
        // Between passes (sampling, a chat waiting for its user) a worker holds no slots.
        self.release_all(conn);
        released(self.ring.as_ref().map(|r| r.end_pass(conn)))
    }

    fn release_trunk(&self, conn: ConnId) -> Response {
        released(self.ring.as_ref().map(|r| r.release_lease(conn)))
    }

    fn stopping(&self) {
        if let Some(r) = &self.ring {
            r.shutdown();
        }
    }

    fn progress(&self, conn: ConnId, p: k3_proto::wire::JobProgress) {
        if let Some(job) = self.experts.lock().extra.live.get_mut(&conn) {
            job.progress = p;
        }
    }

    fn stats(&self, conn: ConnId) -> StatsReport {
        let g = self.experts.lock();
        let t = g.table.counters();
        let lifetime = Counters {
            requests: t.requests,
            resident_hits: t.resident_hits,
            misses: t.misses,
            evictions: t.evictions,
            failed_loads: t.failed_loads,
            expert_bytes_read: g.bytes_read,
            read_seconds: g.read_seconds,
            prefetch_loads: g.prefetch_loads,
            prefetch_bytes: g.prefetch_bytes,
            prefetch_used: t.prefetch_used,
            prefetch_dropped: t.prefetch_dropped,
            preloaded_experts: t.preloaded,
            preload_bytes: g.preload_bytes,
            preload_seconds: g.preload_seconds,
            preload_hits: t.preload_hits,
            private_reads: (g.extra.live.values())
                .chain(g.extra.finished.iter().map(|(_, j)| j))
                .map(|j| j.counters.private_reads)
                .sum(),
            ..Counters::default()
        };
        let mut lifetime = lifetime;
        if let Some(r) = &self.ring {
            add_ring(&mut lifetime, &r.lifetime());
        }
        // A live job's ring counters are in the ring; a finished one's were folded in.
        let counters = |c: &ConnId, j: &Job| {
            let mut k = j.counters.clone();
            if let (true, Some(r)) = (j.live, &self.ring) {
                add_ring(&mut k, &r.job(*c));
            }
            k
        };
        let to_stats = |c: &ConnId, j: &Job| JobStats {
            conn: *c,
            label: j.label.clone(),
            live: j.live,
            counters: counters(c, j),
            progress: j.progress.clone(),
            pid: j.pid,
            lease_age_seconds: j.leased_since.map_or(0.0, |t| t.elapsed().as_secs_f64()),
        };
        let mut jobs: Vec<JobStats> = (g.extra.finished.iter())
            .map(|(c, j)| to_stats(c, j))
            .collect();
        jobs.extend(g.extra.live.iter().map(|(c, j)| to_stats(c, j)));
        jobs.sort_by_key(|j| j.conn);
        StatsReport {
            lifetime,
            job: (g.extra.live.get(&conn))
                .map(|j| counters(&conn, j))
                .unwrap_or_default(),
            jobs,
            pinned_layers: self.pinned,
            slots_used: g.table.used() as u32,
            slots_total: g.table.slots() as u32,
            slots_leased: (0..g.table.slots())
                .filter(|&s| g.table.leases(s) > 0)
                .count() as u32,
            workers: g.extra.live.len() as u32,
            uptime_seconds: 0.0,
            history: Default::default(),
            sessions: Default::default(), // filled by the server
            usage: k3_proto::wire::UsageStats {
                preload: self.preload.to_string(),
                hot_preloaded: if self.preload == "hot" {
                    t.preloaded
                } else {
                    0
                },
                ..self.usage.as_ref().map(|u| u.stats()).unwrap_or_default()
            },
            trunk: self.status.trunk.clone(),
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

    fn draft_dir(&self) -> String {
        self.draft_dir.clone()
    }

    fn trunk(&self) -> k3_proto::wire::TrunkInfo {
        self.status.trunk.clone()
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
        opts.trunk_dir
            .as_deref()
            .map_or("(none: layers read from the shards)".into(), |d| d
                .display()
                .to_string())
    )
}
