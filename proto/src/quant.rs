//! The quantized weight formats of a draft trunk (`k3-ctl pack-trunk --draft`, SPEC.md §6.10).
//!
//! A draft trunk is a lossy copy of the trunk that drafts ids for speculative decoding; the exact
//! model verifies every draft, so the quantization changes how many drafts are accepted, never an
//! emitted id. Each quantized matrix `W [rows, cols]` (bf16 in the checkpoint) is stored as two
//! tensors of the same layer run: the codes under the matrix's own name and its scales under the
//! name + [`SCALE_SUFFIX`]. Symmetric, round to nearest (ties away from zero), zero scale for an
//! all-zero row or group:
//!
//! * **int8** ([`QuantKind::Int8`]): codes `I8 [rows, cols]`, `q = round(w / s)` in −127..=127,
//!   one scale per row, `F32 [rows]`, `s = max|w| / 127`.
//! * **int4** ([`QuantKind::Int4`]): codes `U8 [rows, cols/2]`, column `2i` in the low nibble and
//!   `2i+1` in the high nibble of byte `i`, each nibble `q + 8` with `q` in −7..=7; one scale per
//!   group of [`GROUP`] columns, `F32 [rows, cols/32]`, `s = max|w| / 7` over the group.
//!
//! `w ≈ q · s`. Only matrices whose `cols` is a multiple of [`GROUP`] are quantized.

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
                let s = scale_of(g, 7.0);
                sg.copy_from_slice(&s.to_le_bytes());
                for (c, pair) in cg.iter_mut().zip(g.chunks_exact(2)) {
                    let lo = (code(pair[0], s, 7.0) + 8) as u8;
                    let hi = (code(pair[1], s, 7.0) + 8) as u8;
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
                let step = match kind {
                    QuantKind::Int8 => scale_of(&w, 127.0),
                    QuantKind::Int4 => scale_of(&w[i / GROUP * GROUP..][..GROUP], 7.0),
                };
                assert!(
                    (a - b).abs() <= step * 0.5 + 1e-7,
                    "{kind:?} col {i}: {a} vs {b}"
                );
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
