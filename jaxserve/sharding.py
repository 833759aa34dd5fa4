"""Tensor parallelism: one Mesh axis ("model") over the first `tensor_parallel_size` devices,
and the partition rules that place every weight and the KV pages on it.

Sharding is declarative: arrays carry `NamedSharding`s and XLA inserts the
collectives, so the model code is the same for 1 or N devices.

Rules (Megatron-style; the HF name map's paths, kernels stored [in, out]):
- q/k/v projections column-parallel (output split over heads), o projection row-parallel;
- MLP gate/up column-parallel, down row-parallel;
- embedding split over the hidden size, the LM head over the vocabulary (the logits
  come out vocab-sharded; the sampler's sort and draws are global ops on them);
- norms replicated;
- KV pages split over KV heads.
A dimension is only split when its heads (or size) divide evenly over the mesh;
otherwise that array is replicated (e.g. 2 KV heads on 8 devices).
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig

AXIS = "model"

# (decoder state path pattern, partition spec, the count that must divide the mesh size)
PARTITION_RULES = [
    (r"layers\.\d+\.self_attn\.q_proj\.kernel", P(None, AXIS), "num_heads"),
    (r"layers\.\d+\.self_attn\.q_proj\.bias", P(AXIS), "num_heads"),
    (r"layers\.\d+\.self_attn\.[kv]_proj\.kernel", P(None, AXIS), "num_kv_heads"),
    (r"layers\.\d+\.self_attn\.[kv]_proj\.bias", P(AXIS), "num_kv_heads"),
    (r"layers\.\d+\.self_attn\.o_proj\.kernel", P(AXIS, None), "num_heads"),
    (r"layers\.\d+\.mlp\.(gate|up)_proj\.kernel", P(None, AXIS), "intermediate_size"),
    (r"layers\.\d+\.mlp\.(gate|up)_proj\.bias", P(AXIS), "intermediate_size"),
    (r"layers\.\d+\.mlp\.down_proj\.kernel", P(AXIS, None), "intermediate_size"),
    (r"embed_tokens\.embedding", P(None, AXIS), "hidden_size"),
    (r"lm_head\.kernel", P(None, AXIS), "vocab_size"),
]


def make_mesh(tensor_parallel_size: int) -> Mesh:
    devices = jax.devices()
    if not 1 <= tensor_parallel_size <= len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but there are {len(devices)} devices "
                         f"({jax.default_backend()})")
    return Mesh(np.array(devices[:tensor_parallel_size]), (AXIS,))


def weight_sharding(mesh: Mesh, path: str, cfg: ModelConfig) -> NamedSharding:
    """The sharding of the decoder weight at `path` (replicated unless a rule splits it evenly)."""
    size = mesh.shape[AXIS]
    for pattern, spec, count in PARTITION_RULES:
        if re.fullmatch(pattern, path):
            return NamedSharding(mesh, spec if getattr(cfg, count) % size == 0 else P())
    return NamedSharding(mesh, P())


def kv_sharding(mesh: Mesh, cfg: ModelConfig) -> NamedSharding:
    """KV pages [num_pages, page_size, num_kv_heads, head_dim]: split over KV heads when they divide."""
    split = cfg.num_kv_heads % mesh.shape[AXIS] == 0
    return NamedSharding(mesh, P(None, None, AXIS, None) if split else P())


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device of the mesh holds the whole array (the step's host inputs)."""
    return NamedSharding(mesh, P())
