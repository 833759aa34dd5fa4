"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens), served by the chat path.

A request is read as the chat request it stands for (`chat_request`): `system` and the messages'
blocks become chat messages (a `tool_use` block an assistant tool call, a `tool_result` block a
tool message; past `thinking` blocks are left out, as chat templates leave out past thinking), tools
take the chat form (`input_schema` is the parameters' schema), `tool_choice` any / tool / none /
auto are required / the named function / none / auto, `stop_sequences` is stop, `thinking` the
template's `enable_thinking`. A final assistant message is continued, as Anthropic continues it.
The chat choice's deltas then become content blocks (`MessageBuilder`): thinking, text, tool_use,
streamed as Anthropic's events. Errors take Anthropic's envelope (`error_body`); a full queue is
529 overloaded_error, what Anthropic sends when it is overloaded.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from pydantic import MISSING, BaseModel, ConfigDict, Field, ValidationError
from quart import Blueprint
from quart_schema import document_request, document_response

from api.answer import streamed_or_whole
from api.choices import Choices
from api.errors import APIError
from api.generation import admit, generation, stream_error_status
from api.protocol import GenerationRequest, parse_chat
from api.response_models import DeltaFunctionCall, DeltaMessage, given
from api.sse import new_id, sse
from api.state import APIState, api_state, json_body

messages = Blueprint("messages", __name__)

PATH = "/v1/messages"
_NOT_SERVED = {"mcp_servers": "MCP servers are not run by this server",
               "container": "code execution containers are not run by this server"}
# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # chat's finish reason -> Anthropic's (else end_turn)


class MessagesRequest(BaseModel):
    """POST /v1/messages (Anthropic's request; fields it has that are not listed are ignored). Strict:
    "4" is not a number, as the schema says."""
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # (Anthropic's range, narrower than OpenAI's)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request, max_tokens optional."""
    max_tokens: int | None = None


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class Message(BaseModel):
    """The answer: content blocks ({"type": "thinking", "thinking", "signature"}, {"type": "text",
    "text"}, {"type": "tool_use", "id", "name", "input"})."""
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokensCount(BaseModel):
    input_tokens: int


def error_body(e: APIError) -> tuple[dict, int]:
    """An error as Anthropic sends it: its envelope, and its status (a full queue: 529)."""
    status = 529 if e.code == "queue_full" else e.status
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}, status


def _text(content, where: str) -> str:
    """A block list's (or a string's) text; images and documents are a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}: content must be a string or a list of blocks", param="messages")
    texts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise APIError(f"{where}: blocks of type {kind!r} are not supported here (text blocks are; images and "
                           "documents are not)", param="messages")
        texts.append(block["text"])
    return "".join(texts)


def _message(role: str, content, where: str) -> list[dict]:
    """One Anthropic message as chat messages (a user message's tool results first, as tool messages)."""
    if role not in ("user", "assistant"):
        raise APIError(f"{where}: role must be 'user' or 'assistant'", param="messages")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(f"{where}: content must be a string or a list of blocks", param="messages")
    out, text, calls = [], [], []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(_text([block], f"{where}.content[{i}]"))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise APIError(f"{where}.content[{i}]: a tool_use block needs an id and a name", param="messages")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            result = _text(block.get("content", ""), f"{where}.content[{i}]")
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": f"Error: {result}" if block.get("is_error") else result})
        else:
            raise APIError(f"{where}.content[{i}]: blocks of type {kind!r} are not supported in a {role} message "
                           "(text, tool_use, tool_result and thinking are; images and documents are not)",
                           param="messages")
    if text or calls or not out:
        out.append({"role": role, "content": "".join(text), **({"tool_calls": calls} if calls else {})})
    return out


def _tools(body: dict) -> dict:
    """`tools` and `tool_choice` in the chat form (custom tools only)."""
    out = {}
    tools = body.get("tools")
    if tools is not None:
        chat_tools = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "name" not in tool:
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise APIError(f"tools[{i}]: only custom tools (name, description, input_schema) are supported, "
                               f"not {kind!r}", param="tools")
            chat_tools.append({"type": "function", "function": {
                "name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"},
                **({"description": tool["description"]} if tool.get("description") else {})}})
        out["tools"] = chat_tools
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type")
        if kind not in ("auto", "any", "tool", "none") or (kind == "tool" and not isinstance(choice.get("name"), str)):
            raise APIError("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", "
                           "\"name\": ...}", param="tool_choice")
        out["tool_choice"] = ({"type": "function", "function": {"name": choice["name"]}} if kind == "tool"
                              else {"any": "required"}.get(kind, kind))
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def _thinking(request: dict, reasoning: bool) -> dict:
    """`thinking` as the template's `enable_thinking`: enabled or adaptive, where the server separates
    thinking (--reasoning-parser), or disabled. The budget is checked, not enforced: the thinking and
    the answer share max_tokens."""
    thinking = request.get("thinking")
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise APIError("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} or "
                       "{\"type\": \"disabled\"}", param="thinking")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or budget < 1 or budget >= request.get("max_tokens", budget + 1):
            # (Anthropic's floor of 1024 is left out: a local model's whole context may be shorter)
            raise APIError("'thinking.budget_tokens' must be positive and less than max_tokens", param="thinking")
    if kind != "disabled" and not reasoning:
        raise APIError("'thinking' needs a server started with --reasoning-parser", param="thinking")
    return {"chat_template_kwargs": {"enable_thinking": kind != "disabled"}}


