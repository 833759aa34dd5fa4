"""The sampling settings of a request, vLLM's `SamplingParams`, and the bounds they are checked
against. `jaxserve.sample.tensors` turns them into the rows of the batched sampler."""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable

import numpy as np

from jaxserve.errors import RequestError
from jaxserve.sample.residual import HiddenStatesRequest, Steering, SteeringVector
from jaxserve.structured_output.grammar import Constraint, StructuredOutputsParams, mask_width

MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's bound)
MAX_N = 16384  # sequences per request (vLLM's default bound)
MAX_STOP = 64  # stop strings per request: each is looked for after every token
MAX_STOP_CHARS = 256  # per stop string: holding text back costs O(length^2) per step
MAX_BAD_WORDS = 64  # per request: each is checked on the host before each token
DRY_SEQUENCE_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's default
MAX_DRY_BREAKERS = 16  # per request: each is a row of its DRY arguments
MAX_DRY_BREAKER_CHARS = 40  # llama.cpp's bound (it cuts longer ones)


def _check(ok: bool, message: str) -> None:
    """RequestError(message), about the field the message opens with, unless ok."""
    if not ok:
        name = message.split(" ", 1)[0]
        raise RequestError(message, name if name in SamplingParams.__dataclass_fields__ else None)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class RequestOutputKind(enum.Enum):
    """vLLM's: what each output of a request holds, as `LLM.llm_engine.step()` returns them.
    `LLM.generate` returns the finished outputs whatever the kind (as vLLM's does); the server streams
    deltas."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new
    FINAL_ONLY = 2  # only the finished output


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM-compatible sampling settings of one request: checked once, when built, and never changed
    afterwards (`dataclasses.replace` makes a changed copy, checked again). What the engine derives
    from them for a request (bad words' token ids, the allowed-token mask) is a `RequestSampling`."""

    n: int = 1  # sequences (choices) per prompt, 1..MAX_N; the prompt is prefilled once
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens are out
    temperature: float = 1.0  # 0: greedy
    top_k: int = -1  # -1 or 0: off; 1: greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob, in [0, 1]
    presence_penalty: float = 0.0  # OpenAI: minus this for tokens already generated, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI: minus this times the count of generated occurrences, in [-2, 2]
    repetition_penalty: float = 1.0  # HF: divide positive / multiply negative logits of prompt+output tokens
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)  # token id -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled (None: any)
    # vLLM's: the output never ends in one of these words, as tokenized with and without a leading
    # space: a word's last token is masked wherever the tokens before it were just generated
    bad_words: list[str] = dataclasses.field(default_factory=list)
    seed: int | None = None  # None: drawn from the engine's seed
    stop: list[str] = dataclasses.field(default_factory=list)  # finish at the first occurrence of one
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # finish when one is sampled
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False  # keep going past EOS (until max_tokens)
    # None: no logprobs; k: the sampled token's and the top k; -1: the whole vocabulary (vLLM's). Up to
    # the engine's max_logprobs (more than MAX_LOGPROBS, or -1, only where it allows them)
    logprobs: int | None = None
    # None: none; k: each prompt token's logprob (after the first) and the top k (at most MAX_LOGPROBS),
    # under the model's own distribution (no sampling settings applied), as vLLM's; the prompt is then
    # computed whole
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None  # grammar the output must follow (JSON schema, regex, choice, ...)
    structured_outputs: StructuredOutputsParams | dict | None = None  # vLLM's form of `constraint` (sets it)
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name of `structured_outputs`
    skip_special_tokens: bool = True  # leave special tokens out of the text
    spaces_between_special_tokens: bool = True  # False: added tokens in a row join without spaces (vLLM's)
    detokenize: bool = True  # False: no text (token ids only; logprobs' decoded_token None), as vLLM's
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: max_model_len)
    skip_reading_prefix_cache: bool | None = None  # True: compute the whole prompt, reusing no cached pages
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # vLLM's (see RequestOutputKind)
    # vLLM's: logprobs in one flat container instead of a dict per token; jaxserve's list of dicts
    # reads the same way (logprobs[i][token_id]) either way
    flat_logprobs: bool = False
    extra_args: dict | None = None  # vLLM's: the arguments of the engine's logits processors (and the caller's)
    # llama.cpp's samplers, under its names and defaults (each off at its default; see
    # jaxserve/sample/llamacpp.py for how they are defined and ordered)
    typical_p: float = 1.0  # locally typical sampling: the mass of the most typical tokens kept, in [0, 1]
    mirostat: int = 0  # 1 or 2: mirostat's version (0: off)
    mirostat_tau: float = 5.0  # mirostat's target surprise, in bits
    mirostat_eta: float = 0.1  # mirostat's learning rate
    dry_multiplier: float = 0.0  # DRY's penalty of a repeat one token past dry_allowed_length (0: off)
    dry_base: float = 1.75  # DRY's penalty grows by this factor per further repeated token (>= 1)
    dry_allowed_length: int = 2  # repeats up to this many tokens go unpenalised
    dry_penalty_last_n: int = -1  # DRY looks at the last n tokens (-1: the whole context, 0: off)
    dry_sequence_breakers: list[str] = dataclasses.field(default_factory=lambda: list(DRY_SEQUENCE_BREAKERS))
    xtc_probability: float = 0.0  # XTC: the chance, per token, that the top choices are excluded (0: off)
    xtc_threshold: float = 0.1  # XTC: the tokens at least this likely are the top choices (above 0.5: off)
    top_n_sigma: float = -1.0  # keep tokens within n standard deviations of the top logit (<= 0: off)
    dynatemp_range: float = 0.0  # dynamic temperature: temperature +- this, by the entropy (0: off)
    dynatemp_exponent: float = 1.0  # dynamic temperature: the entropy's exponent
    min_keep: int = 0  # top-p, min-p, typical and XTC keep at least this many tokens
    # jaxserve's: the entropy (nats) of the model's own distribution at each generated token
    # (`CompletionOutput.entropies`), computed in the step
    return_entropy: bool = False
    # jaxserve's: the residual stream's hidden states per choice (`residual.HiddenStatesRequest`:
    # True, or a dict of layers, positions and encoding), and steering vectors added to it
    # (`residual.SteeringVector`s or their dicts), over the prompt's positions too unless steer_prompt
    return_hidden_states: HiddenStatesRequest | dict | bool | None = None
    steering: tuple[SteeringVector, ...] | list | None = None
    steer_prompt: bool = True

    def __post_init__(self):
        self._normalize()
        self._check_numbers()
        self._check_token_lists()

    def _normalize(self) -> None:
        """Each field in one form: the constraint from vLLM's forms of it, lists and dicts fresh."""
        def normalize(name, value):  # (frozen: the one place fields are set after __init__)
            object.__setattr__(self, name, value)

        if self.guided_decoding is not None:
            _check(self.structured_outputs in (None, self.guided_decoding),
                   "give structured_outputs or guided_decoding (its older name), not both")
            normalize("structured_outputs", self.guided_decoding)
        if isinstance(self.structured_outputs, dict):  # (its fields as a dict, as the HTTP API takes them)
            try:
                normalize("structured_outputs", StructuredOutputsParams(**self.structured_outputs))
            except TypeError as e:
                raise RequestError(f"structured_outputs: {e}", "structured_outputs") from e
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputsParams),
                   f"structured_outputs must be a StructuredOutputsParams or a dict, got {self.structured_outputs!r}")
            derived = self.structured_outputs.constraint()
            _check(self.constraint in (None, derived), "give structured_outputs or constraint, not both")
            normalize("constraint", derived)
        normalize("stop", [self.stop] if isinstance(self.stop, str) else list(self.stop or []))
        normalize("stop_token_ids", list(self.stop_token_ids or []))
        normalize("bad_words", list(self.bad_words or []))
        if isinstance(self.dry_sequence_breakers, (list, tuple)):
            normalize("dry_sequence_breakers", list(self.dry_sequence_breakers))
        if self.allowed_token_ids is not None:
            normalize("allowed_token_ids", list(self.allowed_token_ids))
        normalize("logit_bias", {int(k): float(v) for k, v in (self.logit_bias or {}).items()})
        normalize("return_hidden_states", HiddenStatesRequest.of(self.return_hidden_states))
        if self.steering is not None and not isinstance(self.steering, (list, tuple)):
            raise RequestError("steering must be a list of {layer, vector or name, scale} objects", "steering")
        normalize("steering", tuple(SteeringVector.of(v, i) for i, v in enumerate(self.steering or ())) or None)

    def _check_numbers(self) -> None:
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(_is_num(self.temperature) and self.temperature >= 0,
               f"temperature must be >= 0, got {self.temperature!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1,
               f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        _check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        _check(self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens) and (
            self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)),
               f"truncate_prompt_tokens must be -1 or >= 1, got {self.truncate_prompt_tokens!r}")
        _check(isinstance(self.output_kind, RequestOutputKind),
               f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        _check(self.extra_args is None or isinstance(self.extra_args, dict),
               f"extra_args must be a dict, got {self.extra_args!r}")
        for name in ("logprobs", "prompt_logprobs"):  # (their caps: the engine's max_logprobs)
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= -1),
                   f"{name} must be -1 (the whole vocabulary) or an integer >= 0, got {value!r}")
        for name in ("return_entropy", "steer_prompt"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be a boolean, got {getattr(self, name)!r}")
        self._check_llamacpp()

    def _check_llamacpp(self) -> None:
        """llama.cpp's sampler fields (llama.cpp checks few of them: these bounds are where each is defined)."""
        for name in ("typical_p", "xtc_probability", "xtc_threshold"):
            value = getattr(self, name)
            _check(_is_num(value) and 0 <= value <= 1, f"{name} must be in [0, 1], got {value!r}")
        _check(_is_int(self.mirostat) and self.mirostat in (0, 1, 2),
               f"mirostat must be 0 (off), 1 or 2, got {self.mirostat!r}")
        for name in ("mirostat_tau", "mirostat_eta", "dry_multiplier", "dynatemp_range", "dynatemp_exponent"):
            value = getattr(self, name)
            _check(_is_num(value) and 0 <= value < float("inf"), f"{name} must be a number >= 0, got {value!r}")
        _check(_is_num(self.dry_base) and 1 <= self.dry_base < float("inf"),
               f"dry_base must be a number >= 1, got {self.dry_base!r}")
        _check(_is_num(self.top_n_sigma) and abs(self.top_n_sigma) < float("inf"),
               f"top_n_sigma must be a number (<= 0: off), got {self.top_n_sigma!r}")
        for name, low in (("dry_allowed_length", 0), ("dry_penalty_last_n", -1), ("min_keep", 0)):
            value = getattr(self, name)
            _check(_is_int(value) and value >= low, f"{name} must be an integer >= {low}, got {value!r}")
        breakers = self.dry_sequence_breakers
        _check(isinstance(breakers, list) and len(breakers) <= MAX_DRY_BREAKERS and all(
            isinstance(b, str) and 0 < len(b) <= MAX_DRY_BREAKER_CHARS for b in breakers),
               f"dry_sequence_breakers must be at most {MAX_DRY_BREAKERS} non-empty strings of at most "
               f"{MAX_DRY_BREAKER_CHARS} characters, got {breakers!r}")

    def _check_token_lists(self) -> None:
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias has more than {MAX_LOGIT_BIAS} entries")
        _check(all(k >= 0 and -100 <= v <= 100 for k, v in self.logit_bias.items()),
               "logit_bias maps token ids (>= 0) to biases in [-100, 100]")
        _check(self.detokenize or not self.stop, "stop strings need detokenize=True (the text they are found in)")
        _check(len(self.stop) <= MAX_STOP and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
                                                  for s in self.stop),
               f"stop must be at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters, "
               f"got {self.stop!r}")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        _check(all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_CHARS for w in self.bad_words)
               and len(self.bad_words) <= MAX_BAD_WORDS,
               f"bad_words must be at most {MAX_BAD_WORDS} non-blank strings of at most {MAX_STOP_CHARS} "
               f"characters, got {self.bad_words!r}")
        _check(self.allowed_token_ids is None or (bool(self.allowed_token_ids) and all(
            _is_int(t) and t >= 0 for t in self.allowed_token_ids)),
               f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")

    @classmethod
    def from_optional(cls, **kwargs) -> SamplingParams:
        """vLLM's: the fields given, None standing for the default."""
        return cls(**{name: value for name, value in kwargs.items() if value is not None})

    def clone(self) -> SamplingParams:
        """vLLM's: an independent copy."""
        return copy.deepcopy(self)

    def truncate(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as it is run: its last `truncate_prompt_tokens` tokens, when set."""
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return list(prompt_token_ids[-keep:]) if keep else list(prompt_token_ids)

    @property
    def text_settings(self) -> list[str]:
        """The settings given that read the output's text, which need the model's tokenizer: stop
        strings, bad words, a grammar (`constraint`, named as vLLM's structured_outputs), DRY's
        sequence breakers (strings, tokenized) where DRY is on."""
        dry = self.dry_multiplier != 0 and self.dry_penalty_last_n != 0
        given = (("stop", self.stop), ("bad_words", self.bad_words),
                 ("structured_outputs", self.constraint is not None),
                 ("dry_sequence_breakers", dry and bool(self.dry_sequence_breakers)))
        return [name for name, used in given if used]

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def with_constraint(self, constraint: Constraint | None) -> SamplingParams:
        """A copy whose output follows `constraint` instead (whatever form the grammar was given in)."""
        return dataclasses.replace(self, constraint=constraint, structured_outputs=None, guided_decoding=None)


@dataclasses.dataclass(frozen=True)
class RequestSampling:
    """What the engine derives from a request's SamplingParams once, for its sequences (`of`)."""

    # the token ids of each bad word's forms, as vLLM forms them: each word without its leading
    # spaces, and with one space before it where that gives other tokens of the same count
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # `allowed_token_ids` as a packed mask (`SamplingTensors.token_mask`'s row); None: any token
    allowed_mask: np.ndarray | None = dataclasses.field(default=None, compare=False)
    # per logits processor of the engine, the request's arguments (`Processors.request_args`; None: unused)
    processor_args: tuple | None = dataclasses.field(default=None, compare=False)
    carries: bool = False  # one of them carries state from token to token (`Processors.carries`)
    # the layers of return_hidden_states, resolved (`residual.resolve_layers`; the final norm: L)
    hidden_layers: tuple[int, ...] = ()
    steering: Steering | None = None  # its steering and the engine's control vectors, resolved; None: none

    @classmethod
    def of(cls, params: SamplingParams, encode: Callable[[str], list[int]], vocab_size: int,
           processors=None) -> RequestSampling:
        """`encode`: text -> token ids, no special tokens. ValueError for a bad word without tokens, or
        arguments a processor refuses."""
        forms = []
        for word in params.bad_words:
            bare = encode(word.lstrip())
            if not bare:
                raise ValueError(f"bad word {word!r} has no tokens")
            spaced = encode(" " + word.lstrip())
            forms.append(tuple(bare))
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                forms.append(tuple(spaced))
        mask = None
        if params.allowed_token_ids is not None:
            ids = np.asarray([t for t in params.allowed_token_ids if t < vocab_size], np.int64)
            bits = np.zeros(mask_width(vocab_size), np.uint32)
            np.bitwise_or.at(bits, ids // 32, (1 << (ids % 32)).astype(np.uint32))
            mask = bits.view(np.int32)
            mask.flags.writeable = False
        processor_args = processors.request_args(params, encode) if processors else None
        return cls(bad_words_token_ids=tuple(forms), allowed_mask=mask, processor_args=processor_args,
                   carries=bool(processors) and processors.carries(processor_args))

    def banned_tokens(self, token_ids: list[int], num_prompt_tokens: int) -> list[int]:
        """The bad words' last tokens that the next token must not be: those whose words' other
        tokens end the output so far (`token_ids` = prompt + output)."""
        out = []
        for ids in self.bad_words_token_ids:
            before = len(ids) - 1
            if before <= len(token_ids) - num_prompt_tokens and tuple(token_ids[len(token_ids) - before:]) == ids[:-1]:
                out.append(ids[-1])
        return out

    @property
    def needs_last_tokens(self) -> bool:
        """Whether the tokens it may sample depend on the last ones (a bad word of several tokens)."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids)
