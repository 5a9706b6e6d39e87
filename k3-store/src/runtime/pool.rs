//! Long-lived I/O threads: no thread is spawned per layer or per expert batch.
//!
//! An [`IoPool`] owns a fixed set of threads started once (with the cache or the source that
//! owns it) which take boxed jobs from one FIFO queue, in the order they were submitted (callers
//! submit reads in disk-offset order). The queue is multi-consumer: every idle thread waits on it
//! directly, so a batch of jobs wakes several threads at once instead of handing the queue from
//! one thread to the next. A job that panics is caught on its thread: the thread survives and
//! the submitter gets the panic's message as an error instead of a result.
//!
//! [`IoPool::map`] also runs jobs on the CALLING thread: the caller takes jobs from the same
//! batch as the pool's threads, so the first read starts at once, without waiting for a thread
//! to wake (on a 2-vCPU VM a wake-up costs tens of µs, the same order as a 52 KB read).
//!
//! Jobs are `'static`: they own what they touch (an `Arc` of the slot memory and reader, a copy
//! of the ids). [`IoPool::map`] drops each job's captures BEFORE it reports the job's result, so
//! once `map` returns no pool thread holds anything the caller gave it.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};

use crossbeam_channel as channel;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A fixed set of long-lived threads running submitted jobs in FIFO order.
pub struct IoPool {
    tx: Mutex<Option<channel::Sender<Job>>>,
    handles: Vec<std::thread::JoinHandle<()>>,
    threads: usize,
    name: String,
}

impl Drop for IoPool {
    /// Close the queue and wait for the threads to finish the jobs already queued, so that no
    /// job outlives what its pool's owner owns (the store's shared memory). A pool dropped on
    /// one of its own threads does not wait for itself.
    fn drop(&mut self) {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        let me = std::thread::current().id();
        for h in self.handles.drain(..) {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
    }
}

impl std::fmt::Debug for IoPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IoPool({} x {})", self.name, self.threads)
    }
}

/// The text of a panic payload.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-text panic".into())
}

impl IoPool {
    /// Start `threads` (at least 1) threads named `name-N`. Fails only if the operating system
    /// refuses a thread.
    pub fn new(name: &str, threads: usize) -> std::io::Result<IoPool> {
        let threads = threads.max(1);
        let (tx, rx) = channel::unbounded::<Job>();
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let rx = rx.clone();
            let h = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    // Ends when the pool was dropped and the queue is empty.
                    while let Ok(job) = rx.recv() {
                        // Jobs catch their own panics (see `submit`); this is a second fence
                        // so that a thread is never lost.
                        let _ = catch_unwind(AssertUnwindSafe(job));
                    }
                })?;
            handles.push(h);
        }
        Ok(IoPool {
            tx: Mutex::new(Some(tx)),
            handles,
            threads,
            name: name.to_string(),
        })
    }

    /// Threads in the pool.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Queue `job`; it runs on the first free thread after every job queued before it started.
    /// Its panic, if any, is caught and passed to `on_panic` (on the pool thread).
    pub fn submit(
        &self,
        job: impl FnOnce() + Send + 'static,
        on_panic: impl FnOnce(String) + Send + 'static,
    ) {
        let boxed: Job = Box::new(move || {
            if let Err(p) = catch_unwind(AssertUnwindSafe(job)) {
                on_panic(panic_message(&*p));
            }
        });
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let sent = match tx.as_ref() {
            Some(tx) => tx.send(boxed).map_err(|channel::SendError(job)| job),
            None => Err(boxed),
        };
        if let Err(job) = sent {
            // No thread left to take it (cannot happen while the pool lives: the threads only
            // exit once the sender is dropped). Run it here rather than lose it.
            drop(tx);
            job();
        }
    }

    /// Run `f` over `jobs` on the pool's threads AND the calling thread (started in the order
    /// given) and wait for all of them. Results come back in the order of `jobs`; a job that
    /// panicked gives [`JobError::Panicked`].
    ///
    /// The jobs wait in a queue of this call; up to `threads` helpers are queued on the pool,
    /// and each helper, like the caller, takes jobs from it until it is empty. When the caller
    /// finds the queue empty it takes `f` out of the shared state, so a helper that starts late
    /// finds nothing to run and holds nothing of the caller's; `map` returns once every job's
    /// result is in and no helper still holds a clone of `f`.
    pub fn map<T, R>(
        &self,
        jobs: Vec<T>,
        f: Arc<dyn Fn(T) -> R + Send + Sync>,
    ) -> Vec<Result<R, JobError>>
    where
        T: Send + 'static,
        R: Send + 'static,
    {
        let n = jobs.len();
        let shared = Arc::new(MapShared {
            state: Mutex::new(MapState {
                jobs: jobs.into_iter().enumerate().collect(),
                f: Some(f),
                running: 0,
                results: (0..n).map(|_| None).collect(),
                done: 0,
            }),
            changed: Condvar::new(),
        });
        for _ in 0..n.saturating_sub(1).min(self.threads) {
            let s = shared.clone();
            self.submit(move || s.work(), |_| {});
        }
        shared.work();
        let mut st = shared.lock();
        // No helper may start a job from now on (the queue is empty); late helpers find no `f`.
        st.f = None;
        while st.done < n || st.running > 0 {
            st = shared.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        std::mem::take(&mut st.results)
            .into_iter()
            .map(|r| r.unwrap_or(Err(JobError::Lost)))
            .collect()
    }
}

