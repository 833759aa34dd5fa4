"""The host's work per token of one stream (W1's shape) on bench-125m: what it takes from the step.

    python bench/host_cpu.py [--dtype bfloat16] [--runs 6] [--server]

On this 2-core machine a decode step's threads fill both cores, so every millisecond of CPU the
host spends while a step runs (planning the next step, fetching tokens, detokenizing, serving
the stream) is taken from the step. In-process (`LLM`'s engine, no HTTP), each run decodes 128
tokens of one 128-token prompt and prints the engine thread's CPU time and the wall time per
step; then the bare step: the same compiled step called back to back with nothing else to do.
`--server` also starts `run_server.py` and sends it W1 (bench/loadgen.py), and prints the CPU
time per generated token of each of the server's threads (from /proc) and of the client.
Compare commits by running it in a worktree of each, one after the other.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import ROOT, free_port, server  # noqa: E402
from loadgen import NEW_TOKENS, prompts  # noqa: E402
from make_model import DEFAULT_DIR, make  # noqa: E402
from serving import jaxserve_cmd  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402


def in_process(model_dir: Path, dtype: str, runs: int) -> None:
    llm = LLM(str(model_dir), dtype=dtype, kv_cache_dtype="bfloat16", max_model_len=512, max_num_seqs=64,
              max_num_batched_tokens=512)
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    calls = []
    run_step = runner._run
    runner._run = lambda shape, inputs: calls.append((shape, inputs)) or run_step(shape, inputs)
    for r in range(runs + 1):  # (the first run warms up)
        engine.add_request(f"run-{r}", prompts(1, 5000)[0], params)
        steps, cpu, wall = 0, time.thread_time(), time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        if r:
            print(f"engine: {1e3 * (time.thread_time() - cpu) / steps:.2f} ms CPU and "
                  f"{1e3 * (time.perf_counter() - wall) / steps:.2f} ms wall per step", flush=True)
    runner._run = run_step
    shape, inputs = calls[-2]  # a decode step of the last run
    args = runner._args(inputs, shape)
    step = runner._executable(shape, args)
    weights, kv, packed, previous = args
    kv = runner.kv
    for _ in range(3):
        wall = time.perf_counter()
        for _ in range(50):
            kv, launched, _ = step(weights, kv, packed, previous)
            jax.block_until_ready(launched.samples)
        print(f"bare step: {1e3 * (time.perf_counter() - wall) / 50:.2f} ms wall", flush=True)
    runner.kv = kv


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of `pid`, by name and thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{stat[stat.index('(') + 1:stat.rindex(')')]}-{tid}"] = (int(fields[11]) + int(fields[12])) / os.sysconf(
            "SC_CLK_TCK")
    return out


def through_server(model_dir: Path, dtype: str, runs: int) -> None:
    port = free_port()
    with server(jaxserve_cmd(model_dir, dtype, port), port) as (url, _):
        found = subprocess.run(["pgrep", "-f", "--", f"run_server.py.*--port {port}"], capture_output=True, text=True)
        pid = int(found.stdout.split()[0])
        for _ in range(runs):
            before, children = thread_cpu(pid), resource.getrusage(resource.RUSAGE_CHILDREN)
            wall = time.perf_counter()
            result = subprocess.run([sys.executable, "loadgen.py", url, "--workloads", "W1"], cwd=ROOT / "bench",
                                    capture_output=True, text=True, check=True)
            wall = time.perf_counter() - wall
            after, client = thread_cpu(pid), resource.getrusage(resource.RUSAGE_CHILDREN)
            tokens = 2 * NEW_TOKENS  # loadgen's warm-up request and W1's
            per_thread = collections.Counter({k: v - before.get(k, 0) for k, v in after.items()})
            decode = json.loads(result.stdout.strip().splitlines()[-1])["decode_tok_s"]
            client_cpu = client.ru_utime + client.ru_stime - children.ru_utime - children.ru_stime
            print(f"W1 decode {decode:.1f} tok/s; CPU ms per token: " + ", ".join(
                f"{name} {1e3 * s / tokens:.2f}" for name, s in per_thread.most_common() if s > 0)
                + f", client process {1e3 * client_cpu / tokens:.2f} (wall {wall:.1f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--server", action="store_true", help="also W1 through run_server.py, CPU per server thread")
    args = ap.parse_args()
    model_dir = make(DEFAULT_DIR)
    if args.dtype == "bfloat16":
        model_dir = model_dir.with_name(model_dir.name + "-bf16")
    in_process(model_dir, args.dtype, args.runs)
    if args.server:
        through_server(model_dir, args.dtype, args.runs)


if __name__ == "__main__":
    main()
