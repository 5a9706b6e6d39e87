"""Tests of scripts/make-checkpoint.py.

The expected tensor table below is restated from SPEC.md §2 (not imported from the generator),
and every layout property is checked on the written safetensors headers, as a reader sees them.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "make-checkpoint.py")
FIXTURE = os.path.join(ROOT, "fixtures", "tiny", "model")
M = "language_model.model."
EXPERT_ORDER = ["w1.weight_packed", "w1.weight_scale", "w2.weight_packed", "w2.weight_scale", "w3.weight_packed", "w3.weight_scale"]
DSIZE = {"BF16": 2, "F32": 4, "U8": 1}


def generate(out, preset="tiny", *extra):
    r = subprocess.run([sys.executable, SCRIPT, "--preset", preset, *extra, str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return str(out)


def read_header(path):
    """Parse one safetensors header the way a strict reader would; returns (entries, data_start)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        assert n % 8 == 0 and 8 + n <= size
        raw = f.read(n)
    assert raw.startswith(b"{") and raw.rstrip(b" ").endswith(b"}"), "header must be JSON padded with spaces"
    h = json.loads(raw)
    assert h.pop("__metadata__") == {"format": "pt"}
    return h, 8 + n


def load(model_dir):
    """{name: (shard, dtype, shape, abs_start, abs_end)} from the index and every shard header."""
    index = json.load(open(os.path.join(model_dir, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    out = {}
    for s in shards:
        h, data = read_header(os.path.join(model_dir, s))
        ends = []
        for name, e in h.items():
            a, b = e["data_offsets"]
            n = 1
            for dim in e["shape"]:
                n *= dim
            assert b - a == n * DSIZE[e["dtype"]], name
            assert a % DSIZE[e["dtype"]] == 0, f"{name} misaligned"
            out[name] = (s, e["dtype"], tuple(e["shape"]), data + a, data + b)
            ends.append((a, b))
        ends.sort()
        # Data area fully tiled: no overlaps, no holes, file ends at the last tensor.
        assert ends[0][0] == 0 and all(x[1] == y[0] for x, y in zip(ends, ends[1:]))
        assert data + ends[-1][1] == os.path.getsize(os.path.join(model_dir, s))
    assert {k: v[0] for k, v in out.items()} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(v[4] - v[3] for v in out.values())
    return out, index


def expected_tensors(tc, with_experts=True):
    """SPEC.md §2 tables, as {name: (dtype, shape)}, from a nested text_config."""
    E, V = tc["hidden_size"], tc["vocab_size"]
    la = tc["linear_attn_config"]
    H, D, K = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    P = H * D
    Hm, nope, rope, vh = tc["num_attention_heads"], tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
    ql, kvl = tc["q_lora_rank"], tc["kv_lora_rank"]
    N, Lat, I = tc["num_experts"], tc["routed_expert_hidden_size"], tc["moe_intermediate_size"]
    S = tc["num_shared_experts"] * I
    full = set(la["full_attn_layers"])
    t = {
        M + "embed_tokens.weight": ("BF16", (V, E)),
        M + "norm.weight": ("BF16", (E,)),
        M + "output_attn_res_norm.weight": ("BF16", (E,)),
        M + "output_attn_res_proj.weight": ("BF16", (1, E)),
        "language_model.lm_head.weight": ("BF16", (V, E)),
    }
    for L in range(tc["num_hidden_layers"]):
        p = f"{M}layers.{L}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            t[p + n + ".weight"] = ("BF16", (E,))
        t[p + "self_attention_res_proj.weight"] = ("BF16", (1, E))
        t[p + "mlp_res_proj.weight"] = ("BF16", (1, E))
        a = p + "self_attn."
        if L + 1 in full:
            t.update({
                a + "q_a_proj.weight": ("BF16", (ql, E)),
                a + "q_a_layernorm.weight": ("BF16", (ql,)),
                a + "q_b_proj.weight": ("BF16", (Hm * (nope + rope), ql)),
                a + "kv_a_proj_with_mqa.weight": ("BF16", (kvl + rope, E)),
                a + "kv_a_layernorm.weight": ("BF16", (kvl,)),
                a + "kv_b_proj.weight": ("BF16", (Hm * (nope + vh), kvl)),
                a + "o_proj.weight": ("BF16", (E, Hm * vh)),
                a + "g_proj.weight": ("BF16", (Hm * vh, E)),
            })
        else:
            for n in "qkv":
                t[a + f"{n}_proj.weight"] = ("BF16", (P, E))
                t[a + f"{n}_conv1d.weight"] = ("F32", (P, 1, K))
            t.update({
                a + "f_a_proj.weight": ("BF16", (D, E)),
                a + "f_b_proj.weight": ("BF16", (P, D)),
                a + "A_log": ("F32", (D,)),
                a + "dt_bias": ("F32", (P,)),
                a + "b_proj.weight": ("BF16", (H, E)),
                a + "g_proj.weight": ("BF16", (P, E)),
                a + "o_norm.weight": ("F32", (D,)),
                a + "o_proj.weight": ("BF16", (E, P)),
            })
        if L == 0:
            I0 = tc["intermediate_size"]
            t[p + "mlp.gate_proj.weight"] = ("BF16", (I0, E))
            t[p + "mlp.up_proj.weight"] = ("BF16", (I0, E))
            t[p + "mlp.down_proj.weight"] = ("BF16", (E, I0))
            continue
        m = p + "block_sparse_moe."
        t.update({
            m + "gate.weight": ("BF16", (N, E)),
            m + "gate.e_score_correction_bias": ("F32", (N,)),
            m + "routed_expert_down_proj.weight": ("BF16", (Lat, E)),
            m + "routed_expert_norm.weight": ("BF16", (Lat,)),
            m + "routed_expert_up_proj.weight": ("BF16", (E, Lat)),
            m + "shared_experts.gate_proj.weight": ("BF16", (S, E)),
            m + "shared_experts.up_proj.weight": ("BF16", (S, E)),
            m + "shared_experts.down_proj.weight": ("BF16", (E, S)),
        })
        for e in range(N if with_experts else 0):
            x = f"{m}experts.{e}."
            t[x + "w1.weight_packed"] = ("U8", (I, Lat // 2))
            t[x + "w1.weight_scale"] = ("U8", (I, Lat // 32))
            t[x + "w3.weight_packed"] = ("U8", (I, Lat // 2))
            t[x + "w3.weight_scale"] = ("U8", (I, Lat // 32))
            t[x + "w2.weight_packed"] = ("U8", (Lat, I // 2))
            t[x + "w2.weight_scale"] = ("U8", (Lat, I // 32))
    return t


LAYERS = M + "layers."
EXPERTS = ".block_sparse_moe.experts."


def split_name(name):
    """(layer, expert, part) for a routed-expert tensor, (layer, None, suffix) for another
    layer tensor, None for anything else. str.partition, not regex: 497k names."""
    if not name.startswith(LAYERS):
        return None
    layer, _, rest = name[len(LAYERS):].partition(".")
    if rest.startswith(EXPERTS[1:]):
        e, _, part = rest[len(EXPERTS) - 1:].partition(".")
        return int(layer), int(e), part
    return int(layer), None, rest


def layer_runs(tensors):
    """Per layer: (shard, start, end, bytes) of its non-expert tensors; asserts one shard."""
    runs = {}
    for name, (s, _, _, a, b) in tensors.items():
        k = split_name(name)
        if k is not None and k[1] is None:
            runs.setdefault(k[0], []).append((s, a, b))
    out = {}
    for L, ts in runs.items():
        shards = {s for s, _, _ in ts}
        assert len(shards) == 1, f"layer {L} trunk spans shards {shards}"
        lo, hi = min(a for _, a, _ in ts), max(b for _, _, b in ts)
        out[L] = (shards.pop(), lo, hi, sum(b - a for _, a, b in ts))
    return out


def experts(tensors):
    """{(layer, e): [(part, shard, start, end)] sorted by offset}."""
    ex = {}
    for name, (s, _, _, a, b) in tensors.items():
        k = split_name(name)
        if k is not None and k[1] is not None:
            ex.setdefault(k[:2], []).append((k[2], s, a, b))
    for v in ex.values():
        v.sort(key=lambda x: x[2])
    return ex


def contiguous(parts):
    return len({p[1] for p in parts}) == 1 and all(x[3] == y[2] for x, y in zip(parts, parts[1:]))


def sha_dir(d):
    return {f: hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest() for f in sorted(os.listdir(d))}


def read_values(model_dir, tensors, name):
    s, dtype, shape, a, b = tensors[name]
    with open(os.path.join(model_dir, s), "rb") as f:
        f.seek(a)
        raw = f.read(b - a)
    if dtype == "BF16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if dtype == "F32":
        return np.frombuffer(raw, "<f4").reshape(shape)
    return np.frombuffer(raw, np.uint8).reshape(shape)


# ---------------------------------------------------------------------------------------------
# tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = generate(tmp_path_factory.mktemp("tiny") / "model", "tiny", "--seed", "1")
    tensors, index = load(d)
    return d, tensors, index, json.load(open(os.path.join(d, "config.json")))


def test_tiny_names_shapes_dtypes_match_model_md(tiny):
    d, tensors, _, cfg = tiny
    tc = cfg["text_config"]
    want = expected_tensors(tc)
    got = {k: (v[1], v[2]) for k, v in tensors.items()}
    assert set(got) - set(want) == set(), "unexpected tensors"
    assert set(want) - set(got) == set(), "missing tensors"
    assert got == want
    # §2.8 counts at tiny scale: 23 + 8*28 + 4*22 + 5 non-expert, 12*8*6 expert tensors.
    n_exp = sum(1 for k in got if (split_name(k) or (0, None))[1] is not None)
    assert (len(got) - n_exp, n_exp) == (23 + 8 * 28 + 4 * 22 + 5, 12 * 8 * 6)


def test_tiny_config_nested_shape_and_layer_map(tiny):
    d, tensors, _, cfg = tiny
    assert cfg["model_type"] == "kimi_k3" and cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (163584, 163586, 163839)
    tc = cfg["text_config"]
    la = tc["linear_attn_config"]
    assert la["full_attn_layers"] == [4, 8, 12, 13]
    assert la["kda_layers"] == [1, 2, 3, 5, 6, 7, 9, 10, 11]
    assert (la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]) == (4, 16, 4)
    assert "head_dim" not in tc
    assert tc["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert tc["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    dims = (tc["hidden_size"], tc["num_hidden_layers"], tc["vocab_size"], tc["num_experts"], tc["num_experts_per_token"],
            tc["num_shared_experts"], tc["routed_expert_hidden_size"], tc["moe_intermediate_size"], tc["intermediate_size"],
            tc["attn_res_block_size"], tc["q_lora_rank"], tc["kv_lora_rank"], tc["qk_nope_head_dim"], tc["qk_rope_head_dim"],
            tc["v_head_dim"], tc["num_attention_heads"])
    assert dims == (128, 13, 256, 8, 2, 2, 64, 64, 96, 3, 64, 32, 24, 8, 16, 4)
    # The layer map in the headers follows the 1-based lists: MLA at 0-based 3, 7, 11, 12.
    seen = "".join("M" if f"{M}layers.{L}.self_attn.q_a_proj.weight" in tensors else
                   "K" if f"{M}layers.{L}.self_attn.A_log" in tensors else "?" for L in range(13))
    assert seen == "KKKMKKKMKKKMM"


def test_tiny_layout_trunk_runs_and_experts(tiny):
    d, tensors, index, _ = tiny
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    assert all(re.fullmatch(r"model-\d{5}-of-\d{6}\.safetensors", s) for s in shards)
    runs = layer_runs(tensors)
    assert sorted(runs) == list(range(13))
    for L, (_, lo, hi, nbytes) in runs.items():
        assert hi - lo == nbytes, f"layer {L} trunk run is not contiguous"
    ex = experts(tensors)
    assert len(ex) == 12 * 8
    broken = sorted(k for k, v in ex.items() if not contiguous(v))
    assert broken == [(1, 3)], "exactly the documented expert is non-contiguous"
    for k, parts in ex.items():
        order = [p[0] for p in parts]
        assert len({p[1] for p in parts}) == 1, f"expert {k} spans shards"
        assert order == EXPERT_ORDER, f"expert {k} order {order}"
    # The gap of layer 1 expert 3 holds exactly the final norm, between w1 and w2.
    parts = ex[(1, 3)]
    norm = tensors[M + "norm.weight"]
    assert norm[0] == parts[0][1] and parts[1][3] == norm[3] and norm[4] == parts[2][2]


def test_tiny_values_are_numerically_interesting(tiny):
    d, t, _, _ = tiny
    L = f"{M}layers.1."
    a_log = read_values(d, t, L + "self_attn.A_log")
    assert len(set(a_log[:4].tolist())) == 4 and not a_log[4:].any(), "A_log distinct per head, zero tail"
    dt = read_values(d, t, L + "self_attn.dt_bias")
    assert np.abs(dt).min() > 0 and dt.std() > 0.1
    conv = read_values(d, t, L + "self_attn.q_conv1d.weight")[:, 0, :]
    assert np.abs(conv - conv[:, ::-1]).max() > 0.1, "conv kernels must be asymmetric"
    for name in (M + "layers.3.self_attn.q_b_proj.weight",):
        qb = read_values(d, t, name).reshape(4, 32, 64)
        assert np.abs(qb[:, 24:, :]).mean() > 0.02, "rope rows of q_b_proj non-zero"
    kva = read_values(d, t, M + "layers.3.self_attn.kv_a_proj_with_mqa.weight")
    assert np.abs(kva[32:]).mean() > 0.02, "rope rows of kv_a_proj_with_mqa non-zero"
    for name in (L + "self_attention_res_proj.weight", L + "mlp_res_proj.weight", M + "output_attn_res_proj.weight"):
        assert np.abs(read_values(d, t, name)).min() > 0
    gains = read_values(d, t, L + "input_layernorm.weight")
    assert abs(gains.mean() - 1) < 0.05 and 0.05 < gains.std() < 0.2
    # Router bias reorders the top-2 on most inputs (SPEC.md §8 I20).
    g = read_values(d, t, L + "block_sparse_moe.gate.weight").astype(np.float64)
    bias = read_values(d, t, L + "block_sparse_moe.gate.e_score_correction_bias").astype(np.float64)
    x = np.random.default_rng(7).standard_normal((400, 128))
    s = 1 / (1 + np.exp(-(x @ g.T)))
    sets_b = np.sort(np.argsort(-(s + bias), axis=1, kind="stable")[:, :2], axis=1)
    sets_u = np.sort(np.argsort(-s, axis=1, kind="stable")[:, :2], axis=1)
    changed = (sets_b != sets_u).any(axis=1).mean()
    assert changed > 0.5, f"bias changes the top-2 set on only {changed:.0%} of inputs"
    # MXFP4: scales in a sane E8M0 range (never 255), nibbles cover all 16 codes in both halves.
    for L_ in (1, 12):
        for w in ("w1", "w2", "w3"):
            sc = read_values(d, t, f"{M}layers.{L_}.block_sparse_moe.experts.5.{w}.weight_scale")
            assert 118 <= sc.min() and sc.max() <= 126
            pk = read_values(d, t, f"{M}layers.{L_}.block_sparse_moe.experts.5.{w}.weight_packed")
            assert len(np.unique(pk & 15)) == 16 and len(np.unique(pk >> 4)) == 16
    # Different experts and layers hold different bytes.
    e0 = read_values(d, t, f"{M}layers.1.block_sparse_moe.experts.0.w1.weight_packed")
    e1 = read_values(d, t, f"{M}layers.1.block_sparse_moe.experts.1.w1.weight_packed")
    e2 = read_values(d, t, f"{M}layers.2.block_sparse_moe.experts.0.w1.weight_packed")
    assert (e0 != e1).mean() > 0.9 and (e0 != e2).mean() > 0.9
    emb = read_values(d, t, M + "embed_tokens.weight")
    assert 0.9 < emb.std() < 1.1 and len(np.unique(emb[:, 0])) > 200


def test_tiny_deterministic_and_seed_sensitive(tiny, tmp_path):
    d = tiny[0]
    again = generate(tmp_path / "again", "tiny", "--seed", "1")
    assert sha_dir(again) == sha_dir(d)
    other = generate(tmp_path / "other", "tiny", "--seed", "2")
    a, b = sha_dir(d), sha_dir(other)
    assert a["config.json"] == b["config.json"]
    assert all(a[f] != b[f] for f in a if f.endswith(".safetensors"))


def test_committed_fixture_equals_fresh_generation(tiny):
    assert os.path.isdir(FIXTURE), "fixtures/tiny/model missing"
    assert sha_dir(FIXTURE) == sha_dir(tiny[0]), "regenerate with the command in fixtures/tiny/README.md"


def test_flat_config_and_decoy_head_dim(tmp_path):
    flat = generate(tmp_path / "flat", "tiny", "--config-shape", "flat", "--decoy-head-dim")
    cfg = json.load(open(os.path.join(flat, "config.json")))
    assert "text_config" not in cfg and "kda_layers" not in cfg and "linear_attn_config" not in cfg
    assert (cfg["kda_num_heads"], cfg["kda_head_dim"]) == (4, 16)
    assert (cfg["situ_beta"], cfg["situ_linear_beta"]) == (4.0, 25.0)
    assert cfg["full_attn_layers"] == [4, 8, 12, 13]
    assert (cfg["short_conv_kernel_size"], cfg["gate_lower_bound"]) == (4, -5.0)
    assert cfg["head_dim"] == 32  # the decoy: hidden / num_attention_heads, not the KDA head dim
    for k in ("activation_situ_beta", "num_heads", "head_dim_kda"):
        assert k not in cfg
    nested = generate(tmp_path / "nested", "tiny", "--decoy-head-dim")
    tc = json.load(open(os.path.join(nested, "config.json")))["text_config"]
    assert tc["head_dim"] == 32 and tc["linear_attn_config"]["head_dim"] == 16
    # The weights do not depend on the config shape.
    a, b = sha_dir(flat), sha_dir(nested)
    assert {k: v for k, v in a.items() if k != "config.json"} == {k: v for k, v in b.items() if k != "config.json"}


def test_bad_usage_is_refused(tmp_path):
    r = subprocess.run([sys.executable, SCRIPT, "--preset", "huge", str(tmp_path / "x")], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr
    assert not (tmp_path / "x").exists()
    # A non-empty output directory is refused (stale shards would mix in) unless --force,
    # which removes the old shards first.
    out = tmp_path / "y"
    out.mkdir()
    (out / "model-00004-of-000004.safetensors").write_bytes(b"stale")
    r = subprocess.run([sys.executable, SCRIPT, "--preset", "tiny", str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and "not empty" in r.stderr
    generate(out, "tiny", "--force")
    assert not (out / "model-00004-of-000004.safetensors").exists()
    assert len(json.load(open(out / "model.safetensors.index.json"))["weight_map"]) == 916


# ---------------------------------------------------------------------------------------------
# big presets: plans only (no data written), plus the fast-value path on one real-size tensor


def test_preset_plans_dimensions():
    from k3gen.presets import PRESETS
    from k3gen.writer import plan

    sizes = {}
    for name in ("small", "medium", "k3slice"):
        d = PRESETS[name]
        plans = plan(d)
        assert len(plans) >= 2
        tensors = {}
        for sp in plans:
            h = json.loads(sp.header[8:])
            h.pop("__metadata__")
            for k, e in h.items():
                tensors[k] = (sp.file, e["dtype"], tuple(e["shape"]), e["data_offsets"][0], e["data_offsets"][1])
        tc = {
            "hidden_size": d.hidden, "vocab_size": d.vocab, "num_hidden_layers": d.layers,
            "linear_attn_config": {"num_heads": d.kda_heads, "head_dim": d.kda_head_dim, "short_conv_kernel_size": d.conv,
                                   "full_attn_layers": list(d.full_attn_layers)},
            "num_attention_heads": d.mla_heads, "qk_nope_head_dim": d.nope, "qk_rope_head_dim": d.rope, "v_head_dim": d.v_head,
            "q_lora_rank": d.q_lora, "kv_lora_rank": d.kv_lora, "num_experts": d.experts, "routed_expert_hidden_size": d.latent,
            "moe_intermediate_size": d.moe_inter, "num_shared_experts": d.shared, "intermediate_size": d.dense_inter,
        }
        assert {k: (v[1], v[2]) for k, v in tensors.items()} == expected_tensors(tc)
        for L, (_, lo, hi, n) in layer_runs(tensors).items():
            assert hi - lo == n
        assert all(contiguous(v) for v in experts(tensors).values())
        sizes[name] = sum(sp.data_size for sp in plans)
    k3 = PRESETS["k3slice"]
    assert k3.layer_map() == "KKKMM" and (k3.hidden, k3.kda_heads, k3.kda_head_dim, k3.experts, k3.top_k) == (7168, 96, 128, 64, 16)
    assert PRESETS["small"].vocab == PRESETS["medium"].vocab == 163840
    assert 100e6 < sizes["small"] < 200e6
    assert 4e9 < sizes["medium"] < 6.5e9
    assert 14e9 < sizes["k3slice"] < 18e9


def test_fast_values_real_size_tensor():
    from k3gen.graph import Tensor
    from k3gen.values import FastPools, fast_chunks

    t = Tensor("language_model.model.layers.1.self_attn.q_proj.weight", "BF16", (2048, 7168), "linear", 1.0)
    pools = FastPools(1)
    chunks = fast_chunks(t, 1, pools)
    first = next(chunks)
    second = next(chunks)
    f = (first.astype(np.uint32) << 16).view(np.float32)
    assert np.isfinite(f).all()
    assert 0.5 / np.sqrt(7168) < f.std() < 2 / np.sqrt(7168)
    rows = f[: 16 * 7168].reshape(16, 7168)
    assert len({r.tobytes() for r in rows}) == 16, "rows must differ"
    assert (first[:7168] != second[:7168]).mean() > 0.9
    total = first.nbytes + second.nbytes + sum(c.nbytes for c in chunks)
    assert total == t.nbytes
    e = Tensor("x.experts.0.w1.weight_scale", "U8", (3072 * 64, 112), "mx_scale", 3584.0)
    sc = np.concatenate(list(fast_chunks(e, 1, pools)))
    assert sc.size == e.numel and 118 <= sc.min() and sc.max() <= 126


# ---------------------------------------------------------------------------------------------
# skeleton-full: the real layout, sparse


@pytest.fixture(scope="module")
def skeleton(tmp_path_factory):
    d = generate(tmp_path_factory.mktemp("skel") / "model", "skeleton-full")
    tensors, index = load(d)
    return d, tensors, index


def test_skeleton_full_census(skeleton):
    d, tensors, index = skeleton
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 96 and shards[0] == "model-00001-of-000096.safetensors" and shards[-1] == "model-00096-of-000096.safetensors"
    text = {k: v for k, v in tensors.items() if k.startswith("language_model.")}
    other = [k for k in tensors if k not in text]
    assert all(k.startswith(("vision_tower.", "mm_projector.")) for k in other) and len(other) == 168
    assert len(tensors) == 497_220
    ex = experts(text)
    experts_names = {k for k in text if ".block_sparse_moe.experts." in k}
    n_exp_tensors = len(experts_names)
    assert (len(text) - n_exp_tensors, n_exp_tensors, len(text)) == (2_460, 494_592, 497_052)
    assert len(ex) == 82_432
    sizes = {v[-1][3] - v[0][2] for v in ex.values()}
    assert sizes == {17_547_264} and all(contiguous(v) for v in ex.values())
    assert all([p[0] for p in v] == EXPERT_ORDER for v in ex.values())
    assert all([p[3] - p[2] for p in v] == [5_505_024, 344_064, 5_505_024, 344_064, 5_505_024, 344_064] for v in ex.values())
    runs = layer_runs(text)
    assert all(hi - lo == n for _, lo, hi, n in runs.values()), "every trunk run contiguous"
    assert sum(r[3] for r in runs.values()) == 108_811_877_376
    largest = max(runs, key=lambda L: runs[L][3])
    assert (largest, runs[largest][3]) == (0, 2_341_213_184)
    assert runs[1][3] == 1_267_744_256 and runs[3][3] == 844_335_616
    emb = tensors[M + "embed_tokens.weight"]
    head = tensors["language_model.lm_head.weight"]
    assert (emb[4] - emb[3]) + (head[4] - head[3]) == 4_697_620_480
    mla = [L for L in range(93) if f"{M}layers.{L}.self_attn.q_a_proj.weight" in text]
    kda = [L for L in range(93) if f"{M}layers.{L}.self_attn.A_log" in text]
    assert (len(mla), len(kda)) == (24, 69) and mla[-2:] == [91, 92] and sorted(mla + kda) == list(range(93))
    cfg = json.load(open(os.path.join(d, "config.json")))
    la = cfg["text_config"]["linear_attn_config"]
    assert [L + 1 for L in mla] == la["full_attn_layers"] and [L + 1 for L in kda] == la["kda_layers"]
    want = expected_tensors(cfg["text_config"], with_experts=False)
    assert want == {k: (v[1], v[2]) for k, v in text.items() if k not in experts_names}
    tc = cfg["text_config"]
    I, Lat = tc["moe_intermediate_size"], tc["routed_expert_hidden_size"]
    assert {(k.rsplit(".", 2)[-2], v[1], v[2]) for k, v in text.items() if k in experts_names} == {
        ("w1", "U8", (I, Lat // 2)), ("w1", "U8", (I, Lat // 32)), ("w3", "U8", (I, Lat // 2)), ("w3", "U8", (I, Lat // 32)),
        ("w2", "U8", (Lat, I // 2)), ("w2", "U8", (Lat, I // 32))}
    # Roughly equal shards, all sparse.
    sizes = [os.path.getsize(os.path.join(d, s)) for s in shards]
    assert max(sizes) < 1.25 * (sum(sizes) / 96)
    blocks = sum(os.stat(os.path.join(d, s)).st_blocks * 512 for s in shards)
    assert blocks < 200e6, f"shards are not sparse: {blocks} bytes allocated"


def _temporaries(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".tmp")) if os.path.isdir(d) else []


def _started(out, timeout=60):
    """Start writing the `small` checkpoint into `out`; return the process once its first
    temporary shard exists (mid-write: a shard takes seconds)."""
    import signal
    import time

    def interruptible():
        # A writer started from a background job inherits SIGINT ignored (POSIX shells ignore it
        # for asynchronous commands) and Python keeps it so: the writer a user interrupts is a
        # foreground one, with SIGINT's default action, which Python turns into KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    p = subprocess.Popen([sys.executable, SCRIPT, "--preset", "small", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=interruptible)
    t0 = time.monotonic()
    while not _temporaries(out):
        assert p.poll() is None, f"finished before it could be interrupted: {p.communicate()}"
        assert time.monotonic() - t0 < timeout, "no temporary shard appeared"
        time.sleep(0.005)
    return p


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_an_interrupted_write_leaves_no_temporary_file(tmp_path, sig):
    import signal
    out = tmp_path / "small"
    p = _started(out)
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0, err
    assert _temporaries(out) == [], err
    # A shard under its final name is whole (written before the signal): its header parses and
    # the file ends where its last tensor does.
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            entries, start = read_header(os.path.join(out, f))
            end = max(e["data_offsets"][1] for e in entries.values())
            assert os.path.getsize(os.path.join(out, f)) == start + end, f


def test_a_killed_writers_temporaries_are_removed_by_the_next_run(tmp_path):
    out = tmp_path / "small"
    p = _started(out)
    p.kill()
    p.communicate(timeout=60)
    left = _temporaries(out)
    assert left, "SIGKILL leaves the temporary shard"
    r = subprocess.run([sys.executable, SCRIPT, "--preset", "tiny", "--force", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _temporaries(out) == []
    assert all(f"removed {os.path.join(out, f)}" in r.stderr for f in left), r.stderr
