//! `k3-worker --serve-channel`: one job from `k3-ctl serve` over the Unix socket that is this
//! process's standard input, in the job protocol of [`k3_proto::serve`] (docs/SPEC.md §6.12);
//! with `--parallel N`, many jobs at once ([`crate::serve_batch`]).
//!
//! The worker says `Hello`, reads its `Start`, runs the job as a one-shot run whose ids go to
//! the channel ([`ChannelSink`]), and ends with one `Done` or `Error` (the kind and the exit code
//! it then exits with). A thread reads the channel meanwhile: a `Cancel` for the job, or the end
//! of the channel (serve gone), makes the run stop at its next step boundary.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k3_proto::exit::{self, ExitStatus};
use k3_proto::serve::{
    ErrorKind, Finish, FromWorker, ReqId, Start, Timings, ToWorker, Usage, JOB_PROTOCOL_VERSION,
    MAX_JOB_FRAME,
};

use crate::cli::{Cli, MAX_GEN};
use crate::generate::{Flow, StepReport};
use crate::sink::Sink;

/// How long serve has to send the job after the worker's `Hello`.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Standard input as the channel's socket.
fn stdin_socket() -> Result<UnixStream, ChannelError> {
    use std::os::fd::AsFd;
    let fd = (std::io::stdin().as_fd().try_clone_to_owned()).map_err(ChannelError::Stdin)?;
    let s = UnixStream::from(fd);
    // A file or a terminal is not a socket: its address cannot be read.
    s.local_addr().map_err(ChannelError::NotSocket)?;
    Ok(s)
}

