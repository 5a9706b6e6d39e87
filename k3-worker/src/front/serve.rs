//! `k3-worker --serve-channel`: jobs from `k3-ctl serve` over the Unix socket that is this
//! process's standard input, in the job protocol of [`k3_proto::serve`] (docs/SPEC.md §6.12),
//! for as long as serve keeps the channel open.
//!
//! The worker says `Hello`, attaches once, and then each `Start` becomes a [`Request`] of the one
//! engine (its prompt ids, sampling, session; the worker's own speculation flags) with a
//! [`ChannelSink`]: it joins at the next step with room, beside whatever else runs, whatever its
//! size (the scheduler admits it when its state fits). Per job the worker sends `Prefilled`, one
//! `Token` per id and one `Done` or `Error`, all named by `req_id`; a `Cancel` ends a job at the
//! next step (`Done` with `Cancelled`, what its session kept after the prefill kept for a
//! retry). A failed pass fails every job and ends the worker; so does an expert that failed to
//! load (the ids would be unsound). The end of the channel (serve gone) ends every job at once.

use std::cell::RefCell;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use k3_proto::exit::{self, ExitStatus};
use k3_proto::serve::{
    ErrorKind, FromWorker, Grammar, ReqId, Shape, Start, ToWorker, JOB_PROTOCOL_VERSION,
    MAX_CHOICES, MAX_JOB_FRAME, MAX_TOP_LOGPROBS,
};
use k3_store::attach::AttachedSource;
use serde_json::{json, Value};

use crate::constrain::{ConstrainError, Constraint, Spec, Vocab};
use crate::engine::outputs::{Finished, Flow, Outputs, Prefilled, Sink, StepReport};
use crate::engine::request::{Held, Request, RequestError, SeqId, SessionPlan};
use crate::engine::runner::Engine;
use crate::engine::sampling::{positions_needed, Sampler};
use crate::engine::session::{self, ForPrompt};
use crate::engine::shaping::{Shaping, ThinkBudget};
use crate::front::cli::{Cli, MAX_GEN};
use crate::front::drafters::Drafters;
use crate::front::error::{refuse, JobError};
use crate::front::job::{job_shape, preflight, prepare, serve_longest};
use crate::front::report::{self, RunSummary};
use crate::model::Dims;
use crate::text::tools::ToolSpec;
use crate::tokenizer::Tokenizer;

