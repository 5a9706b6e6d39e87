//! Expert-cache eviction policies, and trace replay that measures them against Belady.
//!
//! A trace (written by `k3-worker --dump-cache-trace DIR` into `DIR/expert_trace.jsonl`) is one
//! JSON object per line, `{"step": u64, "layer": u32, "experts": [u32, ...]}`: one line per
//! (step, layer) batch in request order. Several trace files replay as sequential jobs on one
//! store (the cache persists between them).
//!
//! Online policies implement [`EvictionPolicy`] and are replayed through a real [`SlotTable`]
//! ([`replay_store`]), so their counters are the store's counters by construction. Belady (OPT:
//! evict the resident expert whose next use is farthest away) needs the future and lives in a
//! small offline simulator ([`replay_offline`]) that mirrors `SlotTable::reserve` for a single
//! sequential client: a batch's hits are leased before its misses pick victims, free slots are
//! used before anything is evicted, and a batch's own loads are never evicted by that batch. The
//! same simulator also runs LRU, which the tests compare against the real table.
//!
//! The online candidates (`--cache-policy NAME`, [`policy_by_name`]), all O(slots) per victim
//! like [`Lru`]; `docs/CACHE_POLICY.md` has the measurements:
//! - `lfu[:F]`: least frequently used with ageing. Frequencies are kept per (layer, expert), so
//!   they survive eviction, and every count is halved each `F × slots` requests (default 4).
//!   Ties go to the least recently used.
//! - `layer`: layer distance. A decode step visits the MoE layers in the cyclic order 0..n-1, so
//!   the resident expert needed farthest in the future is, to a first approximation, one of the
//!   layer just served. With the current layer c (from [`EvictionPolicy::begin`]) an expert of
//!   layer l is next needed after (l − c) mod n layers, and after a whole cycle when l = c; the
//!   victim maximises that distance, ties (same layer) to the least recently used. This is
//!   exactly OPT on a pure cyclic scan, where LRU gets nothing.
//! - `layer-lfu[:F]`: layer distance, ties within a layer to the lowest aged frequency.
//! - `lrfu[:λ]`: recency-weighted frequency (a count per expert halving every 1/λ tokens).
//! - `layer-lrfu[:λ]`: layer distance, ties to `lrfu`'s score.
//! - `layer-age[:λ]`: staleness in visits of the expert's own layer (capped at [`AGE_CAP`]),
//!   then, among the stale, a long-term frequency; then layer distance; then LRU. The best of
//!   these on the tuning traces, and never worse than LRU on any trace measured.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::io::{BufRead, Read};
use std::path::Path;

use crate::runtime::experts::{EvictionPolicy, Lru, Reserved, SlotTable};

/// Longest accepted trace line, bytes.
pub const MAX_LINE: usize = 1 << 20;
/// Most experts in one batch (after removing duplicates).
pub const MAX_BATCH: usize = 65_536;
/// Largest accepted layer index.
pub const MAX_LAYER: u32 = 65_535;
/// Largest accepted expert id.
pub const MAX_EXPERT: u32 = (1 << 24) - 1;
/// Most requests over all trace files of one replay.
pub const MAX_REQUESTS: u64 = 100_000_000;

/// The policy used when none is given (`--cache-policy`): layer-aware, because the real model's
/// recorded trace and the trained proxy's decode traces both show LRU collapsing below ~10% of
/// the working set while `layer-lfu` does not and never fell below LRU (docs/CACHE_POLICY.md).
pub const DEFAULT_POLICY: &str = "layer-lfu";

/// Names accepted by [`policy_by_name`] (each may take `:PARAM`, see the module docs).
pub const POLICY_NAMES: &[&str] = &[
    "lru",
    "lfu",
    "layer",
    "layer-lfu",
    "lrfu",
    "layer-lrfu",
    "layer-age",
];

/// Default decay of the recency-weighted frequency policies, per token (see [`Lrfu`]).
pub const DEFAULT_LRFU_LAMBDA: f64 = 0.5;

/// Default decay of [`LayerAge`]'s frequency count, halvings per visit of the expert's layer
/// (tuned on the tuning traces of `docs/CACHE_POLICY.md`: a slow, long-term count).
pub const DEFAULT_AGE_LAMBDA: f64 = 0.005;

