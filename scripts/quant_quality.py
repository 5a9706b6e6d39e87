#!/usr/bin/env python3
"""The quantized trunk's quality, independently: the same int8/int4 quantization as
`k3-ctl pack-trunk --codec int8|int4` (SPEC.md §6.15), written here from the spec alone and
applied to the CHECKPOINT's tensors (never to a packed trunk), run by the float64 numpy reference
forward (scripts/k3ref) over a text scored the way `k3-worker --perplexity` scores it (SPEC.md
§6.16): mean NLL and perplexity per model, and against the exact model the mean and 99th
percentile KL divergence and the top-1 agreement.

    python3 scripts/quant_quality.py MODEL_DIR --text FILE [--window 512] [--kinds exact,int8,int4]
        [--json OUT] [--limit N]
    python3 scripts/quant_quality.py --make-heldout fixtures/trained/heldout.txt

Windowing: the text is tokenized as user text with the tiktoken reproduction of the tokenizer
(scripts/tok_parity.py), cut into windows of --window ids, each scored after [BOS] from a fresh
state; every id is scored once. --limit N scores only the first N ids (a quick check).

Quantization (per BF16 weight matrix [rows, cols] with rows > 1, cols a multiple of 32, not
kv_b_proj, not the router; everything else exact): weights widened to float32; int8: one scale
per row s = max|w| / 127 (float32), codes round(w / s) (float32 division, ties away from zero)
clamped to ±127; int4: one scale per 32 columns s = w_ext / -8 (w_ext the group's value of largest
magnitude, the first on ties), codes clamped to -8..7; a zero or non-finite scale gives zero
codes. The reference multiplies by the dequantized matrix q·s in
float64.

Exit codes: 0 ok; 1 failure; 2 usage error or a checkpoint that cannot be bound.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from k3ref.checkpoint import Checkpoint, CheckpointError  # noqa: E402
from k3ref.config import ConfigError, read_config  # noqa: E402
from k3ref.model import BindError, State, bind, forward  # noqa: E402

BOS = 163584
GROUP = 32
CHUNK = 64


def quantizable(name: str, dtype: str, shape) -> bool:
    """SPEC.md §6.15: which trunk tensors a quantized trunk quantizes."""
    return (dtype == "BF16" and len(shape) == 2 and shape[0] > 1 and shape[1] > 0
            and shape[1] % GROUP == 0 and ".layers." in name
            and not name.endswith("kv_b_proj.weight")
            and not name.endswith("block_sparse_moe.gate.weight"))


def _codes(w32: np.ndarray, s32: np.ndarray, qmax: int, lo=None, hi=None) -> np.ndarray:
    """round(w / s) in float32, ties away from zero, clamped to [lo, hi] (default ±qmax); 0
    where s is 0 or the value not finite."""
    with np.errstate(divide="ignore", invalid="ignore"):
        x = (w32 / s32).astype(np.float32).astype(np.float64)
    q = np.clip(np.sign(x) * np.floor(np.abs(x) + 0.5), -qmax if lo is None else lo,
                qmax if hi is None else hi)
    return np.where(np.broadcast_to(s32 == 0, q.shape) | ~np.isfinite(x), 0.0, q)


def _scales(w32: np.ndarray, qmax: int) -> np.ndarray:
    """max|w| / qmax in float32 over the last axis; 0 where that is not finite."""
    m = np.max(np.abs(w32), axis=-1, keepdims=True)
    s = (m / np.float32(qmax)).astype(np.float32)
    return np.where(np.isfinite(s), s, np.float32(0))


def dequantize(kind: str, w: np.ndarray) -> np.ndarray:
    """The float64 matrix an int8/int4 trunk stores for the bf16 matrix ``w`` (q·s)."""
    w32 = np.asarray(w, dtype=np.float32)
    if kind == "int8":
        s = _scales(w32, 127)
        return _codes(w32, s, 127) * s.astype(np.float64)
    if kind == "int4":
        g = w32.reshape(w32.shape[0], -1, GROUP)
        # The group's value of largest magnitude (the first on ties) is code -8: s = w_ext / -8.
        mag = np.where(np.isnan(g), np.float32(-1), np.abs(g))
        ext = np.take_along_axis(g, np.argmax(mag, axis=-1)[..., None], axis=-1)
        s = (ext / np.float32(-8)).astype(np.float32)
        s = np.where(np.isfinite(s), s, np.float32(0))
        return (_codes(g, s, 8, lo=-8, hi=7) * s.astype(np.float64)).reshape(w32.shape)
    raise ValueError(f"kind {kind!r}")


class Quantized:
    """The checkpoint as a quantized trunk gives it: quantizable matrices dequantized, the rest
    as stored (a mapping for ``k3ref.model.bind``)."""

    def __init__(self, ckpt: Checkpoint, kind: str):
        self.ckpt, self.kind = ckpt, kind

    def __contains__(self, name):
        return name in self.ckpt

    def __getitem__(self, name):
        a = self.ckpt[name]
        info = self.ckpt.infos.get(name)
        if info is not None and quantizable(name, info.dtype, info.shape):
            return dequantize(self.kind, a)
        return a


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of float64 log-probabilities."""
    m = logits.max(axis=-1, keepdims=True)
    return logits - (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))


