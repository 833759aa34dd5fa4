"""Raw outputs through the engine, offline: the whole vocabulary's logprobs (`logprobs=-1` where
max_logprobs is -1), the raw_logits mode against a direct forward of the model, and entropies
computed in the step; none of them compiles anything after warm-up."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import SMALL_ENGINE
from test_compile import CompileCounter

from checkpoints.default_model import default_model_dir
from jaxserve import LLM, BeamSearchParams, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.models import ModelInputs, forward, rope_table
from jaxserve.models.config import ModelConfig
from jaxserve.worker.kv_cache import allocate_kv_cache
from jaxserve.worker.weights import load_weights

PARITY_ATOL = 1e-4  # tests/test_parity.py's float32 tolerance on logits


@pytest.fixture(scope="module")
def raw_llm():
    return LLM("jaxserve-tiny", **SMALL_ENGINE, max_logprobs=-1, logprobs_mode="raw_logits")


def model_logits(token_ids: list[int]) -> np.ndarray:
    """f32[len, V] jaxserve-tiny's logits at every position of one sequence, from one forward of the
    model straight onto a fresh cache (no engine, no sampler)."""
    model_dir = default_model_dir()
    cfg = ModelConfig.from_hf(model_dir).for_context(128)
    engine_cfg = EngineConfig(max_model_len=128, page_size=16, num_pages=16, dtype="float32").resolve(cfg)
    graphdef, state = load_weights(model_dir, cfg, "float32")
    n = len(token_ids)
    pos = np.arange(n)
    pages = np.arange(1, 9, dtype=np.int32)
    inputs = ModelInputs(
        token_ids=np.asarray(token_ids, np.int32), positions=pos.astype(np.int32), rope=rope_table(cfg, pos),
        kv_write_index=(pages[pos // 16] * 16 + pos % 16).astype(np.int32), kv_lens=np.array([n], np.int32),
        page_table=pages[None, :], query_start=np.array([0, n], np.int32), num_seqs=np.asarray(1, np.int32),
        logits_indices=np.arange(n, dtype=np.int32))
    _, logits, _ = forward(graphdef, state, allocate_kv_cache(cfg, engine_cfg), inputs)
    return np.asarray(logits)


def entropy(logits: np.ndarray) -> float:
    """Of softmax(logits), in nats, in float64."""
    x = logits.astype(np.float64) - logits.max()
    logprobs = x - np.log(np.exp(x).sum())
    return float(-(np.exp(logprobs) * logprobs).sum())


def test_raw_logits_are_the_models_logits_and_entropies_theirs(raw_llm):
    """raw_logits with logprobs=-1: each generated token's entry holds every token of the vocabulary,
    valued at the model's own logit before it (sampled under temperature and a penalty, which change
    nothing of it), ranked by logit; its entropy is that of those logits. Batched with requests that
    ask for fewer (within and past the K kept per token) or none, and after warm-up, nothing compiles."""
    vocab = raw_llm.engine.model_config.vocab_size
    prompt = raw_llm.tokenizer.encode("raw outputs")
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, presence_penalty=1.0, ignore_eos=True,
                            logprobs=-1, return_entropy=True)
    others = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=k) for k in (None, 3, 40)]
    with CompileCounter() as counter:
        out, *rest = raw_llm.generate([prompt] * 4, [params, *others], use_tqdm=False)
    assert counter.count == 0
    out = out.outputs[0]
    reference = model_logits(prompt + out.token_ids[:-1])[len(prompt) - 1:]
    assert len(out.logprobs) == len(out.entropies) == 6
    for token, entry, want, got_entropy in zip(out.token_ids, out.logprobs, reference, out.entropies):
        assert len(entry) == vocab and next(iter(entry)) == token  # the sampled token first, as vLLM's
        got = np.array([entry[t].logprob for t in range(vocab)])
        np.testing.assert_allclose(got, want, atol=PARITY_ATOL, rtol=0)
        ranks = np.array([entry[t].rank for t in range(vocab)])
        assert sorted(ranks) == list(range(1, vocab + 1)) and (np.diff(got[np.argsort(ranks)]) <= 0).all()
        assert abs(got_entropy - entropy(want)) < 1e-4
        assert abs(got_entropy - entropy(got)) < 1e-4
    assert rest[0].outputs[0].logprobs is None and rest[0].outputs[0].entropies is None
    assert [len(e) for e in rest[1].outputs[0].logprobs] == [3] * 5  # (greedy: the token is the top 1)
    for entry in rest[2].outputs[0].logprobs:
        assert len(entry) == 40 and [lp.rank for lp in entry.values()] == list(range(1, 41))


def test_whole_vocabulary_logprobs_sum_to_one(offline):
    """The default raw_logprobs mode with logprobs=-1 (the engine's max_logprobs is -1): vocab_size
    entries per token, whose probabilities sum to 1; and a count between the K kept per token and the
    vocabulary, the likeliest that many in rank order."""
    vocab = offline.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=7, ignore_eos=True, logprobs=-1)
    out = offline.generate("whole vocabulary", params, use_tqdm=False)[0].outputs[0]
    for token, entry in zip(out.token_ids, out.logprobs):
        assert len(entry) == vocab
        assert abs(np.exp(np.array([lp.logprob for lp in entry.values()], np.float64)).sum() - 1) < 1e-4
    some = offline.generate("whole vocabulary", SamplingParams(max_tokens=4, temperature=1.0, seed=7, ignore_eos=True,
                                                               logprobs=50), use_tqdm=False)[0].outputs[0]
    assert some.token_ids == out.token_ids
    for full, entry in zip(out.logprobs, some.logprobs):
        best = sorted(full.items(), key=lambda item: item[1].rank)[:50]
        assert {t: lp for t, lp in best}.items() <= entry.items() and len(entry) in (50, 51)


def test_what_raw_outputs_cannot_do_is_refused(offline, raw_llm, monkeypatch):
    """-1 means the whole vocabulary: refused where max_logprobs caps the count (as vLLM's), and more
    than the vocabulary is refused where it does not; prompt logprobs stay at most MAX_LOGPROBS; beam
    search, which adds logprobs up, needs a logprobs mode."""
    engine = raw_llm.engine
    monkeypatch.setattr(engine.checks, "config", dataclasses.replace(engine.config, max_logprobs=5))
    with pytest.raises(ValueError, match=r"logprobs of -1 \(-1: the whole vocabulary\), more than max_logprobs \(5\)"):
        engine.check_request([1, 2], SamplingParams(logprobs=-1))
    monkeypatch.undo()
    with pytest.raises(ValueError, match="more than the vocabulary"):
        offline.generate("x", SamplingParams(logprobs=10**6), use_tqdm=False)
    with pytest.raises(ValueError, match="at most 20 per prompt token"):
        raw_llm.generate("x", SamplingParams(prompt_logprobs=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="beam search scores beams by their logprobs"):
        raw_llm.beam_search(["x"], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="logprobs must be -1"):
        SamplingParams(logprobs=-2)
    with pytest.raises(ValueError, match="max_logprobs must be -1"):
        EngineConfig(max_logprobs=-3)
