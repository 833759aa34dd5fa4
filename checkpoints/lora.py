"""LoRA adapters from disk: PEFT's directories and llama.cpp's GGUF adapter files, read into host
arrays by the parameter path of the linear layer each adapts.

An adapter adds scale * B A to a layer's weight W [out, in]: A [r, in], B [out, r], scale
lora_alpha / r (PEFT's rslora: lora_alpha / sqrt(r)). `read_adapter` folds the scale into B, so the
engine adds (x A^T) B^T. Like the rest of `checkpoints`, it knows no model family: the caller gives
the family's Hugging Face name map and the layers that may be adapted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Collection, Mapping
from pathlib import Path

import numpy as np

from checkpoints.gguf import PERMUTED_QK, _param_path, _unpermute
from checkpoints.gguf_file import architecture, gguf_file, metadata, tensors

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
# the PEFT tensor name of one half of an adapted layer: its base layer's HF name, then lora_A / lora_B
PEFT_NAME = re.compile(r"base_model\.model\.(?P<layer>.+)\.lora_(?P<half>[AB])(?:\.default)?\.weight")
GGUF_NAME = re.compile(r"(?P<layer>.+\.weight)\.lora_(?P<half>[ab])")


@dataclasses.dataclass(frozen=True)
class LoraWeights:
    """One adapter as read: per adapted layer (its module path, "layers.0.self_attn.q_proj"), A
    f32[r, in] and B f32[out, r] with the scale folded into B."""

    rank: int
    layers: Mapping[str, tuple[np.ndarray, np.ndarray]]
    base_model_name: str | None = None  # what the adapter was trained on, as its files say


def read_adapter(path: str | Path, hf_name_map: Mapping[str, str], adaptable: Collection[str],
                 heads: tuple[int, int] = (1, 1)) -> LoraWeights:
    """The adapter at `path`: a PEFT directory (adapter_config.json, adapter_model.safetensors) or
    a GGUF adapter file (or a directory holding one). `hf_name_map`: the family's HF tensor name ->
    parameter path; `adaptable`: the module paths that take an adapter; `heads`: the model's query
    and key-value heads (a GGUF file of llama.cpp's Llama layout interleaves B's rows of q and k by
    head, as its base weights', and an adapter file does not say how many). ValueError (saying why) for
    what cannot be served: a missing file, a layer that cannot be adapted, PEFT options that change
    more than the LoRA product."""
    path = Path(path).expanduser()
    gguf = gguf_file(path)
    if gguf is not None:
        return _read_gguf(gguf, hf_name_map, adaptable, heads)
    if not (path / PEFT_CONFIG).is_file():
        raise ValueError(f"no LoRA adapter at {path}: expected a PEFT directory ({PEFT_CONFIG} and {PEFT_WEIGHTS}) "
                         "or a GGUF adapter file")
    return _read_peft(path, hf_name_map, adaptable)


def _read_peft(path: Path, hf_name_map: Mapping[str, str], adaptable: Collection[str]) -> LoraWeights:
    from safetensors.numpy import load_file

    config = json.loads((path / PEFT_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config['peft_type']!r} is not a LoRA adapter")
    for key, off in (("modules_to_save", None), ("bias", "none"), ("use_dora", False)):
        if config.get(key) not in (None, off, []):
            raise ValueError(f"{path}: {key}={config[key]!r} is not supported (only the low-rank products are served)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{path}: per-layer ranks or alphas (rank_pattern, alpha_pattern) are not supported")
    if not (path / PEFT_WEIGHTS).is_file():
        raise ValueError(f"{path}: {PEFT_WEIGHTS} is missing (adapters saved as .bin need torch: save them "
                         "with safe_serialization=True)")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name, value in load_file(path / PEFT_WEIGHTS).items():
        match = PEFT_NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"{path}: tensor {name!r} is not a LoRA A or B matrix (embeddings and other "
                             "trained modules are not supported)")
        hf_name = match["layer"] + ".weight"
        param = next((re.sub(p, to, hf_name) for p, to in hf_name_map.items() if re.fullmatch(p, hf_name)), None)
        module = _module_path(param, hf_name, adaptable, path)
        halves.setdefault(module, {})[match["half"]] = np.asarray(value, np.float32)
    return LoraWeights(rank, _pairs(halves, scale, path), config.get("base_model_name_or_path"))


def _read_gguf(path: Path, hf_name_map: Mapping[str, str], adaptable: Collection[str],
               heads: tuple[int, int]) -> LoraWeights:
    meta = metadata(path)
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise ValueError(f"{path} is not a GGUF LoRA adapter (general.type 'adapter', adapter.type 'lora')")
    arch = architecture(path)
    halves: dict[str, dict[str, np.ndarray]] = {}
    for tensor in tensors(path):
        match = GGUF_NAME.fullmatch(tensor.name)
        if match is None:
            raise ValueError(f"{path}: tensor {tensor.name!r} is not a LoRA A or B matrix")
        if tensor.tensor_type.name not in ("F32", "F16"):
            raise ValueError(f"{path}: tensor {tensor.name!r} is of type {tensor.tensor_type.name} (F32 or F16 only)")
        param = _param_path(match["layer"], hf_name_map, arch)
        if param is None:
            raise ValueError(f"{path}: tensor {tensor.name!r} is not a layer of a {arch} model")
        value = np.asarray(tensor.data, np.float32)
        if match["half"] == "b" and arch in PERMUTED_QK and re.search(r"attn_[qk]\.", tensor.name):
            value = _unpermute(value, heads[0] if ".attn_q." in tensor.name else heads[1])
        module = _module_path(param, tensor.name, adaptable, path)
        halves.setdefault(module, {})[match["half"].upper()] = value
    ranks = {a.shape[0] for pair in halves.values() for half, a in pair.items() if half == "A"}
    if len(ranks) != 1:
        raise ValueError(f"{path}: its layers have ranks {sorted(ranks)}; one rank per adapter is supported")
    rank = ranks.pop()
    alpha = float(meta.get("adapter.lora.alpha") or rank)  # (llama.cpp: no alpha means a scale of 1)
    return LoraWeights(rank, _pairs(halves, alpha / rank, path), meta.get("general.base_model.0.name"))


def _module_path(param: str | None, name: str, adaptable: Collection[str], path: Path) -> str:
    """The module path of the layer whose weight's parameter path is `param` (the file's `name` for it)."""
    module = param.rpartition(".")[0] if param is not None and param.endswith(".weight") else None
    if module not in adaptable:
        raise ValueError(f"{path}: an adapter of {name} is not supported; adapted layers must be among "
                         "the attention's q/k/v/o and the MLP's gate/up/down projections (not a fused or an "
                         "expert's one)")
    return module


def _pairs(halves: dict[str, dict[str, np.ndarray]], scale: float, path: Path) -> dict:
    pairs = {}
    for module, half in halves.items():
        if set(half) != {"A", "B"}:
            raise ValueError(f"{path}: layer {module} has lora_{'B' if 'A' in half else 'A'} missing")
        a, b = half["A"], half["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{path}: layer {module}: A {a.shape} and B {b.shape} are not a LoRA pair")
        pairs[module] = (a, b * np.float32(scale))
    if not pairs:
        raise ValueError(f"{path}: the adapter adapts no layer")
    return pairs
