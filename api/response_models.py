"""The API's answers as typed models, dumped in their fields' order (`dump`).

A field whose default is `MISSING` is left out of the JSON unless set: vLLM's extras (token ids,
prompt logprobs, a reasoning parser's fields) appear only where asked for, while a field set to
None is written as null, as OpenAI's are.
"""

from __future__ import annotations

from typing import Literal

from pydantic import MISSING, BaseModel


def given(value, default=None):
    """A field's value, or `default` where it is MISSING (which is truthy)."""
    return default if value is MISSING else value


class Wire(BaseModel):
    def dump(self) -> dict:
        """The JSON object (as Python values) of the answer."""
        return self.model_dump()


class ErrorDetail(Wire):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Wire):
    error: ErrorDetail


class EngineDown(Wire):
    """The health routes' answer while the engine is not running, or not yet ready."""
    error: str = "engine not running"


# --- usage and logprobs

class PromptTokensDetails(Wire):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class TopLogprob(Wire):
    token: str
    logprob: float
    bytes: list[int]  # the token's own bytes (part of a character where it holds only some of them)


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Wire):
    content: list[ChatLogprob]


class CompletionLogprobs(Wire):
    """The legacy completions shape: per token, its name, logprob, top alternatives and text offset
    (None for a token without logprobs: an echoed prompt's first)."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    @classmethod
    def merged(cls, parts: list[CompletionLogprobs]) -> CompletionLogprobs | None:
        if not parts:
            return None
        return cls(tokens=[t for p in parts for t in p.tokens],
                   token_logprobs=[lp for p in parts for lp in p.token_logprobs],
                   top_logprobs=[top for p in parts for top in p.top_logprobs],
                   text_offset=[o for p in parts for o in p.text_offset])


class PromptLogprob(Wire):
    """vLLM's `prompt_logprobs` entry of a token."""
    logprob: float
    rank: int
    decoded_token: str | None  # None without a tokenizer (--skip-tokenizer-init)


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # None for the prompt's first token


# --- chat and completions

class FunctionCall(Wire):
    name: str
    arguments: str  # JSON text


class ToolCall(Wire):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(Wire):
    name: str = MISSING
    arguments: str = MISSING


class DeltaToolCall(Wire):
    index: int
    id: str = MISSING
    type: Literal["function"] = MISSING
    function: DeltaFunctionCall = MISSING


class ChatMessage(Wire):
    role: str
    content: str | None
    function_call: FunctionCall = MISSING  # the deprecated `functions` form: one call
    tool_calls: list[ToolCall] = MISSING
    reasoning: str | None = MISSING  # --reasoning-parser: the thinking
    reasoning_content: str | None = MISSING  # (vLLM's older name for it)


class DeltaMessage(Wire):
    """What a chat chunk adds to its choice's message."""
    role: str = MISSING
    content: str = MISSING
    reasoning: str = MISSING
    reasoning_content: str = MISSING
    tool_calls: list[DeltaToolCall] = MISSING
    function_call: DeltaFunctionCall = MISSING


FinishReason = str | None  # "stop", "length", "tool_calls", "function_call", "abort"; None while running
StopReason = int | str | None  # the stop token id or string that ended the choice


class HiddenStatesOut(Wire):
    """jaxserve's return_hidden_states: a choice's residual stream, f32[layers, positions, hidden] (`shape`),
    as base64 of its little-endian float32 values (`data`, row-major) or as nested lists (encoding float)."""

    layers: list[int | str]  # 0-based decoder layers (after the layer's residual add); "final": the final norm's output
    positions: list[int]  # of the prompt and output tokens, 0-based
    shape: list[int]
    encoding: str
    data: str | list


class ChatChoice(Wire):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    stop_reason: StopReason
    token_ids: list[int] = MISSING  # vLLM's return_token_ids
    entropies: list[float] = MISSING  # jaxserve's return_entropy: per generated token, in nats
    hidden_states: HiddenStatesOut = MISSING  # jaxserve's return_hidden_states


class CompletionChoice(Wire):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: StopReason
    token_ids: list[int] = MISSING  # vLLM's return_token_ids
    prompt_token_ids: list[int] = MISSING
    prompt_logprobs: PromptLogprobs = MISSING
    entropies: list[float] = MISSING  # jaxserve's return_entropy: per generated token, in nats
    hidden_states: HiddenStatesOut = MISSING  # jaxserve's return_hidden_states


class ChatCompletion(Wire):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs = MISSING
    prompt_token_ids: list[int] = MISSING
    weight_version: int = MISSING  # jaxserve's: the newest weights its tokens were sampled under (docs/rl.md)


class Completion(Wire):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    weight_version: int = MISSING  # jaxserve's: the newest weights its tokens were sampled under (docs/rl.md)


class ChatChunkChoice(Wire):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: StopReason = None
    token_ids: list[int] = MISSING  # those no chunk has carried yet
    entropies: list[float] = MISSING  # of the same tokens
    hidden_states: HiddenStatesOut = MISSING  # in the choice's last chunk, when asked for


class CompletionChunkChoice(Wire):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: StopReason = None
    token_ids: list[int] = MISSING  # those no chunk has carried yet
    prompt_token_ids: list[int] = MISSING  # in each choice's first chunk
    entropies: list[float] = MISSING  # of the tokens no chunk has carried yet
    hidden_states: HiddenStatesOut = MISSING  # in the choice's last chunk, when asked for


class ChatCompletionChunk(Wire):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    prompt_token_ids: list[int] = MISSING  # in each choice's first chunk
    choices: list[ChatChunkChoice]
    usage: Usage | None = MISSING  # with stream_options.include_usage: null but in the last chunk
    weight_version: int = MISSING  # jaxserve's: the newest weights its tokens were sampled under (docs/rl.md)


class CompletionChunk(Wire):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = MISSING  # with stream_options.include_usage: null but in the last chunk
    weight_version: int = MISSING  # jaxserve's: the newest weights its tokens were sampled under (docs/rl.md)


# --- models, tokenize

class ModelPermission(Wire):
    id: str
    object: Literal["model_permission"] = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(Wire):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxserve"
    root: str  # where the model came from (vLLM's)
    parent: str | None = None
    max_model_len: int
    permission: list[ModelPermission]


class ModelList(Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ServerLoad(Wire):
    server_load: int  # requests being generated
    queued_requests: int  # of those and the ones admitted, the requests waiting to start
    queued_tokens: int  # their prompt tokens


class Version(Wire):
    version: str


class TokenizeResponse(Wire):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(Wire):
    prompt: str
