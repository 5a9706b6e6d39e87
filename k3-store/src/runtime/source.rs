//! The one seam between the engine's maths and weight storage.
//!
//! The engine asks a [`WeightSource`] for bytes and never learns whether they came from a
//! resident buffer, a pinned layer, the streaming ring, or the store daemon's shared memory. Every
//! byte range it receives is a [`Region`]: the bytes behind it do not change while the region (or
//! a clone of it) is alive, which is what makes ring reuse and expert leases safe — ring space or
//! an expert slot is only refilled once no region points into it.

use std::sync::Arc;

use k3_proto::Dtype;

use crate::runtime::io::{AlignedBuf, MappedRange};

/// Something that owns bytes that stay put while it is alive.
pub trait ByteOwner: Send + Sync {
    /// The owned bytes.
    fn bytes(&self) -> &[u8];
}

impl ByteOwner for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl ByteOwner for AlignedBuf {
    fn bytes(&self) -> &[u8] {
        self.as_slice()
    }
}

impl ByteOwner for MappedRange {
    fn bytes(&self) -> &[u8] {
        self.as_slice()
    }
}

/// A window onto an owner's bytes. Cheap to clone; keeps the owner alive.
#[derive(Clone)]
pub struct Region {
    owner: Arc<dyn ByteOwner>,
    off: usize,
    len: usize,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Region({}..+{})", self.off, self.len)
    }
}

impl Region {
    /// The whole of `owner`.
    pub fn whole(owner: Arc<dyn ByteOwner>) -> Region {
        let len = owner.bytes().len();
        Region { owner, off: 0, len }
    }

    /// `len` bytes of `owner` from `off`; `None` if that window is out of bounds.
    pub fn new(owner: Arc<dyn ByteOwner>, off: usize, len: usize) -> Option<Region> {
        let end = off.checked_add(len)?;
        (end <= owner.bytes().len()).then_some(Region { owner, off, len })
    }

    /// A sub-window of this region; `None` if out of bounds.
    pub fn sub(&self, off: usize, len: usize) -> Option<Region> {
        let end = off.checked_add(len)?;
        (end <= self.len).then(|| Region {
            owner: self.owner.clone(),
            off: self.off + off,
            len,
        })
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.owner.bytes()[self.off..self.off + self.len]
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// How a trunk tensor's bytes are stored in its layer run (SPEC.md §6.1, §6.13).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum Storage {
    /// As in the checkpoint.
    #[default]
    #[serde(rename = "raw")]
    Raw,
    /// A BF16 matrix coded as EC-BF16 (`k3_proto::ecbf16`): the header carries its shape.
    #[serde(rename = "ecbf16")]
    EcBf16,
    /// A BF16 matrix quantized to int8, a scale per row (`k3_proto::quant::QuantMatrix`):
    /// lossy.
    #[serde(rename = "int8")]
    Int8,
    /// A BF16 matrix quantized to int4, a scale per 32 columns (`k3_proto::quant::QuantMatrix`):
    /// lossy.
    #[serde(rename = "int4")]
    Int4,
}

impl Storage {
    /// The name `trunk.json` and the command line use.
    pub const fn name(self) -> &'static str {
        match self {
            Storage::Raw => "raw",
            Storage::EcBf16 => "ecbf16",
            Storage::Int8 => "int8",
            Storage::Int4 => "int4",
        }
    }

    /// The quantization of a lossy storage (`None` for raw and EC-BF16, which hold the
    /// checkpoint's numbers exactly).
    pub const fn quant(self) -> Option<k3_proto::quant::QuantKind> {
        match self {
            Storage::Int8 => Some(k3_proto::quant::QuantKind::Int8),
            Storage::Int4 => Some(k3_proto::quant::QuantKind::Int4),
            Storage::Raw | Storage::EcBf16 => None,
        }
    }
}

/// Where one tensor sits inside a layer run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLoc {
    /// Full checkpoint name (`language_model.model.layers.N.…`).
    pub name: String,
    /// Byte offset inside the layer run.
    pub off: u64,
    /// Byte length in the run (the coded length when `storage` is not raw).
    pub nbytes: u64,
    /// Element type (of the checkpoint's tensor: `BF16` for a coded matrix).
    pub dtype: Dtype,
    /// How the bytes are stored.
    pub storage: Storage,
    /// XXH3-64 of the checkpoint tensor's bytes, as a packed trunk records it (`None` when read
    /// from the shards): a coded or quantized matrix's header must name the same (checked at
    /// bind).
    pub source_xxh3: Option<u64>,
}

