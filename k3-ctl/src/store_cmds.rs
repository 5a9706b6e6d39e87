//! `k3-ctl status`, `stats`, `stop`: talk to a running store — only one run by this user (the
//! socket directory and the store's uid are checked by [`Client::connect`]; exit 3 otherwise).

use std::time::Duration;

use k3_proto::exit;
use k3_proto::wire::{ClientKind, Counters, Request, Response, StatsReport};
use k3_store::attach::client::{Client, ClientError};
use k3_store::runtime::plan::fmt_bytes;

use crate::fail::Failed;

/// Where the store listens: the flag group every binary shares.
pub use k3_store::cli::SocketArgs as SocketArg;

/// Arguments of `k3-ctl stats`.
#[derive(clap::Args, Debug)]
pub struct StatsArgs {
    #[command(flatten)]
    pub socket: SocketArg,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Print again every second until interrupted, redrawn in place on a terminal.
    #[arg(long)]
    pub watch: bool,
}

fn connect(s: &SocketArg) -> Result<Client, Failed> {
    Client::connect(&s.path(), ClientKind::Control, "k3-ctl").map_err(Failed::of)
}

fn call(c: &mut Client, req: &Request) -> Result<Response, Failed> {
    c.call(req).map_err(Failed::of)
}

/// An answer of another kind than the request's (exit 1).
fn unexpected(other: &Response) -> Failed {
    Failed::failure(format!("unexpected answer {other:?}"))
}

/// `k3-ctl status`.
pub fn run_status(a: SocketArg) -> Result<i32, Failed> {
    let mut c = connect(&a)?;
    match c.call(&Request::Status) {
        // Not serving yet: say how far the load is, on stdout, and end as "no store" (3).
        Err(ClientError::Loading(l)) => {
            let pct = l.percent().map_or(String::new(), |p| format!(" ({p:.0}%)"));
            println!("store: loading, pid {}, {:.1} s so far", l.pid, l.seconds);
            println!("socket: {}", a.path().display());
            println!("model: {}", l.model_dir);
            println!("preset: {}", l.preset);
            println!(
                "loaded: {:.3} of {:.3} GB{pct}",
                l.done_bytes as f64 / 1e9,
                l.total_bytes as f64 / 1e9
            );
            Ok(exit::NO_STORE)
        }
        Err(e) => Err(Failed::of(e)),
        Ok(Response::Status(s)) => {
            println!("store: up, pid {}, uptime {:.1} s", s.pid, s.uptime_seconds);
            println!("socket: {}", a.path().display());
            println!("model: {}", s.model_dir);
            if s.trunk_dir.is_empty() {
                println!("trunk: none packed (layers read from the checkpoint's shards)");
            } else {
                println!("trunk: {} ({})", s.trunk_dir, trunk_kind(&s.trunk));
            }
            if s.trunk.is_lossy() {
                println!("{}", s.trunk.lossy);
            }
            println!("preset: {}", s.preset);
            println!("shared memory: {}", fmt_bytes(s.shm_bytes));
            println!("clients ({}):", s.clients.len());
            for l in &s.clients {
                println!("  {l}");
            }
            println!("{}", s.plan);
            Ok(exit::OK)
        }
        Ok(other) => Err(unexpected(&other)),
    }
}

/// The process `pid` as `/proc/PID/stat` tells it: `Some(start time)` while it runs, `None` once
/// it is gone or a zombie (its memory, the store's shared memory included, is then released).
#[cfg(target_os = "linux")]
fn live_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces and parentheses): state is the
    // first, the start time the 20th.
    let rest: Vec<&str> = stat.rsplit_once(") ")?.1.split_whitespace().collect();
    if matches!(rest.first(), Some(&"Z") | Some(&"X") | None) {
        return None;
    }
    rest.get(19)?.parse().ok()
}

/// Without `/proc` (macOS): `Some(0)` while a process `pid` exists (`kill(pid, 0)`; a signal it
/// is not allowed to receive still proves it exists), `None` once it is gone. A reused pid is
/// not told apart here.
#[cfg(not(target_os = "linux"))]
fn live_start_time(pid: u32) -> Option<u64> {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).ok()?);
    match nix::sys::signal::kill(pid, None) {
        Ok(()) | Err(nix::errno::Errno::EPERM) => Some(0),
        Err(_) => None,
    }
}

