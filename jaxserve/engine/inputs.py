"""The offline API's prompts, under vLLM's names (`vllm.inputs`): a string, token ids, or one of
these dicts, and how they become token ids (`tokenize_prompt`, under `Tokenization`: vLLM's
`tokenization_kwargs`)."""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Tokenization:
    """vLLM's `tokenization_kwargs` of `LLM.generate` and `LLM.chat` (tokenizer.encode's arguments, as
    Hugging Face names them): whether the tokenizer adds its special tokens, and the prompt cut to
    `keep` tokens (`truncation` with `max_length`, or `truncate_prompt_tokens`; -1: max_model_len) from
    `side` ("right" keeps the first tokens, Hugging Face's default; "left" the last ones)."""
    add_special_tokens: bool = True
    keep: int | None = None
    side: str = "right"

    @classmethod
    def of(cls, kwargs: dict | None, max_model_len: int, **defaults) -> Tokenization:
        """ValueError for an argument jaxserve does not take (vLLM warns and ignores them)."""
        kwargs = {**defaults, **(kwargs or {})}
        unknown = sorted(set(kwargs) - {"add_special_tokens", "truncation", "max_length", "truncation_side",
                                        "truncate_prompt_tokens"})
        if unknown:
            raise ValueError(f"tokenization_kwargs {unknown} are not supported: jaxserve takes add_special_tokens, "
                             "truncation with max_length, truncate_prompt_tokens and truncation_side")
        side = kwargs.get("truncation_side") or "right"
        if side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
        keep = kwargs.get("truncate_prompt_tokens")
        truncation = kwargs.get("truncation")
        if truncation not in (None, True, False, "longest_first", "do_not_truncate"):
            raise ValueError(f"truncation must be True, False, 'longest_first' or 'do_not_truncate', "
                             f"got {truncation!r}")
        if truncation in (True, "longest_first"):
            keep = kwargs.get("max_length", max_model_len)
        elif "max_length" in kwargs:
            raise ValueError("tokenization_kwargs' max_length cuts the prompt with truncation=True alone")
        if keep == -1:
            keep = max_model_len
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise ValueError(f"the tokens kept (max_length, truncate_prompt_tokens) must be -1 or >= 1, got {keep!r}")
        return cls(bool(kwargs.get("add_special_tokens", True)), keep, side)

    def cut(self, ids: list[int]) -> list[int]:
        if self.keep is None or len(ids) <= self.keep:
            return ids
        return ids[:self.keep] if self.side == "right" else ids[len(ids) - self.keep:]


def tokenize_prompt(prompt: PromptType, tokenizer: Tokenizer | None,
                    tokenization: Tokenization = Tokenization()) -> tuple[str | None, list[int]]:
    """(the prompt's text where it has one, its token ids, cut as `tokenization` says); ValueError for
    what is not a prompt, and for a text prompt without a tokenizer (skip_tokenizer_init)."""
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
        return prompt, tokenization.cut(tokenizer.encode(prompt, tokenization.add_special_tokens))
    if is_token_ids(prompt):
        return text, tokenization.cut([int(t) for t in prompt])
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
