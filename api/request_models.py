"""The request bodies of the generating routes as typed, frozen models: chat completions, completions
and the Responses API; the OpenAPI document (/openapi.json) is generated from them.

A model reads each field once, as its real type (stop strings, token ids, the logit bias, the
response format, the prompts), checking OpenAI's bounds (`api/fields.py`). A request then turns
itself into what the engine takes (`to_sampling_params`, `to_beam_search_params`, `prompts`),
checking what depends on several fields or on the served model (`Limits`) on the way.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, model_validator

from api.errors import APIError
from api.fields import (MAX_TOKENS, OBJECT, STRING, STRINGS, TOKEN_IDS, Bool, FieldCheck, Object, Str, checked,
                        described, documented, integer, number, object_of, strings, token_id_list, token_ids)
from api.limits import Limits
from api.structured_fields import (GUIDED, STRUCTURED_OUTPUTS, ResponseFormat, ResponseFormatField,
                                   StructuredOutputsField, guided, guided_spec)
from jaxserve.engine.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from jaxserve.errors import RequestError
from jaxserve.sample.params import MAX_N, SamplingParams
from jaxserve.structured_output.grammar import Constraint

LengthPenalty = number(-100.0, 100.0)
Temperature = number(0.0, 2.0)
TopP = number(0.0, 1.0, lo_open=True)
MaxTokens = integer(1, MAX_TOKENS)
# top logprobs per token: OpenAI's 0..20, and as vLLM's more, or -1 for the whole vocabulary, where the
# server's --max-logprobs allows (the engine checks the cap)
TopLogprobs = integer(-1, MAX_TOKENS)
length_penalty = FieldCheck(LengthPenalty)

# Fields (OpenAI's and vLLM's) whose non-default values this server does not implement yet:
# refused, never ignored.
_NOT_YET = {
    "best_of": lambda v: v not in (None, 1),
    "suffix": lambda v: bool(v),
    "audio": lambda v: v is not None,  # (the models write text only)
    "modalities": lambda v: v not in (None, ["text"]),
    "web_search_options": lambda v: v is not None,
}
# llama.cpp's sampler fields, SamplingParams' of the same names (bounds: the request models')
LLAMACPP_FIELDS = ("typical_p", "mirostat", "mirostat_tau", "mirostat_eta", "dry_multiplier", "dry_base",
                   "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "xtc_probability",
                   "xtc_threshold", "top_n_sigma", "dynatemp_range", "dynatemp_exponent", "min_keep")
# With use_beam_search, the fields beam search has no use for: 400 unless absent or at these values.
_BEAM_NEUTRAL = {"top_p": (1,), "top_k": (-1, 0), "min_p": (0,), "presence_penalty": (0,), "frequency_penalty": (0,),
                 "repetition_penalty": (1,), "min_tokens": (0,), "prompt_logprobs": (), "stop": ([""], []),
                 "stop_token_ids": ([],), "logit_bias": ({},), "bad_words": ([],), "allowed_token_ids": (),
                 "response_format": ("text",), "tools": ([],), "guided_json": (), "guided_regex": (),
                 "guided_choice": (), "guided_grammar": (), "grammar": (), "json_schema": (), "structured_outputs": (),
                 "return_entropy": (False,), "return_hidden_states": (False,), "steering": ([],),
                 "steer_prompt": (True,), "min_weight_version": (0,),
                 **{name: (getattr(SamplingParams(), name),) for name in LLAMACPP_FIELDS}}


def _stop(name: str, value) -> list[str]:
    stop = [value] if isinstance(value, str) else value
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):  # (SamplingParams: its bounds)
        raise ValueError("'stop' must be a string or a list of strings")
    return stop


def _bool_or_object(name: str, value) -> bool | dict:
    if not isinstance(value, (bool, dict)):
        raise ValueError(f"'{name}' must be a boolean or an object")
    return value


def _objects(name: str, value) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"'{name}' must be a list of objects")
    return value


def _logit_bias(name: str, bias) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise ValueError(f"'logit_bias' must be an object of token ids to biases, got {bias!r}")
    out = {}  # (its bounds: SamplingParams'; its ids in the vocabulary: the engine's)
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ValueError(f"'logit_bias' key {key!r} is not a token id")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"'logit_bias' values must be numbers, got {value!r}")
        out[int(key)] = float(value)
    return out


class GenerationFields(BaseModel):
    """The fields that chat completions and completions share (OpenAI's and vLLM's), in the order they
    are checked, and what they turn into."""
    model_config = ConfigDict(extra="allow", frozen=True)

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
    logit_bias: checked(dict[int, float], _logit_bias, {"type": "object", "additionalProperties": {
        "type": "number", "minimum": -100, "maximum": 100}}, "logit_bias", "token id -> bias") = None
    seed: integer(-(2**63), 2**64 - 1) = None
    stop: checked(list[str], _stop, {"anyOf": [STRING, STRINGS]}, "stop") = None
    stop_token_ids: token_id_list("stop_token_ids") = None
    allowed_token_ids: token_id_list("allowed_token_ids") = None
    bad_words: strings("bad_words") = None
    include_stop_str_in_output: Bool = None
    ignore_eos: Bool = None
    skip_special_tokens: Bool = None
    spaces_between_special_tokens: Bool = None
    truncate_prompt_tokens: integer(-1, MAX_TOKENS) = None
    response_format: ResponseFormatField = None
    guided_json: guided("guided_json", {"anyOf": [OBJECT, STRING]}) = None
    guided_regex: guided("guided_regex", STRING) = None
    guided_choice: guided("guided_choice", STRINGS) = None
    guided_grammar: guided("guided_grammar", STRING) = None
    grammar: guided("grammar", STRING) = None  # llama.cpp's: a GBNF (or Lark) grammar, as guided_grammar
    json_schema: guided("json_schema", {"anyOf": [OBJECT, STRING]}) = None  # llama.cpp's: as guided_json
    structured_outputs: StructuredOutputsField = None
    stream_options: object_of("stream_options", '{"include_usage": bool, "continuous_usage_stats": bool}') = None
    return_tokens_as_token_ids: Bool = None
    return_token_ids: Bool = None
    return_entropy: Bool = None  # jaxserve's: each choice's `entropies`, per generated token
    # jaxserve's: each choice's residual stream, and vectors added to it (docs/research_sampling.md)
    return_hidden_states: checked(bool | dict, _bool_or_object, {"anyOf": [{"type": "boolean"}, OBJECT]},
                                  "return_hidden_states", "true, or {layers, positions, encoding}") = None
    steering: checked(list, _objects, {"type": "array", "items": OBJECT}, "steering",
                      "[{layer, vector (list or base64 float32) or name, scale}]") = None
    steer_prompt: Bool = None
    add_special_tokens: Bool = None
    use_beam_search: Bool = None
    vllm_xargs: object_of("vllm_xargs", "vLLM's: arguments of the server's logits processors "
                                        "(SamplingParams.extra_args)") = None
    # llama.cpp's samplers (its server's names; see docs/api.md)
    typical_p: number(0.0, 1.0) = None
    mirostat: integer(0, 2) = None
    mirostat_tau: number(0.0, 100.0) = None
    mirostat_eta: number(0.0, 1.0) = None
    dry_multiplier: number(0.0, 100.0) = None
    dry_base: number(1.0, 100.0) = None
    dry_allowed_length: integer(0, MAX_TOKENS) = None
    dry_penalty_last_n: integer(-1, MAX_TOKENS) = None
    dry_sequence_breakers: strings("dry_sequence_breakers", "DRY's (default: newline, colon, double quote, "
                                                            "asterisk)") = None
    xtc_probability: number(0.0, 1.0) = None
    xtc_threshold: number(0.0, 1.0) = None
    top_n_sigma: number(-1.0, 100.0) = None
    dynatemp_range: number(0.0, 2.0) = None
    dynatemp_exponent: number(0.0, 100.0) = None
    min_keep: integer(0, MAX_TOKENS) = None
    length_penalty: documented(LengthPenalty, "with use_beam_search only") = None
    priority: integer(-(2**63), 2**63 - 1) = None  # vLLM's: lower first (--scheduling-policy priority; else 0)
    cache_salt: Str = None  # vLLM's: only requests with the same salt share prefix-cache pages
    min_weight_version: integer(0, 2**63 - 1) = None  # jaxserve's: wait for weights of this version or newer
    request_id: Str = None  # vLLM's: names the request, as an X-Request-Id header (the answer's id ends with it)

    @model_validator(mode="before")
    @classmethod
    def _newer_max_tokens(cls, body):
        """max_completion_tokens, OpenAI's newer name, supersedes max_tokens: the older one is not read."""
        if isinstance(body, dict) and body.get("max_completion_tokens") is not None and "max_tokens" in body:
            body = {k: v for k, v in body.items() if k != "max_tokens"}
        return body

    @model_validator(mode="after")
    def _together(self):
        """The fields that go only with others, checked once every field is read (a 400 naming the first)."""
        self.check_together()
        return self

    def check_together(self) -> None:
        if self.prompt_logprobs is not None and self.stream:
            raise APIError("'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs")
        if self.stream_options and not self.stream:
            raise APIError("'stream_options' is only allowed with 'stream': true", param="stream_options")
        if not self.use_beam_search and self.length_penalty not in (None, 1):
            raise APIError("'length_penalty' applies only with 'use_beam_search'", param="length_penalty")

    def given(self, name: str, default=None):
        """A field's value (an unknown field's as it came), `default` where it is absent or null."""
        value = getattr(self, name) if name in type(self).model_fields else (self.model_extra or {}).get(name)
        return default if value is None else value

    def to_sampling_params(self, limits: Limits, default_max_tokens: int | None) -> SamplingParams:
        """The request's sampling fields; `default_max_tokens` None means up to max_model_len."""
        for name, used in _NOT_YET.items():
            if name in (self.model_extra or {}) and used(self.model_extra[name]):
                raise APIError(f"'{name}' is not supported by this server yet", param=name)
        if self.given("best_of") is not None and self.given("n", 1) > self.given("best_of"):  # (as vLLM)
            raise APIError("'best_of' must be at least 'n'", param="best_of")
        if self.given("logits_processors"):
            raise APIError("'logits_processors' are registered when the server starts (--logits-processors); a "
                           "request uses them through their arguments, in 'vllm_xargs'", param="logits_processors")
        try:
            return SamplingParams(**self._sampling_fields(limits, default_max_tokens))
        except RequestError as e:  # SamplingParams' own bounds (stop strings, bad words, min_tokens, ...)
            raise APIError(str(e), param=e.field) from e
        except ValueError as e:
            raise APIError(str(e)) from e

    def _sampling_fields(self, limits: Limits, default_max_tokens: int | None) -> dict:
        defaults, given = limits.sampling_defaults, self.given
        max_tokens = given("max_completion_tokens", given("max_tokens", default_max_tokens))
        if "max_tokens" in defaults and max_tokens is not None:  # as vLLM: the model's max_new_tokens bounds
            max_tokens = min(defaults["max_tokens"], max_tokens)  # every request (without one: `as_run`)
        return dict(
            n=given("n", 1), max_tokens=max_tokens, min_tokens=given("min_tokens", 0),
            temperature=float(given("temperature", defaults.get("temperature", 1.0))),
            top_p=float(given("top_p", defaults.get("top_p", 1.0))), top_k=given("top_k", defaults.get("top_k", -1)),
            min_p=float(given("min_p", defaults.get("min_p", 0.0))),
            presence_penalty=float(given("presence_penalty", 0.0)),
            frequency_penalty=float(given("frequency_penalty", 0.0)),
            repetition_penalty=float(given("repetition_penalty", defaults.get("repetition_penalty", 1.0))),
            logit_bias=given("logit_bias", {}), seed=self.seed, stop=given("stop", []),
            stop_token_ids=given("stop_token_ids", []), allowed_token_ids=self.allowed_token_ids,
            bad_words=given("bad_words", []), include_stop_str_in_output=given("include_stop_str_in_output", False),
            ignore_eos=given("ignore_eos", False), skip_special_tokens=given("skip_special_tokens", True),
            spaces_between_special_tokens=given("spaces_between_special_tokens", True),
            truncate_prompt_tokens=self._truncate_prompt_tokens(limits.max_model_len), logprobs=self.top_logprobs_k(),
            prompt_logprobs=self.prompt_logprobs, constraint=self.constraint(), extra_args=self._extra_args(limits),
            return_entropy=given("return_entropy", False), return_hidden_states=self.return_hidden_states,
            steering=self.steering, steer_prompt=given("steer_prompt", True),
            **{name: getattr(self, name) for name in LLAMACPP_FIELDS if getattr(self, name) is not None})

    def top_logprobs_k(self) -> int | None:
        """Top logprobs per sampled token, or None for no logprobs."""
        raise NotImplementedError

    def _truncate_prompt_tokens(self, max_model_len: int) -> int | None:
        keep = self.truncate_prompt_tokens
        if keep == 0 or (keep or 0) > max_model_len:
            raise APIError(f"'truncate_prompt_tokens' must be -1 (the model's context) or from 1 to max_model_len "
                           f"({max_model_len}), got {keep}", param="truncate_prompt_tokens")
        return keep

    def constraint(self) -> Constraint | None:
        """response_format, or one of vLLM's guided_* fields or `structured_outputs` (its newer form of
        them), as a grammar constraint (compiled once to check it)."""
        found, guided = [], {name: getattr(self, name) for name in GUIDED}
        structured = self.structured_outputs or {}
        if structured.get("json_object"):
            found.append(("structured_outputs", Constraint("json_object")))
        for key, name in STRUCTURED_OUTPUTS.items():
            if key in structured:
                if guided[name] is not None:
                    raise APIError(f"give one constraint, not structured_outputs.{key} and {name}",
                                   param="structured_outputs")
                try:
                    guided[name] = guided_spec(name, structured[key])
                except ValueError as e:
                    raise APIError(str(e), param=name) from e
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            found.append(("response_format", Constraint("json_object") if fmt.type == "json_object" else
                          Constraint("json_schema", json.dumps(fmt.json_schema["schema"]))))
        found += [(name, Constraint(GUIDED[name], value)) for name, value in guided.items() if value is not None]
        if len(found) > 1:
            raise APIError(f"give one constraint, not {' and '.join(n for n, _ in found)}", param=found[1][0])
        if not found:
            return None
        param, constraint = found[0]
        try:
            constraint.grammar()
        except ValueError as e:
            raise APIError(f"'{param}': {e}", param=param) from e
        return constraint

    def _extra_args(self, limits: Limits) -> dict | None:
        """vLLM's `vllm_xargs` (SamplingParams.extra_args), with the logits processors' arguments given as
        top-level fields (the OpenAI SDK's extra_body) under them."""
        extra = {name: self.given(name) for name in limits.processor_args if self.given(name) is not None}
        extra.update(self.vllm_xargs or {})
        return extra or None

    def response_options(self, limits: Limits) -> dict:
        """GenerationRequest's fields on how the request runs and its response is sent: stream,
        include_usage, continuous_usage (vLLM's continuous_usage_stats, with include_usage only),
        tokens_as_ids (vLLM's return_tokens_as_token_ids), return_token_ids, priority and cache_salt
        (checked by the engine)."""
        stream, options = self.given("stream", False), self.stream_options
        include_usage = bool(options and options.get("include_usage")) or (stream and limits.force_include_usage)
        return dict(stream=stream, include_usage=include_usage,
                    continuous_usage=include_usage and bool(options and options.get("continuous_usage_stats")),
                    tokens_as_ids=self.given("return_tokens_as_token_ids", limits.tokens_as_ids),
                    return_token_ids=self.given("return_token_ids", False), priority=self.given("priority", 0),
                    cache_salt=self.cache_salt, min_weight_version=self.given("min_weight_version", 0))

    def to_beam_search_params(self, params: SamplingParams, prompts: list[list[int]], echo: bool,
                              limits: Limits) -> BeamSearchParams | None:
        """vLLM's `use_beam_search` (with `length_penalty`): the request's n best beams become its n
        choices (logprobs: see `api/generation.py`). Sampling controls that beam search has no use for
        are a 400, not ignored."""
        if not self.use_beam_search:
            return None
        refused = [name for name, neutral in _BEAM_NEUTRAL.items() if self._beam_value(name) not in (None, *neutral)]
        if refused:
            raise APIError(f"'{refused[0]}' cannot be combined with 'use_beam_search'", param=refused[0])
        if echo and params.logprobs is not None:
            raise APIError("'echo' with 'logprobs' cannot be combined with 'use_beam_search': beam search scores "
                           "no prompt tokens", param="logprobs")
        if params.n > MAX_BEAM_WIDTH:
            raise APIError(f"'n' (the beam width) must be at most {MAX_BEAM_WIDTH} with 'use_beam_search'", param="n")
        # (a prompt that leaves no room is the engine's 400, in `admit`)
        max_tokens = params.max_tokens or max(1, limits.max_model_len - max(map(len, prompts)))
        return BeamSearchParams(beam_width=params.n, max_tokens=max_tokens, ignore_eos=params.ignore_eos,
                                temperature=params.temperature,
                                length_penalty=float(length_penalty(self.length_penalty, "length_penalty", 1.0)))

    def _beam_value(self, name: str):
        value = self.given(name)
        return value.type if isinstance(value, ResponseFormat) else value


