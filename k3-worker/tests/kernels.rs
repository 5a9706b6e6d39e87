//! Every kernel tier against the scalar reference and against independent f64 oracles written
//! here (not the kernels' own tables), on awkward lengths; bit-exactness where the contract
//! promises it (bf16 widening, matmul == matvec, thread-count invariance).
//!
//! Tiers this CPU lacks are skipped with a printed note.

use k3_worker::kernels::{self, build_pool, scalar, Kernels, Tier};

// ------------------------------------------------------------------------------------------
// Tolerances

/// Unit roundoff of f32 (2^-24).
const U_F32: f64 = 1.0 / (1u64 << 24) as f64;

/// Longest chain of f32 roundings between one product and a dot's result, for `cols` terms, in
/// any tier: ≤ cols/8 sequential adds into one accumulator lane (the scalar tier's 8 lanes; the
/// SIMD tiers' lanes are shorter), ≤ 32 adds inside an MXFP4 group partial sum, ≤ 16 for tail
/// steps and the fixed final reductions, and 1 for the product itself.
fn rounding_chain(cols: usize) -> f64 {
    (cols / 8 + 32 + 16 + 1) as f64
}

/// Absolute slack for products and group scales in the subnormal range, where f32 loses bits
/// below 2^-149 whatever the order (E8M0 byte 0 is 2^-127; bf16 subnormals exist).
const SUBNORMAL_SLACK: f64 = 1e-30;

/// DOT_ERROR_BOUND: forward error of ANY summation order of `cols` f32 products, relative to
/// the exact sum: `|computed − exact| ≤ γ_k · Σ|w·x|` with `γ_k = k·u / (1 − k·u)` and
/// `k = rounding_chain(cols)` (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1).
/// Two tiers (different orders) therefore differ by at most twice this.
fn dot_error_bound(cols: usize, abs_sum: f64) -> f64 {
    let k = rounding_chain(cols);
    k * U_F32 / (1.0 - k * U_F32) * abs_sum + SUBNORMAL_SLACK
}

/// `|got − want| ≤ bound` (false for NaN).
fn within(got: f64, want: f64, bound: f64) -> bool {
    (got - want).abs() <= bound
}

// ------------------------------------------------------------------------------------------
// Data

/// splitmix64: small, deterministic, good enough for test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Random finite bf16 bits: ±0 (5%), subnormals (2%), else normal values of magnitude
/// 2^-8 .. 2^5 with random mantissa and sign.
fn random_bf16(rng: &mut Rng) -> u16 {
    let sign = (rng.below(2) as u16) << 15;
    match rng.below(100) {
        0..=4 => sign,
        5..=6 => sign | (1 + rng.below(127)) as u16,
        _ => {
            let exp = (127 - 8 + rng.below(14)) as u16;
            sign | (exp << 7) | rng.below(128) as u16
        }
    }
}

/// Random activations in [-2, 2), with ±0 (5%).
fn random_x(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| match rng.below(40) {
            0 => -0.0,
            1 => 0.0,
            _ => 2.0 * rng.unit(),
        })
        .collect()
}

fn bf16_matrix(rng: &mut Rng, rows: usize, cols: usize) -> (Vec<u8>, Vec<u16>) {
    let bits: Vec<u16> = (0..rows * cols).map(|_| random_bf16(rng)).collect();
    let bytes = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    (bytes, bits)
}

/// Every tier this CPU can run; prints a note for each one it cannot.
fn tiers() -> Vec<Kernels> {
    Tier::ALL
        .into_iter()
        .filter_map(|t| {
            let k = Kernels::new(t);
            if k.is_none() {
                eprintln!("note: skipping tier {t}: this CPU lacks its instructions");
            }
            k
        })
        .collect()
}

/// Widths around the SIMD tiers' steps: AVX2 reads 16-column blocks, then one 8-column step,
/// then a padded tail; AVX-512 reads 32-column blocks, then one 16-column step, then a masked
/// tail (e.g. 24 = 16+8, 47 = 32+15 / 2·16+8+7, 57 = 32+16+9 / 3·16+8+1).
const BF16_COLS: [usize; 23] = [
    1, 3, 7, 8, 15, 16, 17, 24, 31, 32, 33, 40, 47, 48, 57, 63, 64, 65, 79, 127, 1023, 1024, 4099,
];
/// Row counts around the SIMD tiers' row blocks (8 rows, then 4, 2, 1): 15 = 8+4+2+1.
const BF16_ROWS: [usize; 6] = [1, 3, 6, 15, 17, 33];
const MXFP4_GROUPS: [usize; 7] = [1, 2, 3, 5, 7, 31, 112];
const MXFP4_ROWS: [usize; 4] = [1, 3, 17, 33];

// ------------------------------------------------------------------------------------------
// Oracles (independent of the kernels' code and tables)

/// `(Σ w·x, Σ|w·x|)` in f64 for one bf16 row given as bits; widening via the `half` crate.
fn oracle_bf16(bits: &[u16], x: &[f32]) -> (f64, f64) {
    bits.iter().zip(x).fold((0.0, 0.0), |(s, a), (&b, &xv)| {
        let p = half::bf16::from_bits(b).to_f64() * xv as f64;
        (s + p, a + p.abs())
    })
}

/// E2M1 decoded from the bit layout: bit 3 sign, bits 0..2 index the magnitudes.
fn e2m1_value(code: u8) -> f64 {
    let mag = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][(code & 7) as usize];
    if code & 8 != 0 {
        -mag
    } else {
        mag
    }
}

/// Dequantised MXFP4 row in f64. `swap` decodes the nibbles the wrong way round (the negative
/// control): with `swap = false`, column `2i` is the LOW nibble of byte `i`.
fn dequant_mxfp4_row(packed: &[u8], scales: &[u8], swap: bool) -> Vec<f64> {
    let cols = packed.len() * 2;
    (0..cols)
        .map(|c| {
            let b = packed[c / 2];
            let (lo, hi) = (b & 0xF, b >> 4);
            let code = if (c % 2 == 0) != swap { lo } else { hi };
            let s = scales[c / 32];
            let factor = if s == 255 {
                0.0
            } else {
                2f64.powi(s as i32 - 127)
            };
            e2m1_value(code) * factor
        })
        .collect()
}

fn oracle_dot(w: &[f64], x: &[f32]) -> (f64, f64) {
    w.iter().zip(x).fold((0.0, 0.0), |(s, a), (&wv, &xv)| {
        let p = wv * xv as f64;
        (s + p, a + p.abs())
    })
}

struct Mxfp4 {
    packed: Vec<u8>,
    scales: Vec<u8>,
}

/// Random MXFP4 matrix: every code equally likely; scale bytes 100..=150, except that about one
/// row in three has one group at an edge byte (0 = 2^-127, subnormal; 254 = 2^127). Activations
/// for these matrices stay below 2^-8 in magnitude so one 2^127 group cannot overflow f32.
fn mxfp4_matrix(rng: &mut Rng, rows: usize, cols: usize) -> Mxfp4 {
    let packed = (0..rows * cols / 2).map(|_| rng.below(256) as u8).collect();
    let sw = cols / 32;
    let mut scales: Vec<u8> = (0..rows * sw).map(|_| 100 + rng.below(51) as u8).collect();
    for r in 0..rows {
        match rng.below(6) {
            0 => scales[r * sw + rng.below(sw as u64) as usize] = 0,
            1 => scales[r * sw + rng.below(sw as u64) as usize] = 254,
            _ => {}
        }
    }
    Mxfp4 { packed, scales }
}

