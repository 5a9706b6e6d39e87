//! Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`,
//! `POST /v1/completions`, `POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic's
//! Messages API, [`super::anthropic`]), `GET /health`, `GET /metrics`; anything else is a 404
//! (405 for a known path with another method), in the OpenAI error shape (Anthropic's on its
//! routes).
//!
//! A generation request takes a place in the queue (429 when none is free), waits for a job slot,
//! then runs as a job of the server's one `k3-worker` ([`Job`]). A whole answer is sent when the job
//! ends; a streamed one sends its headers at once (after the queue and the store said yes), then
//! SSE comments while it waits (`: queued, position N`) and keep-alive comments between ids, and
//! a failure after that as a last `data: {"error": …}` event. When the client goes away (see
//! [`super::conn`]), the request's future or body is dropped, which drops its [`Place`] and
//! [`Job`]: the queue place is freed and the job cancelled.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures_util::stream;
use http_body_util::BodyExt;
use k3_proto::serve::{ErrorKind, Finish, Sampling, Start, Timings, Usage};
use k3_proto::wire::{ClientKind, Request as StoreRequest, Response as StoreResponse, StatsReport};
use k3_worker::engine::outputs::is_prefix_session_name;
use k3_worker::text::xtml::{ChatFormat, Markers, Options};
use k3_worker::tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tracing::Instrument;

use super::access::Ctx;
use super::api::{self, ApiError, Settings};
use super::job::{Cause, Event, Job, JobError, Worker};
use super::metrics::Metrics;
use super::queue::{Admission, Meta, Place};
use super::reply::{CallRules, Delta, ReplyText};
use super::shape;

/// What every handler shares.
#[derive(Debug)]
pub struct AppState {
    /// The tokenizer (rendering, encoding, decoding).
    pub tok: Arc<Tokenizer>,
    /// Its chat markers.
    pub markers: Markers,
    /// The worker every request runs in.
    pub worker: Arc<Worker>,
    /// Names new sessions (keyed: a name confirms nothing about a prompt).
    pub namer: super::sessions::Namer,
    /// Job slots and the queue.
    pub admission: Arc<Admission>,
    /// The served model id.
    pub model_id: String,
    /// The model's vocabulary size.
    pub vocab: usize,
    /// When the server started (unix seconds; the model's `created`).
    pub started: u64,
    /// The store's socket.
    pub socket: std::path::PathBuf,
    /// Keep conversations in the store (a session for every worker).
    pub sessions: bool,
    /// Largest request body.
    pub max_body: usize,
    /// Time to send a request body.
    pub body_timeout: Duration,
    /// The metrics.
    pub metrics: Metrics,
    /// Chat defaults.
    pub defaults: api::Defaults,
    /// The API key and the CORS origins.
    pub policy: super::access::Policy,
}

type Shared = Arc<AppState>;

impl super::access::Guarded for AppState {
    fn policy(&self) -> &super::access::Policy {
        &self.policy
    }
    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// The routes (the access layers are added by [`super::access::layers`]).
pub fn routes(state: Shared) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(anthropic_messages))
        .route("/v1/messages/count_tokens", post(anthropic_count))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found("unknown_url", format!("unknown route {}", uri.path()))
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::status(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {}", uri.path()),
    )
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A unique response id, a job id and a seed for requests that give none.
fn fresh(prefix: &str) -> (String, u64, u64) {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let seed = nanos ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(std::process::id());
    (format!("{prefix}-{nanos:x}{n:x}"), n, seed)
}

/// How long a question to the store may take.
const STORE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest silence of a streamed answer (an SSE comment is sent after it).
const KEEP_ALIVE: Duration = Duration::from_secs(2);
/// How long a streamed answer's next event may wait for the client to take the one before.
const SEND_DEADLINE: Duration = Duration::from_secs(60);

/// Ask the store one control request, off the async threads, within [`STORE_TIMEOUT`].
async fn ask_store(st: &AppState, req: StoreRequest) -> Result<StoreResponse, AskStoreError> {
    let socket = st.socket.clone();
    let ask = tokio::task::spawn_blocking(move || {
        let mut c = k3_store::attach::client::Client::connect(
            &socket,
            ClientKind::Control,
            "k3-ctl serve",
        )?;
        c.call(&req)
    });
    match tokio::time::timeout(STORE_TIMEOUT, ask).await {
        Ok(Ok(r)) => Ok(r?),
        Ok(Err(e)) => Err(AskStoreError::Task(e)),
        Err(_) => Err(AskStoreError::Timeout),
    }
}

