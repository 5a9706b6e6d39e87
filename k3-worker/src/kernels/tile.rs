//! Multi-token products that decode each weight ONCE for all tokens (both SIMD tiers), used
//! only with `Kernels::with_strips`: on AVX2 they measured slower than the token-block kernels
//! (buffered f32 weights move 2–4× more bytes through L1 than re-widening bf16 from L2;
//! docs/BENCHMARKS.md, 2026-12-03), so they are off by default until they win somewhere.
//!
//! A task's rows (at most [`super::ROW_CHUNK`]) are walked in column STRIPS of whole 32-column
//! blocks. For each strip, every row's blocks are decoded once into a small buffer of f32 vectors
//! (the exact vectors the one-token kernel multiplies: bf16 widened, or an MXFP4 group's E2M1
//! values and its scale), and then every token block of the product passes over that buffer with
//! its accumulators in registers. Between strips the accumulators wait in memory, so each
//! (row, token) pair still has one accumulator (two for MXFP4: even and odd groups) receiving the
//! same FMAs in the same column order as in the one-token kernel: the results are the same bits
//! (`matmul` row `t` == `matvec` of token `t`, tested per tier). The columns after the last whole
//! block (bf16 only) are finished by the tier's own one-token code.
//!
//! Loads per FMA: a strip's activations (`n` tokens × the strip) stay in L1 while the rows'
//! buffers pass; the weights come from memory once.
//!
//! Generic over the tier's vector ([`Lanes`]); each tier instantiates these functions inside its
//! own `#[target_feature]` entry points (everything here is `#[inline(always)]`, so the
//! intrinsics are compiled with that tier's features).

/// One tier's f32 vector.
pub(super) trait Lanes: Copy {
    /// The vector.
    type F: Copy;
    /// f32 lanes.
    const LANES: usize;
    /// Vectors per 32 columns (`32 / LANES`).
    const V: usize = 32 / Self::LANES;
    /// All lanes +0.
    ///
    /// # Safety
    /// The CPU supports the tier.
    unsafe fn zero() -> Self::F;
    /// `LANES` floats at `p`.
    ///
    /// # Safety
    /// `LANES` floats at `p` are readable; the CPU supports the tier.
    unsafe fn load(p: *const f32) -> Self::F;
    /// `a·b + c`, one rounding.
    ///
    /// # Safety
    /// The CPU supports the tier.
    unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `a·b`.
    ///
    /// # Safety
    /// The CPU supports the tier.
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// The tier's fixed-order sum of `a + b`'s lanes (the MXFP4 row total).
    ///
    /// # Safety
    /// The CPU supports the tier.
    unsafe fn hsum_pair(a: Self::F, b: Self::F) -> f32;
}

/// A bf16 matrix (raw or coded) as the strip kernel reads it.
pub(super) trait Bf16Blocks<L: Lanes> {
    /// Columns.
    fn cols(&self) -> usize;
    /// The `V` f32 vectors of whole block `b` (columns `32b .. 32b+32`) of row `i`, in the order
    /// the tier's split activations pair with (entries past `V` unused).
    ///
    /// # Safety
    /// Row `i` exists and `32b + 32 <= cols`; the CPU supports the tier.
    unsafe fn widened(&self, i: usize, b: usize) -> [L::F; 4];
    /// Row `i` dotted with token `x` (`cols` split activations) from column `32·⌊cols/32⌋` on,
    /// continuing `acc`, reduced to a float: the one-token kernel's last steps.
    ///
    /// # Safety
    /// Row `i` exists, `x.len() == cols`; the CPU supports the tier.
    unsafe fn finish(&self, i: usize, acc: L::F, x: &[f32]) -> f32;
}

/// An MXFP4 matrix as the strip kernel reads it.
pub(super) trait Mxfp4Groups<L: Lanes> {
    /// Columns (a multiple of 32).
    fn cols(&self) -> usize;
    /// Group `g` of row `i`: its `V` E2M1 vectors (paired like the split activations) and its
    /// scale `2^(s−127)` in every lane.
    ///
    /// # Safety
    /// Row `i` and group `g` exist; the CPU supports the tier.
    unsafe fn group(&self, i: usize, g: usize) -> ([L::F; 4], L::F);
}

