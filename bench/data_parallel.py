"""Data-parallel replicas against one replica of the same devices: W2 at 64 streams.

    python bench/data_parallel.py [--devices 8] [--runs 2] [--model bench-125m|jaxserve-tiny]

On `--devices` virtual CPU devices (XLA_FLAGS), serves bench-125m (bfloat16, serving.py's command
line, every bucket compiled first) as two replicas of half the devices each (`--data-parallel-size
2 --tensor-parallel-size devices/2`) and as one replica over all of them (`--tensor-parallel-size
devices`), alternating, and sends each W2-64 (bench/loadgen.py: 64 concurrent streams of 128
tokens after 128-token prompts). Prints each run's figures and the ratio two replicas / one.
"""

from __future__ import annotations

import argparse
import os

from common import free_port, machine_line, server
from loadgen import run
from make_model import make
from serving import jaxserve_cmd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--model", default=None, help="a model for run_server.py (default: bench-125m in bfloat16)")
    args = parser.parse_args()
    if args.model is None:
        f32 = make()
        model = f32.with_name(f32.name + "-bf16")
    else:
        model = args.model
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
    layouts = {"one replica": ["--tensor-parallel-size", str(args.devices)],
               "two replicas": ["--data-parallel-size", "2", "--tensor-parallel-size", str(args.devices // 2)]}
    print(f"# {machine_line()}; {args.devices} virtual devices; {model}", flush=True)
    rows = {}
    for run_index in range(1, args.runs + 1):
        for name, flags in layouts.items():
            port = free_port()
            with server(jaxserve_cmd(model, "bfloat16", port, "--warmup", "all", *flags), port, env=env) as (url, _):
                (result,) = run(url, ["W2-64"], offset=1000 * run_index)
            rows[run_index, name] = result
            print(f"run {run_index} {name}: W2-64 {result['output_tok_s']:.1f} tok/s, TTFT p50 "
                  f"{1000 * result['ttft_p50']:.0f} ms, ITL p50 {1000 * result['itl_p50']:.1f} ms", flush=True)
    print("\n| run | one replica tok/s | two replicas tok/s | two / one | TTFT p50 one / two | ITL p50 one / two |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for run_index in range(1, args.runs + 1):
        one, two = rows[run_index, "one replica"], rows[run_index, "two replicas"]
        print(f"| {run_index} | {one['output_tok_s']:.1f} | {two['output_tok_s']:.1f} | "
              f"{two['output_tok_s'] / one['output_tok_s']:.3f} | {one['ttft_p50'] / two['ttft_p50']:.3f} | "
              f"{one['itl_p50'] / two['itl_p50']:.3f} |")


if __name__ == "__main__":
    main()