/// Where each trunk tensor of one layer sits inside that layer's run (sorted by name).
#[derive(Clone, Debug, Default)]
pub struct LayerLayout {
    tensors: Vec<TensorLoc>,
}

impl LayerLayout {
    /// Build from locations in any order.
    pub fn new(mut tensors: Vec<TensorLoc>) -> LayerLayout {
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        LayerLayout { tensors }
    }

    /// Look a tensor up by full name.
    pub fn get(&self, name: &str) -> Option<&TensorLoc> {
        self.tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[i])
    }

    /// All tensors, sorted by name.
    pub fn tensors(&self) -> &[TensorLoc] {
        &self.tensors
    }
}

/// One layer's trunk bytes and where each tensor sits in them.
#[derive(Clone, Debug)]
pub struct LayerRun {
    /// 0-based layer index.
    pub layer: usize,
    /// The run's bytes, valid while this value lives.
    pub region: Region,
    /// Tensor locations inside `region`.
    pub layout: Arc<LayerLayout>,
}

/// The experts handed back for one request, in request order. Each `Ok` region holds one expert
/// in the canonical slot layout of [`k3_proto::expert::ExpertLayout`]; each `Err` says why that
/// expert could not be loaded. The caller must count failures and fail the run (exit 4): a
/// missing expert is never silently dropped.
#[derive(Debug)]
pub struct ExpertBatch {
    /// One entry per requested expert id, in request order.
    pub experts: Vec<Result<Region, ExpertError>>,
}

