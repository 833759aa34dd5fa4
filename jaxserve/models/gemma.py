"""The Gemma family (Gemma 2, Gemma 3 and the text model of Gemma 3's image-text checkpoints) on
the shared layers, in Flax NNX.

What sets Gemma apart from Llama: norms scale by (1 + weight) in float32 (`GemmaRMSNorm`), each
block's output is normed again before the residual (post-attention and post-feedforward norms),
embeddings are multiplied by sqrt(hidden_size), the MLP is GeGLU (tanh GELU), attention scales
by query_pre_attn_scalar ** -0.5, and layers are local (a sliding window) or global as config.json
lists them. Gemma 2 soft-caps attention logits; both may soft-cap the final logits. Gemma 3 norms
q and k per head, and its local layers rotate by their own base (`ModelConfig.ropes[1]`).

Gemma3ForConditionalGeneration's config.json nests the text model under `text_config`
(`decoder_config`); its checkpoints hold the language model under a prefix, beside a vision tower
and projector that are never loaded (`SKIPPED_TENSORS`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.layers import (ATTENTION_RULES, EMBEDDING_RULES, Attention, Decoder, GatedMLP, ModelInputs,
                                    ReadRows, mlp_rules, read_only, reading)
from jaxserve.models.rope import RopeConfig, rope_from_hf

if TYPE_CHECKING:
    from jaxserve.models.config import ModelConfig

GEMMA2 = ("Gemma2ForCausalLM",)
GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
SLIDING, FULL = "sliding_attention", "full_attention"  # config.json's `layer_types`

# transformers' defaults for what config.json may leave out, by architecture (Gemma2Config's and
# Gemma3TextConfig's: Gemma 3's image-text checkpoints give little more than the sizes and layer
# count of their text model, and differ from Llama's and `ModelConfig.from_hf`'s where left out)
_SHARED_DEFAULTS = {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "attention_bias": False}
DEFAULTS = {
    **dict.fromkeys(GEMMA2, {**_SHARED_DEFAULTS, "vocab_size": 256000, "max_position_embeddings": 8192,
                             "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    **dict.fromkeys(GEMMA3, {**_SHARED_DEFAULTS, "vocab_size": 262208, "max_position_embeddings": 131072,
                             "attn_logit_softcapping": None, "final_logit_softcapping": None}),
}
GEMMA3_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # transformers' rope bases where config.json has none
GEMMA3_PATTERN = 6  # every 6th layer global, where config.json gives no pattern


@dataclasses.dataclass(frozen=True)
class GemmaOptions:
    """What sets the family's architectures apart, as config.json gives it."""

    qk_norm: bool  # per-head Gemma norm on q and k before RoPE (Gemma 3)
    attention_bias: bool  # biases on the q/k/v and output projections
    sm_scale: float  # query_pre_attn_scalar ** -0.5
    sliding_window: int  # what a local layer attends to: this many most recent positions
    local_layers: tuple[bool, ...]  # per layer: local (sliding window) or global
    local_rope: bool  # local layers rotate by `ModelConfig.ropes[1]` (Gemma 3)
    attn_soft_cap: float | None  # attention logits s -> c * tanh(s / c)
    final_soft_cap: float | None  # final logits, the same


def decoder_config(architecture: str, hf: dict) -> dict:
    """The text model's config.json fields (`text_config` of an image-text checkpoint, where the
    top level's tied embeddings and EOS ids still apply), with transformers' Gemma defaults for
    the fields left out."""
    text = dict(hf.get("text_config") or hf)
    if "text_config" in hf:
        text.update({k: hf[k] for k in ("tie_word_embeddings", "eos_token_id") if k in hf})
    return {**DEFAULTS[architecture], **text}


def options_from_hf(architecture: str, hf: dict, path: Path) -> GemmaOptions:
    activation = hf["hidden_activation"]  # (`decoder_config` gives transformers' default where it is left out)
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {activation!r} is not supported (only 'gelu_pytorch_tanh'), in {path}")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"use_bidirectional_attention=true (an embedding model) is not supported, in {path}")
    gemma3 = architecture in GEMMA3
    if gemma3 and hf.get("attn_logit_softcapping") is not None:
        # (Gemma 3 has no attention soft-capping; transformers reads the field but never applies it)
        raise ValueError(f"attn_logit_softcapping is not supported for {architecture}, in {path}")
    return GemmaOptions(qk_norm=gemma3, attention_bias=bool(hf["attention_bias"]),
                        sm_scale=float(hf["query_pre_attn_scalar"]) ** -0.5,
                        sliding_window=int(hf["sliding_window"] or DEFAULTS[architecture]["sliding_window"]),
                        local_layers=tuple(kind == SLIDING for kind in _layer_types(architecture, hf, path)),
                        local_rope=gemma3, attn_soft_cap=hf.get("attn_logit_softcapping"),
                        final_soft_cap=hf.get("final_logit_softcapping"))


