//! `k3-worker`: one generation job.
//!
//! ```text
//! k3-worker --standalone <model_dir> [--trunk DIR] [--preset NAME] [--trunk-gb X] [--cache-gb X]
//!           (--ids 1,2,3 | --prompt TEXT | --prompt-file PATH) [--tok DIR] [--gen N]
//!           [--full-recompute] [--temperature T] [--top-p P] [--seed S] [--threads N]
//!           [--out FILE] [--dump-logits FILE] [--dump-cache-trace DIR] [--layers N]
//! k3-worker … --chat --tok DIR [--no-think | --effort low|medium|high|max] [--ctx N] [--gen N]
//! ```
//! `--chat` reads user turns from stdin, one per line, in the XTML chat format (SPEC.md §5.5;
//! see `k3_worker::chat`), keeping the sequence state between turns.
//! Without `--standalone` the worker attaches to a running `k3-store` at `--socket` (the store
//! owns the checkpoint, the budget and the expert cache; `--trunk`/`--preset`/`--*-gb` are then
//! refused). Generated text (or ids without a tokenizer) goes to stdout as tokens arrive; the run report
//! goes to stderr. Exit codes (`k3_proto::exit`): 0 ok; 1 bind/forward/I/O failure; 2 refused
//! before any work (usage, config, memory plan / KV cache that does not fit); 3 cannot attach to
//! the store; 4 the run finished
//! but a routed expert failed to load (the ids are unsound).
//!
//! `--dump-cache-trace DIR` writes `DIR/expert_trace.jsonl`: one JSON object per expert request
//! made to the weight source, in order, `{"step": S, "layer": L, "experts": [ids…]}` (step 0 is
//! the prefill; ids ascending and unique — the union over the step's tokens).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{CommandFactory, FromArgMatches, Parser};
use k3_proto::config::ModelConfig;
use k3_proto::exit;
use k3_store::attached::{AttachError, AttachOptions, AttachedSource};
use k3_store::plan::Budget;
use k3_store::source::WeightSource;
use k3_store::standalone::{StandaloneOptions, StandaloneSource};
use k3_worker::generate::{
    generate, positions_needed, GenOptions, GenReport, Sampler, DEFAULT_PREFILL_CHUNK, END_IDS,
};
use k3_worker::model::bind::ShapeTable;
use k3_worker::model::{Dims, Model, TensorShapes};
use k3_worker::tokenizer::Tokenizer;

/// Most tokens one request may generate.
const MAX_GEN: usize = 4096;
/// Longest prompt accepted, in tokens.
const MAX_PROMPT: usize = 32_768;
/// Largest prompt file read, in bytes.
const MAX_PROMPT_FILE: u64 = 16 << 20;

