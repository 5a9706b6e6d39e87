//! Memory presets, budgets and the memory plan computed before anything is allocated.
//!
//! A [`Budget`] splits memory between the streamed trunk and the routed-expert cache (GB = 10⁹
//! bytes, as in kimi-k3-in-c's figures). The [`MemoryPlan`] turns it into concrete numbers —
//! how many trunk layers are pinned, how big the ring arena is, how many expert slots, the
//! per-sequence state — and compares the total with `MemAvailable`; a plan that does not fit is
//! refused (exit 2) with the whole plan and the shortfall printed.
//!
//! Trunk budget accounting: pinned layers + the ring arena. The model-level tensors (embedding,
//! lm_head, final norms) are their own line and are not charged to the trunk budget.

use crate::runtime::io::{align_down, align_up, ALIGN};
// The byte formats live apart (the expert cache prints them too, and the plan reads the cache's
// slot size); they are re-exported here, where callers have always found them.
pub use crate::runtime::units::{fmt_bytes, fmt_gb, fmt_mb, GB};

/// A named memory preset (README "Presets").
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Preset {
    /// Name used with `--preset`.
    pub name: &'static str,
    /// Trunk budget, GB.
    pub trunk_gb: f64,
    /// Expert-cache budget, GB.
    pub cache_gb: f64,
    /// Approximate peak RSS of a full-model run with the C engine, GB.
    pub peak_rss_gb: f64,
    /// What one prefill pass's buffers may take, GB: k3-worker's default prefill chunk is the
    /// longest whose pass fits (`--prefill-chunk auto`, SPEC.md §6.9), so a long prompt sweeps
    /// the routed experts as few times as this allows.
    pub prefill_gb: f64,
    /// One-line advice.
    pub note: &'static str,
}

/// The presets, smallest first.
pub const PRESETS: [Preset; 5] = [
    Preset {
        name: "laptop",
        trunk_gb: 3.0,
        cache_gb: 1.0,
        peak_rss_gb: 8.2,
        prefill_gb: 1.5,
        note: "8-16 GB machines; everything streams",
    },
    Preset {
        name: "desktop",
        trunk_gb: 16.0,
        cache_gb: 10.0,
        peak_rss_gb: 32.0,
        prefill_gb: 4.0,
        note: "32-64 GB",
    },
    Preset {
        name: "workstation",
        trunk_gb: 60.0,
        cache_gb: 30.0,
        peak_rss_gb: 95.0,
        prefill_gb: 8.0,
        note: "96-128 GB",
    },
    Preset {
        name: "server",
        trunk_gb: 110.0,
        cache_gb: 13.0,
        peak_rss_gb: 128.0,
        prefill_gb: 2.0,
        note: "128+ GB; whole trunk pinned; fastest",
    },
    Preset {
        name: "max",
        trunk_gb: 110.0,
        cache_gb: 109.0,
        peak_rss_gb: 224.0,
        prefill_gb: 16.0,
        note: "256 GB",
    },
];

/// Look a preset up by name.
pub fn preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

/// The presets as a table (what `k3-ctl presets` prints).
pub fn presets_table() -> String {
    let mut s =
        String::from("PRESET        TRUNK GB  CACHE GB  ~PEAK RSS GB  PINNED RAW/ECBF16  NOTE\n");
    let raw = full_scale_inputs(4096);
    let coded = raw.clone().with_coded_trunk(ECBF16_TRUNK_RATIO);
    for p in &PRESETS {
        let b = Budget::from_flags(&[BudgetFlag::Preset(p.name.into())]);
        let pinned = |i: &PlanInputs| {
            b.as_ref()
                .map_or(0, |b| MemoryPlan::compute(i, b).pinned_layers)
        };
        s.push_str(&format!(
            "{:<12} {:>9.1} {:>9.1} {:>13.1}  {:>8}/{:<8}  {}\n",
            p.name,
            p.trunk_gb,
            p.cache_gb,
            p.peak_rss_gb,
            pinned(&raw),
            pinned(&coded),
            p.note
        ));
    }
    s.push_str(&format!(
        "PINNED: full-model trunk layers (of 93) the preset pins with a raw trunk and with an \
         ecbf16 one\n(`k3-ctl pack-trunk --codec ecbf16`, estimated at {ECBF16_TRUNK_RATIO}x the \
         raw layer bytes); the rest stream.\n"
    ));
    s.push_str(
        "A later flag overrides an earlier one: --preset server --cache-gb 40.\n\
         Give the trunk memory before the expert cache (1.69x faster at 128 GB in kimi-k3-in-c).\n",
    );
    s
}

/// One memory flag, in command-line order.
#[derive(Clone, Debug, PartialEq)]
pub enum BudgetFlag {
    /// `--preset NAME`
    Preset(String),
    /// `--trunk-gb X`
    TrunkGb(f64),
    /// `--cache-gb X`
    CacheGb(f64),
}

/// How much memory the trunk and the expert cache may use.
#[derive(Clone, Debug, PartialEq)]
pub struct Budget {
    /// Pinned layers + ring arena.
    pub trunk_bytes: u64,
    /// Expert cache slots.
    pub cache_bytes: u64,
    /// What the budget came from, e.g. `server` or `server, --cache-gb 40`.
    pub label: String,
    /// `--preset auto` (implied when no budget flag is given): trunk and cache are chosen from
    /// the memory this process may allocate when the plan is made ([`Budget::fit`]).
    pub auto: bool,
    /// What one prefill pass's buffers may take: the last preset's `prefill_gb`; `None` with
    /// `--preset auto` (see [`Budget::prefill_allowance`]) or without a preset.
    pub prefill_bytes: Option<u64>,
}

/// Share of the memory `--preset auto` plans for ([`AUTO_SHARE`] of the allocatable memory)
/// that one prefill pass's buffers may take; the trunk and the cache share the rest
/// ([`Budget::fit`] counts the pass among the buffers).
pub const AUTO_PREFILL_SHARE: f64 = 0.125;

