//! Numerical kernels.
//!
//! Contract shared by every tier (scalar, AVX2+FMA, AVX-512, NEON):
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
//!
//! # Tiers
//! The free functions below run on the *active* tier ([`active_tier`]), chosen once per process:
//! the best tier the CPU supports, or the one forced by the environment variable `K3_SIMD`
//! (`scalar`, `avx2`, `avx512`, `neon`; unset, empty or `auto` = best available). Binaries call
//! [`select_tier`] at start-up and refuse to run (exit 2) when it returns an error (unknown value,
//! or a forced tier this CPU lacks); no instruction the CPU lacks is ever executed.
//! [`Kernels`] gives tier-specific entry points (tests and benchmarks run every tier on one
//! machine); a `Kernels` value can only be made for a tier the CPU supports.
//!
//! Tiers differ from each other only by the order of f32 additions (and FMA contraction) inside
//! dot products (NEON follows the AVX2 tier's order exactly: the same bits on an aarch64 CPU as
//! on an x86-64 CPU with AVX2); the elementwise kernels (`rms_norm`, `l2_norm_inplace`, `situ_glu`,
//! `softmax_inplace`) are the scalar code on every tier, so their results never depend on the CPU.
//!
//! # Threads
//! The matrix kernels split their OUTPUT ROWS into fixed chunks of [`ROW_CHUNK`] rows and run
//! them on the *current* rayon pool (call them inside `ThreadPool::install` to choose the pool;
//! see [`build_pool`]). Problems under [`PAR_MIN_MACS`] multiply-adds a pass over the weights
//! ([`on_pool`]) run on the calling thread.
//! A row is always computed by the same code, so the thread count never changes a result.

// On an architecture without a SIMD tier the quantized kernels' dispatch has only the scalar arm.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub mod quant;
pub mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(all(target_arch = "aarch64", target_endian = "little"))]
mod neon;
#[cfg(any(
    target_arch = "x86_64",
    all(target_arch = "aarch64", target_endian = "little")
))]
mod quant_loop;
#[cfg(any(
    target_arch = "x86_64",
    all(target_arch = "aarch64", target_endian = "little")
))]
mod tile;

mod tier;
mod token_rows;

pub use k3_proto::ecbf16::CodedMatrix;
pub use tier::{active_tier, choose_tier, select_tier, Tier, TierError, SIMD_ENV};

use std::cell::Cell;
use std::thread::LocalKey;

use rayon::prelude::*;

use token_rows::TokenRows;

/// Output rows per task (run in parallel, or in order on the calling thread). Fixed, so the work
/// split never depends on the thread count (and a row's result never depends on the split
/// anyway). 16 rows of the widest bf16 matrix (12288 columns, 393 KB) stay in L2 while a
/// multi-token product passes each token block over them; 16 is a multiple of the SIMD tiers'
/// 8-row bf16 decode blocks.
pub const ROW_CHUNK: usize = 16;

/// Below this many multiply-adds per pass over the weights (see [`on_pool`]) a matrix kernel
/// runs on the calling thread.
/// Handing work to the pool and waking a sleeping worker costs ~10–20 µs on a 2-vCPU VM, about
/// what one thread needs for 256 Ki bf16 multiply-adds (512 KB of weights at ~15 GB/s): smaller
/// products are faster alone. On the `small` model (hidden 256, most products 64–128 Ki) the
/// former 32 Ki threshold cost ~1 ms per token; every product of the real model (from 0.69 Mi,
/// the KDA β projection 96×7168) is above either threshold.
pub const PAR_MIN_MACS: usize = 256 * 1024;

/// Tokens a pass over the weights serves in [`on_pool`]'s count: the SIMD tiers dot one loaded
/// weight vector with up to 4 tokens (their token block), at nearly the cost of one token.
pub const PAR_TOKENS_PER_PASS: usize = 4;