/// Why a control request to the store got no answer.
#[derive(Debug, thiserror::Error)]
enum AskStoreError {
    /// The store is unreachable or refused.
    #[error(transparent)]
    Client(#[from] k3_store::attach::client::ClientError),
    /// The blocking task failed.
    #[error(transparent)]
    Task(tokio::task::JoinError),
    /// No answer in time.
    #[error("no answer within {STORE_TIMEOUT:?}")]
    Timeout,
}

/// The session a request runs under (see [`super::sessions`]): the store's list. A store that
/// does not answer is 503 `store_unavailable` (no worker is started for it).
async fn pick_session(st: &AppState, prompt: &[u32]) -> Result<(String, usize), ApiError> {
    let list = match ask_store(st, StoreRequest::ListSessions).await {
        Ok(StoreResponse::Sessions(list)) => list,
        Ok(other) => {
            tracing::warn!("cannot list the store's sessions: unexpected answer {other:?}");
            Vec::new()
        }
        Err(e) => {
            st.worker.retire();
            return Err(store_unavailable(e));
        }
    };
    Ok(super::sessions::choose(&list, prompt, &st.namer))
}

/// 503 `store_unavailable` (with `Retry-After`).
fn store_unavailable(why: impl std::fmt::Display) -> ApiError {
    ApiError::unavailable(
        "store_unavailable",
        format!("the store is not serving: {why}"),
    )
}

/// Is the store up?
async fn store_up(st: &AppState) -> Result<(), ApiError> {
    match ask_store(st, StoreRequest::Status).await {
        Ok(StoreResponse::Status(_)) => Ok(()),
        Ok(other) => Err(format!("unexpected answer {other:?}")),
        Err(e) => Err(e.to_string()),
    }
    .map_err(|why| {
        st.worker.retire();
        store_unavailable(why)
    })
}

fn model_object(st: &AppState) -> Value {
    json!({"id": st.model_id, "object": "model", "created": st.started, "owned_by": "k3"})
}

/// 200 while the store answers and the worker progresses; 503 with the reason otherwise.
async fn health(State(st): State<Shared>) -> Response {
    let up = store_up(&st).await.and_then(|()| {
        (st.worker.health()).map_err(|why| ApiError::unavailable("worker_unhealthy", why))
    });
    match up {
        Ok(()) => {
            let (running, queued) = st.admission.counts();
            Json(json!({"status": "ok", "jobs": running + queued, "running": running, "queued": queued}))
                .into_response()
        }
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(st): State<Shared>) -> Response {
    let stats: Option<StatsReport> = match ask_store(&st, StoreRequest::Stats).await {
        Ok(StoreResponse::Stats(s)) => Some(*s),
        _ => None,
    };
    let (running, queued) = st.admission.counts();
    st.metrics
        .running
        .set(i64::try_from(running).unwrap_or(i64::MAX));
    st.metrics
        .queued
        .set(i64::try_from(queued).unwrap_or(i64::MAX));
    match st.metrics.render(stats) {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => ApiError::internal(format!("metrics: {e}")).into_response(),
    }
}

async fn models(State(st): State<Shared>) -> Response {
    match ask_store(&st, StoreRequest::Status).await {
        Ok(StoreResponse::Status(s)) => {
            let mut m = model_object(&st);
            // How the store's trunk holds the weights: a quantized one is lossy, and says where
            // its measured quality is published.
            m["k3_trunk"] = json!({
                "codec": (!s.trunk.codec.is_empty()).then_some(&s.trunk.codec),
                "lossy": s.trunk.is_lossy(),
                "label": s.trunk.is_lossy().then_some(&s.trunk.lossy),
            });
            Json(json!({"object": "list", "data": [m]})).into_response()
        }
        _ => match store_up(&st).await {
            Ok(()) => ApiError::internal("the store's status").into_response(),
            Err(e) => e.into_response(),
        },
    }
}

async fn model(State(st): State<Shared>, Path(id): Path<String>) -> Response {
    match api::check_model(&Some(id), &st.model_id) {
        Ok(()) => Json(model_object(&st)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The body, at most `max_body` bytes within the body deadline: 413 past the limit, 408 when
/// too slow (the connection then closes), 400 when it breaks off. The connection is marked busy
/// once the body is in.
async fn read_body(st: &AppState, ctx: &Ctx, body: Body) -> Result<Bytes, ApiError> {
    let limited = http_body_util::Limited::new(body, st.max_body);
    let collected = tokio::time::timeout(st.body_timeout, limited.collect()).await;
    let bytes = match collected {
        Err(_) => {
            let mut e = ApiError::status(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                format!(
                    "the request body did not arrive within {} s",
                    st.body_timeout.as_secs()
                ),
            );
            e.close = true;
            return Err(e);
        }
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(ApiError::status(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                format!(
                    "the request body is too large: more than {} bytes",
                    st.max_body
                ),
            ))
        }
        Ok(Err(e)) => {
            return Err(ApiError::status(
                StatusCode::BAD_REQUEST,
                "bad_body",
                format!("reading the request body: {e}"),
            ))
        }
        Ok(Ok(c)) => c.to_bytes(),
    };
    if let Some(c) = &ctx.conn {
        c.body_read();
    }
    Ok(bytes)
}

/// The body as JSON of type `T`: 400 for anything malformed.
fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad(
            None,
            format!("the request body is not valid JSON for this endpoint: {e}"),
        )
    })
}

/// What kind of answer to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
    /// Anthropic's Messages API.
    Messages,
}

/// One validated generation.
struct Gen {
    kind: Kind,
    id: String,
    job_id: u64,
    created: u64,
    model: String,
    prompt: Vec<u32>,
    settings: Settings,
    /// Each choice's reply (`n` of them; one for Messages).
    replies: Vec<ReplyText>,
    /// Which choices ended (their `Done` came).
    done: Vec<bool>,
    /// The first choice's counts, once its `Done` came.
    counts: Option<(Usage, Timings)>,
    /// Prompt ids a kept session held (the worker's count).
    cached: usize,
    /// A streamed Messages reply's content blocks.
    blocks: super::anthropic::BlockStream,
    /// Characters of content streamed so far, per choice (a completion's `text_offset`).
    text_chars: Vec<usize>,
    /// Where the conversation's history ends in `prompt` when notes only this request renders
    /// follow it (`tool_choice`, `response_format`): a state is kept there for the next turn.
    history_end: Option<usize>,
}

async fn chat(State(st): State<Shared>, Extension(ctx): Extension<Ctx>, req: Request) -> Response {
    generation(st, ctx, req, prepare_chat).await
}

