"""Run by tests/test_quantization.py in a subprocess with 8 virtual CPU devices: the logits of one
token sequence through a model loaded with --quantization on a mesh of each size, and where the
quantized parts live (JSON). Usage: quant_worker.py MODEL_DIR QUANTIZATION SIZES TOKEN_IDS."""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.models import ModelInputs, forward, rope_table
from jaxserve.models.config import ModelConfig
from jaxserve.worker.kv_cache import allocate_kv_cache
from jaxserve.worker.sharding import kv_sharding, make_mesh
from jaxserve.worker.weights import load_weights


def logits(model_dir: str, quantization: str | None, tp: int, ids: list[int]) -> tuple[np.ndarray, dict]:
    """(f32[len(ids), vocab] logits, {parameter path: [shard shape, devices]} of the first layer's MLP)."""
    cfg = ModelConfig.from_hf(model_dir)
    mesh = make_mesh(tp)
    engine = EngineConfig(max_model_len=128, num_pages=16, dtype="float32").resolve(cfg)
    graphdef, state = load_weights(model_dir, cfg, "float32", mesh, quantization)
    kv = allocate_kv_cache(cfg, engine, kv_sharding(mesh, cfg))
    n, page_size = len(ids), engine.page_size
    pages = np.arange(1, 1 + -(-n // page_size), dtype=np.int32)
    pos = np.arange(n)
    inputs = ModelInputs(token_ids=np.asarray(ids, np.int32), positions=pos.astype(np.int32),
                         rope=rope_table(cfg, pos),
                         kv_write_index=(pages[pos // page_size] * page_size + pos % page_size).astype(np.int32),
                         kv_lens=np.array([n], np.int32), page_table=pages[None, :],
                         query_start=np.array([0, n], np.int32), num_seqs=np.asarray(1, np.int32),
                         logits_indices=np.arange(n, dtype=np.int32))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # (as the engine traces its step)
        _, out, _ = jax.jit(forward, static_argnames="graphdef")(graphdef, state, kv, inputs)
    mlp = state["layers"][0]["mlp"]
    mlp = mlp["experts"] if "experts" in mlp else mlp  # (a Mixture-of-Experts layer's stacked matrices)
    placed = {f"{proj}.{part}": [list(a.sharding.shard_shape(a.shape)), len(a.sharding.device_set)]
              for proj in ("up_proj", "down_proj") for part, a in
              ((p, mlp[proj][p][...]) for p in ("weight", "scales", "mins") if p in mlp[proj])}
    return np.asarray(out), placed


if __name__ == "__main__":  # model_dir quantization sizes token_ids
    model_dir, quantization, sizes, ids = sys.argv[1:5]
    results = {}
    for tp in map(int, sizes.split(",")):
        out, placed = logits(model_dir, None if quantization == "None" else quantization, tp, json.loads(ids))
        results[tp] = {"logits": out.tolist(), "placed": placed}
    print(json.dumps(results))
