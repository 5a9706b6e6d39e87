//! Multi-turn chat in Kimi K3's XTML format (SPEC.md §5.5), with the sequence state kept
//! between turns.
//!
//! * [`ChatFormat`] renders a conversation to ids: the four structural markers (`<|open|>`,
//!   `<|close|>`, `<|sep|>`, `<|end_of_msg|>`) are control ids looked up in the tokenizer;
//!   everything else (tag names, attributes, contents) is ordinary text encoded with specials
//!   disabled, so a user-typed `<|open|>` stays bytes. Attribute values are escaped. A tag's name
//!   and each attribute's ` key`, `="`, value and `"` are encoded separately, as the release
//!   does; contents are one segment each. BPE merges never run across a segment.
//!   Tool declarations, calls and results are rendered by [`crate::text::tools`].
//! * [`ReplyParser`] splits the model's reply at the markers into the think and response
//!   channels, and stops on `[EOS]` (163585) or `<|end_of_msg|>` (163586) (SPEC.md I34).
//! * [`Session`] runs turns. The [`SeqState`] persists: a turn prefills only the ids after those
//!   the state already holds, after checking that the rendered conversation starts with exactly
//!   those ids ([`plan_prefill`]); when it does not, the whole conversation is prefilled again.
//!   A reply the model produced is kept in the history with the model's own ids for its channel
//!   contents, so the next render reproduces what the state holds (re-encoding the decoded text
//!   can split it differently, which would both change what the model conditioned on and defeat
//!   the reuse).
//! * [`run_repl`] is the line-by-line loop behind `k3-worker --chat`.
//!
//! `thinking_effort` values: `low`, `medium`, `high`, `max`. `medium` is disputed (SPEC.md §10
//! C4: the prompt text lists it, one report says the checkpoint's `encoding_k3.py` refuses it);
//! it is accepted here because the effort body itself names it.

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::generate::{self, positions_needed, Flow, GenOptions, Sampler, END_IDS};
use crate::model::{Model, ModelError};
use crate::text::tools::{self, ChoiceNote, FormatNote, Piece, RenderError, ToolCall, ToolSpec};
pub use crate::text::tools::{escape_attr, Markers};
use crate::tokenizer::Tokenizer;

/// What a request adds around its history (SPEC.md §5.5 "Tools").
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Declared tools (a `tool-declare` system message before everything else).
    pub tools: Vec<ToolSpec>,
    /// `tool_choice` `required`/`none` (a `tool-choice` note after the history).
    pub choice: Option<ChoiceNote>,
    /// `response_format` (a `response-format` note after the history).
    pub format: Option<FormatNote>,
}

/// How much the model is asked to think (thinking on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effort {
    /// `low`.
    Low,
    /// `medium` (disputed, SPEC.md §10 C4).
    Medium,
    /// `high`.
    High,
    /// `max` (the default).
    Max,
}

impl Effort {
    /// Every accepted value, in the order the effort body lists them.
    pub const ALL: [Effort; 4] = [Effort::Low, Effort::Medium, Effort::High, Effort::Max];

    /// The name used in the system message.
    pub fn as_str(self) -> &'static str {
        match self {
            Effort::Low => "low",
            Effort::Medium => "medium",
            Effort::High => "high",
            Effort::Max => "max",
        }
    }

    /// Parse `low|medium|high|max`.
    pub fn parse(s: &str) -> Result<Effort, UnknownEffort> {
        Effort::ALL
            .into_iter()
            .find(|e| e.as_str() == s)
            .ok_or_else(|| UnknownEffort(s.to_string()))
    }
}

/// A thinking effort that is not one of [`Effort::ALL`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown thinking effort {0:?} (low, medium, high, max)")]
pub struct UnknownEffort(pub String);

/// A chat marker the tokenizer does not have (a refusal before any work).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the tokenizer has no added token {0} (needed for --chat)")]
pub struct MissingMarker(pub &'static str);

/// The body of the leading thinking-effort system message, byte-exact (SPEC.md §5.5).
pub fn effort_body(effort: Effort) -> String {
    format!(
        "`thinking_effort` guides on how much to think in your thinking channel (not including the \
         response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the \
         system is invoked with `thinking_effort={}`.",
        effort.as_str()
    )
}

/// The text between `<|open|>` and `<|sep|>`: `NAME k1="v1" k2="v2"` with escaped values (as
/// one string; the renderer encodes its parts separately).
pub fn tag_text(name: &str, attrs: &[(&str, &str)]) -> String {
    let mut s = name.to_string();
    for (k, v) in attrs {
        s.push_str(&format!(" {k}=\"{}\"", escape_attr(v)));
    }
    s
}

/// Who wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// `system`.
    System,
    /// `user`.
    User,
    /// `assistant`.
    Assistant,
    /// `tool`: a tool's result ([`Message::tool`] names the tool).
    Tool,
}

impl Role {
    /// The `role` attribute value.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// An assistant reply's channel contents as the model produced them.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplyIds {
    /// Ids of the think channel's contents.
    pub think: Vec<u32>,
    /// Ids of the response channel's contents.
    pub response: Vec<u32>,
}

