"""The checks a request passes before it reaches an engine: what depends on the model and the
engine's configuration only, so the API can refuse a request (a 400) before anything is sent,
whether the engine runs in this process or in another (a Ray replica)."""

from __future__ import annotations

from collections.abc import Callable

from jaxserve.config.engine import MAX_LOGPROBS, EngineConfig
from jaxserve.engine.steering import SteeringLibrary
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.errors import RequestError
from jaxserve.models.config import ModelConfig
from jaxserve.sample.llamacpp import BUILTIN_SAMPLERS
from jaxserve.sample.logits_processors import Processors
from jaxserve.sample.params import SamplingParams
from jaxserve.sample.residual import Steering, resolve_layers
from jaxserve.sample.tensors import MAX_SUPPRESSED, needs_distribution


def engine_processors(config: EngineConfig, vocab_size: int) -> Processors:
    """The logits processors an engine runs: llama.cpp's samplers, then the configured ones."""
    return Processors([*BUILTIN_SAMPLERS, *config.logits_processors], vocab_size)


class RequestChecks:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, processors: Processors,
                 tokenizer: Tokenizer | None):
        self.config, self.model_config, self.processors, self.tokenizer = config, model_config, processors, tokenizer
        self.steering = SteeringLibrary(config, model_config)  # (reads the vector files: a bad one fails here)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, *, priority: int = 0,
                      cache_salt: str | None = None) -> int:
        """The request's max_tokens, or ValueError for what the engine cannot run (all but the
        constraint), for the prompt as it runs (truncated: `SamplingParams.truncate`). Reads only
        the configuration: any thread may call it, e.g. to refuse a streamed request before its
        response starts."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise RequestError(f"priority must be an integer, got {priority!r}", "priority")
        if (params.truncate_prompt_tokens or 0) > self.config.max_model_len:  # (as vLLM)
            raise RequestError(f"truncate_prompt_tokens ({params.truncate_prompt_tokens}) is greater than "
                               f"max_model_len ({self.config.max_model_len})", "truncate_prompt_tokens")
        if priority and self.config.scheduling_policy != "priority":
            raise RequestError(f"Got priority {priority} but priority scheduling is not enabled (the scheduling "
                               "policy is fcfs: start the engine with --scheduling-policy priority)", "priority")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RequestError("cache_salt must be a non-empty string", "cache_salt")
        if not prompt_token_ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.config.max_model_len - len(prompt_token_ids)
            if max_tokens < 1:
                raise RequestError(f"This model's maximum context length is {self.config.max_model_len} tokens, "
                                   f"but the request has {len(prompt_token_ids)} prompt tokens, which leave no room "
                                   "for an output token. Shorten the prompt.", "prompt")
        self.config.check_fits(len(prompt_token_ids), max_tokens)
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise RequestError(f"{name}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})", name)
        if self.config.skip_tokenizer_init and params.text_settings:
            name = params.text_settings[0]
            raise RequestError(f"{name} needs the model's tokenizer, and the engine runs without one "
                               "(skip_tokenizer_init): on token ids alone, stop_token_ids, logit_bias and "
                               "allowed_token_ids serve instead", name)
        self._check_logprobs(params)
        self.residual(params)
        self.processors.request_args(params, self.encode)  # (a ValueError: the request's error)
        suppressed = set(params.stop_token_ids) | set(self.model_config.eos_token_ids)
        if params.min_tokens and len(suppressed) > MAX_SUPPRESSED:
            raise ValueError(f"min_tokens can hold back at most {MAX_SUPPRESSED} EOS and stop token ids, "
                             f"got {len(suppressed)}")
        return max_tokens

    def residual(self, params: SamplingParams) -> tuple[tuple[int, ...], Steering | None]:
        """The request's hidden-state layers and steering, resolved against the model and the engine
        (`RequestSampling.hidden_layers`, `.steering`); RequestError for what it cannot give."""
        layers = ()
        if params.return_hidden_states is not None:
            layers = resolve_layers(params.return_hidden_states, self.model_config.num_layers)
            most = self.config.residual_limits[0]
            if len(layers) > most:
                raise RequestError(f"return_hidden_states asks for {len(layers)} layers, and a step gathers at most "
                                   f"{most} (--max-hidden-states-layers; none under --batch-invariant)",
                                   "return_hidden_states")
        return layers, self.steering.resolve(params)

    def _check_logprobs(self, params: SamplingParams) -> None:
        """Top logprobs up to max_logprobs (-1: the vocabulary's size, in either), as vLLM's; prompt
        logprobs up to the MAX_LOGPROBS the step computes per prompt token."""
        vocab, cap = self.model_config.vocab_size, self.config.max_logprobs
        if params.prompt_logprobs is not None and needs_distribution(params.prompt_logprobs):
            raise RequestError(f"requested prompt logprobs of {params.prompt_logprobs}: at most {MAX_LOGPROBS} per "
                               "prompt token are supported (more, or -1, only for sampled tokens' logprobs)",
                               "prompt_logprobs")
        for name, field, value in (("sample logprobs", "logprobs", params.logprobs),
                                   ("prompt logprobs", "prompt_logprobs", params.prompt_logprobs)):
            wanted = vocab if value == -1 else value
            if value is None or wanted <= (vocab if cap == -1 else cap):
                continue
            if cap == -1:
                raise RequestError(f"requested {name} of {value}, more than the vocabulary's {vocab} tokens", field)
            more = " (-1: the whole vocabulary)" if value == -1 else ""
            raise RequestError(f"requested {name} of {value}{more}, more than max_logprobs ({cap}): raise "
                               "--max-logprobs (LLM's max_logprobs; -1: no cap)", field)

    @property
    def encode(self) -> Callable[[str], list[int]] | None:
        """text -> token ids, no special tokens; None on token ids alone (skip_tokenizer_init)."""
        tokenizer = self.tokenizer
        return None if tokenizer is None else (lambda text: tokenizer.encode(text, add_special_tokens=False))
