"""Every command block of README.md runs as written (issue #49, item 2).

The README's fenced blocks are read in order. A block tagged `sh` is a command block: it runs,
unless the line right before its fence is a marker `<!-- needs: WHAT -->` saying what it needs
that this machine has not (the real checkpoint, a second machine, macOS, …); such blocks are
listed, never run. A block tagged with another language (`python`, `json`, `text`) is a snippet,
not a command. An untagged block fails the test: tag it (and mark it if it cannot run here).

The runnable blocks run as ONE bash script (`set -euo pipefail`), in README order, from the
repository's root, so a block may use what an earlier one set (the five-minute route's `$K3`
is used by the block after it). Nothing is substituted: the blocks make their own directories
with `mktemp` and pick their own ports. The test only points `TMPDIR` and `XDG_RUNTIME_DIR` into
its own temporary directory, so whatever a block leaves behind is found and removed, and any
process still running from it afterwards fails the test (and is stopped).

Checked beside the exit status, per block: the trained proxy wrote text; the five-minute route
printed the store's plan and readiness, got a chat completion with a message from `curl` and a
non-empty streamed answer from the `openai` client, and took under five minutes (build check
included); the step after it ran a worker and a chat turn against the route's store and stopped
it; the typical session's first worker missed (TRUE resident hit rate below 100%: `--preload
off`) and the second found every expert resident, as the README says it prints.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ROUTE_LIMIT_S = 300
FENCE = re.compile(r"^```(\S*)\s*$")
NEEDS = re.compile(r"^<!-- needs: (.+) -->$")
MARK = "@@k3-readme-block"


@dataclass
class Block:
    line: int            # 1-based line of the opening fence
    lang: str
    marker: str          # the line right before the fence ("" if blank or none)
    text: str

    @property
    def needs(self) -> str | None:
        m = NEEDS.match(self.marker)
        return m.group(1) if m else None


def blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j] != "```":
            j += 1
        assert j < len(lines), f"README.md:{start + 1}: a block that never closes"
        marker = lines[start - 1].strip() if start > 0 else ""
        out.append(Block(start + 1, m.group(1), marker, "\n".join(lines[start + 1:j]) + "\n"))
        i = j + 1
    return out


def test_the_block_reader_sees_tags_markers_and_ends():
    text = "a\n<!-- needs: a GPU -->\n```sh\nx\n```\n\n```python\ny = 1\n```\n```\nz\n```\n"
    b = blocks(text)
    assert [(x.line, x.lang, x.needs, x.text) for x in b] == [
        (3, "sh", "a GPU", "x\n"), (7, "python", None, "y = 1\n"), (10, "", None, "z\n")]


def test_every_readme_block_is_tagged_and_every_unrunnable_one_says_why():
    untagged = [b.line for b in blocks(README.read_text()) if not b.lang]
    assert not untagged, (f"README.md blocks without a language at lines {untagged}: tag each "
                          "(```sh for commands) and mark a command block that cannot run here "
                          "with <!-- needs: WHAT --> on the line before its fence")
    runnable = [b for b in blocks(README.read_text()) if b.lang == "sh" and b.needs is None]
    # The route, its next step, the trained proxy and the typical session at least.
    assert len(runnable) >= 4, [b.line for b in runnable]


def script(runnable: list[Block]) -> str:
    parts = ["set -euo pipefail"]
    for b in runnable:
        parts.append(f'echo "{MARK} {b.line} $(date +%s.%N)"; echo "{MARK} {b.line}" >&2')
        parts.append(b.text)
    parts.append(f'echo "{MARK} end $(date +%s.%N)"')
    return "\n".join(parts) + "\n"


def split(out: str) -> tuple[dict[int, str], dict[int, float]]:
    """Output per block (by fence line) and, from stdout's time stamps, each block's seconds."""
    texts: dict[int, list[str]] = {}
    starts: list[tuple[str, float]] = []
    current = None
    for line in out.splitlines():
        if line.startswith(MARK):
            _, key, *t = line.split()
            if t:
                starts.append((key, float(t[0])))
            current = None if key == "end" else int(key)
            if current is not None:
                texts[current] = []
            continue
        if current is not None:
            texts[current].append(line)
    secs = {int(k): t1 - t0 for (k, t0), (_, t1) in zip(starts, starts[1:]) if k != "end"}
    return {k: "\n".join(v) for k, v in texts.items()}, secs


def leftovers(tmp: Path) -> list[int]:
    """Pids of processes whose command line names a path inside `tmp` (what the blocks started)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if str(tmp).encode() in cmd:
            pids.append(int(d.name))
    return pids


