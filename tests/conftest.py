"""Shared fixtures: tiny HF checkpoints on disk and small engine settings that compile fast."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import jax
import openai
import pytest
from server import ENGINE, MAX_MODEL_LEN, MODEL, Server, free_port

# Engine settings for tests: 2 token buckets x 2 page buckets keep warm-up short,
# and the 32-token budget forces prefill into chunks.
SMALL_ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, page_size=16)
# 23 usable pages of 16 tokens for up to 16 sequences: preemption is routine. The tests that want
# it share these settings, so jaxserve-tiny's steps for them compile once (the executable cache).
CROWDED_ENGINE = dict(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, num_pages=24)


def needs_cpu_backend() -> None:
    """Skips a test of the CPU kernels (or of the CPU backend's defaults) on any other backend, where the
    "cpu" implementations refuse to run."""
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU kernels (and these defaults) are the CPU backend's")


X86_64_V2 = ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")  # what -march=x86-64-vN may use
X86_64_V3 = (*X86_64_V2, "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")


def build_for_other_cpu(flags: str, needs: tuple[str, ...], monkeypatch, tmp_path) -> None:
    """The CPU kernels the test builds from here on: with `flags` after -march=native (a compiler
    wrapper), into a cache of their own. Skips the test where this CPU cannot run that build (Linux's
    flags for it lack `needs`)."""
    needs_cpu_backend()
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    cpu_flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
    if platform.machine() != "x86_64" or not cpu_flags.issuperset(needs):
        pytest.skip("this CPU cannot run that build")
    from jaxserve_kernels.cpu import build

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\nexec {compiler} "$@" {flags}\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build._library.cache_clear()


@pytest.fixture
def ieee_float32():
    """float32 products in float32 for the test's duration: on GPU, JAX's default precision multiplies
    float32 operands in TF32 (10-bit mantissas: errors near 1e-3), while the kernel tests' tolerances
    (1e-5) assume the IEEE products the CPU backend computes. Set globally (the engine's threads see it
    too), and only off the CPU backend, where nothing changes."""
    if jax.default_backend() == "cpu":
        yield
        return
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", before)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """name -> (torch model, directory with its HF checkpoint); built once per session. torch is
    imported here, by the tests that use it, so the rest run where torch is not installed."""
    from hf_models import build_hf_model, save_hf_model

    cache = {}

    def get(name: str):
        if name not in cache:
            model = build_hf_model(name)
            cache[name] = (model, save_hf_model(model, tmp_path_factory.mktemp(name)))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def served():
    """(Server, AsyncEngine): the real HTTP server over jaxserve-tiny, shared by the API tests."""
    from api.app import create_app
    from api.limits import Limits
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.build import build_engine

    engine, tokenizer = build_engine(EngineConfig(**ENGINE))
    async_engine = AsyncEngine(engine, tokenizer)
    async_engine.start()
    limits = Limits(MODEL, MAX_MODEL_LEN, engine.model_config.vocab_size, processor_args=engine.processors.arg_names)
    server = Server(create_app(async_engine, limits), free_port())
    yield server, async_engine
    server.stop()
    async_engine.shutdown()


@pytest.fixture(scope="session")
def offline():
    """The offline LLM over jaxserve-tiny with the served engine's settings: what the API's answers are
    compared with."""
    from jaxserve import LLM

    return LLM(**ENGINE)


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)
