//! Binding happens once per layer, not once per pass, and a forward pass allocates nothing per
//! layer: every temporary lives in the sequence's buffers, which grow to the largest pass once
//! (ARCHITECTURE.md, "Run state"). Allocations are counted by a global allocator; those a weight
//! source makes to answer a call (its own bookkeeping, not the engine's) are counted apart. The
//! same allocator follows the live bytes: a pass's peak is what its buffers' owners state
//! (`Work::bytes_for`, `SeqState::bytes_for`, `Journal::bytes_for`), the memory plan's number.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use common::{tiny_dims, Gen, MemSource};
use k3_store::runtime::source::{
    ExpertBatch, LayerRun, PendingExperts, Region, SourceError, SourceStats, WeightSource,
};
use k3_worker::engine::sampling::Sampler;
use k3_worker::model::state::{Journal, PassShape, SeqState, Work};
use k3_worker::model::Lookahead;
use k3_worker::model::{Logits, Model, TensorShapes};

struct Counting;

static BYTES: AtomicU64 = AtomicU64::new(0);
/// Bytes allocated and not yet freed (counted threads only), and the most there were.
/// (Signed: a thread also frees what it allocated before it was counted.)
static LIVE: AtomicI64 = AtomicI64::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);
static CALLS: AtomicU64 = AtomicU64::new(0);
/// Allocations made inside weight-source calls.
static SOURCE_CALLS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set on the one thread the engine runs on ([`on_one_thread`]): only its allocations are
    /// counted, not the test harness's (which reports other tests while this one runs).
    static COUNTED: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if COUNTED.try_with(Cell::get).unwrap_or(false) {
            BYTES.fetch_add(l.size() as u64, Ordering::Relaxed);
            CALLS.fetch_add(1, Ordering::Relaxed);
            let size = l.size() as i64;
            let live = LIVE.fetch_add(size, Ordering::Relaxed).wrapping_add(size);
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        // SAFETY: the caller's contract for `alloc` is passed on unchanged.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if COUNTED.try_with(Cell::get).unwrap_or(false) {
            LIVE.fetch_sub(l.size() as i64, Ordering::Relaxed);
        }
        // SAFETY: `p` came from `System.alloc` with the same layout.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// The counters are global: the tests take turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `f` on a pool of one thread, the only thread whose allocations are counted: every
/// kernel and every parallel loop then runs on it, so the buffers each thread keeps
/// (`kernels::with_buffer`) are grown once, not once per thread a task happens to land on, and
/// the counts are exact. The buffers are the same ones a pool of several threads uses.
fn on_one_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .start_handler(|_| COUNTED.with(|c| c.set(true)))
        .build()
        .expect("a pool of one thread")
        .install(f)
}

/// `f`'s allocations are the source's, not the engine's.
fn source<T>(f: impl FnOnce() -> T) -> T {
    let c0 = CALLS.load(Ordering::Relaxed);
    let r = f();
    SOURCE_CALLS.fetch_add(CALLS.load(Ordering::Relaxed) - c0, Ordering::Relaxed);
    r
}

/// The engine's allocations so far (all, minus the source's).
fn engine_calls() -> u64 {
    CALLS.load(Ordering::Relaxed) - SOURCE_CALLS.load(Ordering::Relaxed)
}

/// A `MemSource` whose every layer is also "resident" (so the router lookahead runs) and is
/// given back before each expert wait, with its allocations set apart.
struct Counted<'a>(&'a MemSource);

impl WeightSource for Counted<'_> {
    fn model_tensor(&self, name: &str) -> Result<Region, SourceError> {
        source(|| self.0.model_tensor(name))
    }
    fn layer(&self, l: usize) -> Result<LayerRun, SourceError> {
        source(|| self.0.layer(l))
    }
    fn prefetch_layer(&self, l: usize) {
        source(|| self.0.prefetch_layer(l))
    }
    fn end_pass(&self) -> Result<(), SourceError> {
        source(|| self.0.end_pass())
    }
    fn experts(&self, l: usize, ids: &[u32]) -> Result<ExpertBatch, SourceError> {
        source(|| self.0.experts(l, ids))
    }
    fn request_experts(&self, l: usize, ids: &[u32]) -> PendingExperts {
        source(|| PendingExperts::ready(self.0.experts(l, ids)))
    }
    fn prefetch_experts(&self, l: usize, ids: &[u32]) {
        source(|| self.0.prefetch_experts(l, ids))
    }
    fn resident_layer(&self, l: usize) -> Option<LayerRun> {
        source(|| self.0.layer(l).ok())
    }
    /// As a streaming source says of its ring layers: the engine's copy of what a MoE layer
    /// reads after its expert wait is counted too.
    fn releases_layers_early(&self, _l: usize) -> bool {
        true
    }
    fn max_expert_batch(&self) -> usize {
        self.0.max_expert_batch()
    }
    fn stats(&self) -> SourceStats {
        source(|| self.0.stats())
    }
}

