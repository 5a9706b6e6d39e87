//! K3's tool grammar in XTML (SPEC.md §5.5 "Tools"): rendering tool declarations, assistant
//! tool calls and tool results exactly as the release's chat encoder does, and parsing the
//! calls the model generates back into (name, arguments), id by id.
//!
//! Rendering produces [`Piece`]s (open tag, close tag, text, end of message) that the chat
//! renderer ([`crate::text::xtml::ChatFormat`]) turns into ids: markers become control ids, every other
//! piece is ordinary text encoded on its own (an attribute's ` key`, `="`, value and `"` are four
//! separate encodes, as in the release).
//!
//! * Declarations: one system message `type="tool-declare"` before everything else, whose body
//!   holds the OpenAI-shaped `tools` array with every object's keys sorted, as compact JSON.
//! * A call: `<|open|>call tool="NAME" index="N"<|sep|>` (N counts from 1 within the message),
//!   one `argument key="K" type="T"` element per argument in the order given (a string raw, any
//!   other value as JSON with Python's `", "`/`": "` separators), or one `json type="object"`
//!   element holding arguments that were not valid JSON, verbatim.
//! * A result: `<|open|>message role="tool" tool="NAME" index="N"<|sep|>CONTENT…`, N counting
//!   the results after the assistant message, in the order of its calls.
//! * `tool_choice` `required`/`none` and `response_format`: a system message of their own
//!   (`type="tool-choice"`, `type="response-format"`) after the conversation.
//!
//! [`CallParser`] reads a reply's `tools` element as ids arrive and yields each call when it
//! closes: well-formed ([`ToolEvent::Call`]) or not ([`ToolEvent::Malformed`], with the text as
//! generated and the reason) — a call is never dropped.

use serde_json::{Map, Value};

use crate::text::visible;
use crate::tokenizer::Tokenizer;

/// One piece of a rendered conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// `<|open|>TAG k="v"…<|sep|>` (values escaped when emitted).
    Open(&'static str, Vec<(&'static str, String)>),
    /// `<|close|>TAG<|sep|>`.
    Close(&'static str),
    /// Ordinary text (specials disabled), encoded as one segment.
    Text(String),
    /// `<|end_of_msg|>`.
    EndOfMsg,
}

/// The pieces as one string with the markers spelled out (for tests and logs; the engine
/// encodes pieces one by one).
pub fn flat(pieces: &[Piece]) -> String {
    let mut s = String::new();
    for p in pieces {
        match p {
            Piece::Open(tag, attrs) => {
                s.push_str("<|open|>");
                s.push_str(tag);
                for (k, v) in attrs {
                    s.push_str(&format!(" {k}=\"{}\"", escape_attr(v)));
                }
                s.push_str("<|sep|>");
            }
            Piece::Close(tag) => s.push_str(&format!("<|close|>{tag}<|sep|>")),
            Piece::Text(t) => s.push_str(t),
            Piece::EndOfMsg => s.push_str("<|end_of_msg|>"),
        }
    }
    s
}

/// Escape an attribute value: `&` → `&amp;`, then `"` → `&quot;`.
pub fn escape_attr(v: &str) -> String {
    v.replace('&', "&amp;").replace('"', "&quot;")
}

/// The two end-of-turn ids (SPEC.md §5.4, I34): `[EOS]` and `<|end_of_msg|>`.
pub const END_IDS: [u32; 2] = [163_585, 163_586];

/// The four structural control ids (looked up in the tokenizer by the chat renderer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Markers {
    /// `<|open|>`.
    pub open: u32,
    /// `<|close|>`.
    pub close: u32,
    /// `<|sep|>`.
    pub sep: u32,
    /// `<|end_of_msg|>`.
    pub end_of_msg: u32,
}

// ---- JSON as Python's `json.dumps(…, ensure_ascii=False)` writes it --------------------------

