"""Training loop, export, and the third reference (see scripts/train_k3.py for usage)."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from k3gen.atomic import atomic_write

from . import corpus as corpus_mod
from .presets import PRESETS

SHARED_ROW_NOTE = "every id outside the kept sub-vocabulary shares one embed row and one lm_head row"


# ---------------------------------------------------------------------------------------------
# vocabulary

def sub_vocabulary(train: np.ndarray, vocab: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept ids [size-1] in rank order, map full id -> row, the shared row = size-1)."""
    counts = np.bincount(train, minlength=vocab)
    order = np.lexsort((np.arange(vocab), -counts))          # count desc, then id asc
    kept = order[: size - 1]
    kept = kept[counts[kept] > 0]
    if corpus_mod.BOS not in set(kept.tolist()):
        kept = np.concatenate([kept[:-1], [corpus_mod.BOS]])
    kept = np.sort(kept).astype(np.int64)
    row = np.full(vocab, len(kept), dtype=np.int32)
    row[kept] = np.arange(len(kept), dtype=np.int32)
    return kept, row


# ---------------------------------------------------------------------------------------------
# initial values (numpy, float32, from the seed)

def init_params(d, n_rows: int, seed: int) -> dict:
    rng = np.random.Generator(np.random.PCG64(seed))
    E, P, D, H = d.hidden, d.kda_proj, d.kda_head_dim, d.kda_heads
    out_gain = 1.0 / math.sqrt(2 * d.layers)

    def lin(o, i, gain=1.0):
        return (rng.standard_normal((o, i)) * gain / math.sqrt(i)).astype(np.float32)

    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    zeros = lambda n: np.zeros(n, np.float32)  # noqa: E731
    layers = []
    for L in range(d.layers):
        if d.is_mla(L):
            Hm = d.mla_heads
            attn = {"q_a": lin(d.q_lora, E), "q_a_norm": ones(d.q_lora),
                    "q_b": lin(Hm * (d.nope + d.rope), d.q_lora),
                    "kv_a": lin(d.kv_lora + d.rope, E), "kv_a_norm": ones(d.kv_lora),
                    "kv_b": lin(Hm * (d.nope + d.v_head), d.kv_lora),
                    "o_proj": lin(E, Hm * d.v_head, out_gain), "g_proj": lin(Hm * d.v_head, E)}
        else:
            def conv():
                w = (rng.standard_normal((P, d.conv)) * 0.1).astype(np.float32)
                w[:, -1] += 1.0
                return w
            attn = {"q_proj": lin(P, E), "k_proj": lin(P, E), "v_proj": lin(P, E),
                    "q_conv": conv(), "k_conv": conv(), "v_conv": conv(),
                    "f_a": lin(D, E), "f_b": lin(P, D),
                    "a_log": zeros(H),
                    "dt_bias": rng.uniform(-5.0, -1.0, P).astype(np.float32),
                    "b_proj": lin(H, E), "g_proj": lin(P, E), "o_norm": ones(D),
                    "o_proj": lin(E, P, out_gain)}
        if L < 1:
            mlp = {"gate": lin(d.dense_inter, E), "up": lin(d.dense_inter, E),
                   "down": lin(E, d.dense_inter, out_gain)}
        else:
            N, I, Lat, S = d.experts, d.moe_inter, d.latent, d.shared * d.moe_inter
            mlp = {"router": lin(N, E), "bias": zeros(N), "down": lin(Lat, E), "norm": ones(Lat),
                   "up": lin(E, Lat, out_gain),
                   "w1": (rng.standard_normal((N, I, Lat)) / math.sqrt(Lat)).astype(np.float32),
                   "w3": (rng.standard_normal((N, I, Lat)) / math.sqrt(Lat)).astype(np.float32),
                   "w2": (rng.standard_normal((N, Lat, I)) / math.sqrt(I)).astype(np.float32),
                   "sh_gate": lin(S, E), "sh_up": lin(S, E), "sh_down": lin(E, S, out_gain)}
        layers.append({"input_norm": ones(E), "post_norm": ones(E),
                       "attn_res_q_norm": ones(E), "attn_res_q_proj": zeros(E),
                       "mlp_res_q_norm": ones(E), "mlp_res_q_proj": zeros(E),
                       "attn": attn, "mlp": mlp})
    return {"embed": rng.standard_normal((n_rows, E)).astype(np.float32),
            "lm_head": lin(n_rows, E), "final_norm": ones(E),
            "out_res_q_norm": ones(E), "out_res_q_proj": zeros(E), "layers": layers}


