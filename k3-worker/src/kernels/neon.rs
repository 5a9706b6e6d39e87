//! NEON tier (aarch64, little-endian): the AVX2 tier's operation sequence, its 8 f32 lanes held
//! as two 128-bit vectors ([`F8`]: lanes 0–3 and 4–7). Every lane receives the same FMAs in the
//! same order as the AVX2 lane of the same number, and the lanes are reduced by the same tree, so
//! a row's result is the bits of the AVX2 tier's (and of the 8-lane model in
//! `tests/kernels.rs`); `vfmaq_f32` and `vfmadd` both round once.
//!
//! * bf16 dot: 16 weights are two 128-bit loads (cols 0–7 and 8–15, four u32 lanes of two bf16
//!   each); `lane << 16` is the even column's f32, `lane & 0xFFFF_0000` the odd column's, so the
//!   first load gives even/odd lanes 0–3 and the second lanes 4–7. Activations arrive per 16
//!   columns as `[8 even | 8 odd]` (`split_even_odd_rows` with 8 lanes, the AVX2 layout). After
//!   the 16-column blocks, one 8-column step (`vshll` by 16 of eight bf16) and the zero-padded
//!   last `< 8` columns complete the row. Each (row, token) pair has one accumulator pair.
//! * EC-BF16: a block's 32 low bytes are two vectors (positions 0–15, 16–31), its indices are
//!   unpacked into two vectors by per-byte shifts (the AVX2 tier's per-lane shifts, byte by
//!   byte), one `tbl` per vector looks the high bytes up in the palette, and `zip1`/`zip2` of low
//!   and high bytes give columns 0–7, 8–15, 16–23 and 24–31 (the block order, SPEC §6.13, was
//!   chosen for AVX2's in-lane unpack; for 128-bit zips it is the same four pieces).
//! * MXFP4 dot: a group's 16 packed bytes give 16 low and 16 high nibbles (even and odd
//!   columns); two `tbl` lookups give the two high bytes of each E2M1 value's f32 (every E2M1
//!   value is a bf16), zipped into bf16 and widened by `vshll`, in the lanes the `[8 even | 8
//!   odd]` activation blocks pair with. Per group `p = w0·x0 + w1·x1 + w2·x2 + w3·x3` (a
//!   multiply, then FMAs), then `acc[g mod 2] += p·2^(s−127)` (one FMA).
//! * int8 / int4 (`kernels::quant`'s sequence): the scalar twin's 32 (int8) or 16 (int4) lanes,
//!   four a vector; codes widened exactly (`vmovl` to 32 bits, `vcvtq`), one FMA a lane and
//!   column as in the twin, the lanes summed by the same halving (vectors pairwise, then the
//!   two halves of the last, then its two lanes).
//! * Blocking: a single token is dotted with 4 rows at once (8 accumulators, 8 activation and up
//!   to 8 weight vectors within the 32 registers), 2 tokens with 2 rows; MXFP4 one row with up
//!   to 2 tokens. No software prefetch (the aarch64 prefetch intrinsic is not stable Rust; the
//!   cores' stream prefetchers follow sequential rows).
//!
//! NEON is part of every aarch64 CPU, so the arithmetic intrinsics are safe to call here; only
//! loads and stores through pointers are `unsafe`.

use std::arch::aarch64::*;

use k3_proto::ecbf16::{self, CodedMatrix};

use super::scalar::{E2M1, E8M0_TABLE};
use super::tile::{self, Bf16Blocks, Lanes, Mxfp4Groups};

/// Tokens dotted with one loaded weight vector at a time (matmul; MXFP4 and bf16).
const TOKEN_BLOCK: usize = 2;
/// bf16 rows per block for a single token (decode).
const MATVEC_ROWS: usize = 4;
/// bf16 rows per block with `TOKEN_BLOCK` tokens.
const MATMUL_ROWS: usize = 2;

// ------------------------------------------------------------------------------------------
// Eight lanes

/// Eight f32 lanes as two vectors: lanes 0–3, lanes 4–7 (the AVX2 tier's `__m256`).
#[derive(Clone, Copy)]
pub(super) struct F8(float32x4_t, float32x4_t);

impl F8 {
    #[inline]
    #[target_feature(enable = "neon")]
    fn zero() -> F8 {
        F8(vdupq_n_f32(0.0), vdupq_n_f32(0.0))
    }

    #[inline]
    #[target_feature(enable = "neon")]
    fn splat(v: f32) -> F8 {
        F8(vdupq_n_f32(v), vdupq_n_f32(v))
    }

    /// 8 floats at `p`.
    ///
    /// # Safety
    /// 8 floats at `p` are readable.
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load(p: *const f32) -> F8 {
        // SAFETY: floats 0..4 of the 8 readable ones.
        let a = unsafe { vld1q_f32(p) };
        // SAFETY: floats 4..8.
        let b = unsafe { vld1q_f32(p.wrapping_add(4)) };
        F8(a, b)
    }

    /// `self + w·x`, one rounding per lane (the AVX2 tier's `fmadd(w, x, self)`).
    #[inline]
    #[target_feature(enable = "neon")]
    fn fma(self, w: F8, x: F8) -> F8 {
        F8(vfmaq_f32(self.0, w.0, x.0), vfmaq_f32(self.1, w.1, x.1))
    }

    #[inline]
    #[target_feature(enable = "neon")]
    fn mul(self, x: F8) -> F8 {
        F8(vmulq_f32(self.0, x.0), vmulq_f32(self.1, x.1))
    }

    #[inline]
    #[target_feature(enable = "neon")]
    fn add(self, x: F8) -> F8 {
        F8(vaddq_f32(self.0, x.0), vaddq_f32(self.1, x.1))
    }

    /// The AVX2 tier's fixed-order lane sum: `s = lanes 0–3 + lanes 4–7`, then
    /// `(s0 + s2) + (s1 + s3)`.
    #[inline]
    #[target_feature(enable = "neon")]
    fn hsum(self) -> f32 {
        let s = vaddq_f32(self.0, self.1);
        let t = vadd_f32(vget_low_f32(s), vget_high_f32(s));
        vget_lane_f32::<0>(t) + vget_lane_f32::<1>(t)
    }
}

