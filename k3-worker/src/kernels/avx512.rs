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
//! * matmul: each loaded weight vector is used for `TOKEN_BLOCK` tokens at once; every token
//!   has its own accumulators and the same operation sequence as one token alone, so matmul ==
//!   matvec bit for bit. Token blocks are the outer loop over a task's rows (which stay in L2),
//!   so the weights come from memory once and the activations of a block stay in L1/L2.
//!
//! Never the AVX-512 BF16 dot instructions: they round the activations to bf16.

use std::arch::x86_64::*;

use super::scalar::{E2M1, E8M0_TABLE};

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
// bf16

/// `R` bf16 rows dotted with `T` tokens at once: `out[i][t] = Σ_c W[row i, c]·x[token t, c]`,
/// with each token's activations in the `split_even_odd_rows` layout (blocks of 32).
///
/// Every (row, token) pair has ONE accumulator vector and this sequence of FMAs into it: per
/// 32-column block the even columns then the odd columns (lane `l` takes columns `2l` and
/// `2l+1` of the block), then at most one 16-column step (lane `l` = column `l`), then one masked
/// step for the last `< 16` columns; the lanes are reduced by `hsum`. The sequence does not
/// depend on `R` or `T`, so any blocking gives the same bits (matmul == matvec); the blocking
/// only decides how often each weight vector and each activation vector is loaded.
///
/// # Safety
/// Each `w[i]` has `2·cols` readable bytes and each `x[t]` has `cols` readable floats; the CPU
/// supports AVX-512 F/BW/VL and FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn dot_block<const R: usize, const T: usize>(
    w: [*const u8; R],
    x: [*const f32; T],
    cols: usize,
) -> [[f32; T]; R] {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let odd = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let mut c = 0;
    while c + 32 <= cols {
        // SAFETY: c + 32 <= cols: floats c .. c+16 of every token are in bounds.
        let xe: [__m512; T] = std::array::from_fn(|t| unsafe { load16(x[t].wrapping_add(c)) });
        // SAFETY: c + 32 <= cols: floats c+16 .. c+32 of every token are in bounds.
        let xo: [__m512; T] = std::array::from_fn(|t| unsafe { load16(x[t].wrapping_add(c + 16)) });
        for i in 0..R {
            // SAFETY: c + 32 <= cols: bytes 2c .. 2c+64 of every row are in bounds.
            let v = unsafe { load_bytes64(w[i].wrapping_add(2 * c)) };
            let we = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
            let wo = _mm512_castsi512_ps(_mm512_and_si512(v, odd));
            for t in 0..T {
                acc[i][t] = _mm512_fmadd_ps(we, xe[t], acc[i][t]);
                acc[i][t] = _mm512_fmadd_ps(wo, xo[t], acc[i][t]);
            }
        }
        c += 32;
    }
    if c + 16 <= cols {
        // SAFETY: c + 16 <= cols: floats c .. c+16 of every token are in bounds.
        let xv: [__m512; T] = std::array::from_fn(|t| unsafe { load16(x[t].wrapping_add(c)) });
        for i in 0..R {
            // SAFETY: c + 16 <= cols: bytes 2c .. 2c+32 of every row are in bounds.
            let wv = unsafe { widen16(w[i].wrapping_add(2 * c)) };
            for t in 0..T {
                acc[i][t] = _mm512_fmadd_ps(wv, xv[t], acc[i][t]);
            }
        }
        c += 16;
    }
    if c < cols {
        let m: __mmask16 = ((1u32 << (cols - c)) - 1) as u16;
        let xv: [__m512; T] = std::array::from_fn(|t| {
            // SAFETY: the mask selects floats c .. cols of the token, in bounds.
            unsafe { load16_masked(x[t].wrapping_add(c), m) }
        });
        for i in 0..R {
            // SAFETY: the mask selects bytes 2c .. 2·cols of the row, in bounds.
            let wv = unsafe { widen16_masked(w[i].wrapping_add(2 * c), m) };
            for t in 0..T {
                acc[i][t] = _mm512_fmadd_ps(wv, xv[t], acc[i][t]);
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for i in 0..R {
        for t in 0..T {
            out[i][t] = hsum(acc[i][t]);
        }
    }
    out
}

/// Rows `r0 .. r0+R` (of `w`, `2·cols` bytes each) × tokens `t0 .. t0+T` (of `x [n, cols]`) into
/// `out [k, n]`.
///
/// # Safety
/// AVX-512 F/BW/VL + FMA. (The slicing below checks that the rows, tokens and outputs exist.)
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn bf16_block<const R: usize, const T: usize>(
    w: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    let rb = 2 * cols;
    let rows: [*const u8; R] =
        std::array::from_fn(|i| w[(r0 + i) * rb..(r0 + i + 1) * rb].as_ptr());
    let toks: [*const f32; T] =
        std::array::from_fn(|t| x[(t0 + t) * cols..(t0 + t + 1) * cols].as_ptr());
    // SAFETY: each pointer starts a slice of the length `dot_block` needs (checked by the
    // slicing above); CPU features are this function's contract.
    let r = unsafe { dot_block::<R, T>(rows, toks, cols) };
    for i in 0..R {
        out[(r0 + i) * n + t0..(r0 + i) * n + t0 + T].copy_from_slice(&r[i]);
    }
}

/// All `k` rows of `w` × tokens `t0 .. t0+T`: blocks of `R` rows, then the remaining `< R` rows in
/// blocks of 4, 2 and 1 (`R` is 8, 4 or 2).
///
/// # Safety
/// AVX-512 F/BW/VL + FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn bf16_tokens<const R: usize, const T: usize>(
    w: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    t0: usize,
    out: &mut [f32],
) {
    let k = w.len() / (2 * cols);
    let mut r = 0;
    while r + R <= k {
        // SAFETY: CPU features are this function's contract.
        unsafe { bf16_block::<R, T>(w, cols, x, n, r, t0, out) };
        r += R;
    }
    if R > 4 && r + 4 <= k {
        // SAFETY: as above, for 4 rows.
        unsafe { bf16_block::<4, T>(w, cols, x, n, r, t0, out) };
        r += 4;
    }
    if R > 2 && r + 2 <= k {
        // SAFETY: as above, for 2 rows.
        unsafe { bf16_block::<2, T>(w, cols, x, n, r, t0, out) };
        r += 2;
    }
    if r < k {
        // SAFETY: as above, for the last row.
        unsafe { bf16_block::<1, T>(w, cols, x, n, r, t0, out) };
    }
}

/// Row kernel: `out [k, n]` for the `k = w.len() / (2·cols)` rows in `w`; `x [n, cols]` with each
/// token's columns in the `split_even_odd_rows` layout (blocks of 32).
///
/// # Safety
/// The CPU supports AVX-512 F, BW, VL and FMA. (Lengths are checked here.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(super) unsafe fn bf16_rows(w: &[u8], cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
    assert!(cols > 0 && n > 0, "empty bf16 product");
    let rb = 2 * cols;
    assert!(w.len().is_multiple_of(rb), "bf16 rows: partial row");
    assert_eq!(out.len(), w.len() / rb * n, "bf16 rows vs output");
    assert_eq!(x.len(), n * cols, "bf16 rows input");
    // Token blocks outer, rows inner: the task's rows stay in L2 while every token block passes
    // over them, and each token block's activations stay in L1/L2.
    let mut t = 0;
    while t + TOKEN_BLOCK <= n {
        // SAFETY: CPU features are this function's contract.
        unsafe { bf16_tokens::<MATMUL_ROWS, TOKEN_BLOCK>(w, cols, x, n, t, out) };
        t += TOKEN_BLOCK;
    }
    match n - t {
        0 => {}
        // SAFETY: as above, for the 3 remaining tokens.
        3 => unsafe { bf16_tokens::<MATMUL_ROWS, 3>(w, cols, x, n, t, out) },
        // SAFETY: as above, for the 2 remaining tokens.
        2 => unsafe { bf16_tokens::<MATMUL_ROWS, 2>(w, cols, x, n, t, out) },
        // SAFETY: as above, for the last token of narrow rows: one row at a time.
        _ if cols <= super::NARROW_COLS => unsafe { bf16_tokens::<1, 1>(w, cols, x, n, t, out) },
        // SAFETY: as above, for the last token (all of a matvec).
        _ => unsafe { bf16_tokens::<MATVEC_ROWS, 1>(w, cols, x, n, t, out) },
    }
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

/// Adds group `g` of one MXFP4 row, scaled, into `acc[t]` for each token.
///
/// # Safety
/// Group `g` exists in `packed` (16 bytes) and in each `x[t]` (32 floats); AVX-512 F/BW/VL+FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn mxfp4_group<const T: usize>(
    packed: &[u8],
    scale: u8,
    x: &[*const f32; T],
    g: usize,
    table: __m512,
    acc: &mut [__m512; T],
) {
    // SAFETY: group g's 16 bytes lie in `packed` (caller contract).
    let b = unsafe { load_group(packed.as_ptr().wrapping_add(16 * g)) };
    // vpermps reads index bits 0..3 only: the low nibble of each byte lane.
    let we = _mm512_permutexvar_ps(b, table);
    let wo = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(b), table);
    let s = _mm512_set1_ps(E8M0_TABLE[scale as usize]);
    for t in 0..T {
        // SAFETY: group g's 32 activations of token t are in bounds (caller contract).
        let [xe, xo] = unsafe { load32(x[t].wrapping_add(32 * g)) };
        let p = _mm512_fmadd_ps(wo, xo, _mm512_mul_ps(we, xe));
        acc[t] = _mm512_fmadd_ps(p, s, acc[t]);
    }
}

