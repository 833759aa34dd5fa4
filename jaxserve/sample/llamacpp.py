"""llama.cpp's samplers (its src/llama-sampling.cpp) as logits processors every engine runs: DRY,
top-n-sigma, locally typical sampling, XTC, dynamic temperature and mirostat 1 and 2, each set by
the SamplingParams fields of llama.cpp's names and off at their defaults.

They run in llama.cpp's default order relative to each other (its common/common.h: penalties, dry,
top-n-sigma, top-k, typical, top-p, min-p, xtc, temperature; mirostat after temperature in place of
the truncations), after jaxserve's mask, bias, min_tokens and penalties and before temperature
(`sampling.sample`), ahead of the engine's registered processors. Where the result differs from
llama.cpp's, and why:

1. top-k, top-p and min-p come after temperature (vLLM's order), so after all of these: typical, XTC
   and dynamic temperature see the distribution before them, where llama.cpp's see it after. A
   request that leaves them off gets llama.cpp's result.
2. Temperature is a division that `sample` makes after the processors: dynamic temperature scales
   the logits by temperature / its own temperature, so that the division gives llama.cpp's. Greedy
   rows (temperature 0) stay greedy, where llama.cpp samples at up to dynatemp_range.
3. Mirostat truncates the tempered distribution (llama.cpp chains temperature then mirostat), and
   the request's other settings then apply as they do without it; llama.cpp's mirostat replaces its
   chain (penalties, DRY and truncations are not run). The same where the others are left off.
4. DRY's sequence breakers are their tokens (`encode`, as llama.cpp tokenizes a breaker's tail);
   llama.cpp also counts every token whose text contains a breaker as one, found by a scan of the
   vocabulary. A breaker is matched by its first BREAKER_TOKENS tokens (llama.cpp: 1 + 20).
5. A token already cut (-inf) is no candidate: it adds nothing to an entropy or a count of tokens
   (llama.cpp keeps the tokens top-n-sigma sets to -inf in its list, with probability 0).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sample.logits_processors import LogitsProcessor
from jaxserve.sample.params import MAX_DRY_BREAKERS
from jaxserve.sample.sampler import GREEDY_TEMPERATURE, argmax

BREAKER_TOKENS = 21  # a DRY breaker's head token and the tail llama.cpp keeps (20 tokens)
FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value: DRY's exponent stops where its power would overflow
MIROSTAT_M = 100  # mirostat 1 fits Zipf's exponent to this many of the most likely tokens (llama.cpp's m)


def _entropy(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log-probabilities [rows, V], entropy in nats [rows], tokens not cut [rows]) of each row."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    cut = logits == -jnp.inf
    return logp, -jnp.sum(jnp.where(cut, 0.0, jnp.exp(logp) * logp), axis=-1), jnp.sum(~cut, axis=-1)


class LlamaCppSampler(LogitsProcessor):
    """A built-in processor: its arguments come from SamplingParams fields (`request_args`), never
    from extra_args."""

    def row_args(self, extra_args: dict) -> None:
        return None


class Dry(LlamaCppSampler):
    """DRY ("don't repeat yourself"): a token that would extend a repeat of the context's end past
    dry_allowed_length tokens loses dry_multiplier * dry_base ** (repeat length - dry_allowed_length)
    from its logit (the exponent stops growing where the power would overflow float32). The repeat is
    the longest run of tokens ending the window (the last dry_penalty_last_n tokens; -1: the whole
    context, prompt included) that also ends earlier in the window, followed there by the token. It
    reaches back no further than the last sequence breaker, and a single-token breaker is never
    penalised."""

    history = True
    args = {"dry_multiplier": np.float32(0), "dry_base": np.float32(1.75), "dry_allowed_length": np.int32(2),
            "dry_penalty_last_n": np.int32(-1),
            # each breaker's tokens, -1 after its last (a row of -1: none)
            "dry_breakers": np.full((MAX_DRY_BREAKERS, BREAKER_TOKENS), -1, np.int32)}

    def request_args(self, params, encode=None) -> dict | None:
        if params.dry_multiplier == 0 or params.dry_penalty_last_n == 0:
            return None
        breakers = np.full((MAX_DRY_BREAKERS, BREAKER_TOKENS), -1, np.int32)
        if params.dry_sequence_breakers and encode is None:
            raise ValueError("DRY's sequence breakers need the tokenizer (encode)")
        for b, text in enumerate(params.dry_sequence_breakers):
            ids = list(encode(text))[:BREAKER_TOKENS]  # (a breaker without tokens matches nothing)
            breakers[b, :len(ids)] = ids
        return {"dry_multiplier": params.dry_multiplier, "dry_base": params.dry_base,
                "dry_allowed_length": params.dry_allowed_length, "dry_penalty_last_n": params.dry_penalty_last_n,
                "dry_breakers": breakers}

    def apply(self, logits, args, active):
        history = args["history"]
        num_rows, vocab = logits.shape
        rows = jnp.arange(num_rows)[:, None]
        allowed, base = args["dry_allowed_length"], args["dry_base"]
        length = jnp.sum(history < vocab, axis=1)  # prompt + generated so far
        last_n = jnp.where(args["dry_penalty_last_n"] > 0, jnp.minimum(args["dry_penalty_last_n"], length), length)
        back = _reversed_window(history, length, last_n)
        limit = _repeat_limit(back, args["dry_breakers"], last_n)
        max_exponent = jnp.where(base > 1.000001, jnp.floor(FLOAT_MAX_LOG / jnp.log(base)), 0).astype(jnp.int32)
        on = active & (last_n > allowed) & (limit >= allowed)
        # (past allowed + max_exponent a longer repeat costs no more: no need to measure it)
        cap = jnp.where(max_exponent > 0, jnp.minimum(limit, allowed + max_exponent), limit)
        lengths = _repeat_lengths(back, last_n, cap, on)
        # the token that followed each earlier repeat: lengths[:, k] ends k tokens back, so back[:, k - 1]
        follower = jnp.pad(back, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
        k = jnp.arange(back.shape[1])[None, :]
        counted = on[:, None] & (k >= 1) & (k < last_n[:, None]) & (lengths >= allowed[:, None]) & (follower >= 0)
        longest = jnp.full((num_rows, vocab), -1, jnp.int32).at[rows, jnp.where(counted, follower, vocab)].max(
            lengths, mode="drop")  # i32[rows, V] the longest repeat each token would extend (-1: none)
        breakers = args["dry_breakers"]
        single = jnp.sum(breakers >= 0, axis=-1) == 1
        is_single = jnp.zeros((num_rows, vocab), bool).at[rows, jnp.where(single, breakers[:, :, 0], vocab)].set(
            True, mode="drop")
        exponent = longest - allowed[:, None]
        exponent = jnp.where(max_exponent[:, None] > 0, jnp.minimum(exponent, max_exponent[:, None]), exponent)
        penalty = args["dry_multiplier"][:, None] * base[:, None] ** exponent.astype(jnp.float32)
        return logits - jnp.where((longest >= 0) & ~is_single, penalty, 0.0)


def _reversed_window(history: jax.Array, length: jax.Array, last_n: jax.Array) -> jax.Array:
    """i32[rows, H]: [:, i] the token i places before the last one of the history (0: the last), -1
    past the window of the last `last_n`."""
    i = jnp.arange(history.shape[1])[None, :]
    back = jnp.take_along_axis(history, jnp.clip(length[:, None] - 1 - i, 0, history.shape[1] - 1), axis=1)
    return jnp.where(i < last_n[:, None], back, -1)


def _repeat_limit(back: jax.Array, breakers: jax.Array, last_n: jax.Array) -> jax.Array:
    """i32[rows]: how many of the last tokens a repeat may span: those after the latest sequence
    breaker in the window (the longest breaker where several end at the same place), else the window."""
    num_rows, width = back.shape
    tail = jnp.sum(breakers >= 0, axis=-1) - 1  # [rows, MAX_DRY_BREAKERS] tokens after the head (-1: unused)
    i = jnp.arange(width)[None, None, :]
    match = (back[:, None, :] == breakers[:, :, :1]) & (tail[:, :, None] >= 0) & (tail[:, :, None] <= i)
    padded = jnp.pad(back, ((0, 0), (BREAKER_TOKENS, 0)), constant_values=-1)

    def tail_token(o, match):  # the tail's token o comes o + 1 tokens after the head: back[:, i - 1 - o]
        after = jax.lax.dynamic_slice_in_dim(padded, BREAKER_TOKENS - 1 - o, width, axis=1)
        token = jax.lax.dynamic_index_in_dim(breakers, o + 1, axis=2)  # [rows, MAX_DRY_BREAKERS, 1]
        return match & ((tail[:, :, None] <= o) | (after[:, None, :] == token))

    match = jax.lax.fori_loop(0, jnp.max(tail), tail_token, match)  # (single-token breakers: no iteration)
    longest = jnp.max(jnp.where(match, tail[:, :, None], -1), axis=1)  # [rows, H] per head position
    found = longest >= 0
    latest = jnp.argmax(found, axis=1)
    return jnp.where(jnp.any(found, axis=1), latest - jnp.take_along_axis(longest, latest[:, None], 1)[:, 0], last_n)


def _repeat_lengths(back: jax.Array, last_n: jax.Array, cap: jax.Array, on: jax.Array) -> jax.Array:
    """i32[rows, H]: [:, k] for 1 <= k < last_n, how many tokens ending k tokens back equal the
    window's last ones (as many, up to `cap`), for the rows `on`; one pass per repeated token."""
    num_rows, width = back.shape
    k = jnp.arange(width)[None, :]
    padded = jnp.pad(back, ((0, 0), (0, width)), constant_values=-1)

    def extend(state):  # does the repeat reach one token further: back[:, n] == back[:, n + k]?
        n, alive, lengths = state
        same = jax.lax.dynamic_slice_in_dim(padded, n, width, axis=1) == jax.lax.dynamic_index_in_dim(back, n, 1)
        alive = alive & same
        return n + 1, alive & (n + 1 < cap[:, None]), lengths + alive

    alive = on[:, None] & (k >= 1) & (k < last_n[:, None]) & (cap[:, None] > 0)
    start = (jnp.int32(0), alive, jnp.zeros((num_rows, width), jnp.int32))
    return jax.lax.while_loop(lambda state: jnp.any(state[1]), extend, start)[2]


