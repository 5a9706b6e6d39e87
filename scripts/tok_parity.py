#!/usr/bin/env python3
"""Reference Kimi K3 tokenizer built on the `tiktoken` package, for parity checks of k3's Rust
tokenizer (`k3-ctl tokenize`).

It reproduces what `tokenization_kimi.py` (Moonshot's remote code) does:
  * `tiktoken.Encoding(pat_str=<Kimi pattern>, mergeable_ranks=<tiktoken.model>,
    special_tokens=<ids 163584..163839 named by tokenizer_config.json's added_tokens_decoder,
    else "<|reserved_token_{id}|>">)`;
  * `encode`: 400,000-character windows, each split by `_split_whitespaces_or_nonwhitespaces`
    (runs of > 25,000 consecutive whitespace / non-whitespace characters by `str.isspace`), then
    `encode(chunk, allowed_special="all")` with added tokens allowed or
    `encode(chunk, disallowed_special=())` for user text.

Usage (prints ids like `k3-ctl tokenize`, so the two outputs can be diffed):
    python3 scripts/tok_parity.py --tok fixtures/tokenizer --text "Hello world"
    python3 scripts/tok_parity.py --tok fixtures/tokenizer --file prompt.txt [--allow-special]
"""
import argparse
import base64
import json
import os
import random
import sys

import tiktoken

# tokenization_kimi.py `pat_str`, alternatives in order.
KIMI_PAT_PARTS = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]
KIMI_PAT_STR = "|".join(KIMI_PAT_PARTS)

NUM_RESERVED_SPECIAL_TOKENS = 256
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


def load_ranks(path):
    """Parses tiktoken.model (`<base64> <rank>` per line) without tiktoken's file cache."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f.read().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def load_encoding(tok_dir):
    """The tiktoken Encoding that tokenization_kimi.py builds from `tok_dir`."""
    ranks = load_ranks(os.path.join(tok_dir, "tiktoken.model"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    named = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
    n = len(ranks)
    special_tokens = {
        named.get(i, f"<|reserved_token_{i}|>"): i
        for i in range(n, n + NUM_RESERVED_SPECIAL_TOKENS)
    }
    return tiktoken.Encoding(
        name="kimi_k3",
        pat_str=KIMI_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens=special_tokens,
    )


def split_whitespaces_or_nonwhitespaces(s, max_consecutive_slice_len):
    """tokenization_kimi.py's run splitter: no chunk has more than `max_consecutive_slice_len`
    consecutive whitespace or non-whitespace characters (by `str.isspace`)."""
    current_slice_len = 0
    current_slice_is_space = s[0].isspace() if len(s) > 0 else False
    slice_start = 0
    for i in range(len(s)):
        is_now_space = s[i].isspace()
        if current_slice_is_space ^ is_now_space:
            current_slice_len = 1
            current_slice_is_space = is_now_space
        else:
            current_slice_len += 1
            if current_slice_len > max_consecutive_slice_len:
                yield s[slice_start:i]
                slice_start = i
                current_slice_len = 1
    yield s[slice_start:]


def kimi_chunks(text):
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        yield from split_whitespaces_or_nonwhitespaces(
            text[i : i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS
        )


def kimi_encode(enc, text, allow_special=False):
    """tokenization_kimi.py `encode(text, allow_special_tokens=allow_special)`."""
    ids = []
    for chunk in kimi_chunks(text):
        if allow_special:
            ids.extend(enc.encode(chunk, allowed_special="all"))
        else:
            ids.extend(enc.encode(chunk, disallowed_special=()))
    return ids


# Fragments for deterministic mixed text (tests and benchmark).
_FRAGMENTS = [
    "The quick brown fox jumps over the lazy dog. ",
    "It's what they'd've WANTED, isn't it? ",
    "人工智能正在改变世界，大型语言模型的推理需要大量内存。",
    "日本語の文章とカタカナ、ひらがなが混ざっています。",
    "안녕하세요, 오늘 날씨가 좋네요. ",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. ",
    "مرحبا بالعالم، هذا نص عربي. ",
    "שָׁלוֹם עוֹלָם ",
    "नमस्ते दुनिया, यह हिंदी पाठ है। ",
    "สวัสดีชาวโลกภาษาไทย ",
    "Καλημέρα κόσμε, ΑΒΓΔ. ",
    "e\u0301le\u0300ve na\u0303o ",
    "👨‍👩‍👧‍👦 👋🏽 🏳️‍🌈 🇫🇷 ❤️ ",
    "fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!(\"{v:?}\");\n}\n",
    "def f(x):\n\treturn {'a': x ** 2, \"b\": [1, 2, 3]}\n",
    '{"id": 12345, "name": "k3", "ok": true, "vals": [1.5, -2e10, null]}\n',
    "Version 3.14.159 released on 2026-11-29 at 23:59:59 UTC; 1234567890 bytes.\n",
    "\r\n",
    "\n\n",
    "    ",
    "\t\t",
    "<|open|>message<|sep|>",
    "ǅemal ʰʲ ⺀⼀〇々 ①② ½ ",
]


def mixed_text(n_bytes, seed):
    """Deterministic text of at least `n_bytes` UTF-8 bytes drawn from many scripts."""
    rng = random.Random(seed)
    parts = []
    size = 0
    while size < n_bytes:
        frag = rng.choice(_FRAGMENTS)
        if rng.random() < 0.1:
            frag = frag.upper()
        if rng.random() < 0.05:
            frag = str(rng.randrange(10 ** rng.randrange(1, 12)))
        parts.append(frag)
        size += len(frag.encode("utf-8"))
    return "".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tok", required=True, help="tokenizer directory")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--text")
    g.add_argument("--file")
    ap.add_argument("--allow-special", action="store_true")
    a = ap.parse_args()
    if a.file is not None:
        with open(a.file, "rb") as f:
            text = f.read().decode("utf-8")
    else:
        text = a.text
    enc = load_encoding(a.tok)
    print(",".join(map(str, kimi_encode(enc, text, a.allow_special))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
