//! One request's `k3-worker` child, attached to the store, spoken to in the typed job protocol
//! ([`k3_proto::serve`], docs/SPEC.md §6.12) over a Unix socket pair that is the worker's
//! standard input.
//!
//! serve sends the job ([`Start`]); the worker sends `Prefilled`, one `Token` per id and one
//! `Done` or `Error` (a kind and the exit code it ends with). Its stderr (a line per step and
//! the run report) is drained beside it into serve's log at debug level; its last lines explain
//! a worker that died without an `Error` (a signal). Dropping a [`Job`] that has not ended sends
//! `Cancel`: the worker stops at its next step boundary, keeping what it prefilled for a retry,
//! and is killed (SIGKILL) if it has not exited within the grace; it is reaped either way. That
//! is how a client that goes away, or a stop string, ends its job.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use k3_proto::serve::{
    ErrorKind, Finish, FromWorker, Start, Timings, ToWorker, Usage, JOB_PROTOCOL_VERSION,
    MAX_JOB_FRAME,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tracing::Instrument;

/// Stderr lines kept for the message of a worker that died without an `Error`.
const KEEP_LINES: usize = 16;
/// How long a started worker has to say `Hello` (it does so before attaching).
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

/// How to run a worker.
#[derive(Clone, Debug)]
pub struct WorkerSpec {
    /// The `k3-worker` binary.
    pub exe: PathBuf,
    /// The store's socket.
    pub socket: PathBuf,
    /// `--threads` for the worker (None: its default, all cores).
    pub threads: Option<usize>,
    /// How long a cancelled worker has to end its job before it is killed.
    pub grace: Duration,
}

/// Why a job failed: the kind the worker reported (or a protocol failure) and the exit code it
/// ended with, when known.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct JobError {
    /// What kind of failure.
    pub kind: ErrorKind,
    /// The worker's exit code (None: it could not be started, or was killed by a signal).
    pub exit_class: Option<i32>,
    /// What went wrong.
    pub message: String,
}

impl JobError {
    pub(super) fn protocol(message: impl std::fmt::Display) -> JobError {
        JobError {
            kind: ErrorKind::Protocol,
            exit_class: None,
            message: message.to_string(),
        }
    }
}

/// What a running job reports.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The prompt is in the state; `cached` ids came from a kept session.
    Prefilled {
        /// Prompt ids the session already held.
        cached: u32,
    },
    /// One generated id.
    Token(u32),
    /// The job ended.
    Done {
        /// Why.
        finish: Finish,
        /// Counts.
        usage: Usage,
        /// Time and bytes.
        timings: Timings,
    },
}

/// A running job: its own worker, or a seat in the batch worker ([`BatchPool`]).
#[derive(Debug)]
pub enum Job {
    /// A worker of its own.
    Own(Box<Worker>),
    /// A seat in the shared batch worker.
    Batched(super::batch::Seat),
}

impl Job {
    /// Start a worker of its own for `start` and hand it the job.
    pub async fn spawn(spec: &WorkerSpec, start: Start) -> Result<Job, JobError> {
        Worker::spawn(spec, start)
            .await
            .map(|w| Job::Own(Box::new(w)))
    }

    /// The process id of the worker running it.
    pub fn pid(&self) -> u32 {
        match self {
            Job::Own(w) => w.pid(),
            Job::Batched(s) => s.pid,
        }
    }

    /// The next event; after `Done` the job is over.
    pub async fn next(&mut self) -> Result<Event, JobError> {
        match self {
            Job::Own(w) => w.next().await,
            Job::Batched(s) => s.next().await,
        }
    }
}

/// A running worker of one job.
pub struct Worker {
    child: Option<Child>,
    chan: UnixStream,
    stderr: Option<JoinHandle<VecDeque<String>>>,
    req_id: u64,
    pid: u32,
    grace: Duration,
    /// `Done` or `Error` arrived: the worker ends by itself.
    ended: bool,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("pid", &self.pid).finish()
    }
}

/// Why a frame of the job or listing protocol could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The connection failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A frame longer than the protocol allows.
    #[error("a frame of {len} bytes exceeds the {limit}-byte limit")]
    TooLong {
        /// Its announced length.
        len: u32,
        /// The limit.
        limit: u32,
    },
    /// The connection ended inside a frame.
    #[error("a frame cut short: {0}")]
    Short(#[source] std::io::Error),
    /// Not a message of the protocol.
    #[error(transparent)]
    Wire(#[from] k3_proto::wire::WireError),
}

/// Read one frame of the job protocol.
pub(super) async fn read_frame<R: AsyncReadExt + Unpin>(
    chan: &mut R,
) -> Result<Option<FromWorker>, FrameError> {
    let mut len = [0u8; 4];
    match chan.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len);
    if len > MAX_JOB_FRAME {
        return Err(FrameError::TooLong {
            len,
            limit: MAX_JOB_FRAME,
        });
    }
    let mut body = vec![0u8; len as usize];
    (chan.read_exact(&mut body).await).map_err(FrameError::Short)?;
    Ok(Some(k3_proto::wire::decode(&body)?))
}

