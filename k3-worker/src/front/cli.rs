//! The `k3-worker` command line. Clap validates it: one input (`--ids`, `--prompt`,
//! `--prompt-file`, `--batch` or `--chat`), text inputs need `--tok`, the memory flags need `--standalone`,
//! chat-only flags need `--chat`, ranges and names are checked before any work (exit 2).

use std::path::PathBuf;

use clap::{ArgGroup, CommandFactory, FromArgMatches, Parser, ValueEnum};
use k3_store::cli::{BudgetArgs, SocketArgs};

use crate::engine::spec::{DraftExperts, SpecMode};
use crate::text::xtml::Effort;

use crate::engine::memory::PrefillChunk;

/// Most tokens one request may generate.
pub const MAX_GEN: u64 = 4096;
/// Longest prompt accepted, in tokens.
pub const MAX_PROMPT: usize = 32_768;
/// Largest prompt file read, in bytes.
pub const MAX_PROMPT_FILE: u64 = 16 << 20;
/// Most requests in a `--batch` file.
pub const MAX_BATCH_REQUESTS: usize = 4096;
/// Most sequences decoded at once (`--parallel`).
pub const MAX_PARALLEL: u64 = 256;
/// Longest chat context accepted, in positions.
pub const MAX_CTX: u64 = 1 << 18;
/// Chat context without --ctx, in positions.
pub const DEFAULT_CTX: usize = 4096;

fn session_name(s: &str) -> Result<String, k3_store::session::SessionError> {
    k3_store::session::check_name(s).map(|()| s.to_string())
}

/// Thinking effort of a chat (SPEC.md §5.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum EffortArg {
    /// Low.
    Low,
    /// Medium (disputed, SPEC.md §10 C4).
    Medium,
    /// High.
    High,
    /// Max.
    Max,
}

impl From<EffortArg> for Effort {
    fn from(e: EffortArg) -> Self {
        match e {
            EffortArg::Low => Effort::Low,
            EffortArg::Medium => Effort::Medium,
            EffortArg::High => Effort::High,
            EffortArg::Max => Effort::Max,
        }
    }
}

/// The routed experts a draft model runs (`--draft-experts`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DraftExpertsArg {
    /// The routed experts the job's cache holds at that moment (never a read), and the shared
    /// experts.
    Resident,
    /// The shared experts alone.
    Shared,
}

impl From<DraftExpertsArg> for DraftExperts {
    fn from(e: DraftExpertsArg) -> Self {
        match e {
            DraftExpertsArg::Resident => DraftExperts::Resident,
            DraftExpertsArg::Shared => DraftExperts::Shared,
        }
    }
}

/// A drafter for speculative decoding (`crate::engine::spec`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DraftArg {
    /// The store's history of earlier jobs' token streams.
    History,
    /// N-gram lookup over the job's own ids.
    Ngram,
    /// A given continuation with injected misses (--draft-replay).
    Replay,
    /// A quantized draft of the model held in this process's memory (--draft-trunk DIR,
    /// written by `k3-ctl pack-trunk --draft int8|int4`).
    Model,
}

/// The inputs other than `--chat`: the chat-only flags conflict with them.
const NOT_CHAT: [&str; 6] = [
    "ids",
    "prompt",
    "prompt_file",
    "batch",
    "serve_channel",
    "perplexity",
];

/// The inputs other than `--batch` and `--serve-channel` (`--parallel` conflicts with them
/// rather than requiring one of those two, for the reason given at `no_think`).
const NOT_BATCH: [&str; 5] = ["ids", "prompt", "prompt_file", "chat", "perplexity"];

/// The inputs `--ctx` means nothing for.
const NOT_CTX: [&str; 5] = ["ids", "prompt", "prompt_file", "batch", "perplexity"];

/// What scoring a text (`--perplexity`) does not combine with: generation's flags, the
/// drafters, sessions and the per-run dumps (every id of the text is scored, none generated).
const PPL_CONFLICTS: [&str; 12] = [
    "gen",
    "temperature",
    "top_p",
    "seed",
    "session",
    "full_recompute",
    "dump_logits",
    "dump_hidden",
    "dump_cache_trace",
    "draft_trunk",
    "draft_replay",
    "spec",
];

