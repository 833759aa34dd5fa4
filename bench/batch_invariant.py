"""What the batch-invariant mode costs: W1 and W2 served without and with `--batch-invariant`, in one run.

    python bench/batch_invariant.py [--runs 2] [--model smollm2-135m-instruct] [--dtype bfloat16]
    python bench/batch_invariant.py --steps [--runs 2]   # engine steps in process, no server

For each run, starts jaxserve without the mode and with it in turn (alternating, so that a drift of
the machine hits both) on the model (default: the built-in default model, SmolLM2-135M-Instruct,
kept as its GGUF file stores it, Q4_1), with serving.py's command line, and sends W1 and W2
(bench/loadgen.py). Prints each run's figures and the ratios mode / plain (< 1: slower with the
mode; for TTFT and ITL, plain / mode, so < 1 is slower too).

`--steps` times engine steps in process instead (median ms): a 128-token prefill chunk, a decode
step of one sequence and one of 32, without and with the mode in turn.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoints import DEFAULT_MODEL_NAME  # noqa: E402
from common import free_port, machine_line, server  # noqa: E402
from loadgen import run  # noqa: E402
from serving import jaxserve_cmd  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402

MODES = {"plain": [], "batch-invariant": ["--batch-invariant"]}


def figures(result: dict) -> dict[str, float]:
    w1, w2 = result["W1"], result["W2"]
    return {"W1 decode tok/s": w1["decode_tok_s"], "W1 TTFT ms": 1000 * w1["ttft_p50"],
            "W2 tok/s": w2["output_tok_s"], "W2 TTFT p50 ms": 1000 * w2["ttft_p50"],
            "W2 ITL p50 ms": 1000 * w2["itl_p50"]}


def table(rows: dict[tuple[int, str], dict[str, float]], runs: int) -> str:
    """Each run's figures per mode, then the ratios (mode / plain for rates, plain / mode for times)."""
    names = list(next(iter(rows.values())))
    lines = ["| run | mode | " + " | ".join(names) + " |", "| --- | --- |" + " --- |" * len(names)]
    lines += [f"| {r} | {mode} | " + " | ".join(f"{v:.1f}" for v in row.values()) + " |"
              for (r, mode), row in rows.items()]
    lines += ["", "| run | " + " | ".join(f"{n} (ratio)" for n in names) + " |", "| --- |" + " --- |" * len(names)]
    for r in range(1, runs + 1):
        plain, mode = rows[(r, "plain")], rows[(r, "batch-invariant")]
        ratios = [mode[n] / plain[n] if "tok/s" in n else plain[n] / mode[n] for n in names]
        lines.append(f"| {r} | " + " | ".join(f"{x:.2f}" for x in ratios) + " |")
    return "\n".join(lines)


def step_times(model: str, dtype: str, batch_invariant: bool, steps: int = 15) -> dict[str, float]:
    """Median ms of engine steps: prefill chunks of 128 tokens, decode steps of 1 and of 32 sequences."""
    llm = LLM(model, dtype=dtype, kv_cache_dtype="bfloat16", max_model_len=512, max_num_seqs=32,
              max_num_batched_tokens=128, num_pages=1100, batch_invariant=batch_invariant)
    engine, rng = llm.engine, np.random.default_rng(0)

    def timed() -> float:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return 1000 * float(np.median(times))

    out = {}
    for i in range(steps + 2):
        engine.add_request(f"p{i}", rng.integers(100, 30000, 128).tolist(), SamplingParams(max_tokens=1))
    out["prefill 128 ms"] = timed()
    while engine.has_unfinished():
        engine.step()
    for rows in (1, 32):
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        for i in range(rows):
            engine.add_request(f"{rows}-{i}", rng.integers(100, 30000, 16).tolist(), params)
        for _ in range(6):  # (past their prefill)
            engine.step()
        out[f"decode {rows} ms"] = timed()
        for i in range(rows):
            engine.abort(f"{rows}-{i}")
        while engine.has_unfinished():
            engine.step()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="a built-in model's name or a checkpoint")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", action="store_true", help="time engine steps in process, not served workloads")
    args = parser.parse_args()
    print(f"# {machine_line()}; {args.model} {args.dtype}", flush=True)
    rows = {}
    for run_index in range(1, args.runs + 1):
        for mode, flags in MODES.items():
            if args.steps:
                rows[(run_index, mode)] = step_times(args.model, args.dtype, bool(flags))
                print(f"run {run_index} {mode}: {rows[(run_index, mode)]}", flush=True)
                continue
            port = free_port()
            with server(jaxserve_cmd(args.model, args.dtype, port, *flags), port) as (url, startup):
                result = {r["workload"]: r for r in run(url, ["W1", "W2"], offset=1000 * run_index)}
            rows[(run_index, mode)] = figures(result)
            print(f"run {run_index} {mode} (ready in {startup:.0f} s): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in rows[(run_index, mode)].items()), flush=True)
    print()
    print(table(rows, args.runs))


if __name__ == "__main__":
    main()
