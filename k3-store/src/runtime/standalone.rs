//! The in-process weight source (`k3-worker --standalone`): the store's logic without a daemon.
//!
//! Model-level tensors are read once into aligned buffers; the trunk streams through
//! [`crate::runtime::stream::TrunkStream`] (pinned prefix + ring); routed experts come from
//! [`crate::runtime::experts::ExpertCache`]. The memory plan is computed and checked against
//! `MemAvailable` before anything large is allocated.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::runtime::catalog::Catalog;
use crate::runtime::experts::{CacheOptions, CacheStats, ExpertCache, Preload};
use crate::runtime::io::{DiskFile, MappedRange};
use crate::runtime::plan::{allocatable, Budget, MemoryPlan, PlanError, PlanInputs};
use crate::runtime::pool::IoPool;
use crate::runtime::source::{
    ByteOwner, ExpertBatch, LayerRun, PendingExperts, Region, SourceError, SourceStats,
    WeightSource,
};
use crate::runtime::stream::{StreamOptions, StreamStats, TrunkStream};
use crate::runtime::trunk::{open_shards, TrunkError, TrunkLayout};

/// Options of [`StandaloneSource`].
#[derive(Clone, Debug)]
pub struct StandaloneOptions {
    /// The sequence states the caller holds, as its engine states them.
    pub state: crate::runtime::plan::StateBytes,
    /// Parallel expert readers.
    pub io_threads: usize,
    /// Compare the plan with `MemAvailable` and refuse when it does not fit.
    pub check_memory: bool,
    /// How long a request waits for leased slots (experts) or ring space (trunk).
    pub wait_timeout: Duration,
    /// Expert-cache eviction policy (a name from `k3_store::runtime::policy::POLICY_NAMES`).
    pub cache_policy: String,
    /// The caller's buffers beyond the sequence state, as it states them from its shapes (a
    /// worker: its forward passes' activations and logits, a verify pass's journal, a draft
    /// model), counted in the plan's buffers with the readers' bounce buffers.
    pub extra_buffer_bytes: u64,
    /// Whether every routed expert is read into the cache before the first token.
    pub preload: Preload,
    /// Hold every tensor the engine reads to the config's dtype and shape at open
    /// ([`k3_proto::tensors::check`]; off only for the store library's own test checkpoints,
    /// which are not a model's tensor set).
    pub check_shapes: bool,
}

impl Default for StandaloneOptions {
    fn default() -> Self {
        StandaloneOptions {
            state: crate::runtime::plan::StateBytes::default(),
            io_threads: crate::runtime::plan::IO_THREADS,
            check_memory: true,
            wait_timeout: Duration::from_secs(60),
            cache_policy: crate::runtime::policy::DEFAULT_POLICY.into(),
            extra_buffer_bytes: 0,
            preload: Preload::Auto,
            check_shapes: true,
        }
    }
}

