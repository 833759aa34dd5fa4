"""A request's view into the model's residual stream: hidden states it asks back
(`HiddenStatesRequest`) and steering vectors it adds (`SteeringVector`), as `SamplingParams` holds them.

Layers are the model's decoder layers, 0-based; layer i's point is the residual stream after the
layer (after its MLP's residual add), before the final norm: transformers' `hidden_states[i + 1]`.
"final" is the final norm's output, what the LM head reads. Negative layers count from the end (-1:
the last layer). The engine resolves them against the model (`resolve_layers`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses

import numpy as np

from jaxserve.errors import RequestError

POSITIONS = ("last", "all", "output")
ENCODINGS = ("base64", "float")
FINAL = "final"


def decode_vector(value, field: str) -> np.ndarray:
    """A vector given as a list of numbers or as base64 of little-endian float32 -> f32[n]."""
    if isinstance(value, np.ndarray):
        vector = value.astype(np.float32).reshape(-1)
    elif isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"{field}: not valid base64", field) from None
        if len(raw) % 4:
            raise RequestError(f"{field}: base64 of little-endian float32 values must be a multiple of 4 bytes", field)
        vector = np.frombuffer(raw, "<f4").astype(np.float32)
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  for v in value):
        vector = np.asarray(value, np.float32)
    else:
        raise RequestError(f"{field} must be a list of numbers or base64 of little-endian float32", field)
    if not np.isfinite(vector).all():
        raise RequestError(f"{field} holds a value that is not finite", field)
    return vector


def encode_array(array: np.ndarray) -> str:
    """base64 of little-endian float32 values."""
    return base64.b64encode(np.ascontiguousarray(array, "<f4").tobytes()).decode()


@dataclasses.dataclass(frozen=True)
class HiddenStatesRequest:
    """Which hidden states a request wants back per choice: `layers` (ints, "final", or "all": every
    decoder layer) at `positions`: "last" (the prompt's last token: what predicts the first output
    token), "all" (every prompt token, then each output token but the last, which is never fed
    back), or "output" (per output token, the position whose logits sampled it). `encoding`: how the
    HTTP API returns them (base64 little-endian float32, or float: JSON lists)."""

    layers: tuple = (-1,)
    positions: str = "last"
    encoding: str = "base64"

    @classmethod
    def of(cls, value) -> HiddenStatesRequest | None:
        """From a request's field: None/False (none), True (the last layer at the last position), a
        dict of the fields, or an instance."""
        field = "return_hidden_states"
        if value is None or value is False or isinstance(value, cls):
            return value or None
        if value is True:
            return cls()
        if not isinstance(value, dict) or set(value) - {"layers", "positions", "encoding", "encoding_format"}:
            raise RequestError(f"{field} must be true or an object of layers, positions and encoding", field)
        layers = value.get("layers", [-1])
        if layers == "all":
            layers = ("all",)
        elif isinstance(layers, (int, str)) and not isinstance(layers, bool):
            layers = (layers,)
        if not isinstance(layers, (list, tuple)) or not layers or not all(
                (isinstance(v, int) and not isinstance(v, bool)) or v == FINAL for v in layers):
            raise RequestError(f'{field}.layers must be "all" or a non-empty list of layer indices (negative from '
                               f'the end) and "final"', field)
        positions = value.get("positions", "last")
        if positions not in POSITIONS:
            raise RequestError(f"{field}.positions must be one of {', '.join(POSITIONS)}, got {positions!r}", field)
        encoding = value.get("encoding", value.get("encoding_format", "base64"))
        if encoding not in ENCODINGS:
            raise RequestError(f"{field}.encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}", field)
        return cls(layers=tuple(layers), positions=positions, encoding=encoding)

    def wants(self, position: int, num_prompt_tokens: int) -> bool:
        """Whether the hidden states at `position` (of prompt + output) are asked for."""
        last_prompt = num_prompt_tokens - 1
        return {"last": position == last_prompt, "all": True, "output": position >= last_prompt}[self.positions]


@dataclasses.dataclass(frozen=True)
class SteeringVector:
    """One vector added to the residual stream after `layer` (see the module's note), times `scale`:
    given as `vector` (a list, base64 of little-endian float32, or an array; the model's hidden
    size), or by `name` (one of the engine's --steering-vectors; a control-vector file's own layers
    apply when `layer` is left out)."""

    layer: int | None = None
    vector: np.ndarray | None = dataclasses.field(default=None, compare=False)
    name: str | None = None
    scale: float = 1.0

    @classmethod
    def of(cls, value, i: int) -> SteeringVector:
        field = f"steering[{i}]"
        if isinstance(value, cls):
            value = dataclasses.asdict(value)
        if not isinstance(value, dict) or set(value) - {"layer", "vector", "name", "scale"}:
            raise RequestError(f"{field} must be an object of layer, vector (or name) and scale", "steering")
        layer, scale, name = value.get("layer"), value.get("scale", 1.0), value.get("name")
        if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool)):
            raise RequestError(f"{field}.layer must be an integer, got {layer!r}", "steering")
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not np.isfinite(scale):
            raise RequestError(f"{field}.scale must be a number, got {scale!r}", "steering")
        if (value.get("vector") is None) == (name is None):
            raise RequestError(f"{field} needs a vector or the name of a registered one (one of them)", "steering")
        if name is not None and not isinstance(name, str):
            raise RequestError(f"{field}.name must be a string", "steering")
        vector = None if name is not None else decode_vector(value["vector"], f"{field}.vector")
        if vector is not None and layer is None:
            raise RequestError(f"{field}.layer is required with a vector", "steering")
        return cls(layer=layer, vector=vector, name=name, scale=float(scale))


@dataclasses.dataclass(frozen=True)
class Steering:
    """A request's steering as the engine resolved it (`engine.steering.SteeringLibrary`): f32[L,
    hidden] the sum added after each layer, the engine's control vectors included; `key`, a digest
    of it and of `prompt` (equal steerings share a device slot and prefix-cache pages); `prompt`:
    whether the prompt's positions get it too."""

    table: np.ndarray = dataclasses.field(compare=False, repr=False)
    key: bytes
    prompt: bool = True


def resolve_layer(layer, num_layers: int, field: str) -> int:
    """A layer as a request gives it -> 0..num_layers - 1, or num_layers for "final"."""
    if layer == FINAL:
        return num_layers
    if not -num_layers <= layer < num_layers:
        raise RequestError(f"{field}: layer {layer} is out of range for a model of {num_layers} layers "
                           f"([{-num_layers}, {num_layers - 1}], or \"final\")", field)
    return layer % num_layers


def resolve_layers(request: HiddenStatesRequest, num_layers: int) -> tuple[int, ...]:
    """The layers a request asks for, resolved (`resolve_layer`), in the order given ("all": 0..L-1)."""
    if request.layers == ("all",):
        return tuple(range(num_layers))
    layers = [resolve_layer(v, num_layers, "return_hidden_states") for v in request.layers]
    if len(set(layers)) != len(layers):
        raise RequestError("return_hidden_states.layers names a layer twice", "return_hidden_states")
    return tuple(layers)


__all__ = ["ENCODINGS", "FINAL", "POSITIONS", "HiddenStatesRequest", "Steering", "SteeringVector", "decode_vector",
           "encode_array", "resolve_layer", "resolve_layers"]
