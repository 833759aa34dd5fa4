"""What a step bucket costs and what it gains: seconds to compile one (no executable cache), and the
time of a decode step in the page-table width it needs against the widest.

    python bench/bucket_costs.py                    # jaxserve-tiny
    python bench/bucket_costs.py --model DIR --runs 2

Prints one JSON object per measurement. The compile times are of one bucket at a time on one
thread (the engine compiles the first bucket so, and the others up to 4 at once). The decode steps
are planned by hand: `--rows` sequences of `--context` tokens each, one new token per row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.build import build_engine
from jaxserve.sample.params import RequestSampling, SamplingParams
from jaxserve.sched.plan import ScheduledBatch, ScheduledSeq
from jaxserve.worker.executables import ExecutableCache


def decode_batch(engine, rows: int, context: int) -> ScheduledBatch:
    params = SamplingParams(max_tokens=8)
    sampling = RequestSampling.of(params, lambda text: [], engine.model_config.vocab_size)
    pages = -(-(context + 1) // engine.config.page_size)
    return ScheduledBatch(rows=[ScheduledSeq(
        seq_id=b, token_ids=[5], start_position=context, pending_row=-1,
        page_ids=list(range(1 + b * pages, 1 + (b + 1) * pages)), sample=True, params=params, sampling=sampling,
        seed=b, all_token_ids=[7] * (context + 1), num_prompt_tokens=context) for b in range(rows)],
        num_tokens=rows, preempted=[])


def step_ms(runner, batch: ScheduledBatch, shape: tuple[int, int, int], steps: int) -> float:
    """The median time of a step of `batch` padded to `shape` (host work and device), after one."""
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        jax.block_until_ready(runner._run(shape, runner.prepare(batch, shape)).samples)
        times.append(time.perf_counter() - start)
    return round(1000 * float(np.median(times[1:])), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint directory (default: jaxserve-tiny)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    # every page-table width, whatever the attention: the point is to compare them
    engine, _ = build_engine(EngineConfig(model=args.model, page_table_widths="4x"), warmup=False)
    runner, cfg = engine.runner, engine.config
    runner.executable_cache = ExecutableCache(None)
    print(json.dumps({"step_buckets": len(cfg.step_buckets), "token_buckets": cfg.token_buckets,
                      "page_buckets": cfg.page_buckets}), flush=True)
    widest = cfg.page_buckets[-1]
    for run in range(1, args.runs + 1):
        for shape in ((1, 1, cfg.page_buckets[0]), (1, 1, widest), (16, 16, widest), cfg.step_buckets[-1]):
            runner.executables.pop(shape, None)
            jax.clear_caches()  # (else a second run finds the executable in jax's own cache)
            start = time.perf_counter()
            runner.compile(shape)
            print(json.dumps({"run": run, "compile": shape, "s": round(time.perf_counter() - start, 2)}), flush=True)
        for rows in args.rows:
            for context in args.context:
                batch = decode_batch(engine, rows, context)
                tokens = next(t for t in cfg.token_buckets if t >= rows)
                width = next(w for w in cfg.page_buckets if w >= len(batch.rows[0].page_ids))
                needed = (tokens, next(s for s in cfg.seqs_buckets(tokens) if s >= rows), width)
                for shape in (needed, (*needed[:2], widest)):
                    runner.compile(shape)
                    print(json.dumps({"run": run, "rows": rows, "context": context, "shape": shape,
                                      "step_ms": step_ms(runner, batch, shape, args.steps)}), flush=True)


if __name__ == "__main__":
    main()
