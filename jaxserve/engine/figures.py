"""The engine's figures as metrics, from its stats snapshot (`SchedulerStats`): what /metrics
shows of the engine (`api/metrics.py`, as Prometheus families) and what `LLM.get_metrics` returns
(as vLLM's metric reader gives them: `Counter`, `Gauge`, `Vector`, `Histogram`). Each figure is
under jaxserve's name, vLLM's, or both (`PREFIXES`)."""

from __future__ import annotations

import dataclasses
import itertools
import time

from jaxserve.sched.plan import SchedulerStats, step_token_bounds

PREFIXES = ("jaxserve:", "vllm:")  # the second with vLLM's labels (model_name, engine)
OURS, VLLMS, BOTH = PREFIXES[:1], PREFIXES[1:], PREFIXES


@dataclasses.dataclass(frozen=True)
class Figure:
    """kind: "gauge" or "counter" (value a number), "vector" (a counter by position: value the
    counts), "histogram" (value: (upper bounds, cumulative counts, sum)), "info" (value 1, `info`
    its labels)."""

    prefixes: tuple[str, ...]
    kind: str
    name: str
    doc: str
    value: object
    info: dict = dataclasses.field(default_factory=dict)

    def buckets(self) -> list[tuple[str, int]]:
        """A histogram's (upper bound, cumulative count) pairs, "+Inf" the last, as Prometheus writes them."""
        bounds, cumulative, _ = self.value
        return [(str(float(b)), c) for b, c in zip(bounds, cumulative)] + [("+Inf", cumulative[-1])]


def engine_figures(stats: SchedulerStats, config, compile_progress: tuple[int, int] = (0, 0),
                   queued: tuple[int, int] = (0, 0)) -> list[Figure]:
    """Every figure of one engine's (or the replicas' totalled) stats; `config` its EngineConfig."""
    compiled, buckets = compile_progress
    queued_requests, queued_tokens = queued
    figures = [Figure(*each) for each in (
        (BOTH, "gauge", "num_requests_running", "Sequences in the batch.", stats.num_running),
        (BOTH, "gauge", "num_requests_waiting", "Sequences waiting (new or preempted).", stats.num_waiting),
        (BOTH, "gauge", "kv_cache_usage_perc", "KV cache use, 1 is full.", stats.kv_cache_usage),
        (VLLMS, "gauge", "gpu_cache_usage_perc", "KV cache use, 1 is full (vLLM's older name).", stats.kv_cache_usage),
        (OURS, "gauge", "num_requests_queued", "Requests waiting to start (the queue that --max-num-queued-reqs "
         "bounds).", queued_requests),
        (OURS, "gauge", "num_tokens_queued", "Prompt tokens of the requests waiting to start (the queue that "
         "--max-num-queued-tokens bounds).", queued_tokens),
        (OURS, "gauge", "kv_pages_used", "KV cache pages held by sequences.", stats.kv_pages_used),
        (OURS, "gauge", "kv_pages_total", "KV cache pages (the null page excluded).", stats.kv_pages_total),
        (BOTH, "counter", "prompt_tokens", "Prompt tokens of the requests prefilled, cached ones included (vLLM's: "
         "each prompt counted once, when its first token is sampled).", stats.num_prompt_tokens),
        (OURS, "counter", "prompt_tokens_computed", "Prompt tokens computed (not found in the prefix cache; "
         "recomputation after a preemption included).", stats.num_prompt_tokens_computed),
        (BOTH, "counter", "generation_tokens", "Tokens generated.", stats.num_generated_tokens),
        (BOTH, "counter", "num_preemptions", "Sequences preempted.", stats.num_preemptions),
        (BOTH, "counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
         stats.num_prefix_queried_tokens),
        (BOTH, "counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.num_prefix_hit_tokens),
        (OURS, "gauge", "step_buckets_compiled", "Step shapes compiled (after the first few, in the background while "
         "serving).", compiled),
        (OURS, "gauge", "step_buckets", "Step shapes in all.", buckets),
    )]
    if stats.accepted_per_position:  # (speculative decoding is on)
        figures += [Figure(*each) for each in (
            (BOTH, "counter", "spec_decode_num_drafts", "Rows that checked draft tokens.", stats.num_drafts),
            (BOTH, "counter", "spec_decode_num_draft_tokens", "Draft tokens checked.", stats.num_draft_tokens),
            (BOTH, "counter", "spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.num_accepted_tokens),
            (BOTH, "vector", "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by their place among "
             "a row's drafts (0: the first).", stats.accepted_per_position),
        )]
    if stats.step_token_counts:
        cumulative = tuple(itertools.accumulate(stats.step_token_counts))
        figures.append(Figure(BOTH, "histogram", "iteration_tokens_total", "Tokens per engine step.",
                              (step_token_bounds(config.max_num_batched_tokens), cumulative, stats.num_step_tokens)))
    if config.enable_lora:  # (vLLM's: the time now as the value)
        figures.append(Figure(BOTH, "info", "lora_requests_info", "Running stats on LoRA requests.", time.time(), {
            "max_lora": str(config.max_loras), "waiting_lora_adapters": ",".join(stats.waiting_loras),
            "running_lora_adapters": ",".join(stats.running_loras)}))
    cache = {"block_size": config.page_size, "cache_dtype": config.kv_dtype, "num_gpu_blocks": config.num_pages,
             "enable_prefix_caching": config.enable_prefix_caching,
             "gpu_memory_utilization": config.kv_cache_memory_fraction}
    figures.append(Figure(BOTH, "info", "cache_config_info", "The KV cache's settings.", 1,
                          {key: str(value) for key, value in cache.items()}))
    return figures


# vLLM's metric reader's types (vllm.v1.metrics.reader), which LLM.get_metrics returns


@dataclasses.dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class Counter(Metric):
    value: int


@dataclasses.dataclass
class Gauge(Metric):
    value: float


@dataclasses.dataclass
class Vector(Metric):
    values: list[int]


@dataclasses.dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound -> cumulative count, "+Inf" the last


def reader_metrics(stats: list[SchedulerStats], config, model_name: str) -> list[Metric]:
    """vLLM's `LLM.get_metrics()`: each replica's figures under vLLM's names (its labels: model_name,
    engine), as its metric reader gives them (a counter's name without `_total`)."""
    out: list[Metric] = []
    for i, each in enumerate(stats):
        labels = {"model_name": model_name, "engine": str(i)}
        for f in engine_figures(each, config):
            if PREFIXES[1] not in f.prefixes:
                continue
            name = PREFIXES[1] + f.name
            if f.kind == "counter":
                out.append(Counter(name, labels, f.value))
            elif f.kind == "gauge":
                out.append(Gauge(name, labels, f.value))
            elif f.kind == "info":
                out.append(Gauge(name, {**f.info, **labels}, f.value))
            elif f.kind == "vector":
                out.append(Vector(name, labels, list(f.value)))
            else:
                buckets = dict(f.buckets())
                out.append(Histogram(name, labels, buckets["+Inf"], f.value[2], buckets))
    return out
