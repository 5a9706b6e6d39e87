//! Continuous batching in serve: one long-lived `k3-worker --serve-channel --parallel N` (the
//! batch worker) takes every request that fits it — a request joins the running batch at the
//! worker's next step and leaves when it ends or is cancelled, without stopping the others
//! (docs/SPEC.md §6.12: the same job protocol, several jobs on one channel, named by `req_id`).
//!
//! [`BatchPool::submit`] hands a job to the worker (starting it on first use, and again after it
//! died) and returns a [`Seat`]: the job's events arrive on its own queue, routed by `req_id`
//! from the one task reading the channel. Dropping a seat that has not ended sends `Cancel`. A
//! worker that dies fails every job it held (with its last stderr lines); the next request
//! starts a new one. A worker that cannot start because its plan does not fit the machine
//! disables batching for this server (logged once): requests then get workers of their own.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use k3_proto::serve::{ErrorKind, FromWorker, ReqId, Start, ToWorker};
use tokio::io::AsyncWriteExt;
use tokio::process::Child;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::job::{
    first_word, launch, read_frame, Event, FirstWord, JobError, StderrTail, WorkerSpec,
};

/// Where each job's events go.
type Routes = Arc<Mutex<HashMap<ReqId, mpsc::UnboundedSender<Result<Event, JobError>>>>>;

/// The running batch worker.
struct Running {
    pid: u32,
    frames: mpsc::UnboundedSender<ToWorker>,
    routes: Routes,
    alive: Arc<AtomicBool>,
}

/// The batch worker of one server.
pub struct BatchPool {
    spec: WorkerSpec,
    /// Jobs at once.
    pub slots: usize,
    /// Positions each job may take (prompt + reply).
    pub positions: usize,
    running: tokio::sync::Mutex<Option<Running>>,
    /// Set when the worker could not start for a reason a restart does not change.
    disabled: AtomicBool,
}

impl std::fmt::Debug for BatchPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchPool")
            .field("slots", &self.slots)
            .field("positions", &self.positions)
            .finish()
    }
}

/// A job's place in the batch worker.
pub struct Seat {
    req_id: ReqId,
    /// The batch worker's pid.
    pub pid: u32,
    events: mpsc::UnboundedReceiver<Result<Event, JobError>>,
    frames: mpsc::UnboundedSender<ToWorker>,
    routes: Routes,
    ended: bool,
}

impl std::fmt::Debug for Seat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seat")
            .field("req_id", &self.req_id)
            .field("pid", &self.pid)
            .finish()
    }
}

impl BatchPool {
    /// A pool whose worker (started on first use) takes `slots` jobs of up to `positions` each.
    pub fn new(spec: WorkerSpec, slots: usize, positions: usize) -> BatchPool {
        BatchPool {
            spec,
            slots,
            positions,
            running: tokio::sync::Mutex::new(None),
            disabled: AtomicBool::new(false),
        }
    }

    /// True when `start` can run in the batch worker (else it gets a worker of its own).
    pub fn takes(&self, start: &Start) -> bool {
        !self.disabled.load(Ordering::Acquire)
            && k3_worker::generate::positions_needed(start.ids.len(), start.max_new as usize)
                <= self.positions
    }

