"""Logprobs in OpenAI's shapes: chat `logprobs.content`, the legacy completions form, and vLLM's
`prompt_logprobs`."""

from __future__ import annotations

import codecs
import math

from api.response_models import ChatLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob
from jaxserve.engine.outputs import logprob_entries
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.sched.sequence import TokenLogprobs

LOGPROB_FLOOR = -9999.0  # stands for -inf, which JSON cannot carry


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def token_name(tokenizer: Tokenizer | None, as_ids: bool):
    """How logprobs name a token: its text, or vLLM's "token_id:<id>" (`return_tokens_as_token_ids`,
    and always without a tokenizer)."""
    return (lambda token: f"token_id:{token}") if as_ids or tokenizer is None else tokenizer.decode_token


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs],
                  as_ids: bool = False) -> list[ChatLogprob]:
    """`choices[].logprobs.content` entries for the tokens. `bytes` are the token's own
    bytes (part of a character where a token holds only some of its bytes; `token` then shows U+FFFD)."""
    name = token_name(tokenizer, as_ids)
    return [ChatLogprob(token=name(token), logprob=finite(lp.logprob), bytes=list(tokenizer.token_bytes(token)),
                        top_logprobs=[TopLogprob(token=name(t), logprob=finite(top),
                                                 bytes=list(tokenizer.token_bytes(t)))
                                      for t, top in zip(lp.top_ids, lp.top_logprobs)])
            for token, lp in zip(token_ids, logprobs)]


def prompt_logprobs(tokenizer: Tokenizer | None, prompt_ids: list[int], logprobs: list[TokenLogprobs]
                    ) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {id: {logprob, rank,
    decoded_token}} for it and the top k (decoded_token None without a tokenizer)."""
    return [None, *({str(t): PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
                     for t, lp in entry.items()}
                    for entry in logprob_entries(tokenizer, prompt_ids[1:], logprobs))]


class CompletionLogprobsWriter:
    """The legacy completions shape (`CompletionLogprobs`), built up token by token.

    `top_logprobs` holds the k likeliest tokens in rank order and, as OpenAI's does, the sampled
    token too (up to k + 1 entries; `logprobs=0` gives the sampled token alone). `text_offset` is
    where each token's text starts in the choice's text, counting whole characters: a token that
    holds the first bytes of a character starts where that character does."""

    def __init__(self, tokenizer: Tokenizer | None, offset: int = 0, as_ids: bool = False):
        # (without a tokenizer the text is empty: every token starts at `offset`)
        self.token_bytes = (lambda token: b"") if tokenizer is None else tokenizer.token_bytes
        self.name = token_name(tokenizer, as_ids)
        self.offset = offset  # characters of the choice's text before the next token
        self._chars = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def format(self, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> CompletionLogprobs:
        """The entries of `token_ids`; a token without logprobs (None: a prompt's first) has None ones."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token, logprobs_of_token in zip(token_ids, logprobs):
            out.tokens.append(self.name(token))
            if logprobs_of_token is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                logprob = logprobs_of_token.logprob
                out.token_logprobs.append(finite(logprob))
                top: dict[str, float] = {}
                candidates = zip(logprobs_of_token.top_ids, logprobs_of_token.top_logprobs)
                for t, lp in [*candidates, (token, logprob)]:  # tokens that decode alike: the likelier
                    top.setdefault(self.name(t), finite(lp))
                out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(self._chars.decode(self.token_bytes(token)))
        return out