/// `k3-ctl stop`: asks the store to stop, then returns once its process has exited (so its
/// memory is free for the next `k3-store start`), at most 30 s later.
pub fn run_stop(a: SocketArg) -> Result<i32, Failed> {
    let path = a.path();
    let mut c = connect(&a)?;
    // Which process to wait for; its start time tells it from a later process given its pid.
    // A store still loading says so, with its pid, and honours the stop all the same.
    let store = match c.call(&Request::Status) {
        Ok(Response::Status(s)) => live_start_time(s.pid).map(|t| (s.pid, t)),
        Err(ClientError::Loading(l)) => live_start_time(l.pid).map(|t| (l.pid, t)),
        Err(e) => return Err(Failed::of(e)),
        Ok(other) => return Err(unexpected(&other)),
    };
    match call(&mut c, &Request::Stop)? {
        Response::Stopping => {}
        other => return Err(unexpected(&other)),
    }
    drop(c);
    // The store removes its socket once it has drained, then exits and its memory is released;
    // wait for both (capped). A store in another pid namespace cannot be watched: the socket
    // is then all there is to wait for.
    let running = || store.is_some_and(|(pid, t)| live_start_time(pid) == Some(t));
    for _ in 0..1500 {
        if !path.exists() && !running() {
            println!("store stopped");
            return Ok(exit::OK);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let what = if path.exists() {
        format!("{} still exists", path.display())
    } else {
        format!(
            "its process (pid {}) is still running",
            store.map_or(0, |s| s.0)
        )
    };
    Err(Failed::failure(format!(
        "the store acknowledged the stop but {what} after 30 s"
    )))
}

fn pct(c: &Counters) -> String {
    if c.requests == 0 {
        "-".into()
    } else {
        format!("{:.1}%", 100.0 * c.true_resident_hit_rate())
    }
}

fn mbps(c: &Counters) -> String {
    if c.read_seconds > 0.0 {
        format!("{:.1}", c.expert_bytes_read as f64 / 1e6 / c.read_seconds)
    } else {
        "-".into()
    }
}

/// Render a stats report as the text table `k3-ctl stats` prints.
/// `ecbf16, exact` / `int4, LOSSY`: how a served trunk is stored and whether its numbers are
/// the checkpoint's.
fn trunk_kind(t: &k3_proto::wire::TrunkInfo) -> String {
    let codec = if t.codec.is_empty() {
        "shards"
    } else {
        &t.codec
    };
    let exact = if t.is_lossy() { "LOSSY" } else { "exact" };
    format!("{codec}, {exact}")
}

pub fn render_stats(s: &StatsReport) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let l = &s.lifetime;
    let _ = writeln!(o, "k3-store stats  (uptime {:.1} s)", s.uptime_seconds);
    if s.trunk.is_lossy() {
        let _ = writeln!(o, "{}", s.trunk.lossy);
    }
    let _ = writeln!(
        o,
        "lifetime: requests {}  TRUE resident hits {} ({})  misses {}  evictions {}  failed loads {}",
        l.requests,
        l.resident_hits,
        pct(l),
        l.misses,
        l.evictions,
        l.failed_loads
    );
    let _ = writeln!(
        o,
        "          experts read {} in {:.2} s ({} MB/s)",
        fmt_bytes(l.expert_bytes_read),
        l.read_seconds,
        mbps(l)
    );
    if l.trunk_layers_served > 0 || l.trunk_layer_reads > 0 {
        let _ = writeln!(
            o,
            "trunk:    read {} in {} layer reads  served {} layers ({} from a shared read)  \
             waits {:.2} s  broken leases {}",
            fmt_bytes(l.trunk_bytes_read),
            l.trunk_layer_reads,
            l.trunk_layers_served,
            l.trunk_shared_layers,
            l.trunk_wait_seconds,
            l.broken_leases
        );
    }
    if l.preloaded_experts > 0 {
        let what = match s.usage.preload.as_str() {
            "hot" => ": the most used of the usage history",
            "every" => ": every routed expert",
            _ => "",
        };
        let _ = writeln!(
            o,
            "preload:  {} experts ({}) read at start-up in {:.2} s{what} (not in the figures \
             above); {} TRUE hits on them so far",
            l.preloaded_experts,
            fmt_bytes(l.preload_bytes),
            l.preload_seconds,
            l.preload_hits
        );
    }
    let u = &s.usage;
    if !u.file.is_empty() {
        let _ = writeln!(
            o,
            "usage:    {} expert requests counted since the start ({} saved), {} in the history \
             at start, {} experts used  file {}{}{}",
            u.requests_counted,
            u.requests_saved,
            u.requests_at_start,
            u.experts_used,
            u.file,
            if u.save_failures > 0 {
                format!("  FAILED SAVES {}", u.save_failures)
            } else {
                String::new()
            },
            if u.refused.is_empty() {
                String::new()
            } else {
                format!("  (the file found at start was refused: {})", u.refused)
            }
        );
    }
    if l.prefetch_loads > 0 {
        let per = l.prefetch_bytes.checked_div(l.prefetch_loads).unwrap_or(0);
        let _ = writeln!(
            o,
            "prefetch: {} experts ({}) read ahead by router lookahead, {} used, {} \
             wasted, {} dropped unread (the layer asked before they were read)",
            l.prefetch_loads,
            fmt_bytes(l.prefetch_bytes),
            l.prefetch_used,
            fmt_bytes(l.prefetch_loads.saturating_sub(l.prefetch_used) * per),
            l.prefetch_dropped
        );
    }
    let _ = writeln!(
        o,
        "memory:   pinned layers {}  arena slots used {}/{}  leased {}  workers {}",
        s.pinned_layers, s.slots_used, s.slots_total, s.slots_leased, s.workers
    );
    let h = &s.history;
    let _ = writeln!(
        o,
        "history:  streams {}  ids {}/{}  draft queries {}  hits {}  drafted ids {}",
        h.streams, h.tokens, h.capacity_tokens, h.queries, h.hits, h.drafted
    );
    let ss = &s.sessions;
    let _ = writeln!(
        o,
        "sessions: {} of at most {}  {} of {}  evicted {}{}",
        ss.count,
        ss.max_count,
        fmt_bytes(ss.bytes),
        fmt_bytes(ss.budget_bytes),
        ss.evicted,
        if ss.state_dir.is_empty() {
            "  (memory only)".to_string()
        } else {
            format!("  state dir {}", ss.state_dir)
        }
    );
    render_jobs(&mut o, s);
    o
}

/// The per-job table of `k3-ctl stats` (nothing without jobs).
fn render_jobs(o: &mut String, s: &StatsReport) {
    use std::fmt::Write;
    if s.jobs.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "{:>5}  {:<28} {:>5} {:>9} {:>9} {:>9} {:>12} {:>10} {:>10} {:>13} {:>8} {:>7} {:>13}",
        "job",
        "label",
        "live",
        "requests",
        "hits",
        "misses",
        "TRUE hit",
        "expert MB",
        "trunk MB",
        "shared/layers",
        "wait s",
        "passes",
        "acc/drafted"
    );
    for j in &s.jobs {
        let c = &j.counters;
        let p = &j.progress;
        let _ = writeln!(
            o,
            "{:>5}  {:<28} {:>5} {:>9} {:>9} {:>9} {:>12} {:>10.1} {:>10.1} {:>13} {:>8.2} {:>7} {:>13}",
            j.conn,
            j.label,
            if j.live { "yes" } else { "no" },
            c.requests,
            c.resident_hits,
            c.misses,
            pct(c),
            c.expert_bytes_read as f64 / 1e6,
            c.trunk_bytes_read as f64 / 1e6,
            format!("{}/{}", c.trunk_shared_layers, c.trunk_layers_served),
            c.trunk_wait_seconds,
            p.forward_passes,
            format!("{}/{}", p.accepted_tokens, p.drafted_tokens)
        );
    }
}

