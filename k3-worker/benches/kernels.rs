//! Kernel benchmark: memory read bandwidth (the floor) and every tier's rates at the real
//! shapes, at 1 and 2 threads.
//!
//! `cargo bench -p k3-worker --bench kernels [-- --reps N] [--tiers avx2,avx512] [--json PATH]
//! [--memory-only] [--sweep-only]` (`--memory-only`: just the memory read bandwidth, for floors
//! in a hurry; `--sweep-only`: memory, FMA peak and the multi-token sweep only)
//! (`K3_BENCH_JSON=PATH` works too). Each figure is the median and min–max of `reps` (≥ 5)
//! timed runs after one warm-up run. Every tier's output is checked against the scalar tier.
//!
//! Shapes: bf16 12288×7168 and 7168×12288 (one 176 MB matrix, read as either shape), and the
//! narrow-row 163840×256 (the `small` preset's lm_head) and 12288×1536; MXFP4 one
//! expert's 3072×3584 (w1/w3) and 3584×3072 (w2), cycled over 16 distinct experts per timed run
//! so the bytes come from memory as in decode (one expert alone would sit in the LLC); bf16
//! matmul of 5 and 16 tokens at 12288×7168.
//!
//! FMA peak: each tier's probe (16 independent FMA chains per thread), GMAC/s at 1 and 2
//! threads. Multi-token sweep (issues 30, 33 and 48): bf16 raw (and `small`'s lm_head shape
//! 163840×256 at K = 1, 2, 4), EC-BF16 coded (widths 4 and 3)
//! and int8/int4 quantized (the quantized trunk's stored matrices, each tier checked bit for bit
//! against the scalar twin) at 12288×7168 and MXFP4 at one expert's 3072×3584, K = 1, 2, 4, 8,
//! 16 tokens, each against its
//! roofline, the lower of the memory bound (memory bandwidth × K / bytes per weight) and the FMA
//! peak ("strips": the same product with the opt-in strip kernels); the coded matrix holds Gaussian weights (a trained matrix's few exponents) and every
//! coded result is checked bit for bit against the raw one.

use std::hint::black_box;
use std::time::Instant;

use k3_worker::kernels::{build_pool, Kernels, Tier};
use rayon::prelude::*;
use serde_json::{json, Value};

const GIB: usize = 1 << 30;
const THREADS: [usize; 2] = [1, 2];
/// Distinct MXFP4 experts cycled per timed run (16 × 5.85 MB ≫ LLC).
const EXPERTS: usize = 16;

struct Args {
    reps: usize,
    tiers: Option<Vec<Tier>>,
    json: Option<String>,
    memory_only: bool,
    sweep_only: bool,
}

// String error because a benchmark's own argument loop prints the message and exits; nothing
// matches on it and no exit code depends on it.
fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        reps: 7,
        tiers: None,
        json: std::env::var("K3_BENCH_JSON").ok(),
        memory_only: false,
        sweep_only: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--bench" => {} // passed by `cargo bench`
            "--reps" => {
                let v = it.next().ok_or("--reps needs a value")?;
                args.reps = v.parse().map_err(|_| format!("--reps {v:?}"))?;
                if args.reps < 5 {
                    return Err("--reps must be at least 5".into());
                }
            }
            "--tiers" => {
                let v = it.next().ok_or("--tiers needs a list")?;
                let t: Option<Vec<Tier>> = v.split(',').map(Tier::from_name).collect();
                args.tiers = Some(t.ok_or(format!("--tiers {v:?}: expected scalar,avx2,avx512"))?);
            }
            "--json" => args.json = Some(it.next().ok_or("--json needs a path")?),
            "--memory-only" => args.memory_only = true,
            "--sweep-only" => args.sweep_only = true,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(args)
}

/// Median, min and max of `reps` timed runs (seconds) after one warm-up run, and the share of
/// `threads` CPUs the process actually got during them (the machine is shared: a share well
/// below 1 means the figures are depressed by other work, not by the kernel).
#[derive(Clone, Copy)]
struct Stat {
    median: f64,
    min: f64,
    max: f64,
    cpu_share: f64,
}

/// CPU time of every thread of this process so far, in ns (Linux schedstat; 0 if unreadable).
fn process_cpu_ns() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn time<F: FnMut()>(reps: usize, threads: usize, mut f: F) -> Stat {
    f();
    let cpu0 = process_cpu_ns();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    let cpu = (process_cpu_ns().saturating_sub(cpu0)) as f64 * 1e-9;
    let wall: f64 = t.iter().sum();
    t.sort_by(f64::total_cmp);
    Stat {
        median: t[t.len() / 2],
        min: t[0],
        max: t[t.len() - 1],
        cpu_share: cpu / (wall * threads as f64),
    }
}

