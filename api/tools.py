"""Function tools on the chat API: `tools`, `tool_choice`, `parallel_tool_calls` (and the
deprecated `functions` / `function_call`), and turning a choice's text into tool calls.

- "none": tools are shown to the model (through the chat template), nothing is parsed.
- "auto": the output is parsed by the model family's parser (`api/tool_parsers.py`).
- a named function: decoding is constrained to that function's arguments (its JSON schema).
- "required": decoding is constrained to a JSON array of calls `[{"name", "arguments"}]`
  (one call only when `parallel_tool_calls` is false).

An answer cut short by max_tokens keeps the shape of calls, as OpenAI's does: the calls made so far,
the last with its arguments as far as they got (`_RequiredParser.cut_calls`), and no content.
"""

from __future__ import annotations

import dataclasses
import json
import re

from api.response_models import ChatMessage, DeltaFunctionCall, DeltaMessage, DeltaToolCall
from api.tool_parsers import ToolCall, ToolCallStreamer, ToolParser, tool_call_from
from jaxserve.engine.detokenizer import REPLACEMENT_CHAR
from jaxserve.structured_output.grammar import Constraint


class ToolError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# A function without `parameters` takes none (OpenAI's "an empty parameter list"): its arguments are {}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclasses.dataclass
class ToolRequest:
    tools: list[dict]  # OpenAI tools, for the chat template
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the forced function, when mode == "named"
    parallel: bool = True
    legacy: bool = False  # sent as `functions`: answer with `function_call` (one call), as OpenAI did

    @property
    def constraint(self) -> Constraint | None:
        schemas = {t["function"]["name"]: t["function"].get("parameters") or NO_PARAMETERS for t in self.tools}
        if self.mode == "named":
            return Constraint("json_schema", json.dumps(schemas[self.name]))
        if self.mode == "required":
            defs = {}  # each tool's $defs move to the root, where their "#/$defs/..." refs point
            for schema in schemas.values():
                defs.update(schema.get("$defs", {}))
            call = {"anyOf": [{"type": "object", "properties": {
                "name": {"const": name}, "arguments": {k: v for k, v in schema.items() if k != "$defs"}},
                "required": ["name", "arguments"], "additionalProperties": False} for name, schema in schemas.items()]}
            array = {"type": "array", "items": call, "minItems": 1, **({"$defs": defs} if defs else {})}
            if not self.parallel:
                array["maxItems"] = 1
            return Constraint("json_schema", json.dumps(array))
        return None


def function_tools(tools) -> list[dict]:
    """OpenAI's `tools` (function tools: {"type": "function", "function": {"name", "parameters"}}), none
    for an empty value; ToolError naming the first tool at fault."""
    if not tools:
        return []
    if not isinstance(tools, list):
        raise ToolError("'tools' must be a list", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}",
                            "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return tools


def parse_tool_request(tools: list[dict] | None, choice, functions, function_call,
                       parallel_tool_calls: bool | None) -> ToolRequest | None:
    """The request's tools (`function_tools`, checked) and how they are used; the deprecated
    `functions` and `function_call` stand for them where `tools` is absent."""
    legacy = functions is not None and tools is None
    if legacy:
        if not isinstance(functions, list):
            raise ToolError("'functions' must be a list", "functions")
        tools = function_tools([{"type": "function", "function": f} for f in functions])
        choice = {"type": "function", "function": function_call} if isinstance(function_call, dict) else function_call
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    names = [t["function"]["name"] for t in tools]
    parallel = parallel_tool_calls is not False
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools {names}", "tool_choice")
        return ToolRequest(tools, "named", name, parallel and not legacy, legacy)
    if choice not in ("none", "auto", "required"):
        raise ToolError("'tool_choice' must be 'none', 'auto', 'required' or a named function", "tool_choice")
    return ToolRequest(tools, choice, None, parallel and not legacy, legacy)


