"""Prometheus metrics of one app: engine gauges read at scrape time, request timings and outcomes;
and the server's periodic log line of the same figures (`StatsLog`).

Names follow vLLM's (`vllm:` -> `jaxserve:`). Each app has its own registry.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.async_engine import AsyncEngine, Update

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class _EngineCollector:
    """Reads the scheduler's state when scraped (plain integer reads of another thread's counters)."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        sched = self.engine.engine.scheduler
        alloc = sched.allocator
        yield GaugeMetricFamily("jaxserve:num_requests_running", "Sequences in the batch.", len(sched.running))
        yield GaugeMetricFamily("jaxserve:num_requests_waiting", "Sequences waiting (new or preempted).",
                                len(sched.waiting))
        yield GaugeMetricFamily("jaxserve:kv_pages_used", "KV cache pages held by sequences.",
                                alloc.num_usable - alloc.num_free)
        yield GaugeMetricFamily("jaxserve:kv_pages_total", "KV cache pages (the null page excluded).",
                                alloc.num_usable)
        yield CounterMetricFamily("jaxserve:prompt_tokens", "Prompt tokens prefilled (recomputation included).",
                                  sched.num_prompt_tokens_computed)
        yield CounterMetricFamily("jaxserve:generation_tokens", "Tokens generated.", sched.num_generated_tokens)
        yield CounterMetricFamily("jaxserve:num_preemptions", "Sequences preempted.", sched.num_preemptions)
        yield CounterMetricFamily("jaxserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  sched.num_prefix_queried_tokens)
        yield CounterMetricFamily("jaxserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  sched.num_prefix_hit_tokens)


class Metrics:
    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("jaxserve:time_to_first_token_seconds", "Time to each sequence's first token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("jaxserve:inter_token_latency_seconds", "Time between a sequence's updates.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("jaxserve:request_success", "Finished sequences by finish reason.",
                                ["finished_reason"], registry=self.registry)
        self.errors = Counter("jaxserve:request_errors", "Requests answered with an error, by HTTP status.",
                              ["status"], registry=self.registry)

    async def timed(self, stream: AsyncIterator[Update], n: int) -> AsyncIterator[Update]:
        """Pass the updates of n sequences through, observing time to first token, inter-token
        latency and outcomes (sequences cut short by a disconnect count as "abort")."""
        start = time.perf_counter()
        last: dict[int, float] = {}
        finished = 0
        try:
            async for update in stream:
                t = time.perf_counter()
                if update.index in last:
                    self.itl.observe(t - last[update.index])
                else:
                    self.ttft.observe(t - start)
                last[update.index] = t
                if update.finish_reason is not None:
                    finished += 1
                    self.finished.labels(update.finish_reason).inc()
                yield update
        finally:
            if finished < n:
                self.finished.labels("abort").inc(n - finished)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsLog:
    """vLLM's periodic stats line: prompt and generation throughput since the last line, sequences
    running and waiting, KV cache use and the prefix cache's hit rate. Reads the scheduler's counters
    (plain integers of the engine thread) like `_EngineCollector`."""

    def __init__(self, engine: AsyncEngine):
        self.scheduler = engine.engine.scheduler
        self._last = self._counters()
        self._was_busy = False

    def _counters(self) -> tuple[float, int, int, int, int]:
        s = self.scheduler
        return (time.perf_counter(), s.num_prompt_tokens_computed, s.num_generated_tokens,
                s.num_prefix_queried_tokens, s.num_prefix_hit_tokens)

    def line(self) -> str | None:
        """The figures since the last call; None while idle (after one line that shows it went idle)."""
        now = self._counters()
        (t0, prompt0, generated0, queried0, hits0), (t1, prompt1, generated1, queried1, hits1) = self._last, now
        self._last = now
        s, alloc = self.scheduler, self.scheduler.allocator
        busy = bool(s.running or s.waiting or prompt1 > prompt0 or generated1 > generated0)
        if not (busy or self._was_busy):
            return None
        self._was_busy = busy
        dt = max(t1 - t0, 1e-9)
        queried = queried1 - queried0
        hit_rate = f"{100 * (hits1 - hits0) / queried:.1f}%" if queried else "-"
        return (f"Avg prompt throughput: {(prompt1 - prompt0) / dt:.1f} tokens/s, "
                f"Avg generation throughput: {(generated1 - generated0) / dt:.1f} tokens/s, "
                f"Running: {len(s.running)} seqs, Waiting: {len(s.waiting)} seqs, "
                f"KV cache usage: {100 * (alloc.num_usable - alloc.num_free) / alloc.num_usable:.1f}%, "
                f"Prefix cache hit rate: {hit_rate}")
