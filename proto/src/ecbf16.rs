//! EC-BF16: an exponent-coded, fixed-width, lossless code for bf16 weight matrices
//! (docs/SPEC.md §6.13).
//!
//! A bf16 weight is two bytes: the LOW byte (the exponent's lowest bit and the 7 mantissa bits)
//! is close to noise and is kept as it is; the HIGH byte (the sign and the exponent's upper 7
//! bits) takes a handful of values in a trained matrix. Each matrix gets a palette of its
//! `2^w − 1` commonest high bytes; a weight stores its low byte and a `w`-bit index into the
//! palette (`w` = 2, 3 or 4: 10, 11 or 12 bits a weight). Index `2^w − 1` is the ESCAPE: the
//! weight's high byte is in the matrix's escape list instead (4 bytes each, per row in column
//! order). Decoding is one table lookup per weight and is exact for every bf16 pattern (zeros,
//! subnormals, ±inf, NaN: a pattern is two bytes, whatever they mean).
//!
//! # Byte layout of one coded matrix `[rows, cols]` (all integers little-endian)
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 4 | magic `K3EC` |
//! | 4 | 1 | version (1) |
//! | 5 | 1 | `w`, index width in bits (2..=4) |
//! | 6 | 1 | palette entries used, `p` (0..=2^w−1) |
//! | 7 | 1 | 0 |
//! | 8 | 4 | rows |
//! | 12 | 4 | cols (`< 2^24`) |
//! | 16 | 4 | escapes, `e` |
//! | 20 | 4 | 0 |
//! | 24 | 8 | XXH3-64 of the raw bf16 bytes (`rows·cols·2`, row-major), the round-trip check |
//! | 32 | 16 | palette: high bytes, entries `p..16` zero |
//! | 48 | 16 | zeros |
//! | 64 | `rows · S` | the rows: row `r` at `64 + r·S`, `S = ⌈cols/32⌉ · (32 + 4w)` |
//! | `E = 64 + rows·S` | `4·(rows+1)` if `e > 0` | escape row index: entries of row `r` are `[ix[r], ix[r+1])`; `ix[0] = 0`, `ix[rows] = e` |
//! | after it | `4·e` | escape entries `col << 8 | high byte`, by row, then column |
//!
//! A row is `⌈cols/32⌉` BLOCKS of 32 columns (the last one padded with zero bytes): 32 low
//! bytes, then the index bits (`4w` bytes). Inside a block, position `q` (0..32) holds column
//! [`col_of`]`(q)`: positions 0–7 are columns 0–7, 8–15 columns 16–23, 16–23 columns 8–15,
//! 24–31 columns 24–31, the order in which a 256-bit byte unpack of (low bytes, high bytes)
//! yields the columns in order (see [`col_of`]). The index of position `q` is made of SECTIONS, low bits
//! first: `w = 4`: one 4-bit section (16 bytes); `w = 3`: a 2-bit section (8 bytes) then a 1-bit
//! one (4 bytes); `w = 2`: one 2-bit section. In a `k`-bit section, position `q = 4d + i`
//! (`d` = 0..8, `i` = 0..4) is bits `k·⌊d/k⌋ .. +k` of section byte `4·(d mod k) + i` — the
//! order a SIMD decoder gets by broadcasting the section over 32 bytes and shifting 32-bit lane
//! `d` right by `k·⌊d/k⌋`.
//!
//! Rows are independent: any row range can be decoded alone (a thread's share of a product),
//! from its blocks and its own escape entries. The whole matrix is position-independent, so a
//! packer can place it at any offset (a layer run's tensors at 64-byte, runs at 4 KiB offsets).

use std::fmt;
use std::hash::Hasher as _;

/// Columns per block.
pub const BLOCK: usize = 32;
/// Bytes of the header before the rows.
pub const HEADER_BYTES: usize = 64;
/// `K3EC`.
pub const MAGIC: [u8; 4] = *b"K3EC";
/// The format version written and read.
pub const VERSION: u8 = 1;
/// Index widths the format allows.
pub const WIDTHS: [u8; 3] = [2, 3, 4];
/// Largest column count (escape entries keep the column in 24 bits).
pub const MAX_COLS: usize = 1 << 24;
/// The name of this format as a tensor dtype in a packed trunk's description.
pub const DTYPE_NAME: &str = "ECBF16";