/// Widens 16 raw bf16 (`a` = columns 0–7, `b` = 8–15) exactly: `(even columns, odd columns)`.
#[inline]
#[target_feature(enable = "neon")]
fn widen16(a: uint8x16_t, b: uint8x16_t) -> (F8, F8) {
    let (a, b) = (vreinterpretq_u32_u8(a), vreinterpretq_u32_u8(b));
    let odd = vdupq_n_u32(0xFFFF_0000);
    let even = |v: uint32x4_t| vreinterpretq_f32_u32(vshlq_n_u32::<16>(v));
    let odd = |v: uint32x4_t| vreinterpretq_f32_u32(vandq_u32(v, odd));
    (F8(even(a), even(b)), F8(odd(a), odd(b)))
}

/// Widens 8 bf16 (a vector of eight u16) exactly, lane `l` = bf16 `l`.
#[inline]
#[target_feature(enable = "neon")]
fn widen8(h: uint16x8_t) -> F8 {
    F8(
        vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h))),
        vreinterpretq_f32_u32(vshll_high_n_u16::<16>(h)),
    )
}

/// 16 bytes at `p`.
///
/// # Safety
/// 16 bytes at `p` are readable.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn load16(p: *const u8) -> uint8x16_t {
    // SAFETY: 16 readable bytes (caller contract); byte loads need no alignment.
    unsafe { vld1q_u8(p) }
}

/// 32 bytes at `p` as two vectors.
///
/// # Safety
/// 32 bytes at `p` are readable.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn load32(p: *const u8) -> (uint8x16_t, uint8x16_t) {
    // SAFETY: the first 16 of the 32 readable bytes.
    let a = unsafe { load16(p) };
    // SAFETY: the last 16.
    let b = unsafe { load16(p.wrapping_add(16)) };
    (a, b)
}

/// The last `< 8` bf16 of a row, zero-padded.
#[inline]
#[target_feature(enable = "neon")]
fn widen_tail(bytes: &[u8]) -> F8 {
    let mut buf = [0u8; 16];
    buf[..bytes.len()].copy_from_slice(bytes);
    // SAFETY: buf is 16 readable bytes.
    widen8(vreinterpretq_u16_u8(unsafe { load16(buf.as_ptr()) }))
}

/// The last `< 8` floats, zero-padded.
#[inline]
#[target_feature(enable = "neon")]
fn load_tail(v: &[f32]) -> F8 {
    let mut buf = [0.0f32; 8];
    buf[..v.len()].copy_from_slice(v);
    // SAFETY: buf is 8 readable floats.
    unsafe { F8::load(buf.as_ptr()) }
}

// ------------------------------------------------------------------------------------------
// bf16 rows: raw or EC-BF16 coded

/// A bf16 matrix's rows as this tier reads them: whole 32-column blocks as four vectors of raw
/// bf16 (columns 0–7, 8–15, 16–23, 24–31; decoded in registers for a coded matrix), and the
/// bytes after the last whole block.
pub(super) trait Rows {
    /// Columns.
    fn cols(&self) -> usize;
    /// Rows.
    fn rows(&self) -> usize;
    /// Raw bf16 of whole block `b` of row `i`.
    ///
    /// # Safety
    /// `i < rows`, `32b + 32 <= cols`.
    unsafe fn block(&self, i: usize, b: usize) -> [uint8x16_t; 4];
    /// Raw bf16 bytes of row `i` from column `32·⌊cols/32⌋` to the end (`buf` as scratch).
    fn rest<'s>(&'s self, i: usize, buf: &'s mut [u8; 64]) -> &'s [u8];
}

/// Raw bf16 rows (`2·cols` bytes each).
struct RawRows<'a> {
    w: &'a [u8],
    cols: usize,
}

impl<'a> RawRows<'a> {
    fn new(w: &'a [u8], cols: usize) -> RawRows<'a> {
        assert!(
            cols > 0 && w.len().is_multiple_of(2 * cols),
            "bf16 rows: partial row"
        );
        RawRows { w, cols }
    }
}

impl Rows for RawRows<'_> {
    fn cols(&self) -> usize {
        self.cols
    }
    fn rows(&self) -> usize {
        self.w.len() / (2 * self.cols)
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn block(&self, i: usize, b: usize) -> [uint8x16_t; 4] {
        let p = self.w.as_ptr().wrapping_add(2 * (i * self.cols + 32 * b));
        // SAFETY: row i has 2·cols bytes and 32b + 32 <= cols (caller contract): the block's 64
        // bytes are in `w`.
        std::array::from_fn(|k| unsafe { load16(p.wrapping_add(16 * k)) })
    }
    fn rest<'s>(&'s self, i: usize, _buf: &'s mut [u8; 64]) -> &'s [u8] {
        let rb = 2 * self.cols;
        &self.w[i * rb + 2 * (self.cols / 32 * 32)..(i + 1) * rb]
    }
}

/// Rows `r0 ..` of an EC-BF16 matrix with index width `W` (k3_proto::ecbf16).
struct CodedRows<'a, const W: u8> {
    m: CodedMatrix<'a>,
    r0: usize,
    k: usize,
    table: uint8x16_t,
    /// Rows `r0 .. r0+k`'s blocks, `stride` bytes a row.
    blocks: &'a [u8],
    stride: usize,
}

