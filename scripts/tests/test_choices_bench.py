"""`scripts/choices_bench.py` end to end on the generated `small` checkpoint: it starts its own store
and server, times `n` = 3 against `n` = 1, and its checks hold (each choice is its seed's request
alone; the usage counts the prompt once and every choice's ids) — exit 0 and a JSON report with
both timings."""
import json
import subprocess
import sys
from pathlib import Path

from test_openai_serve import binary, run

ROOT = Path(__file__).resolve().parents[2]


def test_choices_bench_runs_and_its_checks_hold(small_model, tmp_path):
    run([binary("k3-ctl"), "pack-trunk", small_model, tmp_path / "trunk"])
    out = tmp_path / "choices.json"
    r = subprocess.run([sys.executable, ROOT / "scripts" / "choices_bench.py", "--model", small_model,
                        "--trunk", tmp_path / "trunk", "--bins", binary("k3-ctl").parent, "--choices", "3",
                        "--gen", "4", "--prompt-ids", "40", "--json", out],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    v = json.loads(out.read_text())
    assert v["choices_equal_their_seeds_alone"] and not v["problems"], v
    assert v["choices"] == 3 and v["prompt_ids"] == 40
    assert v["usage_many"]["prompt_tokens"] == 40
    assert len(v["one_runs_s"]) == len(v["many_runs_s"]) == 3
    assert v["one_s"] > 0 and v["many_s"] > 0 and v["extra_cost"] == v["many_s"] / v["one_s"]
