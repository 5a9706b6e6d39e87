//! The `--batch FILE` job: many requests from a JSON Lines file, up to `--parallel` decoded at
//! once by [`crate::batch::Batch`] (one forward pass per step over all their rows); results as
//! JSON Lines on stdout as sequences end (`index` = the request's line order among the
//! requests, `finish_reason`, `prompt_tokens`, `ids`, `text` with --tok, `first_token_seconds`
//! and `seconds` since the request joined the batch), a line per step and the totals on stderr.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::batch::{Batch, Finish, SeqRequest};
use crate::cli::{Cli, MAX_BATCH_REQUESTS, MAX_GEN, MAX_PROMPT};
use crate::generate::{Sampler, END_IDS};
use crate::job::JobError;
use crate::model::state::{PassShape, SeqState, Work};
use crate::model::{Dims, Model};
use crate::report;
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
        .map_err(|e| JobError::Refused(format!("{}: not UTF-8 ({e})", path.display())))?;
    let mut items = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |m: &dyn std::fmt::Display| {
            JobError::Refused(format!("{}:{}: {m}", path.display(), i + 1))
        };
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
        return Err(JobError::Refused(format!(
            "{}: no requests (one JSON object per line)",
            path.display()
        )));
    }
    Ok(items)
}

/// Sequences decoded at once (`--parallel`, default 4).
pub fn parallel(cli: &Cli) -> usize {
    cli.parallel.unwrap_or(DEFAULT_PARALLEL) as usize
}

/// `--parallel` when not given.
pub const DEFAULT_PARALLEL: u64 = 4;

/// Prompt rows a step of the batch may run: `--prefill-chunk`, or (0) every waiting prompt.
pub fn step_prompt_rows(cli: &Cli, seqs: usize, positions: usize) -> usize {
    let all = seqs * positions.max(1);
    if cli.prefill_chunk == 0 {
        all
    } else {
        cli.prefill_chunk.min(all)
    }
}

/// The buffers of the batch's passes, stated by their owners: a pass of `prompt_rows` + `seqs`
/// rows with `seqs` logits rows (and each sequence's copy of its logits), over contexts of up
/// to `positions`. The sequences' states are counted apart ([`SeqState::bytes_for`] each).
pub fn pass_bytes(dims: &Dims, positions: usize, prompt_rows: usize, seqs: usize) -> u64 {
    Work::bytes_for(
        dims,
        &PassShape {
            rows: prompt_rows + seqs,
            logits_rows: seqs,
            context: positions,
            journaled: false,
            threads: rayon::current_num_threads(),
        },
    ) + 4 * (seqs * dims.vocab) as u64
}

/// The states of `seqs` sequences of up to `positions` each.
pub fn states_bytes(dims: &Dims, positions: usize, seqs: usize) -> u64 {
    seqs as u64 * SeqState::bytes_for(dims, positions)
}

/// Run the batch to its end. Exit code as a one-shot run's (expert failures make it 1).
pub fn run(
    cli: &Cli,
    model: &mut Model<'_>,
    tok: Option<&Tokenizer>,
    sampler: &Sampler,
    items: &[BatchItem],
    wall: Instant,
) -> Result<i32, JobError> {
    let parallel = parallel(cli).min(items.len());
    let mut batch = Batch::new(cli.prefill_chunk);
    let mut waiting = items.iter().enumerate();
    let mut index: HashMap<u64, usize> = HashMap::new();
    let mut ids: Vec<Vec<u32>> = vec![Vec::new(); items.len()];
    // When each request joined, and how long after that its first id came.
    let mut joined: Vec<Option<Instant>> = vec![None; items.len()];
    let mut first_token: Vec<Option<f64>> = vec![None; items.len()];
    let stdout = std::io::stdout();
    let written = |source| JobError::Output {
        path: PathBuf::from("<stdout>"),
        source,
        before_work: false,
    };
    eprintln!(
        "batch: {} requests, up to {parallel} at once, at most {} prompt ids per step",
        items.len(),
        if cli.prefill_chunk == 0 {
            "all".to_string()
        } else {
            cli.prefill_chunk.to_string()
        }
    );
    eprintln!(
        "{:>6} {:>5} {:>6} {:>7} {:>9}",
        "step", "seqs", "rows", "prompt", "seconds"
    );
    let (mut steps, mut generated, mut decode_steps) = (0usize, 0usize, 0usize);
    let mut decode_seconds = 0.0;
    loop {
        while batch.len() < parallel {
            let Some((i, it)) = waiting.next() else {
                break;
            };
            let seq = batch.join(
                model,
                SeqRequest {
                    prompt: it.prompt.clone(),
                    max_new: it.max_new,
                    sampler: sampler.clone(),
                    stop_ids: END_IDS.to_vec(),
                    pause_before_last: false,
                },
            )?;
            index.insert(seq, i);
            joined[i] = Some(Instant::now());
        }
        if batch.is_empty() {
            break;
        }
        let step = batch.step(model)?;
        let (out, shape) = (step.emitted, step.shape);
        steps += 1;
        if shape.prompt_rows == 0 {
            decode_steps += 1;
            decode_seconds += shape.seconds;
        }
        eprintln!(
            "{steps:>6} {:>5} {:>6} {:>7} {:>10.5}",
            shape.seqs, shape.rows, shape.prompt_rows, shape.seconds
        );
        for e in out {
            let i = index[&e.seq];
            ids[i].push(e.token);
            generated += 1;
            let since = joined[i].map_or(0.0, |t| t.elapsed().as_secs_f64());
            first_token[i].get_or_insert(since);
            let Some(finish) = e.finish else {
                continue;
            };
            let text = tok.and_then(|t| t.decode(&ids[i]).ok());
            let line = serde_json::json!({
                "index": i,
                "finish_reason": match finish {
                    Finish::Stop(_) => "stop",
                    Finish::Length => "length",
                },
                "prompt_tokens": items[i].prompt.len(),
                "ids": ids[i],
                "text": text.map(|b| String::from_utf8_lossy(&b).into_owned()),
                "first_token_seconds": first_token[i],
                "seconds": joined[i].map(|t| t.elapsed().as_secs_f64()),
            });
            let mut o = stdout.lock();
            writeln!(o, "{line}").map_err(written)?;
            o.flush().map_err(written)?;
        }
    }
    let secs = wall.elapsed().as_secs_f64();
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
    let summary = report::RunSummary::collect(model, secs);
    Ok(summary.exit_code())
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
