"""Orbax checkpoints: convert a Hugging Face checkpoint once, restore it straight into a mesh.

A converted directory holds `params/` (the decoder state, saved by Orbax, one array per
weight), the HF `config.json`, `generation_config.json` and tokenizer files (so it is
a model directory like any other), and `jaxserve_orbax.json` (what made it).
Restoring reads each array directly into its sharding (no full copy on one device).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from checkpoints.hf import _flatten, _unflatten, load_hf_params
from jaxserve.config import ModelConfig
from jaxserve.model import abstract_decoder
from jaxserve.sharding import weight_sharding

MARKER = "jaxserve_orbax.json"
FORMAT = 2  # 2: linear weights [out, in] under `.weight` (1 stored them [in, out] under `.kernel`)
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
          "special_tokens_map.json", "chat_template.jinja", "README.md")


def is_orbax_dir(model_dir: str | Path) -> bool:
    return (Path(model_dir) / MARKER).is_file()


def convert(hf_dir: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write an Orbax checkpoint of the HF checkpoint `hf_dir` (weights in `dtype`) to `out_dir`."""
    import orbax.checkpoint as ocp

    hf_dir, out_dir = Path(hf_dir), Path(out_dir).resolve()
    cfg = ModelConfig.from_hf(hf_dir)
    with jax.default_device(jax.devices("cpu")[0]):  # host memory, not one accelerator's
        _, state = load_hf_params(hf_dir, cfg, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    flat = {path.replace(".", "/"): value for path, value in _flatten(nnx.to_pure_dict(state)).items()}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out_dir / "params", flat, force=True)
    checkpointer.wait_until_finished()
    for name in COPIED:
        if (hf_dir / name).is_file():
            shutil.copy(hf_dir / name, out_dir / name)
    (out_dir / MARKER).write_text(json.dumps({"source": str(hf_dir), "dtype": dtype, "format": FORMAT}, indent=2))
    return out_dir


def restore(model_dir: str | Path, cfg: ModelConfig, dtype: str,
            mesh: Mesh | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """The decoder's (graphdef, state) from a converted directory, each array in `dtype` and its sharding."""
    import orbax.checkpoint as ocp

    made = json.loads((Path(model_dir) / MARKER).read_text())
    if made.get("format", 1) != FORMAT:
        raise ValueError(f"{model_dir} was converted by an older jaxserve (format {made.get('format', 1)}, this one "
                         f"reads {FORMAT}); convert it again: python -m checkpoints.convert --model "
                         f"{made.get('source', 'HF_DIR')} --out {model_dir}")
    graphdef, state = nnx.split(abstract_decoder(cfg, jnp.dtype(dtype)))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {path.replace(".", "/"): jax.ShapeDtypeStruct(
        leaf.shape, jnp.dtype(dtype), sharding=weight_sharding(mesh, path, cfg) if mesh is not None else device)
        for path, leaf in _flatten(nnx.to_pure_dict(state)).items()}
    restored = ocp.StandardCheckpointer().restore(Path(model_dir).resolve() / "params", target)
    nnx.replace_by_pure_dict(state, _unflatten({k.replace("/", "."): v for k, v in restored.items()}))
    return graphdef, state