/// Why a job of [`IoPool::map`] has no result.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    /// The job panicked (a bug); the panic's message.
    #[error("I/O job panicked: {0}")]
    Panicked(String),
    /// The job never reported (a bug of the pool).
    #[error("I/O job lost")]
    Lost,
}

/// One `map` call's jobs, shared by the caller and its helpers.
struct MapShared<T, R> {
    state: Mutex<MapState<T, R>>,
    changed: Condvar,
}

type MapFn<T, R> = Arc<dyn Fn(T) -> R + Send + Sync>;

struct MapState<T, R> {
    /// Jobs not yet started, with their index.
    jobs: VecDeque<(usize, T)>,
    /// The job function while jobs may still start (the caller takes it out at the end).
    f: Option<MapFn<T, R>>,
    /// Jobs running on helpers (each holds a clone of `f` until it is counted out).
    running: usize,
    results: Vec<Option<Result<R, JobError>>>,
    done: usize,
}

impl<T, R> MapShared<T, R> {
    fn lock(&self) -> std::sync::MutexGuard<'_, MapState<T, R>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take and run jobs until none is left. Each job's captures (its `T` and the clone of
    /// `f`) are dropped before its result is published.
    fn work(&self) {
        loop {
            let (i, job, f) = {
                let mut st = self.lock();
                let Some(f) = st.f.clone() else { return };
                let Some((i, job)) = st.jobs.pop_front() else {
                    return;
                };
                st.running += 1;
                (i, job, f)
            };
            let r = catch_unwind(AssertUnwindSafe(|| f(job)))
                .map_err(|p| JobError::Panicked(panic_message(&*p)));
            drop(f);
            let mut st = self.lock();
            st.results[i] = Some(r);
            st.done += 1;
            st.running -= 1;
            drop(st);
            self.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn map_keeps_order_reuses_its_threads_and_survives_panics() {
        let pool = IoPool::new("test-io", 3).unwrap();
        let out = pool.map((0..50u64).collect(), Arc::new(|x| x * x));
        let want: Vec<Result<u64, JobError>> = (0..50u64).map(|x| Ok(x * x)).collect();
        assert_eq!(out, want);
        // Jobs run on the pool's own threads or the caller's, never on new ones.
        let me = std::thread::current().name().unwrap_or("").to_string();
        let names = pool.map(
            (0..30).collect(),
            Arc::new(|_: i32| {
                // Long enough that the helpers wake up and take some of the jobs.
                std::thread::sleep(Duration::from_millis(2));
                std::thread::current().name().unwrap_or("").to_string()
            }),
        );
        let mut names: Vec<String> = names.into_iter().map(Result::unwrap).collect();
        names.sort();
        names.dedup();
        assert!(
            !names.is_empty() && names.len() <= 4,
            "{names:?}: more threads than the pool's 3 and the caller"
        );
        assert!(
            names.iter().all(|n| n.starts_with("test-io-") || *n == me),
            "{names:?}"
        );
        assert!(
            names.iter().any(|n| n.starts_with("test-io-")),
            "{names:?}: the pool's threads took no job"
        );
        // A panicking job is an error for that job only, and the pool keeps all its threads.
        let out = pool.map(
            (0..6u32).collect(),
            Arc::new(|x| {
                if x == 2 {
                    panic!("boom {x}");
                }
                x
            }),
        );
        assert_eq!(out[1], Ok(1));
        assert!(
            matches!(&out[2], Err(JobError::Panicked(m)) if m.contains("boom 2")),
            "{out:?}"
        );
        assert_eq!(out[5], Ok(5));
        // Three jobs that each wait for the other two finish only if all three threads live.
        let b = Arc::new(std::sync::Barrier::new(3));
        let out = pool.map(
            vec![0, 1, 2],
            Arc::new(move |x: u8| {
                b.wait();
                x
            }),
        );
        assert_eq!(out, vec![Ok(0), Ok(1), Ok(2)]);
        assert!(pool.map(Vec::<u8>::new(), Arc::new(|x| x)).is_empty());
    }

    #[test]
    fn map_runs_on_the_caller_when_every_pool_thread_is_busy() {
        let pool = IoPool::new("test-busy", 1).unwrap();
        // The pool's only thread is held until the map below is over.
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        pool.submit(
            move || {
                let _ = release_rx.recv_timeout(Duration::from_secs(10));
            },
            |_| {},
        );
        let t0 = std::time::Instant::now();
        let out = pool.map(vec![1u32, 2, 3], Arc::new(|x| x * 10));
        assert_eq!(out, vec![Ok(10), Ok(20), Ok(30)]);
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "map waited for a busy pool thread"
        );
        release_tx.send(()).unwrap();
        // The helper queued behind the busy job starts late, finds nothing and exits; the pool
        // still works.
        assert_eq!(pool.map(vec![4u32], Arc::new(|x| x + 1)), vec![Ok(5)]);
    }

    #[test]
    fn map_returns_only_after_every_job_dropped_its_captures() {
        let pool = IoPool::new("test-drop", 2).unwrap();
        let held = Arc::new(());
        let h = held.clone();
        pool.map(
            vec![1, 2, 3, 4],
            Arc::new(move |x: u32| {
                std::thread::sleep(Duration::from_millis(5));
                let _keep = &h;
                x
            }),
        );
        assert_eq!(
            Arc::strong_count(&held),
            1,
            "a pool thread still holds a capture"
        );
    }
}
