"""llama.cpp's samplers (jaxserve/sample/llamacpp.py) against float64 numpy references written
from llama.cpp's definitions (src/llama-sampling.cpp), on fixed logits: which tokens survive, their
probabilities, and, where a sampler draws, the drawn tokens' distribution (chi-square); then through
the engine and the server.

Tolerances: probabilities within 1e-5 relative (float32 against float64); DRY's penalties within
1e-5 relative; mirostat's carried mu within 1e-4 relative after several steps."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import scipy.stats
from server import MESSAGES, MODEL, post
from test_sampling import assert_distribution, filtered

from jaxserve import SamplingParams
from jaxserve.sample.llamacpp import BUILTIN_SAMPLERS
from jaxserve.sample.logits_processors import Processors
from jaxserve.sample.sampler import _row_key, process_logits, sample
from jaxserve.sample.tensors import SamplingRow, SamplingTensors

VOCAB = 256
HISTORY = 256
ROWS = 16  # the batch of the deterministic tests
DRAWS = 4096  # the batch of the ones that draw
PROCS = Processors(BUILTIN_SAMPLERS, VOCAB)


def encode(text: str) -> list[int]:
    """The tests' tokenizer: a breaker "3 4" is the tokens [3, 4]."""
    return [int(t) for t in text.split()]


def tensors(params: list[SamplingParams], histories: list[list[int]] | None = None, carried=None,
            num_rows: int = ROWS, seed: int = 0) -> SamplingTensors:
    histories = histories or [[1, 2, 3]] * len(params)
    rows = [SamplingRow(p, seed + b, len(h), h, 1, None, PROCS.request_args(p, encode),
                        None if carried is None else carried[b])
            for b, (p, h) in enumerate(zip(params, histories))]
    return SamplingTensors.from_rows(rows, num_rows, VOCAB, HISTORY, processors=PROCS)


@jax.jit
def processed(logits, t: SamplingTensors):
    """The logits as the built-ins leave them, before temperature."""
    keys = jax.vmap(_row_key)(t.seed_lo, t.seed_hi, t.position)
    return PROCS.apply(process_logits(logits, t), t.processors, t.history, t.num_prompt, keys)


_sample = jax.jit(lambda logits, t: sample(logits, t, "processed_logprobs", processors=PROCS))


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.where(np.isfinite(x), np.exp(x - x[np.isfinite(x)].max()), 0.0)
    return e / e.sum()


def random_logits(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 2.0, size=(rows, VOCAB)).astype(np.float32)


# float64 references, each as llama.cpp defines the sampler (the candidates: the whole vocabulary)

def ref_top_n_sigma(logits, n):
    x = logits.astype(np.float64)
    return np.where(x < x.max() - n * x.std(), -np.inf, x)


def ref_typical(logits, p, min_keep):
    probs = softmax(logits)
    entropy = -np.sum(probs * np.log(probs))
    order = np.argsort(np.abs(-np.log(probs) - entropy), kind="stable")
    cum, last = 0.0, len(order)
    for i, idx in enumerate(order):
        cum += probs[idx]
        if cum > p and (min_keep == 0 or i >= min_keep - 1):
            last = i + 1
            break
    assert last == len(order) or abs(cum - p) > 1e-5  # (a decision float32 makes the same way)
    return np.where(np.isin(np.arange(len(probs)), order[:last]), logits.astype(np.float64), -np.inf)


def ref_xtc(logits, threshold, min_keep):
    """XTC when its coin says to cut."""
    probs = softmax(logits)
    order = np.argsort(-probs, kind="stable")
    last = 0
    for i, idx in enumerate(order):
        if probs[idx] < threshold:
            break
        last = i
    out = logits.astype(np.float64).copy()
    if len(order) - last >= min_keep and last > 0:
        out[order[:last]] = -np.inf
    return out


def ref_dynatemp(logits, temp, spread, exponent):
    """The probabilities llama.cpp samples from after temp-ext (a distribution of V candidates)."""
    x = logits.astype(np.float64)
    low, high = max(0.0, temp - spread), temp + spread
    probs = softmax(x)
    entropy = -np.sum(probs * np.log(probs))
    dynamic = low + (high - low) * (entropy / np.log(len(x))) ** exponent
    return softmax(x / dynamic)