/// Why one expert of a batch could not be handed out (cloned to every request that waited on
/// the same read). Any of them fails the run with exit 4 ([`ExpertBatch`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExpertError {
    /// The checkpoint has no such expert.
    #[error("layer {layer} expert {expert} is not in the checkpoint")]
    NotInCheckpoint {
        /// 0-based layer.
        layer: usize,
        /// Expert id.
        expert: u32,
    },
    /// Reading it from the checkpoint failed (the message names the file and offset).
    #[error(transparent)]
    Read(#[from] crate::runtime::io::ReadError),
    /// Reading it into this process's own memory (the store's slots were held) failed.
    #[error("layer {layer} expert {expert}, read privately: {source}")]
    Private {
        /// 0-based layer.
        layer: usize,
        /// Expert id.
        expert: u32,
        /// Why.
        source: crate::runtime::io::ReadError,
    },
    /// No buffer for a private read.
    #[error(transparent)]
    Alloc(#[from] crate::runtime::io::AllocError),
    /// Its slot could not be used: a bug of the slot protocol, never aliased bytes.
    #[error(transparent)]
    Slot(#[from] SlotProblem),
    /// The store leased a slot this process cannot trust (or a private read's buffer does not
    /// hold the expert).
    #[error("layer {layer} expert {expert}: {problem}")]
    Leased {
        /// 0-based layer.
        layer: usize,
        /// Expert id.
        expert: u32,
        /// What is wrong with the lease.
        problem: SlotProblem,
    },
    /// The store could not load it; its reason, as the store wrote it.
    #[error("{0}")]
    Store(String),
    /// The reader thread was lost or panicked.
    #[error(transparent)]
    Job(#[from] crate::runtime::pool::JobError),
    /// A failure injected by a test hook ([`crate::runtime::experts::FailHook`]).
    #[error("layer {layer} expert {expert}: {message}")]
    Injected {
        /// 0-based layer.
        layer: usize,
        /// Expert id.
        expert: u32,
        /// The hook's message.
        message: String,
    },
    /// Another request read it into the slot, and that read failed.
    #[error("{0} (read by a concurrent request)")]
    Concurrent(Box<ExpertError>),
    /// Another request's read into the slot failed, without a recorded reason.
    #[error("layer {layer} expert {expert}: load failed")]
    LoadFailed {
        /// 0-based layer.
        layer: usize,
        /// Expert id.
        expert: u32,
    },
    /// Asked only of the resident experts, and this one is not resident.
    #[error("expert {expert} of layer {layer} is not resident")]
    NotResident {
        /// 0-based layer.
        layer: usize,
        /// Expert id.
        expert: u32,
    },
    /// The source shares no resident experts (asked of the resident experts only).
    #[error("expert {expert} of layer {layer}: this source shares no resident experts")]
    NoneShared {
        /// 0-based layer.
        layer: usize,
        /// Expert id.
        expert: u32,
    },
    /// The whole request failed (every expert of it carries the reason).
    #[error("{0}")]
    Request(String),
    /// The answer has no entry for the `index`-th expert of the request.
    #[error("no answer for expert {index} of the request")]
    NoAnswer {
        /// Position in the request.
        index: usize,
    },
    /// The region handed out is not one expert's size.
    #[error("expert region of {bytes} bytes, expected {expected}")]
    WrongSize {
        /// Bytes of the region.
        bytes: usize,
        /// Bytes of one expert.
        expected: usize,
    },
}

/// What is wrong with an expert slot a request was handed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SlotProblem {
    /// The slot number is past the arena.
    #[error("slot {slot} out of range ({slots} slots)")]
    OutOfRange {
        /// The slot.
        slot: usize,
        /// Slots in the arena.
        slots: usize,
    },
    /// The expert would end past its slot.
    #[error("{len} bytes at {at} overrun slot {slot} of {stride} bytes")]
    Overrun {
        /// The slot.
        slot: usize,
        /// Offset of the expert in the slot.
        at: usize,
        /// Bytes of the expert.
        len: usize,
        /// Bytes of a slot.
        stride: usize,
    },
    /// The slot lies outside the memory mapped for it.
    #[error("slot {slot} outside the mapping")]
    OutsideMapping {
        /// The slot.
        slot: usize,
    },
    /// A private read's expert lies outside its own buffer.
    #[error("expert at {at}+{len} outside its private buffer")]
    OutsideBuffer {
        /// Offset of the expert in the buffer.
        at: usize,
        /// Bytes of the expert.
        len: usize,
    },
    /// The arena refused the slot's bytes.
    #[error("slot {slot}: {source}")]
    Arena {
        /// The slot.
        slot: usize,
        /// Why.
        source: crate::runtime::arena::ArenaError,
    },
}

/// Counters a source keeps (lifetime of the source, or of one job in daemon mode).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SourceStats {
    /// Routed experts requested.
    pub expert_requests: u64,
    /// Requested experts that were already RESIDENT when the request arrived.
    pub resident_hits: u64,
    /// Requested experts that had to be read (or waited for while another reader read them).
    pub misses: u64,
    /// Slots whose previous expert was evicted to make room.
    pub evictions: u64,
    /// Experts that failed to load.
    pub failed_expert_loads: u64,
    /// Bytes of routed experts read from disk.
    pub expert_bytes_read: u64,
    /// Wall seconds spent in expert reads.
    pub expert_read_seconds: f64,
    /// Bytes of trunk layers read from disk (not counting pinned layers already resident).
    pub trunk_bytes_read: u64,
    /// Wall seconds spent in trunk reads.
    pub trunk_read_seconds: f64,
    /// Seconds the source's callers spent inside its calls waiting for bytes (trunk + experts).
    /// An engine that fetches experts beside its own compute measures its blocked time itself.
    pub io_wait_seconds: f64,
    /// Seconds callers were blocked in [`WeightSource::layer`] waiting for trunk bytes.
    pub trunk_wait_seconds: f64,
    /// Experts loaded by [`WeightSource::prefetch_experts`] (included in `expert_bytes_read`).
    #[serde(default)]
    pub prefetch_loads: u64,
    /// Bytes those prefetches read.
    #[serde(default)]
    pub prefetch_bytes: u64,
    /// Requested experts a prefetch had loaded; the rest of `prefetch_loads` was wasted.
    #[serde(default)]
    pub prefetch_used: u64,
    /// Predicted experts a prefetch dropped unread (their layer's request had come and only an
    /// eviction could have made room).
    #[serde(default)]
    pub prefetch_dropped: u64,
    /// Routed experts this attached job read from the checkpoint itself because the store's
    /// slots were held by a stuck worker (their bytes are in `expert_bytes_read`).
    #[serde(default)]
    pub private_expert_reads: u64,
    /// Streamed trunk layers handed out by the store's shared ring (attached jobs; 0 standalone).
    #[serde(default)]
    pub trunk_layers_served: u64,
    /// Of them, served from a read another job (or an earlier pass) had used already: a shared
    /// read, whose bytes are not in `trunk_bytes_read`.
    #[serde(default)]
    pub trunk_shared_layers: u64,
    /// Experts read into the cache before the first token (`--preload`; standalone only: an
    /// attached job's store preloaded before it served, `k3-ctl stats`). Not in
    /// `expert_bytes_read`, which counts what the job's requests and predictions cost.
    #[serde(default)]
    pub preloaded_experts: u64,
    /// Bytes of that preload.
    #[serde(default)]
    pub preload_bytes: u64,
    /// Wall seconds of its reads.
    #[serde(default)]
    pub preload_seconds: f64,
}

/// The error under a [`SourceError`] raised in a module this one does not name (the expert
/// cache, the trunk ring, the store connection: each of them names this module).
pub type Cause = Box<dyn std::error::Error + Send + Sync>;

/// Errors a source reports.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// A tensor or layer the engine asked for does not exist in this source.
    #[error("missing: {0}")]
    Missing(String),
    /// A read that failed, with the operating system's error kind when there was one.
    #[error("I/O: {0}")]
    Read(#[from] crate::runtime::io::ReadError),
    /// Reading `what` (a row of a tensor, …) from its file failed.
    #[error("I/O: {what}: {source}")]
    File {
        /// What was being read.
        what: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// No buffer for a read.
    #[error("I/O: {0}")]
    Alloc(#[from] crate::runtime::io::AllocError),
    /// The expert cache's memory or reader threads could not be set up.
    #[error("the expert cache: {0}")]
    Cache(#[source] Cause),
    /// `--preload` failed to read an expert (the checkpoint is damaged or unreadable).
    #[error("preloading the expert cache: {0}")]
    Preload(#[source] ExpertError),
    /// The trunk ring could not hand out a layer (its read failed, its lease was broken, it
    /// is stopping).
    #[error("I/O: {0}")]
    Ring(#[source] Cause),
    /// A region that would lie outside the buffer or mapping it names (a bug or a lying
    /// answer; never read).
    #[error("{0}: outside its buffer")]
    Outside(String),
    /// The attached store refused a request (`what`) with an error of its own.
    #[error("{what} ({code:?}): {message}")]
    Refused {
        /// What was asked.
        what: String,
        /// The store's error kind.
        code: k3_proto::wire::ErrorCode,
        /// The store's reason.
        message: String,
    },
    /// The attached store answered something that does not fit the request.
    #[error("the store's answer: {0}")]
    BadAnswer(String),
    /// A request on the store connection failed (it is not known to be gone).
    #[error("store connection: {0}")]
    Connection(#[source] Cause),
    /// The request itself is invalid (layer out of range, expert id too large, …).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The store this source is attached to is gone (its connection closed) or stopping: no
    /// request on this attachment can succeed any more (exit 3, `k3_proto::exit::NO_STORE`).
    #[error("I/O: {0}")]
    StoreGone(String),
    /// The thread serving a request asynchronously panicked (a bug in the source); the message
    /// is the panic's.
    #[error("the request's thread panicked: {0}")]
    Panicked(String),
}

/// An expert request running beside the engine's compute ([`WeightSource::request_experts`]).
/// [`PendingExperts::wait`] blocks until its answer is there.
#[derive(Debug)]
pub struct PendingExperts(Pending);

#[derive(Debug)]
enum Pending {
    Ready(Result<ExpertBatch, SourceError>),
    Running(std::sync::mpsc::Receiver<Result<ExpertBatch, SourceError>>),
}

impl PendingExperts {
    /// An answer that is already there (a source that serves requests synchronously).
    pub fn ready(answer: Result<ExpertBatch, SourceError>) -> PendingExperts {
        PendingExperts(Pending::Ready(answer))
    }

    /// Run `fetch` on `pool` (one of the source's long-lived threads); a panic in it is answered
    /// as [`SourceError::Panicked`].
    pub fn on_pool(
        pool: &crate::runtime::pool::IoPool,
        fetch: impl FnOnce() -> Result<ExpertBatch, SourceError> + Send + 'static,
    ) -> PendingExperts {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let tx2 = tx.clone();
        pool.submit(
            move || {
                let _ = tx.send(fetch());
            },
            move |m| {
                let _ = tx2.send(Err(SourceError::Panicked(m)));
            },
        );
        PendingExperts(Pending::Running(rx))
    }

    /// Wait for the answer.
    pub fn wait(self) -> Result<ExpertBatch, SourceError> {
        match self.0 {
            Pending::Ready(a) => a,
            Pending::Running(rx) => rx.recv().unwrap_or_else(|_| {
                Err(SourceError::Panicked(
                    "the request's thread ended without an answer".into(),
                ))
            }),
        }
    }
}

/// Rows `ids` (each `row_bytes` long) of the tensor `name` held in `t`, into `out` (cleared
/// first): [`WeightSource::tensor_rows`] of a tensor in memory.
pub fn copy_rows(
    t: &Region,
    name: &str,
    row_bytes: usize,
    ids: &[u32],
    out: &mut Vec<u8>,
) -> Result<(), SourceError> {
    let b = t.bytes();
    out.clear();
    for &id in ids {
        let row = (id as usize)
            .checked_mul(row_bytes)
            .and_then(|o| b.get(o..o.checked_add(row_bytes)?))
            .ok_or_else(|| {
                SourceError::Invalid(format!("row {id} of {name}: outside the tensor"))
            })?;
        out.extend_from_slice(row);
    }
    Ok(())
}

/// Where the engine gets weight bytes.
pub trait WeightSource: Send + Sync {
    /// A model-level tensor (embedding, lm_head, final norm, output AttnRes vectors), resident.
    fn model_tensor(&self, name: &str) -> Result<Region, SourceError>;

    /// Rows `ids` of the model-level tensor `name` (the embedding), each `row_bytes` long, into
    /// `out` in that order (`out` is cleared first). The default copies them out of
    /// [`WeightSource::model_tensor`]; a source that maps the tensor from the checkpoint reads
    /// them from the file instead, so that a row does not make a whole page-cache folio (up to
    /// 2 MiB) resident in the process.
    fn tensor_rows(
        &self,
        name: &str,
        row_bytes: usize,
        ids: &[u32],
        out: &mut Vec<u8>,
    ) -> Result<(), SourceError> {
        copy_rows(&self.model_tensor(name)?, name, row_bytes, ids, out)
    }

    /// Layer `l`'s trunk run; blocks until its bytes are in memory. The caller must be done with
    /// the experts of earlier layers (and the runs of earlier streamed layers): an attached
    /// source's store releases their leases when a streamed layer is asked for (SPEC.md §6.8).
    fn layer(&self, l: usize) -> Result<LayerRun, SourceError>;

    /// Hint that layer `l` will be asked for next (a streaming source starts reading it).
    fn prefetch_layer(&self, _l: usize) {}
    /// The forward pass is done with the trunk layers and the experts: release what it leased. `Err` when what
    /// the pass computed cannot be trusted (an attached worker's ring lease was broken by the
    /// store): the caller must discard the pass. Default: nothing held.
    fn end_pass(&self) -> Result<(), SourceError> {
        Ok(())
    }

    /// The routed experts `ids` of layer `l` (one layer's top-k for a token or a batch).
    fn experts(&self, l: usize, ids: &[u32]) -> Result<ExpertBatch, SourceError>;

    /// Start [`WeightSource::experts`] for `l`, `ids` and return at once; the engine computes
    /// what does not depend on the experts meanwhile, then waits. Same answer, same lease
    /// contract as `experts` (counted from the moment the answer is there). The default serves
    /// the request synchronously; the store's sources run it on a long-lived fetch thread.
    fn request_experts(&self, l: usize, ids: &[u32]) -> PendingExperts {
        PendingExperts::ready(self.experts(l, ids))
    }

    /// A PREDICTION that layer `l` will request experts `ids` (most likely first) soon: a
    /// caching source may read them ahead, in that order, into slots that no lease or pending
    /// request needs, without leasing them and without evicting anything more likely to be
    /// reused, and evicts nothing for them once layer `l`'s request has come. Returns at once;
    /// never changes what any request answers. Default: nothing.
    fn prefetch_experts(&self, _l: usize, _ids: &[u32]) {}

    /// The experts of `ids` (layer `l`) that are resident in memory now, leased as
    /// [`WeightSource::experts`] leases them; the others are `Err`. Never reads, never waits
    /// for a read, and is not counted in [`WeightSource::stats`]: a draft model uses it to run
    /// the routed experts it can have for free. Default: none resident.
    fn resident_experts(&self, l: usize, ids: &[u32]) -> ExpertBatch {
        ExpertBatch {
            experts: ids
                .iter()
                .map(|&expert| Err(ExpertError::NoneShared { layer: l, expert }))
                .collect(),
        }
    }

    /// True when giving layer `l`'s run back before the pass ends
    /// ([`WeightSource::release_layer`]) lets this source reuse its memory at once (a layer
    /// streamed through a ring). The forward pass then gives a MoE layer's run back before it
    /// waits for the layer's routed experts, keeping a copy of the little it reads afterwards, so
    /// the ring reads the next layer meanwhile. False (the default) where it would free nothing.
    fn releases_layers_early(&self, _l: usize) -> bool {
        false
    }

    /// Give back the run of a layer the pass is done with, before the pass ends. The default
    /// drops it (an in-process ring sees its lease end); an attached worker also tells the
    /// store, whose answer says whether the lease held to the end: `Err` voids the pass, like
    /// [`WeightSource::end_pass`].
    fn release_layer(&self, run: LayerRun) -> Result<(), SourceError> {
        drop(run);
        Ok(())
    }

    /// Layer `l`'s trunk run if it is already resident (pinned): never reads and never blocks.
    /// Lets the engine look at a later layer's router early. Default: `None`.
    fn resident_layer(&self, _l: usize) -> Option<LayerRun> {
        None
    }

    /// The most distinct experts one [`WeightSource::experts`] call may ask for (the cache's
    /// slots). The engine splits a prefill's larger union into requests of at most this many.
    fn max_expert_batch(&self) -> usize {
        usize::MAX
    }

    /// True when the caller may hold one answered batch of at most half of
    /// [`WeightSource::max_expert_batch`] experts while a request for another such batch runs.
    /// A pass whose union of experts exceeds the cache (a prefill chunk, a speculative verify
    /// pass) then reads group i+1 while it computes group i, instead of reading and computing in
    /// turn. Default: false. The store's cache answers false: its slots are shared with other
    /// workers, whose held batches could leave none for the second request.
    fn overlap_expert_groups(&self) -> bool {
        false
    }

    /// Counters so far.
    fn stats(&self) -> SourceStats;

    /// The packed trunk the layers come from: its codec, seal and — when it is quantized,
    /// lossy — the label every output of the run carries. Default: the checkpoint's own bytes.
    fn trunk(&self) -> k3_proto::wire::TrunkInfo {
        k3_proto::wire::TrunkInfo::default()
    }

    /// Up to `max` draft ids following `context` from earlier jobs' token streams (speculative
    /// decoding's history drafter). Only a store keeps a history: the default has none.
    fn history_draft(&self, _context: &[u32], _max: usize) -> Result<Vec<u32>, SourceError> {
        Ok(Vec::new())
    }

    /// Keep this job's token stream for later jobs' history drafting (a no-op without a store).
    fn record_history(&self, _ids: &[u32]) -> Result<(), SourceError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::SourceStats;

    /// A document written before the later counters existed reads with them at 0 (every field
    /// added after the first has `#[serde(default)]`).
    #[test]
    fn stats_from_before_the_prefetch_and_ring_counters_read_with_them_at_zero() {
        let mut v = serde_json::to_value(SourceStats {
            expert_requests: 7,
            prefetch_loads: 3,
            prefetch_dropped: 2,
            trunk_layers_served: 5,
            preloaded_experts: 4,
            preload_bytes: 9,
            preload_seconds: 0.5,
            ..SourceStats::default()
        })
        .unwrap();
        let o = v.as_object_mut().unwrap();
        for later in [
            "prefetch_loads",
            "prefetch_bytes",
            "prefetch_used",
            "prefetch_dropped",
            "trunk_layers_served",
            "trunk_shared_layers",
            "preloaded_experts",
            "preload_bytes",
            "preload_seconds",
        ] {
            assert!(o.remove(later).is_some(), "{later}");
        }
        let old: SourceStats = serde_json::from_value(v).unwrap();
        assert_eq!(
            old,
            SourceStats {
                expert_requests: 7,
                ..SourceStats::default()
            }
        );
    }
}