/// The task draining a worker's stderr into serve's log; it returns the last lines.
pub(super) type StderrTail = Option<JoinHandle<VecDeque<String>>>;

/// A started `k3-worker --serve-channel` (`slots`: a batch worker's jobs and positions): the
/// child, serve's end of the channel, the task draining its stderr into serve's log (under the
/// current span) and keeping the last lines, and its pid.
pub(super) fn launch(
    spec: &WorkerSpec,
    slots: Option<(usize, usize)>,
) -> Result<(Child, UnixStream, StderrTail, u32), JobError> {
    let cant = |what: &str, e: &dyn std::fmt::Display| JobError {
        kind: ErrorKind::Failed,
        exit_class: None,
        message: format!("cannot start {}: {what}: {e}", spec.exe.display()),
    };
    let (ours, theirs) =
        std::os::unix::net::UnixStream::pair().map_err(|e| cant("socket pair", &e))?;
    ours.set_nonblocking(true)
        .map_err(|e| cant("socket pair", &e))?;
    let chan = UnixStream::from_std(ours).map_err(|e| cant("socket pair", &e))?;
    let mut child = Command::new(&spec.exe)
        .args(k3_worker::cli::serve_channel_args(
            &spec.socket,
            spec.threads,
            slots,
        ))
        .stdin(Stdio::from(OwnedFd::from(theirs)))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        // Its own process group: a Ctrl-C at serve's terminal reaches serve, which cancels
        // the job, not the worker directly.
        .process_group(0)
        .kill_on_drop(slots.is_some())
        .spawn()
        .map_err(|e| cant("spawn", &e))?;
    let pid = child.id().unwrap_or(0);
    // The worker's lines are logged under the current span (a request's id on every line).
    let span = tracing::Span::current();
    let stderr = child.stderr.take().map(|stderr| {
        tokio::spawn(
            async move {
                let mut lines = BufReader::new(stderr);
                let mut kept = VecDeque::with_capacity(KEEP_LINES);
                let mut line = Vec::new();
                loop {
                    line.clear();
                    // A line longer than 4 KiB is cut (read in pieces); the worker's are short.
                    match (&mut lines).take(4096).read_until(b'\n', &mut line).await {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {
                            let l = String::from_utf8_lossy(&line).trim_end().to_string();
                            tracing::debug!("worker {pid}: {l}");
                            if kept.len() == KEEP_LINES {
                                kept.pop_front();
                            }
                            kept.push_back(l);
                        }
                    }
                }
                kept
            }
            .instrument(span),
        )
    });
    Ok((child, chan, stderr, pid))
}

/// What a started worker said first.
pub(super) enum FirstWord {
    /// `Hello` in this build's protocol.
    Hello,
    /// It refused or failed before any job (`Error`): it ends by itself.
    Ended(JobError),
    /// The channel closed.
    Closed,
    /// Anything else, or nothing in time.
    Broken(JobError),
}

/// Read a started worker's first message.
pub(super) async fn first_word<R: AsyncReadExt + Unpin>(chan: &mut R) -> FirstWord {
    match tokio::time::timeout(HELLO_TIMEOUT, read_frame(chan)).await {
        Ok(Ok(Some(FromWorker::Hello {
            protocol_version: JOB_PROTOCOL_VERSION,
            ..
        }))) => FirstWord::Hello,
        Ok(Ok(Some(FromWorker::Hello {
            protocol_version, ..
        }))) => FirstWord::Broken(JobError::protocol(format!(
            "the worker speaks job protocol v{protocol_version}, this server \
             v{JOB_PROTOCOL_VERSION}: use k3 binaries from the same build"
        ))),
        Ok(Ok(Some(FromWorker::Error {
            kind,
            exit_class,
            message,
            ..
        }))) => FirstWord::Ended(JobError {
            kind,
            exit_class: Some(exit_class),
            message,
        }),
        Ok(Ok(Some(other))) => FirstWord::Broken(JobError::protocol(format!(
            "the worker did not start with Hello: {other:?}"
        ))),
        Ok(Ok(None)) => FirstWord::Closed,
        Ok(Err(e)) => FirstWord::Broken(JobError::protocol(e)),
        Err(_) => FirstWord::Broken(JobError::protocol(format!(
            "the worker said nothing within {HELLO_TIMEOUT:?}"
        ))),
    }
}

