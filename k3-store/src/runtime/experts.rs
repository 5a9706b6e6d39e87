//! The routed-expert slot cache.
//!
//! Fixed slots of one whole expert each, in the canonical layout of
//! [`k3_proto::expert::ExpertLayout`] starting at the slot's first byte. Slot states are EMPTY,
//! INFLIGHT(layer, expert) and RESIDENT(layer, expert); a map (layer, expert) → slot finds them.
//!
//! A batch (one layer's top-k) is served in three phases:
//! 1. **reserve**, serially under one lock ([`SlotTable::reserve`]): experts RESIDENT before the
//!    request are hits and get leased first; each miss gets a slot that is neither leased nor
//!    INFLIGHT (so a batch never evicts a slot it just leased, and no slot is handed out twice);
//!    an expert INFLIGHT for another request is waited for (counted as a miss).
//! 2. **read** the misses in parallel, in disk-offset order, with `O_DIRECT`: one read when the
//!    expert's six tensors are contiguous and in canonical order in one shard, else six reads
//!    into their canonical positions ([`ExpertReader`]).
//! 3. **publish** under the lock only what arrived: a failed read leaves the slot EMPTY and the
//!    batch reports that expert as `Err(message)`.
//!
//! A PREFETCH (router lookahead, [`ExpertSlots::prefetch`]) runs the same phases without
//! leasing: [`SlotTable::reserve_prefetch`] gives each predicted expert an EMPTY slot, or an
//! unleased RESIDENT one only while predictions prove likelier to be used than the cache's own
//! reuse; a request that finds it INFLIGHT waits for that read. Phase 2 runs on a fixed set of
//! long-lived reader threads ([`crate::runtime::pool::IoPool`]), never on threads started per batch.
//!
//! [`SlotTable`] is the memory-agnostic state machine; [`ExpertSlots::serve_batch`] runs the three
//! phases over one [`Arena`] of slot memory and is the only implementation of them. Its two
//! users differ only in memory and in who holds the leases: the daemon's backend (an arena in
//! shared memory, explicit per-worker leases — [`SlotTable::hold`],
//! [`SlotTable::release_holder`] — and the slot table mirrored into shared memory) and
//! [`ExpertCache`], the in-process cache of standalone mode (a heap arena, leases held by the
//! returned [`Region`]s and released when the last one drops).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use k3_proto::expert::{ExpertLayout, ExpertPart};

use crate::runtime::arena::{ArenaMem, ArenaRead, ArenaWrite};
use crate::runtime::catalog::{Catalog, ExpertExtents};
use crate::runtime::io::{align_up, DiskFile, ReadError, ALIGN};
use crate::runtime::pool::IoPool;
use crate::runtime::source::{
    ByteOwner, ExpertBatch, ExpertError, Region, SlotProblem, SourceError,
};

/// State of one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Holds nothing.
    Empty,
    /// Being read for (layer, expert).
    Inflight {
        /// 0-based layer.
        layer: u32,
        /// Expert id.
        expert: u32,
    },
    /// Holds (layer, expert).
    Resident {
        /// 0-based layer.
        layer: u32,
        /// Expert id.
        expert: u32,
    },
}

/// Chooses which unleased resident slot to evict. Implementations only order slots; the table
/// decides eligibility (never leased, never INFLIGHT).
pub trait EvictionPolicy: Send {
    /// Short name for reports.
    fn name(&self) -> &'static str;
    /// A batch of `layer` is about to be served (called once per successful
    /// [`SlotTable::reserve`], before its hits are touched). Default: nothing; policies that use
    /// the cyclic layer schedule (see `policy.rs`) learn the current layer here.
    fn begin(&mut self, _layer: u32) {}
    /// `slot` was used (a hit, or its expert was just published).
    fn touch(&mut self, slot: usize, layer: u32, expert: u32);
    /// `slot` became EMPTY.
    fn forget(&mut self, slot: usize);
    /// The slot to evict among those for which `eligible` is true, or `None`.
    fn victim(&mut self, eligible: &mut dyn FnMut(usize) -> bool) -> Option<usize>;
}

/// Least recently used.
#[derive(Debug)]
pub struct Lru {
    stamp: Vec<u64>,
    clock: u64,
}

impl Lru {
    /// For `slots` slots.
    pub fn new(slots: usize) -> Lru {
        Lru {
            stamp: vec![0; slots],
            clock: 0,
        }
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn touch(&mut self, slot: usize, _layer: u32, _expert: u32) {
        self.clock += 1;
        self.stamp[slot] = self.clock;
    }
    fn forget(&mut self, slot: usize) {
        self.stamp[slot] = 0;
    }
    fn victim(&mut self, eligible: &mut dyn FnMut(usize) -> bool) -> Option<usize> {
        let mut best: Option<(u64, usize)> = None;
        for (s, &t) in self.stamp.iter().enumerate() {
            if best.is_none_or(|(bt, _)| t < bt) && eligible(s) {
                best = Some((t, s));
            }
        }
        best.map(|(_, s)| s)
    }
}

/// What [`SlotTable::reserve`] decided for one requested expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reserved {
    /// RESIDENT before the request; leased.
    Hit {
        /// Slot.
        slot: usize,
    },
    /// A miss: the caller must read the expert into `slot` (now INFLIGHT and leased) and then
    /// [`SlotTable::publish`] it.
    Load {
        /// Slot.
        slot: usize,
        /// The expert evicted to make room, if any.
        evicted: Option<(u32, u32)>,
    },
    /// A miss already INFLIGHT for another request: leased; wait until it is no longer INFLIGHT.
    Wait {
        /// Slot.
        slot: usize,
    },
}

impl Reserved {
    /// The slot.
    pub fn slot(&self) -> usize {
        match *self {
            Reserved::Hit { slot } | Reserved::Load { slot, .. } | Reserved::Wait { slot } => slot,
        }
    }
}

/// Why a batch could not be reserved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReserveError {
    /// The cache can never serve the batch (fewer slots than distinct experts requested).
    TooSmall {
        /// Slots in the cache.
        slots: usize,
        /// Distinct experts in the batch.
        needed: usize,
    },
    /// Not enough unleased slots right now; retry after leases are released.
    Busy {
        /// New slots the batch needs.
        needed: usize,
        /// Slots that could be taken now.
        available: usize,
    },
}

impl std::fmt::Display for ReserveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReserveError::TooSmall { slots, needed } => write!(
                f,
                "expert cache too small: {slots} slots, batch needs {needed} (raise the cache budget)"
            ),
            ReserveError::Busy { needed, available } => write!(
                f,
                "expert cache busy: batch needs {needed} free slots, {available} are not leased"
            ),
        }
    }
}

/// Counters kept by the table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TableCounters {
    /// Experts requested.
    pub requests: u64,
    /// Requested experts that were RESIDENT before the request.
    pub resident_hits: u64,
    /// Requested experts that were not (read, or waited for).
    pub misses: u64,
    /// RESIDENT experts evicted.
    pub evictions: u64,
    /// Loads that failed.
    pub failed_loads: u64,
    /// Experts a prefetch ([`SlotTable::reserve_prefetch`]) loaded.
    pub prefetch_loads: u64,
    /// Requested experts that a prefetch had loaded (or was loading) and no request had used
    /// yet. Those loaded and never used are wasted: `prefetch_loads − prefetch_used`.
    pub prefetch_used: u64,
    /// Predicted experts a prefetch did not load: no free slot, or only slots whose expert is
    /// more likely to be reused than a prediction is to be right.
    pub prefetch_declined: u64,
    /// Predicted experts a prefetch did not read because the layer's own request had come
    /// since the prediction and only an eviction could have made room: from then on the disk
    /// serves that request, and its misses are read as such.
    pub prefetch_dropped: u64,
    /// Experts a preload ([`SlotTable::reserve_preload`]) loaded before any request: not
    /// predictions, so a request for one is a resident hit like any other.
    pub preloaded: u64,
    /// Resident hits on a slot a preload filled, before it was evicted or re-read: the hits
    /// the preload gave (part of `resident_hits`).
    pub preload_hits: u64,
}

/// Identity of an explicit lease holder (a daemon connection).
pub type HolderId = u64;

/// The slot state machine (no memory, no locking: callers wrap it in their own mutex).
pub struct SlotTable {
    states: Vec<SlotState>,
    leases: Vec<u32>,
    errors: Vec<Option<ExpertError>>,
    map: HashMap<(u32, u32), usize>,
    free: Vec<usize>,
    policy: Box<dyn EvictionPolicy>,
    held: HashMap<(HolderId, u32), Vec<usize>>,
    /// Slots loaded by a prefetch that no request has used yet.
    prefetched: Vec<bool>,
    /// Slots whose expert a preload put there (cleared when it is evicted or the slot re-read).
    preloaded: Vec<bool>,
    /// Requested experts RESIDENT before the request that no prefetch put there: the cache's
    /// own reuse, the rate a prefetch's eviction is weighed against.
    reuse_hits: u64,
    /// Per layer, how many requests ([`SlotTable::reserve`] calls) it has had: a prefetch for
    /// a layer stops evicting once this has moved since its prediction ([`SlotTable::demands`]).
    demands: Vec<u64>,
    counters: TableCounters,
}

impl std::fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SlotTable({} slots, {} resident, policy {})",
            self.states.len(),
            self.map.len(),
            self.policy.name()
        )
    }
}

impl SlotTable {
    /// `slots` EMPTY slots evicted by `policy`.
    pub fn new(slots: usize, policy: Box<dyn EvictionPolicy>) -> SlotTable {
        SlotTable {
            states: vec![SlotState::Empty; slots],
            leases: vec![0; slots],
            errors: vec![None; slots],
            map: HashMap::new(),
            free: (0..slots).rev().collect(),
            policy,
            held: HashMap::new(),
            prefetched: vec![false; slots],
            preloaded: vec![false; slots],
            reuse_hits: 0,
            demands: Vec::new(),
            counters: TableCounters::default(),
        }
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.states.len()
    }

    /// Slots not EMPTY.
    pub fn used(&self) -> usize {
        self.states
            .iter()
            .filter(|s| **s != SlotState::Empty)
            .count()
    }

    /// State of `slot`.
    pub fn state(&self, slot: usize) -> SlotState {
        self.states[slot]
    }

    /// Live leases on `slot`.
    pub fn leases(&self, slot: usize) -> u32 {
        self.leases[slot]
    }

    /// The error of the last failed load into `slot`.
    pub fn last_error(&self, slot: usize) -> Option<&ExpertError> {
        self.errors[slot].as_ref()
    }

    /// Name of the eviction policy.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Counters so far.
    pub fn counters(&self) -> &TableCounters {
        &self.counters
    }

    /// How many requests for `layer` have reserved so far (whatever their outcome).
    pub fn demands(&self, layer: u32) -> u64 {
        self.demands.get(layer as usize).copied().unwrap_or(0)
    }

    /// The slot holding (layer, expert) RESIDENT or INFLIGHT.
    pub fn lookup(&self, layer: u32, expert: u32) -> Option<usize> {
        self.map.get(&(layer, expert)).copied()
    }

