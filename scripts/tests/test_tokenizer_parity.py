"""Token-for-token parity of `k3-ctl tokenize` with the `tiktoken` package configured like
Moonshot's `tokenization_kimi.py` (scripts/tok_parity.py), plus byte-exact decode round trips.

Runs the `k3-ctl` that `cargo build` produces for this test run (built once per session, so an
edited source is what gets tested; override with the K3_CTL environment variable). Inputs are
passed through files so that bytes are exact and large inputs do not hit argument-length limits.
"""
import json
import os
import random
import subprocess
from pathlib import Path

import pytest

import tok_parity

ROOT = Path(__file__).resolve().parents[2]
TOK_DIR = ROOT / "fixtures" / "tokenizer"
CORPUS = Path(__file__).resolve().parent / "tok_corpus.json"


def k3ctl_path():
    if "K3_CTL" in os.environ:
        p = Path(os.environ["K3_CTL"])
        if not p.is_file():
            pytest.fail(f"K3_CTL={p} is not a file")
        return p
    # Build it now and take the path Cargo reports, never whatever sits under target/.
    r = subprocess.run(
        [os.environ.get("CARGO", "cargo"), "build", "-p", "k3-ctl", "--bin", "k3-ctl",
         "--message-format=json-render-diagnostics"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    if r.returncode != 0:
        pytest.fail(f"cargo build -p k3-ctl failed ({r.returncode}):\n{r.stderr}")
    for line in r.stdout.splitlines():
        msg = json.loads(line)
        if (msg.get("reason") == "compiler-artifact" and msg.get("executable")
                and msg["target"]["name"] == "k3-ctl"):
            return Path(msg["executable"])
    pytest.fail(f"cargo build reported no k3-ctl executable:\n{r.stderr}")


@pytest.fixture(scope="module")
def k3ctl():
    return k3ctl_path()


@pytest.fixture(scope="module")
def enc():
    return tok_parity.load_encoding(str(TOK_DIR))


def k3_tokenize(k3ctl, tmp_path, text, allow_special=False, extra=()):
    f = tmp_path / "input.txt"
    f.write_bytes(text.encode("utf-8"))
    cmd = [str(k3ctl), "tokenize", "--tok", str(TOK_DIR), "--file", str(f), *extra]
    if allow_special:
        cmd.append("--allow-special")
    r = subprocess.run(cmd, capture_output=True)
    assert r.returncode == 0, f"k3-ctl tokenize failed ({r.returncode}): {r.stderr.decode()}"
    out = r.stdout.decode("ascii")
    assert out.endswith("\n") and out.count("\n") == 1, f"not one line: {out[:200]!r}"
    line = out[:-1]
    return [int(x) for x in line.split(",")] if line else []


def k3_detokenize(k3ctl, tmp_path, ids):
    f = tmp_path / "ids.txt"
    f.write_text(",".join(map(str, ids)))
    r = subprocess.run(
        [str(k3ctl), "detokenize", "--tok", str(TOK_DIR), "--ids-file", str(f)],
        capture_output=True,
    )
    assert r.returncode == 0, f"k3-ctl detokenize failed ({r.returncode}): {r.stderr.decode()}"
    return r.stdout


def describe_mismatch(enc, got, want):
    n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    piece = lambda ids: [enc.decode_single_token_bytes(i) for i in ids]  # noqa: E731
    return (
        f"first difference at index {n} (k3 {len(got)} ids, tiktoken {len(want)} ids)\n"
        f"  k3:       {got[max(0, n - 3):n + 4]} {piece(got[max(0, n - 3):n + 4])}\n"
        f"  tiktoken: {want[max(0, n - 3):n + 4]} {piece(want[max(0, n - 3):n + 4])}"
    )


def assert_parity(enc, k3ctl, tmp_path, text, allow_special, extra=()):
    want = tok_parity.kimi_encode(enc, text, allow_special)
    got = k3_tokenize(k3ctl, tmp_path, text, allow_special, extra)
    assert got == want, describe_mismatch(enc, got, want)
    return got


def load_corpus():
    with open(CORPUS, encoding="utf-8") as f:
        return json.load(f)["cases"]


CASES = load_corpus()


def test_corpus_is_broad():
    assert len(CASES) >= 60
    assert any(c["allow_special"] for c in CASES)
    assert any(c["text"] == "" for c in CASES)


@pytest.fixture(scope="module")
def corpus_ids():
    """k3's ids per corpus case, filled by test_corpus_case."""
    return {}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_corpus_case(enc, k3ctl, tmp_path, corpus_ids, case):
    text, allow = case["text"], case["allow_special"]
    ids = assert_parity(enc, k3ctl, tmp_path, text, allow)
    if not allow:
        # User text never yields an added-token id.
        assert all(i < 163584 for i in ids)
    corpus_ids[case["name"]] = ids


def test_corpus_round_trip(enc, k3ctl, tmp_path, corpus_ids):
    # Decoding is concatenation, so one detokenize of every case's ids back to back must give
    # every case's bytes back to back (one process instead of one per case).
    ids, want = [], b""
    for c in CASES:
        case_ids = corpus_ids.get(c["name"])
        if case_ids is None:  # run alone: tokenize here
            case_ids = tok_parity.kimi_encode(enc, c["text"], c["allow_special"])
        ids += case_ids
        want += c["text"].encode("utf-8")
    assert k3_detokenize(k3ctl, tmp_path, ids) == want


def test_goldens_exact(k3ctl, tmp_path):
    # SPEC.md §5.2 goldens, independent of tiktoken.
    goldens = {
        "The capital of France is": [1008, 10484, 318, 15383, 387],
        "Hello world": [19180, 2695],
        "你好世界": [33845, 2243],
        "Hello, world!": [19180, 11, 2695, 0],
        "1234567890": [6694, 12972, 16242, 15],
        "中文English混合": [16717, 44372, 13935],
    }
    for text, want in goldens.items():
        assert k3_tokenize(k3ctl, tmp_path, text) == want, text
    assert 163587 not in k3_tokenize(k3ctl, tmp_path, "<|open|>")
    assert k3_tokenize(k3ctl, tmp_path, "<|open|>", allow_special=True) == [163587]


def test_regex_reference_pretokenizer_matches_tiktoken(enc, k3ctl, tmp_path):
    # The hidden --regex-pretok path (fancy-regex running the pattern verbatim) on the whole
    # corpus joined together, both modes.
    text = "\n".join(c["text"] for c in CASES)
    for allow in (False, True):
        assert_parity(enc, k3ctl, tmp_path, text, allow, extra=["--regex-pretok"])


# ---- long inputs: the tokenization_kimi.py chunking rule ---------------------------------------

# name -> (text generator, whether tokenization_kimi.py's chunking changes tiktoken's ids for it)
LONG_CASES = {
    # > 25,000 consecutive non-whitespace characters: a chunk ends after 25,000 of them, here in
    # the middle of a word (an offset first character moves the cut off a token boundary).
    "letters_26k": (lambda: "q" + "ab" * 13_000, True),
    "words_no_space_26k": (lambda: "xyz" + "abcdefghij" * 2_600, True),
    "han_27k": (lambda: "中" + "人工智能模型" * 4_500, True),
    "mixed_no_space_60k": (lambda: "z" + "abc123!?" * 7_500, True),
    "letters_then_text": (lambda: "b" * 25_001 + " tail words", True),
    # > 25,000 consecutive whitespace characters.
    "spaces_60k": (lambda: " " * 60_000 + "x", True),
    "newlines_30k": (lambda: "x" + "\n" * 30_000 + "y", True),
    # U+001C is whitespace for Python's isspace (so it ends the letter runs and nothing is cut),
    # but not for \s; a splitter using \s would cut the 40,010-character run.
    "py_isspace_breaks_runs": (lambda: "a" * 20_000 + "\u001c" * 10 + "a" * 20_000, False),
    "py_isspace_only_26k": (lambda: "\u001c" * 26_000, False),
    # Crosses the 400,000-character window boundary in the middle of a word.
    "window_450k_chars": (lambda: "zz" + "abcdefgh " * 50_000, True),
}


@pytest.mark.parametrize("name", sorted(LONG_CASES))
def test_long_runs_and_windows(enc, k3ctl, tmp_path, name):
    text = LONG_CASES[name][0]()
    ids = assert_parity(enc, k3ctl, tmp_path, text, False)
    assert k3_detokenize(k3ctl, tmp_path, ids) == text.encode("utf-8")


@pytest.mark.parametrize("name", sorted(k for k, v in LONG_CASES.items() if v[1]))
def test_long_cases_exercise_chunking(enc, name):
    # Guard: without the chunking rule, tiktoken gives other ids for these texts, so the parity
    # above would catch a missing or misplaced cut.
    text = LONG_CASES[name][0]()
    assert enc.encode_ordinary(text) != tok_parity.kimi_encode(enc, text)


def test_py_isspace_case_catches_wrong_space_test(enc):
    # Guard: run splitting with \s instead of str.isspace would give other ids.
    text = LONG_CASES["py_isspace_breaks_runs"][0]()
    cut = 25_000  # \s sees one 40,010-character non-space run: first cut after 25,000
    wrong = enc.encode_ordinary(text[:cut]) + enc.encode_ordinary(text[cut:])
    assert wrong != tok_parity.kimi_encode(enc, text)


def test_every_code_point_shuffled(enc, k3ctl, tmp_path):
    # Every Unicode scalar value once, in a fixed random order: each class boundary of the
    # pattern against tiktoken's own Unicode tables.
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    random.Random(7).shuffle(cps)
    assert_parity(enc, k3ctl, tmp_path, "".join(map(chr, cps)), False)


def test_round_trip_1mb_mixed(enc, k3ctl, tmp_path):
    text = tok_parity.mixed_text(1_100_000, seed=1)
    data = text.encode("utf-8")
    assert len(data) >= 1_000_000
    for allow in (False, True):
        ids = assert_parity(enc, k3ctl, tmp_path, text, allow)
        assert k3_detokenize(k3ctl, tmp_path, ids) == data


# ---- CLI error handling -----------------------------------------------------------------------


def run(k3ctl, *args):
    return subprocess.run([str(k3ctl), *args], capture_output=True)


def test_cli_errors_exit_2(k3ctl, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"abc\xff\xfe")
    r = run(k3ctl, "tokenize", "--tok", str(TOK_DIR), "--file", str(bad))
    assert r.returncode == 2 and b"offset 3" in r.stderr, r.stderr
    r = run(k3ctl, "tokenize", "--tok", str(tmp_path / "none"), "--text", "x")
    assert r.returncode == 2 and b"tiktoken.model" in r.stderr, r.stderr
    r = run(k3ctl, "tokenize", "--tok", str(TOK_DIR))
    assert r.returncode == 2
    r = run(k3ctl, "detokenize", "--tok", str(TOK_DIR), "--ids", "1,163840")
    assert r.returncode == 2 and b"163840" in r.stderr and r.stdout == b"", r
    r = run(k3ctl, "detokenize", "--tok", str(TOK_DIR), "--ids", "1,,2")
    assert r.returncode == 2, r
    r = run(k3ctl, "detokenize", "--tok", str(TOK_DIR), "--ids", "")
    assert r.returncode == 0 and r.stdout == b""
    r = run(k3ctl, "detokenize", "--tok", str(TOK_DIR), "--ids", "163587,19180")
    assert r.returncode == 0 and r.stdout == b"<|open|>Hello"
    r = run(k3ctl, "tokenize", "--tok", str(TOK_DIR), "--text", "")
    assert r.returncode == 0 and r.stdout == b"\n"