/// `T` MXFP4 row dots. `x[t]` is the token's activations in `[even | odd]` group order. Even
/// groups accumulate in `acc0`, odd groups in `acc1`.
///
/// # Safety
/// `packed` has `16·groups` bytes, `scales` has `groups`, each `x[t]` `32·groups` readable
/// floats; AVX-512 F/BW/VL+FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn dot_mxfp4<const T: usize>(
    packed: &[u8],
    scales: &[u8],
    x: [*const f32; T],
    groups: usize,
) -> [f32; T] {
    assert!(packed.len() == 16 * groups && scales.len() == groups);
    // SAFETY: E2M1 is a 16-float array.
    let table = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
    let mut acc0 = [_mm512_setzero_ps(); T];
    let mut acc1 = [_mm512_setzero_ps(); T];
    let mut g = 0;
    while g + 2 <= groups {
        // SAFETY: g < groups (lengths asserted above, activations per the caller contract).
        unsafe { mxfp4_group::<T>(packed, scales[g], &x, g, table, &mut acc0) };
        // SAFETY: g + 1 < groups, as above.
        unsafe { mxfp4_group::<T>(packed, scales[g + 1], &x, g + 1, table, &mut acc1) };
        g += 2;
    }
    if g < groups {
        // SAFETY: g < groups, as above.
        unsafe { mxfp4_group::<T>(packed, scales[g], &x, g, table, &mut acc0) };
    }
    let mut out = [0.0f32; T];
    for t in 0..T {
        out[t] = hsum(_mm512_add_ps(acc0[t], acc1[t]));
    }
    out
}

