"""Two stores, each with its own `k3-ctl serve`, behind nginx with affinity by conversation.

This is the README's "Two machines behind a load balancer" on loopback: one `small` checkpoint
(real vocabulary) is generated, two stores are started on it (different sockets: two machines'
stores), a `k3-ctl serve` in front of each (different ports), and nginx from Debian's packages
(`scripts/test.sh` installs `nginx-light`) is run as a non-daemon child with
`scripts/lb/nginx.conf.in` rendered into a temporary run directory (pid, logs, temp files) on a
free loopback port. Requests go through the balancer with the official `openai` client, the
conversation named by the `X-Conversation-Id` header.

What is checked: the same conversation id always lands on the same backend, and different ids
reach both; which store ran each request is read from the stores themselves (`k3-ctl stats`: the
routed experts each store served), not only from the balancer's own `X-K3-Backend` header; greedy
answers (streamed and whole, chat and completions) through the balancer equal those of each
backend asked directly; a client that disconnects mid-stream through the balancer gets its job
cancelled (serve's one worker ends it and serves on).
Nothing here is skipped: a missing nginx, binary or package is a failure.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "scripts" / "lb" / "nginx.conf.in"
MODEL = "kimi-k3"
PROMPT = "The capital of France is"


def binary(name):
    p = Path(os.environ.get("K3_BIN_DIR", ROOT / "target" / "debug")) / name
    if not p.is_file():
        pytest.fail(f"{p} not built: run `cargo build --workspace --bins` (scripts/test.sh does) or set K3_BIN_DIR")
    return p


def nginx_binary():
    p = shutil.which("nginx") or next((c for c in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(c, os.X_OK)), None)
    if p is None:
        pytest.fail("nginx is not installed: `apt-get install nginx-light` (scripts/test.sh does)")
    return p


def run(args, **kw):
    r = subprocess.run([str(a) for a in args], capture_output=True, timeout=300, **kw)
    assert r.returncode == 0, f"{args} exited {r.returncode}: {r.stderr.decode(errors='replace')[-2000:]}"
    return r


def stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Serve:
    """A `k3-ctl serve` on an ephemeral loopback port in front of one store."""

    def __init__(self, sock, log):
        self.log = open(log, "w+b")
        self.proc = subprocess.Popen(
            [str(binary("k3-ctl")), "serve", "--socket", str(sock), "--listen", "127.0.0.1:0",
             "--threads", "1", "--max-jobs", "1", "--queue", "8"],
            stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL)
        line = self.proc.stdout.readline().decode()
        m = re.search(r"listening on http://(127\.0\.0\.1:\d+)", line)
        if not m:
            stop(self.proc)
            self.log.seek(0)
            pytest.fail(f"serve did not start: {line!r} {self.log.read().decode(errors='replace')}")
        self.addr = m.group(1)
        self.sock = sock

    def client(self):
        return openai.OpenAI(base_url=f"http://{self.addr}/v1", api_key="unused", max_retries=0, timeout=120)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    """nginx with the repository's template, in the foreground, as this process's child."""

    def __init__(self, rundir, backends):
        self.rundir = rundir
        rundir.mkdir()
        last = ""
        for _ in range(5):  # the free port may be taken between probing and binding
            self.port = free_port()
            conf = (TEMPLATE.read_text().replace("@LISTEN@", f"127.0.0.1:{self.port}")
                    .replace("@BACKEND_A@", backends[0]).replace("@BACKEND_B@", backends[1])
                    .replace("@RUNDIR@", str(rundir)))
            assert "@" not in re.sub(r"#.*", "", conf), "a placeholder of nginx.conf.in was left unreplaced"
            (rundir / "nginx.conf").write_text(conf)
            self.proc = subprocess.Popen(
                [nginx_binary(), "-p", str(rundir), "-c", str(rundir / "nginx.conf"), "-e", str(rundir / "error.log"),
                 "-g", "daemon off;"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(rundir / "stderr.log", "ab"))
            t0 = time.monotonic()
            while time.monotonic() - t0 < 20 and self.proc.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    self.url = f"http://127.0.0.1:{self.port}"
                    return
                except OSError:
                    time.sleep(0.05)
            stop(self.proc)
            last = (rundir / "stderr.log").read_text(errors="replace") + self.error_log()
            if "Address already in use" not in last:
                break
        pytest.fail(f"nginx did not start: {last[-3000:]}")

    def error_log(self):
        p = self.rundir / "error.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def client(self, conversation=None):
        headers = {"X-Conversation-Id": conversation} if conversation is not None else None
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                             default_headers=headers)


@pytest.fixture(scope="module")
def world(small_model):
    with tempfile.TemporaryDirectory(prefix="k3-lb-") as d:
        d = Path(d)
        model = small_model
        env = dict(os.environ, XDG_RUNTIME_DIR=str(d / "xdg"))
        socks = [d / "machine-a" / "store.sock", d / "machine-b" / "store.sock"]
        started, serves, nginx = [], [], None
        try:
            for s in socks:
                # No --trunk: each store reads the trunk from the shards.
                run([binary("k3-store"), "start", model, "--preset", "laptop", "--socket", s, "--detach"], env=env)
                started.append(s)
            for i, s in enumerate(socks):
                serves.append(Serve(s, d / f"serve-{'ab'[i]}.log"))
            nginx = Nginx(d / "nginx", [s.addr for s in serves])
            yield {"dir": d, "serves": serves, "nginx": nginx, "env": env}
        finally:
            if nginx is not None:
                stop(nginx.proc)
            for s in serves:
                stop(s.proc)
            for s in started:
                subprocess.run([str(binary("k3-ctl")), "stop", "--socket", str(s)], capture_output=True, timeout=60)


def backend_of(nginx, conversation):
    """The backend nginx picks for a conversation, from a cheap request (no worker runs)."""
    raw = nginx.client(conversation).models.with_raw_response.list()
    assert [m.id for m in raw.parse()] == [MODEL]
    return raw.headers["X-K3-Backend"]


def one_conversation_per_backend(nginx, prefix):
    """{backend address: the first conversation id nginx sends there}."""
    convs = {}
    for i in range(200):
        convs.setdefault(backend_of(nginx, f"{prefix}-{i}"), f"{prefix}-{i}")
        if len(convs) == 2:
            return convs
    pytest.fail(f"200 conversation ids all went to {set(convs)}")


def experts_served(serve):
    """Routed experts the store behind `serve` has served in its lifetime (k3-ctl stats)."""
    r = run([binary("k3-ctl"), "stats", "--json", "--socket", serve.sock])
    return json.loads(r.stdout)["lifetime"]["requests"]


def test_a_conversation_sticks_to_one_backend_and_conversations_spread(world):
    nginx, serves = world["nginx"], world["serves"]
    addrs = {s.addr for s in serves}
    picks = {}
    for i in range(24):
        cid = f"conversation-{i}"
        seen = {backend_of(nginx, cid) for _ in range(3)}
        assert len(seen) == 1, f"{cid} went to {seen}"
        picks[cid] = seen.pop()
        assert picks[cid] in addrs, picks[cid]
    assert set(picks.values()) == addrs, f"24 conversations all went to {set(picks.values())}"
    # The access log agrees with the header.
    log = (nginx.rundir / "access.log").read_text()
    for cid, addr in picks.items():
        lines = [ln for ln in log.splitlines() if f'conversation="{cid}"' in ln]
        assert len(lines) == 3 and all(f"upstream={addr} " in ln for ln in lines), lines


def test_the_stores_themselves_ran_the_requests_of_their_conversations(world):
    """(a) both backends run requests, (b) each conversation's every request on one store: counted
    on the stores (k3-ctl stats: the routed experts each served), not on the balancer."""
    nginx, serves = world["nginx"], world["serves"]
    convs = one_conversation_per_backend(nginx, "chat")
    per_backend = 3
    for addr, cid in convs.items():
        before = {s.addr: experts_served(s) for s in serves}
        c = nginx.client(cid)
        for _ in range(per_backend):
            raw = c.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
            assert raw.headers["X-K3-Backend"] == addr
            assert raw.parse().usage.completion_tokens >= 1
        for s in serves:
            grew = experts_served(s) - before[s.addr]
            if s.addr == addr:
                assert grew > 0, f"the store behind {addr} served no expert for its conversation"
            else:
                assert grew == 0, f"the store behind {s.addr} served {grew} experts of {addr}'s conversation"


def completion(client, stream):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.text
            finish = ch.finish_reason or finish
    return text, finish


def chat(client, stream):
    kw = dict(model=MODEL, max_tokens=6, temperature=0, messages=[{"role": "user", "content": "What is 2+2?"}],
              extra_body={"thinking": {"type": "disabled"}})
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, finish


def test_greedy_answers_through_the_balancer_equal_each_backends(world):
    nginx, serves = world["nginx"], world["serves"]
    want_completion = completion(serves[0].client(), stream=False)
    want_chat = chat(serves[0].client(), stream=False)
    assert want_completion[0], "the backend answered with no text"
    # Both stores hold the same model: the other backend answers the same.
    assert completion(serves[1].client(), stream=False) == want_completion
    assert chat(serves[1].client(), stream=False) == want_chat
    # One conversation on each backend, through the balancer.
    convs = one_conversation_per_backend(nginx, "greedy")
    for cid in convs.values():
        c = nginx.client(cid)
        for stream in (False, True):
            assert completion(c, stream) == want_completion, (cid, stream)
            assert chat(c, stream) == want_chat, (cid, stream)
    # Without a conversation id the request is still served.
    assert completion(nginx.client(), stream=False) == want_completion


def serve_requests(serve):
    """The requests `serve` holds (running and queued), from its listing (`k3-ctl ps --json`)."""
    r = run([binary("k3-ctl"), "ps", "--json", "--socket", serve.sock])
    listings = json.loads(r.stdout)["servers"]
    return [q for l in listings if l["pid"] == serve.proc.pid for q in l["requests"]]


def cancelled_jobs(serve):
    """How many cancelled jobs serve's worker has ended (its log)."""
    return Path(serve.log.name).read_text(errors="replace").count("ended its cancelled job")


