"""bench-125m: the benchmark's Llama checkpoint (random weights, made deterministically).

    python bench/make_model.py [--out DIR]      # default ~/.cache/jaxserve-bench/bench-125m

vocab 32000, hidden 768, intermediate 2048, 12 layers, 12 heads, 4 KV heads, 4096 positions, rope
theta 10000, RMSNorm eps 1e-5, untied embeddings (124.7 M parameters), float32 weights (torch seed 0)
plus a bfloat16 copy in `DIR-bf16`. The tokenizer is the real 32000-token SentencePiece model shipped
in `mistral-common`, loaded as a transformers `LlamaTokenizerFast`, with a simple chat template.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mistral_common
import torch
import transformers

from peers import CACHE

CONFIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096, rope_theta=10000.0,
              rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '[' + m['role'] + ']: ' + m['content'] + '\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '[assistant]: ' }}{% endif %}")
DEFAULT_DIR = CACHE / "bench-125m"
VERSION = 1  # bump when the recipe changes, so stale caches are rebuilt


def make(out: Path = DEFAULT_DIR) -> Path:
    """Write the float32 checkpoint to `out` and a bfloat16 copy to `out`-bf16, unless already there."""
    bf16 = out.with_name(out.name + "-bf16")
    stamp = out / "bench-model-version"
    if stamp.exists() and stamp.read_text() == str(VERSION) and (bf16 / "config.json").exists():
        return out
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    for directory, dtype in ((out, torch.float32), (bf16, torch.bfloat16)):
        model.to(dtype).save_pretrained(directory, safe_serialization=True)
        spm = (Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1").read_bytes()
        (directory / "tokenizer.model").write_bytes(spm)  # llama.cpp's converter reads the SentencePiece model
        (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizerFast"}))
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, legacy=False)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(directory)
        (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    stamp.write_text(str(VERSION))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    print(make(parser.parse_args().out))
