"""Quantized weights: the two formats a linear layer's weight may be kept in, their jnp reference
(`dequantize`), and the quantizer that makes them from float weights (on the host, a checkpoint's;
on the device, a trainer's: the same values).

Both cut the input dimension into blocks of BLOCK values, each with its own float16 scale, as
GGUF's Q8_0, Q4_0 and Q4_1 do, so those blocks load as they are (`checkpoints.gguf`):

- "int8": `data` int8 [out, in]; `scales` f16 [out, in / BLOCK]; w = scale * q (Q8_0).
- "int4": `data` uint8 [out, in / 2], two values a byte in GGUF's order: byte j of a block holds
  value j in its low nibble and value j + 16 in its high one; `scales` and `mins` f16
  [out, in / BLOCK]; w = scale * q + min with q in 0..15 (Q4_1; Q4_0's q - 8 is min = -8 scale).

A weight may have leading dimensions ([experts, out, in]: a Mixture-of-Experts layer's stacked
matrices); its parts then have them too. A weight's format follows from its data's dtype (`fmt`).

A matrix may also be kept grouped (`GroupedRows`, made by `group_rows`): in each group of GROUP_ROWS
rows the rows' 4-byte words of data are interleaved (word j of the group's row r at word
GROUP_ROWS j + r of the group), and so are their scales and mins (block b of row r at
GROUP_ROWS b + r). The CPU kernel's decode products then read one row per lane of each vector, with
no sums across lanes (`quant.cc`; bench/RESULTS.md). The three parts are kept as one array, one
after the other, so that a step takes one array a matrix: each array costs its launch host time
(bench/RESULTS.md, "The engine thread's CPU in a one-stream step").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
FORMATS = ("int8", "int4")


class QuantizedWeight(NamedTuple):
    """A weight [..., out, in] in one of FORMATS (see the top). A pytree: it passes through jit as is."""

    data: jax.Array
    scales: jax.Array
    mins: jax.Array | None = None  # int4 only

    @property
    def fmt(self) -> str:
        return "int8" if self.data.dtype == jnp.int8 else "int4"

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, width = self.data.shape
        return *lead, width if self.fmt == "int8" else 2 * width


class GroupedRows(QuantizedWeight):
    """A quantized matrix [out, in] kept grouped (see the top; `group_rows`), out a multiple of
    GROUP_ROWS: `data` of the data's dtype, [out, row bytes], holds the grouped data, then the
    grouped scales, then (int4) the grouped mins, as raw bytes; `scales` and `mins` are None."""

    __slots__ = ()

    @property
    def shape(self) -> tuple[int, int]:
        out, width = self.data.shape  # (a row's bytes: in + 2 in / BLOCK; int4 in / 2 + 4 in / BLOCK)
        return out, width * 16 // 17 if self.fmt == "int8" else width * 8 // 5

    def parts(self, xp=np) -> tuple:
        """The grouped data [out, in or in / 2] and the grouped scales (and mins) [out, in / BLOCK],
        read out of `data`."""
        out, width = self.shape
        flat = self.data.reshape(-1)
        data_bytes, half_bytes = out * (width if self.fmt == "int8" else width // 2), out * width // BLOCK * 2
        halves = [_as_float16(flat[start:start + half_bytes].reshape(-1, 2), xp).reshape(out, width // BLOCK)
                  for start in range(data_bytes, flat.shape[0], half_bytes)]
        return flat[:data_bytes].reshape(out, -1), *halves


GROUP_ROWS = 16


def _regroup(part, xp, unit: int, inverse: bool):
    """`part` [out, width] with each group of GROUP_ROWS rows transposed as [rows, units] -> [units,
    rows] (or back: `inverse`), a unit being `unit` consecutive elements."""
    out, width = part.shape
    groups, units = out // GROUP_ROWS, width // unit
    shape = (groups, units, GROUP_ROWS, unit) if inverse else (groups, GROUP_ROWS, units, unit)
    return xp.transpose(part.reshape(shape), (0, 2, 1, 3)).reshape(out, width)


def can_group(shape: tuple[int, ...]) -> bool:
    """Whether a quantized weight of `shape` (its data's) may be kept grouped: a matrix of whole groups."""
    return len(shape) == 2 and shape[0] % GROUP_ROWS == 0


def group_rows(w: QuantizedWeight, xp=np) -> GroupedRows:
    """A quantized matrix in the grouped layout (see the top); `xp` numpy or jax.numpy."""
    if not can_group(w.data.shape):
        raise ValueError(f"only a matrix whose rows are a multiple of {GROUP_ROWS} is kept grouped, not {w.shape}")
    data = _regroup(w.data, xp, 4, False)
    halves = [_as_bytes(_regroup(h, xp, 1, False), data.dtype, xp) for h in (w.scales, w.mins) if h is not None]
    return GroupedRows(xp.concatenate([data.reshape(-1), *halves]).reshape(data.shape[0], -1), None)


def ungroup_rows(w: GroupedRows, xp=np) -> QuantizedWeight:
    """The inverse of `group_rows`: the matrix in rows."""
    data, *halves = w.parts(xp)
    return QuantizedWeight(_regroup(data, xp, 4, True), *(_regroup(part, xp, 1, True) for part in halves))


def _as_float16(pairs, xp):
    """Bytes [..., 2] (either integer dtype) -> the float16 [...] they hold."""
    if xp is np:
        return np.ascontiguousarray(pairs).view(np.uint8).view(np.float16)[..., 0]
    return jax.lax.bitcast_convert_type(pairs, jnp.float16)


def _as_bytes(halves, dtype, xp):
    """float16 [...] -> their bytes in `dtype` (int8 or uint8), flat."""
    if xp is np:
        return np.ascontiguousarray(halves).view(dtype).reshape(-1)
    return jax.lax.bitcast_convert_type(halves, dtype).reshape(-1)


def take_rows(w: QuantizedWeight, ids) -> QuantizedWeight:
    """Rows `ids` (an int array of any shape) of a quantized matrix, in rows, from either layout: a
    lookup table's (the tied embedding) reads its rows where the grouped layout put them, by their
    bytes' offsets in its one array (a gather of those bytes only)."""
    if not isinstance(w, GroupedRows):
        return QuantizedWeight(*(None if part is None else part[ids] for part in w))
    xp = np if isinstance(w.data, np.ndarray) else jnp
    out, width = w.shape
    row_bytes, blocks, flat = (width if w.fmt == "int8" else width // 2), width // BLOCK, w.data.reshape(-1)
    group, lane = (ids // GROUP_ROWS)[..., None, None], (ids % GROUP_ROWS)[..., None, None]
    # word j of a group's row `lane` at byte 4 (GROUP_ROWS j + lane) of its group; its blocks likewise
    words = GROUP_ROWS * row_bytes * group + 4 * (GROUP_ROWS * np.arange(row_bytes // 4)[:, None] + lane)
    data = flat[words + np.arange(4)].reshape(*ids.shape, row_bytes)
    blocks_at = 2 * (GROUP_ROWS * blocks * group + GROUP_ROWS * np.arange(blocks)[:, None] + lane) + np.arange(2)
    starts = range(out * row_bytes, flat.shape[0], out * blocks * 2)  # (the scales', then the mins')
    halves = [_as_float16(flat[start + blocks_at], xp) for start in starts]
    return QuantizedWeight(data, *halves)


def _nibbles(data):
    """uint8 [..., n / 2] in GGUF's order -> the values 0..15 as uint8 [..., n]."""
    *lead, width = data.shape
    blocks = data.reshape(*lead, width // (BLOCK // 2), BLOCK // 2)
    return jnp.concatenate([blocks & 0xF, blocks >> 4], axis=-1).reshape(*lead, 2 * width)


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The weight as floats [..., in] in `dtype` (computed in float32). Leading dimensions may be
    any (a gather of an embedding's rows keeps them)."""
    if isinstance(w, GroupedRows):
        w = ungroup_rows(w, jnp)
    q = (w.data if w.fmt == "int8" else _nibbles(w.data)).astype(jnp.float32)
    *lead, width = q.shape
    q = q.reshape(*lead, width // BLOCK, BLOCK)
    out = q * w.scales.astype(jnp.float32)[..., None]
    if w.mins is not None:
        out = out + w.mins.astype(jnp.float32)[..., None]
    return out.reshape(*lead, width).astype(dtype)


def check_quantizable(shape: tuple[int, ...]) -> str | None:
    """Why a weight of `shape` cannot be quantized, or None."""
    if len(shape) < 2 or shape[-1] % BLOCK:
        return f"its input dimension ({shape[-1]}) is not a multiple of {BLOCK}"
    return None


def quantize(w, fmt: str, xp=np) -> QuantizedWeight:
    """A float weight [..., out, in] in `fmt`, rounding to nearest: "int8" with each block's largest
    magnitude at 127, "int4" with each block's range over 0..15. `xp`: numpy on the host (a
    checkpoint's weights), or jax.numpy on the device (a trainer's; the same values bit for bit)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; choose from {list(FORMATS)}")
    if why := check_quantizable(w.shape):
        raise ValueError(f"cannot quantize a weight of shape {w.shape}: {why}")
    *lead, width = w.shape
    blocks = xp.asarray(w, xp.float32).reshape(*lead, width // BLOCK, BLOCK)
    if fmt == "int8":
        scale = _divide(xp.abs(blocks).max(-1), 127, xp).astype(xp.float16)
        q = xp.rint(_divide(blocks, _nonzero(scale, xp)[..., None], xp)).clip(-127, 127).astype(xp.int8)
        return QuantizedWeight(q.reshape(*lead, width), scale)
    lo, hi = blocks.min(-1), blocks.max(-1)
    scale, low = _divide(hi - lo, 15, xp).astype(xp.float16), lo.astype(xp.float16)
    q = xp.rint(_divide(blocks - low[..., None], _nonzero(scale, xp)[..., None], xp)).clip(0, 15).astype(xp.uint8)
    return QuantizedWeight(pack_int4(q.reshape(*lead, width)), scale, low)


def _nonzero(scale, xp=np):
    """A block of zeros has scale 0 and quantizes to zeros."""
    return xp.where(scale == 0, 1, scale).astype(xp.float32)


def _divide(a, b, xp=np):
    """a / b (b broadcast against a), rounded as numpy rounds it. On the device, b goes in as an array
    of a's shape that XLA cannot see through: it would multiply by the reciprocal of a broadcast or
    constant divisor instead of dividing, which rounds differently."""
    if xp is np:
        return a / b
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape))


def pack_int4(q):
    """Values 0..15, uint8 [..., out, in] -> [..., out, in / 2] in GGUF's order (see the top)."""
    *lead, width = q.shape
    blocks = q.reshape(*lead, width // BLOCK, 2, BLOCK // 2)
    return (blocks[..., 0, :] | (blocks[..., 1, :] << 4)).reshape(*lead, width // 2)


def nbytes(w) -> int:
    """Bytes a weight (an array or a QuantizedWeight) holds."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(w))
