"""Smoke tests of scripts/bench.py's parsing and arithmetic on synthetic inputs (no timing)."""
import json
import struct
import subprocess

import pytest

import bench


def test_span_len_matches_the_engine():
    assert bench.span_len(0, 1) == 4096
    assert bench.span_len(4095, 2) == 8192
    assert bench.span_len(8192, 4096) == 4096
    assert bench.span_len(100, 17_547_264) == 17_547_264 + 4096


def test_med_min_max_and_hash():
    assert bench.med_min_max([3.0, 1.0, 2.0, float("nan")]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert bench.med_min_max([]) is None
    assert bench.ids_hash([1, 2, 3]) == bench.ids_hash([1, 2, 3])
    assert bench.ids_hash([1, 2, 3]) != bench.ids_hash([1, 2, 4])
    assert bench.ids_hash([12, 3]) != bench.ids_hash([1, 23])


def test_budgets_mirror_the_presets():
    # k3slice-like: layer 0 biggest; 4 MoE layers x 64 experts, top-16.
    layers = bench.trunk_layers({"layers": [
        {"file_off": 0, "nbytes": 2_341_213_184},
        {"file_off": 2_341_216_256, "nbytes": 1_255_813_376},
        {"file_off": 3_597_029_376, "nbytes": 832_404_736},
    ]})
    eb = 17_547_264
    b = bench.plan_budgets(layers, eb, moe_layers=4, n_experts=64, top_k=16)
    stride = eb + 4096
    total = sum(x[1] for x in layers)
    assert b["all-resident"][0] >= total and b["all-resident"][2] == 256
    assert b["all-resident"][1] >= 256 * stride
    # trunk-pinned: whole trunk, about half of one token's expert reads (server's share).
    assert b["trunk-pinned"][0] >= total and b["trunk-pinned"][2] == 32
    # laptop-like: the laptop preset's 3 GB trunk on real layer sizes, top_k slots.
    lt, lc, ls, _ = b["laptop-like"]
    assert 3_000_000_000 <= lt < 3_000_000_000 + 3 * 4096
    assert ls == 16 and ls * stride <= lc < (ls + 1) * stride
    # laptop-min: a ring of exactly the largest layer; laptop-2x: twice laptop-like's trunk.
    big = bench.align_up(max(x[1] for x in layers))
    assert big <= b["laptop-min"][0] < big + 2 * 4096
    assert b["laptop-2x"][0] == 2 * lt and b["laptop-2x"][2] == 16
    # The plan rule on k3slice's five layers (KKKMM): 3 GB cannot pin layer 0 and still hold
    # layer 1; 6 GB pins layers 0-2 (4.85 GB) and rings the MLA layers in 1.15 GB; the sum pins
    # all.
    sizes = [x[1] for x in layers]
    sizes = sizes[:2] + sizes[1:2] + sizes[2:] + sizes[2:]
    assert bench.pinned_prefix(sizes, lt) == 0
    assert bench.pinned_prefix(sizes, b["laptop-2x"][0]) == 3
    assert bench.pinned_prefix(sizes, sum(bench.align_up(x) for x in sizes)) == 5


def test_floors_pick_the_larger_bound():
    f = bench.floors(6e9, 1e9, 12e9, seq_mbps=2000, rand_mbps=1000, mem_gbps=10)
    assert f["disk_s"] == pytest.approx(3.0 + 1.0)
    assert f["memory_s"] == pytest.approx(1.2)
    assert f["floor_s"] == pytest.approx(4.0) and f["bound"] == "disk"
    g = bench.floors(0, 0, 12e9, seq_mbps=2000, rand_mbps=1000, mem_gbps=10)
    assert g["bound"] == "memory" and g["floor_s"] == pytest.approx(1.2)


def _run(steps, **kw):
    r = {"steps": [{"step": i, "token": 5, "seconds": s, "bytes_read": b,
                    "resident_hit_rate": 0.0} for i, (s, b) in enumerate(steps)],
         "bytes_read": sum(b for _, b in steps), "io_share": 0.5, "wall_seconds": 10.0,
         "true_resident_hit_rate": 0.25, "peak_rss_bytes": 7 << 30, "generated_ids": [5, 5, 5],
         "trunk_bytes_read": 0, "expert_bytes_read": 0}
    r.update(kw)
    return r


def test_summarize_run_splits_trunk_and_experts():
    s = bench.summarize_run(_run([(4.0, 10e9), (1.0, 3e9), (2.0, 3e9)]), trunk_per_step=2_000_000_000)
    assert s["prefill_s"] == 4.0 and s["decode_s"] == [1.0, 2.0]
    assert s["trunk_bytes_per_token"] == 2e9
    assert s["expert_bytes_per_token"] == pytest.approx(1e9)
    # io wait 5 s apportioned by bytes: a decode step read 3 of 16 GB.
    assert s["io_wait_per_decode_token_s"] == pytest.approx(5.0 * 3 / 16)
    assert s["startup_s"] == pytest.approx(3.0)
    # A worker from before --preload reports none; one that preloaded reports its seconds.
    assert (s["preload_s"], s["preload_bytes"]) == (0.0, 0)
    p = bench.summarize_run(_run([(4.0, 10e9), (1.0, 0)],
                                 preload={"experts": 2, "bytes": 35e6, "seconds": 1.5}),
                            trunk_per_step=0)
    assert (p["preload_s"], p["preload_bytes"]) == (1.5, 35e6)
    # All resident: no bytes per decode step, so no trunk or expert bytes either.
    z = bench.summarize_run(_run([(4.0, 10e9), (1.0, 0), (1.0, 0)]), trunk_per_step=2_000_000_000)
    assert z["trunk_bytes_per_token"] == 0 and z["expert_bytes_per_token"] == 0


def test_table_formats_every_budget():
    row = {"budget": "laptop-like", "pinned": "0/5 L, 16 slots",
           "prefill_s": {"median": 15.2, "min": 15.0, "max": 16.0},
           "decode_s": {"median": 3.1, "min": 3.0, "max": 3.4},
           "trunk_gb_per_token": 6.5, "expert_gb_per_token": 1.12, "io_share": 0.67,
           "true_resident_hit_rate": 0.0, "peak_rss_gb": 7.19,
           "floor": {"floor_s": 2.5, "bound": "disk"}, "floor_ratio": 1.24, "ids_hash": "abc"}
    t = bench.fmt_table([row])
    assert "laptop-like" in t and "3.100 (3.000-3.400)" in t and "1.24" in t
    assert "6.500+1.120" in t and "67%" in t and "2.500 (disk)" in t
    assert "start s (preload)" in t and " - " in t, "no start-up figures: -"
    row["startup_s"] = {"median": 6.4, "min": 6.0, "max": 7.0}
    row["preload_s"] = {"median": 3.69, "min": 3.5, "max": 4.0}
    assert "6.40 (3.69)" in bench.fmt_table([row])
    row["preload_s"] = {"median": 0.0, "min": 0.0, "max": 0.0}
    t = bench.fmt_table([row])
    assert "6.40 " in t and "(0.00)" not in t


def test_pinned_count_from_the_plan_line():
    err = "memory plan ...\n  trunk                2.34 GB   0/5 layers PINNED (0.00 GB) + ring 3.00 GB (largest streamed layer 2.34 GB)\n"
    assert bench.pinned_count(err, 5) == 0
    assert bench.pinned_count("trunk 6.52 GB 5/5 layers PINNED (6.52 GB)", 5) == 5
    assert bench.pinned_count("nothing", 7) == 7


def test_expert_bytes_from_a_synthetic_checkpoint(tmp_path):
    parts = {"w1.weight_packed": 600, "w1.weight_scale": 40, "w2.weight_packed": 600,
             "w2.weight_scale": 40, "w3.weight_packed": 600, "w3.weight_scale": 40}
    hdr, off = {}, 0
    for k, n in parts.items():
        name = f"language_model.model.layers.1.block_sparse_moe.experts.0.{k}"
        hdr[name] = {"dtype": "U8", "shape": [n], "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(hdr).encode()
    (tmp_path / "s.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + bytes(off))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "s.safetensors" for k in hdr}}))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {
        "num_hidden_layers": 5, "first_k_dense_replace": 1, "num_experts": 64,
        "num_experts_per_token": 16}}))
    assert bench.expert_bytes_from_checkpoint(tmp_path) == (1920, 4, 64, 16)


