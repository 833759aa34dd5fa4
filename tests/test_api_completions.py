"""The completions API through the real server: prompt forms, n choices from one prefill, and
vLLM's return_token_ids."""

from __future__ import annotations

from server import MODEL, completion, post

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
GREEDY_12 = dict(max_tokens=12, **GREEDY)


def test_completion_prompt_forms(served, client):
    r = client.completions.create(model=MODEL, prompt="Once upon", **GREEDY_12)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.choices[0].finish_reason == "length"
    ids = list(b"Once upon")
    for prompt in (ids, ["Once upon", "a time"], [ids, list(b"a time")]):
        r2 = client.completions.create(model=MODEL, prompt=prompt, **GREEDY_12)
        assert r2.choices[0].text == r.choices[0].text
        assert [c.index for c in r2.choices] == list(range(len(r2.choices)))
    assert r2.usage.prompt_tokens == len(ids) + len(b"a time") and r2.usage.completion_tokens == 24
    as_ints = {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop_token_ids": [97, 98]}
    as_floats = {**as_ints, "prompt": [float(t) for t in ids], "max_tokens": 12.0, "stop_token_ids": [97.0, 98.0]}
    ints, floats = post(served, "/v1/completions", as_ints), post(served, "/v1/completions", as_floats)
    assert floats.status_code == 200 and floats.json()["choices"] == ints.json()["choices"]  # whole floats: ints
    raw = post(served, "/v1/chat/completions", {"prompt": "Once upon", "max_tokens": 12, "temperature": 0,
                                                "ignore_eos": True})
    assert raw.status_code == 200 and raw.json()["choices"][0]["message"]["content"] == r.choices[0].text


def test_n_choices_share_one_prefill(served, client):
    scheduler = served[1].engine.scheduler
    prompt = "n choices from one prefill"
    before = scheduler.num_prompt_tokens_computed
    r = completion(client, prompt=prompt, n=4, max_tokens=16, temperature=1.0, seed=7,
                   extra_body={"ignore_eos": True})
    assert scheduler.num_prompt_tokens_computed - before == len(prompt) - 1 + 4
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3] and len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == 64 and r.usage.prompt_tokens == len(prompt)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3,
                                          max_tokens=4, stream=True, **GREEDY)
    texts = {}
    for chunk in chat:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 1  # greedy: three equal choices
    two = completion(client, prompt=["a", "b"], n=2, max_tokens=3, **GREEDY)
    assert [c.index for c in sorted(two.choices, key=lambda c: c.index)] == [0, 1, 2, 3]


def test_return_token_ids_as_vllm(served, client):
    """vLLM's return_token_ids: the prompt's ids and each choice's, whole and streamed (the prompt's in
    each choice's first chunk, the choice's spread over its chunks), in completions and chat."""
    ask = dict(max_tokens=6, logprobs=0, n=2, temperature=1.0, seed=5,
               extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True})
    whole = completion(client, prompt=["one prompt", "another one"], **ask)
    for c in whole.choices:
        prompt = ["one prompt", "another one"][c.index // 2]
        assert c.model_extra["prompt_token_ids"] == post(served, "/tokenize", {"prompt": prompt}).json()["tokens"]
        assert c.model_extra["token_ids"] == [int(t.removeprefix("token_id:")) for t in c.logprobs.tokens]
    streamed: dict[int, list] = {}
    prompts: dict[int, list] = {}
    for chunk in completion(client, prompt=["one prompt", "another one"], stream=True, **ask):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.model_extra["token_ids"])
            if c.model_extra.get("prompt_token_ids") is not None:
                assert c.index not in prompts
                prompts[c.index] = c.model_extra["prompt_token_ids"]
    assert streamed == {c.index: c.model_extra["token_ids"] for c in whole.choices}
    assert prompts == {c.index: c.model_extra["prompt_token_ids"] for c in whole.choices}
    free = completion(client, prompt="held", max_tokens=12, **GREEDY).choices[0].text
    stop = dict(prompt="held", max_tokens=12, stop=[free[4:7]], temperature=0.0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    cut = completion(client, **stop).choices[0]
    assert cut.finish_reason == "stop" and 0 < len(cut.model_extra["token_ids"]) < 12
    held = [i for chunk in completion(client, stream=True, **stop)
            for c in chunk.choices for i in c.model_extra["token_ids"]]
    assert held == cut.model_extra["token_ids"]  # ids whose text was held back still come, in a later chunk
    messages = [{"role": "user", "content": "ids please"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == post(served, "/tokenize", {"messages": messages}).json()["tokens"]
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.0, stream=True,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert all(c.model_extra.get("prompt_token_ids") is None for c in chunks[1:])
    assert "token_ids" not in chunks[0].choices[0].model_extra  # (the role's chunk, as vLLM's)
    assert [i for c in chunks[1:] for ch in c.choices for i in ch.model_extra["token_ids"]] == \
        chat.choices[0].model_extra["token_ids"]
    plain = completion(client, prompt="x", max_tokens=1).choices[0]
    assert "token_ids" not in plain.model_extra and "prompt_token_ids" not in plain.model_extra
