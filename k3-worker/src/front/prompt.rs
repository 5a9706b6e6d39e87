//! The one-shot jobs (`--ids`, `--prompt`, `--prompt-file`): one request through the engine,
//! its ids to standard output ([`Stdout`]), its run report on stderr and in `--out`, and the
//! dumps (`--dump-logits`, `--dump-cache-trace`, `--dump-hidden`).
//!
//! On stderr the step table and the totals are the run report the user asked for (printed as
//! such); everything else there is the log (`tracing`).

use std::io::Write;

use k3_store::attach::AttachedSource;

use crate::engine::outputs::{Finished, Flow, Outputs, Sink, StepReport};
use crate::engine::request::{Held, Request, SessionPlan};
use crate::engine::runner::Engine;
use crate::engine::sampling::positions_needed;
use crate::engine::session::{self, ForPrompt};
use crate::front::cli::{Cli, MAX_PROMPT, MAX_PROMPT_FILE};
use crate::front::drafters::Drafters;
use crate::front::error::{read_bounded, refuse, JobError};
use crate::front::job::{job_shape, preflight, prepare, Prepared};
use crate::front::report::{self, HiddenDump, RunSummary};
use crate::model::Dims;
use crate::text::visible;
use crate::tokenizer::Tokenizer;

/// Standard output: each id as text (with a tokenizer; an added token prints nothing:
/// [`visible`]) or as its number and a space, flushed per id; a newline at the end. With
/// `table`, the step table's row of each id on stderr.
#[derive(Debug)]
pub struct Stdout<'t> {
    /// Decode ids to text with this tokenizer.
    pub tok: Option<&'t Tokenizer>,
    /// Print the step table on stderr (the run report).
    pub table: bool,
}

impl Sink for Stdout<'_> {
    fn token(&mut self, s: &StepReport) -> Flow {
        if self.table {
            eprintln!("{}", report::step_line(s));
        }
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        let text = self.tok.and_then(|t| visible::decode(t, &[s.token]).ok());
        let _ = match text {
            Some(bytes) => out.write_all(&bytes),
            None => write!(out, "{} ", s.token),
        };
        let _ = out.flush();
        Flow::Continue
    }

    fn done(&mut self, _: &Finished) {
        println!();
    }
}

/// The one-shot job: the prompt read and encoded, one request run; the exit code (0, or 4 when
/// an expert failed to load).
pub fn run(cli: &Cli, matches: &clap::ArgMatches) -> Result<i32, JobError> {
    let wall = std::time::Instant::now();
    let pre = preflight(cli)?;
    let prompt = prompt_ids(cli, pre.tok.as_ref())?;
    let n = positions_needed(prompt.len(), cli.gen as usize);
    let shape = job_shape(cli, &pre, 1, n, n, n);
    let job = prepare(cli, matches, pre, shape, wall)?;
    run_prompt(cli, &job, &prompt)
}

/// The prompt ids, from the one prompt source clap allowed.
fn prompt_ids(cli: &Cli, tok: Option<&Tokenizer>) -> Result<Vec<u32>, JobError> {
    let ids = if let Some(ids) = &cli.ids {
        ids.clone()
    } else {
        let tok = tok.ok_or_else(|| refuse("--prompt/--prompt-file need --tok DIR"))?;
        let bytes = match (&cli.prompt, &cli.prompt_file) {
            (Some(p), _) => p.as_bytes().to_vec(),
            (None, Some(path)) => read_bounded(path, MAX_PROMPT_FILE)?,
            (None, None) => return Err(refuse("no prompt given")),
        };
        // User text is encoded with special tokens disabled (SPEC.md §5.2).
        tok.encode_bytes(&bytes, false)
            .map_err(JobError::Tokenize)?
    };
    if ids.is_empty() {
        return Err(refuse("the prompt is empty"));
    }
    if ids.len() > MAX_PROMPT {
        return Err(refuse(format!(
            "prompt of {} tokens exceeds the limit of {MAX_PROMPT}",
            ids.len()
        )));
    }
    Ok(ids)
}