/// Why a standalone source could not be opened. Each variant keeps the error beneath it; its
/// exit code is in [`crate::exit_codes`] (a refusal before any work: 2; a failed read: 1).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The checkpoint's config.json cannot be used (refused).
    #[error("{}: {source}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// Why.
        source: k3_proto::config::ConfigError,
    },
    /// The checkpoint's safetensors index cannot be used (refused).
    #[error("{}: {source}", dir.display())]
    Index {
        /// The checkpoint folder.
        dir: PathBuf,
        /// Why.
        source: k3_proto::safetensors::IndexError,
    },
    /// A tensor's shape does not fit the config (refused).
    #[error("{}: {source}", dir.display())]
    Shapes {
        /// The checkpoint folder.
        dir: PathBuf,
        /// Why.
        source: k3_proto::tensors::ShapeError,
    },
    /// The tensors cannot be catalogued (refused).
    #[error(transparent)]
    Catalog(#[from] crate::runtime::catalog::CatalogError),
    /// The open-file limit is too low for the descriptors the source holds (refused).
    #[error(transparent)]
    Files(#[from] crate::runtime::fdlimit::TooFewFiles),
    /// A shard's length changed since the checkpoint was indexed (refused).
    #[error("{} is {len} bytes but was {indexed} bytes when indexed", path.display())]
    ShardChanged {
        /// The shard.
        path: PathBuf,
        /// Its length now.
        len: u64,
        /// Its length in the index.
        indexed: u64,
    },
    /// An unknown `--cache-policy` (refused).
    #[error("{}", crate::runtime::policy::unknown_policy(.0))]
    UnknownPolicy(String),
    /// The packed trunk cannot be used (refused) or read (a failure).
    #[error(transparent)]
    Trunk(#[from] TrunkError),
    /// The memory plan does not fit, or the memory available is unknown: exit 2.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// `--preload on` with a cache too small: exit 2.
    #[error(transparent)]
    Preload(#[from] crate::runtime::experts::PreloadRefused),
    /// A shard could not be opened (the error names it).
    #[error(transparent)]
    Shards(crate::runtime::io::ReadError),
    /// Reading the model tensor `what` failed.
    #[error("{what}: {source}")]
    Read {
        /// The tensor.
        what: String,
        /// Why.
        source: crate::runtime::io::ReadError,
    },
    /// A model tensor's shard is not among the open ones (a catalog bug).
    #[error("{tensor}: shard {shard} not open")]
    NotOpen {
        /// The tensor.
        tensor: String,
        /// Its shard.
        shard: u16,
    },
    /// A model tensor's window lies outside the buffer read for it (a bug).
    #[error("{0}: window outside its buffer")]
    Window(String),
    /// The embedding's shard could not be opened again for its row reads.
    #[error("{}: {source}", path.display())]
    Embed {
        /// The shard.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A thread of the source could not be started.
    #[error("starting the {what} thread: {source}")]
    Thread {
        /// Which thread.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// The trunk stream or the expert cache could not be set up (an invalid ring or a damaged
    /// pinned layer is a refusal; anything else a failure).
    #[error(transparent)]
    Source(#[from] SourceError),
}

/// Weights served in-process.
pub struct StandaloneSource {
    model: HashMap<String, Region>,
    stream: TrunkStream,
    experts: Arc<ExpertCache>,
    /// The long-lived thread [`WeightSource::request_experts`] runs on.
    fetch: IoPool,
    /// The long-lived thread [`WeightSource::prefetch_experts`] runs on, and the number of the
    /// latest prefetch submitted (an older one still queued is dropped: its layer has passed).
    prefetcher: IoPool,
    latest_prefetch: Arc<AtomicU64>,
    plan: MemoryPlan,
    /// The embedding's shard (opened buffered: a row is a page-cache read), offset and length:
    /// its rows are read from the file ([`WeightSource::tensor_rows`]), not through the mapping.
    embed: Option<(std::fs::File, u64, u64)>,
    /// The packed trunk read (codec, seal, lossy label).
    trunk: k3_proto::wire::TrunkInfo,
}

impl std::fmt::Debug for StandaloneSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StandaloneSource({:?}, {:?})", self.stream, self.experts)
    }
}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<StandaloneSource>();
};

impl StandaloneSource {
    /// Open the checkpoint in `model_dir` (config + index), optionally with a packed trunk,
    /// make the memory plan for `budget`, refuse if it does not fit, then load. `progress` is
    /// called with (what, done, total) while loading. `layers` limits the model to its first N
    /// layers (`--layers N`, for partial shard sets).
    pub fn open(
        model_dir: &Path,
        trunk_dir: Option<&Path>,
        budget: &Budget,
        layers: Option<usize>,
        opts: &StandaloneOptions,
        progress: &mut dyn FnMut(&str, usize, usize),
    ) -> Result<(StandaloneSource, MemoryPlan), OpenError> {
        let cfg_path = model_dir.join("config.json");
        let mut cfg =
            k3_proto::config::ModelConfig::load(&cfg_path).map_err(|source| OpenError::Config {
                path: cfg_path.clone(),
                source,
            })?;
        if let Some(n) = layers {
            cfg = cfg.with_layers(n);
        }
        let index = k3_proto::safetensors::CheckpointIndex::open(model_dir).map_err(|source| {
            OpenError::Index {
                dir: model_dir.into(),
                source,
            }
        })?;
        if opts.check_shapes {
            k3_proto::tensors::check(&cfg, &index).map_err(|source| OpenError::Shapes {
                dir: model_dir.into(),
                source,
            })?;
        }
        let cat = Catalog::from_index(&index, &cfg)?;
        drop(index);
        let state = opts.state.clone();
        Self::build(
            Arc::new(cat),
            trunk_dir,
            budget,
            opts,
            &|cat, trunk| {
                PlanInputs::from_model(&cfg, cat, trunk, state.clone())
                    .plus_buffers(opts.extra_buffer_bytes)
            },
            progress,
        )
    }

    /// Open from an already built catalog; `inputs` describes the model for the plan given the
    /// catalog and the trunk read plan.
    pub fn build(
        cat: Arc<Catalog>,
        trunk_dir: Option<&Path>,
        budget: &Budget,
        opts: &StandaloneOptions,
        inputs: &dyn Fn(&Catalog, &TrunkLayout) -> PlanInputs,
        progress: &mut dyn FnMut(&str, usize, usize),
    ) -> Result<(StandaloneSource, MemoryPlan), OpenError> {
        // Every descriptor this source holds, against the open-file limit (raised to the hard
        // one): a limit too low for them is a refusal with the number, not a failed read later.
        let needs = crate::runtime::fdlimit::Needs {
            shards: cat.shard_paths().len() as u64,
            trunks: u64::from(trunk_dir.is_some()),
            ..Default::default()
        };
        crate::runtime::fdlimit::raise().check("k3-worker", &needs)?;
        let shards = open_shards(&cat).map_err(OpenError::Shards)?;
        for (f, &want) in shards.iter().zip(cat.shard_lens()) {
            if f.len() != want {
                return Err(OpenError::ShardChanged {
                    path: f.path().into(),
                    len: f.len(),
                    indexed: want,
                });
            }
        }
        let layout = match trunk_dir {
            Some(d) => TrunkLayout::from_packed(&cat, shards.clone(), d)?,
            None => TrunkLayout::from_catalog(&cat, shards.clone()),
        };
        let avail = if opts.check_memory || budget.auto {
            Some(allocatable().map_err(PlanError::from)?)
        } else {
            None
        };
        let plan_inputs = inputs(&cat, &layout);
        let trunk_info = layout.info();
        let budget = match (budget.auto, avail) {
            (true, Some(a)) => Budget::fit(&plan_inputs, a),
            _ => budget.clone(),
        };
        let mut plan = MemoryPlan::compute(&plan_inputs, &budget);
        let avail = if opts.check_memory { avail } else { None };
        plan.check(avail)?;
        let preload = (opts.preload).wanted(plan.expert_slots, cat.routed_experts().count())?;

        let model = load_model_tensors(&cat, &shards, progress)?;
        let embed = cat
            .model_tensors()
            .iter()
            .find(|t| t.name == k3_proto::names::EMBED)
            .map(|t| {
                let f = shard_of(&shards, t)?;
                let file = std::fs::File::open(f.path()).map_err(|source| OpenError::Embed {
                    path: f.path().into(),
                    source,
                })?;
                Ok::<_, OpenError>((file, t.off, t.nbytes))
            })
            .transpose()?;
        let stream = TrunkStream::new(
            Arc::new(layout),
            &StreamOptions {
                pinned: plan.pinned_layers,
                ring_bytes: plan.ring_bytes,
                demand_timeout: opts.wait_timeout,
            },
            &mut |d, t| progress("pinned trunk layers", d, t),
        )?;
        let policy = crate::runtime::policy::policy_by_name(&opts.cache_policy, plan.expert_slots)
            .ok_or_else(|| OpenError::UnknownPolicy(opts.cache_policy.clone()))?;
        let experts = ExpertCache::with_policy(
            cat,
            shards,
            CacheOptions {
                slots: plan.expert_slots,
                io_threads: opts.io_threads,
                busy_timeout: opts.wait_timeout,
            },
            policy,
        )?;
        if preload {
            experts.preload(&mut |d, t| progress("expert cache", d as usize, t as usize))?;
        }
        let fetch = IoPool::new("k3-expert-fetch", 1).map_err(|source| OpenError::Thread {
            what: "expert fetch",
            source,
        })?;
        let prefetcher =
            IoPool::new("k3-expert-prefetch", 1).map_err(|source| OpenError::Thread {
                what: "expert prefetch",
                source,
            })?;
        let src = StandaloneSource {
            model,
            stream,
            experts: Arc::new(experts),
            fetch,
            prefetcher,
            latest_prefetch: Arc::new(AtomicU64::new(0)),
            plan: plan.clone(),
            embed,
            trunk: trunk_info,
        };
        Ok((src, plan))
    }

    /// The plan the source was built from.
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    /// Trunk streaming counters (pinned layers, ring, bytes, waits).
    pub fn stream_stats(&self) -> StreamStats {
        self.stream.stats()
    }

    /// Expert cache counters.
    pub fn cache_stats(&self) -> CacheStats {
        self.experts.stats()
    }

    /// The trunk-stream and expert-cache lines of the run report.
    pub fn describe(&self) -> [String; 2] {
        [self.stream.describe(), self.experts.describe()]
    }
}

/// The open shard model tensor `t` lies in.
fn shard_of<'a>(
    shards: &'a [Arc<DiskFile>],
    t: &crate::runtime::catalog::TensorExtent,
) -> Result<&'a Arc<DiskFile>, OpenError> {
    shards
        .get(t.shard as usize)
        .ok_or_else(|| OpenError::NotOpen {
            tensor: t.name.clone(),
            shard: t.shard,
        })
}

fn load_model_tensors(
    cat: &Catalog,
    shards: &[Arc<DiskFile>],
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<HashMap<String, Region>, OpenError> {
    let ts = cat.model_tensors();
    let mut out = HashMap::with_capacity(ts.len());
    for (i, t) in ts.iter().enumerate() {
        let f = shard_of(shards, t)?;
        let r = if t.name == k3_proto::names::EMBED {
            // One row per token is read: map it, so only the rows used become resident.
            let m =
                MappedRange::map(f.path(), t.off, t.nbytes).map_err(|source| OpenError::Read {
                    what: t.name.clone(),
                    source,
                })?;
            let owner: Arc<dyn ByteOwner> = Arc::new(m);
            Region::whole(owner)
        } else {
            let (buf, inner) =
                f.read_region(t.off, t.nbytes)
                    .map_err(|source| OpenError::Read {
                        what: t.name.clone(),
                        source,
                    })?;
            let owner: Arc<dyn ByteOwner> = Arc::new(buf);
            Region::new(owner, inner, t.nbytes as usize)
                .ok_or_else(|| OpenError::Window(t.name.clone()))?
        };
        out.insert(t.name.clone(), r);
        progress("model tensors", i + 1, ts.len());
    }
    Ok(out)
}

impl WeightSource for StandaloneSource {
    fn max_expert_batch(&self) -> usize {
        self.plan.expert_slots.max(1)
    }

    fn overlap_expert_groups(&self) -> bool {
        // One job owns every slot: with a batch of at most half of them held, the other half
        // (minus reads in flight, which finish) is free for the next group.
        true
    }

    fn tensor_rows(
        &self,
        name: &str,
        row_bytes: usize,
        ids: &[u32],
        out: &mut Vec<u8>,
    ) -> Result<(), SourceError> {
        let Some((file, off, nbytes)) = self
            .embed
            .as_ref()
            .filter(|_| k3_proto::names::canonical(name) == k3_proto::names::EMBED)
        else {
            return crate::runtime::source::copy_rows(
                &self.model_tensor(name)?,
                name,
                row_bytes,
                ids,
                out,
            );
        };
        out.clear();
        out.resize(ids.len() * row_bytes, 0);
        for (&id, dst) in ids.iter().zip(out.chunks_exact_mut(row_bytes.max(1))) {
            let at = (id as u64)
                .checked_mul(row_bytes as u64)
                .filter(|o| o + row_bytes as u64 <= *nbytes)
                .ok_or_else(|| SourceError::Invalid(format!("row {id} of {name}: outside it")))?;
            std::os::unix::fs::FileExt::read_exact_at(file, dst, off + at).map_err(|source| {
                SourceError::File {
                    what: format!("row {id} of {name}"),
                    source,
                }
            })?;
        }
        Ok(())
    }

    fn model_tensor(&self, name: &str) -> Result<Region, SourceError> {
        let name = k3_proto::names::canonical(name);
        self.model
            .get(name.as_ref())
            .cloned()
            .ok_or_else(|| SourceError::Missing(format!("model tensor {name}")))
    }

    fn layer(&self, l: usize) -> Result<LayerRun, SourceError> {
        if l >= self.stream.n_layers() {
            return Err(SourceError::Invalid(format!(
                "layer {l} out of range ({} layers)",
                self.stream.n_layers()
            )));
        }
        self.stream.layer(l)
    }

    fn prefetch_layer(&self, l: usize) {
        self.stream.prefetch(l);
    }

    fn experts(&self, l: usize, ids: &[u32]) -> Result<ExpertBatch, SourceError> {
        self.experts.get(l, ids)
    }

    fn prefetch_experts(&self, l: usize, ids: &[u32]) {
        let (cache, ids) = (self.experts.clone(), ids.to_vec());
        // A request of layer l from now on makes the prefetch late, even before it starts.
        let since = cache.demands(l);
        let latest = self.latest_prefetch.clone();
        let me = latest.fetch_add(1, Ordering::SeqCst) + 1;
        self.prefetcher.submit(
            move || {
                if latest.load(Ordering::SeqCst) == me {
                    cache.prefetch(l, &ids, since);
                }
            },
            // A prediction is never needed: a failed prefetch only costs its reads.
            |_| {},
        );
    }

    fn resident_layer(&self, l: usize) -> Option<LayerRun> {
        self.stream.pinned_layer(l)
    }

    fn releases_layers_early(&self, l: usize) -> bool {
        self.stream.streams(l)
    }

    fn resident_experts(&self, l: usize, ids: &[u32]) -> ExpertBatch {
        self.experts.resident(l, ids)
    }

    fn request_experts(&self, l: usize, ids: &[u32]) -> PendingExperts {
        // All hits: answer here. A hand-off to the fetch thread and back costs two thread
        // wake-ups per MoE layer, far more than the lookups, and with nothing to read there is
        // nothing to overlap. If an expert is evicted between the check and `get` (by a
        // prefetch), `get` reads it here: slower, same answer.
        if self.experts.all_resident(l, ids) {
            return PendingExperts::ready(self.experts.get(l, ids));
        }
        let (cache, ids) = (self.experts.clone(), ids.to_vec());
        PendingExperts::on_pool(&self.fetch, move || cache.get(l, &ids))
    }

    fn trunk(&self) -> k3_proto::wire::TrunkInfo {
        self.trunk.clone()
    }

    fn stats(&self) -> SourceStats {
        let c = self.experts.stats();
        let s = self.stream.stats();
        SourceStats {
            expert_requests: c.table.requests,
            resident_hits: c.table.resident_hits,
            misses: c.table.misses,
            evictions: c.table.evictions,
            failed_expert_loads: c.table.failed_loads,
            expert_bytes_read: c.bytes_read,
            expert_read_seconds: c.read_seconds,
            trunk_bytes_read: s.ring.bytes_read,
            trunk_read_seconds: s.ring.read_seconds,
            io_wait_seconds: s.ring.wait_seconds + c.wait_seconds,
            trunk_wait_seconds: s.ring.wait_seconds,
            // Loads whose reads are done, like their bytes: a prefetch still reading when the
            // report is taken (the last pass's prediction of a next pass) is in neither.
            prefetch_loads: c.prefetch_loads,
            prefetch_bytes: c.prefetch_bytes,
            prefetch_used: c.table.prefetch_used,
            prefetch_dropped: c.table.prefetch_dropped,
            // Reported for the store's ring only (a private stream's hand-outs are its own).
            trunk_layers_served: 0,
            trunk_shared_layers: 0,
            // Only an attached job reads around a store's stuck worker.
            private_expert_reads: 0,
            preloaded_experts: c.table.preloaded,
            preload_bytes: c.preload_bytes,
            preload_seconds: c.preload_seconds,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::{self, Spec};
    use crate::runtime::plan::BudgetFlag;

    fn inputs(spec: &Spec) -> impl Fn(&Catalog, &TrunkLayout) -> PlanInputs + '_ {
        move |cat, trunk| PlanInputs {
            resident_bytes: cat.model_tensors().iter().map(|t| t.nbytes).sum(),
            mapped_bytes: 0,
            layer_bytes: (0..trunk.n_layers()).map(|l| trunk.buf_len(l)).collect(),
            expert_bytes: spec.layout.expert_bytes() as u64,
            expert_slot_bytes: crate::runtime::experts::ExpertReader::slot_stride(&spec.layout)
                as u64,
            top_k: 2,
            total_experts: usize::MAX,
            state: crate::runtime::plan::StateBytes {
                bytes: 3 * 1000 + 64 * 16,
                sequences: 1,
                positions: 16,
            },
            buffer_bytes: 4096,
            process_bytes: 0,
        }
    }

    #[test]
    fn serves_model_trunk_and_experts_and_counts() {
        let spec = Spec::small(4, 6);
        let w = fixture::write(&spec, "standalone");
        let cat = Arc::new(w.catalog.clone());
        let stride = crate::runtime::experts::ExpertReader::slot_stride(&spec.layout) as f64;
        // Trunk budget: layer 0 pinned + a ring of the largest other layer; cache: 3 slots.
        let t = TrunkLayout::from_catalog(&w.catalog, open_shards(&w.catalog).unwrap());
        let trunk = t.buf_len(0) + (1..4).map(|l| t.buf_len(l)).max().unwrap();
        let budget = Budget::from_flags(&[
            BudgetFlag::TrunkGb(trunk as f64 / 1e9),
            BudgetFlag::CacheGb(3.5 * stride / 1e9),
        ])
        .unwrap();
        let opts = StandaloneOptions {
            check_memory: true,
            ..Default::default()
        };
        let mut seen = Vec::new();
        let (src, plan) = StandaloneSource::build(
            cat,
            None,
            &budget,
            &opts,
            &inputs(&spec),
            &mut |what, d, t| seen.push((what.to_string(), d, t)),
        )
        .unwrap();
        assert_eq!(plan.expert_slots, 3);
        let largest = TrunkStream::min_ring_bytes(&t, 1);
        assert_eq!(
            (plan.pinned_layers, plan.ring_bytes),
            (1, largest),
            "{plan}"
        );
        let [t, c] = src.describe();
        assert!(
            t.contains("1/4 layers PINNED") && t.contains("ring "),
            "{t}"
        );
        assert!(
            c.contains("3 slots") && c.contains(crate::runtime::policy::DEFAULT_POLICY),
            "{c}"
        );
        assert!(seen.iter().any(|(w, d, t)| w == "model tensors" && d == t));
        for (n, _, _) in fixture::model_tensors(&spec) {
            let r = src.model_tensor(&n).unwrap();
            assert!(r.bytes() == &fixture::expected_tensor(&spec, &n)[..]);
        }
        assert!(matches!(
            src.model_tensor("language_model.model.nope"),
            Err(SourceError::Missing(_))
        ));
        // The last layer is held until the byte count below: the ring has room for one layer, so
        // the reader cannot read ahead into the next pass meanwhile.
        let mut last = None;
        for pass in 0..2 {
            for l in 0..4 {
                let run = src.layer(l).unwrap();
                if l + 1 < 4 {
                    src.prefetch_layer(l + 1);
                }
                for (n, _, _) in fixture::trunk_tensors(&spec, l) {
                    let loc = run.layout.get(&n).unwrap();
                    assert!(
                        run.region.bytes()[loc.off as usize..(loc.off + loc.nbytes) as usize]
                            == fixture::expected_tensor(&spec, &n)[..]
                    );
                }
                if l >= 1 {
                    let ids = [(pass + l) as u32 % 6, 5];
                    let b = src.experts(l, &ids).unwrap();
                    for (e, r) in ids.iter().zip(&b.experts) {
                        assert!(
                            r.as_ref().unwrap().bytes()
                                == &fixture::expert_bytes(&spec, l, *e as usize)[..]
                        );
                    }
                }
                if pass == 1 && l == 3 {
                    last = Some(run);
                }
            }
        }
        assert!(matches!(src.layer(4), Err(SourceError::Invalid(_))));
        assert!(matches!(src.experts(1, &[6]), Err(SourceError::Invalid(_))));
        let s = src.stats();
        assert_eq!(s.expert_requests, 12);
        assert_eq!(s.resident_hits + s.misses, 12);
        assert_eq!(
            s.expert_bytes_read,
            s.misses * spec.layout.expert_bytes() as u64
        );
        let ring_layers: u64 = (plan.pinned_layers..4)
            .map(|l| w.catalog.trunk_bytes(l))
            .sum();
        assert_eq!(s.trunk_bytes_read, 2 * ring_layers);
        drop(last);
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    fn refuses_a_plan_that_does_not_fit_and_a_changed_shard() {
        let spec = Spec::small(3, 4);
        let w = fixture::write(&spec, "refuse");
        let cat = Arc::new(w.catalog.clone());
        let budget =
            Budget::from_flags(&[BudgetFlag::TrunkGb(1.0), BudgetFlag::CacheGb(100_000.0)])
                .unwrap();
        let e = StandaloneSource::build(
            cat.clone(),
            None,
            &budget,
            &StandaloneOptions::default(),
            &inputs(&spec),
            &mut |_, _, _| {},
        )
        .unwrap_err();
        assert_eq!(k3_proto::exit::ExitStatus::exit_code(&e), 2);
        let m = e.to_string();
        assert!(m.contains("shortfall") && m.contains("TOTAL"), "{m}");
        // A shard that changed size since indexing is refused before any read.
        let p = &w.catalog.shard_paths()[1];
        let len = std::fs::metadata(p).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(p)
            .unwrap()
            .set_len(len - 1)
            .unwrap();
        let budget = Budget::from_flags(&[BudgetFlag::Preset("laptop".into())]).unwrap();
        let e = StandaloneSource::build(
            cat,
            None,
            &budget,
            &StandaloneOptions::default(),
            &inputs(&spec),
            &mut |_, _, _| {},
        )
        .unwrap_err();
        assert!(e.to_string().contains("when indexed"), "{e}");
        std::fs::remove_dir_all(&w.dir).unwrap();
    }
}
