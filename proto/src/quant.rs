//! Quantized weight matrices: the draft trunk's (`k3-ctl pack-trunk --draft`, SPEC.md §6.10)
//! and the quantized packed trunk's (`k3-ctl pack-trunk --codec int8|int4`, SPEC.md §6.1,
//! §6.15).
//!
//! Each quantized matrix `W [rows, cols]` (bf16 in the checkpoint) is codes and f32 scales.
//! Symmetric, round to nearest (ties away from zero), zero scale for an all-zero (or
//! non-finite) row or group:
//!
//! * **int8** ([`QuantKind::Int8`]): codes `I8 [rows, cols]`, `q = round(w / s)` in −127..=127,
//!   one scale per row, `F32 [rows]`, `s = max|w| / 127`.
//! * **int4** ([`QuantKind::Int4`]): codes `U8 [rows, cols/2]`, column `2i` in the low nibble and
//!   `2i+1` in the high nibble of byte `i`, each nibble `q + 8` with `q` in −8..=7; one scale per
//!   group of [`GROUP`] columns, `F32 [rows, cols/32]`, `s = w_ext / −8` with `w_ext` the group's
//!   value of largest magnitude (the first on ties): it is code −8 exactly, and every code serves
//!   (a scale of `max|w| / 7` leaves −8 unused: 13% coarser steps, measured 9.7% against 8.6%
//!   relative RMSE on the trained proxy's matrices).
//!
//! `w ≈ q · s`. Only matrices whose `cols` is a multiple of [`GROUP`] are quantized, and only the
//! trunk matrices [`quantizable`] names (the one rule for a draft and a quantized trunk).
//!
//! A draft trunk stores codes and scales as two tensors (the scales under the name +
//! [`SCALE_SUFFIX`]); a quantized packed trunk stores each matrix as one [`QuantMatrix`]: a
//! 64-byte header (magic `K3QM`, the kind, the shape and the XXH3-64 of the checkpoint's bf16
//! bytes it was made from), then the codes, then the scales.

use std::hash::Hasher as _;

/// Name suffix of a quantized matrix's scales.
pub const SCALE_SUFFIX: &str = ".qscale";

/// Columns per int4 scale group.
pub const GROUP: usize = 32;

/// A draft trunk's weight format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuantKind {
    /// 8-bit codes, a scale per row.
    Int8,
    /// 4-bit codes, a scale per 32 columns.
    Int4,
}

impl QuantKind {
    /// `"int8"` / `"int4"`.
    pub fn name(self) -> &'static str {
        match self {
            QuantKind::Int8 => "int8",
            QuantKind::Int4 => "int4",
        }
    }

    /// Bytes of codes and of scales for a `[rows, cols]` matrix (`cols` a multiple of
    /// [`GROUP`]).
    pub fn sizes(self, rows: usize, cols: usize) -> (usize, usize) {
        match self {
            QuantKind::Int8 => (rows * cols, rows * 4),
            QuantKind::Int4 => (rows * cols / 2, rows * (cols / GROUP) * 4),
        }
    }
}

/// A quantization name that is not `int8` or `int4`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("expected int8 or int4, found {0:?}")]
pub struct UnknownQuant(pub String);

impl std::str::FromStr for QuantKind {
    type Err = UnknownQuant;
    fn from_str(s: &str) -> Result<QuantKind, UnknownQuant> {
        match s {
            "int8" => Ok(QuantKind::Int8),
            "int4" => Ok(QuantKind::Int4),
            _ => Err(UnknownQuant(s.to_string())),
        }
    }
}

fn scale_of(w: &[f32], qmax: f32) -> f32 {
    let m = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if m.is_finite() {
        m / qmax
    } else {
        0.0
    }
}

fn code(v: f32, s: f32, qmax: f32) -> i32 {
    if s == 0.0 || !v.is_finite() {
        0
    } else {
        (v / s).round().clamp(-qmax, qmax) as i32
    }
}

