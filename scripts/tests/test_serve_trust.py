"""`k3-ctl serve` under the third trust probe (issue 47 items 2, 3, 4, 7, 8; issue 49 item 5), with
real processes: a `small` checkpoint, its packed trunk, a store, servers in front of it, raw
sockets and the `openai` package as clients. Each test failed on the code before its fix:

- a value that single precision turns into another (`top_p` 1e-300 → 0) is a 400 naming the
  field, never a worker's refusal (503); no numeric field of either API gives a 5xx;
- `Content-Length` with `Transfer-Encoding` is a 400 and the connection closes (RFC 9112 §6.1);
  a `Content-Encoding` other than identity is a 415, in the route's error shape;
- with the store gone every request (streamed or not) is 503 `store_unavailable` with
  `Retry-After` and no worker is started; a worker that cannot start is retried with a backoff;
- a stopped worker (`SIGSTOP`) is failed after the stall deadline (its requests get 503
  `worker_stalled`, streamed or not), killed and replaced; `/health` is 503 meanwhile;
- a worker's stderr never reaches a client, and session names are keyed per server;
- requests run in arrival order, and only a request that waits is told its queue place.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
import pytest

from test_openai_serve import (MODEL, PROMPT, ROOT, Server, assert_error_shape, binary, final_response,
                               http, log_since, raw, read_all, reaped, run, wait_for)


@pytest.fixture(scope="module")
def world():
    with tempfile.TemporaryDirectory(prefix="k3-trust-") as d:
        d = Path(d)
        model = d / "small"
        run([sys.executable, ROOT / "scripts" / "make-checkpoint.py", "--preset", "small", "--seed", "1", model])
        run([binary("k3-ctl"), "pack-trunk", model, d / "trunk"])
        env = dict(os.environ, XDG_RUNTIME_DIR=str(d / "xdg"))
        w = {"dir": d, "model": model, "trunk": d / "trunk", "env": env, "servers": [], "stores": []}
        w["sock"] = start_store(w, "main")
        try:
            w["main"] = serve(w, w["sock"], "main", "--max-jobs", "2", "--queue", "8")
            yield w
        finally:
            for s in w["servers"]:
                s.stop()
            for sock in w["stores"]:
                subprocess.run([str(binary("k3-ctl")), "stop", "--socket", str(sock)], capture_output=True, timeout=60)


def start_store(w, name):
    sock = w["dir"] / f"run-{name}" / "store.sock"
    run([binary("k3-store"), "start", w["model"], "--trunk", w["trunk"], "--preset", "laptop",
         "--socket", sock, "--detach"], env=w["env"])
    w["stores"].append(sock)
    return sock


def serve(w, sock, name, *extra):
    s = Server(sock, w["dir"] / f"serve-{name}.log", "--threads", "1", *extra)
    w["servers"].append(s)
    return s


def post(srv, path, payload, headers=None):
    h = {"Content-Type": "application/json", **(headers or {})}
    return http(srv, "POST", path, json.dumps(payload).encode(), h)


def completion(**kw):
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "temperature": 0, "reasoning_effort": "none", **kw}


def message(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "temperature": 0, **kw}


def anthropic_error(body):
    v = json.loads(body)
    assert v["type"] == "error" and set(v["error"]) == {"type", "message"}, v
    return v["error"]


# ---- issue 47 item 4: one validation of request values, single precision included


def test_values_single_precision_cannot_hold_are_400_naming_the_field(world):
    srv = world["main"]
    for field, value in [("top_p", 1e-300), ("temperature", 1e-300), ("top_p", 1e-40), ("temperature", 1e-39)]:
        for path, body in [("/v1/completions", completion(**{field: value})),
                           ("/v1/chat/completions", chat(**{field: value}))]:
            status, headers, got = post(srv, path, body)
            assert status == 400, (path, field, value, status, got)
            e = assert_error_shape(got)
            assert e["param"] == field and "single precision" in e["message"], e
            assert "Retry-After" not in headers
        status, _, got = post(srv, "/v1/messages", message(**{field: value}))
        assert status == 400, (field, value, got)
        e = anthropic_error(got)
        assert e["type"] == "invalid_request_error" and e["message"].startswith(field), e


NUMERIC = {
    "/v1/completions": (completion, ["max_tokens", "temperature", "top_p", "seed", "n", "best_of", "logprobs",
                                     "presence_penalty", "frequency_penalty"]),
    "/v1/chat/completions": (chat, ["max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n",
                                    "top_logprobs", "presence_penalty", "frequency_penalty"]),
    "/v1/messages": (message, ["max_tokens", "temperature", "top_p", "top_k"]),
}
EDGES = [1e-300, -1e-300, 1e-45, 1e300, -1.0, 0.5, 1e20, 2 ** 63, -(2 ** 63) - 1]


def test_no_numeric_value_of_either_api_is_a_server_fault(world):
    """Every numeric request field with values at the edges of f64, f32 and i64: a 200 or a 400
    (naming the field when the field is known), never a 5xx."""
    srv = world["main"]
    seen = []
    for path, (make, fields) in NUMERIC.items():
        for field in fields:
            for value in EDGES:
                status, _, got = post(srv, path, make(**{field: value}))
                seen.append((path, field, value, status))
                assert status in (200, 400), (path, field, value, status, got)
                if status == 400 and path != "/v1/messages":
                    param = json.loads(got)["error"]["param"]
                    assert param in (None, field), (path, field, value, got)
    print("measured:", sum(1 for s in seen if s[3] == 200), "accepted,", sum(1 for s in seen if s[3] == 400),
          "refused of", len(seen))


# ---- issue 47 item 8: HTTP framing (RFC 9112)


def exchange(port, data):
    s = raw(port, data, timeout=30)
    try:
        return final_response(read_all(s))
    finally:
        s.close()


def test_a_length_with_a_transfer_coding_is_400_and_the_connection_closes(world):
    srv = world["main"]
    body = json.dumps(completion()).encode()
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    for path, anthropic in [("/v1/completions", False), ("/v1/messages", True)]:
        payload = json.dumps(message() if anthropic else completion()).encode()
        chunked = f"{len(payload):x}\r\n".encode() + payload + b"\r\n0\r\n\r\n"
        for order in [(b"Content-Length: 3\r\n", b"Transfer-Encoding: chunked\r\n"),
                      (b"Transfer-Encoding: chunked\r\n", b"Content-Length: 3\r\n")]:
            got = exchange(srv.port, f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode() + order[0] + order[1]
                           + b"\r\n" + chunked + smuggled)
            head, _, rest = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400"), got
            assert b"connection: close" in head.lower(), head
            # One answer: nothing after the conflicting message was read as a request.
            assert got.count(b"HTTP/1.1 ") == 1, got
            if anthropic:
                assert "Content-Length" in anthropic_error(rest)["message"]
            else:
                assert_error_shape(rest, "bad_framing")
    # Either one alone is fine.
    got = exchange(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                   + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert got.startswith(b"HTTP/1.1 200"), got
    whole = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    got = exchange(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n" + whole)
    assert got.startswith(b"HTTP/1.1 200"), got


def test_an_encoded_body_is_415_in_the_routes_shape(world):
    import gzip
    srv = world["main"]
    for path, make, anthropic in [("/v1/completions", completion, False), ("/v1/chat/completions", chat, False),
                                  ("/v1/messages", message, True)]:
        body = gzip.compress(json.dumps(make()).encode())
        for coding in ["gzip", "br", "identity, gzip"]:
            status, headers, got = http(srv, "POST", path, body,
                                        {"Content-Type": "application/json", "Content-Encoding": coding})
            assert status == 415, (path, coding, status, got)
            assert headers["Accept-Encoding"] == "identity"
            if anthropic:
                assert "Content-Encoding" in anthropic_error(got)["message"]
            else:
                assert_error_shape(got, "unsupported_content_encoding")
        status, _, got = http(srv, "POST", path, json.dumps(make()).encode(),
                              {"Content-Type": "application/json", "Content-Encoding": "identity"})
        assert status == 200, got


# ---- issue 47 item 3: the store gone; worker starts back off


def sse(port, path, payload, headers=b"", timeout=120):
    """A streamed request on a raw socket: (status line, [(seconds, line)]) until the end."""
    body = json.dumps(payload).encode()
    s = raw(port, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n".encode()
            + headers + f"Content-Length: {len(body)}\r\n\r\n".encode() + body, timeout=timeout)
    t0 = time.monotonic()
    buf, lines = b"", []
    try:
        while True:
            try:
                c = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not c:
                break
            buf += c
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                lines.append((time.monotonic() - t0, line.decode(errors="replace").rstrip("\r")))
    finally:
        s.close()
    return lines[0][1] if lines else "", lines


def stream_error(lines):
    """The error of a stream's last events (OpenAI's `data: {"error"}`, Anthropic's `event: error`)."""
    for _, l in lines:
        if l.startswith("data: {") and '"error"' in l:
            v = json.loads(l[6:])
            return v["error"]
    return None