def ref_mirostat(logits, temp, mu, version, n_vocab=VOCAB, m=100):
    """The tokens mirostat keeps of the tempered distribution, and their renormalised probabilities."""
    probs = softmax(logits.astype(np.float64) / temp)
    order = np.argsort(-probs, kind="stable")
    if version == 2:
        keep = next((i for i, idx in enumerate(order) if -np.log2(probs[idx]) > mu), len(order))
        keep = max(keep, 1)
        assert min(abs(-np.log2(probs[order[j]]) - mu) for j in (keep - 1, keep)) > 1e-4
    else:
        sorted_p = probs[order]
        t = np.log(np.arange(2, m + 1) / np.arange(1, m))[:min(m - 1, len(order) - 1)]
        b = np.log(sorted_p[:-1] / sorted_p[1:])[:len(t)]
        s = np.sum(t * b) / np.sum(t * t)
        k = (s - 1) * 2.0 ** mu / (1 - n_vocab ** -(s - 1))
        k = k ** (1 / s)
        assert abs(k - round(k)) > 1e-3
        keep = max(int(k), 1)
    kept = np.zeros(len(probs), bool)
    kept[order[:keep]] = True
    return kept, np.where(kept, probs, 0.0) / probs[kept].sum()


def ref_dry(tokens, multiplier, base, allowed, last_n, breakers, vocab=VOCAB):
    """llama.cpp's DRY penalties (float64) of each token: its steps 1 to 4, the Z-algorithm included."""
    penalty = np.zeros(vocab)
    window = list(tokens[-last_n:]) if last_n > 0 else list(tokens)
    n = len(window)
    if n <= allowed:
        return penalty

    def rat(i):  # i tokens before the last
        return window[n - 1 - i]

    rep_limit = n  # step 1: the latest sequence breaker
    for i in range(n):
        tails = [b[1:] for b in breakers if b[0] == rat(i)]
        longest = -1
        for tail in tails:
            if longest < len(tail) <= i and all(tail[o] == rat(i - o - 1) for o in range(len(tail))):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return penalty
    counts, lt, rt, last = [0] * n, 0, 0, n - 1  # step 2: repeat lengths (reverse Z-algorithm)
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            counts[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        elif counts[last - (k - lt)] < rt - k + 1:
            counts[last - k] = min(counts[last - (k - lt)], rep_limit)
        else:
            j = rt + 1
            while j < n and rat(j) == rat(j - k):
                j += 1
            counts[last - k] = min(j - k, rep_limit)
            lt, rt = k, j - 1
    longest = {}  # step 3: the longest repeat each token would extend
    for i in range(n - 1):
        if counts[i] >= allowed:
            token = rat(n - 2 - i)
            longest[token] = max(longest.get(token, -1), counts[i])
    max_exponent = int(np.float32(88.7228391) / np.log(np.float32(base))) if base > 1.000001 else 0
    single = {b[0] for b in breakers if len(b) == 1}
    for token, length in longest.items():  # step 4
        if token not in single:
            exponent = length - allowed
            if max_exponent > 0:
                exponent = min(exponent, max_exponent)
            penalty[token] = multiplier * float(base) ** exponent
    return penalty


def test_deterministic_samplers_match_llamacpp_and_leave_other_rows_alone():
    """One batch: rows with top-n-sigma, typical (with and without min_keep), XTC (its coin certain),
    dynamic temperature and mirostat 1 and 2, between rows that use none; the kept tokens equal the
    reference's, and so do the probabilities `sample` then draws from (within 1e-5 relative)."""
    cases = [
        (SamplingParams(top_n_sigma=1.0), lambda x: softmax(ref_top_n_sigma(x, 1.0))),
        (SamplingParams(), None),
        (SamplingParams(top_n_sigma=2.5, temperature=0.7), lambda x: softmax(ref_top_n_sigma(x, 2.5) / 0.7)),
        (SamplingParams(typical_p=0.5), lambda x: softmax(ref_typical(x, 0.5, 0))),
        (SamplingParams(typical_p=0.2, min_keep=40), lambda x: softmax(ref_typical(x, 0.2, 40))),
        (SamplingParams(typical_p=0.95, temperature=1.3), lambda x: softmax(ref_typical(x, 0.95, 0) / 1.3)),
        (SamplingParams(temperature=0.5, top_p=0.9), None),
        (SamplingParams(xtc_probability=1.0, xtc_threshold=0.02), lambda x: softmax(ref_xtc(x, 0.02, 0))),
        (SamplingParams(xtc_probability=1.0, xtc_threshold=0.05, min_keep=256),
         lambda x: softmax(ref_xtc(x, 0.05, 256))),
        (SamplingParams(dynatemp_range=0.5), lambda x: ref_dynatemp(x, 1.0, 0.5, 1.0)),
        (SamplingParams(temperature=0.8, dynatemp_range=1.5, dynatemp_exponent=2.0),
         lambda x: ref_dynatemp(x, 0.8, 1.5, 2.0)),
        (SamplingParams(mirostat=2, mirostat_tau=3.0, temperature=0.9), lambda x: ref_mirostat(x, 0.9, 6.0, 2)[1]),
        (SamplingParams(mirostat=1, mirostat_tau=2.5), lambda x: ref_mirostat(x, 1.0, 5.0, 1)[1]),
        (SamplingParams(mirostat=1, mirostat_tau=5.0, temperature=1.5), lambda x: ref_mirostat(x, 1.5, 10.0, 1)[1]),
    ]
    logits = random_logits(ROWS)
    out = np.asarray(processed(logits, tensors([p for p, _ in cases])))
    for b, (params, reference) in enumerate(cases):
        if reference is None:
            np.testing.assert_array_equal(out[b], logits[b])
            continue
        expected = reference(logits[b])
        got = softmax(out[b] / params.temperature)
        assert np.array_equal(got > 0, expected > 0), (b, params)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-12, err_msg=str(params))
    assert 1 < np.isfinite(out[7]).sum() < VOCAB and np.isfinite(out[8]).all()  # (XTC cut; min_keep held it)


