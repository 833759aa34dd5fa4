"""Quantized weights against bfloat16 ones: y = x w^T through `jaxserve_kernels.matmul_t` on the CPU backend.

    python bench/quant_matmul.py [--runs 2] [--rows 1,4,32,512] [--dtype bfloat16] [--reference] [--resident 200]
                                 [--grouped]

For each [out, in] shape of a real model (SmolLM2-135M's MLP and LM head, a 125M model's MLP) and
each row count M, the same product with the weight in bfloat16 (the CPU kernel `cpu.cc`, as the model
calls it), in int8 and in int4 (`quant.cc`), side by side in one run. Each column is one jitted call
of `copies` products with distinct weights of the shape (at least 1 GiB of bfloat16 weights, more
than the caches hold, so that they stream from memory as a model's layers do), best of 5. Reported: ms
per product, GB/s of weight bytes read (data, scales and mins as stored), and the int4 / bfloat16
and int8 / bfloat16 time ratios. `--reference` adds XLA's dot of x and the weight dequantized to x's
dtype (`impl="xla"`), the path off the CPU kernel. `--resident N` instead multiplies N rows of x
(one per product, so that XLA cannot merge the products) by one weight per column, which stays in
the caches: what the kernel's instructions cost without memory's. `--grouped` adds the int8 and int4
weights kept grouped (`quant.group_rows`, as a model on one CPU device keeps its linear layers), and
their time over the same weight's in rows. The weights are random bytes, not quantized floats: only
the time is measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from roofline import best_time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {"SmolLM2-135M up (576 -> 1536)": (1536, 576), "SmolLM2-135M down (1536 -> 576)": (576, 1536),
          "SmolLM2-135M head (576 -> 49152)": (49152, 576), "125M up (768 -> 3072)": (3072, 768)}  # [out, in]
ROWS = (1, 4, 32, 512)
STREAMED_BYTES = 2**30  # bfloat16 weights per column, at least: more than the caches hold


def make_weights(rng, shape, fmt: str, copies: int) -> list:
    """`copies` weights of `shape` in `fmt`, each in its own buffer (random bytes, offset per copy)."""
    import jax
    import jax.numpy as jnp

    from jaxserve_kernels.matmul.quant import BLOCK, QuantizedWeight

    out, width = shape
    scales = jnp.asarray(rng.uniform(0.001, 0.01, (out, width // BLOCK)), jnp.float16)
    if fmt == "bfloat16":
        base = jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, jnp.bfloat16)
    elif fmt == "int8":
        base = jnp.asarray(rng.integers(-127, 128, shape, np.int8))
    else:
        base = jnp.asarray(rng.integers(0, 256, (out, width // 2), np.uint8))
    offset = jax.jit(lambda a, i: a + i.astype(a.dtype))  # a new buffer per copy
    data = [offset(base, jnp.asarray(i)) for i in range(copies)]
    if fmt == "bfloat16":
        return data
    return [QuantizedWeight(d, offset(scales, jnp.asarray(i)), None if fmt == "int8" else -8 * scales)
            for i, d in enumerate(data)]


def read_bandwidth() -> float:
    """Bytes per second XLA reads (a 1 GiB array summed), as bench/roofline.py measures it."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(1 << 28, jnp.float32)
    total = jax.jit(jnp.sum)
    return x.nbytes / best_time(lambda: total(x).block_until_ready(), 3)


def products(impl: str | None):
    """One jitted call of matmul_t(x, w) for every pair of xs and ws, all outputs returned (nothing
    else computed)."""
    import jax

    from jaxserve_kernels.matmul import matmul_t

    return jax.jit(lambda xs, ws: [matmul_t(x, w, impl=impl) for x, w in zip(xs, ws)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts M")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="x's dtype (and y's)")
    parser.add_argument("--reference", action="store_true", help="also time XLA's dot on the dequantized weight")
    parser.add_argument("--resident", type=int, default=0, metavar="N",
                        help="N products of one weight, which stays in the caches (default: weights streamed)")
    parser.add_argument("--grouped", action="store_true",
                        help="also time int8 and int4 weights kept grouped (`quant.group_rows`)")
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp

    from common import machine_line
    from jaxserve_kernels.matmul import implementation, native_bf16, quantized_forms
    from jaxserve_kernels.matmul.quant import group_rows, nbytes

    assert implementation() == "cpu", "the CPU kernels could not be built"
    rng = np.random.default_rng(0)
    columns = [("bfloat16", None), ("int8", None), ("int4", None)]
    if args.reference:
        columns += [("int8", "xla"), ("int4", "xla")]
    if args.grouped:
        columns += [("int8 grouped", None), ("int4 grouped", None)]
    names = [fmt + (" (xla reference)" if impl else "") for fmt, impl in columns]
    reference = ((" --reference" if args.reference else "") + (f" --resident {args.resident}" if args.resident else "")
                 + (" --grouped" if args.grouped else ""))
    print(f"{machine_line()}, {jax.device_count()} CPU device, XLA's threads. Command: `python bench/quant_matmul.py "
          f"--runs {args.runs} --rows {args.rows} --dtype {args.dtype}{reference}`. bfloat16 products on the CPU's "
          f"bfloat16 instructions: {native_bf16()}; the quantized kernel's forms: {', '.join(quantized_forms())}.\n")
    print(f"Memory read bandwidth (XLA, a 1 GiB array summed, same run): {read_bandwidth() / 1e9:.1f} GB/s.\n")
    print("ms per product, and GB/s of weight bytes read:\n")
    print("| run | shape [out, in] | copies | M | " + " | ".join(f"{n} ms | {n} GB/s" for n in names)
          + " | int8 / bf16 | int4 / bf16 |" + (" int8 grouped / int8 | int4 grouped / int4 |" if args.grouped else ""))
    print("| --- | --- | --- | --- |" + " --- | --- |" * len(names) + " --- | --- |" + " --- | --- |" * args.grouped)
    for title, shape in SHAPES.items():
        copies = args.resident or -(-STREAMED_BYTES // (2 * shape[0] * shape[1]))
        weights = {fmt: make_weights(rng, shape, fmt, 1) * copies if args.resident
                   else make_weights(rng, shape, fmt, copies) for fmt in ("bfloat16", "int8", "int4")}
        if args.grouped:
            weights.update({f"{fmt} grouped": [group_rows(w, jnp) for w in weights[fmt]] for fmt in ("int8", "int4")})
        calls = {impl: products(impl) for impl in (None, "xla")}
        for run in range(1, args.runs + 1):
            for m in map(int, args.rows.split(",")):
                x = jnp.asarray(rng.standard_normal(((copies,) if args.resident else ()) + (m, shape[1])), args.dtype)
                xs = list(x) if args.resident else [x] * copies
                times = [best_time(lambda call=calls[impl], ws=weights[fmt]: jax.block_until_ready(call(xs, ws)))
                         / copies for fmt, impl in columns]
                rates = [nbytes(weights[fmt][0]) / t / 1e9 for (fmt, _), t in zip(columns, times)]
                cells = [f"{1000 * t:.3f} | {r:.1f}" for t, r in zip(times, rates)]
                grouped = f" {times[-2] / times[1]:.2f} | {times[-1] / times[2]:.2f} |" if args.grouped else ""
                print(f"| {run} | {title} | {copies} | {m} | " + " | ".join(cells)
                      + f" | {times[1] / times[0]:.2f} | {times[2] / times[0]:.2f} |" + grouped, flush=True)
        del weights


if __name__ == "__main__":
    main()