def read_prompts(name: str, prompt) -> list[str] | list[list[int]]:
    if isinstance(prompt, str) or token_ids(prompt):
        prompt = [token_ids(prompt) or prompt]
    elif isinstance(prompt, list) and not all(isinstance(p, str) for p in prompt):
        prompt = [token_ids(p) for p in prompt]  # (None where one is not a list of ids)
    if not isinstance(prompt, list) or not prompt or not (all(isinstance(p, str) for p in prompt)
                                                          or all(isinstance(p, list) for p in prompt)):
        raise ValueError(f"'{name}' must be a string, a list of strings, a list of token ids, or a list of token-id "
                         "lists")
    return prompt


class CompletionRequest(GenerationFields):
    """POST /v1/completions. With `echo`, max_tokens 0 scores the prompt alone."""
    model_config = ConfigDict(json_schema_extra={"required": ["prompt"]})

    prompt: checked(list[str] | list[list[int]], read_prompts, {"anyOf": [
        STRING, STRINGS, TOKEN_IDS, {"type": "array", "items": TOKEN_IDS}]}, "prompt") = None
    logprobs: TopLogprobs = None

    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts: strings, or token-id lists."""
        if self.prompt is None:
            raise APIError("'prompt' must be a string, a list of strings, a list of token ids, or a list of token-id "
                           "lists", param="prompt")
        return self.prompt
