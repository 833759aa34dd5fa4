"""Token ids to text as they come, one sequence at a time (`IncrementalDetokenizer`), and stop-string
matching over that text."""

from __future__ import annotations

from jaxserve.engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Text deltas for a growing list of generated ids.

    Decodes a short window: `ids[prefix:read]` was already emitted, `ids[prefix:]`
    is decoded again with the new tokens, and the difference is the delta. The
    window starts on the prompt's last tokens, so a SentencePiece leading space
    ("▁word") is kept and a byte-level token is decoded in context. A delta that
    ends in U+FFFD (a multi-byte character split across tokens) is held back
    until the character is complete; `flush` releases what is left at the end.
    Without `spaces_between_special_tokens` (and with special tokens kept), an added
    token right after another is its own text, whatever space the tokenizer's decode
    would put between them (vLLM's rule).
    """

    PROMPT_CONTEXT = 5  # prompt tokens the window starts on

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.joins_added_tokens = not (skip_special_tokens or spaces_between_special_tokens)
        self.after_added = False  # (joins_added_tokens) the last token was an added one
        self.ids = list(prompt_ids[-self.PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # every delta emitted so far

    def _pending(self) -> str:
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; -> the new text that is certain (may be "")."""
        if self.joins_added_tokens:
            return "".join(self._push_joined(token) for token in token_ids)
        return self._push(token_ids)

    def _push_joined(self, token: int) -> str:
        added = self.tokenizer.added_content(token)
        after_added, self.after_added = self.after_added, added is not None
        if added is None or not after_added:
            return self._push([token])
        self.ids.append(token)  # (nothing is held back after an added token)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += added
        return added

    def _push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        delta = self._pending()
        if not delta or delta.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is held back (an incomplete character decodes as U+FFFD)."""
        delta = self._pending()
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


# Stop strings in released text: where one ends, and how much of a text's tail could still start one.
def find_stop(text: str, stops: list[str], checked: int) -> tuple[int, str] | None:
    """Earliest (index, stop string) occurring in `text` and ending after text[:checked]."""
    hits = [(i, s) for s in stops if (i := text.find(s, max(0, checked - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def undecided_tail(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                if text[len(text) - k:] == s[:k]), default=0)