/// Why the channel or the job it sent is refused (exit 2).
#[derive(Debug, thiserror::Error)]
enum ChannelError {
    /// Standard input cannot be duplicated.
    #[error("standard input: {0}")]
    Stdin(#[source] std::io::Error),
    /// Standard input is not the socket serve hands a worker.
    #[error("standard input is not a Unix socket from k3-ctl serve ({0})")]
    NotSocket(#[source] std::io::Error),
    /// A reply length outside the worker's range.
    #[error("max_new {0} outside 1..={MAX_GEN}")]
    MaxNew(u32),
    /// A session name that cannot be a session's.
    #[error("session: {0}")]
    Session(#[source] k3_store::session::SessionError),
}

/// The writing side of the channel; a failed write (serve gone) cancels the job.
pub(crate) struct Writer {
    stream: UnixStream,
    cancel: Arc<AtomicBool>,
}

impl Writer {
    /// A write failed: serve is gone.
    pub(crate) fn broken(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }

    /// Send `m` (a failure marks the channel broken).
    pub(crate) fn send(&mut self, m: &FromWorker) {
        let ok = k3_proto::wire::encode(m)
            .map_err(|e| e.to_string())
            .and_then(|f| self.stream.write_all(&f).map_err(|e| e.to_string()));
        if let Err(e) = ok {
            tracing::debug!("serve channel: {e}");
            self.cancel.store(true, Ordering::Release);
        }
    }
}

/// A one-shot run's output as job messages.
pub struct ChannelSink {
    out: Writer,
    req_id: ReqId,
    cancel: Arc<AtomicBool>,
    /// The `Done` to send once the run has ended with exit code 0.
    done: Option<FromWorker>,
}

impl Sink for ChannelSink {
    fn prefilled(&mut self, cached: usize, held: usize, kept: Option<u64>) {
        let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        self.out.send(&FromWorker::Prefilled {
            req_id: self.req_id,
            cached_ids: n(cached),
            held_ids: n(held),
            kept_bytes: kept,
        });
    }

    fn token(&mut self, s: &StepReport) -> Flow {
        if self.cancelled() {
            return Flow::Stop;
        }
        self.out.send(&FromWorker::Token {
            req_id: self.req_id,
            id: s.token,
        });
        Flow::Continue
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }

    fn keeps_prefill(&self) -> bool {
        true
    }

    fn done(&mut self, finish: Finish, usage: Usage, timings: Timings) {
        self.done = Some(FromWorker::Done {
            req_id: self.req_id,
            finish,
            usage,
            timings,
        });
    }
}

/// The job's command line: the worker's own flags with the job's prompt, sampling and session.
fn job_cli(cli: &Cli, start: &Start) -> Result<Cli, ChannelError> {
    if !(1..=MAX_GEN).contains(&u64::from(start.max_new)) {
        return Err(ChannelError::MaxNew(start.max_new));
    }
    if let Some(name) = &start.session {
        k3_store::session::check_name(name).map_err(ChannelError::Session)?;
    }
    let mut c = cli.clone();
    c.ids = Some(start.ids.clone());
    c.gen = u64::from(start.max_new);
    c.temperature = start.sampling.temperature;
    c.top_p = start.sampling.top_p;
    c.seed = start.sampling.seed;
    c.session = start.session.clone();
    Ok(c)
}

/// Runs `k3-worker --serve-channel`; returns the exit code.
pub fn run(cli: &Cli, matches: &clap::ArgMatches) -> i32 {
    let stream = match stdin_socket() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("k3-worker: --serve-channel: {e}");
            return exit::REFUSED;
        }
    };
    let cancel = Arc::new(AtomicBool::new(false));
    let reader = stream.try_clone();
    let mut out = Writer {
        stream,
        cancel: cancel.clone(),
    };
    let refuse = |out: &mut Writer, req_id: Option<ReqId>, kind: ErrorKind, message: String| {
        eprintln!("k3-worker: {message}");
        let exit_class = exit::REFUSED;
        out.send(&FromWorker::Error {
            req_id,
            kind,
            exit_class,
            message,
        });
        exit_class
    };
    let mut reader = match reader {
        Ok(r) => r,
        Err(e) => return refuse(&mut out, None, ErrorKind::Protocol, e.to_string()),
    };
    out.send(&FromWorker::Hello {
        protocol_version: JOB_PROTOCOL_VERSION,
        pid: std::process::id(),
    });
    if cli.parallel.is_some() {
        // A batch worker: jobs for as long as serve keeps the channel open.
        return crate::serve_batch::run(cli, matches, out, reader);
    }
    if matches.value_source("ctx") == Some(clap::parser::ValueSource::CommandLine) {
        let m = "--ctx sizes a batch worker's jobs: it needs --parallel".to_string();
        return refuse(&mut out, None, ErrorKind::Refused, m);
    }
    let _ = reader.set_read_timeout(Some(START_TIMEOUT));
    let start = match k3_proto::wire::read_frame_limited::<ToWorker, _>(&mut reader, MAX_JOB_FRAME)
    {
        Ok(ToWorker::Start(s)) => s,
        Ok(other) => {
            let m = format!("expected a Start message first, got {other:?}");
            return refuse(&mut out, None, ErrorKind::Protocol, m);
        }
        Err(e) => {
            let m = format!("no job from serve (protocol v{JOB_PROTOCOL_VERSION}): {e}");
            return refuse(&mut out, None, ErrorKind::Protocol, m);
        }
    };
    let req_id = start.req_id;
    let job = match job_cli(cli, &start) {
        Ok(c) => c,
        Err(e) => return refuse(&mut out, Some(req_id), ErrorKind::Refused, e.to_string()),
    };
    drop(start);
    let _ = reader.set_read_timeout(None);
    let watch = cancel.clone();
    std::thread::spawn(move || loop {
        match k3_proto::wire::read_frame_limited::<ToWorker, _>(&mut reader, MAX_JOB_FRAME) {
            Ok(ToWorker::Cancel { req_id: r }) if r == req_id => {
                watch.store(true, Ordering::Release);
            }
            Ok(other) => tracing::warn!("serve channel: ignored {other:?}"),
            Err(e) => {
                // serve is gone (or broke the protocol): nobody waits for the ids.
                tracing::debug!("serve channel closed: {e}");
                watch.store(true, Ordering::Release);
                return;
            }
        }
    });
    let mut sink = ChannelSink {
        out,
        req_id,
        cancel,
        done: None,
    };
    let result = crate::job::run_with(&job, matches, Some(&mut sink));
    let (message, code) = match result {
        Ok(exit::OK) => match sink.done.take() {
            Some(done) => {
                sink.out.send(&done);
                return exit::OK;
            }
            None => ("the run ended without a report".to_string(), exit::FAILURE),
        },
        Ok(code) => (
            "a routed expert failed to load: the generated ids are unsound".to_string(),
            code,
        ),
        Err(e) => {
            let m = exit::message(&e);
            eprintln!("k3-worker: {m}");
            (m, e.exit_code())
        }
    };
    sink.out.send(&FromWorker::Error {
        req_id: Some(req_id),
        kind: ErrorKind::of_exit_code(code),
        exit_class: code,
        message,
    });
    code
}
