"""What the server counts: /metrics (jaxserve's names and vLLM's), vLLM's periodic stats line, and
the prefix cache's figures (in /metrics and in usage)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server import ENGINE, MODEL, completion, post

from api.metrics import LoopLag, StatsLog

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def scrape(served) -> dict[str, float]:
    """/metrics as {name|label values: value}; a histogram's buckets are left out (its _count and _sum kept)."""
    text = httpx.get(served[0].url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"|{v}" for k, v in sorted(s.labels.items()) if k != "le")
            values[key] = values.get(key, 0) + (s.value if "le" not in s.labels else 0)
    return values


NAMES = (("jaxserve:", ""), ("vllm:", f"|0|{MODEL}"))  # (prefix, label suffix) of the engine gauges: jaxserve's, vLLM's
ENGINE_COUNTERS = ("generation_tokens_total", "prompt_tokens_total", "num_preemptions_total")


def key(prefix: str, name: str) -> str:
    """A metric's key in `scrape`: vLLM's engine figures carry the engine label (the one replica: "0"),
    its request figures the model's name only."""
    if prefix == "jaxserve:":
        return prefix + name
    name, _, labels = name.partition("|")
    engine = "|0" if name in ENGINE_COUNTERS or name in GAUGES else ""
    return f"{prefix}{name}{engine}{'|' + labels if labels else ''}|{MODEL}"
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")  # under both names


def test_prompt_tokens_count_each_prompt_as_vllms(served, client):
    """vLLM's prompt_tokens counts each request's whole prompt, cached tokens included; what was
    computed is jaxserve:prompt_tokens_computed (the second time, the prompt's cached pages are not).
    vLLM's per-request histograms: prompt and generated tokens, n and max_tokens, and the engine's
    timings of each sequence (its wait, prefill, decode, and the last two together)."""
    prompt = f"prompt tokens {time.time_ns()} " * 3
    deltas = []
    for _ in range(2):
        before = scrape(served)
        usage = completion(client, prompt=prompt, max_tokens=2, **GREEDY).usage
        after = scrape(served)
        deltas.append([after[key(p, n)] - before.get(key(p, n), 0) for p, n in
                       (("jaxserve:", "prompt_tokens_total"), ("vllm:", "prompt_tokens_total"),
                        ("jaxserve:", "prompt_tokens_computed_total"))])
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert deltas == [[usage.prompt_tokens] * 3, [usage.prompt_tokens] * 2 + [usage.prompt_tokens - cached]]
    for prefix in ("jaxserve:", "vllm:"):
        for name, value in (("request_prompt_tokens", usage.prompt_tokens), ("request_generation_tokens", 2),
                            ("request_params_n", 1), ("request_params_max_tokens", 2)):
            assert after[key(prefix, name + "_sum")] - before.get(key(prefix, name + "_sum"), 0) == value, name
            assert after[key(prefix, name + "_count")] - before.get(key(prefix, name + "_count"), 0) == 1, name
        spans = {}
        for span in ("queue", "prefill", "decode", "inference"):
            name = f"request_{span}_time_seconds"
            assert after[key(prefix, name + "_count")] - before.get(key(prefix, name + "_count"), 0) == 1, name
            spans[span] = after[key(prefix, name + "_sum")] - before.get(key(prefix, name + "_sum"), 0)
        assert min(spans.values()) >= 0 and spans["prefill"] > 0 and spans["decode"] > 0
        assert spans["inference"] == pytest.approx(spans["prefill"] + spans["decode"], rel=1e-3)
        tpot = "request_time_per_output_token_seconds_sum"  # (decode time over the tokens after the first: 1 here)
        assert after[key(prefix, tpot)] - before.get(key(prefix, tpot), 0) == pytest.approx(spans["decode"], rel=1e-3)


