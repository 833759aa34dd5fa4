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
from jaxserve.sched.plan import SchedulerStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
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


def token_buckets(largest: int) -> list[int]:
    """vLLM's buckets of token counts: 1, 2, 5, 10, 20, 50, ... up to `largest`."""
    return [m * 10**e for e in range(len(str(largest))) for m in (1, 2, 5) if m * 10**e <= largest]


class _Twins:
    """One request metric under both names (`PREFIXES`)."""

    def __init__(self, kind, name: str, doc: str, registry, model_name: str, labels: tuple[str, ...] = (), **kw):
        self.ours = kind(PREFIXES[0] + name, doc, labels, registry=registry, **kw)
        self.vllms = kind(PREFIXES[1] + name, doc, ("model_name", *labels), registry=registry, **kw)
        self.model_name = model_name

    def __call__(self, *label_values: str) -> tuple:
        """Both metrics' children with these label values."""
        ours = self.ours.labels(*label_values) if label_values else self.ours
        return ours, self.vllms.labels(self.model_name, *label_values)


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

        def twins(kind, name, doc, labels=(), **kw):
            return _Twins(kind, name, doc, self.registry, model_name, labels, **kw)

        self.ttft = twins(Histogram, "time_to_first_token_seconds", "Time to each sequence's first token.",
                          buckets=LATENCY_BUCKETS)
        self.itl = twins(Histogram, "inter_token_latency_seconds", "Time between a sequence's updates.",
                         buckets=LATENCY_BUCKETS)
        self.e2e = twins(Histogram, "e2e_request_latency_seconds", "Time from a sequence's request to its end.",
                         buckets=LATENCY_BUCKETS)
        self.finished = twins(Counter, "request_success", "Finished sequences by finish reason.", ("finished_reason",))
        counts = token_buckets(engine.engine.config.max_model_len)
        self.prompt_lengths = twins(Histogram, "request_prompt_tokens", "Prompt tokens of each finished sequence.",
                                    buckets=counts)
        self.output_lengths = twins(Histogram, "request_generation_tokens", "Tokens each finished sequence "
                                    "generated.", buckets=counts)
        self.spans = {span: twins(Histogram, f"request_{span}_time_seconds", f"Each finished sequence's {doc} (as "
                                  "the engine measured it).", buckets=LATENCY_BUCKETS)
                      for span, doc in (("queue", "wait for its first step"),
                                        ("prefill", "time from its first step to its first token"),
                                        ("decode", "time from its first token to its last"),
                                        ("inference", "time from its first step to its last token"))}
        self.tpot = twins(Histogram, "request_time_per_output_token_seconds", "Each finished sequence's decode time "
                          "over its tokens after the first (0 for one token).", buckets=LATENCY_BUCKETS)
        self.params_n = twins(Histogram, "request_params_n", "Each request's n.", buckets=(1, 2, 5, 10, 20))
        self.params_max_tokens = twins(Histogram, "request_params_max_tokens", "Each request's max_tokens.",
                                       buckets=counts)
        self.errors = Counter(PREFIXES[0] + "request_errors", "Requests answered with an error, by HTTP status.",
                              ["status"], registry=self.registry)  # (vLLM has no such metric)

    def error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    async def timed(self, stream: AsyncIterator[Update], n: int, max_tokens: int | None) -> AsyncIterator[Update]:
        """Pass the updates of n sequences through, observing time to first token, inter-token
        latency, end-to-end latency, lengths and outcomes (sequences cut short by a disconnect count as "abort")."""
        for metric in self.params_n():
            metric.observe(n)
        for metric in self.params_max_tokens() if max_tokens is not None else ():
            metric.observe(max_tokens)
        start = time.perf_counter()
        last: dict[int, float] = {}
        finished = 0
        try:
            async for update in stream:
                t = time.perf_counter()
                for metric in self.itl() if update.index in last else self.ttft():
                    metric.observe(t - last.get(update.index, start))
                last[update.index] = t
                if update.finish_reason is not None:
                    finished += 1
                    for metric in self.finished(update.finish_reason):
                        metric.inc()
                    for metric in self.e2e():
                        metric.observe(t - start)
                    for metric in self.prompt_lengths():
                        metric.observe(update.num_prompt_tokens)
                    for metric in self.output_lengths():
                        metric.observe(update.num_output_tokens)
                    for span, seconds in zip(self.spans, update.timings or ()):  # (RequestTimings' order)
                        for metric in self.spans[span]():
                            metric.observe(seconds)
                    for metric in self.tpot() if update.timings else ():
                        n = update.num_output_tokens
                        metric.observe(update.timings.decode / (n - 1) if n > 1 else 0.0)
                yield update
        finally:
            if finished < n:
                for metric in self.finished("abort"):
                    metric.inc(n - finished)

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