def worker_starts(log):
    return len(re.findall(r"worker pid \d+ started", log))


def test_with_the_store_gone_every_request_is_503_store_unavailable_and_no_worker_starts(world):
    sock = start_store(world, "gone")
    srv = serve(world, sock, "gone", "--max-jobs", "1")
    assert srv.client().completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1
    seen = srv.log_path.stat().st_size
    run([binary("k3-ctl"), "stop", "--socket", sock])
    cases = [("/v1/completions", completion()), ("/v1/chat/completions", chat()), ("/v1/messages", message()),
             ("/v1/completions", completion(max_tokens=3)), ("/v1/chat/completions", chat(max_tokens=2)),
             ("/v1/messages", message(max_tokens=2))]
    for path, body in cases:
        for stream in (False, True):
            status, headers, got = post(srv, path, dict(body, stream=stream))
            assert status == 503, (path, stream, status, got)
            assert int(headers["Retry-After"]) >= 1
            if path == "/v1/messages":
                assert anthropic_error(got)["type"] == "overloaded_error" or "store" in anthropic_error(got)["message"]
            else:
                assert_error_shape(got, "store_unavailable")
    log = log_since(srv.log_path, seen)
    assert worker_starts(log) == 0, log
    # The store back: served again at once (nothing backs off: no start failed).
    run([binary("k3-store"), "start", world["model"], "--trunk", world["trunk"], "--preset", "laptop",
         "--socket", sock, "--detach"], env=world["env"])
    r = srv.client().completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert r.usage.completion_tokens == 1


