#!/usr/bin/env python3
"""Write a synthetic Kimi K3 checkpoint with the real tensor graph (SPEC.md §1, §2, §4).

    python3 scripts/make-checkpoint.py --preset tiny --seed 1 fixtures/tiny/model

Presets: tiny (committed test fixture), small (~190 MB, real vocab), medium (~5.3 GB, 256
experts), k3slice (~16 GB, real layer dims, 5 layers), skeleton-full (the real 93-layer
layout, 96 sparse shards with real headers and no data). Same preset + seed => identical bytes.
Every preset but skeleton-full also writes k3-manifest.json (each shard's sha256, docs/SPEC.md
§6.11), so the checkpoint's content identity is the strong one and `k3-ctl verify` can check it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from k3gen.presets import PRESETS  # noqa: E402
from k3gen.atomic import remove_stale, terminate_as_exception  # noqa: E402
from k3gen.writer import write_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--config-shape", choices=("nested", "flat"), default="nested")
    ap.add_argument("--decoy-head-dim", action="store_true", help="add text_config.head_dim = hidden / num_attention_heads (a reader must ignore it)")
    ap.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR, first deleting its config.json, index and *.safetensors")
    ap.add_argument("out_dir")
    args = ap.parse_args(argv)
    if args.seed < 0:
        ap.error("--seed must be >= 0")
    d = PRESETS[args.preset]
    terminate_as_exception()
    # The temporaries of a run that was killed (its pid gone) go first; a run interrupted by
    # SIGINT or SIGTERM removed its own.
    for p in remove_stale(args.out_dir):
        print(f"make-checkpoint: removed {p}, left by a writer that is gone", file=sys.stderr)
    if os.path.isdir(args.out_dir) and os.listdir(args.out_dir):
        if not args.force:
            ap.error(f"{args.out_dir} is not empty (stale shards would mix with new ones); use --force or an empty directory")
        for f in os.listdir(args.out_dir):
            if f.endswith(".safetensors") or f in ("config.json", "model.safetensors.index.json", "k3-manifest.json"):
                os.remove(os.path.join(args.out_dir, f))
    t0 = time.monotonic()
    plans = write_checkpoint(d, args.out_dir, args.seed, args.config_shape, args.decoy_head_dim)
    data = sum(p.data_size for p in plans)
    files = sum(len(p.header) + p.data_size for p in plans)
    tensors = sum(len(u.tensors) for p in plans for u in p.units)
    print(
        f"{args.preset}: {tensors} tensors in {len(plans)} shards, {data} data bytes "
        f"({files} bytes of shard files{', sparse' if d.values == 'hole' else ''}), "
        f"layers {d.layer_map()}, {time.monotonic() - t0:.1f} s -> {args.out_dir}"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, OSError) as e:
        print(f"make-checkpoint: error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ValueError) else 1)
