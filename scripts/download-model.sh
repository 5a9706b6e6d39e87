#!/usr/bin/env bash
# Download a model repository from the Hugging Face hub (default: the released Kimi K3 checkpoint,
# 96 shards, 1,560,936,091,448 bytes) and verify every file.
#
#   HF_TOKEN=... scripts/download-model.sh [REPO_ID] DEST_DIR [--revision REV] [--verify-only]
#
# * REPO_ID defaults to moonshotai/Kimi-K3 (or $K3_HF_REPO); REV to main. The hub is
#   $K3_HF_ENDPOINT (default https://huggingface.co; $HF_ENDPOINT is honoured too, for mirrors).
# * The token is read from the environment and never echoed: curl reads it from a header file
#   created with mode 0600 (never on a command line) and removed on exit.
# * The file list comes from the hub's API (GET /api/models/REPO/tree/REV, every page), which
#   publishes each LFS file's sha256 (`lfs.oid`) and every file's size. It is kept in
#   DEST/.k3-download/manifest.json, so --verify-only works offline later.
# * Resumable: a partial file continues where it stopped (curl -C -); a failed transfer is retried
#   (5 attempts, $K3_DL_RETRY_DELAY seconds apart, default 5), each resuming.
# * Progress: one line per file (index, name, size); curl's progress bar on a terminal; a line per
#   file hashed.
# * Verification: every file's size equals the hub's; every LFS file's sha256 equals the hub's
#   (hashes already checked are remembered in DEST/.k3-download/verified, keyed by size and
#   modification time, so a second run does not hash 1.5 TB again); every .safetensors file's size
#   equals 8 + header length + the end of its last tensor; every shard that
#   model.safetensors.index.json names is present. When the hub's listing cannot be had, the file
#   list is config.json, the tokenizer files and the shards the index names, and only the size
#   checks apply (for moonshotai/Kimi-K3 also: 96 shards, 1,560,936,091,448 bytes in total).
# * The manifest: once every file is verified against the hub's listing, DEST/k3-manifest.json
#   records each shard's name, size and the hub's sha256 (docs/SPEC.md §6.11). It is the model's
#   content identity (sessions, saved state and packed trunks are bound to it) and the reference
#   `k3-ctl verify` checks every shard against. Without the hub's listing no manifest is written
#   (a stale one is removed): the contents then have no reference, and `k3-ctl verify` says so.
# Exit codes: 0 everything verified, 1 a download or verification failure (each bad file is named
# on stderr), 2 usage error.
set -euo pipefail

DEFAULT_REPO="moonshotai/Kimi-K3"
REPO="${K3_HF_REPO:-$DEFAULT_REPO}"
REVISION="main"
ENDPOINT="${K3_HF_ENDPOINT:-${HF_ENDPOINT:-https://huggingface.co}}"
ENDPOINT="${ENDPOINT%/}"
RETRY_DELAY="${K3_DL_RETRY_DELAY:-5}"
ATTEMPTS=5

usage() {
  echo "usage: HF_TOKEN=... $0 [REPO_ID] DEST_DIR [--revision REV] [--verify-only]" >&2
  exit 2
}
POS=()
VERIFY_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --verify-only) VERIFY_ONLY=1 ;;
    --revision) [ $# -ge 2 ] || usage; REVISION="$2"; shift ;;
    --revision=*) REVISION="${1#--revision=}" ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) usage ;;
    *) POS+=("$1") ;;
  esac
  shift
done
case ${#POS[@]} in
  1) DEST="${POS[0]}" ;;
  2) REPO="${POS[0]}"; DEST="${POS[1]}" ;;
  *) usage ;;
esac
[[ "$REPO" =~ ^[A-Za-z0-9._-]+/[A-Za-z0-9._-]+$ ]] || { echo "bad repo id: $REPO (want OWNER/NAME)" >&2; exit 2; }
[[ "$RETRY_DELAY" =~ ^[0-9]+$ ]] || { echo "K3_DL_RETRY_DELAY must be a whole number of seconds" >&2; exit 2; }
command -v python3 >/dev/null || { echo "python3 is required" >&2; exit 1; }

mkdir -p "$DEST/.k3-download"
STATE="$DEST/.k3-download"
MANIFEST="$STATE/manifest.json"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
HDR="$WORK/auth"
: > "$HDR"; chmod 600 "$HDR"
if [ -n "${HF_TOKEN:-}" ]; then
  printf 'Authorization: Bearer %s\n' "$HF_TOKEN" > "$HDR"
elif [ "$VERIFY_ONLY" = 0 ]; then
  echo "note: HF_TOKEN is not set; trying anonymous download" >&2
fi

