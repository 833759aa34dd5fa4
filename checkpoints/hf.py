"""Hugging Face safetensors checkpoints -> the decoder's NNX state.

Tensors are read straight from the safetensors files as numpy arrays (memory
mapped); no PyTorch model is ever built. Each HF name is mapped to a path in
the decoder's state by `HF_NAME_MAP` (the decoder keeps HF's [out, in] layout, so
nothing is transposed), checked against the expected shape and cast to the requested dtype.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open

from jaxserve.config import ModelConfig
from jaxserve.model import abstract_decoder
from jaxserve.sharding import place, weight_sharding

# (HF name pattern, decoder state path)
HF_NAME_MAP = [
    (r"model\.embed_tokens\.weight", r"embed_tokens.embedding"),
    (r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.weight", r"layers.\1.\2.\3.weight"),
    (r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.bias", r"layers.\1.\2.\3.bias"),
    (r"model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)\.weight", r"layers.\1.self_attn.\2.weight"),
    (r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight", r"layers.\1.\2.weight"),
    (r"model\.norm\.weight", r"norm.weight"),
    (r"lm_head\.weight", r"lm_head.weight"),
]
# Buffers some exporters leave in the file; they are recomputed, not loaded.
IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")


def hf_to_state_path(name: str) -> str | None:
    """HF tensor name -> decoder state path, or None if unknown."""
    for pattern, path in HF_NAME_MAP:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, path, name)
    return None


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


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _unflatten(flat: dict[str, object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = [int(k) if k.isdigit() else k for k in path.split(".")]
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def load_hf_params(model_dir: str | Path, cfg: ModelConfig, dtype: str,
                   mesh: Mesh | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """Read every tensor of the checkpoint into the decoder's (graphdef, state), in `dtype`;
    with a mesh, each goes straight into its sharding (each device receives only its shard)."""
    model_dir = Path(model_dir)
    graphdef, state = nnx.split(abstract_decoder(cfg, jnp.dtype(dtype)))
    expected = _flatten(nnx.to_pure_dict(state))  # path -> ShapeDtypeStruct
    loaded: dict[str, object] = {}
    for file in safetensors_files(model_dir):
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                if IGNORED.fullmatch(name):
                    continue
                path = hf_to_state_path(name)
                if path is None:
                    raise ValueError(f"unexpected tensor {name!r} in {file} for a {cfg.architecture} checkpoint")
                if path not in expected:
                    if path == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # tied: the head is the embedding
                    raise ValueError(f"tensor {name!r} in {file} does not fit this {cfg.architecture} config")
                array = f.get_tensor(name)
                want = tuple(expected[path].shape)
                if array.shape != want:
                    raise ValueError(f"tensor {name!r} in {file} has shape {tuple(array.shape)}, expected {want} "
                                     "from config.json")
                array = np.ascontiguousarray(array).astype(jnp.dtype(dtype), copy=False)
                loaded[path] = place(array, weight_sharding(mesh, path, cfg)) if mesh is not None \
                    else jnp.asarray(array)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]} (decoder paths)")
    nnx.replace_by_pure_dict(state, _unflatten(loaded))
    return graphdef, state
