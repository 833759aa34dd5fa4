"""The batched sampler on fixed logits, and seeded sampling through the engine."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import scipy.stats
from conftest import CROWDED_ENGINE

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import MAX_LOGPROBS
from jaxserve.sample.params import RequestSampling
from jaxserve.sample.sampler import argmax, entropy, sample
from jaxserve.sample.tensors import SampleOutput, SamplingRow, SamplingTensors

VOCAB = 12
LOGITS = np.random.default_rng(0).normal(0.0, 1.5, size=VOCAB).astype(np.float32)
ROWS = 4000
_jit_sample = jax.jit(sample, static_argnames=("logprobs_mode", "distributions"))


def tensors(params: list[SamplingParams], seeds: list[int], positions: list[int], num_rows: int,
            histories: list[list[int]] | None = None, num_prompt: int = 0, vocab: int = VOCAB) -> SamplingTensors:
    histories = histories or [[]] * len(params)
    rows = [SamplingRow(p, seed, pos, h, num_prompt, RequestSampling.of(p, list, vocab).allowed_mask)
            for p, seed, pos, h in zip(params, seeds, positions, histories)]
    return SamplingTensors.from_rows(rows, num_rows, vocab, history_len=32)


def _sample(logits, t, logprobs_mode: str = "raw_logprobs"):
    out = _jit_sample(logits, t, logprobs_mode)
    return out.tokens, out.logprobs


def draw(params: SamplingParams, rows: int = ROWS, logits: np.ndarray = LOGITS) -> np.ndarray:
    """`rows` draws from the same logits: one row each, distinct seeds."""
    t = tensors([params] * rows, list(range(rows)), [7] * rows, rows, vocab=len(logits))
    tokens, logprobs = _sample(np.tile(logits, (rows, 1)), t)
    return np.asarray(tokens)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def test_greedy_rows_take_the_argmax():
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=1)):
        assert set(draw(params, rows=64)) == {int(np.argmax(LOGITS))}


@pytest.mark.parametrize("nans", [False, True])  # (a batch with a NaN takes the exact form)
@pytest.mark.parametrize("width", [3, 1000, 2368, 4096])  # the exact form (blocks under 16), blocks of 64, 256
def test_argmax_is_jnps_on_ties_infinities_and_nans(width, nans):
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, size=(64, width)).astype(np.float32)  # (many ties for the maximum, across blocks)
    x[1] = -np.inf
    x[2, [0, width - 1]] = np.inf
    x[3] = -1.0
    x[3, width // 2], x[3, -1] = -0.0, 0.0  # (equal: the first)
    x[5, -1] = 99.0
    if nans:
        x[4, 0] = np.nan
        x[6, [width // 2, width - 1]] = np.nan
        x[7, width // 3] = 99.0
        x[7, -1] = np.nan  # (a NaN after the maximum, in another block)
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(x)), np.argmax(x, axis=-1))


def test_top_k_support():
    tokens = draw(SamplingParams(temperature=1.0, top_k=3))
    assert set(tokens) == set(np.argsort(-LOGITS)[:3].tolist())


def test_top_p_support():
    probs = softmax(LOGITS)
    order = np.argsort(-probs)
    top_p = 0.7
    # the smallest prefix whose mass reaches top_p
    allowed = set(order[: int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1].tolist())
    tokens = draw(SamplingParams(temperature=1.0, top_p=top_p))
    assert set(tokens) == allowed


def test_min_p_support():
    probs = softmax(LOGITS)
    allowed = set(np.flatnonzero(probs >= 0.2 * probs.max()).tolist())
    assert set(draw(SamplingParams(temperature=1.0, min_p=0.2))) == allowed


def test_each_row_keeps_its_own_settings():
    rows = [SamplingParams(temperature=0.0), SamplingParams(top_k=2), SamplingParams(top_p=0.3),
            SamplingParams(min_p=0.5), SamplingParams(temperature=1.0)]
    reps = 400
    params = [p for p in rows for _ in range(reps)]
    t = tensors(params, list(range(len(params))), [3] * len(params), len(params))
    tokens = np.asarray(_sample(np.tile(LOGITS, (len(params), 1)), t)[0]).reshape(len(rows), reps)
    order = np.argsort(-LOGITS)
    probs = softmax(LOGITS)
    assert set(tokens[0]) == {order[0]}
    assert set(tokens[1]) == set(order[:2])
    assert set(tokens[2]) <= set(order[: int(np.searchsorted(np.cumsum(probs[order]), 0.3)) + 1])
    assert set(tokens[3]) == set(np.flatnonzero(probs >= 0.5 * probs.max()))
    assert len(set(tokens[4])) > 4


def assert_distribution(tokens: np.ndarray, probs: np.ndarray) -> None:
    """Chi-square of the drawn tokens against `probs` (cells expecting < 5 draws pooled), and no
    token outside the support."""
    expected = probs * len(tokens)
    observed = np.bincount(tokens, minlength=len(probs))
    assert observed[probs == 0].sum() == 0
    keep = expected >= 5  # chi-square needs enough expected counts per cell
    pooled_obs = np.append(observed[keep], observed[~keep].sum())
    pooled_exp = np.append(expected[keep], expected[~keep].sum())
    if pooled_exp[-1] == 0:
        pooled_obs, pooled_exp = pooled_obs[:-1], pooled_exp[:-1]
    assert scipy.stats.chisquare(pooled_obs, pooled_exp).pvalue > 1e-3


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_distribution_matches_tempered_softmax(temperature):
    tokens = draw(SamplingParams(temperature=temperature), rows=20000)
    assert_distribution(tokens, softmax(LOGITS / temperature))


WIDE = np.random.default_rng(1).normal(0.0, 0.7, size=700).astype(np.float32)  # > CANDIDATES, not blocks of 128


def filtered(probs: np.ndarray, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """float64 reference of the filters: top-k, then min-p, then the smallest top_p prefix, renormalised."""
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), bool)
    keep[order[:top_k or len(probs)]] = True
    keep &= probs >= min_p * probs.max()
    p = np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()
    before = np.cumsum(p[order]) - p[order]
    keep[order[before >= top_p]] = False
    return np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()


@pytest.mark.parametrize("settings", [dict(), dict(top_k=10), dict(top_k=200), dict(top_p=0.05), dict(top_p=0.9),
                                      dict(min_p=0.3), dict(top_k=300, top_p=0.8, min_p=0.2)],
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "plain")
def test_wide_vocab_filters_match_float64(settings):
    """A 700-token vocabulary: thresholds read off the 64 candidates (top_k=10, top_p=0.05, min_p), or
    from a full sort when top-k or the nucleus reaches past them (top_k=200, top_p=0.9)."""
    tokens = draw(SamplingParams(temperature=1.0, **settings), rows=20000, logits=WIDE)
    assert_distribution(tokens, filtered(softmax(WIDE), **settings))


def test_key_depends_on_seed_and_position_only():
    params = SamplingParams(temperature=1.0)
    a = tensors([params] * 3, [5, 5, 6], [10, 11, 10], 3)
    b = tensors([params] * 8, [9, 5, 1, 1, 1, 1, 1, 1], [0, 10, 0, 0, 0, 0, 0, 0], 8)
    flat = np.random.default_rng(1).normal(0, 3, size=(8, VOCAB)).astype(np.float32)
    logits = np.tile(flat[1], (8, 1))
    ta, _ = _sample(logits[:3], a)
    tb, _ = _sample(logits, b)
    assert int(ta[0]) == int(tb[1])  # same (seed, position), different row and batch
    # 64 seeds, each drawn in row 0 of a batch of 1 and in row 5 of a batch of 8: identical
    alone = [int(_sample(logits[:1], tensors([params], [s], [4], 1))[0][0])
             for s in range(64)]
    batched = [int(_sample(logits, tensors([params] * 8, [0] * 5 + [s, 1, 2], [9] * 5 + [4, 0, 0],
                                                             8))[0][5]) for s in range(64)]
    assert alone == batched and len(set(alone)) > 1
    draws = [int(_sample(logits[:1], tensors([params], [s], [10], 1))[0][0])
             for s in range(40)]
    assert len(set(draws)) > 1  # different seeds do differ


def test_seed_reproducible_alone_and_in_a_batch_of_16():
    llm = LLM("jaxserve-tiny", **CROWDED_ENGINE)  # (the batch of 16 does not fit its pages: some are preempted)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate(["the same prompt"], seeded)[0].outputs[0].token_ids
    rng = np.random.default_rng(5)
    others = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(1, 40, size=15)]
    batch = llm.generate(others[:7] + ["the same prompt"] + others[7:],
                         [SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)] * 7 + [seeded]
                         + [SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)] * 8)
    assert batch[7].outputs[0].token_ids == alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.generate(["the same prompt"], seeded)[0].outputs[0].token_ids == alone
    reseeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1235, ignore_eos=True)
    assert llm.generate(["the same prompt"], reseeded)[0].outputs[0].token_ids != alone  # the seed decides
    unseeded = llm.generate(["the same prompt"] * 2, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_sampling_params_validation():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2.0),
                dict(max_tokens=0), dict(stop_token_ids=[-1]), dict(seed="x")):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    # vLLM's constructors: None for the default; an independent copy
    assert SamplingParams.from_optional(temperature=None, top_k=5, stop=None) == SamplingParams(top_k=5)
    params = SamplingParams(stop=["x"], logit_bias={3: 1.0})
    copied = params.clone()
    copied.stop.append("y")
    assert copied == SamplingParams(stop=["x", "y"], logit_bias={3: 1.0}) and params.stop == ["x"]


def numpy_penalties(logits, history, num_prompt, presence, frequency, repetition):
    """float64 reference: HF repetition penalty over prompt + output, OpenAI penalties over output."""
    out = logits.astype(np.float64).copy()
    for tok in set(history):
        out[tok] = out[tok] / repetition if out[tok] > 0 else out[tok] * repetition
    counts = np.bincount(history[num_prompt:], minlength=len(logits)) if len(history) > num_prompt \
        else np.zeros(len(logits))
    return out - frequency * counts - presence * (counts > 0)


def test_penalties_match_numpy_on_random_logits_and_histories():
    from jaxserve.sample.sampler import process_logits

    rng = np.random.default_rng(7)
    rows, params, histories, prompts, want = 16, [], [], [], []
    logits = rng.normal(0, 3, size=(rows, VOCAB)).astype(np.float32)
    for b in range(rows):
        p = SamplingParams(presence_penalty=float(rng.uniform(-2, 2)), frequency_penalty=float(rng.uniform(-2, 2)),
                           repetition_penalty=float(rng.uniform(0.5, 2.0)))
        history = rng.integers(0, VOCAB, size=int(rng.integers(1, 30))).tolist()
        num_prompt = int(rng.integers(0, len(history) + 1))
        params.append(p), histories.append(history), prompts.append(num_prompt)
        want.append(numpy_penalties(logits[b], history, num_prompt, p.presence_penalty, p.frequency_penalty,
                                    p.repetition_penalty))
    sampling_rows = [SamplingRow(p, 0, 0, h, n) for p, h, n in zip(params, histories, prompts)]
    t = SamplingTensors.from_rows(sampling_rows, rows, VOCAB, history_len=32)
    got = np.asarray(jax.jit(process_logits)(logits, t))
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-5)


def test_logit_bias_and_min_tokens_masking():
    from jaxserve.sample.sampler import process_logits

    bias = SamplingParams(logit_bias={3: 100.0, 5: -100.0})
    masked = SamplingParams(min_tokens=4, stop_token_ids=[2])
    done = SamplingParams(min_tokens=1, stop_token_ids=[2])
    # (seed, position of the token sampled: one prompt token and one output token before it)
    rows = [SamplingRow(bias, 0, 2, [1, 9], 1), SamplingRow(masked, 0, 2, [1, 9], 1), SamplingRow(done, 0, 2, [1, 9], 1)]
    t = SamplingTensors.from_rows(rows, 4, VOCAB, history_len=8, eos_token_ids=(0,))
    got = np.asarray(jax.jit(process_logits)(np.tile(LOGITS, (4, 1)), t))
    np.testing.assert_allclose(got[0, [3, 5]], LOGITS[[3, 5]] + [100, -100], rtol=1e-6)
    assert np.isneginf(got[1, [0, 2]]).all()  # EOS and the stop id, while fewer than 4 tokens are out
    np.testing.assert_array_equal(got[2], LOGITS)  # min_tokens reached: nothing masked
    np.testing.assert_array_equal(got[3], LOGITS)  # padding row


def test_top_logprobs_are_sorted_and_the_greedy_token_is_first():
    """processed_logprobs: those of the distribution drawn from (here: tempered)."""
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.8, logprobs=5)]
    out = _jit_sample(np.tile(LOGITS, (2, 1)), tensors(params, [1, 2], [0, 0], 2), "processed_logprobs")
    top = np.asarray(out.top_logprobs)
    assert (np.diff(top, axis=1) <= 0).all()
    assert int(out.top_ids[0, 0]) == int(out.tokens[0]) == int(np.argmax(LOGITS))
    log_softmax = LOGITS - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    np.testing.assert_allclose(top[0], np.sort(log_softmax)[::-1][: top.shape[1]], rtol=1e-5)
    tempered = LOGITS / 0.8
    np.testing.assert_allclose(float(out.logprobs[1]), (tempered - np.log(np.exp(tempered.astype(np.float64)).sum()))[
        int(out.tokens[1])], rtol=1e-5)


def test_raw_logprobs_are_the_models_own_whatever_the_sampling_settings():
    """vLLM's default logprobs_mode: the sampled token's logprob, its rank and the top k are those
    of the logits' log-softmax (float64 reference), not of the penalised, tempered, cut or masked
    distribution it was drawn from; the draw itself is the same in both modes."""
    params = [SamplingParams(temperature=0.7, top_k=3, presence_penalty=1.5, logit_bias={5: 4.0}, seed=4, logprobs=5),
              SamplingParams(temperature=0.0, allowed_token_ids=[3, 11], logprobs=2),
              SamplingParams(temperature=1.3, top_p=0.5, min_p=0.1, logprobs=0, seed=9)]
    t = tensors(params, [4, 0, 9], [3, 3, 3], 3, histories=[[1, 2, 5]] * 3)
    raw = _jit_sample(np.tile(LOGITS, (3, 1)), t, "raw_logprobs")
    processed = _jit_sample(np.tile(LOGITS, (3, 1)), t, "processed_logprobs")
    np.testing.assert_array_equal(raw.tokens, processed.tokens)
    reference = LOGITS.astype(np.float64) - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    for row, token in enumerate(np.asarray(raw.tokens).tolist()):
        assert abs(float(raw.logprobs[row]) - reference[token]) < 1e-5
        assert int(raw.ranks[row]) == 1 + int((reference > reference[token]).sum())
        assert abs(float(processed.logprobs[row]) - reference[token]) > 1e-3  # the settings did change those
    np.testing.assert_allclose(np.asarray(raw.top_logprobs[0]), np.sort(reference)[::-1][:raw.top_logprobs.shape[1]],
                               rtol=1e-5)
    assert np.asarray(raw.top_ids[0, :2]).tolist() == np.argsort(-reference)[:2].tolist()
    assert np.isfinite(np.asarray(raw.top_logprobs[0])).all()  # nothing cut: top-k applies to the draw only
    with pytest.raises(ValueError, match="logprobs_mode"):
        sample(LOGITS[None], t, "logits")


def test_allowed_token_ids_restrict_the_draw_and_the_argmax():
    """vLLM's `allowed_token_ids`: rows sample only from their set, each row its own, and the
    processed logprobs are those of the distribution renormalised over it; rows without one are untouched."""
    allowed = [1, 4, 9]
    assert set(draw(SamplingParams(temperature=1.0, allowed_token_ids=allowed))) == set(allowed)
    best = allowed[int(np.argmax(LOGITS[allowed]))]
    assert set(draw(SamplingParams(temperature=0.0, allowed_token_ids=allowed), rows=16)) == {best}
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[2]), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, allowed_token_ids=[3, 11], logprobs=0)]
    tokens, logprobs = _sample(np.tile(LOGITS, (3, 1)), tensors(params, [0, 0, 0], [0, 0, 0], 3),
                               "processed_logprobs")
    assert np.asarray(tokens).tolist() == [2, int(np.argmax(LOGITS)), [3, 11][int(np.argmax(LOGITS[[3, 11]]))]]
    pair = LOGITS[[3, 11]].astype(np.float64)
    assert abs(float(logprobs[2]) - (pair.max() - np.log(np.exp(pair).sum()))) < 1e-5
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


def _entropy(logits: np.ndarray) -> float:
    logprobs = _log_softmax(logits)
    return float(-(np.exp(logprobs) * logprobs).sum())


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_each_logprobs_mode_on_fixed_logits(mode):
    """vLLM's four modes, row by row: the sampled token's value and rank, the top k and (for rows
    asking for more than the K kept, or -1) every token's value are of the model's logits or of
    the processed ones (bias, temperature, top-k cut at -inf; greedy rows at temperature 1), as
    logits or log-softmaxed. Entropies are of the model's own distribution whatever the mode."""
    params = [SamplingParams(temperature=0.7, top_k=3, logit_bias={5: 4.0}, seed=4, logprobs=-1, return_entropy=True),
              SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=1.3, seed=2, logprobs=30, return_entropy=True)]
    out = _jit_sample(np.tile(LOGITS, (3, 1)), tensors(params, [4, 0, 2], [3, 3, 3], 3), mode, distributions=True)
    processed = [(LOGITS + np.eye(VOCAB)[5] * 4.0) / 0.7, LOGITS, LOGITS / 1.3]
    processed[0] = np.where(processed[0] >= np.sort(processed[0])[-3], processed[0], -np.inf)
    want = [p if mode.startswith("processed") else LOGITS.astype(np.float64) for p in processed]
    if mode.endswith("logprobs"):
        want = [_log_softmax(w) for w in want]
    for row, token in enumerate(np.asarray(out.tokens).tolist()):
        assert abs(float(out.logprobs[row]) - want[row][token]) < 1e-5
        assert int(out.ranks[row]) == 1 + int((want[row] > want[row][token]).sum())
    assert np.asarray(out.top_ids[1, :3]).tolist() == np.argsort(-want[1], kind="stable")[:3].tolist()
    np.testing.assert_allclose(np.asarray(out.top_logprobs[1, :3]), np.sort(want[1])[::-1][:3], rtol=1e-5)
    for row in (0, 2):
        np.testing.assert_allclose(np.asarray(out.distributions[row]), want[row], rtol=1e-5, atol=1e-5)
        if mode.endswith("logprobs"):
            assert abs(np.exp(np.asarray(out.distributions[row], np.float64)).sum() - 1) < 1e-5
        assert abs(float(out.entropies[row]) - _entropy(LOGITS)) < 1e-5


