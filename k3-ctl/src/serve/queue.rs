//! Admission: at most `max_jobs` sequences run at once (a request of `n` choices is `n` of them:
//! the worker's slots) and at most `queue` more requests wait for a turn;
//! a request beyond that is answered at once (429 with `Retry-After`). First come, first served:
//! every request gets a ticket when it is let in, and a waiting request runs only when a slot
//! is free and no request let in before it still waits — whenever its handler gets round to
//! asking (a streamed request checks the store before it asks, a whole one does not), so the
//! order is the order of arrival, not of the handlers' progress. Every request inside is listed
//! (for `k3-ctl ps` and a streamed request's queue comments): queued with its position, or
//! running with its worker.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use k3_proto::serve::{RequestInfo, RequestState};
use tokio::sync::Notify;

/// Shared admission state.
#[derive(Debug)]
pub struct Admission {
    /// Told whenever a place starts running or leaves (a waiting one may be next).
    changed: Notify,
    max_jobs: usize,
    capacity: usize,
    inside: AtomicUsize,
    /// Mean seconds of recent jobs (exponentially weighted), for `Retry-After`.
    mean_job_seconds: Mutex<Option<f64>>,
    /// The requests inside, by arrival (their tickets; they run in that order).
    table: Mutex<(u64, BTreeMap<u64, Entry>)>,
}

/// What a request is, for the listing.
#[derive(Clone, Debug, Default)]
pub struct Meta {
    /// The request id.
    pub request_id: String,
    /// The route.
    pub route: String,
    /// Prompt ids.
    pub prompt_ids: usize,
    /// Most ids to generate.
    pub max_new: usize,
    /// Its choices (`n`): the worker slots it takes while it runs (0 counts as 1).
    pub choices: usize,
}

#[derive(Debug)]
struct Entry {
    meta: Meta,
    arrived: Instant,
    running: bool,
    worker_pid: u32,
    generated: u32,
}

/// A request that was let in: waiting for a turn, then running. Dropping it frees its place.
#[derive(Debug)]
pub struct Place {
    adm: Arc<Admission>,
    ticket: u64,
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
            changed: Notify::new(),
            max_jobs,
            capacity: max_jobs + queue,
            inside: AtomicUsize::new(0),
            mean_job_seconds: Mutex::new(None),
            table: Mutex::new((0, BTreeMap::new())),
        })
    }

    /// Take a place (running or waiting), or refuse at once when none is free.
    pub fn enter(self: &Arc<Self>, meta: Meta) -> Result<Place, Full> {
        let taken = self
            .inside
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.capacity).then_some(n + 1)
            });
        if taken.is_err() {
            return Err(Full {
                retry_after: self.retry_after(),
            });
        }
        let ticket = match self.table.lock() {
            Ok(mut t) => {
                t.0 += 1;
                let ticket = t.0;
                t.1.insert(
                    ticket,
                    Entry {
                        meta,
                        arrived: Instant::now(),
                        running: false,
                        worker_pid: 0,
                        generated: 0,
                    },
                );
                ticket
            }
            Err(_) => 0,
        };
        Ok(Place {
            adm: self.clone(),
            ticket,
            started: None,
        })
    }

    /// Requests running or waiting.
    #[cfg(test)]
    pub fn inside(&self) -> usize {
        self.inside.load(Ordering::Acquire)
    }

    /// (running, queued).
    pub fn counts(&self) -> (usize, usize) {
        self.table.lock().map_or((0, 0), |t| {
            let running = t.1.values().filter(|e| e.running).count();
            (running, t.1.len() - running)
        })
    }

    /// The place in the queue of `ticket` (1 = next), `None` once it runs.
    pub fn position(&self, ticket: u64) -> Option<usize> {
        let t = self.table.lock().ok()?;
        let e = t.1.get(&ticket)?;
        if e.running {
            return None;
        }
        Some(t.1.range(..ticket).filter(|(_, e)| !e.running).count() + 1)
    }

    /// Every request inside: running first, then queued in order.
    pub fn listing(&self) -> Vec<RequestInfo> {
        let Ok(t) = self.table.lock() else {
            return Vec::new();
        };
        let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        let mut position = 0;
        let mut queued = Vec::new();
        let mut out = Vec::new();
        for e in t.1.values() {
            let state = if e.running {
                RequestState::Running {
                    worker_pid: e.worker_pid,
                }
            } else {
                position += 1;
                RequestState::Queued { position }
            };
            let info = RequestInfo {
                request_id: e.meta.request_id.clone(),
                route: e.meta.route.clone(),
                state,
                prompt_ids: n(e.meta.prompt_ids),
                max_new: n(e.meta.max_new),
                generated: e.generated,
                age_seconds: e.arrived.elapsed().as_secs_f64(),
            };
            if e.running {
                out.push(info);
            } else {
                queued.push(info);
            }
        }
        out.extend(queued);
        out
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

    fn update(&self, ticket: u64, f: impl FnOnce(&mut Entry)) {
        if let Ok(mut t) = self.table.lock() {
            if let Some(e) = t.1.get_mut(&ticket) {
                f(e);
            }
        }
    }
}

