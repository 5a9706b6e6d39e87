"""`k3-ctl serve` end to end, with the official `openai` package as the client.

A `small` checkpoint (real vocabulary, so text round-trips) is generated once per module, its
trunk packed, a store started on it, and two servers put in front of it: the main one and a
cramped one (one job, no queue, 4 KiB bodies) for the 429 and 413 checks. The binaries are the
built ones in `target/debug/` (override the directory with K3_BIN_DIR); `scripts/test.sh` builds
them first. Nothing here is skipped: a missing binary or package is a failure.

What is checked: streamed and whole answers give the same text (greedy and seeded sampling),
and that text is the worker's own ids detokenized; `usage` equals the tokenizer's counts (the
chat prompt as the XTML rendering, independently tokenized); `stop` cuts the text before the
stop string; `max_tokens` gives finish_reason "length"; a client that disconnects (streaming or
not) gets its job cancelled at a step boundary while the server's one worker serves on; a full
queue answers 429 with Retry-After; an oversized body 413; malformed JSON 400, unknown routes and
models 404, all in the OpenAI error shape.

And the operator's side (issues 34 and 35): slow clients cannot stall the server (caps per
address with room made, head and body deadlines, idle timeout); a client that pipelined its
request and closed, or closed mid-stream, gets its job cancelled, a half-closed one gets its
answer; a retried request resumes from the prefill the cancelled one kept
(`usage.prompt_tokens_details.cached_tokens`); queueing is reported (`k3-ctl ps`, a streamed
request's first bytes at once); `/metrics` parses as OpenMetrics; the API key and CORS paths;
`X-Request-Id`; Ctrl-C ends serve promptly.
"""
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
TOK = ROOT / "fixtures" / "tokenizer"
MODEL = "kimi-k3"
END_IDS = (163585, 163586)


def binary(name):
    p = Path(os.environ.get("K3_BIN_DIR", ROOT / "target" / "debug")) / name
    if not p.is_file():
        pytest.fail(f"{p} not built: run `cargo build --workspace --bins` (scripts/test.sh does) or set K3_BIN_DIR")
    return p


def run(args, **kw):
    r = subprocess.run([str(a) for a in args], capture_output=True, timeout=300, **kw)
    assert r.returncode == 0, f"{args} exited {r.returncode}: {r.stderr.decode(errors='replace')[-2000:]}"
    return r


class Server:
    """A `k3-ctl serve` process on an ephemeral loopback port."""

    def __init__(self, sock, log, *extra, env=None):
        self.log_path = log
        self.log = open(log, "w+b")
        self.proc = subprocess.Popen(
            [str(binary("k3-ctl")), "serve", "--socket", str(sock), "--listen", "127.0.0.1:0", *extra],
            stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL, env=env)
        line = self.proc.stdout.readline().decode()
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if not m:
            self.stop()
            self.log.seek(0)
            pytest.fail(f"serve did not start: {line!r} {self.log.read().decode(errors='replace')}")
        self.port = int(m.group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def world(small_model):
    with tempfile.TemporaryDirectory(prefix="k3-serve-") as d:
        d = Path(d)
        model = small_model
        run([binary("k3-ctl"), "pack-trunk", model, d / "trunk"])
        sock = d / "run" / "store.sock"
        env = dict(os.environ, XDG_RUNTIME_DIR=str(d / "xdg"))
        run([binary("k3-store"), "start", model, "--trunk", d / "trunk", "--preset", "laptop",
             "--socket", sock, "--detach"], env=env)
        servers = []
        try:
            # A generous grace: on a loaded machine one 512-id prefill chunk can take half a minute,
            # and the tests check that a cancelled job ends by itself, not by killing the worker.
            main = Server(sock, d / "serve-main.log", "--max-jobs", "1", "--queue", "4", "--threads", "1",
                          "--cancel-grace", "120")
            servers.append(main)
            cramped = Server(sock, d / "serve-cramped.log", "--max-jobs", "1", "--queue", "0",
                             "--max-body", "4096", "--threads", "1")
            servers.append(cramped)
            (d / "key").write_text(KEY + "\n")
            keyed = Server(sock, d / "serve-keyed.log", "--max-jobs", "1", "--threads", "1",
                           "--api-key-file", d / "key", "--cors-origin", ORIGIN)
            servers.append(keyed)
            tight = Server(sock, d / "serve-tight.log", "--max-jobs", "1", "--threads", "1",
                           "--request-timeout", "2", "--idle-timeout", "3")
            servers.append(tight)
            yield {"dir": d, "sock": sock, "main": main, "cramped": cramped, "keyed": keyed, "tight": tight,
                   "env": env, "model": model, "trunk": d / "trunk"}
        finally:
            for s in servers:
                s.stop()
            subprocess.run([str(binary("k3-ctl")), "stop", "--socket", str(sock)], capture_output=True, timeout=60)


KEY = "k3-test-key-0123456789"
ORIGIN = "https://app.example"


def tokenize(text, special=False):
    r = run([binary("k3-ctl"), "tokenize", "--tok", TOK, "--text", text, *(["--allow-special"] if special else [])])
    line = r.stdout.decode().strip()
    return [int(x) for x in line.split(",")] if line else []


def detokenize(ids):
    return run([binary("k3-ctl"), "detokenize", "--tok", TOK, "--ids", ",".join(map(str, ids))]).stdout


def worker_ids(world, prompt_ids, n, *extra):
    """The worker's own ids for a prompt (attached to the same store)."""
    r = run([binary("k3-worker"), "--socket", world["sock"], "--ids", ",".join(map(str, prompt_ids)),
             "--gen", str(n), "--threads", "1", *extra], env=world["env"])
    return [int(x) for x in r.stdout.decode().split()]


def expected_completion(world, prompt_ids, n, *extra):
    ids = worker_ids(world, prompt_ids, n, *extra)
    if ids and ids[-1] in END_IDS:
        return detokenize(ids[:-1]).decode("utf-8", errors="replace"), "stop", len(ids)
    return detokenize(ids).decode("utf-8", errors="replace"), "length", len(ids)


def stream_completion(client, **kw):
    text, finish, usage = "", None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            if c.finish_reason is not None:
                finish = c.finish_reason
    return text, finish, usage


def stream_chat(client, **kw):
    content, reasoning, finish, usage, roles = "", "", None, None, []
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            content += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            if c.finish_reason is not None:
                finish = c.finish_reason
    return content, reasoning, finish, usage, roles


PROMPT = "The capital of France is"


def test_models_lists_the_served_id(world):
    c = world["main"].client()
    assert [m.id for m in c.models.list()] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")


def test_completion_is_the_workers_ids_streamed_or_not(world):
    c = world["main"].client()
    prompt_ids = tokenize(PROMPT)
    want_text, want_finish, want_n = expected_completion(world, prompt_ids, 12)
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == want_text
    assert r.choices[0].finish_reason == want_finish
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), want_n)
    assert r.usage.total_tokens == len(prompt_ids) + want_n
    text, finish, usage = stream_completion(c, model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert (text, finish) == (want_text, want_finish)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), want_n)
    # Token ids as the prompt give the same answer.
    r2 = c.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == want_text