def test_a_client_that_disconnects_through_the_balancer_cancels_its_job(world):
    nginx, serves = world["nginx"], world["serves"]
    cid = "disconnects"
    serve = next(s for s in serves if s.addr == backend_of(nginx, cid))
    cancelled = cancelled_jobs(serve)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4096, "temperature": 0, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", nginx.port), timeout=120)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"X-Conversation-Id: {cid}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while b"data: " not in got:
        chunk = s.recv(4096)
        assert chunk, f"connection closed before the first event: {got!r}"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got
    assert serve_requests(serve), "no request on the conversation's server while it streams"
    s.close()
    t0 = time.monotonic()
    while serve_requests(serve) or cancelled_jobs(serve) == cancelled:
        assert time.monotonic() - t0 < 30, "the job still runs 30 s after the client went away"
        time.sleep(0.1)
    # The worker serves on: the next request through the balancer is answered.
    r = nginx.client(cid).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_a_backend_that_cannot_be_reached_is_skipped(world):
    """A machine that is down (nothing listens on its port) is skipped for the next one, even for
    a POST (nginx retries only requests it could not send), and the answer is the live one's."""
    live = world["serves"][0]
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    nginx = Nginx(world["dir"] / "nginx-failover", [live.addr, dead])
    try:
        tried_dead = 0
        for i in range(16):
            raw = nginx.client(f"failover-{i}").models.with_raw_response.list()
            assert [m.id for m in raw.parse()] == [MODEL]
            path = [a.strip() for a in raw.headers["X-K3-Backend"].split(",")]
            assert path[-1] == live.addr, path
            tried_dead += dead in path
        assert tried_dead, "no conversation was hashed to the dead backend first: the test proves nothing"
        raw = nginx.client("failover-post").completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
        assert raw.headers["X-K3-Backend"].split(",")[-1].strip() == live.addr
        assert raw.parse().usage.completion_tokens >= 1
    finally:
        stop(nginx.proc)
