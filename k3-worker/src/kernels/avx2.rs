//! AVX2 + FMA tier: 8 f32 lanes.
//!
//! * bf16 dot: 16 weights (one 32-byte load, eight u32 lanes of two bf16 each) are widened
//!   exactly by two integer ops: `lane << 16` is the even column's f32, `lane & 0xFFFF_0000` the
//!   odd column's. Activations arrive per 16 columns as `[8 even | 8 odd]` (the last
//!   `cols mod 16` columns stay in order; see `split_even_odd_rows`), so no weight shuffle is
//!   needed. After the 16-column blocks, one 8-column step (zero-extend + shift) and the
//!   zero-padded last `< 8` columns complete the row. Each (row, token) pair has one
//!   accumulator; it is reduced across lanes in a fixed tree.
//! * bf16 blocking: a single token (decode) is dotted with 8 rows at once, so each activation
//!   vector is loaded once per 8 rows (the kernel then runs at memory bandwidth instead of being
//!   bound by activation loads); `TOKEN_BLOCK` tokens are dotted with 4 rows at once.
//! * MXFP4 dot: a group's 16 packed bytes become its 32 weights by byte lookups: one shuffle
//!   puts each lane's nibble in place, and two 16-entry `vpshufb` tables give the two high bytes
//!   of its f32 (every E2M1 value is a bf16), unpacked into 4 vectors of 8 f32 (12 integer ops
//!   per group, where 8-lane `vpermps` lookups with a separate sign took 20). Activations arrive
//!   per 16 columns as `[8 even | 8 odd]` (see `split_even_odd_rows`). A group's 32 products
//!   are summed in 8 lanes, scaled by `2^(s−127)` and added to one of two accumulators
//!   (even/odd groups).
//! * matmul: each loaded weight vector is used for `TOKEN_BLOCK` tokens at once; every token
//!   has its own accumulators and the same operation sequence as one token alone, so matmul ==
//!   matvec bit for bit. Token blocks are the outer loop over a task's rows (which stay in L2),
//!   so the weights come from memory once and the activations of a block stay in L1/L2.

use std::arch::x86_64::*;

use k3_proto::ecbf16::{self, CodedMatrix};

use super::scalar::{E2M1, E8M0_TABLE};
use super::tile::{self, Bf16Blocks, Lanes, Mxfp4Groups};

/// Tokens dotted with one loaded weight vector at a time (matmul; MXFP4 and bf16).
const TOKEN_BLOCK: usize = 2;
/// bf16 rows per block for a single token (decode): each activation vector is loaded once per
/// 8 rows; 8 accumulators + 2 activation + 2 weight vectors fit the 16 ymm registers.
const MATVEC_ROWS: usize = 8;
/// bf16 rows per block with `TOKEN_BLOCK` tokens: 4 × 2 accumulators + 4 activation vectors.
const MATMUL_ROWS: usize = 4;

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

/// Loads 32 bytes at `p`.
///
/// # Safety
/// 32 bytes at `p` are readable; the CPU supports AVX.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_bytes32(p: *const u8) -> __m256i {
    // SAFETY: 32 readable bytes at p (caller contract); unaligned load.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// Loads 64 bytes at `p` as two vectors.
///
/// # Safety
/// 64 bytes at `p` are readable; the CPU supports AVX.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_raw64(p: *const u8) -> [__m256i; 2] {
    // SAFETY: the first 32 of the 64 readable bytes.
    let a = unsafe { load_bytes32(p) };
    // SAFETY: the last 32.
    let b = unsafe { load_bytes32(p.wrapping_add(32)) };
    [a, b]
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
// bf16 rows: raw or EC-BF16 coded

/// A bf16 matrix's rows as this tier reads them: whole 32-column blocks as raw bf16 vectors
/// (decoded in registers for a coded matrix), and the bytes after the last whole block.
pub(super) trait Rows {
    /// Columns.
    fn cols(&self) -> usize;
    /// Rows.
    fn rows(&self) -> usize;
    /// Raw bf16 of whole block `b` of row `i`: columns `32b .. 32b+16` and `32b+16 .. 32b+32`.
    ///
    /// # Safety
    /// `i < rows`, `32b + 32 <= cols`; AVX2.
    unsafe fn block(&self, i: usize, b: usize) -> [__m256i; 2];
    /// Raw bf16 bytes of row `i` from column `32·⌊cols/32⌋` to the end (`buf` as scratch).
    fn rest<'s>(&'s self, i: usize, buf: &'s mut [u8; 64]) -> &'s [u8];
    /// Asks the cache for row `i`'s bytes ahead of their use (see [`short_row_ahead`]); `i`
    /// may lie past the last row (a prefetch is a hint and never faults). A no-op by default.
    #[inline]
    fn prefetch_row(&self, _i: usize) {}
}

/// Hints the cache to fetch the `bytes` bytes at `p`, one 64-byte line at a time, spread out:
/// `black_box` keeps the loop from being unrolled into a burst of back-to-back prefetches,
/// which the CPU served worse (see [`short_row_ahead`]).
#[inline(never)]
fn prefetch_lines(p: *const u8, bytes: usize) {
    for o in (0..bytes).step_by(64) {
        let o = std::hint::black_box(o);
        // SAFETY: SSE is part of every x86-64 CPU; a prefetch only hints the cache, never
        // faults and reads nothing the program sees, whatever the address (the pointer is
        // formed with `wrapping_add` and not dereferenced).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o) as *const i8) };
    }
}

