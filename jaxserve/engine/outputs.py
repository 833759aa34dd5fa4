"""What the engine gives back: `Update`, what one step released for one sequence (its one output,
which the API's answers and the offline `LLM` both read), and what a request's generation returns
in vLLM's shapes: `RequestOutput` with one `CompletionOutput` per sequence, and logprobs as
{token id: `Logprob`} per token."""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import numpy as np

from jaxserve.config.lora import LoRARequest
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.sample.params import SamplingParams
from jaxserve.sample.residual import FINAL
from jaxserve.sched.sequence import Sequence, TokenLogprobs


@dataclasses.dataclass(frozen=True)
class Update:
    """What one step released for one of a request's sequences."""

    request_id: str
    index: int  # the choice (0..n-1)
    text: str  # newly released text (may be "" while undecided)
    token_ids: list[int]  # new token ids
    logprobs: list[TokenLogprobs]  # per new token, when requested
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int  # so far
    finish_reason: str | None  # set on the sequence's last update
    stop_reason: int | str | None = None
    # when prompt logprobs are asked for: per prompt token after the first (complete from the first
    # update that carries a token on)
    prompt_logprobs: list[TokenLogprobs] | None = None
    # per new token, when asked for (`SamplingParams.return_entropy`): of the model's distribution, in nats
    entropies: list[float] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0  # of the sequence's tokens so far
    weight_version: int = 0  # of the weights that sampled its tokens (`Engine.update_weights`)
    hidden_states: HiddenStates | None = None  # on its last update, when asked for (`HiddenStates.of`)
    timings: RequestTimings | None = None  # on its last update

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestTimings(NamedTuple):
    """vLLM's request timings of a finished sequence, in seconds (measured by the engine)."""

    queued: float  # from its arrival to its first step
    prefill: float  # from its first step to its first token
    decode: float  # from its first token to its last
    inference: float  # from its first step to its last token

    @staticmethod
    def of(seq: Sequence) -> RequestTimings:
        """A sequence's, as it finishes now (one that never ran or released a token: those spans 0)."""
        now = time.monotonic()
        scheduled = seq.scheduled_at or now
        first = seq.first_token_at or now
        return RequestTimings(scheduled - seq.arrived_at, first - scheduled, now - first, now - scheduled)


@dataclasses.dataclass
class HiddenStates:
    """jaxserve's, a choice's hidden states (`SamplingParams.return_hidden_states`): `data`, f32[layers,
    positions, hidden], the residual stream after each of `layers` (0-based, after the layer's residual
    add and its steering, before the final norm; "final": the final norm's output, what the LM head
    reads) at each of `positions` (of the prompt and output tokens, 0-based)."""

    data: np.ndarray
    layers: list[int | str]
    positions: list[int]

    @classmethod
    def of(cls, seq: Sequence) -> HiddenStates:
        asked = seq.params.return_hidden_states
        layers = list(seq.sampling.hidden_layers)
        if asked.layers != ("all",):
            layers = [FINAL if given == FINAL else layer for given, layer in zip(asked.layers, layers)]
        # (the last token is never fed back: nothing was computed at its position)
        positions = sorted(p for p in seq.hidden_states if p < seq.num_tokens - 1 or not seq.num_output_tokens)
        hidden = np.zeros((len(layers), 0, 0), np.float32)
        if positions:
            hidden = np.stack([seq.hidden_states[p] for p in positions], axis=1)
        return cls(data=hidden, layers=layers, positions=positions)


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely (under the distribution sampled from, for a generated token)
    decoded_token: str | None  # None where the request set detokenize=False, or there is no tokenizer


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs; None without logprobs (vLLM's)
    finish_reason: str | None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or string that ended it; None for EOS or length
    # per token, when SamplingParams.logprobs is set: {token id: Logprob} for the sampled token and the top k
    # (-1: every token of the vocabulary), in the engine's logprobs_mode (the `*_logits` modes: logits)
    logprobs: list[dict[int, Logprob]] | None = None
    lora_request: LoRARequest | None = None  # the adapter it ran with
    # jaxserve's, when SamplingParams.return_entropy is set: per token, the entropy in nats of the model's
    # own distribution (the softmax of its raw logits) at that token
    entropies: list[float] | None = None
    # jaxserve's: the version of the weights that sampled its last token (`LLM.update_weights`)
    weight_version: int = 0
    hidden_states: HiddenStates | None = None  # jaxserve's, when SamplingParams.return_hidden_states is set

    def finished(self) -> bool:
        """vLLM's: whether the sequence has ended."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # when SamplingParams.prompt_logprobs is set: None for the first prompt token, then per prompt token
    # {token id: Logprob} for it and the top k, under the model's distribution
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora_request: LoRARequest | None = None  # the LoRA adapter it ran with
    # vLLM's fields for what jaxserve does not have: encoder-decoder models, KV transfer, multimodal
    # inputs; and `metrics`, which vLLM's LLM leaves None too (its stats are off)
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None
    metrics: None = None
    multi_modal_placeholders: dict = dataclasses.field(default_factory=dict)
    weight_version: int = 0  # jaxserve's: the newest weights any of its tokens was sampled under


def logprob_entries(tokenizer: Tokenizer | None, token_ids: list[int], logprobs: list[TokenLogprobs],
                    detokenize: bool = True) -> list[dict[int, Logprob]]:
    """vLLM's form: per token, {id: Logprob} for the token and then the top k (`decoded_token` None
    without `detokenize`, or without a tokenizer). Built a dict at a time (k may be the whole vocabulary)."""
    decode = tokenizer.decode_token if detokenize and tokenizer is not None else (lambda token: None)
    out = []
    for token, lp in zip(token_ids, logprobs):
        top = dict(zip(lp.top_ids, map(Logprob, lp.top_logprobs, range(1, len(lp.top_ids) + 1),
                                       map(decode, lp.top_ids))))
        top.pop(token, None)  # (the token comes first, with its own rank)
        entry = {token: Logprob(lp.logprob, lp.rank, decode(token))}
        entry.update(top)
        out.append(entry)
    return out


@dataclasses.dataclass
class _Choice:
    """One sequence's updates so far, joined."""
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    entropies: list[float] = dataclasses.field(default_factory=list)
    entries: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)  # the logprobs built so far
    last: Update | None = None


