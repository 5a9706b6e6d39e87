//! The one worker of a serve process and its jobs: `k3-worker --serve-channel --parallel N --ctx
//! P` (its command line built by `k3_worker::front::cli::serve_channel_args`), attached to the
//! store, spoken to in the typed job protocol ([`k3_proto::serve`], docs/SPEC.md §6.12) over a
//! Unix socket pair that is its standard input. Every request, whatever its size, is a job in
//! that worker's engine: it joins the running sequences at the worker's next step with room
//! and leaves when it ends or is cancelled, without stopping the others.
//!
//! [`Worker::submit`] hands a job over (starting the worker on first use, and again after it
//! died) and returns a [`Job`]: its events arrive on its own queue, routed by `req_id` from the
//! one task reading the channel. The worker's stderr (its log) is drained into serve's log at
//! debug level; its last lines explain a worker that died without an `Error`. Dropping a [`Job`]
//! that has not ended sends `Cancel`: the worker ends it at its next step (keeping what its
//! session holds after the prefill, for a retry) and answers `Done`; if that does not come
//! within the grace, the worker is killed (every job in it fails) and the next request starts
//! a new one. That is how a client that goes away, or a stop string, ends its job.
//!
//! Supervision ([`super::supervise`]): failed starts back off; a worker that holds jobs and says
//! nothing for the stall deadline is failed (its jobs get [`Cause::Stalled`]), killed and
//! replaced; [`Worker::health`] says why no worker progresses. A client's error carries only
//! what concerns its own job: a worker that died is described by its exit status, and its last
//! stderr lines (which may name another request's session) go to serve's log only.

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use k3_proto::serve::{
    ErrorKind, Finish, FromWorker, Start, Timings, ToWorker, Usage, JOB_PROTOCOL_VERSION,
    MAX_JOB_FRAME,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::supervise::Backoff;

/// Stderr lines kept for the message of a worker that died without an `Error`.
const KEEP_LINES: usize = 16;
/// How long a started worker has to say `Hello` (it does so before attaching).
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

/// How to run the worker.
#[derive(Clone, Debug)]
pub struct WorkerSpec {
    /// The `k3-worker` binary.
    pub exe: PathBuf,
    /// The store's socket.
    pub socket: PathBuf,
    /// `--threads` for the worker (None: its default, all cores).
    pub threads: Option<usize>,
    /// How long a cancelled job has to end before its worker is killed.
    pub grace: Duration,
    /// Jobs decoded at once (`--parallel`).
    pub slots: usize,
    /// Positions each slot is planned for (`--ctx`).
    pub positions: usize,
    /// The longest a worker holding jobs may go without a message ([`super::supervise`]).
    pub stall: Duration,
    /// serve's tokenizer (`--tok`: the worker compiles constrained jobs' grammars over it).
    pub tok: Option<PathBuf>,
}

/// serve's own finding about a job's failure (not the worker's report).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Cause {
    /// The worker made no step progress within the stall deadline: killed and replaced.
    Stalled {
        /// Seconds it was silent.
        silent: u64,
    },
    /// Worker starts back off after failed ones: no start was tried.
    Backoff {
        /// Seconds until the next start may be tried.
        retry_after: u64,
    },
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
    /// serve's own finding, when it is one.
    pub cause: Option<Cause>,
}

impl JobError {
    pub(super) fn protocol(message: impl std::fmt::Display) -> JobError {
        JobError {
            kind: ErrorKind::Protocol,
            exit_class: None,
            message: message.to_string(),
            cause: None,
        }
    }