def test_min_keep_holds_top_p_and_min_p_and_not_top_k():
    """llama.cpp's min_keep: top-p and min-p keep at least that many tokens (here past what they
    would keep alone), top-k still cuts; the distribution `sample` draws from (processed logprobs of
    the top 20) equals the float64 reference within 1e-5 relative."""
    cases = [dict(top_p=0.05, min_keep=7), dict(min_p=0.9, min_keep=5), dict(top_p=0.05, min_p=0.5, min_keep=12),
             dict(top_k=3, min_keep=9), dict(top_p=0.05), dict(top_p=0.99, min_keep=2)]
    logits = random_logits(ROWS, seed=1)
    params = [SamplingParams(temperature=0.8, logprobs=20, **c) for c in cases]
    out = _sample(logits, tensors(params))
    for b, case in enumerate(cases):
        probs = softmax(logits[b] / 0.8)
        order = np.argsort(-probs)
        settings = {k: v for k, v in case.items() if k != "min_keep"}
        expected = filtered(probs, **settings)
        keep = case.get("min_keep", 0)
        if "top_k" not in case and (expected > 0).sum() < keep:  # at least min_keep of the best
            expected = np.zeros_like(probs)
            expected[order[:keep]] = probs[order[:keep]] / probs[order[:keep]].sum()
        ids, lp = np.asarray(out.top_ids[b]), np.asarray(out.top_logprobs[b])  # (the top 20)
        assert np.array_equal(np.isfinite(lp), expected[ids] > 0), case
        np.testing.assert_allclose(np.exp(lp), expected[ids], rtol=1e-5, err_msg=str(case))


def _draws(params: SamplingParams, logits: np.ndarray, seed: int = 0):
    """DRAWS draws of `params` on the same logits, each row its own seed: (tokens, logprobs)."""
    params = dataclasses.replace(params, logprobs=0)  # (the drawn token's logprob is computed where asked for)
    out = _sample(np.tile(logits, (DRAWS, 1)), tensors([params] * DRAWS, num_rows=DRAWS, seed=seed))
    return np.asarray(out.tokens), np.asarray(out.logprobs)


@pytest.mark.parametrize("params,reference", [
    (SamplingParams(temperature=0.9, dynatemp_range=0.6, dynatemp_exponent=0.5),
     lambda x: ref_dynatemp(x, 0.9, 0.6, 0.5)),
    (SamplingParams(temperature=1.2, mirostat=2, mirostat_tau=4.0), lambda x: ref_mirostat(x, 1.2, 8.0, 2)[1]),
    (SamplingParams(temperature=1.0, mirostat=1, mirostat_tau=3.0), lambda x: ref_mirostat(x, 1.0, 6.0, 1)[1]),
], ids=["dynatemp", "mirostat2", "mirostat1"])
def test_drawn_tokens_follow_the_reference(params, reference):
    logits = random_logits(1, seed=2)[0] * 0.6
    tokens, _ = _draws(params, logits)
    assert_distribution(tokens, reference(logits))