/// Python's float `repr`: the shortest round-trip digits, fixed notation for decimal exponents
/// −4..=15 (with `.0` when integral), else `d.ddde±XX`.
pub fn py_float(v: f64) -> String {
    if v == 0.0 {
        return if v.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let s = format!("{v:e}");
    let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(char::is_ascii_digit).collect();
    let mut out = String::from(if neg { "-" } else { "" });
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            let mut int = digits.clone();
            while int.len() < int_len {
                int.push('0');
            }
            let frac = &int[int_len..];
            let frac = if frac.is_empty() {
                "0".to_string()
            } else {
                frac.to_string()
            };
            out.push_str(&int[..int_len]);
            out.push('.');
            out.push_str(&frac);
        } else {
            out.push_str("0.");
            out.push_str(&"0".repeat((-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push_str(&format!(
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        ));
    }
    out
}

/// serde_json formatting with Python's separators and float repr.
struct PyFormatter {
    compact: bool,
}

impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(if self.compact { b"," } else { b", " })
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.begin_array_value(w, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(if self.compact { b":" } else { b": " })
    }

    fn write_f64<W: ?Sized + std::io::Write>(&mut self, w: &mut W, v: f64) -> std::io::Result<()> {
        w.write_all(py_float(v).as_bytes())
    }

    fn write_f32<W: ?Sized + std::io::Write>(&mut self, w: &mut W, v: f32) -> std::io::Result<()> {
        self.write_f64(w, f64::from(v))
    }
}

fn py_json(v: &Value, compact: bool) -> String {
    let mut buf = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, PyFormatter { compact });
    // Writing a `Value` into memory cannot fail.
    serde::Serialize::serialize(v, &mut ser).expect("a JSON value serializes");
    String::from_utf8(buf).expect("serde_json writes UTF-8")
}

/// `json.dumps(v, ensure_ascii=False)`: `", "` and `": "` separators.
pub fn py_dumps(v: &Value) -> String {
    py_json(v, false)
}

/// `json.dumps(v, ensure_ascii=False, separators=(",", ":"))`.
pub fn py_dumps_compact(v: &Value) -> String {
    py_json(v, true)
}

/// Every object's keys sorted (by code point), recursively.
pub fn deep_sort(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            Value::Object(
                keys.into_iter()
                    .map(|k| (k.clone(), deep_sort(&m[k])))
                    .collect(),
            )
        }
        Value::Array(a) => Value::Array(a.iter().map(deep_sort).collect()),
        other => other.clone(),
    }
}

// ---- what is rendered ------------------------------------------------------------------------

/// A declared tool (OpenAI's `function` object; Anthropic's `input_schema` is `parameters`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ToolSpec {
    /// The function name.
    pub name: String,
    /// What it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Its arguments' JSON schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    /// OpenAI's `strict` flag (rendered when given, as the release does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

impl ToolSpec {
    /// The declaration as the release's `tools` list holds it:
    /// `{"type": "function", "function": {…the fields given…}}`.
    pub fn declaration(&self) -> Value {
        let function = serde_json::to_value(self).unwrap_or(Value::Null);
        serde_json::json!({"type": "function", "function": function})
    }
}

/// A call's arguments.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Arguments {
    /// A JSON object: one `argument` element per key, in order.
    Object(Map<String, Value>),
    /// Text that is not JSON: one `json type="object"` element holding it verbatim.
    Raw(String),
}

impl Arguments {
    /// OpenAI's `arguments` string: an object (an empty or blank string is `{}`), or text that
    /// does not parse, kept verbatim. JSON that is not an object is refused.
    pub fn from_json_text(s: &str) -> Result<Arguments, RenderError> {
        if s.trim().is_empty() {
            return Ok(Arguments::Object(Map::new()));
        }
        match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(m)) => Ok(Arguments::Object(m)),
            Ok(_) => Err(RenderError::ArgumentsNotObject),
            Err(_) => Ok(Arguments::Raw(s.to_string())),
        }
    }

    /// The arguments as OpenAI's JSON string (a raw text as it is).
    pub fn to_json_text(&self) -> String {
        match self {
            Arguments::Object(m) => Value::Object(m.clone()).to_string(),
            Arguments::Raw(s) => s.clone(),
        }
    }
}

/// An assistant's tool call.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ToolCall {
    /// The function called.
    pub name: String,
    /// Its arguments.
    pub arguments: Arguments,
}

