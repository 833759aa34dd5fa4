"""The scheduler's plan of a step (`ScheduledBatch` of `ScheduledSeq` rows: host numbers only), what
the device gives back for it (`StepOutput`), and the scheduler's counters (`SchedulerStats`)."""

from __future__ import annotations

import bisect
import dataclasses
import time

import numpy as np

from jaxserve.config.lora import LoRARequest
from jaxserve.sample.params import RequestSampling, SamplingParams
from jaxserve.sample.tensors import PromptLogprobs, needs_distribution
from jaxserve.sched.pages import PageAllocator
from jaxserve.sched.sequence import Sequence, TokenLogprobs


@dataclasses.dataclass
class ScheduledSeq:
    """One row of the step."""

    seq_id: int
    token_ids: list[int]  # the tokens to compute this step (a prefill chunk, or the last token)
    start_position: int  # position of token_ids[0] in the sequence (= num_computed_tokens)
    # >= 0: the last of token_ids is still being sampled by that row of the step before (a 0 here)
    pending_row: int
    page_ids: list[int]  # the sequence's page table, covering start_position + len(token_ids) tokens
    sample: bool  # the chunk ends the known tokens: sample the next one
    params: SamplingParams
    sampling: RequestSampling  # derived from params (bad words, allowed tokens)
    seed: int
    all_token_ids: list[int]  # prompt + generated so far, for penalties (read only)
    num_prompt_tokens: int
    prompt_logprobs: bool = False  # the logprob of each prompt token after token_ids' is asked for
    carried: np.ndarray | None = None  # `Sequence.carried`
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)  # the last len() of token_ids
    # the sampler's row of the sample after its first draft (those after the others follow); the
    # sample after its last known token is in its own row, as for every row
    draft_slot: int = -1
    lora: LoRARequest | None = None  # the sequence's adapter

    def set_drafts(self, drafts: list[int]) -> None:
        """Replace its drafts' tokens (placeholders the scheduler planned for a draft model's)."""
        drafts = list(drafts[:len(self.draft_token_ids)])
        self.token_ids[len(self.token_ids) - len(drafts):] = drafts
        self.draft_token_ids = drafts

    def sample_slots(self, b: int) -> list[int]:
        """The sampler's rows of its samples (this is row b): after its last known token, then after
        each draft."""
        return [b, *range(self.draft_slot, self.draft_slot + len(self.draft_token_ids))]

    @classmethod
    def take(cls, seq: Sequence, n: int, index: int) -> ScheduledSeq:
        """Row `index` of the step: seq's next n tokens, counted as computed from now on. The last may
        be the pending token of the step before (only ever one: a row that samples covers all known
        tokens)."""
        start = seq.num_computed_tokens
        seq.scheduled_at = seq.scheduled_at or time.monotonic()
        token_ids = seq.token_ids[start:start + n]
        pending_row = -1
        if len(token_ids) < n:
            token_ids.append(0)
            pending_row = seq.pending_row
        seq.num_computed_tokens += n
        sample = seq.num_computed_tokens == seq.num_tokens + seq.num_pending
        if sample:
            seq.num_pending += 1
            seq.pending_row = index
        return cls(seq_id=seq.seq_id, token_ids=token_ids, start_position=start, pending_row=pending_row,
                   page_ids=list(seq.page_ids), sample=sample, params=seq.params, sampling=seq.sampling,
                   seed=seq.seed, all_token_ids=seq.token_ids, num_prompt_tokens=seq.num_prompt_tokens,
                   prompt_logprobs=seq.owes_prompt_logprobs and start < seq.num_prompt_tokens - 1,
                   carried=seq.carried, lora=seq.lora)


