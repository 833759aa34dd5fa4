"""The OpenAPI document: /openapi.json describes the generating routes' request bodies (from the
request models that check them) and their answers."""

from __future__ import annotations

import asyncio

import httpx
from server import MAX_MODEL_LEN, MODEL

from api.app import create_app
from api.limits import Limits


def request_schema(document: dict, path: str) -> dict:
    return document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def test_openapi_json_has_the_chat_completions_and_responses_request_schemas(served):
    r = httpx.get(served[0].url + "/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    document = r.json()
    assert document["openapi"].startswith("3.") and document["info"]["title"] == "jaxserve"
    chat, completions, responses = (request_schema(document, path) for path in (
        "/v1/chat/completions", "/v1/completions", "/v1/responses"))
    assert (chat["title"], completions["title"], responses["title"]) == (
        "ChatCompletionRequest", "CompletionRequest", "ResponsesRequest")
    assert {"messages", "tools", "logprobs", "top_logprobs", "response_format"} <= set(chat["properties"])
    assert {"prompt", "echo", "logprobs", "stop"} <= set(completions["properties"])
    assert {"input", "instructions", "max_output_tokens", "text"} <= set(responses["properties"])
    assert completions["required"] == ["prompt"] and responses["required"] == ["input"]
    # the bounds the models check, in the schema; unknown fields are allowed (and ignored)
    temperature = {"type": "number", "minimum": 0.0, "maximum": 2.0}
    for schema in (chat, completions, responses):
        assert temperature in schema["properties"]["temperature"]["anyOf"]
    assert {"type": "integer", "minimum": 1, "maximum": 16384} in chat["properties"]["n"]["anyOf"]
    assert chat["additionalProperties"] is True
    answers = {path: document["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
               for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses")}
    assert answers["/v1/chat/completions"]["properties"]["object"]["const"] == "chat.completion"
    assert answers["/v1/responses"]["properties"]["object"]["const"] == "response"
    messages = request_schema(document, "/v1/messages")  # Anthropic's
    assert messages["title"] == "MessagesRequest" and set(messages["required"]) == {"max_tokens", "messages"}
    answer = document["paths"]["/v1/messages"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer["properties"]["type"]["const"] == "message"
    assert request_schema(document, "/v1/messages/count_tokens")["required"] == ["messages"]
    docs = httpx.get(served[0].url + "/docs")
    assert docs.status_code == 200 and "swagger-ui" in docs.text and "/openapi.json" in docs.text


def test_disable_fastapi_docs_serves_no_document_and_no_pages(served):
    """vLLM's --disable-fastapi-docs: the document and its pages are gone; the API is not."""
    app = create_app(served[1], Limits(MODEL, MAX_MODEL_LEN, 260), docs=False)

    async def statuses():
        test = app.test_client()
        return [(await test.get(path)).status_code for path in ("/openapi.json", "/docs", "/redocs", "/v1/models")]

    assert asyncio.run(statuses()) == [404, 404, 404, 200]
