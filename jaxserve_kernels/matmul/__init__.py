"""y = x w^T with w in Hugging Face's [out, in] layout: every linear layer and the LM head.

Products accumulate in float32 and return the requested dtype. Implementations:
- "xla": XLA's dot (`matmul_t_reference`), on every backend, and wherever the weights are split
  over a mesh (XLA partitions its own dot; it cannot partition a custom call).
- "cpu": a C++ XLA FFI custom call (`cpu.cc`, built on first use like the CPU attention kernel):
  up to KERNEL_MAX_ROWS rows of x: in float32 the row counts of decode steps, where XLA:CPU's
  products are slower, and in bfloat16 up to mid-sized prefill chunks: XLA's single-row bfloat16
  products are far slower than its float32 ones, while the kernel streams bfloat16 weights at half
  float32's bytes (bench/matmul_layout.py; figures in bench/RESULTS.md). Past KERNEL_MAX_ROWS rows
  XLA's float32 dot runs; a bfloat16 weight is widened for it by a second call in `cpu.cc`, which
  takes x as an operand so that each layer's widening waits for that layer (XLA hoisted a plain
  convert of every layer's weight to the start of the step). On a CPU with bfloat16 instructions
  (AVX512_BF16), bfloat16 x against a bfloat16 weight runs in the kernel at every row count
  (`row_limit`): it multiplies them without widening, faster than the widened float32 dot; on one
  with AMX, on its tiles from a few rows on (`bf16_tiles`).

A quantized weight (`quant.py`: int8 or int4 blocks of 32 values with float16 scales) is multiplied
by `quantized_matmul_t`: with "cpu", by a second C++ kernel (`quant.cc`) at every row count, which
reads the weight as it is stored (about a third of bfloat16's bytes for int4): on a CPU with
AVX512-VNNI (or AVX2, for weights kept grouped) it quantizes x to int8 per block of 32 for integer
products, as llama.cpp does, and on one with AMX it multiplies bfloat16 tiles from 8 rows on
(`quantized_forms`); with "xla", by XLA's
dot of x and the weight dequantized to x's dtype (`dequantize`).

$JAXSERVE_MATMUL picks one; by default the CPU backend runs "cpu" where it can be built.

Within `live_rows(n)` (a traced count: a step's tokens before its bucket's padding), the C++
kernels compute x's first n rows and return zeros for the others: a step's padding costs its
products nothing. XLA's dot computes every row. `gated_silu` (SwiGLU's silu(gate) * up between a
layer's products, by a kernel of `cpu.cc` where the products' kernels run) also computes only those.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve_kernels.cpu import build
from jaxserve_kernels.matmul.quant import GROUP_ROWS, GroupedRows, QuantizedWeight, dequantize

ENV = "JAXSERVE_MATMUL"
IMPLEMENTATIONS = ("xla", "cpu")
TARGET = "jaxserve_matmul_t"
WIDEN_TARGET = "jaxserve_widen_after"  # a bfloat16 weight widened once the layer's input exists (cpu.cc)
STACK_TARGET = "jaxserve_stack_matmul_t"  # x times one matrix of a stack, read in place (cpu.cc, grouped.py)
GATED_TARGET = "jaxserve_gated_silu"  # silu(gate) * up between a layer's products (cpu.cc, `gated_silu`)
FLOAT_MANY_TARGET = "jaxserve_matmul_t_float_many"  # float weights against one x, or gated (cpu.cc)
SOURCE = Path(__file__).with_name("cpu.cc")
QUANT_SOURCE = Path(__file__).with_name("quant.cc")
QUANT_TARGETS = {"int8": "jaxserve_matmul_t_int8", "int4": "jaxserve_matmul_t_int4"}  # by QuantizedWeight.fmt
MANY_TARGET = "jaxserve_matmul_t_many"  # several quantized weights of one format against one x (quant.cc)
# Every custom call "cpu" may run: (source, handler symbol, target), all registered when it is chosen.
CUSTOM_CALLS = ((SOURCE, "JaxserveMatmulT", TARGET), (SOURCE, "JaxserveWidenAfter", WIDEN_TARGET),
                (SOURCE, "JaxserveStackMatmulT", STACK_TARGET), (SOURCE, "JaxserveGatedSilu", GATED_TARGET),
                (SOURCE, "JaxserveFloatManyMatmulT", FLOAT_MANY_TARGET),
                (QUANT_SOURCE, "JaxserveInt8MatmulT", QUANT_TARGETS["int8"]),
                (QUANT_SOURCE, "JaxserveInt4MatmulT", QUANT_TARGETS["int4"]),
                (QUANT_SOURCE, "JaxserveManyMatmulT", MANY_TARGET))
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Beyond this many rows of x, XLA's float32 dot is as fast or faster (bench/matmul_layout.py): it
# comes close to this CPU's peak from about 64 rows on. XLA's bfloat16 products are no faster than
# the kernel's at any row count, but from about 384 rows on, widening a bfloat16 weight to float32
# (one pass over it) and running XLA's float32 dot beats both (bench/RESULTS.md, "Products").
KERNEL_MAX_ROWS = {jnp.dtype(jnp.float32): 64, jnp.dtype(jnp.bfloat16): 256}
AMX_MIN_ROWS = 8  # from this many rows of x on, bfloat16 products run on AMX tiles where permitted (cpu.cc)


def implementation(impl: str | None = None) -> str:
    """The implementation `matmul_t` runs: `impl`, else $JAXSERVE_MATMUL, else "cpu" on the CPU
    backend. Resolving "cpu" builds and registers its custom calls, which must happen before a
    compiled step that calls it is loaded from disk; where it cannot be built, the default falls
    back to "xla" and an explicit "cpu" is an error."""
    chosen = impl or os.environ.get(ENV)
    name = chosen or ("cpu" if jax.default_backend() == "cpu" else "xla")
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown matmul implementation {name!r} (from {'impl' if impl else ENV}); "
                         f"choose from {list(IMPLEMENTATIONS)}")
    if name == "cpu" and jax.default_backend() != "cpu":
        raise ValueError(f"the 'cpu' matmul kernel runs on the CPU backend only, not {jax.default_backend()!r}")
    if name == "cpu" and not all(build.register(*call) for call in CUSTOM_CALLS):
        if chosen:
            raise ValueError("the 'cpu' matmul kernel could not be built (see the log); choose 'xla'")
        return "xla"
    return name


def native_bf16() -> bool:
    """Whether the CPU kernel multiplies bfloat16 with the CPU's own instructions (built for a CPU
    with AVX512_BF16; see the top of `cpu.cc`)."""
    lib = build.library(SOURCE)
    return lib is not None and bool(lib.JaxserveMatmulNativeBf16())


def bf16_tiles() -> bool:
    """Whether the CPU kernel multiplies bfloat16 x and w on AMX tiles (from a few rows on, K a
    multiple of 32; see the top of `cpu.cc`): built for a CPU with AMX, and permitted by Linux."""
    lib = build.library(SOURCE)
    return lib is not None and bool(lib.JaxserveMatmulTiles())


def quantized_forms() -> tuple[str, ...]:
    """The forms the quantized kernel may run on this CPU (see the top of `quant.cc`), each rounding
    its own operand: "integer" (x to int8 per block of 32), "tile" (x and w to bfloat16), "float"
    (neither)."""
    lib = build.library(QUANT_SOURCE)
    if lib is None:
        return ()
    lib.JaxserveQuantMatmulForms.restype = ctypes.c_char_p
    return tuple(lib.JaxserveQuantMatmulForms().decode().split(","))


def keeps_grouped(devices: int) -> bool:
    """Whether a model on `devices` devices keeps its quantized matrices grouped (`quant.group_rows`):
    where the kernel's integer forms multiply them, on one CPU device (its grouped dot form measured
    faster than the row forms up to 32 rows of x and about even at 512 on AVX512-VNNI, 2-3x the float
    form's speed on AVX2; bench/RESULTS.md, "Quantized matrices kept grouped", "The quantized products
    on AVX2")."""
    return (devices == 1 and jax.default_backend() == "cpu" and implementation() == "cpu"
            and "integer" in quantized_forms())


