//! Grammar-constrained decoding on the real 163,840-id vocabulary: every id sequence a seeded
//! random sampler draws under the mask is a reply whose JSON is valid (checked with the
//! independent `jsonschema` validator) or whose tool call the §5.5 parser accepts with
//! schema-valid arguments; without a constraint the logits are untouched.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use k3_worker::constrain::{apply, Constraint, MaskAhead, Spec, TokenMask, Vocab};
use k3_worker::text::tools::{CallParser, ToolEvent, ToolSpec};
use k3_worker::text::xtml::Markers;
use k3_worker::tokenizer::Tokenizer;
use serde_json::{json, Value};

use crate::common;
use common::Rng;

fn tok() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizer");
        Arc::new(Tokenizer::from_dir(&dir).expect("fixtures/tokenizer loads"))
    })
    .clone()
}

fn vocab() -> &'static Vocab {
    static V: OnceLock<Vocab> = OnceLock::new();
    V.get_or_init(|| Vocab::new(tok()).expect("the vocabulary builds"))
}

/// A number below `n` from the seeded stream.
fn below(rng: &mut Rng, n: usize) -> usize {
    (rng.next_u64() % n as u64) as usize
}

/// A random pick among the allowed ids; three times in four among the "closing" ones (special
/// ids and tokens made only of `"`, `}`, `]`, `,`), so that replies end within the budget.
fn pick(rng: &mut Rng, mask: &TokenMask) -> u32 {
    let allowed = mask.allowed();
    assert!(!allowed.is_empty(), "the mask allows nothing");
    if below(rng, 4) != 0 {
        let t = tok();
        let closing: Vec<u32> = allowed
            .iter()
            .copied()
            .filter(|&id| {
                id >= t.n_ranks()
                    || t.token_bytes(id)
                        .is_some_and(|b| !b.is_empty() && b.iter().all(|c| b"\"}],".contains(c)))
            })
            .collect();
        if !closing.is_empty() {
            return closing[below(rng, closing.len())];
        }
    }
    allowed[below(rng, allowed.len())]
}

/// Draw a reply under `spec` (the masks computed ahead, as the runner will); returns its ids.
fn draw(spec: &Spec, thinking: bool, seed: u64, budget: usize) -> Vec<u32> {
    let mut rng = Rng(seed);
    let mut c = Constraint::new(vocab(), spec, thinking).expect("the grammar compiles");
    let mut ids = Vec::new();
    let ends = [vocab().ids().end_of_msg, vocab().ids().eos];
    for _ in 0..budget {
        let (back, mask) = MaskAhead::start(c).wait().expect("a mask");
        c = back;
        let id = pick(&mut rng, &mask);
        c.commit(id).expect("the picked id is allowed");
        ids.push(id);
        if ends.contains(&id) {
            assert!(c.is_finished() || c.is_accepting());
            return ids;
        }
    }
    panic!("seed {seed}: no end within {budget} ids: {:?}", text(&ids));
}

fn text(ids: &[u32]) -> String {
    String::from_utf8_lossy(&tok().decode(ids).unwrap()).into_owned()
}

/// The response channel's text of a reply (between the markers).
fn response(ids: &[u32], thinking: bool) -> String {
    let t = text(ids);
    let body = if thinking {
        t.split_once("<|open|>response<|sep|>")
            .expect("a response channel")
            .1
            .to_string()
    } else {
        t
    };
    body.split_once("<|close|>response<|sep|>")
        .expect("the response closes")
        .0
        .to_string()
}

#[test]
fn json_object_replies_parse_as_objects() {
    for (seed, thinking) in [(1, false), (2, true), (3, false), (4, true)] {
        let ids = draw(&Spec::JsonObject, thinking, seed, 600);
        let r = response(&ids, thinking);
        let v: Value = serde_json::from_str(&r).unwrap_or_else(|e| panic!("{e}: {r:?}"));
        assert!(v.is_object(), "{r}");
        assert!(
            text(&ids).ends_with("<|close|>message<|sep|><|end_of_msg|>")
                || text(&ids).ends_with("[EOS]")
        );
    }
}

#[test]
fn json_schema_replies_validate_against_the_schema() {
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": false
    });
    let validator = jsonschema::validator_for(&schema).unwrap();
    for seed in 10..16 {
        let thinking = seed % 2 == 0;
        let spec = Spec::JsonSchema {
            schema: schema.clone(),
            strict: true,
        };
        let ids = draw(&spec, thinking, seed, 800);
        let r = response(&ids, thinking);
        let v: Value = serde_json::from_str(&r).unwrap_or_else(|e| panic!("{e}: {r:?}"));
        let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{r}: {errors:?}");
    }
}

fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "get_weather".into(),
            description: Some("Weather".into()),
            parameters: Some(json!({
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10},
                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["city", "days"],
                "additionalProperties": false
            })),
            strict: Some(true),
        },
        ToolSpec {
            name: "ping".into(),
            description: None,
            parameters: None,
            strict: None,
        },
    ]
}

