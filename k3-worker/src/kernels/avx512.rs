//! AVX-512 tier (F + BW + VL, with FMA): 16 f32 lanes.
//!
//! * bf16 dot: 32 weights (one 64-byte load, sixteen u32 lanes of two bf16 each) are widened
//!   exactly by two integer ops: `lane << 16` is the even column's f32, `lane & 0xFFFF_0000` the
//!   odd column's. Activations arrive per 32 columns as `[16 even | 16 odd]` (the last
//!   `cols mod 32` columns stay in order; see `split_even_odd_rows`), so no weight shuffle is
//!   needed. After the 32-column blocks, one 16-column step (zero-extend + shift) and one masked
//!   step for the last `< 16` columns complete the row. Each (row, token) pair has one
//!   accumulator; it is reduced across lanes in a fixed tree.
//! * bf16 blocking: a single token (decode) is dotted with 8 rows at once, so each activation
//!   vector is loaded once per 8 rows (the kernel then runs at memory bandwidth instead of being
//!   bound by activation loads); rows of at most `NARROW_COLS` columns one at a time (see
//!   there); up to `TOKEN_BLOCK` tokens are dotted with 4 rows at once.
//! * MXFP4 dot: 16 packed bytes (one 32-column group) are zero-extended to 16 lanes; the low
//!   nibble indexes a 16-entry E2M1 table with `vpermps` (which reads only index bits 0..3), the
//!   high nibble (`>> 4`) likewise. Activations arrive per group as `[16 even | 16 odd]` columns
//!   (see `split_even_odd_rows`), so `p = w_even·x_even + w_odd·x_odd` is the group's partial
//!   sum in 16 lanes; it is then scaled by the group's `2^(s−127)` into one of two accumulators
//!   (even/odd groups).
//! * MXFP4 blocking: two rows with up to `TOKEN_BLOCK` tokens at once, so each activation vector
//!   is loaded once for both rows (a block of 4 tokens of a 3584-wide row is 57 KB, more than
//!   L1: one row at a time read it from L2 for every row, which bound the kernel at ~25 GMAC/s a
//!   core whatever the token count).
//! * matmul: each loaded weight vector is used for `TOKEN_BLOCK` tokens at once; every token
//!   has its own accumulators and the same operation sequence as one token alone, so matmul ==
//!   matvec bit for bit. Token blocks are the outer loop over a task's rows (which stay in L2),
//!   so the weights come from memory once and the activations of a block stay in L1/L2.
//!
//! Never the AVX-512 BF16 dot instructions: they round the activations to bf16.

use std::arch::x86_64::*;

use k3_proto::ecbf16::CodedMatrix;

use super::avx2::{self, CodedRows, RawRows};
use super::scalar::{E2M1, E8M0_TABLE};
use super::tile::{self, Bf16Blocks, Lanes, Mxfp4Groups};

/// Tokens dotted with one loaded weight vector at a time (matmul; MXFP4 and bf16).
const TOKEN_BLOCK: usize = 4;
/// bf16 rows per block for a single token (decode): each activation vector is loaded once per
/// 8 rows.
const MATVEC_ROWS: usize = 8;
/// bf16 rows per block with up to `TOKEN_BLOCK` tokens: 4 × 4 accumulators + 4 activation
/// vectors within the 32 zmm registers.
const MATMUL_ROWS: usize = 4;
// The row loops below match remainders 1..=3 explicitly.
const _: () = assert!(TOKEN_BLOCK == 4);

// ------------------------------------------------------------------------------------------
// Loads (each is one unsafe operation with a stated contract)

/// Widens 16 bf16 at `p`.
///
/// # Safety
/// 32 bytes at `p` are readable; the CPU supports AVX-512 F/BW/VL.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn widen16(p: *const u8) -> __m512 {
    // SAFETY: 32 readable bytes at p (caller contract); unaligned load.
    let h = unsafe { _mm256_loadu_si256(p as *const __m256i) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

/// Loads 64 bytes at `p`.
///
/// # Safety
/// 64 bytes at `p` are readable; the CPU supports AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn load_bytes64(p: *const u8) -> __m512i {
    // SAFETY: 64 readable bytes at p (caller contract); unaligned load.
    unsafe { _mm512_loadu_si512(p as *const _) }
}

/// Widens the first `m.count_ones()` bf16 at `p` (`m` a prefix mask); other lanes are +0.
///
/// # Safety
/// The `2·popcount(m)` bytes at `p` selected by `m` are readable; masked-off lanes are not
/// accessed (AVX-512 fault suppression). The CPU supports AVX-512 F/BW/VL.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn widen16_masked(p: *const u8, m: __mmask16) -> __m512 {
    // SAFETY: only the lanes in `m` are read, and those are in bounds (caller contract).
    let h = unsafe { _mm256_maskz_loadu_epi16(m, p as *const i16) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

/// Loads 64 f32 at `p` as four vectors.
///
/// # Safety
/// 64 f32 at `p` are readable; the CPU supports AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn load64(p: *const f32) -> [__m512; 4] {
    let mut v = [_mm512_setzero_ps(); 4];
    for (i, vi) in v.iter_mut().enumerate() {
        // SAFETY: p+16i .. p+16i+16 lie within the 64 readable floats (caller contract).
        *vi = unsafe { _mm512_loadu_ps(p.wrapping_add(16 * i)) };
    }
    v
}

