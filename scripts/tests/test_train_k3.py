"""The trained-proxy smoke test (issue #31): `scripts/train_k3.py OUT --smoke` (a ten-step
training: the loss must fall by more than a nat; 11.7 → 7.1 here), then the
exported checkpoint through three forwards that must agree:

* the trainer's own forward (JAX, float64) on the EXPORTED weights (`train_k3.py --reference`);
* the independent float64 numpy reference (`scripts/k3_reference.py`);
* k3 (`k3-worker --standalone`), ids identical and step-0 logits within max|Δ|/max|ref| ≤ 1e-4,
  the tolerance of k3-worker/tests/gate.rs.

The first run on a machine installs the trainer's venv (pinned JAX for CPU,
scripts/requirements-train.txt) and downloads the pinned corpus, both into the machine's k3 cache
outside the clone (~/.cache/k3/, scripts/k3cache.py); later runs, from any clone, reuse both.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train_k3

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "scripts" / "train_k3.py"
# "[BOS]Django is a high-level Python web framework that" with the real tokenizer
PROMPT = "163584,35,19488,387,261,2293,14947,17763,4891,15113,473"
GEN = 8
TOL = 1e-4


def binary(name: str) -> Path:
    p = Path(os.environ.get("K3_BIN_DIR", ROOT / "target" / "debug")) / name
    assert p.exists(), f"{p} missing: build the workspace first (scripts/test.sh does)"
    return p


def run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}\n--- stderr\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """`train_k3.py OUT --smoke` (--steps 10 --val-limit 8). scripts/test.sh runs that command
    from its start, beside the build (the training needs no binary), and names its OUT in
    K3_TRAIN_SMOKE; without it the fixture trains here."""
    made = os.environ.get("K3_TRAIN_SMOKE")
    if made:
        return Path(made)
    out = tmp_path_factory.mktemp("trained") / "model"
    run([sys.executable, TRAIN, out, "--smoke"], timeout=1800)
    return out


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_smoke_checkpoint_gives_the_trainers_ids_in_k3_and_the_numpy_reference(smoke, tmp_path):
    meta = json.loads((smoke / "training.json").read_text())
    assert meta["steps"] == 10 and meta["corpus"]["sha256"].startswith("de450c09")
    hist = meta["history"]
    assert hist[-1]["train_ce"] < hist[0]["train_ce"] - 1.0, hist      # it learned something

    ref = tmp_path / "trainer"
    r = run([sys.executable, TRAIN, "--reference", smoke, "--ids", PROMPT, "--gen", GEN, "--out-dir", ref],
            timeout=1200)
    trainer_ids = json.loads((ref / "greedy_ids.json").read_text())
    assert r.stdout.strip() == ",".join(map(str, trainer_ids))
    assert len(trainer_ids) == GEN

    logits = tmp_path / "k3.f32"
    w = run([binary("k3-worker"), "--standalone", smoke, "--ids", PROMPT, "--gen", GEN,
             "--dump-logits", logits], timeout=600)
    assert [int(t) for t in w.stdout.split()] == trainer_ids

    npref = tmp_path / "numpy"
    venv_py = train_k3.VENV / "bin" / "python"
    run([venv_py, ROOT / "scripts" / "k3_reference.py", smoke, "--ids", PROMPT, "--gen", GEN,
         "--out-dir", npref], timeout=1200)
    assert json.loads((npref / "greedy_ids.json").read_text()) == trainer_ids

    t = np.fromfile(ref / "logits_step0.f32", dtype="<f4")
    n = np.fromfile(npref / "logits_step0.f32", dtype="<f4")
    k = np.fromfile(logits, dtype="<f4")
    assert t.shape == n.shape == k.shape == (163840,)
    assert rel(t, n) <= 1e-6, rel(t, n)              # two float64 forwards
    assert rel(k, t) <= TOL, rel(k, t)


def test_smoke_checkpoint_is_a_k3_checkpoint_with_mxfp4_experts(smoke):
    cfg = json.loads((smoke / "config.json").read_text())
    text = cfg["text_config"]
    assert cfg["model_type"] == "kimi_k3" and text["vocab_size"] == 163840
    assert text["num_experts"] >= 32 and text["num_experts_per_token"] >= 4
    index = json.loads((smoke / "model.safetensors.index.json").read_text())["weight_map"]
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in index
    assert "language_model.lm_head.weight" in index