/// Why a coded matrix cannot be made or read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The raw bytes are not `rows·cols` bf16.
    #[error("raw bf16 matrix [{rows}, {cols}] needs {want} bytes, got {got}")]
    RawLength {
        rows: usize,
        cols: usize,
        want: usize,
        got: usize,
    },
    /// Width outside [`WIDTHS`].
    #[error("index width {0} is not 2, 3 or 4")]
    Width(u8),
    /// A dimension the format cannot hold.
    #[error("matrix [{rows}, {cols}] too large for EC-BF16 (rows < 2^32, cols < 2^24)")]
    Shape { rows: usize, cols: usize },
    /// A palette that is too long or repeats a byte.
    #[error("palette of {len} entries for width {width} (at most {max}, no repeats)")]
    Palette { len: usize, width: u8, max: usize },
    /// The header is wrong or the length does not match it.
    #[error("not an EC-BF16 matrix: {0}")]
    Header(String),
    /// The rows, the escapes or the checksum disagree.
    #[error("EC-BF16 matrix is corrupt: {0}")]
    Corrupt(String),
}

/// Block position `q` (0..32) → column within the block. Positions `q` and `q + 8` of each
/// 16-byte half are the columns a 256-bit byte unpack of (low bytes, high bytes) puts next to
/// each other: unpacking positions 0–7 with 16–23 gives columns 0–15, 8–15 with 24–31 columns
/// 16–31.
#[inline]
pub const fn col_of(q: usize) -> usize {
    match q {
        0..=7 | 24..=31 => q,
        8..=15 => q + 8,
        _ => q - 8,
    }
}

/// Bytes of one block for index width `w`.
#[inline]
pub const fn block_bytes(width: u8) -> usize {
    BLOCK + 4 * width as usize
}

/// The index code meaning "escaped" for width `w`.
#[inline]
pub const fn escape_code(width: u8) -> u8 {
    (1u8 << width) - 1
}

/// The sections of a width: `(bits k, byte offset in the index area, bit offset in the index)`.
pub const fn sections(width: u8) -> &'static [(u8, usize, u8)] {
    match width {
        4 => &[(4, 0, 0)],
        3 => &[(2, 0, 0), (1, 8, 2)],
        _ => &[(2, 0, 0)],
    }
}

/// The index of position `q` in a block's index area.
#[inline]
pub fn index_at(idx_area: &[u8], width: u8, q: usize) -> u8 {
    let (d, i) = (q / 4, q % 4);
    let mut v = 0u8;
    for &(k, off, bit) in sections(width) {
        let k = k as usize;
        let byte = idx_area[off + 4 * (d % k) + i];
        let field = (byte >> (k * (d / k))) & ((1u8 << k) - 1);
        v |= field << bit;
    }
    v
}

/// Sets the index of position `q` (the area starts zeroed).
fn set_index(idx_area: &mut [u8], width: u8, q: usize, v: u8) {
    let (d, i) = (q / 4, q % 4);
    for &(k, off, bit) in sections(width) {
        let k = k as usize;
        let field = (v >> bit) & ((1u8 << k) - 1);
        idx_area[off + 4 * (d % k) + i] |= field << (k * (d / k));
    }
}

/// Counts of each high byte (sign + upper 7 exponent bits) of a bf16 matrix.
#[derive(Clone, PartialEq, Eq)]
pub struct HighBytes(pub [u64; 256]);

impl fmt::Debug for HighBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let used: Vec<(u8, u64)> = (0..256)
            .filter(|&b| self.0[b] > 0)
            .map(|b| (b as u8, self.0[b]))
            .collect();
        f.debug_tuple("HighBytes").field(&used).finish()
    }
}

impl Default for HighBytes {
    fn default() -> Self {
        HighBytes([0; 256])
    }
}

impl HighBytes {
    /// Counts the high bytes of a raw little-endian bf16 run.
    pub fn of(raw: &[u8]) -> HighBytes {
        let mut h = HighBytes::default();
        h.add(raw);
        h
    }

    /// Adds a raw little-endian bf16 run (even length).
    pub fn add(&mut self, raw: &[u8]) {
        for pair in raw.chunks_exact(2) {
            self.0[pair[1] as usize] += 1;
        }
    }

    /// Adds another count.
    pub fn merge(&mut self, other: &HighBytes) {
        for (a, b) in self.0.iter_mut().zip(other.0.iter()) {
            *a += b;
        }
    }

    /// Weights counted.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// The palette for width `w`: the `2^w − 1` commonest high bytes (fewer if fewer occur), by
    /// count, ties to the lower byte; then sorted ascending.
    pub fn palette(&self, width: u8) -> Vec<u8> {
        let mut order: Vec<u8> = (0..=255u8).filter(|&b| self.0[b as usize] > 0).collect();
        order.sort_by(|&a, &b| self.0[b as usize].cmp(&self.0[a as usize]).then(a.cmp(&b)));
        order.truncate(escape_code(width) as usize);
        order.sort_unstable();
        order
    }

