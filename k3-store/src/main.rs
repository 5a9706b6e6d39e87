//! `k3-store`: the long-lived daemon that owns Kimi K3's weights in shared memory.
//!
//! `k3-store start <model_dir> --trunk <packed_dir> (--preset NAME | --trunk-gb X --cache-gb X)
//! [--socket PATH] [--detach]` — see the README for the whole flow.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use k3_proto::exit::{self, ExitStatus};
use k3_store::cli::{BudgetArgs, SocketArgs};
use k3_store::daemon::backend::{segment_bytes, BuildOptions, StoreBackend};
use k3_store::daemon::detach::{self, Notifier, Readiness};
use k3_store::daemon::loading::{load_behind_gate, LoadState, Loaded};
use k3_store::daemon::sessions::{
    SessionOptions, Sessions, DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_MB, MAX_SESSIONS_LIMIT,
};
use k3_store::daemon::usage::{choose_preload, UsageBook};
use k3_store::daemon::{install_signal_handlers, Server};
use k3_store::progress::Progress;
use k3_store::runtime::experts::PreloadSet;
use k3_store::runtime::plan::{allocatable, fmt_bytes, Budget, MemoryPlan, PlanInputs};

/// k3 store daemon.
#[derive(Parser, Debug)]
#[command(name = "k3-store", version = k3_proto::VERSION, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Load the resident tensors and pinned layers into shared memory and serve workers.
    Start(StartArgs),
}

#[derive(clap::Args, Debug)]
struct StartArgs {
    /// Checkpoint directory (config.json, *.safetensors, model.safetensors.index.json).
    model_dir: PathBuf,
    /// Memory budget and packed trunk (`k3-ctl pack-trunk`; without --trunk the layers are read
    /// from the checkpoint's shards). No memory flag = `--preset auto`.
    #[command(flatten)]
    budget: BudgetArgs,
    /// Store socket.
    #[command(flatten)]
    socket: SocketArgs,
    /// Return once the store is ready, leaving it running in the background.
    #[arg(long)]
    detach: bool,
    /// With --detach: the store's log file (default: store.log beside the socket).
    #[arg(long, value_name = "FILE")]
    log: Option<PathBuf>,
    /// Parallel expert reads per request.
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u64).range(1..=64))]
    io_threads: u64,
    /// Memory for kept conversations, in MB (10^6 bytes), on top of the memory plan: sessions
    /// are evicted least recently used beyond it (0: keep none).
    #[arg(long, value_name = "MB", default_value_t = DEFAULT_SESSION_MB, value_parser = session_mb)]
    session_mb: f64,
    /// Kept conversations at most (evicted least recently used beyond it; 0: keep none).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_SESSIONS,
          value_parser = clap::value_parser!(u32).range(0..=MAX_SESSIONS_LIMIT as i64))]
    max_sessions: u32,
    /// Keep conversations in this directory too, so they survive a restart (written atomically;
    /// reloaded and checked at start), and the expert usage history (`--preload hot`).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Seconds between saves of the expert usage history to --state-dir (a kill -9 loses at
    /// most the counting since the last save; a clean stop saves everything).
    #[arg(long, value_name = "SECS", default_value_t = k3_store::daemon::usage::DEFAULT_SAVE_SECONDS,
          value_parser = lease_seconds)]
    usage_save_seconds: f64,
    /// Hold this draft trunk (`k3-ctl pack-trunk --draft int8|int4 MODEL DIR`) in shared memory
    /// for the workers' draft model (`k3-worker --draft model`); counted in the memory plan.
    #[arg(long, value_name = "DIR")]
    draft_trunk: Option<PathBuf>,
    /// Token ids of earlier jobs kept for speculative drafting (oldest streams dropped first;
    /// 0: keep none, and workers draft only from their own ids). 4 bytes each.
    #[arg(long, value_name = "N", default_value_t = k3_store::daemon::history::DEFAULT_HISTORY_TOKENS as u64,
          value_parser = clap::value_parser!(u64).range(0..=(1u64 << 28)))]
    history_ids: u64,
    /// Seconds a worker may hold a layer of the trunk ring while other workers wait for room;
    /// past it the lease is broken and that worker's job fails with an error (SPEC.md §6.8).
    /// Between two passes a worker's read-ahead is protected for at most min(10 s, this).
    #[arg(long, value_name = "SECS", default_value_t = k3_store::runtime::ring::DEFAULT_LEASE_TIMEOUT.as_secs_f64(),
          value_parser = lease_seconds)]
    lease_timeout: f64,
    /// Internal: the readiness pipe of a detached start.
    #[arg(long, hide = true)]
    ready_fd: Option<i32>,
}

