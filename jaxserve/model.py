"""The Llama-family decoder (Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3) in Flax NNX.

Modules and parameter names mirror Hugging Face's (`self_attn.q_proj`, `mlp.down_proj`,
...), so the checkpoint name map in `checkpoints/hf.py` stays mechanical. Linear
weights are stored [out, in], as in the checkpoint.

The decoder works on one ragged step: T tokens from up to B sequences, each a
prefill chunk or one decode token (`ModelInputs`). Each layer writes the new
keys/values into the paged cache, then attends through `kernels.paged_attention`.
Only the last token of each sequence goes through the LM head (and the tokens whose
next prompt token's logprob is asked for, see `Decoder.logits`).

The engine splits the module once (`nnx.split`) and merges it inside its jitted
step (`forward`), so no NNX object walk happens per call. This module knows
nothing about scheduling, sampling or HTTP.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig, RopeConfig
from kernels import matmul_t, paged_attention, write_kv


@flax.struct.dataclass
class KVCache:
    """One K and one V page array per layer, each [num_pages, page_size, num_kv_heads, head_dim]."""

    k: list[jax.Array]
    v: list[jax.Array]


@flax.struct.dataclass
class ModelInputs:
    """Device view of one step. T = padded tokens, B = padded sequences, P = pages per sequence."""

    token_ids: jax.Array  # i32[T]; padding 0
    positions: jax.Array  # i32[T] position of each token in its sequence
    rope: jax.Array  # f32[T, head_dim] cos then sin of each token's rotation angles (`rope_table`)
    kv_write_index: jax.Array  # i32[T] page * page_size + offset to write K/V; padding -> null page 0
    kv_lens: jax.Array  # i32[B] tokens in the cache after this step; padding 0
    page_table: jax.Array  # i32[B, P]; padding -> null page 0
    query_start: jax.Array  # i32[B + 1] first token row of each sequence; padding repeats the total
    num_seqs: jax.Array  # i32[] real sequences
    logits_indices: jax.Array  # i32[B] row of each sequence's last token


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


def rope_table(cfg: ModelConfig, positions: np.ndarray) -> np.ndarray:
    """f32[T, head_dim]: cos, then sin, of the RoPE angles (position x inverse frequency, taken in
    float32 as Hugging Face does) of each token. Made on the host with the step's inputs: computed
    in the step, XLA:CPU fuses the cosine and sine into each layer's rotation of q and k and
    evaluates them again for every head and layer (3 % of a bench-125m step's thread time,
    `bench/step_profile.py`)."""
    angles = positions.astype(np.float32)[:, None] * rope_inv_freq(cfg.rope, cfg.head_dim)[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)


def apply_rope(x, rope):
    """Rotate-half RoPE. x: [T, heads, head_dim]; rope: f32[T, head_dim] (`rope_table`)."""
    cos, sin = (jnp.concatenate([half, half], axis=-1)[:, None, :].astype(x.dtype)
                for half in jnp.split(rope, 2, axis=-1))
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class RMSNorm(nnx.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


class Linear(nnx.Module):
    """y = x W^T + b, the weight stored [out, in] as Hugging Face stores it (`kernels.matmul_t`).

    Products accumulate in float32 and return the input dtype. Both choices suit XLA's CPU backend:
    its float32 products of a row-major [out, in] weight are faster than of an [in, out] one at 1, 8
    and 32 rows (up to 1.4x), mixed at 2 rows and even at 128 (bench/RESULTS.md), and a
    bfloat16-output product runs about 2.5x slower than a float32-accumulated one; the CPU
    kernel reads both operands along `in` too."""

    def __init__(self, d_in: int, d_out: int, bias: bool, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(nnx.initializers.lecun_normal(in_axis=1, out_axis=0)(rngs.params(), (d_out, d_in),
                                                                                     dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x):
        y = matmul_t(x, self.weight[...])
        return y if self.bias is None else y + self.bias[...]


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.sliding_window = cfg.sliding_window
        self.q_proj = Linear(d, cfg.num_heads * hd, cfg.qkv_bias, dtype, rngs)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, cfg.qkv_bias, dtype, rngs)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, cfg.qkv_bias, dtype, rngs)
        self.o_proj = Linear(cfg.num_heads * hd, d, cfg.o_bias, dtype, rngs)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def __call__(self, x, k_pages, v_pages, inputs: ModelInputs):
        t = x.shape[0]
        q = self.q_proj(x).reshape(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, inputs.rope)
        k = apply_rope(k, inputs.rope)
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, inputs.kv_write_index)
        o = paged_attention(q, k_pages, v_pages, inputs.kv_lens, inputs.page_table, inputs.query_start,
                            inputs.num_seqs, sm_scale=self.head_dim**-0.5, sliding_window=self.sliding_window)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim)), k_pages, v_pages


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, i, cfg.mlp_bias, dtype, rngs)
        self.up_proj = Linear(d, i, cfg.mlp_bias, dtype, rngs)
        self.down_proj = Linear(i, d, cfg.mlp_bias, dtype, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, k_pages, v_pages, inputs: ModelInputs):
        h, k_pages, v_pages = self.self_attn(self.input_layernorm(x), k_pages, v_pages, inputs)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_pages, v_pages


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, rngs)

    def __call__(self, kv: KVCache, inputs: ModelInputs) -> tuple[KVCache, jax.Array]:
        """-> (updated cache, [T, hidden] the last layer's output at every token: see `logits`)."""
        x = self.embed_tokens(inputs.token_ids)
        k_out, v_out = [], []
        for layer, k_pages, v_pages in zip(self.layers, kv.k, kv.v):
            x, k_pages, v_pages = layer(x, k_pages, v_pages, inputs)
            k_out.append(k_pages)
            v_out.append(v_pages)
        return KVCache(k=k_out, v=v_out), x

    def logits(self, x: jax.Array) -> jax.Array:
        """The final norm and the LM head: [N, hidden] rows of `__call__`'s output -> f32[N, vocab]."""
        # tied: the embedding matrix [vocab, hidden] is the head's weight
        head = self.embed_tokens.embedding[...] if self.lm_head is None else self.lm_head.weight[...]
        return matmul_t(self.norm(x), head, jnp.float32)


def abstract_decoder(cfg: ModelConfig, dtype) -> Decoder:
    """The decoder with shapes only (no memory): the template weights are loaded into."""
    return nnx.eval_shape(lambda: Decoder(cfg, dtype, rngs=nnx.Rngs(0)))


def forward(graphdef: nnx.GraphDef, state: nnx.State, kv: KVCache, inputs: ModelInputs):
    """Pure form of the decoder for use under jit: (state, cache, inputs) -> (cache, f32[B, vocab]
    logits of each sequence's last token, [T, hidden] output at every token: see `head_logits`)."""
    decoder = nnx.merge(graphdef, state)
    kv, hidden = decoder(kv, inputs)
    return kv, decoder.logits(hidden[inputs.logits_indices]), hidden


def head_logits(graphdef: nnx.GraphDef, state: nnx.State, hidden: jax.Array) -> jax.Array:
    """Pure form of `Decoder.logits`: rows of `forward`'s output -> f32[N, vocab] logits."""
    return nnx.merge(graphdef, state).logits(hidden)
