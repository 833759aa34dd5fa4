"""Hugging Face safetensors checkpoints -> the model's parameters.

Tensors are read straight from the safetensors files as numpy arrays (memory
mapped); no PyTorch model is ever built. Each HF name is mapped to a parameter path
by the model's name map (`ParamTarget.hf_name_map`; the models keep HF's [out, in]
layout, so nothing is transposed), checked against the expected shape and cast to the
requested dtype.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import jax
from safetensors import safe_open

from checkpoints.target import ParamTarget

# Buffers some exporters leave in the file; they are recomputed, not loaded.
IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")


def hf_to_state_path(name: str, hf_name_map: Mapping[str, str]) -> str | None:
    """HF tensor name -> parameter path, or None if unknown. A base model's checkpoint (an HF
    `*Model` class, e.g. an embedding model's) names its tensors without the "model." prefix."""
    for candidate in (name, f"model.{name}"):
        for pattern, path in hf_name_map.items():
            if re.fullmatch(pattern, candidate):
                return re.sub(pattern, path, candidate)
    return None


def state_path_of(name: str, target: ParamTarget, source: str) -> str | None:
    """The parameter path the tensor `name` loads into; None for one the model leaves out (a tied
    head, a buffer recomputed, a part read past such as a vision tower); ValueError for one it has no
    place for (`source` names it)."""
    if IGNORED.fullmatch(name) or (target.skipped and re.fullmatch(target.skipped, name)):
        return None
    path = hf_to_state_path(name, target.hf_name_map)
    if path is None:
        raise ValueError(f"unexpected tensor {source} for a {target.architecture} checkpoint")
    if not target.fits(path):
        if path in target.unused:
            return None
        raise ValueError(f"tensor {source} does not fit this {target.architecture} config")
    return path


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists files that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {model_dir}; PyTorch .bin checkpoints are not supported "
            "(re-save with save_pretrained(..., safe_serialization=True))"
        )
    return files


def load_hf_params(model_dir: str | Path, target: ParamTarget, dtype: str) -> dict[str, jax.Array]:
    """Every tensor of the checkpoint, by parameter path, in `dtype`; with a sharding, each goes
    straight into it (each device receives only its shard)."""
    model_dir = Path(model_dir)
    loaded: dict[str, jax.Array] = {}
    for file in safetensors_files(model_dir):
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                path = state_path_of(name, target, source=f"{name!r} in {file}")
                if path is None:
                    continue
                target.put(loaded, path, f.get_tensor(name), dtype, source=f"{name!r} in {file}")
    target.check_complete(loaded, model_dir)
    return loaded
