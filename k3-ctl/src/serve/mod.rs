//! `k3-ctl serve`: an OpenAI-compatible HTTP server in front of a running store.
//!
//! The server renders and tokenizes; each generation runs as one `k3-worker` child attached to
//! the store (the store stays free of HTTP and maths), spoken to in the typed job protocol
//! ([`k3_proto::serve`]; [`job`]), its ids detokenized here as they arrive. See the README
//! section "OpenAI-compatible server" for the routes, the request fields and the flags; [`api`]
//! for what is accepted and refused; [`conn`] for connection limits and disconnects; [`access`]
//! for request ids, the API key and CORS; [`listing`] for what `k3-ctl ps` is told.
//!
//! Exit codes: 0 after SIGINT/SIGTERM; 2 refused before serving (bad flag, tokenizer, worker
//! binary, address, API key file); 3 no store answers at the socket.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use k3_proto::exit;
use k3_proto::wire::{ClientKind, Request, Response};
use k3_worker::chat::Markers;
use k3_worker::tokenizer::Tokenizer;
use tower::ServiceExt;

mod access;
mod anthropic;
mod api;
mod batch;
mod conn;
mod http;
mod job;
mod listing;
mod metrics;
mod queue;
mod reply;
mod sessions;
mod text;

/// Largest request head (request line + headers), in bytes.
const MAX_HEAD_BYTES: usize = 16 << 10;
/// Most request headers.
const MAX_HEADERS: usize = 64;
/// Environment variable with the API key (`--api-key-file` wins).
const API_KEY_ENV: &str = "K3_API_KEY";
/// Prompt ids of the request the default `--max-jobs` is sized for (with the default chat
/// `max_tokens`).
const SIZING_PROMPT: usize = 4096;

/// Arguments of `k3-ctl serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Store socket.
    #[command(flatten)]
    pub socket: k3_store::cli::SocketArgs,
    /// Address to listen on. Beyond loopback, give an API key (a warning is printed otherwise).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// A file holding the API key clients must send (`Authorization: Bearer KEY`); default:
    /// the K3_API_KEY environment variable; neither: no key asked.
    #[arg(long, value_name = "PATH")]
    pub api_key_file: Option<PathBuf>,
    /// An origin browsers may call this server from (CORS; repeatable; `*` for any). Default:
    /// none (CORS off).
    #[arg(long, value_name = "ORIGIN")]
    pub cors_origin: Vec<String>,
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
    /// Workers running at once (each uses every core unless --threads). Default: as many as
    /// the memory this machine has free holds the state of a 4,096-id prompt and the default
    /// reply for (the worker's memory plan), at most one per CPU.
    #[arg(long, value_name = "N")]
    pub max_jobs: Option<usize>,
    /// Give every request a worker of its own instead of decoding concurrent requests together
    /// in one batch worker (continuous batching; on by default when --max-jobs is above 1:
    /// requests join and leave its batch between steps, each weight read once per step for all).
    #[arg(long)]
    pub no_batch: bool,
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
    /// Seconds a cancelled job (its client went away) has to stop at a step boundary and keep
    /// its prefill before its worker is killed.
    #[arg(long, value_name = "S", default_value_t = 30)]
    pub cancel_grace: u64,
    /// Most open connections (a new one takes the place of the oldest that is not busy).
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_connections: usize,
    /// Most open connections from one client address.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub max_connections_per_client: usize,
    /// Seconds a client has to send a request head; its body gets as long again.
    #[arg(long, value_name = "S", default_value_t = 10)]
    pub request_timeout: u64,
    /// Seconds a connection may stay idle between requests.
    #[arg(long, value_name = "S", default_value_t = 30)]
    pub idle_timeout: u64,
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

/// Why the API key was refused (exit 2).
#[derive(Debug, thiserror::Error)]
enum KeyError {
    /// The key file cannot be read.
    #[error("{}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The key file is larger than a key.
    #[error("{}: an API key file is at most 4 KiB", .0.display())]
    TooLarge(PathBuf),
    /// An empty key.
    #[error("the API key is empty")]
    Empty,
    /// A key with spaces or non-ASCII bytes.
    #[error("the API key must be printable ASCII without spaces")]
    NotPrintable,
}