def test_summarize_run_uses_the_workers_per_step_io_wait():
    r = _run([(4.0, 10e9), (1.0, 3e9), (2.0, 3e9)])
    for s, (w, rd) in zip(r["steps"], [(3.0, 4.0), (0.2, 1.0), (0.4, 1.0)]):
        s["io_wait_seconds"], s["io_read_seconds"] = w, rd
    s = bench.summarize_run(r, trunk_per_step=2_000_000_000)
    # Decode steps only: mean wait 0.3 s; 0.6 s of 2.0 s of reads not hidden -> 70% hidden.
    assert s["io_wait_per_decode_token_s"] == pytest.approx(0.3)
    assert s["decode_io_hidden"] == pytest.approx(0.7)
    # Without per-step figures there is no hidden share (and the old apportioning is used).
    assert bench.summarize_run(_run([(4.0, 10e9), (1.0, 3e9)]), 0)["decode_io_hidden"] is None


def test_bytes_per_token_ignore_a_layer_read_counted_in_the_next_step():
    # One layer read finished just before a step's end: that step shows it twice, the next not.
    s = bench.summarize_run(_run([(4.0, 10e9), (1.0, 7e9), (1.0, 9e9), (1.0, 5e9), (1.0, 7e9)]),
                            trunk_per_step=6_000_000_000)
    assert s["trunk_bytes_per_token"] == 6e9
    assert s["expert_bytes_per_token"] == pytest.approx(1e9)