/// A conversation that cannot be rendered in K3's tool grammar.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    /// A tool call's arguments are JSON but not an object.
    #[error("tool call arguments must be a JSON object")]
    ArgumentsNotObject,
    /// A tool call or declaration has an empty name.
    #[error("a tool call or tool declaration has an empty name")]
    EmptyName,
}

/// `tool_choice` as the release tells the model (`auto` and a named function add nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChoiceNote {
    /// `required`: "You MUST call tools in the next message."
    Required,
    /// `none`: "You MUST NOT call any tools in the next message."
    None,
}

/// `response_format` as the release tells the model.
#[derive(Clone, Debug, PartialEq)]
pub enum FormatNote {
    /// `json_object`.
    JsonObject,
    /// `json_schema` with its schema.
    JsonSchema(Value),
}

/// A system message the server adds (`_internal_system_message`): its body trimmed.
fn internal_message(kind: &str, body: &str) -> Vec<Piece> {
    vec![
        Piece::Open(
            "message",
            vec![("role", "system".into()), ("type", kind.to_string())],
        ),
        Piece::Text(body.trim().to_string()),
        Piece::Close("message"),
        Piece::EndOfMsg,
    ]
}

/// The `tool-declare` system message for `tools` (nothing when there are none).
pub fn declare(tools: &[ToolSpec]) -> Vec<Piece> {
    if tools.is_empty() {
        return Vec::new();
    }
    let list = Value::Array(tools.iter().map(ToolSpec::declaration).collect());
    let body = format!(
        "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```",
        py_dumps_compact(&deep_sort(&list))
    );
    vec![
        Piece::Open(
            "message",
            vec![("role", "system".into()), ("type", "tool-declare".into())],
        ),
        Piece::Text(body),
        Piece::Close("message"),
        Piece::EndOfMsg,
    ]
}

/// The `tool-choice` system message.
pub fn choice_note(c: ChoiceNote) -> Vec<Piece> {
    let body = match c {
        ChoiceNote::Required => {
            "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
        }
        ChoiceNote::None => {
            "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."
        }
    };
    internal_message("tool-choice", body)
}

/// The `response-format` system message.
pub fn format_note(f: &FormatNote) -> Vec<Piece> {
    const RAW: &str = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting.";
    let body = match f {
        FormatNote::JsonObject => {
            format!("The system is invoked with `response_format=json_object`.\n{RAW}")
        }
        FormatNote::JsonSchema(schema) => format!(
            "The system is invoked with `response_format=json_schema`.\n{RAW}\nThe JSON data must \
             match the following schema:\n```json\n{}\n```",
            py_dumps_compact(&deep_sort(schema))
        ),
    };
    internal_message("response-format", &body)
}

/// The XTML `type` of an argument value (`bool` before number, as the release checks it).
pub fn value_type(v: &Value) -> &'static str {
    match v {
        Value::Bool(_) => "boolean",
        Value::Null => "null",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Object(_) => "object",
        Value::Array(_) => "array",
    }
}

/// An assistant message's `tools` element (nothing when there are no calls).
pub fn calls(calls: &[ToolCall]) -> Result<Vec<Piece>, RenderError> {
    let mut out = Vec::new();
    if calls.is_empty() {
        return Ok(out);
    }
    out.push(Piece::Open("tools", vec![]));
    for (k, c) in calls.iter().enumerate() {
        if c.name.is_empty() {
            return Err(RenderError::EmptyName);
        }
        out.push(Piece::Open(
            "call",
            vec![("tool", c.name.clone()), ("index", (k + 1).to_string())],
        ));
        match &c.arguments {
            Arguments::Raw(text) => {
                out.push(Piece::Open("json", vec![("type", "object".into())]));
                out.push(Piece::Text(text.clone()));
                out.push(Piece::Close("json"));
            }
            Arguments::Object(m) => {
                for (key, v) in m {
                    out.push(Piece::Open(
                        "argument",
                        vec![("key", key.clone()), ("type", value_type(v).into())],
                    ));
                    out.push(Piece::Text(match v {
                        Value::String(s) => s.clone(),
                        other => py_dumps(other),
                    }));
                    out.push(Piece::Close("argument"));
                }
            }
        }
        out.push(Piece::Close("call"));
    }
    out.push(Piece::Close("tools"));
    Ok(out)
}