# The hub's file listing, every page (Link: <…>; rel="next"), into $MANIFEST. Returns non-zero
# (with a note) when it cannot be had; a listing that is not what it should be is an error.
fetch_listing() {
  local url="$ENDPOINT/api/models/$REPO/tree/$REVISION?recursive=true" n=0
  # (curl takes --retry-delay 0 as "its own backoff": no retries then.)
  local LISTING_RETRY=()
  [ "$RETRY_DELAY" -gt 0 ] && LISTING_RETRY=(--retry 3 --retry-delay "$RETRY_DELAY")
  while [ -n "$url" ]; do
    n=$((n + 1))
    [ $n -le 1000 ] || { echo "the hub's listing has more than 1000 pages" >&2; return 1; }
    if ! curl -fsSL "${LISTING_RETRY[@]}" -H @"$HDR" -D "$WORK/head.$n" \
         -o "$WORK/page.$n" "$url"; then
      echo "note: no file listing from $ENDPOINT for $REPO@$REVISION" >&2
      return 1
    fi
    url=$(python3 - "$WORK/head.$n" <<'PY'
import re, sys
# The last response's headers (after redirects): a Link header with rel="next", if any.
blocks = open(sys.argv[1], encoding="latin-1").read().replace("\r", "").split("\n\n")
last = [b for b in blocks if b.strip()][-1]
for line in last.splitlines():
    if line.lower().startswith("link:"):
        for part in line.split(":", 1)[1].split(","):
            m = re.match(r'\s*<([^>]+)>\s*;(.*)', part)
            if m and re.search(r'rel="?next"?', m.group(2)):
                print(m.group(1))
                sys.exit(0)
PY
)
    # A relative next link is resolved against the endpoint.
    case "$url" in ""|http://*|https://*) ;; /*) url="$ENDPOINT$url" ;; *) url="$ENDPOINT/$url" ;; esac
  done
  python3 - "$MANIFEST" "$WORK" "$n" "$REPO" "$REVISION" <<'PY'
import json, os, posixpath, re, sys
out, work, n, repo, revision = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
files = []
for i in range(1, n + 1):
    try:
        page = json.load(open(os.path.join(work, f"page.{i}")))
    except ValueError as e:
        sys.exit(f"the hub's listing (page {i}) is not JSON: {e}")
    if not isinstance(page, list):
        sys.exit(f"the hub's listing (page {i}) is not a list of entries")
    for e in page:
        if not isinstance(e, dict) or e.get("type") != "file":
            continue
        path, size = e.get("path"), e.get("size")
        lfs = e.get("lfs") if isinstance(e.get("lfs"), dict) else None
        # Every name must stay inside DEST.
        if (not isinstance(path, str) or not path or path.startswith("/") or "\\" in path or "\n" in path
                or posixpath.normpath(path) != path or path.split("/")[0] in ("..", ".k3-download")):
            sys.exit(f"the hub's listing names an unsafe path: {path!r}")
        if lfs is not None:
            size = lfs.get("size", size)
        if not isinstance(size, int) or size < 0:
            sys.exit(f"the hub's listing gives {path} no size")
        sha = lfs.get("oid") if lfs else None
        if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
            sys.exit(f"the hub's listing gives {path} a malformed sha256: {sha!r}")
        files.append({"path": path, "size": size, "sha256": sha})
if not files:
    sys.exit("the hub's listing names no file")
if len({f["path"] for f in files}) != len(files):
    sys.exit("the hub's listing names a file twice")
tmp = out + ".tmp"
json.dump({"repo": repo, "revision": revision, "files": files}, open(tmp, "w"), indent=1)
os.replace(tmp, out)
PY
}

# One file, resumed and retried: fetch PATH [EXPECTED_SIZE]. Non-zero when it did not arrive.
fetch() {
  local f="$1" want="${2:-}" url="$ENDPOINT/$REPO/resolve/$REVISION/$1" have attempt progress code
  mkdir -p "$(dirname "$DEST/$f")"
  if [ -t 2 ]; then progress=(--progress-bar); else progress=(-sS); fi
  for attempt in $(seq 1 "$ATTEMPTS"); do
    have=$(stat -c %s "$DEST/$f" 2>/dev/null || echo 0)
    if [ -n "$want" ] && [ "$have" -eq "$want" ]; then return 0; fi
    if [ -n "$want" ] && [ "$have" -gt "$want" ]; then
      echo "$f: $have bytes on disk, more than the hub's $want" >&2; return 1
    fi
    [ "$have" -gt 0 ] && echo "   resuming $f at byte $have" >&2
    code=$(curl -fL "${progress[@]}" -C - -H @"$HDR" -w '%{http_code}' -o "$DEST/$f" "$url") && {
      [ -z "$want" ] && return 0
      continue
    }
    case "$code" in
      416) echo "$f: the hub has no bytes beyond $have (its listing says $want)" >&2; return 1 ;;
      408|429) ;;
      4??) echo "$f: HTTP $code" >&2; return 1 ;;  # not found, not allowed: retrying cannot help
    esac
    [ "$attempt" -lt "$ATTEMPTS" ] && { echo "   transfer of $f failed (attempt $attempt/$ATTEMPTS); retrying in ${RETRY_DELAY}s" >&2; sleep "$RETRY_DELAY"; }
  done
  have=$(stat -c %s "$DEST/$f" 2>/dev/null || echo 0)
  [ -n "$want" ] && [ "$have" -eq "$want" ] && return 0
  echo "$f: download failed after $ATTEMPTS attempts" >&2
  return 1
}