impl<'a, const W: u8> CodedRows<'a, W> {
    /// Rows `r0 .. r0+k` of `m` (whose width must be `W`).
    fn new(m: CodedMatrix<'a>, r0: usize, k: usize) -> CodedRows<'a, W> {
        assert!(
            m.width() == W && r0 + k <= m.rows() && m.cols() > 0,
            "coded rows"
        );
        let t = m.table();
        let stride = m.row_stride();
        CodedRows {
            m,
            r0,
            k,
            // SAFETY: the palette table is 16 readable bytes.
            table: unsafe { load16(t.as_ptr()) },
            blocks: &m.blocks()[r0 * stride..(r0 + k) * stride],
            stride,
        }
    }
}

/// Per byte of a `k`-bit index section broadcast over 16 positions (`q = 4d + i`), the right
/// shift `k·⌊d/k⌋` that brings its field to the bottom (SPEC §6.13), as a negative left shift
/// for `vshlq_u8`: positions 0–15 (`hi = false`) or 16–31.
const fn section_shifts(k: i32, hi: bool) -> [i8; 16] {
    let mut s = [0i8; 16];
    let mut q = 0;
    while q < 16 {
        let d = (q / 4) as i32 + if hi { 4 } else { 0 };
        s[q] = -(k * (d / k)) as i8;
        q += 1;
    }
    s
}
const SHIFT2: [[i8; 16]; 2] = [section_shifts(2, false), section_shifts(2, true)];
const SHIFT1: [[i8; 16]; 2] = [section_shifts(1, false), section_shifts(1, true)];

/// A `k`-bit section's fields for positions 0–15 and 16–31: `bytes` is the section broadcast
/// to 16 bytes, shifted per position and masked to `k` bits.
#[inline]
#[target_feature(enable = "neon")]
fn section_fields(bytes: uint8x16_t, shifts: &[[i8; 16]; 2], mask: u8) -> [uint8x16_t; 2] {
    std::array::from_fn(|h| {
        // SAFETY: each shift table is 16 readable bytes.
        let s = vreinterpretq_s8_u8(unsafe { load16(shifts[h].as_ptr().cast()) });
        vandq_u8(vshlq_u8(bytes, s), vdupq_n_u8(mask))
    })
}

/// The `W`-bit indices of the 32 positions of one block (index area at `p`), one per byte:
/// positions 0–15 and 16–31.
///
/// # Safety
/// `4·W` bytes at `p` are readable.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn block_indices<const W: u8>(p: *const u8) -> [uint8x16_t; 2] {
    let two_bit = |p: *const u8| {
        // SAFETY: 8 readable bytes at p (caller contract).
        let t = unsafe { vld1_u8(p) };
        section_fields(vcombine_u8(t, t), &SHIFT2, 3)
    };
    match W {
        4 => {
            // SAFETY: 16 readable bytes at p (caller contract).
            let s = unsafe { load16(p) };
            [vandq_u8(s, vdupq_n_u8(15)), vshrq_n_u8::<4>(s)]
        }
        3 => {
            // SAFETY: bytes 8..12 of the 12 readable ones (caller contract).
            let d = unsafe { std::ptr::read_unaligned(p.wrapping_add(8) as *const u32) };
            let hi = section_fields(vreinterpretq_u8_u32(vdupq_n_u32(d)), &SHIFT1, 1);
            let lo = two_bit(p);
            [
                vorrq_u8(lo[0], vshlq_n_u8::<2>(hi[0])),
                vorrq_u8(lo[1], vshlq_n_u8::<2>(hi[1])),
            ]
        }
        _ => two_bit(p),
    }
}

/// Decodes one EC-BF16 block at `p` into its raw bf16 (columns 0–7, 8–15, 16–23, 24–31) by
/// one palette lookup per 16 positions and byte zips; also returns whether any position is
/// escaped.
///
/// # Safety
/// `32 + 4·W` bytes at `p` are readable.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn decode_coded_block<const W: u8>(
    p: *const u8,
    table: uint8x16_t,
) -> ([uint8x16_t; 4], bool) {
    // SAFETY: the 32 low bytes, then the 4W index bytes (caller contract).
    let (l0, l1) = unsafe { load32(p) };
    // SAFETY: as above.
    let [i0, i1] = unsafe { block_indices::<W>(p.wrapping_add(32)) };
    let (h0, h1) = (vqtbl1q_u8(table, i0), vqtbl1q_u8(table, i1));
    let esc = vdupq_n_u8(ecbf16::escape_code(W));
    let escaped = vmaxvq_u8(vorrq_u8(vceqq_u8(i0, esc), vceqq_u8(i1, esc))) != 0;
    (
        [
            vzip1q_u8(l0, h0),
            vzip1q_u8(l1, h1),
            vzip2q_u8(l0, h0),
            vzip2q_u8(l1, h1),
        ],
        escaped,
    )
}

impl<const W: u8> Rows for CodedRows<'_, W> {
    fn cols(&self) -> usize {
        self.m.cols()
    }
    fn rows(&self) -> usize {
        self.k
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn block(&self, i: usize, b: usize) -> [uint8x16_t; 4] {
        let at = i * self.stride + b * ecbf16::block_bytes(W);
        let p = self.blocks.as_ptr().wrapping_add(at);
        // SAFETY: i < k and block b is whole (caller contract), so its 32 + 4W bytes lie in
        // row i of `blocks`.
        let (raw, escaped) = unsafe { decode_coded_block::<W>(p, self.table) };
        if !escaped {
            return raw;
        }
        let mut buf = [0u8; 64];
        for (k, v) in raw.iter().enumerate() {
            // SAFETY: bytes 16k .. 16k+16 of the 64 writable ones.
            unsafe { vst1q_u8(buf.as_mut_ptr().wrapping_add(16 * k), *v) };
        }
        for (c, hb) in self.m.row_escapes(self.r0 + i).in_cols(32 * b, 32 * b + 32) {
            buf[2 * (c - 32 * b) + 1] = hb;
        }
        // SAFETY: 64 readable bytes.
        std::array::from_fn(|k| unsafe { load16(buf.as_ptr().wrapping_add(16 * k)) })
    }
    fn rest<'s>(&'s self, i: usize, buf: &'s mut [u8; 64]) -> &'s [u8] {
        let (cols, full) = (self.m.cols(), self.m.cols() / 32);
        if full * 32 == cols {
            return &[];
        }
        self.m.decode_block(self.r0 + i, full, buf);
        &buf[..2 * (cols - 32 * full)]
    }
}

/// Block `b` of a row as the four vectors the split activations pair with: even columns 0–14,
/// odd 1–15, even 16–30, odd 17–31.
#[inline]
#[target_feature(enable = "neon")]
fn widen_block(v: [uint8x16_t; 4]) -> [F8; 4] {
    let (e0, o0) = widen16(v[0], v[1]);
    let (e1, o1) = widen16(v[2], v[3]);
    [e0, o0, e1, o1]
}