/// A timing of `EXPERTS` experts as the time of one.
fn per_expert(s: Stat) -> Stat {
    let per = |v: f64| v / EXPERTS as f64;
    Stat {
        median: per(s.median),
        min: per(s.min),
        max: per(s.max),
        cpu_share: s.cpu_share,
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// A rate (`amount / second`) from a time: median, and the min–max range (the slowest run
/// gives the minimum rate).
fn rate(amount: f64, s: Stat) -> (f64, f64, f64) {
    (amount / s.median, amount / s.max, amount / s.min)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Random finite bf16 weights of magnitude 2^-15 .. 2 (exponent field 112..127).
fn bf16_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 * n);
    for _ in 0..n {
        let r = rng.next();
        let bits = (r & 0x8000) | ((112 + (r >> 20) % 16) << 7) | ((r >> 8) & 0x7F);
        v.extend_from_slice(&(bits as u16).to_le_bytes());
    }
    v
}

fn f32s(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect()
}

struct Expert {
    packed: Vec<u8>,
    scales: Vec<u8>,
}

fn mxfp4_expert(rng: &mut Rng, rows: usize, cols: usize) -> Expert {
    Expert {
        packed: (0..rows * cols / 2).map(|_| rng.next() as u8).collect(),
        scales: (0..rows * cols / 32)
            .map(|_| 120 + (rng.next() % 16) as u8)
            .collect(),
    }
}

/// Largest |a−b| relative to the RMS of `b` (a sanity check that a tier computed the same
/// product as the scalar tier; reassociation differences are ~1e-6).
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let rms = (b.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / b.len() as f64).sqrt();
    let d = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).abs())
        .fold(0.0, f64::max);
    d / rms.max(1e-30)
}
const CHECK_REL: f64 = 1e-4;

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn git_commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// Sum of a buffer of u64 (8 independent lanes so the loads, not the adds, limit the rate).
fn sum_u64(v: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut it = v.chunks_exact(8);
    for c in &mut it {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(x);
        }
    }
    let tail = it.remainder().iter().fold(0u64, |a, &x| a.wrapping_add(x));
    acc.iter().fold(tail, |a, &x| a.wrapping_add(x))
}