/// Rows of at most this many bytes are "short" for the multi-token blocks' prefetch.
const SHORT_ROW_BYTES: usize = 1024;
/// How many rows ahead the multi-token blocks prefetch short rows (4 KB at 256 columns).
const PREFETCH_ROWS: usize = 8;

/// Rows ahead to prefetch for a block of `T` tokens over rows of `cols` bf16: `PREFETCH_ROWS`
/// for short rows and more than one token, else 0 (none).
///
/// Why: a block of R rows reads them interleaved, 64 bytes of each in turn, and each row's load
/// is its own instruction. A short row (`small`'s lm_head: 163840 × 256, 512 bytes a row) ends
/// after 8 such loads, too few for the CPU's stride prefetcher to follow, so the 4-token block
/// waited on its weight loads (`perf annotate`: most samples on the instruction after each
/// row's load): `small`'s lm_head over 4 tokens took ~3× its one-token time on one Zen 4 thread,
/// where one token reads one row at a time, a single sequential stream. Long rows train the
/// prefetcher within the row. How the requests are issued mattered as much as issuing them
/// (`k3-worker --batch` of 4 × 160 ids on `small`, `--threads 1`, user CPU under load, same
/// runs): no prefetch 3.0 s; the 32 lines of a row block inlined and unrolled into one burst
/// 2.6 s; a row's 8 lines a call ([`prefetch_lines`] out of line) 2.1 s; the same with the loop
/// kept rolled, one line an iteration, 1.7 s.
#[inline]
pub(super) fn short_row_ahead(cols: usize, tokens: usize) -> usize {
    if tokens > 1 && 2 * cols <= SHORT_ROW_BYTES {
        PREFETCH_ROWS
    } else {
        0
    }
}

/// Raw bf16 rows (`2·cols` bytes each).
pub(super) struct RawRows<'a> {
    w: &'a [u8],
    cols: usize,
}

impl<'a> RawRows<'a> {
    pub(super) fn new(w: &'a [u8], cols: usize) -> RawRows<'a> {
        assert!(
            cols > 0 && w.len().is_multiple_of(2 * cols),
            "bf16 rows: partial row"
        );
        RawRows { w, cols }
    }

    /// The first byte of block `b` of row `i` (not checked: `Rows::block`'s contract).
    pub(super) fn block_ptr(&self, i: usize, b: usize) -> *const u8 {
        self.w.as_ptr().wrapping_add(2 * (i * self.cols + 32 * b))
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
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block(&self, i: usize, b: usize) -> [__m256i; 2] {
        let p = self.block_ptr(i, b);
        // SAFETY: row i has 2·cols bytes and 32b + 32 <= cols (caller contract).
        unsafe { load_raw64(p) }
    }
    fn rest<'s>(&'s self, i: usize, _buf: &'s mut [u8; 64]) -> &'s [u8] {
        let rb = 2 * self.cols;
        &self.w[i * rb + 2 * (self.cols / 32 * 32)..(i + 1) * rb]
    }
    #[inline]
    fn prefetch_row(&self, i: usize) {
        let rb = 2 * self.cols;
        prefetch_lines(self.w.as_ptr().wrapping_add(i * rb), rb);
    }
}

/// Rows `r0 ..` of an EC-BF16 matrix with index width `W` (k3_proto::ecbf16).
pub(super) struct CodedRows<'a, const W: u8> {
    m: CodedMatrix<'a>,
    r0: usize,
    k: usize,
    table: __m256i,
    /// Rows `r0 .. r0+k`'s blocks, `stride` bytes a row (addressed without a bounds check per
    /// block: `Rows::block`'s contract keeps the address inside).
    blocks: &'a [u8],
    stride: usize,
}

impl<'a, const W: u8> CodedRows<'a, W> {
    /// Rows `r0 .. r0+k` of `m` (whose width must be `W`).
    #[inline]
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn new(m: CodedMatrix<'a>, r0: usize, k: usize) -> CodedRows<'a, W> {
        assert!(
            m.width() == W && r0 + k <= m.rows() && m.cols() > 0,
            "coded rows"
        );
        let t = m.table();
        // SAFETY: 16 readable bytes.
        let t = unsafe { _mm_loadu_si128(t.as_ptr() as *const __m128i) };
        let stride = m.row_stride();
        CodedRows {
            m,
            r0,
            k,
            table: _mm256_broadcastsi128_si256(t),
            blocks: &m.blocks()[r0 * stride..(r0 + k) * stride],
            stride,
        }
    }
}

/// Per 32-bit lane `d` of a broadcast `k`-bit index section, the right shift `k·⌊d/k⌋` that
/// brings positions `4d .. 4d+4`'s fields to the bottom of their bytes (SPEC §6.13).
const fn section_shifts(k: i32) -> [i32; 8] {
    let mut s = [0i32; 8];
    let mut d = 0;
    while d < 8 {
        s[d] = k * (d as i32 / k);
        d += 1;
    }
    s
}
const SHIFT4: [i32; 8] = section_shifts(4);
const SHIFT2: [i32; 8] = section_shifts(2);
const SHIFT1: [i32; 8] = section_shifts(1);

/// The `W`-bit indices of the 32 positions of one block (index area at `p`), one per byte.
///
/// # Safety
/// `4·W` bytes at `p` are readable; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_indices<const W: u8>(p: *const u8) -> __m256i {
    let shifts = |s: &[i32; 8]| {
        // SAFETY: 8 readable i32.
        unsafe { _mm256_loadu_si256(s.as_ptr() as *const __m256i) }
    };
    let two_bit = |p: *const u8| {
        // SAFETY: 8 readable bytes at p (caller contract).
        let q = unsafe { std::ptr::read_unaligned(p as *const i64) };
        _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi64x(q), shifts(&SHIFT2)),
            _mm256_set1_epi8(3),
        )
    };
    match W {
        4 => {
            // SAFETY: 16 readable bytes at p (caller contract).
            let v = unsafe { _mm_loadu_si128(p as *const __m128i) };
            _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_broadcastsi128_si256(v), shifts(&SHIFT4)),
                _mm256_set1_epi8(15),
            )
        }
        3 => {
            // SAFETY: bytes 8..12 of the 12 readable ones (caller contract).
            let d = unsafe { std::ptr::read_unaligned(p.wrapping_add(8) as *const i32) };
            let hi = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32(d), shifts(&SHIFT1)),
                _mm256_set1_epi8(1),
            );
            _mm256_or_si256(two_bit(p), _mm256_slli_epi32::<2>(hi))
        }
        _ => two_bit(p),
    }
}