/// Blocks per strip for `n` tokens: the strip's activations (`n · 32 · blocks` floats) stay
/// within 16 KiB of L1. Even, so every strip starts at an even MXFP4 group.
fn strip_blocks(n: usize) -> usize {
    (128 / n.max(1)).clamp(2, 16) & !1
}

/// `out [k, n]` for rows `0..k` of `src` and tokens `x [n, cols]` (split activations). `R` rows
/// × `T` tokens of accumulators live in registers at a time.
///
/// # Safety
/// `src` has `k` rows; `x.len() == n·cols`, `out.len() == k·n`; the CPU supports the tier.
#[inline(always)]
pub(super) unsafe fn bf16_strips<L: Lanes, S: Bf16Blocks<L>, const R: usize, const T: usize>(
    src: &S,
    k: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let cols = src.cols();
    assert!(
        x.len() == n * cols && out.len() == k * n,
        "strip product shapes"
    );
    let full = cols / 32;
    let sbl = strip_blocks(n);
    // SAFETY: CPU support is this function's contract (as for every call below; rows `< k`,
    // blocks `< full` and tokens `< n` are in bounds by the loops' ranges).
    let zero = unsafe { L::zero() };
    let mut acc = vec![zero; k * n];
    let mut wbuf = vec![[zero; 4]; R * sbl];
    // SAFETY: `src` has k rows of `full` blocks, x has n tokens (asserted); CPU support is this
    // function's contract.
    unsafe {
        walk::<_, _, _, R, T>(
            &Bf16Walk::<L, S, R, T>(src, std::marker::PhantomData),
            k,
            n,
            full,
            sbl,
            &mut wbuf,
            &mut acc,
            x,
            cols,
        )
    };
    for i in 0..k {
        for t in 0..n {
            // SAFETY: row i < k; token t's activations are `cols` floats.
            out[i * n + t] = unsafe { src.finish(i, acc[i * n + t], &x[t * cols..(t + 1) * cols]) };
        }
    }
}

/// As [`bf16_strips`] for MXFP4 (`x` split like the one-token MXFP4 kernel's).
///
/// # Safety
/// As [`bf16_strips`].
#[inline(always)]
pub(super) unsafe fn mxfp4_strips<L: Lanes, S: Mxfp4Groups<L>, const R: usize, const T: usize>(
    src: &S,
    k: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let cols = src.cols();
    assert!(
        x.len() == n * cols && out.len() == k * n,
        "strip product shapes"
    );
    let groups = cols / 32;
    let sbl = strip_blocks(n);
    // SAFETY: as in `bf16_strips`.
    let zero = unsafe { L::zero() };
    // Two accumulators per (row, token): groups of even and of odd index.
    let mut acc = vec![zero; 2 * k * n];
    let mut wbuf = vec![([zero; 4], zero); R * sbl];
    // SAFETY: `src` has k rows of `groups` groups, x has n tokens (asserted); CPU support is
    // this function's contract.
    unsafe {
        walk::<_, _, _, R, T>(
            &Mxfp4Walk::<L, S, R, T>(src, std::marker::PhantomData),
            k,
            n,
            groups,
            sbl,
            &mut wbuf,
            &mut acc,
            x,
            cols,
        )
    };
    for i in 0..k * n {
        // SAFETY: CPU support is this function's contract.
        out[i] = unsafe { L::hsum_pair(acc[2 * i], acc[2 * i + 1]) };
    }
}

