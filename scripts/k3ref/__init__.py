"""k3ref: an independent float64 numpy reference of the Kimi K3 text forward pass.

Written from docs/SPEC.md only (no Rust code, no third-party model code). Modules:

* ``config``      — config.json reader (nested released shape and flat shape, SPEC.md §1)
* ``safetensors`` — a small bounded safetensors reader (§2.1)
* ``checkpoint``  — shard index, legacy prefix, lazy tensor access (§2)
* ``mxfp4``       — MXFP4 / E8M0 dequantisation (§4)
* ``ops``         — RMSNorm, L2 norm, SiTU, sigmoid, Block AttnRes aggregation (§3.1-3.3)
* ``kda``         — Kimi Delta Attention layer (§3.4)
* ``mla``         — Gated MLA, expanded and latent/absorbed forms (§3.5, §3.6)
* ``moe``         — router, Stable LatentMoE, dense SiTU MLP (§3.7, §3.8)
* ``model``       — binding tensor names to layers, the top-level forward, greedy decoding
"""