/// Decodes one EC-BF16 block at `p` into its raw bf16 (columns 0–15, 16–31) by one palette
/// lookup (`vpshufb`) and two byte unpacks; also returns whether any position is escaped.
///
/// # Safety
/// `32 + 4·W` bytes at `p` are readable; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn decode_coded_block<const W: u8>(
    p: *const u8,
    table: __m256i,
) -> ([__m256i; 2], bool) {
    // SAFETY: 32 low bytes then 4W index bytes at p (caller contract).
    let lows = unsafe { load_bytes32(p) };
    // SAFETY: as above.
    let idx = unsafe { block_indices::<W>(p.wrapping_add(32)) };
    let hb = _mm256_shuffle_epi8(table, idx);
    let esc = _mm256_cmpeq_epi8(idx, _mm256_set1_epi8(ecbf16::escape_code(W) as i8));
    (
        [
            _mm256_unpacklo_epi8(lows, hb),
            _mm256_unpackhi_epi8(lows, hb),
        ],
        _mm256_movemask_epi8(esc) != 0,
    )
}

/// Writes the escaped high bytes of block `b` of row `r` into its decoded raw bytes.
#[cold]
#[inline(never)]
pub(super) fn patch_escapes(m: &CodedMatrix<'_>, r: usize, b: usize, raw: &mut [u8; 64]) {
    for (c, hb) in m.row_escapes(r).in_cols(32 * b, 32 * b + 32) {
        raw[2 * (c - 32 * b) + 1] = hb;
    }
}

impl<const W: u8> Rows for CodedRows<'_, W> {
    fn cols(&self) -> usize {
        self.m.cols()
    }
    fn rows(&self) -> usize {
        self.k
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block(&self, i: usize, b: usize) -> [__m256i; 2] {
        let at = i * self.stride + b * ecbf16::block_bytes(W);
        let p = self.blocks.as_ptr().wrapping_add(at);
        // SAFETY: i < k and block b is whole (caller contract), so its 32 + 4W bytes lie in
        // row i of `blocks`.
        let (raw, escaped) = unsafe { decode_coded_block::<W>(p, self.table) };
        if !escaped {
            return raw;
        }
        let mut buf = [0u8; 64];
        // SAFETY: 64 writable bytes.
        unsafe { _mm256_storeu_si256(buf.as_mut_ptr() as *mut __m256i, raw[0]) };
        // SAFETY: as above.
        unsafe { _mm256_storeu_si256(buf[32..].as_mut_ptr() as *mut __m256i, raw[1]) };
        patch_escapes(&self.m, self.r0 + i, b, &mut buf);
        // SAFETY: 64 readable bytes.
        unsafe { load_raw64(buf.as_ptr()) }
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

/// `R` rows dotted with `T` tokens at once: `out[i][t] = Σ_c W[row i, c]·x[token t, c]`, with
/// each token's activations in the `split_even_odd_rows` layout (blocks of 16).
///
/// Every (row, token) pair has ONE accumulator vector and this sequence of FMAs into it: per
/// 16-column block the even columns then the odd columns (lane `l` takes columns `2l` and
/// `2l+1` of the block), then at most one 8-column step (lane `l` = column `l`), then the
/// zero-padded last `< 8` columns; the lanes are reduced by `hsum`. The sequence does not depend
/// on `R`, `T` or the row source (raw or coded rows give the same raw bf16), so any blocking
/// gives the same bits (matmul == matvec, coded == raw); the blocking only decides how often each
/// weight vector and each activation vector is loaded.
///
/// # Safety
/// The rows exist in `src`; each `x[t]` has `cols` floats; AVX2 + FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_block<S: Rows, const R: usize, const T: usize>(
    src: &S,
    rows: [usize; R],
    x: [&[f32]; T],
) -> [[f32; T]; R] {
    let cols = src.cols();
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for b in 0..cols / 32 {
        // SAFETY: 32b + 32 <= cols: floats 32b .. 32b+32 of every token are in bounds.
        let xv: [[__m256; 4]; T] =
            std::array::from_fn(|t| unsafe { load32(x[t][32 * b..].as_ptr()) });
        for i in 0..R {
            // SAFETY: row rows[i] exists and block b is whole.
            let v = unsafe { src.block(rows[i], b) };
            for t in 0..T {
                acc[i][t] = fma_raw32(v, xv[t], acc[i][t]);
            }
        }
    }
    let mut bufs = [[0u8; 64]; R];
    let mut rest: [&[u8]; R] = [&[]; R];
    for ((i, buf), r) in bufs.iter_mut().enumerate().zip(rest.iter_mut()) {
        *r = src.rest(rows[i], buf);
    }
    let c0 = cols / 32 * 32;
    finish(&mut acc, rest, x, c0, cols);
    let mut out = [[0.0f32; T]; R];
    for i in 0..R {
        for t in 0..T {
            out[i][t] = hsum(acc[i][t]);
        }
    }
    out
}

/// The FMAs of one 32-column block into one accumulator: the two 16-column halves, each even
/// columns then odd columns.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn fma_raw32(v: [__m256i; 2], x: [__m256; 4], acc: __m256) -> __m256 {
    let w = widen_raw32(v);
    let mut a = acc;
    for j in 0..4 {
        a = _mm256_fmadd_ps(w[j], x[j], a);
    }
    a
}

