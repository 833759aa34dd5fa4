"""New weights for a running engine (docs/rl.md): how long an update takes, in process and over HTTP,
against restarting on the same weights; and rollout throughput when the weights change every N requests.

    python bench/weight_update.py                          # the default model (SmolLM2-135M, GGUF Q8_0)
    python bench/weight_update.py --model jaxserve-tiny

In process: `LLM.update_weights` with the model's float parameters as device arrays (cast and
quantized on the device where the engine keeps them quantized). Over HTTP: POST /update_weights of
`run_server.py` with the same parameters as a safetensors body (serialized once, before timing; sent
in chunks of 4 MiB).
Restart: a new `LLM` on the same checkpoint, its steps loaded from the warm executable cache (the
least a restart costs). Rollouts: 64 requests of 64 tokens (temperature 1), in batches of N with an
update after each batch, against the same batches with no update. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from safetensors.numpy import save

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxserve import LLM, SamplingParams  # noqa: E402

CHUNK = 1 << 22  # bytes sent at a time (chunked transfer: httpx sends one large bytes object slowly)
ENGINE = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256)


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rollouts(llm: LLM, params: dict, batch: int, update: bool) -> float:
    """Generated tokens per second over 64 requests in batches of `batch`, with an update after each
    batch or not (the same batches: their size alone changes the throughput)."""
    sampling = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=0)
    prompts = [{"prompt_token_ids": [1 + i % 50, 2, 3, 4, 5, 6, 7, 8]} for i in range(64)]
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        tokens += sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts[i:i + batch], sampling, use_tqdm=False))
        if update:
            llm.update_weights(params)
    return tokens / (time.perf_counter() - start)


def over_http(model: str, body: bytes, port: int = 8311) -> float:
    proc = subprocess.Popen([sys.executable, "run_server.py", "--model", model, "--port", str(port),
                             *[f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        pieces = lambda: (body[i:i + CHUNK] for i in range(0, len(body), CHUNK))  # noqa: E731
        post = lambda: httpx.post(url + "/update_weights", content=pieces(), timeout=600).raise_for_status()  # noqa: E731
        post()  # (its casts compile on the first)
        return timed(post, 3)
    finally:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in default model")
    args = parser.parse_args()
    model = args.model or "smollm2-135m-instruct"
    llm = LLM(model, **ENGINE)
    params = llm.get_weights()
    llm.update_weights(params)  # (its casts and quantizations compile on the first)
    in_process = timed(lambda: llm.update_weights(params), 5)
    restart = timed(lambda: LLM(model, **ENGINE), 1)
    throughput = {n: (rollouts(llm, params, n, False), rollouts(llm, params, n, True)) for n in (32, 16, 8)}
    body = memoryview(save({path: np.asarray(x) for path, x in params.items()}))
    llm = params = None  # (its memory, before the server starts)
    http = over_http(model, body)
    print(json.dumps({
        "model": model, "parameters_MB": round(len(body) / 2**20, 1),
        "update_in_process_s": round(in_process, 3), "update_over_http_s": round(http, 3),
        "restart_s": round(restart, 2), "in_process_vs_restart": round(in_process / restart, 4),
        "http_vs_restart": round(http / restart, 4),
        "rollout_tokens_per_s": {f"batches_of_{n}": {"no_updates": round(a, 1), "an_update_after_each": round(b, 1)}
                                 for n, (a, b) in throughput.items()},
        "rollout_ratio": {f"an_update_every_{n}_requests": round(b / a, 3) for n, (a, b) in throughput.items()}},
        indent=1))


if __name__ == "__main__":
    main()
