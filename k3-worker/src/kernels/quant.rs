//! Products with the quantized matrices of a draft trunk (int8 per row, int4 per 32 columns;
//! the formats are `k3_proto::quant`).
//!
//! A portable reference and an AVX2 version (used when the active tier is a SIMD tier) that does
//! the same float operations lane for lane — every multiply and add kept apart (Rust never
//! contracts them into an FMA), the lanes summed in the same fixed order — so both give the same
//! bits (tested); the thread count never changes a result either (rows are split as in the bf16
//! kernels). int8: column `c` adds into lane `c mod 32`, the sum is multiplied by the row's
//! scale; int4: each 32-column group adds its scaled partial sums into 16 lanes.

use k3_proto::quant::{QuantKind, GROUP};

use super::{by_rows, split_even_odd_rows_into, with_buffer, Kernels, Tier, SPLIT};

/// Lanes of an int4 row's sum (a 32-column group: 16 even and 16 odd columns).
const LANES: usize = 16;
/// Lanes of an int8 row's sum (column `c` adds into lane `c mod 32`).
const LANES8: usize = 32;

/// Sum `a`'s lanes by halving: lane `i` adds lane `i + len/2`, then again, down to one lane.
#[inline(always)]
fn reduce(a: &mut [f32]) -> f32 {
    let mut w = a.len() / 2;
    while w > 0 {
        for i in 0..w {
            a[i] += a[i + w];
        }
        w /= 2;
    }
    a[0]
}

#[inline(always)]
fn scale_at(s: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]])
}

/// Rows `out.len() / n` of an int8 matrix (`q` and `s` start at the first of them) times `n`
/// tokens; `out` is `[k, n]`. The reference order: lane `c mod 32` adds `q·x` (a multiply, then
/// an add) in column order, the lanes are [`reduce`]d, the sum is multiplied by the row's scale.
fn q8_rows(q: &[u8], s: &[u8], cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
    for (r, (qr, o)) in q
        .chunks_exact(cols)
        .zip(out.chunks_exact_mut(n))
        .enumerate()
    {
        let sc = scale_at(s, r);
        for (t, ot) in o.iter_mut().enumerate() {
            let xt = &x[t * cols..(t + 1) * cols];
            let mut acc = [0.0f32; LANES8];
            for (qc, xc) in qr.chunks_exact(LANES8).zip(xt.chunks_exact(LANES8)) {
                for i in 0..LANES8 {
                    acc[i] += (qc[i] as i8) as f32 * xc[i];
                }
            }
            *ot = reduce(&mut acc) * sc;
        }
    }
}

/// As [`q8_rows`] for int4 codes; `x` is split per 32 columns into `[16 even | 16 odd]`. Lane
/// `i` of a group adds `(lo·x_even + hi·x_odd)·scale`; the 16 lanes are [`reduce`]d.
fn q4_rows(q: &[u8], s: &[u8], cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
    let groups = cols / GROUP;
    for (r, (qr, o)) in q
        .chunks_exact(cols / 2)
        .zip(out.chunks_exact_mut(n))
        .enumerate()
    {
        let sr = &s[r * groups * 4..(r + 1) * groups * 4];
        for (t, ot) in o.iter_mut().enumerate() {
            let xt = &x[t * cols..(t + 1) * cols];
            let mut acc = [0.0f32; LANES];
            for (g, (qb, xg)) in qr
                .chunks_exact(GROUP / 2)
                .zip(xt.chunks_exact(GROUP))
                .enumerate()
            {
                let sc = scale_at(sr, g);
                let (xe, xo) = xg.split_at(LANES);
                for i in 0..LANES {
                    let lo = (qb[i] & 15) as i32 - 8;
                    let hi = (qb[i] >> 4) as i32 - 8;
                    acc[i] += (lo as f32 * xe[i] + hi as f32 * xo[i]) * sc;
                }
            }
            *ot = reduce(&mut acc);
        }
    }
}

fn rows_portable(
    kind: QuantKind,
    q: &[u8],
    s: &[u8],
    c: usize,
    x: &[f32],
    n: usize,
    o: &mut [f32],
) {
    match kind {
        QuantKind::Int8 => q8_rows(q, s, c, x, n, o),
        QuantKind::Int4 => q4_rows(q, s, c, x, n, o),
    }
}

/// AVX2 loads and stores from slices (each one unsafe operation, bounds asserted).
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// 8 signed bytes widened to 8 f32.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn i8x8(b: &[u8]) -> __m256 {
        assert!(b.len() >= 8);
        // SAFETY: 8 readable bytes (asserted); unaligned 64-bit load.
        let v = unsafe { _mm_loadl_epi64(b.as_ptr().cast()) };
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
    }

    /// 16 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn u8x16(b: &[u8]) -> __m128i {
        assert!(b.len() >= 16);
        // SAFETY: 16 readable bytes (asserted); unaligned load.
        unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
    }

    /// 8 f32.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn f32x8(x: &[f32]) -> __m256 {
        assert!(x.len() >= 8);
        // SAFETY: 8 readable floats (asserted); unaligned load.
        unsafe { _mm256_loadu_ps(x.as_ptr()) }
    }

    /// Store 8 f32.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn store(dst: &mut [f32], v: __m256) {
        assert!(dst.len() >= 8);
        // SAFETY: 8 writable floats (asserted); unaligned store.
        unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), v) }
    }
}

