//! `k3-worker --serve-channel --parallel N`: a batch worker for `k3-ctl serve` (continuous
//! batching). It attaches to the store once and takes jobs over its channel for as long as serve
//! keeps the channel open: each `Start` joins the running batch at the next step
//! ([`crate::batch::Batch`]: one forward pass per step over every job's rows), each job leaves
//! when it ends (an end id, its length) or is cancelled, without stopping the others. The job
//! protocol is the one-job worker's (docs/SPEC.md §6.12): per job `Prefilled`, one `Token` per
//! id, then `Done` or `Error`, all named by `req_id`.
//!
//! A job with a session resumes it when the ids it holds are a strict prefix of the prompt,
//! keeps the state after all of the prompt but its last id (so that a retry resumes from
//! there, as the one-job worker does) and keeps the final state at the end. A job that does not
//! fit the worker (its positions over `--ctx`, or more jobs than `--parallel`) is refused alone
//! (`Error` with its `req_id`); serve routes such jobs to one-job workers. A failed pass fails
//! every job in it and ends the worker; so does an expert that failed to load (the ids would be
//! unsound). The end of the channel (serve gone) ends every job at once.

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::Instant;

use k3_proto::exit::{self, ExitStatus};
use k3_proto::serve::MAX_JOB_FRAME;
use k3_proto::serve::{ErrorKind, Finish, FromWorker, ReqId, Start, Timings, ToWorker, Usage};
use k3_store::attach::AttachedSource;
use k3_store::runtime::source::WeightSource;

use crate::batch::{self, Batch, Resumed, SeqRequest};
use crate::cli::{Cli, MAX_GEN};
use crate::generate::{positions_needed, Sampler, END_IDS};
use crate::job::{self, JobError, Source};
use crate::model::{Model, TensorShapes};
use crate::serve_channel::Writer;
use crate::session::{self, ForPrompt};

/// One job in the batch.
struct Running {
    req_id: ReqId,
    session: Option<String>,
    prompt_ids: usize,
    /// Prompt ids a kept session already held.
    cached: usize,
    /// Ids the state held when generation began (the session's, or all but the last).
    held_before: usize,
    /// Bytes kept after the prefill (`None`: nothing kept then).
    kept_after_prefill: Option<u64>,
    joined: Instant,
    first: Option<Instant>,
    generated: u32,
    /// This job's share of what the passes it was in read.
    bytes: f64,
    requests: f64,
    hits: f64,
    /// The ids it ran and generated (for the store's history).
    stream: Vec<u32>,
}

/// Messages from the channel's reader thread; `None` = the channel ended.
type Inbox = mpsc::Receiver<Option<ToWorker>>;

/// Runs the batch worker after `Hello`; returns the exit code.
pub(crate) fn run(
    cli: &Cli,
    matches: &clap::ArgMatches,
    mut out: Writer,
    mut reader: UnixStream,
) -> i32 {
    let (tx, inbox) = mpsc::channel();
    std::thread::spawn(move || loop {
        match k3_proto::wire::read_frame_limited::<ToWorker, _>(&mut reader, MAX_JOB_FRAME) {
            Ok(m) => {
                if tx.send(Some(m)).is_err() {
                    return;
                }
            }
            Err(e) => {
                tracing::debug!("serve channel closed: {e}");
                let _ = tx.send(None);
                return;
            }
        }
    });
    match serve(cli, matches, &mut out, &inbox) {
        Ok(code) => code,
        Err(e) => {
            let m = exit::message(&e);
            eprintln!("k3-worker: {m}");
            let code = e.exit_code();
            out.send(&FromWorker::Error {
                req_id: None,
                kind: ErrorKind::of_exit_code(code),
                exit_class: code,
                message: m,
            });
            code
        }
    }
}

