//! Constrained decoding's cost per token over the real 163,840-id vocabulary: the time to
//! compute one step's mask ([`Constraint::mask`]) and to commit the picked id, for JSON output
//! (`json_object`, a `json_schema`) and a required tool call, along replies drawn by a seeded
//! random sampler under the mask (the ids the mask allows; the walk covers strings, numbers,
//! nesting and the XTML markers). Thinking is off, so every step is inside the structure (a
//! think channel's free text is the cheapest part of a grammar).
//!
//! `cargo bench -p k3-worker --bench mask [-- --steps N] [--json PATH]` (`K3_BENCH_JSON=PATH`
//! works too): per grammar, the vocabulary build and grammar compile times, then the mask time
//! per token (mean, p50, p90, p99, max, in µs) and the commit time (mean), as JSON on stdout.
//! Time figures depend on the machine's load: take them on a quiet machine.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use k3_worker::constrain::{Constraint, Spec, Vocab};
use k3_worker::text::tools::ToolSpec;
use k3_worker::tokenizer::Tokenizer;
use serde_json::{json, Value};

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Masks and commits of `steps` ids along seeded replies (a new reply when one ends).
fn run(tok: &Tokenizer, vocab: &Vocab, spec: &Spec, steps: usize) -> Value {
    let t0 = Instant::now();
    let mut c = Constraint::new(vocab, spec, false).expect("the grammar compiles");
    let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut rng = Rng(7);
    let (mut masks, mut commits) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
    let ends = [vocab.ids().end_of_msg, vocab.ids().eos];
    let mut replies = 1;
    for _ in 0..steps {
        let t = Instant::now();
        let m = c.mask().expect("a mask");
        masks.push(t.elapsed().as_secs_f64() * 1e6);
        let allowed = m.allowed();
        // Three picks in four among specials and `"}],` tokens, so replies end.
        let closing: Vec<u32> = allowed
            .iter()
            .copied()
            .filter(|&id| {
                id >= tok.n_ranks()
                    || tok
                        .token_bytes(id)
                        .is_some_and(|b| !b.is_empty() && b.iter().all(|c| b"\"}],".contains(c)))
            })
            .collect();
        let r = rng.next();
        let id = if !r.is_multiple_of(4) && !closing.is_empty() {
            closing[(r / 4) as usize % closing.len()]
        } else {
            allowed[(r / 4) as usize % allowed.len()]
        };
        let t = Instant::now();
        c.commit(id).expect("an allowed id");
        commits.push(t.elapsed().as_secs_f64() * 1e6);
        if ends.contains(&id) {
            c = Constraint::new(vocab, spec, false).expect("the grammar compiles");
            replies += 1;
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let mut sorted = masks.clone();
    sorted.sort_by(f64::total_cmp);
    json!({
        "steps": steps, "replies": replies, "compile_ms": compile_ms,
        "mask_us": {"mean": mean(&masks), "p50": quantile(&sorted, 0.5), "p90": quantile(&sorted, 0.9),
                    "p99": quantile(&sorted, 0.99), "max": sorted[sorted.len() - 1]},
        "commit_us_mean": mean(&commits),
    })
}

fn main() {
    let mut steps = 400;
    let mut out = std::env::var("K3_BENCH_JSON").ok();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--steps" => steps = args.next().and_then(|s| s.parse().ok()).expect("--steps N"),
            "--json" => out = args.next(),
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizer");
    let tok = Arc::new(Tokenizer::from_dir(&dir).expect("fixtures/tokenizer loads"));
    let t0 = Instant::now();
    let vocab = Vocab::new(tok.clone()).expect("the vocabulary builds");
    let vocab_ms = t0.elapsed().as_secs_f64() * 1e3;
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}},
        "required": ["name", "age"], "additionalProperties": false});
    let tools = vec![ToolSpec {
        name: "get_weather".into(),
        description: None,
        parameters: Some(
            json!({"type": "object", "properties": {"city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}),
        ),
        strict: None,
    }];
    let report = json!({
        "vocab_size": vocab.size(),
        "vocab_build_ms": vocab_ms,
        "threads_available": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "json_object": run(&tok, &vocab, &Spec::JsonObject, steps),
        "json_schema": run(&tok, &vocab, &Spec::JsonSchema { schema, strict: true }, steps),
        "tool_call": run(&tok, &vocab, &Spec::ToolCall { tools, parallel: true }, steps),
    });
    let text = serde_json::to_string_pretty(&report).expect("JSON");
    println!("{text}");
    if let Some(p) = out {
        std::fs::write(&p, text + "\n").expect("write the JSON");
    }
}