/// Ages above this many visits of the layer count as equally stale in [`LayerAge`] (tuned).
pub const AGE_CAP: u64 = 4;

/// Default ageing period of the frequency policies, in multiples of the slot count.
pub const DEFAULT_AGE_FACTOR: f64 = 4.0;

/// The online policy called `name` (one of [`POLICY_NAMES`], optionally `name:PARAM`) for a
/// cache of `slots` slots, or `None` if the name or parameter is not recognised. This is the
/// constructor for a `--cache-policy NAME` flag.
/// Layers until `layer` is requested again when `current` is being served and layers are
/// visited cyclically 0..n_layers; the current layer counts as a whole cycle.
fn layer_distance(layer: u32, current: u32, n_layers: u32) -> u32 {
    let n = n_layers as u64;
    let d = ((layer as u64 + n - (current as u64 % n)) % n) as u32;
    if d == 0 {
        n_layers
    } else {
        d
    }
}

/// The refusal text for an unknown policy name.
pub fn unknown_policy(name: &str) -> String {
    format!(
        "unknown cache policy '{name}' (known: {})",
        POLICY_NAMES.join(", ")
    )
}

/// Construct a policy by name (`NAME` or `NAME:PARAM`) for `slots` slots; `None` if unknown.
pub fn policy_by_name(name: &str, slots: usize) -> Option<Box<dyn EvictionPolicy>> {
    let (base, param) = match name.split_once(':') {
        Some((b, p)) => (b, Some(p)),
        None => (name, None),
    };
    let param = match param {
        None => None,
        Some(p) => {
            let f: f64 = p.parse().ok()?;
            if !(f.is_finite() && f > 0.0 && f <= 1e6) {
                return None;
            }
            Some(f)
        }
    };
    let factor = param.unwrap_or(DEFAULT_AGE_FACTOR);
    let period = ((slots.max(1) as f64) * factor).ceil().max(1.0) as u64;
    let lambda = param.unwrap_or(DEFAULT_LRFU_LAMBDA);
    match base {
        "lrfu" => Some(Box::new(Lrfu::new(slots, lambda, false))),
        "layer-lrfu" => Some(Box::new(Lrfu::new(slots, lambda, true))),
        "lru" if param.is_none() => Some(Box::new(Lru::new(slots))),
        "lfu" => Some(Box::new(Lfu::new(slots, period))),
        "layer-age" => Some(Box::new(LayerAge::new(
            slots,
            param.unwrap_or(DEFAULT_AGE_LAMBDA),
        ))),
        "layer" if param.is_none() => Some(Box::new(LayerDistance::new(slots, None))),
        "layer-lfu" => Some(Box::new(LayerDistance::new(slots, Some(period)))),
        _ => None,
    }
}

/// Aged frequency counts per (layer, expert), mirrored per slot for a cheap victim scan.
#[derive(Debug)]
struct AgedFreq {
    freq: HashMap<(u32, u32), u32>,
    slot_count: Vec<u32>,
    period: u64,
    since: u64,
}

impl AgedFreq {
    fn new(slots: usize, period: u64) -> AgedFreq {
        AgedFreq {
            freq: HashMap::new(),
            slot_count: vec![0; slots],
            period: period.max(1),
            since: 0,
        }
    }
    fn touch(&mut self, slot: usize, key: (u32, u32)) {
        let f = self.freq.entry(key).or_insert(0);
        *f = f.saturating_add(1);
        self.slot_count[slot] = *f;
        self.since += 1;
        if self.since >= self.period {
            self.since = 0;
            self.freq.retain(|_, c| {
                *c /= 2;
                *c > 0
            });
            for c in &mut self.slot_count {
                *c /= 2;
            }
        }
    }
    fn forget(&mut self, slot: usize) {
        self.slot_count[slot] = 0;
    }
}

/// Least frequently used with ageing; ties to the least recently used.
#[derive(Debug)]
pub struct Lfu {
    freq: AgedFreq,
    stamp: Vec<u64>,
    clock: u64,
}

impl Lfu {
    /// For `slots` slots, halving every count each `period` requests.
    pub fn new(slots: usize, period: u64) -> Lfu {
        Lfu {
            freq: AgedFreq::new(slots, period),
            stamp: vec![0; slots],
            clock: 0,
        }
    }
}

