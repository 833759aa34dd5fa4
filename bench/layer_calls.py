"""A layer's products of one input in one kernel call against one call each, timed as engine steps.

    python bench/layer_calls.py --model CHECKPOINT --dtype bfloat16
    python bench/layer_calls.py --model default --steps 1,0,1 0,512,512   # the default model's Q4_1 file

On the CPU kernels, q, k and v take one call (`matmul_t_many`), and gate, up and SwiGLU's SiLU another
(`gated_matmul_t`); "apart" is the same engine with one call per float product and SiLU's call of its
own. Both engines run in one process, their steps alternating, so that the machine's slow windows
fall on both alike; per step shape (`--steps` DECODE,PROMPT,TOKENS as in
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


def apart_when(flag: dict) -> None:
    """While flag["apart"], steps traced take one call per float product and SiLU's own (quantized q, k
    and v kept in one call, as before; the executables' disk cache keyed apart too)."""
    one_call, gated_call, settings = matmul._float_kernel, layers.gated_matmul_t, executables._settings
    matmul._float_kernel = lambda x, ws, *a: not flag["apart"] and one_call(x, ws, *a)
    layers.gated_matmul_t = lambda *a, **k: None if flag["apart"] else gated_call(*a, **k)
    executables._settings = lambda: settings() + f"apart={flag['apart']}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    step_arguments(p, STEPS)  # (--model may also be 'default')
    p.add_argument("--repeat", type=int, default=60)
    args = p.parse_args()
    flag = {"apart": False}
    apart_when(flag)
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
