"""A checkpoint directory: shards through ``model.safetensors.index.json`` (or a scan of
``*.safetensors`` when there is no index), the legacy ``language_model.layers.`` prefix accepted as
``language_model.model.layers.`` (SPEC.md §10 C6), tensors loaded lazily and cached.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from .safetensors import SafetensorsError, TensorInfo, load_tensor, read_header

LEGACY_PREFIX = "language_model.layers."
CANONICAL_PREFIX = "language_model.model.layers."
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint cannot be bound (exit code 2)."""


def canonical_name(name: str) -> str:
    if name.startswith(LEGACY_PREFIX):
        return CANONICAL_PREFIX + name[len(LEGACY_PREFIX):]
    return name


class Checkpoint:
    """Mapping-like view: ``name in ckpt``, ``ckpt[name]`` → float64 (BF16/F32) or uint8 (U8)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        self.shards = self._shard_files()
        self.infos: dict[str, TensorInfo] = {}
        wanted = self._index_map()
        for shard in self.shards:
            try:
                header = read_header(shard)
            except SafetensorsError as e:
                raise CheckpointError(str(e)) from e
            for name, info in header.items():
                if wanted is not None and wanted.get(name) != shard.name:
                    continue          # the index assigns this name to another shard
                key = canonical_name(name)
                if key in self.infos:
                    raise CheckpointError(f"tensor {key!r} appears twice ({self.infos[key].file}, {shard})")
                self.infos[key] = info
        if wanted is not None:
            missing = [n for n in wanted if canonical_name(n) not in self.infos]
            if missing:
                raise CheckpointError(f"{len(missing)} tensors listed in {INDEX_NAME} are absent "
                                      f"from their shard, e.g. {missing[:3]}")
        self._cache: dict[str, np.ndarray] = {}

    def _index_map(self) -> dict[str, str] | None:
        path = self.dir / INDEX_NAME
        if not path.exists():
            return None
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: {e}") from e
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{path}: no `weight_map` object of name → shard file")
        return wm

    def _shard_files(self) -> list[Path]:
        wm = self._index_map()
        if wm is None:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.dir}: no {INDEX_NAME} and no *.safetensors files")
            return files
        names = sorted(set(wm.values()))
        for n in names:
            if "/" in n or "\\" in n or n in ("", ".", ".."):
                raise CheckpointError(f"{INDEX_NAME}: shard name {n!r} is not a plain file name")
            if not (self.dir / n).is_file():
                raise CheckpointError(f"{INDEX_NAME}: shard {n!r} does not exist in {self.dir}")
        return [self.dir / n for n in names]

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._cache:
            info = self.infos.get(name)
            if info is None:
                raise KeyError(name)
            try:
                self._cache[name] = load_tensor(info)
            except SafetensorsError as e:
                raise CheckpointError(str(e)) from e
        return self._cache[name]

    def dtype_of(self, name: str) -> str:
        return self.infos[name].dtype

    def file_hashes(self) -> dict[str, str]:
        """sha256 of every regular file in the checkpoint directory (config, index, shards)."""
        out = {}
        for p in sorted(self.dir.iterdir()):
            if p.is_file():
                h = hashlib.sha256()
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
                out[p.name] = h.hexdigest()
        return out
