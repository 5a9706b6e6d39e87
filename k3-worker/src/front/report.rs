//! The run report: the per-step table, the summary on stderr, the `--out` JSON, and the dump
//! files (`--dump-logits`, `--dump-cache-trace`, `--dump-hidden`). The table and the summary
//! are a report the user asked for and are printed as such (`eprintln!`); failures are logged
//! (`tracing`).

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use k3_store::runtime::plan::fmt_bytes;
use k3_store::runtime::source::SourceStats;

use super::error::JobError;
use crate::engine::outputs::{GenReport, StepReport};
use crate::model::{Model, RunCounters, TraceRecord};

/// Bytes as decimal GB.
pub fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

/// Peak resident set size of this process, in bytes.
pub fn peak_rss_bytes() -> u64 {
    use nix::sys::resource::{getrusage, UsageWho};
    // Kilobytes on Linux.
    getrusage(UsageWho::RUSAGE_SELF).map_or(0, |u| u.max_rss().max(0) as u64 * 1024)
}

/// The step table's header.
pub const STEP_HEADER: &str =
    " STEP    TOKEN   SECONDS    READ GB   IO WAIT       HIT    TOK/S  PASS  ACC/DRAFT";

/// One row of the step table.
pub fn step_line(s: &StepReport) -> String {
    let hit = s
        .resident_hit_rate
        .map_or("-".to_string(), |h| format!("{:.1}%", 100.0 * h));
    // A verify pass shows accepted/drafted on its first id; its other ids share its pass number.
    let spec = if s.drafted > 0 {
        format!("{}/{}", s.accepted, s.drafted)
    } else {
        String::new()
    };
    format!(
        "{:>5} {:>8} {:>9.3} {:>10.3} {:>9.3} {:>9} {:>8.3} {:>5} {:>10}",
        s.step,
        s.token,
        s.seconds,
        gb(s.bytes_read),
        s.io_wait_seconds,
        hit,
        1.0 / s.seconds.max(1e-9),
        s.pass,
        spec
    )
}

/// Log the expert-load failures and return the exit code they imply (4, or 0).
pub fn expert_failures(c: &RunCounters) -> i32 {
    for m in &c.failure_messages {
        tracing::error!("expert load failed: {m}");
    }
    if c.failed_expert_loads > 0 {
        tracing::error!(
            "{} routed expert load(s) failed: the generated ids are unsound",
            c.failed_expert_loads
        );
        return k3_proto::exit::EXPERT_LOAD_FAILED;
    }
    k3_proto::exit::OK
}

/// The share of the time spent reading weights that the engine did not wait for (reads that
/// overlapped compute): `1 − wait ÷ read`, clamped to [0, 1]; `None` when nothing was read.
pub fn io_hidden_fraction(st: &SourceStats) -> Option<f64> {
    let read = st.trunk_read_seconds + st.expert_read_seconds;
    (read > 0.0).then(|| (1.0 - st.io_wait_seconds / read).clamp(0.0, 1.0))
}

/// Requested experts the router lookahead had predicted ÷ requested experts of the layers it
/// predicted (`None` before any prediction was checked).
pub fn lookahead_recall(c: &RunCounters) -> Option<f64> {
    (c.lookahead_actual > 0).then(|| c.lookahead_correct as f64 / c.lookahead_actual as f64)
}

/// The same for the prediction each forward call makes of the next call's first MoE layer.
pub fn next_pass_recall(c: &RunCounters) -> Option<f64> {
    (c.next_pass_actual > 0).then(|| c.next_pass_correct as f64 / c.next_pass_actual as f64)
}

/// Bytes read by prefetches whose expert no request used (so far).
pub fn wasted_prefetch_bytes(st: &SourceStats) -> u64 {
    let per = st
        .prefetch_bytes
        .checked_div(st.prefetch_loads)
        .unwrap_or(0);
    st.prefetch_loads.saturating_sub(st.prefetch_used) * per
}

/// `time_breakdown` of `--out`: mean seconds per decoded token (steps ≥ 1) by phase of the
/// forward pass, and `other` (the rest of the step: embedding, sampling, bookkeeping); `null`
/// without decode steps.
pub fn time_breakdown_json(r: &GenReport) -> serde_json::Value {
    match r.time_per_token() {
        None => serde_json::Value::Null,
        Some((p, other)) => serde_json::json!({
            "layer_wait_s": p.layer_wait,
            "attention_s": p.attention,
            "mlp_s": p.mlp,
            "expert_wait_s": p.expert_wait,
            "lm_head_s": p.lm_head,
            "other_s": other,
        }),
    }
}

