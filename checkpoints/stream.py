"""Tensors read from a safetensors file as its bytes arrive (an HTTP body), each one as soon as all
of its bytes are in, so that what holds the stream never holds more than one tensor of it.

The format: 8 bytes (little-endian u64) give the header's length; the header is JSON,
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}; the tensors'
bytes follow, at those offsets from the header's end (`safetensors.numpy.save` writes them in
order). What `safetensors.numpy.save(tensors)` returns is such a stream.
"""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


class SafetensorsStream:
    """`feed` it the stream's bytes in any pieces -> the (name, array) pairs completed so far."""

    def __init__(self):
        self._buffer = bytearray()
        self._pending: list[tuple[str, np.dtype, tuple, int, int]] | None = None  # by offset, once the header is in
        self._read = 0  # bytes of the tensor data consumed (dropped from the buffer)

    def feed(self, data: bytes) -> list[tuple[str, np.ndarray]]:
        self._buffer += data
        if self._pending is None and not self._read_header():
            return []
        out = []
        while self._pending:
            name, dtype, shape, begin, end = self._pending[0]
            if begin != self._read:
                raise ValueError(f"safetensors stream: tensor {name!r} does not start where the one before it ended")
            if len(self._buffer) < end - begin:
                break
            array = np.frombuffer(bytes(self._buffer[:end - begin]), dtype).reshape(shape)
            del self._buffer[:end - begin]
            self._read = end
            self._pending.pop(0)
            out.append((name, array))
        return out

    def _read_header(self) -> bool:
        if len(self._buffer) < 8:
            return False
        (size,) = struct.unpack("<Q", self._buffer[:8])
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"safetensors stream: a header of {size} bytes (the limit is {MAX_HEADER_BYTES})")
        if len(self._buffer) < 8 + size:
            return False
        try:
            header = json.loads(bytes(self._buffer[8:8 + size]))
        except ValueError as e:
            raise ValueError(f"safetensors stream: the header is not JSON: {e}") from e
        if not isinstance(header, dict):
            raise ValueError("safetensors stream: the header is not a JSON object")
        del self._buffer[:8 + size]
        header.pop("__metadata__", None)
        pending = [self._entry(name, info) for name, info in header.items()]
        self._pending = sorted(pending, key=lambda t: (t[3], t[4]))
        return True

    @staticmethod
    def _entry(name: str, info) -> tuple[str, np.dtype, tuple, int, int]:
        """(name, dtype, shape, begin, end) of a tensor the header describes."""
        try:
            dtype, shape = np.dtype(DTYPES[info["dtype"]]), tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"safetensors stream: tensor {name!r} is not described as safetensors describes one "
                             f"(dtype one of {', '.join(DTYPES)}, shape, data_offsets): {info!r}"[:500]) from e
        if min(shape, default=0) < 0 or begin < 0 or end - begin != dtype.itemsize * int(np.prod(shape)):
            raise ValueError(f"safetensors stream: tensor {name!r}'s offsets do not match its shape and dtype")
        return name, dtype, shape, begin, end

    def finish(self) -> None:
        """ValueError where the stream ended before its last tensor (or before its header)."""
        if self._pending is None:
            raise ValueError("safetensors stream: it ended before its header")
        if self._pending or self._buffer:
            missing = [name for name, *_ in self._pending]
            raise ValueError(f"safetensors stream: it ended inside its data ({len(missing)} tensors incomplete, "
                             f"e.g. {missing[:3]})" if missing else "safetensors stream: bytes after its last tensor")