/// Loads 16 f32 at `p`.
///
/// # Safety
/// 16 f32 at `p` are readable; the CPU supports AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn load16(p: *const f32) -> __m512 {
    // SAFETY: 16 readable floats at p (caller contract).
    unsafe { _mm512_loadu_ps(p) }
}

/// Loads the lanes of `m` from `p`; other lanes are +0.
///
/// # Safety
/// The floats selected by `m` are readable (masked-off lanes are not accessed).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn load16_masked(p: *const f32, m: __mmask16) -> __m512 {
    // SAFETY: only lanes in `m` are read, all in bounds (caller contract).
    unsafe { _mm512_maskz_loadu_ps(m, p) }
}

/// Fixed-order sum of the 16 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
fn hsum(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s = _mm256_add_ps(lo, hi);
    let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

// ------------------------------------------------------------------------------------------
// bf16 rows: raw or EC-BF16 coded

/// A bf16 matrix's rows as this tier reads them: whole 32-column blocks as one raw bf16 vector
/// (decoded in registers for a coded matrix), and the bytes after the last whole block. The
/// row sources are the AVX2 tier's (this tier's CPUs have AVX2; a coded block is decoded by the
/// AVX2 code and its two halves joined).
pub(super) trait Rows: avx2::Rows {
    /// Raw bf16 of whole block `b` of row `i` (columns `32b .. 32b+32`).
    ///
    /// # Safety
    /// `i < rows`, `32b + 32 <= cols`; AVX-512 F/BW/VL + AVX2.
    unsafe fn block64(&self, i: usize, b: usize) -> __m512i;
}

impl Rows for RawRows<'_> {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn block64(&self, i: usize, b: usize) -> __m512i {
        let p = self.block_ptr(i, b);
        // SAFETY: row i has 2·cols bytes and 32b + 32 <= cols (caller contract).
        unsafe { load_bytes64(p) }
    }
}

impl<const W: u8> Rows for CodedRows<'_, W> {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn block64(&self, i: usize, b: usize) -> __m512i {
        // SAFETY: the caller's contract is `block`'s; AVX2 is part of this tier.
        let [lo, hi] = unsafe { avx2::Rows::block(self, i, b) };
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }
}

/// `R` rows dotted with `T` tokens at once: `out[i][t] = Σ_c W[row i, c]·x[token t, c]`, with
/// each token's activations in the `split_even_odd_rows` layout (blocks of 32).
///
/// Every (row, token) pair has ONE accumulator vector and this sequence of FMAs into it: per
/// 32-column block the even columns then the odd columns (lane `l` takes columns `2l` and
/// `2l+1` of the block), then at most one 16-column step (lane `l` = column `l`), then one masked
/// step for the last `< 16` columns; the lanes are reduced by `hsum`. The sequence does not
/// depend on `R`, `T` or the row source (raw or coded rows give the same raw bf16), so any
/// blocking gives the same bits (matmul == matvec, coded == raw); the blocking only decides how
/// often each weight vector and each activation vector is loaded.
///
/// # Safety
/// The rows exist in `src`; each `x[t]` has `cols` floats; AVX-512 F/BW/VL, AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn dot_block<S: Rows, const R: usize, const T: usize>(
    src: &S,
    rows: [usize; R],
    x: [&[f32]; T],
) -> [[f32; T]; R] {
    let cols = src.cols();
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for b in 0..cols / 32 {
        let c = 32 * b;
        // SAFETY: c + 32 <= cols: floats c .. c+32 of every token are in bounds.
        let xv: [[__m512; 2]; T] =
            std::array::from_fn(|t| unsafe { load32(x[t][c..c + 32].as_ptr()) });
        for i in 0..R {
            // SAFETY: row rows[i] exists and block b is whole.
            let v = unsafe { src.block64(rows[i], b) };
            let w = widen_raw64(v);
            for t in 0..T {
                acc[i][t] = _mm512_fmadd_ps(w[0], xv[t][0], acc[i][t]);
                acc[i][t] = _mm512_fmadd_ps(w[1], xv[t][1], acc[i][t]);
            }
        }
    }
    let mut bufs = [[0u8; 64]; R];
    let mut rest: [&[u8]; R] = [&[]; R];
    for ((i, buf), r) in bufs.iter_mut().enumerate().zip(rest.iter_mut()) {
        *r = src.rest(rows[i], buf);
    }
    finish(&mut acc, rest, x, cols / 32 * 32, cols);
    let mut out = [[0.0f32; T]; R];
    for i in 0..R {
        for t in 0..T {
            out[i][t] = hsum(acc[i][t]);
        }
    }
    out
}

/// One raw 32-column vector widened exactly: `[even columns, odd columns]` (`lane << 16` is the
/// even column's f32, `lane & 0xFFFF_0000` the odd column's).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn widen_raw64(v: __m512i) -> [__m512; 2] {
    let odd = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    [
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)),
        _mm512_castsi512_ps(_mm512_and_si512(v, odd)),
    ]
}

