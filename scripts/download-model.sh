#!/usr/bin/env bash
# Download the released Kimi K3 checkpoint (96 shards, 1,560,936,091,448 bytes) and verify it.
#
#   HF_TOKEN=... scripts/download-model.sh DEST_DIR [--verify-only]
#
# * The token is read from the environment and never echoed (curl reads it from a header file
#   created with mode 0600 and removed on exit).
# * Resumable: partially downloaded shards continue where they stopped (curl -C -).
# * Verifies: exactly 96 shards named by model.safetensors.index.json; every shard's size equals
#   8 + header length + the end of its last tensor (read from the shard's own header); the total
#   equals the published 1,560,936,091,448 bytes.
# Exit codes: 0 verified, 1 download or verification failure, 2 usage error.
set -euo pipefail

REPO="${K3_HF_REPO:-moonshotai/Kimi-K3}"
REVISION="${K3_HF_REVISION:-main}"
ENDPOINT="${HF_ENDPOINT:-https://huggingface.co}"
EXPECTED_SHARDS=96
EXPECTED_TOTAL=1560936091448

usage() { echo "usage: HF_TOKEN=... $0 DEST_DIR [--verify-only]" >&2; exit 2; }
[ $# -ge 1 ] || usage
DEST="$1"; shift
VERIFY_ONLY=0
for a in "$@"; do
  case "$a" in
    --verify-only) VERIFY_ONLY=1 ;;
    *) usage ;;
  esac
done
mkdir -p "$DEST"

if [ "$VERIFY_ONLY" = 0 ]; then
  command -v curl >/dev/null || { echo "curl is required" >&2; exit 1; }
  hdr=$(mktemp); chmod 600 "$hdr"; trap 'rm -f "$hdr"' EXIT
  if [ -n "${HF_TOKEN:-}" ]; then
    printf 'Authorization: Bearer %s\n' "$HF_TOKEN" > "$hdr"
  else
    echo "note: HF_TOKEN is not set; trying anonymous download" >&2
  fi
  fetch() { # fetch FILE
    local url="$ENDPOINT/$REPO/resolve/$REVISION/$1"
    curl -fL --retry 5 --retry-delay 5 -C - -H @"$hdr" -o "$DEST/$1" "$url"
  }
  for f in config.json model.safetensors.index.json tiktoken.model tokenizer_config.json; do
    [ -s "$DEST/$f" ] || fetch "$f"
  done
  python3 - "$DEST" > "$DEST/.shards" <<'PY'
import json, sys
idx = json.load(open(sys.argv[1] + "/model.safetensors.index.json"))
for s in sorted(set(idx["weight_map"].values())):
    print(s)
PY
  while read -r shard; do
    echo "== $shard" >&2
    fetch "$shard"
  done < "$DEST/.shards"
fi

python3 - "$DEST" "$EXPECTED_SHARDS" "$EXPECTED_TOTAL" <<'PY'
import json, os, struct, sys
dest, want_n, want_total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
idx = json.load(open(os.path.join(dest, "model.safetensors.index.json")))
shards = sorted(set(idx["weight_map"].values()))
bad = []
if len(shards) != want_n:
    bad.append(f"index names {len(shards)} shards, expected {want_n}")
total = 0
for s in shards:
    p = os.path.join(dest, s)
    if not os.path.exists(p):
        bad.append(f"{s}: missing"); continue
    size = os.path.getsize(p)
    total += size
    with open(p, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            bad.append(f"{s}: shorter than 8 bytes"); continue
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 1 << 30:
            bad.append(f"{s}: header length {n} exceeds the file"); continue
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    want = 8 + n + end
    if size != want:
        bad.append(f"{s}: {size} bytes, header says {want} (incomplete download?)")
if total != want_total and len(shards) == want_n:
    bad.append(f"total {total} bytes, expected {want_total}")
if bad:
    print("VERIFY FAILED:\n  " + "\n  ".join(bad), file=sys.stderr)
    sys.exit(1)
print(f"verified: {len(shards)} shards, {total} bytes")
PY
