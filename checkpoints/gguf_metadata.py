"""A GGUF file's metadata as a Hugging Face directory reads: config.json (`hf_config`, by the
file's architecture) and the tokenizer, built by transformers' converter from the file's vocabulary
(`gguf_tokenizer`: no torch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkpoints.gguf_file import metadata, tensors

# tokens that end a turn by their text, which llama.cpp also stops at (beside the file's eos, eot
# and eom ids): chat models' end-of-turn markers
END_OF_TURN = ("<end_of_turn>", "<|end|>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<EOT>")


# Gemma's layer counts of its 27B models: llama.cpp scales their attention by hidden / heads, every
# other size's by head_dim (query_pre_attn_scalar, which the file does not hold)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# GGUF general.architecture -> the Hugging Face architecture it is served as
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}


WITH_EXPERTS = {"llama": "MixtralForCausalLM"}  # GGUF architectures served as another when they have experts


SOFTMAX_GATING = 1  # llama.cpp's expert_gating_func for softmax routing, the one the models here route by


# llama.cpp's converter stores Gemma's norm weights w as 1 + w (the scale its (1 + w) norms apply)
NORMS_PLUS_ONE = ("gemma2", "gemma3")


def hf_config(path: Path) -> dict:
    """config.json's fields from the file's metadata."""
    meta = metadata(path)
    arch = meta["general.architecture"]
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} in {path} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    names = {t.name for t in tensors(path)}
    experts = get("expert_count", 0)
    config = {
        "architectures": [WITH_EXPERTS.get(arch, ARCHITECTURES[arch]) if experts else ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": get("embedding_length"), "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", get("embedding_length") // heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0), "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor", 1.0),
                                  "original_max_position_embeddings": get("rope.scaling.original_context_length")}
    if "rope_freqs.weight" in names:
        config["rope_scaling"] = _llama3_rope(path, config)
    if arch == "qwen2":
        config["attention_bias"] = False  # (Qwen2's q/k/v biases come with the architecture)
    if experts and get("expert_gating_func", SOFTMAX_GATING) != SOFTMAX_GATING:
        raise ValueError(f"{path}: expert_gating_func {get('expert_gating_func')} is not supported (only softmax "
                         f"routing, {SOFTMAX_GATING})")
    if experts:
        config.update(num_experts=experts, num_experts_per_tok=get("expert_used_count"),
                      moe_intermediate_size=get("expert_feed_forward_length", config["intermediate_size"]),
                      shared_expert_intermediate_size=get("expert_shared_feed_forward_length", 0),
                      qkv_bias=any(name.endswith("attn_q.bias") for name in names),
                      # as the file says; else as llama.cpp does: Qwen3-MoE's top-k weights
                      # renormalised, never Qwen2-MoE's
                      norm_topk_prob=bool(get("expert_weights_norm", arch == "qwen3moe")),
                      # layers whose feed-forward tensors are a dense MLP's, not stacked experts
                      mlp_only_layers=[i for i in range(config["num_hidden_layers"])
                                       if f"blk.{i}.ffn_gate_exps.weight" not in names])
    if arch in ("gemma2", "gemma3"):
        config.update(_gemma_config(arch, get, config))
    if arch == "phi3":
        config.update(_phi3_config(path, get, config))
    return config


def _gemma_config(arch: str, get, config: dict) -> dict:
    """Gemma's fields as llama.cpp reads the file. What the file does not hold, llama.cpp fixes per
    architecture: the layer pattern (Gemma 2 alternates, even layers local; Gemma 3 makes every
    6th layer global), the attention scale, Gemma 3's local rope base (10000 unless given) and
    Gemma 2's soft-caps (50 and 30 unless given)."""
    layers, every = config["num_hidden_layers"], 2 if arch == "gemma2" else 6
    scalar = (config["hidden_size"] // config["num_attention_heads"] if layers == GEMMA_27B_LAYERS[arch]
              else config["head_dim"])
    out = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
           "query_pre_attn_scalar": scalar, "sliding_window": get("attention.sliding_window", 4096),
           "layer_types": ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)],
           "final_logit_softcapping": get("final_logit_softcapping", 30.0 if arch == "gemma2" else None)}
    if arch == "gemma2":
        out["attn_logit_softcapping"] = get("attn_logit_softcapping", 50.0)
    else:
        out["rope_local_base_freq"] = get("rope.freq_base_swa", 10000.0)
    return out


