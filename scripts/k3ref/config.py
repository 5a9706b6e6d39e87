"""config.json reader for both shapes (SPEC.md §1.1-§1.3).

Search order per key: ``text_config`` → ``text_config.linear_attn_config`` → root. KDA
``num_heads``/``head_dim`` are read from ``linear_attn_config`` FIRST and otherwise only from the
flat aliases ``kda_num_heads``/``kda_head_dim`` — never from a generic ``head_dim`` (hazard I2: a
re-saved config can carry ``text_config.head_dim = hidden/heads``). A missing required field is an
error that lists every missing/invalid key at once; no defaults except the three documented
optional booleans.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """The config cannot be read with confidence (exit code 2)."""


# (field, kind) read with the generic search order. kind: "int" (positive), "int0" (>= 0),
# "float", "list".
_REQUIRED: list[tuple[str, str]] = [
    ("hidden_size", "int"),
    ("num_hidden_layers", "int"),
    ("vocab_size", "int"),
    ("rms_norm_eps", "float"),
    ("intermediate_size", "int"),
    ("first_k_dense_replace", "int0"),
    ("num_experts", "int"),
    ("num_experts_per_token", "int"),
    ("num_shared_experts", "int0"),
    ("moe_intermediate_size", "int"),
    ("routed_expert_hidden_size", "int"),
    ("routed_scaling_factor", "float"),
    ("num_attention_heads", "int"),
    ("q_lora_rank", "int"),
    ("kv_lora_rank", "int"),
    ("qk_nope_head_dim", "int"),
    ("qk_rope_head_dim", "int0"),
    ("v_head_dim", "int"),
    ("attn_res_block_size", "int"),
    ("short_conv_kernel_size", "int"),
    ("gate_lower_bound", "float"),
    ("full_attn_layers", "list"),
]

# Fields with a nested name and a flat alias: (attribute, [names in priority order]).
_ALIASED: list[tuple[str, list[str], str]] = [
    ("situ_beta", ["activation_situ_beta", "situ_beta"], "float"),
    ("situ_linear_beta", ["activation_situ_linear_beta", "situ_linear_beta"], "float"),
]

# Optional booleans with real defaults (§1.2).
_OPTIONAL_BOOLS = {"mla_use_output_gate": True, "moe_renormalize": True, "latent_moe_use_norm": True}


@dataclass(frozen=True)
class Config:
    shape: str                       # "nested" or "flat"
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    situ_beta: float
    situ_linear_beta: float
    intermediate_size: int
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    routed_scaling_factor: float
    moe_renormalize: bool
    latent_moe_use_norm: bool
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    attn_res_block_size: int
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float
    full_attn_layers: tuple[int, ...]   # 1-based, as in the file
    kda_layers: tuple[int, ...]         # 1-based; derived as the complement when absent

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """'mla' or 'kda' per 0-based layer: MLA iff L+1 ∈ full_attn_layers (I1)."""
        full = set(self.full_attn_layers)
        return tuple("mla" if (L + 1) in full else "kda" for L in range(self.num_hidden_layers))

    @property
    def layer_map(self) -> str:
        return "".join("M" if k == "mla" else "K" for k in self.layer_kinds)

    def is_dense(self, layer: int) -> bool:
        return layer < self.first_k_dense_replace

    def summary(self) -> str:
        kinds = self.layer_kinds
        return (f"{self.shape} shape | hidden={self.hidden_size} layers={self.num_hidden_layers} "
                f"vocab={self.vocab_size} | {kinds.count('mla')} MLA + {kinds.count('kda')} KDA | "
                f"experts {self.num_experts} top{self.num_experts_per_token} "
                f"shared{self.num_shared_experts} | latent={self.routed_expert_hidden_size}")


_MISSING = object()


def _scopes(root: dict) -> list[dict]:
    """The dictionaries searched, in order: text_config, text_config.linear_attn_config, root."""
    scopes = []
    text = root.get("text_config")
    if isinstance(text, dict):
        scopes.append(text)
        lac = text.get("linear_attn_config")
        if isinstance(lac, dict):
            scopes.append(lac)
    scopes.append(root)
    return scopes


def lookup(root: dict, key: str) -> Any:
    """Generic search order of §1.2 (returns _MISSING when absent everywhere)."""
    for scope in _scopes(root):
        if key in scope and scope[key] is not None:
            return scope[key]
    return _MISSING


def _linear_attn_config(root: dict) -> dict:
    text = root.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("linear_attn_config"), dict):
        return text["linear_attn_config"]
    return {}


def _kda_dim(root: dict, lac_key: str, flat_key: str) -> Any:
    """KDA heads/head_dim: linear_attn_config first, then only the flat alias (I2)."""
    lac = _linear_attn_config(root)
    if lac_key in lac and lac[lac_key] is not None:
        return lac[lac_key]
    return lookup(root, flat_key)


def _check(name: str, value: Any, kind: str, problems: list[str]) -> Any:
    if value is _MISSING:
        problems.append(f"missing required field `{name}`")
        return None
    if kind in ("int", "int0"):
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"field `{name}` must be an integer, got {value!r}")
            return None
        if value < (1 if kind == "int" else 0):
            problems.append(f"field `{name}` must be {'> 0' if kind == 'int' else '>= 0'}, got {value}")
            return None
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"field `{name}` must be a finite number, got {value!r}")
            return None
        return float(value)
    if kind == "list":
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                  for v in value):
            problems.append(f"field `{name}` must be a list of integers, got {value!r}")
            return None
        return tuple(value)
    raise AssertionError(kind)


def parse_config(root: dict) -> Config:
    """Build a Config from a parsed config.json object; raises ConfigError listing every problem."""
    if not isinstance(root, dict):
        raise ConfigError("config.json: top level is not a JSON object")
    problems: list[str] = []
    vals: dict[str, Any] = {}
    for name, kind in _REQUIRED:
        vals[name] = _check(name, lookup(root, name), kind, problems)
    for attr, names, kind in _ALIASED:
        value = _MISSING
        for n in names:
            value = lookup(root, n)
            if value is not _MISSING:
                break
        vals[attr] = _check("/".join(names), value, kind, problems)
    vals["kda_num_heads"] = _check("linear_attn_config.num_heads/kda_num_heads",
                                   _kda_dim(root, "num_heads", "kda_num_heads"), "int", problems)
    vals["kda_head_dim"] = _check("linear_attn_config.head_dim/kda_head_dim",
                                  _kda_dim(root, "head_dim", "kda_head_dim"), "int", problems)
    for name, default in _OPTIONAL_BOOLS.items():
        v = lookup(root, name)
        if v is _MISSING:
            vals[name] = default
        elif not isinstance(v, bool):
            problems.append(f"field `{name}` must be a boolean, got {v!r}")
        else:
            vals[name] = v
    kda_layers = lookup(root, "kda_layers")
    kda_given = None if kda_layers is _MISSING else _check("kda_layers", kda_layers, "list", problems)

    # Fields that, when present, must hold the only value this reference implements.
    for name, want in [("mla_use_nope", True), ("hidden_act", "situ"),
                       ("moe_router_activation_func", "sigmoid"), ("topk_method", "noaux_tc"),
                       ("num_expert_group", 1), ("topk_group", 1), ("moe_layer_freq", 1),
                       ("tie_word_embeddings", False)]:
        v = lookup(root, name)
        if v is not _MISSING and (v != want or type(v) is not type(want)):
            problems.append(f"field `{name}` = {v!r} is not supported (K3 requires {want!r})")
    if problems:
        raise ConfigError("config: " + "; ".join(problems))

    # Structural checks (§1.2).
    n = vals["num_hidden_layers"]
    full = vals["full_attn_layers"]
    bad = [i for i in full if not 1 <= i <= n]
    if bad:
        problems.append(f"full_attn_layers entries outside 1..{n}: {bad}")
    if len(set(full)) != len(full):
        problems.append("full_attn_layers has duplicates")
    complement = tuple(i for i in range(1, n + 1) if i not in set(full))
    if kda_given is not None:
        badk = [i for i in kda_given if not 1 <= i <= n]
        if badk:
            problems.append(f"kda_layers entries outside 1..{n}: {badk}")
        if set(kda_given) & set(full):
            problems.append(f"kda_layers and full_attn_layers overlap: {sorted(set(kda_given) & set(full))}")
        if sorted(set(kda_given) | set(full)) != list(range(1, n + 1)):
            problems.append("kda_layers ∪ full_attn_layers does not cover every layer 1..num_hidden_layers")
    if not complement:
        problems.append("no KDA layer (every layer listed in full_attn_layers)")
    if vals["num_experts_per_token"] > vals["num_experts"]:
        problems.append("num_experts_per_token > num_experts")
    if problems:
        raise ConfigError("config: " + "; ".join(problems))
    vals["kda_layers"] = complement
    shape = "nested" if isinstance(root.get("text_config"), dict) else "flat"
    return Config(shape=shape, **vals)


def read_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    try:
        root = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from e
    return parse_config(root)
