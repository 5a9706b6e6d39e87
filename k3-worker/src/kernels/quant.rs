//! Products with int8/int4 quantized matrices (`k3_proto::quant`: a quantized packed trunk's,
//! SPEC.md §6.15, or a draft trunk's): `y [n, rows] = x [n, cols] · Wᵀ`, `W ≈ q · s`.
//!
//! **The sequence** (the scalar twin, `scalar::q8_dot` / `scalar::q4_dot`, is its definition;
//! every tier computes each (row, token) by it, so all tiers give the same bits — tested per
//! tier on awkward shapes — and so do every thread count, token count and row blocking):
//! * int8, a scale per row: 32 lanes; column `c` goes to lane `c mod 32` as `acc = fma(q, x,
//!   acc)` in column order; the lanes are summed by halving (lane `i` adds lane `i + 16`, then
//!   `+ 8`, `+ 4`, `+ 2`, `+ 1`); the sum is multiplied by the row's scale.
//! * int4, a scale per 32 columns: 16 lanes; lane `i` of group `g` takes its byte `i` (columns
//!   `32g + 2i` low nibble, `32g + 2i + 1` high), `p = lo·x_even`, `p = fma(hi, x_odd, p)`,
//!   `acc = fma(p, s_g, acc)` (`lo`, `hi` the nibbles minus 8); the lanes are summed by halving.
//!   The activations are split per 32 columns as `[16 even | 16 odd]` once per call.
//!
//! Lane counts are multiples of 4, 8 and 16, so a 4-wide (NEON), 8-wide (AVX2) and 16-wide
//! (AVX-512) tier hold them in whole registers and follow the same sequence; the scalar twin
//! uses `f32::mul_add` (a correctly rounded fused multiply-add on every target). The tiers'
//! kernels (`avx2::quant_rows`, `avx512::quant_rows`, `neon::quant_rows`: their dots through
//! `quant_loop::QuantDots` in the shared loops `quant_loop::tokens`) differ only in how many
//! rows and tokens they dot at once: each
//! loaded code vector is used for a block of tokens, and a decode step dots several rows at
//! once so enough independent FMA chains hide the FMA latency.

use k3_proto::quant::{QuantKind, QuantMatrix, GROUP};

use super::{by_rows, scalar, split_even_odd_rows_into, with_buffer, Kernels, Tier, SPLIT};

/// `y [n, rows] = x [n, cols] · Wᵀ` for a quantized `W` on the active tier.
pub fn matmul_quant(m: &QuantMatrix<'_>, x: &[f32], n: usize, y: &mut [f32]) {
    Kernels::active().matmul_quant(m, x, n, y)
}

