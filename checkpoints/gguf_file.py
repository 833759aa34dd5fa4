"""A GGUF file's header, read directly: its architecture and the index of its tensors (name, type,
shape, where its bytes lie). The metadata values come from gguf's own reader (`metadata`), which
decodes every value (the whole vocabulary) and so is used once, to build a model view."""

from __future__ import annotations

import functools
import math
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_STRING, _ARRAY, _ALIGNMENT = 8, 9, 32  # GGUF's value types for strings and arrays; its default alignment


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def gguf_file(model: Path) -> Path | None:
    """The GGUF file `model` names: the file itself, or the only one in a directory without
    config.json."""
    if is_gguf(model):
        return model
    if model.is_dir() and not (model / "config.json").is_file():
        files = sorted(model.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(f"{model} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}): "
                             "name one")
        return files[0] if files else None
    return None


@functools.cache
def reader(path: Path):
    from gguf import GGUFReader

    return GGUFReader(path)


class Tensor(NamedTuple):
    """A tensor of a GGUF file, its data a view of the file's memory map."""

    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # F32 and F16: the values in their logical shape; other types: their bytes, by row
    n_bytes: int


# GGUF's metadata value types of a fixed size (by type id): what `tensors` steps over
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def tensors(path: Path) -> tuple[Tensor, ...]:
    """The file's tensors, from its header read here (GGUF v2 and v3, little-endian): gguf's reader
    also decodes every metadata value, a vocabulary's 100 k strings among them (seconds), which
    loading the weights does not need."""
    return header(path)[1]


def architecture(path: Path) -> str | None:
    """The file's general.architecture, from its header as `tensors` reads it."""
    return header(path)[0]


@functools.cache
def header(path: Path) -> tuple[str | None, tuple[Tensor, ...]]:
    """(general.architecture, the tensors): see `tensors`."""
    data = np.memmap(path, mode="r")
    view = memoryview(data)
    magic, version, count, kv_count = struct.unpack_from("<4sIQQ", view, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path} is not a little-endian GGUF file of version 2 or 3")
    offset, alignment, arch = 24, _ALIGNMENT, None

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", view, at)
        return bytes(view[at + 8:at + 8 + length]).decode(), at + 8 + length

    def skip(kind: int, at: int) -> int:
        if kind == _STRING:
            return at + 8 + struct.unpack_from("<Q", view, at)[0]
        if kind != _ARRAY:
            return at + _VALUE_SIZES[kind]
        item, items = struct.unpack_from("<IQ", view, at)
        at += 12
        if item != _STRING and item != _ARRAY:
            return at + items * _VALUE_SIZES[item]
        for _ in range(items):
            at = skip(item, at)
        return at

    for _ in range(kv_count):
        key, offset = string(offset)
        (kind,) = struct.unpack_from("<I", view, offset)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", view, offset + 4)
        elif key == "general.architecture" and kind == _STRING:
            arch = string(offset + 4)[0]
        offset = skip(kind, offset + 4)
    infos = []
    for _ in range(count):
        name, offset = string(offset)
        (dims,) = struct.unpack_from("<I", view, offset)
        shape = struct.unpack_from(f"<{dims}Q", view, offset + 4)
        kind, start = struct.unpack_from("<IQ", view, offset + 4 + 8 * dims)
        infos.append((name, GGMLQuantizationType(kind), tuple(reversed(shape)), start))
        offset += 4 + 8 * dims + 12
    base = -(-offset // alignment) * alignment
    out = []
    for name, kind, shape, start in infos:
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes = math.prod(shape) * size // block
        raw = data[base + start:base + start + n_bytes]
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            value = raw.view(np.float32 if kind == GGMLQuantizationType.F32 else np.float16).reshape(shape)
        else:
            value = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        out.append(Tensor(name, kind, value, n_bytes))
    return arch, tuple(out)


def metadata(path: Path) -> dict:
    """The file's key-value metadata (arrays of tokens and merges included)."""
    return {key: field.contents() for key, field in reader(path).fields.items()}
