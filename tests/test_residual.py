"""The residual stream per request: hidden states out (`return_hidden_states`) and steering vectors in
(`steering`, named vectors, llama.cpp's control vectors), against transformers with forward hooks on
its decoder layers, in float32: in one step of every family, through the engine in mixed batches
without a compilation, and over HTTP."""

from __future__ import annotations

import base64

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import SMALL_ENGINE
from hf_models import build_hf_model, save_hf_model
from server import Server, free_port
from test_compile import CompileCounter

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.steering import SteeringLibrary, read_control_vector
from jaxserve.errors import RequestError
from jaxserve.models import ModelInputs, forward_residual, head_logits, rope_table
from jaxserve.models.config import ModelConfig
from jaxserve.worker.kv_cache import allocate_kv_cache
from jaxserve.worker.weights import load_weights

TOL = 1e-5  # of the largest magnitude compared: these random models' states reach 10, where float32 rounds at 1e-6


def assert_close(got, want, tol: float = TOL) -> None:
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=tol * np.abs(want).max())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (torch model, its checkpoint directory)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            model = build_hf_model(arch)
            cache[arch] = model, save_hf_model(model, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


def reference(model, ids: list[int], steer: dict[int, np.ndarray] | None = None, first: int = 0):
    """transformers' run of `ids`, `steer[i]` added to decoder layer i's output from position `first`
    on -> (f32[L + 1, T, hidden]: each layer's output, steered, then the final norm's; f32[T, V] logits)."""
    decoder = model.model
    layers, states, hooks = decoder.layers, [], []
    for i, layer in enumerate(layers):
        def hook(module, args, out, i=i):
            h = out[0] if isinstance(out, tuple) else out
            if steer and i in steer:
                h = h.clone()
                h[:, first:] += torch.from_numpy(steer[i])
            states.append(h[0].numpy().copy())
            return (h, *out[1:]) if isinstance(out, tuple) else h
        hooks.append(layer.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    states.append(out.hidden_states[-1][0].numpy())  # (transformers' last entry: after the final norm)
    return np.stack(states), out.logits[0].numpy()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "mixtral"])
def test_one_step_gathers_and_steers_rows_as_transformers(arch, checkpoints):
    """Three prompts in one step: the first steered after layer 0, the second not, the third after the
    last layer; every layer's hidden states (and the final norm's) of every token gathered, and the
    logits at every position, equal transformers' within 1e-5."""
    model, model_dir = checkpoints(arch)
    cfg = ModelConfig.from_hf(model_dir).for_context(128)
    num_layers, hidden = cfg.num_layers, cfg.hidden_size
    rng = np.random.default_rng(1)
    ids = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (9, 13, 6)]
    vectors = {0: {0: rng.normal(0, 1, hidden).astype(np.float32)}, 1: None,
               2: {num_layers - 1: rng.normal(0, 1, hidden).astype(np.float32)}}
    table = np.zeros((num_layers, 4, hidden), np.float32)  # slots 0 and 2 steer; 3 is the zero slot
    for b, steer in vectors.items():
        for layer, vector in (steer or {}).items():
            table[layer, b] = vector
    graphdef, state, out, gathered, starts = _gather_every_layer(model_dir, cfg, ids, "float32", table)
    logits = np.asarray(head_logits(graphdef, state, out))
    for b, prompt in enumerate(ids):
        want_states, want_logits = reference(model, prompt, vectors[b])
        rows = slice(starts[b], starts[b + 1])
        assert_close(np.asarray(gathered)[:, rows], want_states)
        assert_close(logits[rows], want_logits)
    unsteered = reference(model, ids[0])[1]
    assert np.abs(unsteered - logits[:len(ids[0])]).max() > 0.01  # (the steering changes the logits)


