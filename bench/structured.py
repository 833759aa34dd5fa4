"""Throughput of 16 concurrent json_schema requests vs 16 unconstrained ones, side by side in one run.

    python bench/structured.py [--runs 2] [--model DIR]

Starts `run_server.py` (the built-in jaxserve-tiny unless --model), sends each batch of 16
concurrent chat requests, and reports output tokens/s (from `usage`) and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx

from common import free_port, machine_line, server

SCHEMA = {"type": "array", "minItems": 5, "maxItems": 5, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "name": {"enum": ["alpha", "beta", "gamma", "delta"]}, "ok": {"type": "boolean"}}}}
MAX_TOKENS = 256


async def batch(url: str, constrained: bool, n: int = 16) -> tuple[float, int, list[str]]:
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(i: int):
            body = {"messages": [{"role": "user", "content": f"list {i}"}], "temperature": 1.0, "seed": i,
                    "max_tokens": MAX_TOKENS}
            if constrained:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "rows", "schema": SCHEMA}}
            else:
                body["ignore_eos"] = True
            r = (await client.post(url + "/v1/chat/completions", json=body)).json()
            return r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.perf_counter() - start
    return sum(t for t, _ in results) / elapsed, sum(t for t, _ in results), [f for _, f in results]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--model", default="jaxserve-tiny")
    args = ap.parse_args()
    port = free_port()
    cmd = [sys.executable, "run_server.py", "--port", str(port), "--max-model-len", "512", "--max-num-seqs", "16",
           "--max-num-batched-tokens", "256", "--log-level", "warning", "--model", args.model]
    with server(cmd, port) as (url, _):
        asyncio.run(batch(url, True, 2))  # warm the grammar compiler and caches
        print(f"# {machine_line()}")
        print("| run | unconstrained tok/s | json_schema tok/s | ratio (constrained / unconstrained) |")
        print("| --- | --- | --- | --- |")
        for run in range(1, args.runs + 1):
            free, _, _ = asyncio.run(batch(url, False))
            constrained, tokens, finishes = asyncio.run(batch(url, True))
            assert all(f == "stop" for f in finishes), finishes
            print(f"| {run} | {free:.1f} | {constrained:.1f} ({tokens} tokens) | {constrained / free:.2f} |", flush=True)


if __name__ == "__main__":
    main()
