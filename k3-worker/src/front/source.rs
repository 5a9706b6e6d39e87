//! Where a job's weights come from: attach to the store, or open the checkpoint in-process,
//! each after reading the config and the checkpoint index once, with the memory plan the engine
//! states ([`EnginePlan`]) checked before anything is allocated (exit 2 when it does not fit).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use k3_proto::config::ModelConfig;
use k3_store::attach::{AttachOptions, AttachedSource};
use k3_store::runtime::catalog::Catalog;
use k3_store::runtime::plan::{self, fmt_bytes, PlanInputs, StateBytes};
use k3_store::runtime::source::WeightSource;
use k3_store::runtime::standalone::{StandaloneOptions, StandaloneSource};

use crate::engine::memory::EnginePlan;
use crate::front::cli::Cli;
use crate::front::error::{refuse, JobError};
use crate::model::bind::ShapeTable;
use crate::model::Dims;

/// Where the weights come from.
pub enum Source {
    /// The store's shared memory.
    Attached(Box<AttachedSource>),
    /// In-process.
    Standalone(Box<StandaloneSource>),
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Source::Attached(_) => "Source::Attached",
            Source::Standalone(_) => "Source::Standalone",
        })
    }
}

impl Source {
    /// The source as the engine sees it.
    pub fn weights(&self) -> &dyn WeightSource {
        match self {
            Source::Attached(s) => s.as_ref(),
            Source::Standalone(s) => s.as_ref(),
        }
    }

    /// The store, when attached (sessions, progress).
    pub fn store(&self) -> Option<&AttachedSource> {
        match self {
            Source::Attached(s) => Some(s),
            Source::Standalone(_) => None,
        }
    }
}

/// The opened source, its checkpoint's dims, what its index says, and the plan.
#[derive(Debug)]
pub struct Opened {
    /// The source.
    pub source: Source,
    /// Checkpoint directory.
    pub model_dir: PathBuf,
    /// Dimensions (truncated by --layers).
    pub dims: Dims,
    /// Positions a slot is planned for.
    pub positions: usize,
    /// The stored dtype and shape of every tensor the model binds (from the one read of the
    /// checkpoint index).
    pub shapes: ShapeTable,
    /// The checkpoint's catalog, when a draft model needs it (the standalone source's own).
    pub catalog: Option<Arc<Catalog>>,
    /// The memory this job plans to hold at its peak (its resident memory then), bytes.
    pub plan_bytes: u64,
}

/// What the job plans for: the engine's shape, and how many distinct embedding rows its
/// sequences may read (`usize::MAX`: any, a worker serving jobs for as long as it lives).
#[derive(Clone, Copy, Debug)]
pub struct JobShape {
    /// The engine's plan.
    pub engine: EnginePlan,
    /// Positions whose ids the job may embed in all.
    pub embedded: usize,
    /// The job scores a text (`--perplexity`): its passes return every row's logits
    /// ([`crate::eval::pass_bytes`]) instead of the engine's.
    pub scoring: bool,
    /// `--prefill-chunk auto`: [`open_source`] sizes `engine.prefill_rows` from the plan.
    pub auto_prefill: bool,
}

impl JobShape {
    /// The buffers of the job's largest pass.
    pub fn pass_bytes(&self, d: &Dims) -> u64 {
        if self.scoring {
            crate::eval::pass_bytes(d, self.engine.positions)
        } else {
            self.engine.pass_bytes(d)
        }
    }
}

/// Read the config of `model_dir` (truncated to `--layers`) and its dims.
fn config(cli: &Cli, model_dir: &Path) -> Result<(ModelConfig, Dims), JobError> {
    let cfg_path = model_dir.join("config.json");
    let mut cfg = ModelConfig::load(&cfg_path).map_err(|source| JobError::Config {
        path: cfg_path.clone(),
        source,
    })?;
    if let Some(n) = cli.layers {
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        if n > cfg.num_hidden_layers {
            return Err(JobError::Layers {
                asked: n,
                has: cfg.num_hidden_layers,
            });
        }
        cfg = cfg.with_layers(n);
    }
    let dims = Dims::from_config(&cfg).map_err(|source| JobError::Dims {
        path: cfg_path.clone(),
        source,
    })?;
    tracing::info!(
        "config: {} ({} shape) | hidden={} layers={} vocab={} | {} MLA + {} KDA ({}) | experts {} top{} shared{} | latent={}",
        cfg_path.display(),
        cfg.shape.name(),
        dims.hidden,
        dims.n_layers,
        dims.vocab,
        dims.n_mla(),
        dims.n_kda(),
        dims.layer_map(),
        dims.n_experts,
        dims.top_k,
        dims.n_shared,
        dims.latent
    );
    Ok((cfg, dims))
}

