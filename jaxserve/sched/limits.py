"""What a step's fixed-size device tables hold for the running sequences, and whether a waiting
sequence fits beside them: LoRA adapters (`max_loras` slots), steerings (`max_steering_slots`
slots) and the layers whose hidden states are gathered (`max_hidden_states_layers`, all rows'
together). A sequence that does not fit waits, and those behind it that fit go first (vLLM's rule
for adapters). And how many tokens to keep out of a step whose padding to its token bucket
would cost more than running them in the next one, where padding is computed (`bucket_cut`)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

from jaxserve.sched.sequence import Sequence

CUT_MIN_TOKENS = 64  # below, a step costs less than its tokens' share (reading the weights): padding is cheap


class BatchLimits:
    def __init__(self, config, running: list[Sequence]):
        self.max_loras = config.max_loras
        self.max_layers, self.max_steerings = config.residual_limits
        self.adapters: set[int] = set()
        self.steerings: set[bytes] = set()
        self.layers: set[int] = set()
        for seq in running:
            self.add(seq)

    def fits(self, seq: Sequence) -> bool:
        steering = seq.sampling.steering
        return ((seq.lora is None or seq.lora.lora_int_id in self.adapters or len(self.adapters) < self.max_loras)
                and (steering is None or steering.key in self.steerings or len(self.steerings) < self.max_steerings)
                and len(self.layers.union(seq.sampling.hidden_layers)) <= self.max_layers)

    def add(self, seq: Sequence) -> None:
        if seq.lora is not None:
            self.adapters.add(seq.lora.lora_int_id)
        if seq.sampling.steering is not None:
            self.steerings.add(seq.sampling.steering.key)
        self.layers.update(seq.sampling.hidden_layers)


def next_chunk(config, seq: Sequence, budget: int) -> int:
    """The tokens seq computes next within `budget`: all it lacks, and of a long prompt at most
    `long_prefill_token_threshold` where that is set (vLLM's cap: others keep room in each step)."""
    n = min(seq.num_wanted_tokens - seq.num_computed_tokens, budget)
    cap = config.long_prefill_token_threshold
    return min(n, cap) if cap else n


def bucket_cut(config, total: int, budget: int, waiting: Iterable[Sequence], num_running: int) -> tuple[int, int]:
    """A step's (total, budget) tokens, `budget` of them left once the running rows have theirs,
    cut so that the step ends on the token bucket below instead of being padded to the one above:
    a step whose tokens, the waiting prompts' included, would end in the lower half between two
    buckets of at least CUT_MIN_TOKENS stops at the lower one, its last prompt chunked (the rest
    comes first in the next step), where the upper bucket's step computes its padded tokens as it
    does the others (`padding_computed_from`). Where it skips them (the C++ CPU products), padding
    costs less than the step the cut prompt's first token would wait for. A prompt's cached
    prefix, unknown before it is matched, counts as tokens to compute."""
    used, seats = total - budget, max(config.max_num_seqs - num_running, 0)
    n = used + min(budget, sum(next_chunk(config, seq, budget) for seq in itertools.islice(waiting, seats)))
    buckets = config.token_buckets
    i = bisect.bisect_right(buckets, n) - 1  # the largest bucket of at most n tokens
    computed_from = config.padding_computed_from
    if (i < 0 or i + 1 == len(buckets) or buckets[i] < max(used + 1, CUT_MIN_TOKENS)
            or computed_from is None or buckets[i + 1] < computed_from):
        return total, budget
    low, high = buckets[i], buckets[i + 1]
    return (low, low - used) if 2 * (n - low) < high - low else (total, budget)
