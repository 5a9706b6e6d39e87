"""scripts/hot_bench.py's arithmetic and table on synthetic counters (no store is run)."""
import pytest

import hot_bench


def counters(requests, hits, preload_hits=0):
    return {"requests": requests, "resident_hits": hits, "misses": requests - hits,
            "preload_hits": preload_hits}


def test_slot_bytes_buy_exactly_the_slots():
    # The trained proxy's expert: 98,304 bytes -> a 102,400-byte slot stride.
    assert hot_bench.slot_cache_bytes(1, 98_304) == 102_400
    assert hot_bench.slot_cache_bytes(56, 98_305) == 56 * (102_400 + 4096)


def test_the_job_is_found_by_its_pid_once():
    stats = {"jobs": [{"pid": 7, "counters": {**counters(10, 4, 1), "x": 1}},
                      {"pid": 8, "counters": counters(5, 5)}]}
    assert hot_bench.job_of(stats, 7) == counters(10, 4, 1)
    with pytest.raises(SystemExit):
        hot_bench.job_of(stats, 9)
    with pytest.raises(SystemExit):
        hot_bench.job_of({"jobs": stats["jobs"] * 2}, 8)


def test_rows_compare_hot_and_cold_with_warm_against_the_target():
    runs = {"warm": counters(100, 50), "again": counters(100, 60),
            "hot": counters(100, 41, 30), "cold": counters(100, 20)}
    r = hot_bench.row(56, 16, runs, 200, 224)
    assert r["hot_over_warm"] == pytest.approx(0.82)
    assert r["cold_over_warm"] == pytest.approx(0.4)
    assert r["target_met"]
    assert r["hot"]["true_resident_hit_rate"] == pytest.approx(0.41)
    runs["hot"] = counters(100, 39, 30)
    assert not hot_bench.row(56, 16, runs, 200, 224)["target_met"]
    # No requests: no rate, never a target met by division by zero.
    runs["warm"] = counters(0, 0)
    r = hot_bench.row(56, 16, runs, 200, 224)
    assert r["hot_over_warm"] is None and not r["target_met"]


def test_the_table_names_each_mode_and_the_preload_hits():
    runs = {"warm": counters(100, 50), "again": counters(100, 60),
            "hot": counters(100, 45, 30), "cold": counters(100, 20)}
    t = hot_bench.fmt_table([hot_bench.row(112, 64, runs, 224, 224)])
    last = t.splitlines()[-1]
    assert last.startswith("| 112 (50%) | 64 | 20.0% | **45.0%** | 50.0% | 60.0% | **0.90** | 0.40 |")
    assert "30 of 45 hits (100 requests)" in last
