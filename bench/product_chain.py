"""One-row products in a chain, as a decode step's layers run them: does a call's size set its read rate?

    python bench/product_chain.py [--rounds 5] [--dtype int4]

A fused decode layer would replace a layer's several calls by one. What that could buy in the products
is what a call costs beyond its bytes. Here x (one row) goes through pairs of products, up then down
with the residual added (`x = down(up(x) * c) + x`, each product depending on the one before, as in
the model), the weights grouped as a model on one CPU device keeps them (`quant.group_rows`) and
streamed from memory (about 170 MB a chain, distinct per call). The same bytes are cut into calls of
SmolLM2-135M's MLP (576 -> 1536, 0.55 MB a call in int4), and into calls 2, 4 and 8 times larger (576
-> 3072 and so on); the sizes alternate within each round. Reported: per size, the median over rounds of
us per call and GB/s of weight bytes read, beside the machine's read rate measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from quant_matmul import make_weights, read_bandwidth
from roofline import best_time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HIDDEN, INTERMEDIATE, PAIRS = 576, 1536, 150  # SmolLM2-135M's MLP; 150 pairs: about 170 MB in int4


def chain(rng, scale: int, fmt: str):
    """-> (a call timing the chain once, bytes of its weights, calls in it): PAIRS / scale pairs of
    [INTERMEDIATE * scale, HIDDEN] and [HIDDEN, INTERMEDIATE * scale] products."""
    import jax
    import jax.numpy as jnp

    from jaxserve_kernels.matmul import matmul_t
    from jaxserve_kernels.matmul.quant import group_rows, nbytes

    pairs, inter = PAIRS // scale, INTERMEDIATE * scale
    up = [group_rows(w, jnp) for w in make_weights(rng, (inter, HIDDEN), fmt, pairs)]
    down = [group_rows(w, jnp) for w in make_weights(rng, (HIDDEN, inter), fmt, pairs)]

    def layers(x, up, down):
        for u, d in zip(up, down):
            x = matmul_t(matmul_t(x, u) * 0.01, d) + x
        return x

    call = jax.jit(layers)
    x = jnp.asarray(rng.standard_normal((1, HIDDEN)), jnp.float32)
    return (lambda: jax.block_until_ready(call(x, up, down))), sum(map(nbytes, up + down)), 2 * pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="int4", choices=("int8", "int4"))
    args = parser.parse_args()
    from common import machine_line

    rng = np.random.default_rng(0)
    chains = {scale: chain(rng, scale, args.dtype) for scale in (1, 2, 4, 8)}
    times = {scale: [] for scale in chains}
    bandwidth = []
    for _ in range(args.rounds):
        bandwidth.append(read_bandwidth())
        for scale, (run, _, _) in chains.items():
            times[scale].append(best_time(run, 3))
    print(f"{machine_line()}. Command: `python bench/product_chain.py --rounds {args.rounds} --dtype {args.dtype}`; "
          f"the machine's read rate (XLA, a 1 GiB array summed), median of the rounds: "
          f"{np.median(bandwidth) / 1e9:.1f} GB/s.\n")
    print("| a call's shape (up; down is its transpose) | MB a call | calls a chain | us a call | GB/s |")
    print("| --- | --- | --- | --- | --- |")
    for scale, (_, nbytes, calls) in chains.items():
        t = float(np.median(times[scale]))
        print(f"| {HIDDEN} -> {INTERMEDIATE * scale} | {nbytes / calls / 1e6:.2f} | {calls} | "
              f"{t / calls * 1e6:.1f} | {nbytes / t / 1e9:.1f} |")


if __name__ == "__main__":
    main()
