"""pytest configuration: make scripts/ importable from the tests; the shared `small` checkpoint."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = Path(__file__).resolve().parents[2]


def cached_checkpoint(preset: str, seed: int) -> Path:
    """`scripts/make-checkpoint.py --preset PRESET --seed SEED`, made once per generator version
    into `target/k3-test-models/PRESET-seedSEED-VERSION`: the directory the Rust end-to-end tests
    use (tests/src/lib.rs, `cached_checkpoint`: the same name, VERSION the same FNV-1a hash of the
    generator's source), so one checkpoint serves every test file and both languages. Made in a
    temporary directory beside it and renamed into place: a concurrent maker never sees half of
    one. The tests only read it."""
    src = (ROOT / "scripts" / "make-checkpoint.py").read_bytes()
    h = 0xCBF29CE484222325
    for b in src:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    root = ROOT / "target" / "k3-test-models"
    final = root / f"{preset}-seed{seed}-{h:016x}"
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".making-", dir=root) as tmp:
        out = Path(tmp) / "model"
        r = subprocess.run([sys.executable, ROOT / "scripts" / "make-checkpoint.py", "--preset", preset,
                            "--seed", str(seed), out], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"make-checkpoint.py exited {r.returncode}:\n{r.stderr[-3000:]}"
        try:
            out.rename(final)
        except OSError:
            # Another maker finished first: its copy is used and ours dropped.
            assert (final / "config.json").exists(), f"cannot move {out} to {final}"
    return final


@pytest.fixture(scope="session")
def small_model() -> Path:
    """The generated `small` checkpoint (seed 1, real vocabulary), shared read-only."""
    return cached_checkpoint("small", 1)


# The files that take longest, started first: the one-test chaos run (144 s, which no worker can
# share), then the others longest first (seconds summed over their tests in scripts/test.sh's run
# of 2026-12-07 on 2 cores: agents_serve 178, openai_serve 113, perplexity 45, tokenizer_parity 43,
# serve_trust 41, make_checkpoint 31). scripts/test.sh runs the files in
# five pytest-xdist workers, a file to a worker in collection order (`--dist loadfile
# --no-loadscope-reorder`): started first, the long ones end together instead of one of them
# starting last (xdist's own order is by test count, which put the one-test chaos run near the
# end: 306 s for the Python tests where the files sum to 650 s over three workers).
LONGEST_FIRST = ["test_chaos.py", "test_agents_serve.py", "test_openai_serve.py", "test_perplexity.py",
                 "test_tokenizer_parity.py", "test_serve_trust.py", "test_make_checkpoint.py"]


# Last: the files whose first step is `cargo build --workspace --bins` (the demo, and the README's
# five-minute route): a no-op once scripts/test.sh has built the binaries, but it waits for the
# lock of the build of the test binaries that runs beside the Python tests.
BUILD_FIRST_LAST = ["test_demo.py", "test_readme_blocks.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    last = {name: len(rank) + 1 + i for i, name in enumerate(BUILD_FIRST_LAST)}
    # A stable sort: the tests of a file keep their order, the other files theirs after these.
    items.sort(key=lambda item: last.get(item.path.name, rank.get(item.path.name, len(rank))))
