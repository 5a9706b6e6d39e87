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

Then the worker's shaping (issue 46 items 2-4 and 6): `tool_choice` `required`/named and
Anthropic's `any`/`tool` return a call to a declared tool whose arguments validate (`jsonschema`),
streamed and not; `response_format` `json_schema` output validates; an unconstrained request
keeps the worker's own ids; logprobs come in OpenAI's shapes and agree with greedy picks; a
logit bias moves the pick; a thinking budget of N gives at most N reasoning tokens and an
answer; a tool loop and a reply that re-encodes otherwise resume their conversation
(`cached_tokens` / `cache_read_input_tokens`, counted from an independent rendering); and the
`openai-agents` SDK completes a run with a tool call against the server.

And `n` > 1 (issue 46 item 3): `n=3` gives choices 0, 1, 2 each equal to the request with
`n=1` and seed `seed + i`, the usage counting the prompt once and every choice's ids, streamed
(the chunks folded by index) as whole; with `tool_choice: required` every choice is a valid
call; `n` beyond the server's slots (or with `best_of`) is a 400 naming `n`.
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
            # Three slots: `n` up to 3 (its worker starts with its first request).
            wide = Server(sock, d / "serve-wide.log", "--max-jobs", "3", "--threads", "1")
            servers.append(wide)
            yield {"main": main, "keyed": keyed, "wide": wide, "sock": sock, "env": env}
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
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="auto"), "tool_choice"),
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(logit_bias={"999999": 1}), "logit_bias"),
        (dict(logit_bias={"5": 101}), "logit_bias"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(extra_body={"thinking_budget": -1}), "thinking_budget"),
        (dict(extra_body={"thinking_budget": 4, "thinking": {"type": "disabled"}}), "thinking_budget"),
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
    # A small budget (any budget under 4096 renders `thinking_effort=low`): what is checked is the
    # rendering of the history, not a long generation (1,024 thinking ids took 90 s here).
    m = c.messages.create(model=MODEL, max_tokens=24, extra_body={"temperature": 0}, tools=[A_TOOL],
                          messages=messages,
                          thinking={"type": "enabled", "budget_tokens": 16}, stop_sequences=["\n"])
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
        ({**base, "tools": [A_TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error"),
        ({**base, "output_config": {"effort": "high"}}, 400, "invalid_request_error"),
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


# ---- constrained decoding, the thinking budget, logprobs and logit edits (issue 46 items 2-4)

# A tool whose calls end within a bounded number of ids (bounded strings and numbers, no other
# keys), so that a random model under the grammar finishes its call within max_tokens.
BOUNDED = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "description": "Set an alarm",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"label": {"type": "string", "maxLength": 6},
                           "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                           "loud": {"type": "boolean"}},
            "required": ["label", "hour", "loud"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 5},
                         "rank": {"type": "integer", "minimum": 1, "maximum": 99},
                         "kind": {"enum": ["a", "b", "c"]}},
          "required": ["city", "rank", "kind"], "additionalProperties": False}
NO_THINK = {"thinking": {"type": "disabled"}}


def fold_stream(c, **kw):
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            for tc in ch.delta.tool_calls or []:
                calls[tc.index] = tc
            finish = ch.finish_reason or finish
    return content, reasoning, [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_choice_required_returns_a_valid_call_streamed_or_not(world, thinking):
    c = world["main"].client()
    extra = {"thinking_budget": 3} if thinking else NO_THINK
    tools = [WEATHER, BOUNDED]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Wake me at seven."}], tools=tools,
              tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0,
              extra_body=extra)
    r = c.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls, tools)
    assert not choice.message.content, "a forced call has no text before it"
    content, _, calls, finish = fold_stream(c, **kw)
    assert finish == "tool_calls" and not content
    assert [(x.function.name, x.function.arguments) for x in calls] == \
        [(x.function.name, x.function.arguments) for x in choice.message.tool_calls]


def test_a_named_function_is_the_one_called(world):
    c = world["main"].client()
    r = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, BOUNDED],
        tool_choice={"type": "function", "function": {"name": "set_alarm"}}, parallel_tool_calls=False,
        max_tokens=120, temperature=0, extra_body=NO_THINK)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    assert {x.function.name for x in calls} == {"set_alarm"}
    check_calls(calls, [BOUNDED])