/// The config and the index of `model_dir`, each read once: the dims (truncated by `--layers`),
/// the shape table the binder checks, and the catalog (built when `catalog`).
fn read_checkpoint(
    cli: &Cli,
    model_dir: &Path,
    catalog: bool,
) -> Result<(ModelConfig, Dims, ShapeTable, Option<Catalog>), JobError> {
    let (cfg, dims) = config(cli, model_dir)?;
    let checkpoint = |e: &dyn std::fmt::Display| JobError::Checkpoint {
        dir: model_dir.to_path_buf(),
        problem: e.to_string(),
    };
    let index = k3_proto::safetensors::CheckpointIndex::open(model_dir).map_err(|source| {
        JobError::Index {
            dir: model_dir.to_path_buf(),
            source,
        }
    })?;
    let cat = if catalog {
        // Standalone, this is the first read of the headers: every tensor the engine binds is
        // held to the config's dtype and shape here (exit 2 naming it), as `k3-store start` does.
        k3_proto::tensors::check(&cfg, &index).map_err(|e| checkpoint(&e))?;
        Some(Catalog::from_index(&index, &cfg).map_err(|e| checkpoint(&e.0))?)
    } else {
        None
    };
    let shapes = ShapeTable::from_index(&index, dims.n_layers);
    Ok((cfg, dims, shapes, cat))
}

/// The sequence states an engine of `shape` holds, for the plan's display.
fn state_bytes(shape: &JobShape, d: &Dims) -> StateBytes {
    let e = &shape.engine;
    StateBytes {
        bytes: e.state_budget(d),
        sequences: e.slots,
        positions: e.positions,
    }
}

/// Attach to the store, or open the checkpoint in-process with the memory plan; either way the
/// config and the index are read once, and the plan counts what this process held before it,
/// the sequence states and the passes' buffers as the engine states them, and the draft trunk
/// this process loads, and refuses (exit 2) when that does not fit the memory or the address
/// space the process may still take.
///
/// `catalog`: the job runs a draft model (whose identity check reads the catalog);
/// `own_draft`: the draft trunk this process loads itself (`--draft-trunk DIR`), counted in
/// its buffers.
pub fn open_source(
    cli: &Cli,
    matches: &clap::ArgMatches,
    shape: &mut JobShape,
    catalog: bool,
    own_draft: Option<&Path>,
) -> Result<Opened, JobError> {
    let positions = shape.engine.positions;
    let Some(model_dir) = &cli.standalone else {
        return attach(cli, shape, catalog, own_draft);
    };
    let (cfg, dims, shapes, cat) = read_checkpoint(cli, model_dir, true)?;
    let cat = Arc::new(cat.expect("read with its catalog"));
    let budget = cli.budget.budget(matches)?;
    size_prefill(shape, &dims, &budget)?;
    let state = state_bytes(shape, &dims);
    let opts = StandaloneOptions {
        state: state.clone(),
        extra_buffer_bytes: shape.pass_bytes(&dims) + draft_trunk_bytes(own_draft, &dims)?,
        cache_policy: cli.budget.policy(),
        preload: cli.budget.preload,
        ..StandaloneOptions::default()
    };
    let mut steps = k3_store::progress::Steps::default();
    let (src, plan) = StandaloneSource::build(
        cat.clone(),
        cli.budget.trunk.as_deref(),
        &budget,
        &opts,
        &|cat, trunk| {
            PlanInputs::from_model(&cfg, cat, trunk, state.clone())
                .plus_buffers(opts.extra_buffer_bytes)
        },
        &mut |what, done, total| steps.update(what, done, total),
    )?;
    // The plan's first line is its header: printed once.
    tracing::info!("{}", plan.to_string().trim_end());
    Ok(Opened {
        source: Source::Standalone(Box::new(src)),
        model_dir: model_dir.clone(),
        dims,
        positions,
        shapes,
        catalog: Some(cat),
        plan_bytes: plan.total_bytes(),
    })
}

/// Attach to the store: the store holds the weights and streams the unpinned layers through its
/// own ring (SPEC.md §6.8); this process allocates only the sequence states and the passes'
/// buffers, and the pages of the store's shared memory it reads count in its resident memory.
fn attach(
    cli: &Cli,
    shape: &mut JobShape,
    catalog: bool,
    own_draft: Option<&Path>,
) -> Result<Opened, JobError> {
    let socket = cli.socket.path();
    let (src, info) =
        AttachedSource::attach(&socket, &AttachOptions::default()).map_err(|source| {
            JobError::Attach {
                socket: socket.clone(),
                source,
            }
        })?;
    tracing::info!(
        "attached to {} in {:.3} s: model {}, {} pinned layers, {} shared, {} expert slots, store ring {}",
        socket.display(),
        info.attach_seconds,
        info.model_dir.display(),
        info.pinned_layers,
        fmt_bytes(info.shm_bytes),
        info.slots,
        fmt_bytes(info.ring_bytes)
    );
    let (_, dims, shapes, cat) = read_checkpoint(cli, &info.model_dir, catalog)?;
    // The store holds the weights: the prefill is allowed auto's share of this process's memory.
    size_prefill(shape, &dims, &plan::Budget::auto())?;
    let plan = AttachedPlan {
        process: plan::resident_now(),
        shared: shared_read_bytes(&dims, info.shm_bytes, shape.embedded),
        state: shape.engine.state_budget(&dims),
        buffers: shape.pass_bytes(&dims) + draft_trunk_bytes(own_draft, &dims)?,
    };
    plan.check()?;
    tracing::info!("memory plan:\n{plan}");
    Ok(Opened {
        source: Source::Attached(Box::new(src)),
        model_dir: info.model_dir.clone(),
        dims,
        positions: shape.engine.positions,
        shapes,
        catalog: cat.map(Arc::new),
        plan_bytes: plan.total(),
    })
}

