"""The Quick start's first command, `scripts/demo.sh`, run as written: it exits 0, its two
workers agree, the second found every expert its tokens route to resident and waited for no
read, the store went away with its socket, and the trained proxy wrote text for both prompts.
(The demo checks those itself and says what it expected and saw; this test fails with its
output when it does not pass.)"""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_passes_as_written(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    r = subprocess.run(["bash", ROOT / "scripts" / "demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    out = r.stdout
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{out[-4000:]}\n--- stderr\n{r.stderr[-4000:]}"
    assert "identical ids; the second worker found every expert its tokens routed to resident" in out, out
    assert "socket removed" in out, out
    for prompt in ("To create a new Django project, run", "from django.db import models"):
        after = out.split(f"-- prompt: {prompt}\n", 1)
        assert len(after) == 2 and after[1].strip(), f"no text for {prompt!r}:\n{out[-3000:]}"
    assert not list(tmp_path.glob("k3-demo.*")), "the demo left its directory behind"
