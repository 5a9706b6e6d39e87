#!/usr/bin/env bash
# Regenerates the seed corpora in fuzz/corpus/<target>/ from the repository's real files:
#   safetensors_header  the header (8-byte length + JSON) of each fixtures/tiny/model shard
#   safetensors_index   fixtures/tiny/model/model.safetensors.index.json (+ a one-entry variant)
#   config_json         fixtures/tiny/model/config.json
#   trunk_json          trunk.json of fixtures/tiny/model packed by `k3-ctl pack-trunk`
#   trunk_descriptors   the same packed `--codec int4` (what that target packs beside it)
#   tokenizer_vocab     the first 300 and 1024 lines of fixtures/tokenizer/tiktoken.model
#   tokenizer_config    fixtures/tokenizer/tokenizer_config.json renumbered to follow 1024 ranks
#                       (the vocabulary the tokenizer_config target uses) + a minimal one
#   wire_request/_response  postcard bodies of every message variant and a stream of frames
#   shm_header          encoded headers with 0, 1 and 4 regions
#   tool_calls          replies with XTML tool calls (argument and json forms, malformed ones),
#                       as text (mode byte 0) and as raw ids (mode byte 1)
#   anthropic_body      Messages request bodies: plain, system blocks and thinking, tools with a
#                       tool_use/tool_result turn, sampling edge values
# Usage: fuzz/gen_corpus.sh   (needs python3; builds k3-ctl if target/debug/k3-ctl is missing)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out=fuzz/corpus
rm -rf "$out"
mkdir -p "$out"

k3ctl=target/debug/k3-ctl
[[ -x $k3ctl ]] || cargo build -q -p k3-ctl
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$k3ctl" pack-trunk fixtures/tiny/model "$tmp/trunk" >/dev/null 2>&1
mkdir -p "$out/trunk_json"
cp "$tmp/trunk/trunk.json" "$out/trunk_json/seed-tiny.json"
"$k3ctl" pack-trunk fixtures/tiny/model "$tmp/int4" --codec int4 >/dev/null 2>&1
mkdir -p "$out/trunk_descriptors"
cp "$tmp/int4/trunk.json" "$out/trunk_descriptors/seed-tiny-int4.json"

python3 - "$out" <<'PY'
import json, os, struct, sys

out = sys.argv[1]
M = "fixtures/tiny/model"

def put(target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())

# safetensors headers
for f in sorted(os.listdir(M)):
    if f.endswith(".safetensors"):
        with open(os.path.join(M, f), "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            put("safetensors_header", f.split("-")[1], struct.pack("<Q", n) + fh.read(n))
# a small hand-made header: one tensor at the start of the data
h = json.dumps({"__metadata__": {"format": "pt"},
                "model.norm.weight": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}}).encode()
put("safetensors_header", "small", struct.pack("<Q", len(h)) + h)

# index
idx = open(os.path.join(M, "model.safetensors.index.json"), "rb").read()
put("safetensors_index", "tiny.json", idx)
wm = json.loads(idx)["weight_map"]
k = sorted(wm)[0]
put("safetensors_index", "one.json", json.dumps({"metadata": {}, "weight_map": {k: wm[k]}}))

# config.json
put("config_json", "tiny.json", open(os.path.join(M, "config.json"), "rb").read())

# tokenizer
lines = open("fixtures/tokenizer/tiktoken.model", "rb").read().split(b"\n")
put("tokenizer_vocab", "300", b"\n".join(lines[:300]) + b"\n")
put("tokenizer_vocab", "1024", b"\n".join(lines[:1024]) + b"\n")
RANKS, REAL = 1024, 163584
cfg = json.load(open("fixtures/tokenizer/tokenizer_config.json"))
cfg["added_tokens_decoder"] = {str(int(i) - REAL + RANKS): v
                               for i, v in cfg["added_tokens_decoder"].items()}
