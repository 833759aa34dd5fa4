"""The one batched sampler that applies every request's sampling settings (`SamplingParams`).

Every per-request setting becomes a row of an array (`SamplingTensors`), so a
single compiled `sample` serves any mix of greedy and random rows, penalties,
biases and logprobs. A row's random key is a function of (seed, position of the
token being sampled) only, so a seeded request draws the same numbers alone or
in any batch, and after a preemption.

The order, as in vLLM: the allowed-token mask (a grammar's, `allowed_token_ids`); logit bias;
min_tokens (EOS and stop ids masked); repetition, frequency and presence penalties; then the
logits processors (llama.cpp's samplers, then the engine's registered ones); then greedy
rows take the argmax, and the others apply temperature, top-k, min-p and top-p and draw.
Logprobs are, as vLLM's by default, those of the model's own distribution (the logits as they
come out of the model); with `logprobs_mode="processed_logprobs"` those of the distribution the
token was drawn from: the processed logits at temperature 1 for greedy rows, the tempered and
filtered distribution otherwise. The `*_logits` modes report the logits themselves instead of
their log-softmax (vLLM's `raw_logits`, `processed_logits`). Prompt logprobs (`prompt_logprobs`)
are always the model's own. A row may also ask for more top logprobs than the MAX_LOGPROBS kept
per token (`needs_distribution`: its whole distribution, in the same mode) and for the entropy
of the model's distribution; both are computed only in a step where some row asks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.config.engine import LOGPROBS_MODES, MAX_LOGPROBS
from jaxserve.sample.logits_processors import Processors
from jaxserve.sample.tensors import PromptLogprobs, SampleOutput, SamplingTensors

GREEDY_TEMPERATURE = 1e-5  # at or below this, a row takes the argmax (vLLM's rule)
CANDIDATES = 64  # largest logits a row's top-k / top-p threshold is read from without sorting the vocab


def _rank(logprobs: jax.Array, chosen: jax.Array) -> jax.Array:
    """1 + how many tokens of each row are likelier than its chosen one (logprobs [N, V], chosen [N, 1])."""
    return 1 + jnp.sum(logprobs > chosen, axis=-1, dtype=jnp.int32)


def prompt_logprobs(head: Callable[[jax.Array], jax.Array], hidden: jax.Array, rows: jax.Array,
                    targets: jax.Array, chunk: int = 64, fixed: bool = False) -> PromptLogprobs:
    """hidden [T, D] (the last layer's output at each token), rows i32[T] (the tokens asked about,
    first), targets i32[T] (the prompt token that follows each of them; -1 past them) -> the
    log-softmax of `head(hidden[rows])` (the logits) at the targets, their ranks and the top K.
    Only the tokens asked about go through the LM head, `chunk` at a time: a step never holds more
    than [chunk, V] logits, and one with none asked about does no work here. A step of fewer than
    `chunk` tokens computes that many at a time, unless `fixed` (the batch-invariant mode: every
    chunk has one shape, and each row is normalised alone, so that a prompt token's logprob is its
    logprob when sampled)."""
    num_tokens, k = hidden.shape[0], min(MAX_LOGPROBS, jax.eval_shape(head, hidden[:1]).shape[-1])
    chunk = chunk if fixed else min(chunk, num_tokens)
    padded = -(-num_tokens // chunk) * chunk
    rows, targets = jnp.pad(rows, (0, padded - num_tokens)), jnp.pad(targets, (0, padded - num_tokens),
                                                                      constant_values=-1)

    def one_chunk(c, out: PromptLogprobs) -> PromptLogprobs:
        start = c * chunk
        wanted = jax.lax.dynamic_slice(targets, (start,), (chunk,))
        logits = head(hidden[jax.lax.dynamic_slice(rows, (start,), (chunk,))])
        # (fixed: row by row, as the batch-invariant sampler normalises a sampled token's row)
        logprobs = jax.lax.map(_log_softmax, logits[:, None])[:, 0] if fixed else _log_softmax(logits)
        chosen = jnp.take_along_axis(logprobs, jnp.maximum(wanted, 0)[:, None], axis=-1)
        top_logprobs, top_ids = jax.lax.top_k(logprobs, k)
        part = PromptLogprobs(logprobs=chosen[:, 0], ranks=_rank(logprobs, chosen), top_ids=top_ids.astype(jnp.int32),
                              top_logprobs=top_logprobs)
        return jax.tree.map(lambda o, p: jax.lax.dynamic_update_slice_in_dim(o, p, start, axis=0), out, part)

    empty = PromptLogprobs(logprobs=jnp.zeros(padded), ranks=jnp.zeros(padded, jnp.int32),
                           top_ids=jnp.zeros((padded, k), jnp.int32), top_logprobs=jnp.zeros((padded, k)))
    count = jnp.sum(targets >= 0)
    # (under a cond: XLA:CPU otherwise runs the chunk's top-k, a sort, even when the loop runs no chunk)
    out = jax.lax.cond(count > 0, lambda: jax.lax.fori_loop(0, -(-count // chunk), one_chunk, empty), lambda: empty)
    return jax.tree.map(lambda x: x[:num_tokens], out)


def _log_softmax(logits: jax.Array) -> jax.Array:
    """f32[N, V] logits -> their log-softmax along V (the prompt's and the sampled tokens' logprobs
    alike, so that both agree to the last bit)."""
    return logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)


def _row_key(seed_lo, seed_hi, position):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed_lo), seed_hi), position)


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """HF repetition penalty over prompt + output; OpenAI frequency and presence penalties over output."""
    num_rows, vocab = logits.shape
    rows = jnp.arange(num_rows)[:, None]
    is_output = jnp.arange(t.history.shape[1])[None, :] >= t.num_prompt[:, None]
    counts = jnp.zeros((num_rows, vocab), jnp.float32).at[rows, t.history].add(
        is_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((num_rows, vocab), bool).at[rows, t.history].set(True, mode="drop")
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - t.frequency_penalty[:, None] * counts - t.presence_penalty[:, None] * (counts > 0)


def apply_token_mask(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """-inf for the tokens a row's grammar does not allow (rows without a mask unchanged)."""
    vocab = jnp.arange(logits.shape[-1])
    allowed = (t.token_mask[:, vocab // 32] >> (vocab % 32)[None, :]) & 1
    return jnp.where(t.has_mask[:, None] & (allowed == 0), -jnp.inf, logits)


def process_logits(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Grammar mask, logit bias, min_tokens masking and penalties: everything before temperature."""
    logits = jax.lax.cond(jnp.any(t.has_mask), apply_token_mask, lambda x, _: x, logits, t)
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, t.bias_ids].add(t.bias_values, mode="drop")
    logits = logits.at[rows, t.suppress_ids].set(-jnp.inf, mode="drop")
    any_penalty = jnp.any((t.presence_penalty != 0) | (t.frequency_penalty != 0) | (t.repetition_penalty != 1))
    return jax.lax.cond(any_penalty, apply_penalties, lambda x, _: x, logits, t)


def sample(logits: jax.Array, t: SamplingTensors, logprobs_mode: str = "raw_logprobs", *,
           distributions: bool = False, processors: Processors | None = None) -> SampleOutput:
    """logits f32[B, V] -> the sampled tokens, their logprobs and the top logprobs of each row.

    No step sorts the vocabulary: greedy rows take the argmax; top-k, min-p and top-p become one
    logit threshold per row, read off the CANDIDATES largest logits (a full sort only for the rare row
    whose top-k or nucleus reaches past them); the draw inverts the CDF over the whole vocabulary.
    The top logprobs are computed only when some row asks for them. `logprobs_mode`: vLLM's, as the
    module's docstring says (processed: a token cut is -inf; the `*_logits` modes rank by logit).
    With `distributions` (static), each row that asks for more than K top logprobs also gets them
    for every token (`SampleOutput.distributions`). `processors`: the engine's logits processors
    (`t.processors` holds their rows)."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    processed = logprobs_mode.startswith("processed")
    raw_logits = logits
    keys = jax.vmap(_row_key)(t.seed_lo, t.seed_hi, t.position)
    logits = process_logits(logits, t)
    if processors:
        logits = processors.apply(logits, t.processors, t.history, t.num_prompt, keys)
    num_rows, vocab = logits.shape
    greedy = (t.temperature <= GREEDY_TEMPERATURE) | (t.top_k == 1)
    # (the scaled logits and those kept are computed where a conditional's branch needs them: made
    # here, each would be a [B, V] pass and temporary of every step, a greedy batch's too)
    def scaled():
        return logits / jnp.where(greedy, 1.0, t.temperature)[:, None]

    k = min(MAX_LOGPROBS, vocab)
    threshold, top_values, top_ids = _cut(scaled, greedy, t, k, t.wants_top & processed)

    def kept():
        return jnp.where(scaled() >= threshold, scaled(), -jnp.inf)

    def draw():
        log_norm = jax.nn.logsumexp(kept(), axis=-1, keepdims=True)
        return _inverse_cdf(jnp.exp(kept() - log_norm), jax.vmap(jax.random.uniform)(keys))

    drawn = jax.lax.cond(jnp.all(greedy), lambda: jnp.zeros(num_rows, jnp.int32), draw)  # all-greedy: no draw
    tokens = jnp.where(greedy, argmax(logits), drawn).astype(jnp.int32)
    carried = jnp.zeros((num_rows, 0), jnp.int32)
    if processors and processors.carried:  # (the drawn token's logprob where it was drawn: 0 for greedy rows)
        carries = jnp.any(jnp.stack([r.active for r, proc in zip(t.processors, processors.instances) if proc.carry]))
        drawn_logprob = jax.lax.cond(carries, lambda: jnp.take_along_axis(kept(), tokens[:, None], axis=-1)[:, 0]
                                     - jax.nn.logsumexp(kept(), axis=-1), lambda: jnp.zeros(num_rows))
        carried = processors.advance(t.processors, tokens, jnp.where(greedy, 0.0, drawn_logprob))
    if processed:  # (the top K: the candidates', cut where the row cuts)
        shift = jax.nn.logsumexp(kept(), axis=-1, keepdims=True) if logprobs_mode == "processed_logprobs" else 0.0
        scores, known_top = (lambda: kept() - shift), (jnp.where(top_values >= threshold, top_values - shift, -jnp.inf),
                                                      top_ids)
    else:
        scores, known_top = (lambda: _log_softmax(raw_logits) if logprobs_mode == "raw_logprobs" else raw_logits), None
    logprobs, ranks, top_logprobs, top_ids, whole = _scored(scores, tokens, t, k, known_top, distributions)
    entropies = jax.lax.cond(jnp.any(t.wants_entropy), lambda: entropy(raw_logits), lambda: jnp.zeros(num_rows))
    return SampleOutput(tokens=tokens, logprobs=logprobs, ranks=ranks, top_ids=top_ids, top_logprobs=top_logprobs,
                        entropies=entropies, carried=carried, distributions=whole)


ARGMAX_BLOCK = 256  # logits a block of argmax's first pass reduces


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1) of float32 x: the first maximum, the first NaN where there is one.

    On CPU in one pass over x (as XLA fuses it): each block's maximum and sum (a NaN always reaches a sum, not always
    a maximum), then the first block that holds the row's maximum, then the first index in that block
    alone; a batch with a NaN compares exact keys over the whole of x instead (`_order_keys`).
    XLA:CPU runs argmax's reduction of (value, index) pairs one element at a time, and a maximum
    followed by the least index that holds it keeps [B, V] temporaries: both 2-4x slower over a
    64 x 49152 batch of logits (bench/RESULTS.md, "The sampler's passes")."""
    if jax.default_backend() != "cpu":
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    rows, vocab = x.shape
    block = math.gcd(vocab, ARGMAX_BLOCK)  # (the largest power of two that divides V, up to 256)
    if block < 16:
        return _exact_argmax(x)
    blocks = x.reshape(rows, vocab // block, block)
    peaks, sums = jnp.max(blocks, axis=-1), jnp.sum(blocks, axis=-1)

    def by_blocks(x):
        best = jnp.max(peaks, axis=-1, keepdims=True)
        first = _first_index(peaks, best)
        return first * block + _first_index(jnp.take_along_axis(blocks, first[:, None, None], axis=1)[:, 0], best)

    return jax.lax.cond(jnp.any(jnp.isnan(sums)), _exact_argmax, by_blocks, x)


def _exact_argmax(x: jax.Array) -> jax.Array:
    """`argmax` by exact keys over the whole of x."""
    keys = _order_keys(x)
    return _first_index(keys, jnp.max(keys, axis=-1, keepdims=True))


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> int32 keys in the values' order, ties kept (-0 is 0) and any NaN above +inf: exact
    to compare (XLA:CPU's float max may drop a NaN)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    keys = jnp.where(x == 0, 0, bits ^ ((bits >> 31) & 0x7FFFFFFF))
    return jnp.where(jnp.isnan(x), jnp.iinfo(jnp.int32).max, keys)


def _first_index(x: jax.Array, best: jax.Array) -> jax.Array:
    """The least index of each row of x that holds `best`."""
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == best, ids, x.shape[-1]), axis=-1)


def _cut(scaled: Callable[[], jax.Array], greedy: jax.Array, t: SamplingTensors, k: int, want_top: jax.Array
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The scaled logits f32[B, V] (`scaled()`) -> (f32[B, 1] the logit each row keeps at or above:
    its top-k, min-p and top-p cut, -inf where it cuts nothing; f32[B, k] the top k scaled logits and
    i32[B, k] their ids, computed only where a row cuts or `want_top`)."""
    num_rows, vocab = jax.eval_shape(scaled).shape
    filters = ~greedy & ((t.top_k < vocab) | (t.top_p < 1.0) | (t.min_p > 0.0))
    candidates = min(CANDIDATES, vocab)

    def top(c: int):
        values, ids = jax.lax.top_k(scaled(), c)
        threshold, exact = _threshold(scaled(), values, t)
        return threshold, exact, values[:, :k], ids[:, :k].astype(jnp.int32)

    def no_top():
        return (jnp.full(num_rows, -jnp.inf), jnp.ones(num_rows, bool), jnp.full((num_rows, k), -jnp.inf),
                jnp.zeros((num_rows, k), jnp.int32))

    threshold, exact, top_values, top_ids = jax.lax.cond(jnp.any(filters | want_top), lambda: top(candidates), no_top)
    if candidates < vocab:  # a top-k or nucleus past the candidates: that batch sorts the vocabulary
        threshold = jax.lax.cond(jnp.all(exact | ~filters), lambda: threshold, lambda: top(vocab)[0])
    return jnp.where(filters, threshold, -jnp.inf)[:, None], top_values, top_ids


def entropy(logits: jax.Array) -> jax.Array:
    """f32[B, V] logits -> f32[B] the entropy of their softmax, in nats (a token at -inf adds nothing)."""
    logprobs = _log_softmax(logits)
    return -jnp.sum(jnp.where(jnp.isneginf(logprobs), 0.0, jnp.exp(logprobs) * logprobs), axis=-1)


def _scored(scores: Callable[[], jax.Array], tokens: jax.Array, t: SamplingTensors, k: int,
            known_top: tuple[jax.Array, jax.Array] | None, distributions: bool) -> tuple:
    """What the logprobs mode reports of the sampled tokens, from `scores()` (f32[B, V], its value of
    every token): (f32[B] the tokens' values, i32[B] their ranks, f32[B, k] the top k values,
    i32[B, k] their ids, f32[B, V] every token's for the rows that ask for it, or None without
    `distributions`). The top k are `known_top` where given. Computed only when some row asks for
    logprobs (else values and ranks 0, top values -inf, distributions 0)."""
    num_rows = tokens.shape[0]

    def no_top():
        return jnp.full((num_rows, k), -jnp.inf), jnp.zeros((num_rows, k), jnp.int32)

    def top_k(values):
        top_values, top_ids = jax.lax.top_k(values, k)
        return top_values, top_ids.astype(jnp.int32)

    def scored():
        values = scores()
        chosen = jnp.take_along_axis(values, tokens[:, None], axis=-1)
        top = known_top if known_top is not None else jax.lax.cond(jnp.any(t.wants_top), lambda: top_k(values),
                                                                    no_top)
        whole = jax.lax.cond(jnp.any(t.wants_distribution), lambda: values,
                             lambda: jnp.zeros_like(values)) if distributions else None
        return chosen[:, 0], _rank(values, chosen), *top, whole

    def unscored():
        whole = jnp.zeros(jax.eval_shape(scores).shape) if distributions else None
        return jnp.zeros(num_rows), jnp.zeros(num_rows, jnp.int32), *no_top(), whole

    return jax.lax.cond(jnp.any(t.wants_rank), scored, unscored)


def _threshold(scaled: jax.Array, values: jax.Array, t: SamplingTensors) -> tuple[jax.Array, jax.Array]:
    """The logit each row keeps at or above, from its C largest scaled logits `values` (descending):
    top-k, then min-p (relative to the best token), then top-p over what is left (the smallest prefix
    whose mass reaches top_p); min-p and top-p keep at least `min_keep` tokens (llama.cpp's), top-k
    does not. -> (f32[B] threshold, bool[B] whether C candidates were enough)."""
    num_rows, c = values.shape
    vocab = scaled.shape[-1]
    rows = jnp.arange(num_rows)
    off = t.top_k >= vocab
    top_k = jnp.where(off, -jnp.inf, values[rows, jnp.clip(t.top_k, 1, c) - 1])
    keep = jnp.where(t.min_keep > 0, values[rows, jnp.clip(t.min_keep, 1, c) - 1], jnp.inf)  # the min_keep-th best
    min_p = jnp.minimum(values[:, 0] + jnp.log(t.min_p), keep)  # p / p_max >= min_p
    kept = jnp.maximum(top_k, min_p)
    log_norm = jax.nn.logsumexp(jnp.where(scaled >= kept[:, None], scaled, -jnp.inf), axis=-1)
    probs = jnp.where(values >= kept[:, None], jnp.exp(values - log_norm[:, None]), 0.0)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better candidates
    last = jnp.sum((before < t.top_p[:, None]) & (probs > 0), axis=-1) - 1
    nucleus = jnp.where(t.top_p >= 1.0, -jnp.inf, jnp.minimum(values[rows, jnp.maximum(last, 0)], keep))
    all_kept = jnp.sum(scaled >= kept[:, None], axis=-1) <= c
    exact = (off | (t.top_k <= c)) & ((t.top_p >= 1.0) | (probs.sum(-1) >= t.top_p) | all_kept) & (t.min_keep <= c)
    return jnp.maximum(kept, nucleus), exact


def _inverse_cdf(probs: jax.Array, u: jax.Array, block: int = 128) -> jax.Array:
    """For each row, the token at which the cumulative distribution passes u * total: a draw from
    `probs` (f32[B, V], unnormalised) with u ~ U[0, 1), by blocks of the vocabulary so that no
    cumulative sum runs over it whole. Never returns a zero-probability token."""
    num_rows, vocab = probs.shape
    padded = jnp.pad(probs, ((0, 0), (0, -vocab % block))).reshape(num_rows, -1, block)
    block_mass = padded.sum(-1)
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    target = u * block_cdf[:, -1]
    last_block = jnp.max(jnp.where(block_mass > 0, jnp.arange(block_mass.shape[1]), 0), axis=-1)
    chosen = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), last_block)
    rows = jnp.arange(num_rows)
    inside = padded[rows, chosen]  # [B, block]
    remainder = target - (block_cdf[rows, chosen] - block_mass[rows, chosen])
    last_token = jnp.max(jnp.where(inside > 0, jnp.arange(block), 0), axis=-1)
    offset = jnp.minimum(jnp.sum(jnp.cumsum(inside, axis=-1) <= remainder[:, None], axis=-1), last_token)
    return chosen * block + offset