fn main() {
    k3_store::progress::init_logging();
    let matches = match Cli::command().try_get_matches() {
        Ok(m) => m,
        Err(e) => {
            let code = if e.use_stderr() {
                exit::REFUSED
            } else {
                exit::OK
            };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            std::process::exit(exit::REFUSED);
        }
    };
    let code = match cli.cmd {
        Cmd::Start(a) => {
            let sub = matches.subcommand_matches("start").expect("start matched");
            start(a, sub)
        }
    };
    std::process::exit(code);
}

/// Fewest connections the store starts with when the open-file limit is low.
const MIN_CONNECTIONS: u64 = 16;

fn lease_seconds(s: &str) -> Result<f64, k3_store::cli::ValueError> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && (0.1..=86_400.0).contains(&x) => Ok(x),
        _ => Err(k3_store::cli::ValueError::Seconds(s.to_string())),
    }
}

fn session_mb(s: &str) -> Result<f64, k3_store::cli::ValueError> {
    k3_store::cli::bounded(s, "MB", 1e9, "0..=1e9")
}

fn socket_path(a: &StartArgs) -> PathBuf {
    a.socket.path()
}

/// Make every path of `a` absolute (canonical where it exists) and fill in the default socket,
/// so that nothing depends on the directory the store was started from: the detached store runs
/// in `/`, and workers get these paths in the handshake.
fn resolve_paths(a: &mut StartArgs) -> Result<(), k3_proto::paths::PathError> {
    a.model_dir = k3_proto::paths::resolve(&a.model_dir)?;
    if let Some(t) = &a.budget.trunk {
        a.budget.trunk = Some(k3_proto::paths::resolve(t)?);
    }
    a.socket.socket = Some(k3_proto::paths::resolve_file(&socket_path(a))?);
    if let Some(log) = &a.log {
        a.log = Some(k3_proto::paths::resolve_file(log)?);
    }
    if let Some(d) = &a.state_dir {
        a.state_dir = Some(k3_proto::paths::resolve_file(d)?);
    }
    if let Some(d) = &a.draft_trunk {
        a.draft_trunk = Some(k3_proto::paths::resolve(d)?);
    }
    Ok(())
}

/// The budget flags exactly as given (their order decides which wins), in `--flag=value` form.
fn budget_args(m: &clap::ArgMatches) -> Vec<OsString> {
    let mut flags: Vec<(usize, String)> = Vec::new();
    if let (Some(v), Some(i)) = (m.get_many::<String>("preset"), m.indices_of("preset")) {
        flags.extend(i.zip(v).map(|(i, v)| (i, format!("--preset={v}"))));
    }
    for (id, flag) in [("trunk_gb", "--trunk-gb"), ("cache_gb", "--cache-gb")] {
        if let (Some(v), Some(i)) = (m.get_many::<f64>(id), m.indices_of(id)) {
            flags.extend(i.zip(v).map(|(i, v)| (i, format!("{flag}={v}"))));
        }
    }
    flags.sort_by_key(|f| f.0);
    flags.into_iter().map(|f| f.1.into()).collect()
}

/// The detached child's arguments: every path absolute (see [`resolve_paths`]), the budget flags
/// in their order, the other options by value. Every option of [`StartArgs`] that the child needs
/// must appear here (`child_args_round_trip` checks).
fn child_args(a: &StartArgs, m: &clap::ArgMatches) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec!["start".into(), a.model_dir.clone().into()];
    if let Some(t) = &a.budget.trunk {
        args.push("--trunk".into());
        args.push(t.clone().into());
    }
    args.extend(budget_args(m));
    args.push("--socket".into());
    args.push(socket_path(a).into());
    args.push(format!("--io-threads={}", a.io_threads).into());
    if let Some(p) = &a.budget.cache_policy {
        args.push(format!("--cache-policy={p}").into());
    }
    if let Some(p) = a.budget.preload.to_possible_value() {
        args.push(format!("--preload={}", p.get_name()).into());
    }
    // Only when given: a default --session-mb shrinks to what is left beside the plan, an
    // explicit one that does not fit is refused.
    let given = |id: &str| m.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
    if given("session_mb") {
        args.push(format!("--session-mb={}", a.session_mb).into());
    }
    args.push(format!("--max-sessions={}", a.max_sessions).into());
    if given("history_ids") {
        args.push(format!("--history-ids={}", a.history_ids).into());
    }
    args.push(format!("--lease-timeout={}", a.lease_timeout).into());
    args.push(format!("--usage-save-seconds={}", a.usage_save_seconds).into());
    if let Some(d) = &a.state_dir {
        args.push("--state-dir".into());
        args.push(d.clone().into());
    }
    if let Some(d) = &a.draft_trunk {
        args.push("--draft-trunk".into());
        args.push(d.clone().into());
    }
    args
}