/// The columns `c0 .. cols` (`c0` a multiple of 32, `rest[i]` row `i`'s raw bytes from `c0`):
/// at most one 16-column step and one masked step, as in `dot_block`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn finish<const R: usize, const T: usize>(
    acc: &mut [[__m512; T]; R],
    rest: [&[u8]; R],
    x: [&[f32]; T],
    c0: usize,
    cols: usize,
) {
    let mut c = c0;
    if c + 16 <= cols {
        // SAFETY: c + 16 <= cols: floats c .. c+16 of every token are in bounds.
        let xv: [__m512; T] = std::array::from_fn(|t| unsafe { load16(x[t][c..c + 16].as_ptr()) });
        for i in 0..R {
            let w = &rest[i][2 * (c - c0)..2 * (c - c0 + 16)];
            // SAFETY: `w` is 32 bytes.
            let wv = unsafe { widen16(w.as_ptr()) };
            for t in 0..T {
                acc[i][t] = _mm512_fmadd_ps(wv, xv[t], acc[i][t]);
            }
        }
        c += 16;
    }
    if c < cols {
        let m: __mmask16 = ((1u32 << (cols - c)) - 1) as u16;
        let xv: [__m512; T] = std::array::from_fn(|t| {
            let xt = &x[t][c..cols];
            // SAFETY: the mask selects the `cols - c` floats of `xt`.
            unsafe { load16_masked(xt.as_ptr(), m) }
        });
        for i in 0..R {
            let w = &rest[i][2 * (c - c0)..2 * (cols - c0)];
            // SAFETY: the mask selects the `cols - c` bf16 of `w`.
            let wv = unsafe { widen16_masked(w.as_ptr(), m) };
            for t in 0..T {
                acc[i][t] = _mm512_fmadd_ps(wv, xv[t], acc[i][t]);
            }
        }
    }
}

/// Rows `r0 .. r0+R` of `src` × tokens `t0 .. t0+T` (of `x [n, cols]`) into `out [k, n]`.
///
/// # Safety
/// AVX-512 F/BW/VL, AVX2 + FMA. (The slicing below checks that the rows, tokens and outputs
/// exist.)
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn bf16_block<S: Rows, const R: usize, const T: usize>(
    src: &S,
    x: &[f32],
    n: usize,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    let cols = src.cols();
    assert!(r0 + R <= src.rows(), "bf16 block rows");
    let toks: [&[f32]; T] = std::array::from_fn(|t| &x[(t0 + t) * cols..(t0 + t + 1) * cols]);
    // SAFETY: rows r0..r0+R exist (asserted); CPU features are this function's contract.
    let r = unsafe { dot_block::<S, R, T>(src, std::array::from_fn(|i| r0 + i), toks) };
    for i in 0..R {
        out[(r0 + i) * n + t0..(r0 + i) * n + t0 + T].copy_from_slice(&r[i]);
    }
}

/// All rows of `src` × tokens `t0 .. t0+T`: blocks of `R` rows, then the remaining `< R` rows in
/// blocks of 4, 2 and 1 (`R` is 8, 4 or 2).
///
/// # Safety
/// AVX-512 F/BW/VL, AVX2 + FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn bf16_tokens<S: Rows, const R: usize, const T: usize>(
    src: &S,
    x: &[f32],
    n: usize,
    t0: usize,
    out: &mut [f32],
) {
    let k = src.rows();
    let ahead = avx2::short_row_ahead(src.cols(), T);
    let mut r = 0;
    while r + R <= k {
        if ahead > 0 {
            (r + ahead..r + ahead + R).for_each(|i| src.prefetch_row(i));
        }
        // SAFETY: CPU features are this function's contract.
        unsafe { bf16_block::<S, R, T>(src, x, n, r, t0, out) };
        r += R;
    }
    if R > 4 && r + 4 <= k {
        // SAFETY: as above, for 4 rows.
        unsafe { bf16_block::<S, 4, T>(src, x, n, r, t0, out) };
        r += 4;
    }
    if R > 2 && r + 2 <= k {
        // SAFETY: as above, for 2 rows.
        unsafe { bf16_block::<S, 2, T>(src, x, n, r, t0, out) };
        r += 2;
    }
    if r < k {
        // SAFETY: as above, for the last row.
        unsafe { bf16_block::<S, 1, T>(src, x, n, r, t0, out) };
    }
}

/// This tier's bf16 rows for the strip kernel (a wrapper: the AVX2 tier implements the same
/// trait for the same row sources with its own vectors).
struct Wide<'s, S>(&'s S);