def test_max_tokens_ends_with_length(world):
    c = world["main"].client()
    ids = worker_ids(world, tokenize(PROMPT), 3)
    assert not any(i in END_IDS for i in ids), "pick another prompt: the model ends within 3 ids"
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    _, finish, usage = stream_completion(c, model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert (finish, usage.completion_tokens) == ("length", 3)


def test_seeded_sampling_is_the_workers_and_repeats(world):
    c = world["main"].client()
    prompt_ids = tokenize(PROMPT)
    want_text, _, _ = expected_completion(world, prompt_ids, 10, "--temperature", "0.9", "--top-p", "0.95",
                                          "--seed", "7")
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.9, top_p=0.95, seed=7)
    assert c.completions.create(**kw).choices[0].text == want_text
    assert stream_completion(c, **kw)[0] == want_text
    # The seed is passed through: another seed draws another text.
    assert c.completions.create(**dict(kw, seed=8)).choices[0].text != want_text


def test_stop_cuts_before_the_stop_text(world):
    c = world["main"].client()
    full = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    assert len(full) >= 8, full
    # A stop string from the middle of the text (its first occurrence decides).
    stop = full[len(full) // 2: len(full) // 2 + 3]
    want = full[: full.find(stop)]
    for stops in (stop, ["\u2603 never", stop]):
        r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stops)
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens < 16
        text, finish, _ = stream_completion(c, model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stops)
        assert (text, finish) == (want, "stop")


def xtml_prompt(messages, effort=None):
    """The generation prompt as text with the markers spelled out (tokenized with specials on)."""
    s = ""
    if effort:
        body = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
                "response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the "
                f"system is invoked with `thinking_effort={effort}`.")
        s += f'<|open|>message role="system" type="thinking-effort"<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>'
    for role, text, *reasoning in messages:
        s += f'<|open|>message role="{role}"<|sep|>'
        if role == "assistant":
            if effort:
                s += f"<|open|>think<|sep|>{reasoning[0] if reasoning else ''}<|close|>think<|sep|>"
            s += f"<|open|>response<|sep|>{text}<|close|>response<|sep|>"
        else:
            s += text
        s += "<|close|>message<|sep|><|end_of_msg|>"
    s += '<|open|>message role="assistant"<|sep|>'
    s += "<|open|>think<|sep|>" if effort else "<|open|>response<|sep|>"
    return s