class TopNSigma(LlamaCppSampler):
    """Top-n-sigma: keeps the tokens whose logit is within top_n_sigma standard deviations of the
    largest (mean and deviation over the tokens not cut)."""

    args = {"top_n_sigma": np.float32(-1)}

    def request_args(self, params, encode=None) -> dict | None:
        return {"top_n_sigma": params.top_n_sigma} if params.top_n_sigma > 0 else None

    def apply(self, logits, args, active):
        kept = logits > -jnp.inf
        count = jnp.maximum(jnp.sum(kept, axis=-1, keepdims=True), 1)
        mean = jnp.sum(jnp.where(kept, logits, 0.0), axis=-1, keepdims=True) / count
        std = jnp.sqrt(jnp.sum(jnp.where(kept, (logits - mean) ** 2, 0.0), axis=-1, keepdims=True) / count)
        floor = jnp.max(logits, axis=-1, keepdims=True) - args["top_n_sigma"][:, None] * std
        return jnp.where(logits < floor, -jnp.inf, logits)


class Typical(LlamaCppSampler):
    """Locally typical sampling: ranks the tokens by how far their surprise (-log p) is from the
    distribution's entropy and keeps them in that order until the kept mass passes typical_p
    (at least min_keep of them, and at least one)."""

    args = {"typical_p": np.float32(1), "min_keep": np.int32(0)}

    def request_args(self, params, encode=None) -> dict | None:
        return {"typical_p": params.typical_p, "min_keep": params.min_keep} if params.typical_p < 1 else None

    def apply(self, logits, args, active):
        num_rows, vocab = logits.shape
        logp, entropy, _ = _entropy(logits)
        distance = jnp.where(logits == -jnp.inf, jnp.inf, jnp.abs(-logp - entropy[:, None]))
        order = jnp.argsort(distance, axis=-1)  # most typical first (a sort of the vocabulary)
        probs = jnp.take_along_axis(jnp.exp(logp), order, axis=-1)
        before = jnp.pad(jnp.cumsum(probs, axis=-1)[:, :-1], ((0, 0), (1, 0)))  # the mass ranked ahead of each
        rank = jnp.arange(vocab)[None, :]
        kept = (rank < jnp.maximum(args["min_keep"], 1)[:, None]) | (before <= args["typical_p"][:, None])
        kept = jnp.zeros((num_rows, vocab), bool).at[jnp.arange(num_rows)[:, None], order].set(kept)
        return jnp.where(kept, logits, -jnp.inf)


