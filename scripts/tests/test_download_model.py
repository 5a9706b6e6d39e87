"""scripts/download-model.sh against a fake hub on loopback (no other network).

The fake hub is Python's `http.server` in a thread, with the two routes the script uses: the API's
file listing (`/api/models/REPO/tree/REV`, served in two pages joined by a `Link: rel="next"`
header, as the hub paginates) and `/REPO/resolve/REV/FILE` with byte ranges (what `curl -C -`
resumes with). It records every request, can cut a file's first transfer halfway, and the script
is pointed at it with K3_HF_ENDPOINT.

What is checked: a file whose sha256 is the listing's is accepted, one whose sha256 differs is
refused (exit 1, named), a file without an LFS hash whose size differs is refused (named); the
token is sent as a bearer header and never appears in the script's output; an interrupted
transfer resumes with a range request at the byte it reached, and so does a partial file left by
an earlier run; a second run downloads nothing and does not hash again, the listing saved by an earlier
run stands in when the hub's API is down (for that repository only), and a file changed on disk
afterwards is caught by --verify-only; a listing that names a path outside the destination
is refused before anything is written; once every shard is verified, `k3-manifest.json` records
the hub's sha256 of each (the model's content identity, docs/SPEC.md §6.11), and a download
verified by size only leaves no manifest behind.
"""
import hashlib
import http.server
import json
import os
import struct
import subprocess
import threading
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "download-model.sh"
REPO = "fake-org/fake-model"
TOKEN = "hf_SECRET_do_not_print_4242"


def blob(seed, n):
    out, h = b"", hashlib.sha256(str(seed).encode()).digest()
    while len(out) < n:
        h = hashlib.sha256(h).digest()
        out += h
    return out[:n]


class Hub:
    """Files and listing entries of one fake repository, served on 127.0.0.1."""

    def __init__(self, files, entries):
        self.files = files  # name -> bytes
        self.entries = entries  # the listing
        self.requests = []  # (path, Range header or None, Authorization header or None)
        self.cut_once = set()  # names whose next transfer stops halfway
        self.api_down = False  # the listing answers 503
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                u = urlparse(self.path)
                hub.requests.append((u.path, self.headers.get("Range"), self.headers.get("Authorization")))
                tree = f"/api/models/{REPO}/tree/main"
                resolve = f"/{REPO}/resolve/main/"
                if u.path == tree and hub.api_down:
                    self.send_error(503)
                elif u.path == tree:
                    page = parse_qs(u.query).get("cursor", ["0"])[0]
                    half = len(hub.entries) // 2
                    if page == "0":
                        body, link = hub.entries[:half], f'<{self.base()}{tree}?recursive=true&cursor=1>; rel="next"'
                    else:
                        body, link = hub.entries[half:], None
                    data = json.dumps(body).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    if link:
                        self.send_header("Link", link)
                    self.end_headers()
                    self.wfile.write(data)
                elif u.path.startswith(resolve) and u.path[len(resolve):] in hub.files:
                    name = u.path[len(resolve):]
                    self.send_file(name, hub.files[name])
                else:
                    self.send_error(404)

            def base(self):
                return f"http://127.0.0.1:{hub.port}"

            def send_file(self, name, data):
                start, rng = 0, self.headers.get("Range")
                if rng:
                    assert rng.startswith("bytes=") and rng.endswith("-"), rng
                    start = int(rng[6:-1])
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                body = data[start:]
                if name in hub.cut_once:
                    hub.cut_once.discard(name)
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def file_gets(self):
        return [(p.rsplit("/", 1)[1], r) for p, r, _ in self.requests if "/resolve/" in p]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def lfs_entry(name, data, sha=None):
    return {"type": "file", "path": name, "size": len(data), "oid": "0" * 40,
            "lfs": {"oid": sha or hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}


def plain_entry(name, size):
    return {"type": "file", "path": name, "size": size, "oid": "1" * 40}


@pytest.fixture
def hub():
    hubs = []

    def make(files, entries):
        h = Hub(files, entries)
        hubs.append(h)
        return h

    yield make
    for h in hubs:
        h.close()


def download(h, dest, *extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "K3_HF"))}
    env.update(K3_HF_ENDPOINT=f"http://127.0.0.1:{h.port}", HF_TOKEN=TOKEN, K3_DL_RETRY_DELAY="0")
    r = subprocess.run(["bash", str(SCRIPT), REPO, str(dest), *extra], capture_output=True, timeout=120, env=env)
    out = r.stdout.decode() + r.stderr.decode()
    assert TOKEN not in out, "the token was printed"
    return r.returncode, out


