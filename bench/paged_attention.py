"""Paged-attention kernels against the XLA implementation and the reference, per shape.

    python bench/paged_attention.py                 # on a TPU or GPU VM: realistic shapes, the backend's kernel
    python bench/paged_attention.py --dtype float32 # on CPU: bench-125m's shapes, the C++ kernel
    python bench/paged_attention.py --interpret     # anywhere (CPU): small shapes, kernels in Pallas' interpreter
    python bench/paged_attention.py --cold          # on CPU: K and V out of the caches before each call, as in a step

For each shape (a batch of sequences each adding `new` query tokens to a context of `context`
tokens) it times every implementation and reports the bandwidth reached: the bytes of K and V
the step must read (each sequence's `context` keys and values, once) over the time, and that
as a fraction of the device's peak (`--peak-gbps`, default by device kind). In interpret mode
the times say nothing about speed; the run only keeps the script and the kernels working.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve_kernels import cache_dtype, paged_attention  # noqa: E402
from jaxserve_kernels.paged_attention import BY_BACKEND  # noqa: E402
from jaxserve_kernels.paged_attention.reference import to_cache  # noqa: E402

PEAK_GBPS = {"TPU v4": 1200, "TPU v5 lite": 819, "TPU v5e": 819, "TPU v5p": 2765, "TPU v6 lite": 1640,
             "H100": 3350, "H200": 4800, "A100": 2039, "L4": 300}
# (sequences, new tokens each, context, head_dim, query heads per KV head)
FULL = [(b, 1, c, d, g) for b in (1, 32, 256) for c in (128, 2048, 32768) for d in (64, 128) for g in (1, 4, 8)
        if b * c <= 256 * 4096] + [(4, 512, 4096, 128, 4), (16, 128, 2048, 128, 8)]
SMALL = [(2, 1, 64, 64, 1), (4, 1, 128, 64, 4), (2, 16, 96, 64, 8)]
# CPU: steps the size of bench-125m's W1 and W2 decodes and prefills, and 512-token prefill chunks (head_dim
# 64, 3 query heads per KV head; 8 KV heads, as in every shape here)
CPU = [(1, 1, 256, 64, 3), (32, 1, 256, 64, 3), (64, 1, 512, 64, 3), (1, 128, 128, 64, 3), (4, 128, 128, 64, 3),
       (1, 512, 512, 64, 3), (1, 512, 2048, 64, 3)]


def make_step(num_seqs: int, new: int, context: int, head_dim: int, group: int, dtype, page_size: int = 16,
              num_kv_heads: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-context // page_size)
    num_pages = 1 + num_seqs * pages_per_seq
    page_table = (1 + rng.permutation(num_pages - 1)).reshape(num_seqs, pages_per_seq).astype(np.int32)
    query_start = (np.arange(num_seqs + 1) * new).astype(np.int32)
    kv_lens = np.full(num_seqs, context, np.int32)
    # (drawn on the device: a long-context step holds billions of cache values, too many to draw and move from numpy)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (num_seqs * new, num_kv_heads * group, head_dim), dtype)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    store = jnp.zeros((), cache_dtype(dtype))
    k, v = (to_cache(jax.random.normal(key, shape, dtype), store) for key in (kk, kv))
    kv_bytes = 2 * num_seqs * context * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
    return (q, k, v, kv_lens, page_table, query_start, np.int32(num_seqs)), kv_bytes


def time_call(fn, args, repeats: int, evict=None) -> float:
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(repeats):
        if evict is not None:
            evict()
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interpret", action="store_true", help="run the Pallas kernels in the interpreter, small shapes")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peak-gbps", type=float, default=None, help="the device's memory bandwidth (GB/s)")
    ap.add_argument("--cold", action="store_true", help="before each call, write a buffer larger than the CPU's "
                    "caches: in a decode step the weights read between two layers' attention evict K and V")
    args = ap.parse_args()
    evict = None
    if args.cold:
        flush = np.zeros(256 << 20, np.uint8)
        evict = functools.partial(np.add, flush, 1, out=flush)
    kind = jax.devices()[0].device_kind
    peak = args.peak_gbps or next((v for k, v in PEAK_GBPS.items() if k in kind), None)
    if args.interpret:
        impls, shapes = ["reference", "xla", "tpu-interpret", "gpu-interpret"], SMALL
        impls += ["cpu"] if jax.default_backend() == "cpu" else []
    elif jax.default_backend() == "cpu":
        impls, shapes = ["reference", "xla", "cpu"], CPU
    else:
        kernel = BY_BACKEND.get(jax.default_backend())
        impls, shapes = ["reference", "xla"] + ([kernel] if kernel else []), FULL
    print(f"# paged attention, {args.dtype}{', cold caches' if args.cold else ''}, on {kind} "
          f"({jax.default_backend()}), peak {peak or '?'} GB/s\n")
    print("| seqs | new | context | head_dim | group | " + " | ".join(f"{i} ms (GB/s, % peak)" for i in impls) + " |")
    print("|" + " --- |" * (5 + len(impls)))
    for shape in shapes:
        step, kv_bytes = make_step(*shape, dtype=jnp.dtype(args.dtype))
        step = jax.device_put(step)  # on the device once: the timed calls move no host arrays
        cells = []
        for impl in impls:
            fn = jax.jit(lambda *a, impl=impl: paged_attention(*a, sm_scale=0.1, impl=impl))
            try:
                seconds = time_call(fn, step, args.repeats, evict)
            except Exception as e:  # e.g. out of memory for the reference at long contexts
                cells.append(f"failed: {type(e).__name__}")
                continue
            gbps = kv_bytes / seconds / 1e9
            cells.append(f"{seconds * 1e3:.3f} ({gbps:.0f}, {100 * gbps / peak:.0f} %)" if peak
                         else f"{seconds * 1e3:.3f} ({gbps:.1f})")
        print("| " + " | ".join(map(str, shape)) + " | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
