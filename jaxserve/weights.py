"""A model's weights from its checkpoint: the family's abstract model says what to load, `checkpoints` reads it.

`param_target` describes the parameters for `checkpoints` (paths and shapes of the abstract model,
the family's HF name map, each weight's sharding on the mesh); `load_weights` fills the model's
(graphdef, state) with what it reads; `convert_checkpoint` writes an Orbax copy that loads faster.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from checkpoints import ParamTarget, load_params
from checkpoints.orbax_io import convert
from jaxserve.config import ModelConfig
from jaxserve.models import MODEL_REGISTRY, abstract_model
from jaxserve.sharding import place, weight_sharding


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"layers": {0: {"mlp": ...}}} -> {"layers.0.mlp...": leaf}: NNX's pure dict by parameter path."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _unflatten(flat: dict[str, object]) -> dict:
    """The inverse of `_flatten` (a list's indices back to ints)."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = [int(k) if k.isdigit() else k for k in path.split(".")]
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def param_target(cfg: ModelConfig, state: nnx.State, mesh: Mesh | None = None) -> ParamTarget:
    """What `checkpoints` loads for the model of `cfg` whose (abstract) state is `state`; with a
    mesh, each weight into its sharding (the family's partition rules)."""
    family = MODEL_REGISTRY[cfg.architecture]
    shapes = {path: tuple(leaf.shape) for path, leaf in _flatten(nnx.to_pure_dict(state)).items()}
    sharding = None if mesh is None else (lambda path: weight_sharding(mesh, path, cfg, family.partition_rules))
    return ParamTarget(architecture=cfg.architecture, shapes=shapes, hf_name_map=family.hf_name_map,
                       unused=family.tied_head if cfg.tie_word_embeddings else frozenset(), sharding=sharding,
                       place=place)


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype: str,
                 mesh: Mesh | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's (graphdef, state) with the weights of `model_dir` (HF safetensors, or Orbax made
    by `convert_checkpoint`) in `dtype`; with a mesh, each weight goes straight into its sharding."""
    graphdef, state = nnx.split(abstract_model(cfg, jnp.dtype(dtype)))
    params = load_params(model_dir, param_target(cfg, state, mesh), dtype)
    nnx.replace_by_pure_dict(state, _unflatten(params))
    return graphdef, state


def convert_checkpoint(hf_dir: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write an Orbax copy of the HF checkpoint `hf_dir` (weights in `dtype`) to `out_dir`."""
    cfg = ModelConfig.from_hf(hf_dir)
    target = param_target(cfg, nnx.state(abstract_model(cfg, jnp.dtype(dtype))))
    return convert(hf_dir, out_dir, target, dtype)