/// Two raw 16-column vectors widened exactly: `[even 0–15, odd 0–15, even 16–31, odd 16–31]`
/// (`lane << 16` is the even column's f32, `lane & 0xFFFF_0000` the odd column's).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn widen_raw32(v: [__m256i; 2]) -> [__m256; 4] {
    let odd = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    [
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v[0])),
        _mm256_castsi256_ps(_mm256_and_si256(v[0], odd)),
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v[1])),
        _mm256_castsi256_ps(_mm256_and_si256(v[1], odd)),
    ]
}

/// The columns `c0 .. cols` (`c0` a multiple of 32, `rest[i]` row `i`'s raw bytes from `c0`):
/// at most one 16-column block, one 8-column step and the zero-padded tail, as in `dot_block`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn finish<const R: usize, const T: usize>(
    acc: &mut [[__m256; T]; R],
    rest: [&[u8]; R],
    x: [&[f32]; T],
    c0: usize,
    cols: usize,
) {
    let odd = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let mut c = c0;
    if c + 16 <= cols {
        // SAFETY: c + 16 <= cols: floats c .. c+16 of every token are in bounds.
        let xe: [__m256; T] = std::array::from_fn(|t| unsafe { load8(x[t][c..c + 8].as_ptr()) });
        // SAFETY: as above.
        let xo: [__m256; T] =
            std::array::from_fn(|t| unsafe { load8(x[t][c + 8..c + 16].as_ptr()) });
        for i in 0..R {
            let w = &rest[i][2 * (c - c0)..2 * (c - c0 + 16)];
            // SAFETY: `w` is 32 bytes.
            let v = unsafe { load_bytes32(w.as_ptr()) };
            let we = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
            let wo = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
            for t in 0..T {
                acc[i][t] = _mm256_fmadd_ps(we, xe[t], acc[i][t]);
                acc[i][t] = _mm256_fmadd_ps(wo, xo[t], acc[i][t]);
            }
        }
        c += 16;
    }
    if c + 8 <= cols {
        // SAFETY: c + 8 <= cols: floats c .. c+8 of every token are in bounds.
        let xv: [__m256; T] = std::array::from_fn(|t| unsafe { load8(x[t][c..c + 8].as_ptr()) });
        for i in 0..R {
            let w = &rest[i][2 * (c - c0)..2 * (c - c0 + 8)];
            // SAFETY: `w` is 16 bytes.
            let wv = unsafe { widen8(w.as_ptr()) };
            for t in 0..T {
                acc[i][t] = _mm256_fmadd_ps(wv, xv[t], acc[i][t]);
            }
        }
        c += 8;
    }
    if c < cols {
        let xv: [__m256; T] = std::array::from_fn(|t| load_tail(&x[t][c..cols]));
        for i in 0..R {
            let wv = widen_tail(&rest[i][2 * (c - c0)..2 * (cols - c0)]);
            for t in 0..T {
                acc[i][t] = _mm256_fmadd_ps(wv, xv[t], acc[i][t]);
            }
        }
    }
}

