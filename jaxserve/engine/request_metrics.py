"""Each request's figures as Prometheus histograms and counters, under jaxserve's name and vLLM's
(`figures.PREFIXES`, vLLM's with its `model_name` label): time to first token, inter-token and
end-to-end latency, prompt and output lengths, outcomes, the engine's spans of each sequence, and
the request's n and max_tokens. The server's /metrics (`api/metrics.py`) and `LLM.get_metrics`
read them; a `RequestTimer` observes one request's updates as they come."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from jaxserve.engine.figures import PREFIXES, Counter as CounterReading, Histogram as HistogramReading, Metric
from jaxserve.engine.outputs import Update

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


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


class RequestMetrics:
    """The request metrics of one server or `LLM`, in its registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int):
        def twins(kind, name, doc, labels=(), **kw):
            return _Twins(kind, name, doc, registry, model_name, labels, **kw)

        self.ttft = twins(Histogram, "time_to_first_token_seconds", "Time to each sequence's first token.",
                          buckets=LATENCY_BUCKETS)
        self.itl = twins(Histogram, "inter_token_latency_seconds", "Time between a sequence's updates.",
                         buckets=LATENCY_BUCKETS)
        self.e2e = twins(Histogram, "e2e_request_latency_seconds", "Time from a sequence's request to its end.",
                         buckets=LATENCY_BUCKETS)
        self.finished = twins(Counter, "request_success", "Finished sequences by finish reason.", ("finished_reason",))
        counts = token_buckets(max_model_len)
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

    def timer(self, n: int, max_tokens: int | None) -> RequestTimer:
        """The timer of a request of n sequences, started now."""
        return RequestTimer(self, n, max_tokens)


class RequestTimer:
    """One request's figures from its updates (`observe` each as it comes, then `close`): sequences
    that had not finished by `close` (a disconnect, an abort) count as "abort"."""

    def __init__(self, metrics: RequestMetrics, n: int, max_tokens: int | None):
        self.metrics, self.n = metrics, n
        for metric in metrics.params_n():
            metric.observe(n)
        for metric in metrics.params_max_tokens() if max_tokens is not None else ():
            metric.observe(max_tokens)
        self.start = time.perf_counter()
        self.last: dict[int, float] = {}
        self.finished = 0

    def observe(self, update: Update) -> None:
        m, t = self.metrics, time.perf_counter()
        for metric in m.itl() if update.index in self.last else m.ttft():
            metric.observe(t - self.last.get(update.index, self.start))
        self.last[update.index] = t
        if update.finish_reason is None:
            return
        self.finished += 1
        for metric in m.finished(update.finish_reason):
            metric.inc()
        for metric in m.e2e():
            metric.observe(t - self.start)
        for metric in m.prompt_lengths():
            metric.observe(update.num_prompt_tokens)
        for metric in m.output_lengths():
            metric.observe(update.num_output_tokens)
        for span, seconds in zip(m.spans, update.timings or ()):  # (RequestTimings' order)
            for metric in m.spans[span]():
                metric.observe(seconds)
        for metric in m.tpot() if update.timings else ():
            n = update.num_output_tokens
            metric.observe(update.timings.decode / (n - 1) if n > 1 else 0.0)

    def close(self) -> None:
        if self.finished < self.n:
            for metric in self.metrics.finished("abort"):
                metric.inc(self.n - self.finished)
            self.finished = self.n


def reader_request_metrics(registry: CollectorRegistry) -> list[Metric]:
    """The request metrics under vLLM's names as vLLM's metric reader gives them (`LLM.get_metrics`):
    a counter without `_total`, a histogram's buckets as {upper bound: cumulative count}."""
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIXES[1]):
            continue
        if family.type == "counter":
            out += [CounterReading(family.name, s.labels, int(s.value)) for s in family.samples
                    if s.name.endswith("_total")]
        elif family.type == "histogram":
            by_labels: dict[tuple, dict] = {}
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                entry = by_labels.setdefault(tuple(sorted(labels.items())), {"labels": labels, "buckets": {}})
                if s.name.endswith("_bucket"):
                    entry["buckets"][s.labels["le"]] = int(s.value)
                elif s.name.endswith(("_count", "_sum")):
                    entry[s.name.rsplit("_", 1)[1]] = s.value
            out += [HistogramReading(family.name, e["labels"], int(e["count"]), e["sum"], e["buckets"])
                    for e in by_labels.values()]
    return out