    /// Weights outside [`HighBytes::palette`]`(w)`: the escapes of width `w`.
    pub fn escapes(&self, width: u8) -> u64 {
        let pal = self.palette(width);
        self.total() - pal.iter().map(|&b| self.0[b as usize]).sum::<u64>()
    }

    /// Shannon entropy of the high byte, bits per weight.
    pub fn entropy_bits(&self) -> f64 {
        let n = self.total() as f64;
        if n == 0.0 {
            return 0.0;
        }
        self.0
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let p = c as f64 / n;
                -p * p.log2()
            })
            .sum()
    }
}

/// Canonical Huffman code lengths of `counts` (0 for absent symbols): by repeatedly merging the
/// two lightest subtrees; a single symbol gets length 1.
pub fn huffman_lengths(counts: &[u64; 256]) -> [u8; 256] {
    let mut len = [0u8; 256];
    // (weight, members) — at most 256 symbols, so the quadratic merge is cheap.
    let mut nodes: Vec<(u64, Vec<u8>)> = (0..=255u8)
        .filter(|&s| counts[s as usize] > 0)
        .map(|s| (counts[s as usize], vec![s]))
        .collect();
    if nodes.len() == 1 {
        len[nodes[0].1[0] as usize] = 1;
        return len;
    }
    while nodes.len() > 1 {
        nodes.sort_by_key(|n| std::cmp::Reverse(n.0));
        let (wa, ma) = nodes.pop().expect("two nodes");
        let (wb, mb) = nodes.pop().expect("two nodes");
        for &s in ma.iter().chain(&mb) {
            len[s as usize] += 1;
        }
        nodes.push((wa + wb, [ma, mb].concat()));
    }
    len
}

/// Bytes of a coded matrix.
pub fn encoded_len(rows: usize, cols: usize, width: u8, escapes: usize) -> usize {
    let stride = cols.div_ceil(BLOCK) * block_bytes(width);
    let index = if escapes > 0 { 4 * (rows + 1) } else { 0 };
    HEADER_BYTES + rows * stride + index + 4 * escapes
}

/// What a tensor is stored as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorCodec {
    /// Raw bf16.
    Raw,
    /// EC-BF16 with this index width.
    Coded(u8),
}

/// The smallest encoding of a `[rows, cols]` bf16 matrix with high-byte counts `h` among the
/// widths in `widths` whose escape rate is at most `max_escape_rate`, or raw if none is smaller
/// than raw. Returns the codec and its size in bytes.
pub fn choose_codec(
    h: &HighBytes,
    rows: usize,
    cols: usize,
    widths: &[u8],
    max_escape_rate: f64,
) -> (TensorCodec, usize) {
    let raw = rows * cols * 2;
    let n = h.total().max(1) as f64;
    let mut best = (TensorCodec::Raw, raw);
    for &w in widths {
        let e = h.escapes(w);
        if e as f64 / n > max_escape_rate || cols >= MAX_COLS || rows > u32::MAX as usize {
            continue;
        }
        let size = encoded_len(rows, cols, w, e as usize);
        if size < best.1 {
            best = (TensorCodec::Coded(w), size);
        }
    }
    best
}

/// XXH3-64 of raw bytes (the header's round-trip checksum).
pub fn raw_checksum(raw: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(raw)
}

/// Encodes a raw bf16 matrix with the palette of its own commonest high bytes.
pub fn encode(raw: &[u8], rows: usize, cols: usize, width: u8) -> Result<Vec<u8>, CodecError> {
    check_raw(raw, rows, cols)?;
    let pal = HighBytes::of(raw).palette(width);
    encode_with_palette(raw, rows, cols, width, &pal)
}

fn check_raw(raw: &[u8], rows: usize, cols: usize) -> Result<(), CodecError> {
    let want = rows
        .checked_mul(cols)
        .and_then(|v| v.checked_mul(2))
        .ok_or(CodecError::Shape { rows, cols })?;
    if raw.len() != want {
        return Err(CodecError::RawLength {
            rows,
            cols,
            want,
            got: raw.len(),
        });
    }
    if cols >= MAX_COLS || rows > u32::MAX as usize {
        return Err(CodecError::Shape { rows, cols });
    }
    Ok(())
}

