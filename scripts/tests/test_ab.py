"""scripts/ab.py: the per-cell summary and the refusal of different ids (no engine run)."""
import pytest

import ab


def run(step_seconds, ids, wait=0.0):
    return {"steps": [{"seconds": s} for s in step_seconds], "generated_ids": ids,
            "io_wait_seconds": wait}


def test_summary_skips_the_first_step_and_takes_medians():
    c = ab.summarize([run([9.0, 1.0, 3.0, 2.0], [5, 6], wait=0.4),
                      run([9.0, 4.0, 4.0, 4.0], [5, 6], wait=0.8)])
    # Per run: median of steps >= 1 (2.0 and 4.0); then median/min/max over the runs.
    assert c["decode_s_per_run"] == [2.0, 4.0]
    assert c["decode_s"] == {"median": 3.0, "min": 2.0, "max": 4.0}
    assert c["io_wait_per_step_s"] == pytest.approx(0.15)
    assert len(c["ids_hashes"]) == 1


def test_summary_keeps_every_distinct_ids_hash():
    c = ab.summarize([run([1.0, 1.0], [5, 6]), run([1.0, 1.0], [5, 7])])
    assert len(c["ids_hashes"]) == 2


def test_a_run_without_decode_steps_is_refused():
    with pytest.raises(SystemExit):
        ab.summarize([run([1.0], [5])])


def test_needs_two_builds(tmp_path):
    with pytest.raises(SystemExit):
        ab.main(["--model", str(tmp_path), "--trunk", str(tmp_path), "--bins", str(tmp_path)])
