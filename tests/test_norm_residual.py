"""A layer's RMSNorm before its products and its residual add after its output product, in the C++ kernels'
calls (`matmul_t_many`'s and `gated_matmul_t`'s `norm`, `matmul_t`'s `residual`): against the norm and the
add as XLA computes them (`rms_norm`, `residual + y`) and float64 numpy, in the float and the quantized
kernels, and in the model's layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_cpu_backend
from test_matmul import PLAIN, _kernel_roundings, _quantized_tolerance, _random_quantized

from jaxserve_kernels.matmul import (FLOAT_MANY_TARGET, GATED_TARGET, MANY_TARGET, Norm, gated_matmul_t, live_rows,
                                     matmul_t, matmul_t_many, quantized_forms, rms_norm)
from jaxserve_kernels.matmul.quant import GROUP_ROWS, dequantize, group_rows

pytestmark = pytest.mark.usefixtures("ieee_float32")
EPS = 1e-5
ROWS = (1, 5, 16, 40)  # the dot forms, one panel, panels and a remainder


def _weights(rng, kind: str, shapes, dtype):
    """Float weights of x's dtype, or quantized ones ("int8", "int4"; "int4 grouped")."""
    if kind == "float":
        return [jnp.asarray(rng.standard_normal(shape) * 0.2, dtype) for shape in shapes]
    weights = [_random_quantized(rng, shape, kind.split()[0]) for shape in shapes]
    return [group_rows(w) for w in weights] if kind.endswith("grouped") else weights


def _kinds() -> list[str]:
    return ["float", "int8", "int4"] + (["int4 grouped"] if "integer" in quantized_forms() else [])


def _ops(fn, *args) -> tuple[list[str], set[str]]:
    """The custom calls' targets and the other primitives of fn's jaxpr."""
    eqns = jax.make_jaxpr(fn)(*args).eqns
    return ([e.params["target_name"] for e in eqns if e.primitive.name == "ffi_call"],
            {e.primitive.name for e in eqns if e.primitive.name != "ffi_call"})


def _norm64(x, weight) -> np.ndarray:
    x64 = np.asarray(x, np.float64)
    return np.asarray(weight, np.float64) * x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + EPS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernels_norm_is_hugging_faces_rmsnorm(dtype):
    """The kernel's normed x, read through an identity weight (each sum one exact product): XLA's
    `rms_norm` within float32's rounding, or bit for bit in bfloat16 but where the sums' order moves
    the scale across a rounding (at most one bfloat16 step); float64's within the two roundings."""
    needs_cpu_backend()
    rng = np.random.default_rng(0)
    for rows in ROWS:
        x = jnp.asarray(rng.standard_normal((rows, 96)) * rng.uniform(0.1, 30, (rows, 1)), dtype)
        weight = jnp.asarray(rng.standard_normal(96), dtype)
        eye = jnp.eye(96, dtype=dtype)
        got = np.asarray(jax.jit(lambda x, w: matmul_t_many(x, [eye], norm=Norm(w, EPS)))(x, weight)[0], np.float64)
        xla = np.asarray(jax.jit(lambda x, w: rms_norm(x, Norm(w, EPS)))(x, weight), np.float64)
        step = 2.0**-7 if dtype == "bfloat16" else 2.0**-21
        assert (np.abs(got - xla) <= step * np.abs(xla)).all(), (dtype, rows)
        want = _norm64(x, weight)
        assert (np.abs(got - want) <= (2 * step + 1e-6) * np.abs(want) + 1e-30).all(), (dtype, rows)


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_products_of_a_normed_input_are_those_of_xlas_norm_in_one_call(kind, dtype):
    """q, k and v of a normed x: one call, no XLA op of the norm, the values of `rms_norm` then the
    products (within a step of the normed x's rounding, as above), against float64 within the
    kernel's own roundings; within `live_rows`, the rows after the count zero."""
    needs_cpu_backend()
    rng = np.random.default_rng(1)
    for rows in ROWS:
        x = jnp.asarray(rng.standard_normal((rows, 96)), dtype)
        weight = jnp.asarray(1 + 0.1 * rng.standard_normal(96), dtype)
        ws = _weights(rng, kind, [(48, 96), (16, 96), (16, 96)], dtype)
        live = max(rows - 2, 1)

        def fused(x, weight, ws):
            with live_rows(jnp.int32(live)):
                return matmul_t_many(x, ws, norm=Norm(weight, EPS))

        targets, others = _ops(fused, x, weight, ws)
        assert targets == [MANY_TARGET if kind != "float" else FLOAT_MANY_TARGET] and "rsqrt" not in others
        normed = np.asarray(rms_norm(x, Norm(weight, EPS)), np.float64)
        for got, w in zip(jax.jit(fused)(x, weight, ws), ws, strict=True):
            got = np.asarray(got, np.float64)
            w64 = np.asarray(w if kind == "float" else dequantize(w), np.float64)
            roundings = {"bfloat16"} if kind == "float" and dtype == "bfloat16" else set()
            if kind != "float":
                roundings = _kernel_roundings(quantized_forms(), grouped=kind.endswith("grouped"))
            step = 2.0**-7 if dtype == "bfloat16" else 2.0**-21  # (the normed x's own rounding, moved)
            magnitude = np.abs(normed) @ np.abs(w64).T
            bound = _quantized_tolerance(normed, w64, jnp.dtype(dtype), roundings) + step * magnitude
            assert (np.abs(got[:live] - normed[:live] @ w64.T) <= bound[:live]).all(), (kind, dtype, rows)
            assert not got[live:].any()


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_residual_added_in_the_products_call_is_xlas_add_bit_for_bit(kind, dtype):
    """residual + x w^T in the product's call: XLA's add of the product as `matmul_t` returns it, bit
    for bit, with no XLA op besides; within `live_rows`, the rows after the count the residual's."""
    needs_cpu_backend()
    rng = np.random.default_rng(2)
    for rows in ROWS:
        x = jnp.asarray(rng.standard_normal((rows, 64)), dtype)
        w, = _weights(rng, kind, [(32, 64)], dtype)
        residual = jnp.asarray(rng.standard_normal((rows, 32)) * 4, dtype)
        for live in (rows, max(rows - 3, 0)):
            def fused(x, w, residual, live=live):
                with live_rows(jnp.int32(live)):
                    return matmul_t(x, w, residual=residual)

            def apart(x, w, residual, live=live):
                with live_rows(jnp.int32(live)):
                    return residual + matmul_t(x, w)

            targets, others = _ops(fused, x, w, residual)
            assert targets == [MANY_TARGET if kind != "float" else FLOAT_MANY_TARGET] and "add" not in others
            got = np.asarray(jax.jit(fused)(x, w, residual), np.float32)
            assert np.array_equal(got, np.asarray(jax.jit(apart)(x, w, residual), np.float32)), (kind, dtype, rows)
            assert np.array_equal(got[live:], np.asarray(residual[live:], np.float32))
    # a residual of another dtype than the product's: XLA's add, which promotes
    x, w = jnp.ones((2, 64), dtype), _weights(rng, kind, [(32, 64)], dtype)[0]
    other = jnp.ones((2, 32), jnp.float32 if dtype == "bfloat16" else jnp.bfloat16)
    got = jax.jit(lambda x, w, r: matmul_t(x, w, residual=r))(x, w, other)
    assert got.dtype == jnp.float32 and np.array_equal(got, other + matmul_t(x, w))