def row_limit(x_dtype, w_dtype) -> float:
    """The most rows of x the kernel takes by default (see the top of the module)."""
    both_bf16 = jnp.dtype(x_dtype) == jnp.dtype(w_dtype) == jnp.dtype(jnp.bfloat16)
    return math.inf if both_bf16 and native_bf16() else KERNEL_MAX_ROWS[jnp.dtype(w_dtype)]


_LIVE_ROWS: contextvars.ContextVar = contextvars.ContextVar("live_rows", default=None)


@contextlib.contextmanager
def live_rows(count: jax.Array | None):
    """Within it (while a step is traced), the kernels' products compute only the first `count`
    rows of x (an int32 scalar, traced); the others' results are zero. None: every row. (Read when
    `matmul_t` is traced: a function traced once and reused elsewhere would keep the count.)"""
    token = _LIVE_ROWS.set(count)
    try:
        yield
    finally:
        _LIVE_ROWS.reset(token)


def kernels_here(impl: str | None = None) -> bool:
    """Whether the C++ kernels run in the computation being traced: the "cpu" implementation (`impl`,
    else the default), and no mesh of more than one device (XLA partitions its own ops, not a custom call)."""
    mesh = jax.sharding.get_abstract_mesh()
    return implementation(impl) == "cpu" and (mesh.empty or mesh.size == 1)