@pytest.mark.parametrize("thinking", [False, True])
def test_json_schema_output_validates_streamed_or_not(world, thinking):
    c = world["main"].client()
    extra = {"thinking_budget": 2} if thinking else NO_THINK
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "A city, please."}], max_tokens=120,
              temperature=0, extra_body=extra,
              response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    r = c.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    content, _, _, finish = fold_stream(c, **kw)
    assert (content, finish) == (r.choices[0].message.content, "stop")
    # Sampled too: another seed, still valid.
    r = c.chat.completions.create(**{**kw, "temperature": 1.0, "seed": 7})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_json_object_output_opens_an_object(world):
    c = world["main"].client()
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                  max_tokens=24, temperature=0, extra_body=NO_THINK,
                                  response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{"), text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_an_unconstrained_request_keeps_its_ids(world):
    """The worker's own ids (no shaping) are the server's, with and without logprobs asked (the
    shaped path with nothing to change must not move a pick)."""
    from test_openai_serve import expected_completion
    c = world["main"].client()
    prompt = "Once upon a time"
    w = {"sock": world["sock"], "env": world["env"]}
    want_text, want_finish, n = expected_completion(w, tokenize(prompt), 10)
    for extra in ({}, {"logprobs": 3}, {"logit_bias": {"5": 0}}):
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, **extra)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want_text, want_finish), extra
        assert r.usage.completion_tokens == n


def test_logprobs_in_openai_shapes(world):
    c = world["main"].client()
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                  temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_THINK)
    items = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    assert b"".join(bytes(i.bytes) for i in items).decode("utf-8", errors="replace") == text
    for i in items:
        assert len(i.top_logprobs) == 3 and i.logprob <= 0
        # Greedy: the pick is the most likely id, and the alternatives come in order.
        assert i.top_logprobs[0].logprob == i.logprob and i.top_logprobs[0].token == i.token
        lps = [t.logprob for t in i.top_logprobs]
        assert lps == sorted(lps, reverse=True)
    r = c.completions.create(model=MODEL, prompt="The sea", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    ended = r.choices[0].finish_reason == "stop"
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens - ended
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


def test_logit_bias_and_penalties(world):
    c = world["main"].client()
    word = tokenize(" blue")
    assert len(word) == 1
    r = c.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0,
                             logit_bias={str(word[0]): 100})
    assert r.choices[0].text == " blue" * 5
    # A frequency penalty that outweighs the bias lets the reply move on after the first pick.
    r = c.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0,
                             logit_bias={str(word[0]): 3}, frequency_penalty=2, presence_penalty=2)
    assert r.choices[0].text.count(" blue") <= 2, r.choices[0].text


def test_a_thinking_budget_bounds_the_thinking_and_the_answer_arrives(world):
    c = world["main"].client()
    for budget in (0, 4):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=24, temperature=0,
                  extra_body={"thinking_budget": budget})
        r = c.chat.completions.create(**kw)
        details = r.usage.completion_tokens_details
        assert details.reasoning_tokens <= budget, r.usage
        assert r.choices[0].message.content, r.choices[0]
        content, reasoning, _, _ = fold_stream(c, **kw)
        assert (content, reasoning) == (r.choices[0].message.content,
                                        (r.choices[0].message.model_extra or {}).get("reasoning_content"))
    # The default budget (half of max_tokens) leaves the answer room.
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=16,
                                  temperature=0)
    assert r.usage.completion_tokens_details.reasoning_tokens <= 8
    assert r.choices[0].message.content


def test_anthropic_any_and_tool_force_a_valid_tool_use_streamed_or_not(world):
    c = anthropic_client(world["main"])
    bounded = {"name": "set_alarm", "description": "Set an alarm",
               "input_schema": BOUNDED["function"]["parameters"]}
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "set_alarm", "disable_parallel_tool_use": True}):
        kw = dict(model=MODEL, max_tokens=120, extra_body={"temperature": 0}, tools=[A_TOOL, bounded],
                  tool_choice=choice, messages=[{"role": "user", "content": "Wake me at seven."}])
        m = c.messages.create(**kw)
        assert m.stop_reason == "tool_use", m
        uses = [b for b in m.content if b.type == "tool_use"]
        assert uses
        for b in uses:
            schema = {"get_weather": A_TOOL, "set_alarm": bounded}[b.name]["input_schema"]
            jsonschema.validate(b.input, schema)
            if choice["type"] == "tool":
                assert b.name == "set_alarm"
        with c.messages.stream(**kw) as s:
            final = s.get_final_message()
        # The same blocks (each message names its tool_use blocks after its own id).
        strip = lambda blocks: [{k: v for k, v in b.model_dump().items() if k != "id"} for b in blocks]  # noqa: E731
        assert strip(final.content) == strip(m.content)
        assert final.stop_reason == "tool_use"


