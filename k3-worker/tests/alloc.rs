//! Binding happens once per layer, not once per pass, and what a decode step allocates (counted
//! by a global allocator) does not grow from one step to the next.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use common::{tiny_dims, MemSource};
use k3_worker::generate::{generate, GenOptions, Sampler};
use k3_worker::model::{Model, TensorShapes};

struct Counting;

static BYTES: AtomicU64 = AtomicU64::new(0);
static CALLS: AtomicU64 = AtomicU64::new(0);
static LARGEST: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        BYTES.fetch_add(l.size() as u64, Ordering::Relaxed);
        CALLS.fetch_add(1, Ordering::Relaxed);
        LARGEST.fetch_max(l.size() as u64, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on unchanged.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `System.alloc` with the same layout.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

#[test]
fn layers_are_bound_once_and_decode_allocation_does_not_grow() {
    let d = tiny_dims();
    let src = MemSource::random(&d, 11);
    let mut m = Model::new(d.clone(), &src, Some(&src as &dyn TensorShapes)).unwrap();
    let opts = GenOptions {
        max_new: 6,
        full_recompute: false,
        sampler: Sampler::Greedy,
        stop_ids: vec![],
        keep_step0_logits: false,
        prefill_chunk: 0,
        spec: k3_worker::spec::SpecMode::Off,
    };
    let mut per_step: Vec<(u64, u64, u64)> = Vec::new();
    let mut last = (0u64, 0u64);
    let mut first = true;
    generate(&mut m, &[3, 14, 15, 92, 65], &opts, &mut |_| {
        let now = (BYTES.load(Ordering::Relaxed), CALLS.load(Ordering::Relaxed));
        let largest = LARGEST.swap(0, Ordering::Relaxed);
        if !first {
            per_step.push((now.0 - last.0, now.1 - last.1, largest));
        }
        first = false;
        last = (BYTES.load(Ordering::Relaxed), CALLS.load(Ordering::Relaxed));
    })
    .unwrap();
    assert_eq!(m.bound_layers(), d.n_layers);
    assert_eq!(
        m.bind_count(),
        d.n_layers as u64,
        "6 passes must bind each layer once, not once per pass"
    );
    // Decode steps allocate the same from one step to the next (nothing bound, widened or
    // copied again as the run goes on; the top-level buffers are reused).
    eprintln!("per decode step (bytes, calls, largest allocation): {per_step:?}");
    let (lo, hi) = per_step
        .iter()
        .fold((u64::MAX, 0), |(lo, hi), &(b, _, _)| (lo.min(b), hi.max(b)));
    assert!(hi as f64 <= lo as f64 * 1.1, "{per_step:?}");
}
