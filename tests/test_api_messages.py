"""Anthropic's Messages API through the real server, with Anthropic's own SDK."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import pytest
from server import MAX_MODEL_LEN, MESSAGES, MODEL

from api.app import create_app
from api.limits import Limits
from api.messages import MessageBuilder
from api.response_models import DeltaMessage

SYSTEM, USER = MESSAGES[0]["content"], MESSAGES[1]["content"]
GREEDY = {"temperature": 0.0}  # (sampling fields the SDK no longer names: sent as extra_body, as Anthropic takes them)
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}]


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served[0].url, api_key="unused", max_retries=0)


def test_a_message_is_the_chat_answer_whole_and_streamed(served, claude, client):
    """Greedy text through /v1/messages equals /v1/chat/completions for the same conversation, with
    its usage and stop reason; streamed, the SDK's helpers assemble the same message from
    Anthropic's events in Anthropic's order; count_tokens is the prompt the message used."""
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0.0)
    ask = dict(model=MODEL, max_tokens=12, system=SYSTEM, messages=[{"role": "user", "content": USER}],
               extra_body=GREEDY)
    message = claude.messages.create(**ask)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    with claude.messages.stream(**ask) as stream:
        events = [event.type for event in stream if event.type != "text"]  # (the helper's own text events)
        final = stream.get_final_message()
    assert final.content[0].text == message.content[0].text and final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens
    assert events[0] == "message_start" and events[1] == "content_block_start"
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    raw = httpx.post(served[0].url + "/v1/messages", json={**ask.pop("extra_body"), **ask, "stream": True},
                     timeout=60).text
    names = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"  # (the SDK hides pings)
    count = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": USER}])
    assert count.input_tokens == message.usage.input_tokens
    # max_tokens is a bound: past the context's room (clients ask for tens of thousands), the room
    long = claude.messages.create(**{**ask, "max_tokens": 4096})  # (a 400 in chat: past max_model_len)
    assert long.usage.output_tokens <= MAX_MODEL_LEN - long.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):  # (messages that fill the context)
        claude.messages.create(**{**ask, "messages": [{"role": "user", "content": "hi " * MAX_MODEL_LEN}]})
    assert claude.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": "hi " * MAX_MODEL_LEN}]).input_tokens > MAX_MODEL_LEN  # (counted all the same)


def test_stop_sequences_and_a_continued_assistant_message(claude, client):
    ask = dict(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": USER}], extra_body=GREEDY)
    text = claude.messages.create(**ask).content[0].text
    stop = next(ch for ch in text[2:] if ch != "\ufffd")  # (a whole character of the answer)
    cut = claude.messages.create(**ask, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    # a final assistant message is continued, as chat's continue_final_message continues it
    turns = [*ask["messages"], {"role": "assistant", "content": "Hello"}]
    prefilled = claude.messages.create(**{**ask, "messages": turns})
    chat = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=12, temperature=0.0,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert prefilled.content[0].text == chat.choices[0].message.content
    assert prefilled.usage.input_tokens == chat.usage.prompt_tokens


def test_a_tool_use_round_trip(claude, client):
    """A forced tool call (tool_choice tool, and any: streamed as input_json_delta) is a tool_use block
    with its input parsed, stop_reason tool_use; sent back with its tool_result, the conversation is
    the chat conversation with the assistant's tool call and the tool's message, and is answered."""
    ask = dict(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
               extra_body=GREEDY)
    message = claude.messages.create(**ask, tool_choice={"type": "tool", "name": "get_weather"})
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and set(call.input) == {"city"}
    assert message.stop_reason == "tool_use"
    with claude.messages.stream(**ask, tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        deltas = [event.delta for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.stop_reason in ("tool_use", "max_tokens")  # (whitespace after)
    assert all(delta.type == "input_json_delta" for delta in deltas)
    assert json.loads("".join(delta.partial_json for delta in deltas)) == final.content[0].input
    turns = [*ask["messages"], {"role": "assistant", "content": [{"type": "tool_use", "id": call.id,
                                                                  "name": call.name, "input": call.input}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
                                          {"type": "text", "text": "Thanks!"}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=8, messages=turns, tools=TOOLS, extra_body=GREEDY)
    assert answer.content[0].type == "text" and answer.stop_reason in ("max_tokens", "end_turn")
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0.0, tools=[
        {"type": "function", "function": {"name": t["name"], "description": t["description"],
                                          "parameters": t["input_schema"]}} for t in TOOLS], messages=[
        *ask["messages"], {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}, {"role": "user", "content": "Thanks!"}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.content[0].text == chat.choices[0].message.content


def test_errors_take_anthropics_envelope_and_classes(served, claude):
    """What cannot be served is the SDK's BadRequestError (images, a missing max_tokens, thinking
    without a reasoning parser, server tools), an unknown model its NotFoundError, a full
    queue 529, its OverloadedError; Anthropic's `x-api-key` passes --api-key."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    bad = [dict(messages=[{"role": "user", "content": [image]}], max_tokens=4),
           dict(messages=[{"role": "user", "content": "hi"}], max_tokens=4096, thinking={"type": "enabled",
                                                                                      "budget_tokens": 2048}),
           dict(messages=[{"role": "user", "content": "hi"}], max_tokens=4, tools=[{"type": "web_search_20250305",
                                                                                 "name": "web_search"}])]
    for body, says in zip(bad, ("images and documents are not", "--reasoning-parser", "only custom tools")):
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model=MODEL, **body)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert says in e.value.body["error"]["message"]
    r = httpx.post(served[0].url + "/v1/messages", json={"model": MODEL, "messages": [{"role": "user",
                                                                                             "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(served[0].url + "/v1/messages", json={"model": MODEL, "max_tokens": "4", "messages": [
        {"role": "user", "content": "hi"}]})  # (a string is not the schema's integer)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(served[0].url + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "temperature": 1.5,
                                                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]  # (Anthropic's is 0..1)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    bound = served[1].admission
    bound.max_queued_requests = 1
    bound.admit([("queued-elsewhere", [1, 2, 3])])
    try:
        with pytest.raises(anthropic.OverloadedError) as e:
            claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
        assert e.value.response.headers["Retry-After"] == "1"
    finally:
        bound.max_queued_requests = None
        bound.forget(["queued-elsewhere"])

    async def keyed():
        test = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), api_key="s3cret").test_client()
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        denied = await test.post("/v1/messages", json=body, headers={"x-api-key": "nope"})
        allowed = await test.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": "s3cret"})
        return denied.status_code, await denied.get_json(), allowed.status_code

    status, error, allowed = asyncio.run(keyed())
    assert (status, error["error"]["type"], allowed) == (401, "authentication_error", 200)