def test_chat_without_thinking(world):
    c = world["main"].client()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    prompt_ids = tokenize(xtml_prompt([("system", "Be brief."), ("user", "What is 2+2?")]), special=True)
    kw = dict(model=MODEL, messages=msgs, max_tokens=10, temperature=0, extra_body={"thinking": {"type": "disabled"}})
    r = c.chat.completions.create(**kw)
    m = r.choices[0].message
    assert m.role == "assistant"
    assert "reasoning_content" not in (m.model_extra or {})
    assert r.usage.prompt_tokens == len(prompt_ids)
    # The reply is the worker's ids for the same rendering: with no markers generated, all of
    # it is the response channel.
    ids = worker_ids(world, prompt_ids, 10)
    text_ids = [i for i in ids if i not in END_IDS]
    assert all(i < 163584 for i in text_ids), f"the model generated a marker: pick another prompt {ids}"
    assert m.content == detokenize(text_ids).decode("utf-8", errors="replace")
    assert r.usage.completion_tokens == len(ids)
    content, reasoning, finish, usage, roles = stream_chat(c, **kw)
    assert (content, reasoning, finish) == (m.content, "", r.choices[0].finish_reason)
    assert roles == ["assistant"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)
    # `stop` cuts the content before the stop text, streamed or not.
    full = m.content
    assert len(full) >= 6, full
    stop = full[len(full) // 2: len(full) // 2 + 2]
    r = c.chat.completions.create(**kw, stop=[stop])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (full[: full.find(stop)], "stop")
    content, _, finish, _, _ = stream_chat(c, **kw, stop=stop)
    assert (content, finish) == (full[: full.find(stop)], "stop")


def test_multi_turn_chat_renders_like_the_xtml_template(world):
    c = world["main"].client()
    turns = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello! \"Quoted\" & more", "they greet"),
             ("user", "Sum 2+2 <|open|> literally")]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": 'Hello! "Quoted" & more', "reasoning_content": "they greet"},
            {"role": "user", "content": [{"type": "text", "text": "Sum 2+2 "}, {"type": "text", "text": "<|open|> literally"}]}]
    for extra, effort in (({"thinking": {"type": "disabled"}}, None), ({"reasoning_effort": "medium"}, "medium")):
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0, extra_body=extra)
        # The user's typed "<|open|>" is text, not the marker: tokenize those parts without specials.
        text = xtml_prompt([t if t[0] != "user" or "<|" not in t[1] else (t[0], "\0") for t in turns], effort=effort)
        before, after = text.split("\0")
        want = tokenize(before, special=True) + tokenize("Sum 2+2 <|open|> literally") + tokenize(after, special=True)
        assert r.usage.prompt_tokens == len(want), extra
        assert r.usage.completion_tokens == 1


def test_chat_with_thinking(world):
    c = world["main"].client()
    msgs = [{"role": "user", "content": "Hi"}]
    for extra, effort in (({}, "low"), ({"reasoning_effort": "max"}, "max"),
                          ({"thinking": {"type": "enabled"}, "reasoning_effort": "high"}, "high")):
        prompt_ids = tokenize(xtml_prompt([("user", "Hi")], effort=effort), special=True)
        kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0, extra_body=extra)
        r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        assert r.usage.prompt_tokens == len(prompt_ids), extra
        reasoning = (m.model_extra or {}).get("reasoning_content")
        assert isinstance(reasoning, str)
        ids = worker_ids(world, prompt_ids, 8)
        # No marker generated (checked): the model would think on. The default thinking budget
        # (half of max_tokens) ends the thinking after 4 ids; the closing ids the worker forces
        # then fill the rest of the 8.
        assert all(i < 163584 for i in ids), f"the model generated a marker: pick another prompt {ids}"
        assert reasoning == detokenize(ids[:4]).decode("utf-8", errors="replace")
        assert r.usage.completion_tokens_details.reasoning_tokens == 4
        assert m.content == ""
        assert r.choices[0].finish_reason == "length"
        content, s_reasoning, finish, usage, _ = stream_chat(c, **kw)
        assert (content, s_reasoning, finish) == (m.content, reasoning, r.choices[0].finish_reason)
        assert usage.completion_tokens == r.usage.completion_tokens


# ---- raw HTTP: errors, limits, disconnects


