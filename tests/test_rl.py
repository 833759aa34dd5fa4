"""The rollout engine of a trainer (docs/rl.md): new weights in process and over HTTP, weight versions,
pause and resume, sleep and wake, tokens in and out, and the GRPO example."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save, save_file
from server import ROOT, free_port, serving

from checkpoints import default_model_dir
from jaxserve import LLM, SamplingParams

sys.path.insert(0, str(ROOT / "examples"))
import grpo  # noqa: E402

SMALL = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, page_size=16)
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(60, 90))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)


def perturbed(seed: int) -> dict[str, np.ndarray]:
    """jaxserve-tiny's tensors (by Hugging Face name, float32), each moved a little."""
    rng = np.random.default_rng(seed)
    return {name: x + 0.05 * rng.standard_normal(x.shape).astype(np.float32)
            for name, x in load_file(default_model_dir() / "model.safetensors").items()}


def checkpoint_of(tensors: dict[str, np.ndarray], directory) -> str:
    """A copy of jaxserve-tiny's directory with these tensors."""
    shutil.copytree(default_model_dir(), directory)
    save_file(tensors, directory / "model.safetensors")
    return str(directory)


def outputs(llm: LLM) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    """Greedy tokens and their top logprobs, exactly."""
    return [(list(c.token_ids), [sorted((t, lp.logprob) for t, lp in entry.items()) for entry in c.logprobs])
            for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
            for c in out.outputs]