/// Rows `r0 .. r0+R` of `src` × tokens `t0 .. t0+T` (of `x [n, cols]`) into `out [k, n]`.
///
/// # Safety
/// AVX2 + FMA. (The slicing below checks that the rows, tokens and outputs exist.)
#[inline]
#[target_feature(enable = "avx2,fma")]
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
/// AVX2 + FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn bf16_tokens<S: Rows, const R: usize, const T: usize>(
    src: &S,
    x: &[f32],
    n: usize,
    t0: usize,
    out: &mut [f32],
) {
    let k = src.rows();
    let ahead = short_row_ahead(src.cols(), T);
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

impl<S: Rows> Bf16Blocks<Avx2> for S {
    fn cols(&self) -> usize {
        Rows::cols(self)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn widened(&self, i: usize, b: usize) -> [__m256; 4] {
        // SAFETY: the caller's contract is `block`'s.
        widen_raw32(unsafe { self.block(i, b) })
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn finish(&self, i: usize, acc: __m256, x: &[f32]) -> f32 {
        let cols = Rows::cols(self);
        let mut buf = [0u8; 64];
        let mut a = [[acc]];
        finish(&mut a, [self.rest(i, &mut buf)], [x], cols / 32 * 32, cols);
        hsum(a[0][0])
    }
}

/// Row kernel over any row source: `out [k, n]` for its `k` rows; `x [n, cols]` with each
/// token's columns in the `split_even_odd_rows` layout (blocks of 16). More than
/// `TOKEN_BLOCK` tokens take the strip kernel (`tile`): each weight decoded once for all tokens.
///
/// # Safety
/// AVX2 + FMA. (Lengths are checked here.)
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_kernel<S: Rows>(src: &S, x: &[f32], n: usize, out: &mut [f32], strips: bool) {
    let (cols, k) = (src.cols(), src.rows());
    assert!(cols > 0 && n > 0, "empty bf16 product");
    assert_eq!(out.len(), k * n, "bf16 rows vs output");
    assert_eq!(x.len(), n * cols, "bf16 rows input");
    if strips && n > TOKEN_BLOCK {
        // SAFETY: lengths checked above; CPU features are this function's contract.
        unsafe { tile::bf16_strips::<Avx2, S, MATMUL_ROWS, TOKEN_BLOCK>(src, k, x, n, out) };
        return;
    }
    // Token blocks outer, rows inner: the task's rows stay in L2 while every token block passes
    // over them, and each token block's activations stay in L1/L2.
    let mut t = 0;
    while t + TOKEN_BLOCK <= n {
        // SAFETY: tokens t .. t+TOKEN_BLOCK lie in x (lengths checked above); CPU features are
        // this function's contract.
        unsafe { bf16_tokens::<S, MATMUL_ROWS, TOKEN_BLOCK>(src, x, n, t, out) };
        t += TOKEN_BLOCK;
    }
    if t < n && cols <= super::scalar::NARROW_COLS {
        // SAFETY: as above, for the last token of narrow rows: one row at a time.
        unsafe { bf16_tokens::<S, 1, 1>(src, x, n, t, out) };
    } else if t < n {
        // SAFETY: as above, for the last token (all of a matvec).
        unsafe { bf16_tokens::<S, MATVEC_ROWS, 1>(src, x, n, t, out) };
    }
}

/// Row kernel: `out [k, n]` for the `k = w.len() / (2·cols)` rows in `w`.
///
/// # Safety
/// The CPU supports AVX2 and FMA. (The shape is checked by the caller, `kernels::quant`.)
#[target_feature(enable = "avx2,fma")]
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
/// The CPU supports AVX2 and FMA. (The shape is checked by the caller, `kernels::quant`.)
#[target_feature(enable = "avx2,fma")]
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
#[target_feature(enable = "avx2,fma")]
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

/// Entry `k` (and `k + 16`, for the second 128-bit lane) is the high (`shift` 24) or second
/// (`shift` 16) byte of the f32 of E2M1 code `k`: every E2M1 value is a bf16, so its f32 is these
/// two bytes followed by two zero bytes.
const fn e2m1_byte_table(shift: u32) -> [i8; 32] {
    let mut t = [0i8; 32];
    let mut k = 0;
    while k < 32 {
        t[k] = ((E2M1[k % 16].to_bits() >> shift) & 0xFF) as u8 as i8;
        k += 1;
    }
    t
}
const E2M1_B3: [i8; 32] = e2m1_byte_table(24);
const E2M1_B2: [i8; 32] = e2m1_byte_table(16);

/// One group's 32 weights (16 packed bytes at `p`) as the four vectors the activations'
/// `[8 even | 8 odd]` blocks pair with: columns 0, 2, …, 14; 1, 3, …, 15; 16, …, 30;
/// 17, …, 31 (the values and lanes the former 8-lane `vpermps` lookup gave, so the products are
/// the same bits), from byte lookups: each lane's nibble is moved into place by one byte
/// shuffle, and two 16-entry `vpshufb` tables give the two high bytes of its f32 (an E2M1 value
/// is a bf16).
///
/// # Safety
/// 16 bytes at `p` are readable; the CPU supports AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn decode_group(p: *const u8) -> [__m256; 4] {
    // SAFETY: 16 readable bytes at p (caller contract).
    let v = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(p as *const __m128i) });
    // Lane 0 takes bytes 0-3 and 8-11, lane 1 bytes 4-7 and 12-15, each twice: first for its
    // low nibble (even column), then for its high nibble (odd column).
    let pick = _mm256_setr_epi8(
        0, 1, 2, 3, 0, 1, 2, 3, 8, 9, 10, 11, 8, 9, 10, 11, //
        4, 5, 6, 7, 4, 5, 6, 7, 12, 13, 14, 15, 12, 13, 14, 15,
    );
    let high = _mm256_setr_epi8(
        0, 0, 0, 0, -1, -1, -1, -1, 0, 0, 0, 0, -1, -1, -1, -1, //
        0, 0, 0, 0, -1, -1, -1, -1, 0, 0, 0, 0, -1, -1, -1, -1,
    );
    let u = _mm256_shuffle_epi8(v, pick);
    let codes = _mm256_and_si256(
        _mm256_blendv_epi8(u, _mm256_srli_epi16::<4>(u), high),
        _mm256_set1_epi8(0x0F),
    );
    // SAFETY: the table is 32 bytes.
    let t3 = unsafe { _mm256_loadu_si256(E2M1_B3.as_ptr() as *const __m256i) };
    // SAFETY: as above.
    let t2 = unsafe { _mm256_loadu_si256(E2M1_B2.as_ptr() as *const __m256i) };
    let (b3, b2) = (
        _mm256_shuffle_epi8(t3, codes),
        _mm256_shuffle_epi8(t2, codes),
    );
    // bf16 words (low byte b2, high byte b3), then each word in the high half of a 32-bit lane.
    let (lo, hi) = (_mm256_unpacklo_epi8(b2, b3), _mm256_unpackhi_epi8(b2, b3));
    let z = _mm256_setzero_si256();
    [
        _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, lo)),
        _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, lo)),
        _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, hi)),
        _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, hi)),
    ]
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
    acc: &mut [__m256; T],
) {
    let p = packed.as_ptr().wrapping_add(16 * g);
    // SAFETY: bytes 16g .. 16g+16 lie in `packed` (caller contract).
    let w = unsafe { decode_group(p) };
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

/// How far ahead of the group being decoded the MXFP4 kernel asks for its weights.
const MXFP4_PREFETCH: usize = 4096;

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
    let mut acc0 = [_mm256_setzero_ps(); T];
    let mut acc1 = [_mm256_setzero_ps(); T];
    let mut g = 0;
    let base = pr.as_ptr();
    while g + 2 <= groups {
        // A hint, not a read: the weights `MXFP4_PREFETCH` bytes on (the next rows of the
        // task, contiguous after this one), so memory latency overlaps the decode.
        _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(16 * g + MXFP4_PREFETCH) as *const i8);
        // SAFETY: g < groups; packed, scales and every token slice hold all groups.
        unsafe { mxfp4_group::<T>(pr, sr[g], &xs, g, &mut acc0) };
        // SAFETY: g + 1 < groups, as above.
        unsafe { mxfp4_group::<T>(pr, sr[g + 1], &xs, g + 1, &mut acc1) };
        g += 2;
    }
    if g < groups {
        // SAFETY: g < groups, as above.
        unsafe { mxfp4_group::<T>(pr, sr[g], &xs, g, &mut acc0) };
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
/// The CPU supports AVX2 and FMA. (The shape is checked by the caller, `kernels::quant`.)
#[target_feature(enable = "avx2,fma")]
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
        };
        // SAFETY: lengths checked above; CPU features are this function's contract.
        unsafe {
            tile::mxfp4_strips::<Avx2, _, MXFP4_TILE_ROWS, MXFP4_TILE_TOKENS>(&src, k, x, n, out)
        };
        return;
    }
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

