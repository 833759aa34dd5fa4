"""Tiny random Hugging Face models of every supported architecture, built with transformers.

Weights are redrawn at std 0.2 (norm weights around 1, biases too; Gemma's tied embeddings smaller) so that
greedy paths are diverse rather than one repeated token, and every parameter
(biases, q/k norms) actually matters. The byte-level tokenizer of
jaxserve-tiny goes with each, so prompts can be text too.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import transformers

from checkpoints.default_model import BYTE_VOCAB_SIZE, write_byte_tokenizer

COMMON = dict(vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
              initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)

ATTN_CAP, FINAL_CAP = 4.0, 8.0  # Gemma's soft-caps, small enough to bind on these weights

# name -> (config class, model class, architecture-specific settings; those of a nested `text_config`
# take COMMON's there)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM",
                          {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "attention_bias": True}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM",
                    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
                     "rope_theta": 500000.0, "num_key_value_heads": 1}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "num_key_value_heads": 4}),
    # fused qkv and gate/up; LongRoPE within its original context (the short factors), half of
    # each head rotated (Phi-4-mini's partial rotary); tests/test_parity.py also takes the long ones
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             {"sliding_window": 24, "original_max_position_embeddings": 128,
              "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "short_factor": [1.0, 1.3, 2.1, 3.4], "long_factor": [1.5, 2.5, 4.0, 6.0]}}),
    # Mixture-of-Experts: odd expert counts, a window shorter than the parity prompts
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 5, "num_experts_per_tok": 2, "sliding_window": 24}),
    # a shared expert; layer 0 dense (mlp_only_layers)
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 96, "mlp_only_layers": [0]}),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 5, "num_experts_per_tok": 3, "moe_intermediate_size": 64, "norm_topk_prob": True,
                   "head_dim": 32}),
    # windows of 16 < the 40-token prompts; caps that saturate (test_parity checks that they bind)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16, "attn_logit_softcapping": ATTN_CAP,
                "final_logit_softcapping": FINAL_CAP, "attention_bias": True, "tie_word_embeddings": False}),
    # local and global layers, each rotation its own base, the global one scaled
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16, "final_logit_softcapping": FINAL_CAP,
                "tie_word_embeddings": False,
                "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    # the text model of an image-text checkpoint (a tiny vision tower beside it, never loaded)
    "gemma3-vision": ("Gemma3Config", "Gemma3ForConditionalGeneration",
                      {"text_config": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 16,
                                       "layer_types": ["full_attention", "sliding_attention"]},
                       "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                         "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
                       "mm_tokens_per_image": 4}),
}


def build_hf_model(name: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """The tiny model `name` of ARCHITECTURES, its settings changed by `overrides`."""
    config_cls, model_cls, extra = ARCHITECTURES[name]
    # (a deep copy: transformers writes into the dicts it is given, e.g. rope_parameters)
    extra = copy.deepcopy({**extra, **overrides})
    settings = ({**extra, "text_config": {**COMMON, **extra["text_config"]}} if "text_config" in extra
                else {**COMMON, **extra})
    config = getattr(transformers, config_cls)(**settings)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
        text = config.get_text_config()
        if text.model_type.startswith("gemma") and model.config.tie_word_embeddings:
            # Gemma multiplies its embeddings by sqrt(hidden_size): drawn that much smaller, a tied
            # head does not just echo the input token
            model.get_input_embeddings().weight.div_(text.hidden_size ** 0.5)
    return model


def save_hf_model(model: transformers.PreTrainedModel, directory: Path, **save_kwargs) -> Path:
    """config.json, safetensors, generation_config.json (no EOS) and the byte tokenizer."""
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    (directory / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    write_byte_tokenizer(directory)
    return directory
