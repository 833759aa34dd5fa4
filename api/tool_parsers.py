"""Tool-call parsers: a model family's tool-call text -> OpenAI tool calls.

Each parser knows where its tool calls start (`find_start`) and how to read
them (`parse`). Output that does not parse is returned as plain content, never
an error. `ToolCallStreamer` streams content until a call starts, then holds
the rest back and parses it at the end.

Families: `hermes` (Hermes, Qwen 2.5/3: `<tool_call>{"name", "arguments"}</tool_call>`),
`llama3_json` (Llama 3.x: `{"name", "parameters"}` objects, `;`-separated,
optionally after `<|python_tag|>`), `mistral` (`[TOOL_CALLS][{"name", "arguments"}, ...]`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from api.response_models import FunctionCall
from api.response_models import ToolCall as OpenAIToolCall
from jaxserve.engine.detokenizer import undecided_tail


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> OpenAIToolCall:
        return OpenAIToolCall(id=self.id, function=FunctionCall(name=self.name, arguments=self.arguments))


def tool_call_from(obj, arguments_key: str) -> ToolCall:
    """A ToolCall from a decoded {"name", <arguments_key>} object; ValueError if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a tool call")
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):
        json.loads(args)  # must itself be JSON
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be an object")
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    name = ""
    markers: tuple[str, ...] = ()  # texts that open a tool call

    def find_start(self, text: str) -> int:
        """Index where tool calls begin in `text`, or -1."""
        hits = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(hits, default=-1)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """-> (content before the calls, as streamed; None if empty; the calls). Unparseable: (text, [])."""
        start = self.find_start(text)
        if start < 0:
            return text, []
        try:
            calls = self._calls(text[start:])
        except (ValueError, TypeError):
            return text, []
        if not calls:
            return text, []
        return (text[:start] or None), calls

    def _calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, text: str) -> list[ToolCall]:
        return [tool_call_from(json.loads(body), "arguments") for body in self._block.findall(text)]


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def _calls(self, text: str) -> list[ToolCall]:
        calls = []
        for part in text.split("[TOOL_CALLS]")[1:]:
            decoded = json.loads(part.strip())
            calls += [tool_call_from(obj, "arguments") for obj in (decoded if isinstance(decoded, list) else [decoded])]
        for call in calls:  # Mistral's templates want 9 alphanumeric characters
            call.id = uuid.uuid4().hex[:9]
        return calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>",)

    def find_start(self, text: str) -> int:
        tagged = super().find_start(text)
        if tagged >= 0:
            return tagged
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else -1

    def _calls(self, text: str) -> list[ToolCall]:
        text = text.removeprefix("<|python_tag|>").strip()
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(text):
            obj, end = decoder.raw_decode(text, i)
            calls.append(tool_call_from(obj, "parameters"))
            i = end
            while i < len(text) and text[i] in "; \n\t":
                i += 1
        return calls


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for_template(chat_template: str | dict[str, str] | None) -> ToolParser:
    """The family parser that a chat template's tool-call syntax points to (hermes by default). A
    tokenizer with several named templates is read by its tool-use one, else by all of them."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("tool_use") or "\n".join(chat_template.values())
    template = chat_template or ""
    if "<tool_call>" in template:
        return HermesParser()
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<|python_tag|>" in template or '"parameters"' in template:
        return Llama3JsonParser()
    return HermesParser()


class ToolCallStreamer:
    """Streams content until a tool call starts; holds back what might be a marker's beginning."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.released = 0
        self.in_call = False

    def feed(self, delta: str) -> str:
        """New text -> the content that can be streamed now."""
        self.text += delta
        if not self.in_call:
            start = self.parser.find_start(self.text)
            if start >= 0:
                self.in_call = True
                end = start
            else:
                end = len(self.text) - undecided_tail(self.text, list(self.parser.markers))
                if isinstance(self.parser, Llama3JsonParser) and not self.text.strip():
                    end = self.released  # a call may still start with "{"
            out, self.released = self.text[self.released:end], max(self.released, end)
            return out
        return ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: (content not streamed yet, the calls). Unparseable calls come back as content."""
        _, calls = self.parser.parse(self.text)
        end = self.parser.find_start(self.text) if calls else len(self.text)
        rest, self.released = self.text[self.released:end], end
        return rest, calls