/// `R` rows dotted with `T` tokens at once: `out[i][t] = Σ_c W[row i, c]·x[token t, c]`, with
/// each token's activations in the `split_even_odd_rows` layout (blocks of 16).
///
/// Every (row, token) pair has ONE accumulator (8 lanes) and this sequence of FMAs into it: per
/// 16-column block the even columns then the odd columns (lane `l` takes columns `2l` and
/// `2l+1` of the block), then at most one 8-column step (lane `l` = column `l`), then the
/// zero-padded last `< 8` columns; the lanes are reduced by [`F8::hsum`]. The AVX2 tier's
/// sequence, so the same bits; blocking decides only how often each vector is loaded.
///
/// # Safety
/// The rows exist in `src`; each `x[t]` has `cols` floats.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn dot_block<S: Rows, const R: usize, const T: usize>(
    src: &S,
    rows: [usize; R],
    x: [&[f32]; T],
) -> [[f32; T]; R] {
    let cols = src.cols();
    let mut acc = [[F8::zero(); T]; R];
    for b in 0..cols / 32 {
        // SAFETY: 32b + 32 <= cols: floats 32b .. 32b+32 of every token are in bounds.
        let xv: [[F8; 4]; T] = std::array::from_fn(|t| {
            let p = x[t][32 * b..32 * b + 32].as_ptr();
            // SAFETY: floats 8j .. 8j+8 of the 32 just sliced.
            std::array::from_fn(|j| unsafe { F8::load(p.wrapping_add(8 * j)) })
        });
        for i in 0..R {
            // SAFETY: row rows[i] exists and block b is whole.
            let w = widen_block(unsafe { src.block(rows[i], b) });
            for t in 0..T {
                for j in 0..4 {
                    acc[i][t] = acc[i][t].fma(w[j], xv[t][j]);
                }
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
            out[i][t] = acc[i][t].hsum();
        }
    }
    out
}

/// The columns `c0 .. cols` (`c0` a multiple of 32, `rest[i]` row `i`'s raw bytes from `c0`):
/// at most one 16-column block, one 8-column step and the zero-padded tail, as in `dot_block`.
#[inline]
#[target_feature(enable = "neon")]
fn finish<const R: usize, const T: usize>(
    acc: &mut [[F8; T]; R],
    rest: [&[u8]; R],
    x: [&[f32]; T],
    c0: usize,
    cols: usize,
) {
    let mut c = c0;
    if c + 16 <= cols {
        // SAFETY: c + 16 <= cols: floats c .. c+16 of every token are in bounds.
        let xe: [F8; T] = std::array::from_fn(|t| unsafe { F8::load(x[t][c..c + 8].as_ptr()) });
        // SAFETY: as above.
        let xo: [F8; T] =
            std::array::from_fn(|t| unsafe { F8::load(x[t][c + 8..c + 16].as_ptr()) });
        for i in 0..R {
            let w = &rest[i][2 * (c - c0)..2 * (c - c0 + 16)];
            // SAFETY: `w` is 32 bytes.
            let (a, b) = unsafe { load32(w.as_ptr()) };
            let (we, wo) = widen16(a, b);
            for t in 0..T {
                acc[i][t] = acc[i][t].fma(we, xe[t]).fma(wo, xo[t]);
            }
        }
        c += 16;
    }
    if c + 8 <= cols {
        // SAFETY: c + 8 <= cols: floats c .. c+8 of every token are in bounds.
        let xv: [F8; T] = std::array::from_fn(|t| unsafe { F8::load(x[t][c..c + 8].as_ptr()) });
        for i in 0..R {
            let w = &rest[i][2 * (c - c0)..2 * (c - c0 + 8)];
            // SAFETY: `w` is 16 bytes.
            let wv = widen8(vreinterpretq_u16_u8(unsafe { load16(w.as_ptr()) }));
            for t in 0..T {
                acc[i][t] = acc[i][t].fma(wv, xv[t]);
            }
        }
        c += 8;
    }
    if c < cols {
        let xv: [F8; T] = std::array::from_fn(|t| load_tail(&x[t][c..cols]));
        for i in 0..R {
            let wv = widen_tail(&rest[i][2 * (c - c0)..2 * (cols - c0)]);
            for t in 0..T {
                acc[i][t] = acc[i][t].fma(wv, xv[t]);
            }
        }
    }
}

/// Rows `r0 .. r0+R` of `src` × tokens `t0 .. t0+T` (of `x [n, cols]`) into `out [k, n]`.
#[inline]
#[target_feature(enable = "neon")]
fn bf16_block<S: Rows, const R: usize, const T: usize>(
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
    // SAFETY: rows r0..r0+R exist (asserted) and each token slice has `cols` floats.
    let r = unsafe { dot_block::<S, R, T>(src, std::array::from_fn(|i| r0 + i), toks) };
    for i in 0..R {
        out[(r0 + i) * n + t0..(r0 + i) * n + t0 + T].copy_from_slice(&r[i]);
    }
}

/// All rows of `src` × tokens `t0 .. t0+T`: blocks of `R` rows, then the remaining `< R` rows in
/// blocks of 2 and 1 (`R` is 4, 2 or 1).
#[inline]
#[target_feature(enable = "neon")]
fn bf16_tokens<S: Rows, const R: usize, const T: usize>(
    src: &S,
    x: &[f32],
    n: usize,
    t0: usize,
    out: &mut [f32],
) {
    let k = src.rows();
    let mut r = 0;
    while r + R <= k {
        bf16_block::<S, R, T>(src, x, n, r, t0, out);
        r += R;
    }
    if R > 2 && r + 2 <= k {
        bf16_block::<S, 2, T>(src, x, n, r, t0, out);
        r += 2;
    }
    if r < k {
        bf16_block::<S, 1, T>(src, x, n, r, t0, out);
    }
}

impl<S: Rows> Bf16Blocks<Neon> for S {
    fn cols(&self) -> usize {
        Rows::cols(self)
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn widened(&self, i: usize, b: usize) -> [F8; 4] {
        // SAFETY: the caller's contract is `block`'s.
        widen_block(unsafe { self.block(i, b) })
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn finish(&self, i: usize, acc: F8, x: &[f32]) -> f32 {
        let cols = Rows::cols(self);
        let mut buf = [0u8; 64];
        let mut a = [[acc]];
        finish(&mut a, [self.rest(i, &mut buf)], [x], cols / 32 * 32, cols);
        a[0][0].hsum()
    }
}

/// Row kernel over any row source: `out [k, n]` for its `k` rows; `x [n, cols]` with each
/// token's columns in the `split_even_odd_rows` layout (blocks of 16). More than `TOKEN_BLOCK`
/// tokens take the strip kernel (`tile`) when `strips` is set.
#[target_feature(enable = "neon")]
fn rows_kernel<S: Rows>(src: &S, x: &[f32], n: usize, out: &mut [f32], strips: bool) {
    let (cols, k) = (src.cols(), src.rows());
    assert!(cols > 0 && n > 0, "empty bf16 product");
    assert_eq!(out.len(), k * n, "bf16 rows vs output");
    assert_eq!(x.len(), n * cols, "bf16 rows input");
    if strips && n > TOKEN_BLOCK {
        // SAFETY: lengths checked above; NEON is part of every aarch64 CPU.
        unsafe { tile::bf16_strips::<Neon, S, MATMUL_ROWS, TOKEN_BLOCK>(src, k, x, n, out) };
        return;
    }
    // Token blocks outer, rows inner: the task's rows stay in L2 while every token block passes
    // over them, and each token block's activations stay in L1/L2.
    let mut t = 0;
    while t + TOKEN_BLOCK <= n {
        bf16_tokens::<S, MATMUL_ROWS, TOKEN_BLOCK>(src, x, n, t, out);
        t += TOKEN_BLOCK;
    }
    if t < n && cols <= super::scalar::NARROW_COLS {
        bf16_tokens::<S, 1, 1>(src, x, n, t, out);
    } else if t < n {
        bf16_tokens::<S, MATVEC_ROWS, 1>(src, x, n, t, out);
    }
}

/// Row kernel: `out [k, n]` for the `k = w.len() / (2·cols)` rows in `w`.
///
/// # Safety
/// None beyond the other tiers' signature: NEON is part of every aarch64 CPU. (Lengths are
/// checked here.)
#[target_feature(enable = "neon")]
pub(super) unsafe fn bf16_rows(
    w: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    strips: bool,
) {
    rows_kernel(&RawRows::new(w, cols), x, n, out, strips)
}

/// Row kernel for rows `r0 .. r0 + out.len()/n` of an EC-BF16 matrix: the same bits as
/// [`bf16_rows`] on the decoded matrix.
///
/// # Safety
/// As [`bf16_rows`].
#[target_feature(enable = "neon")]
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
        4 => rows_kernel(&CodedRows::<4>::new(*m, r0, k), x, n, out, strips),
        3 => rows_kernel(&CodedRows::<3>::new(*m, r0, k), x, n, out, strips),
        _ => rows_kernel(&CodedRows::<2>::new(*m, r0, k), x, n, out, strips),
    }
}

// ------------------------------------------------------------------------------------------
// MXFP4

/// Entry `k` is the high (`shift` 24) or second (`shift` 16) byte of the f32 of E2M1 code `k`:
/// every E2M1 value is a bf16, so its f32 is these two bytes followed by two zero bytes.
const fn e2m1_byte_table(shift: u32) -> [u8; 16] {
    let mut t = [0u8; 16];
    let mut k = 0;
    while k < 16 {
        t[k] = ((E2M1[k].to_bits() >> shift) & 0xFF) as u8;
        k += 1;
    }
    t
}
const E2M1_B3: [u8; 16] = e2m1_byte_table(24);
const E2M1_B2: [u8; 16] = e2m1_byte_table(16);

/// The two E2M1 byte tables as vectors.
#[derive(Clone, Copy)]
struct E2m1Tables {
    b3: uint8x16_t,
    b2: uint8x16_t,
}

impl E2m1Tables {
    #[inline]
    #[target_feature(enable = "neon")]
    fn new() -> E2m1Tables {
        // SAFETY: each table is 16 readable bytes.
        let b3 = unsafe { load16(E2M1_B3.as_ptr()) };
        // SAFETY: as above.
        let b2 = unsafe { load16(E2M1_B2.as_ptr()) };
        E2m1Tables { b3, b2 }
    }

    /// The f32 values of 16 E2M1 codes (one per byte) as two [`F8`]: codes 0–7 and 8–15.
    #[inline]
    #[target_feature(enable = "neon")]
    fn values(self, codes: uint8x16_t) -> [F8; 2] {
        let (b3, b2) = (vqtbl1q_u8(self.b3, codes), vqtbl1q_u8(self.b2, codes));
        // bf16 words: low byte b2, high byte b3.
        let lo = vreinterpretq_u16_u8(vzip1q_u8(b2, b3));
        let hi = vreinterpretq_u16_u8(vzip2q_u8(b2, b3));
        [widen8(lo), widen8(hi)]
    }
}

/// One group's 32 weights (16 packed bytes at `p`) as the four vectors the activations'
/// `[8 even | 8 odd]` blocks pair with: columns 0, 2, …, 14; 1, 3, …, 15; 16, …, 30; 17, …, 31
/// (byte `i`'s low nibble is column `2i`, its high nibble column `2i + 1`).
///
/// # Safety
/// 16 bytes at `p` are readable.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn decode_group(p: *const u8, t: E2m1Tables) -> [F8; 4] {
    // SAFETY: 16 readable bytes at p (caller contract).
    let b = unsafe { load16(p) };
    let [e0, e1] = t.values(vandq_u8(b, vdupq_n_u8(0x0F)));
    let [o0, o1] = t.values(vshrq_n_u8::<4>(b));
    [e0, o0, e1, o1]
}