/// An int4 group's scale: its value of largest magnitude (the first, on ties) divided by −8, so
/// that value is code −8 exactly and the 16 codes −8..=7 all serve (the opposite extreme, at
/// most +8 steps, is clamped to 7). 0 when that value is not finite or zero.
fn signed_scale_of(w: &[f32]) -> f32 {
    let mut ext = 0.0f32;
    for &v in w {
        if v.abs() > ext.abs() {
            ext = v;
        }
    }
    if ext.is_finite() {
        ext / -8.0
    } else {
        0.0
    }
}

/// An int4 code: `round(v / s)` (ties away from zero) clamped to −8..=7; 0 for a zero scale or a
/// value that is not finite.
fn code4(v: f32, s: f32) -> i32 {
    if s == 0.0 || !v.is_finite() {
        0
    } else {
        ((v / s).round() as i32).clamp(-8, 7)
    }
}

/// Quantize one row (`cols` = `w.len()`, a multiple of [`GROUP`]) into `codes` and `scales`
/// (little-endian f32 bytes) of the sizes [`QuantKind::sizes`] gives for one row.
pub fn quantize_row(kind: QuantKind, w: &[f32], codes: &mut [u8], scales: &mut [u8]) {
    let (cb, sb) = kind.sizes(1, w.len());
    assert!(w.len().is_multiple_of(GROUP), "row of {} columns", w.len());
    assert_eq!((codes.len(), scales.len()), (cb, sb), "quantized row sizes");
    match kind {
        QuantKind::Int8 => {
            let s = scale_of(w, 127.0);
            scales.copy_from_slice(&s.to_le_bytes());
            for (c, &v) in codes.iter_mut().zip(w) {
                *c = code(v, s, 127.0) as i8 as u8;
            }
        }
        QuantKind::Int4 => {
            for ((g, cg), sg) in w
                .chunks_exact(GROUP)
                .zip(codes.chunks_exact_mut(GROUP / 2))
                .zip(scales.chunks_exact_mut(4))
            {
                let s = signed_scale_of(g);
                sg.copy_from_slice(&s.to_le_bytes());
                for (c, pair) in cg.iter_mut().zip(g.chunks_exact(2)) {
                    let lo = (code4(pair[0], s) + 8) as u8;
                    let hi = (code4(pair[1], s) + 8) as u8;
                    *c = lo | (hi << 4);
                }
            }
        }
    }
}