/// Share of the allocatable memory `--preset auto` plans for (the rest is left to the page
/// cache that O_DIRECT does not use, other processes and allocator slack).
pub const AUTO_SHARE: f64 = 0.85;

impl Budget {
    /// `--preset auto`, resolved later by [`Budget::fit`].
    pub fn auto() -> Budget {
        Budget {
            trunk_bytes: 0,
            cache_bytes: 0,
            label: "auto".into(),
            auto: true,
            prefill_bytes: None,
        }
    }

    /// The bytes one prefill pass's buffers may take under this budget (the auto prefill
    /// chunk is the longest whose pass fits): a preset's `prefill_gb`; with `--preset auto`,
    /// [`AUTO_PREFILL_SHARE`] of the [`AUTO_SHARE`] of `allocatable` (`None` when that is
    /// unknown); `None` for `--trunk-gb`/`--cache-gb` without a preset (the chunk then stays
    /// the fixed default).
    pub fn prefill_allowance(&self, allocatable: Option<u64>) -> Option<u64> {
        match (self.prefill_bytes, self.auto, allocatable) {
            (Some(b), _, _) => Some(b),
            (None, true, Some(a)) => Some((a as f64 * AUTO_SHARE * AUTO_PREFILL_SHARE) as u64),
            _ => None,
        }
    }

    /// The budget `--preset auto` picks for `inputs` given `allocatable` bytes: of
    /// `usable = AUTO_SHARE × allocatable − (resident tensors + sequence state + buffers)`, the
    /// trunk gets first call (SPEC.md §6: a pinned layer saves a full read per token, an expert
    /// slot only sometimes) — all of it when the whole trunk and top-k expert slots fit, else
    /// everything but top-k expert slots; the expert cache gets the rest, at most every expert.
    /// Never below the smallest runnable budget (a ring of the largest layer and top-k slots):
    /// when even that does not fit, the plan's check refuses with the shortfall.
    pub fn fit(inputs: &PlanInputs, allocatable: u64) -> Budget {
        let fixed = inputs
            .resident_bytes
            .saturating_add(inputs.state.bytes)
            .saturating_add(inputs.buffer_bytes);
        let usable = ((allocatable as f64 * AUTO_SHARE) as u64).saturating_sub(fixed);
        let ext = |b: u64| align_up(b).unwrap_or(u64::MAX);
        let whole_trunk: u64 = inputs.layer_bytes.iter().map(|&b| ext(b)).sum();
        let largest = inputs
            .layer_bytes
            .iter()
            .map(|&b| ext(b))
            .max()
            .unwrap_or(0);
        let stride = inputs.expert_slot_bytes.max(ALIGN as u64);
        let min_cache = stride.saturating_mul(inputs.top_k as u64);
        let all_experts = stride.saturating_mul(inputs.total_experts.max(inputs.top_k) as u64);
        let trunk = whole_trunk
            .min(usable.saturating_sub(min_cache))
            .max(largest);
        let cache = usable.saturating_sub(trunk).min(all_experts).max(min_cache);
        Budget {
            trunk_bytes: trunk,
            cache_bytes: cache,
            label: format!(
                "auto ({} trunk, {} cache of {} may allocate)",
                fmt_bytes(trunk),
                fmt_bytes(cache),
                fmt_bytes(allocatable)
            ),
            auto: true,
            prefill_bytes: None,
        }
    }
}

/// Why the memory flags give no budget (a refusal, exit 2).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BudgetError {
    /// A number of GB out of range.
    #[error("{what} {value}: must be a number of GB between 0 and 1000000")]
    OutOfRange {
        /// The flag (or the preset's field).
        what: &'static str,
        /// The value given.
        value: f64,
    },
    /// A preset name that is not one of [`PRESETS`].
    #[error("unknown preset '{0}' (known: {known})", known = PRESETS.map(|p| p.name).join(", "))]
    UnknownPreset(String),
    /// A budget left unset.
    #[error(
        "no memory budget for {0}: pass --preset NAME (see `k3-ctl presets`) or both \
         --trunk-gb and --cache-gb"
    )]
    Missing(String),
    /// `--preset auto` with other memory flags.
    #[error("--preset auto cannot be combined with other memory flags")]
    AutoCombined,
}

/// Why `/proc/meminfo` gave no figure.
#[derive(Debug, thiserror::Error)]
pub enum MemInfoError {
    /// It cannot be read.
    #[error("cannot read /proc/meminfo: {0}")]
    Read(#[source] std::io::Error),
    /// Its `MemAvailable` is not a number of kB.
    #[error("/proc/meminfo MemAvailable '{text}': {source}")]
    Parse {
        /// The value as written.
        text: String,
        /// Why.
        source: std::num::ParseIntError,
    },
    /// Its `MemAvailable` overflows 64 bits of bytes.
    #[error("/proc/meminfo MemAvailable overflows")]
    Overflow,
    /// It has no `MemAvailable` line.
    #[error("/proc/meminfo has no MemAvailable line")]
    NoLine,
    /// macOS: the VM counters cannot be read.
    #[error("cannot read the memory counters (sysctl vm.page_*_count): {0}")]
    Sysctl(#[source] std::io::Error),
}

/// A memory plan refused before anything is allocated (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The memory available is unknown.
    #[error(transparent)]
    MemInfo(#[from] MemInfoError),
    /// The plan has problems or does not fit: the whole plan, then every problem.
    #[error("REFUSING TO START: the memory plan does not fit\n{plan}{}",
        problems.iter().map(|p| format!("  problem: {p}\n")).collect::<String>())]
    DoesNotFit {
        /// The plan, as printed.
        plan: String,
        /// What does not fit, one line each.
        problems: Vec<String>,
    },
}

fn gb_bytes(what: &'static str, value: f64) -> Result<u64, BudgetError> {
    if !value.is_finite() || !(0.0..=1e6).contains(&value) {
        return Err(BudgetError::OutOfRange { what, value });
    }
    Ok((value * GB).round() as u64)
}

