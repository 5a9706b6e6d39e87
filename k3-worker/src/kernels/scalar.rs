//! Scalar reference kernels. Every SIMD tier is tested against these. The leaves every tier
//! shares (the bf16 widening, the sigmoid, the narrow-row threshold) are written here, below
//! the tiers and `mod.rs` (which re-exports them).

/// Widen one bf16 (given as its bits) to f32, exactly.
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// bf16 rows of at most this many columns are dotted with a single token one row at a time by
/// the SIMD tiers, not in blocks of 8 rows. Eight short rows lie in the same few 4 KB pages, and
/// loading them in step (line 0 of each row, then line 1 of each, ...) jumps back and forth
/// through those pages: the hardware prefetcher does not follow, and the kernel waits on memory
/// (the `small` model's 163840×256 lm_head, AVX-512, `cargo bench -p k3-worker --bench
/// kernels`: 8.9 GB/s at 1 thread and 12.3 at 2 in blocks of 8; 21.1 and 28.3 one row at a
/// time). One row at a time is a sequential scan, and its activations (≤ 8 KB) stay in L1, so
/// reloading them per row costs nothing. A sweep over widths (84 MB matrices, 1 and 2 threads)
/// found both ways equal at 2048 columns and the 8-row blocks faster from 3072. K3's narrow
/// matrices: `f_b_proj` (128 columns), `kv_b_proj` (512), `q_b_proj` (1536). Only the loop
/// nesting changes, not any accumulator's operation sequence, so the results are the same
/// bits.
pub const NARROW_COLS: usize = 2048;

/// E2M1 magnitudes by code 0..15 (bit 3 = sign).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// `2^(s-127)` for an E8M0 scale byte. 255 (NaN in the OCP MX spec) maps to 0; the loader counts
/// such bytes as anomalies.
#[inline]
pub const fn e8m0(s: u8) -> f32 {
    match s {
        0 => f32::from_bits(0x0040_0000), // 2^-127, subnormal
        255 => 0.0,
        _ => f32::from_bits((s as u32) << 23),
    }
}

/// [`e8m0`] of every byte (the SIMD tiers broadcast from it).
pub static E8M0_TABLE: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e8m0(i as u8);
        i += 1;
    }
    t
};