def _layer_types(architecture: str, hf: dict, path: Path) -> list[str]:
    """config.json's `layer_types`; older files give a pattern instead: Gemma 2 alternates (even layers
    local), Gemma 3 makes every N-th layer global (`sliding_window_pattern`)."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        every = 2 if architecture in GEMMA2 else hf.get("sliding_window_pattern",
                                                        hf.get("_sliding_window_pattern", GEMMA3_PATTERN))
        types = [SLIDING if (i + 1) % every else FULL for i in range(n)]
    if len(types) != n or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"layer_types must list {n} layers, each {SLIDING!r} or {FULL!r}, in {path}")
    return list(types)


def ropes_from_hf(architecture: str, hf: dict, path: Path) -> tuple[RopeConfig, ...]:
    """Gemma 2 rotates every layer alike. Gemma 3: (global rotation, local rotation); transformers 5
    writes `rope_parameters` per layer type, older files `rope_theta` and `rope_scaling` for the
    global layers and `rope_local_base_freq` for the local ones."""
    if architecture in GEMMA2:
        return (rope_from_hf(hf, path),)
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        per_type = {kind: {"rope_theta": GEMMA3_THETA[kind], **(params.get(kind) or {})} for kind in (FULL, SLIDING)}
    else:
        per_type = {FULL: {"rope_theta": hf.get("rope_theta", GEMMA3_THETA[FULL]),
                           **(params or hf.get("rope_scaling") or {})},
                    SLIDING: {"rope_theta": hf.get("rope_local_base_freq", GEMMA3_THETA[SLIDING])}}
    return rope_from_hf(hf, path, per_type[FULL]), rope_from_hf(hf, path, per_type[SLIDING])


# HF tensor name pattern -> parameter path (`re.sub` template). The text model of an image-text
# checkpoint sits under `model.language_model.` (transformers' module names) or
# `language_model.model.` (what transformers saves, and the hub's files).
PREFIX = r"(?:model\.language_model\.|language_model\.model\.|model\.)"
HF_NAME_MAP = {
    PREFIX + r"embed_tokens\.weight": r"embed_tokens.embedding",
    PREFIX + r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.weight": r"layers.\1.\2.\3.weight",
    PREFIX + r"layers\.(\d+)\.self_attn\.(\w+_proj)\.bias": r"layers.\1.self_attn.\2.bias",
    PREFIX + r"layers\.(\d+)\.self_attn\.(q_norm|k_norm)\.weight": r"layers.\1.self_attn.\2.weight",
    PREFIX + r"layers\.(\d+)\.(\w+_layernorm)\.weight": r"layers.\1.\2.weight",
    PREFIX + r"norm\.weight": r"norm.weight",
    r"(?:language_model\.)?lm_head\.weight": r"lm_head.weight",
}
TIED_HEAD = frozenset({"lm_head.weight"})  # what a checkpoint of tied embeddings may hold but the model lacks
# an image-text checkpoint's vision tower and projector: read past, never loaded (the model is text only)
SKIPPED_TENSORS = r"(?:model\.)?(?:vision_tower|multi_modal_projector)\..*"

PARTITION_RULES = [*ATTENTION_RULES, *mlp_rules(), *EMBEDDING_RULES]


class GemmaRMSNorm(nnx.Module):
    """Gemma's RMSNorm: normalise and scale by (1 + weight), all in float32, then cast back (HF's
    Gemma norms; Llama's casts before it scales)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, local: bool, dtype, rngs: nnx.Rngs):
        options, d = cfg.options, cfg.hidden_size
        self.input_layernorm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, qkv_bias=options.attention_bias, o_bias=options.attention_bias,
                                   qk_norm=GemmaRMSNorm if options.qk_norm else None,
                                   sliding_window=options.sliding_window if local else None,
                                   soft_cap=options.attn_soft_cap, sm_scale=options.sm_scale,
                                   rope_index=1 if local and options.local_rope else 0)
        self.post_attention_layernorm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype)
        self.mlp = GatedMLP(d, cfg.intermediate_size, False, dtype, rngs,
                            activation=functools.partial(jax.nn.gelu, approximate=True))
        self.post_feedforward_layernorm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype)

    def __call__(self, x, k_pages, v_pages, inputs: ModelInputs, rows: ReadRows | None = None):
        h, k_pages, v_pages = self.self_attn(self.input_layernorm(x), k_pages, v_pages, inputs, rows)
        with reading(rows):
            x = read_only(rows, x) + self.post_attention_layernorm(h)
            x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), inputs.lora))
        return x, k_pages, v_pages


class GemmaDecoder(Decoder):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype, rngs, [DecoderLayer(cfg, local, dtype, rngs) for local in cfg.options.local_layers],
                         norm=GemmaRMSNorm)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.dtype = dtype
        self.final_soft_cap = cfg.options.final_soft_cap

    def embed(self, token_ids: jax.Array) -> jax.Array:
        # (the scale is rounded to the model's dtype first, as HF does)
        return self.embed_tokens(token_ids) * jnp.asarray(self.embed_scale, self.dtype)