def test_a_worker_that_cannot_start_is_retried_with_a_backoff(world):
    broken = world["dir"] / "broken-worker"
    broken.write_text("#!/bin/sh\necho 'k3-worker: something private about job 12' >&2\nexit 1\n")
    broken.chmod(0o755)
    srv = serve(world, world["sock"], "backoff", "--worker", broken)
    statuses = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 4:
        status, headers, got = post(srv, "/v1/completions", completion())
        statuses.append((status, headers.get("Retry-After"), json.loads(got)["error"]))
        time.sleep(0.2)
    log = srv.log_path.read_text(errors="replace")
    starts = log.count("starting a worker")
    # Waits of 1, 2, 4 s: at most 3 starts in 4 s (the loop sent ~15 requests).
    assert 1 <= starts <= 3, (starts, len(statuses))
    assert len(statuses) >= 10
    for status, retry, e in statuses:
        assert status in (500, 503), (status, e)
        # The worker's own words stay in serve's log.
        assert "private" not in e["message"], e
        if status == 503:
            assert e["code"] == "worker_unavailable" and int(retry) >= 1, (status, retry, e)
    assert sum(1 for s in statuses if s[0] == 503) >= len(statuses) - starts
    assert "something private about job 12" in log
    status, _, got = http(srv, "GET", "/health")
    assert status == 503 and "start" in assert_error_shape(got, "worker_unhealthy")["message"], got


# ---- issue 47 item 2: a stopped worker is failed, killed and replaced


def worker_pid(srv, seen=0):
    m = re.findall(r"worker pid (\d+) started", log_since(srv.log_path, seen))
    return int(m[-1]) if m else None


def test_a_stopped_worker_is_failed_killed_and_replaced_and_health_says_so(world):
    srv = serve(world, world["sock"], "stall", "--max-jobs", "2", "--stall-timeout", "6")
    want = srv.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    pid = worker_pid(srv)
    assert pid
    assert http(srv, "GET", "/health")[0] == 200
    os.kill(pid, signal.SIGSTOP)
    try:
        out = {}
        t0 = time.monotonic()

        def whole():
            out["whole"] = post(srv, "/v1/completions", completion(max_tokens=4))
            out["whole_s"] = time.monotonic() - t0

        def streamed():
            out["stream"] = sse(srv.port, "/v1/chat/completions", chat(max_tokens=4, stream=True))
            out["stream_s"] = time.monotonic() - t0

        threads = [threading.Thread(target=f) for f in (whole, streamed)]
        for t in threads:
            t.start()
        # Unhealthy from half the deadline on, with the reason.
        status, got = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(http(srv, "GET", "/health")[::2]),
                               "/health to report the stalled worker", timeout=15)
        e = assert_error_shape(got, "worker_unhealthy")
        assert "no step progress" in e["message"] or "killed" in e["message"], e
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a request on the stopped worker hung"
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    status, headers, got = out["whole"]
    assert status == 503 and int(headers["Retry-After"]) >= 1, got
    assert "no step progress" in assert_error_shape(got, "worker_stalled")["message"]
    status_line, lines = out["stream"]
    assert status_line.startswith("HTTP/1.1 200"), lines
    e = stream_error(lines)
    assert e and e["code"] == "worker_stalled", lines
    assert lines[-1][1] == "" or "[DONE]" in "".join(l for _, l in lines[-3:]), lines
    assert 5 < out["whole_s"] < 30 and 5 < out["stream_s"] < 30, out
    wait_for(lambda: reaped(pid), "the stopped worker to be killed and reaped", timeout=10)
    # Replaced: a new worker, healthy again, the same answer.
    wait_for(lambda: worker_pid(srv) not in (None, pid), "a new worker", timeout=30)
    wait_for(lambda: http(srv, "GET", "/health")[0] == 200, "/health to recover", timeout=30)
    again = srv.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert again.choices[0].text == want