/// Encodes a raw bf16 matrix with a given palette (high bytes, no repeats, at most `2^w − 1`).
/// Every high byte outside the palette is escaped.
pub fn encode_with_palette(
    raw: &[u8],
    rows: usize,
    cols: usize,
    width: u8,
    palette: &[u8],
) -> Result<Vec<u8>, CodecError> {
    if !WIDTHS.contains(&width) {
        return Err(CodecError::Width(width));
    }
    check_raw(raw, rows, cols)?;
    let esc = escape_code(width);
    let mut slot = [esc; 256];
    for (i, &b) in palette.iter().enumerate() {
        if i >= esc as usize || slot[b as usize] != esc {
            return Err(CodecError::Palette {
                len: palette.len(),
                width,
                max: esc as usize,
            });
        }
        slot[b as usize] = i as u8;
    }
    let escapes: usize = raw
        .chunks_exact(2)
        .filter(|p| slot[p[1] as usize] == esc)
        .count();
    let bb = block_bytes(width);
    let nb = cols.div_ceil(BLOCK);
    let stride = nb * bb;
    let mut out = vec![0u8; encoded_len(rows, cols, width, escapes)];
    out[0..4].copy_from_slice(&MAGIC);
    out[4] = VERSION;
    out[5] = width;
    out[6] = palette.len() as u8;
    out[8..12].copy_from_slice(&(rows as u32).to_le_bytes());
    out[12..16].copy_from_slice(&(cols as u32).to_le_bytes());
    out[16..20].copy_from_slice(&(escapes as u32).to_le_bytes());
    out[24..32].copy_from_slice(&raw_checksum(raw).to_le_bytes());
    out[32..32 + palette.len()].copy_from_slice(palette);
    let index_at_off = HEADER_BYTES + rows * stride;
    let entries_off = index_at_off + if escapes > 0 { 4 * (rows + 1) } else { 0 };
    let mut n_esc = 0usize;
    for r in 0..rows {
        if escapes > 0 {
            let at = index_at_off + 4 * r;
            out[at..at + 4].copy_from_slice(&(n_esc as u32).to_le_bytes());
        }
        let row = &raw[r * cols * 2..(r + 1) * cols * 2];
        let dst = &mut out[HEADER_BYTES + r * stride..HEADER_BYTES + (r + 1) * stride];
        for (b, blk) in dst.chunks_exact_mut(bb).enumerate() {
            let (lows, idx) = blk.split_at_mut(BLOCK);
            for (q, low) in lows.iter_mut().enumerate() {
                let c = b * BLOCK + col_of(q);
                if c < cols {
                    *low = row[2 * c];
                    set_index(idx, width, q, slot[row[2 * c + 1] as usize]);
                }
            }
        }
        for c in 0..cols {
            let hb = row[2 * c + 1];
            if slot[hb as usize] == esc {
                let at = entries_off + 4 * n_esc;
                out[at..at + 4].copy_from_slice(&(((c as u32) << 8) | hb as u32).to_le_bytes());
                n_esc += 1;
            }
        }
    }
    if escapes > 0 {
        let at = index_at_off + 4 * rows;
        out[at..at + 4].copy_from_slice(&(n_esc as u32).to_le_bytes());
    }
    Ok(out)
}

/// A coded matrix read in place (the bytes of one tensor), structurally checked by
/// [`CodedMatrix::parse`]: header, length, escape row index. [`CodedMatrix::verify`] checks the
/// rest (every block, every escape, the checksum of the decoded bytes).
#[derive(Clone, Copy, Debug)]
pub struct CodedMatrix<'a> {
    rows: usize,
    cols: usize,
    width: u8,
    palette_len: u8,
    escapes: usize,
    raw_xxh3: u64,
    palette: [u8; 16],
    blocks: &'a [u8],
    esc_index: &'a [u8],
    esc: &'a [u8],
    all: &'a [u8],
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

