//! Every way a `k3-worker` job can fail ([`JobError`]), with the exit code each ends the
//! process with, and the small helpers every front end refuses or reads its input with.

use std::path::{Path, PathBuf};

use k3_proto::exit;
use k3_store::attach::AttachError;
use k3_store::runtime::plan;
use k3_store::runtime::standalone::OpenError;

use crate::engine::sampling::SamplingError;
use crate::model::ModelError;
use crate::text::xtml::MissingMarker;
use crate::tokenizer::TokError;

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
    /// Scoring a text (`--perplexity`) failed: its base file refused (exit 2), a read or write
    /// (exit 1), the model (its code), an interrupt (exit 1).
    #[error(transparent)]
    Eval(#[from] crate::eval::EvalError),
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

/// A refusal before any work (exit 2).
pub(crate) fn refuse(msg: impl std::fmt::Display) -> JobError {
    JobError::Refused(msg.to_string())
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
