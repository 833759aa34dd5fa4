"""OpenAI's Responses API (POST /v1/responses), served by the chat path.

A request is read as the chat request it stands for (`chat_request`): `instructions` and the
`input` items become messages, function tools and `tool_choice` take the chat form, `text.format`
becomes `response_format`, `max_output_tokens` is max_tokens. The chat choice's deltas (text,
tool calls) then become the Responses events and output items (`ResponseBuilder`): a message
with its output_text, and a function_call item per call. A response that is not streamed is the
same events' end state. A finished response is stored unless the request says `store: false`
(`api/response_store.py`): GET /v1/responses/{id} reads it, DELETE drops it, and a request's
`previous_response_id` continues its conversation. With `background: true` the request is answered
at once and the response computed by a task of its own (`api/background_responses.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator

from pydantic import MISSING
from pydantic_core import to_jsonable_python
from quart import Blueprint, Response
from quart_schema import document_request, document_response

from api.answer import streamed_or_whole
from api.background_responses import BackgroundRun
from api.chat_models import ResponsesRequest
from api.choices import Choices
from api.errors import APIError
from api.fields import validated
from api.generation import admit, generation, stream_error_status
from api.protocol import GenerationRequest, parse_chat
from api.response_models import ChatLogprob, DeltaFunctionCall, DeltaMessage, Usage, given
from api.response_objects import (FunctionCallItem, IncompleteDetails, MessageItem, OutputItem, OutputText,
                                  ReasoningItem, ReasoningText, ResponseError, ResponseObject, ResponseReasoning,
                                  ResponseUsage)
from api.sse import new_id, now, sse
from api.state import APIState, api_state, json_body
from jaxserve.engine.chat_template import message_text

responses = Blueprint("responses", __name__)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_NOT_SERVED = {  # request fields that need what this server does not keep or run
    "conversation": "it needs a stored conversation, and conversations are not stored",
    "prompt": "stored prompt templates are not available",
    "max_tool_calls": "a bound on built-in tool calls has nothing to bound: only function tools are served",
}


def _text(content, where: str) -> str:
    """A message's content as the chat path reads it (`tokenizer.message_text`)."""
    try:
        return message_text({"content": content}, where)
    except ValueError as e:
        raise APIError(str(e), param="input") from e


def _input_items(body: dict) -> list:
    """`input` as a list of items (a string is one user message)."""
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError("'input' must be a string or a non-empty list of items", param="input")
    return items


