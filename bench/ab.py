"""jaxserve against an earlier revision of itself, in one run: did a change move the serving speed?

    python bench/ab.py [--base REV] [--runs 3] [--dtype bfloat16] [--model default|PATH] [--workloads W1,W2,W3]

Checks REV (default: the commit before HEAD's branch point, `HEAD~1`) out into a temporary git
worktree, then for each run starts the base server and the current one in turn (alternating, so a
drift of the machine hits both) on bench-125m (or, with `--model default`, the served default model:
SmolLM2-135M-Instruct from its Q4_1 GGUF file; or a checkpoint's path) and sends each W1 and W2, and
W3 where `--workloads` names it (bench/loadgen.py). Prints
each run's figures and the ratios current / base (> 1 is faster now). Both servers run the same
command line (serving.py's, with `--warmup all`), from their own trees, on this tree's virtual
environment.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from common import ROOT, free_port, machine_line, server
from loadgen import run
from make_model import make
from serving import DEFAULT_MODEL_NAME, jaxserve_cmd

# (name, workload, result key, scale, whether more is faster)
FIGURES = [("W1 decode tok/s", "W1", "decode_tok_s", 1, True), ("W1 TTFT ms", "W1", "ttft_p50", 1000, False),
           ("W2 tok/s", "W2", "output_tok_s", 1, True), ("W2 ITL p50 ms", "W2", "itl_p50", 1000, False),
           ("W3 tok/s", "W3", "output_tok_s", 1, True), ("W3 TTFT p50 ms", "W3", "ttft_p50", 1000, False),
           ("W3 TTFT p99 ms", "W3", "ttft_p99", 1000, False), ("W3 ITL p50 ms", "W3", "itl_p50", 1000, False),
           ("W3 ITL p99 ms", "W3", "itl_p99", 1000, False)]


def figures(result: dict) -> dict[str, float]:
    return {name: scale * result[w][key] for name, w, key, scale, _ in FIGURES if w in result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD~1", help="the revision to compare with")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default="bench-125m", help="bench-125m, default, or a checkpoint's path")
    parser.add_argument("--workloads", default="W1,W2", help="comma-separated, of W1, W2, W3")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if args.model == "default":
        model = DEFAULT_MODEL_NAME
    elif args.model != "bench-125m":
        model = Path(args.model).resolve()  # (the base server runs in its own tree)
    else:
        f32 = make()
        model = f32 if args.dtype == "float32" else f32.with_name(f32.name + "-bf16")
    base_rev = subprocess.check_output(["git", "rev-parse", "--short", args.base], cwd=ROOT, text=True).strip()
    print(f"# {machine_line()}; base {base_rev}, current {ROOT.name} (working tree); {args.model}, {args.dtype}",
          flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), base_rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for run_index in range(1, args.runs + 1):
                for name, tree in (("base", base_tree), ("current", ROOT)):
                    port = free_port()
                    # (every bucket compiled before the first request: the first start of a tree
                    # compiles them, and a background compile must not be what is measured)
                    cmd = jaxserve_cmd(model, args.dtype, port, "--warmup", "all")
                    with server(cmd, port, cwd=tree) as (url, startup):
                        result = {r["workload"]: r for r in run(url, workloads, offset=1000 * run_index)}
                    rows.append((run_index, name, figures(result)))
                    print(f"run {run_index} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in rows[-1][2].items()),
                          flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
    shown = [f for f in FIGURES if f[1] in workloads]
    print("\n| run | " + " | ".join(f"{name} " + ("current / base" if up else "base / current")
                                     for name, _, _, _, up in shown) + " |")
    print("| --- |" + " --- |" * len(shown))
    for run_index in range(1, args.runs + 1):
        (_, _, base), (_, _, cur) = [r for r in rows if r[0] == run_index]
        ratios = [cur[name] / base[name] if up else base[name] / cur[name] for name, _, _, _, up in shown]
        print(f"| {run_index} | " + " | ".join(f"{r:.3f}" for r in ratios) + " |")


if __name__ == "__main__":
    main()
