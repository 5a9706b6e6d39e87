//! The store ⇄ worker / ctl wire protocol.
//!
//! Frames on the Unix socket are `u32` little-endian length + a postcard-encoded message. This
//! module is the one framing implementation ([`encode`]/[`write_frame`], [`read_frame`]); the
//! socket code only adds the transport (`sendmsg`/`recvmsg` for the descriptor). The length is
//! checked against [`MAX_FRAME`] (or the store's [`MAX_REQUEST_FRAME`]) before anything is
//! allocated. The first exchange on a
//! connection is always the handshake: the client sends [`Request::Hello`] and the store answers
//! [`Response::Welcome`] (with the shared-memory file descriptor attached as `SCM_RIGHTS`
//! ancillary data) or [`Response::Refused`] naming both versions. Every later request gets
//! exactly one response.
//!
//! Versioning: [`PROTOCOL_VERSION`] is bumped on any change to these types. A peer speaking
//! another version is refused with both versions named; variants are only ever appended, and
//! each documents the version it appeared in.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 12;

/// Largest frame either side accepts (1 MiB): a batch of 896 expert ids is ~4 KiB.
pub const MAX_FRAME: u32 = 1 << 20;

/// Largest request frame the store reads (64 KiB): the largest request, 4096 expert ids, is
/// under 21 KiB, and a `Hello` label is cut at [`MAX_LABEL_BYTES`]. A client cannot make the store
/// buffer more than this per connection.
pub const MAX_REQUEST_FRAME: u32 = 64 << 10;

/// Longest client label the store keeps (bytes, cut at a character boundary).
pub const MAX_LABEL_BYTES: usize = 256;

/// `label` cut to at most [`MAX_LABEL_BYTES`] bytes at a character boundary.
pub fn bounded_label(label: &str) -> &str {
    let mut end = label.len().min(MAX_LABEL_BYTES);
    while !label.is_char_boundary(end) {
        end -= 1;
    }
    &label[..end]
}

/// What a client is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientKind {
    /// A `k3-worker` job: it will map the store's memory and request experts.
    Worker,
    /// `k3-ctl`: status, stats, stop. Gets no memory.
    Control,
}

