"""Sampling settings of a request, and the one batched sampler that applies them.

Every per-request setting becomes a row of an array (`SamplingTensors`), so a
single compiled `sample` serves any mix of greedy and random rows. A row's
random key is a function of (seed, position of the token being sampled) only,
so a seeded request gives the same tokens alone or in any batch, and after a
preemption.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

GREEDY_TEMPERATURE = 1e-5  # at or below this, a row takes the argmax (vLLM's rule)


@dataclasses.dataclass
class SamplingParams:
    """vLLM-compatible sampling settings of one request."""

    max_tokens: int | None = 16  # None: up to max_model_len
    temperature: float = 1.0  # 0: greedy
    top_k: int = -1  # -1 or 0: off; 1: greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob, in [0, 1]
    seed: int | None = None  # None: drawn from the engine's seed
    ignore_eos: bool = False  # keep going past EOS (until max_tokens)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # finish when one is sampled

    def __post_init__(self):
        def check(ok: bool, message: str):
            if not ok:
                raise ValueError(message)

        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
              f"temperature must be >= 0, got {self.temperature!r}")
        check(isinstance(self.top_k, int) and self.top_k >= -1,
              f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
              f"top_p must be in (0, 1], got {self.top_p!r}")
        check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1,
              f"min_p must be in [0, 1], got {self.min_p!r}")
        check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)


@flax.struct.dataclass
class SamplingTensors:
    """Per-row sampling settings of one step; B = padded sequences."""

    temperature: jax.Array  # f32[B]; <= GREEDY_TEMPERATURE means greedy
    top_k: jax.Array  # i32[B]; vocab size when off
    top_p: jax.Array  # f32[B]
    min_p: jax.Array  # f32[B]
    seed_lo: jax.Array  # u32[B] low 32 bits of the seed
    seed_hi: jax.Array  # u32[B] high 32 bits of the seed
    position: jax.Array  # i32[B] position of the token being sampled

    @classmethod
    def from_rows(cls, params: list[SamplingParams], seeds: list[int], positions: list[int],
                  num_rows: int, vocab_size: int) -> SamplingTensors:
        """Host arrays for `params` (one per real row), padded to `num_rows` greedy rows."""
        pad = num_rows - len(params)
        def column(values, fill, dtype):
            return np.asarray(list(values) + [fill] * pad, dtype=dtype)
        seeds64 = [s & 0xFFFF_FFFF_FFFF_FFFF for s in seeds]
        return cls(
            temperature=column((p.temperature for p in params), 0.0, np.float32),
            top_k=column((min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params), vocab_size,
                         np.int32),
            top_p=column((p.top_p for p in params), 1.0, np.float32),
            min_p=column((p.min_p for p in params), 0.0, np.float32),
            seed_lo=column((s & 0xFFFF_FFFF for s in seeds64), 0, np.uint32),
            seed_hi=column((s >> 32 for s in seeds64), 0, np.uint32),
            position=column(positions, 0, np.int32),
        )


def _row_key(seed_lo, seed_hi, position):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed_lo), seed_hi), position)


def sample(logits: jax.Array, t: SamplingTensors) -> tuple[jax.Array, jax.Array]:
    """logits f32[B, V] -> (token ids i32[B], logprob f32[B] of each token under the
    distribution it was drawn from: the filtered, tempered one, or the raw one for greedy rows).

    Order: temperature, top-k, min-p (relative to the top token), then top-p over
    what is left, renormalised; a row always keeps its most likely token. An
    all-greedy batch skips the sort.
    """
    greedy = (t.temperature <= GREEDY_TEMPERATURE) | (t.top_k == 1)
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    greedy_logprob = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), argmax[:, None], axis=-1)[:, 0]
    sampled, sampled_logprob = jax.lax.cond(jnp.all(greedy), lambda: (argmax, greedy_logprob),
                                            lambda: _sample_filtered(logits, t, greedy))
    return jnp.where(greedy, argmax, sampled), jnp.where(greedy, greedy_logprob, sampled_logprob)


def _sample_filtered(logits: jax.Array, t: SamplingTensors, greedy: jax.Array) -> tuple[jax.Array, jax.Array]:
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(greedy, 1.0, t.temperature)[:, None]
    sorted_logits, sorted_ids = jax.lax.top_k(scaled, vocab)  # descending
    rank = jnp.arange(vocab)[None, :]
    keep = rank < t.top_k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    keep &= probs >= t.min_p[:, None] * probs[:, :1]
    probs = jnp.where(keep, probs, 0.0)
    probs = probs / probs.sum(axis=-1, keepdims=True)
    # top_p = 1 keeps everything, whatever the rounding of the cumulative sum
    keep &= ((jnp.cumsum(probs, axis=-1) - probs) < t.top_p[:, None]) | (t.top_p[:, None] >= 1.0)
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)

    keys = jax.vmap(_row_key)(t.seed_lo, t.seed_hi, t.position)
    choice = jax.vmap(jax.random.categorical)(keys, filtered)  # i32[B] rank in sorted order
    sampled = jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(filtered, axis=-1), choice[:, None], axis=-1)[:, 0]
    return sampled, logprob
