"""First tokens of jaxserve and vLLM's CPU build, request by request in turn, both servers up at once.

    python bench/paired_ttft.py [--pairs 100] [--gap 2] [--new-tokens 16] [--solo 0]

This VM runs a prompt step at one of two speeds, in windows of seconds (bench/RESULTS.md, "a prompt
step's two speeds"); servers measured one after the other meet different windows. Here both serve the
same bfloat16 checkpoint (`peers.bf16_checkpoint` of the default model's GGUF file) at serving.py's
settings, both fully compiled, and W1's request (a 128-token prompt of its own, streamed, on a fresh
connection) goes to one, then the other, the order swapped every pair, `--gap` seconds apart: the two
first tokens of a pair meet the same window as a rule. vLLM's processes go on using the CPUs for a
while after each of its requests, so the CPU time each server's processes use during the other's
requests is printed too (at a gap of 2 s: 0-10 ms). Prints each server's first tokens and the pairs'
ratios, split by the speed jaxserve's step met; `--solo N` first times N requests to jaxserve alone,
before vLLM starts and once it is up and idle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoints import DEFAULT_MODEL_NAME, builtin  # noqa: E402
from common import free_port, machine_line, server  # noqa: E402
from loadgen import one, prompts  # noqa: E402
from peers import CACHE, bf16_checkpoint, vllm_env  # noqa: E402
from serving import THREADS, jaxserve_cmd, vllm_cmd  # noqa: E402

SLOW_MS = 100.0  # jaxserve's first tokens above this met the slow speed (82-96 ms fast, 112-133 ms slow)


async def first_token(url: str, prompt: list[int], new_tokens: int) -> float:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        return 1000 * (await one(client, url, "bench", prompt, new_tokens)).ttft


def serving_processes(port: int) -> psutil.Process:
    """The server listening on `port` (the process whose command line names it)."""
    return next(p for p in psutil.process_iter(["cmdline"]) if str(port) in (p.info["cmdline"] or [])
                and "--port" in p.info["cmdline"])


def cpu_seconds(root: psutil.Process) -> float:
    """CPU time of `root` and its children so far."""
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def pairs(urls: dict[str, str], count: int, new_tokens: int, offset: int, gap: float = 0.0,
          others: dict[str, psutil.Process] | None = None) -> dict[str, np.ndarray]:
    """`gap` seconds between requests; `others`: by server, the other server's process, whose CPU time
    during each request is kept too (under "NAME cpu", in ms)."""
    names = list(urls)
    out = {name: [] for name in names} | {f"{name} cpu": [] for name in (others or {})}
    for i, prompt in enumerate(prompts(count, offset)):
        for name in (names if i % 2 == 0 else names[::-1]):
            time.sleep(gap)
            before = cpu_seconds(others[name]) if others else 0.0
            # (each server its own prompt of the pair's seed: no prefix cache could help either)
            out[name].append(asyncio.run(first_token(urls[name], [t + names.index(name) for t in prompt],
                                                     new_tokens)))
            if others:
                out[f"{name} cpu"].append(1000 * (cpu_seconds(others[name]) - before))
    return {name: np.array(v) for name, v in out.items()}


def report(ttft: dict[str, np.ndarray]) -> str:
    ours, peer = ttft["jaxserve"], ttft["vllm"]
    ratio = peer / ours  # > 1: jaxserve's first token came sooner
    rows = ["| pairs | jaxserve median / p90 ms | vLLM median / p90 ms | vLLM / jaxserve, median | jaxserve sooner |",
            "| --- | --- | --- | --- | --- |"]
    for label, mask in (("all", np.ones_like(ours, bool)), (f"jaxserve <= {SLOW_MS:.0f} ms", ours <= SLOW_MS),
                        (f"jaxserve > {SLOW_MS:.0f} ms", ours > SLOW_MS)):
        if not mask.any():
            continue
        rows.append(f"| {label}: {mask.sum()} | {np.median(ours[mask]):.0f} / {np.percentile(ours[mask], 90):.0f} | "
                    f"{np.median(peer[mask]):.0f} / {np.percentile(peer[mask], 90):.0f} | "
                    f"{np.median(ratio[mask]):.2f} | {(ratio[mask] > 1).mean():.0%} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--solo", type=int, default=0,
                        help="first, this many requests to jaxserve alone, before vLLM starts and once it is up")
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between two requests")
    args = parser.parse_args()
    checkpoint = bf16_checkpoint(builtin.fetch(DEFAULT_MODEL_NAME))
    print(f"# {machine_line()}", flush=True)
    ours, theirs = free_port(), free_port()
    solo = {}
    with server(jaxserve_cmd(checkpoint, "bfloat16", ours), ours, log=CACHE / "paired-jaxserve.log") as (a, _):
        pairs({"jaxserve": a}, 5, args.new_tokens, 70_000)  # (warm-up)
        if args.solo:
            solo["vLLM not started"] = pairs({"jaxserve": a}, args.solo, args.new_tokens, 80_000)["jaxserve"]
        with server(vllm_cmd(checkpoint, theirs), theirs, log=CACHE / "paired-vllm.log",
                    env=vllm_env(THREADS)) as (b, _):
            urls = {"jaxserve": a, "vllm": b}
            pairs(urls, 5, args.new_tokens, 60_000)  # (warm-up: each server's first requests after start)
            if args.solo:
                solo["vLLM up, idle"] = pairs({"jaxserve": a}, args.solo, args.new_tokens, 90_000)["jaxserve"]
            others = {"jaxserve": serving_processes(theirs), "vllm": serving_processes(ours)}
            ttft = pairs(urls, args.pairs, args.new_tokens, 50_000, args.gap, others)
    for label, ms in solo.items():
        print(f"jaxserve alone, {label}: median {np.median(ms):.0f} ms, {(ms > SLOW_MS).mean():.0%} above "
              f"{SLOW_MS:.0f}")
    print(report(ttft))
    for name in ("jaxserve", "vllm"):
        other = ttft[f"{name} cpu"]
        print(f"the other server's CPU during {name}'s requests: median {np.median(other):.0f} ms, "
              f"p90 {np.percentile(other, 90):.0f} ms")
    np.savez(CACHE / "paired_ttft.npz", **ttft)


if __name__ == "__main__":
    main()
