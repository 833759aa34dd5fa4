"""After warm-up, serving never compiles: every step shape is a pre-compiled bucket."""

from __future__ import annotations

import jax
import numpy as np

from conftest import CROWDED_ENGINE

from jaxserve import LLM, SamplingParams
from jaxserve.structured import Constraint


class CompileCounter:
    """Counts jaxpr traces and backend compiles reported through jax.monitoring
    (`test_counter_sees_a_compilation` guards against the event names changing)."""

    TRACE, LOWER, COMPILE = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                             "/jax/core/compile/backend_compile_duration")

    def __init__(self, events=(TRACE, COMPILE)):
        self.events = events
        self.count = 0

    def __call__(self, event: str, duration: float, **kwargs):
        if event in self.events:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def test_a_hundred_mixed_requests_after_warmup_compile_nothing():
    """Mixed lengths, sampling settings (top-k and top-p within and past the sampler's candidates),
    penalties, biases, n, stop strings, logprobs, prompt logprobs, allowed tokens, bad words and
    grammars."""
    llm = LLM(**CROWDED_ENGINE)
    rng = np.random.default_rng(0)
    prompts, params = [], []
    for i in range(100):
        prompts.append(rng.integers(0, 256, size=int(rng.integers(1, 90))).tolist())
        params.append(SamplingParams(
            max_tokens=int(rng.integers(1, 30)), temperature=float(rng.choice([0.0, 0.7, 1.5])),
            top_k=int(rng.choice([-1, 1, 5, 100])), top_p=float(rng.choice([1.0, 0.8, 0.99])),
            min_p=float(rng.choice([0.0, 0.1])), seed=int(rng.integers(0, 2**40)) if i % 3 else None,
            ignore_eos=bool(i % 2), stop_token_ids=[int(rng.integers(0, 256))] if i % 4 == 0 else [],
            presence_penalty=0.5 if i % 5 == 0 else 0.0, frequency_penalty=0.3 if i % 13 == 0 else 0.0, repetition_penalty=1.3 if i % 6 == 0 else 1.0,
            logit_bias={65: 3.0} if i % 7 == 0 else {}, min_tokens=2 if i % 8 == 0 else 0,
            n=2 if i % 9 == 0 else 1, stop=["ab"] if i % 10 == 0 else [], logprobs=3 if i % 11 == 0 else None,
            constraint=Constraint("regex", "[a-z]{3,9}") if i % 12 == 0 else None,
            prompt_logprobs=2 if i % 14 == 0 else None, allowed_token_ids=list(range(60, 90)) if i % 15 == 0 else None,
            bad_words=["ab", "x"] if i % 16 == 0 else []))
    with CompileCounter() as counter:
        outputs = llm.generate(prompts, params)
    assert counter.count == 0
    assert all(o.finished for o in outputs)
    assert llm.engine.scheduler.num_preemptions > 0  # the mix includes preemption and recompute


def test_counter_sees_a_compilation():
    with CompileCounter() as counter:
        jax.jit(lambda x: x * 3 + 1)(np.arange(7))
    assert counter.count >= 1


def test_a_restart_loads_every_bucket_from_the_executable_cache(tmp_path, monkeypatch, caplog):
    """The second engine of a configuration neither traces nor compiles its step: each bucket's
    executable comes from the disk cache, and generates the same tokens. A damaged entry is
    compiled again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a fresh cache (and a fresh jaxserve-tiny)
    settings = dict(model="jaxserve-tiny", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, seed=3)
    prompts = [[5, 6, 7, 8, 9], list(range(40, 61))]
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=11)
    with CompileCounter() as counter:
        first = LLM(**settings)
    assert counter.count > 0
    buckets = len(first.engine.config.step_buckets)
    entries = sorted((tmp_path / "jaxserve" / "executables").glob("*.executable"))
    assert len(entries) == buckets
    want = [o.outputs[0].token_ids for o in first.generate(prompts, params)]

    with CompileCounter(events=(CompileCounter.LOWER, CompileCounter.COMPILE)) as counter:
        # (loading the weights traces the model's shapes, nothing more; settings only the host reads
        # may differ)
        second = LLM(**{**settings, "seed": 4, "enable_prefix_caching": False})
    assert counter.count == 0
    assert [o.outputs[0].token_ids for o in second.generate(prompts, params)] == want

    entries[0].write_bytes(b"not an executable")
    third = LLM(**settings)
    assert "compiling it again" in caplog.text
    assert [o.outputs[0].token_ids for o in third.generate(prompts, params)] == want
    assert len(list(entries[0].parent.glob("*.executable"))) == buckets


def test_executable_key_follows_the_attention_choice_and_the_arguments(tmp_path, monkeypatch):
    """Tests switch the attention implementation through the environment within one process: the
    executable saved for one choice must never be loaded for another."""
    from jaxserve.executables import ExecutableCache

    cache = ExecutableCache(tmp_path)
    args = (jax.numpy.zeros((2, 3)),)
    monkeypatch.delenv("JAXSERVE_ATTENTION", raising=False)
    default = cache.path(args, "step")
    monkeypatch.setenv("JAXSERVE_ATTENTION", "tpu-interpret")
    assert cache.path(args, "step") != default
    monkeypatch.delenv("JAXSERVE_ATTENTION")
    assert cache.path(args, "step") == default
    assert cache.path((jax.numpy.zeros((2, 4)),), "step") != default
    assert cache.path(args, "another bucket") != default
