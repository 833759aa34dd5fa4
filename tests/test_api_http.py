"""The HTTP surface of the real server: routes (health, models, version, vLLM's ping / load /
invocations, tokenize / detokenize), OpenAI's error bodies, the API key, CORS, request logging,
served model names, and serving without blocking the event loop or compiling."""

from __future__ import annotations

import asyncio
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import numpy as np
import openai
import pytest
from server import MAX_MODEL_LEN, MESSAGES, MODEL, Server, free_port, post

from api.app import MAX_REQUEST_BODY_BYTES, create_app
from api.cors import CorsPolicy
from api.limits import Limits
from jaxserve.config.profiler import ProfilerConfig, profiler_config_from_env
from jaxserve.engine.profiling import Profiler


def test_health_and_models(served, client):
    assert httpx.get(served[0].url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert card.model_extra["root"] == MODEL and card.model_extra["permission"][0]["allow_sampling"]  # vLLM's fields
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert httpx.get(served[0].url + "/version").json()["version"]


BAD_REQUESTS = [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, None),  # (too deep to parse)
    ("/v1/completions", {"model": "nope", "prompt": "a"}, 404, "model"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", '{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "a", "top_p": Infinity}', 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "seed": 10**30}, 400, "seed"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "a", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("/v1/completions", {"prompt": "a", "n": 16385}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "stop": [str(i) for i in range(65)]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "logprobs": 10**6}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": -2}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": -1, "echo": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "return_entropy": "yes"}, 400, "return_entropy"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "a", "use_beam_search": True, "top_k": 5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "a", "bad_words": ["  "]}, 400, "bad_words"),
    ("/v1/completions", {"prompt": "a", "priority": 1}, 400, "priority"),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": [99999]}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, 400, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "a", "user": 5}, 400, "user"),
    ("/v1/completions", {"prompt": "a", "logit_bias": [1, 2]}, 400, "logit_bias"),
    ("/v1/responses", {"input": "a", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ("/v1/responses", {"input": "a " * MAX_MODEL_LEN}, 400, "input"),  # (the Responses field, not chat's)
    ("/v1/completions", {"prompt": "a", "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {"prompt": "a", "model": 5}, 400, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "metadata": "x"}, 400, "metadata"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "parallel_tool_calls": "x"}, 400,
     "parallel_tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "modalities": ["text", "audio"]}, 400,
     "modalities"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "audio": {"voice": "alloy"}}, 400,
     "audio"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "web_search_options": {}}, 400,
     "web_search_options"),
    ("/v1/completions", {"prompt": "a", "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"structural_tag": "x"}}, 400, "structured_outputs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "echo": True, "logprobs": True}, 400,
     "echo"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "frequency_penalty": "x"}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "(unclosed"}, 400, "guided_regex"),
    ("/v1/completions", {"prompt": "a", "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {"prompt": "a", "guided_choice": ["a"], "guided_regex": "b"}, 400, "guided_choice"),
    ("/v1/completions", {"prompt": "a", "grammar": "root ::= (("}, 400, "grammar"),
    ("/v1/completions", {"prompt": "a", "grammar": "root ::= \"a\"", "json_schema": {}}, 400, "json_schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"},
     400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                        "function": {"name": "g"}}},
     400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                              "top_logprobs": 10**6}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", [1, 2]]}, 400, "prompt"),  # strings and token ids mixed
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": 7, "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": 3}, 400,
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "chat_template_kwargs": {"conversations": []}}, 400, "chat_template_kwargs"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(served, client, path, body, status, param):
    r = post(served, path, body)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    ok = client.completions.create(model=MODEL, prompt="still fine", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_default_max_tokens_and_unknown_routes(served):
    r = post(served, "/v1/completions", {"prompt": "a", "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16  # the completions API's default
    r = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "ignore_eos": True})
    assert r.json()["usage"]["total_tokens"] == MAX_MODEL_LEN  # chat: the rest of the context
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, served[0].url + path)
        assert r.status_code == status and r.json()["error"]["message"]


def test_too_long_prompt_names_both_lengths(served):
    r = post(served, "/v1/completions", {"prompt": "x" * (MAX_MODEL_LEN - 10), "max_tokens": 20})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert str(MAX_MODEL_LEN) in message and str(MAX_MODEL_LEN - 10) in message and str(MAX_MODEL_LEN + 10) in message
    r = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * MAX_MODEL_LEN}]})
    assert r.status_code == 400 and "leave no room for an output token" in r.json()["error"]["message"]


