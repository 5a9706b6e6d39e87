//! The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.
//!
//! A request becomes the same chat job as OpenAI's route (one rendered XTML prompt, one
//! [`ReplyText`]); only the shapes differ. Accepted: `model`, `messages` (content a string or
//! `text`, `tool_use`, `tool_result`, `thinking` blocks), `max_tokens` (required), `system` (a
//! string or `text` blocks), `stop_sequences`, `stream`, `temperature` (0..=1), `top_p`,
//! `tools` (custom tools: `name`, `description`, `input_schema`), `tool_choice` `auto`/`none`/
//! `any`/`tool` (with `disable_parallel_tool_use`; `any` and `tool` force a well-formed call
//! through the worker's grammar), `thinking` (`enabled` with `budget_tokens`, or `disabled`;
//! the default is off, as Anthropic's), `output_config.format` (`json_schema`: the reply's
//! JSON follows the schema), `metadata`, `service_tier` `auto` and `standard_only`, and as they
//! come `cache_control`, `inference_geo`, `user_profile_id`, `workspace_id`. Refused with 400
//! naming the field: `top_k` (k3 samples by temperature and nucleus only), `output_config`
//! other than `format`, `container`, `mcp_servers`, `context_management`, `diagnostics`,
//! `speed`, server tools, image and document blocks, `redacted_thinking`.
//!
//! `thinking.budget_tokens` is enforced: at most that many ids in the think channel, then the
//! worker closes it and opens the response (docs/SPEC.md §6.12 "Shaping"); it also chooses the
//! thinking effort of the prompt (below 4,096 `low`, below 16,384 `high`, else `max`). Unlike
//! Anthropic, budgets below 1,024 are accepted (this hardware thinks slowly); the budget must
//! stay below `max_tokens`. A `tool_result`'s `is_error` has no place in K3's format: its text
//! is rendered as given.
//!
//! Errors are Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with its
//! status codes ([`reshape`] converts every error of these routes).

use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use k3_proto::serve::Grammar;
use k3_worker::text::tools::{Arguments, ChoiceNote, FormatNote, ToolCall, ToolSpec};
use k3_worker::text::xtml::{Effort, Message};
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{ApiError, MustCall, Settings, ToolSetup, MAX_GEN, MAX_STOPS};
use super::reply::{CallOut, Delta, Finish};

/// Every field of Anthropic's Messages request: the `anthropic` SDK 2.17's `messages.create`
/// parameters, and the sampling and beta fields of earlier versions that clients still send.
/// `cache_control`, `inference_geo`, `metadata`, `user_profile_id` and `workspace_id` are
/// accepted as they come (caching hints and identifiers: k3 keeps sessions by prompt prefix on
/// its own and runs where it is).
pub const ANTHROPIC_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "cache_control",
    "container",
    "context_management",
    "diagnostics",
    "inference_geo",
    "mcp_servers",
    "metadata",
    "output_config",
    "service_tier",
    "speed",
    "stop_sequences",
    "stream",
    "system",
    "temperature",
    "thinking",
    "tool_choice",
    "tools",
    "top_k",
    "top_p",
    "user_profile_id",
    "workspace_id",
];

/// A text block (of `system`, or of a tool result).
#[derive(Debug, Deserialize)]
pub struct TextBlock {
    /// `text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Its text.
    pub text: Option<String>,
}

/// A string or text blocks.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Texts {
    /// A string.
    One(String),
    /// Blocks.
    Blocks(Vec<TextBlock>),
}

/// One content block of a message.
#[derive(Debug, Deserialize)]
pub struct Block {
    /// `text`, `tool_use`, `tool_result`, `thinking` (others are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// `text`.
    pub text: Option<String>,
    /// `thinking`.
    pub thinking: Option<String>,
    /// `tool_use`: the call's id.
    pub id: Option<String>,
    /// `tool_use`: the tool.
    pub name: Option<String>,
    /// `tool_use`: the arguments.
    pub input: Option<Value>,
    /// `tool_result`: the call it answers.
    pub tool_use_id: Option<String>,
    /// `tool_result`: its content.
    pub content: Option<Texts>,
}