#[inline]
pub(super) fn dot_bf16_row(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let n = x.len();
    let main = n - n % 8;
    let mut c = 0;
    while c < main {
        for (l, a) in acc.iter_mut().enumerate() {
            let i = c + l;
            *a += bf16_to_f32(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])) * x[i];
        }
        c += 8;
    }
    let mut tail = 0.0f32;
    for i in main..n {
        tail += bf16_to_f32(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])) * x[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

pub fn matvec_bf16(w: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    matmul_bf16(w, rows, cols, x, 1, y)
}

pub fn matmul_bf16(w: &[u8], rows: usize, cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    assert_eq!(w.len(), rows * cols * 2, "bf16 weight bytes");
    assert_eq!(x.len(), n * cols, "matmul input");
    assert_eq!(y.len(), n * rows, "matmul output");
    for r in 0..rows {
        let row = &w[r * cols * 2..(r + 1) * cols * 2];
        for t in 0..n {
            y[t * rows + r] = dot_bf16_row(row, &x[t * cols..(t + 1) * cols]);
        }
    }
}

#[inline]
pub(super) fn dot_mxfp4_row(packed: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (g, &s) in scales.iter().enumerate() {
        let mut part = 0.0f32;
        for k in 0..16 {
            let b = packed[g * 16 + k];
            part += E2M1[(b & 0xF) as usize] * x[g * 32 + 2 * k];
            part += E2M1[(b >> 4) as usize] * x[g * 32 + 2 * k + 1];
        }
        acc += part * e8m0(s);
    }
    acc
}

pub fn matvec_mxfp4(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
) {
    matmul_mxfp4(packed, scales, rows, cols, x, 1, y)
}

pub fn matmul_mxfp4(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    assert!(
        cols.is_multiple_of(32),
        "MXFP4 width {cols} is not a multiple of 32"
    );
    assert_eq!(packed.len(), rows * cols / 2, "MXFP4 packed bytes");
    assert_eq!(scales.len(), rows * cols / 32, "MXFP4 scale bytes");
    assert_eq!(x.len(), n * cols, "matmul input");
    assert_eq!(y.len(), n * rows, "matmul output");
    let (pw, sw) = (cols / 2, cols / 32);
    for r in 0..rows {
        let (pr, sr) = (&packed[r * pw..(r + 1) * pw], &scales[r * sw..(r + 1) * sw]);
        for t in 0..n {
            y[t * rows + r] = dot_mxfp4_row(pr, sr, &x[t * cols..(t + 1) * cols]);
        }
    }
}

/// Row kernel of the scalar tier: `out [k, n]` for the `k` rows in `w` (see `Kernels`).
pub(super) fn bf16_rows(
    w: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    _strips: bool,
) {
    let rb = cols * 2;
    assert_eq!(w.len() * n, out.len() * rb, "bf16 rows vs output");
    assert_eq!(x.len(), n * cols, "bf16 rows input");
    for (row, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(n)) {
        for (t, v) in o.iter_mut().enumerate() {
            *v = dot_bf16_row(row, &x[t * cols..(t + 1) * cols]);
        }
    }
}

/// Row kernel of the scalar tier for rows `r0 ..` of an EC-BF16 matrix: each row decoded
/// (exactly) into a row buffer, then the bf16 dot: the bits of [`bf16_rows`] on the raw rows.
pub(super) fn coded_rows(
    m: &k3_proto::ecbf16::CodedMatrix<'_>,
    r0: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    _strips: bool,
) {
    let cols = m.cols();
    assert_eq!(x.len(), n * cols, "coded rows input");
    let mut row = vec![0u8; 2 * cols];
    for (i, o) in out.chunks_exact_mut(n).enumerate() {
        m.decode_row(r0 + i, &mut row);
        for (t, v) in o.iter_mut().enumerate() {
            *v = dot_bf16_row(&row, &x[t * cols..(t + 1) * cols]);
        }
    }
}

/// Row kernel of the scalar tier for MXFP4 (`x` in natural column order).
pub(super) fn mxfp4_rows(
    packed: &[u8],
    scales: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    _strips: bool,
) {
    let (pw, sw) = (cols / 2, cols / 32);
    assert_eq!(packed.len() * n, out.len() * pw, "MXFP4 rows vs output");
    assert_eq!(scales.len() * n, out.len() * sw, "MXFP4 scales vs output");
    assert_eq!(x.len(), n * cols, "MXFP4 rows input");
    for ((pr, sr), o) in packed
        .chunks_exact(pw)
        .zip(scales.chunks_exact(sw))
        .zip(out.chunks_exact_mut(n))
    {
        for (t, v) in o.iter_mut().enumerate() {
            *v = dot_mxfp4_row(pr, sr, &x[t * cols..(t + 1) * cols]);
        }
    }
}

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), w.len());
    assert_eq!(x.len(), out.len());
    let ms = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len() as f64;
    let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
    for i in 0..x.len() {
        out[i] = w[i] * (x[i] * inv);
    }
}

pub fn l2_norm_inplace(x: &mut [f32], eps: f32) {
    let ss = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>();
    let inv = (1.0 / (ss + eps as f64).sqrt()) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

pub fn situ_glu(gate: &[f32], up: &[f32], beta_gate: f32, beta_up: f32, out: &mut [f32]) {
    assert_eq!(gate.len(), up.len());
    assert_eq!(gate.len(), out.len());
    for i in 0..gate.len() {
        let g = gate[i];
        let a = beta_gate * (g / beta_gate).tanh() * sigmoid(g);
        let u = beta_up * (up[i] / beta_up).tanh();
        out[i] = a * u;
    }
}

pub fn softmax_inplace(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v as f64;
    }
    let inv = (1.0 / s) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Narrows a little-endian F32 row to bf16 (each value's high half, in order) into `out`; true
/// when every value's low half is zero (the narrowing is exact).
pub(super) fn narrow_f32_row(row: &[u8], out: &mut [u8]) -> bool {
    assert_eq!(row.len(), 2 * out.len(), "f32 row and its bf16 narrowing");
    let mut low = 0u8;
    for (d, b) in out.chunks_exact_mut(2).zip(row.chunks_exact(4)) {
        d.copy_from_slice(&b[2..4]);
        low |= b[0] | b[1];
    }
    low == 0
}

pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let main = a.len() - a.len() % 8;
    let mut i = 0;
    while i < main {
        for l in 0..8 {
            acc[l] += a[i + l] * b[i + l];
        }
        i += 8;
    }
    let mut tail = 0.0f32;
    for j in main..a.len() {
        tail += a[j] * b[j];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// The scalar tier's FMA probe: 16 chains of `f32::mul_add`; `16·iters` multiply-adds.
pub(super) fn fma_probe(iters: usize, seed: f32) -> f32 {
    let mut acc: [f32; 16] = std::array::from_fn(|i| seed + i as f32);
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = v.mul_add(0.999_999, 1e-7);
        }
    }
    acc.iter().sum()
}

// ------------------------------------------------------------------------------------------
// int8 / int4 quantized matrices (`k3_proto::quant`): the scalar twin. Every SIMD tier's quant
// kernel computes each (row, token) by exactly this sequence (`kernels::quant` states it), so
// its results equal these bit for bit.

/// Lanes of an int8 row's dot: column `c` accumulates in lane `c mod 32`.
pub const Q8_LANES: usize = 32;
/// Lanes of an int4 row's dot: byte `i` of a 32-column group (columns `2i`, `2i+1`) in lane `i`.
pub const Q4_LANES: usize = 16;

/// Sum of `a`'s lanes by halving: lane `i` adds lane `i + len/2`, down to one lane (the order
/// every tier's quant reduction follows: a 512-bit pair, then 256, 128, 64 and 32 bits).
#[inline(always)]
pub(super) fn halving_sum(a: &mut [f32]) -> f32 {
    let mut w = a.len() / 2;
    while w > 0 {
        for i in 0..w {
            a[i] += a[i + w];
        }
        w /= 2;
    }
    a[0]
}

/// Little-endian f32 number `i` of `s`.
#[inline(always)]
pub(super) fn f32_at(s: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]])
}

