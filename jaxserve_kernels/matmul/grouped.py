"""Grouped products y = x w[g]^T: rows of x sorted by group, each group through its own matrix (a
Mixture-of-Experts layer's tokens, sorted by expert, through the experts' stacked [G, out, in]
weights, Hugging Face's [out, in] per expert).

`grouped_matmul_t(x, w, group_sizes)`: rows 0 .. sizes[0] - 1 of x go through w[0], the next
sizes[1] rows through w[1], and so on; rows past sum(group_sizes) come out as zeros. Shapes are
static whatever the sizes, so one compiled step runs every routing. Implementations:
- "ragged": `jax.lax.ragged_dot_general`, which XLA lowers natively on TPU and GPU (the TPU and GPU
  default). On CPU, XLA lowers it as a masked product of every row with every group's matrix.
- "chunked": the CPU default. A loop over the chunks of rows of the groups that have rows (the
  trip count, sum of ceil(size / chunk), follows from the sizes at run time): each iteration
  multiplies `chunk` rows by its group's matrix alone (`stack_matmul_t`: the CPU kernel reads it
  where it lies in the stack; a quantized matrix goes through `matmul_t` as one linear layer's),
  and writes back the rows that are the group's. Only the groups that have rows are read.
- "reference": the jnp definition (a masked product over every group).

A quantized w (`quant.QuantizedWeight` with a leading group dimension) is multiplied as stored by
"chunked", and dequantized to x's dtype for "ragged" and "reference". A bfloat16 w may be given as
its raw bits (BITS), the form a model keeps its stacks in on CPU (`kept_as_bits`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve_kernels.matmul import KERNEL_DTYPES, STACK_TARGET, live_rows, matmul_t, row_limit
from jaxserve_kernels.matmul import implementation as matmul_implementation
from jaxserve_kernels.matmul.quant import QuantizedWeight, dequantize

IMPLEMENTATIONS = ("ragged", "chunked", "reference")
BY_BACKEND = {"cpu": "chunked", "gpu": "ragged", "tpu": "ragged"}  # jax.default_backend() -> implementation
MAX_CHUNK = 32  # rows per iteration of "chunked" at most
# lhs [M, in] ragged along its rows; rhs [G, out, in] grouped along its first dimension
RAGGED_DIMENSIONS = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                                      lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def implementation(impl: str | None = None) -> str:
    """`impl`, else the backend's (BY_BACKEND; "ragged" on any other)."""
    name = impl or BY_BACKEND.get(jax.default_backend(), "ragged")
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown grouped matmul implementation {name!r}; choose from {list(IMPLEMENTATIONS)}")
    return name


def chunk_rows(rows: int, groups: int) -> int:
    """Rows per iteration of "chunked": the power of two at or above the mean group size, at most
    MAX_CHUNK (smaller chunks waste fewer rows past a group's end; larger ones loop fewer times)."""
    mean = -(-rows // groups)
    return min(MAX_CHUNK, 1 << max(0, (mean - 1).bit_length()))


BITS = jnp.uint16  # a stack of this dtype holds bfloat16 values as raw bits (`kept_as_bits`)


def kept_as_bits(dtype, backend: str | None = None) -> bool:
    """Whether a stack of `dtype` is kept as its raw bits (BITS): bfloat16 on CPU, where XLA widens
    a whole bfloat16 stack to float32 (and back) on every call only to index one matrix of it."""
    return jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) and (backend or jax.default_backend()) == "cpu"