impl<S: Rows> Bf16Blocks<Avx512> for Wide<'_, S> {
    fn cols(&self) -> usize {
        self.0.cols()
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn widened(&self, i: usize, b: usize) -> [__m512; 4] {
        // SAFETY: the caller's contract is `block64`'s.
        let [e, o] = widen_raw64(unsafe { self.0.block64(i, b) });
        [e, o, e, o]
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn finish(&self, i: usize, acc: __m512, x: &[f32]) -> f32 {
        let cols = self.0.cols();
        let mut buf = [0u8; 64];
        let mut a = [[acc]];
        finish(
            &mut a,
            [self.0.rest(i, &mut buf)],
            [x],
            cols / 32 * 32,
            cols,
        );
        hsum(a[0][0])
    }
}

/// Row kernel over any row source: `out [k, n]` for its `k` rows; `x [n, cols]` with each
/// token's columns in the `split_even_odd_rows` layout (blocks of 32). More than `TOKEN_BLOCK`
/// tokens take the strip kernel (`tile`): each weight decoded once for all tokens.
///
/// # Safety
/// AVX-512 F/BW/VL, AVX2 + FMA. (Lengths are checked here.)
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn rows_kernel<S: Rows>(src: &S, x: &[f32], n: usize, out: &mut [f32], strips: bool) {
    let (cols, k) = (src.cols(), src.rows());
    assert!(cols > 0 && n > 0, "empty bf16 product");
    assert_eq!(out.len(), k * n, "bf16 rows vs output");
    assert_eq!(x.len(), n * cols, "bf16 rows input");
    if strips && n > TOKEN_BLOCK {
        // SAFETY: lengths checked above; CPU features are this function's contract.
        unsafe {
            tile::bf16_strips::<Avx512, _, MATMUL_ROWS, TOKEN_BLOCK>(&Wide(src), k, x, n, out)
        };
        return;
    }
    // Token blocks outer, rows inner: the task's rows stay in L2 while every token block passes
    // over them. CPU features are this function's contract; tokens t.. lie in x.
    let mut t = 0;
    while t + TOKEN_BLOCK <= n {
        // SAFETY: as above.
        unsafe { bf16_tokens::<S, MATMUL_ROWS, TOKEN_BLOCK>(src, x, n, t, out) };
        t += TOKEN_BLOCK;
    }
    match n - t {
        0 => {}
        // SAFETY: as above.
        3 => unsafe { bf16_tokens::<S, MATMUL_ROWS, 3>(src, x, n, t, out) },
        // SAFETY: as above.
        2 => unsafe { bf16_tokens::<S, MATMUL_ROWS, 2>(src, x, n, t, out) },
        // SAFETY: as above; the last token of narrow rows: one row at a time.
        _ if cols <= super::scalar::NARROW_COLS => unsafe {
            bf16_tokens::<S, 1, 1>(src, x, n, t, out)
        },
        // SAFETY: as above; the last token (all of a matvec).
        _ => unsafe { bf16_tokens::<S, MATVEC_ROWS, 1>(src, x, n, t, out) },
    }
}

/// Row kernel: `out [k, n]` for the `k = w.len() / (2·cols)` rows in `w`.
///
/// # Safety
/// The CPU supports AVX-512 F, BW, VL, AVX2 and FMA. (Lengths are checked here.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(super) unsafe fn bf16_rows(
    w: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    strips: bool,
) {
    // SAFETY: CPU features are this function's contract.
    unsafe { rows_kernel(&RawRows::new(w, cols), x, n, out, strips) }
}

/// Row kernel for rows `r0 .. r0 + out.len()/n` of an EC-BF16 matrix: the same bits as
/// [`bf16_rows`] on the decoded matrix.
///
/// # Safety
/// The CPU supports AVX-512 F, BW, VL, AVX2 and FMA. (Lengths are checked here.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(super) unsafe fn coded_rows(
    m: &CodedMatrix<'_>,
    r0: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    strips: bool,
) {
    let k = out.len() / n.max(1);
    match m.width() {
        // SAFETY: CPU features are this function's contract.
        4 => unsafe { coded_kernel::<4>(m, r0, k, x, n, out, strips) },
        // SAFETY: as above.
        3 => unsafe { coded_kernel::<3>(m, r0, k, x, n, out, strips) },
        // SAFETY: as above.
        _ => unsafe { coded_kernel::<2>(m, r0, k, x, n, out, strips) },
    }
}

/// [`coded_rows`] for width `W` (`CodedRows::new` checks the width and the row range).
///
/// # Safety
/// The CPU has this tier's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn coded_kernel<const W: u8>(
    m: &CodedMatrix<'_>,
    r0: usize,
    k: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    strips: bool,
) {
    // SAFETY: CPU features are this function's contract.
    let src = unsafe { CodedRows::<W>::new(*m, r0, k) };
    // SAFETY: as above.
    unsafe { rows_kernel(&src, x, n, out, strips) }
}

// ------------------------------------------------------------------------------------------
// MXFP4

/// Loads 16 packed bytes (one group) zero-extended to 16 lanes.
///
/// # Safety
/// 16 bytes at `p` are readable; AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn load_group(p: *const u8) -> __m512i {
    // SAFETY: 16 readable bytes at p (caller contract).
    let b = unsafe { _mm_loadu_si128(p as *const __m128i) };
    _mm512_cvtepu8_epi32(b)
}

/// Loads one group's 32 rearranged activations `[even | odd]`.
///
/// # Safety
/// 32 f32 at `p` are readable; AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn load32(p: *const f32) -> [__m512; 2] {
    // SAFETY: p .. p+16 within the 32 readable floats (caller contract).
    let e = unsafe { _mm512_loadu_ps(p) };
    // SAFETY: p+16 .. p+32 within the 32 readable floats (caller contract).
    let o = unsafe { _mm512_loadu_ps(p.wrapping_add(16)) };
    [e, o]
}

/// One group's 32 weights (16 packed bytes at `p`) as `[even columns, odd columns]`: the bytes
/// zero-extended to 16 lanes, the low nibble (`vpermps` reads index bits 0..3 only) and the high
/// nibble (`>> 4`) looked up in the 16-entry E2M1 `table`.
///
/// # Safety
/// 16 bytes at `p` are readable; AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn decode_group(p: *const u8, table: __m512) -> [__m512; 2] {
    // SAFETY: 16 readable bytes at p (caller contract).
    let b = unsafe { load_group(p) };
    [
        _mm512_permutexvar_ps(b, table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(b), table),
    ]
}

