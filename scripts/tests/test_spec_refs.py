"""Every spec reference in the repository resolves in docs/SPEC.md.

Code, `--help` texts, tests and docs cite the model spec as `SPEC.md §3.5`, `SPEC.md I34`,
`§10 C1`, `(I15–I19)`, … This test scans the tracked files at test time (`git ls-files`, so it
also covers whatever was merged since it was written) and fails on:

* a section `§N[.M…]` that is not a `## §N…` heading of docs/SPEC.md (bare `§` references count
  as SPEC references unless another document is named right before them: `PRODUCT.md §3`);
* an invariant `IN` or claim `CN` that is not a `- **IN**` / `- **CN**` item of docs/SPEC.md;
* any mention of the old out-of-repository spec file or of the directory it lived in.

Bare `I8`/`I16`/`I32`/`I64` are safetensors dtype names and are only checked when they follow
`SPEC.md` or a `§` reference.
"""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC_PATH = "docs/SPEC.md"
# Built from pieces so this file does not match its own check.
OLD_SPEC_NAME = "MODEL" + ".md"
OLD_SPEC_DIR = "/work/" + "shared"
# Files whose bare `IN` / `CN` tokens are checked (elsewhere only chained ones are).
PROSE_EXT = (".rs", ".py", ".sh", ".md", ".toml")
DTYPE_NAMES = {"I8", "I16", "I32", "I64"}

HEADING = re.compile(r"^#{1,6}\s+§(\d+(?:\.\d+)*)(?=\s|$)", re.M)
ITEM = re.compile(r"^\s*[-*]\s+\*\*([IC]\d+)\*\*", re.M)

SEC = re.compile(r"§\s?(\d+(?:\.\d+)*)(?![\d])")
ID = re.compile(r"([IC])(\d{1,2})(?![\w])")
NUM = re.compile(r"(\d+(?:\.\d+)*)(?![\d\w])")
# Between two items of one reference chain: spaces, commas, slashes, range dashes, "and", and a
# line break followed by a comment leader (`//!`, `///`, `//`, `#`, `*`).
SEP = re.compile(r"(?:[ \t,/–—`-]|\band\b|\n[ \t]*(?://[/!]?|#+|\*)?)*")
ANCHOR = re.compile(r"SPEC\.md|§")
# What names another document right before a `§`: `PRODUCT.md §3`, `*Book title*, §3.1`.
OTHER_DOC = re.compile(r"(?:\b([\w.-]+\.md)[`'\"]?|\*[^*\n]+\*,?)\s*$")


def spec_ids(text):
    """(section ids, invariant/claim ids) defined by a SPEC.md text."""
    return set(HEADING.findall(text)), set(ITEM.findall(text))


def _sec_key(s):
    return tuple(int(p) for p in s.split("."))


def _chain(text, i):
    """Items of the reference chain starting at `i`: ([(pos, kind, id)], end)."""
    items = []
    prev = None  # (kind, id) of the previous item
    end = i
    while True:
        s = SEP.match(text, i)
        sep, j = s.group(), s.end()
        if prev is not None and not sep:
            break
        dash = any(c in sep for c in "–—-")
        ms, mi, mn = SEC.match(text, j), ID.match(text, j), NUM.match(text, j)
        if ms:
            item, stop = ("sec", ms.group(1)), ms.end()
        elif mi and (j == 0 or not (text[j - 1].isalnum() or text[j - 1] == "_")):
            item, stop = ("id", mi.group(1) + mi.group(2)), mi.end()
        elif mn and dash and prev is not None and prev[0] == "sec":
            item, stop = ("sec", mn.group(1)), mn.end()  # `§2.3–2.7`
        else:
            break
        if dash and prev is not None and prev[0] == item[0] == "id" and prev[1][0] == item[1][0]:
            # `I6–I14`: every id in between is cited too.
            for k in range(int(prev[1][1:]) + 1, int(item[1][1:])):
                items.append((j, "id", f"{item[1][0]}{k}"))
        items.append((j, item[0], item[1]))
        prev = item
        i = end = stop
    return items, end


def find_refs(text, prose=True):
    """Every spec reference in `text`: a list of (line, kind, id), kind 'sec' or 'id'.

    A chain starts at `SPEC.md` or at a `§` and runs over ids joined by separators. A `§` chain
    right after another document's name is that document's and is skipped. With `prose`, lone
    `IN` / `CN` tokens outside chains are references too (except dtype names)."""
    refs, covered = [], []
    pos = 0
    while True:
        m = ANCHOR.search(text, pos)
        if not m:
            break
        start = m.start()
        items, end = _chain(text, m.end() if m.group() == "SPEC.md" else start)
        covered.append((start, max(end, m.end())))
        pos = max(end, m.end())
        if m.group() == "§":
            other = OTHER_DOC.search(text, max(0, start - 200), start)
            if other and other.group(1) != "SPEC.md":
                continue
        refs.extend(items)
    if prose:
        for mi in re.finditer(r"(?<![\w])([IC])([1-9]\d?)(?![\w])", text):
            tok = mi.group(1) + mi.group(2)
            if tok in DTYPE_NAMES or any(a <= mi.start() < b for a, b in covered):
                continue
            refs.append((mi.start(), "id", tok))
    return [(text.count("\n", 0, p) + 1, k, i) for p, k, i in sorted(refs)]