/// One message of a conversation (kept sessions carry the history as JSON of this shape).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// Author.
    pub role: Role,
    /// Text (the response channel for an assistant).
    pub content: String,
    /// An assistant's reasoning (think channel); rendered only with thinking on.
    pub reasoning: Option<String>,
    /// For a reply the model produced: its own ids for the channel contents, rendered instead of
    /// re-encoding `content`/`reasoning` (they decode to the same bytes).
    pub ids: Option<ReplyIds>,
    /// An assistant's tool calls (its `tools` element, SPEC.md §5.5).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool result's tool name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// The author's name (a `name` attribute after `role`; not on tool results).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A system message.
    pub fn system(content: impl Into<String>) -> Message {
        Message::text(Role::System, content.into(), None)
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Message {
        Message::text(Role::User, content.into(), None)
    }

    /// An assistant message given as text.
    pub fn assistant(content: impl Into<String>, reasoning: Option<String>) -> Message {
        Message::text(Role::Assistant, content.into(), reasoning)
    }

    /// An assistant message with tool calls.
    pub fn assistant_calls(
        content: impl Into<String>,
        reasoning: Option<String>,
        tool_calls: Vec<ToolCall>,
    ) -> Message {
        Message {
            tool_calls,
            ..Message::text(Role::Assistant, content.into(), reasoning)
        }
    }

    /// A tool's result.
    pub fn tool(tool: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            tool: Some(tool.into()),
            ..Message::text(Role::Tool, content.into(), None)
        }
    }

    fn text(role: Role, content: String, reasoning: Option<String>) -> Message {
        Message {
            role,
            content,
            reasoning,
            ids: None,
            tool_calls: Vec::new(),
            tool: None,
            name: None,
        }
    }

    /// The assistant message for a parsed reply, keeping the model's ids.
    pub fn from_reply(r: &Reply) -> Message {
        Message {
            role: Role::Assistant,
            content: r.response.clone(),
            reasoning: r.think.clone(),
            ids: Some(ReplyIds {
                think: r.think_ids.clone(),
                response: r.response_ids.clone(),
            }),
            tool_calls: Vec::new(),
            tool: None,
            name: None,
        }
    }
}

impl Markers {
    /// Look the markers up in the tokenizer's added tokens.
    pub fn from_tokenizer(tok: &Tokenizer) -> Result<Markers, MissingMarker> {
        let get = |s: &'static str| tok.special_id(s).ok_or(MissingMarker(s));
        Ok(Markers {
            open: get("<|open|>")?,
            close: get("<|close|>")?,
            sep: get("<|sep|>")?,
            end_of_msg: get("<|end_of_msg|>")?,
        })
    }
}

/// Builds an id sequence: markers as ids, text accumulated and encoded (specials disabled) when
/// the next marker or verbatim ids arrive.
struct Emitter<'t> {
    tok: &'t Tokenizer,
    out: Vec<u32>,
    text: String,
}

impl Emitter<'_> {
    fn flush(&mut self) {
        if !self.text.is_empty() {
            self.out.extend(self.tok.encode(&self.text));
            self.text.clear();
        }
    }

    fn mark(&mut self, id: u32) {
        self.flush();
        self.out.push(id);
    }

    fn text(&mut self, s: &str) {
        self.text.push_str(s);
    }

    /// `s` encoded on its own, never merged with the text around it.
    fn segment(&mut self, s: &str) {
        self.flush();
        self.text.push_str(s);
        self.flush();
    }

    fn ids(&mut self, ids: &[u32]) {
        self.flush();
        self.out.extend_from_slice(ids);
    }

    fn finish(mut self) -> Vec<u32> {
        self.flush();
        self.out
    }
}

/// The XTML renderer for one tokenizer and thinking setting.
#[derive(Clone, Copy, Debug)]
pub struct ChatFormat<'t> {
    tok: &'t Tokenizer,
    /// The control ids.
    pub markers: Markers,
    /// `Some(effort)` = thinking on; `None` = off.
    pub thinking: Option<Effort>,
}

impl<'t> ChatFormat<'t> {
    /// A renderer; fails when the tokenizer lacks a marker.
    pub fn new(
        tok: &'t Tokenizer,
        thinking: Option<Effort>,
    ) -> Result<ChatFormat<'t>, MissingMarker> {
        Ok(ChatFormat {
            tok,
            markers: Markers::from_tokenizer(tok)?,
            thinking,
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &'t Tokenizer {
        self.tok
    }

    fn emitter(&self) -> Emitter<'t> {
        Emitter {
            tok: self.tok,
            out: Vec::new(),
            text: String::new(),
        }
    }

    /// `<|open|>NAME k="v"…<|sep|>` (values escaped). The name, and each attribute's ` k`,
    /// `="`, value and `"`, are encoded as separate segments, as the release does.
    fn open(&self, e: &mut Emitter<'_>, name: &str, attrs: &[(&str, &str)]) {
        e.mark(self.markers.open);
        e.segment(name);
        for (k, v) in attrs {
            e.segment(&format!(" {k}"));
            e.segment("=\"");
            e.segment(&escape_attr(v));
            e.segment("\"");
        }
        e.mark(self.markers.sep);
    }