def http(server, method, path, body=None, headers=None):
    req = urllib.request.Request(server.url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def assert_error_shape(body, code=None):
    e = json.loads(body)["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    assert isinstance(e["message"], str) and e["message"]
    if code is not None:
        assert e["code"] == code, e
    return e


def test_a_request_that_extends_a_kept_conversation_resumes_it(world):
    """The first request's state is kept in the store; a second request whose ids extend it
    runs under that session (prefilling only the new ids) and answers exactly what a full
    prefill of the whole prompt answers."""
    c = world["main"].client()
    log = world["dir"] / "serve-main.log"
    p1 = tokenize("Once upon a time, in a quiet village,")
    g1 = worker_ids(world, p1, 4)
    r1 = c.completions.create(model=MODEL, prompt=p1, max_tokens=4, temperature=0)
    assert r1.usage.completion_tokens == len(g1)
    p2 = p1 + g1 + tokenize(" and then")
    want_text, want_finish, want_n = expected_completion(world, p2, 6)
    seen = log.stat().st_size
    r2 = c.completions.create(model=MODEL, prompt=p2, max_tokens=6, temperature=0)
    assert (r2.choices[0].text, r2.choices[0].finish_reason) == (want_text, want_finish)
    assert r2.usage.completion_tokens == want_n
    with open(log, "rb") as f:
        f.seek(seen)
        tail = f.read().decode(errors="replace")
    held = len(p1) + len(g1) - 1  # every generated id but the last was fed
    assert f"resuming session http-" in tail and f"({held} ids held)" in tail, tail
    sessions = json.loads(run([binary("k3-ctl"), "sessions", "--json", "--socket", world["sock"]]).stdout)
    assert any(s["ids"] == len(p2) + want_n - 1 for s in sessions), sessions


def test_malformed_json_is_400_in_the_openai_shape(world):
    for path in ("/v1/chat/completions", "/v1/completions"):
        status, _, body = http(world["main"], "POST", path, b'{"model": "kimi-k3", "prompt": ', {"Content-Type": "application/json"})
        assert status == 400
        assert assert_error_shape(body)["type"] == "invalid_request_error"
    status, _, body = http(world["main"], "POST", "/v1/completions",
                           json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode())
    assert status == 400 and assert_error_shape(body)["param"] == "max_tokens"
    c = world["main"].client()
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="x", n=2)


def test_unknown_route_and_model_are_404(world):
    status, _, body = http(world["main"], "GET", "/v1/nothing")
    assert status == 404
    assert_error_shape(body, "unknown_url")
    status, _, body = http(world["main"], "POST", "/v1/completions",
                           json.dumps({"model": "gpt-4o", "prompt": "x"}).encode())
    assert status == 404
    assert_error_shape(body, "model_not_found")
    status, _, body = http(world["main"], "GET", "/v1/completions")
    assert status == 405
    assert_error_shape(body)


def test_oversized_body_is_413_and_huge_headers_are_refused(world):
    big = json.dumps({"model": MODEL, "prompt": "x" * 8000}).encode()
    status, _, body = http(world["cramped"], "POST", "/v1/completions", big)
    assert status == 413
    assert_error_shape(body, "request_too_large")
    with pytest.raises(openai.APIStatusError) as e:
        world["cramped"].client().completions.create(model=MODEL, prompt="y" * 8000, max_tokens=1)
    assert e.value.status_code == 413
    status, _, _ = http(world["main"], "GET", "/v1/models", headers={"X-Big": "a" * 20000})
    assert status == 431


def open_stream(server, payload):
    """Send a streamed request on a raw socket; return it once the first event arrived."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=120)
    body = json.dumps(payload).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while b"data: " not in got:
        chunk = s.recv(4096)
        assert chunk, f"connection closed before the first event: {got!r}"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got
    return s


def live_worker_pids(world):
    r = run([binary("k3-ctl"), "stats", "--json", "--socket", world["sock"]])
    jobs = json.loads(r.stdout)["jobs"]
    return [int(re.search(r"pid (\d+)", j["label"]).group(1)) for j in jobs
            if j["live"] and "k3-worker" in j["label"]]


def wait_for(cond, what, timeout=30):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def reaped(pid):
    return not Path(f"/proc/{pid}").exists()  # a zombie (not reaped) still has /proc/PID


LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4096, "temperature": 0}


def server_worker(srv, seen=0):
    """The pid of the worker a server's requests joined (from its log since `seen`), if any."""
    m = re.findall(r"joined worker pid (\d+)", log_since(srv.log_path, seen))
    return int(m[-1]) if m else None


def cancelled_jobs(srv, seen):
    """How many cancelled jobs the server's worker ended since `seen`."""
    return log_since(srv.log_path, seen).count("ended its cancelled job")


def test_a_disconnect_mid_stream_cancels_the_job_and_the_worker_serves_on(world):
    srv = world["main"]
    seen = srv.log_path.stat().st_size
    s = open_stream(srv, dict(LONG, stream=True))
    pid = wait_for(lambda: server_worker(srv, seen), "the job to join the worker")
    s.close()
    wait_for(lambda: cancelled_jobs(srv, seen) == 1, "the cancelled job to end")
    assert "killed" not in log_since(srv.log_path, seen)
    assert not reaped(pid), "the worker serves on"
    # The next request runs in the same worker.
    seen = srv.log_path.stat().st_size
    r = srv.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert server_worker(srv, seen) == pid


def test_a_disconnect_during_the_prefill_ends_the_job_at_a_step_boundary(world):
    """Before its first token the worker writes nothing for seconds (a 1500-id prefill): the
    disconnect is noticed anyway, and the worker, told to cancel, ends the job at its next
    prefill chunk by itself (it would be killed only after serve's grace)."""
    for stream in (False, True):
        prompt = [1000 + (i * 7919 + 13 * stream) % 90000 for i in range(1500)]
        log = world["main"].log_path
        seen = log.stat().st_size
        s = socket.create_connection(("127.0.0.1", world["main"].port), timeout=60)
        body = json.dumps(dict(LONG, prompt=prompt, stream=stream, seed=int(stream))).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: server_worker(world["main"], seen), "the job to join the worker")
        t0 = time.monotonic()
        s.close()
        wait_for(lambda: cancelled_jobs(world["main"], seen) == 1, "the cancelled job to end", timeout=60)
        took = time.monotonic() - t0
        tail = log_since(log, seen)
        assert "killed" not in tail, tail
        print(f"measured: stream={stream}: the job ended {took:.1f} s after the disconnect")


def log_since(path, offset):
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def test_a_full_queue_answers_429_with_retry_after(world):
    cramped = world["cramped"]
    s = open_stream(cramped, dict(LONG, stream=True))
    try:
        status, headers, body = http(cramped, "POST", "/v1/completions",
                                     json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode())
        assert status == 429
        assert int(headers["Retry-After"]) >= 1
        assert_error_shape(body, "queue_full")
        with pytest.raises(openai.RateLimitError):
            cramped.client().completions.create(model=MODEL, prompt="x", max_tokens=1)
    finally:
        s.close()
    # The place is freed with the cancelled job: the next request runs.
    def served():
        try:
            return cramped.client().completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
        except openai.RateLimitError:
            return None
    r = wait_for(served, "the slot to be freed")
    assert r.usage.completion_tokens >= 1