/// The row kernel of `tier` for rows `r0 .. r0 + k` (`out [k, n]`, `k = out.len()/n`). The
/// task's shape is checked here, once for every tier: the tiers' kernels take `k` as given.
fn quant_rows(tier: Tier, m: &QuantMatrix<'_>, r0: usize, x: &[f32], n: usize, out: &mut [f32]) {
    let cols = m.cols();
    assert!(n > 0 && cols.is_multiple_of(GROUP), "quant shape");
    assert_eq!(x.len(), n * cols, "quant rows input");
    let k = out.len() / n;
    assert!(out.len() == k * n && r0 + k <= m.rows(), "quant rows range");
    match tier {
        Tier::Scalar => scalar::quant_rows(m, r0, k, x, n, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernels` values exist only for tiers whose CPU features were detected
        // (`Kernels::new` / `active_tier`); the shape is checked above (and every row, token
        // and output the kernels touch is sliced with bounds checks, `quant_loop::block`).
        Tier::Avx2 => unsafe { super::avx2::quant_rows(m, r0, k, x, n, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, AVX-512 F/BW/VL and FMA were detected.
        Tier::Avx512 => unsafe { super::avx512::quant_rows(m, r0, k, x, n, out) },
        #[cfg(all(target_arch = "aarch64", target_endian = "little"))]
        // SAFETY: as above, NEON was detected (every aarch64 CPU has it).
        Tier::Neon => unsafe { super::neon::quant_rows(m, r0, k, x, n, out) },
        #[allow(unreachable_patterns)] // every tier of this architecture is matched above
        _ => scalar::quant_rows(m, r0, k, x, n, out),
    }
}

impl Kernels {
    /// [`matmul_quant`] on this tier.
    pub fn matmul_quant(self, m: &QuantMatrix<'_>, x: &[f32], n: usize, y: &mut [f32]) {
        let (rows, cols) = (m.rows(), m.cols());
        assert!(
            cols.is_multiple_of(GROUP),
            "quantized matrix of {cols} columns"
        );
        assert_eq!(Some(x.len()), n.checked_mul(cols), "matmul input");
        assert_eq!(Some(y.len()), n.checked_mul(rows), "matmul output");
        if cols == 0 || rows == 0 || n == 0 {
            y.fill(0.0);
            return;
        }
        let tier = self.tier();
        let mut run = |xs: &[f32]| {
            by_rows(rows, cols, n, y, |r0, out| {
                quant_rows(tier, m, r0, xs, n, out)
            })
        };
        match m.kind() {
            QuantKind::Int8 => run(x),
            QuantKind::Int4 => with_buffer(&SPLIT, |buf| {
                split_even_odd_rows_into(x, cols, scalar::Q4_LANES, buf);
                run(buf)
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_proto::quant::{dequantize_row, quantize_row};

    /// Codes and scales of `w [rows, cols]`, and the matrix over them.
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

    /// Weights with a spread of magnitudes per group (and a zero group), activations with
    /// both signs and some large values.
    fn data(rows: usize, cols: usize, n: usize, seed: usize) -> (Vec<f32>, Vec<f32>) {
        let w = (0..rows * cols)
            .map(|i| {
                let g = (i / 32) % 7;
                let v = (((i * 2654435761 + seed) % 1000) as f32 - 500.0) / 700.0;
                if g == 3 {
                    0.0
                } else {
                    v * (1.0 + g as f32)
                }
            })
            .collect();
        let x = (0..n * cols)
            .map(|i| {
                (((i * 40503 + seed) % 97) as f32 / 50.0 - 1.0)
                    * if i % 13 == 0 { 9.0 } else { 1.0 }
            })
            .collect();
        (w, x)
    }

    #[test]
    fn quantized_products_match_a_float64_product_of_the_dequantized_matrix() {
        for kind in [QuantKind::Int8, QuantKind::Int4] {
            for (rows, cols, n) in [(5, 32, 1), (37, 96, 3), (600, 512, 1), (33, 1024, 2)] {
                let (w, x) = data(rows, cols, n, 1);
                let (q, s) = quantize(kind, &w, rows, cols);
                let m = QuantMatrix::from_parts(kind, rows, cols, &q, &s).unwrap();
                let mut y = vec![0.0f32; n * rows];
                matmul_quant(&m, &x, n, &mut y);
                let (qb, sb) = kind.sizes(1, cols);
                for r in 0..rows {
                    let wr = dequantize_row(
                        kind,
                        &q[r * qb..(r + 1) * qb],
                        &s[r * sb..(r + 1) * sb],
                        cols,
                    );
                    for t in 0..n {
                        let xt = &x[t * cols..(t + 1) * cols];
                        let exact: f64 =
                            wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let mag: f64 = wr
                            .iter()
                            .zip(xt)
                            .map(|(&a, &b)| (a as f64 * b as f64).abs())
                            .sum();
                        let got = y[t * rows + r] as f64;
                        // f32 accumulation of `cols` terms: a few ulps of the magnitude.
                        assert!(
                            (got - exact).abs() <= 1e-5 * mag + 1e-6,
                            "{kind:?} [{rows},{cols}] row {r} token {t}: {got} vs {exact}"
                        );
                    }
                }
            }
        }
    }

    /// Every tier available equals the scalar twin bit for bit, per (row, token), on awkward
    /// row counts (not a multiple of any row block), column counts (1 to 17 groups, not a power
    /// of two) and token counts (every remainder of the token blocks), at 1 and 2 threads;
    /// a tier this CPU lacks is skipped and named.
    #[test]
    fn every_tier_is_the_scalar_twin_bit_for_bit() {
        let scalar = Kernels::new(Tier::Scalar).unwrap();
        let pool = super::super::build_pool(2).unwrap();
        for tier in Tier::ALL {
            let Some(k) = Kernels::new(tier) else {
                eprintln!("quant kernels: tier {tier} skipped: this CPU lacks it");
                continue;
            };
            for kind in [QuantKind::Int8, QuantKind::Int4] {
                for (rows, cols) in [(1, 32), (3, 64), (7, 96), (17, 160), (33, 544), (9, 1056)] {
                    for n in [1, 2, 3, 4, 5, 7, 9] {
                        let (w, x) = data(rows, cols, n, rows * 31 + cols);
                        let (q, s) = quantize(kind, &w, rows, cols);
                        let m = QuantMatrix::from_parts(kind, rows, cols, &q, &s).unwrap();
                        let mut want = vec![0.0f32; n * rows];
                        scalar.matmul_quant(&m, &x, n, &mut want);
                        let mut got = vec![0.0f32; n * rows];
                        k.matmul_quant(&m, &x, n, &mut got);
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{tier} {kind:?} [{rows},{cols}] n={n}"
                        );
                        let mut par = vec![0.0f32; n * rows];
                        pool.install(|| k.matmul_quant(&m, &x, n, &mut par));
                        assert_eq!(bits(&par), bits(&want), "{tier} {kind:?} 2 threads");
                        // Each token alone (a decode step) is its row of the batch.
                        for t in 0..n {
                            let mut yt = vec![0.0f32; rows];
                            k.matmul_quant(&m, &x[t * cols..(t + 1) * cols], 1, &mut yt);
                            assert_eq!(bits(&yt), bits(&want[t * rows..(t + 1) * rows]));
                        }
                    }
                }
            }
        }
    }

    /// Stored bytes no quantizer writes — every int8 code (−128 included), every nibble, scales
    /// of both signs from subnormal to near overflow, zero and infinite — and activations of
    /// mixed magnitudes: every tier is still the scalar twin bit for bit (NaN as NaN), per
    /// (row, token), for one token and for blocks of them.
    #[test]
    fn every_tier_is_the_scalar_twin_on_adversarial_bytes() {
        let scalar = Kernels::new(Tier::Scalar).unwrap();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let special = [
            1e-40f32,
            -3e-39,
            1e30,
            -2.5e30,
            0.0,
            -0.0,
            f32::INFINITY,
            7.0,
        ];
        for tier in Tier::ALL {
            let Some(k) = Kernels::new(tier) else {
                eprintln!("quant kernels: tier {tier} skipped: this CPU lacks it");
                continue;
            };
            for kind in [QuantKind::Int8, QuantKind::Int4] {
                for (rows, cols, n) in [(5, 64, 1), (6, 96, 2), (3, 288, 5), (9, 32, 3)] {
                    let (qb, sb) = kind.sizes(rows, cols);
                    let q: Vec<u8> = (0..qb).map(|_| next() as u8).collect();
                    let s: Vec<u8> = (0..sb / 4)
                        .flat_map(|i| {
                            let v = match next() % 4 {
                                0 => special[i % special.len()],
                                _ => (next() % 2001) as f32 / 1000.0 - 1.0,
                            };
                            v.to_le_bytes()
                        })
                        .collect();
                    let x: Vec<f32> = (0..n * cols)
                        .map(|_| {
                            let m = [1e-3f32, 1.0, 3e4][(next() % 3) as usize];
                            ((next() % 2001) as f32 / 1000.0 - 1.0) * m
                        })
                        .collect();
                    let m = QuantMatrix::from_parts(kind, rows, cols, &q, &s).unwrap();
                    let mut want = vec![0.0f32; n * rows];
                    scalar.matmul_quant(&m, &x, n, &mut want);
                    let mut got = vec![0.0f32; n * rows];
                    k.matmul_quant(&m, &x, n, &mut got);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                            "{tier} {kind:?} [{rows},{cols}] n={n} output {i}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }

    /// A large problem runs on the thread pool (rows split in chunks): the same bits as one
    /// thread.
    #[test]
    fn thread_count_changes_nothing() {
        for kind in [QuantKind::Int8, QuantKind::Int4] {
            let (rows, cols, n) = (300, 1024, 3);
            let (w, x) = data(rows, cols, n, 5);
            let (q, s) = quantize(kind, &w, rows, cols);
            let m = QuantMatrix::from_parts(kind, rows, cols, &q, &s).unwrap();
            let run = |threads: usize| {
                let pool = super::super::build_pool(threads).unwrap();
                let mut y = vec![0.0f32; n * rows];
                pool.install(|| matmul_quant(&m, &x, n, &mut y));
                y
            };
            assert_eq!(run(1), run(2), "{kind:?}");
        }
    }
}
