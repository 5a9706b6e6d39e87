//! Kimi K3's XTML chat format (SPEC.md §5.5): rendering a conversation to ids and parsing a
//! reply back into its channels.
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
//! * [`Message::from_reply`] keeps a reply in the history with the model's own ids for its
//!   channel contents, so the next render reproduces what the state holds (re-encoding the
//!   decoded text can split it differently, which would both change what the model conditioned
//!   on and defeat the reuse of the state).
//!
//! `thinking_effort` values: `low`, `medium`, `high`, `max`. `medium` is disputed (SPEC.md §10
//! C4: the prompt text lists it, one report says the checkpoint's `encoding_k3.py` refuses it);
//! it is accepted here because the effort body itself names it.

use crate::text::tools::{self, ChoiceNote, FormatNote, Piece, RenderError, ToolCall, ToolSpec};
pub use crate::text::tools::{escape_attr, Markers, END_IDS};
use crate::text::visible;
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

    /// The ids that close the think channel and open the response, as an assistant message
    /// renders them (`<|close|>think<|sep|><|open|>response<|sep|>`): what a spent thinking
    /// budget forces.
    pub fn think_close(&self) -> Vec<u32> {
        let mut e = self.emitter();
        self.close(&mut e, "think");
        self.open(&mut e, "response", &[]);
        e.finish()
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
            String::from_utf8_lossy(&visible::decode(tok, ids).unwrap_or_default()).into_owned()
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