# A listing saved by an earlier run for this repository and revision.
saved_listing() {
  [ -s "$MANIFEST" ] && python3 - "$MANIFEST" "$REPO" "$REVISION" <<'PY'
import json, sys
try:
    m = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit(1)
sys.exit(0 if (m.get("repo"), m.get("revision")) == (sys.argv[2], sys.argv[3]) else 1)
PY
}

HAVE_MANIFEST=0
if [ "$VERIFY_ONLY" = 1 ] && saved_listing; then
  HAVE_MANIFEST=1
elif command -v curl >/dev/null; then
  set +e; fetch_listing; rc=$?; set -e
  if [ $rc = 0 ]; then HAVE_MANIFEST=1
  elif [ -s "$WORK/page.1" ]; then exit 1   # a listing arrived but is unusable: said above
  elif saved_listing; then
    echo "note: using the listing saved by an earlier run ($MANIFEST)" >&2; HAVE_MANIFEST=1
  fi
elif [ "$VERIFY_ONLY" = 0 ]; then
  echo "curl is required" >&2; exit 1
elif saved_listing; then
  HAVE_MANIFEST=1
fi

FAILED=0
if [ "$VERIFY_ONLY" = 0 ]; then
  if [ "$HAVE_MANIFEST" = 1 ]; then
    python3 - "$MANIFEST" > "$WORK/list" <<'PY'
import json, sys
for f in json.load(open(sys.argv[1]))["files"]:
    print(f["size"], f["path"])
PY
  else
    echo "note: verifying sizes only (no sha256 without the hub's listing)" >&2
    for f in config.json model.safetensors.index.json tiktoken.model tokenizer_config.json; do
      [ -s "$DEST/$f" ] || fetch "$f" || FAILED=1
    done
    [ -s "$DEST/model.safetensors.index.json" ] || { echo "model.safetensors.index.json: missing" >&2; exit 1; }
    python3 - "$DEST" > "$WORK/list" <<'PY'
import json, sys
idx = json.load(open(sys.argv[1] + "/model.safetensors.index.json"))
for s in sorted(set(idx["weight_map"].values())):
    print("-", s)
PY
  fi
  total=$(wc -l < "$WORK/list"); i=0
  while read -r size f; do
    i=$((i + 1))
    [ "$size" = "-" ] && size=""
    echo "== [$i/$total] $f${size:+ ($size bytes)}" >&2
    if [ -z "$size" ] && [ -s "$DEST/$f" ] && python3 - "$DEST/$f" <<'PY'
import json, os, struct, sys
# Without the hub's size: a shard whose size equals its own header's end is complete.
p = sys.argv[1]
with open(p, "rb") as fh:
    raw = fh.read(8)
    if len(raw) < 8: sys.exit(1)
    (n,) = struct.unpack("<Q", raw)
    if n > os.path.getsize(p) - 8 or n > 1 << 30: sys.exit(1)
    try: header = json.loads(fh.read(n))
    except ValueError: sys.exit(1)
end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
sys.exit(0 if os.path.getsize(p) == 8 + n + end else 1)
PY
    then continue; fi
    fetch "$f" "$size" < /dev/null || FAILED=1
  done < "$WORK/list"
fi

set +e
python3 - "$DEST" "$HAVE_MANIFEST" "$REPO" "$DEFAULT_REPO" "$REVISION" <<'PY'
import hashlib, json, os, struct, sys
dest, have_manifest, repo, default_repo, revision = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4], sys.argv[5]
state = os.path.join(dest, ".k3-download")
bad = []