/// Whether a `[rows, cols]` product over `n` tokens runs on the pool (else on the calling
/// thread): `rows·cols·⌈n / PAR_TOKENS_PER_PASS⌉ ≥ PAR_MIN_MACS`. A single token counts its
/// multiply-adds; up to 4 tokens count as one, because a token block reads each weight once
/// and costs little more than one token (the `small` lm_head, 163840×256: 4 tokens ~1.35× one)
/// — counting all `n·rows·cols` sent a decode step of 4 sequences' 64–128 Ki-weight products to
/// the pool, whose wake-ups cost that step ~1.5 ms of its ~12 (2026-12-07, docs/BENCHMARKS.md).
/// The split never changes a result (every row is computed by the same code).
pub fn on_pool(rows: usize, cols: usize, n: usize) -> bool {
    rows.saturating_mul(cols)
        .saturating_mul(n.div_ceil(PAR_TOKENS_PER_PASS))
        >= PAR_MIN_MACS
}

/// Build a rayon pool with `threads` workers (the engine builds one from `--threads` and runs
/// the forward pass inside `pool.install(..)`; every kernel then uses that pool).
pub fn build_pool(threads: usize) -> Result<rayon::ThreadPool, rayon::ThreadPoolBuildError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("k3-kern-{i}"))
        .build()
}

pub use scalar::{bf16_to_f32, sigmoid, NARROW_COLS};

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
    Kernels::active().matvec_bf16(w, rows, cols, x, y)
}

/// `y[t·rows + r] = Σ_c W[r,c]·x[t·cols + c]` for `n` tokens; row `t` equals `matvec_bf16` of
/// token `t` bit for bit.
pub fn matmul_bf16(w: &[u8], rows: usize, cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    Kernels::active().matmul_bf16(w, rows, cols, x, n, y)
}

/// [`matmul_bf16`] for a little-endian F32 matrix `W [rows, cols]` (an F32 router, SPEC.md
/// §3.11). A row whose values are all bf16-representable (the low 16 bits of every value zero)
/// is narrowed exactly and multiplied by this tier's bf16 kernel: the same bits as the BF16
/// matrix of the same values. Any other row is multiplied by [`scalar::dot_f32`] (the scalar
/// tier's bf16 order: 8 interleaved accumulators, the same pairwise finish) on every tier. Each row's result depends on that row alone, so the
/// thread count, the row split and `n` change nothing, as for the bf16 kernels.
pub fn matmul_f32(w: &[u8], rows: usize, cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    Kernels::active().matmul_f32(w, rows, cols, x, n, y)
}

/// `y[r] = Σ_c W[r,c]·x[c]` for an EC-BF16 coded matrix (`k3_proto::ecbf16`): the same bits as
/// [`matvec_bf16`] on the decoded matrix (the decode is exact and happens in registers).
pub fn matvec_coded(m: &CodedMatrix<'_>, x: &[f32], y: &mut [f32]) {
    Kernels::active().matmul_coded(m, x, 1, y)
}

/// [`matmul_bf16`] for an EC-BF16 coded matrix: the same bits as `matmul_bf16` on the decoded
/// matrix, for any `n` (each token block of the tier decodes the weights again; with
/// [`Kernels::with_strips`] once for all `n` tokens).
pub fn matmul_coded(m: &CodedMatrix<'_>, x: &[f32], n: usize, y: &mut [f32]) {
    Kernels::active().matmul_coded(m, x, n, y)
}

/// A trunk matrix as the forward receives it: raw bf16 bytes or EC-BF16 coded. Both multiply to
/// the same bits ([`Kernels::matmul_matrix`]).
#[derive(Clone, Copy, Debug)]
pub enum Bf16Matrix<'a> {
    /// Raw little-endian bf16 `[rows, cols]`.
    Raw {
        /// `rows·cols·2` bytes.
        bytes: &'a [u8],
        /// Output rows.
        rows: usize,
        /// Input columns.
        cols: usize,
    },
    /// EC-BF16 (its header carries the shape).
    Coded(CodedMatrix<'a>),
}

