"""Model checkpoints: where a model comes from and how its weights become device arrays.

It knows no model: a loader is told what to load by a `ParamTarget` (the parameters' paths and
shapes, the HF name map, their shardings), which the model side builds (`jaxserve.weights`).
"""

from __future__ import annotations

from pathlib import Path

import jax

from checkpoints.default_model import NAME as DEFAULT_MODEL_NAME
from checkpoints.default_model import default_model_dir
from checkpoints.hf import load_hf_params
from checkpoints.target import ParamTarget


def resolve_model(model: str | None) -> Path:
    """A local directory, the built-in default (None or "jaxserve-tiny"), or a hub id (needs internet)."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return default_model_dir()
    path = Path(model).expanduser()
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
    or from HF safetensors."""
    from checkpoints.orbax_io import is_orbax_dir, restore

    if is_orbax_dir(model_dir):
        return restore(model_dir, target, dtype)
    return load_hf_params(model_dir, target, dtype)


__all__ = ["DEFAULT_MODEL_NAME", "ParamTarget", "default_model_dir", "load_hf_params", "load_params", "resolve_model"]
