"""Phi-3 (and Phi-3.5 / Phi-4-mini, which share its architecture name): Llama's decoder, loaded
from fused tensors.

Phi-3 checkpoints fuse q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj`. They are
split at load (name map targets "a|b|c", see `checkpoints.target`), so the model and its
partition rules are Llama's: a fused matrix split over devices by rows would hand one device
queries and another keys. What else sets Phi-3 apart is its rotation (`longrope` scaling with
short and long factors, partial rotary in Phi-4-mini), which `jaxserve.models.rope` reads.
"""

from __future__ import annotations

from pathlib import Path

from jaxserve.models.llama import HF_NAME_MAP as LLAMA_NAMES
from jaxserve.models.llama import LlamaOptions


def decoder_config(architecture: str, hf: dict) -> dict:
    """config.json as transformers' Phi3Config reads it: early files name LongRoPE "su" or "yarn"."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(key) or {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in ("su", "yarn"):
        return hf
    return {**hf, key: {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "longrope"}}


def options_from_hf(architecture: str, hf: dict, path: Path) -> LlamaOptions:
    """Llama's options for a Phi-3 config.json: no biases, and the window when it has one."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu'), in {path}")
    return LlamaOptions(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                        sliding_window=hf.get("sliding_window"))


_QKV = "|".join(rf"layers.\1.self_attn.{name}_proj.weight" for name in "qkv")
HF_NAME_MAP = {
    r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight": _QKV,
    r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight": r"layers.\1.mlp.gate_proj.weight|layers.\1.mlp.up_proj.weight",
    r"model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\.down_proj)\.weight": r"layers.\1.\2.weight",
    **{pattern: path for pattern, path in LLAMA_NAMES.items() if "_proj" not in pattern and "q_norm" not in pattern},
}