/// Totals of a finished one-shot run.
#[derive(Debug)]
pub struct RunSummary {
    /// The source's counters, with `io_wait_seconds` = the engine's own blocked time.
    pub stats: SourceStats,
    /// The engine's counters.
    pub counters: RunCounters,
    /// Resident hits ÷ expert requests.
    pub true_hit: f64,
    /// Peak RSS, bytes.
    pub peak: u64,
    /// Wall seconds of the whole job.
    pub wall: f64,
    /// The trunk the layers came from (lossy or exact).
    pub trunk: k3_proto::wire::TrunkInfo,
}

impl RunSummary {
    /// Gather the totals at the end of a run.
    pub fn collect(model: &Model<'_>, wall: f64) -> RunSummary {
        let mut stats = model.source().stats();
        let counters = model.counters.clone();
        // The engine fetches experts beside its own compute: the time it was really blocked is
        // the trunk wait plus what it measured waiting for experts.
        stats.io_wait_seconds = stats.trunk_wait_seconds + counters.expert_wait_seconds;
        let true_hit = if stats.expert_requests > 0 {
            stats.resident_hits as f64 / stats.expert_requests as f64
        } else {
            0.0
        };
        RunSummary {
            stats,
            counters,
            true_hit,
            peak: peak_rss_bytes(),
            wall,
            trunk: model.source().trunk(),
        }
    }

    /// The summary lines on stderr (ends with the expert failures, if any).
    pub fn print_totals(&self, gen: &GenReport) {
        let st = &self.stats;
        if self.trunk.is_lossy() {
            eprintln!("{}", self.trunk.lossy);
        }
        eprintln!(
            "{} tokens in {:.3} s; prefill (step 0) {:.3} s; {}",
            gen.generated_ids.len(),
            gen.steps.iter().map(|s| s.seconds).sum::<f64>(),
            gen.prefill_seconds(),
            gen.seconds_per_token()
                .map_or("no decode steps".into(), |s| format!(
                    "{s:.3} s/token over steps >= 1"
                ))
        );
        eprintln!(
            "experts: requests {} resident hits {} misses {} evictions {} failed {}",
            st.expert_requests,
            st.resident_hits,
            st.misses,
            st.evictions,
            self.counters.failed_expert_loads
        );
        if st.private_expert_reads > 0 {
            eprintln!(
                "experts read privately: {} (the store's slots were held by a stuck worker)",
                st.private_expert_reads
            );
        }
        if let Some((p, other)) = gen.time_per_token() {
            let ms = |v: f64| v * 1e3;
            eprintln!(
                "per decoded token: attention {:.2} ms, mlp {:.2} ms, lm_head {:.2} ms, \
                 expert wait {:.2} ms, layer wait {:.2} ms, other {:.2} ms",
                ms(p.attention),
                ms(p.mlp),
                ms(p.lm_head),
                ms(p.expert_wait),
                ms(p.layer_wait),
                ms(other)
            );
        }
        eprintln!("TRUE resident hit rate: {:.1}%", 100.0 * self.true_hit);
        if gen.spec.drafted_tokens > 0 {
            eprintln!(
                "speculation: {} decode passes for {} ids; {} of {} drafted ids accepted ({:.1}%)",
                gen.spec.forward_passes,
                gen.generated_ids.len().saturating_sub(1),
                gen.spec.accepted_tokens,
                gen.spec.drafted_tokens,
                100.0 * gen.spec.accepted_tokens as f64 / gen.spec.drafted_tokens as f64
            );
        }
        eprintln!(
            "bytes read: {} (trunk {}, experts {}); I/O share of wall clock: {:.1}%",
            fmt_bytes(st.trunk_bytes_read + st.expert_bytes_read),
            fmt_bytes(st.trunk_bytes_read),
            fmt_bytes(st.expert_bytes_read),
            100.0 * st.io_wait_seconds / self.wall.max(1e-9)
        );
        if st.preloaded_experts > 0 {
            eprintln!(
                "preloaded before the first token: {} experts, {} in {:.2} s (not in the \
                 bytes read above)",
                st.preloaded_experts,
                fmt_bytes(st.preload_bytes),
                st.preload_seconds
            );
        }
        let c = &self.counters;
        if c.lookahead_layers > 0 || st.prefetch_loads > 0 {
            eprintln!(
                "lookahead: recall {} ({} of {} requested experts predicted over {} layers); \
                 prefetched {} ({} experts), used {}, wasted {}, dropped unread {}",
                lookahead_recall(c).map_or("-".into(), |r| format!("{:.1}%", 100.0 * r)),
                c.lookahead_correct,
                c.lookahead_actual,
                c.lookahead_layers,
                fmt_bytes(st.prefetch_bytes),
                st.prefetch_loads,
                st.prefetch_used,
                fmt_bytes(wasted_prefetch_bytes(st)),
                st.prefetch_dropped
            );
        }
        if c.next_pass_layers > 0 {
            eprintln!(
                "lookahead across passes: recall {} ({} of {} requested experts of the first MoE \
                 layer predicted over {} passes, read during the previous lm_head)",
                next_pass_recall(c).map_or("-".into(), |r| format!("{:.1}%", 100.0 * r)),
                c.next_pass_correct,
                c.next_pass_actual,
                c.next_pass_layers
            );
        }
        if let Some(h) = io_hidden_fraction(st) {
            eprintln!(
                "I/O hidden behind compute: {:.1}% ({:.3} s reading, {:.3} s waited for)",
                100.0 * h,
                st.trunk_read_seconds + st.expert_read_seconds,
                st.io_wait_seconds
            );
        }
        eprintln!(
            "PEAK RSS for the whole run: {}   <- quote this, not the plan",
            fmt_bytes(self.peak)
        );
    }