/// Why `--max-jobs` could not be sized from the plan.
#[derive(Debug, thiserror::Error)]
enum SizingError {
    /// The model's config.
    #[error(transparent)]
    Config(#[from] k3_proto::config::ConfigError),
    /// The model's dims.
    #[error(transparent)]
    Dims(#[from] k3_worker::model::ModelError),
    /// The memory available.
    #[error(transparent)]
    MemInfo(#[from] k3_store::runtime::plan::MemInfoError),
}

/// The API key: `--api-key-file` (one line; surrounding whitespace dropped), else K3_API_KEY.
fn api_key(a: &Args) -> Result<Option<Vec<u8>>, KeyError> {
    let key = match &a.api_key_file {
        Some(p) => {
            let io = |source| KeyError::Read {
                path: p.clone(),
                source,
            };
            let meta = std::fs::metadata(p).map_err(io)?;
            if meta.len() > 4096 {
                return Err(KeyError::TooLarge(p.clone()));
            }
            std::fs::read_to_string(p).map_err(io)?
        }
        None => match std::env::var(API_KEY_ENV) {
            Ok(k) => k,
            Err(_) => return Ok(None),
        },
    };
    let key = key.trim();
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.bytes().any(|b| !(0x21..0x7f).contains(&b)) {
        return Err(KeyError::NotPrintable);
    }
    Ok(Some(key.as_bytes().to_vec()))
}

/// The default `--max-jobs`: workers whose state for a [`SIZING_PROMPT`]-id prompt and the
/// default reply fit in the memory free now, at most one per CPU, at least one; with the sizes.
fn sized_max_jobs(model_dir: &Path) -> Result<(usize, String), SizingError> {
    let cfg = k3_proto::config::ModelConfig::load(&model_dir.join("config.json"))?;
    let dims = k3_worker::model::Dims::from_config(&cfg)?;
    let positions = k3_worker::generate::positions_needed(SIZING_PROMPT, api::DEFAULT_CHAT_TOKENS);
    let chunk = k3_worker::generate::DEFAULT_PREFILL_CHUNK;
    let drafts = k3_worker::spec::SpecMode::Auto.max_drafts();
    let per_job = k3_worker::job::attached_job_bytes(&dims, positions, chunk, drafts).max(1);
    let avail = k3_store::runtime::plan::allocatable()?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let fit = usize::try_from(avail / per_job).unwrap_or(usize::MAX);
    let n = fit.clamp(1, cpus);
    Ok((
        n,
        format!(
            "{} per job of {positions} positions, {} free, {cpus} CPUs",
            k3_store::runtime::plan::fmt_bytes(per_job),
            k3_store::runtime::plan::fmt_bytes(avail)
        ),
    ))
}

/// Runs `k3-ctl serve`.
pub fn run(a: Args) -> i32 {
    if a.max_jobs == Some(0) {
        return refuse("--max-jobs must be ≥ 1");
    }
    if a.threads == Some(0) {
        return refuse("--threads must be ≥ 1");
    }
    if a.max_body == 0 {
        return refuse("--max-body must be ≥ 1");
    }
    if a.max_connections == 0 || a.max_connections_per_client == 0 {
        return refuse("--max-connections and --max-connections-per-client must be ≥ 1");
    }
    if a.request_timeout == 0 || a.idle_timeout == 0 {
        return refuse("--request-timeout and --idle-timeout must be ≥ 1");
    }
    let key = match api_key(&a) {
        Ok(k) => k,
        Err(e) => return refuse(format!("API key: {e}")),
    };
    if a.cors_origin
        .iter()
        .any(|o| axum::http::HeaderValue::from_str(o).is_err() || o.is_empty())
    {
        return refuse("--cors-origin: an origin is a scheme, host and port (or *)");
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
    let (max_jobs, sizing) = match a.max_jobs {
        Some(n) => (n, "--max-jobs".to_string()),
        None => match sized_max_jobs(&model_dir) {
            Ok((n, why)) => (n, format!("sized from the plan: {why}")),
            Err(e) => {
                return refuse(format!(
                    "cannot size --max-jobs from the plan ({e}): pass --max-jobs N"
                ))
            }
        },
    };
    let limits = conn::Limits {
        total: a.max_connections,
        per_addr: a.max_connections_per_client,
        head: Duration::from_secs(a.request_timeout),
        body: Duration::from_secs(a.request_timeout),
        idle: Duration::from_secs(a.idle_timeout),
    };
    let spec = job::WorkerSpec {
        exe: worker.clone(),
        socket: socket.clone(),
        threads: a.threads,
        grace: Duration::from_secs(a.cancel_grace),
    };
    // One batch worker for the requests that fit a job of the sizing prompt and default reply;
    // larger ones (and every request with --no-batch or one job at a time) get their own.
    let batch = (max_jobs > 1 && !a.no_batch).then(|| {
        let positions =
            k3_worker::generate::positions_needed(SIZING_PROMPT, api::DEFAULT_CHAT_TOKENS);
        batch::BatchPool::new(spec.clone(), max_jobs, positions)
    });
    let state = Arc::new(http::AppState {
        tok: Arc::new(tok),
        markers,
        worker: spec,
        batch,
        admission: queue::Admission::new(max_jobs, a.queue),
        model_id: a.model_name.clone(),
        vocab,
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        socket: socket.clone(),
        sessions: !a.no_sessions,
        max_body: a.max_body,
        body_timeout: limits.body,
        metrics: metrics::Metrics::new(max_jobs, a.queue),
        defaults: api::Defaults::default(),
        policy: access::Policy {
            api_key: key,
            cors_origins: a.cors_origin.clone(),
        },
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
        if !addr.ip().is_loopback() && state.policy.api_key.is_none() {
            tracing::warn!(
                "listening on {addr}, which is not a loopback address, without an API key: \
                 anyone who reaches it can use it (--api-key-file PATH or K3_API_KEY)"
            );
        }
        let listing = listing::start(&socket, state.clone(), addr, max_jobs, a.queue);
        if let Err(e) = &listing {
            tracing::warn!("k3-ctl ps will not list this server's requests: {e}");
        }
        println!(
            "k3-ctl serve: listening on http://{addr} (model {:?} from {}, store {}, tokenizer {}, worker {}, {} job(s) at once ({sizing}), queue {}{})",
            a.model_name,
            model_dir.display(),
            socket.display(),
            tok_dir.display(),
            worker.display(),
            max_jobs,
            a.queue,
            if state.policy.api_key.is_some() { ", API key required" } else { "" },
        );
        let app = access::layers(http::routes(state.clone()), state.clone());
        let code = serve(listener, app, conn::Registry::new(limits), state).await;
        drop(listing);
        code
    });
    // Dropping the runtime drops every in-flight request: their workers are cancelled.
    rt.shutdown_timeout(Duration::from_millis(500));
    code
}

/// The 503 a connection gets when every place is busy with a request (written as is: the
/// connection is not served).
fn busy_response() -> Vec<u8> {
    let body = api::ApiError::unavailable(
        "busy",
        "every connection is busy with a request; retry later",
    )
    .body()
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 5\r\nContent-Type: application/json\r\n\
         Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Accept connections until SIGINT or SIGTERM.
async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    registry: Arc<conn::Registry>,
    state: Arc<http::AppState>,
) -> i32 {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot watch SIGTERM: {e}");
            return exit::FAILURE;
        }
    };
    let mut int = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot watch SIGINT: {e}");
            return exit::FAILURE;
        }
    };
    let limits = registry.limits();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.head)
        .max_header_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS)
        // A client that ends its sending side after its request still gets its answer
        // (conn::watch tells it from a client that is gone).
        .half_close(true);
    loop {
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // E.g. out of file descriptors: wait a little instead of spinning.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = int.recv() => break,
            _ = term.recv() => break,
        };
        let Some(slot) = registry.admit(peer) else {
            let _ = tcp.try_write(&busy_response());
            continue;
        };
        state
            .metrics
            .connections
            .set(i64::try_from(registry.open()).unwrap_or(i64::MAX));
        // A client that vanishes without closing (a cable, a crashed host) is noticed by TCP
        // keepalive within a minute.
        let ka = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(20))
            .with_interval(Duration::from_secs(10))
            .with_retries(3);
        let _ = socket2::SockRef::from(&tcp).set_tcp_keepalive(&ka);
        let c = slot.conn.clone();
        let (stream, tcp) = conn::Stream::new(tcp, c.clone());
        let app = app.clone();
        let svc_conn = c.clone();
        let svc =
            hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                let c = svc_conn.clone();
                let has_body = req.headers().contains_key(hyper::header::TRANSFER_ENCODING)
                    || req
                        .headers()
                        .get(hyper::header::CONTENT_LENGTH)
                        .and_then(|v| v.to_str().ok())
                        .is_some_and(|v| v.trim() != "0");
                c.request(has_body);
                req.extensions_mut().insert(c.clone());
                let fut = app.clone().oneshot(req.map(Body::new));
                async move {
                    let r = fut.await?;
                    let guard = conn::AnswerGuard(c);
                    Ok::<_, std::convert::Infallible>(r.map(move |b| {
                        Body::new(b.map_frame(move |f| {
                            let _keep = &guard;
                            f
                        }))
                    }))
                }
            });
        let served = http.serve_connection(TokioIo::new(stream), svc);
        let reg = registry.clone();
        let st = state.clone();
        tokio::spawn(async move {
            let watcher = tokio::spawn(conn::watch(c.clone(), tcp, limits));
            tokio::select! {
                _ = served => {}
                _ = c.closed() => {}
            }
            watcher.abort();
            drop(slot);
            st.metrics
                .connections
                .set(i64::try_from(reg.open()).unwrap_or(i64::MAX));
        });
    }
    tracing::info!("stopping (in-flight jobs are cancelled)");
    exit::OK
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_busy_answer_is_well_formed() {
        let r = String::from_utf8(super::busy_response()).unwrap();
        let (head, body) = r.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "));
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(len, body.len());
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "busy");
    }
}
