"""README's "Five minutes to a working server": the block between the `five-minute-route` markers,
run as written with bash from the repository's root, and timed.

Three things are changed so the test cannot collide with anything else on the machine, and only
these: the port (`127.0.0.1:8080` becomes a free ephemeral port, and `k3-ctl serve` is given it
with `--listen`), the checkpoint directory and serve's log (`/tmp/k3-small`, `/tmp/k3-serve.log` become
paths inside the test's temporary directory) and `XDG_RUNTIME_DIR` (so the default socket and the store's log are inside it too).
The block runs under `set -euo pipefail`: any command failing fails the test.

Checked: the store printed its plan and became ready; `curl` got a chat completion with a
non-empty message; the `openai` client's streamed answer is non-empty; serve and the store stopped
(the socket is gone, no process of theirs is left); and the whole block, build check included,
took under five minutes.
"""
import json
import os
import re
import socket
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LIMIT_S = 300


def route_block():
    text = README.read_text()
    m = re.search(r"<!-- five-minute-route:begin -->\n```sh\n(.*?)```\n<!-- five-minute-route:end -->", text, re.S)
    assert m, "README has no five-minute-route block between its markers"
    return m.group(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_gone(port, wait_s=10):
    t0 = time.monotonic()
    while time.monotonic() - t0 < wait_s:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return True
        time.sleep(0.2)
    return False


def test_the_readme_five_minute_route_runs_as_written():
    block = route_block()
    for must in ("k3-store start", "k3-ctl serve 2> /tmp/k3-serve.log &", "curl", "from openai import OpenAI", "stream=True",
                 "k3-ctl stop", "127.0.0.1:8080", "/tmp/k3-small"):
        assert must in block, f"the route lost {must!r}"
    with tempfile.TemporaryDirectory(prefix="k3-five-") as d:
        d = Path(d)
        port = free_port()
        script = (block.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
                  .replace("k3-ctl serve 2>", f"k3-ctl serve --listen 127.0.0.1:{port} 2>")
                  .replace("/tmp/k3-small", str(d / "k3-small"))
                  .replace("/tmp/k3-serve.log", str(d / "k3-serve.log")))
        xdg = d / "xdg"
        xdg.mkdir(mode=0o700)
        env = dict(os.environ, XDG_RUNTIME_DIR=str(xdg))
        t0 = time.monotonic()
        try:
            r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=ROOT, env=env,
                               capture_output=True, timeout=LIMIT_S + 60)
        finally:
            # Whatever happened, no store is left behind.
            subprocess.run([str(ROOT / "target" / "debug" / "k3-ctl"), "stop"], env=env, capture_output=True,
                           timeout=60)
        took = time.monotonic() - t0
        out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
        assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
        assert "memory plan (" in out and "k3-store ready" in out, out
        lines = out.splitlines()
        i = next((i for i, line in enumerate(lines) if line.startswith("{") and '"chat.completion"' in line), None)
        assert i is not None, f"no chat completion from curl:\n{out}\nstderr:\n{err[-3000:]}"
        answer = json.loads(lines[i])
        assert answer["object"] == "chat.completion", answer
        assert answer["choices"][0]["message"]["content"], answer
        streamed = lines[i + 1:]
        assert streamed and streamed[0].strip(), f"no streamed answer: {out}"
        assert "store stopped" in out, out
        assert serve_gone(port), f"serve still listens on {port} 10 s after `kill $!`"
        assert not (xdg / "k3" / "store.sock").exists()
        assert not (d / "k3-small").exists() and not (d / "k3-serve.log").exists()
        print(f"five-minute route: {took:.1f} s")
        assert took < LIMIT_S, f"the route took {took:.0f} s"
