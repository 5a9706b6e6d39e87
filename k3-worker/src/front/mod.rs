//! The front ends: each turns its own input into the engine's typed requests
//! ([`crate::engine::request::Request`]) and its sinks' output into what its caller reads.
//!
//! * [`cli`] — the command line (clap); [`job`] — the job wiring every front end shares:
//!   preflight, the plan, the source ([`source`]), the bound model, the drafters
//!   ([`drafters`]); [`error`] — [`JobError`] and its exit codes.
//! * [`prompt`] — `--ids`, `--prompt`, `--prompt-file`: one request, ids to stdout.
//! * [`chat`] — `--chat`: the REPL, a conversation whose turns continue one sequence.
//! * [`batch_file`] — `--batch FILE`: a request per line, JSON Lines out.
//! * [`perplexity`] — `--perplexity FILE`: a text scored with teacher forcing ([`crate::eval`]).
//! * [`serve`] — `--serve-channel`: jobs from `k3-ctl serve` over the job protocol.
//! * [`report`] — the run report (the step table, totals, `--out`, dumps).
//! * [`visible`] — which ids are printed as text (never an added token's content).

pub mod batch_file;
pub mod chat;
pub mod cli;
pub mod drafters;
pub mod error;
pub mod job;
pub mod perplexity;
pub mod prompt;
pub mod report;
pub mod serve;
pub mod source;

pub use error::JobError;

/// The whole `k3-worker` process after parsing: the front end of the input its command line
/// names, and its exit code through the one error-to-exit mapping ([`k3_proto::exit::report`]).
pub fn run(cli: &cli::Cli, matches: &clap::ArgMatches) -> i32 {
    if cli.serve_channel {
        // The jobs arrive from k3-ctl serve; their ends also go back as typed messages (the
        // exit code through the same mapping).
        return serve::run(cli, matches);
    }
    let result = if cli.chat {
        chat::run(cli, matches)
    } else if cli.batch.is_some() {
        batch_file::run(cli, matches)
    } else if cli.perplexity.is_some() {
        perplexity::run(cli, matches)
    } else {
        prompt::run(cli, matches)
    };
    k3_proto::exit::report("k3-worker", result)
}
