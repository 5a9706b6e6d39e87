//! `k3-store`: the long-lived daemon that owns Kimi K3's weights in shared memory.
//!
//! `k3-store start <model_dir> --trunk <packed_dir> (--preset NAME | --trunk-gb X --cache-gb X)
//! [--socket PATH] [--detach]` — see the README for the whole flow.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use clap::{ArgAction, CommandFactory, FromArgMatches, Parser, Subcommand};
use k3_proto::exit;
use k3_store::daemon::backend::{segment_bytes, BuildOptions, StoreBackend};
use k3_store::daemon::detach::{self, Notifier, Readiness};
use k3_store::daemon::{install_signal_handlers, Server};
use k3_store::plan::{fmt_gb, mem_available, Budget, MemoryPlan, PlanInputs};

/// k3 store daemon.
#[derive(Parser, Debug)]
#[command(name = "k3-store", version, about)]
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
    /// Packed trunk directory (`k3-ctl pack-trunk`).
    #[arg(long)]
    trunk: PathBuf,
    /// Memory preset: laptop, desktop, workstation, server, max (`k3-ctl presets`).
    #[arg(long, action = ArgAction::Append)]
    preset: Vec<String>,
    /// Trunk budget in GB (overrides an earlier --preset).
    #[arg(long = "trunk-gb", action = ArgAction::Append)]
    trunk_gb: Vec<f64>,
    /// Expert-cache budget in GB (overrides an earlier --preset).
    #[arg(long = "cache-gb", action = ArgAction::Append)]
    cache_gb: Vec<f64>,
    /// Socket path (default: $XDG_RUNTIME_DIR/k3/store.sock, else /tmp/k3-$UID/store.sock).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Return once the store is ready, leaving it running in the background.
    #[arg(long)]
    detach: bool,
    /// With --detach: the store's log file (default: store.log beside the socket).
    #[arg(long)]
    log: Option<PathBuf>,
    /// Parallel expert reads per request.
    #[arg(long, default_value_t = 8)]
    io_threads: usize,
    /// Expert-cache eviction policy: lru (default), lfu, layer, layer-lfu, lrfu, layer-lrfu,
    /// layer-age (see docs/CACHE_POLICY.md).
    #[arg(long, default_value = "lru")]
    cache_policy: String,
    /// Internal: the readiness pipe of a detached start.
    #[arg(long, hide = true)]
    ready_fd: Option<i32>,
}

