#!/usr/bin/env python3
"""Independent float64 reference forward pass of the Kimi K3 text model (numpy only).

Written from SPEC.md alone; the Rust engine is proven against its outputs.

    python3 scripts/k3_reference.py MODEL_DIR --ids 1,2,3 [--gen N] [--mode full|incremental]
        [--layers N] [--out-dir DIR] [--config PATH] [--mla-norm-eps 1e-6]
        [--mla-form expanded|latent] [--seed S] [--dump-trace FILE.npz]

Prints the generated ids (greedy argmax, first index wins ties, no stop tokens). With --out-dir
writes prompt_ids.json, greedy_ids.json, teacher_forcing.json (argmax at every position of one
forward over prompt+generated), logits_step0.f32 (little-endian float32 logits at the last prompt
position) and meta.json. --dump-trace saves every named float64 intermediate of one forward over
the prompt (``embed``, ``L{n}.attn_in``, ``L{n}.kda.o``, ``L{n}.mla.c``, ``L{n}.moe.sel``, ...,
``final_in``, ``logits``) to an .npz, to locate where an engine diverges.

Exit codes: 0 ok; 1 forward or I/O failure; 2 usage error or a config/checkpoint that cannot be
bound.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k3ref.checkpoint import Checkpoint, CheckpointError  # noqa: E402
from k3ref.config import ConfigError, read_config  # noqa: E402
from k3ref.model import (DEFAULT_MLA_NORM_EPS, BindError, State, argmax_first, bind,  # noqa: E402
                         forward, greedy, top2_margin)
from k3ref.mxfp4 import Mxfp4Error  # noqa: E402
from k3ref.safetensors import SafetensorsError  # noqa: E402

EXIT_OK, EXIT_FAIL, EXIT_REFUSED = 0, 1, 2


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip() != ""]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--ids must be comma-separated integers: {e}") from e
    if not ids:
        raise argparse.ArgumentTypeError("--ids is empty")
    return ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--ids", type=parse_ids, required=True, help="prompt token ids, e.g. 1,2,3")
    p.add_argument("--gen", type=int, default=8, help="tokens to generate (default 8)")
    p.add_argument("--mode", choices=["full", "incremental"], default="full",
                   help="full recompute each step, or prefill + carried state")
    p.add_argument("--layers", type=int, default=None, help="bind only the first N layers")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--config", type=Path, default=None, help="default MODEL_DIR/config.json")
    p.add_argument("--mla-norm-eps", type=float, default=DEFAULT_MLA_NORM_EPS,
                   help="eps of q_a_layernorm/kv_a_layernorm (SPEC.md §10 C1; default 1e-6)")
    p.add_argument("--mla-form", choices=["expanded", "latent"], default="expanded")
    p.add_argument("--dump-trace", type=Path, default=None,
                   help="save the named intermediates of the prompt forward to this .npz")
    p.add_argument("--seed", type=int, default=None,
                   help="generator seed of the checkpoint, recorded in meta.json only")
    return p


def run(args: argparse.Namespace) -> int:
    if args.gen < 1 or args.gen > 4096:
        print("error: --gen must be in 1..4096", file=sys.stderr)
        return EXIT_REFUSED
    config_path = args.config or args.model_dir / "config.json"
    try:
        cfg = read_config(config_path)
        ckpt = Checkpoint(args.model_dir)
        model = bind(cfg, ckpt, args.layers, args.mla_norm_eps)
    except (ConfigError, CheckpointError, BindError, SafetensorsError, Mxfp4Error) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    bad = [i for i in args.ids if not 0 <= i < cfg.vocab_size]
    if bad:
        print(f"error: prompt ids outside 0..{cfg.vocab_size - 1}: {bad}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"config: {config_path} ({cfg.summary()}) | layers bound {len(model.layers)} "
          f"map {cfg.layer_map[:len(model.layers)]}", file=sys.stderr)
    if model.nan_scales:
        print(f"warning: {model.nan_scales} E8M0 scale bytes = 255 treated as 0", file=sys.stderr)

    if args.dump_trace is not None:
        trace: dict = {}
        forward(model, args.ids, State.new(model), args.mla_form, trace)
        np.savez(args.dump_trace, **{k: np.asarray(v) for k, v in trace.items() if v is not None})
    generated, rows = greedy(model, args.ids, args.gen, args.mode, args.mla_form)
    print(",".join(str(i) for i in generated))
    if args.out_dir is None:
        return EXIT_OK

    full_ids = list(args.ids) + generated
    tf_logits = forward(model, full_ids, State.new(model), args.mla_form)
    teacher = [argmax_first(r) for r in tf_logits]
    # Self-check: position len(prompt)-1+i of the one-shot forward predicts generated[i].
    n_p = len(args.ids)
    consistent = teacher[n_p - 1:n_p - 1 + len(generated)] == generated
    if not consistent:
        print("error: teacher-forcing predictions disagree with the greedy ids", file=sys.stderr)
        return EXIT_FAIL
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "generator": "scripts/k3_reference.py (float64 numpy reference, SPEC.md)",
        "model_dir": str(args.model_dir),
        "config_path": str(config_path),
        "config_shape": cfg.shape,
        "layers_bound": len(model.layers),
        "layer_map": cfg.layer_map[:len(model.layers)],
        "mode": args.mode,
        "mla_form": args.mla_form,
        "mla_norm_eps": args.mla_norm_eps,
        "kda_o_norm_eps": cfg.rms_norm_eps,
        "numpy_version": np.__version__,
        "seed": args.seed,
        "n_prompt": n_p,
        "n_generated": len(generated),
        "teacher_forcing_positions": len(full_ids),
        "teacher_forcing_consistent": consistent,
        "e8m0_255_count": model.nan_scales,
        "greedy_top1_top2_margins": [top2_margin(r) for r in rows],
        "min_greedy_margin": min(top2_margin(r) for r in rows),
        "teacher_forcing_top1_top2_margins": [top2_margin(r) for r in tf_logits],
        "tie_rules": {"greedy": "first index wins", "router": "higher biased score, then lower index"},
        "checkpoint_sha256": ckpt.file_hashes(),
    }
    (out / "prompt_ids.json").write_text(json.dumps(list(args.ids)) + "\n")
    (out / "greedy_ids.json").write_text(json.dumps(generated) + "\n")
    (out / "teacher_forcing.json").write_text(json.dumps(teacher) + "\n")
    rows[0].astype("<f4").tofile(out / "logits_step0.f32")
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