/// A message's content.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// A string.
    Text(String),
    /// Blocks.
    Blocks(Vec<Block>),
}

/// One message.
#[derive(Debug, Deserialize)]
pub struct InMessage {
    /// `user` or `assistant`.
    pub role: String,
    /// Its content.
    pub content: MessageContent,
}

/// A declared tool.
#[derive(Debug, Deserialize)]
pub struct Tool {
    /// Absent or `custom` (server tools are refused).
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// Its name.
    pub name: String,
    /// What it does.
    pub description: Option<String>,
    /// Its input's JSON schema.
    pub input_schema: Option<Value>,
}

/// `tool_choice`.
#[derive(Debug, Deserialize)]
pub struct ToolChoice {
    /// `auto`, `none`, `any` or `tool`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The tool of `tool`.
    pub name: Option<String>,
    /// At most one tool call.
    pub disable_parallel_tool_use: Option<bool>,
}

/// `thinking`.
#[derive(Debug, Deserialize)]
pub struct Thinking {
    /// `enabled` or `disabled`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The thinking budget (≥ 0, below `max_tokens`).
    pub budget_tokens: Option<i64>,
}

/// `POST /v1/messages` (and `count_tokens`, which reads the same fields).
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    /// Model id.
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<InMessage>,
    /// Most ids to generate (required by `/v1/messages`).
    pub max_tokens: Option<i64>,
    /// The system prompt.
    pub system: Option<Texts>,
    /// Stop strings.
    pub stop_sequences: Option<Vec<String>>,
    /// Server-sent events.
    pub stream: Option<bool>,
    /// 0..=1.
    pub temperature: Option<f64>,
    /// Nucleus mass.
    pub top_p: Option<f64>,
    /// Refused.
    pub top_k: Option<Value>,
    /// Declared tools.
    pub tools: Option<Vec<Tool>>,
    /// `auto`, `none`.
    pub tool_choice: Option<ToolChoice>,
    /// Thinking on or off.
    pub thinking: Option<Thinking>,
    /// `auto` or `standard_only`.
    pub service_tier: Option<String>,
    /// Refused.
    pub container: Option<Value>,
    /// Refused.
    pub mcp_servers: Option<Value>,
    /// Refused.
    pub context_management: Option<Value>,
    /// Refused.
    pub diagnostics: Option<Value>,
    /// Output format (`format`: `json_schema`; other keys refused).
    pub output_config: Option<Value>,
    /// Refused.
    pub speed: Option<Value>,
}

/// A validated request: what the chat renderer and the reply need.
#[derive(Debug)]
pub struct Prepared {
    /// The conversation.
    pub history: Vec<Message>,
    /// Thinking effort (None: off).
    pub thinking: Option<Effort>,
    /// Declared tools.
    pub tools: Vec<ToolSpec>,
    /// The `tool-choice` note.
    pub choice: Option<ChoiceNote>,
    /// Callable tools.
    pub allowed: Vec<String>,
    /// More than one call per reply.
    pub parallel: bool,
    /// The thinking budget (thinking on).
    pub budget: Option<usize>,
    /// The grammar of a forced tool choice or of `output_config.format`.
    pub grammar: Option<Grammar>,
    /// The `response-format` note of `output_config.format`.
    pub format: Option<FormatNote>,
}

fn bad(field: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::bad(Some(field), message)
}

fn texts(field: &'static str, t: &Texts) -> Result<String, ApiError> {
    match t {
        Texts::One(s) => Ok(s.clone()),
        Texts::Blocks(blocks) => {
            let mut s = String::new();
            for b in blocks {
                match (b.kind.as_str(), &b.text) {
                    ("text", Some(t)) => s.push_str(t),
                    (kind, _) => {
                        return Err(bad(
                            field,
                            format!("{kind:?} blocks are not supported here (text only)"),
                        ))
                    }
                }
            }
            Ok(s)
        }
    }
}

