"""y = x w^T: the CPU kernels (float and quantized weights) against float64 numpy, on random inputs, at
decode and prefill row counts; which implementation matmul_t picks; the CPU kernels' fallback without a
compiler."""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import shutil
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import X86_64_V2, X86_64_V3, build_for_other_cpu, needs_cpu_backend

from jaxserve_kernels.matmul import (FLOAT_MANY_TARGET, KERNEL_MAX_ROWS, MANY_TARGET, QUANT_SOURCE, QUANT_TARGETS,
                                     TARGET, WIDEN_TARGET, _operands, bf16_tiles, implementation, live_rows, matmul_t,
                                     matmul_t_many, native_bf16, quantized_forms, row_limit)
from jaxserve_kernels.matmul.quant import (BLOCK, GROUP_ROWS, GroupedRows, QuantizedWeight, dequantize, group_rows,
                                           nbytes, quantize, take_rows, ungroup_rows)

pytestmark = pytest.mark.usefixtures("ieee_float32")


@pytest.mark.parametrize("impl", ["xla", "cpu"])
@pytest.mark.parametrize("x_dtype,w_dtype,out_dtype", [("float32", "float32", None), ("bfloat16", "bfloat16", None),
                                                       ("bfloat16", "bfloat16", "float32"),
                                                       ("float32", "bfloat16", None)])
def test_matmul_t_matches_float64(impl, x_dtype, w_dtype, out_dtype):
    if impl == "cpu":
        needs_cpu_backend()
    rng = np.random.default_rng(0)
    # rows: the dot form (under 16 rows): one, tiles with a remainder of one and of two rows (tiles
    # take 3 rows of x against a float32 w, 2 against a bfloat16 one); the panel form (16 rows and
    # more): one whole panel, a remainder of one row, several panels and work items; in: with and
    # without a tail past the 8 lanes (16 values for bfloat16 weights); out: a tile's remainders,
    # and more than one work item's block of weight rows (64 in the dot form, 96 in the panel form).
    # Where the CPU has bfloat16 instructions, bfloat16 x and w of an even `in` take pair panels
    # from 16 rows on, 3 panels x 8 rows of w per tile: tiles of 1 panel (16 rows), of 3 whose last
    # has one row (33), of 2 (80 = 3 + 2 panels); an odd `in` (20 x 13) keeps the widening form.
    for rows, d_in, d_out in [(1, 96, 7), (2, 13, 64), (7, 40, 129), (5, 24, 9), (16, 40, 200), (33, 768, 70),
                              (200, 24, 5), (80, 64, 30), (20, 13, 100)]:
        x = jnp.asarray(rng.standard_normal((rows, d_in)), x_dtype)
        w = jnp.asarray(rng.standard_normal((d_out, d_in)), w_dtype)
        got = jax.jit(lambda x, w: matmul_t(x, w, out_dtype, impl=impl))(x, w)
        assert got.dtype == jnp.dtype(out_dtype or x_dtype)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        tol = 2e-5 if got.dtype == jnp.float32 else 2**-8  # bfloat16 output: its rounding
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * np.sqrt(d_in))


@pytest.mark.parametrize("weight", ["float32", "bfloat16", "int8", "int4", "int4 grouped, two"])
@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
def test_within_live_rows_the_kernels_compute_the_first_rows_as_without_and_zero_the_rest(weight, x_dtype):
    """A step's padding rows cost its products nothing: the rows of x before the live count come out
    bit for bit as the whole product's (the form follows from x's rows, padding included), the others
    zero; a count past the rows takes them all, a negative one none."""
    needs_cpu_backend()
    rng = np.random.default_rng(3)
    for rows in (5, 40):  # (the dot form; the panel, pair-panel or tile form)
        x = jnp.asarray(rng.standard_normal((rows, 64)), x_dtype)
        if weight in ("float32", "bfloat16"):
            ws = [jnp.asarray(rng.standard_normal((24, 64)), weight)]
        else:
            ws = [_random_quantized(rng, (32, 64), weight[:4]) for _ in range(1 + weight.endswith("two"))]
            ws = [group_rows(w) for w in ws] if "grouped" in weight else ws

        def products(x, live, ws=ws):
            with live_rows(live):
                return matmul_t_many(x, ws, impl="cpu")

        whole = jax.jit(lambda x, ws=ws: matmul_t_many(x, ws, impl="cpu"))(x)
        for live in (0, 1, 3, 17, rows, rows + 9, -2):
            kept = min(max(live, 0), rows)
            for got, want in zip(jax.jit(products)(x, jnp.int32(live)), whole):
                assert np.array_equal(np.asarray(got[:kept]), np.asarray(want[:kept])), (rows, live)
                assert not np.asarray(got[kept:]).any(), (rows, live)


