//! AVX2 + FMA tier: 8 f32 lanes.
//!
//! * bf16 dot: 8 weights are widened exactly (zero-extend each u16 to 32 bits, shift left 16)
//!   and FMA'd with f32 activations. Four accumulators over 32-column steps, then 8-column steps
//!   into accumulator 0, then the last `< 8` columns copied into zero-padded buffers and FMA'd
//!   into accumulator 1; reduced `(a0+a1)+(a2+a3)` and then across lanes in a fixed tree.
//! * MXFP4 dot: 8 packed bytes (16 columns) are zero-extended to 8 lanes; `vpermps` (index bits
//!   0..2) looks up the E2M1 magnitude of each nibble and bit 3 of the nibble becomes the f32
//!   sign bit. Activations arrive per 16 columns as `[8 even | 8 odd]` (see `split_even_odd`).
//!   A group's 32 products are summed in 8 lanes, scaled by `2^(s−127)` and added to one of two
//!   accumulators (even/odd groups).
//! * matmul: each loaded weight vector is used for `TOKEN_BLOCK` tokens at once; every token
//!   has its own accumulators and the same operation sequence as `T = 1`, so matmul == matvec
//!   bit for bit. Token blocks are the outer loop over a task's rows (which stay in L2), so the
//!   weights come from memory once and the activations of a block stay in L1/L2.

use std::arch::x86_64::*;

use super::scalar::{E2M1, E8M0_TABLE};

/// Tokens dotted with one loaded weight row at a time (2 tokens × 4 accumulators + 4 weight
/// vectors stay within the 16 ymm registers).
const TOKEN_BLOCK: usize = 2;

// ------------------------------------------------------------------------------------------
// Loads (each is one unsafe operation with a stated contract)

/// Widens 8 bf16 at `p`.
///
/// # Safety
/// 16 bytes at `p` are readable; the CPU supports AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen8(p: *const u8) -> __m256 {
    // SAFETY: 16 readable bytes at p (caller contract); unaligned load.
    let h = unsafe { _mm_loadu_si128(p as *const __m128i) };
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}

/// Widens 32 bf16 at `p` into four vectors.
///
/// # Safety
/// 64 bytes at `p` are readable; the CPU supports AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen32(p: *const u8) -> [__m256; 4] {
    let mut v = [_mm256_setzero_ps(); 4];
    for (i, vi) in v.iter_mut().enumerate() {
        // SAFETY: bytes p+16i .. p+16i+16 lie within the 64 readable bytes (caller contract).
        *vi = unsafe { widen8(p.wrapping_add(16 * i)) };
    }
    v
}

/// Loads 8 f32 at `p`.
///
/// # Safety
/// 8 f32 at `p` are readable; the CPU supports AVX.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load8(p: *const f32) -> __m256 {
    // SAFETY: 8 readable floats at p (caller contract).
    unsafe { _mm256_loadu_ps(p) }
}

/// Loads 32 f32 at `p` as four vectors.
///
/// # Safety
/// 32 f32 at `p` are readable; the CPU supports AVX.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load32(p: *const f32) -> [__m256; 4] {
    let mut v = [_mm256_setzero_ps(); 4];
    for (i, vi) in v.iter_mut().enumerate() {
        // SAFETY: p+8i .. p+8i+8 lie within the 32 readable floats (caller contract).
        *vi = unsafe { load8(p.wrapping_add(8 * i)) };
    }
    v
}

/// Fixed-order sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// The last `< 8` bf16 of a row, zero-padded to a vector.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn widen_tail(bytes: &[u8]) -> __m256 {
    let mut buf = [0u8; 16];
    buf[..bytes.len()].copy_from_slice(bytes);
    // SAFETY: buf is 16 readable bytes.
    unsafe { widen8(buf.as_ptr()) }
}

/// The last `< 8` floats, zero-padded to a vector.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn load_tail(v: &[f32]) -> __m256 {
    let mut buf = [0.0f32; 8];
    buf[..v.len()].copy_from_slice(v);
    // SAFETY: buf is 8 readable floats.
    unsafe { load8(buf.as_ptr()) }
}

// ------------------------------------------------------------------------------------------
// bf16

