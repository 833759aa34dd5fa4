"""Where an engine step's time goes: jaxserve's step on bench-125m under JAX's profiler, per operation.

    python bench/step_profile.py --dtype float32 --rows 32      # a decode step of 32 sequences
    python bench/step_profile.py --dtype float32 --prefill 512  # a 512-token prefill chunk
    python bench/step_profile.py --model default --rows 1       # the default model, one stream
    python bench/step_profile.py --prefill 512 --prompt-tokens 2048  # chunks of long prompts

Each sequence has a 128-token prompt (`--prompt-tokens`: longer ones are prefilled in chunks, each
attending to the chunks before it). For decode, the prompts are prefilled first; then the
profiler records `--steps` steps and the table lists, per operation (the CPU kernels by their
custom-call target, XLA's fusions by kind), its time per step. A fusion's time is summed over the
threads that ran it: one that runs on both threads for 1 ms counts 2 ms. A custom call counts its
wall time on the thread that called it: the helper threads its work items run on are not in the
profile (in a 54 ms decode step the products count 44 ms, not twice that). The wall time per
step, unprofiled, comes first, with the page faults per step (memory the step maps anew each time
costs one per 4 KB), the engine thread's CPU time per step, and the part of that spent launching
the compiled step (the call returns before the step is computed: host work per launch, on a core
the step's threads would otherwise have); then the compiled step alone, launched with its inputs
ready and waited for, nothing else running: its launch, and its computation (a pipelined step's
wall time beyond that is host work the cores did not hide). "calls" counts the operations the step
ran (XLA's fusions and thunks and the custom calls, each once per step): what a step pays per call,
times this.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from make_model import DEFAULT_DIR, make  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402

PROMPT_TOKENS = 128


def custom_call_targets(llm: LLM, shapes: set) -> dict[str, str]:
    """Each custom call's instruction name in the steps compiled for `shapes` -> its target (the
    kernel's name). Only the profiled steps' own: another bucket's step may give the same name to
    another kernel."""
    targets = {}
    for executable in (llm.engine.runner.executables[shape] for shape in shapes):
        for m in re.finditer(r"%?((?:ffi_call|custom-call)[.\d]*) = .*?custom_call_target=\"([^\"]+)\"",
                             executable.as_text()):
            targets[m.group(1).lstrip("%")] = m.group(2)
    return targets


def per_op(trace_dir: str, targets: dict[str, str], steps: int) -> tuple[collections.Counter, collections.Counter]:
    """Microseconds per step and calls per step, per operation, from the trace JAX's profiler wrote."""
    path = next(Path(trace_dir).rglob("*.trace.json.gz"))
    times, calls = collections.Counter(), collections.Counter()
    for event in json.load(gzip.open(path))["traceEvents"]:
        name = event.get("name", "")
        if event.get("ph") != "X" or "dur" not in event or name.startswith("$") or "::" in name or "(" in name:
            continue  # (Python frames and runtime internals)
        op = targets.get(name, re.sub(r"[._]\d+$", "", name))
        times[op] += event["dur"] / steps
        calls[op] += 1 / steps
    return times, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model path or name, 'default' for the served default "
                    "(default: bench-125m)")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--rows", type=int, default=32, help="decode: sequences per step")
    group.add_argument("--prefill", type=int, help="prefill: prompt tokens per step (a multiple of 128)")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="each sequence's prompt")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()

    if args.model is None:
        model = make(DEFAULT_DIR)
        if args.dtype == "bfloat16":
            model = model.with_name(model.name + "-bf16")
    model = None if args.model == "default" else str(args.model or model)
    tokens = args.prefill or 512
    prompt_tokens = args.prompt_tokens
    llm = LLM(model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              max_model_len=max(512, prompt_tokens + 64 + 2 * args.steps),
              max_num_seqs=max(64, args.rows), max_num_batched_tokens=tokens)
    engine = llm.engine
    rng = np.random.default_rng(0)
    # prefill: enough prompts that every profiled step is a full chunk; decode: `rows` sequences
    prompts = -(-(args.steps * 3 + 4) * tokens // prompt_tokens) if args.prefill else args.rows
    params = SamplingParams(max_tokens=1 if args.prefill else 64 + 2 * args.steps, temperature=0, ignore_eos=True)
    for i in range(prompts):
        engine.add_request(str(i), rng.integers(100, 30000, prompt_tokens).tolist(), params)
    if not args.prefill:
        for _ in range(-(-args.rows * prompt_tokens // tokens) + 2):
            engine.step()
    walls, cpus, launches, alone_launches, alone_computes = [], [], [], [], []
    executable = engine.runner._executable

    def through(timing):  # the engine's compiled calls, each made as timing(call, *args)
        return lambda shape, args: functools.partial(timing, executable(shape, args))

    def launch_cpu(call, *a):  # the launch, in the engine thread's CPU
        start = time.thread_time()
        out = call(*a)
        launches.append(time.thread_time() - start)
        return out

    def alone(call, *a):  # the inputs ready, then the launch and the computation, nothing else running
        jax.block_until_ready(a)
        start = time.perf_counter()
        out = call(*a)
        launched = time.perf_counter()
        jax.block_until_ready(out)
        alone_launches.append(launched - start)
        alone_computes.append(time.perf_counter() - launched)
        return out

    engine.runner._executable = through(launch_cpu)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(args.steps):
        start, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        walls.append(time.perf_counter() - start)
        cpus.append(time.thread_time() - cpu)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
    engine.runner._executable = through(alone)
    for _ in range(args.steps):
        engine.step()
    engine.runner._executable = executable
    shapes, executable = set(), engine.runner._executable  # (the buckets the profiled steps run)
    engine.runner._executable = lambda shape, *rest: shapes.add(shape) or executable(shape, *rest)
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(args.steps):
            engine.step()
        jax.profiler.stop_trace()
        times, calls = per_op(trace_dir, custom_call_targets(llm, shapes), args.steps)

    kind = f"prefill of {tokens} tokens" if args.prefill else f"decode of {args.rows} sequences"
    kind += f", prompts of {prompt_tokens} tokens"
    cache = "" if args.kv_cache_dtype == "auto" else f" ({args.kv_cache_dtype} KV cache)"
    print(f"# {args.model or 'bench-125m'} {args.dtype}{cache}, {kind}: "
          f"{np.median(walls) * 1e3:.1f} ms per step (median, unprofiled), "
          f"{faults:.0f} page faults per step (fresh memory the step touched); the engine thread's CPU "
          f"{np.median(cpus) * 1e3:.2f} ms per step, {np.median(launches) * 1e3:.2f} ms of it in the compiled "
          f"call's launch; the compiled step alone (its inputs ready, nothing else running): a "
          f"{np.median(alone_launches) * 1e3:.2f} ms launch, then {np.median(alone_computes) * 1e3:.2f} "
          "ms until its outputs are ready\n")
    print("| operation | ms per step (fusions: summed over threads; custom calls: wall time) | calls per step |\n"
          "| --- | --- | --- |")
    for name, us in times.most_common(args.top):
        print(f"| {name} | {us / 1e3:.2f} | {calls[name]:.0f} |")
    print(f"| (all) | {sum(times.values()) / 1e3:.2f} | {sum(calls.values()):.0f} |")


if __name__ == "__main__":
    main()
