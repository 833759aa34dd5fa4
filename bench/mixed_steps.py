"""What a step of running sequences and one new prompt costs in a token bucket larger than its
tokens: the bucket's padding against its computed tokens.

    python bench/mixed_steps.py --model CHECKPOINT --dtype bfloat16 [--runs 2]
    python bench/mixed_steps.py --model CHECKPOINT --dtype bfloat16 --steps 31,128,256 0,100,128

Each `--steps` entry is DECODE,PROMPT,TOKENS: DECODE sequences of `--context` tokens decoding one
token each and one prompt of PROMPT tokens, padded to the TOKENS bucket (and the sequence bucket
the engine would take). Prints one JSON object per step: its median time (host work and device, as
`bucket_costs.py` times it). The default steps are W3's (bench/loadgen.py): a 128-token prompt
meeting about 31 running sequences, whole in the 256 or 192 bucket, or cut into the 128 and 64
buckets (`jaxserve.sched.limits.bucket_cut`), and lone prompts in a bucket they do not fill.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bucket_costs import decode_batch, step_ms  # noqa: E402

from jaxserve.config.engine import EngineConfig  # noqa: E402
from jaxserve.engine.build import build_engine  # noqa: E402
from jaxserve.sched.plan import ScheduledBatch, ScheduledSeq  # noqa: E402

STEPS = ("31,0,32", "31,128,256", "31,128,192", "31,97,128", "31,33,64", "0,128,128", "0,100,128")


def mixed_batch(engine, decode: int, prompt: int, context: int) -> ScheduledBatch:
    """`decode_batch`'s rows, then one prompt of `prompt` tokens on the pages after theirs."""
    rows = decode_batch(engine, decode, context).rows if decode else []
    if prompt:
        first = 1 + sum(len(row.page_ids) for row in rows)
        pages = list(range(first, first - (-prompt // engine.config.page_size)))
        like = decode_batch(engine, 1, 1).rows[0]  # (its sampling settings)
        rows.append(ScheduledSeq(seq_id=decode, token_ids=[9] * prompt, start_position=0, pending_row=-1,
                                 page_ids=pages, sample=True, params=like.params, sampling=like.sampling, seed=decode,
                                 all_token_ids=[9] * prompt, num_prompt_tokens=prompt))
    return ScheduledBatch(rows=rows, num_tokens=decode + prompt, preempted=[])


def step_arguments(p: argparse.ArgumentParser, steps=STEPS) -> None:
    """The arguments of timing steps of mixed batches: the checkpoint, its dtype, the steps, the context."""
    p.add_argument("--model", required=True, help="a checkpoint directory")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--steps", nargs="+", default=steps, help="DECODE,PROMPT,TOKENS each")
    p.add_argument("--context", type=int, default=200)


def batch_and_shape(engine, spec: str, context: int) -> tuple[ScheduledBatch, tuple[int, int, int]]:
    """The batch of `spec` (DECODE,PROMPT,TOKENS: `mixed_batch`'s rows) and the step shape it runs in."""
    decode, prompt, tokens = (int(v) for v in spec.split(","))
    batch = mixed_batch(engine, decode, prompt, context)
    cfg = engine.config
    seqs = next(s for s in cfg.seqs_buckets(tokens) if s >= len(batch.rows))
    return batch, (tokens, seqs, next(w for w in cfg.page_buckets if w >= max(len(r.page_ids) for r in batch.rows)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    step_arguments(p)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    engine, _ = build_engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_dtype="bfloat16",
                                          max_model_len=512, max_num_seqs=64, max_num_batched_tokens=512),
                             warmup=False)
    runner = engine.runner
    for run in range(1, args.runs + 1):
        for spec in args.steps:
            batch, shape = batch_and_shape(engine, spec, args.context)
            decode, prompt, _ = (int(v) for v in spec.split(","))
            runner.compile(shape)
            print(json.dumps({"run": run, "decode": decode, "prompt": prompt, "shape": shape,
                              "step_ms": step_ms(runner, batch, shape, args.repeat)}), flush=True)


if __name__ == "__main__":
    main()