/// `T` dot products of one bf16 row (`2·cols` bytes) with tokens `x[t0 .. t0+T]` of `x [n, cols]`.
///
/// # Safety
/// `row.len() == 2·cols` and `x.len() >= (t0+T)·cols`; the CPU supports AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_bf16<const T: usize>(row: &[u8], x: &[f32], cols: usize, t0: usize) -> [f32; T] {
    let w = row.as_ptr();
    let xs: [&[f32]; T] = std::array::from_fn(|i| &x[(t0 + i) * cols..(t0 + i + 1) * cols]);
    let mut acc = [[_mm256_setzero_ps(); 4]; T];
    let mut c = 0;
    while c + 32 <= cols {
        // SAFETY: c + 32 <= cols, so row bytes 2c .. 2c+64 are in bounds.
        let wv = unsafe { widen32(w.wrapping_add(2 * c)) };
        for t in 0..T {
            // SAFETY: columns c .. c+32 of token t (a cols-float slice) are in bounds.
            let xv = unsafe { load32(xs[t].as_ptr().wrapping_add(c)) };
            for j in 0..4 {
                acc[t][j] = _mm256_fmadd_ps(wv[j], xv[j], acc[t][j]);
            }
        }
        c += 32;
    }
    while c + 8 <= cols {
        // SAFETY: c + 8 <= cols, so row bytes 2c .. 2c+16 are in bounds.
        let wv = unsafe { widen8(w.wrapping_add(2 * c)) };
        for t in 0..T {
            // SAFETY: columns c .. c+8 of token t are in bounds.
            let xv = unsafe { load8(xs[t].as_ptr().wrapping_add(c)) };
            acc[t][0] = _mm256_fmadd_ps(wv, xv, acc[t][0]);
        }
        c += 8;
    }
    if c < cols {
        let wv = widen_tail(&row[2 * c..]);
        for t in 0..T {
            acc[t][1] = _mm256_fmadd_ps(wv, load_tail(&xs[t][c..]), acc[t][1]);
        }
    }
    let mut out = [0.0f32; T];
    for t in 0..T {
        let a = &acc[t];
        out[t] = hsum(_mm256_add_ps(
            _mm256_add_ps(a[0], a[1]),
            _mm256_add_ps(a[2], a[3]),
        ));
    }
    out
}

/// Row kernel: `out [k, n]` for the `k = w.len() / (2·cols)` rows in `w`; `x [n, cols]`.
///
/// # Safety
/// The CPU supports AVX2 and FMA. (Lengths are checked here.)
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn bf16_rows(w: &[u8], cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
    assert!(cols > 0 && n > 0, "empty bf16 product");
    let rb = 2 * cols;
    assert!(w.len().is_multiple_of(rb), "bf16 rows: partial row");
    assert_eq!(out.len(), w.len() / rb * n, "bf16 rows vs output");
    assert_eq!(x.len(), n * cols, "bf16 rows input");
    // Token blocks outer, rows inner: the task's rows stay in L2 while every token block passes
    // over them, and each token block's activations stay in L1/L2.
    for t in (0..n).step_by(TOKEN_BLOCK) {
        for (row, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(n)) {
            if n - t >= TOKEN_BLOCK {
                // SAFETY: row is 2·cols bytes and tokens t..t+2 lie in x (lengths checked
                // above); CPU features are this function's contract.
                let r = unsafe { dot_bf16::<TOKEN_BLOCK>(row, x, cols, t) };
                o[t..t + TOKEN_BLOCK].copy_from_slice(&r);
            } else {
                // SAFETY: as above, for the one remaining token.
                let [r] = unsafe { dot_bf16::<1>(row, x, cols, t) };
                o[t] = r;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// MXFP4

/// Loads 8 packed bytes zero-extended to 8 lanes.
///
/// # Safety
/// 8 bytes at `p` are readable; the CPU supports AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_bytes8(p: *const u8) -> __m256i {
    // SAFETY: 8 readable bytes at p (caller contract).
    let b = unsafe { _mm_loadl_epi64(p as *const __m128i) };
    _mm256_cvtepu8_epi32(b)
}

/// E2M1 values of the codes in bits 0..3 of each lane (higher bits ignored).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn e2m1(codes: __m256i, magnitudes: __m256) -> __m256 {
    let mag = _mm256_permutevar8x32_ps(magnitudes, codes);
    let sign = _mm256_and_si256(_mm256_slli_epi32::<28>(codes), _mm256_set1_epi32(i32::MIN));
    _mm256_xor_ps(mag, _mm256_castsi256_ps(sign))
}

/// Adds group `g` of one MXFP4 row, scaled, into `acc[t]` for each token.
///
/// # Safety
/// Group `g` exists in `packed` (16 bytes) and in each `x[t]` (32 floats); AVX2 + FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn mxfp4_group<const T: usize>(
    packed: &[u8],
    scale: u8,
    x: &[&[f32]; T],
    g: usize,
    magnitudes: __m256,
    acc: &mut [__m256; T],
) {
    let p = packed.as_ptr().wrapping_add(16 * g);
    // SAFETY: bytes 16g .. 16g+8 lie in `packed` (caller contract).
    let b0 = unsafe { load_bytes8(p) };
    // SAFETY: bytes 16g+8 .. 16g+16 lie in `packed` (caller contract).
    let b1 = unsafe { load_bytes8(p.wrapping_add(8)) };
    let w = [
        e2m1(b0, magnitudes),
        e2m1(_mm256_srli_epi32::<4>(b0), magnitudes),
        e2m1(b1, magnitudes),
        e2m1(_mm256_srli_epi32::<4>(b1), magnitudes),
    ];
    let s = _mm256_set1_ps(E8M0_TABLE[scale as usize]);
    for t in 0..T {
        // SAFETY: group g's 32 activations of token t are in bounds (caller contract).
        let xv = unsafe { load32(x[t].as_ptr().wrapping_add(32 * g)) };
        let mut p = _mm256_mul_ps(w[0], xv[0]);
        p = _mm256_fmadd_ps(w[1], xv[1], p);
        p = _mm256_fmadd_ps(w[2], xv[2], p);
        p = _mm256_fmadd_ps(w[3], xv[3], p);
        acc[t] = _mm256_fmadd_ps(p, s, acc[t]);
    }
}

/// `T` MXFP4 row dots with tokens `t0 .. t0+T` of `x [n, cols]` (rearranged activations).
///
/// # Safety
/// `pr.len() == cols/2`, `sr.len() == cols/32`, `x.len() >= (t0+T)·cols`; AVX2 + FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_mxfp4<const T: usize>(
    pr: &[u8],
    sr: &[u8],
    x: &[f32],
    cols: usize,
    t0: usize,
) -> [f32; T] {
    let groups = cols / 32;
    assert!(pr.len() == 16 * groups && sr.len() == groups);
    let xs: [&[f32]; T] = std::array::from_fn(|i| &x[(t0 + i) * cols..(t0 + i + 1) * cols]);
    // SAFETY: E2M1 has 16 floats; the first 8 are the magnitudes.
    let magnitudes = unsafe { _mm256_loadu_ps(E2M1.as_ptr()) };
    let mut acc0 = [_mm256_setzero_ps(); T];
    let mut acc1 = [_mm256_setzero_ps(); T];
    let mut g = 0;
    while g + 2 <= groups {
        // SAFETY: g < groups; packed, scales and every token slice hold all groups.
        unsafe { mxfp4_group::<T>(pr, sr[g], &xs, g, magnitudes, &mut acc0) };
        // SAFETY: g + 1 < groups, as above.
        unsafe { mxfp4_group::<T>(pr, sr[g + 1], &xs, g + 1, magnitudes, &mut acc1) };
        g += 2;
    }
    if g < groups {
        // SAFETY: g < groups, as above.
        unsafe { mxfp4_group::<T>(pr, sr[g], &xs, g, magnitudes, &mut acc0) };
    }
    let mut out = [0.0f32; T];
    for t in 0..T {
        out[t] = hsum(_mm256_add_ps(acc0[t], acc1[t]));
    }
    out
}

