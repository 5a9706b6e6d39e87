//! One `k3-worker` job, in stages: [`preflight`] (everything that can be refused before any work),
//! [`open_source`] (attach to the store or open the checkpoint in-process), [`bind`] (config,
//! memory check, the bound-once engine), then one-shot generation or chat on the one generation
//! loop ([`crate::generate::Session`]), and the report ([`crate::report`]).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use k3_proto::config::ModelConfig;
use k3_proto::exit;
use k3_store::attach::{AttachError, AttachOptions, AttachedSource};
use k3_store::runtime::source::WeightSource;
use k3_store::runtime::standalone::{OpenError, StandaloneOptions, StandaloneSource};

use crate::chat::Effort;
use crate::cli::DraftArg;
use crate::cli::{Cli, MAX_PROMPT, MAX_PROMPT_FILE};
use crate::generate::{positions_needed, Flow, GenOptions, Sampler, Session, END_IDS};
use crate::model::bind::ShapeTable;
use crate::model::state::{Journal, PassShape, SeqState, Work};
use crate::model::{Dims, Model, ModelError, TensorShapes};
use crate::report::{self, HiddenDump};
use crate::sink::{Sink, Stdout};
use crate::spec::{
    Drafter, FirstOf, HistoryDrafter, ModelDrafter, NgramDrafter, ReplayDrafter, SpecMode,
};
use crate::tokenizer::Tokenizer;
use k3_store::runtime::catalog::Catalog;
use k3_store::runtime::draft::DraftSource;
use k3_store::runtime::plan::{self, fmt_bytes, PlanInputs};
use k3_store::runtime::trunk::TrunkError;
use std::sync::Arc;

