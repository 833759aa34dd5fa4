"""api/reasoning: a reasoning model's thinking apart from its answer, whole or in pieces."""

from __future__ import annotations

import random

from api.reasoning import ChoiceReasoning, split_reasoning


def test_reasoning_split_is_the_same_whole_and_in_any_pieces():
    """`ChoiceReasoning` fed a text in random pieces (tags cut anywhere) gives what `split_reasoning`
    gives for it whole, for both starts (inside the thinking or not)."""
    rng = random.Random(0)
    texts = ["<think>\nhmm</think>\n\nyes", "plain answer", "  <thi", "<think>", "<think>abc</th", "",
             "still thinking", "I think so.</think>The answer is 4.", "<think>a</think>b</think>c"]
    for thinking in (False, True):
        for text in texts:
            whole = split_reasoning(thinking, text)
            for _ in range(30):
                cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
                choice, reasoning, content = ChoiceReasoning(thinking), "", ""
                for a, b in zip([0, *cuts], [*cuts, len(text)]):
                    more_reasoning, more_content = choice.feed(text[a:b])
                    reasoning, content = reasoning + more_reasoning, content + more_content
                more_reasoning, more_content = choice.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
                assert (reasoning if choice.reasoned else None, content or None) == whole, (text, cuts)
    assert split_reasoning(False, "<think>\nhmm</think>\n\nyes") == ("\nhmm", "\n\nyes")
    assert split_reasoning(False, "plain answer") == (None, "plain answer")
    assert split_reasoning(True, "still thinking") == ("still thinking", None)