/// What the job messages of `--serve-channel` give, and what a worker serving many jobs has no
/// use for (the flags conflict with it).
const FROM_THE_JOB: [&str; 11] = [
    "gen",
    "temperature",
    "top_p",
    "seed",
    "session",
    "dump_logits",
    "dump_hidden",
    "dump_cache_trace",
    "standalone",
    "full_recompute",
    "draft_replay",
];

/// What `--batch` does not combine with: the one-sequence dumps, sessions, the check mode and
/// the replay drafter (one continuation for one prompt).
const BATCH_CONFLICTS: [&str; 6] = [
    "session",
    "full_recompute",
    "dump_logits",
    "dump_hidden",
    "dump_cache_trace",
    "draft_replay",
];

/// Run the Kimi K3 model on one prompt, or chat.
#[derive(Parser, Debug, Clone)]
#[command(name = "k3-worker", version = k3_proto::VERSION, about, long_about = None)]
#[command(group(ArgGroup::new("input").required(true).args(["ids", "prompt", "prompt_file", "batch", "chat", "serve_channel", "perplexity"])))]
pub struct Cli {
    /// Run the store logic in-process on this checkpoint directory (config.json + shards).
    /// Without it the worker attaches to a running `k3-store` (see --socket).
    #[arg(long, value_name = "MODEL_DIR")]
    pub standalone: Option<PathBuf>,
    /// Store socket (attached mode).
    #[command(flatten)]
    pub socket: SocketArgs,
    /// Memory budget (--standalone only; an attached worker uses the store's).
    #[command(flatten)]
    pub budget: BudgetArgs,
    /// Prompt as token ids, comma separated (no tokenizer needed).
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub ids: Option<Vec<u32>>,
    /// Prompt text (needs --tok).
    #[arg(long, value_name = "TEXT", requires = "tok")]
    pub prompt: Option<String>,
    /// Prompt read verbatim from a file (needs --tok; UTF-8).
    #[arg(long, value_name = "PATH", requires = "tok")]
    pub prompt_file: Option<PathBuf>,
    /// Run many prompts together (continuous batching): a JSON Lines file, one request per
    /// line — `{"prompt": "text"}` (needs --tok) or `{"ids": [1, 2, 3]}`, optionally with
    /// `"max_tokens": N` (default --gen). Up to --parallel sequences run at once, ONE forward
    /// pass per step over all their rows (each weight read once for all of them, drafted ids
    /// included); the others join as sequences end. Each sequence's ids are those it gets alone
    /// (same sampling flags, same seed). Results go to stdout as JSON Lines as sequences end;
    /// --out writes the run report with a record per request.
    #[arg(long, value_name = "FILE", conflicts_with_all = BATCH_CONFLICTS)]
    pub batch: Option<PathBuf>,
    /// Sequences decoded at once with --batch (default 4), or with --serve-channel the slots of
    /// this worker: the jobs from `k3-ctl serve` it decodes at once (default 1; each slot
    /// planned for --ctx positions, and one job may take up to the longest request). Their
    /// states and the pass's rows are in the memory plan.
    #[arg(long, value_name = "N", conflicts_with_all = NOT_BATCH,
          value_parser = clap::value_parser!(u64).range(1..=MAX_PARALLEL))]
    pub parallel: Option<u64>,
    /// Tokenizer directory (tiktoken.model + tokenizer_config.json); with --serve-channel, the
    /// vocabulary constrained jobs' grammars are compiled over.
    #[arg(long, value_name = "DIR")]
    pub tok: Option<PathBuf>,
    /// Tokens to generate (per chat reply with --chat, where the default is 256).
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u64).range(1..=MAX_GEN))]
    pub gen: u64,
    /// Re-run the whole prefix every step instead of carrying state (must give identical ids).
    #[arg(long)]
    pub full_recompute: bool,
    /// Sampling temperature; 0 = greedy argmax.
    #[arg(long, value_name = "T", default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus mass for sampling, in (0, 1].
    #[arg(long, value_name = "P", default_value_t = 1.0)]
    pub top_p: f32,
    /// Sampling seed.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Run the prompt in forward calls of at most N tokens (bounds prefill memory; 0 = all at
    /// once; results are identical for any N). `auto` (the default): the longest chunk whose
    /// pass fits what the memory plan allows a prefill (the preset's `prefill_gb`; with
    /// `--preset auto` or attached, an eighth of the memory auto plans for; with only
    /// --trunk-gb/--cache-gb, DEFAULT_PREFILL_CHUNK), so a long prompt reads the experts fewer
    /// times. A serve worker keeps DEFAULT_PREFILL_CHUNK.
    #[arg(long, value_name = "N|auto", default_value = "auto", value_parser = PrefillChunk::parse)]
    pub prefill_chunk: PrefillChunk,
    /// Compute threads (default: all cores; at most the CPUs this process may use).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub threads: Option<u64>,
    /// Write the run report as JSON.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Write the step-0 logits (last prompt position) as raw little-endian f32.
    #[arg(long, value_name = "FILE")]
    pub dump_logits: Option<PathBuf>,
    /// Write every (step, layer, experts) request to DIR/expert_trace.jsonl.
    #[arg(long, value_name = "DIR")]
    pub dump_cache_trace: Option<PathBuf>,
    /// Write the prefill's per-layer intermediates as DIR/L<n>.<site>.npy (site: attn_in,
    /// attn_out, mlp_in, mlp_out) and DIR/final_in.npy (f32 [tokens, hidden]; the names of the
    /// reference's --dump-trace).
    #[arg(long, value_name = "DIR")]
    pub dump_hidden: Option<PathBuf>,
    /// Bind and run only the first N layers (for partial shard sets; logits are then not the
    /// model's).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub layers: Option<u64>,
    /// Speculative decoding: `auto` (drafts when the measured acceptance and pass costs say it
    /// pays), `off`, or a fixed number of drafted ids per pass (1-16). The ids are the same
    /// in every mode.
    #[arg(
        long,
        value_name = "auto|off|N",
        default_value = "auto",
        conflicts_with = "full_recompute"
    )]
    pub spec: SpecMode,
    /// Drafters, tried in order: `history` (the store's earlier jobs; attached only), `ngram`
    /// (the job's own ids), `model` (a quantized draft model: --draft-trunk), `replay`
    /// (benchmarks: --draft-replay).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "history,ngram"
    )]
    pub draft: Vec<DraftArg>,
    /// The draft trunk the `model` drafter runs (a directory written by `k3-ctl pack-trunk
    /// --draft int8|int4 MODEL_DIR DIR`); it is loaded into this process's memory, which the
    /// memory plan counts.
    #[arg(long, value_name = "DIR")]
    pub draft_trunk: Option<PathBuf>,
    /// The routed experts the draft model runs: `resident` (those the job's expert cache holds
    /// at that moment; never a read) or `shared` (the shared experts alone).
    #[arg(long, value_name = "resident|shared", default_value = "resident")]
    pub draft_experts: DraftExpertsArg,
    /// The continuation the replay drafter proposes: a file of ids (JSON list or separated by
    /// commas/whitespace), e.g. an earlier run's generated ids.
    #[arg(long, value_name = "FILE")]
    pub draft_replay: Option<PathBuf>,
    /// Share of the replayed ids made wrong, in [0, 1] (benchmarks of acceptance).
    #[arg(
        long,
        value_name = "R",
        default_value_t = 0.0,
        requires = "draft_replay"
    )]
    pub draft_miss_rate: f64,
    /// Seed of the replay drafter's miss pattern.
    #[arg(long, value_name = "S", default_value_t = 0, requires = "draft_replay")]
    pub draft_seed: u64,
    /// Multi-turn chat in the XTML format: user turns from stdin, one per line (needs --tok).
    #[arg(long, requires = "tok",
          conflicts_with_all = ["full_recompute", "dump_logits", "dump_hidden", "dump_cache_trace"])]
    pub chat: bool,
    /// Keep the conversation in the store under NAME (attached mode): resume it if the store has
    /// it (prefilling only what is new) and hand the state back after each chat turn or at the
    /// end of a one-shot run.
    #[arg(long, value_name = "NAME", value_parser = session_name, conflicts_with_all = ["standalone", "full_recompute"])]
    pub session: Option<String>,
    // The chat-only flags conflict with the other inputs rather than `requires = "chat"`: clap
    // lets any member of a group satisfy a `requires` on another (clap-rs/clap#4707), so
    // `--ids 1 --tok T --ctx 9` passed and the flag was silently ignored. The `input` group
    // is required, so "none of the others" is "--chat".
    /// Chat without the think channel (no thinking-effort system message; thinking is on by
    /// default).
    #[arg(long, conflicts_with_all = NOT_CHAT)]
    pub no_think: bool,
    /// Thinking effort of the chat (default low).
    #[arg(
        long,
        value_name = "LEVEL",
        value_enum,
        conflicts_with_all = NOT_CHAT,
        conflicts_with = "no_think"
    )]
    pub effort: Option<EffortArg>,
    /// Most tokens of a chat reply's thinking: when they are spent the think channel is closed
    /// for the model and it answers (default: half of the reply's tokens).
    #[arg(long, value_name = "N", conflicts_with_all = NOT_CHAT, conflicts_with = "no_think",
          value_parser = clap::value_parser!(u64).range(0..=MAX_GEN))]
    pub think_budget: Option<u64>,
    /// Take jobs from `k3-ctl serve` over the Unix socket that is this process's standard
    /// input, for as long as serve keeps it open (the job protocol, docs/SPEC.md §6.12): each
    /// job's prompt ids, sampling and session arrive as a message, its ids and its end go back
    /// as messages, and a cancel ends it at the next step. Up to --parallel jobs are decoded at
    /// once. serve builds this command line (`serve_channel_args` in this file).
    #[arg(long, conflicts_with_all = FROM_THE_JOB)]
    pub serve_channel: bool,
    /// Score the text of FILE with teacher forcing (needs --tok) instead of generating: every
    /// id's negative log-likelihood, in windows of --ppl-window ids each run after [BOS] from a
    /// fresh state (docs/SPEC.md §6.16); reports mean NLL and perplexity (and, with --kl-base,
    /// KL divergence and top-1 agreement) on stderr and in --out.
    #[arg(long, value_name = "FILE", requires = "tok", conflicts_with_all = PPL_CONFLICTS)]
    pub perplexity: Option<PathBuf>,
    /// With --perplexity: ids per window.
    #[arg(long, value_name = "N", default_value_t = crate::eval::DEFAULT_WINDOW as u64,
          requires = "perplexity", value_parser = clap::value_parser!(u64).range(1..=MAX_CTX))]
    pub ppl_window: u64,
    /// With --perplexity: write every scored position's log-probabilities to FILE (the base of
    /// a later --kl-base comparison; 4 bytes per vocabulary id per position).
    #[arg(long, value_name = "FILE", requires = "perplexity")]
    pub save_logprobs: Option<PathBuf>,
    /// With --perplexity: compare with the log-probabilities an earlier run saved in FILE (the
    /// same text and window): mean and 99th-percentile KL divergence, top-1 agreement.
    #[arg(long, value_name = "FILE", requires = "perplexity")]
    pub kl_base: Option<PathBuf>,
    /// Chat context in positions (the whole conversation plus one reply must fit); with
    /// --serve-channel, the positions each slot is planned for.
    #[arg(long, value_name = "N", conflicts_with_all = NOT_CTX, default_value_t = DEFAULT_CTX as u64,
          value_parser = clap::value_parser!(u64).range(1..=MAX_CTX))]
    pub ctx: u64,
}

