"""Tensor values, produced as a stream of little-endian byte chunks so no large tensor is
ever held in memory.

Two modes:
* exact: every tensor has its own numpy Generator seeded from (seed, sha256(name)), values
  are drawn from the recipe below, in row chunks. Used by tiny and small.
* fast: the big BF16/U8 tensors are cut from per-run pools of random values (random offset
  per chunk, random low-mantissa/sign mask per chunk, scale applied exactly as a power of two
  on the exponent field), so 16 GB of weights cost disk time, not RNG time. Small tensors
  (vectors, conv kernels, A_log, biases) still use the exact recipe.

Recipes (role -> values):
  embed       N(0,1)                                  BF16
  linear      N(0,1) * param / sqrt(fan_in)           BF16 ([out, in], fan_in = in)
  gain        1 + param * N(0,1)                      BF16 or F32 (norm gains)
  res_proj    N(0,1) * param / sqrt(numel)            BF16 (AttnRes [1, E] query vectors)
  conv        N(0,param), +1 on the current-token tap F32 ([P, 1, K]; tap K-1 = current token)
  a_log       linspace(-1, 1.5, H), zero tail         F32 ([head_dim], H = param heads)
  normal_f32  N(0, param)                             F32 (dt_bias, e_score_correction_bias)
  mx_packed   uniform random bytes (two E2M1 codes)   U8
  mx_scale    E8M0 bytes uniform in c-2..c+2 where    U8
              2^(c-127) * rms(E2M1) ~ 1/sqrt(fan_in)
"""
from __future__ import annotations

import hashlib
import math
from typing import Iterator

import numpy as np
# numpy imports its random module lazily, on first use: in the middle of the first shard's write,
# where an exception a signal handler raises (SIGTERM, Ctrl-C) is lost inside the extension
# module's initialisation and the interrupted writer runs on to exit 0. Imported here, up front.
import numpy.random  # noqa: F401, E402

from .graph import Tensor

CHUNK = 1 << 22  # elements per chunk (at most 16 MiB of f32 temporaries)
POOL = 1 << 24  # elements per fast-mode pool
E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """Independent of write order: a tensor's values depend only on (seed, name)."""
    words = np.frombuffer(hashlib.sha256(name.encode()).digest(), dtype="<u4")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *words.tolist()])))


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bit patterns (no NaN/inf in our data)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype("<u2")


def e8m0_centre(fan_in: int) -> int:
    """E8M0 byte c with 2^(c-127) * rms(E2M1) close to 1/sqrt(fan_in)."""
    return 127 + round(math.log2(1.0 / (E2M1_RMS * math.sqrt(fan_in))))


