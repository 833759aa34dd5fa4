"""The machine's limits, measured: memory bandwidth and matrix-multiply rate (float32, bfloat16).

    python bench/roofline.py [--threads 2]

Bandwidth: a 1 GiB array copied (bytes read + written per second), best of numpy, PyTorch and XLA;
and read only (the same array summed, bytes read per second), best of PyTorch and XLA: what a decode
step does with the weights (the copy rate counts the bytes read and written, not the cache lines a
write first reads, so it is the lower of the two).
Matmul rate: square 2048 products, best of PyTorch and XLA, per dtype. Then the same products at
bench-125m's decode shapes (tokens x 768 @ 768 x 2048 and the 768 x 32000 head), per library and dtype:
the study behind jaxserve's choice of dtype on CPU.
"""

from __future__ import annotations

import argparse
import time


def best_time(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def xla_matmul(m: int, k: int, n: int, dtype: str):
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (m, k), dtype)
    b = jax.random.normal(jax.random.key(1), (k, n), dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    return lambda: f(a, b).block_until_ready()


def torch_matmul(m: int, k: int, n: int, dtype: str):
    import torch

    a = torch.randn(m, k).to(getattr(torch, dtype))
    b = torch.randn(k, n).to(getattr(torch, dtype))
    return lambda: torch.matmul(a, b)


def measure(threads: int = 2) -> dict:
    """{'bandwidth': bytes/s copied, 'read_bandwidth': bytes/s read, 'flops': {dtype: FLOP/s},
    'decode': [(shape, {impl-dtype: FLOP/s})]}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    size = 1 << 28  # float32 elements: 1 GiB
    a, b = np.ones(size, np.float32), np.empty(size, np.float32)
    ta, tb = torch.ones(size), torch.empty(size)
    xa = jnp.ones(size, jnp.float32)
    xcopy = jax.jit(lambda x: x + 1.0)
    copies = {"numpy": lambda: np.copyto(b, a), "torch": lambda: tb.copy_(ta),
              "xla": lambda: xcopy(xa).block_until_ready()}
    bandwidth = max(2 * 4 * size / best_time(fn, 3) for fn in copies.values())
    xsum = jax.jit(jnp.sum)
    reads = {"torch": lambda: ta.sum().item(), "xla": lambda: xsum(xa).block_until_ready()}
    read_bandwidth = max(4 * size / best_time(fn, 3) for fn in reads.values())
    del a, b, ta, tb, xa

    def rate(impl, m, k, n, dtype) -> float:
        return 2 * m * k * n / best_time(impl(m, k, n, dtype))

    flops = {dtype: max(rate(impl, 2048, 2048, 2048, dtype) for impl in (xla_matmul, torch_matmul))
             for dtype in ("float32", "bfloat16")}
    decode = []
    for m, k, n in ((1, 768, 2048), (32, 768, 2048), (256, 768, 2048), (32, 768, 32000)):
        decode.append(((m, k, n), {f"{name}-{dtype}": rate(impl, m, k, n, dtype)
                                   for name, impl in (("xla", xla_matmul), ("torch", torch_matmul))
                                   for dtype in ("float32", "bfloat16")}))
    return dict(bandwidth=bandwidth, read_bandwidth=read_bandwidth, flops=flops, decode=decode)


def report(limits: dict) -> str:
    lines = [f"- memory bandwidth (copy, read + write): {limits['bandwidth'] / 1e9:.1f} GB/s",
             f"- memory bandwidth (read only): {limits['read_bandwidth'] / 1e9:.1f} GB/s",
             *(f"- matmul 2048^3 {dtype}: {rate / 1e9:.0f} GFLOP/s" for dtype, rate in limits["flops"].items()),
             "", "| product (M x K @ K x N) | " + " | ".join(limits["decode"][0][1]) + " |",
             "| --- |" + " --- |" * len(limits["decode"][0][1])]
    for shape, rates in limits["decode"]:
        lines.append(f"| {' x '.join(map(str, shape))} | " + " | ".join(f"{r / 1e9:.0f}" for r in rates.values())
                     + " |")
    return "\n".join(lines) + "\n(GFLOP/s)"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(report(measure(args.threads)))
