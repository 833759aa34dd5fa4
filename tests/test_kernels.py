"""The Pallas paged-attention kernels (TPU Mosaic, GPU Triton) on this CPU: run by Pallas'
interpreter against the jnp reference, lowered for `tpu` and `cuda`, and the TPU kernel under
the whole engine.

The interpreters start every output buffer as NaN (`test_interpreters_poison_outputs` checks
it), so a row a kernel forgets to write fails the comparison instead of passing as a zero.
"""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve_kernels import cache_dtype, paged_attention
from jaxserve_kernels.paged_attention.reference import to_cache

pytestmark = pytest.mark.usefixtures("ieee_float32")

KERNELS = {"tpu": ("tpu", "tpu_custom_call"), "gpu": ("cuda", "__gpu$xla.gpu.triton")}  # platform, custom call
# The GPU the Triton kernel is lowered for from this CPU: newer JAX reads the target's compute
# capability from the abstract mesh's device instead of from a local GPU.
TARGETS = {"tpu": None, "gpu": jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")}


def ragged_batch(rng, seqs, *, num_kv_heads, group, head_dim=32, page_size=8, width=8, rows=8, num_tokens=64,
                 dtype="float32"):
    """A step of sequences (cached, new): random pages in random order, the null page (0) behind
    every padded page-table entry, padding query rows and padding sequences."""
    num_pages = 1 + rows * width
    page_table = np.zeros((rows, width), np.int32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    for b, (cached, new) in enumerate(seqs):
        page_table[b, :-(-(cached + new) // page_size)] = [free.pop() for _ in range(-(-(cached + new) // page_size))]
    lens = [new for _, new in seqs]
    query_start = np.array([0, *np.cumsum(lens)] + [sum(lens)] * (rows - len(seqs)), np.int32)
    kv_lens = np.array([c + n for c, n in seqs] + [0] * (rows - len(seqs)), np.int32)
    q = rng.normal(size=(num_tokens, num_kv_heads * group, head_dim))
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    store = jnp.zeros((), cache_dtype(dtype))
    k_pages, v_pages = (to_cache(jnp.asarray(rng.normal(size=shape), dtype), store) for _ in range(2))
    return jnp.asarray(q, dtype), k_pages, v_pages, kv_lens, page_table, query_start, np.int32(len(seqs))


def as_float32(args):
    """The same step in float32 (bfloat16 values, exactly), as the reference's input."""
    q, k, v, *rest = args
    from jaxserve_kernels.paged_attention.reference import from_cache
    return (q.astype(jnp.float32), from_cache(k).astype(jnp.float32), from_cache(v).astype(jnp.float32), *rest)


ATTENTION = jax.jit(paged_attention, static_argnames=("sm_scale", "sliding_window", "soft_cap", "impl"))

# (cached, new): a 37-token prefill chunk after 3 cached, decodes, a fresh prompt, a length-1 sequence,
# lengths that are multiples of neither the page size (8) nor a tile
SEQS = [(3, 37), (20, 1), (0, 17), (0, 1), (45, 5), (60, 1)]


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
@pytest.mark.parametrize("group,dtype", [  # groups of 1 and 8 query heads per KV head: slow (the kernels
    # read the group size from the shapes, as they do for 4)
    pytest.param(1, "float32", marks=pytest.mark.slow), (4, "float32"), pytest.param(8, "float32", marks=pytest.mark.slow),
    (4, "bfloat16")])
def test_kernel_matches_reference(kernel, group, dtype):
    rng = np.random.default_rng(group)
    args = ragged_batch(rng, SEQS, num_kv_heads=2, group=group, dtype=dtype)
    ref_args = as_float32(args)
    real = int(args[5][-1])
    for window, cap in ((None, None), (9, None), (None, 4.0), (9, 4.0)):
        want = np.asarray(ATTENTION(*ref_args, sm_scale=0.2, sliding_window=window, soft_cap=cap, impl="reference"))
        got = np.asarray(ATTENTION(*args, sm_scale=0.2, sliding_window=window, soft_cap=cap,
                                   impl=f"{kernel}-interpret"), np.float32)
        np.testing.assert_allclose(got[:real], want[:real], atol=1e-5 if dtype == "float32" else 2e-2, rtol=0)
        np.testing.assert_array_equal(got[real:], 0.0)  # padding rows
        assert np.abs(want[:real]).max() > 0.1


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_kernel_block_sizes_and_a_decode_only_step(kernel):
    """Tiles of 1 row (decode only), and block sizes other than the defaults: several tiles per
    sequence, blocks of keys that end inside a page table."""
    from jaxserve_kernels.paged_attention.gpu import paged_attention_gpu
    from jaxserve_kernels.paged_attention.tpu import paged_attention_tpu

    fn = {"tpu": paged_attention_tpu, "gpu": paged_attention_gpu}[kernel]
    rng = np.random.default_rng(7)
    for seqs, options in (([(10, 1), (0, 1), (33, 1), (63, 1)], dict(num_tokens=4)),
                          (SEQS, dict(block_q=4, pages_per_block=4)),
                          (SEQS, dict(block_q=16, pages_per_block=1))):
        args = ragged_batch(rng, seqs, num_kv_heads=4, group=2, num_tokens=options.pop("num_tokens", 64))
        want = np.asarray(ATTENTION(*args, sm_scale=0.2, sliding_window=12, impl="reference"))
        run = jax.jit(functools.partial(fn, sm_scale=0.2, sliding_window=12, interpret=True, **options))
        np.testing.assert_allclose(np.asarray(run(*args)), want, atol=1e-5, rtol=0)


def test_interpreters_poison_outputs():
    """What the comparisons above rely on: an output element no kernel writes reads back as NaN in
    both interpreters."""
    def write_half(o_ref):
        o_ref[:4] = jnp.ones((4, 128), jnp.float32)

    shape = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    for interpret in (True, pltpu.InterpretParams()):
        out = np.asarray(pl.pallas_call(write_half, out_shape=shape, interpret=interpret)())
        assert np.all(out[:4] == 1.0) and np.all(np.isnan(out[4:]))


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
@pytest.mark.parametrize("dtype,kv_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                            ("float32", "bfloat16")])
def test_kernel_lowers_for_its_platform(kernel, dtype, kv_dtype):
    """Lowered from this CPU for the real platform (a window and a soft-cap, as Gemma 2's local
    layers): the module holds the kernel's custom call. On
    TPU/GPU the cache holds its values' dtype (no uint16 bits); a bfloat16 cache may serve a
    float32 model (`kv_cache_dtype`)."""
    platform, custom_call = KERNELS[kernel]
    rng = np.random.default_rng(0)
    for seqs, num_kv_heads, group, head_dim, num_tokens in (([(0, 40), (7, 1)], 2, 4, 128, 64),
                                                            ([(5, 1)] * 8, 8, 1, 64, 8),
                                                            ([(100, 12), (3, 4)], 1, 8, 128, 16)):
        q, k, v, *rest = ragged_batch(rng, seqs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                                      num_tokens=num_tokens, page_size=16, width=16)
        q, k, v = q.astype(dtype), *(jnp.asarray(rng.normal(size=k.shape), kv_dtype) for _ in range(2))
        fn = jax.jit(functools.partial(paged_attention, sm_scale=0.1, sliding_window=32, soft_cap=30.0, impl=kernel))
        target = TARGETS[kernel] and jax.sharding.AbstractMesh((1,), ("x",), abstract_device=TARGETS[kernel])
        with jax.sharding.use_abstract_mesh(target) if target else contextlib.nullcontext():
            text = fn.trace(q, k, v, *rest).lower(lowering_platforms=(platform,)).as_text()
        assert custom_call in set(re.findall(r"custom_call @([\w$.]+)", text)), platform


@pytest.mark.slow
def test_kernel_benchmark_runs_in_interpret_mode():
    """bench/paged_attention.py is for TPU/GPU VMs; its interpret mode keeps it working here."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "bench/paged_attention.py", "--interpret", "--repeats", "1"], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 2 ") or line.startswith("| 4 ")]
    assert len(rows) == 3 and "failed" not in out.stdout


def test_tpu_kernel_through_the_engine_matches_the_default_attention(tmp_path, monkeypatch):
    """The whole engine (prefill in chunks, a prefill beside a decode, sequences over several pages)
    with attention on the TPU Pallas kernel, run by Pallas' interpreter: the same greedy tokens as
    with the backend's own attention, and logprobs of prompt and output within float32 rounding.
    A fresh executable cache makes both engines trace their steps, so the kernel is seen called."""
    import importlib

    from jaxserve import LLM, SamplingParams

    dispatch = importlib.import_module("jaxserve_kernels.paged_attention")  # the module, not its function of that name

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(dispatch.ENV, raising=False)
    calls = []
    tpu_kernel = dispatch.IMPLEMENTATIONS["tpu"]
    monkeypatch.setitem(dispatch.IMPLEMENTATIONS, "tpu",
                        lambda *args, **options: calls.append(options) or tpu_kernel(*args, **options))
    settings = dict(model="jaxserve-tiny", max_model_len=32, page_size=8, max_num_seqs=2, max_num_batched_tokens=16)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (21, 3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    results = []
    for impl in (None, "tpu-interpret"):
        if impl:
            monkeypatch.setenv(dispatch.ENV, impl)
        results.append(LLM(**settings).generate(prompts, params, use_tqdm=False))
        assert bool(calls) == bool(impl) and all(options["interpret"] for options in calls)
    for want, got in zip(*results):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        entries = list(zip(want.prompt_logprobs[1:] + want.outputs[0].logprobs,
                           got.prompt_logprobs[1:] + got.outputs[0].logprobs))
        assert len(entries) == len(want.prompt_token_ids) - 1 + 8
        for w, g in entries:
            assert list(w)[0] == list(g)[0]  # the prompt's or the sampled token
            common = sorted(w.keys() & g.keys())
            np.testing.assert_allclose([g[t].logprob for t in common], [w[t].logprob for t in common],
                                       atol=1e-4, rtol=0)