impl Budget {
    /// Apply flags in command-line order (a later flag overrides an earlier one). Both budgets
    /// must end up set: nothing is guessed.
    pub fn from_flags(flags: &[BudgetFlag]) -> Result<Budget, BudgetError> {
        let mut trunk = None;
        let mut cache = None;
        let mut prefill = None;
        let mut label: Vec<String> = Vec::new();
        for f in flags {
            match f {
                BudgetFlag::Preset(n) => {
                    let p = preset(n).ok_or_else(|| BudgetError::UnknownPreset(n.clone()))?;
                    trunk = Some(gb_bytes("preset trunk", p.trunk_gb)?);
                    cache = Some(gb_bytes("preset cache", p.cache_gb)?);
                    prefill = Some(gb_bytes("preset prefill", p.prefill_gb)?);
                    label = vec![p.name.to_string()];
                }
                BudgetFlag::TrunkGb(x) => {
                    trunk = Some(gb_bytes("--trunk-gb", *x)?);
                    label.push(format!("--trunk-gb {x}"));
                }
                BudgetFlag::CacheGb(x) => {
                    cache = Some(gb_bytes("--cache-gb", *x)?);
                    label.push(format!("--cache-gb {x}"));
                }
            }
        }
        match (trunk, cache) {
            (Some(trunk_bytes), Some(cache_bytes)) => Ok(Budget {
                trunk_bytes,
                cache_bytes,
                label: label.join(", "),
                auto: false,
                prefill_bytes: prefill,
            }),
            (t, c) => {
                let mut missing = Vec::new();
                if t.is_none() {
                    missing.push("--trunk-gb");
                }
                if c.is_none() {
                    missing.push("--cache-gb");
                }
                Err(BudgetError::Missing(missing.join(" and ")))
            }
        }
    }

    /// Collect the flags from clap matches in command-line order. `preset`, `trunk_gb`,
    /// `cache_gb` are the argument ids (the field names with clap derive).
    pub fn from_matches(
        m: &clap::ArgMatches,
        preset: &str,
        trunk_gb: &str,
        cache_gb: &str,
    ) -> Result<Budget, BudgetError> {
        let mut flags: Vec<(usize, BudgetFlag)> = Vec::new();
        if let (Some(vals), Some(idx)) = (m.get_many::<String>(preset), m.indices_of(preset)) {
            flags.extend(
                idx.zip(vals)
                    .map(|(i, v)| (i, BudgetFlag::Preset(v.clone()))),
            );
        }
        if let (Some(vals), Some(idx)) = (m.get_many::<f64>(trunk_gb), m.indices_of(trunk_gb)) {
            flags.extend(idx.zip(vals).map(|(i, v)| (i, BudgetFlag::TrunkGb(*v))));
        }
        if let (Some(vals), Some(idx)) = (m.get_many::<f64>(cache_gb), m.indices_of(cache_gb)) {
            flags.extend(idx.zip(vals).map(|(i, v)| (i, BudgetFlag::CacheGb(*v))));
        }
        flags.sort_by_key(|f| f.0);
        Budget::from_flags(&flags.into_iter().map(|f| f.1).collect::<Vec<_>>())
    }
}

/// The sequence states a process holds (each sequence's KDA state and MLA latent cache), as the
/// engine that allocates them states them (k3-worker `engine::memory`): the plan takes the
/// number, it does not compute it. A store holds none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateBytes {
    /// Their bytes.
    pub bytes: u64,
    /// Sequences (slots) they are planned for.
    pub sequences: usize,
    /// Positions each slot is planned for.
    pub positions: usize,
}

/// Everything the plan needs to know about the model, in bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanInputs {
    /// Model-level tensors read into memory (lm_head, final norms, output AttnRes).
    pub resident_bytes: u64,
    /// Model-level tensors served by a file mapping, paged in on demand (the embedding table:
    /// one row per token is read, so it is not counted as resident).
    pub mapped_bytes: u64,
    /// Memory one layer's trunk occupies when loaded (read buffer size), per layer.
    pub layer_bytes: Vec<u64>,
    /// Bytes of one expert.
    pub expert_bytes: u64,
    /// Bytes between expert slots (≥ expert_bytes).
    pub expert_slot_bytes: u64,
    /// Experts per token (the cache must hold at least this many).
    pub top_k: usize,
    /// Routed experts in the checkpoint: more slots than this are never useful.
    pub total_experts: usize,
    /// The sequence states the process holds, as the engine that allocates them states them.
    pub state: StateBytes,
    /// Activation scratch, logits and I/O bounce buffers, as the process that allocates them
    /// states them from its shapes, with the readers' bounce buffers ([`io_bounce_bytes`]).
    pub buffer_bytes: u64,
    /// What this process holds before the plan ([`resident_now`]).
    pub process_bytes: u64,
}

impl PlanInputs {
    /// These inputs with `bytes` more buffers (a worker's, as it states them).
    pub fn plus_buffers(mut self, bytes: u64) -> PlanInputs {
        self.buffer_bytes += bytes;
        self
    }

    /// From the config, the checkpoint catalog and the trunk read plan, with the sequence
    /// states the process will hold (`state`, the engine's statement).
    pub fn from_model(
        cfg: &k3_proto::config::ModelConfig,
        cat: &crate::runtime::catalog::Catalog,
        trunk: &crate::runtime::trunk::TrunkLayout,
        state: StateBytes,
    ) -> PlanInputs {
        let (embed, resident): (Vec<_>, Vec<_>) = cat
            .model_tensors()
            .iter()
            .partition(|t| t.name == k3_proto::names::EMBED);
        PlanInputs {
            resident_bytes: resident.iter().map(|t| t.nbytes).sum(),
            mapped_bytes: embed.iter().map(|t| t.nbytes).sum(),
            layer_bytes: (0..trunk.n_layers()).map(|l| trunk.buf_len(l)).collect(),
            expert_bytes: cfg.expert_layout().expert_bytes() as u64,
            expert_slot_bytes: crate::runtime::experts::ExpertReader::slot_stride(
                &cfg.expert_layout(),
            ) as u64,
            top_k: cfg.num_experts_per_token,
            total_experts: (0..cat.n_layers())
                .map(|l| {
                    (0..cat.n_experts())
                        .filter(|&e| cat.expert(l, e).is_some())
                        .count()
                })
                .sum(),
            state,
            buffer_bytes: io_bounce_bytes(IO_THREADS, cfg.expert_layout().expert_bytes() as u64),
            process_bytes: resident_now(),
        }
    }
}

