"""vLLM's use_beam_search through the real server."""

from __future__ import annotations

import pytest
from server import MODEL, completion, post


def test_beam_search_through_the_api_as_offline(served, client, offline):
    """vLLM's `use_beam_search`: the n best beams, best first, are the n choices (the text of the
    generated tokens), as the offline LLM.beam_search finds them; streamed, each choice's text comes
    whole. Controls beam search has no use for are 400s."""
    from jaxserve import BeamSearchParams

    prompt = [11, 12, 13]
    want = offline.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))
    texts = [offline.tokenizer.decode(beam.tokens[3:]) for beam in want[0].sequences]
    r = completion(client, prompt=prompt, max_tokens=6, n=3, extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.text for c in r.choices] == texts
    assert r.usage.completion_tokens == sum(len(beam.tokens) - 3 for beam in want[0].sequences)
    streamed = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4, n=2, stream=True, extra_body={"use_beam_search": True}):
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).append(choice.delta.content)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           n=2, extra_body={"use_beam_search": True})
    assert {i: "".join(filter(None, parts)) for i, parts in streamed.items()} == {
        c.index: c.message.content for c in whole.choices}
    # logprobs: those of the rounds that chose each token (the top k of the 2 x n candidates), as offline
    scored = completion(client, prompt=prompt, max_tokens=6, n=3, logprobs=2,
                        extra_body={"use_beam_search": True, "length_penalty": 0.5, "return_tokens_as_token_ids": True})
    for choice, beam in zip(scored.choices, want[0].sequences):
        assert choice.text == offline.tokenizer.decode(beam.tokens[3:])
        for token, logprob, top, candidates in zip(beam.tokens[3:], choice.logprobs.token_logprobs,
                                                   choice.logprobs.top_logprobs, beam.logprobs):
            assert logprob == pytest.approx(candidates[token].logprob, abs=1e-5)
            best = sorted(candidates.items(), key=lambda item: item[1].rank)[:2]
            assert len(top) <= 3 and all(top[f"token_id:{t}"] == pytest.approx(lp.logprob, abs=1e-5) for t, lp in best)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, n=2,
                                          logprobs=True, top_logprobs=3, extra_body={"use_beam_search": True})
    assert sum(len(c.logprobs.content) for c in chat.choices) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 for c in chat.choices for entry in c.logprobs.content)
    for bad, param in (({"top_p": 0.5}, "top_p"), ({"stop": ["a"]}, "stop"), ({"n": 11}, "n"),
                       ({"echo": True, "logprobs": 0}, "logprobs")):
        refused = post(served, "/v1/completions", {"model": MODEL, "prompt": prompt, "use_beam_search": True, **bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, bad
    refused = post(served, "/v1/completions", {"model": MODEL, "prompt": prompt, "length_penalty": 2.0})
    assert refused.status_code == 400 and "use_beam_search" in refused.json()["error"]["message"]