    /// The router lookahead's figures for `--out`: the mode, its recall, and the prefetch bytes
    /// (predicted = experts predicted × bytes per expert; used/wasted as the source counted).
    pub fn lookahead_json(&self) -> serde_json::Value {
        let (c, st) = (&self.counters, &self.stats);
        let per = st
            .prefetch_bytes
            .checked_div(st.prefetch_loads)
            .unwrap_or(0);
        serde_json::json!({
            "layers": c.lookahead_layers,
            "predicted_experts": c.lookahead_predicted,
            "requested_experts": c.lookahead_actual,
            "correct_experts": c.lookahead_correct,
            "recall": lookahead_recall(c),
            "prefetched_experts": st.prefetch_loads,
            "prefetched_bytes": st.prefetch_bytes,
            "used_experts": st.prefetch_used,
            "used_bytes": st.prefetch_used * per,
            "wasted_bytes": wasted_prefetch_bytes(st),
            "dropped_experts": st.prefetch_dropped,
            "next_pass": {
                "layers": c.next_pass_layers,
                "predicted_experts": c.next_pass_predicted,
                "requested_experts": c.next_pass_actual,
                "correct_experts": c.next_pass_correct,
                "recall": next_pass_recall(c),
            },
        })
    }

    /// The exit code the run ends with (4 when an expert failed to load), after printing the
    /// failures.
    pub fn exit_code(&self) -> i32 {
        expert_failures(&self.counters)
    }

    /// The `--out` report.
    pub fn json(&self, r: &GenReport) -> serde_json::Value {
        let st = &self.stats;
        serde_json::json!({
            "prompt_ids": r.prompt_ids,
            "generated_ids": r.generated_ids,
            "stopped_on": r.stopped_on,
            "steps": r.steps,
            "prefill_seconds": r.prefill_seconds(),
            "seconds_per_token": r.seconds_per_token(),
            "wall_seconds": self.wall,
            "bytes_read": st.trunk_bytes_read + st.expert_bytes_read,
            "trunk_bytes_read": st.trunk_bytes_read,
            "expert_bytes_read": st.expert_bytes_read,
            "trunk_layers_served": st.trunk_layers_served,
            "trunk_shared_layers": st.trunk_shared_layers,
            "trunk_wait_seconds": st.trunk_wait_seconds,
            "io_share": st.io_wait_seconds / self.wall.max(1e-9),
            "io_read_seconds": st.trunk_read_seconds + st.expert_read_seconds,
            "io_wait_seconds": st.io_wait_seconds,
            "io_hidden_fraction": io_hidden_fraction(st),
            "expert_requests": st.expert_requests,
            "resident_hits": st.resident_hits,
            "true_resident_hit_rate": self.true_hit,
            "peak_rss_bytes": self.peak,
            "failed_expert_loads": self.counters.failed_expert_loads,
            "private_expert_reads": st.private_expert_reads,
            "forward_passes": r.spec.forward_passes,
            "drafted_tokens": r.spec.drafted_tokens,
            "accepted_tokens": r.spec.accepted_tokens,
            "bytes_per_token": (!r.generated_ids.is_empty())
                .then(|| (st.trunk_bytes_read + st.expert_bytes_read) as f64 / r.generated_ids.len() as f64),
            "lookahead": self.lookahead_json(),
            "preload": {
                "experts": st.preloaded_experts,
                "bytes": st.preload_bytes,
                "seconds": st.preload_seconds,
            },
            "time_breakdown": time_breakdown_json(r),
            "trunk": trunk_json(&self.trunk),
        })
    }
}