/// Why the channel or a job it sent is refused.
#[derive(Debug, thiserror::Error)]
enum ChannelError {
    /// Standard input cannot be duplicated.
    #[error("standard input")]
    Stdin(#[source] std::io::Error),
    /// Standard input is not the socket serve hands a worker.
    #[error("standard input is not a Unix socket from k3-ctl serve")]
    NotSocket(#[source] std::io::Error),
    /// A reply length outside the worker's range.
    #[error("max_new {0} outside 1..={MAX_GEN}")]
    MaxNew(u32),
    /// A session name that cannot be a session's.
    #[error("session")]
    Session(#[source] k3_store::session::SessionError),
    /// Sampling out of range.
    #[error(transparent)]
    Sampling(#[from] crate::engine::sampling::SamplingError),
    /// A value outside what serve may send ([`k3_proto::serve::Sampling::validate`]).
    #[error(transparent)]
    Value(#[from] k3_proto::serve::ValueError),
    /// More choices than a job may ask.
    #[error("n = {0}: a job asks 1..={MAX_CHOICES} choices")]
    Choices(u32),
    /// A job whose id is running already.
    #[error("job {0} is running already")]
    Duplicate(ReqId),
    /// The engine refused it.
    #[error(transparent)]
    Request(#[from] crate::engine::request::RequestError),
    /// A grammar without the tokenizer to compile it over.
    #[error("a constrained job needs the worker started with --tok")]
    NoTokenizer,
    /// The grammar cannot be compiled.
    #[error(transparent)]
    Grammar(#[from] ConstrainError),
    /// A schema that is not JSON.
    #[error("a JSON schema in the job is not JSON")]
    Schema(#[source] serde_json::Error),
    /// A shaping value out of range.
    #[error("{0}")]
    Shape(String),
}

impl ExitStatus for ChannelError {
    /// Every one is a refusal before the job's work (exit 2).
    fn exit_code(&self) -> i32 {
        exit::REFUSED
    }
}

/// Standard input as the channel's socket.
fn stdin_socket() -> Result<UnixStream, ChannelError> {
    use std::os::fd::AsFd;
    let fd = (std::io::stdin().as_fd().try_clone_to_owned()).map_err(ChannelError::Stdin)?;
    let s = UnixStream::from(fd);
    // A file or a terminal is not a socket: its address cannot be read.
    s.local_addr().map_err(ChannelError::NotSocket)?;
    Ok(s)
}

/// The writing side of the channel, shared by every job's sink; a failed write (serve gone)
/// marks it broken.
pub struct Writer {
    stream: UnixStream,
    broken: AtomicBool,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("broken", &self.broken())
            .finish()
    }
}

impl Writer {
    /// A write failed: serve is gone.
    pub fn broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Send `m` (a failure marks the channel broken).
    pub fn send(&self, m: &FromWorker) {
        let sent = match k3_proto::wire::encode(m) {
            Ok(f) => (&self.stream).write_all(&f).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = sent {
            tracing::debug!("serve channel: {e}");
            self.broken.store(true, Ordering::Release);
        }
    }

    /// Tell serve job `req_id` (or, with `None`, the worker) failed with exit code `code`.
    fn fail(&self, req_id: Option<ReqId>, code: i32, message: String) {
        self.fail_as(req_id, ErrorKind::of_exit_code(code), code, message);
    }

    /// Tell serve job `req_id` failed as `kind`.
    fn fail_as(&self, req_id: Option<ReqId>, kind: ErrorKind, code: i32, message: String) {
        self.send(&FromWorker::Error {
            req_id,
            kind,
            exit_class: code,
            message,
        });
    }
}

/// One job's output as job messages.
pub struct ChannelSink<'a> {
    out: &'a Writer,
    req_id: ReqId,
    /// The job's choice this sink reports (0 for a job of one).
    choice: u32,
    /// Jobs that ended (for the loop's table) and, with `--out`, their records.
    ended: &'a RefCell<Ended>,
}

/// What the jobs that ended left.
#[derive(Debug, Default)]
struct Ended {
    /// Choices that ended, and whether the job failed with them.
    jobs: Vec<(ReqId, u32, bool)>,
    records: Option<Vec<Value>>,
}

impl Sink for ChannelSink<'_> {
    fn prefilled(&mut self, p: &Prefilled) {
        if self.choice > 0 {
            // The job's prompt was prefilled once, by its first choice.
            return;
        }
        let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        self.out.send(&FromWorker::Prefilled {
            req_id: self.req_id,
            cached_ids: n(p.cached),
            held_ids: n(p.held),
            kept_bytes: p.kept,
        });
    }

    fn token(&mut self, s: &StepReport) -> Flow {
        self.out.send(&match &s.scored {
            None => FromWorker::Token {
                req_id: self.req_id,
                choice: self.choice,
                id: s.token,
            },
            Some(sc) => FromWorker::Scored {
                req_id: self.req_id,
                choice: self.choice,
                id: s.token,
                logprob: sc.logprob,
                top: sc.top.clone(),
            },
        });
        Flow::Continue
    }

    fn done(&mut self, f: &Finished) {
        let mask = f.mask.map_or(String::new(), |m| {
            let per = |s: f64| 1e3 * s / m.masks.max(1) as f64;
            format!(
                "; {} grammar masks, {:.3} ms each to compute, {:.3} ms each on the pick path",
                m.masks,
                per(m.compute_seconds),
                per(m.wait_seconds)
            )
        });
        tracing::info!(
            "job {} choice {}: ended ({:?}) after {} ids{mask}",
            self.req_id,
            self.choice,
            f.finish,
            f.usage.generated
        );
        if let Some(e) = &f.error {
            self.out.fail(
                Some(self.req_id),
                exit::FAILURE,
                format!("constrained decoding failed: {e}"),
            );
        } else {
            self.out.send(&FromWorker::Done {
                req_id: self.req_id,
                choice: self.choice,
                finish: f.finish,
                usage: f.usage.clone(),
                timings: f.timings.clone(),
            });
        }
        let mut e = self.ended.borrow_mut();
        e.jobs.push((self.req_id, self.choice, f.error.is_some()));
        if let Some(r) = e.records.as_mut() {
            let spec = &f.report.spec;
            r.push(json!({
                "req_id": self.req_id,
                "choice": self.choice,
                "finish": format!("{:?}", f.finish),
                "usage": f.usage,
                "timings": f.timings,
                "mask": f.mask,
                "error": f.error,
                "forward_passes": spec.forward_passes,
                "drafted_tokens": spec.drafted_tokens,
                "accepted_tokens": spec.accepted_tokens,
            }));
        }
    }
}

/// Messages from the channel's reader thread; `None` = the channel ended.
type Inbox = mpsc::Receiver<Option<ToWorker>>;

/// Runs `k3-worker --serve-channel`; returns the exit code.
pub fn run(cli: &Cli, matches: &clap::ArgMatches) -> i32 {
    let stream = match stdin_socket() {
        Ok(s) => s,
        Err(e) => return exit::report("k3-worker: --serve-channel", Err::<i32, _>(e)),
    };
    let reader = stream.try_clone().map_err(ChannelError::Stdin);
    let out = Writer {
        stream,
        broken: AtomicBool::new(false),
    };
    let mut reader = match reader {
        Ok(r) => r,
        Err(e) => {
            out.fail(None, exit::REFUSED, exit::message(&e));
            return exit::report("k3-worker: --serve-channel", Err::<i32, _>(e));
        }
    };
    out.send(&FromWorker::Hello {
        protocol_version: JOB_PROTOCOL_VERSION,
        pid: std::process::id(),
    });
    let (tx, inbox) = mpsc::channel();
    std::thread::spawn(move || loop {
        match k3_proto::wire::read_frame_limited::<ToWorker, _>(&mut reader, MAX_JOB_FRAME) {
            Ok(m) => {
                if tx.send(Some(m)).is_err() {
                    return;
                }
            }
            Err(e) => {
                // serve is gone (or broke the protocol): nobody waits for the ids.
                tracing::debug!("serve channel closed: {e}");
                let _ = tx.send(None);
                return;
            }
        }
    });
    let result = serve(cli, matches, &out, &inbox);
    if let Err(e) = &result {
        out.fail(None, e.exit_code(), exit::message(e));
    }
    exit::report("k3-worker", result)
}

/// The jobs in the engine: request, choice and sequence.
type Jobs = Vec<(ReqId, u32, SeqId)>;

/// The serve loop's state: the engine, the sinks' outputs, the jobs and the channel.
struct Front<'a, 'm> {
    engine: Engine<'m>,
    outputs: Outputs<'a>,
    jobs: Jobs,
    out: &'a Writer,
    ended: &'a RefCell<Ended>,
    admit: Admit<'a>,
}

impl<'a> Front<'a, '_> {
    /// Take what serve sent; wait for it when nothing runs. True when the channel ended.
    fn intake(&mut self, inbox: &Inbox) -> bool {
        loop {
            let msg = if self.engine.is_idle() {
                inbox.recv().ok().flatten()
            } else {
                match inbox.try_recv() {
                    Ok(m) => m,
                    Err(mpsc::TryRecvError::Empty) => return false,
                    Err(mpsc::TryRecvError::Disconnected) => None,
                }
            };
            match msg {
                None => return true,
                Some(ToWorker::Start(s)) => self.start(s),
                Some(ToWorker::Cancel { req_id }) => {
                    if self.jobs.iter().any(|(r, ..)| *r == req_id) {
                        tracing::info!("job {req_id}: cancelled");
                        self.cancel(req_id, None);
                    }
                }
            }
        }
    }

    /// The jobs in the engine, each once.
    fn req_ids(&self) -> Vec<ReqId> {
        let mut ids: Vec<ReqId> = self.jobs.iter().map(|&(r, ..)| r).collect();
        ids.dedup();
        ids
    }

    /// Cancel every choice of job `req_id` (but `except`).
    fn cancel(&mut self, req_id: ReqId, except: Option<u32>) {
        for &(r, choice, seq) in &self.jobs {
            if r == req_id && Some(choice) != except {
                self.engine.cancel(seq, &mut self.outputs);
            }
        }
    }

    /// A job joins (or is refused alone): one request, or a group of its choices that share
    /// one prefill.
    fn start(&mut self, s: Start) {
        let req_id = s.req_id;
        let sink = |choice| {
            Box::new(ChannelSink {
                out: self.out,
                req_id,
                choice,
                ended: self.ended,
            }) as Box<dyn Sink + 'a>
        };
        let admitted = self
            .admit
            .requests(&self.jobs, &self.engine.model().dims, s);
        let joined = admitted.and_then(|mut reqs| {
            let r = if reqs.len() == 1 {
                let req = reqs.pop().expect("one");
                (self.engine.submit(req, sink(0), &mut self.outputs)).map(|seq| vec![seq])
            } else {
                let choices = (reqs.into_iter().zip(0..)).map(|(r, i)| (r, sink(i)));
                self.engine
                    .submit_choices(choices.collect(), &mut self.outputs)
            };
            r.map_err(ChannelError::from)
        });
        match joined {
            Ok(seqs) => {
                let (running, waiting) = self.engine.load();
                tracing::info!(
                    "job {req_id}: joins with {} choice(s) ({running} running, {waiting} waiting)",
                    seqs.len()
                );
                self.jobs
                    .extend((0..).zip(seqs).map(|(choice, seq)| (req_id, choice, seq)));
            }
            Err(e) => {
                let m = exit::message(&e);
                tracing::warn!("job {req_id}: refused: {m}");
                // A value outside the shared validation (or more choices than the worker runs
                // at once) is the client's; anything else the worker's refusal.
                let kind = match e {
                    ChannelError::Value(_)
                    | ChannelError::Choices(_)
                    | ChannelError::Request(RequestError::TooManyChoices { .. }) => {
                        ErrorKind::Invalid
                    }
                    _ => ErrorKind::Refused,
                };
                self.out.fail_as(Some(req_id), kind, exit::REFUSED, m);
            }
        }
    }

    /// One step; `Some(code)` when the worker must end (an expert failed to load: every job
    /// fails, the ids would be unsound).
    fn step(&mut self) -> Result<Option<i32>, JobError> {
        if let Err(e) = self.engine.step(&mut self.outputs) {
            let m = format!("the forward pass failed: {}", exit::message(&e));
            for req_id in self.req_ids() {
                self.out.fail(Some(req_id), e.exit_code(), m.clone());
            }
            return Err(e.into());
        }
        let failures = report::expert_failures(&self.engine.model().counters);
        if failures != exit::OK {
            let m = "a routed expert failed to load: the generated ids are unsound";
            for req_id in self.req_ids() {
                self.out.fail(Some(req_id), failures, m.to_string());
            }
            return Ok(Some(failures));
        }
        let done = std::mem::take(&mut self.ended.borrow_mut().jobs);
        self.jobs
            .retain(|&(r, c, _)| !done.iter().any(|&(dr, dc, _)| (dr, dc) == (r, c)));
        // A choice whose shaping failed failed its job: the other choices end with it.
        for &(req_id, choice, failed) in &done {
            if failed {
                self.cancel(req_id, Some(choice));
            }
        }
        let gone = std::mem::take(&mut self.ended.borrow_mut().jobs);
        self.jobs
            .retain(|&(r, c, _)| !gone.iter().any(|&(gr, gc, _)| (gr, gc) == (r, c)));
        Ok(None)
    }
}

/// The grammar of a job as the constraint module's spec.
fn spec(g: &Grammar) -> Result<Spec, ChannelError> {
    let json = |s: &str| serde_json::from_str::<Value>(s).map_err(ChannelError::Schema);
    Ok(match g {
        Grammar::JsonObject => Spec::JsonObject,
        Grammar::JsonSchema { schema, strict } => Spec::JsonSchema {
            schema: json(schema)?,
            strict: *strict,
        },
        Grammar::ToolCall { tools, parallel } => Spec::ToolCall {
            tools: tools
                .iter()
                .map(|t| {
                    Ok(ToolSpec {
                        name: t.name.clone(),
                        description: None,
                        parameters: t.parameters.as_deref().map(json).transpose()?,
                        strict: Some(t.strict),
                    })
                })
                .collect::<Result<_, ChannelError>>()?,
            parallel: *parallel,
        },
    })
}

/// Attach, then take jobs until the channel ends.
fn serve(
    cli: &Cli,
    matches: &clap::ArgMatches,
    out: &Writer,
    inbox: &Inbox,
) -> Result<i32, JobError> {
    let wall = std::time::Instant::now();
    let mut pre = preflight(cli)?;
    // The tokenizer (`--tok`) compiles the jobs' grammars.
    let tok = pre.tok.take().map(Arc::new);
    let ctx = cli.ctx as usize;
    let slots = cli.parallel.unwrap_or(1) as usize;
    let longest = serve_longest().max(ctx);
    let mut shape = job_shape(cli, &pre, slots, ctx, longest, usize::MAX);
    // k3-ctl serve sized its slots with the default chunk's pass: the worker keeps it.
    shape.auto_prefill = false;
    let job = prepare(cli, matches, pre, shape, wall)?;
    let drafters = job.drafters(cli)?;
    let job = &job;
    let src =
        job.opened.source.store().ok_or_else(|| {
            refuse("a worker for k3-ctl serve attaches to a store (no --standalone)")
        })?;
    let plan = job.shape.engine;
    tracing::info!(
        "serve worker: up to {} jobs at once, {} positions a slot, {} for one job at most",
        plan.slots,
        plan.positions,
        plan.longest
    );
    let ended = RefCell::new(Ended {
        records: cli.out.as_ref().map(|_| Vec::new()),
        ..Ended::default()
    });
    let mut front = Front {
        engine: Engine::new(job.model()?, plan),
        outputs: Outputs::new(Some(src)),
        jobs: Vec::new(),
        out,
        ended: &ended,
        admit: Admit {
            src,
            drafters: &drafters,
            tok,
            vocab: None,
        },
    };
    let code = loop {
        if front.intake(inbox) || out.broken() {
            // Nobody waits for the ids: every job ends here.
            break exit::OK;
        }
        if front.engine.is_idle() {
            continue;
        }
        if let Some(code) = front.step()? {
            break code;
        }
    };
    if let Some(path) = &cli.out {
        let summary = RunSummary::collect(front.engine.model(), job.wall.elapsed().as_secs_f64());
        let v = json!({
            "mode": "serve",
            "slots": plan.slots,
            "positions": plan.positions,
            "longest": plan.longest,
            "jobs": ended.borrow_mut().records.take().unwrap_or_default(),
            "peak_rss_bytes": summary.peak,
            "memory_plan_bytes": job.opened.plan_bytes,
        });
        report::written(report::write_json(path, &v))?;
    }
    Ok(code)
}

/// What a `Start` is checked against and built with.
struct Admit<'a> {
    src: &'a AttachedSource,
    drafters: &'a Drafters,
    /// The tokenizer (`--tok`), for grammars.
    tok: Option<Arc<Tokenizer>>,
    /// The grammars' vocabulary, built at the first constrained job.
    vocab: Option<Vocab>,
}

impl Admit<'_> {
    /// The requests of `s`, one per choice: its ids, each choice's sampling (seed + choice)
    /// and shaping, the session of the first choice (resumed when the store holds a strict
    /// prefix of its prompt), the worker's speculation.
    fn requests(
        &mut self,
        jobs: &Jobs,
        dims: &Dims,
        s: Start,
    ) -> Result<Vec<Request>, ChannelError> {
        if s.n > MAX_CHOICES {
            return Err(ChannelError::Choices(s.n));
        }
        s.sampling.validate()?;
        let others = (1..s.choices())
            .map(|i| {
                let c = s.choice_sampling(i);
                let sampler = Sampler::new(c.temperature, c.top_p, c.seed)?;
                let capacity = positions_needed(s.ids.len(), s.max_new as usize);
                Ok(Request {
                    shaping: self.shaping(&s.shape, dims.vocab)?,
                    spec: self.drafters.for_request(s.ids.len(), capacity),
                    ..Request::new(s.ids.clone(), s.max_new as usize, sampler)
                })
            })
            .collect::<Result<Vec<Request>, ChannelError>>();
        let first = self.request(jobs, dims, s)?;
        Ok([first].into_iter().chain(others?).collect())
    }

    /// The request of `s` (its first choice): its ids, sampling and session (resumed when the
    /// store holds a strict prefix of its prompt), the worker's speculation.
    fn request(&mut self, jobs: &Jobs, dims: &Dims, s: Start) -> Result<Request, ChannelError> {
        let sampling = &s.sampling;
        sampling.validate()?;
        let sampler = Sampler::new(sampling.temperature, sampling.top_p, sampling.seed)?;
        if jobs.iter().any(|(r, ..)| *r == s.req_id) {
            return Err(ChannelError::Duplicate(s.req_id));
        }
        if !(1..=MAX_GEN).contains(&u64::from(s.max_new)) {
            return Err(ChannelError::MaxNew(s.max_new));
        }
        for name in [&s.session, &s.resume].into_iter().flatten() {
            k3_store::session::check_name(name).map_err(ChannelError::Session)?;
        }
        let shaping = self.shaping(&s.shape, dims.vocab)?;
        let max_new = s.max_new as usize;
        let capacity = positions_needed(s.ids.len(), max_new);
        let from = (s.resume.as_deref().or(s.session.as_deref()))
            .and_then(|name| self.resume(dims, name, capacity, &s.ids));
        tracing::info!(
            "job {}: {} prompt ids ({} from its session), up to {max_new} new",
            s.req_id,
            s.ids.len(),
            from.as_ref().map_or(0, |h| h.ids.len())
        );
        Ok(Request {
            shaping,
            spec: self.drafters.for_request(s.ids.len(), capacity),
            from,
            session: s.session.map(|name| SessionPlan {
                name,
                after_prefill: true,
                keep_at: s.keep_at.iter().map(|&k| k as usize).collect(),
                name_key: s.name_key,
            }),
            ..Request::new(s.ids, max_new, sampler)
        })
    }

    /// The job's shaping: its grammar compiled over the vocabulary (built once), its values
    /// checked.
    fn shaping(&mut self, shape: &Shape, vocab: usize) -> Result<Shaping, ChannelError> {
        let bad = |m: String| Err(ChannelError::Shape(m));
        if let Some((id, b)) = shape
            .logit_bias
            .iter()
            .find(|(id, b)| *id as usize >= vocab || !(-100.0..=100.0).contains(b))
        {
            return bad(format!(
                "logit bias {b} for id {id}: ids below {vocab}, biases in -100..=100"
            ));
        }
        for (name, v) in [
            ("presence", shape.presence_penalty),
            ("frequency", shape.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} penalty {v} outside -2..=2"));
            }
        }
        if shape.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            return bad(format!(
                "more than {MAX_TOP_LOGPROBS} top log-probabilities"
            ));
        }
        let think = match &shape.think_budget {
            Some(b) if !shape.thinking => {
                return bad(format!(
                    "a thinking budget of {} without thinking",
                    b.tokens
                ))
            }
            Some(b) if b.close.is_empty() || b.close.iter().any(|&id| id as usize >= vocab) => {
                return bad(
                    "a thinking budget's closing ids are empty or outside the vocabulary".into(),
                )
            }
            Some(b) => Some(ThinkBudget {
                tokens: b.tokens as usize,
                close: b.close.clone(),
            }),
            None => None,
        };
        let grammar = match &shape.grammar {
            None => None,
            Some(g) => Some(Constraint::new(self.vocab()?, &spec(g)?, shape.thinking)?),
        };
        Ok(Shaping {
            grammar,
            think,
            bias: shape.logit_bias.clone(),
            presence: shape.presence_penalty,
            frequency: shape.frequency_penalty,
            logprobs: shape.logprobs.map(usize::from),
        })
    }

    /// The grammars' vocabulary (built at the first use: a trie over every id).
    fn vocab(&mut self) -> Result<&Vocab, ChannelError> {
        if self.vocab.is_none() {
            let tok = self.tok.clone().ok_or(ChannelError::NoTokenizer)?;
            let t = std::time::Instant::now();
            self.vocab = Some(Vocab::new(tok)?);
            tracing::info!(
                "grammar vocabulary built in {:.3} s",
                t.elapsed().as_secs_f64()
            );
        }
        Ok(self.vocab.as_ref().expect("built above"))
    }

    /// The session `name`'s state when the ids it holds are a strict prefix of `prompt`.
    fn resume(&self, dims: &Dims, name: &str, capacity: usize, prompt: &[u32]) -> Option<Held> {
        match session::fetch_for_prompt(self.src, name, dims, capacity, prompt) {
            Ok(ForPrompt::Restored(r)) => Some(r.into_held()),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!("session {name}: not resumed ({e}); prefilling the whole prompt");
                None
            }
        }
    }
}