    fn copy(&self) -> JobError {
        JobError {
            kind: self.kind,
            exit_class: self.exit_class,
            message: self.message.clone(),
            cause: self.cause,
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
    /// One generated id of choice `choice`.
    Token {
        /// The choice (0 for a job of one).
        choice: u32,
        /// The id.
        id: u32,
    },
    /// One generated id with its log-probability and its step's most likely ids.
    Scored {
        /// The choice.
        choice: u32,
        /// The id.
        id: u32,
        /// Its log-probability.
        logprob: f32,
        /// The most likely ids with theirs.
        top: Vec<(u32, f32)>,
    },
    /// A choice ended (the job ends with the last choice's).
    Done {
        /// The choice.
        choice: u32,
        /// Why.
        finish: Finish,
        /// Counts.
        usage: Usage,
        /// Time and bytes.
        timings: Timings,
    },
}

/// A job's events, or its failure.
type Routed = Result<Event, JobError>;
/// Where a job's events go, and how many of its choices have yet to end.
#[derive(Debug)]
struct Route {
    tx: mpsc::UnboundedSender<Routed>,
    left: u32,
}
/// Where each job's events go.
type Routes = Arc<Mutex<HashMap<u64, Route>>>;

/// The running worker.
struct Running {
    pid: u32,
    frames: mpsc::UnboundedSender<ToWorker>,
    live: Live,
    /// Kill it (a cancelled job that did not end in time, or a stall).
    kill: Arc<Notify>,
}

/// What the watchdog and `/health` see of the running worker.
#[derive(Clone, Debug)]
struct Live {
    pid: u32,
    routes: Routes,
    alive: Arc<AtomicBool>,
    /// When it last said something (or was handed work while idle).
    progress: Arc<Mutex<Instant>>,
    /// Kill it.
    kill: Arc<Notify>,
    /// Ended on purpose by serve (its store went away): not a failed start.
    retired: Arc<AtomicBool>,
}

impl Live {
    fn silent_for(&self) -> Duration {
        lock(&self.progress).elapsed()
    }

    fn touch(&self) {
        *lock(&self.progress) = Instant::now();
    }

    fn jobs(&self) -> usize {
        lock(&self.routes).len()
    }
}

/// The worker of one server.
pub struct Worker {
    spec: WorkerSpec,
    running: tokio::sync::Mutex<Option<Running>>,
    /// Failed starts in a row, and the kind of the last failure.
    backoff: Arc<Mutex<(Backoff, ErrorKind)>>,
    /// The running worker as `/health` sees it (without the async lock).
    live: Mutex<Option<Live>>,
    /// A stalled worker was killed and its replacement has not said `Hello` yet.
    replacing: Arc<AtomicBool>,
    /// Told by the watchdog when a stalled worker was killed and needs a replacement.
    replace_wanted: Arc<Notify>,
    /// The task that starts replacements (spawned with the first job, inside the runtime).
    replacer: std::sync::OnceLock<()>,
    /// This handle, for that task.
    me: Weak<Worker>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("spec", &self.spec).finish()
    }
}

/// A job in the worker: its events, and its cancel when dropped before it ended.
pub struct Job {
    req_id: u64,
    pid: u32,
    events: mpsc::UnboundedReceiver<Routed>,
    frames: mpsc::UnboundedSender<ToWorker>,
    routes: Routes,
    kill: Arc<Notify>,
    grace: Duration,
    /// Choices that have not ended (0: the job is over).
    left: u32,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("req_id", &self.req_id)
            .field("pid", &self.pid)
            .finish()
    }
}

impl Worker {
    /// The worker of a server (started on first use).
    pub fn new(spec: WorkerSpec) -> Arc<Worker> {
        Arc::new_cyclic(|me| Worker {
            spec,
            running: tokio::sync::Mutex::new(None),
            backoff: Arc::new(Mutex::new((Backoff::default(), ErrorKind::Failed))),
            live: Mutex::new(None),
            replacing: Arc::new(AtomicBool::new(false)),
            replace_wanted: Arc::new(Notify::new()),
            replacer: std::sync::OnceLock::new(),
            me: me.clone(),
        })
    }

    /// `Err(reason)` while no worker progresses: one holds jobs and has said nothing for half
    /// the stall deadline, a stalled one is being replaced, or starts back off.
    pub fn health(&self) -> Result<(), String> {
        if self.replacing.load(Ordering::Acquire) {
            return Err(
                "the worker made no step progress within the stall deadline: it was \
                        killed and a new one is starting"
                    .into(),
            );
        }
        if let Some(l) = lock(&self.live).as_ref() {
            let (jobs, silent) = (l.jobs(), l.silent_for());
            if l.alive.load(Ordering::Acquire) && jobs > 0 && silent > self.spec.stall / 2 {
                return Err(format!(
                    "worker pid {} has made no step progress for {} s with {jobs} job(s) in \
                     it (it is failed after {} s)",
                    l.pid,
                    silent.as_secs(),
                    self.spec.stall.as_secs()
                ));
            }
        }
        let b = lock(&self.backoff);
        if let Some(wait) = b.0.wait(Instant::now()) {
            return Err(format!(
                "the worker failed {} start(s) in a row; the next start is in {} s",
                b.0.failures(),
                wait.as_secs_f64().ceil()
            ));
        }
        Ok(())
    }