class _RequiredParser(ToolParser):
    """The output of a "required" request: a JSON array of {"name", "arguments"}."""

    name = "required"

    def find_start(self, text: str) -> int:
        return 0

    def _calls(self, text: str) -> list[ToolCall]:
        return [tool_call_from(obj, "arguments") for obj in json.loads(text)]

    def cut_calls(self, text: str) -> list[ToolCall]:
        """The calls of an array cut short: each whole element, then the cut one where its name is
        whole, with its arguments so far. [] where not even one name is."""
        decoder, calls, i = json.JSONDecoder(), [], _skip(text, 0, "[")
        while i < len(text) and text[i] != "]":
            try:
                obj, end = decoder.raw_decode(text, i)
            except ValueError:  # the element cut short
                return calls + _cut_call(text, i)
            calls.append(tool_call_from(obj, "arguments"))
            i = _skip(text, end, ",")
        return calls


def _skip(text: str, i: int, chars: str) -> int:
    """The index of the first character from i on that is neither whitespace nor one of `chars`."""
    while i < len(text) and (text[i].isspace() or text[i] in chars):
        i += 1
    return i


def _cut_call(text: str, i: int) -> list[ToolCall]:
    """The call of the element cut short at text[i] (its "{"), if its name is whole; its arguments
    as far as they got, written as whole ones are (`_as_dumped`)."""
    decoder, name, arguments = json.JSONDecoder(), None, ""
    i = _skip(text, i, "{")
    while i < len(text):
        try:
            key, i = decoder.raw_decode(text, i)
        except ValueError:  # a key cut short
            break
        i = _skip(text, i, ":")
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:  # the value cut short: the last one
            value, end = None, len(text)
        if key == "name" and isinstance(value, str):  # (a string that decodes is whole)
            name = value
        elif key == "arguments":
            arguments = _as_dumped(text[i:end])
        i = _skip(text, end, ",")
    return [ToolCall(name, arguments)] if name is not None else []


_PUNCTUATION = {",": ", ", ":": ": ", "[": "[", "]": "]", "{": "{", "}": "}"}  # as json.dumps writes it
_WORD = re.compile(r'[^\s,:\[\]{}"]+')  # a number or literal


