"""A chat or completions request body (already parsed JSON) as a `GenerationRequest`: prompt token
ids (one list per prompt), `SamplingParams`, and how the answer is sent.

The fields' JSON types and OpenAI's bounds are checked by the request models
(`api/request_models.py`); here, what depends on the served model (its names, vocabulary,
max_model_len, chat template) or on several fields together, and the structured fields (stop,
logit_bias, constraints, tools). Anything out of range, of the wrong type, or not supported yet
raises `APIError` (HTTP 400 with OpenAI's error body); unknown extra fields are ignored, as OpenAI
and vLLM do. This module knows the tokenizer and the limits, not the engine loop.
"""

from __future__ import annotations

import dataclasses
import json

from jaxserve.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from jaxserve.config import MAX_LOGPROBS, RequestError
from jaxserve.sampling import needs_distribution
from jaxserve.sampling_params import SamplingParams
from api.errors import APIError
from api.request_models import ChatCompletionRequest, CompletionRequest, length_penalty, validated, whole
from api.tools import ToolError, ToolRequest, parse_tool_request
from jaxserve.structured import Constraint
from jaxserve.tokenizer import (CHAT_TEMPLATE_TIMEOUT_S, Tokenizer, message_text, template_message,
                                template_options_error)


@dataclasses.dataclass
class Limits:
    served_model_name: str  # the name answers carry where a request names none
    max_model_len: int
    vocab_size: int
    # the model's sampling defaults (`Engine.sampling_defaults`): for the fields a request leaves out;
    # a default max_tokens also caps the request's own
    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    trust_request_chat_template: bool = False  # vLLM's --trust-request-chat-template: requests may pass their own
    other_model_names: tuple[str, ...] = ()  # more names requests may use (vLLM's --served-model-name A B ...)
    chat_template_content_format: str = "auto"  # how message content reaches the template (CONTENT_FORMATS)
    model_root: str = ""  # where the model came from (--model), the model cards' `root` (vLLM's)
    tokens_as_ids: bool = False  # vLLM's --return-tokens-as-token-ids: the default of return_tokens_as_token_ids
    response_role: str = "assistant"  # vLLM's --response-role: the role of chat answers
    force_include_usage: bool = False  # vLLM's --enable-force-include-usage: usage ends every stream
    processor_args: frozenset[str] = frozenset()  # the logits processors' argument names (top-level fields too)
    chat_template_timeout: float = CHAT_TEMPLATE_TIMEOUT_S  # seconds a conversation may take to render

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.served_model_name, *self.other_model_names


@dataclasses.dataclass
class GenerationRequest:
    prompts: list[list[int]]  # token ids of each prompt (one choice each)
    prompt_texts: list[str]  # what `echo` repeats (chat: the assistant message continued, else "")
    params: SamplingParams
    # how the response is sent (`_response_options`)
    stream: bool
    include_usage: bool  # stream_options.include_usage
    echo: bool = False  # prompt_texts lead each choice
    prompt_only: bool = False  # completions: echo with max_tokens 0, the prompt alone (one token is sampled, dropped)
    beam: BeamSearchParams | None = None  # vLLM's use_beam_search: the n best beams are the n choices
    tools: ToolRequest | None = None  # chat: tool calls to parse or force ("none" is left out)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage in every chunk
    return_token_ids: bool = False  # vLLM's: answers carry the prompt's and the choices' token ids
    model: str = ""  # the served name the answer carries (`check_model`)
    role: str = "assistant"  # chat: the answer's role (--response-role; with no generation prompt, the last message's)
    thinking: bool | None = None  # chat, --reasoning-parser: whether the output starts inside the thinking
    prompt_field: str = "prompt"  # the field the prompts came from, which errors about them name
    priority: int = 0  # vLLM's: lower first, under --scheduling-policy priority
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache pages


def _ids(value) -> list[int] | None:
    """A list of token ids (whole-number floats read as integers); None where `value` is not one."""
    if not isinstance(value, list):
        return None
    ids = [whole(t) for t in value]
    return ids if all(isinstance(t, int) and not isinstance(t, bool) for t in ids) else None