/// `k3-ctl stats`.
pub fn run_stats(a: StatsArgs) -> Result<i32, Failed> {
    let mut c = connect(&a.socket)?;
    use std::io::{IsTerminal, Write};
    // On a terminal the table is redrawn in place: cursor home, the frame, clear the rest.
    let redraw = a.watch && !a.json && std::io::stdout().is_terminal();
    loop {
        match call(&mut c, &Request::Stats)? {
            Response::Stats(s) => {
                if a.json {
                    let j =
                        serde_json::to_string(&s).map_err(|e| Failed::coded(exit::FAILURE, e))?;
                    println!("{j}");
                } else if redraw {
                    let mut out = std::io::stdout().lock();
                    let _ = out.write_all(in_place(&render_stats(&s)).as_bytes());
                    let _ = out.flush();
                } else {
                    print!("{}", render_stats(&s));
                }
            }
            other => return Err(unexpected(&other)),
        }
        if !a.watch {
            return Ok(exit::OK);
        }
        std::thread::sleep(Duration::from_secs(1));
        if !redraw {
            println!();
        }
    }
}

/// A frame drawn over the previous one: cursor home, each line cleared to its end, the rest of
/// the screen cleared.
fn in_place(frame: &str) -> String {
    let mut o = String::from("\x1b[H");
    for line in frame.lines() {
        o.push_str(line);
        o.push_str("\x1b[K\n");
    }
    o.push_str("\x1b[J");
    o
}

