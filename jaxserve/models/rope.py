"""Rotary position embeddings: Hugging Face's frequency scalings, a step's cos/sin table, the rotation.

A step's table (`rope_table`) is one of the step's inputs (`ModelInputs.rope`), made where the
backend makes it (`TABLE_BY_BACKEND`); the model only rotates by it (`apply_rope`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from jaxserve.config import ModelConfig, RopeConfig


@functools.cache
def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies f32[head_dim // 2], with HF's `linear` and `llama3` scaling (computed
    once per model: every step's `rope_table` reads them; read-only)."""
    inv = 1.0 / (np.float32(rope.theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    if rope.type == "linear":
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
    """f32[T, head_dim]: cos, then sin, of the RoPE angles (position x inverse frequency, taken in
    float32 as Hugging Face does) of each token, made with numpy on the host."""
    angles = positions.astype(np.float32)[:, None] * rope_inv_freq(cfg.rope, cfg.head_dim)[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)


# jax.default_backend() -> what makes a step's table: the host on CPU, where XLA would evaluate cos and sin
# again in every head's and layer's rotation; GPU and TPU take the same table, for the same numbers everywhere.
TABLE_BY_BACKEND = {"cpu": host_rope_table, "gpu": host_rope_table, "tpu": host_rope_table}


def rope_table(cfg: ModelConfig, positions: np.ndarray) -> np.ndarray:
    """The RoPE table f32[T, head_dim] of a step's positions i32[T], as the backend makes it."""
    return TABLE_BY_BACKEND.get(jax.default_backend(), host_rope_table)(cfg, positions)


def apply_rope(x: jax.Array, rope: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: [T, heads, head_dim]; rope: f32[T, head_dim] (`rope_table`)."""
    cos, sin = (jnp.concatenate([half, half], axis=-1)[:, None, :].astype(x.dtype)
                for half in jnp.split(rope, 2, axis=-1))
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
