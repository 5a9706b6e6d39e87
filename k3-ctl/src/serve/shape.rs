//! What a request asks of its ids beyond sampling, as the worker's [`Shape`] (docs/SPEC.md §6.12
//! "Shaping"), and the log-probabilities it gets back in OpenAI's shapes.
//!
//! * A forced tool choice (`tool_choice` `required` or a named function; Anthropic's `any` and
//!   `tool`) becomes a [`Grammar::ToolCall`] over the tools that may be called; `response_format`
//!   `json_object`/`json_schema` (Anthropic's `output_config.format`) a JSON grammar. The
//!   worker compiles them with llguidance over its vocabulary and masks every pick.
//! * The thinking budget (`thinking_budget`; Anthropic's `thinking.budget_tokens`): at most
//!   that many ids in the think channel, then the worker forces the ids that close it and
//!   open the response ([`ChatFormat::think_close`]). With thinking on and no budget, half of
//!   `max_tokens` ([`default_think_budget`]), so that a default request gets an answer.
//! * `logit_bias`, `presence_penalty`, `frequency_penalty` as OpenAI defines them;
//!   `logprobs`/`top_logprobs` (chat) and `logprobs: k` (completions).

use k3_proto::serve::{Grammar, Shape, ThinkBudget, ToolGrammar, MAX_TOP_LOGPROBS};
use k3_worker::text::tools::{FormatNote, ToolSpec};
use k3_worker::text::xtml::ChatFormat;
use k3_worker::tokenizer::Tokenizer;
use serde_json::{json, Value};

use super::api::{ApiError, MustCall, ToolSetup};

/// Most alternatives of a completion's `logprobs` (OpenAI's limit).
pub const MAX_COMPLETION_LOGPROBS: u8 = 5;

/// The thinking budget when a request with thinking on gives none: half of its `max_tokens`
/// (at least 1), so that the answer has the other half.
pub fn default_think_budget(max_new: usize) -> usize {
    (max_new / 2).max(1)
}

/// `logit_bias`: `{"ID": bias}` with biases in −100..=100 (ids are checked against the
/// vocabulary by [`check_bias_ids`]).
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

/// Every biased id is in the vocabulary.
pub fn check_bias_ids(shape: &Shape, vocab: usize) -> Result<(), ApiError> {
    match shape
        .logit_bias
        .iter()
        .find(|(id, _)| *id as usize >= vocab)
    {
        Some((id, _)) => Err(ApiError::bad(
            Some("logit_bias"),
            format!("token id {id} is outside the vocabulary of {vocab}"),
        )),
        None => Ok(()),
    }
}

/// A chat request's `logprobs` (a boolean) and `top_logprobs` (0..=20, needs `logprobs`).
pub fn chat_logprobs(
    logprobs: Option<&Value>,
    top: Option<&Value>,
) -> Result<Option<u8>, ApiError> {
    let on = match logprobs {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(v) => {
            return Err(ApiError::bad(
                Some("logprobs"),
                format!("logprobs {v}: true or false"),
            ))
        }
    };
    let top = match top {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|&k| k <= u64::from(MAX_TOP_LOGPROBS))
                .ok_or_else(|| {
                    ApiError::bad(
                        Some("top_logprobs"),
                        format!("top_logprobs {v}: an integer in 0..={MAX_TOP_LOGPROBS}"),
                    )
                })? as u8,
        ),
    };
    match (on, top) {
        (false, Some(_)) => Err(ApiError::bad(
            Some("top_logprobs"),
            "top_logprobs needs logprobs: true",
        )),
        (false, None) => Ok(None),
        (true, k) => Ok(Some(k.unwrap_or(0))),
    }
}

/// A completion's `logprobs`: the number of alternatives, 0..=5.
pub fn completion_logprobs(logprobs: Option<&Value>) -> Result<Option<u8>, ApiError> {
    match logprobs {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|&k| k <= u64::from(MAX_COMPLETION_LOGPROBS))
            .map(|k| Some(k as u8))
            .ok_or_else(|| {
                ApiError::bad(
                    Some("logprobs"),
                    format!("logprobs {v}: an integer in 0..={MAX_COMPLETION_LOGPROBS}"),
                )
            }),
    }
}