impl EvictionPolicy for Lfu {
    fn name(&self) -> &'static str {
        "lfu"
    }
    fn touch(&mut self, slot: usize, layer: u32, expert: u32) {
        self.clock += 1;
        self.stamp[slot] = self.clock;
        self.freq.touch(slot, (layer, expert));
    }
    fn forget(&mut self, slot: usize) {
        self.stamp[slot] = 0;
        self.freq.forget(slot);
    }
    fn victim(&mut self, eligible: &mut dyn FnMut(usize) -> bool) -> Option<usize> {
        let mut best: Option<((u32, u64), usize)> = None;
        for s in 0..self.stamp.len() {
            let k = (self.freq.slot_count[s], self.stamp[s]);
            if best.is_none_or(|(bk, _)| k < bk) && eligible(s) {
                best = Some((k, s));
            }
        }
        best.map(|(_, s)| s)
    }
}

/// Layer distance under the cyclic layer schedule; ties to LRU, or to aged LFU.
#[derive(Debug)]
pub struct LayerDistance {
    layer: Vec<u32>,
    stamp: Vec<u64>,
    clock: u64,
    current: u32,
    n_layers: u32,
    freq: Option<AgedFreq>,
}

impl LayerDistance {
    /// For `slots` slots; with `Some(period)` ties within a layer go to the lowest frequency
    /// (halved every `period` requests), else to the least recently used.
    pub fn new(slots: usize, lfu_period: Option<u64>) -> LayerDistance {
        LayerDistance {
            layer: vec![0; slots],
            stamp: vec![0; slots],
            clock: 0,
            current: 0,
            n_layers: 1,
            freq: lfu_period.map(|p| AgedFreq::new(slots, p)),
        }
    }

    fn see_layer(&mut self, layer: u32) {
        self.n_layers = self.n_layers.max(layer.saturating_add(1));
    }

    /// Layers until `layer` is requested again, the current layer counting as a whole cycle.
    fn distance(&self, layer: u32) -> u32 {
        layer_distance(layer, self.current, self.n_layers)
    }
}

impl EvictionPolicy for LayerDistance {
    fn name(&self) -> &'static str {
        if self.freq.is_some() {
            "layer-lfu"
        } else {
            "layer"
        }
    }
    fn begin(&mut self, layer: u32) {
        self.see_layer(layer);
        self.current = layer;
    }
    fn touch(&mut self, slot: usize, layer: u32, expert: u32) {
        self.see_layer(layer);
        self.clock += 1;
        self.stamp[slot] = self.clock;
        self.layer[slot] = layer;
        if let Some(f) = &mut self.freq {
            f.touch(slot, (layer, expert));
        }
    }
    fn forget(&mut self, slot: usize) {
        self.stamp[slot] = 0;
        if let Some(f) = &mut self.freq {
            f.forget(slot);
        }
    }
    fn victim(&mut self, eligible: &mut dyn FnMut(usize) -> bool) -> Option<usize> {
        // Order: farthest layer first, then lowest frequency (if any), then oldest.
        let mut best: Option<((u32, u32, u64), usize)> = None;
        for s in 0..self.stamp.len() {
            let count = self.freq.as_ref().map_or(0, |f| f.slot_count[s]);
            let k = (
                u32::MAX - self.distance(self.layer[s]),
                count,
                self.stamp[s],
            );
            if best.is_none_or(|(bk, _)| k < bk) && eligible(s) {
                best = Some((k, s));
            }
        }
        best.map(|(_, s)| s)
    }
}

/// Recency-weighted frequency (LRFU): each (layer, expert) carries a score that adds 1 per
/// request and halves every `1/λ` tokens (a token = one visit of every layer, counted from
/// [`EvictionPolicy::begin`]); the victim has the lowest score. λ → ∞ is LRU, λ → 0 is LFU.
/// With `layer_first`, the layer distance of [`LayerDistance`] is compared first.
#[derive(Debug)]
pub struct Lrfu {
    lambda: f64,
    layer_first: bool,
    /// Per (layer, expert): log2 of the score at its last request, and that time (tokens).
    hist: HashMap<(u32, u32), (f64, f64)>,
    /// Per slot: log2(score) + λ·last, which orders slots as their scores now do.
    rank: Vec<f64>,
    layer: Vec<u32>,
    batches: u64,
    current: u32,
    n_layers: u32,
}