def stop_leftovers(tmp: Path) -> list[int]:
    for sock in tmp.rglob("*.sock"):
        subprocess.run([ROOT / "target" / "debug" / "k3-ctl", "stop", "--socket", sock],
                       capture_output=True, timeout=60)
    left = leftovers(tmp)
    for pid in left:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return left


def by_content(found: dict[int, str], runnable: list[Block], needle: str) -> tuple[Block, str]:
    b = next((b for b in runnable if needle in b.text), None)
    assert b is not None, f"no runnable README block contains {needle!r}"
    assert b.line in found, f"README.md:{b.line} did not run"
    return b, found[b.line]


def test_every_runnable_readme_block_runs_as_written():
    all_blocks = blocks(README.read_text())
    runnable = [b for b in all_blocks if b.lang == "sh" and b.needs is None]
    skipped = [(b.line, b.needs) for b in all_blocks if b.lang == "sh" and b.needs is not None]
    with tempfile.TemporaryDirectory(prefix="k3-readme-") as d:
        tmp = Path(d)
        xdg = tmp / "xdg"
        xdg.mkdir(mode=0o700)
        env = dict(os.environ, TMPDIR=str(tmp), XDG_RUNTIME_DIR=str(xdg))
        proc = subprocess.Popen(["bash", "-c", script(runnable)], cwd=ROOT, env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out_b, err_b = proc.communicate(timeout=900)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            time.sleep(0.5)
            left = stop_leftovers(tmp)
        out, err = out_b.decode(errors="replace"), err_b.decode(errors="replace")
        found, secs = split(out)
        last = max(found) if found else None
        assert proc.returncode == 0, (
            f"exit {proc.returncode} in the README block at line {last}\n--- stdout\n{out[-4000:]}\n"
            f"--- stderr\n{err[-4000:]}")
        assert not left, f"processes still running after the blocks ended: {left}"
        assert not list(tmp.glob("k3-*")), f"a block left its directory behind: {list(tmp.glob('k3-*'))}"

    print(f"\nREADME blocks run: {[(b.line, round(secs.get(b.line, 0), 1)) for b in runnable]}")
    print(f"README blocks not run here: {skipped}")

    _, proxy = by_content(found, runnable, "--expand fixtures/trained/compact.npz")
    assert any(line.strip() and not line.startswith("expand") for line in proxy.splitlines()), proxy

    route, text = by_content(found, runnable, "k3-ctl serve --socket")
    assert "memory plan (" in text and "k3-store ready" in text, text
    lines = text.splitlines()
    i = next((i for i, line in enumerate(lines) if line.startswith("{") and '"chat.completion"' in line), None)
    assert i is not None, f"no chat completion from curl:\n{text}"
    answer = json.loads(lines[i])
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"], answer
    streamed = lines[i + 1:]
    assert streamed and streamed[0].strip(), f"no streamed answer from the openai client:\n{text}"
    assert secs[route.line] < ROUTE_LIMIT_S, f"the five-minute route took {secs[route.line]:.0f} s"

    _, nxt = by_content(found, runnable, "k3-ctl stop --socket \"$K3/store.sock\"")
    assert "store stopped" in nxt, nxt
    assert "TRUE resident hits" in nxt, nxt        # k3-ctl stats

    _, report = by_content(found, runnable, "--preload off")
    rates = [float(x) for x in re.findall(r"TRUE resident hit rate: ([0-9.]+)%", report)]
    assert len(rates) == 2, f"two workers' reports expected in the typical session:\n{report[-3000:]}"
    cold, warm = rates
    assert cold < 100.0 and warm == 100.0, (
        f"the typical session should show a cold job below 100% and a warm one at 100%; saw {cold}% and {warm}%")