    /// Phase 1: reserve slots for `ids` of `layer` (callers normally pass distinct ids; a
    /// repeated missing id is answered `Wait` on the slot its first occurrence loads). Every
    /// returned entry carries one lease for the caller. On error nothing changes (no lease, no
    /// counter).
    pub fn reserve(&mut self, layer: u32, ids: &[u32]) -> Result<Vec<Reserved>, ReserveError> {
        let l = layer as usize;
        if self.demands.len() <= l {
            self.demands.resize(l + 1, 0);
        }
        self.demands[l] += 1;
        let n = self.states.len();
        let mut distinct = ids.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() > n {
            return Err(ReserveError::TooSmall {
                slots: n,
                needed: distinct.len(),
            });
        }
        // Dry run: how many new slots, and how many can be taken without touching a slot this
        // batch hits or waits for?
        let mut missing: Vec<u32> = Vec::new();
        let mut mine = vec![false; 0];
        for &e in ids {
            match self.map.get(&(layer, e)) {
                Some(&s) => {
                    if mine.is_empty() {
                        mine = vec![false; n];
                    }
                    mine[s] = true;
                }
                None if !missing.contains(&e) => missing.push(e),
                None => {}
            }
        }
        let needed = missing.len();
        if needed > 0 {
            let available = (0..n)
                .filter(|&s| {
                    self.leases[s] == 0
                        && !matches!(self.states[s], SlotState::Inflight { .. })
                        && !mine.get(s).copied().unwrap_or(false)
                })
                .count();
            if available < needed {
                return Err(ReserveError::Busy { needed, available });
            }
        }
        // Commit: lease hits and waits first, so no victim can be one of them.
        self.policy.begin(layer);
        let mut out: Vec<Option<Reserved>> = vec![None; ids.len()];
        for (i, &e) in ids.iter().enumerate() {
            self.counters.requests += 1;
            if let Some(&s) = self.map.get(&(layer, e)) {
                self.leases[s] += 1;
                let prefetched = std::mem::take(&mut self.prefetched[s]);
                if prefetched {
                    self.counters.prefetch_used += 1;
                }
                out[i] = Some(match self.states[s] {
                    SlotState::Resident { .. } => {
                        self.counters.resident_hits += 1;
                        if self.preloaded[s] {
                            self.counters.preload_hits += 1;
                        }
                        if !prefetched {
                            self.reuse_hits += 1;
                        }
                        self.policy.touch(s, layer, e);
                        Reserved::Hit { slot: s }
                    }
                    _ => {
                        self.counters.misses += 1;
                        Reserved::Wait { slot: s }
                    }
                });
            }
        }
        for (i, &e) in ids.iter().enumerate() {
            if out[i].is_some() {
                continue;
            }
            self.counters.misses += 1;
            if let Some(&s) = self.map.get(&(layer, e)) {
                // A repeated id whose first occurrence in this batch is being loaded.
                self.leases[s] += 1;
                out[i] = Some(Reserved::Wait { slot: s });
                continue;
            }
            let s = self
                .take_victim()
                .expect("the dry run counted enough eligible slots");
            let evicted = self.evict(s);
            self.begin_load(s, layer, e, false);
            self.leases[s] = 1;
            out[i] = Some(Reserved::Load { slot: s, evicted });
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// Empty `s` of its RESIDENT expert (if any) before it is refilled; returns that expert.
    fn evict(&mut self, s: usize) -> Option<(u32, u32)> {
        self.prefetched[s] = false;
        self.preloaded[s] = false;
        match self.states[s] {
            SlotState::Resident {
                layer: l,
                expert: x,
            } => {
                self.map.remove(&(l, x));
                self.counters.evictions += 1;
                Some((l, x))
            }
            _ => None,
        }
    }

    /// Reserve slots to PREFETCH `ids` of `layer` (a prediction): no lease is taken, nothing
    /// already RESIDENT or INFLIGHT is touched, and each missing expert gets either an EMPTY
    /// slot or — only while predictions have proven more likely to be used
    /// (`(used + 1) ÷ (loaded + 2)`) than a RESIDENT expert is to be hit again (the cache's own
    /// reuse rate) — the policy's victim among unleased RESIDENT slots that are not an unused
    /// prefetch of `layer` itself. Once `layer`'s request has come (`late`) only EMPTY slots
    /// are taken, and an expert that would need an eviction is dropped
    /// ([`TableCounters::prefetch_dropped`]). The returned `(slot, expert)` pairs are INFLIGHT;
    /// load each and [`SlotTable::publish`] it (a waiting request is woken by the publish as
    /// usual).
    pub fn reserve_prefetch(&mut self, layer: u32, ids: &[u32], late: bool) -> Vec<(usize, u32)> {
        let c = &self.counters;
        let right = (c.prefetch_used as f64 + 1.0) / (c.prefetch_loads as f64 + 2.0);
        let reuse = if c.requests == 0 {
            0.0
        } else {
            self.reuse_hits as f64 / c.requests as f64
        };
        let may_evict = right > reuse;
        let mut out = Vec::new();
        for (i, &e) in ids.iter().enumerate() {
            if ids[..i].contains(&e) || self.map.contains_key(&(layer, e)) {
                continue;
            }
            let free = self.take_empty();
            if free.is_none() && late {
                self.counters.prefetch_dropped += 1;
                continue;
            }
            let slot = free.or_else(|| {
                if !may_evict {
                    return None;
                }
                let (states, leases, pre) = (&self.states, &self.leases, &self.prefetched);
                self.policy.victim(&mut |s| {
                    leases[s] == 0
                        && match states[s] {
                            SlotState::Resident { layer: l, .. } => !(pre[s] && l == layer),
                            _ => false,
                        }
                })
            });
            let Some(s) = slot else {
                self.counters.prefetch_declined += 1;
                continue;
            };
            self.evict(s);
            self.begin_load(s, layer, e, true);
            self.counters.prefetch_loads += 1;
            out.push((s, e));
        }
        out
    }

    /// Reserve EMPTY slots for the experts `ids` of `layer` that are not mapped yet, in order,
    /// for a preload: the cache filled before any request (nothing is ever evicted for it).
    /// Stops at the first expert without an EMPTY slot. The returned `(slot, expert)` pairs are
    /// INFLIGHT, not marked as predictions but as preloaded (a request that finds one RESIDENT
    /// counts a [`TableCounters::preload_hits`]); load each and [`SlotTable::publish`] it.
    pub fn reserve_preload(&mut self, layer: u32, ids: &[u32]) -> Vec<(usize, u32)> {
        let mut out = Vec::new();
        for (i, &e) in ids.iter().enumerate() {
            if ids[..i].contains(&e) || self.map.contains_key(&(layer, e)) {
                continue;
            }
            let Some(s) = self.take_empty() else { break };
            self.begin_load(s, layer, e, false);
            self.preloaded[s] = true;
            self.counters.preloaded += 1;
            out.push((s, e));
        }
        out
    }

    /// An EMPTY slot nobody leases, taken off the free list.
    fn take_empty(&mut self) -> Option<usize> {
        let pos = (self.free.iter())
            .rposition(|&s| self.leases[s] == 0 && self.states[s] == SlotState::Empty)?;
        Some(self.free.swap_remove(pos))
    }

    /// Start loading (`layer`, `e`) into slot `s` (EMPTY, or just evicted): INFLIGHT, no error,
    /// mapped; `predicted` marks a prefetch's load (a request that uses it counts as used).
    fn begin_load(&mut self, s: usize, layer: u32, e: u32, predicted: bool) {
        self.states[s] = SlotState::Inflight { layer, expert: e };
        self.errors[s] = None;
        self.prefetched[s] = predicted;
        self.preloaded[s] = false;
        self.map.insert((layer, e), s);
    }

    fn take_victim(&mut self) -> Option<usize> {
        if let Some(s) = self.take_empty() {
            return Some(s);
        }
        let (states, leases) = (&self.states, &self.leases);
        self.policy
            .victim(&mut |s| leases[s] == 0 && matches!(states[s], SlotState::Resident { .. }))
    }

    /// Phase 3: the load into `slot` (INFLIGHT) finished. `Ok` makes it RESIDENT; `Err` makes it
    /// EMPTY, remembers the message for waiters and counts a failed load. The caller's lease is
    /// not released (release it yourself after a failure).
    pub fn publish(&mut self, slot: usize, result: Result<(), ExpertError>) {
        let SlotState::Inflight { layer, expert } = self.states[slot] else {
            return;
        };
        match result {
            Ok(()) => {
                self.states[slot] = SlotState::Resident { layer, expert };
                self.policy.touch(slot, layer, expert);
            }
            Err(m) => {
                // A failed prefetch is not a failed load: a request for that expert reads it
                // again and reports its own failure.
                if !std::mem::take(&mut self.prefetched[slot]) {
                    self.counters.failed_loads += 1;
                }
                self.preloaded[slot] = false;
                self.map.remove(&(layer, expert));
                self.states[slot] = SlotState::Empty;
                self.errors[slot] = Some(m);
                self.policy.forget(slot);
                self.free.push(slot);
            }
        }
    }

    /// One lease on the slot holding (`layer`, `expert`) if it is RESIDENT now, else `None`.
    /// Touches no counter and no eviction order: a draft model uses what is in memory without
    /// being counted as a request of the job.
    pub fn lease_resident(&mut self, layer: u32, expert: u32) -> Option<usize> {
        let s = self.lookup(layer, expert)?;
        matches!(self.states[s], SlotState::Resident { .. }).then(|| {
            self.leases[s] += 1;
            s
        })
    }

    /// Count a request of `requests` experts answered outside the arena (daemon mode: the
    /// worker reads the `requests − resident_hits` that were not resident itself, because other
    /// workers held the slots). They are demands like any other: the TRUE hit rate counts them.
    pub fn count_private(&mut self, requests: u64, resident_hits: u64) {
        self.counters.requests += requests;
        self.counters.resident_hits += resident_hits;
        self.counters.misses += requests.saturating_sub(resident_hits);
    }

    /// Drop one lease on `slot`.
    pub fn release(&mut self, slot: usize) {
        self.leases[slot] = self.leases[slot].saturating_sub(1);
    }

    /// Record that `holder` keeps one lease on each of `slots` for `layer` (daemon mode). Any
    /// leases it held for that layer before are released first.
    pub fn hold(&mut self, holder: HolderId, layer: u32, slots: Vec<usize>) {
        self.release_layer(holder, layer);
        self.held.insert((holder, layer), slots);
    }

    /// Release `holder`'s leases for `layer`.
    pub fn release_layer(&mut self, holder: HolderId, layer: u32) {
        if let Some(v) = self.held.remove(&(holder, layer)) {
            for s in v {
                self.release(s);
            }
        }
    }

    /// Every holder with leases, and how many slots it holds (a slot leased twice counts
    /// twice).
    pub fn holders(&self) -> Vec<(HolderId, usize)> {
        let mut by: BTreeMap<HolderId, usize> = BTreeMap::new();
        for ((h, _), v) in &self.held {
            *by.entry(*h).or_default() += v.len();
        }
        by.into_iter().filter(|(_, n)| *n > 0).collect()
    }

    /// Release everything `holder` holds (disconnect).
    pub fn release_holder(&mut self, holder: HolderId) {
        let keys: Vec<(HolderId, u32)> = self
            .held
            .keys()
            .filter(|k| k.0 == holder)
            .copied()
            .collect();
        for k in keys {
            self.release_layer(k.0, k.1);
        }
    }
}

/// Reads one expert from the shards into a slot, in canonical layout from
/// [`ExpertReader::offset_in_slot`].
#[derive(Debug)]
pub struct ExpertReader {
    files: Vec<Arc<DiskFile>>,
    layout: ExpertLayout,
}

impl ExpertReader {
    /// Over the given open shard files.
    pub fn new(files: Vec<Arc<DiskFile>>, layout: ExpertLayout) -> ExpertReader {
        ExpertReader { files, layout }
    }

    /// Bytes between slots: room for the aligned span of one expert (the coalesced read lands in
    /// place and the expert stays at its in-page offset), a multiple of 4096.
    pub fn slot_stride(layout: &ExpertLayout) -> usize {
        let e = layout.expert_bytes() as u64;
        (align_up(e).unwrap_or(e) as usize) + ALIGN
    }

    /// True when every shard is read with `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.files.iter().all(|f| f.is_direct())
    }

    /// Bytes of one expert.
    pub fn expert_bytes(&self) -> usize {
        self.layout.expert_bytes()
    }

    /// Where the expert `ext` starts in its slot: when its six parts are one run on disk (they
    /// are in canonical order in the real checkpoint) it is read with one aligned span and stays
    /// where that span puts it, at the run's offset within its 4096-byte page, so no byte is
    /// moved after the read; otherwise its parts are read to their canonical offsets from 0.
    pub fn offset_in_slot(ext: &ExpertExtents) -> usize {
        ext.coalesced()
            .map_or(0, |(_, off)| (off % ALIGN as u64) as usize)
    }

    /// Read the expert `ext` into `dst` (4096-aligned, at least [`ExpertReader::slot_stride`]
    /// bytes); on success `dst[at..at + expert_bytes]` is the expert in canonical layout, `at`
    /// being [`ExpertReader::offset_in_slot`].
    pub fn read(&self, what: &str, ext: &ExpertExtents, dst: &mut [u8]) -> Result<(), ReadError> {
        let eb = self.layout.expert_bytes();
        if dst.len() < Self::slot_stride(&self.layout) {
            return Err(ReadError::msg(format!(
                "{what}: slot of {} bytes too small",
                dst.len()
            )));
        }
        let file = |s: u16| {
            self.files
                .get(s as usize)
                .ok_or_else(|| ReadError::msg(format!("{what}: shard {s} is not open")))
        };
        if let Some((shard, off)) = ext.coalesced() {
            let inner = file(shard)?
                .read_span(off, eb as u64, dst)
                .map_err(|e| ReadError::msg(format!("{what}: {}", e.0)))?;
            debug_assert_eq!(inner, Self::offset_in_slot(ext));
            return Ok(());
        }
        for (i, p) in ExpertPart::ALL.iter().enumerate() {
            let pe = ext.parts[i];
            let at = self.layout.part_offset(*p);
            file(pe.shard)?
                .read_exact_at(pe.off, &mut dst[at..at + pe.nbytes as usize])
                .map_err(|e| ReadError::msg(format!("{what} {}: {}", p.suffix(), e.0)))?;
        }
        Ok(())
    }
}

/// The routed-expert slots' memory: `slots` slots of `stride` bytes at one base address (the
/// standalone cache's heap arena, or the daemon's arena in shared memory). Slot bytes are only
/// reached through `Arena::slot_mut` (by the request that holds the slot INFLIGHT) and
/// `Arena::slot` (under a lease): the slot protocol decides who may touch them, and the
/// [`ArenaMem`] refuses a write guard over a slot being read (or written), so a mistake of the
/// protocol is an error, never aliased bytes.
pub struct Arena {
    mem: Arc<ArenaMem>,
    stride: usize,
    slots: usize,
}

/// Why the expert slots could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ArenaSetupError {
    /// `slots × stride` overflows.
    #[error("{slots} slots of {stride} bytes overflow")]
    Overflow {
        /// Slots asked for.
        slots: usize,
        /// Bytes per slot.
        stride: usize,
    },
    /// The memory given is too short.
    #[error("{slots} slots of {stride} bytes do not fit in {have} bytes")]
    NoFit {
        /// Slots asked for.
        slots: usize,
        /// Bytes per slot.
        stride: usize,
        /// Bytes given.
        have: usize,
    },
    /// The slots' memory could not be allocated.
    #[error("expert slots: {0}")]
    Alloc(#[from] crate::runtime::io::AllocError),
    /// The reader threads could not be started.
    #[error("starting {io_threads} expert reader threads: {source}")]
    Threads {
        /// Threads asked for.
        io_threads: usize,
        /// Why.
        source: std::io::Error,
    },
}

impl Arena {
    /// `slots` zeroed slots of `stride` bytes on the heap (pages are committed when first
    /// written).
    pub fn heap(stride: usize, slots: usize) -> Result<Arena, ArenaSetupError> {
        let len = stride
            .checked_mul(slots)
            .ok_or(ArenaSetupError::Overflow { slots, stride })?;
        Ok(Arena {
            mem: Arc::new(ArenaMem::new(len)?),
            stride,
            slots,
        })
    }

