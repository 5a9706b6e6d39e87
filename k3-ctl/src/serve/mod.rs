//! `k3-ctl serve`: an OpenAI-compatible HTTP server in front of a running store.
//!
//! The server renders and tokenizes; every generation runs as a job of its one `k3-worker`
//! child attached to the store (the store stays free of HTTP and maths), whose engine decodes
//! up to `--max-jobs` jobs at once (continuous batching: a job joins and leaves between steps),
//! spoken to in the typed job protocol ([`k3_proto::serve`]; [`job`]), its ids detokenized here
//! as they arrive. See the README section "OpenAI-compatible server" for the routes, the
//! request fields and the flags; [`api`] for what is accepted and refused; [`conn`] for
//! connection limits and disconnects; [`access`] for request ids, the API key and CORS;
//! [`listing`] for what `k3-ctl ps` is told.
//!
//! Exit codes (one mapping, [`ServeError`] through `k3_proto::exit::report`): 0 after SIGINT or
//! SIGTERM; 1 the async runtime or the signals cannot be set up; 2 refused before serving (bad
//! flag, tokenizer, worker binary, address, API key file, a slot count that cannot be sized);
//! 3 no store answers at the socket.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use k3_proto::exit;
use k3_proto::wire::{ClientKind, Request, Response};
use k3_worker::engine::memory::EnginePlan;
use k3_worker::text::xtml::Markers;
use k3_worker::tokenizer::Tokenizer;
use tower::ServiceExt;

mod access;
mod anthropic;
mod api;
mod conn;
mod http;
mod job;
mod listing;
mod metrics;
mod queue;
mod reply;
mod sessions;
mod shape;
mod supervise;
mod text;

/// Environment variable with the API key (`--api-key-file` wins).
const API_KEY_ENV: &str = "K3_API_KEY";
/// Prompt ids of the request a slot is planned for by default (with the default chat
/// `max_tokens`): `--ctx`.
const SIZING_PROMPT: usize = 4096;
/// The most slots the default `--max-jobs` gives (more need `--max-jobs`).
const DEFAULT_MAX_SLOTS: usize = 16;

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
    /// Requests decoded at once: the slots of the server's one worker, which runs them in one
    /// forward pass per step (continuous batching: a request joins and leaves between steps;
    /// each weight is read once per step for all of them). Default: as many slots of --ctx
    /// positions as the memory this machine may still allocate holds (the engine's memory
    /// plan, 85% of what is free), at most 16.
    #[arg(long, value_name = "N")]
    pub max_jobs: Option<usize>,
    /// Positions each slot is planned for (prompt + reply; default: a 4,096-id prompt and the
    /// default chat reply). A longer request still runs: it takes the room of several slots
    /// (it waits for them when they are busy), up to the longest request accepted.
    #[arg(long, value_name = "N")]
    pub ctx: Option<usize>,
    /// Requests waiting for a worker slot; beyond that the answer is 429 with Retry-After.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub queue: usize,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, value_name = "BYTES", default_value_t = 1 << 20)]
    pub max_body: usize,
    /// Compute threads of the worker (`k3-worker --threads`; default: all cores).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Do not keep conversations in the store (by default a request whose ids extend a kept
    /// conversation resumes it, and every request's state is kept for the next turn).
    #[arg(long)]
    pub no_sessions: bool,
    /// Seconds a cancelled job (its client went away) has to end at a step boundary and keep
    /// its prefill before the worker is killed (its other jobs fail; the next request starts
    /// a new worker).
    #[arg(long, value_name = "S", default_value_t = 30)]
    pub cancel_grace: u64,
    /// Seconds the worker may hold jobs without a step's message before it is failed (its
    /// requests get 503 `worker_stalled`), killed and replaced. Default: derived from the plan,
    /// 60 s + 4 × (the expert bytes the plan's largest step may read) / (1 GB/s).
    #[arg(long, value_name = "S")]
    pub stall_timeout: Option<u64>,
    /// Most open connections (a new one takes the place of the oldest that is not busy).
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_connections: usize,
    /// Most open connections from one client address.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub max_connections_per_client: usize,
    /// Seconds a client has to send a request head from its first byte; its body gets as long again.
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