def _as_dumped(text: str) -> str:
    """JSON text, maybe cut short, as `json.dumps` writes whole arguments (", " and ": " between
    items, strings re-escaped): so cut arguments are a prefix of what they would have become. A cut
    escape is left out; a number or literal at the end stays as written (it may go on)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == '"':
            end = _string_end(text, i)
            out.append(_cut_string(text[i + 1:]) if end is None
                       else json.dumps(json.loads(text[i:end]), ensure_ascii=False))
            i = len(text) if end is None else end
        elif text[i] in _PUNCTUATION or text[i].isspace():
            out.append(_PUNCTUATION.get(text[i], ""))  # (whitespace: dumps writes none but its separators')
            i += 1
        else:  # a number or true / false / null
            end = _WORD.match(text, i).end()
            out.append(text[i:end] if end == len(text) else json.dumps(json.loads(text[i:end])))
            i = end
    return "".join(out)


def _string_end(text: str, i: int) -> int | None:
    """The index after the string that opens at text[i]; None where it is cut short."""
    i += 1
    while i < len(text):
        if text[i] == '"':
            return i + 1
        i += 2 if text[i] == "\\" else 1
    return None


def _cut_string(body: str) -> str:
    """A string cut short (its text after the opening quote), re-escaped as `json.dumps` writes it,
    without its closing quote; a cut escape, or half of a surrogate pair, left out."""
    i = whole = 0
    while i < len(body):
        i += (6 if body[i + 1:i + 2] == "u" else 2) if body[i] == "\\" else 1
        if i <= len(body):
            whole = i
    value = json.loads(f'"{body[:whole]}"')
    if value and "\ud800" <= value[-1] <= "\udbff":
        value = value[:-1]
    return json.dumps(value, ensure_ascii=False)[:-1]


class ChoiceTools:
    """One choice's tool calls: streamed as OpenAI's `delta.tool_calls`, or whole in `message.tool_calls`."""

    def __init__(self, request: ToolRequest, parser: ToolParser):
        self.request = request
        self.streamer = ToolCallStreamer(_RequiredParser() if request.mode == "required" else parser)
        self.named = ToolCall(request.name, "") if request.mode == "named" else None
        self.has_calls = False

    @property
    def finish_reason(self) -> str:
        """What a choice that stopped after making calls reports: "stop" where the request named the
        function (as OpenAI and vLLM report a forced call)."""
        if self.named:
            return "stop"
        return "function_call" if self.request.legacy else "tool_calls"

    def message(self, text: str, cut: bool = False) -> ChatMessage:
        """The non-streamed message for the choice's whole text; `cut`: max_tokens ended it."""
        text = self._uncut(text, cut)
        if self.named:
            content, calls = None, [dataclasses.replace(self.named, arguments=text)]
        else:
            content, calls = self.streamer.parser.parse(text)
            content, calls = self._answer(content, calls, text, cut)
        self.has_calls = bool(calls)
        if not calls:
            return ChatMessage(role="assistant", content=content)
        if self.request.legacy:
            return ChatMessage(role="assistant", content=content, function_call=calls[0].to_openai().function)
        return ChatMessage(role="assistant", content=content, tool_calls=[c.to_openai() for c in calls])

    def _uncut(self, text: str, cut: bool) -> str:
        """A forced call's text without the character that max_tokens cut in its bytes (which the
        detokenizer ends with as U+FFFD): no part of the arguments yet."""
        return text.rstrip(REPLACEMENT_CHAR) if cut and self.request.mode in ("named", "required") else text

    def _answer(self, content: str | None, calls: list[ToolCall], text: str, cut: bool
                ) -> tuple[str | None, list[ToolCall]]:
        """The parser's (content, calls) of the text, or a "required" array's calls so far where
        max_tokens cut it (which does not parse): no content, as the array is no answer in words."""
        if cut and not calls and self.request.mode == "required":
            content, calls = None, self.streamer.parser.cut_calls(text)
        return content, calls if self.request.parallel else calls[:1]

    def _delta(self, index: int, call: ToolCall | None = None, arguments: str | None = None) -> DeltaMessage:
        """A streamed call's head (id and name, `call`) or more of its arguments; in the legacy
        `function_call` shape where the request used `functions`."""
        if call is not None:
            function = DeltaFunctionCall(name=call.name, arguments="")
            delta = DeltaToolCall(index=index, id=call.id, type="function", function=function)
        else:
            function = DeltaFunctionCall(arguments=arguments)
            delta = DeltaToolCall(index=index, function=function)
        return DeltaMessage(function_call=function) if self.request.legacy else DeltaMessage(tool_calls=[delta])

    def feed(self, text: str, cut: bool = False) -> list[DeltaMessage]:
        """Streaming: deltas for newly released text; `cut`: its last, where max_tokens ended the choice."""
        text = self._uncut(text, cut)
        if self.named:
            deltas = []
            if not self.has_calls:
                self.has_calls = True
                deltas.append(self._delta(0, self.named))
            if text:
                deltas.append(self._delta(0, arguments=text))
            return deltas
        content = self.streamer.feed(text)
        return [DeltaMessage(content=content)] if content else []

    def finish(self, cut: bool = False) -> list[DeltaMessage]:
        """Streaming: the deltas left at the end (content held back, then each call: id and name,
        arguments), the same calls as `message`'s; `cut`: max_tokens ended the choice."""
        if self.named:
            return []
        rest, calls = self.streamer.finish()
        rest, calls = self._answer(rest, calls, self.streamer.text, cut)
        deltas = [DeltaMessage(content=rest)] if rest else []
        for i, call in enumerate(calls):
            deltas += [self._delta(i, call), self._delta(i, arguments=call.arguments)]
        self.has_calls = bool(calls)
        return deltas