/// Requests, client → store.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// v1. Must be the first message on a connection.
    Hello {
        /// The client's [`PROTOCOL_VERSION`].
        protocol_version: u32,
        /// Worker or control.
        kind: ClientKind,
        /// Free text for `k3-ctl status` (e.g. "k3-worker pid 1234").
        label: String,
    },
    /// v1. Lease one layer's routed experts (the layer's top-k for a token or a prefill batch).
    /// Releases the leases this connection held for the same layer.
    Experts {
        /// 0-based layer.
        layer: u32,
        /// Expert ids, in the order the worker wants the answers.
        ids: Vec<u32>,
    },
    /// v1. Lifetime and this connection's counters.
    Stats,
    /// v1. What is running: model, preset, memory, workers.
    Status,
    /// v1. Ask the store to drain and exit.
    Stop,
    /// v1. Release every lease of this connection (also implied by disconnecting).
    ReleaseAll,
    /// v2. A worker's progress so far (for `k3-ctl ps`); answered with [`Response::Noted`].
    Progress(JobProgress),
    /// v3. Draft ids for speculative decoding from the store's history of earlier jobs' token
    /// streams: the continuation of the longest suffix of `context` found there
    /// (`crate::runtime::draft::lookup`). Answered with [`Response::Draft`] (empty when nothing
    /// matches). `context` holds at most [`MAX_DRAFT_CONTEXT`] ids, `max` at most
    /// [`MAX_DRAFT_IDS`].
    Draft {
        /// The job's last ids (the last one not yet run through the model).
        context: Vec<u32>,
        /// Most ids wanted.
        max: u32,
    },
    /// v3. Add a finished job's token stream (prompt then generated ids, at most
    /// [`MAX_RECORD_IDS`]: the newest ones) to the history; answered with [`Response::Noted`].
    Record {
        /// The ids.
        ids: Vec<u32>,
    },
    /// v3. Keep a conversation's state under `name` (replacing one of that name). The bytes
    /// travel as a sealed memfd attached to this frame (`SCM_RIGHTS`, docs/SPEC.md §6.6);
    /// answered with [`Response::SessionStored`]. Workers only.
    PutSession {
        /// Session name (`k3_store::session::check_name`).
        name: String,
        /// Bytes in the memfd.
        bytes: u64,
    },
    /// v3. Fetch a kept conversation: [`Response::Session`] with the memfd attached, or
    /// [`Response::NoSession`]. Workers only.
    GetSession {
        /// Session name.
        name: String,
    },
    /// v3. The kept conversations: [`Response::Sessions`].
    ListSessions,
    /// v3. A PREDICTION of a later `Experts` request (router lookahead): the store may read
    /// these experts into slots that no lease or pending request needs, without leasing them
    /// and without evicting anything more likely to be reused. Answered at once with
    /// [`Response::Noted`]; the reads run in the background. Never changes any answer.
    Prefetch {
        /// 0-based layer.
        layer: u32,
        /// Predicted expert ids.
        ids: Vec<u32>,
    },
    /// v4. Lease streamed (unpinned) trunk layer `layer` from the store's ring (SPEC.md §6.8):
    /// answered with [`Response::TrunkLayer`] once the layer is in shared memory. Releases the
    /// trunk lease this connection held before (the engine finishes a layer before it asks for
    /// the next). Fails with [`ErrorCode::LeaseBroken`] when that earlier lease was broken.
    TrunkLayer {
        /// 0-based layer, at least the store's pinned count.
        layer: u32,
    },
    /// v4. The forward pass is done with the streamed layers: release this connection's trunk
    /// lease. Answered [`Response::Released`], or [`ErrorCode::LeaseBroken`] when the lease was
    /// broken while held (the pass computed on bytes that may have been overwritten: discard it).
    EndPass,
    /// v5. Lease, of experts `ids` of `layer`, those RESIDENT now (answered `Leased`; the
    /// others `Failed`): no read, no wait, no counter, no change to the eviction order. A
    /// worker's draft model runs the routed experts it can have for free this way. Like
    /// `Experts`, it releases this connection's earlier expert leases.
    ResidentExperts {
        /// 0-based layer.
        layer: u32,
        /// Expert ids, in the order the worker wants the answers.
        ids: Vec<u32>,
    },
    /// v6. The worker is done with the streamed trunk layer it leased last (it copied what it
    /// still reads): release that lease only, mid-pass, so the ring can read the next layer into
    /// it while the worker waits for the layer's experts. Its expert leases stay. Answered
    /// [`Response::Released`], or [`ErrorCode::LeaseBroken`] when the lease was broken while
    /// held (discard the pass, as for `EndPass`).
    ReleaseTrunk,
}

/// One kept conversation in [`Response::Sessions`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionInfo {
    /// Its name.
    pub name: String,
    /// Token ids its state covers.
    pub ids: u64,
    /// XXH3-128 of those ids as little-endian u32s: a client matches a prompt's prefix against it
    /// without sending the prompt.
    pub ids_hash: u128,
    /// Bytes it takes.
    pub bytes: u64,
    /// Seconds since it was stored or fetched.
    pub idle_seconds: f64,
}

/// The kept conversations' figures in [`StatsReport`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionStats {
    /// Sessions kept.
    pub count: u32,
    /// Bytes they take.
    pub bytes: u64,
    /// The byte limit (`k3-store start --session-mb`).
    pub budget_bytes: u64,
    /// The count limit (`--max-sessions`).
    pub max_count: u32,
    /// Sessions evicted (least recently used first) since the start.
    pub evicted: u64,
    /// `--state-dir`, empty when sessions are kept in memory only.
    pub state_dir: String,
}

/// Most context ids a [`Request::Draft`] may carry (the lookup matches at most
/// `crate::runtime::draft::MAX_MATCH` of them).
pub const MAX_DRAFT_CONTEXT: usize = 64;

/// Most ids a [`Request::Draft`] may ask for.
pub const MAX_DRAFT_IDS: u32 = 64;

/// Most ids a [`Request::Record`] may carry: 12 288 ids are at most 60 KiB as postcard varints,
/// under [`MAX_REQUEST_FRAME`].
pub const MAX_RECORD_IDS: usize = 12 * 1024;

