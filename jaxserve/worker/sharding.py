"""Tensor parallelism: one Mesh axis ("model") over the first `tensor_parallel_size` devices,
and the partition rules that place every weight and the KV pages on it.

Sharding is declarative: arrays carry `NamedSharding`s and XLA inserts the
collectives, so the model code is the same for 1 or N devices.

Each family lists the rules for its weights beside its model (`ModelFamily.partition_rules`,
e.g. Megatron-style in `jaxserve/models/llama.py`: the logits come out vocab-sharded, and the
sampler's sort and draws are global ops on them); the KV pages are split over KV heads.
A dimension is only split when its heads (or size) divide evenly over the mesh;
otherwise that array is replicated (e.g. 2 KV heads on 8 devices).

Across hosts (`initialize_distributed`), `jax.devices()` lists every process's devices and
the mesh spans them all; process 0 plans the steps and broadcasts each plan
(`broadcast_plan`), and every process runs the same jitted step on it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.models.config import ModelConfig
from jaxserve_kernels import AXIS


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, heartbeat_timeout_s: int = 100) -> None:
    """Join the processes of a multi-host run (`jax.distributed.initialize`), before JAX touches a device.
    With no arguments JAX reads them from the environment (TPU VMs, SLURM). A process that stops sending
    heartbeats for `heartbeat_timeout_s` makes every other process exit with an error."""
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)


def is_leader() -> bool:
    """Process 0 runs the scheduler (and the API); the others only follow its steps."""
    return jax.process_index() == 0


def broadcast_plan(tree):
    """Process 0's pytree of host arrays, on every process (each passes a pytree of the same shapes)."""
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(np.array, multihost_utils.broadcast_one_to_all(tree))  # writeable copies


def place(arrays, sharding: NamedSharding):
    """Host arrays (one, or a list; the same on every process) onto `sharding`: each device receives
    only its shard. A list goes in one transfer (fewer transfers cost less host time per step).
    Across processes each one fills its own devices (`device_put` would first compare the whole
    array between the processes, a collective per array)."""
    if jax.process_count() == 1:
        return jax.device_put(arrays, sharding)
    return jax.tree.map(lambda array: jax.make_array_from_callback(array.shape, sharding, lambda index: array[index]),
                        arrays)


def make_mesh(tensor_parallel_size: int, replica: int = 0, replicas: int = 1) -> Mesh:
    """The mesh of data-parallel replica `replica` of `replicas`: its own run of tensor_parallel_size devices."""
    devices = jax.devices()
    wanted = tensor_parallel_size * replicas
    if not 1 <= wanted <= len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}" + (
            f" x data_parallel_size={replicas}" if replicas > 1 else "") + f" but there are {len(devices)} devices "
            f"({jax.default_backend()})")
    if jax.process_count() > 1 and replicas > 1:
        raise ValueError("data parallelism over several processes runs a replica per process group: use "
                         "--data-parallel-backend ray")
    if jax.process_count() > 1 and tensor_parallel_size != len(devices):
        raise ValueError(f"with {jax.process_count()} processes the mesh must span all {len(devices)} devices: "
                         f"set --tensor-parallel-size {len(devices)}")
    start = replica * tensor_parallel_size
    return Mesh(np.array(devices[start:start + tensor_parallel_size]), (AXIS,))


def weight_sharding(mesh: Mesh, path: str, cfg: ModelConfig, rules: Sequence[tuple[str, P, str]],
                    shape: Sequence[int] = ()) -> NamedSharding:
    """The sharding of the weight at `path`: the first of `rules` (parameter path pattern, spec, the
    count that must divide the mesh size: a ModelConfig field, else one of its family's options)
    that matches, else replicated; replicated too where the count, or a split dimension of `shape`
    (a quantized matrix's blocks), does not divide."""
    size = mesh.shape[AXIS]
    for pattern, spec, count in rules:
        if re.fullmatch(pattern, path):
            number = getattr(cfg, count) if hasattr(cfg, count) else getattr(cfg.options, count)
            divides = number % size == 0 and all(
                shape[dim] % size == 0 for dim, axis in enumerate(spec) if axis is not None and dim < len(shape))
            return NamedSharding(mesh, spec if divides else P())
    return NamedSharding(mesh, P())


def kv_sharding(mesh: Mesh, cfg: ModelConfig) -> NamedSharding:
    """KV pages [num_pages, page_size, num_kv_heads, head_dim]: split over KV heads when they divide."""
    split = cfg.num_kv_heads % mesh.shape[AXIS] == 0
    return NamedSharding(mesh, P(None, None, AXIS, None) if split else P())


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