/// The tool-call grammar of a forced choice (`None` when the choice is not forced).
pub fn tool_grammar(setup: &ToolSetup) -> Option<Grammar> {
    let must = setup.must_call.as_ref()?;
    let tools = setup
        .specs
        .iter()
        .filter(|s| match must {
            MustCall::Any => setup.allowed.contains(&s.name),
            MustCall::Named(n) => &s.name == n,
        })
        .map(tool)
        .collect();
    Some(Grammar::ToolCall {
        tools,
        parallel: setup.parallel,
    })
}

fn tool(s: &ToolSpec) -> ToolGrammar {
    ToolGrammar {
        name: s.name.clone(),
        parameters: s.parameters.as_ref().map(Value::to_string),
        strict: s.strict.unwrap_or(false),
    }
}

/// `response_format` (`text`, `json_object`, `json_schema` with `schema` and `strict`): the
/// note the release renders for it and the grammar (`None` for text). `field` names it in a
/// refusal.
pub fn response_format(
    f: Option<&Value>,
    field: &'static str,
) -> Result<Option<(FormatNote, Grammar)>, ApiError> {
    let bad = |m: String| ApiError::bad(Some(field), m);
    let Some(f) = f.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some((FormatNote::JsonObject, Grammar::JsonObject))),
        Some("json_schema") => {
            // OpenAI nests it under `json_schema`; Anthropic's `output_config.format` does not.
            let (schema, strict) = match f.get("json_schema") {
                Some(js) => (
                    js.get("schema").cloned(),
                    js.get("strict").and_then(Value::as_bool).unwrap_or(false),
                ),
                None => (f.get("schema").cloned(), true),
            };
            let schema = schema.unwrap_or_else(|| json!({}));
            if !schema.is_object() {
                return Err(bad(format!(
                    "{field}: the schema {schema} is not an object"
                )));
            }
            Ok(Some((
                FormatNote::JsonSchema(schema.clone()),
                Grammar::JsonSchema {
                    schema: schema.to_string(),
                    strict,
                },
            )))
        }
        _ => Err(bad(format!(
            "{field} {f}: type text, json_object or json_schema"
        ))),
    }
}

/// The thinking budget of a reply with thinking on: `given` (≥ 0) or
/// [`default_think_budget`], with the ids that close the think channel. `None` with thinking
/// off (a budget given then is refused by the caller).
pub fn think_budget(
    tok: &Tokenizer,
    thinking: bool,
    given: Option<usize>,
    max_new: usize,
) -> Result<Option<ThinkBudget>, ApiError> {
    if !thinking {
        return Ok(None);
    }
    let fmt = ChatFormat::new(tok, None).map_err(|e| ApiError::internal(e.to_string()))?;
    let tokens = given.unwrap_or_else(|| default_think_budget(max_new));
    Ok(Some(ThinkBudget {
        tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
        close: fmt.think_close(),
    }))
}

/// One id's `logprobs.content` item (chat): its text, log-probability, bytes and alternatives.
pub fn chat_item(tok: &Tokenizer, id: u32, logprob: f32, top: &[(u32, f32)]) -> Value {
    let one = |id: u32, lp: f32| {
        let bytes = tok.token_bytes(id).unwrap_or(&[]);
        json!({
            "token": String::from_utf8_lossy(bytes),
            "logprob": finite(lp),
            "bytes": bytes,
        })
    };
    let mut v = one(id, logprob);
    v["top_logprobs"] = Value::Array(top.iter().map(|&(i, lp)| one(i, lp)).collect());
    v
}

/// OpenAI's stand-in for −∞ (JSON has no infinity).
fn finite(lp: f32) -> f64 {
    if lp.is_finite() {
        f64::from(lp)
    } else {
        -9999.0
    }
}

