"""Server-sent events through the real server: streamed text equals the whole answer, events stay
whole, usage in streams, many streams at once, and a client that goes away."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
from server import MESSAGES, MODEL

GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


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


def test_sixteen_concurrent_streams_complete(served, client):
    """Sixteen streams at once, of different prompts and lengths (every other one greedy, the rest
    seeded at temperature 0.5), each end by their length and write what the same request writes
    alone: a sequence's tokens do not depend on what shares its batch."""
    def request(i):
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.5, seed=100 + i)
        return dict(model=MODEL, prompt=f"request {i}", max_tokens=20 + i, extra_body={"ignore_eos": True},
                    **sampling)

    async def one(client, i):
        text, finish = "", None
        stream = await client.completions.create(stream=True, **request(i))
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        client = openai.AsyncOpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(16)))

    together = asyncio.run(main())
    assert [finish for _, finish in together] == ["length"] * 16
    alone = [client.completions.create(**request(i)).choices[0] for i in range(16)]
    assert [text for text, _ in together] == [choice.text for choice in alone]
    assert len({choice.text for choice in alone}) == 16


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
    deadline = time.time() + 20  # (the pages come back first; the step in flight ends at the next step)
    while ((allocator.num_free != allocator.num_usable or async_engine.engine.has_unfinished())
           and time.time() < deadline):
        time.sleep(0.05)
    assert allocator.num_free == allocator.num_usable
    assert not async_engine.engine.has_unfinished()
    assert async_engine.engine.scheduler.finish_counts["abort"] == aborted + 1  # cut short, not finished