def test_a_request_the_engine_refuses_gets_a_400_before_its_stream(served):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "min_tokens": 2, "stream": True,
            "stop_token_ids": list(range(40))}
    r = post(served, "/v1/completions", body)
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"]


def test_a_body_over_the_limit_is_a_413(served):
    """--max-request-body-bytes (16 MiB by default): a larger body is a 413 with OpenAI's error body
    naming the limit, whether it says its length (refused before it is sent) or comes in chunks
    (refused once the limit is passed); a server with a lower limit serves the bodies under it."""
    def send(url: str, body: bytes, chunked: bool) -> httpx.Response:
        content = (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)) if chunked else body
        return httpx.post(url + "/v1/completions", content=content, headers={"Content-Type": "application/json"},
                          timeout=60)

    over = b'{"prompt": "' + b"a" * MAX_REQUEST_BODY_BYTES + b'", "max_tokens": 1}'
    for chunked in (False, True):
        r = send(served[0].url, over, chunked)
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert f"limit of {MAX_REQUEST_BODY_BYTES} bytes" in error["message"] and "--max-request-body-bytes" in \
            error["message"] and error["type"] == "invalid_request_error"
    small = Server(create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), max_request_body_bytes=100), free_port())
    try:
        fits = b'{"prompt": "a", "max_tokens": 1}'
        for chunked in (False, True):
            assert send(small.url, fits, chunked).status_code == 200
            r = send(small.url, fits[:-1] + b", " + b" " * 100 + b"}", chunked)
            assert r.status_code == 413 and "limit of 100 bytes" in r.json()["error"]["message"]
    finally:
        small.stop()


def test_api_key_guards_v1_routes(served):
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), api_key="s3cret")

    async def check():
        test = app.test_client()
        assert (await test.get("/health")).status_code == 200
        denied = await test.get("/v1/models")
        assert denied.status_code == 401 and (await denied.get_json())["error"]["code"] == "invalid_api_key"
        wrong = await test.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert (await test.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status_code == 200
        assert (await test.post("/invocations", json={"prompt": "a"})).status_code == 401
        assert (await test.get("/is_sleeping")).status_code == 401  # (the trainer's controls too)
        assert (await test.get("/version")).status_code == 200
        assert "X-Request-Id" not in (await test.get("/health")).headers

    asyncio.run(check())


def test_several_api_keys_and_request_id_headers(served):
    """vLLM's --api-key takes several keys (any one of them serves) and --enable-request-id-headers
    answers with the request's X-Request-Id, else a new one."""
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), api_key=["k1", "k2"], request_id_headers=True)

    async def check():
        test = app.test_client()
        for key, status in (("k1", 200), ("k2", 200), ("k3", 401)):
            assert (await test.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status_code == status
        assert (await test.get("/health", headers={"X-Request-Id": "abc-1"})).headers["X-Request-Id"] == "abc-1"
        given = [(await test.get("/health")).headers["X-Request-Id"] for _ in range(2)]
        assert given[0] != given[1] and all(len(g) == 32 for g in given)

    asyncio.run(check())


def test_a_root_path_serves_the_api_under_its_prefix_and_without_it(served):
    """vLLM's --root-path (FastAPI's root_path): behind a proxy the routes answer under the prefix and
    without it (a proxy that strips it); the prefix is not matched inside a name, the prefix alone is
    redirected to itself with a slash, the OpenAPI document names it as the server's URL, and the
    docs pages load the document under it."""
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), api_key="k", root_path="/llm/")

    async def check():
        test = app.test_client()
        key = {"Authorization": "Bearer k"}
        for path in ("/llm/v1/models", "/v1/models"):
            assert (await test.get(path, headers=key)).status_code == 200
        assert (await test.get("/llm/v1/models")).status_code == 401  # (the key guards it under the prefix)
        assert (await test.get("/llmv1/models", headers=key)).status_code == 404
        assert (await test.get("/llm/")).status_code == (await test.get("/")).status_code == 200  # (the playground)
        redirect = await test.get("/llm", query_string={"a": "1"})
        assert redirect.status_code == 308 and redirect.headers["location"] == "/llm/?a=1"
        assert (await (await test.get("/llm/openapi.json")).get_json())["servers"] == [{"url": "/llm"}]
        assert "/llm/openapi.json" in await (await test.get("/docs")).get_data(as_text=True)

    asyncio.run(check())


