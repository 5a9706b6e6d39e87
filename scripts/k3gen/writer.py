"""Safetensors shards + model.safetensors.index.json + config.json + k3-manifest.json."""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass

from .atomic import atomic_write, remove_stale
from .config import config_text
from .graph import DTYPE_SIZE, Unit, assign_shards, build_units, shard_name
from .presets import Dims
from .values import FastPools, tensor_chunks


NAME_OK = re.compile(r"[A-Za-z0-9_.]+")


@dataclass
class ShardPlan:
    file: str
    units: list[Unit]
    header: bytes  # 8-byte length prefix + padded JSON
    data_size: int


def safetensors_header(units: list[Unit]) -> tuple[bytes, int]:
    """Header bytes (LE u64 length + JSON padded with spaces to a multiple of 8) and the
    data size. Offsets are relative to the start of the data area, in unit order.

    The JSON is formatted by hand (it is the hot path of the 497k-tensor skeleton); tensor
    names are plain ASCII without quotes or backslashes, which NAME_OK enforces."""
    parts = ['{"__metadata__":{"format":"pt"}']
    seen = set()
    off = 0
    for u in units:
        for t in u.tensors:
            if off % DTYPE_SIZE[t.dtype]:
                raise ValueError(f"{t.name} would start at misaligned offset {off}")
            if t.name in seen or not NAME_OK.fullmatch(t.name):
                raise ValueError(f"duplicate or unsafe tensor name {t.name!r}")
            seen.add(t.name)
            shape = ",".join(map(str, t.shape))
            parts.append(f'"{t.name}":{{"dtype":"{t.dtype}","shape":[{shape}],"data_offsets":[{off},{off + t.nbytes}]}}')
            off += t.nbytes
    text = (",".join(parts) + "}").encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, off


def index_text(total: int, weight_map: dict[str, str]) -> str:
    """The index as transformers writes it (2-space indent, sorted names), built line by line
    because json.dump with indent is slow for half a million entries."""
    enc = json.encoder.encode_basestring
    lines = [f"    {enc(k)}: {enc(v)}" for k, v in sorted(weight_map.items())]
    return (
        '{\n  "metadata": {\n    "total_size": %d\n  },\n  "weight_map": {\n' % total
        + ",\n".join(lines)
        + "\n  }\n}\n"
    )


def plan(d: Dims) -> list[ShardPlan]:
    d.validate()
    units = build_units(d)
    which = assign_shards(units, d.shards)
    per_shard: list[list[Unit]] = [[] for _ in range(d.shards)]
    for u, s in zip(units, which):
        per_shard[s].append(u)
    plans = []
    for i, mine in enumerate(per_shard):
        header, size = safetensors_header(mine)
        plans.append(ShardPlan(shard_name(i, d.shards), mine, header, size))
    return plans


MANIFEST = "k3-manifest.json"


def manifest_text(source: str, shards: list[tuple[str, int, str]]) -> str:
    """The checkpoint manifest (docs/SPEC.md §6.11): every shard's file name, size and sha256."""
    return json.dumps({
        "format": 1,
        "source": source,
        "shards": [{"file": f, "size": n, "sha256": h} for f, n, h in sorted(shards)],
    }, indent=1) + "\n"


def write_checkpoint(d: Dims, out_dir: str, seed: int, config_shape: str = "nested", decoy_head_dim: bool = False, given: dict | None = None) -> list[ShardPlan]:
    """Write the shards, the index, the config and — unless the data is left as holes (the
    skeleton has no content to vouch for) — the manifest with each shard's sha256, hashed as it
    is written. ``given`` (values "given"): name -> the tensor's bytes as a flat array already in
    its dtype (BF16 bit patterns, little-endian F32, U8), e.g. a trained model's (scripts/k3train)."""
    os.makedirs(out_dir, exist_ok=True)
    remove_stale(out_dir)
    if (d.values == "given") != (given is not None):
        raise ValueError(f"preset {d.name}: values {d.values!r} and given tensors go together")
    plans = plan(d)
    pools = FastPools(seed) if d.values == "fast" else None
    weight_map: dict[str, str] = {}
    total = 0
    hashes: list[tuple[str, int, str]] = []
    for sp in plans:
        path = os.path.join(out_dir, sp.file)
        sha = hashlib.sha256(sp.header)
        with atomic_write(path) as f:
            f.write(sp.header)
            if d.values == "hole":
                # Real header, data left as a hole: the file is sparse.
                f.truncate(len(sp.header) + sp.data_size)
            else:
                for u in sp.units:
                    for t in u.tensors:
                        written = 0
                        chunks = [given[t.name]] if given is not None else tensor_chunks(t, d.values, seed, pools)
                        for chunk in chunks:
                            b = memoryview(chunk).cast("B")
                            f.write(b)
                            sha.update(b)
                            written += chunk.nbytes
                        if written != t.nbytes:
                            raise AssertionError(f"{t.name}: wrote {written} bytes, expected {t.nbytes}")
        hashes.append((sp.file, len(sp.header) + sp.data_size, sha.hexdigest()))
        for u in sp.units:
            for t in u.tensors:
                weight_map[t.name] = sp.file
                total += t.nbytes
    with atomic_write(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        f.write(index_text(total, weight_map))
    with atomic_write(os.path.join(out_dir, "config.json"), "w") as f:
        f.write(config_text(d, config_shape, decoy_head_dim))
    if d.values != "hole":
        with atomic_write(os.path.join(out_dir, MANIFEST), "w") as f:
            f.write(manifest_text(f"scripts/make-checkpoint.py (synthetic, seed {seed})", hashes))
    return plans