async fn anthropic_messages(
    State(st): State<Shared>,
    Extension(ctx): Extension<Ctx>,
    req: Request,
) -> Response {
    super::anthropic::reshape(generation(st, ctx, req, prepare_messages).await).await
}

async fn anthropic_count(
    State(st): State<Shared>,
    Extension(ctx): Extension<Ctx>,
    req: Request,
) -> Response {
    let r = match read_body(&st, &ctx, req.into_body()).await {
        Ok(body) => count_tokens(&st, &body),
        Err(e) => Err(e),
    };
    match r {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => super::anthropic::error_response(e),
    }
}

/// A Messages request's prompt and its reply settings.
fn render_messages(
    st: &AppState,
    body: &[u8],
    seed: u64,
    count_only: bool,
) -> Result<
    (
        Vec<u32>,
        Settings,
        super::anthropic::Prepared,
        Option<usize>,
    ),
    ApiError,
> {
    let r: super::anthropic::MessagesRequest = parse(body)?;
    warn_unknown(body, super::anthropic::ANTHROPIC_FIELDS);
    let model = r.model.clone();
    if model.is_none() {
        return Err(ApiError::bad(Some("model"), "model: Field required"));
    }
    api::check_model(&model, &st.model_id)?;
    let mut settings = super::anthropic::settings(&r, seed, count_only)?;
    let p = super::anthropic::prepare(&r)?;
    settings.shape.thinking = p.thinking.is_some();
    settings.shape.think_budget =
        shape::think_budget(&st.tok, p.thinking.is_some(), p.budget, settings.max_new)?;
    settings.shape.grammar = p.grammar.clone();
    let fmt =
        ChatFormat::new(&st.tok, p.thinking).map_err(|e| ApiError::internal(e.to_string()))?;
    let opts = Options {
        tools: p.tools.clone(),
        choice: p.choice,
        format: p.format.clone(),
    };
    let prompt = fmt
        .render_with(&p.history, &opts, true)
        .map_err(|e| ApiError::bad(Some("messages"), e.to_string()))?;
    api::check_prompt_len(prompt.len())?;
    let end = history_end(&fmt, &p.history, &opts, &prompt);
    Ok((prompt, settings, p, end))
}

/// Where `history` ends in `prompt` when `opts` add notes after it (`tool_choice`,
/// `response_format`): the next turn renders the history on, not the notes, so a state kept
/// there is what it can resume. `None` without notes (the prompt itself is then the next turn's
/// prefix).
fn history_end(
    fmt: &ChatFormat<'_>,
    history: &[k3_worker::text::xtml::Message],
    opts: &Options,
    prompt: &[u32],
) -> Option<usize> {
    if opts.choice.is_none() && opts.format.is_none() {
        return None;
    }
    let bare = Options {
        tools: opts.tools.clone(),
        choice: None,
        format: None,
    };
    let ids = fmt.render_with(history, &bare, false).ok()?;
    (ids.len() + 1 < prompt.len() && prompt.starts_with(&ids)).then_some(ids.len())
}

fn count_tokens(st: &AppState, body: &[u8]) -> Result<usize, ApiError> {
    render_messages(st, body, 0, true).map(|(prompt, ..)| prompt.len())
}

fn prepare_messages(st: &AppState, body: &[u8]) -> Result<Gen, ApiError> {
    let (id, job_id, seed) = fresh("msg");
    let (prompt, settings, p, history_end) = render_messages(st, body, seed, false)?;
    let rules = CallRules {
        allowed: p.allowed,
        parallel: p.parallel,
    };
    let mut g = Gen::chat(
        st,
        Kind::Messages,
        (id, job_id),
        prompt,
        settings,
        p.thinking.is_some(),
        rules,
    );
    g.history_end = history_end;
    Ok(g)
}

async fn completions(
    State(st): State<Shared>,
    Extension(ctx): Extension<Ctx>,
    req: Request,
) -> Response {
    generation(st, ctx, req, prepare_completion).await
}

/// Read the body, validate it with `prepare`, and run the generation.
async fn generation(
    st: Shared,
    ctx: Ctx,
    req: Request,
    prepare: fn(&AppState, &[u8]) -> Result<Gen, ApiError>,
) -> Response {
    let r = match read_body(&st, &ctx, req.into_body()).await {
        Ok(body) => prepare(&st, &body),
        Err(e) => Err(e),
    };
    match r {
        Ok(g) => run(st, ctx, g).await,
        Err(e) => e.into_response(),
    }
}

/// Log the top-level fields no schema of the endpoint names (they are ignored).
fn warn_unknown(body: &[u8], known: &[&str]) {
    let unknown = api::unknown_fields(body, known);
    if !unknown.is_empty() {
        tracing::warn!(
            "ignoring request fields outside the API: {}",
            unknown.join(", ")
        );
    }
}

