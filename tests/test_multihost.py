"""Multi-host serving with two processes on 127.0.0.1, each with 4 virtual CPU devices
(`jax.distributed` with the CPU collectives): process 0 serves the API over an 8-device mesh and
gives the same greedy text as one process (from an HF checkpoint, then from its Orbax conversion);
stopping process 0 stops both; killing process 1 makes process 0 exit with an error instead of
hanging."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from conftest import SMALL_ENGINE
from server import free_port

ROOT = Path(__file__).resolve().parent.parent
ENGINE_FLAGS = ["--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--seed", "3"]
PROMPTS = [[5, 17, 99, 3, 250, 64, 12], [40, 41], [7] * 20]


def start(model_dir: Path, http_port: int, heartbeat_s: int) -> list[subprocess.Popen]:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    coordinator = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen(
        [sys.executable, "run_server.py", "--model", str(model_dir), "--port", str(http_port), *ENGINE_FLAGS,
         "--tensor-parallel-size", "8", "--served-model-name", "m", "--coordinator-address", coordinator, "--num-processes", "2",
         "--process-id", str(i), "--distributed-timeout", str(heartbeat_s), "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]


def wait_healthy(procs: list[subprocess.Popen], url: str, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in procs:
            assert p.poll() is None, p.stdout.read()[-3000:]
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.5)
    raise AssertionError("process 0 did not become healthy")


def complete(url: str, prompt: list[int], stream: bool = False) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    return outs


def test_two_processes_serve_like_one_and_stop_together(hf_checkpoint, tmp_path):
    from jaxserve import LLM, SamplingParams
    from jaxserve.worker.weights import convert_checkpoint

    _, model_dir = hf_checkpoint("llama")
    llm = LLM(str(model_dir), **SMALL_ENGINE)  # (compiled already by other tests of this checkpoint)
    expected = [o.outputs[0].text for o in llm.generate(
        PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)]
    del llm

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = start(model_dir, port, heartbeat_s=10)
    try:
        wait_healthy(procs, url)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one batch, all three at once
            got = list(pool.map(complete, [url] * len(PROMPTS), PROMPTS))
        assert got == expected
        assert complete(url, PROMPTS[0], stream=True) == expected[0]
        procs[0].send_signal(signal.SIGTERM)
        outs = finish(procs, timeout=60)
        assert [p.returncode for p in procs] == [0, 0], outs
        assert "process 1 of 2 runs process 0's steps" in outs[1] and "jaxserve: stopped" in outs[1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    # Restored from Orbax on both processes; then kill process 1: process 0 must notice (JAX's
    # heartbeat check, 10 s here) and exit non-zero.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = start(convert_checkpoint(model_dir, tmp_path / "orbax"), port, heartbeat_s=10)
    try:
        wait_healthy(procs, url)
        assert complete(url, PROMPTS[1]) == expected[1]
        procs[1].kill()
        started = time.time()
        out = finish(procs[:1], timeout=120)[0]
        assert procs[0].returncode != 0, out
        assert time.time() - started < 120
        assert "heartbeat" in out or "task died" in out, out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
