//! `k3-ctl replay-trace`: TRUE resident hit rate of each eviction policy at several cache
//! capacities, against Belady, by replaying expert traces (see `k3_store::runtime::policy`).

use std::path::PathBuf;

use k3_proto::exit;
use k3_store::runtime::policy::{self, Row, Trace, POLICY_NAMES};

use crate::fail::Failed;

/// Most slots a replay may simulate (bounds the allocation).
const MAX_CAPACITY: usize = 10_000_000;

/// Arguments of `k3-ctl replay-trace`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace files (`expert_trace.jsonl`), replayed in order as sequential jobs on one cache.
    #[arg(required = true)]
    pub traces: Vec<PathBuf>,
    /// Cache capacities: a number of slots, or `P%` of the working set (distinct experts).
    #[arg(long, num_args = 1.., required = true)]
    pub capacity: Vec<String>,
    /// Online policies to compare with LRU and Belady: `all`, or names (comma-separated or
    /// repeated) among lru, lfu, layer, layer-lfu, each optionally `NAME:PARAM`.
    #[arg(long, default_value = "all", value_delimiter = ',')]
    pub policy: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A `--capacity` or `--policy` value refused (exit 2).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
enum ArgError {
    /// Neither `N` nor `P%`.
    #[error("bad capacity {0:?}: expected N or P%")]
    Capacity(String),
    /// A percentage outside (0, 1000].
    #[error("bad capacity {0:?}: percentage out of range")]
    Percent(String),
    /// A slot count outside 1..=MAX_CAPACITY.
    #[error("bad capacity {0:?}: must be 1..={MAX_CAPACITY} slots")]
    Slots(String),
    /// A policy this build does not have.
    #[error("unknown policy {0:?} (known: all, {known})", known = POLICY_NAMES.join(", "))]
    Policy(String),
}

/// Parse `N` or `P%` (of `working_set`) into a slot count.
fn parse_capacity(s: &str, working_set: usize) -> Result<usize, ArgError> {
    let n = if let Some(p) = s.strip_suffix('%') {
        let p: f64 = (p.trim().parse()).map_err(|_| ArgError::Capacity(s.to_string()))?;
        if !(p.is_finite() && p > 0.0 && p <= 1000.0) {
            return Err(ArgError::Percent(s.to_string()));
        }
        ((working_set as f64) * p / 100.0).round().max(1.0) as usize
    } else {
        (s.trim().parse::<usize>()).map_err(|_| ArgError::Capacity(s.to_string()))?
    };
    if n == 0 || n > MAX_CAPACITY {
        return Err(ArgError::Slots(s.to_string()));
    }
    Ok(n)
}

fn policies(names: &[String]) -> Result<Vec<String>, ArgError> {
    let mut out: Vec<String> = Vec::new();
    for n in names {
        let n = n.trim();
        if n == "all" {
            for p in POLICY_NAMES {
                if !out.iter().any(|o| o == p) {
                    out.push(p.to_string());
                }
            }
        } else if policy::policy_by_name(n, 1).is_some() {
            if !out.iter().any(|o| o == n) {
                out.push(n.to_string());
            }
        } else {
            return Err(ArgError::Policy(n.to_string()));
        }
    }
    Ok(out)
}

/// Run the subcommand; returns the exit code.
pub fn run(a: Args) -> Result<i32, Failed> {
    let pols = policies(&a.policy).map_err(|e| Failed::coded(exit::REFUSED, e))?;
    let trace = Trace::read_files(&a.traces).map_err(|e| Failed::coded(exit::REFUSED, e))?;
    let ws = trace.working_set();
    let mut caps = Vec::new();
    for s in &a.capacity {
        caps.push(parse_capacity(s, ws).map_err(|e| Failed::coded(exit::REFUSED, e))?);
    }
    let (max_batch, mb_step, mb_layer) = trace.max_batch();
    if let Some(&c) = caps.iter().find(|&&c| c < max_batch) {
        return Err(Failed::refused(format!(
            "capacity {c} slots < the largest batch, {max_batch} experts \
             (step {mb_step}, layer {mb_layer}); the store would refuse it"
        )));
    }
    let rows =
        policy::evaluate(&trace, &caps, &pols).map_err(|e| Failed::coded(exit::REFUSED, e))?;
    if a.json {
        let v = serde_json::json!({
            "traces": a.traces.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "jobs": trace.jobs,
            "batches": trace.batches.len(),
            "requests": trace.requests(),
            "working_set": ws,
            "layers": trace.layers(),
            "max_batch": max_batch,
            "rows": rows,
        });
        println!("{v:#}");
    } else {
        print!(
            "{}",
            render(&trace, ws, max_batch, &caps, &rows, &pols_with_lru(&pols))
        );
    }
    Ok(exit::OK)
}

fn pols_with_lru(p: &[String]) -> Vec<String> {
    let mut v = vec!["belady".to_string(), "lru".to_string()];
    v.extend(p.iter().filter(|n| *n != "lru").cloned());
    v
}

/// The text table: one line per capacity, per policy "hit% (gap%)".
fn render(
    trace: &Trace,
    ws: usize,
    max_batch: usize,
    caps: &[usize],
    rows: &[Row],
    cols: &[String],
) -> String {
    let mut s = format!(
        "{} job(s), {} batches, {} requests, working set {} (layer, expert) pairs over {} \
         layers, largest batch {}\nTRUE resident hit rate (all steps); in parentheses the \
         share of the LRU->Belady gap closed\n",
        trace.jobs,
        trace.batches.len(),
        trace.requests(),
        ws,
        trace.layers(),
        max_batch
    );
    s += &format!("{:>9} {:>7}", "capacity", "%ws");
    for c in cols {
        s += &format!(" {:>20}", c);
    }
    s.push('\n');
    for &cap in caps {
        s += &format!("{:>9} {:>6.1}%", cap, 100.0 * cap as f64 / ws.max(1) as f64);
        for c in cols {
            let cell = rows
                .iter()
                .find(|r| r.capacity == cap && &r.policy == c)
                .map(|r| match r.gap_closed {
                    Some(g) => format!("{:.1}% ({:+.0}%)", 100.0 * r.hit_rate, 100.0 * g),
                    None => format!("{:.1}%", 100.0 * r.hit_rate),
                })
                .unwrap_or_default();
            s += &format!(" {:>20}", cell);
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_parse_as_slots_or_percent() {
        assert_eq!(parse_capacity("128", 2560), Ok(128));
        assert_eq!(parse_capacity("5%", 2560), Ok(128));
        assert_eq!(parse_capacity("0.01%", 2560), Ok(1));
        assert!(parse_capacity("0", 2560).is_err());
        assert!(parse_capacity("x%", 2560).is_err());
        assert!(parse_capacity("99999999999", 2560).is_err());
    }

    #[test]
    fn policy_lists_expand_and_refuse_unknown_names() {
        let all = policies(&["all".into()]).unwrap();
        assert_eq!(all, POLICY_NAMES.to_vec());
        assert_eq!(
            policies(&["lfu:2".into(), "layer".into()]).unwrap(),
            vec!["lfu:2", "layer"]
        );
        assert!(policies(&["mru".into()])
            .unwrap_err()
            .to_string()
            .contains("mru"));
        assert!(policies(&["lfu:-1".into()]).is_err());
    }
}
