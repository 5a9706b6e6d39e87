//! K3's XTML tool-call parser (k3-worker/src/text/tools.rs, `CallParser`) on the real
//! vocabulary: any id stream (text with the markers spelled out, or raw ids biased towards the
//! markers) gives events or nothing, never a panic; the reply's end reports a call left open;
//! a malformed call keeps its text; and every call that parses renders back (§5.5) to ids that
//! parse to the same call.
#![no_main]

use std::sync::OnceLock;

use k3_fuzz::repo_root;
use k3_worker::text::xtml::{ChatFormat, Markers, Message, Options};
use k3_worker::text::tools::{Arguments, CallParser, ToolCall, ToolEvent};
use k3_worker::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

fn tok() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_dir(&repo_root().join("fixtures/tokenizer")).expect("tokenizer"))
}

fn parse(ids: &[u32]) -> Vec<ToolEvent> {
    let m = Markers::from_tokenizer(tok()).expect("markers");
    let mut p = CallParser::new(m, None);
    let mut out: Vec<ToolEvent> = ids.iter().filter_map(|&id| p.push(tok(), id)).collect();
    out.extend(p.end(tok()));
    assert!(!p.in_tools());
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let ids: Vec<u32> = if mode % 2 == 0 {
        tok().encode_with_special(&String::from_utf8_lossy(rest))
    } else {
        rest.chunks(2)
            .map(|c| {
                let v = u32::from(c[0]) << 8 | u32::from(*c.get(1).unwrap_or(&0));
                // One in four: a marker or an end id (163584 + 1..=5).
                if v % 4 == 0 {
                    163_585 + (v / 4) % 5
                } else {
                    v % 163_584
                }
            })
            .collect()
    };
    let f = ChatFormat::new(tok(), None).expect("chat format");
    for e in parse(&ids) {
        match e {
            ToolEvent::Malformed(m) => assert!(!m.raw.is_empty()),
            ToolEvent::Call(c) => {
                let call = ToolCall {
                    name: c.name.clone(),
                    arguments: Arguments::Object(c.arguments.clone()),
                };
                let Ok(again) = f.render_with(
                    &[Message::assistant_calls("", None, vec![call])],
                    &Options::default(),
                    false,
                ) else {
                    continue;
                };
                let back = parse(&again);
                assert_eq!(back, vec![ToolEvent::Call(c)]);
            }
        }
    }
});