/// What the strip walk does for one kernel: decode a row's block into the buffer, run a tile.
/// Methods of a type, not closures: a closure is a function of its own, compiled without the
/// tier's `#[target_feature]`s (measured on AVX-512: every intrinsic in the MXFP4 tile became a
/// call, 35× slower); `#[inline(always)]` methods are compiled inside the tier's entry point.
trait StripOps {
    /// A decoded block.
    type W: Copy;
    /// An accumulator.
    type A;
    /// Row `i`'s block `b`, decoded.
    ///
    /// # Safety
    /// Row `i` and block `b` exist; the CPU supports the tier.
    unsafe fn decode(&self, i: usize, b: usize) -> Self::W;
    /// The tile at `at` (all `R` rows? all `T` tokens?) over the buffer.
    ///
    /// # Safety
    /// The tile's rows and tokens exist, the buffer holds the strip; the CPU supports the tier.
    unsafe fn tile(
        &self,
        at: &Tile<'_>,
        full_r: bool,
        full_t: bool,
        wbuf: &[Self::W],
        acc: &mut [Self::A],
    );
}

/// [`bf16_strips`]' walk.
struct Bf16Walk<'s, L, S, const R: usize, const T: usize>(&'s S, std::marker::PhantomData<L>);

impl<L: Lanes, S: Bf16Blocks<L>, const R: usize, const T: usize> StripOps
    for Bf16Walk<'_, L, S, R, T>
{
    type W = [L::F; 4];
    type A = L::F;
    #[inline(always)]
    unsafe fn decode(&self, i: usize, b: usize) -> [L::F; 4] {
        // SAFETY: the caller's contract is `widened`'s.
        unsafe { self.0.widened(i, b) }
    }
    #[inline(always)]
    unsafe fn tile(
        &self,
        at: &Tile<'_>,
        full_r: bool,
        full_t: bool,
        w: &[[L::F; 4]],
        a: &mut [L::F],
    ) {
        // SAFETY (every arm): the tile's rows and tokens exist and the CPU supports the tier
        // (this method's contract).
        match (full_r, full_t) {
            // SAFETY: as above.
            (true, true) => unsafe { at.bf16::<L, R, T>(w, a) },
            // SAFETY: as above.
            (true, false) => unsafe { at.bf16::<L, R, 1>(w, a) },
            // SAFETY: as above.
            (false, true) => unsafe { at.bf16::<L, 1, T>(w, a) },
            // SAFETY: as above.
            (false, false) => unsafe { at.bf16::<L, 1, 1>(w, a) },
        }
    }
}

/// [`mxfp4_strips`]' walk.
struct Mxfp4Walk<'s, L, S, const R: usize, const T: usize>(&'s S, std::marker::PhantomData<L>);

impl<L: Lanes, S: Mxfp4Groups<L>, const R: usize, const T: usize> StripOps
    for Mxfp4Walk<'_, L, S, R, T>
{
    type W = ([L::F; 4], L::F);
    type A = L::F;
    #[inline(always)]
    unsafe fn decode(&self, i: usize, g: usize) -> ([L::F; 4], L::F) {
        // SAFETY: the caller's contract is `group`'s.
        unsafe { self.0.group(i, g) }
    }
    #[inline(always)]
    unsafe fn tile(
        &self,
        at: &Tile<'_>,
        full_r: bool,
        full_t: bool,
        w: &[([L::F; 4], L::F)],
        a: &mut [L::F],
    ) {
        // SAFETY (every arm): the tile's rows and tokens exist and the CPU supports the tier
        // (this method's contract).
        match (full_r, full_t) {
            // SAFETY: as above.
            (true, true) => unsafe { at.mxfp4::<L, R, T>(w, a) },
            // SAFETY: as above.
            (true, false) => unsafe { at.mxfp4::<L, R, 1>(w, a) },
            // SAFETY: as above.
            (false, true) => unsafe { at.mxfp4::<L, 1, T>(w, a) },
            // SAFETY: as above.
            (false, false) => unsafe { at.mxfp4::<L, 1, 1>(w, a) },
        }
    }
}

