"""Prometheus metrics of one app: engine gauges read at scrape time, request timings and outcomes,
how late the API's event loop wakes (`LoopLag`); and the server's periodic log line of the same
figures (`StatsLog`).

Every metric that vLLM has is there twice: under jaxserve's name and under vLLM's (`jaxserve:` ->
`vllm:`, with vLLM's `model_name` label), so dashboards and autoscalers built on vLLM's metrics read
jaxserve's.
Each app has its own registry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from jaxserve.engine.figures import PREFIXES, Figure, engine_figures
from jaxserve.engine.outputs import Update
from jaxserve.engine.replicas import Replicas
from jaxserve.engine.request_metrics import RequestMetrics

LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _EngineCollector:
    """Reads the engines' stats snapshots when scraped (`engine_figures`): under jaxserve's names the
    totals of the data-parallel replicas, under vLLM's one sample per replica (its `engine` label, as vLLM's)."""

    def __init__(self, engine: Replicas, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        front = self.engine
        config = front.engine.config
        sources = {PREFIXES[0]: [({}, front.stats, front.compile_progress, front.queued)],
                   PREFIXES[1]: [({"model_name": self.model_name, "engine": str(i)}, replica.stats,
                                  replica.compile_progress, replica.admission.queued)
                                 for i, replica in enumerate(front.replicas)]}
        for prefix, labelled in sources.items():
            metrics = {}
            for labels, stats, compile_progress, queued in labelled:
                for figure in engine_figures(stats, config, compile_progress, queued):
                    if prefix in figure.prefixes:
                        _add(metrics, prefix, labels, figure)
            yield from metrics.values()


def _add(metrics: dict, prefix: str, labels: dict, figure: Figure) -> None:
    """One engine's sample of a figure, into its family (made by the first engine's)."""
    names = [*figure.info, *labels] + (["position"] if figure.kind == "vector" else [])
    if figure.name not in metrics:
        family = {"gauge": GaugeMetricFamily, "info": GaugeMetricFamily, "counter": CounterMetricFamily,
                  "vector": CounterMetricFamily, "histogram": HistogramMetricFamily}[figure.kind]
        metrics[figure.name] = family(prefix + figure.name, figure.doc, labels=names)
    values = [*figure.info.values(), *labels.values()]
    if figure.kind == "vector":
        for position, count in enumerate(figure.value):
            metrics[figure.name].add_metric([*values, str(position)], count)
    elif figure.kind == "histogram":
        metrics[figure.name].add_metric(values, figure.buckets(), figure.value[2])
    else:
        metrics[figure.name].add_metric(values, figure.value)


class LoopLag:
    """How late the API's event loop wakes from a sleep: while it is blocked (work done on the loop
    instead of a thread, or a thread holding the GIL) no request, stream or disconnect is served.
    `watch` runs while the app serves (`start`, `stop`)."""

    def __init__(self, registry: CollectorRegistry, interval: float = 0.05):
        self.interval = interval
        self.lags = Histogram(PREFIXES[0] + "event_loop_lag_seconds", f"How late the API's event loop woke from "
                              f"each {interval} s sleep.", registry=registry, buckets=LAG_BUCKETS)
        self.longest = Gauge(PREFIXES[0] + "event_loop_lag_max_seconds", "The longest event loop lag seen.",
                             registry=registry)  # (vLLM has neither)
        self._task: asyncio.Task | None = None

    async def watch(self) -> None:
        loop = asyncio.get_running_loop()
        longest = 0.0
        while True:
            start = loop.time()
            await asyncio.sleep(self.interval)
            lag = max(loop.time() - start - self.interval, 0.0)
            self.lags.observe(lag)
            if lag > longest:
                longest = lag
                self.longest.set(lag)

    async def start(self) -> None:
        self._task = asyncio.create_task(self.watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


class Metrics:
    def __init__(self, engine: Replicas, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.loop_lag = LoopLag(self.registry)
        self.requests = RequestMetrics(self.registry, model_name, engine.engine.config.max_model_len)
        self.errors = Counter(PREFIXES[0] + "request_errors", "Requests answered with an error, by HTTP status.",
                              ["status"], registry=self.registry)  # (vLLM has no such metric)

    def error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    async def timed(self, stream: AsyncIterator[Update], n: int, max_tokens: int | None) -> AsyncIterator[Update]:
        """Pass the updates of n sequences through, observed by a `RequestTimer` (sequences cut short by a
        disconnect count as "abort")."""
        timer = self.requests.timer(n, max_tokens)
        try:
            async for update in stream:
                timer.observe(update)
                yield update
        finally:
            timer.close()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsLog:
    """vLLM's periodic stats line: prompt and generation throughput since the last line, sequences
    running and waiting, KV cache use and the prefix cache's hit rate, from the engine's stats
    snapshots (`Replicas.stats`: their totals) like `_EngineCollector`."""

    def __init__(self, engine: Replicas):
        self.engine = engine
        self._last = time.perf_counter(), engine.stats
        self._was_busy = False

    def line(self) -> str | None:
        """The figures since the last call; None while idle (after one line that shows it went idle)."""
        (t0, s0), (t1, s1) = self._last, (time.perf_counter(), self.engine.stats)
        self._last = t1, s1
        prompt = s1.num_prompt_tokens - s0.num_prompt_tokens
        generated = s1.num_generated_tokens - s0.num_generated_tokens
        busy = bool(s1.num_running or s1.num_waiting or prompt or generated)
        if not (busy or self._was_busy):
            return None
        self._was_busy = busy
        dt = max(t1 - t0, 1e-9)
        queried = s1.num_prefix_queried_tokens - s0.num_prefix_queried_tokens
        hits = s1.num_prefix_hit_tokens - s0.num_prefix_hit_tokens
        hit_rate = f"{100 * hits / queried:.1f}%" if queried else "-"
        line = (f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, "
                f"Avg generation throughput: {generated / dt:.1f} tokens/s, "
                f"Running: {s1.num_running} seqs, Waiting: {s1.num_waiting} seqs, "
                f"KV cache usage: {100 * s1.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {hit_rate}")
        if s1.accepted_per_position:  # (vLLM's figures of speculative decoding)
            drafts, drafted = s1.num_drafts - s0.num_drafts, s1.num_draft_tokens - s0.num_draft_tokens
            accepted = s1.num_accepted_tokens - s0.num_accepted_tokens
            rate = f"{100 * accepted / drafted:.1f}%" if drafted else "-"
            length = f"{1 + accepted / drafts:.2f}" if drafts else "-"
            line += f", Draft acceptance rate: {rate}, Mean acceptance length: {length}"
        return line