def test_anthropic_output_format_and_thinking_budget(world):
    c = anthropic_client(world["main"])
    m = c.messages.create(model=MODEL, max_tokens=120, extra_body={"temperature": 0,
                          "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
                          messages=[{"role": "user", "content": "A city."}])
    text = "".join(b.text for b in m.content if b.type == "text")
    jsonschema.validate(json.loads(text), SCHEMA)
    # A budget of 0: no thinking at all, and the answer comes.
    m = c.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0},
                          thinking={"type": "enabled", "budget_tokens": 0},
                          messages=[{"role": "user", "content": "Hi"}])
    assert not any(b.type == "thinking" and b.thinking for b in m.content), m.content
    assert any(b.type == "text" and b.text for b in m.content), m.content


def test_the_openai_agents_sdk_completes_a_turn_with_a_tool_call(world):
    """A real agent framework (the `openai-agents` package, pinned in scripts/requirements.txt)
    pointed at k3 by its documented base-URL setting: its first model call must call the tool
    (`tool_choice: required`, forced by the grammar), the SDK runs it and sends its result back,
    and the next call's answer ends the run — with no protocol error on the way (the words are
    noise on random weights)."""
    from typing import Literal

    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # its traces would go to OpenAI
    rung = []

    @function_tool
    def ring(bell: Literal["low", "high"]) -> str:
        """Ring a bell."""
        rung.append(bell)
        return f"rang the {bell} bell"

    client = AsyncOpenAI(base_url=world["main"].url + "/v1", api_key="unused", max_retries=0, timeout=300)
    agent = Agent(
        name="bell-ringer", instructions="Ring a bell, then say which.", tools=[ring],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                     max_tokens=96, extra_body={"thinking": {"type": "disabled"}}))
    result = Runner.run_sync(agent, "Ring the high bell.", max_turns=4)
    assert rung and rung[0] in ("low", "high")
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds


def test_a_tool_loop_resumes_its_session_through_both_apis(world):
    """call → tool result → next turn: the first request (tool_choice forcing the call) keeps a
    state where its history ends, before the `tool-choice` note only it renders; the next
    request (the call and its result appended) resumes there — the reply's own state is no
    prefix of it, the call rendering otherwise than the model wrote it — and reports those ids
    as cached tokens (counted here from an independent rendering)."""
    c = world["main"].client()
    first = [{"role": "user", "content": "Set an alarm for the blue team."}]
    kw = dict(model=MODEL, tools=[BOUNDED], max_tokens=120, temperature=0, extra_body=NO_THINK)
    r1 = c.chat.completions.create(messages=first, tool_choice="required", parallel_tool_calls=False, **kw)
    call = r1.choices[0].message.tool_calls[0]
    history = first + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "alarm set"},
    ]
    r2 = c.chat.completions.create(messages=history, max_tokens=4, **{k: v for k, v in kw.items() if k != "max_tokens"})
    history_end = len(tokenize(declare([BOUNDED]) + msg("user", first[0]["content"]), special=True))
    assert r2.usage.prompt_tokens_details.cached_tokens == history_end, (r1.usage, r2.usage)
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens

    a = anthropic_client(world["main"])
    bounded = {"name": "set_alarm", "description": "Set an alarm",
               "input_schema": BOUNDED["function"]["parameters"]}
    as_openai = {"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm",
                                                  "parameters": BOUNDED["function"]["parameters"]}}
    akw = dict(model=MODEL, extra_body={"temperature": 0}, tools=[bounded])
    q = [{"role": "user", "content": "Set an alarm for the red team."}]
    m1 = a.messages.create(max_tokens=120, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                           messages=q, **akw)
    use = next(b for b in m1.content if b.type == "tool_use")
    m2 = a.messages.create(max_tokens=4, messages=q + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "alarm set"}]},
    ], **akw)
    history_end = len(tokenize(declare([as_openai]) + msg("user", q[0]["content"]), special=True))
    assert m2.usage.cache_read_input_tokens == history_end, (m1.usage, m2.usage)


def test_a_reply_that_re_encodes_otherwise_still_resumes_the_conversation(world):
    """Issue 49 item 4: the second turn sends the first reply back as text; when that text
    re-encodes to other ids than the model generated, the turn still resumes the first turn's
    prefill instead of prefilling everything."""
    c = world["main"].client()
    q = [{"role": "user", "content": "Tell me something."}]
    r1 = c.chat.completions.create(model=MODEL, messages=q, max_tokens=16, temperature=0, extra_body=NO_THINK)
    r2 = c.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0, extra_body=NO_THINK,
        messages=q + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "And again?"}])
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 1, (r1.usage, r2.usage)


def fold_choices(c, **kw):
    """A streamed answer folded by choice index: {index: (content, finish_reason, calls)}, usage."""
    got, usage = {}, None
    for chunk in c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            content, finish, calls = got.get(ch.index, ("", None, {}))
            for tc in ch.delta.tool_calls or []:
                calls[tc.index] = tc
            got[ch.index] = (content + (ch.delta.content or ""), ch.finish_reason or finish, calls)
    return got, usage