def test_union_of_experts_grows_almost_linearly_at_the_real_expert_count():
    assert bench.union_experts(896, 16, 1) == pytest.approx(16)
    # Nine positions share few of 896 experts: within 7% of 9 x 16.
    u9 = bench.union_experts(896, 16, 9)
    assert 0.93 * 144 < u9 < 144
    # ... but most of k3slice's 64.
    assert bench.union_experts(64, 16, 9) < 0.93 * 64


def test_spec_summary_counts_per_emitted_id():
    run = {"steps": [{"seconds": 5.0, "bytes_read": 10},
                     {"seconds": 1.0, "bytes_read": 4}, {"seconds": 1.0, "bytes_read": 4},
                     {"seconds": 2.0, "bytes_read": 8}],
           "forward_passes": 2, "drafted_tokens": 3, "accepted_tokens": 1,
           "peak_rss_bytes": 1, "generated_ids": [1, 2, 3, 4]}
    s = bench.spec_summary(run)
    assert s["decode_s_per_token"] == pytest.approx(4.0 / 3)
    assert s["decode_bytes_per_token"] == pytest.approx(16 / 3)
    assert s["acceptance"] == pytest.approx(1 / 3)


def test_spec_projection_never_loses_and_gains_most_where_the_trunk_streams():
    pr = bench.project(0.5, 8.0e9, 2560.0, 2200.0, None)
    sp = bench.spec_project(pr, 2560.0)
    rows = {r["preset"]: r for r in sp["rows"]}
    for r in sp["rows"]:
        for a, b in r["by_acceptance"].items():
            assert b["x_plain"] <= 1.0
            if b["k"] == 0:
                assert b["x_plain"] == 1.0
    # Streaming the trunk makes a pass's fixed cost large: speculation pays most at laptop.
    assert rows["laptop"]["by_acceptance"][0.75]["x_plain"] < rows["server"]["by_acceptance"][0.75]["x_plain"]
    # Higher acceptance, longer drafts and lower cost.
    lap = rows["laptop"]["by_acceptance"]
    assert lap[1.0]["k"] >= lap[0.75]["k"] >= lap[0.5]["k"]
    assert lap[1.0]["s_per_token"] < lap[0.5]["s_per_token"]


# ---------------------------------------------------------------- --concurrent helpers

K3SLICE_LAYERS = bench.trunk_layers({"layers": [
    {"file_off": 0, "nbytes": 2_341_213_184},
    {"file_off": 2_341_216_256, "nbytes": 1_255_813_376},
    {"file_off": 3_597_029_376, "nbytes": 1_255_813_376},
    {"file_off": 4_852_842_752, "nbytes": 832_404_736},
    {"file_off": 5_685_247_488, "nbytes": 832_404_736},
]})


def test_int_list_and_prompts():
    assert bench.int_list("1,2,4") == [1, 2, 4]
    assert bench.int_list(" 3 ,") == [3]
    for bad in ("", "0,1", "2,-1"):
        with pytest.raises(ValueError):
            bench.int_list(bad)
    p = bench.conc_prompts(7)
    assert p[0] == bench.PROMPT and len(p) == 7
    assert len({tuple(x) for x in p}) == 7 and bench.WARM_PROMPT not in p
    assert all(len(x) == len(bench.PROMPT) and all(0 <= i < bench.VOCAB for i in x) for x in p)
    # A batch of N uses the first N: N=2 is N=1's prompt plus one.
    assert bench.conc_prompts(2) == p[:2]


