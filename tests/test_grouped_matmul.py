"""Grouped products (jaxserve_kernels/matmul/grouped.py) against float64 numpy, one expert at a time: random
group sizes with empty groups and rows past the groups, float and quantized weights; the TPU and
GPU path lowered for those platforms from this CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve_kernels import grouped_matmul_t, matmul_t
from jaxserve_kernels.matmul.grouped import chunk_rows
from jaxserve_kernels.matmul.quant import QuantizedWeight, dequantize, quantize

pytestmark = pytest.mark.usefixtures("ieee_float32")


def numpy_grouped(x: np.ndarray, w: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    out = np.zeros((x.shape[0], w.shape[1]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = x[start:start + size].astype(np.float64) @ w[g].astype(np.float64).T
        start += size
    return out


def random_sizes(rng, groups: int, rows: int) -> np.ndarray:
    """Sizes summing to at most `rows`, about a third of the groups empty."""
    sizes = rng.multinomial(rng.integers(0, rows + 1), np.ones(groups) / groups)
    sizes[rng.random(groups) < 0.3] = 0
    return sizes.astype(np.int32)


@pytest.mark.parametrize("impl", ["chunked", "ragged", "reference"])
@pytest.mark.parametrize("rows,groups,chunk", [(2, 8, None), (16, 5, None), (40, 3, 8), (37, 7, 1)])
def test_grouped_matmul_matches_float64(impl, rows, groups, chunk):
    rng = np.random.default_rng(rows * groups)
    x = rng.normal(size=(rows, 64)).astype(np.float32)
    w = rng.normal(size=(groups, 48, 64)).astype(np.float32)
    f = jax.jit(functools.partial(grouped_matmul_t, impl=impl, chunk=chunk))
    for _ in range(3):
        sizes = random_sizes(rng, groups, rows)
        np.testing.assert_allclose(np.asarray(f(x, w, sizes)), numpy_grouped(x, w, sizes), atol=1e-4, rtol=1e-4)
    sizes = np.zeros(groups, np.int32)  # no rows routed at all
    assert not np.asarray(f(x, w, sizes)).any()


@pytest.mark.parametrize("impl", ["chunked", "ragged"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_grouped_matmul_of_quantized_experts(impl, fmt):
    """A quantized stack multiplies as its dequantized matrices do ("ragged"), or as each group's rows
    through `matmul_t` of its quantized matrix, `chunk_rows` rows at a time ("chunked": the CPU kernel
    rounds x by the number of rows it is given, to int8 or to bfloat16 tiles, `quantized_forms`)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(24, 64)).astype(np.float32)
    w = quantize(rng.normal(size=(5, 32, 64)).astype(np.float32), fmt)
    assert w.shape == (5, 32, 64) and w.scales.shape == (5, 32, 2)
    sizes = np.array([7, 0, 9, 0, 5], np.int32)
    got = jax.jit(functools.partial(grouped_matmul_t, impl=impl))(x, w, sizes)
    want = numpy_grouped(x, np.asarray(dequantize(w)), sizes)
    if impl == "chunked":
        chunk, bounds = chunk_rows(len(x), len(sizes)), np.cumsum(sizes)
        want = np.zeros_like(want)
        for g in np.flatnonzero(sizes):
            for start in range(bounds[g] - sizes[g], bounds[g], chunk):
                rows = np.zeros((chunk, x.shape[1]), np.float32)
                part = x[start:min(start + chunk, bounds[g])]
                rows[:len(part)] = part
                matrix = QuantizedWeight(*(None if p is None else p[g] for p in w))
                want[start:start + len(part)] = np.asarray(matmul_t(rows, matrix))[:len(part)]
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def test_chunk_rows_follows_the_mean_group():
    assert [chunk_rows(r, 8) for r in (2, 16, 64, 256, 4096)] == [1, 2, 8, 32, 32]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_ragged_path_lowers_for_tpu_and_gpu(platform):
    """XLA's ragged dot, not a loop: what TPU and GPU run."""
    x = jnp.ones((16, 64), jnp.bfloat16)
    w = jnp.ones((4, 32, 64), jnp.bfloat16)
    sizes = jnp.array([4, 0, 8, 4], jnp.int32)
    fn = jax.jit(functools.partial(grouped_matmul_t, impl="ragged"))
    text = fn.trace(x, w, sizes).lower(lowering_platforms=(platform,)).as_text()
    assert "ragged_dot" in text and "while" not in text


@pytest.mark.parametrize("impl", ["chunked", "ragged", "reference"])
def test_a_bfloat16_stack_given_as_its_raw_bits(impl):
    """The form a model keeps a bfloat16 stack in on CPU (`kept_as_bits`) multiplies as the values."""
    from jaxserve_kernels.matmul.grouped import BITS

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((12, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 32, 64)), jnp.bfloat16)
    sizes = jnp.asarray([5, 0, 4, 3], jnp.int32)
    bits = jax.lax.bitcast_convert_type(w, BITS)
    np.testing.assert_array_equal(np.asarray(grouped_matmul_t(x, bits, sizes, impl=impl), np.float32),
                                  np.asarray(grouped_matmul_t(x, w, sizes, impl=impl), np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cpu_kernel_reads_each_matrix_in_place_in_the_stack(dtype):
    """On CPU, "chunked" hands the kernel the whole stack and the group (`stack_matmul_t`), never a
    copy of the matrix; the product equals matmul_t of the matrix, for every group, the last included."""
    from jaxserve_kernels.matmul import STACK_TARGET, implementation
    from jaxserve_kernels.matmul.grouped import stack_matmul_t

    if jax.default_backend() != "cpu" or implementation() != "cpu":
        pytest.skip("the CPU kernel runs on the CPU backend, where it can be built")
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(3, 64)), dtype)
    w = jnp.asarray(rng.normal(size=(4, 48, 64)), dtype)
    run = jax.jit(lambda x, w, g: stack_matmul_t(x, w, g, x.dtype))
    assert STACK_TARGET in run.lower(x, w, 0).as_text()
    for g in range(4):
        np.testing.assert_array_equal(np.asarray(run(x, w, g), np.float32), np.asarray(matmul_t(x, w[g]), np.float32))