    /// `slots` slots of `stride` bytes at the start of `mem` (memory the caller owns, such as
    /// the daemon's shared-memory segment). Fails if `mem` is too short.
    ///
    /// # Safety
    /// As [`ArenaMem::over`]: `mem` must stay mapped and valid for reads and writes for as long
    /// as the arena is used, and must not be accessed in this process other than through it.
    pub unsafe fn over(
        mem: &mut [u8],
        stride: usize,
        slots: usize,
    ) -> Result<Arena, ArenaSetupError> {
        let need = stride.checked_mul(slots);
        if need.is_none_or(|n| n > mem.len()) {
            return Err(ArenaSetupError::NoFit {
                slots,
                stride,
                have: mem.len(),
            });
        }
        Ok(Arena {
            // SAFETY: the caller's contract is ArenaMem::over's.
            mem: Arc::new(unsafe { ArenaMem::over(mem) }),
            stride,
            slots,
        })
    }

    /// Bytes between slots.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The bytes of `slot`, to read an expert into: for the request that holds it INFLIGHT
    /// from its own reservation (no other request writes it, nobody holds a lease to read it).
    fn slot_mut(&self, slot: usize) -> Result<ArenaWrite<'_>, SlotProblem> {
        self.check(slot)?;
        (self.mem.write(slot * self.stride, self.stride))
            .map_err(|source| SlotProblem::Arena { slot, source })
    }

    /// The bytes of `slot`, to read the expert it holds: for a holder of a lease on it while it
    /// is RESIDENT (a leased slot is never chosen as a victim, so nobody writes it).
    fn slot(&self, slot: usize) -> Result<ArenaRead, SlotProblem> {
        self.check(slot)?;
        (self.mem.read(slot * self.stride, self.stride))
            .map_err(|source| SlotProblem::Arena { slot, source })
    }

    fn check(&self, slot: usize) -> Result<(), SlotProblem> {
        if slot < self.slots {
            Ok(())
        } else {
            Err(SlotProblem::OutOfRange {
                slot,
                slots: self.slots,
            })
        }
    }
}

/// What the lock of [`ExpertSlots`] guards: the slot table, the read counters, and the caller's
/// own bookkeeping `X`.
#[derive(Debug)]
pub struct Locked<X> {
    /// The slot state machine.
    pub table: SlotTable,
    /// Bytes of experts read.
    pub bytes_read: u64,
    /// Wall seconds of the read phases.
    pub read_seconds: f64,
    /// Bytes of experts read by prefetches (included in `bytes_read`).
    pub prefetch_bytes: u64,
    /// Experts those prefetches loaded, counted with their bytes once the read is done (the
    /// table's `prefetch_loads` counts them when reserved, so it includes reads in flight).
    pub prefetch_loads: u64,
    /// Bytes of experts a preload read at start-up (not in `bytes_read`, which counts what
    /// requests and their predictions cost).
    pub preload_bytes: u64,
    /// Wall seconds of the preload (not in `read_seconds`).
    pub preload_seconds: f64,
    /// The caller's own state.
    pub extra: X,
}

/// What [`ExpertSlots::serve_batch`] decided for one distinct requested expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// RESIDENT before the request (a TRUE resident hit; a wait on another request's read is a
    /// miss).
    pub hit: bool,
    /// The slot holding the expert, with one lease for the caller; or why it could not be
    /// loaded (no lease).
    pub slot: Result<usize, ExpertError>,
    /// Where in its slot the expert's first byte is ([`ExpertReader::offset_in_slot`]).
    pub at: usize,
}

/// A served batch.
#[derive(Clone, Debug)]
pub struct Served {
    /// One outcome per distinct requested expert, in order of first occurrence.
    pub outcomes: Vec<Outcome>,
    /// For each requested id, in request order, the index of its outcome.
    pub index: Vec<usize>,
    /// Bytes this batch read.
    pub bytes_read: u64,
    /// Wall seconds of this batch's read phase (0 when it read nothing).
    pub read_seconds: f64,
    /// Requested experts a prefetch had loaded (or was loading) for this batch to use.
    pub prefetch_used: u64,
    /// Requested experts RESIDENT because the start-up preload put them there
    /// ([`TableCounters::preload_hits`]).
    pub preload_hits: u64,
}

impl Served {
    /// `per_outcome` (one value per outcome) spread back to request order.
    pub fn in_request_order<T: Clone>(&self, per_outcome: &[T]) -> Vec<T> {
        self.index.iter().map(|&i| per_outcome[i].clone()).collect()
    }
}

/// Why [`ExpertSlots::serve_batch`] served nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchError {
    /// The request can never be served (layer or expert out of range, cache too small).
    Invalid(String),
    /// Slots stayed leased past the busy timeout.
    Busy(ReserveError),
}

/// A failure injected into reads (tests).
pub type FailHook = Box<dyn Fn(u32, u32) -> Option<String> + Send + Sync>;

/// The slot protocol over one [`Arena`]: the one implementation of the three batch phases, used
/// by the standalone [`ExpertCache`] and by the daemon's backend.
pub struct ExpertSlots<X> {
    state: Mutex<Locked<X>>,
    cv: Condvar,
    io: Arc<SlotIo>,
    catalog: Arc<Catalog>,
    /// The long-lived readers of phase 2 (no thread is spawned per batch).
    pool: IoPool,
    busy_timeout: Duration,
}

/// What a phase-2 read touches: the slot memory and the reader, shared with the I/O threads.
struct SlotIo {
    arena: Arena,
    reader: ExpertReader,
}

impl<X: Send> ExpertSlots<X> {
    /// The protocol over `arena` (one slot per table slot), reading `catalog`'s experts from
    /// `files` on `io_threads` long-lived reader threads (started here); a batch waits up to
    /// `busy_timeout` for leased slots. Fails only if the reader threads cannot be started.
    pub fn new(
        catalog: Arc<Catalog>,
        files: Vec<Arc<DiskFile>>,
        arena: Arena,
        policy: Box<dyn EvictionPolicy>,
        io_threads: usize,
        busy_timeout: Duration,
        extra: X,
    ) -> Result<ExpertSlots<X>, ArenaSetupError> {
        let pool = IoPool::new("k3-expert-io", io_threads)
            .map_err(|source| ArenaSetupError::Threads { io_threads, source })?;
        Ok(ExpertSlots {
            state: Mutex::new(Locked {
                table: SlotTable::new(arena.slots(), policy),
                bytes_read: 0,
                read_seconds: 0.0,
                prefetch_bytes: 0,
                prefetch_loads: 0,
                preload_bytes: 0,
                preload_seconds: 0.0,
                extra,
            }),
            cv: Condvar::new(),
            io: Arc::new(SlotIo {
                reader: ExpertReader::new(files, catalog.expert_layout()),
                arena,
            }),
            catalog,
            pool,
            busy_timeout,
        })
    }

    /// The lock over the table and counters.
    pub fn lock(&self) -> MutexGuard<'_, Locked<X>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wake batches waiting for slots (call after releasing leases).
    pub fn notify(&self) {
        self.cv.notify_all();
    }

    /// The slot memory.
    pub fn arena(&self) -> &Arena {
        &self.io.arena
    }

    /// How many requests `layer` has had ([`SlotTable::demands`]): a prefetch's `since`.
    pub fn demands(&self, layer: usize) -> u64 {
        u32::try_from(layer).map_or(0, |l| self.lock().table.demands(l))
    }

    /// The expert reader.
    pub fn reader(&self) -> &ExpertReader {
        &self.io.reader
    }

    /// Where expert `e` of `layer` starts in the slot that holds it
    /// ([`ExpertReader::offset_in_slot`]; 0 for an expert the checkpoint lacks, never served).
    pub fn offset_in_slot(&self, layer: usize, e: u32) -> usize {
        (self.catalog.expert(layer, e as usize)).map_or(0, |x| ExpertReader::offset_in_slot(&x))
    }

    /// Serve experts `ids` of `layer` in the three phases of the module docs. Every `Ok` slot
    /// carries one lease: held by `holder` (recorded with [`SlotTable::hold`], after that
    /// holder's earlier leases were released before reserving) or, without a holder, by the
    /// caller, who must [`SlotTable::release`] it. `mirror` is told of every slot whose state the
    /// batch set (after reserving and after publishing), `fail` injects read failures. Returns
    /// with the lock still held so the caller can book the batch consistently.
    pub fn serve_batch(
        &self,
        layer: usize,
        ids: &[u32],
        holder: Option<HolderId>,
        fail: Option<&FailHook>,
        mirror: &dyn Fn(&SlotTable, usize),
    ) -> Result<(MutexGuard<'_, Locked<X>>, Served), BatchError> {
        self.serve_batch_within(layer, ids, holder, fail, mirror, self.busy_timeout)
    }

