"""Where k3 keeps what it installs or downloads once per machine, outside any clone.

``$K3_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/k3``, else ``~/.cache/k3``. It holds the
trainer's pinned JAX environment (``venv-train-<hash of scripts/requirements-train.txt>/``) and
its corpus (``k3train/``: the Django sdist and its tokenization). Every clone and every run of
``scripts/test.sh`` on the machine reuses them; delete the directory to start over.
"""
from __future__ import annotations

import os
from pathlib import Path


def root() -> Path:
    """The cache directory (not created here)."""
    explicit = os.environ.get("K3_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "k3"
