//! The full model's prefill and decode arithmetic per preset (docs/BENCHMARKS.md, issue 48 items
//! 4 and 5), computed from the plan code, not by hand: the released config's dims
//! (`k3_worker::model::Dims`), the engine's pass bytes and auto prefill chunk
//! (`EnginePlan::auto_prefill_rows`), the presets' budgets and memory plan
//! (`k3_store::runtime::plan`, `full_scale_inputs`: the full model's layer and expert sizes).
//!
//! ```sh
//! cargo run --release -p k3-worker --example full_model_table -- \
//!     proto/tests/data/released_config.json [DISK_GBPS ...]      # default 3.3 and 7
//! ```
//!
//! Assumptions (printed with the tables): a chunk of `n` prompt ids routes each of the 92 MoE
//! layers to the expected union of `n` uniform top-16 choices of 896 experts,
//! `896 · (1 − (1 − 16/896)^n)` (512 ids: 895.9, all of them), each read once per chunk (the
//! chunk's MoE is grouped by expert); the expert cache is counted as holding nothing of a
//! prompt's sweep (≤ 109 GB of 1.45 TB) and, in decode, a uniform share of the routed experts;
//! every streamed (unpinned) trunk layer is read once per forward pass; times are bytes over the
//! disk's read rate — an I/O floor, compute not counted.

use k3_store::runtime::plan::{full_scale_inputs, Budget, BudgetFlag, MemoryPlan, PRESETS};
use k3_worker::engine::memory::EnginePlan;
use k3_worker::model::Dims;

const EXPERTS: f64 = 896.0;
const TOP_K: f64 = 16.0;
const MOE_LAYERS: f64 = 92.0;
const EXPERT_BYTES: f64 = 17_547_264.0;
/// Trunk bytes per raw byte: EC-BF16 (k3slice, measured), int8 (k3slice's tensors through the
/// format's sizes, SPEC.md §6.15), int4 (k3slice, measured by pack-trunk).
const MODES: [(&str, f64); 3] = [("exact (ecbf16)", 0.753), ("int8", 0.503), ("int4", 0.3175)];
const PROMPTS: [usize; 3] = [1024, 4096, 16384];

/// Expected experts a chunk of `n` ids routes one MoE layer to.
fn union(n: usize) -> f64 {
    EXPERTS * (1.0 - (1.0 - TOP_K / EXPERTS).powi(n as i32))
}

/// Expert bytes a prompt of `p` ids in chunks of `c` reads, and its chunks.
fn sweep(p: usize, c: usize) -> (f64, usize) {
    let (full, rest) = (p / c, p % c);
    let experts = full as f64 * union(c) + if rest > 0 { union(rest) } else { 0.0 };
    (experts * MOE_LAYERS * EXPERT_BYTES, p.div_ceil(c))
}

fn gb(b: f64) -> String {
    format!("{:.1}", b / 1e9)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(config) = args.first() else {
        eprintln!("usage: full_model_table CONFIG.json [DISK_GBPS ...]");
        std::process::exit(2);
    };
    let cfg = match k3_proto::config::ModelConfig::load(std::path::Path::new(config)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{config}: {e}");
            std::process::exit(2);
        }
    };
    let d = match Dims::from_config(&cfg) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("{config}: {e}");
            std::process::exit(2);
        }
    };
    let rates: Vec<f64> = match args[1..].iter().map(|a| a.parse()).collect() {
        Ok(r) if !args[1..].is_empty() => r,
        Ok(_) => vec![3.3, 7.0],
        Err(e) => {
            eprintln!("a disk rate: {e}");
            std::process::exit(2);
        }
    };
    let secs = |bytes: f64| {
        let t: Vec<String> = rates
            .iter()
            .map(|r| format!("{:.0}", bytes / (r * 1e9)))
            .collect();
        t.join(" / ")
    };
    println!(
        "## Prefill: expert bytes swept per prompt (chunk 512 before, the auto chunk after)\n"
    );
    println!(
        "rates: {rates:?} GB/s; union of a 512-id chunk: {:.1} of 896 experts\n",
        union(512)
    );
    println!("| preset (prefill allowance) | prompt | chunk before → after | pass after | sweeps before → after | expert bytes before → after | I/O floor s before → after ({rates:?} GB/s) |");
    println!("|---|---|---|---|---|---|---|");
    for p in PRESETS {
        let budget = Budget::from_flags(&[BudgetFlag::Preset(p.name.into())]).expect("preset");
        let allowance = budget.prefill_bytes.expect("a preset names its allowance");
        for n in PROMPTS {
            let plan = EnginePlan::one(n + 1, 512, 0);
            let after = plan.auto_prefill_rows(&d, allowance);
            let pass = EnginePlan {
                prefill_rows: after,
                ..plan
            }
            .pass_bytes(&d);
            let before = 512.min(n);
            let ((b0, s0), (b1, s1)) = (sweep(n, before), sweep(n, after));
            let (tb0, tb1) = (b0 / 1e12, b1 / 1e12);
            println!(
                "| {} ({} GB) | {n} | {before} → {after} | {} GB | {s0} → {s1} | {tb0:.2} → {tb1:.2} TB | {} → {} |",
                p.name,
                p.prefill_gb,
                gb(pass as f64),
                secs(b0),
                secs(b1)
            );
        }
    }
    println!("\n## Per preset and trunk mode: resident set, bytes per token, s/token, prefill of 4,096 ids\n");
    println!("| preset | trunk | resident (plan) | pinned layers | bytes read / token (trunk + experts) | s/token ({rates:?} GB/s) | 4k prefill: chunk, bytes, s ({rates:?} GB/s) |");
    println!("|---|---|---|---|---|---|---|");
    for p in PRESETS {
        let budget = Budget::from_flags(&[BudgetFlag::Preset(p.name.into())]).expect("preset");
        let allowance = budget.prefill_bytes.expect("a preset names its allowance");
        let plan4k = EnginePlan::one(4097, 512, 0);
        let chunk = plan4k.auto_prefill_rows(&d, allowance);
        let pass = EnginePlan {
            prefill_rows: chunk,
            ..plan4k
        }
        .pass_bytes(&d);
        for (mode, ratio) in MODES {
            let inputs = full_scale_inputs(4096)
                .with_coded_trunk(ratio)
                .plus_buffers(pass);
            let plan = MemoryPlan::compute(&inputs, &budget);
            let streamed: u64 = inputs.layer_bytes[plan.pinned_layers..].iter().sum();
            let hit = (plan.expert_slots as f64 / (MOE_LAYERS * EXPERTS)).min(1.0);
            let experts = TOP_K * MOE_LAYERS * EXPERT_BYTES * (1.0 - hit);
            let token = streamed as f64 + experts;
            let (sweep_bytes, chunks) = sweep(4096, chunk);
            let prefill = sweep_bytes + chunks as f64 * streamed as f64;
            let tb = prefill / 1e12;
            println!(
                "| {} | {mode} | {} GB | {} of 93 | {} GB ({} + {}) | {} | {chunk}, {tb:.2} TB, {} |",
                p.name,
                gb(plan.total_bytes() as f64),
                plan.pinned_layers,
                gb(token),
                gb(streamed as f64),
                gb(experts),
                rates
                    .iter()
                    .map(|r| format!("{:.2}", token / (r * 1e9)))
                    .collect::<Vec<_>>()
                    .join(" / "),
                secs(prefill)
            );
        }
    }
}
