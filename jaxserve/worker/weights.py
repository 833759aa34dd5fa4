"""A model's weights from its checkpoint: the family's abstract model says what to load, `checkpoints` reads it.
`convert_checkpoint` writes an Orbax copy that loads faster.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from checkpoints import ParamTarget, load_params, quantized_paths, view_file
from checkpoints.gguf import tensor_formats
from checkpoints.orbax_io import convert, is_orbax_dir, saved_formats
from jaxserve.models import MODEL_REGISTRY, abstract_model, quantizable_modules
from jaxserve.models.config import ModelConfig
from jaxserve.worker.sharding import place, weight_sharding
from jaxserve_kernels.matmul.grouped import kept_as_bits
from jaxserve_kernels.matmul import keeps_grouped
from jaxserve_kernels.matmul.quant import can_group, check_quantizable

log = logging.getLogger(__name__)


def flatten(tree: Mapping, prefix: str = "") -> dict[str, object]:
    """{"layers": {0: {"mlp": ...}}} -> {"layers.0.mlp...": leaf}: NNX's pure dict by parameter path
    (a dict already flat stays as it is)."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _unflatten(flat: dict[str, object]) -> dict:
    """The inverse of `flatten` (a list's indices back to ints)."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = [int(k) if k.isdigit() else k for k in path.split(".")]
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def weight_formats(model_dir: str | Path, cfg: ModelConfig, quantization: str | None) -> dict[str, str]:
    """The path of each matrix kept quantized -> its format. An Orbax copy keeps what it was converted
    with by default; a GGUF file decides by default (and for "gguf"): each tensor as its type (`checkpoints.gguf.KEPT_AS`); "none" keeps every matrix in
    floats; "int8" and "int4" quantize every linear layer, and the LM head (tied: the embedding) in
    int8, the part of the model whose errors every logit sees."""
    if is_orbax_dir(model_dir) and quantization is None:
        return saved_formats(model_dir)  # (as it was converted)
    gguf = view_file(model_dir)
    if quantization == "gguf" and gguf is None:
        raise ValueError(f"quantization='gguf' needs a GGUF file, and {model_dir} is not one")
    if quantization in (None, "gguf"):
        return tensor_formats(model_dir, MODEL_REGISTRY[cfg.architecture].hf_name_map) if gguf is not None else {}
    if quantization == "none":
        return {}
    family = MODEL_REGISTRY[cfg.architecture]
    model = abstract_model(cfg, jnp.float32)
    heads = family.tied_head if not cfg.tie_word_embeddings else {"embed_tokens.embedding"}
    formats, skipped = {}, []
    for module_path, module in quantizable_modules(model).items():
        path = f"{module_path}.{module.WEIGHT}"
        if module.WEIGHT == "embedding" and path not in heads:
            continue  # (a lookup reads a few rows: nothing to gain)
        if check_quantizable(getattr(module, module.WEIGHT).shape):
            skipped.append(path)
            continue
        formats[path] = "int8" if path in heads else quantization
    if skipped:
        log.warning("%d matrices stay in floats: their input dimension is not a multiple of the block (%s)",
                    len(skipped), ", ".join(skipped[:3]))
    return formats


def param_target(cfg: ModelConfig, state: nnx.State, mesh: Mesh | None = None,
                 formats: dict[str, str] | None = None) -> ParamTarget:
    """What `checkpoints` loads for the model of `cfg` whose (abstract) state is `state`; with a
    mesh, each weight into its sharding (the family's partition rules, `ModelFamily.rules`: a
    quantized matrix's scales and mins follow its data, split only where their blocks divide over
    the mesh)."""
    family = MODEL_REGISTRY[cfg.architecture]
    formats = formats or {}
    shapes = {path: tuple(leaf.shape) for path, leaf in flatten(nnx.to_pure_dict(state)).items()}
    matrix_of = {part: path for path in formats for part in quantized_paths(path)}

    def sharding(path: str):
        matrix = matrix_of.get(path, path)
        blocks = shapes[quantized_paths(matrix)[1]] if matrix in formats else shapes[path]
        return weight_sharding(mesh, matrix, cfg, family.rules(cfg), blocks)

    return ParamTarget(architecture=cfg.architecture, shapes=shapes, hf_name_map=family.hf_name_map,
                       unused=family.tied_head if cfg.tie_word_embeddings else frozenset(),
                       skipped=family.skipped_tensors,
                       sharding=None if mesh is None else sharding, place=place, formats=formats)


def weight_target(model_dir: str | Path, cfg: ModelConfig, dtype: str, mesh: Mesh | None = None,
                  quantization: str | None = None) -> tuple[nnx.GraphDef, nnx.State, ParamTarget]:
    """The model's graphdef, its abstract state, and what its weights load into (`param_target`:
    matrices kept as `weight_formats` says, each weight into its sharding on `mesh`)."""
    formats = weight_formats(model_dir, cfg, quantization)
    model = abstract_model(cfg, jnp.dtype(dtype), formats)
    state = nnx.state(model)  # (in rows: what the loaders read checkpoints into; `ParamTarget.group`)
    stacks = {path for path, leaf in flatten(nnx.to_pure_dict(state)).items()
              if leaf.ndim == 3 and kept_as_bits(leaf.dtype)}  # (experts' stacks: see `kept_as_bits`)
    target = dataclasses.replace(param_target(cfg, state, mesh, formats), as_bits=frozenset(stacks))
    if keeps_grouped(1 if mesh is None else mesh.size):  # (the tied head too: its lookups read `take_rows`)
        modules = {f"{path}.{module.WEIGHT}": module for path, module in quantizable_modules(model).items()}
        grouped = frozenset(path for path, module in modules.items()
                            if path in formats and can_group(getattr(module, module.WEIGHT).shape))
        model = abstract_model(cfg, jnp.dtype(dtype), formats, grouped)
        target = dataclasses.replace(target, grouped=grouped)
    graphdef, state = nnx.split(model)
    return graphdef, state, target


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype: str, mesh: Mesh | None = None,
                 quantization: str | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's (graphdef, state) with the weights of `model_dir` (HF safetensors, a GGUF view, or
    Orbax made by `convert_checkpoint`) in `dtype`, matrices kept as `weight_formats` says; with a
    mesh, each weight goes straight into its sharding."""
    graphdef, state, target = weight_target(model_dir, cfg, dtype, mesh, quantization)
    nnx.replace_by_pure_dict(state, _unflatten(load_params(model_dir, target, dtype)))
    return graphdef, state


def convert_checkpoint(hf_dir: str | Path, out_dir: str | Path, dtype: str = "float32",
                       quantization: str | None = None) -> Path:
    """Write an Orbax copy of the checkpoint `hf_dir` (weights in `dtype`, matrices kept as
    `weight_formats` says) to `out_dir`."""
    cfg = ModelConfig.from_hf(hf_dir)
    formats = weight_formats(hf_dir, cfg, quantization)
    target = param_target(cfg, nnx.state(abstract_model(cfg, jnp.dtype(dtype), formats)), formats=formats)
    return convert(hf_dir, out_dir, target, dtype)
