"""What a request's generation returns, in vLLM's shapes: `RequestOutput` with one
`CompletionOutput` per sequence, and logprobs as {token id: `Logprob`} per token. Shared by the
offline `LLM` and the HTTP API; built from finished sequences, never read by the engine loop."""

from __future__ import annotations

import dataclasses

from jaxserve.sequence import TokenLogprobs
from jaxserve.tokenizer import Tokenizer


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
    lora_request: None = None  # vLLM's; no LoRA adapters here
    # jaxserve's, when SamplingParams.return_entropy is set: per token, the entropy in nats of the model's
    # own distribution (the softmax of its raw logits) at that token
    entropies: list[float] | None = None

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
    # vLLM's fields for what jaxserve does not have: LoRA adapters, encoder-decoder models, KV
    # transfer, multimodal inputs; and `metrics`, which vLLM's LLM leaves None too (its stats are off)
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None
    metrics: None = None
    multi_modal_placeholders: dict = dataclasses.field(default_factory=dict)



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


