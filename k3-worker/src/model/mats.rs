//! The typed matrices a layer's weights arrive as (a trunk matrix: bf16, EC-BF16 coded, or
//! int8/int4 quantized; a routed expert: three MXFP4 matrices) and the row operations on activations. A leaf:
//! the maths files and the weights feed read it, and it reads none of them. A new storage form
//! of a matrix is a new [`Mat`] variant and its arm in [`linear_into`], nothing else.

use k3_proto::ecbf16::CodedMatrix;
use k3_proto::expert::{ExpertLayout, ExpertPart};
use k3_proto::quant::QuantMatrix;
use k3_store::runtime::source::ExpertBatch;

use crate::kernels::Bf16Matrix;

/// A weight matrix as stored: bf16 (a checkpoint), f32 (a checkpoint's F32 router), EC-BF16
/// coded bf16 (a coded packed trunk, SPEC.md §6.13: the same numbers), or int8/int4 codes and
/// scales (`k3_proto::quant`: a quantized packed trunk, or a draft trunk).
#[derive(Clone, Copy, Debug)]
pub enum Mat<'a> {
    /// Little-endian bf16 `[rows, cols]`.
    Bf16(&'a [u8]),
    /// Little-endian f32 `[rows, cols]` (an F32 router; `kernels::matmul_f32`).
    F32(&'a [u8]),
    /// EC-BF16 coded bf16, parsed, of the shape it was bound with.
    Coded(CodedMatrix<'a>),
    /// int8 or int4 codes and their f32 scales (`k3_proto::quant`): a quantized packed trunk's
    /// matrix (lossy, opt-in, SPEC.md §6.15) or a draft trunk's, of the shape it was bound with.
    Quant(QuantMatrix<'a>),
}

/// `y [n, rows] = x [n, cols] · Wᵀ` (a thin wrapper over the kernels).
pub(crate) fn linear(w: Mat<'_>, rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f32> {
    let mut y = Vec::new();
    linear_into(w, rows, cols, x, n, &mut y);
    y
}

/// [`linear`] into `y`, whose allocation is reused (resized to `[n, rows]`).
pub(crate) fn linear_into(
    w: Mat<'_>,
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut Vec<f32>,
) {
    let y = zeroed(y, n * rows);
    let k = crate::kernels::Kernels::active();
    match w {
        // Raw and coded bf16 multiply to the same bits (SPEC.md §6.13).
        Mat::Bf16(bytes) => k.matmul_matrix(&Bf16Matrix::Raw { bytes, rows, cols }, x, n, y),
        Mat::Coded(m) => {
            debug_assert_eq!((m.rows(), m.cols()), (rows, cols), "coded matrix shape");
            k.matmul_matrix(&Bf16Matrix::Coded(m), x, n, y)
        }
        Mat::F32(w) => crate::kernels::matmul_f32(w, rows, cols, x, n, y),
        Mat::Quant(m) => {
            debug_assert_eq!((m.rows(), m.cols()), (rows, cols), "quantized matrix shape");
            k.matmul_quant(&m, x, n, y)
        }
    }
}

/// RMSNorm of each of the `x.len() / w.len()` rows of `x`, into `y` (its allocation reused).
pub(crate) fn rms_norm_rows_into(x: &[f32], w: &[f32], eps: f32, y: &mut Vec<f32>) {
    let y = zeroed(y, x.len());
    for (xr, yr) in x.chunks_exact(w.len()).zip(y.chunks_exact_mut(w.len())) {
        crate::kernels::rms_norm(xr, w, eps, yr);
    }
}

/// `v` as `len` zeros, reusing its allocation: a forward pass's buffers live in the sequence's
/// [`state::Work`] and grow to the largest pass once, so a decode step allocates nothing per
/// layer (ARCHITECTURE.md, "Run state"). The kernels' per-thread buffers use it too.
pub(crate) use crate::kernels::zeroed;

/// `dst` becomes a copy of `src`, reusing its allocation.
pub(crate) fn copy_into<T: Copy>(dst: &mut Vec<T>, src: &[T]) {
    crate::kernels::grow_exact(dst, src.len());
    dst.extend_from_slice(src);
}

/// One MXFP4 matrix `[rows, cols]` of a routed expert: packed E2M1 codes and their E8M0 scales
/// (SPEC.md §2).
#[derive(Clone, Copy, Debug)]
pub struct Mxfp4<'a> {
    /// Two codes a byte.
    pub packed: &'a [u8],
    /// One scale per 32 codes.
    pub scales: &'a [u8],
}

impl Mxfp4<'_> {
    /// `y [m, rows] = x [m, cols] · Wᵀ`.
    pub fn matmul(&self, rows: usize, cols: usize, x: &[f32], m: usize, y: &mut [f32]) {
        crate::kernels::matmul_mxfp4(self.packed, self.scales, rows, cols, x, m, y)
    }
}

/// One routed expert's three matrices: `w1` (gate) and `w3` (up) `[inter, latent]`, `w2` (down)
/// `[latent, inter]`.
#[derive(Clone, Copy, Debug)]
pub struct ExpertMats<'a> {
    /// Gate projection.
    pub w1: Mxfp4<'a>,
    /// Down projection.
    pub w2: Mxfp4<'a>,
    /// Up projection.
    pub w3: Mxfp4<'a>,
}

/// A source's answer to one expert request ([`ExpertBatch`], request order) seen as typed
/// matrices: where each expert's parts sit in its slot ([`ExpertLayout`]) is read here, once,
/// not by the maths.
#[derive(Clone, Copy, Debug)]
pub struct Experts<'b> {
    batch: &'b ExpertBatch,
    layout: ExpertLayout,
}

impl<'b> Experts<'b> {
    /// The answer `batch`, whose experts have the slot layout `layout`.
    pub fn new(batch: &'b ExpertBatch, layout: ExpertLayout) -> Experts<'b> {
        Experts { batch, layout }
    }

    /// Experts answered.
    pub fn len(&self) -> usize {
        self.batch.experts.len()
    }

    /// True when the answer holds no expert.
    pub fn is_empty(&self) -> bool {
        self.batch.experts.is_empty()
    }

    /// The `j`-th expert's matrices, or why it is unusable (its load failed, or its region is
    /// not one expert's size).
    pub fn get(&self, j: usize) -> Result<ExpertMats<'b>, k3_store::runtime::source::ExpertError> {
        let layout = self.layout;
        let region = match self.batch.experts.get(j) {
            Some(Ok(r)) => r,
            Some(Err(e)) => return Err(e.clone()),
            None => return Err(k3_store::runtime::source::ExpertError::NoAnswer { index: j }),
        };
        let bytes = region.bytes();
        if bytes.len() != layout.expert_bytes() {
            return Err(k3_store::runtime::source::ExpertError::WrongSize {
                bytes: bytes.len(),
                expected: layout.expert_bytes(),
            });
        }
        let part = |p: ExpertPart| {
            let o = layout.part_offset(p);
            &bytes[o..o + layout.part_bytes(p)]
        };
        let mat = |packed, scales| Mxfp4 {
            packed: part(packed),
            scales: part(scales),
        };
        Ok(ExpertMats {
            w1: mat(ExpertPart::W1Packed, ExpertPart::W1Scale),
            w2: mat(ExpertPart::W2Packed, ExpertPart::W2Scale),
            w3: mat(ExpertPart::W3Packed, ExpertPart::W3Scale),
        })
    }
}