def _gather_every_layer(model_dir, cfg, ids, dtype, table):
    """One step of the prompts `ids` (the second unsteered, the others in their own slots of `table`)
    gathering every layer's hidden states and the final norm's -> (graphdef, state, output, gathered,
    the prompts' first rows)."""
    num_layers = cfg.num_layers
    engine_cfg = EngineConfig(max_model_len=128, page_size=16, num_pages=32, dtype=dtype).resolve(cfg)
    graphdef, state = load_weights(model_dir, cfg, dtype)
    starts = np.cumsum([0, *map(len, ids)]).astype(np.int32)
    positions = np.concatenate([np.arange(len(i)) for i in ids]).astype(np.int32)
    row_of = np.repeat(np.arange(len(ids)), list(map(len, ids)))
    pages = np.arange(1, len(ids) + 1, dtype=np.int32)[:, None]
    inputs = ModelInputs(token_ids=np.concatenate(ids).astype(np.int32), positions=positions,
                         rope=rope_table(cfg, positions),
                         kv_write_index=(pages[row_of, 0] * 16 + positions).astype(np.int32),
                         kv_lens=np.array(list(map(len, ids)), np.int32), page_table=pages, query_start=starts,
                         num_seqs=np.asarray(len(ids), np.int32), logits_indices=starts[1:] - 1,
                         steer=np.where(row_of == 1, 3, row_of).astype(np.int32),
                         hidden_slots=np.arange(num_layers + 1, dtype=np.int32))
    step = jax.jit(forward_residual, static_argnums=(0, 4, 7))
    _, _, out, gathered = step(graphdef, state, allocate_kv_cache(cfg, engine_cfg), inputs, False, None,
                               table, num_layers + 1)
    return graphdef, state, out, gathered, starts


def test_bfloat16_hidden_states_are_the_layers_outputs(checkpoints):
    """In bfloat16 the gathered states are kept as their bits on CPU (`cache_dtype`): they come back as
    bfloat16, the last layer's bit for bit the step's output, every layer's near the float32 model's."""
    model, model_dir = checkpoints("llama")
    cfg = ModelConfig.from_hf(model_dir).for_context(128)
    ids = [np.random.default_rng(2).integers(0, cfg.vocab_size, size=n).tolist() for n in (9, 13, 6)]
    table = np.zeros((cfg.num_layers, 4, cfg.hidden_size), np.float32)
    *_, out, gathered, _ = _gather_every_layer(model_dir, cfg, ids, "bfloat16", table)
    assert gathered.dtype == jnp.bfloat16 and gathered.shape == (cfg.num_layers + 1, *out.shape)
    np.testing.assert_array_equal(np.asarray(gathered[cfg.num_layers - 1]), np.asarray(out))
    want = np.asarray(_gather_every_layer(model_dir, cfg, ids, "float32", table)[3])
    got = np.asarray(gathered, np.float32)
    for layer in range(cfg.num_layers + 1):
        scale = np.abs(want[layer]).max()
        assert scale > 0.1 and np.abs(got[layer] - want[layer]).max() < 0.05 * scale, layer


@pytest.fixture(scope="module")
def llm(checkpoints, tmp_path_factory):
    """An LLM over the tiny Llama (float32) with a named vector "up" (layer 1's direction)."""
    model, model_dir = checkpoints("llama")
    directory = tmp_path_factory.mktemp("vectors")
    up = np.random.default_rng(7).normal(0, 2, model.config.hidden_size).astype(np.float32)
    np.save(directory / "up.npy", up)
    llm = LLM(str(model_dir), dtype="float32", max_hidden_states_layers=2,
              steering_vectors=[f"up={directory / 'up.npy'}"], **SMALL_ENGINE)
    return llm, model, up


def _greedy(model, ids: list[int], n: int, steer=None, first: int = 0) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(reference(model, out, steer, first)[1][-1].argmax()))
    return out[len(ids):]


