"""Host-side work around a step: grammar masks before it (`constrain`); after it, grammar progress
(`advance_grammars`), detokenization and stop strings (`process`, which the engine runs while the
next step computes).

Text is released only once it is decided: a tail that could still be the start
of a stop string is held back, so no released text ever contains part of a
stop string that then matches. When a stop string appears, the text is cut
there (or after it, with `include_stop_str_in_output`) and the sequence is
finished with reason "stop". As in vLLM, a stop string counts only where it
ends in the text of a token after the first `min_tokens`, and the EOS or stop
token that ends a sequence adds no text (unless `include_stop_str_in_output`).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from jaxserve.engine.outputs import HiddenStates, RequestTimings, Update
from jaxserve.engine.detokenizer import IncrementalDetokenizer, find_stop, undecided_tail
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.sched.plan import ScheduledBatch
from jaxserve.sched.scheduler import Scheduler
from jaxserve.sched.sequence import Sequence, TokenLogprobs
from jaxserve.structured_output.grammar import Constraint, GrammarMatchers, mask_width


@dataclasses.dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer | None  # None: no text (detokenize=False, or no tokenizer)
    text: str = ""  # everything decoded so far (stop strings cut)
    num_tokens: int = 0  # output tokens already reported
    exempt: int = 0  # characters of the first min_tokens tokens: no stop string may end in them


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, scheduler: Scheduler, vocab_size: int):
        """`tokenizer` None: the engine runs on token ids alone (its check refuses what needs text:
        stop strings, bad words, grammars), every text is empty."""
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self._grammars: GrammarMatchers | None = None  # built on the first constrained request
        self._grammars_lock = threading.Lock()  # (the API may check a constraint from its own thread)
        self._states: dict[int, _TextState] = {}
        # sequences whose grammar refused their last token: possible only where allowed_token_ids or
        # bad_words leave none it allows; they end ("abort") without that token's text
        self._refused: set[int] = set()

    @property
    def grammars(self) -> GrammarMatchers:
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarMatchers(self.tokenizer.hf, self.vocab_size)
            return self._grammars

    def check_constraint(self, constraint: Constraint) -> None:
        """Compile the grammar (in the grammar sandbox first, `jaxserve/structured_output/sandbox.py`) and its
        first mask now, so a bad or too complex one is a ValueError for the request rather than an
        error, or a stall, inside a step. Any thread may call it: the API does, off its event loop,
        before the request reaches the engine, whose sequences then copy the compiled grammar."""
        self.grammars.compiled(constraint)

    def constrain(self, batch: ScheduledBatch) -> None:
        """Fill `batch.token_masks` for the samples of this step under a grammar or bad words (a row
        under a grammar has no drafts; bad words count a sample's drafts before it)."""
        for slot, b, drafted in batch.samples():
            row = batch.rows[b]
            p = row.params
            if not row.sample or (p.constraint is None and not row.sampling.bad_words_token_ids):
                continue
            if p.constraint is not None:
                mask = np.zeros(mask_width(self.vocab_size), np.int32)
                self.grammars.fill(row.seq_id, p.constraint, mask)
            else:
                mask = np.full(mask_width(self.vocab_size), -1, np.int32)
            bits = mask.view(np.uint32)
            history = row.all_token_ids + row.draft_token_ids[:drafted] if drafted else row.all_token_ids
            for token in row.sampling.banned_tokens(history, row.num_prompt_tokens):
                if token < self.vocab_size:
                    bits[token // 32] &= np.uint32(~(1 << token % 32) & 0xFFFF_FFFF)
            batch.token_masks[slot] = mask

    def advance_grammars(self, seqs: list[Sequence]) -> None:
        """Feed each constrained sequence's new token to its grammar: a complete grammar finishes it
        ("stop"), a token it refuses aborts it (and adds no text)."""
        for seq in seqs:
            if seq.params.constraint is not None:
                verdict = self.grammars.accept(seq.seq_id, seq.output_token_ids[-1])
                if verdict == "error":
                    self._refused.add(seq.seq_id)
                if verdict is not None and not seq.is_finished:
                    self.scheduler.finish(seq.seq_id, "stop" if verdict == "done" else "abort")

    def process(self, seqs: list[Sequence], weight_version: int) -> list[Update]:
        """Each sequence's update, its new tokens sampled under the weights of `weight_version`."""
        return [self._process(seq, weight_version) for seq in seqs]

    def _process(self, seq: Sequence, weight_version: int) -> Update:
        state = self._states.get(seq.seq_id)
        if state is None:
            detokenizer = None
            if seq.params.detokenize and self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                                     seq.params.skip_special_tokens,
                                                     seq.params.spaces_between_special_tokens)
            state = self._states[seq.seq_id] = _TextState(detokenizer)
        first = state.num_tokens
        released = len(seq.text)
        stops = seq.params.stop
        hit = None
        # token by token (a step that kept drafts gives several): a stop string ends the sequence at
        # the token whose text completes it, as it would without speculation
        for i, token in enumerate(seq.output_token_ids[first:]):
            state.num_tokens += 1
            last = first + i + 1 == seq.num_output_tokens
            text_tokens = [token]
            if last and (seq.seq_id in self._refused or
                         self._ended_by_token(seq) and not seq.params.include_stop_str_in_output):
                text_tokens = []  # the EOS or stop token that ended it (even with special tokens kept)
            if state.detokenizer is not None:
                state.text += state.detokenizer.push(text_tokens)
                if last and seq.is_finished:
                    state.text += state.detokenizer.flush()
            if state.num_tokens <= seq.params.min_tokens:
                state.exempt = len(state.text)
            elif stops:
                hit = find_stop(state.text, stops, max(released, state.exempt))
                if hit is not None:
                    break
        if hit is not None:
            index, stop = hit
            state.text = state.text[:index + len(stop) if seq.params.include_stop_str_in_output else index]
            if seq.is_finished:  # finished by length or EOS in the same step: the stop string wins
                self.scheduler.restate_finish(seq, "stop", stop)
            else:
                self.scheduler.finish(seq.seq_id, "stop", stop_reason=stop)
            self.scheduler.drop_tokens_after(seq, state.num_tokens)
            end = len(state.text)
        else:
            end = len(state.text) - (0 if seq.is_finished else undecided_tail(state.text, stops))
        seq.text = state.text[:end]
        if seq.is_finished:
            self.forget(seq.seq_id)
        return update_of(seq, seq.text[released:], seq.output_token_ids[first:], seq.logprobs[first:],
                         seq.entropies[first:], state.num_tokens, weight_version)

    def _ended_by_token(self, seq: Sequence) -> bool:
        last = seq.output_token_ids[-1]
        return seq.finish_reason == "stop" and (last in self.scheduler.eos_token_ids or seq.stop_reason == last)

    def forget(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)
        self._refused.discard(seq_id)
        if self._grammars is not None:
            self._grammars.forget(seq_id)


def update_of(seq: Sequence, text: str, token_ids: list[int], logprobs: list[TokenLogprobs], entropies: list[float],
              num_output_tokens: int, weight_version: int) -> Update:
    if token_ids and seq.first_token_at is None:
        seq.first_token_at = time.monotonic()
    return Update(request_id=seq.request_id, index=seq.index, text=text, token_ids=token_ids, logprobs=logprobs,
                  num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                  num_output_tokens=num_output_tokens, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                  prompt_logprobs=None if seq.params.prompt_logprobs is None else seq.prompt_logprobs,
                  entropies=entropies, cumulative_logprob=seq.cumulative_logprob, weight_version=weight_version,
                  hidden_states=HiddenStates.of(seq) if seq.finish_reason and seq.params.return_hidden_states else None,
                  timings=RequestTimings.of(seq) if seq.finish_reason else None)