def _given(body: dict, name: str, default=None):
    """body[name] (its type and bounds checked by the request model), `default` where it is absent or null."""
    value = body.get(name)
    return default if value is None else value


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
                 "repetition_penalty": (1,), "min_tokens": (0,), "prompt_logprobs": (), "stop": ("", []),
                 "stop_token_ids": ([],), "logit_bias": ({},),
                 "bad_words": ([],), "allowed_token_ids": (), "response_format": ({"type": "text"},), "tools": ([],),
                 "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
                 "structured_outputs": (), "return_entropy": (False,),
                 **{name: (getattr(SamplingParams(), name),) for name in LLAMACPP_FIELDS}}


def _beam_search(req: GenerationRequest, body: dict, limits: Limits) -> GenerationRequest:
    """vLLM's `use_beam_search` (with `length_penalty`): the request's n best beams become its n
    choices (logprobs: see `api/generation.py`). Sampling controls that beam search has no use for
    are a 400, not ignored."""
    if not _given(body, "use_beam_search", False):
        if body.get("length_penalty") not in (None, 1):
            raise APIError("'length_penalty' applies only with 'use_beam_search'", param="length_penalty")
        return req
    refused = [name for name, neutral in _BEAM_NEUTRAL.items()
               if body.get(name) is not None and body[name] not in neutral]
    if refused:
        raise APIError(f"'{refused[0]}' cannot be combined with 'use_beam_search'", param=refused[0])
    params = req.params
    if req.echo and params.logprobs is not None:
        raise APIError("'echo' with 'logprobs' cannot be combined with 'use_beam_search': beam search scores no "
                       "prompt tokens", param="logprobs")
    if params.n > MAX_BEAM_WIDTH:
        raise APIError(f"'n' (the beam width) must be at most {MAX_BEAM_WIDTH} with 'use_beam_search'", param="n")
    # (a prompt that leaves no room is the engine's 400, in `admit`)
    max_tokens = params.max_tokens or max(1, limits.max_model_len - max(map(len, req.prompts)))
    req.beam = BeamSearchParams(beam_width=params.n, max_tokens=max_tokens, ignore_eos=params.ignore_eos,
                                temperature=params.temperature,
                                length_penalty=float(length_penalty(body, "length_penalty", 1.0)))
    return req


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):  # (SamplingParams: its bounds)
        raise APIError("'stop' must be a string or a list of strings", param="stop")
    return stop


def _token_ids(body: dict, name: str) -> list[int]:
    """A list of integers (in the vocabulary: the engine's check)."""
    value = _ids([] if body.get(name) is None else body[name])
    if value is None:
        raise APIError(f"'{name}' must be a list of token ids", param=name)
    return value


def _allowed_token_ids(body: dict) -> list[int] | None:
    return None if body.get("allowed_token_ids") is None else _token_ids(body, "allowed_token_ids")


def _bad_words(body: dict) -> list[str]:
    words = [] if body.get("bad_words") is None else body["bad_words"]
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):  # (SamplingParams: its bounds)
        raise APIError("'bad_words' must be a list of strings", param="bad_words")
    return words


def _truncate_prompt_tokens(body: dict, max_model_len: int) -> int | None:
    keep = _given(body, "truncate_prompt_tokens")
    if keep == 0 or (keep or 0) > max_model_len:
        raise APIError(f"'truncate_prompt_tokens' must be -1 (the model's context) or from 1 to max_model_len "
                       f"({max_model_len}), got {keep}", param="truncate_prompt_tokens")
    return keep


def _logit_bias(body: dict) -> dict[int, float]:
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise APIError(f"'logit_bias' must be an object of token ids to biases, got {bias!r}", param="logit_bias")
    out = {}  # (its bounds: SamplingParams'; its ids in the vocabulary: the engine's)
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise APIError(f"'logit_bias' key {key!r} is not a token id", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise APIError(f"'logit_bias' values must be numbers, got {value!r}", param="logit_bias")
        out[int(key)] = float(value)
    return out


def _logprobs(body: dict, chat: bool) -> int | None:
    """Top logprobs per token, or None for no logprobs."""
    if chat:
        wanted = _given(body, "logprobs", False)
        top = _given(body, "top_logprobs")
        if top and not wanted:  # 0 asks for nothing: vLLM takes it alone
            raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if wanted else None
    return _given(body, "logprobs")


# vLLM's `structured_outputs` keys -> the guided_* field each stands for
_STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                       "grammar": "guided_grammar"}