def kernels_run(devices: int) -> bool:
    """Whether the C++ kernels take a step's products on `devices` (else XLA's dot takes them all:
    another backend, the "xla" implementation, a mesh)."""
    return devices == 1 and jax.default_backend() == "cpu" and implementation() == "cpu"


def padding_computed_from(dtype, float_weights: bool, devices: int) -> int | None:
    """The fewest rows of x from which a step's products compute its padding rows too (only the C++
    kernels skip them, within `live_rows`), None for never: 0 where XLA's dot runs them all
    (not `kernels_run`); past `row_limit` where some matrices are `dtype` floats (XLA's dot takes
    the products past it); never where every matrix is quantized."""
    if not kernels_run(devices):
        return 0
    limit = row_limit(jnp.dtype(dtype), jnp.dtype(dtype)) if float_weights else math.inf
    return None if limit == math.inf else int(limit) + 1


def _live(rows: int) -> jax.Array:
    """The kernel's `live` operand: the count of `live_rows`, or all `rows` of x outside it."""
    count = _LIVE_ROWS.get()
    return jnp.asarray(rows if count is None else count, jnp.int32)


def matmul_t_reference(x: jax.Array, weight: jax.Array, dtype=None) -> jax.Array:
    return jax.lax.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(dtype or x.dtype)


def matmul_t(x: jax.Array, weight: jax.Array | QuantizedWeight, dtype=None, *, impl: str | None = None) -> jax.Array:
    """x[..., in] @ weight[out, in]^T -> [..., out], accumulated in float32, returned in `dtype`
    (default: x's). With the "cpu" implementation chosen by default, products of more than
    `row_limit` rows go to XLA's float32 dot (a bfloat16 weight widened first);
    `impl="cpu"` always runs the kernel. A quantized weight (`quant.py`) is multiplied by
    `quantized_matmul_t`."""
    if isinstance(weight, QuantizedWeight):
        return quantized_matmul_t(x, weight, dtype, impl=impl)
    dtype = jnp.dtype(dtype or x.dtype)
    *lead, k = x.shape
    rows = math.prod(lead)
    if not kernels_here(impl) or not {x.dtype, weight.dtype, dtype} <= set(KERNEL_DTYPES):
        return matmul_t_reference(x, weight, dtype)
    if impl is None and rows > row_limit(x.dtype, weight.dtype):
        if weight.dtype != jnp.float32:  # widened by the kernel, ordered after x (see WidenAfter in cpu.cc)
            weight = jax.ffi.ffi_call(WIDEN_TARGET, jax.ShapeDtypeStruct(weight.shape, jnp.float32))(x, weight)
        return matmul_t_reference(x.astype(jnp.float32), weight, dtype)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, weight.shape[0]), dtype))
    return call(x.reshape(rows, k), weight, _live(rows)).reshape(*lead, weight.shape[0])


