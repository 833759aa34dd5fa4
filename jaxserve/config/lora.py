"""LoRA adapters as requests name them: vLLM's `LoRARequest`, and the `--lora-modules` entries a
server starts with (`lora_module`). Reading an adapter's files is the worker's (`jaxserve.worker.lora`)."""

from __future__ import annotations

import argparse
import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`): its name, an id
    unique among the adapters an engine serves (> 0: what the engine's caches know it by; a new
    adapter under an old name needs a new id), and its files (a PEFT directory or a GGUF adapter)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # the model /v1/models gives as its parent (default: the served one)

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a lora_path")

    # vLLM's shorter names
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


@dataclasses.dataclass(frozen=True)
class LoraModule:
    """A `--lora-modules` entry: an adapter served from the start under `name`."""

    name: str
    path: str
    base_model_name: str | None = None


def lora_module(value: str) -> LoraModule:
    """An argparse type, vLLM's two forms: name=path, or JSON {"name", "path", "base_model_name"}."""
    if value.lstrip().startswith("{"):
        try:
            entry = json.loads(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: {value!r} is not valid JSON: {e}") from e
        unknown = set(entry) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str):
            raise argparse.ArgumentTypeError(f'--lora-modules: expected {{"name": ..., "path": ..., '
                                             f'"base_model_name": ...}}, got {value!r}')
        return LoraModule(entry["name"], entry["path"], entry.get("base_model_name"))
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: expected name=path or a JSON object, got {value!r}")
    return LoraModule(name, path)