/// The reader threads a source reads the checkpoint with (`StandaloneOptions::io_threads`).
pub const IO_THREADS: usize = 8;

/// The bounce buffers `threads` readers hold at once when each reads at most `largest` bytes
/// into a destination that is not aligned for `O_DIRECT` (an expert's part from the
/// checkpoint's shards): a span of the read, at most [`crate::runtime::io::BOUNCE`], each. A
/// worker's own buffers are stated by the worker from its shapes and added in
/// [`PlanInputs::buffer_bytes`].
pub fn io_bounce_bytes(threads: usize, largest: u64) -> u64 {
    let span = (largest + 2 * ALIGN as u64).min(crate::runtime::io::BOUNCE as u64);
    threads as u64 * span
}

/// Address space a process takes beyond what the plan allocates and maps: thread stacks (2 MiB
/// each for the I/O, fetch, prefetch, reader and compute threads), the allocator's second arena
/// (64 MiB reserved; [`limit_allocator_arenas`] allows no more) and the runtime's own mappings.
/// Only checked against an address-space limit (`RLIMIT_AS`), never against memory.
pub const ADDRESS_SPACE_RESERVE: u64 = 256 << 20;

/// [`ADDRESS_SPACE_RESERVE`] for a process that starts only `threads` threads and reads no
/// checkpoint (an attached worker): their 2 MiB stacks, the allocator's second arena (64 MiB)
/// and 32 MiB for the runtime's own mappings.
pub fn address_space_reserve(threads: usize) -> u64 {
    threads as u64 * (2 << 20) + (64 << 20) + (32 << 20)
}

/// Allow the allocator two arenas (the main one and one for every other thread). glibc reserves
/// 64 MiB of address space per arena, up to 8 per core, as threads first allocate; an
/// address-space limit (`ulimit -v`) that the plan judged sufficient would otherwise be
/// exhausted by arenas alone, and a failed allocation aborts the process. Call before starting
/// threads.
/// Elsewhere (macOS's allocator has no per-thread arenas reserving address space) nothing.
pub fn limit_allocator_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; M_ARENA_MAX is a valid parameter and
    // any positive value is accepted.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// The address space this process may still map under `RLIMIT_AS` (the limit less what is
/// mapped now), or `None` without a limit.
pub fn address_space_left() -> Option<u64> {
    use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
    let (soft, _) = getrlimit(Resource::RLIMIT_AS).ok()?;
    if soft == RLIM_INFINITY {
        return None;
    }
    let mapped = status_field("VmSize:").unwrap_or(0);
    Some(soft.saturating_sub(mapped))
}

/// What the threads a process starts after its plan make resident besides the buffers the plan
/// counts: their stacks' touched pages and their allocator heaps (16 threads: the readers, the
/// fetch, prefetch and ring threads, the compute pool), 256 KiB each.
pub const THREADS_ALLOWANCE: u64 = 16 * (256 << 10);

/// This process's resident memory now (`VmRSS`: the program, its runtime and what it has read
/// so far, config, index, tokenizer) and [`THREADS_ALLOWANCE`]: the baseline every plan adds
/// its allocations to.
pub fn resident_now() -> u64 {
    status_field("VmRSS:").unwrap_or(0) + THREADS_ALLOWANCE
}

fn status_field(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    status_kb(&s, key)
}

/// Bytes this process may still allocate: the least of `MemAvailable`, the address-space limit
/// (`RLIMIT_AS`) less the address space already mapped, and the cgroup's `memory.max` less its
/// `memory.current` (cgroup v2), whichever are set.
pub fn allocatable() -> Result<u64, MemInfoError> {
    let mut avail = mem_available()?;
    if let Some(left) = address_space_left() {
        avail = avail.min(left);
    }
    let read = |p: &str| std::fs::read_to_string(p).ok();
    if let (Some(max), Some(cur)) = (
        read("/sys/fs/cgroup/memory.max"),
        read("/sys/fs/cgroup/memory.current"),
    ) {
        if let (Ok(max), Ok(cur)) = (max.trim().parse::<u64>(), cur.trim().parse::<u64>()) {
            avail = avail.min(max.saturating_sub(cur));
        }
    }
    Ok(avail)
}

/// A `/proc/self/status` field in kB, as bytes.
fn status_kb(s: &str, key: &str) -> Option<u64> {
    let rest = s.lines().find_map(|l| l.strip_prefix(key))?;
    let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
    kb.checked_mul(1024)
}

/// The memory plan (computed before anything is allocated).
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    /// The budget it was made from.
    pub budget: Budget,
    /// Decoder layers.
    pub n_layers: usize,
    /// Layers `0..pinned_layers` are resident.
    pub pinned_layers: usize,
    /// Their bytes.
    pub pinned_bytes: u64,
    /// Bytes of the ring arena the other layers stream through (0 when everything is pinned).
    pub ring_bytes: u64,
    /// The largest streamed layer (the least the ring must hold), bytes.
    pub ring_layer_bytes: u64,
    /// Model-level tensors read into memory.
    pub resident_bytes: u64,
    /// Model-level tensors mapped from the checkpoint (the embedding; not counted in the total).
    pub mapped_bytes: u64,
    /// Expert slots.
    pub expert_slots: usize,
    /// Bytes per expert slot.
    pub expert_slot_bytes: u64,
    /// Experts per token.
    pub top_k: usize,
    /// The sequence states (KDA state and MLA latent cache of every slot).
    pub state: StateBytes,
    /// Scratch buffers.
    pub buffer_bytes: u64,
    /// What the process held before the plan (program, runtime, what it parsed).
    pub process_bytes: u64,
    /// `MemAvailable` when known.
    pub available_bytes: Option<u64>,
    /// Why this plan cannot run (empty when it can).
    pub problems: Vec<String>,
}