/// Tokens `t0 .. t0+T` of one MXFP4 row into `o[t0 .. t0+T]`.
///
/// # Safety
/// `pr.len() == cols/2`, `sr.len() == cols/32`, `x.len() >= (t0+T)·cols`; AVX-512 F/BW/VL+FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn mxfp4_tokens<const T: usize>(
    pr: &[u8],
    sr: &[u8],
    cols: usize,
    x: &[f32],
    t0: usize,
    o: &mut [f32],
) {
    let xp: [*const f32; T] = std::array::from_fn(|i| x[(t0 + i) * cols..].as_ptr());
    // SAFETY: lengths per the caller contract; each token pointer starts a cols-float run.
    let r = unsafe { dot_mxfp4::<T>(pr, sr, xp, cols / 32) };
    o[t0..t0 + T].copy_from_slice(&r);
}

/// Row kernel: `out [k, n]` for the `k` rows in `packed`/`scales`; `x [n, cols]` with every
/// 32-column group rearranged `[even | odd]`.
///
/// # Safety
/// The CPU supports AVX-512 F, BW, VL and FMA. (Lengths are checked here.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(super) unsafe fn mxfp4_rows(
    packed: &[u8],
    scales: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    assert!(cols > 0 && cols.is_multiple_of(32) && n > 0, "MXFP4 shape");
    let (pw, sw) = (cols / 2, cols / 32);
    assert!(packed.len().is_multiple_of(pw), "MXFP4 rows: partial row");
    let k = packed.len() / pw;
    assert_eq!(scales.len(), k * sw, "MXFP4 scales vs rows");
    assert_eq!(out.len(), k * n, "MXFP4 rows vs output");
    assert_eq!(x.len(), n * cols, "MXFP4 rows input");
    // Token blocks outer, rows inner (see `bf16_rows`).
    for t in (0..n).step_by(TOKEN_BLOCK) {
        for ((pr, sr), o) in packed
            .chunks_exact(pw)
            .zip(scales.chunks_exact(sw))
            .zip(out.chunks_exact_mut(n))
        {
            match n - t {
                // SAFETY: row slices have the checked lengths and tokens t..t+4 lie in x; CPU
                // features are this function's contract.
                4.. => unsafe { mxfp4_tokens::<TOKEN_BLOCK>(pr, sr, cols, x, t, o) },
                // SAFETY: as above, for the three remaining tokens.
                3 => unsafe { mxfp4_tokens::<3>(pr, sr, cols, x, t, o) },
                // SAFETY: as above, for the two remaining tokens.
                2 => unsafe { mxfp4_tokens::<2>(pr, sr, cols, x, t, o) },
                // SAFETY: as above, for the one remaining token.
                _ => unsafe { mxfp4_tokens::<1>(pr, sr, cols, x, t, o) },
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
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
