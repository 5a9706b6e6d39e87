//! The Lark grammars of constrained replies (llguidance's dialect: `<[ID]>` is one special id,
//! `%json { SCHEMA }` a JSON value matching the schema, a regex lexeme never produces a special
//! id). Each grammar covers the whole reply after the generation prompt (SPEC.md §5.5):
//!
//! ```text
//! thinking on:  THINK-TEXT <|close|>think<|sep|> …        thinking off: (the response is open)
//! JSON:   [<|open|>response<|sep|>] JSON <|close|>response<|sep|> <|close|>message<|sep|> END
//! tools:  [<|open|>response<|sep|>] <|close|>response<|sep|>
//!         <|open|>tools<|sep|> CALL+ <|close|>tools<|sep|> <|close|>message<|sep|> END
//! CALL:   <|open|>call tool="NAME" index="N"<|sep|><|open|>json type="object"<|sep|>
//!         ARGUMENTS <|close|>json<|sep|><|close|>call<|sep|>
//! END:    <|end_of_msg|> | [EOS]
//! ```
//!
//! A call's arguments are one `json` element (the call grammar's second form), so they match the
//! tool's `parameters` schema as a whole; with `parallel` off there is exactly one call. A
//! forced call has an empty response channel before it (as the chat format renders an
//! assistant's calls; OpenAI's `required` answers with calls, not content), so that the reply
//! cannot put the call off with text. Between JSON tokens at most [`JSON_WHITESPACE`] of
//! whitespace is allowed (enough for indented output, and a reply cannot pad forever).

use serde_json::{json, Value};

use super::types::{ConstrainError, Ids};
use crate::text::tools::ToolSpec;

/// What a constrained reply must be.
#[derive(Clone, Debug, PartialEq)]
pub enum Spec {
    /// `response_format: {"type": "json_object"}`: a JSON object.
    JsonObject,
    /// `response_format: {"type": "json_schema", …}`: JSON matching `schema`; `strict: false`
    /// lets llguidance skip schema keywords it does not enforce instead of refusing them.
    JsonSchema {
        /// The schema.
        schema: Value,
        /// OpenAI's `strict`.
        strict: bool,
    },
    /// `tool_choice: "required"` (every declared tool) or a named function (one tool): a
    /// well-formed call whose arguments match the tool's schema.
    ToolCall {
        /// The tools that may be called.
        tools: Vec<ToolSpec>,
        /// More than one call.
        parallel: bool,
    },
}

/// A Lark string literal for `s` (JSON's escaping, which Lark reads).
fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// The whitespace allowed between two JSON tokens (llguidance's `whitespace_pattern`).
pub const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,16}";

/// `%json { … }` for `schema`, lenient unless `strict`, with bounded whitespace.
fn json_rule(schema: &Value, strict: bool) -> Result<String, ConstrainError> {
    let mut schema = match schema {
        Value::Object(m) => Value::Object(m.clone()),
        Value::Bool(true) => json!({}),
        other => {
            return Err(ConstrainError::Grammar(format!(
                "a JSON schema must be an object, not {other}"
            )))
        }
    };
    schema["x-guidance"] = json!({"lenient": !strict, "whitespace_pattern": JSON_WHITESPACE});
    Ok(format!("%json {schema}"))
}

/// The grammar of `spec` (see the module doc).
pub fn lark(spec: &Spec, ids: &Ids, thinking: bool) -> Result<String, ConstrainError> {
    let Ids {
        open,
        close,
        sep,
        end_of_msg,
        eos,
    } = *ids;
    let m = |tag: &str, first: u32| format!("<[{first}]> {} <[{sep}]>", lit(tag));
    let mut g = String::new();
    g.push_str(&format!("end: <[{end_of_msg}]> | <[{eos}]>\n"));
    g.push_str("free_text: /(?s:.*)/\n");
    g.push_str(&format!("message_end: {} end\n", m("message", close)));
    let think = if thinking {
        format!("free_text {} ", m("think", close))
    } else {
        String::new()
    };
    match spec {
        Spec::JsonObject | Spec::JsonSchema { .. } => {
            let rule = match spec {
                Spec::JsonSchema { schema, strict } => json_rule(schema, *strict)?,
                _ => json_rule(&json!({"type": "object"}), true)?,
            };
            let open_response = if thinking {
                m("response", open) + " "
            } else {
                String::new()
            };
            g.push_str(&format!("answer: {rule}\n"));
            g.push_str(&format!(
                "start: {think}{open_response}answer {} message_end\n",
                m("response", close)
            ));
        }
        Spec::ToolCall { tools, parallel } => {
            if tools.is_empty() {
                return Err(ConstrainError::Grammar(
                    "a tool call needs a declared tool".into(),
                ));
            }
            let response = if thinking {
                format!("{} {} ", m("response", open), m("response", close))
            } else {
                format!("{} ", m("response", close))
            };
            let mut alts = Vec::new();
            for (k, t) in tools.iter().enumerate() {
                let schema = t.parameters.clone().unwrap_or(json!({"type": "object"}));
                let strict = t.strict.unwrap_or(false);
                g.push_str(&format!("args_{k}: {}\n", json_rule(&schema, strict)?));
                let head = format!(
                    "call tool=\"{}\" index=\"",
                    crate::text::tools::escape_attr(&t.name)
                );
                g.push_str(&format!(
                    "call_{k}: <[{open}]> {} INDEX {} <[{sep}]> {} args_{k} {} {}\n",
                    lit(&head),
                    lit("\""),
                    m("json type=\"object\"", open),
                    m("json", close),
                    m("call", close),
                ));
                alts.push(format!("call_{k}"));
            }
            g.push_str("INDEX: /[1-9][0-9]{0,2}/\n");
            g.push_str(&format!("call: {}\n", alts.join(" | ")));
            let calls = if *parallel { "call+" } else { "call" };
            g.push_str(&format!(
                "start: {think}{response}{} {calls} {} message_end\n",
                m("tools", open),
                m("tools", close)
            ));
        }
    }
    Ok(g)
}