def test_distributions_and_entropies_cost_nothing_unless_asked():
    """Without a row asking, the whole distributions are zeros (their branch does not run) and the
    entropies 0; without `distributions` the output has none at all."""
    t = tensors([SamplingParams(temperature=0.0, logprobs=20), SamplingParams(seed=1)], [0, 1], [0, 0], 2)
    out = _jit_sample(np.tile(LOGITS, (2, 1)), t, "raw_logprobs", distributions=True)
    assert not np.asarray(out.distributions).any() and not np.asarray(out.entropies).any()
    assert _jit_sample(np.tile(LOGITS, (2, 1)), t).distributions is None
    words = np.asarray(_jit_sample(np.tile(LOGITS, (2, 1)), t).packed())
    unpacked = SampleOutput.unpacked(words, min(MAX_LOGPROBS, VOCAB))
    assert unpacked.top_ids.shape == (2, min(MAX_LOGPROBS, VOCAB)) and unpacked.entropies.shape == (2,)


def test_entropy_matches_numpy_with_masked_tokens():
    logits = np.stack([LOGITS, np.where(np.arange(VOCAB) % 3 == 0, -np.inf, LOGITS)]).astype(np.float32)
    got = np.asarray(jax.jit(entropy)(logits))
    assert abs(got[0] - _entropy(LOGITS)) < 1e-5
    assert abs(got[1] - _entropy(logits[1][np.isfinite(logits[1])])) < 1e-5
