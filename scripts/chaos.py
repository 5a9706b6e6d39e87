#!/usr/bin/env python3
"""Chaos run of `k3-ctl serve` (issue 47 item 9): concurrent clients over the OpenAI and
Anthropic APIs while the worker is killed and stopped, the store restarted and a trunk file made
unreadable; every invariant checked, figures written as JSON.

    python3 scripts/chaos.py [--seconds 120] [--clients 4] [--seed 1] [--out chaos.json]
                             [--bin-dir target/debug] [--keep]

What it does, all on loopback and inside one scratch directory it creates (and removes, unless
--keep) under $TMPDIR: generates a `small` checkpoint (scripts/make-checkpoint.py; needs numpy),
packs its trunk, starts a store on a private socket and `k3-ctl serve` on an ephemeral port
(`--max-jobs 2 --queue 8 --stall-timeout 8 --threads 1`). It computes the answer of each of a
pool of greedy requests (random prompt lengths, three routes) alone, then for `--seconds` runs
`--clients` client threads, each sending requests from the pool — whole or streamed, some
cancelled after their first event, some disconnected right after sending — while a fault thread
injects, in turn, every 4–8 s: SIGKILL of the worker, SIGSTOP of the worker (continued after the
stall deadline if still alive), a store restart (`k3-ctl stop`, `k3-store start`), and a trunk
file made unreadable (`trunk.bin` renamed away — chmod does not stop root — while the store is
restarted, which must fail, then put back and the store started).

Invariants (each violation is listed in the JSON and makes the exit code 1):
- every completed answer (status 200, whole or streamed to its end) equals the same request
  alone, text for text (greedy);
- every failure is a documented one: 429 `queue_full`; 503 `store_unavailable`,
  `worker_stalled`, `worker_unavailable`; 500 for a job whose worker was killed ("the worker
  ended"); in a stream, the same as its last event — never a cut stream, a reset, an
  undocumented status or body;
- nothing hangs: every request ends within its deadline (`--request-deadline`, 90 s);
- nothing is left over after serve and the store are stopped: no process whose command line
  names the scratch directory, no temporary file in it, no new `/dev/shm` entry named k3;
- serve's open descriptors (sockets included) and resident memory do not grow: measured at
  quiet points (no client, no fault) at the start and the end.

Exit codes: 0 all invariants held; 1 a violation; 2 setup failed (binaries, checkpoint, store).
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "kimi-k3"
WORDS = ("the river carries small stones past an old mill where two children count boats under a grey "
         "sky while the baker sings about bread and winter and a cat sleeps on warm tiles").split()
DOCUMENTED_503 = {"store_unavailable", "worker_stalled", "worker_unavailable"}


class Setup(Exception):
    pass


def sh(args, timeout=300, check=True, **kw):
    r = subprocess.run([str(a) for a in args], capture_output=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise Setup(f"{args[0]} {args[1] if len(args) > 1 else ''} exited {r.returncode}: "
                    f"{r.stderr.decode(errors='replace')[-1500:]}")
    return r


# ---- HTTP on raw sockets (a client must be able to cancel and vanish at will)


def dechunk(body):
    out, rest = b"", body
    while rest:
        line, _, rest = rest.partition(b"\r\n")
        try:
            n = int(line.split(b";")[0], 16)
        except ValueError:
            return None
        if n == 0:
            return out
        if len(rest) < n:
            return None  # cut
        out, rest = out + rest[:n], rest[n + 2:]
    return None


def exchange(port, path, payload, action, deadline):
    """Send one request; `action`: read it all, `cancel` after the first event, `disconnect`
    right after sending. Returns (status, headers, body bytes or None when cut, seconds)."""
    body = json.dumps(payload).encode()
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port), timeout=deadline)
    try:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: chaos\r\nContent-Type: application/json\r\n"
                  f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        if action == "disconnect":
            return None, {}, None, time.monotonic() - t0
        got = b""
        # A whole request is cancelled after 0.3 s, a streamed one after its first event.
        cancel_at = t0 + 0.3 if action == "cancel" and not payload["stream"] else None
        while True:
            left = deadline - (time.monotonic() - t0)
            if cancel_at is not None:
                left = min(left, cancel_at - time.monotonic())
                if left <= 0:
                    return None, {}, None, time.monotonic() - t0
            elif left <= 0:
                raise TimeoutError
            s.settimeout(left)
            try:
                c = s.recv(65536)
            except ConnectionResetError:
                break
            except (TimeoutError, socket.timeout):
                if cancel_at is not None:
                    return None, {}, None, time.monotonic() - t0
                raise
            if not c:
                break
            got += c
            if action == "cancel" and got.startswith(b"HTTP/1.1 200") and b"data: " in got:
                return 200, {}, None, time.monotonic() - t0
    finally:
        s.close()
    while got.startswith(b"HTTP/1.1 1"):
        got = got[got.index(b"\r\n\r\n") + 4:]
    head, sep, rest = got.partition(b"\r\n\r\n")
    if not sep:
        return -1, {}, None, time.monotonic() - t0
    lines = head.decode(errors="replace").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        rest = dechunk(rest)
    return status, headers, rest, time.monotonic() - t0


# ---- the three routes' requests and answers


def request(route, prompt, n, stream):
    if route == "completions":
        return "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                   "stream": stream}
    msgs = [{"role": "user", "content": prompt}]
    if route == "chat":
        return "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": n, "temperature": 0,
                                        "reasoning_effort": "none", "stream": stream}
    return "/v1/messages", {"model": MODEL, "messages": msgs, "max_tokens": n, "temperature": 0, "stream": stream}


def whole_text(route, v):
    if route == "completions":
        return v["choices"][0]["text"]
    if route == "chat":
        return v["choices"][0]["message"]["content"] or ""
    return "".join(b.get("text", "") for b in v["content"] if b["type"] == "text")


def stream_text(route, body):
    """(text, error dict or None, ended properly)."""
    text, err, ended, event = "", None, False, None
    for line in body.decode(errors="replace").split("\n"):
        line = line.rstrip("\r")
        if line.startswith("event: "):
            event = line[7:]
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            ended = True
            continue
        v = json.loads(data)
        if route == "messages":
            if v.get("type") == "error":
                err = {"status_type": v["error"]["type"], "message": v["error"]["message"]}
            elif v.get("type") == "content_block_delta" and v["delta"].get("type") == "text_delta":
                text += v["delta"]["text"]
            elif v.get("type") == "message_stop":
                ended = True
        elif "error" in v:
            err = v["error"]
        elif route == "completions":
            text += "".join(c.get("text", "") for c in v["choices"])
        else:
            text += "".join(c["delta"].get("content") or "" for c in v["choices"])
    return text, err, ended


def killed(msg):
    """The message of a job whose worker was killed under it."""
    return "the worker ended" in msg or "the worker is gone" in msg


def documented(status, route, err):
    """Is this failure one the README documents? (`status` 200: a stream's last event.)"""
    if route == "messages":
        kind, msg = err.get("type") or err.get("status_type"), err.get("message", "")
        return ((status == 429 and kind == "rate_limit_error")
                or (status in (503, 200) and kind == "overloaded_error")
                or (status in (500, 200) and kind == "api_error" and killed(msg)))
    code, msg = err.get("code"), err.get("message", "")
    return ((status == 429 and code == "queue_full")
            or (status in (503, 200) and code in DOCUMENTED_503)
            or (status in (500, 200) and code is None and killed(msg)))


# ---- processes


class World:
    def __init__(self, args):
        self.args = args
        self.bin = Path(args.bin_dir or os.environ.get("K3_BIN_DIR") or ROOT / "target" / "debug")
        for b in ("k3-ctl", "k3-store", "k3-worker"):
            if not (self.bin / b).is_file():
                raise Setup(f"{self.bin / b} not built (cargo build --workspace --bins)")
        self.dir = Path(tempfile.mkdtemp(prefix="k3-chaos-"))
        self.env = dict(os.environ, XDG_RUNTIME_DIR=str(self.dir / "xdg"))
        self.sock = self.dir / "run" / "store.sock"
        self.serve = None

    def prepare(self):
        print(f"chaos: scratch directory {self.dir}; generating a small checkpoint and packing its trunk", flush=True)
        sh([sys.executable, ROOT / "scripts" / "make-checkpoint.py", "--preset", "small", "--seed", "1",
            self.dir / "small"])
        sh([self.bin / "k3-ctl", "pack-trunk", self.dir / "small", self.dir / "trunk"])
        self.start_store()
        self.log = open(self.dir / "serve.log", "w+b")
        self.serve = subprocess.Popen(
            [str(self.bin / "k3-ctl"), "serve", "--socket", str(self.sock), "--listen", "127.0.0.1:0",
             "--max-jobs", "2", "--queue", "8", "--stall-timeout", str(self.args.stall), "--threads", "1",
             "--cancel-grace", "20"],
            stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL, env=self.env)
        line = self.serve.stdout.readline().decode()
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if not m:
            raise Setup(f"serve did not start: {line!r}")
        self.port = int(m.group(1))

    def start_store(self, check=True):
        return sh([self.bin / "k3-store", "start", self.dir / "small", "--trunk", self.dir / "trunk", "--preset",
                   "laptop", "--socket", self.sock, "--detach"], env=self.env, check=check)

    def stop_store(self):
        sh([self.bin / "k3-ctl", "stop", "--socket", self.sock], check=False, timeout=120)

    def worker_pid(self):
        m = re.findall(rb"worker pid (\d+) started", (self.dir / "serve.log").read_bytes())
        pid = int(m[-1]) if m else None
        return pid if pid and Path(f"/proc/{pid}").exists() else None

    def serve_usage(self):
        pid = self.serve.pid
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        rss = next(int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS:"))
        return fds, rss * 1024

    def ours(self):
        """Processes whose command line names the scratch directory."""
        out = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    cmd = Path(f"/proc/{p}/cmdline").read_bytes()
                except OSError:
                    continue
                if str(self.dir).encode() in cmd and int(p) != os.getpid():
                    out.append((int(p), cmd.replace(b"\0", b" ").decode(errors="replace")[:200]))
        return out

    def shutdown(self):
        if self.serve and self.serve.poll() is None:
            self.serve.send_signal(signal.SIGTERM)
            try:
                self.serve.wait(20)
            except subprocess.TimeoutExpired:
                self.serve.kill()
                self.serve.wait()
        self.stop_store()


# ---- the run


class Run:
    def __init__(self, world, args):
        self.w, self.args = world, args
        self.rng = random.Random(args.seed)
        self.lock = threading.Lock()
        self.counts = {}
        self.violations = []
        self.faults = {}
        self.stop = threading.Event()

    def count(self, key):
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def violate(self, what):
        with self.lock:
            self.violations.append(what)
        print("chaos: VIOLATION", what, flush=True)

    def pool(self):
        cases = []
        for i in range(self.args.cases):
            words = self.rng.randint(1, 160)
            prompt = " ".join(self.rng.choice(WORDS) for _ in range(words))
            cases.append((("completions", "chat", "messages")[i % 3], prompt, self.rng.randint(1, 16)))
        self.expected = {}
        for case in cases:
            route, prompt, n = case
            path, payload = request(route, prompt, n, False)
            status, _, body, _ = exchange(self.w.port, path, payload, "read", 300)
            if status != 200:
                raise Setup(f"the reference request {route} failed: {status} {body!r}")
            self.expected[case] = whole_text(route, json.loads(body))
        self.cases = cases

    def one(self, rng):
        case = rng.choice(self.cases)
        route, prompt, n = case
        stream = rng.random() < 0.5
        action = rng.choices(["read", "cancel", "disconnect"], [0.8, 0.1, 0.1])[0]
        path, payload = request(route, prompt, n, stream)
        label = f"{route} {'stream' if stream else 'whole'} {action}"
        try:
            status, _, body, secs = exchange(self.w.port, path, payload, action, self.args.request_deadline)
        except (TimeoutError, socket.timeout):
            return self.violate(f"{label}: no answer within {self.args.request_deadline} s")
        except OSError as e:
            return self.violate(f"{label}: {e}")
        self.count(f"sent {action}")
        if action != "read":
            return
        if status == -1 or body is None:
            return self.violate(f"{label}: a cut response (status {status})")
        if status == 200 and not stream:
            got = whole_text(route, json.loads(body))
            if got != self.expected[case]:
                return self.violate(f"{label}: WRONG ANSWER {got!r} != {self.expected[case]!r}")
            return self.count("completed")
        if status == 200:
            text, err, ended = stream_text(route, body)
            if err is not None:
                if not documented(200, route, err):
                    return self.violate(f"{label}: undocumented stream error {err}")
                return self.count(f"failed in stream {err.get('code') or err.get('status_type')}")
            if not ended:
                return self.violate(f"{label}: a stream cut without its end or an error")
            if text != self.expected[case]:
                return self.violate(f"{label}: WRONG ANSWER {text!r} != {self.expected[case]!r}")
            return self.count("completed")
        try:
            v = json.loads(body)
            err = v["error"]
        except (ValueError, KeyError, TypeError):
            return self.violate(f"{label}: {status} with a body not in the error shape: {body[:200]!r}")
        if not documented(status, route, err):
            return self.violate(f"{label}: undocumented failure {status} {err}")
        self.count(f"failed {status} {err.get('code') or err.get('type')}")

    def client(self, k):
        rng = random.Random(self.args.seed * 1000 + k)
        while not self.stop.is_set():
            self.one(rng)
            time.sleep(rng.random() * 0.2)

    def fault(self, kind):
        w = self.w
        if kind in ("kill", "stop"):
            pid = w.worker_pid()
            if pid is None:
                return False
            if kind == "kill":
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGSTOP)
                self.stop.wait(self.args.stall + 3)
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        elif kind == "store_restart":
            w.stop_store()
            time.sleep(1)
            w.start_store()
        else:  # trunk_unreadable
            trunk = w.dir / "trunk" / "trunk.bin"
            away = trunk.with_name("trunk.bin.away")
            w.stop_store()
            trunk.rename(away)
            try:
                if w.start_store(check=False).returncode == 0:
                    self.violate("the store started without its trunk.bin")
                time.sleep(2)
            finally:
                away.rename(trunk)
            w.start_store()
        return True

    def faults_loop(self):
        kinds = ["kill", "stop", "store_restart", "trunk_unreadable"]
        i = 0
        while not self.stop.wait(self.rng.uniform(4, 8)):
            kind = kinds[i % len(kinds)]
            i += 1
            try:
                if self.fault(kind):
                    with self.lock:
                        self.faults[kind] = self.faults.get(kind, 0) + 1
            except Setup as e:
                self.violate(f"fault {kind}: {e}")

    def quiet_usage(self):
        time.sleep(3)
        return self.w.serve_usage()

    def run(self):
        w = self.w
        shm_before = {p for p in os.listdir("/dev/shm") if "k3" in p}
        self.pool()
        fds0, rss0 = self.quiet_usage()
        print(f"chaos: {len(self.cases)} reference answers; serve holds {fds0} descriptors, {rss0 >> 20} MiB; "
              f"{self.args.clients} clients for {self.args.seconds} s", flush=True)
        threads = [threading.Thread(target=self.client, args=(k,)) for k in range(self.args.clients)]
        threads.append(threading.Thread(target=self.faults_loop))
        for t in threads:
            t.start()
        time.sleep(self.args.seconds)
        self.stop.set()
        for t in threads:
            t.join(self.args.request_deadline + 30)
            if t.is_alive():
                self.violate("a client thread did not end")
        # Quiet: the store up, one request served, then the descriptors and memory.
        if sh([w.bin / "k3-ctl", "status", "--socket", w.sock], check=False).returncode != 0:
            w.start_store()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            route, prompt, n = case = self.cases[0]
            path, payload = request(route, prompt, n, False)
            status, _, body, _ = exchange(w.port, path, payload, "read", 90)
            if status == 200:
                if whole_text(route, json.loads(body)) != self.expected[case]:
                    self.violate("WRONG ANSWER after the run")
                break
            time.sleep(1)
        else:
            self.violate("serve did not serve again within 60 s of the last fault")
        fds1, rss1 = self.quiet_usage()
        w.shutdown()
        time.sleep(2)
        left = w.ours()
        tmp = [str(p) for p in w.dir.rglob("*") if ".tmp" in p.name]
        shm_after = {p for p in os.listdir("/dev/shm") if "k3" in p} - shm_before
        leaks = {"processes": left, "temp_files": tmp, "shm": sorted(shm_after),
                 "serve_fds": [fds0, fds1], "serve_rss_bytes": [rss0, rss1]}
        if left:
            self.violate(f"processes left: {left}")
        if tmp or shm_after:
            self.violate(f"files left: {tmp} {sorted(shm_after)}")
        if fds1 > fds0 + 4:
            self.violate(f"serve's descriptors grew: {fds0} -> {fds1}")
        if rss1 > rss0 + max(32 << 20, rss0 // 2):
            self.violate(f"serve's memory grew: {rss0 >> 20} -> {rss1 >> 20} MiB")
        completed = self.counts.get("completed", 0)
        wrong = sum(1 for v in self.violations if "WRONG" in v)
        return {
            "seconds": self.args.seconds, "clients": self.args.clients, "seed": self.args.seed,
            "requests": sum(v for k, v in self.counts.items() if k.startswith("sent")),
            "completed": completed, "outcomes": dict(sorted(self.counts.items())),
            "faults": self.faults, "wrong_answers": wrong, "violations": self.violations,
            "leaks": leaks, "ok": not self.violations,
        }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=120)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", type=int, default=9, help="requests in the pool (three routes in turn)")
    ap.add_argument("--stall", type=int, default=8, help="serve's --stall-timeout")
    ap.add_argument("--request-deadline", type=float, default=90.0)
    ap.add_argument("--bin-dir")
    ap.add_argument("--out")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args()
    try:
        w = World(args)
    except Setup as e:
        print(f"chaos: {e}", file=sys.stderr)
        return 2
    try:
        try:
            w.prepare()
            r = Run(w, args)
            result = r.run()
        except Setup as e:
            print(f"chaos: setup failed: {e}", file=sys.stderr)
            return 2
    finally:
        w.shutdown()
        if not args.keep:
            shutil.rmtree(w.dir, ignore_errors=True)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