def test_n_choices_are_their_seeds_alone_with_the_prompt_counted_once(world):
    c = world["wide"].client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
              temperature=1.0, seed=11, extra_body=NO_THINK)
    r = c.chat.completions.create(**kw, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    alone = [c.chat.completions.create(**{**kw, "seed": 11 + i}) for i in range(3)]
    for ch, a in zip(r.choices, alone):
        assert (ch.message.content, ch.finish_reason) == (a.choices[0].message.content, a.choices[0].finish_reason), ch.index
    assert len({ch.message.content for ch in r.choices}) > 1, "sampled choices differ"
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    got, usage = fold_choices(c, **kw, n=3)
    assert sorted(got) == [0, 1, 2]
    for ch in r.choices:
        assert got[ch.index][:2] == (ch.message.content, ch.finish_reason), ch.index
    assert (usage.prompt_tokens, usage.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)
    # Stop strings cut each choice on its own (the others go on; ids of a cut choice are dropped).
    cut = dict(kw, stop=["e", "a"], max_tokens=24)
    r = c.chat.completions.create(**cut, n=3)
    for i, ch in enumerate(r.choices):
        a = c.chat.completions.create(**{**cut, "seed": 11 + i}).choices[0]
        assert (ch.message.content, ch.finish_reason) == (a.message.content, a.finish_reason), i
    got, _ = fold_choices(c, **cut, n=3)
    assert [got[i][:2] for i in range(3)] == [(ch.message.content, ch.finish_reason) for ch in r.choices]
    # The legacy completions endpoint alike.
    k = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5, logprobs=2)
    r = c.completions.create(**k, n=2)
    assert [ch.index for ch in r.choices] == [0, 1]
    for i, ch in enumerate(r.choices):
        a = c.completions.create(**{**k, "seed": 5 + i}).choices[0]
        assert (ch.text, ch.finish_reason) == (a.text, a.finish_reason), i
        # Each choice's own log-probabilities, as the request alone gets them.
        assert ch.logprobs.tokens == a.logprobs.tokens and ch.logprobs.token_logprobs == a.logprobs.token_logprobs, i
        assert ch.logprobs.text_offset == a.logprobs.text_offset, i
    # Greedy: n identical choices (computed as n sequences).
    r = c.chat.completions.create(**{**kw, "temperature": 0}, n=2)
    assert r.choices[0].message.content == r.choices[1].message.content


def test_n_with_a_forced_tool_call_gives_a_valid_call_per_choice(world):
    """Greedy (a sampled random model may write a string argument past max_tokens): the three
    choices are the same call, which each gets only with a grammar state of its own — choices
    sharing one would advance it three times per step and break every call."""
    c = world["wide"].client()
    tools = [WEATHER, BOUNDED]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Wake me at seven."}], tools=tools,
              tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0,
              extra_body=NO_THINK, n=3)
    r = c.chat.completions.create(**kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    ids = set()
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls", ch
        assert len(ch.message.tool_calls) == 1
        check_calls(ch.message.tool_calls, tools)
        ids.update(tc.id for tc in ch.message.tool_calls)
    assert len(ids) == 3, "call ids are unique across choices"
    one = c.chat.completions.create(**{**kw, "n": 1}).choices[0].message.tool_calls
    for ch in r.choices:
        assert [(x.function.name, x.function.arguments) for x in ch.message.tool_calls] == \
            [(x.function.name, x.function.arguments) for x in one]
    got, _ = fold_choices(c, **kw)
    for ch in r.choices:
        content, finish, calls = got[ch.index]
        assert finish == "tool_calls" and not content
        assert [(x.function.name, x.function.arguments) for x in calls.values()] == \
            [(x.function.name, x.function.arguments) for x in ch.message.tool_calls]


def test_n_beyond_the_slots_is_a_400_naming_n(world):
    base = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    for server, n in (("main", 2), ("wide", 4), ("wide", 0), ("wide", 1000)):
        with pytest.raises(openai.BadRequestError) as e:
            world[server].client().chat.completions.create(**base, n=n)
        assert e.value.body["param"] == "n", e.value.body
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"], e.value.body
    # The body on the wire is OpenAI's error object.
    status, body = post(world["main"], "/v1/chat/completions", {**base, "n": 2})
    assert status == 400 and body["error"]["param"] == "n", body
    with pytest.raises(openai.BadRequestError) as e:
        world["wide"].client().completions.create(model=MODEL, prompt="x", max_tokens=1, n=2, best_of=2)
    assert e.value.body["param"] == "best_of", e.value.body