/// Adds group `g` of each of `R` MXFP4 rows, scaled, into `acc[r][t]` for each token: each
/// activation vector is loaded once for the `R` rows (a block of 4 tokens' activations of a
/// 3584-wide row does not fit L1, so one row at a time streams them from L2 for every row), and
/// each (row, token) pair keeps its own one-row sequence.
///
/// # Safety
/// Group `g` exists in every `packed[r]` (16 bytes) and in each `x[t]` (32 floats);
/// AVX-512 F/BW/VL+FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn mxfp4_group<const R: usize, const T: usize>(
    packed: &[&[u8]; R],
    scales: &[&[u8]; R],
    x: &[*const f32; T],
    g: usize,
    table: __m512,
    acc: &mut [[__m512; T]; R],
) {
    let mut w = [[_mm512_setzero_ps(); 2]; R];
    let mut s = [_mm512_setzero_ps(); R];
    for r in 0..R {
        // SAFETY: group g's 16 bytes lie in `packed[r]` (caller contract).
        w[r] = unsafe { decode_group(packed[r].as_ptr().wrapping_add(16 * g), table) };
        s[r] = _mm512_set1_ps(E8M0_TABLE[scales[r][g] as usize]);
    }
    for t in 0..T {
        // SAFETY: group g's 32 activations of token t are in bounds (caller contract).
        let [xe, xo] = unsafe { load32(x[t].wrapping_add(32 * g)) };
        for r in 0..R {
            let p = _mm512_fmadd_ps(w[r][1], xo, _mm512_mul_ps(w[r][0], xe));
            acc[r][t] = _mm512_fmadd_ps(p, s[r], acc[r][t]);
        }
    }
}

/// How far ahead of the group being decoded the MXFP4 kernel asks for its weights.
const MXFP4_PREFETCH: usize = 4096;

/// `R × T` MXFP4 row dots: rows `packed[r]`/`scales[r]` with tokens `x[t]` (activations in
/// `[even | odd]` group order). Even groups accumulate in `acc0`, odd groups in `acc1`.
///
/// # Safety
/// Each `packed[r]` has `16·groups` bytes, each `scales[r]` has `groups`, each `x[t]`
/// `32·groups` readable floats; AVX-512 F/BW/VL+FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn dot_mxfp4<const R: usize, const T: usize>(
    packed: [&[u8]; R],
    scales: [&[u8]; R],
    x: [*const f32; T],
    groups: usize,
) -> [[f32; T]; R] {
    for r in 0..R {
        assert!(packed[r].len() == 16 * groups && scales[r].len() == groups);
    }
    // SAFETY: E2M1 is a 16-float array.
    let table = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
    let mut acc0 = [[_mm512_setzero_ps(); T]; R];
    let mut acc1 = [[_mm512_setzero_ps(); T]; R];
    let mut g = 0;
    while g + 2 <= groups {
        for p in &packed {
            // A hint, not a read: the weights `MXFP4_PREFETCH` bytes on (the next rows of the
            // task, contiguous after this one), so memory latency overlaps the decode.
            _mm_prefetch::<_MM_HINT_T0>(
                p.as_ptr().wrapping_add(16 * g + MXFP4_PREFETCH) as *const i8
            );
        }
        // SAFETY: g < groups (lengths asserted above, activations per the caller contract).
        unsafe { mxfp4_group::<R, T>(&packed, &scales, &x, g, table, &mut acc0) };
        // SAFETY: g + 1 < groups, as above.
        unsafe { mxfp4_group::<R, T>(&packed, &scales, &x, g + 1, table, &mut acc1) };
        g += 2;
    }
    if g < groups {
        // SAFETY: g < groups, as above.
        unsafe { mxfp4_group::<R, T>(&packed, &scales, &x, g, table, &mut acc0) };
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum(_mm512_add_ps(acc0[r][t], acc1[r][t]));
        }
    }
    out
}

/// Tokens `t0 .. t0+T` of `R` MXFP4 rows into `o[r][t0 .. t0+T]`.
///
/// # Safety
/// Every `pr[r].len() == cols/2`, `sr[r].len() == cols/32`, `x.len() >= (t0+T)·cols`;
/// AVX-512 F/BW/VL+FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn mxfp4_tokens<const R: usize, const T: usize>(
    pr: [&[u8]; R],
    sr: [&[u8]; R],
    cols: usize,
    x: &[f32],
    t0: usize,
    o: [&mut [f32]; R],
) {
    let mut xp = [std::ptr::null::<f32>(); T];
    for (i, p) in xp.iter_mut().enumerate() {
        *p = x[(t0 + i) * cols..].as_ptr();
    }
    // SAFETY: lengths per the caller contract; each token pointer starts a cols-float run.
    let r = unsafe { dot_mxfp4::<R, T>(pr, sr, xp, cols / 32) };
    for (row, o) in r.iter().zip(o) {
        o[t0..t0 + T].copy_from_slice(row);
    }
}

