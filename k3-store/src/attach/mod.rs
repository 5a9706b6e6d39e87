//! Attached mode: a worker's [`WeightSource`] over a running store.
//!
//! The worker maps the store's memfd read-only. Model-level tensors and pinned trunk layers are
//! windows onto that mapping (no copy, no per-run reload); unpinned layers are leased from the
//! store's trunk ring (SPEC.md §6.8: one stream shared by every worker, nothing allocated here);
//! routed experts are leased from the store one layer at a time and read in place from the arena.
//!
//! Lease contract: the regions returned by [`WeightSource::experts`] stay valid until the next
//! `experts` call on the same source (the store may reuse those slots after that); a streamed
//! layer from [`WeightSource::layer`] until the next `layer` call for a streamed layer or
//! [`WeightSource::end_pass`]. The engine finishes a layer before it asks for the next and ends
//! every pass, so it never holds a region that long. `end_pass` fails when the store broke the
//! lease (a worker that held it past the store's limit): the pass is discarded.
//!
//! [`client`] is the connection itself (handshake, typed requests, descriptors received).

pub mod client;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use k3_proto::names::MODEL_TENSORS;
use k3_proto::shm::{RegionEntry, RegionKind, ShmHeader};
use k3_proto::wire::{ClientKind, Counters, ErrorCode, Request, Response, SlotAnswer};

use crate::attach::client::{Client, ClientError};
use crate::runtime::catalog::Catalog;
use crate::runtime::draft::{DraftFile, DraftSource};
use crate::runtime::experts::ExpertReader;
use crate::runtime::identity::ModelIdentity;
use crate::runtime::io::{AlignedBuf, DiskFile};
use crate::runtime::pool::IoPool;
use crate::runtime::source::{
    ByteOwner, ExpertBatch, ExpertError, LayerRun, PendingExperts, Region, SlotProblem,
    SourceError, SourceStats, WeightSource,
};
use crate::runtime::trunk::{open_shards, TrunkError, TrunkLayout};
use crate::shmem::ReadOnlySegment;

