"""Fuzzing the served API from its own OpenAPI document (/openapi.json) with schemathesis: request
bodies and path parameters that fit the documented schemas, and ones that break them. Whatever is
sent, no answer is a 5xx, every error is OpenAI's body (no stream carries an error event), a body
that breaks the documented request schema is never answered 2xx, every 2xx body fits the documented
response schema, and the server still serves a plain request afterwards.

The default suite draws a few cases per operation and mode, derandomized (the same cases every run);
the slow test draws many more. Generation is kept short (`bounded`): the fuzz is about the API's checks,
not about decoding.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from server import completion, post

# the token counts a body may ask for, at most: a fuzzed n of 16384 or max_tokens of 2**31 would keep the
# engine busy for minutes; and a min_weight_version above the server's holds a request until new weights come
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "min_tokens": 4, "n": 2,
        "min_weight_version": 0}
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
VOCAB = 256  # (jaxserve-tiny's byte tokens)


@dataclasses.dataclass
class Fault:
    operation: str
    mode: str
    what: str
    body: object

    def __str__(self) -> str:
        return f"{self.operation} ({self.mode}): {self.what}\n  body: {json.dumps(self.body, default=repr)[:500]}"


def bounded(body, path: str, data, negative: bool) -> None:
    """Cap the token counts a body asks for (any number: a whole float counts as an integer). Half of
    the time each of the fields the first checks look at (the model, the messages, the prompt) is made
    valid, so that the fuzz reaches the checks behind them (not in a `negative` case: its broken part
    is left as it is)."""
    if not isinstance(body, dict):
        return
    for name, cap in CAPS.items():
        value = body.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    if not any(name in body for name in MAX_TOKENS_FIELDS):
        body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = CAPS["max_tokens"]
    if negative:
        return
    if data.draw(st.booleans(), label="no model"):
        body.pop("model", None)
    if path in ("/v1/chat/completions", "/v1/messages") and data.draw(st.booleans(), label="plain messages"):
        body["messages"] = [{"role": "user", "content": data.draw(st.text(max_size=20))}]
    if path == "/v1/completions" and data.draw(st.booleans(), label="plain prompt"):
        body["prompt"] = data.draw(st.text(min_size=1, max_size=20) |
                                   st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))


def fault(response) -> str | None:
    """What is wrong with an answer, if anything."""
    text = response.content.decode(errors="replace")
    if response.status_code >= 500:
        return f"HTTP {response.status_code}: {text[:300]}"
    if response.status_code >= 400:
        try:
            error = response.json().get("error")
        except (ValueError, AttributeError):
            error = None
        if not (isinstance(error, dict) and isinstance(error.get("message"), str)
                and isinstance(error.get("type"), str)):
            return f"HTTP {response.status_code} without OpenAI's error body: {text[:300]}"
        return None
    for line in text.splitlines() if response.headers.get("content-type", [""])[0].startswith("text/event-stream") \
            else ():
        event = json.loads(line[len("data: "):]) if line.startswith("data: {") else {}
        if event.get("error") or event.get("type") in ("error", "response.failed"):
            return f"an error event in a stream: {line[:300]}"
    return None


def breaks_request_schema(document: dict, operation, body) -> bool:
    """Whether `body`, as sent (after `bounded`), breaks the request body schema `document` gives
    `operation` (False for an operation without a body)."""
    from jsonschema import Draft202012Validator

    content = (document["paths"][operation.path][operation.method.lower()].get("requestBody") or {}).get("content", {})
    schema = content.get("application/json", {}).get("schema")
    if schema is None:
        return False
    return not Draft202012Validator({**schema, "components": document.get("components", {})}).is_valid(body)


def contract_fault(document: dict, case, response, negative: bool) -> str | None:
    """What breaks the documented contract: a 2xx answer to a body the request schema refuses, or a 2xx
    body the response schema does not describe."""
    if not 200 <= response.status_code < 300:
        return None
    if negative and breaks_request_schema(document, case.operation, case.body):
        return f"HTTP {response.status_code} to a body that breaks the request schema"
    try:
        case.operation.validate_response(response, case=case)
    except Exception as e:  # (schemathesis' failure types: what matters is its message)
        return f"HTTP {response.status_code}, a body the response schema does not describe: {str(e)[:500]}"
    return None


def fuzz(url: str, max_examples: int) -> tuple[list[Fault], int]:
    """Every operation of the served document, in both modes, `max_examples` cases each at most: the
    faults found, and the number of requests sent."""
    document = httpx.get(url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(document)
    faults, sent = [], 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
            def run(case, data):
                nonlocal sent
                negative = mode is GenerationMode.NEGATIVE
                bounded(case.body, operation.path, data, negative)
                response = case.call(base_url=url, timeout=120)
                sent += 1
                if what := fault(response) or contract_fault(document, case, response, negative):
                    faults.append(Fault(operation.label, mode.value, what, case.body))

            try:
                run()
            except Unsatisfiable:  # nothing to break: an operation without parameters or body
                assert mode is GenerationMode.NEGATIVE, operation.label
    return faults, sent


def check_fuzz(served, client, max_examples: int) -> None:
    faults, sent = fuzz(served[0].url, max_examples)
    assert sent > 6 * max_examples  # (the generating routes, in both modes)
    assert not faults, "\n".join(map(str, faults[:10]))
    ok = completion(client, prompt="still fine", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_fuzzed_requests_get_no_5xx_and_openai_errors(served, client):
    check_fuzz(served, client, max_examples=20)


@pytest.mark.slow
def test_fuzzed_requests_get_no_5xx_and_openai_errors_many(served, client):
    check_fuzz(served, client, max_examples=1000)


# What the fuzzer found, each a 500 before its fix.
FOUND = [
    # prompt token ids outside the vocabulary were decoded (for echo) before the engine's check refused them
    ("/v1/completions", {"prompt": [2**40], "max_tokens": 1}),
    ("/v1/completions", {"prompt": [-1], "echo": True, "max_tokens": 1}),
    ("/v1/completions", {"prompt": [[1, 2], [-5]], "max_tokens": 1}),
]
# What the contract checks found: each answered 200 (or 500) before its fix, the field taken as absent.
FOUND_ACCEPTED = [
    ("/v1/responses", {"input": "hi", "reasoning": 0.0, "max_output_tokens": 1}, "reasoning"),
    ("/v1/responses", {"input": "hi", "include": "", "max_output_tokens": 1}, "include"),
    ("/v1/responses", {"input": "hi", "tools": {}, "max_output_tokens": 1}, "tools"),
    ("/v1/responses", {"input": "hi", "text": {"format": 0}, "max_output_tokens": 1}, "text"),
    ("/v1/responses", {"input": "encode", "metadata": False, "max_output_tokens": 4}, "metadata"),
    ("/v1/completions", {"prompt": "hi", "bad_words": 0, "max_tokens": 1}, "bad_words"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": 0, "max_tokens": 1}, "stop_token_ids"),
]


@pytest.mark.parametrize("path,body,param", FOUND_ACCEPTED)
def test_a_wrong_falsy_field_is_a_400(served, path, body, param):
    r = post(served, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path,body", FOUND)
def test_what_the_fuzzer_found_is_a_400(served, path, body):
    r = post(served, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"