impl Lrfu {
    /// For `slots` slots with decay `lambda` (halvings per token).
    pub fn new(slots: usize, lambda: f64, layer_first: bool) -> Lrfu {
        Lrfu {
            lambda,
            layer_first,
            hist: HashMap::new(),
            rank: vec![f64::NEG_INFINITY; slots],
            layer: vec![0; slots],
            batches: 0,
            current: 0,
            n_layers: 1,
        }
    }

    fn now(&self) -> f64 {
        self.batches as f64 / self.n_layers as f64
    }

    fn distance(&self, layer: u32) -> u32 {
        layer_distance(layer, self.current, self.n_layers)
    }
}

impl EvictionPolicy for Lrfu {
    fn name(&self) -> &'static str {
        if self.layer_first {
            "layer-lrfu"
        } else {
            "lrfu"
        }
    }
    fn begin(&mut self, layer: u32) {
        self.n_layers = self.n_layers.max(layer.saturating_add(1));
        self.current = layer;
        self.batches += 1;
    }
    fn touch(&mut self, slot: usize, layer: u32, expert: u32) {
        self.n_layers = self.n_layers.max(layer.saturating_add(1));
        let now = self.now();
        let (l2, last) = self
            .hist
            .get(&(layer, expert))
            .copied()
            .unwrap_or((f64::NEG_INFINITY, now));
        // score = score·2^(−λ·Δt) + 1, in log2.
        let decayed = l2 - self.lambda * (now - last);
        let l2 = (decayed.exp2() + 1.0).log2();
        self.hist.insert((layer, expert), (l2, now));
        self.rank[slot] = l2 + self.lambda * now;
        self.layer[slot] = layer;
    }
    fn forget(&mut self, slot: usize) {
        self.rank[slot] = f64::NEG_INFINITY;
    }
    fn victim(&mut self, eligible: &mut dyn FnMut(usize) -> bool) -> Option<usize> {
        let mut best: Option<((u32, f64), usize)> = None;
        for s in 0..self.rank.len() {
            let d = if self.layer_first {
                u32::MAX - self.distance(self.layer[s])
            } else {
                0
            };
            let k = (d, self.rank[s]);
            if best.is_none_or(|(bk, _)| k < bk) && eligible(s) {
                best = Some((k, s));
            }
        }
        best.map(|(_, s)| s)
    }
}

/// Layers whose visits [`LayerAge`] counts apart (larger indices share counters modulo this).
const AGE_LAYERS: usize = 1 << 16;

/// Age in visits of the expert's own layer, then long-term frequency, then layer distance, then
/// LRU.
///
/// An expert's age is the number of requests for its layer since it was last requested (0 = used
/// at its layer's latest visit; the current layer's other residents are at least 1), capped at
/// [`AGE_CAP`]. The victim is the oldest; among equally old, the least frequently used (a count
/// per (layer, expert) that survives eviction and halves every `1/λ` visits of its layer,
/// `layer-age:λ`); then the one whose layer comes back last in the cyclic schedule (as
/// [`LayerDistance`]); then the least recently used. Measuring staleness per layer removes LRU's
/// cyclic pathology (an expert of the layer just served looks younger than one of the next
/// layer, so LRU evicts exactly what is needed next), while stale experts of any layer still go
/// before fresh ones, which strict layer distance ignores; among the stale, popular experts stay.
#[derive(Debug)]
pub struct LayerAge {
    /// Halvings of the count per visit of the layer.
    lambda: f64,
    /// Per (layer, expert): the count at its last request, and that visit of its layer.
    hist: HashMap<(u32, u32), (f64, u64)>,
    /// Per slot: log2 of its expert's count at its last request.
    score: Vec<f64>,
    visits: Vec<u64>,
    last_visit: Vec<u64>,
    layer: Vec<u32>,
    stamp: Vec<u64>,
    clock: u64,
    current: u32,
    n_layers: u32,
}

impl LayerAge {
    /// For `slots` slots, the frequency count halving every `1/lambda` visits.
    pub fn new(slots: usize, lambda: f64) -> LayerAge {
        LayerAge {
            lambda,
            hist: HashMap::new(),
            score: vec![f64::NEG_INFINITY; slots],
            visits: Vec::new(),
            last_visit: vec![0; slots],
            layer: vec![0; slots],
            stamp: vec![0; slots],
            clock: 0,
            current: 0,
            n_layers: 1,
        }
    }

