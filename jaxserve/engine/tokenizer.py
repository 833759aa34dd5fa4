"""The model's Hugging Face tokenizer: prompts to ids, and generated ids to text deltas.

Generated text is always produced incrementally (`IncrementalDetokenizer`), in
streaming and non-streaming responses alike, so the two agree by construction:
the text of a completion is the concatenation of its deltas.

Rendering a chat template is bounded in time (`render_time_limit`): a template is code, and a
request may bring its own (--trust-request-chat-template).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from checkpoints.byte_level import bytes_to_unicode
from jaxserve.engine.chat_template import (CHAT_TEMPLATE_TIMEOUT_S, CONTENT_FORMATS, check_chat_template,
                                           loops_over_content, render_time_limit, template_options_error)


def _not_about_torch(record: logging.LogRecord) -> bool:
    """transformers says at import that PyTorch is missing, which jaxserve never needs (tokenizers
    need none): a newcomer reads it as an error. Its other warnings pass."""
    return not record.getMessage().startswith("PyTorch was not found.")


# (on the "transformers" logger itself, where the message is logged: importing transformers sets
# that logger's level and handler, not its filters)
logging.getLogger("transformers").addFilter(_not_about_torch)


# the files a Hugging Face tokenizer is read from (one is enough)
TOKENIZER_FILES = ("tokenizer*", "vocab*", "*.tiktoken", "spiece.model")


def check_tokenizer_files(directory: str | Path) -> None:
    """FileNotFoundError, saying the fix, where `directory` holds none of TOKENIZER_FILES: a model
    trained on its own vocabulary may come without them, and is then served on token ids alone."""
    if not any(next(Path(directory).glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{directory} has no tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model, ...): "
            "serve the model on token ids alone with --skip-tokenizer-init (LLM(..., skip_tokenizer_init=True)), "
            "or read the tokenizer from another directory with --tokenizer")


class Tokenizer:
    def __init__(self, model_dir: str | Path, chat_template: str | None = None):
        from transformers import AutoTokenizer

        check_tokenizer_files(model_dir)
        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        if chat_template is not None:
            check_chat_template(chat_template)
            self.hf.chat_template = chat_template
        self._token_bytes: dict[int, bytes] = {}
        self._added: dict[int, str] | None = None  # added token id -> its text (`added_content`)
        self._byte_decoder = _byte_decoder(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def added_content(self, token_id: int) -> str | None:
        """An added token's own text (special tokens, chat markers, ...); None for a vocabulary piece."""
        if self._added is None:
            self._added = {i: token.content for i, token in self.hf.added_tokens_decoder.items()}
        return self._added.get(token_id)

    def content_format(self, chat_template: str | None = None, requested: str = "auto") -> str:
        """"string" or "openai" (see CONTENT_FORMATS): `requested`, or for "auto" (vLLM's default)
        "openai" where the template (`chat_template` or the model's) loops over a message's content."""
        if requested not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                             f"got {requested!r}")
        if requested != "auto":
            return requested
        template = chat_template or self.hf.chat_template or ""
        source = "\n".join(template.values()) if isinstance(template, dict) else template
        return "openai" if loops_over_content(source) else "string"

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, *,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            chat_template: str | None = None, template_kwargs: dict | None = None,
                            timeout: float = CHAT_TEMPLATE_TIMEOUT_S) -> str:
        """The conversation as prompt text. `template_kwargs` are more variables for the template (e.g.
        `enable_thinking`). TimeoutError where rendering takes longer than `timeout` seconds."""
        if not (chat_template or self.hf.chat_template):  # (the model's may be several, chosen by HF: tools or not)
            raise ValueError("this model's tokenizer has no chat template; pass one with --chat-template")
        error = template_options_error(add_generation_prompt, continue_final_message, template_kwargs)
        if error:
            raise ValueError(error[1])
        with render_time_limit(timeout):
            return self.hf.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=chat_template,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message,
                                               **(template_kwargs or {}))

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (a SentencePiece "▁" is a space; byte-fallback and byte-level
        pieces are their raw bytes), for logprobs."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            piece = self.hf.convert_ids_to_tokens(token_id)
            added = self.hf.added_tokens_decoder.get(token_id)
            fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece or "")
            if piece is None:
                cached = b""
            elif added is not None:
                cached = added.content.encode()
            elif fallback:
                cached = bytes([int(fallback[1], 16)])
            elif self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
                cached = bytes(self._byte_decoder[c] for c in piece)
            else:
                cached = piece.replace("\u2581", " ").encode()
            self._token_bytes[token_id] = cached
        return cached

    def decode_token(self, token_id: int) -> str:
        """One token's own text (U+FFFD where it holds part of a character)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _byte_decoder(hf) -> dict[str, int] | None:
    """Stand-in character -> byte, for byte-level BPE tokenizers; None for the others."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or '"ByteLevel"' not in json.dumps(json.loads(backend.to_str()).get("decoder")):
        return None
    return {ch: b for b, ch in bytes_to_unicode().items()}
