"""The benchmark's workloads, sent to any OpenAI-compatible server over HTTP (streaming).

    python bench/loadgen.py URL [--workloads W1,W2,W3] [--model NAME]

Every request: /v1/completions with a 128-token prompt given as token ids (so every server sees the
same tokens), 128 new tokens, temperature 0, `ignore_eos`, streamed. Output tokens are counted from
the server's `usage`.
- W1: one stream: 5 requests, each sent when the one before has ended. Time to first token,
  inter-token latency, decode tokens/s (medians over the requests: one request's first token moved
  by up to half its time between requests).
- W2: 32 concurrent streams (distinct prompts), all sent at once. Output tokens/s, p50/p99 TTFT and ITL.
- W3: 64 requests arriving at 4 per second. The same.
- W2-64: W2 with 64 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time

import httpx
import numpy as np

PROMPT_TOKENS = 128
NEW_TOKENS = 128
VOCAB_RANGE = (100, 32000)  # plain pieces of bench-125m's vocabulary (no control or byte tokens)
# name -> requests, arrival rate (None: all at once; 0: each once the one before has ended), first prompt
# index (no two requests share a prompt, so no server's prefix or prompt cache helps)
WORKLOADS = {"W1": dict(requests=5, rate=0, first=0), "W2": dict(requests=32, rate=None, first=100),
             "W3": dict(requests=64, rate=4.0, first=200), "W2-64": dict(requests=64, rate=None, first=300)}


@dataclasses.dataclass
class Trace:
    sent: float
    chunks: list[float]  # arrival time of every chunk that carried text
    completion_tokens: int

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return list(np.diff(self.chunks))


def prompts(count: int, offset: int = 0) -> list[list[int]]:
    """Distinct deterministic prompts: prompt i is the same for every server and every run."""
    return [np.random.default_rng(1000 + offset + i).integers(*VOCAB_RANGE, PROMPT_TOKENS).tolist()
            for i in range(count)]


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int] | str | list[dict],
              new_tokens: int = NEW_TOKENS, extra: dict | None = None) -> Trace:
    """One streamed request: a completion, or with a list of messages as the prompt a chat completion;
    `extra`: more fields of the body."""
    chat = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
    body = {"model": model, "max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, ("messages" if chat else "prompt"): prompt,
            **(extra or {})}
    trace = Trace(sent=time.perf_counter(), chunks=[], completion_tokens=0)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", url + path, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if any(c.get("text") or (c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                trace.chunks.append(time.perf_counter())
            if event.get("usage"):
                trace.completion_tokens = event["usage"]["completion_tokens"]
    if trace.completion_tokens != new_tokens:
        raise RuntimeError(f"{url}: usage says {trace.completion_tokens} completion tokens, asked {new_tokens}")
    return trace


async def workload(url: str, name: str, model: str = "bench", offset: int = 0, extras: list[dict] | None = None
                   ) -> dict:
    """`extras`: more fields of the requests' bodies, request i's extras[i % len(extras)]."""
    spec = WORKLOADS[name]
    requests = prompts(spec["requests"], offset + spec["first"])
    # (one after another, each request on a connection of its own, as a single request's was: llama-server
    # closed a kept-alive connection as its third request went out)
    limits = httpx.Limits(max_connections=128, **({"max_keepalive_connections": 0} if spec["rate"] == 0 else {}))
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def arrive(i: int, prompt: list[int]) -> Trace:
            if spec["rate"]:
                await asyncio.sleep(i / spec["rate"])
            return await one(client, url, model, prompt, extra=extras[i % len(extras)] if extras else None)

        start = time.perf_counter()
        if spec["rate"] == 0:
            traces = [await arrive(i, p) for i, p in enumerate(requests)]
        else:
            traces = await asyncio.gather(*(arrive(i, p) for i, p in enumerate(requests)))
        elapsed = time.perf_counter() - start
    ttft = [t.ttft for t in traces]
    gaps = [g for t in traces for g in t.gaps]
    tokens = sum(t.completion_tokens for t in traces)
    result = dict(workload=name, output_tok_s=tokens / elapsed, ttft_p50=np.percentile(ttft, 50),
                  ttft_p99=np.percentile(ttft, 99), itl_p50=np.percentile(gaps, 50), itl_p99=np.percentile(gaps, 99))
    if name == "W1":
        result["decode_tok_s"] = np.median([(t.completion_tokens - 1) / (t.chunks[-1] - t.chunks[0]) for t in traces])
    return result


async def warm_up(url: str, model: str, offset: int) -> None:
    async with httpx.AsyncClient(timeout=None) as client:
        await one(client, url, model, prompts(1, 10_000 + offset)[0])


def run(url: str, names: list[str], model: str = "bench", offset: int = 0) -> list[dict]:
    """Each workload once, after one warm-up request. Give each run its own `offset` (a multiple of
    1000) so prompts never repeat."""
    asyncio.run(warm_up(url, model, offset))
    return [asyncio.run(workload(url, name, model, offset)) for name in names]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("--workloads", default="W1,W2,W3")
    parser.add_argument("--model", default="bench")
    args = parser.parse_args()
    for r in run(args.url, args.workloads.split(","), args.model):
        print(json.dumps({k: round(float(v), 4) if isinstance(v, float) else v for k, v in r.items()}))