/// Arguments of `k3-ctl sessions`.
#[derive(clap::Args, Debug)]
pub struct SessionsArgs {
    /// Store socket.
    #[command(flatten)]
    pub socket: SocketArg,
    /// Print JSON (one object per session) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The kept conversations as a table, most recently used first.
fn render_sessions(list: &[k3_proto::wire::SessionInfo]) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "{:<32} {:>9} {:>12} {:>10}\n",
        "SESSION", "IDS", "MB", "IDLE s"
    );
    for i in list {
        let _ = writeln!(
            out,
            "{:<32} {:>9} {:>12.3} {:>10.1}",
            i.name,
            i.ids,
            i.bytes as f64 / 1e6,
            i.idle_seconds
        );
    }
    if list.is_empty() {
        out.push_str("(no sessions)\n");
    }
    out
}

/// `k3-ctl sessions`: the store's kept conversations.
pub fn run_sessions(a: SessionsArgs) -> Result<i32, Failed> {
    let mut c = connect(&a.socket)?;
    match call(&mut c, &Request::ListSessions)? {
        Response::Sessions(list) => {
            if a.json {
                // ids_hash as hex: JSON numbers cannot hold 128 bits.
                let v: Vec<serde_json::Value> = list
                    .iter()
                    .map(|i| {
                        serde_json::json!({
                            "name": i.name,
                            "ids": i.ids,
                            "bytes": i.bytes,
                            "idle_seconds": i.idle_seconds,
                            "ids_hash": format!("{:032x}", i.ids_hash),
                        })
                    })
                    .collect();
                println!("{}", serde_json::Value::Array(v));
            } else {
                print!("{}", render_sessions(&list));
            }
            Ok(exit::OK)
        }
        other => Err(unexpected(&other)),
    }
}