    /// [`ExpertSlots::serve_batch`], waiting at most `wait` (instead of the busy timeout) for
    /// leased slots to be released.
    pub fn serve_batch_within(
        &self,
        layer: usize,
        ids: &[u32],
        holder: Option<HolderId>,
        fail: Option<&FailHook>,
        mirror: &dyn Fn(&SlotTable, usize),
        wait: Duration,
    ) -> Result<(MutexGuard<'_, Locked<X>>, Served), BatchError> {
        self.check_batch(layer, ids)?;
        let l = layer as u32;
        let (uniq, index) = distinct(ids);

        // Phase 1: reserve.
        let mut g = self.lock();
        if let Some(h) = holder {
            g.table.release_holder(h);
        }
        let used0 = g.table.counters().prefetch_used;
        let preload0 = g.table.counters().preload_hits;
        let plan;
        (g, plan) = self.reserve_within(g, l, &uniq, wait)?;
        let prefetch_used = g.table.counters().prefetch_used - used0;
        let preload_hits = g.table.counters().preload_hits - preload0;
        let mut loads = Vec::new();
        for (r, &e) in plan.iter().zip(&uniq) {
            mirror(&g.table, r.slot());
            if let Reserved::Load { slot, .. } = *r {
                loads.push((slot, e));
            }
        }
        drop(g);

        // Phase 2: read the misses in parallel on the reader threads, in disk-offset order,
        // straight into their slots.
        let jobs = self.read_jobs(layer, loads, fail);
        let t_read = Instant::now();
        let n_jobs = jobs.len();
        let results = self.read_into_slots(layer, jobs);
        let read_seconds = if n_jobs > 0 {
            t_read.elapsed().as_secs_f64()
        } else {
            0.0
        };

        // Phase 3: publish what arrived.
        let eb = self.io.reader.expert_bytes() as u64;
        let mut g = self.lock();
        let mut failed: HashMap<usize, ExpertError> = HashMap::new();
        let mut bytes_read = 0u64;
        for (slot, res) in results {
            match res {
                Ok(()) => {
                    g.table.publish(slot, Ok(()));
                    bytes_read += eb;
                }
                Err(m) => {
                    g.table.publish(slot, Err(m.clone()));
                    g.table.release(slot);
                    failed.insert(slot, m);
                }
            }
            mirror(&g.table, slot);
        }
        g.bytes_read += bytes_read;
        g.read_seconds += read_seconds;
        self.cv.notify_all();
        // Waits: experts another request was reading.
        let mut outcomes = Vec::with_capacity(uniq.len());
        for (r, &e) in plan.iter().zip(&uniq) {
            let slot = match failed.get(&r.slot()) {
                Some(m) => Err(m.clone()),
                None => {
                    let got;
                    (g, got) = self.settled(g, r, layer, e);
                    got
                }
            };
            outcomes.push(Outcome {
                hit: matches!(r, Reserved::Hit { .. }),
                slot,
                at: self.offset_in_slot(layer, e),
            });
        }
        if let Some(h) = holder {
            let held = outcomes.iter().filter_map(|o| o.slot.clone().ok());
            g.table.hold(h, l, held.collect());
        }
        let served = Served {
            outcomes,
            index,
            bytes_read,
            read_seconds,
            prefetch_used,
            preload_hits,
        };
        Ok((g, served))
    }
}

impl<X: Send> ExpertSlots<X> {
    /// A batch's layer and experts exist in the catalog.
    fn check_batch(&self, layer: usize, ids: &[u32]) -> Result<(), BatchError> {
        let cat = &self.catalog;
        if layer >= cat.n_layers() {
            return Err(BatchError::Invalid(format!(
                "layer {layer} out of range ({} layers)",
                cat.n_layers()
            )));
        }
        if let Some(&bad) = ids.iter().find(|&&e| e as usize >= cat.n_experts()) {
            return Err(BatchError::Invalid(format!(
                "expert {bad} out of range ({} experts)",
                cat.n_experts()
            )));
        }
        Ok(())
    }

    /// Phase 1 of a batch: slots reserved for the distinct experts `uniq` of layer `l`, waiting
    /// at most `wait` for leased slots to be released (then `Busy`).
    fn reserve_within<'a>(
        &'a self,
        mut g: MutexGuard<'a, Locked<X>>,
        l: u32,
        uniq: &[u32],
        wait: Duration,
    ) -> Result<(MutexGuard<'a, Locked<X>>, Vec<Reserved>), BatchError> {
        let deadline = Instant::now() + wait;
        loop {
            match g.table.reserve(l, uniq) {
                Ok(p) => return Ok((g, p)),
                Err(e @ ReserveError::TooSmall { .. }) => {
                    return Err(BatchError::Invalid(e.to_string()))
                }
                Err(e @ ReserveError::Busy { .. }) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(BatchError::Busy(e));
                    }
                    g = self
                        .cv
                        .wait_timeout(g, deadline - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
    }

    /// The slot of expert `e` once settled: a hit or a load of this batch as it is; an expert
    /// another request was reading is waited for, and its failure (the slot released) reported.
    fn settled<'a>(
        &'a self,
        mut g: MutexGuard<'a, Locked<X>>,
        r: &Reserved,
        layer: usize,
        e: u32,
    ) -> (MutexGuard<'a, Locked<X>>, Result<usize, ExpertError>) {
        let (slot, l) = (r.slot(), layer as u32);
        if !matches!(r, Reserved::Wait { .. }) {
            return (g, Ok(slot));
        }
        let inflight = SlotState::Inflight {
            layer: l,
            expert: e,
        };
        while g.table.state(slot) == inflight {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        if g.table.state(slot)
            == (SlotState::Resident {
                layer: l,
                expert: e,
            })
        {
            return (g, Ok(slot));
        }
        let m = (g.table.last_error(slot))
            .map(|m| ExpertError::Concurrent(Box::new(m.clone())))
            .unwrap_or(ExpertError::LoadFailed { layer, expert: e });
        g.table.release(slot);
        (g, Err(m))
    }
}

/// The distinct values of `ids` in first-seen order, and each id's index among them.
fn distinct(ids: &[u32]) -> (Vec<u32>, Vec<usize>) {
    let mut uniq: Vec<u32> = Vec::with_capacity(ids.len());
    let mut index = Vec::with_capacity(ids.len());
    for &e in ids {
        index.push(uniq.iter().position(|&u| u == e).unwrap_or(uniq.len()));
        if index.last() == Some(&uniq.len()) {
            uniq.push(e);
        }
    }
    (uniq, index)
}

/// One read of phase 2: (slot, expert, its extents, an injected failure).
type ReadJob = (usize, u32, Option<ExpertExtents>, Option<String>);

/// What one [`ExpertSlots::prefetch`] did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Prefetched {
    /// Experts it loaded.
    pub loads: u64,
    /// Bytes it read.
    pub bytes_read: u64,
    /// Predictions it dropped unread ([`TableCounters::prefetch_dropped`]).
    pub dropped: u64,
}

impl<X: Send> ExpertSlots<X> {
    /// Phase 2's jobs for the reserved `(slot, expert)` pairs of `layer`: in disk-offset order,
    /// each with its extents and its injected failure, decided here before any read (call it
    /// without the lock: a hook may wait on another request).
    fn read_jobs(
        &self,
        layer: usize,
        picks: Vec<(usize, u32)>,
        fail: Option<&FailHook>,
    ) -> Vec<ReadJob> {
        let mut jobs: Vec<(usize, u32, Option<ExpertExtents>)> = (picks.into_iter())
            .map(|(slot, e)| (slot, e, self.catalog.expert(layer, e as usize)))
            .collect();
        jobs.sort_by_key(|j| j.2.map_or((u16::MAX, u64::MAX), |x| x.disk_key()));
        let l = layer as u32;
        (jobs.into_iter())
            .map(|(slot, e, ext)| (slot, e, ext, fail.and_then(|f| f(l, e))))
            .collect()
    }

    /// Phase 2: read each job's expert into its slot (INFLIGHT, reserved by the caller) on the
    /// reader threads; results per slot, in job order.
    fn read_into_slots(
        &self,
        layer: usize,
        jobs: Vec<ReadJob>,
    ) -> Vec<(usize, Result<(), ExpertError>)> {
        let slots_of: Vec<usize> = jobs.iter().map(|j| j.0).collect();
        let io = self.io.clone();
        let read = move |(slot, e, ext, injected): ReadJob| {
            match (injected, ext) {
                (Some(message), _) => Err(ExpertError::Injected {
                    layer,
                    expert: e,
                    message,
                }),
                (None, None) => Err(ExpertError::NotInCheckpoint { layer, expert: e }),
                (None, Some(ext)) => {
                    // `slot` is INFLIGHT from the caller's reservation: this job alone writes it.
                    let mut dst = io.arena.slot_mut(slot)?;
                    let what = format!("layer {layer} expert {e}");
                    Ok(io.reader.read(&what, &ext, &mut dst)?)
                }
            }
        };
        slots_of
            .into_iter()
            .zip(self.pool.map(jobs, Arc::new(read)))
            .map(|(slot, r)| (slot, r.map_err(ExpertError::from).and_then(|x| x)))
            .collect()
    }

    /// Prefetch the predicted experts `ids` of `layer` (most likely first) into slots no lease
    /// or pending request needs ([`SlotTable::reserve_prefetch`]), read them and publish them,
    /// without leasing. Experts already RESIDENT or INFLIGHT, and those without a slot that may
    /// be taken, are skipped. Ids out of range are ignored (a prediction is never an error).
    /// `mirror` is told of every slot whose state changed.
    ///
    /// The predictions are reserved and read a few at a time (one per reader thread), in the
    /// given order. Once a request for `layer` has come since the prediction was made (`since`:
    /// [`ExpertSlots::demands`] then, so a prefetch that starts late knows), a prediction is
    /// read only into an EMPTY slot: one that would evict is dropped. Such a read would compete
    /// with the request's own misses (which include the right predictions not read yet) for an
    /// expert that is likely wrong, and it would push out an expert a later token may use. So
    /// the likelier predictions are read first, and evictions happen only before the layer asks.
    pub fn prefetch(
        &self,
        layer: usize,
        ids: &[u32],
        since: u64,
        fail: Option<&FailHook>,
        mirror: &dyn Fn(&SlotTable, usize),
    ) -> Prefetched {
        let cat = &self.catalog;
        if layer >= cat.n_layers() {
            return Prefetched::default();
        }
        let ids: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&e| (e as usize) < cat.n_experts())
            .collect();
        let l = layer as u32;
        let mut done = Prefetched::default();
        let chunk = self.pool.threads().max(1);
        for part in ids.chunks(chunk) {
            let mut g = self.lock();
            let late = g.table.demands(l) != since;
            let dropped = g.table.counters().prefetch_dropped;
            let plan = g.table.reserve_prefetch(l, part, late);
            done.dropped += g.table.counters().prefetch_dropped - dropped;
            if plan.is_empty() {
                continue;
            }
            for &(slot, _) in &plan {
                mirror(&g.table, slot);
            }
            drop(g);
            let (mut g, r) = self.read_reserved(layer, plan, fail, mirror);
            done.loads += r.experts;
            done.bytes_read += r.bytes;
            g.bytes_read += r.bytes;
            g.prefetch_bytes += r.bytes;
            g.prefetch_loads += r.experts;
            g.read_seconds += r.seconds;
        }
        done
    }

    /// Phases 2 and 3 for slots the caller reserved (INFLIGHT, no lease) and mirrored: read
    /// `plan`'s experts of `layer`, publish each result (mirrored), wake the waiters. Returns
    /// the lock, for the caller to count what was read, and what was read.
    fn read_reserved(
        &self,
        layer: usize,
        plan: Vec<(usize, u32)>,
        fail: Option<&FailHook>,
        mirror: &dyn Fn(&SlotTable, usize),
    ) -> (MutexGuard<'_, Locked<X>>, ReadReserved) {
        let eb = self.io.reader.expert_bytes() as u64;
        let jobs = self.read_jobs(layer, plan, fail);
        let t_read = Instant::now();
        let results = self.read_into_slots(layer, jobs);
        let mut r = ReadReserved {
            seconds: t_read.elapsed().as_secs_f64(),
            ..ReadReserved::default()
        };
        let mut g = self.lock();
        for (slot, res) in results {
            match &res {
                Ok(()) => {
                    r.experts += 1;
                    r.bytes += eb;
                }
                Err(m) => {
                    r.failed.get_or_insert_with(|| m.clone());
                }
            }
            g.table.publish(slot, res);
            mirror(&g.table, slot);
        }
        self.cv.notify_all();
        (g, r)
    }
}

/// What [`ExpertSlots::read_reserved`] read.
#[derive(Default)]
struct ReadReserved {
    /// Experts now RESIDENT.
    experts: u64,
    /// Their bytes.
    bytes: u64,
    /// Wall seconds of the reads.
    seconds: f64,
    /// The first failed read's message (its slot is EMPTY again).
    failed: Option<ExpertError>,
}