    /// Rendered [`Piece`]s (SPEC.md §5.5 "Tools").
    fn pieces(&self, e: &mut Emitter<'_>, pieces: &[Piece]) {
        for p in pieces {
            match p {
                Piece::Open(tag, attrs) => {
                    let attrs: Vec<(&str, &str)> =
                        attrs.iter().map(|(k, v)| (*k, v.as_str())).collect();
                    self.open(e, tag, &attrs);
                }
                Piece::Close(tag) => self.close(e, tag),
                Piece::Text(t) => e.segment(t),
                Piece::EndOfMsg => e.mark(self.markers.end_of_msg),
            }
        }
    }

    /// `<|close|>NAME<|sep|>`.
    fn close(&self, e: &mut Emitter<'_>, name: &str) {
        e.mark(self.markers.close);
        e.text(name);
        e.mark(self.markers.sep);
    }

    /// One channel (`think`/`response`) with its contents as ids or text.
    fn channel(&self, e: &mut Emitter<'_>, name: &str, ids: Option<&[u32]>, text: &str) {
        self.open(e, name, &[]);
        match ids {
            Some(ids) => e.ids(ids),
            None => e.text(text),
        }
        self.close(e, name);
    }

    fn message(
        &self,
        e: &mut Emitter<'_>,
        m: &Message,
        tool_index: usize,
    ) -> Result<(), RenderError> {
        if m.role == Role::Tool {
            let name = m.tool.as_deref().unwrap_or_default();
            if name.is_empty() {
                return Err(RenderError::EmptyName);
            }
            self.pieces(e, &tools::result(name, tool_index, &m.content));
            return Ok(());
        }
        match &m.name {
            Some(name) if !name.is_empty() => {
                self.open(e, "message", &[("role", m.role.as_str()), ("name", name)]);
            }
            _ => self.open(e, "message", &[("role", m.role.as_str())]),
        }
        match m.role {
            Role::System | Role::User | Role::Tool => e.text(&m.content),
            Role::Assistant => {
                if self.thinking.is_some() {
                    let ids = m.ids.as_ref().map(|r| r.think.as_slice());
                    let text = m.reasoning.as_deref().unwrap_or("");
                    self.channel(e, "think", ids, text);
                }
                let ids = m.ids.as_ref().map(|r| r.response.as_slice());
                self.channel(e, "response", ids, &m.content);
                self.pieces(e, &tools::calls(&m.tool_calls)?);
            }
        }
        self.close(e, "message");
        e.mark(self.markers.end_of_msg);
        Ok(())
    }

    /// The ids of a conversation: the effort system message (thinking on), every message, and
    /// with `generation_prompt` the opening of the assistant's reply.
    pub fn render(&self, history: &[Message], generation_prompt: bool) -> Vec<u32> {
        // Without tool messages or options nothing can be refused.
        self.render_with(history, &Options::default(), generation_prompt)
            .unwrap_or_default()
    }

    /// [`ChatFormat::render`] with a request's tools and options: the `tool-declare` message
    /// first, the `tool-choice`/`response-format` notes after the history (SPEC.md §5.5).
    /// Refused: a tool call or tool result without a name.
    pub fn render_with(
        &self,
        history: &[Message],
        opts: &Options,
        generation_prompt: bool,
    ) -> Result<Vec<u32>, RenderError> {
        let mut e = self.emitter();
        self.pieces(&mut e, &tools::declare(&opts.tools));
        if let Some(effort) = self.thinking {
            self.open(
                &mut e,
                "message",
                &[("role", "system"), ("type", "thinking-effort")],
            );
            e.text(&effort_body(effort));
            self.close(&mut e, "message");
            e.mark(self.markers.end_of_msg);
        }
        // A tool result's index counts the results since the last assistant message.
        let mut tool_index = 0;
        for m in history {
            tool_index = match m.role {
                Role::Tool => tool_index + 1,
                Role::Assistant => 0,
                _ => tool_index,
            };
            self.message(&mut e, m, tool_index)?;
        }
        if let Some(c) = opts.choice {
            self.pieces(&mut e, &tools::choice_note(c));
        }
        if let Some(f) = &opts.format {
            self.pieces(&mut e, &tools::format_note(f));
        }
        if generation_prompt {
            self.open(&mut e, "message", &[("role", "assistant")]);
            let channel = if self.thinking.is_some() {
                "think"
            } else {
                "response"
            };
            self.open(&mut e, channel, &[]);
        }
        Ok(e.finish())
    }

    /// A parser for the reply that follows [`ChatFormat::render`]'s generation prompt.
    pub fn parser(&self) -> ReplyParser {
        ReplyParser::new(self.markers, self.thinking.is_some())
    }
}

