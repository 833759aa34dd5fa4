"""LoRA adapters: many at once over one base model, against PEFT's merged models.

Invariants: one step mixing three adapters and the base model gives each row the logits of its
adapter merged into the weights by PEFT (float32, within 1e-4); greedy generation through the whole
engine, with more adapters than slots, equals the merged models' `generate`; llama.cpp's GGUF form of
an adapter reads as its PEFT form; over HTTP an adapter is a model (vLLM's names and answers), loaded
and unloaded at run time under load without a single compilation.
"""

from __future__ import annotations

import asyncio
import functools
import re

import httpx
import jax
import numpy as np
import openai
import pytest
import torch
from conftest import SMALL_ENGINE
from hf_models import build_hf_model, save_hf_model
from lora_adapters import ADAPTERS, make_adapter, merged, write_gguf_adapter
from server import Server, free_port, serving
from test_compile import CompileCounter

from checkpoints.lora import read_adapter
from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.models import LoraRows, ModelInputs, forward, head_logits, rope_table
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import HF_NAME_MAP
from jaxserve.worker.kv_cache import allocate_kv_cache
from jaxserve.worker.lora import AdapterSlots, AdapterStore, adaptable_shapes
from jaxserve.worker.sharding import make_mesh
from jaxserve.worker.weights import load_weights