/// The values a quantized row stands for (`q · s`), for tests and references.
pub fn dequantize_row(kind: QuantKind, codes: &[u8], scales: &[u8], cols: usize) -> Vec<f32> {
    let s = |i: usize| f32::from_le_bytes(scales[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    match kind {
        QuantKind::Int8 => codes.iter().map(|&c| c as i8 as f32 * s(0)).collect(),
        QuantKind::Int4 => (0..cols)
            .map(|c| {
                let b = codes[c / 2];
                let nib = if c % 2 == 0 { b & 15 } else { b >> 4 };
                (nib as i32 - 8) as f32 * s(c / GROUP)
            })
            .collect(),
    }
}

/// Where the measured quality of the quantized trunks is published.
pub const QUALITY_DOC: &str = "docs/BENCHMARKS.md, \"Quality of the quantized trunk\"";

/// The one-line label every output of a run on a quantized trunk carries (the worker's report
/// and `--out`, the store's log, `k3-ctl status`/`stats`, serve's `/v1/models`): what is lossy,
/// and where its measured quality is published.
pub fn lossy_label(kind: QuantKind) -> String {
    let what = match kind {
        QuantKind::Int8 => "int8, a scale per row",
        QuantKind::Int4 => "int4, a scale per 32 columns",
    };
    format!(
        "LOSSY: {} trunk (its weight matrices quantized: {what}; the routed experts exact \
         MXFP4): ids differ from the exact model's; measured quality: {QUALITY_DOC}",
        kind.name()
    )
}

/// Whether a trunk tensor `name` of `dtype` and `shape` is quantized (in a draft trunk and in a
/// quantized packed trunk alike): every BF16 weight matrix `[rows, cols]` with `rows > 1` and
/// `cols` a multiple of [`GROUP`], except `kv_b_proj` (MLA multiplies by its transpose straight
/// from its raw rows, SPEC.md §3.6) and the MoE router `gate.weight` (a top-k choice flips on
/// small perturbations, and a flipped choice changes the layer's output far more than
/// quantizing an expert's input does). Vectors — norms, biases, conv kernels, the `[1, E]`
/// AttnRes queries — stay as stored.
pub fn quantizable(name: &str, dtype: crate::Dtype, shape: &[u64]) -> bool {
    dtype == crate::Dtype::BF16
        && shape.len() == 2
        && shape[0] > 1
        && shape[1] > 0
        && shape[1].is_multiple_of(GROUP as u64)
        && !name.ends_with("kv_b_proj.weight")
        && !name.ends_with("block_sparse_moe.gate.weight")
}

/// Quantize a little-endian bf16 matrix `[rows, cols]` (`cols` a multiple of [`GROUP`]) row by
/// row into its codes and scale bytes ([`QuantKind::sizes`]). The draft packer and the trunk
/// packer both call it, and `k3-ctl verify` calls it again to re-derive a stored matrix.
pub fn quantize_bf16(
    kind: QuantKind,
    raw: &[u8],
    rows: usize,
    cols: usize,
) -> Result<(Vec<u8>, Vec<u8>), QuantError> {
    if !cols.is_multiple_of(GROUP) || cols == 0 || rows == 0 {
        return Err(QuantError::Shape { rows, cols });
    }
    let want = rows.checked_mul(cols).and_then(|v| v.checked_mul(2));
    if want != Some(raw.len()) {
        return Err(QuantError::RawLength {
            rows,
            cols,
            got: raw.len(),
        });
    }
    let (qb, sb) = kind.sizes(1, cols);
    let (mut codes, mut scales) = (vec![0u8; qb * rows], vec![0u8; sb * rows]);
    let mut row = vec![0.0f32; cols];
    for (r, src) in raw.chunks_exact(2 * cols).enumerate() {
        for (v, b) in row.iter_mut().zip(src.chunks_exact(2)) {
            *v = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
        }
        quantize_row(
            kind,
            &row,
            &mut codes[r * qb..(r + 1) * qb],
            &mut scales[r * sb..(r + 1) * sb],
        );
    }
    Ok((codes, scales))
}

/// `K3QM`: the magic of a [`QuantMatrix`].
pub const MATRIX_MAGIC: [u8; 4] = *b"K3QM";
/// The [`QuantMatrix`] layout version written and read.
pub const MATRIX_VERSION: u8 = 1;
/// Bytes of a [`QuantMatrix`]'s header before its codes.
pub const MATRIX_HEADER_BYTES: usize = 64;

/// Why a quantized matrix cannot be made or read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// A shape the formats do not quantize (`cols` not a positive multiple of [`GROUP`], no
    /// rows, or too large for the header's 32-bit fields).
    #[error("[{rows}, {cols}] cannot be quantized (rows > 0, columns a positive multiple of 32, each < 2^32)")]
    Shape {
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// The raw bytes are not `rows·cols` bf16.
    #[error("raw bf16 matrix [{rows}, {cols}] needs {} bytes, got {got}", rows * cols * 2)]
    RawLength {
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Bytes given.
        got: usize,
    },
    /// The header is not a quantized matrix's, or the length does not match it.
    #[error("not a quantized matrix: {0}")]
    Header(&'static str),
    /// The length does not match the header's shape.
    #[error(
        "quantized matrix of {got} bytes, but its header's {kind} [{rows}, {cols}] takes {want}"
    )]
    Length {
        /// The header's kind.
        kind: &'static str,
        /// The header's rows.
        rows: usize,
        /// The header's columns.
        cols: usize,
        /// Bytes the shape takes.
        want: u64,
        /// Bytes given.
        got: usize,
    },
}

/// One quantized matrix read in place ([`QuantMatrix::parse`] of a packed trunk's tensor, or
/// [`QuantMatrix::from_parts`] of a draft trunk's two tensors): the kind, the shape, the codes
/// and the scale bytes of the sizes [`QuantKind::sizes`] gives.
#[derive(Clone, Copy, Debug)]
pub struct QuantMatrix<'a> {
    kind: QuantKind,
    rows: usize,
    cols: usize,
    source_xxh3: u64,
    codes: &'a [u8],
    scales: &'a [u8],
}