def test_step_tokens_and_the_cache_config_as_vllms(served, client):
    """vLLM's iteration_tokens_total (each step's tokens: the prompt's step, then one a decode step)
    under its bounds (1, 8, powers of two up to the token budget), and cache_config_info (the KV
    cache's settings as labels)."""
    before = scrape(served)
    usage = completion(client, prompt=f"steps {time.time_ns()}", max_tokens=3, **GREEDY).usage
    after = scrape(served)
    for prefix in ("jaxserve:", "vllm:"):
        name = "iteration_tokens_total"
        labels = "" if prefix == "jaxserve:" else f"|0|{MODEL}"
        moved = [after[prefix + name + part + labels] - before[prefix + name + part + labels]
                 for part in ("_count", "_sum")]
        assert moved == [3, usage.prompt_tokens + 2], prefix
    text = httpx.get(served[0].url + "/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    bounds = [s.labels["le"] for s in families["vllm:iteration_tokens_total"].samples if s.name.endswith("_bucket")]
    top = float(ENGINE.get("max_num_batched_tokens", 512))
    assert bounds == [str(float(b)) for b in (1, 8, 16, 32, 64, 128, 256) if b < top] + [str(top), "+Inf"]
    [info] = families["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["block_size"] == str(ENGINE.get("page_size", 16))
    assert info.labels["num_gpu_blocks"] == str(ENGINE["num_pages"]) and info.labels["engine"] == "0"
    assert info.labels["enable_prefix_caching"] == "True"


def test_metrics_parse_and_move(served, client):
    before = scrape(served)
    start = time.perf_counter()
    completion(client, prompt="count me", max_tokens=7, **GREEDY)
    elapsed = time.perf_counter() - start
    post(served, "/v1/completions", {"prompt": "a", "temperature": 9})
    after = scrape(served)
    assert after["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"] >= 7
    assert after["jaxserve:prompt_tokens_total"] > before["jaxserve:prompt_tokens_total"]
    assert after["jaxserve:time_to_first_token_seconds_count"] > before["jaxserve:time_to_first_token_seconds_count"]
    assert after["jaxserve:inter_token_latency_seconds_count"] >= before["jaxserve:inter_token_latency_seconds_count"] + 6
    assert after["jaxserve:request_success_total|length"] > before.get("jaxserve:request_success_total|length", 0)
    assert after["jaxserve:request_errors_total|400"] > before.get("jaxserve:request_errors_total|400", 0)
    assert after["jaxserve:kv_pages_total"] == ENGINE["num_pages"] - 1
    for name in ("jaxserve:num_requests_running", "jaxserve:num_requests_waiting", "jaxserve:kv_pages_used",
                 "jaxserve:num_preemptions_total"):
        assert name in after
    # vLLM's names too, with its model_name label (and the engine's: its one replica is "0"): the same figures
    model, engine = f"|{MODEL}", f"|0|{MODEL}"
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count"):
        assert after[f"vllm:{name}{model}"] == after[f"jaxserve:{name}"], name
    for name in ("generation_tokens_total", "prompt_tokens_total", "num_requests_running", "kv_cache_usage_perc"):
        assert after[f"vllm:{name}{engine}"] == after[f"jaxserve:{name}"], name
    assert after[f"vllm:request_success_total|length{model}"] == after["jaxserve:request_success_total|length"]
    assert after[f"vllm:gpu_cache_usage_perc{engine}"] == after["jaxserve:kv_cache_usage_perc"]
    assert not any(key.startswith(("vllm:kv_pages", "vllm:request_errors", "jaxserve:gpu")) for key in after)
    assert after["jaxserve:e2e_request_latency_seconds_count"] > before.get("jaxserve:e2e_request_latency_seconds_count", 0)
    # each figure, under each name, moved by what the two requests are known to have done: one
    # sequence of 8 prompt tokens (no full page: nothing from the prefix cache) and 7 generated
    # tokens, one update each, ended by its length; and one 400
    for prefix, label in NAMES:
        moved = {name: after[key(prefix, name)] - before.get(key(prefix, name), 0) for name in (
            "generation_tokens_total", "prompt_tokens_total", "request_success_total|length",
            "time_to_first_token_seconds_count", "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
            "time_to_first_token_seconds_sum", "e2e_request_latency_seconds_sum", "num_preemptions_total")}
        assert moved["generation_tokens_total"] == 7 and moved["prompt_tokens_total"] == len("count me"), prefix
        assert moved["request_success_total|length"] == 1 and moved["num_preemptions_total"] == 0, prefix
        assert moved["time_to_first_token_seconds_count"] == moved["e2e_request_latency_seconds_count"] == 1, prefix
        assert moved["inter_token_latency_seconds_count"] == 6, prefix
        # the sequence's first token came before its end, and both within the request's time
        assert 0 < moved["time_to_first_token_seconds_sum"] <= moved["e2e_request_latency_seconds_sum"] <= elapsed
        # idle again: nothing running or waiting, no page held
        assert [after[f"{prefix}{name}{label}"] for name in GAUGES] == [0, 0, 0], prefix
    assert after["jaxserve:request_errors_total|400"] - before.get("jaxserve:request_errors_total|400", 0) == 1
    assert after["jaxserve:kv_pages_used"] == 0


def test_prefix_cache_counters_and_the_stats_line(served, client):
    """The prefix cache's queries and hits (tokens, in /metrics and the stats line), and vLLM's
    periodic stats line: throughput since the last line, one more line once idle, then none."""
    stats = StatsLog(served[1])
    before = httpx.get(served[0].url + "/metrics").text
    prompt = "The stats line counts these tokens twice over. " * 2
    for _ in range(2):
        n = completion(client, prompt=prompt, max_tokens=4, **GREEDY).usage.prompt_tokens
    size = served[1].engine.config.page_size
    hits = (n - 1) // size * size  # the second run's full pages (its last token is always computed)
    line = stats.line()
    fields = dict(part.split(": ") for part in line.split(", "))
    assert float(fields["Avg generation throughput"].split()[0]) > 0
    assert float(fields["Avg prompt throughput"].split()[0]) > 0
    assert fields["Running"] == "0 seqs" and fields["Waiting"] == "0 seqs"
    assert fields["Prefix cache hit rate"] == f"{100 * hits / (2 * n):.1f}%"
    assert stats.line().startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0")
    assert stats.line() is None  # idle

    def counter(text, name):
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    after = httpx.get(served[0].url + "/metrics").text
    assert counter(after, "jaxserve:prefix_cache_queries_total") - counter(
        before, "jaxserve:prefix_cache_queries_total") == 2 * n
    assert counter(after, "jaxserve:prefix_cache_hits_total") - counter(
        before, "jaxserve:prefix_cache_hits_total") == hits


def test_usage_reports_cached_prompt_tokens(client):
    prompt = "a shared system prompt that is long enough to fill a few pages " * 2
    client.completions.create(model=MODEL, prompt=prompt + "first", max_tokens=2)
    r = client.completions.create(model=MODEL, prompt=prompt + "second", max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens == (len(prompt) // 16) * 16


def test_gauges_show_the_batch_while_it_runs_and_the_idle_values_after(served, monkeypatch):
    """A request of 17 greedy choices: the batch holds 16 (the server's max_num_seqs), the 17th
    waits for room. With the engine held between two steps, the gauges read 16 running and 1
    waiting, under both names, with a page or more per running sequence; once the request is over,
    the idle values again: nothing running or waiting and no page held."""
    engine, usable = served[1].engine, ENGINE["num_pages"] - 1
    assert ENGINE["max_num_seqs"] == 16
    idle = scrape(served)
    for prefix, label in NAMES:
        assert [idle[f"{prefix}{name}{label}"] for name in GAUGES] == [0, 0, 0], prefix
    assert idle["jaxserve:kv_pages_used"] == 0
    step, hold, held, release = engine.step, threading.Event(), threading.Event(), threading.Event()

    def held_step(*args, **kwargs):  # the engine thread stops after a step while the test reads
        out = step(*args, **kwargs)
        if hold.is_set():
            held.set()
            release.wait(60)
        return out

    monkeypatch.setattr(engine, "step", held_step)
    body = {"model": MODEL, "prompt": "wait", "n": 17, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    started, finished = set(), {}
    try:
        with httpx.stream("POST", served[0].url + "/v1/completions", json=body, timeout=60) as r:
            events = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
            for event in events:
                started.update(c["index"] for c in event["choices"] if not c["finish_reason"])
                if len(started) == 16:
                    break
            hold.set()
            assert held.wait(30)
            during = scrape(served)
            hold.clear()
            release.set()
            for event in events:
                finished.update((c["index"], c["finish_reason"]) for c in event["choices"] if c["finish_reason"])
    finally:
        hold.clear()
        release.set()
    assert finished == {i: "length" for i in range(17)}
    for prefix, label in NAMES:
        running, waiting, usage = (during[f"{prefix}{name}{label}"] for name in GAUGES)
        assert (running, waiting) == (16, 1), prefix
        assert usage == pytest.approx(during["jaxserve:kv_pages_used"] / usable, rel=1e-6), prefix
    # each running sequence writes its own page; 44 tokens need 3 pages
    assert 16 <= during["jaxserve:kv_pages_used"] <= 16 * 3
    deadline = time.time() + 20
    while scrape(served)["jaxserve:kv_pages_used"] and time.time() < deadline:
        time.sleep(0.05)
    after = scrape(served)
    for prefix, label in NAMES:
        assert [after[f"{prefix}{name}{label}"] for name in GAUGES] == [0, 0, 0], prefix
    assert after["jaxserve:kv_pages_used"] == 0


def test_preemptions_are_counted_and_the_recomputed_choices_match(served, client):
    """16 greedy choices of 80 tokens need 16 x 6 pages, more than the server's 63: sequences are
    preempted and recomputed. The counter moves under both names, every generated token is counted
    once, and a recomputed choice writes what the others write."""
    before = scrape(served)
    r = completion(client, prompt="many", n=16, max_tokens=80, **GREEDY)
    after = scrape(served)
    assert r.usage.completion_tokens == 16 * 80 and {c.finish_reason for c in r.choices} == {"length"}
    assert len({c.text for c in r.choices}) == 1
    for prefix, label in NAMES:
        def moved(name):
            return after[key(prefix, name)] - before.get(key(prefix, name), 0)

        assert moved("num_preemptions_total") >= 1, prefix
        assert moved("generation_tokens_total") == 16 * 80, prefix
        assert moved("request_success_total|length") == 16, prefix


def test_event_loop_lag_is_observed_while_serving(served):
    """The API's event loop lag: observed every 50 ms from the start of serving, the longest as a gauge."""
    deadline = time.perf_counter() + 10
    while (values := scrape(served)).get("jaxserve:event_loop_lag_seconds_count", 0) < 2:
        assert time.perf_counter() < deadline, "no event loop lag observed"
        time.sleep(0.1)
    assert 0 <= values["jaxserve:event_loop_lag_max_seconds"] < 60
    assert values["jaxserve:event_loop_lag_seconds_sum"] >= 0
    assert not any(key.startswith("vllm:event_loop") for key in values)


def test_a_blocked_event_loop_shows_as_lag():
    """Blocking the loop 0.3 s makes the watcher's 50 ms sleep end at least 0.25 s late."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    lag = LoopLag(registry)

    async def block():
        await lag.start()
        await asyncio.sleep(0)  # (the watcher starts its first sleep)
        time.sleep(0.3)
        await asyncio.sleep(0.01)  # (it wakes, late)
        await lag.stop()

    asyncio.run(block())
    assert registry.get_sample_value("jaxserve:event_loop_lag_max_seconds") >= 0.25
    assert registry.get_sample_value("jaxserve:event_loop_lag_seconds_sum") >= 0.25
