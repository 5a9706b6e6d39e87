//! The `--batch FILE` job: many requests from a JSON Lines file, each a [`Request`] of the one
//! engine, up to `--parallel` decoded at once (one forward pass per step over all their rows,
//! drafted ids included); results as JSON Lines on stdout as sequences end (`index` = the
//! request's line order among the requests, `finish_reason`, `prompt_tokens`, `ids`, `text`
//! with --tok, `first_token_seconds` and `seconds` since the request joined), a line per step
//! and the totals on stderr (the run report), and with `--out` the report as JSON with a record
//! per request (its usage, timings and speculation counters).

use std::cell::RefCell;
use std::io::Write;
use std::path::{Path, PathBuf};

use k3_proto::serve::Finish;
use serde_json::{json, Value};

use crate::engine::outputs::{Finished, Flow, Outputs, Sink, StepReport};
use crate::engine::request::Request;
use crate::engine::runner::Engine;
use crate::engine::sampling::positions_needed;
use crate::front::cli::{Cli, MAX_BATCH_REQUESTS, MAX_GEN, MAX_PROMPT, MAX_PROMPT_FILE};
use crate::front::error::{read_bounded, refuse, JobError};
use crate::front::job::{job_shape, preflight, prepare, Prepared, DEFAULT_PARALLEL};
use crate::front::report::{self, RunSummary};
use crate::text::visible;
use crate::tokenizer::Tokenizer;

/// One request of a `--batch` file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchItem {
    /// The prompt's ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_new: usize,
}

/// A line of the file as written.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    prompt: Option<String>,
    ids: Option<Vec<u32>>,
    max_tokens: Option<u64>,
}

/// Parse a `--batch` file's text: one request per non-blank line; any bad line refuses the job
/// (exit 2) naming the file and the line.
pub fn parse(
    path: &Path,
    bytes: &[u8],
    tok: Option<&Tokenizer>,
    default_gen: u64,
) -> Result<Vec<BatchItem>, JobError> {
    let text = std::str::from_utf8(bytes)
        .map_err(|e| refuse(format!("{}: not UTF-8 ({e})", path.display())))?;
    let mut items = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |m: &dyn std::fmt::Display| refuse(format!("{}:{}: {m}", path.display(), i + 1));
        let l: Line = serde_json::from_str(line).map_err(|e| bad(&e))?;
        let prompt = match (l.prompt, l.ids) {
            (Some(text), None) => {
                let tok = tok.ok_or_else(|| bad(&"a \"prompt\" needs --tok DIR"))?;
                // User text is encoded with special tokens disabled (SPEC.md §5.2).
                tok.encode_bytes(text.as_bytes(), false)
                    .map_err(|e| bad(&format!("cannot tokenize the prompt: {e}")))?
            }
            (None, Some(ids)) => ids,
            _ => return Err(bad(&"give exactly one of \"prompt\" and \"ids\"")),
        };
        if prompt.is_empty() {
            return Err(bad(&"the prompt is empty"));
        }
        if prompt.len() > MAX_PROMPT {
            return Err(bad(&format!(
                "prompt of {} tokens exceeds the limit of {MAX_PROMPT}",
                prompt.len()
            )));
        }
        let max_new = l.max_tokens.unwrap_or(default_gen);
        if !(1..=MAX_GEN).contains(&max_new) {
            return Err(bad(&format!(
                "max_tokens {max_new} is outside 1..={MAX_GEN}"
            )));
        }
        if items.len() == MAX_BATCH_REQUESTS {
            return Err(bad(&format!(
                "more than {MAX_BATCH_REQUESTS} requests in one file"
            )));
        }
        items.push(BatchItem {
            prompt,
            max_new: max_new as usize,
        });
    }
    if items.is_empty() {
        return Err(refuse(format!(
            "{}: no requests (one JSON object per line)",
            path.display()
        )));
    }
    Ok(items)
}

/// The results so far: a record per finished request, and the first failed write.
#[derive(Debug, Default)]
struct Results {
    records: Vec<Value>,
    failed: Option<std::io::Error>,
}

/// One request's result line.
struct LineSink<'a> {
    index: usize,
    tok: Option<&'a Tokenizer>,
    results: &'a RefCell<Results>,
}