fn small_x(rng: &mut Rng, len: usize) -> Vec<f32> {
    random_x(rng, len).iter().map(|v| v / 512.0).collect()
}

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

// ------------------------------------------------------------------------------------------
// bf16

#[test]
fn bf16_to_f32_matches_half_for_all_65536_patterns() {
    for b in 0..=u16::MAX {
        let ours = kernels::bf16_to_f32(b);
        let theirs = half::bf16::from_bits(b).to_f32();
        if theirs.is_nan() {
            assert!(ours.is_nan(), "pattern {b:#06x}: expected NaN, got {ours}");
        } else {
            assert_eq!(ours.to_bits(), theirs.to_bits(), "pattern {b:#06x}");
        }
    }
    let bytes: Vec<u8> = [0x3F80u16, 0xC000, 0x8000]
        .iter()
        .flat_map(|b| b.to_le_bytes())
        .collect();
    let v = kernels::bf16_bytes_to_f32(&bytes);
    assert_eq!(v[..2], [1.0, -2.0]);
    assert_eq!(v[2].to_bits(), (-0.0f32).to_bits());
}

/// Every tier widens every bf16 pattern exactly in every lane position (even and odd halves of
/// the paired blocks, single-vector steps and the tail): row `r` holds pattern `r` at column
/// `r % cols` and zeros elsewhere; with `x = 1` the dot is exactly the widened pattern. 81 and 95
/// columns: AVX2 reads 5 blocks of 16 then 1 / 8 + 7 columns, AVX-512 2 blocks of 32, 16, then
/// 1 / 15 columns.
#[test]
fn every_tier_widens_every_bf16_pattern_exactly_in_every_lane() {
    for cols in [81usize, 95] {
        let rows = 1usize << 16;
        let mut w = vec![0u8; rows * cols * 2];
        for r in 0..rows {
            let at = (r * cols + r % cols) * 2;
            w[at..at + 2].copy_from_slice(&(r as u16).to_le_bytes());
        }
        let x = vec![1.0f32; cols];
        for k in tiers() {
            let mut y = vec![0.0f32; rows];
            k.matvec_bf16(&w, rows, cols, &x, &mut y);
            for (r, &v) in y.iter().enumerate() {
                let want = half::bf16::from_bits(r as u16).to_f32();
                if want.is_nan() {
                    assert!(v.is_nan(), "{} cols {cols}: pattern {r:#06x}", k.tier());
                } else {
                    // `==`: the sign of an exact zero result is not part of the contract.
                    assert!(
                        v == want,
                        "{} cols {cols}: pattern {r:#06x}: {v} != {want}",
                        k.tier()
                    );
                }
            }
        }
    }
}