struct Row {
    kernel: String,
    tier: Tier,
    threads: usize,
    stat: Stat,
    bytes: f64,
    macs: f64,
    mem_gbs: f64,
    /// The tier's measured FMA peak at `threads` (GMAC/s; NaN where not measured).
    peak_gmacs: f64,
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kernels bench: {e}");
            std::process::exit(2);
        }
    };
    let active = match k3_worker::kernels::select_tier() {
        Ok(t) => t.name().to_string(),
        Err(e) => format!("error: {e}"),
    };
    let tiers: Vec<Kernels> = Tier::ALL
        .into_iter()
        .filter(|t| args.tiers.as_ref().is_none_or(|l| l.contains(t)))
        .filter_map(Kernels::new)
        .collect();
    for t in Tier::ALL {
        if !t.is_available() {
            println!("note: tier {t} skipped (CPU lacks it)");
        }
    }
    let pools: Vec<_> = THREADS
        .iter()
        .map(|&n| build_pool(n).expect("thread pool"))
        .collect();
    println!(
        "machine: {} | {} logical CPUs | load average {} | tiers: {} | active (K3_SIMD/auto): {} | commit {} | reps {} (+1 warm-up)",
        cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average(),
        tiers.iter().map(|k| k.tier().name()).collect::<Vec<_>>().join(" "),
        active,
        git_commit(),
        args.reps
    );

    // --- memory read bandwidth --------------------------------------------------------------
    let mut mem = Vec::new();
    {
        let n = GIB / 8;
        let buf: Vec<u64> = (0..n as u64).collect(); // touches every page
        let want = (n as u64).wrapping_mul(n as u64 - 1) / 2;
        for (pool, &threads) in pools.iter().zip(&THREADS) {
            let s = time(args.reps, threads, || {
                let got = pool.install(|| {
                    buf.par_chunks(1 << 17)
                        .map(sum_u64)
                        .reduce(|| 0, u64::wrapping_add)
                });
                assert_eq!(got, want, "memory sum check");
            });
            let (m, lo, hi) = rate(GIB as f64 / 1e9, s);
            println!(
                "memory read bandwidth (sum over 1 GiB), {threads} thread(s): {m:.2} GB/s ({lo:.2}–{hi:.2}), cpu share {:.2}",
                s.cpu_share
            );
            mem.push((threads, s, m));
        }
    }
    if args.memory_only {
        write_json(&args, &active, &mem, &[], Vec::new(), true);
        return;
    }
    let mem_at = |threads: usize| {
        mem.iter()
            .find(|m| m.0 == threads)
            .map_or(f64::NAN, |m| m.2)
    };

    // --- FMA peak ------------------------------------------------------------------------------
    let mut peak: Vec<(Tier, usize, f64)> = Vec::new();
    for k in &tiers {
        for (pool, &threads) in pools.iter().zip(&THREADS) {
            let iters = 4_000_000usize;
            let s = time(args.reps, threads, || {
                let v: f32 = pool.install(|| {
                    (0..threads)
                        .into_par_iter()
                        .map(|_| k.fma_probe(black_box(iters)).1)
                        .sum()
                });
                black_box(v);
            });
            let macs = k.fma_probe(1).0 as f64 * iters as f64 * threads as f64;
            let (g, lo, hi) = rate(macs / 1e9, s);
            println!(
                "FMA peak {} {threads} thread(s): {g:.1} GMAC/s ({lo:.1}–{hi:.1}), cpu share {:.2}",
                k.tier(),
                s.cpu_share
            );
            peak.push((k.tier(), threads, g));
        }
    }
    let peak_at = |tier: Tier, threads: usize| {
        peak.iter()
            .find(|p| p.0 == tier && p.1 == threads)
            .map_or(f64::NAN, |p| p.2)
    };

    let mut rows: Vec<Row> = Vec::new();
    let mut checks_ok = true;
    sweep(
        &args,
        &tiers,
        &pools,
        &mem_at,
        &peak_at,
        &mut rows,
        &mut checks_ok,
    );
    if args.sweep_only {
        report(&args, &active, &mem, &peak, rows, checks_ok);
        return;
    }

    // --- data --------------------------------------------------------------------------------
    let mut rng = Rng(42);
    let (big_r, big_c) = (12288usize, 7168usize);
    let w = bf16_bytes(&mut rng, big_r * big_c);
    // The two wide shapes read the whole matrix; the narrow ones (the `small` preset's lm_head,
    // K3's q_b_proj width) a prefix of it.
    let bf16_shapes = [
        (big_r, big_c),
        (big_c, big_r),
        (163_840, 256),
        (12_288, 1536),
    ];
    let x_wide = f32s(&mut rng, 16 * big_r.max(big_c));
    let (er, ec) = (3072usize, 3584usize);
    let experts: Vec<Expert> = (0..EXPERTS)
        .map(|_| mxfp4_expert(&mut rng, er, ec))
        .collect();

    let scalar = Kernels::new(Tier::Scalar).expect("scalar tier");

    // Reference outputs (scalar tier) for the self-check.
    let mut refs: Vec<Vec<f32>> = Vec::new();
    pools[pools.len() - 1].install(|| {
        for (r, c) in bf16_shapes {
            let mut y = vec![0.0f32; r];
            scalar.matvec_bf16(&w[..r * c * 2], r, c, &x_wide[..c], &mut y);
            refs.push(y);
        }
        for (r, c) in [(er, ec), (ec, er)] {
            let mut y = vec![0.0f32; r];
            scalar.matvec_mxfp4(
                &experts[0].packed,
                &experts[0].scales,
                r,
                c,
                &x_wide[..c],
                &mut y,
            );
            refs.push(y);
        }
    });

    for k in &tiers {
        for (pool, &threads) in pools.iter().zip(&THREADS) {
            pool.install(|| {
                for (i, (r, c)) in bf16_shapes.into_iter().enumerate() {
                    let mut y = vec![0.0f32; r];
                    let s = time(args.reps, threads, || {
                        k.matvec_bf16(black_box(&w[..r * c * 2]), r, c, &x_wide[..c], &mut y);
                        black_box(&y);
                    });
                    if rel_diff(&y, &refs[i]) > CHECK_REL {
                        eprintln!("CHECK FAILED: {} bf16 {r}x{c}", k.tier());
                        checks_ok = false;
                    }
                    rows.push(Row {
                        kernel: format!("bf16 matvec {r}x{c}"),
                        tier: k.tier(),
                        threads,
                        stat: s,
                        bytes: (r * c * 2) as f64,
                        macs: (r * c) as f64,
                        mem_gbs: mem_at(threads),
                        peak_gmacs: f64::NAN,
                    });
                }
                // One expert's matrices: the decode product at both shapes, then the prefill
                // product (n tokens; each token block decodes a group once). Row 0 of every
                // result is checked against the scalar matvec of that shape (matmul row t equals
                // the matvec of token t, bit for bit per tier).
                let mx = [
                    (0, er, ec, 1usize),
                    (1, ec, er, 1),
                    (0, er, ec, 5),
                    (0, er, ec, 16),
                ];
                for (i, r, c, n) in mx {
                    let mut y = vec![0.0f32; n * r];
                    let product = |e: &Expert, y: &mut [f32]| {
                        k.matmul_mxfp4(&e.packed, &e.scales, r, c, &x_wide[..n * c], n, y)
                    };
                    let s = time(args.reps, threads, || {
                        for e in &experts {
                            product(black_box(e), &mut y);
                            black_box(&y);
                        }
                    });
                    product(&experts[0], &mut y);
                    let name = match n {
                        1 => format!("mxfp4 matvec {r}x{c}"),
                        _ => format!("mxfp4 matmul {r}x{c} n={n}"),
                    };
                    if rel_diff(&y[..r], &refs[bf16_shapes.len() + i]) > CHECK_REL {
                        eprintln!("CHECK FAILED: {} {name}", k.tier());
                        checks_ok = false;
                    }
                    rows.push(Row {
                        kernel: name,
                        tier: k.tier(),
                        threads,
                        stat: per_expert(s),
                        bytes: (r * c / 2 + r * c / 32) as f64,
                        macs: (r * c * n) as f64,
                        mem_gbs: mem_at(threads),
                        peak_gmacs: f64::NAN,
                    });
                }
                for n in [5usize, 16] {
                    let (r, c) = (big_r, big_c);
                    let mut y = vec![0.0f32; n * r];
                    let s = time(args.reps, threads, || {
                        k.matmul_bf16(black_box(&w), r, c, &x_wide[..n * c], n, &mut y);
                        black_box(&y);
                    });
                    if rel_diff(&y[..r], &refs[0]) > CHECK_REL {
                        eprintln!("CHECK FAILED: {} bf16 matmul n={n}", k.tier());
                        checks_ok = false;
                    }
                    rows.push(Row {
                        kernel: format!("bf16 matmul {r}x{c} n={n}"),
                        tier: k.tier(),
                        threads,
                        stat: s,
                        bytes: (r * c * 2) as f64,
                        macs: (r * c * n) as f64,
                        mem_gbs: mem_at(threads),
                        peak_gmacs: f64::NAN,
                    });
                }
            });
        }
    }

    report(&args, &active, &mem, &peak, rows, checks_ok);
}