#[test]
fn a_required_tool_call_is_one_the_parser_accepts_with_valid_arguments() {
    let markers = Markers::from_tokenizer(&tok()).unwrap();
    let tools = tools();
    let schemas: Vec<Value> = tools
        .iter()
        .map(|t| t.parameters.clone().unwrap_or(json!({"type": "object"})))
        .collect();
    for seed in 20..28 {
        let thinking = seed % 2 == 1;
        let parallel = seed % 4 < 2;
        let spec = Spec::ToolCall {
            tools: tools.clone(),
            parallel,
        };
        let ids = draw(&spec, thinking, seed, 800);
        let names = Some(tools.iter().map(|t| t.name.clone()).collect());
        let mut p = CallParser::new(markers, names);
        let events: Vec<ToolEvent> = ids.iter().filter_map(|&id| p.push(&tok(), id)).collect();
        assert!(
            !events.is_empty(),
            "seed {seed}: no call in {:?}",
            text(&ids)
        );
        if !parallel {
            assert_eq!(events.len(), 1);
        }
        for e in events {
            let ToolEvent::Call(c) = e else {
                panic!("seed {seed}: {e:?} in {:?}", text(&ids))
            };
            let k = tools.iter().position(|t| t.name == c.name).unwrap();
            let args = Value::Object(c.arguments);
            assert!(jsonschema::is_valid(&schemas[k], &args), "{args}");
        }
    }
    // A named function: only that tool.
    let only = vec![tools[0].clone()];
    let ids = draw(
        &Spec::ToolCall {
            tools: only,
            parallel: false,
        },
        false,
        99,
        800,
    );
    assert!(
        text(&ids).contains("call tool=\"get_weather\""),
        "{}",
        text(&ids)
    );
}

#[test]
fn the_mask_stops_what_the_grammar_forbids_and_no_constraint_changes_nothing() {
    let mut c = Constraint::new(vocab(), &Spec::JsonObject, false).unwrap();
    let m = c.mask().unwrap();
    let t = tok();
    // The reply must open a JSON object: "{" yes, a letter or the end of the message no.
    assert!(m.allows(t.encode("{")[0]));
    assert!(!m.allows(t.encode("Hello")[0]));
    assert!(!m.allows(vocab().ids().end_of_msg));
    assert!(m.count() < vocab().size() / 10, "{} allowed", m.count());
    assert!(c.commit(t.encode("Hello")[0]).is_err() || c.error().is_some());

    let logits: Vec<f32> = (0..vocab().size())
        .map(|i| (i as f32 * 0.37).sin())
        .collect();
    let mut same = logits.clone();
    apply(None, &mut same);
    assert!(same
        .iter()
        .zip(&logits)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let mut masked = logits.clone();
    apply(Some(&m), &mut masked);
    for (id, (a, b)) in masked.iter().zip(&logits).enumerate() {
        if m.allows(id as u32) {
            assert_eq!(a.to_bits(), b.to_bits());
        } else {
            assert_eq!(*a, f32::NEG_INFINITY);
        }
    }
}

#[test]
fn a_schema_llguidance_cannot_compile_is_an_error_not_a_panic() {
    let bad = Spec::JsonSchema {
        schema: json!({"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}),
        strict: true,
    };
    assert!(Constraint::new(vocab(), &bad, false).is_err());
    let not_object = Spec::JsonSchema {
        schema: json!(3),
        strict: true,
    };
    assert!(Constraint::new(vocab(), &not_object, false).is_err());
}

#[test]
fn a_forced_call_has_no_text_before_it_and_json_cannot_pad_forever() {
    // Thinking off, the response channel is open: a forced call must close it at once.
    let spec = Spec::ToolCall {
        tools: tools(),
        parallel: false,
    };
    let mut c = Constraint::new(vocab(), &spec, false).unwrap();
    assert_eq!(c.mask().unwrap().allowed(), [vocab().ids().close]);
    // Thinking on: free thinking, then an empty response channel before the tools.
    let mut c = Constraint::new(vocab(), &spec, true).unwrap();
    let t = tok();
    let ids = vocab().ids();
    for id in t.encode("hmm") {
        c.commit(id).unwrap();
    }
    c.commit(ids.close).unwrap();
    for id in t.encode("think") {
        c.commit(id).unwrap();
    }
    c.commit(ids.sep).unwrap();
    c.commit(ids.open).unwrap();
    for id in t.encode("response") {
        c.commit(id).unwrap();
    }
    c.commit(ids.sep).unwrap();
    assert_eq!(
        c.mask().unwrap().allowed(),
        [ids.close],
        "no text in the response"
    );
    // JSON: at most 16 whitespace characters between two tokens.
    let mut c = Constraint::new(vocab(), &Spec::JsonObject, false).unwrap();
    let space = t.encode(" ");
    assert_eq!(space.len(), 1);
    c.commit(t.encode("{")[0]).unwrap();
    for _ in 0..16 {
        assert!(c.mask().unwrap().allows(space[0]));
        c.commit(space[0]).unwrap();
    }
    assert!(!c.mask().unwrap().allows(space[0]), "a 17th space");
}
