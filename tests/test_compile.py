"""Serving never compiles: every step runs a step bucket compiled before it, whether all of them
were compiled before serving or only the first, with the rest compiling in the background."""

from __future__ import annotations

import logging
import threading
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import CROWDED_ENGINE

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.build import build_engine
from jaxserve.engine.core import Engine
from jaxserve.structured_output.grammar import Constraint
from jaxserve.worker import warmup


class CompileCounter:
    """Counts jaxpr traces and backend compiles reported through jax.monitoring
    (`test_counter_sees_a_compilation` guards against the event names changing); with `thread`, only
    those of that thread (jax reports each in the thread that compiles)."""

    TRACE, LOWER, COMPILE = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                             "/jax/core/compile/backend_compile_duration")

    def __init__(self, events=(TRACE, COMPILE), thread: threading.Thread | None = None):
        self.events = events
        self.thread = thread
        self.count = 0

    def __call__(self, event: str, duration: float, **kwargs):
        if event in self.events and self.thread in (None, threading.current_thread()):
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


# llama.cpp's samplers, each request with one set (or none)
LLAMACPP = [{}, {"mirostat": 2}, {"dry_multiplier": 0.8, "dry_sequence_breakers": ["a", "bc"]}, {"typical_p": 0.7},
            {"mirostat": 1, "mirostat_tau": 3.0}, {"xtc_probability": 0.5, "min_keep": 2}, {"top_n_sigma": 1.5},
            {"dynatemp_range": 0.5}, {}]


def test_a_hundred_mixed_requests_after_warmup_compile_nothing():
    """Mixed lengths, sampling settings (top-k and top-p within and past the sampler's candidates),
    penalties, biases, n, stop strings, logprobs, prompt logprobs, allowed tokens, bad words,
    grammars and llama.cpp's samplers."""
    llm = LLM("jaxserve-tiny", **CROWDED_ENGINE)
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
            bad_words=["ab", "x"] if i % 16 == 0 else [], **LLAMACPP[i % len(LLAMACPP)]))
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


def test_executable_key_covers_every_source_file():
    """An executable saved by one version of the model code must never load under another: the key
    hashes every source file of jaxserve/ and jaxserve_kernels/ (it once hashed none, from a path one folder
    short, and executables outlived changes to the layers)."""
    from jaxserve.models import layers
    from jaxserve.worker.executables import source_files
    from jaxserve_kernels.paged_attention import cpu

    _, files = source_files()
    for module in (layers, cpu):
        assert Path(module.__file__).resolve() in files
    assert cpu.SOURCE.resolve() in files  # (the C++ sources too)


def test_executable_key_follows_the_attention_choice_the_arguments_and_the_devices(tmp_path, monkeypatch):
    """Tests switch the attention implementation through the environment within one process: the
    executable saved for one choice must never be loaded for another. Nor onto other devices (a
    data-parallel replica's): it loads only onto those it was compiled for."""
    from jaxserve.worker.executables import ExecutableCache

    cache = ExecutableCache(tmp_path)
    args = (jax.numpy.zeros((2, 3)),)
    monkeypatch.delenv("JAXSERVE_ATTENTION", raising=False)
    devices = jax.devices()[:1]
    default = cache.path(args, "step", devices)
    monkeypatch.setenv("JAXSERVE_ATTENTION", "tpu-interpret")
    assert cache.path(args, "step", devices) != default
    monkeypatch.delenv("JAXSERVE_ATTENTION")
    assert cache.path(args, "step", devices) == default
    assert cache.path((jax.numpy.zeros((2, 4)),), "step", devices) != default
    assert cache.path(args, "another bucket", devices) != default
    assert cache.path(args, "step", [types.SimpleNamespace(id=devices[0].id + 1)]) != default


class Gate:
    """Holds back the compilation of each of the runner's buckets until it is let through."""

    def __init__(self, engine: Engine):
        self.let = set()
        self.changed = threading.Condition()
        compile_now = engine.runner.compile

        def gated(shape):
            with self.changed:
                self.changed.wait_for(lambda: shape in self.let)
            compile_now(shape)

        engine.runner.compile = gated

    def through(self, *shapes):
        with self.changed:
            self.let.update(shapes)
            self.changed.notify_all()


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], set]:
    """Each prompt's generated tokens, stepping the engine on this thread; and the step buckets run."""
    seqs = [engine.add_request(str(i), prompt, params) for i, prompt in enumerate(prompts)]
    shapes, shape = set(), engine.runner.shape

    def recorded(batch):
        shapes.add(shape(batch))
        return shape(batch)

    engine.runner.shape = recorded
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        del engine.runner.shape
    return [seq.output_token_ids for seq in seqs], shapes