impl<'a> QuantMatrix<'a> {
    /// Bytes a stored matrix of `kind` and `[rows, cols]` takes (header, codes, scales), or
    /// `None` for a shape that is not quantized.
    pub fn stored_len(kind: QuantKind, rows: usize, cols: usize) -> Option<u64> {
        if rows == 0 || cols == 0 || !cols.is_multiple_of(GROUP) {
            return None;
        }
        u32::try_from(rows).ok()?;
        u32::try_from(cols).ok()?;
        let (q, s) = match kind {
            QuantKind::Int8 => ((rows as u64).checked_mul(cols as u64)?, 4 * rows as u64),
            QuantKind::Int4 => (
                (rows as u64).checked_mul(cols as u64 / 2)?,
                (rows as u64).checked_mul(cols as u64 / GROUP as u64 * 4)?,
            ),
        };
        q.checked_add(s)?.checked_add(MATRIX_HEADER_BYTES as u64)
    }

    /// Reads a stored matrix: header (magic, version, kind, reserved bytes zero, shape) and
    /// exact length (`O(1)`; the codes and scales are not looked at).
    pub fn parse(bytes: &'a [u8]) -> Result<QuantMatrix<'a>, QuantError> {
        if bytes.len() < MATRIX_HEADER_BYTES {
            return Err(QuantError::Header("shorter than its 64-byte header"));
        }
        if bytes[0..4] != MATRIX_MAGIC {
            return Err(QuantError::Header("no K3QM magic"));
        }
        if bytes[4] != MATRIX_VERSION {
            return Err(QuantError::Header(
                "a layout version this build does not read",
            ));
        }
        let kind = match bytes[5] {
            8 => QuantKind::Int8,
            4 => QuantKind::Int4,
            _ => return Err(QuantError::Header("a kind other than int8 (8) or int4 (4)")),
        };
        if bytes[6..8].iter().chain(&bytes[24..64]).any(|&b| b != 0) {
            return Err(QuantError::Header("non-zero reserved bytes"));
        }
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let (rows, cols) = (u32_at(8) as usize, u32_at(12) as usize);
        let want = Self::stored_len(kind, rows, cols).ok_or(QuantError::Shape { rows, cols })?;
        if want != bytes.len() as u64 {
            return Err(QuantError::Length {
                kind: kind.name(),
                rows,
                cols,
                want,
                got: bytes.len(),
            });
        }
        let (codes_len, _) = kind.sizes(rows, cols);
        let (codes, scales) = bytes[MATRIX_HEADER_BYTES..].split_at(codes_len);
        Ok(QuantMatrix {
            kind,
            rows,
            cols,
            source_xxh3: u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes")),
            codes,
            scales,
        })
    }

    /// A matrix from its codes and scale bytes held apart (a draft trunk's two tensors); the
    /// source hash is unknown (0).
    pub fn from_parts(
        kind: QuantKind,
        rows: usize,
        cols: usize,
        codes: &'a [u8],
        scales: &'a [u8],
    ) -> Result<QuantMatrix<'a>, QuantError> {
        if Self::stored_len(kind, rows, cols).is_none() {
            return Err(QuantError::Shape { rows, cols });
        }
        if (codes.len(), scales.len()) != kind.sizes(rows, cols) {
            return Err(QuantError::Header(
                "codes or scales of another size than the shape's",
            ));
        }
        Ok(QuantMatrix {
            kind,
            rows,
            cols,
            source_xxh3: 0,
            codes,
            scales,
        })
    }

    /// int8 or int4.
    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The codes (`[rows, cols]` int8, or `[rows, cols/2]` nibble pairs).
    pub fn codes(&self) -> &'a [u8] {
        self.codes
    }

    /// The little-endian f32 scales (`[rows]` or `[rows, cols/32]`).
    pub fn scales(&self) -> &'a [u8] {
        self.scales
    }

    /// XXH3-64 of the checkpoint's bf16 bytes this matrix was quantized from (0 when unknown,
    /// [`QuantMatrix::from_parts`]).
    pub fn source_xxh3(&self) -> u64 {
        self.source_xxh3
    }
}

