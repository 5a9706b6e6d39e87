//! How a `k3-ctl` subcommand fails: [`Failed`] carries the error (its whole source chain) and
//! the documented exit code it ends the process with. Every subcommand returns
//! `Result<i32, Failed>`; `main` maps it through `k3_proto::exit::report`, the one place that
//! prints an error and picks the code.

use std::fmt;

use k3_proto::exit::{self, ExitStatus};

/// The error beneath a [`Failed`].
type Cause = Box<dyn std::error::Error + Send + Sync>;

/// A subcommand's failure: `what` failed (when there is more to say than the error itself)
/// because of `source`, with exit `code`.
#[derive(Debug)]
pub struct Failed {
    /// What failed; `None` when the error says it.
    what: Option<String>,
    /// The exit code.
    code: i32,
    /// Why, when another error is the cause.
    source: Option<Cause>,
}

impl Failed {
    /// Refused before any work (exit 2): a bad flag or input, without another error behind it.
    pub fn refused(what: impl Into<String>) -> Failed {
        Failed {
            what: Some(what.into()),
            code: exit::REFUSED,
            source: None,
        }
    }

    /// Failed after work started (exit 1), without another error behind it.
    pub fn failure(what: impl Into<String>) -> Failed {
        Failed {
            what: Some(what.into()),
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
            what: Some(what.into()),
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
            what: Some(what.into()),
            code,
            source: Some(Box::new(e)),
        }
    }

    /// The error `e` itself (it says what failed), with exit `code`.
    pub fn coded<E>(code: i32, e: E) -> Failed
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        Failed {
            what: None,
            code,
            source: Some(Box::new(e)),
        }
    }

    /// The error `e` itself, with its own exit code.
    pub fn of<E>(e: E) -> Failed
    where
        E: ExitStatus + Send + Sync + 'static,
    {
        Failed::coded(e.exit_code(), e)
    }
}

impl fmt::Display for Failed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.what, &self.source) {
            (Some(w), _) => f.write_str(w),
            (None, Some(e)) => write!(f, "{e}"),
            (None, None) => f.write_str("failed"),
        }
    }
}

impl std::error::Error for Failed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        let e: &(dyn std::error::Error + 'static) = self.source.as_deref()?;
        // Without a `what`, the error itself is this one's text: its cause comes next.
        if self.what.is_some() {
            Some(e)
        } else {
            e.source()
        }
    }
}

impl ExitStatus for Failed {
    fn exit_code(&self) -> i32 {
        self.code
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("reading the trace")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn the_message_names_each_cause_once_and_the_code_is_kept() {
        let io = || std::io::Error::from(std::io::ErrorKind::NotFound);
        let f = Failed::coded(exit::REFUSED, Outer(io()));
        assert_eq!(f.exit_code(), exit::REFUSED);
        assert_eq!(exit::message(&f), format!("reading the trace: {}", io()));
        let f = Failed::with_code("replay", exit::FAILURE, Outer(io()));
        assert_eq!(
            exit::message(&f),
            format!("replay: reading the trace: {}", io())
        );
        assert_eq!(Failed::refused("--x").to_string(), "--x");
    }
}
