"""One stream's decode step by the length of its context, through the engine as it serves.

    python bench/one_stream.py [--context 256 640 1536] [--rounds 3] [--model PATH]

For each context, an `LLM` on the model (default: the served default model) with bfloat16
activations and KV cache, as bench/serving.py serves it; then, `--rounds` times, one request with a
prompt of that many random tokens, its prompt steps, 30 decode steps, then the median time of the
next 300 `Engine.step` calls (each launches the next step and finishes the one before, so the host's
work runs beside the device's, as when serving). Prints one line per context: the medians of the
rounds in ms. To compare two revisions, run it from a git worktree of each, alternating.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DECODE_STEPS = 300


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, nargs="+", default=[256, 640, 1536], help="prompt tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=None, help="a model path (default: the served default model)")
    args = p.parse_args()
    from common import machine_line

    from jaxserve import LLM, SamplingParams

    print(f"{machine_line()}, tree {os.getcwd()}. Command: `python bench/one_stream.py --context "
          f"{' '.join(map(str, args.context))} --rounds {args.rounds}`", flush=True)
    rng = np.random.default_rng(0)
    for context in args.context:
        llm = LLM(args.model, dtype="bfloat16", kv_cache_dtype="bfloat16", max_model_len=context + 512,
                  max_num_seqs=64, max_num_batched_tokens=512)
        engine, medians = llm.engine, []
        for r in range(args.rounds):
            params = SamplingParams(max_tokens=DECODE_STEPS + 100, temperature=0, ignore_eos=True)
            engine.add_request(str(r), rng.integers(100, 30000, context).tolist(), params)
            for _ in range(-(-context // 512) + 30):
                engine.step()
            times = []
            for _ in range(DECODE_STEPS):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            while engine.has_unfinished():
                engine.step()
            medians.append(1000 * float(np.median(times)))
        print(f"context {context}: median step ms per round " + ", ".join(f"{m:.2f}" for m in medians), flush=True)
        llm.engine.close()


if __name__ == "__main__":
    main()