#[test]
fn layers_are_bound_once_and_a_decode_step_allocates_nothing_per_layer() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    on_one_thread(|| {
        let d = tiny_dims();
        let mem = MemSource::random(&d, 11);
        let src = Counted(&mem);
        for lookahead in [Lookahead::Off, Lookahead::MlpIn, Lookahead::AttnIn] {
            let mut m = Model::new(d.clone(), &src, Some(&mem as &dyn TensorShapes)).unwrap();
            m.options.lookahead = lookahead;
            let mut per_step: Vec<(u64, u64)> = Vec::new();
            let mut last = (0u64, 0u64);
            let mut steps = 0;
            let (_, m) = Gen::new(8, Sampler::Greedy).run(m, &[3, 14, 15, 92, 65], &mut |_| {
                let now = (engine_calls(), BYTES.load(Ordering::Relaxed));
                // Step 0 is the prefill; step 1 is the first decode step, whose buffers are sized
                // for one position (the prefill's were sized for five, and are reused).
                if steps >= 1 {
                    per_step.push((now.0 - last.0, now.1 - last.1));
                }
                steps += 1;
                last = (engine_calls(), BYTES.load(Ordering::Relaxed));
            });
            assert_eq!(m.bound_layers(), d.n_layers);
            assert_eq!(
                m.bind_count(),
                d.n_layers as u64,
                "8 passes must bind each layer once, not once per pass"
            );
            assert!(
                m.counters.lookahead_layers > 0 || lookahead == Lookahead::Off,
                "the lookahead must have run"
            );
            eprintln!(
                "{lookahead:?}: engine allocations per decode step (calls, bytes): {per_step:?}"
            );
            // Fewer allocations per step than the model has layers (13), and no growth: a step
            // allocates its logits and the engine's per-step bookkeeping, never per layer.
            for &(calls, _) in &per_step {
                assert!(
                    calls <= 6,
                    "{lookahead:?}: a decode step allocated {calls} times: {per_step:?}"
                );
            }
        }
    });
}

#[test]
fn a_verify_pass_allocates_nothing_per_layer_once_its_buffers_have_grown() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    on_one_thread(|| {
        let d = tiny_dims();
        let mem = MemSource::random(&d, 12);
        let src = Counted(&mem);
        let mut m = Model::new(d.clone(), &src, Some(&mem as &dyn TensorShapes)).unwrap();
        let mut st = m.new_state(64);
        m.forward(&[5, 6, 7], &mut st, Logits::Last).unwrap();
        let mut per_pass = Vec::new();
        for pass in 0..4 {
            let c0 = engine_calls();
            st.begin_journal();
            // Five positions at once with logits for all of them, as a K = 4 verify pass runs, then
            // keep two: the rollback replays the KDA recurrence from the journal.
            let logits = m.forward(&[1, 2, 3, 4, 5], &mut st, Logits::All).unwrap();
            assert_eq!(logits.len(), 5 * d.vocab);
            st.rollback(2).unwrap();
            drop(logits);
            if pass > 0 {
                per_pass.push(engine_calls() - c0);
            }
        }
        eprintln!("engine allocations per verify pass + rollback: {per_pass:?}");
        assert!(per_pass.iter().all(|&c| c <= 2), "{per_pass:?}");
    });
}