@pytest.fixture(scope="module", params=["bfloat16", "int8"])
def engine_kind(request):
    return dict(dtype="bfloat16", quantization=None) if request.param == "bfloat16" else dict(dtype="float32",
                                                                                              quantization="int8")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(new tensors by HF name, a checkpoint of them)."""
    tensors = perturbed(1)
    return tensors, checkpoint_of(tensors, tmp_path_factory.mktemp("new") / "model")


def test_update_weights_equals_a_fresh_engine(engine_kind, trained):
    """A trainer's arrays (by HF name, mapped with params_from_hf; cast and quantized on the device) give
    the tokens and logprobs of an engine started on those weights, bit for bit; so does the same
    checkpoint loaded by path."""
    tensors, directory = trained
    llm = LLM("jaxserve-tiny", **SMALL, **engine_kind)
    before = outputs(llm)
    version = llm.update_weights(llm.params_from_hf({name: jnp.asarray(x) for name, x in tensors.items()}))
    assert version == llm.weight_version == 1
    got = outputs(llm)
    fresh = LLM(directory, **SMALL, **engine_kind)
    assert got == outputs(fresh) and got != before
    assert llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0].weight_version == 1
    assert llm.update_weights_from_path(str(default_model_dir()), weight_version=7) == 7
    assert outputs(llm) == before
    assert llm.update_weights_from_path(directory) == 8 and outputs(llm) == got


def test_twenty_updates_compile_nothing_and_free_the_old_weights():
    """Arrays in the engine's dtype and sharding are taken as they are: 20 updates compile nothing and
    leave the live device memory where it was; float32 arrays compile their casts once, on the first."""
    llm = LLM("jaxserve-tiny", **SMALL, dtype="bfloat16")
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiled.append(event) if event.endswith("backend_compile_duration") else None)
    shardings = {path: x.sharding for path, x in llm.get_weights().items()}

    def bf16_params(seed):
        return {path: jax.device_put(jnp.asarray(x, jnp.bfloat16), shardings[path])
                for path, x in llm.params_from_hf(perturbed(seed)).items()}

    llm.update_weights(bf16_params(0))
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    live = sum(x.nbytes for x in jax.live_arrays())
    compiled.clear()
    for seed in range(20):
        llm.update_weights(bf16_params(seed))
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    assert compiled == [] and llm.weight_version == 21
    assert sum(x.nbytes for x in jax.live_arrays()) == live
    llm.update_weights(llm.params_from_hf(perturbed(0)))  # (float32: cast on the device, compiled now)
    compiled.clear()
    for seed in range(3):
        llm.update_weights(llm.params_from_hf(perturbed(seed)))
    assert compiled == []


def test_sleep_and_wake_compile_nothing():
    """Level 1 keeps the weights on the host; level 2 frees them, and waking reloads the checkpoint
    (version 0) unless new weights came meanwhile. Outputs are as before either way."""
    llm = LLM("jaxserve-tiny", **SMALL, dtype="bfloat16")
    before = outputs(llm)
    llm.update_weights(llm.params_from_hf(perturbed(2)))
    updated = outputs(llm)
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiled.append(event) if event.endswith("backend_compile_duration") else None)
    llm.sleep(1)
    assert llm.is_sleeping()
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    llm.wake_up()
    assert outputs(llm) == updated and llm.weight_version == 1
    llm.sleep(2)
    llm.wake_up(["weights"])
    assert llm.is_sleeping()  # (the KV cache is not back yet)
    llm.wake_up(["kv_cache"])
    assert outputs(llm) == before and llm.weight_version == 0
    llm.sleep(2)  # (vLLM's order: the weights woken, replaced, then the KV cache)
    llm.wake_up(["weights"])
    llm.update_weights(llm.params_from_hf(perturbed(2)), weight_version=5)
    llm.wake_up(["kv_cache"])
    assert outputs(llm) == updated and llm.weight_version == 5
    assert compiled == []
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(["everything"])


def _run_to_end(engine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    return done


def test_sleep_levels_modes_and_prefix_resets_as_vllm_032s():
    """vLLM 0.32's sleep(level, mode): level 0 pauses alone, "keep" holds the requests (they finish as
    greedy decoding from where they stopped gives), "abort" ends them, "wait" takes none here;
    release_kv_cache_memory after a level 0 pause; reset_prefix_cache(reset_running_requests)."""
    llm = LLM("jaxserve-tiny", **SMALL, dtype="float32")
    engine, prompt = llm.llm_engine, PROMPTS[2]
    for level, then in ((0, None), (0, "kv"), (1, None), (2, None), ("reset", None)):
        engine.add_request("r", {"prompt_token_ids": prompt}, GREEDY)
        before = []
        while len(before) < 3:  # (outputs are cumulative)
            before = next((list(o.outputs[0].token_ids) for o in engine.step()), before)
        if level == "reset":
            assert llm.reset_prefix_cache() is False  # (a request runs)
            assert llm.reset_prefix_cache(reset_running_requests=True) is True
        else:
            llm.sleep(level, mode="keep")
            assert llm.is_sleeping()
            for refused in (engine.step, lambda: outputs(llm)):
                with pytest.raises(RuntimeError, match="asleep"):
                    refused()
            if then == "kv":
                llm.release_kv_cache_memory()
                assert llm.wake_up(["scheduling"]) is False  # (the KV cache is still freed)
                assert llm.wake_up(["kv_cache"]) is True
            else:
                assert llm.wake_up(["scheduling"] if level == 0 else None) is True
        assert not llm.is_sleeping()
        assert _run_to_end(engine)["r"] == before + greedy(llm, prompt + before, 12 - len(before)), (level, then)
    with pytest.raises(RuntimeError, match="sleep\\(level=0\\)"):
        llm.release_kv_cache_memory()
    engine.add_request("a", {"prompt_token_ids": prompt}, GREEDY)
    engine.step()
    with pytest.raises(ValueError, match="wait"):
        llm.sleep(1, mode="wait")
    llm.sleep(1)  # (mode "abort", the default: the request ends, no output follows)
    assert not engine.has_unfinished_requests()
    llm.sleep(0, mode="wait")  # (nothing unfinished: nothing to wait for)
    assert llm.wake_up() is True
    for level, mode in ((3, "abort"), (1, "later")):
        with pytest.raises(ValueError, match="level"):
            llm.sleep(level, mode)


def greedy(llm: LLM, prompt: list[int], count: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=count, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_update_weights_refuses_what_does_not_fit():
    llm = LLM("jaxserve-tiny", **SMALL, dtype="bfloat16")
    params = llm.get_weights()
    with pytest.raises(ValueError, match="missing"):
        llm.update_weights({k: v for k, v in params.items() if k != "norm.weight"})
    with pytest.raises(ValueError, match="shape"):
        llm.update_weights({**params, "norm.weight": jnp.zeros(3)})
    with pytest.raises(ValueError, match="unexpected tensor"):
        llm.params_from_hf({"model.bogus.weight": jnp.zeros(3)})
    assert llm.weight_version == 0


def test_grpo_example_in_process():
    """The example's mechanics, 3 steps: rollouts, rewards, a gradient step, new weights each step."""
    sampler = grpo.InProcess("jaxserve-tiny", grpo.ENGINE)
    history = grpo.train(sampler, default_model_dir(), steps=3, log=lambda line: None)
    assert len(history) == 3 and all(0 <= r <= 1 for r in history) and sampler.llm.weight_version == 3