impl<'a> CodedMatrix<'a> {
    /// Reads a coded matrix's header and checks its length and escape row index (`O(rows)`).
    pub fn parse(bytes: &'a [u8]) -> Result<CodedMatrix<'a>, CodecError> {
        let bad = |m: String| Err(CodecError::Header(m));
        if bytes.len() < HEADER_BYTES {
            return bad(format!("{} bytes, shorter than the header", bytes.len()));
        }
        if bytes[0..4] != MAGIC {
            return bad("no K3EC magic".into());
        }
        if bytes[4] != VERSION {
            return bad(format!("version {} (this build reads {VERSION})", bytes[4]));
        }
        let width = bytes[5];
        if !WIDTHS.contains(&width) {
            return Err(CodecError::Width(width));
        }
        let palette_len = bytes[6];
        if palette_len > escape_code(width) {
            return bad(format!("{palette_len} palette entries for width {width}"));
        }
        let (rows, cols) = (u32_at(bytes, 8) as usize, u32_at(bytes, 12) as usize);
        if cols >= MAX_COLS {
            return bad(format!("{cols} columns"));
        }
        let escapes = u32_at(bytes, 16) as usize;
        let mut palette = [0u8; 16];
        palette.copy_from_slice(&bytes[32..48]);
        if bytes[7] != 0
            || bytes[20..24].iter().any(|&b| b != 0)
            || bytes[48..64].iter().any(|&b| b != 0)
            || palette[palette_len as usize..].iter().any(|&b| b != 0)
        {
            return bad("non-zero reserved bytes".into());
        }
        let want = (rows as u64)
            .checked_mul((cols.div_ceil(BLOCK) * block_bytes(width)) as u64)
            .and_then(|v| v.checked_add(HEADER_BYTES as u64))
            .and_then(|v| {
                v.checked_add(if escapes > 0 {
                    4 * (rows as u64 + 1)
                } else {
                    0
                })
            })
            .and_then(|v| v.checked_add(4 * escapes as u64));
        if want != Some(bytes.len() as u64) {
            return bad(format!(
                "{} bytes for [{rows}, {cols}] width {width} with {escapes} escapes (want {want:?})",
                bytes.len()
            ));
        }
        let stride = cols.div_ceil(BLOCK) * block_bytes(width);
        let (blocks, rest) = bytes[HEADER_BYTES..].split_at(rows * stride);
        let (esc_index, esc) = rest.split_at(if escapes > 0 { 4 * (rows + 1) } else { 0 });
        let m = CodedMatrix {
            rows,
            cols,
            width,
            palette_len,
            escapes,
            raw_xxh3: u64::from_le_bytes(bytes[24..32].try_into().expect("8 bytes")),
            palette,
            blocks,
            esc_index,
            esc,
            all: bytes,
        };
        if escapes > 0 {
            if m.ix(0) != 0 || m.ix(rows) != escapes {
                return Err(CodecError::Corrupt(
                    "escape row index does not span the entries".into(),
                ));
            }
            if (0..rows).any(|r| m.ix(r) > m.ix(r + 1)) {
                return Err(CodecError::Corrupt("escape row index decreases".into()));
            }
        }
        Ok(m)
    }

    /// The whole coded matrix as parsed (header to the last escape entry): a copy of these
    /// bytes parses to the same matrix.
    pub fn bytes(&self) -> &'a [u8] {
        self.all
    }