/// Adds group `g` of one MXFP4 row, scaled, into `acc[t]` for each token.
///
/// # Safety
/// Group `g` exists in `packed` (16 bytes) and in each `x[t]` (32 floats).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn mxfp4_group<const T: usize>(
    packed: &[u8],
    scale: u8,
    x: &[&[f32]; T],
    g: usize,
    tables: E2m1Tables,
    acc: &mut [F8; T],
) {
    // SAFETY: bytes 16g .. 16g+16 lie in `packed` (caller contract).
    let w = unsafe { decode_group(packed.as_ptr().wrapping_add(16 * g), tables) };
    let s = F8::splat(E8M0_TABLE[scale as usize]);
    for t in 0..T {
        let xp = x[t].as_ptr().wrapping_add(32 * g);
        // SAFETY: group g's 32 activations of token t are in bounds (caller contract).
        let xv: [F8; 4] = std::array::from_fn(|j| unsafe { F8::load(xp.wrapping_add(8 * j)) });
        let p = w[0]
            .mul(xv[0])
            .fma(w[1], xv[1])
            .fma(w[2], xv[2])
            .fma(w[3], xv[3]);
        acc[t] = acc[t].fma(p, s);
    }
}

/// `T` MXFP4 row dots with tokens `t0 .. t0+T` of `x [n, cols]` (rearranged activations).
#[target_feature(enable = "neon")]
fn dot_mxfp4<const T: usize>(pr: &[u8], sr: &[u8], x: &[f32], cols: usize, t0: usize) -> [f32; T] {
    let groups = cols / 32;
    assert!(pr.len() == 16 * groups && sr.len() == groups);
    let xs: [&[f32]; T] = std::array::from_fn(|i| &x[(t0 + i) * cols..(t0 + i + 1) * cols]);
    let tables = E2m1Tables::new();
    let mut acc0 = [F8::zero(); T];
    let mut acc1 = [F8::zero(); T];
    let mut g = 0;
    while g + 2 <= groups {
        // SAFETY: g + 1 < groups; packed, scales and every token slice hold all groups.
        unsafe { mxfp4_group::<T>(pr, sr[g], &xs, g, tables, &mut acc0) };
        // SAFETY: as above.
        unsafe { mxfp4_group::<T>(pr, sr[g + 1], &xs, g + 1, tables, &mut acc1) };
        g += 2;
    }
    if g < groups {
        // SAFETY: g < groups, as above.
        unsafe { mxfp4_group::<T>(pr, sr[g], &xs, g, tables, &mut acc0) };
    }
    std::array::from_fn(|t| acc0[t].add(acc1[t]).hsum())
}