impl Worker {
    /// Start a worker for `start` and hand it the job.
    pub async fn spawn(spec: &WorkerSpec, start: Start) -> Result<Worker, JobError> {
        let (child, chan, stderr, pid) = launch(spec, None)?;
        let mut job = Worker {
            child: Some(child),
            chan,
            stderr,
            req_id: start.req_id,
            pid,
            grace: spec.grace,
            ended: false,
        };
        match first_word(&mut job.chan).await {
            FirstWord::Hello => {}
            FirstWord::Ended(e) => {
                job.ended = true;
                return Err(e);
            }
            FirstWord::Closed => return Err(job.died().await),
            FirstWord::Broken(e) => return Err(e),
        }
        let frame = k3_proto::wire::encode(&ToWorker::Start(start)).map_err(JobError::protocol)?;
        job.chan
            .write_all(&frame)
            .await
            .map_err(|e| JobError::protocol(format!("sending the job: {e}")))?;
        Ok(job)
    }

    /// The worker's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The next event; after `Done` the job is over (and the worker exits by itself).
    pub async fn next(&mut self) -> Result<Event, JobError> {
        if self.ended {
            return Err(JobError::protocol("the job has ended"));
        }
        let m = read_frame(&mut self.chan)
            .await
            .map_err(|e| JobError::protocol(e.to_string()))?;
        let Some(m) = m else {
            return Err(self.died().await);
        };
        let mine = |r: u64| r == self.req_id;
        match m {
            FromWorker::Prefilled {
                req_id, cached_ids, ..
            } if mine(req_id) => Ok(Event::Prefilled { cached: cached_ids }),
            FromWorker::Token { req_id, id } if mine(req_id) => Ok(Event::Token(id)),
            FromWorker::Done {
                req_id,
                finish,
                usage,
                timings,
            } if mine(req_id) => {
                self.ended = true;
                Ok(Event::Done {
                    finish,
                    usage,
                    timings,
                })
            }
            FromWorker::Error {
                kind,
                exit_class,
                message,
                ..
            } => {
                self.ended = true;
                Err(JobError {
                    kind,
                    exit_class: Some(exit_class),
                    message,
                })
            }
            other => Err(JobError::protocol(format!(
                "unexpected message from the worker: {other:?}"
            ))),
        }
    }

    /// The channel closed without `Done` or `Error`: how the worker ended, with its last
    /// stderr lines.
    async fn died(&mut self) -> JobError {
        self.ended = true;
        let status = match self.child.as_mut() {
            Some(c) => c.wait().await,
            None => return JobError::protocol("the worker is gone"),
        };
        self.child = None;
        let lines = match self.stderr.take() {
            Some(h) => h.await.unwrap_or_default(),
            None => VecDeque::new(),
        };
        let said = lines.back().cloned().unwrap_or_default();
        match status {
            Ok(s) => JobError {
                kind: s.code().map_or(ErrorKind::Failed, ErrorKind::of_exit_code),
                exit_class: s.code(),
                message: format!("the worker ended ({s}) without a report: {said}"),
            },
            Err(e) => JobError::protocol(format!("waiting for the worker: {e}")),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let (pid, grace, ended) = (self.pid, self.grace, self.ended);
        if !ended {
            // A cancel is a 13-byte frame: the socket takes it without blocking.
            if let Ok(f) = k3_proto::wire::encode(&ToWorker::Cancel {
                req_id: self.req_id,
            }) {
                let _ = self.chan.try_write(&f);
            }
        }
        let stderr = self.stderr.take();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let span = tracing::Span::current();
                rt.spawn(
                    async move {
                        match tokio::time::timeout(grace, child.wait()).await {
                            Ok(_) if ended => {}
                            Ok(status) => tracing::info!(
                                "worker pid {pid} ended its cancelled job ({})",
                                status.map_or_else(|e| e.to_string(), |s| s.to_string())
                            ),
                            Err(_) => {
                                let _ = child.start_kill();
                                let _ = child.wait().await;
                                tracing::warn!(
                                    "worker pid {pid} did not end within {grace:?} of its cancel: \
                                 killed and reaped"
                                );
                            }
                        }
                        if let Some(h) = stderr {
                            let _ = h.await;
                        }
                    }
                    .instrument(span),
                );
            }
            Err(_) => {
                // No runtime (shutdown): kill it; tokio reaps orphans when it can.
                let _ = child.start_kill();
            }
        }
    }
}