def _ffi_targets(eqns) -> list[str]:
    return [e.params["target_name"] for e in eqns if e.primitive.name == "ffi_call"]


@pytest.mark.parametrize("x_dtype,w_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                             ("float32", "bfloat16")])
def test_by_default_the_kernel_runs_up_to_its_row_limit_then_xla_in_float32(x_dtype, w_dtype):
    """Past KERNEL_MAX_ROWS rows, XLA's dot runs, on float32 operands (a bfloat16 weight widened
    first, by the kernel's widening call): XLA:CPU's float32 products beat the kernel there, its
    bfloat16 ones do not. Where the CPU has bfloat16 instructions, bfloat16 x and w stay in the
    kernel at any row count."""
    needs_cpu_backend()
    w = jnp.ones((8, 16), w_dtype)
    limit = row_limit(x_dtype, w_dtype)
    native = x_dtype == w_dtype == "bfloat16" and native_bf16()
    assert limit == (math.inf if native else KERNEL_MAX_ROWS[w.dtype])
    for rows, kernel in ((4096, True),) if native else ((limit, True), (limit + 1, False)):
        eqns = jax.make_jaxpr(lambda x: matmul_t(x, w))(jnp.ones((rows, 16), x_dtype)).eqns
        widened = not kernel and w_dtype == "bfloat16"
        assert _ffi_targets(eqns) == [TARGET] * kernel + [WIDEN_TARGET] * widened, rows
        dots = [e for e in eqns if e.primitive.name == "dot_general"]
        assert len(dots) == (not kernel) and all(v.aval.dtype == jnp.float32 for e in dots for v in e.invars)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((4096 if native else limit + 1, 40)), x_dtype)
    w = jnp.asarray(rng.standard_normal((9, 40)), w_dtype)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    tol = 2e-5 if x_dtype == "float32" else 2**-8
    np.testing.assert_allclose(np.asarray(jax.jit(matmul_t)(x, w), np.float64), want, rtol=tol, atol=tol * np.sqrt(40))


def test_bfloat16_weights_are_widened_layer_by_layer():
    """Past the row limit each bfloat16 weight is widened only once its layer's input exists, so the
    float32 copies of a chain of layers are not all live at once (a plain convert was run for every
    layer at the start of the step: 306 MB of temporaries in a 512-token bench-125m step). (x in
    float32: bfloat16 x is never widened where the CPU has bfloat16 instructions.)"""
    needs_cpu_backend()
    rows, d, layers = KERNEL_MAX_ROWS[jnp.dtype(jnp.bfloat16)] + 1, 256, 12
    rng = np.random.default_rng(3)
    ws = [jnp.asarray(rng.standard_normal((d, d)) / 16, jnp.bfloat16) for _ in range(layers)]

    def chain(x, ws):
        outs = []
        for w in ws:
            x = matmul_t(x, w)
            outs.append(x)
        return outs

    x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
    compiled = jax.jit(chain).lower(x, ws).compile()
    widened_bytes = layers * d * d * 4
    assert compiled.memory_analysis().temp_size_in_bytes < widened_bytes / 3  # (about 3 float32 [rows, d] buffers)
    for x, w, got in zip([x, *compiled(x, ws)], ws, compiled(x, ws)):  # each layer against its input
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-8, atol=2**-8 * np.sqrt(d))