def test_pinned_trunk_budget_pins_exactly_k_layers():
    bufs = [b for _, b in K3SLICE_LAYERS]
    for k in (0, 1, 2, 3, 5):
        b = bench.pinned_trunk_budget(K3SLICE_LAYERS, k)
        assert bench.pinned_prefix(bufs, b) == k
    # Four of five: the ring for the last layer is as large as the layer, so the plan pins it.
    with pytest.raises(ValueError):
        bench.pinned_trunk_budget(K3SLICE_LAYERS, 4)
    # Two: layers 0 and 1 pinned, a ring for layer 2 (the largest left).
    b2 = bench.pinned_trunk_budget(K3SLICE_LAYERS, 2)
    assert b2 == bufs[0] + bufs[1] + bench.align_up(bufs[2]) + 4096
    with pytest.raises(ValueError):
        bench.pinned_trunk_budget(K3SLICE_LAYERS, 6)
    # Where the rest is tiny, pinning k means pinning k+1 too: refused, not mislabelled.
    tiny = [(4096, 4096), (4096, 4096)]
    with pytest.raises(ValueError):
        bench.pinned_trunk_budget(tiny, 1)


def test_concurrent_budgets_map_names():
    b = bench.plan_budgets(K3SLICE_LAYERS, 17_547_264, moe_layers=4, n_experts=64, top_k=16)
    cb = bench.concurrent_budgets(["laptop-like", "pinned-2"], b, K3SLICE_LAYERS)
    assert cb["laptop-like"][:4] == b["laptop-like"] and cb["laptop-like"][4] is None
    tb, cache, slots, _, k = cb["pinned-2"]
    assert k == 2 and (cache, slots) == (b["laptop-like"][1], b["laptop-like"][2])
    assert tb == bench.pinned_trunk_budget(K3SLICE_LAYERS, 2)
    with pytest.raises(ValueError):
        bench.concurrent_budgets(["server-ish"], b, K3SLICE_LAYERS)


def test_proc_status_and_pid_parsing():
    st = "Name:\tk3-worker\nVmHWM:\t 5873412 kB\nVmRSS:\t  812 kB\nRssAnon:\t  4096 kB\n"
    assert bench.proc_status_bytes(st, "VmHWM") == 5873412 * 1024
    assert bench.proc_status_bytes(st, "RssAnon") == 4096 * 1024
    assert bench.proc_status_bytes(st, "RssShmem") is None
    assert bench.proc_status_bytes(None, "VmHWM") is None
    assert bench.parse_store_pid("k3-store ready: listening on /t/s.sock (pid 4242); log x") == 4242
    assert bench.parse_store_pid("store: up, pid 77, uptime 1.0 s") == 77
    assert bench.parse_store_pid("no such thing") is None


def test_store_counters_accept_old_and_new_names():
    old = {"lifetime": {"bytes_read": 100, "requests": 3}, "pinned_layers": 0}
    c = bench.store_counters(old)
    assert c["expert_bytes_read"] == 100 and c["trunk_bytes_read"] == 0
    assert c["broken_leases"] == 0 and not c["store_counts_trunk"]
    new = {"lifetime": {"expert_bytes_read": 50, "trunk_bytes_read": 7, "trunk_layers_served": 2,
                        "trunk_shared_layers": 1, "trunk_wait_seconds": 0.5, "broken_leases": 0}}
    c = bench.store_counters(new)
    assert (c["expert_bytes_read"], c["trunk_bytes_read"], c["store_counts_trunk"]) == (50, 7, True)
    after = {"lifetime": {"expert_bytes_read": 80, "trunk_bytes_read": 17, "trunk_layers_served": 5,
                          "trunk_shared_layers": 3, "trunk_wait_seconds": 1.5, "broken_leases": 1}}
    d = bench.counters_delta(new, after)
    assert d["expert_bytes_read"] == 30 and d["trunk_bytes_read"] == 10
    assert d["trunk_shared_layers"] == 2 and d["trunk_wait_seconds"] == pytest.approx(1.0)
    assert d["broken_leases"] == 1 and d["store_counts_trunk"]


def _report(ids, trunk, wait):
    return {"generated_ids": ids, "trunk_bytes_read": trunk, "io_wait_seconds": wait,
            "peak_rss_bytes": 1}