#[test]
fn a_pass_larger_than_a_verify_pass_does_not_keep_its_buffers() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    on_one_thread(|| {
        let d = tiny_dims();
        let mem = MemSource::random(&d, 13);
        let src = Counted(&mem);
        let m_new = || Model::new(d.clone(), &src, Some(&mem as &dyn TensorShapes)).unwrap();
        let decode_after = |prefill: usize| {
            let mut m = m_new();
            let mut st = m.new_state(64);
            let ids: Vec<u32> = (0..prefill as u32).map(|i| 1 + i % 90).collect();
            m.forward(&ids, &mut st, Logits::Last).unwrap();
            let c0 = engine_calls();
            m.forward(&[7], &mut st, Logits::Last).unwrap();
            engine_calls() - c0
        };
        // A prefill of 5 positions leaves buffers the decode step reuses: its logits, and the
        // attention scores' per-thread buffer growing by a position.
        let small = decode_after(5);
        assert!(small <= 4, "{small}");
        // A chunk of 40 (more than KEEP_BUFFERS_MAX_POSITIONS = MAX_K + 1) freed its buffers, so the
        // decode step allocates its own again, once per stage buffer.
        let large = decode_after(40);
        eprintln!("decode step allocations after a 5-position pass: {small}, after 40: {large}");
        assert!(
            large >= small + 10,
            "a 40-position pass kept its buffers: the next step allocated {large} times ({small} after \
             a 5-position pass)"
        );
    });
}

/// What a pass's buffers' owners state is what the pass holds at its peak: for a decode step, a
/// verify pass (journaled, every position's logits), passes that keep their buffers and prefill
/// chunks that free each stage's, the peak of the live bytes (the sequence's state, every
/// temporary, the kernels' per-thread buffers, the logits) is at most the statement, and the
/// statement at most 15% above it, each within [`RAYON_ALLOWANCE`].
/// What the pool's own job queues allocate on its thread during a pass, varying from run to run
/// with how its deques grow (not a buffer of the pass; the same pass measured 132–152 KB).
const RAYON_ALLOWANCE: u64 = 64 << 10;

#[test]
fn a_pass_peaks_at_what_its_buffers_owners_state() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let d = tiny_dims();
    let mem = MemSource::random(&d, 11);
    let src = Counted(&mem);
    let mut wrong = Vec::new();
    let prompt: Vec<u32> = (0..200).map(|i| (i * 7 + 3) % d.vocab as u32).collect();
    for (rows, verify) in [
        (1, false),
        (5, true),
        (17, false),
        (17, true),
        (18, false),
        (64, false),
        (200, false),
    ] {
        // A fresh thread: its kernel buffers start empty, as a worker's do, but for those of
        // the one-position pass that binds every layer first (the bound layers are the
        // model's, not the pass's).
        let (peak, stated) = on_one_thread(|| {
            let mut m = Model::new(d.clone(), &src, Some(&mem as &dyn TensorShapes)).unwrap();
            m.forward(&[1], &mut m.new_state(1), Logits::Last).unwrap();
            let capacity = rows + 3;
            let live0 = LIVE.load(Ordering::Relaxed);
            PEAK.store(live0, Ordering::Relaxed);
            let mut st = m.new_state(capacity);
            let which = if verify {
                st.begin_journal();
                Logits::All
            } else {
                Logits::Last
            };
            let logits = m.forward(&prompt[..rows], &mut st, which).unwrap();
            drop(logits);
            let peak = (PEAK.load(Ordering::Relaxed) - live0) as u64;
            let shape = PassShape {
                rows,
                logits_rows: if verify { rows } else { 1 },
                context: capacity,
                journaled: verify,
                threads: 0,
            };
            let mut stated = SeqState::bytes_for(&d, capacity) + Work::bytes_for(&d, &shape);
            if verify {
                stated += Journal::bytes_for(&d, rows);
            }
            (peak, stated)
        });
        let ratio = stated as f64 / peak as f64;
        eprintln!("rows {rows} verify {verify}: peak {peak} B, stated {stated} B ({ratio:.3})");
        if peak > stated + RAYON_ALLOWANCE || stated as f64 > 1.15 * (peak + RAYON_ALLOWANCE) as f64
        {
            wrong.push(format!(
                "rows {rows} verify {verify}: peak {peak} B, stated {stated} B"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "stated outside [peak, 1.15 peak]: {wrong:#?}"
    );
}