    /// How it runs.
    pub fn spec(&self) -> &WorkerSpec {
        &self.spec
    }

    /// The store went away: end an idle worker now (it is attached to the store that is gone
    /// and would fail the first job it gets after a restart); the next job starts a new one.
    pub fn retire(&self) {
        if let Some(l) = lock(&self.live).as_ref() {
            if l.alive.load(Ordering::Acquire) && l.jobs() == 0 {
                if !l.retired.swap(true, Ordering::AcqRel) {
                    tracing::info!("the store is gone: ending worker pid {}", l.pid);
                }
                l.kill.notify_one();
            }
        }
    }

    /// Hand `start` to the worker (starting it when none is alive).
    pub async fn submit(&self, start: Start) -> Result<Job, JobError> {
        self.replacer.get_or_init(|| {
            tokio::spawn(replacer(self.me.clone(), self.replace_wanted.clone()));
        });
        let mut g = self.running.lock().await;
        if !g
            .as_ref()
            .is_some_and(|r| r.live.alive.load(Ordering::Acquire))
        {
            *g = Some(self.start_worker().await?);
        }
        let r = g.as_ref().expect("started above");
        let (tx, events) = mpsc::unbounded_channel();
        let req_id = start.req_id;
        let left = start.choices();
        {
            let mut routes = lock(&r.live.routes);
            if routes.is_empty() {
                // An idle worker's silence is not a stall: the clock starts with the work.
                r.live.touch();
            }
            routes.insert(req_id, Route { tx, left });
        }
        if r.frames.send(ToWorker::Start(start)).is_err() {
            lock(&r.live.routes).remove(&req_id);
            return Err(JobError::protocol("the worker is gone"));
        }
        Ok(Job {
            req_id,
            pid: r.pid,
            events,
            frames: r.frames.clone(),
            routes: r.live.routes.clone(),
            kill: r.kill.clone(),
            grace: self.spec.grace,
            left,
        })
    }

    /// Start a worker unless starts back off; a failed start makes the next one wait longer.
    async fn start_worker(&self) -> Result<Running, JobError> {
        {
            let b = lock(&self.backoff);
            if let Some(wait) = b.0.wait(Instant::now()) {
                let retry_after = wait.as_secs_f64().ceil() as u64;
                return Err(JobError {
                    kind: b.1,
                    exit_class: None,
                    message: format!(
                        "the worker failed {} start(s) in a row; the next start is in \
                         {retry_after} s",
                        b.0.failures()
                    ),
                    cause: Some(Cause::Backoff { retry_after }),
                });
            }
        }
        let r = self.launch_worker().await;
        if let Err(e) = &r {
            let mut b = lock(&self.backoff);
            let wait = b.0.failed(Instant::now());
            b.1 = e.kind;
            tracing::warn!(
                "the worker did not start ({}); the next start waits {} s",
                e.message,
                wait.as_secs()
            );
        }
        r
    }

