"""Speculative decoding (n-gram prompt lookup) against none, on the real default model, in one run.

    python bench/speculative.py [--runs 2] [--k 4] [--write]

Starts `run_server.py` on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) three times: without
speculation; with `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 5,
"prompt_lookup_min": 2}` and no batch-size cut-off (`disable_by_batch_size` 64), to see what it does
at every concurrency; and with the same but the default cut-off, to see what a server as shipped
does. Each is sent (greedy, `ignore_eos`, streamed; the tokens are the same with speculation as
without):
- W1: bench/loadgen.py's one stream (a 128-token prompt of random tokens, 128 new tokens);
- W1-edit: one stream per code snippet, a chat asking for the snippet back with a name changed (the
  answer mostly repeats it), 128 new tokens each: an editing workload;
- W2: bench/loadgen.py's 32 concurrent streams;
- concurrency sweeps: c = 2, 4, 8, 16 streams at once of loadgen's prompts and of the edit prompts,
  64 new tokens each (where speculation stops paying: the default cut-off).
Reports decode tokens/s (W1, W1-edit) and output tokens/s (W2, sweeps), each as a ratio to the
server without speculation in the same run, and the acceptance rate (/metrics). `--write` puts the
tables into bench/RESULTS.md between the speculative markers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import ROOT, free_port, machine_line, server  # noqa: E402
from loadgen import one, prompts, workload  # noqa: E402

MARKERS = ("<!-- speculative:start -->", "<!-- speculative:end -->")
SNIPPETS = [
    '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None

    def __len__(self):
        return len(self.items)
''',
    '''def parse_config(path):
    settings = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings
''',
]


def edit_prompt(snippet: str) -> list[dict]:
    """A chat asking for the snippet back with its first name changed (the answer mostly repeats it)."""
    name = re.search(r"(?:def|class) (\w+)", snippet).group(1)
    return [{"role": "user", "content": f"Rename {name} to {name}_v2 in this code and give the whole code back:"
                                        f"\n\n```python\n{snippet}```"}]


def spec_cmd(k: int, cutoff: int | None) -> list[str]:
    config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    if cutoff is not None:
        config["disable_by_batch_size"] = cutoff
    return ["--speculative-config", json.dumps(config)]


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(jaxserve:spec_decode_\w+_total) (\S+)$", text, re.M)}


async def streams(url: str, requests: list, new_tokens: int) -> dict:
    """All at once: output tokens/s; with one request, its decode tokens/s too."""
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=64)) as client:
        start = time.perf_counter()
        traces = await asyncio.gather(*(one(client, url, "bench", p, new_tokens) for p in requests))
        elapsed = time.perf_counter() - start
    out = dict(output_tok_s=sum(t.completion_tokens for t in traces) / elapsed)
    out["decode_tok_s"] = float(np.mean([(t.completion_tokens - 1) / (t.chunks[-1] - t.chunks[0]) for t in traces]))
    return out


def measure(url: str, offset: int) -> dict:
    """Every workload once on a running server -> name -> figures (with the acceptance where it drafted)."""
    asyncio.run(workload(url, "W1", offset=10_000 + offset))  # (warm-up)
    edits = [edit_prompt(s) for s in SNIPPETS]
    plan = {"W1": lambda: asyncio.run(workload(url, "W1", offset=offset)),
            "W1-edit": lambda: {"decode_tok_s": float(np.mean([asyncio.run(streams(url, [p], 128))["decode_tok_s"]
                                                               for p in edits]))},
            "W2": lambda: asyncio.run(workload(url, "W2", offset=offset))}
    for c in (2, 4, 8, 16):
        plan[f"c={c}"] = lambda c=c: asyncio.run(streams(url, prompts(c, offset + 500), 64))
        plan[f"c={c} edit"] = lambda c=c: asyncio.run(streams(url, (edits * c)[:c], 64))
    results = {}
    for name, go in plan.items():
        before = counters(url)
        results[name] = go()
        after = counters(url)
        drafted = after.get("jaxserve:spec_decode_num_draft_tokens_total", 0) - before.get(
            "jaxserve:spec_decode_num_draft_tokens_total", 0)
        if drafted:
            accepted = after["jaxserve:spec_decode_num_accepted_tokens_total"] - before[
                "jaxserve:spec_decode_num_accepted_tokens_total"]
            rows = after["jaxserve:spec_decode_num_drafts_total"] - before["jaxserve:spec_decode_num_drafts_total"]
            results[name]["acceptance"] = accepted / drafted
            results[name]["acceptance_length"] = 1 + accepted / rows
    return results


def table(runs: list[dict[str, dict]], k: int) -> str:
    """Per workload: the figure without speculation and each server's ratio to it (runs' mean), and
    the acceptance rate."""
    names = list(runs[0]["none"])
    lines = [f"| workload | figure | none | ngram k={k}, no cut-off | ratio | acceptance (mean length) | "
             "ngram k={k}, default cut-off | ratio |".replace("{k}", str(k)),
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in names:
        figure = "decode_tok_s" if name.startswith("W1") else "output_tok_s"
        mean = {server: float(np.mean([r[server][name][figure] for r in runs])) for server in runs[0]}
        acceptance = [r["ngram"][name].get("acceptance") for r in runs]
        length = [r["ngram"][name].get("acceptance_length") for r in runs]
        accepted = (f"{100 * np.mean(acceptance):.0f}% ({np.mean(length):.2f})"
                    if all(a is not None for a in acceptance) else "-")
        lines.append(f"| {name} | {figure.replace('_', ' ')} | {mean['none']:.1f} | {mean['ngram']:.1f} | "
                     f"{mean['ngram'] / mean['none']:.2f} | {accepted} | {mean['default']:.1f} | "
                     f"{mean['default'] / mean['none']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    servers = {"none": [], "ngram": spec_cmd(args.k, 64), "default": spec_cmd(args.k, None)}
    runs = []
    for run in range(args.runs):
        runs.append({})
        for name, flags in servers.items():
            port = free_port()
            cmd = [sys.executable, "run_server.py", "--served-model-name", "bench", "--port", str(port),
                   "--max-model-len", "1024", "--max-num-seqs", "32", "--log-level", "warning", *flags]
            with server(cmd, port) as (url, _):
                runs[-1][name] = measure(url, 1000 * run)
            print(name, json.dumps(runs[-1][name]), flush=True)
    text = (f"{machine_line()}; `python bench/speculative.py --runs {args.runs} --k {args.k}`; the default model "
            f"(SmolLM2-135M-Instruct Q4_1), greedy; ratios to the server without speculation, mean of "
            f"{args.runs} runs.\n\n{table(runs, args.k)}\n")
    print(text)
    if args.write:
        path = ROOT / "bench" / "RESULTS.md"
        results = path.read_text()
        start, end = MARKERS
        if start in results:
            head, rest = results.split(start, 1)
            results = head + start + "\n" + text + end + rest.split(end, 1)[1]
        else:
            results += f"\n## Speculative decoding\n\n{start}\n{text}{end}\n"
        path.write_text(results)


if __name__ == "__main__":
    main()