class Xtc(LlamaCppSampler):
    """XTC ("exclude top choices"): with probability xtc_probability (a draw of the row's own, a
    function of its seed and position), removes the tokens of probability >= xtc_threshold but the
    least likely of them, where there are two or more and at least min_keep tokens remain (ties with
    that least likely one all stay)."""

    random = True
    args = {"xtc_probability": np.float32(0), "xtc_threshold": np.float32(0.1), "min_keep": np.int32(0)}

    def request_args(self, params, encode=None) -> dict | None:
        if params.xtc_probability <= 0 or params.xtc_threshold > 0.5:  # (above 0.5 no two tokens can be)
            return None
        return {"xtc_probability": params.xtc_probability, "xtc_threshold": params.xtc_threshold,
                "min_keep": params.min_keep}

    def apply(self, logits, args, active):
        probs = jax.nn.softmax(logits, axis=-1)
        count = jnp.sum(logits > -jnp.inf, axis=-1)
        top = probs >= args["xtc_threshold"][:, None]
        removed = jnp.sum(top, axis=-1) - 1
        least = jnp.min(jnp.where(top, probs, jnp.inf), axis=-1, keepdims=True)
        coin = jax.vmap(jax.random.uniform)(args["key"]) <= args["xtc_probability"]
        on = coin & (count >= 2) & (removed > 0) & (count - removed >= args["min_keep"])
        return jnp.where(on[:, None] & top & (probs > least), -jnp.inf, logits)