fn prepare_chat(st: &AppState, body: &[u8]) -> Result<Gen, ApiError> {
    let r: api::ChatRequest = parse(body)?;
    warn_unknown(body, api::OPENAI_CHAT_FIELDS);
    api::check_model(&r.common.model, &st.model_id)?;
    api::check_chat_extras(&r)?;
    let (id, job_id, seed) = fresh("chatcmpl");
    let max = r.max_completion_tokens.or(r.common.max_tokens);
    let mut settings = api::settings(&r.common, max, st.defaults.chat_max_tokens, seed)?;
    check_choices(st, &settings)?;
    let thinking = api::thinking(&r, st.defaults.effort)?;
    let tools = api::tool_setup(&r)?;
    let history = api::messages(&r)?;
    let format = shape::response_format(r.response_format.as_ref(), "response_format")?;
    let budget = api::thinking_budget(&r, thinking.is_some())?;
    settings.shape.logprobs =
        shape::chat_logprobs(r.common.logprobs.as_ref(), r.top_logprobs.as_ref())?;
    settings.shape.thinking = thinking.is_some();
    settings.shape.think_budget =
        shape::think_budget(&st.tok, thinking.is_some(), budget, settings.max_new)?;
    settings.shape.grammar = match (shape::tool_grammar(&tools), &format) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad(
                Some("response_format"),
                "a JSON response_format and a forced tool call exclude each other",
            ))
        }
        (g, f) => g.or_else(|| f.as_ref().map(|f| f.1.clone())),
    };
    shape::check_bias_ids(&settings.shape, st.vocab)?;
    let fmt = ChatFormat::new(&st.tok, thinking).map_err(|e| ApiError::internal(e.to_string()))?;
    let opts = Options {
        tools: tools.specs,
        choice: tools.choice,
        format: format.map(|f| f.0),
    };
    let prompt = fmt
        .render_with(&history, &opts, true)
        .map_err(|e| ApiError::bad(Some("messages"), e.to_string()))?;
    api::check_prompt_len(prompt.len())?;
    let history_end = history_end(&fmt, &history, &opts, &prompt);
    let rules = CallRules {
        allowed: tools.allowed,
        parallel: tools.parallel,
    };
    let mut g = Gen::chat(
        st,
        Kind::Chat,
        (id, job_id),
        prompt,
        settings,
        thinking.is_some(),
        rules,
    );
    g.history_end = history_end;
    Ok(g)
}

fn prepare_completion(st: &AppState, body: &[u8]) -> Result<Gen, ApiError> {
    let r: api::CompletionRequest = parse(body)?;
    warn_unknown(body, api::OPENAI_COMPLETION_FIELDS);
    api::check_model(&r.common.model, &st.model_id)?;
    api::check_completion_extras(&r)?;
    let (id, job_id, seed) = fresh("cmpl");
    let mut settings = api::settings(
        &r.common,
        r.common.max_tokens,
        api::DEFAULT_COMPLETION_TOKENS,
        seed,
    )?;
    check_choices(st, &settings)?;
    settings.shape.logprobs = shape::completion_logprobs(r.common.logprobs.as_ref())?;
    shape::check_bias_ids(&settings.shape, st.vocab)?;
    let prompt = match api::prompt(&r.prompt, st.vocab)? {
        // User text: special tokens disabled, as `k3-worker --prompt`.
        api::PromptInput::Text(t) => st.tok.encode(&t),
        api::PromptInput::Ids(ids) => ids,
    };
    api::check_prompt_len(prompt.len())?;
    let reply = ReplyText::completion(st.tok.clone(), &settings.stops, settings.max_new);
    Ok(Gen::new(
        st,
        Kind::Completion,
        (id, job_id),
        prompt,
        settings,
        reply,
    ))
}

/// `n` choices run as `n` sequences of the worker at once: at most its slots (each choice's
/// state is a slot's; the worker refuses a group whose states exceed its budget, also as 400).
fn check_choices(st: &AppState, s: &Settings) -> Result<(), ApiError> {
    let slots = st.worker.spec().slots;
    if s.n > slots {
        return Err(ApiError::bad(
            Some("n"),
            format!(
                "n = {} choices need {} sequences at once; this server runs at most {slots} \
                 (k3-ctl serve --parallel)",
                s.n, s.n
            ),
        ));
    }
    Ok(())
}

/// A worker failure as an HTTP error: serve's own findings first; a failure while the store is
/// gone is the store's (503 `store_unavailable`, as every request then gets).
async fn failure(st: &AppState, e: JobError) -> ApiError {
    match e.cause {
        Some(Cause::Stalled { .. }) => {
            return ApiError::unavailable("worker_stalled", e.message);
        }
        Some(Cause::Backoff { retry_after }) => {
            let code = match e.kind {
                ErrorKind::NoStore => "store_unavailable",
                _ => "worker_unavailable",
            };
            let mut a = ApiError::unavailable(code, e.message);
            a.retry_after = Some(retry_after.max(1));
            return a;
        }
        None => {}
    }
    if matches!(e.kind, ErrorKind::Failed | ErrorKind::Protocol) {
        if let Err(down) = store_up(st).await {
            return down;
        }
    }
    job_error(e)
}

/// A worker's report as an HTTP error.
fn job_error(e: JobError) -> ApiError {
    match e.kind {
        ErrorKind::NoStore => ApiError::unavailable("store_unavailable", e.message),
        ErrorKind::Refused => ApiError::unavailable("worker_refused", e.message),
        ErrorKind::Invalid => ApiError::bad(None, e.message),
        ErrorKind::ExpertLoad => ApiError::internal(format!(
            "a routed expert failed to load, the generated ids are unsound: {}",
            e.message
        )),
        ErrorKind::Failed | ErrorKind::Protocol => ApiError::internal(e.message),
    }
}

async fn run(st: Shared, ctx: Ctx, g: Gen) -> Response {
    let meta = Meta {
        request_id: ctx.id.clone(),
        route: ctx.route.clone(),
        prompt_ids: g.prompt.len(),
        max_new: g.settings.max_new,
        choices: g.settings.n,
    };
    let place = match st.admission.enter(meta) {
        Ok(p) => p,
        Err(f) => return ApiError::queue_full(f.retry_after).into_response(),
    };
    if g.settings.stream {
        // The headers go out now; a store that is down is still a status.
        if let Err(e) = store_up(&st).await {
            return e.into_response();
        }
        stream_response(st, place, g).into_response()
    } else {
        whole_response(st, place, g).await
    }
}