    fn visit_index(layer: u32) -> usize {
        layer as usize % AGE_LAYERS
    }

    fn visits_of(&self, layer: u32) -> u64 {
        self.visits
            .get(Self::visit_index(layer))
            .copied()
            .unwrap_or(0)
    }

    fn distance(&self, layer: u32) -> u32 {
        layer_distance(layer, self.current, self.n_layers)
    }
}

impl EvictionPolicy for LayerAge {
    fn name(&self) -> &'static str {
        "layer-age"
    }
    fn begin(&mut self, layer: u32) {
        self.n_layers = self.n_layers.max(layer.saturating_add(1));
        self.current = layer;
        let i = Self::visit_index(layer);
        if self.visits.len() <= i {
            self.visits.resize(i + 1, 0);
        }
        self.visits[i] += 1;
    }
    fn touch(&mut self, slot: usize, layer: u32, expert: u32) {
        self.n_layers = self.n_layers.max(layer.saturating_add(1));
        self.clock += 1;
        self.stamp[slot] = self.clock;
        self.layer[slot] = layer;
        let now = self.visits_of(layer);
        self.last_visit[slot] = now;
        let (c, at) = self
            .hist
            .get(&(layer, expert))
            .copied()
            .unwrap_or((0.0, now));
        let c = c * (-self.lambda * now.saturating_sub(at) as f64).exp2() + 1.0;
        self.hist.insert((layer, expert), (c, now));
        self.score[slot] = c.log2();
    }
    fn forget(&mut self, slot: usize) {
        self.stamp[slot] = 0;
        self.last_visit[slot] = 0;
        self.score[slot] = f64::NEG_INFINITY;
    }
    fn victim(&mut self, eligible: &mut dyn FnMut(usize) -> bool) -> Option<usize> {
        // Smallest key wins: oldest (capped); among the stale (age at the cap), the lowest
        // count now; then the farthest layer; then the least recently used. Fresh experts are
        // not compared by count: in the cyclic schedule, layers served earlier in this token have
        // one more request counted than those still to come, and preferring them would bring
        // back LRU's pathology.
        let mut best: Option<((u64, f64, u32, u64), usize)> = None;
        for s in 0..self.stamp.len() {
            let l = self.layer[s];
            let age = self.visits_of(l).saturating_sub(self.last_visit[s]);
            let count = if age >= AGE_CAP {
                self.score[s] - self.lambda * age as f64
            } else {
                0.0
            };
            let k = (
                u64::MAX - age.min(AGE_CAP),
                count,
                u32::MAX - self.distance(l),
                self.stamp[s],
            );
            if best.is_none_or(|(bk, _)| k < bk) && eligible(s) {
                best = Some((k, s));
            }
        }
        best.map(|(_, s)| s)
    }
}

// ---------------------------------------------------------------------------------------------
// Traces

/// One (step, layer) request batch; `experts` distinct, in request order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceBatch {
    /// 0 = prefill, ≥ 1 = decode token.
    pub step: u64,
    /// 0-based layer.
    pub layer: u32,
    /// Distinct expert ids.
    pub experts: Vec<u32>,
}

/// Trace files concatenated as sequential jobs.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// Every batch, in replay order.
    pub batches: Vec<TraceBatch>,
    /// Number of jobs (files) concatenated.
    pub jobs: usize,
}

/// A trace that cannot be read: where and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceError {
    /// File name (as given).
    pub file: String,
    /// 1-based line, 0 if the error is not about one line.
    pub line: u64,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file, self.message)
        } else {
            write!(f, "{}:{}: {}", self.file, self.line, self.message)
        }
    }
}

impl std::error::Error for TraceError {}

#[derive(serde::Deserialize)]
struct RawLine {
    step: u64,
    layer: u32,
    experts: Vec<u32>,
}