/// Quantize a little-endian bf16 matrix `[rows, cols]` into one stored [`QuantMatrix`]: the
/// header (with the XXH3-64 of `raw`), the codes, the scales.
pub fn encode_matrix(
    kind: QuantKind,
    raw: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<u8>, QuantError> {
    let total =
        QuantMatrix::stored_len(kind, rows, cols).ok_or(QuantError::Shape { rows, cols })?;
    let (codes, scales) = quantize_bf16(kind, raw, rows, cols)?;
    let mut out = Vec::with_capacity(total as usize);
    out.extend_from_slice(&MATRIX_MAGIC);
    out.push(MATRIX_VERSION);
    out.push(match kind {
        QuantKind::Int8 => 8,
        QuantKind::Int4 => 4,
    });
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&(rows as u32).to_le_bytes());
    out.extend_from_slice(&(cols as u32).to_le_bytes());
    let mut h = twox_hash::XxHash3_64::new();
    h.write(raw);
    out.extend_from_slice(&h.finish().to_le_bytes());
    out.resize(MATRIX_HEADER_BYTES, 0);
    out.extend_from_slice(&codes);
    out.extend_from_slice(&scales);
    debug_assert_eq!(out.len() as u64, total);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_rows_round_trip_within_half_a_step() {
        let cols = 96;
        let w: Vec<f32> = (0..cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0 * if i < 32 { 0.01 } else { 1.0 })
            .collect();
        for kind in [QuantKind::Int8, QuantKind::Int4] {
            let (cb, sb) = kind.sizes(1, cols);
            let (mut c, mut s) = (vec![0u8; cb], vec![0u8; sb]);
            quantize_row(kind, &w, &mut c, &mut s);
            let back = dequantize_row(kind, &c, &s, cols);
            for (i, (&a, &b)) in w.iter().zip(&back).enumerate() {
                let (step, clamped) = match kind {
                    QuantKind::Int8 => (scale_of(&w, 127.0), false),
                    QuantKind::Int4 => {
                        let s = signed_scale_of(&w[i / GROUP * GROUP..][..GROUP]);
                        // Only code 7 may be clamped (a value up to 8 steps opposite the extreme).
                        (s.abs(), (b / s).round() == 7.0)
                    }
                };
                let bound = if clamped { step } else { step * 0.5 };
                assert!(
                    (a - b).abs() <= bound + 1e-7,
                    "{kind:?} col {i}: {a} vs {b}"
                );
            }
            if kind == QuantKind::Int4 {
                // Each group's value of largest magnitude is code -8: exact.
                for (g, bg) in w.chunks_exact(GROUP).zip(back.chunks_exact(GROUP)) {
                    let i = (0..GROUP)
                        .max_by(|&x, &y| g[x].abs().total_cmp(&g[y].abs()).then(y.cmp(&x)))
                        .unwrap();
                    assert_eq!(bg[i], g[i], "{g:?}");
                }
            }
            // The row's largest magnitude is represented exactly (±qmax codes).
            let (imax, _) = w
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .unwrap();
            assert!((back[imax] - w[imax]).abs() <= w[imax].abs() * 1e-6);
        }
    }

    #[test]
    fn zero_and_non_finite_rows_quantize_to_zero_codes() {
        for kind in [QuantKind::Int8, QuantKind::Int4] {
            let (cb, sb) = kind.sizes(1, 32);
            let (mut c, mut s) = (vec![1u8; cb], vec![1u8; sb]);
            quantize_row(kind, &[0.0; 32], &mut c, &mut s);
            assert!(dequantize_row(kind, &c, &s, 32).iter().all(|&v| v == 0.0));
            let mut w = [1.0f32; 32];
            w[3] = f32::NAN;
            w[4] = f32::INFINITY;
            quantize_row(kind, &w, &mut c, &mut s);
            let back = dequantize_row(kind, &c, &s, 32);
            assert!(back.iter().all(|v| v.is_finite()), "{kind:?}: {back:?}");
        }
    }

    #[test]
    fn kind_parses_its_names_only() {
        assert_eq!("int8".parse::<QuantKind>(), Ok(QuantKind::Int8));
        assert_eq!("int4".parse::<QuantKind>(), Ok(QuantKind::Int4));
        assert!("fp8".parse::<QuantKind>().is_err());
        assert_eq!(QuantKind::Int4.sizes(3, 64), (96, 24));
    }
}