def test_the_kernel_multiplies_bfloat16_natively_where_the_cpu_can():
    """Where the compiler, building for this CPU, has its bfloat16 instructions (AVX512_BF16)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    macros = subprocess.run([compiler, "-march=native", "-dM", "-E", "-x", "c++", "-"], input="",
                            capture_output=True, text=True).stdout
    assert native_bf16() == ("__AVX512BF16__" in macros.split())
    amx = {"__AMX_TILE__", "__AMX_BF16__", "__AVX512BF16__"} <= set(macros.split())
    assert bf16_tiles() <= amx and bf16_tiles() == ("tile" in quantized_forms())  # (the same tiles, permitted once)


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_bfloat16_tiles_match_float64(out_dtype):
    """The tile form (cpu.cc on AMX: K a multiple of 32) against float64: 16 x 16 tiles, 2 x 2 at a
    time, so rows of x and of w that leave one tile, a partial one, or one of two; w's last rows past
    its end copied beside zeros (out under 32, or not a multiple of 32); several work items of w and
    of x (160 rows of x per item at K = 768)."""
    needs_cpu_backend()
    if not bf16_tiles():
        pytest.skip("this CPU (or Linux) gives the kernel no AMX tiles")
    rng = np.random.default_rng(3)
    for rows, d_in, d_out in [(1, 64, 40), (8, 32, 5), (9, 64, 33), (31, 96, 64), (47, 128, 100), (200, 768, 70),
                              (64, 576, 1000), (16, 1536, 48)]:
        x = jnp.asarray(rng.standard_normal((rows, d_in)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((d_out, d_in)), jnp.bfloat16)
        got = jax.jit(lambda x, w: matmul_t(x, w, out_dtype, impl="cpu"))(x, w)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        tol = 2e-5 if out_dtype == "float32" else 2**-8  # (exact products: float32 sums, or bfloat16's rounding)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * np.sqrt(d_in))


def test_matmul_t_keeps_leading_dimensions():
    needs_cpu_backend()
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 3, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)
    got = matmul_t(x, w, impl="cpu")
    assert got.shape == (2, 3, 5)
    np.testing.assert_allclose(got, np.einsum("abk,nk->abn", x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["attention", "matmul"])
def test_without_a_compiler_the_cpu_kernels_fall_back_to_xla(kernel, monkeypatch, tmp_path, caplog):
    """The CPU kernels are built on first use; where they cannot be, the CPU backend's default becomes
    the XLA implementation (with a warning), and asking for "cpu" by name is an error."""
    from jaxserve_kernels import implementation as attention_implementation
    from jaxserve_kernels.cpu import build

    needs_cpu_backend()
    resolve = attention_implementation if kernel == "attention" else implementation
    assert resolve() == "cpu"  # this machine builds it
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build._register.cache_clear()
    build._library.cache_clear()
    try:
        assert resolve() == "xla"
        assert "falls back to its XLA implementation" in caplog.text
        with pytest.raises(ValueError, match="could not be built"):
            resolve("cpu")
    finally:
        build._register.cache_clear()
        build._library.cache_clear()


def _random_quantized(rng, shape, fmt) -> QuantizedWeight:
    return jax.tree.map(jnp.asarray, quantize(rng.standard_normal(shape, np.float32), fmt))


def _quantized_tolerance(x, w, out_dtype, roundings) -> np.ndarray:
    """The bound on |y - x w^T| [M, N] (float64 numpy x and w): float32 sums (1e-5 of sum |x| |w|),
    then per rounding that may have run: "int8 x", x quantized per block of 32 (each value within
    half its block's step, max |x| / 127: see quant_vnni.h); "bfloat16", x or w or both rounded to
    bfloat16 (each within 2^-9 of itself); then y's own rounding to bfloat16."""
    rows, k = x.shape
    magnitude = np.abs(x) @ np.abs(w).T
    bound = 1e-5 * magnitude + (2**-8 * magnitude if "bfloat16" in roundings else 0)
    if "int8 x" in roundings:
        step = np.abs(x).reshape(rows, k // BLOCK, BLOCK).max(-1) / 127  # [M, blocks]
        w_mass = np.abs(w).reshape(len(w), k // BLOCK, BLOCK).sum(-1)  # [N, blocks]
        bound = bound + 0.51 * step @ w_mass.T
    want = x @ w.T
    return bound + (2**-8 * (np.abs(want) + bound) if out_dtype == jnp.bfloat16 else 0)


def _kernel_roundings(forms, grouped: bool = False) -> set[str]:
    """What the kernel's `forms` may round: the integer forms quantize x to int8, except where the build
    also has the float form (AVX2), which multiplies the weights in rows and rounds nothing."""
    integer = "integer" in forms and (grouped or "float" not in forms)
    return ({"int8 x"} if integer else set()) | ({"bfloat16"} if "tile" in forms else set())


@pytest.mark.parametrize("impl", ["xla", "cpu"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("x_dtype,out_dtype", [("float32", None), ("bfloat16", None), ("bfloat16", "float32"),
                                               ("float32", "bfloat16")])
def test_quantized_matmul_t_matches_float64(impl, fmt, x_dtype, out_dtype):
    """Against x times the dequantized weight in float64. rows: the dot form (under 16: 1, 3 of one
    4-row tile) and the panel form (16 rows on: one panel, a remainder of one row, several panels
    and work items); in: every count of blocks left over by the dot form's steps (int8 takes two
    blocks per step, int4 four) and none, more than 16 blocks (its scales come 16 at a time); out:
    odd, a tile's remainders, several work items."""
    if impl == "cpu":
        needs_cpu_backend()
    rng = np.random.default_rng(4)
    for rows, d_in, d_out in [(1, 64, 7), (3, 96, 129), (16, 544, 13), (17, 96, 101), (100, 160, 33), (300, 64, 99),
                              (1, 544, 301), (2, 128, 9), (4, 576, 40)]:
        x = jnp.asarray(rng.standard_normal((rows, d_in)), x_dtype)
        w = _random_quantized(rng, (d_out, d_in), fmt)
        got = jax.jit(lambda x, w: matmul_t(x, w, out_dtype, impl=impl))(x, w)
        assert got.dtype == jnp.dtype(out_dtype or x_dtype) and got.shape == (rows, d_out)
        x64, w64 = np.asarray(x, np.float64), np.asarray(dequantize(w), np.float64)
        roundings = (_kernel_roundings(quantized_forms()) if impl == "cpu"
                     else {"bfloat16"} if x_dtype == "bfloat16" else set())  # (the reference's w in x's dtype)
        tolerance = _quantized_tolerance(x64, w64, got.dtype, roundings)
        error = np.abs(np.asarray(got, np.float64) - x64 @ w64.T)
        assert (error <= tolerance).all(), (rows, d_in, d_out, (error / tolerance).max())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("x_dtype,out_dtype", [("float32", None), ("bfloat16", None), ("bfloat16", "float32")])
def test_matmul_t_many_equals_one_product_each(fmt, x_dtype, out_dtype):
    """Several weights of one format against one x take one kernel call, whose ys equal those of one
    call each bit for bit: at decode row counts (the dot form, x quantized once, work items cut
    where a weight ends) and from 16 rows on (the panel form, weight by weight). Weights of mixed
    formats, or not quantized, take one product each."""
    needs_cpu_backend()
    rng = np.random.default_rng(8)
    for rows, d_in, d_outs in [(1, 96, (40, 13, 13)), (3, 160, (129, 7)), (1, 576, (576, 192, 192)), (17, 64, (9, 33))]:
        x = jnp.asarray(rng.standard_normal((rows, d_in)), x_dtype)
        ws = [_random_quantized(rng, (d_out, d_in), fmt) for d_out in d_outs]
        many = lambda x, ws: matmul_t_many(x, ws, out_dtype)  # noqa: E731
        assert _ffi_targets(jax.make_jaxpr(many)(x, ws).eqns) == [MANY_TARGET]
        for got, w in zip(jax.jit(many)(x, ws), ws, strict=True):
            want = jax.jit(lambda x, w: matmul_t(x, w, out_dtype))(x, w)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    x = jnp.ones((1, 64), jnp.float32)
    other = "int4" if fmt == "int8" else "int8"
    mixed = [_random_quantized(rng, (8, 64), fmt), _random_quantized(rng, (8, 64), other), jnp.ones((8, 64))]
    assert _ffi_targets(jax.make_jaxpr(matmul_t_many)(x, mixed).eqns) == [
        QUANT_TARGETS[fmt], QUANT_TARGETS[other], TARGET]


@pytest.mark.parametrize("x_dtype,w_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")])
def test_float_weights_of_one_dtype_take_one_call_whose_ys_are_each_ones_product(x_dtype, w_dtype):
    """Float weights of one dtype against one x take one kernel call (x packed once, every weight's
    work items handed out together), whose ys equal one product each bit for bit, in every form
    (dot, pair, panel, pair panel), work items cut where a weight ends and within `live_rows`.
    Weights of two dtypes take one product each."""
    needs_cpu_backend()
    rng = np.random.default_rng(9)
    for rows, d_in, d_outs in [(1, 576, (576, 192, 192)), (3, 160, (129, 7)), (17, 64, (9, 33)), (40, 96, (200, 8))]:
        x = jnp.asarray(rng.standard_normal((rows, d_in)), x_dtype)
        ws = [jnp.asarray(rng.standard_normal((d_out, d_in)), w_dtype) for d_out in d_outs]
        for live in (rows, rows // 2):
            def many(x, ws, live=live):
                with live_rows(jnp.int32(live)):
                    return matmul_t_many(x, ws)

            def apart(x, ws, live=live):
                with live_rows(jnp.int32(live)):
                    return [matmul_t(x, w) for w in ws]

            assert _ffi_targets(jax.make_jaxpr(many)(x, ws).eqns) == [FLOAT_MANY_TARGET]
            for got, want in zip(jax.jit(many)(x, ws), jax.jit(apart)(x, ws), strict=True):
                assert got.dtype == want.dtype and got.shape == want.shape
                np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    mixed = [jnp.ones((8, 64), jnp.float32), jnp.ones((8, 64), jnp.bfloat16)]
    assert _ffi_targets(jax.make_jaxpr(matmul_t_many)(jnp.ones((1, 64)), mixed).eqns) == [TARGET, TARGET]
    call = jax.ffi.ffi_call(FLOAT_MANY_TARGET, [jax.ShapeDtypeStruct((1, 8), jnp.float32)])
    x, live = jnp.ones((1, 64)), 1
    with pytest.raises(Exception, match=r"weights \[N, K\] of one float dtype"):  # (gate and up of two shapes)
        jax.block_until_ready(call(x, np.int32(live), jnp.ones((8, 64)), jnp.ones((16, 32)), gated=np.int64(1)))
    with pytest.raises(Exception, match=r"one weight per y \(gated: two\)"):
        jax.block_until_ready(call(x, np.int32(live), jnp.ones((8, 64)), gated=np.int64(1)))


@pytest.mark.parametrize("flags,needs", [("-march=x86-64-v2", X86_64_V2), ("-march=x86-64-v3", X86_64_V3)])
def test_the_float_kernel_built_for_other_cpus_matches_float64(flags, needs, monkeypatch, tmp_path):
    """Built with `flags` after -march=native, for a CPU without AVX-512 (x86-64-v3: no pair forms, a
    bfloat16 w widened in registers, a bfloat16 y rounded from float32 sums) or without AVX
    (x86-64-v2), where this CPU can run that build: one product against float64 numpy in the dot and
    panel forms, and the products of one call (several weights; gate, up and SiLU) equal to one
    product each, and to `gated_silu` of them, bit for bit."""
    needs_cpu_backend()
    from jaxserve_kernels.cpu import build
    from jaxserve_kernels.matmul import GATED_TARGET, SOURCE

    assert build.library(SOURCE) is not None  # (this CPU's own build loaded first, as in test_the_quantized_...)
    build_for_other_cpu(flags, needs, monkeypatch, tmp_path)
    try:
        one, many, gated = (f"test_{flags}_{target}" for target in (TARGET, FLOAT_MANY_TARGET, GATED_TARGET))
        for symbol, target in (("JaxserveMatmulT", one), ("JaxserveFloatManyMatmulT", many),
                               ("JaxserveGatedSilu", gated)):
            assert build._register(SOURCE, symbol, target)
    finally:
        build._library.cache_clear()
    rng = np.random.default_rng(10)
    for dtype in ("float32", "bfloat16"):
        for rows, d_in, d_outs in [(1, 96, (40, 13)), (5, 64, (9, 33)), (40, 96, (100, 17))]:
            x = jnp.asarray(rng.standard_normal((rows, d_in)), dtype)
            ws = [jnp.asarray(rng.standard_normal((d_out, d_in)), dtype) for d_out in (*d_outs, d_outs[0])]
            live, shapes = np.int32(rows), [jax.ShapeDtypeStruct((rows, d_out), dtype) for d_out in d_outs]
            apart = [np.asarray(jax.ffi.ffi_call(one, jax.ShapeDtypeStruct((rows, w.shape[0]), dtype))(x, w, live),
                                np.float32) for w in ws]
            for y, w in zip(apart, ws):
                x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
                want = x64 @ w64.T
                rounding = 2.0**-8 * np.abs(want) if dtype == "bfloat16" else 0
                assert (np.abs(y - want) <= 1e-5 * (np.abs(x64) @ np.abs(w64).T) + rounding).all(), (dtype, rows)
            together = jax.ffi.ffi_call(many, shapes)(x, live, *ws[:len(d_outs)], gated=np.int64(0))
            assert all(np.array_equal(np.asarray(y, np.float32), want) for y, want in zip(together, apart))
            gate_up = jax.ffi.ffi_call(many, shapes[:1])(x, live, ws[0], ws[-1], gated=np.int64(1))[0]
            silu = jax.ffi.ffi_call(gated, shapes[0])(*(jnp.asarray(y, dtype) for y in (apart[0], apart[-1])), live)
            assert np.array_equal(np.asarray(gate_up, np.float32), np.asarray(silu, np.float32)), (dtype, rows)


def test_one_row_products_from_several_threads_at_once_are_the_same():
    """A one-row product hands its second half to the kernels' own helper thread, which one call
    holds at a time (others take XLA's pool): calls from several threads at once, some after the
    helper has gone to sleep, give the values of one call alone bit for bit."""
    needs_cpu_backend()
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((1, 576)), jnp.bfloat16)
    ws = [group_rows(_random_quantized(rng, (d_out, 576), "int4")) for d_out in (1536, 1536)]
    many = jax.jit(lambda x, ws: matmul_t_many(x, ws))
    want = [np.asarray(y) for y in many(x, ws)]

    def calls(thread: int) -> bool:
        same = True
        for i in range(40):
            if (i + thread) % 8 == 0:
                time.sleep(0.002)  # (the helper sleeps after 200 us without work)
            same &= all(np.array_equal(y, w) for y, w in zip(many(x, ws), want, strict=True))
        return same

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(calls, range(4)))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_grouped_rows_match_float64(fmt):
    """A weight kept grouped (`group_rows`: each 16 rows' words interleaved) holds the same weight
    (`ungroup_rows` and `dequantize` give it back exactly), and the kernel multiplies it within the
    same bounds as in rows, at every row count (the grouped dot form: 1 row, a 4-row tile and its
    remainders, 16 and more rows, several work items), alone and with others of one call (the same
    values as one call each); XLA's path dequantizes it."""
    needs_cpu_backend()
    rng = np.random.default_rng(9)
    for rows, d_in, d_out in [(1, 64, 16), (3, 96, 48), (5, 576, 192), (16, 544, 32), (40, 160, 1536), (300, 64, 96)]:
        w = _random_quantized(rng, (d_out, d_in), fmt)
        grouped = group_rows(w)
        assert isinstance(grouped, GroupedRows) and grouped.shape == w.shape
        assert grouped.scales is None and grouped.mins is None and nbytes(grouped) == nbytes(w)  # (one array)
        assert all(np.array_equal(a, b) for a, b in zip(ungroup_rows(grouped), w) if a is not None)
        assert np.array_equal(dequantize(grouped), dequantize(w))
        x = jnp.asarray(rng.standard_normal((rows, d_in)), jnp.bfloat16)
        x64, w64 = np.asarray(x, np.float64), np.asarray(dequantize(w), np.float64)
        for impl in ("cpu", "xla"):
            got = jax.jit(lambda x, w: matmul_t(x, w, jnp.float32, impl=impl))(x, grouped)
            roundings = _kernel_roundings(quantized_forms(), grouped=True) if impl == "cpu" else {"bfloat16"}
            error = np.abs(np.asarray(got, np.float64) - x64 @ w64.T)
            tolerance = _quantized_tolerance(x64, w64, jnp.float32, roundings)
            assert (error <= tolerance).all(), (impl, rows, d_in, d_out, (error / tolerance).max())
        ws = [grouped, group_rows(_random_quantized(rng, (16, d_in), fmt))]
        many = lambda x, ws: matmul_t_many(x, ws)  # noqa: E731
        assert _ffi_targets(jax.make_jaxpr(many)(x, ws).eqns) == [MANY_TARGET]
        for got, one in zip(jax.jit(many)(x, ws), ws, strict=True):
            assert np.array_equal(got, jax.jit(matmul_t)(x, one))
        mixed = [grouped, w]  # (a grouped weight and one in rows: one call each)
        assert _ffi_targets(jax.make_jaxpr(many)(x, mixed).eqns) == [MANY_TARGET, QUANT_TARGETS[fmt]]
    with pytest.raises(ValueError, match="multiple of 16"):
        group_rows(_random_quantized(rng, (8, 64), fmt))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_rows_taken_from_a_grouped_matrix_are_its_rows(fmt):
    """A lookup table kept grouped (the tied embedding) gives the rows looked up exactly as in rows
    (`take_rows`), for ids of any shape, in numpy and under jit."""
    rng = np.random.default_rng(4)
    w = jax.tree.map(np.asarray, _random_quantized(rng, (64, 96), fmt))
    grouped, ids = group_rows(w), rng.integers(0, 64, (3, 5))
    want = take_rows(w, ids)
    assert want.data.shape == (3, 5, w.data.shape[1]) and np.array_equal(want.data[1, 2], w.data[ids[1, 2]])
    for got in (take_rows(grouped, ids), jax.jit(take_rows)(jax.tree.map(jnp.asarray, grouped), jnp.asarray(ids))):
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True) if a is not None)
        assert np.array_equal(dequantize(got), dequantize(w)[ids])