/// Where a reply id landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    /// The think channel's contents.
    Think,
    /// The response channel's contents.
    Response,
    /// Structure (markers, tag names) or text outside both channels.
    Structure,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ParseState {
    /// Inside the contents of `channel`.
    Body,
    /// After `<|open|>`, collecting the tag until `<|sep|>`.
    Open,
    /// After `<|close|>`, collecting the tag until `<|sep|>`.
    Close,
    /// An end id arrived.
    Done,
}

/// A parsed reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// Every generated id, including a final end id.
    pub ids: Vec<u32>,
    /// Ids of the think channel's contents.
    pub think_ids: Vec<u32>,
    /// Ids of the response channel's contents.
    pub response_ids: Vec<u32>,
    /// Think text (`Some` when thinking was on or the model opened a think channel).
    pub think: Option<String>,
    /// Response text.
    pub response: String,
    /// The end id that stopped the reply (`None`: the token limit was reached).
    pub stopped_on: Option<u32>,
}

/// Incremental parser of a reply, id by id (SPEC.md §5.5: reasoning, `<|close|>think<|sep|>
/// <|open|>response<|sep|>`, answer, `<|close|>response<|sep|><|close|>message<|sep|>`, end id).
#[derive(Clone, Debug)]
pub struct ReplyParser {
    m: Markers,
    state: ParseState,
    channel: Channel,
    tag: Vec<u32>,
    saw_think: bool,
    ids: Vec<u32>,
    think: Vec<u32>,
    response: Vec<u32>,
    stopped_on: Option<u32>,
}

impl ReplyParser {
    /// A parser starting inside the think channel (thinking on) or the response channel.
    pub fn new(m: Markers, thinking: bool) -> ReplyParser {
        ReplyParser {
            m,
            state: ParseState::Body,
            channel: if thinking {
                Channel::Think
            } else {
                Channel::Response
            },
            tag: Vec::new(),
            saw_think: thinking,
            ids: Vec::new(),
            think: Vec::new(),
            response: Vec::new(),
            stopped_on: None,
        }
    }

    /// True once an end id arrived.
    pub fn done(&self) -> bool {
        self.state == ParseState::Done
    }

    /// Feed one id; returns the channel it belongs to (`Think`/`Response` for contents).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Channel {
        if self.state == ParseState::Done {
            return Channel::Structure;
        }
        self.ids.push(id);
        if END_IDS.contains(&id) {
            self.state = ParseState::Done;
            self.stopped_on = Some(id);
            return Channel::Structure;
        }
        match self.state {
            ParseState::Body if id == self.m.open => {
                self.state = ParseState::Open;
                self.tag.clear();
            }
            ParseState::Body if id == self.m.close => {
                self.state = ParseState::Close;
                self.tag.clear();
            }
            ParseState::Body if id == self.m.sep => {} // stray separator: structure
            ParseState::Body => match self.channel {
                Channel::Think => {
                    self.think.push(id);
                    return Channel::Think;
                }
                Channel::Response => {
                    self.response.push(id);
                    return Channel::Response;
                }
                Channel::Structure => {}
            },
            ParseState::Open | ParseState::Close if id == self.m.sep => {
                let opened = self.state == ParseState::Open;
                let tag = tok.decode(&self.tag).unwrap_or_default();
                let name = tag.split(|&b| b == b' ').next().unwrap_or(&[]);
                self.channel = match (opened, name) {
                    (true, b"think") => {
                        self.saw_think = true;
                        Channel::Think
                    }
                    (true, b"response") => Channel::Response,
                    _ => Channel::Structure,
                };
                self.state = ParseState::Body;
            }
            ParseState::Open | ParseState::Close => self.tag.push(id),
            ParseState::Done => unreachable!("handled above"),
        }
        Channel::Structure
    }

    /// The reply so far.
    pub fn finish(&self, tok: &Tokenizer) -> Reply {
        let text = |ids: &[u32]| {
            String::from_utf8_lossy(&tok.decode(ids).unwrap_or_default()).into_owned()
        };
        Reply {
            ids: self.ids.clone(),
            think: self.saw_think.then(|| text(&self.think)),
            response: text(&self.response),
            think_ids: self.think.clone(),
            response_ids: self.response.clone(),
            stopped_on: self.stopped_on,
        }
    }
}

/// How a turn's prompt reaches the state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefill {
    /// The state's ids are a strict prefix of the conversation: feed `conversation[from..]`.
    Reuse {
        /// Ids already in the state.
        from: usize,
    },
    /// The state does not match: start a fresh state and feed the whole conversation.
    Restart,
}

/// Decide how to prefill `conversation` given the ids `held` by the state.
pub fn plan_prefill(held: &[u32], conversation: &[u32]) -> Prefill {
    if !held.is_empty() && conversation.len() > held.len() && conversation.starts_with(held) {
        Prefill::Reuse { from: held.len() }
    } else {
        Prefill::Restart
    }
}

