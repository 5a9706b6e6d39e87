//! K3's tool grammar (SPEC.md §5.5 "Tools") on the real Kimi vocabulary: rendered ids worked out
//! by hand from the facts, and the generated-call parser fed id by id.

use std::path::Path;
use std::sync::OnceLock;

use k3_worker::text::tools::{
    Arguments, CallParser, ChoiceNote, MalformedCall, ParsedCall, ToolCall, ToolEvent, ToolSpec,
};
use k3_worker::text::xtml::{ChatFormat, Effort, Markers, Message, Options};
use k3_worker::tokenizer::Tokenizer;
use serde_json::json;

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizer");
        Tokenizer::from_dir(&dir).expect("fixtures/tokenizer loads")
    })
}

// SPEC.md §5.3, written out.
const EOS: u32 = 163_585;
const EOM: u32 = 163_586;
const OPEN: u32 = 163_587;
const CLOSE: u32 = 163_588;
const SEP: u32 = 163_589;

/// Expected ids from the §5.5 rules: markers as ids; the tag name, each attribute's ` key`,
/// `="`, value and `"`, and each content encoded on its own.
#[derive(Default)]
struct Expect(Vec<u32>);

impl Expect {
    fn m(&mut self, id: u32) -> &mut Self {
        self.0.push(id);
        self
    }
    fn t(&mut self, s: &str) -> &mut Self {
        self.0.extend(tok().encode(s));
        self
    }
    fn open(&mut self, tag: &str, attrs: &[(&str, &str)]) -> &mut Self {
        self.m(OPEN).t(tag);
        for (k, v) in attrs {
            self.t(&format!(" {k}")).t("=\"").t(v).t("\"");
        }
        self.m(SEP)
    }
    fn close(&mut self, tag: &str) -> &mut Self {
        self.m(CLOSE).t(tag).m(SEP)
    }
}

fn weather() -> ToolSpec {
    ToolSpec {
        name: "get_weather".into(),
        description: Some("Get current weather for a location".into()),
        parameters: Some(json!({
            "type": "object",
            "properties": {"location": {"type": "string", "description": "City name"}},
            "required": ["location"],
        })),
        strict: None,
    }
}

/// Independent goldens (a tokenizer port's frozen vectors from the release tokenizer).
#[test]
fn goldens_of_the_pieces() {
    assert_eq!(tok().encode("get_weather"), [618, 21055, 2800]);
    assert_eq!(
        tok().encode_with_special("<|close|>think<|sep|>"),
        [CLOSE, 39964, SEP]
    );
}

