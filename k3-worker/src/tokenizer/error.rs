//! The tokenizer's errors (a leaf: the files reader and the tokenizer both name them).

use std::path::PathBuf;

use super::pretok;

/// Tokenizer errors.
#[derive(Debug, thiserror::Error)]
pub enum TokError {
    /// A file could not be read.
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A tokenizer file is malformed.
    #[error("{path}{}: {msg}", line.map(|l| format!(" line {l}")).unwrap_or_default())]
    Format {
        path: PathBuf,
        line: Option<usize>,
        msg: String,
    },
    /// Input text is not UTF-8.
    #[error("input is not valid UTF-8: invalid byte at offset {offset}")]
    InvalidUtf8 { offset: usize },
    /// An id outside `0..vocab_size`.
    #[error("token id {id} (position {position}) is out of range: the vocabulary has ids 0..{vocab_size}")]
    UnknownId {
        id: u64,
        position: usize,
        vocab_size: usize,
    },
    /// Internal setup failure (pattern tables).
    #[error("tokenizer setup failed: {0}")]
    Setup(#[source] pretok::PretokError),
}