fn main() {
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

fn socket_path(a: &StartArgs) -> PathBuf {
    a.socket
        .clone()
        .unwrap_or_else(|| k3_proto::paths::default_socket(k3_store::ipc::current_uid()))
}

fn start(a: StartArgs, m: &clap::ArgMatches) -> i32 {
    let socket = socket_path(&a);
    if a.detach && a.ready_fd.is_none() {
        return start_detached(&a, &socket);
    }
    let mut notify = match a.ready_fd {
        // SAFETY: `--ready-fd` is only passed by `start_detached`, which hands this process the
        // write end of a pipe that nothing else here uses.
        Some(fd) => unsafe { Notifier::from_fd(fd) },
        None => Notifier::none(),
    };
    let fail = |notify: &mut Notifier, code: i32, msg: String| {
        eprintln!("k3-store: {msg}");
        notify.failed(code, &msg);
        code
    };
    let budget = match Budget::from_matches(m, "preset", "trunk_gb", "cache_gb") {
        Ok(b) => b,
        Err(e) => return fail(&mut notify, exit::REFUSED, e),
    };
    if k3_store::policy::policy_by_name(&a.cache_policy, 1).is_none() {
        return fail(
            &mut notify,
            exit::REFUSED,
            k3_store::policy::unknown_policy(&a.cache_policy),
        );
    }
    // Open the checkpoint and the packed trunk; anything unreadable is a refusal.
    let (cat, cfg) = match k3_store::catalog::Catalog::open_dir(&a.model_dir) {
        Ok(x) => x,
        Err(e) => return fail(&mut notify, exit::REFUSED, e.0),
    };
    let shards = match k3_store::trunk::open_shards(&cat) {
        Ok(s) => s,
        Err(e) => return fail(&mut notify, exit::FAILURE, e.0),
    };
    let trunk = match k3_store::trunk::TrunkLayout::from_packed(&cat, shards, &a.trunk) {
        Ok(t) => t,
        Err(e) => return fail(&mut notify, exit::REFUSED, e.to_string()),
    };
    // The plan: the store holds the resident tensors, the pinned prefix and the expert arena;
    // the ring arena, KV caches and activations live in each worker.
    let mut inputs = PlanInputs::from_model(&cfg, &cat, &trunk, 0);
    // The store holds the embedding in shared memory too (workers read its rows there).
    inputs.resident_bytes += inputs.mapped_bytes;
    inputs.mapped_bytes = 0;
    let mut plan = MemoryPlan::compute(&inputs, &budget);
    let shm = segment_bytes(&cat, &trunk, plan.pinned_layers, plan.expert_slots);
    let available = mem_available().ok();
    let mut problems = plan.problems.clone();
    if let Some(av) = available {
        if shm > av {
            problems.push(format!(
                "shared memory needs {} but only {} is available: shortfall {}",
                fmt_gb(shm),
                fmt_gb(av),
                fmt_gb(shm - av)
            ));
        }
    }
    plan.available_bytes = available;
    let plan_text = format!(
        "{plan}store shared memory: {} ({} pinned layers, {} expert slots)\n",
        fmt_gb(shm),
        plan.pinned_layers,
        plan.expert_slots
    );
    if !problems.is_empty() {
        let msg = format!(
            "REFUSING TO START: the memory plan does not fit\n{plan_text}{}",
            problems
                .iter()
                .map(|p| format!("  problem: {p}\n"))
                .collect::<String>()
        );
        return fail(&mut notify, exit::REFUSED, msg);
    }
    eprint!("{plan_text}");
    drop(trunk);
    // Claim the socket before the (possibly long) load: a live store is refused now.
    let listener = match k3_store::ipc::bind(&socket) {
        Ok(l) => l,
        Err(e @ k3_store::ipc::BindError::Live(_)) => {
            return fail(&mut notify, exit::REFUSED, e.to_string())
        }
        Err(e) => return fail(&mut notify, exit::FAILURE, e.to_string()),
    };
    let stop = Arc::new(AtomicBool::new(false));
    if let Err(e) = install_signal_handlers(&stop) {
        let _ = std::fs::remove_file(&socket);
        return fail(&mut notify, exit::FAILURE, format!("signal handlers: {e}"));
    }
    let opts = BuildOptions {
        model_dir: a.model_dir.clone(),
        trunk_dir: a.trunk.clone(),
        pinned_layers: plan.pinned_layers,
        slots: plan.expert_slots,
        io_threads: a.io_threads,
        cache_policy: a.cache_policy.clone(),
        preset: budget.label.clone(),
        plan_text,
    };
    let t0 = std::time::Instant::now();
    let backend = match StoreBackend::build(&opts, progress_bar()) {
        Ok(b) => b,
        Err(e) => {
            let _ = std::fs::remove_file(&socket);
            return fail(&mut notify, e.code, e.message);
        }
    };
    eprintln!();
    eprintln!(
        "k3-store: loaded in {:.2} s; serving {} at {} (pid {})",
        t0.elapsed().as_secs_f64(),
        a.model_dir.display(),
        socket.display(),
        std::process::id()
    );
    notify.ready(&socket);
    let left = Server::new(listener, socket.clone(), backend, stop).run();
    if left > 0 {
        eprintln!("k3-store: stopped with {left} request(s) still in flight after the drain cap");
    } else {
        eprintln!("k3-store: stopped");
    }
    exit::OK
}

/// A progress bar on stderr: `loading [#####.....] 45%  1.20/2.60 GB  850 MB/s`.
fn progress_bar() -> impl FnMut(u64, u64) {
    let t0 = std::time::Instant::now();
    let mut last = 0u64;
    move |done, total| {
        let pct = (done * 100).checked_div(total).unwrap_or(100);
        if pct == last && done != total && done != 0 {
            return;
        }
        last = pct;
        let bar: String = (0..20)
            .map(|i| if i * 5 < pct { '#' } else { '.' })
            .collect();
        let secs = t0.elapsed().as_secs_f64().max(1e-9);
        eprint!(
            "\rloading [{bar}] {pct:>3}%  {:.2}/{:.2} GB  {:.0} MB/s ",
            done as f64 / 1e9,
            total as f64 / 1e9,
            done as f64 / 1e6 / secs
        );
        let _ = std::io::stderr().flush();
    }
}

fn start_detached(a: &StartArgs, socket: &Path) -> i32 {
    // The log goes beside the socket; its directory is created (0700) like the socket's.
    if let Some(dir) = socket.parent() {
        use std::os::unix::fs::DirBuilderExt;
        if let Err(e) = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
        {
            eprintln!("k3-store: cannot create {}: {e}", dir.display());
            return exit::FAILURE;
        }
    }
    let log = a
        .log
        .clone()
        .unwrap_or_else(|| socket.with_file_name("store.log"));
    // Re-run ourselves with the same arguments, minus --detach, plus the explicit socket.
    let mut args: Vec<OsString> = std::env::args_os()
        .skip(1)
        .filter(|x| x != "--detach")
        .collect();
    if a.socket.is_none() {
        args.push("--socket".into());
        args.push(socket.into());
    }
    match detach::spawn_and_wait(&args, &log) {
        Ok(Readiness::Ready { socket, pid }) => {
            println!(
                "k3-store ready: listening on {socket} (pid {pid}); log {}",
                log.display()
            );
            exit::OK
        }
        Ok(Readiness::Failed { code, message }) => {
            eprintln!("k3-store: {}", message.replace(" | ", "\n"));
            code
        }
        Err(e) => {
            eprintln!("k3-store: cannot start in the background: {e}");
            exit::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