def split_bias(params: dict) -> tuple[dict, list]:
    """The selection biases are not trained by gradient (aux-loss-free balancing updates them)."""
    biases = []
    for lp in params["layers"]:
        if "bias" in lp["mlp"]:
            biases.append(lp["mlp"].pop("bias"))
    return params, biases


def with_bias(params: dict, biases: list) -> dict:
    layers, i = [], 0
    for lp in params["layers"]:
        if "router" in lp["mlp"]:
            lp = {**lp, "mlp": {**lp["mlp"], "bias": biases[i]}}
            i += 1
        layers.append(lp)
    return {**params, "layers": layers}


def save_params(path: Path, params: dict, kept: np.ndarray, step: int, n_steps: int) -> None:
    """Trained values (float32, with the selection biases) + kept ids, to re-export without
    retraining (``train_k3.py --export-from``)."""
    import jax
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    with atomic_write(str(path)) as f:
        np.savez(f, __kept__=kept, __step__=step, __steps__=n_steps, **flat)


def load_params(path: Path, template: dict) -> tuple[dict, np.ndarray, int, int]:
    import jax
    z = np.load(path)
    leaves = [z[jax.tree_util.keystr(k)] for k, _ in jax.tree_util.tree_flatten_with_path(template)[0]]
    params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)
    return params, z["__kept__"], int(z["__step__"]), int(z["__steps__"])


def export_checkpoint(out: Path, params: dict, d, kept: np.ndarray, seed: int) -> int:
    """Write the checkpoint through k3gen; returns its size in bytes."""
    from k3gen.writer import write_checkpoint

    from k3ref.mxfp4 import dequantize

    from . import export, model
    # The packer must store exactly what quantization-aware training saw.
    w = np.asarray(params["layers"][1]["mlp"]["w1"][0], dtype=np.float32)
    packed, scale = model.np_mx_pack(w)
    deq, nan = dequantize(packed, scale, w.shape[1])
    if nan or not np.array_equal(deq, np.asarray(model.mx_quantize(w), dtype=np.float64)):
        raise AssertionError("MXFP4 packer and the QAT quantizer disagree")
    given = export.encode(export.logical_tensors(params, d, kept), d)
    out.mkdir(parents=True, exist_ok=True)
    plans = write_checkpoint(d, str(out), seed, given=given)
    np.savez(out / "compact.npz", **export.compact(given, kept, d))
    return sum(len(p.header) + p.data_size for p in plans)


