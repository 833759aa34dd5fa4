"""Run by tests/test_sharding.py in a subprocess with 8 virtual CPU devices: for each tensor-parallel
size, the logits of a prompt, greedy generations with their prompt logprobs, and where the weights
and KV pages live (JSON). Usage: tp_worker.py MODEL_DIR SIZES [ENGINE_SETTINGS_JSON]."""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.models import ModelInputs, forward, rope_table


def prompt_logits(engine, ids: list[int]) -> np.ndarray:
    n, page_size = len(ids), engine.config.page_size
    pages = np.arange(1, 1 + -(-n // page_size), dtype=np.int32)
    pos = np.arange(n)
    inputs = ModelInputs(token_ids=np.asarray(ids, np.int32), positions=pos.astype(np.int32),
                         rope=rope_table(engine.model_config, pos),
                         kv_write_index=(pages[pos // page_size] * page_size + pos % page_size).astype(np.int32),
                         kv_lens=np.array([n], np.int32), page_table=pages[None, :],
                         query_start=np.array([0, n], np.int32), num_seqs=np.asarray(1, np.int32),
                         logits_indices=np.arange(n, dtype=np.int32))
    _, logits, _ = jax.jit(forward, static_argnames="graphdef")(engine.runner.graphdef, engine.runner.state,
                                                             engine.runner.kv, inputs)
    return np.asarray(logits)


ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32)


def run(model_dir: str, sizes: list[int], settings: dict | None = None) -> dict:
    """`settings`: the LLM's settings (ENGINE when None)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 30, 17, 1)]
    results = {}
    for tp in sizes:
        llm = LLM(model_dir, tensor_parallel_size=tp, **(settings or ENGINE))
        engine = llm.engine
        outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                       prompt_logprobs=2), use_tqdm=False)
        layer = engine.runner.state["layers"][0]
        arrays = {"q_proj": layer["self_attn"]["q_proj"]["weight"][...],
                  "k_proj": layer["self_attn"]["k_proj"]["weight"][...],
                  "o_proj": layer["self_attn"]["o_proj"]["weight"][...],
                  "down_proj": layer["mlp"]["down_proj"]["weight"][...],
                  "kv_pages": engine.runner.kv.k[0]}
        last_mlp = engine.runner.state["layers"][engine.model_config.num_layers - 1]["mlp"]
        if "experts" in last_mlp:  # a Mixture-of-Experts layer's stacked [experts, out, in] matrices
            arrays.update({f"experts_{name}": last_mlp["experts"][f"{name}_proj"]["weight"][...]
                           for name in ("gate", "up", "down")})
        results[tp] = {
            "tokens": [o.outputs[0].token_ids for o in outputs],
            "prompt_logprobs": [[[[t, lp.logprob, lp.rank] for t, lp in entry.items()] for entry in o.prompt_logprobs[1:]]
                                for o in outputs],
            "logits": prompt_logits(engine, prompts[1]).tolist(),
            "arrays": {name: {"shape": list(a.shape), "shard": list(a.sharding.shard_shape(a.shape)),
                              "devices": len(a.sharding.device_set)} for name, a in arrays.items()},
        }
    return results


if __name__ == "__main__":  # model_dir sizes [engine settings as JSON]
    engine = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    print(json.dumps(run(sys.argv[1], [int(s) for s in sys.argv[2].split(",")], engine)))