def test_xtc_coin_is_a_row_draw_of_its_own():
    """xtc_probability 0.5: about half the rows cut (a binomial test), told apart by the drawn token's
    processed logprob; the tokens of each half follow their distribution (chi-square), the draw of
    the token being independent of the coin's."""
    logits = random_logits(1, seed=3)[0] * 0.5
    tokens, logprobs = _draws(SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.02), logits)
    full, cut = softmax(logits), softmax(ref_xtc(logits, 0.02, 0))
    assert (cut == 0).sum() > 1
    was_cut = np.abs(logprobs - np.log(np.maximum(cut[tokens], 1e-300))) < 1e-4
    assert np.all(was_cut | (np.abs(logprobs - np.log(full[tokens])) < 1e-4))
    assert scipy.stats.binomtest(int(was_cut.sum()), DRAWS, 0.5).pvalue > 1e-3
    assert_distribution(tokens[was_cut], cut)
    assert_distribution(tokens[~was_cut], full)


def test_mirostat_mu_follows_the_drawn_tokens():
    """Six steps of rows with mirostat 1 and 2 (new logits each step): each drawn token is one the
    reference keeps, and the carried mu equals the reference's update, mu - eta * (-log2 p - tau),
    within 1e-4 relative; greedy rows' tokens have surprise 0."""
    params = [SamplingParams(mirostat=2, mirostat_tau=3.0, mirostat_eta=0.3, temperature=1.1),
              SamplingParams(mirostat=1, mirostat_tau=4.0, mirostat_eta=0.2),
              SamplingParams(mirostat=2, temperature=0.0), SamplingParams(temperature=0.9)]
    mu = [6.0, 8.0, 10.0]
    carried = None
    for step in range(6):
        logits = random_logits(ROWS, seed=10 + step)
        out = _sample(logits, tensors(params, carried=carried, seed=step * 7))
        tokens = np.asarray(out.tokens)
        for b, p in enumerate(params[:3]):
            if p.temperature == 0:
                surprise = 0.0
                assert tokens[b] == np.argmax(logits[b])
            else:
                kept, probs = ref_mirostat(logits[b], p.temperature, mu[b], p.mirostat)
                assert kept[tokens[b]]
                surprise = -np.log2(probs[tokens[b]])
            mu[b] = mu[b] - p.mirostat_eta * (surprise - p.mirostat_tau)
        carried_now = np.asarray(out.carried)
        np.testing.assert_allclose(carried_now[:3, 0].view(np.float32), mu, rtol=1e-4)
        carried = [carried_now[b] for b in range(len(params))]


DRY = dict(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)


def _dry_cases():
    """(params, history): repeats, a breaker cutting a repeat short, a breaker of several tokens, a
    window, an exponent at its cap, base 1, an exempt single-token breaker, and random histories."""
    rng = np.random.default_rng(4)
    abc = [5, 6, 7, 9, 5, 6, 7, 8, 11, 5, 6, 7]
    cases = [
        (SamplingParams(**DRY, dry_sequence_breakers=[]), abc),
        (SamplingParams(**DRY, dry_sequence_breakers=["6"]), [5, 6, 7, 9, 5, 6, 7]),
        (SamplingParams(**DRY, dry_sequence_breakers=["8"]), abc),
        (SamplingParams(**DRY, dry_sequence_breakers=["11 5"]), abc + [20, 5, 6, 7]),
        (SamplingParams(**{**DRY, "dry_allowed_length": 1}, dry_penalty_last_n=7, dry_sequence_breakers=[]),
         abc + [9, 5, 6]),
        (SamplingParams(dry_multiplier=1e-30, dry_base=3.0, dry_allowed_length=2, dry_sequence_breakers=[]),
         [1, 2] * 100),
        (SamplingParams(dry_multiplier=0.5, dry_base=1.0, dry_allowed_length=0, dry_sequence_breakers=["7"]),
         abc + [1, 5]),
        (SamplingParams(**DRY, dry_sequence_breakers=["9"]), [5, 6, 9, 3, 5, 6]),
        (SamplingParams(), abc),
    ]
    for _ in range(6):
        history = rng.integers(0, 4, size=int(rng.integers(10, 120))).tolist()
        breakers = [" ".join(map(str, rng.integers(0, 4, size=int(rng.integers(1, 3))))) for _ in range(2)]
        cases.append((SamplingParams(dry_multiplier=float(rng.uniform(0.1, 2)), dry_base=float(rng.uniform(1, 3)),
                                     dry_allowed_length=int(rng.integers(0, 4)),
                                     dry_penalty_last_n=int(rng.choice([-1, 30, 5])), dry_sequence_breakers=breakers),
                      history))
    return cases