def gated_silu(gate: jax.Array, up: jax.Array, *, token_rows: bool) -> jax.Array | None:
    """silu(gate) * up as `jaxserve.models.layers.gated` computes it, by the C++ kernel (`cpu.cc`)
    where the products' kernels run (`kernels_here`: the "cpu" implementation, no mesh) on float32 or
    bfloat16: XLA's fusion of it runs every row of a step's bucket, and on the CPU slower per row.
    Where gate's rows are the step's tokens (`token_rows`, not a Mixture-of-Experts layer's routed
    rows), only the `live_rows` are computed. None where the kernel does not run."""
    if (not kernels_here() or gate.ndim != 2 or gate.dtype not in KERNEL_DTYPES or up.dtype != gate.dtype
            or up.shape != gate.shape):
        return None
    rows = gate.shape[0]
    call = jax.ffi.ffi_call(GATED_TARGET, jax.ShapeDtypeStruct(gate.shape, gate.dtype))
    return call(gate, up, _live(rows) if token_rows else jnp.asarray(rows, jnp.int32))


def quantized_matmul_t(x: jax.Array, weight: QuantizedWeight, dtype=None, *, impl: str | None = None) -> jax.Array:
    """`matmul_t` with a quantized weight, accumulated in float32, returned in `dtype` (default:
    x's): the C++ kernel with "cpu" at every row count (see the top of the module), else XLA's dot of
    x and the weight dequantized to x's dtype (XLA fuses the conversion into the product on TPU and
    GPU)."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dimension ({x.shape[-1]}) must be the weight's input dimension "
                         f"({weight.shape[1]}, of a weight of shape {weight.shape})")
    dtype = jnp.dtype(dtype or x.dtype)
    if not _quantized_kernel(x, dtype, impl):
        return matmul_t_reference(x, dequantize(weight, x.dtype), dtype)
    return _kernel_products(x, [weight], dtype)[0]


def matmul_t_many(x: jax.Array, weights: list, dtype=None, *, impl: str | None = None) -> list[jax.Array]:
    """[matmul_t(x, w) for w in weights], the same values: where they are all quantized in one
    format, or all floats of one dtype, and the C++ kernel runs, one call takes them all (`quant.cc`,
    `cpu.cc`), so that a layer's products of one input (q, k and v; gate and up) quantize or pack x
    once and hand their work to the threads together; otherwise one product each."""
    dtype = jnp.dtype(dtype or x.dtype)
    if len(weights) > 1 and _float_kernel(x, weights, dtype, impl):
        return _float_products(x, weights, dtype, gated=False)
    if len(weights) > 1 and _many_quantized(x, weights, dtype, impl):
        return _kernel_products(x, weights, dtype)
    return [matmul_t(x, w, dtype, impl=impl) for w in weights]


def _many_quantized(x: jax.Array, weights: list, dtype, impl: str | None) -> bool:
    """Whether one call of the quantized kernel takes x's products by `weights`: all quantized in one
    format and layout, of x's K (a product alone says what does not fit)."""
    formats = {(w.fmt, _row_group(w)) if isinstance(w, QuantizedWeight) else None for w in weights}
    return (len(formats) == 1 and None not in formats and _quantized_kernel(x, dtype, impl)
            and all(x.shape[-1] == w.shape[1] for w in weights))


def gated_matmul_t(x: jax.Array, gate, up, *, impl: str | None = None) -> jax.Array | None:
    """silu(x gate^T) * (x up^T), each product rounded to x's dtype first: `matmul_t_many`'s two products
    and `gated_silu` of them, the same values (within `live_rows`, x's first rows; the others zero), in
    one call of the C++ kernel where it would take both products in one call (`matmul_t_many`): for
    float weights (`cpu.cc`) the activation is applied to each block of the products as it is computed,
    for quantized ones (`quant.cc`) to both products' float32 sums at the end of the call; not in a call
    and a pass of its own over both. None where the kernel does not take them together, or where AMX
    tiles would take the bfloat16 products (their form runs one weight a call)."""
    dtype = jnp.dtype(x.dtype)
    if x.ndim != 2 or gate.shape != up.shape:
        return None
    if _float_kernel(x, [gate, up], dtype, impl):
        tiles = (dtype == gate.dtype == jnp.bfloat16 and x.shape[0] >= AMX_MIN_ROWS and x.shape[1] % 32 == 0
                 and bf16_tiles())
        return None if tiles else _float_products(x, [gate, up], dtype, gated=True)[0]
    if _many_quantized(x, [gate, up], dtype, impl):
        return _kernel_products(x, [gate, up], dtype, gated=True)[0]
    return None


