"""vLLM's engine options jaxserve does not take: each is accepted where it changes nothing here, or
refused with why (`VLLM_OPTIONS`), so that a vLLM command line runs or says what to change."""

from __future__ import annotations

import argparse
import dataclasses

from jaxserve.config.fields import flag_name, json_or_text, optional_text

_SWITCH, _ON_OFF = dict(action="store_true"), dict(action=argparse.BooleanOptionalAction)
_INT, _FLOAT, _JSON, _TEXT = dict(type=int), dict(type=float), dict(type=json_or_text), dict(type=optional_text)


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


_NO_REVISIONS = "models are local directories, without hub revisions"


_TEXT_ONLY = "the models take text only"


_GENERATE_ONLY = "jaxserve generates text, or embeds with --runner pooling (no other tasks or conversions)"


_PARTIAL = ("prompts are chunked as the token budget falls, with no count of partial prefills (vLLM's V1 takes only "
            "1 too); long_prefill_token_threshold caps a long prompt's share of a step")


VLLM_OPTIONS = {
    "enforce_eager": VllmOption("there are no CUDA graphs to turn off: steps run step shapes XLA compiled ahead",
                                cli=_SWITCH),
    "enable_chunked_prefill": VllmOption("prompts are always prefilled in chunks of max_num_batched_tokens (the "
                                         "outputs are the same)", cli=_ON_OFF),
    "max_num_partial_prefills": VllmOption(_PARTIAL, (1,), _INT),
    "max_long_partial_prefills": VllmOption(_PARTIAL, (1,), _INT),
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
    "cpu_offload_gb": VllmOption("weights are not offloaded to host memory", (0,), _FLOAT),
    "kv_cache_memory_bytes": VllmOption("size the KV cache with num_pages or gpu_memory_utilization", (None,), _INT),
    "kv_transfer_config": VllmOption("KV cache transfer is not supported", (None,), _JSON),
    "task": VllmOption(_GENERATE_ONLY, ("auto", "generate"), _TEXT),
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
        group.add_argument(flag_name(name), *option.flags, dest=name, default=option.default, help=why,
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