/// Arguments of `k3-ctl ps`.
#[derive(clap::Args, Debug)]
pub struct PsArgs {
    /// Store socket.
    #[command(flatten)]
    pub socket: SocketArg,
    /// Print JSON (`{"jobs": [live jobs], "servers": [each k3-ctl serve and its requests]}`)
    /// instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// How long one `k3-ctl serve` has to answer.
const SERVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a `k3-ctl serve` gave no listing (logged; the server is left out).
#[derive(Debug, thiserror::Error)]
enum AskServeError {
    /// Nothing listens there.
    #[error(transparent)]
    Connect(#[from] std::io::Error),
    /// The exchange failed.
    #[error(transparent)]
    Wire(#[from] k3_proto::wire::WireError),
    /// The server refused (another protocol version).
    #[error("{0}")]
    Refused(String),
}

/// Ask the `k3-ctl serve` listening on `path` for its requests.
fn ask_serve(path: &std::path::Path) -> Result<k3_proto::serve::ServeListing, AskServeError> {
    use k3_proto::serve::{ServeAnswer, ServeQuery, JOB_PROTOCOL_VERSION, MAX_JOB_FRAME};
    let mut s = std::os::unix::net::UnixStream::connect(path)?;
    let _ = s.set_read_timeout(Some(SERVE_TIMEOUT));
    let _ = s.set_write_timeout(Some(SERVE_TIMEOUT));
    k3_proto::wire::write_frame(
        &mut s,
        &ServeQuery::List {
            protocol_version: JOB_PROTOCOL_VERSION,
        },
    )?;
    match k3_proto::wire::read_frame_limited::<ServeAnswer, _>(&mut s, MAX_JOB_FRAME)? {
        ServeAnswer::List(l) => Ok(l),
        ServeAnswer::Refused { reason, .. } => Err(AskServeError::Refused(reason)),
    }
}

/// Every `k3-ctl serve` of this store (their listing sockets beside its socket), by pid.
fn servers(socket: &std::path::Path) -> Vec<k3_proto::serve::ServeListing> {
    let Some(dir) = socket.parent() else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<_> = entries
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(k3_proto::serve::is_listing_socket_name)
        })
        .filter_map(|e| match ask_serve(&e.path()) {
            Ok(l) => Some(l),
            Err(err) => {
                // A server that is gone leaves nothing to list.
                tracing::debug!("{}: {err}", e.path().display());
                None
            }
        })
        .collect();
    out.sort_by_key(|l| l.pid);
    out
}

/// Each server's requests as a table: running (with the worker) and queued (with the place).
fn render_servers(list: &[k3_proto::serve::ServeListing]) -> String {
    use k3_proto::serve::RequestState;
    use std::fmt::Write as _;
    let mut out = String::new();
    for l in list {
        let running = l
            .requests
            .iter()
            .filter(|r| matches!(r.state, RequestState::Running { .. }))
            .count();
        let _ = writeln!(
            out,
            "k3-ctl serve pid {} on {}: {running} running of {}, {} queued of {}",
            l.pid,
            l.listen,
            l.max_jobs,
            l.requests.len() - running,
            l.queue
        );
        let _ = writeln!(
            out,
            "  {:<28} {:<22} {:<18} {:>7} {:>9} {:>8}",
            "REQUEST", "ROUTE", "STATE", "PROMPT", "GEN/MAX", "AGE s"
        );
        for r in &l.requests {
            let state = match r.state {
                RequestState::Queued { position } => format!("queued #{position}"),
                RequestState::Running { worker_pid } => format!("running pid {worker_pid}"),
            };
            let id: String = r.request_id.chars().take(28).collect();
            let _ = writeln!(
                out,
                "  {:<28} {:<22} {:<18} {:>7} {:>9} {:>8.1}",
                id,
                r.route,
                state,
                r.prompt_ids,
                format!("{}/{}", r.generated, r.max_new),
                r.age_seconds
            );
        }
        if l.requests.is_empty() {
            out.push_str("  (no requests)\n");
        }
    }
    out
}

/// A live job that has held its expert leases at least this long is named as stuck by
/// `k3-ctl ps` (a computing worker takes new leases at every MoE layer).
const STUCK_AFTER_SECONDS: f64 = 5.0;

/// The live jobs as a table: pid, tokens so far, seconds per token, bytes read, how long each
/// has held its expert leases; then a line for each job holding them too long (stuck).
fn render_ps(s: &StatsReport) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "{:>6} {:>8}  {:<28} {:>7} {:>10} {:>9} {:>10} {:>10} {:>7} {:>8}\n",
        "CONN",
        "PID",
        "JOB",
        "TOKENS",
        "PREFILL s",
        "S/TOKEN",
        "TRUNK GB",
        "EXPERT GB",
        "HIT",
        "LEASE s"
    );
    let live: Vec<_> = s.jobs.iter().filter(|j| j.live).collect();
    for j in &live {
        let p = &j.progress;
        let label: String = j.label.chars().take(28).collect();
        let _ = writeln!(
            out,
            "{:>6} {:>8}  {:<28} {:>7} {:>10.3} {:>9} {:>10.3} {:>10.3} {:>6.1}% {:>8.1}",
            j.conn,
            j.pid,
            label,
            p.tokens,
            p.prefill_seconds,
            p.seconds_per_token()
                .map_or("-".to_string(), |v| format!("{v:.3}")),
            p.trunk_bytes_read as f64 / 1e9,
            j.counters.expert_bytes_read as f64 / 1e9,
            100.0 * j.counters.true_resident_hit_rate(),
            j.lease_age_seconds
        );
    }
    if live.is_empty() {
        out.push_str("(no live jobs)\n");
    }
    for j in live
        .iter()
        .filter(|j| j.lease_age_seconds >= STUCK_AFTER_SECONDS)
    {
        let _ = writeln!(
            out,
            "STUCK: pid {} (connection {}, {}) has held its expert leases for {:.1} s \
             (stopped or swapped out?); other workers read around it privately",
            j.pid, j.conn, j.label, j.lease_age_seconds
        );
    }
    out
}

