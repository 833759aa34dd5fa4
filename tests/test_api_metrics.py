"""What the server counts: /metrics (jaxserve's names and vLLM's), vLLM's periodic stats line, and
the prefix cache's figures (in /metrics and in usage)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server import ENGINE, MODEL, completion, post

from api.metrics import StatsLog

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def test_metrics_parse_and_move(served, client):
    def scrape():
        text = httpx.get(served[0].url + "/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name + "".join(f"|{v}" for k, v in sorted(s.labels.items()) if k != "le")
                values[key] = values.get(key, 0) + (s.value if "le" not in s.labels else 0)
        return values

    before = scrape()
    completion(client, prompt="count me", max_tokens=7, **GREEDY)
    post(served, "/v1/completions", {"prompt": "a", "temperature": 9})
    after = scrape()
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
    # vLLM's names too, with its model_name label: the same figures
    model = f"|{MODEL}"
    for name in ("generation_tokens_total", "prompt_tokens_total", "time_to_first_token_seconds_count",
                 "e2e_request_latency_seconds_count", "num_requests_running", "kv_cache_usage_perc"):
        assert after[f"vllm:{name}{model}"] == after[f"jaxserve:{name}"], name
    assert after[f"vllm:request_success_total|length{model}"] == after["jaxserve:request_success_total|length"]
    assert after[f"vllm:gpu_cache_usage_perc{model}"] == after["jaxserve:kv_cache_usage_perc"]
    assert not any(key.startswith(("vllm:kv_pages", "vllm:request_errors", "jaxserve:gpu")) for key in after)
    assert after["jaxserve:e2e_request_latency_seconds_count"] > before.get("jaxserve:e2e_request_latency_seconds_count", 0)


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
