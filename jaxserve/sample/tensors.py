"""A batch's sampling settings as arrays with one row per sequence (`SamplingTensors`, built on the
host), and what the sampler gives back (`SampleOutput`, `PromptLogprobs`)."""

from __future__ import annotations

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.engine import MAX_LOGPROBS
from jaxserve.sample.logits_processors import ProcessorRows, Processors
from jaxserve.sample.params import MAX_LOGIT_BIAS, SamplingParams
from jaxserve.structured_output.grammar import mask_width

MAX_SUPPRESSED = 32  # EOS + stop token ids masked while min_tokens is not reached


@dataclasses.dataclass
class SamplingRow:
    """What the sampler needs to know about one row besides its logits."""

    params: SamplingParams
    seed: int
    position: int  # position of the token being sampled
    token_ids: list[int]  # the sequence's prompt + generated tokens (read only; for penalties)
    num_prompt_tokens: int
    allowed_mask: np.ndarray | None = None  # `RequestSampling.allowed_mask`: packed allowed tokens, or any
    processor_args: tuple | None = None  # `RequestSampling.processor_args`: per logits processor, or None
    carried: np.ndarray | None = None  # i32[C] what its processors carried from its last token (None: none yet)


@dataclasses.dataclass(frozen=True)
class Padding:
    """The value of a large per-row input no row uses this step: `shape` filled with `fill`. A value,
    not an array: equal Paddings have equal contents, so the runner keeps one device copy of each
    and sends none per step. `np.asarray` gives it as a host array (shared, so read-only)."""

    shape: tuple[int, ...]
    fill: int
    dtype: str  # numpy's name

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = _filled(self)
        return array if dtype is None and not copy else np.array(array, dtype=dtype)


@functools.lru_cache(maxsize=64)
def _filled(padding: Padding) -> np.ndarray:
    array = np.full(padding.shape, padding.fill, padding.dtype)
    array.flags.writeable = False
    return array


