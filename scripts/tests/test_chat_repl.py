"""`k3-worker --chat` and Ctrl-C (issue 35 item 6), with real processes and real signals.

A `small` checkpoint (real vocabulary, so the chat markers exist) is generated once per module and
the REPL run standalone on it, stdin and stdout pipes, SIGINT sent to the worker's pid as a
terminal's Ctrl-C would be:

* during a reply: that reply stops at its next token (the per-turn report says `stop Ctrl-C`,
  long before the token limit), and the conversation goes on: the next line is a second turn
  that reuses the state (the partial reply is kept in the conversation), and can be
  interrupted too; end of input then ends the session, exit 0;
* at the prompt: the first Ctrl-C prints a hint and the worker keeps waiting; the second leaves,
  exit 0.
"""
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOK = ROOT / "fixtures" / "tokenizer"
GEN = 2000  # far more than a reply gets before the Ctrl-C


def binary(name):
    p = Path(os.environ.get("K3_BIN_DIR", ROOT / "target" / "debug")) / name
    if not p.is_file():
        pytest.fail(f"{p} not built: run `cargo build --workspace --bins` (scripts/test.sh does) or set K3_BIN_DIR")
    return p


@pytest.fixture(scope="module")
def small(small_model):
    return small_model


class Chat:
    """A `k3-worker --chat` with its output collected by two reader threads."""

    def __init__(self, model):
        self.proc = subprocess.Popen(
            [binary("k3-worker"), "--chat", "--standalone", model, "--tok", TOK, "--no-think", "--gen", str(GEN)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out, self.err = bytearray(), bytearray()
        self.lock = threading.Lock()
        for f, acc in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._read, args=(f, acc), daemon=True).start()

    def _read(self, f, acc):
        while chunk := f.read1(4096):
            with self.lock:
                acc.extend(chunk)

    def text(self, which):
        with self.lock:
            return bytes(self.out if which == "out" else self.err).decode(errors="replace")

    def wait_for(self, which, what, timeout=120):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if what(self.text(which)) if callable(what) else what in self.text(which):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.kill()
        pytest.fail(f"waited for {what!r} on std{which}: {self.text('err')[-3000:]}")

    def send(self, line):
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def ctrl_c(self):
        self.proc.send_signal(signal.SIGINT)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_ctrl_c_stops_the_reply_not_the_conversation(small):
    c = Chat(small)
    try:
        c.send("Name three prime numbers.")
        c.wait_for("out", lambda t: len(t) > 0)  # the reply is being written
        c.ctrl_c()
        c.wait_for("err", "reply interrupted by Ctrl-C")
        before = len(c.text("out"))
        c.send("And two more?")
        c.wait_for("out", lambda t: len(t) > before)  # the second reply is being written
        c.ctrl_c()  # (so that the test need not wait for GEN tokens)
        c.wait_for("err", "turn 2:")
        c.proc.stdin.close()
        assert c.proc.wait(60) == 0, c.text("err")[-3000:]
    finally:
        c.kill()
    err = c.text("err")
    turn1 = next(line for line in err.splitlines() if line.startswith("turn 1:"))
    assert "stop Ctrl-C" in turn1, turn1
    generated = int(turn1.split("generated ")[1].split(" ")[0])
    assert 0 < generated < GEN, turn1
    turn2 = next(line for line in err.splitlines() if line.startswith("turn 2:"))
    reused = int(turn2.split("(reused ")[1].split(")")[0])
    assert reused > generated, f"the second turn reuses the first, partial reply included: {turn2}"
    assert "chat: 2 turns" in err


def test_ctrl_c_twice_at_the_prompt_leaves(small):
    c = Chat(small)
    try:
        c.wait_for("err", "chat: thinking off")  # the loop is about to wait for a line
        time.sleep(0.3)
        c.ctrl_c()
        c.wait_for("err", "Ctrl-C again to leave")
        time.sleep(0.3)
        assert c.proc.poll() is None, "one Ctrl-C at the prompt does not leave"
        c.ctrl_c()
        assert c.proc.wait(10) == 0, c.text("err")[-3000:]
    finally:
        c.kill()
    assert "chat: 0 turns" in c.text("err")