/// Run `prompt` as one request of the prepared job.
fn run_prompt(cli: &Cli, job: &Prepared, prompt: &[u32]) -> Result<i32, JobError> {
    let drafters = job.drafters(cli)?;
    let mut model = job.model()?;
    if cli.dump_cache_trace.is_some() {
        model.trace = Some(Vec::new());
    }
    let hidden = HiddenDump::default();
    if cli.dump_hidden.is_some() {
        model.tap = Some(hidden.tap(model.dims.n_layers));
    }
    let store = job.opened.source.store();
    let gen = cli.gen as usize;
    let capacity = positions_needed(prompt.len(), gen);
    let session = cli.session.as_deref().zip(store);
    let from = session.and_then(|(name, src)| resume(src, name, &model.dims, capacity, prompt));
    let reused = from.as_ref().map_or(0, |h| h.ids.len());
    let req = Request {
        spec: drafters.for_request(prompt.len(), capacity),
        from,
        session: cli.session.clone().map(|name| SessionPlan {
            name,
            after_prefill: false,
            keep_at: Vec::new(),
            name_key: Vec::new(),
        }),
        full_recompute: cli.full_recompute,
        keep_step0_logits: cli.dump_logits.is_some(),
        hand_back: true,
        ..Request::new(prompt.to_vec(), gen, job.pre.sampler.clone())
    };
    let mut engine = Engine::new(model, job.shape.engine);
    let mut out = Outputs::new(store);
    let tok = job.pre.tok.as_ref();
    echo_prompt(tok, prompt);
    eprintln!("{}", report::STEP_HEADER);
    let seq = engine.submit(req, Box::new(Stdout { tok, table: true }), &mut out)?;
    engine.run_to_end(&mut out)?;
    let ended = out.take_ended(seq).expect("the request asked for its end");
    let fin = &ended.finished;
    let summary = RunSummary::collect(engine.model(), job.wall.elapsed().as_secs_f64());
    summary.print_totals(&fin.report);
    let draft_cost = Drafters::model_cost(&ended.spec);
    if let Some((calls, seconds)) = draft_cost {
        eprintln!("draft model: {calls} forward calls, {seconds:.3} s (inside the decode seconds)");
    }
    if let Some(path) = &cli.dump_logits {
        let logits = fin.report.step0_logits.as_deref().unwrap_or(&[]);
        report::written(report::write_logits(path, logits))?;
    }
    if let (Some(dir), Some(trace)) = (&cli.dump_cache_trace, engine.model().trace.as_ref()) {
        report::written(report::write_trace(dir, trace))?;
    }
    if let Some(dir) = &cli.dump_hidden {
        report::written(hidden.write(dir, engine.model().dims.hidden))?;
    }
    if let Some(path) = &cli.out {
        let mut v = summary.json(&fin.report);
        v["memory_plan_bytes"] = job.opened.plan_bytes.into();
        v["prefill_chunk"] = job.shape.engine.prefill_budget().into();
        if let Some((calls, seconds)) = draft_cost {
            v["draft_model"] = serde_json::json!({"forward_calls": calls, "seconds": seconds});
        }
        if let Some(name) = &cli.session {
            v["session"] = serde_json::json!({
                "name": name,
                "reused": reused,
                "prefilled": prompt.len() - reused,
                "kept_bytes": fin.timings.kept_session_bytes,
            });
        }
        report::written(report::write_json(path, &v))?;
    }
    Ok(summary.exit_code())
}

/// The state a one-shot run starts from: the kept session `name` when the ids it holds are a
/// strict prefix of `prompt` (then only the rest is prefilled), else none; says which.
fn resume(
    src: &AttachedSource,
    name: &str,
    dims: &Dims,
    capacity: usize,
    prompt: &[u32],
) -> Option<Held> {
    match session::fetch_for_prompt(src, name, dims, capacity, prompt) {
        Ok(ForPrompt::Restored(r)) => {
            let from = r.held.len();
            tracing::info!(
                "session {name}: resumed; {from} of the prompt's {} ids already held, prefilling {}",
                prompt.len(),
                prompt.len() - from
            );
            Some(r.into_held())
        }
        Ok(ForPrompt::NotPrefix(n)) => {
            tracing::info!(
                "session {name}: the {n} ids it holds are not a prefix of this prompt; prefilling the whole prompt"
            );
            None
        }
        Ok(ForPrompt::Missing) => {
            tracing::info!("session {name}: new (the store has none of that name)");
            None
        }
        Err(e) => {
            tracing::warn!("session {name}: not resumed ({e}); prefilling the whole prompt");
            None
        }
    }
}

/// On a terminal, stdout shows the prompt's text (dimmed) before the generated text, so the
/// continuation reads in place; piped or redirected, stdout is the generated text alone.
fn echo_prompt(tok: Option<&Tokenizer>, prompt: &[u32]) {
    use std::io::IsTerminal;
    let stdout = std::io::stdout();
    if !stdout.is_terminal() {
        return;
    }
    if let Some(text) = tok.and_then(|t| visible::decode(t, prompt).ok()) {
        let mut out = stdout.lock();
        let _ = out.write_all(b"\x1b[2m");
        let _ = out.write_all(&text);
        let _ = out.write_all(b"\x1b[0m");
        let _ = out.flush();
    }
}