/// The same operations as [`rows_portable`], lane for lane, in AVX2 registers (multiplies and
/// adds kept apart, as the portable code does; the final lane sums in the same [`reduce`] order).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rows_avx2(
    kind: QuantKind,
    q: &[u8],
    s: &[u8],
    c: usize,
    x: &[f32],
    n: usize,
    o: &mut [f32],
) {
    use std::arch::x86_64::*;
    match kind {
        QuantKind::Int8 => {
            for (r, (qr, or)) in q.chunks_exact(c).zip(o.chunks_exact_mut(n)).enumerate() {
                let sc = scale_at(s, r);
                for (t, ot) in or.iter_mut().enumerate() {
                    let xt = &x[t * c..(t + 1) * c];
                    let mut acc = [_mm256_setzero_ps(); 4];
                    for (qc, xc) in qr.chunks_exact(LANES8).zip(xt.chunks_exact(LANES8)) {
                        for (j, a) in acc.iter_mut().enumerate() {
                            let w = simd::i8x8(&qc[8 * j..]);
                            let xv = simd::f32x8(&xc[8 * j..]);
                            *a = _mm256_add_ps(*a, _mm256_mul_ps(w, xv));
                        }
                    }
                    let mut lanes = [0.0f32; LANES8];
                    for (j, a) in acc.iter().enumerate() {
                        simd::store(&mut lanes[8 * j..], *a);
                    }
                    *ot = reduce(&mut lanes) * sc;
                }
            }
        }
        QuantKind::Int4 => {
            let groups = c / GROUP;
            let (mask, eight) = (_mm_set1_epi8(15), _mm_set1_epi8(8));
            for (r, (qr, or)) in q.chunks_exact(c / 2).zip(o.chunks_exact_mut(n)).enumerate() {
                let sr = &s[r * groups * 4..(r + 1) * groups * 4];
                for (t, ot) in or.iter_mut().enumerate() {
                    let xt = &x[t * c..(t + 1) * c];
                    let mut acc = [_mm256_setzero_ps(); 2];
                    for (g, (qb, xg)) in qr
                        .chunks_exact(GROUP / 2)
                        .zip(xt.chunks_exact(GROUP))
                        .enumerate()
                    {
                        let sc = _mm256_set1_ps(scale_at(sr, g));
                        let bytes = simd::u8x16(qb);
                        let lo = _mm_sub_epi8(_mm_and_si128(bytes, mask), eight);
                        let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), eight);
                        for (j, a) in acc.iter_mut().enumerate() {
                            let (l, h) = if j == 0 {
                                (lo, hi)
                            } else {
                                (_mm_srli_si128(lo, 8), _mm_srli_si128(hi, 8))
                            };
                            let lf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(l));
                            let hf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h));
                            let xe = simd::f32x8(&xg[8 * j..]);
                            let xo = simd::f32x8(&xg[LANES + 8 * j..]);
                            let p = _mm256_add_ps(_mm256_mul_ps(lf, xe), _mm256_mul_ps(hf, xo));
                            *a = _mm256_add_ps(*a, _mm256_mul_ps(p, sc));
                        }
                    }
                    let mut lanes = [0.0f32; LANES];
                    for (j, a) in acc.iter().enumerate() {
                        simd::store(&mut lanes[8 * j..], *a);
                    }
                    *ot = reduce(&mut lanes);
                }
            }
        }
    }
}

/// `y [n, rows] = x [n, cols] · Wᵀ` for a quantized `W` (codes `q`, scale bytes `s`, sizes as
/// [`QuantKind::sizes`]; `cols` a multiple of 32).
#[allow(clippy::too_many_arguments)]
pub fn matmul_quant(
    kind: QuantKind,
    q: &[u8],
    s: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    assert!(
        cols.is_multiple_of(GROUP),
        "quantized matrix of {cols} columns"
    );
    assert_eq!(
        (q.len(), s.len()),
        kind.sizes(rows, cols),
        "quantized [{rows}, {cols}]"
    );
    assert_eq!(Some(x.len()), n.checked_mul(cols), "matmul input");
    assert_eq!(Some(y.len()), n.checked_mul(rows), "matmul output");
    if cols == 0 {
        y.fill(0.0);
        return;
    }
    let (row_q, row_s) = kind.sizes(1, cols);
    let simd = Kernels::active().tier() != Tier::Scalar && avx2_detected();
    let mut run = |x: &[f32]| {
        by_rows(rows, cols, n, y, |r0, out| {
            let k = out.len() / n;
            let (q, s) = (
                &q[r0 * row_q..(r0 + k) * row_q],
                &s[r0 * row_s..(r0 + k) * row_s],
            );
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: `simd` is true only when the CPU reported AVX2 (`avx2_detected`).
                unsafe { rows_avx2(kind, q, s, cols, x, n, out) };
                return;
            }
            rows_portable(kind, q, s, cols, x, n, out)
        })
    };
    match kind {
        QuantKind::Int8 => run(x),
        QuantKind::Int4 => with_buffer(&SPLIT, |buf| {
            split_even_odd_rows_into(x, cols, LANES, buf);
            run(buf)
        }),
    }
}