@pytest.mark.parametrize("kind", ["float", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gate_up_and_silu_of_a_normed_input_take_one_call(kind, dtype):
    """`gated_matmul_t` of a normed x: one call, the values of the norm by XLA then the call without
    (within a step of the normed x's rounding). A norm's weight of another dtype than x's: XLA norms x
    (promoted) before the one call, as q, k and v's products do."""
    needs_cpu_backend()
    rng = np.random.default_rng(3)
    for rows in ROWS:
        x = jnp.asarray(rng.standard_normal((rows, 64)), dtype)
        weight = jnp.asarray(1 + 0.1 * rng.standard_normal(64), dtype)
        gate, up = _weights(rng, kind, [(48, 64), (48, 64)], dtype)
        def fused(x, weight, gate, up):
            return gated_matmul_t(x, gate, up, norm=Norm(weight, EPS))

        def apart(x, weight, gate, up):
            return gated_matmul_t(rms_norm(x, Norm(weight, EPS)), gate, up)

        assert _ops(fused, x, weight, gate, up)[0] == [MANY_TARGET if kind == "int4" else FLOAT_MANY_TARGET]
        got, want = (np.asarray(jax.jit(f)(x, weight, gate, up), np.float64) for f in (fused, apart))
        step = 2.0**-6 if dtype == "bfloat16" else 1e-5
        scale = np.abs(want).max(-1, keepdims=True) + 1e-6
        assert (np.abs(got - want) <= step * scale).all(), (kind, dtype, rows)
    other = Norm(jnp.ones(64, jnp.float32 if dtype == "bfloat16" else jnp.bfloat16), EPS)
    normed = rms_norm(x, other)
    targets, others = _ops(lambda x: gated_matmul_t(x, gate, up, norm=other), x)
    assert len(targets) == 1 and "rsqrt" in others
    got = gated_matmul_t(x, gate, up, norm=other)
    assert got.dtype == normed.dtype and np.array_equal(got, gated_matmul_t(normed, gate, up))
    many = matmul_t_many(x, [gate, up], norm=other)
    assert _ops(lambda x: matmul_t_many(x, [gate, up], norm=other), x)[0] == targets
    assert all(np.array_equal(a, b) for a, b in zip(many, matmul_t_many(normed, [gate, up]), strict=True))


def test_the_handlers_check_the_norm_and_the_residual():
    """A norm's weight must be [K] in x's dtype, a residual y's shape and dtype, and added to one y,
    not to a gated call's."""
    needs_cpu_backend()
    x, live = jnp.ones((2, 64)), np.int32(2)
    shape = [jax.ShapeDtypeStruct((2, 8), jnp.float32)]
    w = jnp.ones((8, 64))
    call = jax.ffi.ffi_call(FLOAT_MANY_TARGET, shape)
    with pytest.raises(Exception, match=r"a norm's weight must be \[K\] in x's dtype"):
        jax.block_until_ready(call(x, live, w, jnp.ones(32), **{**PLAIN, "norm": np.int64(1)}, gated=np.int64(0)))
    with pytest.raises(Exception, match="the residual must be y's shape and dtype"):
        jax.block_until_ready(call(x, live, w, jnp.ones((2, 8), jnp.bfloat16), **{**PLAIN, "residual": np.int64(1)},
                                   gated=np.int64(0)))
    with pytest.raises(Exception, match="a residual where residual"):
        jax.block_until_ready(call(x, live, w, w, jnp.ones((2, 8)), **{**PLAIN, "residual": np.int64(1)},
                                   gated=np.int64(1)))
    q = _random_quantized(np.random.default_rng(4), (8, 64), "int8")
    many = jax.ffi.ffi_call(MANY_TARGET, shape)
    with pytest.raises(Exception, match=r"a norm's weight must be \[K\] in x's dtype"):
        jax.block_until_ready(many(x, live, q.data, q.scales, jnp.ones(64, jnp.bfloat16),
                                   **{**PLAIN, "norm": np.int64(1)}, row_group=np.int64(0), gated=np.int64(0)))
    with pytest.raises(Exception, match="the residual must be y's shape and dtype"):
        jax.block_until_ready(many(x, live, q.data, q.scales, jnp.ones((2, 9)), **{**PLAIN, "residual": np.int64(1)},
                                   row_group=np.int64(0), gated=np.int64(0)))
    assert GROUP_ROWS  # (grouped weights take the same operands after theirs: test_products_of_a_normed_...)


def test_the_models_layers_take_their_norms_and_residual_adds_into_the_products_calls():
    """A Llama layer's halves as `DecoderLayer` calls them: the MLP of a normed x with the residual
    added takes two calls (gate, up and SiLU; down and the add) and equals x + mlp(norm(x)); with a
    row's adapter on up, x is normed by XLA first (the adapter reads it), the rest as before; the
    attention's q, k and v take the norm in their call (`project`)."""
    needs_cpu_backend()
    from flax import nnx

    from jaxserve.models.layers import GatedMLP, Linear, RMSNorm, project
    from jaxserve.models.lora import LoraRows

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((5, 32)), jnp.bfloat16)
    norm = RMSNorm(32, EPS, jnp.bfloat16)
    norm.weight[...] = jnp.asarray(1 + 0.1 * rng.standard_normal(32), jnp.bfloat16)
    mlp = GatedMLP(32, 48, False, jnp.bfloat16, nnx.Rngs(0))
    assert _ops(lambda x: mlp(x, None, norm, residual=x), x)[0] == [FLOAT_MANY_TARGET] * 2
    got = np.asarray(mlp(x, None, norm, residual=x), np.float32)
    want = np.asarray(x + mlp(norm(x)), np.float32)
    assert np.allclose(got, want, rtol=2**-6, atol=2**-6 * np.abs(want).max())
    mlp.up_proj.lora = nnx.data(tuple(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                                      for shape in ((1, 4, 32), (1, 48, 4))))
    rows = LoraRows(**{k: jnp.asarray(v) for k, v in LoraRows.of(np.array([0, -1, 0, -1, 0]), 1).items()})
    targets, others = _ops(lambda x: mlp(x, rows, norm, residual=x), x)
    assert GATED_TARGET in targets and "rsqrt" in others
    got = np.asarray(mlp(x, rows, norm, residual=x), np.float32)
    assert np.array_equal(got, np.asarray(x + mlp(norm(x), rows), np.float32))
    linears = [Linear(32, n, False, jnp.bfloat16, nnx.Rngs(n)) for n in (32, 16, 16)]
    targets, others = _ops(lambda x: project(x, linears, None, norm), x)
    assert targets == [FLOAT_MANY_TARGET] and "rsqrt" not in others
    for got, want in zip(project(x, linears, None, norm), project(norm(x), linears), strict=True):
        want = np.asarray(want, np.float32)
        assert np.allclose(np.asarray(got, np.float32), want, rtol=2**-6, atol=2**-6 * np.abs(want).max())
