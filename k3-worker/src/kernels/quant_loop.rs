//! The row and token loops every SIMD tier's int8/int4 kernel shares (`kernels::quant` states
//! the sequence): a tier supplies only its dots of `R` rows with `T` tokens ([`QuantDots`]);
//! [`tokens`] walks a task's rows in blocks of `R` (then one at a time) for a block of `T`
//! tokens and applies the int8 row scale as the scalar twin does. A leaf: the tiers name it, it
//! names none of them.

use k3_proto::quant::{QuantKind, QuantMatrix};

use super::scalar;

/// A SIMD tier's dots of `R` quantized rows with `T` tokens (`kernels::quant`'s sequence), for the
/// shared row and token loops [`tokens`] / [`block`].
pub(super) trait QuantDots {
    /// int8: `R` rows of codes (`cols` bytes each) × `T` tokens (`cols` values each): each
    /// (row, token)'s sum before the row's scale.
    ///
    /// # Safety
    /// The CPU has the implementing tier's features.
    unsafe fn q8<const R: usize, const T: usize>(
        codes: [&[u8]; R],
        x: [&[f32]; T],
        cols: usize,
    ) -> [[f32; T]; R];

    /// int4: `R` rows of codes (`cols/2` bytes) and scales (`cols/32` f32) × `T` tokens split
    /// per 32 columns: each (row, token)'s sum.
    ///
    /// # Safety
    /// The CPU has the implementing tier's features.
    unsafe fn q4<const R: usize, const T: usize>(
        codes: [&[u8]; R],
        scales: [&[u8]; R],
        x: [&[f32]; T],
        cols: usize,
    ) -> [[f32; T]; R];
}

/// Rows `i0 .. i0+R` (relative to `r0`) of `m` × tokens `t0 .. t0+T` into `out [k, n]`.
///
/// # Safety
/// The CPU has `D`'s tier's features. (The slicing checks that rows, tokens and outputs exist.)
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn block<D: QuantDots, const R: usize, const T: usize>(
    m: &QuantMatrix<'_>,
    r0: usize,
    i0: usize,
    x: &[f32],
    n: usize,
    t0: usize,
    out: &mut [f32],
) {
    let cols = m.cols();
    let (qb, sb) = m.kind().sizes(1, cols);
    let row = |i: usize| r0 + i0 + i;
    let codes: [&[u8]; R] = std::array::from_fn(|i| &m.codes()[row(i) * qb..(row(i) + 1) * qb]);
    let toks: [&[f32]; T] = std::array::from_fn(|t| &x[(t0 + t) * cols..(t0 + t + 1) * cols]);
    let sums = match m.kind() {
        // SAFETY: CPU features are this function's contract; lengths are the slices'.
        QuantKind::Int8 => unsafe { D::q8::<R, T>(codes, toks, cols) },
        QuantKind::Int4 => {
            let scales: [&[u8]; R] =
                std::array::from_fn(|i| &m.scales()[row(i) * sb..(row(i) + 1) * sb]);
            // SAFETY: as above.
            unsafe { D::q4::<R, T>(codes, scales, toks, cols) }
        }
    };
    for (i, sum) in sums.iter().enumerate() {
        let scale = match m.kind() {
            QuantKind::Int8 => Some(scalar::f32_at(m.scales(), row(i))),
            QuantKind::Int4 => None,
        };
        for (t, &v) in sum.iter().enumerate() {
            // int8: the twin's `sum · scale`; int4: the sum.
            out[(i0 + i) * n + t0 + t] = scale.map_or(v, |s| v * s);
        }
    }
}

/// Every row of a task (`k` rows from `r0`) × tokens `t0 .. t0+T`: blocks of `R` rows, then
/// one row at a time.
///
/// # Safety
/// The CPU has `D`'s tier's features.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tokens<D: QuantDots, const R: usize, const T: usize>(
    m: &QuantMatrix<'_>,
    r0: usize,
    k: usize,
    x: &[f32],
    n: usize,
    t0: usize,
    out: &mut [f32],
) {
    let mut i = 0;
    while i + R <= k {
        // SAFETY: CPU features are this function's contract.
        unsafe { block::<D, R, T>(m, r0, i, x, n, t0, out) };
        i += R;
    }
    while i < k {
        // SAFETY: as above.
        unsafe { block::<D, 1, T>(m, r0, i, x, n, t0, out) };
        i += 1;
    }
}
