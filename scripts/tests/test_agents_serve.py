"""Tools and the Anthropic Messages API of `k3-ctl serve`, end to end, with the official `openai`
and `anthropic` packages as clients (issue 46, first wave).

A `small` checkpoint (real vocabulary) is generated once for the module, its trunk packed, a
store started, and two servers put in front of it: an open one and one with an API key.

What is checked: a request with `tools` renders exactly the release's tool prompt (the
declaration, the history's calls and results, the `tool_choice` note — its `usage.prompt_tokens`
equals an independent rendering built here from the facts of docs/SPEC.md §5.5 and tokenized);
both SDKs parse the answers streamed and whole (a call the random model makes is checked
against its tool's JSON schema with `jsonschema`); the Messages stream's events come in the
documented order and the SDK's stream helper folds them into the final message; count_tokens
equals the rendering; `x-api-key` is checked like the bearer key; refusals and errors come in
each API's shape. (That generated calls become `tool_calls`/`tool_use` blocks is tested on
forced replies in k3-ctl's `serve::reply` and `serve::anthropic` unit tests: a random model
rarely calls a tool by itself.)
"""
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_openai_serve import MODEL, Server, binary, run, tokenize  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEY = "k3-agents-key-0123456789"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get current weather for a location",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "description": "City name"},
                           "days": {"type": "integer", "minimum": 1}},
            "required": ["location"],
        },
    },
}


@pytest.fixture(scope="module")
def world(small_model):
    with tempfile.TemporaryDirectory(prefix="k3-agents-") as d:
        d = Path(d)
        model = small_model
        run([binary("k3-ctl"), "pack-trunk", model, d / "trunk"])
        sock = d / "run" / "store.sock"
        env = dict(os.environ, XDG_RUNTIME_DIR=str(d / "xdg"))
        run([binary("k3-store"), "start", model, "--trunk", d / "trunk", "--preset", "laptop",
             "--socket", sock, "--detach"], env=env)
        servers = []
        try:
            main = Server(sock, d / "serve-main.log", "--max-jobs", "1", "--queue", "8", "--threads", "1")
            servers.append(main)
            (d / "key").write_text(KEY + "\n")
            keyed = Server(sock, d / "serve-keyed.log", "--max-jobs", "1", "--threads", "1",
                           "--api-key-file", d / "key")
            servers.append(keyed)
            yield {"main": main, "keyed": keyed}
        finally:
            for s in servers:
                s.stop()
            subprocess.run([str(binary("k3-ctl")), "stop", "--socket", str(sock)], capture_output=True, timeout=60)


def deep_sort(v):
    if isinstance(v, dict):
        return {k: deep_sort(v[k]) for k in sorted(v)}
    if isinstance(v, list):
        return [deep_sort(x) for x in v]
    return v


def declare(tools):
    """The tool-declare message (SPEC.md §5.5), written out independently."""
    body = ("# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
            + json.dumps(deep_sort(tools), ensure_ascii=False, separators=(",", ":")) + "\n```")
    return f'<|open|>message role="system" type="tool-declare"<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>'


def msg(role, text, **attrs):
    a = "".join(f' {k}="{v}"' for k, v in attrs.items())
    return f'<|open|>message role="{role}"{a}<|sep|>{text}<|close|>message<|sep|><|end_of_msg|>'


def call_text(name, index, args):
    s = f'<|open|>call tool="{name}" index="{index}"<|sep|>'
    for k, v in args.items():
        kind = ("boolean" if isinstance(v, bool) else "null" if v is None else
                "number" if isinstance(v, (int, float)) else "string" if isinstance(v, str) else
                "object" if isinstance(v, dict) else "array")
        val = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        s += f'<|open|>argument key="{k}" type="{kind}"<|sep|>{val}<|close|>argument<|sep|>'
    return s + "<|close|>call<|sep|>"


GEN_RESPONSE = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
NOTE_NONE = msg("system", "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
                type="tool-choice")


def check_calls(calls, tools):
    """Every call names a declared tool and its arguments validate against the tool's schema."""
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    for c in calls or []:
        assert c.function.name in schemas, c
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


def test_openai_tools_auto_render_and_parse_streamed_or_not(world):
    c = world["main"].client()
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    kw = dict(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="auto", max_tokens=8,
              temperature=0, extra_body={"thinking": {"type": "disabled"}})
    r = c.chat.completions.create(**kw)
    want = tokenize(declare([WEATHER]) + msg("user", "What's the weather in Paris?") + GEN_RESPONSE, special=True)
    assert r.usage.prompt_tokens == len(want)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    check_calls(choice.message.tool_calls, [WEATHER])
    # Streamed: the same answer, folded from the chunks by hand.
    content, calls, finish = "", {}, None
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                calls[tc.index] = tc
            finish = ch.finish_reason or finish
    assert finish == choice.finish_reason
    assert content == (choice.message.content or "")
    assert len(calls) == len(choice.message.tool_calls or [])