def _constraint(body: dict) -> Constraint | None:
    """response_format, or one of vLLM's guided_* fields or `structured_outputs` (its newer form of
    them), as a grammar constraint (validated)."""
    found = []
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise APIError("'structured_outputs' must be an object", param="structured_outputs")
        given = {k: v for k, v in structured.items() if v is not None and v is not False}
        unknown = sorted(set(given) - {*_STRUCTURED_OUTPUTS, "json_object"})
        if unknown:
            raise APIError(f"'structured_outputs.{unknown[0]}' is not supported by this server; give one of "
                           f"{', '.join([*_STRUCTURED_OUTPUTS, 'json_object'])}", param="structured_outputs")
        if given.get("json_object"):
            found.append(("structured_outputs", Constraint("json_object")))
        for key, name in _STRUCTURED_OUTPUTS.items():
            if key in given and body.get(name) is not None:
                raise APIError(f"give one constraint, not structured_outputs.{key} and {name}",
                               param="structured_outputs")
        body = {**body, **{_STRUCTURED_OUTPUTS[k]: v for k, v in given.items() if k in _STRUCTURED_OUTPUTS}}
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(("response_format", Constraint("json_object")))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError("'response_format.json_schema' needs a 'schema' object", param="response_format")
            found.append(("response_format", Constraint("json_schema", json.dumps(spec["schema"]))))
        elif kind != "text":
            raise APIError("'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                           param="response_format")
    guided = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
              "guided_grammar": "grammar"}
    for name, kind in guided.items():
        value = body.get(name)
        if value is None:
            continue
        if kind == "json_schema" and isinstance(value, dict):
            value = json.dumps(value)
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
                raise APIError("'guided_choice' must be a non-empty list of strings", param=name)
            value = tuple(value)
        elif not isinstance(value, str):
            raise APIError(f"'{name}' must be a string", param=name)
        found.append((name, Constraint(kind, value)))
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


def _llamacpp_fields(body: dict) -> dict:
    """The llama.cpp sampler fields the request gives (the others keep SamplingParams' defaults)."""
    breakers = body.get("dry_sequence_breakers")
    if breakers is not None and not (isinstance(breakers, list) and all(isinstance(b, str) for b in breakers)):
        raise APIError("'dry_sequence_breakers' must be a list of strings", param="dry_sequence_breakers")
    return {name: body[name] for name in LLAMACPP_FIELDS if body.get(name) is not None}