GOOD = blob(1, 300_000)
BAD = blob(2, 200_000)
CONFIG = b'{"model_type": "fake"}\n'


def test_good_file_verified_bad_sha256_and_bad_size_refused(hub, tmp_path):
    tok_cfg = b'{"x": 1}\n'
    files = {"good.bin": GOOD, "bad.bin": BAD, "config.json": CONFIG, "tokenizer_config.json": tok_cfg}
    entries = [lfs_entry("good.bin", GOOD), lfs_entry("bad.bin", BAD, sha=hashlib.sha256(b"other").hexdigest()),
               plain_entry("config.json", len(CONFIG)), plain_entry("tokenizer_config.json", len(tok_cfg) + 1),
               {"type": "directory", "path": "docs", "oid": "2" * 40, "size": 0}]
    h = hub(files, entries)
    rc, out = download(h, tmp_path)
    assert rc == 1, out
    failed = [ln.strip() for ln in out.split("VERIFY FAILED:")[1].splitlines() if ln.startswith("  ")]
    assert {ln.split(":")[0] for ln in failed} == {"bad.bin", "tokenizer_config.json"}, out
    assert any(ln.startswith("bad.bin: sha256 ") and "the hub says" in ln for ln in failed), out
    assert "tokenizer_config.json: 9 bytes, the hub says 10" in failed, out
    assert "good.bin: ok" in out, out
    assert "tokenizer_config.json: the hub has no bytes beyond 9" in out, out
    assert (tmp_path / "good.bin").read_bytes() == GOOD
    assert (tmp_path / "config.json").read_bytes() == CONFIG
    # Both pages of the listing were read, with the token as a bearer header.
    tree = [r for r in h.requests if "/api/models/" in r[0]]
    assert len(tree) == 2, tree
    assert all(auth == f"Bearer {TOKEN}" for _, _, auth in h.requests), h.requests
    # --verify-only from the saved listing refuses the same files, without the network.
    h.requests.clear()
    rc, out = download(h, tmp_path, "--verify-only")
    assert rc == 1 and "bad.bin: sha256" in out, out
    assert h.requests == [], "--verify-only went to the network although the listing was saved"


def test_interrupted_and_partial_downloads_resume(hub, tmp_path):
    files = {"good.bin": GOOD, "config.json": CONFIG, "second.bin": BAD}
    entries = [lfs_entry("good.bin", GOOD), plain_entry("config.json", len(CONFIG)), lfs_entry("second.bin", BAD)]
    h = hub(files, entries)
    h.cut_once.add("good.bin")
    # A partial file left by an earlier run that was stopped.
    (tmp_path / "second.bin").write_bytes(BAD[:12_345])
    rc, out = download(h, tmp_path)
    assert rc == 0, out
    assert (tmp_path / "good.bin").read_bytes() == GOOD
    assert (tmp_path / "second.bin").read_bytes() == BAD
    gets = h.file_gets()
    good = [r for n, r in gets if n == "good.bin"]
    # The first transfer stopped at half the file; the retry asked for the rest only.
    assert good == [None, f"bytes={len(GOOD) // 2}-"], gets
    assert [r for n, r in gets if n == "second.bin"] == ["bytes=12345-"], gets
    assert "resuming good.bin at byte 150000" in out, out
    assert "verified: 3 files (2 by sha256" in out, out


