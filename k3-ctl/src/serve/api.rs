//! The OpenAI request and response shapes, and their validation into one generation job.
//!
//! Accepted: `model` (must be the served id), `messages` (roles `system`, `developer` = system,
//! `user`, `assistant` with optional `reasoning_content`; content a string or a list of `text`
//! parts) or `prompt` (a string, a one-string list, or token ids), `max_tokens` /
//! `max_completion_tokens` (1..=4096), `temperature` (0..=2, 0 = greedy), `top_p` (0 < p ≤ 1),
//! `seed`, `stop` (a string or up to 4 strings), `stream`, `stream_options.include_usage`,
//! `thinking: {"type": "enabled"|"disabled"}` and `reasoning_effort` (`low`, `medium`, `high`,
//! `max`, or `none` = thinking off). Anything that would change the answer and is not
//! implemented (`n` > 1, `logprobs`, penalties, `logit_bias`, `tools`, `echo`, `suffix`,
//! `best_of` > 1, a JSON `response_format`) is refused with 400 rather than ignored. Unknown
//! fields are ignored, as OpenAI's clients send extras.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
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
    /// Choices (only 1).
    pub n: Option<i64>,
    /// Log probabilities (not implemented).
    pub logprobs: Option<Value>,
    /// Not implemented unless 0.
    pub presence_penalty: Option<f64>,
    /// Not implemented unless 0.
    pub frequency_penalty: Option<f64>,
    /// Not implemented unless empty.
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

/// One chat message.
#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    /// Author.
    pub role: String,
    /// Text.
    pub content: Option<Content>,
    /// An assistant's earlier reasoning (think channel).
    pub reasoning_content: Option<String>,
    /// Tool calls (not implemented).
    pub tool_calls: Option<Value>,
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
    /// Not implemented.
    pub tools: Option<Vec<Value>>,
    /// Only `{"type": "text"}`.
    pub response_format: Option<Value>,
    /// Not implemented.
    pub top_logprobs: Option<Value>,
}

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
    /// Most ids to generate.
    pub max_new: usize,
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

/// Validate the shared fields; `max_tokens` falls back to `default_max`.
pub fn settings(
    c: &Common,
    max_tokens: Option<i64>,
    default_max: usize,
    default_seed: u64,
) -> Result<Settings, ApiError> {
    if let Some(n) = c.n {
        if n != 1 {
            return Err(ApiError::bad(
                Some("n"),
                format!("n = {n}: only n = 1 is supported"),
            ));
        }
    }
    if c.logprobs
        .as_ref()
        .is_some_and(|v| !v.is_null() && v != &Value::Bool(false))
    {
        return Err(ApiError::bad(
            Some("logprobs"),
            "logprobs are not supported",
        ));
    }
    for (name, v) in [
        ("presence_penalty", c.presence_penalty),
        ("frequency_penalty", c.frequency_penalty),
    ] {
        if v.is_some_and(|v| v != 0.0) {
            return Err(ApiError::bad(
                Some(name),
                format!("{name} is not supported (only 0)"),
            ));
        }
    }
    if c.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(ApiError::bad(
            Some("logit_bias"),
            "logit_bias is not supported",
        ));
    }
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
    Ok(Settings {
        max_new,
        temperature: temperature as f32,
        top_p: top_p as f32,
        seed,
        stops,
        stream,
        include_usage,
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

/// Reject what the chat endpoint does not implement.
pub fn check_chat_extras(r: &ChatRequest) -> Result<(), ApiError> {
    if r.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::bad(Some("tools"), "tools are not supported"));
    }
    if r.top_logprobs.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ApiError::bad(
            Some("top_logprobs"),
            "logprobs are not supported",
        ));
    }
    if let Some(f) = &r.response_format {
        if !f.is_null() && f.get("type").and_then(Value::as_str) != Some("text") {
            return Err(ApiError::bad(
                Some("response_format"),
                "only response_format {\"type\": \"text\"} is supported",
            ));
        }
    }
    Ok(())
}

/// The conversation as chat-format messages.
pub fn messages(r: &ChatRequest) -> Result<Vec<Message>, ApiError> {
    if r.messages.is_empty() {
        return Err(ApiError::bad(Some("messages"), "messages is empty"));
    }
    r.messages
        .iter()
        .enumerate()
        .map(|(k, m)| {
            if m.tool_calls.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(ApiError::bad(
                    Some("messages"),
                    format!("messages[{k}]: tool calls are not supported"),
                ));
            }
            let text = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
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
                    s
                }
            };
            match m.role.as_str() {
                "system" | "developer" => Ok(Message::system(text)),
                "user" => Ok(Message::user(text)),
                "assistant" => Ok(Message::assistant(text, m.reasoning_content.clone())),
                other => Err(ApiError::bad(
                    Some("messages"),
                    format!("messages[{k}]: role {other:?} is not supported (system, developer, user, assistant)"),
                )),
            }
        })
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
            json!({"n": 2}),
            json!({"temperature": 2.5}),
            json!({"top_p": 0}),
            json!({"seed": -1}),
            json!({"stop": ["a", "b", "c", "d", "e"]}),
            json!({"stop": ""}),
            json!({"logprobs": true}),
            json!({"presence_penalty": 0.5}),
            json!({"logit_bias": {"1": 5}}),
        ] {
            let c: Common = serde_json::from_value(bad.clone()).unwrap();
            assert!(settings(&c, None, 16, 0).is_err(), "{bad} accepted");
        }
        let c = Common::default();
        assert!(settings(&c, Some(0), 16, 0).is_err());
        assert!(settings(&c, Some(MAX_GEN as i64 + 1), 16, 0).is_err());
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
        let r = chat(json!({"model": "m", "messages": [{"role": "tool", "content": "x"}]}));
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
