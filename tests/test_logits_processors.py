"""Logits processors compiled into the step (`jaxserve.LogitsProcessor`): registered at start,
used per request through extra_args (HTTP: vllm_xargs or top-level fields), without compiling."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CROWDED_ENGINE
from processors import BanToken, EntropyTemperature, NoRepeat, Raises, WrongShape
from server import post
from test_compile import CompileCounter

from jaxserve import LLM, SamplingParams
from jaxserve.sample.logits_processors import Processors, load_class
from jaxserve.sample.tensors import Padding


@pytest.fixture(scope="module")
def llms():
    """(with the test processors, without any), on the same settings."""
    return (LLM("jaxserve-tiny", **CROWDED_ENGINE, logits_processors=[BanToken, "processors:Count", NoRepeat]),
            LLM("jaxserve-tiny", **CROWDED_ENGINE))


def _mixed(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, size=int(rng.integers(2, 60))).tolist() for _ in range(n)]
    params = [SamplingParams(max_tokens=int(rng.integers(4, 20)), temperature=float(rng.choice([0.0, 0.8])),
                             seed=i, ignore_eos=True, n=2 if i % 7 == 0 else 1,
                             presence_penalty=0.5 if i % 5 == 0 else 0.0) for i in range(n)]
    return prompts, params


def test_a_banned_token_never_comes_and_other_rows_are_untouched(llms):
    """Rows that ask never produce their token; rows that do not ask equal a run with no processor
    registered, token for token; 50 mixed requests, some asking, compile nothing."""
    with_processors, without = llms
    prompts, params = _mixed(50)
    reference = without.generate(prompts, params, use_tqdm=False)
    asking = {i: reference[i].outputs[0].token_ids[0] for i in range(0, 50, 3)}  # each bans its own first token
    params = [SamplingParams(**{**p.__dict__, "extra_args": {"ban_token": asking[i]}}) if i in asking else p
              for i, p in enumerate(params)]
    with CompileCounter() as counter:
        outputs = with_processors.generate(prompts, params, use_tqdm=False)
    assert counter.count == 0
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        for choice, ref_choice in zip(out.outputs, ref.outputs):
            if i in asking:
                assert asking[i] not in choice.token_ids
            else:
                assert choice.token_ids == ref_choice.token_ids, i


def test_carried_state_and_history(llms):
    """`carry`: each token is the one before plus one, across steps (and alongside rows scheduled
    ahead); `history`: a sampled output never repeats a token."""
    llm = llms[0]
    count, no_repeat, plain = llm.generate(
        [[5, 6, 7], [1, 2, 3], [1, 2, 3]],
        [SamplingParams(max_tokens=12, ignore_eos=True, extra_args={"count_from": llm.engine.model_config.vocab_size - 6}, n=2),
         SamplingParams(max_tokens=40, ignore_eos=True, seed=1, temperature=0.3, extra_args={"no_repeat": True}),
         SamplingParams(max_tokens=40, ignore_eos=True, seed=1, temperature=0.3)], use_tqdm=False)
    vocab = llm.engine.model_config.vocab_size
    for choice in count.outputs:
        assert choice.token_ids == [t % vocab for t in range(vocab - 6, vocab + 6)]
    assert len(set(no_repeat.outputs[0].token_ids)) == 40
    assert len(set(plain.outputs[0].token_ids)) < 40  # (the tiny model repeats itself when let)


def test_rows_no_row_uses_are_paddings_of_the_defaults():
    """A processor no row uses gets its defaults: as Paddings where a default holds one value (sent
    once, not per step), as arrays where it does not; the same values as rows that spell them out."""
    varied = type("Varied", (BanToken,), {"args": {"ban_token": np.int32(-1), "weights": np.arange(3, dtype=np.float32),
                                                   "flags": np.ones(2, bool)}})
    procs = Processors([varied, "processors:Count"], 256)
    padded = procs.rows([None, None], 4, unused=Padding)
    spelled = procs.rows([None, None], 4)
    assert padded[0].args["ban_token"] == Padding((4,), -1, "int32")
    assert padded[0].args["flags"] == Padding((4, 2), True, "bool")
    assert padded[1].args["count_from"] == Padding((4,), 0, "int32") and padded[0].active == Padding((4,), 0, "bool")
    assert isinstance(padded[0].args["weights"], np.ndarray)
    for ours, theirs in zip(padded, spelled):
        for name in theirs.args:
            got, want = np.asarray(ours.args[name]), theirs.args[name]
            assert got.dtype == want.dtype and np.array_equal(got, want), name


def test_bad_processors_fail_at_start_and_bad_arguments_per_request(llms):
    Processors([EntropyTemperature], 256).check(history_len=16)  # (the docs' example traces)
    for cls, message in ((Raises, "does not trace: RuntimeError: broken processor"),
                         (WrongShape, "apply must return float32[2, 256]")):
        with pytest.raises(ValueError, match=message.replace("[", r"\[")):
            Processors([cls], 256).check(history_len=16)
    with pytest.raises(ValueError, match="'temperature' is a SamplingParams field"):
        Processors([type("Shadows", (BanToken,), {"args": {"temperature": np.float32(0)}})], 256)
    with pytest.raises(ValueError, match="module:Class"):
        load_class("NoModule")
    with pytest.raises(ValueError, match="cannot be imported"):
        load_class("processors:Missing")
    with pytest.raises(ValueError, match="not a subclass of jaxserve.LogitsProcessor"):
        load_class("numpy:ndarray")
    with pytest.raises(ValueError, match="ban_token must be a token id"):
        llms[0].generate([[1, 2]], SamplingParams(extra_args={"ban_token": 999}), use_tqdm=False)


def test_over_http(served, client):
    """vllm_xargs and top-level fields (the OpenAI SDK's extra_body) reach the processor; a bad
    argument is a 400; the per-request `logits_processors` field says where processors come from."""
    first = client.completions.create(model="jaxserve-tiny", prompt="abc", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    banned = first.choices[0].token_ids[0]
    for extra in ({"vllm_xargs": {"ban_token": banned}}, {"ban_token": banned}):
        out = client.completions.create(model="jaxserve-tiny", prompt="abc", max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
        assert banned not in out.choices[0].token_ids and out.choices[0].token_ids != first.choices[0].token_ids
    for stream in (False, True):  # (a stream too: refused before it starts)
        r = post(served, "/v1/completions", {"prompt": "abc", "vllm_xargs": {"ban_token": 100000}, "stream": stream})
        assert r.status_code == 400 and "ban_token must be a token id" in r.json()["error"]["message"]
    r = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                              "logits_processors": ["x:Y"]})
    assert r.status_code == 400 and "--logits-processors" in r.json()["error"]["message"]
