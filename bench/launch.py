"""What launching a compiled step costs the host, by the number of arrays it takes: the calling
thread's CPU time per call of a trivial program whose arguments come as a decode step's do.

    python bench/launch.py [--rounds 60] [--layers 30]

A step's launch parses, checks and holds every argument array and makes every output array, on the
engine thread, before the step is computed (bench/step_profile.py reports that thread's CPU per step
and the launch's part of it). On one CPU device the default model's step takes its weights as 272
arrays (per layer, seven quantized matrices kept grouped, each one array, and two norms; 693 when a
matrix's data, scales and mins were three) and its KV cache as one K and one V array per layer,
donated and given back. Each column here is a program that reads one value of each kind of argument
(so that every array is an argument) and writes one slot of each KV array (so that each is donated
and given back), called with its arguments arranged one way:

- weights with a matrix's three parts apart (21 matrix parts and 2 norms per layer), a matrix as
  one array (9 per layer, as the model keeps them), or one array per layer;
- the KV cache as two arrays per layer, or one K and one V array for all layers.

Before each call the host writes a 128 MB buffer, as a step's weights evict the caches between
launches. The variants alternate within each round; reported: the median over rounds, in ms of the
calling thread's CPU per call.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

KV_SHAPE = (64, 16, 3, 64)  # [pages, page size, KV heads, head dim]; the size does not change the cost


def program(num_weights: int, kv_arrays: int, layers: int):
    """A call(round) of the trivial program over `num_weights` weight arrays and `kv_arrays` donated
    KV arrays (per layer, or stacked over the layers when there are two)."""
    weights = [jnp.full((16, 16), i, jnp.float32) for i in range(num_weights)]
    shape = KV_SHAPE if kv_arrays > 2 else (layers, *KV_SHAPE)
    state = {"kv": [jnp.zeros(shape, jnp.bfloat16) for _ in range(kv_arrays)]}

    def step(weights, kv, t):
        total = sum(w[0, 0] for w in weights) + t
        return [pages.at[(0,) * pages.ndim].set(total.astype(pages.dtype)) for pages in kv], total

    compiled = jax.jit(step, donate_argnums=(1,)).lower(weights, state["kv"], 0).compile()

    def call(i: int):
        state["kv"], out = compiled(weights, state["kv"], i)
        return out

    call(0).block_until_ready()
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--layers", type=int, default=30, help="the default model's 30")
    args = ap.parse_args()
    n = args.layers
    weights = {"parts apart (23 a layer)": 23 * n + 3, "a matrix one array (9 a layer)": 9 * n + 2,
               "one a layer": n + 2}
    kv = {"KV per layer": 2 * n, "KV stacked": 2}
    calls = {(w, k): program(num_w, num_kv, n) for w, num_w in weights.items() for k, num_kv in kv.items()}
    evict = np.ones(32 << 20, np.float32)
    times = {key: [] for key in calls}
    for r in range(args.rounds):
        for key, call in calls.items():
            evict[::16] += 1
            start = time.thread_time()
            out = call(r)
            times[key].append(time.thread_time() - start)
            out.block_until_ready()
    print(f"# the launch's CPU, ms per call (median of {args.rounds} rounds, caches evicted), {n} layers\n")
    print("| weights | arrays | " + " | ".join(f"{k} ({num} arrays)" for k, num in kv.items()) + " |")
    print("| --- | --- |" + " --- |" * len(kv))
    for w, num_w in weights.items():
        cells = " | ".join(f"{np.median(times[w, k]) * 1e3:.3f}" for k in kv)
        print(f"| {w} | {num_w} | {cells} |")


if __name__ == "__main__":
    main()
