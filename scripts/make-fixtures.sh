#!/usr/bin/env bash
# Regenerates the tiny checkpoint (fixtures/tiny/model) and the independent float64 reference
# outputs for it (fixtures/tiny/reference/): a fixed 12-id prompt and 20 greedy tokens, so teacher
# forcing covers 12 + 20 = 32 positions. Both steps are deterministic; commit both directories
# together (scripts/tests/test_reference_invariants.py checks they still agree).
# It replaces both directories in the working tree, and runs Python from `.venv/` (created and
# filled from scripts/requirements.txt first if needed, see scripts/venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

SEED=1
PROMPT=17,200,3,99,42,128,7,255,64,1,180,33   # 12 fixed ids < 256 (tiny vocab)
GEN=20

if [[ ! -f scripts/make-checkpoint.py ]]; then
    echo "error: scripts/make-checkpoint.py is missing (the generator has not been merged yet)" >&2
    exit 2
fi
. scripts/venv.sh

echo "== generating fixtures/tiny/model (preset tiny, seed $SEED)"
rm -rf fixtures/tiny/model
python3 scripts/make-checkpoint.py --preset tiny --seed "$SEED" fixtures/tiny/model

echo "== reference outputs (full recompute) -> fixtures/tiny/reference"
rm -rf fixtures/tiny/reference
python3 scripts/k3_reference.py fixtures/tiny/model --ids "$PROMPT" --gen "$GEN" --mode full \
    --seed "$SEED" --out-dir fixtures/tiny/reference

echo "== cross-check: incremental decode with the latent (absorbed) MLA gives the same ids"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 scripts/k3_reference.py fixtures/tiny/model --ids "$PROMPT" --gen "$GEN" --mode incremental \
    --mla-form latent --seed "$SEED" --out-dir "$tmp"
cmp fixtures/tiny/reference/greedy_ids.json "$tmp/greedy_ids.json"
cmp fixtures/tiny/reference/teacher_forcing.json "$tmp/teacher_forcing.json"

python3 - <<'PY'
import json
m = json.load(open("fixtures/tiny/reference/meta.json"))
print(f"== done: min top1-top2 logit margin over the {m['n_generated']} greedy steps = "
      f"{m['min_greedy_margin']:.3e}")
PY