/// What a worker reports of its job after each generated token.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct JobProgress {
    /// Tokens generated so far.
    pub tokens: u64,
    /// Seconds of the decode steps so far (steps ≥ 1).
    pub decode_seconds: f64,
    /// Seconds of the prefill step (step 0).
    pub prefill_seconds: f64,
    /// Trunk bytes the worker streamed itself so far.
    pub trunk_bytes_read: u64,
    /// v3. Decode forward passes so far (after the prefill).
    pub forward_passes: u64,
    /// v3. Draft ids verified so far (speculative decoding).
    pub drafted_tokens: u64,
    /// v3. Draft ids the model agreed with.
    pub accepted_tokens: u64,
}

impl JobProgress {
    /// Mean seconds per token over the decode steps (`None` before the first).
    pub fn seconds_per_token(&self) -> Option<f64> {
        (self.tokens > 1).then(|| self.decode_seconds / (self.tokens - 1) as f64)
    }
}

/// One expert's answer inside [`Response::Experts`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum SlotAnswer {
    /// The expert is RESIDENT in this slot and leased to the requester.
    Leased {
        /// Slot index into the arena.
        slot: u32,
        /// v7. Where in the slot the expert's first byte is: its offset within its disk page,
        /// where its one aligned read put it (SPEC.md §6.3); 0 when its parts were read one by
        /// one. The worker refuses an answer whose expert would end past the slot.
        at: u32,
    },
    /// The expert could not be loaded; the worker must count it and exit 4.
    Failed {
        /// Why (file, offset, error).
        reason: String,
    },
    /// v10. No slot can be had now (every slot that could take it is leased by a worker that
    /// has held its leases too long — stopped, swapped out): the worker reads the expert from
    /// the checkpoint into its own memory, rather than wait for or fail on another worker.
    Private {
        /// Why (which slots were held, and by whom).
        reason: String,
    },
}

/// Counters, shared by the lifetime and per-job views.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Counters {
    /// Routed experts requested.
    pub requests: u64,
    /// Requested experts already RESIDENT before the request arrived.
    pub resident_hits: u64,
    /// Requested experts that had to be read or waited for.
    pub misses: u64,
    /// Slots whose previous expert was evicted.
    pub evictions: u64,
    /// Experts that failed to load.
    pub failed_loads: u64,
    /// Bytes read from disk for experts.
    pub expert_bytes_read: u64,
    /// Seconds spent reading experts.
    pub read_seconds: f64,
    /// v3. Experts loaded by `Prefetch` requests (their bytes are in `expert_bytes_read`).
    pub prefetch_loads: u64,
    /// v3. Bytes those prefetches read.
    pub prefetch_bytes: u64,
    /// v3. Requested experts that a prefetch had loaded (the rest of the loads were wasted).
    pub prefetch_used: u64,
    /// v7. Predicted experts a prefetch dropped unread: their layer's request had come and
    /// only an eviction could have made room (SPEC.md §6.7).
    pub prefetch_dropped: u64,
    /// v4. Bytes of streamed trunk layers read into the store's ring. Per job: the reads this
    /// job used first (a read another job used first is a shared read and is not counted again).
    pub trunk_bytes_read: u64,
    /// v4. Reads of streamed trunk layers into the ring (per job: the reads it used first).
    pub trunk_layer_reads: u64,
    /// v4. Streamed trunk layers handed out (per job: to this job).
    pub trunk_layers_served: u64,
    /// v4. Hand-outs of a read that an earlier hand-out had already used (a layer served to
    /// several jobs from one read, or again to the same job from the ring).
    pub trunk_shared_layers: u64,
    /// v4. Seconds workers waited for streamed trunk layers, summed.
    pub trunk_wait_seconds: f64,
    /// v4. Trunk leases broken because their holder kept them past the lease limit.
    pub broken_leases: u64,
    /// v8. Experts the store read into the arena at start-up, before serving (`--preload`;
    /// lifetime only). Not in `expert_bytes_read` or `read_seconds`.
    pub preloaded_experts: u64,
    /// v8. Bytes of that preload.
    pub preload_bytes: u64,
    /// v8. Wall seconds of its reads.
    pub preload_seconds: f64,
    /// v10. Requested experts answered [`SlotAnswer::Private`]: read by the worker itself
    /// because the slots were held by a worker that kept its leases too long.
    pub private_reads: u64,
    /// v11. Requested experts that were RESIDENT because the start-up preload put them there
    /// (the slot not evicted or re-read since): the hits the preload gave. Part of
    /// `resident_hits`.
    pub preload_hits: u64,
}