def test_trainer_forward_matches_the_engine():
    """The example's pure-JAX forward pass gives the engine's prompt logprobs (float32)."""
    llm = LLM("jaxserve-tiny", **grpo.ENGINE)
    cfg = json.loads((default_model_dir() / "config.json").read_text())
    params = {name: jnp.asarray(x) for name, x in load_file(default_model_dir() / "model.safetensors").items()}
    prompt = PROMPTS[2]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    want = [entry[t].logprob for t, entry in zip(prompt[1:], out.prompt_logprobs[1:])]
    logp = jax.nn.log_softmax(grpo.logits(params, jnp.asarray(prompt), cfg))
    got = [float(logp[i, t]) for i, t in enumerate(prompt[1:])]
    np.testing.assert_allclose(got, want, atol=2e-4)


# --- over HTTP: one run_server.py for the module

@pytest.fixture(scope="module")
def server():
    port = free_port()
    with serving(port, "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "32",
                 "--max-num-batched-tokens", "64", "--page-size", "16", "--max-request-body-bytes", "1048576"):
        yield f"http://127.0.0.1:{port}"


def generate(url: str, token_ids: list[int], **sampling) -> dict:
    body = {"token_ids": token_ids, "sampling_params": {"temperature": 0, "max_tokens": 8, **sampling}}
    return httpx.post(url + "/inference/v1/generate", json=body, timeout=120).raise_for_status().json()


def test_tokens_in_tokens_out(server):
    answer = generate(server, PROMPTS[0], logprobs=2, n=2, temperature=1.0, seed=3)
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for choice in answer["choices"]:
        assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == 8
        first = choice["logprobs"]["content"][0]
        assert first["token"] == f"token_id:{choice['token_ids'][0]}" and len(first["top_logprobs"]) == 2
        assert choice["finish_reason"] == "length"
    assert "weight_version" in answer and answer["kv_transfer_params"] is None
    named = httpx.post(server + "/inference/v1/generate", json={"token_ids": [1, 2], "request_id": "mine"}).json()
    assert named["request_id"] == "mine"
    events = httpx.post(server + "/inference/v1/generate", json={
        "token_ids": PROMPTS[0], "stream": True, "sampling_params": {"temperature": 0, "max_tokens": 8}},
        timeout=60).text.strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    streamed = [t for e in events[:-1] for c in json.loads(e[len("data: "):])["choices"] for t in c["token_ids"]]
    assert streamed == generate(server, PROMPTS[0])["choices"][0]["token_ids"]
    for body in ({"token_ids": []}, {"token_ids": [1], "sampling_params": {"stop": ["x"]}},
                 {"token_ids": [1], "bogus": 1}, {"token_ids": [1], "sampling_params": {"detokenize": True}},
                 {"token_ids": [1], "request_id": 3}):
        assert httpx.post(server + "/inference/v1/generate", json=body).status_code == 400


def test_grpo_example_over_http(server):
    history = grpo.train(grpo.OverHTTP(server), default_model_dir(), steps=3, log=lambda line: None)
    assert len(history) == 3
    assert httpx.get(server + "/get_weight_version").json() == {"weight_version": 3}


STREAMED = 400  # tokens of each stream: long enough for a pause to find it under way


