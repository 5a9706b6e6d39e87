#!/usr/bin/env python3
"""Train a small model with Kimi K3's exact tensor graph on real text, export it as a K3
checkpoint, and give the trainer's own greedy ids / step-0 logits on the EXPORTED weights.

    scripts/train_k3.py OUT [--preset k3-train] [--minutes 20] [--steps N] [--seed 1] [--force]
    scripts/train_k3.py OUT --smoke    # the test command's smoke training: --steps 10 --val-limit 8
    scripts/train_k3.py OUT --export-from OUT_OF_A_RUN/trained_params.npz [--preset ...]
    scripts/train_k3.py OUT --expand fixtures/trained/compact.npz      # numpy only
    scripts/train_k3.py --reference MODEL_DIR --ids 1,2,3 [--gen 8] [--out-dir DIR] [--val-windows N]
    scripts/train_k3.py --setup        # only install the environment and fetch + tokenize the corpus

Training: K3's forward in JAX on CPU (KDA with gates, decay and short convolutions, gated MLA
NoPE, Block Attention Residuals, Stable LatentMoE with the sigmoid router, selection bias and a
shared expert, SiTU-GLU), routed experts trained quantization-aware in MXFP4, on the Django 5.1.4
sdist's documentation and source (PyPI, sha256-pinned; scripts/k3train/corpus.py), tokenized with
the real K3 tokenizer. ``--minutes`` is turned into a step count by the preset's measured seconds
per step (scripts/k3train/presets.py), so a run is deterministic for a given seed and thread
count. OUT receives the checkpoint (config.json, index, shards: BF16 trunk, F32 where K3 has F32,
MXFP4 routed experts, written by scripts/k3gen) and training.json (losses against the corpus's
unigram entropy).

``--reference`` runs the trainer's forward in float64 on a checkpoint read back from disk
(k3ref's binder: BF16 rounded, MXFP4 dequantized) and prints the greedy ids; with --out-dir it
writes prompt_ids.json, greedy_ids.json and logits_step0.f32 as scripts/k3_reference.py does.

Environment: the first run on a machine creates a virtual environment outside the repository,
``~/.cache/k3/venv-train-<hash>/`` (scripts/k3cache.py: ``$K3_CACHE_DIR`` or ``$XDG_CACHE_HOME/k3``
when set; the hash is that of scripts/requirements-train.txt), and installs
scripts/requirements-train.txt into it (pinned JAX for CPU, numpy, tiktoken; about 630 MB; it says
so before installing); later runs, from any clone, reuse it. Set K3TRAIN_PYTHON=system to use the
current interpreter.
Exit codes: 0 ok, 1 failure, 2 usage.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
REQS = HERE / "requirements-train.txt"
sys.path.insert(0, str(HERE))
import k3cache  # noqa: E402  (standard library only)

REQS_SHA256 = hashlib.sha256(REQS.read_bytes()).hexdigest()
VENV = k3cache.root() / f"venv-train-{REQS_SHA256[:12]}"


def ensure_venv() -> None:
    """Re-exec inside the trainer's venv (creating it from the pinned requirements)."""
    if os.environ.get("K3TRAIN_PYTHON") == "system" or Path(sys.prefix).resolve() == VENV.resolve():
        return
    py = VENV / "bin" / "python"
    stamp = VENV / ".requirements.sha256"
    want = REQS_SHA256
    VENV.parent.mkdir(parents=True, exist_ok=True)
    # One installer at a time per machine (two clones' test runs may start together).
    with open(VENV.parent / f"{VENV.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not py.exists() or not stamp.exists() or stamp.read_text().strip() != want:
            install(py, stamp, want)
    os.execv(str(py), [str(py), str(Path(__file__).resolve()), *sys.argv[1:]])


def install(py: Path, stamp: Path, want: str) -> None:
    """Create VENV and install the pinned requirements into it, saying so first."""
    pins = [ln.strip() for ln in REQS.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    print(f"train_k3: installing into {VENV} (a virtual environment in this machine's k3 cache, "
          f"outside the repository; about 630 MB, once per machine): {', '.join(pins)}",
          file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "-r", str(REQS)], check=True)
    stamp.write_text(want + "\n")


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    if not ids:
        raise argparse.ArgumentTypeError("--ids is empty")
    return ids


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from k3gen.atomic import terminate_as_exception  # noqa: E402

    terminate_as_exception()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="output checkpoint directory (training)")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=None, help="exact step count (overrides --minutes)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--force", action="store_true", help="overwrite a non-empty OUT's checkpoint files")
    ap.add_argument("--val-limit", type=int, default=None,
                    help="score only the first N validation windows (default: all)")
    ap.add_argument("--export-from", metavar="PARAMS_NPZ",
                    help="write OUT from a saved trained_params.npz instead of training")
    ap.add_argument("--expand", metavar="COMPACT_NPZ",
                    help="write OUT from a compact.npz (numpy only: no virtual environment needed)")
    ap.add_argument("--reference", metavar="MODEL_DIR", help="run the trainer's forward on a checkpoint")
    ap.add_argument("--smoke", action="store_true",
                    help="the smoke training of scripts/tests/test_train_k3.py (scripts/test.sh starts "
                         "it beside the build): --steps 10 --val-limit 8")
    ap.add_argument("--setup", action="store_true",
                    help="only make the environment and the corpus ready (installs and downloads once per machine)")
    ap.add_argument("--ids", type=parse_ids)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--out-dir")
    ap.add_argument("--val-windows", type=int, default=0,
                    help="with --reference: also the validation CE over N windows of 256 tokens")
    args = ap.parse_args(argv)
    if args.setup:
        ensure_venv()
        sys.path.insert(0, str(HERE))
        from k3train import corpus  # noqa: E402
        c = corpus.load()
        print(f"train_k3: environment {VENV} and corpus ({len(c.train):,} train ids) ready", file=sys.stderr)
        return 0
    if args.reference is None and args.out is None:
        ap.error("give OUT (train) or --reference MODEL_DIR")
    if args.reference is not None and args.ids is None:
        ap.error("--reference needs --ids")
    if args.smoke:
        if args.steps not in (None, 10) or args.val_limit not in (None, 8):
            ap.error("--smoke is --steps 10 --val-limit 8; give no other --steps or --val-limit")
        args.steps, args.val_limit = 10, 8
    if args.minutes <= 0 or (args.steps is not None and args.steps < 1) or args.seed < 0:
        ap.error("--minutes must be > 0, --steps >= 1, --seed >= 0")
    sys.path.insert(0, str(HERE))
    if args.expand:
        if args.out is None:
            ap.error("--expand needs OUT")
        from k3train import presets as pr, train as tr  # noqa: E402  (numpy only)
        args.preset = args.preset or pr.DEFAULT
        return tr.main_expand(args)
    ensure_venv()
    from k3train import presets, train  # noqa: E402
    if args.reference is not None:
        import json
        res = train.reference(Path(args.reference), args.ids, args.gen,
                              Path(args.out_dir) if args.out_dir else None, args.val_windows)
        print(",".join(map(str, res["greedy_ids"])))
        if args.val_windows:
            print(json.dumps({k: res[k] for k in ("val_ce_exported_f64", "val_windows")}), file=sys.stderr)
        return 0
    args.preset = args.preset or presets.DEFAULT
    if args.preset not in presets.PRESETS:
        ap.error(f"--preset must be one of {sorted(presets.PRESETS)}")
    if args.export_from:
        return train.main_export(args)
    return train.main_train(args)


if __name__ == "__main__":
    sys.exit(main())