/// Refuse the fields k3 cannot honour.
fn check_fields(r: &MessagesRequest) -> Result<(), ApiError> {
    let given = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
    if given(&r.top_k) {
        return Err(bad(
            "top_k",
            "top_k is not supported (k3 samples with temperature and top_p)",
        ));
    }
    for (field, v) in [
        ("container", &r.container),
        ("mcp_servers", &r.mcp_servers),
        ("context_management", &r.context_management),
        ("diagnostics", &r.diagnostics),
        ("speed", &r.speed),
    ] {
        if given(v) {
            return Err(bad(field, format!("{field} is not supported")));
        }
    }
    if r.service_tier
        .as_deref()
        .is_some_and(|t| t != "auto" && t != "standard_only")
    {
        return Err(bad(
            "service_tier",
            "service_tier must be auto or standard_only",
        ));
    }
    Ok(())
}

/// The sampling settings: `max_tokens` (required unless `count_only`), temperature 0..=1.
pub fn settings(r: &MessagesRequest, seed: u64, count_only: bool) -> Result<Settings, ApiError> {
    let max_new = match r.max_tokens {
        None if count_only => 1,
        None => return Err(bad("max_tokens", "max_tokens: Field required")),
        Some(n) if n >= 1 && n as u64 <= MAX_GEN as u64 => n as usize,
        Some(n) => {
            return Err(bad(
                "max_tokens",
                format!("max_tokens = {n} is outside 1..={MAX_GEN}"),
            ))
        }
    };
    let temperature = r.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && (0.0..=1.0).contains(&temperature)) {
        return Err(bad(
            "temperature",
            format!("temperature = {temperature} is outside 0..=1"),
        ));
    }
    let top_p = r.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad("top_p", format!("top_p = {top_p} is outside (0, 1]")));
    }
    let stops = r.stop_sequences.clone().unwrap_or_default();
    if stops.iter().any(String::is_empty) {
        return Err(bad("stop_sequences", "a stop sequence is empty"));
    }
    if stops.len() > 4 * MAX_STOPS {
        return Err(bad(
            "stop_sequences",
            format!("{} stop sequences: at most {}", stops.len(), 4 * MAX_STOPS),
        ));
    }
    let sampling = k3_proto::serve::Sampling::from_request(temperature, top_p, seed)?;
    Ok(Settings {
        max_new,
        n: 1,
        temperature: sampling.temperature,
        top_p: sampling.top_p,
        seed,
        stops,
        stream: r.stream.unwrap_or(false),
        include_usage: true,
        shape: Default::default(),
    })
}

/// Thinking off by default; `enabled` picks an effort from `budget_tokens`, which bounds the
/// think channel.
fn thinking(r: &MessagesRequest) -> Result<Option<(Effort, usize)>, ApiError> {
    let Some(t) = &r.thinking else {
        return Ok(None);
    };
    match (t.kind.as_str(), t.budget_tokens) {
        ("disabled", _) => Ok(None),
        ("enabled", Some(b)) if b >= 0 && r.max_tokens.is_none_or(|m| b < m) => Ok(Some((
            if b < 4096 {
                Effort::Low
            } else if b < 16_384 {
                Effort::High
            } else {
                Effort::Max
            },
            b as usize,
        ))),
        ("enabled", _) => Err(bad(
            "thinking",
            "thinking.budget_tokens must be at least 0 and less than max_tokens",
        )),
        (other, _) => Err(bad(
            "thinking",
            format!("thinking.type {other:?}: enabled or disabled"),
        )),
    }
}

