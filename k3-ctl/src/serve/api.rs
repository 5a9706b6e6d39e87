//! The OpenAI request and response shapes, and their validation into one generation job.
//!
//! Accepted: `model` (must be the served id), `messages` (roles `system`, `developer` = system,
//! `user`, `assistant` with optional `reasoning_content`; content a string or a list of `text`
//! parts) or `prompt` (a string, a one-string list, or token ids), `max_tokens` /
//! `max_completion_tokens` (1..=4096), `temperature` (0..=2, 0 = greedy), `top_p` (0 < p ≤ 1),
//! `seed`, `n` (1..=[`MAX_CHOICES`] here; serve bounds it by its slots), `stop` (a string or up
//! to 4 strings), `stream`, `stream_options.include_usage`,
//! `thinking: {"type": "enabled"|"disabled"}` and `reasoning_effort` (`low`, `medium`, `high`,
//! `max`, or `none` = thinking off) with k3's `thinking_budget`, `tools` with `tool_choice`
//! `auto`/`none`/`required`/a named function and `parallel_tool_calls` (and the older
//! `functions`/`function_call`), `response_format` (`text`, `json_object`, `json_schema`),
//! `logprobs`/`top_logprobs`, `logit_bias`, `presence_penalty`/`frequency_penalty` (the worker's
//! shaping: [`super::shape`]), assistant `tool_calls` and `tool` messages in the history. Every
//! field of OpenAI's request schemas is either honoured, accepted because it cannot change the
//! answer (`user`, `metadata`, `safety_identifier`, `prompt_cache_key`, `store: false`,
//! `service_tier` `auto`/`default`, `modalities: ["text"]`), or refused with 400 naming it
//! ([`OPENAI_CHAT_FIELDS`], [`OPENAI_COMPLETION_FIELDS`]): `n` beyond the server's slots,
//! `echo`, `suffix`, `best_of` > 1 (or with `n` > 1), `audio`, `prediction`, `web_search_options`, `verbosity`. Fields outside those
//! schemas are ignored with a warning in the log, as clients send extras.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use k3_proto::serve::{Shape, MAX_CHOICES};
use k3_worker::text::tools::{self, Arguments, ChoiceNote, ToolCall, ToolSpec};
use k3_worker::text::xtml::{Effort, Message};
use serde::Deserialize;
use serde_json::{json, Value};

/// Most ids one request may generate (the worker's limit, defined once in its command line).
pub const MAX_GEN: usize = k3_worker::front::cli::MAX_GEN as usize;
/// Longest prompt in ids (the worker's limit).
pub const MAX_PROMPT: usize = k3_worker::front::cli::MAX_PROMPT;
/// `max_tokens` of a chat request when not given: what this model answers in well under an
/// hour at the `server` preset's projected 8–13 s/token (docs/BENCHMARKS.md), rather than the
/// days 4,096 ids would take.
pub const DEFAULT_CHAT_TOKENS: usize = 256;
/// Thinking effort of a chat request that does not choose one: `low`, so that a reply's
/// thinking leaves room for its answer within [`DEFAULT_CHAT_TOKENS`].
pub const DEFAULT_EFFORT: Effort = Effort::Low;

/// The chat defaults a server applies.
#[derive(Clone, Copy, Debug)]
pub struct Defaults {
    /// `max_tokens` when not given.
    pub chat_max_tokens: usize,
    /// Thinking effort when thinking is on and none is chosen.
    pub effort: Effort,
}

impl Default for Defaults {
    fn default() -> Defaults {
        Defaults {
            chat_max_tokens: DEFAULT_CHAT_TOKENS,
            effort: DEFAULT_EFFORT,
        }
    }
}
/// Most stop strings (OpenAI's limit).
pub const MAX_STOPS: usize = 4;
/// `max_tokens` of a completion when not given (OpenAI's default).
pub const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable reason.
    pub message: String,
    /// `type`.
    pub kind: &'static str,
    /// `param`: the request field at fault.
    pub param: Option<&'static str>,
    /// `code`.
    pub code: Option<&'static str>,
    /// `Retry-After` seconds (429/503).
    pub retry_after: Option<u64>,
    /// Close the connection after this answer (`Connection: close`).
    pub close: bool,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
            close: false,
        }
    }

    /// 400, naming the field at fault.
    pub fn bad(param: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError {
            param,
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 404.
    pub fn not_found(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some(code),
            ..ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
        }
    }

    /// 429: every running and waiting place is taken.
    pub fn queue_full(retry_after: u64) -> ApiError {
        ApiError {
            code: Some("queue_full"),
            retry_after: Some(retry_after),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "the server is busy: every job slot and queue place is taken; retry later",
            )
        }
    }

    /// 503: the store (or the machine) cannot take the job now.
    pub fn unavailable(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some(code),
            retry_after: Some(5),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
        }
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// Any status with a code (413, 405, 431, …).
    pub fn status(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some(code),
            ..ApiError::new(status, "invalid_request_error", message)
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.close {
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        r
    }
}

/// A value the shared validation refuses (`k3_proto::serve`): 400 naming its field.
impl From<k3_proto::serve::ValueError> for ApiError {
    fn from(e: k3_proto::serve::ValueError) -> ApiError {
        ApiError::bad(Some(e.field()), e.to_string())
    }
}

/// A string or a list of strings (`stop`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage counts.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Fields shared by both endpoints.
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    /// Model id.
    pub model: Option<String>,
    /// Most ids to generate.
    pub max_tokens: Option<i64>,
    /// Sampling temperature.
    pub temperature: Option<f64>,
    /// Nucleus mass.
    pub top_p: Option<f64>,
    /// Sampling seed.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<OneOrMany>,
    /// Server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Choices: 1..=the server's slots.
    pub n: Option<i64>,
    /// Log-probabilities: `true` (chat, with `top_logprobs`) or 0..=5 alternatives
    /// (completions).
    pub logprobs: Option<Value>,
    /// −2..=2, subtracted once from each id the reply generated.
    pub presence_penalty: Option<f64>,
    /// −2..=2, subtracted per time the reply generated an id.
    pub frequency_penalty: Option<f64>,
    /// Id (as a string) → −100..=100 added to its logit.
    pub logit_bias: Option<serde_json::Map<String, Value>>,
}

/// A message's content: a string or a list of parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts (only `text` parts are supported).
    Parts(Vec<Part>),
}