def _float_kernel(x: jax.Array, weights: list, dtype, impl: str | None) -> bool:
    """Whether one call of the C++ kernel takes x's products by the float `weights`: where `matmul_t`
    would run the kernel for each (their dtype one), weights [N, K] of x's K."""
    if any(isinstance(w, QuantizedWeight) for w in weights) or len({w.dtype for w in weights}) != 1:
        return False
    w_dtype = weights[0].dtype
    rows = math.prod(x.shape[:-1])
    return (kernels_here(impl) and {x.dtype, w_dtype, dtype} <= set(KERNEL_DTYPES)
            and all(w.ndim == 2 and w.shape[1] == x.shape[-1] for w in weights)
            and (impl is not None or rows <= row_limit(x.dtype, w_dtype)))


def _float_products(x: jax.Array, weights: list, dtype, *, gated: bool) -> list[jax.Array]:
    """The C++ kernel's products of x by float weights in one call (gated: gate and up, one y)."""
    *lead, k = x.shape
    rows = math.prod(lead)
    outs = weights[:1] if gated else weights
    ys = [jax.ShapeDtypeStruct((rows, w.shape[0]), dtype) for w in outs]
    ys = jax.ffi.ffi_call(FLOAT_MANY_TARGET, ys)(x.reshape(rows, k), _live(rows), *weights, gated=np.int64(gated))
    return [y.reshape(*lead, w.shape[0]) for y, w in zip(ys, outs)]


def _kernel_products(x: jax.Array, weights: list[QuantizedWeight], dtype, *, gated: bool = False
                     ) -> list[jax.Array]:
    """The C++ kernel's products of x by quantized weights of one format and layout: one weight in
    rows by its format's handler, several (or grouped ones, each one array) by the handler of many
    (gated: gate and up, one y)."""
    *lead, k = x.shape
    rows, row_group = math.prod(lead), _row_group(weights[0])
    outs = weights[:1] if gated else weights
    ys = [jax.ShapeDtypeStruct((rows, w.shape[0]), dtype) for w in outs]
    operands = [part for w in weights for part in _operands(w)]
    live = _live(rows)
    if len(weights) == 1 and not row_group:
        ys = [jax.ffi.ffi_call(QUANT_TARGETS[weights[0].fmt], ys[0])(x.reshape(rows, k), live, *operands)]
    else:
        ys = jax.ffi.ffi_call(MANY_TARGET, ys)(x.reshape(rows, k), live, *operands, row_group=row_group,
                                               gated=np.int64(gated))
    return [y.reshape(*lead, w.shape[0]) for y, w in zip(ys, outs)]


def _quantized_kernel(x: jax.Array, dtype, impl: str | None) -> bool:
    """Whether the C++ kernel multiplies x by a quantized weight (else XLA's dot of the dequantized one)."""
    return kernels_here(impl) and {x.dtype, jnp.dtype(dtype)} <= set(KERNEL_DTYPES)


def _row_group(weight: QuantizedWeight) -> np.int64:
    """The kernel's attribute for the weight's layout: GROUP_ROWS grouped (`quant.GroupedRows`), 0 in rows."""
    return np.int64(GROUP_ROWS if isinstance(weight, GroupedRows) else 0)


def _operands(weight: QuantizedWeight) -> tuple[jax.Array, ...]:
    """The kernel's operands of a weight: data, scales (and mins, int4) in rows; grouped, its one array."""
    return tuple(part for part in weight if part is not None)