/// Why a job stopped, with its exit code ([`k3_proto::exit::ExitStatus`]).
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// Refused before any work (exit 2).
    #[error("{0}")]
    Refused(String),
    /// An input file could not be read (exit 2).
    #[error("{path}")]
    Input {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An output path is not writable (checked before work: exit 2; after: exit 1).
    #[error("cannot write {path}")]
    Output {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
        /// True when found before any work.
        before_work: bool,
    },
    /// Cannot attach to the store (exit 3).
    #[error("{socket}: {source}")]
    Attach {
        /// The store's socket.
        socket: PathBuf,
        /// Why.
        #[source]
        source: AttachError,
    },
    /// The standalone source could not be opened (exit 2 or 1).
    #[error(transparent)]
    Open(#[from] OpenError),
    /// Binding or running the model failed (exit 1).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The draft trunk could not be read (exit 1).
    #[error("draft trunk: {0}")]
    DraftIo(String),
    /// An environment variable has a value it cannot take (exit 2).
    #[error(transparent)]
    Env(#[from] k3_proto::paths::EnvError),
    /// The memory flags give no budget (exit 2).
    #[error(transparent)]
    Budget(#[from] plan::BudgetError),
    /// The memory plan does not fit (exit 2).
    #[error(transparent)]
    Plan(#[from] plan::PlanError),
    /// Scoring a text (`--perplexity`) failed: its base file refused (exit 2), a read or write
    /// (exit 1), the model (its code), an interrupt (exit 1).
    #[error(transparent)]
    Eval(#[from] crate::eval::EvalError),
}

impl k3_proto::exit::ExitStatus for JobError {
    fn exit_code(&self) -> i32 {
        match self {
            JobError::Refused(_) | JobError::Input { .. } => exit::REFUSED,
            JobError::Env(e) => k3_proto::exit::ExitStatus::exit_code(e),
            JobError::Budget(e) => k3_proto::exit::ExitStatus::exit_code(e),
            JobError::Plan(e) => k3_proto::exit::ExitStatus::exit_code(e),
            JobError::Output { before_work, .. } => {
                if *before_work {
                    exit::REFUSED
                } else {
                    exit::FAILURE
                }
            }
            // Cannot attach (3), or this process cannot hold what attaching needs (2).
            JobError::Attach { source, .. } => k3_proto::exit::ExitStatus::exit_code(source),
            JobError::Open(e) => k3_proto::exit::ExitStatus::exit_code(e),
            JobError::Model(e) => e.exit_code(),
            JobError::DraftIo(_) => exit::FAILURE,
            JobError::Eval(crate::eval::EvalError::Model(e)) => e.exit_code(),
            JobError::Eval(crate::eval::EvalError::Logprobs { source, .. })
                if source.is_refusal() =>
            {
                exit::REFUSED
            }
            JobError::Eval(_) => exit::FAILURE,
        }
    }
}

fn refuse(msg: impl std::fmt::Display) -> JobError {
    JobError::Refused(msg.to_string())
}

/// What the job will run.
#[derive(Debug)]
pub enum Input {
    /// One prompt.
    Prompt(Vec<u32>),
    /// A chat; `None` = thinking off.
    Chat(Option<Effort>),
    /// Many prompts decoded together (`--batch`).
    Batch(Vec<crate::batch_job::BatchItem>),
    /// A text scored with teacher forcing (`--perplexity`).
    Perplexity(crate::eval::PplJob),
    /// Jobs from `k3-ctl serve` decoded together (`--serve-channel --parallel N`): up to `seqs`
    /// sequences of up to `positions` each.
    Slots {
        /// Sequences at once.
        seqs: usize,
        /// Positions each may take.
        positions: usize,
    },
}

/// Everything checked before any work.
#[derive(Debug)]
pub struct Preflight {
    /// The sampler.
    pub sampler: Sampler,
    /// The tokenizer, when given.
    pub tok: Option<Tokenizer>,
    /// The input.
    pub input: Input,
    /// The replay drafter's continuation (`--draft-replay`).
    pub replay: Option<Vec<u32>>,
}

/// Checks and set-up that need neither the store nor the checkpoint: SIMD tier, sampler, thread
/// pool (bounded by the CPUs), tokenizer, the input, and that every output path is writable.
pub fn preflight(cli: &Cli) -> Result<Preflight, JobError> {
    // Before any thread: the allocator's arenas are bounded, so the address space the memory
    // plan checks is what the job will take (k3_store::runtime::plan::ADDRESS_SPACE_RESERVE).
    plan::limit_allocator_arenas();
    // The SIMD tier is chosen once, here: a forced tier (K3_SIMD) that is unknown or that this
    // CPU lacks is a refusal, never a crash or a silent fallback.
    let tier = crate::kernels::select_tier().map_err(|e| refuse(e.to_string()))?;
    tracing::info!("kernels: {} tier", tier.name());
    let sampler = Sampler::new(cli.temperature, cli.top_p, cli.seed).map_err(refuse)?;
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
            Tokenizer::from_dir(dir)
                .map_err(|e| refuse(format!("tokenizer {}: {e}", dir.display())))?,
        ),
        None => None,
    };
    let input = if cli.chat {
        let tok = tok
            .as_ref()
            .ok_or_else(|| refuse("--chat needs --tok DIR"))?;
        crate::chat::Markers::from_tokenizer(tok).map_err(refuse)?;
        Input::Chat(if cli.no_think {
            None
        } else {
            Some(cli.effort.map_or(Effort::Max, Effort::from))
        })
    } else if let (true, Some(n), None) = (cli.serve_channel, cli.parallel, &cli.ids) {
        Input::Slots {
            seqs: n as usize,
            positions: cli.ctx as usize,
        }
    } else if let Some(path) = &cli.perplexity {
        Input::Perplexity(perplexity_job(cli, path, tok.as_ref())?)
    } else if let Some(path) = &cli.batch {
        let bytes = read_bounded(path, MAX_PROMPT_FILE)?;
        Input::Batch(crate::batch_job::parse(
            path,
            &bytes,
            tok.as_ref(),
            cli.gen,
        )?)
    } else {
        Input::Prompt(prompt_ids(cli, tok.as_ref())?)
    };
    let replay = draft_replay(cli)?;
    Ok(Preflight {
        sampler,
        tok,
        input,
        replay,
    })
}

/// `--perplexity FILE`: the text read (bounded) and tokenized as user text.
fn perplexity_job(
    cli: &Cli,
    path: &Path,
    tok: Option<&Tokenizer>,
) -> Result<crate::eval::PplJob, JobError> {
    let tok = tok.ok_or_else(|| refuse("--perplexity needs --tok DIR"))?;
    let bytes = read_bounded(path, MAX_PROMPT_FILE)?;
    let ids = tok
        .encode_bytes(&bytes, false)
        .map_err(|e| refuse(format!("cannot tokenize {}: {e}", path.display())))?;
    if ids.is_empty() {
        return Err(refuse(format!("{} has no text to score", path.display())));
    }
    let bos = tok
        .bos_id()
        .ok_or_else(|| refuse("the tokenizer has no bos_token to start each window with"))?;
    Ok(crate::eval::PplJob {
        ids,
        bos,
        window: cli.ppl_window as usize,
        save: cli.save_logprobs.clone(),
        base: cli.kl_base.clone(),
        codec: String::new(),
    })
}

/// The `--draft-replay` continuation, checked with the other drafter flags.
fn draft_replay(cli: &Cli) -> Result<Option<Vec<u32>>, JobError> {
    if !(0.0..=1.0).contains(&cli.draft_miss_rate) {
        return Err(refuse(format!(
            "--draft-miss-rate {} must be in [0, 1]",
            cli.draft_miss_rate
        )));
    }
    match (cli.draft.contains(&DraftArg::Model), &cli.draft_trunk) {
        (true, None) if cli.standalone.is_some() => {
            return Err(refuse("--draft model needs --draft-trunk DIR"))
        }
        (false, Some(_)) => return Err(refuse("--draft-trunk needs model in --draft")),
        _ => {}
    }
    let wants = cli.draft.contains(&DraftArg::Replay);
    let Some(path) = &cli.draft_replay else {
        if wants {
            return Err(refuse("--draft replay needs --draft-replay FILE"));
        }
        return Ok(None);
    };
    if !wants {
        return Err(refuse("--draft-replay needs replay in --draft"));
    }
    let text = String::from_utf8(read_bounded(path, MAX_PROMPT_FILE)?)
        .map_err(|_| refuse(format!("{}: not UTF-8", path.display())))?;
    let ids: Result<Vec<u32>, _> = text
        .split(|c: char| c == ',' || c == '[' || c == ']' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>())
        .collect();
    let ids = ids.map_err(|e| {
        refuse(format!(
            "{}: expected token ids (a JSON list or ids separated by commas or spaces): {e}",
            path.display()
        ))
    })?;
    if ids.is_empty() {
        return Err(refuse(format!("{}: no ids", path.display())));
    }
    Ok(Some(ids))
}

/// The drafters `--draft` names, in order (None with `--spec off`).
fn drafter(
    cli: &Cli,
    replay: Option<&[u32]>,
    prompt_len: usize,
    mut model: Option<ModelDrafter>,
) -> Option<Box<dyn Drafter>> {
    if cli.spec == SpecMode::Off || cli.full_recompute {
        return None;
    }
    let mut list: Vec<Box<dyn Drafter>> = Vec::new();
    for d in &cli.draft {
        match d {
            DraftArg::History => list.push(Box::new(HistoryDrafter::default())),
            DraftArg::Ngram => list.push(Box::new(NgramDrafter)),
            DraftArg::Replay => list.push(Box::new(ReplayDrafter {
                continuation: replay.unwrap_or_default().to_vec(),
                prompt_len,
                miss_rate: cli.draft_miss_rate,
                seed: cli.draft_seed,
            })),
            DraftArg::Model => {
                if let Some(m) = model.take() {
                    list.push(Box::new(m));
                }
            }
        }
    }
    Some(Box::new(FirstOf(list)))
}

/// True when this job runs a draft model (`--draft model`, speculation on).
fn wants_draft_model(cli: &Cli) -> bool {
    cli.spec != SpecMode::Off && !cli.full_recompute && cli.draft.contains(&DraftArg::Model)
}

/// Bytes the draft model will hold in this process (its trunk, unless the store holds it, and
/// its sequence state) for a job of `positions`, read from `draft.json` before anything is
/// loaded; 0 without a draft model.
fn draft_model_bytes(cli: &Cli, dims: &Dims, positions: usize) -> Result<u64, JobError> {
    if !wants_draft_model(cli) {
        return Ok(0);
    }
    let state = ModelDrafter::state_bytes(dims, positions + spec_drafts(cli));
    let Some(dir) = cli.draft_trunk.as_deref() else {
        tracing::info!(
            "draft model: the store's draft trunk + its sequence state {} in this process",
            fmt_bytes(state)
        );
        return Ok(state);
    };
    let (kind, bytes) =
        DraftSource::probe(dir, dims.n_layers).map_err(|e| refuse(e.to_string()))?;
    tracing::info!(
        "draft model: {} trunk {} + its sequence state {}, held in this process",
        kind.name(),
        fmt_bytes(bytes),
        fmt_bytes(state)
    );
    Ok(bytes + state)
}

/// Load the draft model (`--draft model`: its own `--draft-trunk DIR`, or the store's) made from
/// the checkpoint `catalog` describes (given exactly when the job runs one), with the target's
/// model-level tensors.
fn load_draft_model(
    cli: &Cli,
    opened: &Opened,
    source: &dyn WeightSource,
    catalog: Option<&k3_store::runtime::catalog::Catalog>,
) -> Result<Option<ModelDrafter>, JobError> {
    let Some(cat) = catalog.filter(|_| wants_draft_model(cli)) else {
        return Ok(None);
    };
    let t0 = Instant::now();
    let n = opened.dims.n_layers;
    let src = match (&cli.draft_trunk, &opened.source) {
        (Some(dir), _) => DraftSource::open(dir, cat, n, &|t| source.model_tensor(t)),
        (None, Source::Attached(store)) => store.draft_source(cat, n).ok_or_else(|| {
            refuse(
                "--draft model: the store holds no draft trunk (start it with --draft-trunk DIR, \
                 or give this job --draft-trunk DIR)",
            )
        })?,
        (None, Source::Standalone(_)) => {
            return Err(refuse("--draft model needs --draft-trunk DIR"))
        }
    }
    .map_err(|e: TrunkError| match e.is_refusal() {
        true => refuse(e.to_string()),
        false => JobError::DraftIo(e.to_string()),
    })?;
    tracing::info!(
        "draft model: {} trunk {} loaded and checked in {:.2} s",
        src.kind().name(),
        fmt_bytes(src.bytes()),
        t0.elapsed().as_secs_f64()
    );
    let capacity = opened.positions + spec_drafts(cli);
    let chunk = match cli.prefill_chunk {
        0 => opened.positions,
        c => c.min(opened.positions),
    };
    Ok(Some(ModelDrafter::new(
        src,
        opened.dims.clone(),
        capacity,
        chunk,
        cli.draft_experts,
    )?))
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

/// The prompt ids, from the one prompt source clap allowed.
fn prompt_ids(cli: &Cli, tok: Option<&Tokenizer>) -> Result<Vec<u32>, JobError> {
    let ids = if let Some(ids) = &cli.ids {
        ids.clone()
    } else {
        let tok = tok.ok_or_else(|| refuse("--prompt/--prompt-file need --tok DIR"))?;
        let bytes = match (&cli.prompt, &cli.prompt_file) {
            (Some(p), _) => p.as_bytes().to_vec(),
            (None, Some(path)) => read_bounded(path, MAX_PROMPT_FILE)?,
            (None, None) => return Err(refuse("no prompt given")),
        };
        // User text is encoded with special tokens disabled (SPEC.md §5.2).
        tok.encode_bytes(&bytes, false)
            .map_err(|e| refuse(format!("cannot tokenize the prompt: {e}")))?
    };
    if ids.is_empty() {
        return Err(refuse("the prompt is empty"));
    }
    if ids.len() > MAX_PROMPT {
        return Err(refuse(format!(
            "prompt of {} tokens exceeds the limit of {MAX_PROMPT}",
            ids.len()
        )));
    }
    Ok(ids)
}

fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, JobError> {
    let input = |source| JobError::Input {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(input)?;
    if meta.len() > max {
        return Err(refuse(format!(
            "{}: {} bytes exceeds the {max}-byte limit",
            path.display(),
            meta.len()
        )));
    }
    std::fs::read(path).map_err(input)
}

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
}

/// The opened source, its checkpoint's config and dims, what its index says, and the positions
/// the state holds.
#[derive(Debug)]
pub struct Opened {
    /// The source.
    pub source: Source,
    /// Checkpoint directory.
    pub model_dir: PathBuf,
    /// Dimensions (truncated by --layers).
    pub dims: Dims,
    /// Positions the sequence state is sized for.
    pub positions: usize,
    /// The stored dtype and shape of every tensor the model binds (from the one read of the
    /// checkpoint index).
    pub shapes: ShapeTable,
    /// The checkpoint's catalog, when a draft model needs it (the standalone source's own).
    pub catalog: Option<Arc<Catalog>>,
    /// The memory this job plans to hold at its peak (its resident memory then), bytes.
    pub plan_bytes: u64,
}

/// Log (warning) that the run's outputs are not the exact model's when its trunk is quantized:
/// the label names what is lossy and where its measured quality is published.
pub fn warn_if_lossy(opened: &Opened) {
    let trunk = opened.source.weights().trunk();
    if trunk.is_lossy() {
        tracing::warn!("{}", trunk.lossy);
    }
}

/// Read the config of `model_dir` (truncated to `--layers`) and its dims.
fn config(cli: &Cli, model_dir: &Path) -> Result<(ModelConfig, Dims), JobError> {
    let cfg_path = model_dir.join("config.json");
    let mut cfg =
        ModelConfig::load(&cfg_path).map_err(|e| refuse(format!("{}: {e}", cfg_path.display())))?;
    if let Some(n) = cli.layers {
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        if n > cfg.num_hidden_layers {
            return Err(refuse(format!(
                "--layers {n} outside 1..={}",
                cfg.num_hidden_layers
            )));
        }
        cfg = cfg.with_layers(n);
    }
    let dims = Dims::from_config(&cfg).map_err(|e| refuse(e.to_string()))?;
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
    let index = k3_proto::safetensors::CheckpointIndex::open(model_dir)
        .map_err(|e| refuse(format!("{}: {e}", model_dir.display())))?;
    let cat = if catalog {
        // Standalone, this is the first read of the headers: every tensor the engine binds is
        // held to the config's dtype and shape here (exit 2 naming it), as `k3-store start` does.
        k3_proto::tensors::check(&cfg, &index)
            .map_err(|e| refuse(format!("{}: {e}", model_dir.display())))?;
        Some(Catalog::from_index(&index, &cfg).map_err(|e| refuse(e.0))?)
    } else {
        None
    };
    let shapes = ShapeTable::from_index(&index, dims.n_layers);
    Ok((cfg, dims, shapes, cat))
}

/// What this job's own buffers take at their peak, as their owners state them from the shapes
/// (`model::state`): the larger of a prefill chunk's pass and a verify pass of the most drafts,
/// the verify journal (kept from pass to pass), the step-0 logits `--dump-logits` keeps and the
/// draft model.
/// The buffers of the job's forward calls besides the sequence states: a batch's passes, or one
/// sequence's ([`buffer_bytes`]).
fn job_buffers(
    cli: &Cli,
    pre: &Preflight,
    dims: &Dims,
    positions: usize,
    chunk: usize,
    seqs: usize,
) -> Result<u64, JobError> {
    match pre.input {
        Input::Batch(_) | Input::Slots { .. } => {
            let rows = crate::batch_job::step_prompt_rows(cli, seqs, positions);
            Ok(crate::batch_job::pass_bytes(dims, positions, rows, seqs))
        }
        Input::Perplexity(_) => {
            let rows = crate::eval::CHUNK.min(positions);
            let pass = Work::bytes_for(
                dims,
                &PassShape {
                    rows,
                    logits_rows: rows,
                    context: positions,
                    journaled: false,
                    threads: rayon::current_num_threads(),
                },
            );
            Ok(pass + crate::eval::extra_bytes(dims.vocab))
        }
        _ => buffer_bytes(cli, dims, positions, chunk),
    }
}

fn buffer_bytes(cli: &Cli, dims: &Dims, positions: usize, chunk: usize) -> Result<u64, JobError> {
    let kept_logits = if cli.dump_logits.is_some() {
        4 * dims.vocab as u64
    } else {
        0
    };
    Ok(pass_bytes(dims, positions, chunk, spec_drafts(cli))
        + kept_logits
        + draft_model_bytes(cli, dims, positions)?)
}

/// The buffers of a job's forward calls: the larger of a prefill chunk of `chunk` ids and a
/// verify pass of `drafts` + 1 rows, and the verify journal.
fn pass_bytes(dims: &Dims, positions: usize, chunk: usize, drafts: usize) -> u64 {
    let threads = rayon::current_num_threads();
    let pass = |rows: usize, logits_rows: usize, journaled: bool| {
        Work::bytes_for(
            dims,
            &PassShape {
                rows,
                logits_rows,
                context: positions + drafts,
                journaled,
                threads,
            },
        )
    };
    let (verify, journal) = if drafts > 0 {
        let rows = drafts + 1;
        (pass(rows, rows, true), Journal::bytes_for(dims, rows))
    } else {
        (0, 0)
    };
    pass(chunk, 1, false).max(verify) + journal
}

/// Bytes an attached worker allocates for a job of `positions` in prefill calls of `chunk` ids
/// with verify passes of up to `drafts` drafted ids (without a draft model): the sequence state
/// and the buffers of its forward calls, stated by their owners. `k3-ctl serve` sizes its
/// default `--max-jobs` with it.
pub fn attached_job_bytes(dims: &Dims, positions: usize, chunk: usize, drafts: usize) -> u64 {
    SeqState::bytes_for(dims, positions) + pass_bytes(dims, positions, chunk, drafts)
}

/// Attach to the store, or open the checkpoint in-process with the memory plan; either way the
/// config and the index are read once, and the plan counts what this process held before it,
/// the sequence state and the job's buffers as their owners state them, and refuses (exit 2)
/// when that does not fit the memory or the address space the process may still take.
pub fn open_source(
    cli: &Cli,
    matches: &clap::ArgMatches,
    pre: &Preflight,
) -> Result<Opened, JobError> {
    let positions = match &pre.input {
        Input::Chat(_) => cli.ctx as usize,
        Input::Prompt(p) => positions_needed(p.len(), cli.gen as usize),
        Input::Batch(items) => items
            .iter()
            .map(|it| positions_needed(it.prompt.len(), it.max_new))
            .max()
            .unwrap_or(1),
        Input::Slots { positions, .. } => *positions,
        Input::Perplexity(job) => job.window.min(job.ids.len()),
    };
    // Sequences held at once: a batch's --parallel (at most its requests), else one.
    let seqs = match &pre.input {
        Input::Batch(items) => crate::batch_job::parallel(cli).min(items.len()),
        Input::Slots { seqs, .. } => *seqs,
        _ => 1,
    };
    let chunk = if cli.prefill_chunk == 0 {
        positions.max(1)
    } else {
        cli.prefill_chunk.min(positions.max(1))
    };
    match &cli.standalone {
        None => {
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
            let (_, dims, shapes, cat) =
                read_checkpoint(cli, &info.model_dir, wants_draft_model(cli))?;
            // The store holds the weights and streams the unpinned layers through its own ring
            // (SPEC.md §6.8); this process allocates only the sequence state and its buffers,
            // and the pages of the store's shared memory it reads count in its resident memory.
            let plan = AttachedPlan {
                process: plan::resident_now(),
                shared: shared_read_bytes(&dims, info.shm_bytes, positions),
                state: seqs as u64 * SeqState::bytes_for(&dims, positions),
                buffers: job_buffers(cli, pre, &dims, positions, chunk, seqs)?,
            };
            plan.check()?;
            tracing::info!("memory plan:\n{plan}");
            Ok(Opened {
                source: Source::Attached(Box::new(src)),
                model_dir: info.model_dir.clone(),
                dims,
                positions,
                shapes,
                catalog: cat.map(Arc::new),
                plan_bytes: plan.total(),
            })
        }
        Some(model_dir) => {
            let (cfg, dims, shapes, cat) = read_checkpoint(cli, model_dir, true)?;
            let cat = Arc::new(cat.expect("read with its catalog"));
            let budget = cli.budget.budget(matches)?;
            let opts = StandaloneOptions {
                context_len: positions,
                // The plan counts one sequence's state itself; a batch's others are buffers here.
                extra_buffer_bytes: job_buffers(cli, pre, &dims, positions, chunk, seqs)?
                    + (seqs as u64 - 1) * SeqState::bytes_for(&dims, positions),
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
                    PlanInputs::from_model(&cfg, cat, trunk, positions)
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
    }
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
    let rows = positions as u64 * (row.div_ceil(FAULT_AROUND) + 1) * FAULT_AROUND;
    shm.saturating_sub(embed) + rows.min(embed)
}

/// An attached worker's memory plan: what the process held before it, the store's shared memory
/// its reads make resident in it ([`shared_read_bytes`]), the sequence state and the job's
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

    /// Refuse when the state and buffers do not fit the memory or the address space left (the
    /// shared memory is mapped already: the store allocated it).
    fn check(&self) -> Result<(), plan::PlanError> {
        let need = self.state + self.buffers;
        let avail = plan::allocatable()?;
        let mut problems = Vec::new();
        if need > avail {
            problems.push(format!(
                "the sequence state and buffers need {} but this process may allocate only {}: shortfall {}",
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
            ("state", self.state, "KDA state + MLA latent cache"),
            (
                "buffers",
                self.buffers,
                "activations, logits, verify journal, draft model",
            ),
            ("process", self.process, "resident before the plan"),
            ("TOTAL", self.total(), ""),
        ] {
            writeln!(f, "  {name:<16}{:>12}   {note}", plan::fmt_bytes(b))?;
        }
        Ok(())
    }
}

/// The most ids a verify pass may draft in this job (its memory is planned up front).
fn spec_drafts(cli: &Cli) -> usize {
    if cli.full_recompute {
        0
    } else {
        cli.spec.max_drafts()
    }
}

/// The job's whole run; returns the exit code (0, or 4 when an expert failed to load).
pub fn run(cli: &Cli, matches: &clap::ArgMatches) -> Result<i32, JobError> {
    run_with(cli, matches, None)
}

/// [`run`], a one-shot run's ids going to `sink` (default: standard output, [`Stdout`]).
pub fn run_with(
    cli: &Cli,
    matches: &clap::ArgMatches,
    sink: Option<&mut dyn Sink>,
) -> Result<i32, JobError> {
    let wall = Instant::now();
    let pre = preflight(cli)?;
    let opened = open_source(cli, matches, &pre)?;
    let prompts: Vec<&[u32]> = match &pre.input {
        Input::Prompt(prompt) => vec![prompt],
        Input::Batch(items) => items.iter().map(|it| &it.prompt[..]).collect(),
        Input::Perplexity(job) => vec![&job.ids],
        Input::Chat(_) | Input::Slots { .. } => Vec::new(),
    };
    for (i, prompt) in prompts.into_iter().enumerate() {
        if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= opened.dims.vocab) {
            let which = match &pre.input {
                Input::Batch(_) => format!("request {} (line order): ", i + 1),
                _ => String::new(),
            };
            return Err(refuse(format!(
                "{which}prompt id {bad} outside the vocabulary of {}",
                opened.dims.vocab
            )));
        }
    }
    warn_if_lossy(&opened);
    tracing::info!(
        "sequence state: {} positions -> MLA latent cache {} ({} B/position over {} layers) + KDA state {}",
        opened.positions,
        fmt_bytes(opened.dims.mla_cache_bytes(opened.positions as u64)),
        opened.dims.mla_cache_bytes(1),
        opened.dims.n_mla(),
        fmt_bytes(opened.dims.kda_state_bytes())
    );
    let source = opened.source.weights();
    let mut model = Model::new(
        opened.dims.clone(),
        source,
        Some(&opened.shapes as &dyn TensorShapes),
    )?;
    if cli.session.is_some() && !matches!(opened.source, Source::Attached(_)) {
        return Err(refuse(
            "--session keeps the conversation in a store: it needs attached mode",
        ));
    }
    model.options = crate::model::feed::FeedOptions::from_env()?;
    let draft_model = load_draft_model(cli, &opened, source, opened.catalog.as_deref())?;
    if cli.dump_cache_trace.is_some() {
        model.trace = Some(Vec::new());
    }
    let hidden = HiddenDump::default();
    if cli.dump_hidden.is_some() {
        model.tap = Some(hidden.tap(model.dims.n_layers));
    }
    // An attached worker tells the store its progress after every token (`k3-ctl ps`).
    let reporter = match &opened.source {
        Source::Attached(src) => Some(src.as_ref()),
        Source::Standalone(_) => None,
    };
    match &pre.input {
        Input::Chat(thinking) => {
            let tok = pre
                .tok
                .as_ref()
                .ok_or_else(|| refuse("--chat needs --tok DIR"))?;
            run_chat(
                cli,
                &mut model,
                opened.plan_bytes,
                tok,
                *thinking,
                pre.sampler.clone(),
                opened.positions,
                drafter(cli, None, 0, draft_model),
                reporter,
            )
        }
        Input::Slots { .. } => Err(refuse(
            "jobs from k3-ctl serve arrive over --serve-channel, not as a one-shot run",
        )),
        Input::Perplexity(job) => run_perplexity(cli, &mut model, job, opened.plan_bytes, wall),
        Input::Batch(items) => {
            crate::batch_job::run(cli, &mut model, pre.tok.as_ref(), &pre.sampler, items, wall)
        }
        Input::Prompt(prompt) => {
            let mut stdout = Stdout {
                tok: pre.tok.as_ref(),
            };
            if sink.is_none() {
                echo_prompt(pre.tok.as_ref(), prompt);
            }
            let sink: &mut dyn Sink = match sink {
                Some(s) => s,
                None => &mut stdout,
            };
            run_prompt(
                cli,
                &mut model,
                opened.plan_bytes,
                sink,
                prompt,
                &pre.sampler,
                &hidden,
                wall,
                reporter,
                drafter(cli, pre.replay.as_deref(), prompt.len(), draft_model),
            )
        }
    }
}

/// `--perplexity`: score the text (crate::eval), print the figures, write `--out`. SIGINT and
/// SIGTERM stop it between forward calls (a base being saved is removed).
fn run_perplexity(
    cli: &Cli,
    model: &mut Model<'_>,
    job: &crate::eval::PplJob,
    plan_bytes: u64,
    wall: Instant,
) -> Result<i32, JobError> {
    let trunk = model.source().trunk();
    let mut job = job.clone();
    job.codec = trunk.codec.clone();
    let stop = k3_store::runtime::trunk::Interrupt::on_signals()
        .map_err(|e| refuse(format!("cannot handle SIGINT/SIGTERM: {e}")))?;
    let r = crate::eval::run(model, &job, &|| stop.signal())?;
    crate::eval::print(&r, &trunk);
    if let Some(path) = &cli.out {
        let v = serde_json::json!({
            "mode": "perplexity",
            "text": cli.perplexity,
            "perplexity": r,
            "trunk": report::trunk_json(&trunk),
            "wall_seconds": wall.elapsed().as_secs_f64(),
            "peak_rss_bytes": report::peak_rss_bytes(),
            "memory_plan_bytes": plan_bytes,
        });
        report::write_json(path, &v).map_err(|(path, source)| JobError::Output {
            path,
            source,
            before_work: false,
        })?;
    }
    Ok(report::expert_failures(&model.counters))
}

/// On a terminal, stdout shows the prompt's text (dimmed) before the generated text, so the
/// continuation reads in place; piped or redirected, stdout is the generated text alone.
fn echo_prompt(tok: Option<&Tokenizer>, prompt: &[u32]) {
    use std::io::IsTerminal;
    let stdout = std::io::stdout();
    if !stdout.is_terminal() {
        return;
    }
    if let Some(text) = tok.and_then(|t| t.decode(prompt).ok()) {
        let mut out = stdout.lock();
        let _ = out.write_all(b"\x1b[2m");
        let _ = out.write_all(&text);
        let _ = out.write_all(b"\x1b[0m");
        let _ = out.flush();
    }
}

#[allow(clippy::too_many_arguments)]
fn run_prompt(
    cli: &Cli,
    model: &mut Model<'_>,
    plan_bytes: u64,
    sink: &mut dyn Sink,
    prompt: &[u32],
    sampler: &Sampler,
    hidden: &HiddenDump,
    wall: Instant,
    reporter: Option<&AttachedSource>,
    drafter: Option<Box<dyn Drafter>>,
) -> Result<i32, JobError> {
    let gen_opts = GenOptions {
        max_new: cli.gen as usize,
        full_recompute: cli.full_recompute,
        sampler: sampler.clone(),
        stop_ids: END_IDS.to_vec(),
        keep_step0_logits: cli.dump_logits.is_some(),
        prefill_chunk: cli.prefill_chunk,
        spec: cli.spec,
    };
    eprintln!("{}", report::STEP_HEADER);
    let mut progress = k3_proto::wire::JobProgress::default();
    let capacity = positions_needed(prompt.len(), gen_opts.max_new);
    let session_name = cli.session.as_deref().zip(reporter);
    let (mut seq, reused) = resume_prompt(session_name, model, prompt, capacity, sampler)?;
    if let Some(d) = drafter {
        seq.set_drafter(d);
    }
    // For serve: the prompt but its last id first, in chunks between which a cancel is
    // noticed, and that state kept under the session before the first pick, so that a retry of
    // the same request (the client gave up) resumes it instead of prefilling again. The ids
    // are the same: a prompt's positions are computed alike in whatever calls they arrive.
    let (fed, kept_after_prefill, prefill_seconds) =
        prefill_and_keep(cli, model, sink, &mut seq, prompt, reused, session_name)?;
    if sink.cancelled() {
        sink.prefilled(reused, fed, kept_after_prefill);
        let summary = report::RunSummary::collect(model, wall.elapsed().as_secs_f64());
        let timings = job_timings(&summary, prefill_seconds, None, kept_after_prefill);
        let usage = job_usage(prompt.len(), reused, 0);
        sink.done(k3_proto::serve::Finish::Cancelled, usage, timings);
        return Ok(summary.exit_code());
    }
    let mut emitted = 0usize;
    let mut gen = seq.generate(model, &prompt[fed..], &gen_opts, &mut |s| {
        eprintln!("{}", report::step_line(s));
        if s.step == 0 {
            sink.prefilled(reused, fed, kept_after_prefill);
        }
        if let Some(src) = reporter {
            progress.tokens += 1;
            if s.step == 0 {
                progress.prefill_seconds = prefill_seconds + s.seconds;
            } else {
                progress.decode_seconds += s.seconds;
                if s.pass as u64 > progress.forward_passes {
                    progress.forward_passes = s.pass as u64;
                }
                progress.drafted_tokens += s.drafted as u64;
                progress.accepted_tokens += s.accepted as u64;
            }
            // Summed from the steps: no extra round trip to the store per token.
            progress.trunk_bytes_read += s.trunk_bytes_read;
            // Progress is for people watching; a lost connection fails the next expert request.
            if let Err(e) = src.report_progress(progress.clone()) {
                tracing::debug!("progress not reported: {e}");
            }
        }
        let flow = sink.token(s);
        if flow == Flow::Continue {
            emitted += 1;
        }
        flow
    })?;
    gen.prompt_ids = prompt.to_vec();
    let cancelled = gen.stopped_on.is_none() && emitted < gen_opts.max_new;
    if let Some(src) = reporter {
        // The job's stream, for later jobs' history drafting (SPEC.md §3.12).
        let mut stream = prompt.to_vec();
        stream.extend_from_slice(&gen.generated_ids);
        if let Err(e) = src.record_history(&stream) {
            tracing::warn!("token stream not recorded in the store's history: {e}");
        }
    }
    let summary = report::RunSummary::collect(model, wall.elapsed().as_secs_f64());
    summary.print_totals(&gen);
    let draft_cost = seq.drafter().and_then(|d| d.model_cost());
    if let Some((calls, seconds)) = draft_cost {
        eprintln!("draft model: {calls} forward calls, {seconds:.3} s (inside the decode seconds)");
    }
    let written = |r: Result<(), (PathBuf, std::io::Error)>| {
        r.map_err(|(path, source)| JobError::Output {
            path,
            source,
            before_work: false,
        })
    };
    if let Some(path) = &cli.dump_logits {
        written(report::write_logits(
            path,
            gen.step0_logits.as_deref().unwrap_or(&[]),
        ))?;
    }
    if let (Some(dir), Some(trace)) = (&cli.dump_cache_trace, model.trace.as_ref()) {
        written(report::write_trace(dir, trace))?;
    }
    if let Some(dir) = &cli.dump_hidden {
        written(hidden.write(dir, model.dims.hidden))?;
    }
    // A cancelled run keeps what it kept after the prefill (its retry resumes from there); the
    // state of a run that ended is kept for the conversation's next turn.
    let kept = if cancelled && sink.keeps_prefill() {
        Some(kept_after_prefill)
    } else {
        session_name.map(|(name, src)| keep_session(src, name, &seq, &[], &mut std::io::stderr()))
    };
    if let Some(path) = &cli.out {
        let mut v = summary.json(&gen);
        v["memory_plan_bytes"] = plan_bytes.into();
        if let Some((calls, seconds)) = draft_cost {
            v["draft_model"] = serde_json::json!({"forward_calls": calls, "seconds": seconds});
        }
        if let Some((name, _)) = session_name {
            v["session"] = serde_json::json!({
                "name": name,
                "reused": reused,
                "prefilled": prompt.len() - reused,
                "kept_bytes": kept.flatten(),
            });
        }
        written(report::write_json(path, &v))?;
    }
    let finish = match gen.stopped_on {
        Some(id) => k3_proto::serve::Finish::EndId(id),
        None if cancelled => k3_proto::serve::Finish::Cancelled,
        None => k3_proto::serve::Finish::Length,
    };
    let timings = job_timings(
        &summary,
        prefill_seconds + gen.prefill_seconds(),
        Some(&gen),
        kept.flatten(),
    );
    sink.done(finish, job_usage(prompt.len(), reused, emitted), timings);
    Ok(summary.exit_code())
}

/// With a sink that keeps the prefill ([`Sink::keeps_prefill`]) and a session: run the prompt
/// after the `reused` ids a session held, but its last id, in chunks (stopping early when the
/// sink is cancelled), and keep that state under the session. Returns the prompt ids the state
/// holds, the bytes kept and the seconds it took.
fn prefill_and_keep(
    cli: &Cli,
    model: &mut Model<'_>,
    sink: &dyn Sink,
    seq: &mut Session,
    prompt: &[u32],
    reused: usize,
    session: Option<(&str, &AttachedSource)>,
) -> Result<(usize, Option<u64>, f64), JobError> {
    let Some((name, src)) = session.filter(|_| sink.keeps_prefill()) else {
        return Ok((reused, None, 0.0));
    };
    let t0 = Instant::now();
    let body = &prompt[reused..prompt.len() - 1];
    let chunk = match cli.prefill_chunk {
        0 => body.len().max(1),
        c => c,
    };
    let mut fed = reused;
    for part in body.chunks(chunk) {
        if sink.cancelled() {
            break;
        }
        seq.prefill(model, part, 0)?;
        fed += part.len();
    }
    let kept = if fed > reused {
        keep_session(src, name, seq, &[], &mut std::io::stderr())
    } else {
        None
    };
    Ok((fed, kept, t0.elapsed().as_secs_f64()))
}

/// A job's counts for its sink.
fn job_usage(prompt: usize, cached: usize, generated: usize) -> k3_proto::serve::Usage {
    let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    k3_proto::serve::Usage {
        prompt_ids: n(prompt),
        cached_ids: n(cached),
        generated: n(generated),
    }
}

/// A job's time and bytes for its sink.
fn job_timings(
    summary: &report::RunSummary,
    prefill_seconds: f64,
    gen: Option<&crate::generate::GenReport>,
    kept_session_bytes: Option<u64>,
) -> k3_proto::serve::Timings {
    let st = &summary.stats;
    k3_proto::serve::Timings {
        prefill_seconds,
        decode_seconds: gen.map_or(0.0, |g| g.steps.iter().skip(1).map(|s| s.seconds).sum()),
        bytes_read: st.trunk_bytes_read + st.expert_bytes_read,
        expert_requests: st.expert_requests,
        resident_hits: st.resident_hits,
        kept_session_bytes,
    }
}

/// The sequence a one-shot run starts from: the kept session `name` when the ids it holds are a
/// strict prefix of `prompt` (then only the rest is prefilled), else a fresh one; says which on
/// stderr. Returns the sequence and the number of prompt ids it already holds.
fn resume_prompt(
    session: Option<(&str, &AttachedSource)>,
    model: &Model<'_>,
    prompt: &[u32],
    capacity: usize,
    sampler: &Sampler,
) -> Result<(Session, usize), JobError> {
    let fresh = || Session::new(model, capacity, sampler.clone());
    let Some((name, src)) = session else {
        return Ok((fresh(), 0));
    };
    use crate::session::ForPrompt;
    match crate::session::fetch_for_prompt(src, name, &model.dims, capacity, prompt) {
        Ok(ForPrompt::Restored(r)) => {
            let from = r.held.len();
            eprintln!(
                "session {name}: resumed; {from} of the prompt's {} ids already held, prefilling {}",
                prompt.len(),
                prompt.len() - from
            );
            let seq = Session::from_parts(r.state, r.held, sampler.clone())?;
            Ok((seq, from))
        }
        Ok(ForPrompt::NotPrefix(n)) => {
            eprintln!(
                "session {name}: the {n} ids it holds are not a prefix of this prompt; prefilling the whole prompt"
            );
            Ok((fresh(), 0))
        }
        Ok(ForPrompt::Missing) => {
            eprintln!("session {name}: new (the store has none of that name)");
            Ok((fresh(), 0))
        }
        Err(e) => {
            eprintln!("session {name}: not resumed ({e}); prefilling the whole prompt");
            Ok((fresh(), 0))
        }
    }
}

/// Hand `seq` (and the chat `history`) to the store as session `name`, saying so on `err`; the
/// bytes kept, or `None` (with the reason on `err`) when the store did not keep it.
fn keep_session(
    src: &AttachedSource,
    name: &str,
    seq: &Session,
    history: &[crate::chat::Message],
    err: &mut dyn Write,
) -> Option<u64> {
    if !seq.is_valid() {
        let _ = writeln!(
            err,
            "session {name}: NOT kept (the state is unusable after a failed forward)"
        );
        return None;
    }
    let meta = crate::session::Meta {
        history: history.to_vec(),
    };
    match crate::session::keep(src, name, seq.held(), seq.state(), &meta) {
        Ok(k) => {
            let _ = writeln!(
                err,
                "session {name}: kept {} positions ({:.3} MB) in {:.3} s{}",
                seq.held().len(),
                k.bytes as f64 / 1e6,
                k.seconds,
                if k.evicted.is_empty() {
                    String::new()
                } else {
                    format!("; the store evicted {}", k.evicted.join(", "))
                }
            );
            Some(k.bytes)
        }
        Err(e) => {
            let _ = writeln!(err, "session {name}: NOT kept: {e}");
            None
        }
    }
}

/// The `--chat` loop: stdin lines are user turns; exit 0 at end of input. With `--session` the
/// conversation is resumed from the store and kept there after every turn.
#[allow(clippy::too_many_arguments)]
fn run_chat(
    cli: &Cli,
    model: &mut Model<'_>,
    plan_bytes: u64,
    tok: &Tokenizer,
    thinking: Option<Effort>,
    sampler: Sampler,
    capacity: usize,
    drafter: Option<Box<dyn Drafter>>,
    src: Option<&AttachedSource>,
) -> Result<i32, JobError> {
    use crate::chat::{run_repl, ChatFormat, ReplOptions, Session, TurnOptions};
    // Ctrl-C: see `ReplInput::stdin_with_ctrl_c` (stops a reply; twice at the prompt leaves).
    use std::io::IsTerminal;
    let fmt = ChatFormat::new(tok, thinking).map_err(refuse)?;
    tracing::info!(
        "chat: thinking {}; context {capacity} positions; up to {} tokens per reply; end of input ends the session",
        thinking.map_or("off".to_string(), |e| format!("on (effort {})", e.as_str())),
        cli.gen
    );
    let kept_in = cli.session.as_deref().zip(src);
    let mut session = Session::new(model, capacity, sampler.clone());
    let mut resumed = None;
    if let Some((name, src)) = kept_in {
        match crate::session::fetch(src, name, &model.dims, capacity) {
            Ok(Some(r)) => {
                let (n, m) = (r.held.len(), r.meta.history.len());
                eprintln!(
                    "session {name}: resumed {n} positions and {m} messages ({:.3} MB)",
                    r.bytes as f64 / 1e6
                );
                let seq = crate::generate::Session::from_parts(r.state, r.held, sampler)?;
                session = Session::from_parts(r.meta.history, seq);
                resumed = Some(n);
            }
            Ok(None) => eprintln!("session {name}: new (the store has none of that name)"),
            Err(e) => eprintln!("session {name}: not resumed ({e}); starting afresh"),
        }
    }
    let mut after_turn = |s: &Session, err: &mut dyn Write| {
        if let Some((name, src)) = kept_in {
            keep_session(src, name, s.seq(), &s.history, err);
        }
    };
    if let Some(d) = drafter {
        session.set_drafter(d);
    }
    let opts = ReplOptions {
        turn: TurnOptions {
            max_new: cli.gen as usize,
            prefill_chunk: cli.prefill_chunk,
            spec: cli.spec,
        },
        prompt: std::io::stdin().is_terminal(),
        prompt_on_out: std::io::stdout().is_terminal(),
        dim_think: std::io::stderr().is_terminal(),
    };
    let mut input =
        crate::chat::ReplInput::stdin_with_ctrl_c().map_err(|source| JobError::Output {
            path: PathBuf::from("<stdin>"),
            source,
            before_work: true,
        })?;
    let summary = run_repl(
        model,
        &fmt,
        &mut session,
        &mut input,
        &mut std::io::stdout(),
        &mut std::io::stderr(),
        &opts,
        &mut after_turn,
    )
    .map_err(|e| match e {
        crate::chat::ReplError::Model(m) => JobError::Model(m),
        crate::chat::ReplError::Io(source) => JobError::Output {
            path: PathBuf::from("<stdio>"),
            source,
            before_work: false,
        },
    })?;
    eprintln!(
        "chat: {} turns ({} refused); PEAK RSS for the whole run: {}",
        summary.turns,
        summary.refused,
        fmt_bytes(report::peak_rss_bytes())
    );
    if let Some(path) = &cli.out {
        let v = serde_json::json!({
            "mode": "chat",
            "session": cli.session,
            "resumed_positions": resumed,
            "turns": summary.records,
            "refused": summary.refused,
            "peak_rss_bytes": report::peak_rss_bytes(),
            "memory_plan_bytes": plan_bytes,
            "trunk": report::trunk_json(&model.source().trunk()),
        });
        report::write_json(path, &v).map_err(|(path, source)| JobError::Output {
            path,
            source,
            before_work: false,
        })?;
    }
    Ok(report::expert_failures(&model.counters))
}
