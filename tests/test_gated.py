"""SwiGLU's activation between a layer's products, by the C++ CPU kernel (`jaxserve_kernels.matmul.gated_silu`)
against XLA's form of `jaxserve.models.layers.gated`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import needs_cpu_backend

from jaxserve.models.layers import gated
from jaxserve_kernels.matmul import GATED_TARGET, gated_silu, live_rows


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
