"""An engine from an `EngineConfig`: the checkpoint resolved and read, the mesh, the KV cache sized
from memory, the tokenizer and the sampling defaults."""

from __future__ import annotations

import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
from flax import nnx

from checkpoints import resolve_model
from jaxserve.config.checkpoint import resolve_dtype, sampling_defaults
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.checks import RequestChecks
from jaxserve.engine.core import Engine
from jaxserve.engine.pooling import is_pooling_checkpoint, pooler_config_of
from jaxserve.engine.tokenizer import Tokenizer, check_tokenizer_files
from jaxserve.models import abstract_model, quantizable_modules
from jaxserve.models.config import ModelConfig
from jaxserve.sample.logits_processors import Processors
from jaxserve.sample.params import SamplingParams
from jaxserve.worker.lora import adapter_bytes
from jaxserve.worker.weights import weight_formats
from jaxserve_kernels import implementation as attention_implementation
from jaxserve_kernels.matmul import kernels_run, padding_computed_from

log = logging.getLogger(__name__)


def kv_cache_budget(model_config: ModelConfig, dtype: str, fraction: float, tensor_parallel_size: int,
                    formats: dict[str, str] | None = None,
                    draft: tuple[ModelConfig, dict[str, str]] | None = None, replicas: int = 1,
                    lora: tuple[int, int] | None = None) -> int:
    """Bytes of KV cache (as one logical array) that fit in `fraction` of memory next to the weights
    (matrices kept quantized as `formats` says, see `weights.weight_formats`). With a `draft` model
    (its config and formats: speculative decoding), next to its weights too, and sharing the bytes
    with its cache, which has as many pages (`jaxserve/worker/draft.py`): the target's part. With
    `lora` (slots, rank), next to the LoRA adapters' stacks too (`jaxserve/worker/lora.py`).

    On accelerators each of the tp devices gives `fraction` of its memory and holds 1/tp of the
    weights; the cache is split over them, or copied to each when its KV heads do not divide.
    On CPU the (virtual) devices share one pool of host RAM, which `replicas` data-parallel replicas
    (each with its own weights) divide."""
    tp = tensor_parallel_size
    models = [(model_config, formats), *([draft] if draft is not None else [])]
    weights = sum(x.size * x.dtype.itemsize for cfg, fmts in models for x in jax.tree.leaves(
        nnx.state(abstract_model(cfg, jnp.dtype(dtype), fmts))))
    weights += adapter_bytes(model_config, dtype, *lora) if lora else 0
    copies = 1 if model_config.num_kv_heads % tp == 0 else tp  # devices holding a whole copy of the cache
    stats = jax.devices()[0].memory_stats() or {}
    if jax.default_backend() == "cpu" or "bytes_limit" not in stats:
        ram = fraction * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget = (ram - weights * replicas) / copies / replicas
    else:
        per_device = fraction * stats["bytes_limit"] - weights / tp
        budget = per_device * (tp if copies == 1 else 1)
    if budget <= 0:
        raise ValueError(f"kv_cache_memory_fraction={fraction} leaves no memory for the KV cache next to "
                         f"{weights} bytes of weights")
    token_bytes = [cfg.num_layers * cfg.num_kv_heads * cfg.head_dim for cfg, _ in models]  # (of a cached token)
    return int(budget * token_bytes[0] / sum(token_bytes))


def build_engine(config: EngineConfig, chat_template: str | None = None, warmup: bool = True
                 ) -> tuple[Engine, Tokenizer | None]:
    """The engine of a config of one replica (`build_engines`)."""
    if config.data_parallel_size != 1:
        raise ValueError("build_engine builds one replica: build_engines builds data_parallel_size of them")
    engines, tokenizer = build_engines(config, chat_template, warmup)
    return engines[0], tokenizer


def build_engines(config: EngineConfig, chat_template: str | None = None, warmup: bool = True,
                  first_rank: int = 0) -> tuple[list[Engine], Tokenizer | None]:
    """Resolve the model, read its config and tokenizer (`_prepare`), load the weights of each of
    `data_parallel_size` replicas onto its devices, compile the step buckets (`Engine.warmup`;
    where `warmup` is False, the caller does that later). `chat_template` replaces the tokenizer's;
    `first_rank`: the data-parallel rank of the first replica built here (a Ray replica's)."""
    model_dir, model_config, config, tokenizer_dir, defaults = _prepare(config, chat_template)
    with ThreadPoolExecutor(1) as pool:  # the tokenizer (mostly: importing transformers) loads meanwhile
        tokenizer = (None if tokenizer_dir is None  # (skip_tokenizer_init)
                     else pool.submit(Tokenizer, tokenizer_dir, chat_template=chat_template))
        engines = [Engine(model_dir, model_config, config, tokenizer, warmup=warmup, sampling_defaults=defaults,
                          replica=replica, data_parallel_rank=first_rank + replica)
                   for replica in range(config.data_parallel_size)]
    return engines, engines[0].tokenizer


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What the API needs of engines it does not run itself (Ray replicas): the model's and the
    resolved engine configuration, the tokenizer, the sampling defaults, the logits processors and
    the request checks, as a replica's `Engine` has them (`of`)."""

    model_config: ModelConfig
    config: EngineConfig
    tokenizer: Tokenizer | None
    sampling_defaults: dict
    processors: Processors
    checks: RequestChecks

    @classmethod
    def of(cls, engine: Engine) -> EngineSpec:
        return cls(engine.model_config, engine.config, engine.tokenizer, engine.sampling_defaults, engine.processors,
                   engine.checks)


