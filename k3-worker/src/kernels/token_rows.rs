//! [`TokenRows`]: the `[n, rows]` output of a multi-token product, written by the pool's tasks
//! in place, each task the output rows it computed for every token.
//!
//! A task of [`super::by_rows`] computes a chunk of output rows for all `n` tokens; in `y` those
//! values lie in `n` separate runs (`y[t·rows + r0 ..]`), interleaved with other tasks' runs, so
//! no safe split of `y` gives each task its own. Writing them from the task (while the chunk's
//! result is in L1) replaces a rows-major scratch and a second, strided pass over it on the pool.

use std::marker::PhantomData;

/// `y [n, rows]`, borrowed mutably for its lifetime, written a chunk of rows at a time.
pub(super) struct TokenRows<'a> {
    ptr: *mut f32,
    rows: usize,
    n: usize,
    _y: PhantomData<&'a mut [f32]>,
}

// SAFETY: `TokenRows` is a `&mut [f32]` (which is Send and Sync) whose writes go through
// `write`, whose contract keeps the tasks' writes disjoint.
unsafe impl Send for TokenRows<'_> {}
// SAFETY: as above: shared references only call `write`, on disjoint elements.
unsafe impl Sync for TokenRows<'_> {}

impl<'a> TokenRows<'a> {
    /// `y` as `[n, rows]` (its length must be `n·rows`).
    pub(super) fn new(y: &'a mut [f32], rows: usize, n: usize) -> TokenRows<'a> {
        assert_eq!(Some(y.len()), rows.checked_mul(n), "output [n, rows]");
        TokenRows {
            ptr: y.as_mut_ptr(),
            rows,
            n,
            _y: PhantomData,
        }
    }

    /// Rows `r0 .. r0 + k` of every token from `chunk [k, n]` (rows-major, as the row kernels
    /// write it): `y[t·rows + r0 + i] = chunk[i·n + t]`.
    ///
    /// # Safety
    /// No other call on this value, before, during or after this one, writes any of the rows
    /// `r0 .. r0 + k` (the tasks of one product own disjoint row ranges).
    pub(super) unsafe fn write(&self, r0: usize, chunk: &[f32]) {
        let k = chunk.len() / self.n;
        assert!(
            chunk.len() == k * self.n && r0 + k <= self.rows,
            "chunk of {} values at row {r0} of [{}, {}]",
            chunk.len(),
            self.n,
            self.rows
        );
        let run = |t: usize| {
            let at = self.ptr.wrapping_add(t * self.rows + r0);
            // SAFETY: t·rows + r0 + k <= n·rows = y.len() (asserted), so the run lies in `y`;
            // no other call writes rows r0..r0+k (this function's contract) and `y` is
            // borrowed mutably by `self`, so nothing else reads or writes it meanwhile; each
            // token's run is made once per call, so the runs never alias.
            unsafe { std::slice::from_raw_parts_mut(at, k) }
        };
        match self.n {
            // The decode step of 4 or 2 sequences: a fixed width the compiler transposes in
            // registers.
            4 => transpose::<4>(std::array::from_fn(run), chunk),
            2 => transpose::<2>(std::array::from_fn(run), chunk),
            _ => (0..self.n).for_each(|t| {
                for (d, &v) in run(t).iter_mut().zip(chunk[t..].iter().step_by(self.n)) {
                    *d = v;
                }
            }),
        }
    }
}

/// `runs[t][i] = chunk[i·N + t]`.
fn transpose<const N: usize>(runs: [&mut [f32]; N], chunk: &[f32]) {
    let k = chunk.len() / N;
    let mut runs = runs.map(|r| &mut r[..k]);
    for (i, v) in chunk.chunks_exact(N).enumerate() {
        for (run, &x) in runs.iter_mut().zip(v) {
            run[i] = x;
        }
    }
}