    fn ix(&self, r: usize) -> usize {
        u32_at(self.esc_index, 4 * r) as usize
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Index width in bits.
    pub fn width(&self) -> u8 {
        self.width
    }
    /// Escaped weights.
    pub fn escapes(&self) -> usize {
        self.escapes
    }
    /// The palette entries in use.
    pub fn palette(&self) -> &[u8] {
        &self.palette[..self.palette_len as usize]
    }
    /// The 16-entry lookup table of a SIMD decoder: palette, zeros after it (the escape code's
    /// entry is 0 until patched).
    pub fn table(&self) -> [u8; 16] {
        self.palette
    }
    /// The checksum of the decoded bytes the header promises.
    pub fn raw_checksum(&self) -> u64 {
        self.raw_xxh3
    }
    /// Bytes of a row's blocks.
    pub fn row_stride(&self) -> usize {
        self.cols.div_ceil(BLOCK) * block_bytes(self.width)
    }
    /// Blocks per row.
    pub fn blocks_per_row(&self) -> usize {
        self.cols.div_ceil(BLOCK)
    }
    /// Row `r`'s blocks.
    pub fn row_blocks(&self, r: usize) -> &'a [u8] {
        let s = self.row_stride();
        &self.blocks[r * s..(r + 1) * s]
    }
    /// Every row's blocks, row-major (`rows · row_stride` bytes).
    pub fn blocks(&self) -> &'a [u8] {
        self.blocks
    }
    /// Row `r`'s escape entries: `(column, high byte)` in column order.
    pub fn row_escapes(&self, r: usize) -> Escapes<'a> {
        if self.escapes == 0 {
            return Escapes(&[]);
        }
        Escapes(&self.esc[4 * self.ix(r)..4 * self.ix(r + 1)])
    }

    /// Decodes block `b` of row `r` into `out` (the raw bf16 bytes of its 32 columns, zero for
    /// columns past the row's end). Exact when the matrix verifies.
    pub fn decode_block(&self, r: usize, b: usize, out: &mut [u8; 2 * BLOCK]) {
        let bb = block_bytes(self.width);
        let blk = &self.row_blocks(r)[b * bb..(b + 1) * bb];
        let (lows, idx) = blk.split_at(BLOCK);
        for (q, &low) in lows.iter().enumerate() {
            let c = col_of(q);
            out[2 * c] = low;
            out[2 * c + 1] = self.palette[index_at(idx, self.width, q) as usize & 15];
        }
        for (c, hb) in self.row_escapes(r).in_cols(b * BLOCK, (b + 1) * BLOCK) {
            out[2 * (c - b * BLOCK) + 1] = hb;
        }
        let valid = self.cols.saturating_sub(b * BLOCK).min(BLOCK);
        out[2 * valid..].fill(0);
    }

    /// Decodes row `r` into `out` (`2·cols` bytes).
    pub fn decode_row(&self, r: usize, out: &mut [u8]) {
        assert_eq!(out.len(), 2 * self.cols, "decoded row length");
        let mut buf = [0u8; 2 * BLOCK];
        for (b, dst) in out.chunks_mut(2 * BLOCK).enumerate() {
            self.decode_block(r, b, &mut buf);
            dst.copy_from_slice(&buf[..dst.len()]);
        }
    }

    /// The whole raw matrix.
    pub fn decode(&self) -> Vec<u8> {
        let mut out = vec![0u8; 2 * self.rows * self.cols];
        if self.cols > 0 {
            for (r, row) in out.chunks_exact_mut(2 * self.cols).enumerate() {
                self.decode_row(r, row);
            }
        }
        out
    }

    /// Checks everything [`CodedMatrix::parse`] does not: padding is zero, escape entries are in
    /// column order inside their row and sit exactly where the escape code is, no escaped byte
    /// is in the palette, no index points past the palette, and the decoded matrix has the
    /// header's checksum. `O(rows·cols)`.
    pub fn verify(&self) -> Result<(), CodecError> {
        let corrupt = |m: String| Err(CodecError::Corrupt(m));
        let esc = escape_code(self.width);
        let bb = block_bytes(self.width);
        let mut hasher = twox_hash::XxHash3_64::new();
        let mut row = vec![0u8; 2 * self.cols];
        for r in 0..self.rows {
            let entries = self.row_escapes(r);
            let mut last = None;
            for (c, hb) in entries.iter() {
                if c >= self.cols || last.is_some_and(|l| c <= l) {
                    return corrupt(format!("row {r}: escape entry for column {c} out of order"));
                }
                if self.palette().contains(&hb) {
                    return corrupt(format!(
                        "row {r} column {c}: escaped byte {hb:#04x} is in the palette"
                    ));
                }
                last = Some(c);
            }
            let mut coded_escapes = 0usize;
            for (b, blk) in self.row_blocks(r).chunks_exact(bb).enumerate() {
                let (lows, idx) = blk.split_at(BLOCK);
                for (q, &low) in lows.iter().enumerate() {
                    let c = b * BLOCK + col_of(q);
                    let i = index_at(idx, self.width, q);
                    if c >= self.cols {
                        if low != 0 || i != 0 {
                            return corrupt(format!("row {r}: padding is not zero"));
                        }
                    } else if i == esc {
                        coded_escapes += 1;
                        if entries.in_cols(c, c + 1).next().is_none() {
                            return corrupt(format!(
                                "row {r} column {c}: escape code without entry"
                            ));
                        }
                    } else if i >= self.palette_len {
                        return corrupt(format!("row {r} column {c}: index {i} past the palette"));
                    }
                }
            }
            if coded_escapes != entries.len() {
                return corrupt(format!(
                    "row {r}: {coded_escapes} escape codes, {} entries",
                    entries.len()
                ));
            }
            self.decode_row(r, &mut row);
            hasher.write(&row);
        }
        if std::hash::Hasher::finish(&hasher) != self.raw_xxh3 {
            return corrupt("decoded bytes do not have the header's checksum".into());
        }
        Ok(())
    }
}

/// One row's escape entries (4 bytes each: `column << 8 | high byte`), in column order.
#[derive(Clone, Copy, Debug)]
pub struct Escapes<'a>(&'a [u8]);