def _stream(url: str, prompt: list[int], out: list) -> None:
    """A streamed token-in/token-out request: [(token ids, weight version)] per chunk, into `out`."""
    body = {"token_ids": prompt, "stream": True, "sampling_params": {"temperature": 0, "max_tokens": STREAMED,
                                                                    "ignore_eos": True}}
    with httpx.stream("POST", url + "/inference/v1/generate", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                out.append((chunk["choices"][0]["token_ids"], chunk["weight_version"]))


def test_pause_keep_update_resume(server):
    """Pause ("keep") during 16 streams, send new weights, resume: every stream completes; its tokens
    after the resume carry the new version and are what the new weights give greedily from there."""
    version = httpx.get(server + "/get_weight_version").json()["weight_version"]
    prompts = [[97 + i, 98 + i, 99 + i, 100 + i] for i in range(16)]
    streams = [[] for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(server, p, out)) for p, out in zip(prompts, streams)]
    for t in threads:
        t.start()
    while not any(streams):  # (under way)
        threading.Event().wait(0.05)
    assert httpx.post(server + "/pause", params={"mode": "keep"}, timeout=60).json() == {"status": "paused"}
    assert httpx.get(server + "/is_paused").json() == {"is_paused": True}
    tensors = perturbed(5)
    answer = httpx.post(server + "/update_weights", content=save(tensors), timeout=300).raise_for_status().json()
    assert answer["weight_version"] == version + 1
    httpx.post(server + "/resume", timeout=60).raise_for_status()
    for t in threads:
        t.join(300)
    split = [([t for ids, v in chunks if v == version for t in ids],
              [t for ids, v in chunks if v == version + 1 for t in ids]) for chunks in streams]
    assert all(len(before) + len(after) == STREAMED and after for before, after in split)
    with ThreadPoolExecutor(16) as pool:  # (the new weights' own greedy continuations, side by side)
        again = pool.map(lambda p, ba: generate(server, p + ba[0], max_tokens=len(ba[1]), ignore_eos=True),
                         prompts, split)
    assert [a["choices"][0]["token_ids"] for a in again] == [after for _, after in split]


def test_sleep_wake_and_checkpoint_updates(server, trained, tmp_path):
    _, directory = trained
    answer = httpx.post(server + "/update_weights_from_disk", json={"model_path": directory, "weight_version": 100},
                        timeout=300).json()
    assert answer["success"] and answer["weight_version"] == 100
    want = generate(server, PROMPTS[0])
    assert want["weight_version"] == 100
    assert httpx.post(server + "/sleep", params={"level": 1}).status_code == 200
    assert httpx.get(server + "/is_sleeping").json() == {"is_sleeping": True}
    assert httpx.post(server + "/resume").status_code == 400  # (asleep: wake_up first)
    httpx.post(server + "/wake_up", timeout=60).raise_for_status()
    assert httpx.get(server + "/is_sleeping").json() == {"is_sleeping": False}
    assert generate(server, PROMPTS[0])["choices"] == want["choices"]
    assert httpx.post(server + "/update_weights_from_disk", json={"model_path": str(tmp_path / "none")}
                      ).status_code == 400
    assert httpx.post(server + "/finish_weight_update").status_code == 400
    for broken in (b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]", save(perturbed(0))[:-10], b"\x01"):
        assert httpx.post(server + "/update_weights", content=broken).status_code == 400
    httpx.post(server + "/start_weight_update", json={"weight_version": 200}).raise_for_status()
    half = dict(list(perturbed(0).items())[:5])
    httpx.post(server + "/update_weights", content=save(half)).raise_for_status()
    assert httpx.post(server + "/finish_weight_update").status_code == 400  # (incomplete: dropped)
    assert httpx.get(server + "/get_weight_version").json() == {"weight_version": 100}
    assert httpx.post(server + "/reset_prefix_cache").json() == {"success": True}