/// Write the JSON report when `--json` was given (exit 1 if it cannot be written).
fn write_json(
    args: &Args,
    active: &str,
    mem: &[(usize, Stat, f64)],
    peak: &[(Tier, usize, f64)],
    out_rows: Vec<Value>,
    checks_ok: bool,
) {
    if let Some(path) = &args.json {
        // `cargo bench` runs in the package directory: a relative path is the workspace root's.
        let path = if std::path::Path::new(path).is_relative() {
            format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"))
        } else {
            path.clone()
        };
        let doc: Value = json!({
            "machine": {"cpu": cpu_model(),
                        "logical_cpus": std::thread::available_parallelism().map_or(0, |n| n.get())},
            "commit": git_commit(),
            "load_average_at_start": load_average(),
            "reps": args.reps,
            "active_tier": active,
            "memory_read_bandwidth": mem.iter().map(|(t, s, m)| {
                let (_, lo, hi) = rate(GIB as f64 / 1e9, *s);
                json!({"threads": t, "gb_per_s": {"median": m, "min": lo, "max": hi},
                       "cpu_share": s.cpu_share})
            }).collect::<Vec<_>>(),
            "fma_peak_gmac_per_s": peak.iter().map(|(t, n, g)| {
                json!({"tier": t.name(), "threads": n, "gmac_per_s": g})
            }).collect::<Vec<_>>(),
            "kernels": out_rows,
            "self_check_ok": checks_ok,
        });
        match serde_json::to_string_pretty(&doc) {
            Ok(s) => {
                if let Err(e) = std::fs::write(&path, s) {
                    eprintln!("kernels bench: cannot write {path}: {e}");
                    std::process::exit(1);
                }
                println!("wrote {path}");
            }
            Err(e) => {
                eprintln!("kernels bench: JSON: {e}");
                std::process::exit(1);
            }
        }
    }
}