impl Bf16Matrix<'_> {
    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Bf16Matrix::Raw { rows, cols, .. } => (*rows, *cols),
            Bf16Matrix::Coded(m) => (m.rows(), m.cols()),
        }
    }
}

/// `y[t·cols + c] = Σ_r W[r,c]·x[t·rows + r]` for `n` tokens: the product with the TRANSPOSE of
/// a bf16 matrix `W [rows, cols]`, read in its stored layout (no transposed copy is made).
///
/// Each output element adds its `rows` terms in row order, one multiply and one add each, the
/// same sequence on every tier and thread count (the loop runs along a row, so it vectorises
/// across output elements without reordering any element's sum); token `t`'s row does not
/// depend on `n`, so prefill and decode agree bit for bit. Used for MLA's absorbed query
/// `q̃ = W_UKᵀ q_nope` (SPEC.md §3.5), where `W_UK` is a block of `kv_b_proj` rows.
pub fn matmul_t_bf16(w: &[u8], rows: usize, cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    assert_eq!(w.len(), rows * cols * 2, "bf16 matrix [{rows}, {cols}]");
    assert_eq!(x.len(), n * rows, "activations [{n}, {rows}]");
    assert_eq!(y.len(), n * cols, "output [{n}, {cols}]");
    y.iter_mut().for_each(|v| *v = 0.0);
    with_buffer(&ROW, |row| {
        let row = zeroed(row, cols);
        for (r, wr) in w.chunks_exact(cols * 2).enumerate() {
            for (dst, b) in row.iter_mut().zip(wr.chunks_exact(2)) {
                *dst = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
            for t in 0..n {
                let xr = x[t * rows + r];
                for (yv, &wv) in y[t * cols..(t + 1) * cols].iter_mut().zip(row.iter()) {
                    *yv += xr * wv;
                }
            }
        }
    });
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
    Kernels::active().matvec_mxfp4(packed, scales, rows, cols, x, y)
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
    Kernels::active().matmul_mxfp4(packed, scales, rows, cols, x, n, y)
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
    Kernels::active().dot_f32(a, b)
}

/// `z·σ(z)`.
#[inline]
pub fn silu(z: f32) -> f32 {
    z * sigmoid(z)
}

/// The kernels of one tier. Holding a `Kernels` proves the CPU supports its tier: the only
/// constructors are [`Kernels::new`] (checks CPU detection) and [`Kernels::active`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernels {
    tier: Tier,
    /// Products of more than a token block take the strip kernels (`tile.rs`, each weight
    /// decoded once for all tokens) — only with [`Kernels::with_strips`]: measured slower than
    /// the token-block kernels on AVX2 (docs/BENCHMARKS.md, 2026-12-03), so off by default. The
    /// same bits either way.
    strips: bool,
}