# ---- issue 47 item 7: a client's error carries only its own request's data


def test_a_killed_worker_relays_no_stderr_and_session_names_are_keyed(world):
    a = serve(world, world["sock"], "keyed-a", "--max-jobs", "2")
    # A store of its own: on a shared one, b would resume the prefix session a's job kept (sessions
    # are found by their ids, not their names) instead of naming a new one.
    b = serve(world, start_store(world, "keyed-b"), "keyed-b", "--max-jobs", "2")
    prompt = "A prompt whose session name must not confirm it: 4711"
    names = []
    for srv in (a, b):
        seen = srv.log_path.stat().st_size
        srv.client().completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        m = re.findall(r"new session (http-[0-9a-f]{16})", log_since(srv.log_path, seen))
        assert m, log_since(srv.log_path, seen)
        names.append(m[-1])
    # The same prompt, two servers: two keys, two names (an unkeyed hash gives one name to all).
    assert names[0] != names[1], names
    # Kill the worker under two running requests: each error says what happened to the worker,
    # and nothing the worker wrote (its lines name sessions and jobs).
    pid = worker_pid(a)
    out = []

    def one(seed):
        out.append(post(a, "/v1/completions", completion(max_tokens=4000, seed=seed, temperature=0.5)))

    threads = [threading.Thread(target=one, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    wait_for(lambda: log_since(a.log_path, 0).count("joined worker") >= 3, "both requests to join")
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert len(out) == 2
    for status, _, got in out:
        assert status >= 500, got
        msg = assert_error_shape(got)["message"]
        assert "http-" not in msg and "session" not in msg and "job " not in msg, msg
        assert "worker ended" in msg, msg


# ---- issue 49 item 5: first come, first served; told "queued" only when waiting


def first_data(lines):
    return next((t for t, l in lines if l.startswith("data: {") and '"error"' not in l), None)


def test_queued_requests_start_in_arrival_order_and_only_waiters_are_told(world):
    srv = serve(world, world["sock"], "fifo", "--max-jobs", "1", "--queue", "8")
    srv.client().completions.create(model=MODEL, prompt="warm", max_tokens=1)  # the worker is up
    results = {}

    def go(name, delay, n):
        time.sleep(delay)
        results[name] = (time.monotonic(), sse(srv.port, "/v1/completions",
                                               completion(prompt=f"{name} says", max_tokens=n, stream=True),
                                               headers=f"X-Request-Id: {name}\r\n".encode()))

    # Three at the same instant to an idle slot: one runs at once, two wait.
    threads = [threading.Thread(target=go, args=(f"burst{i}", 0, 24)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    told = {n: any(l.startswith(": queued") for _, l in r[1][1]) for n, r in results.items()}
    starts = {n: r[0] + first_data(r[1][1]) for n, r in results.items()}
    first = min(starts, key=starts.get)
    assert not told[first], (told, starts)
    assert sum(told.values()) == 2, told
    # Four sent 150 ms apart behind a long one: they start in the order they were sent.
    results.clear()
    names = ["long"] + [f"q{i}" for i in range(4)]
    threads = [threading.Thread(target=go, args=(n, 0.15 * k, 60 if n == "long" else 8)) for k, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    starts = {n: r[0] + first_data(r[1][1]) for n, r in results.items()}
    assert sorted(names, key=starts.get) == names, starts
    log = srv.log_path.read_text(errors="replace")
    joined = [m for m in re.findall(r"id=(q\d)[^\n]*joined worker", log)]
    assert joined == names[1:], joined
    assert not any(l.startswith(": queued") for _, l in results["long"][1][1])
    assert all(any(l.startswith(": queued") for _, l in results[n][1][1]) for n in names[1:])
