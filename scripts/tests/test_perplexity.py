"""`k3-worker --perplexity` against the float64 numpy reference, on the trained proxy (issue 48,
item 2).

The trained proxy is expanded from fixtures/trained/compact.npz once per module; the text is the
start of its held-out text (fixtures/trained/heldout.txt, validation documents never trained on).
What is checked:

* the exact model's mean NLL equals the float64 reference's (scripts/quant_quality.py, which
  tokenizes with tiktoken and runs scripts/k3ref) within 1e-4 nats, over the same ids and windows;
* the int8 and int4 trunks (`k3-ctl pack-trunk --codec`) compared with the exact run's saved
  log-probabilities give the KL and top-1 agreement the reference's own quantization of the
  checkpoint gives (the quantization written twice, independently);
* a run compared with its own base gives KL 0 and full agreement; a base of another text or
  window is refused (exit 2) and writes nothing.

Binaries: target/debug (override with K3_BIN_DIR).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import quant_quality  # noqa: E402
from k3ref.checkpoint import Checkpoint  # noqa: E402
from k3ref.config import read_config  # noqa: E402
from k3ref.model import bind  # noqa: E402

TOK = ROOT / "fixtures" / "tokenizer"
WINDOW = 96
CHARS = 1100


def binary(name):
    p = Path(os.environ.get("K3_BIN_DIR", ROOT / "target" / "debug")) / name
    if not p.is_file():
        pytest.fail(f"{p} not built: run `cargo build --workspace --bins` (scripts/test.sh does)")
    return p


def run(args, code=0):
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=1200)
    assert r.returncode == code, f"{args} exited {r.returncode}: {r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("ppl")
    model = d / "trained"
    run([sys.executable, ROOT / "scripts" / "train_k3.py", model, "--expand",
         ROOT / "fixtures" / "trained" / "compact.npz"])
    text = (ROOT / "fixtures" / "trained" / "heldout.txt").read_text(encoding="utf-8")
    cut = text[:CHARS]
    cut = cut[:cut.rindex("\n") + 1]
    (d / "text.txt").write_text(cut, encoding="utf-8")
    trunks = {}
    for kind in ("ecbf16", "int8", "int4"):
        trunks[kind] = d / f"trunk-{kind}"
        run([binary("k3-ctl"), "pack-trunk", model, trunks[kind], "--codec", kind])
    cfg = read_config(model / "config.json")
    ckpt = Checkpoint(model)
    models = {k: bind(cfg, ckpt if k == "exact" else quant_quality.Quantized(ckpt, k))
              for k in ("exact", "int8", "int4")}
    ids = quant_quality.tokenize(d / "text.txt", TOK)
    ref = quant_quality.score(models, ids, WINDOW)
    return {"dir": d, "model": model, "text": d / "text.txt", "trunks": trunks, "ref": ref}


def perplexity(world, trunk, *extra, code=0, name="r"):
    out = world["dir"] / f"{name}.json"
    r = run([binary("k3-worker"), "--standalone", world["model"], "--trunk", trunk, "--tok", TOK,
             "--perplexity", world["text"], "--ppl-window", WINDOW, "--threads", "2",
             "--out", out, *extra], code=code)
    return r, (json.loads(out.read_text()) if code == 0 else None)


def test_the_exact_models_mean_nll_is_the_float64_references(world):
    base = world["dir"] / "base.k3lp"
    r, j = perplexity(world, world["trunks"]["ecbf16"], "--save-logprobs", base, name="exact")
    ref = world["ref"]["models"]["exact"]
    p = j["perplexity"]
    assert p["positions"] == world["ref"]["positions"] > 150
    assert p["window"] == WINDOW and p["windows"] == world["ref"]["windows"] > 1
    assert abs(p["mean_nll"] - ref["mean_nll"]) < 1e-4, (p, ref)
    assert abs(p["perplexity"] - ref["perplexity"]) < 1e-4 * ref["perplexity"]
    assert j["trunk"]["lossy"] is False and "LOSSY" not in r.stderr
    assert "perplexity:" in r.stderr
    # The base: a header and every position's row, nothing temporary left beside it.
    assert base.stat().st_size == 64 + p["positions"] * 163840 * 4
    assert not [f for f in os.listdir(world["dir"]) if f.endswith(".tmp")]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_trunks_kl_and_agreement_are_the_references(world, kind):
    base = world["dir"] / "base.k3lp"
    if not base.exists():
        perplexity(world, world["trunks"]["ecbf16"], "--save-logprobs", base, name="exact")
    r, j = perplexity(world, world["trunks"][kind], "--kl-base", base, name=kind)
    ref = world["ref"]["models"][kind]
    p, k = j["perplexity"], j["perplexity"]["kl"]
    n = p["positions"]
    assert j["trunk"]["lossy"] is True and f"LOSSY: {kind} trunk" in r.stderr
    # The engine computes in float32 with its kernels, the reference in float64: the same
    # quantization must give the same figures up to that rounding.
    assert abs(p["mean_nll"] - ref["mean_nll"]) < 1e-4, (p, ref)
    assert abs(k["mean"] - ref["kl_mean"]) <= 0.02 * ref["kl_mean"] + 1e-6, (k, ref)
    assert abs(k["p99"] - ref["kl_p99"]) <= 0.05 * ref["kl_p99"] + 1e-5, (k, ref)
    assert abs(k["top1_agreement"] - ref["top1_agreement"]) * n <= 1, (k, ref)
    assert 0 < k["mean"] < 0.05 and k["top1_agreement"] > 0.8, k


def test_a_run_against_its_own_base_is_exact_and_another_texts_base_is_refused(world):
    base = world["dir"] / "base.k3lp"
    if not base.exists():
        perplexity(world, world["trunks"]["ecbf16"], "--save-logprobs", base, name="exact")
    _, j = perplexity(world, world["trunks"]["ecbf16"], "--kl-base", base, name="self")
    k = j["perplexity"]["kl"]
    assert k["mean"] == 0.0 and k["max"] == 0.0 and k["top1_agreement"] == 1.0, k
    # Another window: the base is for other positions (exit 2, no report).
    out = world["dir"] / "refused.json"
    r = run([binary("k3-worker"), "--standalone", world["model"], "--tok", TOK,
             "--perplexity", world["text"], "--ppl-window", WINDOW + 1, "--kl-base", base,
             "--out", out], code=2)
    assert "K3LP" in r.stderr or "made for" in r.stderr, r.stderr
    assert not out.exists()
