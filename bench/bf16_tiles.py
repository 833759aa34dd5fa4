"""bfloat16 products on AMX tiles against the same products on AVX512-BF16 pairs, and against torch.

    python bench/bf16_tiles.py [--runs 2] [--rows 1,4,8,16,32,128,512]

For each [out, in] shape of the default model (SmolLM2-135M) and each row count M, y = x w^T with x
and w in bfloat16, side by side in one run:
- "tiles": the CPU kernel as the model calls it (`cpu.cc`), which takes the tile form (`amx.h`) from
  kAmxMinRows rows on where the CPU has AMX;
- "pairs": the same kernel built without AMX (`-mno-amx-tile`), its AVX512-BF16 pair forms;
- "torch": `torch.nn.functional.linear` on bfloat16 (oneDNN, which multiplies on AMX tiles too), the
  products vLLM's CPU build runs, on as many threads as XLA's pool.
Each column is one call of `copies` products with distinct weights of the shape (at least 1 GiB of
weights, more than the caches hold, as a model's layers stream from memory), best of 5, the columns
alternating. Reported: ms per product, GFLOP/s, and the ratios pairs / tiles and torch / tiles (above
1: the tiles are faster). On a CPU without AMX the kernel as the model calls it runs its pair forms:
then it is the one column ("tiles" holds it; the pairs columns are left out) against torch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from quant_matmul import make_weights
from roofline import best_time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {"q, o (576 -> 576)": (576, 576), "k, v (576 -> 192)": (192, 576), "up, gate (576 -> 1536)": (1536, 576),
          "down (1536 -> 576)": (576, 1536), "LM head (576 -> 49152)": (49152, 576)}  # [out, in]
ROWS = (1, 4, 8, 16, 32, 128, 512)
STREAMED_BYTES = 2**30
PAIRS_TARGET = "bench_pairs_matmul_t"


def register_pairs() -> None:
    """cpu.cc built once more without AMX, registered as PAIRS_TARGET (its own cache directory)."""
    from jaxserve_kernels.cpu import build
    from jaxserve_kernels.matmul import SOURCE

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    with tempfile.TemporaryDirectory() as tmp:
        wrapper = Path(tmp) / "cxx"
        wrapper.write_text(f'#!/bin/sh\nexec {compiler} "$@" -mno-amx-tile\n')
        wrapper.chmod(0o755)
        saved = {name: os.environ.get(name) for name in ("CXX", "XDG_CACHE_HOME")}
        os.environ.update(CXX=str(wrapper), XDG_CACHE_HOME=tmp)
        build._library.cache_clear()
        try:
            assert build._register(SOURCE, "JaxserveMatmulT", PAIRS_TARGET), "the build without AMX failed"
            assert not build.library(SOURCE).JaxserveMatmulTiles()
        finally:
            build._library.cache_clear()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name)
                else:
                    os.environ[name] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts M")
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp
    import torch

    from common import machine_line
    from jaxserve_kernels.cpu import build
    from jaxserve_kernels.matmul import SOURCE, implementation, matmul_t

    assert implementation() == "cpu", "the CPU kernels could not be built"
    tiles = bool(build.library(SOURCE).JaxserveMatmulTiles())  # (else the kernel runs its pair forms)
    threads = os.cpu_count()  # (XLA's pool has a thread per core)
    torch.set_num_threads(threads)

    def pairs_call(x, w):
        call = jax.ffi.ffi_call(PAIRS_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), x.dtype))
        return call(x, w, np.int32(x.shape[0]))  # (every row: `live_rows`)

    calls = {"tiles": jax.jit(lambda x, ws: [matmul_t(x, w, impl="cpu") for w in ws])}
    if tiles:
        register_pairs()
        calls["pairs"] = jax.jit(lambda x, ws: [pairs_call(x, w) for w in ws])

    def torch_products(x, ws):
        with torch.inference_mode():
            return [torch.nn.functional.linear(x, w) for w in ws]

    print(f"{machine_line()}, {threads} threads for XLA and torch {torch.__version__}. Command: "
          f"`python bench/bf16_tiles.py --runs {args.runs} --rows {args.rows}`."
          + ("" if tiles else " No AMX tiles here: the kernel's pair forms (\"tiles\") against torch.") + "\n")
    heads = ["run", "shape [out, in]", "M", "tiles ms", "pairs ms", "torch ms", "tiles GFLOP/s", "pairs / tiles",
             "torch / tiles"]
    heads = [h for h in heads if tiles or "pairs" not in h]
    print("| " + " | ".join(heads) + " |\n|" + " --- |" * len(heads))
    rng = np.random.default_rng(0)
    for title, shape in SHAPES.items():
        copies = -(-STREAMED_BYTES // (2 * shape[0] * shape[1]))
        ws = make_weights(rng, shape, "bfloat16", copies)
        torch_ws = [torch.from_numpy(np.array(w, np.float32)).to(torch.bfloat16) for w in ws]
        for run in range(1, args.runs + 1):
            for m in map(int, args.rows.split(",")):
                x = jnp.asarray(rng.standard_normal((m, shape[1])), jnp.bfloat16)
                torch_x = torch.from_numpy(np.array(x, np.float32)).to(torch.bfloat16)
                times = {name: best_time(lambda call=call: jax.block_until_ready(call(x, ws))) / copies
                         for name, call in calls.items()}
                times["torch"] = best_time(lambda: torch_products(torch_x, torch_ws)) / copies
                flops = 2 * m * shape[0] * shape[1]
                pairs = [f"{1000 * times['pairs']:.3f}", f"{times['pairs'] / times['tiles']:.2f}"] if tiles else []
                cells = [run, title, m, f"{1000 * times['tiles']:.3f}", *pairs[:1], f"{1000 * times['torch']:.3f}",
                         f"{flops / times['tiles'] / 1e9:.0f}", *pairs[1:], f"{times['torch'] / times['tiles']:.2f}"]
                print("| " + " | ".join(map(str, cells)) + " |", flush=True)


if __name__ == "__main__":
    main()
