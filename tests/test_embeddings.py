"""Embeddings from a decoder (`--runner pooling`): a tiny random Qwen3 embedding model (a base model's
checkpoint: no LM head, no "model." prefix, with sentence-transformers' files), against transformers
with the pooling done by hand, offline (`LLM.embed`) and over HTTP (the OpenAI SDK)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import SMALL_ENGINE
from hf_models import build_hf_model, save_hf_model
from server import Server, free_port

from jaxserve import LLM, PoolingParams
from jaxserve.config.engine import EngineConfig

TOL = 1e-5


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory):
    """(the torch base model, its directory): Qwen3Model with sentence-transformers' last-token pooling
    and normalization."""
    base = build_hf_model("qwen3").model  # (Qwen3Model: hidden states, no head)
    directory = save_hf_model(base, tmp_path_factory.mktemp("qwen3-embedding"))
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": base.config.hidden_size, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": True,
        "include_prompt": True}))
    return base, directory


def reference(base, ids: list[int], pooling: str = "LAST", normalize: bool = True, dimensions=None) -> np.ndarray:
    with torch.no_grad():
        states = base(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    vector = (states[-1] if pooling == "LAST" else states.mean(0))[:dimensions]
    return vector / np.linalg.norm(vector) if normalize else vector


def close(got, want) -> None:
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=TOL * np.abs(want).max())


@pytest.fixture(scope="module")
def embedder(embedding_model):
    base, directory = embedding_model
    return LLM(str(directory), dtype="float32", **SMALL_ENGINE), base


def test_llm_embed_equals_transformers_with_the_checkpoints_pooling(embedder):
    llm, base = embedder
    assert llm.engine.config.runner == "pooling"  # (auto: a base model's checkpoint)
    tokenizer = llm.get_tokenizer()
    texts = ["the quick brown fox", "a", "jumps over the lazy dog " * 3]
    outs = llm.embed(texts + [{"prompt_token_ids": [5, 6, 7, 8]}], use_tqdm=False)
    for text, out in zip(texts, outs):
        close(out.outputs.embedding, reference(base, tokenizer.encode(text)))
    close(outs[3].outputs.embedding, reference(base, [5, 6, 7, 8]))
    half = llm.embed("the quick brown fox", pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    close(half[0].outputs.embedding, reference(base, tokenizer.encode("the quick brown fox"), dimensions=16))
    with pytest.raises(ValueError, match="LLM.embed"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("x", pooling_params=PoolingParams(dimensions=10_000))


def test_mean_pooling_from_the_pooler_config(embedding_model):
    base, directory = embedding_model
    llm = LLM(str(directory), dtype="float32", pooler_config={"pooling_type": "MEAN", "normalize": False},
              **SMALL_ENGINE)
    ids = list(range(3, 40))  # (longer than a page: all of the prompt's positions are read)
    close(llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding,
          reference(base, ids, "MEAN", normalize=False))
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(str(directory), pooler_config={"pooling_type": "MAX"}, **SMALL_ENGINE)


@pytest.fixture(scope="module")
def embedding_server(embedding_model):
    from api.app import create_app
    from api.limits import Limits
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.build import build_engine
    from jaxserve.engine.pooling import Pooler

    base, directory = embedding_model
    engine, tokenizer = build_engine(EngineConfig(model=str(directory), dtype="float32", **SMALL_ENGINE))
    async_engine = AsyncEngine(engine, tokenizer)
    async_engine.start()
    limits = Limits("embedder", 128, engine.model_config.vocab_size, pooler=Pooler.of(engine.config),
                    hidden_size=engine.model_config.hidden_size)
    server = Server(create_app(async_engine, limits), free_port())
    yield server.url, base, tokenizer
    server.stop()
    async_engine.shutdown()


def test_the_openai_sdk_gets_embeddings(embedding_server):
    url, base, tokenizer = embedding_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    texts = ["hello there", "general kenobi", "x"]
    got = client.embeddings.create(model="embedder", input=texts)  # (the SDK asks for base64, and decodes it)
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == "embedder"
    for text, item in zip(texts, got.data):
        close(item.embedding, reference(base, tokenizer.encode(text)))
    assert got.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    floats = client.embeddings.create(model="embedder", input=[1, 2, 3], encoding_format="float", dimensions=8)
    close(floats.data[0].embedding, reference(base, [1, 2, 3], dimensions=8))
    for body, param in (({"input": "x", "dimensions": 10_000}, "dimensions"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": 5}, "input")):
        bad = httpx.post(f"{url}/v1/embeddings", json=body, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert refused.status_code == 400 and "/v1/embeddings" in refused.json()["error"]["message"]
