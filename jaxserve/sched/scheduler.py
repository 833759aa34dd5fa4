"""Continuous batching with one token budget and no phases.

Each sequence knows `num_computed_tokens` (K/V in the cache) and how many it wants cached
(`num_wanted_tokens`). A step hands out up to `max_num_batched_tokens` new tokens: a running sequence gets
what it lacks (one decode token, or the next chunk of a long prompt, of at most `long_prefill_token_threshold`
tokens where that is set), then waiting sequences join while the budget, the `max_num_seqs` limit and the free
pages allow. A chunk that reaches the end of a sequence's known tokens samples the next token; a partial
prefill chunk samples nothing.

When a running sequence needs a page and none is free, the newest running sequence is preempted: its pages are
freed and it waits at the front of the queue to be recomputed from its tokens.

Under the priority policy (`EngineConfig.scheduling_policy`) the waiting queue and the batch are kept in order
of (priority, arrival): the lowest priority is preempted first, and a waiting sequence of a higher priority
than the lowest running one that finds no seat or pages preempts it.

Prefix caching (`PageAllocator.match_prefix`): a sequence that joins the batch starts on the cached
pages of its longest registered prefix and computes only the rest.

A request for n > 1 choices is one sequence until all of its prompt but the last token is cached; it then
forks n - 1 siblings that share those pages (reference counts). Each computes the last prompt token itself;
whoever writes into a shared page first gets a private copy (`ScheduledBatch.page_copies`).

Steps are planned one ahead: a step may be scheduled while the one before it still computes, and take in
the sequences that arrive before it is launched (`admit`). Scheduling counts a row's tokens as computed
at once, and a row that samples leaves its sequence one *pending* token, which the next step may already
take as its input: that row names the previous step's row (`ScheduledSeq.pending_row`) and the device
feeds the sampled token in. `update` then records the sampled tokens of a finished step; a result for a
sequence that has finished or been preempted since is dropped (a preempted sequence samples that
position again, with the same random key). The device also puts a pending token into the penalties'
history. Sequences whose next step needs their last token on the host (a grammar's mask) are not planned
ahead (`can_schedule_ahead`).

Speculative decoding (`jaxserve/spec_decode/`): once every running sequence has its row, a decode
row also computes the drafts its budget and free pages allow (`ScheduledSeq.draft_slot`); `update`
keeps the samples up to the first that differs from its draft and rolls the rest back. A step with
drafts is never planned ahead of.

The scheduler's output is a plan of host numbers (`ScheduledBatch`); it never touches device arrays, and
knows nothing about the model, tokenizers or HTTP.
"""

from __future__ import annotations

import bisect
import collections
import itertools

import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.sched.limits import BatchLimits, bucket_cut, next_chunk
from jaxserve.sched.pages import PageAllocator
from jaxserve.sched.plan import (ScheduledBatch, ScheduledSeq, SchedulerStats, StepOutput, StepTokens, add_drafts,
                                 hidden_layer_slots, prompt_targets, record_hidden_states, record_prompt_logprobs,
                                 token_logprobs)
from jaxserve.sched.sequence import Sequence, SequenceStatus, adapter_names


