"""A chat or completions request body as a `GenerationRequest`: prompt token ids (one list per
prompt), `SamplingParams`, and how the answer is sent.

The request models (`api/request_models.py`, `api/chat_models.py`) read and check the fields and turn
themselves into the engine's inputs; here, the chat template renders the messages and the prompts
are tokenized. Anything out of range, of the wrong type, or not supported yet raises `APIError`
(HTTP 400 with OpenAI's error body); unknown extra fields are ignored, as OpenAI and vLLM do. This
module knows the tokenizer and the limits, not the engine loop.
"""

from __future__ import annotations

import dataclasses

from api.chat_models import ChatCompletionRequest
from api.errors import APIError
from api.fields import validated, whole
from api.limits import Limits, check_model
from api.request_models import CompletionRequest
from api.tools import ToolRequest
from jaxserve.config.lora import LoRARequest
from jaxserve.config.engine import MAX_LOGPROBS
from jaxserve.engine.beam_search import BeamSearchParams
from jaxserve.engine.chat_template import message_text, template_message
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.errors import RequestError
from jaxserve.sample.params import SamplingParams
from jaxserve.sample.tensors import needs_distribution


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    prompts: list[list[int]]  # token ids of each prompt (one choice each)
    prompt_texts: list[str]  # what `echo` repeats (chat: the assistant message continued, else "")
    params: SamplingParams
    # how the response is sent (`GenerationFields.response_options`)
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
    min_weight_version: int = 0  # jaxserve's: wait for weights of at least this version (docs/rl.md)
    lora: LoRARequest | None = None  # the LoRA adapter `model` names (`api.generation.admit`)
    pooling: bool = False  # an embeddings request (`api/embeddings.py`), which only --runner pooling serves


def as_run(ids: list[int], limits: Limits, params: SamplingParams) -> tuple[list[int], SamplingParams]:
    """The prompt's ids as they will run (truncated, see SamplingParams.truncate), and the params they
    run with: a request without max_tokens (chat) under a model's max_new_tokens
    (`Limits.sampling_defaults`) gets the rest of the context up to that cap here, where the prompt's
    length is known. Whether they can run is the engine's check (`api.generation.admit`)."""
    ids = params.truncate(ids, limits.max_model_len)
    cap = limits.sampling_defaults.get("max_tokens")
    if params.max_tokens is None and cap is not None:  # the rest of the context, at most the model's cap
        try:
            params = dataclasses.replace(params, max_tokens=max(1, min(cap, limits.max_model_len - len(ids))))
        except RequestError as e:  # (min_tokens past the model's cap)
            raise APIError(str(e), param=e.field) from e
    return ids, params


def parse_completion(body: dict, limits: Limits, tokenizer: Tokenizer | None) -> GenerationRequest:
    """With `echo`, `logprobs` covers the prompt's tokens too (the first has none), and max_tokens 0
    gives the prompt alone: OpenAI's way to score a text. Without a tokenizer (--skip-tokenizer-init)
    prompts are token ids; the answer's texts are empty, and it carries the token ids (vLLM's
    return_token_ids) unless the request says otherwise."""
    model = check_model(body.get("model"), limits)
    prompt_only = body.get("echo") is True and type(whole(body.get("max_tokens"))) is int and \
        body["max_tokens"] == 0 and body.get("max_completion_tokens") is None
    if prompt_only:  # the one token sampled is dropped: nothing may make it a stop
        body = {**body, "max_tokens": 1, "min_tokens": 0, "stop": None, "stop_token_ids": None, "ignore_eos": True}
    request = validated(CompletionRequest, body)
    echo = request.given("echo", False)
    params = request.to_sampling_params(limits, default_max_tokens=16)  # the legacy API's default
    options = request.response_options(limits)
    if echo and params.logprobs is not None and params.prompt_logprobs is None:
        if needs_distribution(params.logprobs):
            raise APIError(f"'echo' with 'logprobs' of {params.logprobs} is not supported: prompt tokens get at most "
                           f"{MAX_LOGPROBS} top logprobs", param="logprobs")
        params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
    prompts = request.prompts()
    if tokenizer is None:
        if isinstance(prompts[0], str):
            raise APIError("text prompts need the model's tokenizer, and this server runs without one "
                           "(--skip-tokenizer-init): send 'prompt' as token ids", param="prompt")
        options["return_token_ids"] = request.given("return_token_ids", True)
    special = request.given("add_special_tokens", True)
    ids = [as_run(tokenizer.encode(p, add_special_tokens=special) if isinstance(p, str) else list(p), limits,
                  params)[0] for p in prompts]  # (a completion's max_tokens is set: params stay)
    decode = (lambda i: "") if tokenizer is None else tokenizer.decode  # (no tokenizer: no text to echo)
    # ids outside the vocabulary cannot be decoded (an OverflowError); the engine's check refuses them (a 400)
    texts = [p if isinstance(p, str) and params.truncate_prompt_tokens is None
             else decode(i) if all(0 <= t < limits.vocab_size for t in i) else "" for p, i in zip(prompts, ids)]
    return GenerationRequest(ids, texts, params, echo=echo, prompt_only=prompt_only, model=model,
                             beam=request.to_beam_search_params(params, ids, echo, limits), **options)