/// `--prefill-chunk auto`: the longest chunk whose pass fits what `budget` allows a prefill
/// (`Budget::prefill_allowance`; the memory this process may allocate is read only for
/// `--preset auto`); the fixed default chunk when the budget allows nothing in particular.
fn size_prefill(shape: &mut JobShape, d: &Dims, budget: &plan::Budget) -> Result<(), JobError> {
    if !shape.auto_prefill {
        return Ok(());
    }
    let avail = match budget.auto {
        true => Some(plan::allocatable().map_err(plan::PlanError::from)?),
        false => None,
    };
    let Some(allowance) = budget.prefill_allowance(avail) else {
        tracing::info!(
            "prefill chunk: {} rows (the default: the budget names no prefill allowance)",
            shape.engine.prefill_budget()
        );
        return Ok(());
    };
    let e = &mut shape.engine;
    e.prefill_rows = e.auto_prefill_rows(d, allowance);
    tracing::info!(
        "prefill chunk: {} rows (auto: the longest whose pass, {}, fits the {} the plan allows a prefill, at least the default's)",
        e.prefill_rows,
        fmt_bytes(e.pass_bytes(d)),
        fmt_bytes(allowance)
    );
    Ok(())
}

/// Bytes of the draft trunk in `dir` this process reads into its memory (`--draft-trunk DIR`;
/// 0 without one), read from `draft.json` before anything loads.
fn draft_trunk_bytes(dir: Option<&Path>, d: &Dims) -> Result<u64, JobError> {
    let Some(dir) = dir else {
        return Ok(0);
    };
    let (kind, bytes) = k3_store::runtime::draft::DraftSource::probe(dir, d.n_layers)
        .map_err(|e| refuse(e.to_string()))?;
    tracing::info!(
        "draft model: {} trunk {}, held in this process",
        kind.name(),
        fmt_bytes(bytes)
    );
    Ok(bytes)
}

/// Of the store's shared memory (`shm` bytes), what an attached worker's reads make resident in
/// it: all of it but the embedding, of which only the rows of the `positions` ids are read. A
/// read fault on shared memory maps the 64 KiB window around the page (the kernel's
/// fault-around, `fault_around_bytes`), so a row costs the windows it spans, one more when it
/// straddles a window's end.
fn shared_read_bytes(dims: &Dims, shm: u64, positions: usize) -> u64 {
    const FAULT_AROUND: u64 = 64 << 10;
    let row = 2 * dims.hidden as u64;
    let embed = row * dims.vocab as u64;
    let rows = (positions as u64).saturating_mul((row.div_ceil(FAULT_AROUND) + 1) * FAULT_AROUND);
    shm.saturating_sub(embed) + rows.min(embed)
}

/// An attached worker's memory plan: what the process held before it, the store's shared memory
/// its reads make resident in it ([`shared_read_bytes`]), the sequence states and the passes'
/// buffers.
struct AttachedPlan {
    process: u64,
    shared: u64,
    state: u64,
    buffers: u64,
}

impl AttachedPlan {
    /// The resident memory at the peak.
    fn total(&self) -> u64 {
        self.process + self.shared + self.state + self.buffers
    }

    /// Refuse when the states and buffers do not fit the memory or the address space left (the
    /// shared memory is mapped already: the store allocated it).
    fn check(&self) -> Result<(), plan::PlanError> {
        let need = self.state + self.buffers;
        let avail = plan::allocatable()?;
        let mut problems = Vec::new();
        if need > avail {
            problems.push(format!(
                "the sequence states and buffers need {} but this process may allocate only {}: shortfall {}",
                plan::fmt_bytes(need),
                plan::fmt_bytes(avail),
                plan::fmt_bytes(need - avail)
            ));
        }
        // Its threads: the compute pool's, the main one and the expert fetch thread.
        let reserve = plan::address_space_reserve(rayon::current_num_threads() + 2);
        problems.extend(plan::address_space_problem(need + reserve));
        plan::refusal(self, &problems)
    }
}

impl std::fmt::Display for AttachedPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "memory plan (attached):")?;
        for (name, b, note) in [
            (
                "store memory",
                self.shared,
                "the store's shared memory, read in place",
            ),
            (
                "state",
                self.state,
                "KDA state + MLA latent cache, every slot",
            ),
            (
                "buffers",
                self.buffers,
                "activations, logits, verify journals, draft model",
            ),
            ("process", self.process, "resident before the plan"),
            ("TOTAL", self.total(), ""),
        ] {
            writeln!(f, "  {name:<16}{:>12}   {note}", plan::fmt_bytes(b))?;
        }
        Ok(())
    }
}