/// A tool result message: the `index`-th (from 1) result after an assistant message.
pub fn result(tool: &str, index: usize, content: &str) -> Vec<Piece> {
    vec![
        Piece::Open(
            "message",
            vec![
                ("role", "tool".into()),
                ("tool", tool.to_string()),
                ("index", index.to_string()),
            ],
        ),
        Piece::Text(content.to_string()),
        Piece::Close("message"),
        Piece::EndOfMsg,
    ]
}

/// The order in which a run of tool results is rendered: by the position of the call each
/// answers (`result_ids[k]` against `call_ids`), ties in arrival order. `None` when a result
/// does not name one of the calls: the run is then rendered as it came (the release does the
/// same).
pub fn result_order(call_ids: &[Option<&str>], result_ids: &[Option<&str>]) -> Option<Vec<usize>> {
    let mut keyed = Vec::with_capacity(result_ids.len());
    for (offset, id) in result_ids.iter().enumerate() {
        let id = (*id)?;
        // Duplicate call ids keep their first occurrence.
        let pos = call_ids.iter().position(|c| *c == Some(id))?;
        keyed.push((pos, offset));
    }
    keyed.sort();
    Some(keyed.into_iter().map(|(_, offset)| offset).collect())
}

// ---- parsing generated calls -----------------------------------------------------------------

/// Why a generated call was not accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MalformedCall {
    /// The reply ended (end id or token limit) inside the `tools` element.
    #[error("the reply ended inside a tool call")]
    Incomplete,
    /// A tag that does not belong where it stands.
    #[error("unexpected <{0}> in a tool call")]
    UnexpectedTag(String),
    /// Text between the elements of a `tools` or `call` element.
    #[error("text outside an argument in a tool call")]
    StrayText,
    /// A `<|sep|>` or `<|end_of_msg|>` where none belongs.
    #[error("a stray marker in a tool call")]
    StrayMarker,
    /// `call` without a `tool` attribute, or `argument` without `key`/`type`.
    #[error("{0}")]
    MissingAttribute(&'static str),
    /// The tool is not one of the declared tools.
    #[error("the tool {0:?} was not declared")]
    UnknownTool(String),
    /// The same argument twice.
    #[error("argument {0:?} given twice")]
    DuplicateArgument(String),
    /// An argument's value does not parse as its `type`.
    #[error("argument {key:?} is not a valid {kind}")]
    BadValue {
        /// The argument.
        key: String,
        /// Its declared type.
        kind: String,
    },
    /// An argument `type` outside string, number, integer, boolean, null, object, array.
    #[error("argument {key:?} has the unknown type {kind:?}")]
    UnknownType {
        /// The argument.
        key: String,
        /// The type given.
        kind: String,
    },
    /// A `json` element that is not a JSON object, or next to other arguments.
    #[error("the call's json element is not one JSON object")]
    BadJson,
    /// Text that is not UTF-8.
    #[error("the call's text is not UTF-8")]
    NotUtf8,
}

/// A well-formed generated call.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedCall {
    /// The tool.
    pub name: String,
    /// Its arguments with the types their elements declared.
    pub arguments: Map<String, Value>,
}

/// A generated call that does not parse: its text as generated, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Malformed {
    /// The ids' text (markers spelled out), from the call's start (or the `tools` element's
    /// when the call never started) to where the problem was found and the parser resumed.
    pub raw: String,
    /// Why.
    pub reason: MalformedCall,
}

/// What a generated id completed.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolEvent {
    /// A call closed and parsed.
    Call(ParsedCall),
    /// A call that does not parse.
    Malformed(Malformed),
}

/// Where the parser stands.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Level {
    /// Outside a `tools` element (the rest of the reply: not ours).
    Outside,
    /// In `tools`, between calls.
    Tools,
    /// In a `call`, between its elements.
    Call,
    /// In an `argument` element's value.
    Argument { key: String, kind: String },
    /// In a `json` element.
    Json,
    /// After a malformed piece: skipping to the end of the call or the `tools` element.
    Skip(MalformedCall),
}

