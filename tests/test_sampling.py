"""The batched sampler on fixed logits, and seeded sampling through the engine."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import scipy.stats

from jaxserve import LLM, SamplingParams
from jaxserve.sampling import SamplingTensors, sample

VOCAB = 12
LOGITS = np.random.default_rng(0).normal(0.0, 1.5, size=VOCAB).astype(np.float32)
ROWS = 4000
_sample = jax.jit(sample)


def draw(params: SamplingParams, rows: int = ROWS, logits: np.ndarray = LOGITS) -> np.ndarray:
    """`rows` draws from the same logits: one row each, distinct seeds."""
    tensors = SamplingTensors.from_rows([params] * rows, list(range(rows)), [7] * rows, rows, VOCAB)
    tokens, logprobs = _sample(np.tile(logits, (rows, 1)), tensors)
    return np.asarray(tokens)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def test_greedy_rows_take_the_argmax():
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=1)):
        assert set(draw(params, rows=64)) == {int(np.argmax(LOGITS))}


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
    tensors = SamplingTensors.from_rows(params, list(range(len(params))), [3] * len(params), len(params), VOCAB)
    tokens = np.asarray(_sample(np.tile(LOGITS, (len(params), 1)), tensors)[0]).reshape(len(rows), reps)
    order = np.argsort(-LOGITS)
    probs = softmax(LOGITS)
    assert set(tokens[0]) == {order[0]}
    assert set(tokens[1]) == set(order[:2])
    assert set(tokens[2]) <= set(order[: int(np.searchsorted(np.cumsum(probs[order]), 0.3)) + 1])
    assert set(tokens[3]) == set(np.flatnonzero(probs >= 0.5 * probs.max()))
    assert len(set(tokens[4])) > 4


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_distribution_matches_tempered_softmax(temperature):
    tokens = draw(SamplingParams(temperature=temperature), rows=20000)
    expected = softmax(LOGITS / temperature) * len(tokens)
    observed = np.bincount(tokens, minlength=VOCAB)
    keep = expected >= 5  # chi-square needs enough expected counts per cell
    pooled_obs = np.append(observed[keep], observed[~keep].sum())
    pooled_exp = np.append(expected[keep], expected[~keep].sum())
    if pooled_exp[-1] == 0:
        pooled_obs, pooled_exp = pooled_obs[:-1], pooled_exp[:-1]
    assert scipy.stats.chisquare(pooled_obs, pooled_exp).pvalue > 1e-3


def test_key_depends_on_seed_and_position_only():
    params = SamplingParams(temperature=1.0)
    a = SamplingTensors.from_rows([params] * 3, [5, 5, 6], [10, 11, 10], 3, VOCAB)
    b = SamplingTensors.from_rows([params] * 8, [9, 5, 1, 1, 1, 1, 1, 1], [0, 10, 0, 0, 0, 0, 0, 0], 8, VOCAB)
    flat = np.random.default_rng(1).normal(0, 3, size=(8, VOCAB)).astype(np.float32)
    logits = np.tile(flat[1], (8, 1))
    ta, _ = _sample(logits[:3], a)
    tb, _ = _sample(logits, b)
    assert int(ta[0]) == int(tb[1])  # same (seed, position), different row and batch
    # 64 seeds, each drawn in row 0 of a batch of 1 and in row 5 of a batch of 8: identical
    alone = [int(_sample(logits[:1], SamplingTensors.from_rows([params], [s], [4], 1, VOCAB))[0][0])
             for s in range(64)]
    batched = [int(_sample(logits, SamplingTensors.from_rows([params] * 8, [0] * 5 + [s, 1, 2], [9] * 5 + [4, 0, 0],
                                                             8, VOCAB))[0][5]) for s in range(64)]
    assert alone == batched and len(set(alone)) > 1
    draws = [int(_sample(logits[:1], SamplingTensors.from_rows([params], [s], [10], 1, VOCAB))[0][0])
             for s in range(40)]
    assert len(set(draws)) > 1  # different seeds do differ


def test_seed_reproducible_alone_and_in_a_batch_of_16():
    llm = LLM(None, max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate(["the same prompt"], seeded)[0].outputs[0].token_ids
    rng = np.random.default_rng(5)
    others = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(1, 40, size=15)]
    batch = llm.generate(others[:7] + ["the same prompt"] + others[7:],
                         [SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)] * 7 + [seeded]
                         + [SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)] * 8)
    assert batch[7].outputs[0].token_ids == alone
    unseeded = llm.generate(["the same prompt"] * 2, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_sampling_params_validation():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2.0),
                dict(max_tokens=0), dict(stop_token_ids=[-1]), dict(seed="x")):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
