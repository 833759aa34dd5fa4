"""Typed, frozen, validated-once configuration.

`ModelConfig` is what the decoder needs to know about a Hugging Face checkpoint
(read from its `config.json`); `EngineConfig` is what the serving engine needs
(from the CLI or the `LLM(...)` keyword arguments), including the shape buckets
that every jitted step is padded to.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from pathlib import Path

from jaxserve.models import MODEL_REGISTRY, ModelOptions

log = logging.getLogger("jaxserve.config")

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (HF `rope_parameters` / `rope_scaling`)."""

    theta: float
    type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    options: ModelOptions  # the family's own settings (e.g. `llama.LlamaOptions`), from `MODEL_REGISTRY`
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` for EOS ids)."""
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a model directory needs a Hugging Face config.json")
        hf = json.loads(path.read_text())
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in MODEL_REGISTRY), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')!r} in {path}; "
                f"supported: {', '.join(MODEL_REGISTRY)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu'), in {path}")
        num_heads = hf["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=_rope_from_hf(hf, path),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            options=MODEL_REGISTRY[arch].options_from_hf(arch, hf, path),
            eos_token_ids=_eos_ids(model_dir, hf),
        )


def _rope_from_hf(hf: dict, path: Path) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files
    # have `rope_theta` and an optional `rope_scaling`.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES}), in {path}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor is not supported, in {path}")
    fields = {f.name for f in dataclasses.fields(RopeConfig)} - {"theta", "type"}
    return RopeConfig(theta=float(theta), type=rope_type, **{k: v for k, v in params.items() if k in fields})


# generation_config.json's sampling fields that vLLM takes as the model's defaults -> SamplingParams' names
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
HF_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}  # not a choice


def sampling_defaults(model_dir: str | Path, generation_config: str = "auto", overrides: dict | None = None) -> dict:
    """The sampling settings a request gets for the fields it leaves out, as vLLM's
    `--generation-config`: "auto" reads the model's generation_config.json, a directory reads the
    one there, "vllm" none. Only temperature, top_p, top_k, min_p, repetition_penalty and
    max_new_tokens (as max_tokens: a cap on every request's) are taken, and only where they differ
    from transformers' own defaults (as vLLM reads the file: `top_k` 50 is no choice of the model's;
    `do_sample` is not read). `overrides` (vLLM's `override_generation_config`): fields of the
    same names, taken over the file's."""
    unknown = sorted(set(overrides or {}) - set(GENERATION_DEFAULTS))
    if unknown:
        raise ValueError(f"override_generation_config: {', '.join(map(repr, unknown))} not among the fields "
                         f"read, {', '.join(GENERATION_DEFAULTS)}")
    config = {}
    if generation_config != "vllm":
        path = Path(model_dir if generation_config == "auto" else generation_config) / "generation_config.json"
        if generation_config != "auto" and not path.is_file():
            raise FileNotFoundError(f"generation_config={generation_config!r}: {path} not found")
        config = json.loads(path.read_text()) if path.is_file() else {}
        config = {name: value for name, value in config.items()
                  if value is not None and value != HF_GENERATION_DEFAULTS.get(name)}
    config.update(overrides or {})
    return {ours: config[name] for name, ours in GENERATION_DEFAULTS.items() if name in config}


def _eos_ids(model_dir: Path, hf: dict) -> tuple[int, ...]:
    """All EOS ids of generation_config.json, else of config.json."""
    eos = None
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    if eos is None:
        eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


FEW_SEQS_MIN_TOKENS = 64  # steps of at least this many tokens also get a bucket of few sequences
FEW_SEQS_ROWS = 16  # ... of tokens / 16 sequences


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, 4*lo, ... below hi, then hi itself."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


DEFAULT_MAX_MODEL_LEN = 8192  # unless asked for more: long contexts cost cache and compile time
DTYPES = ("float32", "bfloat16")  # what weights, activations and the KV cache can be
# what sampled tokens' logprobs are of (vLLM's --logprobs-mode; see sampling.sample): the model's own
# distribution, or the one the token is drawn from
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
MAX_LOGPROBS = 20  # top logprobs the sampler computes per token (OpenAI's bound; vLLM's default max_logprobs)
ITEMSIZE = {"float32": 4, "bfloat16": 2}


# vLLM's other names for the dtypes: float16 runs as bfloat16 (its range), as in vLLM on CPU and TPU
DTYPE_ALIASES = {"float16": "bfloat16", "half": "bfloat16", "float": "float32"}


def resolve_dtype(dtype: str, model_dir: str | Path) -> str:
    """`dtype` as given (or as DTYPE_ALIASES names it), or for "auto" the checkpoint's own
    (`torch_dtype` in its config.json; `dtype` from transformers 5 on): float32 or bfloat16 as
    stored, float16 as bfloat16, float32 where none is named."""
    if dtype in DTYPE_ALIASES:
        if dtype != "float":
            log.warning("dtype %s: float16 runs as bfloat16 here (as in vLLM on CPU and TPU)", dtype)
        return DTYPE_ALIASES[dtype]
    if dtype != "auto":
        return dtype
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    stored = str(hf.get("torch_dtype") or hf.get("dtype") or "float32").removeprefix("torch.")
    return DTYPE_ALIASES.get(stored, stored if stored in DTYPES else "float32")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Serving limits. `resolve` fills the model-dependent defaults."""

    max_model_len: int  # prompt + generated tokens per sequence
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 512  # tokens per step (the token budget)
    page_size: int = 16  # tokens per KV page
    num_pages: int = 0  # KV pages in the cache, including the null page 0
    dtype: str = "float32"  # weights and activations (DTYPES)
    kv_cache_dtype: str = "auto"  # the KV cache's values: "auto" (= dtype) or one of DTYPES
    seed: int = 0  # draws the seeds of requests that set none
    min_token_bucket: int = 1  # smallest padded step size (see token_buckets)
    kv_cache_bytes: int = 2 << 30  # budget for the default num_pages
    tensor_parallel_size: int = 1  # devices the weights and KV pages are split over
    enable_prefix_caching: bool = True  # reuse the KV pages of earlier prompts with the same prefix
    logprobs_mode: str = "raw_logprobs"  # what logprobs are of (LOGPROBS_MODES, vLLM's names)
    max_logprobs: int = MAX_LOGPROBS  # the most logprobs / prompt_logprobs a request may ask for (vLLM's)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", *DTYPES):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'float32' or 'bfloat16', got {self.kv_cache_dtype!r}"
                             + (" (fp8 KV caches are not supported)" if self.kv_cache_dtype.startswith("fp8") else ""))
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the sampler computes the top "
                             f"{MAX_LOGPROBS} per token), got {self.max_logprobs}")
        if self.min_token_bucket < 1:
            raise ValueError(f"min_token_bucket must be >= 1, got {self.min_token_bucket}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {self.num_pages}")

    @classmethod
    def resolve(cls, model: ModelConfig, *, max_model_len: int | None = None, num_pages: int | None = None,
                **kwargs) -> EngineConfig:
        """Defaults: max_model_len = the model's, capped at DEFAULT_MAX_MODEL_LEN; pages for
        max_num_seqs full-length sequences, capped at `kv_cache_bytes`."""
        if max_model_len is None:
            max_model_len = min(model.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{model.max_position_embeddings}; pass a smaller max_model_len"
            )
        cfg = cls(max_model_len=max_model_len, **kwargs)
        if not num_pages:
            page_bytes = (2 * model.num_layers * cfg.page_size * model.num_kv_heads * model.head_dim
                          * ITEMSIZE[cfg.kv_dtype])
            fit = cfg.kv_cache_bytes // page_bytes
            if fit < 1 + cfg.max_pages_per_seq:
                raise ValueError(
                    f"one {max_model_len}-token sequence needs {cfg.max_pages_per_seq} KV pages of {page_bytes} bytes "
                    f"but kv_cache_bytes={cfg.kv_cache_bytes} holds {fit}; lower max_model_len or set num_pages")
            num_pages = min(1 + cfg.max_num_seqs * cfg.max_pages_per_seq, fit)
        return dataclasses.replace(cfg, num_pages=num_pages, kv_cache_dtype=cfg.kv_dtype)

    @property
    def kv_dtype(self) -> str:
        """The KV cache's value type: `kv_cache_dtype`, or for "auto" the model's `dtype`."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

    @functools.cached_property  # (read twice a step)
    def token_buckets(self) -> tuple[int, ...]:
        """Padded numbers of tokens per step: `min_token_bucket` (1: a lone sequence's decode step),
        4, then powers of two from 16. Below 16 tokens a step costs about the same whatever its size
        (reading the weights dominates)."""
        top = self.max_num_batched_tokens
        small = min(self.min_token_bucket, top)
        return tuple(sorted({small, top, *(b for b in (4, *_powers_of_two(16, top)) if small < b < top)}))

    @functools.cached_property  # (read twice a step)
    def page_buckets(self) -> tuple[int, ...]:
        """Padded page-table widths (pages per sequence), in steps of 4x:
        a wider table costs only attention over masked positions."""
        out, b = [], 4
        while b < self.max_pages_per_seq:
            out.append(b)
            b *= 4
        return tuple(out) + (self.max_pages_per_seq,)

    def seqs_buckets(self, token_bucket: int) -> tuple[int, ...]:
        """Padded numbers of sequences for a step of `token_bucket` tokens T: min(T, max_num_seqs)
        (every sequence brings >= 1 token), and from T = FEW_SEQS_MIN_TOKENS on also T / 16, for a
        step of a few long prompt chunks: it then computes the LM head and the sampler for T / 16
        rows instead of max_num_seqs, and a tiled attention (kernels/paged_attention/tiles.py) cuts
        its chunks into tiles of 16 rows instead of T / max_num_seqs. Smaller steps cost too little
        to pay for more compilations."""
        full, few = min(token_bucket, self.max_num_seqs), token_bucket // FEW_SEQS_ROWS
        return (few, full) if token_bucket >= FEW_SEQS_MIN_TOKENS and few < full else (full,)

    @property
    def step_buckets(self) -> list[tuple[int, int, int]]:
        """Every step shape compiled: (tokens, sequences, page-table width)."""
        return [(t, s, p) for t in self.token_buckets for s in self.seqs_buckets(t) for p in self.page_buckets]


# vLLM's engine options that its scripts and command lines pass and that change nothing in
# jaxserve, with why; `LLM` and run_server.py take them (`check_vllm_options`).
VLLM_NO_EFFECT = {
    "enforce_eager": "there are no CUDA graphs to turn off: XLA compiles every step shape at start-up",
    "enable_chunked_prefill": "prompts are always prefilled in chunks of max_num_batched_tokens (the outputs are the same)",
    "swap_space": "preempted sequences are recomputed, never swapped to host memory",
    "disable_custom_all_reduce": "XLA picks the collectives",
    "distributed_executor_backend": "jaxserve runs one process per host, with no worker processes",
    "disable_log_stats": "the offline LLM logs no stats",
    "download_dir": "hub models go to Hugging Face's own cache (HF_HOME)",
    "hf_token": "hub models are fetched with Hugging Face's own login (HF_TOKEN)",
    "served_model_name": "the offline LLM serves no API",
    "compilation_config": "XLA compiles the steps; there is no torch.compile",
    "max_seq_len_to_capture": "there are no CUDA graphs to capture",
    "async_scheduling": "the next step is always launched before the previous step's tokens are processed",
    "allowed_local_media_path": "the models take text only",
    "max_loras": "LoRA adapters are not supported (enable_lora)",
    "max_lora_rank": "LoRA adapters are not supported (enable_lora)",
}
# vLLM's engine options that jaxserve takes only at the values that leave them off: name -> (those
# values, why); any other value is a ValueError.
VLLM_OFF_ONLY = {
    "quantization": ((None,), "quantized weights are not supported"),
    "revision": ((None, "main"), "models are local directories, without hub revisions"),
    "tokenizer_revision": ((None, "main"), "models are local directories, without hub revisions"),
    "code_revision": ((None, "main"), "models are local directories, without hub revisions"),
    "tokenizer_mode": (("auto", "hf"), "jaxserve reads the Hugging Face tokenizer of the model"),
    "skip_tokenizer_init": ((False,), "prompts and outputs go through the model's tokenizer"),
    "load_format": (("auto", "safetensors"), "weights are read from safetensors files"),
    "hf_overrides": ((None, {}), "the model's config.json is read as it is"),
    "pipeline_parallel_size": ((1,), "pipeline parallelism is not supported (tensor_parallel_size splits the model)"),
    "data_parallel_size": ((1,), "data parallelism is not supported (run one server per replica)"),
    "enable_lora": ((False,), "LoRA adapters are not supported"),
    "cpu_offload_gb": ((0,), "weights are not offloaded to host memory"),
    "kv_cache_memory_bytes": ((None,), "size the KV cache with num_pages or gpu_memory_utilization"),
    "speculative_config": ((None,), "speculative decoding is not supported"),
    "kv_transfer_config": ((None,), "KV cache transfer is not supported"),
    "task": (("auto", "generate"), "jaxserve generates text only"),
    "runner": (("auto", "generate"), "jaxserve generates text only"),
    "convert": (("auto", "none"), "jaxserve generates text only"),
    "mm_processor_kwargs": ((None, {}), "the models take text only"),
    "limit_mm_per_prompt": ((None, {}), "the models take text only"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "scheduling_policy": (("fcfs",), "requests are scheduled first come, first served"),
}


def check_vllm_options(options: dict) -> None:
    """Take vLLM's engine options that change nothing here (VLLM_NO_EFFECT, VLLM_OFF_ONLY at their
    off values); ValueError for one at a value jaxserve cannot honour, TypeError for a name that
    is not vLLM's either (as Python's own for an unknown keyword)."""
    for name, value in options.items():
        if name in VLLM_OFF_ONLY:
            allowed, why = VLLM_OFF_ONLY[name]
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported: {why}")
        elif name not in VLLM_NO_EFFECT:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