def main_expand(args) -> int:
    """compact.npz -> the full checkpoint (numpy only, no JAX)."""
    from k3gen.writer import write_checkpoint

    from . import export
    d = PRESETS[args.preset].dims
    with np.load(args.expand) as z:
        given = export.expand(dict(z), d)
    out = Path(args.out)
    plans = write_checkpoint(d, str(out), args.seed, given=given)
    print(f"expanded {args.expand} -> {out} ({sum(len(p.header) + p.data_size for p in plans)} bytes)",
          file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# training

def train(out: Path, preset_name: str, minutes: float, steps: int | None, seed: int,
          log=print, val_limit: int | None = None) -> dict:
    import jax
    import jax.numpy as jnp

    from . import model

    pre = PRESETS[preset_name]
    d = pre.dims
    n_steps = steps if steps is not None else max(1, round(60.0 * minutes / pre.step_seconds))
    c = corpus_mod.load()
    kept, row = sub_vocabulary(c.train, d.vocab, pre.sub_vocab)
    n_rows = len(kept) + 1
    shared = n_rows - 1
    log_n_shared = math.log(d.vocab - len(kept))
    train_rows = row[c.train]
    val_rows = row[c.val]
    cover = float(np.mean(train_rows != shared))
    log(f"corpus: {c.n_docs} documents ({c.n_val_docs} validation), {len(c.train):,} train / "
        f"{len(c.val):,} validation tokens, key {c.key[:16]}; {len(kept)} kept ids cover "
        f"{100 * cover:.2f}% of train tokens ({SHARED_ROW_NOTE})")

    cfg = {**model.model_cfg(d), "capacity": pre.capacity}
    T, B = pre.seq, pre.batch
    out.mkdir(parents=True, exist_ok=True)
    params, biases = split_bias(init_params(d, n_rows, seed))
    params = jax.tree_util.tree_map(jnp.asarray, params)
    biases = [jnp.asarray(b) for b in biases]

    def loss_fn(p, biases, x, y):
        lg, counts = model.logits(with_bias(p, biases), x, cfg, qat=True)
        lg = lg.at[..., shared].add(log_n_shared)
        lse = jax.nn.logsumexp(lg, axis=-1)
        tgt = jnp.take_along_axis(lg, y[..., None], axis=-1)[..., 0]
        ce = jnp.mean(lse - tgt)
        return ce, counts

    def decay_mask(p):
        return jax.tree_util.tree_map(lambda a: 1.0 if a.ndim >= 2 else 0.0, p)

    wd_mask = decay_mask(params)
    b1, b2, wd, eps_adam, clip = 0.9, 0.95, 0.01, 1e-8, 1.0

    @jax.jit
    def step(p, m, v, biases, x, y, lr, t):
        (ce, counts), g = jax.value_and_grad(loss_fn, has_aux=True)(p, biases, x, y)
        gn = jnp.sqrt(sum(jnp.sum(a * a) for a in jax.tree_util.tree_leaves(g)))
        g = jax.tree_util.tree_map(lambda a: a * jnp.minimum(1.0, clip / (gn + 1e-6)), g)
        m = jax.tree_util.tree_map(lambda mm, gg: b1 * mm + (1 - b1) * gg, m, g)
        v = jax.tree_util.tree_map(lambda vv, gg: b2 * vv + (1 - b2) * gg * gg, v, g)
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        p = jax.tree_util.tree_map(
            lambda pp, mm, vv, dm: pp - lr * ((mm / bc1) / (jnp.sqrt(vv / bc2) + eps_adam) + wd * dm * pp),
            p, m, v, wd_mask)
        # aux-loss-free balancing of the selection bias (DeepSeek-V3 style): raise the bias of
        # under-loaded experts, lower the over-loaded ones.
        new_b = [bb + 1e-3 * jnp.sign(jnp.mean(cc) - cc) for bb, cc in zip(biases, counts)]
        return p, m, v, new_b, ce, gn, jnp.stack(counts)

    @jax.jit
    def eval_ce(p, biases, x, y):
        lg, _ = model.logits(with_bias(p, biases), x, cfg, qat=True)
        lg = lg.at[..., shared].add(log_n_shared)
        lse = jax.nn.logsumexp(lg, axis=-1)
        tgt = jnp.take_along_axis(lg, y[..., None], axis=-1)[..., 0]
        # full-vocabulary CE: a token outside the kept ids is one of the shared row's copies
        return jnp.sum(lse - tgt + jnp.where(y == shared, log_n_shared, 0.0)), y.size

    n_val = (len(val_rows) - 1) // T
    if val_limit is not None:
        n_val = min(n_val, val_limit)
    vx = np.stack([val_rows[i * T:(i + 1) * T] for i in range(n_val)])
    vy = np.stack([val_rows[i * T + 1:(i + 1) * T + 1] for i in range(n_val)])
    # the unigram baseline on exactly these target positions
    counts_full = np.bincount(c.train, minlength=d.vocab).astype(np.float64)
    p_full = counts_full[counts_full > 0] / counts_full.sum()
    uni_entropy = float(-(p_full * np.log(p_full)).sum())
    smoothed = (counts_full + 1.0) / (counts_full.sum() + d.vocab)
    vy_full = np.stack([c.val[i * T + 1:(i + 1) * T + 1] for i in range(n_val)])
    uni_val_ce = float(-np.log(smoothed[vy_full]).mean())

    def validate(p, biases):
        tot, n = 0.0, 0
        for i in range(0, n_val, B):
            s, k = eval_ce(p, biases, jnp.asarray(vx[i:i + B]), jnp.asarray(vy[i:i + B]))
            tot += float(s)
            n += int(k)
        return tot / n

    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    data_rng = np.random.Generator(np.random.PCG64(seed + 1))
    warm = max(1, n_steps // 20)
    history = []
    log(f"training preset {preset_name}: {n_steps} steps of {B}x{T} tokens, layers {d.layer_map()}, "
        f"{d.experts} experts top-{d.top_k}, seed {seed}")
    t0 = time.monotonic()
    load_hist = np.zeros((sum(1 for L in range(d.layers) if L >= 1), d.experts))
    for it in range(1, n_steps + 1):
        lr = pre.lr * (it / warm if it <= warm else
                       0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (it - warm) / max(1, n_steps - warm))))
        starts = data_rng.integers(0, len(train_rows) - T - 1, B)
        x = np.stack([train_rows[s:s + T] for s in starts])
        y = np.stack([train_rows[s + 1:s + T + 1] for s in starts])
        params, m, v, biases, ce, gn, counts = step(params, m, v, biases, jnp.asarray(x), jnp.asarray(y),
                                                    jnp.float32(lr), jnp.float32(it))
        if it > n_steps - max(1, n_steps // 10):
            load_hist += np.asarray(counts)
        if it % 50 == 0 or it == n_steps:
            save_params(out / "trained_params.npz",
                        jax.tree_util.tree_map(np.asarray, with_bias(params, biases)), kept, it, n_steps)
        if it == 1 or it % 25 == 0 or it == n_steps:
            el = time.monotonic() - t0
            history.append({"step": it, "train_ce": float(ce), "grad_norm": float(gn), "seconds": el})
            log(f"step {it}/{n_steps} train CE {float(ce):.3f} |g| {float(gn):.2f} lr {lr:.2e} "
                f"{el:.0f} s ({el / it:.2f} s/step)")
    train_s = time.monotonic() - t0
    tv = time.monotonic()
    val_ce = validate(params, biases)
    log(f"validation over {n_val} windows of {T} tokens took {time.monotonic() - tv:.0f} s")
    log(f"validation CE {val_ce:.4f} nats/token vs unigram: entropy {uni_entropy:.4f}, "
        f"smoothed unigram on validation {uni_val_ce:.4f}")

    # export
    final = jax.tree_util.tree_map(np.asarray, with_bias(params, biases))
    size = export_checkpoint(out, final, d, kept, seed)
    load_frac = load_hist / load_hist.sum(axis=1, keepdims=True)
    meta = {
        "preset": preset_name, "seed": seed, "steps": n_steps, "batch": B, "seq": T,
        "tokens_seen": n_steps * B * T, "train_seconds": round(train_s, 1),
        "seconds_per_step": round(train_s / n_steps, 3),
        "threads": os.cpu_count(), "jax": jax.__version__,
        "corpus": {"sdist": corpus_mod.SDIST, "sha256": corpus_mod.SDIST_SHA256, "key": c.key,
                   "train_tokens": int(len(c.train)), "val_tokens": int(len(c.val)),
                   "documents": c.n_docs, "val_documents": c.n_val_docs},
        "sub_vocab": {"kept": int(len(kept)), "train_coverage": cover, "note": SHARED_ROW_NOTE},
        "val_ce_qat_f32": val_ce, "val_tokens_scored": int(n_val * T),
        "unigram": {"train_entropy": uni_entropy, "val_smoothed_ce": uni_val_ce},
        "history": history,
        "expert_load_last_10pct": {"max_share": float(load_frac.max()), "min_share": float(load_frac.min()),
                                   "uniform_share": 1.0 / d.experts},
        "checkpoint_bytes": size,
    }
    return meta


# ---------------------------------------------------------------------------------------------
# the third reference: the trainer's forward on the EXPORTED checkpoint, float64

def reference(model_dir: Path, ids: list[int], n_gen: int, out_dir: Path | None,
              val_windows: int = 0) -> dict:
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    from k3ref.checkpoint import Checkpoint
    from k3ref.config import read_config
    from k3ref.model import bind

    from . import export, model

    cfg_k3 = read_config(model_dir / "config.json")
    bound = bind(cfg_k3, Checkpoint(model_dir))
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype=jnp.float64), export.params_from_bound(bound))
    cfg = {**model.cfg_from_config(cfg_k3), "dense_experts": False}
    fwd = jax.jit(lambda p, x: model.logits(p, x, cfg)[0])
    seq = list(ids)
    rows = []
    # Every step runs the same shape, the longest sequence (prompt + n_gen - 1), padded with id 0
    # after the real ids, so jit compiles once rather than once per length (a compile costs
    # seconds, the forward milliseconds). The model is causal: what follows a position does not
    # change its logits, so row len(seq) - 1 is the one an unpadded run gives.
    width = len(ids) + max(n_gen, 1) - 1
    for _ in range(n_gen):
        x = jnp.asarray([seq + [0] * (width - len(seq))], dtype=jnp.int32)
        lg = np.asarray(fwd(params, x))[0, len(seq) - 1]
        rows.append(lg)
        seq.append(int(np.argmax(lg)))
    gen = seq[len(ids):]
    res = {"prompt_ids": list(ids), "greedy_ids": gen}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "prompt_ids.json").write_text(json.dumps(list(ids)) + "\n")
        (out_dir / "greedy_ids.json").write_text(json.dumps(gen) + "\n")
        rows[0].astype("<f4").tofile(out_dir / "logits_step0.f32")
        (out_dir / "meta.json").write_text(json.dumps({"reference": "k3train (JAX float64) on the exported "
                                                       "checkpoint", "gen": n_gen}, indent=2) + "\n")
    if val_windows:
        c = corpus_mod.load()
        T = 256
        tot, n = 0.0, 0
        fwd_b = jax.jit(lambda p, x: jax.nn.log_softmax(model.logits(p, x, cfg)[0], axis=-1))
        for i in range(val_windows):
            w = c.val[i * T:(i + 1) * T + 1]
            lp = np.asarray(fwd_b(params, jnp.asarray(w[None, :-1])))[0]
            tot += float(-lp[np.arange(T), w[1:]].sum())
            n += T
        res["val_ce_exported_f64"] = tot / n
        res["val_windows"] = val_windows
    return res