impl MemoryPlan {
    /// Compute the plan. Never fails: problems (trunk budget below the largest layer, cache below
    /// top-k slots) are recorded in `problems`; call [`MemoryPlan::check`] to refuse.
    pub fn compute(inputs: &PlanInputs, budget: &Budget) -> MemoryPlan {
        let n = inputs.layer_bytes.len();
        // A streamed layer takes its read buffer rounded up to the page in the ring arena.
        let ext = |b: u64| align_up(b).unwrap_or(u64::MAX);
        // suffix_max[p] / suffix_sum[p]: largest / total arena bytes of layers p..n.
        let mut suffix_max = vec![0u64; n + 1];
        let mut suffix_sum = vec![0u64; n + 1];
        for l in (0..n).rev() {
            suffix_max[l] = suffix_max[l + 1].max(ext(inputs.layer_bytes[l]));
            suffix_sum[l] = suffix_sum[l + 1].saturating_add(ext(inputs.layer_bytes[l]));
        }
        let mut problems = Vec::new();
        let mut pinned = 0usize;
        let mut prefix = 0u64;
        // Largest prefix that still leaves room for a ring holding the largest remaining layer.
        for p in (0..=n).rev() {
            let pre: u64 = inputs.layer_bytes[..p].iter().sum();
            let ring = if p < n { suffix_max[p] } else { 0 };
            if pre.saturating_add(ring) <= budget.trunk_bytes {
                pinned = p;
                prefix = pre;
                break;
            }
        }
        let need = suffix_max[pinned];
        // The ring gets the rest of the trunk budget (more room = more read-ahead), but never
        // more than the streamed layers take together.
        let ring_bytes = if pinned == n {
            0
        } else if prefix + need > budget.trunk_bytes {
            problems.push(format!(
                "trunk budget {} cannot hold a ring for {} (the largest layer)",
                fmt_bytes(budget.trunk_bytes),
                fmt_bytes(need)
            ));
            need
        } else {
            align_down(budget.trunk_bytes - prefix)
                .min(suffix_sum[pinned])
                .max(need)
        };
        let stride = inputs.expert_slot_bytes.max(ALIGN as u64);
        let budget_slots = usize::try_from(budget.cache_bytes / stride).unwrap_or(usize::MAX);
        let expert_slots = budget_slots.min(inputs.total_experts.max(inputs.top_k));
        if expert_slots < inputs.top_k {
            problems.push(format!(
                "expert cache budget {} holds {expert_slots} slots of {}; at least top_k = {} are \
                 needed ({} )",
                fmt_bytes(budget.cache_bytes),
                fmt_mb(stride),
                inputs.top_k,
                fmt_bytes(stride * inputs.top_k as u64)
            ));
        }
        MemoryPlan {
            budget: budget.clone(),
            n_layers: n,
            pinned_layers: pinned,
            pinned_bytes: prefix,
            ring_bytes,
            ring_layer_bytes: if pinned < n { need } else { 0 },
            resident_bytes: inputs.resident_bytes,
            mapped_bytes: inputs.mapped_bytes,
            expert_slots,
            expert_slot_bytes: stride,
            top_k: inputs.top_k,
            state: inputs.state.clone(),
            buffer_bytes: inputs.buffer_bytes,
            process_bytes: inputs.process_bytes,
            available_bytes: None,
            problems,
        }
    }

    /// Trunk memory: pinned layers + ring.
    pub fn trunk_bytes(&self) -> u64 {
        self.pinned_bytes + self.ring_bytes
    }

    /// Expert arena bytes.
    pub fn cache_bytes(&self) -> u64 {
        self.expert_slots as u64 * self.expert_slot_bytes
    }

    /// The process's resident memory at its peak: what it held before the plan and everything
    /// the plan allocates (the mapped embedding is not touched: its rows are read from the file,
    /// `WeightSource::tensor_rows`).
    pub fn total_bytes(&self) -> u64 {
        self.process_bytes + self.to_allocate()
    }

    /// What the plan adds to the process.
    pub fn to_allocate(&self) -> u64 {
        self.trunk_bytes()
            + self.resident_bytes
            + self.cache_bytes()
            + self.state.bytes
            + self.buffer_bytes
    }

    /// The address space the plan adds: its allocations, the whole of every mapping and
    /// [`ADDRESS_SPACE_RESERVE`].
    pub fn address_space_bytes(&self) -> u64 {
        self.to_allocate() + self.mapped_bytes + ADDRESS_SPACE_RESERVE
    }

    /// Refuse when the plan has a problem or does not fit `available` bytes. The error text is
    /// the whole plan followed by the problems and the shortfall.
    pub fn check(&mut self, available: Option<u64>) -> Result<(), PlanError> {
        self.available_bytes = available;
        let mut problems = self.problems.clone();
        if let Some(a) = available {
            let need = self.to_allocate();
            if need > a {
                problems.push(format!(
                    "the plan needs {} more but only {} is available: shortfall {}",
                    fmt_bytes(need),
                    fmt_bytes(a),
                    fmt_bytes(need - a)
                ));
            }
            problems.extend(address_space_problem(self.address_space_bytes()));
        }
        refusal(self, &problems)
    }
}

/// `Ok` without problems, else the refusal: `plan` followed by every problem.
pub fn refusal(plan: &dyn std::fmt::Display, problems: &[String]) -> Result<(), PlanError> {
    if problems.is_empty() {
        return Ok(());
    }
    Err(PlanError::DoesNotFit {
        plan: plan.to_string(),
        problems: problems.to_vec(),
    })
}

