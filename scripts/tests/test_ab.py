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


def fake_bins(tmp_path, worker_exit):
    """k3-store / k3-worker / k3-ctl stand-ins that log their arguments."""
    log = tmp_path / "log"
    bins = tmp_path / "bins"
    bins.mkdir()
    for name, body in [
        ("k3-store", "echo store \"$@\" >> {log}"),
        ("k3-worker", "echo worker \"$@\" >> {log}\n"
                      "out=''; while [ $# -gt 0 ]; do [ \"$1\" = --out ] && out=$2; shift; done\n"
                      "echo '{{\"steps\": [], \"generated_ids\": []}}' > \"$out\"\n"
                      f"exit {worker_exit}"),
        ("k3-ctl", "echo ctl \"$@\" >> {log}"),
    ]:
        p = bins / name
        p.write_text("#!/bin/sh\n" + body.format(log=log) + "\n")
        p.chmod(0o755)
    return bins, log


def test_attached_run_starts_a_store_runs_the_worker_on_its_socket_and_stops_it(tmp_path):
    bins, log = fake_bins(tmp_path, 0)
    d = ab.run_attached(bins, tmp_path / "m", tmp_path / "t", 2_000_000, 300_000, 5,
                        tmp_path / "out.json", 1, tmp_path)
    assert d == {"steps": [], "generated_ids": []}
    store, worker, ctl = log.read_text().splitlines()
    sock = store.split("--socket ")[1].split()[0]
    assert "--trunk-gb 0.002000000 --cache-gb 0.000300000" in store and "--detach" in store
    assert f"--socket {sock}" in worker and "--standalone" not in worker
    assert ctl == f"ctl stop --socket {sock}"


def test_attached_run_stops_the_store_when_the_worker_fails(tmp_path):
    bins, log = fake_bins(tmp_path, 3)
    with pytest.raises(SystemExit):
        ab.run_attached(bins, tmp_path / "m", tmp_path / "t", 2_000_000, 300_000, 5,
                        tmp_path / "out.json", 1, tmp_path)
    assert log.read_text().splitlines()[-1].startswith("ctl stop --socket ")


def test_trunks_compare_with_one_set_of_binaries(tmp_path):
    bins, _ = fake_bins(tmp_path, 0)
    (tmp_path / "t1").mkdir()
    (tmp_path / "t1" / "trunk.json").write_text("{}")
    # Two sets of binaries and two trunks at once: which side is which is ambiguous.
    with pytest.raises(SystemExit):
        ab.main(["--model", str(tmp_path), "--trunk", str(tmp_path / "t1"),
                 "--bins", f"{bins},{bins}", "--trunks", f"{tmp_path / 't1'},{tmp_path / 't1'}"])
    # A trunk directory without trunk.json is refused before any run.
    with pytest.raises(SystemExit):
        ab.main(["--model", str(tmp_path), "--trunk", str(tmp_path / "t1"),
                 "--bins", str(bins), "--trunks", f"{tmp_path / 't1'},{tmp_path / 'nope'}"])


def test_summary_reports_trunk_bytes_and_peak_rss():
    r = run([9.0, 1.0, 1.0], [5, 6])
    for s, b in zip(r["steps"], [100, 40, 60]):
        s["trunk_bytes_read"] = b
        s["bytes_read"] = b + 1
    r["peak_rss_bytes"] = 7
    c = ab.summarize([r])
    assert (c["trunk_bytes_per_step"], c["bytes_per_step"], c["peak_rss_bytes"]) == (50, 51, 7)
