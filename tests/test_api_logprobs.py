"""Logprobs through the real server: chat's and completions' shapes, byte tokens, rank order, the
model's own distribution, scoring a prompt (echo, vLLM's prompt_logprobs), the whole vocabulary's
logprobs (-1) and entropies (jaxserve's return_entropy)."""

from __future__ import annotations

import math

import numpy as np
from server import MODEL, completion, post, streamed_text

from jaxserve import SamplingParams

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and "".join(c.token for c in content) == r.choices[0].message.content
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.logprob == tops[0] <= 0  # greedy = top-1
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, logprobs=True, top_logprobs=3, stream=True, **GREEDY))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    alone = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           top_logprobs=0, **GREEDY)  # asks for nothing: vLLM takes it
    assert alone.choices[0].logprobs is None


def test_logprobs_of_characters_split_over_byte_tokens(client):
    """é and 😀 come as byte tokens: chat's `bytes` spell the text back, and completions' text_offset
    counts whole characters."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                                       logprobs=True, top_logprobs=2, extra_body={"guided_regex": "é😀x"})
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == "é😀x" and len(content) > 3  # some tokens hold part of a character
    assert b"".join(bytes(e.bytes) for e in content).decode() == "é😀x"
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=20, logprobs=True, stream=True,
                                                 extra_body={"guided_regex": "é😀x"}))
    held = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs and not c.choices[0].delta.content]
    assert held and all(choice.delta.content == "" for choice in held)  # content "", as vLLM's
    r = completion(client, prompt="hi", max_tokens=20, logprobs=1, extra_body={"guided_regex": "é😀x"})
    assert r.choices[0].text == "é😀x" and r.choices[0].logprobs.text_offset[-1] == 2  # "x" is the third character


def test_completion_top_logprobs_in_rank_order_with_the_sampled_token(served):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 1.5, "seed": 3, "logprobs": 3}
    lp = post(served, "/v1/completions", body).json()["choices"][0]["logprobs"]  # the dicts' order as sent
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] >= logprob and len(top) <= 4  # (a likelier token may decode alike, e.g. U+FFFD)
        assert list(top.values()) == sorted(top.values(), reverse=True)  # the sampled one last, if outside
    lp = post(served, "/v1/completions", {**body, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]


def test_completion_logprobs_shape_and_echo(client):
    r = completion(client, prompt="echo me", max_tokens=5, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert max(top.values()) == logprob and top[token] == logprob
    echoed = completion(client, prompt="echo me", max_tokens=5, echo=True, **GREEDY).choices[0].text
    assert echoed == "echo me" + r.choices[0].text
    assert streamed_text(client, prompt="echo me", max_tokens=5, echo=True, **GREEDY)[0] == echoed


def test_logprobs_are_the_models_own_distribution(client):
    """vLLM's default logprobs_mode (raw_logprobs): what sampling settings did to the draw does not
    show in the logprobs. A token's logprob, sampled under temperature, top_k, penalties and bias,
    is the one scoring the same text gives (echo, max_tokens 0)."""
    prompt = [114, 97, 119]
    sampled = completion(client, prompt=prompt, max_tokens=6, temperature=1.5, presence_penalty=1.0, seed=2,
                         logprobs=3, logit_bias={"101": 3},
                         extra_body={"top_k": 2, "ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = sampled.choices[0].logprobs
    assert all(len(top) >= 3 and min(top.values()) > -100 for top in lp.top_logprobs)  # top_k cut none of them
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    scored = completion(client, prompt=prompt + ids, max_tokens=0, echo=True, logprobs=0).choices[0].logprobs
    np.testing.assert_allclose(scored.token_logprobs[len(prompt):], lp.token_logprobs, atol=2e-4)


def test_echo_with_logprobs_scores_the_prompt(served, client):
    """OpenAI's way to score a text: echo, logprobs and max_tokens 0 give the prompt alone, each of
    its tokens with its logprob (the first has none), as vLLM serves them; vLLM's `prompt_logprobs`
    gives the same numbers in its own shape, on completions and on chat."""
    prompt = "score this text"
    ids = served[1].tokenizer.encode(prompt)
    scored = completion(client, prompt=prompt, max_tokens=0, echo=True, logprobs=1, **GREEDY)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert choice.text == prompt and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:]) and all(len(top) in (1, 2) for top in lp.top_logprobs[1:])
    vllm_shape = choice.model_extra["prompt_logprobs"]
    assert vllm_shape[0] is None and len(vllm_shape) == len(ids)
    for token, logprob, entry in zip(ids[1:], lp.token_logprobs[1:], vllm_shape[1:]):
        assert entry[str(token)]["logprob"] == logprob and entry[str(token)]["rank"] >= 1
    # with generated tokens after the prompt, streamed or not, and prompt_logprobs alone
    plain = completion(client, prompt=prompt, max_tokens=4, logprobs=1, **GREEDY).choices[0]
    both = completion(client, prompt=prompt, max_tokens=4, echo=True, logprobs=1, **GREEDY).choices[0]
    assert both.text == prompt + plain.text and both.logprobs.tokens == lp.tokens + plain.logprobs.tokens
    assert both.logprobs.token_logprobs[:len(ids)] == lp.token_logprobs
    assert both.logprobs.text_offset[len(ids):] == [len(prompt) + o for o in plain.logprobs.text_offset]
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True,
                                                             logprobs=1, stream=True, **GREEDY) if c.choices]
    assert "".join(c.text for c in chunks) == both.text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs] == both.logprobs.token_logprobs
    alone = completion(client, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert alone.choices[0].model_extra["prompt_logprobs"] == [
        None, *({str(t): e[str(t)]} for t, e in zip(ids[1:], vllm_shape[1:]))]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 2})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert all(len(entry) in (2, 3) for entry in chat.model_extra["prompt_logprobs"][1:])


def test_whole_vocabulary_logprobs_over_http(served, client):
    """The test server runs with --max-logprobs -1: completions' logprobs=-1 and chat's top_logprobs=-1
    give every token of the vocabulary per generated token, whose probabilities sum to 1 (completions
    name tokens by id here: byte tokens that decode alike would share a name); a count past 20 gives
    that many, in rank order."""
    vocab = served[1].engine.model_config.vocab_size
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 1.0, "seed": 5, "logprobs": -1,
            "return_tokens_as_token_ids": True}
    lp = post(served, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == 3
    for token, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert len(top) == vocab and token in top
        assert abs(sum(math.exp(v) for v in top.values()) - 1) < 1e-4
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, logprobs=True, top_logprobs=-1,
                                       **GREEDY)
    for entry in r.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == vocab and entry.top_logprobs[0].logprob == entry.logprob
        assert abs(sum(math.exp(t.logprob) for t in entry.top_logprobs) - 1) < 1e-4
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, logprobs=True, top_logprobs=30,
                                       **GREEDY)
    for entry in r.choices[0].logprobs.content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 30 and tops == sorted(tops, reverse=True)
    r = post(served, "/v1/chat/completions", {"model": MODEL, "messages": messages, "logprobs": True,
                                              "top_logprobs": vocab + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert "more than the vocabulary" in r.json()["error"]["message"]


def test_entropies_over_http_as_offline(client, offline):
    """jaxserve's `return_entropy`: each choice's `entropies`, one per generated token, equal to the
    offline API's (computed in the step); streamed, each chunk carries those of its tokens. Absent
    unless asked for."""
    prompt = [114, 97, 119]
    want = offline.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                                         return_entropy=True),
                            use_tqdm=False)[0].outputs[0].entropies
    extra = {"ignore_eos": True, "return_entropy": True}
    got = completion(client, prompt=prompt, max_tokens=5, temperature=0.0, extra_body=extra).choices[0]
    np.testing.assert_allclose(got.model_extra["entropies"], want, atol=1e-5, rtol=0)
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0, stream=True,
                                       extra_body=extra)
    streamed = [e for c in chunks for choice in c.choices for e in (choice.model_extra.get("entropies") or [])]
    np.testing.assert_allclose(streamed, want, atol=1e-5, rtol=0)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0.0,
                                          extra_body=extra).choices[0]
    assert len(chat.model_extra["entropies"]) == 4 and all(e > 0 for e in chat.model_extra["entropies"])
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0.0,
                                            stream=True, extra_body=extra)
    streamed = [e for c in chunks for choice in c.choices for e in (choice.model_extra.get("entropies") or [])]
    assert streamed == chat.model_extra["entropies"]
    plain = completion(client, prompt=prompt, max_tokens=2, **GREEDY).choices[0]
    assert "entropies" not in plain.model_extra
