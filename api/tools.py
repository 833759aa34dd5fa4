"""Function tools on the chat API: `tools`, `tool_choice`, `parallel_tool_calls` (and the
deprecated `functions` / `function_call`), and turning a choice's text into tool calls.

- "none": tools are shown to the model (through the chat template), nothing is parsed.
- "auto": the output is parsed by the model family's parser (`api/tool_parsers.py`).
- a named function: decoding is constrained to that function's arguments (its JSON schema).
- "required": decoding is constrained to a JSON array of calls `[{"name", "arguments"}]`
  (one call only when `parallel_tool_calls` is false).
"""

from __future__ import annotations

import dataclasses
import json

from api.response_models import ChatMessage, DeltaFunctionCall, DeltaMessage, DeltaToolCall
from api.tool_parsers import ToolCall, ToolCallStreamer, ToolParser, tool_call_from
from jaxserve.structured import Constraint


class ToolError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class ToolRequest:
    tools: list[dict]  # OpenAI tools, for the chat template
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the forced function, when mode == "named"
    parallel: bool = True
    legacy: bool = False  # sent as `functions`: answer with `function_call` (one call), as OpenAI did

    @property
    def constraint(self) -> Constraint | None:
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
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


def parse_tool_request(body: dict) -> ToolRequest | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("functions") is not None and tools is None:  # the deprecated form
        functions = body["functions"]
        if not isinstance(functions, list):
            raise ToolError("'functions' must be a list", "functions")
        tools = [{"type": "function", "function": f} for f in functions]
        call = body.get("function_call")
        choice = {"type": "function", "function": call} if isinstance(call, dict) else call
        legacy = True
    else:
        legacy = False
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
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
    names = [t["function"]["name"] for t in tools]
    parallel = body.get("parallel_tool_calls", True) is not False
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

    def message(self, text: str) -> ChatMessage:
        """The non-streamed message for the choice's whole text."""
        if self.named:
            content, calls = None, [dataclasses.replace(self.named, arguments=text)]
        else:
            content, calls = self.streamer.parser.parse(text)
            calls = calls if self.request.parallel else calls[:1]
        self.has_calls = bool(calls)
        if not calls:
            return ChatMessage(role="assistant", content=text)
        if self.request.legacy:
            return ChatMessage(role="assistant", content=content, function_call=calls[0].to_openai().function)
        return ChatMessage(role="assistant", content=content, tool_calls=[c.to_openai() for c in calls])

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

    def feed(self, text: str) -> list[DeltaMessage]:
        """Streaming: deltas for newly released text."""
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

    def finish(self) -> list[DeltaMessage]:
        """Streaming: the deltas left at the end (content held back, then each call: id and name, arguments)."""
        if self.named:
            return []
        rest, calls = self.streamer.finish()
        calls = calls if self.request.parallel else calls[:1]
        deltas = [DeltaMessage(content=rest)] if rest else []
        for i, call in enumerate(calls):
            deltas += [self._delta(i, call), self._delta(i, arguments=call.arguments)]
        self.has_calls = bool(calls)
        return deltas