def safetensors_size_check(path, name):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return f"{name}: shorter than 8 bytes"
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 1 << 30:
            return f"{name}: header length {n} exceeds the file"
        try:
            header = json.loads(f.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            return f"{name}: unreadable safetensors header ({e})"
    if size != 8 + n + end:
        return f"{name}: {size} bytes, its header says {8 + n + end} (incomplete download?)"
    return None


index_path = os.path.join(dest, "model.safetensors.index.json")
shards = None
if os.path.exists(index_path):
    try:
        shards = sorted(set(json.load(open(index_path))["weight_map"].values()))
    except (ValueError, KeyError, TypeError) as e:
        bad.append(f"model.safetensors.index.json: unreadable ({e})")

if have_manifest:
    files = json.load(open(os.path.join(state, "manifest.json")))["files"]
    cache_path = os.path.join(state, "verified")
    cache = set()
    if os.path.exists(cache_path):
        cache = {line.rstrip("\n") for line in open(cache_path)}
    new_cache = []
    listed = {f["path"] for f in files}
    hashed = [f for f in files if f["sha256"]]
    k = 0
    for f in files:
        name, p = f["path"], os.path.join(dest, f["path"])
        if not os.path.isfile(p):
            bad.append(f"{name}: missing")
            continue
        st = os.stat(p)
        if st.st_size != f["size"]:
            bad.append(f"{name}: {st.st_size} bytes, the hub says {f['size']}")
            continue
        if f["sha256"]:
            k += 1
            key = f"{f['sha256']} {st.st_size} {st.st_mtime_ns} {name}"
            if key in cache:
                new_cache.append(key)
            else:
                h = hashlib.sha256()
                with open(p, "rb") as fh:
                    while True:
                        b = fh.read(8 << 20)
                        if not b:
                            break
                        h.update(b)
                got = h.hexdigest()
                if got != f["sha256"]:
                    print(f"   sha256 [{k}/{len(hashed)}] {name}: MISMATCH", file=sys.stderr)
                    bad.append(f"{name}: sha256 {got}, the hub says {f['sha256']} (delete it and run again)")
                    continue
                print(f"   sha256 [{k}/{len(hashed)}] {name}: ok", file=sys.stderr)
                new_cache.append(key)
        if name.endswith(".safetensors"):
            e = safetensors_size_check(p, name)
            if e:
                bad.append(e)
    if shards is not None:
        for s in shards:
            if s not in listed:
                bad.append(f"{s}: named by model.safetensors.index.json but not in the hub's listing")
    tmp = cache_path + ".tmp"
    with open(tmp, "w") as out:
        out.writelines(line + "\n" for line in new_cache)
    os.replace(tmp, cache_path)
    summary = f"verified: {len(files)} files ({len(hashed)} by sha256, the rest by size), {sum(f['size'] for f in files)} bytes"
else:
    if shards is None:
        bad.append("model.safetensors.index.json: missing (and no listing from the hub to verify against)")
        shards = []
    total = 0
    for s in shards:
        p = os.path.join(dest, s)
        if not os.path.exists(p):
            bad.append(f"{s}: missing")
            continue
        total += os.path.getsize(p)
        e = safetensors_size_check(p, s)
        if e:
            bad.append(e)
    if repo == default_repo:
        want_n, want_total = 96, 1560936091448
        if len(shards) != want_n:
            bad.append(f"index names {len(shards)} shards, expected {want_n}")
        elif total != want_total:
            bad.append(f"total {total} bytes, expected {want_total}")
    summary = f"verified by size only (no sha256 without the hub's listing): {len(shards)} shards, {total} bytes"

manifest_path = os.path.join(dest, "k3-manifest.json")
if bad:
    print("VERIFY FAILED:\n  " + "\n  ".join(bad), file=sys.stderr)
    sys.exit(1)
if have_manifest:
    # The hub's sha256 of every shard, beside the model (written only once every file checked).
    by_path = {f["path"]: f for f in files}
    names = shards if shards is not None else sorted(p for p in by_path if p.endswith(".safetensors") and "/" not in p)
    missing = [s for s in names if not (by_path.get(s) or {}).get("sha256")]
    if not names:
        pass  # no safetensors shard in this repository: nothing to record
    elif missing:
        print(f"note: the hub publishes no sha256 for {', '.join(missing[:3])}: no k3-manifest.json written", file=sys.stderr)
    else:
        entries = [{"file": s, "size": by_path[s]["size"], "sha256": by_path[s]["sha256"]} for s in sorted(names)]
        tmp = manifest_path + ".tmp"
        with open(tmp, "w") as out:
            json.dump({"format": 1, "source": f"{repo}@{revision} (the hub's sha256)", "shards": entries}, out, indent=1)
            out.write("\n")
        os.replace(tmp, manifest_path)
        print(f"wrote {manifest_path}: {len(entries)} shards with the hub's sha256")
elif os.path.exists(manifest_path):
    os.remove(manifest_path)
    print(f"note: removed {manifest_path}: without the hub's listing the shards have no reference hashes", file=sys.stderr)
print(summary)
PY
rc=$?
set -e
[ $rc = 0 ] && [ $FAILED = 0 ] && exit 0
[ $FAILED = 1 ] && echo "some downloads failed (named above); run again to resume" >&2
exit 1
