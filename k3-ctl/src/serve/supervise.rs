//! How serve keeps its one worker honest: restarts that back off, and a deadline on step
//! progress.
//!
//! - **Backoff.** A worker that could not start, or ended before it finished any job, is a failed
//!   start. After `n` failed starts in a row the next start waits `min(1 s · 2^(n−1), 30 s)`;
//!   a request that arrives meanwhile gets 503 with `Retry-After` (the wait left), instead of
//!   a new process that dies at once. A finished job resets the count.
//! - **Stall deadline.** While the worker holds jobs, every message it sends (a prefill, an id,
//!   an end) is progress. A worker that sends nothing for [`stall_deadline`] (or
//!   `--stall-timeout`) is failed: its jobs end with a clear error, it is killed (SIGKILL, which
//!   also ends a stopped process) and a new one is started. `/health` is 503 from half that
//!   silence on, and until the replacement has said `Hello`.

use std::time::{Duration, Instant};

use k3_worker::engine::memory::EnginePlan;
use k3_worker::model::Dims;

/// The first wait after a failed start.
const BACKOFF_BASE: Duration = Duration::from_secs(1);
/// The longest wait between starts.
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// The stall deadline's fixed part: the slowest step of a small model on a busy machine, and a
/// worker's start (attaching, mapping the trunk) before its first message.
const STALL_FLOOR: Duration = Duration::from_secs(60);
/// The read rate the stall deadline assumes for the expert bytes of one step (an NVMe drive
/// shared with other readers: well below a drive's sequential rate).
const STALL_READ_BYTES_PER_SECOND: f64 = 1e9;
/// The deadline's margin over that estimate.
const STALL_MARGIN: f64 = 4.0;

/// The longest a step of a worker running `plan` may go without a message:
/// `60 s + 4 × B / (1 GB/s)`, where `B` is what the plan's largest step can read from disk —
/// every MoE layer's routed experts for its rows, `B = moe_layers × min(n_experts, rows ×
/// top_k) × 3 × hidden × moe_inter × 2 bytes` (bf16, the largest stored form), `rows` the
/// plan's prefill chunk or its decode rows (`slots × (1 + drafts)`), whichever is larger. A
/// step that reads what it may at a quarter of 1 GB/s still ends in time; a stopped or wedged
/// worker is found within minutes at the small scales and within the step's own worst case
/// at full scale.
pub fn stall_deadline(dims: &Dims, plan: &EnginePlan) -> Duration {
    let rows = plan.prefill_rows.max(plan.slots * (1 + plan.drafts));
    let experts = dims.n_experts.min(rows.saturating_mul(dims.top_k));
    let expert_bytes = 3.0 * dims.hidden as f64 * dims.moe_inter as f64 * 2.0;
    let layers = dims.n_layers.saturating_sub(dims.first_k_dense);
    let bytes = layers as f64 * experts as f64 * expert_bytes;
    STALL_FLOOR + Duration::from_secs_f64(STALL_MARGIN * bytes / STALL_READ_BYTES_PER_SECOND)
}

/// Failed starts in a row and when the next start may happen.
#[derive(Debug, Default)]
pub struct Backoff {
    failures: u32,
    until: Option<Instant>,
}

impl Backoff {
    /// The wait left before the next start may happen (`None`: start now).
    pub fn wait(&self, now: Instant) -> Option<Duration> {
        self.until
            .filter(|u| *u > now)
            .map(|u| u.duration_since(now))
    }

    /// A start failed (or the worker ended before finishing a job): the next waits longer.
    /// Returns the wait.
    pub fn failed(&mut self, now: Instant) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let wait = BACKOFF_BASE
            .saturating_mul(1u32 << (self.failures - 1).min(16))
            .min(BACKOFF_MAX);
        self.until = Some(now + wait);
        wait
    }

    /// A job finished: the worker works.
    pub fn served(&mut self) {
        *self = Backoff::default();
    }

    /// Failed starts in a row.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_and_resets_when_a_job_ends() {
        let t = Instant::now();
        let mut b = Backoff::default();
        assert_eq!(b.wait(t), None);
        let waits: Vec<u64> = (0..8).map(|_| b.failed(t).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(b.wait(t), Some(Duration::from_secs(30)));
        assert_eq!(b.wait(t + Duration::from_secs(31)), None);
        b.served();
        assert_eq!((b.failures(), b.wait(t)), (0, None));
        assert_eq!(b.failed(t), Duration::from_secs(1));
    }

    #[test]
    fn the_stall_deadline_grows_with_what_a_step_may_read() {
        let cfg = |experts: usize, hidden: usize| {
            let mut d = tiny_dims();
            d.n_experts = experts;
            d.hidden = hidden;
            d
        };
        let plan = EnginePlan::one(64, 512, 0);
        let small = stall_deadline(&cfg(8, 64), &plan);
        assert!(small >= STALL_FLOOR && small < STALL_FLOOR + Duration::from_secs(1));
        // K3's shape: 384 experts, 60 MoE layers, 7168 × 2048: a 512-row chunk may read every
        // expert, 2 TB, which at 1 GB/s is over half an hour.
        let mut k3 = cfg(384, 7168);
        (k3.n_layers, k3.first_k_dense, k3.moe_inter, k3.top_k) = (61, 1, 2048, 8);
        let big = stall_deadline(&k3, &plan);
        assert!(big > Duration::from_secs(4 * 1800), "{big:?}");
        // One decode row reads far less than a prefill chunk.
        let decode = stall_deadline(&k3, &EnginePlan::one(64, 1, 0));
        assert!(decode < big / 10, "{decode:?} vs {big:?}");
    }

    fn tiny_dims() -> Dims {
        let cfg = k3_proto::config::ModelConfig::load(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fixtures/tiny/model/config.json"
        )))
        .expect("the tiny fixture's config");
        Dims::from_config(&cfg).expect("dims")
    }
}
