"""Structured output and forced tool calls through the real server, with the RANDOM-weight
default model: whatever validity the output has comes from the constraint."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import sys
import time

import jsonschema
import openai
import pytest
from server import MESSAGES, MODEL, post

from checkpoints import resolve_model
from jaxserve.structured_output import sandbox as grammar_sandbox
from jaxserve.structured_output.grammar import Constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object",
                    "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                   "city": {"type": "string", "maxLength": 12}},
                    "required": ["zip", "city"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
# As clients send it: no word on other keys, which vLLM's grammars and OpenAI's strict mode forbid.
OPEN_SCHEMA = {**{k: v for k, v in SCHEMA.items() if k != "additionalProperties"}, "properties": {
    **SCHEMA["properties"], "address": {k: v for k, v in SCHEMA["properties"]["address"].items()
                                        if k != "additionalProperties"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Please answer."}]


def test_json_schema_over_twenty_seeds(served):
    async def one(client, seed):
        r = await client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=240, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": OPEN_SCHEMA,
                                                                    "strict": True}})
        return r.choices[0]

    async def main():
        client = openai.AsyncOpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(client, seed) for seed in range(20)))

    for choice in asyncio.run(main()):
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@functools.cache
def _matching():
    """(llguidance's tokenizer, the HF one) of the built-in model, to check texts against grammars."""
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(resolve_model("jaxserve-tiny")))
    return llguidance.hf.from_tokenizer(hf), hf


def accepts(kind: str, value, text: str, thinking: tuple[str, str] | None = None, whole: bool = False) -> bool:
    """Whether the constraint's grammar takes every token of `text` (and, `whole`, ends there)."""
    import llguidance

    tokenizer, hf = _matching()
    matcher = llguidance.LLMatcher(tokenizer, Constraint(kind, value, thinking).grammar())
    ids = hf.encode(text, add_special_tokens=False)
    if not whole:
        return matcher.validate_tokens(ids) == len(ids)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_a_constraint_waits_for_the_thinking():
    """With a reasoning parser a constraint applies after the thinking, as in vLLM: free text up to
    the first </think>, which the output must write where it starts inside the thinking, and may
    leave out (thinking and all) where it would start with <think>."""
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    optional, inside = ("<think>", "</think>"), ("", "</think>")
    assert accepts("json_schema", schema, '<think>{no json} </thin here</think>{"a":1}', optional, whole=True)
    assert accepts("json_schema", schema, '<think>x</think>\n\n{"a":1}', optional, whole=True)
    assert not accepts("json_schema", schema, '<think>x</think>\n\nx', optional)
    assert accepts("json_schema", schema, '{"a":1}', optional, whole=True)
    assert not accepts("json_schema", schema, "<think>x</think>oops", optional)
    assert not accepts("json_schema", schema, '<think>x</think>{"a":1}</think>', optional)
    assert accepts("json_schema", schema, 'free {"a":1}</think>{"a":2}', inside, whole=True)
    assert not accepts("json_schema", schema, '{"a":1}', inside, whole=True)  # (still thinking)
    assert accepts("choice", ("yes", "no"), "q</think>no", inside, whole=True)
    assert accepts("regex", "[a-z]{3}", "<think>q</think>abc", optional, whole=True)