def tracked_texts():
    """(path, text) of every tracked text file."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    for rel in out.stdout.decode().split("\0"):
        if not rel:
            continue
        path = os.path.join(ROOT, rel)
        if not os.path.isfile(path) or os.path.getsize(path) > 8 << 20:
            continue
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" in data[:8192]:
            continue
        try:
            yield rel, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def test_spec_defines_every_referenced_id():
    with open(os.path.join(ROOT, SPEC_PATH), encoding="utf-8") as f:
        secs, ids = spec_ids(f.read())
    missing = []
    n_refs = 0
    for rel, text in tracked_texts():
        if rel == "fixtures/tokenizer/tiktoken.model":
            continue  # base64 token table
        for line, kind, ident in find_refs(text, prose=rel.endswith(PROSE_EXT)):
            n_refs += 1
            if (kind == "sec" and ident not in secs) or (kind == "id" and ident not in ids):
                shown = f"§{ident}" if kind == "sec" else ident
                missing.append(f"{rel}:{line}: {shown}")
    assert not missing, (
        f"references that docs/SPEC.md does not define ({len(missing)}):\n  "
        + "\n  ".join(missing)
    )
    # The repository cites the spec about a hundred times; far fewer means the scan broke.
    assert n_refs > 50, n_refs


def test_no_reference_to_the_old_spec_location():
    bad = []
    for rel, text in tracked_texts():
        for needle in (OLD_SPEC_NAME, OLD_SPEC_DIR):
            for k, line in enumerate(text.splitlines(), 1):
                if needle in line:
                    bad.append(f"{rel}:{k}: {line.strip()[:100]}")
    assert not bad, "mentions of a spec outside the repository:\n  " + "\n  ".join(bad)


def test_spec_structure():
    with open(os.path.join(ROOT, SPEC_PATH), encoding="utf-8") as f:
        text = f.read()
    secs, ids = spec_ids(text)
    items = ITEM.findall(text)
    assert len(items) == len(set(items)), "an invariant or claim is defined twice"
    headings = HEADING.findall(text)
    assert len(headings) == len(set(headings)), "a section heading is defined twice"
    # Top-level sections 1..11 in order; each subsection under its parent.
    tops = [h for h in headings if "." not in h]
    assert tops == [str(k) for k in range(1, 12)], tops
    for h in headings:
        if "." in h:
            assert h.rsplit(".", 1)[0] in secs, f"§{h} has no parent section"
    assert [_sec_key(h) for h in headings] == sorted(_sec_key(h) for h in headings)
    # Invariants live in §8, claims in §10, numbered without gaps.
    body8 = text.split("\n## §8 ", 1)[1].split("\n## §9 ", 1)[0]
    body10 = text.split("\n## §10 ", 1)[1].split("\n## §11 ", 1)[0]
    inv = [i for i in items if i.startswith("I")]
    cla = [i for i in items if i.startswith("C")]
    assert inv == [f"I{k}" for k in range(1, len(inv) + 1)] and len(inv) >= 38
    assert cla == [f"C{k}" for k in range(1, len(cla) + 1)] and len(cla) >= 18
    assert set(ITEM.findall(body8)) == set(inv)
    assert set(ITEM.findall(body10)) == set(cla)


# ------------------------------------------------------------------ the scanner itself


def _ids(text, prose=True):
    return [(k, i) for _, k, i in find_refs(text, prose)]


def test_scanner_finds_chains_ranges_and_continuations():
    assert _ids("see SPEC.md §1, §8 I1–I3).") == [
        ("sec", "1"), ("sec", "8"), ("id", "I1"), ("id", "I2"), ("id", "I3")]
    assert _ids("(SPEC.md §2.3–2.7)") == [("sec", "2.3"), ("sec", "2.7")]
    assert _ids("SPEC.md §2.8/§2.9. Ignored") == [("sec", "2.8"), ("sec", "2.9")]
    assert _ids("disputed (SPEC.md §10\n//! C4: the prompt") == [("sec", "10"), ("id", "C4")]
    assert _ids("(SPEC.md I34).") == [("id", "I34")]
    assert _ids("bare §3.3 loop") == [("sec", "3.3")]


def test_scanner_skips_other_documents_and_dtypes():
    assert _ids("the memory presets (PRODUCT.md §3).") == []
    assert _ids("question (PRODUCT.md §5–§6): the C engine") == []
    assert _ids("(Higham, *Accuracy and Stability*, §3.1).") == []
    assert _ids('"I64" | "U64" => 8, Dtype::I8') == []
    assert _ids("I0 = tc['intermediate_size']") == []
    assert _ids("router (I20) and (I22, I23)") == [("id", "I20"), ("id", "I22"), ("id", "I23")]
    assert _ids("router (I20)", prose=False) == []


def test_a_dangling_reference_is_reported():
    secs, ids = spec_ids("## §1 A\n### §1.1 B\n## §8 C\n- **I1** x\n")
    refs = find_refs("SPEC.md §1.2 and SPEC.md I2; SPEC.md §1.1, I1")
    bad = [(k, i) for _, k, i in refs if (k == "sec" and i not in secs) or (k == "id" and i not in ids)]
    assert bad == [("sec", "1.2"), ("id", "I2")]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