def test_dry_penalties_match_llamacpp_on_crafted_histories():
    cases = _dry_cases()
    assert len(cases) <= ROWS
    logits = random_logits(ROWS, seed=5)
    out = np.asarray(processed(logits, tensors([p for p, _ in cases], [h for _, h in cases])))
    for b, (p, history) in enumerate(cases):
        if not p.dry_multiplier:
            np.testing.assert_array_equal(out[b], logits[b])
            continue
        expected = ref_dry(history, p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n,
                           [encode(s) for s in p.dry_sequence_breakers])
        np.testing.assert_allclose(logits[b] - out[b], expected, rtol=1e-5, atol=1e-5 * p.dry_multiplier,
                                   err_msg=f"row {b}: {history}")
    penalised = [np.flatnonzero(logits[b] != out[b]).tolist() for b in range(8)]
    assert penalised[0] == [8, 9] and penalised[1] == [] and penalised[7] == []  # (breakers: cut short, exempt)
    assert penalised[6] != [] and 7 not in penalised[6]


def test_through_the_engine(offline):
    """A top_n_sigma this small keeps only the top token: sampled output equals greedy; mirostat
    carries mu from token to token and a seeded run repeats; DRY keeps greedy from repeating a token."""
    prompt = [[7, 8, 9, 7, 8, 9, 7, 8]]
    greedy = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    sigma = offline.generate(prompt, SamplingParams(temperature=1.0, top_n_sigma=1e-6, max_tokens=24, seed=1,
                                                    ignore_eos=True), use_tqdm=False)
    assert sigma[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    mirostat = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=2.0, max_tokens=24, seed=3, ignore_eos=True,
                              n=2)
    first, again = (offline.generate(prompt, mirostat, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert all(len(c.token_ids) == 24 for c in first.outputs)
    # (allowed length 0: every token seen before would extend a repeat)
    dry = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, dry_multiplier=50.0,
                                                  dry_allowed_length=0, dry_sequence_breakers=[]), use_tqdm=False)
    tokens = dry[0].outputs[0].token_ids
    assert len(set(greedy[0].outputs[0].token_ids)) < 24 and len(set(tokens)) == 24 and not set(tokens) & {7, 8, 9}


def test_over_http(served, client):
    """llama.cpp's field names on both routes; out-of-range values and beam search are 400s."""
    kw = dict(model=MODEL, prompt="abc", max_tokens=12, seed=5)
    greedy = client.completions.create(**kw, temperature=0, extra_body={"ignore_eos": True})
    sigma = client.completions.create(**kw, temperature=1.0, extra_body={"ignore_eos": True, "top_n_sigma": 1e-6})
    assert sigma.choices[0].text == greedy.choices[0].text
    body = {"ignore_eos": True, "mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2, "typical_p": 0.9,
            "min_keep": 2, "dry_multiplier": 0.8, "dry_sequence_breakers": ["\n", "."], "xtc_probability": 0.5,
            "xtc_threshold": 0.1, "dynatemp_range": 0.3, "dynatemp_exponent": 1.5, "dry_penalty_last_n": 64}

    def chat(extra: dict) -> str:
        answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, seed=2,
                                                extra_body=extra)
        assert answer.usage.completion_tokens == 10
        return answer.choices[0].message.content

    # the fields take effect: a seeded run repeats, and differs from the same seed without them
    with_fields = chat(body)
    assert chat(body) == with_fields and chat({"ignore_eos": True}) != with_fields
    for field, value, message in [("mirostat", 3, "'mirostat' must be in [0, 2]"),
                                  ("typical_p", 1.5, "'typical_p' must be in [0.0, 1.0]"),
                                  ("dry_base", 0.5, "'dry_base' must be in [1.0, 100.0]"),
                                  ("dry_sequence_breakers", "x", "must be a list of strings"),
                                  ("dry_sequence_breakers", [""], "non-empty strings"),
                                  ("min_keep", -1, "'min_keep' must be in [0,")]:
        for path, extra in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MESSAGES})):
            r = post(served, path, {**extra, field: value})
            assert r.status_code == 400 and message in r.json()["error"]["message"], (field, r.text)
            assert r.json()["error"]["param"] == field
    r = post(served, "/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 2, "mirostat": 2})
    assert r.status_code == 400 and "'mirostat' cannot be combined with 'use_beam_search'" in r.text