    /// Hand `start` to the batch worker. `Ok(None)`: batching is off for good (the worker cannot
    /// start on this machine); run the job in a worker of its own.
    pub async fn submit(&self, start: Start) -> Result<Option<Seat>, JobError> {
        let mut g = self.running.lock().await;
        if !g.as_ref().is_some_and(|r| r.alive.load(Ordering::Acquire)) {
            match self.start_worker().await {
                Ok(r) => *g = Some(r),
                Err(e) if e.kind == ErrorKind::Refused => {
                    tracing::warn!(
                        "the batch worker cannot start ({}): concurrent requests get workers of \
                         their own",
                        e.message
                    );
                    self.disabled.store(true, Ordering::Release);
                    return Ok(None);
                }
                Err(e) => return Err(e),
            }
        }
        let r = g.as_ref().expect("started above");
        let (tx, events) = mpsc::unbounded_channel();
        let req_id = start.req_id;
        r.routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(req_id, tx);
        if r.frames.send(ToWorker::Start(start)).is_err() {
            r.routes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&req_id);
            return Err(JobError::protocol("the batch worker is gone"));
        }
        Ok(Some(Seat {
            req_id,
            pid: r.pid,
            events,
            frames: r.frames.clone(),
            routes: r.routes.clone(),
            ended: false,
        }))
    }

    /// Start the worker: `Hello`, then a task writing frames and one routing what it says.
    async fn start_worker(&self) -> Result<Running, JobError> {
        let span = tracing::info_span!("batch-worker");
        let (child, mut chan, stderr, pid) =
            span.in_scope(|| launch(&self.spec, Some((self.slots, self.positions))))?;
        match first_word(&mut chan).await {
            FirstWord::Hello => {}
            FirstWord::Ended(e) | FirstWord::Broken(e) => return Err(e),
            FirstWord::Closed => return Err(died(child, stderr).await),
        }
        tracing::info!(
            "batch worker pid {pid} started: up to {} jobs of {} positions",
            self.slots,
            self.positions
        );
        let (mut rd, mut wr) = chan.into_split();
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
        let routes: Routes = Arc::new(Mutex::new(HashMap::new()));
        let alive = Arc::new(AtomicBool::new(true));
        let (r2, a2) = (routes.clone(), alive.clone());
        tokio::spawn(
            async move {
                let end = loop {
                    match read_frame(&mut rd).await {
                        Ok(Some(m)) => route(&r2, m),
                        Ok(None) => break None,
                        Err(e) => break Some(JobError::protocol(e)),
                    }
                };
                a2.store(false, Ordering::Release);
                let e = match end {
                    Some(e) => e,
                    None => died(child, stderr).await,
                };
                tracing::warn!("batch worker pid {pid} ended: {}", e.message);
                let waiting: Vec<_> = r2
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .drain()
                    .collect();
                for (_, tx) in waiting {
                    let _ = tx.send(Err(JobError {
                        kind: e.kind,
                        exit_class: e.exit_class,
                        message: e.message.clone(),
                    }));
                }
            }
            .instrument(span),
        );
        Ok(Running {
            pid,
            frames,
            routes,
            alive,
        })
    }
}

/// Deliver one message of the worker to its job.
fn route(routes: &Routes, m: FromWorker) {
    let mut r = routes.lock().unwrap_or_else(|p| p.into_inner());
    let (req_id, ev, last) = match m {
        FromWorker::Prefilled {
            req_id, cached_ids, ..
        } => (req_id, Ok(Event::Prefilled { cached: cached_ids }), false),
        FromWorker::Token { req_id, id } => (req_id, Ok(Event::Token(id)), false),
        FromWorker::Done {
            req_id,
            finish,
            usage,
            timings,
        } => (
            req_id,
            Ok(Event::Done {
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
            }),
            true,
        ),
        other => {
            // A worker-wide error precedes its exit; the reader reports the end to every job.
            tracing::warn!("batch worker: {other:?}");
            return;
        }
    };
    let tx = if last {
        r.remove(&req_id)
    } else {
        r.get(&req_id).cloned()
    };
    if let Some(tx) = tx {
        let _ = tx.send(ev);
    }
}

/// How a worker that closed its channel ended, with its last stderr lines.
async fn died(mut child: Child, stderr: StderrTail) -> JobError {
    let status = child.wait().await;
    let lines = match stderr {
        Some(h) => h.await.unwrap_or_default(),
        None => VecDeque::new(),
    };
    let said = lines.back().cloned().unwrap_or_default();
    match status {
        Ok(s) => JobError {
            kind: s.code().map_or(ErrorKind::Failed, ErrorKind::of_exit_code),
            exit_class: s.code(),
            message: format!("the batch worker ended ({s}): {said}"),
        },
        Err(e) => JobError::protocol(format!("waiting for the batch worker: {e}")),
    }
}

impl Seat {
    /// The job's next event; after `Done` (or an error) it is over.
    pub async fn next(&mut self) -> Result<Event, JobError> {
        if self.ended {
            return Err(JobError::protocol("the job has ended"));
        }
        let ev = self
            .events
            .recv()
            .await
            .unwrap_or_else(|| Err(JobError::protocol("the batch worker is gone")));
        if matches!(ev, Ok(Event::Done { .. }) | Err(_)) {
            self.ended = true;
        }
        ev
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        if !self.ended {
            // The worker drops the job at its next step and answers `Done` (nobody reads it).
            let _ = self.frames.send(ToWorker::Cancel {
                req_id: self.req_id,
            });
        }
        self.routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.req_id);
    }
}