/// Wait for a slot, then start the worker.
async fn start(st: &Shared, place: &mut Place, g: &Gen) -> Result<Job, ApiError> {
    place.run().await;
    let session = if st.sessions {
        Some(pick_session(st, &g.prompt).await?)
    } else {
        store_up(st).await?;
        None
    };
    let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    // A prompt's prefill snapshot is resumed, never overwritten: the job keeps its states under
    // a name of its own.
    let (keep_as, resume) = match &session {
        Some((name, _)) if is_prefix_session_name(name) => {
            (Some(st.namer.name(&g.prompt)), Some(name.clone()))
        }
        Some((name, _)) => (Some(name.clone()), None),
        None => (None, None),
    };
    let job = Start {
        req_id: g.job_id,
        ids: g.prompt.clone(),
        max_new: n(g.settings.max_new),
        sampling: Sampling {
            temperature: g.settings.temperature,
            top_p: g.settings.top_p,
            seed: g.settings.seed,
        },
        session: keep_as,
        resume,
        keep_at: g.history_end.into_iter().map(n).collect(),
        name_key: st.namer.key().to_vec(),
        shape: g.settings.shape.clone(),
        n: n(g.settings.n),
    };
    let job = match st.worker.submit(job).await {
        Ok(j) => j,
        Err(e) => return Err(failure(st, e).await),
    };
    place.set_worker(job.pid());
    tracing::info!(
        "{} joined worker pid {} ({} prompt ids, up to {} new, {} choice(s)){}",
        g.id,
        job.pid(),
        g.prompt.len(),
        g.settings.max_new,
        g.settings.n,
        match &session {
            Some((name, 0)) => format!("; new session {name}"),
            Some((name, held)) => format!("; resuming session {name} ({held} ids held)"),
            None => String::new(),
        }
    );
    Ok(job)
}

/// What the next event of a job gave the reply.
enum Step {
    /// Text of a choice released by an id (possibly none).
    Text(usize, Delta),
    /// Every choice is complete: the first choice's counts (None when a stop string ended the
    /// reply and the job was cancelled).
    End(Option<(Usage, Timings)>),
}

/// Take the job's next event into the reply. Errors when the worker's output disagrees with
/// the request.
async fn next_step(
    st: &AppState,
    g: &mut Gen,
    job: &mut Job,
    place: &Place,
) -> Result<Step, ApiError> {
    loop {
        let ev = match job.next().await {
            Ok(ev) => ev,
            Err(e) => return Err(failure(st, e).await),
        };
        match ev {
            Event::Prefilled { cached } => {
                g.cached = cached as usize;
                tracing::info!(
                    "{} prefilled ({cached} of {} prompt ids from the kept session)",
                    g.id,
                    g.prompt.len()
                );
            }
            Event::Token { choice, id } => {
                if let Some(c) = g.live_choice(choice)? {
                    return Ok(took(st, g, place, c, id, None));
                }
            }
            Event::Scored {
                choice,
                id,
                logprob,
                top,
            } => {
                if let Some(c) = g.live_choice(choice)? {
                    return Ok(took(st, g, place, c, id, Some((logprob, &top))));
                }
            }
            Event::Done {
                choice,
                finish,
                usage,
                timings,
            } => {
                // The prompt (prefilled once) is counted with the first choice.
                st.metrics.job(&usage, &timings, choice == 0);
                g.cached = usage.cached_ids as usize;
                let reply = g.replies.get(choice as usize).ok_or_else(|| {
                    ApiError::internal(format!("the worker ended a choice {choice} never asked"))
                })?;
                if finish == Finish::Cancelled || reply.finish().is_none() {
                    return Err(ApiError::internal(format!(
                        "the worker stopped after {} of {} ids without an end id ({finish:?})",
                        reply.generated(),
                        g.settings.max_new
                    )));
                }
                if choice == 0 {
                    g.counts = Some((usage, timings));
                }
                g.done[choice as usize] = true;
                if g.complete() {
                    return Ok(Step::End(g.counts.take()));
                }
            }
        }
    }
}

/// A generated id into choice `c`'s reply (with its log-probabilities when asked: kept for
/// the ids of the content).
fn took(
    st: &AppState,
    g: &mut Gen,
    place: &Place,
    c: usize,
    id: u32,
    scored: Option<(f32, &[(u32, f32)])>,
) -> Step {
    let reply = &mut g.replies[c];
    let mut d = reply.push(id);
    if let Some((logprob, top)) = scored.filter(|_| reply.in_content()) {
        d.logprobs.push(shape::chat_item(&st.tok, id, logprob, top));
    }
    let cut = reply.cut_short();
    place.set_generated(g.generated());
    // A stop string ends the choice at once; the caller cancels the job once every choice is
    // complete.
    if cut && g.complete() {
        st.metrics.cancel("stop_string");
    }
    Step::Text(c, d)
}

/// Counts a whole answer's request as cancelled (the client went away) unless it ended.
struct Unfinished(Option<Shared>);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some(st) = self.0.take() {
            st.metrics.cancel("client_gone");
            tracing::info!("the client went away: request cancelled");
        }
    }
}