/// Attach, then take jobs until the channel ends.
fn serve(
    cli: &Cli,
    matches: &clap::ArgMatches,
    out: &mut Writer,
    inbox: &Inbox,
) -> Result<i32, JobError> {
    let pre = job::preflight(cli)?;
    let opened = job::open_source(cli, matches, &pre)?;
    job::warn_if_lossy(&opened);
    let Source::Attached(src) = &opened.source else {
        return Err(JobError::Refused(
            "a batch worker for k3-ctl serve attaches to a store (no --standalone)".into(),
        ));
    };
    let src: &AttachedSource = src;
    let mut model = Model::new(
        opened.dims.clone(),
        src,
        Some(&opened.shapes as &dyn TensorShapes),
    )?;
    model.options = crate::model::feed::FeedOptions::from_env()?;
    let slots = crate::batch_job::parallel(cli);
    let ctx = cli.ctx as usize;
    eprintln!("batch worker: up to {slots} jobs at once, {ctx} positions each");
    let mut b = Batch::new(cli.prefill_chunk);
    let mut jobs: HashMap<u64, Running> = HashMap::new();
    let mut closed = false;
    loop {
        // Take what serve sent; wait for it when nothing runs.
        loop {
            let msg = if b.is_empty() && !closed {
                inbox.recv().ok().flatten()
            } else {
                match inbox.try_recv() {
                    Ok(m) => m,
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => None,
                }
            };
            match msg {
                None => {
                    closed = true;
                    break;
                }
                Some(ToWorker::Start(s)) => {
                    let req_id = s.req_id;
                    if let Err(m) = admit(&mut b, &mut jobs, &model, src, s, slots, ctx) {
                        eprintln!("k3-worker: job {req_id}: {m}");
                        out.send(&FromWorker::Error {
                            req_id: Some(req_id),
                            kind: ErrorKind::Refused,
                            exit_class: exit::REFUSED,
                            message: m,
                        });
                    }
                }
                Some(ToWorker::Cancel { req_id }) => {
                    let seq = jobs
                        .iter()
                        .find(|(_, j)| j.req_id == req_id)
                        .map(|(s, _)| *s);
                    if let Some(seq) = seq {
                        b.leave(seq);
                        let j = jobs.remove(&seq).expect("found above");
                        eprintln!("job {req_id}: cancelled after {} ids", j.generated);
                        out.send(&done(&j, Finish::Cancelled, j.kept_after_prefill));
                    }
                }
            }
        }
        if closed || out.broken() {
            // Nobody waits for the ids: every job ends here.
            return Ok(exit::OK);
        }
        if b.is_empty() {
            continue;
        }
        let before = src.stats();
        let step = match b.step(&mut model) {
            Ok(s) => s,
            Err(e) => {
                let m = format!("the batch's forward pass failed: {e}");
                for j in jobs.values() {
                    fail(out, j.req_id, e.exit_code(), &m);
                }
                return Err(e.into());
            }
        };
        let after = src.stats();
        let failures = crate::report::expert_failures(&model.counters);
        if failures != exit::OK {
            let m = "a routed expert failed to load: the generated ids are unsound";
            for j in jobs.values() {
                fail(out, j.req_id, failures, m);
            }
            return Ok(failures);
        }
        let bytes = (after.trunk_bytes_read + after.expert_bytes_read)
            .saturating_sub(before.trunk_bytes_read + before.expert_bytes_read)
            as f64;
        let requests = after.expert_requests.saturating_sub(before.expert_requests) as f64;
        let hits = after.resident_hits.saturating_sub(before.resident_hits) as f64;
        for (seq, share) in &step.shares {
            if let Some(j) = jobs.get_mut(seq) {
                j.bytes += bytes * share;
                j.requests += requests * share;
                j.hits += hits * share;
            }
        }
        for seq in &step.paused {
            if let (Some(j), Some((state, held))) = (jobs.get_mut(seq), b.state(*seq)) {
                j.held_before = held.len();
                j.kept_after_prefill = j
                    .session
                    .as_deref()
                    .and_then(|name| keep(src, name, held, state));
            }
            b.resume(*seq);
        }
        for e in &step.emitted {
            let Some(j) = jobs.get_mut(&e.seq) else {
                continue;
            };
            if j.first.is_none() {
                j.first = Some(Instant::now());
                let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
                out.send(&FromWorker::Prefilled {
                    req_id: j.req_id,
                    cached_ids: n(j.cached),
                    held_ids: n(j.held_before),
                    kept_bytes: j.kept_after_prefill,
                });
            }
            j.generated += 1;
            j.stream.push(e.token);
            out.send(&FromWorker::Token {
                req_id: j.req_id,
                id: e.token,
            });
        }
        for (seq, fin) in step.ended {
            let Some(j) = jobs.remove(&seq) else {
                continue;
            };
            let finish = match step
                .emitted
                .iter()
                .find(|e| e.seq == seq)
                .and_then(|e| e.finish)
            {
                Some(batch::Finish::Stop(id)) => Finish::EndId(id),
                _ => Finish::Length,
            };
            let kept = j
                .session
                .as_deref()
                .and_then(|name| keep(src, name, &fin.held, &fin.state));
            if let Err(e) = src.record_history(&j.stream) {
                tracing::warn!("token stream not recorded in the store's history: {e}");
            }
            out.send(&done(&j, finish, kept));
        }
    }
}