def _output_config(request: dict) -> dict:
    """`output_config`: its JSON schema as the chat `response_format`, its effort as `reasoning_effort`."""
    config = request.get("output_config") or {}
    if not isinstance(config, dict):
        raise APIError("'output_config' must be an object", param="output_config")
    out = {}
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                           param="output_config")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if config.get("effort") is not None:
        out["reasoning_effort"] = {"max": "xhigh"}.get(config["effort"], config["effort"])
    return out


def chat_request(body: dict, reasoning: bool, counting: bool = False) -> dict:
    """The chat completions body a Messages request stands for; 400 for what cannot be served.
    `reasoning`: the server separates thinking (--reasoning-parser)."""
    try:
        request = (CountTokensRequest if counting else MessagesRequest).model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(map(str, error["loc"]))
        raise APIError(f"'{where}': {error['msg']}", param=str(error["loc"][0])) from e
    request = request.model_dump(exclude_unset=True)
    for name, why in _NOT_SERVED.items():
        if body.get(name):
            raise APIError(f"'{name}' is not supported: {why}", param=name)
    system = request.get("system")
    chat = [] if system is None else [{"role": "system", "content": _text(system, "system")}]
    for i, message in enumerate(request["messages"]):
        chat += _message(message.get("role"), message.get("content"), f"messages[{i}]")
    out = {"messages": chat, **_tools(request)}
    if chat and chat[-1]["role"] == "assistant":  # (Anthropic continues a final assistant message)
        out.update(add_generation_prompt=False, continue_final_message=True)
    out.update(_thinking(request, reasoning), **_output_config(request))
    for ours, theirs in (("model", "model"), ("max_tokens", "max_tokens"), ("stop_sequences", "stop"),
                         ("stream", "stream"), ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if request.get(ours) is not None:
            out[theirs] = request[ours]
    user = (request.get("metadata") or {}).get("user_id")
    if isinstance(user, str):
        out["user"] = user
    return out


def _event(kind: str, **fields) -> str:
    return sse({"type": kind, **fields}, event=kind)


class MessageBuilder:
    """The message, grown from the chat choice's deltas; each step returns the events it makes."""

    def __init__(self, message_id: str, model: str, input_tokens: int, show_thinking: bool = True):
        self.show_thinking = show_thinking  # (`thinking.display: "omitted"`: no thinking blocks)
        self.message = Message(id=message_id, model=model, content=[],
                               usage=MessageUsage(input_tokens=input_tokens, output_tokens=0))
        self.open = False  # whether the last block is still streaming (its content_block_stop not sent)
        self.arguments = ""  # the open tool_use block's input as streamed JSON

    def start(self) -> Iterator[str]:
        yield _event("message_start", message=self.message.model_dump())
        yield _event("ping")

    def _open(self, block: dict) -> Iterator[str]:
        yield from self._close()
        self.message.content.append(block)
        self.open = True
        yield _event("content_block_start", index=len(self.message.content) - 1, content_block=block)

    def _close(self) -> Iterator[str]:
        if not self.open:
            return
        self.open = False
        block = self.message.content[-1]
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(self.arguments) if self.arguments else {}
            except ValueError:  # (cut short by max_tokens, which stop_reason says: the input is left empty)
                block["input"] = {}
        yield _event("content_block_stop", index=len(self.message.content) - 1)

    def _extend(self, kind: str, field: str, delta_type: str, text: str, **block) -> Iterator[str]:
        """`text` added to the open block of type `kind` (opened with `block` where another is open)."""
        if not text:
            return
        if not (self.open and self.message.content[-1]["type"] == kind):
            yield from self._open({"type": kind, field: "", **block})
        self.message.content[-1][field] += text
        yield _event("content_block_delta", index=len(self.message.content) - 1,
                     delta={"type": delta_type, field: text})

    def delta(self, delta: DeltaMessage) -> Iterator[str]:
        """A chat delta of the choice: thinking (--reasoning-parser), text, or tool calls as
        `ChoiceTools` streams them (a new call's id and name first, then its arguments)."""
        if self.show_thinking:
            yield from self._extend("thinking", "thinking", "thinking_delta", given(delta.reasoning) or "",
                                    signature="")
        yield from self._extend("text", "text", "text_delta", given(delta.content) or "")
        for call in given(delta.tool_calls, []):
            if call.id is not MISSING:
                yield from self._open({"type": "tool_use", "id": call.id, "name": call.function.name, "input": {}})
                self.arguments = ""
            arguments = given(given(call.function, DeltaFunctionCall()).arguments) or ""
            if arguments and self.open and self.message.content[-1]["type"] == "tool_use":
                self.arguments += arguments
                yield _event("content_block_delta", index=len(self.message.content) - 1,
                             delta={"type": "input_json_delta", "partial_json": arguments})

    def finish(self, finish_reason: str | None, stop: str | int | None, output_tokens: int) -> Iterator[str]:
        """The last events: the open block closed, the stop reason and the usage, message_stop."""
        yield from self._close()
        matched = isinstance(stop, str) and finish_reason == "stop"
        called = finish_reason != "length" and any(block["type"] == "tool_use" for block in self.message.content)
        self.message.stop_reason = ("stop_sequence" if matched else "tool_use" if called  # (a forced call ends "stop")
                                    else STOP_REASONS.get(finish_reason, "end_turn"))
        self.message.stop_sequence = stop if matched else None
        self.message.usage.output_tokens = output_tokens
        yield _event("message_delta", delta={"stop_reason": self.message.stop_reason,
                                             "stop_sequence": self.message.stop_sequence},
                     usage=self.message.usage.model_dump())
        yield _event("message_stop")


async def _request(state: APIState, body: dict, counting: bool = False) -> GenerationRequest:
    """The chat request; its max_tokens cut to the context's room: Anthropic's clients ask for tens of
    thousands of tokens as a bound, where a local model's context may hold fewer."""
    chat = chat_request(body, reasoning=state.reasoning_parser is not None, counting=counting)
    req = await state.off_loop(parse_chat, chat, state.limits, state.text_tokenizer(PATH))
    room = state.limits.max_model_len - len(req.prompts[0])
    if room < 1 and not counting:  # (the messages alone fill the context: max_tokens is not what to lower)
        raise APIError(f"prompt is too long: {len(req.prompts[0])} tokens, and this model's context of "
                       f"{state.limits.max_model_len} leaves no room for an answer", param="messages")
    if req.params.max_tokens is not None and 0 < room < req.params.max_tokens:
        req = dataclasses.replace(req, params=dataclasses.replace(req.params, max_tokens=room))
    return req


@messages.post(PATH)
@document_request(MessagesRequest)
@document_response(Message)
async def create_message():
    """The assistant's message; with `"stream": true`, Anthropic's server-sent events."""
    state, body = api_state(), await json_body()
    req = await _request(state, body)
    thinking = body.get("thinking")
    shown = not (isinstance(thinking, dict) and thinking.get("display") == "omitted")
    builder = MessageBuilder(new_id("msg", "_"), req.model, len(req.prompts[0]), show_thinking=shown)
    req = await admit(state, req, builder.message.id, chat=True)
    return await streamed_or_whole(req, lambda: _events_or_error(state, req, builder),
                                   lambda: _events(state, req, builder), lambda: builder.message)


@messages.post(PATH + "/count_tokens")
@document_request(CountTokensRequest)
@document_response(TokensCount)
async def count_tokens():
    """The input tokens the same Messages request would use."""
    req = await _request(api_state(), await json_body(), counting=True)
    return TokensCount(input_tokens=len(req.prompts[0]))


async def _events(state: APIState, req: GenerationRequest, builder: MessageBuilder) -> AsyncIterator[str]:
    """The Messages events of a chat request's one choice."""
    choices = Choices(req, True, state.engine, state.tool_parser)
    for event in builder.start():
        yield event
    stop = None
    async for _, update in generation(state, req, builder.message.id):
        text, _ = choices.add(0, update)
        stop = update.stop_reason if update.finish_reason is not None else stop
        for delta in choices.deltas(0, text, update.finish_reason is not None):
            for event in builder.delta(delta):
                yield event
    for event in builder.finish(choices.finish_reason(0), stop, choices.usage().completion_tokens):
        yield event


async def _events_or_error(state: APIState, req: GenerationRequest, builder: MessageBuilder) -> AsyncIterator[str]:
    try:
        async for event in _events(state, req, builder):
            yield event
    except Exception as e:  # after the 200 is sent, an error can only be an event in the stream
        error = e if isinstance(e, APIError) else APIError(str(e), status=stream_error_status(state, e))
        yield sse(error_body(error)[0], event="error")