/// The SIMD tiers read the activations rearranged (even/odd columns per block, the tail in
/// order): a single nonzero activation at each column in turn must pick out exactly that
/// column's weight, for widths with every kind of tail.
#[test]
fn bf16_each_activation_column_meets_its_own_weight_column() {
    let mut rng = Rng(11);
    for cols in [15usize, 16, 17, 24, 33, 47, 57, 95] {
        let rows = 9;
        let (w, bits) = bf16_matrix(&mut rng, rows, cols);
        for k in tiers() {
            for c in 0..cols {
                let mut x = vec![0.0f32; cols];
                x[c] = 1.0;
                let mut y = vec![f32::NAN; rows];
                k.matvec_bf16(&w, rows, cols, &x, &mut y);
                for r in 0..rows {
                    let want = half::bf16::from_bits(bits[r * cols + c]).to_f32();
                    assert!(
                        y[r] == want,
                        "{} {rows}x{cols} row {r} column {c}: {} != {want}",
                        k.tier(),
                        y[r]
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_matvec_every_tier_within_bound_of_oracle_and_scalar() {
    let mut rng = Rng(1);
    for &cols in &BF16_COLS {
        for &rows in &BF16_ROWS {
            let (w, bits) = bf16_matrix(&mut rng, rows, cols);
            let x = random_x(&mut rng, cols);
            let mut reference = vec![0.0f32; rows];
            scalar::matvec_bf16(&w, rows, cols, &x, &mut reference);
            for k in tiers() {
                let mut y = vec![f32::NAN; rows];
                k.matvec_bf16(&w, rows, cols, &x, &mut y);
                for r in 0..rows {
                    let (exact, abs) = oracle_bf16(&bits[r * cols..(r + 1) * cols], &x);
                    let bound = dot_error_bound(cols, abs);
                    let (got, sref) = (y[r] as f64, reference[r] as f64);
                    assert!(
                        (got - exact).abs() <= bound,
                        "{} {rows}x{cols} row {r}: {got} vs exact {exact} (bound {bound:e})",
                        k.tier()
                    );
                    assert!(
                        (got - sref).abs() <= 2.0 * bound,
                        "{} {rows}x{cols} row {r}: {got} vs scalar {sref}",
                        k.tier()
                    );
                }
            }
        }
    }
}

/// A wrong widening (e.g. treating bf16 as f16, or a byte-swapped load) must fail the oracle
/// comparison: checks that the comparison above has teeth.
#[test]
fn bf16_oracle_rejects_byte_swapped_weights() {
    let mut rng = Rng(2);
    let (rows, cols) = (17, 65);
    let (w, bits) = bf16_matrix(&mut rng, rows, cols);
    let swapped: Vec<u8> = w.chunks_exact(2).flat_map(|b| [b[1], b[0]]).collect();
    let x = random_x(&mut rng, cols);
    for k in tiers() {
        let mut y = vec![0.0f32; rows];
        k.matvec_bf16(&swapped, rows, cols, &x, &mut y);
        let failing = (0..rows)
            .filter(|&r| {
                let (exact, abs) = oracle_bf16(&bits[r * cols..(r + 1) * cols], &x);
                !within(y[r] as f64, exact, dot_error_bound(cols, abs))
            })
            .count();
        assert!(
            failing >= rows - 1,
            "{}: only {failing} rows differ",
            k.tier()
        );
    }
}

// ------------------------------------------------------------------------------------------
// MXFP4

#[test]
fn mxfp4_matvec_every_tier_within_bound_of_dequantised_oracle() {
    let mut rng = Rng(3);
    let mut codes_seen = [false; 16];
    let (mut saw0, mut saw254) = (false, false);
    for &groups in &MXFP4_GROUPS {
        for &rows in &MXFP4_ROWS {
            let cols = 32 * groups;
            let m = mxfp4_matrix(&mut rng, rows, cols);
            for b in &m.packed {
                codes_seen[(b & 0xF) as usize] = true;
                codes_seen[(b >> 4) as usize] = true;
            }
            saw0 |= m.scales.contains(&0);
            saw254 |= m.scales.contains(&254);
            let x = small_x(&mut rng, cols);
            let mut reference = vec![0.0f32; rows];
            scalar::matvec_mxfp4(&m.packed, &m.scales, rows, cols, &x, &mut reference);
            for k in tiers() {
                let mut y = vec![f32::NAN; rows];
                k.matvec_mxfp4(&m.packed, &m.scales, rows, cols, &x, &mut y);
                for r in 0..rows {
                    let w = dequant_mxfp4_row(
                        &m.packed[r * cols / 2..(r + 1) * cols / 2],
                        &m.scales[r * groups..(r + 1) * groups],
                        false,
                    );
                    let (exact, abs) = oracle_dot(&w, &x);
                    let bound = dot_error_bound(cols, abs);
                    let (got, sref) = (y[r] as f64, reference[r] as f64);
                    assert!(
                        (got - exact).abs() <= bound,
                        "{} {rows}x{cols} row {r}: {got} vs exact {exact} (bound {bound:e})",
                        k.tier()
                    );
                    assert!(
                        (got - sref).abs() <= 2.0 * bound,
                        "{} {rows}x{cols} row {r}: {got} vs scalar {sref}",
                        k.tier()
                    );
                }
            }
        }
    }
    assert!(
        codes_seen.iter().all(|&s| s),
        "not every nibble code was exercised"
    );
    assert!(
        saw0 && saw254,
        "edge scale bytes 0 and 254 were not exercised"
    );
}

/// Negative control: decoding the nibbles the other way round (high nibble = even column) must
/// FAIL the same comparison, for every tier.
#[test]
fn mxfp4_swapped_nibble_oracle_is_rejected() {
    let mut rng = Rng(4);
    let (rows, cols) = (33, 96);
    let m = mxfp4_matrix(&mut rng, rows, cols);
    let x = small_x(&mut rng, cols);
    for k in tiers() {
        let mut y = vec![0.0f32; rows];
        k.matvec_mxfp4(&m.packed, &m.scales, rows, cols, &x, &mut y);
        let failing = (0..rows)
            .filter(|&r| {
                let w = dequant_mxfp4_row(
                    &m.packed[r * cols / 2..(r + 1) * cols / 2],
                    &m.scales[r * 3..(r + 1) * 3],
                    true,
                );
                let (exact, abs) = oracle_dot(&w, &x);
                !within(y[r] as f64, exact, dot_error_bound(cols, abs))
            })
            .count();
        assert!(
            failing >= rows - 1,
            "{}: swapped nibbles matched on {} of {rows} rows",
            k.tier(),
            rows - failing
        );
    }
}

/// One exact case by hand: codes 0..15 in order with x = 1 at one column at a time, scale bytes
/// 127 (×1), 128 (×2), 0 (×2^-127) and 255 (treated as 0).
#[test]
fn mxfp4_single_columns_decode_exactly() {
    let cols = 32;
    let row_codes: Vec<u8> = (0..32).map(|c| (c % 16) as u8).collect();
    let packed_row: Vec<u8> = row_codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect();
    let scale_bytes = [127u8, 128, 0, 255];
    let rows = scale_bytes.len();
    let packed: Vec<u8> = (0..rows).flat_map(|_| packed_row.clone()).collect();
    for k in tiers() {
        for c in 0..cols {
            let mut x = vec![0.0f32; cols];
            x[c] = 1.0;
            let mut y = vec![0.0f32; rows];
            k.matvec_mxfp4(&packed, &scale_bytes, rows, cols, &x, &mut y);
            let v = e2m1_value(row_codes[c]);
            let want = [v, 2.0 * v, v * 2f64.powi(-127), 0.0];
            for r in 0..rows {
                assert!(
                    y[r] as f64 == want[r],
                    "{} column {c} scale {}: {} != {}",
                    k.tier(),
                    scale_bytes[r],
                    y[r],
                    want[r]
                );
            }
        }
    }
}

#[test]
fn e8m0_table_is_two_to_the_s_minus_127() {
    for s in 0..=254u8 {
        assert_eq!(
            scalar::E8M0_TABLE[s as usize] as f64,
            2f64.powi(s as i32 - 127),
            "byte {s}"
        );
        assert_eq!(scalar::e8m0(s), scalar::E8M0_TABLE[s as usize]);
    }
    assert_eq!(scalar::E8M0_TABLE[255], 0.0);
}

// ------------------------------------------------------------------------------------------
// Bitwise contracts: matmul == matvec, thread-count invariance

fn check_matmul_equals_matvec(k: Kernels, rows: usize, cols: usize, rng: &mut Rng) {
    let (w, _) = bf16_matrix(rng, rows, cols);
    let m = mxfp4_matrix(rng, rows, cols);
    for n in [1usize, 2, 3, 4, 5, 7, 9, 16] {
        let x = random_x(rng, n * cols);
        let xs = small_x(rng, n * cols);
        let mut yb = vec![f32::NAN; n * rows];
        let mut ym = vec![f32::NAN; n * rows];
        k.matmul_bf16(&w, rows, cols, &x, n, &mut yb);
        k.matmul_mxfp4(&m.packed, &m.scales, rows, cols, &xs, n, &mut ym);
        for t in 0..n {
            let mut vb = vec![f32::NAN; rows];
            let mut vm = vec![f32::NAN; rows];
            k.matvec_bf16(&w, rows, cols, &x[t * cols..(t + 1) * cols], &mut vb);
            k.matvec_mxfp4(
                &m.packed,
                &m.scales,
                rows,
                cols,
                &xs[t * cols..(t + 1) * cols],
                &mut vm,
            );
            let tier = k.tier();
            assert_eq!(
                bits_of(&yb[t * rows..(t + 1) * rows]),
                bits_of(&vb),
                "{tier} bf16 {rows}x{cols} n={n} token {t}"
            );
            assert_eq!(
                bits_of(&ym[t * rows..(t + 1) * rows]),
                bits_of(&vm),
                "{tier} mxfp4 {rows}x{cols} n={n} token {t}"
            );
        }
    }
}

/// bf16 alone on widths that are not whole SIMD blocks (the activations' rearranged blocks and
/// in-order tails) and row counts around the row blocks; 131×1001 with 5, 7 or 9 tokens takes
/// the parallel path (`kernels::on_pool`), with up to 4 tokens the calling thread. A
/// single-token product dots rows of at most `NARROW_COLS` columns one at a time and wider rows
/// in blocks of 8; both must give the 4-row matmul blocks' bits.
#[test]
fn bf16_matmul_equals_matvec_bitwise_on_odd_widths() {
    let mut rng = Rng(8);
    let (narrow, wide) = (
        k3_worker::kernels::NARROW_COLS,
        k3_worker::kernels::NARROW_COLS + 37,
    );
    assert!(!kernels::on_pool(131, 1001, 4) && kernels::on_pool(131, 1001, 5));
    for k in tiers() {
        for (rows, cols) in [(15, 37), (6, 95), (131, 1001), (19, narrow), (21, wide)] {
            let (w, _) = bf16_matrix(&mut rng, rows, cols);
            for n in [1usize, 2, 3, 4, 5, 7, 9] {
                let x = random_x(&mut rng, n * cols);
                let mut y = vec![f32::NAN; n * rows];
                k.matmul_bf16(&w, rows, cols, &x, n, &mut y);
                for t in 0..n {
                    let mut v = vec![f32::NAN; rows];
                    k.matvec_bf16(&w, rows, cols, &x[t * cols..(t + 1) * cols], &mut v);
                    assert_eq!(
                        bits_of(&y[t * rows..(t + 1) * rows]),
                        bits_of(&v),
                        "{} bf16 {rows}x{cols} n={n} token {t}",
                        k.tier()
                    );
                }
            }
        }
    }
}

#[test]
fn matmul_row_t_equals_matvec_of_token_t_bitwise() {
    let mut rng = Rng(5);
    for k in tiers() {
        // Small (serial) and large enough for the parallel path; odd sizes exercise tails.
        for (rows, cols) in [(3, 32), (17, 96), (33, 224), (67, 1056)] {
            check_matmul_equals_matvec(k, rows, cols, &mut rng);
        }
    }
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let mut rng = Rng(6);
    let (rows, cols, n) = (501, 544, 5); // 272k MACs per token: parallel path, 32 row chunks
    assert!(rows * cols >= kernels::PAR_MIN_MACS);
    let (w, _) = bf16_matrix(&mut rng, rows, cols);
    let m = mxfp4_matrix(&mut rng, rows, cols);
    let x = random_x(&mut rng, n * cols);
    let xs = small_x(&mut rng, n * cols);
    let a = random_x(&mut rng, 100_003);
    let b = random_x(&mut rng, 100_003);
    // bf16 at a width that is not whole SIMD blocks (rearranged blocks plus in-order tails).
    let (odd_rows, odd_cols) = (503, 547);
    assert!(odd_rows * odd_cols >= kernels::PAR_MIN_MACS);
    let (wo, _) = bf16_matrix(&mut rng, odd_rows, odd_cols);
    let xo = random_x(&mut rng, n * odd_cols);
    for k in tiers() {
        let run = |threads: usize| {
            let pool = build_pool(threads).expect("thread pool");
            pool.install(|| {
                assert_eq!(rayon::current_num_threads(), threads);
                let mut out = Vec::new();
                let mut y = vec![0.0f32; rows];
                k.matvec_bf16(&w, rows, cols, &x[..cols], &mut y);
                out.extend(bits_of(&y));
                let mut y = vec![0.0f32; n * rows];
                k.matmul_bf16(&w, rows, cols, &x, n, &mut y);
                out.extend(bits_of(&y));
                let mut y = vec![0.0f32; odd_rows];
                k.matvec_bf16(&wo, odd_rows, odd_cols, &xo[..odd_cols], &mut y);
                out.extend(bits_of(&y));
                let mut y = vec![0.0f32; n * odd_rows];
                k.matmul_bf16(&wo, odd_rows, odd_cols, &xo, n, &mut y);
                out.extend(bits_of(&y));
                let mut y = vec![0.0f32; rows];
                k.matvec_mxfp4(&m.packed, &m.scales, rows, cols, &xs[..cols], &mut y);
                out.extend(bits_of(&y));
                let mut y = vec![0.0f32; n * rows];
                k.matmul_mxfp4(&m.packed, &m.scales, rows, cols, &xs, n, &mut y);
                out.extend(bits_of(&y));
                out.push(k.dot_f32(&a, &b).to_bits());
                out
            })
        };
        let one = run(1);
        for threads in [2, 3] {
            assert!(
                run(threads) == one,
                "{}: {threads} threads differ from 1",
                k.tier()
            );
        }
    }
}

// ------------------------------------------------------------------------------------------
// dot_f32, degenerate shapes, elementwise kernels

#[test]
fn dot_f32_every_tier_within_bound() {
    let mut rng = Rng(7);
    for len in [
        0usize, 1, 3, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 127, 576, 1023, 4099,
    ] {
        let a = random_x(&mut rng, len);
        let b = random_x(&mut rng, len);
        let (exact, abs) = a.iter().zip(&b).fold((0.0f64, 0.0f64), |(s, t), (&p, &q)| {
            let v = p as f64 * q as f64;
            (s + v, t + v.abs())
        });
        let bound = dot_error_bound(len, abs);
        for k in tiers() {
            let got = k.dot_f32(&a, &b) as f64;
            assert!(
                (got - exact).abs() <= bound,
                "{} len {len}: {got} vs {exact}",
                k.tier()
            );
        }
        assert!((scalar::dot_f32(&a, &b) as f64 - exact).abs() <= bound);
    }
}

#[test]
fn degenerate_shapes() {
    for k in tiers() {
        // No rows or no tokens: nothing to write.
        k.matvec_bf16(&[], 0, 5, &[0.0; 5], &mut []);
        k.matmul_bf16(&[0u8; 10], 1, 5, &[], 0, &mut []);
        k.matmul_mxfp4(&[], &[], 0, 32, &[0.0; 64], 2, &mut []);
        // No columns: empty sums are zero.
        let mut y = [f32::NAN; 3];
        k.matvec_bf16(&[], 3, 0, &[], &mut y);
        assert_eq!(y, [0.0; 3]);
        let mut y = [f32::NAN; 2];
        k.matvec_mxfp4(&[], &[], 2, 0, &[], &mut y);
        assert_eq!(y, [0.0; 2]);
    }
}

#[test]
#[should_panic(expected = "bf16 weight bytes")]
fn bf16_length_mismatch_is_caught() {
    let k = Kernels::new(Tier::best_available()).expect("best tier");
    let mut y = [0.0f32; 2];
    k.matvec_bf16(&[0u8; 6], 2, 2, &[0.0; 2], &mut y);
}

#[test]
#[should_panic(expected = "not a multiple of 32")]
fn mxfp4_width_must_be_whole_groups() {
    let k = Kernels::new(Tier::best_available()).expect("best tier");
    let mut y = [0.0f32; 1];
    k.matvec_mxfp4(&[0u8; 8], &[127], 1, 16, &[0.0; 16], &mut y);
}

#[test]
fn situ_glu_saturates_at_both_caps_and_stays_within_100() {
    let (b1, b2) = (4.0f32, 25.0f32);
    // |out| ≤ β1·β2 over |z| from 0.1 to 1000, all sign combinations.
    let mags: Vec<f32> = (0..=40)
        .map(|i| 0.1 * 10f32.powf(i as f32 / 10.0))
        .collect();
    let mut gate = Vec::new();
    let mut up = Vec::new();
    for &g in &mags {
        for &u in &mags {
            for (sg, su) in [(1.0, 1.0), (1.0, -1.0), (-1.0, 1.0), (-1.0, -1.0)] {
                gate.push(sg * g);
                up.push(su * u);
            }
        }
    }
    let mut out = vec![0.0f32; gate.len()];
    kernels::situ_glu(&gate, &up, b1, b2, &mut out);
    for i in 0..out.len() {
        assert!(
            out[i].abs() <= 100.0,
            "g={} u={} out={}",
            gate[i],
            up[i],
            out[i]
        );
        let (g, u) = (gate[i] as f64, up[i] as f64);
        let want = 4.0 * (g / 4.0).tanh() / (1.0 + (-g).exp()) * 25.0 * (u / 25.0).tanh();
        assert!((out[i] as f64 - want).abs() <= 1e-5 * want.abs().max(1e-3));
    }
    // Both caps saturate: large gate → 4 (σ → 1), large |up| → ±25; the product reaches ±100.
    let mut o = [0.0f32; 4];
    kernels::situ_glu(
        &[1000.0, 1000.0, 1000.0, 1.0],
        &[1000.0, -1000.0, 1.0, 1000.0],
        b1,
        b2,
        &mut o,
    );
    assert!(
        (o[0] - 100.0).abs() < 1e-4 && (o[1] + 100.0).abs() < 1e-4,
        "{o:?}"
    );
    let a1 = 4.0 * (0.25f64).tanh() / (1.0 + (-1.0f64).exp());
    assert!(
        (o[2] as f64 - 4.0 * 25.0 * (1.0f64 / 25.0).tanh()).abs() < 1e-4,
        "gate cap: {o:?}"
    );
    assert!((o[3] as f64 - a1 * 25.0).abs() < 1e-4, "up cap: {o:?}");
    // σ takes the UNCAPPED gate: a large negative gate gives ~0, not −4·σ(−4)·u.
    let mut o = [0.0f32; 1];
    kernels::situ_glu(&[-30.0], &[10.0], b1, b2, &mut o);
    assert!(o[0].abs() < 1e-9, "{o:?}");
}

#[test]
fn rms_norm_is_mean_with_eps_inside_and_l2_is_sum() {
    let x = [3.0f32, -4.0, 0.0, 1.0];
    let w = [1.0f32, 2.0, 3.0, 0.5];
    let eps = 1e-5f32;
    let mut out = [0.0f32; 4];
    kernels::rms_norm(&x, &w, eps, &mut out);
    let inv = 1.0 / ((9.0 + 16.0 + 0.0 + 1.0) / 4.0 + eps as f64).sqrt();
    for i in 0..4 {
        let want = w[i] as f64 * x[i] as f64 * inv;
        assert!(
            (out[i] as f64 - want).abs() <= 1e-6 * want.abs().max(1.0),
            "{i}"
        );
    }
    let mut v = x;
    kernels::l2_norm_inplace(&mut v, 1e-6);
    let inv = 1.0 / (26.0f64 + 1e-6).sqrt();
    for i in 0..4 {
        assert!((v[i] as f64 - x[i] as f64 * inv).abs() <= 1e-6, "{i}");
    }
    let mut s = [1.0f32, 2.0, 3.0, -1000.0];
    kernels::softmax_inplace(&mut s);
    let e = [(-2f64).exp(), (-1f64).exp(), 1.0];
    let z: f64 = e.iter().sum();
    for i in 0..3 {
        assert!((s[i] as f64 - e[i] / z).abs() < 1e-6);
    }
    assert_eq!(s[3], 0.0);
}

/// Child half of `k3_simd_env_forces_or_refuses_each_tier`: prints what `select_tier` chose.
#[test]
fn env_child_reports_tier() {
    if std::env::var_os("K3_KERNELS_TEST_CHILD").is_none() {
        return; // only meaningful when spawned by the parent test
    }
    match kernels::select_tier() {
        Ok(t) => {
            assert_eq!(kernels::active_tier(), t);
            println!("SELECTED={t}");
        }
        Err(e) => println!("REFUSED={e}"),
    }
}

/// A command running this test binary again: directly, or through `K3_TEST_RUNNER` (an
/// emulator such as `qemu-aarch64 -L /usr/aarch64-linux-gnu`, which `scripts/test-platforms.sh`
/// sets: an emulated process cannot exec a foreign binary itself without the kernel's binfmt
/// registration).
fn self_command(exe: &std::path::Path) -> std::process::Command {
    let runner = std::env::var("K3_TEST_RUNNER").unwrap_or_default();
    let mut words = runner.split_whitespace();
    match words.next() {
        Some(prog) => {
            let mut c = std::process::Command::new(prog);
            c.args(words).arg(exe);
            c
        }
        None => std::process::Command::new(exe),
    }
}

/// A test of this file as the test binary names it: `FILE::NAME` (every file is a module of one
/// binary; `--exact` needs the whole path).
fn test_path(name: &str) -> String {
    match module_path!().split_once("::") {
        Some((_, module)) => format!("{module}::{name}"),
        None => name.to_string(),
    }
}

/// `K3_SIMD` is read once per process: run this test binary as a child with each value.
#[test]
#[cfg_attr(miri, ignore)] // runs this test binary as child processes
fn k3_simd_env_forces_or_refuses_each_tier() {
    let exe = std::env::current_exe().expect("test binary path");
    let run = |value: &str| -> String {
        let out = self_command(&exe)
            .args([
                "--exact",
                &test_path("env_child_reports_tier"),
                "--nocapture",
                "--test-threads=1",
            ])
            .env("K3_KERNELS_TEST_CHILD", "1")
            .env(kernels::SIMD_ENV, value)
            .output()
            .expect("spawn child test");
        assert!(out.status.success(), "child failed for {value:?}");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        // libtest prints "test <name> ... " on the same line before the test's own output.
        stdout
            .lines()
            .find_map(|l| {
                let at = l.find("SELECTED=").or_else(|| l.find("REFUSED="))?;
                Some(l[at..].to_string())
            })
            .unwrap_or_else(|| panic!("no report from child for {value:?}: {stdout}"))
    };
    for t in Tier::ALL {
        let got = run(t.name());
        if t.is_available() {
            assert_eq!(got, format!("SELECTED={t}"));
        } else {
            assert!(
                got.starts_with("REFUSED=") && got.contains("lacks"),
                "{got}"
            );
        }
    }
    assert_eq!(run("auto"), format!("SELECTED={}", Tier::best_available()));
    assert_eq!(run(""), format!("SELECTED={}", Tier::best_available()));
    let bogus = run("sse9");
    assert!(
        bogus.starts_with("REFUSED=") && bogus.contains("\"sse9\""),
        "{bogus}"
    );
}

#[test]
fn active_tier_is_available_and_matches_select() {
    if std::env::var_os(kernels::SIMD_ENV).is_some() {
        eprintln!(
            "note: {} is set; checking it was honoured",
            kernels::SIMD_ENV
        );
    }
    match kernels::select_tier() {
        Ok(t) => {
            assert!(t.is_available());
            assert_eq!(kernels::active_tier(), t);
            assert_eq!(Kernels::active().tier(), t);
        }
        Err(e) => eprintln!("note: {e}"),
    }
}

// ------------------------------------------------------------------------------------------
// Bit-exact models of the SIMD tiers' operation sequence (independent of their code)

/// A SIMD tier's bf16 dot as the kernels document it, lane by lane in scalar code with
/// `f32::mul_add` as the FMA: per block of `2·lanes` columns lane `l` adds column `2l` then
/// `2l+1`, then one `lanes`-column step (lane `l` = column `l`), then the zero-padded tail; the
/// lanes are summed by the tier's fixed halving tree.
fn model_bf16(lanes: usize, w: &[u16], x: &[f32]) -> f32 {
    let cols = x.len();
    let wv = |c: usize| half::bf16::from_bits(w[c]).to_f32();
    let mut acc = vec![0.0f32; lanes];
    let mut c = 0;
    while c + 2 * lanes <= cols {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = wv(c + 2 * l).mul_add(x[c + 2 * l], *a);
            *a = wv(c + 2 * l + 1).mul_add(x[c + 2 * l + 1], *a);
        }
        c += 2 * lanes;
    }
    if c + lanes <= cols {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = wv(c + l).mul_add(x[c + l], *a);
        }
        c += lanes;
    }
    if c < cols {
        for (l, a) in acc.iter_mut().enumerate() {
            let (wl, xl) = if c + l < cols {
                (wv(c + l), x[c + l])
            } else {
                (0.0, 0.0)
            };
            *a = wl.mul_add(xl, *a);
        }
    }
    model_hsum(&acc)
}

/// The tiers' horizontal sum: halves added (16 → 8 → 4 lanes), then `(s0 + s2) + (s1 + s3)`.
fn model_hsum(acc: &[f32]) -> f32 {
    let mut v = acc.to_vec();
    while v.len() > 4 {
        let h = v.len() / 2;
        v = (0..h).map(|i| v[i] + v[i + h]).collect();
    }
    (v[0] + v[2]) + (v[1] + v[3])
}

/// A SIMD tier's MXFP4 dot as documented: per group the partial sum in `lanes` lanes over the
/// group's vectors in order (vector `j`, lane `i` = column `32/lanes`-block `j/2`, even
/// (`j` even) or odd column `2i (+1)`), first a multiply then FMAs; then `acc[g mod 2] =
/// fma(p, scale, acc)`; the row total is the halving sum of `acc0 + acc1`.
fn model_mxfp4(lanes: usize, packed: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let code = |c: usize| {
        let b = packed[c / 2];
        if c.is_multiple_of(2) {
            b & 15
        } else {
            b >> 4
        }
    };
    let mut acc = [vec![0.0f32; lanes], vec![0.0f32; lanes]];
    for (g, &s) in scales.iter().enumerate() {
        let sc = scalar::e8m0(s);
        let mut p = vec![0.0f32; lanes];
        for j in 0..32 / lanes {
            for (i, pi) in p.iter_mut().enumerate() {
                let c = 32 * g + 2 * lanes * (j / 2) + 2 * i + j % 2;
                let w = scalar::E2M1[code(c) as usize];
                *pi = if j == 0 {
                    w * x[c]
                } else {
                    w.mul_add(x[c], *pi)
                };
            }
        }
        for (a, &pi) in acc[g % 2].iter_mut().zip(&p) {
            *a = pi.mul_add(sc, *a);
        }
    }
    let sum: Vec<f32> = acc[0].iter().zip(&acc[1]).map(|(a, b)| a + b).collect();
    model_hsum(&sum)
}

/// The lanes of a SIMD tier's documented sequence (NEON follows AVX2's 8-lane sequence).
fn simd_lanes(t: Tier) -> Option<usize> {
    match t {
        Tier::Scalar => None,
        Tier::Avx2 | Tier::Neon => Some(8),
        Tier::Avx512 => Some(16),
    }
}

/// Bits, with every NaN made one NaN: which NaN an invalid operation or a NaN input yields is
/// the CPU's (x86 and Arm differ), not part of the sequence.
fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Adversarial bf16 bits: the largest finite values (products overflow to ±inf), ±inf, NaN,
/// subnormals and the smallest normals (products underflow), ±0, and ±2^k pairs that cancel.
fn adversarial_bf16(rng: &mut Rng) -> u16 {
    let sign = (rng.below(2) as u16) << 15;
    sign | match rng.below(10) {
        0 => 0x7F7F,                         // ±3.39e38
        1 => 0x7F80,                         // ±inf
        2 => 0x7FC0 | rng.below(64) as u16,  // NaN
        3 => 1 + rng.below(127) as u16,      // subnormal
        4 => 0x0080,                         // smallest normal
        5 => 0,                              // ±0
        6 => 0x4B00 | rng.below(128) as u16, // 2^23 ..: cancels with its negative
        _ => random_bf16(rng) & 0x7FFF,
    }
}

/// Every SIMD tier computes exactly its documented sequence on adversarial rows too (overflow,
/// ±inf, NaN, subnormals, cancellation; MXFP4 with the edge scale bytes 0, 254 and 255 and
/// activations that overflow a group), for every row count 1..=9 and token counts around the
/// token blocks: the lane that overflows or turns NaN, and when, is the sequence's.
#[test]
fn simd_tiers_follow_their_documented_sequence_on_adversarial_rows() {
    let mut rng = Rng(22);
    let mut checked = 0;
    for k in tiers() {
        let Some(lanes) = simd_lanes(k.tier()) else {
            continue;
        };
        for rows in 1..=9usize {
            for cols in [31usize, 64, 95] {
                let bits: Vec<u16> = (0..rows * cols)
                    .map(|_| adversarial_bf16(&mut rng))
                    .collect();
                let mc = cols / 32 * 32;
                let mx = Mxfp4 {
                    packed: (0..rows * mc / 2).map(|_| rng.below(256) as u8).collect(),
                    scales: (0..rows * mc / 32)
                        .map(|_| [0u8, 1, 127, 200, 254, 255][rng.below(6) as usize])
                        .collect(),
                };
                for n in [1usize, 2, 3, 5] {
                    let x: Vec<f32> = (0..n * cols)
                        .map(|_| match rng.below(12) {
                            0 => f32::INFINITY,
                            1 => f32::MIN_POSITIVE,
                            2 => 1e30,
                            _ => 2.0 * rng.unit(),
                        })
                        .collect();
                    let xm: Vec<f32> = (0..n * mc).map(|_| 1e4 * rng.unit()).collect();
                    let c = ModelCase {
                        rows,
                        cols,
                        n,
                        bits: &bits,
                        x: &x,
                        mx: &mx,
                        xm: &xm,
                    };
                    checked += check_models(k, lanes, &c, same_bits);
                }
            }
        }
    }
    if checked == 0 {
        eprintln!("skipped: no SIMD tier on this CPU");
    }
}

/// One bf16 product `[rows, cols]` and one MXFP4 product `[rows, mc]` (`mc = cols` rounded down
/// to whole groups) of `n` tokens, for [`check_models`].
struct ModelCase<'a> {
    rows: usize,
    cols: usize,
    n: usize,
    bits: &'a [u16],
    x: &'a [f32],
    mx: &'a Mxfp4,
    xm: &'a [f32],
}

/// Runs both products of `c` on `k` and checks every (token, row) against the tier's documented
/// sequence (`model_bf16`, `model_mxfp4`) with `same` (exact bits, or bits up to NaN payloads);
/// returns the rows checked.
fn check_models(k: Kernels, lanes: usize, c: &ModelCase<'_>, same: fn(f32, f32) -> bool) -> usize {
    let (rows, cols, n) = (c.rows, c.cols, c.n);
    let mc = cols / 32 * 32;
    let w: Vec<u8> = c.bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let mut y = vec![f32::NAN; n * rows];
    k.matmul_bf16(&w, rows, cols, c.x, n, &mut y);
    let mut ym = vec![f32::NAN; n * rows];
    k.matmul_mxfp4(&c.mx.packed, &c.mx.scales, rows, mc, c.xm, n, &mut ym);
    for t in 0..n {
        for r in 0..rows {
            let want = model_bf16(
                lanes,
                &c.bits[r * cols..(r + 1) * cols],
                &c.x[t * cols..(t + 1) * cols],
            );
            let got = y[t * rows + r];
            assert!(
                same(got, want),
                "{} bf16 {rows}x{cols} n={n} token {t} row {r}: {got:e} vs {want:e}",
                k.tier()
            );
            let want = model_mxfp4(
                lanes,
                &c.mx.packed[r * mc / 2..(r + 1) * mc / 2],
                &c.mx.scales[r * mc / 32..(r + 1) * mc / 32],
                &c.xm[t * mc..(t + 1) * mc],
            );
            let got = ym[t * rows + r];
            assert!(
                same(got, want),
                "{} mxfp4 {rows}x{mc} n={n} token {t} row {r}: {got:e} vs {want:e}",
                k.tier()
            );
        }
    }
    n * rows
}

/// Every SIMD tier computes exactly its documented sequence, for one token and for 2–17 tokens
/// (the multi-token kernels decode each weight once for all tokens and must not change any
/// accumulator's order), bf16 and MXFP4, on widths with every kind of tail.
#[test]
fn simd_tiers_follow_their_documented_sequence_bit_for_bit() {
    let mut rng = Rng(21);
    let mut checked = 0;
    let exact = |a: f32, b: f32| a.to_bits() == b.to_bits();
    for k in tiers() {
        let Some(lanes) = simd_lanes(k.tier()) else {
            continue;
        };
        for (rows, cols) in [(5, 47), (9, 95), (17, 640), (3, 1091), (33, 96)] {
            let (_, bits) = bf16_matrix(&mut rng, rows, cols);
            let mc = cols / 32 * 32;
            let mx = mxfp4_matrix(&mut rng, rows, mc);
            for n in [1usize, 2, 3, 4, 5, 8, 16, 17] {
                let x = random_x(&mut rng, n * cols);
                let xm = small_x(&mut rng, n * mc);
                let c = ModelCase {
                    rows,
                    cols,
                    n,
                    bits: &bits,
                    x: &x,
                    mx: &mx,
                    xm: &xm,
                };
                checked += check_models(k, lanes, &c, exact);
            }
        }
    }
    if checked == 0 {
        eprintln!("skipped: no SIMD tier on this CPU");
    }
}

// ------------------------------------------------------------------------------------------
// EC-BF16 coded matrices: coded == raw, bit for bit, per tier

use k3_proto::ecbf16::{self, CodedMatrix};

/// The raw product and the coded product of `bytes` at every width, for `ns` token counts, on
/// every tier and at 1 and 2 threads: the same bits.
fn check_coded_equals_raw(
    bytes: &[u8],
    rows: usize,
    cols: usize,
    palettes: &[Option<Vec<u8>>],
    ns: &[usize],
    rng: &mut Rng,
    what: &str,
) {
    let pools = [build_pool(1).expect("pool"), build_pool(2).expect("pool")];
    for &w in &ecbf16::WIDTHS {
        for pal in palettes {
            let coded = match pal {
                None => ecbf16::encode(bytes, rows, cols, w).expect("encode"),
                Some(p) => {
                    let p: Vec<u8> = p
                        .iter()
                        .copied()
                        .take(ecbf16::escape_code(w) as usize)
                        .collect();
                    ecbf16::encode_with_palette(bytes, rows, cols, w, &p).expect("encode")
                }
            };
            let m = CodedMatrix::parse(&coded).expect("parse");
            m.verify().expect("verify");
            for &n in ns {
                let x = random_x(rng, n * cols);
                for k in tiers() {
                    for pool in &pools {
                        pool.install(|| {
                            let mut raw = vec![f32::NAN; n * rows];
                            k.matmul_bf16(bytes, rows, cols, &x, n, &mut raw);
                            let mut got = vec![f32::NAN; n * rows];
                            k.matmul_coded(&m, &x, n, &mut got);
                            assert_eq!(
                                bits_of(&got),
                                bits_of(&raw),
                                "{} {what} [{rows}, {cols}] width {w} ({} escapes) n={n} threads {}",
                                k.tier(),
                                m.escapes(),
                                rayon::current_num_threads()
                            );
                        })
                    }
                }
            }
        }
    }
}

#[test]
fn coded_equals_raw_on_random_rows_of_awkward_widths() {
    let mut rng = Rng(31);
    for (rows, cols) in [
        (1, 1),
        (3, 15),
        (5, 31),
        (7, 32),
        (9, 33),
        (17, 47),
        (6, 95),
        (19, 1091),
        (40, 256),
    ] {
        let (w, _) = bf16_matrix(&mut rng, rows, cols);
        check_coded_equals_raw(
            &w,
            rows,
            cols,
            &[None],
            &[1, 2, 3, 5, 16],
            &mut rng,
            "random",
        );
    }
}

/// Gaussian-like weights (the commonest case): few escapes, most blocks on the fast path; the
/// parallel path (≥ `PAR_MIN_MACS`).
#[test]
fn coded_equals_raw_on_gaussian_like_rows_in_parallel() {
    let mut rng = Rng(32);
    let (rows, cols) = (301, 1056);
    assert!(rows * cols >= kernels::PAR_MIN_MACS);
    let bits: Vec<u8> = (0..rows * cols)
        .flat_map(|_| {
            // Exponents 118..=125 mostly, a rare far one: escapes at every width.
            let e = if rng.below(500) == 0 {
                100 + rng.below(40)
            } else {
                118 + rng.below(8)
            };
            let b = ((rng.below(2) << 15) | (e << 7) | rng.below(128)) as u16;
            b.to_le_bytes()
        })
        .collect();
    check_coded_equals_raw(
        &bits,
        rows,
        cols,
        &[None],
        &[1, 4, 9],
        &mut rng,
        "gaussian-like",
    );
}

/// Adversarial rows: every one of the 65,536 bf16 patterns (zeros, subnormals, ±inf, NaNs, every
/// exponent) at every lane position, coded with the matrix's own palette, with a palette that
/// escapes almost everything, and with an empty palette (every weight escaped).
#[test]
fn coded_equals_raw_on_every_bf16_pattern_and_all_escaped() {
    let mut rng = Rng(33);
    let cols = 81;
    let rows = 1usize << 16;
    let mut w = vec![0u8; rows * cols * 2];
    for r in 0..rows {
        for c in 0..cols {
            // Pattern r in its own column, neighbours from a shifted pattern: every block mixes.
            let p = if c == r % cols {
                r as u16
            } else {
                (r as u16).wrapping_mul(31).wrapping_add(c as u16)
            };
            w[2 * (r * cols + c)..2 * (r * cols + c) + 2].copy_from_slice(&p.to_le_bytes());
        }
    }
    check_coded_equals_raw(
        &w,
        rows,
        cols,
        &[None, Some(vec![0x3F, 0xBF]), Some(vec![])],
        &[1],
        &mut rng,
        "every pattern",
    );
    // Zeros only, and one row of ±inf/NaN, in a matmul.
    let mut z = vec![0u8; 8 * 70 * 2];
    for (i, p) in [0x7F80u16, 0xFF80, 0x7FC0, 0xFFFF, 0x0001, 0x8001]
        .iter()
        .enumerate()
    {
        z[2 * (70 + 5 * i)..2 * (70 + 5 * i) + 2].copy_from_slice(&p.to_le_bytes());
    }
    check_coded_equals_raw(
        &z,
        8,
        70,
        &[None, Some(vec![])],
        &[1, 3, 7],
        &mut rng,
        "zeros and specials",
    );
}

/// A coded matrix with escapes in every block: the slow path is the one taken everywhere.
#[test]
fn coded_escape_patch_is_exact_when_every_block_escapes() {
    let mut rng = Rng(34);
    let (rows, cols) = (13, 200);
    let (w, _) = bf16_matrix(&mut rng, rows, cols);
    let hist = ecbf16::HighBytes::of(&w);
    // Only the single commonest high byte in the palette.
    let top: Vec<u8> = hist.palette(2).into_iter().take(1).collect();
    check_coded_equals_raw(
        &w,
        rows,
        cols,
        &[Some(top)],
        &[1, 2, 6],
        &mut rng,
        "escapes everywhere",
    );
}

#[test]
fn coded_free_functions_match_kernels_of_the_active_tier() {
    let mut rng = Rng(35);
    let (rows, cols) = (10, 100);
    let (w, _) = bf16_matrix(&mut rng, rows, cols);
    let coded = ecbf16::encode(&w, rows, cols, 4).expect("encode");
    let m = CodedMatrix::parse(&coded).expect("parse");
    let x = random_x(&mut rng, cols);
    let mut a = vec![0.0f32; rows];
    let mut b = vec![0.0f32; rows];
    kernels::matvec_coded(&m, &x, &mut a);
    kernels::matvec_bf16(&w, rows, cols, &x, &mut b);
    assert_eq!(bits_of(&a), bits_of(&b));
    let mut c = vec![0.0f32; rows];
    Kernels::active().matmul_matrix(&kernels::Bf16Matrix::Coded(m), &x, 1, &mut c);
    assert_eq!(bits_of(&c), bits_of(&b));
    // A wrong decode has teeth: a palette entry changed makes the results differ.
    let mut bad = coded.clone();
    bad[32] ^= 1;
    let mb = CodedMatrix::parse(&bad).expect("parse");
    assert!(mb.verify().is_err());
    let mut d = vec![0.0f32; rows];
    kernels::matvec_coded(&mb, &x, &mut d);
    assert_ne!(bits_of(&d), bits_of(&b));
}

/// The strip kernels (each weight decoded once for all tokens) and the token-block kernels they
/// replace give the same bits, bf16 raw and coded and MXFP4, at every token count.
#[test]
fn strip_kernels_equal_the_token_block_kernels_bitwise() {
    let mut rng = Rng(41);
    for k in tiers() {
        let (old, k) = (k, k.with_strips());
        for (rows, cols) in [(7, 95), (18, 1056), (33, 64)] {
            let (w, _) = bf16_matrix(&mut rng, rows, cols);
            let coded = ecbf16::encode(&w, rows, cols, 4).expect("encode");
            let m = CodedMatrix::parse(&coded).expect("parse");
            let mc = cols / 32 * 32;
            let mx = mxfp4_matrix(&mut rng, rows, mc);
            for n in [3usize, 5, 8, 13, 16, 17] {
                let x = random_x(&mut rng, n * cols);
                let xs = small_x(&mut rng, n * mc);
                let run = |kk: Kernels| {
                    let mut a = vec![f32::NAN; n * rows];
                    let mut b = vec![f32::NAN; n * rows];
                    let mut c = vec![f32::NAN; n * rows];
                    kk.matmul_bf16(&w, rows, cols, &x, n, &mut a);
                    kk.matmul_coded(&m, &x, n, &mut b);
                    kk.matmul_mxfp4(&mx.packed, &mx.scales, rows, mc, &xs, n, &mut c);
                    (bits_of(&a), bits_of(&b), bits_of(&c))
                };
                let (new, before) = (run(k), run(old));
                assert_eq!(new.0, before.0, "{} bf16 {rows}x{cols} n={n}", k.tier());
                assert_eq!(new.1, before.1, "{} coded {rows}x{cols} n={n}", k.tier());
                assert_eq!(new.2, before.2, "{} mxfp4 {rows}x{mc} n={n}", k.tier());
                assert_eq!(
                    new.0,
                    new.1,
                    "{} coded vs raw {rows}x{cols} n={n}",
                    k.tier()
                );
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// F32 matrices (an F32 router, SPEC.md §3.11)

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

/// An F32 matrix holding bf16 values multiplies to the BF16 matrix's bits on every tier, at any
/// token count (decode, the 4-token blocks, the strips beyond them), row count around the row
/// blocks and width around the column blocks and `NARROW_COLS`, on 1 and 2 threads.
#[test]
fn f32_matrix_of_bf16_values_gives_the_bf16_bits_on_every_tier() {
    let mut rng = Rng(35);
    let pools = [build_pool(1).expect("pool"), build_pool(2).expect("pool")];
    let wide = kernels::NARROW_COLS + 37;
    for k in tiers() {
        for (rows, cols) in [(1, 7), (15, 37), (6, 95), (17, 1001), (33, 64), (9, wide)] {
            let (w, bits) = bf16_matrix(&mut rng, rows, cols);
            let wf: Vec<f32> = bits.iter().map(|&b| kernels::bf16_to_f32(b)).collect();
            let w32 = f32_bytes(&wf);
            for n in [1usize, 3, 5, 9, 17] {
                let x = random_x(&mut rng, n * cols);
                let mut want = vec![f32::NAN; n * rows];
                k.matmul_bf16(&w, rows, cols, &x, n, &mut want);
                for pool in &pools {
                    let mut got = vec![f32::NAN; n * rows];
                    pool.install(|| k.matmul_f32(&w32, rows, cols, &x, n, &mut got));
                    assert_eq!(
                        bits_of(&got),
                        bits_of(&want),
                        "{} {rows}x{cols} n={n} threads {}",
                        k.tier(),
                        pool.current_num_threads()
                    );
                }
            }
        }
    }
}

/// Rows with values bf16 cannot hold are an f32 dot in the scalar order on every tier (the same
/// bits everywhere, within the summation bound of an f64 oracle); the bf16-valued rows of the
/// same matrix still give the BF16 bits (a row's result depends on that row alone).
#[test]
fn f32_rows_beyond_bf16_are_the_same_bits_on_every_tier_and_near_the_oracle() {
    let mut rng = Rng(36);
    let (rows, cols) = (19, 1001);
    let (w, bits) = bf16_matrix(&mut rng, rows, cols);
    let mut wf: Vec<f32> = bits.iter().map(|&b| kernels::bf16_to_f32(b)).collect();
    // Every third row gets full f32 mantissas.
    let full = |r: usize| r % 3 == 1;
    for r in (0..rows).filter(|&r| full(r)) {
        for v in &mut wf[r * cols..(r + 1) * cols] {
            *v = rng.unit() * 3.0;
        }
    }
    let w32 = f32_bytes(&wf);
    let mut first: Option<Vec<u32>> = None;
    for k in tiers() {
        for n in [1usize, 4, 9] {
            let x = random_x(&mut Rng(n as u64), n * cols);
            let mut got = vec![f32::NAN; n * rows];
            k.matmul_f32(&w32, rows, cols, &x, n, &mut got);
            let mut bf = vec![f32::NAN; n * rows];
            k.matmul_bf16(&w, rows, cols, &x, n, &mut bf);
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                for r in 0..rows {
                    let g = got[t * rows + r];
                    if full(r) {
                        let (s, a) = wf[r * cols..(r + 1) * cols].iter().zip(xt).fold(
                            (0.0f64, 0.0f64),
                            |(s, a), (&w, &x)| {
                                let p = w as f64 * x as f64;
                                (s + p, a + p.abs())
                            },
                        );
                        assert!(
                            within(g as f64, s, dot_error_bound(cols, a)),
                            "{} row {r} token {t}: {g} vs {s}",
                            k.tier()
                        );
                    } else {
                        assert_eq!(g.to_bits(), bf[t * rows + r].to_bits(), "{}", k.tier());
                    }
                }
            }
            if n == 9 {
                let full_bits: Vec<u32> = (0..n * rows)
                    .filter(|i| full(i % rows))
                    .map(|i| got[i].to_bits())
                    .collect();
                match &first {
                    None => first = Some(full_bits),
                    Some(f) => assert_eq!(f, &full_bits, "{} differs", k.tier()),
                }
            }
        }
    }
}
