"""README.md and each binary's `--help` agree (issue #49, item 8).

For every command (`k3-store start`, `k3-worker`, each `k3-ctl` subcommand) the flags its
`--help` lists are read, with the defaults clap prints (`[default: X]`), and compared with the
README section that documents the command:

* every flag of `--help` is named in that section (a flag the README does not mention is a
  flag a reader cannot find);
* every flag in the first column of the section's flag tables exists in `--help` (a renamed or
  removed flag left in the docs);
* where both state a default — the table's default column, or `(default X)` right after the
  flag — they are the same value;
* `--help` shows no Rust doc-link syntax (`` [`name`] ``) and names every directory argument
  `<DIR>` (or a more specific name ending in `_DIR`), as the README does.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
FLAG = re.compile(r"^\s+(?:-\w, )?(--[a-z0-9][a-z0-9-]*)(?:[ =](<[^>]+>|\S+))?")


def binary(name: str) -> Path:
    p = Path(os.environ.get("K3_BIN_DIR", ROOT / "target" / "debug")) / name
    assert p.exists(), f"{p} missing: build the workspace first (scripts/test.sh does)"
    return p


def help_text(cmd: list[str]) -> str:
    r = subprocess.run([binary(cmd[0]), *cmd[1:], "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def help_flags(text: str) -> dict[str, tuple[str | None, str | None, str]]:
    """flag -> (value name, default, description) from clap's help (short or long form)."""
    flags: dict[str, tuple[str | None, str | None, str]] = {}
    current = None
    for line in text.splitlines():
        m = FLAG.match(line)
        if m and line.lstrip().startswith("-"):
            current = m.group(1)
            flags[current] = (m.group(2), None, line[m.end():].strip())
        elif current and not flags[current][2]:
            flags[current] = (flags[current][0], None, line.strip())
        if current:
            d = re.search(r"\[default: ([^\]]+)\]", line)
            if d:
                flags[current] = (flags[current][0], d.group(1), flags[current][2])
    flags.pop("--help", None)
    flags.pop("--version", None)
    return flags


def section(heading: str) -> str:
    """The README text from `heading` to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = README.splitlines()
    start = lines.index(heading)
    out = []
    for line in lines[start + 1:]:
        m = re.match(r"^(#+) ", line)
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    return "\n".join(out)


def subcommands() -> list[str]:
    text = help_text(["k3-ctl"])
    body = text.split("Commands:")[1].split("Options:")[0]
    return [line.split()[0] for line in body.splitlines() if line.strip() and line.split()[0] != "help"]


def norm(v: str) -> str:
    return v.strip().strip("`").replace(",", "").replace("_", "").rstrip(".").strip()


def table_rows(text: str) -> list[tuple[list[str], list[str]]]:
    """(header cells, row cells) of every table row whose first cell names a flag."""
    rows, header = [], []
    for line in text.splitlines():
        if not line.startswith("|"):
            header = []
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if not header:
            header = [c.lower() for c in cells]
            continue
        if cells and cells[0].startswith("`--"):
            rows.append((header, cells))
    return rows


def documented_default(doc: str, flag: str) -> str | None:
    """The default the README states for `flag`: its table row's default column, or `(default X`
    in its row or right after its name in prose."""
    for header, cells in table_rows(doc):
        names = re.findall(r"--[a-z0-9-]+", cells[0])
        if flag not in names:
            continue
        if "default" in header and len(names) == 1:
            return cells[header.index("default")]
        m = re.search(r"\(default (`[^`]+`|[^,;)]+)", " ".join(cells[1:]))
        if m and len(names) == 1:
            return m.group(1)
    m = re.search(re.escape(flag) + r"\b[^()|`]{0,40}`? \(default (`[^`]+`|[^,;)]+)", doc)
    return m.group(1) if m else None


COMMANDS = [(["k3-store", "start"], "### k3-store start"), (["k3-worker"], "### k3-worker")]


def commands():
    out = list(COMMANDS)
    for sub in subcommands():
        out.append((["k3-ctl", sub], "### OpenAI-compatible server" if sub == "serve" else "### k3-ctl"))
    return out


@pytest.mark.parametrize("cmd,heading", commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_readme_and_help_name_the_same_flags_and_defaults(cmd, heading):
    text = help_text(cmd)
    flags = help_flags(text)
    doc = section(heading)
    name = " ".join(cmd)
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![a-z0-9-])", doc)]
    assert not missing, f"`{name} --help` has flags the README's {heading!r} does not name: {missing}"
    if cmd[0] != "k3-ctl" or cmd[1] == "serve":
        stale = [f for _, cells in table_rows(doc) for f in re.findall(r"--[a-z0-9-]+", cells[0])
                 if f not in flags]
        assert not stale, f"README's {heading!r} tables name flags `{name} --help` lacks: {stale}"
    wrong = []
    for f, (_, default, _) in flags.items():
        said = documented_default(doc, f)
        if default is not None and said is not None and norm(said) != norm(default):
            wrong.append(f"{f}: README {said!r}, --help {default!r}")
    assert not wrong, f"{name}: defaults disagree: {wrong}"
    assert not re.search(r"\[`[^`]+`\]", text), f"`{name} --help` shows Rust doc-link syntax"
    for f, (value, _, desc) in flags.items():
        # (a path that may also be a file, as the doctor's --dir, stays a PATH)
        if value and re.match(r"^(\w+ )?(packed trunk |tokenizer |checkpoint )?directory\b", desc, re.I) \
                and " file" not in desc:
            assert value == "<DIR>" or value.endswith("_DIR>"), f"`{name} {f} {value}` ({desc}): directories are <DIR>"


def test_the_default_reader_finds_table_columns_and_prose():
    global README
    saved = README
    README = ("### t\n| flag | default | meaning |\n|---|---|---|\n| `--a N` | 8 | x |\n"
              "| `--b X` | meaning (default 3) |\nand `--c N` (default 7, at most 9)\n")
    try:
        doc = section("### t")
        assert documented_default(doc, "--a") == "8"
        assert documented_default(doc, "--c") == "7"
        assert norm(documented_default("| flag | meaning |\n|---|---|\n| `--e L` | x (default `a,b`) |", "--e") or "") == "ab"
        assert documented_default(doc, "--d") is None
    finally:
        README = saved
