"""SwiGLU's activation between a layer's products, by the C++ CPU kernel (`jaxserve_kernels.matmul.gated_silu`)
against XLA's form of `jaxserve.models.layers.gated`; the products and the activation in one call
(`gated_matmul_t`) against them apart and float64 numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_cpu_backend

from jaxserve.models.layers import gated
from jaxserve_kernels.matmul import (AMX_MIN_ROWS, FLOAT_MANY_TARGET, GATED_TARGET, TARGET, bf16_tiles, gated_matmul_t,
                                     gated_silu, live_rows, matmul_t, row_limit)


@jax.jit
def _xla(gate, up):
    return jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype) * up


def test_gated_silu_is_xlas_for_every_bfloat16_gate_and_within_float32_rounding():
    """Every finite bfloat16 value as a gate (a bfloat16 product of bfloat16 values is exact in
    float32, so the result is XLA's wherever the rounded activation is), in rows of 29: 16 lanes, 8,
    then 5 padded to 8, as a step's rows reach the kernel. In float32, values from far below to far
    above zero (e^-|x| never overflows) within float32 rounding."""
    needs_cpu_backend()
    rng = np.random.default_rng(0)
    bits = np.arange(1 << 16, dtype=np.uint32)
    finite = bits[(bits & 0x7F80) != 0x7F80].astype(np.uint16)
    gate = np.resize(finite.view(jnp.bfloat16), (-(-finite.size // 29), 29))
    up = rng.standard_normal(gate.shape).astype(jnp.bfloat16)
    got = jax.jit(lambda g, u: gated_silu(g, u, token_rows=False))(gate, up)
    assert np.array_equal(np.asarray(got, np.float32), np.asarray(_xla(gate, up), np.float32))
    for rows, n in ((1, 1536), (7, 29), (40, 200)):
        gate, up = (jnp.asarray(rng.standard_normal((rows, n)) * scale, jnp.float32) for scale in (30, 1))
        got = np.asarray(jax.jit(lambda g, u: gated_silu(g, u, token_rows=False))(gate, up))
        np.testing.assert_allclose(got, np.asarray(_xla(gate, up)), rtol=2e-6, atol=1e-30)


def test_gated_silu_computes_a_steps_live_rows_only_where_its_rows_are_the_tokens():
    """Within `live_rows`, the token rows before the count as without it, the padding zeros; a
    Mixture-of-Experts layer's routed rows (`token_rows=False`) are all computed whatever the count."""
    needs_cpu_backend()
    rng = np.random.default_rng(1)
    gate, up = (jnp.asarray(rng.standard_normal((12, 64)), jnp.bfloat16) for _ in range(2))

    def within(live, token_rows):
        with live_rows(jnp.int32(live)):
            return gated_silu(gate, up, token_rows=token_rows)

    whole = np.asarray(_xla(gate, up))
    for live in (0, 5, 12, 20):
        kept = min(live, 12)
        got = np.asarray(jax.jit(lambda: within(live, True))())
        assert np.array_equal(got[:kept], whole[:kept]) and not got[kept:].any(), live
        assert np.array_equal(np.asarray(jax.jit(lambda: within(live, False))()), whole), live


def test_the_models_silu_runs_the_kernel_on_cpu_and_other_activations_xla():
    needs_cpu_backend()
    gate = up = jnp.ones((4, 32), jnp.bfloat16)

    def targets(activation):
        eqns = jax.make_jaxpr(lambda g, u: gated(activation, g, u, token_rows=True))(gate, up).eqns
        return [e.params["target_name"] for e in eqns if e.primitive.name == "ffi_call"]

    assert targets(jax.nn.silu) == [GATED_TARGET]
    assert targets(lambda x: jax.nn.gelu(x, approximate=True)) == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gate_and_up_in_one_call_are_their_products_then_gated_silu(dtype):
    """`gated_matmul_t` (both products and the activation in one kernel call, applied to each block as
    it is computed) against the two products and `gated_silu` after them: the same bits, at decode row
    counts (the dot forms), from 16 rows on (the panel forms) and past one work item's rows of x,
    within `live_rows` (the padding zeros); and against float64 numpy within three roundings of x's
    dtype (each product's, the activation's, the result's)."""
    needs_cpu_backend()
    rng = np.random.default_rng(2)
    eps = 2.0**-8 if dtype == "bfloat16" else 2.0**-23
    many = int(min(300, row_limit(dtype, dtype)))  # (past a work item's 224 rows, within the kernel's limit)
    for rows, d_in, d_out in [(1, 576, 1536), (3, 64, 40), (17, 96, 33), (many, 576, 70)]:
        x = jnp.asarray(rng.standard_normal((rows, d_in)), dtype)
        gate, up = (jnp.asarray(rng.standard_normal((d_out, d_in)) / np.sqrt(d_in), dtype) for _ in range(2))
        if dtype == "bfloat16" and rows >= AMX_MIN_ROWS and d_in % 32 == 0 and bf16_tiles():
            assert gated_matmul_t(x, gate, up) is None  # (AMX tiles take the products, one call each)
            continue
        for live in (rows, max(1, rows // 2)):
            def fused(x, gate, up, live=live):
                with live_rows(jnp.int32(live)):
                    return gated_matmul_t(x, gate, up)

            def apart(x, gate, up, live=live):
                with live_rows(jnp.int32(live)):
                    return gated_silu(matmul_t(x, gate), matmul_t(x, up), token_rows=True)

            assert _targets(fused, x, gate, up) == [FLOAT_MANY_TARGET]
            got = np.asarray(jax.jit(fused)(x, gate, up), np.float32)
            assert np.array_equal(got, np.asarray(jax.jit(apart)(x, gate, up), np.float32)), (rows, live)
            assert not got[live:].any()
            if live == rows:
                whole = got
        x64, g64, u64 = (np.asarray(a, np.float64) for a in (x, gate, up))
        g, u = x64 @ g64.T, x64 @ u64.T
        silu = g / (1 + np.exp(-g))
        tolerance = 4 * eps * ((np.abs(x64) @ np.abs(g64).T) * np.abs(u) + np.abs(silu) * (np.abs(x64) @ np.abs(u64).T)
                               + np.abs(silu * u)) + 1e-30
        error = np.abs(whole - silu * u)
        assert (error <= tolerance).all(), (rows, (error / tolerance).max())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_gate_and_up_in_one_call_are_their_products_then_gated_silu(fmt):
    """Quantized gate and up (in rows and grouped) take one call of the quantized kernel, the
    activation applied to both products' sums at its end: the same bits as the two products
    (`matmul_t_many`) and `gated_silu` after them, within `live_rows`."""
    needs_cpu_backend()
    from jaxserve_kernels.matmul import MANY_TARGET, matmul_t_many
    from jaxserve_kernels.matmul.quant import group_rows, quantize

    rng = np.random.default_rng(4)
    for rows, d_in, d_out, dtype in [(1, 576, 1536, "bfloat16"), (3, 64, 48, "float32"), (40, 96, 32, "bfloat16")]:
        x = jnp.asarray(rng.standard_normal((rows, d_in)), dtype)
        pair = [quantize(rng.standard_normal((d_out, d_in), np.float32), fmt) for _ in range(2)]
        for gate, up in (pair, [group_rows(w) for w in pair]):
            gate, up = jax.tree.map(jnp.asarray, (gate, up))
            live = max(1, rows - 2)

            def fused(x, gate, up):
                with live_rows(jnp.int32(live)):
                    return gated_matmul_t(x, gate, up)

            def apart(x, gate, up):
                with live_rows(jnp.int32(live)):
                    return gated_silu(*matmul_t_many(x, [gate, up]), token_rows=True)

            assert _targets(fused, x, gate, up) == [MANY_TARGET]
            got = np.asarray(jax.jit(fused)(x, gate, up), np.float32)
            assert np.array_equal(got, np.asarray(jax.jit(apart)(x, gate, up), np.float32)), (rows, dtype)
            assert got[:live].any() and not got[live:].any()


def test_the_models_gated_mlp_takes_one_call_for_its_gate_up_and_silu_unless_a_layer_adds_to_its_product():
    """A `GatedMLP` of SiLU runs gate, up and the activation as one call (`gated_matmul_t`) and equals
    its products and `gated` apart; with a bias (or a row's adapter) on gate or up, the products, then
    the activation (the bias added between them); other activations, XLA's."""
    needs_cpu_backend()
    from flax import nnx

    from jaxserve.models.layers import GatedMLP
    from jaxserve.models.lora import LoraRows

    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 32)), jnp.bfloat16)
    for bias, activation, calls in [(False, jax.nn.silu, [FLOAT_MANY_TARGET, TARGET]),
                                    (True, jax.nn.silu, [FLOAT_MANY_TARGET, GATED_TARGET, TARGET]),
                                    (False, jax.nn.gelu, [FLOAT_MANY_TARGET, TARGET])]:
        mlp = GatedMLP(32, 48, bias, jnp.bfloat16, nnx.Rngs(0), activation=activation)
        if bias:
            mlp.gate_proj.bias[...] = jnp.full((48,), 0.5, jnp.bfloat16)
        assert _targets(mlp, x) == calls, (bias, activation)
        linears = [mlp.gate_proj, mlp.up_proj]
        apart = mlp.down_proj(gated(activation, *(linear(x) for linear in linears), token_rows=True))
        assert np.array_equal(np.asarray(mlp(x), np.float32), np.asarray(apart, np.float32)), (bias, activation)
    # a row's adapter on up: its product added before the activation (rows 0, 2, 4 on slot 0)
    mlp = GatedMLP(32, 48, False, jnp.bfloat16, nnx.Rngs(0))
    rng = np.random.default_rng(5)
    mlp.up_proj.lora = nnx.data(tuple(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                                      for shape in ((1, 4, 32), (1, 48, 4))))
    rows = LoraRows(**{k: jnp.asarray(v) for k, v in LoraRows.of(np.array([0, -1, 0, -1, 0]), 1).items()})
    assert GATED_TARGET in _targets(lambda x: mlp(x, rows), x)
    apart = gated(jax.nn.silu, mlp.gate_proj(x, rows), mlp.up_proj(x, rows), token_rows=True)
    assert np.array_equal(np.asarray(mlp(x, rows), np.float32), np.asarray(mlp.down_proj(apart, rows), np.float32))


def _targets(fn, *args) -> list[str]:
    return [e.params["target_name"] for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "ffi_call"]