def test_a_second_run_downloads_and_hashes_nothing_and_verify_only_catches_a_change(hub, tmp_path):
    files = {"good.bin": GOOD, "config.json": CONFIG}
    h = hub(files, [lfs_entry("good.bin", GOOD), plain_entry("config.json", len(CONFIG))])
    rc, out = download(h, tmp_path)
    assert rc == 0, out
    h.requests.clear()
    rc, out = download(h, tmp_path)
    assert rc == 0, out
    assert h.file_gets() == [], "a complete, verified file was downloaded again"
    assert "good.bin: ok" not in out, "a verified file was hashed again"
    # The hub's API down: the listing saved by the first run is used, with a note.
    h.api_down = True
    rc, out = download(h, tmp_path)
    assert rc == 0, out
    assert "using the listing saved by an earlier run" in out and "2 files (1 by sha256" in out, out
    # ... but not for another repository's download into the same directory.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "K3_HF"))}
    env.update(K3_HF_ENDPOINT=f"http://127.0.0.1:{h.port}", K3_DL_RETRY_DELAY="0")
    r = subprocess.run(["bash", str(SCRIPT), "other/repo", str(tmp_path), "--verify-only"], capture_output=True,
                       timeout=60, env=env)
    assert r.returncode == 1 and b"verified" not in r.stdout, r
    h.api_down = False
    # One byte changed on disk (same size): --verify-only hashes it again and refuses it.
    p = tmp_path / "good.bin"
    data = bytearray(p.read_bytes())
    data[1000] ^= 1
    p.write_bytes(bytes(data))
    rc, out = download(h, tmp_path, "--verify-only")
    assert rc == 1, out
    assert "good.bin: sha256" in out.split("VERIFY FAILED:")[1], out


def test_a_listing_naming_a_path_outside_the_destination_is_refused(hub, tmp_path):
    evil = b"x" * 10
    h = hub({"../evil": evil}, [lfs_entry("../evil", evil), plain_entry("config.json", len(CONFIG))])
    dest = tmp_path / "dest"
    rc, out = download(h, dest)
    assert rc == 1, out
    assert "unsafe path" in out, out
    assert not (tmp_path / "evil").exists()
    assert h.file_gets() == []


def test_usage_errors_exit_2(tmp_path):
    for args in ([], ["a", "b", "c"], ["not a repo", str(tmp_path)], [str(tmp_path), "--bogus"]):
        r = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, timeout=30)
        assert r.returncode == 2, (args, r.stderr)


def shard(name_seed, n):
    """A valid safetensors file of one U8 tensor of n bytes."""
    header = json.dumps({f"t{name_seed}": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + blob(name_seed, n)


def test_the_manifest_records_the_hubs_sha256_of_every_shard_once_verified(hub, tmp_path):
    s1, s2 = shard(1, 5000), shard(2, 7000)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.dumps({"weight_map": {"t1": names[0], "t2": names[1]}}).encode()
    tok = b"tokens\n"
    files = {names[0]: s1, names[1]: s2, "config.json": CONFIG, "model.safetensors.index.json": index,
             "tiktoken.model": tok, "tokenizer_config.json": tok}
    entries = [lfs_entry(names[0], s1), lfs_entry(names[1], s2), plain_entry("config.json", len(CONFIG)),
               plain_entry("model.safetensors.index.json", len(index)), plain_entry("tiktoken.model", len(tok)),
               plain_entry("tokenizer_config.json", len(tok))]
    h = hub(files, entries)
    rc, out = download(h, tmp_path)
    assert rc == 0, out
    m = json.loads((tmp_path / "k3-manifest.json").read_text())
    assert m["format"] == 1 and REPO in m["source"], m
    assert m["shards"] == [
        {"file": names[0], "size": len(s1), "sha256": hashlib.sha256(s1).hexdigest()},
        {"file": names[1], "size": len(s2), "sha256": hashlib.sha256(s2).hexdigest()},
    ], m
    # A shard whose hub hash does not match: the download fails and no manifest is (re)written.
    (tmp_path / "k3-manifest.json").unlink()
    h.entries[1] = lfs_entry(names[1], s2, sha=hashlib.sha256(b"other").hexdigest())
    (tmp_path / ".k3-download" / "verified").unlink()
    rc, out = download(h, tmp_path)
    assert rc == 1 and not (tmp_path / "k3-manifest.json").exists(), out
    # Without the hub's listing (and none saved): sizes only, and a stale manifest is removed.
    h.entries[1] = lfs_entry(names[1], s2)
    assert download(h, tmp_path)[0] == 0
    assert (tmp_path / "k3-manifest.json").exists()
    (tmp_path / ".k3-download" / "manifest.json").unlink()
    h.api_down = True
    rc, out = download(h, tmp_path)
    assert rc == 0 and "verified by size only" in out, out
    assert not (tmp_path / "k3-manifest.json").exists(), out
    assert "no reference hashes" in out, out