@dataclasses.dataclass
class ScheduledBatch:
    """The plan of one step: everything the runner needs, nothing it must look up."""

    rows: list[ScheduledSeq]  # in row order
    num_tokens: int  # sum of len(row.token_ids)
    preempted: list[int]  # seq ids preempted while planning this step
    token_limit: int = 0  # the most tokens it may hold (the plan's budget, cut to a bucket): `Scheduler.admit`'s
    page_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst), before the step
    token_masks: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # sample -> packed allowed tokens

    @property
    def num_samples(self) -> int:
        """Rows of the sampler: one per row, one more per draft token."""
        return len(self.rows) + sum(len(row.draft_token_ids) for row in self.rows)

    @property
    def prefill_only(self) -> bool:
        """Every row a prompt chunk of more than one token: no row decodes."""
        return all(len(row.token_ids) > 1 and not row.draft_token_ids for row in self.rows)

    def samples(self) -> list[tuple[int, int, int]]:
        """(the sampler's row, the step's row, how many of that row's drafts come before it), in the
        sampler's order: a sample per row, then those after drafts."""
        out = [(b, b, 0) for b in range(len(self.rows))]
        return out + [(row.draft_slot + j, b, j + 1) for b, row in enumerate(self.rows)
                      for j in range(len(row.draft_token_ids))]


@dataclasses.dataclass
class StepOutput:
    """What the device returns for a batch: one entry per row (meaningful where row.sample)."""

    token_ids: np.ndarray  # i32[rows]
    logprobs: np.ndarray  # f32[rows]
    ranks: np.ndarray  # i32[rows]
    top_ids: np.ndarray  # i32[rows, K] most likely first
    top_logprobs: np.ndarray  # f32[rows, K]
    entropies: np.ndarray  # f32[rows] of the model's distribution (where the row asked for it)
    prompt: PromptLogprobs | None = None  # per token of the step, when some row asked for them
    carried: np.ndarray | None = None  # i32[rows, C] what the logits processors carry to each row's next token
    # f32[rows, V] every token's logprob (or logit, in the *_logits modes), when some row asked for more
    # than K (`needs_distribution`)
    distributions: np.ndarray | None = None
    # f32[H, T, hidden] the residual stream after the step's gathered layers (`hidden_layer_slots`) at
    # each token of the step, when some row asked for hidden states
    hidden: np.ndarray | None = None


def hidden_layer_slots(rows: list[ScheduledSeq]) -> dict[int, int]:
    """The layers whose hidden states a step gathers (those its rows ask for) -> their slots."""
    return {layer: slot for slot, layer in enumerate(sorted({layer for row in rows
                                                             for layer in row.sampling.hidden_layers}))}


def record_hidden_states(seq: Sequence, row: ScheduledSeq, hidden: np.ndarray, slots: dict[int, int]) -> None:
    """Keep the asked positions' hidden states of the row's tokens (`hidden`: [H, tokens from the
    row's first, hidden]) in the order of the layers asked."""
    rows = [slots[layer] for layer in seq.sampling.hidden_layers]
    for j in range(len(row.token_ids)):
        position = row.start_position + j
        if seq.params.return_hidden_states.wants(position, seq.num_prompt_tokens):
            seq.hidden_states[position] = hidden[rows, j]


def prompt_targets(row: ScheduledSeq) -> list[int]:
    """The prompt tokens whose logprobs the row asks for: the i-th follows its i-th token."""
    if not row.prompt_logprobs:
        return []
    start = row.start_position
    return row.all_token_ids[start + 1:min(start + len(row.token_ids) + 1, row.num_prompt_tokens)]


def token_logprobs(out: StepOutput | PromptLogprobs, i: int, k: int) -> TokenLogprobs:
    """Entry i of a step's logprobs (sampled or prompt tokens': the same fields), with the top k
    (read from the row's whole distribution where k is past the K kept per token, or -1: all)."""
    if needs_distribution(k):
        top_ids, top_logprobs = _top(out.distributions[i], k)
    else:
        top_ids, top_logprobs = out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist()
    return TokenLogprobs(logprob=float(out.logprobs[i]), rank=int(out.ranks[i]), top_ids=top_ids,
                         top_logprobs=top_logprobs)