/// MXFP4 strip tiles (more than `TOKEN_BLOCK` tokens): 1 row × 4 tokens of accumulator pairs,
/// partial sums and activations fit the 16 registers.
const MXFP4_TILE_ROWS: usize = 1;
const MXFP4_TILE_TOKENS: usize = 4;

/// An MXFP4 task's rows for the strip kernel.
struct Mxfp4Rows<'a> {
    packed: &'a [u8],
    scales: &'a [u8],
    cols: usize,
}

impl Mxfp4Groups<Avx2> for Mxfp4Rows<'_> {
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn group(&self, i: usize, g: usize) -> ([__m256; 4], __m256) {
        let at = i * self.cols / 2 + 16 * g;
        let p = self.packed[at..at + 16].as_ptr();
        // SAFETY: 16 readable bytes.
        let w = unsafe { decode_group(p) };
        (
            w,
            _mm256_set1_ps(E8M0_TABLE[self.scales[i * self.cols / 32 + g] as usize]),
        )
    }
}

/// This tier's vector for the strip kernels.
#[derive(Clone, Copy)]
pub(super) struct Avx2;

impl Lanes for Avx2 {
    type F = __m256;
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: the CPU supports the tier (caller contract); inlined into the
        // tier's `#[target_feature]` entry point.
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: 8 readable floats (caller contract).
        unsafe { load8(p) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: the CPU supports the tier (caller contract); inlined into the
        // tier's `#[target_feature]` entry point.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the CPU supports the tier (caller contract); inlined into the
        // tier's `#[target_feature]` entry point.
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn hsum_pair(a: __m256, b: __m256) -> f32 {
        // SAFETY: the CPU supports the tier (caller contract); inlined into the
        // tier's `#[target_feature]` entry point.
        let sum = unsafe { _mm256_add_ps(a, b) };
        // SAFETY: as above.
        unsafe { hsum(sum) }
    }
}

// ------------------------------------------------------------------------------------------
// FMA peak

/// Independent FMA chains of the probe: 12 cover the FMA latency on two ports (4 cycles × 2)
/// and, with the two constants, fit the 16 ymm registers AVX2 has (16 chains spilled one
/// accumulator a round: on a Zen 4 the probe read half the FMA peak, below what the bf16
/// kernel reached).
pub(super) const FMA_PROBE_CHAINS: usize = 12;

/// `iters` rounds of `FMA_PROBE_CHAINS` independent FMA chains: `FMA_PROBE_CHAINS·8·iters`
/// multiply-adds; returns their sum so nothing is optimised away.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn fma_probe(iters: usize, seed: f32) -> f32 {
    let (m, a) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    let mut acc = [_mm256_setzero_ps(); FMA_PROBE_CHAINS];
    for (i, v) in acc.iter_mut().enumerate() {
        *v = _mm256_set1_ps(seed + i as f32);
    }
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm256_fmadd_ps(*v, m, a);
        }
    }
    acc.iter().map(|&v| hsum(v)).sum()
}

