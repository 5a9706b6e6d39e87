#!/usr/bin/env python3
"""Encode throughput of k3's tokenizer vs the `tiktoken` package on the same mixed text.

    cargo build --release -p k3-ctl
    python3 scripts/bench_tokenizer.py [--mb 10] [--runs 5] [--k3-ctl target/release/k3-ctl]

What is timed:
  * k3: `k3-ctl tokenize --file F --stats` reports `encode_s`, measured inside the process
    around the encode call only (UTF-8 check + chunking + pre-tokenizer + BPE); tokenizer
    loading, file reading and printing are excluded. Both pre-tokenizers: the hand-written
    scanner (default) and the fancy-regex reference (`--regex-pretok`).
  * tiktoken, in-process, single thread: `Encoding.encode_ordinary` over the text already cut
    by tokenization_kimi.py's chunking (cutting not timed: tiktoken's core alone), and
    `tok_parity.kimi_encode` (the Python chunking loop + tiktoken, what the Hugging Face
    tokenizer does). Chunking matters here: the 400,000-character windows cut words.
MB/s = UTF-8 input bytes / 1e6 / seconds; median and min..max of `--runs` runs each.
The benchmark checks its own output: every engine must give the same ids.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tok_parity

ROOT = Path(__file__).resolve().parents[1]
TOK_DIR = ROOT / "fixtures" / "tokenizer"


def k3_run(k3ctl, path, extra=()):
    r = subprocess.run(
        [str(k3ctl), "tokenize", "--tok", str(TOK_DIR), "--file", str(path), "--stats", *extra],
        capture_output=True,
        check=True,
    )
    m = re.search(r"encode_s=([0-9.]+)", r.stderr.decode())
    if not m:
        sys.exit(f"no encode_s in k3-ctl stats: {r.stderr.decode()!r}")
    line = r.stdout.decode().strip()
    ids = [int(x) for x in line.split(",")] if line else []
    return float(m.group(1)), ids


def summary(name, n_bytes, secs):
    med = statistics.median(secs)
    rates = sorted(n_bytes / 1e6 / s for s in secs)
    print(
        f"{name:<42} median {n_bytes / 1e6 / med:8.2f} MB/s  "
        f"(range {rates[0]:.2f}..{rates[-1]:.2f}; median {med:.3f} s)"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=10.0, help="input size in MB (default 10)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--k3-ctl", default=str(ROOT / "target" / "release" / "k3-ctl"))
    a = ap.parse_args()
    k3ctl = Path(a.k3_ctl)
    if not k3ctl.is_file():
        sys.exit(f"{k3ctl} not found: run `cargo build --release -p k3-ctl` first")

    text = tok_parity.mixed_text(int(a.mb * 1e6), seed=a.seed)
    data = text.encode("utf-8")
    enc = tok_parity.load_encoding(str(TOK_DIR))
    print(f"input: {len(data)} bytes, {len(text)} characters (tok_parity.mixed_text seed {a.seed})")
    print(f"k3-ctl: {k3ctl}; tiktoken {getattr(__import__('tiktoken'), '__version__', '?')}; "
          f"{os.cpu_count()} CPUs visible; runs: {a.runs}")

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.txt"
        path.write_bytes(data)

        chunks = list(tok_parity.kimi_chunks(text))

        def core():
            ids = []
            for c in chunks:
                ids.extend(enc.encode_ordinary(c))
            return ids

        def k3(extra):
            return lambda: k3_run(k3ctl, path, extra)

        def timed(fn):
            t0 = time.perf_counter()
            ids = fn()
            return time.perf_counter() - t0, ids

        engines = [
            ("tiktoken core (pre-chunked)", lambda: timed(core)),
            ("tiktoken + tokenization_kimi chunking",
             lambda: timed(lambda: tok_parity.kimi_encode(enc, text))),
            ("k3 (scanner pre-tokenizer)", k3(())),
            ("k3 (--regex-pretok)", k3(("--regex-pretok",))),
        ]
        reference = None
        results = {name: [] for name, _ in engines}
        # Runs are interleaved (each engine once per round) so that load from other processes
        # on the machine affects every engine alike.
        for _ in range(a.runs):
            for name, fn in engines:
                secs, ids = fn()
                if reference is None:
                    reference = ids
                elif ids != reference:
                    sys.exit(f"{name}: ids differ from tiktoken core")
                results[name].append(secs)

    print(f"tokens: {len(reference)} (identical across all engines); "
          f"load average after: {os.getloadavg()[0]:.1f}")
    for name, secs in results.items():
        summary(name, len(data), secs)


if __name__ == "__main__":
    sys.exit(main())