class DynamicTemperature(LlamaCppSampler):
    """Dynamic temperature (llama.cpp's temp-ext): a temperature between max(0, temperature -
    dynatemp_range) and temperature + dynatemp_range, placed by the distribution's entropy as a
    fraction of the largest possible (log of the tokens not cut), raised to dynatemp_exponent.
    `sample` divides by the row's temperature afterwards, so the logits are scaled here by
    temperature / that temperature (at 0, only the top token stays). Greedy rows stay greedy."""

    args = {"temperature": np.float32(1), "dynatemp_range": np.float32(0), "dynatemp_exponent": np.float32(1)}

    def request_args(self, params, encode=None) -> dict | None:
        if params.dynatemp_range <= 0 or params.temperature <= GREEDY_TEMPERATURE:
            return None
        return {"temperature": params.temperature, "dynatemp_range": params.dynatemp_range,
                "dynatemp_exponent": params.dynatemp_exponent}

    def apply(self, logits, args, active):
        temperature, spread = args["temperature"], args["dynatemp_range"]
        low, high = jnp.maximum(0.0, temperature - spread), temperature + spread
        _, entropy, count = _entropy(logits)
        fraction = entropy / jnp.log(jnp.maximum(count, 2).astype(jnp.float32))
        dynamic = low + (high - low) * fraction ** args["dynatemp_exponent"]
        top = jnp.arange(logits.shape[-1])[None, :] == argmax(logits)[:, None]
        scaled = jnp.where(dynamic[:, None] > 0, logits * (temperature / jnp.maximum(dynamic, 1e-30))[:, None],
                           jnp.where(top, logits, -jnp.inf))
        return jnp.where(count[:, None] > 1, scaled, logits)  # (one candidate: nothing to scale)