PROMPTS = ["the quick brown fox", "lora adapters", "one base model, many fine-tunes", "hello"]


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """arch -> (base torch model, its checkpoint, {adapter name: (PEFT model, its directory)})."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            base = build_hf_model(arch)
            peft = {name: (make_adapter(base, root / name, rank, targets, rslora, seed=i + 1), root / name)
                    for i, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items())}
            cache[arch] = base, save_hf_model(base, root / "base"), peft
        return cache[arch]

    return get


def requests_of(peft: dict) -> list[LoRARequest]:
    return [LoRARequest(name, i + 1, str(directory)) for i, (name, (_, directory)) in enumerate(peft.items())]


def mixed_step_logits(model_dir, requests: list[LoRARequest | None], ids: list[list[int]],
                      quantization: str | None = None) -> list[np.ndarray]:
    """The logits at every position of each prompt, all in one step, prompt b with adapter
    requests[b] (None: the base model), through three slots."""
    cfg = ModelConfig.from_hf(model_dir).for_context(128)
    engine_cfg = EngineConfig(max_model_len=128, page_size=16, num_pages=32, dtype="float32").resolve(cfg)
    graphdef, state = load_weights(model_dir, cfg, "float32", quantization=quantization)
    kv = allocate_kv_cache(cfg, engine_cfg)
    slots = AdapterSlots(cfg, 3, 16, "float32", make_mesh(1),
                         AdapterStore(cfg, adaptable_shapes(cfg, "float32"), 16, 3))
    slot_of = slots.assign(r for r in requests if r is not None)
    starts = np.cumsum([0, *map(len, ids)]).astype(np.int32)
    positions = np.concatenate([np.arange(len(i)) for i in ids]).astype(np.int32)
    row_of = np.repeat(np.arange(len(ids)), list(map(len, ids)))
    pages = np.arange(1, len(ids) + 1, dtype=np.int32)[:, None]  # one page per prompt
    token_slots = np.array([-1 if requests[b] is None else slot_of[requests[b].lora_int_id] for b in row_of], np.int32)
    inputs = ModelInputs(token_ids=np.concatenate(ids).astype(np.int32), positions=positions,
                         rope=rope_table(cfg, positions),
                         kv_write_index=(pages[row_of, 0] * 16 + positions).astype(np.int32),
                         kv_lens=np.array(list(map(len, ids)), np.int32), page_table=pages, query_start=starts,
                         num_seqs=np.asarray(len(ids), np.int32), logits_indices=starts[1:] - 1,
                         lora=LoraRows(**LoraRows.of(token_slots, 3)))
    _, _, hidden = forward(graphdef, state, kv, inputs, adapters=slots.stacks)
    logits = np.asarray(head_logits(graphdef, state, hidden))
    return [logits[starts[b]:starts[b + 1]] for b in range(len(ids))]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_one_step_of_three_adapters_and_the_base_equals_peft_merged(arch, adapted):
    base, model_dir, peft = adapted(arch)
    rng = np.random.default_rng(2)
    ids = [rng.integers(0, base.config.vocab_size, size=n).tolist() for n in (9, 14, 6, 11)]
    adapters = [*requests_of(peft), None]  # prompt b runs with adapters[b]
    got = mixed_step_logits(model_dir, adapters, ids)
    for prompt, adapter, logits in zip(ids, adapters, got):
        reference = base if adapter is None else merged(peft[adapter.lora_name][0])
        with torch.no_grad():
            want = reference(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(logits, want, atol=1e-4, rtol=0)
    with torch.no_grad():  # (the adapters change the logits: the comparison tells them apart)
        plain = base(torch.tensor([ids[0]])).logits[0].numpy()
    assert np.abs(plain - got[0]).max() > 0.1


def test_a_mixture_of_experts_takes_adapters_of_its_attention_only(tmp_path):
    """Qwen3-MoE: an adapter of q and v equals PEFT's merged model; one of an expert's projection is
    refused, naming the layer."""
    from safetensors.numpy import save_file

    base = build_hf_model("qwen3-moe")
    model_dir = save_hf_model(base, tmp_path / "base")
    rank, targets, rslora = ADAPTERS["qv4"]
    peft = make_adapter(base, tmp_path / "qv4", rank, targets, rslora, seed=5)
    ids = [np.random.default_rng(4).integers(0, base.config.vocab_size, size=12).tolist()]
    (got,) = mixed_step_logits(model_dir, [LoRARequest("qv4", 1, str(tmp_path / "qv4"))], ids)
    with torch.no_grad():
        want = merged(peft)(torch.tensor(ids)).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    experts = tmp_path / "experts"
    experts.mkdir()
    (experts / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 2}')
    prefix = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    save_file({f"{prefix}.lora_A.weight": np.ones((2, 64), np.float32),
               f"{prefix}.lora_B.weight": np.ones((64, 2), np.float32)}, str(experts / "adapter_model.safetensors"))
    cfg = ModelConfig.from_hf(model_dir)
    from jaxserve.models import MODEL_REGISTRY

    with pytest.raises(ValueError, match="experts.0.gate_proj"):
        read_adapter(experts, MODEL_REGISTRY[cfg.architecture].hf_name_map, adaptable_shapes(cfg, "float32"))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_adapters_over_quantized_weights_match_them_over_the_dequantized_ones(quantization, adapted, tmp_path):
    """The adapter's products stay in floats over a quantized base: the same adapters over the
    checkpoint whose quantized matrices hold their dequantized values agree as test_quantization's
    models do (top-1 and KL divergence)."""
    from test_gguf import MAX_KL, MIN_TOP1, TIE, agreement
    from test_quantization import dequantized_twin

    base, model_dir, peft = adapted("llama")
    twin = dequantized_twin(model_dir, quantization, tmp_path / "twin")
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, base.config.vocab_size, size=30).tolist() for _ in range(4)]
    adapters = [*requests_of(peft), None]
    got = np.concatenate(mixed_step_logits(model_dir, adapters, ids, quantization))
    want = np.concatenate(mixed_step_logits(twin, adapters, ids))
    top1, kl = agreement(got, want, TIE)
    assert top1 >= MIN_TOP1 and kl <= MAX_KL, (top1, kl)


@pytest.mark.parametrize(("arch", "slots"), [("llama", 2), ("qwen3", 3)])
def test_greedy_generation_equals_the_merged_models(arch, slots, adapted):
    """Eight prompts over three adapters and the base: with three slots they all decode in the same
    steps; with two, each runs when its adapter has a slot (the others wait, then take the slots of
    the adapters no longer running). Each equals its merged model's greedy `generate`; outputs carry
    their LoRARequest."""
    base, model_dir, peft = adapted(arch)
    llm = LLM(str(model_dir), enable_lora=True, max_loras=slots, max_lora_rank=16, **SMALL_ENGINE)
    requests = requests_of(peft)
    prompts = PROMPTS * 2
    loras = [requests[0], requests[1], requests[2], None, requests[2], None, requests[1], requests[0]]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0), lora_request=loras)
    for out, lora in zip(outputs, loras):
        reference = base if lora is None else merged(peft[lora.lora_name][0])
        with torch.no_grad():
            want = reference.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=10, do_sample=False)
        assert out.outputs[0].token_ids == want[0, len(out.prompt_token_ids):].tolist(), lora
        assert out.lora_request == lora and out.outputs[0].lora_request == lora
    if slots == 3:
        return
    # the same new prompt under two adapters shares no prefix-cache page; under the first again, it does
    fresh = "a prompt of its own, over two pages long"
    cached = [llm.generate(fresh, SamplingParams(max_tokens=1), lora_request=lora, use_tqdm=False)[0].num_cached_tokens
              for lora in (requests[0], requests[1], requests[0])]
    assert cached == [0, 0, 32]
    # vLLM's LLMEngine: adapters read ahead, listed, pinned, forgotten (host memory holds two: max_loras)
    engine, ids = llm.llm_engine, [r.lora_int_id for r in requests]
    assert engine.add_lora(requests[0]) is True and ids[0] in engine.list_loras()
    assert engine.pin_lora(ids[0]) is True
    engine.add_lora(requests[1]), engine.add_lora(requests[2])
    assert engine.list_loras() == {ids[0], ids[2]}  # (the pinned one stays)
    assert engine.remove_lora(ids[2]) is True and engine.remove_lora(ids[2]) is False
    with pytest.raises(ValueError, match="not registered"):
        engine.pin_lora(ids[2])
    with pytest.raises(ValueError, match="no LoRA adapter at"):
        engine.add_lora(LoRARequest("missing", 9, str(model_dir / "none")))
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0), lora_request=requests[2])
    assert out[0].outputs[0].token_ids == outputs[2].outputs[0].token_ids  # (forgotten, then served again)


@pytest.mark.parametrize("form,skip_idle", [("masked", True), ("masked", False), ("grouped", True)])
def test_lora_delta_against_float64_numpy(form, skip_idle):
    """Both forms of the adapters' products (masked: CPU's and GPU's, GPU's without skipping idle
    steps; grouped: TPU's) against float64 numpy, rows of every slot and of none interleaved; the
    forms lower for TPU and GPU."""
    from jaxserve.models.lora import lora_delta

    rng = np.random.default_rng(6)
    x, a, b = (np.asarray(rng.normal(size=shape), np.float32) for shape in ((13, 24), (3, 4, 24), (3, 20, 4)))
    slots = np.array([2, -1, 0, 0, 1, -1, 2, 2, 1, 0, -1, 1, 2], np.int32)
    rows = LoraRows(**LoraRows.of(slots, 3))
    f = jax.jit(functools.partial(lora_delta, skip_idle=skip_idle), static_argnames="form")
    want = np.stack([np.zeros(20) if s < 0 else (x[i] @ a[s].T.astype(float)) @ b[s].T for i, s in enumerate(slots)])
    np.testing.assert_allclose(np.asarray(f(x, a, b, rows, form)), want, atol=1e-4, rtol=1e-5)
    none = LoraRows(**LoraRows.of(np.full(13, -1, np.int32), 3))
    assert not np.asarray(f(x, a, b, none, form)).any()
    for platform in ("tpu", "cuda"):
        f.trace(x, a, b, rows, form).lower(lowering_platforms=(platform,))


def test_host_memory_keeps_the_most_recently_used_adapters(adapted):
    _, model_dir, peft = adapted("llama")
    cfg = ModelConfig.from_hf(model_dir)
    store = AdapterStore(cfg, adaptable_shapes(cfg, "float32"), 16, capacity=2)
    first, second, third = requests_of(peft)
    held = store.get(first)
    assert store.get(first) is held  # (kept: not read again)
    store.get(second), store.get(third)
    assert store.get(first) is not held  # (dropped for the third, then read again)
    store.pin(first.lora_int_id)
    held = store.get(first)
    store.get(second), store.get(third)
    assert store.get(first) is held and store.held() == {first.lora_int_id, third.lora_int_id}  # (pinned: kept)
    assert store.remove(first.lora_int_id) and not store.remove(first.lora_int_id)
    with pytest.raises(ValueError, match="rank 16, past --max-lora-rank 8"):
        AdapterStore(cfg, adaptable_shapes(cfg, "float32"), 8, capacity=2).get(second)


def test_adapter_errors_are_clear():
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(enable_lora=True, batch_invariant=True)
    with pytest.raises(ValueError, match="positive"):
        LoRARequest("a", 0, "/x")


def test_gguf_adapter_reads_as_its_peft_form(adapted, tmp_path):
    """llama.cpp's layout of an adapter (B's q and k rows interleaved by head, alpha in the metadata)
    gives the same products as the PEFT directory it came from."""
    _, model_dir, peft = adapted("llama")
    cfg = ModelConfig.from_hf(model_dir)
    shapes = adaptable_shapes(cfg, "float32")
    heads = (cfg.num_heads, cfg.num_kv_heads)
    for name in ("mlp8", "all16"):
        rank, _, rslora = ADAPTERS[name]
        scale = 2 * rank / (rank ** 0.5 if rslora else rank)  # (lora_alpha is 2 r)
        # (llama.cpp scales by alpha / rank: an rslora adapter converts with alpha = scale * rank)
        path = write_gguf_adapter(peft[name][0], tmp_path / f"{name}.gguf", heads, alpha=scale * rank)
        got = read_adapter(path, HF_NAME_MAP, shapes, heads)
        want = read_adapter(peft[name][1], HF_NAME_MAP, shapes)
        assert got.rank == want.rank == rank and set(got.layers) == set(want.layers)
        for layer, (a, b) in want.layers.items():
            np.testing.assert_allclose(got.layers[layer][0], a, rtol=1e-6)
            np.testing.assert_allclose(got.layers[layer][1], b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not a LoRA adapter|no LoRA adapter"):
        read_adapter(model_dir, HF_NAME_MAP, shapes)


@pytest.fixture(scope="module")
def lora_server(adapted):
    """(url, AsyncEngine, {name: merged torch model}) of a server over the tiny Llama with two slots,
    run-time updates on, and adapter qv4 from the start (as --lora-modules gives it)."""
    from api.app import create_app
    from api.limits import Limits
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.build import build_engine
    from run_server import add_lora_modules
    from jaxserve.config.lora import LoraModule

    base, model_dir, peft = adapted("llama")
    engine, tokenizer = build_engine(EngineConfig(model=str(model_dir), enable_lora=True, max_loras=2,
                                                  **SMALL_ENGINE))
    async_engine = AsyncEngine(engine, tokenizer)
    async_engine.start()
    limits = Limits("base", 128, engine.model_config.vocab_size)
    add_lora_modules(limits, [LoraModule("qv4", str(peft["qv4"][1]))], [engine])
    server = Server(create_app(async_engine, limits, runtime_lora_updating=True), free_port())
    references = {"base": base, **{name: merged(model) for name, (model, _) in peft.items()}}
    yield server.url, async_engine, references, {name: str(directory) for name, (_, directory) in peft.items()}
    server.stop()
    async_engine.shutdown()


def _greedy(reference, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return reference.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)[0, len(prompt_ids):
                                                                                                  ].tolist()


def test_an_adapter_is_a_model_over_http(lora_server):
    url, _, references, paths = lora_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "qv4"}
    assert cards["qv4"].parent == "base" and cards["qv4"].root == paths["qv4"]
    assert client.models.retrieve("qv4").parent == "base"
    answer = client.completions.create(model="qv4", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert answer.model == "qv4"
    choice = answer.choices[0]
    assert choice.token_ids == _greedy(references["qv4"], choice.prompt_token_ids, 8)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    # vLLM's run-time routes: loaded, then served; the same name twice is a 400 unless in place
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "all16", "lora_path": paths["all16"]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'all16' added successfully."
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "all16", "lora_path": paths["all16"]})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/no/such/adapter"})
    assert r.status_code == 400 and "/no/such/adapter" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400
    chat = client.chat.completions.create(model="all16", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "all16"
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "all16"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'all16' removed successfully."
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "all16"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="all16", prompt="x", max_tokens=1)


def test_adapters_of_concurrent_requests_share_steps_and_report_in_metrics(lora_server):
    """Three adapters and the base at once through two slots, each answer its merged model's; while
    they run, vLLM's lora_requests_info gauge names the running and the waiting adapters."""
    url, _, references, paths = lora_server
    for name in ("all16", "mlp8"):
        httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": paths[name],
                                                        "load_inplace": True}).raise_for_status()
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    models = ["qv4", "all16", "base", "mlp8"] * 2
    seen = []

    async def scrape():
        async with httpx.AsyncClient() as http:
            for _ in range(40):
                text = (await http.get(url + "/metrics")).text
                seen.extend(re.findall(r"vllm:lora_requests_info\{[^}]*\}", text))
                await asyncio.sleep(0.01)

    async def run():
        calls = [client.completions.create(model=m, prompt=p, max_tokens=12, temperature=0,
                                           extra_body={"return_token_ids": True})
                 for m, p in zip(models, PROMPTS * 2)]
        return await asyncio.gather(*calls, scrape())

    *answers, _ = asyncio.run(run())
    for model, answer in zip(models, answers):
        assert answer.choices[0].token_ids == _greedy(references[model], answer.choices[0].prompt_token_ids, 12), model
    assert seen and all('max_lora="2"' in s for s in seen)
    assert any(re.search(r'running_lora_adapters="[a-z0-9,]+"', s) for s in seen)


