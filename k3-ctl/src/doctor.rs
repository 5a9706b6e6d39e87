//! `k3-ctl doctor`: what this machine can do for k3.
//!
//! - CPU model, logical cores, the SIMD tiers the kernels can use here (and the one `K3_SIMD` /
//!   auto-detection picks).
//! - RAM: `MemTotal` / `MemAvailable` and the recommended preset: the largest whose full-scale
//!   memory plan ([`k3_store::runtime::plan::MemoryPlan`]) fits `MemAvailable`.
//! - Disk bandwidth measured the way the engine reads: `O_DIRECT` random reads of one expert
//!   (17,547,264 bytes) through [`k3_store::runtime::io::DiskFile`] at queue depth 1 and 16 (16 reader
//!   threads; also 8, the standalone expert cache's reader count), sequential large `O_DIRECT` reads, and buffered reads of expert-sized chunks
//!   after `posix_fadvise(DONTNEED)`; each as MB/s median and min–max over rounds.
//!
//! - Kernel figures per SIMD tier this CPU has, each named with the CPU model and the tier:
//!   the FMA peak of one thread, and bf16, EC-BF16 (width 4) and MXFP4 matvec rates on a 64 MiB
//!   matrix at the kernels' thread count (`--no-kernels` skips them).
//!
//! `--dir PATH`: a directory gets a scratch file (written, fsynced, dropped from the page cache,
//! measured, deleted); a regular file is measured in place, read-only (e.g. a checkpoint shard).

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod cpu;

use cpu::cpu_model;
use k3_store::runtime::io::{AlignedBuf, DiskFile, ALIGN};
use k3_store::runtime::plan::{Budget, BudgetFlag, MemoryPlan, PRESETS};
use k3_store::runtime::trunk::{remove_stale_temporaries, temp_name, Interrupt};
use serde_json::{json, Value};

use crate::fail::Failed;

/// Bytes of one routed expert at full scale (MXFP4 w1/w2/w3 + scales): one engine read.
pub const EXPERT_BYTES: u64 = 17_547_264;
/// Reader threads for the queue-depth-16 figure.
const QD_HIGH: usize = 16;
/// Reader threads of the standalone expert cache (`StandaloneOptions::io_threads`).
const QD_ENGINE: usize = 8;
/// Sequential read size.
const SEQ_CHUNK: u64 = 64 << 20;
/// Timed rounds per measurement (median and min–max are over these).
const ROUNDS: usize = 5;

/// Arguments of `k3-ctl doctor`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Directory (a scratch file is created there and deleted) or existing file (read in place)
    /// to measure disk bandwidth on; default the current directory.
    #[arg(long, value_name = "PATH", default_value = ".")]
    dir: PathBuf,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// Seconds per disk measurement (5 rounds each).
    #[arg(long, value_name = "N", default_value_t = 2.0)]
    seconds: f64,
    /// Size of the scratch file in MiB (directories only).
    #[arg(long, value_name = "MIB", default_value_t = 2048)]
    size_mib: u64,
    /// Skip the disk measurements.
    #[arg(long)]
    no_disk: bool,
    /// Skip the kernel measurements.
    #[arg(long)]
    no_kernels: bool,
    /// Bytes of each expert-sized read (the random and the buffered measurements; rounded up to
    /// whole 4096-byte pages): default one routed expert of the full model. A checkpoint with
    /// other experts is read at its own size (`scripts/bench.py` passes it): small reads cost the
    /// disk's latency, not its bandwidth.
    #[arg(long, value_name = "BYTES", default_value_t = EXPERT_BYTES)]
    read_bytes: u64,
}

/// Largest `--read-bytes`.
const MAX_READ_BYTES: u64 = 1 << 30;

/// Bytes of the scratch file for `--size-mib` (at least 64 MiB).
fn scratch_bytes(size_mib: u64) -> u64 {
    size_mib.max(64) << 20
}

/// (preset name, full-scale plan total bytes), smallest first.
pub fn preset_needs() -> Vec<(&'static str, u64)> {
    preset_needs_of(&k3_store::runtime::plan::full_scale_inputs(4096))
}

/// [`preset_needs`] with an ecbf16-coded trunk (`pack-trunk --codec ecbf16`, its layers
/// estimated at `plan::ECBF16_TRUNK_RATIO` of raw).
pub fn preset_needs_coded() -> Vec<(&'static str, u64)> {
    use k3_store::runtime::plan::{full_scale_inputs, ECBF16_TRUNK_RATIO};
    preset_needs_of(&full_scale_inputs(4096).with_coded_trunk(ECBF16_TRUNK_RATIO))
}

fn preset_needs_of(inputs: &k3_store::runtime::plan::PlanInputs) -> Vec<(&'static str, u64)> {
    PRESETS
        .iter()
        .filter_map(|p| {
            let b = Budget::from_flags(&[BudgetFlag::Preset(p.name.into())]).ok()?;
            Some((p.name, MemoryPlan::compute(inputs, &b).total_bytes()))
        })
        .collect()
}

