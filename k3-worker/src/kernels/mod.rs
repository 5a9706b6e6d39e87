//! Numerical kernels.
//!
//! Contract shared by every tier (scalar, AVX2+FMA, AVX-512):
//! * bf16 weights are raw little-endian bytes (`&[u8]`, any alignment), row-major `[rows, cols]`,
//!   widened exactly (`f32 bits = bf16 bits << 16`).
//! * MXFP4 weights are `packed [rows, cols/2]` (low nibble = even column) and E8M0
//!   `scales [rows, cols/32]`; they are multiplied straight from the nibbles, the group scale is
//!   applied after the 32-element partial sum.
//! * Each output element is produced by one fixed sequence of operations for a given tier, so
//!   results do not depend on the thread count, and `matmul_*` row `t` is bit-identical to
//!   `matvec_*` of token `t` (prefill and incremental decode agree bit for bit).
//! * Lengths are checked with `assert!`: a mismatch is a bug in the caller (the binder checks
//!   every tensor's shape against the config before any kernel runs).

pub mod scalar;

/// Widen one bf16 (given as its bits) to f32, exactly.
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Widen a little-endian bf16 byte run into f32s.
pub fn bf16_bytes_to_f32(bytes: &[u8]) -> Vec<f32> {
    assert!(
        bytes.len().is_multiple_of(2),
        "bf16 byte run of odd length {}",
        bytes.len()
    );
    bytes
        .chunks_exact(2)
        .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
        .collect()
}

/// Little-endian f32 byte run into f32s.
pub fn f32_bytes_to_f32(bytes: &[u8]) -> Vec<f32> {
    assert!(
        bytes.len().is_multiple_of(4),
        "f32 byte run of length {}",
        bytes.len()
    );
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// `y[r] = Σ_c W[r,c]·x[c]` for a bf16 matrix `W [rows, cols]`.
pub fn matvec_bf16(w: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    scalar::matvec_bf16(w, rows, cols, x, y)
}

/// `y[t·rows + r] = Σ_c W[r,c]·x[t·cols + c]` for `n` tokens; row `t` equals `matvec_bf16` of
/// token `t` bit for bit.
pub fn matmul_bf16(w: &[u8], rows: usize, cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    scalar::matmul_bf16(w, rows, cols, x, n, y)
}

/// `y[r] = Σ_c W[r,c]·x[c]` for an MXFP4 matrix with E8M0 group scales.
pub fn matvec_mxfp4(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
) {
    scalar::matvec_mxfp4(packed, scales, rows, cols, x, y)
}

/// MXFP4 product for `n` tokens (`x [n, cols]`, `y [n, rows]`); row `t` equals `matvec_mxfp4`.
pub fn matmul_mxfp4(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    scalar::matmul_mxfp4(packed, scales, rows, cols, x, n, y)
}

/// `out[i] = w[i]·x[i] / sqrt(mean(x²) + eps)`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    scalar::rms_norm(x, w, eps, out)
}

/// `x ← x / sqrt(Σ x² + eps)` (sum, not mean: the KDA q/k normalisation).
pub fn l2_norm_inplace(x: &mut [f32], eps: f32) {
    scalar::l2_norm_inplace(x, eps)
}

/// SiTU-GLU: `out = β1·tanh(g/β1)·σ(g) · β2·tanh(u/β2)` (σ of the uncapped gate).
pub fn situ_glu(gate: &[f32], up: &[f32], beta_gate: f32, beta_up: f32, out: &mut [f32]) {
    scalar::situ_glu(gate, up, beta_gate, beta_up, out)
}

/// Numerically stable softmax in place.
pub fn softmax_inplace(x: &mut [f32]) {
    scalar::softmax_inplace(x)
}

/// `Σ a[i]·b[i]` over f32 vectors.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    scalar::dot_f32(a, b)
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// `z·σ(z)`.
#[inline]
pub fn silu(z: f32) -> f32 {
    z * sigmoid(z)
}