/// Join `s` to the batch, resuming its session when the store holds a prefix of its prompt.
fn admit(
    b: &mut Batch,
    jobs: &mut HashMap<u64, Running>,
    model: &Model<'_>,
    src: &AttachedSource,
    s: Start,
    slots: usize,
    ctx: usize,
) -> Result<(), String> {
    if jobs.values().any(|j| j.req_id == s.req_id) {
        return Err(format!("job {} is running already", s.req_id));
    }
    if jobs.len() >= slots {
        return Err(format!("this worker runs {slots} jobs at once, all taken"));
    }
    if !(1..=MAX_GEN).contains(&u64::from(s.max_new)) {
        return Err(format!("max_new {} outside 1..={MAX_GEN}", s.max_new));
    }
    let capacity = positions_needed(s.ids.len(), s.max_new as usize);
    if capacity > ctx {
        return Err(format!(
            "a job of {} prompt ids and {} new needs {capacity} positions; this worker's \
             jobs take at most {ctx} (--ctx)",
            s.ids.len(),
            s.max_new
        ));
    }
    if let Some(name) = &s.session {
        k3_store::session::check_name(name).map_err(|e| format!("session: {e}"))?;
    }
    let sampler = Sampler::new(s.sampling.temperature, s.sampling.top_p, s.sampling.seed)
        .map_err(|e| e.to_string())?;
    let from = match &s.session {
        Some(name) => match session::fetch_for_prompt(src, name, &model.dims, capacity, &s.ids) {
            Ok(ForPrompt::Restored(r)) => Some(Resumed {
                state: r.state,
                held: r.held,
            }),
            Ok(_) => None,
            Err(e) => {
                eprintln!("session {name}: not resumed ({e}); prefilling the whole prompt");
                None
            }
        },
        None => None,
    };
    let cached = from.as_ref().map_or(0, |r| r.held.len());
    let req = SeqRequest {
        prompt: s.ids.clone(),
        max_new: s.max_new as usize,
        sampler,
        stop_ids: END_IDS.to_vec(),
        pause_before_last: s.session.is_some(),
    };
    let seq = b.join_from(model, req, from).map_err(|e| e.to_string())?;
    eprintln!(
        "job {}: joined ({} prompt ids, {cached} from its session, up to {} new; {} running)",
        s.req_id,
        s.ids.len(),
        s.max_new,
        jobs.len() + 1
    );
    jobs.insert(
        seq,
        Running {
            req_id: s.req_id,
            session: s.session,
            prompt_ids: s.ids.len(),
            cached,
            held_before: cached,
            kept_after_prefill: None,
            joined: Instant::now(),
            first: None,
            generated: 0,
            bytes: 0.0,
            requests: 0.0,
            hits: 0.0,
            stream: s.ids,
        },
    );
    Ok(())
}

/// Keep `state` (holding `held`) as session `name`; the bytes kept, or `None` (said on stderr).
fn keep(
    src: &AttachedSource,
    name: &str,
    held: &[u32],
    state: &crate::model::SeqState,
) -> Option<u64> {
    match session::keep(src, name, held, state, &session::Meta::default()) {
        Ok(k) => {
            eprintln!(
                "session {name}: kept {} positions ({:.3} MB)",
                held.len(),
                k.bytes as f64 / 1e6
            );
            Some(k.bytes)
        }
        Err(e) => {
            eprintln!("session {name}: NOT kept: {e}");
            None
        }
    }
}

/// The `Done` of job `j`.
fn done(j: &Running, finish: Finish, kept: Option<u64>) -> FromWorker {
    let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    let now = Instant::now();
    let first = j.first.unwrap_or(now);
    FromWorker::Done {
        req_id: j.req_id,
        finish,
        usage: Usage {
            prompt_ids: n(j.prompt_ids),
            cached_ids: n(j.cached),
            generated: j.generated,
        },
        timings: Timings {
            prefill_seconds: (first - j.joined).as_secs_f64(),
            decode_seconds: (now - first).as_secs_f64(),
            bytes_read: j.bytes.round() as u64,
            expert_requests: j.requests.round() as u64,
            resident_hits: j.hits.round() as u64,
            kept_session_bytes: kept,
        },
    }
}

/// Tell serve job `req_id` failed with `code`.
fn fail(out: &mut Writer, req_id: ReqId, code: i32, message: &str) {
    out.send(&FromWorker::Error {
        req_id: Some(req_id),
        kind: ErrorKind::of_exit_code(code),
        exit_class: code,
        message: message.to_string(),
    });
}