def _prepare(config: EngineConfig, chat_template: str | None) -> tuple:
    """(model directory, ModelConfig, the config resolved for the model, tokenizer directory or None,
    sampling defaults): the model resolved, its tokenizer's files checked (none with
    `skip_tokenizer_init`: a model directory without tokenizer files is refused before anything
    loads, `check_tokenizer_files`). The cache holds `num_pages`, else what
    `kv_cache_memory_fraction` of memory allows, else 2 GiB; dtype "auto" is the checkpoint's own
    (`resolve_dtype`); the requests' sampling defaults come from `generation_config`
    (`sampling_defaults`)."""
    if config.skip_tokenizer_init and (chat_template is not None or config.tokenizer is not None):
        raise ValueError("a chat template or --tokenizer needs a tokenizer: drop them or --skip-tokenizer-init")
    model_dir = resolve_model(config.model)
    model_config = ModelConfig.from_hf(model_dir)
    tokenizer_dir = None
    if not config.skip_tokenizer_init:
        tokenizer_dir = model_dir if config.tokenizer is None else resolve_model(config.tokenizer)
        check_tokenizer_files(tokenizer_dir)
    defaults = sampling_defaults(model_dir, config.generation_config, config.override_generation_config)
    SamplingParams(**defaults)  # a bad default is an error now, not in every request
    if defaults:
        log.warning("sampling defaults from the model's generation config: %s (vLLM's behaviour; "
                    "--generation-config vllm for none)", defaults)
    runner = config.runner
    if runner == "auto":
        runner = "pooling" if is_pooling_checkpoint(model_dir, model_config) else "generate"
    if runner == "pooling":  # (an embedding model's head, if any, goes unused: the embedding's stands in)
        model_config = dataclasses.replace(model_config, tie_word_embeddings=True)
    config = config.resolve(model_config, runner=runner, pooler_config=pooler_config_of(
        model_dir, config.pooler_config) if runner == "pooling" else None,
                            **_derived_settings(config, model_dir, model_config))
    return model_dir, model_config, config, tokenizer_dir, defaults


def _derived_settings(config: EngineConfig, model_dir, model_config: ModelConfig) -> dict:
    """The settings that follow from the checkpoint, the backend and the memory: the dtype, the
    page-table widths where "auto", whether a step computes its padding, the KV cache's budget
    where a memory fraction sizes it."""
    given = dict(dtype=resolve_dtype(config.dtype, model_dir))
    if config.page_table_widths == "auto":  # (the C++ CPU kernel reads each sequence's own pages only;
        # the batch-invariant mode's attention reads one width)
        wide = config.batch_invariant or attention_implementation() == "cpu"
        given["page_table_widths"] = "widest" if wide else "4x"
    given["padding_computed_from"] = _padding_computed_from(config, model_dir, model_config, given["dtype"])
    given["fine_buckets"] = jax.default_backend() == "cpu"
    if config.kv_cache_memory_fraction is not None and not config.num_pages:
        formats = weight_formats(model_dir, model_config, config.quantization)
        spec, draft = config.speculative, None
        if spec is not None and spec.model is not None:
            draft_dir = resolve_model(spec.model)
            draft_config = ModelConfig.from_hf(draft_dir)
            draft = draft_config, weight_formats(draft_dir, draft_config, None)
        given["kv_cache_bytes"] = kv_cache_budget(model_config, given["dtype"], config.kv_cache_memory_fraction,
                                                  config.tensor_parallel_size, formats, draft,
                                                  config.data_parallel_size,
                                                  (config.max_loras, config.max_lora_rank) if config.enable_lora
                                                  else None)
    return given


def _padding_computed_from(config: EngineConfig, model_dir, model_config: ModelConfig, dtype: str) -> int | None:
    """`EngineConfig.padding_computed_from`: the layers' products' (`matmul.padding_computed_from`),
    or from the start in the batch-invariant mode and for experts (their products run every row).
    (A draft model's float products are not counted: it costs the step little.)"""
    devices = config.tensor_parallel_size
    if config.batch_invariant or model_config.num_experts or not kernels_run(devices):
        return 0  # (XLA's dot computes every row, whatever the weights' formats)
    formats = weight_formats(model_dir, model_config, config.quantization)
    matrices = quantizable_modules(abstract_model(model_config, jnp.float32))
    floats = not formats or any(f"{path}.{module.WEIGHT}" not in formats for path, module in matrices.items()
                                if path.startswith("layers."))
    return padding_computed_from(dtype, floats, devices)