/// The whole prompt of a `tool_choice: required` request with one declared tool, thinking off:
/// tool declaration first, the user message, the tool-choice note, the generation prompt.
#[test]
fn a_tool_request_renders_declaration_user_note_and_prompt() {
    let f = ChatFormat::new(tok(), None).unwrap();
    let opts = Options {
        tools: vec![weather()],
        choice: Some(ChoiceNote::Required),
        format: None,
    };
    let got = f
        .render_with(
            &[Message::user("What's the weather in San Francisco?")],
            &opts,
            true,
        )
        .unwrap();
    let declare = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n\
        [{\"function\":{\"description\":\"Get current weather for a location\",\"name\":\
        \"get_weather\",\"parameters\":{\"properties\":{\"location\":{\"description\":\"City \
        name\",\"type\":\"string\"}},\"required\":[\"location\"],\"type\":\"object\"}},\"type\":\
        \"function\"}]\n```";
    let mut e = Expect::default();
    e.open("message", &[("role", "system"), ("type", "tool-declare")])
        .t(declare)
        .close("message")
        .m(EOM)
        .open("message", &[("role", "user")])
        .t("What's the weather in San Francisco?")
        .close("message")
        .m(EOM)
        .open("message", &[("role", "system"), ("type", "tool-choice")])
        .t("The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.")
        .close("message")
        .m(EOM)
        .open("message", &[("role", "assistant")])
        .open("response", &[]);
    assert_eq!(got, e.0);
    // The same string encoded in one pass with specials (a tokenizer port's 147-id vector):
    // equal here because no attribute value starts or ends with punctuation.
    let flat_text = "<|open|>message role=\"system\" type=\"tool-declare\"<|sep|>".to_string()
        + declare
        + "<|close|>message<|sep|><|end_of_msg|><|open|>message role=\"user\"<|sep|>What's the \
           weather in San Francisco?<|close|>message<|sep|><|end_of_msg|><|open|>message \
           role=\"system\" type=\"tool-choice\"<|sep|>The system is invoked with \
           `tool_choice=required`.\nYou MUST call tools in the next message.<|close|>message<|sep|>\
           <|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>";
    assert_eq!(got.len(), 147);
    assert_eq!(tok().encode_with_special(&flat_text), got);
    // The port's frozen sha256 of the ids as little-endian i32 (from the release tokenizer).
    use sha2::Digest;
    let packed: Vec<u8> = got.iter().flat_map(|&i| (i as i32).to_le_bytes()).collect();
    let hex: String = sha2::Sha256::digest(&packed)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        hex,
        "f1ed3971af8259f3b9241d92404ec8d45f34137dec027fd96bc8d23b91b9773c"
    );
}

/// A call loop in the history: the assistant's calls (typed arguments, a raw block) and the
/// results, thinking on.
#[test]
fn calls_and_results_in_the_history() {
    let f = ChatFormat::new(tok(), Some(Effort::Max)).unwrap();
    let history = vec![
        Message::user("weather?"),
        Message::assistant_calls(
            "",
            Some("look it up".into()),
            vec![
                ToolCall {
                    name: "get_weather".into(),
                    arguments: Arguments::from_json_text(r#"{"city": "SF", "days": 3}"#).unwrap(),
                },
                ToolCall {
                    name: "f".into(),
                    arguments: Arguments::Raw("{oops".into()),
                },
            ],
        ),
        Message::tool("get_weather", "22C"),
        Message::tool("f", "error"),
    ];
    let got = f.render_with(&history, &Options::default(), true).unwrap();
    let mut e = Expect::default();
    e.open(
        "message",
        &[("role", "system"), ("type", "thinking-effort")],
    )
    .t(&k3_worker::text::xtml::effort_body(Effort::Max))
    .close("message")
    .m(EOM)
    .open("message", &[("role", "user")])
    .t("weather?")
    .close("message")
    .m(EOM)
    .open("message", &[("role", "assistant")])
    .open("think", &[])
    .t("look it up")
    .close("think")
    .open("response", &[])
    .close("response")
    .open("tools", &[])
    .open("call", &[("tool", "get_weather"), ("index", "1")])
    .open("argument", &[("key", "city"), ("type", "string")])
    .t("SF")
    .close("argument")
    .open("argument", &[("key", "days"), ("type", "number")])
    .t("3")
    .close("argument")
    .close("call")
    .open("call", &[("tool", "f"), ("index", "2")])
    .open("json", &[("type", "object")])
    .t("{oops")
    .close("json")
    .close("call")
    .close("tools")
    .close("message")
    .m(EOM)
    .open(
        "message",
        &[("role", "tool"), ("tool", "get_weather"), ("index", "1")],
    )
    .t("22C")
    .close("message")
    .m(EOM)
    .open(
        "message",
        &[("role", "tool"), ("tool", "f"), ("index", "2")],
    )
    .t("error")
    .close("message")
    .m(EOM)
    .open("message", &[("role", "assistant")])
    .open("think", &[]);
    assert_eq!(got, e.0);
}

/// Attribute pieces are separate encodes: a tool name ending in punctuation does not merge with
/// the closing quote (one-segment rendering would give other ids).
#[test]
fn attribute_values_are_encoded_on_their_own() {
    let f = ChatFormat::new(tok(), None).unwrap();
    let history = [Message::assistant_calls(
        "",
        None,
        vec![ToolCall {
            name: "get!".into(),
            arguments: Arguments::Object(Default::default()),
        }],
    )];
    let got = f.render_with(&history, &Options::default(), false).unwrap();
    let mut e = Expect::default();
    e.open("message", &[("role", "assistant")])
        .open("response", &[])
        .close("response")
        .open("tools", &[])
        .open("call", &[("tool", "get!"), ("index", "1")])
        .close("call")
        .close("tools")
        .close("message")
        .m(EOM);
    assert_eq!(got, e.0);
    let one_segment = tok().encode_with_special(
        "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|><|close|>response<|sep|>\
         <|open|>tools<|sep|><|open|>call tool=\"get!\" index=\"1\"<|sep|><|close|>call<|sep|>\
         <|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
    );
    assert_ne!(got, one_segment, "`!\"` would merge in one segment");
}

#[test]
fn a_tool_message_needs_a_name() {
    let f = ChatFormat::new(tok(), None).unwrap();
    assert!(f
        .render_with(&[Message::tool("", "x")], &Options::default(), true)
        .is_err());
}

fn markers() -> Markers {
    Markers::from_tokenizer(tok()).unwrap()
}

/// Feed `text` (specials allowed) id by id; collect the events, then the end.
fn parse(declared: &[&str], text: &str, end: bool) -> Vec<ToolEvent> {
    let declared = (!declared.is_empty()).then(|| declared.iter().map(|s| s.to_string()).collect());
    let mut p = CallParser::new(markers(), declared);
    let mut out: Vec<ToolEvent> = tok()
        .encode_with_special(text)
        .into_iter()
        .filter_map(|id| p.push(tok(), id))
        .collect();
    if end {
        out.extend(p.end(tok()));
    }
    out
}

fn call(name: &str, args: serde_json::Value) -> ToolEvent {
    ToolEvent::Call(ParsedCall {
        name: name.into(),
        arguments: args.as_object().unwrap().clone(),
    })
}

#[test]
fn generated_calls_parse_with_their_types() {
    let reply =
        "check first<|close|>think<|sep|><|open|>response<|sep|>On it.<|close|>response<|sep|>\
        <|open|>tools<|sep|><|open|>call tool=\"weather&amp;alerts\" index=\"1\"<|sep|>\
        <|open|>argument key=\"city\" type=\"string\"<|sep|> New York <|close|>argument<|sep|>\
        <|open|>argument key=\"days\" type=\"number\"<|sep|>2<|close|>argument<|sep|>\
        <|open|>argument key=\"hourly\" type=\"boolean\"<|sep|>true<|close|>argument<|sep|>\
        <|open|>argument key=\"tags\" type=\"array\"<|sep|>[\"a\", 1]<|close|>argument<|sep|>\
        <|close|>call<|sep|><|open|>call tool=\"write_file\" index=\"2\"<|sep|>\
        <|open|>json type=\"object\"<|sep|>{\"count\":7,\"content\":\"x<y\"}<|close|>json<|sep|>\
        <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";
    let got = parse(&["weather&alerts", "write_file"], reply, true);
    assert_eq!(
        got,
        vec![
            call(
                "weather&alerts",
                json!({"city": " New York ", "days": 2, "hourly": true, "tags": ["a", 1]})
            ),
            call("write_file", json!({"count": 7, "content": "x<y"})),
        ]
    );
    // Argument order is kept as generated.
    let ToolEvent::Call(c) = &got[0] else {
        unreachable!()
    };
    let keys: Vec<&str> = c.arguments.keys().map(String::as_str).collect();
    assert_eq!(keys, ["city", "days", "hourly", "tags"]);
}

#[test]
fn rendered_calls_parse_back_to_themselves() {
    let f = ChatFormat::new(tok(), None).unwrap();
    let args = json!({"q": "K3 <b>&\"x\"", "n": 1.5, "o": {"z": null}, "l": []});
    let ids = f
        .render_with(
            &[Message::assistant_calls(
                "",
                None,
                vec![ToolCall {
                    name: "search".into(),
                    arguments: Arguments::Object(args.as_object().unwrap().clone()),
                }],
            )],
            &Options::default(),
            false,
        )
        .unwrap();
    let mut p = CallParser::new(markers(), Some(vec!["search".into()]));
    let events: Vec<ToolEvent> = ids.iter().filter_map(|&id| p.push(tok(), id)).collect();
    assert_eq!(events, vec![call("search", args)]);
}

fn malformed(events: &[ToolEvent]) -> Vec<(MalformedCall, String)> {
    events
        .iter()
        .filter_map(|e| match e {
            ToolEvent::Malformed(m) => Some((m.reason.clone(), m.raw.clone())),
            ToolEvent::Call(_) => None,
        })
        .collect()
}

#[test]
fn malformed_calls_are_reported_with_their_text_and_the_next_call_still_parses() {
    let bad = "<|open|>call tool=\"lookup\" index=\"1\"<|sep|><|open|>argument key=\"n\" \
               type=\"number\"<|sep|>many<|close|>argument<|sep|><|close|>call<|sep|>";
    let good = "<|open|>call tool=\"lookup\" index=\"2\"<|sep|><|open|>argument key=\"n\" \
                type=\"integer\"<|sep|>4<|close|>argument<|sep|><|close|>call<|sep|>";
    let text = format!("<|open|>tools<|sep|>{bad}{good}<|close|>tools<|sep|>");
    let got = parse(&["lookup"], &text, true);
    assert_eq!(got.len(), 2);
    assert_eq!(
        malformed(&got),
        vec![(
            MalformedCall::BadValue {
                key: "n".into(),
                kind: "number".into()
            },
            bad.to_string()
        )]
    );
    assert_eq!(got[1], call("lookup", json!({"n": 4})));

    let cases: Vec<(&str, MalformedCall)> = vec![
        (
            "<|open|>tools<|sep|><|open|>call tool=\"rm\" index=\"1\"<|sep|><|close|>call<|sep|>",
            MalformedCall::UnknownTool("rm".into()),
        ),
        (
            "<|open|>tools<|sep|><|open|>call tool=\"lookup\" index=\"1\"<|sep|><|open|>argument \
             key=\"q\" type=\"string\"<|sep|>unfinished",
            MalformedCall::Incomplete,
        ),
        (
            "<|open|>tools<|sep|>chatter<|open|>call tool=\"lookup\"<|sep|><|close|>call<|sep|>",
            MalformedCall::StrayText,
        ),
        (
            "<|open|>tools<|sep|><|open|>call tool=\"lookup\"<|sep|><|open|>argument key=\"a\" \
             type=\"string\"<|sep|>1<|close|>argument<|sep|><|open|>argument key=\"a\" \
             type=\"string\"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|>",
            MalformedCall::DuplicateArgument("a".into()),
        ),
        (
            "<|open|>tools<|sep|><|open|>call tool=\"lookup\"<|sep|><|open|>json \
             type=\"object\"<|sep|>[1]<|close|>json<|sep|><|close|>call<|sep|>",
            MalformedCall::BadJson,
        ),
        (
            "<|open|>tools<|sep|><|open|>call tool=\"lookup\"<|sep|><|open|>argument key=\"a\" \
             type=\"date\"<|sep|>x<|close|>argument<|sep|><|close|>call<|sep|>",
            MalformedCall::UnknownType {
                key: "a".into(),
                kind: "date".into(),
            },
        ),
        (
            "<|open|>tools<|sep|><|open|>call index=\"1\"<|sep|><|close|>call<|sep|>",
            MalformedCall::MissingAttribute("a call has no tool name"),
        ),
        (
            "<|open|>tools<|sep|><|open|>call tool=\"lookup\"<|sep|><|open|>think<|sep|>\
             <|close|>call<|sep|>",
            MalformedCall::UnexpectedTag("think".into()),
        ),
    ];
    for (text, reason) in cases {
        let got = malformed(&parse(&["lookup"], text, true));
        assert_eq!(got.len(), 1, "{text}: {got:?}");
        assert_eq!(got[0].0, reason, "{text}");
        assert!(!got[0].1.is_empty());
    }
}

#[test]
fn an_end_id_inside_a_call_reports_it_and_text_outside_tools_is_ignored() {
    let mut p = CallParser::new(markers(), None);
    let mut events = Vec::new();
    for id in tok().encode_with_special(
        "plain <|open|>response<|sep|>text<|close|>response<|sep|><|open|>tools<|sep|>\
         <|open|>call tool=\"x\"<|sep|>",
    ) {
        events.extend(p.push(tok(), id));
    }
    assert!(events.is_empty());
    assert!(p.in_tools());
    events.extend(p.push(tok(), EOS));
    assert_eq!(malformed(&events)[0].0, MalformedCall::Incomplete);
    assert_eq!(
        malformed(&events)[0].1,
        "<|open|>call tool=\"x\"<|sep|>[EOS]"
    );
    assert!(!p.in_tools());
    // No tools element at all: nothing to report.
    assert!(parse(&[], "just words<|close|>message<|sep|><|end_of_msg|>", true).is_empty());
    // No tool may be called (none declared, or tool_choice none): a call is reported.
    let mut p = CallParser::new(markers(), Some(vec![]));
    let events: Vec<ToolEvent> = tok()
        .encode_with_special(
            "<|open|>tools<|sep|><|open|>call tool=\"x\"<|sep|><|close|>call<|sep|>",
        )
        .into_iter()
        .filter_map(|id| p.push(tok(), id))
        .collect();
    assert_eq!(
        malformed(&events)[0].0,
        MalformedCall::UnknownTool("x".into())
    );
}