/// Row kernel: `out [k, n]` for the `k` rows in `packed`/`scales`; `x [n, cols]` with every
/// 16 columns rearranged `[8 even | 8 odd]`.
///
/// # Safety
/// As [`bf16_rows`].
#[target_feature(enable = "neon")]
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
        let src = Mxfp4Rows {
            packed,
            scales,
            cols,
            tables: E2m1Tables::new(),
        };
        // SAFETY: lengths checked above; NEON is part of every aarch64 CPU.
        unsafe { tile::mxfp4_strips::<Neon, _, 1, MXFP4_TILE_TOKENS>(&src, k, x, n, out) };
        return;
    }
    // Token blocks outer, rows inner (see `rows_kernel`).
    for t in (0..n).step_by(TOKEN_BLOCK) {
        for ((pr, sr), o) in packed
            .chunks_exact(pw)
            .zip(scales.chunks_exact(sw))
            .zip(out.chunks_exact_mut(n))
        {
            if n - t >= TOKEN_BLOCK {
                let r = dot_mxfp4::<TOKEN_BLOCK>(pr, sr, x, cols, t);
                o[t..t + TOKEN_BLOCK].copy_from_slice(&r);
            } else {
                let [r] = dot_mxfp4::<1>(pr, sr, x, cols, t);
                o[t] = r;
            }
        }
    }
}

/// MXFP4 strip tiles (more than `TOKEN_BLOCK` tokens): 1 row × 4 tokens of accumulator pairs.
const MXFP4_TILE_TOKENS: usize = 4;

/// An MXFP4 task's rows for the strip kernel.
struct Mxfp4Rows<'a> {
    packed: &'a [u8],
    scales: &'a [u8],
    cols: usize,
    tables: E2m1Tables,
}

impl Mxfp4Groups<Neon> for Mxfp4Rows<'_> {
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn group(&self, i: usize, g: usize) -> ([F8; 4], F8) {
        let at = i * self.cols / 2 + 16 * g;
        let p = self.packed[at..at + 16].as_ptr();
        // SAFETY: 16 readable bytes.
        let w = unsafe { decode_group(p, self.tables) };
        (
            w,
            F8::splat(E8M0_TABLE[self.scales[i * self.cols / 32 + g] as usize]),
        )
    }
}

/// This tier's vector for the strip kernels.
#[derive(Clone, Copy)]
pub(super) struct Neon;

