"""A model directory without tokenizer files, served on token ids alone (vLLM's skip_tokenizer_init):
offline and over HTTP, prompts are token ids and outputs are token ids with empty text; whatever
needs text is refused, saying why; without the setting, such a directory is refused naming it."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from conftest import SMALL_ENGINE
from server import Server, free_port, post

import run_server
from checkpoints import default_model_dir
from jaxserve import LLM, SamplingParams
from jaxserve.structured_output.grammar import StructuredOutputsParams

PROMPT = [5, 6, 7, 8]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
EOS = 259  # jaxserve-tiny's config.json eos_token_id


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    """jaxserve-tiny's config.json and weights alone: no tokenizer files, no generation_config.json."""
    directory = tmp_path_factory.mktemp("bare")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(default_model_dir() / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def bare_llm(bare_model):
    return LLM(str(bare_model), skip_tokenizer_init=True, **SMALL_ENGINE)


@pytest.fixture(scope="module")
def bare_served(bare_model):
    """The real HTTP server over the bare model, as `run_server.py --skip-tokenizer-init` builds it."""
    from api.app import create_app
    from api.limits import Limits
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.build import build_engine

    engine, tokenizer = build_engine(EngineConfig(model=str(bare_model), skip_tokenizer_init=True, **SMALL_ENGINE))
    assert tokenizer is None
    async_engine = AsyncEngine(engine, tokenizer)
    async_engine.start()
    limits = Limits("bare", engine.config.max_model_len, engine.model_config.vocab_size)
    server = Server(create_app(async_engine, limits), free_port())
    yield server, async_engine
    server.stop()
    async_engine.shutdown()


def test_offline_generates_on_token_ids_as_with_the_tokenizer(bare_llm):
    with_tokenizer = LLM("jaxserve-tiny", **SMALL_ENGINE)
    expected = with_tokenizer.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    by_list, by_dict = bare_llm.generate([PROMPT, {"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    for out in (by_list, by_dict):
        assert out.prompt is None and out.prompt_token_ids == PROMPT
        assert out.outputs[0].token_ids == expected and out.outputs[0].text == ""
    scored = bare_llm.generate([PROMPT], SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1),
                               use_tqdm=False)[0]
    assert scored.outputs[0].text == "" and len(scored.outputs[0].logprobs) == 3
    entries = [*scored.outputs[0].logprobs, *scored.prompt_logprobs[1:]]
    assert all(lp.decoded_token is None for entry in entries for lp in entry.values())


def test_offline_stops_at_the_config_eos_and_stop_token_ids(bare_llm):
    (eos,) = bare_llm.generate([PROMPT], SamplingParams(max_tokens=5, logit_bias={EOS: 100}), use_tqdm=False)
    assert eos.outputs[0].token_ids == [EOS] and eos.outputs[0].finish_reason == "stop"
    first = bare_llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids[0]
    (stop,) = bare_llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[first]),
                                use_tqdm=False)
    assert stop.outputs[0].token_ids == [first] and stop.outputs[0].stop_reason == first


def test_offline_refuses_what_needs_text(bare_llm):
    assert bare_llm.tokenizer is None
    with pytest.raises(ValueError, match="cannot pass text prompts"):
        bare_llm.generate("hello", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="without a tokenizer"):
        bare_llm.chat([{"role": "user", "content": "hello"}])
    with pytest.raises(ValueError, match="Unable to get tokenizer"):  # (vLLM's)
        bare_llm.get_tokenizer()
    for refused in (dict(stop=["x"]), dict(bad_words=["x"]),
                    dict(structured_outputs=StructuredOutputsParams(json_object=True)),
                    dict(dry_sequence_breakers=["x"], dry_multiplier=0.8)):
        with pytest.raises(ValueError, match=f"{next(iter(refused))} needs the model's tokenizer"):
            bare_llm.generate([PROMPT], SamplingParams(**refused), use_tqdm=False)
    assert not bare_llm.engine.has_unfinished()
    dry = SamplingParams(max_tokens=4, dry_multiplier=0.8, dry_sequence_breakers=[])  # (DRY on tokens alone)
    assert len(bare_llm.generate([PROMPT], dry, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_without_the_setting_the_error_names_it(bare_model):
    with pytest.raises(FileNotFoundError, match="no tokenizer files.*skip_tokenizer_init=True"):
        LLM(str(bare_model), **SMALL_ENGINE)
    with pytest.raises(SystemExit, match="--skip-tokenizer-init"):
        run_server.main(["--model", str(bare_model)])
    assert run_server.parse_args(["--skip-tokenizer-init"]).engine.skip_tokenizer_init
    with pytest.raises(SystemExit, match="chat template or --tokenizer needs a tokenizer"):
        run_server.main(["--model", str(bare_model), "--skip-tokenizer-init", "--chat-template", "{{ x }}"])


def test_completions_on_token_ids(bare_served, bare_llm):
    expected = bare_llm.generate([PROMPT, PROMPT[:2]], GREEDY, use_tqdm=False)
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    (choice,) = post(bare_served, "/v1/completions", body).json()["choices"]
    assert choice["text"] == "" and choice["token_ids"] == expected[0].outputs[0].token_ids
    assert choice["prompt_token_ids"] == PROMPT
    both = post(bare_served, "/v1/completions", {**body, "prompt": [PROMPT, PROMPT[:2]]}).json()["choices"]
    assert [c["token_ids"] for c in both] == [o.outputs[0].token_ids for o in expected]
    plain = post(bare_served, "/v1/completions", {**body, "return_token_ids": False}).json()["choices"][0]
    assert "token_ids" not in plain and plain["text"] == ""
    scored = post(bare_served, "/v1/completions", {**body, "logprobs": 1, "echo": True, "prompt_logprobs": 1}
                  ).json()["choices"][0]
    assert scored["text"] == "" and set(scored["logprobs"]["text_offset"]) == {0}
    assert {lp["decoded_token"] for entry in scored["prompt_logprobs"][1:] for lp in entry.values()} == {None}
    assert scored["logprobs"]["tokens"] == [f"token_id:{t}" for t in PROMPT + choice["token_ids"]]
    events = post(bare_served, "/v1/completions", {**body, "stream": True}).text.split("\n\n")
    chunks = [json.loads(e[len("data: "):]) for e in events if e.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ""
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == choice["token_ids"]
    assert httpx.get(bare_served[0].url + "/health").status_code == 200
    assert [m["id"] for m in httpx.get(bare_served[0].url + "/v1/models").json()["data"]] == ["bare"]


def test_what_needs_text_is_a_400(bare_served):
    refused = [("/v1/completions", {"prompt": "hello"}, "'prompt' as token ids"),
               ("/v1/completions", {"prompt": ["a", "b"]}, "'prompt' as token ids"),
               ("/v1/completions", {"prompt": PROMPT, "stop": ["x"]}, "stop needs"),
               ("/v1/completions", {"prompt": PROMPT, "bad_words": ["x"]}, "bad_words needs"),
               ("/v1/completions", {"prompt": PROMPT, "response_format": {"type": "json_object"}},
                "structured_outputs needs"),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "chat needs"),
               ("/invocations", {"messages": [{"role": "user", "content": "hi"}]}, "chat needs"),
               ("/v1/responses", {"input": "hi"}, "/v1/responses needs"),
               ("/tokenize", {"prompt": "hi"}, "/tokenize needs"),
               ("/detokenize", {"tokens": PROMPT}, "/detokenize needs")]
    for path, body, message in refused:
        r = post(bare_served, path, body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (path, r.text)
    assert "--skip-tokenizer-init" in post(bare_served, "/tokenize", {"prompt": "hi"}).json()["error"]["message"]