/// One content part.
#[derive(Debug, Deserialize)]
pub struct Part {
    /// `text` (others are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// A function: a tool's declaration (`tools[].function`, or an item of `functions`).
#[derive(Clone, Debug, Deserialize)]
pub struct FunctionDef {
    /// Its name.
    pub name: String,
    /// What it does.
    pub description: Option<String>,
    /// Its arguments' JSON schema.
    pub parameters: Option<Value>,
    /// OpenAI's strict flag (rendered as given).
    pub strict: Option<bool>,
}

/// One of `tools`.
#[derive(Debug, Deserialize)]
pub struct ToolDef {
    /// `function` (others are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    pub function: Option<FunctionDef>,
}

/// A call's function in the history (`tool_calls[].function`, or `function_call`).
#[derive(Debug, Deserialize)]
pub struct CallFunction {
    /// The function called.
    pub name: String,
    /// Its arguments: a JSON string (an object is taken too).
    pub arguments: Option<Value>,
}

/// An assistant's earlier tool call.
#[derive(Debug, Deserialize)]
pub struct CallDef {
    /// The call's id (what a `tool` message answers).
    pub id: Option<String>,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// The function called.
    pub function: CallFunction,
}

/// One chat message.
#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    /// Author.
    pub role: String,
    /// Text.
    pub content: Option<Content>,
    /// An assistant's earlier reasoning (think channel).
    pub reasoning_content: Option<String>,
    /// An assistant's tool calls.
    pub tool_calls: Option<Vec<CallDef>>,
    /// The older form of one call.
    pub function_call: Option<CallFunction>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
    /// The author's name (a `name` attribute), or a `function` message's function.
    pub name: Option<String>,
    /// An assistant's refusal (refused: not representable).
    pub refusal: Option<Value>,
    /// An assistant's audio (refused).
    pub audio: Option<Value>,
}