fn avx2_detected() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_proto::quant::{dequantize_row, quantize_row};

    fn quantize(kind: QuantKind, w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
        let (qb, sb) = kind.sizes(1, cols);
        let (mut q, mut s) = (vec![0u8; qb * rows], vec![0u8; sb * rows]);
        for r in 0..rows {
            quantize_row(
                kind,
                &w[r * cols..(r + 1) * cols],
                &mut q[r * qb..(r + 1) * qb],
                &mut s[r * sb..(r + 1) * sb],
            );
        }
        (q, s)
    }

    #[test]
    fn quantized_products_match_a_float64_product_of_the_dequantized_matrix() {
        for kind in [QuantKind::Int8, QuantKind::Int4] {
            for (rows, cols, n) in [(5, 32, 1), (37, 96, 3), (600, 512, 1), (33, 1024, 2)] {
                let w: Vec<f32> = (0..rows * cols)
                    .map(|i| (((i * 2654435761) % 1000) as f32 - 500.0) / 700.0)
                    .collect();
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 40503) % 97) as f32 / 50.0 - 1.0)
                    .collect();
                let (q, s) = quantize(kind, &w, rows, cols);
                let mut y = vec![0.0f32; n * rows];
                matmul_quant(kind, &q, &s, rows, cols, &x, n, &mut y);
                let (qb, sb) = kind.sizes(1, cols);
                for r in 0..rows {
                    let wr = dequantize_row(
                        kind,
                        &q[r * qb..(r + 1) * qb],
                        &s[r * sb..(r + 1) * sb],
                        cols,
                    );
                    for t in 0..n {
                        let exact: f64 = wr
                            .iter()
                            .zip(&x[t * cols..(t + 1) * cols])
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum();
                        let mag: f64 = wr
                            .iter()
                            .zip(&x[t * cols..(t + 1) * cols])
                            .map(|(&a, &b)| (a as f64 * b as f64).abs())
                            .sum();
                        let got = y[t * rows + r] as f64;
                        assert!(
                            (got - exact).abs() <= 1e-5 * mag + 1e-6,
                            "{kind:?} [{rows},{cols}] row {r} token {t}: {got} vs {exact}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn quantized_products_do_not_depend_on_tokens_threads_or_the_build() {
        for kind in [QuantKind::Int8, QuantKind::Int4] {
            let (rows, cols, n) = (300, 1024, 3);
            let w: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 7919) % 513) as f32 / 300.0 - 0.8)
                .collect();
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 104729) % 89) as f32 / 40.0 - 1.1)
                .collect();
            let (q, s) = quantize(kind, &w, rows, cols);
            let run = |threads: usize| {
                let pool = super::super::build_pool(threads).unwrap();
                let mut y = vec![0.0f32; n * rows];
                pool.install(|| matmul_quant(kind, &q, &s, rows, cols, &x, n, &mut y));
                y
            };
            let y1 = run(1);
            assert_eq!(y1, run(2), "{kind:?}: 1 vs 2 threads");
            // Each token alone (a decode step) equals its row of the batch.
            for t in 0..n {
                let mut yt = vec![0.0f32; rows];
                matmul_quant(
                    kind,
                    &q,
                    &s,
                    rows,
                    cols,
                    &x[t * cols..(t + 1) * cols],
                    1,
                    &mut yt,
                );
                assert_eq!(yt, y1[t * rows..(t + 1) * rows], "{kind:?} token {t}");
            }
            // The portable build and the AVX2 build give the same bits.
            let xs = match kind {
                QuantKind::Int8 => x.clone(),
                QuantKind::Int4 => super::super::split_even_odd_rows(&x, cols, LANES),
            };
            let mut a = vec![0.0f32; rows * n];
            rows_portable(kind, &q, &s, cols, &xs, n, &mut a);
            #[cfg(target_arch = "x86_64")]
            if avx2_detected() {
                let mut b = vec![0.0f32; rows * n];
                // SAFETY: AVX2 was detected just above.
                unsafe { rows_avx2(kind, &q, &s, cols, &xs, n, &mut b) };
                assert_eq!(a, b, "{kind:?}: portable vs AVX2 build");
            }
            for r in 0..rows {
                for t in 0..n {
                    assert_eq!(a[r * n + t], y1[t * rows + r]);
                }
            }
        }
    }
}