@flax.struct.dataclass
class SamplingTensors:
    """Per-row sampling settings of one step; B = padded sequences, V = vocab, H = history length."""

    temperature: jax.Array  # f32[B]; <= GREEDY_TEMPERATURE means greedy
    top_k: jax.Array  # i32[B]; V when off
    top_p: jax.Array  # f32[B]
    min_p: jax.Array  # f32[B]
    min_keep: jax.Array  # i32[B] llama.cpp's: top-p and min-p keep at least this many tokens
    seed_lo: jax.Array  # u32[B] low 32 bits of the seed
    seed_hi: jax.Array  # u32[B] high 32 bits of the seed
    position: jax.Array  # i32[B] position of the token being sampled
    presence_penalty: jax.Array  # f32[B]
    frequency_penalty: jax.Array  # f32[B]
    repetition_penalty: jax.Array  # f32[B]
    bias_ids: jax.Array  # i32[B, MAX_LOGIT_BIAS]; V (dropped) where unused
    bias_values: jax.Array  # f32[B, MAX_LOGIT_BIAS]
    suppress_ids: jax.Array  # i32[B, MAX_SUPPRESSED] ids masked to -inf; V where unused
    history: jax.Array  # i32[B, H] prompt + generated ids for penalties; V where unused (a Padding if all is)
    num_prompt: jax.Array  # i32[B] how many of history are prompt tokens
    token_mask: jax.Array  # i32[B, ceil(V / 32)] allowed tokens, bit t % 32 of word t // 32 (or a Padding)
    has_mask: jax.Array  # bool[B] whether the row's token_mask applies
    wants_top: jax.Array  # bool[B] the row asked for top logprobs
    wants_rank: jax.Array  # bool[B] the row asked for logprobs (the sampled token's rank)
    wants_distribution: jax.Array  # bool[B] the row asked for more top logprobs than K: its whole distribution
    wants_entropy: jax.Array  # bool[B] the row asked for the entropy of the model's distribution
    processors: tuple[ProcessorRows, ...] = ()  # per registered logits processor, its rows' arguments

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], num_rows: int, vocab_size: int, history_len: int,
                  eos_token_ids: tuple[int, ...] = (), token_masks: dict[int, np.ndarray] | None = None,
                  keep_padding: bool = False, processors: Processors | None = None) -> SamplingTensors:
        """Host arrays for `rows`, padded to `num_rows` greedy rows. The history is filled only when
        some row uses a penalty or a processor that reads it (otherwise it is all padding);
        `token_masks` maps row -> its packed allowed-token mask (a grammar's), which a row's
        `allowed_token_ids` narrow further. With `keep_padding`, an input no row uses is left a
        `Padding` (which the runner sends to the device once) instead of an array."""
        pad = num_rows - len(rows)
        params = [r.params for r in rows]

        def column(values, fill, dtype):
            return np.asarray(list(values) + [fill] * pad, dtype=dtype)

        seeds64 = [r.seed & 0xFFFF_FFFF_FFFF_FFFF for r in rows]
        bias_ids = np.full((num_rows, MAX_LOGIT_BIAS), vocab_size, np.int32)
        bias_values = np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32)
        suppress = np.full((num_rows, MAX_SUPPRESSED), vocab_size, np.int32)
        unused = Padding if keep_padding else lambda *padding: np.asarray(Padding(*padding))
        needs_history = any(r.params.uses_penalties or (processors is not None and processors.uses_history(
            r.processor_args)) for r in rows)
        history = (np.full if needs_history else unused)((num_rows, history_len), vocab_size, "int32")
        token_mask, has_mask = _token_masks(rows, num_rows, vocab_size, token_masks or {}, unused)
        for b, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                ids = np.fromiter(p.logit_bias.keys(), np.int64)
                bias_ids[b, :len(ids)] = np.where(ids < vocab_size, ids, vocab_size)
                bias_values[b, :len(ids)] = list(p.logit_bias.values())
            if row.position - row.num_prompt_tokens < p.min_tokens and p.constraint is None:  # outputs before it
                ids = sorted(set(p.stop_token_ids) | set(eos_token_ids))  # <= MAX_SUPPRESSED (Engine checks)
                suppress[b, :len(ids)] = ids
            if needs_history:  # then `history` is a fresh array
                n = min(len(row.token_ids), history_len)
                history[b, :n] = row.token_ids[:n]
        return cls(
            temperature=column((p.temperature for p in params), 0.0, np.float32),
            top_k=column((min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params), vocab_size,
                         np.int32),
            top_p=column((p.top_p for p in params), 1.0, np.float32),
            min_p=column((p.min_p for p in params), 0.0, np.float32),
            min_keep=column((p.min_keep for p in params), 0, np.int32),
            seed_lo=column((s & 0xFFFF_FFFF for s in seeds64), 0, np.uint32),
            seed_hi=column((s >> 32 for s in seeds64), 0, np.uint32),
            position=column((r.position for r in rows), 0, np.int32),
            presence_penalty=column((p.presence_penalty for p in params), 0.0, np.float32),
            frequency_penalty=column((p.frequency_penalty for p in params), 0.0, np.float32),
            repetition_penalty=column((p.repetition_penalty for p in params), 1.0, np.float32),
            bias_ids=bias_ids, bias_values=bias_values, suppress_ids=suppress, history=history,
            num_prompt=column((r.num_prompt_tokens for r in rows), 0, np.int32),
            token_mask=token_mask, has_mask=has_mask,
            wants_top=column((bool(p.logprobs) and not needs_distribution(p.logprobs) for p in params), False, bool),
            wants_rank=column((p.logprobs is not None for p in params), False, bool),
            wants_distribution=column((needs_distribution(p.logprobs) for p in params), False, bool),
            wants_entropy=column((p.return_entropy for p in params), False, bool),
            processors=processors.rows([r.processor_args for r in rows], num_rows, [r.carried for r in rows],
                                       unused) if processors else (),
        )