    /// Start the worker: `Hello`, then a task writing frames, one routing what it says and one
    /// watching its progress.
    async fn launch_worker(&self) -> Result<Running, JobError> {
        let span = tracing::info_span!("worker");
        tracing::info!(
            "starting a worker ({} failed start(s) before)",
            lock(&self.backoff).0.failures()
        );
        let (child, mut chan, stderr, pid) = span.in_scope(|| launch(&self.spec))?;
        match first_word(&mut chan).await {
            FirstWord::Hello => {}
            FirstWord::Ended(e) | FirstWord::Broken(e) => return Err(e),
            FirstWord::Closed => return Err(died(pid, child, stderr).await),
        }
        tracing::info!(
            "worker pid {pid} started: up to {} jobs at once, {} positions a slot",
            self.spec.slots,
            self.spec.positions
        );
        let (rd, mut wr) = chan.into_split();
        let (frames, mut queue) = mpsc::unbounded_channel::<ToWorker>();
        tokio::spawn(
            async move {
                while let Some(m) = queue.recv().await {
                    let Ok(f) = k3_proto::wire::encode(&m) else {
                        continue;
                    };
                    if wr.write_all(&f).await.is_err() {
                        return;
                    }
                }
            }
            .instrument(span.clone()),
        );
        let kill = Arc::new(Notify::new());
        let live = Live {
            pid,
            routes: Arc::new(Mutex::new(HashMap::new())),
            alive: Arc::new(AtomicBool::new(true)),
            progress: Arc::new(Mutex::new(Instant::now())),
            kill: kill.clone(),
            retired: Arc::new(AtomicBool::new(false)),
        };
        let reader = Reader {
            live: live.clone(),
            kill: kill.clone(),
            backoff: self.backoff.clone(),
        };
        tokio::spawn(reader.run(rd, child, stderr).instrument(span.clone()));
        tokio::spawn(
            Watchdog {
                live: live.clone(),
                kill: kill.clone(),
                deadline: self.spec.stall,
                replacing: self.replacing.clone(),
                replace_wanted: self.replace_wanted.clone(),
            }
            .run()
            .instrument(span),
        );
        *lock(&self.live) = Some(live.clone());
        self.replacing.store(false, Ordering::Release);
        Ok(Running {
            pid,
            frames,
            live,
            kill,
        })
    }

    /// Start a worker in place of one the watchdog killed (once it has ended), after the
    /// backoff's wait.
    async fn replace(&self) {
        let wait = lock(&self.backoff).0.wait(Instant::now());
        if let Some(wait) = wait {
            tokio::time::sleep(wait).await;
        }
        let mut g = self.running.lock().await;
        if !g
            .as_ref()
            .is_some_and(|r| r.live.alive.load(Ordering::Acquire))
        {
            match self.start_worker().await {
                Ok(r) => *g = Some(r),
                Err(e) => tracing::warn!("no worker replaces the stalled one: {}", e.message),
            }
        }
        self.replacing.store(false, Ordering::Release);
    }
}

/// How often the watchdog looks at the worker's progress.
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// Starts a worker in place of each one the watchdog killed.
async fn replacer(worker: Weak<Worker>, wanted: Arc<Notify>) {
    loop {
        wanted.notified().await;
        let Some(w) = worker.upgrade() else {
            return;
        };
        w.replace().await;
    }
}

/// Watches one worker's progress.
struct Watchdog {
    live: Live,
    kill: Arc<Notify>,
    deadline: Duration,
    replacing: Arc<AtomicBool>,
    replace_wanted: Arc<Notify>,
}

impl Watchdog {
    /// Fail, kill and have replaced the worker when it holds jobs and says nothing for the
    /// deadline.
    async fn run(self) {
        let live = &self.live;
        loop {
            tokio::time::sleep(WATCH_EVERY).await;
            if !live.alive.load(Ordering::Acquire) {
                return;
            }
            let silent = live.silent_for();
            if live.jobs() > 0 && silent >= self.deadline {
                break self.fail(silent).await;
            }
        }
    }