/// Run the Kimi K3 model on one prompt.
#[derive(Parser, Debug)]
#[command(name = "k3-worker", version, about, long_about = None)]
struct Cli {
    /// Run the store logic in-process on this checkpoint directory (config.json + shards).
    /// Without it the worker attaches to a running `k3-store` (see --socket).
    #[arg(long, value_name = "MODEL_DIR")]
    standalone: Option<PathBuf>,
    /// The store's socket (attached mode; default $XDG_RUNTIME_DIR/k3/store.sock, else
    /// /tmp/k3-$UID/store.sock).
    #[arg(long, value_name = "PATH", conflicts_with = "standalone")]
    socket: Option<PathBuf>,
    /// Packed trunk directory (trunk.bin + trunk.json) to stream layers from (--standalone).
    #[arg(long, value_name = "DIR")]
    trunk: Option<PathBuf>,
    /// Expert-cache eviction policy (--standalone): lru (default), lfu, layer, layer-lfu, lrfu,
    /// layer-lrfu, layer-age (see docs/CACHE_POLICY.md).
    #[arg(long, value_name = "NAME")]
    cache_policy: Option<String>,
    /// Memory preset (see `k3-ctl presets`; --standalone); a later memory flag overrides an
    /// earlier one.
    #[arg(long, value_name = "NAME")]
    preset: Vec<String>,
    /// Trunk budget in GB (pinned layers + ring).
    #[arg(long, value_name = "X")]
    trunk_gb: Vec<f64>,
    /// Routed-expert cache budget in GB.
    #[arg(long, value_name = "X")]
    cache_gb: Vec<f64>,
    /// Prompt as token ids, comma separated (no tokenizer needed).
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    ids: Option<Vec<u32>>,
    /// Prompt text (needs --tok).
    #[arg(long, value_name = "TEXT")]
    prompt: Option<String>,
    /// Prompt read verbatim from a file (needs --tok).
    #[arg(long, value_name = "PATH")]
    prompt_file: Option<PathBuf>,
    /// Tokenizer directory (tiktoken.model + tokenizer_config.json).
    #[arg(long, value_name = "DIR")]
    tok: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(long, value_name = "N", default_value_t = 8)]
    gen: usize,
    /// Re-run the whole prefix every step instead of carrying state (must give identical ids).
    #[arg(long)]
    full_recompute: bool,
    /// Sampling temperature; 0 = greedy argmax.
    #[arg(long, value_name = "T", default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus mass for sampling.
    #[arg(long, value_name = "P", default_value_t = 1.0)]
    top_p: f32,
    /// Sampling seed.
    #[arg(long, value_name = "S", default_value_t = 0)]
    seed: u64,
    /// Run the prompt in forward calls of at most N tokens (bounds prefill memory; 0 = all at
    /// once; results are identical for any N).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// Compute threads (default: all cores).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Write the run report as JSON.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Write the step-0 logits (last prompt position) as raw little-endian f32.
    #[arg(long, value_name = "FILE")]
    dump_logits: Option<PathBuf>,
    /// Write every (step, layer, experts) request to DIR/expert_trace.jsonl.
    #[arg(long, value_name = "DIR")]
    dump_cache_trace: Option<PathBuf>,
    /// Write the prefill's per-layer intermediates as DIR/L{n}.{attn_in,attn_out,mlp_in,mlp_out}.npy
    /// and DIR/final_in.npy (f32 [tokens, hidden]; same names as the reference's --dump-trace).
    #[arg(long, value_name = "DIR")]
    dump_hidden: Option<PathBuf>,
    /// Bind and run only the first N layers (for partial shard sets; logits are then not the
    /// model's).
    #[arg(long, value_name = "N")]
    layers: Option<usize>,
    /// Multi-turn chat in the XTML format: user turns from stdin, one per line (needs --tok).
    #[arg(long, conflicts_with_all = ["ids", "prompt", "prompt_file", "full_recompute", "out", "dump_logits", "dump_hidden", "dump_cache_trace"])]
    chat: bool,
    /// Chat with the think channel (the default).
    #[arg(long, conflicts_with = "no_think")]
    think: bool,
    /// Chat without the think channel (no thinking-effort system message).
    #[arg(long)]
    no_think: bool,
    /// Thinking effort: low, medium (disputed, see SPEC.md §10 C4), high, max (default).
    #[arg(long, value_name = "LEVEL", conflicts_with = "no_think")]
    effort: Option<String>,
    /// Chat context in positions (the whole conversation plus one reply must fit; default
    /// 4096).
    #[arg(long, value_name = "N")]
    ctx: Option<usize>,
}

/// A failure with its exit code.
struct Fail(i32, String);

fn refuse(msg: impl Into<String>) -> Fail {
    Fail(exit::REFUSED, msg.into())
}

fn main() {
    let matches = match Cli::command().try_get_matches() {
        Ok(m) => m,
        Err(e) => e.exit(), // usage errors exit 2, --help/--version 0
    };
    let code = match Cli::from_arg_matches(&matches) {
        Ok(cli) => match run(&cli, &matches) {
            Ok(code) => code,
            Err(Fail(code, msg)) => {
                eprintln!("k3-worker: {msg}");
                code
            }
        },
        Err(e) => e.exit(),
    };
    std::process::exit(code);
}

