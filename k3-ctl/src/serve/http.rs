//! Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`,
//! `POST /v1/completions`, `GET /health`; anything else is a 404 (405 for a known path with
//! another method), always in the OpenAI error shape.
//!
//! A generation request takes a place in the queue (429 when none is free), waits for a job slot,
//! then runs one `k3-worker` attached to the store. A streamed request sends its headers once the
//! first id has arrived, so a worker that fails before generating (store down, refused) still
//! gets a proper status; after that, a failure is sent as a last `data: {"error": …}` event.
//! When the client goes away (the connection closes), hyper drops the response future or body,
//! which drops the [`Job`]: the worker is killed and reaped.

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use k3_proto::exit;
use k3_proto::wire::{ClientKind, Request as StoreRequest, Response as StoreResponse};
use k3_worker::chat::{ChatFormat, Markers};
use k3_worker::tokenizer::Tokenizer;
use serde_json::{json, Value};

use super::api::{self, ApiError, Settings};
use super::job::{GenParams, Job, JobError, WorkerSpec};
use super::queue::{Admission, Place};
use super::reply::{Delta, ReplyText};

/// What every handler shares.
#[derive(Debug)]
pub struct AppState {
    /// The tokenizer (rendering, encoding, decoding).
    pub tok: Arc<Tokenizer>,
    /// Its chat markers.
    pub markers: Markers,
    /// How to run a worker.
    pub worker: WorkerSpec,
    /// Job slots and the queue.
    pub admission: Arc<Admission>,
    /// The served model id.
    pub model_id: String,
    /// The model's vocabulary size.
    pub vocab: usize,
    /// When the server started (unix seconds; the model's `created`).
    pub started: u64,
    /// The store's socket.
    pub socket: PathBuf,
    /// Keep conversations in the store (`--session` for every worker).
    pub sessions: bool,
}

type Shared = Arc<AppState>;

/// The router.
pub fn router(state: Shared, max_body: usize) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
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

/// A unique response id and a seed for requests that give none.
fn fresh(prefix: &str) -> (String, u64) {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let seed = nanos ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(std::process::id());
    (format!("{prefix}-{nanos:x}{n:x}"), seed)
}