def test_thinking_with_a_reasoning_parser(served):
    """With --reasoning-parser, `thinking` is taken (the template's enable_thinking) and the chat's
    reasoning deltas are a thinking block before the text, streamed as thinking_delta."""
    async def ask(thinking: dict):
        test = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), reasoning_parser="qwen3").test_client()
        r = await test.post("/v1/messages", json={"model": MODEL, "max_tokens": 24, "thinking": thinking,
                                                  "messages": [{"role": "user", "content": "hi"}],
                                                  "temperature": 0.0, "stop_sequences": ["a"]})
        return r.status_code, await r.get_json()

    status, message = asyncio.run(ask({"type": "enabled", "budget_tokens": 16}))
    assert status == 200 and message["type"] == "message"
    assert asyncio.run(ask({"type": "enabled", "budget_tokens": 24}))[0] == 400  # (not under max_tokens)
    assert asyncio.run(ask({"type": "disabled"}))[0] == 200
    builder = MessageBuilder("msg_1", MODEL, 3)
    events = [*builder.start(), *builder.delta(DeltaMessage(reasoning="hmm")), *builder.delta(DeltaMessage(
        reasoning=" ok")), *builder.delta(DeltaMessage(content="yes")), *builder.finish("stop", None, 4)]
    assert builder.message.content == [{"type": "thinking", "thinking": "hmm ok", "signature": ""},
                                       {"type": "text", "text": "yes"}]
    assert sum("thinking_delta" in e for e in events) == 2 and builder.message.stop_reason == "end_turn"
    hidden = MessageBuilder("msg_2", MODEL, 3, show_thinking=False)  # (thinking.display: "omitted")
    [*hidden.delta(DeltaMessage(reasoning="hmm")), *hidden.delta(DeltaMessage(content="yes"))]
    assert hidden.message.content == [{"type": "text", "text": "yes"}]