def test_sleep_levels_modes_and_prefix_resets_over_http(server):
    """vLLM 0.32's routes: /sleep?level=0 holds a request until /wake_up, with the KV cache freed
    meanwhile by /release_kv_cache_memory; /sleep's mode "abort" (the default) ends a stream;
    /reset_prefix_cache?reset_running_requests=true under a stream that then completes."""
    want = generate(server, PROMPTS[1])["choices"]
    assert httpx.post(server + "/release_kv_cache_memory").status_code == 400  # (not paused)
    assert httpx.post(server + "/sleep", params={"level": 0}).json() == {"status": "sleeping", "level": 0}
    assert httpx.get(server + "/is_sleeping").json() == {"is_sleeping": True}
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(generate, server, PROMPTS[1])
        assert httpx.post(server + "/release_kv_cache_memory").json() == {"status": "kv_cache_released"}
        assert httpx.post(server + "/wake_up", params={"tags": "scheduling"}).json() == {
            "status": "sleeping", "tags": ["scheduling"]}  # (the KV cache is still freed)
        assert not held.done()
        assert httpx.post(server + "/wake_up", params={"tags": "kv_cache"}, timeout=60).json()["status"] == "awake"
        assert held.result(120)["choices"] == want
    for params in ({"level": 3}, {"mode": "later"}):
        assert httpx.post(server + "/sleep", params=params).status_code == 400
    assert httpx.get(server + "/is_sleeping").json() == {"is_sleeping": False}
    for route, params, ends in (("/sleep", {"level": 1}, "abort"),
                                ("/reset_prefix_cache", {"reset_running_requests": "true"}, "length")):
        chunks = []
        stream = threading.Thread(target=_stream, args=(server, PROMPTS[2], chunks))
        stream.start()
        while not chunks:  # (under way)
            threading.Event().wait(0.05)
        answer = httpx.post(server + route, params=params, timeout=60).json()
        assert answer in ({"status": "sleeping", "level": 1}, {"success": True})
        stream.join(300)
        assert (sum(len(ids) for ids, _ in chunks) == STREAMED) == (ends == "length"), route
        httpx.post(server + "/wake_up", timeout=60).raise_for_status()


