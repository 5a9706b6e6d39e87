"""The Quick start's first command, `scripts/demo.sh`, its store part (`--store-only`): it exits
0, its two workers agree, the second found every expert its tokens route to resident and waited
for no read, the store went away with its socket. (The demo checks those itself and says what it
expected and saw; this test fails with its output when it does not pass.) The demo's last part,
the trained proxy's text, is the README's trained-proxy block, which
scripts/tests/test_readme_blocks.py runs as written; `--store-only` keeps the test command from
generating that text twice."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_demos_store_part_passes_as_written(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    r = subprocess.run(["bash", ROOT / "scripts" / "demo.sh", "--store-only"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    out = r.stdout
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{out[-4000:]}\n--- stderr\n{r.stderr[-4000:]}"
    assert "identical ids; the second worker found every expert its tokens routed to resident" in out, out
    assert "socket removed" in out, out
    assert "the trained proxy" not in out, "--store-only ran the trained proxy's part"
    assert not list(tmp_path.glob("k3-demo.*")), "the demo left its directory behind"
