"""`jaxserve-tiny`, the built-in default model: RANDOM weights, real Hugging Face format.

It exists so that a fresh machine can serve and test without a download. It is
a small Llama-architecture model whose weights are drawn from a fixed numpy
seed: its output is gibberish by design. It is written on first use into
`~/.cache/jaxserve/` (or `$XDG_CACHE_HOME/jaxserve/`) as config.json,
generation_config.json, model.safetensors, tokenizer.json and
tokenizer_config.json (with a ChatML chat template); transformers loads it too.

The tokenizer is byte-level: ids 0..255 are the bytes, then four special
tokens. `write_byte_tokenizer` is shared with the tests' parity models.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from checkpoints.byte_level import bytes_to_unicode
from jaxserve_kernels.cache import cache_root

NAME = "jaxserve-tiny"
VERSION = 1  # bump when the generated files change, so old caches are not reused
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, END_OF_TEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258, 259
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": BYTE_VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": IM_END_ID,
    "torch_dtype": "float32",
}


def write_byte_tokenizer(directory: Path, model_max_length: int = 2048) -> None:
    """tokenizer.json + tokenizer_config.json of the byte-level tokenizer (no merges)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[3],
        "pad_token": SPECIAL_TOKENS[1],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }, indent=2))


def _random_weights(cfg: dict, seed: int = 0, std: float = 0.2) -> dict[str, np.ndarray]:
    """HF-named float32 tensors, normal(0, std), norms at 1."""
    rng = np.random.default_rng(seed)
    d, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def normal(*shape):
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    weights = {"model.embed_tokens.weight": normal(cfg["vocab_size"], d)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        weights.update({
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "self_attn.q_proj.weight": normal(q, d),
            p + "self_attn.k_proj.weight": normal(kv, d),
            p + "self_attn.v_proj.weight": normal(kv, d),
            p + "self_attn.o_proj.weight": normal(d, q),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
            p + "mlp.gate_proj.weight": normal(i, d),
            p + "mlp.up_proj.weight": normal(i, d),
            p + "mlp.down_proj.weight": normal(d, i),
        })
    weights["model.norm.weight"] = np.ones(d, np.float32)
    weights["lm_head.weight"] = normal(cfg["vocab_size"], d)
    return weights


def default_model_dir() -> Path:
    """The directory of jaxserve-tiny (random weights), written on first use."""
    target = cache_root() / f"{NAME}-v{VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{NAME}-"))
    try:
        (tmp / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": BOS_ID, "eos_token_id": [IM_END_ID, END_OF_TEXT_ID]}, indent=2))
        (tmp / "README.md").write_text(f"# {NAME}\n\nRandom weights (numpy seed 0): output is gibberish by design. "
                                       "Made by jaxserve's checkpoints/default_model.py for tests and smoke runs.\n")
        write_byte_tokenizer(tmp, TINY_CONFIG["max_position_embeddings"])
        save_file(_random_weights(TINY_CONFIG), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            tmp.rename(target)  # atomic; a concurrent writer may have won the race
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