def sampling_params(body: dict, limits: Limits, default_max_tokens: int | None, chat: bool) -> SamplingParams:
    """The request's sampling fields; `default_max_tokens` None means up to max_model_len."""
    for name, used in _NOT_YET.items():
        if name in body and used(body[name]):
            raise APIError(f"'{name}' is not supported by this server yet", param=name)
    if body.get("logits_processors"):
        raise APIError("'logits_processors' are registered when the server starts (--logits-processors); a "
                       "request uses them through their arguments, in 'vllm_xargs'", param="logits_processors")
    defaults = limits.sampling_defaults
    max_tokens = _given(body, "max_completion_tokens", _given(body, "max_tokens", default_max_tokens))
    if "max_tokens" in defaults and max_tokens is not None:  # as vLLM: the model's max_new_tokens bounds
        max_tokens = min(defaults["max_tokens"], max_tokens)  # every request (without one: `_as_run`)
    prompt_logprobs = _given(body, "prompt_logprobs")
    if prompt_logprobs is not None and _given(body, "stream", False):
        raise APIError("'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs")
    fields = dict(
        n=_given(body, "n", 1),
        max_tokens=max_tokens,
        min_tokens=_given(body, "min_tokens", 0),
        temperature=float(_given(body, "temperature", defaults.get("temperature", 1.0))),
        top_p=float(_given(body, "top_p", defaults.get("top_p", 1.0))),
        top_k=_given(body, "top_k", defaults.get("top_k", -1)),
        min_p=float(_given(body, "min_p", defaults.get("min_p", 0.0))),
        presence_penalty=float(_given(body, "presence_penalty", 0.0)),
        frequency_penalty=float(_given(body, "frequency_penalty", 0.0)),
        repetition_penalty=float(_given(body, "repetition_penalty", defaults.get("repetition_penalty", 1.0))),
        logit_bias=_logit_bias(body),
        seed=_given(body, "seed"),
        stop=_stop(body),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        allowed_token_ids=_allowed_token_ids(body),
        bad_words=_bad_words(body),
        include_stop_str_in_output=_given(body, "include_stop_str_in_output", False),
        ignore_eos=_given(body, "ignore_eos", False),
        skip_special_tokens=_given(body, "skip_special_tokens", True),
        spaces_between_special_tokens=_given(body, "spaces_between_special_tokens", True),
        truncate_prompt_tokens=_truncate_prompt_tokens(body, limits.max_model_len),
        logprobs=_logprobs(body, chat),
        prompt_logprobs=prompt_logprobs,
        constraint=_constraint(body),
        extra_args=_extra_args(body, limits),
        return_entropy=_given(body, "return_entropy", False),
        **_llamacpp_fields(body),
    )
    try:
        return SamplingParams(**fields)
    except RequestError as e:  # SamplingParams' own bounds (stop strings, bad words, min_tokens, ...)
        raise APIError(str(e), param=e.field) from e
    except ValueError as e:
        raise APIError(str(e)) from e


def _extra_args(body: dict, limits: Limits) -> dict | None:
    """vLLM's `vllm_xargs` (SamplingParams.extra_args), with the logits processors' arguments given as
    top-level fields (the OpenAI SDK's extra_body) under them."""
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise APIError("'vllm_xargs' must be an object", param="vllm_xargs")
    extra = {name: body[name] for name in limits.processor_args if body.get(name) is not None}
    extra.update(xargs or {})
    return extra or None