/// The strip walk shared by both kernels: for each strip of at most `sbl` of the `blocks`
/// blocks, for each group of `R` rows (then single rows), `ops.decode(row, block)` fills the
/// buffer once, then `ops.tile(at, R rows?, T tokens?, buffer, accumulators)` runs for each
/// group of `T` tokens (then single tokens).
///
/// # Safety
/// `ops` has `k` rows of `blocks` blocks, `x` holds `n` tokens of `cols` floats; the CPU
/// supports the tier.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn walk<W: Copy, A, O: StripOps<W = W, A = A>, const R: usize, const T: usize>(
    ops: &O,
    k: usize,
    n: usize,
    blocks: usize,
    sbl: usize,
    wbuf: &mut [W],
    acc: &mut [A],
    x: &[f32],
    cols: usize,
) {
    let mut s = 0;
    while s < blocks {
        let sb = sbl.min(blocks - s);
        let mut r = 0;
        while r < k {
            let rr = if k - r >= R { R } else { 1 };
            for i in 0..rr {
                for b in 0..sb {
                    // SAFETY: row r + i < k, block s + b < blocks (the loops' ranges).
                    wbuf[i * sbl + b] = unsafe { ops.decode(r + i, s + b) };
                }
            }
            let mut t = 0;
            while t < n {
                let tt = if n - t >= T { T } else { 1 };
                let at = Tile {
                    x,
                    cols,
                    n,
                    r,
                    t,
                    s,
                    sb,
                    sbl,
                };
                // SAFETY: rows r..r+rr, tokens t..t+tt exist (the loops' ranges).
                unsafe { ops.tile(&at, rr == R, tt == T, wbuf, acc) };
                t += tt;
            }
            r += rr;
        }
        s += sb;
    }
}

/// Where a tile sits: rows `r..`, tokens `t..`, strip blocks `s .. s+sb` (buffer stride `sbl`).
struct Tile<'x> {
    x: &'x [f32],
    cols: usize,
    n: usize,
    r: usize,
    t: usize,
    s: usize,
    sb: usize,
    sbl: usize,
}