impl<'a> Escapes<'a> {
    /// Entries.
    pub fn len(&self) -> usize {
        self.0.len() / 4
    }
    /// No entries.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// Entry `i` as `(column, high byte)`.
    #[inline]
    pub fn get(&self, i: usize) -> (usize, u8) {
        let v = u32_at(self.0, 4 * i);
        ((v >> 8) as usize, v as u8)
    }
    /// Every entry.
    pub fn iter(&self) -> impl Iterator<Item = (usize, u8)> + 'a {
        let s = *self;
        (0..s.len()).map(move |i| s.get(i))
    }
    /// The entries with `c0 <= column < c1` (binary search; entries must be in column order,
    /// which [`CodedMatrix::verify`] checks — out of order, some may be missed, never read out
    /// of bounds).
    pub fn in_cols(&self, c0: usize, c1: usize) -> impl Iterator<Item = (usize, u8)> + 'a {
        let s = *self;
        let n = s.len();
        let (mut lo, mut hi) = (0usize, n);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if s.get(mid).0 < c0 {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        (lo..n).map(move |i| s.get(i)).take_while(move |e| e.0 < c1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
    }

    /// Gaussian-like bf16: a few common exponents, rare far ones, every special pattern.
    fn matrix(rng: &mut Rng, rows: usize, cols: usize) -> Vec<u8> {
        (0..rows * cols)
            .flat_map(|_| {
                let r = rng.next();
                let bits: u16 = match r % 1000 {
                    0 => 0x7F80,                    // +inf
                    1 => 0xFF80,                    // -inf
                    2 => 0x7FC1,                    // NaN
                    3 => (r >> 16) as u16 & 0x807F, // ±0 / subnormal
                    4..=9 => (r >> 16) as u16,      // anything
                    _ => {
                        let e = 120 + (r >> 20) % 6;
                        ((r >> 40) as u16 & 0x8000) | ((e as u16) << 7) | ((r >> 8) as u16 & 0x7F)
                    }
                };
                bits.to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn huffman_lengths_are_optimal_on_a_known_distribution() {
        let mut c = [0u64; 256];
        c[1] = 8;
        c[2] = 4;
        c[3] = 2;
        c[4] = 2;
        let l = huffman_lengths(&c);
        assert_eq!((l[1], l[2], l[3], l[4]), (1, 2, 3, 3));
        assert_eq!(l.iter().filter(|&&x| x > 0).count(), 4);
        // Kraft equality for a full binary code.
        let kraft: f64 = l
            .iter()
            .filter(|&&x| x > 0)
            .map(|&x| 0.5f64.powi(x as i32))
            .sum();
        assert!((kraft - 1.0).abs() < 1e-12);
        let mut one = [0u64; 256];
        one[7] = 5;
        assert_eq!(huffman_lengths(&one)[7], 1);
    }

    #[test]
    fn col_of_is_a_permutation_that_unpacks_to_column_order() {
        let mut seen = [false; 32];
        for q in 0..32 {
            assert!(!seen[col_of(q)]);
            seen[col_of(q)] = true;
        }
        // A 256-bit unpacklo takes byte j of each 128-bit half (j < 8): columns 0..7 then 8..15.
        for j in 0..8 {
            assert_eq!(col_of(j), j);
            assert_eq!(col_of(16 + j), 8 + j);
            assert_eq!(col_of(8 + j), 16 + j);
            assert_eq!(col_of(24 + j), 24 + j);
        }
    }

    #[test]
    fn index_bits_round_trip_for_every_position_and_value() {
        for w in WIDTHS {
            for q in 0..32 {
                for v in 0..(1u8 << w) {
                    let mut area = vec![0u8; 4 * w as usize];
                    set_index(&mut area, w, q, v);
                    assert_eq!(index_at(&area, w, q), v, "w {w} q {q} v {v}");
                    assert_eq!(
                        area.iter().map(|b| b.count_ones()).sum::<u32>(),
                        v.count_ones()
                    );
                    for p in (0..32).filter(|&p| p != q) {
                        assert_eq!(index_at(&area, w, p), 0, "w {w}: q {q} leaks into {p}");
                    }
                }
            }
        }
    }

    #[test]
    fn round_trips_exactly_on_awkward_shapes_and_every_width() {
        let mut rng = Rng(1);
        for (rows, cols) in [
            (1, 1),
            (3, 31),
            (5, 32),
            (7, 33),
            (2, 95),
            (4, 1000),
            (0, 8),
            (6, 0),
        ] {
            let raw = matrix(&mut rng, rows, cols);
            for w in WIDTHS {
                let coded = encode(&raw, rows, cols, w).unwrap();
                let m = CodedMatrix::parse(&coded).unwrap();
                assert_eq!((m.rows(), m.cols(), m.width()), (rows, cols, w));
                assert_eq!(coded.len(), encoded_len(rows, cols, w, m.escapes()));
                assert_eq!(m.escapes() as u64, HighBytes::of(&raw).escapes(w));
                m.verify().unwrap();
                assert_eq!(m.decode(), raw, "[{rows}, {cols}] w {w}");
            }
        }
    }

    #[test]
    fn every_bf16_pattern_round_trips_even_all_escaped() {
        let raw: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
        for w in WIDTHS {
            for pal in [vec![], vec![0x3F, 0xBF, 0x7F]] {
                let coded = encode_with_palette(&raw, 256, 256, w, &pal).unwrap();
                let m = CodedMatrix::parse(&coded).unwrap();
                assert_eq!(m.escapes(), 65536 - 256 * pal.len());
                m.verify().unwrap();
                assert_eq!(m.decode(), raw);
            }
        }
    }

    #[test]
    fn palette_is_the_commonest_high_bytes_ties_to_the_lower() {
        let mut h = HighBytes::default();
        for (b, n) in [
            (0x3Fu8, 50u64),
            (0xBF, 50),
            (0x3E, 20),
            (0x40, 20),
            (0x01, 1),
        ] {
            h.0[b as usize] = n;
        }
        assert_eq!(h.palette(2), vec![0x3E, 0x3F, 0xBF]);
        assert_eq!(h.escapes(2), 21);
        assert_eq!(h.palette(4), vec![0x01, 0x3E, 0x3F, 0x40, 0xBF]);
        assert_eq!(h.escapes(4), 0);
    }

    #[test]
    fn choose_codec_prefers_the_smallest_allowed_and_falls_back_to_raw() {
        let mut h = HighBytes::default();
        for b in 0..7u8 {
            h.0[b as usize] = 1000;
        }
        h.0[200] = 10; // 10 of 7010 outside a 7-entry palette (0.14%)
        let (rows, cols) = (10, 701);
        assert_eq!(
            choose_codec(&h, rows, cols, &WIDTHS, 0.01).0,
            TensorCodec::Coded(3)
        );
        assert_eq!(
            choose_codec(&h, rows, cols, &[4], 0.01).0,
            TensorCodec::Coded(4)
        );
        // Width 2 would escape 4010 weights (57%): never chosen with a 1% cap.
        assert_eq!(choose_codec(&h, rows, cols, &[2], 0.01).0, TensorCodec::Raw);
        // Escapes are allowed, but a 3-entry palette costs more than raw bf16 here.
        assert_eq!(choose_codec(&h, rows, cols, &[2], 1.0).0, TensorCodec::Raw);
    }

    #[test]
    fn corruption_is_refused_by_parse_or_verify() {
        let mut rng = Rng(2);
        let (rows, cols) = (4, 70);
        let raw = matrix(&mut rng, rows, cols);
        let coded = encode(&raw, rows, cols, 3).unwrap();
        assert!(CodedMatrix::parse(&coded).unwrap().escapes() > 0);
        assert!(CodedMatrix::parse(&coded[..coded.len() - 1]).is_err());
        let mut bad = coded.clone();
        bad[5] = 5;
        assert_eq!(CodedMatrix::parse(&bad).unwrap_err(), CodecError::Width(5));
        // A flipped low byte: parses, fails the checksum.
        let mut bad = coded.clone();
        bad[HEADER_BYTES] ^= 1;
        assert!(matches!(
            CodedMatrix::parse(&bad).unwrap().verify(),
            Err(CodecError::Corrupt(m)) if m.contains("checksum")
        ));
        // An escape entry moved to another column.
        let m = CodedMatrix::parse(&coded).unwrap();
        let last = coded.len() - 4;
        let mut bad = coded.clone();
        let r = (0..rows)
            .rev()
            .find(|&r| !m.row_escapes(r).is_empty())
            .unwrap();
        let (c, hb) = m.row_escapes(r).get(m.row_escapes(r).len() - 1);
        let moved = if c + 1 < cols { c + 1 } else { c - 1 };
        bad[last..].copy_from_slice(&(((moved as u32) << 8) | hb as u32).to_le_bytes());
        assert!(CodedMatrix::parse(&bad).unwrap().verify().is_err());
        // Padding that is not zero (column 70 of the last block).
        let mut bad = coded.clone();
        let pad_q = (0..32).find(|&q| 64 + col_of(q) >= cols).unwrap();
        bad[HEADER_BYTES + m.row_stride() - block_bytes(3) + pad_q] = 1;
        assert!(CodedMatrix::parse(&bad).unwrap().verify().is_err());
    }

    #[test]
    fn escapes_in_cols_finds_the_block_entries() {
        let raw: Vec<u8> = (0..200u16)
            .flat_map(|c| if c % 7 == 0 { [0u8, 0x55] } else { [0u8, 0x3F] })
            .collect();
        let coded = encode_with_palette(&raw, 1, 200, 4, &[0x3F]).unwrap();
        let m = CodedMatrix::parse(&coded).unwrap();
        let e = m.row_escapes(0);
        let got: Vec<usize> = e.in_cols(32, 64).map(|x| x.0).collect();
        assert_eq!(got, vec![35, 42, 49, 56, 63]);
        assert_eq!(e.in_cols(196, 300).count(), 1);
        assert_eq!(e.in_cols(197, 300).count(), 0);
        assert_eq!(e.in_cols(0, 1).count(), 1);
    }
}