impl Sink for LineSink<'_> {
    fn token(&mut self, _: &StepReport) -> Flow {
        Flow::Continue
    }

    fn done(&mut self, f: &Finished) {
        let ids = &f.report.generated_ids;
        let text = self.tok.and_then(|t| visible::decode(t, ids).ok());
        let t = &f.timings;
        let line = json!({
            "index": self.index,
            "finish_reason": match f.finish {
                Finish::EndId(_) => "stop",
                Finish::Length => "length",
                Finish::Cancelled => "cancelled",
            },
            "prompt_tokens": f.usage.prompt_ids,
            "ids": ids,
            "text": text.map(|b| String::from_utf8_lossy(&b).into_owned()),
            "first_token_seconds": t.prefill_seconds,
            "seconds": t.prefill_seconds + t.decode_seconds,
        });
        let mut r = self.results.borrow_mut();
        let stdout = std::io::stdout();
        let mut o = stdout.lock();
        let written = writeln!(o, "{line}").and_then(|_| o.flush());
        if let (Err(e), None) = (written, &r.failed) {
            r.failed = Some(e);
        }
        let mut record = line;
        let spec = &f.report.spec;
        record["usage"] = json!(f.usage);
        record["timings"] = json!(t);
        record["forward_passes"] = spec.forward_passes.into();
        record["drafted_tokens"] = spec.drafted_tokens.into();
        record["accepted_tokens"] = spec.accepted_tokens.into();
        r.records.push(record);
    }
}

/// The `--batch FILE` job: the file read and checked before any work, then run to its end.
/// Exit code as a one-shot run's (4 when an expert failed to load).
pub fn run(cli: &Cli, matches: &clap::ArgMatches) -> Result<i32, JobError> {
    let wall = std::time::Instant::now();
    let pre = preflight(cli)?;
    let path = cli
        .batch
        .as_deref()
        .ok_or_else(|| refuse("no --batch FILE"))?;
    let bytes = read_bounded(path, MAX_PROMPT_FILE)?;
    let items = parse(path, &bytes, pre.tok.as_ref(), cli.gen)?;
    let longest = (items.iter())
        .map(|it| positions_needed(it.prompt.len(), it.max_new))
        .max()
        .unwrap_or(1);
    let all = items.iter().map(|it| it.prompt.len() + it.max_new).sum();
    let slots = cli.parallel.unwrap_or(DEFAULT_PARALLEL) as usize;
    let slots = slots.min(items.len()).max(1);
    let shape = job_shape(cli, &pre, slots, longest, longest, all);
    let job = prepare(cli, matches, pre, shape, wall)?;
    run_batch(cli, &job, &items)
}