impl<X: Send> ExpertSlots<X> {
    /// Fill EMPTY slots with the experts of `set` (every routed expert the checkpoint holds, or
    /// a list: the store's most used experts, SPEC.md §6.3), layer by layer (each batch in
    /// disk-offset order on the reader threads), before any request: so that no token waits
    /// for a first read of them. Stops quietly when the slots run out; never evicts. A
    /// preloaded slot counts its hits ([`TableCounters::preload_hits`]) until it is evicted.
    /// Calls `progress(bytes done, bytes in all)`. A failed read fails the preload (the
    /// checkpoint is damaged or unreadable): the other experts of its batch are published, the
    /// failed one stays EMPTY.
    pub fn preload(
        &self,
        set: &PreloadSet,
        fail: Option<&FailHook>,
        mirror: &dyn Fn(&SlotTable, usize),
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Preloaded, ExpertError> {
        let eb = self.io.reader.expert_bytes() as u64;
        let all = set.experts(&self.catalog, self.arena().slots());
        let total = eb * set.count(&self.catalog, self.arena().slots()) as u64;
        let chunk = 4 * self.pool.threads().max(1);
        let mut done = Preloaded::default();
        progress(0, total);
        for of_layer in all.chunk_by(|a, b| a.0 == b.0) {
            let layer = of_layer[0].0;
            let ids: Vec<u32> = of_layer.iter().map(|&(_, e)| e).collect();
            for part in ids.chunks(chunk) {
                let mut g = self.lock();
                let plan = g.table.reserve_preload(layer as u32, part);
                for &(slot, _) in &plan {
                    mirror(&g.table, slot);
                }
                let full = g.table.used() == g.table.slots();
                drop(g);
                if plan.is_empty() {
                    if full {
                        return Ok(done);
                    }
                    continue;
                }
                let (mut g, r) = self.read_reserved(layer, plan, fail, mirror);
                g.preload_bytes += r.bytes;
                g.preload_seconds += r.seconds;
                drop(g);
                done.experts += r.experts;
                done.bytes += r.bytes;
                done.seconds += r.seconds;
                if let Some(e) = r.failed {
                    return Err(e);
                }
                progress(done.bytes, total);
            }
        }
        Ok(done)
    }
}

/// Which experts a start-up preload reads ([`ExpertSlots::preload`]; chosen from `--preload`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PreloadSet {
    /// None: each expert is read on first use.
    #[default]
    Nothing,
    /// Every routed expert the checkpoint holds (as many as there are slots, in layer order).
    Every,
    /// These `(layer, expert)` pairs, most wanted first (the store's most used experts): the
    /// first `slots` of them that the checkpoint holds are read, layer by layer.
    These(Vec<(usize, u32)>),
}

impl PreloadSet {
    /// The experts to read into `slots` slots, by layer then expert, each once, only those
    /// `cat` holds.
    fn experts(&self, cat: &Catalog, slots: usize) -> Vec<(usize, u32)> {
        match self {
            PreloadSet::Nothing => Vec::new(),
            PreloadSet::Every => cat.routed_experts().collect(),
            PreloadSet::These(list) => {
                let mut seen = std::collections::HashSet::new();
                let mut v: Vec<(usize, u32)> = (list.iter().copied())
                    .filter(|&(l, e)| cat.expert(l, e as usize).is_some() && seen.insert((l, e)))
                    .take(slots)
                    .collect();
                v.sort_unstable();
                v
            }
        }
    }

    /// How many experts it reads into a cache of `slots` slots.
    pub fn count(&self, cat: &Catalog, slots: usize) -> usize {
        match self {
            PreloadSet::Nothing => 0,
            PreloadSet::Every => cat.routed_experts().count().min(slots),
            PreloadSet::These(_) => self.experts(cat, slots).len(),
        }
    }
}

/// When the routed-expert cache is filled at start-up (`--preload`, parsed by
/// [`crate::cli`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Preload {
    /// Every expert when the cache holds them all; otherwise, in a store with a usage history
    /// (`--state-dir`), the most used experts that fit (as `Hot`); otherwise none.
    #[default]
    Auto,
    /// Every expert; a cache that cannot hold every routed expert is refused.
    On,
    /// The most used experts of the store's usage history that fit (a store with
    /// `--state-dir` only).
    Hot,
    /// Never: each expert is read on first use.
    Off,
}

impl Preload {
    /// Whether a standalone cache of `slots` slots for a checkpoint of `experts` routed experts
    /// preloads every expert; `Err` (a refusal, exit 2) for `on` when they do not all fit and
    /// for `hot` (a standalone process keeps no usage history).
    pub fn wanted(self, slots: usize, experts: usize) -> Result<bool, PreloadRefused> {
        match self {
            Preload::Off => Ok(false),
            Preload::Auto => Ok(slots >= experts),
            Preload::On if slots >= experts => Ok(true),
            Preload::On => Err(PreloadRefused::NotAll { slots, experts }),
            Preload::Hot => Err(PreloadRefused::NoHistory {
                what: "a standalone worker keeps none (a store started with --state-dir does)",
            }),
        }
    }
}

/// A `--preload` that cannot be done (a refusal, exit 2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PreloadRefused {
    /// `--preload on` with a cache that cannot hold every routed expert.
    #[error(
        "--preload on: the expert cache holds {slots} experts, the checkpoint has {experts} \
         routed experts (raise --cache-gb, or use --preload auto)"
    )]
    NotAll {
        /// Slots of the cache.
        slots: usize,
        /// Routed experts of the checkpoint.
        experts: usize,
    },
    /// `--preload hot` without an expert usage history.
    #[error("--preload hot reads the most used experts of the expert usage history: {what}")]
    NoHistory {
        /// Why there is none.
        what: &'static str,
    },
}

/// What an [`ExpertSlots::preload`] loaded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Preloaded {
    /// Experts now RESIDENT.
    pub experts: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Wall seconds of its reads.
    pub seconds: f64,
}

/// Options of the standalone cache.
#[derive(Clone, Debug)]
pub struct CacheOptions {
    /// Slots (whole experts).
    pub slots: usize,
    /// Parallel readers per batch.
    pub io_threads: usize,
    /// How long a batch waits for leased slots to be released before giving up.
    pub busy_timeout: Duration,
}

/// Counters of the standalone cache.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheStats {
    /// Table counters.
    pub table: TableCounters,
    /// Bytes read.
    pub bytes_read: u64,
    /// Wall seconds of the read phases.
    pub read_seconds: f64,
    /// Seconds callers were blocked in `get` on batches that missed.
    pub wait_seconds: f64,
    /// Slots in use.
    pub slots_used: usize,
    /// Bytes read by prefetches (included in `bytes_read`).
    pub prefetch_bytes: u64,
    /// Experts prefetches loaded, reads done ([`Locked::prefetch_loads`]): the count that
    /// goes with `prefetch_bytes`.
    pub prefetch_loads: u64,
    /// Bytes the preload read at start-up (not in `bytes_read`).
    pub preload_bytes: u64,
    /// Wall seconds of the preload's reads (not in `read_seconds`).
    pub preload_seconds: f64,
}

/// The standalone cache's slots; the lock's own state is the seconds callers waited.
type Slots = ExpertSlots<f64>;

/// One lease on one slot, held by the regions handed out for it: the expert is the slot's
/// bytes `[at, at + len)`.
struct ExpertLease {
    slots: Arc<Slots>,
    slot: usize,
    at: usize,
    len: usize,
    /// The slot's bytes; `None` only while dropping (the guard goes before the lease).
    bytes: Option<ArenaRead>,
}

impl ExpertLease {
    /// The region of a lease on `slot` (RESIDENT, just leased by the caller), which the region
    /// releases when it goes. On `Err` (the arena refuses the slot's bytes: a bug of the slot
    /// protocol) the caller still holds the lease and releases it.
    fn region(
        slots: &Arc<Slots>,
        slot: usize,
        at: usize,
        len: usize,
    ) -> Result<Region, SlotProblem> {
        let bytes = slots.arena().slot(slot)?;
        if at + len > bytes.len() {
            return Err(SlotProblem::Overrun {
                slot,
                at,
                len,
                stride: bytes.len(),
            });
        }
        Ok(Region::whole(Arc::new(ExpertLease {
            slots: slots.clone(),
            slot,
            at,
            len,
            bytes: Some(bytes),
        })))
    }
}

impl ByteOwner for ExpertLease {
    fn bytes(&self) -> &[u8] {
        self.bytes
            .as_deref()
            .map_or(&[], |b| &b[self.at..self.at + self.len])
    }
}

impl Drop for ExpertLease {
    fn drop(&mut self) {
        // The arena guard first: once the lease is released the slot may be written.
        drop(self.bytes.take());
        self.slots.lock().table.release(self.slot);
        self.slots.notify();
    }
}

/// The in-process routed-expert cache (standalone mode).
pub struct ExpertCache {
    slots: Arc<Slots>,
    opts: CacheOptions,
    fail: Option<FailHook>,
}

impl std::fmt::Debug for ExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExpertCache({} slots)", self.opts.slots)
    }
}

impl ExpertCache {
    /// A cache of `opts.slots` slots over the catalog's experts (LRU eviction). Allocates the
    /// slots up front (their pages are only committed when first written).
    pub fn new(
        catalog: Arc<Catalog>,
        files: Vec<Arc<DiskFile>>,
        opts: CacheOptions,
    ) -> Result<ExpertCache, SourceError> {
        let policy = Box::new(Lru::new(opts.slots));
        Self::with_policy(catalog, files, opts, policy)
    }

    /// Like [`ExpertCache::new`] with another eviction policy (sized for `opts.slots`).
    pub fn with_policy(
        catalog: Arc<Catalog>,
        files: Vec<Arc<DiskFile>>,
        opts: CacheOptions,
        policy: Box<dyn EvictionPolicy>,
    ) -> Result<ExpertCache, SourceError> {
        let stride = ExpertReader::slot_stride(&catalog.expert_layout());
        let arena = Arena::heap(stride, opts.slots).map_err(|e| SourceError::Cache(e.into()))?;
        let slots = ExpertSlots::new(
            catalog,
            files,
            arena,
            policy,
            opts.io_threads,
            opts.busy_timeout,
            0.0,
        )
        .map_err(|e| SourceError::Cache(e.into()))?;
        Ok(ExpertCache {
            slots: Arc::new(slots),
            opts,
            fail: None,
        })
    }

    /// Make reads of chosen experts fail (tests of the failure path).
    pub fn set_fail_hook(&mut self, hook: FailHook) {
        self.fail = Some(hook);
    }

    /// One line for the run report: slots, bytes, policy, read mode.
    pub fn describe(&self) -> String {
        let stride = self.slots.arena().stride() as u64;
        let policy = self.slots.lock().table.policy_name();
        format!(
            "expert cache: {} slots x {} ({}), {policy}, {}",
            self.opts.slots,
            crate::runtime::units::fmt_mb(stride),
            crate::runtime::units::fmt_bytes(stride * self.opts.slots as u64),
            if self.slots.reader().is_direct() {
                "O_DIRECT"
            } else {
                "buffered reads"
            }
        )
    }

    /// How many requests layer `l` has had: the `since` of a prefetch predicted now.
    pub fn demands(&self, l: usize) -> u64 {
        self.slots.demands(l)
    }

    /// Prefetch the predicted experts `ids` of layer `l` without leasing them
    /// ([`ExpertSlots::prefetch`]; `since` = [`ExpertCache::demands`] when they were predicted).
    pub fn prefetch(&self, l: usize, ids: &[u32], since: u64) -> Prefetched {
        self.slots
            .prefetch(l, ids, since, self.fail.as_ref(), &|_, _| {})
    }