/// Why `k3-store start` did not serve: the exit code it ends with and what the log and a
/// `start --detach` waiting for readiness are told.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
struct StartError {
    code: i32,
    message: String,
}

impl StartError {
    /// From an error that knows its exit code, with its whole source chain.
    fn of<E: ExitStatus>(e: E) -> StartError {
        StartError {
            code: e.exit_code(),
            message: exit::message(&e),
        }
    }

    /// A refusal before anything is loaded (exit 2).
    fn refused(message: String) -> StartError {
        StartError {
            code: exit::REFUSED,
            message,
        }
    }

    /// A failure after work started (exit 1).
    fn failed(message: String) -> StartError {
        StartError {
            code: exit::FAILURE,
            message,
        }
    }
}

fn start(mut a: StartArgs, m: &clap::ArgMatches) -> i32 {
    let mut notify = match a.ready_fd {
        // SAFETY: `--ready-fd` is only passed by `start_detached`, which hands this process the
        // write end of a pipe that nothing else here uses.
        Some(fd) => unsafe { Notifier::from_fd(fd) },
        None => Notifier::none(),
    };
    match start_store(&mut a, m, &mut notify) {
        Ok(code) => code,
        Err(e) => {
            tracing::error!("{}", e.message);
            notify.failed(e.code, &e.message);
            e.code
        }
    }
}

/// What the store opens before its plan.
struct Opened {
    budget: Budget,
    cat: k3_store::runtime::catalog::Catalog,
    cfg: k3_proto::config::ModelConfig,
    identity: k3_store::runtime::identity::ModelIdentity,
    trunk: k3_store::runtime::trunk::TrunkLayout,
    draft: Option<k3_store::runtime::draft::DraftFile>,
}

/// The checkpoint, its identity, the packed trunk and the draft trunk; anything unreadable is
/// a refusal.
fn open_checkpoint(a: &StartArgs, m: &clap::ArgMatches) -> Result<Opened, StartError> {
    let budget = a.budget.budget(m).map_err(StartError::of)?;
    let (cat, cfg) =
        k3_store::runtime::catalog::Catalog::open_dir(&a.model_dir).map_err(|e| StartError {
            code: e.exit_code(),
            message: e.0,
        })?;
    // The content identity sessions, saved state and the segment are bound to: from the
    // manifest's recorded hashes when there is one (no shard is read), else sampled.
    let identity = k3_store::runtime::identity::ModelIdentity::of(&cat).map_err(StartError::of)?;
    tracing::info!("{}", identity.describe());
    let shards = k3_store::runtime::trunk::open_shards(&cat).map_err(|e| StartError {
        code: e.exit_code(),
        message: e.0,
    })?;
    let trunk = match &a.budget.trunk {
        Some(dir) => k3_store::runtime::trunk::TrunkLayout::from_packed(&cat, shards, dir)
            .map_err(StartError::of)?,
        // No packed trunk: the layers are read from the checkpoint's shards.
        None => k3_store::runtime::trunk::TrunkLayout::from_catalog(&cat, shards),
    };
    let draft = match &a.draft_trunk {
        Some(dir) => Some(
            k3_store::runtime::draft::DraftFile::open(dir, &cat, cat.n_layers())
                .map_err(StartError::of)?,
        ),
        None => None,
    };
    Ok(Opened {
        budget,
        cat,
        cfg,
        identity,
        trunk,
        draft,
    })
}

/// The store's plan and what it serves with.
struct Planned {
    budget: Budget,
    plan: MemoryPlan,
    plan_text: String,
    session_bytes: u64,
    max_connections: usize,
}