impl Counters {
    /// The TRUE resident hit rate: resident_hits / requests (0 when nothing was requested).
    pub fn true_resident_hit_rate(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.resident_hits as f64 / self.requests as f64
        }
    }
}

/// One worker connection's figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct JobStats {
    /// The store's id for the connection (increasing).
    pub conn: u64,
    /// The worker's label (e.g. "k3-worker pid 1234").
    pub label: String,
    /// Still connected.
    pub live: bool,
    /// This job's counters.
    pub counters: Counters,
    /// What the worker last reported of its progress.
    pub progress: JobProgress,
    /// v10. The worker's process id (`SO_PEERCRED`; 0 when unknown).
    pub pid: u32,
    /// v10. Seconds it has held its current expert leases (0 when it holds none): a live job
    /// whose figure keeps growing is stuck (stopped, swapped out) and others read privately
    /// around it.
    pub lease_age_seconds: f64,
}

/// The answer to [`Request::Stats`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StatsReport {
    /// Since the store started.
    pub lifetime: Counters,
    /// For the asking connection only.
    pub job: Counters,
    /// Connected workers and the most recent finished ones (newest last).
    pub jobs: Vec<JobStats>,
    /// Layers pinned in shared memory.
    pub pinned_layers: u32,
    /// Arena slots holding an expert.
    pub slots_used: u32,
    /// Arena slots in all.
    pub slots_total: u32,
    /// Slots currently leased by some worker.
    pub slots_leased: u32,
    /// Connected worker processes.
    pub workers: u32,
    /// Seconds since the store was ready.
    pub uptime_seconds: f64,
    /// v3. Kept conversations.
    pub sessions: SessionStats,
    /// v3. The history drafts are taken from.
    pub history: HistoryStats,
    /// v11. The expert usage history (`--state-dir`) and the preload it chose.
    pub usage: UsageStats,
    /// v12. The trunk the store serves (lossy or exact).
    pub trunk: TrunkInfo,
}

/// The store's per-expert usage history (`k3-store start --state-dir`, SPEC.md §6.6) and the
/// start-up preload it chose.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UsageStats {
    /// The usage file, empty when the store keeps no usage history (no `--state-dir`).
    pub file: String,
    /// Why the file found at start was refused (logged; the store started a new history, which
    /// replaces it at its first save), empty when it was loaded or there was none.
    pub refused: String,
    /// Demand requests the history held when the store started (0: a new history).
    pub requests_at_start: u64,
    /// Demand requests counted since the start (experts named by workers' `Experts` requests;
    /// never prefetches, preloads or a draft model's resident leases).
    pub requests_counted: u64,
    /// Of those, how many the file on disk holds (the rest is lost if the store is killed).
    pub requests_saved: u64,
    /// Experts whose count is not zero.
    pub experts_used: u64,
    /// Saves written.
    pub saves: u64,
    /// Saves that failed (each logged; the previous file stays).
    pub save_failures: u64,
    /// What the start-up preload read: `every` (every routed expert), `hot` (the most used
    /// experts of the history that fit), `none`.
    pub preload: String,
    /// Experts the preload read because the history named them (`preload` = `hot`).
    pub hot_preloaded: u64,
}

/// v12. The packed trunk a store serves: how it is stored, its seal, and — for a quantized,
/// lossy trunk — the label every output of a run on it carries.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrunkInfo {
    /// `"raw"`, `"ecbf16"`, `"int8"` or `"int4"` (`trunk.json`'s codec); empty when the layers
    /// are read from the checkpoint's shards.
    pub codec: String,
    /// The `trunk.json` seal the store opened (32 hex digits; empty without a packed trunk): a
    /// worker whose `trunk.json` has another is refused (its descriptors are not the store's).
    pub seal: String,
    /// `k3_proto::quant::lossy_label` for an int8/int4 trunk; empty when the trunk holds the
    /// checkpoint's numbers exactly.
    pub lossy: String,
}