def test_load_and_unload_under_load_compiles_nothing(lora_server):
    """50 cycles of loading an adapter (the three in turn, through two slots), sending a request for
    it, unloading it while it streams: each such request still finishes, a new one is a 404, and no
    step compiles."""
    url, engine, references, paths = lora_server
    names = list(paths)
    with CompileCounter(thread=engine._thread) as counter, httpx.Client(base_url=url, timeout=60) as http:
        for cycle in range(50):
            name = names[cycle % 3]
            http.post("/v1/load_lora_adapter", json={"lora_name": "cycle", "lora_path": paths[name]}
                      ).raise_for_status()
            with http.stream("POST", "/v1/completions", json={"model": "cycle", "prompt": PROMPTS[cycle % 4],
                                                               "max_tokens": 6, "temperature": 0, "stream": True,
                                                               "return_token_ids": True}) as stream:
                lines = stream.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                http.post("/v1/unload_lora_adapter", json={"lora_name": "cycle"}).raise_for_status()
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]", rest
            assert http.post("/v1/completions", json={"model": "cycle", "prompt": "x"}).status_code == 404
            assert first
    assert counter.count == 0


def test_adapters_under_tensor_parallelism_split_like_their_layers(adapted):
    """Sizes 1, 2 and 4 on virtual CPU devices give the same greedy tokens for rows of three adapters
    and the base; q's B is split over its outputs, o's A over its inputs."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    _, model_dir, peft = adapted("llama")
    here = Path(__file__).resolve().parent
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(here.parent), os.environ.get("PYTHONPATH")]))}
    args = [sys.executable, str(here / "lora_tp_worker.py"), str(model_dir), "1,2,4",
            *(str(directory) for _, directory in peft.values())]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900, cwd=here.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    results = {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    for tp, result in results.items():
        assert result["tokens"] == results[1]["tokens"], tp
        (q_a, q_b), (o_a, o_b) = result["stacks"].values()
        assert q_a == [2, 16, 64] and q_b == [2, 64 // tp, 16]  # (4 heads of 16)
        assert o_a == [2, 16, 64 // tp] and o_b == [2, 64, 16]


def test_run_server_serves_lora_modules_under_vllms_switch(adapted):
    """`python run_server.py --enable-lora --lora-modules` in both of vLLM's forms, with vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING turning on the run-time routes; --lora-modules without
    --enable-lora, or an adapter that cannot be served, stops it with why."""
    import json

    import run_server

    base, model_dir, peft = adapted("llama")
    with pytest.raises(SystemExit):
        run_server.parse_args(["--model", str(model_dir), "--lora-modules", f"qv4={peft['qv4'][1]}"])
    module = json.dumps({"name": "mlp8", "path": str(peft["mlp8"][1]), "base_model_name": "tiny-llama"})
    port = free_port()
    with serving(port, "--model", str(model_dir), "--enable-lora", "--max-loras", "2", "--max-model-len", "128",
                 "--max-num-batched-tokens", "32", "--lora-modules", f"qv4={peft['qv4'][1]}", module,
                 env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}):
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert {m.id: m.parent for m in client.models.list().data} == {
            str(model_dir): None, "qv4": str(model_dir), "mlp8": "tiny-llama"}
        answer = client.completions.create(model="mlp8", prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                           extra_body={"return_token_ids": True})
        choice = answer.choices[0]
        assert choice.token_ids == _greedy(merged(peft["mlp8"][0]), choice.prompt_token_ids, 6)
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "all16", "lora_path": str(peft["all16"][1])})
        assert r.status_code == 200, r.text