/// Why a turn did not run.
#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    /// The turn would overflow the context; the session is unchanged.
    #[error("turn refused: the conversation is {conversation} tokens and up to {max_new} more may be generated, which exceeds the context of {capacity} positions (raise --ctx or start a new session)")]
    Overflow {
        /// Ids of the rendered conversation with the generation prompt.
        conversation: usize,
        /// Requested generation limit.
        max_new: usize,
        /// The state's capacity.
        capacity: usize,
    },
    /// The forward pass failed (the state is reset before the next turn).
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// Per-turn settings.
#[derive(Clone, Debug)]
pub struct TurnOptions {
    /// Most ids generated in a turn (≥ 1).
    pub max_new: usize,
    /// Prefill in forward calls of at most this many ids (0 = all at once).
    pub prefill_chunk: usize,
    /// Speculative decoding (needs a drafter: [`Session::set_drafter`]).
    pub spec: crate::spec::SpecMode,
}

/// What one turn did.
#[derive(Clone, Debug)]
pub struct TurnReport {
    /// The parsed reply.
    pub reply: Reply,
    /// Ids of the rendered conversation (with the generation prompt).
    pub conversation_len: usize,
    /// Ids reused from the state (0 on the first turn or a restart).
    pub reused: usize,
    /// Ids prefilled this turn.
    pub prefilled: usize,
    /// True when the state held ids that did not prefix the conversation (re-prefilled).
    pub restarted: bool,
    /// Seconds of the prefill forward(s) plus the first pick.
    pub prefill_seconds: f64,
    /// Seconds of each later decode step.
    pub decode_seconds: Vec<f64>,
}

impl TurnReport {
    /// Mean seconds per generated id after the first (None when only one was generated).
    pub fn seconds_per_token(&self) -> Option<f64> {
        let d = &self.decode_seconds;
        (!d.is_empty()).then(|| d.iter().sum::<f64>() / d.len() as f64)
    }
}

/// A conversation with its persisted sequence state: the history plus one
/// [`generate::Session`], whose loop runs every turn.
#[derive(Debug)]
pub struct Session {
    /// The messages so far (the thinking-effort system message is implicit).
    pub history: Vec<Message>,
    seq: generate::Session,
}

impl Session {
    /// An empty conversation with a state of `capacity` positions.
    pub fn new(model: &Model<'_>, capacity: usize, sampler: Sampler) -> Session {
        Session {
            history: Vec::new(),
            seq: generate::Session::new(model, capacity, sampler),
        }
    }

    /// Draft with `drafter` when the turn options enable speculation.
    pub fn set_drafter(&mut self, drafter: Box<dyn crate::spec::Drafter>) {
        self.seq.set_drafter(drafter);
    }

    /// A session that starts from `history` (nothing in the state yet).
    pub fn with_history(
        model: &Model<'_>,
        capacity: usize,
        sampler: Sampler,
        history: Vec<Message>,
    ) -> Session {
        Session {
            history,
            ..Session::new(model, capacity, sampler)
        }
    }

    /// A conversation resumed from a kept session: its history and its restored sequence.
    pub fn from_parts(history: Vec<Message>, seq: generate::Session) -> Session {
        Session { history, seq }
    }

    /// The sequence (state and held ids), to keep it as a session.
    pub fn seq(&self) -> &generate::Session {
        &self.seq
    }

    /// The ids the state holds.
    pub fn held(&self) -> &[u32] {
        self.seq.held()
    }

    /// Positions the state was sized for.
    pub fn capacity(&self) -> usize {
        self.seq.capacity()
    }

    /// One turn: append `user`, prefill what the state lacks, generate up to `max_new` ids,
    /// append the reply to the history. `on_id` sees each generated id with its channel;
    /// [`Flow::Stop`] ends the reply after that id (it is kept as it is, like a reply cut by
    /// `max_new`).
    pub fn turn(
        &mut self,
        model: &mut Model<'_>,
        fmt: &ChatFormat<'_>,
        user: &str,
        opts: &TurnOptions,
        on_id: &mut dyn FnMut(Channel, u32) -> Flow,
    ) -> Result<TurnReport, TurnError> {
        self.history.push(Message::user(user));
        let conversation = fmt.render(&self.history, true);
        let capacity = self.seq.capacity();
        if opts.max_new == 0 || positions_needed(conversation.len(), opts.max_new) > capacity {
            self.history.pop();
            return Err(TurnError::Overflow {
                conversation: conversation.len(),
                max_new: opts.max_new,
                capacity,
            });
        }
        let result = self.run(model, fmt, &conversation, opts, on_id);
        match &result {
            Ok(r) => self.history.push(Message::from_reply(&r.reply)),
            Err(_) => {
                // The state is unusable after a failed forward: the next turn starts afresh.
                self.history.pop();
                self.seq = generate::Session::new(model, capacity, self.seq_sampler());
            }
        }
        result
    }

    fn seq_sampler(&self) -> Sampler {
        self.seq.sampler().clone()
    }

