"""OpenAI's Responses API through the real server."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from server import MAX_MODEL_LEN, MESSAGES, MODEL, post
from test_api_metrics import scrape

GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


def test_responses_api_is_the_chat_answer(client):
    """OpenAI's Responses API: `instructions` + `input` answer as the chat request with a system
    message would, as a message item with output_text; max_output_tokens reached is "incomplete".
    Streamed: created, in_progress, the item and part added, text deltas, then every "done" and
    response.incomplete, in sequence order, adding up to the same response."""
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    ask = dict(model=MODEL, instructions=MESSAGES[0]["content"], input=[{"role": "user", "content": "Say hello"}],
               max_output_tokens=12, temperature=0.0)
    r = client.responses.create(**ask)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL and r.store
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
    for bad, param in (({"previous_response_id": 1}, "previous_response_id"), ({"store": "yes"}, "store"),
                       ({"tools": [{"type": "web_search"}]}, "tools"),
                       ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
                       ({"include": ["reasoning.encrypted_content"]}, "include"),
                       ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning")):
        refused = post(served, "/v1/responses", {"model": MODEL, "input": "Hi", **bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, bad


def test_stored_responses_continue_their_conversation_and_are_read_and_deleted(served, client):
    """OpenAI's `store` (true by default): previous_response_id continues a stored response's
    conversation (its input and output items before the new input: the chat answer to those
    messages, chained over two responses, without the earlier instructions); GET reads a stored
    response back, DELETE drops it (a 404 after); `store: false` keeps nothing; an unknown
    previous_response_id is a 400, as OpenAI's."""
    ask = dict(model=MODEL, max_output_tokens=5, temperature=0.0)
    first = client.responses.create(**ask, input="Say hello", instructions="Be brief.")
    assert first.store and client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(**ask, input="And again", previous_response_id=first.id)
    third = client.responses.create(**ask, input=[{"role": "user", "content": "Once more"}],
                                    previous_response_id=second.id)
    assert (second.previous_response_id, third.previous_response_id, second.instructions) == (first.id, second.id, None)
    messages = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And again"}]
    for response, conversation in ((second, messages), (third, [*messages, {"role": "assistant", "content": (
            second.output_text)}, {"role": "user", "content": "Once more"}])):
        chat = client.chat.completions.create(model=MODEL, messages=conversation, temperature=0.0, max_tokens=5)
        assert response.output_text == chat.choices[0].message.content
        assert response.usage.input_tokens == chat.usage.prompt_tokens
    listed = client.responses.input_items.list(third.id, order="asc")
    assert [item.type for item in listed.data] == ["message"] and listed.data[0].content[0].text == "Once more"
    assert listed.data[0].id.startswith("msg_") and not listed.has_more
    items = post(served, "/v1/responses", {**ask, "input": [{"role": "user", "content": f"part {i}"} for i in range(3)],
                                           "model": MODEL}).json()["id"]
    page = client.responses.input_items.list(items, limit=2)  # (newest first)
    assert [item.content[0].text for item in page.data] == ["part 2", "part 1"] and page.has_more
    rest = client.responses.input_items.list(items, limit=2, after=page.last_id)
    assert [item.content[0].text for item in rest.data] == ["part 0"] and not rest.has_more
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert client.responses.create(**ask, input="Still", previous_response_id=second.id).status == "incomplete"
    unstored = client.responses.create(**ask, input="Forget me", store=False)
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    missing = post(served, "/v1/responses", {**ask, "input": "Hi", "previous_response_id": "resp_missing"})
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "previous_response_not_found"


FORECAST = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["C", "F"]}}, "required": ["city", "days", "unit"], "additionalProperties": False}