/// The call being read.
#[derive(Clone, Debug, Default)]
struct Building {
    name: String,
    args: Map<String, Value>,
    json: bool,
}

/// Incremental parser of the calls in a reply, id by id (see the module doc).
#[derive(Clone, Debug)]
pub struct CallParser {
    m: Markers,
    declared: Option<Vec<String>>,
    level: Level,
    /// After `<|open|>` (true) or `<|close|>` (false): the tag's ids until `<|sep|>`.
    tag: Option<(bool, Vec<u32>)>,
    value: Vec<u32>,
    call: Option<Building>,
    /// Ids since the last event, inside the `tools` element (the text of a malformed call).
    raw: Vec<u32>,
    seen_calls: usize,
}

/// Split a tag's text into its name and attributes (values unescaped).
pub fn parse_tag(text: &str) -> Option<(&str, Vec<(&str, String)>)> {
    let (name, mut rest) = match text.find(' ') {
        Some(i) => (&text[..i], &text[i..]),
        None => (text, ""),
    };
    let mut attrs = Vec::new();
    while !rest.is_empty() {
        let r = rest.strip_prefix(' ')?;
        let eq = r.find("=\"")?;
        let key = &r[..eq];
        let after = &r[eq + 2..];
        let end = after.find('"')?;
        let value = after[..end].replace("&quot;", "\"").replace("&amp;", "&");
        attrs.push((key, value));
        rest = &after[end + 1..];
    }
    Some((name, attrs))
}

fn attr<'a>(attrs: &'a [(&str, String)], key: &str) -> Option<&'a str> {
    attrs
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.as_str())
}

/// An argument's text as a value of its `type`.
fn typed_value(key: &str, kind: &str, text: &str) -> Result<Value, MalformedCall> {
    let bad = || MalformedCall::BadValue {
        key: key.to_string(),
        kind: kind.to_string(),
    };
    if kind == "string" {
        return Ok(Value::String(text.to_string()));
    }
    let known = ["number", "integer", "boolean", "null", "object", "array"];
    if !known.contains(&kind) {
        return Err(MalformedCall::UnknownType {
            key: key.to_string(),
            kind: kind.to_string(),
        });
    }
    let v: Value = serde_json::from_str(text).map_err(|_| bad())?;
    let ok = match kind {
        "number" => v.is_number(),
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "object" => v.is_object(),
        _ => v.is_array(),
    };
    ok.then_some(v).ok_or_else(bad)
}

impl CallParser {
    /// A parser for a reply to a request that allows calls to `declared` (the tool names; `None`:
    /// any name is accepted; an empty list: every call is reported as not declared).
    pub fn new(m: Markers, declared: Option<Vec<String>>) -> CallParser {
        CallParser {
            m,
            declared,
            level: Level::Outside,
            tag: None,
            value: Vec::new(),
            call: None,
            raw: Vec::new(),
            seen_calls: 0,
        }
    }

    /// True while inside a `tools` element.
    pub fn in_tools(&self) -> bool {
        self.level != Level::Outside
    }

    /// Calls seen so far (well-formed or not).
    pub fn seen_calls(&self) -> usize {
        self.seen_calls
    }

    fn malformed(&mut self, tok: &Tokenizer, reason: MalformedCall) -> ToolEvent {
        let raw = String::from_utf8_lossy(&tok.decode(&self.raw).unwrap_or_default()).into_owned();
        self.raw.clear();
        self.call = None;
        self.value.clear();
        ToolEvent::Malformed(Malformed { raw, reason })
    }

    /// Skip to the end of the call (or of the `tools` element), then report `reason`.
    fn skip(&mut self, reason: MalformedCall) {
        self.value.clear();
        self.level = Level::Skip(reason);
    }

