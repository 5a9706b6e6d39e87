//! The ring's reader thread: the one place that writes the arena. It picks the next read
//! ([`super::state::State::next_read`]), claims its extent under the lock, reads it without the
//! lock (a partial claim: the free windows, then the rest once the holds on it are gone), checks
//! it against its checksum when asked to, and publishes it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::runs::{RunError, Runs, VerifyMode};
use super::state::{Claim, Geometry, RingOptions, State};
use crate::runtime::arena::ArenaMem;
use crate::runtime::pool::panic_message;

/// What the ring's lock guards, and what the reader thread and the readers share.
pub(super) struct Shared {
    pub st: Mutex<State>,
    pub cv: Condvar,
    pub geo: Geometry,
    pub runs: Arc<dyn Runs>,
    pub mem: Arc<ArenaMem>,
    pub verify: VerifyMode,
    pub opts: RingOptions,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn wait<'a>(&'a self, g: MutexGuard<'a, State>, d: Duration) -> MutexGuard<'a, State> {
        self.cv
            .wait_timeout(g, d)
            .unwrap_or_else(|p| p.into_inner())
            .0
    }
}

/// How often the reader thread looks again while it waits: protections expire with time.
const POLL: Duration = Duration::from_millis(200);

/// The reader thread. A panic (a bug) fails every hand-out from then on instead of leaving the
/// readers waiting for ever.
pub(super) fn run(sh: &Shared) {
    if let Err(p) = catch_unwind(AssertUnwindSafe(|| serve(sh))) {
        let m = format!("the trunk ring's reader failed: {}", panic_message(&*p));
        tracing::error!("{m}");
        let mut g = sh.lock();
        g.dead = Some(m);
        g.reading = false;
        drop(g);
        sh.cv.notify_all();
    }
}

fn serve(sh: &Shared) {
    let mut g = sh.lock();
    loop {
        if g.shutdown {
            return;
        }
        let now = Instant::now();
        let Some((l, off)) = g.next_read(&sh.geo, now) else {
            if g.any_waiting() {
                // A reader waits and there is no room: leases held past the limit go.
                g.break_stale(now, sh.opts.lease_timeout);
                if g.next_read(&sh.geo, now).is_some() {
                    continue;
                }
            }
            g = sh.wait(g, POLL);
            continue;
        };
        let claim = g.claim(&sh.geo, l, off);
        drop(g);
        let Some(res) = read(sh, &claim) else {
            return;
        };
        g = sh.lock();
        g.publish(&claim, res, sh.runs.run_len(l));
        sh.cv.notify_all();
    }
}