def _response_options(body: dict, limits: Limits) -> dict:
    """GenerationRequest's fields on how the request runs and its response is sent: stream,
    include_usage, continuous_usage (vLLM's continuous_usage_stats, with include_usage only),
    tokens_as_ids (vLLM's return_tokens_as_token_ids), return_token_ids, priority and cache_salt
    (checked by the engine)."""
    stream = _given(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError("'stream_options' must be an object", param="stream_options")
    include_usage = bool(options and options.get("include_usage")) or (stream and limits.force_include_usage)
    if options and not stream:
        raise APIError("'stream_options' is only allowed with 'stream': true", param="stream_options")
    return dict(stream=stream, include_usage=include_usage,
                continuous_usage=include_usage and bool(options and options.get("continuous_usage_stats")),
                tokens_as_ids=_given(body, "return_tokens_as_token_ids", limits.tokens_as_ids),
                return_token_ids=_given(body, "return_token_ids", False),
                priority=_given(body, "priority", 0), cache_salt=body.get("cache_salt"))


def check_model(body: dict, limits: Limits) -> str:
    """404 unless the request names a served model (or none) -> the name its answer carries: its own,
    as vLLM answers, or the first served name."""
    model = body.get("model")
    if model is not None and model not in limits.model_names:
        raise APIError(f"The model '{model}' does not exist; this server serves "
                       f"{', '.join(repr(name) for name in limits.model_names)}",
                       status=404, param="model", code="model_not_found")
    return limits.served_model_name if model is None else model


def _as_run(ids: list[int], limits: Limits, params: SamplingParams) -> tuple[list[int], SamplingParams]:
    """The prompt's ids as they will run (truncated, see SamplingParams.truncate), and the params they
    run with: a request without max_tokens (chat) under a model's max_new_tokens
    (`Limits.sampling_defaults`) gets the rest of the context up to that cap here, where the prompt's
    length is known. Whether they can run is the engine's check (`api.generation.admit`)."""
    ids = params.truncate(ids, limits.max_model_len)
    cap = limits.sampling_defaults.get("max_tokens")
    if params.max_tokens is None and cap is not None:  # the rest of the context, at most the model's cap
        params = dataclasses.replace(params, max_tokens=max(1, min(cap, limits.max_model_len - len(ids))))
    return ids, params


def parse_completion(body: dict, limits: Limits, tokenizer: Tokenizer | None) -> GenerationRequest:
    """With `echo`, `logprobs` covers the prompt's tokens too (the first has none), and max_tokens 0
    gives the prompt alone: OpenAI's way to score a text. Without a tokenizer (--skip-tokenizer-init)
    prompts are token ids; the answer's texts are empty, and it carries the token ids (vLLM's
    return_token_ids) unless the request says otherwise."""
    model = check_model(body, limits)
    prompt_only = body.get("echo") is True and type(whole(body.get("max_tokens"))) is int and \
        body["max_tokens"] == 0 and body.get("max_completion_tokens") is None
    if prompt_only:  # the one token sampled is dropped: nothing may make it a stop
        body = {**body, "max_tokens": 1, "min_tokens": 0, "stop": None, "stop_token_ids": None, "ignore_eos": True}
    body = validated(CompletionRequest, body)
    echo = _given(body, "echo", False)
    params = sampling_params(body, limits, default_max_tokens=16, chat=False)  # the legacy API's default
    options = _response_options(body, limits)
    if echo and params.logprobs is not None and params.prompt_logprobs is None:
        if needs_distribution(params.logprobs):
            raise APIError(f"'echo' with 'logprobs' of {params.logprobs} is not supported: prompt tokens get at most "
                           f"{MAX_LOGPROBS} top logprobs", param="logprobs")
        params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _ids(prompt):
        prompt = [_ids(prompt) or prompt]
    elif isinstance(prompt, list) and not all(isinstance(p, str) for p in prompt):
        prompt = [_ids(p) for p in prompt]  # (None where one is not a list of ids)
    if not isinstance(prompt, list) or not prompt or not (all(isinstance(p, str) for p in prompt)
                                                          or all(isinstance(p, list) for p in prompt)):
        raise APIError("'prompt' must be a string, a list of strings, a list of token ids, or a list of token-id lists",
                       param="prompt")
    if tokenizer is None:
        if isinstance(prompt[0], str):
            raise APIError("text prompts need the model's tokenizer, and this server runs without one "
                           "(--skip-tokenizer-init): send 'prompt' as token ids", param="prompt")
        options["return_token_ids"] = _given(body, "return_token_ids", True)
    special = _given(body, "add_special_tokens", True)
    ids = [_as_run(tokenizer.encode(p, add_special_tokens=special) if isinstance(p, str) else list(p), limits,
                   params)[0] for p in prompt]  # (a completion's max_tokens is set: params stay)
    decode = (lambda i: "") if tokenizer is None else tokenizer.decode  # (no tokenizer: no text to echo)
    # ids outside the vocabulary cannot be decoded (an OverflowError); the engine's check refuses them (a 400)
    texts = [p if isinstance(p, str) and params.truncate_prompt_tokens is None
             else decode(i) if all(0 <= t < limits.vocab_size for t in i) else "" for p, i in zip(prompt, ids)]
    return _beam_search(GenerationRequest(ids, texts, params, echo=echo, prompt_only=prompt_only, model=model,
                                          **options), body, limits)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's


def _template_options(body: dict, limits: Limits) -> dict:
    """vLLM's extras for rendering the messages: `add_generation_prompt` (default true),
    `continue_final_message` (default false), `chat_template_kwargs` (more template variables), and
    `chat_template` (the request's own, where the server trusts requests' templates); OpenAI's
    `reasoning_effort`, which the template gets as a variable of that name."""
    out = {}
    template = body.get("chat_template")
    if template is not None:
        if not limits.trust_request_chat_template:
            raise APIError("the request passes a chat template, but the server was not started with "
                           "--trust-request-chat-template: a request's template is refused", param="chat_template")
        if not isinstance(template, str) or not template.strip():
            raise APIError("'chat_template' must be a non-empty string (a Jinja template)", param="chat_template")
        out["chat_template"] = template
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        out[name] = body.get(name, default)
        if not isinstance(out[name], bool):
            raise APIError(f"'{name}' must be a boolean", param=name)
    out["template_kwargs"] = body.get("chat_template_kwargs")
    if out["template_kwargs"] is not None and not isinstance(out["template_kwargs"], dict):
        raise APIError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:  # a template variable, as in vLLM (gpt-oss's templates read it)
        if effort not in REASONING_EFFORTS:
            raise APIError(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning_effort")
        out["template_kwargs"] = {"reasoning_effort": effort, **(out["template_kwargs"] or {})}
    error = template_options_error(out["add_generation_prompt"], out["continue_final_message"],
                                   out["template_kwargs"])
    if error:
        raise APIError(error[1], param=error[0])
    return out


def parse_chat(body: dict, limits: Limits, tokenizer: Tokenizer) -> GenerationRequest:
    model = check_model(body, limits)
    body = validated(ChatCompletionRequest, body)
    return _beam_search(_parse_chat(body, model, limits, tokenizer), body, limits)


def _parse_chat(body: dict, model: str, limits: Limits, tokenizer: Tokenizer) -> GenerationRequest:
    echo = _given(body, "echo", False)  # vLLM's: the reply starts with the assistant message it continues
    if echo and _given(body, "logprobs", False):
        raise APIError("'echo' with 'logprobs' on chat is not supported by this server yet", param="echo")
    params = sampling_params(body, limits, default_max_tokens=None, chat=True)  # the rest of the context
    response = {**_response_options(body, limits), "role": limits.response_role}
    try:
        tools = parse_tool_request(body)
    except ToolError as e:
        raise APIError(str(e), param=e.param) from e
    if tools is not None and tools.constraint is not None:
        if params.constraint is not None:
            raise APIError("a forced tool call cannot be combined with response_format or guided decoding",
                           param="tool_choice")
        try:
            tools.constraint.grammar()
        except ValueError as e:
            raise APIError(f"'tools': {e}", param="tools") from e
        params = params.with_constraint(tools.constraint)
    messages = body.get("messages")
    if messages is None and isinstance(body.get("prompt"), str):
        text = body["prompt"]  # a raw prompt, no chat template
        ids = tokenizer.encode(text, add_special_tokens=_given(body, "add_special_tokens", True))
        ids, params = _as_run(ids, limits, params)
        return GenerationRequest([ids], [text], params, model=model, **response)
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    options = _template_options(body, limits)
    try:
        content_format = tokenizer.content_format(options.get("chat_template"), limits.chat_template_content_format)
        rendered = [template_message(m, f"messages[{i}]", content_format) for i, m in enumerate(messages)]
    except ValueError as e:
        raise APIError(str(e), param="messages") from e
    try:
        text = tokenizer.apply_chat_template(rendered, tools=tools.tools if tools else None,
                                             timeout=limits.chat_template_timeout, **options)
    except TimeoutError as e:  # (the tokenizing thread is free again: the template stopped)
        raise APIError(f"{e} (the server's --chat-template-timeout)",
                       param="chat_template" if "chat_template" in options else "messages") from e
    except Exception as e:  # a template's own error (e.g. unsupported role order) is the client's to fix
        raise APIError(f"the chat template could not render these messages: {e}", param="messages") from e
    # (vLLM's default: the template holds the special tokens it wants)
    ids = tokenizer.encode(text, add_special_tokens=_given(body, "add_special_tokens", False))
    last = rendered[-1]
    echoed = message_text(last) if echo and last["role"] == "assistant" else ""
    if not options["add_generation_prompt"]:  # (vLLM's: the answer continues the last message, in its role)
        response["role"] = last["role"]
    ids, params = _as_run(ids, limits, params)
    return GenerationRequest([ids], [echoed], params, echo=echo, prompt_field="messages",
                             tools=tools if tools is not None and tools.mode != "none" else None, model=model,
                             **response)