def test_profiling_routes_trace_the_process_where_profiling_is_on(served, tmp_path, monkeypatch):
    """vLLM's POST /start_profile and /stop_profile: served with a profiler config (else 404s, as
    vLLM's), guarded by the API key; the trace of a request is written under the directory; a second
    start, or a stop with none running, is a 400. VLLM_TORCH_PROFILER_DIR turns profiling on too."""
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), api_key="k", profiler=ProfilerConfig(str(tmp_path)))
    plain = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260))
    key = {"Authorization": "Bearer k"}

    async def check():
        test = app.test_client()
        assert (await test.post("/start_profile")).status_code == 401
        assert [(await test.post(path, headers=key)).status_code for path in ("/start_profile", "/start_profile")] \
            == [200, 400]
        body = {"model": MODEL, "prompt": "profiled", "max_tokens": 2}
        assert (await test.post("/v1/completions", json=body, headers=key)).status_code == 200
        assert [(await test.post(path, headers=key)).status_code for path in ("/stop_profile", "/stop_profile")] \
            == [200, 400]
        assert (await plain.test_client().post("/start_profile")).status_code == 404

    asyncio.run(check())
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    assert ProfilerConfig.parse(profiler_config_from_env()) == ProfilerConfig(str(tmp_path))
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR")
    assert profiler_config_from_env() is None and ProfilerConfig.parse({"profiler": None}) is None
    with pytest.raises(ValueError, match="add \"profiler\""):
        ProfilerConfig.parse({"torch_profiler_dir": str(tmp_path)})
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="the profiler's directory"):
        Profiler(ProfilerConfig(str(tmp_path / "file" / "traces"))).start()


def test_the_playground_page_and_its_files_are_served_unless_turned_off(served):
    """GET / is the playground (tests/test_playground.py drives it in a browser); its files are the
    package's own, served as modules; --disable-playground (llama.cpp's --no-webui) turns it all off."""
    page = httpx.get(served[0].url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert "no-cache" in page.headers["cache-control"]
    assert "data-api-key" not in page.text  # (no --api-key here)
    names = re.findall(r'(?:src|href)="playground/([^"]+)"', page.text)
    names += re.findall(r'from "\./([^"]+)"', httpx.get(served[0].url + "/playground/playground.js").text)
    assert sorted(names) == ["api.js", "playground.css", "playground.js", "tokens.js"]
    for name in names:
        r = httpx.get(served[0].url + "/playground/" + name)
        kind = "text/css" if name.endswith(".css") else "javascript"
        assert r.status_code == 200 and kind in r.headers["content-type"] and "no-cache" in r.headers["cache-control"]
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), playground=False, api_key="k")

    async def statuses():
        test = app.test_client()
        return [(await test.get(path)).status_code for path in ("/", "/playground/playground.js", "/health")]

    assert asyncio.run(statuses()) == [404, 404, 200]
    keyed = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), api_key="k")
    assert 'data-api-key="required"' in asyncio.run(_text(keyed, "/"))


async def _text(app, path: str) -> str:
    return (await (await app.test_client().get(path)).get_data()).decode()


def test_requests_are_logged_when_asked(served, caplog):
    """--enable-log-requests: one log line per request, with its id and prompt length."""
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), log_requests=True)

    async def check():
        response = await app.test_client().post("/v1/completions", json={"model": MODEL, "prompt": "abc",
                                                                          "max_tokens": 1})
        return await response.get_json()

    with caplog.at_level("INFO", logger="api.generation"):
        body = asyncio.run(check())
    (line,) = [r.getMessage() for r in caplog.records if r.name == "api.generation"]
    assert body["id"] in line and "[3]" in line


