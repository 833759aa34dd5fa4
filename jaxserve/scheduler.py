"""Continuous batching with one token budget and no phases.

Each sequence knows `num_computed_tokens` (K/V in the cache) and how many it
wants cached (`num_wanted_tokens`). A step hands out up to
`max_num_batched_tokens` new tokens: a running sequence gets what it lacks (one
decode token, or the next chunk of a long prompt), then waiting sequences join
while the budget, the `max_num_seqs` limit and the free pages allow. A chunk
that reaches the end of a sequence's known tokens samples the next token; a
partial prefill chunk samples nothing.

When a running sequence needs a page and none is free, the newest running
sequence is preempted: its pages are freed and it waits at the front of the
queue to be recomputed from its tokens.

Under the priority policy (`EngineConfig.scheduling_policy`) the waiting queue
and the batch are kept in order of (priority, arrival): the lowest priority is
preempted first, and a waiting sequence of a higher priority than the lowest
running one that finds no seat or pages preempts it.

Prefix caching: every page that fills up is registered under the hash of its
tokens and all before them; a sequence that joins the batch starts on the
cached pages of its longest registered prefix and computes only the rest.

A request for n > 1 choices is one sequence until all of its prompt but the
last token is cached; it then forks n - 1 siblings that share those pages
(reference counts). Each computes the last prompt token itself; whoever writes
into a shared page first gets a private copy (`ScheduledBatch.page_copies`).

Steps are planned one ahead: a step may be scheduled while the one before it
still computes. Scheduling counts a row's tokens as computed at once, and a row
that samples leaves its sequence one *pending* token, which the next step may
already take as its input: that row names the previous step's row
(`ScheduledSeq.pending_row`) and the device feeds the sampled token in.
`update` then records the sampled tokens of a finished step; a result for a
sequence that has finished or been preempted since is dropped (a preempted
sequence samples that position again, with the same random key). The device
also puts a pending token into the penalties' history. Sequences whose next
step needs their last token on the host (a grammar's mask) are not planned
ahead (`can_schedule_ahead`).

Speculative decoding (`jaxserve/speculative.py`): `schedule` takes draft tokens
for decode rows; once every running sequence has its row, such a row also
computes the drafts its budget and the free pages allow (drafts never preempt),
and samples after each (`ScheduledSeq.draft_slot`). `update` keeps the samples up
to the first that differs from its draft, and rolls the rest back: fewer tokens
computed, the pages past them freed. A step with drafts is never planned ahead
of (its rows' lengths are known only once it is done).

The scheduler's output is a plan of host numbers (`ScheduledBatch`); it never
touches device arrays. It knows nothing about the model, tokenizers or HTTP.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import hashlib
import itertools

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.kv_cache import PageAllocator
from jaxserve.sampling import PromptLogprobs, needs_distribution
from jaxserve.sampling_params import RequestSampling, SamplingParams
from jaxserve.sequence import Sequence, SequenceStatus, TokenLogprobs

_FORK_SEED_STRIDE = 0x9E3779B97F4A7C15  # sibling k samples with seed + k * stride (mod 2**64)


def page_hash(previous: bytes | None, tokens: list[int]) -> bytes:
    """Prefix-cache key of a full page: sha256 of the previous page's key and its own tokens
    (a collision would serve another prompt's keys and values, so no 64-bit hash)."""
    return hashlib.sha256((previous or b"") + np.asarray(tokens, np.int64).tobytes()).digest()


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

    def set_drafts(self, drafts: list[int]) -> None:
        """Replace its drafts' tokens (placeholders the scheduler planned for a draft model's)."""
        drafts = list(drafts[:len(self.draft_token_ids)])
        self.token_ids[len(self.token_ids) - len(drafts):] = drafts
        self.draft_token_ids = drafts

    def sample_slots(self, b: int) -> list[int]:
        """The sampler's rows of its samples (this is row b): after its last known token, then after
        each draft."""
        return [b, *range(self.draft_slot, self.draft_slot + len(self.draft_token_ids))]


@dataclasses.dataclass
class ScheduledBatch:
    """The plan of one step: everything the runner needs, nothing it must look up."""

    rows: list[ScheduledSeq]  # in row order
    num_tokens: int  # sum of len(row.token_ids)
    preempted: list[int]  # seq ids preempted while planning this step
    page_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst), before the step
    token_masks: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # sample -> packed allowed tokens

    @property
    def num_samples(self) -> int:
        """Rows of the sampler: one per row, one more per draft token."""
        return len(self.rows) + sum(len(row.draft_token_ids) for row in self.rows)

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


