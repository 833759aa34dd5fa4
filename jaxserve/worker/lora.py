"""LoRA adapters on the device: a fixed number of slots (`--max-loras`) per adaptable layer, filled
from host memory as steps need them.

Every adaptable layer (`models.ADAPTABLE`) has stacks A [S, R, in] and B [S, out, R] in the
activations' dtype (R = `--max-lora-rank`; an adapter of a lower rank, or one that leaves a layer
alone, is zero-padded), whatever the base weights' format. The stacks are arguments of the step
(`attach_adapters`), so loading an adapter into a slot changes data, never a shape: no step
compiles again, and the one write function compiles once, at start. Slots are reused least
recently used first, never while a running sequence needs them: the scheduler admits at most
`max_loras` adapters' sequences at once (`Scheduler`), so a step's adapters always fit.

Under tensor parallelism each stack is split like the layer it adapts: a column-parallel layer's
B over its outputs, a row-parallel layer's A over its inputs; the other half is replicated.
`AdapterStore` keeps adapters read from their files in host memory (`--max-cpu-loras`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from checkpoints.lora import LoraWeights, read_adapter
from jaxserve.config.lora import LoRARequest
from jaxserve.worker.slots import LruSlots
from jaxserve.models import MODEL_REGISTRY, abstract_model, adaptable_modules
from jaxserve.models.config import ModelConfig
from jaxserve.worker.sharding import weight_sharding


def adaptable_shapes(cfg: ModelConfig, dtype) -> dict[str, tuple[int, int]]:
    """Module path -> (out, in) of every layer that takes an adapter."""
    return {path: tuple(module.weight.shape) for path, module in adaptable_modules(abstract_model(cfg, dtype)).items()}


def adapter_bytes(cfg: ModelConfig, dtype, slots: int, rank: int) -> int:
    """The device memory of the slots' stacks (as one logical array)."""
    shapes = adaptable_shapes(cfg, dtype)
    return slots * rank * sum(out + width for out, width in shapes.values()) * jnp.dtype(dtype).itemsize