/// A completion's `logprobs` object from its ids' items ([`chat_item`]s) and the text offsets.
pub fn completion_object(items: &[Value], offsets: &[usize]) -> Value {
    let tokens: Vec<Value> = items.iter().map(|i| i["token"].clone()).collect();
    let lps: Vec<Value> = items.iter().map(|i| i["logprob"].clone()).collect();
    let tops: Vec<Value> = items
        .iter()
        .map(|i| {
            let mut m = serde_json::Map::new();
            for t in i["top_logprobs"].as_array().into_iter().flatten() {
                let key = t["token"].as_str().unwrap_or_default().to_string();
                m.entry(key).or_insert_with(|| t["logprob"].clone());
            }
            Value::Object(m)
        })
        .collect();
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logit_bias_keys_are_ids_and_values_bounded() {
        let m: serde_json::Map<String, Value> =
            serde_json::from_value(json!({"42": -100, "7": 2.5})).unwrap();
        assert_eq!(logit_bias(Some(&m)).unwrap(), vec![(7, 2.5), (42, -100.0)]);
        for bad in [
            json!({"x": 1}),
            json!({"1": 101}),
            json!({"1": "5"}),
            json!({"-1": 1}),
        ] {
            let m: serde_json::Map<String, Value> = serde_json::from_value(bad.clone()).unwrap();
            let e = logit_bias(Some(&m)).unwrap_err();
            assert_eq!(e.param, Some("logit_bias"), "{bad}");
        }
        let shape = Shape {
            logit_bias: vec![(10, 1.0)],
            ..Shape::default()
        };
        assert!(check_bias_ids(&shape, 11).is_ok());
        assert!(check_bias_ids(&shape, 10).is_err());
    }

    #[test]
    fn logprobs_fields_follow_openai() {
        let t = json!(true);
        assert_eq!(chat_logprobs(None, None).unwrap(), None);
        assert_eq!(chat_logprobs(Some(&t), None).unwrap(), Some(0));
        assert_eq!(chat_logprobs(Some(&t), Some(&json!(20))).unwrap(), Some(20));
        assert!(chat_logprobs(Some(&t), Some(&json!(21))).is_err());
        assert!(chat_logprobs(None, Some(&json!(2))).is_err());
        assert!(chat_logprobs(Some(&json!(3)), None).is_err());
        assert_eq!(completion_logprobs(Some(&json!(5))).unwrap(), Some(5));
        assert_eq!(completion_logprobs(Some(&json!(0))).unwrap(), Some(0));
        assert!(completion_logprobs(Some(&json!(6))).is_err());
        assert!(completion_logprobs(Some(&json!(true))).is_err());
    }

    #[test]
    fn response_formats_become_notes_and_grammars() {
        assert!(
            response_format(Some(&json!({"type": "text"})), "response_format")
                .unwrap()
                .is_none()
        );
        let (note, g) = response_format(Some(&json!({"type": "json_object"})), "response_format")
            .unwrap()
            .unwrap();
        assert_eq!((note, g), (FormatNote::JsonObject, Grammar::JsonObject));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let f = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}});
        let (_, g) = response_format(Some(&f), "response_format")
            .unwrap()
            .unwrap();
        assert_eq!(
            g,
            Grammar::JsonSchema {
                schema: schema.to_string(),
                strict: true
            }
        );
        // Anthropic's output_config.format: the schema at the top, always strict.
        let f = json!({"type": "json_schema", "schema": schema});
        let (_, g) = response_format(Some(&f), "output_config").unwrap().unwrap();
        assert!(matches!(g, Grammar::JsonSchema { strict: true, .. }));
        for bad in [
            json!({"type": "xml"}),
            json!({"type": "json_schema", "json_schema": {"schema": 3}}),
        ] {
            assert!(
                response_format(Some(&bad), "response_format").is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_forced_choice_grammar_lists_what_may_be_called() {
        let spec = |n: &str| ToolSpec {
            name: n.into(),
            description: None,
            parameters: Some(json!({"type": "object"})),
            strict: None,
        };
        let mut setup = ToolSetup {
            specs: vec![spec("a"), spec("b")],
            allowed: vec!["a".into(), "b".into()],
            parallel: false,
            ..ToolSetup::default()
        };
        assert_eq!(tool_grammar(&setup), None);
        setup.force(MustCall::Named("b".into())).unwrap();
        let Some(Grammar::ToolCall { tools, parallel }) = tool_grammar(&setup) else {
            panic!("a grammar")
        };
        assert_eq!(
            tools.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            ["b"]
        );
        assert!(!parallel);
        assert!(setup.force(MustCall::Named("c".into())).is_err());
    }
}
