//! Admission: at most `max_jobs` workers run at once and at most `queue` more requests wait for
//! a turn; a request beyond that is answered at once (429 with `Retry-After`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Shared admission state.
#[derive(Debug)]
pub struct Admission {
    running: Arc<Semaphore>,
    max_jobs: usize,
    capacity: usize,
    inside: AtomicUsize,
    /// Mean seconds of recent jobs (exponentially weighted), for `Retry-After`.
    mean_job_seconds: Mutex<Option<f64>>,
}

/// A request that was let in: waiting for a turn, then running. Dropping it frees its place.
#[derive(Debug)]
pub struct Place {
    adm: Arc<Admission>,
    permit: Option<OwnedSemaphorePermit>,
    started: Option<Instant>,
}

/// Refused: everything is taken. `retry_after` in whole seconds (≥ 1).
#[derive(Debug, PartialEq, Eq)]
pub struct Full {
    /// Suggested wait.
    pub retry_after: u64,
}

impl Admission {
    /// `max_jobs` ≥ 1 running, `queue` waiting.
    pub fn new(max_jobs: usize, queue: usize) -> Arc<Admission> {
        Arc::new(Admission {
            running: Arc::new(Semaphore::new(max_jobs)),
            max_jobs,
            capacity: max_jobs + queue,
            inside: AtomicUsize::new(0),
            mean_job_seconds: Mutex::new(None),
        })
    }

    /// Take a place (running or waiting), or refuse at once when none is free.
    pub fn enter(self: &Arc<Self>) -> Result<Place, Full> {
        let taken = self
            .inside
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.capacity).then_some(n + 1)
            });
        match taken {
            Ok(_) => Ok(Place {
                adm: self.clone(),
                permit: None,
                started: None,
            }),
            Err(_) => Err(Full {
                retry_after: self.retry_after(),
            }),
        }
    }

    /// Requests running or waiting.
    pub fn inside(&self) -> usize {
        self.inside.load(Ordering::Acquire)
    }

    /// About when a place frees: a mean job's seconds over the jobs running at once.
    fn retry_after(&self) -> u64 {
        let mean = self
            .mean_job_seconds
            .lock()
            .map(|m| m.unwrap_or(1.0))
            .unwrap_or(1.0);
        (mean / self.max_jobs as f64).ceil().clamp(1.0, 600.0) as u64
    }

    fn record(&self, seconds: f64) {
        if let Ok(mut m) = self.mean_job_seconds.lock() {
            *m = Some(match *m {
                None => seconds,
                Some(old) => 0.7 * old + 0.3 * seconds,
            });
        }
    }
}

impl Place {
    /// Wait for a turn to run (at most `max_jobs` places run at once).
    pub async fn run(&mut self) {
        if self.permit.is_some() {
            return;
        }
        // The semaphore is never closed, so acquiring only waits.
        if let Ok(p) = self.adm.running.clone().acquire_owned().await {
            self.permit = Some(p);
            self.started = Some(Instant::now());
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(t) = self.started {
            self.adm.record(t.elapsed().as_secs_f64());
        }
        self.permit.take();
        self.adm.inside.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn places_are_bounded_and_freed_on_drop() {
        let adm = Admission::new(1, 1);
        let mut a = adm.enter().unwrap();
        a.run().await;
        let mut b = adm.enter().unwrap();
        assert_eq!(adm.enter().unwrap_err(), Full { retry_after: 1 });
        // b waits while a runs.
        let waited = tokio::time::timeout(std::time::Duration::from_millis(50), b.run()).await;
        assert!(waited.is_err(), "b ran while a held the only slot");
        drop(a);
        tokio::time::timeout(std::time::Duration::from_secs(5), b.run())
            .await
            .expect("b runs once a is gone");
        let c = adm.enter().unwrap();
        assert_eq!(adm.inside(), 2);
        drop((b, c));
        assert_eq!(adm.inside(), 0);
    }

    #[test]
    fn retry_after_follows_the_mean_job_time() {
        let adm = Admission::new(2, 0);
        adm.record(10.0);
        assert_eq!(adm.retry_after(), 5);
        adm.record(0.01);
        assert_eq!(adm.retry_after(), 4); // 0.7*10 + 0.3*0.01 = 7.003 -> /2 -> 4
        let one = Admission::new(1, 0);
        one.record(0.2);
        assert_eq!(one.retry_after(), 1);
    }
}