def _top(distribution: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    """The k (-1: all) highest of f32[V] values and their ids, highest first; ties by id, as the
    sampler's top K."""
    vocab = distribution.shape[0]
    k = vocab if k == -1 else min(k, vocab)
    if k == vocab:
        ids = np.argsort(-distribution, kind="stable")
    else:  # (the k first, then only those sorted)
        ids = np.argpartition(-distribution, k - 1)[:k]
        ids = ids[np.lexsort((ids, -distribution[ids]))]
    return ids.tolist(), distribution[ids].tolist()


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler's gauges and counters, for metrics and the stats line."""

    num_running: int  # sequences in the batch
    num_waiting: int  # sequences waiting (new or preempted)
    kv_pages_used: int  # pages held by sequences
    kv_pages_total: int  # pages, the null page excluded
    num_prompt_tokens_computed: int  # prefill work, recomputation included
    num_generated_tokens: int
    num_preemptions: int
    num_prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int  # ... and found there
    finish_counts: dict[str, int]  # finish reason -> sequences
    num_prompt_tokens: int = 0  # the prompts of the sequences that have sampled a first token (vLLM's prompt_tokens)
    num_queued_requests: int = 0  # requests none of whose sequences has started yet
    num_queued_tokens: int = 0  # their prompt tokens
    num_drafts: int = 0  # rows that checked draft tokens (speculative decoding)
    num_draft_tokens: int = 0  # draft tokens checked
    num_accepted_tokens: int = 0  # ... and kept
    accepted_per_position: tuple[int, ...] = ()  # drafts kept, by their place in the row's drafts
    running_loras: tuple[str, ...] = ()  # the names of the LoRA adapters of running sequences
    waiting_loras: tuple[str, ...] = ()  # ... and of waiting ones
    step_token_counts: tuple[int, ...] = ()  # steps by their tokens, under `step_token_bounds` (not cumulative)
    num_step_tokens: int = 0  # the tokens of every step

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total


def step_token_bounds(max_num_batched_tokens: int) -> tuple[int, ...]:
    """vLLM's bounds of its steps' token counts (iteration_tokens_total): 1, 8, then powers of two up to the
    token budget."""
    top = max_num_batched_tokens
    return tuple(b for b in (1, 8, *(1 << i for i in range(4, top.bit_length()))) if b < top) + (top,)


class StepTokens:
    """How many steps computed how many tokens: each step counted under the first bound it does not exceed."""

    def __init__(self, max_num_batched_tokens: int):
        self.bounds = step_token_bounds(max_num_batched_tokens)
        self.counts = [0] * len(self.bounds)
        self.total = 0

    def observe(self, num_tokens: int) -> None:
        self.counts[min(bisect.bisect_left(self.bounds, num_tokens), len(self.bounds) - 1)] += 1
        self.total += num_tokens


def record_prompt_logprobs(seq: Sequence, row: ScheduledSeq, prompt: PromptLogprobs, first: int) -> None:
    """Append the row's prompt logprobs (from entry `first` of the step's on) that seq lacks: a
    recomputed chunk repeats some; a chunk after a dropped one, none (the sequence was preempted
    and computes its prompt again)."""
    if len(seq.prompt_logprobs) < row.start_position:
        return
    end = min(row.start_position + len(row.token_ids), seq.num_prompt_tokens - 1)
    for position in range(len(seq.prompt_logprobs), end):
        seq.prompt_logprobs.append(token_logprobs(prompt, first + position - row.start_position,
                                                  seq.params.prompt_logprobs))


def add_drafts(batch: ScheduledBatch, seqs: dict[int, Sequence], drafts: dict[int, list[int]], budget: int,
               allocator: PageAllocator) -> int:
    """Give the rows that compute one token and sample their drafts (`Scheduler.schedule`), within
    `budget` tokens and the free pages. -> the tokens added."""
    added = 0
    for row in batch.rows:
        seq = seqs[row.seq_id]
        draft = drafts.get(seq.seq_id, [])[:budget - added] if len(row.token_ids) == 1 and row.sample else []
        if draft and allocator.allocate(seq, len(draft), batch.page_copies):
            seq.num_computed_tokens += len(draft)  # (`Scheduler.update` takes back the rejected ones)
            row.token_ids, row.draft_token_ids = row.token_ids + draft, list(draft)
            row.page_ids = list(seq.page_ids)
            added += len(draft)
    return added