def tokenize(text_path: Path, tok_dir: Path) -> list[int]:
    from tok_parity import kimi_encode, load_encoding
    enc = load_encoding(str(tok_dir))
    return kimi_encode(enc, text_path.read_text(encoding="utf-8"))


def score(models: dict, ids: list[int], window: int) -> dict:
    """Per model: mean NLL; per quantized model against "exact": mean/p99/max KL, top-1
    agreement (the windows of SPEC.md §6.16)."""
    nll = {k: 0.0 for k in models}
    kls = {k: [] for k in models if k != "exact"}
    same = {k: 0 for k in kls}
    n = 0
    for w0 in range(0, len(ids), window):
        w = ids[w0:w0 + window]
        inp = [BOS] + w[:-1]
        states = {k: State.new(m) for k, m in models.items()}
        for c in range(0, len(inp), CHUNK):
            lp = {k: log_softmax(forward(m, inp[c:c + CHUNK], states[k])) for k, m in models.items()}
            nxt = np.asarray(w[c:c + CHUNK])
            rows = np.arange(len(nxt))
            for k in models:
                nll[k] -= float(lp[k][rows, nxt].sum())
            if "exact" in lp:
                p = np.exp(lp["exact"])
                top = lp["exact"].argmax(axis=-1)
                for k in kls:
                    kls[k].extend((p * (lp["exact"] - lp[k])).sum(axis=-1).tolist())
                    same[k] += int((lp[k].argmax(axis=-1) == top).sum())
            n += len(nxt)
    out = {"positions": n, "window": window, "windows": math.ceil(len(ids) / window), "models": {}}
    for k in models:
        r = {"mean_nll": nll[k] / n, "perplexity": math.exp(nll[k] / n)}
        if k in kls:
            v = np.sort(np.asarray(kls[k]))
            r["kl_mean"] = float(v.mean())
            r["kl_p99"] = float(v[max(1, math.ceil(0.99 * len(v))) - 1])
            r["kl_max"] = float(v[-1])
            r["top1_agreement"] = same[k] / n
        out["models"][k] = r
    return out


def heldout_text(prose_chars: int = 8_000, code_chars: int = 6_000, per_doc: int = 2_000) -> str:
    """The trained proxy's held-out text (fixtures/trained/heldout.txt): from the validation
    split of its corpus (scripts/k3train/corpus.py: never trained on), in path order, the first
    ``per_doc`` characters of each document (cut at a line end), joined by blank lines, until
    ``prose_chars`` of documentation (docs/) and ``code_chars`` of code (django/)."""
    from k3train import corpus
    docs = corpus.documents(corpus.fetch())
    val = [(p, t) for i, (p, t) in enumerate(docs) if i % corpus.VAL_EVERY == 0]
    parts = []
    for prefix, budget in (("docs/", prose_chars), ("django/", code_chars)):
        took = 0
        for p, t in val:
            if not p.startswith(prefix) or took >= budget:
                continue
            piece = t[:per_doc]
            if len(t) > per_doc and "\n" in piece:
                piece = piece[:piece.rindex("\n") + 1]
            piece = piece.strip("\n")
            if piece:
                parts.append(piece)
                took += len(piece)
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path, nargs="?")
    ap.add_argument("--text", type=Path)
    ap.add_argument("--make-heldout", type=Path, metavar="OUT",
                    help="write the held-out text (fixtures/trained/heldout.txt) from the corpus and exit")
    ap.add_argument("--tok", type=Path, default=HERE.parent / "fixtures" / "tokenizer")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--kinds", default="exact,int8,int4")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.make_heldout is not None:
        a.make_heldout.write_text(heldout_text(), encoding="utf-8")
        return 0
    if a.model_dir is None or a.text is None:
        ap.error("MODEL_DIR and --text are needed (or --make-heldout OUT)")
    kinds = a.kinds.split(",")
    if a.window < 1 or any(k not in ("exact", "int8", "int4") for k in kinds):
        ap.error("--window >= 1; --kinds from exact, int8, int4")
    try:
        cfg = read_config(a.model_dir / "config.json")
        ckpt = Checkpoint(a.model_dir)
        models = {k: bind(cfg, ckpt if k == "exact" else Quantized(ckpt, k)) for k in kinds}
    except (ConfigError, CheckpointError, BindError) as e:
        print(f"quant_quality: {e}", file=sys.stderr)
        return 2
    ids = tokenize(a.text, a.tok)
    if a.limit is not None:
        ids = ids[:a.limit]
    if not ids:
        print("quant_quality: the text has no ids", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    r = score(models, ids, a.window)
    r["text"] = str(a.text)
    r["seconds"] = time.monotonic() - t0
    for k, m in r["models"].items():
        extra = ""
        if "kl_mean" in m:
            extra = (f"; vs exact: mean KL {m['kl_mean']:.6f}, p99 {m['kl_p99']:.6f}, max {m['kl_max']:.6f}, "
                     f"top-1 agreement {100 * m['top1_agreement']:.3f}%")
        print(f"{k}: {r['positions']} ids, mean NLL {m['mean_nll']:.6f}, perplexity {m['perplexity']:.4f}{extra}")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
