//! Progress of long steps (store load, standalone pinned load, pack-trunk, doctor) and the
//! log set-up every binary shares.
//!
//! On a terminal a step shows an `indicatif` bar on stderr; otherwise (a detached store's log, a
//! pipe, CI) it logs plain `tracing` lines at every tenth and at the end, so a log file never
//! gets `\r` frames. Sizes are decimal (1 GB = 10^9 bytes, 1 MB = 10^6), as everywhere in k3.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// Log lines with levels and timestamps on stderr, filtered by `RUST_LOG` (default `info`).
/// Safe to call more than once (later calls do nothing).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env(k3_proto::paths::env::RUST_LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .try_init();
}

/// One long step's display: a bar on a terminal, plain log lines otherwise.
#[derive(Debug)]
pub struct Progress {
    bar: Option<ProgressBar>,
    what: String,
    total: u64,
    bytes: bool,
    t0: Instant,
    last_tenth: u64,
}

impl Progress {
    /// A step of `total` units named `what`; `bytes` formats the counts as sizes.
    pub fn new(what: &str, total: u64, bytes: bool) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let tpl = if bytes {
                "{msg:>24} [{bar:32}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} eta {eta}"
            } else {
                "{msg:>24} [{bar:32}] {pos}/{len} eta {eta}"
            };
            let b = ProgressBar::new(total).with_message(what.to_string());
            if let Ok(style) = ProgressStyle::with_template(tpl) {
                b.set_style(style.progress_chars("=> "));
            }
            b.enable_steady_tick(Duration::from_millis(200));
            b
        });
        Progress {
            bar,
            what: what.to_string(),
            total,
            bytes,
            t0: Instant::now(),
            last_tenth: 0,
        }
    }

    /// `done` of the total units are complete.
    pub fn set(&mut self, done: u64) {
        match &self.bar {
            Some(b) => {
                b.set_position(done);
                if done >= self.total && !b.is_finished() {
                    b.finish();
                    // indicatif leaves the cursor at the end of the finished bar: what is
                    // printed next starts on a line of its own.
                    eprintln!();
                }
            }
            None => {
                let tenth = done
                    .saturating_mul(10)
                    .checked_div(self.total)
                    .unwrap_or(10);
                if tenth > self.last_tenth || done >= self.total && self.last_tenth < 10 {
                    self.last_tenth = tenth.max(if done >= self.total { 10 } else { 0 });
                    tracing::info!("{}: {}", self.what, self.line(done));
                }
            }
        }
    }
}

impl Progress {
    /// The plain form of `done`: `12/40` for counts; for bytes
    /// `1.20 GB of 3.40 GB (35%), 250.00 MB/s, eta 9 s`.
    fn line(&self, done: u64) -> String {
        if !self.bytes {
            return format!("{done}/{}", self.total);
        }
        use crate::runtime::plan::fmt_bytes;
        let pct = if self.total > 0 {
            done as f64 * 100.0 / self.total as f64
        } else {
            100.0
        };
        let secs = self.t0.elapsed().as_secs_f64();
        let rate = if secs > 0.0 { done as f64 / secs } else { 0.0 };
        let left = self.total.saturating_sub(done);
        let eta = if left == 0 {
            "done".to_string()
        } else if rate > 0.0 {
            format!("eta {:.0} s", left as f64 / rate)
        } else {
            "eta unknown".to_string()
        };
        format!(
            "{} of {} ({pct:.0}%), {}/s, {eta}",
            fmt_bytes(done),
            fmt_bytes(self.total),
            fmt_bytes(rate as u64)
        )
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(b) = &self.bar {
            if !b.is_finished() {
                b.abandon();
                eprintln!();
            }
        }
    }
}

/// The steps the loaders report in bytes (the others count items): shown as sizes.
/// (`StandaloneSource::open` reports the expert preload as "expert cache", in bytes.)
pub const BYTE_STEPS: &[&str] = &["expert cache"];

/// A `(what, done, total)` callback (the shape the loaders report in) that keeps one
/// [`Progress`] per step name.
#[derive(Debug, Default)]
pub struct Steps {
    current: Option<(String, Progress)>,
}

impl Steps {
    /// Report `done` of `total` for the step `what` (a new name starts a new display).
    pub fn update(&mut self, what: &str, done: usize, total: usize) {
        let same = self.current.as_ref().is_some_and(|(w, _)| w == what);
        if !same {
            let bytes = BYTE_STEPS.contains(&what);
            self.current = Some((what.to_string(), Progress::new(what, total as u64, bytes)));
        }
        if let Some((_, p)) = self.current.as_mut() {
            p.set(done as u64);
        }
    }
}