/// Run the items on the prepared job's engine.
fn run_batch(cli: &Cli, job: &Prepared, items: &[BatchItem]) -> Result<i32, JobError> {
    let drafters = job.drafters(cli)?;
    let plan = job.shape.engine;
    let mut engine = Engine::new(job.model()?, plan);
    let results = RefCell::new(Results::default());
    let mut out = Outputs::new(job.opened.source.store());
    let tok = job.pre.tok.as_ref();
    for (index, it) in items.iter().enumerate() {
        let capacity = positions_needed(it.prompt.len(), it.max_new);
        let req = Request {
            spec: drafters.for_request(it.prompt.len(), capacity),
            ..Request::new(it.prompt.clone(), it.max_new, job.pre.sampler.clone())
        };
        let sink = LineSink {
            index,
            tok,
            results: &results,
        };
        engine
            .submit(req, Box::new(sink), &mut out)
            .map_err(|e| refuse(format!("request {} (line order): {e}", index + 1)))?;
    }
    eprintln!(
        "batch: {} requests, up to {} at once, at most {} prompt ids per step",
        items.len(),
        plan.slots,
        plan.prefill_rows
    );
    eprintln!(
        "{:>6} {:>5} {:>6} {:>7} {:>7} {:>9}",
        "step", "seqs", "rows", "prompt", "drafts", "seconds"
    );
    let (mut steps, mut decode_steps, mut decode_seconds) = (0usize, 0usize, 0.0);
    while !engine.is_idle() {
        let shape = engine.step(&mut out)?;
        steps += 1;
        if shape.prompt_rows == 0 {
            decode_steps += 1;
            decode_seconds += shape.seconds;
        }
        eprintln!(
            "{steps:>6} {:>5} {:>6} {:>7} {:>7} {:>10.5}",
            shape.seqs, shape.rows, shape.prompt_rows, shape.draft_rows, shape.seconds
        );
        if let Some(source) = results.borrow_mut().failed.take() {
            return Err(JobError::Output {
                path: PathBuf::from("<stdout>"),
                source,
                before_work: false,
            });
        }
    }
    let secs = job.wall.elapsed().as_secs_f64();
    let records = std::mem::take(&mut results.borrow_mut().records);
    let generated: u64 = (records.iter())
        .map(|r| r["usage"]["generated"].as_u64().unwrap_or(0))
        .sum();
    eprintln!(
        "batch: {generated} tokens for {} requests in {steps} steps, {secs:.3} s: {:.2} tokens/s{}",
        items.len(),
        generated as f64 / secs.max(1e-9),
        if decode_steps > 0 {
            format!(
                "; decode-only steps: {decode_steps}, {:.4} s each",
                decode_seconds / decode_steps as f64
            )
        } else {
            String::new()
        }
    );
    let summary = RunSummary::collect(engine.model(), secs);
    if let Some(path) = &cli.out {
        let v = report_json(&summary, records, steps, job.opened.plan_bytes);
        report::written(report::write_json(path, &v))?;
    }
    Ok(summary.exit_code())
}

/// The `--out` report of a batch: the totals and a record per request, in the order they
/// ended.
fn report_json(summary: &RunSummary, mut records: Vec<Value>, steps: usize, plan: u64) -> Value {
    records.sort_by_key(|r| r["index"].as_u64());
    let st = &summary.stats;
    json!({
        "mode": "batch",
        "requests": records,
        "steps": steps,
        "wall_seconds": summary.wall,
        "bytes_read": st.trunk_bytes_read + st.expert_bytes_read,
        "trunk_bytes_read": st.trunk_bytes_read,
        "expert_bytes_read": st.expert_bytes_read,
        "expert_requests": st.expert_requests,
        "resident_hits": st.resident_hits,
        "failed_expert_loads": summary.counters.failed_expert_loads,
        "peak_rss_bytes": summary.peak,
        "memory_plan_bytes": plan,
        "trunk": report::trunk_json(&summary.trunk),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Result<Vec<BatchItem>, String> {
        parse(Path::new("b.jsonl"), text.as_bytes(), None, 8).map_err(|e| e.to_string())
    }

    #[test]
    fn lines_become_requests_and_bad_lines_name_themselves() {
        let got = p("{\"ids\": [1, 2]}\n\n{\"ids\": [3], \"max_tokens\": 5}\n").unwrap();
        assert_eq!(
            got,
            [
                BatchItem {
                    prompt: vec![1, 2],
                    max_new: 8
                },
                BatchItem {
                    prompt: vec![3],
                    max_new: 5
                }
            ]
        );
        for (text, want) in [
            (
                "{\"ids\": [1]}\n{\"ids\": []}\n",
                "b.jsonl:2: the prompt is empty",
            ),
            (
                "{\"prompt\": \"hi\"}",
                "b.jsonl:1: a \"prompt\" needs --tok DIR",
            ),
            ("{\"ids\": [1], \"prompt\": \"x\"}", "exactly one of"),
            (
                "{\"ids\": [1], \"max_tokens\": 0}",
                "max_tokens 0 is outside",
            ),
            ("{\"ids\": [1], \"max_tokens\": 4097}", "max_tokens 4097"),
            ("{\"ids\": [1], \"temperature\": 1}", "unknown field"),
            ("[1, 2]", "b.jsonl:1:"),
            ("\n  \n", "no requests"),
        ] {
            let e = p(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        assert!(parse(Path::new("b"), &[0xff, 0xfe], None, 8).is_err());
        let many = "{\"ids\": [1]}\n".repeat(MAX_BATCH_REQUESTS + 1);
        assert!(p(&many).unwrap_err().contains("more than 4096"));
    }
}