    /// Feed one generated id; returns the call it completed, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Option<ToolEvent> {
        let marker = id == self.m.open || id == self.m.close;
        if self.level == Level::Outside && self.tag.is_none() && marker {
            self.raw.clear();
        }
        if self.level != Level::Outside || self.tag.is_some() || marker {
            self.raw.push(id);
        }
        if END_IDS.contains(&id) {
            return self.end(tok);
        }
        if marker {
            let inside = !matches!(self.level, Level::Outside | Level::Skip(_));
            if self.tag.is_some() && inside {
                self.skip(MalformedCall::StrayMarker);
            }
            self.tag = Some((id == self.m.open, Vec::new()));
            return None;
        }
        if let Some((open, mut ids)) = self.tag.take() {
            if id == self.m.sep {
                let text =
                    String::from_utf8_lossy(&tok.decode(&ids).unwrap_or_default()).into_owned();
                return self.on_tag(tok, open, &text);
            }
            if id == self.m.end_of_msg {
                if !matches!(self.level, Level::Outside | Level::Skip(_)) {
                    self.skip(MalformedCall::StrayMarker);
                }
                return None;
            }
            ids.push(id);
            self.tag = Some((open, ids));
            return None;
        }
        if id == self.m.sep || id == self.m.end_of_msg {
            if !matches!(self.level, Level::Outside | Level::Skip(_)) {
                self.skip(MalformedCall::StrayMarker);
            }
            return None;
        }
        match &self.level {
            Level::Argument { .. } | Level::Json => self.value.push(id),
            Level::Tools | Level::Call => {
                let bytes = tok.token_bytes(id).unwrap_or(&[]);
                if !bytes.iter().all(u8::is_ascii_whitespace) {
                    self.skip(MalformedCall::StrayText);
                }
            }
            Level::Outside | Level::Skip(_) => {}
        }
        None
    }

    /// The reply ended (an end id, or call this at the token limit): a call left open is
    /// reported (a `tools` element left open between calls loses nothing).
    pub fn end(&mut self, tok: &Tokenizer) -> Option<ToolEvent> {
        self.tag = None;
        match std::mem::replace(&mut self.level, Level::Outside) {
            // Between calls every call was already reported: nothing is lost.
            Level::Outside | Level::Tools => {
                self.raw.clear();
                None
            }
            Level::Skip(reason) => Some(self.malformed(tok, reason)),
            _ => Some(self.malformed(tok, MalformedCall::Incomplete)),
        }
    }

    fn on_tag(&mut self, tok: &Tokenizer, open: bool, text: &str) -> Option<ToolEvent> {
        let Some((name, attrs)) = parse_tag(text) else {
            if self.level != Level::Outside && !matches!(self.level, Level::Skip(_)) {
                self.skip(MalformedCall::UnexpectedTag(text.to_string()));
            }
            return None;
        };
        let level = std::mem::replace(&mut self.level, Level::Outside);
        let (next, event) = self.step(tok, level, open, name, &attrs, text);
        self.level = next;
        event
    }

    /// The transition for one tag (`text` is the whole tag, for messages).
    fn step(
        &mut self,
        tok: &Tokenizer,
        level: Level,
        open: bool,
        name: &str,
        attrs: &[(&str, String)],
        text: &str,
    ) -> (Level, Option<ToolEvent>) {
        let unexpected = || Level::Skip(MalformedCall::UnexpectedTag(text.to_string()));
        match (level, open, name) {
            (Level::Outside, true, "tools") => (Level::Tools, None),
            (Level::Outside, _, _) => {
                self.raw.clear();
                (Level::Outside, None)
            }
            (Level::Tools, false, "tools") => {
                self.raw.clear();
                (Level::Outside, None)
            }
            (Level::Tools, true, "call") => {
                self.seen_calls += 1;
                // The call's text starts at its own `<|open|>`.
                let start = self.raw.len().saturating_sub(1);
                let start = self.raw[..start]
                    .iter()
                    .rposition(|&i| i == self.m.open)
                    .unwrap_or(0);
                self.raw.drain(..start);
                match attr(attrs, "tool") {
                    None | Some("") => (
                        Level::Skip(MalformedCall::MissingAttribute("a call has no tool name")),
                        None,
                    ),
                    Some(tool) => {
                        if self
                            .declared
                            .as_ref()
                            .is_some_and(|d| !d.iter().any(|d| d == tool))
                        {
                            return (Level::Skip(MalformedCall::UnknownTool(tool.into())), None);
                        }
                        self.call = Some(Building {
                            name: tool.to_string(),
                            ..Building::default()
                        });
                        (Level::Call, None)
                    }
                }
            }
            (Level::Call, true, "argument") => match (attr(attrs, "key"), attr(attrs, "type")) {
                (Some(k), Some(t)) => {
                    self.value.clear();
                    (
                        Level::Argument {
                            key: k.to_string(),
                            kind: t.to_string(),
                        },
                        None,
                    )
                }
                _ => (
                    Level::Skip(MalformedCall::MissingAttribute(
                        "an argument needs key and type",
                    )),
                    None,
                ),
            },
            (Level::Call, true, "json") => {
                self.value.clear();
                (Level::Json, None)
            }
            (Level::Call, false, "call") => {
                let c = self.call.take().unwrap_or_default();
                self.raw.clear();
                (
                    Level::Tools,
                    Some(ToolEvent::Call(ParsedCall {
                        name: c.name,
                        arguments: c.args,
                    })),
                )
            }
            (Level::Argument { key, kind }, false, "argument") => {
                match self.take_argument(tok, &key, &kind) {
                    Ok(()) => (Level::Call, None),
                    Err(e) => (Level::Skip(e), None),
                }
            }
            (Level::Json, false, "json") => match self.take_json(tok) {
                Ok(()) => (Level::Call, None),
                Err(e) => (Level::Skip(e), None),
            },
            (Level::Skip(reason), false, "call") => {
                let e = self.malformed(tok, reason);
                (Level::Tools, Some(e))
            }
            (Level::Skip(reason), false, "tools") => {
                let e = self.malformed(tok, reason);
                (Level::Outside, Some(e))
            }
            (Level::Skip(reason), _, _) => (Level::Skip(reason), None),
            _ => (unexpected(), None),
        }
    }

    fn value_text(&mut self, tok: &Tokenizer) -> Result<String, MalformedCall> {
        // A control marker or reserved slot inside a value is not text (see `visible`).
        let bytes = visible::decode(tok, &self.value).unwrap_or_default();
        self.value.clear();
        String::from_utf8(bytes).map_err(|_| MalformedCall::NotUtf8)
    }

    fn take_argument(
        &mut self,
        tok: &Tokenizer,
        key: &str,
        kind: &str,
    ) -> Result<(), MalformedCall> {
        let text = self.value_text(tok)?;
        let v = typed_value(key, kind, &text)?;
        let call = self.call.get_or_insert_with(Building::default);
        if call.json || call.args.contains_key(key) {
            return Err(MalformedCall::DuplicateArgument(key.to_string()));
        }
        call.args.insert(key.to_string(), v);
        Ok(())
    }

    fn take_json(&mut self, tok: &Tokenizer) -> Result<(), MalformedCall> {
        let text = self.value_text(tok)?;
        let call = self.call.get_or_insert_with(Building::default);
        if call.json || !call.args.is_empty() {
            return Err(MalformedCall::BadJson);
        }
        match serde_json::from_str::<Value>(&text) {
            Ok(Value::Object(m)) => {
                call.args = m;
                call.json = true;
                Ok(())
            }
            _ => Err(MalformedCall::BadJson),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn python_float_repr() {
        for (v, s) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (-0.0, "-0.0"),
            (2.71, "2.71"),
        ] {
            assert_eq!(py_float(v), s, "{v}");
        }
    }

    #[test]
    fn python_separators_and_sorting() {
        let v: Value = serde_json::from_str(r#"{"b":1,"a":[1,2.0],"u":"中\n"}"#).unwrap();
        assert_eq!(py_dumps(&v), r#"{"b": 1, "a": [1, 2.0], "u": "中\n"}"#);
        assert_eq!(
            py_dumps_compact(&deep_sort(&v)),
            r#"{"a":[1,2.0],"b":1,"u":"中\n"}"#
        );
    }

    #[test]
    fn declarations_are_sorted_compact_and_first_class() {
        let t = ToolSpec {
            name: "f".into(),
            description: Some("d".into()),
            parameters: Some(json!({"type": "object", "properties": {}})),
            strict: None,
        };
        assert_eq!(
            flat(&declare(&[t])),
            "<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\nHere are the \
             available tools, described in JSONSchema.\n\n```json\n[{\"function\":{\"description\
             \":\"d\",\"name\":\"f\",\"parameters\":{\"properties\":{},\"type\":\"object\"}},\"\
             type\":\"function\"}]\n```<|close|>message<|sep|><|end_of_msg|>"
        );
        assert!(declare(&[]).is_empty());
    }

    #[test]
    fn calls_render_typed_arguments_in_order_or_a_raw_json_block() {
        let args =
            Arguments::from_json_text(r#"{"city": "SF", "days": 3, "x": {"b": 1.5}}"#).unwrap();
        let p = calls(&[
            ToolCall {
                name: "get_weather".into(),
                arguments: args,
            },
            ToolCall {
                name: "f".into(),
                arguments: Arguments::from_json_text("{oops").unwrap(),
            },
        ])
        .unwrap();
        assert_eq!(
            flat(&p),
            "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>\
             <|open|>argument key=\"city\" type=\"string\"<|sep|>SF<|close|>argument<|sep|>\
             <|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>\
             <|open|>argument key=\"x\" type=\"object\"<|sep|>{\"b\": 1.5}<|close|>argument<|sep|>\
             <|close|>call<|sep|><|open|>call tool=\"f\" index=\"2\"<|sep|>\
             <|open|>json type=\"object\"<|sep|>{oops<|close|>json<|sep|><|close|>call<|sep|>\
             <|close|>tools<|sep|>"
        );
        assert_eq!(
            Arguments::from_json_text("[1]"),
            Err(RenderError::ArgumentsNotObject)
        );
        assert_eq!(
            Arguments::from_json_text("  "),
            Ok(Arguments::Object(Map::new()))
        );
    }

    #[test]
    fn notes_and_results() {
        assert_eq!(
            flat(&choice_note(ChoiceNote::Required)),
            "<|open|>message role=\"system\" type=\"tool-choice\"<|sep|>The system is invoked \
             with `tool_choice=required`.\nYou MUST call tools in the next message.<|close|>\
             message<|sep|><|end_of_msg|>"
        );
        assert_eq!(
            flat(&result("get_weather", 2, "22C")),
            "<|open|>message role=\"tool\" tool=\"get_weather\" index=\"2\"<|sep|>22C<|close|>\
             message<|sep|><|end_of_msg|>"
        );
        assert!(flat(&format_note(&FormatNote::JsonSchema(
            json!({"type": "object", "additionalProperties": false})
        )))
        .contains("```json\n{\"additionalProperties\":false,\"type\":\"object\"}\n```"));
    }

    #[test]
    fn results_follow_their_calls() {
        let calls = [Some("a"), Some("b"), None];
        assert_eq!(
            result_order(&calls, &[Some("b"), Some("a")]),
            Some(vec![1, 0])
        );
        assert_eq!(result_order(&calls, &[Some("b"), Some("zz")]), None);
        assert_eq!(result_order(&calls, &[None]), None);
        assert_eq!(
            result_order(&calls, &[Some("a"), Some("a")]),
            Some(vec![0, 1])
        );
    }

    #[test]
    fn tags_and_values() {
        let (n, a) = parse_tag("call tool=\"a&quot;&amp;b\" index=\"1\"").unwrap();
        assert_eq!(n, "call");
        assert_eq!(
            a,
            vec![("tool", "a\"&b".to_string()), ("index", "1".to_string())]
        );
        assert!(parse_tag("call tool=\"x").is_none());
        assert_eq!(typed_value("k", "integer", "2").unwrap(), json!(2));
        assert!(typed_value("k", "integer", "2.5").is_err());
        assert_eq!(typed_value("k", "string", " a ").unwrap(), json!(" a "));
        assert!(typed_value("k", "number", "\"3\"").is_err());
        assert!(matches!(
            typed_value("k", "date", "x"),
            Err(MalformedCall::UnknownType { .. })
        ));
    }
}