    fn run(
        &mut self,
        model: &mut Model<'_>,
        fmt: &ChatFormat<'_>,
        conversation: &[u32],
        opts: &TurnOptions,
        on_id: &mut dyn FnMut(Channel, u32) -> Flow,
    ) -> Result<TurnReport, TurnError> {
        let plan = if self.seq.is_valid() {
            plan_prefill(self.seq.held(), conversation)
        } else {
            Prefill::Restart
        };
        let restarted = plan == Prefill::Restart && !self.seq.held().is_empty();
        let from = match plan {
            Prefill::Reuse { from } => from,
            Prefill::Restart => {
                self.seq.reset(model);
                0
            }
        };
        let new = &conversation[from..];
        let tok = fmt.tokenizer();
        let mut parser = fmt.parser();
        let gen = GenOptions {
            max_new: opts.max_new,
            full_recompute: false,
            sampler: Sampler::Greedy, // unused: the session's own sampler picks
            stop_ids: END_IDS.to_vec(),
            keep_step0_logits: false,
            prefill_chunk: opts.prefill_chunk,
            spec: opts.spec,
        };
        let report = self.seq.generate(model, new, &gen, &mut |s| {
            let channel = parser.push(tok, s.token);
            let asked = on_id(channel, s.token);
            if parser.done() || asked == Flow::Stop {
                Flow::Stop
            } else {
                Flow::Continue
            }
        })?;
        Ok(TurnReport {
            reply: parser.finish(tok),
            conversation_len: conversation.len(),
            reused: from,
            prefilled: new.len(),
            restarted,
            prefill_seconds: report.prefill_seconds(),
            decode_seconds: report.steps.iter().skip(1).map(|s| s.seconds).collect(),
        })
    }
}

/// Longest user line accepted, in bytes.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// One line of input.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// The line without its terminator.
    Text(Vec<u8>),
    /// The line exceeded the limit (the rest of it was discarded).
    TooLong,
}

/// Read one `\n`-terminated line of at most `limit` bytes (`None` at end of input).
pub fn read_line_bounded(input: &mut dyn BufRead, limit: usize) -> std::io::Result<Option<Line>> {
    let mut line = Vec::new();
    let mut too_long = false;
    let mut any = false;
    loop {
        let buf = match input.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            break;
        }
        any = true;
        let (take, end) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i, true),
            None => (buf.len(), false),
        };
        if !too_long {
            if line.len() + take > limit {
                too_long = true;
                line = Vec::new();
            } else {
                line.extend_from_slice(&buf[..take]);
            }
        }
        input.consume(take + usize::from(end));
        if end {
            break;
        }
    }
    if !any {
        return Ok(None);
    }
    if too_long {
        return Ok(Some(Line::TooLong));
    }
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    Ok(Some(Line::Text(line)))
}

/// Where the chat loop's lines come from, and its Ctrl-C.
///
/// [`ReplInput::stdin_with_ctrl_c`] reads stdin on a thread of its own and catches SIGINT into a
/// flag, so that a Ctrl-C is seen both while a reply is written (the loop stops that reply at
/// its next token) and while the loop waits for a line (a blocking read would not return for
/// it). [`ReplInput::reader`] reads a `BufRead` in place and knows no Ctrl-C.
pub struct ReplInput<'a> {
    src: InputSrc<'a>,
    interrupted: Option<Arc<AtomicBool>>,
}

enum InputSrc<'a> {
    Reader(&'a mut dyn BufRead),
    Thread(std::sync::mpsc::Receiver<std::io::Result<Option<Line>>>),
}

/// What [`ReplInput::read`] got.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// A line.
    Line(Line),
    /// End of input.
    End,
    /// Ctrl-C while waiting for a line.
    Interrupt,
}

/// How often a wait for a line looks at the Ctrl-C flag.
const INTERRUPT_POLL: std::time::Duration = std::time::Duration::from_millis(50);

impl<'a> ReplInput<'a> {
    /// Lines from `r`; no Ctrl-C handling.
    pub fn reader(r: &'a mut dyn BufRead) -> ReplInput<'a> {
        ReplInput {
            src: InputSrc::Reader(r),
            interrupted: None,
        }
    }

    /// Lines from `rx` (sent by a reader thread) and Ctrl-C from `interrupted` (set by a
    /// signal handler or a test).
    pub fn channel(
        rx: std::sync::mpsc::Receiver<std::io::Result<Option<Line>>>,
        interrupted: Arc<AtomicBool>,
    ) -> ReplInput<'static> {
        ReplInput {
            src: InputSrc::Thread(rx),
            interrupted: Some(interrupted),
        }
    }