def _values(w: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(w, jnp.bfloat16) if w.dtype == BITS else w


def _index(stack: jax.Array, g) -> jax.Array:
    """stack[g] (a traced index), as values."""
    return _values(jax.lax.dynamic_index_in_dim(stack, g, keepdims=False))


def stack_matmul_t(x: jax.Array, stack: jax.Array, g, dtype) -> jax.Array:
    """`matmul_t(x, stack[g])` for a stack of float matrices (bfloat16 ones may be its raw bits) and a
    traced index: where `matmul_t` would run the CPU kernel on the matrix, the kernel reads it where
    it lies in the stack (XLA copies a dynamic slice out first: one more pass over the matrix)."""
    values = jnp.dtype(jnp.bfloat16) if stack.dtype == BITS else jnp.dtype(stack.dtype)
    mesh = jax.sharding.get_abstract_mesh()
    if (matmul_implementation() == "cpu" and (mesh.empty or mesh.size == 1)
            and {x.dtype, values, jnp.dtype(dtype)} <= set(KERNEL_DTYPES) and x.shape[0] <= row_limit(x.dtype, values)):
        call = jax.ffi.ffi_call(STACK_TARGET, jax.ShapeDtypeStruct((x.shape[0], stack.shape[1]), dtype))
        return call(x, stack, jnp.asarray(g, jnp.int32))
    return matmul_t(x, _index(stack, g), dtype)


def _group(w: jax.Array | QuantizedWeight, g) -> jax.Array | QuantizedWeight:
    """w[g] (a traced index): one group's matrix, or its quantized parts."""
    if isinstance(w, QuantizedWeight):
        return QuantizedWeight(*(None if part is None else _index(part, g) for part in w))
    return _index(w, g)


def grouped_matmul_t_reference(x: jax.Array, w: jax.Array | QuantizedWeight, group_sizes: jax.Array,
                               dtype=None) -> jax.Array:
    dtype = jnp.dtype(dtype or x.dtype)
    w = dequantize(w, x.dtype) if isinstance(w, QuantizedWeight) else _values(w)
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right")  # G for rows past the groups
    every = jnp.einsum("mk,gnk->gmn", x, w, preferred_element_type=jnp.float32)
    mask = group[None, :] == jnp.arange(w.shape[0])[:, None]
    return jnp.where(mask[..., None], every, 0).sum(0).astype(dtype)


def _ragged(x, w, group_sizes, dtype):
    w = dequantize(w, x.dtype) if isinstance(w, QuantizedWeight) else _values(w)
    return jax.lax.ragged_dot_general(x, w, group_sizes, RAGGED_DIMENSIONS,
                                      preferred_element_type=jnp.float32).astype(dtype)


def _chunked(x, w, group_sizes, dtype, chunk: int):
    rows = x.shape[0]
    out_dim = w.shape[-2]
    starts = jnp.cumsum(group_sizes) - group_sizes
    chunks = -(-group_sizes // chunk)  # per group
    chunk_ends = jnp.cumsum(chunks)
    # one chunk of padding: the last chunk of the last group may read and write past the rows
    x = jnp.pad(x, ((0, chunk), (0, 0)))

    def body(i, out):
        g = jnp.searchsorted(chunk_ends, i, side="right")  # the group whose chunks hold chunk i
        offset = (i - (chunk_ends[g] - chunks[g])) * chunk
        row = starts[g] + offset
        rows_in = jax.lax.dynamic_slice_in_dim(x, row, chunk)
        with live_rows(None):  # (a step's live count is of its tokens, not of these rows sorted by group)
            y = (matmul_t(rows_in, _group(w, g), dtype) if isinstance(w, QuantizedWeight)
                 else stack_matmul_t(rows_in, w, g, dtype))
        inside = (offset + jnp.arange(chunk)) < group_sizes[g]
        kept = jnp.where(inside[:, None], y, jax.lax.dynamic_slice_in_dim(out, row, chunk))
        return jax.lax.dynamic_update_slice_in_dim(out, kept, row, 0)

    out = jax.lax.fori_loop(0, chunk_ends[-1], body, jnp.zeros((rows + chunk, out_dim), dtype))
    return out[:rows]


def grouped_matmul_t(x: jax.Array, w: jax.Array | QuantizedWeight, group_sizes: jax.Array, dtype=None, *,
                     impl: str | None = None, chunk: int | None = None) -> jax.Array:
    """x[M, in] (rows sorted by group) and w[G, out, in] (or its quantized parts) -> [M, out]:
    row r through w[g] for the group g whose rows hold r (`group_sizes` i32[G], summing to at most
    M), zeros past the groups; accumulated in float32, returned in `dtype` (default: x's).
    `chunk`: "chunked"'s rows per iteration (default `chunk_rows`)."""
    if x.ndim != 2 or len(w.shape) != 3 or x.shape[1] != w.shape[2] or group_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped_matmul_t takes x [M, in], w [G, out, in] and group_sizes [G]; got x {x.shape}, "
                         f"w {tuple(w.shape)}, group_sizes {group_sizes.shape}")
    dtype = jnp.dtype(dtype or x.dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    name = implementation(impl)
    if name == "reference":
        return grouped_matmul_t_reference(x, w, group_sizes, dtype)
    if name == "ragged":
        return _ragged(x, w, group_sizes, dtype)
    return _chunked(x, w, group_sizes, dtype, chunk or chunk_rows(x.shape[0], w.shape[0]))