/// Read `c`'s layer into its extent and check it; `None` when the ring stopped meanwhile.
fn read(sh: &Shared, c: &Claim) -> Option<Result<usize, RunError>> {
    let t0 = Instant::now();
    let mut res = if c.busy.is_empty() {
        read_windows(sh, c, &[(0, c.len)])
    } else {
        read_windows(sh, c, &free_windows(c.len, &c.busy))
    };
    // Seconds of reading and checking (not of waiting while parked).
    let mut secs = t0.elapsed().as_secs_f64();
    if !c.busy.is_empty() && res.is_ok() {
        let mut g = sh.lock();
        g.lifetime.partial_reads += 1;
        g.lifetime.early_bytes += c.len - c.busy.iter().map(|b| b.1).sum::<u64>();
        g.park(c, true);
        sh.cv.notify_all();
        // The rest once the overlapped extents are neither held nor on a path (paths end at this
        // read: a reader waiting for it needs nothing behind it, so no deadlock).
        loop {
            if g.shutdown {
                return None;
            }
            let now = Instant::now();
            if !g.claim_blocked(&sh.geo, c, now) {
                break;
            }
            if g.any_waiting() {
                g.break_stale(now, sh.opts.lease_timeout);
            }
            g = sh.wait(g, POLL);
        }
        g.take_rest(c);
        g.park(c, false);
        drop(g);
        let windows: Vec<(u64, u64)> = c.busy.iter().map(|&(s, n)| (s, s + n)).collect();
        let t1 = Instant::now();
        res = read_windows(sh, c, &windows);
        secs += t1.elapsed().as_secs_f64();
    }
    let l = c.layer;
    // The file's stamp after the read: a write that reached any byte of it changed the stamp
    // before the read returned.
    let stamp = sh.runs.stamp(l);
    let check = match sh.verify {
        VerifyMode::Off => false,
        VerifyMode::First => match sh.lock().verified.get(l) {
            Some(Some(seen)) => *seen != stamp,
            _ => true,
        },
        VerifyMode::Every => true,
    };
    let mut verify_secs = 0.0;
    if let (true, Ok(inner)) = (check, &res) {
        // Checked without the lock (the extent is the reader thread's while Filling), so no
        // reader is held up by the hash.
        let t1 = Instant::now();
        res = verify(sh, c, *inner);
        verify_secs = t1.elapsed().as_secs_f64();
    }
    let mut g = sh.lock();
    g.lifetime.verify_seconds += verify_secs;
    g.lifetime.read_seconds += secs + verify_secs;
    if check && res.is_ok() {
        if let Some(v) = g.verified.get_mut(l) {
            *v = Some(stamp);
        }
    }
    Some(res)
}

/// `[0, len)` minus `busy` (sorted, disjoint sub-ranges `(start, len)`), as `(start, end)`.
fn free_windows(len: u64, busy: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = 0;
    for &(s, l) in busy {
        if s > at {
            out.push((at, s));
        }
        at = at.max(s + l);
    }
    if at < len {
        out.push((at, len));
    }
    out
}

/// Read the windows `(start, end)` (relative to `c`'s extent) of its layer; where the run starts
/// in the extent. The whole extent `[(0, len)]` is one read of the layer.
fn read_windows(sh: &Shared, c: &Claim, windows: &[(u64, u64)]) -> Result<usize, RunError> {
    let mut inner = 0;
    for &(a, b) in windows {
        let mut dst = (sh.mem)
            .write((c.off + a) as usize, (b - a) as usize)
            .map_err(|source| RunError::Extent {
                layer: c.layer,
                source,
            })?;
        inner = if (a, b) == (0, c.len) {
            sh.runs.read(c.layer, &mut dst)?
        } else {
            sh.runs.read_window(c.layer, &mut dst, a as usize)?
        };
    }
    Ok(inner)
}

/// Check `c`'s run, read into its extent with the run at `inner`, against its checksum;
/// `Ok(inner)` when it matches.
fn verify(sh: &Shared, c: &Claim, inner: usize) -> Result<usize, RunError> {
    let run_len = sh.runs.run_len(c.layer);
    match (inner as u64).checked_add(run_len) {
        Some(end) if end <= c.len => {
            let run = (sh.mem)
                .read(c.off as usize + inner, run_len as usize)
                .map_err(|source| RunError::Extent {
                    layer: c.layer,
                    source,
                })?;
            Ok(sh.runs.verify(c.layer, &run).map(|()| inner)?)
        }
        _ => Err(RunError::OutsideExtent { layer: c.layer }),
    }
}

#[cfg(test)]
mod tests {
    use super::free_windows;

    #[test]
    fn free_windows_are_the_extent_minus_its_busy_parts() {
        assert_eq!(free_windows(10, &[]), vec![(0, 10)]);
        assert_eq!(free_windows(10, &[(0, 4)]), vec![(4, 10)]);
        assert_eq!(free_windows(10, &[(6, 4)]), vec![(0, 6)]);
        assert_eq!(
            free_windows(10, &[(2, 2), (6, 1)]),
            vec![(0, 2), (4, 6), (7, 10)]
        );
        assert!(free_windows(10, &[(0, 10)]).is_empty());
    }
}