/// Why serve did not serve, with its exit code (`k3_proto::exit::report` prints it).
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A flag out of range (exit 2).
    #[error("{0}")]
    Usage(&'static str),
    /// The API key (exit 2).
    #[error("API key")]
    Key(#[from] KeyError),
    /// No tokenizer given or shipped (exit 2).
    #[error(
        "no tokenizer beside this binary (<bin>/../share/k3/tokenizer or \
         <bin>/../../fixtures/tokenizer): pass --tok DIR"
    )]
    NoTokenizer,
    /// The tokenizer cannot be loaded (exit 2).
    #[error("tokenizer {}", dir.display())]
    Tokenizer {
        /// Its directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: k3_worker::tokenizer::TokError,
    },
    /// The tokenizer has no chat markers (exit 2).
    #[error("tokenizer {}", dir.display())]
    Markers {
        /// Its directory.
        dir: PathBuf,
        /// Which.
        #[source]
        source: k3_worker::text::xtml::MissingMarker,
    },
    /// This binary's path is unknown (exit 2).
    #[error("cannot locate this binary: pass --worker PATH")]
    NoExe,
    /// No worker binary (exit 2).
    #[error("no k3-worker at {} (pass --worker PATH)", .0.display())]
    NoWorker(PathBuf),
    /// No store answers (exit 3).
    #[error("cannot use the store{}", store_at(socket, source))]
    NoStore {
        /// Its socket.
        socket: PathBuf,
        /// Why.
        #[source]
        source: k3_store::attach::client::ClientError,
    },
    /// The store answered something else (exit 3).
    #[error("unexpected answer from the store: {0}")]
    StoreAnswer(String),
    /// The model's config (exit 2).
    #[error("{}", path.display())]
    Config {
        /// `config.json`.
        path: PathBuf,
        /// Why.
        #[source]
        source: k3_proto::config::ConfigError,
    },
    /// The default slot count cannot be sized (exit 2).
    #[error("cannot size --max-jobs from the plan: pass --max-jobs N")]
    Sizing(#[source] SizingError),
    /// The async runtime (exit 1).
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    /// The listening address (exit 2).
    #[error("cannot listen on {addr}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No random bytes for the session key (exit 1).
    #[error("cannot draw the session names' key")]
    Random(#[source] getrandom::Error),
    /// A signal cannot be watched (exit 1).
    #[error("cannot watch {0}")]
    Signal(&'static str, #[source] std::io::Error),
}

impl k3_proto::exit::ExitStatus for ServeError {
    fn exit_code(&self) -> i32 {
        match self {
            ServeError::NoStore { .. } | ServeError::StoreAnswer(_) => exit::NO_STORE,
            ServeError::Runtime(_) | ServeError::Signal(..) | ServeError::Random(_) => {
                exit::FAILURE
            }
            _ => exit::REFUSED,
        }
    }
}

/// Why the API key was refused (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The key file cannot be read.
    #[error("{}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
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
pub enum SizingError {
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

/// The engine plan of the server's worker with `slots` slots of `positions` (the worker's own
/// statement: `k3_worker::engine::memory`).
fn engine_plan(slots: usize, positions: usize) -> EnginePlan {
    use k3_worker::engine::memory::prefill_rows;
    let longest = k3_worker::front::job::serve_longest().max(positions);
    EnginePlan {
        slots,
        positions,
        longest,
        prefill_rows: prefill_rows(k3_worker::engine::sampling::DEFAULT_PREFILL_CHUNK, longest),
        drafts: k3_worker::engine::spec::SpecMode::Auto.max_drafts(),
        draft_model: false,
        keep_step0_logits: false,
    }
}

/// The default `--max-jobs`: the slots of `positions` whose states and passes fit
/// [`AUTO_SHARE`](k3_store::runtime::plan::AUTO_SHARE) of the memory this process may allocate
/// now, as the worker's engine states them, at least 1, at most [`DEFAULT_MAX_SLOTS`]; with
/// the sizes.
fn sized_max_jobs(model_dir: &Path, positions: usize) -> Result<(usize, String), SizingError> {
    use k3_store::runtime::plan::{allocatable, fmt_bytes, AUTO_SHARE};
    let cfg = k3_proto::config::ModelConfig::load(&model_dir.join("config.json"))?;
    let dims = k3_worker::model::Dims::from_config(&cfg)?;
    let avail = allocatable()?;
    let usable = (avail as f64 * AUTO_SHARE) as u64;
    let one = engine_plan(1, positions);
    let n = one.slots_that_fit(&dims, usable, DEFAULT_MAX_SLOTS);
    Ok((
        n,
        format!(
            "{} per slot of {positions} positions, {} free",
            fmt_bytes(one.seq_bytes(&dims, positions).max(1)),
            fmt_bytes(avail)
        ),
    ))
}

/// The flags checked before anything else (exit 2).
fn check_flags(a: &Args) -> Result<(), ServeError> {
    let bad = |m| Err(ServeError::Usage(m));
    if a.max_jobs == Some(0) {
        return bad("--max-jobs must be ≥ 1");
    }
    if a.ctx == Some(0) {
        return bad("--ctx must be ≥ 1");
    }
    if a.threads == Some(0) {
        return bad("--threads must be ≥ 1");
    }
    if a.max_body == 0 {
        return bad("--max-body must be ≥ 1");
    }
    if a.max_connections == 0 || a.max_connections_per_client == 0 {
        return bad("--max-connections and --max-connections-per-client must be ≥ 1");
    }
    if a.request_timeout == 0 || a.idle_timeout == 0 || a.stall_timeout == Some(0) {
        return bad("--request-timeout, --idle-timeout and --stall-timeout must be ≥ 1");
    }
    if a.cors_origin
        .iter()
        .any(|o| axum::http::HeaderValue::from_str(o).is_err() || o.is_empty())
    {
        return bad("--cors-origin: an origin is a scheme, host and port (or *)");
    }
    Ok(())
}

/// The tokenizer (`--tok`, or the shipped one) and its chat markers.
fn tokenizer(a: &Args, exe: Option<&Path>) -> Result<(PathBuf, Tokenizer, Markers), ServeError> {
    let dir = match (&a.tok, exe.and_then(default_tokenizer)) {
        (Some(d), _) => d.clone(),
        (None, Some(d)) => std::fs::canonicalize(&d).unwrap_or(d),
        (None, None) => return Err(ServeError::NoTokenizer),
    };
    let tok = Tokenizer::from_dir(&dir).map_err(|source| ServeError::Tokenizer {
        dir: dir.clone(),
        source,
    })?;
    let markers = Markers::from_tokenizer(&tok).map_err(|source| ServeError::Markers {
        dir: dir.clone(),
        source,
    })?;
    Ok((dir, tok, markers))
}

/// " at PATH" unless the client's error names the path itself (it does when nothing answers
/// there or the place is not trusted), so a message never says the path twice.
fn store_at(socket: &Path, source: &k3_store::attach::client::ClientError) -> String {
    use k3_store::attach::client::ClientError as C;
    match source {
        C::Unreachable { .. } | C::Untrusted { .. } => String::new(),
        _ => format!(" at {}", socket.display()),
    }
}

/// The store's model directory and its vocabulary size (the store must answer).
fn store_model(socket: &Path) -> Result<(PathBuf, usize), ServeError> {
    let no_store = |source| ServeError::NoStore {
        socket: socket.to_path_buf(),
        source,
    };
    let mut c =
        k3_store::attach::client::Client::connect(socket, ClientKind::Control, "k3-ctl serve")
            .map_err(no_store)?;
    let model_dir = match c.call(&Request::Status).map_err(no_store)? {
        Response::Status(s) => PathBuf::from(s.model_dir),
        other => return Err(ServeError::StoreAnswer(format!("{other:?}"))),
    };
    let path = model_dir.join("config.json");
    let cfg = k3_proto::config::ModelConfig::load(&path)
        .map_err(|source| ServeError::Config { path, source })?;
    Ok((model_dir, cfg.vocab_size))
}

/// What serve's startup found, for its one line on stdout.
struct Started {
    model_dir: PathBuf,
    tok_dir: PathBuf,
    sizing: String,
}

/// Everything the handlers share, from the flags and what the store said.
fn app_state(a: &Args) -> Result<(Arc<http::AppState>, Started), ServeError> {
    check_flags(a)?;
    let key = api_key(a)?;
    let exe = std::env::current_exe().ok();
    let (tok_dir, tok, markers) = tokenizer(a, exe.as_deref())?;
    let worker = match (&a.worker, &exe) {
        (Some(p), _) => p.clone(),
        (None, Some(e)) => e.with_file_name("k3-worker"),
        (None, None) => return Err(ServeError::NoExe),
    };
    if !worker.is_file() {
        return Err(ServeError::NoWorker(worker));
    }
    let socket = a.socket.path();
    let (model_dir, vocab) = store_model(&socket)?;
    let positions = a
        .ctx
        .unwrap_or(k3_worker::engine::sampling::positions_needed(
            SIZING_PROMPT,
            api::DEFAULT_CHAT_TOKENS,
        ));
    let (max_jobs, sizing) = match a.max_jobs {
        Some(n) => (n, "--max-jobs".to_string()),
        None => sized_max_jobs(&model_dir, positions)
            .map(|(n, why)| (n, format!("sized from the plan: {why}")))
            .map_err(ServeError::Sizing)?,
    };
    let stall = match a.stall_timeout {
        Some(s) => Duration::from_secs(s),
        None => {
            let path = model_dir.join("config.json");
            let cfg = k3_proto::config::ModelConfig::load(&path)
                .map_err(|source| ServeError::Config { path, source })?;
            let dims = k3_worker::model::Dims::from_config(&cfg)
                .map_err(|e| ServeError::Sizing(SizingError::Dims(e)))?;
            supervise::stall_deadline(&dims, &engine_plan(max_jobs, positions))
        }
    };
    let spec = job::WorkerSpec {
        exe: worker,
        socket: socket.clone(),
        threads: a.threads,
        grace: Duration::from_secs(a.cancel_grace),
        slots: max_jobs,
        positions,
        stall,
        tok: Some(tok_dir.clone()),
    };
    let state = Arc::new(http::AppState {
        tok: Arc::new(tok),
        markers,
        worker: job::Worker::new(spec),
        namer: sessions::Namer::new().map_err(ServeError::Random)?,
        admission: queue::Admission::new(max_jobs, a.queue),
        model_id: a.model_name.clone(),
        vocab,
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        socket,
        sessions: !a.no_sessions,
        max_body: a.max_body,
        body_timeout: Duration::from_secs(a.request_timeout),
        metrics: metrics::Metrics::new(max_jobs, a.queue),
        defaults: api::Defaults::default(),
        policy: access::Policy {
            api_key: key,
            cors_origins: a.cors_origin.clone(),
        },
    });
    let started = Started {
        model_dir,
        tok_dir,
        sizing,
    };
    Ok((state, started))
}

/// Runs `k3-ctl serve` until SIGINT or SIGTERM.
pub fn run(a: Args) -> Result<i32, ServeError> {
    let (state, started) = app_state(&a)?;
    let limits = conn::Limits {
        total: a.max_connections,
        per_addr: a.max_connections_per_client,
        head: Duration::from_secs(a.request_timeout),
        body: Duration::from_secs(a.request_timeout),
        idle: Duration::from_secs(a.idle_timeout),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    let code = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(a.listen)
            .await
            .map_err(|source| ServeError::Listen {
                addr: a.listen,
                source,
            })?;
        let addr = listener.local_addr().unwrap_or(a.listen);
        if !addr.ip().is_loopback() && state.policy.api_key.is_none() {
            tracing::warn!(
                "listening on {addr}, which is not a loopback address, without an API key: \
                 anyone who reaches it can use it (--api-key-file PATH or K3_API_KEY)"
            );
        }
        let spec = state.worker.spec();
        let (max_jobs, socket) = (spec.slots, spec.socket.clone());
        let listing = listing::start(&socket, state.clone(), addr, max_jobs, a.queue);
        if let Err(e) = &listing {
            tracing::warn!("k3-ctl ps will not list this server's requests: {e}");
        }
        println!(
            "k3-ctl serve: listening on http://{addr} (model {:?} from {}, store {}, tokenizer {}, worker {}, {} job(s) at once ({}), {} positions a slot, queue {}{})",
            a.model_name,
            started.model_dir.display(),
            socket.display(),
            started.tok_dir.display(),
            spec.exe.display(),
            max_jobs,
            started.sizing,
            spec.positions,
            a.queue,
            if state.policy.api_key.is_some() { ", API key required" } else { "" },
        );
        tracing::info!(
            "stall deadline {} s: a worker holding jobs that says nothing that long is failed, \
             killed and replaced",
            spec.stall.as_secs()
        );
        let app = access::layers(http::routes(state.clone()), state.clone());
        let code = serve(listener, app, conn::Registry::new(limits), state).await;
        drop(listing);
        code
    });
    // Dropping the runtime drops every in-flight request: their jobs are cancelled, and the
    // worker, whose channel closes, ends.
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
) -> Result<i32, ServeError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(|e| ServeError::Signal("SIGTERM", e))?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| ServeError::Signal("SIGINT", e))?;
    let limits = registry.limits();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        // conn::watch keeps the head's deadline (hyper's would also cut idle connections).
        .header_read_timeout(None)
        .max_header_size(conn::MAX_HEAD_BYTES)
        .max_headers(conn::MAX_HEADERS)
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
    Ok(exit::OK)
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