/// Prints the table (and writes the JSON); exits 1 if a self-check failed.
fn report(
    args: &Args,
    active: &str,
    mem: &[(usize, Stat, f64)],
    peak: &[(Tier, usize, f64)],
    rows: Vec<Row>,
    checks_ok: bool,
) {
    println!();
    println!(
        "{:<34} {:<7} {:>3} {:>10} {:>22} {:>8} {:>8} {:>9} {:>6} {:>5} {:>9}",
        "kernel",
        "tier",
        "thr",
        "median ms",
        "GB/s weights (min–max)",
        "GMAC/s",
        "÷mem bw",
        "roofline",
        "÷roof",
        "cpu",
        "GB/s/cpu"
    );
    let mut out_rows = Vec::new();
    for r in &rows {
        let (gbs, gbs_lo, gbs_hi) = rate(r.bytes / 1e9, r.stat);
        let (gmac, _, _) = rate(r.macs / 1e9, r.stat);
        let ratio = gbs / r.mem_gbs;
        // The lower of the memory bound (every weight read once) and the FMA peak.
        let roofline = (r.mem_gbs * r.macs / r.bytes).min(r.peak_gmacs);
        let per_cpu = gbs / (r.stat.cpu_share * r.threads as f64);
        println!(
            "{:<34} {:<7} {:>3} {:>10.3} {:>8.2} ({:>5.2}–{:>5.2}) {:>8.2} {:>8.2} {:>9.1} {:>6.2} {:>5.2} {:>9.2}",
            r.kernel,
            r.tier.name(),
            r.threads,
            r.stat.median * 1e3,
            gbs,
            gbs_lo,
            gbs_hi,
            gmac,
            ratio,
            roofline,
            gmac / roofline,
            r.stat.cpu_share,
            per_cpu
        );
        out_rows.push(json!({
            "kernel": r.kernel, "tier": r.tier.name(), "threads": r.threads,
            "seconds": {"median": r.stat.median, "min": r.stat.min, "max": r.stat.max},
            "bytes": r.bytes, "macs": r.macs,
            "gb_per_s": {"median": gbs, "min": gbs_lo, "max": gbs_hi},
            "gmac_per_s": gmac, "ratio_to_memory_bandwidth": ratio,
            "roofline_gmac_per_s": if roofline.is_finite() { json!(roofline) } else { Value::Null },
            "ratio_to_roofline": if roofline.is_finite() { json!(gmac / roofline) } else { Value::Null },
            "cpu_share": r.stat.cpu_share, "gb_per_s_per_cpu_received": per_cpu,
        }));
    }
    println!(
        "\ncpu = share of the `thr` CPUs this process got during the timed runs (schedstat); \
         GB/s/cpu = GB/s ÷ (cpu·thr), the rate per CPU actually received (an estimate); \
         roofline = min(memory bandwidth × MACs/bytes, FMA peak of the tier at thr threads)."
    );
    println!(
        "self-check (against the scalar tier, max |Δ|/rms ≤ {CHECK_REL:e}; coded against raw bit for bit): {}",
        if checks_ok { "ok" } else { "FAILED" }
    );
    write_json(args, active, mem, peak, out_rows, checks_ok);
    if !checks_ok {
        std::process::exit(1);
    }
}

