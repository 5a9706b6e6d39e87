"""A small, bounded safetensors reader (SPEC.md §2.1).

Layout: 8-byte little-endian header length N, N bytes of JSON header, then the data region.
Header entries: name → {dtype, shape, data_offsets: [begin, end]} with offsets relative to the
start of the data region. Every length and offset is checked against the file size before use.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class SafetensorsError(ValueError):
    """Malformed or unsupported safetensors file (exit code 2)."""


# Byte sizes of the safetensors dtypes (for offset validation). Only BF16/F32/U8 are decoded.
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}

MAX_HEADER_BYTES = 256 << 20


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int          # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            if size < 8:
                raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors header")
            f.seek(0)
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen == 0 or hlen > size - 8 or hlen > MAX_HEADER_BYTES:
                raise SafetensorsError(f"{path}: header length {hlen} out of range (file {size} bytes)")
            raw = f.read(hlen)
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot read: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    data_start = 8 + hlen
    data_len = size - data_start
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise SafetensorsError(f"{where}: entry is not an object")
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise SafetensorsError(f"{where}: unknown dtype {dtype!r}")
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise SafetensorsError(f"{where}: bad shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise SafetensorsError(f"{where}: bad data_offsets {offs!r}")
        begin, end = offs
        if not 0 <= begin <= end <= data_len:
            raise SafetensorsError(f"{where}: data_offsets {offs} outside the data region ({data_len} bytes)")
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        if nbytes != end - begin:
            raise SafetensorsError(f"{where}: shape {shape} × {dtype} = {nbytes} bytes but offsets span {end - begin}")
        out[name] = TensorInfo(path, name, dtype, tuple(shape), data_start + begin, nbytes)
    return out


def bf16_bits_to_f64(bits: np.ndarray) -> np.ndarray:
    """Exact bf16 → float: the 16 bits become the high half of an f32 (never via f16)."""
    wide = bits.astype(np.uint32) << np.uint32(16)
    return wide.view(np.float32).astype(np.float64)


def load_tensor(info: TensorInfo) -> np.ndarray:
    """Read one tensor: BF16/F32 → float64 (exact), U8 → uint8. Other dtypes are refused."""
    if info.dtype not in ("BF16", "F32", "U8"):
        raise SafetensorsError(f"{info.file}: tensor {info.name!r} has dtype {info.dtype}; "
                               "the K3 text model uses only BF16, F32 and U8")
    try:
        with open(info.file, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.nbytes)
    except OSError as e:
        raise SafetensorsError(f"{info.file}: cannot read tensor {info.name!r}: {e}") from e
    if len(raw) != info.nbytes:
        raise SafetensorsError(f"{info.file}: tensor {info.name!r} truncated")
    if info.dtype == "BF16":
        arr = bf16_bits_to_f64(np.frombuffer(raw, dtype="<u2"))
    elif info.dtype == "F32":
        arr = np.frombuffer(raw, dtype="<f4").astype(np.float64)
    else:
        arr = np.frombuffer(raw, dtype=np.uint8).copy()
    return arr.reshape(info.shape)