/// Peak resident set size of this process, in bytes.
fn peak_rss_bytes() -> u64 {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `rusage` into the valid, properly aligned buffer we pass.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    if rc != 0 {
        return 0;
    }
    // SAFETY: getrusage returned 0, so the struct is initialised (and it was zeroed before).
    let ru = unsafe { ru.assume_init() };
    ru.ru_maxrss.max(0) as u64 * 1024 // kilobytes on Linux
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

/// The prompt ids, from exactly one of --ids, --prompt, --prompt-file.
fn prompt_ids(cli: &Cli, tok: Option<&Tokenizer>) -> Result<Vec<u32>, Fail> {
    let given = [
        cli.ids.is_some(),
        cli.prompt.is_some(),
        cli.prompt_file.is_some(),
    ];
    if given.iter().filter(|&&g| g).count() != 1 {
        return Err(refuse(
            "give exactly one prompt source: --ids, --prompt or --prompt-file",
        ));
    }
    let ids = if let Some(ids) = &cli.ids {
        ids.clone()
    } else {
        let tok = tok.ok_or_else(|| refuse("--prompt/--prompt-file need --tok DIR"))?;
        let bytes = match (&cli.prompt, &cli.prompt_file) {
            (Some(p), _) => p.as_bytes().to_vec(),
            (None, Some(path)) => read_bounded(path, MAX_PROMPT_FILE)?,
            (None, None) => unreachable!("one prompt source was checked above"),
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

fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, Fail> {
    let meta = std::fs::metadata(path).map_err(|e| refuse(format!("{}: {e}", path.display())))?;
    if meta.len() > max {
        return Err(refuse(format!(
            "{}: {} bytes exceeds the {max}-byte limit",
            path.display(),
            meta.len()
        )));
    }
    std::fs::read(path).map_err(|e| refuse(format!("{}: {e}", path.display())))
}

fn run(cli: &Cli, matches: &clap::ArgMatches) -> Result<i32, Fail> {
    let wall = Instant::now();
    // ---- everything that can be refused, before any work
    // The SIMD tier is chosen once, here: a forced tier (K3_SIMD) that is unknown or that this
    // CPU lacks is a refusal, never a crash or a silent fallback.
    let tier = k3_worker::kernels::select_tier().map_err(|e| refuse(e.to_string()))?;
    eprintln!("kernels: {} tier", tier.name());
    if cli.gen == 0 || cli.gen > MAX_GEN {
        return Err(refuse(format!("--gen {} outside 1..={MAX_GEN}", cli.gen)));
    }
    let sampler = Sampler::new(cli.temperature, cli.top_p, cli.seed).map_err(refuse)?;
    let budget = match &cli.standalone {
        Some(_) => {
            Some(Budget::from_matches(matches, "preset", "trunk_gb", "cache_gb").map_err(refuse)?)
        }
        None if !cli.preset.is_empty()
            || !cli.trunk_gb.is_empty()
            || !cli.cache_gb.is_empty()
            || cli.trunk.is_some()
            || cli.cache_policy.is_some() =>
        {
            return Err(refuse(
                "--trunk/--preset/--trunk-gb/--cache-gb/--cache-policy need --standalone (an attached worker uses the store's)",
            ))
        }
        None => None,
    };
    if let Some(t) = cli.threads {
        if t == 0 {
            return Err(refuse("--threads must be ≥ 1"));
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .map_err(|e| refuse(format!("--threads {t}: {e}")))?;
    }
    let tok = match &cli.tok {
        Some(dir) => Some(
            Tokenizer::from_dir(dir)
                .map_err(|e| refuse(format!("tokenizer {}: {e}", dir.display())))?,
        ),
        None => None,
    };
    let (prompt, thinking) = if cli.chat {
        (Vec::new(), chat_setup(cli, tok.as_ref())?)
    } else if cli.think || cli.no_think || cli.effort.is_some() || cli.ctx.is_some() {
        return Err(refuse("--think/--no-think/--effort/--ctx need --chat"));
    } else {
        (prompt_ids(cli, tok.as_ref())?, None)
    };

    // Attached mode: connect first (the store tells us which checkpoint it serves).
    let attached = match &cli.standalone {
        Some(_) => None,
        None => {
            let socket = cli.socket.clone().unwrap_or_else(|| {
                // SAFETY: getuid has no preconditions and cannot fail.
                k3_proto::paths::default_socket(unsafe { libc::getuid() })
            });
            let (src, info) = AttachedSource::attach(&socket, &AttachOptions::default()).map_err(
                |e| match e {
                    AttachError::NoStore(m) => {
                        Fail(exit::NO_STORE, format!("{}: {m}", socket.display()))
                    }
                    AttachError::Mismatch(m) => Fail(exit::NO_STORE, m),
                },
            )?;
            eprintln!(
                "attached to {} in {:.3} s: model {}, {} pinned layers, {:.3} GB shared, {} expert slots, ring {:.3} GB",
                socket.display(),
                info.attach_seconds,
                info.model_dir.display(),
                info.pinned_layers,
                gb(info.shm_bytes),
                info.slots,
                gb(info.ring_bytes)
            );
            Some((src, info))
        }
    };
    let model_dir: PathBuf = match (&cli.standalone, &attached) {
        (Some(d), _) => d.clone(),
        (None, Some((_, info))) => info.model_dir.clone(),
        (None, None) => unreachable!("attached mode was entered above"),
    };
    let cfg_path = model_dir.join("config.json");
    let mut cfg =
        ModelConfig::load(&cfg_path).map_err(|e| refuse(format!("{}: {e}", cfg_path.display())))?;
    if let Some(n) = cli.layers {
        if n == 0 || n > cfg.num_hidden_layers {
            return Err(refuse(format!(
                "--layers {n} outside 1..={}",
                cfg.num_hidden_layers
            )));
        }
        cfg = cfg.with_layers(n);
    }
    let dims = Dims::from_config(&cfg).map_err(|e| refuse(e.to_string()))?;
    if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= dims.vocab) {
        return Err(refuse(format!(
            "prompt id {bad} outside the vocabulary of {}",
            dims.vocab
        )));
    }
    eprintln!(
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

    // The per-sequence state for the whole request is planned up front: the source's plan
    // includes it and refuses (exit 2) when the total does not fit.
    let positions = if cli.chat {
        cli.ctx.unwrap_or(DEFAULT_CTX)
    } else {
        positions_needed(prompt.len(), cli.gen)
    };
    eprintln!(
        "sequence state: {} positions -> MLA latent cache {:.3} GB ({} B/position over {} layers) + KDA state {:.3} GB",
        positions,
        gb(dims.mla_cache_bytes(positions as u64)),
        dims.mla_cache_bytes(1),
        dims.n_mla(),
        gb(dims.kda_state_bytes())
    );
    let standalone;
    let source: &dyn WeightSource = match (attached.as_ref(), budget.as_ref()) {
        (Some((src, info)), _) => {
            // The store holds the weights; this process holds the sequence state and its ring.
            let need = dims.kda_state_bytes() + dims.mla_cache_bytes(positions as u64);
            let avail = k3_store::plan::mem_available().map_err(refuse)?;
            if need > avail {
                return Err(refuse(format!(
                    "REFUSING TO START: the sequence state needs {:.3} GB but only {:.3} GB is available",
                    gb(need),
                    gb(avail)
                )));
            }
            eprintln!(
                "worker memory: sequence state {:.3} GB + ring {:.3} GB; available {:.3} GB",
                gb(need),
                gb(info.ring_bytes),
                gb(avail)
            );
            src
        }
        (None, Some(budget)) => {
            let opts = StandaloneOptions {
                context_len: positions,
                cache_policy: cli.cache_policy.clone().unwrap_or_else(|| "lru".into()),
                ..StandaloneOptions::default()
            };
            let (src, plan) = StandaloneSource::open(
                &model_dir,
                cli.trunk.as_deref(),
                budget,
                cli.layers,
                &opts,
                &mut |what, done, total| {
                    if done == total {
                        eprintln!("loaded {what}: {done}/{total}");
                    }
                },
            )
            .map_err(|e| Fail(e.exit_code(), e.to_string()))?;
            eprintln!("{plan}");
            standalone = src;
            &standalone
        }
        (None, None) => unreachable!("standalone mode has a budget"),
    };

    let shapes = {
        let index = k3_proto::safetensors::CheckpointIndex::open(&model_dir)
            .map_err(|e| refuse(format!("{}: {e}", model_dir.display())))?;
        ShapeTable::from_index(&index, dims.n_layers)
    };
    let mut model = Model::new(dims, source, Some(&shapes as &dyn TensorShapes))
        .map_err(|e| Fail(exit::FAILURE, e.to_string()))?;
    if cli.dump_cache_trace.is_some() {
        model.trace = Some(Vec::new());
    }
    type Dump = std::rc::Rc<std::cell::RefCell<(bool, Vec<(String, Vec<f32>)>)>>;
    let hidden_dump: Dump = Default::default();
    if cli.dump_hidden.is_some() {
        let n_layers = model.dims.n_layers;
        let sink = hidden_dump.clone();
        model.tap = Some(Box::new(move |l: usize, name: &str, v: &[f32]| {
            let mut h = sink.borrow_mut();
            if h.0 {
                return; // only the first forward (the prefill)
            }
            let key = if l == n_layers {
                name.to_string()
            } else {
                format!("L{l}.{name}")
            };
            h.1.push((key, v.to_vec()));
            if name == "final_in" {
                h.0 = true;
            }
        }));
    }

    if let (true, Some(tok)) = (cli.chat, tok.as_ref()) {
        return run_chat(cli, &mut model, tok, thinking, sampler, positions);
    }

    // ---- generation
    let gen_opts = GenOptions {
        max_new: cli.gen,
        full_recompute: cli.full_recompute,
        sampler,
        stop_ids: END_IDS.to_vec(),
        keep_step0_logits: cli.dump_logits.is_some(),
        prefill_chunk: cli.prefill_chunk,
    };
    eprintln!(
        "{:>5} {:>8} {:>9} {:>10} {:>9} {:>9} {:>8}",
        "STEP", "TOKEN", "SECONDS", "READ GB", "IO WAIT", "HIT", "TOK/S"
    );
    let stdout = std::io::stdout();
    let stats = || source.stats();
    let report = generate(&mut model, &stats, &prompt, &gen_opts, &mut |s| {
        let hit = s
            .resident_hit_rate
            .map_or("-".to_string(), |h| format!("{:.1}%", 100.0 * h));
        eprintln!(
            "{:>5} {:>8} {:>9.3} {:>10.3} {:>9.3} {:>9} {:>8.3}",
            s.step,
            s.token,
            s.seconds,
            gb(s.bytes_read),
            s.io_wait_seconds,
            hit,
            1.0 / s.seconds.max(1e-9)
        );
        let mut out = stdout.lock();
        let text = tok.as_ref().and_then(|t| t.decode(&[s.token]).ok());
        let _ = match text {
            Some(bytes) => out.write_all(&bytes),
            None => write!(out, "{} ", s.token),
        };
        let _ = out.flush();
    })
    .map_err(|e| Fail(exit::FAILURE, e.to_string()))?;
    println!();

    // ---- report
    let total = wall.elapsed().as_secs_f64();
    let mut st = source.stats();
    let counters = model.counters.clone();
    // The engine fetches experts beside its own compute: the time it was really blocked is the
    // trunk wait plus what it measured waiting for experts, not the time spent in the source.
    st.io_wait_seconds = st.trunk_wait_seconds + counters.expert_wait_seconds;
    let trace = model.trace.take();
    let hidden = model.dims.hidden;
    drop(model);
    let true_hit = if st.expert_requests > 0 {
        st.resident_hits as f64 / st.expert_requests as f64
    } else {
        0.0
    };
    let peak = peak_rss_bytes();
    let n = report.generated_ids.len();
    eprintln!(
        "{n} tokens in {:.3} s; prefill (step 0) {:.3} s; {}",
        report.steps.iter().map(|s| s.seconds).sum::<f64>(),
        report.prefill_seconds(),
        report
            .seconds_per_token()
            .map_or("no decode steps".into(), |s| format!(
                "{s:.3} s/token over steps >= 1"
            ))
    );
    eprintln!(
        "experts: requests {} resident hits {} misses {} evictions {} failed {}",
        st.expert_requests, st.resident_hits, st.misses, st.evictions, counters.failed_expert_loads
    );
    eprintln!("TRUE resident hit rate: {:.1}%", 100.0 * true_hit);
    eprintln!(
        "bytes read: {:.3} GB (trunk {:.3}, experts {:.3}); I/O share of wall clock: {:.1}%",
        gb(st.trunk_bytes_read + st.expert_bytes_read),
        gb(st.trunk_bytes_read),
        gb(st.expert_bytes_read),
        100.0 * st.io_wait_seconds / total.max(1e-9)
    );
    if let Some(h) = io_hidden_fraction(&st) {
        eprintln!(
            "I/O hidden behind compute: {:.1}% ({:.3} s reading, {:.3} s waited for)",
            100.0 * h,
            st.trunk_read_seconds + st.expert_read_seconds,
            st.io_wait_seconds
        );
    }
    eprintln!(
        "PEAK RSS for the whole run: {:.3} GB   <- quote this, not the plan",
        gb(peak)
    );
    for m in &counters.failure_messages {
        eprintln!("expert load failed: {m}");
    }

    if let Some(path) = &cli.dump_logits {
        let logits = report.step0_logits.as_deref().unwrap_or(&[]);
        let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(path, bytes)
            .map_err(|e| Fail(exit::FAILURE, format!("{}: {e}", path.display())))?;
    }
    if let (Some(dir), Some(trace)) = (&cli.dump_cache_trace, trace) {
        write_trace(dir, &trace).map_err(|e| Fail(exit::FAILURE, e))?;
    }
    if let Some(dir) = &cli.dump_hidden {
        write_hidden(dir, &hidden_dump.take().1, hidden).map_err(|e| Fail(exit::FAILURE, e))?;
    }
    if let Some(path) = &cli.out {
        let json = report_json(
            &report,
            &st,
            true_hit,
            peak,
            counters.failed_expert_loads,
            total,
        );
        std::fs::write(
            path,
            serde_json::to_string_pretty(&json).unwrap_or_default() + "\n",
        )
        .map_err(|e| Fail(exit::FAILURE, format!("{}: {e}", path.display())))?;
    }
    if counters.failed_expert_loads > 0 {
        eprintln!(
            "k3-worker: {} routed expert load(s) failed: the generated ids are unsound",
            counters.failed_expert_loads
        );
        return Ok(exit::EXPERT_LOAD_FAILED);
    }
    Ok(exit::OK)
}

/// Longest chat context accepted, in positions.
const MAX_CTX: usize = 1 << 18;
/// Chat context without --ctx, in positions.
const DEFAULT_CTX: usize = 4096;

/// Checks for `--chat` before any work; returns the thinking setting (`None` = off).
fn chat_setup(cli: &Cli, tok: Option<&Tokenizer>) -> Result<Option<k3_worker::chat::Effort>, Fail> {
    let tok = tok.ok_or_else(|| refuse("--chat needs --tok DIR"))?;
    k3_worker::chat::Markers::from_tokenizer(tok).map_err(refuse)?;
    let ctx = cli.ctx.unwrap_or(DEFAULT_CTX);
    if ctx == 0 || ctx > MAX_CTX {
        return Err(refuse(format!("--ctx {ctx} outside 1..={MAX_CTX}")));
    }
    if cli.no_think {
        return Ok(None);
    }
    let effort = cli.effort.as_deref().unwrap_or("max");
    k3_worker::chat::Effort::parse(effort)
        .map(Some)
        .map_err(refuse)
}

/// The `--chat` loop: stdin lines are user turns; exit 0 at end of input.
fn run_chat(
    cli: &Cli,
    model: &mut Model<'_>,
    tok: &Tokenizer,
    thinking: Option<k3_worker::chat::Effort>,
    sampler: Sampler,
    capacity: usize,
) -> Result<i32, Fail> {
    use k3_worker::chat::{run_repl, ChatFormat, ReplOptions, Session, TurnOptions};
    let fmt = ChatFormat::new(tok, thinking).map_err(refuse)?;
    let isatty = |fd| {
        // SAFETY: isatty only inspects the descriptor number; it has no memory preconditions.
        unsafe { libc::isatty(fd) == 1 }
    };
    let (stdin_tty, stderr_tty) = (isatty(0), isatty(2));
    eprintln!(
        "chat: thinking {}; context {capacity} positions; up to {} tokens per reply; end of input ends the session",
        thinking.map_or("off".to_string(), |e| format!("on (effort {})", e.as_str())),
        cli.gen
    );
    let mut session = Session::new(model, capacity, sampler);
    let opts = ReplOptions {
        turn: TurnOptions {
            max_new: cli.gen,
            prefill_chunk: cli.prefill_chunk,
        },
        prompt: stdin_tty,
        dim_think: stderr_tty,
    };
    let stdin = std::io::stdin();
    let summary = run_repl(
        model,
        &fmt,
        &mut session,
        &mut stdin.lock(),
        &mut std::io::stdout(),
        &mut std::io::stderr(),
        &opts,
    )
    .map_err(|e| Fail(exit::FAILURE, e))?;
    let counters = &model.counters;
    eprintln!(
        "chat: {} turns ({} refused); PEAK RSS for the whole run: {:.3} GB",
        summary.turns,
        summary.refused,
        gb(peak_rss_bytes())
    );
    for m in &counters.failure_messages {
        eprintln!("expert load failed: {m}");
    }
    if counters.failed_expert_loads > 0 {
        eprintln!(
            "k3-worker: {} routed expert load(s) failed: the generated ids are unsound",
            counters.failed_expert_loads
        );
        return Ok(exit::EXPERT_LOAD_FAILED);
    }
    Ok(exit::OK)
}

/// The share of the time spent reading weights that the engine did not wait for (reads that
/// overlapped compute): `1 − wait ÷ read`, clamped to [0, 1]; `None` when nothing was read.
fn io_hidden_fraction(st: &k3_store::source::SourceStats) -> Option<f64> {
    let read = st.trunk_read_seconds + st.expert_read_seconds;
    (read > 0.0).then(|| (1.0 - st.io_wait_seconds / read).clamp(0.0, 1.0))
}

fn write_trace(dir: &Path, trace: &[k3_worker::model::TraceRecord]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join("expert_trace.jsonl");
    let mut s = String::new();
    for r in trace {
        s.push_str(&serde_json::to_string(r).map_err(|e| e.to_string())?);
        s.push('\n');
    }
    std::fs::write(&path, s).map_err(|e| format!("{}: {e}", path.display()))
}

/// One f32 `[rows, cols]` array in `.npy` format (version 1.0).
fn npy_f32(v: &[f32], cols: usize) -> Vec<u8> {
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}",
        v.len() / cols,
        cols
    );
    // magic(6) + version(2) + len(2) + header + '\n' is a multiple of 64.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
    out
}

fn write_hidden(dir: &Path, arrays: &[(String, Vec<f32>)], cols: usize) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for (name, v) in arrays {
        let path = dir.join(format!("{name}.npy"));
        std::fs::write(&path, npy_f32(v, cols)).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

fn report_json(
    r: &GenReport,
    st: &k3_store::source::SourceStats,
    true_hit: f64,
    peak: u64,
    failed: u64,
    total: f64,
) -> serde_json::Value {
    serde_json::json!({
        "prompt_ids": r.prompt_ids,
        "generated_ids": r.generated_ids,
        "stopped_on": r.stopped_on,
        "steps": r.steps,
        "prefill_seconds": r.prefill_seconds(),
        "seconds_per_token": r.seconds_per_token(),
        "wall_seconds": total,
        "bytes_read": st.trunk_bytes_read + st.expert_bytes_read,
        "trunk_bytes_read": st.trunk_bytes_read,
        "expert_bytes_read": st.expert_bytes_read,
        "io_share": st.io_wait_seconds / total.max(1e-9),
        "io_read_seconds": st.trunk_read_seconds + st.expert_read_seconds,
        "io_wait_seconds": st.io_wait_seconds,
        "io_hidden_fraction": io_hidden_fraction(st),
        "expert_requests": st.expert_requests,
        "resident_hits": st.resident_hits,
        "true_resident_hit_rate": true_hit,
        "peak_rss_bytes": peak,
        "failed_expert_loads": failed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn memory_flags_apply_in_command_line_order() {
        let m = Cli::command()
            .try_get_matches_from([
                "k3-worker",
                "--standalone",
                "m",
                "--cache-gb",
                "40",
                "--preset",
                "server",
                "--ids",
                "1,2",
            ])
            .unwrap();
        let later_preset = Budget::from_matches(&m, "preset", "trunk_gb", "cache_gb").unwrap();
        let m = Cli::command()
            .try_get_matches_from([
                "k3-worker",
                "--standalone",
                "m",
                "--preset",
                "server",
                "--cache-gb",
                "40",
                "--ids",
                "1,2",
            ])
            .unwrap();
        let later_cache = Budget::from_matches(&m, "preset", "trunk_gb", "cache_gb").unwrap();
        assert_eq!(later_cache.cache_bytes, 40_000_000_000);
        assert_ne!(later_preset.cache_bytes, later_cache.cache_bytes);
        assert_eq!(later_preset.trunk_bytes, later_cache.trunk_bytes);
    }

    #[test]
    fn ids_parse_as_a_comma_list() {
        let cli =
            Cli::try_parse_from(["k3-worker", "--standalone", "m", "--ids", "5,6,7"]).unwrap();
        assert_eq!(cli.ids, Some(vec![5, 6, 7]));
        assert_eq!(cli.gen, 8);
    }
}