/// Tools, `tool_choice` and what the reply may call.
fn tools(r: &MessagesRequest) -> Result<ToolSetup, ApiError> {
    let mut specs: Vec<ToolSpec> = Vec::new();
    for t in r.tools.iter().flatten() {
        if t.kind.as_deref().is_some_and(|k| k != "custom") {
            return Err(bad(
                "tools",
                format!(
                    "server tools ({:?}) are not supported",
                    t.kind.as_deref().unwrap_or("")
                ),
            ));
        }
        if t.name.is_empty() || specs.iter().any(|s| s.name == t.name) {
            return Err(bad(
                "tools",
                format!("tool names must be unique and non-empty ({:?})", t.name),
            ));
        }
        if t.input_schema.as_ref().is_some_and(|s| !s.is_object()) {
            return Err(bad(
                "tools",
                format!("the input_schema of {:?} is not an object", t.name),
            ));
        }
        specs.push(ToolSpec {
            name: t.name.clone(),
            description: t.description.clone(),
            parameters: t.input_schema.clone(),
            strict: None,
        });
    }
    let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
    let (choice, parallel) = match &r.tool_choice {
        None => (None, true),
        Some(c) => {
            let parallel = !c.disable_parallel_tool_use.unwrap_or(false);
            match c.kind.as_str() {
                "auto" => (None, parallel),
                "none" => (Some(ChoiceNote::None), parallel),
                // Forced below, once the tools are known.
                "any" | "tool" => (None, parallel),
                other => {
                    return Err(bad(
                        "tool_choice",
                        format!("tool_choice type {other:?}: auto, none, any or tool"),
                    ))
                }
            }
        }
    };
    if choice.is_some() && specs.is_empty() {
        return Err(bad("tool_choice", "tool_choice needs tools"));
    }
    let allowed = if choice == Some(ChoiceNote::None) {
        Vec::new()
    } else {
        names
    };
    let mut setup = ToolSetup {
        specs,
        choice,
        allowed,
        parallel,
        must_call: None,
    };
    let must = match r.tool_choice.as_ref().map(|c| (c.kind.as_str(), &c.name)) {
        Some(("any", _)) => Some(MustCall::Any),
        Some(("tool", Some(name))) => Some(MustCall::Named(name.clone())),
        Some(("tool", None)) => return Err(bad("tool_choice", "tool_choice tool needs a name")),
        _ => None,
    };
    if let Some(m) = must {
        if setup.specs.is_empty() {
            return Err(bad("tool_choice", "tool_choice needs tools"));
        }
        setup.force(m).map_err(|e| bad("tool_choice", e))?;
    }
    Ok(setup)
}

/// `output_config`: only `format` (a JSON schema the reply follows).
fn output_format(r: &MessagesRequest) -> Result<Option<(FormatNote, Grammar)>, ApiError> {
    let Some(c) = r.output_config.as_ref().filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let Some(m) = c.as_object() else {
        return Err(bad("output_config", "output_config must be an object"));
    };
    if let Some(k) = m.keys().find(|k| *k != "format") {
        return Err(bad(
            "output_config",
            format!("output_config.{k} is not supported (format only)"),
        ));
    }
    match m.get("format") {
        Some(f) if f.get("type").and_then(Value::as_str) == Some("json_schema") => {
            super::shape::response_format(Some(f), "output_config")
        }
        Some(f) if f.is_null() => Ok(None),
        Some(f) => Err(bad(
            "output_config",
            format!("output_config.format {f}: type json_schema"),
        )),
        None => Ok(None),
    }
}

/// The conversation: `system` first, each message's blocks in order (tool results become
/// `tool` messages named by the `tool_use` they answer, in that call order).
fn history(r: &MessagesRequest) -> Result<Vec<Message>, ApiError> {
    if r.messages.is_empty() {
        return Err(bad(
            "messages",
            "messages: at least one message is required",
        ));
    }
    let mut out = Vec::new();
    if let Some(s) = &r.system {
        let text = texts("system", s)?;
        if !text.is_empty() {
            out.push(Message::system(text));
        }
    }
    // The last assistant message's tool_use ids and names.
    let mut calls: Vec<(String, String)> = Vec::new();
    for (k, m) in r.messages.iter().enumerate() {
        let err = |msg: String| bad("messages", format!("messages[{k}]: {msg}"));
        let blocks = match &m.content {
            MessageContent::Text(t) => vec![Block {
                kind: "text".into(),
                text: Some(t.clone()),
                thinking: None,
                id: None,
                name: None,
                input: None,
                tool_use_id: None,
                content: None,
            }],
            MessageContent::Blocks(b) => b.iter().map(clone_block).collect(),
        };
        match m.role.as_str() {
            "user" => out.extend(user_turn(k, &blocks, &calls)?),
            "assistant" => {
                let (msg, c) = assistant_turn(k, &blocks)?;
                calls = c;
                out.push(msg);
            }
            other => return Err(err(format!("role {other:?}: user or assistant"))),
        }
    }
    Ok(out)
}

