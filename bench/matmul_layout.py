"""Which weight layout XLA:CPU multiplies fastest at decode shapes: [in, out] or [out, in].

    python bench/matmul_layout.py [--runs 2] [--rows 1,2,8,32,128] [--only NAME,...]

The products of one bench-125m decode step (12 layers of q, k, v, o, gate, up, down, then the
768 x 32000 head; 100 M weights, 400 MB in float32, so they stream from memory as in serving),
chained through the layers, for M = 1 ... 128 token rows. Each configuration is jitted once and
timed (best of 10). PyTorch's `x @ W.T` on the [out, in] weights is the peer, in the same run.
jaxserve stores its weights [out, in] (`jaxserve.models.layers.Linear`) because of this table. The
"jaxserve cpu kernel" columns run `jaxserve_kernels.matmul_t` with the C++ CPU kernel on the same [out, in]
weights; the "jaxserve default" ones `jaxserve_kernels.matmul_t` as the model calls it (the kernel up to its
row limit, then XLA's float32 dot). `--only` keeps the columns whose names contain one of the
given strings (prefill row counts are slow for PyTorch's bfloat16).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from roofline import best_time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYERS, HIDDEN, KV, INTER, VOCAB = 12, 768, 256, 2048, 32000
SHAPES = dict(q=(HIDDEN, HIDDEN), k=(KV, HIDDEN), v=(KV, HIDDEN), o=(HIDDEN, HIDDEN), gate=(INTER, HIDDEN),
              up=(INTER, HIDDEN), down=(HIDDEN, INTER))  # [out, in]
ROWS = (1, 2, 8, 32, 128)


def weights(rng) -> tuple[list[dict], np.ndarray]:
    layers = [{name: (rng.standard_normal(shape, np.float32) * 0.02) for name, shape in SHAPES.items()}
              for _ in range(LAYERS)]
    return layers, rng.standard_normal((VOCAB, HIDDEN), np.float32) * 0.02


def decode_products(x, layers, head, mm):
    """The step's products (attention replaced by a cheap mix of q, k and v); `mm(x, name_or_head)`."""
    for layer in layers:
        q, k, v = mm(x, layer["q"]), mm(x, layer["k"]), mm(x, layer["v"])
        x = x + mm(q + 0.1 * (k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True)), layer["o"])
        x = x + mm(mm(x, layer["gate"]) * mm(x, layer["up"]), layer["down"])
    return mm(x, head)


def xla_step(layers, head, dtype: str, layout: str, impl: str | None = "xla"):
    """impl "cpu": jaxserve's CPU kernel (`jaxserve_kernels.matmul`, [out, in] only) instead of XLA's dot;
    None: `jaxserve_kernels.matmul_t`'s default choice."""
    import jax
    import jax.numpy as jnp

    from jaxserve_kernels.matmul import matmul_t

    def put(w):  # w is [out, in]
        return jnp.asarray(w if layout == "out,in" else w.T, dtype)

    dev_layers = [{n: put(w) for n, w in layer.items()} for layer in layers]
    dev_head = put(head)
    contract = 1 if layout == "out,in" else 0

    def mm(x, w):
        if impl != "xla":
            return matmul_t(x, w, impl=impl)
        return jax.lax.dot_general(x, w, (((1,), (contract,)), ((), ())),
                                   preferred_element_type=jnp.float32).astype(x.dtype)

    step = jax.jit(lambda ls, h, x: decode_products(x, ls, h, mm))
    return lambda x: step(dev_layers, dev_head, jnp.asarray(x, dtype)).block_until_ready()


def torch_step(layers, head, dtype: str):
    import torch

    t_layers = [{n: torch.from_numpy(w).to(getattr(torch, dtype)) for n, w in layer.items()} for layer in layers]
    t_head = torch.from_numpy(head).to(getattr(torch, dtype))

    def run(x):
        with torch.no_grad():
            return decode_products(torch.from_numpy(x).to(getattr(torch, dtype)), t_layers, t_head,
                                   lambda a, w: a @ w.T)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="", help=f"comma-separated row counts M (default: {ROWS})")
    parser.add_argument("--only", default="", help="comma-separated parts of column names to keep (default: all)")
    args = parser.parse_args()
    keep = [part for part in args.only.split(",") if part]
    import torch

    from common import machine_line

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    layers, head = weights(rng)
    makers = {f"xla {dtype} [{layout}]": lambda dtype=dtype, layout=layout: xla_step(layers, head, dtype, layout)
              for dtype in ("float32", "bfloat16") for layout in ("in,out", "out,in")}
    for dtype in ("float32", "bfloat16"):
        makers[f"jaxserve cpu kernel {dtype}"] = lambda dtype=dtype: xla_step(layers, head, dtype, "out,in", "cpu")
        makers[f"jaxserve default {dtype}"] = lambda dtype=dtype: xla_step(layers, head, dtype, "out,in", None)
    makers.update({f"torch {dtype}": lambda dtype=dtype: torch_step(layers, head, dtype)
                   for dtype in ("float32", "bfloat16")})
    impls = {name: make() for name, make in makers.items() if not keep or any(part in name for part in keep)}
    layouts = all(f"xla float32 [{layout}]" in impls for layout in ("in,out", "out,in"))
    options = "".join(f" --{name} {getattr(args, name)}" for name in ("rows", "only") if getattr(args, name))
    print(f"{machine_line()}, {args.threads} threads. Command: "
          f"`python bench/matmul_layout.py --runs {args.runs}{options}`.\n")
    print("ms per decode step's products (lower is better):\n")
    print("| run | rows (M) | " + " | ".join(impls) + (" | xla f32 [in,out] / [out,in] |" if layouts else " |"))
    print("| --- | --- |" + " --- |" * (len(impls) + layouts))
    for run in range(1, args.runs + 1):
        for m in map(int, args.rows.split(",")) if args.rows else ROWS:
            x = rng.standard_normal((m, HIDDEN), np.float32)
            times = {name: best_time(lambda f=f: f(x), repeat=10) for name, f in impls.items()}
            cells = [f"{1000 * t:.1f}" for t in times.values()]
            if layouts:
                cells.append(f"{times['xla float32 [in,out]'] / times['xla float32 [out,in]']:.2f}")
            print(f"| {run} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