def test_cors_lets_web_pages_call_the_api(served):
    """vLLM's default CORS policy (any origin, method and header; no credentials) over HTTP: the
    preflight is answered before the API key is asked for, and answers (errors too) name the origin.
    A narrower policy refuses other origins, methods and headers."""
    origin = {"Origin": "https://app.example"}
    preflight = httpx.options(served[0].url + "/v1/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, x-stainless-os"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, x-stainless-os"
    answered = post(served, "/v1/completions", {"prompt": "a", "max_tokens": 1})
    assert "access-control-allow-origin" not in answered.headers  # no Origin: not a browser's cross-origin call
    for r in (httpx.post(served[0].url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=origin),
              httpx.post(served[0].url + "/v1/completions", json={"prompt": "a", "temperature": -1}, headers=origin),
              httpx.get(served[0].url + "/v1/models", headers=origin)):
        assert r.status_code in (200, 400) and r.headers["access-control-allow-origin"] == "*"

    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), api_key="k", cors=CorsPolicy(
        allowed_origins=("https://app.example",), allowed_methods=("GET", "POST"), allowed_headers=("authorization",),
        allow_credentials=True))

    def ask(origin: str, method: str = "POST", headers: str = "authorization"):
        return {"Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers}

    async def check():
        test = app.test_client()
        ok = await test.options("/v1/models", headers=ask("https://app.example"))
        assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert ok.headers["Access-Control-Allow-Credentials"] == "true" and "Origin" in ok.headers["Vary"]
        assert ok.headers["Access-Control-Allow-Methods"] == "GET, POST"
        for refused, what in ((ask("https://evil.example", "DELETE"), "origin, method"),
                              (ask("https://app.example", headers="x-secret"), "headers")):
            r = await test.options("/v1/models", headers=refused)
            assert r.status_code == 400 and (await r.get_data(as_text=True)) == f"Disallowed CORS {what}"
        assert "Access-Control-Allow-Origin" not in (await test.options("/v1/models", headers=ask("https://e.example")
                                                                         )).headers
        denied = await test.get("/v1/models", headers={"Origin": "https://app.example"})  # no key: 401, readable
        assert denied.status_code == 401 and denied.headers["Access-Control-Allow-Origin"] == "https://app.example"
        other = await test.get("/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer k"})
        assert other.status_code == 200 and "Access-Control-Allow-Origin" not in other.headers

    asyncio.run(check())


def test_several_served_model_names(served):
    """vLLM's `--served-model-name A B`: requests may name either, and answers carry the name asked
    for (the first where a request names none); /v1/models lists both."""
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260, other_model_names=("alias",)))

    async def check():
        test = app.test_client()
        listed = await (await test.get("/v1/models")).get_json()
        assert [card["id"] for card in listed["data"]] == [MODEL, "alias"]
        assert (await (await test.get("/v1/models/alias")).get_json())["id"] == "alias"
        answer = await test.post("/v1/completions", json={"model": "alias", "prompt": "a", "max_tokens": 1})
        assert answer.status_code == 200 and (await answer.get_json())["model"] == "alias"
        unnamed = await test.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
        assert (await unnamed.get_json())["model"] == MODEL
        unknown = await test.post("/v1/completions", json={"model": "other", "prompt": "a", "max_tokens": 1})
        assert unknown.status_code == 404 and "'alias'" in (await unknown.get_json())["error"]["message"]

    asyncio.run(check())


def test_prompts_are_tokenized_off_the_event_loop(served, monkeypatch):
    """While a prompt is tokenized (seconds for megabytes of text) the server goes on answering: here
    the tokenizing of one prompt waits until /health has been answered, which the event loop could
    not do if it were the one tokenizing."""
    tokenizer = served[1].tokenizer
    entered, answered = threading.Event(), threading.Event()
    encode = tokenizer.encode

    def held_encode(text, add_special_tokens=True):
        if text == "held up":
            entered.set()
            assert answered.wait(60)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", held_encode)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, served, "/v1/completions", {"model": MODEL, "prompt": "held up", "max_tokens": 2})
        assert entered.wait(60)
        assert httpx.get(served[0].url + "/health", timeout=30).status_code == 200
        answered.set()
        assert pending.result().status_code == 200


