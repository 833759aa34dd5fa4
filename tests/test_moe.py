"""Mixture-of-Experts models beyond parity (tests/test_parity.py): the layers config.json makes dense,
routing as transformers routes, experts kept quantized, and what expert parallelism refuses."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import needs_cpu_backend
from flax import nnx
from test_parity import chunked_logits

from jaxserve.models import abstract_model
from jaxserve.models.config import ModelConfig
from jaxserve.models.moe import route
from jaxserve.worker.weights import load_weights


def test_dense_layers_and_the_shared_expert_follow_the_config(hf_checkpoint):
    _, model_dir = hf_checkpoint("qwen2-moe")  # mlp_only_layers [0], a shared expert
    layers = nnx.state(abstract_model(ModelConfig.from_hf(model_dir), jnp.float32))["layers"]
    assert "experts" not in layers[0]["mlp"] and layers[0]["mlp"]["down_proj"]["weight"].shape == (64, 128)
    mlp = layers[1]["mlp"]
    assert mlp["experts"]["gate_proj"]["weight"].shape == (3, 64, 64)
    assert mlp["shared_expert"]["down_proj"]["weight"].shape == (64, 96)
    assert mlp["shared_expert_gate"]["weight"].shape == (1, 64)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_routing_matches_transformers_router(arch, hf_checkpoint):
    model, _ = hf_checkpoint(arch)
    block = model.model.layers[1].mlp
    x = torch.randn(50, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, want_weights, want_experts = block.gate(x)
    weights, experts = route(jnp.asarray(logits.numpy()), block.gate.top_k, arch != "qwen2-moe")
    np.testing.assert_array_equal(np.asarray(experts), want_experts.numpy())
    np.testing.assert_allclose(np.asarray(weights), want_weights.numpy(), atol=1e-6, rtol=0)


def test_int8_keeps_the_experts_quantized_and_the_router_in_floats(hf_checkpoint):
    model, model_dir = hf_checkpoint("qwen3-moe")
    _, state = load_weights(model_dir, ModelConfig.from_hf(model_dir), "float32", quantization="int8")
    mlp = state["layers"][0]["mlp"]
    assert mlp["experts"]["down_proj"]["weight"][...].dtype == jnp.int8
    assert mlp["experts"]["down_proj"]["scales"][...].shape == (5, 64, 2)
    assert mlp["gate"]["weight"][...].dtype == jnp.float32
    ids = np.random.default_rng(1).integers(0, 256, size=24).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    got = chunked_logits(model_dir, ids, [24], quantization="int8")
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_expert_parallel_needs_experts_that_divide_over_the_devices(hf_checkpoint):
    _, moe_dir = hf_checkpoint("qwen3-moe")  # 5 experts
    cfg = ModelConfig.from_hf(moe_dir)
    assert cfg.num_experts == 5 and not cfg.expert_parallel
    assert cfg.parallel(False, 2) is cfg and cfg.parallel(True, 5).expert_parallel
    with pytest.raises(ValueError, match="5 experts do not split evenly over tensor_parallel_size=2"):
        cfg.parallel(True, 2)
    _, dense_dir = hf_checkpoint("llama")
    with pytest.raises(ValueError, match="LlamaForCausalLM has no experts"):
        ModelConfig.from_hf(dense_dir).parallel(True, 1)


def test_bfloat16_experts_are_kept_as_raw_bits_on_cpu(hf_checkpoint):
    """On CPU a bfloat16 stack of experts is kept as its raw bits (`kept_as_bits`: XLA would widen
    the whole stack to index one expert); the router stays bfloat16 values, and the logits stay
    within bfloat16's error of float32's."""
    from jaxserve_kernels.matmul.grouped import BITS

    needs_cpu_backend()

    _, model_dir = hf_checkpoint("qwen3-moe")
    _, state = load_weights(model_dir, ModelConfig.from_hf(model_dir), "bfloat16")
    assert state["layers"][0]["mlp"]["experts"]["up_proj"]["weight"][...].dtype == BITS
    assert state["layers"][0]["mlp"]["gate"]["weight"][...].dtype == jnp.bfloat16
    ids = np.random.default_rng(2).integers(0, 256, size=24).tolist()
    want = chunked_logits(model_dir, ids, [24])
    got = chunked_logits(model_dir, ids, [24], dtype="bfloat16")
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max(), np.abs(got - want).max()