def test_summarize_batch_old_store_sums_worker_trunk_bytes():
    prompts = [[1, 2], [3, 4]]
    ref = {(1, 2): [9, 9, 9], (3, 4): [8, 8, 8]}
    delta = bench.counters_delta({"lifetime": {"bytes_read": 0}},
                                 {"lifetime": {"bytes_read": 600}})
    mem = [{"rss_anon_peak_bytes": 10, "vm_hwm_bytes": 20},
           {"rss_anon_peak_bytes": 30, "vm_hwm_bytes": 40}]
    b = bench.summarize_batch(2, 3.0, [_report([9, 9, 9], 1000, 0.5), _report([8, 8, 8], 2000, 1.5)],
                              delta, prompts, ref, mem)
    assert b["tokens"] == 6 and b["aggregate_tok_s"] == pytest.approx(2.0)
    assert b["trunk_bytes_read"] == 3000 and b["trunk_bytes_source"].startswith("workers")
    assert b["disk_bytes_per_token"] == pytest.approx(3600 / 6)
    assert b["trunk_bytes_per_token"] == pytest.approx(500)
    assert b["ids_match"] and b["worker_wait_s"] == [0.5, 1.5]
    assert b["worker_trunk_bytes_read"] == [1000, 2000]
    # A worker whose ids differ from its prompt's standalone ids fails the batch.
    b = bench.summarize_batch(2, 3.0, [_report([9, 9, 9], 0, 0), _report([9, 9, 9], 0, 0)],
                              delta, prompts, ref, mem)
    assert b["ids_match_per_worker"] == [True, False] and not b["ids_match"]


def test_summarize_batch_new_store_counts_trunk_once():
    delta = bench.counters_delta(
        {"lifetime": {"expert_bytes_read": 0, "trunk_bytes_read": 0}},
        {"lifetime": {"expert_bytes_read": 400, "trunk_bytes_read": 800}})
    mem = [{"rss_anon_peak_bytes": 1, "vm_hwm_bytes": 2}] * 2
    b = bench.summarize_batch(2, 2.0, [_report([1], 800, 0.1), _report([2], 800, 0.2)],
                              delta, [[1], [2]], {(1,): [1], (2,): [2]}, mem)
    # The store's own count, not the workers' (which would count a shared read twice).
    assert b["trunk_bytes_read"] == 800 and b["trunk_bytes_source"].startswith("store")
    assert b["disk_bytes_per_token"] == pytest.approx(600)


def test_conc_rows_speedups_and_table():
    def batch(n, wall, tok, match=True):
        return {"n": n, "wall_s": wall, "aggregate_tok_s": tok, "disk_bytes_per_token": 2e9,
                "trunk_bytes_per_token": 1e9, "worker_wait_s": [0.5] * n,
                "worker_private_peak_bytes": [3e9] * n, "store_vm_hwm_bytes": 4e9,
                "ids_match": match, "trunk_bytes_source": "workers"}
    rows = [bench.conc_row("laptop-like", [batch(1, 10.0, 0.6), batch(1, 12.0, 0.5)]),
            bench.conc_row("laptop-like", [batch(2, 15.0, 0.9)]),
            bench.conc_row("pinned-2", [batch(2, 5.0, 2.0, match=False)])]
    bench.add_speedups(rows)
    assert rows[0]["wall_s"] == pytest.approx(11.0) and rows[0]["aggregate_tok_s"] == pytest.approx(0.55)
    assert rows[0]["speedup_vs_1"] == pytest.approx(1.0)
    assert rows[1]["speedup_vs_1"] == pytest.approx(0.9 / 0.55)
    assert rows[2]["speedup_vs_1"] is None  # no N=1 for that budget
    assert rows[1]["store_peak_rss_gb"] == pytest.approx(4.0)
    assert rows[1]["worker_private_peak_gb"] == pytest.approx(3.0)
    t = bench.fmt_conc_table(rows)
    lines = t.splitlines()
    assert lines[0].startswith("| budget | N | wall s | aggregate tok/s | speed-up vs N=1")
    assert len(lines) == 5 and all(l.count("|") == 12 for l in lines)
    assert "| 1.64x |" in lines[3] and "| 2.000 | 1.000 |" in lines[3]
    assert "**NO**" in lines[4] and "| - |" in lines[4]


