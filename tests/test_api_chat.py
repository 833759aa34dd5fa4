"""The chat API through the real server: the answer's shape and usage, the chat template (and a
request's own, where trusted), echo, vLLM's server defaults, function tools chosen "auto" and read by
a tool-call parser, and a reasoning parser's thinking apart from the answer."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from server import MAX_MODEL_LEN, MESSAGES, MODEL, Server, free_port, post

from api.app import create_app
from api.limits import Limits
from api.responses import ResponseBuilder
from api.tool_parsers import PARSERS

GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


def test_chat_completion_shape_and_usage(served, client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert isinstance(r.created, int) and abs(r.created - time.time()) < 60
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the prompt is the chat template's rendering: one token per byte for this tokenizer
    rendered = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay hello<|im_end|>\n" \
               "<|im_start|>assistant\n"
    assert r.usage.prompt_tokens == len(served[1].tokenizer.encode(rendered, add_special_tokens=False))
    assert r.usage.prompt_tokens == len(rendered.encode()) - 3 * len("<|im_start|>") - 2 * len("<|im_end|>") + 5


def test_unknown_fields_are_ignored_and_content_parts_join(served):
    r = post(served, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 3, "some_future_field": {"x": 1}, "user": "me",
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                     {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                     {"role": "tool", "content": "42", "tool_call_id": "call_1"}]})
    assert r.status_code == 200, r.text
    rendered = ("<|im_start|>system\na\nb<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    assert r.json()["usage"]["prompt_tokens"] == len(served[1].tokenizer.encode(rendered, add_special_tokens=False))


def test_a_requests_chat_template_only_where_trusted(served):
    """vLLM's `chat_template` request field: a 400 unless the server trusts requests' templates
    (--trust-request-chat-template); then it renders the messages, for /tokenize too."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template": "{{ messages[0]['content'] }}!!"}
    refused = post(served, "/v1/chat/completions", body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    assert post(served, "/tokenize", body).status_code == 400
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260, trust_request_chat_template=True))

    async def check():
        test = app.test_client()
        answer = await (await test.post("/v1/chat/completions", json=body)).get_json()
        assert answer["usage"]["prompt_tokens"] == len("hi!!")
        assert (await (await test.post("/tokenize", json=body)).get_json())["tokens"] == list(b"hi!!")
        bad = await test.post("/v1/chat/completions", json={**body, "chat_template": "{% if %}"})
        assert bad.status_code == 400
        parts = {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}]}
        looped = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
        for template, rendered in ((body["chat_template"], "a\nb!!"), (looped, "[a][b]")):  # "auto" content format
            answer = await (await test.post("/tokenize", json={**parts, "chat_template": template})).get_json()
            assert answer["tokens"] == list(rendered.encode())
        # vLLM's other text parts; reasoning_effort reaches the template as a variable
        mixed = {**body, "messages": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                                      {"role": "assistant", "content": [{"type": "refusal", "refusal": "b"}]}],
                 "chat_template": "{% for m in messages %}{{ m['content'] }};{% endfor %}{{ reasoning_effort }}",
                 "reasoning_effort": "low"}
        assert (await (await test.post("/tokenize", json=mixed)).get_json())["tokens"] == list(b"a;b;low")
        wrong = await test.post("/v1/chat/completions", json={**mixed, "reasoning_effort": "extreme"})
        assert wrong.status_code == 400 and (await wrong.get_json())["error"]["param"] == "reasoning_effort"

    asyncio.run(check())


def test_a_template_that_would_run_for_minutes_is_a_400_within_the_bound(served):
    """--chat-template-timeout: rendering stops at the bound, in the template's own loops (or
    recursive macros), so the tokenizing thread is free again; the request is a 400 naming the
    flag, and the next requests are served. The offline path raises TimeoutError."""
    nested = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    doubling = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}"
    with pytest.raises(TimeoutError):
        served[1].tokenizer.apply_chat_template(MESSAGES, chat_template=nested, timeout=0.2)
    server = Server(create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260, trust_request_chat_template=True,
                                                 chat_template_timeout=1.0)), free_port())
    try:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
        for template in (nested, doubling):
            start = time.monotonic()
            r = post((server, served[1]), "/v1/chat/completions", {**body, "chat_template": template})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
            assert "--chat-template-timeout" in r.json()["error"]["message"] and time.monotonic() - start < 5
        assert post((server, served[1]), "/v1/chat/completions", body).status_code == 200
        plain = post((server, served[1]), "/v1/chat/completions",
                     {**body, "chat_template": "{{ messages[1]['content'] }}"})
        assert plain.status_code == 200 and plain.json()["usage"]["prompt_tokens"] == len("Say hello")
    finally:
        server.stop()


