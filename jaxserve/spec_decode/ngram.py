"""Speculative decoding: what proposes draft tokens (`--speculative-config`, vLLM's).

A decode row with drafts d1..dk computes [x, d1, ..., dk] in one step (x: its last token) and
samples after each of them, every sample exactly as it would be sampled without speculation: the
same processed distribution (penalties, bias, min_tokens, masks over the tokens before it, drafts
included) and the same random key, a function of (seed, position). The sample after x is the next
token; the sample after d_j counts only while d1..d_j all equal the samples before them. So the
tokens kept are the samples up to the first one that differs from its draft, which is the first
rejection of rejection sampling against a draft that puts all its mass on one token (vLLM's rule
for drafts without probabilities: accept d with probability p(d), else draw from p without d). The
outputs are distributed exactly as without speculation, and a seeded request draws the same tokens
with it as without. The scheduler then rolls the rejected drafts' KV entries back
(`Scheduler.update`).
"""

from __future__ import annotations

import numpy as np

from jaxserve.config.speculative import SpeculativeConfig


class NgramProposer:
    """Prompt lookup: drafts are what followed the latest earlier occurrence of the sequence's
    longest suffix of `prompt_lookup_min` to `prompt_lookup_max` tokens (prompt and output alike)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens to follow `token_ids`; none where no suffix of min_n tokens or more occurred before."""
        tokens = np.asarray(token_ids, np.int64)
        size = tokens.size
        if k < 1 or size <= self.min_n:
            return []
        # (starts of earlier occurrences of the last token, then narrowed as the suffix grows)
        starts = np.flatnonzero(tokens[:-1] == tokens[-1])
        best = None
        for n in range(1, min(self.max_n, size - 1) + 1):
            if n > 1:
                starts = starts[starts >= n - 1]
                starts = starts[tokens[starts - (n - 1)] == tokens[size - n]]
            if starts.size == 0:
                break
            if n >= self.min_n:
                best = starts[-1] + 1  # (the latest occurrence of the longest suffix found so far)
        return [] if best is None else tokens[best:best + k].tolist()