// ------------------------------------------------------------------------------------------
// F32 row narrowing

/// Narrows a little-endian F32 row to bf16 (each value's high half, in order) into `out`, 16
/// values a step, the rest one at a time; true when every value's low half is zero (the
/// narrowing is exact). The same bytes and answer as `scalar::narrow_f32_row`.
///
/// # Safety
/// The CPU supports AVX2. (Lengths are checked here.)
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn narrow_f32_row(row: &[u8], out: &mut [u8]) -> bool {
    assert_eq!(row.len(), 2 * out.len(), "f32 row and its bf16 narrowing");
    let main = row.len() / 64 * 64;
    let low_half = _mm256_set1_epi32(0xffff);
    let mut low = _mm256_setzero_si256();
    for (src, dst) in row[..main].chunks_exact(64).zip(out.chunks_exact_mut(32)) {
        // SAFETY: `src` is 64 readable bytes (chunks_exact); AVX2 is this function's contract.
        let [a, b] = unsafe { load_raw64(src.as_ptr()) };
        low = _mm256_or_si256(low, _mm256_and_si256(_mm256_or_si256(a, b), low_half));
        // High halves (≤ 0xffff, so the unsigned saturation keeps them), packed per 128-bit
        // lane as [a0-3, b0-3 | a4-7, b4-7], then put back in order.
        let packed = _mm256_packus_epi32(_mm256_srli_epi32::<16>(a), _mm256_srli_epi32::<16>(b));
        let ordered = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
        // SAFETY: `dst` is 32 writable bytes (chunks_exact); unaligned store.
        unsafe { _mm256_storeu_si256(dst.as_mut_ptr() as *mut __m256i, ordered) };
    }
    let mut exact = _mm256_testz_si256(low, low) == 1;
    for (d, b) in out[main / 2..]
        .chunks_exact_mut(2)
        .zip(row[main..].chunks_exact(4))
    {
        d.copy_from_slice(&b[2..4]);
        exact &= b[0] | b[1] == 0;
    }
    exact
}

// f32 dot

/// `Σ a[i]·b[i]`: four accumulators over 32-element steps, 8-element steps into accumulator 0,
/// the zero-padded rest into accumulator 1.
///
/// # Safety
/// The CPU supports AVX2 and FMA. (The shape is checked by the caller, `kernels::quant`.)
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

// ------------------------------------------------------------------------------------------
// int8 / int4 quantized matrices (`k3_proto::quant`): the scalar twin's sequence
// (`scalar::q8_dot`, `scalar::q4_dot`) with its lanes in ymm registers, so every (row, token) is
// the twin's bits. int8: the 32 lanes in four accumulators (lanes 0–7, 8–15, 16–23, 24–31),
// reduced as the twin halves (`(a0 + a2) + (a1 + a3)`, then `hsum`) and times the row's scale.
// int4: the 16 lanes in two accumulators, added and `hsum`med; a group's nibbles split with
// byte masks and converted exactly (`q − 8`).

/// Loads 8 bytes at `p` sign-extended to 8 f32 lanes.
///
/// # Safety
/// 8 bytes at `p` are readable; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn i8x8(p: *const u8) -> __m256 {
    // SAFETY: 8 readable bytes at p (caller contract); unaligned 64-bit load.
    let b = unsafe { _mm_loadl_epi64(p as *const __m128i) };
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))
}

/// `R` int8 rows (`codes[r]`: `cols` bytes) × `T` tokens (`x[t]`: `cols` floats): each pair's
/// unscaled lane sum.
///
/// # Safety
/// Lengths as stated (asserted); AVX2 + FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
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
    let mut acc = [[[_mm256_setzero_ps(); 4]; T]; R];
    for b in 0..cols / 32 {
        #[allow(clippy::needless_range_loop)] // j names the lane block of every accumulator
        for j in 0..4 {
            let c = 32 * b + 8 * j;
            // SAFETY: c + 8 <= cols floats of each token (asserted lengths).
            let xv: [__m256; T] =
                std::array::from_fn(|t| unsafe { load8(x[t].as_ptr().wrapping_add(c)) });
            for r in 0..R {
                // SAFETY: c + 8 <= cols bytes of each row (asserted lengths).
                let w = unsafe { i8x8(codes[r].as_ptr().wrapping_add(c)) };
                for t in 0..T {
                    acc[r][t][j] = _mm256_fmadd_ps(w, xv[t], acc[r][t][j]);
                }
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            let [a0, a1, a2, a3] = acc[r][t];
            let s = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
            out[r][t] = hsum(s);
        }
    }
    out
}

/// A group's 16 nibble pairs (16 bytes at `p`) as `q − 8` floats: `[lo 0–7, lo 8–15, hi 0–7,
/// hi 8–15]`.
///
/// # Safety
/// 16 bytes at `p` are readable; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn q4_group(p: *const u8) -> [__m256; 4] {
    // SAFETY: 16 readable bytes at p (caller contract).
    let b = unsafe { _mm_loadu_si128(p as *const __m128i) };
    let mask = _mm_set1_epi8(15);
    let lo = _mm_and_si128(b, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), mask);
    let eight = _mm256_set1_ps(8.0);
    let f = |v: __m128i| _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), eight);
    [
        f(lo),
        f(_mm_srli_si128::<8>(lo)),
        f(hi),
        f(_mm_srli_si128::<8>(hi)),
    ]
}