@pytest.mark.parametrize("flags,forms,needs", [("-march=x86-64-v2", ("float",), X86_64_V2),
                                               ("-march=x86-64-v3", ("integer", "float"), X86_64_V3),
                                               ("-mno-amx-tile", ("integer",), ("avx512_vnni", "avx512bw"))])
def test_the_quantized_kernel_built_for_other_cpus_matches_float64(flags, forms, needs, monkeypatch, tmp_path):
    """Built with `flags` after -march=native, for a CPU without AVX (x86-64-v2: the float form,
    nothing rounded), with AVX2 but not AVX-512 (x86-64-v3: the grouped dot form in bytes for grouped
    weights, the float form for weights in rows) or without AMX (the integer forms at every row
    count, the panel form from 16 rows on), where this CPU can run that build (its flags `needs`)."""
    needs_cpu_backend()
    from jaxserve_kernels.cpu import build

    # this CPU's own build loaded first, as in any process that ran a product before: each build in the
    # process must still call its own tiles (common.h, Helpers)
    assert build.library(QUANT_SOURCE) is not None
    build_for_other_cpu(flags, needs, monkeypatch, tmp_path)
    try:
        assert quantized_forms() == forms
        targets = {fmt: f"test_{flags}_{target}" for fmt, target in QUANT_TARGETS.items()}
        for fmt, target in targets.items():
            assert build._register(QUANT_SOURCE, f"Jaxserve{fmt.capitalize()}MatmulT", target)
        assert build._register(QUANT_SOURCE, "JaxserveManyMatmulT", many_target := f"test_{flags}_{MANY_TARGET}")
    finally:
        build._library.cache_clear()
    rng = np.random.default_rng(5)
    for fmt in ("int8", "int4"):
        for x_dtype in ("float32", "bfloat16"):
            for rows, d_in, d_out in [(1, 96, 7), (4, 64, 9), (17, 544, 33), (50, 96, 101), (1, 96, 16), (3, 544, 32),
                                      (5, 544, 32), (6, 96, 48)]:
                x = jnp.asarray(rng.standard_normal((rows, d_in)), x_dtype)
                w = _random_quantized(rng, (d_out, d_in), fmt)
                operands = [w.data, w.scales] + ([w.mins] if fmt == "int4" else [])
                call = jax.ffi.ffi_call(targets[fmt], jax.ShapeDtypeStruct((rows, d_out), jnp.float32))
                x64, w64 = np.asarray(x, np.float64), np.asarray(dequantize(w), np.float64)
                tolerance = _quantized_tolerance(x64, w64, jnp.float32, _kernel_roundings(forms))
                whole = np.asarray(call(x, np.int32(rows), *operands))
                error = np.abs(whole.astype(np.float64) - x64 @ w64.T)
                assert (error <= tolerance).all(), (fmt, x_dtype, rows, (error / tolerance).max())
                live = min(3, rows - 1)  # (a form chosen by x's rows, computed for its first ones: `live_rows`)
                part = np.asarray(call(x, np.int32(live), *operands))
                assert np.array_equal(part[:live], whole[:live]) and not part[live:].any(), (fmt, x_dtype, rows)
                if "integer" in forms and d_out % GROUP_ROWS == 0:
                    many = jax.ffi.ffi_call(many_target, [jax.ShapeDtypeStruct((rows, d_out), jnp.float32)])
                    grouped, = many(x, np.int32(rows), *_operands(group_rows(w)), row_group=np.int64(GROUP_ROWS),
                                     gated=np.int64(0))
                    error = np.abs(np.asarray(grouped, np.float64) - x64 @ w64.T)
                    tolerance = _quantized_tolerance(x64, w64, jnp.float32, _kernel_roundings(forms, grouped=True))
                    assert (error <= tolerance).all(), (fmt, x_dtype, rows, "grouped", (error / tolerance).max())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_matmul_t_runs_the_quantized_kernel_on_cpu_and_the_reference_elsewhere(fmt):
    """Under jit on the CPU backend, a quantized weight goes to its kernel at every row count; with
    impl="xla", or under a mesh of several devices (XLA partitions its dot, not a custom call), to
    XLA's dot of the dequantized weight."""
    needs_cpu_backend()
    w = _random_quantized(np.random.default_rng(6), (8, 64), fmt)
    for rows in (1, 4096):
        x = jnp.ones((2, rows, 64), jnp.bfloat16)
        text = jax.jit(lambda x, w: matmul_t(x, w)).lower(x, w).as_text()
        assert QUANT_TARGETS[fmt] in text and "dot_general" not in text
        assert jax.jit(lambda x, w: matmul_t(x, w)).eval_shape(x, w).shape == (2, rows, 8)
    text = jax.jit(lambda x, w: matmul_t(x, w, impl="xla")).lower(x, w).as_text()
    assert QUANT_TARGETS[fmt] not in text and "dot_general" in text
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("model",))):
        assert _ffi_targets(jax.make_jaxpr(lambda x, w: matmul_t(x, w))(x, w).eqns) == []


