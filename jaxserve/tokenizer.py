"""The model's Hugging Face tokenizer: prompts to ids and generated ids to text."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir))

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, with the special tokens the model expects (e.g. BOS)."""
        return list(self.hf(text).input_ids)

    def decode(self, token_ids: list[int]) -> str:
        """Text of generated ids, special tokens (EOS, ...) left out."""
        return self.hf.decode(token_ids, skip_special_tokens=True)
