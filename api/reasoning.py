"""vLLM's `--reasoning-parser`: a reasoning model's thinking, written between <think> and </think>,
goes to the chat message's `reasoning` (and vLLM's older name for it, `reasoning_content`) instead
of its `content`; the Responses API makes it a `reasoning` output item.

- `deepseek_r1`: the output starts in the thinking (its chat template opens <think> in the prompt;
  a <think> the model writes anyway is dropped); all of it is reasoning until </think>.
- `qwen3`: the output is thinking where it starts with <think>, or where the rendered prompt ends
  with an open <think> (the thinking-only templates); otherwise it is all content (thinking
  turned off: the template closed <think></think> in the prompt).

Text after </think> is the content (tool calls are parsed from it); a constraint (response_format,
named or required tools) applies to it alone, as in vLLM. Thinking that never closes (the output
ran out) stays reasoning, streamed and whole (vLLM's qwen3 parser makes it content when whole).
The text is split the same way whole and streamed: a tag split across deltas is held back until it
is known.
"""

from __future__ import annotations

import dataclasses

from jaxserve.structured_output.grammar import Constraint

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def opens_thinking(parser: str, tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the output starts inside the thinking, before it has written anything."""
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    return parser == "deepseek_r1" or tail.rstrip().endswith(START)


def thinking_first(constraint: Constraint | None, thinking: bool) -> Constraint | None:
    """A constraint (response_format, tools) applies after the thinking, as vLLM applies it with a
    reasoning parser (`Constraint.thinking`)."""
    return constraint and dataclasses.replace(constraint, thinking=("" if thinking else START, END))


class ChoiceReasoning:
    """Splits one choice's text, fed piece by piece, into reasoning and content."""

    def __init__(self, thinking: bool):
        self.state = "start"  # "start" (nothing decided yet), "reasoning" or "content"
        self.thinking = thinking  # (at "start") the output is thinking even without <think>
        self.reasoned = False  # whether the output has had a reasoning part (even an empty one)
        self.held = ""  # text that may be the beginning of a tag

    def feed(self, text: str) -> tuple[str, str]:
        """-> (reasoning, content) that `text` adds."""
        text, self.held = self.held + text, ""
        reasoning = ""
        if self.state == "start":
            stripped = text.lstrip()
            if START.startswith(stripped):  # (all whitespace, or part of <think>): wait and see
                self.held = text
                return "", ""
            if stripped.startswith(START):
                text = stripped[len(START):]
            self.state = "reasoning" if self.thinking or stripped.startswith(START) else "content"
            self.reasoned = self.state == "reasoning"
        if self.state == "reasoning":
            end = text.find(END)
            if end < 0:
                keep = _partial_tag_at_end(text, END)
                self.held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            reasoning, text, self.state = text[:end], text[end + len(END):], "content"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """-> (reasoning, content) of what was held back, at the end of the output."""
        held, self.held = self.held, ""
        if self.state == "start":
            self.reasoned = self.thinking or held.strip() == START
            if held.strip() == START:
                return "", ""
            return (held, "") if self.thinking else ("", held)
        return (held, "") if self.state == "reasoning" else ("", held)


def _partial_tag_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that `tag` starts with (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(thinking: bool, text: str) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content), as vLLM's: None for a part it does not have.
    `thinking`: whether the output starts inside the thinking (`opens_thinking`)."""
    choice = ChoiceReasoning(thinking)
    (reasoning, content), (more_reasoning, more_content) = choice.feed(text), choice.finish()
    return (reasoning + more_reasoning if choice.reasoned else None), (content + more_content) or None