/// `R` int4 rows (`codes[r]`: `cols/2` bytes, `scales[r]`: `cols/32` f32) × `T` tokens (`x[t]`:
/// `cols` floats split per 32 as `[16 even | 16 odd]`).
///
/// # Safety
/// Lengths as stated (asserted); AVX2 + FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
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
    let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
    for g in 0..groups {
        // SAFETY: 32g + 32 <= cols floats of each token (asserted lengths).
        let xv: [[__m256; 4]; T] =
            std::array::from_fn(|t| unsafe { load32(x[t].as_ptr().wrapping_add(32 * g)) });
        for r in 0..R {
            // SAFETY: 16g + 16 <= 16·groups bytes of each row (asserted lengths).
            let [lo0, lo1, hi0, hi1] = unsafe { q4_group(codes[r].as_ptr().wrapping_add(16 * g)) };
            let s = _mm256_set1_ps(super::scalar::f32_at(scales[r], g));
            for t in 0..T {
                // Lanes 0–7: even columns xv[0], odd xv[2]; lanes 8–15: xv[1], xv[3].
                let p0 = _mm256_fmadd_ps(hi0, xv[t][2], _mm256_mul_ps(lo0, xv[t][0]));
                let p1 = _mm256_fmadd_ps(hi1, xv[t][3], _mm256_mul_ps(lo1, xv[t][1]));
                acc[r][t][0] = _mm256_fmadd_ps(p0, s, acc[r][t][0]);
                acc[r][t][1] = _mm256_fmadd_ps(p1, s, acc[r][t][1]);
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum(_mm256_add_ps(acc[r][t][0], acc[r][t][1]));
        }
    }
    out
}

/// This tier's quantized-row dots for the shared row and token loops of `kernels::quant`.
pub(super) struct Avx2Dots;

impl super::quant_loop::QuantDots for Avx2Dots {
    unsafe fn q8<const R: usize, const T: usize>(
        codes: [&[u8]; R],
        x: [&[f32]; T],
        cols: usize,
    ) -> [[f32; T]; R] {
        // SAFETY: the caller's contract is the CPU features (AVX2 + FMA).
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
/// cols]` in natural order (int8) or split per 32 columns (int4). Within the 16 ymm registers:
/// int8 (4 accumulators a pair) 2 tokens with 1 row or 1 token with 2 rows; int4 (2 a pair) 2
/// tokens with 2 rows or 1 token with 4 rows.
///
/// # Safety
/// The CPU supports AVX2 and FMA. (The shape is checked by the caller, `kernels::quant`.)
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quant_rows(
    m: &k3_proto::quant::QuantMatrix<'_>,
    r0: usize,
    k: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let mut t = 0;
    if m.kind() == k3_proto::quant::QuantKind::Int8 {
        while t + 2 <= n {
            // SAFETY: CPU features are this function's contract.
            unsafe { super::quant_loop::tokens::<Avx2Dots, 1, 2>(m, r0, k, x, n, t, out) };
            t += 2;
        }
        if t < n {
            // SAFETY: as above.
            unsafe { super::quant_loop::tokens::<Avx2Dots, 2, 1>(m, r0, k, x, n, t, out) }
        }
        return;
    }
    while t + 4 <= n {
        // SAFETY: as above.
        unsafe { super::quant_loop::tokens::<Avx2Dots, 1, 4>(m, r0, k, x, n, t, out) };
        t += 4;
    }
    match n - t {
        0 => {}
        // SAFETY: as above.
        3 => unsafe { super::quant_loop::tokens::<Avx2Dots, 1, 3>(m, r0, k, x, n, t, out) },
        // SAFETY: as above.
        2 => unsafe { super::quant_loop::tokens::<Avx2Dots, 1, 2>(m, r0, k, x, n, t, out) },
        // SAFETY: as above.
        _ => unsafe { super::quant_loop::tokens::<Avx2Dots, 2, 1>(m, r0, k, x, n, t, out) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte value in every position of a group decodes to the E2M1 values of its two
    /// nibbles, in the lanes the `[8 even | 8 odd]` activation blocks pair with.
    #[test]
    fn decode_group_gives_each_nibbles_e2m1_value_in_its_columns_lane() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        for start in 0..16u32 {
            // Bytes start, start + 16, … cover all 256 values over the 16 starts.
            let group: [u8; 16] = std::array::from_fn(|i| (start + 16 * i as u32) as u8);
            // SAFETY: 16 readable bytes; AVX2 and FMA checked above.
            let w = unsafe { decode_group(group.as_ptr()) };
            let mut got = [0f32; 32];
            for (k, v) in w.iter().enumerate() {
                // SAFETY: 8 floats written into an 8-float slice.
                unsafe { _mm256_storeu_ps(got[8 * k..].as_mut_ptr(), *v) };
            }
            for col in 0..32 {
                let b = group[col / 2];
                let code = if col % 2 == 0 { b & 15 } else { b >> 4 };
                // Vector k, lane i: block k / 2 of 16 columns, even (k even) or odd columns.
                let (k, i) = ((col / 16) * 2 + col % 2, (col % 16) / 2);
                assert_eq!(
                    got[8 * k + i].to_bits(),
                    E2M1[code as usize].to_bits(),
                    "byte {b:#04x}, column {col}"
                );
            }
        }
    }
}