def _row_chunks(t: Tensor) -> Iterator[tuple[int, int]]:
    """(start_row, rows) pieces of at most CHUNK elements (at least one row each)."""
    rows = t.shape[0] if t.shape else 1
    per_row = max(1, t.numel // max(rows, 1))
    step = max(1, CHUNK // per_row)
    for r in range(0, rows, step):
        yield r, min(step, rows - r)


def exact_chunks(t: Tensor, seed: int) -> Iterator[np.ndarray]:
    rng = tensor_rng(seed, t.name)
    role, p = t.role, t.param
    if role in ("embed", "linear", "res_proj", "gain", "normal_f32"):
        per_row = t.numel // t.shape[0]
        for _, rows in _row_chunks(t):
            x = rng.standard_normal(rows * per_row)
            if role == "linear":
                x *= p / math.sqrt(t.shape[-1])
            elif role == "res_proj":
                x *= p / math.sqrt(t.numel)
            elif role == "gain":
                x = 1.0 + p * x
            elif role == "normal_f32":
                x *= p
            yield _encode(x, t.dtype)
    elif role == "conv":
        P, _, K = t.shape
        w = rng.standard_normal((P, 1, K)) * p
        w[:, :, K - 1] += 1.0
        yield _encode(w.ravel(), t.dtype)
    elif role == "a_log":
        heads, D = int(p), t.shape[0]
        a = np.zeros(D)
        a[:heads] = np.linspace(-1.0, 1.5, heads)
        yield _encode(a, t.dtype)
    elif role == "mx_packed":
        for _, rows in _row_chunks(t):
            yield rng.integers(0, 256, rows * t.shape[1], dtype=np.uint8)
    elif role == "mx_scale":
        c = e8m0_centre(int(p))
        for _, rows in _row_chunks(t):
            yield rng.integers(c - 2, c + 3, rows * t.shape[1], dtype=np.uint8)
    else:
        raise ValueError(f"{t.name}: no exact recipe for role {role!r}")


def _encode(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return f32_to_bf16_bits(x.astype(np.float32))
    if dtype == "F32":
        return x.astype("<f4")
    raise ValueError(f"cannot encode floats as {dtype}")


class FastPools:
    """Per-run pools for fast mode, built lazily from the run seed."""

    def __init__(self, seed: int):
        self.seed = seed
        self._normal: np.ndarray | None = None
        self._scaled: dict[int, np.ndarray] = {}
        self._bytes: np.ndarray | None = None
        self._scales: dict[int, np.ndarray] = {}

    def normal_bf16(self, log2_scale: int) -> np.ndarray:
        """bf16 bits of N(0,1) * 2^log2_scale (exact: only the exponent field changes)."""
        if self._normal is None:
            x = tensor_rng(self.seed, "__pool_normal__").standard_normal(POOL, dtype=np.float32)
            # Keep every value far from the subnormal range so exponent shifts stay exact.
            tiny = np.abs(x) < 2.0**-20
            x[tiny] = np.copysign(2.0**-20, x[tiny])
            self._normal = f32_to_bf16_bits(x)
        if log2_scale not in self._scaled:
            if not -60 < log2_scale < 60:
                raise ValueError(f"scale 2^{log2_scale} out of range")
            shifted = self._normal.astype(np.int32) + (log2_scale << 7)
            self._scaled[log2_scale] = shifted.astype("<u2")
        return self._scaled[log2_scale]

    def random_bytes(self) -> np.ndarray:
        if self._bytes is None:
            self._bytes = tensor_rng(self.seed, "__pool_bytes__").integers(0, 256, POOL, dtype=np.uint8)
        return self._bytes

    def scale_bytes(self, centre: int) -> np.ndarray:
        if centre not in self._scales:
            rng = tensor_rng(self.seed, f"__pool_scales_{centre}__")
            self._scales[centre] = rng.integers(centre - 2, centre + 3, POOL, dtype=np.uint8)
        return self._scales[centre]


FAST_ROLES = ("embed", "linear", "mx_packed", "mx_scale")


def fast_chunks(t: Tensor, seed: int, pools: FastPools) -> Iterator[np.ndarray]:
    if t.role not in FAST_ROLES or t.numel <= CHUNK:
        yield from exact_chunks(t, seed)
        return
    rng = tensor_rng(seed, t.name)
    if t.role in ("embed", "linear"):
        scale = t.param / math.sqrt(t.shape[-1]) if t.role == "linear" else 1.0
        pool = pools.normal_bf16(round(math.log2(scale)))
        sign_or_low = True
    elif t.role == "mx_packed":
        pool, sign_or_low = pools.random_bytes(), False
    else:
        pool, sign_or_low = pools.scale_bytes(e8m0_centre(int(t.param))), False
    left = t.numel
    while left:
        n = min(CHUNK, left)
        off = int(rng.integers(0, POOL - n + 1))
        piece = pool[off : off + n]
        if sign_or_low:
            # Flip the sign and/or the 3 lowest mantissa bits: no two chunks are copies.
            mask = int(rng.integers(0, 8)) | (int(rng.integers(0, 2)) << 15)
            piece = piece ^ np.uint16(mask)
        elif t.role == "mx_packed":
            piece = piece ^ np.uint8(int(rng.integers(0, 256)))
        yield piece
        left -= n


def tensor_chunks(t: Tensor, mode: str, seed: int, pools: FastPools | None) -> Iterator[np.ndarray]:
    if mode == "exact":
        return exact_chunks(t, seed)
    if mode == "fast":
        assert pools is not None
        return fast_chunks(t, seed, pools)
    raise ValueError(f"no data for mode {mode!r}")