put("tokenizer_config", "renumbered.json", json.dumps(cfg, indent=1))
put("tokenizer_config", "minimal.json", json.dumps({
    "added_tokens_decoder": {str(RANKS): {"content": "[BOS]"}, str(RANKS + 1): {"content": "[EOS]"}},
    "bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}}))

# wire: postcard (varint integers, length-prefixed strings and sequences, variant index first)
def v(n):
    b = bytearray()
    while True:
        x = n & 0x7F
        n >>= 7
        if n:
            b.append(x | 0x80)
        else:
            b.append(x)
            return bytes(b)
def s(t):
    t = t.encode()
    return v(len(t)) + t
def f64(x):
    return struct.pack("<d", x)
def seq(items):
    return v(len(items)) + b"".join(items)
def counters(a):
    return b"".join(v(x) for x in a[:6]) + f64(a[6])

requests = {
    "hello": v(0) + v(1) + v(0) + s("k3-worker pid 1234"),
    "hello-control": v(0) + v(1) + v(1) + s("k3-ctl"),
    "experts": v(1) + v(3) + seq([v(i) for i in (0, 7, 300, 383)]),
    "stats": v(2), "status": v(3), "stop": v(4), "release-all": v(5),
}
c = counters([100, 80, 20, 5, 0, 1 << 30, 1.5])
responses = {
    "welcome": v(0) + v(1) + s("/models/k3") + s("/models/k3/trunk") + v(1 << 33),
    "refused": v(1) + v(1) + v(2) + s("protocol version mismatch"),
    "experts": v(2) + seq([v(0) + v(5), v(1) + s("shard 3 at 4096: EIO"), v(0) + v(0)]) + v(2),
    "stats": v(3) + c + c + seq([v(1) + s("k3-worker pid 7") + b"\x01" + c]) + b"".join(v(x) for x in (4, 10, 64, 3, 1)) + f64(12.5),
    "status": v(4) + s("/m") + s("/t") + s("laptop") + s("plan: 6 GB") + v(1 << 32) + v(4242) + seq([s("a"), s("b")]) + f64(3.0),
    "stopping": v(5), "released": v(6), "error": v(7) + s("layer 99 out of range"),
}
for target, msgs in (("wire_request", requests), ("wire_response", responses)):
    stream = b""
    for name, body in msgs.items():
        put(target, name, body)
        stream += struct.pack("<I", len(body)) + body
    put(target, "stream", stream)

# shared-memory header
HEADER, ALIGN, FIRST = 64 + 24 * 256, 4096, 8192
def shm(total, regions, slot_count=0, stride=0, expert=0):
    b = b"K3STORE\0" + struct.pack("<IIQQIIQQQ", 1, HEADER, total, 0x1234, len(regions),
                                   slot_count, stride, expert, 0)
    for r in regions + [(0, 0, 0, 0)] * (256 - len(regions)):
        b += struct.pack("<IIQQ", *r)
    return b + bytes(total - len(b))
put("shm_header", "empty", shm(HEADER, []))
put("shm_header", "one", shm(FIRST + ALIGN, [(1, 0, FIRST, 100)]))
put("shm_header", "four", shm(FIRST + 6 * ALIGN, [
    (1, 0, FIRST, 10), (2, 3, FIRST + ALIGN, ALIGN),
    (3, 0, FIRST + 2 * ALIGN, 2 * ALIGN), (4, 0, FIRST + 4 * ALIGN, 32)], 2, ALIGN, 4000))

# XTML tool calls (docs/SPEC.md §5.5 "Tools"): mode byte 0 = text with the markers spelled out
call = ('<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>'
        ' New York <|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>2'
        '<|close|>argument<|sep|><|close|>call<|sep|>')
json_call = ('<|open|>call tool="f" index="2"<|sep|><|open|>json type="object"<|sep|>{"a": [1, {"b": null}]}'
             '<|close|>json<|sep|><|close|>call<|sep|>')
tools = lambda body: "think<|close|>think<|sep|><|open|>tools<|sep|>" + body + "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
put("tool_calls", "two-calls", b"\0" + tools(call + json_call).encode())
put("tool_calls", "bad-number", b"\0" + tools(call.replace(">2<", ">two<")).encode())
put("tool_calls", "open-at-end", b"\0" + ("<|open|>tools<|sep|>" + call[:80]).encode())
put("tool_calls", "ids", b"\1" + bytes([0x00, 0x10, 0x27, 0x0f, 0x80, 0x00, 0x12, 0x35]))

# Anthropic Messages request bodies (k3-ctl serve /v1/messages)
def body(name, v):
    put("anthropic_body", name, json.dumps(v))
body("plain", {"model": "kimi-k3", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]})
body("system-thinking", {"model": "kimi-k3", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
                         "thinking": {"type": "enabled", "budget_tokens": 2048}, "stop_sequences": ["\n\n"],
                         "messages": [{"role": "user", "content": [{"type": "text", "text": "Why?"}]}]})
body("tools", {"model": "kimi-k3", "max_tokens": 32, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
               "tools": [{"name": "get_weather", "description": "Weather",
                          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
               "messages": [{"role": "user", "content": "Weather in Paris?"},
                            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                               "input": {"city": "Paris"}}]},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]})
body("sampling-edges", {"model": "kimi-k3", "max_tokens": 4096, "temperature": 1e-300, "top_p": 1e-45,
                        "messages": [{"role": "user", "content": "x"}]})
PY
du -sh "$out"
for d in "$out"/*/; do printf '%-20s %3d files %s\n' "$(basename "$d")" "$(ls "$d" | wc -l)" "$(du -sh "$d" | cut -f1)"; done
