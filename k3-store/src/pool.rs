//! Long-lived I/O threads: no thread is spawned per layer or per expert batch.
//!
//! An [`IoPool`] owns a fixed set of threads started once (with the cache or the source that
//! owns it) which take boxed jobs from one FIFO queue, in the order they were submitted (callers
//! submit reads in disk-offset order). A job that panics is caught on its thread: the thread
//! survives and the submitter gets the panic's message as an error instead of a result.
//!
//! Jobs are `'static`: they own what they touch (an `Arc` of the slot memory and reader, a copy
//! of the ids). [`IoPool::map`] drops each job's captures BEFORE it reports the job's result, so
//! once `map` returns no pool thread holds anything the caller gave it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A fixed set of long-lived threads running submitted jobs in FIFO order.
pub struct IoPool {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
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
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let rx = rx.clone();
            let h = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || loop {
                    // One thread waits in `recv` holding the lock; the others wait for the lock.
                    // The lock is released before the job runs.
                    let job = match rx.lock() {
                        Ok(g) => g.recv(),
                        Err(p) => p.into_inner().recv(),
                    };
                    match job {
                        // Jobs catch their own panics (see `submit`); this is a second fence
                        // so that a thread is never lost.
                        Ok(job) => {
                            let _ = catch_unwind(AssertUnwindSafe(job));
                        }
                        // The pool was dropped and the queue is empty.
                        Err(_) => break,
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
            Some(tx) => tx.send(boxed).map_err(|mpsc::SendError(job)| job),
            None => Err(boxed),
        };
        if let Err(job) = sent {
            // No thread left to take it (cannot happen while the pool lives: the threads only
            // exit once the sender is dropped). Run it here rather than lose it.
            drop(tx);
            job();
        }
    }

    /// Run `f` over `jobs` on the pool (started in the order given) and wait for all of them.
    /// Results come back in the order of `jobs`; a job that panicked gives `Err(message)`.
    pub fn map<T, R>(
        &self,
        jobs: Vec<T>,
        f: Arc<dyn Fn(T) -> R + Send + Sync>,
    ) -> Vec<Result<R, String>>
    where
        T: Send + 'static,
        R: Send + 'static,
    {
        let n = jobs.len();
        let (rtx, rrx) = mpsc::channel::<(usize, Result<R, String>)>();
        for (i, t) in jobs.into_iter().enumerate() {
            let (f, ok_tx, err_tx) = (f.clone(), rtx.clone(), rtx.clone());
            self.submit(
                move || {
                    let r = f(t);
                    // Drop the captures before reporting: once the caller has every result, no
                    // pool thread holds anything it was given.
                    drop(f);
                    let _ = ok_tx.send((i, Ok(r)));
                },
                move |m| {
                    let _ = err_tx.send((i, Err(format!("I/O thread panicked: {m}"))));
                },
            );
        }
        drop(rtx);
        let mut out: Vec<Option<Result<R, String>>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            match rrx.recv() {
                Ok((i, r)) => out[i] = Some(r),
                Err(_) => break,
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err("I/O job lost (its thread exited)".into())))
            .collect()
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
        let want: Vec<Result<u64, String>> = (0..50u64).map(|x| Ok(x * x)).collect();
        assert_eq!(out, want);
        // Jobs run on the pool's own threads, never on new ones.
        let names = pool.map(
            (0..30).collect(),
            Arc::new(|_: i32| std::thread::current().name().unwrap_or("").to_string()),
        );
        let mut names: Vec<String> = names.into_iter().map(Result::unwrap).collect();
        names.sort();
        names.dedup();
        assert!(
            !names.is_empty() && names.len() <= 3,
            "{names:?}: more threads than the pool's 3"
        );
        assert!(names.iter().all(|n| n.starts_with("test-io-")), "{names:?}");
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
        assert!(matches!(&out[2], Err(m) if m.contains("boom 2")), "{out:?}");
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