/// The largest preset whose full-scale plan fits `available` bytes.
pub fn recommend(needs: &[(&'static str, u64)], available: u64) -> Option<&'static str> {
    needs
        .iter()
        .filter(|(_, n)| *n <= available)
        .max_by_key(|(_, n)| *n)
        .map(|(name, _)| *name)
}

/// Median, min and max of a non-empty list.
pub fn summarize(v: &[f64]) -> (f64, f64, f64) {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let med = if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    };
    (med, s[0], s[n - 1])
}

/// `(total, available)` bytes of memory: `/proc/meminfo`'s `MemTotal` and `MemAvailable`; on
/// macOS `hw.memsize` and the memory plan's VM-counter figure.
fn memory_totals() -> (Option<u64>, Option<u64>) {
    #[cfg(target_vendor = "apple")]
    return (
        k3_store::sys::sysctl_uint("hw.memsize").ok(),
        k3_store::runtime::plan::mem_available().ok(),
    );
    #[cfg(not(target_vendor = "apple"))]
    return (
        meminfo_kb("MemTotal").map(|k| k * 1024),
        meminfo_kb("MemAvailable").map(|k| k * 1024),
    );
}

#[cfg(not(target_vendor = "apple"))]
fn meminfo_kb(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|r| r.trim().trim_end_matches("kB").trim().parse().ok())
}

fn rustc_version() -> Option<String> {
    let out = std::process::Command::new("rustc")
        .arg("--version")
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// (mount source, mount point, fs type) of the filesystem holding `path` (longest mount-point
/// prefix in /proc/mounts).
fn mount_of(path: &Path) -> Option<(String, String, String)> {
    let p = std::fs::canonicalize(path).ok()?;
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 3).then(|| (f[0].to_string(), f[1].to_string(), f[2].to_string()))
        })
        .filter(|(_, mp, _)| p.starts_with(mp))
        .max_by_key(|(_, mp, _)| mp.len())
}

/// Whether this system can drop one file's pages from the page cache ([`drop_cache`]).
const DROPS_CACHE: bool = cfg!(target_os = "linux");

/// Drop `f`'s pages from the page cache (best effort; the answer says whether it worked: never
/// on macOS, which has no per-file way).
fn drop_cache(f: &File) -> bool {
    #[cfg(target_os = "linux")]
    {
        use nix::fcntl::{posix_fadvise, PosixFadviseAdvice};
        posix_fadvise(f, 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED).is_ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = f;
        false
    }
}

/// Drop `[off, off+len)` of `f` from the page cache (best effort; Linux only).
fn drop_range(f: &File, off: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use nix::fcntl::{posix_fadvise, PosixFadviseAdvice};
        let (Ok(off), Ok(len)) = (i64::try_from(off), i64::try_from(len)) else {
            return;
        };
        let _ = posix_fadvise(f, off, len, PosixFadviseAdvice::POSIX_FADV_DONTNEED);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (f, off, len);
}

/// A tiny xorshift generator (offsets and scratch contents; no statistical claims).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// The scratch file's name (its temporary name adds the pid: `.k3-doctor.PID.tmp`).
const SCRATCH: &str = "k3-doctor";

