"""Tool-call parsers on crafted model outputs, whole and streamed character by character."""

from __future__ import annotations

import json
import re

import pytest

from api.response_models import given
from api.tool_parsers import PARSERS, ToolCallStreamer, parser_for_template
from api.tools import ChoiceTools, ToolRequest

WEATHER = {"city": "Paris", "unit": "C"}
TIME = {"tz": "UTC"}

CASES = {
    "hermes": [
        ("Let me check.\n<tool_call>\n" + json.dumps({"name": "weather", "arguments": WEATHER}) + "\n</tool_call>",
         "Let me check.\n", [("weather", WEATHER)]),
        ("<tool_call>" + json.dumps({"name": "weather", "arguments": WEATHER}) + "</tool_call>\n<tool_call>"
         + json.dumps({"name": "time", "arguments": TIME}) + "</tool_call>", None, [("weather", WEATHER), ("time", TIME)]),
        ("<tool_call>{\"name\": \"weather\", \"arguments\": {\"city\": }</tool_call>", "MALFORMED", []),
        ("no tools here, just < and > signs", "no tools here, just < and > signs", []),
    ],
    "llama3_json": [
        (json.dumps({"name": "weather", "parameters": WEATHER}), None, [("weather", WEATHER)]),
        ("\n" + json.dumps({"name": "weather", "parameters": WEATHER}), "\n", [("weather", WEATHER)]),
        ("<|python_tag|>" + json.dumps({"name": "weather", "parameters": WEATHER}) + "; "
         + json.dumps({"name": "time", "parameters": TIME}), None, [("weather", WEATHER), ("time", TIME)]),
        ('{"name": "weather", "parameters": {"city": "Par', "MALFORMED", []),
        ("The answer is 42.", "The answer is 42.", []),
    ],
    "mistral": [
        ("Sure. [TOOL_CALLS]" + json.dumps([{"name": "weather", "arguments": WEATHER}]), "Sure. ",
         [("weather", WEATHER)]),
        ("[TOOL_CALLS]" + json.dumps([{"name": "weather", "arguments": WEATHER}, {"name": "time", "arguments": TIME}]),
         None, [("weather", WEATHER), ("time", TIME)]),
        ("[TOOL_CALLS][{\"name\": \"weather\", \"arguments\": {", "MALFORMED", []),
        ("plain [text] answer", "plain [text] answer", []),
    ],
}


@pytest.mark.parametrize("family,text,content,calls",
                         [(f, *case) for f, cases in CASES.items() for case in cases])
def test_parse_whole_and_streamed(family, text, content, calls):
    """The same content whole and streamed: the text before the first call, unstripped."""
    parser = PARSERS[family]()
    got_content, got_calls = parser.parse(text)
    want_content = text if content == "MALFORMED" else content
    assert got_content == want_content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)

    streamer = ToolCallStreamer(PARSERS[family]())
    streamed = "".join(streamer.feed(ch) for ch in text)
    rest, stream_calls = streamer.finish()
    assert [(c.name, json.loads(c.arguments)) for c in stream_calls] == calls
    if calls:
        assert streamed + rest == (want_content or "")  # content as vLLM's parsers give it: up to the call
        assert "<tool_call>" not in streamed and "[TOOL_CALLS]" not in streamed and "{" not in streamed
    else:
        assert streamed + rest == text  # no call: everything comes out as content


def test_parser_is_chosen_from_the_chat_template():
    assert parser_for_template("{{ '<tool_call>' }} {{ tool.parameters }} \"parameters\"").name == "hermes"
    assert parser_for_template("[TOOL_CALLS] {{ tools }}").name == "mistral"
    assert parser_for_template("<|python_tag|>{{ x }}").name == "llama3_json"
    assert parser_for_template(None).name == "hermes"
    named = {"default": "{{ messages }}", "tool_use": "[TOOL_CALLS] {{ tools }}"}  # several named templates
    assert parser_for_template(named).name == "mistral"
    assert parser_for_template({"default": "<|python_tag|>{{ x }}"}).name == "llama3_json"


def test_a_required_array_cut_anywhere_is_the_calls_so_far():
    """Each prefix of a "required" answer, as max_tokens may cut it (with the U+FFFD a detokenizer ends
    a cut character with): the whole calls, then the cut one once its name is whole, with arguments
    that begin the whole ones (as json.dumps writes them; a number at the end may yet go on)."""
    text = ('[{"name":"weather","arguments":{"city":"P\\u00e9r\\"is\\/\\ud83d\\ude00","days":3,'
            '"x":[1.5,true,null,{}]}},{"name":"time","arguments":{"tz":"UTC"}}]')
    request = ToolRequest([{"type": "function", "function": {"name": n}} for n in ("weather", "time")], "required")
    whole = ChoiceTools(request, PARSERS["hermes"]()).message(text).tool_calls
    assert [c.function.arguments for c in whole] == [
        '{"city": "Pér\\"is/😀", "days": 3, "x": [1.5, true, null, {}]}', '{"tz": "UTC"}']
    for n in range(len(text)):
        cut = ChoiceTools(request, PARSERS["hermes"]()).message(text[:n] + "\ufffd", cut=True)
        calls = given(cut.tool_calls, [])
        assert cut.content is None and len(calls) == len(re.findall(r'"name":"\w+"', text[:n])), n
        for call, full in zip(calls, whole, strict=False):
            assert call.function.name == full.function.name
            assert full.function.arguments.startswith(call.function.arguments) or text[n - 1].isdigit(), n