/// One int8 row (`codes`, `x.len()` columns, a multiple of 32) with one token: lane `c mod 32`
/// accumulates `fma(q_c, x_c, acc)` in column order; the lanes are [`halving_sum`]med; the sum
/// is multiplied by the row's scale.
pub(super) fn q8_dot(codes: &[u8], scale: f32, x: &[f32]) -> f32 {
    let mut acc = [0.0f32; Q8_LANES];
    for (q, xv) in codes.chunks_exact(Q8_LANES).zip(x.chunks_exact(Q8_LANES)) {
        for l in 0..Q8_LANES {
            acc[l] = f32::from(q[l] as i8).mul_add(xv[l], acc[l]);
        }
    }
    halving_sum(&mut acc) * scale
}

/// One int4 row (`codes`: 16 bytes a 32-column group, `scales`: one f32 a group) with one
/// token whose columns are split per 32 as `[16 even | 16 odd]`: per group, lane `i` forms
/// `p = lo_i·x_even_i`, then `p = fma(hi_i, x_odd_i, p)` (`lo`, `hi` the nibbles minus 8), then
/// `acc_i = fma(p, scale, acc_i)`; the 16 lanes are [`halving_sum`]med.
pub(super) fn q4_dot(codes: &[u8], scales: &[u8], xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; Q4_LANES];
    for (g, (q, xg)) in codes.chunks_exact(16).zip(xs.chunks_exact(32)).enumerate() {
        let s = f32_at(scales, g);
        let (xe, xo) = xg.split_at(Q4_LANES);
        for i in 0..Q4_LANES {
            let lo = f32::from(q[i] & 15) - 8.0;
            let hi = f32::from(q[i] >> 4) - 8.0;
            let p = hi.mul_add(xo[i], lo * xe[i]);
            acc[i] = p.mul_add(s, acc[i]);
        }
    }
    halving_sum(&mut acc)
}

/// Row kernel of the scalar tier for rows `r0 .. r0 + k` of a quantized matrix (the shape
/// checked by `kernels::quant`):
/// `out [k, n]`; `x [n, cols]` in natural order (int8) or split per 32 columns (int4,
/// `split_even_odd_rows` with 16 lanes).
pub(super) fn quant_rows(
    m: &k3_proto::quant::QuantMatrix<'_>,
    r0: usize,
    k: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let cols = m.cols();
    let (qb, sb) = m.kind().sizes(1, cols);
    for (i, o) in out[..k * n].chunks_exact_mut(n).enumerate() {
        let r = r0 + i;
        let (q, s) = (
            &m.codes()[r * qb..(r + 1) * qb],
            &m.scales()[r * sb..(r + 1) * sb],
        );
        for (t, v) in o.iter_mut().enumerate() {
            let xt = &x[t * cols..(t + 1) * cols];
            *v = match m.kind() {
                k3_proto::quant::QuantKind::Int8 => q8_dot(q, f32_at(s, 0), xt),
                k3_proto::quant::QuantKind::Int4 => q4_dot(q, s, xt),
            };
        }
    }
}
