"""Model checkpoints: where a model comes from and how its weights become device arrays.

It knows no model: a loader is told what to load by a `ParamTarget` (the parameters' paths and
shapes, the HF name map, their shardings), which the model side builds (`jaxserve.worker.weights`).
"""

from __future__ import annotations

from pathlib import Path

import jax

from checkpoints import builtin
from checkpoints.builtin import DEFAULT_NAME as DEFAULT_MODEL_NAME
from checkpoints.default_model import NAME as OFFLINE_MODEL_NAME
from checkpoints.default_model import default_model_dir
from checkpoints.gguf import load_gguf_params, model_view, view_file
from checkpoints.gguf_file import gguf_file
from checkpoints.hf import load_hf_params
from checkpoints.target import ParamTarget, quantized_paths


def resolve_model(model: str | None) -> Path:
    """The model directory of `model`: a built-in model's name (None: DEFAULT_MODEL_NAME, fetched
    once; OFFLINE_MODEL_NAME, random weights, written locally), a local directory, a GGUF file or a
    directory holding one (a view of it, `checkpoints.gguf`), or a hub id (needs internet)."""
    name = model or DEFAULT_MODEL_NAME
    if name == OFFLINE_MODEL_NAME:
        return default_model_dir()
    if name in builtin.MODELS:
        return model_view(builtin.fetch(name))
    path = Path(name).expanduser()
    if (file := gguf_file(path)) is not None:
        return model_view(file)
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model {model!r} is not a directory (nor a Hugging Face hub id 'org/name')")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*"],
                                     ignore_patterns=["consolidated*"]))
    except Exception as e:  # network or hub errors: all say the same thing to the user
        raise FileNotFoundError(f"model {model!r} is not a local directory and could not be downloaded: {e}") from e


def load_params(model_dir: str | Path, target: ParamTarget, dtype: str) -> dict[str, jax.Array]:
    """The parameters of `target`, by path, from an Orbax directory made by `jaxserve.convert`,
    a view of a GGUF file, or HF safetensors (the matrices `target.grouped` names grouped)."""
    from checkpoints.orbax_io import is_orbax_dir, restore

    if view_file(model_dir) is not None:
        return target.group(load_gguf_params(model_dir, target, dtype))
    if is_orbax_dir(model_dir):
        return target.group(restore(model_dir, target, dtype))
    return target.group(load_hf_params(model_dir, target, dtype))


__all__ = ["DEFAULT_MODEL_NAME", "OFFLINE_MODEL_NAME", "ParamTarget", "default_model_dir", "load_hf_params", "load_params",
           "quantized_paths", "resolve_model", "view_file"]