def test_object_schemas_allow_only_their_own_keys():
    """An object schema that lists its properties is closed to other keys (nested ones too, and
    the objects in $defs), as vLLM's default backend and OpenAI's strict mode make it; one that
    lists none, or says otherwise, stays open, and so do the parts of an allOf."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "o": {"$ref": "#/$defs/o"},
                                               "free": {"type": "object"}, "open": {
                                                   "type": "object", "properties": {"x": {"type": "integer"}},
                                                   "additionalProperties": {"type": "integer"}}},
              "required": ["a"], "$defs": {"o": {"type": "object", "properties": {"x": {"type": "string"}}}}}
    assert accepts("json_schema", json.dumps(schema), '{"a":1,"o":{"x":"q"},"free":{"k":1},"open":{"x":1,"y":2}}')
    for extra in ('{"a":1,"b":2}', '{"a":1,"o":{"x":"q","y":1}}'):
        assert not accepts("json_schema", json.dumps(schema), extra)
    both = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                      {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert accepts("json_schema", json.dumps(both), '{"a":1,"b":2}')


def test_regex_classes_are_ascii():
    """\\d, \\w and \\s in a regex are ASCII sets, as in vLLM's default backend and in JSON
    schema patterns: no Arabic-Indic digit for \\d, no é for \\w, no no-break space for \\s."""
    for regex, ascii_text, other in ((r"\d", "5", "٣"), (r"[\d]", "5", "٣"), (r"\w", "a", "é"),
                                     (r"\s", " ", "\u00a0"), (r"\D", "é", "5"), (r"[^\d]", "٣", "5")):
        assert accepts("regex", regex, ascii_text) and not accepts("regex", regex, other), regex
    assert accepts("regex", r"\\d", "\\d") and accepts("regex", r"[]\d]+", "]5")
    assert not accepts("json_schema", json.dumps({"type": "string", "pattern": r"^\d$"}), '"٣"')


def test_json_object_parses_when_it_stops(client):
    stopped = 0
    for seed in range(32):  # random weights: most objects run out of tokens; stop after two that close
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(r.choices[0].message.content), dict)
            if stopped == 2:
                break
    assert stopped == 2


def test_guided_choice_and_regex(client):
    for seed in range(6):
        r = client.completions.create(model=MODEL, prompt="pick", max_tokens=10, temperature=1.0, seed=seed,
                                      extra_body={"guided_choice": ["red", "green", "blue violet"]})
        assert r.choices[0].text in ("red", "green", "blue violet") and r.choices[0].finish_reason == "stop"
        r = client.completions.create(model=MODEL, prompt="code", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}(-x)?"})
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}(-x)?", r.choices[0].text)


def test_guided_json_and_grammar_extras(client):
    r = client.completions.create(model=MODEL, prompt="j", max_tokens=60, temperature=0.7, seed=1,
                                  extra_body={"guided_json": WEATHER["function"]["parameters"]})
    jsonschema.validate(json.loads(r.choices[0].text), WEATHER["function"]["parameters"])
    r = client.completions.create(model=MODEL, prompt="g", max_tokens=30, temperature=1.0, seed=2,
                                  extra_body={"guided_grammar": 'start: "yes" | "no" | "x" NUM\nNUM: /[0-9]+/'})
    assert re.fullmatch(r"yes|no|x[0-9]+", r.choices[0].text)
    for field in ("guided_grammar", "grammar"):  # (GBNF too; `grammar`: llama.cpp's name)
        r = client.completions.create(model=MODEL, prompt="g", max_tokens=30, temperature=1.0, seed=2,
                                      extra_body={field: 'root ::= "yes" | "no" | "x" [0-9]+'})
        assert re.fullmatch(r"yes|no|x[0-9]+", r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0.7, seed=1,
                                       extra_body={"json_schema": WEATHER["function"]["parameters"]})  # (llama.cpp's)
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER["function"]["parameters"])


def test_forced_named_tool_call_always_validates(client):
    for seed in range(6):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=1.0, seed=seed,
                                           tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None  # a forced call, as OpenAI
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_calls_validate_and_parallel_false_gives_one(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=1.0, seed=seed,
                                           tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_function_without_parameters_is_called_with_no_arguments(client):
    """OpenAI: omitting `parameters` defines a function with an empty parameter list."""
    ping = {"type": "function", "function": {"name": "ping", "description": "Ping the server"}}
    for seed in range(3):
        for choice in ("required", {"type": "function", "function": {"name": "ping"}}):
            r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=1.0, seed=seed,
                                               tools=[ping], tool_choice=choice, parallel_tool_calls=False)
            (call,) = r.choices[0].message.tool_calls
            assert call.function.name == "ping" and json.loads(call.function.arguments) == {}


def test_streamed_equals_non_streamed_at_temperature_zero(client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=240, temperature=0.0,
              response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == whole

    kw = dict(model=MODEL, messages=ASK, max_tokens=80, temperature=0.0, tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].function.name == "get_weather"  # the id and name come first
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_tool_turns_are_accepted_as_input(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "C"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=4)
    assert r.choices[0].message.role == "assistant"


def test_deprecated_functions_get_the_legacy_shape(client):
    kw = dict(model=MODEL, messages=ASK + [{"role": "function", "name": "get_time", "content": "noon"}],
              max_tokens=60, temperature=0.0, functions=[WEATHER["function"], TIME["function"]],
              function_call={"name": "get_weather"})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None  # a forced call
    assert choice.message.function_call.name == "get_weather"
    jsonschema.validate(json.loads(choice.message.function_call.arguments), WEATHER["function"]["parameters"])
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    calls = [c.choices[0].delta.function_call for c in chunks if c.choices[0].delta.function_call]
    assert calls[0].name == "get_weather"
    assert "".join(c.arguments or "" for c in calls) == choice.message.function_call.arguments


def _ref_chain(n: int) -> dict:
    """A JSON schema of nested arrays, each level a `$ref` to the next definition, n deep."""
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


# Constraints llguidance cannot compile safely in the server's process: a chain of $refs, or of Lark
# rules, that overflows its stack (a crash, unsandboxed), and a choice among so many strings that it
# compiles for minutes; each given as (route, field, value).
PATHOLOGICAL = [
    ("/v1/chat/completions", "response_format",
     {"type": "json_schema", "json_schema": {"name": "chain", "schema": _ref_chain(10_000)}}),
    ("/v1/completions", "guided_grammar",
     "start: r0\n" + "\n".join(f'r{i}: "x" r{i + 1}' for i in range(5000)) + '\nr5000: "y"'),
    ("/v1/completions", "guided_choice", [f"option number {i}" for i in range(100_000)]),
]


def test_pathological_grammars_are_quick_400s(served, monkeypatch):
    """Grammars that would crash the compiler or hold it for minutes are 400s within seconds, found
    in the grammar sandbox (`jaxserve/structured_output/sandbox.py`, here with a 1 s deadline); the engine's
    own check (the offline LLM's) refuses them too. A regex whose DFA would explode is built lazily
    by llguidance, and served. The server then serves a normal constrained request."""
    monkeypatch.setattr(grammar_sandbox, "GRAMMAR_CHECK_TIMEOUT_S", 1.0)
    for route, field, value in PATHOLOGICAL:
        start = time.monotonic()
        r = post(served, route, {"model": MODEL, "messages": MESSAGES, "prompt": "a", "max_tokens": 4, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text[:300])
        assert "is too complex" in r.json()["error"]["message"]
        assert time.monotonic() - start < 15, field
    with pytest.raises(ValueError, match="compiler down"):
        served[1].check_constraint(Constraint("json_schema", json.dumps(_ref_chain(10_000))))
    start = time.monotonic()
    r = post(served, "/v1/completions",
             {"model": MODEL, "prompt": "a", "max_tokens": 8, "guided_regex": "(a|b)*a(a|b){40}"})
    assert r.status_code == 200 and re.fullmatch("[ab]*", r.json()["choices"][0]["text"])
    assert time.monotonic() - start < 15
    r = post(served, "/v1/completions",
             {"model": MODEL, "prompt": "a", "max_tokens": 4, "guided_choice": ["yes", "no"]})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")


def test_a_sandbox_that_cannot_start_is_an_internal_error(monkeypatch):
    """A broken installation (the child cannot start) is the server's error, never the grammar's."""
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match="did not start"):
        grammar_sandbox.GrammarSandbox().check('start: "a"')


def _cut_and_whole(client, max_tokens: int, **kw):
    """A seeded request's tool calls when max_tokens cuts its answer, checked to be the same streamed
    (put together from the deltas), and the whole answer."""
    ask = dict(model=MODEL, messages=ASK, temperature=1.0, tools=[WEATHER, TIME], **kw)
    cut = client.chat.completions.create(max_tokens=max_tokens, **ask).choices[0]
    streamed, ends = {}, []
    for chunk in client.chat.completions.create(max_tokens=max_tokens, stream=True, **ask):
        choice = chunk.choices[0]
        assert not choice.delta.content  # (the role's chunk carries "")
        for piece in choice.delta.tool_calls or []:
            call = streamed.setdefault(piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""})
            assert call["id"] and piece.id in (None, call["id"]) and piece.function.name in (None, call["name"])
            call["arguments"] += piece.function.arguments or ""
        ends += [choice.finish_reason] if choice.finish_reason else []
    assert cut.finish_reason == "length" and ends == ["length"] and cut.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in cut.message.tool_calls or []]
    assert calls == [(c["name"], c["arguments"]) for c in streamed.values()]
    return calls, client.chat.completions.create(max_tokens=160, **ask).choices[0]


def test_a_required_answer_cut_by_max_tokens_is_the_calls_so_far(client):
    """tool_choice "required" cut by max_tokens: the whole calls, then the cut one (its name whole)
    with its arguments so far, a prefix of what they become; streamed the same; no content."""
    cut, whole = _cut_and_whole(client, 100, seed=6, tool_choice="required")  # (cut in its second call)
    assert whole.finish_reason == "tool_calls"
    (first, second), (whole_first, whole_second) = cut, whole.message.tool_calls
    assert first == (whole_first.function.name, whole_first.function.arguments)
    assert second[0] == whole_second.function.name and second[1] != whole_second.function.arguments
    assert whole_second.function.arguments.startswith(second[1])
    assert _cut_and_whole(client, 3, seed=6, tool_choice="required")[0] == []  # before a name: no call


def test_a_named_call_cut_by_max_tokens_is_its_arguments_so_far(client):
    """A named function cut by max_tokens: its call with the arguments so far; in the legacy shape too."""
    (call,), whole = _cut_and_whole(client, 12, seed=3,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert whole.finish_reason == "stop" and call[0] == "get_weather"
    assert whole.message.tool_calls[0].function.arguments.startswith(call[1]) and len(call[1]) > 2
    legacy = client.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=3, max_tokens=12,
                                            functions=[WEATHER["function"], TIME["function"]],
                                            function_call={"name": "get_weather"}).choices[0]
    assert legacy.finish_reason == "length" and legacy.message.content is None
    assert (legacy.message.function_call.name, legacy.message.function_call.arguments) == call