class OutputCollector:
    """A request's updates joined into its `RequestOutput` (the offline `LLM`'s; the API streams them).
    `LLM.llm_engine` asks for an output at every step while the updates go on coming: an output's
    lists are copies, and each token's logprobs are built once."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 lora_request: LoRARequest | None = None):
        self.request_id, self.prompt, self.prompt_token_ids, self.params = request_id, prompt, prompt_token_ids, params
        self.lora_request = lora_request
        self.choices = [_Choice() for _ in range(params.n)]
        self._prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def add(self, update: Update) -> None:
        choice = self.choices[update.index]
        choice.text += update.text
        choice.token_ids += update.token_ids
        choice.logprobs += update.logprobs
        choice.entropies += update.entropies
        choice.last = update

    @property
    def finished(self) -> bool:
        return all(c.last is not None and c.last.finished for c in self.choices)

    def completion(self, i: int, tokenizer: Tokenizer | None) -> CompletionOutput:
        """Choice i as it stands (it has had an update)."""
        params, c = self.params, self.choices[i]
        if params.logprobs is not None:
            built = len(c.entries)
            c.entries += logprob_entries(tokenizer, c.token_ids[built:], c.logprobs[built:], params.detokenize)
        return CompletionOutput(index=i, text=c.text, token_ids=list(c.token_ids),
                                cumulative_logprob=None if params.logprobs is None else c.last.cumulative_logprob,
                                finish_reason=c.last.finish_reason, stop_reason=c.last.stop_reason,
                                logprobs=None if params.logprobs is None else list(c.entries),
                                entropies=list(c.entropies) if params.return_entropy else None,
                                weight_version=c.last.weight_version, lora_request=self.lora_request,
                                hidden_states=c.last.hidden_states)

    def output(self, tokenizer: Tokenizer | None, indices: list[int] | None = None) -> RequestOutput:
        """The request's output: every choice, or those of `indices`."""
        outputs = [self.completion(i, tokenizer) for i in (range(len(self.choices)) if indices is None else indices)]
        first = next(c.last for c in self.choices if c.last is not None)
        if self.params.prompt_logprobs is not None and self._prompt_logprobs is None:
            self._prompt_logprobs = [None, *logprob_entries(tokenizer, self.prompt_token_ids[1:], first.prompt_logprobs,
                                                            self.params.detokenize)]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=self.finished, num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=self._prompt_logprobs, lora_request=self.lora_request,
                             weight_version=max(c.weight_version for c in outputs))