/// Tokens `t0 .. t0+T` (`T ≤ TOKEN_BLOCK`) of every row, two rows at a time (the last row of
/// an odd count alone).
///
/// # Safety
/// As [`mxfp4_rows`]' checked lengths; `t0 + T <= n`; AVX-512 F/BW/VL+FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn mxfp4_token_block<const T: usize>(
    packed: &[u8],
    scales: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    t0: usize,
    out: &mut [f32],
) {
    let (pw, sw) = (cols / 2, cols / 32);
    let (mut pp, mut sp) = (packed.chunks_exact(2 * pw), scales.chunks_exact(2 * sw));
    let mut op = out.chunks_exact_mut(2 * n);
    for ((p, s), o) in pp.by_ref().zip(sp.by_ref()).zip(op.by_ref()) {
        let (p0, p1) = p.split_at(pw);
        let (s0, s1) = s.split_at(sw);
        let (o0, o1) = o.split_at_mut(n);
        // SAFETY: two whole rows and their outputs; tokens per the caller contract.
        unsafe { mxfp4_tokens::<2, T>([p0, p1], [s0, s1], cols, x, t0, [o0, o1]) };
    }
    let (p, s, o) = (pp.remainder(), sp.remainder(), op.into_remainder());
    if !p.is_empty() {
        // SAFETY: the last whole row (an odd count) and its output; tokens per the caller
        // contract.
        unsafe { mxfp4_tokens::<1, T>([p], [s], cols, x, t0, [o]) };
    }
}

/// Row kernel: `out [k, n]` for the `k` rows in `packed`/`scales`; `x [n, cols]` with every
/// 32-column group rearranged `[even | odd]`.
///
/// # Safety
/// The CPU supports AVX-512 F, BW, VL and FMA. (The shape is checked by the caller,
/// `kernels::quant`.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(super) unsafe fn mxfp4_rows(
    packed: &[u8],
    scales: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    strips: bool,
) {
    assert!(cols > 0 && cols.is_multiple_of(32) && n > 0, "MXFP4 shape");
    let (pw, sw) = (cols / 2, cols / 32);
    assert!(packed.len().is_multiple_of(pw), "MXFP4 rows: partial row");
    let k = packed.len() / pw;
    assert_eq!(scales.len(), k * sw, "MXFP4 scales vs rows");
    assert_eq!(out.len(), k * n, "MXFP4 rows vs output");
    assert_eq!(x.len(), n * cols, "MXFP4 rows input");
    if strips && n > TOKEN_BLOCK {
        // SAFETY: E2M1 is a 16-float array.
        let table = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
        let src = Mxfp4Rows {
            packed,
            scales,
            cols,
            table,
        };
        // SAFETY: lengths checked above; CPU features are this function's contract.
        unsafe {
            tile::mxfp4_strips::<Avx512, _, MXFP4_TILE_ROWS, MXFP4_TILE_TOKENS>(&src, k, x, n, out)
        };
        return;
    }
    // Token blocks outer, rows inner (see `bf16_rows`).
    for t in (0..n).step_by(TOKEN_BLOCK) {
        match n - t {
            // SAFETY: lengths checked above, tokens t..t+4 lie in x; CPU features are this
            // function's contract.
            4.. => unsafe { mxfp4_token_block::<TOKEN_BLOCK>(packed, scales, cols, x, n, t, out) },
            // SAFETY: as above, for the three remaining tokens.
            3 => unsafe { mxfp4_token_block::<3>(packed, scales, cols, x, n, t, out) },
            // SAFETY: as above, for the two remaining tokens.
            2 => unsafe { mxfp4_token_block::<2>(packed, scales, cols, x, n, t, out) },
            // SAFETY: as above, for the one remaining token.
            _ => unsafe { mxfp4_token_block::<1>(packed, scales, cols, x, n, t, out) },
        }
    }
}

/// MXFP4 strip tiles (more than `TOKEN_BLOCK` tokens): 2 rows × 4 tokens of accumulator
/// pairs (16), their partial sums (8) and the decoded groups fit the 32 registers.
const MXFP4_TILE_ROWS: usize = 2;
const MXFP4_TILE_TOKENS: usize = 4;

/// An MXFP4 task's rows for the strip kernel.
struct Mxfp4Rows<'a> {
    packed: &'a [u8],
    scales: &'a [u8],
    cols: usize,
    table: __m512,
}

impl Mxfp4Groups<Avx512> for Mxfp4Rows<'_> {
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    unsafe fn group(&self, i: usize, g: usize) -> ([__m512; 4], __m512) {
        let at = i * self.cols / 2 + 16 * g;
        let p = self.packed[at..at + 16].as_ptr();
        // SAFETY: 16 readable bytes.
        let [e, o] = unsafe { decode_group(p, self.table) };
        let s = E8M0_TABLE[self.scales[i * self.cols / 32 + g] as usize];
        ([e, o, e, o], _mm512_set1_ps(s))
    }
}

/// This tier's vector for the strip kernels.
#[derive(Clone, Copy)]
pub(super) struct Avx512;