def test_a_tool_loop_in_the_history_renders_like_the_release(world):
    c = world["main"].client()
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Paris", "days": 2}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Rome"}'}},
        ]},
        # Results out of order: rendered in the order of the calls they answer.
        {"role": "tool", "tool_call_id": "c2", "content": "Rome: 25C"},
        {"role": "tool", "tool_call_id": "c1", "content": "Paris: 18C"},
    ]
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                  max_tokens=1, temperature=0, extra_body={"thinking": {"type": "disabled"}})
    text = (declare([WEATHER]) + msg("user", "Weather in Paris and Rome?")
            + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
            + call_text("get_weather", 1, {"location": "Paris", "days": 2})
            + call_text("get_weather", 2, {"location": "Rome"})
            + "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
            + msg("tool", "Paris: 18C", tool="get_weather", index=1)
            + msg("tool", "Rome: 25C", tool="get_weather", index=2)
            + NOTE_NONE + GEN_RESPONSE)
    assert r.usage.prompt_tokens == len(tokenize(text, special=True))
    assert not r.choices[0].message.tool_calls, "tool_choice none: no call is returned"


def test_openai_refusals_name_their_field(world):
    c = world["main"].client()
    base = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    for extra, field in (
        (dict(tools=[WEATHER], tool_choice="required"), "tool_choice"),
        (dict(tool_choice="auto"), "tool_choice"),
        (dict(response_format={"type": "json_object"}), "response_format"),
        (dict(logprobs=True), "logprobs"),
        (dict(extra_body={"functions": [{"name": "f"}], "tools": [WEATHER]}), "functions"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**base, **extra)
        assert e.value.body["param"] == field, (extra, e.value.body)


def anthropic_client(server, key="unused"):
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120)


A_TOOL = {"name": "get_weather", "description": "Get current weather for a location",
          "input_schema": WEATHER["function"]["parameters"]}


def test_messages_with_tools_render_count_and_parse(world):
    c = anthropic_client(world["main"])
    # The SDK dropped `temperature` from its signature; the API (and k3) still take it.
    kw = dict(model=MODEL, max_tokens=8, extra_body={"temperature": 0}, system="Be brief.", tools=[A_TOOL],
              messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    want = tokenize(declare([WEATHER]) + msg("system", "Be brief.") + msg("user", "What's the weather in Paris?")
                    + GEN_RESPONSE, special=True)
    counted = c.messages.count_tokens(model=MODEL, system=kw["system"], tools=kw["tools"], messages=kw["messages"])
    assert counted.input_tokens == len(want)
    m = c.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant"
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(want)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    for b in m.content:
        assert b.type in ("text", "tool_use")
        if b.type == "tool_use":
            assert b.name == "get_weather"
            jsonschema.validate(b.input, A_TOOL["input_schema"])
    # Streamed: the documented event order, folded by the SDK into the same message.
    names = []
    with c.messages.stream(**kw) as s:
        for ev in s:
            names.append(ev.type)
        final = s.get_final_message()
    raw = [n for n in names if n in ("message_start", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop")]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"], names
    open_blocks = 0
    for n in raw:
        if n == "content_block_start":
            assert open_blocks == 0
            open_blocks += 1
        elif n == "content_block_stop":
            assert open_blocks == 1
            open_blocks -= 1
        elif n == "content_block_delta":
            assert open_blocks == 1
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    assert final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens


def test_messages_thinking_and_tool_results(world):
    c = anthropic_client(world["main"])
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "look it up", "signature": ""},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"location": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18C"}]},
    ]
    m = c.messages.create(model=MODEL, max_tokens=1200, extra_body={"temperature": 0}, tools=[A_TOOL],
                          messages=messages,
                          thinking={"type": "enabled", "budget_tokens": 1024}, stop_sequences=["\n"])
    effort = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
              "response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the "
              "system is invoked with `thinking_effort=low`.")
    text = (declare([WEATHER]) + msg("system", effort, type="thinking-effort") + msg("user", "Weather?")
            + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>look it up<|close|>think<|sep|>'
            + "<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
            + call_text("get_weather", 1, {"location": "Paris"}) + "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
            + msg("tool", "18C", tool="get_weather", index=1)
            + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(tokenize(text, special=True))
    assert m.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    if m.stop_reason == "stop_sequence":
        assert m.stop_sequence == "\n"


def post(server, path, body, headers=None):
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_messages_errors_and_keys(world):
    base = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for body, status, kind in (
        ({k: v for k, v in base.items() if k != "max_tokens"}, 400, "invalid_request_error"),
        ({**base, "top_k": 5}, 400, "invalid_request_error"),
        ({**base, "tools": [A_TOOL], "tool_choice": {"type": "any"}}, 400, "invalid_request_error"),
        ({**base, "model": "other"}, 404, "not_found_error"),
    ):
        got, err = post(world["main"], "/v1/messages", body)
        assert (got, err["type"], err["error"]["type"]) == (status, "error", kind), (body, err)
    # The key: x-api-key (Anthropic's header) or the bearer, checked alike.
    got, err = post(world["keyed"], "/v1/messages", base)
    assert (got, err["error"]["type"]) == (401, "authentication_error")
    got, err = post(world["keyed"], "/v1/messages", base, {"x-api-key": "wrong"})
    assert got == 401
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(world["keyed"], "wrong").messages.create(**base)
    m = anthropic_client(world["keyed"], KEY).messages.create(**base)
    assert m.usage.output_tokens >= 1
    got, _ = post(world["keyed"], "/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                  "messages": [{"role": "user", "content": "hi"}]}, {"x-api-key": KEY})
    assert got == 200