/// The plan: the store holds the resident tensors (the embedding too: workers read its rows
/// in shared memory), the pinned prefix, the ring the other layers stream through, the expert
/// arena and the draft trunk; sequence states and activations live in each worker. Refused
/// (exit 2) when it does not fit the memory or the address space.
fn plan_store(a: &StartArgs, m: &clap::ArgMatches, o: &Opened) -> Result<Planned, StartError> {
    let mut inputs = PlanInputs::from_model(&o.cfg, &o.cat, &o.trunk, Default::default());
    inputs.resident_bytes += inputs.mapped_bytes;
    inputs.mapped_bytes = 0;
    let available = allocatable().ok();
    // The draft trunk (if any) is held in full: `--preset auto` fits the rest around it.
    let draft_bytes = o.draft.as_ref().map_or(0, |d| d.run_bytes());
    let budget = match (o.budget.auto, available) {
        (true, Some(av)) => Budget::fit(&inputs, av.saturating_sub(draft_bytes)),
        (true, None) => {
            return Err(StartError::refused(
                "--preset auto: cannot tell how much memory is available".into(),
            ))
        }
        (false, _) => o.budget.clone(),
    };
    let mut plan = MemoryPlan::compute(&inputs, &budget);
    let (pinned, slots, ring) = (plan.pinned_layers, plan.expert_slots, plan.ring_bytes);
    let shm = segment_bytes(&o.cat, &o.trunk, pinned, slots, ring, o.draft.as_ref());
    let mut problems = plan.problems.clone();
    if let Some(av) = available.filter(|&av| shm > av) {
        problems.push(format!(
            "shared memory needs {} but only {} is available: shortfall {}",
            fmt_bytes(shm),
            fmt_bytes(av),
            fmt_bytes(shm - av)
        ));
    }
    // Under an address-space limit the store is refused here, not aborted by a failed mapping
    // or allocation later: the shared memory, the reader's buffers, threads and allocator arenas.
    let address_space = shm + inputs.buffer_bytes + k3_store::runtime::plan::ADDRESS_SPACE_RESERVE;
    problems.extend(k3_store::runtime::plan::address_space_problem(
        address_space,
    ));
    plan.available_bytes = available;
    // Kept conversations and the history live on top of the plan: checked against what is left
    // beside the shared memory. An explicit --session-mb or --history-ids that cannot be held is
    // refused; the default session budget shrinks to what is left (said in the plan).
    let (session_bytes, session_note) = beside_the_plan(a, m, available, shm, &mut problems);
    let draft_note = o.draft.as_ref().map_or(String::new(), |d| {
        format!(
            ", {} draft trunk {}",
            d.kind().name(),
            fmt_bytes(d.run_bytes())
        )
    });
    let plan_text = format!(
        "{plan}store shared memory: {} ({pinned} pinned layers, ring {}, {slots} expert slots{draft_note})\nkept conversations: up to {}{session_note} and {} sessions, on top of the above{}\n",
        fmt_bytes(shm),
        fmt_bytes(ring),
        fmt_bytes(session_bytes),
        a.max_sessions,
        a.state_dir
            .as_ref()
            .map_or(String::new(), |d| format!(" (mirrored in {})", d.display()))
    );
    if !problems.is_empty() {
        return Err(StartError::refused(format!(
            "REFUSING TO START: the memory plan does not fit\n{plan_text}{}",
            problems
                .iter()
                .map(|p| format!("  problem: {p}\n"))
                .collect::<String>()
        )));
    }
    // Open files: the soft limit raised, what the store holds counted (connections_to_serve).
    let max_connections =
        connections_to_serve(a, &o.cat, o.draft.is_some()).map_err(StartError::of)?;
    Ok(Planned {
        budget,
        plan,
        plan_text,
        session_bytes,
        max_connections,
    })
}

