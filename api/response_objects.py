"""The Responses API's answers as typed models (`api/responses.py`), as `api.response_models`' are."""

from __future__ import annotations

from typing import Literal

from pydantic import JsonValue

from api.response_models import ChatLogprob, Usage, Wire

class OutputText(Wire):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[JsonValue] = []
    logprobs: list[ChatLogprob] = []


class MessageItem(Wire):
    type: Literal["message"] = "message"
    id: str
    status: str = "in_progress"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningText(Wire):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningItem(Wire):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[JsonValue] = []
    content: list[ReasoningText]
    encrypted_content: str | None = None
    status: str = "in_progress"


class FunctionCallItem(Wire):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: str = "in_progress"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(Wire):
    cached_tokens: int


class OutputTokensDetails(Wire):
    reasoning_tokens: int = 0


class ResponseUsage(Wire):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage) -> ResponseUsage:
        """The chat usage as the Responses API counts it."""
        return cls(input_tokens=usage.prompt_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
                   output_tokens=usage.completion_tokens, output_tokens_details=OutputTokensDetails(),
                   total_tokens=usage.total_tokens)


class ResponseReasoning(Wire):
    effort: str | None
    summary: str | None = None


class ResponseError(Wire):
    code: str
    message: str


class IncompleteDetails(Wire):
    reason: str


class ResponseObject(Wire):
    """A response of the Responses API; the request's own fields are echoed as it sent them."""
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str = "in_progress"  # then "completed", "incomplete", "failed"; background: "queued" first, or "cancelled"
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: JsonValue = None
    max_output_tokens: JsonValue = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: JsonValue = True
    previous_response_id: str | None = None
    reasoning: ResponseReasoning | None = None
    service_tier: str = "default"
    store: bool = False
    temperature: float
    text: JsonValue
    tool_choice: JsonValue
    tools: JsonValue
    top_logprobs: JsonValue = None
    top_p: float
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: JsonValue = None
    metadata: JsonValue