/// The problem, if `need` bytes of address space exceed what `RLIMIT_AS` leaves this process
/// ([`address_space_left`]).
pub fn address_space_problem(need: u64) -> Option<String> {
    let left = address_space_left()?;
    (need > left).then(|| {
        format!(
            "the plan maps {} of address space but the limit (ulimit -v) leaves {}: shortfall {}",
            fmt_bytes(need),
            fmt_bytes(left),
            fmt_bytes(need - left)
        )
    })
}

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let row = |f: &mut std::fmt::Formatter<'_>, name: &str, b: u64, note: String| {
            let line = format!("  {name:<16}{:>12}   {note}", fmt_bytes(b));
            writeln!(f, "{}", line.trim_end())
        };
        writeln!(
            f,
            "memory plan ({}: trunk {}, expert cache {}):",
            self.budget.label,
            fmt_bytes(self.budget.trunk_bytes),
            fmt_bytes(self.budget.cache_bytes)
        )?;
        let trunk_note = if self.ring_bytes == 0 {
            format!(
                "{}/{} layers PINNED, no ring",
                self.pinned_layers, self.n_layers
            )
        } else {
            format!(
                "{}/{} layers PINNED ({}) + ring {} (largest streamed layer {})",
                self.pinned_layers,
                self.n_layers,
                fmt_bytes(self.pinned_bytes),
                fmt_bytes(self.ring_bytes),
                fmt_bytes(self.ring_layer_bytes)
            )
        };
        row(f, "trunk", self.trunk_bytes(), trunk_note)?;
        if self.mapped_bytes > 0 {
            row(
                f,
                "lm_head+norms",
                self.resident_bytes,
                "model-level tensors, resident".into(),
            )?;
            row(
                f,
                "embedding",
                0,
                format!(
                    "{} mapped from the checkpoint; the rows of used tokens are read from the file",
                    fmt_bytes(self.mapped_bytes)
                ),
            )?;
        } else {
            row(
                f,
                "embed+lm_head",
                self.resident_bytes,
                "model-level tensors, resident".into(),
            )?;
        }
        row(
            f,
            "expert cache",
            self.cache_bytes(),
            format!(
                "{} slots x {} (top_k {})",
                self.expert_slots,
                fmt_mb(self.expert_slot_bytes),
                self.top_k
            ),
        )?;
        if self.state.sequences > 0 {
            row(
                f,
                "sequence state",
                self.state.bytes,
                format!(
                    "KDA state + MLA latent cache, {} slot(s) x {} positions",
                    self.state.sequences, self.state.positions
                ),
            )?;
        }
        row(
            f,
            "buffers",
            self.buffer_bytes,
            "activations, logits, I/O, as their owners state them".into(),
        )?;
        if self.process_bytes > 0 {
            row(
                f,
                "process",
                self.process_bytes,
                "resident before the plan (program, runtime, what it parsed) + its threads".into(),
            )?;
        }
        row(f, "TOTAL", self.total_bytes(), String::new())?;
        match self.available_bytes {
            Some(a) => row(f, "available", a, "MemAvailable".into()),
            None => writeln!(f, "  {:<16}{:>12}", "available", "unknown"),
        }
    }
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
#[cfg(not(target_vendor = "apple"))]
pub fn mem_available() -> Result<u64, MemInfoError> {
    let s = std::fs::read_to_string("/proc/meminfo").map_err(MemInfoError::Read)?;
    parse_meminfo(&s)
}

/// macOS has no `/proc/meminfo`: what it could give without swapping, from the VM counters
/// (`crate::sys::mem_available`).
#[cfg(target_vendor = "apple")]
pub fn mem_available() -> Result<u64, MemInfoError> {
    crate::runtime::sysinfo::mem_available().map_err(MemInfoError::Sysctl)
}

#[cfg_attr(target_vendor = "apple", allow(dead_code))]
fn parse_meminfo(s: &str) -> Result<u64, MemInfoError> {
    for line in s.lines() {
        if let Some(rest) = line.strip_prefix("MemAvailable:") {
            let kb: u64 = (rest.trim().trim_end_matches("kB").trim())
                .parse()
                .map_err(|source| MemInfoError::Parse {
                    text: rest.trim().to_string(),
                    source,
                })?;
            return kb.checked_mul(1024).ok_or(MemInfoError::Overflow);
        }
    }
    Err(MemInfoError::NoLine)
}

/// Bytes of an ecbf16-coded trunk (`k3-ctl pack-trunk --codec ecbf16`, 12-bit index) per byte
/// of the raw trunk, as measured on `k3slice` (synthetic Gaussian weights: 4,906,382,652 of
/// 6,517,649,408 trunk bytes, docs/BENCHMARKS.md): what the full-model tables assume when no
/// coded trunk is at hand (a plan made from a packed trunk counts its actual run sizes).
pub const ECBF16_TRUNK_RATIO: f64 = 0.753;

impl PlanInputs {
    /// These inputs with every trunk layer `ratio` times its size (rounded up): a coded trunk's
    /// estimate.
    pub fn with_coded_trunk(mut self, ratio: f64) -> PlanInputs {
        for b in &mut self.layer_bytes {
            *b = (*b as f64 * ratio).ceil() as u64;
        }
        self
    }
}

