"""The residual stream's cost: a server with steering slots and hidden-state gathering (the defaults)
against one without (`--max-steering-slots 0 --max-hidden-states-layers 0`), in the same run.

    python bench/residual.py [--runs 2] [--write]
    python bench/residual.py --steps [--rows 1,32] [--prefill 512]

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF), both servers fully compiled (`--warmup all`),
alternating. On each: W1 (one stream: decode tok/s) and W2 (32 streams: output tok/s) of plain requests;
on the first also W2 with every request steered (8 distinct random vectors after layer 16, so every
slot is in use) and W2 with every request asking for the last layer's hidden state at each output
token. Reports each figure and its ratio to the server without them. `--write` puts the table into
bench/RESULTS.md between the residual markers.

`--steps` times the decode step itself, in one process: three `LLM`s of the default model (without,
with, and without again: the measurement's own noise), each decoding `--rows` plain sequences, their
steps taken in turn so that the machine's drift falls on all; the median ms per step of each and the
ratios. `--prefill N` times prefills instead: N // 128 prompts of 128 tokens in one step, until done.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import free_port, machine_line, server, write_between  # noqa: E402
from loadgen import warm_up, workload  # noqa: E402

MARKERS = ("<!-- residual:start -->", "<!-- residual:end -->")
HIDDEN = 576  # the default model's


def engines(**settings) -> dict:
    """`LLM`s of the default model: without the residual stream's slots, with them (the defaults), and
    without again (a second engine of the same settings: the measurement's own noise)."""
    from jaxserve import LLM

    off = dict(max_steering_slots=0, max_hidden_states_layers=0)
    return {"without": LLM(**off, **settings), "with": LLM(**settings), "again": LLM(**off, **settings)}


def steps(rows: int, count: int = 60) -> str:
    """The `--steps` line for decode steps of `rows` sequences on each of `engines`."""
    from jaxserve import SamplingParams

    llms = engines(max_model_len=256, max_num_seqs=max(rows, 1), max_num_batched_tokens=128)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=count + 40, temperature=0, ignore_eos=True)
    for llm in llms.values():
        for i in range(rows):
            llm.engine.add_request(str(i), rng.integers(100, 30000, 64).tolist(), params)
        for _ in range(8):  # (the prompts, then a few decode steps)
            llm.engine.step()
    times = {label: [] for label in llms}
    for _ in range(count):
        for label, llm in llms.items():
            start = time.perf_counter()
            llm.engine.step()
            times[label].append(time.perf_counter() - start)
    return line(rows, times)


def prefills(tokens: int, count: int = 16) -> str:
    """The `--steps --prefill` line: a prefill of `tokens` (prompts of 128) on each of `engines` in turn."""
    from jaxserve import SamplingParams

    llms = engines(max_model_len=256, max_num_seqs=tokens // 128, max_num_batched_tokens=tokens)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = {label: [] for label in llms}
    for turn in range(count):
        for label, llm in llms.items():
            for i in range(tokens // 128):
                llm.engine.add_request(f"{turn}-{i}", rng.integers(100, 30000, 128).tolist(), params)
            start = time.perf_counter()
            while llm.engine.has_unfinished():
                llm.engine.step()
            times[label].append(time.perf_counter() - start)
    return line(f"prefill {tokens}", times)


def line(what, times: dict[str, list[float]]) -> str:
    """A table row: each engine's median ms, and the ratios to the one without."""
    ms = {label: np.median(t) * 1e3 for label, t in times.items()}
    return (f"| {what} | {ms['without']:.2f} | {ms['with']:.2f} | {ms['again']:.2f} | "
            f"{ms['with'] / ms['without']:.3f} | {ms['again'] / ms['without']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--steps", action="store_true")
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--prefill", type=int, help="with --steps: time prefills of this many tokens instead")
    args = parser.parse_args()
    if args.steps:
        command = f"--prefill {args.prefill}" if args.prefill else f"--rows {args.rows}"
        print(f"{machine_line()}; `python bench/residual.py --steps {command}`: median ms per step\n\n"
              "| rows | without | with | without, again | with / without | again / without |\n"
              "| --- | --- | --- | --- | --- | --- |")
        if args.prefill:
            print(prefills(args.prefill), flush=True)
        else:
            for rows in map(int, args.rows.split(",")):
                print(steps(rows), flush=True)
        return
    rng = np.random.default_rng(0)
    steered = [{"steering": [{"layer": 16, "vector": rng.normal(0, 0.5, HIDDEN).tolist()}]} for _ in range(8)]
    hidden = [{"return_hidden_states": {"layers": [-1], "positions": "output"}}]
    base = [sys.executable, "run_server.py", "--served-model-name", "bench", "--max-model-len", "512",
            "--max-num-seqs", "64", "--max-num-batched-tokens", "512", "--warmup", "all", "--log-level", "warning"]
    servers = (("without", ["--max-steering-slots", "0", "--max-hidden-states-layers", "0"]), ("with", []))
    results: dict[str, list[float]] = {}
    for run in range(args.runs):
        for label, flags in servers:
            port = free_port()
            with server([*base, *flags, "--port", str(port)], port) as (url, _):
                asyncio.run(warm_up(url, "bench", 1000 * run))
                plans = [("W1", None), ("W2", None)]
                if label == "with":
                    plans += [("W2 steered", steered), ("W2 hidden states", hidden)]
                for name, extras in plans:
                    out = asyncio.run(workload(url, name.split()[0], offset=1000 * run, extras=extras))
                    key = "decode_tok_s" if name == "W1" else "output_tok_s"
                    results.setdefault(f"{label}: {name}", []).append(out[key])
    table = render(results, args.runs)
    print(table)
    if args.write:
        write_between(MARKERS, table)


def render(results: dict[str, list[float]], runs: int) -> str:
    lines = [f"{machine_line()}; `python bench/residual.py --runs {runs}`; the default model (SmolLM2-135M-Instruct "
             "Q4_1); W1: decode tok/s of one stream, W2: output tok/s of 32 streams; per run, then the ratio to "
             "the server without steering slots or hidden-state gathering in the same run.", "",
             "| server: requests | run | tok/s | ratio |", "| --- | --- | --- | --- |"]
    for key, values in results.items():
        reference = results["without: " + ("W1" if key.endswith("W1") else "W2")]
        for run, value in enumerate(values):
            lines.append(f"| {key} | {run + 1} | {value:.1f} | {value / reference[run]:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