async fn whole_response(st: Shared, mut place: Place, mut g: Gen) -> Response {
    let mut unfinished = Unfinished(Some(st.clone()));
    let mut job = match start(&st, &mut place, &g).await {
        Ok(j) => j,
        Err(e) => {
            unfinished.0 = None;
            return e.into_response();
        }
    };
    let n = g.replies.len();
    let mut all = vec![Delta::default(); n];
    let mut offsets = vec![Vec::new(); n];
    let mut counts = None;
    loop {
        match next_step(&st, &mut g, &mut job, &place).await {
            Ok(Step::Text(c, d)) => {
                let at = all[c].content.chars().count();
                offsets[c].extend(d.logprobs.iter().map(|_| at));
                all[c].add(d);
                if g.complete() {
                    break;
                }
            }
            Ok(Step::End(c)) => {
                counts = c;
                break;
            }
            Err(e) => {
                unfinished.0 = None;
                return e.into_response();
            }
        }
    }
    unfinished.0 = None;
    drop(job); // after a stop string the worker is still running: it is cancelled here
    drop(place);
    g.log_done(counts.as_ref());
    let usage = g.usage();
    let body = match g.kind {
        Kind::Chat => json!({
            "id": g.id, "object": "chat.completion", "created": g.created, "model": g.model,
            "choices": (all.iter().enumerate()).map(|(c, d)| g.chat_choice(c, d)).collect::<Vec<_>>(),
            "usage": usage,
        }),
        Kind::Completion => json!({
            "id": g.id, "object": "text_completion", "created": g.created, "model": g.model,
            "choices": (all.iter().zip(&offsets).enumerate())
                .map(|(c, (d, o))| json!({"index": c, "text": d.content,
                    "logprobs": g.completion_logprobs(&d.logprobs, o),
                    "finish_reason": g.finish(c)}))
                .collect::<Vec<_>>(),
            "usage": usage,
        }),
        Kind::Messages => json!({
            "id": g.id, "type": "message", "role": "assistant", "model": g.model,
            "content": super::anthropic::content_blocks(&g.id, g.replies[0].thinking(), &all[0]),
            "stop_reason": super::anthropic::stop_reason(g.replies[0].finish()),
            "stop_sequence": g.replies[0].stop_sequence(),
            "usage": super::anthropic::usage(g.prompt.len(), g.cached, g.generated()),
        }),
    };
    Json(body).into_response()
}

impl Gen {
    /// A chat-shaped job (OpenAI chat or Anthropic Messages): the reply starts after the
    /// generation prompt (`thinking`: inside the think channel) and reads tool calls by `rules`.
    fn chat(
        st: &AppState,
        kind: Kind,
        ids: (String, u64),
        prompt: Vec<u32>,
        settings: Settings,
        thinking: bool,
        rules: CallRules,
    ) -> Gen {
        let reply = ReplyText::chat(
            st.tok.clone(),
            st.markers,
            thinking,
            &settings.stops,
            settings.max_new,
        )
        .with_calls(rules);
        Gen::new(st, kind, ids, prompt, settings, reply)
    }

    fn new(
        st: &AppState,
        kind: Kind,
        (id, job_id): (String, u64),
        prompt: Vec<u32>,
        settings: Settings,
        reply: ReplyText,
    ) -> Gen {
        let n = settings.n.max(1);
        Gen {
            kind,
            id,
            job_id,
            created: unix_now(),
            model: st.model_id.clone(),
            prompt,
            settings,
            replies: vec![reply; n],
            done: vec![false; n],
            counts: None,
            cached: 0,
            blocks: Default::default(),
            text_chars: vec![0; n],
            history_end: None,
        }
    }