/// How long a status question to the store may take.
const STORE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The session a request runs under (see [`super::sessions`]): the store's list, asked off the
/// async threads. If the store does not answer, the request runs under a new name (its worker
/// will report the store's state itself).
async fn pick_session(st: &Shared, prompt: &[u32]) -> (String, usize) {
    let socket = st.socket.clone();
    let ask = tokio::task::spawn_blocking(move || {
        let mut c =
            k3_store::attach::client::Client::connect(&socket, ClientKind::Control, "k3-ctl serve")
                .map_err(|e| e.to_string())?;
        match c.call(&StoreRequest::ListSessions) {
            Ok(StoreResponse::Sessions(list)) => Ok(list),
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    });
    let list = match tokio::time::timeout(STORE_TIMEOUT, ask).await {
        Ok(Ok(Ok(list))) => list,
        Ok(Ok(Err(e))) => {
            tracing::warn!("cannot list the store's sessions: {e}");
            Vec::new()
        }
        Ok(Err(e)) => {
            tracing::warn!("cannot list the store's sessions: {e}");
            Vec::new()
        }
        Err(_) => {
            tracing::warn!("the store did not list its sessions within {STORE_TIMEOUT:?}");
            Vec::new()
        }
    };
    super::sessions::choose(&list, prompt)
}

/// Is the store up? (A control connection and a status request, off the async threads.)
async fn store_up(st: &Shared) -> Result<(), ApiError> {
    let socket = st.socket.clone();
    let ask = tokio::task::spawn_blocking(move || {
        let mut c =
            k3_store::attach::client::Client::connect(&socket, ClientKind::Control, "k3-ctl serve")
                .map_err(|e| e.to_string())?;
        match c.call(&StoreRequest::Status) {
            Ok(StoreResponse::Status(_)) => Ok(()),
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    });
    let r = match tokio::time::timeout(STORE_TIMEOUT, ask).await {
        Ok(joined) => joined.map_err(|e| ApiError::internal(e.to_string()))?,
        Err(_) => Err(format!("no answer within {STORE_TIMEOUT:?}")),
    };
    r.map_err(|m| {
        ApiError::unavailable(
            "store_unavailable",
            format!("the store is not serving: {m}"),
        )
    })
}

fn model_object(st: &AppState) -> Value {
    json!({"id": st.model_id, "object": "model", "created": st.started, "owned_by": "k3"})
}

async fn health(State(st): State<Shared>) -> Response {
    match store_up(&st).await {
        Ok(()) => Json(json!({"status": "ok", "jobs": st.admission.inside()})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn models(State(st): State<Shared>) -> Response {
    match store_up(&st).await {
        Ok(()) => Json(json!({"object": "list", "data": [model_object(&st)]})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn model(State(st): State<Shared>, Path(id): Path<String>) -> Response {
    match api::check_model(&Some(id), &st.model_id) {
        Ok(()) => Json(model_object(&st)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The body as JSON of type `T`: 413 past the limit, 400 for anything malformed.
fn parse<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|r| {
        let status = r.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::status(
                status,
                "request_too_large",
                format!("the request body is too large: {}", r.body_text()),
            )
        } else {
            ApiError::status(status, "bad_body", r.body_text())
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| {
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
}

/// One validated generation.
struct Gen {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    prompt: Vec<u32>,
    settings: Settings,
    reply: ReplyText,
}

async fn chat(State(st): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    match prepare_chat(&st, body) {
        Ok(g) => run(st, g).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(State(st): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    match prepare_completion(&st, body) {
        Ok(g) => run(st, g).await,
        Err(e) => e.into_response(),
    }
}

fn prepare_chat(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Gen, ApiError> {
    let r: api::ChatRequest = parse(body)?;
    api::check_model(&r.common.model, &st.model_id)?;
    api::check_chat_extras(&r)?;
    let (id, seed) = fresh("chatcmpl");
    let max = r.max_completion_tokens.or(r.common.max_tokens);
    let settings = api::settings(&r.common, max, api::MAX_GEN, seed)?;
    let thinking = api::thinking(&r)?;
    let history = api::messages(&r)?;
    let fmt = ChatFormat::new(&st.tok, thinking).map_err(ApiError::internal)?;
    let prompt = fmt.render(&history, true);
    api::check_prompt_len(prompt.len())?;
    let reply = ReplyText::chat(
        st.tok.clone(),
        st.markers,
        thinking.is_some(),
        &settings.stops,
        settings.max_new,
    );
    Ok(Gen {
        kind: Kind::Chat,
        id,
        created: unix_now(),
        model: st.model_id.clone(),
        prompt,
        settings,
        reply,
    })
}

fn prepare_completion(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Gen, ApiError> {
    let r: api::CompletionRequest = parse(body)?;
    api::check_model(&r.common.model, &st.model_id)?;
    api::check_completion_extras(&r)?;
    let (id, seed) = fresh("cmpl");
    let settings = api::settings(
        &r.common,
        r.common.max_tokens,
        api::DEFAULT_COMPLETION_TOKENS,
        seed,
    )?;
    let prompt = match api::prompt(&r.prompt, st.vocab)? {
        // User text: special tokens disabled, as `k3-worker --prompt`.
        api::PromptInput::Text(t) => st.tok.encode(&t),
        api::PromptInput::Ids(ids) => ids,
    };
    api::check_prompt_len(prompt.len())?;
    let reply = ReplyText::completion(st.tok.clone(), &settings.stops, settings.max_new);
    Ok(Gen {
        kind: Kind::Completion,
        id,
        created: unix_now(),
        model: st.model_id.clone(),
        prompt,
        settings,
        reply,
    })
}

/// A worker failure as an HTTP error.
fn job_error(e: JobError) -> ApiError {
    match e.code {
        Some(exit::NO_STORE) => ApiError::unavailable("store_unavailable", e.message),
        Some(exit::REFUSED) => ApiError::unavailable("worker_refused", e.message),
        Some(exit::EXPERT_LOAD_FAILED) => ApiError::internal(format!(
            "a routed expert failed to load, the generated ids are unsound: {}",
            e.message
        )),
        _ => ApiError::internal(e.message),
    }
}

async fn run(st: Shared, g: Gen) -> Response {
    match start(&st, g).await {
        Ok((place, job, first, g)) => {
            if g.settings.stream {
                stream_response(place, job, first, g).into_response()
            } else {
                whole_response(place, job, first, g).await
            }
        }
        Err(e) => e.into_response(),
    }
}

/// Queue, wait for a slot, start the worker and wait for its first id (or its failure).
async fn start(st: &Shared, g: Gen) -> Result<(Place, Job, Option<u32>, Gen), ApiError> {
    let mut place = st
        .admission
        .enter()
        .map_err(|f| ApiError::queue_full(f.retry_after))?;
    place.run().await;
    let session = if st.sessions {
        Some(pick_session(st, &g.prompt).await)
    } else {
        None
    };
    let params = GenParams {
        ids: g.prompt.clone(),
        max_new: g.settings.max_new,
        temperature: g.settings.temperature,
        top_p: g.settings.top_p,
        seed: g.settings.seed,
        session: session.as_ref().map(|s| s.0.clone()),
    };
    let mut job = Job::spawn(&st.worker, &params).map_err(|e| ApiError::internal(e.message))?;
    tracing::info!(
        "{} started worker pid {} ({} prompt ids, up to {} new){}",
        g.id,
        job.pid(),
        g.prompt.len(),
        g.settings.max_new,
        match &session {
            Some((name, 0)) => format!("; new session {name}"),
            Some((name, held)) => format!("; resuming session {name} ({held} ids held)"),
            None => String::new(),
        }
    );
    let first = job.next().await.map_err(job_error)?;
    Ok((place, job, first, g))
}

/// Feed one id (or the end of the worker's output); returns the text released and whether the
/// reply is complete. Errors when the worker's output disagrees with the request.
fn feed(g: &mut Gen, next: Option<u32>) -> Result<(Delta, bool), ApiError> {
    match next {
        Some(_) if g.reply.finish().is_some() => Err(ApiError::internal(
            "the worker generated past the end of the reply",
        )),
        Some(id) => {
            let d = g.reply.push(id);
            // A stop string ends the reply at once; otherwise wait for the worker's exit.
            Ok((d, g.reply.stopped_by_text()))
        }
        None if g.reply.finish().is_none() => Err(ApiError::internal(format!(
            "the worker stopped after {} of {} ids without an end id",
            g.reply.generated(),
            g.settings.max_new
        ))),
        None => Ok((Delta::default(), true)),
    }
}

async fn whole_response(place: Place, mut job: Job, first: Option<u32>, mut g: Gen) -> Response {
    let mut all = Delta::default();
    let mut next = first;
    loop {
        match feed(&mut g, next) {
            Ok((d, done)) => {
                all.reasoning.push_str(&d.reasoning);
                all.content.push_str(&d.content);
                if done {
                    break;
                }
            }
            Err(e) => return e.into_response(),
        }
        next = match job.next().await {
            Ok(n) => n,
            Err(e) => return job_error(e).into_response(),
        };
    }
    drop(job); // a stop string: the worker is still running and is killed here
    drop(place);
    let finish = g.reply.finish().map(|f| f.as_str());
    g.log_done(finish);
    let usage = api::usage(g.prompt.len(), g.reply.generated());
    let body = match g.kind {
        Kind::Chat => {
            let mut message = json!({"role": "assistant", "content": all.content});
            if g.reply_has_reasoning() {
                message["reasoning_content"] = Value::String(all.reasoning);
            }
            json!({
                "id": g.id, "object": "chat.completion", "created": g.created, "model": g.model,
                "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
                "usage": usage,
            })
        }
        Kind::Completion => json!({
            "id": g.id, "object": "text_completion", "created": g.created, "model": g.model,
            "choices": [{"index": 0, "text": all.content, "logprobs": null, "finish_reason": finish}],
            "usage": usage,
        }),
    };
    Json(body).into_response()
}

impl Gen {
    fn log_done(&self, finish: Option<&str>) {
        tracing::info!(
            "{} done: {} prompt + {} generated ids, finish_reason {}",
            self.id,
            self.prompt.len(),
            self.reply.generated(),
            finish.unwrap_or("-")
        );
    }

    fn reply_has_reasoning(&self) -> bool {
        self.reply.thinking()
    }

    fn chunk(&self, d: &Delta, finish: Option<&str>, first: bool) -> Value {
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
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
                })
            }
            Kind::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": d.content, "logprobs": null, "finish_reason": finish}],
            }),
        }
    }

    fn usage_chunk(&self) -> Value {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [], "usage": api::usage(self.prompt.len(), self.reply.generated()),
        })
    }
}

/// The state of a streamed answer between two events.
struct Streaming {
    place: Option<Place>,
    job: Option<Job>,
    pending: Option<Option<u32>>,
    g: Gen,
    first: bool,
    over: bool,
}

fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

/// Produce the next events: one chunk per id that released text, then the finish chunk, the
/// usage chunk when asked, and `[DONE]`.
async fn step(mut s: Streaming) -> Option<(Vec<Event>, Streaming)> {
    if s.over {
        return None;
    }
    let next = match s.pending.take() {
        Some(n) => Ok(n),
        None => match s.job.as_mut() {
            Some(job) => job.next().await.map_err(job_error),
            None => Ok(None),
        },
    };
    let mut events = Vec::new();
    let fed = next.and_then(|n| feed(&mut s.g, n));
    match fed {
        Ok((d, done)) => {
            if !d.is_empty() || (s.first && s.g.kind == Kind::Chat) {
                events.push(data(&s.g.chunk(&d, None, s.first)));
                s.first = false;
            }
            if done {
                s.job.take(); // killed if a stop string ended the reply early
                s.place.take();
                let finish = s.g.reply.finish().map(|f| f.as_str());
                s.g.log_done(finish);
                events.push(data(&s.g.chunk(&Delta::default(), finish, s.first)));
                if s.g.settings.include_usage {
                    events.push(data(&s.g.usage_chunk()));
                }
                events.push(Event::default().data("[DONE]"));
                s.over = true;
            }
        }
        Err(e) => {
            tracing::warn!("{} failed mid-stream: {}", s.g.id, e.message);
            s.job.take();
            s.place.take();
            events.push(data(&e.body()));
            events.push(Event::default().data("[DONE]"));
            s.over = true;
        }
    }
    Some((events, s))
}

fn stream_response(
    place: Place,
    job: Job,
    first: Option<u32>,
    g: Gen,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let s = Streaming {
        place: Some(place),
        job: Some(job),
        pending: Some(first),
        g,
        first: true,
        over: false,
    };
    let events = stream::unfold(s, step)
        .flat_map(|batch| stream::iter(batch.into_iter().map(Ok::<Event, Infallible>)));
    Sse::new(events)
}
