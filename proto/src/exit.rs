//! Exit codes shared by every k3 binary (documented in the README).

/// Success.
pub const OK: i32 = 0;
/// Bind, forward or I/O failure after work started.
pub const FAILURE: i32 = 1;
/// Refused before any work: usage error, a config or checkpoint that cannot be read with
/// confidence, or a memory plan / KV cache that cannot fit.
pub const REFUSED: i32 = 2;
/// Cannot reach or attach to the store.
pub const NO_STORE: i32 = 3;
/// The run finished but at least one routed expert failed to load: the ids are unsound.
pub const EXPERT_LOAD_FAILED: i32 = 4;
/// `k3-ctl verify` only: every byte read and consistent, but the checkpoint has no manifest
/// (`k3-manifest.json`), so its contents were not checked against a reference.
pub const UNVERIFIED: i32 = 5;

/// An error that knows which documented exit code it ends the process with. Every binary maps
/// its errors through this trait and [`report`], the one place that prints and picks a code.
pub trait ExitStatus: std::error::Error {
    /// One of [`FAILURE`], [`REFUSED`], [`NO_STORE`], [`EXPERT_LOAD_FAILED`].
    fn exit_code(&self) -> i32;
}

impl ExitStatus for crate::paths::PathError {
    /// A path on the command line that cannot be made absolute: refused before any work.
    fn exit_code(&self) -> i32 {
        REFUSED
    }
}

impl ExitStatus for crate::paths::EnvError {
    /// An environment variable with a value it cannot take: refused before any work.
    fn exit_code(&self) -> i32 {
        REFUSED
    }
}

impl ExitStatus for crate::manifest::ManifestError {
    /// A manifest that cannot be read or is malformed: refused before any work.
    fn exit_code(&self) -> i32 {
        REFUSED
    }
}

/// The process exit code for `result`; an error is printed to stderr as `prog: error: cause:
/// cause…` (its whole source chain, so an `io::Error` kind is never lost).
pub fn report<E: ExitStatus>(prog: &str, result: Result<i32, E>) -> i32 {
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{prog}: {}", message(&e));
            e.exit_code()
        }
    }
}

/// An error and its whole source chain as one line (`error: cause: cause…`), each cause once.
pub fn message(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let s_txt = s.to_string();
        if !msg.contains(&s_txt) {
            msg.push_str(": ");
            msg.push_str(&s_txt);
        }
        src = s.source();
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read the plan")]
    struct Outer(#[source] std::io::Error);

    impl ExitStatus for Outer {
        fn exit_code(&self) -> i32 {
            REFUSED
        }
    }

    #[test]
    fn report_keeps_the_code_and_passes_ok_through() {
        assert_eq!(report::<Outer>("t", Ok(OK)), OK);
        assert_eq!(
            report::<Outer>("t", Ok(EXPERT_LOAD_FAILED)),
            EXPERT_LOAD_FAILED
        );
        let e = Outer(std::io::Error::new(std::io::ErrorKind::NotFound, "gone"));
        assert_eq!(report("t", Err(e)), REFUSED);
    }
}