    /// Read every routed expert into the cache now ([`ExpertSlots::preload`]), calling
    /// `progress(bytes done, bytes in all)`.
    pub fn preload(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<Preloaded, SourceError> {
        self.preload_set(&PreloadSet::Every, progress)
    }

    /// Read the experts of `set` into the cache now ([`ExpertSlots::preload`]).
    pub fn preload_set(
        &self,
        set: &PreloadSet,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Preloaded, SourceError> {
        (self.slots)
            .preload(set, self.fail.as_ref(), &|_, _| {}, progress)
            .map_err(SourceError::Preload)
    }

    /// Counters so far.
    pub fn stats(&self) -> CacheStats {
        let g = self.slots.lock();
        CacheStats {
            table: g.table.counters().clone(),
            bytes_read: g.bytes_read,
            read_seconds: g.read_seconds,
            wait_seconds: g.extra,
            slots_used: g.table.used(),
            prefetch_bytes: g.prefetch_bytes,
            prefetch_loads: g.prefetch_loads,
            preload_bytes: g.preload_bytes,
            preload_seconds: g.preload_seconds,
        }
    }

    /// The state of every slot (diagnostics and tests).
    pub fn slot_states(&self) -> Vec<(SlotState, u32)> {
        let g = self.slots.lock();
        (0..g.table.slots())
            .map(|s| (g.table.state(s), g.table.leases(s)))
            .collect()
    }

    /// Whether every expert of `ids` (layer `l`) is RESIDENT right now, so that [`get`] would
    /// read nothing (an answer that may be stale as soon as the lock is dropped: a caller that
    /// acts on it must stay correct when it is).
    ///
    /// [`get`]: ExpertCache::get
    pub fn all_resident(&self, l: usize, ids: &[u32]) -> bool {
        let g = self.slots.lock();
        ids.iter().all(|&e| {
            g.table
                .lookup(l as u32, e)
                .is_some_and(|s| matches!(g.table.state(s), SlotState::Resident { .. }))
        })
    }

    /// The experts of `ids` (layer `l`) that are RESIDENT now, leased like [`get`]'s; the others
    /// are `Err`. Never reads, waits, counts a request or changes the eviction order (the draft
    /// model's experts, [`crate::runtime::source::WeightSource::resident_experts`]).
    ///
    /// [`get`]: ExpertCache::get
    pub fn resident(&self, l: usize, ids: &[u32]) -> ExpertBatch {
        let len = self.slots.reader().expert_bytes();
        let mut g = self.slots.lock();
        let mut refused = false;
        let experts = ids
            .iter()
            .map(|&e| {
                match u32::try_from(l)
                    .ok()
                    .and_then(|l| g.table.lease_resident(l, e))
                {
                    Some(slot) => {
                        let at = self.slots.offset_in_slot(l, e);
                        ExpertLease::region(&self.slots, slot, at, len)
                            .inspect_err(|_| {
                                g.table.release(slot);
                                refused = true;
                            })
                            .map_err(ExpertError::from)
                    }
                    None => Err(ExpertError::NotResident {
                        layer: l,
                        expert: e,
                    }),
                }
            })
            .collect();
        drop(g);
        if refused {
            self.slots.notify();
        }
        ExpertBatch { experts }
    }

    /// Experts `ids` of layer `l`, in request order. Each `Ok` region is the expert in canonical
    /// layout and stays valid (its slot leased) while the region or a clone lives.
    pub fn get(&self, l: usize, ids: &[u32]) -> Result<ExpertBatch, SourceError> {
        let t0 = Instant::now();
        let (mut g, served) = self
            .slots
            .serve_batch(l, ids, None, self.fail.as_ref(), &|_, _| {})
            .map_err(|e| {
                SourceError::Invalid(match e {
                    BatchError::Invalid(m) => m,
                    BatchError::Busy(e) => format!(
                        "{e} after waiting {:.1} s (regions of earlier batches still alive?)",
                        self.opts.busy_timeout.as_secs_f64()
                    ),
                })
            })?;
        if served.outcomes.iter().any(|o| !o.hit) {
            g.extra += t0.elapsed().as_secs_f64();
        }
        drop(g);
        let len = self.slots.reader().expert_bytes();
        let answers: Vec<Result<Region, ExpertError>> = served
            .outcomes
            .iter()
            .map(|o| {
                let slot = o.slot.clone()?;
                // The lease's bytes are exactly the expert, so `whole` is the expert.
                ExpertLease::region(&self.slots, slot, o.at, len)
                    .inspect_err(|_| {
                        self.slots.lock().table.release(slot);
                        self.slots.notify();
                    })
                    .map_err(ExpertError::from)
            })
            .collect();
        Ok(ExpertBatch {
            experts: served.in_request_order(&answers),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::{self, Rng, Spec};
    use crate::runtime::trunk::open_shards;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn cache(w: &fixture::Written, slots: usize, timeout_ms: u64) -> ExpertCache {
        ExpertCache::new(
            Arc::new(w.catalog.clone()),
            open_shards(&w.catalog).unwrap(),
            CacheOptions {
                slots,
                io_threads: 3,
                busy_timeout: Duration::from_millis(timeout_ms),
            },
        )
        .unwrap()
    }

    fn spec() -> Spec {
        let mut s = Spec::small(4, 8);
        // Two experts are stored with their parts reversed: the six-read path.
        s.reversed_experts = vec![(1, 2), (3, 5)];
        s
    }

    fn check(spec: &Spec, l: usize, ids: &[u32], b: &ExpertBatch) {
        assert_eq!(b.experts.len(), ids.len());
        for (e, r) in ids.iter().zip(&b.experts) {
            let r = r.as_ref().unwrap();
            assert!(
                r.bytes() == &fixture::expert_bytes(spec, l, *e as usize)[..],
                "layer {l} expert {e}: wrong bytes (aliasing)"
            );
        }
    }

    fn random_ids(rng: &mut Rng, n: usize, k: usize) -> Vec<u32> {
        let mut v = Vec::new();
        while v.len() < k {
            let e = rng.below(n as u64) as u32;
            if !v.contains(&e) {
                v.push(e);
            }
        }
        v
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn reversed_expert_is_assembled_in_canonical_order() {
        let spec = spec();
        let w = fixture::write(&spec, "canon");
        assert!(w.catalog.expert(1, 2).unwrap().coalesced().is_none());
        assert!(w.catalog.expert(1, 1).unwrap().coalesced().is_some());
        let c = cache(&w, 4, 1000);
        let b = c.get(1, &[2, 1]).unwrap();
        check(&spec, 1, &[2, 1], &b);
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn random_streams_never_alias_with_capacity_below_working_set() {
        let spec = spec();
        let w = fixture::write(&spec, "alias");
        let c = cache(&w, 7, 2000);
        let mut rng = Rng(0x1234_5678_9abc);
        let mut prev: Option<(usize, Vec<u32>, ExpertBatch)> = None;
        let mut total = 0u64;
        for _ in 0..300 {
            let l = 1 + rng.below(3) as usize;
            let ids = random_ids(&mut rng, 8, 3);
            let b = c.get(l, &ids).unwrap();
            total += 3;
            check(&spec, l, &ids, &b);
            // Keep the previous batch alive half the time: its slots must not be reused.
            if let Some((pl, pids, p)) = prev.take() {
                check(&spec, pl, &pids, &p);
            }
            if rng.below(2) == 0 {
                prev = Some((l, ids, b));
            }
        }
        let s = c.stats();
        assert_eq!(s.table.requests, total);
        assert_eq!(s.table.resident_hits + s.table.misses, total);
        assert!(s.table.resident_hits > 0 && s.table.evictions > 0, "{s:?}");
        assert_eq!(
            s.bytes_read,
            s.table.misses * spec.layout.expert_bytes() as u64
        );
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn held_regions_keep_their_bytes_while_later_batches_evict() {
        let spec = spec();
        let w = fixture::write(&spec, "held");
        let c = cache(&w, 6, 2000);
        let mut rng = Rng(99);
        let held_ids = [0u32, 2, 5];
        let held = c.get(1, &held_ids).unwrap();
        for _ in 0..100 {
            let l = 2 + rng.below(2) as usize;
            let ids = random_ids(&mut rng, 8, 3);
            let b = c.get(l, &ids).unwrap();
            check(&spec, l, &ids, &b);
            check(&spec, 1, &held_ids, &held);
        }
        assert!(c.stats().table.evictions > 50);
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn two_threads_concurrent_batches() {
        let spec = spec();
        let w = fixture::write(&spec, "threads");
        let c = cache(&w, 8, 5000);
        std::thread::scope(|s| {
            for t in 0..2u64 {
                let (c, spec) = (&c, &spec);
                s.spawn(move || {
                    let mut rng = Rng(17 + t * 1000);
                    for _ in 0..200 {
                        let l = 1 + rng.below(3) as usize;
                        let ids = random_ids(&mut rng, 8, 3);
                        let b = c.get(l, &ids).unwrap();
                        check(spec, l, &ids, &b);
                    }
                });
            }
        });
        let s = c.stats();
        assert_eq!(s.table.requests, 1200);
        assert_eq!(s.table.failed_loads, 0);
        // Every lease was released.
        assert!(c.slot_states().iter().all(|(_, leases)| *leases == 0));
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn inflight_expert_is_read_once_and_waited_for() {
        let spec = spec();
        let w = fixture::write(&spec, "inflight");
        let mut c = cache(&w, 4, 5000);
        c.set_fail_hook(Box::new(|l, e| {
            if (l, e) == (2, 4) {
                std::thread::sleep(Duration::from_millis(300));
            }
            None
        }));
        let (a, b) = std::thread::scope(|s| {
            let ha = s.spawn(|| c.get(2, &[4]).unwrap());
            std::thread::sleep(Duration::from_millis(100));
            let hb = s.spawn(|| c.get(2, &[4, 1]).unwrap());
            (ha.join().unwrap(), hb.join().unwrap())
        });
        check(&spec, 2, &[4], &a);
        check(&spec, 2, &[4, 1], &b);
        let s = c.stats();
        assert_eq!(s.table.requests, 3);
        assert_eq!(s.table.resident_hits, 0);
        assert_eq!(s.table.misses, 3);
        // Expert 4 was read once (by the first request), expert 1 once.
        assert_eq!(s.bytes_read, 2 * spec.layout.expert_bytes() as u64);
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn all_resident_is_true_only_when_every_expert_is_resident() {
        let spec = spec();
        let w = fixture::write(&spec, "allres");
        let mut c = cache(&w, 3, 5000);
        // Expert 6 of layer 1 is held INFLIGHT for a while by a slow read.
        c.set_fail_hook(Box::new(|l, e| {
            if (l, e) == (1, 6) {
                std::thread::sleep(Duration::from_millis(400));
            }
            None
        }));
        assert!(!c.all_resident(2, &[0, 3]), "empty cache");
        let b = c.get(2, &[0, 3]).unwrap();
        assert!(c.all_resident(2, &[0, 3]) && c.all_resident(2, &[3]));
        assert!(c.all_resident(2, &[]));
        assert!(!c.all_resident(2, &[0, 3, 5]), "5 was never read");
        assert!(!c.all_resident(1, &[0]), "same expert id, other layer");
        drop(b);
        std::thread::scope(|s| {
            let h = s.spawn(|| c.get(1, &[6]).unwrap());
            std::thread::sleep(Duration::from_millis(100));
            assert!(!c.all_resident(1, &[6]), "INFLIGHT is not resident");
            check(&spec, 1, &[6], &h.join().unwrap());
        });
        assert!(c.all_resident(1, &[6]));
        // Two more experts evict the two least recently used: layer 2's (LRU, 3 slots).
        drop(c.get(3, &[1, 2]).unwrap());
        assert!(!c.all_resident(2, &[0, 3]), "evicted");
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn failed_read_is_reported_and_not_published() {
        let spec = spec();
        let w = fixture::write(&spec, "fail");
        let mut c = cache(&w, 5, 1000);
        let failing = Arc::new(AtomicBool::new(true));
        let f2 = failing.clone();
        c.set_fail_hook(Box::new(move |l, e| {
            ((l, e) == (1, 3) && f2.load(Ordering::SeqCst)).then(|| "injected EIO".to_string())
        }));
        let b = c.get(1, &[2, 3, 4]).unwrap();
        assert!(b.experts[0].is_ok() && b.experts[2].is_ok());
        let m = b.experts[1].as_ref().unwrap_err().to_string();
        assert!(
            m.contains("layer 1 expert 3") && m.contains("injected"),
            "{m}"
        );
        assert_eq!(c.stats().table.failed_loads, 1);
        assert!(c.slot_states().iter().all(|(s, _)| *s
            != SlotState::Resident {
                layer: 1,
                expert: 3
            }));
        drop(b);
        // Not papered over: a retry reads again (and succeeds once the disk behaves).
        failing.store(false, Ordering::SeqCst);
        let b = c.get(1, &[3]).unwrap();
        check(&spec, 1, &[3], &b);
        let s = c.stats();
        assert_eq!(s.table.resident_hits, 0);
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn truncated_shard_fails_only_the_experts_past_the_end() {
        let mut spec = spec();
        spec.n_shards = 1;
        let w = fixture::write(&spec, "trunc");
        let c = cache(&w, 8, 1000);
        // Cut the shard in the middle of layer 3's expert 6 (after indexing).
        let cut = w.catalog.expert(3, 6).unwrap().parts[2].off;
        let path = &w.catalog.shard_paths()[0];
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let b = c.get(3, &[0, 6, 7]).unwrap();
        check(
            &spec,
            3,
            &[0],
            &ExpertBatch {
                experts: vec![b.experts[0].clone()],
            },
        );
        for r in &b.experts[1..] {
            let m = r.as_ref().unwrap_err().to_string();
            assert!(m.contains("model-00001-of-000001.safetensors"), "{m}");
        }
        assert_eq!(c.stats().table.failed_loads, 2);
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn eviction_never_touches_leased_slots_and_too_small_is_refused() {
        let spec = spec();
        let w = fixture::write(&spec, "leased");
        let c = cache(&w, 3, 150);
        let held = c.get(1, &[0, 1, 2]).unwrap();
        let e = c.get(1, &[3]).unwrap_err().to_string();
        assert!(e.contains("busy"), "{e}");
        check(&spec, 1, &[0, 1, 2], &held);
        let e = c.get(2, &[0, 1, 2, 3]).unwrap_err().to_string();
        assert!(
            e.contains("expert cache too small: 3 slots, batch needs 4"),
            "{e}"
        );
        // Release expert 1 only: the next miss must take exactly its slot.
        let ExpertBatch { mut experts } = held;
        let one = experts.remove(1);
        drop(one);
        let b = c.get(1, &[3]).unwrap();
        check(&spec, 1, &[3], &b);
        let states: Vec<SlotState> = c.slot_states().into_iter().map(|(s, _)| s).collect();
        for x in [0, 2, 3] {
            assert!(states.contains(&SlotState::Resident {
                layer: 1,
                expert: x
            }));
        }
        assert!(!states.contains(&SlotState::Resident {
            layer: 1,
            expert: 1
        }));
        check(&spec, 1, &[0, 2], &ExpertBatch { experts });
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn duplicate_ids_share_one_slot() {
        let spec = spec();
        let w = fixture::write(&spec, "dup");
        let c = cache(&w, 2, 100);
        let b = c.get(1, &[5, 5, 6]).unwrap();
        check(&spec, 1, &[5, 5, 6], &b);
        assert!(c.get(1, &[9]).is_err());
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn heap_and_borrowed_arenas_serve_the_same_stream() {
        // The standalone cache (heap arena, leases held by regions) and the daemon's way of
        // calling the same routine (borrowed memory, leases held per holder, slot-table mirror)
        // must give the same bytes, the same hits and failures, and the same slot choices.
        let spec = spec();
        let w = fixture::write(&spec, "twomem");
        let fails = |l: u32, e: u32| ((l, e) == (2, 3)).then(|| "injected EIO".to_string());
        let mut c = cache(&w, 5, 1000);
        c.set_fail_hook(Box::new(fails));
        let fail: FailHook = Box::new(fails);
        let stride = ExpertReader::slot_stride(&spec.layout);
        let mut mem = crate::runtime::io::AlignedBuf::zeroed(6 * stride).unwrap();
        // SAFETY: `mem` outlives `d` (declared before it) and is not touched again.
        let arena = unsafe { Arena::over(&mut mem.as_mut_slice()[stride..], stride, 5) }.unwrap();
        let d = ExpertSlots::new(
            Arc::new(w.catalog.clone()),
            open_shards(&w.catalog).unwrap(),
            arena,
            Box::new(Lru::new(5)),
            3,
            Duration::from_millis(1000),
            (),
        )
        .unwrap();
        let mirrored = Mutex::new(HashMap::new());
        let mirror = |t: &SlotTable, s: usize| {
            mirrored
                .lock()
                .unwrap()
                .insert(s, (t.state(s), t.leases(s)));
        };
        let mut rng = Rng(0x5eed);
        let (mut hits, mut failures) = (0, 0);
        // The experts' offsets in their slots: the fixture puts them off page boundaries.
        let mut offsets = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let l = 1 + rng.below(3) as usize;
            let mut ids = random_ids(&mut rng, 8, 3);
            ids.push(ids[0]);
            let before = c.stats().table.resident_hits;
            let a = c.get(l, &ids).unwrap();
            let (g, served) = d
                .serve_batch(l, &ids, Some(7), Some(&fail), &mirror)
                .unwrap();
            let (ta, tb) = (c.slot_states(), g.table.counters().clone());
            let states_b: Vec<SlotState> = (0..5).map(|s| g.table.state(s)).collect();
            drop(g);
            let batch_hits = served.outcomes.iter().filter(|o| o.hit).count() as u64;
            assert_eq!(c.stats().table.resident_hits - before, batch_hits);
            assert_eq!(c.stats().table, tb);
            assert_eq!(ta.iter().map(|x| x.0).collect::<Vec<_>>(), states_b);
            let b = served.in_request_order(&served.outcomes);
            for ((e, x), y) in ids.iter().zip(&a.experts).zip(&b) {
                match (x, &y.slot) {
                    (Ok(x), Ok(s)) => {
                        // Holder 7 keeps its lease on `s` until its next batch.
                        let got = d.arena().slot(*s).unwrap();
                        let want = fixture::expert_bytes(&spec, l, *e as usize);
                        assert!(x.bytes() == &want[..] && got[y.at..y.at + want.len()] == want[..]);
                        offsets.insert(y.at);
                        let m = mirrored.lock().unwrap()[s];
                        assert_eq!(
                            m.0,
                            SlotState::Resident {
                                layer: l as u32,
                                expert: *e
                            }
                        );
                    }
                    (Err(x), Err(y)) => {
                        assert_eq!(x, y);
                        assert!(x.to_string().contains("injected EIO"), "{x}");
                        failures += 1;
                    }
                    (x, y) => panic!("layer {l} expert {e}: {x:?} vs {y:?}"),
                }
            }
            hits += batch_hits;
        }
        assert!(hits > 0 && failures > 0, "{hits} hits, {failures} failures");
        assert!(c.stats().table.evictions > 0);
        assert!(offsets.len() > 1, "every expert at offset {offsets:?}");
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    /// A prefetch reads its predictions in the given order, one per reader thread at a time.
    /// Once a request for its layer has come since the prediction (while it reads, or before it
    /// started), it still reads into EMPTY slots but no longer evicts: a prediction that would
    /// is dropped (counted, not reserved, never read).
    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn a_prefetch_reads_the_likeliest_first_and_stops_evicting_once_its_layer_is_requested() {
        use std::sync::mpsc;
        let spec = Spec::small(3, 12);
        let w = fixture::write(&spec, "prefetch-stop");
        let predicted = [9u32, 2, 7, 0];
        // A prefetch of layer 1 into `slots` slots, the first four holding RESIDENT experts of
        // layer 2 (unleased), with a request of `layer` served while its first pair of reads is
        // being prepared (none: no request; `early`: after the prediction, before the prefetch
        // starts). Returns (loads, counters' loads, dropped, which predictions are in the
        // cache).
        let run = |slots: usize, layer: Option<usize>, early: bool| {
            let stride = ExpertReader::slot_stride(&spec.layout);
            let d = ExpertSlots::new(
                Arc::new(w.catalog.clone()),
                open_shards(&w.catalog).unwrap(),
                Arena::heap(stride, slots).unwrap(),
                Box::new(Lru::new(slots)),
                2,
                Duration::from_millis(1000),
                (),
            )
            .unwrap();
            let (mut g, served) = d
                .serve_batch(2, &[0, 1, 2, 3], None, None, &|_, _| {})
                .unwrap();
            for o in &served.outcomes {
                g.table.release(o.slot.clone().unwrap());
            }
            drop(g);
            // An expert no prediction named.
            let request = |l| {
                let (mut g, served) = d.serve_batch(l, &[4], None, None, &|_, _| {}).unwrap();
                g.table.release(served.outcomes[0].slot.clone().unwrap());
            };
            let since = d.demands(1);
            let (started, wait_started) = mpsc::channel::<()>();
            let (go, wait_go) = mpsc::channel::<()>();
            let (started, wait_go) = (Mutex::new(started), Mutex::new(wait_go));
            let hook: FailHook = Box::new(move |_, _| {
                if started.lock().unwrap().send(()).is_ok() {
                    let _ = wait_go.lock().unwrap().recv();
                }
                None
            });
            let done = if early {
                layer.into_iter().for_each(request);
                d.prefetch(1, &predicted, since, None, &|_, _| {})
            } else {
                std::thread::scope(|s| {
                    let t = s.spawn(|| d.prefetch(1, &predicted, since, Some(&hook), &|_, _| {}));
                    wait_started.recv().unwrap();
                    drop(wait_started);
                    layer.into_iter().for_each(request);
                    go.send(()).unwrap();
                    t.join().unwrap()
                })
            };
            let g = d.lock();
            let c = g.table.counters().clone();
            let read: Vec<bool> = (predicted.iter())
                .map(|&e| {
                    (g.table.lookup(1, e)).is_some_and(|s| g.table.state(s) != SlotState::Empty)
                })
                .collect();
            (done.loads, c.prefetch_loads, c.prefetch_dropped, read)
        };
        // No request, one of another layer, or the layer's own with EMPTY slots left: every
        // prediction is read (evicting layer 2's experts where it must, in the first two).
        for early in [false, true] {
            for (slots, layer) in [(4, None), (4, Some(2)), (9, Some(1))] {
                let got = run(slots, layer, early);
                let what = format!("{slots} slots, request of {layer:?}, early {early}");
                assert_eq!(got, (4, 4, 0, vec![true; 4]), "{what}");
            }
        }
        // The layer's own request, with every slot taken: the first pair (the two likeliest)
        // was read; the other two would have evicted, and were dropped.
        assert_eq!(
            run(4, Some(1), false),
            (2, 2, 2, vec![true, true, false, false])
        );
        // The request came before the prefetch started: nothing was evicted for it.
        assert_eq!(run(4, Some(1), true), (0, 0, 4, vec![false; 4]));
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    /// The slot views of a heap and of a borrowed arena: each slot is its own `stride` bytes,
    /// writing one through `slot_mut` shows in `slot` of that slot only, the borrowed arena
    /// stays inside the memory it was given, and a too-small memory is refused. No I/O, so it
    /// also runs under Miri (scripts/miri.sh), which checks the raw-pointer views.
    #[test]
    fn slot_views_are_disjoint_and_inside_the_arena() {
        let (stride, slots, skip) = (64usize, 3usize, 5usize);
        let heap = Arena::heap(stride, slots).unwrap();
        let mut mem = vec![0xeeu8; skip + stride * slots + skip];
        // SAFETY: `mem` outlives `over` (dropped below) and is not touched while it is used.
        let over = unsafe { Arena::over(&mut mem[skip..], stride, slots) }.unwrap();
        for a in [&heap, &over] {
            assert_eq!((a.stride(), a.slots()), (stride, slots));
            for s in 0..slots {
                a.slot_mut(s).unwrap().fill(s as u8 + 1);
            }
            for s in 0..slots {
                let v = a.slot(s).unwrap();
                assert_eq!(v.len(), stride);
                assert!(v.iter().all(|&b| b == s as u8 + 1), "slot {s}");
                // A slot being read is not written, its neighbours are.
                assert!(a.slot_mut(s).is_err());
                assert!(a.slot_mut((s + 1) % slots).is_ok());
            }
            assert!(a.slot(slots).is_err() && a.slot_mut(slots).is_err());
        }
        drop(over);
        assert!(mem[..skip].iter().all(|&b| b == 0xee));
        assert!(mem[skip + stride * slots..].iter().all(|&b| b == 0xee));
        for (s, chunk) in mem[skip..skip + stride * slots].chunks(stride).enumerate() {
            assert!(
                chunk.iter().all(|&b| b == s as u8 + 1),
                "slot {s} in borrowed memory"
            );
        }
        let mut small = [0u8; 2 * 8 - 1];
        // SAFETY: refused, so no arena over `small` exists.
        assert!(unsafe { Arena::over(&mut small, 8, 2) }.is_err());
        assert!(Arena::heap(usize::MAX, 2).is_err());
    }

    #[test]
    fn table_lru_order_and_explicit_holders() {
        let mut t = SlotTable::new(2, Box::new(Lru::new(2)));
        let r = t.reserve(7, &[10, 11]).unwrap();
        for x in &r {
            t.publish(x.slot(), Ok(()));
        }
        t.hold(1, 7, r.iter().map(|x| x.slot()).collect());
        assert_eq!(
            t.reserve(7, &[12]),
            Err(ReserveError::Busy {
                needed: 1,
                available: 0
            })
        );
        t.release_layer(1, 7);
        // Hit 10, so 11 is least recently used.
        let h = t.reserve(7, &[10]).unwrap();
        assert!(matches!(h[0], Reserved::Hit { .. }));
        t.hold(2, 7, vec![h[0].slot()]);
        let m = t.reserve(7, &[12]).unwrap();
        assert_eq!(
            m[0],
            Reserved::Load {
                slot: r[1].slot(),
                evicted: Some((7, 11))
            }
        );
        // While INFLIGHT, another request waits for it and cannot evict it.
        let w = t.reserve(7, &[12]).unwrap();
        assert_eq!(w[0], Reserved::Wait { slot: r[1].slot() });
        assert_eq!(
            t.reserve(7, &[13]),
            Err(ReserveError::Busy {
                needed: 1,
                available: 0
            })
        );
        t.publish(m[0].slot(), Ok(()));
        t.release(m[0].slot());
        t.release(w[0].slot());
        t.release_holder(2);
        assert!((0..2).all(|s| t.leases(s) == 0));
        let c = t.counters();
        assert_eq!(
            (c.requests, c.resident_hits, c.misses, c.evictions),
            (5, 1, 4, 1)
        );
        assert_eq!(
            t.reserve(7, &[1, 2, 3]),
            Err(ReserveError::TooSmall {
                slots: 2,
                needed: 3
            })
        );
        // A repeated missing id: one load, the repeat waits on the same slot.
        let mut t = SlotTable::new(1, Box::new(Lru::new(1)));
        let r = t.reserve(0, &[4, 4]).unwrap();
        assert_eq!(
            r[0],
            Reserved::Load {
                slot: 0,
                evicted: None
            }
        );
        assert_eq!(r[1], Reserved::Wait { slot: 0 });
        assert_eq!(t.leases(0), 2);
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn preload_reads_every_expert_into_empty_slots_and_every_request_then_hits() {
        let spec = spec();
        let w = fixture::write(&spec, "preload");
        // Layer 0 is dense: layers 1–3 hold 8 experts each.
        let routed = w.catalog.routed_experts().count();
        assert_eq!(routed, 3 * 8);
        let c = cache(&w, routed + 2, 2000);
        let mut calls = Vec::new();
        let p = c.preload(&mut |d, t| calls.push((d, t))).unwrap();
        let eb = spec.layout.expert_bytes() as u64;
        assert_eq!((p.experts, p.bytes), (routed as u64, routed as u64 * eb));
        assert_eq!(calls.first(), Some(&(0, p.bytes)));
        assert_eq!(calls.last(), Some(&(p.bytes, p.bytes)));
        let s = c.stats();
        assert_eq!(s.table.preloaded, routed as u64);
        assert_eq!((s.preload_bytes, s.slots_used), (p.bytes, routed));
        // Start-up reads are neither requests, nor request reads, nor predictions.
        let t = &s.table;
        assert_eq!(
            (s.bytes_read, t.requests, t.prefetch_loads, t.evictions),
            (0, 0, 0, 0)
        );
        let ids: Vec<u32> = (0..8).collect();
        for l in 1..4 {
            // Every expert's bytes, the two stored in reverse part order included.
            check(&spec, l, &ids, &c.get(l, &ids).unwrap());
        }
        let s = c.stats();
        assert_eq!(s.table.requests, 24);
        assert_eq!(s.table.resident_hits, 24, "TRUE hits: {s:?}");
        assert_eq!(s.table.preload_hits, 24, "every hit is the preload's");
        assert_eq!((s.bytes_read, s.table.prefetch_used), (0, 0));
        // Nothing is left to preload: a second one reads nothing.
        assert_eq!(c.preload(&mut |_, _| {}).unwrap(), Preloaded::default());
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn preload_stops_when_the_slots_run_out_and_never_evicts() {
        let spec = spec();
        let w = fixture::write(&spec, "preload-few");
        let c = cache(&w, 5, 2000);
        let p = c.preload(&mut |_, _| {}).unwrap();
        assert_eq!(p.experts, 5);
        let s = c.stats();
        assert_eq!((s.table.evictions, s.slots_used), (0, 5));
        // In layer order: the first five experts of layer 1.
        assert!(c.all_resident(1, &[0, 1, 2, 3, 4]));
        assert!(!c.all_resident(1, &[5]) && !c.all_resident(2, &[0]));
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn a_listed_preload_reads_the_first_that_fit_and_counts_their_hits_until_evicted() {
        let spec = spec();
        let w = fixture::write(&spec, "preload-list");
        let c = cache(&w, 3, 2000);
        // Most wanted first; one the checkpoint lacks (layer 0 is dense) and a repeat are
        // skipped; the fourth that exists does not fit.
        let set = PreloadSet::These(vec![(3, 5), (0, 1), (2, 6), (3, 5), (1, 1), (2, 0)]);
        let mut calls = Vec::new();
        let p = c.preload_set(&set, &mut |d, t| calls.push((d, t))).unwrap();
        let eb = spec.layout.expert_bytes() as u64;
        assert_eq!((p.experts, p.bytes), (3, 3 * eb));
        assert_eq!(calls.last(), Some(&(3 * eb, 3 * eb)));
        assert!(c.all_resident(3, &[5]) && c.all_resident(2, &[6]) && c.all_resident(1, &[1]));
        assert!(!c.all_resident(2, &[0]), "never more than the cache holds");
        let s = c.stats();
        assert_eq!(
            (s.table.preloaded, s.slots_used, s.table.evictions),
            (3, 3, 0)
        );
        // Hits on preloaded slots are the preload's; a miss evicts one, which no longer counts.
        check(&spec, 3, &[5], &c.get(3, &[5]).unwrap());
        check(&spec, 2, &[6], &c.get(2, &[6]).unwrap());
        let t = c.stats().table;
        assert_eq!((t.resident_hits, t.preload_hits), (2, 2));
        // A batch of three others takes every slot: the preloaded experts are evicted, and a
        // hit on one read again is not the preload's.
        drop(c.get(1, &[0, 2, 3]).unwrap());
        assert_eq!(c.stats().table.evictions, 3);
        drop(c.get(3, &[5]).unwrap());
        drop(c.get(3, &[5]).unwrap());
        let t = c.stats().table;
        assert_eq!((t.resident_hits, t.preload_hits), (3, 2), "{t:?}");
        assert_eq!(
            c.preload_set(&PreloadSet::Nothing, &mut |_, _| {})
                .unwrap()
                .experts,
            0
        );
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)] // writes and reads shard files (O_DIRECT)
    fn a_failed_preload_read_fails_the_preload_and_names_the_expert() {
        let spec = spec();
        let w = fixture::write(&spec, "preload-fail");
        let mut c = cache(&w, 30, 2000);
        c.set_fail_hook(Box::new(|l, e| {
            ((l, e) == (2, 4)).then(|| "EIO".to_string())
        }));
        let e = c.preload(&mut |_, _| {}).unwrap_err().to_string();
        assert!(e.contains("layer 2 expert 4") && e.contains("EIO"), "{e}");
        // Its batch's other experts arrived; the failed one stays out of the cache.
        assert!(c.all_resident(1, &(0..8).collect::<Vec<_>>()));
        assert!(c.all_resident(2, &[3, 5]) && !c.all_resident(2, &[4]));
        let s = c.stats();
        assert_eq!(s.table.failed_loads, 1);
        assert!(c
            .slot_states()
            .iter()
            .all(|(st, _)| !matches!(st, SlotState::Inflight { .. })));
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    fn prefetch_takes_only_slots_no_lease_or_request_needs_and_counts_use() {
        let mut t = SlotTable::new(4, Box::new(Lru::new(4)));
        // Layer 0's request holds slots for experts 0 and 1.
        let r = t.reserve(0, &[0, 1]).unwrap();
        for x in &r {
            t.publish(x.slot(), Ok(()));
        }
        let held: Vec<usize> = r.iter().map(|x| x.slot()).collect();
        // Layer 1 predicted 5, 6, 7 (and 5 again): two free slots, nothing else may be taken
        // (the other two are leased), so 7 is declined.
        let p = t.reserve_prefetch(1, &[5, 6, 7, 5], false);
        assert_eq!(p.iter().map(|x| x.1).collect::<Vec<_>>(), vec![5, 6]);
        assert!(
            p.iter().all(|x| !held.contains(&x.0)),
            "{p:?} took a leased slot"
        );
        assert_eq!(t.counters().prefetch_loads, 2);
        assert_eq!(t.counters().prefetch_declined, 1);
        for &(s, e) in &p {
            assert_eq!(
                t.state(s),
                SlotState::Inflight {
                    layer: 1,
                    expert: e
                }
            );
            assert_eq!(t.leases(s), 0, "a prefetch leases nothing");
        }
        // A prediction already INFLIGHT or RESIDENT is not read twice.
        assert!(t.reserve_prefetch(1, &[5, 6], false).is_empty());
        // A request arriving while the prefetch reads waits for it instead of reading again.
        let w = t.reserve(1, &[6]).unwrap();
        assert_eq!(w, vec![Reserved::Wait { slot: p[1].0 }]);
        for &(s, _) in &p {
            t.publish(s, Ok(()));
        }
        t.release(p[1].0);
        for &s in &held {
            t.release(s);
        }
        // Layer 1 asks for 5 (prefetched: a hit, used) and 9 (a miss that evicts the least
        // recently used slot, not a prefetched one that is waiting for use).
        let r = t.reserve(1, &[5, 9]).unwrap();
        assert_eq!(r[0], Reserved::Hit { slot: p[0].0 });
        assert!(
            matches!(
                r[1],
                Reserved::Load {
                    evicted: Some((0, _)),
                    ..
                }
            ),
            "{r:?}"
        );
        assert_eq!(
            t.counters().prefetch_used,
            2,
            "6 (waited for) and 5 (hit) were used"
        );
        // A failed prefetch is no failed load.
        for x in &r {
            t.publish(x.slot(), Ok(()));
            t.release(x.slot());
        }
        let q = t.reserve_prefetch(2, &[3], false);
        assert_eq!(q.len(), 1);
        t.publish(q[0].0, Err(ExpertError::Store("EIO".into())));
        assert_eq!(t.counters().failed_loads, 0);
        assert_eq!(t.lookup(2, 3), None);
    }

    #[test]
    fn prefetch_never_evicts_what_is_reused_more_often_than_predictions_are_right() {
        let mut t = SlotTable::new(2, Box::new(Lru::new(2)));
        let r = t.reserve(0, &[0, 1]).unwrap();
        for x in &r {
            t.publish(x.slot(), Ok(()));
            t.release(x.slot());
        }
        // Layer 0's experts are hit again and again: the cache's reuse rate is high (8 of 10).
        for _ in 0..4 {
            for x in t.reserve(0, &[0, 1]).unwrap() {
                assert!(matches!(x, Reserved::Hit { .. }));
                t.release(x.slot());
            }
        }
        // No free slot and a prediction is (so far) a coin toss: nothing is evicted.
        assert!(t.reserve_prefetch(1, &[4], false).is_empty());
        assert_eq!(t.counters().prefetch_declined, 1);
        assert_eq!(t.counters().evictions, 0);
        assert!(t.lookup(0, 0).is_some() && t.lookup(0, 1).is_some());
        // A cache that never hits: predictions (unproven, 1/2) beat its reuse (0), so the
        // least recently used unleased expert makes room.
        let mut t = SlotTable::new(2, Box::new(Lru::new(2)));
        for (l, e) in [(0, 0), (1, 1)] {
            let r = t.reserve(l, &[e]).unwrap();
            t.publish(r[0].slot(), Ok(()));
            t.release(r[0].slot());
        }
        let p = t.reserve_prefetch(2, &[7], false);
        assert_eq!(p.len(), 1);
        assert_eq!(t.lookup(0, 0), None, "the LRU expert (layer 0) was evicted");
        assert_eq!(t.counters().evictions, 1);
    }
}