impl Trace {
    /// Append one job read from `r` (named `file` in errors).
    pub fn push_job<R: BufRead>(&mut self, file: &str, mut r: R) -> Result<(), TraceError> {
        let err = |line: u64, message: String| TraceError {
            file: file.to_string(),
            line,
            message,
        };
        let mut requests: u64 = self.requests();
        let mut buf = Vec::new();
        let mut line = 0u64;
        loop {
            buf.clear();
            line += 1;
            let n = (&mut r)
                .take(MAX_LINE as u64 + 1)
                .read_until(b'\n', &mut buf)
                .map_err(|e| err(line, format!("read failed: {e}")))?;
            if n == 0 {
                break;
            }
            if buf.last() != Some(&b'\n') && buf.len() > MAX_LINE {
                return Err(err(line, format!("line longer than {MAX_LINE} bytes")));
            }
            let text = std::str::from_utf8(&buf).map_err(|_| err(line, "not UTF-8".into()))?;
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            let raw: RawLine = serde_json::from_str(text).map_err(|e| {
                // serde's own "at line 1 column C" would contradict our line number.
                let m = e.to_string();
                let m = m.rsplit_once(" at line ").map_or(m.as_str(), |(a, _)| a);
                err(
                    line,
                    format!(
                        "expected {{\"step\": u64, \"layer\": u32, \"experts\": [u32, ...]}}: \
                         {m} (column {})",
                        e.column()
                    ),
                )
            })?;
            if raw.layer > MAX_LAYER {
                return Err(err(line, format!("layer {} > {MAX_LAYER}", raw.layer)));
            }
            if raw.experts.is_empty() {
                return Err(err(line, "empty expert list".into()));
            }
            if let Some(&e) = raw.experts.iter().find(|&&e| e > MAX_EXPERT) {
                return Err(err(line, format!("expert id {e} > {MAX_EXPERT}")));
            }
            // The store serves duplicates from one slot (one request each): do the same.
            let mut experts = Vec::with_capacity(raw.experts.len());
            let mut seen = std::collections::HashSet::with_capacity(raw.experts.len());
            for e in raw.experts {
                if seen.insert(e) {
                    experts.push(e);
                }
            }
            if experts.len() > MAX_BATCH {
                return Err(err(
                    line,
                    format!("{} experts in one batch > {MAX_BATCH}", experts.len()),
                ));
            }
            requests += experts.len() as u64;
            if requests > MAX_REQUESTS {
                return Err(err(
                    line,
                    format!("more than {MAX_REQUESTS} requests in total"),
                ));
            }
            self.batches.push(TraceBatch {
                step: raw.step,
                layer: raw.layer,
                experts,
            });
        }
        self.jobs += 1;
        Ok(())
    }

    /// Read trace files in order, each a job.
    pub fn read_files<P: AsRef<Path>>(paths: &[P]) -> Result<Trace, TraceError> {
        let mut t = Trace::default();
        for p in paths {
            let name = p.as_ref().display().to_string();
            let f = std::fs::File::open(p.as_ref()).map_err(|e| TraceError {
                file: name.clone(),
                line: 0,
                message: format!("cannot open: {e}"),
            })?;
            t.push_job(&name, std::io::BufReader::new(f))?;
        }
        if t.batches.is_empty() {
            return Err(TraceError {
                file: paths
                    .iter()
                    .map(|p| p.as_ref().display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                line: 0,
                message: "no requests in the trace".into(),
            });
        }
        Ok(t)
    }

    /// Experts requested in total.
    pub fn requests(&self) -> u64 {
        self.batches.iter().map(|b| b.experts.len() as u64).sum()
    }

    /// Distinct (layer, expert) pairs: the working set.
    pub fn working_set(&self) -> usize {
        let mut s = std::collections::HashSet::new();
        for b in &self.batches {
            for &e in &b.experts {
                s.insert((b.layer, e));
            }
        }
        s.len()
    }

    /// The largest batch (the smallest cache that can replay the trace), and where it is.
    pub fn max_batch(&self) -> (usize, u64, u32) {
        self.batches
            .iter()
            .map(|b| (b.experts.len(), b.step, b.layer))
            .max_by_key(|x| x.0)
            .unwrap_or((0, 0, 0))
    }

    /// Distinct layers.
    pub fn layers(&self) -> usize {
        let s: std::collections::HashSet<u32> = self.batches.iter().map(|b| b.layer).collect();
        s.len()
    }
}

// ---------------------------------------------------------------------------------------------
// Replay

/// Counters of one replay, defined exactly as the store's (`k3_proto::wire::Counters`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    /// Experts requested.
    pub requests: u64,
    /// Requested experts RESIDENT before the request.
    pub resident_hits: u64,
    /// Requested experts that were not.
    pub misses: u64,
    /// RESIDENT experts evicted.
    pub evictions: u64,
    /// Requests of decode steps (step ≥ 1).
    pub decode_requests: u64,
    /// Resident hits of decode steps.
    pub decode_hits: u64,
}