impl Cli {
    /// The command with the cross-group rules the derive cannot state: memory flags and
    /// `--trunk` need `--standalone`; `--socket` conflicts with it.
    pub fn command_checked() -> clap::Command {
        let mut cmd = Cli::command().mut_arg("socket", |a| a.conflicts_with("standalone"));
        for id in BudgetArgs::IDS {
            cmd = cmd.mut_arg(id, |a| a.requires("standalone").conflicts_with("socket"));
        }
        cmd
    }

    /// Parse the process arguments (usage errors exit 2, `--help`/`--version` 0), keeping the
    /// matches (the budget needs their order).
    pub fn parse_with_matches() -> (Cli, clap::ArgMatches) {
        let matches = Cli::command_checked().get_matches();
        match Cli::from_arg_matches(&matches) {
            Ok(cli) => (cli, matches),
            Err(e) => e.exit(),
        }
    }

    /// Parse `args` (tests).
    pub fn try_parse_with_matches<I, T>(args: I) -> Result<(Cli, clap::ArgMatches), clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let matches = Cli::command_checked().try_get_matches_from(args)?;
        Ok((Cli::from_arg_matches(&matches)?, matches))
    }
}

/// The command line of a worker that takes its jobs from `k3-ctl serve` (`--serve-channel`):
/// the one place its flags are spelled for serve, checked against [`Cli`] by a test. It decodes
/// up to `slots` jobs at once, each slot planned for `positions`; `tok` (serve's tokenizer)
/// compiles the grammars of constrained jobs.
pub fn serve_channel_args(
    socket: &std::path::Path,
    threads: Option<usize>,
    slots: usize,
    positions: usize,
    tok: Option<&std::path::Path>,
) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = vec![
        "--serve-channel".into(),
        "--socket".into(),
        socket.as_os_str().to_owned(),
    ];
    if let Some(t) = threads {
        args.push("--threads".into());
        args.push(t.to_string().into());
    }
    args.push("--parallel".into());
    args.push(slots.to_string().into());
    args.push("--ctx".into());
    args.push(positions.to_string().into());
    if let Some(dir) = tok {
        args.push("--tok".into());
        args.push(dir.as_os_str().to_owned());
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_channel_args_parse_back_into_the_cli() {
        let args = serve_channel_args(
            std::path::Path::new("/run/k3/store.sock"),
            Some(3),
            1,
            64,
            Some(std::path::Path::new("/k3/tokenizer")),
        );
        let c = Cli::try_parse_with_matches(std::iter::once("k3-worker".into()).chain(args))
            .unwrap()
            .0;
        assert!(c.serve_channel);
        assert_eq!(
            c.socket.socket.as_deref(),
            Some(std::path::Path::new("/run/k3/store.sock"))
        );
        assert_eq!(c.threads, Some(3));
        assert_eq!(
            c.tok.as_deref(),
            Some(std::path::Path::new("/k3/tokenizer"))
        );
        let args = serve_channel_args(std::path::Path::new("/s"), None, 4, 5000, None);
        let c = Cli::try_parse_with_matches(std::iter::once("k3-worker".into()).chain(args))
            .unwrap()
            .0;
        assert_eq!((c.parallel, c.ctx), (Some(4), 5000));
        // The job message gives the prompt, sampling and session: the flags are refused.
        for extra in [&["--ids", "1"][..], &["--gen", "3"], &["--session", "s"]] {
            let mut a = vec!["k3-worker", "--serve-channel"];
            a.extend_from_slice(extra);
            assert!(Cli::try_parse_with_matches(a.clone()).is_err(), "{a:?}");
        }
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_with_matches(std::iter::once("k3-worker").chain(args.iter().copied()))
            .map(|c| c.0)
    }

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command_checked().debug_assert();
    }

    #[test]
    fn exactly_one_input_and_its_requirements() {
        assert!(parse(&["--standalone", "m"]).is_err(), "no input");
        assert!(
            parse(&["--ids", "1", "--prompt", "x", "--tok", "t"]).is_err(),
            "two inputs"
        );
        assert!(parse(&["--prompt", "x"]).is_err(), "text without --tok");
        assert!(parse(&["--chat"]).is_err(), "chat without --tok");
        assert!(
            parse(&["--ids", "1", "--ctx", "9"]).is_err(),
            "--ctx needs --chat"
        );
        assert!(parse(&["--ids", "1", "--effort", "high"]).is_err());
        // With --tok present too (clap-rs/clap#4707 let these through, the flag then ignored).
        for flag in [&["--ctx", "9"][..], &["--effort", "high"], &["--no-think"]] {
            for input in [
                &["--ids", "1"][..],
                &["--prompt", "x"],
                &["--prompt-file", "p"],
            ] {
                let mut args = input.to_vec();
                args.extend_from_slice(&["--tok", "t"]);
                args.extend_from_slice(flag);
                assert!(parse(&args).is_err(), "{args:?} needs --chat");
            }
            let mut args = vec!["--chat", "--tok", "t"];
            args.extend_from_slice(flag);
            assert!(parse(&args).is_ok(), "{args:?}");
        }
        assert_eq!(parse(&["--ids", "1"]).unwrap().ctx, DEFAULT_CTX as u64);
        assert!(parse(&["--chat", "--tok", "t", "--effort", "low", "--no-think"]).is_err());
        let c = parse(&["--chat", "--tok", "t", "--effort", "medium"]).unwrap();
        assert_eq!(c.effort, Some(EffortArg::Medium));
        assert_eq!(parse(&["--ids", "5,6,7"]).unwrap().ids, Some(vec![5, 6, 7]));
        // --batch is an input of its own; --parallel needs it; the one-sequence outputs conflict.
        let c = parse(&["--batch", "b.jsonl"]).unwrap();
        assert_eq!((c.batch.is_some(), c.parallel), (true, None));
        let c = parse(&["--serve-channel", "--parallel", "3", "--ctx", "100"]).unwrap();
        assert_eq!((c.parallel, c.ctx), (Some(3), 100));
        assert!(parse(&["--batch", "b", "--ids", "1"]).is_err());
        assert!(parse(&["--ids", "1", "--parallel", "2"]).is_err());
        assert!(parse(&["--batch", "b", "--parallel", "0"]).is_err());
        assert!(parse(&["--batch", "b", "--parallel", "257"]).is_err());
        assert!(parse(&["--batch", "b", "--out", "o"]).is_ok());
        for flag in [&["--session", "s"][..], &["--dump-logits", "l"]] {
            let mut args = vec!["--batch", "b"];
            args.extend_from_slice(flag);
            assert!(parse(&args).is_err(), "{args:?}");
        }
    }

    #[test]
    fn ranges_and_mode_rules_are_clap_errors() {
        assert!(parse(&["--ids", "1", "--gen", "0"]).is_err());
        assert!(parse(&["--ids", "1", "--gen", "4097"]).is_err());
        assert!(parse(&["--ids", "1", "--threads", "0"]).is_err());
        assert!(
            parse(&["--ids", "1", "--preset", "laptop"]).is_err(),
            "budget needs --standalone"
        );
        // The preload is the store's (`k3-store start --preload`) for an attached worker.
        assert!(parse(&["--ids", "1", "--preload", "on"]).is_err());
        assert!(
            parse(&["--ids", "1"]).is_ok(),
            "the default --preload needs nothing"
        );
        assert!(parse(&["--ids", "1", "--standalone", "m", "--preload", "off"]).is_ok());
        assert!(parse(&["--ids", "1", "--standalone", "m", "--socket", "s"]).is_err());
        assert!(parse(&["--ids", "1", "--socket", "s", "--cache-gb", "1"]).is_err());
        assert!(parse(&["--ids", "1", "--standalone", "m", "--preset", "laptop"]).is_ok());
        assert!(parse(&["--ids", "1", "--layers", "0"]).is_err());
        assert_eq!(parse(&["--ids", "1"]).unwrap().gen, 8);
    }

    #[test]
    fn sessions_are_attached_only_and_named_safely() {
        let c = parse(&["--chat", "--tok", "t", "--session", "s-1", "--out", "o"]).unwrap();
        assert_eq!(c.session.as_deref(), Some("s-1"));
        assert!(parse(&["--ids", "1", "--session", "s"]).is_ok());
        let e = parse(&["--ids", "1", "--standalone", "m", "--session", "s"]).unwrap_err();
        assert!(e.to_string().contains("--standalone"), "{e}");
        assert!(parse(&["--ids", "1", "--session", "../x"]).is_err());
        assert!(parse(&["--ids", "1", "--session", "s", "--full-recompute"]).is_err());
    }
}