def _messages(body: dict) -> list[dict]:
    """`instructions` and `input` as chat messages: a function_call item joins the assistant message
    before it (as its tool_calls), a function_call_output item is a tool message; a reasoning item
    (an earlier answer's thinking, sent back) is left out, as chat templates leave out past thinking."""
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise APIError("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(_input_items(body)):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item.get("role"), str):
            messages.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(f"{where}: a function_call item needs call_id, name and arguments (strings)",
                               param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "reasoning":
            continue
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(f"{where}: a function_call_output item needs a call_id", param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output", ""), where)})
        else:
            raise APIError(f"{where}: items of type {kind!r} are not supported (messages, function_call, "
                           "function_call_output and reasoning are)", param="input")
    return messages


def _tools(body: dict) -> dict:
    """`tools` and `tool_choice` in the chat form (function tools only)."""
    out = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise APIError("'tools' must be a list", param="tools")
        chat_tools = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise APIError(f"tools[{i}]: only function tools are supported, not {kind!r}", param="tools")
            chat_tools.append({"type": "function", "function": {k: tool[k] for k in (
                "name", "description", "parameters", "strict") if tool.get(k) is not None}})
        out["tools"] = chat_tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                           "\"name\": ...}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def _response_format(body: dict) -> dict:
    """`text.format` as the chat `response_format`."""
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if text is not None and not isinstance(text, dict):
        raise APIError("'text' must be an object", param="text")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError("'text.format' must be an object", param="text")
    if fmt is None or fmt.get("type") == "text":
        return {}
    if fmt.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise APIError(f"text.format type {fmt.get('type')!r} is not supported (text, json_object, json_schema)",
                   param="text")


_CHAT_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


def chat_request(body: dict) -> dict:
    """The chat completions body a Responses request stands for; 400 for what cannot be served."""
    for name, why in _NOT_SERVED.items():
        if body.get(name) not in (None, False):
            raise APIError(f"'{name}' is not supported: {why}", param=name)
    if body.get("truncation") not in (None, "disabled"):
        raise APIError("'truncation' must be 'disabled': input that does not fit is a 400", param="truncation")
    reasoning = {} if body.get("reasoning") is None else body["reasoning"]  # (0, "" and false are errors too)
    if not isinstance(reasoning, dict):
        raise APIError("'reasoning' must be an object", param="reasoning")
    if any(reasoning.get(name) is not None for name in reasoning if name != "effort"):
        raise APIError("'reasoning' may only set 'effort': reasoning summaries are not available", param="reasoning")
    include = [] if body.get("include") is None else body["include"]
    if not isinstance(include, list) or any(entry != LOGPROBS_INCLUDE for entry in include):
        raise APIError(f"'include' may only hold {LOGPROBS_INCLUDE!r}", param="include")
    chat = {"messages": _messages(body), **_tools(body), **_response_format(body)}
    if reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    body = validated(ResponsesRequest, body).model_dump(exclude_unset=True)  # (a 400 names the Responses field)
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("parallel_tool_calls", "parallel_tool_calls"), ("model", "model"), ("stream", "stream"),
                         ("user", "user"), ("priority", "priority"), ("cache_salt", "cache_salt"),
                         ("metadata", "metadata")):  # (passed on to be checked there: the chat request keeps it)
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if LOGPROBS_INCLUDE in include:
        chat.update(logprobs=True, top_logprobs=body.get("top_logprobs") or 0)
    return chat


def _event(kind: str, sequence: int, **fields) -> str:
    """One server-sent event of the Responses stream: its type as the event name and in the data."""
    return sse({"type": kind, "sequence_number": sequence, **to_jsonable_python(fields)}, event=kind)


class ResponseBuilder:
    """The response, grown from the chat choice's deltas; each step returns the events it makes."""

    def __init__(self, response_id: str, body: dict, model: str, temperature: float, top_p: float,
                 logprobs: bool):
        self.logprobs = logprobs
        self.sequence = 0
        self.open: OutputItem | None = None  # the item being streamed (its "done" events not yet sent)
        self.pending_logprobs: list[ChatLogprob] = []  # logprobs of text held back (a stop string being matched)
        reasoning = body.get("reasoning")
        self.state = ResponseObject(
            id=response_id, created_at=now(), instructions=body.get("instructions"),
            max_output_tokens=body.get("max_output_tokens"), model=model,
            parallel_tool_calls=body.get("parallel_tool_calls", True),
            reasoning=ResponseReasoning(effort=reasoning.get("effort")) if reasoning else None,
            temperature=temperature, text=body.get("text") or {"format": {"type": "text"}},
            tool_choice=body.get("tool_choice", "auto"), tools=body.get("tools") or [],
            top_logprobs=body.get("top_logprobs"), top_p=top_p, user=body.get("user"),
            metadata=body.get("metadata") or {})
        self.output = self.state.output
        self.stored_items: list | None = None  # the conversation's input items, where the response is stored
        self.own_items = 0  # ... the last of them the request's own

    @property
    def response(self) -> dict:
        """The response as it stands."""
        return self.state.dump()

    def _emit(self, kind: str, **fields) -> str:
        event = _event(kind, self.sequence, **fields)
        self.sequence += 1
        return event

    def start(self) -> Iterator[str]:
        yield self._emit("response.created", response=self.response)  # (a background one's: "queued")
        self.state.status = "in_progress"
        yield self._emit("response.in_progress", response=self.response)

    def _open(self, item: OutputItem) -> Iterator[str]:
        yield from self._close()
        self.open = item
        self.output.append(item)
        added = item.model_copy(update={"content": []}) if hasattr(item, "content") else item  # (its part comes next)
        yield self._emit("response.output_item.added", output_index=len(self.output) - 1, item=added)

    def _close(self, status: str = "completed") -> Iterator[str]:
        """Close the open item; "incomplete" where the output ran out in it."""
        item, self.open = self.open, None
        if item is None:
            return
        index = len(self.output) - 1
        item.status = status
        if isinstance(item, MessageItem):
            part = item.content[0]
            if self.pending_logprobs:
                part.logprobs.extend(self.pending_logprobs)
                self.pending_logprobs = []
            ids = dict(item_id=item.id, output_index=index, content_index=0)
            yield self._emit("response.output_text.done", **ids, text=part.text, logprobs=part.logprobs)
            yield self._emit("response.content_part.done", **ids, part=part)
        elif isinstance(item, ReasoningItem):
            yield self._emit("response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0,
                             text=item.content[0].text)
        else:
            yield self._emit("response.function_call_arguments.done", item_id=item.id, output_index=index,
                             arguments=item.arguments)
        yield self._emit("response.output_item.done", output_index=index, item=item)

    def _open_message(self) -> Iterator[str]:
        part = OutputText()
        yield from self._open(MessageItem(id=new_id("msg", "_"), content=[part]))
        yield self._emit("response.content_part.added", item_id=self.open.id, output_index=len(self.output) - 1,
                         content_index=0, part=part)

    def _text(self, text: str, logprobs: list[ChatLogprob] | None) -> Iterator[str]:
        if self.logprobs:
            self.pending_logprobs.extend(logprobs or [])
        if not text:
            return
        if not isinstance(self.open, MessageItem):
            yield from self._open_message()
        part = self.open.content[0]
        part.text += text
        shown, self.pending_logprobs = self.pending_logprobs, []
        part.logprobs.extend(shown)
        yield self._emit("response.output_text.delta", item_id=self.open.id, output_index=len(self.output) - 1,
                         content_index=0, delta=text, logprobs=shown)

    def _reasoning(self, text: str) -> Iterator[str]:
        """Thinking (--reasoning-parser): a `reasoning` item before the message."""
        if not isinstance(self.open, ReasoningItem):
            yield from self._open(ReasoningItem(id=new_id("rs", "_"), content=[ReasoningText()]))
        self.open.content[0].text += text
        yield self._emit("response.reasoning_text.delta", item_id=self.open.id, output_index=len(self.output) - 1,
                         content_index=0, delta=text)

    def delta(self, delta: DeltaMessage | dict, logprobs: list[ChatLogprob] | None = None) -> Iterator[str]:
        """A chat delta of the choice (reasoning, content, or tool_calls as `ChoiceTools` streams them;
        a model or its JSON) and the logprobs of its tokens."""
        delta = DeltaMessage.model_validate(delta)
        reasoning = given(delta.reasoning)
        if reasoning:  # (the logprobs of a delta with reasoning are the thinking's: not shown)
            yield from self._reasoning(reasoning)
        yield from self._text(given(delta.content) or "", None if reasoning else logprobs)
        for call in given(delta.tool_calls, []):
            if call.id is not MISSING:  # a new call: its id and name come first
                yield from self._open(FunctionCallItem(id=new_id("fc", "_"), call_id=call.id,
                                                       name=call.function.name))
            arguments = given(given(call.function, DeltaFunctionCall()).arguments) or ""
            if arguments and isinstance(self.open, FunctionCallItem):
                self.open.arguments += arguments
                yield self._emit("response.function_call_arguments.delta", item_id=self.open.id,
                                 output_index=len(self.output) - 1, delta=arguments)

    def finish(self, finish_reason: str | None, usage: Usage | dict) -> Iterator[str]:
        """The last events: the open item closed, then response.completed (or .incomplete where the
        output reached max_output_tokens). `usage` is the chat usage."""
        if not self.output:  # an empty answer is still a message
            yield from self._open_message()
        incomplete = finish_reason == "length"
        yield from self._close("incomplete" if incomplete else "completed")
        self.state.status = "incomplete" if incomplete else "completed"
        self.state.incomplete_details = IncompleteDetails(reason="max_output_tokens") if incomplete else None
        self.state.usage = ResponseUsage.of(Usage.model_validate(usage))
        yield self._emit("response.incomplete" if incomplete else "response.completed", response=self.response)

    def failed(self, message: str, code: str) -> Iterator[str]:
        """After the stream has begun, an error ends it: an error event, then response.failed."""
        yield self._emit("error", code=code, message=message, param=None)
        self.state.status = "failed"
        self.state.error = ResponseError(code=code, message=message)
        yield self._emit("response.failed", response=self.response)


@responses.post("/v1/responses")
@document_request(ResponsesRequest)
@document_response(ResponseObject)
async def create_response():
    """The response to the input; with `"stream": true`, its server-sent events."""
    state, body = api_state(), await json_body()
    try:
        own = _input_items(body)
        items = own
        if body.get("previous_response_id") is not None:
            items = [*state.responses.history(body["previous_response_id"]), *own]
        chat = chat_request({**body, "input": items})
        req = await state.off_loop(parse_chat, chat, state.limits, state.text_tokenizer("/v1/responses"))
        builder = ResponseBuilder(new_id("resp", "_"), body, req.model, req.params.temperature,
                                  req.params.top_p, logprobs=req.params.logprobs is not None)
        builder.state.previous_response_id = body.get("previous_response_id")
        if body.get("store") is not False and state.responses.capacity > 0:
            builder.stored_items, builder.own_items = items, len(own)
            builder.state.store = True
        if body.get("background"):
            _background(builder)
        req = await admit(state, dataclasses.replace(req, prompt_field="input"), builder.state.id, chat=True)
    except APIError as e:  # (an error of the chat request names the Responses field it came from)
        e.param = _CHAT_FIELDS.get(e.param, e.param)
        raise
    if builder.state.background:  # (its own task: the response goes on without this connection)
        queued = builder.state.model_copy(deep=True)
        run = BackgroundRun(builder.state, _events_or_failure(state, req, builder))
        state.responses.put(builder.state, builder.stored_items, builder.own_items, run)
        return Response(run.follow(), content_type="text/event-stream", headers={"Cache-Control": "no-cache"}) \
            if req.stream else queued
    return await streamed_or_whole(req, lambda: _events_or_failure(state, req, builder),
                                   lambda: _events(state, req, builder), lambda: builder.state)


def _background(builder: ResponseBuilder) -> None:
    """A background response, answered "queued": it must be stored (GET is how its answer is read)."""
    if not builder.state.store:
        raise APIError("background responses are stored (GET /v1/responses/{id} reads them): 'store' must not be "
                       "false, and the server must keep responses (--max-stored-responses > 0)", param="background")
    builder.state.background, builder.state.status = True, "queued"


async def _events(state: APIState, req: GenerationRequest, builder: ResponseBuilder) -> AsyncIterator[str]:
    """The Responses events of a chat request's one choice."""
    choices = Choices(req, True, state.engine, state.tool_parser)
    for event in builder.start():
        yield event
    async for _, update in generation(state, req, builder.state.id):
        answering = choices.reasoning is None or choices.reasoning[0].state == "content"
        text, logprobs = choices.add(0, update)
        logprobs = logprobs if answering else None  # (output_text's logprobs: none of the thinking's tokens)
        for k, delta in enumerate(choices.deltas(0, text, update.finish_reason is not None) or [DeltaMessage()]):
            for event in builder.delta(delta, logprobs if k == 0 else None):
                yield event
    last = list(builder.finish(choices.finish_reason(0), choices.usage()))
    if builder.stored_items is not None and not builder.state.background:  # (a background one is kept as it grows)
        # (before its last event: a client may continue it on seeing that)
        state.responses.put(builder.state, builder.stored_items, builder.own_items)
    for event in last:
        yield event


async def _events_or_failure(state: APIState, req: GenerationRequest, builder: ResponseBuilder
                             ) -> AsyncIterator[str]:
    try:
        async for event in _events(state, req, builder):
            yield event
    except Exception as e:  # after the 200 is sent, an error can only be an event in the stream
        status = stream_error_status(state, e)
        for event in builder.failed(str(e), "invalid_request_error" if status == 400 else "server_error"):
            yield event