impl Lanes for Avx512 {
    type F = __m512;
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: the CPU supports the tier (caller contract); inlined into the
        // tier's `#[target_feature]` entry point.
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: 16 readable floats (caller contract).
        unsafe { load16(p) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: the CPU supports the tier (caller contract); inlined into the
        // tier's `#[target_feature]` entry point.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the CPU supports the tier (caller contract); inlined into the
        // tier's `#[target_feature]` entry point.
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn hsum_pair(a: __m512, b: __m512) -> f32 {
        // SAFETY: the CPU supports the tier (caller contract); inlined into the
        // tier's `#[target_feature]` entry point.
        let sum = unsafe { _mm512_add_ps(a, b) };
        // SAFETY: as above.
        unsafe { hsum(sum) }
    }
}

// ------------------------------------------------------------------------------------------
// FMA peak

/// `iters` rounds of 16 independent FMA chains (enough to cover the FMA latency on two ports):
/// `16·16·iters` multiply-adds; returns their sum so nothing is optimised away.
///
/// # Safety
/// The CPU supports AVX-512 F and FMA.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(super) unsafe fn fma_probe(iters: usize, seed: f32) -> f32 {
    let (m, a) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    let mut acc: [__m512; 16] = std::array::from_fn(|i| _mm512_set1_ps(seed + i as f32));
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm512_fmadd_ps(*v, m, a);
        }
    }
    acc.iter().map(|&v| hsum(v)).sum()
}

// ------------------------------------------------------------------------------------------
// F32 row narrowing

/// `avx2::narrow_f32_row` (a byte shuffle: the same bytes on every tier).
///
/// # Safety
/// The CPU supports AVX-512 F/BW/VL, AVX2 and FMA (this tier's contract).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(super) unsafe fn narrow_f32_row(row: &[u8], out: &mut [u8]) -> bool {
    // SAFETY: this tier's CPUs support AVX2 (detected with AVX-512 before this tier exists).
    unsafe { avx2::narrow_f32_row(row, out) }
}

// f32 dot

/// `Σ a[i]·b[i]`: four accumulators over 64-element steps, 16-element steps into accumulator 0,
/// a masked step into accumulator 1.
///
/// # Safety
/// The CPU supports AVX-512 F and FMA. (Lengths are checked here.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(super) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32 lengths");
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i + 64 <= n {
        // SAFETY: i + 64 <= n = a.len().
        let va = unsafe { load64(pa.wrapping_add(i)) };
        // SAFETY: i + 64 <= n = b.len().
        let vb = unsafe { load64(pb.wrapping_add(i)) };
        for j in 0..4 {
            acc[j] = _mm512_fmadd_ps(va[j], vb[j], acc[j]);
        }
        i += 64;
    }
    while i + 16 <= n {
        // SAFETY: i + 16 <= n = a.len().
        let va = unsafe { load16(pa.wrapping_add(i)) };
        // SAFETY: i + 16 <= n = b.len().
        let vb = unsafe { load16(pb.wrapping_add(i)) };
        acc[0] = _mm512_fmadd_ps(va, vb, acc[0]);
        i += 16;
    }
    if i < n {
        let m: __mmask16 = ((1u32 << (n - i)) - 1) as u16;
        // SAFETY: the mask selects a[i..n], in bounds.
        let va = unsafe { load16_masked(pa.wrapping_add(i), m) };
        // SAFETY: the mask selects b[i..n], in bounds.
        let vb = unsafe { load16_masked(pb.wrapping_add(i), m) };
        acc[1] = _mm512_fmadd_ps(va, vb, acc[1]);
    }
    hsum(_mm512_add_ps(
        _mm512_add_ps(acc[0], acc[1]),
        _mm512_add_ps(acc[2], acc[3]),
    ))
}

// ------------------------------------------------------------------------------------------
// int8 / int4 quantized matrices (`k3_proto::quant`): the scalar twin's sequence
// (`scalar::q8_dot`, `scalar::q4_dot`) with its lanes in zmm registers, so every (row, token)
// is the twin's bits. int8: lanes 0–15 and 16–31 of a row in two accumulators, added together
// and `hsum`med (the twin's halving order), times the row's scale. int4: the 16 lanes in one
// accumulator; a group's 16 bytes zero-extended to 16 lanes, each nibble looked up in the
// table `q − 8` by `vpermps` (which reads index bits 0..3 only).

/// `q − 8` for `q` = 0..15.
static Q4_TABLE: [f32; 16] = [
    -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
];

/// Loads 16 bytes at `p` sign-extended to 16 f32 lanes.
///
/// # Safety
/// 16 bytes at `p` are readable; AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn i8x16(p: *const u8) -> __m512 {
    // SAFETY: 16 readable bytes at p (caller contract).
    let b = unsafe { _mm_loadu_si128(p as *const __m128i) };
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))
}

