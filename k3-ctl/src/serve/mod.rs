//! `k3-ctl serve`: an OpenAI-compatible HTTP server in front of a running store.
//!
//! The server renders and tokenizes; each generation runs as one `k3-worker` child attached to
//! the store (the store stays free of HTTP and maths), its ids read from the worker's stdout and
//! detokenized here as they arrive. See the README section "OpenAI-compatible server" for the
//! routes, the request fields and the flags; [`api`] for what is accepted and refused.
//!
//! Exit codes: 0 after SIGINT/SIGTERM; 2 refused before serving (bad flag, tokenizer, worker
//! binary, address); 3 no store answers at the socket.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use k3_proto::exit;
use k3_proto::wire::{ClientKind, Request, Response};
use k3_worker::chat::Markers;
use k3_worker::tokenizer::Tokenizer;

mod api;
mod http;
mod job;
mod queue;
mod reply;
mod sessions;
mod text;

/// Largest request head (request line + headers), in bytes.
const MAX_HEAD_BYTES: usize = 16 << 10;
/// Most request headers.
const MAX_HEADERS: usize = 64;
/// Time a client has to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// Most open connections; further ones wait in the listen backlog.
const MAX_CONNECTIONS: usize = 256;

/// Arguments of `k3-ctl serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Store socket.
    #[command(flatten)]
    pub socket: k3_store::cli::SocketArgs,
    /// Address to listen on. The server has no authentication: keep it on loopback unless a
    /// proxy in front of it does that.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Tokenizer directory (default: the shipped one, found relative to this binary:
    /// <bin>/../share/k3/tokenizer, else <bin>/../../fixtures/tokenizer in a build tree).
    #[arg(long, value_name = "DIR")]
    pub tok: Option<PathBuf>,
    /// The k3-worker binary (default: the one beside this k3-ctl).
    #[arg(long, value_name = "PATH")]
    pub worker: Option<PathBuf>,
    /// The model id clients name in `model` and `GET /v1/models` lists.
    #[arg(long, value_name = "ID", default_value = "kimi-k3")]
    pub model_name: String,
    /// Workers running at once (each uses every core unless --threads).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub max_jobs: usize,
    /// Requests waiting for a worker slot; beyond that the answer is 429 with Retry-After.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub queue: usize,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, value_name = "BYTES", default_value_t = 1 << 20)]
    pub max_body: usize,
    /// Compute threads per worker (`k3-worker --threads`; default: all cores).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Do not keep conversations in the store (by default a request whose ids extend a kept
    /// conversation resumes it, and every request's state is kept for the next turn).
    #[arg(long)]
    pub no_sessions: bool,
}

/// The shipped tokenizer relative to the running binary.
fn default_tokenizer(exe: &Path) -> Option<PathBuf> {
    let bin = exe.parent()?;
    let candidates = [
        bin.join("../share/k3/tokenizer"),
        bin.join("../../fixtures/tokenizer"),
    ];
    candidates
        .into_iter()
        .find(|d| d.join("tiktoken.model").is_file())
}

fn refuse(msg: impl std::fmt::Display) -> i32 {
    tracing::warn!("{msg}");
    exit::REFUSED
}

/// Runs `k3-ctl serve`.
pub fn run(a: Args) -> i32 {
    if a.max_jobs == 0 {
        return refuse("--max-jobs must be ≥ 1");
    }
    if a.threads == Some(0) {
        return refuse("--threads must be ≥ 1");
    }
    if a.max_body == 0 {
        return refuse("--max-body must be ≥ 1");
    }
    let exe = std::env::current_exe().ok();
    let tok_dir = match (&a.tok, exe.as_deref().and_then(default_tokenizer)) {
        (Some(d), _) => d.clone(),
        (None, Some(d)) => std::fs::canonicalize(&d).unwrap_or(d),
        (None, None) => {
            return refuse(
                "no tokenizer beside this binary (<bin>/../share/k3/tokenizer or <bin>/../../fixtures/tokenizer): pass --tok DIR",
            )
        }
    };
    let tok = match Tokenizer::from_dir(&tok_dir) {
        Ok(t) => t,
        Err(e) => return refuse(format!("tokenizer {}: {e}", tok_dir.display())),
    };
    let markers = match Markers::from_tokenizer(&tok) {
        Ok(m) => m,
        Err(e) => return refuse(format!("tokenizer {}: {e}", tok_dir.display())),
    };
    let worker = match (&a.worker, &exe) {
        (Some(p), _) => p.clone(),
        (None, Some(e)) => e.with_file_name("k3-worker"),
        (None, None) => return refuse("cannot locate this binary: pass --worker PATH"),
    };
    if !worker.is_file() {
        return refuse(format!(
            "no k3-worker at {} (pass --worker PATH)",
            worker.display()
        ));
    }
    let socket = a.socket.path();
    let status =
        k3_store::attach::client::Client::connect(&socket, ClientKind::Control, "k3-ctl serve")
            .map_err(|e| e.to_string())
            .and_then(|mut c| c.call(&Request::Status).map_err(|e| e.to_string()));
    let model_dir = match status {
        Ok(Response::Status(s)) => PathBuf::from(s.model_dir),
        Ok(other) => {
            tracing::warn!("unexpected answer from the store: {other:?}");
            return exit::NO_STORE;
        }
        Err(e) => {
            tracing::warn!("{e}");
            return exit::NO_STORE;
        }
    };
    let cfg_path = model_dir.join("config.json");
    let vocab = match k3_proto::config::ModelConfig::load(&cfg_path) {
        Ok(c) => c.vocab_size,
        Err(e) => return refuse(format!("{}: {e}", cfg_path.display())),
    };
    let state = Arc::new(http::AppState {
        tok: Arc::new(tok),
        markers,
        worker: job::WorkerSpec {
            exe: worker.clone(),
            socket: socket.clone(),
            threads: a.threads,
        },
        admission: queue::Admission::new(a.max_jobs, a.queue),
        model_id: a.model_name.clone(),
        vocab,
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        socket: socket.clone(),
        sessions: !a.no_sessions,
    });
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::warn!("cannot start the async runtime: {e}");
            return exit::FAILURE;
        }
    };
    let code = rt.block_on(async {
        let listener = match tokio::net::TcpListener::bind(a.listen).await {
            Ok(l) => l,
            Err(e) => return refuse(format!("cannot listen on {}: {e}", a.listen)),
        };
        let addr = listener.local_addr().unwrap_or(a.listen);
        if !addr.ip().is_loopback() {
            tracing::warn!("listening on {addr}, which is not a loopback address; the server has no authentication"
            );
        }
        println!(
            "k3-ctl serve: listening on http://{addr} (model {:?} from {}, store {}, tokenizer {}, worker {}, {} job(s) at once, queue {})",
            a.model_name,
            model_dir.display(),
            socket.display(),
            tok_dir.display(),
            worker.display(),
            a.max_jobs,
            a.queue
        );
        serve(listener, http::router(state, a.max_body)).await
    });
    // Dropping the runtime drops every in-flight request: their workers are killed.
    rt.shutdown_timeout(Duration::from_secs(2));
    code
}

/// Accept connections until SIGINT or SIGTERM.
async fn serve(listener: tokio::net::TcpListener, app: axum::Router) -> i32 {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot watch SIGTERM: {e}");
            return exit::FAILURE;
        }
    };
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_header_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS);
    loop {
        let permit = tokio::select! {
            p = connections.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return exit::FAILURE, // never closed
            },
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // E.g. out of file descriptors: wait a little instead of spinning.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
        };
        let conn =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
    tracing::info!("stopping (in-flight jobs are cancelled)");
    exit::OK
}
