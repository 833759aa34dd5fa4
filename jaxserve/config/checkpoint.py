"""What the engine reads from a checkpoint's own files: the sampling defaults of its
generation_config.json (vLLM's `--generation-config`) and its dtype; and how its weights may be kept."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


# generation_config.json's sampling fields that vLLM takes as the model's defaults -> SamplingParams' names
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


HF_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}  # not a choice


def sampling_defaults(model_dir: str | Path, generation_config: str = "auto", overrides: dict | None = None) -> dict:
    """The sampling settings a request gets for the fields it leaves out, as vLLM's
    `--generation-config`: "auto" reads the model's generation_config.json, a directory reads the
    one there, "vllm" none. Only GENERATION_DEFAULTS are taken (max_new_tokens: a cap on every
    request's), and only where they differ from transformers' own defaults (as vLLM reads the file:
    `top_k` 50 is no choice of the model's; `do_sample` is not read). `overrides` (vLLM's
    `override_generation_config`): fields of the same names, taken over the file's."""
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


DTYPES = ("float32", "bfloat16")  # what weights, activations and the KV cache can be
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


# how weights may be kept (`EngineConfig.quantization`): formats of jaxserve_kernels.matmul.quant, a GGUF
# file's own types, or floats
QUANTIZATIONS = ("int8", "int4", "gguf", "none")


def quantization_flag(text: str) -> str | None:
    """--quantization's value: vLLM's scripts pass "None" for the default."""
    return None if text == "None" else text
