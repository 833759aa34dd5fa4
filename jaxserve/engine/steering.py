"""Steering vectors as the engine resolves them: llama.cpp's control-vector files, the named vectors
of --steering-vectors, and a request's own, summed into one table per request (`Steering`).

A control-vector file is llama.cpp's: a GGUF file of F32 tensors `direction.N` (N >= 1), each of the
model's hidden size, added to the residual stream after layer N (0-based: llama.cpp's `il`, after the
layer's MLP residual add). As llama.cpp's server does, `--control-vector` files are added at scale 1,
`--control-vector-scaled` files at their scale, all summed, and applied to the layers in
`--control-vector-layer-range` (inclusive; by default 1 to the last).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from jaxserve.errors import RequestError
from jaxserve.models.config import ModelConfig
from jaxserve.sample.params import SamplingParams
from jaxserve.sample.residual import Steering, resolve_layer
from jaxserve.worker.steering import steering_slots


def read_control_vector(path: str | Path, cfg: ModelConfig) -> dict[int, np.ndarray]:
    """A llama.cpp control-vector file -> layer -> f32[hidden] (ValueError for another model's)."""
    import gguf

    directions = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if not tensor.name.startswith("direction."):
            continue
        layer = int(tensor.name.split(".", 1)[1])
        vector = np.asarray(tensor.data, np.float32).reshape(-1)
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32 or vector.shape != (cfg.hidden_size,):
            raise ValueError(f"{path}: {tensor.name} must be F32 of the model's hidden size {cfg.hidden_size}")
        if not 1 <= layer < cfg.num_layers:
            raise ValueError(f"{path}: {tensor.name} is past the model's layers (1 to {cfg.num_layers - 1})")
        directions[layer] = vector
    if not directions:
        raise ValueError(f"{path}: no direction.N tensors: not a control-vector file")
    return directions


def read_named_vector(path: str | Path, cfg: ModelConfig) -> np.ndarray | dict[int, np.ndarray]:
    """A --steering-vectors file: a .npy vector of the hidden size, or a control-vector .gguf."""
    if str(path).endswith(".gguf"):
        return read_control_vector(path, cfg)
    vector = np.load(path).astype(np.float32)
    if vector.shape != (cfg.hidden_size,):
        raise ValueError(f"{path}: a steering vector of shape {vector.shape}, the model's hidden size is "
                         f"{cfg.hidden_size}")
    return vector


class SteeringLibrary:
    """The engine's control vectors (summed, `control`: f32[L, hidden] or None) and named vectors."""

    def __init__(self, config, cfg: ModelConfig):
        self.model = cfg
        self.enabled = steering_slots(config) > 0
        self.named: dict[str, np.ndarray | dict[int, np.ndarray]] = {}
        for entry in config.steering_vectors:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"steering_vectors: {entry!r} is not name=file")
            self.named[name] = read_named_vector(path, cfg)
        files = [(path, 1.0) for path in config.control_vector]
        scaled = list(config.control_vector_scaled)
        if len(scaled) % 2:
            raise ValueError("control_vector_scaled takes FILE SCALE pairs")
        files += [(path, float(scale)) for path, scale in zip(scaled[::2], scaled[1::2])]
        self.control = None
        if files:
            start, end = config.control_vector_layer_range or (1, cfg.num_layers)
            self.control = np.zeros((cfg.num_layers, cfg.hidden_size), np.float32)
            for path, scale in files:
                for layer, vector in read_control_vector(path, cfg).items():
                    if start <= layer <= end:
                        self.control[layer] += scale * vector
        if (self.named or self.control is not None) and not self.enabled:
            raise ValueError("steering vectors and control vectors need max_steering_slots >= 1 (and neither "
                             "batch_invariant nor a multi-host mesh)")

    def resolve(self, params: SamplingParams) -> Steering | None:
        """The request's steering (its vectors and the control vectors), or None: neither. RequestError
        for a vector the engine cannot add."""
        if not params.steering and self.control is None:
            return None
        if not self.enabled:
            raise RequestError("steering: this engine steers nothing (it needs max_steering_slots >= 1, and neither "
                               "batch_invariant nor a multi-host mesh)", "steering")
        cfg = self.model
        table = np.zeros((cfg.num_layers, cfg.hidden_size), np.float32) if self.control is None else self.control.copy()
        for i, entry in enumerate(params.steering or ()):
            field = f"steering[{i}]"
            vector = entry.vector
            if entry.name is not None:
                if entry.name not in self.named:
                    raise RequestError(f"{field}: no steering vector named {entry.name!r} (the engine has: "
                                       f"{', '.join(sorted(self.named)) or 'none'})", "steering")
                vector = self.named[entry.name]
                if isinstance(vector, dict):
                    layers = vector if entry.layer is None else {entry.layer: vector.get(entry.layer)}
                    for layer, direction in layers.items():
                        if direction is None:
                            raise RequestError(f"{field}: {entry.name!r} has no direction at layer {layer}", "steering")
                        table[resolve_layer(layer, cfg.num_layers, "steering")] += entry.scale * direction
                    continue
                if entry.layer is None:
                    raise RequestError(f"{field}.layer is required with the vector {entry.name!r}", "steering")
            if vector.shape != (cfg.hidden_size,):
                raise RequestError(f"{field}.vector has {vector.size} values, the model's hidden size is "
                                   f"{cfg.hidden_size}", "steering")
            table[resolve_layer(entry.layer, cfg.num_layers, "steering")] += entry.scale * vector
        key = hashlib.sha256(table.tobytes() + bytes([params.steer_prompt])).digest()
        return Steering(table=table, key=key, prompt=params.steer_prompt)