/// The plan inputs of the full released model (SPEC.md §2.9: layer 0 KDA + dense MLP, MLA+MoE
/// at layers 3, 7, …, 87, 91, 92, KDA+MoE elsewhere; 896 experts of 17,547,264 bytes, top-16),
/// as a standalone worker lays it out: lm_head and the small model-level vectors resident, the
/// embedding mapped, one sequence of `context_len` positions (69 KDA layers of 96 heads' 128²
/// state and conv histories, 24 MLA layers of 576 floats a position: the sizes k3-worker's
/// engine states for these dims). The one place the full model's sizes are written down, for
/// `k3-ctl doctor` (which has no 1.56 TB catalog to compute them from) and the tests.
pub fn full_scale_inputs(context_len: usize) -> PlanInputs {
    const EXPERT_BYTES: u64 = 17_547_264;
    let layer_bytes = (0..93)
        .map(|l| {
            if l == 0 {
                2_341_213_184
            } else if (l + 1) % 4 == 0 || l == 92 {
                844_335_616
            } else {
                1_267_744_256
            }
        })
        .collect();
    PlanInputs {
        // lm_head + final norm + output AttnRes norm and projection (3 × 7168 bf16).
        resident_bytes: 2_348_810_240 + 3 * 7168 * 2,
        // The embedding (163,840 × 7168 bf16): one row per token is read.
        mapped_bytes: 2_348_810_240,
        layer_bytes,
        expert_bytes: EXPERT_BYTES,
        expert_slot_bytes: EXPERT_BYTES + ALIGN as u64,
        top_k: 16,
        total_experts: 92 * 896,
        state: StateBytes {
            bytes: 69 * 4 * (96 * 128 * 128 + 3 * 12288 * 3) + 24 * 4 * 576 * context_len as u64,
            sequences: 1,
            positions: context_len,
        },
        buffer_bytes: 100 << 20,
        process_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full_scale() -> PlanInputs {
        full_scale_inputs(4096)
    }

    /// A preset names its prefill allowance (kept when --trunk-gb/--cache-gb follow), auto
    /// takes its share of the allocatable memory (none when that is unknown), flags alone none.
    #[test]
    fn the_prefill_allowance_comes_from_the_preset_or_auto() {
        let laptop = b(&[
            BudgetFlag::Preset("laptop".into()),
            BudgetFlag::CacheGb(2.0),
        ]);
        assert_eq!(laptop.prefill_allowance(None), Some(1_500_000_000));
        let flags = b(&[BudgetFlag::TrunkGb(1.0), BudgetFlag::CacheGb(1.0)]);
        assert_eq!(flags.prefill_allowance(Some(1 << 40)), None);
        let auto = Budget::auto();
        assert_eq!(auto.prefill_allowance(None), None);
        let a = auto.prefill_allowance(Some(16_000_000_000)).unwrap();
        assert_eq!(a, (16e9 * AUTO_SHARE * AUTO_PREFILL_SHARE) as u64);
    }

    fn b(flags: &[BudgetFlag]) -> Budget {
        Budget::from_flags(flags).unwrap()
    }

    #[test]
    fn full_scale_trunk_total_matches_the_spec() {
        let i = full_scale();
        assert_eq!(i.layer_bytes.iter().sum::<u64>(), 108_811_877_376);
    }

    #[test]
    fn later_flag_wins() {
        use BudgetFlag::*;
        let x = b(&[Preset("server".into()), CacheGb(40.0)]);
        assert_eq!(
            (x.trunk_bytes, x.cache_bytes),
            (110_000_000_000, 40_000_000_000)
        );
        let y = b(&[CacheGb(40.0), Preset("server".into())]);
        assert_eq!(y.cache_bytes, 13_000_000_000);
        let z = b(&[TrunkGb(5.0), CacheGb(2.5)]);
        assert_eq!(
            (z.trunk_bytes, z.cache_bytes),
            (5_000_000_000, 2_500_000_000)
        );
        let e = Budget::from_flags(&[TrunkGb(5.0)]).unwrap_err().to_string();
        assert!(e.starts_with("no memory budget for --cache-gb:"), "{e}");
        assert!(Budget::from_flags(&[Preset("huge".into())])
            .unwrap_err()
            .to_string()
            .contains("laptop"));
        assert!(Budget::from_flags(&[Preset("laptop".into()), CacheGb(f64::NAN)]).is_err());
        assert!(Budget::from_flags(&[]).is_err());
    }

    #[test]
    fn clap_matches_keep_command_line_order() {
        let cmd = clap::Command::new("t")
            .arg(clap::Arg::new("preset").long("preset"))
            .arg(
                clap::Arg::new("trunk_gb")
                    .long("trunk-gb")
                    .value_parser(clap::value_parser!(f64)),
            )
            .arg(
                clap::Arg::new("cache_gb")
                    .long("cache-gb")
                    .value_parser(clap::value_parser!(f64)),
            );
        let m = cmd
            .clone()
            .get_matches_from(["t", "--cache-gb", "40", "--preset", "server"]);
        let x = Budget::from_matches(&m, "preset", "trunk_gb", "cache_gb").unwrap();
        assert_eq!(x.cache_bytes, 13_000_000_000);
        let m = cmd.get_matches_from(["t", "--preset", "server", "--cache-gb", "40"]);
        let x = Budget::from_matches(&m, "preset", "trunk_gb", "cache_gb").unwrap();
        assert_eq!(x.cache_bytes, 40_000_000_000);
    }

    #[test]
    fn presets_at_full_scale() {
        let i = full_scale();
        let p = |n: &str| MemoryPlan::compute(&i, &b(&[BudgetFlag::Preset(n.into())]));
        // laptop: 3 GB cannot pin layer 0 (2.34 GB) and still ring the rest (1.27 GB): nothing
        // pinned, the whole 3 GB is the ring, which holds two KDA layers at once.
        let l = p("laptop");
        let ext = |b: u64| align_up(b).unwrap();
        assert_eq!(
            (l.pinned_layers, l.ring_layer_bytes),
            (0, ext(2_341_213_184))
        );
        assert!(l.ring_bytes <= 3_000_000_000 && l.ring_bytes > 3_000_000_000 - ALIGN as u64);
        assert_eq!(l.ring_bytes % ALIGN as u64, 0);
        assert!(2 * ext(1_267_744_256) <= l.ring_bytes);
        assert_eq!(l.trunk_bytes(), l.ring_bytes);
        assert_eq!(l.expert_slots, 56);
        assert!(l.problems.is_empty(), "{:?}", l.problems);
        // server: the whole trunk fits.
        let s = p("server");
        assert_eq!((s.pinned_layers, s.ring_bytes), (93, 0));
        assert_eq!(s.trunk_bytes(), 108_811_877_376);
        // desktop: the longest prefix that leaves a ring for the largest remaining layer is
        // pinned; the ring takes the rest of the budget.
        let d = p("desktop");
        assert!(d.pinned_layers > 5 && d.pinned_layers < 93);
        assert!(d.trunk_bytes() <= 16_000_000_000);
        assert!(d.trunk_bytes() > 16_000_000_000 - ALIGN as u64);
        assert_eq!(d.ring_layer_bytes, ext(1_267_744_256));
        assert!(d.ring_bytes >= d.ring_layer_bytes);
        let one_more: u64 = i.layer_bytes[..d.pinned_layers + 1].iter().sum();
        assert!(one_more + d.ring_layer_bytes > 16_000_000_000);
        // KV: 576 floats per position per MLA layer, and the KDA state.
        assert_eq!(
            d.state.bytes,
            4 * 576 * 4096 * 24 + 69 * 4 * (96 * 128 * 128 + 3 * 12288 * 3)
        );
        let text = d.to_string();
        for w in [
            "trunk",
            "lm_head+norms",
            "embedding",
            "mapped from the checkpoint",
            "expert cache",
            "sequence state",
            "buffers",
            "TOTAL",
            "available",
        ] {
            assert!(text.contains(w), "{w} missing from\n{text}");
        }
    }

    #[test]
    fn auto_budget_gives_the_trunk_first_and_fits_what_may_be_allocated() {
        let i = full_scale();
        let ext = |b: u64| align_up(b).unwrap();
        let whole: u64 = i.layer_bytes.iter().map(|&b| ext(b)).sum();
        let largest = i.layer_bytes.iter().map(|&b| ext(b)).max().unwrap();
        // A machine that holds everything: the whole trunk and every expert.
        let big = Budget::fit(&i, 4_000_000_000_000);
        assert!(big.auto);
        assert_eq!(big.trunk_bytes, whole);
        let mut p = MemoryPlan::compute(&i, &big);
        assert_eq!(p.pinned_layers, i.layer_bytes.len());
        assert_eq!(p.expert_slots, i.total_experts);
        assert!(p.check(Some(4_000_000_000_000)).is_ok());
        // 64 GB: the trunk takes all but top-k slots; the plan fits what may be allocated.
        let mid = Budget::fit(&i, 64_000_000_000);
        let mut p = MemoryPlan::compute(&i, &mid);
        assert!(mid.trunk_bytes > 40_000_000_000, "{}", mid.label);
        assert_eq!(p.expert_slots, i.top_k);
        assert!(p.check(Some(64_000_000_000)).is_ok(), "{p}");
        // Too little memory: never below a runnable budget, and the check refuses.
        let tiny = Budget::fit(&i, 2_000_000_000);
        assert!(tiny.trunk_bytes >= largest);
        assert!(MemoryPlan::compute(&i, &tiny)
            .check(Some(2_000_000_000))
            .is_err());
    }

    #[test]
    fn refusals_print_the_plan_and_the_shortfall() {
        let i = full_scale();
        let mut tiny = MemoryPlan::compute(
            &i,
            &b(&[BudgetFlag::TrunkGb(2.0), BudgetFlag::CacheGb(0.1)]),
        );
        let e = tiny.check(Some(1 << 40)).unwrap_err().to_string();
        assert!(e.contains("cannot hold a ring"), "{e}");
        assert!(e.contains("at least top_k = 16"), "{e}");
        assert!(e.contains("TOTAL"), "{e}");
        let mut max = MemoryPlan::compute(&i, &b(&[BudgetFlag::Preset("max".into())]));
        let e = max.check(Some(8_000_000_000)).unwrap_err().to_string();
        assert!(e.contains("shortfall") && e.contains("available"), "{e}");
        assert!(max.check(Some(1 << 42)).is_ok());
        // More cache than the checkpoint has experts: capped at the expert count.
        let small = PlanInputs {
            total_experts: 40,
            ..i.clone()
        };
        let p = MemoryPlan::compute(&small, &b(&[BudgetFlag::Preset("max".into())]));
        assert_eq!(p.expert_slots, 40);
    }

    #[test]
    fn meminfo_parsing() {
        assert_eq!(
            parse_meminfo("MemTotal: 100 kB\nMemAvailable:   24341440 kB\n").unwrap(),
            24_341_440 * 1024
        );
        assert!(parse_meminfo("MemTotal: 1 kB\n").is_err());
        assert!(parse_meminfo("MemAvailable: lots kB\n").is_err());
        assert!(mem_available().unwrap() > 0);
        assert!(presets_table().contains("workstation"));
    }

    #[test]
    fn a_coded_trunk_pins_more_layers_in_the_same_budget() {
        let raw = full_scale();
        let coded = raw.clone().with_coded_trunk(ECBF16_TRUNK_RATIO);
        assert_eq!(
            coded.layer_bytes[0], 1_762_933_528,
            "layer 0 x 0.753, rounded up"
        );
        let plan = |i: &PlanInputs, p: &str| {
            MemoryPlan::compute(
                i,
                &Budget::from_flags(&[BudgetFlag::Preset(p.into())]).unwrap(),
            )
        };
        // Laptop: the raw ring must hold layer 0 (2.34 GB) and pins nothing; coded, layer 0
        // (1.76 GB) is pinned and the rest streams through a ring of one KDA layer.
        assert_eq!(plan(&raw, "laptop").pinned_layers, 0);
        assert_eq!(plan(&coded, "laptop").pinned_layers, 1);
        for p in ["desktop", "workstation"] {
            let (r, c) = (plan(&raw, p), plan(&coded, p));
            assert!(c.pinned_layers > r.pinned_layers, "{p}: {r:?} {c:?}");
            assert!(
                c.trunk_bytes() <= c.budget.trunk_bytes,
                "{p}: within the budget"
            );
        }
        // Server pins the whole trunk either way, in 0.753 of the memory.
        let (r, c) = (plan(&raw, "server"), plan(&coded, "server"));
        assert_eq!((r.pinned_layers, c.pinned_layers), (93, 93));
        assert!(c.pinned_bytes as f64 <= 0.754 * r.pinned_bytes as f64);
        let t = presets_table();
        let laptop = t.lines().find(|l| l.starts_with("laptop")).unwrap();
        assert!(laptop.contains(" 0/1 "), "{laptop}");
    }
}