impl TrunkInfo {
    /// True for a quantized trunk.
    pub fn is_lossy(&self) -> bool {
        !self.lossy.is_empty()
    }
}

/// The store's history of earlier jobs' token streams (speculative drafting, SPEC.md §3.12).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HistoryStats {
    /// Streams kept.
    pub streams: u64,
    /// Ids kept, over all streams.
    pub tokens: u64,
    /// Most ids kept (oldest streams are dropped first).
    pub capacity_tokens: u64,
    /// Draft requests answered.
    pub queries: u64,
    /// Draft requests that found a match.
    pub hits: u64,
    /// Ids drafted, over all answers.
    pub drafted: u64,
}

/// The answer to [`Request::Status`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// Checkpoint directory.
    pub model_dir: String,
    /// Packed trunk directory.
    pub trunk_dir: String,
    /// Preset name or "custom".
    pub preset: String,
    /// The memory plan, as printed at start.
    pub plan: String,
    /// Shared-memory bytes.
    pub shm_bytes: u64,
    /// Store process id.
    pub pid: u32,
    /// One label per connected client.
    pub clients: Vec<String>,
    /// Seconds since ready.
    pub uptime_seconds: f64,
    /// v12. The trunk the store serves (lossy or exact).
    pub trunk: TrunkInfo,
}

/// What a store that is still loading its shared memory says ([`Response::Loading`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadingReport {
    /// Store process id (what `k3-ctl stop` waits for).
    pub pid: u32,
    /// Checkpoint directory.
    pub model_dir: String,
    /// Preset name or "custom".
    pub preset: String,
    /// Bytes loaded so far.
    pub done_bytes: u64,
    /// Bytes the load reads in all (0 until it is known).
    pub total_bytes: u64,
    /// Seconds since the load began.
    pub seconds: f64,
}

impl LoadingReport {
    /// Percent loaded, once the total is known.
    pub fn percent(&self) -> Option<f64> {
        (self.total_bytes > 0).then(|| 100.0 * self.done_bytes as f64 / self.total_bytes as f64)
    }

    /// One line for people: "the store (pid 7, preset server) is still loading: 2.10 of 6.52 GB
    /// (32%) in 12.0 s".
    pub fn line(&self) -> String {
        let pct = self
            .percent()
            .map_or(String::new(), |p| format!(" ({p:.0}%)"));
        format!(
            "the store (pid {}, preset {}) is still loading its shared memory: {:.2} of {:.2} GB{pct} \
             in {:.1} s",
            self.pid,
            self.preset,
            self.done_bytes as f64 / 1e9,
            self.total_bytes as f64 / 1e9,
            self.seconds
        )
    }
}

