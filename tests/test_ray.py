"""Replicas on Ray (`--data-parallel-backend ray`): a local Ray cluster whose custom resource stands
for two hosts, one replica on each; one replica's actor is killed under a load of streams. (Slow:
a Ray cluster and two engines; the placement and the retry logic have default-tier tests in
test_data_parallel.py.)"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
from server import free_port, serving
from test_api_metrics import scrape

pytestmark = pytest.mark.slow


def _stream(url: str, i: int) -> tuple[int, str | None]:
    """(chunks with text before the end, the finish reason, or the error's code) of one streamed completion."""
    chunks, end = 0, None
    body = {"model": "jaxserve-tiny", "prompt": [3 + i % 50, 4, 5, 6], "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return chunks, event["error"]["code"]
            choice = event["choices"][0]
            chunks += bool(choice["text"])
            end = choice["finish_reason"] or end
    return chunks, end


def test_a_killed_replica_ends_only_what_it_streamed_and_ray_brings_it_back():
    ray.init(_node_ip_address="127.0.0.1", resources={"host": 2}, num_cpus=2, include_dashboard=False,
             namespace="jaxserve")
    try:
        port, address = free_port(), ray.get_runtime_context().gcs_address
        with serving(port, "--data-parallel-size", "2", "--data-parallel-backend", "ray", "--ray-address", address,
                     "--ray-bundle", json.dumps({"CPU": 1, "host": 1}), "--max-model-len", "320",
                     "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--num-pages", "64"):
            url = f"http://127.0.0.1:{port}"
            with ThreadPoolExecutor(24) as pool:
                streams = [pool.submit(_stream, url, i) for i in range(24)]
                time.sleep(3)  # (some streams answering, others still waiting for a seat)
                ray.kill(ray.get_actor("jaxserve-replica-0"), no_restart=False)
                results = [s.result(timeout=180) for s in streams]  # none hangs
            lost = [chunks for chunks, end in results if end == "replica_lost"]
            assert all(end in ("length", "replica_lost") for _, end in results), [r for r in results if r[1] != "length"]
            assert all(chunks > 0 for chunks in lost)  # only streams already answering end so
            assert sum(end == "length" for _, end in results) > len(results) // 2
            before = scrape((type("S", (), {"url": url}),))
            deadline = time.time() + 120
            while True:  # Ray restarts the replica; traffic reaches both again
                with ThreadPoolExecutor(8) as pool:
                    assert all(end == "length" for _, end in pool.map(lambda i: _stream(url, i), range(8)))
                after = scrape((type("S", (), {"url": url}),))
                moved = [after[f"vllm:generation_tokens_total|{e}|jaxserve-tiny"] -
                         before[f"vllm:generation_tokens_total|{e}|jaxserve-tiny"] for e in ("0", "1")]
                if all(moved):
                    break
                assert time.time() < deadline, moved
            # a trainer's controls reach both replicas' actors (new weights from a path; not as tensors)
            assert httpx.post(url + "/pause", params={"mode": "keep"}, timeout=60).status_code == 200
            assert httpx.get(url + "/is_paused").json() == {"is_paused": True}
            httpx.post(url + "/resume", timeout=60).raise_for_status()
            answer = httpx.post(url + "/update_weights_from_disk", json={"model_path": "jaxserve-tiny",
                                                                        "weight_version": 5}, timeout=120).json()
            assert answer["weight_version"] == 5 == httpx.get(url + "/get_weight_version").json()["weight_version"]
            assert httpx.post(url + "/update_weights", content=b"").status_code == 400
            assert _stream(url, 0)[1] == "length"
    finally:
        ray.shutdown()
