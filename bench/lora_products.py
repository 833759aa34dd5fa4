"""The two forms of the LoRA adapters' products (`jaxserve.models.lora.lora_delta`), timed as a step runs
them, on whatever backend JAX has (no server, no model file: jax and jaxserve's layers only).

    python bench/lora_products.py [--slots 4] [--rank 16] [--dims default | 8b | D,INTER,KV,LAYERS]

Each layer's 7 projections (q, k, v, o, gate, up, down) one after another, scanned over the layers, each
its base product plus the adapters' (grouped: two grouped products over the rows sorted by slot;
masked: every row through every slot's A, masked to its own slot's ranks, then through B), against the
base products alone, for 1 to 256 rows spread over the slots, in bfloat16 and float32. `--dims default`
is the default model's shapes (SmolLM2-135M), `8b` a Llama-3-8B's.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.models.lora import LoraRows, lora_delta  # noqa: E402
from jaxserve_kernels import matmul_t  # noqa: E402

DIMS = {"default": (576, 1536, 192, 30), "8b": (4096, 14336, 1024, 32)}  # hidden, intermediate, kv width, layers


def chain(x, weights, adapters, lora, form, skip_idle=True, scan=False):
    """x through every layer's 7 projections (each reading the last output of its input width), the
    layers unrolled as the model runs them, or scanned (compiles faster)."""
    def layer(x, params):
        ws, abs_ = params
        h = {x.shape[1]: x}
        for w, (a, b) in zip(ws, abs_):
            y = matmul_t(h[w.shape[1]], w)
            if form:
                y = y + lora_delta(h[w.shape[1]], a, b, lora, form, skip_idle)
            h[w.shape[0]] = y
        return h[x.shape[1]], None

    if scan:
        return jax.lax.scan(layer, x, (weights, adapters))[0]
    for i in range(weights[0].shape[0]):
        x = layer(x, jax.tree.map(lambda v: v[i], (weights, adapters)))[0]
    return x


def table(slots: int, rank: int, dims: tuple[int, int, int, int], repeats: int = 20, scan: bool = False) -> str:
    d, inter, kv, layers = dims
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (inter, d), (inter, d), (d, inter)]
    device = jax.devices()[0]
    lines = [f"{time.strftime('%Y-%m-%d')}, {device.device_kind} ({jax.default_backend()}, {os.cpu_count()} cores), "
             f"jax {jax.__version__}; `python bench/lora_products.py --slots {slots} --rank {rank} --dims "
             f"{','.join(map(str, dims))}{' --scan' if scan else ''}`: ms per step's worth of products "
             f"({7 * layers} projections), medians of 3 x {repeats}.", "",
             "| dtype | rows | base only | + grouped | + masked | + masked, no skip | no row adapted "
             "| grouped / masked |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for dtype in (jnp.bfloat16, jnp.float32):
        keys = iter(jax.random.split(jax.random.key(0), 3 * len(shapes) + 1))

        def draw(shape):
            return (0.02 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

        weights = [draw((layers, *s)) for s in shapes]
        adapters = [(draw((layers, slots, rank, s[1])), draw((layers, slots, s[0], rank))) for s in shapes]
        x_all = draw((256, d)) * 50
        for rows in (1, 4, 16, 32, 256):
            x = x_all[:rows]
            lora = LoraRows(**{k: jnp.asarray(v) for k, v in LoraRows.of(np.arange(rows) % slots, slots).items()})
            figures = []
            idle = LoraRows(**{k: jnp.asarray(v) for k, v in LoraRows.of(np.full(rows, -1), slots).items()})
            for form, skip, rows_of in ((None, True, lora), ("grouped", True, lora), ("masked", True, lora),
                                        ("masked", False, lora), ("masked", True, idle)):
                f = jax.jit(functools.partial(chain, form=form, skip_idle=skip, scan=scan))
                f(x, weights, adapters, rows_of).block_until_ready()
                times = []
                for _ in range(3):
                    start = time.perf_counter()
                    for _ in range(repeats):
                        out = f(x, weights, adapters, rows_of)
                    out.block_until_ready()
                    times.append((time.perf_counter() - start) / repeats * 1e3)
                figures.append(sorted(times)[1])
            lines.append(f"| {jnp.dtype(dtype).name} | {rows} | " + " | ".join(f"{t:.2f}" for t in figures)
                         + f" | {figures[1] / figures[2]:.2f} |")
            print(lines[-1], flush=True)
        del weights, adapters
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dims", default="default", help="default, 8b, or hidden,intermediate,kv,layers")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--scan", action="store_true", help="scan over the layers (compiles faster)")
    args = parser.parse_args()
    dims = DIMS.get(args.dims) or tuple(int(v) for v in args.dims.split(","))
    print(table(args.slots, args.rank, dims, args.repeats, args.scan))


if __name__ == "__main__":
    main()
