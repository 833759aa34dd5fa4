"""glibc's malloc set up on import (`jaxserve.host_memory`): on a CPU-only host an XLA:CPU executable's
temporaries reuse the memory of its last call instead of faulting in fresh pages each call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve import host_memory

ROOT = Path(__file__).resolve().parent.parent
# A step-like executable whose temporaries (48 MB: two running sums) are past glibc's largest mmap threshold
# and within a thread arena's 64 MB heap, run 60 times; then the median of the minor page faults of each of
# 15 more calls. The heap grows over the first calls (a call's temporaries may come before the last call's
# are freed, and small blocks split the free ones) and then stays: a server's steps run in that steady state.
SCRIPT = """
import resource
import statistics
import jaxserve  # noqa: F401
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.cumsum(x)[::64] + jnp.cumsum(x * 3.0)[::64])
x = jnp.ones(1 << 22, jnp.float32)
assert 32 << 20 < f.lower(x).compile().memory_analysis().temp_size_in_bytes < 64 << 20
for _ in range(60):
    jax.block_until_ready(f(x))
faults = []
for _ in range(15):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(f(x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(statistics.median(faults))
"""


def faults_per_call(**env: str) -> float:
    environ = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAXSERVE_MALLOC", "XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env={**environ, "PYTHONPATH": str(ROOT), **env},
                         capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not host_memory.cpu_only(), reason="glibc, CPU-only host")
def test_a_cpu_executables_temporaries_reuse_memory_across_calls():
    assert faults_per_call(JAX_PLATFORMS="cpu") < 500  # (the temporaries are 12,288 pages)
    assert faults_per_call(JAX_PLATFORMS="cpu", JAXSERVE_MALLOC="default") > 6_000  # glibc's defaults: fresh pages


def test_only_a_cpu_only_host_changes_malloc(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_memory.cpu_only()
    for platforms in ("tpu", "cuda", "cuda,cpu"):
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
        assert not host_memory.cpu_only() and not host_memory.reuse_freed_memory()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAXSERVE_MALLOC", "default")
    assert not host_memory.reuse_freed_memory()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD")
def test_the_server_runs_again_with_tcmalloc_only_where_the_system_has_it_and_nothing_else_was_chosen(monkeypatch):
    runs = []
    monkeypatch.setattr(host_memory.os, "execve", lambda path, argv, env: runs.append((path, argv, env)))
    monkeypatch.setattr(host_memory.ctypes.util, "find_library",
                        lambda name: "libtcmalloc_minimal.so.4" if name == "tcmalloc_minimal" else None)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("JAXSERVE_MALLOC", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("TCMALLOC_RELEASE_RATE", raising=False)
    host_memory.preload_tcmalloc()
    assert runs == [(sys.executable, sys.orig_argv, {**os.environ, "LD_PRELOAD": "libtcmalloc_minimal.so.4",
                                                      "JAXSERVE_MALLOC": "tcmalloc", "TCMALLOC_RELEASE_RATE": "0"})]
    monkeypatch.setenv("TCMALLOC_RELEASE_RATE", "2")  # (the user's, kept)
    host_memory.preload_tcmalloc()
    assert runs[-1][2]["TCMALLOC_RELEASE_RATE"] == "2"
    monkeypatch.setenv("LD_PRELOAD", "libother.so")  # (kept, after it)
    host_memory.preload_tcmalloc()
    assert runs[-1][2]["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:libother.so"
    for name, value in (("LD_PRELOAD", "libjemalloc.so.2"), ("JAXSERVE_MALLOC", "glibc"), ("JAX_PLATFORMS", "tpu")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            host_memory.preload_tcmalloc()
    monkeypatch.setattr(host_memory.ctypes.util, "find_library", lambda name: None)  # (not on the system)
    host_memory.preload_tcmalloc()
    assert len(runs) == 3