def test_responses_text_format_shapes_the_output(client):
    """`text.format`: a json_schema output parses and validates against its schema, whole and
    streamed, at temperature 1 (the random model writes JSON only where the format makes it);
    json_object, given room, writes a whole JSON object; the response carries the format asked for."""
    fmt = {"type": "json_schema", "name": "forecast", "schema": FORECAST, "strict": True}
    ask = dict(model=MODEL, input="Forecast?", max_output_tokens=200, temperature=1.0)
    for _ in range(3):
        r = client.responses.create(**ask, text={"format": fmt})
        assert r.status == "completed", r.incomplete_details
        jsonschema.validate(json.loads(r.output_text), FORECAST)
    assert r.text.format.type == "json_schema" and r.text.format.name == "forecast"
    events = list(client.responses.create(**ask, text={"format": fmt}, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    jsonschema.validate(json.loads(streamed), FORECAST)
    assert events[-1].type == "response.completed" and events[-1].response.output_text == streamed
    # (greedy, with room: the random model closes an object with a member after "ok"; after most inputs it
    # writes one endless key)
    obj = client.responses.create(**{**ask, "input": "ok", "max_output_tokens": 280, "temperature": 0.0},
                                  text={"format": {"type": "json_object"}})
    assert obj.status == "completed", obj.incomplete_details
    assert len(json.loads(obj.output_text)) == 1
    free = client.responses.create(**{**ask, "temperature": 0.0}, text={"format": {"type": "text"}}).output_text
    with pytest.raises(ValueError):
        json.loads(free)  # (without a format, not JSON)


def _until_finished(client, response_id: str):
    while (r := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        time.sleep(0.05)
    return r


def test_background_responses_run_on_their_own_and_are_cancelled(served, client):
    """OpenAI's `background`: answered at once ("queued"), then read by GET as it grows, to the same
    answer as the request without it; streamed, the same events, and GET ...?stream=true resumes them
    after a sequence number; POST .../cancel stops one running ("cancelled", its sequences aborted,
    again the same), and is a 400 for a response not made in the background; a background response
    must be stored; one running cannot be continued yet."""
    ask = dict(model=MODEL, input="Say hello", max_output_tokens=12, temperature=0.0)
    whole = client.responses.create(**ask)
    queued = client.responses.create(**ask, background=True)
    assert queued.status == "queued" and queued.background and queued.output == []
    done = _until_finished(client, queued.id)
    assert done.status == "incomplete" and done.output_text == whole.output_text and done.background
    events = list(client.responses.create(**ask, background=True, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "queued" and events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == whole.output_text
    resumed = list(client.responses.retrieve(events[0].response.id, stream=True, starting_after=3))
    assert [e.sequence_number for e in resumed] == list(range(4, len(events)))
    assert [e.type for e in resumed] == [e.type for e in events[4:]]
    aborted = scrape(served).get("jaxserve:request_success_total|abort", 0)
    long = client.responses.create(**{**ask, "max_output_tokens": MAX_MODEL_LEN - 32}, background=True)
    early = post(served, "/v1/responses", {**ask, "previous_response_id": long.id})
    assert early.status_code == 400 and early.json()["error"]["param"] == "previous_response_id"
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.usage is None
    assert client.responses.cancel(long.id).status == "cancelled"  # (again: the same)
    shown = client.responses.retrieve(long.id)
    assert shown.status == "cancelled" and shown.output == cancelled.output
    assert scrape(served)["jaxserve:request_success_total|abort"] == aborted + 1  # (its sequence aborted)
    refused = post(served, f"/v1/responses/{whole.id}/cancel", {})
    assert refused.status_code == 400 and "synchronous" in refused.json()["error"]["message"]
    unstored = post(served, "/v1/responses", {**ask, "background": True, "store": False})
    assert unstored.status_code == 400 and unstored.json()["error"]["param"] == "background"
    not_bool = post(served, "/v1/responses", {**ask, "background": "yes"})
    assert not_bool.status_code == 400 and not_bool.json()["error"]["param"] == "background"
    not_streamed = httpx.get(f"{served[0].url}/v1/responses/{whole.id}?stream=true", timeout=30)
    assert not_streamed.status_code == 400 and not_streamed.json()["error"]["param"] == "stream"
    for after in ("-5", "x"):
        wrong = httpx.get(f"{served[0].url}/v1/responses/{long.id}?stream=true&starting_after={after}", timeout=30)
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "starting_after"


def test_the_store_keeps_background_responses_while_they_run():
    """A full store drops its least recently used responses, but not a background one still running
    (its answer would be lost, and it could not be cancelled), nor the one just stored."""
    from types import SimpleNamespace

    from api.errors import APIError
    from api.response_objects import ResponseObject
    from api.response_store import ResponseStore

    def response(response_id: str) -> ResponseObject:
        return ResponseObject(id=response_id, created_at=0, model=MODEL, temperature=1.0, text={}, tool_choice="auto",
                              tools=[], top_p=1.0, metadata={})

    store, run = ResponseStore(1), SimpleNamespace(done=False)
    store.put(response("running"), [], 0, run)
    store.put(response("b"), [], 0)
    assert store.get("running").run is run and store.get("b")  # (over capacity while one runs)
    store.put(response("c"), [], 0)
    with pytest.raises(APIError, match="not found"):
        store.get("b")
    run.done = True
    store.put(response("d"), [], 0)
    assert [store.get("d").response.id] == ["d"]
    for gone in ("running", "c"):
        with pytest.raises(APIError, match="not found"):
            store.get(gone)