impl Place {
    /// Wait for a turn to run (at most `max_jobs` places run at once, in arrival order).
    pub async fn run(&mut self) {
        let adm = self.adm.clone();
        loop {
            let changed = adm.changed.notified();
            tokio::pin!(changed);
            // Registered before the look, so a change between the two is not missed.
            changed.as_mut().enable();
            if self.try_run() {
                return;
            }
            changed.await;
        }
    }

    /// Take a turn now if a slot is free and no request let in earlier waits; false when this
    /// one must wait.
    pub fn try_run(&mut self) -> bool {
        if self.started.is_some() {
            return true;
        }
        let Ok(mut t) = self.adm.table.lock() else {
            return false;
        };
        let slots = |e: &Entry| e.meta.choices.max(1);
        let running: usize = t.1.values().filter(|e| e.running).map(slots).sum();
        let first_waiting = t.1.iter().find(|(_, e)| !e.running).map(|(k, _)| *k);
        let mine = t.1.get(&self.ticket).map_or(1, slots);
        // A request of more choices than the slots (refused before it is let in) runs alone.
        if (running > 0 && running + mine > self.adm.max_jobs) || first_waiting != Some(self.ticket)
        {
            return false;
        }
        if let Some(e) = t.1.get_mut(&self.ticket) {
            e.running = true;
        }
        drop(t);
        self.started = Some(Instant::now());
        // The next in line may run too (another slot may be free).
        self.adm.changed.notify_waiters();
        true
    }

    /// The place in the queue (1 = next), `None` once running.
    #[cfg(test)]
    pub fn position(&self) -> Option<usize> {
        self.adm.position(self.ticket)
    }

    /// Its ticket (for [`Admission::position`]).
    pub fn ticket(&self) -> u64 {
        self.ticket
    }

    /// The admission this place belongs to.
    pub fn admission(&self) -> &Arc<Admission> {
        &self.adm
    }

    /// The worker that runs the request.
    pub fn set_worker(&self, pid: u32) {
        self.adm.update(self.ticket, |e| e.worker_pid = pid);
    }