    async fn fail(&self, silent: Duration) {
        let live = &self.live;
        self.replacing.store(true, Ordering::Release);
        let e = JobError {
            kind: ErrorKind::Failed,
            exit_class: None,
            message: format!(
                "the worker made no step progress for {} s (the stall deadline): it was killed \
                 and is being replaced",
                silent.as_secs()
            ),
            cause: Some(Cause::Stalled {
                silent: silent.as_secs(),
            }),
        };
        let failed: Vec<_> = lock(&live.routes).drain().collect();
        tracing::warn!(
            "worker pid {} made no step progress for {} s with {} job(s) in it: failing them, \
             killing it and starting another",
            live.pid,
            silent.as_secs(),
            failed.len()
        );
        for (_, route) in failed {
            let _ = route.tx.send(Err(e.copy()));
        }
        self.kill.notify_one();
        while live.alive.load(Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.replace_wanted.notify_one();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The task that reads what the worker says and routes it to its jobs; when the channel ends it
/// reaps the worker and fails every job still in it.
struct Reader {
    live: Live,
    kill: Arc<Notify>,
    backoff: Arc<Mutex<(Backoff, ErrorKind)>>,
}

impl Reader {
    async fn run(
        self,
        mut rd: tokio::net::unix::OwnedReadHalf,
        mut child: Child,
        stderr: StderrTail,
    ) {
        let mut served = false;
        let end = loop {
            tokio::select! {
                r = read_frame(&mut rd) => match r {
                    Ok(Some(m)) => {
                        self.live.touch();
                        if matches!(m, FromWorker::Done { .. }) && !served {
                            served = true;
                            lock(&self.backoff).0.served();
                        }
                        route(&self.live.routes, m)
                    }
                    Ok(None) => break None,
                    // A worker killed with bytes unread in its end of the socket resets the
                    // channel instead of closing it: an end like any other, told by its status.
                    Err(FrameError::Io(e)) | Err(FrameError::Short(e)) => {
                        tracing::debug!("worker channel: {e}");
                        break None;
                    }
                    Err(e) => break Some(JobError::protocol(e)),
                },
                _ = self.kill.notified() => {
                    // Its end is read from the channel, which closes with it.
                    let _ = child.start_kill();
                }
            }
        };
        let pid = self.live.pid;
        let e = match end {
            Some(e) => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                e
            }
            None => died(pid, child, stderr).await,
        };
        if !served && !self.live.retired.load(Ordering::Acquire) {
            let mut b = lock(&self.backoff);
            let wait = b.0.failed(Instant::now());
            b.1 = e.kind;
            tracing::warn!(
                "worker pid {pid} ended before it finished a job: the next start waits {} s",
                wait.as_secs()
            );
        }
        self.live.alive.store(false, Ordering::Release);
        tracing::warn!("worker pid {pid} ended: {}", e.message);
        let waiting: Vec<_> = lock(&self.live.routes).drain().collect();
        for (_, route) in waiting {
            let _ = route.tx.send(Err(e.copy()));
        }
    }
}

/// Deliver one message of the worker to its job.
fn route(routes: &Routes, m: FromWorker) {
    let mut r = lock(routes);
    let (req_id, ev, last) = match m {
        FromWorker::Prefilled {
            req_id, cached_ids, ..
        } => (req_id, Ok(Event::Prefilled { cached: cached_ids }), false),
        FromWorker::Token { req_id, choice, id } => {
            (req_id, Ok(Event::Token { choice, id }), false)
        }
        FromWorker::Scored {
            req_id,
            choice,
            id,
            logprob,
            top,
        } => (
            req_id,
            Ok(Event::Scored {
                choice,
                id,
                logprob,
                top,
            }),
            false,
        ),
        FromWorker::Done {
            req_id,
            choice,
            finish,
            usage,
            timings,
        } => (
            req_id,
            Ok(Event::Done {
                choice,
                finish,
                usage,
                timings,
            }),
            true,
        ),
        FromWorker::Error {
            req_id: Some(req_id),
            kind,
            exit_class,
            message,
        } => (
            req_id,
            Err(JobError {
                kind,
                exit_class: Some(exit_class),
                message,
                cause: None,
            }),
            true,
        ),
        other => {
            // A worker-wide error precedes its exit; the reader reports the end to every job.
            tracing::warn!("worker: {other:?}");
            return;
        }
    };
    let Some(route) = r.get_mut(&req_id) else {
        return;
    };
    let failed = ev.is_err();
    let _ = route.tx.send(ev);
    // The job's last `Done`, or its `Error`, ends its route.
    if last && (failed || route.left <= 1) {
        r.remove(&req_id);
    } else if last {
        route.left -= 1;
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
    #[error("a frame cut short")]
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
type StderrTail = Option<JoinHandle<VecDeque<String>>>;

/// Start `k3-worker --serve-channel`: the child, serve's end of the channel, the task draining
/// its stderr into serve's log (under the current span) and keeping the last lines, and its pid.
fn launch(spec: &WorkerSpec) -> Result<(Child, UnixStream, StderrTail, u32), JobError> {
    let cant = |what: &str, e: &dyn std::fmt::Display| JobError {
        kind: ErrorKind::Failed,
        exit_class: None,
        message: format!("cannot start {}: {what}: {e}", spec.exe.display()),
        cause: None,
    };
    let (ours, theirs) =
        std::os::unix::net::UnixStream::pair().map_err(|e| cant("socket pair", &e))?;
    ours.set_nonblocking(true)
        .map_err(|e| cant("socket pair", &e))?;
    let chan = UnixStream::from_std(ours).map_err(|e| cant("socket pair", &e))?;
    let mut child = Command::new(&spec.exe)
        .args(k3_worker::front::cli::serve_channel_args(
            &spec.socket,
            spec.threads,
            spec.slots,
            spec.positions,
            spec.tok.as_deref(),
        ))
        .stdin(Stdio::from(OwnedFd::from(theirs)))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        // Its own process group: a Ctrl-C at serve's terminal reaches serve, which closes the
        // channel, not the worker directly.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| cant("spawn", &e))?;
    let pid = child.id().unwrap_or(0);
    // The worker's lines are logged under the current span.
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
enum FirstWord {
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
async fn first_word<R: AsyncReadExt + Unpin>(chan: &mut R) -> FirstWord {
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
            cause: None,
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

/// How a worker that closed its channel ended: its exit status for the clients; its last
/// stderr lines go to serve's log only (they may name another request's session or ids).
async fn died(pid: u32, mut child: Child, stderr: StderrTail) -> JobError {
    let status = child.wait().await;
    let lines = match stderr {
        Some(h) => h.await.unwrap_or_default(),
        None => VecDeque::new(),
    };
    if !lines.is_empty() {
        let tail: Vec<&str> = lines.iter().map(String::as_str).collect();
        tracing::warn!(
            "worker pid {pid} ended; its last lines:\n  {}",
            tail.join("\n  ")
        );
    }
    match status {
        Ok(s) => JobError {
            kind: s.code().map_or(ErrorKind::Failed, ErrorKind::of_exit_code),
            exit_class: s.code(),
            message: format!("the worker ended ({s}); serve's log has its last lines"),
            cause: None,
        },
        Err(e) => JobError::protocol(format!("waiting for the worker: {e}")),
    }
}

impl Job {
    /// The process id of the worker running it.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The job's next event; after `Done` (or an error) it is over.
    pub async fn next(&mut self) -> Result<Event, JobError> {
        if self.left == 0 {
            return Err(JobError::protocol("the job has ended"));
        }
        let ev = self
            .events
            .recv()
            .await
            .unwrap_or_else(|| Err(JobError::protocol("the worker is gone")));
        match ev {
            Ok(Event::Done { .. }) => self.left -= 1,
            Err(_) => self.left = 0,
            Ok(_) => {}
        }
        ev
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let mut routes = lock(&self.routes);
        // Ends already routed but not read (a choice that ended as the reply was cut short by
        // a stop string) are not waited for again: the worker has forgotten those choices.
        // Under the routes' lock, so that every later message goes to the watcher below.
        while let Ok(ev) = self.events.try_recv() {
            match ev {
                Ok(Event::Done { .. }) => self.left = self.left.saturating_sub(1),
                Err(_) => self.left = 0,
                Ok(_) => {}
            }
        }
        if self.left == 0 {
            routes.remove(&self.req_id);
            return;
        }
        // The worker ends the job at its next step and answers `Done` for each choice left; a
        // watcher waits for them within the grace, else kills the worker.
        let (tx, mut rx) = mpsc::unbounded_channel();
        let left = self.left;
        routes.insert(self.req_id, Route { tx, left });
        drop(routes);
        let _ = self.frames.send(ToWorker::Cancel {
            req_id: self.req_id,
        });
        let (pid, req_id, grace, kill) = (self.pid, self.req_id, self.grace, self.kill.clone());
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // Shutting down: the worker goes with serve (its channel closes).
        };
        let span = tracing::Span::current();
        rt.spawn(
            async move {
                let ended = async {
                    let mut left = left;
                    while let Some(ev) = rx.recv().await {
                        match ev {
                            Ok(Event::Done { .. }) if left > 1 => left -= 1,
                            Ok(Event::Done { .. }) | Err(_) => return true,
                            Ok(_) => {}
                        }
                    }
                    false
                };
                match tokio::time::timeout(grace, ended).await {
                    Ok(_) => tracing::info!("worker pid {pid} ended its cancelled job {req_id}"),
                    Err(_) => {
                        tracing::warn!(
                            "worker pid {pid} did not end job {req_id} within {grace:?} of its \
                             cancel: killed"
                        );
                        kill.notify_one();
                    }
                }
            }
            .instrument(span),
        );
    }
}
