//! How a `k3-ctl` subcommand fails: [`Failed`] carries the error (its whole source chain) and
//! the documented exit code it ends the process with. Every subcommand returns
//! `Result<i32, Failed>`; `main` maps it through `k3_proto::exit::report`, the one place that
//! prints an error and picks the code.

use k3_proto::exit::{self, ExitStatus};

/// A subcommand's failure.
#[derive(Debug, thiserror::Error)]
#[error("{what}")]
pub struct Failed {
    /// What failed.
    what: String,
    /// The exit code.
    code: i32,
    /// Why, when another error is the cause.
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl Failed {
    /// Refused before any work (exit 2): a bad flag or input, without another error behind it.
    pub fn refused(what: impl Into<String>) -> Failed {
        Failed {
            what: what.into(),
            code: exit::REFUSED,
            source: None,
        }
    }

    /// Failed after work started (exit 1), without another error behind it.
    pub fn failed(what: impl Into<String>) -> Failed {
        Failed {
            what: what.into(),
            code: exit::FAILURE,
            source: None,
        }
    }

    /// `what` failed because of `e`, with `e`'s own exit code.
    pub fn because<E>(what: impl Into<String>, e: E) -> Failed
    where
        E: ExitStatus + Send + Sync + 'static,
    {
        Failed {
            what: what.into(),
            code: e.exit_code(),
            source: Some(Box::new(e)),
        }
    }

    /// `what` failed because of `e` (an error that knows no exit code), with exit `code`.
    pub fn with_code<E>(what: impl Into<String>, code: i32, e: E) -> Failed
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        Failed {
            what: what.into(),
            code,
            source: Some(Box::new(e)),
        }
    }
}

impl ExitStatus for Failed {
    fn exit_code(&self) -> i32 {
        self.code
    }
}