fn clone_block(b: &Block) -> Block {
    Block {
        kind: b.kind.clone(),
        text: b.text.clone(),
        thinking: b.thinking.clone(),
        id: b.id.clone(),
        name: b.name.clone(),
        input: b.input.clone(),
        tool_use_id: b.tool_use_id.clone(),
        content: b.content.as_ref().map(|c| match c {
            Texts::One(s) => Texts::One(s.clone()),
            Texts::Blocks(v) => Texts::Blocks(
                v.iter()
                    .map(|t| TextBlock {
                        kind: t.kind.clone(),
                        text: t.text.clone(),
                    })
                    .collect(),
            ),
        }),
    }
}

/// A user turn: its tool results (in the order of the calls they answer), then its text.
fn user_turn(
    k: usize,
    blocks: &[Block],
    calls: &[(String, String)],
) -> Result<Vec<Message>, ApiError> {
    let err = |m: String| bad("messages", format!("messages[{k}]: {m}"));
    let mut results: Vec<(usize, Message)> = Vec::new();
    let mut text = String::new();
    for b in blocks {
        match b.kind.as_str() {
            "text" => text.push_str(b.text.as_deref().unwrap_or_default()),
            "tool_result" => {
                let id = b.tool_use_id.as_deref().unwrap_or_default();
                let Some(pos) = calls.iter().position(|c| c.0 == id) else {
                    return Err(err(format!(
                        "tool_result {id:?} answers no tool_use of the assistant message before it"
                    )));
                };
                let content = match &b.content {
                    None => String::new(),
                    Some(t) => texts("messages", t)?,
                };
                results.push((pos, Message::tool(calls[pos].1.clone(), content)));
            }
            other => {
                return Err(err(format!(
                    "{other:?} blocks are not supported in a user message"
                )))
            }
        }
    }
    results.sort_by_key(|(pos, _)| *pos);
    let mut out: Vec<Message> = results.into_iter().map(|(_, m)| m).collect();
    if !text.is_empty() || out.is_empty() {
        out.push(Message::user(text));
    }
    Ok(out)
}

/// An assistant turn: thinking, text and tool calls; and its call ids with names.
fn assistant_turn(
    k: usize,
    blocks: &[Block],
) -> Result<(Message, Vec<(String, String)>), ApiError> {
    let err = |m: &str| bad("messages", format!("messages[{k}]: {m}"));
    let mut text = String::new();
    let mut reasoning: Option<String> = None;
    let mut tc = Vec::new();
    let mut ids = Vec::new();
    for b in blocks {
        match b.kind.as_str() {
            "text" => text.push_str(b.text.as_deref().unwrap_or_default()),
            "thinking" => reasoning
                .get_or_insert_with(String::new)
                .push_str(b.thinking.as_deref().unwrap_or_default()),
            "tool_use" => {
                let name = b
                    .name
                    .clone()
                    .filter(|n| !n.is_empty())
                    .ok_or_else(|| err("a tool_use has no name"))?;
                let arguments = match &b.input {
                    None | Some(Value::Null) => Arguments::Object(serde_json::Map::new()),
                    Some(Value::Object(m)) => Arguments::Object(m.clone()),
                    Some(_) => return Err(err("a tool_use input must be an object")),
                };
                ids.push((b.id.clone().unwrap_or_default(), name.clone()));
                tc.push(ToolCall { name, arguments });
            }
            other => {
                return Err(err(&format!(
                    "{other:?} blocks are not supported in an assistant message"
                )))
            }
        }
    }
    Ok((Message::assistant_calls(text, reasoning, tc), ids))
}