class Scheduler:
    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...]):
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = PageAllocator(config.num_pages, config.page_size, record_events=config.kv_events is not None)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # oldest first: the last is preempted first
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence
        self._seq_ids = itertools.count()
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # the prompts of the sequences that have sampled their first token (vLLM's)
        self.num_prompt_tokens_computed = 0  # prefill work, recomputation included
        self.num_generated_tokens = 0
        self.num_prefix_queried_tokens = 0  # prefix cache lookups of new sequences: their prompt tokens,
        self.num_prefix_hit_tokens = 0  # ... and those found cached
        self.finish_counts: collections.Counter[str] = collections.Counter()  # finish reason -> sequences
        self.by_priority = config.scheduling_policy == "priority"
        # requests none of whose sequences has run yet (their first sequence waits, never preempted)
        self.num_queued_requests = self.num_queued_tokens = 0
        self._arrivals = itertools.count()
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        spec = config.speculative
        self.accepted_per_position = [0] * (spec.num_speculative_tokens if spec else 0)
        self.step_tokens = StepTokens(config.max_num_batched_tokens)

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
            num_prompt_tokens=self.num_prompt_tokens, num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generated_tokens=self.num_generated_tokens,
            num_preemptions=self.num_preemptions, num_prefix_queried_tokens=self.num_prefix_queried_tokens,
            num_prefix_hit_tokens=self.num_prefix_hit_tokens, finish_counts=dict(self.finish_counts),
            num_queued_requests=self.num_queued_requests, num_queued_tokens=self.num_queued_tokens,
            num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens, accepted_per_position=tuple(self.accepted_per_position),
            running_loras=adapter_names(self.running), waiting_loras=adapter_names(self.waiting),
            step_token_counts=tuple(self.step_tokens.counts), num_step_tokens=self.step_tokens.total)

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
            n = next_chunk(self.config, seq, budget)
            if n <= 0:  # its pending token is its last: nothing more to compute
                continue
            if not self._reserve(seq, n, batch):
                break  # seq itself was preempted: it was the newest
            batch.rows.append(ScheduledSeq.take(seq, n, len(batch.rows)))
            budget -= n
        budget -= add_drafts(batch, self.seqs, drafts or {}, budget, self.allocator)
        self._admit(batch, total, budget, made_room)
        return batch

    def admit(self, batch: ScheduledBatch) -> int:
        """Admit waiting sequences (those that arrived since) into `batch`, planned but not launched
        yet, within the tokens its plan allowed (`token_limit`); not into a plan that preempted or
        holds drafts. -> how many."""
        if batch.preempted or any(row.draft_token_ids for row in batch.rows):
            return 0
        before = len(batch.rows)
        self._admit(batch, batch.token_limit, batch.token_limit - batch.num_tokens, 0)
        return len(batch.rows) - before

    def _admit(self, batch: ScheduledBatch, total: int, budget: int, made_room: int) -> None:
        """Give waiting sequences rows in `batch` with `budget` of its `total` tokens left (`schedule`),
        then number its samples."""
        total, budget = bucket_cut(self.config, total, budget, self.waiting, len(self.running))
        batch.token_limit = total
        limits = BatchLimits(self.config, self.running)
        while (len(batch.preempted) == made_room and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = next((seq for seq in self.waiting if limits.fits(seq)), None)
            if seq is None:
                break
            if seq.seq_id in batch.preempted[:made_room]:
                break  # (its result from the step in flight is still to be dropped)
            matched = self.config.enable_prefix_caching and self.allocator.match_prefix(seq)
            n = next_chunk(self.config, seq, budget)
            if not self.allocator.allocate(seq, n, batch.page_copies):
                if matched:  # give the cached pages back until it can be admitted
                    self.allocator.release(seq.page_ids)
                    seq.page_hashes, seq.num_computed_tokens = [], 0
                break
            self.waiting.remove(seq)
            self._count_queued(seq, -1)
            limits.add(seq)
            if self.config.enable_prefix_caching and seq.reads_prefix_cache and not seq.num_preemptions:
                self.num_prefix_queried_tokens += seq.num_prompt_tokens
                self.num_prefix_hit_tokens += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            if self.by_priority:
                bisect.insort(self.running, seq, key=self._order)
            else:
                self.running.append(seq)
            batch.rows.append(ScheduledSeq.take(seq, n, len(batch.rows)))
            budget -= n
        batch.num_tokens = total - budget
        slot = len(batch.rows)  # (the samples after drafts follow every row's own)
        for row in batch.rows:
            row.draft_slot, slot = slot, slot + len(row.draft_token_ids)

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """`PageAllocator.allocate`, preempting the newest (lowest-priority) running sequences as needed."""
        while not self.allocator.allocate(seq, n, batch.page_copies):
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
            n = next_chunk(self.config, seq, budget)
            pages = alloc.pages_for(seq.num_computed_tokens + n) - len(seq.page_ids)
            if len(self.running) < self.config.max_num_seqs and pages <= alloc.num_free:
                return
            self._preempt_last(batch)

    def preempt_all(self) -> None:
        """Preempt every running sequence (none may be in a launched step): they recompute their KV
        when next scheduled (after a weight update, whose KV the old one's is not)."""
        batch = ScheduledBatch(rows=[], num_tokens=0, preempted=[])
        while self.running:
            self._preempt_last(batch)

    def _preempt_last(self, batch: ScheduledBatch) -> Sequence:
        victim = self.running.pop()
        self.allocator.release(victim.page_ids)
        victim.page_hashes, victim.num_computed_tokens, victim.num_pending = [], 0, 0
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._wait(victim, front=True)
        batch.preempted.append(victim.seq_id)
        return victim

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
        self.step_tokens.observe(batch.num_tokens)
        if out.prompt is not None:  # each asking row's first entry in it
            first_entry = np.cumsum([0] + [len(prompt_targets(row)) for row in batch.rows])
        if out.hidden is not None:  # each row's first token, and where each layer's hidden states are
            first_token = np.cumsum([0] + [len(r.token_ids) for r in batch.rows])
            layer_slots = hidden_layer_slots(batch.rows)
        for b, row in enumerate(batch.rows):
            seq = self.seqs.get(row.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # finished or preempted since the plan was made
            if row.prompt_logprobs:
                record_prompt_logprobs(seq, row, out.prompt, first_entry[b])
            if out.hidden is not None and row.sampling.hidden_layers:
                record_hidden_states(seq, row, out.hidden[:, first_token[b]:], layer_slots)
            self.num_prompt_tokens_computed += max(0, min(seq.num_prompt_tokens - row.start_position,
                                                          len(row.token_ids)))
            slots = [b]
            if row.draft_token_ids:  # (the step loop's common case has none)
                slots = row.sample_slots(b)
                slots = slots[:self._accept(seq, row, out.token_ids[slots]) + 1]
            if row.sample:  # first: a step in flight may already have computed this token's K/V
                seq.num_pending -= 1
                self.num_prompt_tokens += seq.num_prompt_tokens if len(seq.token_ids) == seq.num_prompt_tokens else 0
                seq.token_ids.extend(int(out.token_ids[slot]) for slot in slots)
            if self.config.enable_prefix_caching:
                self.allocator.register_full_pages(seq)
            self._fork_if_ready(seq)
            if not row.sample:
                continue
            seq.new_logprobs = [float(out.logprobs[slot]) for slot in slots]
            for i, slot in enumerate(slots):
                seq.cumulative_logprob += seq.new_logprobs[i]
                if row.sampling.carries:
                    seq.carried = out.carried[slot].copy()
                if seq.params.logprobs is not None:
                    seq.logprobs.append(token_logprobs(out, slot, seq.params.logprobs))
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
        others' K/V is rolled back."""
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
        """A finished sequence's text ended (a stop string) at its output token `num_output_tokens`."""
        self.num_generated_tokens -= seq.drop_tokens_after(num_output_tokens)

    def _fork_if_ready(self, seq: Sequence) -> None:
        """Fork the pending siblings once all of the prompt but its last token is cached (and its
        prompt logprobs are in, where asked for: the siblings share them)."""
        if not seq.pending_forks or seq.num_computed_tokens < seq.num_prompt_tokens - 1 or seq.owes_prompt_logprobs:
            return
        for k in range(1, seq.pending_forks + 1):
            sibling = seq.sibling(self.new_seq_id(), k)
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