/// Why a worker could not attach. Each variant keeps the error beneath it; its exit code is in
/// [`crate::exit_codes`] (no store to attach to: 3; this process's limits: 2).
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// No store answers, or it refused us (exit 3).
    #[error(transparent)]
    Connect(#[from] ClientError),
    /// The store's handshake lacked something (`what`: its Welcome, its shared memory): exit 3.
    #[error("the store sent no {0}")]
    Handshake(&'static str),
    /// The store's memory could not be mapped (exit 3).
    #[error("cannot attach: mapping the store's memory: {0}")]
    Map(#[source] std::io::Error),
    /// The store's memory does not start with a header this worker reads (exit 3).
    #[error("cannot attach: the store's memory: {0}")]
    Header(#[source] k3_proto::shm::ShmError),
    /// The store's checkpoint cannot be catalogued here (exit 3).
    #[error("cannot attach: {0}")]
    Catalog(#[source] crate::runtime::catalog::CatalogError),
    /// The checkpoint's identity cannot be established here (exit 3).
    #[error("cannot attach: {0}")]
    Identity(#[source] crate::runtime::identity::IdentityError),
    /// The checkpoint's shards cannot be opened here (exit 3).
    #[error("cannot attach: {0}")]
    Shards(#[source] crate::runtime::io::ReadError),
    /// The store's packed trunk cannot be used here (exit 3).
    #[error("cannot attach: {0}")]
    Trunk(#[source] TrunkError),
    /// The store's checkpoint, trunk or memory is not what it should be (exit 3: we cannot
    /// attach); the message says what differs.
    #[error("cannot attach: {0}")]
    Mismatch(String),
    /// This process cannot hold what attaching needs (its open-file limit): exit 2.
    #[error(transparent)]
    Files(#[from] crate::runtime::fdlimit::TooFewFiles),
    /// The expert fetch thread could not be started (exit 1).
    #[error("starting the expert fetch thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// How to attach.
#[derive(Clone, Debug)]
pub struct AttachOptions {
    /// The label the store shows for this worker.
    pub label: String,
}

impl Default for AttachOptions {
    fn default() -> Self {
        AttachOptions {
            label: format!("k3-worker pid {}", std::process::id()),
        }
    }
}

/// What was attached.
#[derive(Clone, Debug)]
pub struct AttachInfo {
    /// Checkpoint directory the store serves.
    pub model_dir: PathBuf,
    /// Packed trunk directory (`None`: the store reads the layers from the shards).
    pub trunk_dir: Option<PathBuf>,
    /// Layers pinned in the store's memory.
    pub pinned_layers: usize,
    /// Bytes of shared memory mapped.
    pub shm_bytes: u64,
    /// Expert slots in the store's arena.
    pub slots: u32,
    /// Bytes of the store's trunk ring the unpinned layers stream through (0: all pinned).
    pub ring_bytes: u64,
    /// Seconds from connect to ready.
    pub attach_seconds: f64,
    /// The draft trunk the store holds in shared memory: its directory and bytes.
    pub draft: Option<(PathBuf, u64)>,
    /// The trunk the store serves (codec, seal, lossy label).
    pub trunk: k3_proto::wire::TrunkInfo,
}

/// A worker's view of a running store.
pub struct AttachedSource {
    link: Arc<Link>,
    model: HashMap<&'static str, Region>,
    /// The trunk's layout (tensor locations of the streamed layers).
    trunk: Arc<TrunkLayout>,
    /// Runs of the pinned layers `0..pinned.len()` in the store's memory.
    pinned: Vec<LayerRun>,
    /// The store's trunk ring in the mapping: (offset, bytes); (0, 0) when all is pinned.
    ring: (u64, u64),
    /// This job's trunk figures, and whether it holds a ring lease (a pass to end).
    trunk_stats: Mutex<TrunkFigures>,
    /// The long-lived thread [`WeightSource::request_experts`] runs on.
    fetch: IoPool,
    /// The draft trunk in the store's memory: its directory and one run per layer.
    draft: Option<(PathBuf, Vec<Region>)>,
}

impl Link {
    /// Lease experts `ids` of layer `l` from the store.
    fn experts(&self, l: usize, ids: &[u32]) -> Result<ExpertBatch, SourceError> {
        let t0 = Instant::now();
        let layer = u32::try_from(l).map_err(|_| SourceError::Invalid(format!("layer {l}")))?;
        let resp = {
            let mut c = self.client.lock().unwrap_or_else(|p| p.into_inner());
            c.call(&Request::Experts {
                layer,
                ids: ids.to_vec(),
            })
        };
        *self.wait.lock().unwrap_or_else(|p| p.into_inner()) += t0.elapsed().as_secs_f64();
        self.batch(l, ids, resp)
    }

    /// Lease, of experts `ids` of layer `l`, those resident in the store now (no read, not
    /// counted; the draft model's experts).
    fn resident(&self, l: usize, ids: &[u32]) -> Result<ExpertBatch, SourceError> {
        let layer = u32::try_from(l).map_err(|_| SourceError::Invalid(format!("layer {l}")))?;
        let resp = {
            let mut c = self.client.lock().unwrap_or_else(|p| p.into_inner());
            c.call(&Request::ResidentExperts {
                layer,
                ids: ids.to_vec(),
            })
        };
        self.batch(l, ids, resp)
    }

    /// The regions of the slots an `Experts` answer leased.
    fn batch(
        &self,
        l: usize,
        ids: &[u32],
        resp: Result<Response, ClientError>,
    ) -> Result<ExpertBatch, SourceError> {
        match resp {
            Ok(Response::Experts { answers, .. }) => {
                if answers.len() != ids.len() {
                    return Err(SourceError::BadAnswer(format!(
                        "{} experts for {} requested",
                        answers.len(),
                        ids.len()
                    )));
                }
                let owner: Arc<dyn ByteOwner> = self.seg.clone();
                let experts = answers
                    .into_iter()
                    .zip(ids)
                    .map(|(a, e)| match a {
                        SlotAnswer::Leased { slot, at } => self
                            .arena
                            .expert_offset(slot, at)
                            .and_then(|off| {
                                Region::new(owner.clone(), off, self.arena.expert_bytes).ok_or(
                                    SlotProblem::OutsideMapping {
                                        slot: slot as usize,
                                    },
                                )
                            })
                            .map_err(|problem| ExpertError::Leased {
                                layer: l,
                                expert: *e,
                                problem,
                            }),
                        SlotAnswer::Failed { reason } => Err(ExpertError::Store(reason)),
                        SlotAnswer::Private { reason } => self.private.read(l, *e, &reason),
                    })
                    .collect();
                Ok(ExpertBatch { experts })
            }
            Ok(Response::Error {
                code: ErrorCode::Stopping,
                message,
            }) => Err(SourceError::StoreGone(format!(
                "the store refused layer {l}'s experts (Stopping): {message}"
            ))),
            Ok(Response::Error { code, message }) => Err(SourceError::Invalid(format!(
                "the store refused layer {l}'s experts ({code:?}): {message}"
            ))),
            Ok(other) => Err(SourceError::BadAnswer(format!("{other:?}"))),
            Err(e) => Err(SourceError::StoreGone(format!(
                "store connection lost: {e}"
            ))),
        }
    }
}

/// This job's streamed trunk layers, as the store's answers tell them.
#[derive(Default)]
struct TrunkFigures {
    /// Bytes of the reads this job used first.
    bytes_read: u64,
    /// Layers handed to this job.
    served: u64,
    /// Of them, served from a read another hand-out had used (shared).
    shared: u64,
    /// Seconds spent waiting for them.
    wait_seconds: f64,
    /// A ring lease was taken in this pass: the pass must be ended (`EndPass` also gives back
    /// the expert leases, as between passes a worker holds none).
    leased: bool,
    /// The last ring lease is still held (not given back early with `ReleaseTrunk`).
    holding: bool,
}

/// The connection to the store and the arena's geometry: what an expert request needs, shared
/// with the fetch thread.
struct Link {
    client: Mutex<Client>,
    seg: Arc<ReadOnlySegment>,
    arena: ArenaGeometry,
    wait: Mutex<f64>,
    identity: u128,
    private: PrivateReads,
}

/// Experts the store answered [`SlotAnswer::Private`] (its slots held by a stuck worker): read
/// from the checkpoint into this worker's own memory, one aligned slot-sized buffer each, kept
/// alive by the regions handed out (until the next request of the engine).
struct PrivateReads {
    cat: Arc<Catalog>,
    reader: ExpertReader,
    /// Experts read so far and their bytes.
    count: std::sync::atomic::AtomicU64,
    bytes: std::sync::atomic::AtomicU64,
}

impl PrivateReads {
    fn read(&self, l: usize, e: u32, reason: &str) -> Result<Region, ExpertError> {
        use std::sync::atomic::Ordering::Relaxed;
        let what = format!("layer {l} expert {e}");
        let ext = (self.cat.expert(l, e as usize)).ok_or(ExpertError::NotInCheckpoint {
            layer: l,
            expert: e,
        })?;
        let layout = self.cat.expert_layout();
        let mut buf = AlignedBuf::zeroed(ExpertReader::slot_stride(&layout))?;
        self.reader
            .read(&what, &ext, buf.as_mut_slice())
            .map_err(|source| ExpertError::Private {
                layer: l,
                expert: e,
                source,
            })?;
        if self.count.fetch_add(1, Relaxed) == 0 {
            tracing::warn!(
                "the store's expert slots are held by another worker: reading experts from the \
                 checkpoint into this worker's memory ({reason})"
            );
        }
        self.bytes.fetch_add(layout.expert_bytes() as u64, Relaxed);
        let owner: Arc<dyn ByteOwner> = Arc::new(buf);
        let at = ExpertReader::offset_in_slot(&ext);
        Region::new(owner, at, layout.expert_bytes()).ok_or(ExpertError::Leased {
            layer: l,
            expert: e,
            problem: SlotProblem::OutsideBuffer {
                at,
                len: layout.expert_bytes(),
            },
        })
    }
}

/// Where the store's expert arena lies in its memory, as its header says.
#[derive(Clone, Copy, Debug)]
struct ArenaGeometry {
    offset: usize,
    stride: usize,
    expert_bytes: usize,
    slots: u32,
}

impl ArenaGeometry {
    /// The mapping offset of the expert a `Leased { slot, at }` answer names; `Err` when the
    /// slot is out of range or the expert would end past its slot (a store this worker cannot
    /// trust: the bytes would belong to another slot).
    fn expert_offset(&self, slot: u32, at: u32) -> Result<usize, SlotProblem> {
        if slot >= self.slots {
            return Err(SlotProblem::OutOfRange {
                slot: slot as usize,
                slots: self.slots as usize,
            });
        }
        if at as usize + self.expert_bytes > self.stride {
            return Err(SlotProblem::Overrun {
                slot: slot as usize,
                at: at as usize,
                len: self.expert_bytes,
                stride: self.stride,
            });
        }
        Ok(self.offset + slot as usize * self.stride + at as usize)
    }
}

/// Why a kept session could not be fetched from or handed to the store.
#[derive(Debug, thiserror::Error)]
pub enum SessionCallError {
    /// The connection failed.
    #[error("store connection: {0}")]
    Connection(#[from] ClientError),
    /// The store refused the request.
    #[error("the store refused ({code:?}): {message}")]
    Refused {
        /// What kind of refusal.
        code: k3_proto::wire::ErrorCode,
        /// Why.
        message: String,
    },
    /// An answer of another kind.
    #[error("unexpected answer from the store: {0}")]
    Unexpected(String),
    /// The store answered a session without its memfd.
    #[error("the store answered a session without its memfd")]
    NoMemfd,
    /// The session's memfd is not usable.
    #[error("the store's session {name}: {source}")]
    Memfd {
        /// The session.
        name: String,
        /// Why.
        source: std::io::Error,
    },
}

/// An answer the caller did not expect: the store's refusal, or any other answer.
fn unexpected(r: Response) -> SessionCallError {
    match r {
        Response::Error { code, message } => SessionCallError::Refused { code, message },
        other => SessionCallError::Unexpected(format!("{other:?}")),
    }
}

/// The checkpoint at `model_dir` as this worker sees it, refused unless it is the model the
/// store serves (the header's content identity).
fn same_model(model_dir: &Path, header: &ShmHeader) -> Result<Catalog, AttachError> {
    let (cat, _cfg) = Catalog::open_dir(model_dir).map_err(AttachError::Catalog)?;
    let identity = ModelIdentity::of(&cat).map_err(AttachError::Identity)?;
    if identity.id != header.model_identity() {
        return Err(AttachError::Mismatch(format!(
            "{} is model {identity} here, but the store serves model {:032x}: the checkpoint \
             (its config, manifest or shards) changed since the store loaded it; restart \
             the store",
            model_dir.display(),
            header.model_identity()
        )));
    }
    Ok(cat)
}

/// The store resolves its paths before it starts; a relative one would be looked up in this
/// worker's directory, where a different checkpoint may sit: refused.
fn absolute_paths(model_dir: &Path, trunk_dir: Option<&Path>) -> Result<(), AttachError> {
    for d in std::iter::once(model_dir).chain(trunk_dir) {
        if !d.is_absolute() {
            return Err(AttachError::Mismatch(format!(
                "the store sent a relative path {}; refusing to resolve it here",
                d.display()
            )));
        }
    }
    Ok(())
}

/// This worker's trunk layout (from `trunk_dir`, or the checkpoint's shards without one),
/// refused unless its descriptors are the ones the store checks runs against (`served`'s seal).
fn same_trunk(
    cat: &Catalog,
    shards: Vec<Arc<DiskFile>>,
    trunk_dir: Option<&Path>,
    served: &k3_proto::wire::TrunkInfo,
    trunk_from: &Path,
) -> Result<TrunkLayout, AttachError> {
    let trunk = match trunk_dir {
        Some(dir) => TrunkLayout::from_packed(cat, shards, dir).map_err(AttachError::Trunk)?,
        None => TrunkLayout::from_catalog(cat, shards),
    };
    let ours = trunk.info();
    if ours.seal != served.seal {
        return Err(AttachError::Mismatch(format!(
            "the store serves the trunk sealed {:?}, but {} has seal {:?} (re-packed since the \
             store started? restart the store)",
            served.seal,
            trunk_from.display(),
            ours.seal
        )));
    }
    Ok(trunk)
}

/// A region of the store's mapping, refused when it lies outside it.
fn region_of(
    owner: &Arc<dyn ByteOwner>,
    r: &RegionEntry,
    what: &str,
) -> Result<Region, AttachError> {
    Region::new(owner.clone(), r.offset as usize, r.len as usize)
        .ok_or_else(|| AttachError::Mismatch(format!("{what}: region outside the mapping")))
}

/// The model-level tensors the store holds, by name.
fn model_regions(
    header: &ShmHeader,
    owner: &Arc<dyn ByteOwner>,
) -> Result<HashMap<&'static str, Region>, AttachError> {
    let mut model = HashMap::new();
    for (i, name) in MODEL_TENSORS.iter().enumerate() {
        if let Some(r) = header.find(RegionKind::ModelTensor, i as u32) {
            model.insert(*name, region_of(owner, &r, name)?);
        }
    }
    Ok(model)
}

/// The pinned layers the store holds, each checked against this worker's trunk layout (read
/// from `trunk_from`).
fn pinned_regions(
    header: &ShmHeader,
    owner: &Arc<dyn ByteOwner>,
    trunk: &TrunkLayout,
    trunk_from: &Path,
) -> Result<Vec<LayerRun>, AttachError> {
    let mismatch = |m: String| AttachError::Mismatch(m);
    let mut pinned = Vec::new();
    while let Some(r) = header.find(RegionKind::PinnedLayer, pinned.len() as u32) {
        let l = pinned.len();
        let plan = trunk
            .plan(l)
            .ok_or_else(|| mismatch(format!("pinned layer {l} is not in the trunk")))?;
        if plan.run_len != r.len {
            return Err(mismatch(format!(
                "pinned layer {l} is {} bytes in the store, {} in {}",
                r.len,
                plan.run_len,
                trunk_from.display()
            )));
        }
        pinned.push(LayerRun {
            layer: l,
            region: region_of(owner, &r, &format!("pinned layer {l}"))?,
            layout: plan.layout.clone(),
        });
    }
    Ok(pinned)
}

/// The store's draft trunk: its directory (absolute, as the store resolved it) and its runs in
/// the mapping; `None` when the store holds none. Its draft.json is read (and checked against
/// the checkpoint) only by a job that drafts with it.
fn draft_regions(
    header: &ShmHeader,
    owner: &Arc<dyn ByteOwner>,
    draft_dir: &str,
) -> Result<Option<(PathBuf, Vec<Region>)>, AttachError> {
    if draft_dir.is_empty() {
        return Ok(None);
    }
    let dir = PathBuf::from(draft_dir);
    if !dir.is_absolute() {
        return Err(AttachError::Mismatch(format!(
            "the store sent a relative path {draft_dir}; refusing to resolve it here"
        )));
    }
    let mut runs = Vec::new();
    while let Some(r) = header.find(RegionKind::DraftLayer, runs.len() as u32) {
        let what = format!("draft layer {}", runs.len());
        runs.push(region_of(owner, &r, &what)?);
    }
    Ok(Some((dir, runs)))
}

impl AttachedSource {
    /// Connect to the store at `socket`, map its memory and prepare to stream unpinned layers.
    pub fn attach(
        socket: &Path,
        opts: &AttachOptions,
    ) -> Result<(AttachedSource, AttachInfo), AttachError> {
        let t0 = Instant::now();
        let mut client = Client::connect(socket, ClientKind::Worker, &opts.label)?;
        let Response::Welcome {
            model_dir,
            trunk_dir,
            shm_bytes,
            draft_dir,
            trunk: served,
            ..
        } = client.welcome.clone()
        else {
            return Err(AttachError::Handshake("Welcome"));
        };
        let fd = client
            .shm_fd
            .take()
            .ok_or(AttachError::Handshake("shared memory"))?;
        let seg = Arc::new(ReadOnlySegment::map(fd, shm_bytes).map_err(AttachError::Map)?);
        let header = ShmHeader::decode(seg.bytes()).map_err(AttachError::Header)?;
        let model_dir = PathBuf::from(model_dir);
        // An empty trunk directory: the store reads the layers from the checkpoint's shards.
        let trunk_dir = (!trunk_dir.is_empty()).then(|| PathBuf::from(trunk_dir));
        let mismatch = |m: String| AttachError::Mismatch(m);
        absolute_paths(&model_dir, trunk_dir.as_deref())?;
        let cat = same_model(&model_dir, &header)?;
        // The shards (private expert reads, the trunk layout), the trunk, the socket, the
        // store's memory and a session's memfd, against the open-file limit (raised).
        let needs = crate::runtime::fdlimit::Needs {
            shards: cat.shard_paths().len() as u64,
            trunks: u64::from(trunk_dir.is_some()),
            other: 3,
            ..Default::default()
        };
        (crate::runtime::fdlimit::raise()).check("k3-worker", &needs)?;
        let shards = open_shards(&cat).map_err(AttachError::Shards)?;
        let reader = ExpertReader::new(shards.clone(), cat.expert_layout());
        let trunk_from = trunk_dir.as_deref().unwrap_or(&model_dir);
        let trunk = Arc::new(same_trunk(
            &cat,
            shards,
            trunk_dir.as_deref(),
            &served,
            trunk_from,
        )?);
        let owner: Arc<dyn ByteOwner> = seg.clone();
        let model = model_regions(&header, &owner)?;
        let pinned = pinned_regions(&header, &owner, &trunk, trunk_from)?;
        let pinned_layers = pinned.len();
        let ring = match header.find(RegionKind::TrunkRing, 0) {
            Some(r) => (r.offset, r.len),
            None if pinned_layers < trunk.n_layers() => {
                return Err(mismatch(format!(
                    "the store pins {pinned_layers} of {} layers but has no trunk ring",
                    trunk.n_layers()
                )))
            }
            None => (0, 0),
        };
        let arena = header
            .find(RegionKind::ExpertArena, 0)
            .ok_or_else(|| mismatch("the store's memory has no expert arena".into()))?;
        // The store's draft trunk: its runs are regions of the mapping; its draft.json is read
        // (and checked against the checkpoint) only by a job that drafts with it.
        let draft = draft_regions(&header, &owner, &draft_dir)?;
        let info = AttachInfo {
            model_dir,
            trunk_dir,
            pinned_layers,
            shm_bytes,
            slots: header.slot_count,
            ring_bytes: ring.1,
            attach_seconds: t0.elapsed().as_secs_f64(),
            draft: draft
                .as_ref()
                .map(|(d, runs)| (d.clone(), runs.iter().map(|r| r.len() as u64).sum())),
            trunk: trunk.info(),
        };
        let fetch = IoPool::new("k3-expert-fetch", 1).map_err(AttachError::Thread)?;
        Ok((
            AttachedSource {
                link: Arc::new(Link {
                    client: Mutex::new(client),
                    seg,
                    arena: ArenaGeometry {
                        offset: arena.offset as usize,
                        stride: header.slot_stride as usize,
                        expert_bytes: header.expert_bytes as usize,
                        slots: header.slot_count,
                    },
                    wait: Mutex::new(0.0),
                    identity: header.model_identity(),
                    private: PrivateReads {
                        cat: Arc::new(cat),
                        reader,
                        count: Default::default(),
                        bytes: Default::default(),
                    },
                }),
                model,
                trunk,
                pinned,
                ring,
                trunk_stats: Mutex::new(TrunkFigures::default()),
                fetch,
                draft,
            },
            info,
        ))
    }

    /// A draft source over the store's draft trunk for the first `n_layers` layers of the
    /// checkpoint `cat` describes (`None` when the store holds none): its `draft.json` is checked
    /// against the checkpoint and the runs in the store's memory; the model-level tensors are
    /// this job's.
    pub fn draft_source(
        &self,
        cat: &Catalog,
        n_layers: usize,
    ) -> Option<Result<DraftSource, TrunkError>> {
        let (dir, runs) = self.draft.as_ref()?;
        Some((|| {
            let file = DraftFile::open(dir, cat, n_layers)?;
            if runs.len() < n_layers || (0..n_layers).any(|l| runs[l].len() as u64 != file.run(l).1)
            {
                return Err(TrunkError::draft(format!(
                    "the store's draft runs do not match {}",
                    dir.display()
                )));
            }
            file.source(runs[..n_layers].to_vec(), &|name| self.model_tensor(name))
        })())
    }

    /// Give the trunk lease back (`EndPass` or `ReleaseTrunk`); `Err` when the store broke it
    /// while it was held (the pass computed on bytes that may have been overwritten).
    fn trunk_call(&self, req: &Request) -> Result<(), SourceError> {
        let mut c = self.link.client.lock().unwrap_or_else(|p| p.into_inner());
        match c.call(req) {
            Ok(Response::Released) => Ok(()),
            Ok(Response::Error {
                code: ErrorCode::Stopping,
                message,
            }) => Err(SourceError::StoreGone(format!(
                "the store's trunk ring (Stopping): {message}"
            ))),
            Ok(Response::Error { code, message }) => Err(SourceError::Refused {
                what: "the trunk lease's release".into(),
                code,
                message,
            }),
            Ok(other) => Err(SourceError::BadAnswer(format!("{other:?}"))),
            Err(e) => Err(SourceError::StoreGone(format!(
                "store connection lost: {e}"
            ))),
        }
    }

    /// Lease streamed layer `l` from the store's ring (blocks until the store has it).
    fn leased_layer(&self, l: usize) -> Result<LayerRun, SourceError> {
        let plan = self
            .trunk
            .plan(l)
            .ok_or_else(|| SourceError::Missing(format!("trunk layer {l}")))?;
        let layer = u32::try_from(l).map_err(|_| SourceError::Invalid(format!("layer {l}")))?;
        let t0 = Instant::now();
        let resp = {
            let mut c = self.link.client.lock().unwrap_or_else(|p| p.into_inner());
            c.call(&Request::TrunkLayer { layer })
        };
        let waited = t0.elapsed().as_secs_f64();
        let (offset, len, fresh) = match resp {
            Ok(Response::TrunkLayer { offset, len, fresh }) => (offset, len, fresh),
            Ok(Response::Error {
                code: ErrorCode::Stopping,
                message,
            }) => {
                return Err(SourceError::StoreGone(format!(
                    "the store's trunk ring refused layer {l} (Stopping): {message}"
                )))
            }
            Ok(Response::Error { code, message }) => {
                return Err(SourceError::Refused {
                    what: format!("trunk layer {l}"),
                    code,
                    message,
                })
            }
            Ok(other) => return Err(SourceError::BadAnswer(format!("{other:?}"))),
            Err(e) => {
                return Err(SourceError::StoreGone(format!(
                    "store connection lost: {e}"
                )))
            }
        };
        let (r0, rlen) = self.ring;
        let inside = offset >= r0 && offset.checked_add(len).is_some_and(|e| e <= r0 + rlen);
        if len != plan.run_len || !inside {
            return Err(SourceError::BadAnswer(format!(
                "layer {l} at {offset}+{len}, not a {}-byte run inside its ring ({r0}+{rlen})",
                plan.run_len
            )));
        }
        let owner: Arc<dyn ByteOwner> = self.link.seg.clone();
        let region = Region::new(owner, offset as usize, len as usize)
            .ok_or_else(|| SourceError::Outside(format!("layer {l}'s run in the mapping")))?;
        let mut f = self.trunk_stats.lock().unwrap_or_else(|p| p.into_inner());
        f.leased = true;
        f.holding = true;
        f.served += 1;
        f.wait_seconds += waited;
        if fresh {
            f.bytes_read += len;
        } else {
            f.shared += 1;
        }
        Ok(LayerRun {
            layer: l,
            region,
            layout: plan.layout.clone(),
        })
    }

    /// This job's counters as the store keeps them (TRUE resident hits, bytes read, …).
    pub fn job_counters(&self) -> Result<Counters, SourceError> {
        let mut c = self.link.client.lock().unwrap_or_else(|p| p.into_inner());
        match c.call(&Request::Stats) {
            Ok(Response::Stats(s)) => Ok(s.job),
            Ok(other) => Err(SourceError::BadAnswer(format!("{other:?}"))),
            Err(e) => Err(SourceError::Connection(e.into())),
        }
    }

    /// The identity of the checkpoint the store serves (what a kept session must carry).
    pub fn model_identity(&self) -> u128 {
        self.link.identity
    }

    /// Fetch the kept session `name` (`None` when the store has none of that name).
    pub fn get_session(
        &self,
        name: &str,
    ) -> Result<Option<crate::session::Blob>, SessionCallError> {
        let mut c = self.link.client.lock().unwrap_or_else(|p| p.into_inner());
        let req = Request::GetSession { name: name.into() };
        match c.call_with_fd(&req, None)? {
            (Response::Session { bytes }, Some(fd)) => crate::session::Blob::from_fd(fd, bytes)
                .map(Some)
                .map_err(|source| SessionCallError::Memfd {
                    name: name.to_string(),
                    source,
                }),
            (Response::Session { .. }, None) => Err(SessionCallError::NoMemfd),
            (Response::NoSession, _) => Ok(None),
            (other, _) => Err(unexpected(other)),
        }
    }

    /// Hand `blob` to the store as session `name`; the names it evicted to make room.
    pub fn put_session(
        &self,
        name: &str,
        blob: &crate::session::Blob,
    ) -> Result<Vec<String>, SessionCallError> {
        let mut c = self.link.client.lock().unwrap_or_else(|p| p.into_inner());
        let req = Request::PutSession {
            name: name.into(),
            bytes: blob.len(),
        };
        match c.call_with_fd(&req, Some(blob.fd()))? {
            (Response::SessionStored { evicted }, _) => Ok(evicted),
            (other, _) => Err(unexpected(other)),
        }
    }

    /// Tell the store how far this job has come (shown by `k3-ctl ps`).
    pub fn report_progress(&self, p: k3_proto::wire::JobProgress) -> Result<(), SourceError> {
        let mut c = self.link.client.lock().unwrap_or_else(|p| p.into_inner());
        match c.call(&Request::Progress(p)) {
            Ok(Response::Noted) => Ok(()),
            Ok(other) => Err(SourceError::BadAnswer(format!("{other:?}"))),
            Err(e) => Err(SourceError::Connection(e.into())),
        }
    }

    /// Ask the store's history for up to `max` ids following `context` (history drafting). The
    /// context is cut to its last [`k3_proto::wire::MAX_DRAFT_CONTEXT`] ids.
    fn store_history_draft(&self, context: &[u32], max: usize) -> Result<Vec<u32>, SourceError> {
        let context = &context[context
            .len()
            .saturating_sub(k3_proto::wire::MAX_DRAFT_CONTEXT)..];
        let max = (max as u32).min(k3_proto::wire::MAX_DRAFT_IDS);
        let mut c = self.link.client.lock().unwrap_or_else(|p| p.into_inner());
        match c.call(&Request::Draft {
            context: context.to_vec(),
            max,
        }) {
            Ok(Response::Draft { mut ids }) => {
                ids.truncate(max as usize);
                Ok(ids)
            }
            Ok(other) => Err(SourceError::BadAnswer(format!("{other:?}"))),
            Err(e) => Err(SourceError::Connection(e.into())),
        }
    }

    /// Add this job's token stream (its newest [`k3_proto::wire::MAX_RECORD_IDS`] ids) to the
    /// store's history, so a later similar job can draft from it.
    fn store_record_history(&self, ids: &[u32]) -> Result<(), SourceError> {
        let ids = &ids[ids.len().saturating_sub(k3_proto::wire::MAX_RECORD_IDS)..];
        let mut c = self.link.client.lock().unwrap_or_else(|p| p.into_inner());
        match c.call(&Request::Record { ids: ids.to_vec() }) {
            Ok(Response::Noted) => Ok(()),
            Ok(other) => Err(SourceError::BadAnswer(format!("{other:?}"))),
            Err(e) => Err(SourceError::Connection(e.into())),
        }
    }
}

impl WeightSource for AttachedSource {
    fn model_tensor(&self, name: &str) -> Result<Region, SourceError> {
        self.model
            .get(name)
            .cloned()
            .ok_or_else(|| SourceError::Missing(format!("{name} (not in the store's memory)")))
    }

    fn layer(&self, l: usize) -> Result<LayerRun, SourceError> {
        if let Some(r) = self.pinned.get(l) {
            return Ok(r.clone());
        }
        self.leased_layer(l)
    }

    fn end_pass(&self) -> Result<(), SourceError> {
        let mut f = self.trunk_stats.lock().unwrap_or_else(|p| p.into_inner());
        if !f.leased {
            return Ok(());
        }
        f.leased = false;
        f.holding = false;
        drop(f);
        self.trunk_call(&Request::EndPass)
    }

    fn max_expert_batch(&self) -> usize {
        (self.link.arena.slots as usize).max(1)
    }

    fn experts(&self, l: usize, ids: &[u32]) -> Result<ExpertBatch, SourceError> {
        self.link.experts(l, ids)
    }

    fn prefetch_experts(&self, l: usize, ids: &[u32]) {
        // The store answers at once and reads in the background; the answer is not needed (a
        // prediction that went nowhere costs nothing).
        let Ok(layer) = u32::try_from(l) else { return };
        let mut c = self.link.client.lock().unwrap_or_else(|p| p.into_inner());
        let _ = c.call(&Request::Prefetch {
            layer,
            ids: ids.to_vec(),
        });
    }

    fn resident_layer(&self, l: usize) -> Option<LayerRun> {
        self.pinned.get(l).cloned()
    }

    fn releases_layers_early(&self, l: usize) -> bool {
        l >= self.pinned.len()
    }

    fn release_layer(&self, run: LayerRun) -> Result<(), SourceError> {
        // The run's bytes are the store's ring: nothing may read them once the lease is given
        // back, so the region goes first.
        drop(run);
        let mut f = self.trunk_stats.lock().unwrap_or_else(|p| p.into_inner());
        if !f.holding {
            return Ok(());
        }
        f.holding = false;
        drop(f);
        self.trunk_call(&Request::ReleaseTrunk)
    }

    fn request_experts(&self, l: usize, ids: &[u32]) -> PendingExperts {
        let (link, ids) = (self.link.clone(), ids.to_vec());
        PendingExperts::on_pool(&self.fetch, move || link.experts(l, &ids))
    }

    fn history_draft(&self, context: &[u32], max: usize) -> Result<Vec<u32>, SourceError> {
        self.store_history_draft(context, max)
    }

    fn record_history(&self, ids: &[u32]) -> Result<(), SourceError> {
        self.store_record_history(ids)
    }

    fn resident_experts(&self, l: usize, ids: &[u32]) -> ExpertBatch {
        self.link.resident(l, ids).unwrap_or_else(|e| ExpertBatch {
            experts: ids
                .iter()
                .map(|_| Err(ExpertError::Request(e.to_string())))
                .collect(),
        })
    }

    fn trunk(&self) -> k3_proto::wire::TrunkInfo {
        self.trunk.info()
    }

    fn stats(&self) -> SourceStats {
        use std::sync::atomic::Ordering::Relaxed;
        let (trunk_bytes, served, shared, trunk_wait) = {
            let f = self.trunk_stats.lock().unwrap_or_else(|p| p.into_inner());
            (f.bytes_read, f.served, f.shared, f.wait_seconds)
        };
        let job = self.job_counters().unwrap_or_default();
        let wait = *self.link.wait.lock().unwrap_or_else(|p| p.into_inner());
        SourceStats {
            expert_requests: job.requests,
            resident_hits: job.resident_hits,
            misses: job.misses,
            evictions: 0,
            failed_expert_loads: job.failed_loads,
            expert_bytes_read: job.expert_bytes_read + self.link.private.bytes.load(Relaxed),
            expert_read_seconds: job.read_seconds,
            // The store reads the ring; what this job saw of it is the wait.
            trunk_bytes_read: trunk_bytes,
            trunk_read_seconds: 0.0,
            io_wait_seconds: trunk_wait + wait,
            trunk_wait_seconds: trunk_wait,
            trunk_layers_served: served,
            trunk_shared_layers: shared,
            prefetch_loads: job.prefetch_loads,
            prefetch_bytes: job.prefetch_bytes,
            prefetch_used: job.prefetch_used,
            prefetch_dropped: job.prefetch_dropped,
            private_expert_reads: self.link.private.count.load(Relaxed),
            // The store's preload happened before this job: `k3-ctl stats` reports it.
            ..SourceStats::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ArenaGeometry;

    /// A `Leased` answer is placed inside its slot or refused: the slot must exist and the
    /// expert must end within the slot's stride, whatever `at` the store sent.
    #[test]
    fn a_leased_answer_stays_inside_its_slot() {
        let g = ArenaGeometry {
            offset: 8192,
            stride: 3 * 4096,
            expert_bytes: 2 * 4096 + 100,
            slots: 4,
        };
        assert_eq!(g.expert_offset(0, 0), Ok(8192));
        assert_eq!(g.expert_offset(2, 1840), Ok(8192 + 2 * 3 * 4096 + 1840));
        // The last byte of the expert is the last byte of the slot.
        let last = (g.stride - g.expert_bytes) as u32;
        assert_eq!(
            g.expert_offset(3, last),
            Ok(8192 + 9 * 4096 + last as usize)
        );
        let m = g.expert_offset(3, last + 1).unwrap_err().to_string();
        assert!(m.contains("overrun slot 3"), "{m}");
        assert!(g.expert_offset(0, u32::MAX).is_err());
        let m = g.expert_offset(4, 0).unwrap_err().to_string();
        assert!(m.contains("slot 4 out of range (4 slots)"), "{m}");
    }
}