impl Lanes for Neon {
    type F = F8;
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> F8 {
        // SAFETY: NEON is part of every aarch64 CPU.
        unsafe { F8::zero() }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> F8 {
        // SAFETY: 8 readable floats (caller contract).
        unsafe { F8::load(p) }
    }
    #[inline(always)]
    unsafe fn fma(a: F8, b: F8, c: F8) -> F8 {
        // SAFETY: NEON is part of every aarch64 CPU.
        unsafe { c.fma(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: F8, b: F8) -> F8 {
        // SAFETY: NEON is part of every aarch64 CPU.
        unsafe { a.mul(b) }
    }
    #[inline(always)]
    unsafe fn hsum_pair(a: F8, b: F8) -> f32 {
        // SAFETY: NEON is part of every aarch64 CPU.
        let s = unsafe { a.add(b) };
        // SAFETY: as above.
        unsafe { s.hsum() }
    }
}

// ------------------------------------------------------------------------------------------
// int8 / int4 quantized matrices (`kernels::quant`): the scalar twin's lanes, four a vector

/// 16 int8 codes at `p` as floats (exact): columns 0–3, 4–7, 8–11, 12–15.
///
/// # Safety
/// 16 bytes at `p` are readable.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn i8x16(p: *const u8) -> [float32x4_t; 4] {
    // SAFETY: 16 readable bytes (caller contract).
    let b = vreinterpretq_s8_u8(unsafe { load16(p) });
    let (lo, hi) = (vmovl_s8(vget_low_s8(b)), vmovl_high_s8(b));
    [
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
        vcvtq_f32_s32(vmovl_high_s16(lo)),
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
        vcvtq_f32_s32(vmovl_high_s16(hi)),
    ]
}

/// 16 nibbles (one a byte, `0..16`) as `q − 8` floats (exact): lanes 0–3, 4–7, 8–11, 12–15.
#[inline]
#[target_feature(enable = "neon")]
fn nibbles(b: uint8x16_t) -> [float32x4_t; 4] {
    let (lo, hi) = (vmovl_u8(vget_low_u8(b)), vmovl_high_u8(b));
    let eight = vdupq_n_f32(8.0);
    let f = |v: uint32x4_t| vsubq_f32(vcvtq_f32_u32(v), eight);
    [
        f(vmovl_u16(vget_low_u16(lo))),
        f(vmovl_high_u16(lo)),
        f(vmovl_u16(vget_low_u16(hi))),
        f(vmovl_high_u16(hi)),
    ]
}

/// 16 floats at `p` as four vectors.
///
/// # Safety
/// 16 floats at `p` are readable.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn load16_f32(p: *const f32) -> [float32x4_t; 4] {
    // SAFETY: floats 4j .. 4j+4 of the 16 readable ones (caller contract).
    std::array::from_fn(|j| unsafe { vld1q_f32(p.wrapping_add(4 * j)) })
}

/// The sum of the lanes of `v` (4·`v.len()` lanes, vector `j` holding lanes `4j .. 4j+4`) by
/// halving, as `scalar::halving_sum`: lane `i` adds lane `i + len/2`, down to one lane.
#[inline]
#[target_feature(enable = "neon")]
fn halving_sum(v: &mut [float32x4_t]) -> f32 {
    let mut w = v.len() / 2;
    while w > 0 {
        for i in 0..w {
            v[i] = vaddq_f32(v[i], v[i + w]);
        }
        w /= 2;
    }
    let t = vadd_f32(vget_low_f32(v[0]), vget_high_f32(v[0]));
    vget_lane_f32::<0>(t) + vget_lane_f32::<1>(t)
}

/// `R` int8 rows (`codes[r]`: `cols` bytes) × `T` tokens (`x[t]`: `cols` floats): each pair's
/// unscaled lane sum (32 lanes: eight vectors, column `c` in lane `c mod 32`).
///
/// # Safety
/// None beyond NEON (every aarch64 CPU); lengths are asserted.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn q8_block<const R: usize, const T: usize>(
    codes: [&[u8]; R],
    x: [&[f32]; T],
    cols: usize,
) -> [[f32; T]; R] {
    assert!(cols.is_multiple_of(32), "int8 row of {cols} columns");
    for c in &codes {
        assert_eq!(c.len(), cols, "int8 row codes");
    }
    for xt in &x {
        assert_eq!(xt.len(), cols, "int8 token");
    }
    let mut acc = [[[vdupq_n_f32(0.0); 8]; T]; R];
    for c in (0..cols).step_by(16) {
        // Columns c .. c+16 are lanes 4h .. 4h+16 of the 32 (h = 0 or 4).
        let h = (c % 32) / 4;
        // SAFETY: c + 16 <= cols floats of each token (asserted lengths).
        let xv: [[float32x4_t; 4]; T] =
            std::array::from_fn(|t| unsafe { load16_f32(x[t].as_ptr().wrapping_add(c)) });
        for r in 0..R {
            // SAFETY: c + 16 <= cols bytes of each row (asserted lengths).
            let w = unsafe { i8x16(codes[r].as_ptr().wrapping_add(c)) };
            for t in 0..T {
                for j in 0..4 {
                    acc[r][t][h + j] = vfmaq_f32(acc[r][t][h + j], w[j], xv[t][j]);
                }
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = halving_sum(&mut acc[r][t]);
        }
    }
    out
}

/// `R` int4 rows (`codes[r]`: `cols/2` bytes, `scales[r]`: `cols/32` f32) × `T` tokens (`x[t]`:
/// `cols` floats split per 32 as `[16 even | 16 odd]`): each pair's lane sum (16 lanes: four
/// vectors, lane `i` byte `i` of each group).
///
/// # Safety
/// None beyond NEON (every aarch64 CPU); lengths are asserted.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn q4_block<const R: usize, const T: usize>(
    codes: [&[u8]; R],
    scales: [&[u8]; R],
    x: [&[f32]; T],
    cols: usize,
) -> [[f32; T]; R] {
    let groups = cols / 32;
    for r in 0..R {
        assert!(
            codes[r].len() == 16 * groups && scales[r].len() == 4 * groups,
            "int4 row of {cols} columns"
        );
    }
    for xt in &x {
        assert_eq!(xt.len(), 32 * groups, "int4 token");
    }
    let mut acc = [[[vdupq_n_f32(0.0); 4]; T]; R];
    let mask = vdupq_n_u8(15);
    for g in 0..groups {
        // Each token's 32 floats of the group: 16 even columns, then 16 odd.
        let xv: [([float32x4_t; 4], [float32x4_t; 4]); T] = std::array::from_fn(|t| {
            let p = x[t].as_ptr().wrapping_add(32 * g);
            // SAFETY: floats 32g .. 32g+16 of the token (asserted length).
            let even = unsafe { load16_f32(p) };
            // SAFETY: floats 32g+16 .. 32g+32.
            (even, unsafe { load16_f32(p.wrapping_add(16)) })
        });
        for r in 0..R {
            // SAFETY: 16g + 16 <= 16·groups bytes of each row (asserted lengths).
            let b = unsafe { load16(codes[r].as_ptr().wrapping_add(16 * g)) };
            let lo = nibbles(vandq_u8(b, mask));
            let hi = nibbles(vshrq_n_u8::<4>(b));
            let s = vdupq_n_f32(super::scalar::f32_at(scales[r], g));
            for t in 0..T {
                let (xe, xo) = &xv[t];
                for j in 0..4 {
                    let p = vfmaq_f32(vmulq_f32(lo[j], xe[j]), hi[j], xo[j]);
                    acc[r][t][j] = vfmaq_f32(acc[r][t][j], p, s);
                }
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = halving_sum(&mut acc[r][t]);
        }
    }
    out
}

/// This tier's quantized-row dots for the shared row and token loops of `kernels::quant`.
pub(super) struct NeonDots;

impl super::quant_loop::QuantDots for NeonDots {
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn q8<const R: usize, const T: usize>(
        codes: [&[u8]; R],
        x: [&[f32]; T],
        cols: usize,
    ) -> [[f32; T]; R] {
        // SAFETY: NEON is part of every aarch64 CPU; the callee asserts the lengths.
        unsafe { q8_block::<R, T>(codes, x, cols) }
    }

    #[inline]
    #[target_feature(enable = "neon")]
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

/// Row kernel for rows `r0 .. r0 + k` of a quantized matrix (`out [k, n]`; `x [n,
/// cols]` in natural order for int8, split per 32 columns for int4): two tokens a block with
/// one row, a last single token with two rows (eight or four accumulator vectors a pair within
/// the 32 registers).
///
/// # Safety
/// As [`bf16_rows`]. (The shape is checked by the caller, `kernels::quant`.)
#[target_feature(enable = "neon")]
pub(super) unsafe fn quant_rows(
    m: &k3_proto::quant::QuantMatrix<'_>,
    r0: usize,
    k: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let mut t = 0;
    while t + 2 <= n {
        // SAFETY: NEON is part of every aarch64 CPU.
        unsafe { super::quant_loop::tokens::<NeonDots, 1, 2>(m, r0, k, x, n, t, out) };
        t += 2;
    }
    if t < n {
        // SAFETY: as above.
        unsafe { super::quant_loop::tokens::<NeonDots, 2, 1>(m, r0, k, x, n, t, out) };
    }
}

// ------------------------------------------------------------------------------------------
// FMA peak

/// Independent FMA chains of the probe: 16 cover a 4-cycle FMA latency on four pipes (Apple's
/// performance cores, Neoverse V1/V2) and, with the two constants, fit the 32 vector registers.
pub(super) const FMA_PROBE_CHAINS: usize = 16;

/// `iters` rounds of `FMA_PROBE_CHAINS` independent 4-lane FMA chains:
/// `FMA_PROBE_CHAINS·4·iters` multiply-adds; returns their sum so nothing is optimised away.
///
/// # Safety
/// None beyond the other tiers' signature (NEON is part of every aarch64 CPU).
#[target_feature(enable = "neon")]
pub(super) unsafe fn fma_probe(iters: usize, seed: f32) -> f32 {
    let (m, a) = (vdupq_n_f32(0.999_999), vdupq_n_f32(1e-7));
    let mut acc: [float32x4_t; FMA_PROBE_CHAINS] =
        std::array::from_fn(|i| vdupq_n_f32(seed + i as f32));
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = vfmaq_f32(a, *v, m);
        }
    }
    acc.iter().map(|&v| vaddvq_f32(v)).sum()
}