/// `thinking`.
#[derive(Debug, Deserialize)]
pub struct Thinking {
    /// `enabled` or `disabled`.
    #[serde(rename = "type")]
    pub kind: String,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// Shared fields.
    #[serde(flatten)]
    pub common: Common,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Newer name of `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    /// Thinking on or off.
    pub thinking: Option<Thinking>,
    /// Thinking effort.
    pub reasoning_effort: Option<String>,
    /// Most ids of the think channel (k3's field; the default is half of `max_tokens`).
    pub thinking_budget: Option<i64>,
    /// Declared tools.
    pub tools: Option<Vec<ToolDef>>,
    /// `auto`, `none`, `required` or a named function.
    pub tool_choice: Option<Value>,
    /// More than one call per reply (default true).
    pub parallel_tool_calls: Option<bool>,
    /// The older form of `tools`.
    pub functions: Option<Vec<FunctionDef>>,
    /// The older form of `tool_choice`.
    pub function_call: Option<Value>,
    /// `text`, `json_object` or `json_schema`.
    pub response_format: Option<Value>,
    /// Alternatives per id with `logprobs` (0..=20).
    pub top_logprobs: Option<Value>,
    /// The fields that cannot change the answer, or are refused unless at their default.
    #[serde(flatten)]
    pub other: ChatOther,
}

/// Chat fields checked by [`check_chat_extras`]: accepted at values that cannot change the
/// answer, refused otherwise. (`user`, `metadata`, `prompt_cache_key` and `safety_identifier` are
/// accepted as they come: identifiers and tags that k3 neither stores nor uses; kept sessions
/// follow the prompt's prefix on their own.)
#[derive(Debug, Default, Deserialize)]
pub struct ChatOther {
    /// Audio output (refused).
    pub audio: Option<Value>,
    /// Output modalities (only `["text"]`).
    pub modalities: Option<Vec<String>>,
    /// Predicted output (refused).
    pub prediction: Option<Value>,
    /// Store the completion (only `false`).
    pub store: Option<bool>,
    /// How long a cached prompt lives (only `in_memory`).
    pub prompt_cache_retention: Option<String>,
    /// Processing tier (only `auto` and `default`).
    pub service_tier: Option<String>,
    /// Answer length (refused: not a K3 option).
    pub verbosity: Option<Value>,
    /// Web search (refused).
    pub web_search_options: Option<Value>,
}

/// Every field of OpenAI's chat completion request (API reference, `POST /chat/completions`),
/// with what k3 does with it. `tests` send each one.
pub const OPENAI_CHAT_FIELDS: &[&str] = &[
    "messages",
    "model",
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "max_completion_tokens",
    "max_tokens",
    "metadata",
    "modalities",
    "n",
    "parallel_tool_calls",
    "prediction",
    "presence_penalty",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "seed",
    "service_tier",
    "stop",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "user",
    "verbosity",
    "web_search_options",
];

/// Every field of OpenAI's (legacy) completion request (`POST /completions`).
pub const OPENAI_COMPLETION_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
];

/// `prompt`: text, one text in a list, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Ids(Vec<i64>),
    /// Texts (exactly one supported).
    Texts(Vec<String>),
    /// Lists of token ids (exactly one supported).
    IdLists(Vec<Vec<i64>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// Shared fields.
    #[serde(flatten)]
    pub common: Common,
    /// The prompt.
    pub prompt: Prompt,
    /// Not implemented.
    pub echo: Option<bool>,
    /// Not implemented beyond 1.
    pub best_of: Option<i64>,
    /// Not implemented.
    pub suffix: Option<String>,
}

/// Sampling and output settings common to both endpoints, validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Most ids to generate (per choice).
    pub max_new: usize,
    /// Choices (`n`): sequences of the one prompt, prefilled once.
    pub n: usize,
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Seed.
    pub seed: u64,
    /// Stop strings.
    pub stops: Vec<String>,
    /// Server-sent events.
    pub stream: bool,
    /// Usage chunk at the end of a stream.
    pub include_usage: bool,
    /// What the worker shapes beyond sampling (logit bias and penalties here; the grammar, the
    /// thinking budget and the log-probabilities are added by each endpoint).
    pub shape: Shape,
}

/// Check the model id: missing → 400, another → 404.
pub fn check_model(model: &Option<String>, served: &str) -> Result<(), ApiError> {
    match model.as_deref() {
        None => Err(ApiError::bad(
            Some("model"),
            "you must provide a model parameter",
        )),
        Some(m) if m == served => Ok(()),
        Some(m) => Err(ApiError::not_found(
            "model_not_found",
            format!("the model {m:?} does not exist; this server serves {served:?}"),
        )),
    }
}

/// `logit_bias`: `{"ID": bias}` with biases in −100..=100 (ids are checked against the
/// vocabulary by [`super::shape::check_bias_ids`]).
pub fn logit_bias(m: Option<&serde_json::Map<String, Value>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::bad(Some("logit_bias"), m);
    let mut out = Vec::new();
    for (k, v) in m.into_iter().flatten() {
        let id: u32 = k
            .parse()
            .map_err(|_| bad(format!("logit_bias key {k:?} is not a token id")))?;
        let b = v
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| bad(format!("logit_bias[{k:?}] = {v}: a number in -100..=100")))?;
        out.push((id, b as f32));
    }
    out.sort_by_key(|e| e.0);
    Ok(out)
}

/// Validate the shared fields; `max_tokens` falls back to `default_max`.
pub fn settings(
    c: &Common,
    max_tokens: Option<i64>,
    default_max: usize,
    default_seed: u64,
) -> Result<Settings, ApiError> {
    let n = match c.n {
        None => 1,
        Some(n) if n >= 1 && n <= i64::from(MAX_CHOICES) => n as usize,
        Some(n) => {
            return Err(ApiError::bad(
                Some("n"),
                format!("n = {n} is outside 1..={MAX_CHOICES}"),
            ))
        }
    };
    let mut penalty = [0.0f32; 2];
    for (k, (name, v)) in [
        ("presence_penalty", c.presence_penalty),
        ("frequency_penalty", c.frequency_penalty),
    ]
    .into_iter()
    .enumerate()
    {
        let v = v.unwrap_or(0.0);
        if !(v.is_finite() && (-2.0..=2.0).contains(&v)) {
            return Err(ApiError::bad(
                Some(name),
                format!("{name} = {v} is outside -2..=2"),
            ));
        }
        penalty[k] = v as f32;
    }
    let logit_bias = logit_bias(c.logit_bias.as_ref())?;
    let max_new = match max_tokens {
        None => default_max,
        Some(n) if n >= 1 && n as u64 <= MAX_GEN as u64 => n as usize,
        Some(n) => {
            return Err(ApiError::bad(
                Some("max_tokens"),
                format!("max_tokens = {n} is outside 1..={MAX_GEN}"),
            ))
        }
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
        return Err(ApiError::bad(
            Some("temperature"),
            format!("temperature = {temperature} is outside 0..=2"),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(
            Some("top_p"),
            format!("top_p = {top_p} is outside (0, 1]"),
        ));
    }
    let seed = match c.seed {
        None => default_seed,
        Some(s) if s >= 0 => s as u64,
        Some(s) => {
            return Err(ApiError::bad(
                Some("seed"),
                format!("seed = {s} must be ≥ 0"),
            ))
        }
    };
    let stops = match &c.stop {
        None => Vec::new(),
        Some(OneOrMany::One(s)) => vec![s.clone()],
        Some(OneOrMany::Many(v)) => v.clone(),
    };
    if stops.len() > MAX_STOPS {
        return Err(ApiError::bad(
            Some("stop"),
            format!("{} stop strings: at most {MAX_STOPS}", stops.len()),
        ));
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::bad(Some("stop"), "a stop string is empty"));
    }
    let stream = c.stream.unwrap_or(false);
    let include_usage = c
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let sampling = k3_proto::serve::Sampling::from_request(temperature, top_p, seed)?;
    Ok(Settings {
        max_new,
        n,
        temperature: sampling.temperature,
        top_p: sampling.top_p,
        seed,
        stops,
        stream,
        include_usage,
        shape: Shape {
            logit_bias,
            presence_penalty: penalty[0],
            frequency_penalty: penalty[1],
            ..Shape::default()
        },
    })
}

/// Thinking on (with its effort) or off, from `thinking` and `reasoning_effort`. Default: on,
/// with effort `default_effort`.
pub fn thinking(r: &ChatRequest, default_effort: Effort) -> Result<Option<Effort>, ApiError> {
    let enabled = match r.thinking.as_ref().map(|t| t.kind.as_str()) {
        None => None,
        Some("enabled") => Some(true),
        Some("disabled") => Some(false),
        Some(other) => {
            return Err(ApiError::bad(
                Some("thinking"),
                format!("thinking.type {other:?}: use \"enabled\" or \"disabled\""),
            ))
        }
    };
    let effort = match r.reasoning_effort.as_deref() {
        None => None,
        Some("none") => {
            if enabled == Some(true) {
                return Err(ApiError::bad(
                    Some("reasoning_effort"),
                    "reasoning_effort \"none\" contradicts thinking.type \"enabled\"",
                ));
            }
            return Ok(None);
        }
        Some(e) => Some(
            Effort::parse(e)
                .map_err(|m| ApiError::bad(Some("reasoning_effort"), format!("{m}, or none")))?,
        ),
    };
    match (enabled, effort) {
        (Some(false), Some(_)) => Err(ApiError::bad(
            Some("reasoning_effort"),
            "reasoning_effort needs thinking on (thinking.type is \"disabled\")",
        )),
        (Some(false), None) => Ok(None),
        (_, e) => Ok(Some(e.unwrap_or(default_effort))),
    }
}

/// `thinking_budget`: a count of ids ≥ 0, with thinking on (`None`: not given).
pub fn thinking_budget(r: &ChatRequest, thinking: bool) -> Result<Option<usize>, ApiError> {
    match r.thinking_budget {
        None => Ok(None),
        Some(_) if !thinking => Err(ApiError::bad(
            Some("thinking_budget"),
            "thinking_budget needs thinking on",
        )),
        Some(b) if b < 0 || b as u64 > MAX_GEN as u64 => Err(ApiError::bad(
            Some("thinking_budget"),
            format!("thinking_budget = {b} is outside 0..={MAX_GEN}"),
        )),
        Some(b) => Ok(Some(b as usize)),
    }
}

/// Reject what the chat endpoint does not implement.
pub fn check_chat_extras(r: &ChatRequest) -> Result<(), ApiError> {
    let o = &r.other;
    let refuse = |field: &'static str, why: &str| Err(ApiError::bad(Some(field), why.to_string()));
    if o.audio.as_ref().is_some_and(|v| !v.is_null()) {
        return refuse("audio", "audio output is not supported (text only)");
    }
    if o.modalities
        .as_ref()
        .is_some_and(|m| m.iter().any(|m| m != "text"))
    {
        return refuse("modalities", "only the text modality is supported");
    }
    if o.prediction.as_ref().is_some_and(|v| !v.is_null()) {
        return refuse("prediction", "predicted outputs are not supported");
    }
    if o.store == Some(true) {
        return refuse("store", "k3 does not store completions (store: false only)");
    }
    if o.prompt_cache_retention
        .as_deref()
        .is_some_and(|v| v != "in_memory")
    {
        return refuse(
            "prompt_cache_retention",
            "kept sessions live in the store's memory: only \"in_memory\"",
        );
    }
    if o.service_tier
        .as_deref()
        .is_some_and(|t| t != "auto" && t != "default")
    {
        return refuse("service_tier", "only service_tier \"auto\" or \"default\"");
    }
    if o.verbosity.as_ref().is_some_and(|v| !v.is_null()) {
        return refuse("verbosity", "verbosity is not an option of this model");
    }
    if o.web_search_options.as_ref().is_some_and(|v| !v.is_null()) {
        return refuse("web_search_options", "web search is not supported");
    }
    Ok(())
}

/// The tool setup of a chat request: what is declared in the prompt and what may be called.
#[derive(Debug, Default)]
pub struct ToolSetup {
    /// Declared tools (rendered in the `tool-declare` message).
    pub specs: Vec<ToolSpec>,
    /// The `tool-choice` note.
    pub choice: Option<ChoiceNote>,
    /// Tools the reply may call (empty: none).
    pub allowed: Vec<String>,
    /// More than one call per reply.
    pub parallel: bool,
    /// The reply must call a tool (`required`, Anthropic's `any`) or this one (a named
    /// function, Anthropic's `tool`): a grammar forces it.
    pub must_call: Option<MustCall>,
}

/// What a forced tool choice asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MustCall {
    /// One of the declared tools.
    Any,
    /// This tool.
    Named(String),
}

impl ToolSetup {
    /// Force a call (`must`), rendering the `required` note and allowing only what may be
    /// called.
    pub fn force(&mut self, must: MustCall) -> Result<(), String> {
        if let MustCall::Named(name) = &must {
            if !self.specs.iter().any(|s| &s.name == name) {
                return Err(format!("{name:?} is not a declared tool"));
            }
            self.allowed = vec![name.clone()];
        }
        self.choice = Some(ChoiceNote::Required);
        self.must_call = Some(must);
        Ok(())
    }
}

/// `tools`/`tool_choice`/`parallel_tool_calls`, or the older `functions`/`function_call`.
pub fn tool_setup(r: &ChatRequest) -> Result<ToolSetup, ApiError> {
    let (defs, choice, choice_field) = match (&r.tools, &r.functions) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad(
                Some("functions"),
                "give tools or the older functions, not both",
            ))
        }
        (None, Some(f)) => {
            if r.tool_choice.is_some() {
                return Err(ApiError::bad(
                    Some("tool_choice"),
                    "tool_choice goes with tools (functions takes function_call)",
                ));
            }
            (f.clone(), &r.function_call, "function_call")
        }
        (tools, None) => {
            if r.function_call.is_some() {
                return Err(ApiError::bad(
                    Some("function_call"),
                    "function_call goes with functions (tools takes tool_choice)",
                ));
            }
            let mut defs = Vec::new();
            for t in tools.iter().flatten() {
                match (t.kind.as_str(), &t.function) {
                    ("function", Some(f)) => defs.push(f.clone()),
                    ("function", None) => {
                        return Err(ApiError::bad(
                            Some("tools"),
                            "a function tool needs function",
                        ))
                    }
                    (other, _) => {
                        return Err(ApiError::bad(
                            Some("tools"),
                            format!("tools of type {other:?} are not supported (function only)"),
                        ))
                    }
                }
            }
            (defs, &r.tool_choice, "tool_choice")
        }
    };
    let mut specs: Vec<ToolSpec> = Vec::with_capacity(defs.len());
    for f in defs {
        if f.name.is_empty() || specs.iter().any(|s| s.name == f.name) {
            return Err(ApiError::bad(
                Some("tools"),
                format!("tool names must be unique and non-empty ({:?})", f.name),
            ));
        }
        if f.parameters.as_ref().is_some_and(|p| !p.is_object()) {
            return Err(ApiError::bad(
                Some("tools"),
                format!(
                    "the parameters of {:?} are not a JSON schema object",
                    f.name
                ),
            ));
        }
        specs.push(ToolSpec {
            name: f.name,
            description: f.description,
            parameters: f.parameters,
            strict: f.strict,
        });
    }
    let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
    let bad = |m: String| ApiError::bad(Some(choice_field), m);
    let (choice, must) = match choice {
        None => (None, None),
        Some(_) if specs.is_empty() => {
            return Err(bad(format!("{choice_field} needs declared tools")))
        }
        Some(Value::String(c)) if c == "auto" => (None, None),
        Some(Value::String(c)) if c == "none" => (Some(ChoiceNote::None), None),
        Some(Value::String(c)) if c == "required" && choice_field == "tool_choice" => {
            (None, Some(MustCall::Any))
        }
        Some(v @ Value::Object(_)) => (None, Some(MustCall::Named(named_choice(v, choice_field)?))),
        Some(other) => {
            let named = if choice_field == "tool_choice" {
                "\"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": …}}"
            } else {
                "\"auto\", \"none\" or {\"name\": …}"
            };
            return Err(bad(format!("{choice_field} {other}: use {named}")));
        }
    };
    let mut setup = ToolSetup {
        allowed: if choice == Some(ChoiceNote::None) {
            Vec::new()
        } else {
            names
        },
        specs,
        choice,
        parallel: r.parallel_tool_calls.unwrap_or(true),
        must_call: None,
    };
    if let Some(m) = must {
        setup.force(m).map_err(bad)?;
    }
    Ok(setup)
}

/// The function a named choice names: `{"type": "function", "function": {"name": N}}`
/// (`tool_choice`) or `{"name": N}` (`function_call`).
fn named_choice(v: &Value, field: &'static str) -> Result<String, ApiError> {
    let name = if field == "tool_choice" {
        (v.get("type").and_then(Value::as_str) == Some("function"))
            .then(|| v.pointer("/function/name"))
            .flatten()
    } else {
        v.get("name")
    };
    name.and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| ApiError::bad(Some(field), format!("{field} {v} names no function")))
}

/// A message's text: a string, or its `text` parts joined (SPEC.md §10 C19).
fn content_text(k: usize, content: &Option<Content>) -> Result<String, ApiError> {
    match content {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => {
            let mut s = String::new();
            for p in parts {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => s.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::bad(
                            Some("messages"),
                            format!("messages[{k}]: content part of type {kind:?} is not supported (text only)"),
                        ))
                    }
                }
            }
            Ok(s)
        }
    }
}

/// One call of the history as the renderer takes it.
fn history_call(k: usize, f: &CallFunction) -> Result<ToolCall, ApiError> {
    let bad = |m: String| ApiError::bad(Some("messages"), format!("messages[{k}]: {m}"));
    let arguments = match &f.arguments {
        None | Some(Value::Null) => Arguments::Object(serde_json::Map::new()),
        Some(Value::String(s)) => Arguments::from_json_text(s).map_err(|e| bad(e.to_string()))?,
        Some(Value::Object(m)) => Arguments::Object(m.clone()),
        Some(other) => {
            return Err(bad(format!(
                "tool call arguments {other} are not a JSON string"
            )))
        }
    };
    if f.name.is_empty() {
        return Err(bad("a tool call has an empty name".into()));
    }
    Ok(ToolCall {
        name: f.name.clone(),
        arguments,
    })
}

/// The conversation as chat-format messages: tool results follow the order of the calls they
/// answer and take their names (SPEC.md §5.5 "Tools").
pub fn messages(r: &ChatRequest) -> Result<Vec<Message>, ApiError> {
    if r.messages.is_empty() {
        return Err(ApiError::bad(Some("messages"), "messages is empty"));
    }
    let mut out = Vec::with_capacity(r.messages.len());
    // The last assistant message's call ids and names.
    let mut calls: Vec<(Option<&str>, &str)> = Vec::new();
    let mut k = 0;
    while k < r.messages.len() {
        let m = &r.messages[k];
        if m.role == "tool" || m.role == "function" {
            let start = k;
            while k < r.messages.len() && matches!(r.messages[k].role.as_str(), "tool" | "function")
            {
                k += 1;
            }
            out.extend(tool_run(&r.messages[start..k], start, &calls)?);
            continue;
        }
        let bad = |m: String| ApiError::bad(Some("messages"), format!("messages[{k}]: {m}"));
        if m.audio.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(bad("audio is not supported".into()));
        }
        if m.refusal.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(bad(
                "an assistant refusal cannot be rendered; give it as content".into(),
            ));
        }
        let text = content_text(k, &m.content)?;
        let mut msg = match m.role.as_str() {
            "system" | "developer" => Message::system(text),
            "user" => Message::user(text),
            "assistant" => {
                let mut tc = Vec::new();
                calls.clear();
                for c in m.tool_calls.iter().flatten() {
                    if c.kind.as_deref().is_some_and(|t| t != "function") {
                        return Err(bad("only function tool calls are supported".into()));
                    }
                    tc.push(history_call(k, &c.function)?);
                    calls.push((c.id.as_deref(), c.function.name.as_str()));
                }
                if let Some(f) = &m.function_call {
                    if !tc.is_empty() {
                        return Err(bad("give tool_calls or function_call, not both".into()));
                    }
                    tc.push(history_call(k, f)?);
                    calls.push((None, f.name.as_str()));
                }
                Message::assistant_calls(text, m.reasoning_content.clone(), tc)
            }
            other => {
                return Err(bad(format!(
                    "role {other:?} is not supported (system, developer, user, assistant, tool, function)"
                )))
            }
        };
        if m.tool_call_id.is_some() {
            return Err(bad("tool_call_id belongs on a tool message".into()));
        }
        msg.name = m.name.clone().filter(|n| !n.is_empty());
        out.push(msg);
        k += 1;
    }
    Ok(out)
}

/// A run of consecutive tool results after the calls `calls` (id, name).
fn tool_run(
    run: &[ChatMessage],
    first: usize,
    calls: &[(Option<&str>, &str)],
) -> Result<Vec<Message>, ApiError> {
    let call_ids: Vec<Option<&str>> = calls.iter().map(|c| c.0).collect();
    let result_ids: Vec<Option<&str>> = run.iter().map(|m| m.tool_call_id.as_deref()).collect();
    let order = tools::result_order(&call_ids, &result_ids);
    let mut out = Vec::with_capacity(run.len());
    for pos in 0..run.len() {
        let at = order.as_ref().map_or(pos, |o| o[pos]);
        let m = &run[at];
        let k = first + at;
        let name = match &order {
            // Matched: the call's own name.
            Some(_) => m
                .tool_call_id
                .as_deref()
                .and_then(|id| calls.iter().find(|c| c.0 == Some(id)))
                .map(|c| c.1.to_string()),
            None => m
                .name
                .clone()
                .filter(|n| !n.is_empty())
                .or_else(|| calls.get(pos).map(|c| c.1.to_string())),
        };
        let Some(name) = name else {
            return Err(ApiError::bad(
                Some("messages"),
                format!(
                    "messages[{k}]: a tool result must answer a call of the assistant message \
                     before it (tool_call_id) or name its tool"
                ),
            ));
        };
        out.push(Message::tool(name, content_text(k, &m.content)?));
    }
    Ok(out)
}

/// Fields k3 reads beyond OpenAI's schemas.
pub const K3_FIELDS: &[&str] = &["thinking", "thinking_budget"];

/// The body's top-level fields that no schema of this endpoint names (`known`): they are
/// ignored, and the caller logs them.
pub fn unknown_fields(body: &[u8], known: &[&str]) -> Vec<String> {
    let Ok(serde_json::Value::Object(m)) = serde_json::from_slice::<Value>(body) else {
        return Vec::new();
    };
    m.keys()
        .filter(|k| !known.contains(&k.as_str()) && !K3_FIELDS.contains(&k.as_str()))
        .cloned()
        .collect()
}

/// Reject what the completions endpoint does not implement.
pub fn check_completion_extras(r: &CompletionRequest) -> Result<(), ApiError> {
    if r.echo == Some(true) {
        return Err(ApiError::bad(Some("echo"), "echo is not supported"));
    }
    if r.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::bad(
            Some("best_of"),
            "only best_of = 1 is supported",
        ));
    }
    if r.best_of.is_some() && r.common.n.is_some_and(|n| n > 1) {
        return Err(ApiError::bad(
            Some("best_of"),
            "best_of with n > 1 is not supported (n choices are returned as generated)",
        ));
    }
    if r.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad(Some("suffix"), "suffix is not supported"));
    }
    Ok(())
}

/// The completion prompt: text to encode, or ids checked against the vocabulary.
pub enum PromptInput {
    /// Text (encoded as user text, special tokens disabled).
    Text(String),
    /// Ids as given.
    Ids(Vec<u32>),
}

/// The one prompt of a completion request.
pub fn prompt(p: &Prompt, vocab: usize) -> Result<PromptInput, ApiError> {
    let ids = |v: &[i64]| -> Result<PromptInput, ApiError> {
        v.iter()
            .map(|&i| {
                if i >= 0 && (i as u64) < vocab as u64 {
                    Ok(i as u32)
                } else {
                    Err(ApiError::bad(
                        Some("prompt"),
                        format!("token id {i} is outside the vocabulary of {vocab}"),
                    ))
                }
            })
            .collect::<Result<Vec<u32>, ApiError>>()
            .map(PromptInput::Ids)
    };
    let one = |n: usize| {
        ApiError::bad(
            Some("prompt"),
            format!("{n} prompts: exactly one prompt per request is supported"),
        )
    };
    match p {
        Prompt::Text(t) => Ok(PromptInput::Text(t.clone())),
        Prompt::Ids(v) => ids(v),
        Prompt::Texts(v) if v.len() == 1 => Ok(PromptInput::Text(v[0].clone())),
        Prompt::Texts(v) => Err(one(v.len())),
        Prompt::IdLists(v) if v.len() == 1 => ids(&v[0]),
        Prompt::IdLists(v) => Err(one(v.len())),
    }
}

/// Check the prompt length in ids.
pub fn check_prompt_len(n: usize) -> Result<(), ApiError> {
    if n == 0 {
        return Err(ApiError::bad(Some("prompt"), "the prompt is empty"));
    }
    if n > MAX_PROMPT {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::bad(
                Some("messages"),
                format!("the prompt is {n} tokens; the limit is {MAX_PROMPT}"),
            )
        });
    }
    Ok(())
}

/// `usage`, with the prompt ids a kept session held as `prompt_tokens_details.cached_tokens`
/// (OpenAI's field for prompt caching).
pub fn usage(prompt: usize, cached: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> ChatRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn thinking_fields() {
        let base = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let with = |extra: Value| {
            let mut b = base.clone();
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            thinking(&chat(b), DEFAULT_EFFORT)
        };
        assert_eq!(with(json!({})).unwrap(), Some(Effort::Low));
        assert_eq!(
            with(json!({"thinking": {"type": "disabled"}})).unwrap(),
            None
        );
        assert_eq!(with(json!({"reasoning_effort": "none"})).unwrap(), None);
        assert_eq!(
            with(json!({"thinking": {"type": "enabled"}, "reasoning_effort": "low"})).unwrap(),
            Some(Effort::Low)
        );
        assert_eq!(
            with(json!({"reasoning_effort": "high"})).unwrap(),
            Some(Effort::High)
        );
        for bad in [
            json!({"thinking": {"type": "disabled"}, "reasoning_effort": "low"}),
            json!({"thinking": {"type": "enabled"}, "reasoning_effort": "none"}),
            json!({"thinking": {"type": "maybe"}}),
            json!({"reasoning_effort": "minimal"}),
        ] {
            let e = with(bad.clone()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
        }
    }

    #[test]
    fn settings_defaults_and_ranges() {
        let c: Common = serde_json::from_value(json!({"stop": "x"})).unwrap();
        let s = settings(&c, None, 16, 42).unwrap();
        assert_eq!(
            (s.max_new, s.seed, s.stops.clone()),
            (16, 42, vec!["x".to_string()])
        );
        assert_eq!((s.temperature, s.top_p, s.stream), (1.0, 1.0, false));
        let c: Common =
            serde_json::from_value(json!({"stop": ["a", "b"], "seed": 3, "temperature": 0}))
                .unwrap();
        let s = settings(&c, Some(4096), 16, 42).unwrap();
        assert_eq!((s.max_new, s.seed, s.temperature), (4096, 3, 0.0));
        assert_eq!(s.stops, vec!["a".to_string(), "b".to_string()]);
        for bad in [
            json!({"n": 0}),
            json!({"n": 129}),
            json!({"temperature": 2.5}),
            json!({"top_p": 0}),
            json!({"seed": -1}),
            json!({"stop": ["a", "b", "c", "d", "e"]}),
            json!({"stop": ""}),
            json!({"presence_penalty": 2.5}),
            json!({"frequency_penalty": -3}),
            json!({"logit_bias": {"1": 500}}),
            json!({"logit_bias": {"x": 5}}),
        ] {
            let c: Common = serde_json::from_value(bad.clone()).unwrap();
            assert!(settings(&c, None, 16, 0).is_err(), "{bad} accepted");
        }
        let c = Common::default();
        assert!(settings(&c, Some(0), 16, 0).is_err());
        assert!(settings(&c, Some(MAX_GEN as i64 + 1), 16, 0).is_err());
    }

    /// What a request field gets.
    #[derive(Debug, PartialEq)]
    enum Fate {
        /// Accepted (honoured, or accepted because it cannot change the answer).
        Ok,
        /// 400 naming the field.
        Refused,
    }

    /// Every check a chat request goes through before rendering.
    fn check_chat(body: &Value) -> Result<(), ApiError> {
        let r: ChatRequest =
            serde_json::from_value(body.clone()).map_err(|e| ApiError::bad(None, e.to_string()))?;
        check_chat_extras(&r)?;
        settings(
            &r.common,
            r.max_completion_tokens.or(r.common.max_tokens),
            16,
            0,
        )?;
        thinking(&r, DEFAULT_EFFORT)?;
        tool_setup(&r)?;
        messages(&r)?;
        crate::serve::shape::response_format(r.response_format.as_ref(), "response_format")?;
        crate::serve::shape::chat_logprobs(r.common.logprobs.as_ref(), r.top_logprobs.as_ref())?;
        Ok(())
    }

    #[test]
    fn forced_tool_choices_name_what_may_be_called() {
        let tools = json!([
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "g"}}]);
        let setup = |choice: Value| {
            tool_setup(&chat(
                json!({"messages": [], "tools": tools, "tool_choice": choice}),
            ))
        };
        let s = setup(json!("required")).unwrap();
        assert_eq!(s.must_call, Some(MustCall::Any));
        assert_eq!(s.choice, Some(ChoiceNote::Required));
        assert_eq!(s.allowed, ["f", "g"]);
        let s = setup(json!({"type": "function", "function": {"name": "g"}})).unwrap();
        assert_eq!(s.must_call, Some(MustCall::Named("g".into())));
        assert_eq!(s.allowed, ["g"]);
        assert_eq!(setup(json!("auto")).unwrap().must_call, None);
        for bad in [
            json!({"type": "function", "function": {"name": "h"}}),
            json!({"type": "x"}),
            json!("any"),
        ] {
            assert_eq!(
                setup(bad.clone()).unwrap_err().param,
                Some("tool_choice"),
                "{bad}"
            );
        }
        // The older form: function_call {"name"}; "required" is not one of its values.
        let old = |fc: Value| {
            tool_setup(&chat(
                json!({"messages": [], "functions": [{"name": "f"}], "function_call": fc}),
            ))
        };
        assert_eq!(
            old(json!({"name": "f"})).unwrap().must_call,
            Some(MustCall::Named("f".into()))
        );
        assert_eq!(
            old(json!("required")).unwrap_err().param,
            Some("function_call")
        );
    }

    fn tools_json() -> Value {
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    }

    /// Issue 47 item 5: every field of OpenAI's chat request is honoured or refused with 400
    /// naming it — none is dropped silently.
    #[test]
    fn every_openai_chat_field_is_honoured_or_refused_by_name() {
        let table: Vec<(&str, Value, Fate)> = vec![
            (
                "messages",
                json!([{"role": "user", "content": "x"}]),
                Fate::Ok,
            ),
            ("model", json!("m"), Fate::Ok),
            (
                "audio",
                json!({"voice": "alloy", "format": "wav"}),
                Fate::Refused,
            ),
            ("frequency_penalty", json!(0.5), Fate::Ok),
            ("function_call", json!("auto"), Fate::Refused),
            ("functions", json!([{"name": "f"}]), Fate::Ok),
            ("logit_bias", json!({"1": 5}), Fate::Ok),
            ("logprobs", json!(true), Fate::Ok),
            ("max_completion_tokens", json!(5), Fate::Ok),
            ("max_tokens", json!(5), Fate::Ok),
            ("metadata", json!({"a": "b"}), Fate::Ok),
            ("modalities", json!(["text", "audio"]), Fate::Refused),
            ("n", json!(2), Fate::Ok),
            ("parallel_tool_calls", json!(false), Fate::Ok),
            (
                "prediction",
                json!({"type": "content", "content": "x"}),
                Fate::Refused,
            ),
            ("presence_penalty", json!(0.5), Fate::Ok),
            ("prompt_cache_key", json!("k"), Fate::Ok),
            ("prompt_cache_retention", json!("24h"), Fate::Refused),
            ("reasoning_effort", json!("high"), Fate::Ok),
            ("response_format", json!({"type": "json_object"}), Fate::Ok),
            ("safety_identifier", json!("u"), Fate::Ok),
            ("seed", json!(3), Fate::Ok),
            ("service_tier", json!("flex"), Fate::Refused),
            ("stop", json!("x"), Fate::Ok),
            ("store", json!(true), Fate::Refused),
            ("stream", json!(true), Fate::Ok),
            ("stream_options", json!({"include_usage": true}), Fate::Ok),
            ("temperature", json!(0.5), Fate::Ok),
            ("tool_choice", json!("required"), Fate::Ok),
            ("tools", tools_json(), Fate::Ok),
            ("top_logprobs", json!(2), Fate::Refused),
            ("top_p", json!(0.5), Fate::Ok),
            ("user", json!("u"), Fate::Ok),
            ("verbosity", json!("low"), Fate::Refused),
            ("web_search_options", json!({}), Fate::Refused),
        ];
        let listed: Vec<&str> = table.iter().map(|t| t.0).collect();
        assert_eq!(
            listed, OPENAI_CHAT_FIELDS,
            "the walk covers the schema's fields"
        );
        for (field, value, fate) in table {
            let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
            body[field] = value;
            // tool_choice is refused for its value, not for a missing tools list.
            if field == "tool_choice" {
                body["tools"] = tools_json();
            }
            let bytes = body.to_string();
            assert!(unknown_fields(bytes.as_bytes(), OPENAI_CHAT_FIELDS).is_empty());
            match (check_chat(&body), fate) {
                (Ok(()), Fate::Ok) => {}
                (Err(e), Fate::Refused) => {
                    assert_eq!(e.status, StatusCode::BAD_REQUEST, "{field}");
                    assert_eq!(e.param, Some(field), "{field}: {}", e.message);
                }
                (got, fate) => panic!("{field}: {:?}, expected {fate:?}", got.err()),
            }
        }
        let extra = json!({"model": "m", "messages": [], "thinking": {}, "frobnicate": 1});
        assert_eq!(
            unknown_fields(extra.to_string().as_bytes(), OPENAI_CHAT_FIELDS),
            vec!["frobnicate".to_string()]
        );
    }

    #[test]
    fn every_openai_completion_field_is_honoured_or_refused_by_name() {
        let table: Vec<(&str, Value, Fate)> = vec![
            ("model", json!("m"), Fate::Ok),
            ("prompt", json!("x"), Fate::Ok),
            ("best_of", json!(2), Fate::Refused),
            ("echo", json!(true), Fate::Refused),
            ("frequency_penalty", json!(0.5), Fate::Ok),
            ("logit_bias", json!({"1": 5}), Fate::Ok),
            ("logprobs", json!(2), Fate::Ok),
            ("max_tokens", json!(5), Fate::Ok),
            ("n", json!(2), Fate::Ok),
            ("presence_penalty", json!(0.5), Fate::Ok),
            ("seed", json!(3), Fate::Ok),
            ("stop", json!(["a"]), Fate::Ok),
            ("stream", json!(true), Fate::Ok),
            ("stream_options", json!({"include_usage": true}), Fate::Ok),
            ("suffix", json!("x"), Fate::Refused),
            ("temperature", json!(0.5), Fate::Ok),
            ("top_p", json!(0.5), Fate::Ok),
            ("user", json!("u"), Fate::Ok),
        ];
        let listed: Vec<&str> = table.iter().map(|t| t.0).collect();
        assert_eq!(listed, OPENAI_COMPLETION_FIELDS);
        for (field, value, fate) in table {
            let mut body = json!({"model": "m", "prompt": "hi"});
            body[field] = value;
            let r: CompletionRequest = serde_json::from_value(body).unwrap();
            let got = check_completion_extras(&r)
                .and_then(|()| settings(&r.common, r.common.max_tokens, 16, 0).map(|_| ()))
                .and_then(|()| {
                    crate::serve::shape::completion_logprobs(r.common.logprobs.as_ref()).map(|_| ())
                });
            match (got, fate) {
                (Ok(()), Fate::Ok) => {}
                (Err(e), Fate::Refused) => assert_eq!(e.param, Some(field), "{field}"),
                (got, fate) => panic!("{field}: {:?}, expected {fate:?}", got.err()),
            }
        }
    }

    #[test]
    fn tool_setups() {
        let with = |extra: Value| {
            let mut b = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            tool_setup(&chat(b))
        };
        let t = with(json!({"tools": tools_json()})).unwrap();
        assert_eq!(
            (t.allowed.clone(), t.choice, t.parallel),
            (vec!["f".to_string()], None, true)
        );
        let t = with(json!({"tools": tools_json(), "tool_choice": "none"})).unwrap();
        assert_eq!((t.allowed.len(), t.choice), (0, Some(ChoiceNote::None)));
        assert_eq!(
            t.specs.len(),
            1,
            "declared even under none, as the release does"
        );
        let t = with(json!({"functions": [{"name": "g"}], "function_call": "auto"})).unwrap();
        assert_eq!(t.allowed, vec!["g".to_string()]);
        let t = with(json!({"tools": tools_json(), "parallel_tool_calls": false})).unwrap();
        assert!(!t.parallel);
        for (bad, field) in [
            (json!({"tool_choice": "auto"}), "tool_choice"),
            (
                json!({"tools": tools_json(), "tool_choice": {"type": "function", "function": {"name": "g"}}}),
                "tool_choice",
            ),
            (
                json!({"tools": tools_json(), "functions": [{"name": "g"}]}),
                "functions",
            ),
            (
                json!({"tools": [{"type": "custom", "custom": {"name": "x"}}]}),
                "tools",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]}),
                "tools",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}),
                "tools",
            ),
            (
                json!({"functions": [{"name": "g"}], "function_call": {"name": "f"}}),
                "function_call",
            ),
            (
                json!({"tools": tools_json(), "tool_choice": "maybe"}),
                "tool_choice",
            ),
        ] {
            let e = with(bad.clone()).unwrap_err();
            assert_eq!(e.param, Some(field), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn tool_history_follows_call_order_and_names() {
        let r = chat(json!({"model": "m", "messages": [
            {"role": "user", "content": "go", "name": "ann"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "first", "arguments": "{\"x\": 1}"}},
                {"id": "b", "type": "function", "function": {"name": "second", "arguments": "not json"}},
            ]},
            {"role": "tool", "tool_call_id": "b", "content": "B"},
            {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "A"}]},
            {"role": "assistant", "content": "", "function_call": {"name": "old", "arguments": "{}"}},
            {"role": "function", "name": "old", "content": "O"},
        ]}));
        let m = messages(&r).unwrap();
        assert_eq!(m[0].name.as_deref(), Some("ann"));
        assert_eq!(m[1].tool_calls.len(), 2);
        assert_eq!(
            m[1].tool_calls[1].arguments,
            Arguments::Raw("not json".into())
        );
        assert_eq!(
            (m[2].tool.as_deref(), m[2].content.as_str()),
            (Some("first"), "A")
        );
        assert_eq!(
            (m[3].tool.as_deref(), m[3].content.as_str()),
            (Some("second"), "B")
        );
        assert_eq!(m[4].tool_calls[0].name, "old");
        assert_eq!(m[5].tool.as_deref(), Some("old"));
        for bad in [
            json!([{"role": "tool", "content": "orphan"}]),
            json!([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "[1]"}}]}]),
            json!([{"role": "assistant", "refusal": "no"}]),
            json!([{"role": "user", "content": "x", "tool_call_id": "a"}]),
        ] {
            let r = chat(json!({"model": "m", "messages": bad.clone()}));
            assert_eq!(messages(&r).unwrap_err().param, Some("messages"), "{bad}");
        }
    }

    #[test]
    fn messages_and_prompts() {
        let r = chat(json!({"model": "m", "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "reasoning_content": "hmm"},
        ]}));
        let m = messages(&r).unwrap();
        assert_eq!(m[0], Message::system("be brief"));
        assert_eq!(m[1], Message::user("hi"));
        assert_eq!(m[2], Message::assistant("", Some("hmm".into())));
        let r = chat(json!({"model": "m", "messages": [{"role": "critic", "content": "x"}]}));
        assert!(messages(&r).is_err());
        let r = chat(
            json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        );
        assert!(messages(&r).is_err());

        let p: Prompt = serde_json::from_value(json!([5, 7])).unwrap();
        assert!(matches!(prompt(&p, 10).unwrap(), PromptInput::Ids(v) if v == [5, 7]));
        let p: Prompt = serde_json::from_value(json!([5, 10])).unwrap();
        assert!(prompt(&p, 10).is_err());
        let p: Prompt = serde_json::from_value(json!(["a", "b"])).unwrap();
        assert!(prompt(&p, 10).is_err());
        let p: Prompt = serde_json::from_value(json!(["a"])).unwrap();
        assert!(matches!(prompt(&p, 10).unwrap(), PromptInput::Text(t) if t == "a"));
        assert_eq!(
            check_model(&Some("x".into()), "m").unwrap_err().status,
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            check_model(&None, "m").unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }
}