/// Open, plan, load behind the socket's loading gate, then serve until asked to stop.
fn start_store(
    a: &mut StartArgs,
    m: &clap::ArgMatches,
    notify: &mut Notifier,
) -> Result<i32, StartError> {
    resolve_paths(a).map_err(StartError::of)?;
    // Before any thread: the allocator's arenas are bounded, so the address space the plan
    // checks below is what the store will take (k3_store::runtime::plan::ADDRESS_SPACE_RESERVE).
    k3_store::runtime::plan::limit_allocator_arenas();
    let (shm, io) = k3_store::sys::platform_paths().map_err(StartError::of)?;
    tracing::info!("shared memory: {}; disk reads: {}", shm.name(), io.name());
    let socket = socket_path(a);
    // The socket's directory is created (0700) or checked before anything is opened there.
    k3_store::ipc::prepare_socket_dir(&socket)
        .map_err(|e| StartError::refused(format!("socket {}: {e}", socket.display())))?;
    // A store already serving there is refused before the checkpoint is read or a plan printed
    // (the bind below still settles a race between two starts).
    if let Ok(k3_store::ipc::Existing::Live) = k3_store::ipc::probe(&socket) {
        let live = k3_store::ipc::BindError::Live(socket.display().to_string());
        return Err(StartError::of(live));
    }
    if a.detach && a.ready_fd.is_none() {
        return Ok(start_detached(a, &socket, m));
    }
    let o = open_checkpoint(a, m)?;
    let p = plan_store(a, m, &o)?;
    // The plan's first line is its header (with the budget's label): printed once.
    tracing::info!("{}", p.plan_text.trim_end());
    notify.plan(&p.plan_text);
    log_shared_memory_pages();
    let sessions = Arc::new(Sessions::new(
        SessionOptions {
            budget_bytes: p.session_bytes,
            max_count: a.max_sessions,
            state_dir: a.state_dir.clone(),
        },
        o.identity.id,
    ));
    sessions.load_state_dir().map_err(StartError::of)?;
    let (usage, preload) = usage_and_preload(a, o.identity.id, &o.cat, p.plan.expert_slots)
        .map_err(|(code, message)| StartError { code, message })?;
    // Claim the socket before the (possibly long) load: a live store is refused now.
    let listener = k3_store::ipc::bind(&socket).map_err(StartError::of)?;
    let stop = Arc::new(AtomicBool::new(false));
    let hup = Arc::new(AtomicBool::new(false));
    if let Err(e) = install_signal_handlers(&stop, &hup) {
        let _ = std::fs::remove_file(&socket);
        return Err(StartError::failed(format!("signal handlers: {e}")));
    }
    let opts = build_options(a, o, &p, preload, usage.clone());
    let t0 = std::time::Instant::now();
    let Some((backend, listener)) = load(listener, &opts, &p.budget.label, &stop, &socket, notify)?
    else {
        return Ok(exit::OK);
    };
    tracing::info!(
        "loaded in {:.2} s; serving {} at {} (pid {})",
        t0.elapsed().as_secs_f64(),
        a.model_dir.display(),
        socket.display(),
        std::process::id()
    );
    if let Some(u) = &usage {
        u.start_saver(std::time::Duration::from_secs_f64(a.usage_save_seconds));
    }
    notify.ready(&socket);
    let left = Server::new(listener, socket.clone(), backend, stop)
        .with_limits(k3_store::daemon::Limits {
            history_tokens: a.history_ids as usize,
            max_connections: p.max_connections,
            ..Default::default()
        })
        .with_hup(hup)
        .with_sessions(sessions)
        .run();
    if let Some(u) = &usage {
        u.finish();
    }
    if left > 0 {
        tracing::warn!("stopped with {left} request(s) still in flight after the drain cap");
    } else {
        tracing::info!("stopped");
    }
    Ok(exit::OK)
}

/// What the backend is built with.
fn build_options(
    a: &StartArgs,
    o: Opened,
    p: &Planned,
    preload: PreloadSet,
    usage: Option<Arc<UsageBook>>,
) -> BuildOptions {
    use k3_store::runtime::ring::{RingOptions, DEFAULT_IDLE_PROTECT};
    let lease_timeout = std::time::Duration::from_secs_f64(a.lease_timeout);
    BuildOptions {
        model_dir: a.model_dir.clone(),
        trunk_dir: a.budget.trunk.clone(),
        draft: o.draft.map(Arc::new),
        pinned_layers: p.plan.pinned_layers,
        slots: p.plan.expert_slots,
        io_threads: a.io_threads as usize,
        cache_policy: a.budget.policy(),
        preset: p.budget.label.clone(),
        plan_text: p.plan_text.clone(),
        ring_bytes: p.plan.ring_bytes,
        preload,
        usage,
        // A worker between passes protects its read-ahead no longer than a lease lasts.
        ring: RingOptions {
            lease_timeout,
            idle_protect: DEFAULT_IDLE_PROTECT.min(lease_timeout),
            demand_timeout: lease_timeout,
        },
        identity: o.identity.id,
    }
}

