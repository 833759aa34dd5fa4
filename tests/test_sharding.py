"""Tensor parallelism on 8 virtual CPU devices (in a subprocess, since the device count is fixed when
jax starts): sizes 1, 2, 4 and 8 agree, and the arrays are split as the partition rules say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent


def run_worker(model_dir: Path, sizes=(1, 2, 4, 8), engine: dict | None = None) -> dict:
    # (the worker imports this checkout's packages, as the tests do, not an installed copy)
    path = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": path}
    args = [sys.executable, str(HERE / "tp_worker.py"), str(model_dir), ",".join(map(str, sizes))]
    out = subprocess.run(args + ([json.dumps(engine)] if engine else []),
                         env=env, capture_output=True, text=True, timeout=900, cwd=HERE.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def check(results: dict, heads: int, kv_heads: int, intermediate: int) -> None:
    base = results[1]
    for tp, r in results.items():
        np.testing.assert_allclose(np.array(r["logits"]), np.array(base["logits"]), atol=1e-4, rtol=0)
        assert r["tokens"] == base["tokens"], f"tp={tp}"
        for got, want in zip(r["prompt_logprobs"], base["prompt_logprobs"]):  # per prompt, per position:
            assert len(got) == len(want)                                       # [token, logprob, rank] entries
            for got_entry, want_entry in zip(got, want):  # (2 or 3 entries: the prompt's token may be in the top 2)
                np.testing.assert_allclose(np.array(got_entry, float), np.array(want_entry, float), atol=1e-4, rtol=0)
        arrays = r["arrays"]
        q, k, o, down, kv = (arrays[n] for n in ("q_proj", "k_proj", "o_proj", "down_proj", "kv_pages"))
        assert q["devices"] == kv["devices"] == tp
        split = heads % tp == 0
        # weights are [out, in]: column-parallel splits dim 0, row-parallel dim 1
        assert q["shard"] == [q["shape"][0] // (tp if split else 1), q["shape"][1]]
        assert o["shard"] == [o["shape"][0], o["shape"][1] // (tp if split else 1)]
        kv_split = kv_heads % tp == 0
        assert k["shard"][0] == k["shape"][0] // (tp if kv_split else 1)
        assert kv["shard"][2] == kv["shape"][2] // (tp if kv_split else 1)  # pages split over KV heads
        assert down["shard"][1] == down["shape"][1] // (tp if intermediate % tp == 0 else 1)


def test_tensor_parallel_llama_and_an_orbax_round_trip(hf_checkpoint, tmp_path):
    """4 query heads, 2 KV heads: at 4 devices the query heads are split and the KV heads, which do
    not divide, replicated (2 devices, which split them: the next test; 8: the slow test below).
    The same checkpoint converted to Orbax and restored into a 4-way mesh gives the same logits."""
    from tp_worker import run

    model, model_dir = hf_checkpoint("llama")
    cfg = model.config
    # one device: in this process, whose engine of these settings other tests have compiled already
    results = {1: json.loads(json.dumps(run(str(model_dir), [1])))["1"], **run_worker(model_dir, sizes=(4,))}
    check(results, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)

    from checkpoints.orbax_io import is_orbax_dir
    from jaxserve.worker.weights import convert_checkpoint

    orbax_dir = convert_checkpoint(model_dir, tmp_path / "orbax")
    assert is_orbax_dir(orbax_dir) and (orbax_dir / "tokenizer.json").is_file()
    restored = run_worker(orbax_dir, sizes=(4,))
    check({1: results[1], 4: restored[4]}, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)
    np.testing.assert_array_equal(np.array(restored[4]["logits"]), np.array(results[4]["logits"]))


def test_tensor_parallel_splits_the_kv_heads_over_2_devices(hf_checkpoint):
    """4 query heads, 2 KV heads at 2 devices: each device holds one KV head of every page and
    attends with its own two query heads; logits, greedy generations and prompt logprobs equal
    those of one device. (Small settings: three step shapes to compile.)"""
    from tp_worker import run

    model, model_dir = hf_checkpoint("llama")
    cfg = model.config
    engine = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)
    results = {1: json.loads(json.dumps(run(str(model_dir), [1], engine)))["1"],
               **run_worker(model_dir, sizes=(2,), engine=engine)}
    assert cfg.num_key_value_heads == 2 and results[2]["arrays"]["kv_pages"]["shard"][2] == 1
    check(results, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tensor_parallel_up_to_8_devices(arch, hf_checkpoint):
    model, model_dir = hf_checkpoint(arch)
    cfg = model.config
    check(run_worker(model_dir), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)


def test_expert_parallel_on_8_devices(tmp_path):
    """Qwen2-MoE with 8 experts (a dense layer 0, a shared expert) on 8 devices with
    enable_expert_parallel: each device holds one whole expert of each stack, attention is split as
    for a dense model; logits, greedy generations and prompt logprobs equal one device's (the flag
    changes nothing there)."""
    from hf_models import build_hf_model, save_hf_model

    model = build_hf_model("qwen2-moe", num_experts=8)
    model_dir = save_hf_model(model, tmp_path / "qwen2-moe-8")
    cfg = model.config
    engine = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, enable_expert_parallel=True)
    results = run_worker(model_dir, sizes=(1, 8), engine=engine)
    check(results, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)
    for name in ("gate", "up", "down"):
        stack = results[8]["arrays"][f"experts_{name}"]
        assert stack["shape"][0] == 8 and stack["shard"] == [1, *stack["shape"][1:]] and stack["devices"] == 8


@pytest.mark.slow  # (two worker processes, each compiling its steps for 4 devices)
def test_expert_parallel_splits_whole_experts_and_tensor_parallel_their_matrices(tmp_path):
    """Qwen2-MoE with 4 experts (a dense layer 0, a shared expert) on 4 of 8 devices: with
    enable_expert_parallel each device holds one whole expert, without it every expert's matrices are
    split along the intermediate dimension; both generate what one device does, attention split as
    for a dense model."""
    from hf_models import build_hf_model, save_hf_model
    from tp_worker import run

    model = build_hf_model("qwen2-moe", num_experts=4)
    model_dir = save_hf_model(model, tmp_path / "qwen2-moe-4")
    cfg = model.config
    engine = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)
    one = json.loads(json.dumps(run(str(model_dir), [1], engine)))["1"]
    expert_parallel = run_worker(model_dir, sizes=(4,), engine={**engine, "enable_expert_parallel": True})[4]
    tensor_parallel = run_worker(model_dir, sizes=(4,), engine=engine)[4]
    for results in (expert_parallel, tensor_parallel):
        check({1: one, 4: results}, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)
    gate, down = (expert_parallel["arrays"][f"experts_{n}"] for n in ("gate", "down"))
    assert gate["shape"] == [4, 64, 64] and gate["shard"] == [1, 64, 64] and down["shard"] == [1, 64, 64]
    gate, down = (tensor_parallel["arrays"][f"experts_{n}"] for n in ("gate", "down"))
    assert gate["shard"] == [4, 16, 64] and down["shard"] == [4, 64, 16] and gate["devices"] == 4