def test_vllm_routes_ping_load_invocations(served, monkeypatch):
    """vLLM's /ping (GET and POST), /load (the requests being generated) and /invocations (chat or
    completions, by the body)."""
    url = served[0].url
    assert httpx.get(url + "/ping").status_code == 200 and httpx.post(url + "/ping").status_code == 200
    assert httpx.get(url + "/load").json() == {"server_load": 0, "queued_requests": 0, "queued_tokens": 0}
    generate, resume = served[1].generate, threading.Event()

    async def held(*args, **options):  # up to the first text, then nothing until the test has read the load
        async for update in generate(*args, **options):
            yield update
            while update.text and not resume.is_set():
                await asyncio.sleep(0.01)

    monkeypatch.setattr(served[1], "generate", held)
    body = {"model": MODEL, "prompt": "load", "max_tokens": 20, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert httpx.get(url + "/load").json()["server_load"] == 1
        resume.set()
        list(lines)
    assert httpx.get(url + "/load").json() == {"server_load": 0, "queued_requests": 0, "queued_tokens": 0}
    chat = post(served, "/invocations", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] <= 2
    completion = post(served, "/invocations", {"prompt": "hi", "max_tokens": 2}).json()
    assert completion["object"] == "text_completion"
    assert post(served, "/invocations", {"input": "hi"}).status_code == 400


def test_tokenize_and_detokenize(served):
    r = post(served, "/tokenize", {"model": MODEL, "prompt": "héllo"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == list("héllo".encode()) and body["count"] == 6 and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] is None
    named = post(served, "/tokenize", {"prompt": "hi", "return_token_strs": True}).json()  # vLLM's
    assert named["token_strs"] == served[1].tokenizer.hf.convert_ids_to_tokens(named["tokens"]) == ["h", "i"]
    chat = post(served, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len(served[1].tokenizer.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False))
    opened = post(served, "/tokenize", {"messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "Once"}],
                                        "add_generation_prompt": False, "continue_final_message": True}).json()
    assert opened["tokens"] == served[1].tokenizer.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce", add_special_tokens=False)
    assert post(served, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": "héllo"}
    assert post(served, "/detokenize", {"tokens": [1, -1]}).status_code == 400
    assert post(served, "/tokenize", {"prompt": "x", "model": "other"}).status_code == 404


TRACE, COMPILE = "/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration"


def test_serving_compiles_nothing_after_warm_up(served, client):
    """After warm-up no request through the HTTP server traces or compiles: a mix of lengths (one
    prompt prefilled in chunks), batch sizes (up to the server's 16 sequences, and more waiting),
    sampling controls, logprobs, grammars, tools, beam search and the Responses API, streamed and
    not. The server runs in this process, so jax.monitoring reports its compilations here; a jit of
    a new function on another thread, in the same window, shows they would be seen."""
    seen = []

    def listener(event: str, duration: float, **kwargs):
        if event in (TRACE, COMPILE):
            seen.append(event)

    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    asks = [
        ("/v1/completions", {"prompt": "x" * (MAX_MODEL_LEN - 40), "max_tokens": 30, "ignore_eos": True}),
        ("/v1/completions", {"prompt": "mixed", "n": 3, "max_tokens": 9, "temperature": 0.8, "seed": 1, "top_k": 5,
                             "top_p": 0.9, "min_p": 0.05, "logprobs": 3, "stop": ["ab"], "presence_penalty": 0.5,
                             "frequency_penalty": 0.3, "repetition_penalty": 1.2, "logit_bias": {"65": 2}}),
        ("/v1/completions", {"prompt": "echo", "max_tokens": 3, "echo": True, "logprobs": 2, "min_tokens": 2,
                             "bad_words": ["ab"], "allowed_token_ids": list(range(60, 120))}),
        ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "n": 3, "use_beam_search": True}),
        ("/v1/completions", {"prompt": "many", "n": 20, "max_tokens": 12, "temperature": 1.0, "stream": True}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, "logprobs": True, "top_logprobs": 2,
                                  "prompt_logprobs": 1}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40, "stream": True,
                                  "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {
                                      "type": "object", "properties": {"a": {"type": "integer"}}}}}}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 30, "tools": tools,
                                  "tool_choice": {"type": "function", "function": {"name": "f"}}}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "tools": tools, "guided_choice": ["yes"]}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 5, "stream": True}),
    ]

    async def ask_all():
        async with httpx.AsyncClient(base_url=served[0].url, timeout=120) as http:
            answers = await asyncio.gather(*(http.post(path, json={"model": MODEL, **body}) for path, body in asks))
        return [answer.status_code for answer in answers]

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        statuses = asyncio.run(ask_all())
        for path, body in asks:  # and each alone
            assert post(served, path, {"model": MODEL, **body}).status_code == 200, (path, body)
        compiled_by_serving = list(seen)
        elsewhere = threading.Thread(target=lambda: jax.jit(lambda x: x * 5 - 2)(np.arange(5)))  # as the engine's
        elsewhere.start()
        elsewhere.join()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert statuses == [200] * len(asks)
    assert compiled_by_serving == []
    assert COMPILE in seen