/// Load the shared memory behind the socket's loading gate (until the load is done the socket
/// answers "loading" and honours a stop, SPEC.md §6.5). `None`: asked to stop during the load
/// (not a failure of the store; a `start --detach` waiting for readiness is told no store
/// started).
fn load(
    listener: std::os::unix::net::UnixListener,
    opts: &BuildOptions,
    label: &str,
    stop: &Arc<AtomicBool>,
    socket: &Path,
    notify: &mut Notifier,
) -> Result<Option<(StoreBackend, std::os::unix::net::UnixListener)>, StartError> {
    let load = LoadState::new(&opts.model_dir.display().to_string(), label);
    let dirs = (
        opts.model_dir.display().to_string(),
        (opts.trunk_dir.as_ref()).map_or(String::new(), |d| d.display().to_string()),
    );
    let mut bar: Option<Progress> = None;
    let progress = {
        let load = load.clone();
        let notify = notify.clone();
        move |done: u64, total: u64| {
            bar.get_or_insert_with(|| Progress::new("loading shared memory", total, true))
                .set(done);
            load.set(done, total);
            notify.loading(done, total);
        }
    };
    let opts = opts.clone();
    let built = load_behind_gate(listener, load.clone(), stop.clone(), dirs, move || {
        StoreBackend::build(&opts, progress)
    });
    match built {
        Ok((Loaded::Done(Ok(b)), l)) if !stop.load(Ordering::SeqCst) => return Ok(Some((b, l))),
        _ => {}
    }
    // Every other end: no store serves at this socket.
    let _ = std::fs::remove_file(socket);
    match built {
        Ok((Loaded::Done(Ok(_)) | Loaded::Stopped, _)) => {
            let r = load.report();
            let msg = format!(
                "stopped during the load, after {} of {} in {:.1} s",
                fmt_bytes(r.done_bytes),
                fmt_bytes(r.total_bytes),
                r.seconds
            );
            tracing::info!("{msg}");
            notify.failed(exit::FAILURE, &format!("{msg}; the store was not started"));
            Ok(None)
        }
        Ok((Loaded::Done(Err(e)), _)) => Err(StartError {
            code: e.code,
            message: e.message,
        }),
        Ok((Loaded::Panicked(m), _)) => Err(StartError::failed(format!("the load failed: {m}"))),
        Err(e) => Err(StartError::failed(format!("starting the load: {e}"))),
    }
}

/// The expert usage history (`None` without `--state-dir`) and the experts to preload.
type UsageAndPreload = (Option<Arc<UsageBook>>, PreloadSet);

/// The expert usage history (with `--state-dir`, beside the sessions) and what the expert cache
/// holds at start (`--preload`); a refusal is (exit code, message).
fn usage_and_preload(
    a: &StartArgs,
    identity: u128,
    cat: &k3_store::runtime::catalog::Catalog,
    slots: usize,
) -> Result<UsageAndPreload, (i32, String)> {
    let usage = match &a.state_dir {
        Some(dir) => match UsageBook::open(dir, identity, cat.n_layers(), cat.n_experts()) {
            Ok(b) => Some(Arc::new(b)),
            Err(e) => return Err((e.exit_code(), e.to_string())),
        },
        None => None,
    };
    let preload = choose_preload(a.budget.preload, slots, cat, usage.as_deref())
        .map_err(|e| (e.exit_code(), e.to_string()))?;
    if let PreloadSet::These(list) = &preload {
        tracing::info!(
            "preload: the {} most used experts of the usage history ({slots} slots)",
            list.len()
        );
    }
    Ok((usage, preload))
}