/// `trunk` of `--out`: the codec the layers came from (`null`: the checkpoint's shards) and, for
/// a quantized trunk, `lossy: true` and its label (what is lossy, where its measured quality is
/// published); an exact trunk says `lossy: false`.
pub fn trunk_json(t: &k3_proto::wire::TrunkInfo) -> serde_json::Value {
    serde_json::json!({
        "codec": (!t.codec.is_empty()).then_some(&t.codec),
        "lossy": t.is_lossy(),
        "label": t.is_lossy().then_some(&t.lossy),
    })
}

/// An output file that could not be written.
pub type WriteResult = Result<(), (PathBuf, std::io::Error)>;

fn write(path: &Path, bytes: &[u8]) -> WriteResult {
    std::fs::write(path, bytes).map_err(|e| (path.to_path_buf(), e))
}

/// `--dump-logits`: raw little-endian f32.
pub fn write_logits(path: &Path, logits: &[f32]) -> WriteResult {
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    write(path, &bytes)
}

/// `--out`: pretty JSON and a newline.
pub fn write_json(path: &Path, v: &serde_json::Value) -> WriteResult {
    let text = serde_json::to_string_pretty(v).unwrap_or_default() + "\n";
    write(path, text.as_bytes())
}

/// A file written after the work (a report, a dump): its failure as the job's error.
pub fn written(r: WriteResult) -> Result<(), JobError> {
    r.map_err(|(path, source)| JobError::Output {
        path,
        source,
        before_work: false,
    })
}

/// `--dump-cache-trace`: `DIR/expert_trace.jsonl`, one request per line.
pub fn write_trace(dir: &Path, trace: &[TraceRecord]) -> WriteResult {
    std::fs::create_dir_all(dir).map_err(|e| (dir.to_path_buf(), e))?;
    let mut s = String::new();
    for r in trace {
        s.push_str(&serde_json::to_string(r).unwrap_or_default());
        s.push('\n');
    }
    write(&dir.join("expert_trace.jsonl"), s.as_bytes())
}

/// One f32 `[rows, cols]` array in `.npy` format (version 1.0).
pub fn npy_f32(v: &[f32], cols: usize) -> Vec<u8> {
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}",
        v.len() / cols,
        cols
    );
    // magic(6) + version(2) + len(2) + header + '\n' is a multiple of 64.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
    out
}

/// What `--dump-hidden` collected: the prefill's named intermediates, in order.
#[derive(Debug, Default)]
struct Collected {
    /// The first forward call (the prefill) ended.
    done: bool,
    arrays: Vec<(String, Vec<f32>)>,
}

/// The `--dump-hidden` collector: a tap for the engine and the writer.
#[derive(Debug, Default, Clone)]
pub struct HiddenDump {
    inner: Rc<RefCell<Collected>>,
}

impl HiddenDump {
    /// The engine tap: keeps the first forward call's intermediates as `L{l}.{site}` and
    /// `final_in`.
    pub fn tap(&self, n_layers: usize) -> crate::model::forward::Tap<'static> {
        let sink = self.inner.clone();
        Box::new(move |l: usize, name: &str, v: &[f32]| {
            let mut c = sink.borrow_mut();
            if c.done {
                return;
            }
            let key = if l == n_layers {
                name.to_string()
            } else {
                format!("L{l}.{name}")
            };
            c.arrays.push((key, v.to_vec()));
            if name == "final_in" {
                c.done = true;
            }
        })
    }

    /// Write every array as `DIR/NAME.npy` (`cols` = the hidden width).
    pub fn write(&self, dir: &Path, cols: usize) -> WriteResult {
        std::fs::create_dir_all(dir).map_err(|e| (dir.to_path_buf(), e))?;
        for (name, v) in &self.inner.borrow().arrays {
            write(&dir.join(format!("{name}.npy")), &npy_f32(v, cols))?;
        }
        Ok(())
    }
}
