"""The Llama family (Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3) on the shared layers, in Flax NNX.

Its architectures differ only in options read from config.json (`LlamaOptions`): biases on the
projections, a per-head norm of q and k (Qwen3), a sliding window (Mistral). Modules and
parameter names mirror Hugging Face's (`self_attn.q_proj`, `mlp.down_proj`, ...), so the name
map of checkpoints (`HF_NAME_MAP`) stays mechanical, and so do the partition rules.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from flax import nnx

from jaxserve.models.layers import (ATTENTION_RULES, EMBEDDING_RULES, Attention, Decoder, GatedMLP, ModelInputs,
                                    ReadRows, RMSNorm, mlp_rules, read_only, reading)

if TYPE_CHECKING:
    from jaxserve.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LlamaOptions:
    """What sets the family's architectures apart, as config.json gives it."""

    qkv_bias: bool  # biases on q/k/v projections (Qwen2, Llama's attention_bias)
    o_bias: bool  # bias on the output projection (Llama's attention_bias)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None  # attend to at most this many most recent positions


QKV_BIAS = ("Qwen2ForCausalLM",)  # architectures with q/k/v biases whatever attention_bias says
QK_NORM = ("Qwen3ForCausalLM",)
SLIDING_WINDOW = ("MistralForCausalLM",)  # architectures whose `sliding_window` applies to every layer


def options_from_hf(architecture: str, hf: dict, path: Path) -> LlamaOptions:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu'), in {path}")
    attention_bias = bool(hf.get("attention_bias", False))
    return LlamaOptions(qkv_bias=architecture in QKV_BIAS or attention_bias, o_bias=attention_bias,
                        mlp_bias=bool(hf.get("mlp_bias", False)), qk_norm=architecture in QK_NORM,
                        sliding_window=_sliding_window_from_hf(hf, architecture, path))


def _sliding_window_from_hf(hf: dict, architecture: str, path: Path) -> int | None:
    if architecture in SLIDING_WINDOW:
        return hf.get("sliding_window")
    if hf.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window=true (per-layer windows) is not supported yet, in {path}")
    return None


# HF tensor name pattern -> parameter path (`re.sub` template)
HF_NAME_MAP = {
    r"model\.embed_tokens\.weight": r"embed_tokens.embedding",
    r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.weight": r"layers.\1.\2.\3.weight",
    r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.bias": r"layers.\1.\2.\3.bias",
    r"model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)\.weight": r"layers.\1.self_attn.\2.weight",
    r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight": r"layers.\1.\2.weight",
    r"model\.norm\.weight": r"norm.weight",
    r"lm_head\.weight": r"lm_head.weight",
}
TIED_HEAD = frozenset({"lm_head.weight"})  # what a checkpoint of tied embeddings may hold but the model lacks

# Megatron-style (`layers.ATTENTION_RULES`), MLP biases split with their rows
PARTITION_RULES = [*ATTENTION_RULES, *mlp_rules(bias=True), *EMBEDDING_RULES]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        options = cfg.options
        self.self_attn = Attention(cfg, dtype, rngs, qkv_bias=options.qkv_bias, o_bias=options.o_bias,
                                   qk_norm=RMSNorm if options.qk_norm else None, sliding_window=options.sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.options.mlp_bias, dtype, rngs)

    def __call__(self, x, k_pages, v_pages, inputs: ModelInputs, rows: ReadRows | None = None):
        h, k_pages, v_pages = self.self_attn(self.input_layernorm(x), k_pages, v_pages, inputs, rows)
        with reading(rows):
            x = read_only(rows, x) + h
            x = x + self.mlp(self.post_attention_layernorm(x), inputs.lora)
        return x, k_pages, v_pages


class LlamaDecoder(Decoder):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype, rngs, [DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])