def test_a_mixed_batch_gets_each_requests_hidden_states_and_steering(llm):
    """8 requests in one generate: hidden states of all positions, of the outputs only, of the last
    prompt token, none; steered by a vector, by name, on the output only. Each equals transformers
    run alone (greedy tokens; hidden states within 1e-5), and the engine compiles nothing. Their layers
    (0, 1 and the final norm) are more than a step gathers (2): some requests wait for others."""
    llm, model, up = llm
    rng = np.random.default_rng(3)
    hidden = model.config.hidden_size
    prompts = [rng.integers(0, model.config.vocab_size, size=n).tolist() for n in (11, 7, 20, 5, 9, 14, 8, 12)]
    v = [rng.normal(0, 3, hidden).astype(np.float32) for _ in range(3)]
    asks = [dict(return_hidden_states={"layers": [0, "final"], "positions": "all"}),
            dict(return_hidden_states={"layers": [-1], "positions": "output"}),
            dict(return_hidden_states=True),
            {},
            dict(steering=[{"layer": 0, "vector": v[0].tolist(), "scale": 0.5}],
                 return_hidden_states={"layers": [1], "positions": "all"}),
            dict(steering=[{"name": "up", "layer": 1, "scale": 2.0}, {"layer": 0, "vector": base64.b64encode(
                v[1].astype("<f4").tobytes()).decode()}]),
            dict(steering=[{"layer": 0, "vector": v[2].tolist()}], steer_prompt=False),
            dict(steering=[{"layer": 0, "vector": v[0].tolist(), "scale": 0.5}])]  # (shares request 4's slot)
    steers = [None, None, None, None, {0: 0.5 * v[0]}, {1: 2.0 * up, 0: v[1]}, {0: v[2]}, {0: 0.5 * v[0]}]
    params = [SamplingParams(max_tokens=5, temperature=0, **ask) for ask in asks]
    engine_thread_counter = CompileCounter()
    with engine_thread_counter:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert engine_thread_counter.count == 0
    for b, (prompt, out) in enumerate(zip(prompts, outs)):
        first = len(prompt) if b == 6 else 0
        tokens = out.outputs[0].token_ids
        assert tokens == _greedy(model, prompt, 5, steers[b], first), b
        got = out.outputs[0].hidden_states
        if "return_hidden_states" not in asks[b]:
            assert got is None
            continue
        states, _ = reference(model, prompt + tokens[:-1], steers[b], first)
        want_positions = {0: list(range(len(prompt) + 4)), 1: list(range(len(prompt) - 1, len(prompt) + 4)),
                          2: [len(prompt) - 1], 4: list(range(len(prompt) + 4))}[b]
        assert got.positions == want_positions
        layers = {0: ([0, "final"], [0, 2]), 1: ([1], [1]), 2: ([1], [1]), 4: ([1], [1])}[b]
        assert got.layers == layers[0]
        assert_close(got.data, states[layers[1]][:, want_positions])
    assert outs[4].outputs[0].token_ids != _greedy(model, prompts[4], 5)  # (the vectors change the answers)


def test_eight_different_vectors_in_one_batch_equal_each_alone(llm):
    llm, model, _ = llm
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, model.config.vocab_size, size=10).tolist()
    params = [SamplingParams(max_tokens=6, temperature=0, steering=[
        {"layer": int(i % 2), "vector": rng.normal(0, 3, model.config.hidden_size).tolist()}]) for i in range(8)]
    together = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompt}] * 8, params,
                                                               use_tqdm=False)]
    alone = [llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0].outputs[0].token_ids for p in params]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1


def test_steered_prompts_never_share_prefix_pages_with_unsteered_ones(llm):
    llm, model, _ = llm
    prompt = list(range(3, 40))
    steered = SamplingParams(max_tokens=1, steering=[{"name": "up", "layer": 1}])
    cached = [llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0].num_cached_tokens
              for p in (SamplingParams(max_tokens=1), steered, steered)]
    assert cached == [0, 0, 32]


def test_requests_the_engine_cannot_serve_are_refused(llm):
    llm, model, _ = llm
    with pytest.raises(RequestError, match="out of range"):
        llm.generate("hi", SamplingParams(return_hidden_states={"layers": [5]}), use_tqdm=False)
    with pytest.raises(RequestError, match="at most 2"):
        llm.generate("hi", SamplingParams(return_hidden_states={"layers": [0, 1, "final"]}), use_tqdm=False)
    with pytest.raises(RequestError, match="hidden size"):
        llm.generate("hi", SamplingParams(steering=[{"layer": 0, "vector": [1.0, 2.0]}]), use_tqdm=False)
    with pytest.raises(RequestError, match="no steering vector named"):
        llm.generate("hi", SamplingParams(steering=[{"layer": 0, "name": "down"}]), use_tqdm=False)
    for bad in ([{"layer": 0}], [{"vector": [1.0]}], "x", [{"layer": 0, "vector": "not base64!"}]):
        with pytest.raises(RequestError):
            SamplingParams(steering=bad)
    with pytest.raises(RequestError, match="positions"):
        SamplingParams(return_hidden_states={"positions": "first"})