/// Validate a Messages request's conversation, thinking and tools (`metadata` is accepted as it
/// comes: k3 records no user ids).
pub fn prepare(r: &MessagesRequest) -> Result<Prepared, ApiError> {
    check_fields(r)?;
    let thinking = thinking(r)?;
    let setup = tools(r)?;
    let format = output_format(r)?;
    let grammar = match (super::shape::tool_grammar(&setup), &format) {
        (Some(_), Some(_)) => {
            return Err(bad(
                "output_config",
                "output_config.format and a forced tool call exclude each other",
            ))
        }
        (g, f) => g.or_else(|| f.as_ref().map(|f| f.1.clone())),
    };
    let ToolSetup {
        specs: tools,
        choice,
        allowed,
        parallel,
        ..
    } = setup;
    let history = history(r)?;
    Ok(Prepared {
        history,
        thinking: thinking.map(|t| t.0),
        budget: thinking.map(|t| t.1),
        tools,
        choice,
        allowed,
        parallel,
        grammar,
        format: format.map(|f| f.0),
    })
}

/// `stop_reason`.
pub fn stop_reason(f: Option<Finish>) -> &'static str {
    match f {
        Some(Finish::Length) => "max_tokens",
        Some(Finish::ToolCalls) => "tool_use",
        Some(Finish::Stop) | None => "end_turn",
    }
}

/// A call's `tool_use` block.
pub fn tool_use(msg_id: &str, c: &CallOut) -> Value {
    let input: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": format!("toolu_{msg_id}_{}", c.index), "name": c.name, "input": input})
}

/// `usage`: input ids not held by a kept session, the ones that were, and the output.
pub fn usage(prompt: usize, cached: usize, output: usize) -> Value {
    json!({
        "input_tokens": prompt.saturating_sub(cached),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": output,
    })
}

/// A whole reply's `content` blocks.
pub fn content_blocks(msg_id: &str, thinking: bool, all: &Delta) -> Value {
    let mut blocks = Vec::new();
    if thinking && !all.reasoning.is_empty() {
        blocks.push(json!({"type": "thinking", "thinking": all.reasoning, "signature": ""}));
    }
    if !all.content.is_empty() {
        blocks.push(json!({"type": "text", "text": all.content}));
    }
    blocks.extend(all.calls.iter().map(|c| tool_use(msg_id, c)));
    Value::Array(blocks)
}

/// The kind of the open content block of a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockKind {
    Thinking,
    Text,
}

/// A streamed reply's content blocks: each delta's text goes to the open block of its kind,
/// opening (and closing the other) as needed; a call is a whole `tool_use` block.
#[derive(Debug, Default)]
pub struct BlockStream {
    open: Option<(usize, BlockKind)>,
    next: usize,
}

