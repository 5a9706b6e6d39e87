"""scripts/lookahead_recall.py against the engine: its router (written from the float64
reference's) must choose, at every MoE layer of the tiny fixture, the experts the engine
requested for the same prompt; the recall arithmetic on hand-made choices."""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import lookahead_recall

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "fixtures" / "tiny" / "model"


def binary(name):
    p = Path(os.environ.get("K3_BIN_DIR", ROOT / "target" / "debug")) / name
    if not p.is_file():
        pytest.fail(f"{p} not built: run `cargo build --workspace --bins` (scripts/test.sh does) "
                    "or set K3_BIN_DIR")
    return p


def test_recall_is_the_mean_share_of_each_rows_choice():
    true = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    assert lookahead_recall.recall(true, true) == 1.0
    assert lookahead_recall.recall(np.array([[3, 2, 9, 8], [9, 9, 9, 7]]), true) == (0.5 + 0.25) / 2
    assert lookahead_recall.recall(np.array([[8, 9, 10, 11], [0, 1, 2, 3]]), true) == 0.0


def test_the_routers_choice_is_what_the_engine_requested(tmp_path):
    out = tmp_path / "hid"
    ids = "5,17,200,3,99,42,7,128,64,1"
    r = subprocess.run([str(binary("k3-worker")), "--standalone", str(TINY), "--ids", ids,
                        "--gen", "1", "--spec", "off", "--dump-hidden", str(out),
                        "--dump-cache-trace", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rc = lookahead_recall.main([str(TINY), str(out), "--depth", "2",
                                "--check-trace", str(out / "expert_trace.jsonl")])
    assert rc == 0
    doc = lookahead_recall.analyse(TINY, out, 2)
    cfg = json.loads((TINY / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    moe = [l for l in range(t["num_hidden_layers"]) if l >= t["first_k_dense_replace"]]
    assert [row["layer"] for row in doc["layers"]] == moe
    for row in doc["layers"]:
        assert row["positions"] == 10
        assert all(0.0 <= c["recall"] <= 1.0 for c in row["candidates"])
        # One layer back from the MLP input is the engine's default candidate.
        assert any(c["layers_ahead"] == 1 and c["point"] == "mlp_in" for c in row["candidates"])


def test_a_wrong_trace_fails_the_check(tmp_path):
    out = tmp_path / "hid"
    r = subprocess.run([str(binary("k3-worker")), "--standalone", str(TINY), "--ids", "5,17,200",
                        "--gen", "1", "--spec", "off", "--dump-hidden", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = lookahead_recall.analyse(TINY, out, 1)
    layer = doc["layers"][0]["layer"]
    lie = tmp_path / "trace.jsonl"
    lie.write_text(json.dumps({"step": 0, "layer": layer, "experts": [0]}) + "\n")
    assert lookahead_recall.main([str(TINY), str(out), "--check-trace", str(lie)]) == 1


def test_unreadable_inputs_exit_2(tmp_path, capsys):
    # No checkpoint there; then a checkpoint but a directory without any MoE layer's mlp_in.
    assert lookahead_recall.main([str(tmp_path / "missing"), str(tmp_path)]) == 2
    assert lookahead_recall.main([str(TINY), str(tmp_path)]) == 2
    assert lookahead_recall.main([str(TINY), str(tmp_path), "--depth", "0"]) == 2
    assert "lookahead_recall:" in capsys.readouterr().err