impl Counts {
    /// TRUE resident hit rate.
    pub fn hit_rate(&self) -> f64 {
        ratio(self.resident_hits, self.requests)
    }
    /// TRUE resident hit rate of decode steps.
    pub fn decode_hit_rate(&self) -> f64 {
        ratio(self.decode_hits, self.decode_requests)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Why a replay cannot run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplayError {
    /// A batch needs more slots than the cache has.
    TooSmall {
        /// Slots.
        capacity: usize,
        /// The batch's distinct experts.
        batch: usize,
        /// Where.
        step: u64,
        /// Where.
        layer: u32,
    },
    /// The table refused for another reason (a bug: a sequential replay holds no leases).
    Table(String),
}

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplayError::TooSmall {
                capacity,
                batch,
                step,
                layer,
            } => write!(
                f,
                "capacity {capacity} slots < batch of {batch} experts (step {step}, layer {layer})"
            ),
            ReplayError::Table(m) => write!(f, "slot table refused: {m}"),
        }
    }
}

impl std::error::Error for ReplayError {}

fn too_small(capacity: usize, b: &TraceBatch) -> ReplayError {
    ReplayError::TooSmall {
        capacity,
        batch: b.experts.len(),
        step: b.step,
        layer: b.layer,
    }
}

/// Replay `trace` through a real [`SlotTable`] of `capacity` slots evicted by `policy`, as one
/// sequential client: reserve each batch, publish its loads, release its leases.
pub fn replay_store(
    trace: &Trace,
    capacity: usize,
    policy: Box<dyn EvictionPolicy>,
) -> Result<Counts, ReplayError> {
    if let Some(b) = trace.batches.iter().find(|b| b.experts.len() > capacity) {
        return Err(too_small(capacity, b));
    }
    let mut t = SlotTable::new(capacity, policy);
    let mut c = Counts::default();
    for b in &trace.batches {
        let hits0 = t.counters().resident_hits;
        let r = t
            .reserve(b.layer, &b.experts)
            .map_err(|e| ReplayError::Table(e.to_string()))?;
        for x in &r {
            if let Reserved::Load { slot, .. } = *x {
                t.publish(slot, Ok(()));
            }
        }
        for x in &r {
            t.release(x.slot());
        }
        if b.step >= 1 {
            c.decode_requests += b.experts.len() as u64;
            c.decode_hits += t.counters().resident_hits - hits0;
        }
    }
    let tc = t.counters();
    c.requests = tc.requests;
    c.resident_hits = tc.resident_hits;
    c.misses = tc.misses;
    c.evictions = tc.evictions;
    Ok(c)
}

/// Orderings of the offline simulator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offline {
    /// Belady / OPT: evict the resident expert whose next request is farthest (or never).
    Belady,
    /// Least recently used (to check the simulator against the real table).
    Lru,
}

/// For every request (flattened in batch order) the index of the next batch requesting the
/// same (layer, expert), or `u64::MAX` if none.
fn next_uses(trace: &Trace) -> Vec<u64> {
    let total: usize = trace.batches.iter().map(|b| b.experts.len()).sum();
    let mut next = vec![u64::MAX; total];
    let mut later: HashMap<(u32, u32), u64> = HashMap::new();
    let mut pos = total;
    for (bi, b) in trace.batches.iter().enumerate().rev() {
        pos -= b.experts.len();
        for (i, &e) in b.experts.iter().enumerate() {
            if let Some(n) = later.insert((b.layer, e), bi as u64) {
                next[pos + i] = n;
            }
        }
    }
    next
}