def parse_chat(body: dict, limits: Limits, tokenizer: Tokenizer) -> GenerationRequest:
    model = check_model(body.get("model"), limits)
    request = validated(ChatCompletionRequest, body)
    echo = request.given("echo", False)
    params = request.to_sampling_params(limits, default_max_tokens=None)  # the rest of the context
    response = {**request.response_options(limits), "role": limits.response_role, "model": model}
    tools = request.tool_request()
    if tools is not None and tools.constraint is not None:
        if params.constraint is not None:
            raise APIError("a forced tool call cannot be combined with response_format or guided decoding",
                           param="tool_choice")
        try:
            tools.constraint.grammar()
        except ValueError as e:
            raise APIError(f"'tools': {e}", param="tools") from e
        params = params.with_constraint(tools.constraint)
    raw = request.given("prompt")
    if request.messages is None and isinstance(raw, str):  # a raw prompt, no chat template
        ids, params = as_run(tokenizer.encode(raw, add_special_tokens=request.given("add_special_tokens", True)),
                             limits, params)
        return GenerationRequest([ids], [raw], params, beam=request.to_beam_search_params(params, [ids], echo, limits),
                                 **response)
    if request.messages is None:
        raise APIError("'messages' must be a non-empty list", param="messages")
    ids, echoed, role, params = _render(request, limits, tokenizer, tools, params)
    return GenerationRequest([ids], [echoed], params, echo=echo, prompt_field="messages",
                             tools=tools if tools is not None and tools.mode != "none" else None,
                             beam=request.to_beam_search_params(params, [ids], echo, limits),
                             **{**response, "role": role or response["role"]})


def _render(request: ChatCompletionRequest, limits: Limits, tokenizer: Tokenizer, tools: ToolRequest | None,
            params: SamplingParams) -> tuple[list[int], str, str | None, SamplingParams]:
    """The messages rendered by the chat template and tokenized -> (prompt ids, the text `echo`
    repeats, the answer's role where the last message's, the params as they run)."""
    options = request.template_options(limits)
    try:
        content_format = tokenizer.content_format(options.chat_template, limits.chat_template_content_format)
        rendered = [template_message(m, f"messages[{i}]", content_format) for i, m in enumerate(request.messages)]
    except ValueError as e:
        raise APIError(str(e), param="messages") from e
    try:
        text = tokenizer.apply_chat_template(rendered, tools=tools.tools if tools else None,
                                             timeout=limits.chat_template_timeout, **dataclasses.asdict(options))
    except TimeoutError as e:  # (the tokenizing thread is free again: the template stopped)
        raise APIError(f"{e} (the server's --chat-template-timeout)",
                       param="chat_template" if options.chat_template is not None else "messages") from e
    except Exception as e:  # a template's own error (e.g. unsupported role order) is the client's to fix
        raise APIError(f"the chat template could not render these messages: {e}", param="messages") from e
    # (vLLM's default: the template holds the special tokens it wants)
    ids = tokenizer.encode(text, add_special_tokens=request.given("add_special_tokens", False))
    last = rendered[-1]
    echoed = message_text(last) if request.given("echo", False) and last["role"] == "assistant" else ""
    # (vLLM's: without a generation prompt, the answer continues the last message, in its role)
    role = None if options.add_generation_prompt else last["role"]
    ids, params = as_run(ids, limits, params)
    return ids, echoed, role, params
