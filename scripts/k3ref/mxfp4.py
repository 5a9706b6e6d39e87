"""MXFP4 (compressed-tensors ``mxfp4-pack-quantized``) dequantisation, SPEC.md §4.

code (4 bits): bit 3 = sign, bits 0..2 index E2M1 = [0, .5, 1, 1.5, 2, 3, 4, 6].
weight_packed[r, i] holds column 2i in the LOW nibble and column 2i+1 in the HIGH nibble.
weight_scale[r, g] is an E8M0 byte for columns 32g..32g+31: factor 2^(s-127).
E8M0 255 (NaN in the OCP spec) is treated as factor 0 and counted (ARCHITECTURE.md decision).
"""
from __future__ import annotations

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float64)

GROUP = 32


class Mxfp4Error(ValueError):
    pass


def dequantize(packed: np.ndarray, scale: np.ndarray, in_features: int) -> tuple[np.ndarray, int]:
    """Return (W [out, in] float64, number of E8M0 255 bytes seen)."""
    if packed.dtype != np.uint8 or scale.dtype != np.uint8:
        raise Mxfp4Error("weight_packed / weight_scale must be U8")
    if in_features % GROUP:
        raise Mxfp4Error(f"MXFP4 input width {in_features} is not a multiple of {GROUP}")
    out = packed.shape[0]
    if packed.shape != (out, in_features // 2) or scale.shape != (out, in_features // GROUP):
        raise Mxfp4Error(f"MXFP4 shapes packed {packed.shape} / scale {scale.shape} do not fit "
                         f"a [{out}, {in_features}] matrix")
    codes = np.empty((out, in_features), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F          # even column: low nibble
    codes[:, 1::2] = packed >> 4            # odd column: high nibble
    nan_scales = int(np.count_nonzero(scale == 255))
    factor = np.ldexp(1.0, scale.astype(np.int64) - 127)
    factor[scale == 255] = 0.0
    w = E2M1[codes] * np.repeat(factor, GROUP, axis=1)
    return w, nan_scales