    /// Stdin, read on a thread, with SIGINT caught (from now on, for the rest of the process)
    /// as the loop's Ctrl-C.
    pub fn stdin_with_ctrl_c() -> std::io::Result<ReplInput<'static>> {
        let interrupted = Arc::new(AtomicBool::new(false));
        signal_hook::flag::register(signal_hook::consts::SIGINT, interrupted.clone())?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("chat-stdin".into())
            .spawn(move || {
                let stdin = std::io::stdin();
                let mut lock = stdin.lock();
                loop {
                    let r = read_line_bounded(&mut lock, MAX_LINE_BYTES);
                    let more = matches!(r, Ok(Some(_)));
                    if tx.send(r).is_err() || !more {
                        break;
                    }
                }
            })?;
        Ok(ReplInput::channel(rx, interrupted))
    }

    /// Whether Ctrl-C was pressed since the last look (clears it).
    pub fn take_interrupt(&self) -> bool {
        (self.interrupted.as_ref()).is_some_and(|f| f.swap(false, Ordering::SeqCst))
    }

    /// The next line, end of input, or a Ctrl-C that came first.
    pub fn read(&mut self) -> std::io::Result<Next> {
        let rx = match &mut self.src {
            InputSrc::Reader(r) => {
                return Ok(read_line_bounded(*r, MAX_LINE_BYTES)?.map_or(Next::End, Next::Line))
            }
            InputSrc::Thread(rx) => rx,
        };
        loop {
            if (self.interrupted.as_ref()).is_some_and(|f| f.swap(false, Ordering::SeqCst)) {
                return Ok(Next::Interrupt);
            }
            match rx.recv_timeout(INTERRUPT_POLL) {
                Ok(r) => return Ok(r?.map_or(Next::End, Next::Line)),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(Next::End),
            }
        }
    }
}

/// What the chat loop prints at the first Ctrl-C at its prompt.
pub const CTRL_C_HINT: &str = "(Ctrl-C again to leave; or type a message)";

/// Settings of the line-by-line loop.
#[derive(Clone, Debug)]
pub struct ReplOptions {
    /// Per-turn settings.
    pub turn: TurnOptions,
    /// Show a `> ` prompt (stdin is a terminal): on `out`, where the replies are read, when
    /// `prompt_on_out`, else on `err`.
    pub prompt: bool,
    /// Write the prompt to `out` (stdout is a terminal) rather than to `err`.
    pub prompt_on_out: bool,
    /// Dim the think text with ANSI escapes (stderr is a terminal); otherwise it is prefixed.
    pub dim_think: bool,
}

/// One turn that ran, for `--out`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TurnRecord {
    /// The rendered conversation's ids (with the generation prompt).
    pub conversation_ids: Vec<u32>,
    /// Ids reused from the state.
    pub reused: usize,
    /// Ids prefilled this turn.
    pub prefilled: usize,
    /// True when the state did not match and the whole conversation was prefilled.
    pub restarted: bool,
    /// The reply's ids (including a final end id).
    pub generated_ids: Vec<u32>,
    /// Seconds of the prefill and the first pick.
    pub prefill_seconds: f64,
}

/// What a whole session did.
#[derive(Clone, Debug, Default)]
pub struct ReplSummary {
    /// Turns that ran.
    pub turns: usize,
    /// Turns refused (overflow, bad input).
    pub refused: usize,
    /// Every turn that ran.
    pub records: Vec<TurnRecord>,
}

