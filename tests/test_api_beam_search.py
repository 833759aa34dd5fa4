"""vLLM's use_beam_search through the real server."""

from __future__ import annotations

import numpy as np
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


def test_beam_search_keeps_the_best_pairs_of_a_brute_force_search(served, client):
    """Every continuation of two tokens, scored through the API in one request: the prompt followed by
    each token of the vocabulary, echoed with its logprob, and the best next tokens' logprobs after
    it. Beam search of width k keeps the k likeliest first tokens, then the k best pairs among their
    extensions (ignore_eos: every beam is as long, so scores order as summed logprobs): its beams are
    those pairs, best first, with the brute force's scores. Here the best pair of all starts with
    one of those first tokens, so the best beam is the best continuation there is."""
    prompt, width = [11, 12, 13], 4
    vocab = served[1].engine.model_config.vocab_size
    every = post(served, "/v1/completions", {
        "model": MODEL, "prompt": [prompt + [token] for token in range(vocab)], "max_tokens": 1, "echo": True,
        "logprobs": width, "temperature": 0.0, "ignore_eos": True, "return_tokens_as_token_ids": True})
    assert every.status_code == 200
    first, pairs = {}, {}  # first token -> its logprob; (first, second) -> the pair's, for each first's best seconds
    for choice in every.json()["choices"]:
        token, logprobs = choice["index"], choice["logprobs"]
        assert logprobs["tokens"][len(prompt)] == f"token_id:{token}"
        first[token] = logprobs["token_logprobs"][len(prompt)]
        for name, logprob in logprobs["top_logprobs"][len(prompt) + 1].items():
            pairs[token, int(name.removeprefix("token_id:"))] = first[token] + logprob
    assert len(first) == vocab
    kept = sorted(first, key=first.get, reverse=True)[:width]
    want = sorted(((score, pair) for pair, score in pairs.items() if pair[0] in kept), reverse=True)[:width]
    assert all(a - b > 1e-3 for (a, _), (b, _) in zip(want, want[1:]))  # no near-ties to order by rounding
    best = max(pairs, key=pairs.get)  # of all vocab x vocab pairs: a first token's best second is among its top
    assert best[0] in kept and best == want[0][1]

    beams = completion(client, prompt=prompt, max_tokens=2, n=width, logprobs=0,
                       extra_body={"use_beam_search": True, "ignore_eos": True, "return_tokens_as_token_ids": True})
    got = [(sum(c.logprobs.token_logprobs), tuple(int(t.removeprefix("token_id:")) for t in c.logprobs.tokens))
           for c in beams.choices]
    assert [pair for _, pair in got] == [pair for _, pair in want]
    np.testing.assert_allclose([score for score, _ in got], [score for score, _ in want], atol=1e-4)
    assert got[0][0] == pytest.approx(pairs[best], abs=1e-4)
