"""The offline API's prompts, under vLLM's names (`vllm.inputs`): a string, token ids, or one of
these dicts, and how they become token ids (`tokenize_prompt`)."""

from __future__ import annotations

from typing import NotRequired, TypedDict

import numpy as np

from jaxserve.engine.tokenizer import Tokenizer


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[dict]  # refused: the models take text only


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # reported as the prompt, where given (the ids run)
    multi_modal_data: NotRequired[dict]


PromptType = str | list[int] | TextPrompt | TokensPrompt


def tokenize_prompt(prompt: PromptType, tokenizer: Tokenizer | None) -> tuple[str | None, list[int]]:
    """(the prompt's text where it has one, its token ids); ValueError for what is not a prompt, and
    for a text prompt without a tokenizer (skip_tokenizer_init)."""
    text = None
    if isinstance(prompt, dict):
        if prompt.get("multi_modal_data") or prompt.get("mm_processor_kwargs"):
            raise ValueError("multi_modal_data is not supported: the models take text only")
        if "prompt_token_ids" not in prompt and "prompt" not in prompt:
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        text = prompt.get("prompt")
        if "prompt_token_ids" not in prompt:
            prompt = text
            if not isinstance(prompt, str):
                raise ValueError(f"'prompt' must be a string, got {type(prompt).__name__}")
        else:
            prompt = prompt["prompt_token_ids"]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("You cannot pass text prompts when skip_tokenizer_init=True: text needs the model's "
                             "tokenizer; pass token ids (a list, or {'prompt_token_ids': [...]})")
        return prompt, tokenizer.encode(prompt)
    if is_token_ids(prompt):
        return text, [int(t) for t in prompt]
    raise ValueError("a prompt must be a string, a list of token ids (integers) or a dict with 'prompt' or "
                     f"'prompt_token_ids', got {type(prompt).__name__}")


def is_token_ids(value) -> bool:
    return ((isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim == 1))
            and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value))


def prompt_list(prompts: PromptType | list[PromptType]) -> list[PromptType]:
    """One prompt (a string, a dict, token ids) as a list of one; a list or tuple of them as a list."""
    if isinstance(prompts, (list, tuple)) and not (len(prompts) and is_token_ids(prompts)):
        return list(prompts)
    return [prompts]