/// `R` int8 rows (`codes[r]`: `cols` bytes) × `T` tokens (`x[t]`: `cols` floats): each pair's
/// unscaled lane sum.
///
/// # Safety
/// Lengths as stated (asserted); AVX-512 F/BW/VL + FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn q8_block<const R: usize, const T: usize>(
    codes: [&[u8]; R],
    x: [&[f32]; T],
    cols: usize,
) -> [[f32; T]; R] {
    for c in &codes {
        assert_eq!(c.len(), cols);
    }
    for xt in &x {
        assert_eq!(xt.len(), cols);
    }
    let mut acc = [[[_mm512_setzero_ps(); 2]; T]; R];
    for b in 0..cols / 32 {
        let c = 32 * b;
        // SAFETY: c + 32 <= cols floats of each token (asserted lengths): `load32` reads them
        // as two halves, the same lanes as two 16-float loads.
        let xv: [[__m512; 2]; T] =
            std::array::from_fn(|t| unsafe { load32(x[t].as_ptr().wrapping_add(c)) });
        for r in 0..R {
            let p = codes[r].as_ptr();
            // SAFETY: c + 16 <= cols bytes of each row (asserted lengths).
            let w0 = unsafe { i8x16(p.wrapping_add(c)) };
            // SAFETY: c + 32 <= cols bytes of each row (asserted lengths).
            let w1 = unsafe { i8x16(p.wrapping_add(c + 16)) };
            let w = [w0, w1];
            for t in 0..T {
                acc[r][t][0] = _mm512_fmadd_ps(w[0], xv[t][0], acc[r][t][0]);
                acc[r][t][1] = _mm512_fmadd_ps(w[1], xv[t][1], acc[r][t][1]);
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum(_mm512_add_ps(acc[r][t][0], acc[r][t][1]));
        }
    }
    out
}

/// `R` int4 rows (`codes[r]`: `cols/2` bytes, `scales[r]`: `cols/32` f32) × `T` tokens (`x[t]`:
/// `cols` floats split per 32 as `[16 even | 16 odd]`).
///
/// # Safety
/// Lengths as stated (asserted); AVX-512 F/BW/VL + FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn q4_block<const R: usize, const T: usize>(
    codes: [&[u8]; R],
    scales: [&[u8]; R],
    x: [&[f32]; T],
    cols: usize,
) -> [[f32; T]; R] {
    let groups = cols / 32;
    for r in 0..R {
        assert!(codes[r].len() == 16 * groups && scales[r].len() == 4 * groups);
    }
    for xt in &x {
        assert_eq!(xt.len(), cols);
    }
    // SAFETY: Q4_TABLE is 16 floats.
    let table = unsafe { _mm512_loadu_ps(Q4_TABLE.as_ptr()) };
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for g in 0..groups {
        // SAFETY: 32g + 32 <= cols floats of each token (asserted lengths).
        let xv: [[__m512; 2]; T] =
            std::array::from_fn(|t| unsafe { load32(x[t].as_ptr().wrapping_add(32 * g)) });
        for r in 0..R {
            // SAFETY: 16g + 16 <= 16·groups bytes of each row (asserted lengths).
            let b = unsafe { load_group(codes[r].as_ptr().wrapping_add(16 * g)) };
            let lo = _mm512_permutexvar_ps(b, table);
            let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(b), table);
            let s = _mm512_set1_ps(super::scalar::f32_at(scales[r], g));
            for t in 0..T {
                let p = _mm512_fmadd_ps(hi, xv[t][1], _mm512_mul_ps(lo, xv[t][0]));
                acc[r][t] = _mm512_fmadd_ps(p, s, acc[r][t]);
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum(acc[r][t]);
        }
    }
    out
}

/// This tier's quantized-row dots for the shared row and token loops of `kernels::quant`.
pub(super) struct Avx512Dots;

impl super::quant_loop::QuantDots for Avx512Dots {
    unsafe fn q8<const R: usize, const T: usize>(
        codes: [&[u8]; R],
        x: [&[f32]; T],
        cols: usize,
    ) -> [[f32; T]; R] {
        // SAFETY: the caller's contract is the CPU features (AVX-512 F/BW/VL + FMA).
        unsafe { q8_block::<R, T>(codes, x, cols) }
    }

    unsafe fn q4<const R: usize, const T: usize>(
        codes: [&[u8]; R],
        scales: [&[u8]; R],
        x: [&[f32]; T],
        cols: usize,
    ) -> [[f32; T]; R] {
        // SAFETY: as above.
        unsafe { q4_block::<R, T>(codes, scales, x, cols) }
    }
}

/// Row kernel for rows `r0 .. r0 + k` of a quantized matrix: `out [k, n]`; `x [n,
/// cols]` in natural order (int8) or split per 32 columns (int4). Tokens in blocks of 4 with 2
/// rows at a time (int8: 16 accumulators; int4: 8), then the rest; a single token with 4
/// (int8) or 8 (int4) rows at a time, 8 independent FMA chains either way.
///
/// # Safety
/// The CPU supports AVX-512 F, BW, VL and FMA. (The shape is checked by the caller,
/// `kernels::quant`.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(super) unsafe fn quant_rows(
    m: &k3_proto::quant::QuantMatrix<'_>,
    r0: usize,
    k: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let int8 = m.kind() == k3_proto::quant::QuantKind::Int8;
    let mut t = 0;
    while t + 4 <= n {
        // SAFETY: CPU features are this function's contract.
        unsafe { super::quant_loop::tokens::<Avx512Dots, 2, 4>(m, r0, k, x, n, t, out) };
        t += 4;
    }
    match (n - t, int8) {
        (0, _) => {}
        // SAFETY: as above.
        (3, _) => unsafe { super::quant_loop::tokens::<Avx512Dots, 2, 3>(m, r0, k, x, n, t, out) },
        // SAFETY: as above.
        (2, _) => unsafe { super::quant_loop::tokens::<Avx512Dots, 4, 2>(m, r0, k, x, n, t, out) },
        // SAFETY: as above.
        (_, true) => unsafe {
            super::quant_loop::tokens::<Avx512Dots, 4, 1>(m, r0, k, x, n, t, out)
        },
        // SAFETY: as above.
        (_, false) => unsafe {
            super::quant_loop::tokens::<Avx512Dots, 8, 1>(m, r0, k, x, n, t, out)
        },
    }
}
