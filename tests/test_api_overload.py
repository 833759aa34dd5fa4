"""The shared server under trouble: a full waiting queue (503 + Retry-After), a draining server, a
step that fails (only its requests end, with a 500), per-tenant prefix caches (cache_salt), and
priorities refused under first come, first served. (`test_run_server.py` has the same behaviours
end to end through `python run_server.py`: a real burst, priorities under load, SIGTERM.)"""

from __future__ import annotations

import json

import httpx
from server import MODEL, completion, post
from test_api_metrics import scrape

from api.state import api_state_of


def test_a_full_queue_is_a_503_with_retry_after_before_any_work(served, client):
    bound = served[1].admission
    bound.max_queued_requests = 2
    bound.admit([("queued-elsewhere", [1, 2, 3, 4, 5])])
    try:
        r = post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2})  # one request of two choices
        assert r.status_code == 200
        assert httpx.get(served[0].url + "/load").json()["queued_requests"] == 1
        r = post(served, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})  # two requests: no room
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        error = r.json()["error"]
        assert error["type"] == "server_overloaded" and "--max-num-queued-reqs" in error["message"]
        assert scrape(served)["jaxserve:num_requests_queued"] == 1
        bound.max_queued_requests, bound.max_queued_tokens = None, 8
        r = post(served, "/v1/completions", {"prompt": "a longer prompt than the rest", "max_tokens": 2})
        assert r.status_code == 503 and "--max-num-queued-tokens" in r.json()["error"]["message"]
    finally:
        bound.max_queued_requests = bound.max_queued_tokens = None
        bound.forget(["queued-elsewhere"])
    assert httpx.get(served[0].url + "/load").json()["queued_requests"] == 0
    assert completion(client, prompt="hi", max_tokens=2).choices[0].finish_reason in ("length", "stop")


def test_a_draining_server_says_503_on_health_and_to_new_requests(served, client):
    state = api_state_of(served[0].app)
    state.draining = True
    try:
        health = httpx.get(served[0].url + "/health")
        r = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        for answer in (health, r):  # (the same 503: its code, and when to try again)
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down"
            assert answer.headers["Retry-After"] == "1"
        assert httpx.get(served[0].url + "/metrics").status_code == 200  # (still scraped)
    finally:
        state.draining = False
    assert httpx.get(served[0].url + "/health").status_code == 200


MARK = 4242  # the seed of the requests whose steps fail


def test_a_failing_step_ends_only_its_requests_and_the_engine_goes_on(served, client, monkeypatch, caplog):
    runner = served[1].engine.runner
    launch = runner.launch

    def failing(batch, *staged):
        if any(row.seed == MARK for row in batch.rows):
            raise RuntimeError("injected step failure")
        return launch(batch, *staged)

    monkeypatch.setattr(runner, "launch", failing)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "seed": MARK}
    r = post(served, "/v1/completions", body)
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "internal_error" and "injected step failure" in error["message"]
    assert sum(record.exc_info is not None for record in caplog.records) == 1  # the traceback, logged once

    with httpx.stream("POST", served[0].url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": MARK,
            "stream": True}) as s:
        events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    error = json.loads(events[-2])["error"]
    assert events[-1] == "[DONE]" and "injected step failure" in error["message"] and error["type"] == "internal_error"

    # the other requests, before and after, are served; no page is left behind
    for _ in range(2):
        assert completion(client, prompt="hi", max_tokens=3, seed=1).usage.completion_tokens >= 1
    assert served[1].is_ready and httpx.get(served[0].url + "/health").status_code == 200
    assert scrape(served)["jaxserve:kv_pages_used"] == 0


def test_cache_salt_separates_prefix_cache_hits(served, client):
    prompt = "a prompt long enough to fill some pages of the prefix cache: " * 3

    def cached(**salt) -> int:
        r = completion(client, prompt=prompt, max_tokens=1, extra_body=salt)
        return r.usage.prompt_tokens_details.cached_tokens

    cached(cache_salt="tenant-a")
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0 and cached() == 0  # another tenant, or none, sees no hit
    assert cached() > 0 and cached(cache_salt="tenant-b") > 0
    r = post(served, "/v1/completions", {"prompt": "hi", "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_a_priority_needs_the_priority_policy(served):
    r = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "priority": 3})
    assert r.status_code == 400 and "--scheduling-policy priority" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "priority"
    assert post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "priority": 0}).status_code == 200