impl Tile<'_> {
    /// `R × T` bf16 accumulators over the strip: per block, vector `j` of every row meets
    /// vector `j` of every token (FMA order per accumulator: blocks in order, `j` in order).
    ///
    /// # Safety
    /// Rows `r..r+R` and tokens `t..t+T` exist, the buffer holds the strip; the tier's CPU.
    #[inline(always)]
    unsafe fn bf16<L: Lanes, const R: usize, const T: usize>(
        &self,
        wbuf: &[[L::F; 4]],
        acc: &mut [L::F],
    ) {
        let (n, r0, t0) = (self.n, self.r, self.t);
        let mut a: [[L::F; T]; R] =
            std::array::from_fn(|i| std::array::from_fn(|t| acc[(r0 + i) * n + t0 + t]));
        // Bounds once, then unchecked addresses in the loop: tokens t0..t0+T have `cols`
        // floats, the strip's columns are < cols, the buffer holds R rows × sbl blocks.
        assert!((t0 + T) * self.cols <= self.x.len() && 32 * (self.s + self.sb) <= self.cols);
        assert!(R * self.sbl <= wbuf.len() && self.sb <= self.sbl);
        let xp: [*const f32; T] =
            std::array::from_fn(|t| self.x.as_ptr().wrapping_add((t0 + t) * self.cols));
        let wp = wbuf.as_ptr();
        for b in 0..self.sb {
            let c = 32 * (self.s + b);
            for j in 0..L::V {
                // SAFETY: i < R, b < sb <= sbl: inside the buffer (asserted above).
                let w: [L::F; R] =
                    std::array::from_fn(|i| unsafe { (*wp.wrapping_add(i * self.sbl + b))[j] });
                for t in 0..T {
                    // SAFETY: column c + j·LANES + LANES <= cols of token t0 + t (asserted);
                    // CPU support is the caller's contract.
                    let xv = unsafe { L::load(xp[t].wrapping_add(c + j * L::LANES)) };
                    for i in 0..R {
                        // SAFETY: as above.
                        a[i][t] = unsafe { L::fma(w[i], xv, a[i][t]) };
                    }
                }
            }
        }
        for i in 0..R {
            for t in 0..T {
                acc[(r0 + i) * n + t0 + t] = a[i][t];
            }
        }
    }

    /// `R × T` MXFP4 accumulator pairs over the strip: per group, the partial sum
    /// `p = w0·x0 (+ w1·x1 …)` then `acc[g mod 2] += p·scale` (one FMA), as in the one-token
    /// kernel.
    ///
    /// # Safety
    /// As [`Tile::bf16`].
    #[inline(always)]
    unsafe fn mxfp4<L: Lanes, const R: usize, const T: usize>(
        &self,
        wbuf: &[([L::F; 4], L::F)],
        acc: &mut [L::F],
    ) {
        let (n, r0, t0) = (self.n, self.r, self.t);
        let at = |i: usize, t: usize, par: usize| 2 * ((r0 + i) * n + t0 + t) + par;
        let mut a0: [[L::F; T]; R] =
            std::array::from_fn(|i| std::array::from_fn(|t| acc[at(i, t, 0)]));
        let mut a1: [[L::F; T]; R] =
            std::array::from_fn(|i| std::array::from_fn(|t| acc[at(i, t, 1)]));
        // Strips start at even groups (`strip_blocks` is even), so block `b`'s parity is its
        // group's: even blocks go to `a0`, odd ones to `a1`.
        let mut b = 0;
        while b < self.sb {
            // SAFETY: block b is in the strip; CPU support is the caller's contract.
            unsafe { self.mxfp4_group::<L, R, T>(wbuf, b, &mut a0) };
            if b + 1 < self.sb {
                // SAFETY: as above, for block b + 1.
                unsafe { self.mxfp4_group::<L, R, T>(wbuf, b + 1, &mut a1) };
            }
            b += 2;
        }
        for (par, ap) in [a0, a1].iter().enumerate() {
            for i in 0..R {
                for t in 0..T {
                    acc[at(i, t, par)] = ap[i][t];
                }
            }
        }
    }

    /// One group (strip block `b`) of every tile row and token into `a`.
    ///
    /// # Safety
    /// As [`Tile::bf16`], and `b < sb`.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // register tiles: index loops over const sizes
    unsafe fn mxfp4_group<L: Lanes, const R: usize, const T: usize>(
        &self,
        wbuf: &[([L::F; 4], L::F)],
        b: usize,
        a: &mut [[L::F; T]; R],
    ) {
        let t0 = self.t;
        let c = 32 * (self.s + b);
        assert!((t0 + T) * self.cols <= self.x.len() && c + 32 <= self.cols);
        assert!((R - 1) * self.sbl + b < wbuf.len());
        let xp: [*const f32; T] =
            std::array::from_fn(|t| self.x.as_ptr().wrapping_add((t0 + t) * self.cols + c));
        let wp = wbuf.as_ptr();
        // SAFETY: CPU support is the caller's contract.
        let mut p: [[L::F; T]; R] = [[unsafe { L::zero() }; T]; R];
        for j in 0..L::V {
            // SAFETY: i < R: entry ·sbl + b is in the buffer (asserted above).
            let w: [L::F; R] =
                std::array::from_fn(|i| unsafe { (*wp.wrapping_add(i * self.sbl + b)).0[j] });
            for t in 0..T {
                // SAFETY: the group's 32 columns are inside token t0 + t (asserted); CPU support
                // is the caller's contract.
                let xv = unsafe { L::load(xp[t].wrapping_add(j * L::LANES)) };
                for i in 0..R {
                    p[i][t] = if j == 0 {
                        // SAFETY: as above.
                        unsafe { L::mul(w[i], xv) }
                    } else {
                        // SAFETY: as above.
                        unsafe { L::fma(w[i], xv, p[i][t]) }
                    };
                }
            }
        }
        for i in 0..R {
            let sc = wbuf[i * self.sbl + b].1;
            for t in 0..T {
                // SAFETY: as above.
                a[i][t] = unsafe { L::fma(p[i][t], sc, a[i][t]) };
            }
        }
    }
}