/// What kept conversations and the history may take beside the store's shared memory (`shm`)
/// in what this process may allocate (`available`): the session budget and a note for the plan
/// when the default had to shrink; an explicit `--session-mb` or `--history-ids` that cannot be
/// held adds a problem (a refusal) instead.
fn beside_the_plan(
    a: &StartArgs,
    m: &clap::ArgMatches,
    available: Option<u64>,
    shm: u64,
    problems: &mut Vec<String>,
) -> (u64, String) {
    let history_bytes = a.history_ids.saturating_mul(4);
    let mut session_bytes = (a.session_mb * 1e6) as u64;
    let mut session_note = String::new();
    if let Some(av) = available {
        let room = av.saturating_sub(shm);
        let explicit =
            |id: &str| m.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
        if history_bytes > room && explicit("history_ids") {
            problems.push(format!(
                "--history-ids {}: the history takes {} beside the store's shared memory, but only \
                 {} is left there (lower --history-ids)",
                a.history_ids,
                fmt_bytes(history_bytes),
                fmt_bytes(room)
            ));
        }
        let room = room.saturating_sub(history_bytes);
        if session_bytes > room {
            if explicit("session_mb") {
                problems.push(format!(
                    "--session-mb {}: kept conversations may take {} on top of the store's shared \
                     memory ({}), but only {} is left beside it: shortfall {} (lower --session-mb)",
                    a.session_mb,
                    fmt_bytes(session_bytes),
                    fmt_bytes(shm),
                    fmt_bytes(room),
                    fmt_bytes(session_bytes - room)
                ));
            } else {
                session_note = format!(
                    " (the default {} MB does not fit beside the plan)",
                    DEFAULT_SESSION_MB
                );
                session_bytes = room;
            }
        }
    }
    (session_bytes, session_note)
}

/// Too few open files for the least the store serves with (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("it starts with at least {least} open files, serving fewer connections")]
struct TooFewFiles {
    least: u64,
    #[source]
    source: Option<k3_store::runtime::fdlimit::TooFewFiles>,
}

impl ExitStatus for TooFewFiles {
    fn exit_code(&self) -> i32 {
        exit::REFUSED
    }
}

/// Open files: the soft limit raised to the hard one; the shards, trunks, sessions and
/// connections counted. The connections served: fewer when they alone do not fit (at least
/// `MIN_CONNECTIONS`); below that, the refusal with the number needed.
fn connections_to_serve(
    a: &StartArgs,
    cat: &k3_store::runtime::catalog::Catalog,
    has_draft: bool,
) -> Result<usize, TooFewFiles> {
    use k3_store::runtime::fdlimit::{connections_that_fit, raise, Needs};
    let defaults = k3_store::daemon::Limits::default();
    let all = (defaults.max_connections + defaults.reserved) as u64;
    let fixed = Needs {
        shards: cat.shard_paths().len() as u64,
        trunks: u64::from(a.budget.trunk.is_some()) + u64::from(has_draft),
        sessions: u64::from(a.max_sessions),
        ..Default::default()
    };
    let limit = raise();
    let fit = connections_that_fit(limit.soft, &fixed, all);
    let full = Needs {
        connections: all,
        ..fixed
    };
    if fit < MIN_CONNECTIONS + defaults.reserved as u64 {
        let least = Needs {
            connections: MIN_CONNECTIONS + defaults.reserved as u64,
            ..fixed
        };
        return Err(TooFewFiles {
            least: least.total(),
            source: limit.check("k3-store", &full).err(),
        });
    }
    tracing::info!("{}", limit.describe(&full));
    let served = fit as usize - defaults.reserved;
    if served < defaults.max_connections {
        tracing::warn!(
            "open files: serving at most {served} connections (not {}) under a limit of {}",
            defaults.max_connections,
            limit.soft
        );
    }
    Ok(served.min(defaults.max_connections))
}

fn start_detached(a: &StartArgs, socket: &Path, m: &clap::ArgMatches) -> i32 {
    // The socket's directory has been checked (ours, private): only now is the log opened there,
    // without following a symlink.
    let log = a
        .log
        .clone()
        .unwrap_or_else(|| socket.with_file_name("store.log"));
    let logf = match detach::open_log(&log) {
        Ok(f) => f,
        Err(e) => {
            tracing::error!("{e}");
            return e.exit_code();
        }
    };
    let args = child_args(a, m);
    match detach::spawn_and_wait(&args, logf, &log) {
        Ok(Readiness::Ready { socket, pid }) => {
            println!(
                "k3-store ready: listening on {socket} (pid {pid}); log {}",
                log.display()
            );
            // The store's own warning went to its log: repeat it where the user is looking.
            if let (true, line) = shared_memory_pages() {
                tracing::warn!("{line}");
            }
            exit::OK
        }
        Ok(Readiness::Failed { code, message }) => {
            tracing::error!("{message}");
            code
        }
        Err(e) => {
            tracing::error!("cannot start in the background: {e}");
            exit::FAILURE
        }
    }
}