/// Responses, store → client.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Response {
    /// v1. Handshake accepted. For workers the shared-memory fd travels with this frame.
    Welcome {
        /// The store's [`PROTOCOL_VERSION`].
        protocol_version: u32,
        /// Checkpoint directory the store serves.
        model_dir: String,
        /// Packed trunk directory (the store streams the unpinned layers from it; workers read
        /// its `trunk.json` for the layers' tensor layout and check its identity).
        trunk_dir: String,
        /// Bytes of shared memory to map (0 for control clients).
        shm_bytes: u64,
        /// v5. The draft trunk the store holds in shared memory (SPEC.md §6.10; its runs are
        /// the `DraftLayer` regions; workers read its `draft.json` for their layout), or empty.
        draft_dir: String,
        /// v12. The trunk it serves: a worker checks its `trunk.json` has this seal, and labels
        /// its outputs when it is lossy.
        trunk: TrunkInfo,
    },
    /// v1. Handshake refused.
    Refused {
        /// The store's version.
        store_version: u32,
        /// The client's version as it said.
        client_version: u32,
        /// Human-readable reason naming both versions.
        reason: String,
    },
    /// v1. Answer to [`Request::Experts`], one entry per requested id, in order.
    Experts {
        /// Per-expert answers.
        answers: Vec<SlotAnswer>,
        /// Requested experts that were RESIDENT before this request.
        resident_hits: u32,
    },
    /// v1. Answer to [`Request::Stats`] (boxed: it is by far the largest answer; the encoding is
    /// the same).
    Stats(Box<StatsReport>),
    /// v1. Answer to [`Request::Status`].
    Status(StatusReport),
    /// v1. Answer to [`Request::Stop`]: the store is draining.
    Stopping,
    /// v1. Answer to [`Request::ReleaseAll`].
    Released,
    /// v2. Answer to [`Request::Progress`] (and, v3, to [`Request::Record`]).
    Noted,
    /// v2. The request cannot be served; `code` says which kind of failure it is, so a client
    /// can act on it without matching the text.
    Error {
        /// What kind of failure.
        code: ErrorCode,
        /// Why, for people.
        message: String,
    },
    /// v3. Answer to [`Request::Draft`]: the drafted ids (possibly none).
    Draft {
        /// At most the `max` asked for.
        ids: Vec<u32>,
    },
    /// v3. Answer to [`Request::PutSession`]: kept.
    SessionStored {
        /// Sessions evicted to make room (least recently used first).
        evicted: Vec<String>,
    },
    /// v3. Answer to [`Request::GetSession`]; the sealed memfd travels with this frame.
    Session {
        /// Bytes in the memfd.
        bytes: u64,
    },
    /// v3. Answer to [`Request::GetSession`]: no session of that name.
    NoSession,
    /// v3. Answer to [`Request::ListSessions`], most recently used first.
    Sessions(Vec<SessionInfo>),
    /// v4. Answer to [`Request::TrunkLayer`]: the layer's run is at `offset..offset + len` of the
    /// shared memory, leased to this connection until its next `TrunkLayer`, `ReleaseTrunk` or
    /// `EndPass`.
    TrunkLayer {
        /// Byte offset of the run in the shared-memory segment.
        offset: u64,
        /// Bytes of the run.
        len: u64,
        /// This connection is the first to use this read of the layer (its bytes count as read
        /// for this job); `false`: another job's read served it too (a shared read).
        fresh: bool,
    },
    /// v9. The store has claimed its socket but is still loading its shared memory: the answer
    /// to a worker's `Hello` and to every control request but `Stop` (which is honoured: the
    /// load is abandoned). A client reports it and ends (exit 3); nothing is served yet.
    Loading(LoadingReport),
}

/// The kind of a [`Response::Error`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// The request is malformed or out of range (bad layer, unknown expert, too many ids, a
    /// frame over the limit, a first message that is not `Hello`).
    BadRequest,
    /// This client may not make this request (a control client leasing experts, a peer of
    /// another uid, `Hello` twice).
    NotAllowed,
    /// The store is at a limit (connections); try again later.
    Busy,
    /// The store is stopping.
    Stopping,
    /// The answer would exceed the frame limit.
    TooLarge,
    /// The store failed to do something it should be able to (share memory, read experts).
    Internal,
    /// v4. A trunk lease this connection held longer than the store's lease limit was broken
    /// so the other workers could go on; what was computed on it must be discarded.
    LeaseBroken,
}

impl ErrorCode {
    /// The exit code a client ends with when the store answers this (`k3_proto::exit`): the
    /// store is there but will not serve us (3) for a refusal or a limit, a failure otherwise.
    pub fn exit_code(self) -> i32 {
        match self {
            ErrorCode::NotAllowed | ErrorCode::Busy | ErrorCode::Stopping => crate::exit::NO_STORE,
            ErrorCode::BadRequest
            | ErrorCode::TooLarge
            | ErrorCode::Internal
            | ErrorCode::LeaseBroken => crate::exit::FAILURE,
        }
    }
}

/// Wire errors.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Socket error (a timeout shows as `TimedOut`/`WouldBlock`).
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    /// A frame longer than the reader's limit ([`MAX_FRAME`], or [`MAX_REQUEST_FRAME`] for the
    /// store reading requests), or a message too large to send as one frame.
    #[error("frame of {len} bytes exceeds the {limit}-byte limit")]
    TooLong {
        /// The announced or encoded length.
        len: u64,
        /// The limit it exceeds.
        limit: u32,
    },
    /// A frame that does not decode as a message of this protocol version.
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// The peer closed the connection (before the first byte of a frame).
    #[error("peer closed the connection")]
    Closed,
}