def test_quantized_matmul_t_checks_its_operands():
    """matmul_t checks x against the weight; the kernel checks its operands' dtypes and shapes."""
    w = _random_quantized(np.random.default_rng(7), (8, 64), "int4")
    with pytest.raises(ValueError, match="input dimension"):
        matmul_t(jnp.ones((1, 32)), w)
    needs_cpu_backend()
    assert implementation() == "cpu"
    live = np.int32(1)  # (the rows computed: `live_rows`)
    call = jax.ffi.ffi_call(QUANT_TARGETS["int4"], jax.ShapeDtypeStruct((1, 8), jnp.float32))
    with pytest.raises(Exception, match="scales and mins must be float16"):
        call(jnp.ones((1, 64)), live, w.data, w.scales.astype(jnp.float32), w.mins).block_until_ready()
    with pytest.raises(Exception, match=r"scales and mins \[N, K / 32\]"):
        call(jnp.ones((1, 64)), live, w.data, w.scales[:, :1], w.mins).block_until_ready()
    # (not gate and up of one y)
    many = functools.partial(jax.ffi.ffi_call(MANY_TARGET, [jax.ShapeDtypeStruct((1, 8), jnp.float32)] * 2),
                             gated=np.int64(0))
    rows, grouped = np.int64(0), np.int64(GROUP_ROWS)  # the layouts (`row_group`)
    with pytest.raises(Exception, match="row_group must be 0"):
        jax.block_until_ready(many(jnp.ones((1, 64)), live, *_operands(w), *_operands(w), row_group=np.int64(4)))
    with pytest.raises(Exception, match="each y needs its weight's data, scales and, int4, mins"):
        jax.block_until_ready(many(jnp.ones((1, 64)), live, w.data, w.scales, w.mins, w.data, w.scales, row_group=rows))
    with pytest.raises(Exception, match="scales and mins must be float16"):
        jax.block_until_ready(many(jnp.ones((1, 64)), live, w.data, w.scales, w.mins, w.data, w.scales,
                                   w.mins.astype(jnp.float32), row_group=rows))
    if "integer" in quantized_forms():  # (a grouped weight is one array, its rows in whole groups)
        one = functools.partial(jax.ffi.ffi_call(MANY_TARGET, [jax.ShapeDtypeStruct((1, 8), jnp.float32)]),
                                gated=np.int64(0))
        packed = jnp.zeros((8, 40), jnp.uint8)  # (K = 64: 32 bytes of data, 4 of scales and 4 of mins a row)
        with pytest.raises(Exception, match="a multiple of 16"):
            jax.block_until_ready(one(jnp.ones((1, 64)), live, packed, row_group=grouped))
        with pytest.raises(Exception, match="a grouped weight must be"):
            jax.block_until_ready(one(jnp.ones((1, 64)), live, packed[:, :32], row_group=grouped))