class AdapterStore:
    """Adapters read from their files, in host memory: the `capacity` most recently used (by
    `LoRARequest.lora_int_id`), and those pinned. Any thread may call it (the API checks an adapter
    as it loads)."""

    def __init__(self, cfg: ModelConfig, shapes: dict[str, tuple[int, int]], max_rank: int, capacity: int):
        self.hf_name_map = MODEL_REGISTRY[cfg.architecture].hf_name_map
        self.heads = cfg.num_heads, cfg.num_kv_heads
        self.shapes, self.max_rank, self.capacity = shapes, max_rank, capacity
        self._held: collections.OrderedDict[int, LoraWeights] = collections.OrderedDict()
        self._pinned: set[int] = set()  # (never evicted)
        self._lock = threading.Lock()

    def get(self, request: LoRARequest) -> LoraWeights:
        """The adapter's weights, read on first use; ValueError (saying why) for one this model
        cannot serve: unreadable, of a rank past --max-lora-rank, of layers it lacks or of other shapes."""
        with self._lock:
            if request.lora_int_id in self._held:
                self._held.move_to_end(request.lora_int_id)
                return self._held[request.lora_int_id]
        weights = self._read(request)
        with self._lock:
            self._held[request.lora_int_id] = weights
            evictable = [i for i in self._held if i not in self._pinned]
            for i in evictable[:max(0, len(self._held) - self.capacity)]:
                del self._held[i]
        return weights

    def held(self) -> set[int]:
        with self._lock:
            return set(self._held)

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (read again if a request names it) -> whether it was held."""
        with self._lock:
            self._pinned.discard(lora_int_id)
            return self._held.pop(lora_int_id, None) is not None

    def pin(self, lora_int_id: int) -> None:
        """Never evict the adapter (held now, else ValueError)."""
        with self._lock:
            if lora_int_id not in self._held:
                raise ValueError(f"Pinning failed. LoRA {lora_int_id} is not registered.")
            self._pinned.add(lora_int_id)

    def _read(self, request: LoRARequest) -> LoraWeights:
        where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
        try:
            weights = read_adapter(request.lora_path, self.hf_name_map, self.shapes, self.heads)
        except (OSError, KeyError) as e:
            raise ValueError(f"{where} could not be read: {e}") from e
        if weights.rank > self.max_rank:
            raise ValueError(f"{where} has rank {weights.rank}, past --max-lora-rank {self.max_rank}: raise it")
        for path, (a, b) in weights.layers.items():
            out, width = self.shapes[path]
            if a.shape[1] != width or b.shape[0] != out:
                raise ValueError(f"{where}: layer {path} is [{b.shape[0]}, {a.shape[1]}] in the adapter but "
                                 f"[{out}, {width}] in the model: it adapts another model")
        return weights


def adapter_slots(cfg: ModelConfig, config, mesh: Mesh) -> AdapterSlots | None:
    """The slots an engine of `config` (an `EngineConfig`) serves adapters from; None without enable_lora."""
    if not config.enable_lora:
        return None
    if jax.process_count() > 1:
        raise ValueError("enable_lora: LoRA adapters are served by one host's replicas only")
    store = AdapterStore(cfg, adaptable_shapes(cfg, config.dtype), config.max_lora_rank, config.cpu_loras)
    return AdapterSlots(cfg, config.max_loras, config.max_lora_rank, config.dtype, mesh, store)


def _write_slot(stacks: dict, slot: jax.Array, new: dict) -> dict:
    return {path: (a.at[slot].set(new[path][0].astype(a.dtype)), b.at[slot].set(new[path][1].astype(b.dtype)))
            for path, (a, b) in stacks.items()}


class AdapterSlots:
    """The device's adapter slots: `stacks` (module path -> (A, B), a step argument) and which
    adapter each slot holds."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype, mesh: Mesh, store: AdapterStore):
        self.num_slots, self.max_rank, self.dtype, self.store = num_slots, max_rank, jnp.dtype(dtype), store
        rules = MODEL_REGISTRY[cfg.architecture].rules(cfg)
        shardings, stacks = {}, {}
        for path, (out, width) in store.shapes.items():
            split = weight_sharding(mesh, f"{path}.weight", cfg, rules, (out, width)).spec
            rows, cols = (tuple(split) + (None, None))[:2]
            shardings[path] = (NamedSharding(mesh, P(None, None, cols)), NamedSharding(mesh, P(None, rows, None)))
            stacks[path] = (jnp.zeros((num_slots, max_rank, width), self.dtype, device=shardings[path][0]),
                            jnp.zeros((num_slots, out, max_rank), self.dtype, device=shardings[path][1]))
        self._write = jax.jit(_write_slot, out_shardings=shardings)
        self._slots = LruSlots(num_slots, "LoRA adapters")
        self.stacks = self._write(stacks, 0, self._padded(None))  # (compiles the write now, not while serving)

    def _padded(self, weights: LoraWeights | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """One slot's contents: each layer's A [R, in] and B [out, R], zeros past the adapter's rank
        and for the layers it leaves alone."""
        new = {}
        for path, (out, width) in self.store.shapes.items():
            a, b = np.zeros((self.max_rank, width), np.float32), np.zeros((out, self.max_rank), np.float32)
            if weights is not None and path in weights.layers:
                la, lb = weights.layers[path]
                a[:la.shape[0]], b[:, :lb.shape[1]] = la, lb
            new[path] = a, b
        return new

    def assign(self, requests: Iterable[LoRARequest]) -> dict[int, int]:
        """Adapter id -> slot for the adapters of a step (at most num_slots), loading those not in a
        slot (`LruSlots`)."""
        def load(slot: int, request: LoRARequest) -> None:
            self.stacks = self._write(self.stacks, slot, self._padded(self.store.get(request)))

        return self._slots.assign({request.lora_int_id: request for request in requests}, load)


__all__ = ["AdapterSlots", "AdapterStore", "adaptable_shapes", "adapter_bytes", "adapter_slots"]
