"""Sampling controls through the real server: max_tokens, seeds, stop strings, logit bias,
min_tokens, penalties, vLLM's token controls, and the model's sampling defaults."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from server import MAX_MODEL_LEN, MESSAGES, MODEL, completion, post, streamed_text

from api.app import create_app
from api.limits import Limits
from checkpoints.default_model import IM_END_ID
from jaxserve import SamplingParams

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.mark.parametrize("field,value", [("max_tokens", 37), ("max_completion_tokens", 37), ("max_tokens", 37.0)])
def test_max_tokens_with_ignore_eos_is_exact(client, field, value):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.7, seed=3,
                                       extra_body={"ignore_eos": True, field: value})
    assert r.usage.completion_tokens == 37 and r.choices[0].finish_reason == "length"


def test_seed_reproducible_over_http(client):
    kw = dict(model=MODEL, prompt="seeded", max_tokens=16, temperature=1.0, top_p=0.9, seed=11,
              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text
    assert client.completions.create(**{**kw, "seed": 12}).choices[0].text != client.completions.create(
        **kw).choices[0].text  # the seed is what fixes the draw


def test_stop_string_from_the_middle_cuts_exactly_there(client):
    free = completion(client, prompt="The story", max_tokens=30, **GREEDY).choices[0].text
    stop = free[10:13]
    assert free.find(stop) == 10
    cut = completion(client, prompt="The story", max_tokens=30, stop=[stop], **GREEDY).choices[0]
    assert cut.text == free[:10] and cut.finish_reason == "stop"
    assert streamed_text(client, prompt="The story", max_tokens=30, stop=stop, **GREEDY) == (free[:10], "stop")
    kept = completion(client, prompt="The story", max_tokens=30, stop=stop,
                      extra_body={"ignore_eos": True, "include_stop_str_in_output": True}, temperature=0.0)
    assert kept.choices[0].text == free[:13]


def test_no_delta_holds_part_of_a_matching_stop_string(client):
    free = completion(client, prompt="held back", max_tokens=30, **GREEDY).choices[0].text
    stop = free[12:16]
    deltas = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="held back", max_tokens=30, stop=stop, stream=True, **GREEDY) if c.choices]
    # the deltas add up to the text before the stop string: none ever carried a piece of it
    assert "".join(deltas) == free[:free.find(stop)]


def test_held_back_text_is_released_when_the_stop_string_does_not_follow(client):
    """Characters that may begin a stop string are held back; when the next token breaks the match,
    or the output ends by its length first, they are released. The output is kept to lowercase
    letters, one token each, so that a stream without a stop string sends one character per delta,
    and a delta of several is text that was held back."""
    ask = dict(prompt="held back", max_tokens=30, temperature=0.0,
               extra_body={"ignore_eos": True, "allowed_token_ids": list(range(ord("a"), ord("z") + 1))})
    free = completion(client, **ask).choices[0].text
    assert len(free) == 30 and free.isalpha()
    assert streamed_text(client, **ask) == (free, "length")
    assert all(len(c.choices[0].text) <= 1 for c in client.completions.create(model=MODEL, stream=True, **ask))
    for start in (10, len(free) - 2):  # the match broken by the next token; cut short by max_tokens
        stop = free[start:start + 2] + "~"  # begins as the output does at `start`, never completes
        whole = completion(client, stop=stop, **ask).choices[0]
        assert (whole.text, whole.finish_reason) == (free, "length")
        deltas = [c.choices[0].text for c in client.completions.create(model=MODEL, stop=stop, stream=True, **ask)
                  if c.choices]
        assert "".join(deltas) == free, stop
        ends = list(itertools.accumulate(map(len, deltas)))
        # the two held characters came in one delta (with what broke the match, or at the end)
        assert any(end - len(delta) <= start and start + 2 <= end for delta, end in zip(deltas, ends)), deltas


def test_logit_bias_forces_every_greedy_token(client):
    r = completion(client, prompt="bias", max_tokens=10, logit_bias={"65": 100}, **GREEDY)
    assert r.choices[0].text == "A" * 10


def test_min_tokens_holds_off_an_eos_that_is_biased_up(client):
    r = completion(client, prompt="eos", max_tokens=20, temperature=0.0, logit_bias={str(IM_END_ID): 100},
                   extra_body={"min_tokens": 5})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"  # 5 tokens, then EOS
    r = completion(client, prompt="eos", max_tokens=20, temperature=0.0, logit_bias={str(IM_END_ID): 100})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("penalties", [
    dict(presence_penalty=1.5), dict(frequency_penalty=2.0), dict(repetition_penalty=1.8),
    dict(presence_penalty=-1.0, frequency_penalty=0.7, repetition_penalty=0.8)])
def test_penalised_greedy_matches_the_offline_api(client, offline, penalties):
    extra = {"ignore_eos": True}
    if "repetition_penalty" in penalties:
        extra["repetition_penalty"] = penalties["repetition_penalty"]
    api_kw = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
    served = completion(client, prompt="aaaa bbbb aaaa", max_tokens=24, temperature=0.0, extra_body=extra, **api_kw)
    want = offline.generate("aaaa bbbb aaaa", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                             **penalties))[0].outputs[0]
    plain = offline.generate("aaaa bbbb aaaa", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert served.choices[0].text == want.text
    assert want.token_ids != plain[0].outputs[0].token_ids  # the penalty did something


def test_vllm_token_controls(served, client):
    """vLLM's allowed_token_ids, skip_special_tokens, truncate_prompt_tokens, bad_words,
    structured_outputs and return_tokens_as_token_ids."""
    r = completion(client, prompt="only these", max_tokens=12, temperature=1.0, seed=3,
                   extra_body={"allowed_token_ids": [65, 66], "ignore_eos": True})
    assert set(r.choices[0].text) == {"A", "B"}
    eos = dict(max_tokens=3, temperature=0.0, logit_bias={str(IM_END_ID): 100})
    kept = completion(client, prompt="eos", **eos, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert kept.choices[0].text == "<|im_end|>" * 3
    joined = completion(client, prompt="eos", **eos, extra_body={"ignore_eos": True, "skip_special_tokens": False,
                                                                 "spaces_between_special_tokens": False})
    assert joined.choices[0].text == "<|im_end|>" * 3  # (the tokenizers library never spaces them, as vLLM finds)
    assert completion(client, prompt="eos", **eos, extra_body={"ignore_eos": True}).choices[0].text == ""
    cut = completion(client, prompt="a prompt cut to its end", max_tokens=1, echo=True,
                     extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text.startswith("end")
    forced = dict(prompt="bias", max_tokens=6, logprobs=0, temperature=0.0, logit_bias={"65": 100})
    banned = completion(client, **forced, extra_body={"bad_words": ["A"], "return_tokens_as_token_ids": True})
    assert completion(client, **forced).choices[0].text == "A" * 6
    assert "token_id:65" not in banned.choices[0].logprobs.tokens and len(banned.choices[0].logprobs.tokens) == 6
    choice = completion(client, prompt="pick", max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    named = completion(client, prompt="ids", max_tokens=3, logprobs=2, temperature=0.0,
                       extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}).choices[0]
    assert len(named.logprobs.tokens) == 3 and all(t.startswith("token_id:") for t in named.logprobs.tokens)
    assert all(k.startswith("token_id:") for top in named.logprobs.top_logprobs for k in top)
    ids = [int(t.removeprefix("token_id:")) for t in named.logprobs.tokens]
    assert post(served, "/detokenize", {"tokens": ids}).json()["prompt"] == named.text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          logprobs=True, top_logprobs=1,
                                          extra_body={"return_tokens_as_token_ids": True})
    assert all(e.token.startswith("token_id:") and e.top_logprobs[0].token.startswith("token_id:")
               for e in chat.choices[0].logprobs.content)


def test_sampling_defaults_of_the_generation_config(served):
    """vLLM's --generation-config auto: the model's settings for the fields a request leaves out
    (temperature 0 here: greedy), its max_new_tokens a cap on every request's max_tokens, and the
    rest of the context where a chat request sets none."""
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260, sampling_defaults={"temperature": 0.0,
                                                                                       "max_tokens": 5}))
    body = {"model": MODEL, "prompt": "Once upon", "ignore_eos": True}

    async def check():
        test = app.test_client()

        async def post(path, **fields):
            response = await test.post(path, json={**body, **fields})
            assert response.status_code == 200
            return await response.get_json()

        capped = await post("/v1/completions", max_tokens=50)
        greedy = await post("/v1/completions", max_tokens=5, temperature=0.0)
        sampled = await post("/v1/completions", max_tokens=5, temperature=1.5, seed=3)
        assert capped["usage"]["completion_tokens"] == 5
        assert capped["choices"][0]["text"] == greedy["choices"][0]["text"] != sampled["choices"][0]["text"]
        chat = await post("/v1/chat/completions", messages=MESSAGES)
        assert chat["usage"]["completion_tokens"] == 5

    asyncio.run(check())