// ------------------------------------------------------------------------------------------
// F32 row narrowing

/// Narrows a little-endian F32 row to bf16 (each value's high half, in order) into `out`, 8
/// values a step (`uzp2` of their 16-bit halves), the rest one at a time; true when every
/// value's low half is zero. The same bytes and answer as `scalar::narrow_f32_row`.
///
/// # Safety
/// As [`bf16_rows`]. (Lengths are checked here.)
#[target_feature(enable = "neon")]
pub(super) unsafe fn narrow_f32_row(row: &[u8], out: &mut [u8]) -> bool {
    assert_eq!(row.len(), 2 * out.len(), "f32 row and its bf16 narrowing");
    let main = row.len() / 32 * 32;
    let mut low = vdupq_n_u16(0);
    for (src, dst) in row[..main].chunks_exact(32).zip(out.chunks_exact_mut(16)) {
        // SAFETY: `src` is 32 readable bytes (chunks_exact).
        let (a, b) = unsafe { load32(src.as_ptr()) };
        let (a, b) = (vreinterpretq_u16_u8(a), vreinterpretq_u16_u8(b));
        low = vorrq_u16(low, vuzp1q_u16(a, b));
        let high = vreinterpretq_u8_u16(vuzp2q_u16(a, b));
        // SAFETY: `dst` is 16 writable bytes (chunks_exact); byte stores need no alignment.
        unsafe { vst1q_u8(dst.as_mut_ptr(), high) };
    }
    let rest = super::scalar::narrow_f32_row(&row[main..], &mut out[main / 2..]);
    vmaxvq_u16(low) == 0 && rest
}

// f32 dot

/// `Σ a[i]·b[i]`: the AVX2 tier's sequence — four accumulators over 32-element steps,
/// 8-element steps into accumulator 0, the zero-padded rest into accumulator 1, then
/// `hsum((acc0 + acc1) + (acc2 + acc3))`.
///
/// # Safety
/// As [`bf16_rows`]. (Lengths are checked here.)
#[target_feature(enable = "neon")]
pub(super) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32 lengths");
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [F8::zero(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, aj) in acc.iter_mut().enumerate() {
            // SAFETY: i + 8j + 8 <= i + 32 <= n = a.len() = b.len().
            let va = unsafe { F8::load(pa.wrapping_add(i + 8 * j)) };
            // SAFETY: as above.
            let vb = unsafe { F8::load(pb.wrapping_add(i + 8 * j)) };
            *aj = aj.fma(va, vb);
        }
        i += 32;
    }
    while i + 8 <= n {
        // SAFETY: i + 8 <= n = a.len() = b.len().
        let va = unsafe { F8::load(pa.wrapping_add(i)) };
        // SAFETY: as above.
        let vb = unsafe { F8::load(pb.wrapping_add(i)) };
        acc[0] = acc[0].fma(va, vb);
        i += 8;
    }
    if i < n {
        acc[1] = acc[1].fma(load_tail(&a[i..]), load_tail(&b[i..]));
    }
    acc[0].add(acc[1]).add(acc[2].add(acc[3])).hsum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes(v: F8) -> [f32; 8] {
        let mut out = [0f32; 8];
        // SAFETY: floats 0..4 of the 8 writable ones.
        unsafe { vst1q_f32(out.as_mut_ptr(), v.0) };
        // SAFETY: floats 4..8.
        unsafe { vst1q_f32(out.as_mut_ptr().wrapping_add(4), v.1) };
        out
    }

    /// Every byte value in every position of a group decodes to the E2M1 values of its two
    /// nibbles, in the lanes the `[8 even | 8 odd]` activation blocks pair with.
    #[test]
    fn decode_group_gives_each_nibbles_e2m1_value_in_its_columns_lane() {
        // SAFETY: NEON is part of every aarch64 CPU.
        let t = unsafe { E2m1Tables::new() };
        for start in 0..16u32 {
            let group: [u8; 16] = std::array::from_fn(|i| (start + 16 * i as u32) as u8);
            // SAFETY: 16 readable bytes.
            let w = unsafe { decode_group(group.as_ptr(), t) };
            for col in 0..32 {
                let b = group[col / 2];
                let code = if col % 2 == 0 { b & 15 } else { b >> 4 };
                let (k, i) = ((col / 16) * 2 + col % 2, (col % 16) / 2);
                assert_eq!(
                    lanes(w[k])[i].to_bits(),
                    E2M1[code as usize].to_bits(),
                    "byte {b:#04x}, column {col}"
                );
            }
        }
    }

    /// The lane sum is the AVX2 tier's tree, not any other order: values chosen so that each
    /// association gives different bits.
    #[test]
    fn hsum_is_the_avx2_tree() {
        let v = [1e8f32, 1.0, -1e8, 3.0, 0.5, 7.0, 0.25, -2.0];
        // SAFETY: 8 readable floats.
        let f = unsafe { F8::load(v.as_ptr()) };
        let s: Vec<f32> = (0..4).map(|i| v[i] + v[i + 4]).collect();
        let want = (s[0] + s[2]) + (s[1] + s[3]);
        // SAFETY: NEON is part of every aarch64 CPU.
        let got = unsafe { f.hsum() };
        assert_eq!(got.to_bits(), want.to_bits());
        let naive: f32 = v.iter().sum();
        assert_ne!(
            naive.to_bits(),
            want.to_bits(),
            "the test values do not tell orders apart"
        );
    }
}