def test_serving_starts_on_the_first_bucket_and_steps_run_only_compiled_ones():
    """The server's warm-up (run_server.py's default): ready once the first bucket of the order (one
    token, the widest page table) is compiled; until more are, steps take one token and run it, a
    long prompt included; as others compile in the background, steps take more tokens and use them.
    No step compiles, and the tokens are those of the engine compiled in full."""
    settings = dict(model="jaxserve-tiny", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, seed=3,
                    page_table_widths="4x")
    prompts = [list(range(30, 70)), [5, 6, 7, 8, 9], list(range(100, 120))]  # the first needs 3 pages
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=11)
    want = [o.outputs[0].token_ids for o in LLM(**settings).generate(prompts, params, use_tqdm=False)]

    engine, _ = build_engine(EngineConfig(**settings), warmup=False)
    order = engine.config.warmup_order
    assert order[0] == (1, 1, 8) and set(order) == set(engine.config.step_buckets)
    assert engine.runner.cached_prefix(order) == len(order)  # (the LLM above compiled them all: a restart)
    engine.runner.cached_prefix = lambda shapes: 0  # (a first start: ready after the first bucket alone)
    gate = Gate(engine)
    gate.through(order[0])
    engine.warmup(background=True)
    assert engine.is_ready and engine.compile_progress == (1, len(order)) and engine.runner.token_budget() == 1
    with CompileCounter(thread=threading.current_thread()) as counter:
        got, shapes = generate(engine, prompts, params)
        assert got == want and shapes == {order[0]}

        gate.through(order[1])  # (4, 4, 8): steps of up to 4 tokens now
        engine.compiler.wait(2)
        assert engine.runner.token_budget() == 4
        got, shapes = generate(engine, prompts, params)
        assert got == want and shapes <= set(order[:2]) and (4, 4, 8) in shapes

        gate.through(*order)
        got, _ = generate(engine, prompts, params)  # while the others compile
        assert got == want
        engine.compiler.wait(len(order))
        got, shapes = generate(engine, prompts, params)
        assert got == want and (16, 4, 4) in shapes and engine.runner.token_budget() == 16
    assert counter.count == 0
    engine.close()


def test_buckets_past_the_memory_map_limit_are_left_out_not_crashed_into(monkeypatch, caplog):
    """Linux's vm.max_map_count: once fewer than MAP_RESERVE maps are left, the buckets left are not
    compiled (loading or compiling the next one would crash XLA); the engine serves on those it has,
    the log says once how to raise the limit, and its progress lines count the failed ones apart."""
    settings = dict(model="jaxserve-tiny", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, seed=3)
    engine, _ = build_engine(EngineConfig(**settings), warmup=False)
    order = engine.config.warmup_order
    engine.runner.cached_prefix = lambda shapes: 0  # (ready after the first bucket alone)
    headroom = iter([10**6])  # enough for the first bucket only
    monkeypatch.setattr(warmup, "map_headroom", lambda: next(headroom, warmup.MAP_RESERVE - 1))
    with caplog.at_level(logging.INFO, logger=warmup.__name__):
        engine.warmup(background=True)
        with pytest.raises(RuntimeError, match="compiling the step for bucket") as failed:
            engine.compiler.wait(len(order))
        engine.compiler.close()
    assert isinstance(failed.value.__cause__, warmup.MapsExhausted)
    assert engine.compile_progress == (1, len(order))
    said = [r.getMessage() for r in caplog.records if "vm.max_map_count" in r.getMessage()]
    assert len(said) == 1 and "sysctl -w vm.max_map_count=" in said[0]
    progress = [r.getMessage() for r in caplog.records if "step buckets compiled" in r.getMessage()]
    assert all(line.startswith(f"1 of {len(order)} ") for line in progress) and "1 failed" in " ".join(progress)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    got, shapes = generate(engine, [list(range(30, 50)), [5, 6, 7]], params)
    assert [len(tokens) for tokens in got] == [5, 5] and shapes == {order[0]}
    engine.close()


def test_a_restart_serves_once_every_bucket_the_executable_cache_holds_is_loaded():
    """A restart loads the buckets it compiled before (moments each) before it is ready, so its first
    requests run in every step shape; only the buckets missing from the cache compile in the background."""
    settings = dict(model="jaxserve-tiny", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16)
    LLM(**settings)  # (every bucket compiled and saved)
    engine, _ = build_engine(EngineConfig(**settings), warmup=False)
    engine.warmup(background=True)
    assert engine.is_ready and engine.compile_progress == (len(engine.config.step_buckets),) * 2
    engine.close()


def test_page_table_widths_follow_the_attention(monkeypatch):
    """The C++ CPU kernel reads only each sequence's own pages, so a narrower table gains nothing:
    one width, the widest (a third of the step buckets here); an attention that reads the whole
    table (the XLA form) keeps widths in steps of 4x. Nothing is compiled to know."""
    settings = EngineConfig(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=16)
    monkeypatch.setenv("JAXSERVE_ATTENTION", "cpu")
    engine, _ = build_engine(settings, warmup=False)
    assert engine.config.page_buckets == (64,) and len(engine.config.step_buckets) == 3
    monkeypatch.setenv("JAXSERVE_ATTENTION", "xla")
    engine, _ = build_engine(settings, warmup=False)
    assert engine.config.page_buckets == (4, 16, 64) and len(engine.config.step_buckets) == 9
    assert engine.config.warmup_order[:3] == ((1, 1, 64), (4, 4, 64), (16, 4, 64))
