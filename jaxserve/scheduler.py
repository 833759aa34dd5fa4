"""Continuous batching with one token budget and no phases.

Each sequence knows `num_computed_tokens` (K/V in the cache) and `num_tokens`
(prompt + generated). A step hands out up to `max_num_batched_tokens` new
tokens: a running sequence gets what it lacks (one decode token, or the next
chunk of a long prompt), then waiting sequences join while the budget, the
`max_num_seqs` limit and the free pages allow. A chunk that reaches the end of
a sequence's known tokens samples the next token; a partial prefill chunk
samples nothing.

When a running sequence needs a page and none is free, the newest running
sequence is preempted: its pages are freed and it waits at the front of the
queue to be recomputed from its tokens.

The scheduler's output is a plan of host numbers (`ScheduledBatch`); it never
touches device arrays. It knows nothing about the model, tokenizers or HTTP.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.kv_cache import PageAllocator
from jaxserve.sampling import SamplingParams
from jaxserve.sequence import Sequence, SequenceStatus


@dataclasses.dataclass
class ScheduledSeq:
    """One row of the step."""

    seq_id: int
    token_ids: list[int]  # the tokens to compute this step (a prefill chunk, or the last token)
    start_position: int  # position of token_ids[0] in the sequence (= num_computed_tokens)
    page_ids: list[int]  # the sequence's page table, covering start_position + len(token_ids) tokens
    sample: bool  # the chunk ends the known tokens: sample the next one
    params: SamplingParams
    seed: int


@dataclasses.dataclass
class ScheduledBatch:
    """The plan of one step: everything the runner needs, nothing it must look up."""

    rows: list[ScheduledSeq]  # in row order
    num_tokens: int  # sum of len(row.token_ids)
    preempted: list[int]  # seq ids preempted while planning this step


@dataclasses.dataclass
class StepOutput:
    """What the device returns for a batch: one entry per row (meaningful where row.sample)."""

    token_ids: np.ndarray  # i32[rows]
    logprobs: np.ndarray  # f32[rows]


class Scheduler:
    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...]):
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = PageAllocator(config.num_pages, config.page_size)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # oldest first: the last is preempted first
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence
        self.num_preemptions = 0
        self.finish_counts: collections.Counter[str] = collections.Counter()  # finish reason -> sequences

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; ValueError if it could never fit."""
        total = seq.num_prompt_tokens + seq.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.max_tokens}) = {total} "
                             f"exceeds max_model_len ({self.config.max_model_len})")
        if self.allocator.pages_for(total) > self.allocator.num_usable:
            raise ValueError(f"a sequence of {total} tokens needs {self.allocator.pages_for(total)} KV pages but the "
                             f"cache has {self.allocator.num_usable}; raise num_pages")
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish a sequence now ("abort") and free its pages."""
        seq = self.seqs.get(seq_id)
        if seq is not None:
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self._finish(seq, "abort")
        return seq

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        rows: list[ScheduledSeq] = []
        preempted: list[int] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve(seq, n, preempted):
                break  # seq itself was preempted: it was the newest
            rows.append(self._row(seq, n))
            budget -= n
            i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.allocator.grow(seq.page_ids, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            rows.append(self._row(seq, n))
            budget -= n
        return ScheduledBatch(rows=rows, num_tokens=self.config.max_num_batched_tokens - budget, preempted=preempted)

    def _reserve(self, seq: Sequence, n: int, preempted: list[int]) -> bool:
        """Pages for seq's next n tokens, preempting the newest running sequences as needed."""
        while not self.allocator.grow(seq.page_ids, seq.num_computed_tokens + n):
            victim = self.running.pop()
            self.allocator.release(victim.page_ids)
            victim.num_computed_tokens = 0
            victim.status = SequenceStatus.WAITING
            victim.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(victim)
            preempted.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    @staticmethod
    def _row(seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(seq_id=seq.seq_id, token_ids=seq.token_ids[start:start + n], start_position=start,
                            page_ids=list(seq.page_ids), sample=start + n == seq.num_tokens,
                            params=seq.params, seed=seq.seed)

    def update(self, batch: ScheduledBatch, out: StepOutput) -> list[Sequence]:
        """Record the step: computed counts, sampled tokens, stop checks. -> sequences that got a token."""
        changed = []
        for row, token, logprob in zip(batch.rows, out.token_ids.tolist(), out.logprobs.tolist()):
            seq = self.seqs.get(row.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or preempted since the plan was made
            seq.num_computed_tokens += len(row.token_ids)
            if not row.sample:
                continue
            seq.token_ids.append(token)
            seq.cumulative_logprob += logprob
            self._check_stop(seq, token)
            changed.append(seq)
        return changed

    def _check_stop(self, seq: Sequence, token: int) -> None:
        if token in seq.params.stop_token_ids:
            seq.stop_reason = token
            self._finish(seq, "stop")
        elif token in self.eos_token_ids and not seq.params.ignore_eos:
            self._finish(seq, "stop")
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            self._finish(seq, "length")
        else:
            return
        self.running.remove(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.finish_counts[reason] += 1
        self.allocator.release(seq.page_ids)
        del self.seqs[seq.seq_id]
