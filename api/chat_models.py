"""The chat request (`ChatCompletionRequest`, also what a Responses request turns into) and the
Responses API's own (`ResponsesRequest`), typed as `api/request_models.py` types the fields they share."""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel, ConfigDict

from api.errors import APIError
from api.fields import OBJECT, STRING, Bool, Object, Str, checked, described, documented, integer, object_of
from api.limits import Limits
from api.request_models import GenerationFields, MaxTokens, Temperature, TopLogprobs, TopP
from api.tools import ToolError, ToolRequest, function_tools, parse_tool_request
from jaxserve.engine.chat_template import template_options_error

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's


def _messages(name: str, messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    return messages


def _tools(name: str, tools) -> list[dict]:
    return function_tools(tools)


def _boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"'{name}' must be a boolean")
    return value


def _effort(name: str, value) -> str:
    if value not in REASONING_EFFORTS:
        raise ValueError(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}")
    return value


@dataclasses.dataclass(frozen=True)
class TemplateOptions:
    """How a chat request's messages are rendered (`Tokenizer.apply_chat_template`'s options)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict | None = None  # more template variables (OpenAI's reasoning_effort among them)
    chat_template: str | None = None  # the request's own template (--trust-request-chat-template)


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions (or a raw `prompt` instead of messages, rendered by no template)."""
    messages: checked(list, _messages, {"type": "array", "items": OBJECT, "minItems": 1}, "messages") = None
    logprobs: Bool = None
    top_logprobs: TopLogprobs = None
    tools: checked(list[dict], _tools, {"type": "array", "items": OBJECT}, "tools") = None
    # (read with the tools, once the sampling fields are: `tool_request`)
    tool_choice: described({"anyOf": [{"enum": ["none", "auto", "required"]}, OBJECT]}) = None
    functions: described({"type": "array", "items": OBJECT}, "deprecated: tools") = None
    function_call: described({"anyOf": [STRING, OBJECT]}, "deprecated: tool_choice") = None
    add_generation_prompt: checked(bool, _boolean, {"type": "boolean"}, "add_generation_prompt", null=False) = None
    continue_final_message: checked(bool, _boolean, {"type": "boolean"}, "continue_final_message",
                                     null=False) = None
    # (refused unless the server trusts requests' templates, whatever it holds: `template_options`)
    chat_template: described(STRING, "with --trust-request-chat-template only") = None
    chat_template_kwargs: object_of("chat_template_kwargs") = None
    reasoning_effort: checked(str, _effort, {"enum": list(REASONING_EFFORTS)}, "reasoning_effort") = None

    def check_together(self) -> None:
        if self.echo and self.logprobs:  # (vLLM's echo: the reply starts with the message it continues)
            raise APIError("'echo' with 'logprobs' on chat is not supported by this server yet", param="echo")
        super().check_together()
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing: vLLM takes it alone
            raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")

    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_request(self) -> ToolRequest | None:
        """The function tools: to show the template, and to parse or force ("none": shown only)."""
        try:
            return parse_tool_request(self.tools, self.tool_choice, self.functions, self.function_call,
                                      self.parallel_tool_calls)
        except ToolError as e:
            raise APIError(str(e), param=e.param) from e

    def template_options(self, limits: Limits) -> TemplateOptions:
        """The rendering options; `reasoning_effort` becomes a template variable of that name, as in vLLM
        (gpt-oss's templates read it)."""
        template = self.chat_template
        if template is not None:
            if not limits.trust_request_chat_template:
                raise APIError("the request passes a chat template, but the server was not started with "
                               "--trust-request-chat-template: a request's template is refused", param="chat_template")
            if not isinstance(template, str) or not template.strip():
                raise APIError("'chat_template' must be a non-empty string (a Jinja template)", param="chat_template")
        kwargs = self.chat_template_kwargs
        if self.reasoning_effort is not None:
            kwargs = {"reasoning_effort": self.reasoning_effort, **(kwargs or {})}
        options = TemplateOptions(self.given("add_generation_prompt", True), self.given("continue_final_message", False),
                                  kwargs, template)
        error = template_options_error(options.add_generation_prompt, options.continue_final_message, kwargs)
        if error:
            raise APIError(error[1], param=error[0])
        return options


class ResponsesRequest(BaseModel):
    """POST /v1/responses: read as the chat request it stands for (`api/responses.py`), whose model
    checks the fields passed on."""
    model_config = ConfigDict(extra="allow", frozen=True, json_schema_extra={"required": ["input"]})

    model: described(STRING) = None
    input: described({"anyOf": [STRING, {"type": "array", "items": OBJECT, "minItems": 1}]}) = None
    instructions: described(STRING) = None
    max_output_tokens: MaxTokens = None
    temperature: documented(Temperature) = None
    top_p: documented(TopP) = None
    top_logprobs: TopLogprobs = None  # (checked here: passed on only with `include`)
    include: described({"type": "array", "items": {"enum": ["message.output_text.logprobs"]}}) = None
    tools: described({"type": "array", "items": OBJECT}, "function tools") = None
    tool_choice: described({"anyOf": [{"enum": ["none", "auto", "required"]}, OBJECT]}) = None
    parallel_tool_calls: documented(Bool) = None
    text: described(OBJECT, '{"format": {"type": "text" | "json_object" | "json_schema", ...}}') = None
    reasoning: described(OBJECT, '{"effort": ...}') = None
    stream: documented(Bool) = None
    user: documented(Str) = None
    metadata: documented(Object) = None
    truncation: described({"enum": ["disabled"]}) = None
    priority: documented(integer(-(2**63), 2**63 - 1)) = None
    cache_salt: documented(Str) = None
    store: Bool = None  # (checked here; default true: the response is kept for GET and previous_response_id)
    background: Bool = None  # (checked here: answered at once, queued; read by GET, stopped by POST .../cancel)
    previous_response_id: Str = None  # (a stored response whose conversation this one continues)