    /// Ids generated so far.
    pub fn set_generated(&self, n: usize) {
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        self.adm.update(self.ticket, |e| e.generated = n);
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(t) = self.started {
            self.adm.record(t.elapsed().as_secs_f64());
        }
        if let Ok(mut t) = self.adm.table.lock() {
            t.1.remove(&self.ticket);
        }
        self.adm.inside.fetch_sub(1, Ordering::AcqRel);
        self.adm.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(id: &str) -> Meta {
        Meta {
            request_id: id.into(),
            route: "/v1/completions".into(),
            prompt_ids: 3,
            max_new: 5,
            choices: 1,
        }
    }

    #[tokio::test]
    async fn places_are_bounded_listed_and_freed_on_drop() {
        let adm = Admission::new(1, 2);
        let mut a = adm.enter(meta("a")).unwrap();
        a.run().await;
        a.set_worker(42);
        let mut b = adm.enter(meta("b")).unwrap();
        let c = adm.enter(meta("c")).unwrap();
        assert_eq!(adm.enter(meta("d")).unwrap_err(), Full { retry_after: 1 });
        assert_eq!(
            (a.position(), b.position(), c.position()),
            (None, Some(1), Some(2))
        );
        let l = adm.listing();
        let ids: Vec<&str> = l.iter().map(|r| r.request_id.as_str()).collect();
        assert_eq!(ids, ["a", "b", "c"]);
        assert_eq!(l[0].state, RequestState::Running { worker_pid: 42 });
        assert_eq!(l[2].state, RequestState::Queued { position: 2 });
        assert_eq!(adm.counts(), (1, 2));
        // b waits while a runs.
        let waited = tokio::time::timeout(std::time::Duration::from_millis(50), b.run()).await;
        assert!(waited.is_err(), "b ran while a held the only slot");
        drop(a);
        tokio::time::timeout(std::time::Duration::from_secs(5), b.run())
            .await
            .expect("b runs once a is gone");
        assert_eq!(c.position(), Some(1));
        assert_eq!(adm.inside(), 2);
        drop((b, c));
        assert_eq!(adm.inside(), 0);
        assert!(adm.listing().is_empty());
    }

    #[tokio::test]
    async fn places_run_in_arrival_order_whenever_their_handlers_ask() {
        use std::time::Duration;
        let adm = Admission::new(1, 4);
        let mut a = adm.enter(meta("a")).unwrap();
        let mut b = adm.enter(meta("b")).unwrap();
        let mut c = adm.enter(meta("c")).unwrap();
        // c asks first, while a (let in first) has not asked yet: c may not overtake a or b.
        assert!(!c.try_run());
        assert!(!b.try_run());
        assert!(a.try_run(), "the first one in runs at once on a free slot");
        let order = Arc::new(Mutex::new(Vec::new()));
        let wait = |mut p: Place, name: &'static str| {
            let order = order.clone();
            tokio::spawn(async move {
                p.run().await;
                order.lock().unwrap().push(name);
                tokio::time::sleep(Duration::from_millis(20)).await;
                drop(p);
            })
        };
        // c starts waiting before b.
        let tc = wait(c, "c");
        tokio::time::sleep(Duration::from_millis(20)).await;
        let tb = wait(b, "b");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            order.lock().unwrap().is_empty(),
            "nothing runs while a does"
        );
        drop(a);
        tokio::time::timeout(Duration::from_secs(5), async {
            tb.await.unwrap();
            tc.await.unwrap();
        })
        .await
        .expect("both ran");
        assert_eq!(*order.lock().unwrap(), ["b", "c"]);
        // Two slots: the first two in run at once, the third waits.
        let two = Admission::new(2, 4);
        let (mut x, mut y, mut z) = (
            two.enter(meta("x")).unwrap(),
            two.enter(meta("y")).unwrap(),
            two.enter(meta("z")).unwrap(),
        );
        assert!(x.try_run() && y.try_run() && !z.try_run());
        drop(y);
        assert!(z.try_run());
        // A request of 2 choices takes both slots: it waits for them, and what comes after it
        // waits behind it.
        let (mut p, mut q, mut r) = (
            two.enter(meta("p")).unwrap(),
            two.enter(Meta {
                choices: 2,
                ..meta("q")
            })
            .unwrap(),
            two.enter(meta("r")).unwrap(),
        );
        drop((x, z));
        assert!(p.try_run() && !q.try_run() && !r.try_run());
        drop(p);
        assert!(q.try_run() && !r.try_run());
        drop(q);
        assert!(r.try_run());
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