/// Runs one tier's row kernel. `$k` is a `Kernels`; the AVX and NEON arms are sound because a
/// `Kernels` only exists for a tier the CPU supports.
macro_rules! by_tier {
    ($k:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $k.tier {
            Tier::Scalar => scalar::$f($($arg),*),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Kernels` values are only constructed for tiers whose CPU features were
            // detected (`Kernels::new` / `active_tier`); the callee checks every slice length.
            Tier::Avx2 => unsafe { avx2::$f($($arg),*) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, AVX-512 F/BW/VL, AVX2 and FMA were detected before this value existed.
            Tier::Avx512 => unsafe { avx512::$f($($arg),*) },
            #[cfg(all(target_arch = "aarch64", target_endian = "little"))]
            // SAFETY: as above, NEON was detected (every aarch64 CPU has it).
            Tier::Neon => unsafe { neon::$f($($arg),*) },
            #[allow(unreachable_patterns)] // every tier of this architecture is matched above
            _ => unreachable!("a SIMD tier of another architecture"),
        }
    };
}

impl Kernels {
    /// The kernels of `tier`, or `None` if this CPU cannot run it. Like [`Kernels::active`],
    /// without the strip kernels ([`Kernels::with_strips`] turns them on).
    pub fn new(tier: Tier) -> Option<Kernels> {
        tier.is_available().then_some(Kernels {
            tier,
            strips: false,
        })
    }

    /// The kernels of the process-wide active tier (see [`active_tier`]).
    pub fn active() -> Kernels {
        Kernels {
            tier: active_tier(),
            strips: false,
        }
    }

    /// These kernels with the multi-token strip kernels on (`tile.rs`: products of more than a
    /// token block decode each weight once for all tokens). The same bits as without; for A/B
    /// measurements, tests, and the tiers where they pay (not yet measured on AVX-512).
    pub fn with_strips(self) -> Kernels {
        Kernels {
            strips: true,
            ..self
        }
    }

    /// The tier these kernels run.
    pub fn tier(self) -> Tier {
        self.tier
    }

    /// [`matvec_bf16`] on this tier.
    pub fn matvec_bf16(self, w: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
        self.matmul_bf16(w, rows, cols, x, 1, y)
    }

    /// [`matmul_bf16`] on this tier.
    pub fn matmul_bf16(
        self,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) {
        if !dense_shapes(w, 2, "bf16", rows, cols, x, n, y) {
            return;
        }
        let row_bytes = cols * 2;
        self.with_split(x, cols, |xs| {
            by_rows(rows, cols, n, y, |r0, out| {
                let k = out.len() / n;
                let wr = &w[r0 * row_bytes..(r0 + k) * row_bytes];
                by_tier!(self, bf16_rows(wr, cols, xs, n, out, self.strips))
            })
        });
    }

    /// [`matmul_f32`] on this tier.
    pub fn matmul_f32(
        self,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) {
        if !dense_shapes(w, 4, "f32", rows, cols, x, n, y) {
            return;
        }
        let row_bytes = cols * 4;
        self.with_split(x, cols, |xs| {
            by_rows(rows, cols, n, y, |r0, out| {
                let k = out.len() / n;
                let wr = &w[r0 * row_bytes..(r0 + k) * row_bytes];
                with_buffer(&NARROW, |narrow| {
                    for (row, o) in wr.chunks_exact(row_bytes).zip(out.chunks_exact_mut(n)) {
                        // The bf16 truncation of each value (its high half), and whether that
                        // is the value exactly (every low half zero).
                        grow_exact(narrow, cols * 2);
                        narrow.resize(cols * 2, 0);
                        if by_tier!(self, narrow_f32_row(row, narrow)) {
                            by_tier!(self, bf16_rows(narrow, cols, xs, n, o, self.strips));
                            continue;
                        }
                        with_buffer(&ROW, |wide| {
                            let wide = zeroed(wide, cols);
                            for (d, b) in wide.iter_mut().zip(row.chunks_exact(4)) {
                                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                            }
                            for (t, v) in o.iter_mut().enumerate() {
                                *v = scalar::dot_f32(wide, &x[t * cols..(t + 1) * cols]);
                            }
                        });
                    }
                })
            })
        });
    }

    /// [`matmul_coded`] on this tier.
    pub fn matmul_coded(self, m: &CodedMatrix<'_>, x: &[f32], n: usize, y: &mut [f32]) {
        let (rows, cols) = (m.rows(), m.cols());
        assert_eq!(Some(x.len()), n.checked_mul(cols), "matmul input");
        assert_eq!(Some(y.len()), n.checked_mul(rows), "matmul output");
        if cols == 0 {
            y.fill(0.0);
            return;
        }
        self.with_split(x, cols, |xs| {
            by_rows(rows, cols, n, y, |r0, out| {
                by_tier!(self, coded_rows(m, r0, xs, n, out, self.strips))
            })
        });
    }

    /// [`matvec_coded`] on this tier.
    pub fn matvec_coded(self, m: &CodedMatrix<'_>, x: &[f32], y: &mut [f32]) {
        self.matmul_coded(m, x, 1, y)
    }

    /// The product with a raw or coded bf16 matrix ([`matmul_bf16`] / [`matmul_coded`]).
    pub fn matmul_matrix(self, w: &Bf16Matrix<'_>, x: &[f32], n: usize, y: &mut [f32]) {
        match w {
            Bf16Matrix::Raw { bytes, rows, cols } => self.matmul_bf16(bytes, *rows, *cols, x, n, y),
            Bf16Matrix::Coded(m) => self.matmul_coded(m, x, n, y),
        }
    }

    /// [`matvec_mxfp4`] on this tier.
    pub fn matvec_mxfp4(
        self,
        packed: &[u8],
        scales: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        y: &mut [f32],
    ) {
        self.matmul_mxfp4(packed, scales, rows, cols, x, 1, y)
    }

    /// [`matmul_mxfp4`] on this tier.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_mxfp4(
        self,
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
        assert_eq!(
            Some(packed.len()),
            rows.checked_mul(cols / 2),
            "MXFP4 packed bytes"
        );
        assert_eq!(
            Some(scales.len()),
            rows.checked_mul(cols / 32),
            "MXFP4 scale bytes"
        );
        assert_eq!(Some(x.len()), n.checked_mul(cols), "matmul input");
        assert_eq!(Some(y.len()), n.checked_mul(rows), "matmul output");
        if cols == 0 {
            y.fill(0.0);
            return;
        }
        let (pw, sw) = (cols / 2, cols / 32);
        self.with_split(x, cols, |xs| {
            by_rows(rows, cols, n, y, |r0, out| {
                let k = out.len() / n;
                let (p, s) = (
                    &packed[r0 * pw..(r0 + k) * pw],
                    &scales[r0 * sw..(r0 + k) * sw],
                );
                by_tier!(self, mxfp4_rows(p, s, cols, xs, n, out, self.strips))
            })
        });
    }

    /// Runs `f` on `x [n, cols]` in the layout this tier's bf16 and MXFP4 kernels read:
    /// unchanged for the scalar tier; for the SIMD tiers, [`split_even_odd_rows`] with the
    /// tier's f32 lane count (so one 32-bit lane holding two bf16, or one byte holding two E2M1
    /// nibbles, feeds the same lane of an even-column and an odd-column vector), in this
    /// thread's reused buffer. Once per call: `O(n·cols)`.
    fn with_split<R>(self, x: &[f32], cols: usize, f: impl FnOnce(&[f32]) -> R) -> R {
        let lanes = match self.tier {
            Tier::Scalar => return f(x),
            Tier::Avx2 | Tier::Neon => 8,
            Tier::Avx512 => 16,
        };
        with_buffer(&SPLIT, |buf| {
            split_even_odd_rows_into(x, cols, lanes, buf);
            f(buf)
        })
    }

    /// Runs `iters` rounds of this tier's FMA probe (12 or 16 independent chains of vector FMAs, the
    /// machine's multiply-add peak on one thread) and returns the multiply-adds done and a value
    /// that depends on all of them. `k3-ctl doctor` and the kernel bench time it.
    pub fn fma_probe(self, iters: usize) -> (u64, f32) {
        // (lanes, independent chains)
        let (lanes, chains) = match self.tier {
            Tier::Scalar => (1, 16),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => (8, avx2::FMA_PROBE_CHAINS as u64),
            #[cfg(not(target_arch = "x86_64"))]
            Tier::Avx2 => (8, 16),
            Tier::Avx512 => (16, 16),
            #[cfg(all(target_arch = "aarch64", target_endian = "little"))]
            Tier::Neon => (4, neon::FMA_PROBE_CHAINS as u64),
            #[cfg(not(all(target_arch = "aarch64", target_endian = "little")))]
            Tier::Neon => (4, 16),
        };
        let v = by_tier!(self, fma_probe(iters, 1.0));
        (chains * lanes * iters as u64, v)
    }

    /// [`dot_f32`] on this tier.
    pub fn dot_f32(self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len(), "dot_f32 lengths");
        by_tier!(self, dot_f32(a, b))
    }
}

/// Runs `f(first_row, out_rows)` over `y`'s rows: `f` fills `out_rows`, laid out `[k, n]`
/// (row-major by output row), for rows `first_row .. first_row + k`. `y` is `[n, rows]`.
fn by_rows<F>(rows: usize, cols: usize, n: usize, y: &mut [f32], f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    if rows == 0 || n == 0 {
        return;
    }
    let serial = !on_pool(rows, cols, n) || rayon::current_num_threads() == 1;
    if n == 1 {
        // Serial runs use the same chunks in order as the pool's tasks.
        if serial {
            y.chunks_mut(ROW_CHUNK)
                .enumerate()
                .for_each(|(i, o)| f(i * ROW_CHUNK, o));
        } else {
            y.par_chunks_mut(ROW_CHUNK)
                .enumerate()
                .for_each(|(i, o)| f(i * ROW_CHUNK, o));
        }
        return;
    }
    // Several tokens: each chunk of rows is computed rows-major (`[k, n]`, as the row kernels
    // write it; its rows stay in L2 while every token block passes over them) into the running
    // thread's buffer, then written to its place in each token's row of `y`. Every value of
    // the chunk is written by `f`, so a buffer of the right length is not zeroed first.
    let y = TokenRows::new(y, rows, n);
    let chunk = |i: usize| {
        let r0 = i * ROW_CHUNK;
        let k = ROW_CHUNK.min(rows - r0);
        with_buffer(&CHUNK, |buf| {
            if buf.len() != k * n {
                zeroed(buf, k * n);
            }
            f(r0, buf);
            // SAFETY: chunk `i` is the only one writing rows r0 .. r0 + k, and each chunk
            // index is run once.
            unsafe { y.write(r0, buf) };
        });
    };
    let chunks = rows.div_ceil(ROW_CHUNK);
    if serial {
        (0..chunks).for_each(chunk);
    } else {
        (0..chunks).into_par_iter().for_each(chunk);
    }
}

thread_local! {
    /// The split activations of the matrix kernel running on this thread.
    pub(super) static SPLIT: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    /// [`by_rows`]'s rows-major output of one chunk of rows for several tokens.
    static CHUNK: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    /// [`matmul_t_bf16`]'s widened weight row (and [`matmul_f32`]'s row that bf16 cannot hold).
    static ROW: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    /// [`matmul_f32`]'s row narrowed to bf16 (`2·cols` bytes).
    static NARROW: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
    /// [`with_scratch`]'s buffer.
    static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Greedy argmax; the first index wins ties. NaN never wins (all NaN: 0).
///
/// Two passes, the largest value (`f32::max` skips NaN) and then its first position, so that
/// both loops vectorise: over a 163,840-entry vocabulary this is ~4× faster than one pass that
/// compares against the best so far.
pub fn argmax(logits: &[f32]) -> u32 {
    let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    logits.iter().position(|&v| v == top).unwrap_or(0) as u32
}

/// `v` as `len` zeros, reusing its allocation (the engine's buffers, and the kernels' own per
/// thread, grow once and are then reused).
///
/// A buffer that must grow is freed first and then allocated at exactly `len` (no amortised
/// doubling, no moment with both the old and the new allocation): its size is the one its
/// owner states for the memory plan (`model::state::Work::bytes_for`).
pub(crate) fn zeroed(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    grow_exact(v, len);
    v.resize(len, 0.0);
    v
}

/// `v` emptied, with room for exactly `len` elements if it had less (the old allocation is
/// freed before the new one is made).
pub(crate) fn grow_exact<T>(v: &mut Vec<T>, len: usize) {
    v.clear();
    if v.capacity() < len {
        *v = Vec::new();
        v.reserve_exact(len);
    }
}

/// Runs `f` on `len` zeros in this thread's scratch buffer (kept for the next call like the
/// kernels' own; see [`with_buffer`]): temporaries of a per-head task sized by the context, such
/// as MLA's attention scores, exist once per thread rather than once per head. The buffer is
/// first sized for `planned` floats (when that is kept at all), so a context growing by a
/// position a step does not grow it again and again.
pub fn with_scratch<R>(len: usize, planned: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    with_buffer(&SCRATCH, |buf| {
        buf.clear();
        let want = if planned <= KEEP_MAX_FLOATS {
            planned.max(len)
        } else {
            len
        };
        buf.reserve(want);
        f(zeroed(buf, len))
    })
}

/// The largest per-thread kernel buffer kept between calls (4 MiB of f32): enough for a decode
/// step and a verify pass at K3's widths (17 positions × 33,792 columns), while a prefill chunk's
/// buffers are freed after the call instead of being held for the rest of the run.
pub const KEEP_MAX_FLOATS: usize = 1 << 20;

/// Bytes one thread's kernel buffers keep between calls at most when the largest call it ran
/// needed `split` floats of rearranged activations, `rows_major` floats of a rows-major chunk of
/// output, `row` floats of a widened weight row (and `row` bf16 of an F32 row narrowed by
/// [`matmul_f32`]) and `scratch` floats of per-task scratch (each buffer is kept only up to
/// `4·`[`KEEP_MAX_FLOATS`] bytes; a larger one lives for its call only).
pub fn kept_bytes_for(split: usize, rows_major: usize, row: usize, scratch: usize) -> u64 {
    let keep = 4 * KEEP_MAX_FLOATS as u64;
    let narrow = (2 * row as u64).min(keep);
    [split, rows_major, row, scratch]
        .into_iter()
        .map(|f| (4 * f as u64).min(keep))
        .sum::<u64>()
        + narrow
}

/// Runs `f` with this thread's buffer `key`, whose allocation is kept for the next call (a
/// kernel allocates its temporaries once per thread, not once per call) unless it grew past
/// [`KEEP_MAX_FLOATS`]. The buffer is taken out while `f` runs: a kernel started on this
/// thread meanwhile (a pool thread takes other work while it waits) finds it empty and uses a
/// buffer of its own, so nothing is shared.
pub(super) fn with_buffer<T, R>(
    key: &'static LocalKey<Cell<Vec<T>>>,
    f: impl FnOnce(&mut Vec<T>) -> R,
) -> R {
    let mut buf = key.take();
    let r = f(&mut buf);
    if buf.capacity() * std::mem::size_of::<T>() <= KEEP_MAX_FLOATS * 4 {
        key.set(buf);
    }
    r
}

/// Rearranges each `cols`-float row of `x` (one token) in blocks of `2·lanes` columns as
/// `[lanes even columns | lanes odd columns]`; the last `cols mod 2·lanes` columns of each row
/// stay in order. This is the order in which the SIMD tiers consume bf16 pairs (the two halves of
/// a 32-bit lane) and MXFP4 nibbles (byte `i` of a block holds columns `2i` and `2i+1`).
/// The shape checks of a dense `[rows, cols]` product with `elem`-byte weights (`name` in the
/// panic message); `false` when there is nothing to multiply (`cols == 0`: `y` zeroed).
#[allow(clippy::too_many_arguments)]
fn dense_shapes(
    w: &[u8],
    elem: usize,
    name: &str,
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> bool {
    assert_eq!(
        Some(w.len()),
        rows.checked_mul(cols).and_then(|v| v.checked_mul(elem)),
        "{name} weight bytes"
    );
    assert_eq!(Some(x.len()), n.checked_mul(cols), "matmul input");
    assert_eq!(Some(y.len()), n.checked_mul(rows), "matmul output");
    if cols == 0 {
        y.fill(0.0);
        return false;
    }
    true
}

#[cfg(test)]
fn split_even_odd_rows(x: &[f32], cols: usize, lanes: usize) -> Vec<f32> {
    let mut out = Vec::new();
    split_even_odd_rows_into(x, cols, lanes, &mut out);
    out
}

/// [`split_even_odd_rows`] into `out` (its allocation reused).
pub(super) fn split_even_odd_rows_into(x: &[f32], cols: usize, lanes: usize, out: &mut Vec<f32>) {
    assert!(cols > 0 && lanes > 0 && x.len().is_multiple_of(cols));
    let block = 2 * lanes;
    out.clear();
    out.extend_from_slice(x);
    for (src, dst) in x.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
        for (s, d) in src.chunks_exact(block).zip(dst.chunks_exact_mut(block)) {
            let (ev, od) = d.split_at_mut(lanes);
            for i in 0..lanes {
                ev[i] = s[2 * i];
                od[i] = s[2 * i + 1];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tier narrows an F32 row to the high halves of its values, in order, and calls it
    /// exact exactly when no value has a low-half bit set, wherever that value sits (a SIMD
    /// step's any lane, or the tail).
    #[test]
    fn every_tier_narrows_f32_rows_and_spots_any_value_bf16_cannot_hold() {
        for tier in Tier::ALL {
            let Some(k) = Kernels::new(tier) else {
                continue;
            };
            for cols in [1usize, 7, 15, 16, 17, 31, 32, 33, 47, 64, 100] {
                let bits: Vec<u32> = (0..cols as u32)
                    .map(|i| 0x3f80_0000u32.wrapping_add(i.wrapping_mul(0x9e37_0000)) & 0xffff_0000)
                    .collect();
                let want: Vec<u8> = bits
                    .iter()
                    .flat_map(|b| ((b >> 16) as u16).to_le_bytes())
                    .collect();
                let narrow = |bits: &[u32]| {
                    let row: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
                    let mut out = vec![0xAAu8; 2 * cols];
                    let exact = by_tier!(k, narrow_f32_row(&row, &mut out));
                    (exact, out)
                };
                assert_eq!(narrow(&bits), (true, want.clone()), "{tier} {cols}");
                for j in 0..cols {
                    for low in [1u32, 0x8000] {
                        let mut b = bits.clone();
                        b[j] |= low;
                        assert_eq!(narrow(&b), (false, want.clone()), "{tier} {cols} at {j}");
                    }
                }
            }
        }
    }

    #[test]
    fn split_even_odd_rows_permutes_whole_blocks_of_each_row_and_keeps_tails() {
        for lanes in [8usize, 16] {
            let block = 2 * lanes;
            for cols in [
                1,
                7,
                block - 1,
                block,
                block + 1,
                2 * block + lanes + 3,
                5 * block,
            ] {
                let n = 3;
                // Value = token·10000 + column: the layout can be read back from the values.
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i / cols) * 10_000 + i % cols) as f32)
                    .collect();
                let y = split_even_odd_rows(&x, cols, lanes);
                assert_eq!(y.len(), x.len());
                for t in 0..n {
                    let row = &y[t * cols..(t + 1) * cols];
                    let whole = cols / block * block;
                    for (j, &v) in row.iter().enumerate() {
                        let col = if j < whole {
                            let (b, k) = (j / block, j % block);
                            b * block
                                + if k < lanes {
                                    2 * k
                                } else {
                                    2 * (k - lanes) + 1
                                }
                        } else {
                            j
                        };
                        assert_eq!(
                            v,
                            (t * 10_000 + col) as f32,
                            "lanes {lanes} cols {cols} [{t},{j}]"
                        );
                    }
                    // A permutation of the token's own columns.
                    let mut sorted: Vec<f32> = row.to_vec();
                    sorted.sort_by(f32::total_cmp);
                    assert_eq!(sorted, x[t * cols..(t + 1) * cols]);
                }
            }
        }
    }
}