def prompt_targets(row: ScheduledSeq) -> list[int]:
    """The prompt tokens whose logprobs the row asks for: the i-th follows its i-th token."""
    if not row.prompt_logprobs:
        return []
    start = row.start_position
    return row.all_token_ids[start + 1:min(start + len(row.token_ids) + 1, row.num_prompt_tokens)]


def _entry(out: StepOutput | PromptLogprobs, i: int, k: int) -> TokenLogprobs:
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
    num_queued_requests: int = 0  # requests none of whose sequences has started yet
    num_queued_tokens: int = 0  # their prompt tokens
    num_drafts: int = 0  # rows that checked draft tokens (speculative decoding)
    num_draft_tokens: int = 0  # draft tokens checked
    num_accepted_tokens: int = 0  # ... and kept
    accepted_per_position: tuple[int, ...] = ()  # drafts kept, by their place in the row's drafts

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total


class Scheduler:
    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...]):
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = PageAllocator(config.num_pages, config.page_size)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # oldest first: the last is preempted first
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence
        self._seq_ids = itertools.count()
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prefill work, recomputation included
        self.num_generated_tokens = 0
        # prefix cache lookups of new sequences: their prompt tokens, and those found cached
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.finish_counts: collections.Counter[str] = collections.Counter()  # finish reason -> sequences
        self.by_priority = config.scheduling_policy == "priority"
        # requests none of whose sequences has run yet (their first sequence waits, never preempted)
        self.num_queued_requests = self.num_queued_tokens = 0
        self._arrivals = itertools.count()
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        spec = config.speculative
        self.accepted_per_position = [0] * (spec.num_speculative_tokens if spec else 0)

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (with seq.params.n - 1 siblings to fork), one that fits
        (`EngineConfig.check_fits`, which the engine calls first)."""
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence id {seq.seq_id} is already queued; take ids from new_seq_id()")
        seq.pending_forks = seq.params.n - 1
        seq.arrival = next(self._arrivals)
        self.seqs[seq.seq_id] = seq
        self._count_queued(seq, 1)
        self._wait(seq)
        self._fork_if_ready(seq)

    def _count_queued(self, seq: Sequence, sign: int) -> None:
        """Count a request's first sequence in or out of the queued figures, where it has never run."""
        if seq.index == 0 and not seq.num_preemptions:
            self.num_queued_requests += sign
            self.num_queued_tokens += sign * seq.num_prompt_tokens

    @staticmethod
    def _order(seq: Sequence) -> tuple[int, int, int]:
        """Its place under the priority policy: priority, then arrival, then choice."""
        return seq.priority, seq.arrival, seq.index

    def _wait(self, seq: Sequence, front: bool = False) -> None:
        """Queue seq: at the back (first come, first served) or `front` (preempted, or a sibling that
        found no seat), or in its place under the priority policy."""
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=self._order)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def finish(self, seq_id: int, reason: str, stop_reason: int | str | None = None) -> Sequence | None:
        """Finish a sequence now (an abort, or a stop string found by the output processor) and free its pages."""
        seq = self.seqs.get(seq_id)
        if seq is not None:
            if seq.status is SequenceStatus.WAITING:
                self._count_queued(seq, -1)
            (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
            seq.stop_reason = stop_reason
            self._finish(seq, reason)
        return seq

    def abort(self, seq_id: int) -> Sequence | None:
        return self.finish(seq_id, "abort")

    def restate_finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        """A finished sequence turns out to have ended otherwise (a stop string found in the text of
        the token that ended it by length or EOS): its finish reason, and the counts, say so."""
        self.finish_counts[seq.finish_reason] -= 1
        self.finish_counts[reason] += 1
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    def stats(self) -> SchedulerStats:
        """The counters and gauges as of now (read by the engine thread; others read its snapshot)."""
        alloc = self.allocator
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_pages_used=alloc.num_usable - alloc.num_free, kv_pages_total=alloc.num_usable,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed, num_generated_tokens=self.num_generated_tokens,
            num_preemptions=self.num_preemptions, num_prefix_queried_tokens=self.num_prefix_queried_tokens,
            num_prefix_hit_tokens=self.num_prefix_hit_tokens, finish_counts=dict(self.finish_counts),
            num_queued_requests=self.num_queued_requests, num_queued_tokens=self.num_queued_tokens,
            num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens, accepted_per_position=tuple(self.accepted_per_position))

    def schedule(self, token_budget: int | None = None, drafts: dict[int, list[int]] | None = None
                 ) -> ScheduledBatch:
        """The next step's plan, of at most `token_budget` tokens (default and at most:
        max_num_batched_tokens; less while the larger step buckets are still compiling). `drafts`:
        seq id -> draft tokens to check after its last token, for running sequences with no pending
        token that compute only that token: as many as the budget left once every running sequence
        has its row allows, none where they would need pages that are not free."""
        total = budget = self.config.max_num_batched_tokens
        if token_budget is not None:
            total = budget = min(total, token_budget)
        batch = ScheduledBatch(rows=[], num_tokens=0, preempted=[])
        if self.by_priority:
            self._make_room(batch, budget)
        made_room = len(batch.preempted)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            n = min(seq.num_wanted_tokens - seq.num_computed_tokens, budget)
            if n <= 0:  # its pending token is its last: nothing more to compute
                continue
            if not self._reserve(seq, n, batch):
                break  # seq itself was preempted: it was the newest
            batch.rows.append(self._row(seq, n, len(batch.rows)))
            budget -= n
        budget -= self._add_drafts(batch, drafts or {}, budget)
        while (len(batch.preempted) == made_room and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if seq.seq_id in batch.preempted[:made_room]:
                break  # (its result from the step in flight is still to be dropped)
            matched = self._match_prefix(seq)
            n = min(seq.num_wanted_tokens - seq.num_computed_tokens, budget)
            if not self._allocate(seq, n, batch.page_copies):
                if matched:  # give the cached pages back until it can be admitted
                    self.allocator.release(seq.page_ids)
                    seq.page_hashes, seq.num_computed_tokens = [], 0
                break
            self.waiting.popleft()
            self._count_queued(seq, -1)
            if self.config.enable_prefix_caching and seq.reads_prefix_cache and not seq.num_preemptions:
                self.num_prefix_queried_tokens += seq.num_prompt_tokens
                self.num_prefix_hit_tokens += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            if self.by_priority:
                bisect.insort(self.running, seq, key=self._order)
            else:
                self.running.append(seq)
            batch.rows.append(self._row(seq, n, len(batch.rows)))
            budget -= n
        batch.num_tokens = total - budget
        slot = len(batch.rows)  # (the samples after drafts follow every row's own)
        for row in batch.rows:
            row.draft_slot, slot = slot, slot + len(row.draft_token_ids)
        return batch

    def _add_drafts(self, batch: ScheduledBatch, drafts: dict[int, list[int]], budget: int) -> int:
        """Give the rows that compute one token and sample their drafts (`schedule`), within `budget`
        tokens and the free pages. -> the tokens added."""
        added = 0
        for row in batch.rows:
            seq = self.seqs[row.seq_id]
            draft = drafts.get(seq.seq_id, [])[:budget - added] if len(row.token_ids) == 1 and row.sample else []
            if draft and self._allocate(seq, len(draft), batch.page_copies):
                seq.num_computed_tokens += len(draft)  # (`update` takes back the rejected ones)
                row.token_ids, row.draft_token_ids = row.token_ids + draft, list(draft)
                row.page_ids = list(seq.page_ids)
                added += len(draft)
        return added

    def _match_prefix(self, seq: Sequence) -> bool:
        """Start a sequence that holds no pages on the cached pages of its longest known prefix
        (full pages only, leaving at least one token to compute). -> whether any matched."""
        if not self.config.enable_prefix_caching or seq.page_ids or not seq.reads_prefix_cache:
            return False
        size = self.allocator.page_size
        prefix_hash = seq.hash_seed
        for i in range((seq.num_wanted_tokens - 1) // size):
            prefix_hash = page_hash(prefix_hash, seq.token_ids[i * size:(i + 1) * size])
            page = self.allocator.lookup(prefix_hash)
            if page is None:
                break
            self.allocator.acquire(page)
            seq.page_ids.append(page)
            seq.page_hashes.append(prefix_hash)
        seq.num_computed_tokens = len(seq.page_ids) * size
        if not seq.num_preemptions:
            seq.num_cached_tokens = seq.num_computed_tokens
        return bool(seq.page_ids)

    def _register_full_pages(self, seq: Sequence) -> None:
        """Enter the sequence's newly completed pages into the prefix cache."""
        size = self.allocator.page_size  # (every computed token is known here: see `update`)
        for i in range(len(seq.page_hashes), seq.num_computed_tokens // size):
            prefix_hash = page_hash(seq.page_hashes[-1] if seq.page_hashes else seq.hash_seed,
                                    seq.token_ids[i * size:(i + 1) * size])
            self.allocator.register(seq.page_ids[i], prefix_hash)
            seq.page_hashes.append(prefix_hash)

    def _allocate(self, seq: Sequence, n: int, page_copies: list[tuple[int, int]]) -> bool:
        """Pages for seq's next n tokens: a private copy of a shared page it writes into, then new pages.
        False (nothing taken) if too few are free."""
        alloc = self.allocator
        first = seq.num_computed_tokens // alloc.page_size  # the page the first new token goes into
        copy = first < len(seq.page_ids) and alloc.is_shared(seq.page_ids[first])
        if alloc.num_free < max(0, alloc.pages_for(seq.num_computed_tokens + n) - len(seq.page_ids)) + copy:
            return False
        if copy:
            shared, seq.page_ids[first] = seq.page_ids[first], alloc.take()
            page_copies.append((shared, seq.page_ids[first]))
            alloc.drop(shared)
        return alloc.grow(seq.page_ids, seq.num_computed_tokens + n)

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """`_allocate`, preempting the newest (lowest-priority) running sequences as needed."""
        while not self._allocate(seq, n, batch.page_copies):
            victim = self._preempt_last(batch)
            if victim is seq:
                return False
        return True

    def _make_room(self, batch: ScheduledBatch, budget: int) -> None:
        """Priority policy: preempt the lowest-priority running sequences while the first waiting one
        has a higher priority and finds no seat, or too few pages for its next chunk."""
        if not self.waiting:
            return
        seq, alloc = self.waiting[0], self.allocator
        while self.running and seq.priority < self.running[-1].priority:
            n = min(seq.num_wanted_tokens - seq.num_computed_tokens, budget)
            pages = alloc.pages_for(seq.num_computed_tokens + n) - len(seq.page_ids)
            if len(self.running) < self.config.max_num_seqs and pages <= alloc.num_free:
                return
            self._preempt_last(batch)

    def _preempt_last(self, batch: ScheduledBatch) -> Sequence:
        """Preempt the last running sequence: free its pages, queue it to be recomputed."""
        victim = self.running.pop()
        self.allocator.release(victim.page_ids)
        victim.page_hashes, victim.num_computed_tokens, victim.num_pending = [], 0, 0
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._wait(victim, front=True)
        batch.preempted.append(victim.seq_id)
        return victim

    @staticmethod
    def _row(seq: Sequence, n: int, index: int) -> ScheduledSeq:
        """Row `index` of the step: seq's next n tokens, counted as computed from now on. The last may
        be the pending token of the step before (only ever one: a row that samples covers all known
        tokens)."""
        start = seq.num_computed_tokens
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
        return ScheduledSeq(seq_id=seq.seq_id, token_ids=token_ids, start_position=start, pending_row=pending_row,
                            page_ids=list(seq.page_ids), sample=sample, params=seq.params, sampling=seq.sampling,
                            seed=seq.seed,
                            all_token_ids=seq.token_ids, num_prompt_tokens=seq.num_prompt_tokens,
                            prompt_logprobs=seq.owes_prompt_logprobs and start < seq.num_prompt_tokens - 1,
                            carried=seq.carried)

    def can_schedule_ahead(self, batch: ScheduledBatch) -> bool:
        """Whether the next step may be planned before `batch`'s tokens are known: not when one of
        its sampled tokens feeds the host side of the next step (a grammar's mask, bad words of
        several tokens, what a logits processor carries). The penalties' history gets a pending token
        on the device (`runner.make_step_fn`)."""
        return not any(row.draft_token_ids or row.sample and (
            row.params.constraint is not None or row.sampling.needs_last_tokens or row.sampling.carries)
            for row in batch.rows)

    def update(self, batch: ScheduledBatch, out: StepOutput) -> list[Sequence]:
        """Record a finished step: sampled tokens, full pages, forks, stop checks. -> sequences that got
        a token."""
        changed = []
        if out.prompt is not None:  # each asking row's first entry in it
            first_entry = np.cumsum([0] + [len(prompt_targets(row)) for row in batch.rows])
        for b, row in enumerate(batch.rows):
            seq = self.seqs.get(row.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # finished or preempted since the plan was made
            if row.prompt_logprobs:
                self._record_prompt_logprobs(seq, row, out.prompt, first_entry[b])
            self.num_prompt_tokens_computed += max(0, min(seq.num_prompt_tokens - row.start_position,
                                                          len(row.token_ids)))
            slots = [b]
            if row.draft_token_ids:  # (the step loop's common case has none)
                slots = row.sample_slots(b)
                slots = slots[:self._accept(seq, row, out.token_ids[slots]) + 1]
            if row.sample:  # first: a step in flight may already have computed this token's K/V
                seq.num_pending -= 1
                seq.token_ids.extend(int(out.token_ids[slot]) for slot in slots)
            if self.config.enable_prefix_caching:
                self._register_full_pages(seq)
            self._fork_if_ready(seq)
            if not row.sample:
                continue
            seq.new_logprobs = [float(out.logprobs[slot]) for slot in slots]
            for i, slot in enumerate(slots):
                seq.cumulative_logprob += seq.new_logprobs[i]
                if row.sampling.carries:
                    seq.carried = out.carried[slot].copy()
                if seq.params.logprobs is not None:
                    seq.logprobs.append(_entry(out, slot, seq.params.logprobs))
                if seq.params.return_entropy:
                    seq.entropies.append(float(out.entropies[slot]))
                self.num_generated_tokens += 1
                if self._check_stop(seq, len(slots) - 1 - i):
                    del seq.new_logprobs[i + 1:]  # (those of the tokens it dropped)
                    break
            changed.append(seq)
        return changed

    def _accept(self, seq: Sequence, row: ScheduledSeq, samples: np.ndarray) -> int:
        """How many of the row's drafts are kept: those equal to the sample before them, up to the
        first that is not (`samples`: after its last known token, then after each draft). The
        others' K/V is rolled back: the sequence's computed tokens end at its kept tokens, and the
        pages past them are freed."""
        drafts = row.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and samples[accepted] == drafts[accepted]:
            self.accepted_per_position[accepted] += 1
            accepted += 1
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        seq.num_computed_tokens -= len(drafts) - accepted
        keep = self.allocator.pages_for(seq.num_computed_tokens)
        self.allocator.release(seq.page_ids[keep:])
        del seq.page_ids[keep:]
        return accepted

    def drop_tokens_after(self, seq: Sequence, num_output_tokens: int) -> None:
        """A finished sequence's text ended (a stop string) at its output token `num_output_tokens`,
        before the last ones its last step gave it: it ends there."""
        dropped = seq.num_output_tokens - num_output_tokens
        if dropped <= 0:
            return
        del seq.token_ids[seq.num_tokens - dropped:]
        del seq.logprobs[num_output_tokens:], seq.entropies[num_output_tokens:]
        seq.cumulative_logprob -= sum(seq.new_logprobs[-dropped:])
        self.num_generated_tokens -= dropped

    @staticmethod
    def _record_prompt_logprobs(seq: Sequence, row: ScheduledSeq, prompt: PromptLogprobs, first: int) -> None:
        """Append the row's prompt logprobs (from entry `first` of the step's on) that seq lacks: a
        recomputed chunk repeats some; a chunk after a dropped one, none (the sequence was preempted
        and computes its prompt again)."""
        if len(seq.prompt_logprobs) < row.start_position:
            return
        end = min(row.start_position + len(row.token_ids), seq.num_prompt_tokens - 1)
        for position in range(len(seq.prompt_logprobs), end):
            seq.prompt_logprobs.append(_entry(prompt, first + position - row.start_position, seq.params.prompt_logprobs))

    def _fork_if_ready(self, seq: Sequence) -> None:
        """Fork the pending siblings once all of the prompt but its last token is cached (and its
        prompt logprobs are in, where asked for: the siblings share them)."""
        if not seq.pending_forks or seq.num_computed_tokens < seq.num_prompt_tokens - 1 or seq.owes_prompt_logprobs:
            return
        for k in range(1, seq.pending_forks + 1):
            sibling = Sequence(seq_id=self.new_seq_id(), request_id=seq.request_id,
                               prompt_token_ids=seq.prompt_token_ids, params=seq.params, sampling=seq.sampling,
                               seed=(seq.seed + k * _FORK_SEED_STRIDE) % 2**64, max_tokens=seq.max_tokens,
                               page_ids=list(seq.page_ids), page_hashes=list(seq.page_hashes),
                               num_computed_tokens=seq.num_computed_tokens, status=seq.status, index=seq.index + k,
                               num_cached_tokens=seq.num_cached_tokens, priority=seq.priority, arrival=seq.arrival,
                               hash_seed=seq.hash_seed,
                               prompt_logprobs=seq.prompt_logprobs)  # the same list: choice 0 fills it
            self.seqs[sibling.seq_id] = sibling
            seq.forks.append(sibling)
            if seq.status is SequenceStatus.RUNNING and len(self.running) < self.config.max_num_seqs:
                self.allocator.share(sibling.page_ids)
                self.running.insert(self.running.index(seq) + k, sibling)
            else:  # no room in the batch: wait holding no pages, and prefill on its own later
                sibling.page_ids, sibling.page_hashes, sibling.num_computed_tokens = [], [], 0
                sibling.status = SequenceStatus.WAITING
                self._wait(sibling, front=True)
        seq.pending_forks = 0

    def _check_stop(self, seq: Sequence, later: int = 0) -> bool:
        """Whether the token `later` tokens before seq's last one ends it: then it is finished and the
        tokens after it dropped (a step that kept drafts gives a sequence several tokens)."""
        num_output = seq.num_output_tokens - later
        token = seq.token_ids[seq.num_tokens - 1 - later]
        min_reached = num_output >= seq.params.min_tokens
        if token in seq.params.stop_token_ids and min_reached:
            seq.stop_reason = token
            self._finish(seq, "stop")
        elif token in self.eos_token_ids and not seq.params.ignore_eos and min_reached:
            self._finish(seq, "stop")
        elif num_output >= seq.max_tokens or seq.num_tokens - later >= self.config.max_model_len:
            self._finish(seq, "length")
        else:
            return False
        self.running.remove(seq)
        if later:
            del seq.token_ids[seq.num_tokens - later:]
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.finish_counts[reason] += 1
        self.allocator.release(seq.page_ids)
        del self.seqs[seq.seq_id]