/// Whether the segment can get huge pages ([`k3_store::shmem::shmem_huge_pages`]), as a log
/// line, and whether that line is a warning: with 4 KiB pages every `O_DIRECT` read into the
/// segment runs slower (a third of the rate on the benchmark VM), so the store says so, with the
/// fix.
fn shared_memory_pages() -> (bool, String) {
    use k3_store::shmem::{shmem_huge_pages, shmem_mode_gives_huge_pages};
    const KNOB: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
    match shmem_huge_pages() {
        Some(m) if shmem_mode_gives_huge_pages(&m) => {
            (false, format!("shared memory: huge pages ({KNOB} is {m})"))
        }
        Some(m) => (
            true,
            format!(
                "shared memory: 4 KiB pages ({KNOB} is {m}): O_DIRECT reads into the store run \
                 slower than into huge pages (`k3-ctl doctor` measures both); as root, \
                 `echo advise > {KNOB}` lets the store ask for huge pages"
            ),
        ),
        None => (
            false,
            format!("shared memory: huge-page mode unknown ({KNOB} unreadable)"),
        ),
    }
}

/// Log [`shared_memory_pages`] once, at its level.
fn log_shared_memory_pages() {
    match shared_memory_pages() {
        (true, line) => tracing::warn!("{line}"),
        (false, line) => tracing::info!("{line}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    fn parse(args: &[&str]) -> (StartArgs, clap::ArgMatches) {
        let m = Cli::command()
            .try_get_matches_from(std::iter::once("k3-store").chain(args.iter().copied()))
            .unwrap();
        let Cmd::Start(a) = Cli::from_arg_matches(&m).unwrap().cmd;
        let sub = m.subcommand_matches("start").unwrap().clone();
        (a, sub)
    }

    #[test]
    fn child_args_round_trip() {
        let (mut a, m) = parse(&[
            "start",
            "rel/model",
            "--cache-gb=1.5",
            "--trunk",
            "t",
            "--preset",
            "laptop",
            "--trunk-gb=0.25",
            "--socket",
            "r.sock",
            "--detach",
            "--log",
            "x.log",
            "--io-threads",
            "3",
            "--cache-policy",
            "lfu",
            "--preload",
            "off",
            "--session-mb",
            "0.5",
            "--max-sessions",
            "3",
            "--state-dir",
            "st",
            "--lease-timeout",
            "2.5",
            "--usage-save-seconds",
            "0.25",
        ]);
        resolve_paths(&mut a).unwrap();
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(
            a.socket.socket.as_deref(),
            Some(cwd.join("r.sock").as_path())
        );
        assert!(a.model_dir.is_absolute() && a.budget.trunk.as_ref().unwrap().is_absolute());
        let child = child_args(&a, &m);
        let strs: Vec<&str> = child.iter().map(|s| s.to_str().unwrap()).collect();
        let (b, m2) = parse(&strs);
        assert_eq!(
            (
                &b.model_dir,
                &b.budget.trunk,
                &b.socket.socket,
                b.io_threads,
                &b.budget.cache_policy,
                b.budget.preload,
                b.session_mb,
                b.max_sessions,
                b.history_ids,
                b.lease_timeout,
                &b.state_dir,
                b.usage_save_seconds
            ),
            (
                &a.model_dir,
                &a.budget.trunk,
                &a.socket.socket,
                a.io_threads,
                &a.budget.cache_policy,
                a.budget.preload,
                a.session_mb,
                a.max_sessions,
                a.history_ids,
                2.5,
                &a.state_dir,
                0.25
            )
        );
        assert_eq!(b.state_dir, Some(cwd.join("st")));
        // The budget flags keep their order (a later one overrides an earlier one).
        assert_eq!(
            (&b.budget.preset, &b.budget.trunk_gb, &b.budget.cache_gb),
            (&a.budget.preset, &a.budget.trunk_gb, &a.budget.cache_gb)
        );
        assert_eq!(budget_args(&m2), budget_args(&m));
        assert_eq!(
            budget_args(&m),
            ["--cache-gb=1.5", "--preset=laptop", "--trunk-gb=0.25"]
                .map(OsString::from)
                .to_vec()
        );
    }
}
