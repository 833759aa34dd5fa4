"""Steering vectors on the device: a fixed number of slots (`--max-steering-slots`), each one
steering's vectors for every layer, filled from the requests' resolved steerings as steps need them.

The table [L, S + 1, hidden] (activations' dtype, replicated) is an argument of the step; each token
row carries its slot, and slot S, always zeros, is the rows without steering (`Decoder.run`). Writing
a slot changes data, never a shape: the one write function compiles at start, and no step compiles
because of steering. The scheduler admits at most S distinct steerings at once (`sched.limits`).
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.models.config import ModelConfig
from jaxserve.sample.residual import Steering
from jaxserve.worker.slots import LruSlots


def steering_slots(config) -> int:
    """The steering slots an engine of `config` (an `EngineConfig`) has: none on a multi-host mesh,
    whose other processes would not see the slots written (a replica per host serves steering)."""
    return 0 if jax.process_count() > 1 else config.residual_limits[1]


def _write_slot(table: jax.Array, slot: jax.Array, vectors: jax.Array) -> jax.Array:
    return table.at[:, slot].set(vectors.astype(table.dtype))


class SteeringSlots:
    def __init__(self, cfg: ModelConfig, num_slots: int, dtype, replicated: NamedSharding):
        self.num_slots = num_slots
        self._write = jax.jit(_write_slot, out_shardings=replicated)
        self._slots = LruSlots(num_slots, "steerings")
        zeros = np.zeros((cfg.num_layers, cfg.hidden_size), np.float32)
        table = jnp.zeros((cfg.num_layers, num_slots + 1, cfg.hidden_size), dtype, device=replicated)
        self.table = self._write(table, num_slots, zeros)  # (compiles the write now, not while serving)

    def assign(self, steerings: Iterable[Steering]) -> dict[bytes, int]:
        """Steering key -> slot for the steerings of a step (at most num_slots)."""
        def load(slot: int, steering: Steering) -> None:
            self.table = self._write(self.table, slot, steering.table)

        return self._slots.assign({steering.key: steering for steering in steerings}, load)


__all__ = ["SteeringSlots", "steering_slots"]
