"""A layer's work in fewer kernel calls against more, timed as engine steps.

    python bench/layer_calls.py --model CHECKPOINT --dtype bfloat16
    python bench/layer_calls.py --model default --steps 1,0,1 0,512,512   # the default model's Q4_1 file
    python bench/layer_calls.py --apart norms --model default            # the norms and adds as XLA's

On the CPU kernels, q, k and v take one call (`matmul_t_many`), and gate, up and SwiGLU's SiLU another
(`gated_matmul_t`), each norming its input itself, and the o and down products add the residual in
their calls (`matmul_t`'s `residual`). "apart" is the same engine with, `--apart products`, one call per
float product and SiLU's call of its own (their norms and adds then XLA's too); `--apart norms`, the
norms and the residual adds as XLA's fusions between the calls, the products' calls as they are. Both engines run in one process, their steps alternating, so that the
machine's slow windows fall on both alike; per step shape (`--steps` DECODE,PROMPT,TOKENS as in
bench/mixed_steps.py) the median and the quartiles of each, and the median ratio apart / one call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mixed_steps import batch_and_shape, step_arguments  # noqa: E402

import jaxserve.models.layers as layers  # noqa: E402
import jaxserve.worker.executables as executables  # noqa: E402
import jaxserve_kernels.matmul as matmul  # noqa: E402
from checkpoints import DEFAULT_MODEL_NAME  # noqa: E402
from jaxserve.config.engine import EngineConfig  # noqa: E402
from jaxserve.engine.build import build_engine  # noqa: E402

STEPS = ("0,128,128", "0,512,512", "32,0,32", "31,128,256", "1,0,1")


def apart_when(flag: dict, what: str) -> None:
    """While flag["apart"], steps traced take, `what` "products", one call per float product and SiLU's
    own (quantized q, k and v kept in one call); "norms", the norms and residual adds outside the
    kernels' calls (XLA's norm, then the same calls). The executables' disk cache is keyed apart too."""
    settings = executables._settings
    executables._settings = lambda: settings() + f"apart={flag['apart'] and what}"
    if what == "norms":
        takes_norm, plus_residual = matmul._takes_norm, matmul._plus_residual
        matmul._takes_norm = lambda x, norm: norm is None or (not flag["apart"] and takes_norm(x, norm))
        matmul._plus_residual = lambda x, w, r, dtype, impl: (r + matmul.matmul_t(x, w, dtype, impl=impl)
                                                              if flag["apart"] else plus_residual(x, w, r, dtype, impl))
        return
    one_call, gated_call = matmul._float_kernel, layers.gated_matmul_t
    matmul._float_kernel = lambda x, ws, *a: not flag["apart"] and one_call(x, ws, *a)
    layers.gated_matmul_t = lambda *a, **k: None if flag["apart"] else gated_call(*a, **k)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    step_arguments(p, STEPS)  # (--model may also be 'default')
    p.add_argument("--repeat", type=int, default=60)
    p.add_argument("--apart", choices=("products", "norms"), default="products", help="what 'apart' leaves apart")
    args = p.parse_args()
    flag = {"apart": False}
    apart_when(flag, args.apart)
    engines = {}
    for name in ("one call", "apart"):
        flag["apart"] = name == "apart"
        model = DEFAULT_MODEL_NAME if args.model == "default" else args.model
        config = EngineConfig(model=model, dtype=args.dtype, kv_cache_dtype="bfloat16", max_model_len=512,
                              max_num_seqs=64, max_num_batched_tokens=512)
        engine = engines[name] = build_engine(config, warmup=False)[0]
        for spec in args.steps:  # (traced now, while the flag holds)
            engine.runner.compile(batch_and_shape(engine, spec, args.context)[1])
    for spec in args.steps:
        times = {name: [] for name in engines}
        prepared = {name: batch_and_shape(engine, spec, args.context) for name, engine in engines.items()}
        for _ in range(args.repeat + 1):
            for name, engine in engines.items():
                batch, shape = prepared[name]
                start = time.perf_counter()
                jax.block_until_ready(engine.runner._run(shape, engine.runner.prepare(batch, shape)).samples)
                times[name].append(1000 * (time.perf_counter() - start))
        quartiles = {name: [round(float(q), 1) for q in np.percentile(t[1:], [25, 50, 75])]
                     for name, t in times.items()}
        print(json.dumps({"step": spec, "shape": prepared["apart"][1], "ms p25/p50/p75": quartiles,
                          "apart / one call": round(quartiles["apart"][1] / quartiles["one call"][1], 3)}), flush=True)


if __name__ == "__main__":
    main()