def test_a_store_that_goes_down_gives_503_and_serve_exits_cleanly(world):
    d = world["dir"]
    sock2 = d / "run2" / "store.sock"
    run([binary("k3-store"), "start", world["model"], "--trunk", world["trunk"], "--preset", "laptop",
         "--socket", sock2, "--detach"], env=world["env"])
    srv = Server(sock2, d / "serve-down.log", "--threads", "1")
    try:
        r = srv.client().completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert r.usage.completion_tokens == 1
        run([binary("k3-ctl"), "stop", "--socket", sock2])
        status, headers, body = http(srv, "POST", "/v1/completions",
                                     json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode())
        assert status == 503, body
        assert_error_shape(body, "store_unavailable")
        assert int(headers["Retry-After"]) >= 1
        assert http(srv, "GET", "/health")[0] == 503
        with pytest.raises(openai.InternalServerError):
            srv.client().models.list()
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, "SIGTERM should stop serve with exit 0"
    # Without a store, serve refuses to start: exit 3.
    r = subprocess.run([str(binary("k3-ctl")), "serve", "--socket", str(sock2), "--listen", "127.0.0.1:0"],
                       capture_output=True, timeout=60)
    assert r.returncode == 3, r


# ---- issue 34: slow and vanished clients


def raw(port, data, source="127.0.0.1", timeout=60):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))
    if data:
        s.sendall(data)
    return s


def read_all(s):
    got = b""
    while True:
        try:
            c = s.recv(65536)
        except (ConnectionResetError, TimeoutError, socket.timeout):
            break
        if not c:
            break
        got += c
    return got


def final_response(got):
    """The final response of a raw exchange, after any interim 1xx responses."""
    while got.startswith(b"HTTP/1.1 1"):
        got = got[got.index(b"\r\n\r\n") + 4:]
    return got


def test_slow_clients_cannot_keep_a_fresh_request_out(world):
    """300 connections that send their headers and then trickle their body (from another
    address, then from the same one), more than the server's 256-connection cap: a fresh
    request is still answered within seconds (before: unreachable for as long as they stay)."""
    srv = world["main"]
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"
    for source in ("127.0.0.2", "127.0.0.1"):
        slow = [raw(srv.port, head, source=source) for _ in range(300)]
        try:
            time.sleep(0.5)
            t0 = time.monotonic()
            status, _, body = http(srv, "GET", "/health")
            took = time.monotonic() - t0
            assert status == 200, body
            assert took < 10, f"a fresh request waited {took:.1f} s behind slow clients from {source}"
            print(f"measured: /health answered in {took:.3f} s with 300 slow connections from {source}")
        finally:
            for c in slow:
                c.close()