/// Encode `msg` as one frame (length prefix + postcard), refused when longer than [`MAX_FRAME`].
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, WireError> {
    // Reserve the prefix and serialize behind it: one allocation, no copy.
    let mut out =
        postcard::to_extend(msg, vec![0u8; 4]).map_err(|e| WireError::Malformed(e.to_string()))?;
    let body_len = out.len() - 4;
    let len = u32::try_from(body_len)
        .ok()
        .filter(|&l| l <= MAX_FRAME)
        .ok_or(WireError::TooLong {
            len: body_len as u64,
            limit: MAX_FRAME,
        })?;
    out[..4].copy_from_slice(&len.to_le_bytes());
    Ok(out)
}

/// Write one frame. For a frame that carries a file descriptor, the socket code sends the bytes
/// of [`encode`] with `sendmsg` itself (the framing is the same).
pub fn write_frame<T: Serialize, W: Write>(w: &mut W, msg: &T) -> Result<(), WireError> {
    w.write_all(&encode(msg)?)?;
    w.flush()?;
    Ok(())
}

/// Read one frame's body, at most `limit` bytes. The length prefix is checked against `limit`
/// before anything is allocated, and the body buffer grows only as bytes actually arrive (a peer
/// that announces a large frame and sends half of it costs half, not the whole). End of input
/// before the first byte is [`WireError::Closed`]; inside a frame it is `Malformed`.
pub fn read_frame_bytes<R: Read>(r: &mut R, limit: u32) -> Result<Vec<u8>, WireError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Err(WireError::Closed),
            Ok(0) => {
                return Err(WireError::Malformed(
                    "frame cut short inside its length prefix".into(),
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_le_bytes(len);
    if len > limit {
        return Err(WireError::TooLong {
            len: len as u64,
            limit,
        });
    }
    const FIRST_CHUNK: usize = 64 << 10;
    let mut body = Vec::with_capacity((len as usize).min(FIRST_CHUNK));
    r.take(len as u64).read_to_end(&mut body)?;
    if body.len() != len as usize {
        return Err(WireError::Malformed(format!(
            "frame cut short: wanted {len} bytes, got {}",
            body.len()
        )));
    }
    Ok(body)
}

/// Decode a frame body.
pub fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, WireError> {
    let (msg, rest) =
        postcard::take_from_bytes(body).map_err(|e| WireError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(WireError::Malformed(format!(
            "{} trailing bytes after the message",
            rest.len()
        )));
    }
    Ok(msg)
}

/// Read and decode one frame of at most [`MAX_FRAME`] bytes.
pub fn read_frame<T: for<'de> Deserialize<'de>, R: Read>(r: &mut R) -> Result<T, WireError> {
    read_frame_limited(r, MAX_FRAME)
}

/// Read and decode one frame of at most `limit` bytes.
pub fn read_frame_limited<T: for<'de> Deserialize<'de>, R: Read>(
    r: &mut R,
    limit: u32,
) -> Result<T, WireError> {
    decode(&read_frame_bytes(r, limit)?)
}

/// The store's answer to a `Hello` with `client_version`: `None` when accepted.
pub fn check_version(client_version: u32) -> Option<Response> {
    (client_version != PROTOCOL_VERSION).then(|| Response::Refused {
        store_version: PROTOCOL_VERSION,
        client_version,
        reason: format!(
            "protocol version mismatch: this store speaks v{PROTOCOL_VERSION}, the client speaks \
             v{client_version}; use k3 binaries from the same build"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let msgs = vec![
            Request::Hello {
                protocol_version: PROTOCOL_VERSION,
                kind: ClientKind::Worker,
                label: "k3-worker pid 7".into(),
            },
            Request::Experts {
                layer: 91,
                ids: (0..896).collect(),
            },
            Request::Stats,
            Request::Stop,
        ];
        let mut buf = Vec::new();
        for m in &msgs {
            write_frame(&mut buf, m).unwrap();
        }
        let mut r = &buf[..];
        for m in &msgs {
            let got: Request = read_frame(&mut r).unwrap();
            assert_eq!(&got, m);
        }
        assert!(matches!(
            read_frame::<Request, _>(&mut r),
            Err(WireError::Closed)
        ));
    }

    #[test]
    fn oversized_length_is_refused_before_allocating() {
        let mut frame = (u32::MAX).to_le_bytes().to_vec();
        frame.extend_from_slice(&[0; 16]);
        let err = read_frame::<Request, _>(&mut &frame[..]).unwrap_err();
        assert!(matches!(err, WireError::TooLong { len, .. } if len == u32::MAX as u64));
        // A request-sized limit refuses what the general one accepts.
        let big = encode(&Request::Experts {
            layer: 0,
            ids: (0..40_000).collect(),
        })
        .unwrap();
        assert!(read_frame::<Request, _>(&mut &big[..]).is_ok());
        assert!(matches!(
            read_frame_limited::<Request, _>(&mut &big[..], MAX_REQUEST_FRAME),
            Err(WireError::TooLong {
                limit: MAX_REQUEST_FRAME,
                ..
            })
        ));
        // Too large to send at all.
        let huge = Response::Error {
            code: ErrorCode::Internal,
            message: "x".repeat(MAX_FRAME as usize + 1),
        };
        assert!(matches!(encode(&huge), Err(WireError::TooLong { .. })));
    }

    #[test]
    fn half_sent_frame_costs_what_arrived() {
        // A frame announcing 1 MiB with 10 bytes behind it: an error, and the reader never
        // reserves the announced size.
        let mut frame = MAX_FRAME.to_le_bytes().to_vec();
        frame.extend_from_slice(&[0; 10]);
        let err = read_frame_bytes(&mut &frame[..], MAX_FRAME).unwrap_err();
        assert!(
            matches!(err, WireError::Malformed(ref m) if m.contains("got 10")),
            "{err}"
        );
        // Cut inside the prefix.
        assert!(matches!(
            read_frame_bytes(&mut &[1u8, 0][..], MAX_FRAME),
            Err(WireError::Malformed(_))
        ));
    }

    #[test]
    fn labels_are_cut_at_a_char_boundary() {
        assert_eq!(bounded_label("k3-ctl"), "k3-ctl");
        let long = "é".repeat(MAX_LABEL_BYTES); // 2 bytes each
        let cut = bounded_label(&long);
        assert!(cut.len() <= MAX_LABEL_BYTES && cut.len() >= MAX_LABEL_BYTES - 1);
        assert!(cut.chars().all(|c| c == 'é'));
    }

    #[test]
    fn truncated_and_garbage_frames_are_errors() {
        let mut frame = 10u32.to_le_bytes().to_vec();
        frame.extend_from_slice(&[1, 2, 3]);
        assert!(matches!(
            read_frame::<Request, _>(&mut &frame[..]),
            Err(WireError::Malformed(_))
        ));
        let mut garbage = 3u32.to_le_bytes().to_vec();
        garbage.extend_from_slice(&[0xff, 0xff, 0xff]);
        assert!(matches!(
            read_frame::<Request, _>(&mut &garbage[..]),
            Err(WireError::Malformed(_))
        ));
    }

    #[test]
    fn version_mismatch_names_both_versions() {
        assert!(check_version(PROTOCOL_VERSION).is_none());
        match check_version(PROTOCOL_VERSION + 1) {
            Some(Response::Refused {
                store_version,
                client_version,
                reason,
            }) => {
                assert_eq!(store_version, PROTOCOL_VERSION);
                assert_eq!(client_version, PROTOCOL_VERSION + 1);
                assert!(reason.contains(&format!("v{}", PROTOCOL_VERSION + 1)));
                assert!(reason.contains(&format!("v{PROTOCOL_VERSION}")));
            }
            other => panic!("expected Refused, got {other:?}"),
        }
    }

    #[test]
    fn true_hit_rate_is_resident_hits_over_requests() {
        let c = Counters {
            requests: 8,
            resident_hits: 6,
            misses: 2,
            ..Default::default()
        };
        assert!((c.true_resident_hit_rate() - 0.75).abs() < 1e-12);
        assert_eq!(Counters::default().true_resident_hit_rate(), 0.0);
    }
}