def _phi3_config(path: Path, get, config: dict) -> dict:
    """Phi-3's fields as llama.cpp's converter writes them: the rotated dimensions, a window of 0 for
    none, and LongRoPE's factors as tensors beside its original context and attention factor."""
    out = {"partial_rotary_factor": get("rope.dimension_count", config["head_dim"]) / config["head_dim"],
           "sliding_window": get("attention.sliding_window") or None}
    factors = {t.name: np.asarray(t.data, np.float32).tolist() for t in tensors(path)
               if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if factors:
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
                               "short_factor": factors["rope_factors_short.weight"],
                               "original_max_position_embeddings": get("rope.scaling.original_context_length"),
                               "attention_factor": get("rope.scaling.attn_factor")}
    return out


def _llama3_rope(path: Path, config: dict) -> dict:
    """Llama 3.1's rope scaling, which llama.cpp keeps as a tensor of frequency factors: recognised
    by recomputing them from Llama 3's published parameters (any other factors are an error)."""
    freqs = next(t for t in tensors(path) if t.name == "rope_freqs.weight")
    factors = np.asarray(freqs.data, np.float32)
    dim, theta = config["head_dim"], config["rope_theta"]
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor, low, high, original = float(factors.max()), 1.0, 4.0, 8192
    smooth = np.clip((original / wavelen - low) / (high - low), 0, 1)
    expected = np.where(wavelen < original / high, 1.0,
                        np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    if not np.allclose(factors, expected, rtol=1e-3):
        raise ValueError(f"{path}: rope_freqs.weight is not Llama 3's rope scaling, which is all that is supported")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original}


def write_tokenizer(path: Path, out: Path) -> None:
    """The file's tokenizer (`gguf_tokenizer`) with its chat template, as tokenizer files."""
    gguf_tokenizer(path).save_pretrained(str(out))


# the tokenizer's special tokens -> the metadata key of their id (under tokenizer.ggml.)
SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                     "pad_token": "padding_token_id"}


def gguf_tokenizer(path: Path):
    """The tokenizer the file's metadata describes: its vocabulary, merges or scores, token types and
    pre-tokenizer type go to transformers' GGUF converter (which needs no torch, unlike transformers'
    GGUF file reader), and its special tokens, add_bos/add_eos flags and chat template to the
    tokenizer's settings, as transformers reads them."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    meta = metadata(path)
    fields, settings = ({name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
                        for renames in (GGUF_TOKENIZER_MAPPING["tokenizer"], GGUF_TOKENIZER_MAPPING["tokenizer_config"]))
    if fields.get("tokenizer_type") == "llama":  # (llama.cpp adds BOS to a SentencePiece vocabulary unless told not to)
        settings.setdefault("add_bos_token", True)
    for name, key in SPECIAL_TOKEN_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        settings[name] = fields["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], fields)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **settings, **extra)


def end_of_generation(path: Path) -> list[int]:
    """The ids generation stops at, as llama.cpp takes them: the file's eos, eot and eom tokens, and
    the tokens whose text ends a turn (END_OF_TURN; a Gemma 3 or Phi-3 file names only its eos)."""
    meta = metadata(path)
    ids = [meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    ids += [i for i, text in enumerate(meta.get("tokenizer.ggml.tokens", ())) if text in END_OF_TURN]
    return list(dict.fromkeys(i for i in ids if i is not None))