def _token_masks(rows: list[SamplingRow], num_rows: int, vocab_size: int, token_masks: dict[int, np.ndarray],
                 unused) -> tuple[np.ndarray | Padding, np.ndarray]:
    """(token_mask, has_mask): each row's grammar mask (`token_masks`) narrowed by its allowed tokens;
    the mask input left `unused` (padding) where no row has one."""
    has_mask = np.zeros(num_rows, bool)
    if not token_masks and all(r.allowed_mask is None for r in rows):
        return unused((num_rows, mask_width(vocab_size)), 0, "int32"), has_mask
    token_mask = np.zeros((num_rows, mask_width(vocab_size)), np.int32)
    for b, mask in token_masks.items():
        token_mask[b], has_mask[b] = mask, True
    for b, row in enumerate(rows):
        if row.allowed_mask is not None:
            token_mask[b] = token_mask[b] & row.allowed_mask if has_mask[b] else row.allowed_mask
            has_mask[b] = True
    return token_mask, has_mask


def needs_distribution(logprobs: int | None) -> bool:
    """Whether a request's `logprobs` (top logprobs per token) are read from its rows' whole
    distribution: -1 (all of them, vLLM's) or more than the MAX_LOGPROBS the sampler keeps per token."""
    return logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS


@flax.struct.dataclass
class SampleOutput:
    """The sampled tokens and their logprobs, in the logprobs mode (`sample`): logits in the `*_logits` modes."""

    tokens: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B] of each token (all 0 when no row asks for logprobs)
    ranks: jax.Array  # i32[B] 1 + how many tokens are likelier than it (0 where no row asked for logprobs)
    top_ids: jax.Array  # i32[B, K] the K = min(MAX_LOGPROBS, V) most likely tokens, most likely first
    top_logprobs: jax.Array  # f32[B, K]
    entropies: jax.Array  # f32[B] of the model's distribution, in nats (0 where no row asked for it)
    carried: jax.Array  # i32[B, C] the logits processors' carried values after this token (`Processors.advance`)
    # f32[B, V] each row's value of every token (a logprob, or a logit in the `*_logits` modes), for
    # the rows that ask for more than K (zeros when none does); None where `sample` was not asked for
    # it. Not packed: fetched only when asked for.
    distributions: jax.Array | None = None

    def packed(self) -> jax.Array:
        """The per-row fields in one i32[B * (4 + 2K + C)] buffer, in field order, floats bit for bit: the
        host fetches a step's samples in one transfer (each array fetched has a fixed host cost)."""
        fields = (self.tokens, self.logprobs, self.ranks, self.top_ids, self.top_logprobs, self.entropies,
                  self.carried)
        return jnp.concatenate([(a if a.dtype == jnp.int32 else jax.lax.bitcast_convert_type(a, jnp.int32)).ravel()
                                for a in fields])

    @staticmethod
    def unpacked(words: np.ndarray, k: int, c: int = 0) -> SampleOutput:
        """`packed` on the host: the fields as numpy views of `words`."""
        b = words.size // (4 + 2 * k + c)
        floats, top = words.view(np.float32), 3 * b + b * k  # (top: where top_logprobs start)
        return SampleOutput(tokens=words[:b], logprobs=floats[b:2 * b], ranks=words[2 * b:3 * b],
                            top_ids=words[3 * b:top].reshape(b, k), top_logprobs=floats[top:top + b * k].reshape(b, k),
                            entropies=floats[top + b * k:top + b * k + b], carried=words[top + b * k + b:].reshape(b, c))


@flax.struct.dataclass
class PromptLogprobs:
    """Of the step's tokens whose next token is a prompt token asked about, in the plan's order
    (`Runner.prepare`): entries past their count are padding (T = the step's tokens)."""

    logprobs: jax.Array  # f32[T] of the next prompt token
    ranks: jax.Array  # i32[T] its rank (1 = most likely)
    top_ids: jax.Array  # i32[T, K]
    top_logprobs: jax.Array  # f32[T, K]
