//! `--perplexity FILE`: a text scored with teacher forcing ([`crate::eval`]) — mean NLL and
//! perplexity, and against a saved base KL divergence and top-1 agreement — on stderr and in
//! `--out`. No id is generated: the model runs the text's windows itself, not the engine.

use std::path::Path;

use k3_store::runtime::trunk::Interrupt;

use crate::eval::PplJob;
use crate::front::cli::{Cli, MAX_PROMPT_FILE};
use crate::front::error::{read_bounded, refuse, JobError};
use crate::front::job::{job_shape, preflight, prepare, Prepared};
use crate::front::report;
use crate::tokenizer::Tokenizer;

/// The scoring job: the text read (bounded) and tokenized as user text, its windows scored;
/// the exit code (0, or 4 when an expert failed to load).
pub fn run(cli: &Cli, matches: &clap::ArgMatches) -> Result<i32, JobError> {
    let wall = std::time::Instant::now();
    let pre = preflight(cli)?;
    let Some(path) = cli.perplexity.as_deref() else {
        return Err(refuse("no text to score"));
    };
    let job = read_job(cli, path, pre.tok.as_ref())?;
    // One window's sequence at a time; every id of the text, and a BOS a window, is embedded.
    let window = job.window.min(job.ids.len());
    let windows = job.ids.len().div_ceil(job.window.max(1));
    let mut shape = job_shape(cli, &pre, 1, window, window, job.ids.len() + windows);
    shape.scoring = true;
    shape.auto_prefill = false;
    let prepared = prepare(cli, matches, pre, shape, wall)?;
    let vocab = prepared.opened.dims.vocab;
    if let Some(&bad) = job.ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(refuse(format!(
            "{}: id {bad} outside the vocabulary of {vocab}",
            path.display()
        )));
    }
    score(cli, &prepared, job)
}

/// The text of `path` read (bounded) and tokenized as user text.
fn read_job(cli: &Cli, path: &Path, tok: Option<&Tokenizer>) -> Result<PplJob, JobError> {
    let tok = tok.ok_or_else(|| refuse("--perplexity needs --tok DIR"))?;
    let bytes = read_bounded(path, MAX_PROMPT_FILE)?;
    let ids = tok
        .encode_bytes(&bytes, false)
        .map_err(|e| refuse(format!("cannot tokenize {}: {e}", path.display())))?;
    if ids.is_empty() {
        return Err(refuse(format!("{} has no text to score", path.display())));
    }
    let bos = tok
        .bos_id()
        .ok_or_else(|| refuse("the tokenizer has no bos_token to start each window with"))?;
    Ok(PplJob {
        ids,
        bos,
        window: cli.ppl_window as usize,
        save: cli.save_logprobs.clone(),
        base: cli.kl_base.clone(),
        codec: String::new(),
    })
}

/// Score the text (crate::eval), print the figures, write `--out`. SIGINT and SIGTERM stop it
/// between forward calls (a base being saved is removed).
fn score(cli: &Cli, job: &Prepared, mut ppl: PplJob) -> Result<i32, JobError> {
    let mut model = job.model()?;
    let trunk = model.source().trunk();
    ppl.codec = trunk.codec.clone();
    let stop = Interrupt::on_signals()
        .map_err(|e| refuse(format!("cannot handle SIGINT/SIGTERM: {e}")))?;
    let r = crate::eval::run(&mut model, &ppl, &|| stop.signal())?;
    crate::eval::print(&r, &trunk);
    if let Some(path) = &cli.out {
        let v = serde_json::json!({
            "mode": "perplexity",
            "text": cli.perplexity,
            "perplexity": r,
            "trunk": report::trunk_json(&trunk),
            "wall_seconds": job.wall.elapsed().as_secs_f64(),
            "peak_rss_bytes": report::peak_rss_bytes(),
            "memory_plan_bytes": job.opened.plan_bytes,
        });
        report::written(report::write_json(path, &v))?;
    }
    Ok(report::expert_failures(&model.counters))
}