def test_chat_echo_repeats_the_assistant_message_it_continues(client):
    """vLLM's chat `echo`: where the last message is the assistant's (continued), the reply starts
    with its content, streamed or not; after a user message there is nothing to repeat."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]
    ask = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0.0,
               extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False})
    plain = client.chat.completions.create(**ask).choices[0].message.content
    ask["extra_body"]["echo"] = True
    echoed = client.chat.completions.create(**ask).choices[0].message.content
    assert echoed == "Once upon" + plain
    chunks = client.chat.completions.create(**ask, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    after_user = dict(model=MODEL, messages=messages[:1], max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True})
    assert client.chat.completions.create(**after_user).choices[0].message.content == client.chat.completions.create(
        **{**after_user, "extra_body": {"ignore_eos": True, "echo": True}}).choices[0].message.content


def test_server_defaults_as_vllms_flags(served):
    """--return-tokens-as-token-ids (a default a request can turn off), --response-role and
    --enable-force-include-usage (usage ends every stream)."""
    limits = Limits(MODEL, MAX_MODEL_LEN, 260, tokens_as_ids=True, response_role="bot", force_include_usage=True)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "logprobs": True}

    async def check():
        test = create_app(served[1], limits).test_client()
        whole = await (await test.post("/v1/chat/completions", json=body)).get_json()
        named = await (await test.post("/v1/chat/completions", json={**body, "return_tokens_as_token_ids": False}))\
            .get_json()
        continued = await (await test.post("/v1/chat/completions", json={**body, "add_generation_prompt": False}))\
            .get_json()
        streamed = await (await test.post("/v1/chat/completions", json={**body, "stream": True})).get_data()
        lines = streamed.decode().splitlines()
        return whole, named, continued, [json.loads(line[6:]) for line in lines if line.startswith("data: {")]

    whole, named, continued, chunks = asyncio.run(check())
    assert continued["choices"][0]["message"]["role"] == MESSAGES[-1]["role"]  # (vLLM's: no generation prompt)
    assert whole["choices"][0]["message"]["role"] == "bot" and chunks[0]["choices"][0]["delta"]["role"] == "bot"
    assert all(e["token"].startswith("token_id:") for e in whole["choices"][0]["logprobs"]["content"])
    assert not any(e["token"].startswith("token_id:") for e in named["choices"][0]["logprobs"]["content"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_auto_tool_choice_can_be_switched_off(served):
    """`--no-enable-auto-tool-choice`: tools chosen "auto" (named or implied) are a 400, as in vLLM
    without --enable-auto-tool-choice; tool_choice "none" is still served."""
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), auto_tool_choice=False)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    body = {"model": MODEL, "messages": MESSAGES, "tools": tools, "max_tokens": 2}

    async def check():
        test = app.test_client()
        for choice in ({}, {"tool_choice": "auto"}):
            refused = await test.post("/v1/chat/completions", json={**body, **choice})
            assert refused.status_code == 400
            assert "--enable-auto-tool-choice" in (await refused.get_json())["error"]["message"]
        served = await test.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
        assert served.status_code == 200

    asyncio.run(check())


def test_reasoning_parser_puts_the_thinking_apart(served, monkeypatch):
    """--reasoning-parser: the text between <think> and </think> is the message's `reasoning` (and
    `reasoning_content`), the rest its content; whole and streamed alike, and a `reasoning` item in
    the Responses API. The outputs are forced into shape with a regex, applied here from the first
    token (a constraint otherwise waits for the thinking: see the end)."""
    monkeypatch.setattr("api.generation.thinking_first", lambda constraint, thinking: constraint)
    think = {"structured_outputs": {"regex": "<think>[a-z]{3,8}</think>[a-z]{2,6}"}}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 30, "temperature": 1.0, "seed": 4}

    async def check(parser: str, extra: dict):
        test = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), reasoning_parser=parser).test_client()
        whole = await (await test.post("/v1/chat/completions", json={**body, **extra})).get_json()
        streamed = await (await test.post("/v1/chat/completions", json={**body, **extra, "stream": True})).get_data()
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.decode().splitlines()
                  if line.startswith("data: {")]
        # an answer's reasoning item sent back in a Responses input is taken (and left out); echo is refused
        again = await test.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 2, "input": [
            {"type": "message", "role": "user", "content": "x"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
            {"type": "message", "role": "assistant", "content": "y"},
            {"type": "message", "role": "user", "content": "z"}]})
        echo = await test.post("/v1/chat/completions", json={**body, "echo": True})
        assert again.status_code == 200 and echo.status_code == 400
        return whole["choices"][0]["message"], deltas

    message, deltas = asyncio.run(check("qwen3", think))
    reasoning, content = message["reasoning"], message["content"]
    assert 3 <= len(reasoning) <= 8 and reasoning.isalpha() and 2 <= len(content) <= 6 and content.isalpha()
    assert message["reasoning_content"] == reasoning
    assert "".join(d.get("reasoning", "") for d in deltas) == reasoning
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == content
    # the Responses API: a reasoning item, then the message
    builder = ResponseBuilder("resp_1", {}, MODEL, 1.0, 1.0, logprobs=False)
    events = [*builder.start(), *[e for d in deltas[1:] for e in builder.delta(d)],  # (after the role's)
              *builder.finish("stop", {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
                                       "prompt_tokens_details": {"cached_tokens": 0}})]
    output = builder.response["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"][0]["text"] == reasoning and output[1]["content"][0]["text"] == content
    assert sum("response.reasoning_text.delta" in e for e in events) >= 1
    assert sum("response.reasoning_text.done" in e for e in events) == 1
    # deepseek_r1: the output starts in the thinking (the template opened it)
    message, _ = asyncio.run(check("deepseek_r1", {"structured_outputs": {"regex": "[a-z]{3,8}</think>[a-z]{2,6}"}}))
    assert message["reasoning"].isalpha() and message["content"].isalpha()
    # qwen3 without <think>: all content, no reasoning
    message, deltas = asyncio.run(check("qwen3", {"structured_outputs": {"regex": "[a-z]{3,8}"}}))
    assert message["reasoning"] is None and message["content"].isalpha()
    assert not any("reasoning" in d for d in deltas)
    # as vLLM's, a constraint applies after the thinking: "<" (pushed up) may open it, not start a JSON object
    monkeypatch.undo()
    message, _ = asyncio.run(check("qwen3", {"response_format": {"type": "json_object"}, "max_tokens": 12,
                                             "logit_bias": {"60": 100}}))
    assert message["reasoning"].startswith("<") and message["content"] is None


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CITY = r'\{"city": "[a-z]{2,6}"\}'  # a regex for the arguments
CALLS = {  # a regex for a call to get_weather in each family's syntax (`api/tool_parsers.py`)
    "hermes": r'<tool_call>\{"name": "get_weather", "arguments": ' + CITY + r'\}</tool_call>',
    "llama3_json": r'\{"name": "get_weather", "parameters": ' + CITY + r'\}',
    "mistral": r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": ' + CITY + r'\}\]',
}


def test_auto_tool_choice_reads_the_call_the_model_writes(client):
    """tool_choice "auto": the output is read by the parser the chat template points to (Hermes for
    this model's). Where it holds a call, the answer is the content before the call, the call in
    tool_calls and finish_reason "tool_calls"; streamed, the content first, then delta.tool_calls
    (id and name, then the arguments). The random model would not write a call of itself: a regex,
    which "auto" (forcing nothing) allows beside it, makes it write one."""
    ask = dict(model=MODEL, messages=MESSAGES, tools=WEATHER, tool_choice="auto", max_tokens=120, temperature=1.0,
               seed=5, extra_body={"structured_outputs": {"regex": r"Sure\. " + CALLS["hermes"]}})
    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert re.fullmatch("[a-z]{2,6}", json.loads(call.function.arguments)["city"])
    chunks = list(client.chat.completions.create(stream=True, **ask))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Sure. "
    first = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert not any(d.content for d in deltas[first:])  # no content once the call has started
    streamed = [c for d in deltas for c in d.tool_calls or []]
    assert streamed[0].id.startswith("call_") and streamed[0].function.name == "get_weather"
    assert {c.index for c in streamed} == {0}
    assert "".join(c.function.arguments or "" for c in streamed) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    plain = client.chat.completions.create(**{k: v for k, v in ask.items() if k not in ("tools", "tool_choice")})
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content.startswith("Sure. <tool_call>")  # without tools: text


def test_tool_call_parser_flag_chooses_the_family(served):
    """--tool-call-parser: the family whose syntax "auto" tool calls are read in, whatever the chat
    template points to. Each family's call (made by a regex) is a call under its own parser, whole
    and streamed, and plain content under another family's."""
    body = {"model": MODEL, "messages": MESSAGES, "tools": WEATHER, "max_tokens": 120, "temperature": 1.0, "seed": 5}

    async def answer(parser: str, regex: str) -> tuple[dict, list[dict]]:
        test = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), tool_parser=PARSERS[parser]()).test_client()
        ask = {**body, "structured_outputs": {"regex": regex}}
        whole = await (await test.post("/v1/chat/completions", json=ask)).get_json()
        streamed = await (await test.post("/v1/chat/completions", json={**ask, "stream": True})).get_data()
        chunks = [json.loads(line[6:]) for line in streamed.decode().splitlines() if line.startswith("data: {")]
        return whole["choices"][0], [c["choices"][0] for c in chunks if c["choices"]]

    families = list(CALLS)
    for parser, other in zip(families, families[1:] + families[:1]):
        choice, streamed = asyncio.run(answer(parser, CALLS[parser]))
        (call,) = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather", parser
        assert re.fullmatch("[a-z]{2,6}", json.loads(call["function"]["arguments"])["city"]), parser
        calls = [c for s in streamed for c in s["delta"].get("tool_calls") or []]
        assert calls[0]["function"]["name"] == "get_weather", parser
        assert "".join(c["function"].get("arguments") or "" for c in calls) == call["function"]["arguments"]
        assert streamed[-1]["finish_reason"] == "tool_calls", parser
        choice, streamed = asyncio.run(answer(other, CALLS[parser]))
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"], (parser, other)
        assert re.fullmatch(CALLS[parser], choice["message"]["content"]), (parser, other)
        assert not any(s["delta"].get("tool_calls") for s in streamed), (parser, other)