/// Replay `trace` through `capacity` slots with an offline ordering, mirroring
/// `SlotTable::reserve` for one sequential client.
pub fn replay_offline(
    trace: &Trace,
    capacity: usize,
    order: Offline,
) -> Result<Counts, ReplayError> {
    if let Some(b) = trace.batches.iter().find(|b| b.experts.len() > capacity) {
        return Err(too_small(capacity, b));
    }
    let next = match order {
        Offline::Belady => next_uses(trace),
        Offline::Lru => Vec::new(),
    };
    // Resident experts with their eviction priority; the largest priority is evicted first.
    let mut prio: HashMap<(u32, u32), u64> = HashMap::new();
    let mut queue: BTreeSet<(u64, u32, u32)> = BTreeSet::new();
    let mut c = Counts::default();
    let mut clock = 0u64;
    let mut pos = 0usize;
    let mut hits: Vec<usize> = Vec::new();
    let mut loads: Vec<usize> = Vec::new();
    for b in &trace.batches {
        hits.clear();
        loads.clear();
        // Lease the hits: out of the eviction queue while the batch is served.
        for (i, &e) in b.experts.iter().enumerate() {
            if let Some(&p) = prio.get(&(b.layer, e)) {
                queue.remove(&(p, b.layer, e));
                hits.push(i);
            } else {
                loads.push(i);
            }
        }
        // Each miss takes a free slot, else evicts (never a leased hit, never this batch's
        // loads: they are not in the queue yet).
        let mut occupied = prio.len();
        for _ in &loads {
            if occupied >= capacity {
                let (_, l, x) = queue
                    .pop_last()
                    .ok_or_else(|| ReplayError::Table("no evictable slot".into()))?;
                prio.remove(&(l, x));
                c.evictions += 1;
                occupied -= 1;
            }
            occupied += 1;
        }
        // Publish: hits were touched first (in reserve), then the loads.
        for &i in hits.iter().chain(loads.iter()) {
            let e = b.experts[i];
            clock += 1;
            let p = match order {
                Offline::Belady => next[pos + i],
                Offline::Lru => u64::MAX - clock,
            };
            prio.insert((b.layer, e), p);
            queue.insert((p, b.layer, e));
        }
        let n = b.experts.len() as u64;
        c.requests += n;
        c.resident_hits += hits.len() as u64;
        c.misses += loads.len() as u64;
        if b.step >= 1 {
            c.decode_requests += n;
            c.decode_hits += hits.len() as u64;
        }
        pos += b.experts.len();
    }
    Ok(c)
}

/// One row of an evaluation.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Row {
    /// Slots.
    pub capacity: usize,
    /// Policy name (`belady` for the offline ceiling).
    pub policy: String,
    /// Counters.
    pub counts: Counts,
    /// TRUE resident hit rate.
    pub hit_rate: f64,
    /// TRUE resident hit rate of decode steps.
    pub decode_hit_rate: f64,
    /// (hit − lru) / (belady − lru); `None` for lru, belady, or when belady = lru.
    pub gap_closed: Option<f64>,
}

/// Replay `policies` (names for [`policy_by_name`]) and Belady at each capacity. LRU is always
/// included, since the gap is measured from it. Rows per capacity: belady, lru, then `policies`.
pub fn evaluate(
    trace: &Trace,
    capacities: &[usize],
    policies: &[String],
) -> Result<Vec<Row>, ReplayError> {
    let mut rows = Vec::new();
    for &cap in capacities {
        let belady = replay_offline(trace, cap, Offline::Belady)?;
        let lru = replay_store(trace, cap, Box::new(Lru::new(cap)))?;
        let (bh, lh) = (belady.hit_rate(), lru.hit_rate());
        let row = |name: &str, c: Counts, gap: bool| Row {
            capacity: cap,
            policy: name.to_string(),
            hit_rate: c.hit_rate(),
            decode_hit_rate: c.decode_hit_rate(),
            gap_closed: (gap && bh > lh).then(|| (c.hit_rate() - lh) / (bh - lh)),
            counts: c,
        };
        rows.push(row("belady", belady, false));
        rows.push(row("lru", lru, false));
        for p in policies.iter().filter(|p| p.as_str() != "lru") {
            let pol = policy_by_name(p, cap)
                .ok_or_else(|| ReplayError::Table(format!("unknown policy {p}")))?;
            let c = replay_store(trace, cap, pol)?;
            rows.push(row(p, c, true));
        }
    }
    Ok(rows)
}
