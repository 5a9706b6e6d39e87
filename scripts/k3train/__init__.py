"""Train a small model with Kimi K3's exact tensor graph on a pinned text corpus (issue #31).

corpus.py  the pinned corpus (Django 5.1.4 sdist from PyPI, sha256-checked), tokenized with the
           real K3 tokenizer, split deterministically into train / validation documents;
model.py   K3's forward in JAX, mirroring scripts/k3ref (the float64 spec in code) line by line,
           with MXFP4 quantization-aware routed experts;
export.py  trained parameters -> checkpoint tensors written by scripts/k3gen (BF16 trunk, F32
           where K3 has F32, MXFP4 routed experts, the released config shape);
train.py   the training loop and the third reference (the trainer's forward on the EXPORTED
           checkpoint).
"""