/// `k3-ctl ps`: the store's live jobs.
pub fn run_ps(a: PsArgs) -> Result<i32, Failed> {
    let mut c = connect(&a.socket)?;
    match call(&mut c, &Request::Stats)? {
        Response::Stats(s) => {
            let servers = servers(&a.socket.path());
            if a.json {
                let live: Vec<_> = s.jobs.iter().filter(|j| j.live).collect();
                let v = serde_json::json!({"jobs": live, "servers": servers});
                println!("{v}");
            } else {
                print!("{}", render_ps(&s));
                print!("{}", render_servers(&servers));
            }
            Ok(exit::OK)
        }
        other => Err(unexpected(&other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_proto::wire::JobStats;

    #[test]
    fn ps_lists_live_jobs_with_tokens_and_seconds_per_token() {
        let mut s = StatsReport::default();
        for (conn, live, tokens) in [(1u64, false, 9u64), (2, true, 5), (3, true, 1)] {
            s.jobs.push(JobStats {
                conn,
                label: format!("k3-worker pid {conn}"),
                live,
                progress: k3_proto::wire::JobProgress {
                    tokens,
                    decode_seconds: 2.0 * tokens.saturating_sub(1) as f64,
                    prefill_seconds: 3.0,
                    trunk_bytes_read: 4_000_000_000,
                    ..Default::default()
                },
                ..JobStats::default()
            });
        }
        let t = render_ps(&s);
        assert!(!t.contains("pid 1 "), "a finished job is not listed:\n{t}");
        let row2 = t.lines().find(|l| l.contains("pid 2")).unwrap();
        assert!(
            row2.contains(" 5 ") && row2.contains("2.000") && row2.contains("4.000"),
            "{t}"
        );
        let row3 = t.lines().find(|l| l.contains("pid 3")).unwrap();
        assert!(row3.contains(" - "), "one token: no s/token yet:\n{t}");
        assert!(render_ps(&StatsReport::default()).contains("no live jobs"));
        assert!(!t.contains("STUCK"), "{t}");
        // A job holding its leases for a minute is named, with its pid.
        s.jobs[2].pid = 4242;
        s.jobs[2].lease_age_seconds = 61.0;
        let t = render_ps(&s);
        let stuck = t.lines().find(|l| l.starts_with("STUCK")).unwrap();
        assert!(
            stuck.contains("pid 4242") && stuck.contains("61.0 s"),
            "{t}"
        );
    }

    #[test]
    fn ps_lists_each_servers_running_and_queued_requests() {
        use k3_proto::serve::{RequestInfo, RequestState, ServeListing};
        let req = |id: &str, state| RequestInfo {
            request_id: id.into(),
            route: "/v1/completions".into(),
            state,
            prompt_ids: 12,
            max_new: 16,
            generated: 3,
            age_seconds: 1.5,
        };
        let t = render_servers(&[ServeListing {
            pid: 77,
            listen: "127.0.0.1:8080".into(),
            max_jobs: 1,
            queue: 8,
            requests: vec![
                req("req-a", RequestState::Running { worker_pid: 900 }),
                req("req-b", RequestState::Queued { position: 1 }),
            ],
        }]);
        assert!(
            t.contains("pid 77 on 127.0.0.1:8080: 1 running of 1, 1 queued of 8"),
            "{t}"
        );
        let b = t.lines().find(|l| l.contains("req-b")).unwrap();
        assert!(b.contains("queued #1") && b.contains("3/16"), "{t}");
        assert!(
            t.lines()
                .any(|l| l.contains("req-a") && l.contains("running pid 900")),
            "{t}"
        );
    }

    #[test]
    fn watch_frames_redraw_in_place() {
        let f = in_place("a\nbb\n");
        assert_eq!(f, "\x1b[Ha\x1b[K\nbb\x1b[K\n\x1b[J");
        assert!(!f.contains("\x1b[2J"), "no full clear: it flickers");
    }

    #[test]
    fn stats_table_shows_true_hit_rate_per_job() {
        let s = StatsReport {
            lifetime: Counters {
                requests: 10,
                resident_hits: 4,
                misses: 6,
                prefetch_loads: 5,
                prefetch_bytes: 5_000_000,
                prefetch_used: 3,
                prefetch_dropped: 4,
                trunk_bytes_read: 2_500_000_000,
                trunk_layer_reads: 10,
                trunk_layers_served: 30,
                trunk_shared_layers: 20,
                trunk_wait_seconds: 1.5,
                broken_leases: 1,
                preloaded_experts: 64,
                preload_bytes: 1_123_024_896,
                preload_seconds: 0.4,
                preload_hits: 3,
                ..Default::default()
            },
            usage: k3_proto::wire::UsageStats {
                file: "/s/expert-usage.k3usage".into(),
                requests_at_start: 500,
                requests_counted: 10,
                requests_saved: 8,
                experts_used: 90,
                preload: "hot".into(),
                hot_preloaded: 64,
                ..Default::default()
            },
            jobs: vec![
                JobStats {
                    conn: 1,
                    label: "first".into(),
                    live: false,
                    counters: Counters {
                        requests: 5,
                        misses: 5,
                        trunk_bytes_read: 2_500_000_000,
                        trunk_layers_served: 15,
                        trunk_shared_layers: 5,
                        ..Default::default()
                    },
                    ..Default::default()
                },
                JobStats {
                    conn: 2,
                    label: "second".into(),
                    live: true,
                    counters: Counters {
                        requests: 5,
                        resident_hits: 4,
                        misses: 1,
                        ..Default::default()
                    },
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let t = render_stats(&s);
        assert!(t.contains("TRUE resident hits 4 (40.0%)"), "{t}");
        assert!(
            t.contains(
                "prefetch: 5 experts (5.00 MB) read ahead by router lookahead, 3 used, 2.00 MB \
                 wasted, 4 dropped unread"
            ),
            "{t}"
        );
        assert!(
            t.contains(
                "preload:  64 experts (1.12 GB) read at start-up in 0.40 s: the most used of the \
                 usage history (not in the figures above); 3 TRUE hits on them so far"
            ),
            "{t}"
        );
        assert!(
            t.contains(
                "usage:    10 expert requests counted since the start (8 saved), 500 in the \
                 history at start, 90 experts used  file /s/expert-usage.k3usage\n"
            ),
            "{t}"
        );
        let empty = render_stats(&StatsReport::default());
        assert!(
            !empty.contains("preload:") && !empty.contains("usage:"),
            "{empty}"
        );
        let second = t.lines().find(|l| l.contains("second")).unwrap();
        assert!(second.contains("80.0%"), "{second}");
        let first = t.lines().find(|l| l.contains("first")).unwrap();
        assert!(first.contains("0.0%"), "{first}");
        // The shared trunk ring: lifetime reads, hand-outs, shared ones, waits, broken leases;
        // per job its trunk MB and shared/served layers.
        assert!(
            t.contains("trunk:    read 2.50 GB in 10 layer reads  served 30 layers (20 from a shared read)  waits 1.50 s  broken leases 1"),
            "{t}"
        );
        assert!(
            first.contains("2500.0") && first.contains("5/15"),
            "{first}"
        );
    }
}