impl BlockStream {
    fn close(&mut self, out: &mut Vec<(&'static str, Value)>) {
        if let Some((index, _)) = self.open.take() {
            out.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    fn to(&mut self, kind: BlockKind, out: &mut Vec<(&'static str, Value)>) -> usize {
        match self.open {
            Some((index, k)) if k == kind => index,
            _ => {
                self.close(out);
                let index = self.next;
                self.next += 1;
                let block = match kind {
                    BlockKind::Thinking => {
                        json!({"type": "thinking", "thinking": "", "signature": ""})
                    }
                    BlockKind::Text => json!({"type": "text", "text": ""}),
                };
                out.push((
                    "content_block_start",
                    json!({"type": "content_block_start", "index": index, "content_block": block}),
                ));
                self.open = Some((index, kind));
                index
            }
        }
    }

    /// The events for one delta.
    pub fn events(&mut self, msg_id: &str, d: &Delta) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        if !d.reasoning.is_empty() {
            let index = self.to(BlockKind::Thinking, &mut out);
            out.push((
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": d.reasoning}}),
            ));
        }
        if !d.content.is_empty() {
            let index = self.to(BlockKind::Text, &mut out);
            out.push((
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": d.content}}),
            ));
        }
        for c in &d.calls {
            self.close(&mut out);
            let index = self.next;
            self.next += 1;
            let mut block = tool_use(msg_id, c);
            let input = std::mem::replace(&mut block["input"], json!({}));
            out.push((
                "content_block_start",
                json!({"type": "content_block_start", "index": index, "content_block": block}),
            ));
            out.push((
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
            ));
            out.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
        out
    }

    /// The closing events: the open block's stop, `message_delta`, `message_stop`.
    pub fn finish(
        &mut self,
        stop_reason: &str,
        stop_sequence: Option<&str>,
        usage: Value,
    ) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        self.close(&mut out);
        out.push((
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": usage}),
        ));
        out.push(("message_stop", json!({"type": "message_stop"})));
        out
    }
}

/// Anthropic's error `type` for a status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 408 | 415 | 431 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// An error in Anthropic's shape.
pub fn error_body(status: StatusCode, message: &str) -> Value {
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}

/// An [`ApiError`] in Anthropic's shape (headers kept).
pub fn error_response(e: ApiError) -> Response {
    let status = e.status;
    let body = error_body(status, &e.message);
    let mut r = e.into_response();
    *r.body_mut() = Body::from(body.to_string());
    r.headers_mut().remove(axum::http::header::CONTENT_LENGTH);
    *r.status_mut() = status;
    r
}

/// Any error response of these routes (OpenAI-shaped from the shared code) in Anthropic's
/// shape; other responses pass unchanged.
pub async fn reshape(r: Response) -> Response {
    if r.status().is_success() {
        return r;
    }
    let (mut parts, body) = r.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    let body = error_body(parts.status, &message).to_string();
    Response::from_parts(parts, Body::from(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> MessagesRequest {
        serde_json::from_value(v).unwrap()
    }

    fn base() -> Value {
        json!({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
    }

    /// Every field of Anthropic's Messages request is honoured or refused by name.
    #[test]
    fn every_anthropic_field_is_honoured_or_refused_by_name() {
        let tools = json!([{"name": "f", "input_schema": {"type": "object"}}]);
        let table: Vec<(&str, Value, bool)> = vec![
            ("model", json!("m"), true),
            (
                "messages",
                json!([{"role": "user", "content": [{"type": "text", "text": "x"}]}]),
                true,
            ),
            ("max_tokens", json!(8), true),
            ("cache_control", json!({"type": "ephemeral"}), true),
            ("container", json!("c"), false),
            ("context_management", json!({"edits": []}), false),
            ("diagnostics", json!({}), false),
            ("inference_geo", json!("us"), true),
            (
                "mcp_servers",
                json!([{"type": "url", "url": "http://x", "name": "x"}]),
                false,
            ),
            ("metadata", json!({"user_id": "u"}), true),
            (
                "output_config",
                json!({"format": {"type": "json_schema", "schema": {"type": "object"}}}),
                true,
            ),
            ("service_tier", json!("priority"), false),
            ("speed", json!("fast"), false),
            ("stop_sequences", json!(["\n\n"]), true),
            ("stream", json!(true), true),
            (
                "system",
                json!([{"type": "text", "text": "be brief"}]),
                true,
            ),
            ("temperature", json!(0.5), true),
            (
                "thinking",
                json!({"type": "enabled", "budget_tokens": 2048}),
                true,
            ),
            ("tool_choice", json!({"type": "any"}), true),
            ("tools", tools.clone(), true),
            ("top_k", json!(40), false),
            ("top_p", json!(0.9), true),
            ("user_profile_id", json!("p"), true),
            ("workspace_id", json!("w"), true),
        ];
        let listed: Vec<&str> = table.iter().map(|t| t.0).collect();
        assert_eq!(listed, ANTHROPIC_FIELDS);
        for (field, value, ok) in table {
            let mut body = base();
            body[field] = value;
            if field == "tool_choice" {
                body["tools"] = tools.clone();
            }
            if field == "thinking" {
                body["max_tokens"] = json!(4096);
            }
            let r = req(body);
            let got = prepare(&r).and_then(|_| settings(&r, 0, false).map(|_| ()));
            match got {
                Ok(()) => assert!(ok, "{field} accepted"),
                Err(e) => {
                    assert!(!ok, "{field}: {}", e.message);
                    assert_eq!(e.param, Some(field), "{field}: {}", e.message);
                }
            }
        }
        let r = req(json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}));
        assert_eq!(
            settings(&r, 0, false).unwrap_err().param,
            Some("max_tokens")
        );
        assert!(
            settings(&r, 0, true).is_ok(),
            "count_tokens needs no max_tokens"
        );
    }

    #[test]
    fn a_tool_loop_becomes_calls_and_results_in_call_order() {
        let r = req(
            json!({"model": "m", "max_tokens": 64, "system": "S", "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "plan", "signature": "x"},
                {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "t1", "name": "a", "input": {"x": 1}},
                {"type": "tool_use", "id": "t2", "name": "b", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t2", "content": "B"},
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "A"}], "is_error": true},
                {"type": "text", "text": "next?"},
            ]},
        ], "tools": [{"name": "a", "input_schema": {"type": "object"}}, {"name": "b"}],
           "tool_choice": {"type": "auto", "disable_parallel_tool_use": true}}),
        );
        let p = prepare(&r).unwrap();
        assert!(p.thinking.is_none(), "thinking is off unless enabled");
        assert!(!p.parallel);
        assert_eq!(p.allowed, vec!["a".to_string(), "b".to_string()]);
        let h = &p.history;
        assert_eq!(h[0], Message::system("S"));
        assert_eq!(h[2].tool_calls.len(), 2);
        assert_eq!(h[2].reasoning.as_deref(), Some("plan"));
        assert_eq!(
            (h[3].tool.as_deref(), h[3].content.as_str()),
            (Some("a"), "A")
        );
        assert_eq!(
            (h[4].tool.as_deref(), h[4].content.as_str()),
            (Some("b"), "B")
        );
        assert_eq!(h[5], Message::user("next?"));
        for bad_msgs in [
            json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "zz", "content": "x"}]}]),
            json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            json!([{"role": "system", "content": "x"}]),
            json!([]),
        ] {
            let mut b = base();
            b["messages"] = bad_msgs.clone();
            assert_eq!(
                prepare(&req(b)).unwrap_err().param,
                Some("messages"),
                "{bad_msgs}"
            );
        }
    }

    #[test]
    fn stream_blocks_open_close_and_carry_calls() {
        let mut s = BlockStream::default();
        fn names(ev: &[(&'static str, Value)]) -> Vec<&'static str> {
            ev.iter().map(|e| e.0).collect()
        }
        let e = s.events(
            "m",
            &Delta {
                reasoning: "hm".into(),
                ..Delta::default()
            },
        );
        assert_eq!(names(&e), ["content_block_start", "content_block_delta"]);
        assert_eq!(e[1].1["delta"]["type"], "thinking_delta");
        let e = s.events(
            "m",
            &Delta {
                reasoning: "m".into(),
                ..Delta::default()
            },
        );
        assert_eq!(names(&e), ["content_block_delta"]);
        let e = s.events(
            "m",
            &Delta {
                content: "Hi".into(),
                calls: vec![CallOut {
                    index: 0,
                    name: "f".into(),
                    arguments: r#"{"x":1}"#.into(),
                }],
                ..Delta::default()
            },
        );
        assert_eq!(
            names(&e),
            [
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop"
            ]
        );
        assert_eq!(e[1].1["index"], 1);
        assert_eq!(e[4].1["content_block"]["type"], "tool_use");
        assert_eq!(e[4].1["content_block"]["input"], json!({}));
        assert_eq!(e[5].1["delta"]["partial_json"], r#"{"x":1}"#);
        let e = s.finish("tool_use", None, usage(10, 4, 3));
        assert_eq!(names(&e), ["message_delta", "message_stop"]);
        assert_eq!(e[0].1["usage"]["input_tokens"], 6);
        assert_eq!(e[0].1["usage"]["cache_read_input_tokens"], 4);
    }

    #[test]
    fn errors_take_anthropics_types() {
        assert_eq!(error_type(StatusCode::BAD_REQUEST), "invalid_request_error");
        assert_eq!(error_type(StatusCode::UNAUTHORIZED), "authentication_error");
        assert_eq!(
            error_type(StatusCode::TOO_MANY_REQUESTS),
            "rate_limit_error"
        );
        assert_eq!(
            error_type(StatusCode::SERVICE_UNAVAILABLE),
            "overloaded_error"
        );
        assert_eq!(error_type(StatusCode::INTERNAL_SERVER_ERROR), "api_error");
        assert_eq!(
            error_body(StatusCode::NOT_FOUND, "x"),
            json!({"type": "error", "error": {"type": "not_found_error", "message": "x"}})
        );
    }
}
