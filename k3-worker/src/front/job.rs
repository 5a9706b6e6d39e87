//! The job wiring every front end shares, in stages: [`preflight`] (what can be refused before
//! any work: the SIMD tier, the sampler, the threads, the tokenizer, the speculation flags, the
//! outputs writable), [`job_shape`] (what the engine is planned for), [`prepare`] (the memory
//! plan and the source, [`crate::front::source`]), then [`Prepared`]: the model bound once and
//! the drafters, for the front end — a one-shot prompt, a chat, a `--batch` file or jobs from
//! `k3-ctl serve` — to feed the one engine ([`crate::engine`]) with typed requests.

use std::path::Path;
use std::time::Instant;

use k3_store::runtime::plan;

use crate::engine::memory::{prefill_rows, EnginePlan, PrefillChunk};
use crate::engine::sampling::{positions_needed, Sampler};
use crate::front::cli::{Cli, MAX_GEN, MAX_PROMPT};
use crate::front::drafters::{DraftAt, DraftFlags, Drafters};
use crate::front::error::{refuse, JobError};
use crate::front::source::{open_source, JobShape, Opened};
use crate::model::{Model, TensorShapes};
use crate::tokenizer::Tokenizer;

/// Everything every front end checks before any work.
#[derive(Debug)]
pub struct Preflight {
    /// The sampler the command line asks for.
    pub sampler: Sampler,
    /// The tokenizer, when given.
    pub tok: Option<Tokenizer>,
    /// The speculation flags.
    pub drafts: DraftFlags,
}