def test_slow_bodies_get_408_and_idle_connections_close(world):
    srv = world["tight"]  # --request-timeout 2 --idle-timeout 3
    s = raw(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    t0 = time.monotonic()
    got = read_all(s)
    took = time.monotonic() - t0
    assert got.startswith(b"HTTP/1.1 408"), got
    assert_error_shape(got[got.index(b"\r\n\r\n") + 4:], "request_timeout")
    assert took < 10, took
    # A head that never ends is cut too (no answer: the connection closes).
    s = raw(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    read_all(s)
    assert time.monotonic() - t0 < 10
    # An idle keep-alive connection is closed after --idle-timeout (3 s), not after the
    # head's 2 s (hyper's header timer also ran between requests and cut it at 2 s).
    s = raw(srv.port, b"GET /v1/models/kimi-k3 HTTP/1.1\r\nHost: x\r\n\r\n")
    first = s.recv(65536)
    t0 = time.monotonic()
    assert first.startswith(b"HTTP/1.1 200"), first
    rest = read_all(s)
    took = time.monotonic() - t0
    assert rest == b"" and 2.3 < took < 10, (rest, took)  # 2 s when the head's time cut it
    # A head sent byte by byte within the idle time but never finished is cut at its own
    # deadline, counted from its first byte.
    s = raw(srv.port, b"GET /v1/models/kimi-k3 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert s.recv(65536).startswith(b"HTTP/1.1 200")
    time.sleep(2.2)  # idle longer than the head's time: still open
    s.sendall(b"GET /health HTTP/1.1\r\n")
    t0 = time.monotonic()
    rest = read_all(s)
    took = time.monotonic() - t0
    assert rest == b"" and 1.7 < took < 10, (rest, took)


def test_a_pipelined_request_whose_client_closed_is_cancelled(world):
    """The client sends its whole request and closes its socket at once, streaming or not:
    the job is cancelled (before: it ran to its 4,096 ids for nobody)."""
    srv = world["main"]
    for stream in (False, True):
        seen = srv.log_path.stat().st_size
        body = json.dumps(dict(LONG, stream=stream, seed=5 + stream)).encode()
        s = raw(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        s.close()
        wait_for(lambda: server_worker(srv, seen) or "went away" in log_since(srv.log_path, seen),
                 "the job to join the worker or the request to be cancelled")
        t0 = time.monotonic()
        wait_for(lambda: "the client went away" in log_since(srv.log_path, seen), "the request to be cancelled")
        if server_worker(srv, seen):
            wait_for(lambda: cancelled_jobs(srv, seen) == 1, "the job to end", timeout=60)
        took = time.monotonic() - t0
        assert took < 45, f"stream={stream}: the job ran {took:.1f} s for nobody"
        print(f"measured: stream={stream}: cancelled and ended {took:.1f} s after it was seen")


def test_a_half_closed_client_gets_its_answer(world):
    srv = world["main"]
    want_text, want_finish, _ = expected_completion(world, tokenize(PROMPT), 5)
    for stream in (False, True):
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                           "stream": stream}).encode()
        s = raw(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        s.shutdown(socket.SHUT_WR)
        got = final_response(read_all(s))
        assert got.startswith(b"HTTP/1.1 200"), got[:300]
        payload = got[got.index(b"\r\n\r\n") + 4:]
        if stream:
            assert b"data: [DONE]" in payload, payload[-300:]
        else:
            r = json.loads(payload)
            assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (want_text, want_finish)


# ---- issue 35: defaults that answer, queueing, metrics, keys, CORS, Ctrl-C


def test_a_retry_resumes_from_the_prefill_the_cancelled_request_kept(world):
    """The first request's client leaves during its generation; the worker stops at a step
    boundary having kept its prefill; the same request again prefills one id and reports the
    rest as cached_tokens, with the answer of a full prefill."""
    srv = world["main"]
    prompt = [2000 + (i * 104729) % 80000 for i in range(700)]
    seen = srv.log_path.stat().st_size
    body = json.dumps(dict(LONG, prompt=prompt)).encode()
    s = raw(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(lambda: "prefilled (0 of 700" in log_since(srv.log_path, seen), "the prefill", timeout=120)
    s.close()
    wait_for(lambda: "ended its cancelled job" in log_since(srv.log_path, seen), "the cancelled job to end", timeout=60)
    want_text, want_finish, want_n = expected_completion(world, prompt, 4)
    r = srv.client().completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1, r.usage
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want_text, want_finish)
    assert r.usage.completion_tokens == want_n


def test_chat_defaults_answer(world):
    """Without max_tokens a chat generates at most the documented default (256), with thinking
    at effort low (the rendered prompt says so)."""
    c = world["main"].client()
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0)
    assert r.usage.completion_tokens <= 256
    prompt_ids = tokenize(xtml_prompt([("user", "Hi")], effort="low"), special=True)
    assert r.usage.prompt_tokens == len(prompt_ids)


def ps_json(world):
    return json.loads(run([binary("k3-ctl"), "ps", "--json", "--socket", world["sock"]]).stdout)


def test_queueing_is_reported(world):
    """With the one job slot taken, a streamed request gets its headers and a queue comment at
    once, `k3-ctl ps` lists it as queued behind the running one, and a full queue is a 429."""
    srv = world["main"]  # --max-jobs 1 --queue 4
    seen = srv.log_path.stat().st_size
    a = open_stream(srv, dict(LONG, stream=True, seed=11))
    try:
        body = json.dumps(dict(LONG, stream=True, seed=12)).encode()
        t0 = time.monotonic()
        b = raw(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: queued-b\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while b": queued, position 1 of 1" not in got:
            chunk = b.recv(4096)
            assert chunk, got
            got += chunk
        took = time.monotonic() - t0
        assert got.startswith(b"HTTP/1.1 200") and b"x-request-id: queued-b" in got.lower(), got
        assert took < 10, took
        print(f"measured: a queued streamed request got its first bytes in {took:.3f} s")
        servers = wait_for(lambda: [s for s in ps_json(world)["servers"] if len(s["requests"]) >= 2], "ps to list both")
        reqs = [r for s in servers for r in s["requests"]]
        states = {r["request_id"]: r["state"] for r in reqs}
        assert states["queued-b"] == {"Queued": {"position": 1}}, reqs
        assert any("Running" in st and st["Running"]["worker_pid"] > 0 for st in states.values()), reqs
        table = run([binary("k3-ctl"), "ps", "--socket", world["sock"]]).stdout.decode()
        assert "queued-b" in table and "queued #1" in table, table
        b.close()
        wait_for(lambda: all(len(s["requests"]) <= 1 for s in ps_json(world)["servers"]), "the queued request to leave when its client did")
    finally:
        a.close()
    wait_for(lambda: cancelled_jobs(srv, seen) >= 1, "the running job to end", timeout=60)


def scrape(srv, headers=None):
    status, h, body = http(srv, "GET", "/metrics", headers=headers)
    assert status == 200, body
    assert h["Content-Type"].startswith("application/openmetrics-text"), h
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def sample(fams, family, name, **labels):
    for s in fams[family].samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no {name} {labels} in {fams[family].samples}")


def test_metrics_parse_and_count(world):
    srv = world["main"]
    before = scrape(srv)
    done = sample(before, "k3_serve_completion_tokens", "k3_serve_completion_tokens_total")
    r = srv.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    fams = scrape(srv)
    assert sample(fams, "k3_serve_completion_tokens", "k3_serve_completion_tokens_total") == done + r.usage.completion_tokens
    assert sample(fams, "k3_serve_requests", "k3_serve_requests_total", route="/v1/completions", status="200") >= 1
    assert sample(fams, "k3_store_up", "k3_store_up") == 1
    assert 0 <= sample(fams, "k3_store_true_resident_hit_rate", "k3_store_true_resident_hit_rate") <= 1
    assert sample(fams, "k3_store_sessions", "k3_store_sessions") >= 1
    assert sample(fams, "k3_serve_prefill_seconds", "k3_serve_prefill_seconds_count") >= 1
    assert sample(fams, "k3_serve_bytes_read", "k3_serve_bytes_read_total") >= 0  # the store holds it all
    assert sample(fams, "k3_serve_expert_requests", "k3_serve_expert_requests_total") > 0
    assert sample(fams, "k3_serve_max_jobs", "k3_serve_max_jobs") == 1
    assert "k3_serve_seconds_per_token" in fams and "k3_serve_queued" in fams


def test_request_ids(world):
    srv = world["main"]
    status, h, _ = http(srv, "GET", "/v1/models", headers={"X-Request-Id": "my-id.42"})
    assert status == 200 and h["X-Request-Id"] == "my-id.42"
    status, h, _ = http(srv, "GET", "/v1/models", headers={"X-Request-Id": "bad id\t"})
    assert status == 200 and h["X-Request-Id"].startswith("req-") and h["X-Request-Id"] != "bad id"
    log = srv.log_path.read_text(errors="replace")
    assert "request{id=my-id.42}" in log, log[-2000:]
    # A streamed request is logged when its head goes out and again, with its whole time, when
    # its stream ends — not "-> 200 in 0.000 s" before its job ran (issue 49).
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}).encode()
    status, _, b = http(srv, "POST", "/v1/completions", body, {"X-Request-Id": "streamed-7"})
    assert status == 200 and b.rstrip().endswith(b"data: [DONE]"), b
    deadline = time.monotonic() + 10
    while True:
        mine = [ln for ln in srv.log_path.read_text(errors="replace").splitlines() if "request{id=streamed-7}" in ln]
        if any("(stream ended)" in ln for ln in mine) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    heads = [ln for ln in mine if "-> 200, streaming (head after" in ln]
    ends = [ln for ln in mine if "-> 200 in " in ln and ln.endswith("(stream ended)")]
    assert len(heads) == 1 and len(ends) == 1 and mine.index(heads[0]) < mine.index(ends[0]), mine


def test_api_key_and_cors(world):
    srv = world["keyed"]
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, h, b = http(srv, "POST", "/v1/completions", body, headers)
        assert status == 401, (headers, b)
        assert_error_shape(b, "invalid_api_key")
        assert h["WWW-Authenticate"] == "Bearer"
    assert http(srv, "GET", "/metrics")[0] == 401
    assert http(srv, "GET", "/health")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1
    # CORS: a preflight from the allowed origin, its answers carry the origin; others do not.
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    status, h, _ = http(srv, "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status == 204 and h["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in h["Access-Control-Allow-Methods"] and "authorization" in h["Access-Control-Allow-Headers"]
    status, h, _ = http(srv, "OPTIONS", "/v1/chat/completions", headers=dict(pre, Origin="https://evil.example"))
    assert status == 403 and "Access-Control-Allow-Origin" not in h
    status, h, _ = http(srv, "GET", "/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert status == 200 and h["Access-Control-Allow-Origin"] == ORIGIN
    status, h, _ = http(srv, "GET", "/v1/models", headers={"Origin": ORIGIN})
    assert status == 401 and h["Access-Control-Allow-Origin"] == ORIGIN, "a browser must be able to read the 401"
    # Off by default.
    status, h, _ = http(world["main"], "GET", "/v1/models", headers={"Origin": ORIGIN})
    assert status == 200 and "Access-Control-Allow-Origin" not in h
    assert http(world["main"], "OPTIONS", "/v1/models", headers=pre)[0] == 403


def test_api_key_from_the_environment_and_a_warning_beyond_loopback(world):
    d = world["dir"]
    env = dict(os.environ, K3_API_KEY="env-key-1")
    srv = Server(world["sock"], d / "serve-env.log", "--threads", "1", "--max-jobs", "1", env=env)
    try:
        assert http(srv, "GET", "/v1/models")[0] == 401
        assert http(srv, "GET", "/v1/models", headers={"Authorization": "Bearer env-key-1"})[0] == 200
    finally:
        srv.stop()
    # Beyond loopback without a key: a warning (0.0.0.0 is every address, loopback included).
    # Without --max-jobs the slot count is sized from the engine's memory plan (at most 16).
    p = subprocess.Popen([str(binary("k3-ctl")), "serve", "--socket", str(world["sock"]), "--listen", "0.0.0.0:0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        line = p.stdout.readline().decode()
        m = re.search(r"(\d+) job\(s\) at once \(sized from the plan: ([0-9.]+) [GM]B per slot", line)
        assert m, line
        assert 1 <= int(m.group(1)) <= 16 and float(m.group(2)) > 0, line
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert b"without an API key" in err, err


def test_ctrl_c_ends_serve_promptly_and_cancels_its_jobs(world):
    import signal
    d = world["dir"]
    srv = Server(world["sock"], d / "serve-int.log", "--threads", "1", "--max-jobs", "1")
    s = open_stream(srv, dict(LONG, stream=True, seed=21))
    pids = [wait_for(lambda: server_worker(srv), "the job to join the worker")]
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGINT)
    code = srv.proc.wait(10)
    took = time.monotonic() - t0
    s.close()
    assert code == 0 and took < 3, (code, took)
    print(f"measured: serve exited {took:.3f} s after SIGINT")
    wait_for(lambda: all(reaped(p) for p in pids), "the worker to end", timeout=60)


def test_concurrent_requests_share_one_worker_with_their_solo_answers(world):
    """`--max-jobs 3`: concurrent requests join the server's one worker (continuous batching) and
    each gets the text a worker gives it alone — greedy and seeded, whole and streamed, one
    joining while another decodes, one cancelled mid-stream without disturbing the others, a
    kept conversation resumed beside the others. Afterwards the worker ends with serve."""
    import concurrent.futures as cf
    d = world["dir"]
    log = d / "serve-batched.log"
    before = set(live_worker_pids(world))
    srv = Server(world["sock"], log, "--max-jobs", "3", "--queue", "4", "--threads", "1",
                 "--cancel-grace", "120")
    try:
        c = srv.client()
        prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
        seeded = ("--temperature", "0.9", "--top-p", "0.95", "--seed", "5")
        want = [expected_completion(world, tokenize(prompts[0]), 12),
                expected_completion(world, tokenize(prompts[1]), 16, *seeded),
                expected_completion(world, tokenize(prompts[2]), 8)]
        kws = [dict(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0),
               dict(model=MODEL, prompt=prompts[1], max_tokens=16, temperature=0.9, top_p=0.95, seed=5),
               dict(model=MODEL, prompt=prompts[2], max_tokens=8, temperature=0)]

        def whole(kw):
            r = c.completions.create(**kw)
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

        def streamed(kw):
            text, finish, usage = stream_completion(c, **kw)
            return text, finish, usage.completion_tokens

        # A long stream first: the others join its batch while it decodes; it is cancelled later.
        s = open_stream(srv, dict(LONG, stream=True, seed=3))
        with cf.ThreadPoolExecutor(4) as ex:
            got_whole = list(ex.map(whole, kws))
            got_streamed = list(ex.map(streamed, kws))
        assert got_whole == want and got_streamed == want, (got_whole, got_streamed, want)
        tail = log.read_text(errors="replace")
        pids = set(re.findall(r"joined worker pid (\d+)", tail))
        assert len(pids) == 1 and tail.count("joined worker pid") >= 7, tail
        assert tail.count(" started: up to 3 jobs at once") == 1, tail
        (pid,) = pids
        # The long stream's client goes away: its job leaves, the worker stays for the next.
        # Three at once again: the cancelled job's slot is free.
        s.close()
        with cf.ThreadPoolExecutor(3) as ex:
            assert list(ex.map(whole, kws)) == want
        # A request that extends a kept conversation resumes it inside the batch.
        p1 = tokenize("In the beginning")
        g1 = worker_ids(world, p1, 4)
        r1 = c.completions.create(model=MODEL, prompt=p1, max_tokens=4, temperature=0)
        assert r1.usage.completion_tokens == len(g1)
        p2 = p1 + g1 + tokenize(" and so")
        w2 = expected_completion(world, p2, 5)
        r2 = c.completions.create(model=MODEL, prompt=p2, max_tokens=5, temperature=0)
        assert (r2.choices[0].text, r2.choices[0].finish_reason, r2.usage.completion_tokens) == w2
        assert r2.usage.prompt_tokens_details.cached_tokens == len(p1) + len(g1) - 1
        tail = log.read_text(errors="replace")
        assert set(re.findall(r"joined worker pid (\d+)", tail)) == {pid}, tail
    finally:
        srv.stop()
    # The worker ends with serve (its channel closes).
    wait_for(lambda: set(live_worker_pids(world)) <= before, "the worker to end", timeout=60)


def test_a_long_prompt_beside_short_ones_takes_the_same_worker(world):
    """`--max-jobs 3 --ctx 256`: a 600-id prompt (more than a slot's positions) sent beside two
    short requests runs in the same worker as they do (its log says so), and every answer is the
    one a worker gives that request alone."""
    import concurrent.futures as cf
    d = world["dir"]
    log = d / "serve-long.log"
    srv = Server(world["sock"], log, "--max-jobs", "3", "--ctx", "256", "--queue", "4",
                 "--threads", "1", "--no-sessions")
    try:
        c = srv.client()
        long_prompt = [3000 + (i * 7919) % 90000 for i in range(600)]
        prompts = [tokenize("The capital of France is"), long_prompt, tokenize("Once upon a time")]
        want = [expected_completion(world, p, 6) for p in prompts]

        def whole(p):
            r = c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

        with cf.ThreadPoolExecutor(3) as ex:
            got = list(ex.map(whole, prompts))
        assert got == want, (got, want)
        tail = log.read_text(errors="replace")
        joined = re.findall(r"joined worker pid (\d+) \((\d+) prompt ids", tail)
        assert len(joined) == 3 and len({p for p, _ in joined}) == 1, tail
        assert "600" in {n for _, n in joined}, tail
        assert "positions a slot" in tail and "256 positions a slot" in tail, tail
    finally:
        srv.stop()