/// Why the chat loop stopped early.
#[derive(Debug, thiserror::Error)]
pub enum ReplError {
    /// The forward pass failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Reading stdin or writing the reply failed.
    #[error("chat I/O")]
    Io(#[from] std::io::Error),
}

/// Read user turns from `input` until end of input; the response goes to `out`, the think text
/// and the per-turn report to `err`; `after_turn` sees the session after each turn that ran (to
/// keep it in the store). Returns on end of input, on a second Ctrl-C at the prompt (the first
/// prints [`CTRL_C_HINT`]), or on a forward/I/O failure. A Ctrl-C while a reply is written
/// stops that reply at its next token; the partial reply stays in the conversation (as a reply
/// cut by `--gen` does) and the loop reads the next turn.
#[allow(clippy::too_many_arguments)]
pub fn run_repl(
    model: &mut Model<'_>,
    fmt: &ChatFormat<'_>,
    session: &mut Session,
    input: &mut ReplInput<'_>,
    out: &mut dyn Write,
    err: &mut dyn Write,
    opts: &ReplOptions,
    after_turn: &mut dyn FnMut(&Session, &mut dyn Write),
) -> Result<ReplSummary, ReplError> {
    let mut summary = ReplSummary::default();
    let tok = fmt.tokenizer();
    // A first Ctrl-C at the prompt arms this; a second one leaves; a line disarms it.
    let mut leaving = false;
    loop {
        if opts.prompt {
            let w: &mut dyn Write = if opts.prompt_on_out { out } else { err };
            let _ = write!(w, "> ");
            let _ = w.flush();
        }
        let line = match input.read()? {
            Next::End => {
                if opts.prompt {
                    let _ = writeln!(err);
                }
                break;
            }
            Next::Interrupt if leaving => {
                let _ = writeln!(err);
                break;
            }
            Next::Interrupt => {
                leaving = true;
                let _ = writeln!(err, "\n{CTRL_C_HINT}");
                continue;
            }
            Next::Line(l) => {
                leaving = false;
                l
            }
        };
        let line = match line {
            Line::TooLong => {
                let _ = writeln!(err, "turn refused: the line exceeds {MAX_LINE_BYTES} bytes");
                summary.refused += 1;
                continue;
            }
            Line::Text(l) => l,
        };
        let text = match String::from_utf8(line) {
            Ok(t) => t,
            Err(e) => {
                let _ = writeln!(
                    err,
                    "turn refused: the line is not UTF-8 (invalid byte at offset {})",
                    e.utf8_error().valid_up_to()
                );
                summary.refused += 1;
                continue;
            }
        };
        if text.trim().is_empty() {
            continue;
        }
        let mut last = Channel::Structure;
        let mut io_err = None;
        // A Ctrl-C pressed before this turn (while typing it) is not for this reply.
        input.take_interrupt();
        let mut interrupted = false;
        let mut on_id = |ch: Channel, id: u32| {
            let bytes = tok.token_bytes(id).unwrap_or(&[]);
            let r = match ch {
                Channel::Response => out.write_all(bytes).and_then(|_| out.flush()),
                Channel::Think => {
                    let start = last != Channel::Think;
                    let r = if opts.dim_think {
                        err.write_all(b"\x1b[2m")
                            .and_then(|_| err.write_all(bytes))
                            .and_then(|_| err.write_all(b"\x1b[0m"))
                    } else if start {
                        err.write_all(b"think: ").and_then(|_| err.write_all(bytes))
                    } else {
                        err.write_all(bytes)
                    };
                    r.and_then(|_| err.flush())
                }
                Channel::Structure => Ok(()),
            };
            if last == Channel::Think && ch != Channel::Think {
                let _ = writeln!(err); // the think text ended
            }
            last = ch;
            if let (Err(e), None) = (r, &io_err) {
                io_err = Some(e);
            }
            if input.take_interrupt() {
                interrupted = true;
                Flow::Stop
            } else {
                Flow::Continue
            }
        };
        match session.turn(model, fmt, &text, &opts.turn, &mut on_id) {
            Ok(r) => {
                if last == Channel::Think {
                    let _ = writeln!(err);
                }
                writeln!(out)?;
                let _ = out.flush();
                if let Some(e) = io_err {
                    return Err(ReplError::Io(e));
                }
                if interrupted {
                    let _ = writeln!(
                        err,
                        "(reply interrupted by Ctrl-C; the conversation goes on)"
                    );
                }
                summary.turns += 1;
                if r.restarted {
                    let _ = writeln!(
                        err,
                        "state: the rendered conversation does not start with the ids the state held; re-prefilled the whole conversation"
                    );
                }
                let n = r.reply.ids.len();
                let _ = writeln!(
                    err,
                    "turn {}: prefill {} tokens (reused {}) in {:.3} s; generated {} tokens, {}; stop {}; context {}/{}",
                    summary.turns,
                    r.prefilled,
                    r.reused,
                    r.prefill_seconds,
                    n,
                    r.seconds_per_token()
                        .map_or("no decode steps".into(), |s| format!("{s:.3} s/token")),
                    match r.reply.stopped_on {
                        Some(id) => id.to_string(),
                        None if interrupted => "Ctrl-C".into(),
                        None => "token limit".into(),
                    },
                    session.held().len(),
                    session.capacity()
                );
                summary.records.push(TurnRecord {
                    conversation_ids: session.held()[..r.conversation_len].to_vec(),
                    reused: r.reused,
                    prefilled: r.prefilled,
                    restarted: r.restarted,
                    generated_ids: r.reply.ids.clone(),
                    prefill_seconds: r.prefill_seconds,
                });
                after_turn(session, err);
            }
            Err(e @ TurnError::Overflow { .. }) => {
                let _ = writeln!(err, "{e}");
                summary.refused += 1;
            }
            Err(TurnError::Model(e)) => return Err(ReplError::Model(e)),
        }
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Ctrl-C is reported before a line already queued, once (the flag is cleared), and a
    /// closed reader is the end of input.
    #[test]
    fn repl_input_reports_ctrl_c_first_then_lines_then_the_end() {
        let (tx, rx) = std::sync::mpsc::channel();
        let flag = Arc::new(AtomicBool::new(false));
        let mut input = ReplInput::channel(rx, flag.clone());
        tx.send(Ok(Some(Line::Text(b"hi".to_vec())))).unwrap();
        flag.store(true, Ordering::SeqCst);
        assert_eq!(input.read().unwrap(), Next::Interrupt);
        assert_eq!(
            input.read().unwrap(),
            Next::Line(Line::Text(b"hi".to_vec()))
        );
        // Waiting for a line: a Ctrl-C arriving meanwhile ends the wait.
        let f = flag.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            f.store(true, Ordering::SeqCst);
        });
        assert_eq!(input.read().unwrap(), Next::Interrupt);
        t.join().unwrap();
        assert!(!input.take_interrupt());
        drop(tx);
        assert_eq!(input.read().unwrap(), Next::End);
        let mut bytes: &[u8] = b"one\n";
        let mut plain = ReplInput::reader(&mut bytes);
        assert_eq!(
            plain.read().unwrap(),
            Next::Line(Line::Text(b"one".to_vec()))
        );
        assert_eq!(plain.read().unwrap(), Next::End);
        assert!(!plain.take_interrupt());
    }
}