/// Gaussian bf16 weights (σ = 2^-6, Box–Muller, round to nearest even): the handful of
/// exponents of a trained matrix, so the coded matrix has the escapes such a matrix has.
fn gaussian_bf16(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 * n);
    while v.len() < 2 * n {
        let u1 = ((rng.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
        let r = (-2.0 * u1.ln()).sqrt() / 64.0;
        for z in [
            r * (2.0 * std::f64::consts::PI * u2).cos(),
            r * (2.0 * std::f64::consts::PI * u2).sin(),
        ] {
            let b = (z as f32).to_bits();
            let bf = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
            if v.len() < 2 * n {
                v.extend_from_slice(&bf.to_le_bytes());
            }
        }
    }
    v
}

/// The multi-token sweep: bf16 raw, EC-BF16 coded (widths 4 and 3) and MXFP4 at K tokens.
#[allow(clippy::too_many_arguments)]
fn sweep(
    args: &Args,
    tiers: &[Kernels],
    pools: &[rayon::ThreadPool],
    mem_at: &(dyn Fn(usize) -> f64 + Sync),
    peak_at: &(dyn Fn(Tier, usize) -> f64 + Sync),
    rows: &mut Vec<Row>,
    checks_ok: &mut bool,
) {
    use k3_proto::ecbf16::{self, CodedMatrix};
    const KS: [usize; 5] = [1, 2, 4, 8, 16];
    let mut rng = Rng(7);
    let (r, c) = (12288usize, 7168usize);
    let raw = gaussian_bf16(&mut rng, r * c);
    let coded: Vec<(u8, Vec<u8>)> = [4u8, 3]
        .into_iter()
        .map(|w| (w, ecbf16::encode(&raw, r, c, w).expect("encode")))
        .collect();
    for (w, bytes) in &coded {
        let m = CodedMatrix::parse(bytes).expect("parse");
        println!(
            "EC-BF16 width {w}: {:.4} of raw, {} escapes ({:.4}%)",
            bytes.len() as f64 / raw.len() as f64,
            m.escapes(),
            100.0 * m.escapes() as f64 / (r * c) as f64
        );
    }
    huffman_decode_rate(args, pools, &raw);
    let x = f32s(&mut rng, 16 * c);
    let (er, ec) = (3072usize, 3584usize);
    let experts: Vec<Expert> = (0..EXPERTS)
        .map(|_| mxfp4_expert(&mut rng, er, ec))
        .collect();
    let quant = quant_matrices(&raw, r, c, &x[..c]);
    for k in tiers.iter().filter(|k| k.tier() != Tier::Scalar) {
        for (pool, &threads) in pools.iter().zip(&THREADS) {
            pool.install(|| {
                for n in KS {
                    for (kind, blob, twin) in &quant {
                        let m = k3_proto::quant::QuantMatrix::parse(blob).expect("parse");
                        let mut y = vec![0.0f32; n * r];
                        let s = time(args.reps, threads, || {
                            k.matmul_quant(black_box(&m), &x[..n * c], n, &mut y);
                            black_box(&y);
                        });
                        // Token 0 is the scalar twin's bits (every tier, every K).
                        if y[..r]
                            .iter()
                            .zip(twin)
                            .any(|(a, b)| a.to_bits() != b.to_bits())
                        {
                            eprintln!(
                                "CHECK FAILED: {} {} K={n} differs from the scalar twin",
                                k.tier(),
                                kind.name()
                            );
                            *checks_ok = false;
                        }
                        rows.push(Row {
                            kernel: format!("{} {r}x{c} K={n}", kind.name()),
                            tier: k.tier(),
                            threads,
                            stat: s,
                            bytes: blob.len() as f64,
                            macs: (r * c * n) as f64,
                            mem_gbs: mem_at(threads),
                            peak_gmacs: peak_at(k.tier(), threads),
                        });
                    }
                    let mut y_raw = vec![0.0f32; n * r];
                    let s = time(args.reps, threads, || {
                        k.matmul_bf16(black_box(&raw), r, c, &x[..n * c], n, &mut y_raw);
                        black_box(&y_raw);
                    });
                    rows.push(Row {
                        kernel: format!("bf16 {r}x{c} K={n}"),
                        tier: k.tier(),
                        threads,
                        stat: s,
                        bytes: raw.len() as f64,
                        macs: (r * c * n) as f64,
                        mem_gbs: mem_at(threads),
                        peak_gmacs: peak_at(k.tier(), threads),
                    });
                    if n <= 4 {
                        // Short rows: `small`'s lm_head (163840 × 256, 84 MB, the first bytes
                        // of the same matrix) at the batch sizes of a 4-slot serve step — the
                        // multi-token blocks' short-row prefetch (avx2::short_row_ahead).
                        let (sr, sc) = (163_840usize, 256usize);
                        let w = &raw[..sr * sc * 2];
                        let mut y = vec![0.0f32; n * sr];
                        let s = time(args.reps, threads, || {
                            k.matmul_bf16(black_box(w), sr, sc, &x[..n * sc], n, &mut y);
                            black_box(&y);
                        });
                        rows.push(Row {
                            kernel: format!("bf16 {sr}x{sc} K={n}"),
                            tier: k.tier(),
                            threads,
                            stat: s,
                            bytes: w.len() as f64,
                            macs: (sr * sc * n) as f64,
                            mem_gbs: mem_at(threads),
                            peak_gmacs: peak_at(k.tier(), threads),
                        });
                    }
                    if n > 2 {
                        // The same product with the strip kernels (each weight decoded once
                        // for all tokens; off by default), same run.
                        let mut y = vec![0.0f32; n * r];
                        let kb = k.with_strips();
                        let s = time(args.reps, threads, || {
                            kb.matmul_bf16(black_box(&raw), r, c, &x[..n * c], n, &mut y);
                            black_box(&y);
                        });
                        rows.push(Row {
                            kernel: format!("bf16 {r}x{c} K={n} strips"),
                            tier: k.tier(),
                            threads,
                            stat: s,
                            bytes: raw.len() as f64,
                            macs: (r * c * n) as f64,
                            mem_gbs: mem_at(threads),
                            peak_gmacs: peak_at(k.tier(), threads),
                        });
                    }
                    for (w, bytes) in &coded {
                        if *w == 3 && n > 1 {
                            continue;
                        }
                        let m = CodedMatrix::parse(bytes).expect("parse");
                        let mut y = vec![0.0f32; n * r];
                        let s = time(args.reps, threads, || {
                            k.matmul_coded(black_box(&m), &x[..n * c], n, &mut y);
                            black_box(&y);
                        });
                        if y.iter()
                            .zip(&y_raw)
                            .any(|(a, b)| a.to_bits() != b.to_bits())
                        {
                            eprintln!(
                                "CHECK FAILED: {} coded w{w} K={n} differs from raw",
                                k.tier()
                            );
                            *checks_ok = false;
                        }
                        rows.push(Row {
                            kernel: format!("ecbf16 w{w} {r}x{c} K={n}"),
                            tier: k.tier(),
                            threads,
                            stat: s,
                            bytes: bytes.len() as f64,
                            macs: (r * c * n) as f64,
                            mem_gbs: mem_at(threads),
                            peak_gmacs: peak_at(k.tier(), threads),
                        });
                    }
                    for (kk, label) in [(*k, ""), (k.with_strips(), " strips")] {
                        if label.is_empty() || n > 2 {
                            mxfp4_row(args, &experts, kk, threads, n, label, mem_at, peak_at, rows);
                        }
                    }
                }
            });
        }
    }
}

/// The int8 and int4 quantized copies of `raw [r, c]` (the trunk's stored matrices,
/// `k3_proto::quant::encode_matrix`) and each one's scalar-twin product with `x0` (one token);
/// exits 1 when a copy strays from the bf16 product more than its quantization allows (the
/// largest error over the rms: ~0.04 for int8, ~0.4 for int4 over 12288 Gaussian rows).
fn quant_matrices(
    raw: &[u8],
    r: usize,
    c: usize,
    x0: &[f32],
) -> Vec<(k3_proto::quant::QuantKind, Vec<u8>, Vec<f32>)> {
    use k3_proto::quant::{encode_matrix, QuantKind, QuantMatrix};
    let scalar = Kernels::new(Tier::Scalar).expect("the scalar tier");
    let mut exact = vec![0.0f32; r];
    scalar.matmul_bf16(raw, r, c, x0, 1, &mut exact);
    [QuantKind::Int8, QuantKind::Int4]
        .into_iter()
        .map(|kind| {
            let blob = encode_matrix(kind, raw, r, c).expect("quantize");
            let m = QuantMatrix::parse(&blob).expect("parse");
            let mut twin = vec![0.0f32; r];
            scalar.matmul_quant(&m, x0, 1, &mut twin);
            let d = rel_diff(&twin, &exact);
            let bound = if kind == QuantKind::Int8 { 0.05 } else { 0.5 };
            println!(
                "{} {r}x{c}: {:.4} of raw bf16, error vs the bf16 product {d:.4} of its rms",
                kind.name(),
                blob.len() as f64 / raw.len() as f64
            );
            if d > bound {
                eprintln!(
                    "CHECK FAILED: {} strays {d:.3} from the bf16 product",
                    kind.name()
                );
                std::process::exit(1);
            }
            (kind, blob, twin)
        })
        .collect()
}

/// Bits of the primary lookup table of the Huffman decoder.
const HUFF_PEEK: u32 = 11;

/// The entropy-code alternative (issue 30): the high-byte plane of `raw` as a canonical Huffman
/// code in independent chunks of 64 Ki weights, decoded by a table-driven decoder (an 11-bit
/// lookup, a canonical search for longer codes) at 1 and 2 threads; prints weights/s and the
/// coded size. Exits 1 if a decode differs from the plane.
fn huffman_decode_rate(args: &Args, pools: &[rayon::ThreadPool], raw: &[u8]) {
    let plane: Vec<u8> = raw.chunks_exact(2).map(|p| p[1]).collect();
    let mut counts = [0u64; 256];
    plane.iter().for_each(|&b| counts[b as usize] += 1);
    let len = k3_proto::ecbf16::huffman_lengths(&counts);
    // Canonical codes: by (length, symbol).
    let mut order: Vec<u8> = (0..=255u8).filter(|&s| len[s as usize] > 0).collect();
    order.sort_by_key(|&s| (len[s as usize], s));
    let mut code = [0u32; 256];
    let (mut c, mut prev) = (0u32, 0u8);
    for (i, &s) in order.iter().enumerate() {
        let l = len[s as usize];
        if i > 0 {
            c = (c + 1) << (l - prev);
        }
        code[s as usize] = c;
        prev = l;
    }
    // Primary table: peek HUFF_PEEK bits (MSB first) -> (symbol, length); 0 length = longer code.
    let mut table = vec![(0u8, 0u8); 1 << HUFF_PEEK];
    for &s in &order {
        let l = len[s as usize] as u32;
        if l <= HUFF_PEEK {
            let base = (code[s as usize] << (HUFF_PEEK - l)) as usize;
            for e in &mut table[base..base + (1 << (HUFF_PEEK - l))] {
                *e = (s, l as u8);
            }
        }
    }
    const CHUNK: usize = 1 << 16;
    // Encode: each chunk is a big-endian bit stream padded to whole u64 words, plus 8 zero bytes.
    let chunks: Vec<Vec<u8>> = plane
        .chunks(CHUNK)
        .map(|syms| {
            let mut out = Vec::new();
            let (mut acc, mut nbits) = (0u128, 0u32);
            for &s in syms {
                acc = (acc << len[s as usize]) | code[s as usize] as u128;
                nbits += len[s as usize] as u32;
                while nbits >= 8 {
                    out.push((acc >> (nbits - 8)) as u8);
                    nbits -= 8;
                }
            }
            if nbits > 0 {
                out.push((acc << (8 - nbits)) as u8);
            }
            out.extend_from_slice(&[0u8; 16]);
            out
        })
        .collect();
    let coded_bytes: usize = chunks.iter().map(|c| c.len() - 16).sum();
    let decode = |bits: &[u8], out: &mut [u8]| {
        let mut pos = 0usize; // bit position
        for o in out.iter_mut() {
            let byte = pos / 8;
            let w = u64::from_be_bytes(bits[byte..byte + 8].try_into().expect("8 bytes"));
            let window = w << (pos % 8);
            let (s, l) = table[(window >> (64 - HUFF_PEEK)) as usize];
            if l > 0 {
                *o = s;
                pos += l as usize;
            } else {
                // Canonical search over the longer codes.
                let mut found = false;
                for &sym in &order {
                    let l = len[sym as usize] as u32;
                    if l > HUFF_PEEK && (window >> (64 - l)) as u32 == code[sym as usize] {
                        *o = sym;
                        pos += l as usize;
                        found = true;
                        break;
                    }
                }
                assert!(found, "huffman: no code matches");
            }
        }
    };
    let mut out = vec![0u8; plane.len()];
    for (pool, &threads) in pools.iter().zip(&THREADS) {
        let s = time(args.reps, threads, || {
            pool.install(|| {
                out.par_chunks_mut(CHUNK)
                    .zip(chunks.par_iter())
                    .for_each(|(o, bits)| decode(bits, o));
            });
            black_box(&out);
        });
        if out != plane {
            eprintln!("CHECK FAILED: Huffman decode differs from the high-byte plane");
            std::process::exit(1);
        }
        let (g, lo, hi) = rate(plane.len() as f64 / 1e9, s);
        println!(
            "Huffman high-byte plane ({:.3} bits/weight + 8 raw = {:.4} of raw bf16): decode {threads} thread(s) {g:.3} G weights/s ({lo:.3}–{hi:.3}) = {:.2} GB/s of raw bf16, cpu share {:.2}",
            8.0 * coded_bytes as f64 / plane.len() as f64,
            (plane.len() + coded_bytes) as f64 / raw.len() as f64,
            2.0 * g,
            s.cpu_share
        );
    }
}

/// One MXFP4 sweep row: the product of `n` tokens cycled over the experts.
#[allow(clippy::too_many_arguments)]
fn mxfp4_row(
    args: &Args,
    experts: &[Expert],
    k: Kernels,
    threads: usize,
    n: usize,
    label: &str,
    mem_at: &(dyn Fn(usize) -> f64 + Sync),
    peak_at: &(dyn Fn(Tier, usize) -> f64 + Sync),
    rows: &mut Vec<Row>,
) {
    let (er, ec) = (3072usize, 3584usize);
    let x = vec![0.25f32; n * ec];
    let mut y = vec![0.0f32; n * er];
    let s = time(args.reps, threads, || {
        for e in experts {
            k.matmul_mxfp4(black_box(&e.packed), &e.scales, er, ec, &x, n, &mut y);
            black_box(&y);
        }
    });
    rows.push(Row {
        kernel: format!("mxfp4 {er}x{ec} K={n}{label}"),
        tier: k.tier(),
        threads,
        stat: per_expert(s),
        bytes: (er * ec / 2 + er * ec / 32) as f64,
        macs: (er * ec * n) as f64,
        mem_gbs: mem_at(threads),
        peak_gmacs: peak_at(k.tier(), threads),
    });
}