def main_export(args) -> int:
    """Re-export a saved trained_params.npz (e.g. after fixing the exporter) into OUT."""
    pre = PRESETS[args.preset]
    c = corpus_mod.load()
    kept, _ = sub_vocabulary(c.train, pre.dims.vocab, pre.sub_vocab)
    template = init_params(pre.dims, len(kept) + 1, 0)
    params, kept_saved, step, n_steps = load_params(Path(args.export_from), template)
    if not np.array_equal(kept, kept_saved):
        print("train_k3: the saved kept ids differ from this corpus's", file=sys.stderr)
        return 1
    size = export_checkpoint(Path(args.out), params, pre.dims, kept, args.seed)
    print(f"exported step {step} of {n_steps} -> {args.out} ({size} bytes)", file=sys.stderr)
    _, row = sub_vocabulary(c.train, pre.dims.vocab, pre.sub_vocab)
    ev = evaluate(params, pre, c, row, len(kept) + 1, args.val_limit)
    ev.update({"step": step, "steps": n_steps, "preset": args.preset, "checkpoint_bytes": size})
    (Path(args.out) / "export.json").write_text(json.dumps(ev, indent=2) + "\n")
    print(json.dumps(ev))
    return 0


def evaluate(params: dict, pre, c, row: np.ndarray, n_rows: int, limit: int | None) -> dict:
    """Validation CE (nats/token, full vocabulary, float32, MXFP4 experts) of trained params,
    and the unigram baselines on the same target positions (what ``train`` reports at its end)."""
    import jax
    import jax.numpy as jnp

    from . import model
    d, T, B = pre.dims, pre.seq, pre.batch
    shared = n_rows - 1
    log_n_shared = math.log(d.vocab - (n_rows - 1))
    cfg = model.model_cfg(d)
    val_rows = row[c.val]
    n_val = (len(val_rows) - 1) // T
    if limit is not None:
        n_val = min(n_val, limit)
    vx = np.stack([val_rows[i * T:(i + 1) * T] for i in range(n_val)])
    vy = np.stack([val_rows[i * T + 1:(i + 1) * T + 1] for i in range(n_val)])

    @jax.jit
    def ce_sum(p, x, y):
        lg, _ = model.logits(p, x, cfg, qat=True)
        lg = lg.at[..., shared].add(log_n_shared)
        lse = jax.nn.logsumexp(lg, axis=-1)
        tgt = jnp.take_along_axis(lg, y[..., None], axis=-1)[..., 0]
        return jnp.sum(lse - tgt + jnp.where(y == shared, log_n_shared, 0.0))

    p = jax.tree_util.tree_map(jnp.asarray, params)
    tot = sum(float(ce_sum(p, jnp.asarray(vx[i:i + B]), jnp.asarray(vy[i:i + B]))) for i in range(0, n_val, B))
    counts = np.bincount(c.train, minlength=d.vocab).astype(np.float64)
    pf = counts[counts > 0] / counts.sum()
    smoothed = (counts + 1.0) / (counts.sum() + d.vocab)
    vy_full = np.stack([c.val[i * T + 1:(i + 1) * T + 1] for i in range(n_val)])
    return {"val_ce": tot / vy.size, "val_tokens_scored": int(vy.size),
            "train_unigram_entropy": float(-(pf * np.log(pf)).sum()),
            "val_unigram_smoothed_ce": float(-np.log(smoothed[vy_full]).mean())}


def main_train(args) -> int:
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        print(f"train_k3: {out} is not empty (use --force)", file=sys.stderr)
        return 2
    if out.exists() and args.force:
        for f in out.iterdir():
            if f.is_file() and (f.suffix in (".safetensors", ".json", ".f32")):
                f.unlink()
    meta = train(out, args.preset, args.minutes, args.steps, args.seed,
                 log=lambda s: print(s, file=sys.stderr, flush=True), val_limit=args.val_limit)
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({k: meta[k] for k in ("preset", "steps", "val_ce_qat_f32", "unigram",
                                           "train_seconds", "checkpoint_bytes")}))
    return 0
