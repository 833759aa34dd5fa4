"""The request bodies of the generating routes as typed models: chat completions, completions and
the Responses API; the OpenAPI document (/openapi.json) is generated from them.

A model checks each field's JSON type and OpenAI's bounds, once; `validated` turns the first fault
into OpenAI's error body naming the field. Null means absent, a whole-number float counts as an
integer, and unknown fields are ignored (kept as they came), as OpenAI and vLLM do. What depends on
the served model (the vocabulary, max_model_len, the names served) or on several fields together is
checked by `api/protocol.py`; fields it checks are only described here (`Described`), never
checked twice.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, JsonValue, TypeAdapter, ValidationError, \
    WithJsonSchema, model_validator

from api.errors import APIError
from jaxserve.sampling_params import MAX_N

MAX_TOKENS = 2**31  # OpenAI's bound on max_tokens and the other token counts


@dataclasses.dataclass(frozen=True)
class Typed:
    """A field of one JSON type: the message of a value of another."""
    what: str  # "a boolean", "a string", "an object"

    def message(self, name: str, error: dict) -> str:
        return f"'{name}' must be {self.what}, got {error['input']!r}"


@dataclasses.dataclass(frozen=True)
class Bounds:
    """A number field in [lo, hi] (or (lo, hi] where `lo_open`): the messages of a value of the wrong
    type and of one out of range (non-finite numbers included)."""
    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False

    def message(self, name: str, error: dict) -> str:
        value = error["input"]
        if error["type"] in ("int_type", "float_type"):
            return f"'{name}' must be {'an integer' if self.integer else 'a number'}, got {value!r}"
        return f"'{name}' must be in {'(' if self.lo_open else '['}{self.lo}, {self.hi}], got {value}"


def whole(value):
    """A whole-number float as the integer it stands for (5.0 is 5, as vLLM's request models read it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def number(lo: float, hi: float, lo_open: bool = False):
    """An optional number in [lo, hi] (or (lo, hi]); booleans and strings are not numbers."""
    bound = Field(strict=True, gt=lo, le=hi, allow_inf_nan=False) if lo_open else \
        Field(strict=True, ge=lo, le=hi, allow_inf_nan=False)
    return Annotated[Annotated[float, bound] | None, Bounds(lo, hi, lo_open=lo_open)]


def integer(lo: int, hi: int):
    """An optional integer in [lo, hi]; a whole-number float is read as the integer."""
    return Annotated[Annotated[int, Field(strict=True, ge=lo, le=hi)] | None, BeforeValidator(whole),
                     Bounds(lo, hi, integer=True)]


Bool = Annotated[Annotated[bool, Field(strict=True)] | None, Typed("a boolean")]
Str = Annotated[Annotated[str, Field(strict=True)] | None, Typed("a string")]
Object = Annotated[Annotated[dict, Field(strict=True)] | None, Typed("an object")]


def described(schema: dict, description: str | None = None):
    """A field checked elsewhere (`api/protocol.py`, `api/tools.py`): any JSON here, `schema` in the
    OpenAPI document."""
    return Annotated[JsonValue, WithJsonSchema({**schema, **({"description": description} if description else {})})]


def documented(field_type, description: str | None = None):
    """A field of the chat request that another request passes on to it, described as the chat
    request's field and checked there."""
    return described(TypeAdapter(field_type).json_schema(), description)


STRING = {"type": "string"}
OBJECT = {"type": "object"}
STRINGS = {"type": "array", "items": STRING}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
LengthPenalty = number(-100.0, 100.0)
Temperature = number(0.0, 2.0)
TopP = number(0.0, 1.0, lo_open=True)
MaxTokens = integer(1, MAX_TOKENS)
# top logprobs per token: OpenAI's 0..20, and as vLLM's more, or -1 for the whole vocabulary, where the
# server's --max-logprobs allows (the engine checks the cap)
TopLogprobs = integer(-1, MAX_TOKENS)


class GenerationFields(BaseModel):
    """The fields that chat completions and completions share (OpenAI's and vLLM's), in the order they
    are checked."""
    model_config = ConfigDict(extra="allow")

    model: described(STRING, "a served model's name (any, where absent)") = None
    echo: Bool = None
    user: Str = None
    metadata: Object = None
    store: Bool = None
    service_tier: Str = None
    parallel_tool_calls: Bool = None
    max_completion_tokens: MaxTokens = None
    max_tokens: MaxTokens = None
    prompt_logprobs: TopLogprobs = None  # (at most 20: the engine's check)
    stream: Bool = None
    min_tokens: integer(0, MAX_TOKENS) = None
    n: integer(1, MAX_N) = None
    temperature: Temperature = None
    top_p: TopP = None
    top_k: integer(-1, MAX_TOKENS) = None
    min_p: number(0.0, 1.0) = None
    presence_penalty: number(-2.0, 2.0) = None
    frequency_penalty: number(-2.0, 2.0) = None
    repetition_penalty: number(0.0, 100.0, lo_open=True) = None
    logit_bias: described({"type": "object", "additionalProperties": {"type": "number", "minimum": -100,
                                                                      "maximum": 100}}, "token id -> bias") = None
    seed: integer(-(2**63), 2**64 - 1) = None
    stop: described({"anyOf": [STRING, STRINGS]}) = None
    stop_token_ids: described(TOKEN_IDS) = None
    allowed_token_ids: described(TOKEN_IDS) = None
    bad_words: described(STRINGS) = None
    include_stop_str_in_output: Bool = None
    ignore_eos: Bool = None
    skip_special_tokens: Bool = None
    spaces_between_special_tokens: Bool = None
    truncate_prompt_tokens: integer(-1, MAX_TOKENS) = None
    response_format: described(OBJECT, '{"type": "text" | "json_object" | "json_schema", "json_schema": ...}') = None
    guided_json: described({"anyOf": [OBJECT, STRING]}) = None
    guided_regex: described(STRING) = None
    guided_choice: described(STRINGS) = None
    guided_grammar: described(STRING) = None
    structured_outputs: described(OBJECT, "vLLM's: one of json, regex, choice, grammar, json_object") = None
    stream_options: described(OBJECT, '{"include_usage": bool, "continuous_usage_stats": bool}') = None
    return_tokens_as_token_ids: Bool = None
    return_token_ids: Bool = None
    return_entropy: Bool = None  # jaxserve's: each choice's `entropies`, per generated token
    add_special_tokens: Bool = None
    use_beam_search: Bool = None
    vllm_xargs: described(OBJECT, "vLLM's: arguments of the server's logits processors (SamplingParams.extra_args)") = None
    # llama.cpp's samplers (its server's names; see docs/api.md)
    typical_p: number(0.0, 1.0) = None
    mirostat: integer(0, 2) = None
    mirostat_tau: number(0.0, 100.0) = None
    mirostat_eta: number(0.0, 1.0) = None
    dry_multiplier: number(0.0, 100.0) = None
    dry_base: number(1.0, 100.0) = None
    dry_allowed_length: integer(0, MAX_TOKENS) = None
    dry_penalty_last_n: integer(-1, MAX_TOKENS) = None
    dry_sequence_breakers: described(STRINGS, "DRY's (default: newline, colon, double quote, asterisk)") = None
    xtc_probability: number(0.0, 1.0) = None
    xtc_threshold: number(0.0, 1.0) = None
    top_n_sigma: number(-1.0, 100.0) = None
    dynatemp_range: number(0.0, 2.0) = None
    dynatemp_exponent: number(0.0, 100.0) = None
    min_keep: integer(0, MAX_TOKENS) = None
    length_penalty: documented(LengthPenalty, "with use_beam_search only") = None
    priority: integer(-(2**63), 2**63 - 1) = None  # vLLM's: lower first (--scheduling-policy priority; else 0)
    cache_salt: Str = None  # vLLM's: only requests with the same salt share prefix-cache pages

    @model_validator(mode="before")
    @classmethod
    def _newer_max_tokens(cls, body):
        """max_completion_tokens, OpenAI's newer name, supersedes max_tokens: the older one is not read."""
        if isinstance(body, dict) and body.get("max_completion_tokens") is not None and "max_tokens" in body:
            body = {k: v for k, v in body.items() if k != "max_tokens"}
        return body


class CompletionRequest(GenerationFields):
    """POST /v1/completions. With `echo`, max_tokens 0 scores the prompt alone."""
    model_config = ConfigDict(json_schema_extra={"required": ["prompt"]})

    prompt: described({"anyOf": [STRING, STRINGS, TOKEN_IDS, {"type": "array", "items": TOKEN_IDS}]}) = None
    logprobs: TopLogprobs = None


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions (or a raw `prompt` instead of messages, rendered by no template)."""
    messages: described({"type": "array", "items": OBJECT, "minItems": 1}) = None
    logprobs: Bool = None
    top_logprobs: TopLogprobs = None
    tools: described({"type": "array", "items": OBJECT}) = None
    tool_choice: described({"anyOf": [{"enum": ["none", "auto", "required"]}, OBJECT]}) = None
    functions: described({"type": "array", "items": OBJECT}, "deprecated: tools") = None
    function_call: described({"anyOf": [STRING, OBJECT]}, "deprecated: tool_choice") = None
    add_generation_prompt: described({"type": "boolean"}) = None
    continue_final_message: described({"type": "boolean"}) = None
    chat_template: described(STRING, "with --trust-request-chat-template only") = None
    chat_template_kwargs: described(OBJECT) = None
    reasoning_effort: described({"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]}) = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses: read as the chat request it stands for (`api/responses.py`), whose model
    checks the fields passed on."""
    model_config = ConfigDict(extra="allow", json_schema_extra={"required": ["input"]})

    model: described(STRING) = None
    input: described({"anyOf": [STRING, {"type": "array", "items": OBJECT, "minItems": 1}]}) = None
    instructions: described(STRING) = None
    max_output_tokens: MaxTokens = None
    temperature: documented(Temperature) = None
    top_p: documented(TopP) = None
    top_logprobs: documented(TopLogprobs) = None
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


def _error(rule: Typed | Bounds, name: str, error: ValidationError) -> APIError:
    return APIError(rule.message(name, error.errors()[0]), param=name)


def validated(model: type[BaseModel], body: dict) -> dict:
    """The body with its fields checked by `model` (whole-number floats made integers); a 400 naming
    the first field at fault otherwise."""
    try:
        return model.model_validate(body).model_dump(exclude_unset=True)
    except ValidationError as e:
        name = e.errors()[0]["loc"][0]
        rule = next(m for m in model.model_fields[name].metadata if isinstance(m, (Typed, Bounds)))
        raise _error(rule, name, e) from e


class FieldCheck:
    """The check of one field that its request's model only describes, made where its turn comes
    (`length_penalty`: once `use_beam_search` is known)."""

    def __init__(self, field_type):
        self.adapter = TypeAdapter(field_type)
        self.rule = next(m for m in get_args(field_type)[1:] if isinstance(m, (Typed, Bounds)))

    def __call__(self, body: dict, name: str, default):
        """body[name] as the field reads it, `default` where it is absent or null; a 400 naming it otherwise."""
        try:
            value = self.adapter.validate_python(body.get(name))
        except ValidationError as e:
            raise _error(self.rule, name, e) from e
        return default if value is None else value


length_penalty = FieldCheck(LengthPenalty)
