"""Host-side state of one sequence (one generated choice of a request)."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import NamedTuple

import numpy as np

from jaxserve.config.lora import LoRARequest
from jaxserve.sample.params import RequestSampling, SamplingParams

FORK_SEED_STRIDE = 0x9E3779B97F4A7C15  # sibling k samples with seed + k * stride (mod 2**64)


class TokenLogprobs(NamedTuple):
    """A token's logprobs, as the sampler gives them (of a sampled token, or of a prompt token)."""

    logprob: float
    rank: int  # 1 = most likely
    top_ids: list[int]  # the top k, most likely first (k may be the whole vocabulary)
    top_logprobs: list[float]  # theirs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not in the batch: new, or preempted (pages freed, to be recomputed)
    RUNNING = "running"  # holds pages; scheduled every step until it finishes
    FINISHED = "finished"


def adapter_names(seqs) -> tuple[str, ...]:
    """The names of the LoRA adapters of `seqs`, sorted."""
    return tuple(sorted({seq.lora.lora_name for seq in seqs if seq.lora is not None}))


@dataclasses.dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed, or one drawn by the engine
    max_tokens: int  # params.max_tokens, resolved against max_model_len
    sampling: RequestSampling = RequestSampling()  # what the engine derived from params (its siblings share it)
    token_ids: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache, or being written by a launched step
    num_pending: int = 0  # sampled by launched steps, not yet in token_ids (0-2)
    pending_row: int = -1  # the row of the last launched step that samples its next token
    page_ids: list[int] = dataclasses.field(default_factory=list)  # the page table
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)  # prefix hashes of its first full pages
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first scheduled
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | None = None  # the stop token id that ended it, if any
    cumulative_logprob: float = 0.0
    new_logprobs: list[float] = dataclasses.field(default_factory=list)  # of the tokens its last step gave it
    carried: np.ndarray | None = None  # i32[C] what its logits processors carry to its next token (None: none yet)
    num_preemptions: int = 0
    text: str = ""  # generated text released so far (stop strings cut, undecided text held back)
    index: int = 0  # which of the request's n choices
    priority: int = 0  # under priority scheduling, lower first
    arrival: int = 0  # the request's place in arrival order (its siblings share it)
    # time.monotonic() when it came (its siblings share it), when it was first in a step, when its first
    # token was released: vLLM's request timings (`Update.timings`)
    arrived_at: float = dataclasses.field(default_factory=time.monotonic)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    # the prefix cache key of its first page's predecessor: None, or its request's cache_salt hashed
    # (only requests with the same salt share pages)
    hash_seed: bytes | None = None
    lora: LoRARequest | None = None  # the adapter it runs with (--enable-lora)
    pending_forks: int = 0  # siblings to fork once all of the prompt but its last token is cached
    forks: list[Sequence] = dataclasses.field(default_factory=list)  # the siblings forked from this one
    # per generated token, when params.logprobs is set
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    # per generated token, when params.return_entropy is set: of the model's distribution, in nats
    entropies: list[float] = dataclasses.field(default_factory=list)
    # per prompt token after the first, when params.prompt_logprobs is set: filled in order by choice 0
    # as it computes the prompt (its siblings share the list)
    prompt_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    # position -> f32[layers, hidden] the residual stream there, when params.return_hidden_states is set
    # (a recomputed position is written again; `record_hidden_states`)
    hidden_states: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_wanted_tokens(self) -> int:
        """Tokens to have in the cache: all of them, pending ones included, but the prompt's last one
        while forks are pending (each sibling computes that token itself, writing into its own copy
        of the last page), and not a pending token that is its last (max_tokens)."""
        wanted = self.num_tokens + self.num_pending - (1 if self.pending_forks else 0)
        return wanted - (1 if self.num_pending and self.num_output_tokens + self.num_pending >= self.max_tokens else 0)

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Whether its prompt logprobs are asked for and not all computed yet (a request's first
        choice computes them; it then reads nothing from the prefix cache)."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether it may start on the prefix cache's pages: not while it owes prompt logprobs or
        the hidden states of every prompt position, nor where the request says `skip_reading_prefix_cache`."""
        hidden = self.params.return_hidden_states
        return not (self.owes_prompt_logprobs or self.params.skip_reading_prefix_cache
                    or (hidden is not None and hidden.positions == "all"))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sibling(self, seq_id: int, k: int) -> Sequence:
        """Its k-th sibling (choice index + k) at the point of forking: the same prompt, pages and
        prompt logprobs (the same list: choice 0 fills it), its own seed."""
        return Sequence(seq_id=seq_id, request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
                        params=self.params, sampling=self.sampling, seed=(self.seed + k * FORK_SEED_STRIDE) % 2**64,
                        max_tokens=self.max_tokens, page_ids=list(self.page_ids), page_hashes=list(self.page_hashes),
                        num_computed_tokens=self.num_computed_tokens, status=self.status, index=self.index + k,
                        num_cached_tokens=self.num_cached_tokens, priority=self.priority, arrival=self.arrival,
                        arrived_at=self.arrived_at, hash_seed=self.hash_seed, lora=self.lora,
                        prompt_logprobs=self.prompt_logprobs, hidden_states=dict(self.hidden_states))

    def drop_tokens_after(self, num_output_tokens: int) -> int:
        """End at output token `num_output_tokens`, dropping the tokens its last step gave it past that
        one (and their logprobs). -> how many were dropped."""
        dropped = self.num_output_tokens - num_output_tokens
        if dropped <= 0:
            return 0
        del self.token_ids[self.num_tokens - dropped:]
        del self.logprobs[num_output_tokens:], self.entropies[num_output_tokens:]
        self.cumulative_logprob -= sum(self.new_logprobs[-dropped:])
        return dropped
