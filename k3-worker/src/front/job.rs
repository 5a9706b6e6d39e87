//! One `k3-worker` job, in stages: [`preflight`] (everything that can be refused before any
//! work: the input read and checked, the outputs writable), the memory plan and the source
//! ([`crate::front::source`]), the model bound once, then the front end of the input — a
//! one-shot prompt, a chat, a `--batch` file or jobs from `k3-ctl serve` — each feeding the one
//! engine ([`crate::engine`]) with typed requests. [`JobError`] is every way a job can fail,
//! with its exit code.

use std::path::{Path, PathBuf};
use std::time::Instant;

use k3_proto::exit;
use k3_store::attach::AttachError;
use k3_store::runtime::plan;
use k3_store::runtime::standalone::OpenError;

use crate::engine::memory::{prefill_rows, EnginePlan};
use crate::engine::sampling::{positions_needed, Sampler, SamplingError};
use crate::front::batch_file::BatchItem;
use crate::front::cli::{Cli, MAX_GEN, MAX_PROMPT, MAX_PROMPT_FILE};
use crate::front::drafters::{DraftFlags, Drafters};
use crate::front::source::{open_source, JobShape, Opened};
use crate::model::{Model, ModelError, TensorShapes};
use crate::text::xtml::{Effort, Markers, MissingMarker};
use crate::tokenizer::{TokError, Tokenizer};

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
    /// The tokenizer could not be loaded (exit 2).
    #[error("tokenizer {}", dir.display())]
    Tokenizer {
        /// Its directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: TokError,
    },
    /// A prompt could not be tokenized (exit 2).
    #[error("cannot tokenize the prompt")]
    Tokenize(#[source] TokError),
    /// The tokenizer lacks a chat marker (exit 2).
    #[error(transparent)]
    Marker(#[from] MissingMarker),
    /// Sampling flags out of range (exit 2).
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The checkpoint's config (exit 2).
    #[error("{}", path.display())]
    Config {
        /// `config.json`.
        path: PathBuf,
        /// Why.
        #[source]
        source: k3_proto::config::ConfigError,
    },
    /// The config's dims (exit 2).
    #[error("{}", path.display())]
    Dims {
        /// `config.json`.
        path: PathBuf,
        /// Why.
        #[source]
        source: ModelError,
    },
    /// The checkpoint's index (exit 2).
    #[error("{}", dir.display())]
    Index {
        /// The checkpoint directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: k3_proto::safetensors::IndexError,
    },
    /// A checkpoint whose tensors do not match its config (exit 2).
    #[error("{}: {problem}", dir.display())]
    Checkpoint {
        /// The checkpoint directory.
        dir: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// `--layers` beyond the model's (exit 2).
    #[error("--layers {asked} outside 1..={has}")]
    Layers {
        /// Asked.
        asked: usize,
        /// The model's layers.
        has: usize,
    },
    /// An output path is not writable (checked before work: exit 2; after: exit 1).
    #[error("cannot write {}", path.display())]
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
    #[error("{}", socket.display())]
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
    /// The engine refused a request (exit 2).
    #[error(transparent)]
    Request(#[from] crate::engine::request::RequestError),
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
}

impl k3_proto::exit::ExitStatus for JobError {
    fn exit_code(&self) -> i32 {
        use k3_proto::exit::ExitStatus as E;
        match self {
            JobError::Refused(_)
            | JobError::Input { .. }
            | JobError::Tokenizer { .. }
            | JobError::Tokenize(_)
            | JobError::Marker(_)
            | JobError::Sampling(_)
            | JobError::Config { .. }
            | JobError::Dims { .. }
            | JobError::Index { .. }
            | JobError::Checkpoint { .. }
            | JobError::Layers { .. }
            | JobError::Request(_) => exit::REFUSED,
            JobError::Env(e) => E::exit_code(e),
            JobError::Budget(e) => E::exit_code(e),
            JobError::Plan(e) => E::exit_code(e),
            JobError::Output { before_work, .. } => {
                if *before_work {
                    exit::REFUSED
                } else {
                    exit::FAILURE
                }
            }
            // Cannot attach (3), or this process cannot hold what attaching needs (2).
            JobError::Attach { source, .. } => E::exit_code(source),
            JobError::Open(e) => E::exit_code(e),
            JobError::Model(e) => e.exit_code(),
            JobError::DraftIo(_) => exit::FAILURE,
        }
    }
}

/// A refusal before any work (exit 2).
pub(crate) fn refuse(msg: impl std::fmt::Display) -> JobError {
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
    Batch(Vec<BatchItem>),
    /// Jobs from `k3-ctl serve` (`--serve-channel`).
    Serve,
}

/// Everything checked before any work.
#[derive(Debug)]
pub struct Preflight {
    /// The sampler the command line asks for.
    pub sampler: Sampler,
    /// The tokenizer, when given.
    pub tok: Option<Tokenizer>,
    /// The input.
    pub input: Input,
    /// The speculation flags.
    pub drafts: DraftFlags,
}

/// Checks and set-up that need neither the store nor the checkpoint: SIMD tier, sampler, thread
/// pool (bounded by the CPUs), tokenizer, the input, and that every output path is writable.
pub fn preflight(cli: &Cli) -> Result<Preflight, JobError> {
    // Before any thread: the allocator's arenas are bounded, so the address space the memory
    // plan checks is what the job will take (k3_store::runtime::plan::ADDRESS_SPACE_RESERVE).
    plan::limit_allocator_arenas();
    // The SIMD tier is chosen once, here: a forced tier (K3_SIMD) that is unknown or that this
    // CPU lacks is a refusal, never a crash or a silent fallback.
    let tier = crate::kernels::select_tier().map_err(refuse)?;
    tracing::info!("kernels: {} tier", tier.name());
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
    for path in [&cli.out, &cli.dump_logits].into_iter().flatten() {
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
    let input = input(cli, tok.as_ref())?;
    let drafts = DraftFlags::from_cli(cli)?;
    Ok(Preflight {
        sampler,
        tok,
        input,
        drafts,
    })
}

/// The input clap allowed, read and checked.
fn input(cli: &Cli, tok: Option<&Tokenizer>) -> Result<Input, JobError> {
    if cli.chat {
        let tok = tok.ok_or_else(|| refuse("--chat needs --tok DIR"))?;
        Markers::from_tokenizer(tok)?;
        return Ok(Input::Chat(if cli.no_think {
            None
        } else {
            Some(cli.effort.map_or(Effort::Max, Effort::from))
        }));
    }
    if cli.serve_channel {
        return Ok(Input::Serve);
    }
    if let Some(path) = &cli.batch {
        let bytes = read_bounded(path, MAX_PROMPT_FILE)?;
        let items = crate::front::batch_file::parse(path, &bytes, tok, cli.gen)?;
        return Ok(Input::Batch(items));
    }
    Ok(Input::Prompt(prompt_ids(cli, tok)?))
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
            .map_err(JobError::Tokenize)?
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

/// Read `path`, refusing one larger than `max` bytes before reading it.
pub(crate) fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, JobError> {
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

/// The most positions one sequence of a serve worker may take: the longest prompt serve
/// accepts and the longest reply.
pub fn serve_longest() -> usize {
    positions_needed(MAX_PROMPT, MAX_GEN as usize)
}

/// `--parallel` of `--batch` when not given.
pub const DEFAULT_PARALLEL: u64 = 4;

/// What the job's engine is planned for, from its input and flags.
fn job_shape(cli: &Cli, pre: &Preflight) -> JobShape {
    let drafts = pre.drafts.max_drafts();
    let gen = cli.gen as usize;
    let (slots, positions, longest, embedded) = match &pre.input {
        Input::Prompt(p) => {
            let n = positions_needed(p.len(), gen);
            (1, n, n, n)
        }
        Input::Chat(_) => (1, cli.ctx as usize, cli.ctx as usize, cli.ctx as usize),
        Input::Batch(items) => {
            let n = (items.iter())
                .map(|it| positions_needed(it.prompt.len(), it.max_new))
                .max()
                .unwrap_or(1);
            let all = items.iter().map(|it| it.prompt.len() + it.max_new).sum();
            let slots = cli.parallel.unwrap_or(DEFAULT_PARALLEL) as usize;
            (slots.min(items.len()).max(1), n, n, all)
        }
        Input::Serve => {
            let n = cli.ctx as usize;
            let slots = cli.parallel.unwrap_or(1) as usize;
            (slots, n, serve_longest().max(n), usize::MAX)
        }
    };
    JobShape {
        engine: EnginePlan {
            slots,
            positions,
            longest,
            prefill_rows: prefill_rows(cli.prefill_chunk, longest),
            drafts,
            draft_model: pre.drafts.wants_model(),
            keep_step0_logits: cli.dump_logits.is_some(),
        },
        embedded,
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
    pub fn drafters(&mut self, cli: &Cli) -> Result<Drafters, JobError> {
        let flags = std::mem::replace(&mut self.pre.drafts, DraftFlags::from_cli(cli)?);
        Drafters::load(cli, flags, &self.opened, self.opened.source.weights())
    }
}

/// Preflight, the plan and the source: everything before the engine runs.
pub fn prepare(cli: &Cli, matches: &clap::ArgMatches) -> Result<Prepared, JobError> {
    let wall = Instant::now();
    let pre = preflight(cli)?;
    let shape = job_shape(cli, &pre);
    let opened = open_source(cli, matches, &shape, &pre.drafts)?;
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
    Ok(Prepared {
        pre,
        opened,
        shape,
        wall,
    })
}

/// The job's whole run; returns the exit code (0, or 4 when an expert failed to load).
pub fn run(cli: &Cli, matches: &clap::ArgMatches) -> Result<i32, JobError> {
    let mut job = prepare(cli, matches)?;
    match std::mem::replace(&mut job.pre.input, Input::Serve) {
        Input::Prompt(prompt) => crate::front::prompt::run(cli, &mut job, &prompt),
        Input::Chat(thinking) => crate::front::chat::run(cli, &mut job, thinking),
        Input::Batch(items) => crate::front::batch_file::run(cli, &mut job, &items),
        Input::Serve => Err(refuse(
            "jobs from k3-ctl serve arrive over --serve-channel, not as a one-shot run",
        )),
    }
}