def write_control_vector(path, directions: dict[int, np.ndarray]) -> None:
    """A control-vector file as llama.cpp's cvector-generator writes it."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    writer.add_uint32("controlvector.layer_count", len(directions))
    for layer, vector in directions.items():
        writer.add_tensor(f"direction.{layer}", vector.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_control_vectors_apply_as_llama_cpp_defines_them(checkpoints, tmp_path):
    """--control-vector at scale 1 and --control-vector-scaled files summed, direction.N after layer N,
    within --control-vector-layer-range; a request's own vectors add to them."""
    model, model_dir = checkpoints("llama")
    cfg = ModelConfig.from_hf(model_dir)
    rng = np.random.default_rng(8)
    a = {1: rng.normal(size=cfg.hidden_size).astype(np.float32)}
    b = {1: rng.normal(size=cfg.hidden_size).astype(np.float32)}
    write_control_vector(tmp_path / "a.gguf", a)
    write_control_vector(tmp_path / "b.gguf", b)
    np.testing.assert_array_equal(read_control_vector(tmp_path / "a.gguf", cfg)[1], a[1])
    config = EngineConfig(control_vector=(str(tmp_path / "a.gguf"),),
                          control_vector_scaled=(str(tmp_path / "b.gguf"), "-0.5"))
    library = SteeringLibrary(config, cfg)
    want = np.zeros((cfg.num_layers, cfg.hidden_size), np.float32)
    want[1] = a[1] - 0.5 * b[1]
    np.testing.assert_allclose(library.resolve(SamplingParams()).table, want, rtol=1e-6)
    mine = rng.normal(size=cfg.hidden_size).astype(np.float32)
    got = library.resolve(SamplingParams(steering=[{"layer": 0, "vector": mine.tolist()}])).table
    np.testing.assert_allclose(got, want + np.stack([mine, np.zeros_like(mine)]), rtol=1e-6)
    outside = EngineConfig(control_vector=(str(tmp_path / "a.gguf"),), control_vector_layer_range=(2, 2))
    assert not SteeringLibrary(outside, cfg).resolve(SamplingParams()).table.any()
    write_control_vector(tmp_path / "zero.gguf", {0: a[1]})
    with pytest.raises(ValueError, match="direction.0"):
        read_control_vector(tmp_path / "zero.gguf", cfg)


@pytest.fixture(scope="module")
def residual_server(checkpoints, tmp_path_factory):
    """(url, torch model, direction) of a server over the tiny Llama with a control vector."""
    from api.app import create_app
    from api.limits import Limits
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.build import build_engine

    model, model_dir = checkpoints("llama")
    direction = np.random.default_rng(9).normal(0, 2, model.config.hidden_size).astype(np.float32)
    path = tmp_path_factory.mktemp("cvec") / "c.gguf"
    write_control_vector(path, {1: direction})
    engine, tokenizer = build_engine(EngineConfig(model=str(model_dir), dtype="float32", control_vector=(str(path),),
                                                  **SMALL_ENGINE))
    async_engine = AsyncEngine(engine, tokenizer)
    async_engine.start()
    server = Server(create_app(async_engine, Limits("base", 128, engine.model_config.vocab_size)), free_port())
    yield server.url, model, direction
    server.stop()
    async_engine.shutdown()


def test_hidden_states_and_steering_over_http(residual_server):
    """Completions and chat, streamed or not: base64 and float encodings equal transformers under the
    server's control vector plus the request's vector."""
    url, model, direction = residual_server
    vector = np.random.default_rng(10).normal(0, 2, model.config.hidden_size).astype(np.float32)
    prompt = [5, 9, 13, 17, 21, 25]
    body = dict(model="base", prompt=prompt, max_tokens=3, temperature=0,
                return_hidden_states={"layers": [0, -1], "positions": "all"},
                steering=[{"layer": 0, "vector": vector.tolist(), "scale": 0.5}])
    got = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    choice = got["choices"][0]
    hidden = choice["hidden_states"]
    data = np.frombuffer(base64.b64decode(hidden["data"]), "<f4").reshape(hidden["shape"])
    steer = {0: 0.5 * vector, 1: direction}
    tokens = _greedy(model, prompt, 3, steer)
    states, _ = reference(model, prompt + tokens[:-1], steer)
    assert hidden["layers"] == [0, 1] and hidden["positions"] == list(range(8)) and hidden["encoding"] == "base64"
    assert_close(data, states[[0, 1]])
    as_floats = httpx.post(f"{url}/v1/completions", json={**body, "return_hidden_states": {
        "layers": ["final"], "positions": "last", "encoding": "float"}}, timeout=60).json()
    assert_close(as_floats["choices"][0]["hidden_states"]["data"], states[[2], len(prompt) - 1:len(prompt)])
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json=dict(
            model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
            return_hidden_states=True)) as response:
        chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
    carrying = [c for c in chunks if '"hidden_states"' in c]
    assert len(carrying) == 1 and '"finish_reason":"' in carrying[0].replace(" ", "")
    bad = httpx.post(f"{url}/v1/completions", json={**body, "steering": [{"layer": 9, "vector": [1.0]}]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "steering"