def test_a_failed_worker_is_recorded_not_fatal():
    prompts = [[1, 2], [3, 4]]
    ref = {(1, 2): [9, 9, 9], (3, 4): [8, 8, 8]}
    mem = [{"rss_anon_peak_bytes": 10, "vm_hwm_bytes": 20}] * 2
    fail = [{"worker": 1, "exit": 1, "exit_s": 61.0, "error": "expert cache busy",
             "stderr_tail": "..."}]
    old = bench.counters_delta({"lifetime": {"bytes_read": 0}}, {"lifetime": {"bytes_read": 600}})
    b = bench.summarize_batch(2, 6.0, [_report([9, 9, 9], 1000, 0.5), None], old, prompts, ref,
                              mem, fail)
    # Throughput counts the worker that finished; its ids match; the other is None, not False.
    assert b["tokens"] == 3 and b["aggregate_tok_s"] == pytest.approx(0.5)
    assert b["ids_match_per_worker"] == [True, None] and b["ids_match"]
    assert b["worker_wait_s"] == [0.5, None] and b["failed_workers"] == fail
    # The failed worker's private trunk reads are unknown: no bytes per token.
    assert b["disk_bytes_per_token"] is None and b["trunk_bytes_read"] is None
    # A store that counts trunk bytes itself still gives them.
    new = bench.counters_delta({"lifetime": {"expert_bytes_read": 0, "trunk_bytes_read": 0}},
                               {"lifetime": {"expert_bytes_read": 300, "trunk_bytes_read": 300}})
    b2 = bench.summarize_batch(2, 6.0, [_report([9, 9, 9], 0, 0.5), None], new, prompts, ref,
                               mem, fail)
    assert b2["disk_bytes_per_token"] == pytest.approx(200)
    # All failed: nothing matched, no throughput.
    b3 = bench.summarize_batch(2, 6.0, [None, None], old, prompts, ref, mem, fail * 2)
    assert not b3["ids_match"] and b3["aggregate_tok_s"] is None
    b["store_vm_hwm_bytes"] = 4e9
    row = bench.conc_row("laptop-like", [b])
    assert row["failed_workers"] == 1 and row["workers"] == 2
    assert "(1 of 2 workers FAILED)" in bench.fmt_conc_table([row])


def test_time_breakdown_is_the_median_per_phase_and_needs_every_run():
    tb = {k: 0.001 for k in bench.PHASES}
    a = dict(tb, lm_head_s=0.003)
    b = dict(tb, lm_head_s=0.005)
    c = dict(tb, lm_head_s=0.004)
    got = bench.time_breakdown([{"time_breakdown": x} for x in (a, b, c)])
    assert got["lm_head_s"] == 0.004 and got["mlp_s"] == 0.001
    # A run from an older worker has no breakdown: no median of a partial set.
    assert bench.time_breakdown([{"time_breakdown": a}, {"time_breakdown": None}]) is None
    table = bench.fmt_breakdown([{"budget": "all-resident", "time_breakdown": got}])
    assert "all-resident" in table and "4.00 (" in table
    assert bench.fmt_breakdown([{"budget": "x", "time_breakdown": None}]) == ""


def test_the_disk_floor_is_measured_at_the_checkpoints_expert_size(monkeypatch, tmp_path):
    # small's experts are 52 KB: a 17.5 MB read's rate would price them at the disk's bandwidth,
    # while reads that small cost its latency. Both the start-of-run floors and each run's
    # recheck must ask the doctor for reads of the checkpoint's own expert size.
    calls = []

    def fake_sh(cmd, **kw):
        calls.append([str(c) for c in cmd])
        doc = {"disk": {"measurements": [
            {"name": "sequential_direct", "mb_per_s": {"median": 3000.0}},
            {"name": f"random_qd{bench.ENGINE_EXPERT_READERS}", "mb_per_s": {"median": 900.0}},
        ]}}
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(doc), stderr="")

    monkeypatch.setattr(bench, "sh", fake_sh)
    bench.doctor(tmp_path, tmp_path, 0.5, 512, 52_224)
    assert calls[-1][calls[-1].index("--read-bytes") + 1] == "52224"
    seq, rnd = bench.direct_rates(tmp_path, tmp_path / "trunk.bin", tmp_path / "s.safetensors",
                                  0.5, 52_224)
    assert (seq, rnd) == (3000.0, 900.0)
    assert all(c[c.index("--read-bytes") + 1] == "52224" for c in calls)