/// The scratch file: deleted on drop.
struct Scratch(PathBuf);
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn free_bytes(dir: &Path) -> Option<u64> {
    let st = nix::sys::statvfs::statvfs(dir).ok()?;
    #[allow(clippy::unnecessary_cast)] // u32 on macOS, u64 on Linux
    Some((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
}

/// Why the disk could not be measured (exit 1; the other sections are still reported).
#[derive(Debug, thiserror::Error)]
enum DiskError {
    /// Too little free space for the scratch file.
    #[error(
        "{}: {:.2} GB free, the {:.2} GB scratch file needs twice that to leave room \
         (use --size-mib)",
        dir.display(), *free as f64 / 1e9, *size as f64 / 1e9
    )]
    NoRoom {
        /// The directory.
        dir: PathBuf,
        /// Bytes free.
        free: u64,
        /// Bytes of the scratch file.
        size: u64,
    },
    /// A file operation failed: what, on which path.
    #[error("{what}{}: {source}", path.display())]
    File {
        /// What was being done (`"cannot create "`, `"writing "`, `"fsync "`, or nothing).
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is too small for the reads.
    #[error("{}: {len} bytes is too small for {read}-byte random reads", path.display())]
    TooSmall {
        /// The file.
        path: PathBuf,
        /// Its bytes.
        len: u64,
        /// Bytes per read.
        read: u64,
    },
    /// The file is empty.
    #[error("{}: empty file", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// A read failed.
    #[error(transparent)]
    Read(#[from] k3_store::runtime::io::ReadError),
    /// No buffer for the reads.
    #[error(transparent)]
    Alloc(#[from] k3_store::runtime::io::AllocError),
    /// No shared memory for the store-destination reads.
    #[error("shared memory for the store-destination reads: {0}")]
    Shm(#[source] std::io::Error),
    /// A reader thread panicked.
    #[error("reader panicked")]
    Panicked,
    /// SIGINT or SIGTERM while the scratch file was written (it was removed).
    #[error("interrupted by {0}; the scratch file was removed")]
    Interrupted(&'static str),
}

impl DiskError {
    fn file<'a>(
        what: &'static str,
        path: &'a Path,
    ) -> impl FnOnce(std::io::Error) -> DiskError + 'a {
        move |source| DiskError::File {
            what,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Write a scratch file of `size` bytes of non-constant data in `dir`, fsync it and drop it
/// from the page cache.
fn make_scratch(dir: &Path, size: u64) -> Result<Scratch, DiskError> {
    if let Some(free) = free_bytes(dir) {
        if free < size.saturating_mul(2) {
            return Err(DiskError::NoRoom {
                dir: dir.to_path_buf(),
                free,
                size,
            });
        }
    }
    // A scratch file a killed doctor left (its pid gone) is removed first; this one is removed
    // on an error, a SIGINT or a SIGTERM while it is written, and unlinked once it is open for
    // the reads (so a kill then leaves nothing).
    for p in remove_stale_temporaries(dir, &[SCRATCH]) {
        tracing::info!("removed {}, left by a doctor that is gone", p.display());
    }
    let stop = Interrupt::on_signals().map_err(DiskError::file("signal handlers for ", dir))?;
    let path = dir.join(temp_name(SCRATCH, std::process::id()));
    let scratch = Scratch(path.clone());
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(DiskError::file("cannot create ", &path))?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let chunk = 8usize << 20;
    let mut buf = vec![0u8; chunk];
    let mut left = size;
    while left > 0 {
        if let Some(sig) = stop.signal() {
            return Err(DiskError::Interrupted(sig));
        }
        for w in buf.chunks_exact_mut(8) {
            w.copy_from_slice(&rng.next().to_le_bytes());
        }
        let n = left.min(chunk as u64) as usize;
        f.write_all(&buf[..n])
            .map_err(DiskError::file("writing ", &path))?;
        left -= n as u64;
    }
    f.sync_all().map_err(DiskError::file("fsync ", &path))?;
    drop_cache(&f);
    Ok(scratch)
}

/// One disk measurement: MB/s per round, and what was read.
struct Measure {
    name: &'static str,
    what: String,
    mbps: Vec<f64>,
    direct: bool,
}

impl Measure {
    fn to_json(&self) -> Value {
        let (m, lo, hi) = summarize(&self.mbps);
        json!({"name": self.name, "what": self.what, "direct": self.direct,
               "mb_per_s": {"median": m, "min": lo, "max": hi}, "rounds": self.mbps})
    }
}

/// Random `len`-byte reads at 4 KiB-aligned offsets with `threads` readers, `ROUNDS` rounds of
/// `round` each.
fn random_reads(
    file: &DiskFile,
    len: u64,
    threads: usize,
    round: Duration,
    uncache: Option<&File>,
) -> Result<Vec<f64>, DiskError> {
    let span = file.len().saturating_sub(len) / ALIGN as u64;
    if span == 0 {
        return Err(DiskError::TooSmall {
            path: file.path().to_path_buf(),
            len: file.len(),
            read: len,
        });
    }
    let mut out = Vec::with_capacity(ROUNDS);
    for r in 0..ROUNDS {
        let t0 = Instant::now();
        let results: Vec<Result<u64, DiskError>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    s.spawn(move || -> Result<u64, DiskError> {
                        let mut buf = AlignedBuf::zeroed(len as usize + ALIGN)?;
                        let mut rng = Rng(0x1234_5678 + (r * 1000 + t) as u64 * 7919);
                        let mut bytes = 0u64;
                        loop {
                            let off = (rng.next() % span) * ALIGN as u64;
                            file.read_span(off, len, buf.as_mut_slice())?;
                            if let Some(f) = uncache {
                                // A later read of the same range must come from the disk too.
                                drop_range(f, off, len);
                            }
                            bytes += len;
                            if t0.elapsed() >= round {
                                return Ok(bytes);
                            }
                        }
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(Err(DiskError::Panicked)))
                .collect()
        });
        let secs = t0.elapsed().as_secs_f64();
        let mut bytes = 0;
        for x in results {
            bytes += x?;
        }
        out.push(bytes as f64 / 1e6 / secs);
    }
    Ok(out)
}

/// Sequential `chunk`-byte reads from offset 0 (wrapping), one reader.
fn sequential_reads(
    file: &DiskFile,
    chunk: u64,
    round: Duration,
    before: &dyn Fn(),
) -> Result<Vec<f64>, DiskError> {
    let chunk = seq_chunk(file, chunk)?;
    let mut buf = AlignedBuf::zeroed(chunk as usize + ALIGN)?;
    sequential_reads_into(file, chunk, round, before, buf.as_mut_slice())
}

/// The sequential read size for `file`: `chunk`, or the whole file (in [`ALIGN`] units) if it is
/// smaller.
fn seq_chunk(file: &DiskFile, chunk: u64) -> Result<u64, DiskError> {
    let chunk = chunk.min(file.len() / ALIGN as u64 * ALIGN as u64);
    if chunk == 0 {
        return Err(DiskError::Empty {
            path: file.path().to_path_buf(),
        });
    }
    Ok(chunk)
}

/// [`sequential_reads`] into the store's kind of memory: a memfd segment
/// ([`k3_store::shmem::Segment`], which asks for huge pages where the kernel allows them).
fn sequential_reads_shm(
    file: &DiskFile,
    chunk: u64,
    round: Duration,
) -> Result<Vec<f64>, DiskError> {
    let chunk = seq_chunk(file, chunk)?;
    let mut seg = k3_store::shmem::Segment::create("k3-doctor", chunk + ALIGN as u64)
        .map_err(DiskError::Shm)?;
    sequential_reads_into(file, chunk, round, &|| {}, seg.bytes_mut())
}

fn sequential_reads_into(
    file: &DiskFile,
    chunk: u64,
    round: Duration,
    before: &dyn Fn(),
    buf: &mut [u8],
) -> Result<Vec<f64>, DiskError> {
    let mut out = Vec::with_capacity(ROUNDS);
    let mut off = 0u64;
    for _ in 0..ROUNDS {
        before();
        let t0 = Instant::now();
        let mut bytes = 0u64;
        while t0.elapsed() < round {
            if off + chunk > file.len() {
                off = 0;
            }
            file.read_span(off, chunk, buf)?;
            off += chunk;
            bytes += chunk;
        }
        out.push(bytes as f64 / 1e6 / t0.elapsed().as_secs_f64());
    }
    Ok(out)
}

/// Measure the disk holding `target` (a directory gets a scratch file).
/// What `measure_disk` reads: a scratch file it writes in a directory (deleted on drop), or the
/// file it is given, read in place; with a note for the report.
fn file_to_read(a: &Args) -> Result<(Option<Scratch>, PathBuf, String), DiskError> {
    let meta = std::fs::metadata(&a.dir).map_err(DiskError::file("", &a.dir))?;
    if !meta.is_dir() {
        return Ok((None, a.dir.clone(), "existing file, read in place".into()));
    }
    let size = scratch_bytes(a.size_mib);
    let t0 = Instant::now();
    let s = make_scratch(&a.dir, size)?;
    let p = s.0.clone();
    let note = format!(
        "scratch file of {} MiB written and fsynced in {:.1} s (deleted afterwards)",
        size >> 20,
        t0.elapsed().as_secs_f64()
    );
    Ok((Some(s), p, note))
}

fn measure_disk(a: &Args) -> Result<Value, DiskError> {
    let (_scratch, file_path, scratch_note) = file_to_read(a)?;
    let round = Duration::from_secs_f64((a.seconds / ROUNDS as f64).max(0.05));
    let direct = DiskFile::open(&file_path)?;
    let is_direct = direct.is_direct();
    let buffered = DiskFile::open_with(&file_path, false)?;
    let plain = File::open(&file_path).map_err(DiskError::file("", &file_path))?;
    // Every handle the measurements read through is open: the scratch file's name goes now
    // (its bytes stay until the handles close), so nothing is left whatever ends the process.
    drop(_scratch);
    let dropper = || {
        drop_cache(&plain);
    };
    let mut ms = Vec::new();
    // Seven measurements of --seconds each: a bar on a terminal, log lines otherwise.
    let mut bar = k3_store::progress::Progress::new("measuring the disk", 7, false);
    let mode = match (is_direct, direct.read_mode()) {
        (false, "buffered reads") => "buffered (O_DIRECT refused)",
        (_, m) => m,
    };
    // Whole pages, as the engine's O_DIRECT span of an expert is.
    let rb = a.read_bytes.next_multiple_of(ALIGN as u64);
    ms.push(Measure {
        name: "random_qd1",
        what: format!("{rb}-byte random reads, 1 reader, {mode}"),
        mbps: random_reads(&direct, rb, 1, round, None)?,
        direct: is_direct,
    });
    bar.set(ms.len() as u64);
    ms.push(Measure {
        name: "random_qd8",
        what: format!(
            "{rb}-byte random reads, {QD_ENGINE} reader threads (the standalone expert cache's \
             readers), {mode}"
        ),
        mbps: random_reads(&direct, rb, QD_ENGINE, round, None)?,
        direct: is_direct,
    });
    bar.set(ms.len() as u64);
    ms.push(Measure {
        name: "random_qd16",
        what: format!("{rb}-byte random reads, {QD_HIGH} reader threads, {mode}"),
        mbps: random_reads(&direct, rb, QD_HIGH, round, None)?,
        direct: is_direct,
    });
    bar.set(ms.len() as u64);
    ms.push(Measure {
        name: "sequential_direct",
        what: format!("{} MiB sequential reads, 1 reader, {mode}", SEQ_CHUNK >> 20),
        mbps: sequential_reads(&direct, SEQ_CHUNK, round, &|| {})?,
        direct: is_direct,
    });
    bar.set(ms.len() as u64);
    ms.push(Measure {
        name: "sequential_direct_shm",
        what: format!(
            "{} MiB sequential reads into shared memory (a memfd, as the store reads; huge pages \
             only where shmem_enabled allows: now {}), 1 reader, {mode}",
            SEQ_CHUNK >> 20,
            k3_store::shmem::shmem_huge_pages().unwrap_or_else(|| "unknown".into())
        ),
        mbps: sequential_reads_shm(&direct, SEQ_CHUNK, round)?,
        direct: is_direct,
    });
    bar.set(ms.len() as u64);
    ms.push(Measure {
        name: "sequential_buffered",
        what: format!(
            "{rb}-byte sequential buffered reads, 1 reader, {}",
            if DROPS_CACHE {
                "page cache dropped (posix_fadvise DONTNEED) before each round"
            } else {
                "page cache NOT dropped (no per-file way on this system): may be cache hits"
            }
        ),
        mbps: sequential_reads(&buffered, rb, round, &dropper)?,
        direct: false,
    });
    bar.set(ms.len() as u64);
    dropper();
    ms.push(Measure {
        name: "random_buffered_qd1",
        what: format!(
            "{rb}-byte random buffered reads, 1 reader, {}",
            if DROPS_CACHE {
                "each range dropped from the page cache after its read"
            } else {
                "page cache NOT dropped (no per-file way on this system): may be cache hits"
            }
        ),
        mbps: random_reads(&buffered, rb, 1, round, Some(&plain))?,
        direct: false,
    });
    bar.set(ms.len() as u64);
    dropper();
    let mount = mount_of(&file_path);
    Ok(json!({
        "path": file_path.display().to_string(),
        "file_bytes": direct.len(),
        "note": scratch_note,
        "filesystem": mount.as_ref().map(|(src, mp, ty)| json!({"source": src, "mount": mp, "type": ty})),
        "device": plain.metadata().ok().map(|m| device_name(m.dev())),
        "seconds_per_measurement": a.seconds,
        "read_bytes": rb,
        "rounds": ROUNDS,
        "measurements": ms.iter().map(Measure::to_json).collect::<Vec<_>>(),
    }))
}

/// `major:minor` of a device number (Linux), or the number itself elsewhere.
fn device_name(dev: u64) -> String {
    #[cfg(target_os = "linux")]
    return format!(
        "{}:{}",
        nix::sys::stat::major(dev),
        nix::sys::stat::minor(dev)
    );
    #[cfg(not(target_os = "linux"))]
    return format!("{dev:#x}");
}

/// Run `k3-ctl doctor`.
pub fn run(a: Args) -> Result<i32, Failed> {
    if !(a.seconds.is_finite() && a.seconds > 0.0 && a.seconds <= 600.0) {
        return Err(Failed::refused("--seconds must be in (0, 600]"));
    }
    if !a.no_disk {
        std::fs::metadata(&a.dir).map_err(|e| {
            Failed::with_code(
                format!("--dir {}", a.dir.display()),
                k3_proto::exit::REFUSED,
                e,
            )
        })?;
    }
    if a.size_mib > (1 << 20) {
        return Err(Failed::refused("--size-mib at most 1048576"));
    }
    if !(1..=MAX_READ_BYTES).contains(&a.read_bytes) {
        return Err(Failed::refused(format!(
            "--read-bytes must be in [1, {MAX_READ_BYTES}]"
        )));
    }
    if !a.no_disk && a.dir.is_dir() && a.read_bytes > scratch_bytes(a.size_mib) / 2 {
        return Err(Failed::refused(format!(
            "--read-bytes {} needs a scratch file of at least twice that; \
             --size-mib {} gives {} bytes",
            a.read_bytes,
            a.size_mib,
            scratch_bytes(a.size_mib)
        )));
    }
    let tiers: Vec<Value> = k3_worker::kernels::Tier::ALL
        .iter()
        .map(|t| json!({"tier": t.name(), "available": t.is_available()}))
        .collect();
    let active = match k3_worker::kernels::select_tier() {
        Ok(t) => t.name().to_string(),
        Err(e) => format!("error: {e}"),
    };
    let (total, avail) = memory_totals();
    let needs = preset_needs();
    let rec = avail.and_then(|a| recommend(&needs, a));
    let mut doc = json!({
        "cpu": {"model": cpu_model(),
                "logical_cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
                "simd_tiers": tiers, "active_tier": active},
        "toolchain": {"rustc": rustc_version(),
                      "k3_version": env!("CARGO_PKG_VERSION"),
                      "k3_build": if cfg!(debug_assertions) { "debug" } else { "release" }},
        "memory": {"total_bytes": total, "available_bytes": avail,
                   "preset_plan_totals_bytes": needs.iter().map(|(n, b)| json!({"preset": n, "bytes": b})).collect::<Vec<_>>(),
                   "preset_plan_totals_ecbf16_bytes": preset_needs_coded().iter().map(|(n, b)| json!({"preset": n, "bytes": b})).collect::<Vec<_>>(),
                   "ecbf16_trunk_ratio": k3_store::runtime::plan::ECBF16_TRUNK_RATIO,
                   "recommended_preset": rec,
                   "shmem_enabled": k3_store::shmem::shmem_huge_pages()},
    });
    if !a.json {
        print_head(&doc);
    }
    if !a.no_kernels {
        doc["kernels"] = measure_kernels();
        if !a.json {
            print_kernels(&doc["kernels"]);
        }
    }
    let outcome = if a.no_disk {
        Ok(k3_proto::exit::OK)
    } else {
        if !a.json {
            println!(
                "disk: measuring on {} ({} s per measurement)…",
                a.dir.display(),
                a.seconds
            );
        }
        match measure_disk(&a) {
            Ok(d) => {
                if !a.json {
                    print_disk(&d);
                }
                doc["disk"] = d;
                Ok(k3_proto::exit::OK)
            }
            Err(e) => {
                doc["disk"] = json!({"error": e.to_string()});
                Err(Failed::with_code("disk", k3_proto::exit::FAILURE, e))
            }
        }
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
    }
    outcome
}

/// Kernel rates per available tier on this machine (each figure names the CPU and the tier):
/// one thread's FMA peak, and matvec rates on a 4096×8192 matrix (64 MiB as bf16) at the
/// kernels' thread count, bf16, EC-BF16 width 4 (Gaussian-like weights: a trained matrix's few
/// exponents) and MXFP4, best of 5 runs. The coded result is checked against the raw one.
pub fn measure_kernels() -> Value {
    use k3_proto::ecbf16::{encode, CodedMatrix};
    use k3_worker::kernels::{Kernels, Tier};
    let (rows, cols) = (4096usize, 8192usize);
    let mut z = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        z ^= z << 13;
        z ^= z >> 7;
        z ^= z << 17;
        z
    };
    // Exponents 117..=124 (σ ≈ 2^-5 and below), random sign and mantissa.
    let w: Vec<u8> = (0..rows * cols)
        .flat_map(|_| {
            let r = next();
            let e = 117 + (r >> 40) % 8;
            (((r & 1) << 15 | e << 7 | (r >> 8) & 0x7F) as u16).to_le_bytes()
        })
        .collect();
    let coded = encode(&w, rows, cols, 4).expect("a 4096x8192 matrix encodes");
    let m = CodedMatrix::parse(&coded).expect("just encoded");
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|_| 118 + (next() % 8) as u8)
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
    let best = |f: &mut dyn FnMut()| {
        f();
        (0..5)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let cpu = cpu_model();
    let threads = rayon::current_num_threads();
    let mut out = Vec::new();
    for k in Tier::ALL.into_iter().filter_map(Kernels::new) {
        let iters = 2_000_000usize;
        let t = best(&mut || {
            std::hint::black_box(k.fma_probe(std::hint::black_box(iters)));
        });
        let fma = k.fma_probe(1).0 as f64 * iters as f64 / t / 1e9;
        let mut y = vec![0.0f32; rows];
        let mut yc = vec![0.0f32; rows];
        let t_raw = best(&mut || k.matvec_bf16(&w, rows, cols, &x, &mut y));
        let t_coded = best(&mut || k.matvec_coded(&m, &x, &mut yc));
        let same = y.iter().zip(&yc).all(|(a, b)| a.to_bits() == b.to_bits());
        let t_mx = best(&mut || k.matvec_mxfp4(&packed, &scales, rows, cols, &x, &mut y));
        let weights = (rows * cols) as f64;
        out.push(json!({
            "cpu": cpu, "tier": k.tier().name(), "threads": threads,
            "fma_peak_gmac_per_s_1thread": fma,
            "bf16_matvec_gb_per_s": 2.0 * weights / t_raw / 1e9,
            "ecbf16_w4_matvec_gb_per_s": coded.len() as f64 / t_coded / 1e9,
            "ecbf16_w4_matvec_gweights_per_s": weights / t_coded / 1e9,
            "bf16_matvec_gweights_per_s": weights / t_raw / 1e9,
            "ecbf16_equals_bf16": same,
            "mxfp4_matvec_gb_per_s": (packed.len() + scales.len()) as f64 / t_mx / 1e9,
        }));
    }
    Value::Array(out)
}

fn print_kernels(k: &Value) {
    for t in k.as_array().into_iter().flatten() {
        let f = |key: &str| t[key].as_f64().unwrap_or(f64::NAN);
        println!(
            "kernels [{} · {} · {} threads]: FMA peak {:.1} GMAC/s (1 thread) · matvec 4096x8192: bf16 {:.1} GB/s ({:.2} G weights/s), EC-BF16 w4 {:.1} GB/s ({:.2} G weights/s{}), MXFP4 {:.1} GB/s",
            t["cpu"].as_str().unwrap_or("?"),
            t["tier"].as_str().unwrap_or("?"),
            t["threads"],
            f("fma_peak_gmac_per_s_1thread"),
            f("bf16_matvec_gb_per_s"),
            f("bf16_matvec_gweights_per_s"),
            f("ecbf16_w4_matvec_gb_per_s"),
            f("ecbf16_w4_matvec_gweights_per_s"),
            if t["ecbf16_equals_bf16"].as_bool() == Some(true) { ", same bits" } else { ", BITS DIFFER" },
            f("mxfp4_matvec_gb_per_s"),
        );
    }
}

fn print_head(d: &Value) {
    let c = &d["cpu"];
    let tiers: Vec<String> = c["simd_tiers"]
        .as_array()
        .map(|v| {
            v.iter()
                .map(|t| {
                    format!(
                        "{}{}",
                        t["tier"].as_str().unwrap_or("?"),
                        if t["available"].as_bool() == Some(true) {
                            ""
                        } else {
                            " (absent)"
                        }
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    println!(
        "cpu: {} | {} logical cores",
        c["model"].as_str().unwrap_or("?"),
        c["logical_cores"]
    );
    println!(
        "simd tiers: {} | kernels will use: {}",
        tiers.join(", "),
        c["active_tier"].as_str().unwrap_or("?")
    );
    let t = &d["toolchain"];
    println!(
        "toolchain: {} | k3 {} ({} build)",
        t["rustc"].as_str().unwrap_or("rustc not found"),
        t["k3_version"].as_str().unwrap_or("?"),
        t["k3_build"].as_str().unwrap_or("?")
    );
    let m = &d["memory"];
    let g = |v: &Value| {
        v.as_u64()
            .map_or("?".into(), |b| format!("{:.2} GB", b as f64 / 1e9))
    };
    println!(
        "ram: total {} | available {}",
        g(&m["total_bytes"]),
        g(&m["available_bytes"])
    );
    if let Some(rows) = m["preset_plan_totals_bytes"].as_array() {
        let s: Vec<String> = rows
            .iter()
            .map(|r| format!("{} {}", r["preset"].as_str().unwrap_or("?"), g(&r["bytes"])))
            .collect();
        println!("full-model plan totals (context 4096): {}", s.join(" · "));
    }
    if let Some(rows) = m["preset_plan_totals_ecbf16_bytes"].as_array() {
        let s: Vec<String> = rows
            .iter()
            .map(|r| format!("{} {}", r["preset"].as_str().unwrap_or("?"), g(&r["bytes"])))
            .collect();
        println!(
            "  with an ecbf16 trunk (layers x{}): {}",
            m["ecbf16_trunk_ratio"],
            s.join(" · ")
        );
    }
    match m["recommended_preset"].as_str() {
        Some(p) => println!(
            "recommended preset: {p} (the largest whose full-model plan fits MemAvailable)"
        ),
        None => println!("recommended preset: none — even `laptop` does not fit MemAvailable"),
    }
}

fn print_disk(d: &Value) {
    println!(
        "disk: {} ({}) — {}",
        d["path"].as_str().unwrap_or("?"),
        d["filesystem"]
            .get("source")
            .and_then(Value::as_str)
            .unwrap_or("?"),
        d["note"].as_str().unwrap_or("")
    );
    println!(
        "  {:<22} {:>10} {:>22}  what",
        "measurement", "MB/s med", "min–max"
    );
    for m in d["measurements"].as_array().into_iter().flatten() {
        let r = &m["mb_per_s"];
        println!(
            "  {:<22} {:>10.0} {:>10.0}–{:<10.0}  {}",
            m["name"].as_str().unwrap_or("?"),
            r["median"].as_f64().unwrap_or(0.0),
            r["min"].as_f64().unwrap_or(0.0),
            r["max"].as_f64().unwrap_or(0.0),
            m["what"].as_str().unwrap_or("")
        );
    }
    if let Some(note) = shm_note(d) {
        println!("  note: {note}");
    }
}

/// When reads into shared memory (the store's destination) run clearly slower than into private
/// huge pages and the kernel gives shared memory no huge pages: the fix.
fn shm_note(d: &Value) -> Option<String> {
    shm_note_under(d, &k3_store::shmem::shmem_huge_pages()?)
}

/// [`shm_note`] under the `shmem_enabled` mode `mode`.
fn shm_note_under(d: &Value, mode: &str) -> Option<String> {
    let med = |name: &str| {
        d["measurements"]
            .as_array()?
            .iter()
            .find(|m| m["name"] == name)?["mb_per_s"]["median"]
            .as_f64()
    };
    let (private, shm) = (med("sequential_direct")?, med("sequential_direct_shm")?);
    if k3_store::shmem::shmem_mode_gives_huge_pages(mode) || shm >= 0.8 * private {
        return None;
    }
    Some(format!(
        "reads into shared memory run at {:.0}% of reads into huge pages here \
         (/sys/kernel/mm/transparent_hugepage/shmem_enabled is {mode}); a store reads every \
         weight into shared memory: as root, `echo advise > \
         /sys/kernel/mm/transparent_hugepage/shmem_enabled` lets it ask for huge pages",
        100.0 * shm / private
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_totals_match_the_full_scale_plan() {
        let n = preset_needs();
        let names: Vec<_> = n.iter().map(|x| x.0).collect();
        assert_eq!(names, ["laptop", "desktop", "workstation", "server", "max"]);
        // Totals grow with the presets. Laptop: ring arena 3.00 (the whole trunk budget) +
        // lm_head 2.35 + 56 expert slots 0.98 + KDA state 0.46 + KV 0.23 + buffers 0.10 GB =
        // 7.12 GB (the embedding is mapped).
        for w in n.windows(2) {
            assert!(w[0].1 < w[1].1, "{n:?}");
        }
        assert!((7.05e9..7.20e9).contains(&(n[0].1 as f64)), "{n:?}");
        assert!((215e9..230e9).contains(&(n[4].1 as f64)), "{n:?}");
    }

    #[test]
    fn recommendation_is_the_largest_that_fits() {
        let n = preset_needs();
        assert_eq!(recommend(&n, 1_000_000_000), None);
        assert_eq!(recommend(&n, n[0].1), Some("laptop"));
        assert_eq!(recommend(&n, n[1].1 - 1), Some("laptop"));
        assert_eq!(recommend(&n, n[2].1 + 1), Some("workstation"));
        assert_eq!(recommend(&n, u64::MAX), Some("max"));
    }

    #[test]
    fn summary_is_median_min_max() {
        assert_eq!(summarize(&[3.0, 1.0, 2.0]), (2.0, 1.0, 3.0));
        assert_eq!(summarize(&[4.0, 1.0, 2.0, 3.0]), (2.5, 1.0, 4.0));
        assert_eq!(summarize(&[]), (0.0, 0.0, 0.0));
    }

    #[test]
    fn slow_shared_memory_reads_get_the_fix_only_when_the_kernel_withholds_huge_pages() {
        let d = |private: f64, shm: f64| {
            json!({"measurements": [
                {"name": "sequential_direct", "mb_per_s": {"median": private}},
                {"name": "sequential_direct_shm", "mb_per_s": {"median": shm}},
            ]})
        };
        let note = shm_note_under(&d(2610.0, 873.0), "never").unwrap();
        assert!(
            note.contains("33%") && note.contains("echo advise"),
            "{note}"
        );
        // Huge pages already allowed, or shared memory as fast: nothing to say.
        assert_eq!(shm_note_under(&d(2610.0, 873.0), "advise"), None);
        assert_eq!(shm_note_under(&d(2610.0, 2500.0), "never"), None);
        // A document without the measurement (an older doctor's JSON): nothing either.
        assert_eq!(shm_note_under(&json!({"measurements": []}), "never"), None);
    }

    /// `k3-ctl doctor --json --dir DIR --seconds 0.25 --size-mib 64 --read-bytes READ_BYTES`.
    fn small_args(dir: &std::path::Path, read_bytes: u64) -> Args {
        Args {
            dir: dir.to_path_buf(),
            json: true,
            seconds: 0.25,
            size_mib: 64,
            no_disk: false,
            no_kernels: true,
            read_bytes,
        }
    }

    #[test]
    fn kernel_figures_name_cpu_and_tier_and_coded_equals_raw_on_every_tier() {
        let k = measure_kernels();
        let tiers = k.as_array().expect("one entry per tier");
        let available = k3_worker::kernels::Tier::ALL
            .iter()
            .filter(|t| t.is_available())
            .count();
        assert_eq!(tiers.len(), available);
        for t in tiers {
            assert!(t["cpu"].as_str().is_some_and(|c| !c.is_empty()), "{t}");
            assert!(t["tier"].as_str().is_some(), "{t}");
            assert_eq!(t["ecbf16_equals_bf16"], json!(true), "{t}");
            for key in [
                "fma_peak_gmac_per_s_1thread",
                "bf16_matvec_gb_per_s",
                "ecbf16_w4_matvec_gb_per_s",
                "mxfp4_matvec_gb_per_s",
            ] {
                assert!(
                    t[key].as_f64().is_some_and(|v| v > 0.0 && v.is_finite()),
                    "{key}: {t}"
                );
            }
        }
    }

    #[test]
    fn a_read_size_of_zero_over_a_gib_or_over_half_the_scratch_file_is_refused_up_front() {
        let tmp = tempfile::tempdir().unwrap();
        // Over half the 64 MiB scratch file would leave no room to read at random.
        for read_bytes in [0, MAX_READ_BYTES + 1, (32 << 20) + 1] {
            let a = small_args(tmp.path(), read_bytes);
            let code = k3_proto::exit::report("k3-ctl doctor", run(a));
            assert_eq!(code, k3_proto::exit::REFUSED, "--read-bytes {read_bytes}");
        }
        // Refused before the scratch file was made.
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    #[test]
    fn disk_measurement_on_a_small_scratch_file() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        // A small checkpoint's expert (`small`: 52,224 bytes, read as 13 pages).
        let a = small_args(dir, 52_224);
        // A scratch file a killed doctor left (pid 2^22 + 1, above Linux's default pid_max) is
        // removed; a live process's (ours: the parent) is not.
        let dead = dir.join(temp_name(SCRATCH, (1 << 22) + 1));
        let live = dir.join(temp_name(SCRATCH, std::os::unix::process::parent_id()));
        std::fs::write(&dead, b"left").unwrap();
        std::fs::write(&live, b"busy").unwrap();
        let d = measure_disk(&a).unwrap();
        assert!(!dead.exists() && live.exists());
        std::fs::remove_file(&live).unwrap();
        assert_eq!(d["read_bytes"], 53_248);
        let ms = d["measurements"].as_array().unwrap();
        let names: Vec<_> = ms.iter().map(|m| m["name"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            [
                "random_qd1",
                "random_qd8",
                "random_qd16",
                "sequential_direct",
                "sequential_direct_shm",
                "sequential_buffered",
                "random_buffered_qd1"
            ]
        );
        for m in ms {
            assert!(m["mb_per_s"]["median"].as_f64().unwrap() > 0.0, "{m}");
            assert_eq!(m["rounds"].as_array().unwrap().len(), ROUNDS);
            let what = m["what"].as_str().unwrap();
            if !what.contains("MiB sequential") {
                assert!(what.starts_with("53248-byte "), "{what}");
            }
        }
        // The scratch file is gone.
        assert_eq!(std::fs::read_dir(dir).unwrap().count(), 0);
    }
}
