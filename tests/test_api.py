"""The real server (Hypercorn on 127.0.0.1, a free port) driven by the OpenAI SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server import MAX_MODEL_LEN, MODEL, post

from api.app import create_app
from api.cors import CorsPolicy
from api.responses import ResponseBuilder
from api.reasoning import ChoiceReasoning, split_reasoning
from api.protocol import Limits

GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]


def test_health_and_models(served, client):
    assert httpx.get(served[0].url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert card.model_extra["root"] == MODEL and card.model_extra["permission"][0]["allow_sampling"]  # vLLM's fields
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert httpx.get(served[0].url + "/version").json()["version"]


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


def test_completion_prompt_forms(served, client):
    r = client.completions.create(model=MODEL, prompt="Once upon", **GREEDY)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.choices[0].finish_reason == "length"
    ids = list(b"Once upon")
    for prompt in (ids, ["Once upon", "a time"], [ids, list(b"a time")]):
        r2 = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
        assert r2.choices[0].text == r.choices[0].text
        assert [c.index for c in r2.choices] == list(range(len(r2.choices)))
    assert r2.usage.prompt_tokens == len(ids) + len(b"a time") and r2.usage.completion_tokens == 24
    as_ints = {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop_token_ids": [97, 98]}
    as_floats = {**as_ints, "prompt": [float(t) for t in ids], "max_tokens": 12.0, "stop_token_ids": [97.0, 98.0]}
    ints, floats = post(served, "/v1/completions", as_ints), post(served, "/v1/completions", as_floats)
    assert floats.status_code == 200 and floats.json()["choices"] == ints.json()["choices"]  # whole floats: ints
    raw = post(served, "/v1/chat/completions", {"prompt": "Once upon", "max_tokens": 12, "temperature": 0,
                                                "ignore_eos": True})
    assert raw.status_code == 200 and raw.json()["choices"][0]["message"]["content"] == r.choices[0].text


def test_streamed_text_equals_non_streamed(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **GREEDY))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content

    whole = client.completions.create(model=MODEL, prompt=["abc", "xyz"], **GREEDY)
    pieces = {0: "", 1: ""}
    finish = {}
    for c in client.completions.create(model=MODEL, prompt=["abc", "xyz"], stream=True, **GREEDY):
        for ch in c.choices:
            pieces[ch.index] += ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert [pieces[i] for i in (0, 1)] == [c.text for c in whole.choices] and finish == {0: "length", 1: "length"}


def test_streamed_line_separators_stay_inside_their_event(served):
    """U+2028, U+2029 and U+0085 are legal raw in JSON, but httpx's and requests' `iter_lines`
    split lines at them (str.splitlines): events carry them escaped, so such a client reads whole
    events."""
    text = "a\u2028b\u0085c\u2029d"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 16, "temperature": 0, "stream": True,
            "guided_choice": [text]}
    with httpx.Client(base_url=served[0].url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == text


def test_stream_usage_option(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    every = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}, **GREEDY))  # vLLM's: usage in every chunk
    counts = [c.usage.completion_tokens for c in every]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 12 and len(set(counts)) > 2
    assert all(c.usage.prompt_tokens == every[-1].usage.prompt_tokens for c in every)
    two = list(client.completions.create(model=MODEL, prompt="two", n=2, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    for index in (0, 1):  # each choice's chunks count its own tokens
        assert [c.usage.completion_tokens for c in two if c.choices and c.choices[0].index == index][-1] == 12
    assert two[-1].usage.completion_tokens == 24


@pytest.mark.parametrize("field,value", [("max_tokens", 37), ("max_completion_tokens", 37), ("max_tokens", 37.0)])
def test_max_tokens_with_ignore_eos_is_exact(client, field, value):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.7, seed=3,
                                       extra_body={"ignore_eos": True, field: value})
    assert r.usage.completion_tokens == 37 and r.choices[0].finish_reason == "length"


def test_seed_reproducible_over_http(client):
    kw = dict(model=MODEL, prompt="seeded", max_tokens=16, temperature=1.0, top_p=0.9, seed=11,
              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_sixteen_concurrent_streams_complete(served):
    async def one(client, i):
        text, finish = "", None
        stream = await client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=20 + i,
                                                 temperature=0.5, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return finish

    async def main():
        client = openai.AsyncOpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(16)))

    assert asyncio.run(main()) == ["length"] * 16


BAD_REQUESTS = [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", {"model": "nope", "prompt": "a"}, 404, "model"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", '{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "a", "top_p": Infinity}', 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "seed": 10**30}, 400, "seed"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "a", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("/v1/completions", {"prompt": "a", "n": 16385}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "stop": [str(i) for i in range(65)]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "a", "use_beam_search": True, "top_k": 5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "a", "bad_words": ["  "]}, 400, "bad_words"),
    ("/v1/completions", {"prompt": "a", "priority": 1}, 400, "priority"),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": [99999]}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, 400, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "a", "user": 5}, 400, "user"),
    ("/v1/completions", {"prompt": "a", "logit_bias": [1, 2]}, 400, "logit_bias"),
    ("/v1/responses", {"input": "a", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "metadata": "x"}, 400, "metadata"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "parallel_tool_calls": "x"}, 400,
     "parallel_tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "modalities": ["text", "audio"]}, 400,
     "modalities"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "audio": {"voice": "alloy"}}, 400,
     "audio"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "web_search_options": {}}, 400,
     "web_search_options"),
    ("/v1/completions", {"prompt": "a", "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"structural_tag": "x"}}, 400, "structured_outputs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "echo": True, "logprobs": True}, 400,
     "echo"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "frequency_penalty": "x"}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "(unclosed"}, 400, "guided_regex"),
    ("/v1/completions", {"prompt": "a", "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {"prompt": "a", "guided_choice": ["a"], "guided_regex": "b"}, 400, "guided_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"},
     400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                        "function": {"name": "g"}}},
     400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", [1, 2]]}, 400, "prompt"),  # strings and token ids mixed
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": 7, "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": 3}, 400,
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "chat_template_kwargs": {"conversations": []}}, 400, "chat_template_kwargs"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(served, client, path, body, status, param):
    r = post(served, path, body)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    ok = client.completions.create(model=MODEL, prompt="still fine", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_default_max_tokens_and_unknown_routes(served):
    r = post(served, "/v1/completions", {"prompt": "a", "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16  # the completions API's default
    r = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "ignore_eos": True})
    assert r.json()["usage"]["total_tokens"] == MAX_MODEL_LEN  # chat: the rest of the context
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, served[0].url + path)
        assert r.status_code == status and r.json()["error"]["message"]


def test_too_long_prompt_names_both_lengths(served):
    r = post(served, "/v1/completions", {"prompt": "x" * (MAX_MODEL_LEN - 10), "max_tokens": 20})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert str(MAX_MODEL_LEN) in message and str(MAX_MODEL_LEN - 10) in message and str(MAX_MODEL_LEN + 10) in message
    r = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * MAX_MODEL_LEN}]})
    assert r.status_code == 400 and "leave no room for an output token" in r.json()["error"]["message"]


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


def test_client_disconnect_frees_its_pages(served):
    server, async_engine = served
    allocator = async_engine.engine.scheduler.allocator
    aborted = async_engine.engine.scheduler.finish_counts["abort"]
    body = {"prompt": "x", "max_tokens": 180, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert allocator.num_free < allocator.num_usable  # it holds pages while streaming
    deadline = time.time() + 20
    while allocator.num_free != allocator.num_usable and time.time() < deadline:
        time.sleep(0.05)
    assert allocator.num_free == allocator.num_usable
    assert not async_engine.engine.has_unfinished()
    assert async_engine.engine.scheduler.finish_counts["abort"] == aborted + 1  # cut short, not finished


def test_api_key_guards_v1_routes(served):
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), api_key="s3cret")

    async def check():
        test = app.test_client()
        assert (await test.get("/health")).status_code == 200
        denied = await test.get("/v1/models")
        assert denied.status_code == 401 and (await denied.get_json())["error"]["code"] == "invalid_api_key"
        wrong = await test.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert (await test.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status_code == 200
        assert (await test.post("/invocations", json={"prompt": "a"})).status_code == 401

    asyncio.run(check())


def test_requests_are_logged_when_asked(served, caplog):
    """--enable-log-requests: one log line per request, with its id and prompt length."""
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), log_requests=True)

    async def check():
        response = await app.test_client().post("/v1/completions", json={"model": MODEL, "prompt": "abc",
                                                                          "max_tokens": 1})
        return await response.get_json()

    with caplog.at_level("INFO", logger="api.generation"):
        body = asyncio.run(check())
    (line,) = [r.getMessage() for r in caplog.records if r.name == "api.generation"]
    assert body["id"] in line and "[3]" in line


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


def test_sampling_defaults_of_the_generation_config(served):
    """vLLM's --generation-config auto: the model's settings for the fields a request leaves out
    (temperature 0 here: greedy), its max_new_tokens a cap on every request's max_tokens, and the
    rest of the context where a chat request sets none."""
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260, sampling_defaults={"temperature": 0.0,
                                                                                       "max_tokens": 5}))
    body = {"model": MODEL, "prompt": "Once upon", "ignore_eos": True}

    async def check():
        test = app.test_client()

        async def post(path, **fields):
            response = await test.post(path, json={**body, **fields})
            assert response.status_code == 200
            return await response.get_json()

        capped = await post("/v1/completions", max_tokens=50)
        greedy = await post("/v1/completions", max_tokens=5, temperature=0.0)
        sampled = await post("/v1/completions", max_tokens=5, temperature=1.5, seed=3)
        assert capped["usage"]["completion_tokens"] == 5
        assert capped["choices"][0]["text"] == greedy["choices"][0]["text"] != sampled["choices"][0]["text"]
        chat = await post("/v1/chat/completions", messages=MESSAGES)
        assert chat["usage"]["completion_tokens"] == 5

    asyncio.run(check())


def test_responses_api_is_the_chat_answer(client):
    """OpenAI's Responses API: `instructions` + `input` answer as the chat request with a system
    message would, as a message item with output_text; max_output_tokens reached is "incomplete".
    Streamed: created, in_progress, the item and part added, text deltas, then every "done" and
    response.incomplete, in sequence order, adding up to the same response."""
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    ask = dict(model=MODEL, instructions=MESSAGES[0]["content"], input=[{"role": "user", "content": "Say hello"}],
               max_output_tokens=12, temperature=0.0)
    r = client.responses.create(**ask)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL and not r.store
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert item.status == "incomplete"  # the output ran out in it
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    events = list(client.responses.create(**ask, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text and events[-1].response.usage.output_tokens == 12
    assert events[-2].item.status == "incomplete"


def test_responses_api_logprobs_tools_and_errors(served, client):
    """Logprobs through `include` (top_logprobs alternatives each), a forced function call as a
    function_call item (streamed as argument deltas), function_call and function_call_output
    items as input, and 400s for what the server does not keep or run."""
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=6, temperature=0.0, top_logprobs=2,
                                include=["message.output_text.logprobs"], reasoning={"effort": "low"})
    assert r.reasoning.effort == "low"  # (the chat template's reasoning_effort, as chat's)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == 6 and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    tools = [{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}]
    forced = dict(model=MODEL, input="Weather?", tools=tools, tool_choice={"type": "function", "name": "get_weather"},
                  max_output_tokens=60, temperature=0.0)
    r = client.responses.create(**forced)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    events = list(client.responses.create(**forced, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments == events[-1].response.output[0].arguments
    follow_up = client.responses.create(model=MODEL, max_output_tokens=4, tools=tools, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow_up.usage.input_tokens > r.usage.input_tokens and follow_up.usage.output_tokens == 4
    for bad, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                       ({"tools": [{"type": "web_search"}]}, "tools"),
                       ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
                       ({"include": ["reasoning.encrypted_content"]}, "include"),
                       ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning")):
        refused = post(served, "/v1/responses", {"model": MODEL, "input": "Hi", **bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, bad


def test_cors_lets_web_pages_call_the_api(served):
    """vLLM's default CORS policy (any origin, method and header; no credentials) over HTTP: the
    preflight is answered before the API key is asked for, and answers (errors too) name the origin.
    A narrower policy refuses other origins, methods and headers."""
    origin = {"Origin": "https://app.example"}
    preflight = httpx.options(served[0].url + "/v1/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, x-stainless-os"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, x-stainless-os"
    answered = post(served, "/v1/completions", {"prompt": "a", "max_tokens": 1})
    assert "access-control-allow-origin" not in answered.headers  # no Origin: not a browser's cross-origin call
    for r in (httpx.post(served[0].url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=origin),
              httpx.post(served[0].url + "/v1/completions", json={"prompt": "a", "temperature": -1}, headers=origin),
              httpx.get(served[0].url + "/v1/models", headers=origin)):
        assert r.status_code in (200, 400) and r.headers["access-control-allow-origin"] == "*"

    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), api_key="k", cors=CorsPolicy(
        allowed_origins=("https://app.example",), allowed_methods=("GET", "POST"), allowed_headers=("authorization",),
        allow_credentials=True))

    def ask(origin: str, method: str = "POST", headers: str = "authorization"):
        return {"Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers}

    async def check():
        test = app.test_client()
        ok = await test.options("/v1/models", headers=ask("https://app.example"))
        assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert ok.headers["Access-Control-Allow-Credentials"] == "true" and "Origin" in ok.headers["Vary"]
        assert ok.headers["Access-Control-Allow-Methods"] == "GET, POST"
        for refused, what in ((ask("https://evil.example", "DELETE"), "origin, method"),
                              (ask("https://app.example", headers="x-secret"), "headers")):
            r = await test.options("/v1/models", headers=refused)
            assert r.status_code == 400 and (await r.get_data(as_text=True)) == f"Disallowed CORS {what}"
        assert "Access-Control-Allow-Origin" not in (await test.options("/v1/models", headers=ask("https://e.example")
                                                                         )).headers
        denied = await test.get("/v1/models", headers={"Origin": "https://app.example"})  # no key: 401, readable
        assert denied.status_code == 401 and denied.headers["Access-Control-Allow-Origin"] == "https://app.example"
        other = await test.get("/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer k"})
        assert other.status_code == 200 and "Access-Control-Allow-Origin" not in other.headers

    asyncio.run(check())


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


def test_several_served_model_names(served):
    """vLLM's `--served-model-name A B`: requests may name either, and answers carry the name asked
    for (the first where a request names none); /v1/models lists both."""
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260, other_model_names=("alias",)))

    async def check():
        test = app.test_client()
        listed = await (await test.get("/v1/models")).get_json()
        assert [card["id"] for card in listed["data"]] == [MODEL, "alias"]
        assert (await (await test.get("/v1/models/alias")).get_json())["id"] == "alias"
        answer = await test.post("/v1/completions", json={"model": "alias", "prompt": "a", "max_tokens": 1})
        assert answer.status_code == 200 and (await answer.get_json())["model"] == "alias"
        unnamed = await test.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
        assert (await unnamed.get_json())["model"] == MODEL
        unknown = await test.post("/v1/completions", json={"model": "other", "prompt": "a", "max_tokens": 1})
        assert unknown.status_code == 404 and "'alias'" in (await unknown.get_json())["error"]["message"]

    asyncio.run(check())


def test_prompts_are_tokenized_off_the_event_loop(served, monkeypatch):
    """While a prompt is tokenized (seconds for megabytes of text) the server goes on answering: here
    the tokenizing of one prompt waits until /health has been answered, which the event loop could
    not do if it were the one tokenizing."""
    tokenizer = served[1].tokenizer
    entered, answered = threading.Event(), threading.Event()
    encode = tokenizer.encode

    def held_encode(text, add_special_tokens=True):
        if text == "held up":
            entered.set()
            assert answered.wait(60)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", held_encode)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, served, "/v1/completions", {"model": MODEL, "prompt": "held up", "max_tokens": 2})
        assert entered.wait(60)
        assert httpx.get(served[0].url + "/health", timeout=30).status_code == 200
        answered.set()
        assert pending.result().status_code == 200


def test_vllm_routes_ping_load_invocations(served, monkeypatch):
    """vLLM's /ping (GET and POST), /load (the requests being generated) and /invocations (chat or
    completions, by the body)."""
    url = served[0].url
    assert httpx.get(url + "/ping").status_code == 200 and httpx.post(url + "/ping").status_code == 200
    assert httpx.get(url + "/load").json() == {"server_load": 0}
    generate, resume = served[1].generate, threading.Event()

    async def held(*args):  # up to the first text, then nothing until the test has read the load
        async for update in generate(*args):
            yield update
            while update.text and not resume.is_set():
                await asyncio.sleep(0.01)

    monkeypatch.setattr(served[1], "generate", held)
    body = {"model": MODEL, "prompt": "load", "max_tokens": 20, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert httpx.get(url + "/load").json() == {"server_load": 1}
        resume.set()
        list(lines)
    assert httpx.get(url + "/load").json() == {"server_load": 0}
    chat = post(served, "/invocations", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] <= 2
    completion = post(served, "/invocations", {"prompt": "hi", "max_tokens": 2}).json()
    assert completion["object"] == "text_completion"
    assert post(served, "/invocations", {"input": "hi"}).status_code == 400


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


def test_reasoning_split_is_the_same_whole_and_in_any_pieces():
    """`ChoiceReasoning` fed a text in random pieces (tags cut anywhere) gives what `split_reasoning`
    gives for it whole, for both starts (inside the thinking or not)."""
    rng = random.Random(0)
    texts = ["<think>\nhmm</think>\n\nyes", "plain answer", "  <thi", "<think>", "<think>abc</th", "",
             "still thinking", "I think so.</think>The answer is 4.", "<think>a</think>b</think>c"]
    for thinking in (False, True):
        for text in texts:
            whole = split_reasoning(thinking, text)
            for _ in range(30):
                cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
                choice, reasoning, content = ChoiceReasoning(thinking), "", ""
                for a, b in zip([0, *cuts], [*cuts, len(text)]):
                    more_reasoning, more_content = choice.feed(text[a:b])
                    reasoning, content = reasoning + more_reasoning, content + more_content
                more_reasoning, more_content = choice.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
                assert (reasoning if choice.reasoned else None, content or None) == whole, (text, cuts)
    assert split_reasoning(False, "<think>\nhmm</think>\n\nyes") == ("\nhmm", "\n\nyes")
    assert split_reasoning(False, "plain answer") == (None, "plain answer")
    assert split_reasoning(True, "still thinking") == ("still thinking", None)