/// Checks and set-up that need neither the store nor the checkpoint: SIMD tier, sampler, thread
/// pool (bounded by the CPUs), tokenizer, the speculation flags, and that every output path is
/// writable. Each front end then reads and checks its own input.
pub fn preflight(cli: &Cli) -> Result<Preflight, JobError> {
    // Before any thread: the allocator's arenas are bounded, so the address space the memory
    // plan checks is what the job will take (k3_store::runtime::plan::ADDRESS_SPACE_RESERVE).
    plan::limit_allocator_arenas();
    // The SIMD tier is chosen once, here: a forced tier (K3_SIMD) that is unknown or that this
    // CPU lacks is a refusal, never a crash or a silent fallback.
    let tier = crate::kernels::select_tier().map_err(refuse)?;
    tracing::info!("kernels: {} tier", tier.name());
    // So are the platform paths (K3_SHM, K3_DISK_IO).
    k3_store::sys::platform_paths().map_err(|e| refuse(e.to_string()))?;
    let sampler = Sampler::new(cli.temperature, cli.top_p, cli.seed)?;
    if let Some(t) = cli.threads {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
        if t > cpus {
            return Err(refuse(format!(
                "--threads {t} exceeds the {cpus} CPUs this process may use"
            )));
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(t as usize)
            .build_global()
            .map_err(|e| refuse(format!("--threads {t}: {e}")))?;
    }
    for path in [&cli.out, &cli.dump_logits, &cli.save_logprobs]
        .into_iter()
        .flatten()
    {
        check_writable_file(path)?;
    }
    for dir in [&cli.dump_cache_trace, &cli.dump_hidden]
        .into_iter()
        .flatten()
    {
        check_writable_dir(dir)?;
    }
    let tok = match &cli.tok {
        Some(dir) => Some(
            Tokenizer::from_dir(dir).map_err(|source| JobError::Tokenizer {
                dir: dir.clone(),
                source,
            })?,
        ),
        None => None,
    };
    let drafts = DraftFlags::from_cli(cli)?;
    Ok(Preflight {
        sampler,
        tok,
        drafts,
    })
}

fn check_writable_file(path: &Path) -> Result<(), JobError> {
    let out = |source| JobError::Output {
        path: path.to_path_buf(),
        source,
        before_work: true,
    };
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(out)?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

fn check_writable_dir(dir: &Path) -> Result<(), JobError> {
    let out = |source| JobError::Output {
        path: dir.to_path_buf(),
        source,
        before_work: true,
    };
    std::fs::create_dir_all(dir).map_err(out)?;
    tempfile::tempfile_in(dir).map_err(out)?;
    Ok(())
}

/// The most positions one sequence of a serve worker may take: the longest prompt serve
/// accepts and the longest reply.
pub fn serve_longest() -> usize {
    positions_needed(MAX_PROMPT, MAX_GEN as usize)
}

/// `--parallel` of `--batch` when not given.
pub const DEFAULT_PARALLEL: u64 = 4;

/// What a job's engine is planned for: `slots` sequences of `positions`, one of up to
/// `longest`, with the prefill chunk, the drafts and the dumps the flags ask for; `embedded`:
/// the positions whose ids it may embed in all.
pub fn job_shape(
    cli: &Cli,
    pre: &Preflight,
    slots: usize,
    positions: usize,
    longest: usize,
    embedded: usize,
) -> JobShape {
    JobShape {
        engine: EnginePlan {
            slots,
            positions,
            longest,
            prefill_rows: prefill_rows(cli.prefill_chunk.rows_or_default(), longest),
            drafts: pre.drafts.max_drafts(),
            draft_model: pre.drafts.wants_model(),
            keep_step0_logits: cli.dump_logits.is_some(),
        },
        embedded,
        scoring: false,
        auto_prefill: cli.prefill_chunk == PrefillChunk::Auto,
    }
}

/// A job's opened source, bound model and drafters, ready for its front end.
#[derive(Debug)]
pub struct Prepared {
    /// The checks' results.
    pub pre: Preflight,
    /// The source and the plan.
    pub opened: Opened,
    /// The engine's shape.
    pub shape: JobShape,
    /// When the job started.
    pub wall: Instant,
}

impl Prepared {
    /// The model over the opened source, its feed options from the environment (bound once;
    /// layers at their first pass).
    pub fn model(&self) -> Result<Model<'_>, JobError> {
        let o = &self.opened;
        let mut m = Model::new(
            o.dims.clone(),
            o.source.weights(),
            Some(&o.shapes as &dyn TensorShapes),
        )?;
        m.options = crate::model::feed::FeedOptions::from_env()?;
        Ok(m)
    }

    /// The drafters (the draft model loaded when the flags ask for one).
    pub fn drafters(&self, cli: &Cli) -> Result<Drafters, JobError> {
        let o = &self.opened;
        let at = DraftAt {
            dims: &o.dims,
            positions: o.positions,
            catalog: o.catalog.as_deref(),
            store: o.source.store(),
            target: o.source.weights(),
        };
        Drafters::load(cli, self.pre.drafts.clone(), &at)
    }
}

/// The plan and the source for a job of `shape`, after its preflight: everything before the
/// engine runs.
pub fn prepare(
    cli: &Cli,
    matches: &clap::ArgMatches,
    pre: Preflight,
    mut shape: JobShape,
    wall: Instant,
) -> Result<Prepared, JobError> {
    let own_draft = cli
        .draft_trunk
        .as_deref()
        .filter(|_| pre.drafts.wants_model());
    let opened = open_source(
        cli,
        matches,
        &mut shape,
        pre.drafts.wants_model(),
        own_draft,
    )?;
    if cli.session.is_some() && opened.source.store().is_none() {
        return Err(refuse(
            "--session keeps the conversation in a store: it needs attached mode",
        ));
    }
    tracing::info!(
        "sequence state: {} positions a slot -> MLA latent cache {} ({} B/position over {} layers) + KDA state {}",
        opened.positions,
        plan::fmt_bytes(opened.dims.mla_cache_bytes(opened.positions as u64)),
        opened.dims.mla_cache_bytes(1),
        opened.dims.n_mla(),
        plan::fmt_bytes(opened.dims.kda_state_bytes())
    );
    // A quantized trunk: every output of the run says so (the log here, the report, --out).
    let trunk = opened.source.weights().trunk();
    if trunk.is_lossy() {
        tracing::warn!("{}", trunk.lossy);
    }
    Ok(Prepared {
        pre,
        opened,
        shape,
        wall,
    })
}