class Mirostat(LlamaCppSampler):
    """Mirostat 1 and 2: truncates the tempered distribution (logits / temperature) so that the
    surprise of the drawn tokens (-log2 p) tracks mirostat_tau. Version 2 keeps the tokens of surprise
    at most mu (the top one at least); version 1 the k most likely, k from Zipf's exponent s fitted
    to the MIROSTAT_M most likely tokens: k = (e * 2**mu / (1 - N**-e)) ** (1 / s), e = s - 1, N
    the vocabulary. mu starts at 2 * tau and after each token moves by mirostat_eta times the
    token's surprise past tau, the surprise under the distribution it was drawn from (`advance`;
    greedy rows: 0). Greedy rows are left as they are."""

    args = {"mirostat": np.int32(0), "temperature": np.float32(1), "mirostat_tau": np.float32(5),
            "mirostat_eta": np.float32(0.1), "mirostat_mu": np.float32(10)}
    carry = ("mirostat_mu",)

    def request_args(self, params, encode=None) -> dict | None:
        if not params.mirostat:
            return None
        return {"mirostat": params.mirostat, "temperature": params.temperature, "mirostat_tau": params.mirostat_tau,
                "mirostat_eta": params.mirostat_eta, "mirostat_mu": 2 * params.mirostat_tau}

    def apply(self, logits, args, active):
        sampled = args["temperature"] > GREEDY_TEMPERATURE
        tempered = logits / jnp.where(sampled, args["temperature"], 1.0)[:, None]
        logp = jax.nn.log_softmax(tempered, axis=-1)
        mu = args["mirostat_mu"][:, None]
        version2 = (logp >= -mu * math.log(2)) | (tempered == jnp.max(tempered, axis=-1, keepdims=True))
        version1 = tempered >= self._zipf_threshold(tempered, args["mirostat_mu"], args["mirostat"] == 1)[:, None]
        kept = jnp.where((args["mirostat"] == 1)[:, None], version1, version2)
        return jnp.where(sampled[:, None] & ~kept, -jnp.inf, logits)

    def _zipf_threshold(self, tempered: jax.Array, mu: jax.Array, rows: jax.Array) -> jax.Array:
        """f32[rows]: mirostat 1's cut, the k-th largest tempered logit (for the `rows` that use it)."""
        vocab = tempered.shape[-1]
        m = min(MIROSTAT_M, vocab)
        values = jax.lax.top_k(tempered, m)[0]
        i = jnp.arange(m - 1, dtype=jnp.float32)
        t = jnp.log((i + 2) / (i + 1))
        b = values[:, :-1] - values[:, 1:]  # log(p_i / p_i+1)
        pairs = values[:, 1:] > -jnp.inf  # (only pairs of tokens not cut)
        s = jnp.sum(jnp.where(pairs, t * b, 0.0), axis=-1) / jnp.sum(jnp.where(pairs, t * t, 0.0), axis=-1)
        e = s - 1
        k = (e * 2.0 ** mu / (1 - jnp.float32(self.vocab_size) ** -e)) ** (1 / s)
        k = jnp.clip(jnp.floor(jnp.nan_to_num(k, nan=1.0, posinf=vocab)), 1, vocab).astype(jnp.int32)

        def kth(ranked):
            return jnp.take_along_axis(ranked, jnp.minimum(k, ranked.shape[-1])[:, None] - 1, axis=-1)[:, 0]

        # (a k past the m candidates: that step sorts the vocabulary)
        return jax.lax.cond(jnp.all(~rows | (k <= m)), lambda: kth(values), lambda: kth(-jnp.sort(-tempered)))

    def advance(self, args, tokens, logprobs):
        surprise = -logprobs / math.log(2)
        return {"mirostat_mu": args["mirostat_mu"] - args["mirostat_eta"] * (surprise - args["mirostat_tau"])}


# in llama.cpp's order (the module's docstring)
BUILTIN_SAMPLERS = (Dry, TopNSigma, Typical, Xtc, DynamicTemperature, Mirostat)