    /// Choice `c`'s `finish_reason`.
    fn finish(&self, c: usize) -> Option<&'static str> {
        self.replies[c].finish().map(|f| f.as_str())
    }

    /// Ids generated over every choice (OpenAI's `completion_tokens`).
    fn generated(&self) -> usize {
        self.replies.iter().map(ReplyText::generated).sum()
    }

    /// Every choice has ended (its `Done` came) or was cut short by a stop string (the job
    /// still runs it: it is cancelled when the reply is sent).
    fn complete(&self) -> bool {
        (self.replies.iter().zip(&self.done)).all(|(r, &done)| done || r.cut_short())
    }

    /// The index of `choice` when an id of it goes into the reply; `None`: the choice was cut
    /// short by a stop string, its later ids are dropped. An id past a choice's end, or of a
    /// choice never asked, is the worker disagreeing with the request.
    fn live_choice(&self, choice: u32) -> Result<Option<usize>, ApiError> {
        let c = choice as usize;
        let r = self.replies.get(c).ok_or_else(|| {
            ApiError::internal(format!(
                "the worker generated for a choice {choice} never asked"
            ))
        })?;
        match r.finish() {
            None => Ok(Some(c)),
            Some(_) if r.cut_short() && self.replies.len() > 1 => Ok(None),
            Some(_) => Err(ApiError::internal(
                "the worker generated past the end of the reply",
            )),
        }
    }

    /// Choice `c` of a whole chat answer, `all` its text.
    fn chat_choice(&self, c: usize, all: &Delta) -> Value {
        let reply = &self.replies[c];
        let mut message = json!({"role": "assistant", "content": all.content});
        if reply.thinking() {
            message["reasoning_content"] = Value::String(all.reasoning.clone());
        }
        if !all.calls.is_empty() {
            if all.content.is_empty() {
                message["content"] = Value::Null;
            }
            message["tool_calls"] = Value::Array(
                all.calls
                    .iter()
                    .map(|k| self.tool_call(c, k, false))
                    .collect(),
            );
        }
        let mut choice = json!({"index": c, "message": message,
            "logprobs": self.chat_logprobs(&all.logprobs), "finish_reason": self.finish(c)});
        if !reply.malformed().is_empty() {
            choice["malformed_tool_calls"] = self.malformed_json(c);
        }
        choice
    }

    fn log_done(&self, counts: Option<&(Usage, Timings)>) {
        let finish: Vec<&str> = (0..self.replies.len())
            .map(|c| self.finish(c).unwrap_or("-"))
            .collect();
        let finish = finish.join(",");
        let timing = counts.map_or(String::new(), |(u, t)| {
            let decoded = u.generated.saturating_sub(1);
            format!(
                "; prefill {:.3} s, decode {}",
                t.prefill_seconds,
                if decoded > 0 {
                    format!("{:.3} s/token", t.decode_seconds / f64::from(decoded))
                } else {
                    "-".into()
                }
            )
        });
        tracing::info!(
            "{} done: {} prompt ({} cached) + {} generated ids, finish_reason {finish}{timing}",
            self.id,
            self.prompt.len(),
            self.cached,
            self.generated(),
        );
    }

    /// The request's usage: the prompt once, the ids of every choice (OpenAI's convention).
    fn usage(&self) -> Value {
        let mut u = api::usage(self.prompt.len(), self.cached, self.generated());
        if self.replies[0].thinking() {
            let reasoning: usize = self.replies.iter().map(ReplyText::reasoning_ids).sum();
            u["completion_tokens_details"] = json!({"reasoning_tokens": reasoning});
        }
        u
    }

    /// Choice `choice`'s generated call as OpenAI's `tool_calls` item (`streamed`: with its
    /// `index`); ids are unique across choices.
    fn tool_call(&self, choice: usize, c: &super::reply::CallOut, streamed: bool) -> Value {
        let id = match choice {
            0 => format!("call_{}_{}", self.id, c.index),
            _ => format!("call_{}_{choice}_{}", self.id, c.index),
        };
        let mut v = json!({
            "id": id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        });
        if streamed {
            v["index"] = json!(c.index);
        }
        v
    }

    /// Choice `c`'s calls that were reported instead of returned.
    fn malformed_json(&self, c: usize) -> Value {
        Value::Array(
            self.replies[c]
                .malformed()
                .iter()
                .map(|m| json!({"error": m.error, "text": m.text}))
                .collect(),
        )
    }

    /// A chat choice's `logprobs` (`null` unless asked).
    fn chat_logprobs(&self, items: &[Value]) -> Value {
        match self.settings.shape.logprobs {
            Some(_) => json!({"content": items, "refusal": null}),
            None => Value::Null,
        }
    }

    /// A completion choice's `logprobs` (`null` unless asked).
    fn completion_logprobs(&self, items: &[Value], offsets: &[usize]) -> Value {
        match self.settings.shape.logprobs {
            Some(_) => shape::completion_object(items, offsets),
            None => Value::Null,
        }
    }

    /// A streamed chunk of choice `c`.
    fn chunk(&self, c: usize, d: &Delta, finish: Option<&str>, first: bool) -> Value {
        match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), "assistant".into());
                }
                if !d.reasoning.is_empty() {
                    delta.insert("reasoning_content".into(), d.reasoning.clone().into());
                }
                if !d.content.is_empty() || first {
                    delta.insert("content".into(), d.content.clone().into());
                }
                if !d.calls.is_empty() {
                    let calls = d.calls.iter().map(|k| self.tool_call(c, k, true)).collect();
                    delta.insert("tool_calls".into(), Value::Array(calls));
                }
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": c, "delta": delta,
                        "logprobs": self.chat_logprobs(&d.logprobs), "finish_reason": finish}],
                })
            }
            Kind::Completion | Kind::Messages => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": c, "text": d.content,
                    "logprobs": self.completion_logprobs(&d.logprobs, &vec![self.text_chars[c]; d.logprobs.len()]),
                    "finish_reason": finish}],
            }),
        }
    }

    /// The stream events of one delta of choice `c`.
    fn events(&mut self, c: usize, d: &Delta, first: bool) -> Vec<SseEvent> {
        if self.kind == Kind::Messages {
            let id = self.id.clone();
            return named(self.blocks.events(&id, d));
        }
        let events = if !d.is_empty() || (first && self.kind == Kind::Chat) {
            vec![data(&self.chunk(c, d, None, first))]
        } else {
            Vec::new()
        };
        self.text_chars[c] += d.content.chars().count();
        events
    }

    /// A Messages stream's opening: `message_start` and a `ping`.
    fn opening(&self) -> Vec<SseEvent> {
        if self.kind != Kind::Messages {
            return Vec::new();
        }
        let usage = super::anthropic::usage(self.prompt.len(), 0, 0);
        named(vec![
            (
                "message_start",
                json!({"type": "message_start", "message": {
                    "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                    "content": [], "stop_reason": null, "stop_sequence": null, "usage": usage,
                }}),
            ),
            ("ping", json!({"type": "ping"})),
        ])
    }

    /// A failure as the stream's last events.
    fn error_events(&self, e: &ApiError) -> Vec<SseEvent> {
        if self.kind == Kind::Messages {
            return named(vec![(
                "error",
                super::anthropic::error_body(e.status, &e.message),
            )]);
        }
        vec![data(&e.body()), SseEvent::default().data("[DONE]")]
    }

    fn usage_chunk(&self) -> Value {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion | Kind::Messages => "text_completion",
        };
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [], "usage": self.usage(),
        })
    }
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// Named events (`event: NAME`).
fn named(events: Vec<(&'static str, Value)>) -> Vec<SseEvent> {
    events
        .into_iter()
        .map(|(name, v)| SseEvent::default().event(name).data(v.to_string()))
        .collect()
}

/// Send events in order; `false` when the client is gone.
async fn send_all(tx: &mpsc::Sender<SseEvent>, events: Vec<SseEvent>) -> bool {
    for e in events {
        if !send(tx, e).await {
            return false;
        }
    }
    true
}

/// Send one event to the client's stream; `false` when it is gone or did not take the event
/// within [`SEND_DEADLINE`].
async fn send(tx: &mpsc::Sender<SseEvent>, e: SseEvent) -> bool {
    matches!(
        tokio::time::timeout(SEND_DEADLINE, tx.send(e)).await,
        Ok(Ok(()))
    )
}

/// A streamed answer: queue comments, one chunk per id that released text, then the finish
/// chunk, the usage chunk when asked, and `[DONE]`; a failure as a last error event.
async fn stream_job(st: Shared, mut place: Place, mut g: Gen, tx: &mpsc::Sender<SseEvent>) {
    // Waiting for a slot: say where the request is, whenever that changes.
    let adm = place.admission().clone();
    let ticket = place.ticket();
    // A request runs at once when a slot is free and nobody let in before it waits (the
    // admission's order); only one that actually waits is told its place.
    if !place.try_run() {
        let mut told = None;
        let run = place.run();
        tokio::pin!(run);
        loop {
            let pos = adm.position(ticket);
            if pos.is_none() {
                break;
            }
            if pos != told {
                told = pos;
                let (_, queued) = adm.counts();
                let text = format!("queued, position {} of {queued}", pos.unwrap_or(0));
                if !send(tx, SseEvent::default().comment(text)).await {
                    return;
                }
            }
            tokio::select! {
                _ = &mut run => break,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    }
    let mut job = match start(&st, &mut place, &g).await {
        Ok(j) => j,
        Err(e) => {
            tracing::warn!("{} failed before its first id: {}", g.id, e.message);
            let _ = send_all(tx, g.error_events(&e)).await;
            return;
        }
    };
    if !send_all(tx, g.opening()).await {
        return;
    }
    // Each choice's first chunk carries the role.
    let mut first = vec![true; g.replies.len()];
    loop {
        match next_step(&st, &mut g, &mut job, &place).await {
            Ok(Step::Text(c, d)) => {
                let events = g.events(c, &d, first[c]);
                if !events.is_empty() {
                    if !send_all(tx, events).await {
                        return;
                    }
                    first[c] = false;
                }
                if g.complete() {
                    drop(job); // the worker is still running: it is cancelled here
                    finish_stream(&mut g, None, &first, tx).await;
                    return;
                }
            }
            Ok(Step::End(counts)) => {
                drop(job);
                finish_stream(&mut g, counts.as_ref(), &first, tx).await;
                return;
            }
            Err(e) => {
                tracing::warn!("{} failed mid-stream: {}", g.id, e.message);
                let _ = send_all(tx, g.error_events(&e)).await;
                return;
            }
        }
    }
}

/// The stream's end: each choice's finish chunk (in choice order), the usage chunk when asked
/// and `[DONE]`; a Messages stream's closing events.
async fn finish_stream(
    g: &mut Gen,
    counts: Option<&(Usage, Timings)>,
    first: &[bool],
    tx: &mpsc::Sender<SseEvent>,
) {
    g.log_done(counts);
    if g.kind == Kind::Messages {
        let reply = &g.replies[0];
        let usage = super::anthropic::usage(g.prompt.len(), g.cached, reply.generated());
        let reason = super::anthropic::stop_reason(reply.finish());
        let stop = reply.stop_sequence().map(str::to_string);
        let events = g.blocks.finish(reason, stop.as_deref(), usage);
        send_all(tx, named(events)).await;
        return;
    }
    let mut events = Vec::new();
    for (c, &first) in first.iter().enumerate() {
        let mut last = g.chunk(c, &Delta::default(), g.finish(c), first);
        if g.kind == Kind::Chat && !g.replies[c].malformed().is_empty() {
            last["choices"][0]["malformed_tool_calls"] = g.malformed_json(c);
        }
        events.push(data(&last));
    }
    if g.settings.include_usage {
        events.push(data(&g.usage_chunk()));
    }
    events.push(SseEvent::default().data("[DONE]"));
    send_all(tx, events).await;
}

/// The streamed response: its events come from a task that runs the request; when the client
/// goes away the response body (the receiver) is dropped, the task sees its channel closed and
/// drops the job (cancelled).
fn stream_response(st: Shared, place: Place, g: Gen) -> Response {
    let (tx, rx) = mpsc::channel::<SseEvent>(64);
    let span = tracing::Span::current();
    let metrics_st = st.clone();
    tokio::spawn(
        async move {
            tokio::select! {
                _ = tx.closed() => {
                    metrics_st.metrics.cancel("client_gone");
                    tracing::info!("the client went away: request cancelled");
                }
                _ = stream_job(st, place, g, &tx) => {}
            }
        }
        .instrument(span),
    );
    let events = stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|e| (Ok::<SseEvent, std::convert::Infallible>(e), rx))
    });
    let mut r = Sse::new(events)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE).text("keep-alive"))
        .into_response();
    // Proxies (nginx) must pass the events on as they come.
    r.headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    r
}