def test_abort_requests_by_id_and_all_as_vllm_032s(server):
    """/abort_requests (and /inference/v1/abort_requests) end requests in flight by the request_id a
    client gave /inference/v1/generate or by a completion's id (vLLM's: cmpl- and the client's
    X-Request-Id or request_id, which requests may share), or all of them (held ones too): each
    answers, finish reason "abort"; the others go on."""
    assert httpx.get(server + "/weight_info").json() == httpx.get(server + "/get_weight_version").json()
    long = {"temperature": 0, "max_tokens": STREAMED, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        def ask(body: dict, route: str = "/inference/v1/generate") -> dict:
            return httpx.post(server + route, json=body, timeout=300).json()

        mine = pool.submit(ask, {"token_ids": PROMPTS[0], "request_id": "mine", "sampling_params": long})
        other = pool.submit(ask, {"token_ids": PROMPTS[1], "sampling_params": {**long, "max_tokens": 24}})
        chunks = []
        model = httpx.get(server + "/v1/models").json()["data"][0]["id"]
        with httpx.stream("POST", server + "/v1/completions", timeout=300, json={
                "model": model, "prompt": PROMPTS[2], "stream": True, **long}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[len("data: "):]))
                    if len(chunks) == 2:
                        assert httpx.post(server + "/abort_requests", json={"request_ids": ["mine"]}).json() == {
                            "status": "aborted", "aborted": 1}
                        assert httpx.post(server + "/inference/v1/abort_requests",
                                          json={"request_ids": [chunks[0]["id"]]}).status_code == 200
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert len(chunks) < STREAMED
        assert mine.result(300)["choices"][0]["finish_reason"] == "abort"
        assert len(mine.result()["choices"][0]["token_ids"]) < STREAMED
        assert other.result(300)["choices"][0]["finish_reason"] == "length"
        httpx.post(server + "/pause", timeout=60).raise_for_status()
        held = pool.submit(ask, {"token_ids": PROMPTS[0], "sampling_params": long})
        threading.Event().wait(1.0)  # (the request reaches the paused engine, which holds it)
        assert httpx.post(server + "/abort_requests", json={}).json()["status"] == "aborted"
        answer = held.result(300)["choices"][0]
        assert answer["finish_reason"] == "abort" and answer["token_ids"] == []
        # vLLM's ids: cmpl- and the client's X-Request-Id (or the body's request_id), shared or not
        short = {"model": model, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        named = [pool.submit(lambda body, h: httpx.post(server + "/v1/completions", json=body, headers=h,
                                                        timeout=300).json(), body, headers)
                 for body, headers in ((short, {"X-Request-Id": "r-1"}), ({**short, "request_id": "r-1"}, {}),
                                       ({**short, "request_id": "r-2"}, {}))]
        threading.Event().wait(1.0)
        assert httpx.post(server + "/abort_requests", json={"request_ids": ["cmpl-r-1"]}).json()["aborted"] == 1
        httpx.post(server + "/resume", timeout=60).raise_for_status()
        answers = [f.result(300) for f in named]
        assert [a["id"] for a in answers] == ["cmpl-r-1", "cmpl-r-1", "cmpl-r-2"]
        assert [a["choices"][0]["finish_reason"] for a in answers] == ["abort", "abort", "length"]
    assert httpx.post(server + "/abort_requests", json={"request_ids": "mine"}).status_code == 400


def test_min_weight_version_waits_for_new_weights(server):
    """A request for newer weights than the server's waits for them; pause ("wait") lets those in
    flight finish, ("abort") ends them."""
    version = httpx.get(server + "/get_weight_version").json()["weight_version"]
    result = {}

    def ask():
        body = {"token_ids": PROMPTS[0], "min_weight_version": version + 1, "sampling_params": {"max_tokens": 4}}
        result["answer"] = httpx.post(server + "/inference/v1/generate", json=body, timeout=300).json()

    waiting = threading.Thread(target=ask)
    waiting.start()
    waiting.join(2)
    assert waiting.is_alive()  # (held)
    completions = httpx.post(server + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60).json()
    assert completions["weight_version"] == version
    httpx.post(server + "/update_weights", content=save(perturbed(7)), timeout=300).raise_for_status()
    waiting.join(120)
    assert result["answer"]["weight_version"] == version + 1
    assert httpx.post(server + "/pause", params={"mode": "wait"}, timeout=60).status_code == 200
    httpx.post(server + "/resume").raise_for_status()
    chunks = []
    running = threading.Thread(target=_stream, args=(server, [9, 9, 9], chunks))
    running.start()
    while not chunks:
        threading.Event().wait(0.01)
    with pytest.raises(httpx.TimeoutException):  # (a pause whose caller goes away while it waits)
        httpx.post(server + "/pause", params={"mode": "wait"}, timeout=0.01)
    httpx.post(server + "/resume").raise_for_status()
    running.join(120)
    assert generate(server, PROMPTS[0])["choices"][0]["finish_reason"] == "length"
    assert httpx.post(server + "/pause", params={"mode": "sideways"}).status_code == 400
    assert httpx.post(server + "/pause", params={"mode": "abort"}).status_code == 200
    httpx.post(server + "/resume").raise_for_status()


# --- slow: the example learns; 8 devices

@pytest.mark.slow
def test_grpo_example_reward_rises():
    sampler = grpo.InProcess("jaxserve-tiny", grpo.ENGINE)
    history = grpo.train(sampler, default_model_dir(), steps=25, log=lambda line: None)
    assert np.mean(history[-5:]) > np.mean(history[:5]) + 0.2


EIGHT_DEVICES = """
import jax.numpy as jnp, numpy as np
from jaxserve import LLM, SamplingParams
import test_rl as t
for kind in ({"dtype": "bfloat16"}, {"dtype": "float32", "quantization": "int8"}):
    settings = dict(**t.SMALL, **kind, tensor_parallel_size=4, data_parallel_size=2)
    llm = LLM("jaxserve-tiny", **settings)
    llm.update_weights(llm.params_from_hf({k: jnp.asarray(x) for k, x in t.TENSORS.items()}))
    assert t.outputs(llm) == t.outputs(LLM(t.DIRECTORY, **settings)), kind
print("ok")
"""


@pytest.mark.slow
def test_update_weights_on_eight_devices(trained):
    """Tensor parallel over 4 virtual devices, 2 replicas: each replica's update equals a fresh engine."""
    tensors, directory = trained
    code = (f"import test_rl as t, safetensors.numpy as s\nt.DIRECTORY = {directory!r}\n"
            f"t.TENSORS = s.load_file({directory!r} + '/model.safetensors')\n" + EIGHT_DEVICES)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": str(ROOT / "tests")}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantizing_on_the_device_equals_the_host(fmt):
    """The engine quantizes a trainer's weights on the device to the very values it quantizes a
    checkpoint's to on the host (XLA must divide, not multiply by a reciprocal)."""
    from jaxserve_kernels.matmul.quant import quantize

    w = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32) * 3
    w[7, :64] = 0
    host, device = quantize(w, fmt), jax.jit(lambda x: quantize(x, fmt, jnp))(w)
    for a, b in zip(host, device):
        assert (a is None) == (b is None) and (a is None or np.array_equal(a, np.asarray(b)))