/// Row kernel: `out [k, n]` for the `k` rows in `packed`/`scales`; `x [n, cols]` with every
/// 16 columns rearranged `[8 even | 8 odd]`.
///
/// # Safety
/// The CPU supports AVX2 and FMA. (Lengths are checked here.)
#[target_feature(enable = "avx2,fma")]
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
            if n - t >= TOKEN_BLOCK {
                // SAFETY: row slices have the checked lengths and tokens t..t+2 lie in x; CPU
                // features are this function's contract.
                let r = unsafe { dot_mxfp4::<TOKEN_BLOCK>(pr, sr, x, cols, t) };
                o[t..t + TOKEN_BLOCK].copy_from_slice(&r);
            } else {
                // SAFETY: as above, for the one remaining token.
                let [r] = unsafe { dot_mxfp4::<1>(pr, sr, x, cols, t) };
                o[t] = r;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// f32 dot

/// `Σ a[i]·b[i]`: four accumulators over 32-element steps, 8-element steps into accumulator 0,
/// the zero-padded rest into accumulator 1.
///
/// # Safety
/// The CPU supports AVX2 and FMA. (Lengths are checked here.)
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32 lengths");
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY: i + 32 <= n = a.len().
        let va = unsafe { load32(pa.wrapping_add(i)) };
        // SAFETY: i + 32 <= n = b.len().
        let vb = unsafe { load32(pb.wrapping_add(i)) };
        for j in 0..4 {
            acc[j] = _mm256_fmadd_ps(va[j], vb[j], acc[j]);
        }
        i += 32;
    }
    while i + 8 <= n {
        // SAFETY: i + 8 <= n = a.len().
        let va = unsafe { load8(pa.wrapping_add(i)) };
        // SAFETY: i + 8 <= n = b.len().
        let vb = unsafe { load8(pb.wrapping_add(i)) };
        acc[0] = _mm256_fmadd_ps(va, vb, acc[0]);
        i += 8;
    }
    if i < n {
        acc[1] = _mm256_fmadd_ps(load_tail(&a[i..]), load_tail(&b[i..]), acc[1]);
    }
    hsum(_mm256_add_ps(
        _mm256_add_ps(acc[0], acc[1]),
        _mm256_add_ps(acc[2], acc[3]),
    ))
}
