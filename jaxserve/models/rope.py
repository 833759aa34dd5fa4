"""Rotary position embeddings: Hugging Face's settings and frequency scalings, a step's cos/sin
tables, the rotation.

A model may rotate its layers in more than one way (Gemma 3's local layers have their own base):
`ModelConfig.ropes` lists them, and a step's tables (`rope_table`, one per rotation) are one of
the step's inputs (`ModelInputs.rope`), made where the backend makes them (`TABLE_BY_BACKEND`); a
layer only rotates by its table (`apply_rope`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from jaxserve.models.config import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (HF `rope_parameters` / `rope_scaling`)."""

    theta: float
    type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, longrope
    partial_rotary_factor: float = 1.0  # the leading fraction of each head that is rotated (Phi-4-mini)
    short_factor: tuple[float, ...] | None = None  # longrope: per-frequency divisors within the original context
    long_factor: tuple[float, ...] | None = None  # ... and beyond it
    attention_factor: float = 1.0  # longrope: cos and sin are scaled by it
    long: bool = False  # longrope: the long factors apply (`for_context`)

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)

    def for_context(self, max_model_len: int) -> RopeConfig:
        """This rotation for an engine serving up to `max_model_len` tokens. LongRoPE takes its long
        factors at every position when the context may pass the original one (vLLM's choice: one
        rotation per position, so cached keys stay valid; transformers switches per forward)."""
        if self.type != "longrope" or max_model_len <= self.original_max_position_embeddings:
            return self
        log.warning("longrope: max_model_len %d > the original context %d, so the long factors apply at every "
                    "position (pass a max_model_len within it for the short ones)", max_model_len,
                    self.original_max_position_embeddings)
        return dataclasses.replace(self, long=True)


def rope_from_hf(hf: dict, path: Path, params: dict | None = None) -> RopeConfig:
    """The rotation config.json describes. `params`: a `rope_parameters` entry to read instead of the
    top-level one (transformers >= 5 writes one per layer type for some models)."""
    # transformers >= 5 writes `rope_parameters` (theta inside); older files
    # have `rope_theta` and an optional `rope_scaling`.
    params = dict(params if params is not None else hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES}), in {path}")
    params.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if rope_type == "longrope":
        params.update(_longrope(params, hf, path))
    fields = {f.name for f in dataclasses.fields(RopeConfig)} - {"theta", "type", "long"}
    return RopeConfig(theta=float(theta), type=rope_type, **{k: v for k, v in params.items() if k in fields})


def _longrope(params: dict, hf: dict, path: Path) -> dict:
    """LongRoPE's settings as HF computes them: the factors, the original context, and the
    attention factor (when not given: from the ratio of the contexts)."""
    original = params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if original is None or "short_factor" not in params or "long_factor" not in params:
        raise ValueError(f"longrope needs short_factor, long_factor and original_max_position_embeddings, in {path}")
    factor = params.get("factor") or hf.get("max_position_embeddings", original) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return dict(original_max_position_embeddings=int(original), attention_factor=float(attention),
                short_factor=tuple(map(float, params["short_factor"])),
                long_factor=tuple(map(float, params["long_factor"])))


def ropes_from_hf(architecture: str, hf: dict, path: Path) -> tuple[RopeConfig, ...]:
    """A family's `ropes_from_hf` when every layer rotates the same way."""
    return (rope_from_hf(hf, path),)


@functools.cache
def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies f32[rotary_dim // 2], with HF's `linear`, `llama3` and `longrope` scaling
    (computed once per model: every step's `rope_table` reads them; read-only)."""
    dim = rope.rotary_dim(head_dim)
    wavelengths = np.float32(rope.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv = 1.0 / wavelengths
    if rope.type == "longrope":
        factors = np.asarray(rope.long_factor if rope.long else rope.short_factor, np.float32)
        if len(factors) != len(inv):
            raise ValueError(f"longrope: {len(factors)} factors for {len(inv)} frequencies")
        inv = 1.0 / (factors * wavelengths)
    elif rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        old_len = rope.original_max_position_embeddings
        wavelen = 2 * np.pi / inv
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        scaled = np.where(wavelen > low_freq_wavelen, inv / rope.factor, inv)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv = np.where(medium, smoothed, scaled)
    inv = inv.astype(np.float32)
    inv.flags.writeable = False
    return inv


def host_rope_table(cfg: ModelConfig, positions: np.ndarray) -> np.ndarray:
    """f32[R, T, rotary_dim]: for each of the model's rotations, cos, then sin, of the RoPE angles
    (position x inverse frequency, taken in float32 as Hugging Face does) of each token, made with
    numpy on the host."""
    tables = []
    for rope in cfg.ropes:
        angles = positions.astype(np.float32)[:, None] * rope_inv_freq(rope, cfg.head_dim)[None, :]
        tables.append(np.concatenate([np.cos(angles), np.sin(angles)], axis=-1) * np.float32(rope.attention_factor))
    return np.stack(tables).astype(np.float32)


# jax.default_backend() -> what makes a step's table: the host on CPU, where XLA would evaluate cos and sin
# again in every head's and layer's rotation; GPU and TPU take the same table, for the same numbers everywhere.
TABLE_BY_BACKEND = {"cpu": host_rope_table, "gpu": host_rope_table, "tpu": host_rope_table}


def rope_table(cfg: ModelConfig, positions: np.ndarray) -> np.ndarray:
    """The RoPE tables f32[R, T, rotary_dim] of a step's positions i32[T], as the backend makes them."""
    return TABLE_BY_BACKEND.get(jax.default_backend(), host_rope_table)(cfg, positions)


def apply_rope(x: jax.Array, rope: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: [T, heads, head_dim]; rope: f32[T, rotary_dim], one of a step's tables
    (`ModelInputs.rope[i]`): the first rotary_dim features of each head turn, the rest pass."""
    rotary = rope.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], rope), x[..., rotary:]], axis=-1)
    cos, sin = (jnp.concatenate([half, half], axis=-1)[:, None, :].astype(x.dtype)
                for half in jnp.split(rope, 2, axis=-1))
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
